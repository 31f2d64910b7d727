//! What caches keep of each object, against a real API server: by default everything but
//! `managedFields` and the last-applied annotation, in every mode (a fleet's own watches, a
//! provider's shared watches, single-cluster mode); a kind's own transform on top; the whole
//! object when the manager keeps managed fields.

mod common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use common::*;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::reflector::ObjectRef;
use multicluster_runtime::providers::{Clusters, Namespaces, SingleProvider};
use multicluster_runtime::testenv::TestEnv;
use multicluster_runtime::{
    Action, Builder, Cluster, ClusterId, Context, LAST_APPLIED, Manager, Provider,
};

/// The objects the reconciler was handed, by name.
#[derive(Default)]
struct Handed(Mutex<BTreeMap<String, Arc<ConfigMap>>>);

impl Handed {
    fn get(&self, name: &str) -> Option<Arc<ConfigMap>> {
        self.0.lock().unwrap().get(name).cloned()
    }
}

async fn keep<C: ClusterId>(
    cm: Arc<ConfigMap>,
    ctx: Context<C, Handed>,
) -> Result<Action, kube::Error> {
    let name = cm.metadata.name.clone().unwrap_or_default();
    ctx.state().0.lock().unwrap().insert(name, cm);
    Ok(Action::await_change())
}

fn never<K, C: ClusterId, S>(_: Arc<K>, _: &kube::Error, _: &Context<C, S>) -> Action {
    Action::await_change()
}

/// Runs `manager` with the ConfigMap controller until it was handed `name`; returns it.
async fn handed<P: Provider>(manager: Manager<P>, name: &str) -> Arc<ConfigMap> {
    let manager = Arc::new(manager);
    let handed = Arc::new(Handed::default());
    Builder::<_, ConfigMap>::new(&manager, fixture_objects()).start(keep, never, handed.clone());
    let run = spawn_manager(&manager);
    eventually(
        30,
        &format!("the reconciler was handed {name}"),
        async || handed.get(name).is_some(),
    )
    .await;
    manager.shutdown();
    run.await.unwrap();
    handed.get(name).unwrap()
}

fn annotations(cm: &ConfigMap) -> BTreeMap<String, String> {
    cm.metadata.annotations.clone().unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn caches_drop_managed_fields_unless_kept_and_apply_the_kinds_transform_in_every_mode() {
    let env = TestEnv::start().await.unwrap();
    let tc = env.cluster(0).unwrap();
    let client = tc.client().unwrap();
    create_namespace(&client, "cached").await;
    // Applied server-side (managedFields) with the annotation `kubectl apply` leaves.
    let mut cm = config_map("cached", "applied", "t");
    cm.metadata.annotations = Some(BTreeMap::from([
        (LAST_APPLIED.to_string(), "{\"big\":\"json\"}".to_string()),
        ("team".to_string(), "blue".to_string()),
    ]));
    cm.data = Some(BTreeMap::from([("payload".to_string(), "x".repeat(1024))]));
    let stored = Api::<ConfigMap>::namespaced(client.clone(), "cached")
        .patch(
            "applied",
            &PatchParams::apply("test").force(),
            &Patch::Apply(&cm),
        )
        .await
        .unwrap();
    assert!(
        stored.metadata.managed_fields.is_some(),
        "the server keeps managed fields"
    );
    let stripped = |cm: &ConfigMap| {
        cm.metadata.managed_fields.is_none()
            && annotations(cm) == BTreeMap::from([("team".to_string(), "blue".to_string())])
            && cm.data.as_ref().is_some_and(|d| d["payload"].len() == 1024)
    };

    // A fleet's own watch, by default: stripped, in the reconcile and in the cache.
    let clusters = Clusters::new();
    let cluster = Cluster::from_config(name("fleet"), tc.config()).unwrap();
    clusters.add(cluster.clone()).unwrap();
    let manager = Manager::new(clusters);
    let seen = handed(manager, "applied").await;
    assert!(stripped(&seen), "fleet default: {:?}", seen.metadata);

    // Read from the cache of a cluster engaged by a running manager: the same.
    let clusters = Clusters::new();
    clusters.add(cluster.clone()).unwrap();
    let manager = Arc::new(Manager::new(clusters));
    let run = spawn_manager(&manager);
    eventually(30, "the cluster is engaged", async || cluster.is_engaged()).await;
    let cache = cluster
        .cache::<ConfigMap>(&fixture_objects())
        .await
        .unwrap();
    let cached = cache
        .store()
        .get(&ObjectRef::new("applied").within("cached"))
        .unwrap();
    assert!(stripped(&cached), "cache: {:?}", cached.metadata);
    manager.shutdown();
    run.await.unwrap();

    // A kind's own transform runs after the default.
    let clusters = Clusters::new();
    clusters
        .add(Cluster::from_config(name("transformed"), tc.config()).unwrap())
        .unwrap();
    let manager = Manager::new(clusters).transform(|cm: &mut ConfigMap| {
        cm.data = None;
    });
    let seen = handed(manager, "applied").await;
    assert_eq!(seen.data, None, "the kind's transform ran");
    assert!(seen.metadata.managed_fields.is_none());

    // Kept whole when asked.
    let clusters = Clusters::new();
    clusters
        .add(Cluster::from_config(name("whole"), tc.config()).unwrap())
        .unwrap();
    let seen = handed(Manager::new(clusters).keep_managed_fields(), "applied").await;
    assert!(seen.metadata.managed_fields.is_some());
    assert!(annotations(&seen).contains_key(LAST_APPLIED));

    // Single-cluster mode (kube-runtime's controller and store): the same default.
    let seen = handed(Manager::new(SingleProvider::new(client.clone())), "applied").await;
    assert!(stripped(&seen), "single mode: {:?}", seen.metadata);
    let seen = handed(
        Manager::new(SingleProvider::new(client.clone())).keep_managed_fields(),
        "applied",
    )
    .await;
    assert!(seen.metadata.managed_fields.is_some());

    // A provider's shared watch (namespaces as clusters: the host's one watch per kind).
    let seen = handed(Manager::new(Namespaces::new(client.clone())), "applied").await;
    assert!(stripped(&seen), "namespace-cluster: {:?}", seen.metadata);
}
