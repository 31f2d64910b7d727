//! [`Cluster`]: one cluster's identity and client and, while it is engaged, its shared caches.
//!
//! A `Cluster` is a cheap handle a provider builds once and may engage any number of times:
//! each engagement (from the first fleet engaging it to the last letting go) has caches of its
//! own, which stop when it ends. See `docs/architecture.md` for the states.

mod errors;
mod id;
mod identity;
pub(crate) mod reported;
mod session;

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};

use futures::StreamExt;
use futures::future::Either;
use kube::Client;
use kube_runtime::events::{Recorder, Reporter};
use kube_runtime::watcher;

pub use errors::DiscoveryError;
pub(crate) use id::ClusterField;
pub use id::{ClusterId, ClusterName, InvalidClusterId, SingleCluster};
pub use identity::ClusterIdentity;
pub(crate) use identity::value_of as property_value;
use session::Attachment;
pub(crate) use session::Primary;
pub(crate) use session::{Engagement, Session};

use crate::cache::watch::WatchState;
use crate::cache::{
    Cache, CacheError, Indexer, SharedWatch, Store, WatchKey, WatchSettings, WatchSource,
    Watchable, listing, source, transform, watch,
};
use crate::client::endpoint::same_endpoint_and_credentials;
use crate::client::layer::{ClientLayer, ClientState, Forward, MakeClient};
use crate::client::{CredentialError, RateLimit, reauth, redact, requester, transport};
use crate::util::sync::lock;

/// A cheap, clonable handle to one cluster: its id, its [`Client`] and, while it is engaged,
/// the caches shared by every controller that watches it.
///
/// A provider creates it with [`Cluster::new`] or [`Cluster::from_config`] and engages it with
/// the manager's [`Fleet`](crate::Fleet). The same handle can be engaged again after it was
/// disengaged (by a second manager run, say): each engagement starts its caches afresh.
pub struct Cluster<C: ClusterId> {
    inner: Arc<Inner<C>>,
}

struct Inner<C: ClusterId> {
    id: C,
    /// Behind `client_state`'s layer (rate limit, request metrics).
    client: ClientSlot,
    client_state: Arc<ClientState>,
    config: Option<kube::Config>,
    /// Field indexes registered for this cluster; every watch of their kind maintains them.
    indexers: Mutex<Vec<Indexer>>,
    /// Where its watches get their events: `None` watches the API server through `client`;
    /// a provider may share watches among its clusters (a namespace of a host cluster is fed
    /// by the host's one watch per kind).
    source: Option<Arc<dyn WatchSource>>,
    attachment: Mutex<Attachment>,
    /// Event recorders by reporter, made on first use; they keep their series of repeated
    /// Events for as long as the cluster instance lives.
    recorders: Mutex<HashMap<Reporter, Recorder>>,
    /// What the cluster says it is, where a provider reads it.
    identity: Mutex<Option<ClusterIdentity>>,
    /// Where its credential is kept, when a provider says so.
    credential_holder: Mutex<Option<crate::client::CredentialHolder>>,
}

/// A cluster's client: built with its layer, made on first use from its configuration, or
/// (for a client given to [`Cluster::new`]) wrapped on first use inside a runtime, since the
/// wrapper's buffer needs one to start.
enum ClientSlot {
    Built(Client),
    /// From a configuration: everything that can fail was done by `from_config`; the client
    /// (and its buffer's task) is made when first asked for, so a cluster that is only
    /// discovered (a sharded replica that does not own it) costs no task.
    Deferred {
        make: Mutex<Option<MakeClient>>,
        made: std::sync::OnceLock<Client>,
        /// The stack the client is made of, for the cluster's watches (which need no
        /// client, and so no buffer); `None` for kube's own stacks.
        raw: Option<requester::RawService>,
        /// The exec plugin's credentials, when the user is one.
        credentials: Option<reauth::Credentials>,
    },
    Given {
        given: Client,
        layered: std::sync::OnceLock<Client>,
    },
}

/// Whether one cache of a cluster has listed; see [`Cluster::cache_status`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct CacheStatus {
    /// The kind cached.
    pub kind: String,
    /// The watcher configuration of the cache (its selectors), as text.
    pub config: String,
    /// Whether its first listing is in.
    pub synced: bool,
    /// Why the watch is failing, if it is (forbidden, a missing CRD, an unreachable server):
    /// before its first listing, or since (the cache is stale then); `None` once it works.
    pub error: Option<String>,
    /// Whether its first listing has taken longer than the manager's
    /// [`cache_sync_timeout`](crate::Manager::cache_sync_timeout) so far.
    pub overdue: bool,
    /// When its last event came (a listed object, the listing's end, a change), if one has.
    pub last_event: Option<std::time::SystemTime>,
    /// How many of its attempts to list or watch failed since it started.
    pub failures: u64,
}

