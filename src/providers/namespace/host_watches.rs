//! The host's shared watches: one watch per kind across the host, its events handed to each
//! namespace-cluster for its namespace.

use std::collections::{BTreeMap, VecDeque};

use crate::util::hashing::HashMap;
use std::pin::{Pin, pin};
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context as TaskContext, Poll};

use futures::stream::BoxStream;
use futures::{Stream, StreamExt};
use kube::Client;
use kube_runtime::watcher::{self, Event};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::scope::Discovery;
use crate::cache::{SharedObject, WatchKey, WatchRequest, WatchSource};
use crate::util::sync::lock;

/// The host's shared watches and discovery cache, shared by one provider's
/// namespace-clusters (and its clones). A host watch stops when its last subscriber goes,
/// and all of them when the last holder drops the hub.
pub(crate) struct HostWatches {
    host: Client,
    pub(super) watches: Mutex<HashMap<WatchKey, Arc<HostWatch>>>,
    pub(super) discovery: Arc<Discovery>,
    token: CancellationToken,
}

impl Drop for HostWatches {
    fn drop(&mut self) {
        self.token.cancel();
    }
}

impl HostWatches {
    pub(super) fn new(host: Client) -> Self {
        Self {
            discovery: Arc::new(Discovery::new(host.clone())),
            host,
            watches: Mutex::new(HashMap::default()),
            token: CancellationToken::new(),
        }
    }

    /// The events of `namespace`'s objects of the requested kind, from the host's watch of
    /// that kind (started on first use), for as long as the request's engagement lasts: a
    /// listing (`Init`, `InitApply`*, `InitDone`) as soon as the host's objects are known and
    /// after every relist of the host, changes in between.
    fn events(&self, namespace: &str, request: WatchRequest<'_>) -> Receiver {
        let mut watches = lock(&self.watches);
        if let Some(events) = watches
            .get(&request.key)
            .and_then(|w| w.subscribe(namespace, request.engagement))
        {
            return events;
        }
        // None yet, or the last one stopped for want of subscribers.
        let (watch, subscriptions) = HostWatch::new(self.token.child_token());
        let watch = Arc::new(watch);
        // Subscribed before the task starts, so it never finds itself without subscribers.
        let events = watch
            .subscribe(namespace, request.engagement)
            .unwrap_or_else(Receiver::closed);
        tokio::spawn(run_host_watch(
            // Retried with backoff inside, namespace by namespace.
            (request.open)(self.host.clone()),
            subscriptions,
            Arc::downgrade(&watch),
            watch.stop.clone(),
            request.kind.to_string(),
        ));
        watches.insert(request.key, watch);
        events
    }
}

/// What a namespace-cluster keeps to reach its share of the host's watches: the source of its
/// cluster's watches.
#[derive(Clone)]
pub(crate) struct NamespaceSlice {
    pub(super) host_watches: Arc<HostWatches>,
    pub(super) namespace: Arc<str>,
}

impl WatchSource for NamespaceSlice {
    fn events(&self, request: WatchRequest<'_>) -> BoxStream<'static, Event<SharedObject>> {
        self.host_watches.events(&self.namespace, request).boxed()
    }
}

/// One namespace's objects of one kind (or the cluster-scoped ones), by name.
type Objects = BTreeMap<String, SharedObject>;

/// What a host watch sends one namespace-cluster.
enum Delivery {
    /// A complete listing: the namespace's objects and the cluster-scoped ones, as the host
    /// held them (the host's maps themselves, shared: sending one costs the same for a
    /// namespace of one object as of ten thousand).
    Listing {
        own: Option<Arc<Objects>>,
        cluster_scoped: Option<Arc<Objects>>,
    },
    /// A change: `Apply` or `Delete`.
    Change(Event<SharedObject>),
}

/// A subscription to a host watch: the events of one namespace.
pub(crate) struct Receiver {
    rx: mpsc::UnboundedReceiver<Delivery>,
    /// The rest of a listing being handed out.
    pending: VecDeque<Event<SharedObject>>,
}

impl Receiver {
    fn new(rx: mpsc::UnboundedReceiver<Delivery>) -> Self {
        Self {
            rx,
            pending: VecDeque::new(),
        }
    }

    /// A subscription that has already ended.
    fn closed() -> Self {
        Self::new(mpsc::unbounded_channel().1)
    }
}

impl Stream for Receiver {
    type Item = Event<SharedObject>;

