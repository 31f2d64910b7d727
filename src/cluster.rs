//! [`Cluster`]: a cheap handle to one engaged cluster, with its client and its shared caches.

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};

use futures::future::Either;
use futures::{Stream, StreamExt};
use kube::{Api, Client, Resource};
use kube_runtime::reflector::{ObjectRef, Store, store::Writer};
use kube_runtime::watcher::{self, Event};
use kube_runtime::{WatchStreamExt, watcher::watcher};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::index::{FieldIndexes, Indexer};
use crate::providers::NamespaceSlice;
use crate::{ClusterId, Watchable};

/// A cheap, clonable handle to one cluster: its id, its [`Client`] and the caches shared by
/// every controller that watches it.
///
/// A provider creates it with [`Cluster::new`] and engages it with the manager's
/// [`Fleet`](crate::Fleet); the handle stays valid after the cluster is disengaged, but its
/// watches stop and [`Cluster::is_engaged`] turns false.
pub struct Cluster<C: ClusterId> {
    inner: Arc<Inner<C>>,
}

struct Inner<C: ClusterId> {
    id: C,
    client: Client,
    config: Option<kube::Config>,
    /// Cancelled when the cluster is disengaged (or replaced); stops its watches.
    token: CancellationToken,
    /// One shared watch per (resource type, watcher configuration): `SharedWatch<K>`.
    watches: Mutex<HashMap<(TypeId, String), Arc<dyn ErasedWatch>>>,
    /// Field indexes registered for this cluster; every watch of their kind maintains them.
    indexers: Mutex<Vec<Indexer>>,
    /// Where its watches get their events: `None` watches the API server through `client`;
    /// a namespace of a host cluster is fed by the host's one watch per kind.
    slice: Option<NamespaceSlice>,
}

/// A [`SharedWatch`] of any kind.
trait ErasedWatch: Send + Sync {
    fn as_any(self: Arc<Self>) -> Arc<dyn Any + Send + Sync>;
    fn add_indexer(&self, indexer: &Indexer);
}

impl<K> ErasedWatch for SharedWatch<K>
where
    K: Resource<DynamicType = ()> + Clone + Send + Sync + 'static,
{
    fn as_any(self: Arc<Self>) -> Arc<dyn Any + Send + Sync> {
        self
    }

    fn add_indexer(&self, indexer: &Indexer) {
        if let Some(extract) = indexer.extract::<K>() {
            // Lock before the snapshot: the watch task updates indexes under this lock after
            // applying each event, so no event can fall between snapshot and registration.
            let mut indexes = lock(&self.indexes);
            let objects = self.store.state();
            indexes.add(indexer.name.clone(), extract, objects.iter().map(|o| &**o));
        }
    }
}

/// Locks, recovering from poisoning: every critical section here leaves its data consistent.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The cluster has no field index of that name for that kind.
#[derive(Debug, thiserror::Error)]
#[error(
    "cluster {cluster}: no field index {index:?} for {kind}; register it with Manager::index_field (or Fleet::index_field for provider clusters)"
)]
pub struct UnknownIndex {
    /// The cluster asked.
    pub cluster: String,
    /// The kind asked for.
    pub kind: String,
    /// The index asked for.
    pub index: String,
}

impl<C: ClusterId> Drop for Inner<C> {
    fn drop(&mut self) {
        // Nothing can use the watches any more; stop them.
        self.token.cancel();
    }
}

impl<C: ClusterId> Clone for Cluster<C> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
        }
    }
}

impl<C: ClusterId> fmt::Debug for Cluster<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Cluster")
            .field("id", &self.inner.id)
            .field("engaged", &self.is_engaged())
            .finish()
    }
}

impl<C: ClusterId> Cluster<C> {
    /// A cluster reached through `client`.
    pub fn new(id: C, client: Client) -> Self {
        Self::build(id, client, None)
    }

    /// A cluster built from `config`, which is kept: re-engaging the same id with a config
    /// that differs in endpoint or credentials replaces the cluster, an equal one is a no-op.
    pub fn from_config(id: C, config: kube::Config) -> Result<Self, kube::Error> {
        let client = Client::try_from(config.clone())?;
        Ok(Self::build(id, client, Some(config)))
    }

    /// A namespace of a host cluster, whose watches are fed from the host's shared watches.
    pub(crate) fn namespace_slice(id: C, client: Client, slice: NamespaceSlice) -> Self {
        let mut cluster = Self::build(id, client, None);
        if let Some(inner) = Arc::get_mut(&mut cluster.inner) {
            inner.slice = Some(slice);
        }
        cluster
    }

