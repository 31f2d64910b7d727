//! [`Manager`]: runs a provider and the controllers that follow its fleet.

mod campaign;
mod run;
mod signals;
mod term;

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::cache::Fault;
use crate::cache::WatchBackoff;
use crate::cluster::Cluster;
use crate::fleet::Fleet;
use crate::lease::leader::{InvalidLeaderElection, LeaderElection};
use crate::lease::tenure::Tenure;
use crate::metrics::Metrics;
use crate::provider::{Provider, ProviderError};
use crate::serve::Endpoints;
use crate::util::sync::lock;

use crate::run::component::{Component, Standby};
pub(crate) use crate::run::component::{ControllerFactory, Task};

/// What a running manager is told.
enum Job<C: crate::cluster::ClusterId> {
    /// A task from [`Manager::add`].
    Task(Task),
    /// A controller was added to the list: start it if controllers are running.
    Controller,
    /// A component was added: start it.
    Component(Arc<dyn Component<C>>),
}

/// Runs a [`Provider`], holds the engaged clusters (its [`Fleet`]) and the optional local
/// (host) cluster, and runs controllers until shutdown.
///
/// Controllers are built with [`Builder`](crate::Builder); they can be added before
/// [`Manager::run`] or while it runs, and each one reconciles every cluster engaged before or
/// after it started.
///
/// A manager can run again after a run returned (leader election stops it when the lease is
/// lost and starts it when it is won again): each run starts the provider and every
/// controller afresh, with the same provider, and when a run returns nothing it started runs
/// on. A second `Manager` on the same provider works too.
pub struct Manager<P: Provider> {
    provider: Arc<P>,
    fleet: Fleet<P::Id>,
    local: Option<Cluster<P::Id>>,
    /// The token of the current (or next) run.
    shutdown: Mutex<CancellationToken>,
    graceful_timeout: Duration,
    backoff: WatchBackoff,
    /// Controllers from [`Builder::start`](crate::Builder::start), started in every run, and
    /// whether each is leader-only.
    controllers: Mutex<Vec<(ControllerFactory<P::Id>, bool)>>,
    /// What runs beside the controllers for the whole of every run, on every replica: the
    /// endpoints, the webhook server, the sharding coordinator, the warm standby of
    /// controllers that have one (with leader election).
    components: Mutex<Vec<Arc<dyn Component<P::Id>>>>,
    /// While running, where new controllers, components and tasks are announced; otherwise
    /// `None`.
    running: Mutex<Option<mpsc::UnboundedSender<Job<P::Id>>>>,
    /// Controllers run only while this replica holds the lease, if set.
    leader_election: Option<LeaderElection>,
    /// Replicas split the fleet, if set.
    sharding: Option<crate::shard::Sharding>,
    /// What the sharding coordinator of the current run last saw.
    shard_status: Arc<Mutex<Option<crate::shard::ShardStatus>>>,
    /// Where fleet controllers answer for their queues (the diagnostics view).
    diagnostics: Arc<crate::diagnostics::Controllers<P::Id>>,
    /// The endpoints serve the diagnostics view: controllers keep what it shows.
    diagnosed: bool,
    metrics: Option<Metrics>,
    rate_limit: Option<crate::client::RateLimit>,
    /// Shared with every run's watches and controllers.
    transforms: Arc<crate::cache::Transforms>,
    /// The namespaces each kind is watched in.
    namespaces: Arc<crate::cache::namespaces::NamespaceScopes>,
    /// The CRDs installed bundles bring, whose kinds' watches wait for them.
    established: Arc<std::sync::RwLock<std::collections::BTreeSet<String>>>,
    /// How long before a cluster's credential ends it is warned about.
    credential_lead: Arc<Mutex<Duration>>,
    /// Watches list in pages, never by streaming lists.
    paged_lists: bool,
    /// A watch not listed within this long is reported.
    cache_sync_timeout: Duration,
    /// Where the endpoints are served in the current run.
    served_at: Arc<Mutex<Option<std::net::SocketAddr>>>,
    /// The admission webhooks, if any.
    webhooks: Option<Arc<crate::webhook::install::Runtime<P::Id>>>,
    /// Where the webhooks are served in the current run, and their server's state.
    webhooks_at: Arc<Mutex<Option<std::net::SocketAddr>>>,
    /// While controllers may run (leading, or running without leader election), the token
    /// that ends their term.
    leading: tokio::sync::watch::Sender<Option<CancellationToken>>,
    /// Tasks from [`Manager::add`] waiting for the next run.
    pending: Mutex<Vec<Task>>,
}

