//! [`SharedWatch`]: one watch of one kind in one engaged cluster, feeding a reflector store,
//! its field indexes and every controller relation that subscribes to it.

use std::fmt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Mutex, Weak};

use futures::{Stream, StreamExt};
use kube::Resource;
use kube_runtime::watcher::{self, Event};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::backoff::WatchBackoff;
use super::errors::CacheError;
use super::index::{FieldIndexes, Indexer};
use super::store::{ObjectKey, Store, Writer};
use crate::cache::Watchable;
use crate::util::panic::panic_message;
use crate::util::sync::lock;

/// What every watch of a fleet's clusters shares: how to retry, and where to report a watch
/// that cannot go on.
#[derive(Clone, Debug, Default)]
pub(crate) struct WatchSettings {
    pub(crate) backoff: WatchBackoff,
    /// The running manager's fault channel; `None` outside a manager.
    pub(crate) faults: Option<mpsc::UnboundedSender<Fault>>,
    /// The manager's metrics, if it keeps any.
    pub(crate) metrics: Option<crate::metrics::Metrics>,
    /// The manager's default limit on each cluster's client requests.
    pub(crate) rate_limit: Option<crate::client::RateLimit>,
    /// What the caches keep of each object.
    pub(crate) transforms: Arc<super::transform::Transforms>,
    /// Watches list in pages of list requests, never by streaming lists.
    pub(crate) paged_lists: bool,
    /// The namespaces each kind is watched in.
    pub(crate) namespaces: Arc<super::namespaces::NamespaceScopes>,
    /// A watch that has not listed within this long is reported (a WARN line, its
    /// [`CacheStatus::overdue`](crate::CacheStatus::overdue), a metric); `None`: never.
    pub(crate) sync_timeout: Option<std::time::Duration>,
    /// The CRDs (`<plural>.<group>`) whose kinds' watches wait until the CRD is `Established`
    /// before listing: those a bundle installs (`Manager::install`).
    pub(crate) established: Arc<std::sync::RwLock<std::collections::BTreeSet<String>>>,
}

/// A watch that stopped for good because user code panicked inside it (a field index
/// extractor): its cache would freeze while the cluster looks engaged, so the manager stops.
#[derive(Clone, Debug)]
pub struct Fault {
    /// The cluster of the watch.
    pub cluster: String,
    /// The kind watched.
    pub kind: String,
    /// What happened.
    pub reason: String,
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "cluster {}: the watch of {} stopped: {}",
            self.cluster, self.kind, self.reason
        )
    }
}

/// A change seen by a shared watch.
#[derive(Debug)]
pub(crate) struct Change<K> {
    /// The object as stored (or, for a deletion, as last seen).
    pub(crate) object: Arc<K>,
    /// Whether it was deleted (seen deleted, or gone from a relist).
    pub(crate) deleted: bool,
    /// Whether it comes from the first complete listing (or a replay of the store to a late
    /// subscriber) rather than from a later change.
    pub(crate) initial: bool,
    /// Whether it is no news: listed (first listing, replay, or a relist that found it at
    /// the resourceVersion the store held), not seen changing. Such changes are reconciled
    /// after live ones.
    pub(crate) listed: bool,
}

impl<K> Clone for Change<K> {
    fn clone(&self) -> Self {
        Self {
            object: self.object.clone(),
            deleted: self.deleted,
            initial: self.initial,
            listed: self.listed,
        }
    }
}

/// A change is a resource for kube-runtime's predicate filter, which keys its cache by the
/// object's metadata (uid included); the flags ride along.
impl<K: Watchable> Resource for Change<K> {
    type DynamicType = K::DynamicType;
    type Scope = K::Scope;

    fn kind(dt: &K::DynamicType) -> std::borrow::Cow<'_, str> {
        K::kind(dt)
    }
    fn group(dt: &K::DynamicType) -> std::borrow::Cow<'_, str> {
        K::group(dt)
    }
    fn version(dt: &K::DynamicType) -> std::borrow::Cow<'_, str> {
        K::version(dt)
    }
    fn plural(dt: &K::DynamicType) -> std::borrow::Cow<'_, str> {
        K::plural(dt)
    }
    fn meta(&self) -> &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
        self.object.meta()
    }
    fn meta_mut(&mut self) -> &mut k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
        Arc::make_mut(&mut self.object).meta_mut()
    }
}

/// Where a watch is in its life.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum WatchState {
    /// The first listing is not in yet; `error` is the last failure, if any (forbidden, a
    /// missing CRD, an unreachable server).
    Listing { error: Option<String> },
    /// The first listing is in the store (later relists keep the old content until their
    /// own listing is complete); `error` is the current failure if the watch is failing
    /// again (its content may be stale then).
    Synced { error: Option<String> },
    /// The watch ended: its cluster's engagement ended (`failure` is `None`) or it failed.
    Stopped { failure: Option<String> },
}

/// The subscribers of a watch; closed once it stops, so late subscribers see their stream end.
struct Subscribers<K> {
    open: bool,
    senders: Vec<mpsc::UnboundedSender<Change<K>>>,
}

