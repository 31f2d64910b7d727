//! [`Namespaces`]: every namespace of one host cluster is a cluster of the fleet.
//!
//! Two parts make a namespace behave like a cluster of its own:
//!
//! - **One watch per kind for the whole host.** A [`Hub`] keeps, per resource type and
//!   watcher configuration, a single watch across all namespaces of the host and hands each
//!   namespace-cluster the events of its namespace (replaying the current objects to a
//!   namespace that comes later, and a fresh listing after the host watch relists). A
//!   thousand namespaces cost one watch per kind, not a thousand.
//! - **A scoped client.** Each namespace-cluster's [`Client`] rewrites namespaced requests
//!   into its namespace whatever namespace the caller names (in the path and in the body),
//!   lists "across all namespaces" within it, passes cluster-scoped reads through and
//!   refuses cluster-scoped writes with [`ClusterScopedWrite`]. Whether a resource is
//!   namespaced comes from the host's discovery documents, cached per API group version.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::future::Future;
use std::pin::{Pin, pin};
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context as TaskContext, Poll};
use std::time::{Duration, Instant};

use futures::stream::BoxStream;
use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::APIResourceList;
use kube::client::Body;
use kube::{Api, Client, ResourceExt};
use kube_runtime::WatchStreamExt;
use kube_runtime::watcher::{self, Event};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::cluster::{Retrying, SharedObject, WatchKey, WatchRequest, WatchSource};
use crate::{Cluster, ClusterName, Fleet, Provider, ProviderError, WatchBackoff};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Every namespace of one host cluster is a cluster, named after the namespace.
///
/// A namespace-cluster's client is scoped to its namespace (see [`ClusterScopedWrite`] for
/// what is refused), and its watches are fed by one watch per resource type across the
/// host, shared by all namespaces. Creating a namespace engages its cluster; deleting it
/// disengages the cluster once the namespace is gone. A namespace that is terminating
/// stays engaged, so controllers can still remove their finalizers from the objects in it
/// (otherwise the namespace could never finish terminating).
///
/// It is the cheapest way to run a fleet locally (many "clusters" on one API server), and a
/// fit for tenants-as-namespaces designs. The isolation is the client's, not the API
/// server's: every namespace-cluster acts with the host client's credentials.
///
/// ```no_run
/// # async fn f(host: kube::Client) {
/// use multicluster_runtime::Manager;
/// use multicluster_runtime::providers::Namespaces;
///
/// // Every namespace labelled tenant=true is a cluster.
/// let manager = Manager::new(Namespaces::new(host).labels("tenant=true"));
/// # }
/// ```
#[derive(Clone)]
pub struct Namespaces {
    host: Client,
    selector: watcher::Config,
    hub: Arc<Hub>,
}

impl std::fmt::Debug for Namespaces {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Namespaces")
            .field("selector", &self.selector.label_selector)
            .finish_non_exhaustive()
    }
}

impl Namespaces {
    /// Every namespace of the cluster `host` reaches.
    pub fn new(host: Client) -> Self {
        Self {
            hub: Arc::new(Hub::new(host.clone())),
            host,
            selector: watcher::Config::default(),
        }
    }

    /// Only the namespaces matching a label selector (`tenant=true`, `env in (a,b)`).
    /// A namespace that stops matching is disengaged.
    #[must_use]
    pub fn labels(mut self, selector: &str) -> Self {
        self.selector = self.selector.labels(selector);
        self
    }

    /// How many watches this provider keeps open on the host for its namespace-clusters
    /// (one per resource type and watcher configuration in use by an engaged cluster), for
    /// diagnostics.
    pub fn host_watches(&self) -> usize {
        lock(&self.hub.watches)
            .values()
            .filter(|w| w.is_running())
            .count()
    }

    fn cluster(&self, namespace: &str) -> Cluster<ClusterName> {
        let service = Scoped {
            host: self.host.clone(),
            namespace: Arc::from(namespace),
            discovery: self.hub.discovery.clone(),
        };
        let client = Client::new(service, namespace);
        Cluster::with_source(
            ClusterName::from(namespace),
            client,
            Arc::new(NamespaceSlice {
                hub: self.hub.clone(),
                namespace: Arc::from(namespace),
            }),
        )
    }
}

impl Provider for Namespaces {
    type Id = ClusterName;

