//! Patches: JSON merge (RFC 7386), JSON patch (RFC 6902) and strategic merge for built-in kinds.

use serde_json::{Map, Value};

use crate::kinds::Resource;
use crate::status::ApiError;

/// The patch types the server reads, from the request's content type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PatchType {
    Merge,
    Json,
    Strategic,
    Apply,
}

impl PatchType {
    pub(crate) fn from_content_type(content_type: &str) -> Option<Self> {
        match content_type.split(';').next().unwrap_or("").trim() {
            "application/merge-patch+json" => Some(PatchType::Merge),
            "application/json-patch+json" => Some(PatchType::Json),
            "application/strategic-merge-patch+json" => Some(PatchType::Strategic),
            "application/apply-patch+yaml" | "application/apply-patch+cbor" => {
                Some(PatchType::Apply)
            }
            _ => None,
        }
    }
}

/// `current` with a merge, JSON or strategic patch applied.
pub(crate) fn apply(
    kind: PatchType,
    resource: &Resource,
    current: &Value,
    patch: &[u8],
) -> Result<Value, ApiError> {
    match kind {
        PatchType::Merge => {
            let patch: Value = serde_json::from_slice(patch)
                .map_err(|e| ApiError::bad_request(format!("error decoding patch: {e}")))?;
            if !patch.is_object() {
                return Err(ApiError::bad_request(
                    "error decoding patch: the patch is not a JSON object",
                ));
            }
            let mut out = current.clone();
            json_patch::merge(&mut out, &patch);
            Ok(out)
        }
        PatchType::Json => {
            let patch: json_patch::Patch = serde_json::from_slice(patch)
                .map_err(|e| ApiError::bad_request(format!("error decoding patch: {e}")))?;
            let mut out = current.clone();
            for op in patch.0 {
                // The API server's JSON patch passes a `test` for null on a path that is not
                // there (kube-runtime's finalizer helper relies on it); RFC 6902 would fail it.
                if let json_patch::PatchOperation::Test(t) = &op
                    && t.value.is_null()
                    && out.pointer(t.path.as_str()).is_none()
                {
                    continue;
                }
                json_patch::patch(&mut out, &[op]).map_err(|_| ApiError::patch_rejected())?;
            }
            Ok(out)
        }
        PatchType::Strategic => {
            if resource.custom {
                return Err(ApiError::unsupported_media_type(
                    "application/strategic-merge-patch+json",
                ));
            }
            let patch: Value = serde_json::from_slice(patch)
                .map_err(|e| ApiError::bad_request(format!("error decoding patch: {e}")))?;
            let Value::Object(patch) = patch else {
                return Err(ApiError::bad_request(
                    "error decoding patch: the patch is not a JSON object",
                ));
            };
            let mut out = current.clone();
            strategic_map(&mut out, patch, resource.merge_keys);
            Ok(out)
        }
        // Server-side apply has its own module; it never reaches here.
        PatchType::Apply => Err(ApiError::unsupported_media_type(
            "application/apply-patch+yaml",
        )),
    }
}

/// The merge key of a list field, `Some("")` for a list of scalars merged as a set.
fn merge_key<'a>(keys: &'a [(&'static str, &'static str)], field: &str) -> Option<&'a str> {
    keys.iter().find(|(f, _)| *f == field).map(|(_, k)| *k)
}

fn strategic_map(
    target: &mut Value,
    mut patch: Map<String, Value>,
    keys: &[(&'static str, &'static str)],
) {
    if patch.get("$patch").and_then(Value::as_str) == Some("replace") {
        patch.remove("$patch");
        *target = Value::Object(patch);
        return;
    }
    if !target.is_object() {
        *target = Value::Object(Map::new());
    }
    let Value::Object(map) = target else { return };
    if let Some(Value::Array(retain)) = patch.remove("$retainKeys") {
        let keep: Vec<&str> = retain.iter().filter_map(Value::as_str).collect();
        map.retain(|k, _| keep.contains(&k.as_str()));
    }
    let directives: Vec<String> = patch
        .keys()
        .filter(|k| k.starts_with('$'))
        .cloned()
        .collect();
    for d in directives {
        let value = patch.remove(&d);
        if let (Some(field), Some(Value::Array(values))) =
            (d.strip_prefix("$deleteFromPrimitiveList/"), value)
            && let Some(Value::Array(list)) = map.get_mut(field)
        {
            list.retain(|v| !values.contains(v));
        }
        // `$setElementOrder/…` and unknown directives only order or annotate; dropped.
    }
    for (field, value) in patch {
        match value {
            Value::Null => {
                map.remove(&field);
            }
            Value::Object(sub) if sub.get("$patch").and_then(Value::as_str) == Some("delete") => {
                map.remove(&field);
            }
            Value::Object(sub) => strategic_map(map.entry(field).or_insert(Value::Null), sub, keys),
            Value::Array(items) => match merge_key(keys, &field) {
                Some("") => {
                    // A list of scalars merges as a set: the patch's items first, then the
                    // items it did not name (what the API server answers).
                    let old = match map.remove(&field) {
                        Some(Value::Array(old)) => old,
                        _ => Vec::new(),
                    };
                    let mut merged: Vec<Value> = Vec::new();
                    for item in items.into_iter().chain(old) {
                        if !merged.contains(&item) {
                            merged.push(item);
                        }
                    }
                    map.insert(field, Value::Array(merged));
                }
                Some(key) => {
                    let entry = map.entry(field).or_insert_with(|| Value::Array(Vec::new()));
                    if !entry.is_array() {
                        *entry = Value::Array(Vec::new());
                    }
                    if let Value::Array(list) = entry {
                        merge_list(list, items, key, keys);
                    }
                }
                None => {
                    map.insert(field, Value::Array(items));
                }
            },
            other => {
                map.insert(field, other);
            }
        }
    }
}