impl<K> Subscribers<K> {
    /// Sends `change` to every subscriber, forgetting those that are gone.
    fn send(&mut self, change: Change<K>) {
        self.senders.retain(|tx| tx.send(change.clone()).is_ok());
    }
}

/// One watch of one resource type and configuration in one engagement of a cluster, feeding a
/// reflector store, field indexes and any number of subscribers (one per controller relation).
pub(crate) struct SharedWatch<K: Watchable> {
    /// When its last event came, and how often it failed.
    activity: Activity,
    pub(crate) store: Store<K>,
    subscribers: Mutex<Subscribers<K>>,
    /// Field indexes over `store`, updated with it.
    indexes: Mutex<FieldIndexes<K>>,
    /// Readable by many waiters at once (kube-runtime's `Store::wait_until_ready` wakes only
    /// the last of several tasks waiting on one store).
    state: tokio::sync::watch::Sender<WatchState>,
    /// Stops the watch task: cancelled with the engagement, or when the watch fails.
    stop: CancellationToken,
    cluster: Arc<str>,
    /// The kind's name, for logs and errors.
    kind: Arc<str>,
    faults: Option<mpsc::UnboundedSender<Fault>>,
    /// When it started (its first listing's time counts from here).
    started: std::time::Instant,
    /// For a watch a single-cluster controller runs (see [`SharedWatch::adopt`]): the
    /// kube-runtime store its reflector writes, which `store` reads too and another controller
    /// of the kind schedules from.
    reflector: Option<kube_runtime::reflector::Store<K>>,
}