    async fn run(
        &self,
        fleet: Fleet<ClusterName>,
        shutdown: CancellationToken,
    ) -> Result<(), ProviderError> {
        let api: Api<Namespace> = Api::all(self.host.clone());
        let mut events = pin!(watcher::watcher(api, self.selector.clone()).default_backoff());
        let mut engaged: BTreeSet<String> = BTreeSet::new();
        let mut listing: BTreeSet<String> = BTreeSet::new();
        loop {
            let event = tokio::select! {
                () = shutdown.cancelled() => return Ok(()),
                event = events.next() => event,
            };
            match event {
                None => return Ok(()),
                Some(Err(error)) => {
                    tracing::warn!(%error, "watching the host's namespaces failed; retrying");
                }
                Some(Ok(Event::Init)) => listing.clear(),
                Some(Ok(Event::InitApply(ns))) => {
                    listing.insert(ns.name_any());
                    self.engage(&fleet, &mut engaged, ns.name_any());
                }
                Some(Ok(Event::Apply(ns))) => self.engage(&fleet, &mut engaged, ns.name_any()),
                Some(Ok(Event::InitDone)) => {
                    let vanished: Vec<String> = engaged.difference(&listing).cloned().collect();
                    for name in vanished {
                        self.disengage(&fleet, &mut engaged, &name);
                    }
                }
                Some(Ok(Event::Delete(ns))) => {
                    self.disengage(&fleet, &mut engaged, &ns.name_any());
                }
            }
        }
    }
}

impl Namespaces {
    fn engage(&self, fleet: &Fleet<ClusterName>, engaged: &mut BTreeSet<String>, name: String) {
        if engaged.contains(&name) {
            return;
        }
        match fleet.engage(self.cluster(&name)) {
            Ok(_) => {
                engaged.insert(name);
            }
            Err(error) => tracing::warn!(cluster = %name, %error, "could not engage namespace"),
        }
    }

    fn disengage(&self, fleet: &Fleet<ClusterName>, engaged: &mut BTreeSet<String>, name: &str) {
        engaged.remove(name);
        // The host watches notice the cluster's engagement ending and let go of its
        // subscriptions (and stop when nobody is left).
        fleet.disengage(&ClusterName::from(name));
    }
}

/// Locks, recovering from poisoning: every critical section here leaves its data consistent.
use crate::sync::lock;

// ---------------------------------------------------------------------------------------
// The shared watches.

/// The host's shared watches and discovery cache, shared by one provider's
/// namespace-clusters (and its clones). A host watch stops when its last subscriber goes,
/// and all of them when the last holder drops the hub.
pub(crate) struct Hub {
    host: Client,
    watches: Mutex<HashMap<WatchKey, Arc<HostWatch>>>,
    discovery: Arc<Discovery>,
    token: CancellationToken,
}

impl Drop for Hub {
    fn drop(&mut self) {
        self.token.cancel();
    }
}