impl<C: ClusterId> Drop for Inner<C> {
    fn drop(&mut self) {
        // Nothing can use the watches any more; stop them.
        if let Some(session) = &lock(&self.attachment).session {
            session.token.cancel();
        }
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
    /// A cluster reached through `client`. Its requests pass through the cluster's rate
    /// limit and request metrics ([`Cluster::with_rate_limit`]) on their way to `client`.
    pub fn new(id: C, client: Client) -> Self {
        let slot = ClientSlot::Given {
            given: client,
            layered: std::sync::OnceLock::new(),
        };
        Self::build(id, slot, Arc::new(ClientState::default()), None, None)
    }

    /// A cluster built from `config`, which is kept: re-engaging the same id with a config
    /// that differs in endpoint or credentials replaces the cluster, an equal one is a no-op.
    ///
    /// Runs nothing: an exec credential plugin runs when a request first needs its
    /// credentials (or at [`Cluster::credentials_ready`]), as a child process the runtime
    /// waits on without holding a thread, killed with its own children after 30 s; it runs
    /// again from a minute before a token expires (requests go on with the old one
    /// meanwhile) and after a 401. If it fails, the requests' error is a [`CredentialError`]
    /// in [`kube::Error::Service`]: it says what failed, never the plugin's command line,
    /// environment or output (kube-client's own error quotes them).
    pub fn from_config(id: C, config: kube::Config) -> Result<Self, kube::Error> {
        let state = Arc::new(ClientState::default());
        let layer = ClientLayer(state.clone());
        let (make, raw, credentials) =
            Self::make_client(&config, layer).map_err(redact::redact_kube)?;
        let slot = ClientSlot::Deferred {
            make: Mutex::new(Some(make)),
            made: std::sync::OnceLock::new(),
            raw,
            credentials,
        };
        Ok(Self::build(id, slot, state, Some(config), None))
    }

    /// Has the exec credential plugin of a cluster built by [`Cluster::from_config`] run,
    /// unless its credentials are held and valid; `Ok` for any other cluster. Providers call
    /// this before engaging a cluster, so that a plugin that fails is a refusal rather than
    /// a cluster whose every request fails. The error names no credential.
    pub async fn credentials_ready(&self) -> Result<(), CredentialError> {
        match &self.inner.client {
            ClientSlot::Deferred {
                credentials: Some(credentials),
                ..
            } => credentials.ready().await.map_err(CredentialError::new),
            _ => Ok(()),
        }
    }

    /// How to make the client of `config` once it is first needed: over the shared
    /// transport (with the stack it is made of, for watches), or kube's own stack for what
    /// the transport does not do; and the handle of its exec plugin's credentials.
    fn make_client(
        config: &kube::Config,
        layer: ClientLayer,
    ) -> Result<
        (
            MakeClient,
            Option<requester::RawService>,
            Option<reauth::Credentials>,
        ),
        kube::Error,
    > {
        Ok(match transport::shared(config)? {
            Some(transport) => {
                let (make, raw, credentials) = transport::client(config, transport, layer)?;
                (make, Some(raw), credentials)
            }
            None if config.auth_info.exec.is_some() => {
                // kube's stack, without its exec plugin (which it would run on a worker):
                // the crate's own credentials on top, a buffer making the stack cloneable
                // for them.
                let mut plain = config.clone();
                plain.auth_info.exec = None;
                // secrets-lint: from_config passes the error through redact_kube.
                let builder = kube::client::ClientBuilder::try_from(plain)?;
                let exec = reauth::ReauthLayer::new(config, None);
                let credentials = exec.credentials();
                let make: MakeClient = Box::new(move || {
                    builder
                        .with_layer(&tower::buffer::BufferLayer::new(1024))
                        .with_layer(&exec)
                        .with_layer(&layer)
                        .build()
                });
                (make, None, Some(credentials))
            }
            None => {
                // secrets-lint: from_config passes the error through redact_kube.
                let builder = kube::client::ClientBuilder::try_from(config.clone())?;
                // A buffer makes kube's stack cloneable, for the owner reference check.
                let builder = builder
                    .with_layer(&tower::buffer::BufferLayer::new(1024))
                    .with_layer(&layer);
                (Box::new(move || builder.build()), None, None)
            }
        })
    }

    /// A cluster whose requests go to `service` (through the cluster's layer) and whose
    /// watches get their events from `source` (a provider's shared watches) rather than
    /// from watches of their own.
    pub(crate) fn with_source<S, B>(
        id: C,
        service: S,
        default_namespace: &str,
        source: Arc<dyn WatchSource>,
    ) -> Self
    where
        S: tower_service::Service<http::Request<kube::client::Body>, Response = http::Response<B>>
            + Clone
            + Send
            + 'static,
        S::Future: Send + 'static,
        S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
        B: http_body::Body<Data = bytes::Bytes> + Send + 'static,
        B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let state = Arc::new(ClientState::default());
        let client = Client::new(
            tower_layer::Layer::layer(&ClientLayer(state.clone()), service),
            default_namespace,
        );
        Self::build(id, ClientSlot::Built(client), state, None, Some(source))
    }

