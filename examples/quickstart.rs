//! Quickstart: one uniform ConfigMap controller over a fleet that changes while it runs.
//!
//! With no arguments it starts three local control planes (testenv), engages them, creates
//! ConfigMaps in each and shows the reconciles per cluster, adds a fourth cluster at run time,
//! removes one, prints a summary and exits.
//!
//! ```sh
//! scripts/example.sh quickstart                          # local control planes
//! scripts/example.sh quickstart --kubeconfig ~/.kube/config   # every context of a kubeconfig, until Ctrl-C
//! ```
//!
//! The controller reconciles ConfigMaps labelled `app=quickstart`; against real clusters it
//! only reads them.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, ObjectMeta, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube_runtime::watcher;
use multicluster_runtime::providers::Clusters;
use multicluster_runtime::{Action, Builder, Cluster, ClusterId, ClusterName, Context, Manager};
use multicluster_runtime_testenv::TestEnv;

// The items below are `pub(crate)` so that the fake crate's unit tests
// (fake/tests/examples.rs) can include this file and test its controller without a cluster.

/// Reconciles seen, per cluster.
#[derive(Default)]
pub(crate) struct Tally {
    per_cluster: Mutex<BTreeMap<String, usize>>,
}

impl Tally {
    pub(crate) fn count(&self, cluster: &str) -> usize {
        self.per_cluster
            .lock()
            .map(|m| m.get(cluster).copied().unwrap_or(0))
            .unwrap_or(0)
    }
}

