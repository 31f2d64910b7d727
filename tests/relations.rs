//! Relations, re-engagement, requeues and shutdown against real control planes.

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams};
use kube_runtime::watcher;
use multicluster_runtime::providers::Clusters;
use multicluster_runtime::{
    Action, Builder, Cluster, ClusterName, Context, Engaged, Manager, Request,
};
use multicluster_runtime_testenv::TestEnv;

fn secret(ns: &str, name: &str, owner: Option<OwnerReference>) -> Secret {
    Secret {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some(ns.into()),
            owner_references: owner.map(|o| vec![o]),
            ..Default::default()
        },
        ..Default::default()
    }
}

#[tokio::test]
async fn a_change_to_an_owned_object_reconciles_its_owner() {
    let env = TestEnv::start().await.unwrap();
    let c = env.cluster(0).unwrap();
    let client = c.client().unwrap();
    fixture(&client).await;
    let clusters = clusters_of([("c0", client.clone())]);
    let manager = Arc::new(Manager::new(clusters));
    let seen = Arc::new(Seen::default());
    Builder::<_, ConfigMap>::new(&manager, fixture_objects())
        .owns::<Secret>(watcher::Config::default())
        .start(record, retry_soon, seen.clone());
    let run = spawn_manager(&manager);

    let owner = "cluster://c0/zoo/elephant";
    eventually(30, "initial reconcile", async || seen.count(owner) == 1).await;
    let parent = Api::<ConfigMap>::namespaced(client.clone(), "zoo")
        .get("elephant")
        .await
        .unwrap();
    let owner_ref = OwnerReference {
        api_version: "v1".into(),
        kind: "ConfigMap".into(),
        name: "elephant".into(),
        uid: parent.metadata.uid.unwrap(),
        ..Default::default()
    };
    Api::<Secret>::namespaced(client.clone(), "zoo")
        .create(
            &PostParams::default(),
            &secret("zoo", "tusk", Some(owner_ref)),
        )
        .await
        .unwrap();
    eventually(30, "owner reconciled for its child", async || {
        seen.count(owner) == 2
    })
    .await;
    // A secret without an owner reconciles nothing. Sync point: a secret owned by the
    // keeper, created after it in the same watch, reconciles the keeper; a request for the
    // elephant would have been queued before.
    let secrets = Api::<Secret>::namespaced(client.clone(), "zoo");
    secrets
        .create(&PostParams::default(), &secret("zoo", "loose", None))
        .await
        .unwrap();
    let keeper = Api::<ConfigMap>::namespaced(client.clone(), "zoo")
        .get("keeper")
        .await
        .unwrap();
    let keeper_ref = OwnerReference {
        api_version: "v1".into(),
        kind: "ConfigMap".into(),
        name: "keeper".into(),
        uid: keeper.metadata.uid.unwrap(),
        ..Default::default()
    };
    secrets
        .create(
            &PostParams::default(),
            &secret("zoo", "badge", Some(keeper_ref)),
        )
        .await
        .unwrap();
    eventually(30, "the keeper reconciled for its secret", async || {
        seen.count("cluster://c0/zoo/keeper") == 2
    })
    .await;
    assert_eq!(seen.count(owner), 2, "the loose secret reconciled nobody");
    manager.shutdown();
    run.await.unwrap();
}

#[tokio::test]
async fn a_mapper_can_enqueue_requests_for_another_cluster() {
    let env = TestEnv::builder().clusters(2).start().await.unwrap();
    let clusters = zoo_fleet(&env).await;
    let manager = Arc::new(Manager::new(clusters));
    let seen = Arc::new(Seen::default());
    // Secrets in cluster-0 ask for the ConfigMap of the same name in cluster-1.
    Builder::<_, ConfigMap>::new(&manager, fixture_objects())
        .watches::<Secret, _>(
            watcher::Config::default(),
            |cluster: &ClusterName, s: &Secret| {
                (cluster == "cluster-0").then(|| {
                    Request::new(
                        name("cluster-1"),
                        s.metadata.namespace.clone(),
                        s.metadata.name.clone().unwrap_or_default(),
                    )
                })
            },
        )
        .start(record, retry_soon, seen.clone());
    let run = spawn_manager(&manager);

    let target = "cluster://cluster-1/jungle/elephant";
    for c in env.clusters() {
        let client = c.client().unwrap();
        eventually(30, "initial reconciles", async || {
            seen.reconciled_at_latest(c.name(), &client).await
        })
        .await;
    }
    assert_eq!(seen.count(target), 1);
    let c0 = env.cluster(0).unwrap().client().unwrap();
    Api::<Secret>::namespaced(c0, "jungle")
        .create(&PostParams::default(), &secret("jungle", "elephant", None))
        .await
        .unwrap();
    eventually(30, "the other cluster's object reconciled", async || {
        seen.count(target) == 2
    })
    .await;
    // The request went to cluster-1 only: the same secret event would have queued both.
    assert_eq!(
        seen.count("cluster://cluster-0/jungle/elephant"),
        1,
        "the watched cluster's own object is untouched"
    );
    manager.shutdown();
    run.await.unwrap();
}

