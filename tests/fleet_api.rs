//! `FleetApi`: one client over several real apiservers, one of them stopped: per-cluster
//! results (the stopped one an error naming it, never a failed call), one-cluster calls,
//! a watch that follows the fleet, and reads of the shared caches.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, DeleteParams, ObjectMeta, PostParams};
use multicluster_runtime::providers::Clusters;
use multicluster_runtime::{Cluster, ClusterName, FleetApi, FleetApiError, Manager, watcher};
use multicluster_runtime_testenv::TestEnv;

fn settings(data: &str) -> ConfigMap {
    ConfigMap {
        metadata: ObjectMeta {
            name: Some("settings".into()),
            namespace: Some("default".into()),
            labels: Some(BTreeMap::from([("fleet".to_string(), "yes".to_string())])),
            ..Default::default()
        },
        data: Some(BTreeMap::from([("mode".to_string(), data.to_string())])),
        ..Default::default()
    }
}

fn ids<T>(results: &multicluster_runtime::PerCluster<ClusterName, T>) -> Vec<String> {
    results.successes().map(|(id, _)| id.to_string()).collect()
}

#[tokio::test]
async fn a_fleet_client_acts_on_every_cluster_and_reports_the_stopped_one_by_name() {
    let env = TestEnv::builder().clusters(3).start().await.unwrap();
    let clusters = Clusters::<ClusterName>::new();
    for (i, c) in env.clusters().iter().enumerate() {
        clusters
            .add(Cluster::new(name(&format!("c{i}")), c.client().unwrap()))
            .unwrap();
    }
    let manager = Arc::new(Manager::new(clusters.clone()));
    let run = spawn_manager(&manager);
    eventually(30, "three clusters engaged", async || {
        manager.fleet().len() == 3
    })
    .await;
    // c2's apiserver is down (its port refuses connections); the fleet still has it.
    let c2 = env.cluster(2).unwrap();
    c2.stop().await;

    let cms = FleetApi::<_, ConfigMap>::namespaced(manager.fleet(), "default")
        .timeout(Duration::from_secs(10));
    let created = cms.create(&PostParams::default(), &settings("a")).await;
    assert_eq!(created.len(), 3);
    assert_eq!(ids(&created), ["c0", "c1"]);
    let errors: Vec<&FleetApiError> = created.errors().collect();
    assert_eq!(errors.len(), 1);
    assert_eq!(errors[0].cluster(), "c2");
    assert!(
        errors[0].to_string().starts_with("cluster c2: "),
        "{}",
        errors[0]
    );

    let listed = cms
        .list(&kube::api::ListParams::default().labels("fleet"))
        .await;
    let objects: Vec<(String, String)> = listed
        .objects()
        .into_iter()
        .map(|(id, cm)| (id.to_string(), cm.metadata.name.clone().unwrap()))
        .collect();
    assert_eq!(
        objects,
        [
            ("c0".into(), "settings".into()),
            ("c1".into(), "settings".into())
        ]
    );
    assert_eq!(listed.errors().count(), 1);

    // Across all namespaces: lists work; a call on one object of a namespaced kind is
    // refused, not answered "absent" from a cluster-wide URL.
    let across = FleetApi::<_, ConfigMap>::all(manager.fleet()).timeout(Duration::from_secs(10));
    let everywhere = across
        .list(&kube::api::ListParams::default().labels("fleet"))
        .await;
    assert_eq!(everywhere.objects().len(), 2);
    let refused = across.get("settings").await;
    assert_eq!(refused.len(), 3);
    assert!(
        refused
            .errors()
            .all(|e| matches!(e, FleetApiError::NoNamespace { .. })),
        "{refused:?}"
    );
    assert!(matches!(
        across
            .delete_in(&name("c0"), "settings", &DeleteParams::default())
            .await,
        Err(FleetApiError::NoNamespace { cluster, .. }) if cluster == "c0"
    ));

    // One cluster by id; an id the fleet does not have is an error naming it.
    let c1 = name("c1");
    let one = cms.get_in(&c1, "settings").await.unwrap().unwrap();
    assert_eq!(one.data.unwrap()["mode"], "a");
    assert!(matches!(
        cms.get_in(&name("nowhere"), "settings").await,
        Err(FleetApiError::NotEngaged { cluster }) if cluster == "nowhere"
    ));

    // Server-side apply everywhere it can; then the subset without the stopped cluster
    // succeeds whole.
    let reachable = cms.clone().clusters(|c| c.id() != "c2");
    let applied = reachable
        .apply("settings", "fleet-test", &settings("b"))
        .await;
    assert!(applied.all_succeeded(), "{applied:?}");
    for c in &env.clusters()[..2] {
        let cm = Api::<ConfigMap>::namespaced(c.client().unwrap(), "default")
            .get("settings")
            .await
            .unwrap();
        assert_eq!(cm.data.unwrap()["mode"], "b");
    }
    let got = reachable.get("settings").await;
    assert!(got.successes().all(|(_, cm)| cm.is_some()));

    let deleted = cms.delete("settings", &DeleteParams::default()).await;
    assert_eq!(
        deleted.successes().map(|(_, d)| *d).collect::<Vec<_>>(),
        [true, true]
    );
    assert_eq!(deleted.errors().next().unwrap().cluster(), "c2");
    let again = reachable.delete("settings", &DeleteParams::default()).await;
    assert!(again.successes().all(|(_, d)| !d), "nothing left to delete");

    // The caches: the reachable clusters' synced stores; the stopped one times out.
    cms.create_in(&c1, &PostParams::default(), &settings("c"))
        .await
        .unwrap();
    let cached = cms
        .clone()
        .timeout(Duration::from_secs(3))
        .cached(&watcher::Config::default().labels("fleet"))
        .await;
    eventually(30, "the cached object", async || {
        cms.cached(&watcher::Config::default().labels("fleet"))
            .await
            .get(&c1)
            .is_some_and(|r| r.as_ref().is_ok_and(|objects| objects.len() == 1))
    })
    .await;
    assert!(matches!(
        cached.get(&name("c2")),
        Some(Err(FleetApiError::Timeout { .. }))
    ));
    c2.start().await.unwrap();
    manager.shutdown();
    run.await.unwrap();
}

