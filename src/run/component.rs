//! The parts of a manager's run beside its controllers: the endpoints, the webhook server, the
//! sharding coordinator, the warm standby. Each registers with the manager as a
//! [`Component`]; the manager's run knows them only by their [`Stage`], which says when each
//! stops. Controllers, webhook installers and per-cluster tasks are the other kind of part:
//! they run in a term (while leading, or on this replica's share), through
//! [`ControllerFactory`].
//!
//! A run's lifecycle, for every component alike:
//! 1. **prepared** before the run starts anything: settings checked, an address bound. A
//!    failure refuses the run.
//! 2. **started** in [`Stage`] order, each with what the run hands it ([`Starting`]); one may
//!    add a readiness check for the ones started after it (the endpoints serve them).
//! 3. **followed** while the run goes on: a component that fails (or panics) ends the run with
//!    its [`Failure`]; one that ends quietly is done.
//! 4. **stopped** in the wind-down, by stage: [`Stage::Work`] with the controllers, within the
//!    graceful timeout; [`Stage::Membership`] once they have stopped, before the fleet is
//!    closed; [`Stage::Admission`] told to stop with it but awaited after the fleet is closed;
//!    [`Stage::Serving`] last of all.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;

use super::Env;
use crate::cluster::{Cluster, ClusterId};
use crate::lease::tenure::Tenure;

/// A boxed future, as components return them.
pub(crate) type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A task of a run: a controller, a standby, a task from `Manager::add`.
pub(crate) type Task = BoxFuture<'static, ()>;

/// What a run hands each controller it starts (in a term).
pub(crate) type ControllerFactory<C> = Arc<dyn Fn(Env<C>) -> Task + Send + Sync>;

/// A readiness check, as `/readyz` runs it (`serve::Check`).
pub(crate) type Check = Arc<dyn Fn() -> Result<(), String> + Send + Sync>;

/// What starts a prepared component.
pub(crate) type Start<C> = Box<dyn FnOnce(&mut Starting<C>) -> Running + Send>;

/// A part of a manager's run that runs for the whole run, on every replica.
pub(crate) trait Component<C: ClusterId>: Send + Sync {
    /// Its kind: a manager given the endpoints, the webhooks or the sharding settings again
    /// replaces the component of that name.
    fn name(&self) -> &'static str;

    /// When it stops in the wind-down (and, in this order, when it starts).
    fn stage(&self) -> Stage;

    /// Checks its settings and takes what it needs before the run starts anything (`local`:
    /// the manager's host cluster); returns what starts it.
    fn prepare<'a>(
        &'a self,
        local: Option<&'a Cluster<C>>,
    ) -> BoxFuture<'a, Result<Start<C>, Failure>>;
}

/// When a component stops, in the order components start.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Stage {
    /// Ends with the run's shutdown and is drained with the controllers, within the graceful
    /// timeout (the warm standby).
    Work,
    /// Stopped and awaited once the controllers have stopped, before the fleet is closed: it
    /// hands the fleet's clusters over (the sharding coordinator).
    Membership,
    /// Told to stop once the controllers have stopped (their own writes may need it), and
    /// awaited after the fleet is closed: it answers what is in flight meanwhile (the
    /// webhook server).
    Admission,
    /// Stopped last: probes and metrics are answered to the end (the endpoints).
    Serving,
}

/// What a run hands the components it starts.
pub(crate) struct Starting<C: ClusterId> {
    /// The run's environment: its shutdown, never aborted, with no tenure.
    pub(crate) env: Env<C>,
    /// The cluster whose watches readiness waits for: the host cluster, or the single
    /// provider's.
    pub(crate) host: Option<Cluster<C>>,
    /// Readiness checks of the components started so far, by name.
    pub(crate) ready: Vec<(String, Check)>,
    /// The term of the sharded controllers (with sharding).
    pub(crate) sharded: ShardedTerm,
}

/// The sharded controllers' term, as the component that keeps their fences sees it.
#[derive(Clone)]
pub(crate) struct ShardedTerm {
    /// Until when they may start work: the fences' renew deadline.
    pub(crate) tenure: Arc<Tenure>,
    /// Drops their reconciles in flight (nothing renews the fences any more).
    pub(crate) abort: CancellationToken,
}

