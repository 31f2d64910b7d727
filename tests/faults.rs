//! The runtime under real faults: watch gaps and relists, replacements during outages,
//! managers stopped and started again, bounded shutdown, panicking user code.
//!
//! No assertion here proves that something did NOT happen by waiting: each waits for a later
//! event that shows the earlier one was processed (a sync point).

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use common::*;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, DeleteParams, PostParams};
use kube_runtime::watcher;
use multicluster_runtime::providers::{Clusters, SingleProvider};
use multicluster_runtime::{Action, Builder, Cluster, ClusterId, Context, Engaged, Manager};
use multicluster_runtime_testenv::{TestCluster, TestEnv};

/// What a reconciler saw, with the phase of the test it saw it in.
#[derive(Default)]
struct Phased {
    phase: AtomicUsize,
    seen: std::sync::Mutex<Vec<(usize, String)>>,
}

impl Phased {
    fn count(&self, phase: usize, request: &str) -> usize {
        self.seen
            .lock()
            .unwrap()
            .iter()
            .filter(|(p, r)| *p == phase && r == request)
            .count()
    }
    fn total(&self) -> usize {
        self.seen.lock().unwrap().len()
    }
}

async fn record_phase<C: ClusterId>(
    _: Arc<ConfigMap>,
    ctx: Context<C, Phased>,
) -> Result<Action, kube::Error> {
    let phase = ctx.state().phase.load(Ordering::SeqCst);
    ctx.state()
        .seen
        .lock()
        .unwrap()
        .push((phase, ctx.request().to_string()));
    Ok(Action::await_change())
}

fn never_retry<K, C: ClusterId, S, E>(_: Arc<K>, _: &E, _: &Context<C, S>) -> Action {
    Action::await_change()
}

async fn create(client: &kube::Client, cm: ConfigMap) {
    let ns = cm.metadata.namespace.clone().unwrap();
    Api::<ConfigMap>::namespaced(client.clone(), &ns)
        .create(&PostParams::default(), &cm)
        .await
        .unwrap();
}

async fn delete(client: &kube::Client, ns: &str, name: &str) {
    Api::<ConfigMap>::namespaced(client.clone(), ns)
        .delete(name, &DeleteParams::default())
        .await
        .unwrap();
}

/// Opens a watch gap that ends in a relist: the relay drops the controller's connections,
/// `during` changes the cluster directly, and the apiserver restarts, so the controller's
/// watches come back with a resourceVersion the new apiserver no longer serves (410 Gone).
async fn watch_gap(cluster: &TestCluster, relay: &Relay, during: impl AsyncFnOnce(&kube::Client)) {
    relay.cut();
    during(&cluster.client().unwrap()).await;
    cluster.stop().await;
    cluster.start().await.unwrap();
    relay.restore();
}

// ---- lifecycle ----------------------------------------------------------------------

/// Two managers, one after the other, on clones of `provider` (which reaches a cluster with
/// the fixture): each reconciles everything.
async fn two_managers_in_turn<P: multicluster_runtime::Provider + Clone>(provider: P) {
    for round in 0..2 {
        let manager = Arc::new(Manager::new(provider.clone()));
        let seen = Arc::new(Seen::default());
        Builder::<_, ConfigMap>::new(&manager, fixture_objects()).start(
            record,
            retry_soon,
            seen.clone(),
        );
        let run = spawn_manager(&manager);
        eventually(30, &format!("round {round} reconciled"), async || {
            seen.total() >= 9
        })
        .await;
        manager.shutdown();
        run.await.unwrap();
    }
}

#[tokio::test]
async fn a_second_manager_runs_on_the_same_fleet_provider() {
    let env = TestEnv::start().await.unwrap();
    let c = env.cluster(0).unwrap();
    fixture(&c.client().unwrap()).await;
    let clusters = clusters_of([("c0", c.client().unwrap())]);
    two_managers_in_turn(clusters).await;
}

#[tokio::test]
async fn a_second_manager_runs_on_the_same_single_provider() {
    let env = TestEnv::start().await.unwrap();
    let c = env.cluster(0).unwrap();
    fixture(&c.client().unwrap()).await;
    two_managers_in_turn(SingleProvider::new(c.client().unwrap())).await;
}

#[tokio::test]
async fn the_same_manager_runs_again_with_its_controllers() {
    let env = TestEnv::start().await.unwrap();
    let c = env.cluster(0).unwrap();
    fixture(&c.client().unwrap()).await;
    let clusters = clusters_of([("c0", c.client().unwrap())]);
    let manager = Arc::new(Manager::new(clusters));
    let seen = Arc::new(Seen::default());
    Builder::<_, ConfigMap>::new(&manager, fixture_objects()).start(
        record,
        retry_soon,
        seen.clone(),
    );
    for round in 1..=2 {
        let run = spawn_manager(&manager);
        // Each run starts the controller afresh: it lists and reconciles everything again.
        eventually(30, &format!("run {round} reconciled"), async || {
            seen.count("cluster://c0/zoo/elephant") >= round
        })
        .await;
        manager.shutdown();
        run.await.unwrap();
        assert!(
            manager.fleet().is_empty(),
            "a stopped manager engages nothing"
        );
    }
}

/// A reconcile that never ends by itself; it sets its flag when it is dropped.
#[derive(Default)]
struct Stuck {
    started: AtomicUsize,
    dropped: Arc<AtomicBool>,
}

async fn stuck<C: ClusterId>(
    _: Arc<ConfigMap>,
    ctx: Context<C, Stuck>,
) -> Result<Action, kube::Error> {
    let _flag = DropFlag(ctx.state().dropped.clone());
    ctx.state().started.fetch_add(1, Ordering::SeqCst);
    std::future::pending::<()>().await;
    Ok(Action::await_change())
}