impl<K> SharedWatch<K>
where
    K: Watchable,
{
    /// A watch of `events` for `cluster`, running on `runtime` until `stop` is cancelled;
    /// reported once if it has not listed within `sync_timeout`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn start(
        events: impl Stream<Item = Result<Event<Arc<K>>, watcher::Error>> + Send + 'static,
        dt: &K::DynamicType,
        cluster: Arc<str>,
        stop: CancellationToken,
        indexers: &[Indexer],
        faults: Option<mpsc::UnboundedSender<Fault>>,
        sync_timeout: Option<std::time::Duration>,
        runtime: &tokio::runtime::Handle,
    ) -> (Arc<Self>, tokio::task::JoinHandle<()>) {
        let writer = Writer::<K>::new();
        let watch = Self::new(
            writer.as_reader(),
            None,
            dt,
            cluster,
            stop,
            indexers,
            faults,
        );
        let task = runtime.spawn(run(events, writer, Arc::downgrade(&watch), sync_timeout));
        (watch, task)
    }

    /// A shared watch whose events come from elsewhere: a single-cluster controller's own
    /// watch, reflected by kube-runtime into `reflector` and handed on by the returned
    /// [`Feed`]. Caches of the kind read that store; other controllers subscribe as usual.
    pub(crate) fn adopt(
        reflector: kube_runtime::reflector::Store<K>,
        dt: &K::DynamicType,
        cluster: Arc<str>,
        stop: CancellationToken,
        indexers: &[Indexer],
        faults: Option<mpsc::UnboundedSender<Fault>>,
    ) -> Feed<K> {
        let store = Store::of_reflector(reflector.clone(), dt.clone());
        let watch = Self::new(store, Some(reflector), dt, cluster, stop, indexers, faults);
        Feed {
            watch,
            relist: Relist { first: true },
            failing: false,
            before: None,
            stopped: false,
        }
    }

    /// A watch listing, over `store`, with the field indexes `indexers` give it.
    fn new(
        store: Store<K>,
        reflector: Option<kube_runtime::reflector::Store<K>>,
        dt: &K::DynamicType,
        cluster: Arc<str>,
        stop: CancellationToken,
        indexers: &[Indexer],
        faults: Option<mpsc::UnboundedSender<Fault>>,
    ) -> Arc<Self> {
        let watch = Arc::new(Self {
            store,
            subscribers: Mutex::new(Subscribers {
                open: true,
                senders: Vec::new(),
            }),
            indexes: Mutex::new(FieldIndexes::default()),
            state: tokio::sync::watch::Sender::new(WatchState::Listing { error: None }),
            stop,
            cluster,
            kind: Arc::from(K::kind(dt).as_ref()),
            faults,
            started: std::time::Instant::now(),
            reflector,
            activity: Activity::default(),
        });
        for indexer in indexers {
            watch.add_indexer(indexer);
        }
        watch
    }

    /// The kube-runtime store of an adopted watch (see [`SharedWatch::adopt`]).
    pub(crate) fn reflector(&self) -> Option<&kube_runtime::reflector::Store<K>> {
        self.reflector.as_ref()
    }

    /// Completes after `timeout` from its start, having warned if it had not listed by then.
    pub(crate) async fn report_if_overdue(self: Arc<Self>, timeout: std::time::Duration) {
        tokio::time::sleep_until((self.started + timeout).into()).await;
        if let WatchState::Listing { error } = self.state() {
            warn_overdue(&self.cluster, &self.kind, timeout, error.as_deref());
        }
    }

    /// A stream of changes from now on, starting with every object already in the store
    /// (marked initial), so a subscriber that comes late misses nothing. The stream ends once
    /// the watch has stopped and everything sent before is drained.
    pub(crate) fn subscribe(&self) -> impl Stream<Item = Change<K>> + Send + use<K> {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let mut subscribers = lock(&self.subscribers);
        // Under the lock the watch task cannot notify in between: no change is lost or
        // delivered before the replay.
        for object in self.store.state() {
            let _ = tx.send(Change {
                object,
                deleted: false,
                initial: true,
                listed: true,
            });
        }
        if subscribers.open {
            subscribers.senders.push(tx);
        }
        futures::stream::poll_fn(move |cx| rx.poll_recv(cx))
    }

    /// Completes once the first listing is in the store; an error if the watch stopped first.
    pub(crate) fn synced(
        &self,
    ) -> impl std::future::Future<Output = Result<(), CacheError>> + Send + 'static {
        let mut rx = self.state.subscribe();
        let cluster = self.cluster.clone();
        let kind = self.kind.clone();
        async move {
            let state = rx
                .wait_for(|s| !matches!(s, WatchState::Listing { .. }))
                .await
                .map(|s| s.clone())
                .unwrap_or(WatchState::Stopped { failure: None });
            match state {
                WatchState::Synced { .. } | WatchState::Listing { .. } => Ok(()),
                WatchState::Stopped { failure: None } => Err(CacheError::NotEngaged {
                    cluster: cluster.to_string(),
                }),
                WatchState::Stopped {
                    failure: Some(reason),
                } => Err(CacheError::WatchFailed {
                    cluster: cluster.to_string(),
                    kind: kind.to_string(),
                    reason,
                }),
            }
        }
    }

    /// The kind's name.
    pub(crate) fn kind(&self) -> &str {
        &self.kind
    }

    /// Whether the first listing is in the store.
    pub(crate) fn is_synced(&self) -> bool {
        matches!(*self.state.borrow(), WatchState::Synced { .. })
    }

    /// The watch's state.
    pub(crate) fn state(&self) -> WatchState {
        self.state.borrow().clone()
    }

    /// When the watch started.
    pub(crate) fn started(&self) -> std::time::Instant {
        self.started
    }

    /// When its last event came, and how often it failed.
    pub(crate) fn activity(&self) -> &Activity {
        &self.activity
    }

    /// Registers a field index (once per name) and fills it from the store. Runs the user's
    /// extractor: a panic fails the watch.
    pub(crate) fn add_indexer(&self, indexer: &Indexer) {
        let Some(extract) = indexer.extract::<K>() else {
            return;
        };
        let added = catch_unwind(AssertUnwindSafe(|| {
            // Lock before the snapshot: the watch task updates indexes under this lock after
            // applying each event, so no event can fall between snapshot and registration.
            let mut indexes = lock(&self.indexes);
            let objects = self.store.state();
            indexes.add(indexer.name.clone(), extract, objects.iter().map(|o| &**o));
        }));
        if let Err(panic) = added {
            self.fail(format!(
                "the field index {:?} panicked: {}",
                indexer.name,
                panic_message(&*panic)
            ));
        }
    }

    /// The cached objects the field index `index` files under `value`.
    pub(crate) fn indexed(&self, index: &str, value: &str) -> Result<Vec<Arc<K>>, CacheError> {
        let refs =
            lock(&self.indexes)
                .lookup(index, value)
                .ok_or_else(|| CacheError::UnknownIndex {
                    cluster: self.cluster.to_string(),
                    kind: self.kind.to_string(),
                    index: index.to_string(),
                })?;
        Ok(refs.iter().filter_map(|r| self.store.get_key(r)).collect())
    }

    /// The watch fails (it retries): `error` is shown until it works again.
    fn failing(&self, error: String) {
        self.activity.failed();
        self.state.send_if_modified(|s| match s {
            WatchState::Listing { error: e } | WatchState::Synced { error: e } => {
                *e = Some(error);
                true
            }
            WatchState::Stopped { .. } => false,
        });
    }

    /// A listing completed or a change came after a failure: the error is cleared.
    fn recovered(&self) {
        self.state.send_if_modified(|s| match s {
            WatchState::Synced { error } if error.is_some() => {
                *error = None;
                true
            }
            _ => false,
        });
    }

    fn notify(&self, change: Change<K>) {
        lock(&self.subscribers).send(change);
    }

    /// Stops the watch for good because of `reason`, and reports it to the manager.
    fn fail(&self, reason: String) {
        let kind = self.kind.to_string();
        tracing::error!(cluster = %self.cluster, %kind, %reason, "watch stopped");
        if let Some(faults) = &self.faults {
            let _ = faults.send(Fault {
                cluster: self.cluster.to_string(),
                kind,
                reason: reason.clone(),
            });
        }
        self.close(Some(reason));
    }

    /// Closes the subscriptions (each subscriber drains what was sent, then its stream ends)
    /// and wakes every waiter.
    fn close(&self, failure: Option<String>) {
        {
            let mut subscribers = lock(&self.subscribers);
            subscribers.open = false;
            subscribers.senders.clear();
        }
        self.state.send_modify(|s| {
            if !matches!(s, WatchState::Stopped { failure: Some(_) }) {
                *s = WatchState::Stopped { failure };
            }
        });
        self.stop.cancel();
    }
}

