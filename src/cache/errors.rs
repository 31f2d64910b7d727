//! Why a cluster's cache cannot be read ([`CacheError`]).

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
