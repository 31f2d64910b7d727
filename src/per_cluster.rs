//! Per-cluster tasks ([`Manager::per_cluster`](crate::Manager::per_cluster)): one task per
//! engagement of each fleet cluster, stopped when that engagement ends.

use std::future::Future;
use std::sync::Arc;

use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::cluster::Engagement;
use crate::controller::Env;
use crate::fleet::FleetEvent;
use crate::{Cluster, ClusterId};

/// A per-cluster task as the manager keeps it.
pub(crate) type PerCluster<C> = Arc<
    dyn Fn(Cluster<C>, CancellationToken) -> futures::future::BoxFuture<'static, ()> + Send + Sync,
>;

/// Wraps a user's task.
pub(crate) fn boxed<C, F, Fut>(task: F) -> PerCluster<C>
where
    C: ClusterId,
    F: Fn(Cluster<C>, CancellationToken) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    Arc::new(move |cluster, until| Box::pin(task(cluster, until)))
}

/// Runs `task` for each engagement of the fleet until the manager shuts down; then every
/// task's token is cancelled and they get the graceful timeout to return.
pub(crate) async fn run<C: ClusterId>(env: Env<C>, name: Arc<str>, task: PerCluster<C>) {
    let mut events = env.fleet.subscribe();
    let mut tasks = JoinSet::new();
    let stop_all = env.shutdown.child_token();
    let start = |tasks: &mut JoinSet<()>, engagement: Engagement<C>| {
        // Counted on the engagement while it runs (a sharded replica hands the cluster over
        // once it has returned); nothing starts on an engagement that already ended.
        let Some(busy) = engagement.session.busy() else {
            return;
        };
        let aborted = engagement.session.aborted().clone();
        // Cancelled when the engagement ends, or when the manager shuts down.
        let until = until_either(engagement.session.token().child_token(), stop_all.clone());
        let cluster = engagement.cluster;
        let id = cluster.id().to_string();
        let work = task(cluster, until);
        let name = name.clone();
        tasks.spawn(async move {
            let _busy = busy;
            // A panic ends this cluster's task only.
            let work = futures::FutureExt::catch_unwind(std::panic::AssertUnwindSafe(work));
            tokio::select! {
                ended = work => if let Err(panic) = ended {
                    tracing::error!(task = %name, cluster = %id, panic = %crate::cluster::panic_message(&*panic), "per-cluster task panicked");
                },
                // A sharded replica about to lose the cluster's fence.
                () = aborted.cancelled() => {
                    tracing::warn!(task = %name, cluster = %id, "per-cluster task dropped: this replica is losing the cluster");
                }
            }
        });
    };
    loop {
        tokio::select! {
            () = env.shutdown.cancelled() => break,
            event = events.recv() => match event {
                Some(FleetEvent::Engaged(engagement)) => start(&mut tasks, engagement),
                Some(FleetEvent::Replaced { new, .. }) => start(&mut tasks, new),
                Some(FleetEvent::Disengaged(_) | FleetEvent::Departed(_)) => {}
                None => break,
            },
            Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
        }
    }
    stop_all.cancel();
    let drain = async { while tasks.join_next().await.is_some() {} };
    tokio::select! {
        () = drain => {}
        () = env.grace.over() => {
            tracing::warn!(task = %name, "per-cluster tasks still running after the graceful timeout were dropped");
            tasks.abort_all();
            // Aborted tasks end at their next await; nothing of this run goes on after it.
            while tasks.join_next().await.is_some() {}
        }
    }
}

/// A token cancelled when either `a` or `b` is.
pub(crate) fn until_either(a: CancellationToken, b: CancellationToken) -> CancellationToken {
    let either = a.child_token();
    let watcher = either.clone();
    tokio::spawn(async move {
        tokio::select! {
            () = b.cancelled() => watcher.cancel(),
            () = watcher.cancelled() => {}
        }
    });
    either
}
