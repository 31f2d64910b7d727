//! The runtime against real control planes: uniform reconcilers over a fleet, clusters coming
//! and going, single-cluster mode.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, PostParams};
use kube_runtime::watcher;
use multicluster_runtime::providers::{Clusters, SingleProvider};
use multicluster_runtime::{
    Action, Builder, Cluster, ClusterName, Context, Fleet, Manager, Provider, ProviderError,
};
use multicluster_runtime_testenv::TestEnv;
use tokio_util::sync::CancellationToken;

fn uniform_controller<P: Provider>(manager: &Manager<P>, seen: &Arc<Seen>) {
    Builder::<_, ConfigMap>::new(manager, watcher::Config::default()).start(
        feed_animals,
        retry_soon,
        seen.clone(),
    );
}

#[tokio::test]
async fn a_uniform_reconciler_feeds_the_animals_of_every_cluster() {
    let env = TestEnv::builder().clusters(3).start().await.unwrap();
    let clusters = zoo_fleet(&env).await;
    let manager = Arc::new(Manager::new(clusters));
    let seen = Arc::new(Seen::default());
    uniform_controller(&manager, &seen);
    let run = spawn_manager(&manager);

    for c in env.clusters() {
        let client = c.client().unwrap();
        for ns in NAMESPACES {
            eventually(30, &format!("{}/{ns}/elephant fed", c.name()), async || {
                is_fed(&client, ns, "elephant").await
            })
            .await;
            assert!(!is_fed(&client, ns, "keeper").await, "humans are not fed");
        }
    }
    assert_eq!(
        seen.clusters(),
        ["cluster-0", "cluster-1", "cluster-2"]
            .map(String::from)
            .into()
    );
    manager.shutdown();
    run.await.unwrap();
}

#[tokio::test]
async fn clusters_added_at_run_time_are_reconciled_and_removed_ones_are_let_go() {
    let env = TestEnv::builder().clusters(2).start().await.unwrap();
    let (c0, c1) = (env.cluster(0).unwrap(), env.cluster(1).unwrap());
    fixture(&c0.client().unwrap()).await;
    fixture(&c1.client().unwrap()).await;
    let clusters = Clusters::new();
    let first = Cluster::new(name("cluster-0"), c0.client().unwrap());
    let weak_first = first.downgrade();
    clusters.add(first).unwrap();
    let manager = Arc::new(Manager::new(clusters.clone()));
    let seen = Arc::new(Seen::default());
    uniform_controller(&manager, &seen);
    let run = spawn_manager(&manager);

    let client0 = c0.client().unwrap();
    eventually(30, "cluster-0 fed", async || {
        is_fed(&client0, "zoo", "elephant").await
    })
    .await;
    assert_eq!(seen.count("cluster://cluster-1/zoo/elephant"), 0);

    clusters
        .add(Cluster::new(name("cluster-1"), c1.client().unwrap()))
        .unwrap();
    let client1 = c1.client().unwrap();
    eventually(30, "cluster-1 fed after it was added", async || {
        is_fed(&client1, "zoo", "elephant").await
    })
    .await;

    assert!(clusters.remove(&name("cluster-0")));
    // Nothing keeps the removed cluster alive: watches, stores and queues were let go.
    eventually(10, "cluster-0's handle freed", async || {
        weak_first.upgrade().is_none()
    })
    .await;
    Api::<ConfigMap>::namespaced(client0.clone(), "zoo")
        .create(&PostParams::default(), &config_map("zoo", "lion", "animal"))
        .await
        .unwrap();
    Api::<ConfigMap>::namespaced(client1.clone(), "zoo")
        .create(&PostParams::default(), &config_map("zoo", "lion", "animal"))
        .await
        .unwrap();
    eventually(30, "the lion of cluster-1 fed", async || {
        is_fed(&client1, "zoo", "lion").await
    })
    .await;
    assert!(
        !is_fed(&client0, "zoo", "lion").await,
        "a removed cluster is not reconciled"
    );
    assert_eq!(seen.count("cluster://cluster-0/zoo/lion"), 0);

    manager.shutdown();
    run.await.unwrap();
}