#[tokio::test]
async fn a_cluster_reengaged_with_new_credentials_is_not_reconciled_twice() {
    let env = TestEnv::start().await.unwrap();
    let c = env.cluster(0).unwrap();
    fixture(&c.client().unwrap()).await;
    let clusters = Clusters::new();
    clusters
        .add(Cluster::from_config(name("c0"), c.config()).unwrap())
        .unwrap();
    let manager = Arc::new(Manager::new(clusters.clone()));
    let seen = Arc::new(Seen::default());
    Builder::<_, ConfigMap>::new(&manager, fixture_objects()).start(
        record,
        retry_soon,
        seen.clone(),
    );
    let run = spawn_manager(&manager);
    let client = c.client().unwrap();
    eventually(30, "initial reconciles", async || {
        seen.reconciled_at_latest("c0", &client).await
    })
    .await;
    let initial = seen.requests.lock().unwrap().clone();

    // The same config again changes nothing; new credentials replace the cluster.
    assert_eq!(
        clusters
            .add(Cluster::from_config(name("c0"), c.config()).unwrap())
            .unwrap(),
        Engaged::Unchanged
    );
    let rotated = c.add_user("rotated-admin", &["system:masters"]).unwrap();
    let replacement = Cluster::from_config(name("c0"), rotated.config()).unwrap();
    assert_eq!(
        clusters.add(replacement.clone()).unwrap(),
        Engaged::Replaced
    );
    eventually(10, "the new cluster's cache listed", async || {
        replacement
            .store::<ConfigMap>(&fixture_objects())
            .is_ok_and(|s| s.len() == 9)
    })
    .await;

    // Sync point: a change made after the switch is reconciled through the new cluster,
    // after whatever the switch itself queued.
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), "island");
    let patch = serde_json::json!({ "data": { "changed": "yes" } });
    cms.patch("rock", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
    eventually(30, "the change reconciled", async || {
        seen.count("cluster://c0/island/rock") == 2
    })
    .await;
    let mut expected = initial;
    expected.push("cluster://c0/island/rock".to_string());
    assert_eq!(
        *seen.requests.lock().unwrap(),
        expected,
        "unchanged objects are not reconciled again after the switch; one change, one reconcile"
    );
    manager.shutdown();
    run.await.unwrap();
}

/// Counts calls per object; fails the first two of `elephant`, then requeues it three times.
#[derive(Default)]
struct Flaky {
    calls: Mutex<HashMap<String, usize>>,
}

#[derive(Debug, thiserror::Error)]
#[error("not yet")]
struct NotYet;

async fn flaky(cm: Arc<ConfigMap>, ctx: Context<ClusterName, Flaky>) -> Result<Action, NotYet> {
    let name = cm.metadata.name.clone().unwrap_or_default();
    let n = {
        let mut calls = ctx.state().calls.lock().unwrap();
        let n = calls.entry(name.clone()).or_default();
        *n += 1;
        *n
    };
    match (name.as_str(), n) {
        ("elephant", 1 | 2) => Err(NotYet),
        ("elephant", 3..=5) => Ok(Action::requeue(Duration::from_millis(300))),
        // A timer set later and longer than the elephant's: once it fired, theirs had.
        ("clock", 1) => Ok(Action::requeue(Duration::from_millis(900))),
        _ => Ok(Action::await_change()),
    }
}

#[tokio::test]
async fn errors_are_retried_by_the_error_policy_and_requeues_come_back() {
    let env = TestEnv::start().await.unwrap();
    let c = env.cluster(0).unwrap();
    let client = c.client().unwrap();
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), "default");
    cms.create(
        &PostParams::default(),
        &config_map("default", "elephant", "animal"),
    )
    .await
    .unwrap();
    let clusters = clusters_of([("c0", client)]);
    let manager = Arc::new(Manager::new(clusters));
    let state = Arc::new(Flaky::default());
    let policy_calls = Arc::new(AtomicUsize::new(0));
    let policy = {
        let policy_calls = policy_calls.clone();
        move |_: Arc<ConfigMap>, _: &NotYet, _: &Context<ClusterName, Flaky>| {
            policy_calls.fetch_add(1, Ordering::SeqCst);
            Action::requeue(Duration::from_millis(100))
        }
    };
    Builder::<_, ConfigMap>::new(&manager, fixture_objects()).start(flaky, policy, state.clone());
    let run = spawn_manager(&manager);
    let calls = || {
        state
            .calls
            .lock()
            .unwrap()
            .get("elephant")
            .copied()
            .unwrap_or(0)
    };
    eventually(30, "two failures and three requeues", async || calls() == 6).await;
    cms.create(
        &PostParams::default(),
        &config_map("default", "clock", "thing"),
    )
    .await
    .unwrap();
    let clock = || {
        state
            .calls
            .lock()
            .unwrap()
            .get("clock")
            .copied()
            .unwrap_or(0)
    };
    eventually(30, "the clock's requeue fired", async || clock() == 2).await;
    assert_eq!(calls(), 6, "after await_change nothing more");
    assert_eq!(policy_calls.load(Ordering::SeqCst), 2);
    manager.shutdown();
    run.await.unwrap();
}

