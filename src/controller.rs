//! The fleet controller: per-cluster watches merged into one deduplicating, delaying, fair
//! queue per controller, and the loop that runs reconciles from it.
//!
//! Path of an event: a cluster's shared watch (`crate::cluster`) notifies each relation's
//! subscription; the relation maps the object to [`Request`]s tagged with a cluster id; the
//! loop below sends them through kube-runtime's `debounced_scheduler` (delays, requeues,
//! deduplication) into the `FairQueue` (one in flight per request, round-robin across
//! clusters), from which at most `concurrency` reconciles run at once.

use std::collections::HashMap;
use std::convert::Infallible;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::stream::{self, BoxStream, FuturesUnordered, SelectAll};
use futures::{FutureExt, StreamExt};
use kube::Resource;
use kube_runtime::controller::trigger_self;
use kube_runtime::reflector::{ObjectRef, Store};
use kube_runtime::watcher;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::cluster::{Change, SharedWatch};
use crate::context::Shared;
use crate::fleet::FleetEvent;
use crate::queue::FleetQueue;
use crate::{Action, Cluster, ClusterId, Context, Fleet, Request, Watchable};

/// Why a reconcile was queued (the first reason wins while it waits).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ReconcileReason {
    /// The object itself changed (or was listed).
    ObjectChanged,
    /// A related object (owned or watched) of this kind changed.
    RelatedObjectChanged(Arc<str>),
    /// The previous reconcile asked to be requeued.
    Requeue,
    /// The previous reconcile failed and the error policy asked for a retry.
    ErrorPolicy,
}

impl fmt::Display for ReconcileReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::ObjectChanged => f.write_str("object changed"),
            Self::RelatedObjectChanged(kind) => write!(f, "related {kind} changed"),
            Self::Requeue => f.write_str("requeue"),
            Self::ErrorPolicy => f.write_str("error policy requeue"),
        }
    }
}

/// A request and why it was made.
pub(crate) type Trigger<C> = (Request<C>, ReconcileReason);

/// A relation of the primary kind `K` to other objects (owned, watched), type-erased.
pub(crate) trait Relation<C: ClusterId, K>: Send + Sync {
    /// Requests this relation makes for `cluster` (fleet mode). `baseline` is the cluster
    /// this one replaces, whose caches tell which listed objects did not change.
    fn triggers(
        &self,
        cluster: &Cluster<C>,
        baseline: Option<&Cluster<C>>,
    ) -> BoxStream<'static, Trigger<C>>;

    /// Adds the relation to a kube-runtime `Controller` (single-cluster mode).
    fn attach(
        &self,
        controller: kube_runtime::Controller<K>,
        cluster: &Cluster<C>,
    ) -> kube_runtime::Controller<K>
    where
        K: Watchable;
}

/// What a replaced cluster's cache held: each object's uid and resourceVersion, without the
/// objects themselves.
pub(crate) struct Baseline<K: Resource<DynamicType = ()>> {
    versions: HashMap<ObjectRef<K>, (Option<String>, Option<String>)>,
}

impl<K: Resource<DynamicType = ()> + Clone> Baseline<K> {
    /// The versions in `store`, if there is one and it holds anything.
    pub(crate) fn of(store: Option<Store<K>>) -> Option<Self> {
        let versions: HashMap<_, _> = store?
            .state()
            .iter()
            .map(|obj| {
                let meta = obj.meta();
                (
                    ObjectRef::from_obj(&**obj),
                    (meta.uid.clone(), meta.resource_version.clone()),
                )
            })
            .collect();
        (!versions.is_empty()).then_some(Self { versions })
    }
}

/// Whether `change` is the first listing's version of an object the replaced cluster's cache
/// already held at the same uid and resourceVersion, so its change was seen there. The
/// baseline is needed only during that listing; it is dropped at the first later change.
pub(crate) fn seen_before<K: Resource<DynamicType = ()> + Clone>(
    change: &Change<K>,
    baseline: &mut Option<Baseline<K>>,
) -> bool {
    if !change.initial {
        *baseline = None;
        return false;
    }
    let Some(baseline) = baseline else {
        return false;
    };
    let meta = change.object.meta();
    baseline
        .versions
        .get(&ObjectRef::from_obj(&*change.object))
        .is_some_and(|(uid, rv)| *uid == meta.uid && *rv == meta.resource_version)
}