    /// The same cluster under another id (for providers that rename their children's
    /// clusters): same client, config and watch source; its own engagement and caches.
    pub(crate) fn renamed<D: ClusterId>(&self, id: D) -> Cluster<D> {
        let mut renamed = Cluster::build(id, self.client(), self.inner.config.clone());
        if let Some(inner) = Arc::get_mut(&mut renamed.inner) {
            inner.slice = self.inner.slice.clone();
        }
        renamed
    }

    fn build(id: C, client: Client, config: Option<kube::Config>) -> Self {
        Self {
            inner: Arc::new(Inner {
                id,
                client,
                config,
                token: CancellationToken::new(),
                watches: Mutex::new(HashMap::new()),
                indexers: Mutex::new(Vec::new()),
                slice: None,
            }),
        }
    }

    /// The cluster's id.
    pub fn id(&self) -> &C {
        &self.inner.id
    }

    /// A client for the cluster (a cheap clone).
    pub fn client(&self) -> Client {
        self.inner.client.clone()
    }

    /// The configuration the cluster was built from, if it was built with
    /// [`Cluster::from_config`].
    pub fn config(&self) -> Option<&kube::Config> {
        self.inner.config.as_ref()
    }

    /// Whether the cluster is still engaged.
    pub fn is_engaged(&self) -> bool {
        !self.inner.token.is_cancelled()
    }

    /// Completes when the cluster is disengaged (or replaced by a changed cluster of the same
    /// id). Reconcilers can select on it to abandon work for a cluster that is gone.
    pub async fn disengaged(&self) {
        self.inner.token.cancelled().await
    }

    /// A handle that does not keep the cluster alive.
    pub fn downgrade(&self) -> WeakCluster<C> {
        WeakCluster {
            inner: Arc::downgrade(&self.inner),
        }
    }

    /// Whether `self` and `other` are the same instance (not merely the same id).
    pub fn same_instance(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// Whether `other` reaches the cluster differently: another endpoint or other
    /// credentials. Clusters without a kept config compare by instance.
    pub(crate) fn differs_from(&self, other: &Self) -> bool {
        if self.same_instance(other) {
            return false;
        }
        match (&self.inner.config, &other.inner.config) {
            (Some(a), Some(b)) => !same_endpoint_and_credentials(a, b),
            _ => true,
        }
    }

    /// The store of an existing shared watch, without starting one.
    pub(crate) fn existing_store<K>(&self, config: &watcher::Config) -> Option<Store<K>>
    where
        K: Resource<DynamicType = ()> + Clone + Send + Sync + 'static,
    {
        let key = (TypeId::of::<K>(), format!("{config:?}"));
        let watches = lock(&self.inner.watches);
        let watch = watches
            .get(&key)?
            .clone()
            .as_any()
            .downcast::<SharedWatch<K>>()
            .ok()?;
        Some(watch.store.clone())
    }

    /// Registers a field index on this cluster's `K` caches (existing and future ones).
    /// An index of the same kind and name is registered once; later registrations are
    /// ignored.
    pub(crate) fn add_indexer(&self, indexer: &Indexer) {
        {
            let mut indexers = lock(&self.inner.indexers);
            if indexers.iter().any(|i| i.same_as(indexer)) {
                return;
            }
            indexers.push(indexer.clone());
        }
        for ((kind, _), watch) in lock(&self.inner.watches).iter() {
            if *kind == indexer.kind() {
                watch.add_indexer(indexer);
            }
        }
    }

    /// The cached `K` objects (of the watch for `config`, started on first use) that the
    /// field index `index` files under `value`.
    ///
    /// ```no_run
    /// # use multicluster_runtime::{Cluster, ClusterName};
    /// # use k8s_openapi::api::core::v1::ConfigMap;
    /// # use kube::runtime::watcher;
    /// # fn f(cluster: Cluster<ClusterName>) -> Result<(), multicluster_runtime::UnknownIndex> {
    /// // After `manager.index_field::<ConfigMap>("type", ...)`:
    /// let animals = cluster.indexed::<ConfigMap>(&watcher::Config::default(), "type", "animal")?;
    /// # Ok(()) }
    /// ```
    pub fn indexed<K>(
        &self,
        config: &watcher::Config,
        index: &str,
        value: &str,
    ) -> Result<Vec<Arc<K>>, UnknownIndex>
    where
        K: Watchable,
    {
        let watch = self.watch::<K>(config);
        let refs = lock(&watch.indexes)
            .lookup(index, value)
            .ok_or_else(|| UnknownIndex {
                cluster: self.inner.id.to_string(),
                kind: K::kind(&()).into_owned(),
                index: index.to_string(),
            })?;
        Ok(refs.iter().filter_map(|r| watch.store.get(r)).collect())
    }

    pub(crate) fn disengage(&self) {
        self.inner.token.cancel();
    }

    /// The reflector store of `K` objects matching `config`, started on first use and shared
    /// by every controller of this process that asks for the same type and configuration.
    pub fn store<K>(&self, config: &watcher::Config) -> Store<K>
    where
        K: Watchable,
    {
        self.watch::<K>(config).store.clone()
    }

    /// The shared watch of `K` objects matching `config`; started on first use.
    pub(crate) fn watch<K>(&self, config: &watcher::Config) -> Arc<SharedWatch<K>>
    where
        K: Watchable,
    {
        let key = (TypeId::of::<K>(), format!("{config:?}"));
        let mut watches = lock(&self.inner.watches);
        if let Some(existing) = watches.get(&key).cloned()
            && let Ok(watch) = existing.as_any().downcast::<SharedWatch<K>>()
        {
            return watch;
        }
        let writer = Writer::<K>::default();
        let watch = Arc::new(SharedWatch {
            store: writer.as_reader(),
            subscribers: Mutex::new(Vec::new()),
            indexes: Mutex::new(FieldIndexes::default()),
            ready: tokio::sync::watch::Sender::new(false),
            token: self.inner.token.clone(),
        });
        for indexer in lock(&self.inner.indexers).iter() {
            watch.add_indexer(indexer);
        }
        let events = match &self.inner.slice {
            None => Either::Left(
                watcher(Api::<K>::all(self.client()), config.clone()).default_backoff(),
            ),
            Some(slice) => Either::Right(slice.events::<K>(config, &self.inner.token).map(Ok)),
        };
        let task = run_watch(
            events,
            writer,
            Arc::downgrade(&watch),
            self.inner.token.clone(),
            self.inner.id.to_string(),
        );
        tokio::spawn(task);
        watches.insert(key, watch.clone());
        watch
    }
}

/// A non-owning [`Cluster`] handle; see [`Cluster::downgrade`].
pub struct WeakCluster<C: ClusterId> {
    inner: std::sync::Weak<Inner<C>>,
}

impl<C: ClusterId> Clone for WeakCluster<C> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
        }
    }
}

