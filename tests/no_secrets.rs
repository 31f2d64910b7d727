//! The grep-level rule behind "nothing secret in logs or Events", checked over the crate's
//! sources (`src/`) and examples: no `Display` or `Debug` of a kube authentication error, a
//! `kube::Config`, an `AuthInfo`, an `ExecConfig` or a `Kubeconfig` may reach a log line, an
//! Event, an error string or a metric.
//!
//! Three rules, each a pattern over the text (test modules excepted):
//! 1. **format**: a value named like a credential holder (`config`, `kubeconfig`,
//!    `auth_info`, `auth`, `exec`, `exec_config`, `credentials`) formatted in a macro: `{config:?}`,
//!    `{config}`, `?config` / `%config` in a tracing macro, or passed after a format string.
//! 2. **derive**: `#[derive(Debug)]` on a type holding a `kube::Config`, `AuthInfo`,
//!    `ExecConfig`, `Kubeconfig` or `AuthError`.
//! 3. **construct**: a call that can fail with kube's authentication error (it runs an exec
//!    plugin): `Client::try_from`, `ClientBuilder::try_from`, `Client::try_default`,
//!    `.auth_layer()`. Its error must pass through the crate's redaction.
//!
//! A line that is right in spite of a pattern says so with `secrets-lint: <why>` on it or on
//! the line above; the reason is read in review. What the rules do not see: an error value
//! (`%error`) whose type carries a kube authentication error. Those are redacted where they
//! arise (every cluster's client layer) or shown through `Shown` where the client is a plain
//! `kube::Client` of the user's. The rules are tested on planted lines below,
//! so a rule that can no longer fail is noticed.

use std::path::{Path, PathBuf};

use regex::Regex;

/// The names credential holders go by in this code base.
const HOLDERS: &str = "config|kubeconfig|auth_info|auth|exec|exec_config|credentials";

struct Rules {
    inline: Regex,
    tracing: Regex,
    positional: Regex,
    derive: Regex,
    holder_type: Regex,
    construct: Regex,
    redacted: Regex,
}

impl Rules {
    fn new() -> Self {
        Rules {
            // "{config:?}", "{self.config}" is not Rust syntax; "{config}" and "{config:#?}".
            inline: Regex::new(&format!(r#"\{{({HOLDERS})(:[#?]*\??)?\}}"#)).unwrap(),
            // tracing's shorthand and named fields: `?config`, `%self.config`, `x = ?exec`, with
            // nothing read from the holder after it (`%config.cluster_url` is the URL).
            tracing: Regex::new(&format!(
                r"[?%]\s*(?:[a-z_]+\.)*({HOLDERS})\b\s*(?:[,)]|$)"
            ))
            .unwrap(),
            // A format string's positional argument: `format!("{:?}", config)`.
            positional: Regex::new(&format!(
                r#""\s*,\s*(?:.*,\s*)?&?(?:[a-z_]+\.)*({HOLDERS})\s*[,)]"#
            ))
            .unwrap(),
            derive: Regex::new(r"#\[derive\([^)]*\bDebug\b").unwrap(),
            // In a type's place (after `:`, `(`, `<`, `,` or `&`), not a variant's name.
            holder_type: Regex::new(
                r"[:(<,&]\s*(?:kube::Config|(?:[a-z_]+::)*(?:AuthInfo|ExecConfig|Kubeconfig|AuthError))\b",
            )
            .unwrap(),
            construct: Regex::new(
                r"Client::try_from\(|ClientBuilder::try_from\(|Client::try_default\(|\.auth_layer\(\)",
            )
            .unwrap(),
            // The error mapped on the same line by the crate's redaction.
            redacted: Regex::new(r"map_err\((?:[a-z_]+::)*redact_(?:kube|boxed)\)").unwrap(),
        }
    }

    /// The problems of one file's text, as `line: rule`.
    fn check(&self, text: &str) -> Vec<String> {
        let lines: Vec<&str> = text.lines().collect();
        // Test modules may print what they like.
        let end = lines
            .windows(2)
            .position(|w| w[0].trim() == "#[cfg(test)]" && w[1].trim_start().starts_with("mod "))
            .unwrap_or(lines.len());
        let allowed = |i: usize| {
            lines[i].contains("secrets-lint:") || (i > 0 && lines[i - 1].contains("secrets-lint:"))
        };
        let mut problems = Vec::new();
        let mut in_macro = 0i32;
        for (i, line) in lines[..end].iter().enumerate() {
            let code = line.split("//").next().unwrap_or(line);
            let trimmed = line.trim_start();
            if trimmed.starts_with("//") {
                continue;
            }
            let formats = in_macro > 0 || is_format_macro(code);
            if is_format_macro(code) {
                in_macro = 0;
            }
            if formats || code.contains("#[error(") {
                for rule in [&self.inline, &self.tracing, &self.positional] {
                    if let Some(m) = rule.find(code)
                        && !allowed(i)
                    {
                        problems.push(format!("{}: format: `{}`", i + 1, m.as_str().trim()));
                        break;
                    }
                }
            }
            // Format macros span lines: follow the parentheses.
            if formats {
                in_macro += code.matches('(').count() as i32 - code.matches(')').count() as i32;
                if in_macro < 0 {
                    in_macro = 0;
                }
            }
            if self.construct.is_match(code) && !self.redacted.is_match(code) && !allowed(i) {
                problems.push(format!("{}: construct: `{}`", i + 1, code.trim()));
            }
            if self.derive.is_match(code) && !allowed(i) {
                // The type's body: up to its closing brace (or semicolon) at depth 0.
                let mut depth = 0i32;
                'body: for (j, body) in lines[i + 1..end].iter().enumerate() {
                    let body = body.split("//").next().unwrap_or(body);
                    if self.holder_type.is_match(body) && depth > 0 {
                        problems.push(format!(
                            "{}: derive: Debug of a type holding `{}` (line {})",
                            i + 1,
                            self.holder_type.find(body).unwrap().as_str(),
                            i + j + 2
                        ));
                        break;
                    }
                    for c in body.chars() {
                        match c {
                            '{' | '(' => depth += 1,
                            '}' | ')' => {
                                depth -= 1;
                                if depth == 0 {
                                    break 'body;
                                }
                            }
                            ';' if depth == 0 => break 'body,
                            _ => {}
                        }
                    }
                }
            }
        }
        problems
    }
}

/// Whether a line opens a macro whose arguments end up as text: logs, format strings,
/// panics and errors.
fn is_format_macro(code: &str) -> bool {
    const MACROS: [&str; 12] = [
        "trace!(",
        "debug!(",
        "info!(",
        "warn!(",
        "error!(",
        "format!(",
        "write!(",
        "writeln!(",
        "panic!(",
        "print!(",
        "println!(",
        "eprintln!(",
    ];
    MACROS.iter().any(|m| code.contains(m)) || code.contains("format_args!(")
}

fn sources() -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    for dir in ["src", "examples", "testenv/src"] {
        walk(&root.join(dir), &mut files);
    }
    files.sort();
    files
}

