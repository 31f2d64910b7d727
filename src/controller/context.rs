//! [`Context`]: what a reconciler gets besides the object.

use kube_runtime::events::{Recorder, Reporter};
use std::fmt;
use std::sync::{Arc, OnceLock};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::{Client, Resource};
use tokio_util::sync::CancellationToken;

use crate::cluster::{Cluster, ClusterId};
use crate::controller::Request;
use crate::fleet::FleetView;

/// The context of one reconcile: the request, the cluster it is for, the user's state, and
/// the rest of the fleet (for reconcilers that act on other clusters).
///
/// The same reconciler compiles for a single cluster (`C` =
/// [`SingleCluster`](crate::SingleCluster)) and for a fleet (`C` =
/// [`ClusterName`](crate::ClusterName) or your own id):
///
/// ```
/// use std::sync::{Arc, OnceLock};
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
    shared: Arc<ReconcileShared<C, S>>,
    cluster: Cluster<C>,
    /// The cluster's engagement this reconcile runs in (fleet mode); cancelled when it ends.
    /// Single-cluster mode has none: its one cluster stays engaged while the manager runs.
    engagement: Option<CancellationToken>,
    /// Built on first use from `object` in single-cluster mode (where most reconcilers never
    /// ask for it, and building it would cost two string copies per reconcile).
    request: OnceLock<Request<C>>,
    object: Option<Arc<dyn HasMeta>>,
    /// How many times in a row this object failed (or backed off) before this reconcile.
    failures: u32,
    /// When the controller's reconcile timeout ends this reconcile, if it has one.
    deadline: Option<tokio::time::Instant>,
}

/// What every reconcile of one controller shares; one reference count per reconcile.
pub(crate) struct ReconcileShared<C: ClusterId, S> {
    pub(crate) state: Arc<S>,
    pub(crate) fleet: FleetView<C>,
    pub(crate) local: Option<Cluster<C>>,
    pub(crate) shutdown: CancellationToken,
    /// The controller and replica, as its Events name them.
    pub(crate) reporter: Reporter,
    /// Cancelled when the run's reconciles are dropped at once (leadership lost).
    pub(crate) abort: CancellationToken,
    /// Until when this replica may act (its leader Lease, its fences).
    pub(crate) tenure: Arc<crate::lease::tenure::Tenure>,
    /// The failures in a row of each object of the controller.
    pub(crate) failures: super::Failures<Request<C>>,
}

impl<C: ClusterId, S> ReconcileShared<C, S> {
    /// What the reconciles of the controller `spec` share in one run (`env`), in either mode.
    pub(crate) fn new<K: crate::cache::Watchable>(
        spec: &super::Spec<K, C>,
        env: &crate::run::Env<C>,
        state: Arc<S>,
    ) -> Self {
        Self {
            state,
            fleet: FleetView::new(env.fleet.clone()),
            local: env.local.clone(),
            shutdown: env.shutdown.clone(),
            reporter: Reporter {
                controller: spec.name.to_string(),
                instance: Some(env.instance.to_string()),
            },
            abort: env.grace.abort.clone(),
            tenure: env.tenure.clone(),
            failures: super::Failures::new(spec.failure_backoff),
        }
    }
}

/// Object metadata behind a type-erased pointer.
trait HasMeta: Send + Sync {
    fn object_meta(&self) -> &ObjectMeta;
}

impl<K: Resource + Send + Sync> HasMeta for K {
    fn object_meta(&self) -> &ObjectMeta {
        self.meta()
    }
}

impl<C: ClusterId, S> Clone for Context<C, S> {
    fn clone(&self) -> Self {
        Self {
            shared: self.shared.clone(),
            cluster: self.cluster.clone(),
            engagement: self.engagement.clone(),
            request: self.request.clone(),
            object: self.object.clone(),
            failures: self.failures,
            deadline: self.deadline,
        }
    }
}

impl<C: ClusterId, S> fmt::Debug for Context<C, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Context")
            .field("request", self.request())
            .finish_non_exhaustive()
    }
}