#[tokio::test]
async fn single_mode_shutdown_is_bounded_by_the_graceful_timeout() {
    let env = TestEnv::start().await.unwrap();
    let c = env.cluster(0).unwrap();
    fixture(&c.client().unwrap()).await;
    let manager = Arc::new(
        Manager::new(SingleProvider::new(c.client().unwrap()))
            .graceful_timeout(Duration::from_secs(1)),
    );
    let state = Arc::new(Stuck::default());
    Builder::<_, ConfigMap>::new(&manager, fixture_objects()).start(
        stuck,
        never_retry,
        state.clone(),
    );
    let run = spawn_manager(&manager);
    eventually(30, "a reconcile started", async || {
        state.started.load(Ordering::SeqCst) > 0
    })
    .await;
    manager.shutdown();
    tokio::time::timeout(Duration::from_secs(30), run)
        .await
        .expect("run returned within its graceful timeout (plus slack)")
        .unwrap();
    assert!(
        state.dropped.load(Ordering::SeqCst),
        "the reconcile still in flight was dropped, not left running"
    );
}

#[tokio::test]
async fn nothing_a_manager_started_runs_after_run_returned() {
    let env = TestEnv::start().await.unwrap();
    let c = env.cluster(0).unwrap();
    fixture(&c.client().unwrap()).await;
    let clusters = clusters_of([("c0", c.client().unwrap())]);
    let manager = Arc::new(Manager::new(clusters).graceful_timeout(Duration::from_secs(1)));
    let state = Arc::new(Stuck::default());
    Builder::<_, ConfigMap>::new(&manager, fixture_objects()).start(
        stuck,
        never_retry,
        state.clone(),
    );
    // A task of the user's that ignores shutdown.
    let task_dropped = Arc::new(AtomicBool::new(false));
    let flag = DropFlag(task_dropped.clone());
    manager.add(async move {
        let _flag = flag;
        std::future::pending::<()>().await;
    });
    let run = spawn_manager(&manager);
    eventually(30, "reconciles started", async || {
        state.started.load(Ordering::SeqCst) > 0
    })
    .await;
    manager.shutdown();
    tokio::time::timeout(Duration::from_secs(30), run)
        .await
        .unwrap()
        .unwrap();
    assert!(state.dropped.load(Ordering::SeqCst), "reconciles dropped");
    assert!(task_dropped.load(Ordering::SeqCst), "added tasks dropped");
}

// ---- watch gaps ---------------------------------------------------------------------

/// A child in one cluster (through a relay) points at its parent in another; the parent's
/// controller watches children there and maps them to the parent.
#[tokio::test]
async fn a_delete_missed_during_a_watch_gap_reaches_the_mapper() {
    let env = TestEnv::builder().clusters(2).start().await.unwrap();
    let (hub, edge) = (env.cluster(0).unwrap(), env.cluster(1).unwrap());
    let (hub_client, edge_client) = (hub.client().unwrap(), edge.client().unwrap());
    create(&hub_client, config_map("default", "parent", "parent")).await;
    let mut child = config_map("default", "child", "child");
    child
        .metadata
        .labels
        .as_mut()
        .unwrap()
        .insert("parent".into(), "parent".into());
    create(&edge_client, child).await;
    let relay = Relay::start(edge.server()).await;

    let clusters = clusters_of([("hub", hub_client.clone())]);
    clusters
        .add(Cluster::from_config(name("edge"), relay.config(edge.config())).unwrap())
        .unwrap();
    let manager = Arc::new(Manager::new(clusters));
    let state = Arc::new(Phased::default());
    Builder::<_, ConfigMap>::new(&manager, watcher::Config::default().labels("type=parent"))
        .watches::<ConfigMap, _>(
            watcher::Config::default().labels("type=child"),
            |_, child: &ConfigMap| {
                let parent = child.metadata.labels.as_ref().and_then(|l| l.get("parent"));
                parent.map(|p| multicluster_runtime::Request::new(name("hub"), Some("default"), p))
            },
        )
        .start(record_phase, never_retry, state.clone());
    let run = spawn_manager(&manager);
    eventually(30, "the parent reconciled", async || {
        state.count(0, "cluster://hub/default/parent") > 0
    })
    .await;

    state.phase.store(1, Ordering::SeqCst);
    watch_gap(&edge, &relay, async |client| {
        delete(client, "default", "child").await
    })
    .await;
    eventually(
        60,
        "the parent reconciled for its vanished child",
        async || state.count(1, "cluster://hub/default/parent") > 0,
    )
    .await;
    manager.shutdown();
    run.await.unwrap();
}

fn labelled(ns: &str, name: &str) -> ConfigMap {
    config_map(ns, name, "animal")
}

/// The same scenario in both modes: an object deleted and created again under the same name
/// and labels during a watch gap is reconciled after the relist, with a label predicate.
async fn recreated_across_a_relist<P: multicluster_runtime::Provider>(
    make: impl FnOnce(kube::Config) -> P,
) {
    let env = TestEnv::start().await.unwrap();
    let c = env.cluster(0).unwrap();
    let client = c.client().unwrap();
    create(&client, labelled("default", "phoenix")).await;
    create(&client, labelled("default", "witness")).await;
    let relay = Relay::start(c.server()).await;
    let manager = Arc::new(Manager::new(make(relay.config(c.config()))));
    let state = Arc::new(Phased::default());
    Builder::<_, ConfigMap>::new(&manager, fixture_objects())
        .with_predicate(kube_runtime::predicates::labels)
        .start(record_phase, never_retry, state.clone());
    let run = spawn_manager(&manager);
    eventually(30, "both reconciled", async || state.total() >= 2).await;
    let phoenix = state.seen.lock().unwrap()[0]
        .1
        .replace("witness", "phoenix");
    let phoenix = phoenix.as_str();

    state.phase.store(1, Ordering::SeqCst);
    watch_gap(&c, &relay, async |client| {
        delete(client, "default", "phoenix").await;
        create(client, labelled("default", "phoenix")).await;
    })
    .await;
    eventually(60, "the new phoenix reconciled", async || {
        state.count(1, phoenix) > 0
    })
    .await;
    manager.shutdown();
    run.await.unwrap();
}

