//! Single-cluster mode: kube-runtime's own `Controller`, with nothing of this crate in the
//! path of an event but the reconcile's [`Context`].

use std::sync::Arc;
use std::time::Duration;

use futures::{FutureExt, StreamExt, TryStreamExt};
use kube::{Api, Resource};
use kube_runtime::{Controller, WatchStreamExt, watcher};
use tokio_util::task::TaskTracker;

use tracing::Instrument;

use super::context::ReconcileShared;
use super::gate::Gate;
use super::{ObjectField, Spec};
use crate::cache::Watchable;
use crate::cache::listing::WatchOptions;
use crate::cache::{Change, listing};
use crate::cluster::ClusterField;
use crate::cluster::Primary;
use crate::cluster::{Cluster, ClusterId};
use crate::controller::{Action, Context};
use crate::metrics::{Outcome, Series};
use crate::run::Env;
use crate::util::panic::panic_message;
use prometheus_client::metrics::gauge::Gauge;

/// What the runner hands to each call: everything a [`Context`] needs, behind the one `Arc`
/// kube-runtime passes around, so a call costs three reference-count increments and no
/// allocation of ours.
struct Single<C: ClusterId, S, F, EP> {
    cluster: Cluster<C>,
    shared: Arc<ReconcileShared<C, S>>,
    reconcile: Arc<F>,
    error_policy: Arc<EP>,
    /// kube-runtime spawns each reconcile as a task; the tracker tells when the ones it
    /// cancelled at shutdown are really gone.
    tracker: TaskTracker,
    /// The controller's name, for the reconcile's span.
    name: Arc<str>,
    /// Its metrics, if the manager keeps any.
    metrics: Option<Arc<SingleMetrics>>,
    /// The result observer, if the controller has one.
    observer: Option<super::Observer<C>>,
    /// How long a reconcile may run; `None` for no limit.
    timeout: Option<Duration>,
    /// Where listed objects wait behind live changes, if they do.
    gate: Option<Arc<Gate>>,
}

/// A single-cluster controller's series: the reconcile ones and its workers (its queue is
/// kube-runtime's, without metrics).
struct SingleMetrics {
    series: Series,
    active: Gauge,
}

/// Counts a reconcile as active until dropped (finished or cancelled).
struct Active(Arc<SingleMetrics>);

impl Active {
    fn new(metrics: Arc<SingleMetrics>) -> Self {
        metrics.active.inc();
        Self(metrics)
    }
}

impl Drop for Active {
    fn drop(&mut self) {
        self.0.active.dec();
    }
}

/// Why a single-cluster reconcile failed (the reconciler's error, or a panic caught), and
/// how long it ran (timed only when metrics or an observer want it).
#[derive(Debug)]
enum Failure<E> {
    Failed(E, Duration),
    Panicked(String, Duration),
    /// Dropped at the reconcile timeout (the limit).
    TimedOut(Duration, Duration),
}

impl<E> Failure<E> {
    fn took(self, took: Duration) -> Self {
        match self {
            Self::Failed(error, _) => Self::Failed(error, took),
            Self::Panicked(message, _) => Self::Panicked(message, took),
            Self::TimedOut(limit, _) => Self::TimedOut(limit, took),
        }
    }
}

impl<E: std::fmt::Display> std::fmt::Display for Failure<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Failed(error, _) => error.fmt(f),
            Self::Panicked(message, _) => write!(f, "the reconciler panicked: {message}"),
            Self::TimedOut(limit, _) => write!(f, "the reconcile ran past its timeout ({limit:?})"),
        }
    }
}

impl<E: std::error::Error + 'static> std::error::Error for Failure<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Failed(error, _) => Some(error),
            Self::Panicked(..) | Self::TimedOut(..) => None,
        }
    }
}

impl<C: ClusterId, S, F, EP> Single<C, S, F, EP> {
    /// `obj`'s request and version, as its failure count keys them.
    fn counted<K: Resource>(&self, obj: &K) -> (crate::controller::Request<C>, Option<String>) {
        (
            crate::controller::Request::from_obj(self.cluster.id().clone(), obj),
            super::version_of(obj),
        )
    }

