//! [`Manager::run`], in its phases: the settings checked; the run started (the components
//! prepared, the fleet opened, the terms, the components and the campaign started, the
//! provider); the run loop, until something stops it; the wind-down (the controllers drained
//! within the graceful timeout, the lease given up, the components stopped stage by stage,
//! the fleet closed).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::campaign::{Campaign, Leadership};
use super::term::{Scope, Term};
use super::{Job, Manager, ManagerError};
use crate::cache::{Fault, WatchSettings};
use crate::cluster::Engagement;
use crate::lease::leader::{LeaderElection, OnLoss};
use crate::lease::tenure::Tenure;
use crate::metrics::WatchRow;
use crate::provider::{Provider, ProviderError};
use crate::run::component::{self, Failure, Running, ShardedTerm, Stage, Start, Starting};
use crate::shard::Sharding;
use crate::util::sync::lock;

/// The provider's `run`, for as long as the run lasts.
type ProviderRun<'a> = Pin<Box<dyn Future<Output = Result<(), ProviderError>> + Send + 'a>>;

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

    /// Every registered component prepared (settings checked, addresses bound), in the order
    /// they start: refused before anything starts if one cannot.
    async fn prepare_components(&self) -> Result<Vec<(Stage, Start<P::Id>)>, ManagerError> {
        let mut components = lock(&self.components).clone();
        components.sort_by_key(|c| c.stage());
        let mut prepared = Vec::with_capacity(components.len());
        for component in &components {
            let start = component.prepare(self.local.as_ref()).await?;
            prepared.push((component.stage(), start));
        }
        Ok(prepared)
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

impl From<Failure> for ManagerError {
    fn from(failure: Failure) -> Self {
        match failure {
            Failure::Endpoints(reason) => ManagerError::Endpoints(reason),
            Failure::Webhooks(reason) => ManagerError::Webhooks(reason),
            Failure::Listen { addr, error } => ManagerError::Serve { addr, error },
            Failure::Sharding(reason) => ManagerError::ShardingFailed(reason),
            Failure::Panicked(reason) => ManagerError::ControllerPanicked(reason),
        }
    }
}

/// A run in progress: what it started, followed while it runs and stopped at its end.
struct Run<'a, P: Provider> {
    manager: &'a Manager<P>,
    /// Ends the run.
    shutdown: CancellationToken,
    /// Controllers, components and tasks added while the run goes on.
    jobs: mpsc::UnboundedReceiver<Job<P::Id>>,
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
    campaign: Campaign,
    /// What components are started with (those added while the run goes on too).
    starting: Starting<P::Id>,
    /// The components started, in [`Stage`] order, each with its stage.
    components: Vec<(Stage, Running)>,
    local: Option<Engagement<P::Id>>,
    /// Last, so that it is dropped last when the run is.
    abandoned: Abandoned<'a, P>,
}

