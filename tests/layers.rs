//! The crate's floors, kept: every path into the crate (`crate::…`, `super::…`, `self::…`, a
//! child module's name) in `src/` is resolved to the module that defines the item it names,
//! following re-exports (the root's and every folder's), and the edge between the two
//! top-level modules must point down the floor order of `FLOORS`. Test code (`#[cfg(test)]`
//! items) is left out: a unit test may build whatever it needs.
//!
//! Two more rules keep the graph honest:
//! - inside the crate nothing names an item through the root (`use crate::Cluster`): the
//!   root's re-exports are the public face, and an import through them hides its real edge;
//! - every top-level module has a floor: a new one is placed in `FLOORS` when it is added.
//!
//! The checker is tested on planted trees below, so a rule that can no longer fail is noticed.
//! `MCR_LAYERS_PRINT=1 cargo test --test layers -- --nocapture` prints the whole graph.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Top-level modules by floor, lowest first. A module may import from a lower floor only;
/// modules on one floor stand beside each other and import nothing of each other.
const FLOORS: &[&[&str]] = &[
    &["util"],
    &["telemetry"],
    &["metrics"],
    &["client"],
    &["cache"],
    &["cluster"],
    &["fleet", "lease", "diagnostics"],
    &["run", "provider"],
    &["ownership", "bootstrap"],
    &["controller", "providers"],
    &["serve"],
    &["webhook", "shard"],
    &["manager"],
    &["builder"],
    &["fuzzing"],
];

#[test]
fn every_import_of_the_crate_points_down_its_floors() {
    let files = read_tree(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"));
    let crate_ = Crate::parse(&files);
    if std::env::var_os("MCR_LAYERS_PRINT").is_some() {
        for ((from, to), evidence) in crate_.edges() {
            println!("{from} -> {to}   ({})", evidence.join(", "));
        }
    }
    let faults = crate_.faults(FLOORS);
    assert!(
        faults.is_empty(),
        "{} import(s) against the floors (lowest first: {}):\n{}",
        faults.len(),
        FLOORS
            .iter()
            .map(|f| f.join(" "))
            .collect::<Vec<_>>()
            .join(" < "),
        faults.join("\n")
    );
}

/// `(path relative to src/, text)` of every `.rs` file under `dir`.
fn read_tree(dir: &Path) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).expect("src/ is readable") {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let rel = path
                    .strip_prefix(dir)
                    .expect("under src/")
                    .to_string_lossy()
                    .replace('\\', "/");
                out.push((rel, std::fs::read_to_string(&path).expect("a source file")));
            }
        }
    }
    out.sort();
    out
}

/// The module path of a file: `cluster/mod.rs` and `cluster.rs` are `cluster`, `lib.rs` is
/// the root (empty).
fn module_of(rel: &str) -> String {
    let rel = rel.trim_end_matches(".rs");
    let rel = rel.strip_suffix("/mod").unwrap_or(rel);
    if rel == "lib" || rel == "main" {
        return String::new();
    }
    rel.replace('/', "::")
}

fn join(module: &str, name: &str) -> String {
    if module.is_empty() {
        name.to_string()
    } else {
        format!("{module}::{name}")
    }
}

fn top(module: &str) -> &str {
    module.split("::").next().unwrap_or("")
}

/// One `use` leaf: the path as written (segments) and the name it binds (`None` for a glob).
#[derive(Debug, Clone)]
struct UseLeaf {
    path: Vec<String>,
    binds: Option<String>,
}

#[derive(Default)]
struct Module {
    /// Names of the items defined here (types, functions, constants, macros, …).
    defs: BTreeSet<String>,
    /// Re-exports: bound name → path as written.
    reexports: BTreeMap<String, Vec<String>>,
    /// Every path into the crate this module names (as written, in `use` or in code).
    paths: Vec<Vec<String>>,
}

struct Crate {
    modules: BTreeMap<String, Module>,
}

