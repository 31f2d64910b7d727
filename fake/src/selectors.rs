//! Label and field selectors, parsed as the API server parses them.

use serde_json::Value;

/// One requirement of a label selector.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Requirement {
    Equals(String, String),
    NotEquals(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    DoesNotExist(String),
}

/// A parsed `labelSelector`; the empty selector selects everything.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct LabelSelector(Vec<Requirement>);

impl LabelSelector {
    /// Parses `a=b,c!=d,e in (f,g),h notin (i),j,!k`.
    pub(crate) fn parse(text: &str) -> Result<Self, String> {
        let mut requirements = Vec::new();
        let mut rest = text.trim();
        while !rest.is_empty() {
            let (requirement, after) = parse_requirement(rest)?;
            requirements.push(requirement);
            rest = after.trim_start();
            if let Some(after) = rest.strip_prefix(',') {
                rest = after.trim_start();
                if rest.is_empty() {
                    return Err(format!("found '', expected: identifier in {text:?}"));
                }
            } else if !rest.is_empty() {
                return Err(format!(
                    "found '{}', expected: ',' or 'end of string'",
                    rest.chars().next().unwrap_or(' ')
                ));
            }
        }
        Ok(LabelSelector(requirements))
    }

    /// Whether `labels` (an object's `metadata.labels`, or nothing) satisfies every requirement.
    pub(crate) fn matches(&self, labels: Option<&serde_json::Map<String, Value>>) -> bool {
        let get = |k: &str| labels.and_then(|l| l.get(k)).and_then(Value::as_str);
        self.0.iter().all(|r| match r {
            Requirement::Equals(k, v) => get(k) == Some(v.as_str()),
            Requirement::NotEquals(k, v) => get(k) != Some(v.as_str()),
            Requirement::In(k, vs) => get(k).is_some_and(|x| vs.iter().any(|v| v == x)),
            Requirement::NotIn(k, vs) => get(k).is_none_or(|x| vs.iter().all(|v| v != x)),
            Requirement::Exists(k) => get(k).is_some(),
            Requirement::DoesNotExist(k) => get(k).is_none(),
        })
    }
}

fn is_key_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/')
}

fn take_key(text: &str) -> Result<(String, &str), String> {
    let end = text.find(|c: char| !is_key_char(c)).unwrap_or(text.len());
    if end == 0 {
        return Err(format!(
            "found '{}', expected: identifier",
            text.chars().next().unwrap_or(' ')
        ));
    }
    let key = &text[..end];
    validate_key(key)?;
    Ok((key.to_owned(), &text[end..]))
}

fn validate_key(key: &str) -> Result<(), String> {
    let (prefix, name) = key
        .rsplit_once('/')
        .map_or((None, key), |(p, n)| (Some(p), n));
    let name_ok = !name.is_empty()
        && name.len() <= 63
        && name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name.ends_with(|c: char| c.is_ascii_alphanumeric());
    let prefix_ok = prefix
        .is_none_or(|p| !p.is_empty() && p.len() <= 253 && !p.contains('/') && !p.contains('_'));
    if name_ok && prefix_ok {
        Ok(())
    } else {
        Err(format!("invalid label key {key:?}"))
    }
}

fn take_value(text: &str) -> (String, &str) {
    let end = text
        .find(|c: char| !is_key_char(c) || c == '/')
        .unwrap_or(text.len());
    (text[..end].to_owned(), &text[end..])
}

fn parse_requirement(text: &str) -> Result<(Requirement, &str), String> {
    if let Some(rest) = text.strip_prefix('!') {
        let (key, rest) = take_key(rest.trim_start())?;
        return Ok((Requirement::DoesNotExist(key), rest));
    }
    let (key, rest) = take_key(text)?;
    let rest = rest.trim_start();
    if let Some(r) = rest.strip_prefix("==").or_else(|| rest.strip_prefix('=')) {
        let (value, r) = take_value(r.trim_start());
        return Ok((Requirement::Equals(key, value), r));
    }
    if let Some(r) = rest.strip_prefix("!=") {
        let (value, r) = take_value(r.trim_start());
        return Ok((Requirement::NotEquals(key, value), r));
    }
    for (word, notin) in [("in", false), ("notin", true)] {
        if let Some(r) = rest
            .strip_prefix(word)
            .filter(|r| r.trim_start().starts_with('('))
        {
            let r = r.trim_start()[1..].trim_start();
            if r.is_empty() {
                return Err("found '', expected: ',', ')' or identifier".to_owned());
            }
            let close = r
                .find(')')
                .ok_or_else(|| "found 'end of string', expected: ')'".to_owned())?;
            let values: Vec<String> = r[..close].split(',').map(|v| v.trim().to_owned()).collect();
            if values.iter().all(String::is_empty) && values.len() == 1 {
                return Err("for 'in', 'notin' operators, values set can't be empty".to_owned());
            }
            let requirement = if notin {
                Requirement::NotIn(key, values)
            } else {
                Requirement::In(key, values)
            };
            return Ok((requirement, &r[close + 1..]));
        }
    }
    Ok((Requirement::Exists(key), rest))
}

