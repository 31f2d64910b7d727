//! [`Manager::run`], in its phases: the settings checked; the run started (endpoints, watch
//! settings, tasks, the sharding coordinator, the leadership campaign, the provider); the run
//! loop, until something stops it; the wind-down (drain within the graceful timeout, the lease
//! given up, the coordinator's leave, the fleet closed).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;

use super::campaign::{Leadership, campaign};
use super::term::{Scope, Term};
use super::{Job, Manager, ManagerError};
use crate::cache::{Fault, WatchSettings};
use crate::cluster::Engagement;
use crate::lease::leader::{Elector, LeaderElection, OnLoss};
use crate::lease::tenure::Tenure;
use crate::metrics::WatchRow;
use crate::provider::{Provider, ProviderError};
use crate::serve::Endpoints;
use crate::shard::Coordinator;
use crate::shard::Sharding;
use crate::util::sync::lock;

/// The provider's `run`, for as long as the run lasts.
type ProviderRun<'a> = Pin<Box<dyn Future<Output = Result<(), ProviderError>> + Send + 'a>>;

/// The endpoints' TLS settings (`None`: plain HTTP) and token checker (`None`: everyone may
/// ask).
type Security = (
    Option<Arc<rustls::ServerConfig>>,
    Option<Arc<crate::serve::Authorizer>>,
);