#[tokio::test]
async fn shutdown_lets_reconciles_in_flight_finish_and_starts_no_more() {
    let env = TestEnv::start().await.unwrap();
    let c = env.cluster(0).unwrap();
    let client = c.client().unwrap();
    fixture(&client).await;
    let clusters = clusters_of([("c0", client.clone())]);
    let manager = Arc::new(Manager::new(clusters));
    // The gate opens after the manager was asked to shut down.
    let (open, state) = Gated::new();
    Builder::<_, ConfigMap>::new(&manager, fixture_objects())
        .concurrency(3)
        .max_in_flight_per_cluster(3)
        .start(
            gated::<ClusterName>,
            |_, _: &kube::Error, _: &Context<ClusterName, Gated>| Action::await_change(),
            state.clone(),
        );
    let run = spawn_manager(&manager);
    eventually(30, "three reconciles started", async || {
        state.started.load(Ordering::SeqCst) == 3
    })
    .await;
    // Six more are due. Shut down, change an object, then let the three finish: slots
    // free up while requests wait, so a manager that went on dispatching would start more.
    manager.shutdown();
    Api::<ConfigMap>::namespaced(client, "zoo")
        .create(&PostParams::default(), &config_map("zoo", "late", "thing"))
        .await
        .unwrap();
    open.send(true).unwrap();
    run.await.unwrap();
    assert_eq!(
        state.finished.load(Ordering::SeqCst),
        3,
        "in-flight reconciles ran to the end"
    );
    // No wait needed: when `run` has returned, nothing the manager started runs on.
    assert_eq!(
        state.started.load(Ordering::SeqCst),
        3,
        "nothing new started after shutdown (six were due, and one more came)"
    );
}

async fn always_requeue(
    cm: Arc<ConfigMap>,
    ctx: Context<ClusterName, Flaky>,
) -> Result<Action, NotYet> {
    let name = cm.metadata.name.clone().unwrap_or_default();
    *ctx.state().calls.lock().unwrap().entry(name).or_default() += 1;
    Ok(Action::requeue(Duration::from_millis(300)))
}

#[tokio::test]
async fn a_requeue_chain_survives_the_replacement_of_its_cluster() {
    let env = TestEnv::start().await.unwrap();
    let c = env.cluster(0).unwrap();
    Api::<ConfigMap>::namespaced(c.client().unwrap(), "default")
        .create(
            &PostParams::default(),
            &config_map("default", "ticker", "thing"),
        )
        .await
        .unwrap();
    let clusters = Clusters::new();
    clusters
        .add(Cluster::from_config(name("c0"), c.config()).unwrap())
        .unwrap();
    let manager = Arc::new(Manager::new(clusters.clone()));
    let state = Arc::new(Flaky::default());
    Builder::<_, ConfigMap>::new(&manager, fixture_objects()).start(
        always_requeue,
        |_, _: &NotYet, _: &Context<ClusterName, Flaky>| Action::await_change(),
        state.clone(),
    );
    let run = spawn_manager(&manager);
    let calls = || {
        state
            .calls
            .lock()
            .unwrap()
            .get("ticker")
            .copied()
            .unwrap_or(0)
    };
    eventually(30, "the chain runs", async || calls() >= 2).await;

    // Credentials rotate while the apiserver is down: the new cluster cannot list for now,
    // and the objects must come from the replaced cluster's cache meanwhile.
    c.stop().await;
    let rotated = c.add_user("rotated", &["system:masters"]).unwrap();
    assert_eq!(
        clusters
            .add(Cluster::from_config(name("c0"), rotated.config()).unwrap())
            .unwrap(),
        Engaged::Replaced
    );
    let at_replacement = calls();
    // Without a change to the object, only the requeue chain can bring it back.
    eventually(30, "the chain goes on after the replacement", async || {
        calls() >= at_replacement + 3
    })
    .await;
    c.start().await.unwrap();
    let after_restart = calls();
    eventually(30, "and after the new cluster has listed", async || {
        calls() >= after_restart + 3
    })
    .await;
    manager.shutdown();
    run.await.unwrap();
}
