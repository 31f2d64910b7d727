//! Single-cluster mode (kube-runtime's own `Controller` underneath) against a real control
//! plane: relations, predicate, cluster filter, debounce, graceful shutdown and its timeout.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::*;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams};
use kube_runtime::watcher;
use multicluster_runtime::providers::SingleProvider;
use multicluster_runtime::{Action, Builder, Context, Manager, Request, SingleCluster};
use multicluster_runtime_testenv::TestEnv;

const SINGLE: &str = "";

fn secret(name: &str, labels: &[(&str, &str)], owner: Option<OwnerReference>) -> Secret {
    Secret {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some("zoo".into()),
            labels: Some(
                labels
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            ),
            owner_references: owner.map(|o| vec![o]),
            ..Default::default()
        },
        ..Default::default()
    }
}

async fn owner_ref(client: &kube::Client, name: &str) -> OwnerReference {
    let owner = Api::<ConfigMap>::namespaced(client.clone(), "zoo")
        .get(name)
        .await
        .unwrap();
    OwnerReference {
        api_version: "v1".into(),
        kind: "ConfigMap".into(),
        name: name.into(),
        uid: owner.metadata.uid.unwrap(),
        ..Default::default()
    }
}

/// A control plane with the fixture, and a manager of its single cluster.
async fn single_cluster() -> (TestEnv, kube::Client, Arc<Manager<SingleProvider>>) {
    let env = TestEnv::start().await.unwrap();
    let client = env.cluster(0).unwrap().client().unwrap();
    fixture(&client).await;
    let manager = Arc::new(Manager::new(SingleProvider::new(client.clone())));
    (env, client, manager)
}

async fn patch(client: &kube::Client, name: &str, patch: serde_json::Value) -> String {
    Api::<ConfigMap>::namespaced(client.clone(), "zoo")
        .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap()
        .metadata
        .resource_version
        .unwrap()
}

#[tokio::test]
async fn owned_and_watched_objects_reconcile_their_owner_and_mapped_object() {
    let (_env, client, manager) = single_cluster().await;
    let seen = Arc::new(Seen::default());
    Builder::<_, ConfigMap>::new(&manager, fixture_objects())
        .owns::<Secret>(watcher::Config::default())
        .watches::<Secret, _>(
            watcher::Config::default().labels("for"),
            |_: &SingleCluster, s: &Secret| {
                let target = s.metadata.labels.as_ref()?.get("for")?.clone();
                Some(Request::new(
                    SingleCluster,
                    s.metadata.namespace.clone(),
                    target,
                ))
            },
        )
        .start(record, retry_soon, seen.clone());
    let run = spawn_manager(&manager);
    eventually(30, "initial reconciles", async || {
        seen.reconciled_at_latest(SINGLE, &client).await
    })
    .await;

    let secrets = Api::<Secret>::namespaced(client.clone(), "zoo");
    let owned = secret("tusk", &[], Some(owner_ref(&client, "elephant").await));
    secrets
        .create(&PostParams::default(), &owned)
        .await
        .unwrap();
    eventually(30, "the owner reconciled for its secret", async || {
        seen.count("cluster:///zoo/elephant") == 2
    })
    .await;
    let watched = secret("badge", &[("for", "keeper")], None);
    secrets
        .create(&PostParams::default(), &watched)
        .await
        .unwrap();
    eventually(30, "the mapped object reconciled", async || {
        seen.count("cluster:///zoo/keeper") == 2
    })
    .await;
    manager.shutdown();
    run.await.unwrap();
}

