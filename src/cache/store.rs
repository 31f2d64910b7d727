//! [`Store`]: the objects a cluster's watch of one kind holds, shared as `Arc<K>`.
//!
//! The crate keeps its own store rather than kube-runtime's reflector store because that one
//! copies every object it is given into a new `Arc`: a watch fed by a shared source (every
//! namespace-cluster of a [`Namespaces`](crate::providers::Namespaces) provider is fed by one
//! host watch per kind) would hold its own deep copy of each object. This store keeps the
//! `Arc` it is handed, so the host's copy is the only one, and a namespace-cluster's store
//! costs one table slot per object. The read API is kube-runtime's (`get` with an
//! [`ObjectRef`], `state`, `find`, `state_filter`, `len`), so code written against that store
//! reads this one unchanged.

use std::fmt;
use std::hash::BuildHasher;
use std::sync::{Arc, RwLock};

use hashbrown::{DefaultHashBuilder, HashTable};
use kube::core::{Selector, SelectorExt};
use kube::{Resource, ResourceExt};
use kube_runtime::reflector::ObjectRef;

use crate::util::sync::{read, write};

/// The objects of one kind a cluster's watch holds: what its last complete listing and the
/// changes since then say. A cheap, clonable read handle; see [`Cache`](crate::Cache).
///
/// Like any cache it may lag the API server: a reconciler that must act on the newest version
/// reads through the cluster's client.
pub struct Store<K> {
    backing: Backing<K>,
}

/// Where a store's objects are: in a table of the crate's own, or in the reflector store of a
/// single-cluster controller (kube-runtime's, which that controller's scheduler reads), so a
/// context cache of the controller's own kind reads the objects the controller's watch holds.
enum Backing<K> {
    Own(Arc<RwLock<Objects<K>>>),
    Reflector(Arc<dyn Reflected<K>>),
}

/// A read-only view of kube-runtime's reflector store (object-safe: kube-runtime's store has
/// bounds on its type this crate's store does not carry).
pub(crate) trait Reflected<K>: Send + Sync {
    fn get(&self, namespace: Option<&str>, name: &str) -> Option<Arc<K>>;
    fn state(&self) -> Vec<Arc<K>>;
    fn find(&self, predicate: &dyn Fn(&K) -> bool) -> Option<Arc<K>>;
    fn state_filter(&self, predicate: &dyn Fn(&K) -> bool) -> Vec<Arc<K>>;
    fn len(&self) -> usize;
}

/// kube-runtime's reflector store with the dynamic type its keys need.
struct Reflector<K: Resource + 'static>
where
    K::DynamicType: std::hash::Hash + Eq,
{
    store: kube_runtime::reflector::Store<K>,
    dt: K::DynamicType,
}

impl<K> Reflected<K> for Reflector<K>
where
    K: Resource + Clone + Send + Sync + 'static,
    K::DynamicType: std::hash::Hash + Eq + Clone + Send + Sync,
{
    fn get(&self, namespace: Option<&str>, name: &str) -> Option<Arc<K>> {
        let mut key = ObjectRef::new_with(name, self.dt.clone());
        key.namespace = namespace.map(str::to_string);
        self.store.get(&key)
    }
    fn state(&self) -> Vec<Arc<K>> {
        self.store.state()
    }
    fn find(&self, predicate: &dyn Fn(&K) -> bool) -> Option<Arc<K>> {
        self.store.find(|o| predicate(o))
    }
    fn state_filter(&self, predicate: &dyn Fn(&K) -> bool) -> Vec<Arc<K>> {
        self.store.state_filter(|o| predicate(o))
    }
    fn len(&self) -> usize {
        self.store.len()
    }
}

impl<K> Clone for Store<K> {
    fn clone(&self) -> Self {
        Self {
            backing: match &self.backing {
                Backing::Own(objects) => Backing::Own(objects.clone()),
                Backing::Reflector(store) => Backing::Reflector(store.clone()),
            },
        }
    }
}