impl<P: Provider> Manager<P> {
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
        let (election, sharding) = self.checked_settings()?;
        let mut run = Run::start(self, election, sharding).await?;
        let result = run.until_stopped().await;
        run.wind_down(result).await
    }

    /// The leader election and sharding settings of a run, refused before anything starts
    /// if they cannot work.
    fn checked_settings(&self) -> Result<(Option<LeaderElection>, Option<Sharding>), ManagerError> {
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
        Ok((election, sharding))
    }

    /// The TLS settings (`None`: plain HTTP) and the token checker (`None`: everyone may
    /// ask) of `endpoints`.
    fn endpoint_security(&self, endpoints: &Endpoints) -> Result<Security, ManagerError> {
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

    /// The endpoints' security checked and their address bound, before anything starts.
    async fn bind_endpoints(
        &self,
    ) -> Result<Option<(tokio::net::TcpListener, Security)>, ManagerError> {
        let Some(endpoints) = &self.endpoints else {
            return Ok(None);
        };
        let security = self.endpoint_security(endpoints)?;
        let listener = tokio::net::TcpListener::bind(endpoints.addr)
            .await
            .map_err(|error| ManagerError::Serve {
                addr: endpoints.addr,
                error,
            })?;
        Ok(Some((listener, security)))
    }

    /// Serves the endpoints on `listener` until the returned token is cancelled.
    fn serve_endpoints(
        &self,
        listener: tokio::net::TcpListener,
        (tls, authorizer): Security,
        stopping: &CancellationToken,
        webhooks_ready: Option<crate::serve::Check>,
    ) -> Option<(AbortOnDropHandle<()>, CancellationToken)> {
        let mut endpoints = self.endpoints.clone()?;
        if let Some(check) = webhooks_ready {
            endpoints.readyz.push(("webhooks".into(), check));
        }
        let stop = CancellationToken::new();
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
            endpoints,
            authorizer,
            stopping: stopping.clone(),
        });
        let server = AbortOnDropHandle::new(tokio::spawn(crate::serve::serve(
            listener,
            tls,
            served,
            stop.clone(),
        )));
        Some((server, stop))
    }

    /// The webhooks' settings checked, their keeper made (on the first run) and their
    /// address bound, before anything starts.
    async fn bind_webhooks(
        &self,
    ) -> Result<Option<(tokio::net::TcpListener, Arc<crate::webhook::Keeper>)>, ManagerError> {
        let Some(runtime) = &self.webhooks else {
            return Ok(None);
        };
        let webhooks = &runtime.webhooks;
        webhooks.validate().map_err(ManagerError::Webhooks)?;
        if self.local.is_none()
            && matches!(
                webhooks.install,
                crate::webhook::Install::Host | crate::webhook::Install::FleetAndHost
            )
        {
            return Err(ManagerError::Webhooks(
                "webhooks installed in the host need one: Manager::with_local".into(),
            ));
        }
        let (host_name, _) = webhooks.url_parts().map_err(ManagerError::Webhooks)?;
        let keeper = match runtime.keeper.get() {
            Some(keeper) => keeper.clone(),
            None => {
                let secret = match (&webhooks.secret, &self.local) {
                    (Some((namespace, name)), Some(local)) => {
                        let client = local.client();
                        let namespace = namespace
                            .clone()
                            .unwrap_or_else(|| client.default_namespace().to_string());
                        Some((client, namespace, name.clone()))
                    }
                    _ => None,
                };
                if secret.is_none() {
                    tracing::info!(
                        "webhooks: no host cluster: the certificates and route key live in this process only (one replica)"
                    );
                }
                let _ = runtime
                    .secret
                    .set(secret.as_ref().map(|(_, namespace, name)| {
                        k8s_openapi::api::core::v1::ObjectReference {
                            api_version: Some("v1".into()),
                            kind: Some("Secret".into()),
                            namespace: Some(namespace.clone()),
                            name: Some(name.clone()),
                            ..Default::default()
                        }
                    }));
                let mut names = vec![host_name];
                names.extend(webhooks.names.iter().cloned());
                // In one order whatever the settings' order: replicas compare the names the
                // certificate is for, and must agree.
                names.sort();
                names.dedup();
                let keeper = crate::webhook::Keeper::new(
                    webhooks.certificates.clone(),
                    secret,
                    names,
                    webhooks.check_every,
                    webhooks.route_rotation_period(),
                );
                let _ = runtime.keeper.set(keeper.clone());
                keeper
            }
        };
        let listener = tokio::net::TcpListener::bind(webhooks.addr)
            .await
            .map_err(|error| ManagerError::Serve {
                addr: webhooks.addr,
                error,
            })?;
        Ok(Some((listener, keeper)))
    }

    /// Starts the certificate keeper and the webhook server; returns them (and the token
    /// that stops both) and the server's readiness check.
    fn serve_webhooks(
        &self,
        runtime: &crate::webhook::install::Runtime<P::Id>,
        listener: tokio::net::TcpListener,
        keeper: Arc<crate::webhook::Keeper>,
    ) -> (
        (
            AbortOnDropHandle<()>,
            AbortOnDropHandle<()>,
            CancellationToken,
        ),
        crate::serve::Check,
    ) {
        let webhooks = &runtime.webhooks;
        let (_, base) = webhooks.url_parts().unwrap_or_default();
        let addr = listener.local_addr().ok();
        *lock(&self.webhooks_at) = addr;
        tracing::info!(addr = ?addr, url = %webhooks.url, "serving admission webhooks");
        let host = match webhooks.install {
            crate::webhook::Install::Fleet => None,
            _ => self.local.as_ref().map(|l| l.id().clone()),
        };
        let shared = Arc::new(crate::webhook::ServerShared {
            fleet: self.fleet.clone(),
            serve_fleet: webhooks.install != crate::webhook::Install::Host,
            host,
            base,
            hooks: webhooks
                .hooks
                .iter()
                .map(|hook| {
                    (
                        hook.name.clone(),
                        (hook.handle(), Arc::from(hook.name.as_str()), hook.timeout),
                    )
                })
                .collect(),
            keeper: keeper.clone(),
            metrics: self.metrics.clone(),
            listening: std::sync::atomic::AtomicBool::new(false),
            slots: crate::serve::slots::Slots::new(crate::webhook::server::limits(
                webhooks
                    .connections
                    .unwrap_or_else(crate::webhook::server::default_connections),
            )),
            flights: crate::webhook::server::Flights::new(webhooks.budget),
        });
        let stop = CancellationToken::new();
        let keeping = AbortOnDropHandle::new(tokio::spawn(keeper.run(stop.clone())));
        let server = AbortOnDropHandle::new(tokio::spawn(crate::webhook::serve(
            listener,
            shared.clone(),
            stop.clone(),
            self.graceful_timeout,
        )));
        let ready: crate::serve::Check = Arc::new(move || shared.ready());
        ((server, keeping, stop), ready)
    }

    /// The watch gauges read this manager's clusters at scrape time (one source per manager:
    /// a later run replaces its own).
    fn gauge_watches(&self) {
        let Some(metrics) = &self.metrics else {
            return;
        };
        let (fleet, local) = (self.fleet.clone(), self.local.clone());
        metrics.watch_source(self.fleet.key(), move || {
            local
                .iter()
                .cloned()
                .chain(fleet.clusters())
                .map(|cluster| {
                    let id = crate::cluster::ClusterField(cluster.id()).to_string();
                    let rows = cluster.cache_status().into_iter().map(|status| WatchRow {
                        kind: status.kind,
                        synced: status.synced,
                        failing: status.error.is_some(),
                        overdue: status.overdue,
                    });
                    (id, rows.collect())
                })
                .collect()
        });
    }
}

