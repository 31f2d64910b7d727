//! Requests from elsewhere than the watches of a controller's own clusters: the manager's
//! local (host) cluster, a second provider's fleet with an id type of its own, streams the
//! user brings (`reconcile_on`, `reconcile_all_on`, `owns_stream`, `watches_stream`), and
//! relations filtered by a predicate. Fleet and single-cluster modes.

mod common;

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use common::*;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams};
use multicluster_runtime::providers::{Clusters, SingleProvider};
use multicluster_runtime::{
    Builder, Cluster, ClusterId, ClusterName, InvalidClusterId, Manager, Request, predicates,
    watcher,
};
use multicluster_runtime_testenv::TestEnv;
use tokio::sync::mpsc;

/// A cluster id of the user's own: a region and a name, `region.name` as text.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
struct Regional {
    region: String,
    name: String,
}

impl fmt::Display for Regional {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.region, self.name)
    }
}

impl ClusterId for Regional {
    fn parse(s: &str) -> Result<Self, InvalidClusterId> {
        let (region, name) = s
            .split_once('.')
            .ok_or_else(|| InvalidClusterId::new(s, "expected region.name"))?;
        Ok(Self {
            region: region.into(),
            name: name.into(),
        })
    }
}

/// A ConfigMap in `default` of `client` naming, in its data, the zoo object to reconcile.
async fn order(client: &kube::Client, name: &str, target: &str) {
    let cm = ConfigMap {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some("default".into()),
            labels: Some(BTreeMap::from([("order".to_string(), "yes".to_string())])),
            ..Default::default()
        },
        data: Some(BTreeMap::from([("target".to_string(), target.to_string())])),
        ..Default::default()
    };
    Api::<ConfigMap>::namespaced(client.clone(), "default")
        .create(&PostParams::default(), &cm)
        .await
        .unwrap();
}

fn orders() -> watcher::Config {
    watcher::Config::default().labels("order")
}

/// The zoo object an order names.
fn target_of(cm: &ConfigMap) -> Option<String> {
    cm.data.as_ref()?.get("target").cloned()
}

#[tokio::test]
async fn objects_on_the_host_and_in_a_second_providers_fleet_drive_reconciles_in_the_fleet() {
    let env = TestEnv::builder().clusters(4).start().await.unwrap();
    let clients: Vec<kube::Client> = env.clusters().iter().map(|c| c.client().unwrap()).collect();
    // Members m0, m1 (the controller's fleet), the host, and one cluster of a second
    // provider whose ids are `Regional`.
    let members = Clusters::<ClusterName>::new();
    for (i, client) in clients[..2].iter().enumerate() {
        fixture(client).await;
        members
            .add(Cluster::new(name(&format!("m{i}")), client.clone()))
            .unwrap();
    }
    let host = Cluster::new(name("host"), clients[2].clone());
    let regional = Clusters::<Regional>::new();
    let eu = Regional {
        region: "eu".into(),
        name: "hub".into(),
    };
    regional
        .add(Cluster::new(eu.clone(), clients[3].clone()))
        .unwrap();
    let second = Arc::new(Manager::new(regional));
    let manager = Arc::new(Manager::new(members).with_local(host));
    let seen = Arc::new(Seen::default());
    Builder::<_, ConfigMap>::new(&manager, fixture_objects())
        // An order on the host reconciles its target in every member.
        .watches_local(orders(), |order: &ConfigMap| {
            let target = target_of(order);
            ["m0", "m1"]
                .into_iter()
                .filter_map(move |m| Some(Request::new(name(m), Some("zoo"), target.clone()?)))
        })
        // An order in a regional cluster reconciles its target in m1 only; the mapper sees
        // the regional id, typed.
        .watches_from(
            second.fleet(),
            orders(),
            |from: &Regional, order: &ConfigMap| {
                assert_eq!(from.region, "eu");
                target_of(order).map(|t| Request::new(name("m1"), Some("zoo"), t))
            },
        )
        .start(record, retry_soon, seen.clone());
    let second_run = spawn_manager(&second);
    let run = spawn_manager(&manager);
    eventually(60, "the first reconciles", async || {
        seen.count("cluster://m0/zoo/keeper") == 1 && seen.count("cluster://m1/zoo/keeper") == 1
    })
    .await;

    order(&clients[2], "feed", "elephant").await;
    eventually(
        30,
        "the host's order reconciled in both members",
        async || {
            seen.count("cluster://m0/zoo/elephant") == 2
                && seen.count("cluster://m1/zoo/elephant") == 2
        },
    )
    .await;
    order(&clients[3], "clean", "rock").await;
    eventually(30, "the regional order reconciled in m1", async || {
        seen.count("cluster://m1/zoo/rock") == 2
    })
    .await;
    // Sync point for m0: an order on the host made after the regional one reconciles m0's
    // keeper; the regional order never reached m0.
    order(&clients[2], "greet", "keeper").await;
    eventually(30, "the later host order", async || {
        seen.count("cluster://m0/zoo/keeper") == 2
    })
    .await;
    assert_eq!(seen.count("cluster://m0/zoo/rock"), 1);
    manager.shutdown();
    second.shutdown();
    run.await.unwrap();
    second_run.await.unwrap();
}

