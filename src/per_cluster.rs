//! Per-cluster tasks ([`Manager::per_cluster`](crate::Manager::per_cluster)): one task per
//! engagement of each fleet cluster, stopped when that engagement ends.

use std::future::Future;
use std::sync::Arc;

use futures::StreamExt;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::controller::Env;
use crate::{Cluster, ClusterEvent, ClusterId};

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
    let mut events = env.fleet.events();
    let mut tasks = JoinSet::new();
    let stop_all = env.shutdown.child_token();
    let start = |tasks: &mut JoinSet<()>, cluster: Cluster<C>, until: CancellationToken| {
        // Cancelled when the engagement ends, or when the manager shuts down.
        let until = until_either(until, stop_all.clone());
        let id = cluster.id().to_string();
        let work = task(cluster, until);
        let name = name.clone();
        tasks.spawn(async move {
            // A panic ends this cluster's task only.
            if let Err(panic) = futures::FutureExt::catch_unwind(std::panic::AssertUnwindSafe(work)).await {
                tracing::error!(task = %name, cluster = %id, panic = %crate::cluster::panic_message(&*panic), "per-cluster task panicked");
            }
        });
    };
    loop {
        tokio::select! {
            () = env.shutdown.cancelled() => break,
            event = events.next() => match event {
                Some(ClusterEvent::Engaged { cluster, until }) => start(&mut tasks, cluster, until),
                Some(ClusterEvent::Replaced { new, until, .. }) => start(&mut tasks, new, until),
                Some(ClusterEvent::Disengaged { .. }) => {}
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
fn until_either(a: CancellationToken, b: CancellationToken) -> CancellationToken {
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