#[tokio::test]
async fn an_object_recreated_across_a_relist_passes_the_predicate_in_fleet_mode() {
    recreated_across_a_relist(|config| {
        let clusters = Clusters::new();
        clusters
            .add(Cluster::from_config(name("c0"), config).unwrap())
            .unwrap();
        clusters
    })
    .await;
}

#[tokio::test]
async fn an_object_recreated_across_a_relist_passes_the_predicate_in_single_mode() {
    recreated_across_a_relist(|config| SingleProvider::from_config(config).unwrap()).await;
}

// ---- replacement --------------------------------------------------------------------

#[tokio::test]
async fn a_replacement_the_filter_accepts_is_engaged_though_the_old_one_was_refused() {
    let env = TestEnv::start().await.unwrap();
    let c = env.cluster(0).unwrap();
    fixture(&c.client().unwrap()).await;
    let clusters = Clusters::new();
    // Built from a client: no config, refused by the filter below.
    clusters
        .add(Cluster::new(name("c0"), c.client().unwrap()))
        .unwrap();
    let manager = Arc::new(Manager::new(clusters.clone()));
    let seen = Arc::new(Seen::default());
    Builder::<_, ConfigMap>::new(&manager, fixture_objects())
        .cluster_filter(|c| c.config().is_some())
        .start(record, retry_soon, seen.clone());
    let everything = Arc::new(Seen::default());
    Builder::<_, ConfigMap>::new(&manager, fixture_objects()).start(
        record,
        retry_soon,
        everything.clone(),
    );
    let run = spawn_manager(&manager);
    // Sync point: the unfiltered controller has seen the first cluster.
    eventually(30, "the first cluster reconciled", async || {
        everything.total() >= 9
    })
    .await;
    assert_eq!(
        clusters
            .add(Cluster::from_config(name("c0"), c.config()).unwrap())
            .unwrap(),
        Engaged::Replaced
    );
    eventually(30, "the replacement reconciled", async || seen.total() >= 9).await;
    manager.shutdown();
    run.await.unwrap();
}

/// Requeues every object every 300 ms, counting the calls.
#[derive(Default)]
struct Ticks {
    calls: AtomicUsize,
}

async fn tick(
    _: Arc<ConfigMap>,
    ctx: Context<multicluster_runtime::ClusterName, Ticks>,
) -> Result<Action, kube::Error> {
    ctx.state().calls.fetch_add(1, Ordering::SeqCst);
    Ok(Action::requeue(Duration::from_millis(300)))
}

#[tokio::test]
async fn a_requeue_chain_survives_two_replacements_during_an_outage() {
    let env = TestEnv::start().await.unwrap();
    let c = env.cluster(0).unwrap();
    create(
        &c.client().unwrap(),
        config_map("default", "ticker", "thing"),
    )
    .await;
    let clusters = Clusters::new();
    clusters
        .add(Cluster::from_config(name("c0"), c.config()).unwrap())
        .unwrap();
    let manager = Arc::new(Manager::new(clusters.clone()));
    let state = Arc::new(Ticks::default());
    Builder::<_, ConfigMap>::new(&manager, fixture_objects()).start(
        tick,
        never_retry,
        state.clone(),
    );
    let run = spawn_manager(&manager);
    let calls = || state.calls.load(Ordering::SeqCst);
    eventually(30, "the chain runs", async || calls() >= 2).await;

    c.stop().await;
    for user in ["first", "second"] {
        let rotated = c.add_user(user, &["system:masters"]).unwrap();
        assert_eq!(
            clusters
                .add(Cluster::from_config(name("c0"), rotated.config()).unwrap())
                .unwrap(),
            Engaged::Replaced
        );
    }
    let at_replacement = calls();
    eventually(
        30,
        "the chain goes on from the last synced cache",
        async || calls() >= at_replacement + 3,
    )
    .await;
    c.start().await.unwrap();
    manager.shutdown();
    run.await.unwrap();
}

/// Abandons its first reconcile of each object when the context is cancelled.
#[derive(Default)]
struct Abandons {
    abandoned: AtomicUsize,
    completed: AtomicUsize,
    waiting: AtomicBool,
}

async fn abandon_first<C: ClusterId>(
    _: Arc<ConfigMap>,
    ctx: Context<C, Abandons>,
) -> Result<Action, kube::Error> {
    if ctx.state().abandoned.load(Ordering::SeqCst) == 0 {
        ctx.state().waiting.store(true, Ordering::SeqCst);
        ctx.cancelled().await;
        ctx.state().abandoned.fetch_add(1, Ordering::SeqCst);
        return Ok(Action::await_change());
    }
    ctx.state().completed.fetch_add(1, Ordering::SeqCst);
    Ok(Action::await_change())
}

#[tokio::test]
async fn a_reconcile_abandoned_because_of_a_replacement_runs_again() {
    let env = TestEnv::start().await.unwrap();
    let c = env.cluster(0).unwrap();
    create(&c.client().unwrap(), config_map("default", "only", "thing")).await;
    let clusters = Clusters::new();
    clusters
        .add(Cluster::from_config(name("c0"), c.config()).unwrap())
        .unwrap();
    let manager = Arc::new(Manager::new(clusters.clone()));
    let state = Arc::new(Abandons::default());
    Builder::<_, ConfigMap>::new(&manager, fixture_objects()).start(
        abandon_first,
        never_retry,
        state.clone(),
    );
    let run = spawn_manager(&manager);
    eventually(30, "the reconcile waits", async || {
        state.waiting.load(Ordering::SeqCst)
    })
    .await;
    let rotated = c.add_user("rotated", &["system:masters"]).unwrap();
    clusters
        .add(Cluster::from_config(name("c0"), rotated.config()).unwrap())
        .unwrap();
    eventually(
        30,
        "the abandoned work done on the new cluster",
        async || state.completed.load(Ordering::SeqCst) == 1,
    )
    .await;
    assert_eq!(state.abandoned.load(Ordering::SeqCst), 1);
    manager.shutdown();
    run.await.unwrap();
}

// ---- user code that panics ------------------------------------------------------------

