//! The book (`docs/`, an mdBook): every chapter is listed in `SUMMARY.md` and every file it
//! lists exists, and every link between chapters reaches an existing file and, if it names
//! one, an existing heading (mdBook's anchors). Its code samples are doctests of the crates.

use std::collections::BTreeSet;
use std::path::{Component, Path, PathBuf};

fn docs() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("docs")
}

/// Every Markdown file under `dir`, relative to it.
fn markdown_files(dir: &Path, base: &Path, out: &mut BTreeSet<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            markdown_files(&path, base, out);
        } else if path.extension().is_some_and(|e| e == "md") {
            out.insert(path.strip_prefix(base).unwrap().to_path_buf());
        }
    }
}

/// The targets of the inline links `[text](target)` in `text`, outside code.
fn links(text: &str) -> Vec<String> {
    let mut found = Vec::new();
    let mut in_fence = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            in_fence = !in_fence;
            continue;
        }
        if in_fence {
            continue;
        }
        // Inline code spans are not links.
        let mut plain = String::new();
        for (i, part) in line.split('`').enumerate() {
            if i % 2 == 0 {
                plain.push_str(part);
            }
        }
        let mut rest = plain.as_str();
        while let Some(start) = rest.find("](") {
            let after = &rest[start + 2..];
            let Some(end) = after.find(')') else { break };
            found.push(after[..end].trim().to_string());
            rest = &after[end..];
        }
    }
    found
}

/// mdBook's anchor of a heading: lower case, spaces to dashes, other punctuation dropped.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// The anchors of `text`'s headings.
fn anchors(text: &str) -> BTreeSet<String> {
    let mut in_fence = false;
    let mut out = BTreeSet::new();
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            in_fence = !in_fence;
        } else if !in_fence && line.starts_with('#') {
            let title = line.trim_start_matches('#').replace('`', "");
            out.insert(anchor(&title));
        }
    }
    out
}

