//! [`Manager`]: runs a provider and the controllers that follow its fleet.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;

use crate::cluster::{Fault, WatchSettings};
use crate::leader::{Attempt, Elector, InvalidLeaderElection, LeaderElection, OnLoss};
use crate::metrics::Metrics;
use crate::serve::Endpoints;
use crate::sync::lock;
use crate::tenure::Tenure;
use crate::{Cluster, Fleet, Provider, ProviderError, WatchBackoff};

type Task = Pin<Box<dyn Future<Output = ()> + Send + 'static>>;

/// What a running manager is told.
enum Job {
    /// A task from [`Manager::add`].
    Task(Task),
    /// A controller was added to the list: start it if controllers are running.
    Controller,
}

/// What a run hands each controller it starts.
pub(crate) type ControllerFactory<C> = Arc<dyn Fn(crate::controller::Env<C>) -> Task + Send + Sync>;

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
    /// While running, where new controllers and tasks are announced; otherwise `None`.
    running: Mutex<Option<mpsc::UnboundedSender<Job>>>,
    /// Controllers run only while this replica holds the lease, if set.
    leader_election: Option<LeaderElection>,
    /// Replicas split the fleet, if set.
    sharding: Option<crate::Sharding>,
    /// What the sharding coordinator of the current run last saw.
    shard_status: Arc<Mutex<Option<crate::ShardStatus>>>,
    metrics: Option<Metrics>,
    rate_limit: Option<crate::RateLimit>,
    /// Shared with every run's watches and controllers.
    transforms: Arc<crate::cluster::Transforms>,
    /// The namespaces each kind is watched in.
    namespaces: Arc<crate::cluster::namespaces::NamespaceScopes>,
    /// Watches list in pages, never by streaming lists.
    paged_lists: bool,
    endpoints: Option<Endpoints>,
    /// Where the endpoints are served in the current run.
    served_at: Mutex<Option<std::net::SocketAddr>>,
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
    /// This replica lost its lease (with [`OnLoss::Exit`]); its controllers were stopped
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

