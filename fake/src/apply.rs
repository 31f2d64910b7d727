//! Managed fields and server-side apply: who owns which field, what an apply removes, merges
//! and refuses (conflicts), and what an update hands to its writer.
//!
//! A field set is the set of leaf paths of an object, each path a list of the elements
//! `fieldsV1` uses: `f:<name>` for a field, `k:<json>` for the item of a keyed list (with its
//! own `.` leaf), `v:<json>` for the item of a list of scalars merged as a set. Other lists
//! are atomic: one leaf.

use std::collections::BTreeSet;

use serde_json::{Map, Value, json};

use crate::kinds::Resource;

type Path = Vec<String>;
pub(crate) type FieldSet = BTreeSet<Path>;

/// The metadata fields nobody owns.
const UNOWNED_META: &[&str] = &[
    "name",
    "namespace",
    "uid",
    "resourceVersion",
    "generation",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "managedFields",
    "selfLink",
];

fn merge_key<'a>(r: &'a Resource, field: &str) -> Option<&'a str> {
    r.merge_keys
        .iter()
        .find(|(f, _)| *f == field)
        .map(|(_, k)| *k)
}

/// The leaf paths of `object` (a whole object: apiVersion, kind and the unowned metadata are
/// left out; so is the status when `status` is false, and everything but the status when it
/// is true).
pub(crate) fn fields_of(r: &Resource, object: &Value, status: bool) -> FieldSet {
    let mut out = FieldSet::new();
    let Some(top) = object.as_object() else {
        return out;
    };
    for (k, v) in top {
        match k.as_str() {
            "apiVersion" | "kind" => {}
            "status" if !status && r.status_subresource => {}
            _ if status && k != "status" => {}
            "metadata" => {
                if let Some(m) = v.as_object() {
                    for (mk, mv) in m {
                        if !UNOWNED_META.contains(&mk.as_str()) {
                            walk(r, mk, mv, &mut vec!["f:metadata".to_owned()], &mut out);
                        }
                    }
                }
            }
            _ => walk(r, k, v, &mut Vec::new(), &mut out),
        }
    }
    out
}

/// Built-in struct types that are atomic (owned whole): object references, and the items
/// of `ownerReferences`.
const ATOMIC: &[&str] = &["regarding", "related", "involvedObject"];
const ATOMIC_ITEMS: &[&str] = &["ownerReferences"];

fn walk(r: &Resource, field: &str, value: &Value, path: &mut Path, out: &mut FieldSet) {
    path.push(format!("f:{field}"));
    match value {
        Value::Object(map) if !map.is_empty() && (!ATOMIC.contains(&field) || r.custom) => {
            for (k, v) in map {
                walk(r, k, v, path, out);
            }
        }
        Value::Array(items) if merge_key(r, field).is_some() => {
            let key = merge_key(r, field).unwrap_or_default();
            if items.is_empty() {
                out.insert(path.clone());
            }
            for item in items {
                if key.is_empty() {
                    path.push(format!("v:{item}"));
                    out.insert(path.clone());
                    path.pop();
                } else {
                    let id = item.get(key).cloned().unwrap_or(Value::Null);
                    path.push(format!("k:{}", json!({ key: id })));
                    let mut marker = path.clone();
                    marker.push(".".to_owned());
                    out.insert(marker);
                    if ATOMIC_ITEMS.contains(&field) {
                        path.pop();
                        continue;
                    }
                    if let Some(fields) = item.as_object() {
                        for (k, v) in fields {
                            walk(r, k, v, path, out);
                        }
                    }
                    path.pop();
                }
            }
        }
        _ => {
            out.insert(path.clone());
        }
    }
    path.pop();
}

/// Whether the field at `path` differs between `before` and `after`. A keyed item's `.` leaf
/// says only that the item exists: it changes when the item comes or goes, not when a field
/// inside it does (those fields are paths of their own).
fn differs(before: &Value, after: &Value, path: &[String]) -> bool {
    match path.split_last() {
        Some((last, item)) if last == "." => {
            value_at(before, item).is_some() != value_at(after, item).is_some()
        }
        _ => value_at(before, path) != value_at(after, path),
    }
}