#[tokio::test]
async fn a_fleet_watch_follows_clusters_as_they_join_and_leave() {
    let env = TestEnv::builder().clusters(2).start().await.unwrap();
    let clusters = Clusters::<ClusterName>::new();
    let manager = Arc::new(Manager::new(clusters.clone()));
    let run = spawn_manager(&manager);
    let c0 = env.cluster(0).unwrap();
    clusters
        .add(Cluster::new(name("c0"), c0.client().unwrap()))
        .unwrap();
    let cms = FleetApi::<_, ConfigMap>::namespaced(manager.fleet(), "default");
    // The API server's own watches of ConfigMaps, before ours.
    let c0_before = c0.served_watches("configmaps", false).await.unwrap();
    // The watch is read by a task of its own, as an application would: a stream is only
    // driven (and a leaving cluster's watch only closed) while someone polls it.
    let (tx, mut events) = tokio::sync::mpsc::unbounded_channel();
    let watch = cms.watch(watcher::Config::default().labels("fleet"));
    let reader = tokio::spawn(async move {
        let mut watch = std::pin::pin!(watch);
        while let Some(event) = watch.next().await {
            if tx.send(event).is_err() {
                break;
            }
        }
    });

    /// The next applied object's (cluster, data) from the watch.
    async fn next_applied(
        events: &mut tokio::sync::mpsc::UnboundedReceiver<(
            ClusterName,
            Result<watcher::Event<ConfigMap>, watcher::Error>,
        )>,
    ) -> (String, String) {
        loop {
            let (id, event) = tokio::time::timeout(Duration::from_secs(30), events.recv())
                .await
                .expect("an event within 30 s")
                .expect("the stream goes on");
            if let Ok(watcher::Event::Apply(cm) | watcher::Event::InitApply(cm)) = event {
                return (id.to_string(), cm.data.unwrap()["mode"].clone());
            }
        }
    }

    Api::<ConfigMap>::namespaced(c0.client().unwrap(), "default")
        .create(&PostParams::default(), &settings("zero"))
        .await
        .unwrap();
    assert_eq!(
        next_applied(&mut events).await,
        ("c0".into(), "zero".into())
    );
    // A cluster that joins later is watched too.
    let c1 = env.cluster(1).unwrap();
    clusters
        .add(Cluster::new(name("c1"), c1.client().unwrap()))
        .unwrap();
    Api::<ConfigMap>::namespaced(c1.client().unwrap(), "default")
        .create(&PostParams::default(), &settings("one"))
        .await
        .unwrap();
    assert_eq!(next_applied(&mut events).await, ("c1".into(), "one".into()));
    // One that leaves is not: its watch request ends (the API server's count of namespaced
    // ConfigMap watches goes back to what it was before ours; c1's stays).
    let baseline_c1 = c1.served_watches("configmaps", false).await.unwrap();
    assert_eq!(
        c0.served_watches("configmaps", false).await.unwrap(),
        c0_before + 1
    );
    clusters.remove(&name("c0"));
    eventually(30, "c0's watch closed", async || {
        c0.served_watches("configmaps", false).await.unwrap() == c0_before
    })
    .await;
    assert_eq!(
        c1.served_watches("configmaps", false).await.unwrap(),
        baseline_c1
    );
    // c1's goes on.
    let c1_cms = Api::<ConfigMap>::namespaced(c1.client().unwrap(), "default");
    let mut cm = c1_cms.get("settings").await.unwrap();
    cm.data = Some(BTreeMap::from([("mode".to_string(), "later".to_string())]));
    c1_cms
        .replace("settings", &PostParams::default(), &cm)
        .await
        .unwrap();
    assert_eq!(
        next_applied(&mut events).await,
        ("c1".into(), "later".into())
    );
    // The watch ends with the run that owns the fleet (its reader sees the stream end).
    manager.shutdown();
    run.await.unwrap();
    tokio::time::timeout(Duration::from_secs(30), reader)
        .await
        .expect("the watch ends when the run does")
        .unwrap();
}