#[tokio::test]
async fn a_panicking_index_extractor_stops_the_manager_with_an_error() {
    let env = TestEnv::start().await.unwrap();
    let c = env.cluster(0).unwrap();
    let client = c.client().unwrap();
    let clusters = clusters_of([("c0", client.clone())]);
    let manager = Arc::new(Manager::new(clusters));
    manager.index_field::<ConfigMap>("bad", |cm| {
        assert_ne!(cm.metadata.name.as_deref(), Some("boom"), "extractor bug");
        vec![]
    });
    let seen = Arc::new(Seen::default());
    Builder::<_, ConfigMap>::new(&manager, fixture_objects()).start(
        record,
        retry_soon,
        seen.clone(),
    );
    let run = {
        let manager = manager.clone();
        tokio::spawn(async move { manager.run().await })
    };
    create(&client, config_map("default", "fine", "thing")).await;
    eventually(30, "the first object reconciled", async || {
        seen.total() == 1
    })
    .await;
    create(&client, config_map("default", "boom", "thing")).await;
    let result = tokio::time::timeout(Duration::from_secs(30), run)
        .await
        .expect("the manager stopped")
        .unwrap();
    let error = result.expect_err("with an error").to_string();
    assert!(
        error.contains("c0") && error.contains("ConfigMap") && error.contains("extractor bug"),
        "{error}"
    );
}

// ---- slots ------------------------------------------------------------------------------

/// Reconciles whose API calls hang on a frozen apiserver: each reconcile reads its object
/// back from the API server (not the cache) and requeues the pingers every 100 ms.
#[derive(Default)]
struct Pings {
    seen: std::sync::Mutex<std::collections::HashMap<String, tokio::time::Instant>>,
}

async fn ping<C: ClusterId>(
    cm: Arc<ConfigMap>,
    ctx: Context<C, Pings>,
) -> Result<Action, kube::Error> {
    let ns = cm.metadata.namespace.clone().unwrap_or_default();
    Api::<ConfigMap>::namespaced(ctx.client(), &ns)
        .get(&ctx.request().name)
        .await?;
    ctx.state()
        .seen
        .lock()
        .unwrap()
        .entry(ctx.request().to_string())
        .or_insert_with(tokio::time::Instant::now);
    if ctx.request().name.starts_with("pinger") {
        return Ok(Action::requeue(Duration::from_millis(100)));
    }
    Ok(Action::await_change())
}

#[tokio::test]
async fn a_frozen_cluster_cannot_hold_every_slot_and_catches_up_when_it_thaws() {
    let env = TestEnv::builder().clusters(3).start().await.unwrap();
    let frozen = env.cluster(0).unwrap();
    for i in 0..3 {
        create(
            &frozen.client().unwrap(),
            config_map("default", &format!("pinger-{i}"), "thing"),
        )
        .await;
    }
    let clusters = clusters_of_env(&env);
    let manager = Arc::new(Manager::new(clusters));
    let state = Arc::new(Pings::default());
    Builder::<_, ConfigMap>::new(&manager, fixture_objects())
        .concurrency(2)
        .start(ping, never_retry, state.clone());
    let run = spawn_manager(&manager);
    eventually(30, "the pingers run", async || {
        state.seen.lock().unwrap().len() == 3
    })
    .await;

    // The pingers' next reads hang; without a per-cluster cap they would take both slots.
    let paused = frozen.pause().unwrap();
    let mut created = Vec::new();
    for c in env.clusters().iter().skip(1) {
        for i in 0..5 {
            let request = format!("cluster://{}/default/new-{i}", c.name());
            create(
                &c.client().unwrap(),
                config_map("default", &format!("new-{i}"), "thing"),
            )
            .await;
            created.push((request, tokio::time::Instant::now()));
        }
    }
    eventually(
        60,
        "the other clusters' new objects reconciled",
        async || {
            let seen = state.seen.lock().unwrap();
            created.iter().all(|(r, _)| seen.contains_key(r))
        },
    )
    .await;
    let mut latencies: Vec<Duration> = {
        let seen = state.seen.lock().unwrap();
        created
            .iter()
            .map(|(r, at)| seen[r].duration_since(*at))
            .collect()
    };
    latencies.sort();
    eprintln!(
        "create to reconcile with one of three apiservers frozen: p50 {:?}, max {:?}",
        latencies[latencies.len() / 2],
        latencies[latencies.len() - 1]
    );

    paused.resume();
    create(
        &frozen.client().unwrap(),
        config_map("default", "after-thaw", "thing"),
    )
    .await;
    eventually(60, "the thawed cluster catches up", async || {
        state
            .seen
            .lock()
            .unwrap()
            .contains_key("cluster://cluster-0/default/after-thaw")
    })
    .await;
    manager.shutdown();
    run.await.unwrap();
}

#[tokio::test]
async fn a_reconcile_of_a_disengaged_cluster_is_dropped_after_the_grace_period() {
    let env = TestEnv::start().await.unwrap();
    let c = env.cluster(0).unwrap();
    create(&c.client().unwrap(), config_map("default", "only", "thing")).await;
    let clusters = clusters_of([("c0", c.client().unwrap())]);
    let manager = Arc::new(Manager::new(clusters.clone()));
    let state = Arc::new(Stuck::default());
    Builder::<_, ConfigMap>::new(&manager, fixture_objects())
        .concurrency(1)
        .disengage_grace(Duration::from_secs(1))
        .start(stuck, never_retry, state.clone());
    let run = spawn_manager(&manager);
    eventually(30, "the reconcile started", async || {
        state.started.load(Ordering::SeqCst) == 1
    })
    .await;
    assert!(clusters.remove(&name("c0")));
    eventually(30, "the stuck reconcile dropped", async || {
        state.dropped.load(Ordering::SeqCst)
    })
    .await;
    // Its slot is free again: the same cluster, engaged anew, is reconciled.
    clusters
        .add(Cluster::new(name("c0"), c.client().unwrap()))
        .unwrap();
    eventually(30, "a new reconcile in the freed slot", async || {
        state.started.load(Ordering::SeqCst) == 2
    })
    .await;
    manager.shutdown();
    run.await.unwrap();
}

