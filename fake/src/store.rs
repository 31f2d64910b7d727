//! The objects of one fake server, their resource versions and the history watches replay.
//!
//! Every write goes through [`Store::commit`]: it takes the next resource version, keeps the
//! change in the history (bounded; a watch or a continue token older than what is kept gets
//! 410 Gone) and hands the change to every open watch that selects the object before or after
//! it.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use bytes::Bytes;
use serde_json::{Map, Value, json};
use tokio::sync::mpsc;

use crate::kinds::{Registry, ResourceId};
use crate::ops::Behaviour;
use crate::selectors::{FieldSelector, LabelSelector};
use crate::status::ApiError;

/// Where an object is kept: its resource, namespace ("" for cluster-scoped) and name.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct Key {
    pub(crate) resource: ResourceId,
    pub(crate) namespace: String,
    pub(crate) name: String,
}

/// One write, as the history keeps it.
#[derive(Clone, Debug)]
pub(crate) struct Change {
    pub(crate) rv: u64,
    pub(crate) key: Key,
    pub(crate) old: Option<Arc<Value>>,
    pub(crate) new: Option<Arc<Value>>,
}

/// What an open watch selects and where its events go.
pub(crate) struct Watcher {
    pub(crate) resource: ResourceId,
    pub(crate) namespace: Option<String>,
    pub(crate) name: Option<String>,
    pub(crate) labels: LabelSelector,
    pub(crate) fields: FieldSelector,
    /// The version objects are shown in.
    pub(crate) api_version: String,
    /// The kind, for bookmarks.
    pub(crate) kind: String,
    /// Whether the client asked for bookmarks.
    pub(crate) bookmarks: bool,
    pub(crate) tx: mpsc::UnboundedSender<Bytes>,
}

impl Watcher {
    pub(crate) fn selects(&self, key: &Key, object: &Value) -> bool {
        key.resource == self.resource
            && self
                .namespace
                .as_ref()
                .is_none_or(|ns| *ns == key.namespace)
            && self.name.as_ref().is_none_or(|n| *n == key.name)
            && self.labels.matches(
                object
                    .pointer("/metadata/labels")
                    .and_then(Value::as_object),
            )
            && self.fields.matches(object)
    }

    /// The watch event `change` makes for this watch, if any.
    pub(crate) fn event(&self, change: &Change) -> Option<Bytes> {
        let before = change
            .old
            .as_deref()
            .filter(|o| self.selects(&change.key, o));
        let after = change
            .new
            .as_deref()
            .filter(|o| self.selects(&change.key, o));
        let (kind, object) = match (before, after) {
            (None, None) => return None,
            (None, Some(new)) => ("ADDED", new.clone()),
            (Some(_), Some(new)) => ("MODIFIED", new.clone()),
            (Some(old), None) => {
                // An object that leaves the selection or is deleted is shown as it was before,
                // at the version of the change that removed it.
                let mut shown = old.clone();
                set_rv(&mut shown, change.rv);
                ("DELETED", shown)
            }
        };
        Some(watch_line(kind, &self.show(object)))
    }

    fn show(&self, mut object: Value) -> Value {
        object["apiVersion"] = Value::String(self.api_version.clone());
        object
    }
}

/// One line of a watch stream.
pub(crate) fn watch_line(kind: &str, object: &Value) -> Bytes {
    let mut line = serde_json::to_vec(&json!({"type": kind, "object": object})).unwrap_or_default();
    line.push(b'\n');
    Bytes::from(line)
}

pub(crate) fn set_rv(object: &mut Value, rv: u64) {
    if let Some(meta) = object.get_mut("metadata").and_then(Value::as_object_mut) {
        meta.insert("resourceVersion".to_owned(), Value::String(rv.to_string()));
    }
}

/// The objects, the history and the open watches of one server.
pub(crate) struct Store {
    pub(crate) registry: Registry,
    pub(crate) rv: u64,
    pub(crate) objects: BTreeMap<Key, Arc<Value>>,
    history: VecDeque<Change>,
    history_limit: usize,
    /// Watches and continue tokens from before this version get 410 Gone.
    pub(crate) oldest: u64,
    pub(crate) watchers: Vec<Watcher>,
    /// Names from `generateName` and uids come from here, seeded by the test.
    pub(crate) rng: fastrand::Rng,
    pub(crate) behaviour: Behaviour,
}

impl Store {
    pub(crate) fn new(
        registry: Registry,
        history_limit: usize,
        seed: u64,
        behaviour: Behaviour,
    ) -> Self {
        Store {
            registry,
            rv: 1,
            objects: BTreeMap::new(),
            history: VecDeque::new(),
            history_limit,
            oldest: 1,
            watchers: Vec::new(),
            rng: fastrand::Rng::with_seed(seed),
            behaviour,
        }
    }

