//! A term of controllers: the set a run starts together and stops together (while leading,
//! or the sharded ones for the whole run), with the tokens that end it gracefully or at once.

use std::sync::Arc;

use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::Manager;
use crate::lease::tenure::Tenure;
use crate::provider::Provider;
use crate::util::sync::lock;

/// The controllers of one term: from winning the lease (or the start of a run, without
/// leader election) to losing it or the run's end.
pub(super) struct Term {
    /// Which of the manager's controllers the term runs.
    scope: Scope,
    pub(super) controllers: JoinSet<()>,
    /// Ends the term (a child of the run's shutdown).
    pub(super) stop: CancellationToken,
    /// Drops reconciles in flight instead of awaiting them.
    pub(super) abort: CancellationToken,
    /// How many of the manager's controllers run in this term; `None` between terms.
    started: Option<usize>,
    /// Until when its controllers may start reconciles (the leader Lease's renew deadline,
    /// the fences'; unbounded without either).
    tenure: Arc<Tenure>,
}

/// Which controllers a term runs.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Scope {
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
    pub(super) fn new(scope: Scope, tenure: Arc<Tenure>) -> Self {
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
    pub(super) fn begin<P: Provider>(
        &mut self,
        manager: &Manager<P>,
        shutdown: &CancellationToken,
    ) {
        self.stop = shutdown.child_token();
        self.abort = CancellationToken::new();
        self.started = Some(0);
        self.start_new(manager);
    }

    /// Starts the controllers added since the term began, if one is going on.
    pub(super) fn start_new<P: Provider>(&mut self, manager: &Manager<P>) {
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
    pub(super) async fn abort(&mut self) {
        self.started = None;
        self.abort.cancel();
        self.stop.cancel();
        while self.controllers.join_next().await.is_some() {}
    }
}