impl Crate {
    fn parse(files: &[(String, String)]) -> Crate {
        let mut modules = BTreeMap::new();
        for (rel, text) in files {
            let module = module_of(rel);
            let code = without_tests(&strip_comments_and_strings(text));
            modules.insert(module, parse_module(&code));
        }
        Crate { modules }
    }

    fn is_module(&self, m: &str) -> bool {
        self.modules.contains_key(m)
    }

    /// The absolute form of a path written in `module`, or `None` for a path outside the
    /// crate (another crate, a prelude name, a generic parameter).
    fn absolute(&self, module: &str, path: &[String]) -> Option<Vec<String>> {
        let first = path.first()?;
        let mut base: Vec<String> = if module.is_empty() {
            Vec::new()
        } else {
            module.split("::").map(str::to_string).collect()
        };
        let rest = match first.as_str() {
            "crate" | "$crate" => {
                base.clear();
                &path[1..]
            }
            "self" => &path[1..],
            "super" => {
                let mut rest = path;
                while rest.first().map(String::as_str) == Some("super") {
                    base.pop()?;
                    rest = &rest[1..];
                }
                rest
            }
            name => {
                let m = self.modules.get(module)?;
                if self.is_module(&join(module, name)) || m.defs.contains(name) {
                    path
                } else {
                    return None;
                }
            }
        };
        base.extend(rest.iter().cloned());
        Some(base)
    }

    /// The module that defines the item an absolute path names, following re-exports.
    fn defining(&self, path: &[String], depth: usize) -> Option<String> {
        if depth > 16 {
            return None;
        }
        let mut module = String::new();
        for (i, seg) in path.iter().enumerate() {
            if seg == "self" {
                continue;
            }
            let child = join(&module, seg);
            if self.is_module(&child) {
                module = child;
                continue;
            }
            let m = self.modules.get(&module)?;
            if let Some(target) = m.reexports.get(seg) {
                let mut target = self.absolute(&module, target)?;
                target.extend(path[i + 1..].iter().cloned());
                return self.defining(&target, depth + 1);
            }
            return Some(module);
        }
        Some(module)
    }

    /// Top-level edges with the paths that make them, test code excepted.
    fn edges(&self) -> BTreeMap<(String, String), Vec<String>> {
        let mut edges: BTreeMap<(String, String), Vec<String>> = BTreeMap::new();
        for (module, m) in &self.modules {
            if module.is_empty() {
                continue;
            }
            for path in &m.paths {
                let Some(abs) = self.absolute(module, path) else {
                    continue;
                };
                let Some(def) = self.defining(&abs, 0) else {
                    continue;
                };
                let (from, to) = (top(module), top(&def));
                if from != to && !to.is_empty() {
                    let list = edges.entry((from.to_string(), to.to_string())).or_default();
                    let evidence = format!("{module}: {}", path.join("::"));
                    if !list.contains(&evidence) {
                        list.push(evidence);
                    }
                }
            }
        }
        edges
    }

    fn faults(&self, floors: &[&[&str]]) -> Vec<String> {
        let floor_of = |name: &str| floors.iter().position(|f| f.contains(&name));
        let mut faults = Vec::new();
        for module in self.modules.keys() {
            let t = top(module);
            if !t.is_empty() && module == t && floor_of(t).is_none() {
                faults.push(format!("module `{t}` has no floor in FLOORS"));
            }
        }
        for ((from, to), evidence) in self.edges() {
            let (Some(a), Some(b)) = (floor_of(&from), floor_of(&to)) else {
                continue;
            };
            if a <= b {
                let why = if a == b { "beside it" } else { "above it" };
                faults.push(format!(
                    "`{from}` imports `{to}`, which stands {why}: {}",
                    evidence.join("; ")
                ));
            }
        }
        // Through the root: `crate::Name` where `Name` is no module of the root.
        for (module, m) in &self.modules {
            if module.is_empty() {
                continue;
            }
            for path in &m.paths {
                let Some(abs) = self.absolute(module, path) else {
                    continue;
                };
                if let Some(first) = abs.first()
                    && !self.is_module(first)
                    && self.modules[""].reexports.contains_key(first)
                {
                    faults.push(format!(
                        "{module} names `{}` through the root: import it from the module that defines it",
                        abs.join("::")
                    ));
                }
            }
        }
        faults.sort();
        faults.dedup();
        faults
    }
}

