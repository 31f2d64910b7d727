//! [`Context`]: what a reconciler gets besides the object.

use std::fmt;
use std::sync::Arc;

use kube::Client;
use tokio_util::sync::CancellationToken;

use crate::{Cluster, ClusterId, Fleet, Request};

/// The context of one reconcile: the request, the cluster it is for, the user's state, and
/// the rest of the fleet (for reconcilers that act on other clusters).
///
/// The same reconciler compiles for a single cluster (`C` =
/// [`SingleCluster`](crate::SingleCluster)) and for a fleet (`C` =
/// [`ClusterName`](crate::ClusterName) or your own id):
///
/// ```
/// use std::sync::Arc;
/// use k8s_openapi::api::core::v1::ConfigMap;
/// use multicluster_runtime::{Action, ClusterId, Context};
///
/// async fn reconcile<C: ClusterId>(cm: Arc<ConfigMap>, ctx: Context<C, ()>) -> Result<Action, kube::Error> {
///     tracing::info!(request = %ctx.request(), "reconciling");
///     let _client = ctx.client();
///     Ok(Action::await_change())
/// }
/// ```
pub struct Context<C: ClusterId, S> {
    request: Request<C>,
    cluster: Cluster<C>,
    state: Arc<S>,
    fleet: Fleet<C>,
    local: Option<Cluster<C>>,
    shutdown: CancellationToken,
}

impl<C: ClusterId, S> Clone for Context<C, S> {
    fn clone(&self) -> Self {
        Self {
            request: self.request.clone(),
            cluster: self.cluster.clone(),
            state: self.state.clone(),
            fleet: self.fleet.clone(),
            local: self.local.clone(),
            shutdown: self.shutdown.clone(),
        }
    }
}

impl<C: ClusterId, S> fmt::Debug for Context<C, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Context")
            .field("request", &self.request)
            .finish_non_exhaustive()
    }
}

impl<C: ClusterId, S> Context<C, S> {
    pub(crate) fn new(
        request: Request<C>,
        cluster: Cluster<C>,
        state: Arc<S>,
        fleet: Fleet<C>,
        local: Option<Cluster<C>>,
        shutdown: CancellationToken,
    ) -> Self {
        Self {
            request,
            cluster,
            state,
            fleet,
            local,
            shutdown,
        }
    }

    /// What is being reconciled: the cluster's id and the object's key.
    pub fn request(&self) -> &Request<C> {
        &self.request
    }

    /// The id of the cluster the object lives in.
    pub fn cluster_id(&self) -> &C {
        &self.request.cluster
    }

    /// The cluster the object lives in.
    pub fn cluster(&self) -> &Cluster<C> {
        &self.cluster
    }

    /// A client for the cluster the object lives in.
    pub fn client(&self) -> Client {
        self.cluster.client()
    }

    /// The state given to the controller.
    pub fn state(&self) -> &S {
        &self.state
    }

    /// The state given to the controller, as a shared pointer.
    pub fn state_arc(&self) -> Arc<S> {
        self.state.clone()
    }

    /// Another cluster of the fleet (or the manager's local cluster), by id.
    pub fn cluster_by_id(&self, id: &C) -> Option<Cluster<C>> {
        if let Some(local) = &self.local
            && local.id() == id
        {
            return Some(local.clone());
        }
        self.fleet.get(id)
    }

    /// The fleet: every engaged cluster.
    pub fn fleet(&self) -> &Fleet<C> {
        &self.fleet
    }

    /// The manager's local (host) cluster, if it has one.
    pub fn local(&self) -> Option<&Cluster<C>> {
        self.local.as_ref()
    }

    /// Whether the reconcile should stop early: its cluster was disengaged, or the manager
    /// is shutting down.
    pub fn is_cancelled(&self) -> bool {
        !self.cluster.is_engaged() || self.shutdown.is_cancelled()
    }

    /// Completes when [`Context::is_cancelled`] turns true; select on it to abandon work.
    pub async fn cancelled(&self) {
        tokio::select! {
            () = self.cluster.disengaged() => {}
            () = self.shutdown.cancelled() => {}
        }
    }
}
