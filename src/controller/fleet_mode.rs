//! The fleet controller: per-cluster watches merged into one deduplicating, delaying, fair
//! queue per controller, the loop that runs reconciles from it, and the state machine that
//! follows each cluster id through engagement, listing, replacement and disengagement.
//!
//! Path of an event: a cluster's shared watch (`crate::cluster`) notifies each relation's
//! subscription; the relation maps the object to [`Request`]s tagged with a cluster id; the
//! loop sends them through kube-runtime's `debounced_scheduler` (delays, requeues,
//! deduplication) into the `FairQueue` (one in flight per request, round-robin across
//! clusters, a cap per cluster), from which at most `concurrency` reconciles run at once.
//!
//! Each cluster id the controller follows is a [`Slot`] in one of two phases
//! (`docs/architecture.md` draws it):
//!
//! - `Syncing`: the primary cache of the current engagement has not listed yet. A request
//!   that comes due reads the *reference* cache, the last synced cache of an engagement this
//!   one replaced (same endpoint only), or, without one, is parked.
//! - `Synced`: requests read the current cache.
//!
//! In either phase, a request that comes due after the slot's engagement ended (the event
//! saying whether it was replaced or disengaged is on its way) is parked too.
//!
//! `Syncing → Synced` when the cache lists (parked requests are released, the reference is
//! let go). A replacement starts a new `Syncing` slot whose reference is the old slot's cache
//! if that had synced, else the old slot's own reference (so a second replacement during an
//! outage still serves the last cache that listed). The same reference is the baseline of the
//! new listing: objects it held at the same uid and resourceVersion are not reconciled again.
//! A reconcile that returns after the engagement it ran in ended runs once more if its id is
//! still followed, so work cut short by a replacement is not lost to that baseline.

use crate::util::hashing::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use crate::cache::Store;
use futures::stream::{self, BoxStream, FuturesUnordered, SelectAll};
use futures::{FutureExt, StreamExt};
use kube_runtime::watcher;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::context::ReconcileShared;
use super::queue::{FleetQueue, Origin};
use super::relations::{Baseline, seen_before};
use super::{ReconcileReason, Spec, Trigger};
use crate::cache::Watchable;
use crate::cache::{CacheError, Change, SharedWatch};
use crate::cluster::ClusterId;
use crate::cluster::Engagement;
use crate::controller::{Action, Context, Request};
use crate::fleet::FleetEvent;
use crate::run::Env;
use crate::util::panic::panic_message;

/// A reconcile in flight; it yields what became of it.
type Reconciling<C> = Pin<Box<dyn Future<Output = Finished<C>> + Send>>;

/// What a reconcile came to.
struct Finished<C: ClusterId> {
    request: Request<C>,
    /// What it (or the error policy) asked for next.
    action: Action,
    /// Why it runs next.
    reason: ReconcileReason,
    /// Its engagement ended while it ran.
    engagement_ended: bool,
    /// How long it took (timed only when metrics are kept).
    took: Option<std::time::Duration>,
    /// It returned after its deadline (the reconcile timeout) rather than being dropped.
    overran: bool,
    /// It did not run, or did not run to its end.
    dropped: bool,
    /// Why it failed, for the diagnostics view (kept only while it is served).
    failure: Option<String>,
    /// The trace it ran in, for its duration's exemplar.
    mark: crate::telemetry::TraceMark,
}

impl<C: ClusterId> Finished<C> {
    /// A reconcile that did not run to its end (its engagement ended, or the tenure did):
    /// it waits for its next trigger, on a new engagement of the id if there is one.
    fn cut_short(request: Request<C>, reason: ReconcileReason, took: Option<Duration>) -> Self {
        Finished {
            request,
            action: Action::await_change(),
            reason,
            engagement_ended: true,
            took,
            overran: false,
            dropped: true,
            failure: None,
            mark: crate::telemetry::TraceMark::default(),
        }
    }
}

/// A primary cache that listed (or failed to): the id, the slot's epoch, the outcome.
type Synced<C> = Pin<Box<dyn Future<Output = (C, u64, Result<(), CacheError>)> + Send>>;

/// The last synced engagement of an id, and its primary cache.
struct Reference<K: Watchable, C: ClusterId> {
    engagement: Engagement<C>,
    store: Store<K>,
}

/// Where a slot is; see the module documentation.
enum Phase<K: Watchable, C: ClusterId> {
    Syncing { reference: Option<Reference<K, C>> },
    Synced,
}

/// One cluster id as the controller follows it.
struct Slot<K: Watchable, C: ClusterId> {
    engagement: Engagement<C>,
    /// The primary watch of `engagement`; `None` if the engagement had already ended when
    /// the controller got to it (a later event of the same id is on its way).
    watch: Option<Arc<SharedWatch<K>>>,
    /// Tells this slot's sync signal from one of an earlier slot of the same id.
    epoch: u64,
    phase: Phase<K, C>,
    /// Requests that came due with no cache to read (not listed yet and no reference, or the
    /// engagement ended and the event saying what follows is on its way); released when the
    /// cache lists, carried over to a replacement, dropped with a disengagement.
    parked: HashMap<Request<C>, ReconcileReason>,
}

