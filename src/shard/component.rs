//! The sharding coordinator as a component of a manager's run: it keeps this replica's share
//! of the fleet (and the fences of its clusters) for the whole run, and leaves the group once
//! the controllers have stopped. If it ends before that, nothing renews the fences any more:
//! the sharded controllers start nothing more and drop their reconciles in flight, and the run
//! ends.

use std::sync::{Arc, Mutex};

use tokio_util::sync::CancellationToken;

use super::{Coordinator, ShardStatus, Sharding};
use crate::cluster::{Cluster, ClusterId};
use crate::run::component::{
    BoxFuture, Component, Failure, Running, ShardedTerm, Stage, Start, Starting,
};

/// Runs the coordinator of [`Sharding`] for the whole run.
pub(crate) struct ShardingComponent {
    pub(crate) sharding: Sharding,
    /// What the coordinator last saw (`Manager::shard_status`).
    pub(crate) status: Arc<Mutex<Option<ShardStatus>>>,
}

impl<C: ClusterId> Component<C> for ShardingComponent {
    fn name(&self) -> &'static str {
        "sharding"
    }

    fn stage(&self) -> Stage {
        Stage::Membership
    }

    fn prepare<'a>(
        &'a self,
        _: Option<&'a Cluster<C>>,
    ) -> BoxFuture<'a, Result<Start<C>, Failure>> {
        let sharding = self.sharding.clone();
        let status = self.status.clone();
        Box::pin(async move {
            let start: Start<C> = Box::new(move |starting: &mut Starting<C>| {
                let term = starting.sharded.clone();
                let coordinator = Coordinator::new(
                    sharding,
                    starting.env.fleet.clone(),
                    starting.env.metrics.as_ref(),
                    status,
                    term.tenure.clone(),
                    starting.env.diagnostics.is_some(),
                );
                let stop = CancellationToken::new();
                let shutdown = starting.env.shutdown.clone();
                let stopped = stop.clone();
                Running::spawn(
                    stop,
                    async move {
                        let mut unexpected = Unexpected(Some(term));
                        let coordinator = coordinator.run(stopped.clone(), shutdown).await;
                        if !stopped.is_cancelled() {
                            // The guard, dropped now, ends the sharded term.
                            let reason = "it ended".to_string();
                            tracing::error!(%reason, "the sharding coordinator stopped; dropping the sharded controllers' work and shutting down");
                            return Err(Failure::Sharding(reason));
                        }
                        unexpected.0 = None;
                        coordinator.leave().await;
                        Ok(())
                    },
                    Failure::Sharding,
                )
            });
            Ok(start)
        })
    }
}

/// Armed while the coordinator runs: if it ends before it is told to (or panics), the sharded
/// controllers' tenure ends and their reconciles in flight are dropped. As when a lease is
/// lost: nothing renews the fences any more, and the others take them over once the lease
/// duration has passed, so the work is dropped now rather than drained.
struct Unexpected(Option<ShardedTerm>);

impl Drop for Unexpected {
    fn drop(&mut self) {
        // It ended on its own (said above), panicked (said here) or the run was dropped.
        if let Some(term) = self.0.take() {
            if std::thread::panicking() {
                tracing::error!(
                    "the sharding coordinator panicked; dropping the sharded controllers' work and shutting down"
                );
            }
            term.tenure.end();
            term.abort.cancel();
        }
    }
}