impl<K: Resource> fmt::Debug for Store<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Store")
            .field("objects", &self.len())
            .finish()
    }
}

/// An object's namespace and name: how the crate tells objects of one kind apart, for kinds
/// known at compile time and at run time alike (kube-runtime's `ObjectRef` needs the dynamic
/// type to be built).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct ObjectKey {
    pub(crate) namespace: Option<String>,
    pub(crate) name: String,
}

impl ObjectKey {
    /// The key of `object`.
    pub(crate) fn of<K: Resource>(object: &K) -> Self {
        let meta = object.meta();
        Self {
            namespace: meta.namespace.clone(),
            name: meta.name.clone().unwrap_or_default(),
        }
    }
}

/// Objects keyed by namespace and name, each key taken from the object itself (no copy of it).
struct Objects<K> {
    table: HashTable<Arc<K>>,
    hasher: DefaultHashBuilder,
}

impl<K: Resource> Objects<K> {
    fn new() -> Self {
        Self {
            table: HashTable::new(),
            hasher: DefaultHashBuilder::default(),
        }
    }

    fn hash(hasher: &DefaultHashBuilder, namespace: Option<&str>, name: &str) -> u64 {
        hasher.hash_one((namespace, name))
    }

    fn key(object: &K) -> (Option<&str>, &str) {
        let meta = object.meta();
        (
            meta.namespace.as_deref(),
            meta.name.as_deref().unwrap_or_default(),
        )
    }

    fn get(&self, namespace: Option<&str>, name: &str) -> Option<&Arc<K>> {
        let hash = Self::hash(&self.hasher, namespace, name);
        self.table.find(hash, |o| Self::key(o) == (namespace, name))
    }

    /// Inserts or replaces the object with the same namespace and name.
    fn insert(&mut self, object: Arc<K>) {
        let (namespace, name) = Self::key(&object);
        let hash = Self::hash(&self.hasher, namespace, name);
        let hasher = &self.hasher;
        match self.table.entry(
            hash,
            |o| Self::key(o) == (namespace, name),
            |o| {
                let (namespace, name) = Self::key(o);
                Self::hash(hasher, namespace, name)
            },
        ) {
            hashbrown::hash_table::Entry::Occupied(mut slot) => *slot.get_mut() = object,
            hashbrown::hash_table::Entry::Vacant(slot) => {
                slot.insert(object);
            }
        }
    }

    fn remove(&mut self, namespace: Option<&str>, name: &str) -> Option<Arc<K>> {
        let hash = Self::hash(&self.hasher, namespace, name);
        self.table
            .find_entry(hash, |o| Self::key(o) == (namespace, name))
            .ok()
            .map(|slot| slot.remove().0)
    }
}

impl<K: Resource> Store<K> {
    /// A store that reads kube-runtime's reflector store `store` (written by a single-cluster
    /// controller's reflector), `dt` being the kind's dynamic type.
    pub(crate) fn of_reflector(store: kube_runtime::reflector::Store<K>, dt: K::DynamicType) -> Self
    where
        K: Clone + Send + Sync + 'static,
        K::DynamicType: std::hash::Hash + Eq + Clone + Send + Sync,
    {
        Self {
            backing: Backing::Reflector(Arc::new(Reflector { store, dt })),
        }
    }

    /// The object `key` names, if the store holds it. For a cluster-scoped kind the key's
    /// namespace is ignored (as kube-runtime's store does).
    ///
    /// ```no_run
    /// # use multicluster_runtime::{Cluster, ClusterName};
    /// # use k8s_openapi::api::core::v1::Secret;
    /// # use kube::runtime::{reflector::ObjectRef, watcher};
    /// # async fn f(cluster: Cluster<ClusterName>) -> Result<(), multicluster_runtime::CacheError> {
    /// let secrets = cluster.cache::<Secret>(&watcher::Config::default()).await?;
    /// let tls = secrets.store().get(&ObjectRef::new("tls").within("default"));
    /// # Ok(()) }
    /// ```
    #[must_use]
    pub fn get(&self, key: &ObjectRef<K>) -> Option<Arc<K>> {
        self.get_named(key.namespace.as_deref(), &key.name)
    }