    /// The same cluster under another id (for providers that rename their children's
    /// clusters): same client (and so the same rate limit), config and watch source; its
    /// own engagement and caches.
    pub(crate) fn renamed<D: ClusterId>(&self, id: D) -> Cluster<D> {
        Cluster::build(
            id,
            ClientSlot::Built(self.client()),
            self.inner.client_state.clone(),
            self.inner.config.clone(),
            self.inner.source.clone(),
        )
    }

    fn build(
        id: C,
        client: ClientSlot,
        client_state: Arc<ClientState>,
        config: Option<kube::Config>,
        source: Option<Arc<dyn WatchSource>>,
    ) -> Self {
        let inner = Arc::new(Inner {
            id,
            client,
            client_state,
            config,
            indexers: Mutex::new(Vec::new()),
            source,
            attachment: Mutex::new(Attachment::default()),
            recorders: Mutex::new(HashMap::new()),
            identity: Mutex::new(None),
            credential_holder: Mutex::new(None),
        });
        // A renamed cluster shares its client: its spans and checks name the latest name.
        let named = ClusterField(&inner.id).to_string();
        inner.client_state.name(&named);
        // The owner reference check reads through the cluster's own client; a weak handle,
        // since the client's layer holds the check.
        let weak = Arc::downgrade(&inner);
        crate::client::owners::OwnerCheck::attach(
            &inner.client_state,
            &named,
            Box::new(move || weak.upgrade().map(|inner| Cluster { inner }.client())),
        );
        Self { inner }
    }

    /// Whether this cluster's client refuses a write whose object has a native
    /// `ownerReferences` entry naming a uid the cluster does not hold (the garbage collector
    /// would delete the object): on by default. An error naming the cluster (and the cluster
    /// of the fleet that holds the uid, when this process has seen it) is returned in place
    /// of the write, which is never sent. Off, such writes go as they are.
    pub fn with_owner_reference_check(self, on: bool) -> Self {
        self.inner.client_state.owners.set(on);
        self
    }

    /// When the cluster's credential ends, where the crate can read it: the credential an
    /// exec plugin gave last (its `expirationTimestamp`), else the earliest of the bearer
    /// token's `exp` (a JWT's claim, `token` or `tokenFile`) and the client certificate's
    /// `notAfter`; and, earlier still, the end its holder states
    /// ([`CredentialHolder::ends_at`](crate::CredentialHolder::ends_at)). `None` for a
    /// cluster made from a client ([`Cluster::new`]) with no holder's end, a credential
    /// without an end the crate can read, or an exec plugin that has not run yet.
    pub fn credential_expiry(&self) -> Option<crate::client::CredentialExpiry> {
        let read = if let ClientSlot::Deferred {
            credentials: Some(credentials),
            ..
        } = &self.inner.client
        {
            credentials
                .expires()
                .map(|at| crate::client::CredentialExpiry {
                    at,
                    source: crate::client::CredentialSource::Exec,
                })
        } else {
            self.inner
                .config
                .as_ref()
                .and_then(crate::client::expiry::of_config)
        };
        let stated = lock(&self.inner.credential_holder)
            .as_ref()
            .and_then(|h| h.end)
            .map(|at| crate::client::CredentialExpiry {
                at,
                source: crate::client::CredentialSource::Annotation,
            });
        [read, stated].into_iter().flatten().min_by_key(|e| e.at)
    }

    /// Says where the cluster's credential is kept (and the end that object states), for
    /// its Warning Event as the end comes near; see [`CredentialHolder`](crate::CredentialHolder).
    pub fn with_credential_holder(self, holder: crate::client::CredentialHolder) -> Self {
        *lock(&self.inner.credential_holder) = Some(holder);
        self
    }

    /// Where the cluster's credential is kept, if a provider said.
    pub(crate) fn credential_holder(&self) -> Option<crate::client::CredentialHolder> {
        lock(&self.inner.credential_holder).clone()
    }

    /// The end the holder states changed (the provider read its object again).
    pub(crate) fn restate_credential_end(&self, end: Option<std::time::SystemTime>) {
        if let Some(holder) = lock(&self.inner.credential_holder).as_mut() {
            holder.end = end;
        }
    }

    /// Tells the owner reference check that the cluster holds an object of `uid` (the object
    /// a reconcile is for).
    pub(crate) fn holds_uid(&self, namespace: Option<&str>, uid: &str) {
        self.inner.client_state.owners.know(namespace, uid);
    }