    fn poll_next(
        self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
    ) -> Poll<Option<Event<SharedObject>>> {
        let this = self.get_mut();
        loop {
            if let Some(event) = this.pending.pop_front() {
                if this.pending.is_empty() && this.pending.capacity() > 64 {
                    // A listing handed out: its buffer is not kept for the next one.
                    this.pending = VecDeque::new();
                }
                return Poll::Ready(Some(event));
            }
            match std::task::ready!(this.rx.poll_recv(cx)) {
                None => return Poll::Ready(None),
                Some(Delivery::Change(event)) => return Poll::Ready(Some(event)),
                Some(Delivery::Listing {
                    own,
                    cluster_scoped,
                }) => {
                    // Unpacked here, in the namespace-cluster's own task: the host task
                    // only passed two pointers.
                    this.pending.push_back(Event::Init);
                    let objects = own.iter().chain(cluster_scoped.iter());
                    this.pending.extend(
                        objects
                            .flat_map(|m| m.values())
                            .map(|o| Event::InitApply(o.clone())),
                    );
                    this.pending.push_back(Event::InitDone);
                }
            }
        }
    }
}

/// One watch of one kind across the host, demultiplexed by namespace.
pub(super) struct HostWatch {
    state: Mutex<HostState>,
    /// Stops the watch task.
    stop: CancellationToken,
    /// Tells the watch task of each new subscription, so it notices when the subscriber's
    /// cluster is disengaged.
    joined: mpsc::UnboundedSender<(String, CancellationToken)>,
}

impl HostWatch {
    /// A watch (not yet running) and what its task is to receive subscriptions from.
    fn new(
        stop: CancellationToken,
    ) -> (Self, mpsc::UnboundedReceiver<(String, CancellationToken)>) {
        let (joined, subscriptions) = mpsc::unbounded_channel();
        let watch = Self {
            state: Mutex::new(HostState::default()),
            stop,
            joined,
        };
        (watch, subscriptions)
    }
}

/// One namespace-cluster's subscription.
#[derive(Clone)]
struct Subscriber {
    tx: mpsc::UnboundedSender<Delivery>,
    /// The cluster's engagement: cancelled when it is disengaged.
    engagement: CancellationToken,
}

impl Subscriber {
    fn alive(&self) -> bool {
        !self.engagement.is_cancelled() && !self.tx.is_closed()
    }
}

/// Subscribers by namespace.
type Subscribers = HashMap<String, Vec<Subscriber>>;

/// The host watch's state. The maps are shared copy-on-write: the watch task takes a
/// snapshot (two pointer copies) under the lock and sends to the subscribers after letting
/// go of it, so a relist's fan-out to a thousand namespaces never holds the lock (a cluster
/// subscribing meanwhile waits for nothing, and gets the new listing itself).
#[derive(Default)]
struct HostState {
    /// Whether a complete listing is known.
    ready: bool,
    /// The watch has stopped (no subscriber was left); it takes no new ones.
    stopped: bool,
    /// The current objects by namespace ("" for cluster-scoped ones) and name.
    objects: Arc<HashMap<String, Arc<Objects>>>,
    /// A listing in progress; swapped in at its end.
    listing: Option<HashMap<String, Objects>>,
    subscribers: Arc<Subscribers>,
}

impl HostState {
    /// `namespace`'s listing (with the cluster-scoped objects) from `objects`.
    fn listing_of(objects: &HashMap<String, Arc<Objects>>, namespace: &str) -> Delivery {
        Delivery::Listing {
            own: objects.get(namespace).cloned(),
            cluster_scoped: objects.get("").cloned(),
        }
    }