/// The value at a path, if the object has it.
fn value_at<'a>(object: &'a Value, path: &[String]) -> Option<&'a Value> {
    let mut at = object;
    for element in path {
        if element == "." {
            return Some(at);
        }
        if let Some(name) = element.strip_prefix("f:") {
            at = at.get(name)?;
        } else if let Some(id) = element.strip_prefix("k:") {
            let id: Map<String, Value> = serde_json::from_str(id).ok()?;
            at = at
                .as_array()?
                .iter()
                .find(|item| id.iter().all(|(k, v)| item.get(k) == Some(v)))?;
        } else if let Some(v) = element.strip_prefix("v:") {
            let v: Value = serde_json::from_str(v).ok()?;
            return at.as_array()?.iter().find(|x| **x == v);
        }
    }
    Some(at)
}

/// Removes the field at `path` from `object` (and maps or keyed items left empty by it).
fn remove_at(object: &mut Value, path: &[String]) {
    let Some((last, parents)) = path.split_last() else {
        return;
    };
    if last == "." {
        // A keyed item itself.
        let Some((item, list_path)) = parents.split_last() else {
            return;
        };
        if let Some(list) = value_mut(object, list_path).and_then(Value::as_array_mut)
            && let Some(id) = item
                .strip_prefix("k:")
                .and_then(|i| serde_json::from_str::<Map<String, Value>>(i).ok())
        {
            list.retain(|x| !id.iter().all(|(k, v)| x.get(k) == Some(v)));
        }
        return;
    }
    let Some(parent) = value_mut(object, parents) else {
        return;
    };
    if let Some(name) = last.strip_prefix("f:") {
        if let Some(m) = parent.as_object_mut() {
            m.remove(name);
        }
    } else if let Some(v) = last.strip_prefix("v:")
        && let (Some(list), Ok(v)) = (parent.as_array_mut(), serde_json::from_str::<Value>(v))
    {
        list.retain(|x| *x != v);
    }
}

fn value_mut<'a>(object: &'a mut Value, path: &[String]) -> Option<&'a mut Value> {
    let mut at = object;
    for element in path {
        if let Some(name) = element.strip_prefix("f:") {
            at = at.get_mut(name)?;
        } else if let Some(id) = element.strip_prefix("k:") {
            let id: Map<String, Value> = serde_json::from_str(id).ok()?;
            at = at
                .as_array_mut()?
                .iter_mut()
                .find(|item| id.iter().all(|(k, v)| item.get(k) == Some(v)))?;
        } else {
            return None;
        }
    }
    Some(at)
}

/// `fieldsV1` of a field set.
pub(crate) fn to_fields_v1(set: &FieldSet) -> Value {
    let mut root = Map::new();
    for path in set {
        let mut at = &mut root;
        for element in path {
            let next = at.entry(element.clone()).or_insert_with(|| json!({}));
            match next {
                Value::Object(m) => at = m,
                _ => break,
            }
        }
    }
    Value::Object(root)
}

/// The field set of a `fieldsV1`.
pub(crate) fn from_fields_v1(v: &Value) -> FieldSet {
    fn go(v: &Value, path: &mut Path, out: &mut FieldSet) {
        match v.as_object() {
            Some(m) if !m.is_empty() => {
                for (k, child) in m {
                    path.push(k.clone());
                    go(child, path, out);
                    path.pop();
                }
            }
            _ => {
                out.insert(path.clone());
            }
        }
    }
    let mut out = FieldSet::new();
    go(v, &mut Vec::new(), &mut out);
    out
}

/// One entry of `metadata.managedFields`.
#[derive(Clone, Debug)]
pub(crate) struct Entry {
    pub(crate) manager: String,
    pub(crate) operation: String,
    pub(crate) api_version: String,
    pub(crate) subresource: Option<String>,
    pub(crate) time: String,
    pub(crate) fields: FieldSet,
}

pub(crate) fn entries(object: &Value) -> Vec<Entry> {
    object
        .pointer("/metadata/managedFields")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .map(|e| Entry {
                    manager: e["manager"].as_str().unwrap_or_default().to_owned(),
                    operation: e["operation"].as_str().unwrap_or_default().to_owned(),
                    api_version: e["apiVersion"].as_str().unwrap_or_default().to_owned(),
                    subresource: e["subresource"].as_str().map(str::to_owned),
                    time: e["time"].as_str().unwrap_or_default().to_owned(),
                    fields: from_fields_v1(&e["fieldsV1"]),
                })
                .collect()
        })
        .unwrap_or_default()
}