impl<K: Watchable, C: ClusterId> Slot<K, C> {
    /// Moves to `Synced` once the cache has listed (letting go of the reference then, not at
    /// the next request), and releases the parked requests as soon as there is a cache to
    /// read them from: the listed one, or the reference.
    fn catch_up(&mut self, queue: &mut FleetQueue<C>) {
        if matches!(self.phase, Phase::Syncing { .. })
            && self.watch.as_ref().is_some_and(|w| w.is_synced())
        {
            self.phase = Phase::Synced;
        }
        let readable = match &self.phase {
            Phase::Synced => true,
            Phase::Syncing { reference } => reference.is_some(),
        };
        if readable && self.engagement.session.is_active() {
            for (req, reason) in self.parked.drain() {
                queue.trigger(req, reason);
            }
        }
    }
}

/// Runs a fleet controller until shutdown; reconciles in flight then get the graceful timeout
/// to finish and are dropped after it.
pub(crate) async fn run<K, C, S, F, Fut, E, P>(
    spec: Arc<Spec<K, C>>,
    env: Env<C>,
    reconcile: Arc<F>,
    error_policy: Arc<P>,
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
    let shared = Arc::new(ReconcileShared::new(&spec, &env, state));
    let mut fleet_rx = spec.engage_fleet.then(|| env.fleet.subscribe());
    let mut slots = Slots {
        spec: spec.clone(),
        slots: HashMap::default(),
        triggers: SelectAll::new(),
        queue: {
            let queue = FleetQueue::new(spec.concurrency, spec.per_cluster_cap(), spec.debounce)
                .with_lanes(spec.changes_first);
            match &env.metrics {
                Some(metrics) => queue.with_metrics(metrics.clone(), spec.name.clone()),
                None => queue,
            }
        },
        syncs: FuturesUnordered::new(),
        epoch: 0,
    };
    let mut running: FuturesUnordered<Reconciling<C>> = FuturesUnordered::new();
    for source in &spec.sources {
        if let Some(triggers) = source.triggers(&env) {
            slots.triggers.push(triggers);
        }
    }
    let mut bulk = spec.bulk.as_ref().and_then(|b| b.lend());
    // Past the tenure (a renewal overdue, its background task not yet run: a starved
    // runtime), no request is taken from the queue until the tenure runs again or the
    // replica's work here is stopped.
    let mut tenure_changes = env.tenure.subscribe();
    // While the diagnostics view is served: where it asks for the queues, and how each
    // cluster's last reconcile ended.
    let mut asks = env
        .diagnostics
        .as_ref()
        .map(|d| d.register(spec.name.clone()));
    let diagnosed = asks.is_some();
    let mut last: HashMap<C, Last<C>> = HashMap::default();

    if spec.engage_local
        && let Some(local) = &env.local
    {
        match local.engagement() {
            Some(engagement) => {
                slots.engage(engagement, None, HashMap::default());
            }
            None => {
                tracing::warn!(controller = %spec.name, "the local cluster is not engaged (the manager is not running); not reconciling it")
            }
        }
    }

    loop {
        let mut may_start = env.tenure.holds();
        if !may_start {
            // Changes from here on wake the loop.
            tenure_changes.borrow_and_update();
            may_start = env.tenure.holds();
        }
        tokio::select! {
            () = env.shutdown.cancelled() => break,
            Ok(()) = tenure_changes.changed(), if !may_start => {}
            Some(event) = recv_opt(&mut fleet_rx) => match event {
                FleetEvent::Engaged(engagement) => {
                    slots.engage(engagement, None, HashMap::default());
                }
                FleetEvent::Replaced { old, new } => slots.replace(old, new),
                FleetEvent::Disengaged(engagement) => {
                    slots.disengage(&engagement);
                    // A late event of an older engagement leaves the current one's entry.
                    if !last.is_empty() && !slots.slots.contains_key(engagement.id()) {
                        last.remove(engagement.id());
                    }
                }
                FleetEvent::Departed(_) => {}
            },
            Some((id, epoch, outcome)) = slots.syncs.next(), if !slots.syncs.is_empty() => {
                if outcome.is_ok() {
                    slots.synced(&id, epoch);
                }
            }
            Some((req, reason)) = slots.triggers.next(), if !slots.triggers.is_empty() => {
                slots.queue.trace(&req, &reason, |lane| traced(&spec.name, &req, &reason, lane));
                slots.queue.trigger(req, reason);
            }
            bulk_item = next_opt(&mut bulk) => match bulk_item {
                Some(()) => slots.reconcile_all(),
                None => bulk = None,
            },
            Some(answer) = recv_ask(&mut asks) => {
                let _ = answer.send(slots.queues(&mut last));
            }
            Some(Finished { request: req, action, reason, engagement_ended: ended, took, overran, dropped, failure, mark }) = running.next(), if !running.is_empty() => {
                if diagnosed && slots.slots.contains_key(&req.cluster) {
                    last.insert(req.cluster.clone(), Last {
                        at: std::time::SystemTime::now(),
                        request: req.clone(),
                        result: result_of(&reason, &action, dropped),
                        failure,
                    });
                }
                if overran {
                    slots.queue.timed_out(&req.cluster);
                }
                // A reconcile whose engagement ended while it ran (its cluster was replaced:
                // the client it used stopped, its context was cancelled) may have been cut
                // short: it runs again if the id is still followed, on the new engagement.
                let rerun = ended && slots.slots.contains_key(&req.cluster);
                if rerun {
                    slots.queue.finish_marked(req.clone(), action, reason.clone(), took, mark);
                    slots.queue.trigger(req, reason);
                } else {
                    slots.queue.finish_marked(req, action, reason, took, mark);
                }
            }
            (req, reason) = slots.queue.next(), if may_start => {
                let origin = slots.queue.take_origin(&req);
                if let Some((object, engagement)) = slots.object_for(&req, &reason) {
                    let timed = env.metrics.is_some();
                    running.push(start(&spec, req, reason, object, engagement, &shared, &reconcile, &error_policy, timed, diagnosed, origin));
                }
            }
        }
    }

    // No more answers for the view: a controller draining is not waited on.
    drop(asks);
    // Graceful shutdown: take no new work; let reconciles in flight finish, within bounds.
    tracing::debug!(controller = %spec.name, in_flight = running.len(), "controller shutting down");
    let drain = async { while running.next().await.is_some() {} };
    tokio::select! {
        () = drain => {}
        () = env.grace.over() => {
            tracing::warn!(controller = %spec.name, "reconciles still running after the graceful timeout (or an abort) were dropped");
        }
    }
}

