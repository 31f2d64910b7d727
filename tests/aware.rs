//! Components that follow the fleet (Go's `multicluster.Aware`): the public fleet events and
//! per-cluster tasks that start with a cluster's engagement and stop with it.

mod common;

use std::sync::{Arc, Mutex};

use common::*;
use futures::StreamExt;
use multicluster_runtime::providers::Clusters;
use multicluster_runtime::{Cluster, ClusterEvent, ClusterName, Manager};
use multicluster_runtime_testenv::TestEnv;

/// What the per-cluster tasks did, in order: `start:<id>:<n>` and `stop:<id>:<n>`, `n`
/// numbering the tasks.
#[derive(Clone, Default)]
struct Log(Arc<Mutex<Vec<String>>>);

impl Log {
    fn push(&self, line: String) {
        self.0.lock().unwrap().push(line);
    }
    fn lines(&self) -> Vec<String> {
        self.0.lock().unwrap().clone()
    }
    fn position(&self, line: &str) -> Option<usize> {
        self.lines().iter().position(|l| l == line)
    }
}

#[tokio::test]
async fn a_per_cluster_task_runs_for_each_engagement_and_stops_with_it() {
    let env = TestEnv::builder().clusters(2).start().await.unwrap();
    let (c0, c1) = (env.cluster(0).unwrap(), env.cluster(1).unwrap());
    let clusters = Clusters::<ClusterName>::new();
    let manager = Arc::new(Manager::new(clusters.clone()));
    let log = Log::default();
    let task_log = log.clone();
    let serial = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    manager.per_cluster("probe", move |cluster, until| {
        let log = task_log.clone();
        // Each start is numbered: the task of a replacement is a new one.
        let n = serial.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        async move {
            // The task's own work: it reaches its cluster.
            let version = cluster.client().apiserver_version().await.unwrap();
            assert!(!version.git_version.is_empty());
            log.push(format!("start:{}:{n}", cluster.id()));
            until.cancelled().await;
            log.push(format!("stop:{}:{n}", cluster.id()));
        }
    });
    let run = spawn_manager(&manager);
    clusters
        .add(Cluster::from_config(name("c0"), c0.config()).unwrap())
        .unwrap();
    eventually(30, "c0's task", async || {
        log.position("start:c0:0").is_some()
    })
    .await;
    clusters
        .add(Cluster::from_config(name("c1"), c1.config()).unwrap())
        .unwrap();
    eventually(30, "c1's task", async || {
        log.position("start:c1:1").is_some()
    })
    .await;

    // Replaced under the same id (other credentials): the old engagement's task stops and
    // a new one starts with the new cluster.
    let rotated = c0.add_user("rotated", &["system:masters"]).unwrap();
    clusters
        .add(Cluster::from_config(name("c0"), rotated.config()).unwrap())
        .unwrap();
    eventually(
        30,
        "the replaced cluster's task stopped, a new one started",
        async || log.position("stop:c0:0").is_some() && log.position("start:c0:2").is_some(),
    )
    .await;

    // Disengaged: its task stops.
    clusters.remove(&name("c0"));
    eventually(30, "the disengaged cluster's task stopped", async || {
        log.position("stop:c0:2").is_some()
    })
    .await;

    // c1's task ran through all of that and stops only at shutdown.
    manager.shutdown();
    run.await.unwrap();
    let lines = log.lines();
    let c1_stop = log
        .position("stop:c1:1")
        .expect("c1's task stopped at shutdown");
    assert!(
        c1_stop > log.position("stop:c0:2").unwrap(),
        "c1's task stopped only after everything c0 went through: {lines:?}"
    );
    assert_eq!(lines.len(), 6, "{lines:?}");
}

#[tokio::test]
async fn fleet_events_say_what_joined_and_left_with_a_token_per_engagement() {
    let env = TestEnv::builder().clusters(2).start().await.unwrap();
    let (c0, c1) = (env.cluster(0).unwrap(), env.cluster(1).unwrap());
    let clusters = Clusters::<ClusterName>::new();
    let manager = Arc::new(Manager::new(clusters.clone()));
    let run = spawn_manager(&manager);
    clusters
        .add(Cluster::from_config(name("c0"), c0.config()).unwrap())
        .unwrap();
    eventually(30, "c0 engaged", async || {
        manager.cluster(&name("c0")).is_some()
    })
    .await;
    // A subscriber that comes late first hears of every cluster engaged already.
    let mut events = manager.fleet().events();
    let Some(ClusterEvent::Engaged {
        cluster,
        until: c0_until,
    }) = events.next().await
    else {
        panic!("an Engaged event for c0 first");
    };
    assert_eq!(cluster.id(), "c0");
    clusters
        .add(Cluster::from_config(name("c1"), c1.config()).unwrap())
        .unwrap();
    let Some(ClusterEvent::Engaged {
        cluster,
        until: c1_until,
    }) = events.next().await
    else {
        panic!("an Engaged event for c1");
    };
    assert_eq!(cluster.id(), "c1");
    assert!(!c0_until.is_cancelled() && !c1_until.is_cancelled());

    let rotated = c1.add_user("rotated", &["system:masters"]).unwrap();
    clusters
        .add(Cluster::from_config(name("c1"), rotated.config()).unwrap())
        .unwrap();
    let Some(ClusterEvent::Replaced { old, new, until }) = events.next().await else {
        panic!("a Replaced event for c1");
    };
    assert_eq!((old.id().as_str(), new.id().as_str()), ("c1", "c1"));
    assert!(!old.same_instance(&new));
    c1_until.cancelled().await;
    assert!(!until.is_cancelled());

    clusters.remove(&name("c0"));
    let Some(ClusterEvent::Disengaged { cluster }) = events.next().await else {
        panic!("a Disengaged event for c0");
    };
    assert_eq!(cluster.id(), "c0");
    // Removed from its provider: it left for good, and the next event says so.
    let Some(ClusterEvent::Departed { cluster }) = events.next().await else {
        panic!("a Departed event for c0");
    };
    assert_eq!(cluster.id(), "c0");
    c0_until.cancelled().await;

    // The manager's run ends: the last engagement's token too.
    manager.shutdown();
    run.await.unwrap();
    until.cancelled().await;
}