#[tokio::test]
async fn a_controller_added_after_clusters_were_engaged_reconciles_them() {
    let env = TestEnv::builder().clusters(2).start().await.unwrap();
    let clusters = zoo_fleet(&env).await;
    let manager = Arc::new(Manager::new(clusters));
    let run = spawn_manager(&manager);
    eventually(10, "both clusters engaged", async || {
        manager.fleet().len() == 2
    })
    .await;

    let seen = Arc::new(Seen::default());
    uniform_controller(&manager, &seen);
    for c in env.clusters() {
        let client = c.client().unwrap();
        eventually(30, &format!("{} fed", c.name()), async || {
            is_fed(&client, "island", "elephant").await
        })
        .await;
    }
    manager.shutdown();
    run.await.unwrap();
}

#[tokio::test]
async fn the_same_reconciler_runs_in_single_cluster_mode() {
    let env = TestEnv::start().await.unwrap();
    let c = env.cluster(0).unwrap();
    let client = c.client().unwrap();
    fixture(&client).await;
    let manager = Arc::new(Manager::new(SingleProvider::new(client.clone())));
    let seen = Arc::new(Seen::default());
    // `feed_animals` is the function the fleet tests use, here with C = SingleCluster.
    uniform_controller(&manager, &seen);
    let run = spawn_manager(&manager);
    for ns in NAMESPACES {
        eventually(30, &format!("{ns}/elephant fed"), async || {
            is_fed(&client, ns, "elephant").await
        })
        .await;
    }
    // Every object reconciled, printed with the empty id; only animals fed.
    for ns in NAMESPACES {
        for name in ["elephant", "keeper", "rock"] {
            let request = format!("cluster:///{ns}/{name}");
            eventually(30, &format!("{request} reconciled"), async || {
                seen.count(&request) >= 1
            })
            .await;
        }
        assert!(!is_fed(&client, ns, "keeper").await && !is_fed(&client, ns, "rock").await);
    }
    assert!(
        seen.requests
            .lock()
            .unwrap()
            .iter()
            .all(|r| r.starts_with("cluster:///")),
        "the single cluster's requests have the empty id"
    );
    manager.shutdown();
    tokio::time::timeout(Duration::from_secs(40), run)
        .await
        .unwrap()
        .unwrap();
}

#[tokio::test]
async fn both_modes_log_a_reconcile_with_the_same_span_fields() {
    let logs = Logs::capture();
    let env = TestEnv::start().await.unwrap();
    let c = env.cluster(0).unwrap();
    let client = c.client().unwrap();
    fixture(&client).await;
    let single = Arc::new(Manager::new(SingleProvider::new(client.clone())));
    let fleet = Arc::new(Manager::new(Clusters::new()));
    fleet
        .provider()
        .add(Cluster::new(name("spans-fleet"), client.clone()))
        .unwrap();
    let seen = Arc::new(Seen::default());
    uniform_controller(&single, &seen);
    uniform_controller(&fleet, &seen);
    let (run_single, run_fleet) = (spawn_manager(&single), spawn_manager(&fleet));
    for cluster in ["single", "spans-fleet"] {
        eventually(30, &format!("{cluster} logged"), async || {
            !logs
                .lines(&["feed_animals reconciling", &format!(" cluster={cluster} ")])
                .is_empty()
        })
        .await;
        for line in logs.lines(&["feed_animals reconciling", &format!(" cluster={cluster} ")]) {
            let span = line
                .split_once("reconcile{")
                .and_then(|(_, rest)| rest.split_once('}'))
                .map(|(fields, _)| fields.to_string())
                .unwrap_or_else(|| panic!("no reconcile span: {line}"));
            for field in ["controller=", " cluster=", " object=", " reason="] {
                assert!(span.contains(field), "{field} missing: {line}");
            }
            assert!(!span.contains("cluster= "), "an empty cluster: {line}");
        }
    }
    single.shutdown();
    fleet.shutdown();
    run_single.await.unwrap();
    run_fleet.await.unwrap();
}

