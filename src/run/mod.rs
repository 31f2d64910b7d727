//! What a manager's run hands each of its parts: the fleet, the shutdown and grace, the
//! cache settings, the tenure ([`Env`]); the per-cluster tasks started under it; and the
//! [`component::Component`]s it runs beside the controllers, with their one lifecycle.

pub(crate) mod cluster_task;
pub(crate) mod component;
pub(crate) mod credentials;

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::cache::WatchBackoff;
use crate::cache::namespaces::NamespaceScopes;
use crate::cache::transform::Transforms;
use crate::cluster::{Cluster, ClusterId};
use crate::fleet::Fleet;
use crate::lease::tenure::Tenure;
use crate::metrics::Metrics;

/// Where a controller runs: what a manager's run hands it.
pub(crate) struct Env<C: ClusterId> {
    pub(crate) fleet: Fleet<C>,
    pub(crate) local: Option<Cluster<C>>,
    pub(crate) shutdown: CancellationToken,
    pub(crate) grace: Grace,
    pub(crate) backoff: WatchBackoff,
    pub(crate) metrics: Option<Metrics>,
    /// What caches keep of each object (single mode applies them to its controller's store).
    pub(crate) transforms: Arc<Transforms>,
    /// The namespaces each kind is watched in (single mode builds its own watches).
    pub(crate) namespaces: Arc<NamespaceScopes>,
    /// Watches list in pages, never by streaming lists (`Manager::paged_lists`).
    pub(crate) paged_lists: bool,
    /// Who this replica is, in the Events it records (the leader election identity, or the
    /// host name: the pod's name in a cluster).
    pub(crate) instance: Arc<str>,
    /// Until when this replica may start reconciles: its leader Lease's renew deadline for
    /// the leader's controllers, its fences' for a sharded manager's, unbounded otherwise.
    pub(crate) tenure: Arc<Tenure>,
    /// Where fleet controllers answer for their queues, while the endpoints serve the
    /// diagnostics view (`None`: no view, nothing kept for it).
    pub(crate) diagnostics: Option<Arc<crate::diagnostics::Controllers<C>>>,
}

/// How long reconciles in flight at shutdown are awaited.
#[derive(Clone)]
pub(crate) struct Grace {
    pub(crate) timeout: Duration,
    /// Cancelled when they are to be dropped at once instead (leadership lost: another
    /// replica may be acting already).
    pub(crate) abort: CancellationToken,
}

impl Grace {
    /// Completes when reconciles still in flight are no longer awaited: the graceful timeout
    /// has passed, or the run aborts.
    pub(crate) async fn over(&self) {
        tokio::select! {
            () = tokio::time::sleep(self.timeout) => {}
            () = self.abort.cancelled() => {}
        }
    }
}

impl<C: ClusterId> Clone for Env<C> {
    fn clone(&self) -> Self {
        Self {
            fleet: self.fleet.clone(),
            local: self.local.clone(),
            shutdown: self.shutdown.clone(),
            grace: self.grace.clone(),
            backoff: self.backoff.clone(),
            metrics: self.metrics.clone(),
            transforms: self.transforms.clone(),
            namespaces: self.namespaces.clone(),
            paged_lists: self.paged_lists,
            instance: self.instance.clone(),
            tenure: self.tenure.clone(),
            diagnostics: self.diagnostics.clone(),
        }
    }
}