/// A run in progress: what it started, followed while it runs and stopped at its end.
struct Run<'a, P: Provider> {
    manager: &'a Manager<P>,
    /// Ends the run.
    shutdown: CancellationToken,
    /// Controllers and tasks added while the run goes on.
    jobs: mpsc::UnboundedReceiver<Job>,
    /// Watches that stopped for good.
    faults: mpsc::UnboundedReceiver<Fault>,
    provider: ProviderRun<'a>,
    provider_done: bool,
    /// Tasks from [`Manager::add`].
    tasks: JoinSet<()>,
    /// The controllers that run while leading (all of them without sharding; the
    /// leader-only ones with it).
    term: Term,
    /// The sharded controllers, for the whole run.
    shared_term: Term,
    election: Option<LeaderElection>,
    /// The lease as `namespace/name` (empty without an election), for logs and metrics.
    lease: String,
    leadership: mpsc::UnboundedReceiver<Leadership>,
    campaigning: bool,
    /// The campaign and the token that ends it (with an election).
    campaign: Option<(AbortOnDropHandle<Elector>, CancellationToken)>,
    coordinator: Option<AbortOnDropHandle<Coordinator<P::Id>>>,
    coordinator_stop: CancellationToken,
    coordinating: bool,
    /// Until when the sharded controllers may start work (the fences').
    fence_tenure: Arc<Tenure>,
    local: Option<Engagement<P::Id>>,
    /// The endpoints' server and the token that stops it.
    server: Option<(AbortOnDropHandle<()>, CancellationToken)>,
    /// The webhook server and the certificate keeper, and the token that stops them.
    webhooks: Option<(
        AbortOnDropHandle<()>,
        AbortOnDropHandle<()>,
        CancellationToken,
    )>,
    /// Last, so that it is dropped last when the run is.
    abandoned: Abandoned<'a, P>,
}