// ---- caches -------------------------------------------------------------------------------

/// Records whether the Secret paired with each ConfigMap was in the synced cache.
#[derive(Default)]
struct Pairs {
    found: AtomicUsize,
    missing: AtomicUsize,
}

async fn check_pair(
    cm: Arc<ConfigMap>,
    ctx: Context<multicluster_runtime::ClusterName, Pairs>,
) -> Result<Action, multicluster_runtime::CacheError> {
    let secrets = ctx
        .cluster()
        .cache::<k8s_openapi::api::core::v1::Secret>(&watcher::Config::default().labels("pair"))
        .await?;
    let ns = cm.metadata.namespace.as_deref().unwrap_or_default();
    let key = kube_runtime::reflector::ObjectRef::new(&ctx.request().name).within(ns);
    if secrets.store().get(&key).is_some() {
        ctx.state().found.fetch_add(1, Ordering::SeqCst);
    } else {
        ctx.state().missing.fetch_add(1, Ordering::SeqCst);
    }
    Ok(Action::await_change())
}

#[tokio::test]
async fn a_reconciler_reading_another_kind_right_after_engagement_sees_it_listed() {
    let env = TestEnv::start().await.unwrap();
    let c = env.cluster(0).unwrap();
    let client = c.client().unwrap();
    let secrets: Api<k8s_openapi::api::core::v1::Secret> =
        Api::namespaced(client.clone(), "default");
    for i in 0..20 {
        create(
            &client,
            config_map("default", &format!("pair-{i}"), "thing"),
        )
        .await;
        let mut secret = k8s_openapi::api::core::v1::Secret::default();
        secret.metadata.name = Some(format!("pair-{i}"));
        secret.metadata.labels = Some([("pair".to_string(), "yes".to_string())].into());
        secrets
            .create(&PostParams::default(), &secret)
            .await
            .unwrap();
    }
    let clusters = clusters_of([("c0", client)]);
    let manager = Arc::new(Manager::new(clusters));
    let state = Arc::new(Pairs::default());
    // Twenty reconciles at once, all waiting on the one Secret cache as it starts.
    Builder::<_, ConfigMap>::new(&manager, fixture_objects()).start(
        check_pair,
        never_retry,
        state.clone(),
    );
    let run = spawn_manager(&manager);
    eventually(30, "every pair checked", async || {
        state.found.load(Ordering::SeqCst) + state.missing.load(Ordering::SeqCst) == 20
    })
    .await;
    assert_eq!(
        state.missing.load(Ordering::SeqCst),
        0,
        "no secret looked missing"
    );
    manager.shutdown();
    run.await.unwrap();
}

// ---- missing CRD, revoked RBAC ------------------------------------------------------------

/// A custom resource of the CRD above.
#[derive(Clone, Debug, serde::Deserialize, serde::Serialize)]
struct Widget {
    #[serde(rename = "apiVersion", default)]
    api_version: String,
    #[serde(default)]
    kind: String,
    metadata: kube::api::ObjectMeta,
}

impl Widget {
    fn new(name: &str) -> Self {
        Self {
            api_version: "example.com/v1".into(),
            kind: "Widget".into(),
            metadata: kube::api::ObjectMeta {
                name: Some(name.into()),
                namespace: Some("default".into()),
                ..Default::default()
            },
        }
    }
}

impl kube::Resource for Widget {
    type DynamicType = ();
    type Scope = kube::core::NamespaceResourceScope;

    fn kind(_: &()) -> std::borrow::Cow<'_, str> {
        "Widget".into()
    }
    fn group(_: &()) -> std::borrow::Cow<'_, str> {
        "example.com".into()
    }
    fn version(_: &()) -> std::borrow::Cow<'_, str> {
        "v1".into()
    }
    fn plural(_: &()) -> std::borrow::Cow<'_, str> {
        "widgets".into()
    }
    fn meta(&self) -> &kube::api::ObjectMeta {
        &self.metadata
    }
    fn meta_mut(&mut self) -> &mut kube::api::ObjectMeta {
        &mut self.metadata
    }
}

#[tokio::test]
async fn a_crd_installed_late_in_one_cluster_is_reconciled_without_a_restart() {
    let logs = Logs::capture();
    let env = TestEnv::builder()
        .clusters(2)
        .name_prefix("crdlate")
        .start()
        .await
        .unwrap();
    let (ready, late) = (env.cluster(0).unwrap(), env.cluster(1).unwrap());
    ready.install_crds(WIDGET_CRD).await.unwrap();
    let widgets = |c: &TestCluster| Api::<Widget>::namespaced(c.client().unwrap(), "default");
    widgets(&ready)
        .create(&PostParams::default(), &Widget::new("early"))
        .await
        .unwrap();
    let clusters = clusters_of_env(&env);
    let manager = Arc::new(Manager::new(clusters));
    let seen = Arc::new(Seen::default());
    Builder::<_, Widget>::new(&manager, watcher::Config::default()).start(
        record,
        never_retry,
        seen.clone(),
    );
    let run = spawn_manager(&manager);
    eventually(30, "the cluster with the CRD reconciled", async || {
        seen.count("cluster://crdlate-0/default/early") == 1
    })
    .await;
    // The other cluster's Widget cache cannot list: it says so once, not at every retry.
    let failures = ["cluster=crdlate-1", "kind=Widget", "watch failed"];
    eventually(60, "three listing attempts failed", async || {
        logs.lines(&failures).len() >= 3
    })
    .await;
    let warnings = logs.lines(&[&failures[..], &["WARN"]].concat());
    assert_eq!(warnings.len(), 1, "{warnings:#?}");
    // That is visible, and holds nobody up.
    let late_cluster = manager.cluster(&name("crdlate-1")).unwrap();
    eventually(30, "the missing CRD reported", async || {
        late_cluster
            .cache_status()
            .iter()
            .any(|s| s.kind == "Widget" && !s.synced && s.error.is_some())
    })
    .await;

    // A read with a deadline says why it cannot be served rather than wait for the CRD.
    let waited = late_cluster
        .cache_within::<Widget>(&watcher::Config::default(), Duration::from_secs(1))
        .await;
    match &waited {
        Err(multicluster_runtime::CacheError::NotSynced {
            cluster,
            kind,
            reason: Some(reason),
            ..
        }) => {
            assert_eq!((cluster.as_str(), kind.as_str()), ("crdlate-1", "Widget"));
            assert!(
                reason.contains("404") || reason.contains("not find"),
                "{reason}"
            );
        }
        other => panic!("{:?}", other.as_ref().map(|_| "a cache")),
    }

    late.install_crds(WIDGET_CRD).await.unwrap();
    let cache = late_cluster
        .cache_within::<Widget>(&watcher::Config::default(), Duration::from_secs(60))
        .await
        .expect("the cache lists once the CRD is in");
    drop(cache);
    widgets(&late)
        .create(&PostParams::default(), &Widget::new("late"))
        .await
        .unwrap();
    eventually(
        30,
        "the late cluster reconciled once its CRD is in",
        async || seen.count("cluster://crdlate-1/default/late") == 1,
    )
    .await;
    assert!(late_cluster.cache_status().iter().all(|s| s.synced));
    manager.shutdown();
    run.await.unwrap();
}

