//! [`Cache`]: a cluster's synced cache of one kind, and [`CacheError`].

use std::sync::Arc;

use super::store::Store;

use super::watch::SharedWatch;
use crate::Watchable;

/// Why a cluster's cache cannot be read.
#[derive(Clone, Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CacheError {
    /// The cluster is not engaged (not yet, or no longer): it has no caches.
    #[error("cluster {cluster} is not engaged; its caches are gone or not started")]
    NotEngaged {
        /// The cluster asked.
        cluster: String,
    },
    /// Caches run as tasks of a Tokio runtime, and the call came from outside one.
    #[error("cluster {cluster}: caches can only be started from within a Tokio runtime")]
    NoRuntime {
        /// The cluster asked.
        cluster: String,
    },
    /// The watch behind the cache stopped for good (user code panicked in it).
    #[error("cluster {cluster}: the watch of {kind} failed: {reason}")]
    WatchFailed {
        /// The cluster asked.
        cluster: String,
        /// The kind watched.
        kind: String,
        /// What happened.
        reason: String,
    },
    /// The cluster has no field index of that name for that kind.
    #[error(
        "cluster {cluster}: no field index {index:?} for {kind}; register it with Manager::index_field (or Fleet::index_field for provider clusters)"
    )]
    UnknownIndex {
        /// The cluster asked.
        cluster: String,
        /// The kind asked for.
        kind: String,
        /// The index asked for.
        index: String,
    },
    /// The cache did not list within the time given
    /// ([`Cluster::cache_within`](crate::Cluster::cache_within)); it goes on trying.
    #[error("cluster {cluster}: the cache of {kind} did not list within {waited:?}{}", reason.as_ref().map(|r| format!(": {r}")).unwrap_or_default())]
    NotSynced {
        /// The cluster asked.
        cluster: String,
        /// The kind asked for.
        kind: String,
        /// How long it was waited for.
        waited: std::time::Duration,
        /// Why its listing fails, if it does (a kind not served: its CRD not installed;
        /// forbidden; an unreachable server).
        reason: Option<String>,
    },
}

/// Why [`Cluster::discover`](crate::Cluster::discover) found no resource for a kind.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DiscoveryError {
    /// The cluster's API server does not serve the kind (its CRD is not installed there, or
    /// not in that version).
    #[error("cluster {cluster}: {kind} is not served")]
    NotServed {
        /// The cluster asked.
        cluster: String,
        /// The kind, as `group/version/Kind`.
        kind: String,
    },
    /// Discovery failed (an unreachable server, forbidden).
    #[error("cluster {cluster}: discovery of {kind} failed: {source}")]
    Failed {
        /// The cluster asked.
        cluster: String,
        /// The kind, as `group/version/Kind`.
        kind: String,
        /// kube's error.
        #[source]
        source: kube::Error,
    },
}

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