#[tokio::test]
async fn a_field_index_registered_once_serves_clusters_engaged_before_and_after() {
    let env = TestEnv::builder().clusters(2).start().await.unwrap();
    for c in env.clusters() {
        fixture(&c.client().unwrap()).await;
    }
    let (c0, c1) = (env.cluster(0).unwrap(), env.cluster(1).unwrap());
    let clusters = clusters_of([("cluster-0", c0.client().unwrap())]);
    let manager = Arc::new(Manager::new(clusters.clone()));
    manager.index_field::<ConfigMap>("type", label_type);
    let run = spawn_manager(&manager);
    eventually(10, "cluster-0 engaged", async || manager.fleet().len() == 1).await;

    let animals = async |id: &str| match manager.cluster(&name(id)) {
        Some(c) => c
            .cache::<ConfigMap>(&fixture_objects())
            .await
            .unwrap()
            .indexed("type", "animal")
            .unwrap()
            .len(),
        None => 0,
    };
    eventually(30, "3 animals indexed in cluster-0", async || {
        animals("cluster-0").await == 3
    })
    .await;

    clusters
        .add(Cluster::new(name("cluster-1"), c1.client().unwrap()))
        .unwrap();
    eventually(30, "3 animals indexed in the later cluster-1", async || {
        animals("cluster-1").await == 3
    })
    .await;
    Api::<ConfigMap>::namespaced(c1.client().unwrap(), "zoo")
        .create(&PostParams::default(), &config_map("zoo", "lion", "animal"))
        .await
        .unwrap();
    eventually(30, "the new animal indexed", async || {
        animals("cluster-1").await == 4
    })
    .await;

    // Registering the same index again changes nothing.
    manager.index_field::<ConfigMap>("type", label_type);
    assert_eq!(animals("cluster-1").await, 4);
    let cluster1 = manager.cluster(&name("cluster-1")).unwrap();
    let cache = cluster1
        .cache::<ConfigMap>(&fixture_objects())
        .await
        .unwrap();
    assert_eq!(cache.indexed("type", "human").unwrap().len(), 3);
    let err = cache.indexed("colour", "red").unwrap_err();
    assert!(
        err.to_string().contains("cluster-1") && err.to_string().contains("colour"),
        "{err}"
    );

    manager.shutdown();
    run.await.unwrap();
}

#[tokio::test]
async fn local_provider_and_filtered_clusters_and_predicates_decide_what_is_reconciled() {
    let env = TestEnv::builder().clusters(3).start().await.unwrap();
    for c in env.clusters() {
        fixture(&c.client().unwrap()).await;
    }
    let clusters = Clusters::new();
    for c in env.clusters().iter().take(2) {
        clusters
            .add(Cluster::new(name(c.name()), c.client().unwrap()))
            .unwrap();
    }
    let local = env.cluster(2).unwrap();
    let manager = Arc::new(
        Manager::new(clusters).with_local(Cluster::new(name("host"), local.client().unwrap())),
    );
    let only_local = Arc::new(Seen::default());
    Builder::<_, ConfigMap>::new(&manager, fixture_objects())
        .engage_local(true)
        .engage_provider(false)
        .start(record, retry_soon, only_local.clone());
    let only_cluster1 = Arc::new(Seen::default());
    let asked = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    Builder::<_, ConfigMap>::new(&manager, fixture_objects())
        .cluster_filter({
            let asked = asked.clone();
            move |c| {
                asked.lock().unwrap().push(c.id().to_string());
                c.id() == "cluster-1"
            }
        })
        .start(record, retry_soon, only_cluster1.clone());
    let label_changes = Arc::new(Seen::default());
    Builder::<_, ConfigMap>::new(&manager, fixture_objects())
        .with_predicate(kube_runtime::predicates::labels)
        .start(record, retry_soon, label_changes.clone());
    let run = spawn_manager(&manager);

    let (c0, c1) = (
        env.cluster(0).unwrap().client().unwrap(),
        env.cluster(1).unwrap().client().unwrap(),
    );
    let host = local.client().unwrap();
    eventually(30, "local reconciles", async || {
        only_local.reconciled_at_latest("host", &host).await
    })
    .await;
    eventually(30, "cluster-1 reconciles", async || {
        only_cluster1.reconciled_at_latest("cluster-1", &c1).await
    })
    .await;
    eventually(30, "provider clusters reconciled", async || {
        label_changes.reconciled_at_latest("cluster-0", &c0).await
            && label_changes.reconciled_at_latest("cluster-1", &c1).await
    })
    .await;
    // Sync point for the filter: it was asked about cluster-0 (and said no).
    eventually(30, "the filter asked about cluster-0", async || {
        asked.lock().unwrap().iter().any(|id| id == "cluster-0")
    })
    .await;
    assert_eq!(only_local.clusters(), ["host".to_string()].into());
    assert_eq!(only_cluster1.clusters(), ["cluster-1".to_string()].into());
    assert_eq!(
        label_changes.clusters(),
        ["cluster-0".to_string(), "cluster-1".to_string()].into(),
        "the local cluster is not engaged unless asked for"
    );

    let cms: Api<ConfigMap> = Api::namespaced(c0.clone(), "zoo");
    let data = serde_json::json!({ "data": { "note": "same labels" } });
    cms.patch(
        "rock",
        &kube::api::PatchParams::default(),
        &kube::api::Patch::Merge(&data),
    )
    .await
    .unwrap();
    let labels = serde_json::json!({ "metadata": { "labels": { "extra": "yes" } } });
    cms.patch(
        "keeper",
        &kube::api::PatchParams::default(),
        &kube::api::Patch::Merge(&labels),
    )
    .await
    .unwrap();
    // Sync point: the keeper's change came after the rock's in the same watch.
    eventually(30, "the label change reconciled", async || {
        label_changes.count("cluster://cluster-0/zoo/keeper") == 2
    })
    .await;
    assert_eq!(
        label_changes.count("cluster://cluster-0/zoo/rock"),
        1,
        "a data-only change is filtered out"
    );
    manager.shutdown();
    run.await.unwrap();
}