/// The objects of `X` in `cluster` as they change (deletions included), leaving out those of
/// the first listing that the replaced cluster had already seen at the same version. The
/// watch for `config` is started on first use.
pub(crate) fn fresh_changes<C: ClusterId, X: Watchable>(
    cluster: &Cluster<C>,
    replaced: Option<&Cluster<C>>,
    config: &watcher::Config,
) -> impl futures::Stream<Item = Arc<X>> + Send + 'static {
    let mut baseline = Baseline::of(replaced.and_then(|r| r.existing_store::<X>(config)));
    cluster
        .watch::<X>(config)
        .subscribe()
        .filter_map(move |change| {
            let fresh = !seen_before(&change, &mut baseline);
            std::future::ready(fresh.then_some(change.object))
        })
}

/// A predicate's hash of an object (see `kube_runtime::Predicate`).
pub(crate) type PredicateFn<K> = Arc<dyn Fn(&K) -> Option<u64> + Send + Sync>;
/// Which clusters a controller engages.
pub(crate) type ClusterFilter<C> = Arc<dyn Fn(&Cluster<C>) -> bool + Send + Sync>;
/// A reconcile in flight; it yields its request, what it asked for next, and why.
type Reconciling<C> = Pin<Box<dyn Future<Output = (Request<C>, Action, ReconcileReason)> + Send>>;

/// The controller's settings, fixed when it starts.
pub(crate) struct Spec<K, C: ClusterId> {
    pub(crate) name: Arc<str>,
    pub(crate) watcher_config: watcher::Config,
    pub(crate) relations: Vec<Arc<dyn Relation<C, K>>>,
    pub(crate) predicate: Option<PredicateFn<K>>,
    pub(crate) engage_local: bool,
    pub(crate) engage_fleet: bool,
    pub(crate) cluster_filter: Option<ClusterFilter<C>>,
    pub(crate) concurrency: usize,
    pub(crate) debounce: Duration,
}

/// Where the controller runs.
pub(crate) struct Env<C: ClusterId> {
    pub(crate) fleet: Fleet<C>,
    pub(crate) local: Option<Cluster<C>>,
    pub(crate) shutdown: CancellationToken,
    pub(crate) graceful: Duration,
}

/// One engaged cluster as the controller holds it.
struct Engagement<K: Resource<DynamicType = ()> + Clone + 'static, C: ClusterId> {
    cluster: Cluster<C>,
    watch: Arc<SharedWatch<K>>,
    /// The cache of the cluster this one replaced, for lookups until this one's first
    /// listing is in (so requeues and queued requests keep their objects meanwhile).
    previous: Option<Store<K>>,
}

impl<K: Resource<DynamicType = ()> + Clone + 'static, C: ClusterId> Engagement<K, C> {
    /// The object `req` is about: from this cluster's cache, or while it is still listing,
    /// from the replaced cluster's. `Err(())` if it cannot be known yet.
    fn lookup(&mut self, req: &Request<C>) -> Result<Option<Arc<K>>, ()> {
        let key = req.object_ref();
        if self.watch.is_ready() {
            self.previous = None;
            return Ok(self.watch.store.get(&key));
        }
        match &self.previous {
            Some(previous) => Ok(previous.get(&key)),
            None => Err(()),
        }
    }
}

/// How long a request waits when its cluster's cache is still listing.
const NOT_LISTED_YET: Duration = Duration::from_millis(200);

type Running<C> = FuturesUnordered<Reconciling<C>>;