    /// Drops the subscriptions whose clusters were disengaged or whose receivers went away.
    fn prune(&mut self, namespace: Option<&str>) {
        let subscribers = Arc::make_mut(&mut self.subscribers);
        let prune = |subs: &mut Vec<Subscriber>| subs.retain(Subscriber::alive);
        match namespace {
            Some(ns) => subscribers.get_mut(ns).into_iter().for_each(prune),
            None => subscribers.values_mut().for_each(prune),
        }
        subscribers.retain(|_, subs| !subs.is_empty());
    }
}

/// What the watch task sends once it has let go of the lock.
enum Fanout {
    /// A new listing, to every subscriber.
    Listing {
        objects: Arc<HashMap<String, Arc<Objects>>>,
        subscribers: Arc<Subscribers>,
    },
    /// A change in `namespace` ("" for a cluster-scoped object: to everyone).
    Change {
        namespace: String,
        event: Event<SharedObject>,
        subscribers: Arc<Subscribers>,
    },
}

impl Fanout {
    /// Sends; false if some subscriber has gone (to be pruned).
    fn send(self) -> bool {
        let mut all_alive = true;
        let mut send = |sub: &Subscriber, delivery: Delivery| {
            all_alive &= sub.alive() && sub.tx.send(delivery).is_ok();
        };
        match self {
            Fanout::Listing {
                objects,
                subscribers,
            } => {
                for (ns, subs) in subscribers.iter() {
                    for sub in subs {
                        send(sub, HostState::listing_of(&objects, ns));
                    }
                }
            }
            Fanout::Change {
                namespace,
                event,
                subscribers,
            } => {
                let mut to_all = |subs: &Vec<Subscriber>| {
                    for sub in subs {
                        send(sub, Delivery::Change(event.clone()));
                    }
                };
                if namespace.is_empty() {
                    subscribers.values().for_each(to_all);
                } else if let Some(subs) = subscribers.get(&namespace) {
                    to_all(subs);
                }
            }
        }
        all_alive
    }
}

impl HostWatch {
    /// Whether the watch still runs.
    pub(super) fn is_running(&self) -> bool {
        !self.stop.is_cancelled()
    }

    /// A subscription for `namespace`, or `None` if the watch has stopped.
    fn subscribe(&self, namespace: &str, engagement: &CancellationToken) -> Option<Receiver> {
        let (tx, rx) = mpsc::unbounded_channel();
        let mut state = lock(&self.state);
        if state.stopped {
            return None;
        }
        // Under the lock the host task cannot take a snapshot in between: the new subscriber
        // gets this listing, then every change after it, and no listing twice.
        if state.ready {
            let _ = tx.send(HostState::listing_of(&state.objects, namespace));
        }
        let subs = Arc::make_mut(&mut state.subscribers)
            .entry(namespace.to_string())
            .or_default();
        subs.retain(Subscriber::alive);
        subs.push(Subscriber {
            tx,
            engagement: engagement.clone(),
        });
        let _ = self
            .joined
            .send((namespace.to_string(), engagement.clone()));
        Some(Receiver::new(rx))
    }

    /// Drops the subscriptions of `namespace` whose clusters were disengaged; true if the
    /// watch has no subscriber left and stopped.
    fn forget(&self, namespace: &str) -> bool {
        let mut state = lock(&self.state);
        state.prune(Some(namespace));
        self.stop_if_idle(&mut state)
    }

    /// Stops the watch if nobody subscribes to it any more; true if it is stopped.
    fn stop_if_idle(&self, state: &mut HostState) -> bool {
        if state.subscribers.is_empty() {
            state.stopped = true;
            // What the watch cached is of no use to anybody now.
            state.objects = Arc::default();
            state.listing = None;
            self.stop.cancel();
        }
        state.stopped
    }