/// A keyed list merged: the patch's items first, each merged into the item of the same key
/// (or new), then the items the patch did not name, in their order (what the API server
/// answers when the patch carries no `$setElementOrder`).
fn merge_list(
    list: &mut Vec<Value>,
    items: Vec<Value>,
    key: &str,
    keys: &[(&'static str, &'static str)],
) {
    if items
        .iter()
        .any(|i| i.get("$patch").and_then(Value::as_str) == Some("replace"))
    {
        *list = items
            .into_iter()
            .filter(|i| i.get("$patch").is_none())
            .collect();
        return;
    }
    let mut old: Vec<Option<Value>> = std::mem::take(list).into_iter().map(Some).collect();
    let mut merged = Vec::new();
    for item in items {
        let Value::Object(mut fields) = item else {
            continue;
        };
        let id = fields.get(key).cloned();
        let at = id.as_ref().and_then(|id| {
            old.iter()
                .position(|e| e.as_ref().and_then(|e| e.get(key)) == Some(id))
        });
        let existing = at.and_then(|i| old[i].take());
        if fields.get("$patch").and_then(Value::as_str) == Some("delete") {
            continue;
        }
        fields.remove("$patch");
        let mut target = existing.unwrap_or_else(|| Value::Object(Map::new()));
        strategic_map(&mut target, fields, keys);
        merged.push(target);
    }
    merged.extend(old.into_iter().flatten());
    *list = merged;
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod() -> Resource {
        Resource::of::<k8s_openapi::api::core::v1::Pod>()
    }

    #[test]
    fn a_strategic_patch_merges_containers_by_name_patch_items_first() {
        let current = json!({"spec": {"containers": [{"name": "a", "image": "x"}, {"name": "b", "image": "y"}]}});
        let patch = json!({"spec": {"containers": [{"name": "b", "image": "z"}, {"name": "c", "image": "w"}]}});
        let out = apply(
            PatchType::Strategic,
            &pod(),
            &current,
            patch.to_string().as_bytes(),
        )
        .unwrap();
        assert_eq!(
            out["spec"]["containers"],
            json!([{"name": "b", "image": "z"}, {"name": "c", "image": "w"}, {"name": "a", "image": "x"}])
        );
    }

    #[test]
    fn a_strategic_patch_deletes_by_key_and_merges_finalizers_as_a_set() {
        let current = json!({"metadata": {"finalizers": ["a"]}, "spec": {"containers": [{"name": "a"}, {"name": "b"}]}});
        let patch = json!({
            "metadata": {"finalizers": ["a", "b"]},
            "spec": {"containers": [{"name": "a", "$patch": "delete"}]}
        });
        let out = apply(
            PatchType::Strategic,
            &pod(),
            &current,
            patch.to_string().as_bytes(),
        )
        .unwrap();
        assert_eq!(out["spec"]["containers"], json!([{"name": "b"}]));
        assert_eq!(out["metadata"]["finalizers"], json!(["a", "b"]));
        let again = apply(
            PatchType::Strategic,
            &pod(),
            &out,
            br#"{"metadata": {"finalizers": ["c"]}}"#,
        )
        .unwrap();
        assert_eq!(again["metadata"]["finalizers"], json!(["c", "a", "b"]));
    }

    #[test]
    fn a_strategic_patch_of_a_custom_resource_is_refused() {
        let mut r = pod();
        r.custom = true;
        let e = apply(PatchType::Strategic, &r, &json!({}), b"{}").unwrap_err();
        assert_eq!(e.code, 415);
    }
}
