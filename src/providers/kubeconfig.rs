//! Kubeconfigs from outside input (files, Secrets, CLIs): parsing and building, with errors
//! that say where and what kind of problem, and never copy a byte of the kubeconfig.
//!
//! A kubeconfig holds tokens, client keys and passwords, and the line a parser trips over is
//! as likely as any other to be one of them. The errors of the libraries underneath quote
//! what they read: serde's "invalid type: string \"…\"", the YAML parser's source snippet,
//! an exec plugin's output, base64's offending byte. Those texts go to logs and to Events
//! that anyone with `view` on a namespace can read, so none of them is passed on: every
//! error is mapped here to fixed words, a position, a field path or a count.

use kube::config::{KubeconfigError, LoadDataError};

/// A short stand-in for one version of some input (a kubeconfig's bytes, a problem), to
/// tell whether it changed and to report a version once, without keeping it.
pub(crate) fn version_of(value: &impl std::hash::Hash) -> u64 {
    use std::hash::Hasher;
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    value.hash(&mut hasher);
    hasher.finish()
}

/// The version of a parsed kubeconfig (or any serializable value), the same for equal
/// contents however their maps are ordered: an exec plugin's `env` entries are each a map
/// of their own, whose iteration order differs from one parse to the next, and a version
/// that changes with it would rebuild the cluster (and run its plugin) at every read.
pub(crate) fn canonical_version_of(value: &impl serde::Serialize) -> u64 {
    use std::hash::{Hash, Hasher};
    fn feed(value: &serde_json::Value, hasher: &mut impl Hasher) {
        use serde_json::Value as V;
        match value {
            V::Null => 0u8.hash(hasher),
            V::Bool(b) => (1u8, b).hash(hasher),
            V::Number(n) => (2u8, n.to_string()).hash(hasher),
            V::String(s) => (3u8, s).hash(hasher),
            V::Array(items) => {
                (4u8, items.len()).hash(hasher);
                items.iter().for_each(|item| feed(item, hasher));
            }
            V::Object(map) => {
                (5u8, map.len()).hash(hasher);
                let mut entries: Vec<_> = map.iter().collect();
                entries.sort_unstable_by(|a, b| a.0.cmp(b.0));
                for (key, value) in entries {
                    key.hash(hasher);
                    feed(value, hasher);
                }
            }
        }
    }
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    match serde_json::to_value(value) {
        Ok(value) => feed(&value, &mut hasher),
        Err(_) => 6u8.hash(&mut hasher),
    }
    hasher.finish()
}

/// Parses `text` (YAML or JSON, one or more documents, merged like kubectl does).
pub(crate) fn parse(text: &str) -> Result<kube::config::Kubeconfig, String> {
    kube::config::Kubeconfig::from_yaml(text).map_err(|e| describe(&e))
}

/// What is wrong, in words that hold nothing of the kubeconfig.
pub(crate) fn describe(error: &KubeconfigError) -> String {
    match error {
        KubeconfigError::Parse(e) => describe_syntax(e),
        KubeconfigError::CurrentContextNotSet => "no current-context is set".into(),
        KubeconfigError::KindMismatch | KubeconfigError::ApiVersionMismatch => {
            "its documents differ in kind or apiVersion and cannot be merged".into()
        }
        KubeconfigError::LoadContext(_) => "the context is not defined".into(),
        KubeconfigError::LoadClusterOfContext(_) => {
            "the cluster the context names is not defined".into()
        }
        KubeconfigError::FindPath => "no kubeconfig path".into(),
        KubeconfigError::ReadConfig(e, _) => format!("cannot read the kubeconfig ({})", e.kind()),
        KubeconfigError::MissingClusterUrl => "the cluster has no server".into(),
        KubeconfigError::ParseClusterUrl(_) => "the cluster's server is not a valid URL".into(),
        KubeconfigError::ParseProxyUrl(_) => "the cluster's proxy-url is not a valid URL".into(),
        KubeconfigError::LoadCertificateAuthority(e) => describe_data("certificate-authority", e),
        KubeconfigError::LoadClientCertificate(e) => describe_data("client-certificate", e),
        KubeconfigError::LoadClientKey(e) => describe_data("client-key", e),
        KubeconfigError::ParseCertificates(_) => {
            "certificate-authority: not PEM-encoded certificates".into()
        }
        // Variants behind kube features this crate does not enable (another crate in the
        // build may).
        #[allow(unreachable_patterns)]
        _ => "unusable kubeconfig".into(),
    }
}

fn describe_data(field: &str, error: &LoadDataError) -> String {
    match error {
        LoadDataError::DecodeBase64(_) => format!("{field}-data: not valid base64"),
        LoadDataError::ReadFile(e, _) => {
            format!("{field}: cannot read the file it names ({})", e.kind())
        }
        LoadDataError::NoBase64DataOrFile => format!("{field}: neither data nor a file"),
    }
}

