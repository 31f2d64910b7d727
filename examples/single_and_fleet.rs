//! One reconcile function, compiled twice: for a single cluster (`SingleProvider`, which runs
//! on kube-runtime's own `Controller`) and for a fleet (`Clusters`, the fleet queue).
//!
//! ```sh
//! scripts/example.sh single_and_fleet
//! ```

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams};
use kube_runtime::watcher;
use multicluster_runtime::providers::{Clusters, SingleProvider};
use multicluster_runtime::{
    Action, Builder, Cluster, ClusterId, ClusterName, Context, Manager, Provider,
};
use multicluster_runtime_testenv::TestEnv;

/// Stamps each `app=demo` ConfigMap with the cluster it was reconciled in. Generic over the
/// cluster id, so it compiles for `SingleCluster` and for `ClusterName` alike.
async fn stamp<C: ClusterId>(
    cm: Arc<ConfigMap>,
    ctx: Context<C, ()>,
) -> Result<Action, kube::Error> {
    let api: Api<ConfigMap> = Api::namespaced(
        ctx.client(),
        cm.metadata.namespace.as_deref().unwrap_or("default"),
    );
    let stamp = format!("reconciled as {}", ctx.request());
    if cm.data.as_ref().and_then(|d| d.get("stamp")) != Some(&stamp) {
        let patch = serde_json::json!({ "data": { "stamp": stamp } });
        api.patch(
            &ctx.request().name,
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await?;
    }
    Ok(Action::await_change())
}

fn retry<C: ClusterId>(_: Arc<ConfigMap>, _: &kube::Error, _: &Context<C, ()>) -> Action {
    Action::requeue(Duration::from_secs(1))
}

async fn demo_object(client: kube::Client) -> Result<(), kube::Error> {
    let cm = ConfigMap {
        metadata: ObjectMeta {
            name: Some("demo".into()),
            labels: Some(BTreeMap::from([("app".to_string(), "demo".to_string())])),
            ..Default::default()
        },
        ..Default::default()
    };
    Api::<ConfigMap>::namespaced(client, "default")
        .create(&PostParams::default(), &cm)
        .await?;
    Ok(())
}

/// Runs `stamp` on `manager` until the demo object of every client is stamped.
async fn run_until_stamped<P: Provider>(
    manager: Manager<P>,
    clients: Vec<kube::Client>,
) -> Result<Vec<String>, Box<dyn std::error::Error>> {
    let manager = Arc::new(manager);
    Builder::<_, ConfigMap>::new(&manager, watcher::Config::default().labels("app=demo")).start(
        stamp,
        retry,
        Arc::new(()),
    );
    let run = {
        let manager = manager.clone();
        tokio::spawn(async move { manager.run().await })
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut stamps = Vec::new();
    for client in clients {
        let api: Api<ConfigMap> = Api::namespaced(client, "default");
        loop {
            let cm = api.get("demo").await?;
            if let Some(stamp) = cm.data.and_then(|d| d.get("stamp").cloned()) {
                stamps.push(stamp);
                break;
            }
            if Instant::now() > deadline {
                return Err("timed out waiting for the stamp".into());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    manager.shutdown();
    run.await??;
    Ok(stamps)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let env = TestEnv::builder().clusters(3).start().await?;
    for c in env.clusters() {
        demo_object(c.client()?).await?;
    }

    // Single-cluster mode: cluster-0 alone, through kube-runtime's Controller.
    let single = env.cluster(0).ok_or("no cluster-0")?;
    let stamps = run_until_stamped(
        Manager::new(SingleProvider::new(single.client()?)),
        vec![single.client()?],
    )
    .await?;
    println!("single-cluster mode: {stamps:?}");

    // Fleet mode: the other two clusters, through the fleet queue; same function.
    let clusters = Clusters::new();
    let mut clients = Vec::new();
    for c in env.clusters().into_iter().skip(1) {
        clusters.add(Cluster::new(ClusterName::from(c.name()), c.client()?))?;
        clients.push(c.client()?);
    }
    let stamps = run_until_stamped(Manager::new(clusters), clients).await?;
    println!("fleet mode:          {stamps:?}");
    Ok(())
}