impl<'a, P: Provider> Run<'a, P> {
    /// Starts everything a run runs: refused if the manager is running already or the
    /// endpoints cannot be served.
    async fn start(
        manager: &'a Manager<P>,
        election: Option<LeaderElection>,
        sharding: Option<Sharding>,
    ) -> Result<Self, ManagerError> {
        let (jobs_tx, jobs) = mpsc::unbounded_channel();
        let shutdown = {
            let mut running = lock(&manager.running);
            if running.is_some() {
                return Err(ManagerError::AlreadyRunning);
            }
            *running = Some(jobs_tx);
            manager.shutdown_token()
        };
        // If the run is dropped before it returns (or the provider panics), what it started
        // is stopped without waiting and the manager can run again. A failure from here on
        // ends the run through it too.
        let abandoned = Abandoned {
            manager,
            armed: true,
        };
        let endpoints = manager.bind_endpoints().await?;
        let webhook_listener = manager.bind_webhooks().await?;
        let (faults_tx, faults) = mpsc::unbounded_channel();
        let settings = WatchSettings {
            backoff: manager.backoff.clone(),
            faults: Some(faults_tx),
            metrics: manager.metrics.clone(),
            rate_limit: manager.rate_limit,
            transforms: manager.transforms.clone(),
            paged_lists: manager.paged_lists,
            namespaces: manager.namespaces.clone(),
            sync_timeout: Some(manager.cache_sync_timeout),
        };
        manager.fleet.open(
            settings.clone(),
            sharding.is_some(),
            manager.local.as_ref().map(|l| l.id().clone()),
        );
        manager.gauge_watches();
        // A single-cluster provider's cluster is engaged before any controller starts, so a
        // reconciler's `cache()` of it never finds it unengaged (the provider engages it too;
        // that is then `Unchanged`).
        if let Some(single) = manager.provider.single()
            && let Err(error) = manager.fleet.engage(single)
        {
            tracing::warn!(%error, "could not engage the provider's cluster");
        }
        let local = manager.local.as_ref().map(|local| local.attach(&settings));

        let mut tasks = JoinSet::new();
        for task in lock(&manager.pending).drain(..) {
            tasks.spawn(task);
        }
        // Warm standby: caches kept listed while waiting for the Lease (every replica).
        if election.is_some() {
            for warmer in lock(&manager.warmers).iter() {
                tasks.spawn(warmer(manager.env()));
            }
        }
        let (webhooks, webhook_ready) = match (webhook_listener, &manager.webhooks) {
            (Some((listener, keeper)), Some(runtime)) => {
                let (handles, ready) = manager.serve_webhooks(runtime, listener, keeper);
                (Some(handles), Some(ready))
            }
            _ => (None, None),
        };
        let server = endpoints.and_then(|(listener, security)| {
            manager.serve_endpoints(listener, security, &shutdown, webhook_ready)
        });
        // Sharded: every controller but the leader-only ones runs from the start, each on this
        // replica's share, which the coordinator keeps in the fleet.
        // The leader's controllers start nothing past the lease's renew deadline (unbounded
        // without an election), the sharded ones nothing past the fences'.
        let lease_tenure = Arc::new(match election {
            Some(_) => Tenure::ended(),
            None => Tenure::always(),
        });
        let fence_tenure = Arc::new(Tenure::ended());
        let term = Term::new(
            match (&sharding, &election) {
                (None, _) => Scope::All,
                (Some(_), Some(_)) => Scope::LeaderOnly,
                // Refused before the start; one added later is never started (and said so).
                (Some(_), None) => Scope::Nothing,
            },
            lease_tenure.clone(),
        );
        let mut shared_term = Term::new(Scope::Sharded, fence_tenure.clone());
        let coordinator_stop = CancellationToken::new();
        let coordinator = sharding.map(|sharding| {
            shared_term.begin(manager, &shutdown);
            let coordinator = Coordinator::new(
                sharding,
                manager.fleet.clone(),
                manager.metrics.as_ref(),
                manager.shard_status.clone(),
                fence_tenure.clone(),
            );
            AbortOnDropHandle::new(tokio::spawn(
                coordinator.run(coordinator_stop.clone(), shutdown.clone()),
            ))
        });
        // Leadership: without an election, controllers run from the start.
        let (leadership_tx, leadership) = mpsc::unbounded_channel();
        let campaign = match &election {
            Some(election) => {
                let stop = CancellationToken::new();
                let campaign = AbortOnDropHandle::new(tokio::spawn(campaign(
                    Elector::new(election.clone()),
                    leadership_tx,
                    stop.clone(),
                    lease_tenure.clone(),
                )));
                Some((campaign, stop))
            }
            None => {
                let _ = leadership_tx.send(Leadership::Acquired);
                None
            }
        };
        let lease = election
            .as_ref()
            .map(|e| format!("{}/{}", e.namespace, e.name))
            .unwrap_or_default();
        let coordinating = coordinator.is_some();
        let provider = Box::pin(
            manager
                .provider
                .run(manager.fleet.clone(), shutdown.child_token()),
        );
        Ok(Self {
            manager,
            shutdown,
            jobs,
            faults,
            provider,
            provider_done: false,
            tasks,
            term,
            shared_term,
            election,
            lease,
            leadership,
            campaigning: true,
            campaign,
            coordinator,
            coordinator_stop,
            coordinating,
            fence_tenure,
            local,
            server,
            webhooks,
            abandoned,
        })
    }