/// Hands the events of a single-cluster controller's watch, after kube-runtime's reflector
/// applied them, to the [`SharedWatch`] that shows that watch to the rest of the crate: its
/// state (caches wait for its first listing, `cache_status` and `/readyz` show it), its field
/// indexes, and its subscribers. Dropping it (the controller ended) stops the shared watch.
pub(crate) struct Feed<K: Watchable> {
    watch: Arc<SharedWatch<K>>,
    relist: Relist,
    /// Whether the last event was an error (the state holds it).
    failing: bool,
    /// The objects held when a relist began ([`Relist`]).
    before: Option<Vec<Arc<K>>>,
    /// Set once the watch failed (a field index panicked): nothing more is handed on.
    stopped: bool,
}

impl<K: Watchable> Feed<K> {
    /// The shared watch fed.
    pub(crate) fn watch(&self) -> &Arc<SharedWatch<K>> {
        &self.watch
    }

    /// Follows one event the reflector has applied.
    pub(crate) fn observe(&mut self, event: &Result<Event<K>, watcher::Error>) {
        if self.stopped {
            return;
        }
        let event = match event {
            Ok(event) => {
                if !matches!(event, Event::Init) {
                    self.watch.activity.event();
                }
                event
            }
            Err(error) => {
                self.failing = true;
                self.watch.failing(crate::client::redact::safe_text(error));
                return;
            }
        };
        if self.failing && matches!(event, Event::InitDone | Event::Apply(_) | Event::Delete(_)) {
            self.failing = false;
            self.watch.recovered();
        }
        let applied = catch_unwind(AssertUnwindSafe(|| self.apply(event)));
        if let Err(panic) = applied {
            self.stopped = true;
            self.watch
                .fail(format!("panicked: {}", panic_message(&*panic)));
        }
    }

    /// Indexes and subscribers. The subscribers' lock is taken for every event (uncontended
    /// but for a new subscription): a subscription replays the store under it, so an event
    /// the reflector applied before is in the replay and one applied after is sent.
    fn apply(&mut self, event: &Event<K>) {
        let watch = &*self.watch;
        match event {
            Event::Apply(obj) => {
                index(watch, |ix| ix.apply(obj));
                let mut subscribers = lock(&watch.subscribers);
                let meta = obj.meta();
                if !subscribers.senders.is_empty()
                    && let Some(object) = watch.store.get_named(
                        meta.namespace.as_deref(),
                        meta.name.as_deref().unwrap_or_default(),
                    )
                {
                    subscribers.send(Change {
                        object,
                        deleted: false,
                        initial: false,
                        listed: false,
                    });
                }
            }
            Event::Delete(obj) => {
                index(watch, |ix| ix.delete(obj));
                let mut subscribers = lock(&watch.subscribers);
                if !subscribers.senders.is_empty() {
                    subscribers.send(Change {
                        object: Arc::new(obj.clone()),
                        deleted: true,
                        initial: false,
                        listed: false,
                    });
                }
            }
            Event::Init => {
                // The reflector serves the old content until the listing is done: what it
                // held before, for a subscriber that comes during the relist too.
                self.before = (!self.relist.first).then(|| watch.store.state());
            }
            Event::InitApply(_) => {}
            Event::InitDone => {
                index(watch, |ix| {
                    ix.rebuild(watch.store.state().iter().map(|o| &**o))
                });
                watch.state.send_if_modified(|s| match s {
                    WatchState::Stopped { .. } => false,
                    _ => {
                        *s = WatchState::Synced { error: None };
                        true
                    }
                });
                let before = self.before.take().unwrap_or_default();
                let mut subscribers = lock(&watch.subscribers);
                if !subscribers.senders.is_empty() {
                    let before: std::collections::HashMap<ObjectKey, Arc<K>> = before
                        .into_iter()
                        .map(|o| (ObjectKey::of(&*o), o))
                        .collect();
                    let listed: Vec<_> = watch
                        .store
                        .state()
                        .into_iter()
                        .map(|object| {
                            let held = before.get(&ObjectKey::of(&*object));
                            let unchanged = self.relist.unchanged(held.map(|h| &**h), &*object);
                            (object, unchanged)
                        })
                        .collect();
                    self.relist
                        .announce(listed, before.into_values(), &watch.store, |change| {
                            subscribers.send(change)
                        });
                }
                self.relist.first = false;
            }
        }
    }
}

impl<K: Watchable> Drop for Feed<K> {
    fn drop(&mut self) {
        self.watch.close(None);
    }
}