/// Runs a fleet controller until shutdown.
pub(crate) async fn run_fleet<K, C, S, F, Fut, E, P>(
    spec: Spec<K, C>,
    env: Env<C>,
    reconcile: F,
    error_policy: P,
    state: Arc<S>,
) where
    K: Watchable,
    C: ClusterId,
    S: Send + Sync + 'static,
    F: Fn(Arc<K>, Context<C, S>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Action, E>> + Send + 'static,
    E: std::error::Error + Send + 'static,
    P: Fn(Arc<K>, &E, &Context<C, S>) -> Action + Send + Sync + 'static,
{
    let reconcile = Arc::new(reconcile);
    let error_policy = Arc::new(error_policy);
    let name = spec.name.clone();
    let shared = Arc::new(Shared {
        state,
        fleet: env.fleet.clone(),
        local: env.local.clone(),
        shutdown: env.shutdown.clone(),
    });
    let mut fleet_rx = spec.engage_fleet.then(|| env.fleet.subscribe());
    let mut engaged: HashMap<C, Engagement<K, C>> = HashMap::new();
    let mut triggers: SelectAll<BoxStream<'static, Trigger<C>>> = SelectAll::new();
    let mut queue = FleetQueue::new(spec.concurrency, spec.debounce);
    let mut running: Running<C> = FuturesUnordered::new();

    if spec.engage_local
        && let Some(local) = &env.local
    {
        engage(
            &spec,
            &mut engaged,
            &mut queue,
            &mut triggers,
            local.clone(),
            None,
        );
    }

    loop {
        tokio::select! {
            () = env.shutdown.cancelled() => break,
            Some(event) = recv_opt(&mut fleet_rx) => match event {
                FleetEvent::Engaged(cluster) => {
                    engage(&spec, &mut engaged, &mut queue, &mut triggers, cluster, None);
                }
                FleetEvent::Replaced { old, new } => {
                    // Queued requests stay: the id is the same and so are its objects.
                    if engaged.get(old.id()).is_some_and(|e| e.cluster.same_instance(&old)) {
                        let id = old.id().clone();
                        let previous = engaged.remove(&id).map(|e| e.watch.store.clone());
                        if !engage(&spec, &mut engaged, &mut queue, &mut triggers, new, Some((old, previous))) {
                            // The filter refuses the new cluster: as good as disengaged.
                            queue.disengage(&id);
                        }
                    }
                }
                FleetEvent::Disengaged(cluster) => {
                    if engaged.get(cluster.id()).is_some_and(|e| e.cluster.same_instance(&cluster)) {
                        engaged.remove(cluster.id());
                        queue.disengage(cluster.id());
                        tracing::debug!(controller = %name, cluster = %cluster.id(), "cluster disengaged; its queue was dropped");
                    }
                }
            },
            Some((req, reason)) = triggers.next(), if !triggers.is_empty() => queue.trigger(req, reason),
            Some((req, action, reason)) = running.next(), if !running.is_empty() => queue.finish(req, action, reason),
            (req, reason) = queue.next() => {
                let Some(engagement) = engaged.get_mut(&req.cluster) else {
                    queue.finish(req, Action::await_change(), reason);
                    continue;
                };
                match engagement.lookup(&req) {
                    Ok(Some(object)) => {
                        let engagement = &*engagement;
                        running.push(start(&name, req, reason, object, engagement, &shared, &reconcile, &error_policy));
                    }
                    Ok(None) => {
                        tracing::debug!(controller = %name, request = %req, "object not in the cache (deleted); skipping");
                        queue.finish(req, Action::await_change(), reason);
                    }
                    Err(()) => queue.finish(req, Action::requeue(NOT_LISTED_YET), reason),
                }
            }
        }
    }

    // Graceful shutdown: take no new work; let reconciles in flight finish, within bounds.
    tracing::debug!(controller = %name, in_flight = running.len(), "controller shutting down");
    let drain = async { while running.next().await.is_some() {} };
    if tokio::time::timeout(env.graceful, drain).await.is_err() {
        tracing::warn!(controller = %name, "reconciles still running after the graceful timeout were abandoned");
    }
}

/// The reconcile of `req` as a future yielding what to do next.
#[allow(clippy::too_many_arguments)]
fn start<K, C, S, F, Fut, E, P>(
    name: &Arc<str>,
    req: Request<C>,
    reason: ReconcileReason,
    object: Arc<K>,
    engagement: &Engagement<K, C>,
    shared: &Arc<Shared<C, S>>,
    reconcile: &Arc<F>,
    error_policy: &Arc<P>,
) -> Reconciling<C>
where
    K: Resource<DynamicType = ()> + Clone + Send + Sync + 'static,
    C: ClusterId,
    S: Send + Sync + 'static,
    F: Fn(Arc<K>, Context<C, S>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Action, E>> + Send + 'static,
    E: std::error::Error + Send + 'static,
    P: Fn(Arc<K>, &E, &Context<C, S>) -> Action + Send + Sync + 'static,
{
    let ctx = Context::new(req.clone(), engagement.cluster.clone(), shared.clone());
    let span = tracing::info_span!(
        "reconcile",
        controller = %name,
        cluster = %req.cluster,
        object = %ObjectKey(&req),
        reason = %reason,
    );
    let reconcile = reconcile.clone();
    let error_policy = error_policy.clone();
    async move {
        match reconcile(object.clone(), ctx.clone()).await {
            Ok(action) => (req, action, ReconcileReason::Requeue),
            Err(error) => {
                tracing::warn!(cluster = %req.cluster, %error, "reconcile failed");
                let action = error_policy(object, &error, &ctx);
                (req, action, ReconcileReason::ErrorPolicy)
            }
        }
    }
    .instrument(span)
    .boxed()
}

/// `namespace/name` or `name`.
struct ObjectKey<'a, C: ClusterId>(&'a Request<C>);

impl<C: ClusterId> fmt::Display for ObjectKey<'_, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0.namespace {
            Some(ns) => write!(f, "{ns}/{}", self.0.name),
            None => f.write_str(&self.0.name),
        }
    }
}