impl<P: Provider> Manager<P> {
    /// A manager for `provider`, with no local cluster, a graceful-shutdown bound of
    /// [`DEFAULT_GRACEFUL_TIMEOUT`] and the default [`WatchBackoff`].
    pub fn new(provider: P) -> Self {
        Self {
            provider: Arc::new(provider),
            fleet: Fleet::new(),
            local: None,
            shutdown: Mutex::new(CancellationToken::new()),
            graceful_timeout: DEFAULT_GRACEFUL_TIMEOUT,
            backoff: WatchBackoff::default(),
            controllers: Mutex::new(Vec::new()),
            running: Mutex::new(None),
            pending: Mutex::new(Vec::new()),
            leader_election: None,
            sharding: None,
            shard_status: Arc::default(),
            metrics: None,
            rate_limit: None,
            transforms: Arc::default(),
            namespaces: Arc::default(),
            paged_lists: false,
            endpoints: None,
            served_at: Mutex::new(None),
            leading: tokio::sync::watch::Sender::new(None),
        }
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
    pub fn sharding(mut self, sharding: crate::Sharding) -> Self {
        self.sharding = Some(sharding);
        self
    }

    /// What this replica's sharding saw and held at its last round, while a sharded run goes
    /// on; `None` otherwise.
    pub fn shard_status(&self) -> Option<crate::ShardStatus> {
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
    pub fn client_rate_limit(mut self, limit: crate::RateLimit) -> Self {
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
    pub fn transform<K: crate::Watchable>(
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
        let set = crate::cluster::namespaces::NamespaceScopes::set(namespaces);
        Arc::make_mut(&mut self.namespaces).set_default(set);
        self
    }

    /// Watches and caches of `K` look only at `namespaces` (an empty list: at all of them),
    /// whatever [`Manager::namespaces`] says for other kinds (controller-runtime's
    /// `cache.Options.ByObject`). A later call for the same kind replaces the earlier.
    #[must_use]
    pub fn namespaces_for<K: crate::Watchable>(
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
    pub fn namespaces_for_resource<K: crate::Watchable>(
        mut self,
        dt: &K::DynamicType,
        namespaces: impl IntoIterator<Item = impl Into<String>>,
    ) -> Self {
        let set = crate::cluster::namespaces::NamespaceScopes::set(namespaces);
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

    /// Serves `/metrics`, `/healthz` and `/readyz` while the manager runs (on every replica,
    /// leading or not); see [`Endpoints`].
    #[must_use]
    pub fn serve(mut self, endpoints: Endpoints) -> Self {
        self.endpoints = Some(endpoints);
        self
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

    /// The TLS settings (`None`: plain HTTP) and the token checker (`None`: everyone may
    /// ask) of `endpoints`.
    #[allow(clippy::type_complexity)]
    fn endpoint_security(
        &self,
        endpoints: &Endpoints,
    ) -> Result<
        (
            Option<Arc<rustls::ServerConfig>>,
            Option<Arc<crate::serve::Authorizer>>,
        ),
        ManagerError,
    > {
        if endpoints.plain {
            return Ok((None, None));
        }
        let client = match (&endpoints.authorizer, &self.local) {
            (Some(client), _) => client.clone(),
            (None, Some(local)) => local.client(),
            (None, None) => {
                return Err(ManagerError::Endpoints(
                    "HTTPS endpoints check tokens with a host cluster: give one with Endpoints::authorize_with or Manager::with_local, or serve plain HTTP with Endpoints::plain_http".into(),
                ));
            }
        };
        let certificates = crate::serve::Certificates::load(endpoints.tls.clone())
            .map_err(ManagerError::Endpoints)?;
        let tls = certificates
            .server_config()
            .map_err(ManagerError::Endpoints)?;
        Ok((Some(tls), Some(crate::serve::Authorizer::new(client))))
    }

    /// The local (host) cluster, if set.
    pub fn local(&self) -> Option<&Cluster<P::Id>> {
        self.local.as_ref()
    }

    /// Registers a field index on `K` objects in every cluster, present and future, and in
    /// the local cluster; see [`Fleet::index_field`].
    pub fn index_field<K: crate::Watchable>(
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
            local.add_indexer(&crate::cluster::Indexer::new::<K>(name, move |k: &K| {
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
    pub(crate) fn env(&self) -> crate::controller::Env<P::Id> {
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
    ) -> crate::controller::Env<P::Id> {
        crate::controller::Env {
            fleet: self.fleet.clone(),
            local: self.local.clone(),
            shutdown: stop,
            grace: crate::controller::Grace {
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
                (None, None) => crate::leader::host_name(),
            }),
            tenure,
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
                Err(mpsc::error::SendError(Job::Controller)) => return,
            },
            None => task,
        };
        lock(&self.pending).push(task);
    }

    /// Adds a controller: started in the current run (if any) and in every later one.
    /// Runs `task` once per engagement of each provider cluster, in this run and every
    /// later one: started when the cluster is engaged (and again for the cluster that
    /// replaces it under the same id), handed the cluster and a token cancelled when that
    /// engagement ends or the manager shuts down; it gets the graceful timeout to return
    /// after that. For per-cluster background work that must stop with its cluster: a
    /// health probe, a cache warmer, a per-cluster informer of your own (Go's
    /// `multicluster.Aware` components). Like controllers, it runs on the leader only when
    /// leader election is on. A panic ends that cluster's task only. `name` is for logs.
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
        let task = crate::per_cluster::boxed(task);
        let name: Arc<str> = Arc::from(name);
        self.add_controller(
            false,
            Arc::new(move |env| Box::pin(crate::per_cluster::run(env, name.clone(), task.clone()))),
        );
    }

    pub(crate) fn add_controller(&self, leader_only: bool, factory: ControllerFactory<P::Id>) {
        let running = lock(&self.running);
        lock(&self.controllers).push((factory, leader_only));
        if let Some(tx) = &*running {
            let _ = tx.send(Job::Controller);
        }
    }

    /// [`Manager::run`] until the process gets SIGTERM or SIGINT (Ctrl-C), then a graceful
    /// shutdown (kube-runtime's `shutdown_on_signal`): reconciles in flight get the graceful
    /// timeout, a leader gives its lease up. A second signal during that stops at once:
    /// everything is dropped without waiting (the lease then expires on its own), and the
    /// run returns [`ManagerError::ForcedStop`], telling it apart from a clean stop.
    pub async fn run_until_signal(&self) -> Result<(), ManagerError> {
        // Listening before the run starts: a signal from then on is never the default
        // action (the process killed).
        let mut signals = Signals::listen().map_err(ManagerError::Signals)?;
        let run = self.run();
        tokio::pin!(run);
        tokio::select! {
            result = &mut run => return result,
            signal = signals.next() => {
                tracing::info!(%signal, "signal received: shutting down gracefully (a second one stops at once)");
                self.shutdown();
            }
        }
        tokio::select! {
            result = &mut run => result,
            signal = signals.next() => {
                tracing::warn!(%signal, "second signal: stopping now, without waiting for reconciles");
                Err(ManagerError::ForcedStop { signal })
            }
        }
    }

    /// Runs the provider and every controller until [`Manager::shutdown`], a provider error,
    /// a panicking controller or a failed watch; then shuts down within the graceful
    /// timeout and returns. When it returns, every task it started has ended (tasks still
    /// running at the deadline are dropped), every cluster is disengaged and its watches have
    /// stopped; the manager can run again.
    ///
    /// With [`Manager::leader_election`], controllers run only while this replica holds the
    /// lease: they start when it is won and stop when it is lost (reconciles in flight are
    /// dropped then, not awaited), and the run returns
    /// [`ManagerError::LeadershipLost`] or campaigns again, as [`OnLoss`] says. A graceful
    /// shutdown keeps renewing until the controllers have stopped, then gives the lease up.
    pub async fn run(&self) -> Result<(), ManagerError> {
        let election = match &self.leader_election {
            Some(election) => {
                election
                    .validate()
                    .map_err(ManagerError::InvalidLeaderElection)?;
                Some(election.clone())
            }
            None => None,
        };
        let sharding = match &self.sharding {
            Some(sharding) => {
                sharding.validate().map_err(ManagerError::InvalidSharding)?;
                if self.provider.single().is_some() {
                    return Err(ManagerError::InvalidSharding(
                        crate::shard::InvalidSharding {
                            reason: "a single-cluster provider has nothing to split",
                            ..sharding.invalid()
                        },
                    ));
                }
                if election.is_none() && lock(&self.controllers).iter().any(|(_, l)| *l) {
                    return Err(ManagerError::InvalidSharding(
                        crate::shard::InvalidSharding {
                            reason: "a leader-only controller needs Manager::leader_election",
                            ..sharding.invalid()
                        },
                    ));
                }
                Some(sharding.clone())
            }
            None => None,
        };
        let (jobs_tx, mut jobs_rx) = mpsc::unbounded_channel();
        let shutdown = {
            let mut running = lock(&self.running);
            if running.is_some() {
                return Err(ManagerError::AlreadyRunning);
            }
            *running = Some(jobs_tx);
            self.shutdown_token()
        };
        // If the run is dropped before it returns (or the provider panics), what it started
        // is stopped without waiting and the manager can run again.
        let mut abandoned = Abandoned {
            manager: self,
            armed: true,
        };
        // Checked and bound before anything starts; a failure ends the run (the guard
        // cleans up).
        let security = match &self.endpoints {
            Some(endpoints) => Some(self.endpoint_security(endpoints)?),
            None => None,
        };
        let listener = match &self.endpoints {
            Some(endpoints) => Some(
                tokio::net::TcpListener::bind(endpoints.addr)
                    .await
                    .map_err(|error| ManagerError::Serve {
                        addr: endpoints.addr,
                        error,
                    })?,
            ),
            None => None,
        };
        let (faults_tx, mut faults_rx) = mpsc::unbounded_channel();
        let settings = WatchSettings {
            backoff: self.backoff.clone(),
            faults: Some(faults_tx),
            metrics: self.metrics.clone(),
            rate_limit: self.rate_limit,
            transforms: self.transforms.clone(),
            paged_lists: self.paged_lists,
            namespaces: self.namespaces.clone(),
        };
        self.fleet.open(settings.clone(), sharding.is_some());
        if let Some(metrics) = &self.metrics {
            // The watch gauges read this manager's clusters at scrape time (one source per
            // manager: a later run replaces its own).
            let (fleet, local) = (self.fleet.clone(), self.local.clone());
            metrics.watch_source(self.fleet.key(), move || {
                local
                    .iter()
                    .cloned()
                    .chain(fleet.clusters())
                    .map(|cluster| {
                        let id = crate::cluster::ClusterField(cluster.id()).to_string();
                        (id, cluster.cache_status())
                    })
                    .collect()
            });
        }
        // A single-cluster provider's cluster is engaged before any controller starts, so a
        // reconciler's `cache()` of it never finds it unengaged (the provider engages it too;
        // that is then `Unchanged`).
        if let Some(single) = self.provider.single()
            && let Err(error) = self.fleet.engage(single)
        {
            tracing::warn!(%error, "could not engage the provider's cluster");
        }
        let local = self.local.as_ref().map(|local| local.attach(&settings));

        let mut tasks = JoinSet::new();
        for task in lock(&self.pending).drain(..) {
            tasks.spawn(task);
        }
        let endpoints_stop = CancellationToken::new();
        let server = match (listener, &self.endpoints, security) {
            (Some(listener), Some(endpoints), Some((tls, authorizer))) => {
                let addr = listener.local_addr().ok();
                *lock(&self.served_at) = addr;
                let scheme = if tls.is_some() { "https" } else { "http" };
                tracing::info!(addr = ?addr, scheme, "serving /metrics, /healthz and /readyz");
                let host = self.local.clone().or_else(|| {
                    self.provider
                        .single()
                        .and_then(|single| self.fleet.get(single.id()))
                });
                let served = Arc::new(crate::serve::Served {
                    fleet: self.fleet.clone(),
                    host,
                    local: self.local.clone(),
                    endpoints: endpoints.clone(),
                    authorizer,
                    stopping: shutdown.clone(),
                });
                Some(AbortOnDropHandle::new(tokio::spawn(crate::serve::serve(
                    listener,
                    tls,
                    served,
                    endpoints_stop.clone(),
                ))))
            }
            _ => None,
        };
        // Sharded: every controller but the leader-only ones runs from the start, each on this
        // replica's share, which the coordinator keeps in the fleet.
        // The leader's controllers start nothing past the lease's renew deadline (unbounded
        // without an election), the sharded ones nothing past the fences'.
        let lease_tenure = Arc::new(match election {
            Some(_) => Tenure::ended(),
            None => Tenure::always(),
        });
        let fence_tenure = Arc::new(Tenure::ended());
        let mut term = Term::new(
            match (&sharding, &election) {
                (None, _) => Scope::All,
                (Some(_), Some(_)) => Scope::LeaderOnly,
                // Refused above; one added later is never started (and said so).
                (Some(_), None) => Scope::Nothing,
            },
            lease_tenure.clone(),
        );
        let mut shared_term = Term::new(Scope::Sharded, fence_tenure.clone());
        let coordinator_stop = CancellationToken::new();
        let mut coordinator = sharding.map(|sharding| {
            shared_term.begin(self, &shutdown);
            let coordinator = crate::shard::Coordinator::new(
                sharding,
                self.fleet.clone(),
                self.metrics.as_ref(),
                self.shard_status.clone(),
                fence_tenure.clone(),
            );
            AbortOnDropHandle::new(tokio::spawn(
                coordinator.run(coordinator_stop.clone(), shutdown.clone()),
            ))
        });
        // Leadership: without an election, controllers run from the start.
        let (leadership_tx, mut leadership) = mpsc::unbounded_channel();
        let campaign_stop = CancellationToken::new();
        let campaign = match &election {
            Some(election) => Some(AbortOnDropHandle::new(tokio::spawn(campaign(
                Elector::new(election.clone()),
                leadership_tx,
                campaign_stop.clone(),
                lease_tenure.clone(),
            )))),
            None => {
                let _ = leadership_tx.send(Leadership::Acquired);
                None
            }
        };
        let lease = election
            .as_ref()
            .map(|e| format!("{}/{}", e.namespace, e.name))
            .unwrap_or_default();
        let mut campaigning = true;
        let mut coordinating = coordinator.is_some();
        let provider = self
            .provider
            .run(self.fleet.clone(), shutdown.child_token());
        let mut provider = std::pin::pin!(provider);
        let mut provider_done = false;
        let mut result = Ok(());
        loop {
            tokio::select! {
                () = shutdown.cancelled() => break,
                res = &mut provider, if !provider_done => {
                    provider_done = true;
                    if let Err(e) = res {
                        tracing::error!(error = %e, "provider failed; shutting down");
                        result = Err(ManagerError::Provider(e));
                        break;
                    }
                }
                Some(job) = jobs_rx.recv() => match job {
                    Job::Task(task) => {
                        tasks.spawn(task);
                    }
                    Job::Controller => {
                        term.start_new(self);
                        shared_term.start_new(self);
                    }
                },
                event = leadership.recv(), if campaigning => match event {
                    Some(Leadership::Acquired) => {
                        if election.is_some() {
                            tracing::info!(lease = %lease, "leading: starting the controllers");
                        }
                        term.begin(self, &shutdown);
                        self.leading.send_replace(Some(term.stop.clone()));
                        if let Some(metrics) = self.metrics.as_ref().filter(|_| election.is_some()) {
                            metrics.leading(&lease, true);
                        }
                    }
                    Some(Leadership::Lost(reason)) => {
                        tracing::error!(lease = %lease, %reason, "leadership lost: stopping the controllers now");
                        self.leading.send_replace(None);
                        if let Some(metrics) = &self.metrics {
                            metrics.leading(&lease, false);
                        }
                        term.abort().await;
                        if election.as_ref().is_none_or(|e| e.on_loss == OnLoss::Exit) {
                            result = Err(ManagerError::LeadershipLost { lease: lease.clone(), reason });
                            break;
                        }
                    }
                    // Without leader election nothing more comes.
                    None if election.is_none() => campaigning = false,
                    None => {
                        // The election task died (it never ends on its own before the run's
                        // end): leading or not, this replica can no longer take part.
                        let reason = "the election task ended unexpectedly".to_string();
                        tracing::error!(lease = %lease, %reason, "stopping");
                        self.leading.send_replace(None);
                        term.abort().await;
                        result = Err(ManagerError::LeadershipLost { lease: lease.clone(), reason });
                        break;
                    }
                },
                Some(joined) = tasks.join_next(), if !tasks.is_empty() => {
                    if let Err(panic) = controller_panic(joined) {
                        result = Err(panic);
                        break;
                    }
                }
                Some(joined) = term.controllers.join_next(), if !term.controllers.is_empty() => {
                    if let Err(panic) = controller_panic(joined) {
                        result = Err(panic);
                        break;
                    }
                }
                Some(joined) = shared_term.controllers.join_next(), if !shared_term.controllers.is_empty() => {
                    if let Err(panic) = controller_panic(joined) {
                        result = Err(panic);
                        break;
                    }
                }
                joined = async {
                    match coordinator.as_mut() {
                        Some(handle) => handle.await,
                        None => std::future::pending().await,
                    }
                }, if coordinating => {
                    // It runs until the run's end: without it nothing keeps this replica's
                    // share, nor stops its work when the host is out of reach.
                    coordinating = false;
                    let reason = match joined {
                        Ok(_) => "it ended".to_string(),
                        Err(error) => panic_text(error),
                    };
                    // As when a lease is lost: nothing renews the fences any more, and the
                    // others take them over once the lease duration has passed, so the work
                    // is dropped now rather than drained.
                    tracing::error!(%reason, "the sharding coordinator stopped; dropping the sharded controllers' work and shutting down");
                    fence_tenure.end();
                    shared_term.abort().await;
                    result = Err(ManagerError::ShardingFailed(reason));
                    break;
                }
                Some(fault) = faults_rx.recv() => {
                    tracing::error!(%fault, "shutting down");
                    result = Err(ManagerError::WatchFailed(fault));
                    break;
                }
            }
        }
        shutdown.cancel();
        {
            // From now on, added tasks wait for the next run.
            *lock(&self.running) = None;
            let mut pending = lock(&self.pending);
            while let Ok(job) = jobs_rx.try_recv() {
                if let Job::Task(task) = job {
                    pending.push(task);
                }
            }
        }
        // Controllers see the same token and wind down on their own, each within the graceful
        // timeout, and the provider gets as long for its cleanup; whatever is left after a
        // little more than that is dropped. A leader keeps renewing meanwhile: if it loses
        // the lease, its reconciles are dropped at once.
        let abort = term.abort.clone();
        let drain = async {
            let provider = async {
                if !provider_done {
                    let _ = (&mut provider).await;
                }
            };
            let tasks = async { while tasks.join_next().await.is_some() {} };
            let controllers = async { while term.controllers.join_next().await.is_some() {} };
            let shared = async { while shared_term.controllers.join_next().await.is_some() {} };
            futures::join!(provider, tasks, controllers, shared);
        };
        let lost_meanwhile = async {
            while let Some(event) = leadership.recv().await {
                if let Leadership::Lost(reason) = event {
                    tracing::error!(lease = %lease, %reason, "leadership lost while shutting down: dropping reconciles in flight");
                    abort.cancel();
                    return true;
                }
            }
            std::future::pending().await
        };
        let bound = self.graceful_timeout.saturating_add(Duration::from_secs(1));
        let mut lost = false;
        let drained = tokio::time::timeout(bound, async {
            tokio::pin!(drain);
            tokio::select! {
                () = &mut drain => {}
                true = lost_meanwhile => {
                    lost = true;
                    drain.await;
                }
            }
        })
        .await;
        if drained.is_err() {
            tracing::warn!(
                remaining = tasks.len() + term.controllers.len() + shared_term.controllers.len(),
                "tasks did not stop within the graceful timeout; dropping them"
            );
            tasks.shutdown().await;
            term.controllers.shutdown().await;
            shared_term.controllers.shutdown().await;
        }
        // Only a lease this replica still holds (as far as it knows) is given up on the way
        // out: one lost is not asked about again (the host may be out of reach, which is
        // often why it was lost).
        let holds_lease = self.leading.send_replace(None).is_some();
        if let Some(metrics) = self.metrics.as_ref().filter(|_| election.is_some()) {
            metrics.leading(&lease, false);
        }
        if let Some(campaign) = campaign {
            campaign_stop.cancel();
            if let Ok(mut elector) = campaign.await
                && holds_lease
                && !lost
                && elector.config().release_on_shutdown
            {
                match tokio::time::timeout(Duration::from_secs(5), elector.release()).await {
                    Ok(Ok(())) => tracing::info!(lease = %lease, "lease released"),
                    Ok(Err(error)) => {
                        tracing::warn!(lease = %lease, error = %crate::cluster::Shown(&error), "could not release the lease; it expires on its own");
                    }
                    Err(_) => {
                        tracing::warn!(lease = %lease, "releasing the lease timed out; it expires on its own")
                    }
                }
            }
        }
        if let Some(coordinator) = coordinator.filter(|_| coordinating) {
            coordinator_stop.cancel();
            if let Ok(coordinator) = coordinator.await {
                coordinator.leave().await;
            }
        }
        self.fleet.close().await;
        if let Some(local) = local
            && let Some(session) = local.cluster.detach()
        {
            session.stopped().await;
        }
        if let Some(server) = server {
            endpoints_stop.cancel();
            let _ = server.await;
            *lock(&self.served_at) = None;
        }
        // The next run gets a token of its own.
        *lock(&self.shutdown) = CancellationToken::new();
        abandoned.armed = false;
        result
    }
}

/// SIGTERM and SIGINT (Ctrl-C where there are no Unix signals).
struct Signals {
    #[cfg(unix)]
    terminate: tokio::signal::unix::Signal,
    #[cfg(unix)]
    interrupt: tokio::signal::unix::Signal,
}

impl Signals {
    fn listen() -> std::io::Result<Self> {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            Ok(Self {
                terminate: signal(SignalKind::terminate())?,
                interrupt: signal(SignalKind::interrupt())?,
            })
        }
        #[cfg(not(unix))]
        Ok(Self {})
    }

    /// The next signal's name.
    async fn next(&mut self) -> &'static str {
        #[cfg(unix)]
        {
            tokio::select! {
                _ = self.terminate.recv() => "SIGTERM",
                _ = self.interrupt.recv() => "SIGINT",
            }
        }
        #[cfg(not(unix))]
        {
            let _ = tokio::signal::ctrl_c().await;
            "Ctrl-C"
        }
    }
}

/// The controllers of one term: from winning the lease (or the start of a run, without
/// leader election) to losing it or the run's end.
struct Term {
    /// Which of the manager's controllers the term runs.
    scope: Scope,
    controllers: JoinSet<()>,
    /// Ends the term (a child of the run's shutdown).
    stop: CancellationToken,
    /// Drops reconciles in flight instead of awaiting them.
    abort: CancellationToken,
    /// How many of the manager's controllers run in this term; `None` between terms.
    started: Option<usize>,
    /// Until when its controllers may start reconciles (the leader Lease's renew deadline,
    /// the fences'; unbounded without either).
    tenure: Arc<Tenure>,
}

/// Which controllers a term runs.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Scope {
    /// Every controller (unsharded).
    All,
    /// The leader-only controllers of a sharded manager.
    LeaderOnly,
    /// None (a sharded manager without leader election: leader-only controllers are
    /// refused).
    Nothing,
    /// The others of a sharded manager.
    Sharded,
}

impl Term {
    fn new(scope: Scope, tenure: Arc<Tenure>) -> Self {
        Self {
            scope,
            controllers: JoinSet::new(),
            stop: CancellationToken::new(),
            abort: CancellationToken::new(),
            started: None,
            tenure,
        }
    }

    /// Starts every controller.
    fn begin<P: Provider>(&mut self, manager: &Manager<P>, shutdown: &CancellationToken) {
        self.stop = shutdown.child_token();
        self.abort = CancellationToken::new();
        self.started = Some(0);
        self.start_new(manager);
    }

    /// Starts the controllers added since the term began, if one is going on.
    fn start_new<P: Provider>(&mut self, manager: &Manager<P>) {
        let Some(started) = self.started else {
            return;
        };
        let controllers = lock(&manager.controllers);
        let env = manager.term_env(self.stop.clone(), self.abort.clone(), self.tenure.clone());
        for (factory, leader_only) in controllers.iter().skip(started) {
            let runs_here = match self.scope {
                Scope::All => true,
                Scope::LeaderOnly => *leader_only,
                Scope::Sharded => !*leader_only,
                Scope::Nothing => {
                    if *leader_only {
                        tracing::error!(
                            "a leader-only controller was added to a sharded manager without leader election: not started"
                        );
                    }
                    false
                }
            };
            if runs_here {
                self.controllers.spawn(factory(env.clone()));
            }
        }
        self.started = Some(controllers.len());
    }

    /// Ends the term at once: controllers stop taking work and drop reconciles in flight.
    async fn abort(&mut self) {
        self.started = None;
        self.abort.cancel();
        self.stop.cancel();
        while self.controllers.join_next().await.is_some() {}
    }
}

/// What the campaign tells the run.
enum Leadership {
    Acquired,
    Lost(String),
}

/// Campaigns for the lease and, once held, renews it, until `stop`; returns the elector (to
/// release the lease with).
async fn campaign(
    mut elector: Elector,
    events: mpsc::UnboundedSender<Leadership>,
    stop: CancellationToken,
    tenure: Arc<Tenure>,
) -> Elector {
    // Whatever ends the campaign ends the tenure it published.
    let _ended = EndsTenure(&tenure);
    let lease = format!("{}/{}", elector.config().namespace, elector.config().name);
    let identity = elector.config().identity.clone();
    let renew_deadline = elector.config().timing.renew_deadline;
    loop {
        // A candidate: try every retry period until the lease is ours.
        let mut holder_seen: Option<String> = None;
        let mut failing = false;
        // When the last successful attempt began: the others' lease clocks start no earlier
        // (they start when they see the write), so the renew deadline counts from here.
        let mut renewed;
        loop {
            renewed = Instant::now();
            let attempt = tokio::select! {
                () = stop.cancelled() => return elector,
                attempt = elector.try_acquire_or_renew() => attempt,
            };
            match attempt {
                Ok(Attempt::Held) => break,
                Ok(Attempt::HeldBy(holder)) => {
                    if holder_seen.as_ref() != Some(&holder) {
                        tracing::info!(lease = %lease, %identity, %holder, "another replica leads; waiting for the lease");
                        holder_seen = Some(holder);
                    }
                    failing = false;
                }
                Err(error) => {
                    if !failing {
                        tracing::warn!(lease = %lease, %identity, error = %crate::cluster::Shown(&error), "cannot read or take the lease; retrying");
                        failing = true;
                    }
                }
            }
            tokio::select! {
                () = stop.cancelled() => return elector,
                () = tokio::time::sleep(elector.config().timing.jittered_retry()) => {}
            }
        }
        tracing::info!(lease = %lease, %identity, transitions = elector.transitions(), "lease acquired");
        tenure.until((renewed + renew_deadline).into());
        if events.send(Leadership::Acquired).is_err() {
            return elector;
        }
        // The leader: renew every retry period; give up the moment the renew deadline has
        // passed since the last renewal began, whatever the reason (never sleeping past it).
        let mut last_error = None;
        let reason = loop {
            let deadline = renewed + renew_deadline;
            let wake = (Instant::now() + elector.config().timing.jittered_retry()).min(deadline);
            tokio::select! {
                () = stop.cancelled() => return elector,
                () = tokio::time::sleep_until(wake.into()) => {}
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break match last_error.take() {
                    Some(error) => format!(
                        "not renewed within the renew deadline ({renew_deadline:?}); last error: {error}"
                    ),
                    None => format!("not renewed within the renew deadline ({renew_deadline:?})"),
                };
            }
            let began = Instant::now();
            let attempt = tokio::select! {
                () = stop.cancelled() => return elector,
                attempt = tokio::time::timeout(left, elector.try_acquire_or_renew()) => attempt,
            };
            match attempt {
                Ok(Ok(Attempt::Held)) => {
                    renewed = began;
                    tenure.until((renewed + renew_deadline).into());
                    last_error = None;
                }
                Ok(Ok(Attempt::HeldBy(holder))) => break format!("{holder} holds the lease now"),
                Ok(Err(error)) => {
                    tracing::warn!(lease = %lease, error = %crate::cluster::Shown(&error), "renewing the lease failed; retrying until the renew deadline");
                    last_error = Some(error);
                }
                Err(_) => {
                    break format!(
                        "not renewed within the renew deadline ({renew_deadline:?}): no answer in time"
                    );
                }
            }
        };
        tenure.end();
        if events.send(Leadership::Lost(reason)).is_err() {
            return elector;
        }
        if elector.config().on_loss == OnLoss::Exit {
            stop.cancelled().await;
            return elector;
        }
    }
}

/// Ends a tenure when dropped.
struct EndsTenure<'a>(&'a Tenure);

impl Drop for EndsTenure<'_> {
    fn drop(&mut self) {
        self.0.end();
    }
}

/// A joined task: an error if it panicked (a controller that died would leave its clusters
/// unreconciled while everything looks alive; the run stops instead, loudly).
fn controller_panic(joined: Result<(), tokio::task::JoinError>) -> Result<(), ManagerError> {
    match joined {
        Err(error) if error.is_panic() => {
            tracing::error!(%error, "a controller panicked; shutting down");
            Err(ManagerError::ControllerPanicked(panic_text(error)))
        }
        _ => Ok(()),
    }
}

/// Cleans up after a [`Manager::run`] that did not return (dropped, or the provider panicked):
/// stops its tasks' work without awaiting them (they are dropped with the run), disengages
/// every cluster and lets the manager run again.
struct Abandoned<'a, P: Provider> {
    manager: &'a Manager<P>,
    armed: bool,
}

impl<P: Provider> Drop for Abandoned<'_, P> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let manager = self.manager;
        manager.leading.send_replace(None);
        lock(&manager.shutdown).cancel();
        // Closed as a run's end closes it: no engagement is accepted until the next run.
        manager.fleet.close_now();
        if let Some(local) = &manager.local {
            local.detach();
        }
        *lock(&manager.running) = None;
        *lock(&manager.shutdown) = CancellationToken::new();
    }
}