/// Comments and the contents of string and character literals blanked (newlines kept).
fn strip_comments_and_strings(text: &str) -> String {
    let b: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        let next = b.get(i + 1).copied();
        if c == '/' && next == Some('/') {
            while i < b.len() && b[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            let mut depth = 0;
            while i < b.len() {
                if b[i] == '/' && b.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if b[i] == '*' && b.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    if b[i] == '\n' {
                        out.push('\n');
                    }
                    i += 1;
                }
            }
        } else if c == 'r' && (next == Some('#') || next == Some('"')) && !ident_before(&b, i) {
            // A raw string: r"…", r#"…"#.
            let mut j = i + 1;
            let mut hashes = 0;
            while b.get(j) == Some(&'#') {
                hashes += 1;
                j += 1;
            }
            if b.get(j) != Some(&'"') {
                out.push(c);
                i += 1;
                continue;
            }
            j += 1;
            loop {
                if j >= b.len() {
                    break;
                }
                if b[j] == '"' && (0..hashes).all(|h| b.get(j + 1 + h) == Some(&'#')) {
                    j += 1 + hashes;
                    break;
                }
                if b[j] == '\n' {
                    out.push('\n');
                }
                j += 1;
            }
            out.push_str("\"\"");
            i = j;
        } else if c == '"' {
            i += 1;
            while i < b.len() && b[i] != '"' {
                if b[i] == '\\' {
                    i += 1;
                }
                if b.get(i) == Some(&'\n') {
                    out.push('\n');
                }
                i += 1;
            }
            i += 1;
            out.push_str("\"\"");
        } else if c == '\'' {
            // A character literal ('a', '\n', '\u{..}') or a lifetime ('a).
            if b.get(i + 2) == Some(&'\'') && next != Some('\\') {
                out.push_str("' '");
                i += 3;
            } else if next == Some('\\') {
                let mut j = i + 2;
                while j < b.len() && b[j] != '\'' {
                    j += 1;
                }
                out.push_str("' '");
                i = j + 1;
            } else {
                out.push(c);
                i += 1;
            }
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

fn ident_before(b: &[char], i: usize) -> bool {
    i > 0 && (b[i - 1].is_alphanumeric() || b[i - 1] == '_')
}

/// The text without the items under `#[cfg(test)]`.
fn without_tests(code: &str) -> String {
    let mut out = String::with_capacity(code.len());
    let mut rest = code;
    while let Some(at) = rest.find("#[cfg(test)]") {
        out.push_str(&rest[..at]);
        let after = &rest[at + "#[cfg(test)]".len()..];
        // The item ends at its first `;` outside braces, or where its first brace closes.
        let mut depth = 0usize;
        let mut end = after.len();
        for (i, c) in after.char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth = depth.saturating_sub(1);
                    if depth == 0 {
                        end = i + 1;
                        break;
                    }
                }
                ';' if depth == 0 => {
                    end = i + 1;
                    break;
                }
                _ => {}
            }
        }
        rest = &after[end..];
    }
    out.push_str(rest);
    out
}

fn tokens(code: &str) -> Vec<String> {
    let mut out = Vec::new();
    let b: Vec<char> = code.chars().collect();
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c.is_alphanumeric() || c == '_' || c == '$' {
            let start = i;
            while i < b.len() && (b[i].is_alphanumeric() || b[i] == '_' || b[i] == '$') {
                i += 1;
            }
            // `r#type`: a raw identifier.
            out.push(b[start..i].iter().collect());
        } else if c == ':' && b.get(i + 1) == Some(&':') {
            out.push("::".to_string());
            i += 2;
        } else if c.is_whitespace() {
            i += 1;
        } else {
            out.push(c.to_string());
            i += 1;
        }
    }
    out
}