/// Starts following `cluster`: its primary watch and every relation's. `replacing` is the
/// cluster it takes the place of, with this controller's cache of it. Returns whether the
/// cluster was engaged (the filter may refuse it, and an id already engaged, the local
/// cluster's id coming from the provider too, is refused).
fn engage<K, C>(
    spec: &Spec<K, C>,
    engaged: &mut HashMap<C, Engagement<K, C>>,
    queue: &mut FleetQueue<C>,
    triggers: &mut SelectAll<BoxStream<'static, Trigger<C>>>,
    cluster: Cluster<C>,
    replacing: Option<(Cluster<C>, Option<Store<K>>)>,
) -> bool
where
    K: Watchable,
    C: ClusterId,
{
    if let Some(filter) = &spec.cluster_filter
        && !filter(&cluster)
    {
        tracing::debug!(controller = %spec.name, cluster = %cluster.id(), "cluster filtered out");
        return false;
    }
    if engaged.contains_key(cluster.id()) {
        tracing::error!(
            controller = %spec.name,
            cluster = %cluster.id(),
            "two clusters with one id (the local cluster and a provider's?); the second is ignored"
        );
        return false;
    }
    let (old, previous) = replacing.unzip();
    let previous = previous.flatten();
    let watch = cluster.watch::<K>(&spec.watcher_config);
    let mut baseline = Baseline::of(previous.clone());
    let id = cluster.id().clone();
    let predicate = spec.predicate.clone();
    let mut last_hash: HashMap<ObjectRef<K>, u64> = HashMap::new();
    let changed = watch.subscribe().filter_map(move |change: Change<K>| {
        let keep = if change.deleted {
            last_hash.remove(&ObjectRef::from_obj(&*change.object));
            false
        } else if seen_before(&change, &mut baseline) {
            false
        } else if let Some(predicate) = &predicate {
            match predicate(&change.object) {
                Some(hash) => {
                    last_hash.insert(ObjectRef::from_obj(&*change.object), hash) != Some(hash)
                }
                None => true,
            }
        } else {
            true
        };
        std::future::ready(keep.then(|| Ok::<_, Infallible>(change.object)))
    });
    // kube-runtime's own trigger, then the cluster id on top (moving the key's strings).
    let primary = trigger_self::<K, _>(changed, ()).filter_map(move |request| {
        std::future::ready(request.ok().map(|r| {
            (
                Request::from_object_ref(id.clone(), r.obj_ref),
                ReconcileReason::ObjectChanged,
            )
        }))
    });
    // Requests wait for the first complete listing: a reconcile must find its object in the
    // store. The subscriptions end by themselves once the cluster's watches stop (they are
    // drained first, so no change seen before a replacement is lost).
    let ready = watch.ready();
    triggers.push(
        stream::once(async move {
            ready.await;
            primary
        })
        .flatten()
        .boxed(),
    );
    for relation in &spec.relations {
        triggers.push(relation.triggers(&cluster, old.as_ref()));
    }
    queue.engage(cluster.id().clone());
    engaged.insert(
        cluster.id().clone(),
        Engagement {
            cluster,
            watch,
            previous,
        },
    );
    true
}

async fn recv_opt<T>(rx: &mut Option<mpsc::UnboundedReceiver<T>>) -> Option<T> {
    match rx {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}