impl<'a, P: Provider> Run<'a, P> {
    /// Starts everything a run runs: refused if the manager is running already or a
    /// component cannot start.
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
        let prepared = manager.prepare_components().await?;
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
            established: manager.established.clone(),
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
        // The leader's controllers start nothing past the lease's renew deadline (unbounded
        // without an election), the sharded ones nothing past the fences'. Sharded: every
        // controller but the leader-only ones runs from the start, each on this replica's
        // share, which the sharding component keeps in the fleet.
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
        if sharding.is_some() {
            shared_term.begin(manager, &shutdown);
        }
        let mut starting = Starting {
            env: manager.env(),
            host: manager.local.clone().or_else(|| {
                manager
                    .provider
                    .single()
                    .and_then(|single| manager.fleet.get(single.id()))
            }),
            ready: Vec::new(),
            sharded: ShardedTerm {
                tenure: fence_tenure,
                abort: shared_term.abort.clone(),
            },
        };
        let components = prepared
            .into_iter()
            .map(|(stage, start)| (stage, start(&mut starting)))
            .collect();
        // Leadership: without an election, controllers run from the start.
        let campaign = Campaign::start(election, lease_tenure);
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
            campaign,
            starting,
            components,
            local,
            abandoned,
        })
    }

    /// Follows the run until something stops it: a shutdown (`Ok`), or a failure.
    async fn until_stopped(&mut self) -> Result<(), ManagerError> {
        loop {
            let components_run = self.components.iter().any(|(_, c)| c.running());
            let stopped = tokio::select! {
                () = self.shutdown.cancelled() => Some(Ok(())),
                res = &mut self.provider, if !self.provider_done => {
                    self.provider_done = true;
                    res.err().map(|e| {
                        tracing::error!(error = %e, "provider failed; shutting down");
                        Err(ManagerError::Provider(e))
                    })
                }
                Some(job) = self.jobs.recv() => self.job(job).await.err().map(Err),
                event = self.campaign.events.recv(), if self.campaign.listening => self.leadership_changed(event).await,
                Some(joined) = self.tasks.join_next(), if !self.tasks.is_empty() => {
                    controller_panic(joined).err().map(Err)
                }
                Some(joined) = self.term.controllers.join_next(), if !self.term.controllers.is_empty() => {
                    controller_panic(joined).err().map(Err)
                }
                Some(joined) = self.shared_term.controllers.join_next(), if !self.shared_term.controllers.is_empty() => {
                    controller_panic(joined).err().map(Err)
                }
                ended = component::next_end(&mut self.components), if components_run => {
                    ended.err().map(|failure| {
                        let error = ManagerError::from(failure);
                        tracing::error!(%error, "shutting down");
                        Err(error)
                    })
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

    /// Starts what was added while the run goes on.
    async fn job(&mut self, job: Job<P::Id>) -> Result<(), ManagerError> {
        match job {
            Job::Task(task) => {
                self.tasks.spawn(task);
            }
            Job::Controller => {
                self.term.start_new(self.manager);
                self.shared_term.start_new(self.manager);
            }
            Job::Component(component) => {
                let start = component.prepare(self.manager.local.as_ref()).await?;
                let running = start(&mut self.starting);
                self.components.push((component.stage(), running));
            }
        }
        Ok(())
    }

    /// Starts or stops the leader's controllers; `Some` if that ends the run.
    async fn leadership_changed(
        &mut self,
        event: Option<Leadership>,
    ) -> Option<Result<(), ManagerError>> {
        let manager = self.manager;
        let elected = self.campaign.election.is_some();
        let lease = &self.campaign.lease;
        match event {
            Some(Leadership::Acquired) => {
                if elected {
                    tracing::info!(lease = %lease, "leading: starting the controllers");
                }
                self.term.begin(manager, &self.shutdown);
                manager.leading.send_replace(Some(self.term.stop.clone()));
                if let Some(metrics) = manager.metrics.as_ref().filter(|_| elected) {
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
                    .campaign
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
            None if !elected => {
                self.campaign.listening = false;
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

    /// Ends the run: everything drained or dropped, the lease given up, the components
    /// stopped stage by stage, the fleet closed; returns `result` and leaves the manager
    /// ready to run again.
    async fn wind_down(mut self, result: Result<(), ManagerError>) -> Result<(), ManagerError> {
        let manager = self.manager;
        self.shutdown.cancel();
        {
            // From now on, added tasks wait for the next run (added components are
            // registered already: the next run starts them).
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
        if manager.leading.borrow().is_none() {
            self.campaign
                .end(|| manager.leading.send_replace(None).is_some())
                .await;
        }
        let lost = self.drain().await;
        // The components that outlast the controllers are told to stop now (the webhook
        // server takes no new review: readiness has failed since the start of the
        // shutdown, so a Service has stopped sending it reviews meanwhile).
        self.stop(Stage::Admission);
        // Only a lease this replica still holds (as far as it knows) is given up on the way
        // out: one lost is not asked about again (the host may be out of reach, which is
        // often why it was lost).
        let holds_lease = manager.leading.send_replace(None).is_some();
        if let Some(metrics) = manager
            .metrics
            .as_ref()
            .filter(|_| self.campaign.election.is_some())
        {
            metrics.leading(&self.campaign.lease, false);
        }
        self.campaign.end(|| holds_lease && !lost).await;
        self.end(Stage::Membership).await;
        manager.fleet.close().await;
        if let Some(local) = self.local.take()
            && let Some(session) = local.cluster.detach()
        {
            session.stopped().await;
        }
        self.end(Stage::Admission).await;
        self.end(Stage::Serving).await;
        // The next run gets a token of its own.
        *lock(&manager.shutdown) = CancellationToken::new();
        self.abandoned.armed = false;
        result
    }

    /// Tells the components of `stage` to stop.
    fn stop(&self, stage: Stage) {
        for (_, component) in self.components.iter().filter(|(s, _)| *s == stage) {
            component.stop();
        }
    }

    /// Stops the components of `stage` and waits for them (a failure now is logged only).
    async fn end(&mut self, stage: Stage) {
        self.stop(stage);
        for (_, component) in self.components.iter_mut().filter(|(s, _)| *s == stage) {
            if let Err(failure) = component.join().await {
                tracing::warn!(error = %ManagerError::from(failure), "while shutting down");
            }
        }
    }

    /// Lets the controllers, the tasks, the components of [`Stage::Work`] and the provider
    /// wind down on the run's token, each within the graceful timeout; whatever is left
    /// after a little more than that is dropped. A leader keeps renewing meanwhile: if it
    /// loses the lease, its reconciles are dropped at once. Returns whether it lost the
    /// lease meanwhile.
    async fn drain(&mut self) -> bool {
        let Run {
            manager,
            provider,
            provider_done,
            tasks,
            term,
            shared_term,
            campaign,
            components,
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
            let work = async {
                for (_, component) in components.iter_mut().filter(|(s, _)| *s == Stage::Work) {
                    let _ = component.join().await;
                }
            };
            futures::join!(provider, tasks, controllers, shared, work);
        };
        let lease = &campaign.lease;
        let events = &mut campaign.events;
        let lost_meanwhile = async {
            while let Some(event) = events.recv().await {
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
            let work = components
                .iter_mut()
                .filter(|(s, c)| *s == Stage::Work && c.running());
            let mut remaining =
                tasks.len() + term.controllers.len() + shared_term.controllers.len();
            for (_, component) in work {
                component.abort();
                remaining += 1;
            }
            tracing::warn!(
                remaining,
                "tasks did not stop within the graceful timeout; dropping them"
            );
            tasks.shutdown().await;
            term.controllers.shutdown().await;
            shared_term.controllers.shutdown().await;
        }
        lost
    }
}

/// A joined task: an error if it panicked (a controller that died would leave its clusters
/// unreconciled while everything looks alive; the run stops instead, loudly).
fn controller_panic(joined: Result<(), tokio::task::JoinError>) -> Result<(), ManagerError> {
    match joined {
        Err(error) if error.is_panic() => {
            tracing::error!(%error, "a controller panicked; shutting down");
            Err(ManagerError::ControllerPanicked(
                crate::util::panic::join_error_text(error),
            ))
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