impl Hub {
    fn new(host: Client) -> Self {
        Self {
            discovery: Arc::new(Discovery {
                host: host.clone(),
                groups: Mutex::new(HashMap::new()),
            }),
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
    hub: Arc<Hub>,
    namespace: Arc<str>,
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
struct HostWatch {
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
    fn is_running(&self) -> bool {
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

// ---------------------------------------------------------------------------------------
// The scoped client.

/// A namespace-cluster's client refused a write to a cluster-scoped resource (or to a path
/// outside the resource APIs): a namespace-cluster may only change objects in its namespace.
///
/// It reaches callers as [`kube::Error::Service`]; `downcast_ref::<ClusterScopedWrite>()`
/// on the boxed error recognises it. Cluster-scoped reads (listing namespaces or nodes,
/// discovery) and create-only review APIs such as `SelfSubjectAccessReview` are allowed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "cluster {cluster}: {method} {path} refused: {cluster} is a namespace of its host cluster and may not write cluster-scoped resources"
)]
pub struct ClusterScopedWrite {
    /// The namespace-cluster.
    pub cluster: String,
    /// The HTTP method of the refused request.
    pub method: String,
    /// Its path.
    pub path: String,
}

/// A namespace-cluster's client refused a request it cannot confine to its namespace, for
/// any verb:
///
/// - a path with `.` or `..` segments, empty segments or percent-escapes, which a server or
///   proxy normalising paths could read as another path (no Kubernetes name produces one);
/// - a resource the host's discovery does not list (not served, or a CRD still being
///   installed), since whether it is namespaced is unknown;
/// - a subresource of a cluster-scoped object other than `status` (a node's `proxy`
///   reaches the pods of every namespace);
/// - a write to a namespaced resource named without a namespace.
///
/// It reaches callers as [`kube::Error::Service`], like [`ClusterScopedWrite`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "cluster {cluster}: {method} {path} refused: {reason}, so it cannot be confined to namespace {cluster}"
)]
pub struct UnscopableRequest {
    /// The namespace-cluster.
    pub cluster: String,
    /// The HTTP method of the refused request.
    pub method: String,
    /// Its path.
    pub path: String,
    /// Why.
    pub reason: &'static str,
}

/// Whether `path` has no segment that could be normalised into another path: no `.` or
/// `..`, no empty segment (but a trailing `/`), no percent-escape.
pub(crate) fn is_plain_path(path: &str) -> bool {
    let Some(rest) = path.strip_prefix('/') else {
        return false;
    };
    let rest = rest.strip_suffix('/').unwrap_or(rest);
    rest.is_empty()
        || rest
            .split('/')
            .all(|s| !s.is_empty() && s != "." && s != ".." && !s.contains('%'))
}

/// Whether each resource of an API group version is namespaced, from the host's discovery.
struct Discovery {
    host: Client,
    /// By group-version path (`/api/v1`, `/apis/apps/v1`): when it was read, and the
    /// resources by plural.
    groups: Mutex<HashMap<String, (Instant, Arc<Scopes>)>>,
}

/// The scopes of one group version's resources, by plural.
type Scopes = HashMap<String, ResourceScope>;

/// How long a group version's discovery is trusted. A CRD deleted and created again with
/// another scope is noticed within this time.
const DISCOVERY_TTL: Duration = Duration::from_secs(30);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ResourceScope {
    namespaced: bool,
    /// Only `create` is served: a review API that changes nothing.
    create_only: bool,
}

impl Discovery {
    /// The scope of `resource` in `group_version`; `None` if the host does not serve it.
    async fn scope(
        &self,
        group_version: &str,
        resource: &str,
    ) -> Result<Option<ResourceScope>, kube::Error> {
        let cached = lock(&self.groups).get(group_version).cloned();
        if let Some((read, scopes)) = cached
            && read.elapsed() < DISCOVERY_TTL
            && let Some(found) = scopes.get(resource)
        {
            return Ok(Some(*found));
        }
        // Not known (yet), or known too long ago: a CRD may have been added or changed.
        let request = http::Request::get(group_version)
            .body(Vec::new())
            .map_err(kube::Error::HttpError)?;
        let list: APIResourceList = match self.host.request(request).await {
            Ok(list) => list,
            Err(kube::Error::Api(status)) if status.code == 404 => return Ok(None),
            Err(error) => return Err(error),
        };
        let scopes: Scopes = list
            .resources
            .iter()
            .filter(|r| !r.name.contains('/'))
            .map(|r| {
                let scope = ResourceScope {
                    namespaced: r.namespaced,
                    create_only: r.verbs == ["create"],
                };
                (r.name.clone(), scope)
            })
            .collect();
        let found = scopes.get(resource).copied();
        lock(&self.groups).insert(
            group_version.to_string(),
            (Instant::now(), Arc::new(scopes)),
        );
        Ok(found)
    }
}

/// An API path taken apart: `<group_version>[/watch]/<rest>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ApiPath<'a> {
    /// `/api/<version>` or `/apis/<group>/<version>`.
    pub(crate) group_version: &'a str,
    /// The deprecated `watch/` prefix.
    pub(crate) watch: bool,
    /// What it addresses.
    pub(crate) target: Target<'a>,
}

/// What an API path addresses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Target<'a> {
    /// The group version's discovery document.
    Discovery,
    /// `namespaces/<namespace>/<resource>[/<name>[/<subresource>...]]`.
    Namespaced {
        /// The namespace named.
        namespace: &'a str,
        /// The resource and whatever follows it.
        rest: Vec<&'a str>,
    },
    /// `<resource>[/<name>...]`: a cluster-scoped resource, or a namespaced one across all
    /// namespaces (discovery tells which).
    Unqualified {
        /// The resource plural.
        resource: &'a str,
        /// Whatever follows it.
        rest: Vec<&'a str>,
    },
}