/// Grants `user` what the controller needs on ConfigMaps, through a binding named after it.
async fn grant(admin: &kube::Client, user: &str) {
    allow_config_maps(
        admin,
        user,
        "cm-controller",
        &["get", "list", "watch", "patch"],
    )
    .await;
}

async fn revoke(admin: &kube::Client, user: &str) {
    Api::<k8s_openapi::api::rbac::v1::ClusterRoleBinding>::all(admin.clone())
        .delete(&format!("cm-controller-{user}"), &DeleteParams::default())
        .await
        .unwrap();
}

#[tokio::test]
async fn revoked_rbac_in_one_cluster_parks_it_alone_and_restoring_it_resumes() {
    let env = TestEnv::builder().clusters(2).start().await.unwrap();
    let clusters = Clusters::new();
    for c in env.clusters() {
        let admin = c.client().unwrap();
        fixture(&admin).await;
        grant(&admin, "operator").await;
        let operator = c.add_user("operator", &[]).unwrap();
        clusters
            .add(Cluster::from_config(name(c.name()), operator.config()).unwrap())
            .unwrap();
    }
    let manager = Arc::new(Manager::new(clusters));
    let seen = Arc::new(Seen::default());
    Builder::<_, ConfigMap>::new(&manager, fixture_objects()).start(
        feed_animals,
        retry_soon,
        seen.clone(),
    );
    let run = spawn_manager(&manager);
    for c in env.clusters() {
        let client = c.client().unwrap();
        eventually(30, "fed", async || is_fed(&client, "zoo", "elephant").await).await;
    }

    // Revoked, and the watch made to list again (a restart), so the refusal is seen.
    let (revoked, other) = (env.cluster(0).unwrap(), env.cluster(1).unwrap());
    revoke(&revoked.client().unwrap(), "operator").await;
    revoked.stop().await;
    revoked.start().await.unwrap();
    let revoked_cluster = manager.cluster(&name("cluster-0")).unwrap();
    eventually(30, "the refusal reported", async || {
        revoked_cluster.cache_status().iter().any(|s| {
            s.kind == "ConfigMap"
                && s.error
                    .as_deref()
                    .is_some_and(|e| e.contains("forbidden") || e.contains("403"))
        })
    })
    .await;
    // Meanwhile the other cluster goes on.
    let other_client = other.client().unwrap();
    create(&other_client, config_map("island", "parrot", "animal")).await;
    eventually(30, "the other cluster's new animal fed", async || {
        is_fed(&other_client, "island", "parrot").await
    })
    .await;

    grant(&revoked.client().unwrap(), "operator").await;
    let revoked_client = revoked.client().unwrap();
    create(&revoked_client, config_map("island", "parrot", "animal")).await;
    eventually(60, "the restored cluster's new animal fed", async || {
        is_fed(&revoked_client, "island", "parrot").await
    })
    .await;
    manager.shutdown();
    run.await.unwrap();
}

// ---- kill -9 under load -------------------------------------------------------------------

/// Every resourceVersion each object was reconciled at.
#[derive(Default)]
struct Versions {
    seen: std::sync::Mutex<std::collections::HashMap<String, Vec<String>>>,
}

async fn record_version(
    cm: Arc<ConfigMap>,
    ctx: Context<multicluster_runtime::ClusterName, Versions>,
) -> Result<Action, kube::Error> {
    let rv = cm.metadata.resource_version.clone().unwrap_or_default();
    ctx.state()
        .seen
        .lock()
        .unwrap()
        .entry(ctx.request().name.clone())
        .or_default()
        .push(rv);
    Ok(Action::await_change())
}

/// Patches objects round after round: group `before` until the outage, `across` all along
/// (a write that fails is retried until it lands, so the last ones are issued during the
/// outage), `after` once the apiserver is back. Counts successful writes per object.
struct Writer {
    phase: AtomicUsize,
    rounds: AtomicUsize,
    failures: AtomicUsize,
    writes: std::sync::Mutex<std::collections::HashMap<String, usize>>,
}

const BEFORE: usize = 0;
const DURING: usize = 1;
const AFTER: usize = 2;
const STOP: usize = 3;

impl Writer {
    fn targets(&self, phase: usize) -> Vec<String> {
        let group = |g: &'static str| (0..8).map(move |i| format!("{g}-{i}"));
        match phase {
            BEFORE => group("before").chain(group("across")).collect(),
            DURING => group("across").collect(),
            _ => group("across").chain(group("after")).collect(),
        }
    }