/// Why [`Manager::run`] failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ManagerError {
    /// The provider returned an error.
    #[error("provider failed: {0}")]
    Provider(#[source] ProviderError),
    /// A controller panicked; the manager shut down.
    #[error("a controller panicked: {0}")]
    ControllerPanicked(String),
    /// A cluster's watch stopped for good (user code, such as a field index extractor,
    /// panicked in it); the manager shut down rather than run on with a frozen cache.
    #[error("{0}")]
    WatchFailed(Fault),
    /// `run` was called while a run was going on.
    #[error("the manager is already running")]
    AlreadyRunning,
    /// The leader election settings cannot work.
    #[error("{0}")]
    InvalidLeaderElection(#[source] InvalidLeaderElection),
    /// The sharding settings cannot work.
    #[error("{0}")]
    InvalidSharding(#[source] crate::shard::InvalidSharding),
    /// The sharding coordinator stopped (it panicked): the run ended rather than go on
    /// without anything keeping this replica's share.
    #[error("the sharding coordinator stopped: {0}")]
    ShardingFailed(String),
    /// The endpoints' settings cannot work ([`Manager::serve`]): a certificate file that
    /// cannot be used, or secure endpoints without a cluster to check tokens with.
    #[error("the endpoints cannot be served: {0}")]
    Endpoints(String),
    /// The webhooks' settings cannot work ([`Manager::webhooks`]): a name Kubernetes would
    /// refuse, a URL that is not https, no host for the certificates' Secret.
    #[error("the webhooks cannot be served: {0}")]
    Webhooks(String),
    /// The endpoints could not listen on their address ([`Manager::serve`]).
    #[error("cannot serve the endpoints on {addr}: {error}")]
    Serve {
        /// The address.
        addr: std::net::SocketAddr,
        /// Why.
        #[source]
        error: std::io::Error,
    },
    /// A second signal stopped the run at once ([`Manager::run_until_signal`]): reconciles
    /// in flight were dropped, not awaited, and a lease held was not given up (it expires
    /// on its own).
    #[error("stopped at once by a second signal ({signal}), without waiting for reconciles")]
    ForcedStop {
        /// The second signal (`SIGTERM`, `SIGINT`).
        signal: &'static str,
    },
    /// The process's signals could not be listened to ([`Manager::run_until_signal`]).
    #[error("cannot listen for signals: {0}")]
    Signals(#[source] std::io::Error),
    /// This replica lost its lease (with [`OnLoss::Exit`](crate::OnLoss::Exit)); its controllers were stopped
    /// without waiting for reconciles in flight.
    #[error("leadership of lease {lease} lost: {reason}")]
    LeadershipLost {
        /// The lease, as `namespace/name`.
        lease: String,
        /// Why.
        reason: String,
    },
}

impl<P: Provider> std::fmt::Debug for Manager<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Manager")
            .field("fleet", &self.fleet)
            .field("local", &self.local)
            .finish_non_exhaustive()
    }
}

/// The default bound on how long shutdown waits for reconciles in flight.
pub const DEFAULT_GRACEFUL_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a cache may take to list before it is reported, by default (controller-runtime's
/// `CacheSyncTimeout` default); see [`Manager::cache_sync_timeout`].
pub const DEFAULT_CACHE_SYNC_TIMEOUT: Duration = Duration::from_secs(120);

/// How long before a cluster's credential ends a WARN line says so, by default; see
/// [`Manager::credential_warning`].
pub const DEFAULT_CREDENTIAL_LEAD: Duration = Duration::from_secs(7 * 24 * 3600);

impl<P: Provider> Manager<P> {
    /// A manager for `provider`, with no local cluster, a graceful-shutdown bound of
    /// [`DEFAULT_GRACEFUL_TIMEOUT`] and the default [`WatchBackoff`].
    pub fn new(provider: P) -> Self {
        let credential_lead = Arc::new(Mutex::new(DEFAULT_CREDENTIAL_LEAD));
        let lead = credential_lead.clone();
        let manager = Self {
            credential_lead,
            provider: Arc::new(provider),
            fleet: Fleet::new(),
            local: None,
            shutdown: Mutex::new(CancellationToken::new()),
            graceful_timeout: DEFAULT_GRACEFUL_TIMEOUT,
            backoff: WatchBackoff::default(),
            controllers: Mutex::new(Vec::new()),
            components: Mutex::new(Vec::new()),
            running: Mutex::new(None),
            pending: Mutex::new(Vec::new()),
            leader_election: None,
            sharding: None,
            shard_status: Arc::default(),
            diagnostics: Arc::default(),
            diagnosed: false,
            metrics: None,
            rate_limit: None,
            transforms: Arc::default(),
            namespaces: Arc::default(),
            established: Arc::default(),
            paged_lists: false,
            cache_sync_timeout: DEFAULT_CACHE_SYNC_TIMEOUT,
            served_at: Arc::default(),
            webhooks: None,
            webhooks_at: Arc::default(),
            leading: tokio::sync::watch::Sender::new(None),
        };
        // The credentials' ends, shown in every run (a gauge, a WARN line).
        manager.add_controller(
            false,
            Arc::new(move |env| {
                let lead = *lock(&lead);
                Box::pin(crate::run::credentials::watch(env, lead))
            }),
        );
        manager
    }

    /// Runs controllers only while this replica holds the Lease `election` names (on the
    /// host cluster); the provider and tasks from [`Manager::add`] run on every replica. See
    /// [`LeaderElection`] for the protocol and [`Manager::elected`] for work of your own that
    /// must run on the leader only.
    #[must_use]
    pub fn leader_election(mut self, election: LeaderElection) -> Self {
        self.leader_election = Some(election);
        self
    }

    /// Splits the fleet between the replicas of `sharding`'s group: each replica builds
    /// watches and caches, and reconciles, only for the clusters it owns (it holds their fence
    /// Lease), while its provider still discovers them all. Controllers and per-cluster tasks
    /// run on every replica, each on its share; controllers built with
    /// [`Builder::leader_only`](crate::Builder::leader_only) run on the replica holding the
    /// [`Manager::leader_election`] Lease. Reach clusters another replica owns through
    /// [`Fleet::discovered`]. See [`Sharding`](crate::Sharding) for the protocol; needs a
    /// fleet provider (not `SingleProvider`).
    #[must_use]
    pub fn sharding(mut self, sharding: crate::shard::Sharding) -> Self {
        self.register(Arc::new(crate::shard::ShardingComponent {
            sharding: sharding.clone(),
            status: self.shard_status.clone(),
        }));
        self.sharding = Some(sharding);
        self
    }

    /// What this replica's sharding saw and held at its last round, while a sharded run goes
    /// on; `None` otherwise.
    pub fn shard_status(&self) -> Option<crate::shard::ShardStatus> {
        lock(&self.shard_status).clone()
    }

    /// Keeps Prometheus metrics of the controllers, the fleet and the leader election in
    /// `metrics`; see [`Metrics`] for the series.
    #[must_use]
    pub fn metrics(mut self, metrics: Metrics) -> Self {
        self.metrics = Some(metrics);
        self
    }

    /// Limits the API requests of each cluster's client the manager engages (the local
    /// cluster's too) to `limit`, unless the cluster has a limit of its own
    /// ([`Cluster::with_rate_limit`](crate::Cluster::with_rate_limit)); every provider's
    /// clusters take it. Default: no limit, as kube-rs.
    #[must_use]
    pub fn client_rate_limit(mut self, limit: crate::client::RateLimit) -> Self {
        self.rate_limit = Some(limit);
        self
    }

    /// Transforms each `K` object before the caches of the manager's clusters keep it (after
    /// the default, see [`Manager::keep_managed_fields`]); a later call for the same kind
    /// replaces the transform. The object is transformed once per watch, and reconcilers, field
    /// indexes and predicates see it transformed: drop what they do not read (large
    /// `data`, status details). Set it before the first cluster is engaged: watches started
    /// earlier keep what they had.
    #[must_use]
    pub fn transform<K: crate::cache::Watchable>(
        mut self,
        transform: impl Fn(&mut K) + Send + Sync + 'static,
    ) -> Self
    where
        // Transforms are kept by Rust type: one for every kind a `DynamicObject` stands for
        // would run on all of them.
        K::DynamicType: Default,
    {
        Arc::make_mut(&mut self.transforms).set(transform);
        self
    }

    /// Caches keep objects whole. By default they drop `metadata.managedFields` and the
    /// `kubectl.kubernetes.io/last-applied-configuration` annotation, which reconcilers
    /// rarely read and which are most of a small object's memory; see
    /// [`strip_managed_fields`](crate::strip_managed_fields). Objects a reconciler fetches
    /// through its client are never transformed.
    #[must_use]
    pub fn keep_managed_fields(mut self) -> Self {
        Arc::make_mut(&mut self.transforms).keep_managed_fields = true;
        self
    }

    /// Watches and caches of namespaced kinds, in every cluster, look only at `namespaces`
    /// (an empty list: at all of them, the default): a controller whose RBAC grants it some
    /// namespaces only can run. Controllers, relations and [`Cluster::cache`] reads all use
    /// the same restricted watches; a reconcile never sees an object from elsewhere. With
    /// several namespaces each has its own watch (and its own failures: a forbidden
    /// namespace keeps the cache from syncing, as a forbidden kind does), merged into one
    /// cache that lists once every namespace has listed. Cluster-scoped kinds are watched
    /// whole; [`Manager::namespaces_for`] sets a kind apart. controller-runtime's
    /// `cache.Options.DefaultNamespaces`, for every cluster of the fleet.
    ///
    /// Set it before the first cluster is engaged: watches started earlier keep their scope.
    /// The namespace provider's clusters are namespaces already: this narrows the host
    /// watches they share.
    ///
    /// [`Cluster::cache`]: crate::Cluster::cache
    #[must_use]
    pub fn namespaces(mut self, namespaces: impl IntoIterator<Item = impl Into<String>>) -> Self {
        let set = crate::cache::namespaces::NamespaceScopes::set(namespaces);
        Arc::make_mut(&mut self.namespaces).set_default(set);
        self
    }

    /// Watches and caches of `K` look only at `namespaces` (an empty list: at all of them),
    /// whatever [`Manager::namespaces`] says for other kinds (controller-runtime's
    /// `cache.Options.ByObject`). A later call for the same kind replaces the earlier.
    #[must_use]
    pub fn namespaces_for<K: crate::cache::Watchable>(
        self,
        namespaces: impl IntoIterator<Item = impl Into<String>>,
    ) -> Self
    where
        K::DynamicType: Default,
    {
        self.namespaces_for_resource::<K>(&K::DynamicType::default(), namespaces)
    }

    /// [`Manager::namespaces_for`] for a kind known at run time (a `DynamicObject` with the
    /// [`ApiResource`](kube::api::ApiResource) `dt`). A kind known only at run time is
    /// restricted only this way, since its scope is not known before a server is asked.
    #[must_use]
    pub fn namespaces_for_resource<K: crate::cache::Watchable>(
        mut self,
        dt: &K::DynamicType,
        namespaces: impl IntoIterator<Item = impl Into<String>>,
    ) -> Self {
        let set = crate::cache::namespaces::NamespaceScopes::set(namespaces);
        Arc::make_mut(&mut self.namespaces).set_for(&K::group(dt), &K::kind(dt), set);
        self
    }

    /// Watches make their first listing (and every relist) in pages of list requests. By
    /// default they ask for a streaming list (a watch whose first events are the current
    /// objects: one object decoded at a time instead of a page of 500 held twice) and fall
    /// back to pages, per watch, where the API server does not serve streaming lists
    /// (kube-apiserver before 1.27, or with the `WatchList` feature gate off, as in 1.33).
    /// A watcher configuration that asks for streaming lists itself
    /// ([`watcher::Config::streaming_lists`](kube_runtime::watcher::Config::streaming_lists))
    /// gets them regardless, without the fallback.
    #[must_use]
    pub fn paged_lists(mut self) -> Self {
        self.paged_lists = true;
        self
    }

    /// How long a cache (a watch of one kind in one cluster) may take to list before it is
    /// reported: default [`DEFAULT_CACHE_SYNC_TIMEOUT`], 2 minutes, controller-runtime's
    /// `CacheSyncTimeout`. A cache past it is named in a WARN line (cluster, kind, the
    /// watch's last error), in [`Cluster::cache_status`](crate::Cluster::cache_status)
    /// (`overdue`), in `/readyz?verbose` and in `multicluster_runtime_watch_sync_overdue`.
    ///
    /// Unlike controller-runtime, where a controller whose caches do not sync in time fails
    /// and stops the manager, nothing stops: in a fleet one cluster's missing CRD, refused
    /// credentials or unreachable server must not stop the others, and a restart would list
    /// again the same way. The watch keeps trying with its backoff, requests for its objects
    /// wait (other clusters' are served), and the reports clear when it lists. Readiness is
    /// as before: the host's caches count, members' only with
    /// [`Endpoints::strict`](crate::Endpoints::strict).
    #[must_use]
    pub fn cache_sync_timeout(mut self, timeout: Duration) -> Self {
        self.cache_sync_timeout = timeout;
        self
    }

    /// Serves `/metrics`, `/healthz`, `/readyz` and the diagnostics view while the manager
    /// runs (on every replica, leading or not); see [`Endpoints`].
    #[must_use]
    pub fn serve(mut self, endpoints: Endpoints) -> Self {
        self.diagnosed = true;
        self.register(Arc::new(crate::serve::EndpointsComponent {
            endpoints,
            served_at: self.served_at.clone(),
            view: crate::serve::ViewSources {
                shard: shard_source(self.shard_status.clone()),
                credential_lead: self.credential_lead.clone(),
                leading: self.leading.subscribe(),
            },
        }));
        self
    }

    /// Serves admission webhooks while the manager runs, on every replica, and installs
    /// their configurations where [`Webhooks::install`](crate::webhook::Webhooks::install)
    /// says: in every engaged cluster by default, by the leader (with leader election) or by
    /// each cluster's owner (with sharding). See [`webhook`](crate::webhook). The settings
    /// are checked when the run starts ([`ManagerError::Webhooks`]).
    #[must_use]
    pub fn webhooks(mut self, webhooks: crate::webhook::Webhooks<P::Id>) -> Self {
        let runtime = Arc::new(crate::webhook::install::Runtime {
            webhooks,
            keeper: std::sync::OnceLock::new(),
            secret: std::sync::OnceLock::new(),
            recorder: std::sync::OnceLock::new(),
        });
        self.webhooks = Some(runtime.clone());
        self.register(Arc::new(crate::webhook::WebhookServer {
            runtime: runtime.clone(),
            served_at: self.webhooks_at.clone(),
        }));
        self.add_controller(
            false,
            Arc::new(move |env| Box::pin(crate::webhook::install_task(env, runtime.clone()))),
        );
        self
    }

    /// The address the webhooks listen on in the current run (the port chosen, if the
    /// address had port 0); `None` when not running or not serving webhooks.
    pub fn webhooks_served_at(&self) -> Option<std::net::SocketAddr> {
        *lock(&self.webhooks_at)
    }

    /// The URL `cluster`'s API server is given for `webhook` (a hook's name), once the
    /// webhooks' route key is loaded: for configurations you write yourself
    /// ([`Install::Nothing`](crate::webhook::Install::Nothing)). `None` before that, or
    /// without webhooks.
    pub fn webhook_url(&self, cluster: &P::Id, webhook: &str) -> Option<String> {
        let runtime = self.webhooks.as_ref()?;
        let served = runtime.keeper.get()?.served()?;
        let side = if self.local.as_ref().is_some_and(|l| l.id() == cluster) {
            crate::webhook::route::Side::Host
        } else {
            crate::webhook::route::Side::Fleet
        };
        Some(runtime.url(&served.route, side, &cluster.to_string(), webhook))
    }

    /// The CA bundle the webhooks' configurations carry (PEM), once loaded.
    pub fn webhook_ca_bundle(&self) -> Option<String> {
        let runtime = self.webhooks.as_ref()?;
        Some(runtime.keeper.get()?.served()?.bundle.to_string())
    }

    /// The address the endpoints listen on in the current run (the port chosen, if the
    /// address had port 0); `None` when not running or not serving.
    pub fn served_at(&self) -> Option<std::net::SocketAddr> {
        *lock(&self.served_at)
    }

    /// Completes once controllers may run: this replica leads (with leader election), or a
    /// run has started (without); like controller-runtime's `Elected()`. The token it returns
    /// is cancelled when that ends (the lease lost, or the run shutting down): leader-only
    /// work of your own stops on it.
    ///
    /// ```no_run
    /// # use multicluster_runtime::{Manager, providers::Clusters, ClusterName};
    /// # async fn f(manager: std::sync::Arc<Manager<Clusters<ClusterName>>>) {
    /// let m = manager.clone();
    /// manager.add(async move {
    ///     let shutdown = m.shutdown_token();
    ///     while !shutdown.is_cancelled() {
    ///         let term = m.elected().await;
    ///         // Leader-only work here, until the term ends.
    ///         term.cancelled().await;
    ///     }
    /// });
    /// # }
    /// ```
    pub async fn elected(&self) -> CancellationToken {
        let mut leading = self.leading.subscribe();
        let term = leading
            .wait_for(Option::is_some)
            .await
            .ok()
            .and_then(|term| term.clone());
        match term {
            Some(term) => term,
            // The sender lives as long as the manager.
            None => std::future::pending().await,
        }
    }

    /// Whether controllers run now: this replica leads, or (without leader election) a run
    /// is going on.
    pub fn is_leader(&self) -> bool {
        self.leading.borrow().is_some()
    }

    /// Sets the local (host) cluster, the one the controller runs in or is configured for.
    /// Controllers engage it when built with [`Builder::engage_local`](crate::Builder::engage_local);
    /// it is engaged while the manager runs.
    #[must_use]
    pub fn with_local(mut self, cluster: Cluster<P::Id>) -> Self {
        self.local = Some(cluster);
        self
    }

    /// How long shutdown waits for reconciles in flight (and the provider's own cleanup)
    /// before dropping them; in both modes.
    #[must_use]
    pub fn graceful_timeout(mut self, timeout: Duration) -> Self {
        self.graceful_timeout = timeout;
        self
    }

    /// How the watches of every cluster (and of single-cluster controllers) retry after a
    /// failure; see [`WatchBackoff`] for the default.
    #[must_use]
    pub fn watch_backoff(mut self, backoff: WatchBackoff) -> Self {
        self.backoff = backoff;
        self
    }

    /// The provider.
    pub fn provider(&self) -> &P {
        &self.provider
    }

    /// The engaged clusters.
    pub fn fleet(&self) -> &Fleet<P::Id> {
        &self.fleet
    }

    /// The engaged cluster with this id, or the local cluster if it has this id.
    pub fn cluster(&self, id: &P::Id) -> Option<Cluster<P::Id>> {
        match &self.local {
            Some(local) if local.id() == id => Some(local.clone()),
            _ => self.fleet.get(id),
        }
    }

    /// Every engaged cluster (not including the local cluster).
    pub fn clusters(&self) -> Vec<Cluster<P::Id>> {
        self.fleet.clusters()
    }

    /// The local (host) cluster, if set.
    pub fn local(&self) -> Option<&Cluster<P::Id>> {
        self.local.as_ref()
    }

    /// Registers a field index on `K` objects in every cluster, present and future, and in
    /// the local cluster; see [`Fleet::index_field`].
    pub fn index_field<K: crate::cache::Watchable>(
        &self,
        name: &str,
        extract: impl Fn(&K) -> Vec<String> + Send + Sync + 'static,
    ) where
        // Indexes are kept by Rust type (see `Manager::transform`).
        K::DynamicType: Default,
    {
        let extract = Arc::new(extract);
        if let Some(local) = &self.local {
            let extract = extract.clone();
            local.add_indexer(&crate::cache::Indexer::new::<K>(name, move |k: &K| {
                extract(k)
            }));
        }
        self.fleet.index_field::<K>(name, move |k: &K| extract(k));
    }

    /// The token that stops the current run (or the next one, if none is going on) when
    /// cancelled. Each run gets a new one once the previous run has returned.
    pub fn shutdown_token(&self) -> CancellationToken {
        lock(&self.shutdown).clone()
    }

    /// Stops the manager: controllers stop taking work, let reconciles in flight finish
    /// (bounded by the graceful timeout), and [`Manager::run`] returns.
    pub fn shutdown(&self) {
        lock(&self.shutdown).cancel();
    }

    /// What a controller run by hand ([`Builder::run`](crate::Builder::run)) gets: the
    /// current (or next) run's shutdown, never aborted.
    pub(crate) fn env(&self) -> crate::run::Env<P::Id> {
        self.term_env(
            self.shutdown_token(),
            CancellationToken::new(),
            Arc::new(Tenure::always()),
        )
    }

    /// What controllers of one term get: `stop` ends the term, `abort` drops reconciles in
    /// flight instead of awaiting them.
    fn term_env(
        &self,
        stop: CancellationToken,
        abort: CancellationToken,
        tenure: Arc<Tenure>,
    ) -> crate::run::Env<P::Id> {
        crate::run::Env {
            fleet: self.fleet.clone(),
            local: self.local.clone(),
            shutdown: stop,
            grace: crate::run::Grace {
                timeout: self.graceful_timeout,
                abort,
            },
            backoff: self.backoff.clone(),
            metrics: self.metrics.clone(),
            transforms: self.transforms.clone(),
            namespaces: self.namespaces.clone(),
            paged_lists: self.paged_lists,
            instance: Arc::from(match (&self.sharding, &self.leader_election) {
                (Some(sharding), _) => sharding.identity.clone(),
                (None, Some(election)) => election.identity.clone(),
                (None, None) => crate::lease::leader::host_name(),
            }),
            tenure,
            diagnostics: self.diagnosed.then(|| self.diagnostics.clone()),
        }
    }

    /// Runs `task` with the manager: in the current run, or in the next one if none is going
    /// on. It runs once; when the run ends it is dropped after the graceful timeout if it has
    /// not finished by then (select on [`Manager::shutdown_token`] to end it sooner).
    pub fn add(&self, task: impl Future<Output = ()> + Send + 'static) {
        let task: Task = Box::pin(task);
        let running = lock(&self.running);
        let task = match &*running {
            Some(tx) => match tx.send(Job::Task(task)) {
                Ok(()) => return,
                Err(mpsc::error::SendError(Job::Task(task))) => task,
                Err(mpsc::error::SendError(_)) => return,
            },
            None => task,
        };
        lock(&self.pending).push(task);
    }

    /// How long before an engaged cluster's credential ends a WARN line names the cluster
    /// and when ([`DEFAULT_CREDENTIAL_LEAD`], a week, by default). The end is read where the
    /// crate can ([`Cluster::credential_expiry`](crate::Cluster::credential_expiry)) at each
    /// engagement and every minute, and shown with
    /// [`metrics`](Self::metrics) as `multicluster_runtime_credential_expiry_seconds`.
    pub fn credential_warning(self, lead: Duration) -> Self {
        *lock(&self.credential_lead) = lead;
        self
    }

    /// Installs `bundle` in every cluster of the fleet: in each engaged cluster, and in each
    /// new one as it is engaged. Its CRDs are applied first; the watches of their kinds, in
    /// that cluster, wait until they are `Established` instead of failing until they are.
    /// Then its other objects are applied. An object changed or deleted by anyone is applied
    /// again at once (its watch sees it), and the whole bundle every
    /// [`reapply_every`](crate::bootstrap::Bundle::reapply_every). When a cluster leaves for
    /// good, the bundle's objects are removed from it only if
    /// [`remove_on_departure`](crate::bootstrap::Bundle::remove_on_departure) says so.
    ///
    /// It writes to members, so nothing is installed unless called. Like controllers, it runs
    /// on the leader only when leader election is on (with sharding, on the replica that owns
    /// the cluster). The identity needs, in each member: get, list, watch, create and patch
    /// of the bundle's kinds (CRDs included), and delete of them for removal. A cluster where
    /// an apply fails is tried again (1 s, doubling to a minute) with a WARN line naming it;
    /// the other clusters go on. The book's chapter "Bootstrapping members" says more.
    pub fn install(&self, bundle: crate::bootstrap::Bundle) {
        self.established
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .extend(bundle.crd_names());
        let installer = Arc::new(crate::bootstrap::Installer::new(bundle));
        self.add_controller(
            false,
            Arc::new(move |env| Box::pin(installer.clone().run(env))),
        );
    }

    /// Adds a controller: started in the current run (if any) and in every later one.
    /// Runs `task` once per engagement of each provider cluster, in this run and every
    /// later one: started when the cluster is engaged (and again for the cluster that
    /// replaces it under the same id), handed the cluster and a token cancelled when that
    /// engagement ends or the manager shuts down; it gets the graceful timeout to return
    /// after that. For per-cluster background work that must stop with its cluster: a
    /// health probe, a cache warmer, a per-cluster informer of your own (Go's
    /// `multicluster.Aware` components). Like controllers, it runs on the leader only when
    /// leader election is on (with sharding, on the replica that owns the cluster), and,
    /// like a reconcile, it starts only while this replica's tenure holds: an engagement
    /// that comes while a renewal is overdue waits for the next one. Once started, the
    /// task is told of a lost tenure through `until` as soon as the term ends; a task that
    /// writes where another replica must not should also stop at its own deadline, as
    /// [`Context::still_owned`](crate::Context::still_owned) says for reconciles. A panic
    /// ends that cluster's task only. `name` is for logs.
    ///
    /// ```no_run
    /// # use multicluster_runtime::{providers::Clusters, ClusterName, Manager};
    /// let manager = Manager::new(Clusters::<ClusterName>::new());
    /// manager.per_cluster("version-probe", |cluster, until| async move {
    ///     loop {
    ///         if let Ok(version) = cluster.client().apiserver_version().await {
    ///             tracing::info!(cluster = %cluster.id(), version = %version.git_version);
    ///         }
    ///         tokio::select! {
    ///             () = until.cancelled() => return,
    ///             () = tokio::time::sleep(std::time::Duration::from_secs(60)) => {}
    ///         }
    ///     }
    /// });
    /// ```
    pub fn per_cluster<F, Fut>(&self, name: &str, task: F)
    where
        F: Fn(Cluster<P::Id>, CancellationToken) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let task = crate::run::cluster_task::boxed(task);
        let name: Arc<str> = Arc::from(name);
        self.add_controller(
            false,
            Arc::new(move |env| {
                Box::pin(crate::run::cluster_task::run(
                    env,
                    name.clone(),
                    task.clone(),
                ))
            }),
        );
    }

    /// Adds a controller's warm standby: started at the beginning of every run with leader
    /// election (and in the current one), on every replica. Without leader election there
    /// is nothing to wait for: it is not kept.
    pub(crate) fn add_warmer(&self, factory: ControllerFactory<P::Id>) {
        if self.leader_election.is_none() {
            return;
        }
        let component: Arc<dyn Component<P::Id>> = Arc::new(Standby(factory));
        let running = lock(&self.running);
        lock(&self.components).push(component.clone());
        if let Some(tx) = &*running {
            let _ = tx.send(Job::Component(component));
        }
    }

    /// Registers `component` for every run, in place of one of the same name (the endpoints,
    /// the webhooks and the sharding are set once; setting them again replaces them).
    fn register(&mut self, component: Arc<dyn Component<P::Id>>) {
        let components = self.components.get_mut().unwrap_or_else(|e| e.into_inner());
        components.retain(|c| c.name() != component.name());
        components.push(component);
    }

    pub(crate) fn add_controller(&self, leader_only: bool, factory: ControllerFactory<P::Id>) {
        let running = lock(&self.running);
        lock(&self.controllers).push((factory, leader_only));
        if let Some(tx) = &*running {
            let _ = tx.send(Job::Controller);
        }
    }
}

impl<P: Provider> Drop for Manager<P> {
    fn drop(&mut self) {
        lock(&self.shutdown).cancel();
    }
}

/// The diagnostics view's reading of the sharding coordinator's last status: this replica's
/// side and the owner of each cluster named.
fn shard_source(
    status: Arc<Mutex<Option<crate::shard::ShardStatus>>>,
) -> crate::serve::ShardSource {
    Arc::new(move |names: &[&str]| {
        let status = lock(&status);
        let status = status.as_ref()?;
        let mut peers = status.peers.clone();
        // In one order, to compare with other replicas' (each sees itself last).
        peers.sort();
        let view = crate::diagnostics::ShardView {
            identity: status.identity.clone(),
            peers,
            discovered: status.discovered,
            held: status.holding.clone(),
        };
        Some((view, status.owners(names.iter().copied())))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::providers::Clusters;
    use crate::run::component::{Failure, Running, Stage, Start};

    #[tokio::test]
    async fn a_panicking_controller_stops_the_manager_with_an_error() {
        let manager = Manager::new(Clusters::<crate::cluster::ClusterName>::new());
        manager.add(async { panic!("controller bug") });
        let result = tokio::time::timeout(Duration::from_secs(10), manager.run())
            .await
            .unwrap();
        assert!(
            matches!(result, Err(ManagerError::ControllerPanicked(ref m)) if m.contains("controller bug")),
            "{result:?}"
        );
    }

    #[tokio::test]
    async fn run_refuses_a_concurrent_run_and_runs_again_after_it_returned() {
        let manager = Arc::new(Manager::new(Clusters::<crate::cluster::ClusterName>::new()));
        let runs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        for _ in 0..2 {
            let counter = runs.clone();
            manager.add(async move {
                counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            });
            let run = tokio::spawn({
                let manager = manager.clone();
                async move { manager.run().await }
            });
            while runs.load(std::sync::atomic::Ordering::SeqCst) == 0 {
                tokio::task::yield_now().await;
            }
            assert!(matches!(
                manager.run().await,
                Err(ManagerError::AlreadyRunning)
            ));
            manager.shutdown();
            tokio::time::timeout(Duration::from_secs(10), run)
                .await
                .unwrap()
                .unwrap()
                .unwrap();
            runs.store(0, std::sync::atomic::Ordering::SeqCst);
        }
    }

    /// A component that writes down when it starts (and which readiness checks it was
    /// handed) and when it ends. One of [`Stage::Admission`] ends only once the fleet is
    /// closed: a run that awaited it before closing the fleet would never return.
    struct Recorder {
        name: &'static str,
        stage: Stage,
        log: Arc<Mutex<Vec<String>>>,
        /// What it ends with, once told to stop (or at once, for [`Stage::Work`]: when the
        /// run's shutdown comes).
        ends_with: Result<(), &'static str>,
        /// Refuses to start with this.
        refuses: Option<&'static str>,
    }

    impl Recorder {
        fn new(name: &'static str, stage: Stage, log: &Arc<Mutex<Vec<String>>>) -> Self {
            Self {
                name,
                stage,
                log: log.clone(),
                ends_with: Ok(()),
                refuses: None,
            }
        }
    }

    impl Component<crate::cluster::ClusterName> for Recorder {
        fn name(&self) -> &'static str {
            self.name
        }

        fn stage(&self) -> Stage {
            self.stage
        }

        fn prepare<'a>(
            &'a self,
            _: Option<&'a Cluster<crate::cluster::ClusterName>>,
        ) -> crate::run::component::BoxFuture<'a, Result<Start<crate::cluster::ClusterName>, Failure>>
        {
            let (name, stage, log, ends_with) =
                (self.name, self.stage, self.log.clone(), self.ends_with);
            Box::pin(async move {
                if let Some(reason) = self.refuses {
                    return Err(Failure::Endpoints(reason.into()));
                }
                let start: Start<crate::cluster::ClusterName> = Box::new(move |starting| {
                    let seen: Vec<&str> = starting.ready.iter().map(|(n, _)| n.as_str()).collect();
                    lock(&log).push(format!("start {name}, seeing {seen:?}"));
                    starting.ready.push((name.into(), Arc::new(|| Ok(()))));
                    let fleet = starting.env.fleet.clone();
                    let stop = match stage {
                        Stage::Work => starting.env.shutdown.clone(),
                        _ => CancellationToken::new(),
                    };
                    let stopped = stop.clone();
                    Running::spawn(
                        stop,
                        async move {
                            if ends_with.is_ok() {
                                stopped.cancelled().await;
                            }
                            if stage == Stage::Admission {
                                while !fleet.is_closed() {
                                    tokio::time::sleep(Duration::from_millis(1)).await;
                                }
                            }
                            let closed = fleet.is_closed();
                            lock(&log).push(format!("end {name}, fleet closed: {closed}"));
                            ends_with.map_err(|reason| Failure::Sharding(reason.into()))
                        },
                        Failure::Panicked,
                    )
                });
                Ok(start)
            })
        }
    }

    fn position(log: &[String], prefix: &str) -> usize {
        log.iter()
            .position(|line| line.starts_with(prefix))
            .unwrap_or_else(|| panic!("no {prefix:?} in {log:?}"))
    }

    #[tokio::test]
    async fn components_start_in_stage_order_and_stop_stage_by_stage_around_the_fleets_close() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let mut manager = Manager::new(Clusters::<crate::cluster::ClusterName>::new());
        // Registered out of order: the run orders them by stage.
        for (name, stage) in [
            ("serving", Stage::Serving),
            ("admission", Stage::Admission),
            ("work", Stage::Work),
            ("membership", Stage::Membership),
        ] {
            manager.register(Arc::new(Recorder::new(name, stage, &log)));
        }
        let manager = Arc::new(manager);
        let run = tokio::spawn({
            let manager = manager.clone();
            async move { manager.run().await }
        });
        while lock(&log).len() < 4 {
            tokio::task::yield_now().await;
        }
        manager.shutdown();
        tokio::time::timeout(Duration::from_secs(10), run)
            .await
            .expect("the run awaited a component of Stage::Admission before closing the fleet")
            .unwrap()
            .unwrap();
        let log = lock(&log).clone();
        assert_eq!(
            log[..4],
            [
                r#"start work, seeing []"#,
                r#"start membership, seeing ["work"]"#,
                r#"start admission, seeing ["work", "membership"]"#,
                r#"start serving, seeing ["work", "membership", "admission"]"#,
            ],
            "{log:?}"
        );
        assert_eq!(log.len(), 8, "{log:?}");
        for (name, closed) in [
            ("work", false),
            ("membership", false),
            ("admission", true),
            ("serving", true),
        ] {
            let line = &log[position(&log, &format!("end {name},"))];
            assert_eq!(line, &format!("end {name}, fleet closed: {closed}"));
        }
        // The work is drained before the membership is told to stop, and the endpoints go
        // after everything else.
        assert!(
            position(&log, "end work") < position(&log, "end membership"),
            "{log:?}"
        );
        assert!(
            position(&log, "end admission") < position(&log, "end serving"),
            "{log:?}"
        );
        assert!(
            position(&log, "end membership") < position(&log, "end serving"),
            "{log:?}"
        );
    }

    #[tokio::test]
    async fn a_component_that_fails_ends_the_run_with_its_error_and_the_others_stop() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let mut manager = Manager::new(Clusters::<crate::cluster::ClusterName>::new());
        manager.register(Arc::new(Recorder::new("serving", Stage::Serving, &log)));
        manager.register(Arc::new(Recorder {
            ends_with: Err("the coordinator's bug"),
            ..Recorder::new("membership", Stage::Membership, &log)
        }));
        let result = tokio::time::timeout(Duration::from_secs(10), manager.run())
            .await
            .unwrap();
        assert!(
            matches!(&result, Err(ManagerError::ShardingFailed(reason)) if reason == "the coordinator's bug"),
            "{result:?}"
        );
        let log = lock(&log).clone();
        assert!(
            log.contains(&"end serving, fleet closed: true".to_string()),
            "{log:?}"
        );
        assert!(lock(&manager.running).is_none());
    }

    #[tokio::test]
    async fn a_component_that_cannot_start_refuses_the_run_before_anything_starts() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let mut manager = Manager::new(Clusters::<crate::cluster::ClusterName>::new());
        manager.register(Arc::new(Recorder::new("work", Stage::Work, &log)));
        manager.register(Arc::new(Recorder {
            refuses: Some("no certificate"),
            ..Recorder::new("serving", Stage::Serving, &log)
        }));
        let result = tokio::time::timeout(Duration::from_secs(10), manager.run())
            .await
            .unwrap();
        assert!(
            matches!(&result, Err(ManagerError::Endpoints(reason)) if reason == "no certificate"),
            "{result:?}"
        );
        assert!(lock(&log).is_empty(), "{:?}", lock(&log));
        // Refused, not half-run: the manager can run again (and is refused again).
        assert!(lock(&manager.running).is_none());
        assert!(matches!(
            manager.run().await,
            Err(ManagerError::Endpoints(_))
        ));
    }

    /// A provider with cleanup to do after shutdown.
    struct Cleans(Arc<std::sync::atomic::AtomicBool>);

    impl Provider for Cleans {
        type Id = crate::cluster::ClusterName;

        async fn run(
            &self,
            _: Fleet<crate::cluster::ClusterName>,
            shutdown: CancellationToken,
        ) -> Result<(), ProviderError> {
            shutdown.cancelled().await;
            // Cleanup that takes a moment (deregistering, closing connections).
            tokio::task::yield_now().await;
            self.0.store(true, std::sync::atomic::Ordering::SeqCst);
            Ok(())
        }
    }

    #[tokio::test]
    async fn the_provider_finishes_its_cleanup_before_run_returns() {
        let cleaned = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let manager = Arc::new(Manager::new(Cleans(cleaned.clone())));
        let run = tokio::spawn({
            let manager = manager.clone();
            async move { manager.run().await }
        });
        tokio::task::yield_now().await;
        manager.shutdown();
        run.await.unwrap().unwrap();
        assert!(cleaned.load(std::sync::atomic::Ordering::SeqCst));
    }

    #[tokio::test]
    async fn a_run_that_is_dropped_lets_the_manager_run_again() {
        let manager = Manager::new(Clusters::<crate::cluster::ClusterName>::new());
        assert!(
            tokio::time::timeout(Duration::from_millis(50), manager.run())
                .await
                .is_err(),
            "still running when dropped"
        );
        // The dropped run closed its fleet: nothing is engaged into a fleet no run serves
        // (its watches would report to a run that is gone).
        let cluster = Cluster::from_config(
            crate::cluster::ClusterName::new("late"),
            kube::Config::new("https://127.0.0.1:1".parse().unwrap()),
        )
        .unwrap();
        assert!(matches!(
            manager.fleet().engage(cluster.clone()),
            Err(crate::fleet::EngageError::Stopped { .. })
        ));
        assert!(!cluster.is_engaged());
        manager.shutdown();
        tokio::time::timeout(Duration::from_secs(10), manager.run())
            .await
            .unwrap()
            .unwrap();
    }

    /// `manager`'s run, spawned, once its controllers may run.
    async fn running(
        manager: &Arc<Manager<Clusters<crate::cluster::ClusterName>>>,
    ) -> tokio::task::JoinHandle<Result<(), ManagerError>> {
        let run = {
            let manager = manager.clone();
            tokio::spawn(async move { manager.run().await })
        };
        tokio::time::timeout(Duration::from_secs(10), manager.elected())
            .await
            .unwrap();
        run
    }

    #[tokio::test]
    async fn endpoints_that_cannot_listen_fail_the_run_naming_the_address() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = taken.local_addr().unwrap();
        let manager = Manager::new(Clusters::<crate::cluster::ClusterName>::new())
            .serve(crate::serve::Endpoints::new(addr).plain_http());
        let result = manager.run().await;
        assert!(
            matches!(&result, Err(ManagerError::Serve { addr: a, .. }) if *a == addr),
            "{result:?}"
        );
        assert!(result.unwrap_err().to_string().contains(&addr.to_string()));
        // The failed run left nothing behind: once the port is free, it runs.
        drop(taken);
        let manager = Arc::new(manager);
        let run = running(&manager).await;
        assert_eq!(manager.served_at(), Some(addr));
        manager.shutdown();
        run.await.unwrap().unwrap();
    }

    #[tokio::test]
    async fn without_leader_election_a_run_is_elected_from_its_start_to_its_end() {
        let manager = Arc::new(Manager::new(Clusters::<crate::cluster::ClusterName>::new()));
        assert!(!manager.is_leader());
        let run = running(&manager).await;
        assert!(manager.is_leader());
        manager.shutdown();
        run.await.unwrap().unwrap();
        assert!(!manager.is_leader());
    }

    #[tokio::test(start_paused = true)]
    async fn tasks_that_ignore_shutdown_are_dropped_after_the_graceful_timeout() {
        let manager = Manager::new(Clusters::<crate::cluster::ClusterName>::new())
            .graceful_timeout(Duration::from_secs(5));
        let dropped = Arc::new(std::sync::atomic::AtomicBool::new(false));
        struct Flag(Arc<std::sync::atomic::AtomicBool>);
        impl Drop for Flag {
            fn drop(&mut self) {
                self.0.store(true, std::sync::atomic::Ordering::SeqCst);
            }
        }
        let flag = Flag(dropped.clone());
        manager.add(async move {
            let _flag = flag;
            std::future::pending::<()>().await;
        });
        manager.shutdown();
        manager.run().await.unwrap();
        assert!(dropped.load(std::sync::atomic::Ordering::SeqCst));
    }
}