impl<C: ClusterId> fmt::Debug for WeakCluster<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("WeakCluster")
    }
}

impl<C: ClusterId> WeakCluster<C> {
    /// The cluster, if anything still holds it.
    pub fn upgrade(&self) -> Option<Cluster<C>> {
        self.inner.upgrade().map(|inner| Cluster { inner })
    }
}

/// Compares what decides where and as whom requests go: the endpoint, the CA, the TLS
/// name, proxy, extra headers and the user's credentials (everything in `AuthInfo`, secrets
/// included: exec plugins, auth providers, impersonation). Timeouts and the like do not
/// matter.
fn same_endpoint_and_credentials(a: &kube::Config, b: &kube::Config) -> bool {
    // `AuthInfo` has no `PartialEq`; its serde form is complete (it writes secrets out).
    let auth = |c: &kube::Config| serde_json::to_value(&c.auth_info).ok();
    a.cluster_url == b.cluster_url
        && a.root_cert == b.root_cert
        && a.root_cert_file == b.root_cert_file
        && a.tls_server_name == b.tls_server_name
        && a.accept_invalid_certs == b.accept_invalid_certs
        && a.proxy_url == b.proxy_url
        && a.headers == b.headers
        && auth(a).is_some()
        && auth(a) == auth(b)
}

/// A change seen by a shared watch.
#[derive(Debug)]
pub(crate) struct Change<K> {
    /// The object as stored (or, for a deletion, as last seen).
    pub(crate) object: Arc<K>,
    /// Whether it was deleted.
    pub(crate) deleted: bool,
    /// Whether it comes from the first complete listing (or a replay of the store to a late
    /// subscriber) rather than from a later change.
    pub(crate) initial: bool,
}

impl<K> Clone for Change<K> {
    fn clone(&self) -> Self {
        Self {
            object: self.object.clone(),
            deleted: self.deleted,
            initial: self.initial,
        }
    }
}

/// One watch of one resource type in one cluster, feeding a reflector store and any number
/// of subscribers (one per controller relation).
pub(crate) struct SharedWatch<K: Resource<DynamicType = ()> + Clone + 'static> {
    pub(crate) store: Store<K>,
    subscribers: Mutex<Vec<mpsc::UnboundedSender<Change<K>>>>,
    /// Field indexes over `store`, updated with it.
    indexes: Mutex<FieldIndexes<K>>,
    /// True once the first listing is in the store. `Store::wait_until_ready` cannot serve
    /// here: its one-shot channel keeps only the last waiter's waker, so with several
    /// controllers (tasks) waiting on one shared store all but one would wait forever.
    ready: tokio::sync::watch::Sender<bool>,
    /// The cluster's engagement token.
    token: CancellationToken,
}