    /// Limits the requests of this cluster's client (every request: the controllers'
    /// watches and the reconcilers' calls); `None` for no limit. A limit set here wins over
    /// the manager's default ([`Manager::client_rate_limit`](crate::Manager::client_rate_limit));
    /// without one, the cluster takes the default of the manager that engages it.
    pub fn with_rate_limit(self, limit: Option<RateLimit>) -> Self {
        self.inner.client_state.set_limit(limit);
        self
    }

    /// An Event recorder of this cluster for `reporter`, kept with the cluster so that its
    /// record of Events already sent (repeats are counted into a series) lasts between
    /// reconciles. Its Events are created in the cluster, through its client.
    pub fn recorder(&self, reporter: &Reporter) -> Recorder {
        let mut recorders = lock(&self.inner.recorders);
        if let Some(recorder) = recorders.get(reporter) {
            return recorder.clone();
        }
        let recorder = Recorder::new(self.client(), reporter.clone());
        recorders.insert(reporter.clone(), recorder.clone());
        recorder
    }

    /// The rate limit in force on the cluster's client, if any.
    pub fn rate_limit(&self) -> Option<RateLimit> {
        self.inner.client_state.limit()
    }

    /// The cluster's id.
    pub fn id(&self) -> &C {
        &self.inner.id
    }

    /// A client for the cluster (a cheap clone).
    pub fn client(&self) -> Client {
        match &self.inner.client {
            ClientSlot::Built(client) => client.clone(),
            ClientSlot::Deferred { make, made, .. } => made
                .get_or_init(|| {
                    // Taken once: `get_or_init` runs one initialiser at a time, and only
                    // until one returns.
                    let make = lock(make).take();
                    match make {
                        Some(make) => make(),
                        // Only if making it panicked before (outside a Tokio runtime, as
                        // building a kube client eagerly would have).
                        None => panic!(
                            "the client of cluster {} could not be made: it needs a Tokio runtime",
                            self.inner.id
                        ),
                    }
                })
                .clone(),
            ClientSlot::Given { given, layered } => {
                if let Some(client) = layered.get() {
                    return client.clone();
                }
                // Outside a runtime the client given is all there is (nothing can send a
                // request there anyway); inside one it goes behind the cluster's layer.
                if tokio::runtime::Handle::try_current().is_err() {
                    return given.clone();
                }
                layered
                    .get_or_init(|| {
                        let layer = ClientLayer(self.inner.client_state.clone());
                        Client::new(
                            tower_layer::Layer::layer(&layer, Forward(given.clone())),
                            given.default_namespace(),
                        )
                        .with_valid_until(*given.valid_until())
                    })
                    .clone()
            }
        }
    }

    /// How the cluster's watches send their requests: the stack its client is made of where
    /// there is one (a cluster whose client nobody asks for never makes it), else the client.
    pub(crate) fn requester(&self) -> requester::Requester {
        match &self.inner.client {
            ClientSlot::Deferred { raw: Some(raw), .. } => {
                requester::Requester::Service(raw.clone())
            }
            _ => requester::Requester::Client(self.client()),
        }
    }

    /// The configuration the cluster was built from, if it was built with
    /// [`Cluster::from_config`].
    pub fn config(&self) -> Option<&kube::Config> {
        self.inner.config.as_ref()
    }

    /// Whether the cluster is engaged (by a running manager's fleet, or as its local cluster).
    /// A new handle is not engaged until a fleet engages it; a handle given to
    /// [`Fleet::engage`](crate::Fleet::engage) that found an equal cluster already engaged
    /// (`Engaged::Unchanged`) stays unengaged.
    pub fn is_engaged(&self) -> bool {
        lock(&self.inner.attachment).fleets > 0
    }

    /// Completes when the current engagement ends (disengaged, replaced by a changed cluster
    /// of the same id, or its manager stopped); at once if the cluster is not engaged.
    pub async fn disengaged(&self) {
        if let Some(session) = self.session() {
            session.token.cancelled().await;
        }
    }

    /// A handle that does not keep the cluster alive.
    pub fn downgrade(&self) -> WeakCluster<C> {
        WeakCluster {
            inner: Arc::downgrade(&self.inner),
        }
    }

    /// What the cluster says it is (KEP-2149), where its provider reads it
    /// ([`Identified`](crate::providers::Identified), [`ById`](crate::providers::ById)):
    /// kept up to date while it is engaged; `None` where nothing reads it.
    pub fn identity(&self) -> Option<ClusterIdentity> {
        lock(&self.inner.identity).clone()
    }

    pub(crate) fn set_identity(&self, identity: Option<ClusterIdentity>) {
        *lock(&self.inner.identity) = identity;
    }