#[tokio::test]
async fn requests_and_objects_from_the_users_own_streams_are_reconciled_in_a_fleet() {
    let env = TestEnv::builder().clusters(2).start().await.unwrap();
    let clusters = Clusters::<ClusterName>::new();
    let mut clients = Vec::new();
    for (i, c) in env.clusters().iter().enumerate() {
        let client = c.client().unwrap();
        fixture(&client).await;
        clusters
            .add(Cluster::new(name(&format!("c{i}")), client.clone()))
            .unwrap();
        clients.push(client);
    }
    let manager = Arc::new(Manager::new(clusters));
    let (requests, requests_rx) = mpsc::unbounded_channel::<Request<ClusterName>>();
    let (everything, everything_rx) = mpsc::unbounded_channel::<()>();
    let (children, children_rx) = mpsc::unbounded_channel::<(ClusterName, Arc<Secret>)>();
    let (others, others_rx) = mpsc::unbounded_channel::<(ClusterName, Arc<ConfigMap>)>();
    let seen = Arc::new(Seen::default());
    Builder::<_, ConfigMap>::new(&manager, fixture_objects())
        .reconcile_on(stream(requests_rx))
        .reconcile_all_on(stream(everything_rx))
        .owns_stream(stream(children_rx))
        .watches_stream(stream(others_rx), |id: &ClusterName, cm: &ConfigMap| {
            target_of(cm).map(|t| Request::new(id.clone(), Some("jungle"), t))
        })
        .start(record, retry_soon, seen.clone());
    let run = spawn_manager(&manager);
    eventually(60, "the first reconciles", async || seen.total() == 18).await;

    requests
        .send(Request::new(name("c1"), Some("island"), "rock"))
        .unwrap();
    eventually(30, "the request given", async || {
        seen.count("cluster://c1/island/rock") == 2
    })
    .await;

    // A child from the user's stream reconciles its owner (by owner reference).
    let keeper = Api::<ConfigMap>::namespaced(clients[0].clone(), "zoo")
        .get("keeper")
        .await
        .unwrap();
    let badge = Secret {
        metadata: ObjectMeta {
            name: Some("badge".into()),
            namespace: Some("zoo".into()),
            owner_references: Some(vec![OwnerReference {
                api_version: "v1".into(),
                kind: "ConfigMap".into(),
                name: "keeper".into(),
                uid: keeper.metadata.uid.unwrap(),
                ..Default::default()
            }]),
            ..Default::default()
        },
        ..Default::default()
    };
    children.send((name("c0"), Arc::new(badge))).unwrap();
    eventually(30, "the owner of the child given", async || {
        seen.count("cluster://c0/zoo/keeper") == 2
    })
    .await;

    // An object from the user's stream goes through the mapper.
    let note = ConfigMap {
        data: Some(BTreeMap::from([(
            "target".to_string(),
            "elephant".to_string(),
        )])),
        ..Default::default()
    };
    others.send((name("c1"), Arc::new(note))).unwrap();
    eventually(30, "the mapped object", async || {
        seen.count("cluster://c1/jungle/elephant") == 2
    })
    .await;

    // Everything, once.
    let before = seen.total();
    everything.send(()).unwrap();
    eventually(30, "every object reconciled once more", async || {
        seen.total() == before + 18
    })
    .await;
    manager.shutdown();
    run.await.unwrap();
}