/// A syntax or schema error: its kind and position. (The parser's own message and snippet
/// quote the text.)
fn describe_syntax(error: &serde_saphyr::Error) -> String {
    use serde_saphyr::Error as E;
    let mut inner = error;
    while let E::WithSnippet { error, .. } | E::AliasError { error, .. } = inner {
        inner = error;
    }
    let kind = match inner {
        E::Eof { .. } => "the text ends before the document does".to_string(),
        E::InvalidUtf8Input => "not UTF-8".to_string(),
        E::ExternalMessage { .. }
        | E::IndentationError { .. }
        | E::ContainerEndMismatch { .. }
        | E::UnexpectedSequenceEnd { .. }
        | E::UnexpectedMappingEnd { .. }
        | E::UnexpectedContainerEndWhileReadingKeyNode { .. }
        | E::UnexpectedContainerEndWhileSkippingNode { .. }
        | E::FoldedBlockScalarMustIndentContent { .. } => "not valid YAML or JSON".to_string(),
        E::SerdeMissingField { field, .. } if KNOWN_FIELDS.contains(field) => {
            format!("the required field {field} is missing")
        }
        E::SerdeMissingField { .. } => "a required field is missing".to_string(),
        E::DuplicateMappingKey { .. } => "a key appears twice in one mapping".to_string(),
        E::UnknownAnchor { .. } => "an alias names an anchor that is not defined".to_string(),
        E::AliasReplayCounterOverflow { .. }
        | E::AliasReplayLimitExceeded { .. }
        | E::AliasExpansionLimitExceeded { .. }
        | E::AliasReplayStackDepthExceeded { .. }
        | E::Budget { .. } => {
            "it exceeds the parser's limits (aliases, nesting or size)".to_string()
        }
        _ => "a value does not fit the kubeconfig schema".to_string(),
    };
    match error.location() {
        Some(at) if at.line() > 0 => {
            format!(
                "not a kubeconfig: {kind} (line {}, column {})",
                at.line(),
                at.column()
            )
        }
        _ => format!("not a kubeconfig: {kind}"),
    }
}

/// The kubeconfig fields serde may report missing by name (names of the schema, not of
/// the text).
const KNOWN_FIELDS: &[&str] = &[
    "name", "cluster", "user", "context", "clusters", "users", "contexts",
];

pub(crate) use crate::client::describe_client;

#[cfg(test)]
mod tests {
    use super::*;

    const MARKER: &str = "tok3n-MARKER-5ecret";

    #[test]
    fn a_kubeconfig_parsed_again_has_the_same_version_whatever_its_maps_order() {
        let text = "apiVersion: v1\nkind: Config\nusers:\n- name: u\n  user:\n    exec:\n      apiVersion: client.authentication.k8s.io/v1\n      command: plugin\n      env:\n      - {name: A, value: a}\n      - {name: B, value: b}\n      - {name: C, value: c}\n";
        let first = canonical_version_of(&parse(text).unwrap());
        for _ in 0..20 {
            assert_eq!(canonical_version_of(&parse(text).unwrap()), first);
        }
        let changed = text.replace("value: c", "value: d");
        assert_ne!(canonical_version_of(&parse(&changed).unwrap()), first);
    }

    #[test]
    fn a_broken_line_holding_a_secret_is_reported_by_position_only() {
        let yaml = format!(
            "apiVersion: v1\nkind: Config\nusers:\n- name: u\n  user:\n    token: \"{MARKER}\n    oops: [\n"
        );
        let error = parse(&yaml).unwrap_err();
        assert!(!error.contains(MARKER), "{error}");
        assert!(error.contains("line "), "{error}");

        // A value of the wrong type: serde would quote it.
        let yaml = format!("apiVersion: v1\nkind: Config\nusers: {MARKER}\n");
        let error = parse(&yaml).unwrap_err();
        assert!(!error.contains(MARKER), "{error}");
        assert!(error.contains("line 3"), "{error}");

        let json = format!(
            r#"{{"apiVersion": "v1", "users": [{{"name": "u", "user": {{"token": "{MARKER}" "oops"}}}}]}}"#
        );
        let error = parse(&json).unwrap_err();
        assert!(!error.contains(MARKER), "{error}");
        assert!(error.contains("line 1"), "{error}");
    }

    #[test]
    fn a_missing_field_is_named_when_it_is_one_of_the_schema() {
        let error = parse("contexts:\n- context: {cluster: c, user: u}\n").unwrap_err();
        assert!(
            error.contains("the required field name is missing"),
            "{error}"
        );
    }
}