    async fn run(self: Arc<Self>, client: kube::Client) {
        let api: Api<ConfigMap> = Api::namespaced(client, "default");
        let mut n = 0u64;
        loop {
            let phase = self.phase.load(Ordering::SeqCst);
            if phase == STOP {
                return;
            }
            for name in self.targets(phase) {
                n += 1;
                let patch = serde_json::json!({ "data": { "n": n.to_string() } });
                // Retried until it lands: a write issued during the outage lands after it.
                loop {
                    let result = api
                        .patch(
                            &name,
                            &kube::api::PatchParams::default(),
                            &kube::api::Patch::Merge(&patch),
                        )
                        .await;
                    match result {
                        Ok(_) => {
                            *self.writes.lock().unwrap().entry(name.clone()).or_default() += 1;
                            break;
                        }
                        Err(_) => {
                            self.failures.fetch_add(1, Ordering::SeqCst);
                            tokio::time::sleep(Duration::from_millis(100)).await;
                        }
                    }
                }
            }
            self.rounds.fetch_add(1, Ordering::SeqCst);
        }
    }
}

#[tokio::test]
async fn every_object_is_reconciled_at_its_final_version_across_a_kill_9() {
    let env = TestEnv::start().await.unwrap();
    let c = env.cluster(0).unwrap();
    let client = c.client().unwrap();
    let names: Vec<String> = ["before", "across", "after"]
        .iter()
        .flat_map(|g| (0..8).map(move |i| format!("{g}-{i}")))
        .collect();
    for name in &names {
        create(&client, config_map("default", name, "thing")).await;
    }
    let clusters = clusters_of([("c0", client.clone())]);
    let manager = Arc::new(Manager::new(clusters));
    let state = Arc::new(Versions::default());
    Builder::<_, ConfigMap>::new(&manager, fixture_objects()).start(
        record_version,
        never_retry,
        state.clone(),
    );
    let run = spawn_manager(&manager);
    eventually(30, "every object reconciled once", async || {
        state.seen.lock().unwrap().len() == names.len()
    })
    .await;

    let writer = Arc::new(Writer {
        phase: AtomicUsize::new(BEFORE),
        rounds: AtomicUsize::new(0),
        failures: AtomicUsize::new(0),
        writes: Default::default(),
    });
    let writing = tokio::spawn(writer.clone().run(c.client().unwrap()));
    eventually(30, "writes before the outage", async || {
        writer.rounds.load(Ordering::SeqCst) >= 3
    })
    .await;
    // Killed in the middle of the writer's round: some writes are in flight.
    writer.phase.store(DURING, Ordering::SeqCst);
    c.kill().await;
    eventually(30, "writes attempted during the outage", async || {
        writer.failures.load(Ordering::SeqCst) >= 3
    })
    .await;
    let reconciles = || {
        state
            .seen
            .lock()
            .unwrap()
            .values()
            .map(Vec::len)
            .sum::<usize>()
    };
    let before_restart = reconciles();
    let starting = tokio::time::Instant::now();
    c.start().await.unwrap();
    let ready = starting.elapsed();
    writer.phase.store(AFTER, Ordering::SeqCst);
    eventually(60, "reconciles resume", async || {
        reconciles() > before_restart
    })
    .await;
    eprintln!(
        "kill -9: reconciles resumed {:?} after the apiserver was started (it answered /readyz after {ready:?})",
        starting.elapsed()
    );
    let rounds = writer.rounds.load(Ordering::SeqCst);
    eventually(60, "writes after the outage", async || {
        writer.rounds.load(Ordering::SeqCst) >= rounds + 3
    })
    .await;
    writer.phase.store(STOP, Ordering::SeqCst);
    writing.await.unwrap();

    let finals: std::collections::HashMap<String, String> =
        Api::<ConfigMap>::namespaced(client.clone(), "default")
            .list(&Default::default())
            .await
            .unwrap()
            .items
            .into_iter()
            .filter(|cm| names.contains(cm.metadata.name.as_ref().unwrap()))
            .map(|cm| {
                (
                    cm.metadata.name.unwrap(),
                    cm.metadata.resource_version.unwrap(),
                )
            })
            .collect();
    assert_eq!(finals.len(), names.len());
    eventually(
        60,
        "every object reconciled at its final resourceVersion",
        async || {
            let seen = state.seen.lock().unwrap();
            finals
                .iter()
                .all(|(name, rv)| seen.get(name).is_some_and(|rvs| rvs.contains(rv)))
        },
    )
    .await;
    // Sync point for the counts: an object created last is reconciled after everything above.
    create(&client, config_map("default", "last", "thing")).await;
    eventually(30, "the last object reconciled", async || {
        state.seen.lock().unwrap().contains_key("last")
    })
    .await;
    // Duplicates are bounded: per object at most one reconcile per write that landed, plus
    // the first listing, up to two relists (the watch may list again once more while the
    // apiserver starts), and one write whose response the kill cut off but which landed.
    {
        let seen = state.seen.lock().unwrap();
        let writes = writer.writes.lock().unwrap();
        let mut total = (0, 0);
        for name in &names {
            let reconciles = seen[name].len();
            let landed = writes.get(name).copied().unwrap_or(0);
            total.0 += reconciles;
            total.1 += landed;
            assert!(
                reconciles <= landed + 4,
                "{name}: {reconciles} reconciles for {landed} writes"
            );
        }
        eprintln!(
            "kill -9 under load: {} reconciles for {} writes of {} objects",
            total.0,
            total.1,
            names.len()
        );
    }
    manager.shutdown();
    run.await.unwrap();
}

// ---- engagement churn ---------------------------------------------------------------------

/// What a process holds that could leak: tokio tasks, open sockets, resident memory.
#[derive(Debug, Clone, Copy)]
struct Footprint {
    tasks: usize,
    sockets: usize,
    rss_kib: u64,
}

impl Footprint {
    fn now() -> Self {
        let sockets = std::fs::read_dir("/proc/self/fd")
            .unwrap()
            .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
            .filter(|target| target.to_string_lossy().starts_with("socket:"))
            .count();
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let rss_kib = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap();
        Self {
            tasks: tokio::runtime::Handle::current()
                .metrics()
                .num_alive_tasks(),
            sockets,
            rss_kib,
        }
    }
}