#[tokio::test]
async fn given_requests_and_reconcile_all_work_with_a_single_cluster() {
    let env = TestEnv::start().await.unwrap();
    let client = env.cluster(0).unwrap().client().unwrap();
    fixture(&client).await;
    let manager = Arc::new(Manager::new(SingleProvider::new(client.clone())));
    let (requests, requests_rx) = mpsc::unbounded_channel();
    let (everything, everything_rx) = mpsc::unbounded_channel::<()>();
    let seen = Arc::new(Seen::default());
    Builder::<_, ConfigMap>::new(&manager, fixture_objects())
        .reconcile_on(stream(requests_rx))
        .reconcile_all_on(stream(everything_rx))
        .start(record, retry_soon, seen.clone());
    let run = spawn_manager(&manager);
    eventually(60, "the first reconciles", async || seen.total() == 9).await;
    requests
        .send(Request::new(Default::default(), Some("zoo"), "rock"))
        .unwrap();
    eventually(30, "the request given", async || {
        seen.count("cluster:///zoo/rock") == 2
    })
    .await;
    everything.send(()).unwrap();
    eventually(30, "every object once more", async || seen.total() == 19).await;
    manager.shutdown();
    run.await.unwrap();
}

#[tokio::test]
async fn the_users_streams_go_on_in_the_managers_next_run() {
    let env = TestEnv::start().await.unwrap();
    let client = env.cluster(0).unwrap().client().unwrap();
    fixture(&client).await;
    let clusters = Clusters::<ClusterName>::new();
    let manager = Arc::new(Manager::new(clusters.clone()));
    let (requests, requests_rx) = mpsc::unbounded_channel();
    let (everything, everything_rx) = mpsc::unbounded_channel::<()>();
    let seen = Arc::new(Seen::default());
    Builder::<_, ConfigMap>::new(&manager, fixture_objects())
        .reconcile_on(stream(requests_rx))
        .reconcile_all_on(stream(everything_rx))
        .start(record, retry_soon, seen.clone());
    clusters
        .add(Cluster::new(name("c0"), client.clone()))
        .unwrap();
    for _ in 0..2 {
        // Each run engages the cluster anew and lists its objects.
        let start = seen.total();
        let run = spawn_manager(&manager);
        eventually(60, "the run's first reconciles", async || {
            seen.total() >= start + 9
        })
        .await;
        requests
            .send(Request::new(name("c0"), Some("zoo"), "rock"))
            .unwrap();
        let rock = seen.count("cluster://c0/zoo/rock");
        eventually(30, "the request given in this run", async || {
            seen.count("cluster://c0/zoo/rock") > rock
        })
        .await;
        let before = seen.total();
        everything.send(()).unwrap();
        eventually(30, "everything again in this run", async || {
            seen.total() >= before + 9
        })
        .await;
        manager.shutdown();
        run.await.unwrap();
    }
}

/// Sets `label=value` and a data key on a ConfigMap or Secret named `name` in `zoo`.
async fn touch<K>(client: &kube::Client, name: &str, patch: serde_json::Value)
where
    K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>
        + Clone
        + serde::de::DeserializeOwned
        + fmt::Debug,
{
    Api::<K>::namespaced(client.clone(), "zoo")
        .patch(name, &PatchParams::default(), &Patch::Merge(patch))
        .await
        .unwrap();
}

fn owned_by(owner: &ConfigMap, name: &str) -> Secret {
    Secret {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some("zoo".into()),
            owner_references: Some(vec![OwnerReference {
                api_version: "v1".into(),
                kind: "ConfigMap".into(),
                name: owner.metadata.name.clone().unwrap(),
                uid: owner.metadata.uid.clone().unwrap(),
                ..Default::default()
            }]),
            ..Default::default()
        },
        ..Default::default()
    }
}