impl<'a> ApiPath<'a> {
    /// Takes apart a request path (without query); `None` for paths outside the resource
    /// APIs (`/version`, `/openapi/v2`, `/apis`, ...).
    pub(crate) fn parse(path: &'a str) -> Option<Self> {
        let (group_version, rest) = if let Some(after) = path.strip_prefix("/api/") {
            let version = after.split('/').next().filter(|s| !s.is_empty())?;
            let len = "/api/".len() + version.len();
            (&path[..len], &path[len..])
        } else {
            let after = path.strip_prefix("/apis/")?;
            let mut parts = after.splitn(3, '/');
            let group = parts.next().filter(|s| !s.is_empty())?;
            let version = parts.next().filter(|s| !s.is_empty())?;
            let len = "/apis/".len() + group.len() + 1 + version.len();
            (&path[..len], &path[len..])
        };
        if !(rest.is_empty() || rest.starts_with('/')) {
            return None;
        }
        let mut segments: Vec<&str> = rest.split('/').skip(1).collect();
        if segments.last() == Some(&"") {
            segments.pop();
        }
        if segments.iter().any(|s| s.is_empty()) {
            return None;
        }
        let watch = segments.first() == Some(&"watch");
        if watch {
            segments.remove(0);
        }
        let target = match segments.as_slice() {
            [] => Target::Discovery,
            // The Namespace object's own subresources, `namespaces/<ns>/status|finalize`
            // (the API server reads them so in every group, whatever follows).
            ["namespaces", _, "status" | "finalize", ..] => Target::Unqualified {
                resource: segments[0],
                rest: segments[1..].to_vec(),
            },
            ["namespaces", namespace, _, ..] => Target::Namespaced {
                namespace,
                rest: segments[2..].to_vec(),
            },
            [resource, rest @ ..] => Target::Unqualified {
                resource,
                rest: rest.to_vec(),
            },
        };
        Some(Self {
            group_version,
            watch,
            target,
        })
    }

    /// The path of the same request for the namespaced `resource` (followed by `rest`) in
    /// `namespace`.
    pub(crate) fn in_namespace(&self, namespace: &str, rest: &[&str]) -> String {
        let mut path = String::from(self.group_version);
        if self.watch {
            path.push_str("/watch");
        }
        path.push_str("/namespaces/");
        path.push_str(namespace);
        for segment in rest {
            path.push('/');
            path.push_str(segment);
        }
        path
    }
}

/// What the scoped client does with a request.
#[derive(Debug, PartialEq, Eq)]
enum Decision {
    /// Send it as it is.
    Pass,
    /// Send it to this path instead; `body` says whether the body may name a namespace.
    Rewrite { path: String, body: bool },
    /// Refuse it: a cluster-scoped write.
    Refuse,
    /// Refuse it: it cannot be confined to the namespace, for this reason.
    Unscopable(&'static str),
}

/// The tower service behind a namespace-cluster's [`Client`]: it scopes each request to the
/// namespace and sends it with the host's client.
#[derive(Clone)]
struct Scoped {
    host: Client,
    namespace: Arc<str>,
    discovery: Arc<Discovery>,
}

impl Scoped {
    async fn decide(&self, method: &http::Method, path: &str) -> Result<Decision, BoxError> {
        let write = !matches!(
            *method,
            http::Method::GET | http::Method::HEAD | http::Method::OPTIONS
        );
        if !is_plain_path(path) {
            return Ok(Decision::Unscopable(
                "a path with dot segments, empty segments or escapes could be read as another path",
            ));
        }
        let Some(api) = ApiPath::parse(path) else {
            return Ok(if write {
                Decision::Refuse
            } else {
                Decision::Pass
            });
        };
        match &api.target {
            Target::Discovery => Ok(if write {
                Decision::Refuse
            } else {
                Decision::Pass
            }),
            Target::Namespaced { rest, .. } => Ok(Decision::Rewrite {
                path: api.in_namespace(&self.namespace, rest),
                body: write,
            }),
            Target::Unqualified { resource, rest } => {
                let scope = self.discovery.scope(api.group_version, resource).await?;
                Ok(match scope {
                    // Not served, or not yet in discovery (a CRD being installed): whether
                    // it is namespaced is unknown, so it cannot be confined.
                    None => Decision::Unscopable("the host's discovery does not list the resource"),
                    // Across all namespaces: within this one.
                    Some(s) if s.namespaced && rest.is_empty() => Decision::Rewrite {
                        path: api.in_namespace(&self.namespace, &[resource]),
                        body: write,
                    },
                    // Not a path the server serves; a write is refused in case discovery
                    // is stale and the resource turned cluster-scoped.
                    Some(s) if s.namespaced && write => {
                        Decision::Unscopable("a namespaced resource named without a namespace")
                    }
                    Some(s) if s.namespaced => Decision::Pass,
                    // Cluster-scoped. Review APIs (create only) change nothing.
                    Some(s) if write && s.create_only && rest.is_empty() => Decision::Pass,
                    Some(_) if write => Decision::Refuse,
                    // Reads of the collection, an object and its status only: subresources
                    // such as a node's `proxy` reach into every namespace.
                    Some(_) if matches!(rest.as_slice(), [] | [_] | [_, "status"]) => {
                        Decision::Pass
                    }
                    Some(_) => Decision::Unscopable(
                        "a cluster-scoped subresource other than status, which may reach into other namespaces",
                    ),
                })
            }
        }
    }