#[test]
fn no_credential_holder_or_auth_error_is_formatted_derived_or_left_unredacted() {
    let rules = Rules::new();
    let files = sources();
    assert!(files.len() > 50, "the sources are found: {files:?}");
    let mut problems = Vec::new();
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        for problem in rules.check(&text) {
            problems.push(format!("{}:{problem}", file.display()));
        }
    }
    assert!(
        problems.is_empty(),
        "credential holders or auth errors may reach text:\n{}",
        problems.join("\n")
    );
}

#[test]
fn each_rule_catches_its_planted_line_and_passes_its_fixed_one() {
    let rules = Rules::new();
    let caught = |text: &str| !rules.check(text).is_empty();
    for bad in [
        r#"tracing::warn!(cluster = %id, ?config, "built");"#,
        r#"tracing::warn!(%exec, "plugin");"#,
        "tracing::debug!(\n    cluster = %id,\n    auth = ?self.auth_info,\n    \"user\"\n);",
        r#"let text = format!("{config:?}");"#,
        r#"let text = format!("{:?} at {}", config, server);"#,
        r#"return Err(format!("refused: {}", kubeconfig));"#,
        "#[error(\"cannot build: {auth}\")]",
        "#[derive(Clone, Debug)]\nstruct Holder {\n    config: kube::Config,\n}",
        "#[derive(Debug)]\nenum Failure {\n    Auth(kube::client::AuthError),\n}",
        "#[derive(Debug)]\nstruct Holder {\n    users: Vec<AuthInfo>,\n}",
        "let client = kube::Client::try_from(config)?;",
        "let layer = config.auth_layer()?;",
        "let client = Client::try_default().await?;",
        "let client = Client::try_from(config)?; // redacted later",
    ] {
        assert!(caught(bad), "not caught: {bad}");
    }
    for good in [
        r#"tracing::warn!(server = %config.cluster_url, "built");"#,
        r#"let text = format!("{} at {}", name, config.cluster_url);"#,
        "#[derive(Clone, Debug)]\nstruct Settings {\n    qps: f64,\n}\nstruct Holder {\n    config: kube::Config,\n}",
        "let client = kube::Client::try_from(config).map_err(redact_kube)?;",
        "#[derive(Debug)]\nenum Error {\n    /// From a kube::Config.\n    Kubeconfig { cluster: String },\n}",
        "// secrets-lint: the error is described by describe_client\nlet layer = config.auth_layer()?;",
        "#[cfg(test)]\nmod tests {\n    fn f() { println!(\"{config:?}\"); }\n}",
        "// tracing::warn!(?config) in a comment",
    ] {
        assert!(!caught(good), "caught: {good}: {:?}", rules.check(good));
    }
}
