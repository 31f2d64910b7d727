//! The host's shared watches: one watch per kind across the host, its events handed to each
//! namespace-cluster for its namespace.

use std::collections::{BTreeMap, HashMap};
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
use crate::WatchBackoff;
use crate::cluster::{Retrying, SharedObject, WatchKey, WatchRequest, WatchSource};
use crate::sync::lock;

/// The host's shared watches and discovery cache, shared by one provider's
/// namespace-clusters (and its clones). A host watch stops when its last subscriber goes,
/// and all of them when the last holder drops the hub.
pub(crate) struct Hub {
    host: Client,
    pub(super) watches: Mutex<HashMap<WatchKey, Arc<HostWatch>>>,
    pub(super) discovery: Arc<Discovery>,
    token: CancellationToken,
}

impl Drop for Hub {
    fn drop(&mut self) {
        self.token.cancel();
    }
}

impl Hub {
    pub(super) fn new(host: Client) -> Self {
        Self {
            discovery: Arc::new(Discovery::new(host.clone())),
            host,
            watches: Mutex::new(HashMap::new()),
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
            Retrying::new(
                (request.open)(self.host.clone()),
                WatchBackoff::default().delays(),
            ),
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
    pub(super) hub: Arc<Hub>,
    pub(super) namespace: Arc<str>,
}

impl WatchSource for NamespaceSlice {
    fn events(&self, request: WatchRequest<'_>) -> BoxStream<'static, Event<SharedObject>> {
        self.hub.events(&self.namespace, request).boxed()
    }
}

/// A subscription to a host watch: the events of one namespace.
pub(crate) struct Receiver(mpsc::UnboundedReceiver<Event<SharedObject>>);

impl Receiver {
    /// A subscription that has already ended.
    fn closed() -> Self {
        Self(mpsc::unbounded_channel().1)
    }
}

impl Stream for Receiver {
    type Item = Event<SharedObject>;

    fn poll_next(
        mut self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
    ) -> Poll<Option<Event<SharedObject>>> {
        self.0.poll_recv(cx)
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
struct Subscriber {
    tx: mpsc::UnboundedSender<Event<SharedObject>>,
    /// The cluster's engagement: cancelled when it is disengaged.
    engagement: CancellationToken,
}

impl Subscriber {
    fn alive(&self) -> bool {
        !self.engagement.is_cancelled() && !self.tx.is_closed()
    }
}

#[derive(Default)]
struct HostState {
    /// Whether a complete listing is known.
    ready: bool,
    /// The watch has stopped (no subscriber was left); it takes no new ones.
    stopped: bool,
    /// The current objects by namespace ("" for cluster-scoped ones) and name.
    objects: HashMap<String, BTreeMap<String, SharedObject>>,
    /// A listing in progress; swapped in at its end.
    listing: Option<HashMap<String, BTreeMap<String, SharedObject>>>,
    /// Subscribers by namespace.
    subscribers: HashMap<String, Vec<Subscriber>>,
}

impl HostState {
    /// Sends `namespace`'s objects (and the cluster-scoped ones) as a complete listing.
    fn send_listing(
        &self,
        namespace: &str,
        tx: &mpsc::UnboundedSender<Event<SharedObject>>,
    ) -> bool {
        let mut ok = tx.send(Event::Init).is_ok();
        let own = self.objects.get(namespace).into_iter();
        let cluster_scoped = self.objects.get("").into_iter();
        for object in own.chain(cluster_scoped).flat_map(|m| m.values()) {
            ok &= tx.send(Event::InitApply(object.clone())).is_ok();
        }
        ok && tx.send(Event::InitDone).is_ok()
    }

    /// Delivers a change to the subscribers of `namespace` (all of them for cluster-scoped
    /// objects), dropping those that went away.
    fn deliver(&mut self, namespace: &str, event: &Event<SharedObject>) {
        let send = |subs: &mut Vec<Subscriber>| {
            subs.retain(|s| s.alive() && s.tx.send(event.clone()).is_ok());
        };
        if namespace.is_empty() {
            self.subscribers.values_mut().for_each(send);
            self.subscribers.retain(|_, subs| !subs.is_empty());
        } else if let Some(subs) = self.subscribers.get_mut(namespace) {
            send(subs);
            if subs.is_empty() {
                self.subscribers.remove(namespace);
            }
        }
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
        // Under the lock the host task cannot deliver in between: nothing is lost or
        // delivered before the listing.
        if state.ready {
            state.send_listing(namespace, &tx);
        }
        let subs = state.subscribers.entry(namespace.to_string()).or_default();
        subs.retain(Subscriber::alive);
        subs.push(Subscriber {
            tx,
            engagement: engagement.clone(),
        });
        let _ = self
            .joined
            .send((namespace.to_string(), engagement.clone()));
        Some(Receiver(rx))
    }

    /// Drops the subscriptions of `namespace` whose clusters were disengaged; true if the
    /// watch has no subscriber left and stopped.
    fn forget(&self, namespace: &str) -> bool {
        let mut state = lock(&self.state);
        if let Some(subs) = state.subscribers.get_mut(namespace) {
            subs.retain(Subscriber::alive);
            if subs.is_empty() {
                state.subscribers.remove(namespace);
            }
        }
        self.stop_if_idle(&mut state)
    }

    /// Stops the watch if nobody subscribes to it any more; true if it is stopped.
    fn stop_if_idle(&self, state: &mut HostState) -> bool {
        if state.subscribers.is_empty() {
            state.stopped = true;
            // What the watch cached is of no use to anybody now.
            state.objects.clear();
            state.listing = None;
            self.stop.cancel();
        }
        state.stopped
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
        let mut state = lock(&watch.state);
        match event {
            None => break,
            Some(Err(error)) => {
                tracing::warn!(cluster = "host", %kind, %error, "namespace provider: the host watch failed; retrying");
            }
            Some(Ok(Event::Init)) => state.listing = Some(HashMap::new()),
            Some(Ok(Event::InitApply(object))) => {
                let ns = object.meta().namespace.clone().unwrap_or_default();
                state
                    .listing
                    .get_or_insert_default()
                    .entry(ns)
                    .or_default()
                    .insert(name_of(&object), object);
            }
            Some(Ok(Event::InitDone)) => {
                state.objects = state.listing.take().unwrap_or_default();
                state.ready = true;
                let mut subscribers = std::mem::take(&mut state.subscribers);
                for (ns, subs) in &mut subscribers {
                    subs.retain(|s| s.alive() && state.send_listing(ns, &s.tx));
                }
                subscribers.retain(|_, subs| !subs.is_empty());
                state.subscribers = subscribers;
            }
            Some(Ok(Event::Apply(object))) => {
                let ns = object.meta().namespace.clone().unwrap_or_default();
                state
                    .objects
                    .entry(ns.clone())
                    .or_default()
                    .insert(name_of(&object), object.clone());
                state.deliver(&ns, &Event::Apply(object));
            }
            Some(Ok(Event::Delete(object))) => {
                let ns = object.meta().namespace.clone().unwrap_or_default();
                if let Some(objects) = state.objects.get_mut(&ns) {
                    objects.remove(&name_of(&object));
                    if objects.is_empty() {
                        state.objects.remove(&ns);
                    }
                }
                state.deliver(&ns, &Event::Delete(object));
            }
        }
        if watch.stop_if_idle(&mut state) {
            break;
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

    fn obj<K: crate::Watchable>(object: K) -> SharedObject {
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
}
