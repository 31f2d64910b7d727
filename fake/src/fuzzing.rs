//! The body of the fuzz target `fake_sequences` (`fuzz/`), behind the `fuzzing` feature: a
//! sequence of writes, lists, watches and compactions on one fake server, and the server's
//! own invariants after each step. Not a public API.

use std::collections::BTreeMap;

use bytes::Bytes;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::kinds::{Registry, defaults};
use crate::ops::{Behaviour, DeleteOptions, ListOptions, Target, WriteOptions};
use crate::selectors::{FieldSelector, LabelSelector};
use crate::store::{Store, Watcher};

/// A watch opened during the sequence, and what its events rebuilt.
struct Model {
    rx: mpsc::UnboundedReceiver<Bytes>,
    /// The namespace it watches (all for `None`).
    namespace: Option<String>,
    /// The objects as its events say they are: name → (resourceVersion, object).
    objects: BTreeMap<(String, String), Value>,
    last_rv: u64,
    /// It was told 410 and ended (a compaction passed it by).
    ended: bool,
}

fn byte(data: &mut &[u8]) -> u8 {
    match data.split_first() {
        Some((b, rest)) => {
            *data = rest;
            *b
        }
        None => 0,
    }
}

/// Runs the program in `data`; panics when an invariant breaks.
///
/// Invariants: every write takes a resource version greater than every earlier one, and an
/// object shows the version of its last write; pages of a list, followed by their continue
/// tokens, hold exactly the objects of one list at the first page's version; a watch opened
/// at a listed version and fed its events rebuilds exactly the objects the server holds (in
/// its namespace), each event newer than the one before, unless a compaction ended it with
/// 410 Gone.
pub fn sequences(mut data: &[u8]) {
    let mut registry = Registry::default();
    for r in defaults() {
        registry.add(r);
    }
    let cm = registry.find("", "v1", "configmaps").unwrap_or_default();
    let ns_id = registry.find("", "v1", "namespaces").unwrap_or_default();
    let mut store = Store::new(
        registry,
        64,
        0,
        Behaviour {
            controllers: byte(&mut data) & 1 == 1,
        },
    );
    for ns in ["n0", "n1"] {
        let t = Target {
            resource: ns_id,
            version: "v1".into(),
            namespace: None,
            name: None,
            subresource: None,
        };
        let _ = store.create(
            &t,
            json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}),
            &WriteOptions::default(),
        );
    }
    let mut models: Vec<Model> = Vec::new();
    let mut last_rv = store.rv;
    let mut steps = 0;
    while !data.is_empty() && steps < 200 {
        steps += 1;
        let op = byte(&mut data);
        let ns = format!("n{}", byte(&mut data) % 2);
        let name = format!("o{}", byte(&mut data) % 4);
        let arg = byte(&mut data);
        let t = Target {
            resource: cm,
            version: "v1".into(),
            namespace: Some(ns.clone()),
            name: None,
            subresource: None,
        };
        let writer = WriteOptions {
            dry_run: arg & 0x80 != 0 && op.is_multiple_of(11),
            manager: Some(format!("m{}", arg % 3)),
            keep_uid: false,
        };
        let current_rv = |store: &Store| {
            store.get_object(&t, &name).ok().and_then(|o| {
                o.pointer("/metadata/resourceVersion")
                    .and_then(Value::as_str)
                    .map(str::to_owned)
            })
        };
        match op % 11 {
            0 => {
                let mut body = json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "labels": {"l": (arg % 3).to_string()}}, "data": {"k": arg.to_string()}});
                if arg & 0x40 != 0 {
                    body["metadata"]["finalizers"] = json!(["f/x"]);
                }
                let _ = store.create(&t, body, &writer);
            }
            1 => {
                // An update with the current version, a stale one or none.
                let mut body = json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "labels": {"l": (arg % 3).to_string()}}, "data": {"k": arg.to_string()}});
                match arg % 3 {
                    0 => body["metadata"]["resourceVersion"] = json!(current_rv(&store)),
                    1 => body["metadata"]["resourceVersion"] = json!("1"),
                    _ => {}
                }
                let _ = store.update(&t, &name, body, &writer);
            }
            2 => {
                let patch = json!({"data": {format!("p{}", arg % 4): if arg & 1 == 1 { Value::Null } else { json!(arg.to_string()) }}});
                if let Ok(current) = store.get_object(&t, &name) {
                    let mut next = current.clone();
                    json_patch::merge(&mut next, &patch);
                    let _ = store.update(&t, &name, next, &writer);
                }
            }
            3 => {
                let o = DeleteOptions {
                    propagation: match arg % 3 {
                        0 => None,
                        1 => Some("Foreground".into()),
                        _ => Some("Orphan".into()),
                    },
                    ..DeleteOptions::default()
                };
                let _ = store.delete(&t, &name, &o);
            }
            4 => {
                // Drop the finalizers (an object being deleted goes).
                if let Ok(mut current) = store.get_object(&t, &name) {
                    current["metadata"]["finalizers"] = Value::Null;
                    let _ = store.update(&t, &name, current, &writer);
                }
            }
            5 => {
                let applied = json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": {format!("a{}", arg % 2): arg.to_string()}});
                let _ = store.apply(
                    &t,
                    &name,
                    applied,
                    &format!("m{}", arg % 3),
                    arg & 1 == 1,
                    false,
                );
            }
            6 => check_pages(&store, &t, (arg % 4) as usize + 1),
            7 => {
                // A watch from the version of a fresh list, in one namespace or all.
                let namespace = (arg & 1 == 1).then(|| ns.clone());
                let lt = Target {
                    namespace: namespace.clone(),
                    ..t.clone()
                };
                let Ok(list) = store.list(&lt, &ListOptions::default()) else {
                    continue;
                };
                let rv = rv_of(&list);
                let mut objects = BTreeMap::new();
                for item in list["items"].as_array().into_iter().flatten() {
                    objects.insert(key_of(item), item.clone());
                }
                let (tx, rx) = mpsc::unbounded_channel();
                let watcher = Watcher {
                    resource: cm,
                    namespace: namespace.clone(),
                    name: None,
                    labels: LabelSelector::default(),
                    fields: FieldSelector::default(),
                    api_version: "v1".into(),
                    kind: "ConfigMap".into(),
                    bookmarks: false,
                    tx,
                };
                // As the server opens a watch from a version: the changes since, then live.
                let opened = match store.since(rv) {
                    Ok(changes) => {
                        for c in changes {
                            if let Some(line) = watcher.event(c) {
                                let _ = watcher.tx.send(line);
                            }
                        }
                        true
                    }
                    Err(_) => false,
                };
                if opened {
                    store.watchers.push(watcher);
                    models.push(Model {
                        rx,
                        namespace,
                        objects,
                        last_rv: rv,
                        ended: false,
                    });
                }
            }
            8 => store.compact(),
            9 => {
                let dt = Target {
                    name: None,
                    ..t.clone()
                };
                let labels = LabelSelector::parse(&format!("l={}", arg % 3)).unwrap_or_default();
                let Ok(list) = store.list(
                    &dt,
                    &ListOptions {
                        labels,
                        ..ListOptions::default()
                    },
                ) else {
                    continue;
                };
                for item in list["items"].as_array().cloned().unwrap_or_default() {
                    let n = item
                        .pointer("/metadata/name")
                        .and_then(Value::as_str)
                        .unwrap_or_default()
                        .to_owned();
                    let _ = store.delete(&t, &n, &DeleteOptions::default());
                }
            }
            _ => {
                // A namespace deleted (and, with controllers, emptied).
                let nt = Target {
                    resource: ns_id,
                    version: "v1".into(),
                    namespace: None,
                    name: None,
                    subresource: None,
                };
                if arg.is_multiple_of(5) {
                    let _ = store.delete(&nt, &ns, &DeleteOptions::default());
                }
            }
        }
        assert!(
            store.rv >= last_rv,
            "the resource version went back: {last_rv} → {}",
            store.rv
        );
        last_rv = store.rv;
        for (key, object) in &store.objects {
            let rv = rv_of(object);
            assert!(
                rv <= store.rv && rv > 0,
                "{key:?} shows version {rv} beyond the server's {}",
                store.rv
            );
        }
        for model in &mut models {
            drain(model);
        }
        // Every watch that is still open has rebuilt what the server holds.
        for model in models.iter().filter(|m| !m.ended) {
            let truth: BTreeMap<(String, String), Value> = store
                .of(cm, model.namespace.as_deref())
                .map(|(k, v)| ((k.namespace.clone(), k.name.clone()), shown(v)))
                .collect();
            let rebuilt: BTreeMap<(String, String), Value> = model
                .objects
                .iter()
                .map(|(k, v)| (k.clone(), shown(v)))
                .collect();
            assert_eq!(
                rebuilt, truth,
                "a watch's events did not rebuild the server's objects"
            );
        }
    }
}