fn is_ident(t: &str) -> bool {
    t.chars()
        .next()
        .is_some_and(|c| c.is_alphabetic() || c == '_' || c == '$')
}

const ITEM_KEYWORDS: &[&str] = &[
    "struct", "enum", "trait", "fn", "type", "const", "static", "union", "mod",
];

fn parse_module(code: &str) -> Module {
    let t = tokens(code);
    let mut m = Module::default();
    let mut i = 0;
    while i < t.len() {
        let tok = t[i].as_str();
        if tok == "use" && (i == 0 || !matches!(t[i - 1].as_str(), "::" | ".")) {
            let public = i > 0 && (t[i - 1] == "pub" || t[i - 1] == ")");
            let mut j = i + 1;
            let mut leaves = Vec::new();
            parse_use_tree(&t, &mut j, &[], &mut leaves);
            for leaf in leaves {
                if public && let Some(name) = &leaf.binds {
                    m.reexports.insert(name.clone(), leaf.path.clone());
                }
                m.paths.push(leaf.path);
            }
            i = j;
            continue;
        }
        if ITEM_KEYWORDS.contains(&tok)
            && let Some(name) = t.get(i + 1)
            && is_ident(name)
            && (i == 0 || t[i - 1] != "::")
        {
            m.defs.insert(name.clone());
        }
        if tok == "macro_rules"
            && t.get(i + 1).map(String::as_str) == Some("!")
            && let Some(name) = t.get(i + 2)
        {
            m.defs.insert(name.clone());
        }
        if matches!(tok, "crate" | "$crate" | "super")
            && t.get(i + 1).map(String::as_str) == Some("::")
            && (i == 0 || t[i - 1] != "::")
        {
            let mut path = vec![tok.to_string()];
            let mut j = i + 1;
            while t.get(j).map(String::as_str) == Some("::")
                && let Some(seg) = t.get(j + 1)
                && is_ident(seg)
            {
                path.push(seg.clone());
                j += 2;
            }
            m.paths.push(path);
            i = j;
            continue;
        }
        i += 1;
    }
    m
}

/// Parses a use tree from `t[*j]` up to its `;` (or the `,`/`}` that ends a nested tree).
fn parse_use_tree(t: &[String], j: &mut usize, prefix: &[String], out: &mut Vec<UseLeaf>) {
    let mut path = prefix.to_vec();
    if t.get(*j).map(String::as_str) == Some("::") {
        *j += 1;
    }
    while let Some(tok) = t.get(*j) {
        match tok.as_str() {
            "{" => {
                *j += 1;
                loop {
                    match t.get(*j).map(String::as_str) {
                        None => return,
                        Some("}") => {
                            *j += 1;
                            break;
                        }
                        Some(",") => *j += 1,
                        _ => {
                            let inner = path.clone();
                            parse_use_tree(t, j, &inner, out);
                        }
                    }
                }
                return;
            }
            "*" => {
                *j += 1;
                out.push(UseLeaf { path, binds: None });
                return;
            }
            "::" => *j += 1,
            ";" | "," | "}" => {
                if *t.get(*j).unwrap() == ";" {
                    *j += 1;
                }
                push_leaf(path, None, out);
                return;
            }
            "as" => {
                let alias = t.get(*j + 1).cloned();
                *j += 2;
                push_leaf(path, alias, out);
                if t.get(*j).map(String::as_str) == Some(";") {
                    *j += 1;
                }
                return;
            }
            seg => {
                path.push(seg.to_string());
                *j += 1;
            }
        }
    }
}

fn push_leaf(mut path: Vec<String>, alias: Option<String>, out: &mut Vec<UseLeaf>) {
    // `use a::b::{self}` binds `b`.
    if path.last().map(String::as_str) == Some("self") && path.len() > 1 {
        path.pop();
    }
    let binds = alias.or_else(|| path.last().cloned());
    if binds.as_deref() == Some("_") {
        out.push(UseLeaf { path, binds: None });
    } else {
        out.push(UseLeaf { path, binds });
    }
}