/// `path` with `.` and `..` resolved, without touching the file system.
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for part in path.components() {
        match part {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
}

#[test]
fn every_chapter_is_in_the_summary_and_every_listed_chapter_exists() {
    let docs = docs();
    let summary = std::fs::read_to_string(docs.join("SUMMARY.md")).unwrap();
    let listed: BTreeSet<PathBuf> = links(&summary).iter().map(PathBuf::from).collect();
    let mut files = BTreeSet::new();
    markdown_files(&docs, &docs, &mut files);
    files.remove(Path::new("SUMMARY.md"));
    let missing: Vec<_> = listed.difference(&files).collect();
    assert!(missing.is_empty(), "listed but not written: {missing:?}");
    let unlisted: Vec<_> = files.difference(&listed).collect();
    assert!(
        unlisted.is_empty(),
        "written but not in SUMMARY.md: {unlisted:?}"
    );
}

#[test]
fn every_link_between_chapters_reaches_a_file_and_heading() {
    let docs = docs();
    let mut files = BTreeSet::new();
    markdown_files(&docs, &docs, &mut files);
    let mut broken = Vec::new();
    for file in &files {
        let text = std::fs::read_to_string(docs.join(file)).unwrap();
        for target in links(&text) {
            if target.starts_with("http://")
                || target.starts_with("https://")
                || target.starts_with("mailto:")
            {
                continue;
            }
            let (path, fragment) = match target.split_once('#') {
                Some((path, fragment)) => (path, Some(fragment)),
                None => (target.as_str(), None),
            };
            let resolved = if path.is_empty() {
                file.clone()
            } else {
                normalize(&file.parent().unwrap_or(Path::new("")).join(path))
            };
            if resolved.starts_with("..") || !docs.join(&resolved).is_file() {
                broken.push(format!(
                    "{}: {target} (no such chapter in docs/)",
                    file.display()
                ));
                continue;
            }
            if let Some(fragment) = fragment {
                let target_text = std::fs::read_to_string(docs.join(&resolved)).unwrap();
                if !anchors(&target_text).contains(fragment) {
                    broken.push(format!("{}: {target} (no such heading)", file.display()));
                }
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn anchors_follow_mdbook() {
    assert_eq!(
        anchor("Cluster identity (KEP-2149)"),
        "cluster-identity-kep-2149"
    );
    assert_eq!(anchor("The `Provider` trait"), "the-provider-trait");
    assert_eq!(
        links("see [a](x.md#y) and `[b](not.md)`\n```\n[c](no.md)\n```"),
        ["x.md#y"]
    );
}

/// Every string literal of the crate's sources (`src/`): plain, byte and raw strings, with
/// escapes and line continuations resolved; comments and character literals skipped.
fn source_literals() -> Vec<String> {
    fn walk(dir: &Path, out: &mut Vec<String>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(std::fs::read_to_string(&path).unwrap());
            }
        }
    }
    let mut sources = Vec::new();
    walk(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("src"),
        &mut sources,
    );
    let mut literals = Vec::new();
    for source in &sources {
        literals.extend(literals_of(source));
    }
    literals
}

/// The string literals of one Rust source text.
fn literals_of(source: &str) -> Vec<String> {
    let chars: Vec<char> = source.chars().collect();
    let mut literals = Vec::new();
    let mut i = 0;
    let ident = |c: char| c.is_alphanumeric() || c == '_';
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        if c == '/' && next == Some('/') {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            i += 2;
            while i + 1 < chars.len() && !(chars[i] == '*' && chars[i + 1] == '/') {
                i += 1;
            }
            i += 2;
        } else if c == '\'' {
            // A character literal ('x', '\n', '"'), or a lifetime ('a).
            if next == Some('\\') {
                i += 2;
                while i < chars.len() && chars[i] != '\'' {
                    i += 1;
                }
                i += 1;
            } else if chars.get(i + 2) == Some(&'\'') {
                i += 3;
            } else {
                i += 1;
            }
        } else if c == 'r' && (i == 0 || !ident(chars[i - 1])) && matches!(next, Some('"' | '#')) {
            let mut hashes = 0;
            let mut j = i + 1;
            while chars.get(j) == Some(&'#') {
                hashes += 1;
                j += 1;
            }
            if chars.get(j) != Some(&'"') {
                i += 1;
                continue;
            }
            j += 1;
            let start = j;
            loop {
                if j >= chars.len() {
                    break;
                }
                if chars[j] == '"' && (1..=hashes).all(|k| chars.get(j + k) == Some(&'#')) {
                    break;
                }
                j += 1;
            }
            literals.push(chars[start..j.min(chars.len())].iter().collect());
            i = j + 1 + hashes;
        } else if c == '"' {
            let mut text = String::new();
            i += 1;
            while i < chars.len() && chars[i] != '"' {
                if chars[i] == '\\' {
                    match chars.get(i + 1) {
                        Some('\n') => {
                            i += 2;
                            while i < chars.len() && chars[i].is_whitespace() {
                                i += 1;
                            }
                            continue;
                        }
                        Some('n') => text.push('\n'),
                        Some('t') => text.push('\t'),
                        Some(other) => text.push(*other),
                        None => {}
                    }
                    i += 2;
                    continue;
                }
                text.push(chars[i]);
                i += 1;
            }
            literals.push(text);
            i += 1;
        } else {
            i += 1;
        }
    }
    literals
}

#[test]
fn literals_are_read_as_rust_reads_them() {
    let source = r##"let a = "plain \"quoted\" \
        continued"; // "a comment"
let c = '"'; let l: &'static str = r#"raw "inner""#; /* "block" */ let b = b"bytes";"##;
    assert_eq!(
        literals_of(source),
        ["plain \"quoted\" continued", "raw \"inner\"", "bytes"]
    );
}

/// The book quotes the crate's messages in ```` ```text,quote ```` blocks, one per line, with
/// `{name}` for the parts that vary (docs/troubleshooting.md). Each line is one of the crate's
/// string literals, whole, the placeholders standing for anything (the literal's own format
/// arguments among them): a reworded message cannot leave its quote behind.
#[test]
fn the_books_quoted_messages_are_the_crates_own() {
    let literals = source_literals();
    let placeholder = regex::Regex::new(r"\{[^{}]*\}").unwrap();
    let mut files = BTreeSet::new();
    markdown_files(&docs(), &docs(), &mut files);
    let mut checked = 0;
    let mut missing = Vec::new();
    for file in &files {
        let text = std::fs::read_to_string(docs().join(file)).unwrap();
        let mut in_quote = false;
        for line in text.lines() {
            if line.trim() == "```text,quote" {
                in_quote = true;
                continue;
            }
            if in_quote && line.trim() == "```" {
                in_quote = false;
                continue;
            }
            if !in_quote {
                continue;
            }
            let pattern = placeholder
                .split(line)
                .map(regex::escape)
                .collect::<Vec<_>>()
                .join(".*?");
            let whole = regex::Regex::new(&format!("^{pattern}$")).unwrap();
            let letters = placeholder
                .replace_all(line, "")
                .chars()
                .filter(char::is_ascii_alphabetic)
                .count();
            assert!(
                letters >= 2,
                "{}: the quote {line:?} has no words of its own to check",
                file.display()
            );
            if !literals
                .iter()
                .any(|literal| whole.is_match(literal.trim_end_matches('\n')))
            {
                missing.push(format!("{}: {line:?}", file.display()));
            }
            checked += 1;
        }
    }
    assert!(
        missing.is_empty(),
        "quoted lines that are no string literal of src/:\n{}",
        missing.join("\n")
    );
    // The troubleshooting chapter alone quotes more than this.
    assert!(checked >= 50, "only {checked} quoted lines found");
}

/// mdBook's `{{#include FILE:ANCHOR}}` (docs/providers.md takes its provider from an example
/// that CI runs): the file exists and has the anchor's start and end.
#[test]
fn included_files_and_anchors_exist() {
    let mut files = BTreeSet::new();
    markdown_files(&docs(), &docs(), &mut files);
    let include = regex::Regex::new(r"\{\{#include ([^}:]+)(?::([^}]+))?\}\}").unwrap();
    let mut seen = 0;
    for file in &files {
        let text = std::fs::read_to_string(docs().join(file)).unwrap();
        let dir = docs().join(file).parent().unwrap().to_path_buf();
        for found in include.captures_iter(&text) {
            let target = dir.join(&found[1]);
            let content = std::fs::read_to_string(&target)
                .unwrap_or_else(|e| panic!("{}: cannot read {}: {e}", file.display(), &found[1]));
            // A line range (`FILE:10:20`) names no anchor.
            if let Some(anchor) = found
                .get(2)
                .filter(|a| !a.as_str().chars().all(|c| c.is_ascii_digit() || c == ':'))
            {
                let anchor = anchor.as_str();
                for mark in [format!("ANCHOR: {anchor}"), format!("ANCHOR_END: {anchor}")] {
                    assert!(
                        content
                            .lines()
                            .any(|l| l.trim_start().trim_start_matches("//").trim() == mark),
                        "{}: {} has no line {mark}",
                        file.display(),
                        &found[1]
                    );
                }
            }
            seen += 1;
        }
    }
    assert!(seen >= 1, "no include found: the check checks nothing");
}