    /// Follows the run until something stops it: a shutdown (`Ok`), or a failure.
    async fn until_stopped(&mut self) -> Result<(), ManagerError> {
        loop {
            let stopped = tokio::select! {
                () = self.shutdown.cancelled() => Some(Ok(())),
                res = &mut self.provider, if !self.provider_done => {
                    self.provider_done = true;
                    res.err().map(|e| {
                        tracing::error!(error = %e, "provider failed; shutting down");
                        Err(ManagerError::Provider(e))
                    })
                }
                Some(job) = self.jobs.recv() => {
                    match job {
                        Job::Task(task) => {
                            self.tasks.spawn(task);
                        }
                        Job::Controller => {
                            self.term.start_new(self.manager);
                            self.shared_term.start_new(self.manager);
                        }
                    }
                    None
                }
                event = self.leadership.recv(), if self.campaigning => self.leadership_changed(event).await,
                Some(joined) = self.tasks.join_next(), if !self.tasks.is_empty() => {
                    controller_panic(joined).err().map(Err)
                }
                Some(joined) = self.term.controllers.join_next(), if !self.term.controllers.is_empty() => {
                    controller_panic(joined).err().map(Err)
                }
                Some(joined) = self.shared_term.controllers.join_next(), if !self.shared_term.controllers.is_empty() => {
                    controller_panic(joined).err().map(Err)
                }
                joined = async {
                    match self.coordinator.as_mut() {
                        Some(handle) => handle.await,
                        None => std::future::pending().await,
                    }
                }, if self.coordinating => {
                    // It runs until the run's end: without it nothing keeps this replica's
                    // share, nor stops its work when the host is out of reach.
                    self.coordinating = false;
                    let reason = match joined {
                        Ok(_) => "it ended".to_string(),
                        Err(error) => panic_text(error),
                    };
                    // As when a lease is lost: nothing renews the fences any more, and the
                    // others take them over once the lease duration has passed, so the work
                    // is dropped now rather than drained.
                    tracing::error!(%reason, "the sharding coordinator stopped; dropping the sharded controllers' work and shutting down");
                    self.fence_tenure.end();
                    self.shared_term.abort().await;
                    Some(Err(ManagerError::ShardingFailed(reason)))
                }
                Some(fault) = self.faults.recv() => {
                    tracing::error!(%fault, "shutting down");
                    Some(Err(ManagerError::WatchFailed(fault)))
                }
            };
            if let Some(result) = stopped {
                return result;
            }
        }
    }

    /// Starts or stops the leader's controllers; `Some` if that ends the run.
    async fn leadership_changed(
        &mut self,
        event: Option<Leadership>,
    ) -> Option<Result<(), ManagerError>> {
        let manager = self.manager;
        let lease = &self.lease;
        match event {
            Some(Leadership::Acquired) => {
                if self.election.is_some() {
                    tracing::info!(lease = %lease, "leading: starting the controllers");
                }
                self.term.begin(manager, &self.shutdown);
                manager.leading.send_replace(Some(self.term.stop.clone()));
                if let Some(metrics) = manager.metrics.as_ref().filter(|_| self.election.is_some())
                {
                    metrics.leading(lease, true);
                }
                None
            }
            Some(Leadership::Lost(reason)) => {
                tracing::error!(lease = %lease, %reason, "leadership lost: stopping the controllers now");
                manager.leading.send_replace(None);
                if let Some(metrics) = &manager.metrics {
                    metrics.leading(lease, false);
                }
                self.term.abort().await;
                if self
                    .election
                    .as_ref()
                    .is_none_or(|e| e.on_loss == OnLoss::Exit)
                {
                    return Some(Err(ManagerError::LeadershipLost {
                        lease: lease.clone(),
                        reason,
                    }));
                }
                None
            }
            // Without leader election nothing more comes.
            None if self.election.is_none() => {
                self.campaigning = false;
                None
            }
            None => {
                // The election task died (it never ends on its own before the run's end):
                // leading or not, this replica can no longer take part.
                let reason = "the election task ended unexpectedly".to_string();
                tracing::error!(lease = %lease, %reason, "stopping");
                manager.leading.send_replace(None);
                self.term.abort().await;
                Some(Err(ManagerError::LeadershipLost {
                    lease: lease.clone(),
                    reason,
                }))
            }
        }
    }