#[derive(Debug, thiserror::Error)]
#[error("reconcile failed: {0}")]
struct Error(#[from] kube::Error);

/// The uniform reconciler: the same code for every cluster (and for a single cluster).
async fn reconcile<C: ClusterId>(
    cm: Arc<ConfigMap>,
    ctx: Context<C, Tally>,
) -> Result<Action, Error> {
    let data = cm
        .data
        .as_ref()
        .and_then(|d| d.get("greeting"))
        .map(String::as_str)
        .unwrap_or("-");
    println!("  reconciled {}  greeting={data}", ctx.request());
    if let Ok(mut tally) = ctx.state().per_cluster.lock() {
        *tally.entry(ctx.cluster_id().to_string()).or_default() += 1;
    }
    Ok(Action::requeue(Duration::from_secs(300)))
}

fn error_policy<C: ClusterId>(_: Arc<ConfigMap>, error: &Error, ctx: &Context<C, Tally>) -> Action {
    eprintln!("  {} failed: {error}", ctx.request());
    // Again after 5 ms, then twice as long after each failure in a row (up to 1,000 s).
    Action::backoff()
}

pub(crate) fn greeting(name: &str, text: &str) -> ConfigMap {
    ConfigMap {
        metadata: ObjectMeta {
            name: Some(name.into()),
            labels: Some(BTreeMap::from([(
                "app".to_string(),
                "quickstart".to_string(),
            )])),
            ..Default::default()
        },
        data: Some(BTreeMap::from([("greeting".to_string(), text.to_string())])),
        ..Default::default()
    }
}

async fn wait_for(
    what: &str,
    mut done: impl FnMut() -> bool,
) -> Result<(), Box<dyn std::error::Error>> {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !done() {
        if Instant::now() > deadline {
            return Err(format!("timed out waiting for {what}").into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .init();
    let args: Vec<String> = std::env::args().collect();
    match args.iter().position(|a| a == "--kubeconfig") {
        Some(i) => {
            let path = args.get(i + 1).ok_or("--kubeconfig needs a path")?;
            real_clusters(path).await
        }
        None => local_fleet().await,
    }
}

/// The controller on a manager for `clusters`.
pub(crate) fn manager_with_controller(
    clusters: &Clusters,
    tally: &Arc<Tally>,
) -> Arc<Manager<Clusters>> {
    let manager = Arc::new(Manager::new(clusters.clone()));
    Builder::<_, ConfigMap>::new(
        &manager,
        watcher::Config::default().labels("app=quickstart"),
    )
    .named("quickstart")
    .start(reconcile, error_policy, tally.clone());
    manager
}

async fn local_fleet() -> Result<(), Box<dyn std::error::Error>> {
    let started = Instant::now();
    let env = TestEnv::builder().clusters(3).start().await?;
    println!(
        "started 3 local control planes in {:.1?}",
        started.elapsed()
    );

    let clusters = Clusters::new();
    let tally = Arc::new(Tally::default());
    let manager = manager_with_controller(&clusters, &tally);
    let run = {
        let manager = manager.clone();
        tokio::spawn(async move { manager.run().await })
    };

    for c in env.clusters() {
        clusters.add(Cluster::from_config(
            ClusterName::from(c.name()),
            c.config(),
        )?)?;
        println!("engaged {}", c.name());
        let api: Api<ConfigMap> = Api::namespaced(c.client()?, "default");
        for (name, text) in [("hello", "hello"), ("bonjour", "bonjour")] {
            api.create(
                &PostParams::default(),
                &greeting(name, &format!("{text} from {}", c.name())),
            )
            .await?;
        }
    }
    for c in env.clusters() {
        wait_for("the first reconciles", || tally.count(c.name()) >= 2).await?;
    }

    println!("adding a fourth cluster while the controller runs");
    let fourth = env.add_cluster().await?;
    Api::<ConfigMap>::namespaced(fourth.client()?, "default")
        .create(
            &PostParams::default(),
            &greeting("hallo", "hallo from the newcomer"),
        )
        .await?;
    clusters.add(Cluster::from_config(
        ClusterName::from(fourth.name()),
        fourth.config(),
    )?)?;
    wait_for("the new cluster's reconcile", || {
        tally.count(fourth.name()) >= 1
    })
    .await?;

    println!("removing cluster-1");
    clusters.remove(&ClusterName::from("cluster-1"));
    env.remove_cluster("cluster-1").await;
    let before = tally.count("cluster-1");
    // A change in a remaining cluster is still reconciled; the removed one is quiet.
    let c0 = env.cluster_named("cluster-0").ok_or("cluster-0 is gone")?;
    Api::<ConfigMap>::namespaced(c0.client()?, "default")
        .create(
            &PostParams::default(),
            &greeting("hola", "hola after the removal"),
        )
        .await?;
    wait_for("the change in cluster-0", || tally.count("cluster-0") >= 3).await?;

    let engaged = manager.fleet().ids();
    manager.shutdown();
    run.await??;
    println!("\nsummary (reconciles per cluster):");
    for (cluster, n) in tally
        .per_cluster
        .lock()
        .map_err(|_| "tally poisoned")?
        .iter()
    {
        println!("  {cluster:<10} {n}");
    }
    println!("engaged at the end: {engaged:?}");
    if tally.count("cluster-1") != before {
        return Err("cluster-1 was reconciled after its removal".into());
    }
    Ok(())
}

/// Every context of a kubeconfig file becomes a cluster; runs until Ctrl-C.
async fn real_clusters(path: &str) -> Result<(), Box<dyn std::error::Error>> {
    let kubeconfig = Kubeconfig::read_from(path)?;
    let clusters = Clusters::new();
    for context in &kubeconfig.contexts {
        let options = KubeConfigOptions {
            context: Some(context.name.clone()),
            ..Default::default()
        };
        match kube::Config::from_custom_kubeconfig(kubeconfig.clone(), &options).await {
            Ok(config) => {
                clusters.add(Cluster::from_config(
                    ClusterName::from(context.name.as_str()),
                    config,
                )?)?;
                println!("engaged context {}", context.name);
            }
            Err(error) => eprintln!("skipping context {}: {error}", context.name),
        }
    }
    let tally = Arc::new(Tally::default());
    let manager = manager_with_controller(&clusters, &tally);
    let shutdown = manager.shutdown_token();
    tokio::spawn(async move {
        let _ = tokio::signal::ctrl_c().await;
        shutdown.cancel();
    });
    println!("reconciling ConfigMaps labelled app=quickstart; Ctrl-C to stop");
    manager.run().await?;
    Ok(())
}