/// The objects of a listing in progress: the store swaps them in only at InitDone, so their
/// notifications wait until then (a reconcile must find the object in the store).
struct Listing {
    /// The listing's objects, each with whether the store held it at the same
    /// resourceVersion before (always for the first listing).
    refs: Vec<(ObjectKey, bool)>,
    relist: Relist,
}

/// Drives one shared watch until it stops or nobody holds it.
async fn run<K: Watchable>(
    events: impl Stream<Item = Result<Event<Arc<K>>, watcher::Error>> + Send,
    mut writer: Writer<K>,
    shared: Weak<SharedWatch<K>>,
    sync_timeout: Option<std::time::Duration>,
) {
    let Some((stop, kind)) = shared.upgrade().map(|s| (s.stop.clone(), s.kind.clone())) else {
        return;
    };
    let mut events = std::pin::pin!(events);
    let mut listing = Listing {
        refs: Vec::new(),
        relist: Relist { first: true },
    };
    let mut failures = 0u32;
    let overdue = async move {
        match sync_timeout {
            Some(timeout) => tokio::time::sleep(timeout).await,
            None => std::future::pending().await,
        }
    };
    let mut overdue = std::pin::pin!(futures::FutureExt::fuse(overdue));
    loop {
        let event = tokio::select! {
            () = stop.cancelled() => break,
            () = &mut overdue => {
                if let Some(shared) = shared.upgrade()
                    && let WatchState::Listing { error } = shared.state()
                {
                    warn_overdue(&shared.cluster, &kind, sync_timeout.unwrap_or_default(), error.as_deref());
                }
                continue;
            }
            event = events.next() => event,
        };
        let Some(shared) = shared.upgrade() else {
            break;
        };
        match event {
            None => break,
            Some(Err(error)) => {
                // The watcher retries with backoff; an unreachable, restarting or forbidding
                // cluster is reported here and does not affect the others. Once per outage at
                // WARN, then quietly until it works again.
                failures += 1;
                let error = crate::client::redact::safe_text(&error);
                if failures == 1 {
                    tracing::warn!(cluster = %shared.cluster, %kind, %error, "watch failed; retrying (requests for its objects wait)");
                } else {
                    tracing::debug!(cluster = %shared.cluster, %kind, %error, failures, "watch failed again; retrying");
                }
                shared.failing(error);
            }
            Some(Ok(event)) => {
                if !matches!(event, Event::Init) {
                    shared.activity.event();
                }
                // A watcher starts each listing attempt with Init: only a completed listing or
                // a change shows it works again.
                let progress =
                    matches!(event, Event::InitDone | Event::Apply(_) | Event::Delete(_));
                if failures > 0 && progress {
                    tracing::info!(cluster = %shared.cluster, %kind, failures, "watch recovered");
                    failures = 0;
                    shared.recovered();
                }
                let applied = catch_unwind(AssertUnwindSafe(|| {
                    step(&shared, &mut writer, event, &mut listing)
                }));
                if let Err(panic) = applied {
                    shared.fail(format!("panicked: {}", panic_message(&*panic)));
                    return;
                }
            }
        }
    }
    if let Some(shared) = shared.upgrade() {
        shared.close(None);
    }
    tracing::debug!(%kind, "watch stopped");
}

/// Applies one event: store, indexes (user code), then subscribers. A relist's listing is
/// announced at its end, when the store holds it; objects the store held before and the
/// listing lacks were deleted during the gap and are announced as deletions (client-go's
/// `DeletedFinalStateUnknown`), so owners and mappers hear of them.
fn step<K: Watchable>(
    shared: &SharedWatch<K>,
    writer: &mut Writer<K>,
    event: Event<Arc<K>>,
    listing: &mut Listing,
) {
    let store = &shared.store;
    match event {
        Event::Apply(obj) => {
            writer.apply(obj.clone());
            index(shared, |ix| ix.apply(&obj));
            shared.notify(Change {
                object: obj,
                deleted: false,
                initial: false,
                listed: false,
            });
        }
        Event::Delete(obj) => {
            writer.delete(&obj);
            index(shared, |ix| ix.delete(&obj));
            shared.notify(Change {
                object: obj,
                deleted: true,
                initial: false,
                listed: false,
            });
        }
        Event::Init => {
            listing.refs.clear();
            writer.init();
        }
        Event::InitApply(obj) => {
            let key = ObjectKey::of(&*obj);
            // The store serves its old content until the listing is done.
            let unchanged = listing
                .relist
                .unchanged(store.get_key(&key).as_deref(), &*obj);
            listing.refs.push((key, unchanged));
            writer.init_apply(obj);
        }
        Event::InitDone => {
            let before = if listing.relist.first {
                Vec::new()
            } else {
                store.state()
            };
            writer.init_done();
            index(shared, |ix| ix.rebuild(store.state().iter().map(|o| &**o)));
            // Synced before the listing is announced: whoever handles an announced object
            // finds the store synced.
            shared
                .state
                .send_replace(WatchState::Synced { error: None });
            // Taken, not drained: a big listing's buffer is not kept for the next one.
            let listed = std::mem::take(&mut listing.refs)
                .into_iter()
                .filter_map(|(key, unchanged)| store.get_key(&key).map(|o| (o, unchanged)));
            listing
                .relist
                .announce(listed, before, store, |change| shared.notify(change));
            listing.relist.first = false;
        }
    }
}