/// Sends the cluster id of every reconcile.
struct Reconciled(tokio::sync::mpsc::UnboundedSender<String>);

async fn report(
    _: Arc<ConfigMap>,
    ctx: Context<multicluster_runtime::ClusterName, Reconciled>,
) -> Result<Action, kube::Error> {
    let _ = ctx.state().0.send(ctx.cluster_id().to_string());
    Ok(Action::await_change())
}

#[tokio::test]
async fn a_thousand_engagements_leave_no_task_socket_watch_or_memory_behind() {
    let env = TestEnv::start().await.unwrap();
    let c = env.cluster(0).unwrap();
    create(&c.client().unwrap(), config_map("default", "only", "thing")).await;
    let clusters = Clusters::new();
    let manager = Arc::new(Manager::new(clusters.clone()));
    let (tx, mut reconciled) = tokio::sync::mpsc::unbounded_channel();
    Builder::<_, ConfigMap>::new(&manager, fixture_objects()).start(
        report,
        never_retry,
        Arc::new(Reconciled(tx)),
    );
    let run = spawn_manager(&manager);
    let same = Cluster::from_config(name("same"), c.config()).unwrap();
    let cycle =
        async |cluster: Cluster<multicluster_runtime::ClusterName>,
               reconciled: &mut tokio::sync::mpsc::UnboundedReceiver<String>| {
            let id = cluster.id().to_string();
            clusters.add(cluster).unwrap();
            // Sync point: this engagement's first reconcile.
            while reconciled.recv().await.unwrap() != id {}
            assert!(clusters.remove(&name(&id)));
        };
    // Warm up: the first engagement of each kind allocates what later ones reuse.
    cycle(same.clone(), &mut reconciled).await;
    cycle(
        Cluster::from_config(name("fresh"), c.config()).unwrap(),
        &mut reconciled,
    )
    .await;
    let watches = async || c.served_watches("configmaps", true).await.unwrap();
    eventually(30, "the warm-up let go", async || {
        !same.is_engaged() && manager.fleet().is_empty()
    })
    .await;
    let baseline_watches = watches().await;
    let baseline = Footprint::now();

    for i in 0..1000 {
        let cluster = if i % 2 == 0 {
            same.clone()
        } else {
            Cluster::from_config(name("fresh"), c.config()).unwrap()
        };
        cycle(cluster, &mut reconciled).await;
    }

    // What 1,000 engagements started is gone again. Tolerances: tasks and sockets exactly
    // (hyper closes a dropped client's connection and ends its task once the apiserver's
    // side is read to the end, which takes a moment, hence waiting); the apiserver's watches
    // exactly; RSS within 16 MiB, since the allocator keeps some freed memory mapped.
    eventually(
        60,
        "tasks, sockets and watches back to the baseline",
        async || {
            let now = Footprint::now();
            now.tasks <= baseline.tasks
                && now.sockets <= baseline.sockets
                && watches().await <= baseline_watches
        },
    )
    .await;
    let after = Footprint::now();
    eprintln!(
        "1,000 engagements: before {baseline:?} ({baseline_watches} watches), after {after:?} ({} watches)",
        watches().await
    );
    assert!(
        after.rss_kib <= baseline.rss_kib + 16 * 1024,
        "RSS grew from {} to {} KiB",
        baseline.rss_kib,
        after.rss_kib
    );
    manager.shutdown();
    run.await.unwrap();
}

/// Requeues every object every 300 ms, recording each call as `name@server` (the server of
/// the cluster it ran against).
async fn tick_where(
    cm: Arc<ConfigMap>,
    ctx: Context<multicluster_runtime::ClusterName, Seen>,
) -> Result<Action, kube::Error> {
    let server = ctx
        .cluster()
        .config()
        .map(|c| c.cluster_url.to_string())
        .unwrap_or_default();
    let name = cm.metadata.name.clone().unwrap_or_default();
    ctx.state()
        .requests
        .lock()
        .unwrap()
        .push(format!("{name}@{}", server.trim_end_matches('/')));
    Ok(Action::requeue(Duration::from_millis(300)))
}

#[tokio::test]
async fn a_replacement_at_another_endpoint_does_not_read_the_old_cache() {
    let env = TestEnv::builder().clusters(2).start().await.unwrap();
    let (old, new) = (env.cluster(0).unwrap(), env.cluster(1).unwrap());
    create(
        &old.client().unwrap(),
        config_map("default", "old-only", "thing"),
    )
    .await;
    create(
        &new.client().unwrap(),
        config_map("default", "new-only", "thing"),
    )
    .await;
    let clusters = Clusters::new();
    clusters
        .add(Cluster::from_config(name("c"), old.config()).unwrap())
        .unwrap();
    let manager = Arc::new(Manager::new(clusters.clone()));
    let seen = Arc::new(Seen::default());
    Builder::<_, ConfigMap>::new(&manager, fixture_objects()).start(
        tick_where,
        never_retry,
        seen.clone(),
    );
    let run = spawn_manager(&manager);
    let (old_server, new_server) = (old.server().to_string(), new.server().to_string());
    eventually(30, "the old cluster's object requeues", async || {
        seen.count(&format!("old-only@{old_server}")) >= 2
    })
    .await;

    // The id moves to another apiserver, which is down for now: the old cluster's cache
    // stands for nothing there, so the requeue chain of `old-only` must not go on from it
    // against the new cluster.
    new.stop().await;
    assert_eq!(
        clusters
            .add(Cluster::from_config(name("c"), new.config()).unwrap())
            .unwrap(),
        Engaged::Replaced
    );
    new.start().await.unwrap();
    // Sync point: the new apiserver's object is reconciled (so the new cache listed and the
    // parked requests were released).
    eventually(60, "the new cluster's object reconciled", async || {
        seen.count(&format!("new-only@{new_server}")) >= 1
    })
    .await;
    assert_eq!(
        seen.count(&format!("old-only@{new_server}")),
        0,
        "an object of the old endpoint was reconciled against the new one"
    );
    manager.shutdown();
    run.await.unwrap();
}