/// An object as compared: what a client sees of it.
fn shown(v: &Value) -> Value {
    let mut v = v.clone();
    if let Some(m) = v.as_object_mut() {
        m.remove("apiVersion");
        m.remove("kind");
    }
    v
}

/// The resource version an object (or a list) shows, 0 when none.
fn rv_of(object: &Value) -> u64 {
    object
        .pointer("/metadata/resourceVersion")
        .and_then(Value::as_str)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn key_of(object: &Value) -> (String, String) {
    let s = |p: &str| {
        object
            .pointer(p)
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned()
    };
    (s("/metadata/namespace"), s("/metadata/name"))
}

/// Applies the events a watch has received to its model.
fn drain(model: &mut Model) {
    while let Ok(line) = model.rx.try_recv() {
        let Ok(event) = serde_json::from_slice::<Value>(&line) else {
            panic!("a watch line is not JSON")
        };
        let kind = event["type"].as_str().unwrap_or_default();
        if kind == "ERROR" {
            model.ended = true;
            continue;
        }
        let object = &event["object"];
        let rv = rv_of(object);
        assert!(
            rv > model.last_rv,
            "a watch event at {rv} after one at {}",
            model.last_rv
        );
        model.last_rv = rv;
        match kind {
            "ADDED" | "MODIFIED" => {
                model.objects.insert(key_of(object), object.clone());
            }
            "DELETED" => {
                model.objects.remove(&key_of(object));
            }
            other => panic!("an unexpected watch event type {other}"),
        }
    }
    // A compaction ends watches by dropping them from the server: their channel closes.
    if model.rx.is_closed() && model.rx.is_empty() {
        model.ended = true;
    }
}

/// Pages of `limit` followed to the end hold exactly the list at the first page's version.
fn check_pages(store: &Store, t: &Target, limit: usize) {
    let all_t = Target {
        namespace: None,
        ..t.clone()
    };
    let Ok(first) = store.list(
        &all_t,
        &ListOptions {
            limit: Some(limit),
            ..ListOptions::default()
        },
    ) else {
        return;
    };
    let rv = rv_of(&first);
    let mut names: Vec<(String, String)> = first["items"]
        .as_array()
        .into_iter()
        .flatten()
        .map(key_of)
        .collect();
    let mut token = first
        .pointer("/metadata/continue")
        .and_then(Value::as_str)
        .map(str::to_owned);
    let mut pages = 0;
    while let Some(c) = token.take() {
        pages += 1;
        assert!(pages < 100, "pages never end");
        let Ok(page) = store.list(
            &all_t,
            &ListOptions {
                limit: Some(limit),
                continue_token: Some(c),
                ..ListOptions::default()
            },
        ) else {
            return;
        };
        let items = page["items"].as_array().cloned().unwrap_or_default();
        assert!(items.len() <= limit, "a page longer than its limit");
        names.extend(items.iter().map(key_of));
        token = page
            .pointer("/metadata/continue")
            .and_then(Value::as_str)
            .map(str::to_owned);
    }
    let Ok(snapshot) = store.snapshot(t.resource, rv) else {
        return;
    };
    let expected: Vec<(String, String)> = snapshot
        .keys()
        .map(|k| (k.namespace.clone(), k.name.clone()))
        .collect();
    assert_eq!(
        names, expected,
        "the pages do not hold the list at their version"
    );
}