pub(crate) fn to_value(entries: &[Entry]) -> Value {
    Value::Array(
        entries
            .iter()
            .filter(|e| !e.fields.is_empty())
            .map(|e| {
                let mut v = json!({
                    "manager": e.manager,
                    "operation": e.operation,
                    "apiVersion": e.api_version,
                    "time": e.time,
                    "fieldsType": "FieldsV1",
                    "fieldsV1": to_fields_v1(&e.fields),
                });
                if let Some(s) = &e.subresource {
                    v["subresource"] = json!(s);
                }
                v
            })
            .collect(),
    )
}

fn show_path(path: &[String]) -> String {
    let mut out = String::new();
    for element in path {
        if let Some(name) = element.strip_prefix("f:") {
            out.push('.');
            out.push_str(name);
        } else if let Some(id) = element.strip_prefix("k:") {
            out.push('[');
            out.push_str(id);
            out.push(']');
        } else if let Some(v) = element.strip_prefix("v:") {
            out.push_str(&format!("[={v}]"));
        }
    }
    out
}

/// A refused apply: the fields other managers own with other values, as (how the manager
/// is named, the field). An updater is named with its version (`"m" using v1`), an applier
/// without.
#[derive(Debug)]
pub(crate) struct Conflicts(pub(crate) Vec<(String, String)>);

impl Conflicts {
    /// The message and causes the API server gives.
    pub(crate) fn describe(&self) -> (String, Value) {
        let causes: Vec<Value> = self
            .0
            .iter()
            .map(|(who, path)| {
                json!({"reason": "FieldManagerConflict", "message": format!("conflict with {who}"), "field": path})
            })
            .collect();
        let message = if self.0.len() == 1 {
            let (who, path) = &self.0[0];
            format!("Apply failed with 1 conflict: conflict with {who}: {path}")
        } else {
            let mut m = format!("Apply failed with {} conflicts: ", self.0.len());
            let mut by_manager: Vec<(String, Vec<String>)> = Vec::new();
            for (who, path) in &self.0 {
                match by_manager.iter_mut().find(|(m, _)| m == who) {
                    Some(entry) => entry.1.push(path.clone()),
                    None => by_manager.push((who.clone(), vec![path.clone()])),
                }
            }
            let parts: Vec<String> = by_manager
                .iter()
                .map(|(who, paths)| {
                    let word = if paths.len() == 1 {
                        "conflict"
                    } else {
                        "conflicts"
                    };
                    let list: Vec<String> = paths.iter().map(|p| format!("- {p}")).collect();
                    format!("{word} with {who}:\n{}", list.join("\n"))
                })
                .collect();
            m.push_str(&parts.join("\n"));
            m
        };
        (message, Value::Array(causes))
    }
}

/// Merges an applied configuration into `target`: maps field by field, keyed lists item by
/// item, lists of scalars as sets, anything else replaced.
fn merge(r: &Resource, target: &mut Value, applied: &Value, field: Option<&str>) {
    match (target, applied) {
        (Value::Object(t), Value::Object(a)) => {
            for (k, v) in a {
                match t.get_mut(k) {
                    Some(existing) if v.is_object() || v.is_array() => {
                        merge(r, existing, v, Some(k))
                    }
                    _ => {
                        t.insert(k.clone(), v.clone());
                    }
                }
            }
        }
        (Value::Array(t), Value::Array(a)) => match field.and_then(|f| merge_key(r, f)) {
            Some("") => {
                for item in a {
                    if !t.contains(item) {
                        t.push(item.clone());
                    }
                }
            }
            Some(key) => {
                for item in a {
                    let id = item.get(key);
                    match t.iter_mut().find(|x| x.get(key) == id) {
                        Some(existing) => merge(r, existing, item, None),
                        None => t.push(item.clone()),
                    }
                }
            }
            None => *t = a.clone(),
        },
        (t, a) => *t = a.clone(),
    }
}