// The checker on planted trees: a rule that can no longer fail is noticed.

fn planted(files: &[(&str, &str)]) -> Vec<String> {
    let files: Vec<(String, String)> = files
        .iter()
        .map(|(p, t)| (p.to_string(), t.to_string()))
        .collect();
    Crate::parse(&files).faults(&[&["util"], &["cache", "client"], &["cluster"]])
}

const ROOT: &str = "mod util; mod cache; mod client; mod cluster;\n\
                    pub use cluster::Cluster;\npub use cache::Store;\n";

#[test]
fn an_import_down_the_floors_passes() {
    let faults = planted(&[
        ("lib.rs", ROOT),
        ("util.rs", "pub(crate) fn lock() {}"),
        (
            "cache/mod.rs",
            "mod store;\npub use store::Store;\nuse crate::util::lock;",
        ),
        ("cache/store.rs", "pub struct Store;"),
        ("client.rs", "pub fn send() { crate::util::lock() }"),
        (
            "cluster.rs",
            "use crate::cache::{Store, self};\npub struct Cluster(Store);\n\
             fn f() { crate::client::send() }",
        ),
    ]);
    assert_eq!(faults, Vec::<String>::new());
}

#[test]
fn an_import_up_the_floors_fails_also_through_a_re_export() {
    let faults = planted(&[
        ("lib.rs", ROOT),
        ("util.rs", "pub(crate) fn lock() {}"),
        ("cache/mod.rs", "mod store;\npub use store::Store;"),
        // Up, written through the cache's own re-export of the cluster's type.
        (
            "cache/store.rs",
            "pub struct Store;\npub(crate) use crate::cluster::Cluster;",
        ),
        ("client.rs", "use crate::cache::store::Cluster;"),
        ("cluster.rs", "pub struct Cluster;"),
    ]);
    assert_eq!(faults.len(), 2, "{faults:#?}");
    assert!(faults[0].starts_with("`cache` imports `cluster`, which stands above it"));
    assert!(faults[1].starts_with("`client` imports `cluster`, which stands above it"));
}

#[test]
fn modules_on_one_floor_import_nothing_of_each_other() {
    let faults = planted(&[
        ("lib.rs", ROOT),
        ("util.rs", ""),
        ("cache.rs", "pub struct Store;"),
        ("client.rs", "fn f(_: super::cache::Store) {}"),
        ("cluster.rs", ""),
    ]);
    assert_eq!(faults.len(), 1, "{faults:#?}");
    assert!(faults[0].starts_with("`client` imports `cache`, which stands beside it"));
}

#[test]
fn a_name_through_the_root_and_a_module_without_a_floor_fail() {
    let faults = planted(&[
        (
            "lib.rs",
            "mod util; mod cache; mod cluster; mod extra;\npub use cache::Store;",
        ),
        ("util.rs", ""),
        ("cache.rs", "pub struct Store;"),
        ("cluster.rs", "use crate::Store;"),
        ("extra.rs", ""),
    ]);
    assert_eq!(faults.len(), 2, "{faults:#?}");
    assert!(faults[0].contains("cluster names `Store` through the root"));
    assert_eq!(faults[1], "module `extra` has no floor in FLOORS");
}

#[test]
fn test_code_and_comments_are_left_out() {
    let faults = planted(&[
        ("lib.rs", ROOT),
        (
            "util.rs",
            "// crate::cluster::Cluster\n/// [`x`](crate::cluster::Cluster)\nfn f() {}",
        ),
        (
            "cache.rs",
            "#[cfg(test)]\nmod tests {\n use crate::cluster::Cluster;\n}\n",
        ),
        (
            "client.rs",
            "fn f() -> &'static str { \"crate::cluster::Cluster\" }",
        ),
        ("cluster.rs", "pub struct Cluster;"),
    ]);
    assert_eq!(faults, Vec::<String>::new());
}