    pub(crate) fn get(&self, key: &Key) -> Option<&Arc<Value>> {
        self.objects.get(key)
    }

    /// Writes `new` at `key` (or deletes it when `None`) with the next resource version, and
    /// tells the watches. Returns the object as stored.
    pub(crate) fn commit(&mut self, key: Key, new: Option<Value>) -> Option<Arc<Value>> {
        self.rv += 1;
        let rv = self.rv;
        let new = new.map(|mut v| {
            set_rv(&mut v, rv);
            Arc::new(v)
        });
        let old = match &new {
            Some(v) => self.objects.insert(key.clone(), v.clone()),
            None => self.objects.remove(&key),
        };
        let change = Change {
            rv,
            key,
            old,
            new: new.clone(),
        };
        self.watchers.retain(|w| match w.event(&change) {
            Some(line) => w.tx.send(line).is_ok(),
            None => !w.tx.is_closed(),
        });
        self.history.push_back(change);
        while self.history.len() > self.history_limit {
            if let Some(dropped) = self.history.pop_front() {
                self.oldest = dropped.rv + 1;
            }
        }
        new
    }

    /// Forgets the history: every watch or continue token from before now gets 410 Gone.
    /// The version moves on by one (as a compaction's own revision does), so a client that
    /// lists afterwards can watch from what it listed.
    pub(crate) fn compact(&mut self) {
        self.rv += 1;
        self.history.clear();
        self.oldest = self.rv + 1;
    }

    /// The changes after `rv`, or 410 when some of them are no longer kept.
    pub(crate) fn since(&self, rv: u64) -> Result<impl Iterator<Item = &Change>, ApiError> {
        if rv.saturating_add(1) < self.oldest {
            return Err(ApiError::expired(format!(
                "too old resource version: {rv} ({})",
                self.oldest - 1
            )));
        }
        Ok(self.history.iter().filter(move |c| c.rv > rv))
    }

    /// The objects of `resource` as they were at `rv` (for a continue token or an exact list).
    pub(crate) fn snapshot(
        &self,
        resource: ResourceId,
        rv: u64,
    ) -> Result<BTreeMap<Key, Arc<Value>>, ApiError> {
        if rv.saturating_add(1) < self.oldest {
            return Err(ApiError::expired(
                "The provided continue parameter is too old to display a consistent list result. You can start a new list without the continue parameter.",
            ));
        }
        let mut objects: BTreeMap<Key, Arc<Value>> = self
            .objects
            .range(
                Key {
                    resource,
                    namespace: String::new(),
                    name: String::new(),
                }..,
            )
            .take_while(|(k, _)| k.resource == resource)
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        for change in self.history.iter().rev().take_while(|c| c.rv > rv) {
            if change.key.resource != resource {
                continue;
            }
            match &change.old {
                Some(old) => objects.insert(change.key.clone(), old.clone()),
                None => objects.remove(&change.key),
            };
        }
        Ok(objects)
    }

    /// The objects of `resource` in `namespace` (all namespaces for `None`).
    pub(crate) fn of(
        &self,
        resource: ResourceId,
        namespace: Option<&str>,
    ) -> impl Iterator<Item = (&Key, &Arc<Value>)> {
        let start = Key {
            resource,
            namespace: namespace.unwrap_or("").to_owned(),
            name: String::new(),
        };
        self.objects.range(start..).take_while(move |(k, _)| {
            k.resource == resource && namespace.is_none_or(|ns| k.namespace == ns)
        })
    }
}

/// `metadata` of an object (an empty map when it has none).
pub(crate) fn meta(object: &Value) -> Option<&Map<String, Value>> {
    object.get("metadata").and_then(Value::as_object)
}

/// `metadata` of an object, made when missing.
pub(crate) fn meta_mut(object: &mut Value) -> &mut Map<String, Value> {
    if !object.get("metadata").is_some_and(Value::is_object) {
        object["metadata"] = Value::Object(Map::new());
    }
    match object.get_mut("metadata") {
        Some(Value::Object(m)) => m,
        // Made an object just above.
        _ => unreachable!("metadata is an object"),
    }
}

pub(crate) fn meta_str<'a>(object: &'a Value, field: &str) -> Option<&'a str> {
    meta(object)
        .and_then(|m| m.get(field))
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
}

pub(crate) fn finalizers(object: &Value) -> Vec<String> {
    meta(object)
        .and_then(|m| m.get("finalizers"))
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(Value::as_str)
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default()
}