/// Who applies, in which version, to which part (the status subresource or the rest), when.
pub(crate) struct Writer<'a> {
    pub(crate) manager: &'a str,
    pub(crate) api_version: &'a str,
    pub(crate) status: bool,
    pub(crate) now: &'a str,
}

/// Applies `applied` for `manager` to `live` (the object as stored, or a new one): returns
/// the object to write with its managed fields, or the conflicts when not `force`d.
pub(crate) fn apply(
    r: &Resource,
    live: &Value,
    applied: &Value,
    writer: &Writer<'_>,
    force: bool,
) -> Result<Value, Conflicts> {
    let Writer {
        manager,
        api_version,
        status,
        now,
    } = *writer;
    let mut managers = entries(live);
    let subresource = status.then(|| "status".to_owned());
    let applied_fields = fields_of(r, applied, status);
    let mine =
        |e: &Entry| e.manager == manager && e.operation == "Apply" && e.subresource == subresource;
    let mut conflicts = Vec::new();
    let mut changed: FieldSet = FieldSet::new();
    for path in &applied_fields {
        if differs(live, applied, path) {
            changed.insert(path.clone());
        }
    }
    for e in managers
        .iter()
        .filter(|e| !mine(e) && e.subresource == subresource)
    {
        for path in e.fields.intersection(&changed) {
            if e.manager != manager {
                let who = if e.operation == "Update" {
                    format!("{:?} using {}", e.manager, e.api_version)
                } else {
                    format!("{:?}", e.manager)
                };
                conflicts.push((who, show_path(path)));
            }
        }
    }
    if !conflicts.is_empty() && !force {
        return Err(Conflicts(conflicts));
    }
    let mut out = live.clone();
    // Fields this manager applied before and no longer applies go, unless someone else
    // owns them too.
    let before: FieldSet = managers
        .iter()
        .filter(|e| mine(e))
        .flat_map(|e| e.fields.iter().cloned())
        .collect();
    for path in before.difference(&applied_fields) {
        let shared = managers.iter().any(|e| !mine(e) && e.fields.contains(path));
        if !shared {
            remove_at(&mut out, path);
        }
    }
    let mut body = applied.clone();
    if let Some(m) = body.get_mut("metadata").and_then(Value::as_object_mut) {
        for f in UNOWNED_META {
            m.remove(*f);
        }
    }
    merge(r, &mut out, &body, None);
    for e in managers.iter_mut().filter(|e| !mine(e)) {
        e.fields.retain(|p| !changed.contains(p));
    }
    match managers.iter_mut().find(|e| mine(e)) {
        Some(e) => {
            e.fields = applied_fields;
            e.time = now.to_owned();
            e.api_version = api_version.to_owned();
        }
        None => managers.push(Entry {
            manager: manager.to_owned(),
            operation: "Apply".to_owned(),
            api_version: api_version.to_owned(),
            subresource,
            time: now.to_owned(),
            fields: applied_fields,
        }),
    }
    set(&mut out, &managers);
    Ok(out)
}

/// The managed fields after an update (any write but an apply) by `manager`: the fields it
/// changed are its own, no longer anyone else's; fields removed are no one's.
pub(crate) fn record_update(
    r: &Resource,
    old: Option<&Value>,
    new: &mut Value,
    manager: &str,
    api_version: &str,
    status: bool,
    now: &str,
) {
    let mut managers = old.map(entries).unwrap_or_default();
    let subresource = status.then(|| "status".to_owned());
    let before = old.map(|o| fields_of(r, o, status)).unwrap_or_default();
    let after = fields_of(r, new, status);
    let empty = Value::Null;
    let changed: FieldSet = after
        .iter()
        .filter(|p| differs(old.unwrap_or(&empty), new, p))
        .cloned()
        .collect();
    let removed: FieldSet = before.difference(&after).cloned().collect();
    for e in &mut managers {
        e.fields.retain(|p| {
            !removed.contains(p)
                && !(changed.contains(p) && !(e.manager == manager && e.operation == "Update"))
        });
    }
    if !changed.is_empty() {
        let at = managers.iter().position(|e| {
            e.manager == manager
                && e.operation == "Update"
                && e.subresource == subresource
                && e.api_version == api_version
        });
        match at {
            Some(i) => {
                managers[i].fields.extend(changed);
                managers[i].time = now.to_owned();
            }
            None => managers.push(Entry {
                manager: manager.to_owned(),
                operation: "Update".to_owned(),
                api_version: api_version.to_owned(),
                subresource,
                time: now.to_owned(),
                fields: changed,
            }),
        }
    }
    set(new, &managers);
}