/// Every cluster id the controller follows, and what feeds its queue.
struct Slots<K: Watchable, C: ClusterId> {
    spec: Arc<Spec<K, C>>,
    slots: HashMap<C, Slot<K, C>>,
    triggers: SelectAll<BoxStream<'static, Trigger<C>>>,
    queue: FleetQueue<C>,
    syncs: FuturesUnordered<Synced<C>>,
    epoch: u64,
}

impl<K: Watchable, C: ClusterId> Slots<K, C> {
    /// Each followed cluster's queue, for the diagnostics view; `last` forgets the clusters
    /// no longer followed.
    fn queues(&self, last: &mut HashMap<C, Last<C>>) -> crate::diagnostics::Queues<C> {
        last.retain(|id, _| self.slots.contains_key(id));
        let mut depths = self.queue.depths();
        self.slots
            .iter()
            .map(|(id, slot)| {
                let depth = depths.remove(id).unwrap_or_default();
                let view = crate::diagnostics::QueueView {
                    controller: self.spec.name.to_string(),
                    listed: matches!(slot.phase, Phase::Synced),
                    normal: depth.normal,
                    low: depth.low,
                    scheduled: depth.scheduled,
                    parked: slot.parked.len(),
                    in_flight: depth.in_flight,
                    last: last.get(id).map(Last::view),
                };
                (id.clone(), view)
            })
            .collect()
    }

    /// Starts following `engagement` in `Syncing`, reading `reference` meanwhile. Returns
    /// whether it did (the filter may refuse the cluster, an id may come twice).
    fn engage(
        &mut self,
        engagement: Engagement<C>,
        reference: Option<Reference<K, C>>,
        parked: HashMap<Request<C>, ReconcileReason>,
    ) -> bool {
        let spec = &self.spec;
        let id = engagement.id().clone();
        if let Some(filter) = &spec.cluster_filter
            && !filter(&engagement.cluster)
        {
            tracing::debug!(controller = %spec.name, cluster = %id, "cluster filtered out");
            return false;
        }
        if self.slots.contains_key(&id) {
            tracing::error!(
                controller = %spec.name,
                cluster = %id,
                "two clusters with one id (the local cluster and a provider's?); the second is ignored"
            );
            return false;
        }
        // An engagement that has already ended (replaced again, or disengaged, before this
        // controller got to it) gets a slot without watches: it keeps the reference and the
        // parked requests for the event that follows.
        let watch = engagement.watch::<K>(&spec.dt, &spec.watcher_config).ok();
        self.epoch += 1;
        let epoch = self.epoch;
        if let Some(watch) = &watch {
            let reference_engagement = reference.as_ref().map(|r| &r.engagement);
            for relation in &spec.relations {
                if let Ok(triggers) = relation.triggers(&engagement, reference_engagement) {
                    self.triggers.push(triggers);
                }
            }
            self.triggers.push(primary(
                spec,
                &id,
                watch,
                reference.as_ref().map(|r| &r.store),
            ));
            if let Some(period) = spec.resync {
                self.triggers.push(resyncs(
                    watch.store.clone(),
                    id.clone(),
                    period,
                    engagement.session.token().clone(),
                ));
            }
            let synced = watch.synced();
            let signal_id = id.clone();
            self.syncs
                .push(Box::pin(async move { (signal_id, epoch, synced.await) }));
        }
        self.queue.engage(id.clone());
        self.slots.insert(
            id.clone(),
            Slot {
                engagement,
                watch,
                epoch,
                phase: Phase::Syncing { reference },
                parked,
            },
        );
        self.synced(&id, epoch);
        true
    }