#[tokio::test]
async fn a_predicate_filters_changes_it_does_not_care_about() {
    let (_env, client, manager) = single_cluster().await;
    let seen = Arc::new(Seen::default());
    Builder::<_, ConfigMap>::new(&manager, fixture_objects())
        .with_predicate(kube_runtime::predicates::labels)
        .start(record, retry_soon, seen.clone());
    let run = spawn_manager(&manager);
    eventually(30, "initial reconciles", async || {
        seen.reconciled_at_latest(SINGLE, &client).await
    })
    .await;
    patch(
        &client,
        "rock",
        serde_json::json!({ "data": { "note": "x" } }),
    )
    .await;
    patch(
        &client,
        "keeper",
        serde_json::json!({ "metadata": { "labels": { "extra": "yes" } } }),
    )
    .await;
    // Sync point: the keeper's change came after the rock's in the same watch.
    eventually(30, "the label change reconciled", async || {
        seen.count("cluster:///zoo/keeper") == 2
    })
    .await;
    assert_eq!(
        seen.count("cluster:///zoo/rock"),
        1,
        "a data-only change is filtered"
    );
    manager.shutdown();
    run.await.unwrap();
}

#[tokio::test]
async fn a_cluster_filter_that_refuses_the_cluster_leaves_its_controller_idle() {
    let (_env, client, manager) = single_cluster().await;
    let (refused, everything) = (Arc::new(Seen::default()), Arc::new(Seen::default()));
    let asked = Arc::new(AtomicUsize::new(0));
    Builder::<_, ConfigMap>::new(&manager, fixture_objects())
        .cluster_filter({
            let asked = asked.clone();
            move |_| {
                asked.fetch_add(1, Ordering::SeqCst);
                false
            }
        })
        .start(record, retry_soon, refused.clone());
    Builder::<_, ConfigMap>::new(&manager, fixture_objects()).start(
        record,
        retry_soon,
        everything.clone(),
    );
    let run = spawn_manager(&manager);
    eventually(
        30,
        "the other controller reconciled everything",
        async || everything.reconciled_at_latest(SINGLE, &client).await,
    )
    .await;
    // Sync point: the filter has answered (no) before the controller would have watched.
    eventually(30, "the filter asked", async || {
        asked.load(Ordering::SeqCst) >= 1
    })
    .await;
    assert_eq!(refused.total(), 0);
    manager.shutdown();
    run.await.unwrap();
}

#[tokio::test]
async fn debounce_folds_a_burst_of_changes_into_one_reconcile() {
    let (_env, client, manager) = single_cluster().await;
    let seen = Arc::new(Seen::default());
    Builder::<_, ConfigMap>::new(&manager, fixture_objects())
        .debounce(Duration::from_secs(1))
        .start(record, retry_soon, seen.clone());
    let run = spawn_manager(&manager);
    eventually(30, "initial reconciles", async || {
        seen.reconciled_at_latest(SINGLE, &client).await
    })
    .await;
    let mut versions = Vec::new();
    for n in 0..3 {
        versions.push(
            patch(
                &client,
                "rock",
                serde_json::json!({ "data": { "n": n.to_string() } }),
            )
            .await,
        );
    }
    let last = versions.pop().unwrap();
    eventually(30, "reconciled at the last version", async || {
        seen.reconciled_at("cluster:///zoo/rock", &last)
    })
    .await;
    // Once at the last version, no reconcile can see an earlier one any more.
    for skipped in &versions {
        assert!(
            !seen.reconciled_at("cluster:///zoo/rock", skipped),
            "{skipped} was folded into {last}"
        );
    }
    manager.shutdown();
    run.await.unwrap();
}

fn gated_controller(manager: &Manager<SingleProvider>, state: &Arc<Gated>) {
    Builder::<_, ConfigMap>::new(manager, fixture_objects())
        .concurrency(3)
        .start(
            gated::<SingleCluster>,
            |_, _: &kube::Error, _: &Context<SingleCluster, Gated>| Action::await_change(),
            state.clone(),
        );
}