    /// Whether `self` and `other` are the same instance (not merely the same id).
    pub fn same_instance(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// Whether `other` reaches the cluster differently: another endpoint, default namespace
    /// or other credentials. Clusters without a kept config compare by instance.
    pub(crate) fn differs_from(&self, other: &Self) -> bool {
        if self.same_instance(other) {
            return false;
        }
        match (&self.inner.config, &other.inner.config) {
            (Some(a), Some(b)) => !same_endpoint_and_credentials(a, b),
            _ => true,
        }
    }

    /// Whether `other` is known to reach the same API server (same URL), so that what one's
    /// cache held stands for the other's objects. Clusters without a kept config: unknown.
    pub(crate) fn same_endpoint(&self, other: &Self) -> bool {
        match (&self.inner.config, &other.inner.config) {
            (Some(a), Some(b)) => a.cluster_url == b.cluster_url,
            _ => false,
        }
    }

    /// The current engagement.
    fn session(&self) -> Option<Arc<Session>> {
        lock(&self.inner.attachment).session.clone()
    }

    /// Lists a watch of `kind` for `config` that `owner` (a controller) runs itself among
    /// this engagement's caches, for [`Cluster::cache_status`] and readiness, until the
    /// report is dropped; `None` if the cluster is not engaged.
    pub(crate) fn report_watch(
        &self,
        kind: String,
        owner: &str,
        config: &watcher::Config,
    ) -> Option<reported::Report> {
        let session = self.session()?;
        Some(reported::Report::start(
            session,
            ClusterField(&self.inner.id).to_string(),
            kind,
            owner,
            config,
        ))
    }

    /// How a single-cluster controller watches its primary kind `K` for `config`, its own
    /// reflector store being `reflector`: see [`Primary`]. A cluster fed by a shared source
    /// (a namespace of a host) is watched apart.
    pub(crate) fn claim_primary<K: Watchable>(
        &self,
        dt: &K::DynamicType,
        config: &watcher::Config,
        reflector: &kube_runtime::reflector::Store<K>,
    ) -> Primary<K> {
        let Some(session) = self.session() else {
            return Primary::Apart;
        };
        if self.inner.source.is_some() {
            return Primary::Apart;
        }
        session.claim_primary(
            Arc::from(ClusterField(&self.inner.id).to_string()),
            dt,
            config,
            reflector,
            &self.inner.indexers,
        )
    }

    /// The current engagement, with the cluster.
    pub(crate) fn engagement(&self) -> Option<Engagement<C>> {
        self.session().map(|session| Engagement {
            cluster: self.clone(),
            session,
        })
    }

    /// A fleet takes the cluster on: the first starts an engagement, later ones share it.
    pub(crate) fn attach(&self, settings: &WatchSettings) -> Engagement<C> {
        let mut attachment = lock(&self.inner.attachment);
        attachment.fleets += 1;
        let session = attachment
            .session
            .get_or_insert_with(|| {
                // The first engagement sets the client's defaults and starts its metrics.
                let state = &self.inner.client_state;
                state.inherit(settings.rate_limit);
                if let Some(metrics) = &settings.metrics {
                    let label = ClusterField(&self.inner.id).to_string();
                    // client-go's `host`: the server's authority, as the config names it.
                    let host = self
                        .inner
                        .config
                        .as_ref()
                        .and_then(|c| c.cluster_url.authority().map(ToString::to_string))
                        .unwrap_or_default();
                    state.measure(metrics, label, Arc::from(host));
                }
                Arc::new(Session::new(settings.clone()))
            })
            .clone();
        Engagement {
            cluster: self.clone(),
            session,
        }
    }

    /// A fleet lets go of the cluster: the last ends the engagement (its watches stop) and
    /// gets it back, to await its tasks.
    pub(crate) fn detach(&self) -> Option<Arc<Session>> {
        let mut attachment = lock(&self.inner.attachment);
        attachment.fleets = attachment.fleets.saturating_sub(1);
        if attachment.fleets > 0 {
            return None;
        }
        let session = attachment.session.take()?;
        session.token.cancel();
        self.inner.client_state.unmeasure();
        Some(session)
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
        let Some(session) = self.session() else {
            return;
        };
        // Filling an index runs the user's extractor over the cache: not under the lock.
        let watches: Vec<_> = lock(&session.watches)
            .iter()
            .filter(|(key, _)| key.kind == indexer.kind())
            .map(|(_, watch)| watch.clone())
            .collect();
        for watch in watches {
            watch.add_indexer(indexer);
        }
    }

    /// Whether each cache of the current engagement has listed, and why not: for readiness
    /// checks and diagnostics. Controllers park the requests of a cluster whose primary cache
    /// has not listed (a missing CRD, a forbidden kind, an unreachable server) and release
    /// them when it does. Empty if the cluster is not engaged.
    pub fn cache_status(&self) -> Vec<CacheStatus> {
        let Some(session) = self.session() else {
            return Vec::new();
        };
        let timeout = session.settings.sync_timeout;
        let mut status: Vec<CacheStatus> = lock(&session.watches)
            .iter()
            .map(|(key, watch)| {
                let (synced, error, listing) = match watch.state() {
                    WatchState::Listing { error } => (false, error, true),
                    WatchState::Synced { error } => (true, error, false),
                    WatchState::Stopped { failure } => (false, failure, false),
                };
                CacheStatus {
                    kind: watch.kind(),
                    // secrets-lint: a watcher::Config (selectors), not a client's.
                    config: format!("{:?}", key.config),
                    synced,
                    error,
                    overdue: listing
                        && timeout.is_some_and(|timeout| watch.started().elapsed() >= timeout),
                    last_event: watch.activity().last_event(),
                    failures: watch.activity().failures(),
                }
            })
            .collect();
        status.sort_by(|a, b| (&a.kind, &a.config).cmp(&(&b.kind, &b.config)));
        status
    }

    /// The resource serving the kind `gvk` in this cluster (its plural, for
    /// [`Builder::new_with`](crate::Builder::new_with) and the other `_with` calls with a
    /// [`DynamicObject`](kube::api::DynamicObject)), found by API discovery. Kinds of one name
    /// may be served in some clusters of a fleet and not in others: ask each.
    ///
    /// ```no_run
    /// # use multicluster_runtime::{Cluster, ClusterName};
    /// # use kube::api::{DynamicObject, GroupVersionKind};
    /// # use kube::runtime::watcher;
    /// # async fn f(cluster: Cluster<ClusterName>) -> Result<(), Box<dyn std::error::Error>> {
    /// let gvk = GroupVersionKind::gvk("example.com", "v1", "Widget");
    /// let widgets = cluster.discover(&gvk).await?;
    /// let cache = cluster.cache_with::<DynamicObject>(&widgets, &watcher::Config::default()).await?;
    /// # Ok(()) }
    /// ```
    pub async fn discover(
        &self,
        gvk: &kube::api::GroupVersionKind,
    ) -> Result<kube::api::ApiResource, DiscoveryError> {
        let kind = format!("{}/{}/{}", gvk.group, gvk.version, gvk.kind);
        let cluster = self.inner.id.to_string();
        match kube::discovery::pinned_kind(&self.client(), gvk).await {
            Ok((resource, _)) => Ok(resource),
            Err(kube::Error::Discovery(_)) => Err(DiscoveryError::NotServed { cluster, kind }),
            Err(kube::Error::Api(status)) if status.code == 404 => {
                Err(DiscoveryError::NotServed { cluster, kind })
            }
            Err(source) => Err(DiscoveryError::Failed {
                cluster,
                kind,
                source,
            }),
        }
    }

    /// The store of `K` objects matching `config`, started on first use and shared
    /// by every controller of this process that asks for the same type and configuration.
    ///
    /// It returns at once, so the store may not have listed yet (it is empty then): a
    /// reconciler that decides from what is missing ("no child yet, create one") must use
    /// [`Cluster::cache`], which waits for the listing. The controllers' own lookups of their
    /// primary objects always wait.
    pub fn store<K: Watchable>(&self, config: &watcher::Config) -> Result<Store<K>, CacheError>
    where
        K::DynamicType: Default,
    {
        self.store_with(&K::DynamicType::default(), config)
    }

    /// [`Cluster::store`] for a kind known at run time: `dt` is its dynamic type (an
    /// [`ApiResource`](kube::api::ApiResource) for a `DynamicObject`).
    pub fn store_with<K: Watchable>(
        &self,
        dt: &K::DynamicType,
        config: &watcher::Config,
    ) -> Result<Store<K>, CacheError> {
        Ok(self.watch::<K>(dt, config)?.store.clone())
    }

    /// The cache of `K` objects matching `config` once its first listing is in: started on
    /// first use, shared like [`Cluster::store`], and awaitable by any number of tasks at once
    /// (controller-runtime's cache reads block the same way until the informer has synced).
    ///
    /// Waits as long as the cluster is engaged and the listing does not succeed (an
    /// unreachable server, a forbidden kind, a CRD not installed yet). Fails at once if the
    /// cluster is not engaged, and when it is disengaged meanwhile. In a reconcile, prefer
    /// [`Cluster::cache_within`]: a reconcile waiting here holds its controller's slot for as
    /// long as a CRD stays missing.
    ///
    /// ```no_run
    /// # use multicluster_runtime::{Cluster, ClusterName};
    /// # use k8s_openapi::api::core::v1::Secret;
    /// # use kube::runtime::{reflector::ObjectRef, watcher};
    /// # async fn f(cluster: Cluster<ClusterName>) -> Result<(), multicluster_runtime::CacheError> {
    /// let secrets = cluster.cache::<Secret>(&watcher::Config::default()).await?;
    /// let missing = secrets.store().get(&ObjectRef::new("tls").within("default")).is_none();
    /// # Ok(()) }
    /// ```
    pub async fn cache<K: Watchable>(
        &self,
        config: &watcher::Config,
    ) -> Result<Cache<K>, CacheError>
    where
        K::DynamicType: Default,
    {
        self.cache_with(&K::DynamicType::default(), config).await
    }

    /// [`Cluster::cache`], waiting at most `within`: then [`CacheError::NotSynced`], with why
    /// the listing fails (`the server could not find the requested resource` for a CRD not
    /// installed). The cache goes on trying; a later call finds it listed once it has.
    ///
    /// ```no_run
    /// # use std::time::Duration;
    /// # use multicluster_runtime::{CacheError, Cluster, ClusterName};
    /// # use k8s_openapi::api::core::v1::Secret;
    /// # use kube::runtime::watcher;
    /// # async fn f(cluster: Cluster<ClusterName>) -> Result<(), CacheError> {
    /// let secrets = cluster
    ///     .cache_within::<Secret>(&watcher::Config::default(), Duration::from_secs(10))
    ///     .await?;
    /// # Ok(()) }
    /// ```
    pub async fn cache_within<K: Watchable>(
        &self,
        config: &watcher::Config,
        within: std::time::Duration,
    ) -> Result<Cache<K>, CacheError>
    where
        K::DynamicType: Default,
    {
        self.cache_with_within(&K::DynamicType::default(), config, within)
            .await
    }

    /// [`Cluster::cache_within`] for a kind known at run time.
    pub async fn cache_with_within<K: Watchable>(
        &self,
        dt: &K::DynamicType,
        config: &watcher::Config,
        within: std::time::Duration,
    ) -> Result<Cache<K>, CacheError> {
        let watch = self.watch::<K>(dt, config)?;
        match tokio::time::timeout(within, watch.synced()).await {
            Ok(synced) => synced.map(|()| Cache::new(watch)),
            Err(_) => Err(CacheError::NotSynced {
                cluster: ClusterField(&self.inner.id).to_string(),
                kind: watch.kind().to_string(),
                waited: within,
                reason: match watch.state() {
                    watch::WatchState::Listing { error } | watch::WatchState::Synced { error } => {
                        error
                    }
                    watch::WatchState::Stopped { failure } => failure,
                },
            }),
        }
    }

    /// [`Cluster::cache`] for a kind known at run time: `dt` is its dynamic type (an
    /// [`ApiResource`](kube::api::ApiResource) for a `DynamicObject`). In a cluster that does
    /// not serve the kind, it waits (like a CRD not installed yet) until the cluster does.
    pub async fn cache_with<K: Watchable>(
        &self,
        dt: &K::DynamicType,
        config: &watcher::Config,
    ) -> Result<Cache<K>, CacheError> {
        let watch = self.watch::<K>(dt, config)?;
        watch.synced().await?;
        Ok(Cache::new(watch))
    }

    /// The changes of the shared watch of `K` objects matching `config` (started on first
    /// use), from every object it holds now on.
    pub(crate) fn changes<K: Watchable>(
        &self,
        dt: &K::DynamicType,
        config: &watcher::Config,
    ) -> Result<
        impl futures::Stream<Item = crate::cache::watch::Change<K>> + Send + use<K, C>,
        CacheError,
    > {
        Ok(self.watch::<K>(dt, config)?.subscribe())
    }

    /// The shared watch of `K` objects matching `config` in the current engagement.
    fn watch<K: Watchable>(
        &self,
        dt: &K::DynamicType,
        config: &watcher::Config,
    ) -> Result<Arc<SharedWatch<K>>, CacheError> {
        let session = self.session().ok_or_else(|| CacheError::NotEngaged {
            cluster: ClusterField(&self.inner.id).to_string(),
        })?;
        self.watch_in(&session, dt, config)
    }

    /// The shared watch of `K` objects matching `config` in `session`; started on first use.
    /// It is restricted to the namespaces the manager's settings give `K`.
    fn watch_in<K: Watchable>(
        &self,
        session: &Session,
        dt: &K::DynamicType,
        config: &watcher::Config,
    ) -> Result<Arc<SharedWatch<K>>, CacheError> {
        let key = WatchKey::of::<K>(dt, config);
        let mut watches = lock(&session.watches);
        if let Some(existing) = watches.get(&key).cloned()
            && let Ok(watch) = existing.as_any().downcast::<SharedWatch<K>>()
        {
            return Ok(watch);
        }
        if !session.is_active() {
            return Err(CacheError::NotEngaged {
                cluster: ClusterField(&self.inner.id).to_string(),
            });
        }
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| CacheError::NoRuntime {
            cluster: ClusterField(&self.inner.id).to_string(),
        })?;
        let stop = session.token.child_token();
        let transform = session.settings.transforms.of::<K>();
        // Logs and errors name the single cluster `single`, as its spans do.
        let cluster: Arc<str> = Arc::from(ClusterField(&self.inner.id).to_string());
        let namespaces = session.settings.namespaces.of::<K>(dt);
        let events = match &self.inner.source {
            None => {
                let options = listing::WatchOptions {
                    streaming: !session.settings.paged_lists,
                    trim: transform.as_ref().is_some_and(transform::Transform::strips),
                    cluster: cluster.clone(),
                };
                let events = listing::shared(
                    listing::Target::<K>::all(self.requester(), dt),
                    namespaces,
                    config.clone(),
                    &options,
                    &session.settings.backoff,
                    transform,
                );
                // A kind whose CRD a bundle installs lists once the CRD is established,
                // rather than failing (and warning) until it is.
                let crd = format!("{}.{}", K::plural(dt), K::group(dt));
                let waits = !K::group(dt).is_empty()
                    && session
                        .settings
                        .established
                        .read()
                        .unwrap_or_else(|e| e.into_inner())
                        .contains(&crd);
                let gate =
                    waits.then(|| established(self.client(), cluster.clone(), crd, stop.clone()));
                let gate = futures::stream::iter(gate)
                    .then(|wait| wait)
                    .filter_map(|()| std::future::ready(None));
                Either::Left(gate.chain(events))
            }
            Some(source) => Either::Right(
                source::events_from::<K>(
                    &**source,
                    dt,
                    config,
                    transform,
                    &session.settings,
                    &session.token,
                )
                .map(Ok),
            ),
        };
        let indexers = lock(&self.inner.indexers).clone();
        let (watch, task) = SharedWatch::start(
            events,
            dt,
            cluster,
            stop,
            &indexers,
            session.settings.faults.clone(),
            session.settings.sync_timeout,
            &runtime,
        );
        {
            let mut tasks = lock(&session.tasks);
            tasks.retain(|t| !t.is_finished());
            tasks.push(task);
        }
        watches.insert(key, watch.clone());
        Ok(watch)
    }
}