#[tokio::test]
async fn debounce_folds_a_burst_of_changes_into_one_reconcile_in_fleet_mode() {
    let env = TestEnv::start().await.unwrap();
    let client = env.cluster(0).unwrap().client().unwrap();
    fixture(&client).await;
    let clusters = clusters_of([("c0", client.clone())]);
    let manager = Arc::new(Manager::new(clusters));
    let seen = Arc::new(Seen::default());
    Builder::<_, ConfigMap>::new(&manager, fixture_objects())
        .debounce(Duration::from_secs(1))
        .start(record, retry_soon, seen.clone());
    let run = spawn_manager(&manager);
    eventually(30, "initial reconciles", async || {
        seen.reconciled_at_latest("c0", &client).await
    })
    .await;
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), "zoo");
    let mut versions = Vec::new();
    for n in 0..3 {
        let patch = serde_json::json!({ "data": { "n": n.to_string() } });
        let patched = cms
            .patch(
                "rock",
                &kube::api::PatchParams::default(),
                &kube::api::Patch::Merge(&patch),
            )
            .await
            .unwrap();
        versions.push(patched.metadata.resource_version.unwrap());
    }
    let last = versions.pop().unwrap();
    eventually(30, "reconciled at the last version", async || {
        seen.reconciled_at("cluster://c0/zoo/rock", &last)
    })
    .await;
    for skipped in &versions {
        assert!(!seen.reconciled_at("cluster://c0/zoo/rock", skipped));
    }
    manager.shutdown();
    run.await.unwrap();
}

/// Waits in every reconcile until the context is cancelled, then notes it.
#[derive(Default)]
struct Waiting {
    started: std::sync::atomic::AtomicUsize,
    cancelled: std::sync::atomic::AtomicUsize,
}

async fn wait_for_cancel(
    _: Arc<ConfigMap>,
    ctx: Context<ClusterName, Waiting>,
) -> Result<Action, kube::Error> {
    use std::sync::atomic::Ordering;
    ctx.state().started.fetch_add(1, Ordering::SeqCst);
    ctx.cancelled().await;
    assert!(ctx.is_cancelled());
    ctx.state().cancelled.fetch_add(1, Ordering::SeqCst);
    Ok(Action::await_change())
}

#[tokio::test]
async fn a_reconcile_waiting_on_its_context_is_told_when_its_cluster_leaves() {
    use std::sync::atomic::Ordering;
    let env = TestEnv::start().await.unwrap();
    let client = env.cluster(0).unwrap().client().unwrap();
    fixture(&client).await;
    let clusters = clusters_of([("c0", client.clone())]);
    let manager = Arc::new(Manager::new(clusters.clone()));
    let state = Arc::new(Waiting::default());
    Builder::<_, ConfigMap>::new(&manager, fixture_objects())
        .concurrency(2)
        .max_in_flight_per_cluster(2)
        .start(
            wait_for_cancel,
            |_, _: &kube::Error, _: &Context<_, Waiting>| Action::await_change(),
            state.clone(),
        );
    let run = spawn_manager(&manager);
    eventually(30, "two reconciles waiting", async || {
        state.started.load(Ordering::SeqCst) == 2
    })
    .await;
    assert_eq!(state.cancelled.load(Ordering::SeqCst), 0);
    clusters.remove(&name("c0"));
    eventually(30, "both told their cluster left", async || {
        state.cancelled.load(Ordering::SeqCst) == 2
    })
    .await;
    manager.shutdown();
    run.await.unwrap();
}