impl<K> SharedWatch<K>
where
    K: Resource<DynamicType = ()> + Clone + 'static,
{
    /// A stream of changes from now on, starting with every object already in the store
    /// (marked initial), so a subscriber that comes late misses nothing.
    pub(crate) fn subscribe(&self) -> impl Stream<Item = Change<K>> + Send + use<K>
    where
        K: Send + Sync,
    {
        let (tx, rx) = mpsc::unbounded_channel();
        let mut subscribers = self.subscribers.lock().unwrap_or_else(|e| e.into_inner());
        // Under the lock the watch task cannot notify in between: no change is lost or
        // delivered before the replay.
        for object in self.store.state() {
            let _ = tx.send(Change {
                object,
                deleted: false,
                initial: true,
            });
        }
        subscribers.push(tx);
        tokio_stream_from(rx)
    }

    /// Completes once the first listing is in the store, or (false) when the cluster is
    /// disengaged first.
    pub(crate) fn ready(&self) -> impl std::future::Future<Output = bool> + Send + 'static {
        let mut rx = self.ready.subscribe();
        let token = self.token.clone();
        async move {
            tokio::select! {
                ready = rx.wait_for(|ready| *ready) => ready.is_ok(),
                () = token.cancelled() => false,
            }
        }
    }

    /// Whether the first listing is in the store.
    pub(crate) fn is_ready(&self) -> bool {
        *self.ready.borrow()
    }

    fn update_indexes(&self, event: &Event<K>, store: &Store<K>) {
        let mut indexes = lock(&self.indexes);
        if indexes.is_empty() {
            return;
        }
        match event {
            Event::Apply(obj) => indexes.apply(obj),
            Event::Delete(obj) => indexes.delete(obj),
            Event::InitDone => {
                let objects = store.state();
                indexes.rebuild(objects.iter().map(|o| &**o));
            }
            Event::Init | Event::InitApply(_) => {}
        }
    }

    fn notify(&self, change: Change<K>) {
        let mut subscribers = self.subscribers.lock().unwrap_or_else(|e| e.into_inner());
        subscribers.retain(|tx| tx.send(change.clone()).is_ok());
    }
}

fn tokio_stream_from<T: Send + 'static>(
    mut rx: mpsc::UnboundedReceiver<T>,
) -> impl Stream<Item = T> + Send + 'static {
    futures::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

/// Drives one shared watch until the cluster is disengaged or nobody holds the watch.
async fn run_watch<K>(
    events: impl Stream<Item = Result<Event<K>, watcher::Error>> + Send,
    mut writer: Writer<K>,
    shared: std::sync::Weak<SharedWatch<K>>,
    token: CancellationToken,
    cluster: String,
) where
    K: Watchable,
{
    let kind = K::kind(&());
    let store = writer.as_reader();
    let mut events = std::pin::pin!(events);
    // Objects of a listing in progress: the store swaps them in only at InitDone, so their
    // notifications wait until then (a reconcile must find the object in the store).
    let mut listing: Vec<ObjectRef<K>> = Vec::new();
    let mut first_listing = true;
    loop {
        let event = tokio::select! {
            () = token.cancelled() => break,
            event = events.next() => event,
        };
        let Some(shared) = shared.upgrade() else {
            break;
        };
        match event {
            None => break,
            Some(Err(error)) => {
                // The watcher retries with backoff; an unreachable, restarting or forbidding
                // cluster is reported here and does not affect the others.
                tracing::warn!(%cluster, %kind, %error, "watch failed; retrying");
            }
            Some(Ok(event)) => {
                writer.apply_watcher_event(&event);
                shared.update_indexes(&event, &store);
                match event {
                    Event::Apply(obj) => {
                        if let Some(object) = store.get(&ObjectRef::from_obj(&obj)) {
                            shared.notify(Change {
                                object,
                                deleted: false,
                                initial: false,
                            });
                        }
                    }
                    Event::Delete(obj) => {
                        shared.notify(Change {
                            object: Arc::new(obj),
                            deleted: true,
                            initial: false,
                        });
                    }
                    Event::Init => listing.clear(),
                    Event::InitApply(obj) => listing.push(ObjectRef::from_obj(&obj)),
                    Event::InitDone => {
                        for obj_ref in listing.drain(..) {
                            if let Some(object) = store.get(&obj_ref) {
                                shared.notify(Change {
                                    object,
                                    deleted: false,
                                    initial: first_listing,
                                });
                            }
                        }
                        first_listing = false;
                        shared.ready.send_replace(true);
                    }
                }
            }
        }
    }
    // Closing the subscriptions lets each subscriber drain what was already sent and then
    // see its stream end.
    if let Some(shared) = shared.upgrade() {
        lock(&shared.subscribers).clear();
    }
    tracing::debug!(%cluster, %kind, "watch stopped");
}