fn set(object: &mut Value, managers: &[Entry]) {
    let v = to_value(managers);
    if let Some(m) = object.get_mut("metadata").and_then(Value::as_object_mut) {
        if v.as_array().is_some_and(Vec::is_empty) {
            m.remove("managedFields");
        } else {
            m.insert("managedFields".to_owned(), v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cm() -> Resource {
        Resource::of::<k8s_openapi::api::core::v1::ConfigMap>()
    }

    const M: Writer<'static> = Writer {
        manager: "m",
        api_version: "v1",
        status: false,
        now: "t",
    };
    const O: Writer<'static> = Writer { manager: "o", ..M };

    fn obj(data: Value) -> Value {
        json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x", "namespace": "d"}, "data": data})
    }

    #[test]
    fn an_apply_removes_what_the_manager_no_longer_applies_and_keeps_what_others_own() {
        let r = cm();
        let live = obj(json!({}));
        let first = apply(&r, &live, &obj(json!({"a": "1", "b": "2"})), &M, false).unwrap();
        let mut other = first.clone();
        other["data"]["c"] = json!("3");
        record_update(&r, Some(&first), &mut other, "n", "v1", false, "t");
        let second = apply(&r, &other, &obj(json!({"a": "1"})), &M, false).unwrap();
        assert_eq!(second["data"], json!({"a": "1", "c": "3"}));
    }

    fn pod() -> Resource {
        Resource::of::<k8s_openapi::api::core::v1::Pod>()
    }

    fn pod_with(container: Value) -> Value {
        json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "d"}, "spec": {"containers": [container]}})
    }

    #[test]
    fn two_appliers_of_different_fields_of_one_keyed_item_share_it_without_conflict() {
        let r = pod();
        let live = pod_with(json!({"name": "app"}));
        let a = apply(
            &r,
            &live,
            &pod_with(json!({"name": "app", "image": "x"})),
            &M,
            false,
        )
        .unwrap();
        let b = apply(
            &r,
            &a,
            &pod_with(json!({"name": "app", "resources": {"limits": {"cpu": "1"}}})),
            &O,
            false,
        )
        .expect("no conflict: the managers set different fields of the item");
        assert_eq!(b["spec"]["containers"][0]["image"], "x");
        // The second applier stops applying the container: the first one's fields stay.
        let c = apply(
            &r,
            &b,
            &json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}}),
            &O,
            false,
        )
        .unwrap();
        assert_eq!(c["spec"]["containers"][0]["image"], "x", "{c}");
    }

    #[test]
    fn an_apply_that_changes_a_field_another_manager_set_conflicts_unless_forced() {
        let r = cm();
        let mut live = obj(json!({"a": "1"}));
        record_update(&r, None, &mut live, "n", "v1", false, "t");
        let e = apply(&r, &live, &obj(json!({"a": "2"})), &M, false).unwrap_err();
        assert_eq!(
            e.describe().0,
            r#"Apply failed with 1 conflict: conflict with "n" using v1: .data.a"#
        );
        let applied = apply(&r, &live, &obj(json!({"b": "1"})), &O, false).unwrap();
        let e = apply(&r, &applied, &obj(json!({"b": "2"})), &M, false).unwrap_err();
        assert_eq!(
            e.describe().0,
            r#"Apply failed with 1 conflict: conflict with "o": .data.b"#
        );
        // The same value is no conflict: the field is shared.
        apply(&r, &live, &obj(json!({"a": "1"})), &M, false).unwrap();
        let forced = apply(&r, &live, &obj(json!({"a": "2"})), &M, true).unwrap();
        let owners = entries(&forced);
        assert_eq!(owners.len(), 1, "{owners:?}");
        assert_eq!(owners[0].manager, "m");
    }
}
