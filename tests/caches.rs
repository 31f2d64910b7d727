//! What caches keep of each object, against a real API server: by default everything but
//! `managedFields` and the last-applied annotation, in every mode (a fleet's own watches, a
//! provider's shared watches, single-cluster mode); a kind's own transform on top; the whole
//! object when the manager keeps managed fields; metadata only for `owns_metadata`. How they
//! list: streaming lists by default, pages when asked and where the server has none.

mod common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use common::*;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::core::PartialObjectMeta;
use kube::runtime::reflector::ObjectRef;
use multicluster_runtime::providers::{Clusters, Namespaces, SingleProvider};
use multicluster_runtime::{
    Action, Builder, Cluster, ClusterId, Context, LAST_APPLIED, Manager, Provider,
};
use multicluster_runtime_testenv::TestEnv;

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

/// How many cluster-wide LIST requests for ConfigMaps the API server has served (its
/// `apiserver_request_total` counter).
async fn configmap_lists(client: &kube::Client) -> u64 {
    let request = http::Request::get("/metrics").body(Vec::new()).unwrap();
    let text = client.request_text(request).await.unwrap();
    text.lines()
        .filter(|l| {
            l.starts_with("apiserver_request_total{")
                && l.contains("resource=\"configmaps\"")
                && l.contains("scope=\"cluster\"")
                && l.contains("verb=\"LIST\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// Lists ConfigMaps once (the marker), then waits until the server counted it; returns the
/// count the runs before it left, the marker's own taken off.
async fn lists_before_marker(client: &kube::Client, since: u64) -> u64 {
    Api::<ConfigMap>::all(client.clone())
        .list(&Default::default())
        .await
        .unwrap();
    let mut now = 0;
    eventually(30, "the marker list is counted", async || {
        now = configmap_lists(client).await;
        now > since
    })
    .await;
    now - since - 1
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watches_list_by_streaming_lists_unless_the_manager_asks_for_pages() {
    let env = TestEnv::start().await.unwrap();
    let tc = env.cluster(0).unwrap();
    let client = tc.client().unwrap();
    create_namespace(&client, "streamed").await;
    Api::<ConfigMap>::namespaced(client.clone(), "streamed")
        .create(&PostParams::default(), &config_map("streamed", "a", "t"))
        .await
        .unwrap();
    let before = configmap_lists(&client).await;

    // A fleet's own watch, single-cluster mode and a provider's shared watch: no list request.
    let clusters = Clusters::new();
    clusters
        .add(Cluster::from_config(name("streamed"), tc.config()).unwrap())
        .unwrap();
    handed(Manager::new(clusters), "a").await;
    handed(Manager::new(SingleProvider::new(client.clone())), "a").await;
    handed(Manager::new(Namespaces::new(client.clone())), "a").await;
    let streamed = lists_before_marker(&client, before).await;
    assert_eq!(streamed, 0, "list requests made by streaming watches");

    // Pages when asked: the same three make list requests.
    let before = configmap_lists(&client).await;
    let clusters = Clusters::new();
    clusters
        .add(Cluster::from_config(name("paged"), tc.config()).unwrap())
        .unwrap();
    handed(Manager::new(clusters).paged_lists(), "a").await;
    handed(
        Manager::new(SingleProvider::new(client.clone())).paged_lists(),
        "a",
    )
    .await;
    handed(
        Manager::new(Namespaces::new(client.clone())).paged_lists(),
        "a",
    )
    .await;
    let paged = lists_before_marker(&client, before).await;
    assert!(paged >= 3, "list requests made by paged watches: {paged}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_without_streaming_lists_is_listed_in_pages() {
    let logs = Logs::capture();
    let env = TestEnv::builder()
        .apiserver_arg("--feature-gates=WatchList=false")
        .start()
        .await
        .unwrap();
    let tc = env.cluster(0).unwrap();
    let client = tc.client().unwrap();
    create_namespace(&client, "paged").await;
    Api::<ConfigMap>::namespaced(client.clone(), "paged")
        .create(&PostParams::default(), &config_map("paged", "b", "t"))
        .await
        .unwrap();
    // The server refuses a streaming list outright.
    let refused = Api::<ConfigMap>::all(client.clone())
        .watch(&kube::api::WatchParams::streaming_lists(), "0")
        .await
        .err()
        .map(|e| e.to_string());
    assert!(
        refused
            .as_deref()
            .is_some_and(|e| e.contains("sendInitialEvents")),
        "a streaming list is refused: {refused:?}"
    );
    let before = configmap_lists(&client).await;

    // Every kind of watch falls back to pages and reconciles (it would retry for ever without).
    let clusters = Clusters::new();
    let cluster = Cluster::from_config(name("no-watch-list"), tc.config()).unwrap();
    clusters.add(cluster.clone()).unwrap();
    let manager = Arc::new(Manager::new(clusters));
    let handed_to = Arc::new(Handed::default());
    Builder::<_, ConfigMap>::new(&manager, fixture_objects()).start(keep, never, handed_to.clone());
    let run = spawn_manager(&manager);
    eventually(30, "the fleet reconciler was handed b", async || {
        handed_to.get("b").is_some()
    })
    .await;
    let status = cluster.cache_status();
    assert!(
        status.iter().all(|s| s.synced && s.error.is_none()),
        "no error left in the cache status: {status:?}"
    );
    manager.shutdown();
    run.await.unwrap();
    handed(Manager::new(SingleProvider::new(client.clone())), "b").await;
    handed(Manager::new(Namespaces::new(client.clone())), "b").await;
    let paged = lists_before_marker(&client, before).await;
    assert!(paged >= 3, "list requests after the fallback: {paged}");
    assert!(
        !logs
            .lines(&[
                "does not serve streaming lists",
                "no-watch-list",
                "ConfigMap",
                "sendInitialEvents"
            ])
            .is_empty(),
        "the fallback is logged with the cluster and the server's reason"
    );
}

/// How often each ConfigMap was reconciled.
#[derive(Default)]
struct Counts(Mutex<BTreeMap<String, usize>>);

impl Counts {
    fn of(&self, name: &str) -> usize {
        self.0.lock().unwrap().get(name).copied().unwrap_or(0)
    }
}

async fn count<C: ClusterId>(
    cm: Arc<ConfigMap>,
    ctx: Context<C, Counts>,
) -> Result<Action, kube::Error> {
    let name = cm.metadata.name.clone().unwrap_or_default();
    *ctx.state().0.lock().unwrap().entry(name).or_default() += 1;
    Ok(Action::await_change())
}

/// Runs `manager` with a ConfigMap controller owning Secrets by their metadata only; the
/// owner's reconciles: after its first (then `after_first` runs), and after its Secret
/// changed.
async fn owner_reconciled_on_child_change<P: Provider>(
    manager: Manager<P>,
    client: &kube::Client,
    ns: &str,
    round: &str,
    after_first: impl AsyncFnOnce(),
) {
    let manager = Arc::new(manager);
    let counts = Arc::new(Counts::default());
    Builder::<_, ConfigMap>::new(&manager, fixture_objects())
        .owns_metadata::<Secret>(Default::default())
        .start(count, never, counts.clone());
    let run = spawn_manager(&manager);
    eventually(30, "the owner is reconciled", async || {
        counts.of("owner") > 0
    })
    .await;
    after_first().await;
    // Its Secret's labels change (metadata: what the relation sees).
    let first = counts.of("owner");
    let patch = serde_json::json!({"metadata": {"labels": {"round": round}}});
    Api::<Secret>::namespaced(client.clone(), ns)
        .patch("child", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
    eventually(30, "the owner is reconciled for its child", async || {
        counts.of("owner") > first
    })
    .await;
    manager.shutdown();
    run.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn owned_children_watched_by_their_metadata_only_trigger_their_owner() {
    let env = TestEnv::start().await.unwrap();
    let tc = env.cluster(0).unwrap();
    let client = tc.client().unwrap();
    create_namespace(&client, "owning").await;
    let owner = Api::<ConfigMap>::namespaced(client.clone(), "owning")
        .create(&PostParams::default(), &config_map("owning", "owner", "t"))
        .await
        .unwrap();
    let child = Secret {
        metadata: kube::api::ObjectMeta {
            name: Some("child".into()),
            namespace: Some("owning".into()),
            owner_references: Some(vec![
                kube::Resource::controller_owner_ref(&owner, &()).unwrap(),
            ]),
            ..Default::default()
        },
        string_data: Some(BTreeMap::from([(
            "password".to_string(),
            "s3cret".to_string(),
        )])),
        ..Default::default()
    };
    Api::<Secret>::namespaced(client.clone(), "owning")
        .create(&PostParams::default(), &child)
        .await
        .unwrap();

    // Fleet mode; the relation's cache holds the Secret's metadata, owner reference included.
    let clusters = Clusters::new();
    let cluster = Cluster::from_config(name("owning"), tc.config()).unwrap();
    clusters.add(cluster.clone()).unwrap();
    let cached_owner = async || {
        let cache = cluster
            .cache::<PartialObjectMeta<Secret>>(&Default::default())
            .await
            .unwrap();
        let cached = cache
            .store()
            .get(&ObjectRef::new("child").within("owning"))
            .expect("the child's metadata is cached");
        assert_eq!(
            cached
                .metadata
                .owner_references
                .as_ref()
                .map(|o| o[0].name.as_str()),
            Some("owner")
        );
    };
    owner_reconciled_on_child_change(
        Manager::new(clusters),
        &client,
        "owning",
        "fleet",
        cached_owner,
    )
    .await;
    owner_reconciled_on_child_change(
        Manager::new(SingleProvider::new(client.clone())),
        &client,
        "owning",
        "single",
        async || {},
    )
    .await;
}

/// What each controller of [`one_watch_per_kind`] reconciled, and what the context cache of
/// Secrets held when it did.
#[derive(Default)]
struct Shared {
    reconciled: Mutex<std::collections::BTreeSet<(String, String)>>,
    cached: Mutex<std::collections::BTreeSet<String>>,
}

impl Shared {
    fn reconciled(&self, controller: &str, name: &str) -> bool {
        self.reconciled
            .lock()
            .unwrap()
            .contains(&(controller.to_string(), name.to_string()))
    }
    fn cached(&self, name: &str) -> bool {
        self.cached.lock().unwrap().contains(name)
    }
}

async fn create_secret(client: &kube::Client, name: &str) {
    let secret = Secret {
        metadata: kube::api::ObjectMeta {
            name: Some(name.into()),
            namespace: Some("zoo".into()),
            ..Default::default()
        },
        ..Default::default()
    };
    Api::<Secret>::namespaced(client.clone(), "zoo")
        .create(&PostParams::default(), &secret)
        .await
        .unwrap();
}

/// Runs two controllers of Secrets, whose reconciler reads a context cache of Secrets, on
/// `manager` (whose one cluster is `tc`), and returns how many more watches of Secrets the API
/// server serves once each of the three has seen a Secret created after it had listed.
async fn watches_of_two_controllers_and_a_cache<P: Provider>(
    manager: Manager<P>,
    tc: &multicluster_runtime_testenv::TestCluster,
    mode: &str,
) -> usize {
    let client = tc.client().unwrap();
    let before = tc.served_watches("secrets", true).await.unwrap();
    let manager = Arc::new(manager);
    let shared = Arc::new(Shared::default());
    for controller in ["first", "second"] {
        let builder = Builder::<_, Secret>::new(&manager, Default::default()).named(controller);
        // The second in two lanes (listed objects wait in a gate) with a predicate: the
        // filters a controller puts on a watch it shares with another.
        let builder = match controller {
            "second" => builder
                .concurrency(2)
                .changes_first(true)
                .with_predicate(|s: &Secret| {
                    Some(
                        s.metadata
                            .resource_version
                            .as_deref()
                            .unwrap_or_default()
                            .len() as u64
                            + 1,
                    )
                }),
            _ => builder,
        };
        builder.start(
            move |secret: Arc<Secret>, ctx: Context<_, Shared>| async move {
                let cache = ctx
                    .cluster()
                    .cache::<Secret>(&Default::default())
                    .await
                    .map_err(|e| kube::Error::Service(e.into()))?;
                let names: Vec<String> = cache
                    .store()
                    .state()
                    .iter()
                    .filter_map(|s| s.metadata.name.clone())
                    .collect();
                let name = secret.metadata.name.clone().unwrap_or_default();
                let held = names.contains(&name);
                ctx.state().cached.lock().unwrap().extend(names);
                ctx.state()
                    .reconciled
                    .lock()
                    .unwrap()
                    .insert((controller.to_string(), name));
                // A cache of its own (before sharing) may lag the controller's watch.
                Ok(if held {
                    Action::await_change()
                } else {
                    Action::requeue(std::time::Duration::from_millis(100))
                })
            },
            never,
            shared.clone(),
        );
    }
    let listed = format!("{mode}-listed");
    create_secret(&client, &listed).await;
    let run = spawn_manager(&manager);
    let both = async |name: &str| {
        shared.reconciled("first", name) && shared.reconciled("second", name) && shared.cached(name)
    };
    eventually(
        30,
        &format!("{mode}: both controllers reconciled {listed}"),
        async || both(&listed).await,
    )
    .await;
    // Created after every watch has listed: each of them can only hear of it through a watch.
    let live = format!("{mode}-live");
    create_secret(&client, &live).await;
    eventually(
        30,
        &format!("{mode}: both controllers and the cache saw {live}"),
        async || both(&live).await,
    )
    .await;
    let after = tc.served_watches("secrets", true).await.unwrap();
    manager.shutdown();
    run.await.unwrap();
    // Its watches are gone (the API server notices a closed watch soon, not at once).
    eventually(
        30,
        &format!("{mode}: the manager's watches ended"),
        async || tc.served_watches("secrets", true).await.unwrap() == before,
    )
    .await;
    after.saturating_sub(before)
}

#[tokio::test]
async fn two_controllers_of_a_kind_and_a_context_cache_share_one_watch_in_every_mode() {
    let env = TestEnv::start().await.unwrap();
    let tc = env.cluster(0).unwrap();
    let client = tc.client().unwrap();
    create_namespace(&client, "zoo").await;

    let single = Manager::new(SingleProvider::new(client.clone()));
    let single = watches_of_two_controllers_and_a_cache(single, &tc, "single").await;
    // kube-runtime's own watcher underneath (objects kept whole, listed in pages).
    let kube = Manager::new(SingleProvider::new(client.clone()))
        .keep_managed_fields()
        .paged_lists();
    let kube = watches_of_two_controllers_and_a_cache(kube, &tc, "kube").await;
    let clusters = Clusters::new();
    clusters
        .add(Cluster::from_config(name("fleet"), tc.config()).unwrap())
        .unwrap();
    let fleet = watches_of_two_controllers_and_a_cache(Manager::new(clusters), &tc, "fleet").await;
    assert_eq!(
        (single, kube, fleet),
        (1, 1, 1),
        "watches of Secrets opened (single mode, single mode on kube-runtime's watcher, fleet)"
    );
}