/// A parsed `fieldSelector`: `field=value` and `field!=value` terms.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct FieldSelector(Vec<(String, bool, String)>);

impl FieldSelector {
    /// Parses the selector and checks each field is one the kind supports (`supported`, the
    /// fields besides `metadata.name` and `metadata.namespace`).
    pub(crate) fn parse(text: &str, extra: &[&str]) -> Result<Self, String> {
        let supported =
            |f: &str| f == "metadata.name" || f == "metadata.namespace" || extra.contains(&f);
        let mut terms = Vec::new();
        for term in text.split(',').map(str::trim).filter(|t| !t.is_empty()) {
            let (field, equal, value) = if let Some((f, v)) = term.split_once("!=") {
                (f, false, v)
            } else if let Some((f, v)) = term.split_once("==").or_else(|| term.split_once('=')) {
                (f, true, v)
            } else {
                return Err(format!(
                    "invalid selector: '{text}'; can't understand '{term}'"
                ));
            };
            let field = field.trim();
            if !supported(field) {
                let known: Vec<String> = ["metadata.name", "metadata.namespace"]
                    .iter()
                    .chain(extra)
                    .map(|f| format!("{f:?}"))
                    .collect();
                return Err(format!(
                    "{field:?} is not a known field selector: only {}",
                    known.join(", ")
                ));
            }
            terms.push((field.to_owned(), equal, value.trim().to_owned()));
        }
        Ok(FieldSelector(terms))
    }

    /// Whether `object` satisfies every term; a field the object lacks reads as "".
    pub(crate) fn matches(&self, object: &Value) -> bool {
        self.0.iter().all(|(field, equal, value)| {
            let found = field_value(object, field);
            (found == *value) == *equal
        })
    }
}

/// The value of a dotted field path as a selector sees it (strings as they are, other scalars
/// printed, a missing field as "").
pub(crate) fn field_value(object: &Value, path: &str) -> String {
    let mut at = object;
    for part in path.split('.') {
        match at.get(part) {
            Some(v) => at = v,
            None => return String::new(),
        }
    }
    match at {
        Value::String(s) => s.clone(),
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

/// The fields a kind can be selected by besides `metadata.name` and `metadata.namespace`.
pub(crate) fn extra_fields(group: &str, kind: &str) -> &'static [&'static str] {
    match (group, kind) {
        ("", "Pod") => &[
            "spec.nodeName",
            "spec.restartPolicy",
            "spec.schedulerName",
            "spec.serviceAccountName",
            "spec.hostNetwork",
            "status.phase",
            "status.podIP",
            "status.nominatedNodeName",
        ],
        ("", "Secret") => &["type"],
        ("", "Namespace") => &["status.phase"],
        ("", "Node") => &["spec.unschedulable"],
        ("", "Event") => &[
            "involvedObject.kind",
            "involvedObject.namespace",
            "involvedObject.name",
            "involvedObject.uid",
            "involvedObject.apiVersion",
            "involvedObject.resourceVersion",
            "involvedObject.fieldPath",
            "reason",
            "reportingComponent",
            "source",
            "type",
        ],
        ("apps", "ReplicaSet") => &["status.replicas"],
        ("batch", "Job") => &["status.successful"],
        _ => &[],
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn labels(v: Value) -> serde_json::Map<String, Value> {
        v.as_object().cloned().unwrap_or_default()
    }

    #[test]
    fn every_operator_selects_as_the_api_server_does() {
        let l = labels(json!({"app": "web", "tier": "front", "example.com/team": "a"}));
        let yes = [
            "app=web",
            "app==web",
            "app!=db",
            "tier in (front, back)",
            "tier notin (back)",
            "app",
            "!missing",
            "example.com/team=a,app",
            "missing notin (x)",
            "missing!=x",
            "",
        ];
        for s in yes {
            assert!(
                LabelSelector::parse(s).unwrap().matches(Some(&l)),
                "{s} should select"
            );
        }
        let no = [
            "app=db",
            "app!=web",
            "tier in (back)",
            "tier notin (front)",
            "missing",
            "!app",
            "app=web,tier=x",
        ];
        for s in no {
            assert!(
                !LabelSelector::parse(s).unwrap().matches(Some(&l)),
                "{s} should not select"
            );
        }
    }

    #[test]
    fn a_malformed_label_selector_is_refused() {
        for s in ["app=web,", "=x", "app in (", "-x=y", "a b"] {
            assert!(LabelSelector::parse(s).is_err(), "{s} should be refused");
        }
    }

    #[test]
    fn a_field_selector_reads_dotted_paths_and_refuses_unknown_fields() {
        let s = FieldSelector::parse("metadata.name=a,status.phase!=Failed", &["status.phase"])
            .unwrap();
        assert!(s.matches(&json!({"metadata": {"name": "a"}, "status": {"phase": "Running"}})));
        assert!(!s.matches(&json!({"metadata": {"name": "a"}, "status": {"phase": "Failed"}})));
        assert_eq!(
            FieldSelector::parse("spec.x=1", &["status.phase"]).unwrap_err(),
            r#""spec.x" is not a known field selector: only "metadata.name", "metadata.namespace", "status.phase""#
        );
    }
}