    /// What comes after `obj`'s reconcile asked for `action` (its error policy, if it
    /// `failed`): see [`super::Failures::settle`]. Nothing to do (no key built) while no
    /// object fails and no backoff is asked for.
    fn settle<K: Resource>(&self, obj: &K, action: Action, failed: bool) -> Action {
        if !failed && !action.is_backoff() && self.shared.failures.is_empty() {
            return action;
        }
        let (request, version) = self.counted(obj);
        self.shared
            .failures
            .settle(&request, version.as_deref(), action, failed)
    }

    /// Whether `obj`'s reconcile said its error was terminal.
    fn take_terminal<K: Resource>(&self, obj: &K) -> bool {
        if self.shared.failures.is_empty() {
            return false;
        }
        let request = crate::controller::Request::from_obj(self.cluster.id().clone(), obj);
        self.shared.failures.take_terminal(&request)
    }

    /// How many times `obj` failed in a row before.
    fn prior<K: Resource>(&self, obj: &K) -> u32 {
        if self.shared.failures.is_empty() {
            return 0;
        }
        let (request, version) = self.counted(obj);
        self.shared.failures.prior(&request, version.as_deref())
    }

    /// Three reference counts; the request is built only if the reconciler asks for it.
    fn context<K: Resource + Send + Sync + 'static>(&self, obj: &Arc<K>) -> Context<C, S> {
        Context::for_object(obj.clone(), self.cluster.clone(), self.shared.clone())
    }
}

/// The objects `events` (reflected into the store `reader` reads) trigger, in two lanes: a
/// change goes on at once, an object listed without news (the first listing, or a relist
/// that found it at the resourceVersion the store held) waits in `gate`. With a `predicate`
/// downstream, a relist's unchanged objects are dropped here, as its filter would drop them.
fn lanes<K: Watchable>(
    events: impl futures::Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static,
    gate: Arc<Gate>,
    predicate: bool,
    reader: kube_runtime::reflector::Store<K>,
    dt: K::DynamicType,
) -> impl futures::Stream<Item = Result<K, watcher::Error>> + Send + 'static {
    let mut first = true;
    events.try_filter_map(move |event| {
        let live = match event {
            watcher::Event::Apply(object) => Some(object),
            watcher::Event::InitApply(object) => {
                // The store serves what it held until the listing is done.
                let held = kube_runtime::reflector::ObjectRef::from_obj_with(&object, dt.clone());
                let unchanged = first
                    || reader
                        .get(&held)
                        .is_some_and(|held| crate::cache::same_version(&*held, &object));
                if unchanged {
                    if first || !predicate {
                        gate.hold(&object);
                    }
                    None
                } else {
                    Some(object)
                }
            }
            watcher::Event::InitDone => {
                first = false;
                None
            }
            watcher::Event::Init | watcher::Event::Delete(_) => None,
        };
        if let Some(object) = &live {
            gate.pass(object);
        }
        std::future::ready(Ok(live))
    })
}

/// The objects a subscription to another controller's watch of the kind triggers: as
/// [`lanes`] and kube-runtime's own path do (deletions trigger nothing; with a gate, listed
/// objects without news wait in it), then through the predicate.
fn subscription<K: Watchable>(
    changes: impl futures::Stream<Item = Change<K>> + Send + 'static,
    gate: Option<Arc<Gate>>,
    predicate: Option<super::PredicateFn<K>>,
) -> impl futures::Stream<Item = Arc<K>> + Send + 'static {
    let with_predicate = predicate.is_some();
    let live = gate.clone();
    let changes = changes.filter_map(move |change| {
        let pass = match &gate {
            _ if change.deleted => false,
            None => true,
            Some(gate) if change.listed => {
                // A relist's unchanged objects: dropped where the predicate would drop them.
                if change.initial || !with_predicate {
                    gate.hold(&*change.object);
                }
                false
            }
            Some(gate) => {
                gate.pass(&*change.object);
                true
            }
        };
        std::future::ready(pass.then_some(Ok::<_, watcher::Error>(change)))
    });
    filtered(changes, predicate, live, |change: &Change<K>| {
        &*change.object
    })
    .filter_map(|change| std::future::ready(change.ok().map(|change| change.object)))
}