#[tokio::test]
async fn a_related_kind_filtered_by_a_predicate_triggers_on_the_changes_it_passes() {
    let env = TestEnv::start().await.unwrap();
    let client = env.cluster(0).unwrap().client().unwrap();
    fixture(&client).await;
    let clusters = clusters_of([("c0", client.clone())]);
    let manager = Arc::new(Manager::new(clusters));
    let seen = Arc::new(Seen::default());
    Builder::<_, ConfigMap>::new(&manager, fixture_objects())
        .owns_filtered::<Secret>(watcher::Config::default(), predicates::labels)
        .start(record, retry_soon, seen.clone());
    let run = spawn_manager(&manager);
    let cms = Api::<ConfigMap>::namespaced(client.clone(), "zoo");
    let secrets = Api::<Secret>::namespaced(client.clone(), "zoo");
    let elephant = cms.get("elephant").await.unwrap();
    let keeper = cms.get("keeper").await.unwrap();
    eventually(60, "the first reconciles", async || seen.total() == 9).await;
    secrets
        .create(&PostParams::default(), &owned_by(&elephant, "tusk"))
        .await
        .unwrap();
    eventually(30, "a new child passes", async || {
        seen.count("cluster://c0/zoo/elephant") == 2
    })
    .await;
    // A data change keeps the labels: filtered out. Sync point: a child of the keeper
    // created after it, in the same watch, reconciles the keeper.
    touch::<Secret>(
        &client,
        "tusk",
        serde_json::json!({"stringData": {"length": "2m"}}),
    )
    .await;
    secrets
        .create(&PostParams::default(), &owned_by(&keeper, "badge"))
        .await
        .unwrap();
    eventually(30, "the keeper's new child", async || {
        seen.count("cluster://c0/zoo/keeper") == 2
    })
    .await;
    assert_eq!(
        seen.count("cluster://c0/zoo/elephant"),
        2,
        "the data change was filtered"
    );
    // A label change passes; a deletion always does.
    touch::<Secret>(
        &client,
        "tusk",
        serde_json::json!({"metadata": {"labels": {"worn": "yes"}}}),
    )
    .await;
    eventually(30, "the label change", async || {
        seen.count("cluster://c0/zoo/elephant") == 3
    })
    .await;
    secrets.delete("tusk", &Default::default()).await.unwrap();
    eventually(30, "the deletion", async || {
        seen.count("cluster://c0/zoo/elephant") == 4
    })
    .await;
    manager.shutdown();
    run.await.unwrap();
}

#[tokio::test]
async fn a_watched_kind_filtered_by_a_predicate_in_single_cluster_mode() {
    let env = TestEnv::start().await.unwrap();
    let client = env.cluster(0).unwrap().client().unwrap();
    fixture(&client).await;
    let manager = Arc::new(Manager::new(SingleProvider::new(client.clone())));
    let seen = Arc::new(Seen::default());
    Builder::<_, ConfigMap>::new(&manager, fixture_objects())
        .watches_filtered(
            watcher::Config::default().labels("note"),
            predicates::labels,
            |id, note: &Secret| {
                let target = note.metadata.labels.as_ref()?.get("note")?.clone();
                Some(Request::new(*id, Some("zoo"), target))
            },
        )
        .start(record, retry_soon, seen.clone());
    let run = spawn_manager(&manager);
    eventually(60, "the first reconciles", async || seen.total() == 9).await;
    let secrets = Api::<Secret>::namespaced(client.clone(), "zoo");
    let mut note = Secret::default();
    note.metadata.name = Some("note".into());
    note.metadata.labels = Some(BTreeMap::from([("note".to_string(), "rock".to_string())]));
    secrets.create(&PostParams::default(), &note).await.unwrap();
    eventually(30, "the note", async || {
        seen.count("cluster:///zoo/rock") == 2
    })
    .await;
    // A data change: filtered. Sync point: a label change of the same object after it,
    // naming the keeper.
    touch::<Secret>(
        &client,
        "note",
        serde_json::json!({"stringData": {"x": "y"}}),
    )
    .await;
    touch::<Secret>(
        &client,
        "note",
        serde_json::json!({"metadata": {"labels": {"note": "keeper"}}}),
    )
    .await;
    eventually(30, "the relabelled note", async || {
        seen.count("cluster:///zoo/keeper") == 2
    })
    .await;
    assert_eq!(
        seen.count("cluster:///zoo/rock"),
        2,
        "the data change was filtered"
    );
    manager.shutdown();
    run.await.unwrap();
}

/// A channel's receiver as a stream.
fn stream<T: Send + 'static>(
    mut rx: mpsc::UnboundedReceiver<T>,
) -> impl futures::Stream<Item = T> + Send + 'static {
    futures::stream::poll_fn(move |cx| rx.poll_recv(cx))
}