    /// The object of `namespace` and `name`, as [`get`](Self::get) finds it.
    pub(crate) fn get_named(&self, namespace: Option<&str>, name: &str) -> Option<Arc<K>> {
        let objects = match &self.backing {
            Backing::Own(objects) => read(objects),
            Backing::Reflector(store) => return store.get(namespace, name),
        };
        objects
            .get(namespace, name)
            .or_else(|| namespace.and_then(|_| objects.get(None, name)))
            .cloned()
    }

    /// The object `key` names, as [`get`](Self::get) finds it.
    pub(crate) fn get_key(&self, key: &ObjectKey) -> Option<Arc<K>> {
        self.get_named(key.namespace.as_deref(), &key.name)
    }

    /// Every object in the store, in no particular order.
    #[must_use]
    pub fn state(&self) -> Vec<Arc<K>> {
        match &self.backing {
            Backing::Own(objects) => read(objects).table.iter().cloned().collect(),
            Backing::Reflector(store) => store.state(),
        }
    }

    /// An object `predicate` accepts, if there is one.
    ///
    /// The store stays locked for reading while `predicate` runs: keep it quick.
    #[must_use]
    pub fn find(&self, predicate: impl Fn(&K) -> bool) -> Option<Arc<K>> {
        match &self.backing {
            Backing::Own(objects) => read(objects).table.iter().find(|o| predicate(o)).cloned(),
            Backing::Reflector(store) => store.find(&predicate),
        }
    }

    /// The objects `predicate` accepts.
    ///
    /// The store stays locked for reading while `predicate` runs: keep it quick.
    #[must_use]
    pub fn state_filter(&self, predicate: impl Fn(&K) -> bool) -> Vec<Arc<K>> {
        match &self.backing {
            Backing::Own(objects) => read(objects)
                .table
                .iter()
                .filter(|o| predicate(o))
                .cloned()
                .collect(),
            Backing::Reflector(store) => store.state_filter(&predicate),
        }
    }

    /// The objects whose labels `selector` matches.
    #[must_use]
    pub fn state_filter_selector(&self, selector: &Selector) -> Vec<Arc<K>> {
        self.state_filter(|o| selector.matches(o.labels()))
    }

    /// How many objects the store holds.
    #[must_use]
    pub fn len(&self) -> usize {
        match &self.backing {
            Backing::Own(objects) => read(objects).table.len(),
            Backing::Reflector(store) => store.len(),
        }
    }

    /// Whether the store holds no object.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// What a watch applies its events to. A listing is gathered aside and swapped in whole at
/// its end, so the store keeps serving the previous content while a relist runs.
pub(crate) struct Writer<K> {
    objects: Arc<RwLock<Objects<K>>>,
    listing: Option<Objects<K>>,
}

impl<K: Resource> Writer<K> {
    pub(crate) fn new() -> Self {
        Self {
            objects: Arc::new(RwLock::new(Objects::new())),
            listing: None,
        }
    }

    /// A read handle to the store.
    pub(crate) fn as_reader(&self) -> Store<K> {
        Store {
            backing: Backing::Own(self.objects.clone()),
        }
    }

    /// Stores `object` (replacing the one of the same namespace and name).
    pub(crate) fn apply(&mut self, object: Arc<K>) {
        write(&self.objects).insert(object);
    }

    /// Removes the object of `object`'s namespace and name.
    pub(crate) fn delete(&mut self, object: &K) {
        let (namespace, name) = Objects::key(object);
        write(&self.objects).remove(namespace, name);
    }

    /// A listing begins.
    pub(crate) fn init(&mut self) {
        self.listing = Some(Objects::new());
    }

