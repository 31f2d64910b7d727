//! [`SingleProvider`]: one fixed cluster.

use kube::Client;
use tokio_util::sync::CancellationToken;

use crate::cluster::{Cluster, SingleCluster};
use crate::fleet::Fleet;
use crate::provider::{Provider, ProviderError};

/// Exactly one cluster, identified by the zero-sized [`SingleCluster`].
///
/// Controllers of a `Manager<SingleProvider>` run through kube-runtime's own `Controller`:
/// the same reconciler code as in a fleet, with no fleet queue, task or channel in between.
#[derive(Clone, Debug)]
pub struct SingleProvider {
    cluster: Cluster<SingleCluster>,
}

impl SingleProvider {
    /// The cluster `client` reaches.
    pub fn new(client: Client) -> Self {
        Self {
            cluster: Cluster::new(SingleCluster, client),
        }
    }

    /// The cluster `config` reaches.
    pub fn from_config(config: kube::Config) -> Result<Self, kube::Error> {
        Ok(Self {
            cluster: Cluster::from_config(SingleCluster, config)?,
        })
    }

    /// The cluster of the environment: `$KUBECONFIG` or `~/.kube/config`, else the in-cluster
    /// service account (as `kube::Config::infer`).
    pub async fn infer() -> Result<Self, kube::Error> {
        let config = kube::Config::infer()
            .await
            .map_err(kube::Error::InferConfig)?;
        Self::from_config(config)
    }

    /// The cluster.
    pub fn cluster(&self) -> &Cluster<SingleCluster> {
        &self.cluster
    }
}

impl Provider for SingleProvider {
    type Id = SingleCluster;

    async fn run(
        &self,
        fleet: Fleet<SingleCluster>,
        shutdown: CancellationToken,
    ) -> Result<(), ProviderError> {
        fleet.engage(self.cluster.clone())?;
        shutdown.cancelled().await;
        Ok(())
    }

    fn single(&self) -> Option<Cluster<SingleCluster>> {
        Some(self.cluster.clone())
    }
}
