//! [`Cache`]: a cluster's synced cache of one kind.

use std::sync::Arc;

use super::errors::CacheError;
use super::store::Store;

use super::watch::SharedWatch;
use crate::cache::Watchable;

/// A synced cache of one kind in one cluster, as [`Cluster::cache`](crate::Cluster::cache)
/// returns it: its first complete listing is in. It stays current while the cluster is
/// engaged (a relist keeps serving the old content until the new listing is complete) and
/// freezes when the cluster is disengaged.
pub struct Cache<K: Watchable> {
    watch: Arc<SharedWatch<K>>,
}

impl<K: Watchable> Clone for Cache<K> {
    fn clone(&self) -> Self {
        Self {
            watch: self.watch.clone(),
        }
    }
}

impl<K: Watchable> std::fmt::Debug for Cache<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cache")
            .field("kind", &self.watch.kind())
            .field("objects", &self.watch.store.len())
            .finish()
    }
}

impl<K: Watchable> Cache<K> {
    pub(crate) fn new(watch: Arc<SharedWatch<K>>) -> Self {
        Self { watch }
    }

    /// The store, for `get`, `state`, `find` and the like (kube-runtime's reflector store's
    /// read API, over objects shared rather than copied).
    pub fn store(&self) -> &Store<K> {
        &self.watch.store
    }

    /// The cached objects the field index `index` files under `value`.
    ///
    /// ```no_run
    /// # use multicluster_runtime::{Cluster, ClusterName};
    /// # use k8s_openapi::api::core::v1::ConfigMap;
    /// # use kube::runtime::watcher;
    /// # async fn f(cluster: Cluster<ClusterName>) -> Result<(), multicluster_runtime::CacheError> {
    /// // After `manager.index_field::<ConfigMap>("type", ...)`:
    /// let cache = cluster.cache::<ConfigMap>(&watcher::Config::default()).await?;
    /// let animals = cache.indexed("type", "animal")?;
    /// # Ok(()) }
    /// ```
    pub fn indexed(&self, index: &str, value: &str) -> Result<Vec<Arc<K>>, CacheError> {
        self.watch.indexed(index, value)
    }
}