    /// Queues every object of every cluster whose cache can be read (a cluster still listing
    /// reconciles all it lists anyway).
    fn reconcile_all(&mut self) {
        for (id, slot) in &self.slots {
            let store = match &slot.phase {
                Phase::Synced => slot.watch.as_ref().map(|w| &w.store),
                Phase::Syncing { reference } => reference.as_ref().map(|r| &r.store),
            };
            for object in store.map(Store::state).unwrap_or_default() {
                let request = Request::from_obj(id.clone(), &*object);
                self.queue.trigger(request, ReconcileReason::Bulk);
            }
        }
    }

    /// `old` was replaced by `new` under the same id.
    fn replace(&mut self, old: Engagement<C>, new: Engagement<C>) {
        let id = old.id().clone();
        let Some(slot) = self.slots.remove(&id) else {
            // This controller did not follow the old one (its filter refused it): the new one
            // is a plain engagement.
            self.engage(new, None, HashMap::default());
            return;
        };
        if !slot.engagement.same(&old) {
            // The slot belongs to another cluster of the same id (the local one).
            self.slots.insert(id, slot);
            return;
        }
        let parked = slot.parked;
        let reference = match slot.phase {
            Phase::Synced => slot.watch.map(|watch| Reference {
                store: watch.store.clone(),
                engagement: slot.engagement,
            }),
            Phase::Syncing { reference } => reference,
        };
        // Another endpoint may be another cluster: its cache stands for nothing here.
        let reference = reference.filter(|r| r.engagement.cluster.same_endpoint(&new.cluster));
        // Queued and scheduled requests stay: the id is the same and so are its objects.
        if !self.engage(new, reference, parked) {
            self.queue.disengage(&id);
        }
    }

    /// `engagement` ended.
    fn disengage(&mut self, engagement: &Engagement<C>) {
        let id = engagement.id();
        if self
            .slots
            .get(id)
            .is_some_and(|slot| slot.engagement.same(engagement))
        {
            self.slots.remove(id);
            self.queue.disengage(id);
            tracing::debug!(controller = %self.spec.name, cluster = %id, "cluster disengaged; its queue was dropped");
        }
    }

    /// The slot of `id` catches up with its cache, if `epoch` is its own.
    fn synced(&mut self, id: &C, epoch: u64) {
        if let Some(slot) = self.slots.get_mut(id)
            && slot.epoch == epoch
        {
            slot.catch_up(&mut self.queue);
        }
    }

    /// The object `req` is about and the engagement to reconcile it in; `None` if it is not
    /// to be reconciled now (its request is then finished or parked).
    fn object_for(
        &mut self,
        req: &Request<C>,
        reason: &ReconcileReason,
    ) -> Option<(Arc<K>, Engagement<C>)> {
        let Some(slot) = self.slots.get_mut(&req.cluster) else {
            self.queue
                .finish(req.clone(), Action::await_change(), reason.clone(), None);
            return None;
        };
        // A cache that has just listed serves at once, before its signal comes round.
        slot.catch_up(&mut self.queue);
        let cache = match &slot.phase {
            // An engagement that ended reconciles nothing more; the event that ended it
            // (a replacement or a disengagement) decides what becomes of the request.
            _ if !slot.engagement.session.is_active() => None,
            Phase::Synced => slot.watch.as_ref().map(|w| &w.store),
            Phase::Syncing { reference } => reference.as_ref().map(|r| &r.store),
        };
        let Some(cache) = cache else {
            tracing::debug!(controller = %self.spec.name, request = %req, "no cache to read yet; parked");
            slot.parked.insert(req.clone(), reason.clone());
            self.queue
                .finish(req.clone(), Action::await_change(), reason.clone(), None);
            return None;
        };
        let object = cache.get_named(req.namespace.as_deref(), &req.name);
        match object {
            Some(object) => Some((object, slot.engagement.clone())),
            None => {
                tracing::debug!(controller = %self.spec.name, request = %req, "object not in the cache (deleted); skipping");
                self.queue
                    .finish(req.clone(), Action::await_change(), reason.clone(), None);
                None
            }
        }
    }
}