    async fn call(self, request: http::Request<Body>) -> Result<http::Response<Body>, BoxError> {
        let (mut parts, body) = request.into_parts();
        let path = parts.uri.path().to_string();
        let decision = self.decide(&parts.method, &path).await?;
        let body = match decision {
            Decision::Pass => body,
            Decision::Refuse => {
                return Err(Box::new(ClusterScopedWrite {
                    cluster: self.namespace.to_string(),
                    method: parts.method.to_string(),
                    path,
                }));
            }
            Decision::Unscopable(reason) => {
                return Err(Box::new(UnscopableRequest {
                    cluster: self.namespace.to_string(),
                    method: parts.method.to_string(),
                    path,
                    reason,
                }));
            }
            Decision::Rewrite {
                path,
                body: rewrite_body,
            } => {
                let path_and_query = match parts.uri.query() {
                    Some(query) => format!("{path}?{query}"),
                    None => path,
                };
                let mut uri = parts.uri.into_parts();
                uri.path_and_query = Some(path_and_query.parse()?);
                parts.uri = http::Uri::from_parts(uri)?;
                if rewrite_body {
                    let bytes = body.collect_bytes().await?;
                    match with_namespace(&bytes, &self.namespace) {
                        Ok(Some(rewritten)) => {
                            parts.headers.remove(http::header::CONTENT_LENGTH);
                            Body::from(rewritten)
                        }
                        Ok(None) => Body::from(bytes),
                        Err(reason) => {
                            return Err(Box::new(UnscopableRequest {
                                cluster: self.namespace.to_string(),
                                method: parts.method.to_string(),
                                path: parts.uri.path().to_string(),
                                reason,
                            }));
                        }
                    }
                } else {
                    body
                }
            }
        };
        Ok(self
            .host
            .send(http::Request::from_parts(parts, body))
            .await?)
    }
}

/// The body with `metadata.namespace` set to `namespace`, if it is a JSON object naming
/// another namespace; `Ok(None)` to send it unchanged; an error for an Event about a
/// cluster-scoped object, which the API server only accepts outside the namespace (in
/// `default`).
pub(crate) fn with_namespace(
    body: &[u8],
    namespace: &str,
) -> Result<Option<Vec<u8>>, &'static str> {
    let Ok(mut value) = serde_json::from_slice::<serde_json::Value>(body) else {
        return Ok(None);
    };
    let about_cluster_scoped = value.get("kind").and_then(|k| k.as_str()) == Some("Event")
        && ["regarding", "involvedObject"].iter().any(|field| {
            value.get(*field).is_some_and(|object| {
                object.is_object()
                    && object
                        .get("namespace")
                        .and_then(|n| n.as_str())
                        .is_none_or(str::is_empty)
            })
        });
    if about_cluster_scoped {
        return Err("an Event about a cluster-scoped object belongs in namespace default");
    }
    let Some(slot) = value
        .get_mut("metadata")
        .and_then(|m| m.get_mut("namespace"))
    else {
        return Ok(None);
    };
    if slot.as_str() == Some(namespace) || !slot.is_string() {
        return Ok(None);
    }
    *slot = serde_json::Value::String(namespace.to_string());
    Ok(serde_json::to_vec(&value).ok())
}

impl tower_service::Service<http::Request<Body>> for Scoped {
    type Response = http::Response<Body>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<http::Response<Body>, BoxError>> + Send>>;