/// A relist's announcements, in both modes. An object the listing has at the version the
/// store held is no news (`listed`); one it has otherwise is a change; one the store held and
/// the listing lacks was deleted during the gap (client-go's `DeletedFinalStateUnknown`), so
/// owners and mappers hear of it. Every object of the first listing is `initial`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Relist {
    pub(crate) first: bool,
}

impl Relist {
    /// Whether `listed`, held as `held` before the relist, is no news.
    pub(crate) fn unchanged<K: Resource>(self, held: Option<&K>, listed: &K) -> bool {
        self.first || held.is_some_and(|held| same_version(held, listed))
    }

    /// Announces a finished listing through `send`: each of `listed` (objects in the store
    /// now, each with whether it is no news), then each of `before` (what the store held
    /// before the listing) that the store no longer holds, as deleted.
    pub(crate) fn announce<K: Watchable>(
        self,
        listed: impl IntoIterator<Item = (Arc<K>, bool)>,
        before: impl IntoIterator<Item = Arc<K>>,
        store: &Store<K>,
        mut send: impl FnMut(Change<K>),
    ) {
        for (object, unchanged) in listed {
            send(Change {
                object,
                deleted: false,
                initial: self.first,
                listed: unchanged,
            });
        }
        for object in before {
            if store.get_key(&ObjectKey::of(&*object)).is_none() {
                send(Change {
                    object,
                    deleted: true,
                    initial: false,
                    listed: false,
                });
            }
        }
    }
}

/// Whether `a` and `b` are the same object at the same resourceVersion (uid included: one
/// deleted and created again under the name is another).
pub(crate) fn same_version<K: Resource>(a: &K, b: &K) -> bool {
    a.meta().resource_version == b.meta().resource_version && a.meta().uid == b.meta().uid
}

/// Says once that a cache of `kind` in `cluster` has not listed within `timeout`, with the
/// watch's last error.
pub(crate) fn warn_overdue(
    cluster: &str,
    kind: &str,
    timeout: std::time::Duration,
    error: Option<&str>,
) {
    let error = error.unwrap_or("none yet (the listing is slow)");
    tracing::warn!(%cluster, %kind, ?timeout, %error, "the cache has not listed within the cache sync timeout; requests for its objects wait, the watch keeps trying");
}

fn index<K: Watchable>(shared: &SharedWatch<K>, update: impl FnOnce(&mut FieldIndexes<K>)) {
    let mut indexes = lock(&shared.indexes);
    if !indexes.is_empty() {
        update(&mut indexes);
    }
}

/// When a watch's last event came and how many times it failed, for the diagnostics view
/// (`Cluster::cache_status`): two atomics, written on each event.
#[derive(Default)]
pub(crate) struct Activity {
    /// Milliseconds since the Unix epoch; 0 before the first event.
    last_event: std::sync::atomic::AtomicU64,
    failures: std::sync::atomic::AtomicU64,
}

impl Activity {
    /// An event came: a listed object, the listing's end, a change (not the start of a
    /// listing attempt, which a watch failing and retrying makes too).
    pub(crate) fn event(&self) {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        self.last_event
            .store(now, std::sync::atomic::Ordering::Relaxed);
    }

    /// An attempt to list or watch failed.
    pub(crate) fn failed(&self) {
        self.failures
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// When the last event came, if one has.
    pub(crate) fn last_event(&self) -> Option<std::time::SystemTime> {
        match self.last_event.load(std::sync::atomic::Ordering::Relaxed) {
            0 => None,
            ms => Some(std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms)),
        }
    }