    /// Applies one event of the host's watch to the state; what is to be sent, if anything.
    fn apply(&self, event: Event<SharedObject>) -> Option<Fanout> {
        let mut state = lock(&self.state);
        match event {
            Event::Init => {
                state.listing = Some(HashMap::default());
                None
            }
            Event::InitApply(object) => {
                let ns = object.meta().namespace.clone().unwrap_or_default();
                state
                    .listing
                    .get_or_insert_default()
                    .entry(ns)
                    .or_default()
                    .insert(name_of(&object), object);
                None
            }
            Event::InitDone => {
                let listing = state.listing.take().unwrap_or_default();
                state.objects = Arc::new(
                    listing
                        .into_iter()
                        .map(|(ns, objects)| (ns, Arc::new(objects)))
                        .collect(),
                );
                state.ready = true;
                Some(Fanout::Listing {
                    objects: state.objects.clone(),
                    subscribers: state.subscribers.clone(),
                })
            }
            Event::Apply(object) => {
                let ns = object.meta().namespace.clone().unwrap_or_default();
                // Copies a namespace's map only while a listing that shares it is still
                // being handed out; the outer map is never shared at this point.
                let objects = Arc::make_mut(&mut state.objects);
                Arc::make_mut(objects.entry(ns.clone()).or_default())
                    .insert(name_of(&object), object.clone());
                Some(Fanout::Change {
                    namespace: ns,
                    event: Event::Apply(object),
                    subscribers: state.subscribers.clone(),
                })
            }
            Event::Delete(object) => {
                let ns = object.meta().namespace.clone().unwrap_or_default();
                let objects = Arc::make_mut(&mut state.objects);
                if let Some(in_ns) = objects.get_mut(&ns) {
                    let in_ns = Arc::make_mut(in_ns);
                    in_ns.remove(&name_of(&object));
                    if in_ns.is_empty() {
                        objects.remove(&ns);
                    }
                }
                Some(Fanout::Change {
                    namespace: ns,
                    event: Event::Delete(object),
                    subscribers: state.subscribers.clone(),
                })
            }
        }
    }
}

/// Drives one host watch until it stops (no subscriber left) or the hub goes away.
async fn run_host_watch(
    events: impl Stream<Item = Result<Event<SharedObject>, watcher::Error>> + Send,
    mut subscriptions: mpsc::UnboundedReceiver<(String, CancellationToken)>,
    watch: Weak<HostWatch>,
    stop: CancellationToken,
    kind: String,
) {
    let mut events = pin!(events);
    // The namespaces of subscribers, each as soon as the subscriber's cluster is disengaged.
    let mut departures = futures::stream::FuturesUnordered::new();
    loop {
        let event = tokio::select! {
            () = stop.cancelled() => break,
            Some((namespace, engagement)) = subscriptions.recv() => {
                departures.push(async move {
                    engagement.cancelled_owned().await;
                    namespace
                });
                continue;
            }
            Some(namespace) = departures.next(), if !departures.is_empty() => {
                let Some(watch) = watch.upgrade() else {
                    break;
                };
                if watch.forget(&namespace) {
                    break;
                }
                continue;
            }
            event = events.next() => event,
        };
        let Some(watch) = watch.upgrade() else {
            break;
        };
        let event = match event {
            None => break,
            Some(Err(error)) => {
                tracing::warn!(cluster = "host", %kind, error = %crate::client::Shown(&error), "namespace provider: the host watch failed; retrying");
                continue;
            }
            Some(Ok(event)) => event,
        };
        // The lock is held to update the state and snapshot it, not while sending.
        let Some(fanout) = watch.apply(event) else {
            continue;
        };
        if !fanout.send() {
            let mut state = lock(&watch.state);
            state.prune(None);
            if watch.stop_if_idle(&mut state) {
                break;
            }
        }
    }
    tracing::debug!(cluster = "host", %kind, "namespace provider: host watch stopped");
}

/// An object's name.
fn name_of(object: &SharedObject) -> String {
    object.meta().name.clone().unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    use k8s_openapi::api::core::v1::{ConfigMap, Node};

    fn cm(ns: &str, name: &str) -> ConfigMap {
        let mut cm = ConfigMap::default();
        cm.metadata.name = Some(name.into());
        cm.metadata.namespace = Some(ns.into());
        cm
    }

    fn obj<K: crate::cache::Watchable>(object: K) -> SharedObject {
        Arc::new(object)
    }

    fn describe(event: &Event<SharedObject>) -> String {
        match event {
            Event::Init => "init".into(),
            Event::InitApply(o) => format!("list {}", o.meta().name.as_deref().unwrap_or("")),
            Event::InitDone => "done".into(),
            Event::Apply(o) => format!("apply {}", o.meta().name.as_deref().unwrap_or("")),
            Event::Delete(o) => format!("delete {}", o.meta().name.as_deref().unwrap_or("")),
        }
    }

    /// Everything a subscription has received so far.
    fn drain(stream: &mut (impl Stream<Item = Event<SharedObject>> + Unpin)) -> Vec<String> {
        let mut out = Vec::new();
        while let Some(Some(event)) = stream.next().now_or_never() {
            out.push(describe(&event));
        }
        out
    }

    use futures::FutureExt;

    /// A host watch driven by hand: `(feed, watch, task)`.
    fn host_watch() -> (
        mpsc::UnboundedSender<Event<SharedObject>>,
        Arc<HostWatch>,
        tokio::task::JoinHandle<()>,
    ) {
        let (tx, mut rx) = mpsc::unbounded_channel::<Event<SharedObject>>();
        let (watch, subscriptions) = HostWatch::new(CancellationToken::new());
        let watch = Arc::new(watch);
        let events = futures::stream::poll_fn(move |cx| rx.poll_recv(cx)).map(Ok);
        let task = tokio::spawn(run_host_watch(
            events,
            subscriptions,
            Arc::downgrade(&watch),
            watch.stop.clone(),
            "ConfigMap".to_string(),
        ));
        (tx, watch, task)
    }

    async fn settle() {
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test]
    async fn the_host_watch_hands_each_namespace_its_own_events() {
        let (feed, watch, task) = host_watch();
        let engaged = |_: &str| CancellationToken::new();
        let (zoo_engaged, jungle_engaged, island_engaged) =
            (engaged("zoo"), engaged("jungle"), engaged("island"));
        // Subscribed before the first listing: gets it when it completes.
        let mut zoo = watch.subscribe("zoo", &zoo_engaged).unwrap();
        feed.send(Event::Init).unwrap();
        feed.send(Event::InitApply(obj(cm("zoo", "elephant"))))
            .unwrap();
        feed.send(Event::InitApply(obj(cm("jungle", "parrot"))))
            .unwrap();
        settle().await;
        assert_eq!(
            drain(&mut zoo),
            Vec::<String>::new(),
            "nothing before the listing ends"
        );
        feed.send(Event::InitDone).unwrap();
        settle().await;
        assert_eq!(drain(&mut zoo), ["init", "list elephant", "done"]);

        // Subscribed later: the current objects are replayed as a listing.
        let mut jungle = watch.subscribe("jungle", &jungle_engaged).unwrap();
        assert_eq!(drain(&mut jungle), ["init", "list parrot", "done"]);
        let mut island = watch.subscribe("island", &island_engaged).unwrap();
        assert_eq!(drain(&mut island), ["init", "done"]);

        // Changes go to their namespace only.
        feed.send(Event::Apply(obj(cm("zoo", "lion")))).unwrap();
        feed.send(Event::Delete(obj(cm("jungle", "parrot"))))
            .unwrap();
        settle().await;
        assert_eq!(drain(&mut zoo), ["apply lion"]);
        assert_eq!(drain(&mut jungle), ["delete parrot"]);
        assert_eq!(drain(&mut island), Vec::<String>::new());

        // A relist of the host is a relist of every namespace; what vanished meanwhile is
        // absent from it.
        feed.send(Event::Init).unwrap();
        feed.send(Event::InitApply(obj(cm("zoo", "lion")))).unwrap();
        feed.send(Event::InitApply(obj(cm("island", "crab"))))
            .unwrap();
        feed.send(Event::InitDone).unwrap();
        settle().await;
        assert_eq!(drain(&mut zoo), ["init", "list lion", "done"]);
        assert_eq!(drain(&mut jungle), ["init", "done"]);
        assert_eq!(drain(&mut island), ["init", "list crab", "done"]);

        // Forgetting a namespace lets go only of disengaged clusters' subscriptions (a
        // clone of the provider may share the hub and still serve the namespace).
        assert!(!watch.forget("island"));
        feed.send(Event::Apply(obj(cm("island", "gull")))).unwrap();
        settle().await;
        assert_eq!(drain(&mut island), ["apply gull"]);
        island_engaged.cancel();
        assert!(!watch.forget("island"));
        assert!(!lock(&watch.state).subscribers.contains_key("island"));
        // A dropped subscription is let go at the next delivery.
        drop(jungle);
        feed.send(Event::Apply(obj(cm("island", "tern")))).unwrap();
        feed.send(Event::Apply(obj(cm("jungle", "tiger")))).unwrap();
        settle().await;
        assert!(!lock(&watch.state).subscribers.contains_key("jungle"));
        assert_eq!(drain(&mut island), Vec::<String>::new());
        assert_eq!(drain(&mut zoo), Vec::<String>::new());

        // The last subscriber gone, the watch stops, forgets its objects and takes no
        // new subscribers (the hub starts a new watch instead).
        zoo_engaged.cancel();
        assert!(watch.forget("zoo"));
        assert!(!watch.is_running());
        assert!(lock(&watch.state).objects.is_empty());
        assert!(watch.subscribe("zoo", &engaged("zoo")).is_none());
        task.await.unwrap();
        assert_eq!(zoo.next().await.map(|e| describe(&e)), None);
    }

    #[tokio::test]
    async fn the_host_watch_task_ends_with_its_hub() {
        let (feed, watch, task) = host_watch();
        let _sub = watch.subscribe("zoo", &CancellationToken::new()).unwrap();
        drop(watch);
        feed.send(Event::Apply(obj(cm("zoo", "tapir")))).unwrap();
        task.await.unwrap();
    }

    #[tokio::test]
    async fn cluster_scoped_objects_reach_every_namespace() {
        let (feed, watch, _task) = host_watch();
        let token = CancellationToken::new();
        let mut zoo = watch.subscribe("zoo", &token).unwrap();
        let mut jungle = watch.subscribe("jungle", &token).unwrap();
        let mut node = Node::default();
        node.metadata.name = Some("n1".into());
        feed.send(Event::Init).unwrap();
        feed.send(Event::InitApply(obj(node.clone()))).unwrap();
        feed.send(Event::InitDone).unwrap();
        node.metadata.name = Some("n2".into());
        feed.send(Event::Apply(obj(node))).unwrap();
        settle().await;
        for events in [drain(&mut zoo), drain(&mut jungle)] {
            assert_eq!(events, ["init", "list n1", "done", "apply n2"]);
        }
        let mut island = watch.subscribe("island", &token).unwrap();
        assert_eq!(drain(&mut island), ["init", "list n1", "list n2", "done"]);
    }

    fn versioned(ns: &str, version: u64) -> SharedObject {
        let mut cm = cm(ns, "only");
        cm.metadata.resource_version = Some(version.to_string());
        obj(cm)
    }

    /// Checks one subscription's events: a listing first, then never an older version of its
    /// namespace's object after a newer one; returns once it has seen `last`.
    async fn in_order(mut events: Receiver, last: u64) -> Result<(), String> {
        let mut newest = 0u64;
        let mut first = true;
        while let Some(event) = events.next().await {
            if first && !matches!(event, Event::Init) {
                return Err(format!("began with {}", describe(&event)));
            }
            first = false;
            let (Event::InitApply(o) | Event::Apply(o)) = event else {
                continue;
            };
            let version: u64 = o
                .meta()
                .resource_version
                .as_deref()
                .unwrap()
                .parse()
                .unwrap();
            if version < newest {
                return Err(format!("version {version} after {newest}"));
            }
            newest = version;
            if version == last {
                return Ok(());
            }
        }
        Err(format!("ended at version {newest}"))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn subscribers_joining_during_relists_and_changes_see_each_in_order() {
        let (feed, watch, _task) = host_watch();
        let token = CancellationToken::new();
        let namespaces: Vec<String> = (0..100).map(|i| format!("ns-{i}")).collect();
        let mut checks = Vec::new();
        for ns in &namespaces[..50] {
            let events = watch.subscribe(ns, &token).unwrap();
            checks.push(tokio::spawn(in_order(events, 1_000)));
        }
        // Subscribers join from another thread while the host relists and changes objects.
        let joining = {
            let (watch, token, namespaces) = (watch.clone(), token.clone(), namespaces.clone());
            tokio::spawn(async move {
                let mut checks = Vec::new();
                for round in 0..1_000 {
                    let ns = &namespaces[round % namespaces.len()];
                    let events = watch.subscribe(ns, &token).unwrap();
                    checks.push(tokio::spawn(in_order(events, 1_000)));
                    tokio::task::yield_now().await;
                }
                checks
            })
        };
        for round in 1..=50u64 {
            feed.send(Event::Init).unwrap();
            for ns in &namespaces {
                feed.send(Event::InitApply(versioned(ns, round * 10)))
                    .unwrap();
            }
            feed.send(Event::InitDone).unwrap();
            for ns in &namespaces {
                feed.send(Event::Apply(versioned(ns, round * 10 + 5)))
                    .unwrap();
                tokio::task::yield_now().await;
            }
        }
        checks.extend(joining.await.unwrap());
        // The sync point: a last change to every namespace, which every subscriber waits for.
        for ns in &namespaces {
            feed.send(Event::Apply(versioned(ns, 1_000))).unwrap();
        }
        for check in checks {
            check.await.unwrap().unwrap();
        }
    }
}
