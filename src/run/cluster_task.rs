//! Per-cluster tasks ([`Manager::per_cluster`](crate::Manager::per_cluster)): one task per
//! engagement of each fleet cluster, stopped when that engagement ends.

use std::future::Future;
use std::sync::Arc;

use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::cluster::Engagement;
use crate::cluster::{Cluster, ClusterId};
use crate::fleet::FleetEvent;
use crate::run::Env;
use crate::util::task::until_either;

/// A per-cluster task as the manager keeps it.
pub(crate) type ClusterTask<C> = Arc<
    dyn Fn(Cluster<C>, CancellationToken) -> futures::future::BoxFuture<'static, ()> + Send + Sync,
>;

/// Wraps a user's task.
pub(crate) fn boxed<C, F, Fut>(task: F) -> ClusterTask<C>
where
    C: ClusterId,
    F: Fn(Cluster<C>, CancellationToken) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    Arc::new(move |cluster, until| Box::pin(task(cluster, until)))
}

/// Runs `task` for each engagement of the fleet until the manager shuts down; then every
/// task's token is cancelled and they get the graceful timeout to return.
pub(crate) async fn run<C: ClusterId>(env: Env<C>, name: Arc<str>, task: ClusterTask<C>) {
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
                    tracing::error!(task = %name, cluster = %id, panic = %crate::util::panic::panic_message(&*panic), "per-cluster task panicked");
                },
                // A sharded replica about to lose the cluster's fence.
                () = aborted.cancelled() => {
                    tracing::warn!(task = %name, cluster = %id, "per-cluster task dropped: this replica is losing the cluster");
                }
            }
        });
    };
    // Work starts only under a tenure that holds (the leader Lease or the shard's fences
    // renewed in time, as for reconciles): an engagement meanwhile waits for the next
    // renewal, and is dropped if it ends first.
    let mut tenure = env.tenure.subscribe();
    let mut parked: Vec<Engagement<C>> = Vec::new();
    loop {
        tokio::select! {
            () = env.shutdown.cancelled() => break,
            Ok(()) = tenure.changed(), if !parked.is_empty() => {
                if env.tenure.holds() {
                    for engagement in parked.drain(..) {
                        start(&mut tasks, engagement);
                    }
                }
            }
            event = events.recv() => match event {
                Some(FleetEvent::Engaged(engagement) | FleetEvent::Replaced { new: engagement, .. }) => {
                    parked.retain(|p| p.session.is_active());
                    if env.tenure.holds() {
                        start(&mut tasks, engagement);
                    } else {
                        tracing::debug!(task = %name, cluster = %engagement.cluster.id(), "per-cluster task waits for the tenure to be renewed");
                        parked.push(engagement);
                    }
                }
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

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;
    use crate::cluster::ClusterName;

    #[derive(Clone, Default)]
    struct Log(Arc<std::sync::Mutex<Vec<u8>>>);

    impl std::io::Write for Log {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[tokio::test]
    async fn a_task_starts_only_under_a_tenure_that_holds() {
        // One thread: the subscriber set here sees the task loop's lines.
        let log = Log::default();
        let writer = log.clone();
        let _logging = tracing::subscriber::set_default(
            tracing_subscriber::fmt()
                .with_max_level(tracing::Level::DEBUG)
                .with_writer(move || writer.clone())
                .finish(),
        );
        let fleet = crate::fleet::Fleet::<ClusterName>::new();
        let tenure = Arc::new(crate::lease::tenure::Tenure::ended());
        let shutdown = CancellationToken::new();
        let env = Env {
            fleet: fleet.clone(),
            local: None,
            shutdown: shutdown.clone(),
            grace: crate::run::Grace {
                timeout: std::time::Duration::from_secs(1),
                abort: CancellationToken::new(),
            },
            backoff: crate::cache::WatchBackoff::default(),
            metrics: None,
            transforms: Arc::default(),
            namespaces: Arc::default(),
            paged_lists: false,
            instance: Arc::from("test"),
            tenure: tenure.clone(),
            diagnostics: None,
        };
        let started = Arc::new(AtomicUsize::new(0));
        let counted = started.clone();
        let task = boxed(move |_: Cluster<ClusterName>, until: CancellationToken| {
            let counted = counted.clone();
            async move {
                counted.fetch_add(1, Ordering::SeqCst);
                until.cancelled().await;
            }
        });
        let running = tokio::spawn(run(env, Arc::from("writer"), task));
        // Engaged while the tenure has lapsed (a renewal overdue): not started.
        let cluster = Cluster::from_config(
            ClusterName::from("a"),
            kube::Config::new("https://127.0.0.1:1".parse().unwrap()),
        )
        .unwrap();
        fleet.engage(cluster).unwrap();
        // Sync point: the loop says it parked the engagement.
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(5);
        while !String::from_utf8_lossy(&log.0.lock().unwrap()).contains("waits for the tenure") {
            assert!(tokio::time::Instant::now() < deadline, "never parked");
            tokio::task::yield_now().await;
        }
        assert_eq!(
            started.load(Ordering::SeqCst),
            0,
            "started without a tenure"
        );
        // Renewed: the waiting engagement starts.
        tenure.until(tokio::time::Instant::now() + std::time::Duration::from_secs(60));
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(5);
        while started.load(Ordering::SeqCst) == 0 && tokio::time::Instant::now() < deadline {
            tokio::task::yield_now().await;
        }
        assert_eq!(started.load(Ordering::SeqCst), 1);
        shutdown.cancel();
        running.await.unwrap();
    }
}