/// Completes once the CRD `name` is `Established` in the cluster of `client`, when `stop` is
/// cancelled, or at once when the CRD cannot be read (forbidden: the watch then finds out by
/// itself whether its kind is served).
async fn established(
    client: Client,
    cluster: Arc<str>,
    name: String,
    stop: tokio_util::sync::CancellationToken,
) {
    let path = format!("/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}");
    let mut said = false;
    // Twice a second at first, then less often, up to every 5 s.
    let mut wait = std::time::Duration::from_millis(500);
    loop {
        let Ok(request) = http::Request::get(&path).body(Vec::new()) else {
            return;
        };
        match client.request::<serde_json::Value>(request).await {
            Ok(crd) if crd_established(&crd) => return,
            Ok(_) => {}
            Err(kube::Error::Api(status)) if status.code == 401 || status.code == 403 => return,
            Err(_) => {}
        }
        if !said {
            tracing::debug!(%cluster, crd = %name, "watch waits for its CRD to be established");
            said = true;
        }
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(wait) => {}
        }
        wait = (wait * 2).min(std::time::Duration::from_secs(5));
    }
}

/// Whether a CRD (as JSON) says `Established=True`.
pub(crate) fn crd_established(crd: &serde_json::Value) -> bool {
    crd.pointer("/status/conditions")
        .and_then(|c| c.as_array())
        .is_some_and(|conditions| {
            conditions.iter().any(|c| {
                c.get("type").and_then(|t| t.as_str()) == Some("Established")
                    && c.get("status").and_then(|s| s.as_str()) == Some("True")
            })
        })
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A renamed cluster shares its client: the client's spans name the cluster by its
    /// latest name (the one the fleet and the reconcile spans use).
    #[tokio::test]
    async fn a_renamed_clusters_requests_are_named_after_it() {
        let client = Client::new(
            tower::service_fn(|_: http::Request<kube::client::Body>| async {
                Ok::<_, std::convert::Infallible>(http::Response::new(kube::client::Body::empty()))
            }),
            "default",
        );
        let inner = Cluster::new(ClusterName::from("member-a"), client);
        assert_eq!(
            inner.inner.client_state.named().as_deref(),
            Some("member-a")
        );
        let _outer = inner.renamed(ClusterName::from("prefix/member-a"));
        assert_eq!(
            inner.inner.client_state.named().as_deref(),
            Some("prefix/member-a")
        );
    }
}