    fn poll_ready(&mut self, _: &mut TaskContext<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        Box::pin(self.clone().call(request))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_taken_apart() {
        let p = ApiPath::parse("/api/v1/namespaces/zoo/configmaps/elephant").unwrap();
        assert_eq!(p.group_version, "/api/v1");
        assert_eq!(
            p.target,
            Target::Namespaced {
                namespace: "zoo",
                rest: vec!["configmaps", "elephant"]
            }
        );
        assert_eq!(
            p.in_namespace("jungle", &["configmaps", "elephant"]),
            "/api/v1/namespaces/jungle/configmaps/elephant"
        );

        let p = ApiPath::parse("/apis/apps/v1/watch/namespaces/zoo/deployments").unwrap();
        assert_eq!(p.group_version, "/apis/apps/v1");
        assert!(p.watch);
        assert_eq!(
            p.in_namespace("island", &["deployments"]),
            "/apis/apps/v1/watch/namespaces/island/deployments"
        );

        // The Namespace object and its subresources are cluster-scoped, in any group (as
        // the API server reads them; found in review).
        for path in [
            "/api/v1/namespaces/zoo",
            "/api/v1/namespaces/zoo/status",
            "/api/v1/namespaces/zoo/finalize",
            "/api/v1/namespaces/zoo/status/more",
            "/apis/example.com/v1/namespaces/zoo/status",
            "/api/v1/namespaces",
        ] {
            let p = ApiPath::parse(path).unwrap();
            assert!(
                matches!(
                    p.target,
                    Target::Unqualified {
                        resource: "namespaces",
                        ..
                    }
                ),
                "{path}: {p:?}"
            );
        }
        assert_eq!(
            ApiPath::parse("/api/v1/configmaps").unwrap().target,
            Target::Unqualified {
                resource: "configmaps",
                rest: vec![]
            }
        );
        assert_eq!(
            ApiPath::parse("/apis/apps/v1").unwrap().target,
            Target::Discovery
        );
        for outside in [
            "/version",
            "/apis",
            "/api",
            "/apis/apps",
            "/openapi/v2",
            "/api/v1//pods",
        ] {
            assert_eq!(ApiPath::parse(outside), None, "{outside}");
        }
    }

    #[test]
    fn paths_that_could_be_normalised_elsewhere_are_not_plain() {
        for plain in [
            "/",
            "/version",
            "/api/v1/namespaces/zoo/configmaps/a.b",
            "/apis/apps/v1/",
            "/api/v1/namespaces/zoo/configmaps/...",
        ] {
            assert!(is_plain_path(plain), "{plain}");
        }
        for tricky in [
            "/api/v1/namespaces/zoo/configmaps/../../../nodes/n1",
            "/api/v1/namespaces/zoo/./configmaps",
            "/api/v1//nodes/n1",
            "/api/v1/namespaces/zoo/configmaps/%2e%2e",
            "api/v1/nodes",
            "",
        ] {
            assert!(!is_plain_path(tricky), "{tricky}");
        }
    }

    #[test]
    fn only_a_foreign_namespace_in_the_body_is_rewritten() {
        let body = br#"{"metadata":{"name":"a","namespace":"jungle"},"data":{"x":"1"}}"#;
        let out = with_namespace(body, "zoo").unwrap().unwrap();
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["metadata"]["namespace"], "zoo");
        assert_eq!(v["data"]["x"], "1");
        assert_eq!(
            with_namespace(br#"{"metadata":{"namespace":"zoo"}}"#, "zoo"),
            Ok(None)
        );
        assert_eq!(
            with_namespace(br#"{"metadata":{"name":"a"}}"#, "zoo"),
            Ok(None)
        );
        assert_eq!(with_namespace(br#"[{"op":"add"}]"#, "zoo"), Ok(None));
        assert_eq!(with_namespace(b"not json", "zoo"), Ok(None));
        // Events: about an object in the namespace, fine; about a cluster-scoped one, not.
        let event = |regarding: &str| {
            format!(
                r#"{{"kind":"Event","metadata":{{"namespace":"default"}},"regarding":{regarding}}}"#
            )
        };
        assert!(
            with_namespace(
                event(r#"{"kind":"ConfigMap","namespace":"x"}"#).as_bytes(),
                "zoo"
            )
            .unwrap()
            .is_some()
        );
        assert!(with_namespace(event(r#"{"kind":"Node","name":"n1"}"#).as_bytes(), "zoo").is_err());
        assert!(
            with_namespace(event(r#"{"kind":"Node","namespace":""}"#).as_bytes(), "zoo").is_err()
        );
    }

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