fn panic_text(error: tokio::task::JoinError) -> String {
    match error.try_into_panic() {
        Ok(panic) => crate::cluster::panic_message(&*panic),
        Err(error) => error.to_string(),
    }
}

impl<P: Provider> Drop for Manager<P> {
    fn drop(&mut self) {
        lock(&self.shutdown).cancel();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::providers::Clusters;

    #[tokio::test]
    async fn a_panicking_controller_stops_the_manager_with_an_error() {
        let manager = Manager::new(Clusters::<crate::ClusterName>::new());
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
        let manager = Arc::new(Manager::new(Clusters::<crate::ClusterName>::new()));
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

    /// A provider with cleanup to do after shutdown.
    struct Cleans(Arc<std::sync::atomic::AtomicBool>);

    impl Provider for Cleans {
        type Id = crate::ClusterName;

        async fn run(
            &self,
            _: Fleet<crate::ClusterName>,
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
        let manager = Manager::new(Clusters::<crate::ClusterName>::new());
        assert!(
            tokio::time::timeout(Duration::from_millis(50), manager.run())
                .await
                .is_err(),
            "still running when dropped"
        );
        // The dropped run closed its fleet: nothing is engaged into a fleet no run serves
        // (its watches would report to a run that is gone).
        let cluster = Cluster::from_config(
            crate::ClusterName::new("late"),
            kube::Config::new("https://127.0.0.1:1".parse().unwrap()),
        )
        .unwrap();
        assert!(matches!(
            manager.fleet().engage(cluster.clone()),
            Err(crate::EngageError::Stopped { .. })
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
        manager: &Arc<Manager<Clusters<crate::ClusterName>>>,
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
        let manager = Manager::new(Clusters::<crate::ClusterName>::new())
            .serve(crate::Endpoints::new(addr).plain_http());
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
        let manager = Arc::new(Manager::new(Clusters::<crate::ClusterName>::new()));
        assert!(!manager.is_leader());
        let run = running(&manager).await;
        assert!(manager.is_leader());
        manager.shutdown();
        run.await.unwrap().unwrap();
        assert!(!manager.is_leader());
    }

    #[tokio::test(start_paused = true)]
    async fn tasks_that_ignore_shutdown_are_dropped_after_the_graceful_timeout() {
        let manager = Manager::new(Clusters::<crate::ClusterName>::new())
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