/// The requests for the primary objects of one engagement: every change but deletions,
/// through the predicate (kube-runtime's filter: keyed by uid, entries expire), then without
/// the first listing's objects the reference cache held at the same version. The predicate
/// sees those too, so its cache is seeded and their next status-only change is filtered.
fn primary<K: Watchable, C: ClusterId>(
    spec: &Spec<K, C>,
    id: &C,
    watch: &SharedWatch<K>,
    reference: Option<&Store<K>>,
) -> BoxStream<'static, Trigger<C>> {
    let changes = watch
        .subscribe()
        .filter(|change| std::future::ready(!change.deleted))
        .map(Ok::<_, watcher::Error>);
    let filtered =
        super::through_predicate(changes, spec.predicate.clone(), |change: &Change<K>| {
            &*change.object
        });
    let mut baseline = Baseline::of(reference);
    let id = id.clone();
    filtered
        .filter_map(move |change| {
            let trigger = change
                .ok()
                .filter(|change| !seen_before(change, &mut baseline))
                .map(|change| {
                    // A listed object without news waits behind live changes.
                    let reason = if change.listed {
                        ReconcileReason::Listed
                    } else {
                        ReconcileReason::ObjectChanged
                    };
                    (Request::from_obj(id.clone(), &*change.object), reason)
                });
            std::future::ready(trigger)
        })
        .boxed()
}

/// Every object of `store` each resync period of `period`, until the engagement whose
/// token is `ended` ends.
fn resyncs<K: Watchable, C: ClusterId>(
    store: Store<K>,
    id: C,
    period: std::time::Duration,
    ended: CancellationToken,
) -> BoxStream<'static, Trigger<C>> {
    super::resync_ticks(period, ended)
        .flat_map(move |()| {
            let id = id.clone();
            let requests = store
                .state()
                .into_iter()
                .map(move |o| (Request::from_obj(id.clone(), &*o), ReconcileReason::Resync));
            stream::iter(requests)
        })
        .boxed()
}

/// The spans of a request a live change asked for, if a subscriber takes them:
/// `watch_event`, and its child `queue`, the wait in `lane`.
fn traced<C: ClusterId>(
    controller: &str,
    req: &Request<C>,
    reason: &ReconcileReason,
    lane: super::queue::Lane,
) -> Option<Origin> {
    // Its fields are not even formatted unless a subscriber takes it.
    let event = tracing::info_span!(
        parent: None,
        "watch_event",
        controller = %controller,
        cluster = %crate::cluster::ClusterField(&req.cluster),
        object = %super::ObjectField {
            namespace: req.namespace.as_deref(),
            name: &req.name,
        },
        reason = %reason,
    );
    if event.is_disabled() {
        return None;
    }
    let waiting = tracing::info_span!(
        parent: &event,
        "queue",
        controller = %controller,
        cluster = %crate::cluster::ClusterField(&req.cluster),
        lane = lane.as_str(),
    );
    Some(Origin {
        event,
        _waiting: waiting,
    })
}