impl<C: ClusterId, S> Context<C, S> {
    /// A context for `object`, reconciled for `request` in one engagement of its cluster
    /// (fleet mode). Where the request is the object's own key, as it is but for a mapped
    /// request that gave a cluster-scoped object a namespace, it is made from the object when
    /// asked for, as in single-cluster mode: most reconcilers never ask, and keeping it would
    /// cost two string copies per reconcile and two more per clone of the context.
    pub(crate) fn new<K: Resource + Send + Sync + 'static>(
        request: &Request<C>,
        object: Arc<K>,
        cluster: Cluster<C>,
        engagement: CancellationToken,
        shared: Arc<ReconcileShared<C, S>>,
    ) -> Self {
        let meta = object.meta();
        let own_key = request.cluster == *cluster.id()
            && request.namespace == meta.namespace
            && request.name == meta.name.as_deref().unwrap_or_default();
        // The cluster holds the object: a native owner reference to it there needs no check.
        if let Some(uid) = &meta.uid {
            cluster.holds_uid(meta.namespace.as_deref(), uid);
        }
        let mut ctx = Self::for_object(object, cluster, shared);
        ctx.engagement = Some(engagement);
        if !own_key {
            ctx.request = OnceLock::from(request.clone());
        }
        ctx
    }

    /// A context outside a running manager, for tests of a reconciler: the reconcile of
    /// `request` (for `object`) in `cluster`, with `fleet` as the rest of the fleet, `local`
    /// as the manager's local cluster and `state` as the controller's state. Cancelling `engagement` is what a disengagement
    /// does to a reconcile in flight ([`Context::is_cancelled`] turns true). Events report
    /// as the controller `reconciler` of no replica.
    ///
    /// The fake crate's schedule checker makes its contexts with it; a plain unit test can
    /// too.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use k8s_openapi::api::core::v1::ConfigMap;
    /// use multicluster_runtime::{Cluster, ClusterName, Context, Fleet, Request};
    /// use tokio_util::sync::CancellationToken;
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// # let client = kube::Client::new(tower::service_fn(|_: http::Request<kube::client::Body>| async {
    /// #     Ok::<_, std::convert::Infallible>(http::Response::new(kube::client::Body::empty()))
    /// # }), "default");
    /// let fleet = Fleet::new();
    /// let cluster = Cluster::new(ClusterName::from("a"), client);
    /// let mut cm = ConfigMap::default();
    /// cm.metadata.name = Some("x".into());
    /// cm.metadata.namespace = Some("default".into());
    /// let request = Request::new(ClusterName::from("a"), Some("default"), "x");
    /// let ctx: Context<ClusterName, ()> =
    ///     Context::detached(request, Arc::new(cm), cluster, &fleet, None, Arc::new(()), CancellationToken::new());
    /// assert_eq!(ctx.request().name, "x");
    /// assert!(!ctx.is_cancelled());
    /// # }
    /// ```
    pub fn detached<K: Resource + Send + Sync + 'static>(
        request: Request<C>,
        object: Arc<K>,
        cluster: Cluster<C>,
        fleet: &crate::fleet::Fleet<C>,
        local: Option<Cluster<C>>,
        state: Arc<S>,
        engagement: CancellationToken,
    ) -> Self {
        let shared = Arc::new(ReconcileShared {
            state,
            fleet: FleetView::new(fleet.clone()),
            local,
            shutdown: CancellationToken::new(),
            reporter: Reporter {
                controller: "reconciler".into(),
                instance: None,
            },
            abort: CancellationToken::new(),
            tenure: Arc::new(crate::lease::tenure::Tenure::always()),
            failures: super::Failures::new(super::FailureBackoff::default()),
        });
        Self::new(&request, object, cluster, engagement, shared)
    }

    /// A context whose request is made from `object` when asked for (single-cluster mode).
    pub(crate) fn for_object<K: Resource + Send + Sync + 'static>(
        object: Arc<K>,
        cluster: Cluster<C>,
        shared: Arc<ReconcileShared<C, S>>,
    ) -> Self {
        Self {
            shared,
            cluster,
            engagement: None,
            request: OnceLock::new(),
            object: Some(object),
            failures: 0,
            deadline: None,
        }
    }

    /// Says that `error`, which this reconcile is about to return, is terminal
    /// (controller-runtime's `TerminalError`): the object is not retried, and the error policy
    /// is not asked, until the object (or a related one) changes and triggers a reconcile.
    /// It is counted in `controller_runtime_terminal_reconcile_errors_total` and as an error,
    /// reported to [`Builder::on_result`](crate::Builder::on_result) like any other, and
    /// the object's failure count goes on (a later [`Action::backoff`](crate::Action::backoff)
    /// retry starts where it was). For errors no retry can fix: an invalid spec, a
    /// forbidden action, a conflict only a person can settle.
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use k8s_openapi::api::core::v1::ConfigMap;
    /// # use multicluster_runtime::{Action, ClusterId, Context};
    /// # #[derive(Debug, thiserror::Error)]
    /// # #[error("invalid")]
    /// # struct Invalid;
    /// async fn reconcile<C: ClusterId>(cm: Arc<ConfigMap>, ctx: Context<C, ()>) -> Result<Action, Invalid> {
    ///     if cm.data.is_none() {
    ///         // Retrying cannot fill it in: wait for someone to edit the object.
    ///         return Err(ctx.terminal(Invalid));
    ///     }
    ///     Ok(Action::await_change())
    /// }
    /// ```
    pub fn terminal<E>(&self, error: E) -> E {
        self.shared.failures.mark_terminal(self.request().clone());
        error
    }

    /// The failure counts of the controller's objects.
    pub(crate) fn failure_counts(&self) -> &super::Failures<Request<C>> {
        &self.shared.failures
    }

    /// The same context, for an object that failed `failures` times in a row before.
    pub(crate) fn with_failures(mut self, failures: u32) -> Self {
        self.failures = failures;
        self
    }

    /// The same context, ending at `deadline` (the reconcile timeout).
    pub(crate) fn with_deadline(mut self, deadline: Option<tokio::time::Instant>) -> Self {
        self.deadline = deadline;
        self
    }

    /// How many times in a row this object's reconciles failed (or asked for
    /// [`Action::backoff`](crate::Action::backoff)) before this one, since it last succeeded
    /// or changed; 0 on a first attempt. An error policy of your own can grow its delay with
    /// it ([`Action::backoff`](crate::Action::backoff) does).
    pub fn failures(&self) -> u32 {
        self.failures
    }

    /// The tenure the reconcile runs under.
    pub(crate) fn shared_tenure(&self) -> &crate::lease::tenure::Tenure {
        &self.shared.tenure
    }

    /// Records `owner`, an object of this reconcile's cluster, as the owner of `child` (which
    /// may go to any cluster of the fleet): an annotation naming the owner's cluster, kind,
    /// namespace, name and uid, and a label that finds the owner's children. A controller
    /// built with [`Builder::owns_in_fleet`](crate::Builder::owns_in_fleet) reconciles the
    /// owner when the child changes and, when asked, deletes the child when the owner goes.
    ///
    /// Use it in place of a native `ownerReferences` entry whenever the child is written to
    /// another cluster than the owner's: there, the garbage collector would delete it (the
    /// cluster clients of this crate refuse to send such a write). Fails for an owner without
    /// a uid (one not read from its server).
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use k8s_openapi::api::core::v1::ConfigMap;
    /// # use kube::api::{Api, Patch, PatchParams};
    /// # use multicluster_runtime::{Action, ClusterName, Context};
    /// async fn reconcile(
    ///     hub: Arc<ConfigMap>,
    ///     ctx: Context<ClusterName, ()>,
    /// ) -> Result<Action, Box<dyn std::error::Error + Send + Sync>> {
    ///     let mut copy = ConfigMap::default();
    ///     copy.metadata.name = hub.metadata.name.clone();
    ///     copy.data = hub.data.clone();
    ///     ctx.own(&mut copy, hub.as_ref())?;
    ///     for member in ctx.fleet().clusters() {
    ///         let api: Api<ConfigMap> = Api::namespaced(member.client(), "default");
    ///         let name = copy.metadata.name.clone().unwrap_or_default();
    ///         api.patch(&name, &PatchParams::apply("copier").force(), &Patch::Apply(&copy))
    ///             .await?;
    ///     }
    ///     Ok(Action::await_change())
    /// }
    /// ```
    pub fn own<Child: Resource, Owner: Resource>(
        &self,
        child: &mut Child,
        owner: &Owner,
    ) -> Result<(), crate::ownership::OwnerError>
    where
        Owner::DynamicType: Default,
    {
        self.own_in(self.cluster_id(), child, owner)
    }

    /// [`Context::own`] for an owner of another cluster, `cluster`.
    pub fn own_in<Child: Resource, Owner: Resource>(
        &self,
        cluster: &C,
        child: &mut Child,
        owner: &Owner,
    ) -> Result<(), crate::ownership::OwnerError>
    where
        Owner::DynamicType: Default,
    {
        crate::ownership::FleetOwner::of(cluster, owner)?.record(child);
        Ok(())
    }

    /// What is being reconciled: the cluster's id and the object's key.
    pub fn request(&self) -> &Request<C> {
        self.request.get_or_init(|| {
            let meta = self.object.as_ref().map(|o| o.object_meta());
            Request {
                cluster: self.cluster.id().clone(),
                namespace: meta.and_then(|m| m.namespace.clone()),
                name: meta.and_then(|m| m.name.clone()).unwrap_or_default(),
            }
        })
    }

    /// The id of the cluster the object lives in.
    pub fn cluster_id(&self) -> &C {
        self.cluster.id()
    }

    /// The cluster the object lives in.
    pub fn cluster(&self) -> &Cluster<C> {
        &self.cluster
    }

    /// A client for the cluster the object lives in.
    pub fn client(&self) -> Client {
        self.cluster.client()
    }

    /// An Event recorder for the cluster the object lives in (kube-runtime's `Recorder`),
    /// reporting as this controller ([`Builder::named`](crate::Builder::named)) and this
    /// replica (the leader election identity, or the host name: the pod's name). One is kept
    /// per cluster and controller, so repeats of an Event are counted into one series, as
    /// the Events API intends, across reconciles.
    ///
    /// ```no_run
    /// # use std::sync::Arc;
    /// # use k8s_openapi::api::core::v1::ConfigMap;
    /// # use kube::Resource;
    /// # use kube_runtime::events::{Event, EventType};
    /// # use multicluster_runtime::{Action, ClusterName, Context};
    /// async fn reconcile(cm: Arc<ConfigMap>, ctx: Context<ClusterName, ()>) -> Result<Action, kube::Error> {
    ///     let event = Event {
    ///         type_: EventType::Normal,
    ///         reason: "Copied".into(),
    ///         note: Some(format!("copied into {}", ctx.cluster_id())),
    ///         action: "Copy".into(),
    ///         secondary: None,
    ///     };
    ///     ctx.recorder().publish(&event, &cm.object_ref(&())).await?;
    ///     Ok(Action::await_change())
    /// }
    /// ```
    pub fn recorder(&self) -> Recorder {
        self.cluster.recorder(&self.shared.reporter)
    }

    /// Who the controller's Events say reported them: the controller's name and this replica.
    pub fn reporter(&self) -> &kube_runtime::events::Reporter {
        &self.shared.reporter
    }

    /// An Event recorder for `cluster` (another cluster of the fleet: a multi-cluster-aware
    /// controller that acts there), reporting as [`Context::recorder`] does.
    pub fn recorder_in(&self, cluster: &Cluster<C>) -> Recorder {
        cluster.recorder(&self.shared.reporter)
    }

    /// The state given to the controller.
    pub fn state(&self) -> &S {
        &self.shared.state
    }

    /// The state given to the controller, as a shared pointer.
    pub fn state_arc(&self) -> Arc<S> {
        self.shared.state.clone()
    }

    /// Another cluster of the fleet (or the manager's local cluster), by id.
    pub fn cluster_by_id(&self, id: &C) -> Option<Cluster<C>> {
        if let Some(local) = &self.shared.local
            && local.id() == id
        {
            return Some(local.clone());
        }
        self.shared.fleet.get(id)
    }

    /// The fleet: every engaged cluster (read-only).
    pub fn fleet(&self) -> &FleetView<C> {
        &self.shared.fleet
    }

    /// The manager's local (host) cluster, if it has one.
    pub fn local(&self) -> Option<&Cluster<C>> {
        self.shared.local.as_ref()
    }

    /// Whether the reconcile should stop early: the engagement of its cluster it runs in
    /// ended (the cluster was disengaged, or replaced by one with new credentials), the
    /// manager is shutting down, or the controller's reconcile timeout
    /// ([`Builder::reconcile_timeout`](crate::Builder::reconcile_timeout)) has passed.
    ///
    /// A reconcile that stops early because its cluster was *replaced* loses nothing: every
    /// request in flight at a replacement runs again, on the new cluster, once it returns.
    pub fn is_cancelled(&self) -> bool {
        self.engagement.as_ref().is_some_and(|t| t.is_cancelled())
            || self.shared.shutdown.is_cancelled()
            || self
                .deadline
                .is_some_and(|d| tokio::time::Instant::now() >= d)
    }

    /// When the controller's reconcile timeout
    /// ([`Builder::reconcile_timeout`](crate::Builder::reconcile_timeout)) ends this
    /// reconcile (controller-runtime's context deadline); `None` without one. At the deadline
    /// [`Context::cancelled`] completes: a reconcile that returns then (its own error, which
    /// the error policy sees) is handled as any other; one still running a second later is
    /// dropped.
    pub fn deadline(&self) -> Option<tokio::time::Instant> {
        self.deadline
    }

    /// Whether this replica still holds, by its own clock, what lets it act on this request's
    /// cluster: the leader Lease (a controller under leader election), the cluster's fence
    /// and its engagement here (a sharded manager). Ask it just before a write that another
    /// replica must not also make: the background tasks that stop a replica's work when a
    /// renewal is overdue can run late on a runtime starved of CPU, and this reads the
    /// deadline itself. `true` when neither leader election nor sharding applies and the
    /// cluster is engaged.
    ///
    /// It narrows the window, it does not close it: a write sent in time may still land after
    /// another replica took over (the member clusters know nothing of the Leases, so there is
    /// no fencing token). See `docs/sharding.md`.
    pub fn still_owned(&self) -> bool {
        self.shared.tenure.holds()
            && !self.engagement.as_ref().is_some_and(|t| t.is_cancelled())
            && !self.shared.abort.is_cancelled()
    }

    /// When what lets this replica act on the cluster (its leader Lease, its fences) runs
    /// out unless renewed, by this process's clock: `None` when nothing bounds it (no leader
    /// election or sharding), an instant already past once it was lost.
    pub fn owned_until(&self) -> Option<tokio::time::Instant> {
        self.shared.tenure.end_at()
    }

    /// Completes when [`Context::is_cancelled`] turns true; select on it to abandon work.
    /// Reconciles still running a while after their cluster was disengaged are dropped
    /// ([`Builder::disengage_grace`](crate::Builder::disengage_grace)), and at shutdown after
    /// the manager's graceful timeout.
    pub async fn cancelled(&self) {
        let engagement = async {
            match &self.engagement {
                Some(token) => token.cancelled().await,
                None => std::future::pending().await,
            }
        };
        let deadline = async {
            match self.deadline {
                Some(deadline) => tokio::time::sleep_until(deadline).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            () = engagement => {}
            () = self.shared.shutdown.cancelled() => {}
            () = deadline => {}
        }
    }
}