/// A component that has started (the run keeps it with its component's [`Stage`]).
pub(crate) struct Running {
    /// Stops it.
    stop: CancellationToken,
    /// Its task, until it has ended: `Err` ends the run.
    task: Option<AbortOnDropHandle<Result<(), Failure>>>,
    /// What its panic means for the run.
    panicked: fn(String) -> Failure,
}

impl Running {
    /// `task` on its own tokio task, stopped by `stop`; a panic in it is `panicked`.
    pub(crate) fn spawn(
        stop: CancellationToken,
        task: impl Future<Output = Result<(), Failure>> + Send + 'static,
        panicked: fn(String) -> Failure,
    ) -> Self {
        Self {
            stop,
            task: Some(AbortOnDropHandle::new(tokio::spawn(task))),
            panicked,
        }
    }

    /// Whether its task still runs (as far as the run has seen).
    pub(crate) fn running(&self) -> bool {
        self.task.is_some()
    }

    /// Tells it to stop.
    pub(crate) fn stop(&self) {
        self.stop.cancel();
    }

    /// Waits for its task to end; `Err` if it failed or panicked (`Ok` if it had ended).
    pub(crate) async fn join(&mut self) -> Result<(), Failure> {
        let Some(task) = self.task.as_mut() else {
            return Ok(());
        };
        let joined = task.await;
        self.task = None;
        self.joined(joined)
    }

    /// Drops its task at once.
    pub(crate) fn abort(&mut self) {
        self.task = None;
    }

    fn joined(
        &self,
        joined: Result<Result<(), Failure>, tokio::task::JoinError>,
    ) -> Result<(), Failure> {
        match joined {
            Ok(result) => result,
            Err(error) if error.is_panic() => {
                Err((self.panicked)(crate::util::panic::join_error_text(error)))
            }
            // Cancelled: only the run aborts its tasks, on the way out.
            Err(_) => Ok(()),
        }
    }
}

/// Waits for the first of `components` still running to end; how it ended. Never completes
/// while none runs.
pub(crate) async fn next_end(components: &mut [(Stage, Running)]) -> Result<(), Failure> {
    let (index, joined) = std::future::poll_fn(|cx| {
        for (index, (_, component)) in components.iter_mut().enumerate() {
            if let Some(task) = component.task.as_mut()
                && let std::task::Poll::Ready(joined) = Pin::new(task).poll(cx)
            {
                return std::task::Poll::Ready((index, joined));
            }
        }
        std::task::Poll::Pending
    })
    .await;
    let (_, component) = &mut components[index];
    component.task = None;
    component.joined(joined)
}

/// Why a component refused to start or ended a run (the manager's error says it in its own
/// words).
#[derive(Debug)]
pub(crate) enum Failure {
    /// The endpoints' settings cannot work.
    Endpoints(String),
    /// The webhooks' settings cannot work.
    Webhooks(String),
    /// An address could not be listened on.
    Listen {
        addr: std::net::SocketAddr,
        error: std::io::Error,
    },
    /// The sharding coordinator stopped before the run's end.
    Sharding(String),
    /// A task of the run panicked.
    Panicked(String),
}

/// The warm standby of a controller: its caches kept listed while this replica waits for the
/// Lease (registered only with leader election).
pub(crate) struct Standby<C: ClusterId>(pub(crate) ControllerFactory<C>);

impl<C: ClusterId> Component<C> for Standby<C> {
    fn name(&self) -> &'static str {
        "standby"
    }

    fn stage(&self) -> Stage {
        Stage::Work
    }

    fn prepare<'a>(
        &'a self,
        _: Option<&'a Cluster<C>>,
    ) -> BoxFuture<'a, Result<Start<C>, Failure>> {
        let factory = self.0.clone();
        Box::pin(async move {
            let start: Start<C> = Box::new(move |starting: &mut Starting<C>| {
                let task = factory(starting.env.clone());
                Running::spawn(
                    starting.env.shutdown.clone(),
                    async move {
                        task.await;
                        Ok(())
                    },
                    Failure::Panicked,
                )
            });
            Ok(start)
        })
    }
}
