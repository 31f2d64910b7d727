//! Why discovery found no resource for a kind ([`DiscoveryError`]).

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