#[tokio::test]
async fn shutdown_lets_reconciles_in_flight_finish_and_starts_no_more() {
    let (_env, client, manager) = single_cluster().await;
    let (open, state) = Gated::new();
    gated_controller(&manager, &state);
    let run = spawn_manager(&manager);
    eventually(30, "three reconciles started", async || {
        state.started.load(Ordering::SeqCst) == 3
    })
    .await;
    // Six more are due; one more object comes after the shutdown began.
    manager.shutdown();
    Api::<ConfigMap>::namespaced(client, "zoo")
        .create(&PostParams::default(), &config_map("zoo", "late", "thing"))
        .await
        .unwrap();
    open.send(true).unwrap();
    run.await.unwrap();
    assert_eq!(state.finished.load(Ordering::SeqCst), 3);
    assert_eq!(
        state.started.load(Ordering::SeqCst),
        3,
        "nothing new started"
    );
}

#[tokio::test]
async fn reconciles_still_running_after_the_graceful_timeout_are_dropped() {
    let env = TestEnv::start().await.unwrap();
    let client = env.cluster(0).unwrap().client().unwrap();
    fixture(&client).await;
    let manager = Arc::new(
        Manager::new(SingleProvider::new(client.clone()))
            .graceful_timeout(Duration::from_millis(300)),
    );
    let (_never_opened, state) = Gated::new();
    gated_controller(&manager, &state);
    let run = spawn_manager(&manager);
    eventually(30, "three reconciles started", async || {
        state.started.load(Ordering::SeqCst) == 3
    })
    .await;
    manager.shutdown();
    tokio::time::timeout(Duration::from_secs(30), run)
        .await
        .expect("run returns once the graceful timeout has passed")
        .unwrap();
    assert_eq!(state.finished.load(Ordering::SeqCst), 0);
    assert_eq!(
        state.dropped.load(Ordering::SeqCst),
        3,
        "the three were dropped by the time run returned"
    );
}

/// Whether `seen` reconciled the Secret `name` of namespace zoo.
fn reconciled(seen: &Seen, name: &str) -> bool {
    let suffix = format!("/zoo/{name}");
    seen.requests
        .lock()
        .unwrap()
        .iter()
        .any(|r| r.ends_with(&suffix))
}

#[tokio::test]
async fn a_controller_sharing_anothers_watch_carries_on_when_that_one_stops() {
    let (env, client, manager) = single_cluster().await;
    let tc = env.cluster(0).unwrap();
    let secrets = Api::<Secret>::namespaced(client.clone(), "zoo");
    let run = spawn_manager(&manager);
    let (a_seen, b_seen) = (Arc::new(Seen::default()), Arc::new(Seen::default()));
    // `a` runs the watch of Secrets (it claims it first, and has listed), `b` schedules from it.
    let a = tokio::spawn(
        Builder::<_, Secret>::new(&manager, watcher::Config::default())
            .named("a")
            .run(record, |_, _, _| Action::await_change(), a_seen.clone()),
    );
    secrets
        .create(&PostParams::default(), &secret("first", &[], None))
        .await
        .unwrap();
    eventually(30, "a reconciled first", async || {
        reconciled(&a_seen, "first")
    })
    .await;
    let b = tokio::spawn(
        Builder::<_, Secret>::new(&manager, watcher::Config::default())
            .named("b")
            .run(record, |_, _, _| Action::await_change(), b_seen.clone()),
    );
    eventually(30, "b reconciled first", async || {
        reconciled(&b_seen, "first")
    })
    .await;
    let before = tc.served_watches("secrets", true).await.unwrap();
    // `a` stops (as a controller run by hand does); `b` goes on with a watch of its own.
    a.abort();
    let _ = a.await;
    secrets
        .create(&PostParams::default(), &secret("second", &[], None))
        .await
        .unwrap();
    eventually(30, "b reconciled second after a stopped", async || {
        reconciled(&b_seen, "second")
    })
    .await;
    assert!(!reconciled(&a_seen, "second"), "a had stopped");
    // One watch of Secrets again, `b`'s where `a`'s was (the API server notices a closed
    // watch soon, not at once).
    eventually(30, "one watch of Secrets", async || {
        tc.served_watches("secrets", true).await.unwrap() == before
    })
    .await;
    manager.shutdown();
    run.await.unwrap();
    b.await.unwrap();
}