    /// How many attempts failed since the watch started.
    pub(crate) fn failures(&self) -> u64 {
        self.failures.load(std::sync::atomic::Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::api::ObjectMeta;

    fn cm(name: &str, uid: &str) -> ConfigMap {
        ConfigMap {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("ns".into()),
                uid: Some(uid.into()),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    /// A watch fed `events`, then silence (or the end of the stream, if `end`).
    fn watch(
        events: Vec<Event<ConfigMap>>,
        end: bool,
        indexers: &[Indexer],
        faults: Option<mpsc::UnboundedSender<Fault>>,
    ) -> Arc<SharedWatch<ConfigMap>> {
        let events = futures::stream::iter(
            events
                .into_iter()
                .map(|e| Ok(crate::cache::map_event::map_event(e, Arc::new))),
        );
        let events = if end {
            events.boxed()
        } else {
            events.chain(futures::stream::pending()).boxed()
        };
        let (watch, _task) = SharedWatch::start(
            events,
            &(),
            Arc::from("c0"),
            CancellationToken::new(),
            indexers,
            faults,
            None,
            &tokio::runtime::Handle::current(),
        );
        watch
    }

    fn describe(change: &Change<ConfigMap>) -> String {
        let name = change.object.metadata.name.clone().unwrap_or_default();
        let uid = change.object.metadata.uid.clone().unwrap_or_default();
        match (change.deleted, change.initial) {
            (true, _) => format!("-{name}/{uid}"),
            (false, true) => format!("={name}/{uid}"),
            (false, false) => format!("+{name}/{uid}"),
        }
    }

    async fn drain(
        stream: &mut (impl Stream<Item = Change<ConfigMap>> + Unpin),
        n: usize,
    ) -> Vec<String> {
        let mut seen = Vec::new();
        while seen.len() < n {
            let next = tokio::time::timeout(std::time::Duration::from_secs(10), stream.next());
            seen.push(describe(
                &next.await.expect("a change in time").expect("a change"),
            ));
        }
        seen
    }

    /// An adopted watch (a single-cluster controller's, reflected by kube-runtime): what its
    /// subscribers and caches see of the events the reflector applies.
    #[tokio::test]
    async fn an_adopted_watch_announces_what_its_reflector_applied() {
        let at = |name: &str, uid: &str, version: &str| {
            let mut object = cm(name, uid);
            object.metadata.resource_version = Some(version.into());
            object
        };
        let mut writer = kube_runtime::reflector::store::Writer::<ConfigMap>::new(());
        let feed = SharedWatch::adopt(
            writer.as_reader(),
            &(),
            Arc::from("single"),
            CancellationToken::new(),
            &[],
            None,
        );
        let shared = feed.watch().clone();
        let mut feed = Some(feed);
        // The reflector applies an event, then the feed hands it on.
        let mut step = |event: Option<Result<Event<ConfigMap>, watcher::Error>>| match event {
            Some(event) => {
                if let Ok(event) = &event {
                    writer.apply_watcher_event(event);
                }
                if let Some(feed) = &mut feed {
                    feed.observe(&event);
                }
            }
            // The controller ended.
            None => drop(feed.take()),
        };
        step(Some(Ok(Event::Init)));
        step(Some(Ok(Event::InitApply(at("same", "1", "10")))));
        // Subscribed during the first listing: the store was empty, the listing comes at
        // its end.
        let mut changes = Box::pin(shared.subscribe());
        step(Some(Ok(Event::InitApply(at("edited", "2", "11")))));
        step(Some(Ok(Event::InitApply(at("gone", "3", "12")))));
        assert!(!shared.is_synced(), "synced only at the listing's end");
        step(Some(Ok(Event::InitDone)));
        assert!(shared.is_synced());
        let mut first = drain(&mut changes, 3).await;
        first.sort();
        assert_eq!(first, ["=edited/2", "=gone/3", "=same/1"]);
        // The crate's store reads the reflector's.
        assert_eq!(shared.store.len(), 3);
        assert!(shared.store.get_named(Some("ns"), "same").is_some());
        step(Some(Ok(Event::Apply(at("live", "4", "13")))));
        assert_eq!(drain(&mut changes, 1).await, ["+live/4"]);
        // A relist: `same` and `live` unchanged, `edited` changed, `gone` deleted in the gap.
        step(Some(Ok(Event::Init)));
        step(Some(Ok(Event::InitApply(at("same", "1", "10")))));
        // Subscribed during the relist: it hears of it as the first subscriber does.
        let mut late = Box::pin(shared.subscribe());
        let mut replay = drain(&mut late, 4).await;
        replay.sort();
        assert_eq!(replay, ["=edited/2", "=gone/3", "=live/4", "=same/1"]);
        step(Some(Ok(Event::InitApply(at("edited", "2", "14")))));
        step(Some(Ok(Event::InitApply(at("live", "4", "13")))));
        step(Some(Ok(Event::InitDone)));
        let mut relist = Vec::new();
        for _ in 0..4 {
            let next = tokio::time::timeout(std::time::Duration::from_secs(10), changes.next());
            let change = next.await.expect("a change in time").expect("a change");
            relist.push(format!("{} listed={}", describe(&change), change.listed));
        }
        relist.sort();
        let expected = [
            "+edited/2 listed=false",
            "+live/4 listed=true",
            "+same/1 listed=true",
            "-gone/3 listed=false",
        ];
        assert_eq!(relist, expected);
        let mut heard_late = Vec::new();
        for _ in 0..4 {
            let next = tokio::time::timeout(std::time::Duration::from_secs(10), late.next());
            let change = next.await.expect("a change in time").expect("a change");
            heard_late.push(format!("{} listed={}", describe(&change), change.listed));
        }
        heard_late.sort();
        assert_eq!(heard_late, expected);
        // A failure shows in the state; the next change clears it.
        step(Some(Err(watcher::Error::NoResourceVersion)));
        assert!(matches!(
            shared.state(),
            WatchState::Synced { error: Some(_) }
        ));
        step(Some(Ok(Event::Delete(at("live", "4", "15")))));
        assert_eq!(drain(&mut changes, 1).await, ["-live/4"]);
        assert_eq!(shared.state(), WatchState::Synced { error: None });
        // The controller ended: the watch stops, and its subscription ends.
        step(None);
        assert!(matches!(
            shared.state(),
            WatchState::Stopped { failure: None }
        ));
        assert!(changes.next().await.is_none());
    }

    #[tokio::test]
    async fn a_relist_announces_what_vanished_during_the_gap_as_deleted() {
        let shared = watch(
            vec![
                Event::Init,
                Event::InitApply(cm("kept", "1")),
                Event::InitApply(cm("gone", "2")),
                Event::InitApply(cm("recreated", "3")),
                Event::InitDone,
                // The watch broke; the relist no longer has `gone`, and `recreated` has a new uid.
                Event::Init,
                Event::InitApply(cm("kept", "1")),
                Event::InitApply(cm("recreated", "4")),
                Event::InitDone,
            ],
            false,
            &[],
            None,
        );
        let mut changes = Box::pin(shared.subscribe());
        let first = drain(&mut changes, 3).await;
        assert_eq!(first, ["=kept/1", "=gone/2", "=recreated/3"]);
        let relist = drain(&mut changes, 3).await;
        assert_eq!(relist, ["+kept/1", "+recreated/4", "-gone/2"]);
        assert!(shared.is_synced());
    }

    #[tokio::test]
    async fn a_relist_marks_as_no_news_only_what_it_found_at_the_version_held() {
        let at = |name: &str, uid: &str, version: &str| {
            let mut object = cm(name, uid);
            object.metadata.resource_version = Some(version.into());
            object
        };
        let shared = watch(
            vec![
                Event::Init,
                Event::InitApply(at("same", "1", "10")),
                Event::InitApply(at("edited", "2", "11")),
                Event::InitApply(at("recreated", "3", "12")),
                Event::InitDone,
                Event::Apply(at("live", "4", "13")),
                Event::Init,
                Event::InitApply(at("same", "1", "10")),
                Event::InitApply(at("edited", "2", "20")),
                Event::InitApply(at("recreated", "5", "12")),
                Event::InitApply(at("new", "6", "21")),
                Event::InitApply(at("live", "4", "13")),
                Event::InitDone,
            ],
            false,
            &[],
            None,
        );
        let mut changes = Box::pin(shared.subscribe());
        let mut seen = Vec::new();
        while seen.len() < 9 {
            let change = changes.next().await.expect("a change");
            let name = change.object.metadata.name.clone().unwrap_or_default();
            seen.push((name, change.initial, change.listed));
        }
        let seen: Vec<_> = seen.iter().map(|(n, i, l)| (n.as_str(), *i, *l)).collect();
        assert_eq!(
            seen,
            [
                ("same", true, true),
                ("edited", true, true),
                ("recreated", true, true),
                ("live", false, false),
                ("same", false, true),
                ("edited", false, false),
                ("recreated", false, false),
                ("new", false, false),
                ("live", false, true),
            ]
        );
    }

    #[tokio::test]
    async fn a_subscription_to_a_stopped_watch_ends_after_the_replay() {
        let shared = watch(
            vec![Event::Init, Event::InitApply(cm("a", "1")), Event::InitDone],
            true,
            &[],
            None,
        );
        // Once the stream has ended, the watch is stopped.
        let mut state = shared.state.subscribe();
        state
            .wait_for(|s| matches!(s, WatchState::Stopped { .. }))
            .await
            .unwrap();
        let late: Vec<_> = shared.subscribe().map(|c| describe(&c)).collect().await;
        assert_eq!(
            late,
            ["=a/1"],
            "the store is replayed, then the stream ends"
        );
        assert!(matches!(
            shared.synced().await,
            Err(CacheError::NotEngaged { .. })
        ));
    }

    #[tokio::test]
    async fn a_panicking_index_extractor_fails_the_watch_and_reports_it() {
        let indexer = Indexer::new::<ConfigMap>("bad", |cm: &ConfigMap| {
            assert_ne!(cm.metadata.name.as_deref(), Some("boom"), "extractor bug");
            vec![]
        });
        let (faults, mut reported) = mpsc::unbounded_channel();
        let shared = watch(
            vec![
                Event::Init,
                Event::InitApply(cm("fine", "1")),
                Event::InitDone,
                Event::Apply(cm("boom", "2")),
            ],
            false,
            &[indexer],
            Some(faults),
        );
        let mut changes = Box::pin(shared.subscribe());
        let fault = reported.recv().await.unwrap();
        assert_eq!(
            (fault.cluster.as_str(), fault.kind.as_str()),
            ("c0", "ConfigMap")
        );
        assert!(fault.reason.contains("extractor bug"), "{fault}");
        // Subscribers see their stream end rather than wait on a frozen cache.
        assert_eq!(drain(&mut changes, 1).await, ["=fine/1"]);
        assert!(changes.next().await.is_none());
        assert!(matches!(
            shared.synced().await,
            Err(CacheError::WatchFailed { .. })
        ));
    }
}