/// Through the predicate, then to the scheduler: what passed holds the gate as a live
/// change. `object` is the controller's object in an item.
fn filtered<T, K>(
    items: impl futures::Stream<Item = Result<T, watcher::Error>> + Send + 'static,
    predicate: Option<super::PredicateFn<K>>,
    gate: Option<Arc<Gate>>,
    object: fn(&T) -> &K,
) -> impl futures::Stream<Item = Result<T, watcher::Error>> + Send + 'static
where
    T: Resource + Send + 'static,
    T::DynamicType: Eq + std::hash::Hash + Clone + Send,
    K: 'static,
{
    let items = super::through_predicate(items, predicate, object);
    match gate {
        Some(gate) => items.inspect_ok(move |item| gate.live(item)).left_stream(),
        None => items.right_stream(),
    }
}

/// Runs `cluster`'s controller until shutdown; reconciles still running the graceful timeout
/// after it are dropped.
pub(crate) async fn run<K, C, S, F, Fut, E, EP>(
    spec: Arc<Spec<K, C>>,
    env: Env<C>,
    cluster: Cluster<C>,
    reconcile: Arc<F>,
    error_policy: Arc<EP>,
    state: Arc<S>,
) where
    K: Watchable,
    C: ClusterId,
    S: Send + Sync + 'static,
    F: Fn(Arc<K>, Context<C, S>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Action, E>> + Send + 'static,
    E: std::error::Error + Send + 'static,
    EP: Fn(Arc<K>, &E, &Context<C, S>) -> Action + Send + Sync + 'static,
{
    if let Some(filter) = &spec.cluster_filter
        && !filter(&cluster)
    {
        tracing::info!(controller = %spec.name, "the only cluster is filtered out; nothing to reconcile");
        env.shutdown.cancelled().await;
        return;
    }
    // A controller scheduling from another's watch of its kind starts over when that watch
    // stops under it (the other controller ended first): it then runs the watch itself, or
    // schedules from the one that does.
    while run_once(
        spec.clone(),
        env.clone(),
        cluster.clone(),
        reconcile.clone(),
        error_policy.clone(),
        state.clone(),
    )
    .await
    {
        tracing::info!(controller = %spec.name, "the watch this controller scheduled from stopped; starting over");
    }
}

/// One run of the controller until shutdown; `true` if it ended early because the watch it
/// scheduled from (another controller's) stopped, after its reconciles in flight finished.
///
/// Three steps: [`build`] the kube-runtime controller, adapt the reconciler to it
/// ([`Single`], [`reconcile_one`], [`on_failure`]), and [`drive`] it to shutdown.
async fn run_once<K, C, S, F, Fut, E, EP>(
    spec: Arc<Spec<K, C>>,
    env: Env<C>,
    cluster: Cluster<C>,
    reconcile: Arc<F>,
    error_policy: Arc<EP>,
    state: Arc<S>,
) -> bool
where
    K: Watchable,
    C: ClusterId,
    S: Send + Sync + 'static,
    F: Fn(Arc<K>, Context<C, S>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Action, E>> + Send + 'static,
    E: std::error::Error + Send + 'static,
    EP: Fn(Arc<K>, &E, &Context<C, S>) -> Action + Send + Sync + 'static,
{
    // Lanes need a limit to matter: without one every request starts when it is due.
    let gate =
        (spec.changes_first && spec.concurrency > 0).then(|| Arc::new(Gate::new(spec.concurrency)));
    let Some(built) = build(&spec, &env, &cluster, &gate).await else {
        return false;
    };
    let tracker = TaskTracker::new();
    let metrics = env.metrics.as_ref().map(|metrics| {
        Arc::new(SingleMetrics {
            series: metrics.series(&spec.name, &ClusterField(cluster.id()).to_string(), false),
            active: metrics.controller(&spec.name, spec.concurrency),
        })
    });
    let single = Arc::new(Single {
        metrics,
        observer: spec.observer.clone(),
        cluster,
        shared: Arc::new(ReconcileShared::new(&spec, &env, state)),
        reconcile,
        error_policy,
        tracker: tracker.clone(),
        name: spec.name.clone(),
        timeout: spec.reconcile_timeout,
        gate: gate.clone(),
    });
    drive(built, single, &spec, &env, gate, tracker).await
}

/// The kube-runtime controller of one run, and what watches beside it.
struct Built<K: Watchable> {
    controller: Controller<K>,
    /// The primary watch's state, shown beside the cluster's caches when it is not the
    /// engagement's own.
    report: Option<crate::cluster::reported::Report>,
    /// The adopted watch, to report if it has not listed within the cache sync timeout.
    overdue_watch: Option<(Arc<crate::cache::SharedWatch<K>>, Option<Duration>)>,
    /// Cancelled when the subscription ends before shutdown: the watch it follows stopped.
    orphaned: tokio_util::sync::CancellationToken,
}

/// Builds the kube-runtime controller: the primary watch adopted, subscribed to or run
/// apart (with its transform, predicate and lanes), the relations, the requests from
/// elsewhere, resyncs and bulk triggers. `None` if the manager shut down meanwhile.
async fn build<K: Watchable, C: ClusterId>(
    spec: &Spec<K, C>,
    env: &Env<C>,
    cluster: &Cluster<C>,
    gate: &Option<Arc<Gate>>,
) -> Option<Built<K>> {
    let transform = env.transforms.of::<K>();
    let options = WatchOptions {
        streaming: !env.paged_lists,
        // Managed fields are not decoded where the caches would drop them.
        trim: !env.transforms.keep_managed_fields,
        cluster: ClusterField(cluster.id()).to_string().into(),
    };
    let namespaces = env.namespaces.of::<K>(&spec.dt);
    let dt = spec.dt.clone();
    // One watch per kind and configuration in the engagement: the first controller of the
    // kind runs it and shows it to the rest of the crate (context caches read its store);
    // another controller of the kind schedules from that store and a subscription to it.
    let writer = kube_runtime::reflector::store::Writer::new(dt.clone());
    let reader = writer.as_reader();
    let (adopted, subscribed) = match cluster.claim_primary::<K>(&dt, &spec.watcher_config, &reader)
    {
        Primary::Own(adopted) => (Some(adopted), None),
        // Started once the other controller's watch has listed: kube-runtime's store wakes
        // only the last of the tasks waiting for it to be ready, and that controller waits.
        Primary::Subscribe(watch, reflector) => tokio::select! {
            synced = watch.synced() => match synced {
                Ok(()) => (None, Some((watch, reflector))),
                // It failed: this controller watches apart.
                Err(_) => (None, None),
            },
            () = env.shutdown.cancelled() => return None,
        },
        Primary::Apart => (None, None),
    };
    // Cancelled when the subscription ends before shutdown: the watch it follows stopped.
    let orphaned = tokio_util::sync::CancellationToken::new();
    // The primary watch's state, beside the cluster's caches (cache_status, readiness), for
    // a watch not shown as the engagement's own.
    let report = (adopted.is_none() && subscribed.is_none())
        .then(|| cluster.report_watch(K::kind(&dt).to_string(), &spec.name, &spec.watcher_config))
        .flatten();
    let overdue_watch = adopted
        .as_ref()
        .map(|a| (a.feed.watch().clone(), a.timeout));
    let observed = report.as_ref().map(|r| r.watch.clone());
    let observe = move |event: &Result<watcher::Event<K>, watcher::Error>| {
        if let Some(observed) = &observed {
            observed.observe(event);
        }
    };
    // After the reflector: the shared watch's readers find in its store what it announces.
    let mut adopted = adopted;
    let feed = move |event: &Result<watcher::Event<K>, watcher::Error>| {
        if let Some(adopted) = &mut adopted {
            adopted.feed.observe(event);
        }
    };
    // The cache resyncs and bulk triggers read: the other controller's, when subscribed.
    let cache = match &subscribed {
        Some((_, reflector)) => reflector.clone(),
        None => reader.clone(),
    };
    let controller = match (&spec.predicate, transform, subscribed) {
        (predicate, _, Some((watch, reflector))) => {
            drop(writer);
            let (orphaned, shutdown) = (orphaned.clone(), env.shutdown.clone());
            let ended = futures::stream::once(async move {
                if !shutdown.is_cancelled() {
                    orphaned.cancel();
                }
            })
            .filter_map(|()| std::future::ready(None));
            Controller::for_shared_stream_with(
                subscription(watch.subscribe(), gate.clone(), predicate.clone()).chain(ended),
                reflector,
                dt,
            )
        }
        // kube-runtime's own path (what `Controller::new_with` builds), when objects are kept
        // as they come, listed in pages, in every namespace, in one lane.
        (None, None, None) if !options.streaming && namespaces.is_none() && gate.is_none() => {
            let events = kube_runtime::watcher(
                Api::all_with(cluster.client(), &dt),
                spec.watcher_config.clone(),
            )
            .inspect(observe);
            Controller::for_stream_with(
                kube_runtime::reflector(writer, events)
                    .inspect(feed)
                    .applied_objects(),
                reader,
                dt,
            )
        }
        (predicate, transform, None) => {
            // The controller's trigger backoff covers this stream too (errors pass through).
            let target = listing::Target::all(cluster.requester(), &dt);
            let config = spec.watcher_config.clone();
            let stream = listing::scoped(target, namespaces, config, &options, &env.backoff)
                .inspect(observe)
                .map_ok(move |event| match &transform {
                    Some(transform) => event.modify(|o| transform.apply(o)),
                    None => event,
                })
                .reflect(writer)
                .inspect(feed);
            let stream = match &gate {
                // kube-runtime's own: every object listed or changed triggers.
                None => stream.applied_objects().left_stream(),
                Some(gate) => lanes(
                    stream,
                    gate.clone(),
                    predicate.is_some(),
                    reader.clone(),
                    dt.clone(),
                )
                .right_stream(),
            };
            let stream = filtered(stream, predicate.clone(), gate.clone(), |obj: &K| obj);
            Controller::for_stream_with(stream, reader, dt)
        }
    };
    let controller = triggers(controller, spec, env, cluster, gate, cache, &options);
    Some(Built {
        controller,
        report,
        overdue_watch,
        orphaned,
    })
}

/// Adds to `controller` what else triggers reconciles: the relations (owned and watched
/// objects), requests from elsewhere, resyncs and bulk triggers (through the gate, when
/// there is one, reading `cache`).
fn triggers<K: Watchable, C: ClusterId>(
    mut controller: Controller<K>,
    spec: &Spec<K, C>,
    env: &Env<C>,
    cluster: &Cluster<C>,
    gate: &Option<Arc<Gate>>,
    cache: kube_runtime::reflector::Store<K>,
    options: &WatchOptions,
) -> Controller<K> {
    for relation in &spec.relations {
        controller = relation.attach(controller, cluster, &env.namespaces, &env.backoff, options);
    }
    // Requests from elsewhere (another fleet, the local cluster, the user's streams) for
    // this cluster, through kube-runtime's own entry points.
    let given: Vec<_> = spec
        .sources
        .iter()
        .filter_map(|s| s.triggers(env))
        .collect();
    if !given.is_empty() {
        let (id, dt) = (cluster.id().clone(), spec.dt.clone());
        let refs = futures::stream::select_all(given).filter_map(move |(request, _)| {
            let this = request.cluster == id;
            std::future::ready(this.then(|| request.object_ref_with::<K>(dt.clone())))
        });
        controller = controller.reconcile_on(refs);
    }
    let bulk = spec.bulk.as_ref().and_then(|b| b.lend());
    let resync = spec
        .resync
        .map(|period| super::resync_ticks(period, env.shutdown.clone()).boxed());
    match &gate {
        Some(gate) => {
            // A resync or bulk trigger makes every cached object due: they wait in the gate,
            // behind live changes, as a listing's objects do (kube-runtime's own bulk
            // trigger would hand them all to its scheduler at once).
            let ticks = futures::stream::select_all(bulk.into_iter().chain(resync));
            let (held, cache) = (gate.clone(), cache.clone());
            let holds = ticks.filter_map(move |()| {
                for object in cache.state() {
                    held.hold(&*object);
                }
                std::future::ready(None::<kube_runtime::reflector::ObjectRef<K>>)
            });
            controller = controller.reconcile_on(futures::stream::select(
                gate.clone().releases::<K>(spec.dt.clone()),
                holds,
            ));
        }
        None => {
            // kube-runtime's bulk trigger reads the cache, as a resync does.
            if let Some(bulk) = bulk {
                controller = controller.reconcile_all_on(bulk);
            }
            if let Some(resync) = resync {
                controller = controller.reconcile_all_on(resync);
            }
        }
    }
    controller
}

/// One reconcile as kube-runtime calls it: the span, the context, the tenure, panics and
/// the reconcile timeout caught, metrics and the observer, the object's failure count
/// settled.
fn reconcile_one<K, C, S, F, Fut, E, EP>(
    obj: Arc<K>,
    single: Arc<Single<C, S, F, EP>>,
) -> impl Future<Output = Result<kube_runtime::controller::Action, Failure<E>>> + Send + 'static
where
    K: Watchable,
    C: ClusterId,
    S: Send + Sync + 'static,
    F: Fn(Arc<K>, Context<C, S>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Action, E>> + Send + 'static,
    E: std::error::Error + Send + 'static,
    EP: Fn(Arc<K>, &E, &Context<C, S>) -> Action + Send + Sync + 'static,
{
    use kube_runtime::controller::Action as KubeAction;
    // The same span as fleet mode's. kube-runtime keeps the trigger's reason to
    // itself (its enclosing span has it as `object.reason`).
    let span = tracing::info_span!(
        "reconcile",
        controller = %single.name,
        cluster = %ClusterField(single.cluster.id()),
        object = %ObjectField {
            namespace: obj.meta().namespace.as_deref(),
            name: obj.meta().name.as_deref().unwrap_or_default(),
        },
        reason = "unknown",
    );
    if let Some(gate) = &single.gate {
        gate.started(&*obj);
    }
    let deadline = single
        .timeout
        .map(|limit| tokio::time::Instant::now() + limit);
    let ctx = single
        .context(&obj)
        .with_failures(single.prior(&*obj))
        .with_deadline(deadline);
    // The object and controller again, to settle its failure count afterwards.
    let settling = (obj.clone(), single.clone());
    let observed = single.observer.as_ref().map(|observer| {
        (
            observer.clone(),
            crate::controller::Request::from_obj(single.cluster.id().clone(), &*obj),
        )
    });
    // Past the leader's tenure (its renewal overdue, the task that stops the
    // controllers not yet run: a starved runtime) the reconciler is not called;
    // the object comes back after a second, if the controller still runs.
    let held = single.shared.tenure.holds();
    let fut = held.then(|| (single.reconcile)(obj, ctx));
    let metrics = single.metrics.clone();
    // A panic ends this reconcile only (kube-runtime would carry it into the
    // controller's stream and end the controller).
    let fut = fut.map(|fut| {
        std::panic::AssertUnwindSafe(fut)
            .catch_unwind()
            .map(|ended| {
                ended
                    .map_err(|panic| {
                        let message = panic_message(&*panic);
                        tracing::error!(panic = %message, "reconcile panicked");
                        Failure::Panicked(message, Duration::ZERO)
                    })
                    .and_then(|result| {
                        result.map_err(|error| Failure::Failed(error, Duration::ZERO))
                    })
            })
    });
    // At the reconcile timeout the reconcile is dropped: a failure of its own.
    let fut = fut.map(|fut| match single.timeout {
        None => futures::future::Either::Left(fut),
        Some(limit) => futures::future::Either::Right(
            tokio::time::timeout(limit + super::TIMEOUT_GRACE, fut).map(move |done| {
                done.unwrap_or_else(|_| {
                    tracing::warn!(?limit, "reconcile dropped: it did not return within a second of its reconcile timeout; retried after the object's backoff");
                    Err(Failure::TimedOut(limit, Duration::ZERO))
                })
            }),
        ),
    });
    single.tracker.track_future(
        async move {
            let Some(fut) = fut else {
                return Ok(KubeAction::requeue(Duration::from_secs(1)));
            };
            let settle = |action: Action| {
                let (obj, single) = &settling;
                single.settle(&**obj, action, false)
            };
            if metrics.is_none() && observed.is_none() {
                return fut.await.map(|action| KubeAction::from(settle(action)));
            }
            let active = metrics.map(Active::new);
            let started = std::time::Instant::now();
            let result = fut.await;
            let took = started.elapsed();
            if let Some(active) = &active {
                let outcome = match &result {
                    Err(Failure::Failed(..)) => Outcome::Error,
                    Err(Failure::Panicked(..)) => Outcome::Panic,
                    Err(Failure::TimedOut(..)) => {
                        active.0.series.timed_out();
                        Outcome::Error
                    }
                    Ok(action) => action.outcome(),
                };
                // Returned past its deadline: a timeout too, as
                // controller-runtime counts one.
                if !matches!(result, Err(Failure::TimedOut(..)))
                    && deadline.is_some_and(|d| tokio::time::Instant::now() >= d)
                {
                    active.0.series.timed_out();
                }
                let mark = crate::telemetry::TraceMark::of(&tracing::Span::current());
                active.0.series.reconciled(outcome, took, mark);
            }
            match result {
                Ok(action) => {
                    let action = settle(action);
                    // A failure is observed where the error policy decides.
                    if let Some((observer, request)) = observed {
                        super::observe(
                            &observer,
                            super::Reconciled {
                                request,
                                action,
                                failure: None,
                                took,
                            },
                        );
                    }
                    Ok(KubeAction::from(action))
                }
                Err(failure) => Err(failure.took(took)),
            }
        }
        .instrument(span),
    )
}

/// What follows a failed reconcile: the error policy (its panic caught) unless the error is
/// terminal, the failure count settled, metrics and the observer told.
fn on_failure<K, C, S, F, Fut, E, EP>(
    obj: Arc<K>,
    error: &Failure<E>,
    single: Arc<Single<C, S, F, EP>>,
) -> kube_runtime::controller::Action
where
    K: Watchable,
    C: ClusterId,
    S: Send + Sync + 'static,
    F: Fn(Arc<K>, Context<C, S>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Action, E>> + Send + 'static,
    E: std::error::Error + Send + 'static,
    EP: Fn(Arc<K>, &E, &Context<C, S>) -> Action + Send + Sync + 'static,
{
    let request = single
        .observer
        .as_ref()
        .map(|_| crate::controller::Request::from_obj(single.cluster.id().clone(), &*obj));
    let (action, failure, took) = match error {
        Failure::Failed(error, took) => {
            let ctx = single.context(&obj).with_failures(single.prior(&*obj));
            let terminal = single.take_terminal(&*obj);
            // The error policy is the user's code too: its panic is caught.
            let action = if terminal {
                tracing::warn!(controller = %single.name, "the error is terminal; not retried until the object changes");
                Action::await_change()
            } else {
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    (single.error_policy)(obj.clone(), error, &ctx)
                }))
                .unwrap_or_else(|panic| {
                    tracing::error!(controller = %single.name, panic = %panic_message(&*panic), "error policy panicked");
                    Action::requeue(super::PANIC_REQUEUE)
                })
            };
            let action = single.settle(&*obj, action, true);
            if action.requeue_after().is_none()
                && let Some(metrics) = &single.metrics
            {
                metrics.series.terminal();
            }
            let failure = request
                .is_some()
                .then(|| super::Failure::Error(crate::client::Shown(error).to_string()));
            (action, failure, *took)
        }
        Failure::Panicked(message, took) => (
            {
                // A mark the panicked reconcile left is its own.
                single.take_terminal(&*obj);
                Action::requeue(super::PANIC_REQUEUE)
            },
            Some(super::Failure::Panic(message.clone())),
            *took,
        ),
        Failure::TimedOut(limit, took) => (
            single.settle(&*obj, Action::backoff(), true),
            Some(super::Failure::Timeout(*limit)),
            *took,
        ),
    };
    if let (Some(observer), Some(request)) = (&single.observer, request) {
        super::observe(
            observer,
            super::Reconciled {
                request,
                action,
                failure,
                took,
            },
        );
    }
    action.into()
}

/// Runs the controller until shutdown (or until the watch it subscribed to stops), reports
/// an overdue first listing, bounds kube-runtime's graceful shutdown by the graceful timeout
/// and waits until every reconcile task it started is gone.
async fn drive<K, C, S, F, Fut, E, EP>(
    built: Built<K>,
    single: Arc<Single<C, S, F, EP>>,
    spec: &Spec<K, C>,
    env: &Env<C>,
    gate: Option<Arc<Gate>>,
    tracker: TaskTracker,
) -> bool
where
    K: Watchable,
    C: ClusterId,
    S: Send + Sync + 'static,
    F: Fn(Arc<K>, Context<C, S>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Action, E>> + Send + 'static,
    E: std::error::Error + Send + 'static,
    EP: Fn(Arc<K>, &E, &Context<C, S>) -> Action + Send + Sync + 'static,
{
    use kube_runtime::controller::Error as KubeError;

    let Built {
        controller,
        report,
        overdue_watch,
        orphaned,
    } = built;
    let config = kube_runtime::controller::Config::default()
        .concurrency(u16::try_from(spec.concurrency).unwrap_or(u16::MAX))
        .debounce(spec.debounce);
    let shutdown = env.shutdown.clone();
    let grace = env.grace.clone();
    let name = spec.name.clone();
    let running = controller
        .with_config(config)
        .trigger_backoff(env.backoff.delays())
        .graceful_shutdown_on({
            let (shutdown, orphaned) = (shutdown.clone(), orphaned.clone());
            async move {
                tokio::select! {
                    () = shutdown.cancelled() => {}
                    () = orphaned.cancelled() => {}
                }
            }
        })
        .run(
            reconcile_one::<K, C, S, F, Fut, E, EP>,
            on_failure::<K, C, S, F, Fut, E, EP>,
            single,
        )
        .for_each(move |result| {
            match result {
                Ok(_) => {}
                Err(KubeError::ObjectNotFound(obj)) => {
                    if let Some(gate) = &gate {
                        gate.begun(&crate::cache::ObjectKey {
                            namespace: obj.namespace.clone(),
                            name: obj.name.clone(),
                        });
                    }
                    tracing::debug!(controller = %name, object = %obj, "object not in the cache (deleted); skipping");
                }
                Err(KubeError::ReconcilerFailed(error, obj)) => {
                    tracing::warn!(controller = %name, object = %obj, error = %crate::client::Shown(&error), "reconcile failed");
                }
                Err(error) => tracing::warn!(controller = %name, error = %crate::client::Shown(&error), "controller error"),
            }
            std::future::ready(())
        });
    // A primary watch that has not listed within the cache sync timeout is reported.
    let overdue = async move {
        if let Some(report) = &report
            && let Some(timeout) = report.timeout
        {
            report.watch.clone().report_if_overdue(timeout).await;
        }
        if let Some((watch, Some(timeout))) = overdue_watch {
            watch.report_if_overdue(timeout).await;
        }
        // The report stays listed while the controller runs.
        std::future::pending::<()>().await;
        drop(report);
    };
    let running = async move {
        tokio::select! {
            () = running => {}
            () = overdue => {}
        }
    };
    // kube-runtime's graceful shutdown waits for reconciles in flight without a bound.
    let deadline = async {
        shutdown.cancelled().await;
        grace.over().await;
    };
    tokio::select! {
        () = running => {}
        () = deadline => {
            tracing::warn!(controller = %spec.name, "reconciles still running after the graceful timeout were dropped");
        }
    }
    // Dropping the controller cancelled the reconcile tasks it spawned; wait until they are
    // gone, so nothing of this controller runs once it has returned.
    tracker.close();
    tracker.wait().await;
    orphaned.is_cancelled() && !env.shutdown.is_cancelled()
}
