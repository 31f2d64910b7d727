//! The [`Provider`] trait: how clusters are discovered and engaged.

use std::future::Future;

use tokio_util::sync::CancellationToken;

use crate::cluster::{Cluster, ClusterId};
use crate::fleet::Fleet;

/// An error a provider reports.
pub type ProviderError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Discovers clusters and engages them with a manager's [`Fleet`].
///
/// Implement it to bring your own source of clusters. [`Provider::run`] is started by
/// [`Manager::run`](crate::Manager::run) and should watch its source until `shutdown` is
/// cancelled, calling [`Fleet::engage`] for each cluster that appears or changes (a changed
/// endpoint or credentials replaces the cluster) and [`Fleet::disengage`] for each that goes
/// away. One unreachable or malformed cluster should be reported (naming it) and retried,
/// never stop the others.
///
/// ```
/// use kube::Client;
/// use multicluster_runtime::{Cluster, ClusterName, Fleet, Provider, ProviderError};
/// use tokio_util::sync::CancellationToken;
///
/// /// Engages a fixed list of clients, named as given.
/// struct Fixed(Vec<(String, Client)>);
///
/// impl Provider for Fixed {
///     type Id = ClusterName;
///
///     async fn run(&self, fleet: Fleet<ClusterName>, shutdown: CancellationToken) -> Result<(), ProviderError> {
///         for (name, client) in &self.0 {
///             fleet.engage(Cluster::new(ClusterName::from(name), client.clone()))?;
///         }
///         shutdown.cancelled().await;
///         Ok(())
///     }
/// }
/// ```
pub trait Provider: Send + Sync + 'static {
    /// How this provider's clusters are identified.
    type Id: ClusterId;

    /// Discovers clusters and engages them with `fleet` until `shutdown` is cancelled.
    fn run(
        &self,
        fleet: Fleet<Self::Id>,
        shutdown: CancellationToken,
    ) -> impl Future<Output = Result<(), ProviderError>> + Send;

    /// For a provider that always has exactly one cluster, that cluster. Controllers of such
    /// a provider run through kube-runtime's own `Controller`, without any fleet machinery.
    /// The default is `None`.
    fn single(&self) -> Option<Cluster<Self::Id>> {
        None
    }
}
