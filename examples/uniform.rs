//! A uniform reconciler: the same compliance rule in every cluster of a fleet.
//!
//! Every namespace labelled `compliance=enforced`, in every cluster, must hold a ConfigMap
//! `compliance` with the current policy. The controller applies it (server-side apply, owned
//! by the namespace), puts it back when someone deletes or edits it, and covers clusters that
//! join the fleet later. The reconciler is written once and knows nothing of the fleet.
//!
//! ```sh
//! scripts/example.sh uniform
//! ```
//!
//! It starts three local control planes (testenv), shows each step, checks its outcome,
//! and exits with an error if one is not met.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams};
use kube::{Resource, ResourceExt};
use multicluster_runtime::providers::Clusters;
use multicluster_runtime::{
    Action, Builder, Cluster, ClusterId, ClusterName, Context, Manager, watcher,
};
use multicluster_runtime_testenv::{TestCluster, TestEnv};

// The items below are `pub(crate)` so that the fake fleet's unit test
// (fake/tests/examples.rs) can include this file and test its reconciler without a cluster.

/// The policy every enforced namespace must carry.
pub(crate) const POLICY: &str = "images-from=registry.internal; privileged=false";
/// The field manager of the ConfigMaps this controller writes.
pub(crate) const MANAGER: &str = "compliance-controller";

#[derive(Debug, thiserror::Error)]
pub(crate) enum Error {
    #[error("namespace {0} has no uid yet")]
    NoUid(String),
    #[error(transparent)]
    Kube(#[from] kube::Error),
}

// ANCHOR: reconcile
/// The rule, for one namespace of one cluster.
pub(crate) async fn reconcile<C: ClusterId>(
    ns: Arc<Namespace>,
    ctx: Context<C, ()>,
) -> Result<Action, Error> {
    let name = ns.name_any();
    let owner = ns
        .controller_owner_ref(&())
        .ok_or_else(|| Error::NoUid(name.clone()))?;
    let wanted = ConfigMap {
        metadata: ObjectMeta {
            name: Some("compliance".into()),
            namespace: Some(name.clone()),
            labels: Some(BTreeMap::from([("managed-by".into(), MANAGER.into())])),
            owner_references: Some(vec![owner]),
            ..Default::default()
        },
        data: Some(BTreeMap::from([("policy".into(), POLICY.into())])),
        ..Default::default()
    };
    Api::<ConfigMap>::namespaced(ctx.client(), &name)
        .patch(
            "compliance",
            &PatchParams::apply(MANAGER).force(),
            &Patch::Apply(&wanted),
        )
        .await?;
    tracing::info!(cluster = %ctx.cluster_id(), namespace = %name, "compliant");
    Ok(Action::requeue(Duration::from_secs(600)))
}
// ANCHOR_END: reconcile

pub(crate) fn error_policy<C: ClusterId>(
    _: Arc<Namespace>,
    error: &Error,
    ctx: &Context<C, ()>,
) -> Action {
    eprintln!("  {}: {error}", ctx.request());
    Action::requeue(Duration::from_secs(2))
}

/// The controller, on `manager` (the fake crate's unit tests start it the same way).
pub(crate) fn start_controller(manager: &Arc<Manager<Clusters<ClusterName>>>) {
    // ANCHOR: builder
    Builder::<_, Namespace>::new(
        manager,
        watcher::Config::default().labels("compliance=enforced"),
    )
    .named("compliance")
    // A deleted or edited ConfigMap reconciles its namespace again.
    .owns::<ConfigMap>(watcher::Config::default().labels(&format!("managed-by={MANAGER}")))
    .start(reconcile, error_policy, Arc::new(()));
    // ANCHOR_END: builder
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .init();
    let env = TestEnv::builder().clusters(3).start().await?;
    println!("started 3 local control planes");
    let clusters = Clusters::<ClusterName>::new();
    let manager = Arc::new(Manager::new(clusters.clone()));
    start_controller(&manager);
    let run = {
        let manager = manager.clone();
        tokio::spawn(async move { manager.run().await })
    };

    // Two of the three clusters first, each with an enforced and an exempt namespace.
    let all = env.clusters();
    for c in &all[..2] {
        namespaces(c).await?;
        clusters.add(Cluster::from_config(
            ClusterName::from(c.name()),
            c.config(),
        )?)?;
    }
    for c in &all[..2] {
        wait_for(&format!("{}: team-a compliant", c.name()), || {
            policy_of(c, "team-a")
        })
        .await?;
        if current(c, "sandbox").await?.is_some() {
            return Err(format!("{}: the exempt namespace got the ConfigMap", c.name()).into());
        }
    }
    println!("step 1: enforced namespaces of both clusters carry the policy; exempt ones do not");

    let c1 = &all[1];
    Api::<ConfigMap>::namespaced(c1.client()?, "team-a")
        .delete("compliance", &Default::default())
        .await?;
    wait_for("the deleted ConfigMap restored", || policy_of(c1, "team-a")).await?;
    Api::<ConfigMap>::namespaced(c1.client()?, "team-a")
        .patch(
            "compliance",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"data": {"policy": "anything goes"}})),
        )
        .await?;
    wait_for("the edited ConfigMap restored", || policy_of(c1, "team-a")).await?;
    println!(
        "step 2: {} drifted twice (deleted, edited) and was put back",
        c1.name()
    );

    let late = &all[2];
    namespaces(late).await?;
    clusters.add(Cluster::from_config(
        ClusterName::from(late.name()),
        late.config(),
    )?)?;
    wait_for("the late cluster compliant", || policy_of(late, "team-a")).await?;
    println!(
        "step 3: {} joined later and was made compliant",
        late.name()
    );

    manager.shutdown();
    run.await??;
    println!("done: every enforced namespace in 3 clusters carries the policy");
    Ok(())
}

/// `team-a` (enforced) and `sandbox` (exempt) in cluster `c`.
async fn namespaces(c: &TestCluster) -> Result<(), Box<dyn std::error::Error>> {
    for (name, enforced) in [("team-a", true), ("sandbox", false)] {
        let mut ns = Namespace::default();
        ns.metadata.name = Some(name.into());
        if enforced {
            ns.metadata.labels = Some(BTreeMap::from([("compliance".into(), "enforced".into())]));
        }
        Api::<Namespace>::all(c.client()?)
            .create(&PostParams::default(), &ns)
            .await?;
    }
    Ok(())
}

/// The `compliance` ConfigMap of `namespace` in `c`, if there is one.
async fn current(
    c: &TestCluster,
    namespace: &str,
) -> Result<Option<ConfigMap>, Box<dyn std::error::Error>> {
    Ok(Api::<ConfigMap>::namespaced(c.client()?, namespace)
        .get_opt("compliance")
        .await?)
}

/// Whether `namespace` in `c` carries the current policy.
async fn policy_of(c: &TestCluster, namespace: &str) -> bool {
    matches!(current(c, namespace).await, Ok(Some(cm))
        if cm.data.as_ref().and_then(|d| d.get("policy")).map(String::as_str) == Some(POLICY))
}

/// Polls `done` until it holds, for at most a minute.
async fn wait_for<F, Fut>(what: &str, mut done: F) -> Result<(), Box<dyn std::error::Error>>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + Duration::from_secs(60);
    while !done().await {
        if Instant::now() > deadline {
            return Err(format!("timed out waiting for {what}").into());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}