/// Engages one cluster until the test cancels its token.
struct Until {
    cluster: Cluster<ClusterName>,
    token: CancellationToken,
}

impl Provider for Until {
    type Id = ClusterName;

    async fn run(
        &self,
        fleet: Fleet<ClusterName>,
        shutdown: CancellationToken,
    ) -> Result<(), ProviderError> {
        fleet.engage_until(self.cluster.clone(), self.token.clone())?;
        shutdown.cancelled().await;
        Ok(())
    }
}

#[tokio::test]
async fn a_cluster_engaged_until_a_token_leaves_when_the_token_is_cancelled() {
    let env = TestEnv::start().await.unwrap();
    let client = env.cluster(0).unwrap().client().unwrap();
    fixture(&client).await;
    let token = CancellationToken::new();
    let manager = Arc::new(Manager::new(Until {
        cluster: Cluster::new(name("until"), client.clone()),
        token: token.clone(),
    }));
    let seen = Arc::new(Seen::default());
    Builder::<_, ConfigMap>::new(&manager, fixture_objects()).start(
        record,
        retry_soon,
        seen.clone(),
    );
    let run = spawn_manager(&manager);
    eventually(30, "reconciled while engaged", async || {
        seen.reconciled_at_latest("until", &client).await
    })
    .await;
    let engaged = manager.cluster(&name("until")).unwrap();
    token.cancel();
    eventually(30, "disengaged with the token", async || {
        manager.cluster(&name("until")).is_none()
    })
    .await;
    tokio::time::timeout(Duration::from_secs(30), engaged.disengaged())
        .await
        .expect("the cluster's handle sees the end of its engagement");
    manager.shutdown();
    run.await.unwrap();
}

#[tokio::test]
async fn a_provider_cluster_with_the_local_clusters_id_is_refused_by_the_fleet() {
    let logs = Logs::capture();
    let env = TestEnv::builder().clusters(2).start().await.unwrap();
    let (local, other) = (
        env.cluster(0).unwrap().client().unwrap(),
        env.cluster(1).unwrap().client().unwrap(),
    );
    let cms = |c: &kube::Client| Api::<ConfigMap>::namespaced(c.clone(), "default");
    cms(&local)
        .create(
            &PostParams::default(),
            &config_map("default", "only-local", "thing"),
        )
        .await
        .unwrap();
    cms(&other)
        .create(
            &PostParams::default(),
            &config_map("default", "only-other", "thing"),
        )
        .await
        .unwrap();
    let clusters = clusters_of([("twin", other.clone())]);
    let manager =
        Arc::new(Manager::new(clusters).with_local(Cluster::new(name("twin"), local.clone())));
    let seen = Arc::new(Seen::default());
    Builder::<_, ConfigMap>::new(&manager, fixture_objects())
        .named("twins")
        .engage_local(true)
        .start(record, retry_soon, seen.clone());
    let run = spawn_manager(&manager);
    let (a, b) = (
        "cluster://twin/default/only-local",
        "cluster://twin/default/only-other",
    );
    // The fleet refuses the provider's cluster of the local cluster's id (its webhook
    // reviews and `cluster_by_id` would be taken for the host's); the local one is served.
    eventually(
        30,
        "the local twin reconciled and the provider's refused",
        async || {
            seen.count(a) >= 1
                && !logs
                    .lines(&["cannot engage cluster twin: the manager's local cluster has that id"])
                    .is_empty()
        },
    )
    .await;
    assert!(
        manager.fleet().get(&name("twin")).is_none(),
        "the provider's twin is not a fleet member"
    );
    assert_eq!(
        seen.count(b),
        0,
        "only the local one is reconciled: {:?}",
        seen.requests.lock().unwrap()
    );
    manager.shutdown();
    run.await.unwrap();
}