    /// Ends the run: everything drained or dropped, the lease given up, the coordinator gone,
    /// the fleet closed; returns `result` and leaves the manager ready to run again.
    async fn wind_down(mut self, result: Result<(), ManagerError>) -> Result<(), ManagerError> {
        let manager = self.manager;
        self.shutdown.cancel();
        {
            // From now on, added tasks wait for the next run.
            *lock(&manager.running) = None;
            let mut pending = lock(&manager.pending);
            while let Ok(job) = self.jobs.try_recv() {
                if let Job::Task(task) = job {
                    pending.push(task);
                }
            }
        }
        // A replica that does not lead stops campaigning before the drain: a lease it won
        // during the drain would be neither used nor given up (only a lease held when the
        // drain ends is released below), and the others would wait a lease duration for it.
        // One won just before the campaign stopped is released now; one lost is not asked
        // about again.
        if manager.leading.borrow().is_none()
            && let Some((campaign, stop)) = self.campaign.take()
        {
            stop.cancel();
            if let Ok(elector) = campaign.await
                && manager.leading.send_replace(None).is_some()
                && elector.config().release_on_shutdown
            {
                release(elector, &self.lease).await;
            }
        }
        let lost = self.drain().await;
        // The webhook server goes after the controllers (their own writes may need it, as in
        // controller-runtime): it takes no new review from now on, and those in flight are
        // answered (awaited below, within the graceful timeout). Readiness has failed since
        // the start of the shutdown, so a Service has stopped sending it reviews meanwhile.
        if let Some((_, _, stop)) = &self.webhooks {
            stop.cancel();
        }
        // Only a lease this replica still holds (as far as it knows) is given up on the way
        // out: one lost is not asked about again (the host may be out of reach, which is
        // often why it was lost).
        let holds_lease = manager.leading.send_replace(None).is_some();
        if let Some(metrics) = manager.metrics.as_ref().filter(|_| self.election.is_some()) {
            metrics.leading(&self.lease, false);
        }
        if let Some((campaign, stop)) = self.campaign.take() {
            stop.cancel();
            if let Ok(elector) = campaign.await
                && holds_lease
                && !lost
                && elector.config().release_on_shutdown
            {
                release(elector, &self.lease).await;
            }
        }
        if let Some(coordinator) = self.coordinator.take().filter(|_| self.coordinating) {
            self.coordinator_stop.cancel();
            if let Ok(coordinator) = coordinator.await {
                coordinator.leave().await;
            }
        }
        manager.fleet.close().await;
        if let Some(local) = self.local.take()
            && let Some(session) = local.cluster.detach()
        {
            session.stopped().await;
        }
        if let Some((server, keeper, _)) = self.webhooks.take() {
            let _ = server.await;
            let _ = keeper.await;
            *lock(&manager.webhooks_at) = None;
        }
        if let Some((server, stop)) = self.server.take() {
            stop.cancel();
            let _ = server.await;
            *lock(&manager.served_at) = None;
        }
        // The next run gets a token of its own.
        *lock(&manager.shutdown) = CancellationToken::new();
        self.abandoned.armed = false;
        result
    }

    /// Lets the controllers, the tasks and the provider wind down on the run's token, each
    /// within the graceful timeout; whatever is left after a little more than that is
    /// dropped. A leader keeps renewing meanwhile: if it loses the lease, its reconciles are
    /// dropped at once. Returns whether it lost the lease meanwhile.
    async fn drain(&mut self) -> bool {
        let Run {
            manager,
            provider,
            provider_done,
            tasks,
            term,
            shared_term,
            leadership,
            lease,
            ..
        } = self;
        let abort = term.abort.clone();
        let drain = async {
            let provider = async {
                if !*provider_done {
                    let _ = provider.await;
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
        let bound = manager
            .graceful_timeout
            .saturating_add(Duration::from_secs(1));
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
        lost
    }
}

/// Gives the lease up on the way out, bounded: if that fails, it expires on its own.
async fn release(mut elector: Elector, lease: &str) {
    match tokio::time::timeout(Duration::from_secs(5), elector.release()).await {
        Ok(Ok(())) => tracing::info!(lease = %lease, "lease released"),
        Ok(Err(error)) => {
            tracing::warn!(lease = %lease, error = %crate::client::Shown(&error), "could not release the lease; it expires on its own");
        }
        Err(_) => {
            tracing::warn!(lease = %lease, "releasing the lease timed out; it expires on its own")
        }
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
        Ok(panic) => crate::util::panic::panic_message(&*panic),
        Err(error) => error.to_string(),
    }
}
