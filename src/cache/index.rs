//! Field indexes over a cluster's cached objects, registered once for the whole fleet
//! ([`Fleet::index_field`](crate::Fleet::index_field)) and kept up to date by each watch.

use crate::util::hashing::{HashMap, HashSet};
use std::any::{Any, TypeId};
use std::sync::Arc;

use kube::Resource;

use super::store::ObjectKey;

/// Computes the values an object is indexed under.
pub(crate) type Extract<K> = Arc<dyn Fn(&K) -> Vec<String> + Send + Sync>;

/// A registered index, independent of the kind it indexes.
#[derive(Clone)]
pub(crate) struct Indexer {
    kind: TypeId,
    pub(crate) name: Arc<str>,
    /// An `Extract<K>` for the kind `kind`.
    extract: Arc<dyn Any + Send + Sync>,
}

impl Indexer {
    pub(crate) fn new<K: 'static>(
        name: &str,
        extract: impl Fn(&K) -> Vec<String> + Send + Sync + 'static,
    ) -> Self {
        let extract: Extract<K> = Arc::new(extract);
        Self {
            kind: TypeId::of::<K>(),
            name: Arc::from(name),
            extract: Arc::new(extract),
        }
    }

    /// The kind it indexes.
    pub(crate) fn kind(&self) -> TypeId {
        self.kind
    }

    /// Whether `other` indexes the same kind under the same name.
    pub(crate) fn same_as(&self, other: &Self) -> bool {
        self.kind == other.kind && self.name == other.name
    }

    /// The extractor, if this indexer is for `K`.
    pub(crate) fn extract<K: 'static>(&self) -> Option<Extract<K>> {
        self.extract.downcast_ref::<Extract<K>>().cloned()
    }
}

/// Every field index of one watch.
pub(crate) struct FieldIndexes<K: Resource> {
    indexes: HashMap<Arc<str>, FieldIndex<K>>,
}

struct FieldIndex<K: Resource> {
    extract: Extract<K>,
    by_value: HashMap<String, HashSet<ObjectKey>>,
    /// The values each object is indexed under now, to remove them when it changes.
    by_object: HashMap<ObjectKey, Vec<String>>,
}

impl<K: Resource> Default for FieldIndexes<K> {
    fn default() -> Self {
        Self {
            indexes: HashMap::default(),
        }
    }
}

impl<K: Resource> FieldIndex<K> {
    fn remove(&mut self, key: &ObjectKey) {
        for value in self.by_object.remove(key).into_iter().flatten() {
            if let Some(set) = self.by_value.get_mut(&value) {
                set.remove(key);
                if set.is_empty() {
                    self.by_value.remove(&value);
                }
            }
        }
    }

    fn insert(&mut self, obj: &K) {
        let key = ObjectKey::of(obj);
        self.remove(&key);
        let values = (self.extract)(obj);
        for value in &values {
            self.by_value
                .entry(value.clone())
                .or_default()
                .insert(key.clone());
        }
        if !values.is_empty() {
            self.by_object.insert(key, values);
        }
    }
}

impl<K: Resource> FieldIndexes<K> {
    /// Adds an index (if none of that name exists) and fills it from `objects`.
    pub(crate) fn add<'a>(
        &mut self,
        name: Arc<str>,
        extract: Extract<K>,
        objects: impl IntoIterator<Item = &'a K>,
    ) where
        K: 'a,
    {
        if self.indexes.contains_key(&name) {
            return;
        }
        let mut index = FieldIndex {
            extract,
            by_value: HashMap::default(),
            by_object: HashMap::default(),
        };
        for obj in objects {
            index.insert(obj);
        }
        self.indexes.insert(name, index);
    }

    /// `obj` was created or changed.
    pub(crate) fn apply(&mut self, obj: &K) {
        for index in self.indexes.values_mut() {
            index.insert(obj);
        }
    }

    /// `obj` was deleted.
    pub(crate) fn delete(&mut self, obj: &K) {
        let key = ObjectKey::of(obj);
        for index in self.indexes.values_mut() {
            index.remove(&key);
        }
    }

    /// The store was replaced by a new listing: index `objects` afresh.
    pub(crate) fn rebuild<'a>(&mut self, objects: impl IntoIterator<Item = &'a K> + Clone)
    where
        K: 'a,
    {
        for index in self.indexes.values_mut() {
            index.by_value.clear();
            index.by_object.clear();
            for obj in objects.clone() {
                index.insert(obj);
            }
        }
    }

    /// The objects indexed under `value` by `index`; `None` if there is no such index.
    pub(crate) fn lookup(&self, index: &str, value: &str) -> Option<Vec<ObjectKey>> {
        let index = self.indexes.get(index)?;
        Some(
            index
                .by_value
                .get(value)
                .map(|set| set.iter().cloned().collect())
                .unwrap_or_default(),
        )
    }

    /// Whether nothing is indexed (no index registered).
    pub(crate) fn is_empty(&self) -> bool {
        self.indexes.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::api::ObjectMeta;
    use std::collections::BTreeMap;

    fn cm(name: &str, kind: &str) -> ConfigMap {
        ConfigMap {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("ns".into()),
                labels: Some(BTreeMap::from([("type".to_string(), kind.to_string())])),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    fn by_type() -> Extract<ConfigMap> {
        Arc::new(|cm: &ConfigMap| {
            cm.metadata
                .labels
                .iter()
                .flatten()
                .filter(|(k, _)| *k == "type")
                .map(|(_, v)| v.clone())
                .collect()
        })
    }

    fn names(refs: Option<Vec<ObjectKey>>) -> Vec<String> {
        let mut names: Vec<String> = refs.unwrap().into_iter().map(|r| r.name).collect();
        names.sort();
        names
    }

    #[test]
    fn objects_move_between_values_as_they_change_and_leave_when_deleted() {
        let mut ix = FieldIndexes::default();
        let existing = [cm("a", "animal"), cm("b", "thing")];
        ix.add("type".into(), by_type(), existing.iter());
        assert_eq!(names(ix.lookup("type", "animal")), ["a"]);
        ix.apply(&cm("b", "animal"));
        assert_eq!(names(ix.lookup("type", "animal")), ["a", "b"]);
        assert!(names(ix.lookup("type", "thing")).is_empty());
        ix.delete(&cm("a", "animal"));
        assert_eq!(names(ix.lookup("type", "animal")), ["b"]);
        ix.rebuild([cm("c", "human")].iter());
        assert!(names(ix.lookup("type", "animal")).is_empty());
        assert_eq!(names(ix.lookup("type", "human")), ["c"]);
        assert!(ix.lookup("other", "x").is_none(), "unknown index");
    }

    #[test]
    fn an_indexer_hands_its_extractor_only_to_its_own_kind() {
        let ix = Indexer::new::<ConfigMap>("type", |_: &ConfigMap| vec![]);
        assert!(ix.extract::<ConfigMap>().is_some());
        assert!(ix.extract::<k8s_openapi::api::core::v1::Secret>().is_none());
        assert_eq!(ix.kind(), TypeId::of::<ConfigMap>());
    }
}