    /// One object of the listing.
    pub(crate) fn init_apply(&mut self, object: Arc<K>) {
        self.listing.get_or_insert_with(Objects::new).insert(object);
    }

    /// The listing is complete: it becomes the store's content.
    pub(crate) fn init_done(&mut self) {
        let listing = self.listing.take().unwrap_or_else(Objects::new);
        *write(&self.objects) = listing;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{ConfigMap, Node};
    use kube::api::ObjectMeta;

    fn cm(ns: &str, name: &str, version: &str) -> Arc<ConfigMap> {
        Arc::new(ConfigMap {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some(ns.into()),
                resource_version: Some(version.into()),
                labels: Some([("app".to_string(), name.to_string())].into()),
                ..Default::default()
            },
            ..Default::default()
        })
    }

    fn version(o: Option<Arc<ConfigMap>>) -> Option<String> {
        o?.metadata.resource_version.clone()
    }

    #[test]
    fn objects_are_kept_as_given_keyed_by_namespace_and_name() {
        let mut writer = Writer::new();
        let store = writer.as_reader();
        let zoo = cm("zoo", "lion", "1");
        writer.apply(zoo.clone());
        writer.apply(cm("jungle", "lion", "2"));
        assert!(
            Arc::ptr_eq(
                &store.get(&ObjectRef::new("lion").within("zoo")).unwrap(),
                &zoo
            ),
            "the store keeps the Arc it was given, not a copy"
        );
        assert_eq!(
            version(store.get(&ObjectRef::new("lion").within("jungle"))),
            Some("2".into())
        );
        assert!(store.get(&ObjectRef::new("lion")).is_none());
        // Replacing and deleting go by namespace and name only.
        writer.apply(cm("zoo", "lion", "3"));
        assert_eq!(store.len(), 2);
        assert_eq!(
            version(store.get(&ObjectRef::new("lion").within("zoo"))),
            Some("3".into())
        );
        writer.delete(&cm("zoo", "lion", "9"));
        assert!(store.get(&ObjectRef::new("lion").within("zoo")).is_none());
        assert_eq!(store.len(), 1);
        assert_eq!(
            store
                .find(|o| o.metadata.namespace.as_deref() == Some("jungle"))
                .map(|o| o.metadata.name.clone()),
            Some(Some("lion".into()))
        );
        let selector: Selector = kube::core::Expression::Equal("app".into(), "lion".into()).into();
        assert_eq!(store.state_filter_selector(&selector).len(), 1);
        let other: Selector = kube::core::Expression::Equal("app".into(), "tiger".into()).into();
        assert!(store.state_filter_selector(&other).is_empty());
    }

    #[test]
    fn a_cluster_scoped_object_is_found_whatever_namespace_the_key_names() {
        let mut writer = Writer::<Node>::new();
        let store = writer.as_reader();
        let mut node = Node::default();
        node.metadata.name = Some("n1".into());
        writer.apply(Arc::new(node));
        assert!(store.get(&ObjectRef::new("n1")).is_some());
        assert!(store.get(&ObjectRef::new("n1").within("zoo")).is_some());
        assert!(store.get(&ObjectRef::new("n2")).is_none());
    }

    #[test]
    fn a_listing_replaces_the_content_only_when_complete() {
        let mut writer = Writer::new();
        let store = writer.as_reader();
        writer.apply(cm("zoo", "old", "1"));
        writer.init();
        writer.init_apply(cm("zoo", "new", "2"));
        assert_eq!(
            store.state().len(),
            1,
            "the old content is served during the listing"
        );
        assert!(store.get(&ObjectRef::new("old").within("zoo")).is_some());
        writer.init_done();
        assert!(store.get(&ObjectRef::new("old").within("zoo")).is_none());
        assert!(store.get(&ObjectRef::new("new").within("zoo")).is_some());
        assert!(!store.is_empty());
        // An empty listing empties the store.
        writer.init();
        writer.init_done();
        assert!(store.is_empty());
    }
}