/// The reconcile of `req` as a future yielding what to do next. If its cluster's engagement
/// ends, it has the grace period to return before it is dropped.
#[allow(clippy::too_many_arguments)]
fn start<K, C, S, F, Fut, E, P>(
    spec: &Spec<K, C>,
    req: Request<C>,
    reason: ReconcileReason,
    object: Arc<K>,
    engagement: Engagement<C>,
    shared: &Arc<ReconcileShared<C, S>>,
    reconcile: &Arc<F>,
    error_policy: &Arc<P>,
    timed: bool,
    diagnosed: bool,
    origin: Option<Origin>,
) -> Reconciling<C>
where
    K: Watchable,
    C: ClusterId,
    S: Send + Sync + 'static,
    F: Fn(Arc<K>, Context<C, S>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Action, E>> + Send + 'static,
    E: std::error::Error + Send + 'static,
    P: Fn(Arc<K>, &E, &Context<C, S>) -> Action + Send + Sync + 'static,
{
    let token = engagement.session.token().clone();
    let aborted = engagement.session.aborted().clone();
    // Counted on its engagement while it runs; nothing starts on an engagement that ended.
    let busy = engagement.session.busy();
    // What the object is now, for its failure count: a change starts it over.
    let version = (!shared.failures.is_empty()).then(|| super::version_of(&*object));
    let failures = shared
        .failures
        .prior(&req, version.as_ref().and_then(Option::as_deref));
    // The reconcile timeout: the context ends at the deadline; the future is dropped a
    // grace period later if it has not returned.
    let deadline = spec
        .reconcile_timeout
        .map(|limit| tokio::time::Instant::now() + limit);
    let ctx = Context::new(
        &req,
        object.clone(),
        engagement.cluster,
        token.clone(),
        shared.clone(),
    )
    .with_failures(failures)
    .with_deadline(deadline);
    // A child of the watch event that asked for it (its wait in the queue ends here), or a
    // trace of its own (never a child of whatever span the manager was started in).
    let parent = origin.map(|origin| origin.event);
    let span = tracing::info_span!(
        parent: parent.as_ref().and_then(tracing::Span::id),
        "reconcile",
        controller = %spec.name,
        cluster = %crate::cluster::ClusterField(&req.cluster),
        object = %super::ObjectField {
            namespace: req.namespace.as_deref(),
            name: &req.name,
        },
        reason = %reason,
    );
    let reconcile = reconcile.clone();
    let error_policy = error_policy.clone();
    let grace = spec.disengage_grace;
    let limit = spec.reconcile_timeout;
    let observer = spec.observer.clone();
    async move {
        let Some(_busy) = busy else {
            // Its cluster left between the request coming due and now: it runs again on a
            // new engagement of the id, if there is one.
            return Finished::cut_short(req, reason, None);
        };
        if !ctx.shared_tenure().holds() {
            // Past the tenure since it was taken from the queue: queued again, taken once
            // the tenure runs again (or dropped with the cluster).
            return Finished::cut_short(req, reason, None);
        }
        let began = (timed || observer.is_some()).then(std::time::Instant::now);
        let observed = observer.is_some() || diagnosed;
        // A panic of the reconciler or its error policy ends this reconcile only: the
        // controller goes on with every other request and cluster.
        let counts = ctx.failure_counts();
        // The version the failure count is kept for (read here only once something fails).
        let version = |object: &K| version.clone().unwrap_or_else(|| super::version_of(object));
        let work = std::panic::AssertUnwindSafe(attempt(
            &*reconcile,
            &*error_policy,
            &object,
            &ctx,
            &req,
            counts,
            limit,
            observed,
            &version,
        ))
        .catch_unwind()
        .map(|ended| {
            ended.unwrap_or_else(|panic| {
                let message = panic_message(&*panic);
                tracing::error!(cluster = %req.cluster, panic = %message, "reconcile panicked");
                (
                    Action::requeue(super::PANIC_REQUEUE),
                    ReconcileReason::Panicked,
                    Some(super::Failure::Panic(message)),
                )
            })
        })
        .map(|(action, reason, failure)| {
            let text = failure
                .as_ref()
                .filter(|_| diagnosed)
                .map(|failure| match failure {
                    super::Failure::Error(text) | super::Failure::Panic(text) => {
                        crate::diagnostics::cut(text.clone())
                    }
                    super::Failure::Timeout(limit) => {
                        format!("it did not return within its reconcile timeout ({limit:?})")
                    }
                });
            if let Some(observer) = &observer {
                super::observe(
                    observer,
                    super::Reconciled {
                        request: req.clone(),
                        action,
                        failure,
                        took: began.map(|b| b.elapsed()).unwrap_or_default(),
                    },
                );
            }
            (action, reason, text)
        });
        let abandoned = async {
            tokio::select! {
                () = async {
                    token.cancelled().await;
                    Box::pin(tokio::time::sleep(grace)).await;
                } => {}
                // A sharded replica about to lose the cluster's fence: no grace.
                () = aborted.cancelled() => {}
            }
        };
        // Biased: a reconcile that is done is not made to wait on the token first.
        let ended = tokio::select! {
            biased;
            (action, reason, failure) = work => {
                let took = began.map(|b| b.elapsed());
                // Returned (not dropped) past its deadline: a timeout too, as
                // controller-runtime counts one.
                let overran = reason != ReconcileReason::TimedOut
                    && deadline.is_some_and(|d| tokio::time::Instant::now() >= d);
                Finished {
                    request: req,
                    action,
                    reason,
                    engagement_ended: token.is_cancelled(),
                    took,
                    overran,
                    dropped: false,
                    failure,
                    mark: if timed {
                        crate::telemetry::TraceMark::of(&tracing::Span::current())
                    } else {
                        crate::telemetry::TraceMark::default()
                    },
                }
            }
            () = abandoned => {
                tracing::warn!(cluster = %req.cluster, ?grace, "reconcile dropped: its cluster was disengaged and it did not return within the grace period");
                Finished::cut_short(req, reason, began.map(|b| b.elapsed()))
            }
        };
        // Whatever ended it (a panic, the grace period), a terminal mark it left is its own.
        counts.clear_terminal(&ended.request);
        ended
    }
    .instrument(span)
    .boxed()
}

/// The reconciler's call and, when it fails, the error policy's (or a terminal error's
/// wait), within the reconcile timeout; the object's failure count settled. What to do next,
/// why, and (when `observed`) the failure to tell the observer.
#[allow(clippy::too_many_arguments)]
async fn attempt<K, C, S, F, Fut, E, P>(
    reconcile: &F,
    error_policy: &P,
    object: &Arc<K>,
    ctx: &Context<C, S>,
    req: &Request<C>,
    counts: &crate::controller::Failures<Request<C>>,
    limit: Option<Duration>,
    observed: bool,
    version: &impl Fn(&K) -> Option<String>,
) -> (Action, ReconcileReason, Option<super::Failure>)
where
    K: Watchable,
    C: ClusterId,
    S: Send + Sync + 'static,
    F: Fn(Arc<K>, Context<C, S>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Action, E>> + Send + 'static,
    E: std::error::Error + Send + 'static,
    P: Fn(Arc<K>, &E, &Context<C, S>) -> Action + Send + Sync + 'static,
{
    let reconciled = reconcile(object.clone(), ctx.clone());
    let result = match limit {
        None => Ok(reconciled.await),
        // Boxed, as the grace sleep below is: a timer's state inline would make every
        // reconcile's future larger, timed or not (see `start`).
        Some(limit) => Box::pin(tokio::time::timeout(
            limit + super::TIMEOUT_GRACE,
            reconciled,
        ))
        .await
        .map_err(|_| limit),
    };
    let result = match result {
        Ok(result) => result,
        Err(limit) => {
            tracing::warn!(cluster = %req.cluster, ?limit, "reconcile dropped: it did not return within a second of its reconcile timeout; retried after the object's backoff");
            let action = counts.settle(req, version(object).as_deref(), Action::backoff(), true);
            let failure = observed.then_some(super::Failure::Timeout(limit));
            return (action, ReconcileReason::TimedOut, failure);
        }
    };
    match result {
        Ok(action) => {
            let reason = if action.is_backoff() {
                ReconcileReason::Backoff
            } else {
                ReconcileReason::Requeue
            };
            let version = if action.is_backoff() {
                version(object)
            } else {
                None
            };
            let action = counts.settle(req, version.as_deref(), action, false);
            (action, reason, None)
        }
        Err(error) => {
            let failed_at = version(object);
            let action = if counts.take_terminal(req) {
                tracing::warn!(cluster = %req.cluster, error = %crate::client::Shown(&error), "reconcile failed with a terminal error; not retried until the object changes");
                Action::await_change()
            } else {
                tracing::warn!(cluster = %req.cluster, error = %crate::client::Shown(&error), "reconcile failed");
                error_policy(object.clone(), &error, ctx)
            };
            let action = counts.settle(req, failed_at.as_deref(), action, true);
            let failure =
                observed.then(|| super::Failure::Error(crate::client::Shown(&error).to_string()));
            (action, ReconcileReason::ErrorPolicy, failure)
        }
    }
}

async fn next_opt<T>(stream: &mut Option<BoxStream<'static, T>>) -> Option<T> {
    match stream {
        Some(stream) => stream.next().await,
        None => std::future::pending().await,
    }
}

async fn recv_ask<T>(rx: &mut Option<mpsc::Receiver<T>>) -> Option<T> {
    match rx {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}

/// How a reconcile ended, in the diagnostics view's words (the metrics' outcome, a timeout
/// and a reconcile cut short told apart).
fn result_of(reason: &ReconcileReason, action: &Action, dropped: bool) -> &'static str {
    use crate::metrics::Outcome;
    if dropped {
        return "dropped";
    }
    if *reason == ReconcileReason::TimedOut {
        return "timeout";
    }
    match super::queue::outcome_of(reason, action) {
        Outcome::Success => "success",
        Outcome::RequeueAfter => "requeue_after",
        Outcome::Requeue => "requeue",
        Outcome::Error => "error",
        Outcome::Panic => "panic",
    }
}

/// How a cluster's last reconcile ended, as the loop keeps it: formatted only when the view
/// asks.
struct Last<C: ClusterId> {
    at: std::time::SystemTime,
    request: Request<C>,
    result: &'static str,
    failure: Option<String>,
}

impl<C: ClusterId> Last<C> {
    fn view(&self) -> crate::diagnostics::LastReconcile {
        crate::diagnostics::LastReconcile {
            at: crate::diagnostics::timestamp(self.at),
            object: super::ObjectField {
                namespace: self.request.namespace.as_deref(),
                name: &self.request.name,
            }
            .to_string(),
            result: self.result.into(),
            error: self.failure.clone(),
        }
    }
}

async fn recv_opt<T>(rx: &mut Option<mpsc::UnboundedReceiver<T>>) -> Option<T> {
    match rx {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::ClusterName;
    use crate::controller::PredicateFn;
    use k8s_openapi::api::apps::v1::Deployment;
    use kube::api::ObjectMeta;
    use kube_runtime::watcher::Event;
    use tokio_util::sync::CancellationToken;

    fn deployment(name: &str, rv: &str, generation: i64) -> Deployment {
        Deployment {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("ns".into()),
                uid: Some(format!("uid-{name}")),
                resource_version: Some(rv.into()),
                generation: Some(generation),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    fn watch(events: Vec<Event<Deployment>>) -> Arc<SharedWatch<Deployment>> {
        let events = futures::stream::iter(
            events
                .into_iter()
                .map(|e| Ok(crate::cache::map_event::map_event(e, Arc::new))),
        )
        .chain(futures::stream::pending())
        .boxed();
        SharedWatch::start(
            events,
            &(),
            Arc::from("c0"),
            CancellationToken::new(),
            &[],
            None,
            None,
            &tokio::runtime::Handle::current(),
        )
        .0
    }

    fn spec(predicate: Option<PredicateFn<Deployment>>) -> Spec<Deployment, ClusterName> {
        Spec {
            observer: None,
            name: Arc::from("test"),
            dt: (),
            watcher_config: watcher::Config::default(),
            relations: Vec::new(),
            sources: Vec::new(),
            bulk: None,
            predicate,
            engage_local: false,
            engage_fleet: true,
            cluster_filter: None,
            concurrency: 0,
            per_cluster: None,
            debounce: std::time::Duration::ZERO,
            disengage_grace: std::time::Duration::ZERO,
            failure_backoff: crate::controller::FailureBackoff::default(),
            reconcile_timeout: None,
            changes_first: true,
            resync: None,
            warm: false,
            leader_only: false,
        }
    }

    #[tokio::test]
    async fn a_fleet_context_names_the_request_it_was_started_for() {
        use crate::cluster::Cluster;
        use k8s_openapi::api::core::v1::Node;
        let manager = crate::manager::Manager::new(crate::providers::Clusters::new());
        let shared = Arc::new(ReconcileShared::new(
            &spec(None),
            &manager.env(),
            Arc::new(()),
        ));
        let cluster = Cluster::from_config(
            ClusterName::from("a"),
            kube::Config::new("https://127.0.0.1:1".parse().unwrap()),
        )
        .unwrap();
        fn start<K: kube::Resource + Send + Sync + 'static>(
            req: &Request<ClusterName>,
            object: K,
            (cluster, shared): (
                &Cluster<ClusterName>,
                &Arc<ReconcileShared<ClusterName, ()>>,
            ),
        ) -> Context<ClusterName, ()> {
            let token = CancellationToken::new();
            Context::new(
                req,
                Arc::new(object),
                cluster.clone(),
                token,
                shared.clone(),
            )
        }
        let at = (&cluster, &shared);
        // An object under its own key: the request made from the object is the same, in the
        // context and in each clone of it.
        let own = Request::new(ClusterName::from("a"), Some("ns"), "app");
        let ctx = start(&own, deployment("app", "1", 1), at);
        assert_eq!(ctx.clone().request(), &own);
        assert_eq!(ctx.request(), &own);
        // A cluster-scoped object that a mapped request gave a namespace (the cache finds it
        // all the same): the context names the request as it came.
        let node = Node {
            metadata: ObjectMeta {
                name: Some("n1".into()),
                ..Default::default()
            },
            ..Default::default()
        };
        let mapped = Request::new(ClusterName::from("a"), Some("ns"), "n1");
        assert_eq!(start(&mapped, node.clone(), at).request(), &mapped);
        // And a request of another cluster id than the engagement's, likewise.
        let other = Request::new(ClusterName::from("b"), None::<String>, "n1");
        assert_eq!(start(&other, node, at).request(), &other);
    }

    /// The names of the triggered requests up to the one for the `sync` object.
    async fn names_until_sync(
        triggers: &mut BoxStream<'static, Trigger<ClusterName>>,
    ) -> Vec<String> {
        let mut names = Vec::new();
        while names.last().map(String::as_str) != Some("sync") {
            names.push(triggers.next().await.unwrap().0.name);
        }
        names
    }

    #[tokio::test]
    async fn after_a_replacement_a_status_only_change_does_not_pass_a_generation_predicate() {
        // The replaced cluster's cache held `app` at generation 1.
        let reference = watch(vec![
            Event::Init,
            Event::InitApply(deployment("app", "1", 1)),
            Event::InitDone,
        ]);
        reference.synced().await.unwrap();
        // The new cluster lists the same version (suppressed by the baseline), then a status
        // change (same generation), then a spec change, then a new object as a sync point.
        let new = watch(vec![
            Event::Init,
            Event::InitApply(deployment("app", "1", 1)),
            Event::InitDone,
            Event::Apply(deployment("app", "2", 1)),
            Event::Apply(deployment("app", "3", 2)),
            Event::Apply(deployment("sync", "4", 1)),
        ]);
        let generation: PredicateFn<Deployment> =
            Arc::new(|d: &Deployment| kube_runtime::predicates::generation(d));
        let spec = spec(Some(generation));
        let mut triggers = primary(
            &spec,
            &ClusterName::from("c0"),
            &new,
            Some(&reference.store),
        );
        let names = names_until_sync(&mut triggers).await;
        // Once for the spec change: neither the unchanged listing nor the status change.
        assert_eq!(names, ["app", "sync"]);
    }

    #[tokio::test]
    async fn an_object_recreated_under_the_same_name_passes_the_predicate() {
        let new = watch(vec![
            Event::Init,
            Event::InitApply(deployment("app", "1", 1)),
            Event::InitDone,
            Event::Delete(deployment("app", "2", 1)),
            // The same name, labels and generation, a new uid.
            Event::Apply(Deployment {
                metadata: ObjectMeta {
                    uid: Some("uid-app-2".into()),
                    ..deployment("app", "3", 1).metadata
                },
                ..Default::default()
            }),
            Event::Apply(deployment("sync", "4", 1)),
        ]);
        let generation: PredicateFn<Deployment> =
            Arc::new(|d: &Deployment| kube_runtime::predicates::generation(d));
        let spec = spec(Some(generation));
        let mut triggers = primary(&spec, &ClusterName::from("c0"), &new, None);
        let names = names_until_sync(&mut triggers).await;
        assert_eq!(names, ["app", "app", "sync"]);
    }
}
