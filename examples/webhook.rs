//! A fleet-wide admission policy: in every cluster, a ConfigMap labelled
//! `fleet.example.com/managed=true` must carry an owner. A mutating webhook fills in a
//! default owner (the namespace's team); a validating webhook refuses an owner that is not a
//! lower-case name, saying which cluster refused. One server in the manager serves every
//! cluster; the manager installs the webhook configurations in each cluster it engages,
//! with a route only that cluster's configuration carries, and removes them from a cluster
//! that leaves.
//!
//! ```sh
//! scripts/example.sh webhook
//! ```
//!
//! It starts three local control planes (testenv), shows each step, checks its outcome,
//! and exits with an error if one is not met.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
};
use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::ResourceExt;
use kube::api::{Api, ObjectMeta, PostParams};
use multicluster_runtime::providers::Clusters;
use multicluster_runtime::webhook::{Hook, Mutation, Review, Verdict, Webhooks};
use multicluster_runtime::{Cluster, ClusterName, Manager};
use multicluster_runtime_testenv::{TestCluster, TestEnv};

const MANAGED: &str = "fleet.example.com/managed";
const OWNER: &str = "fleet.example.com/owner";

// ANCHOR: hooks
/// Fills in the owner of a managed ConfigMap that has none: the team of its namespace.
async fn default_owner(
    review: Review<ClusterName, ConfigMap>,
) -> Result<Mutation<ConfigMap>, Infallible> {
    let Some(mut cm) = review.object else {
        return Ok(Mutation::unchanged());
    };
    let annotations = cm.metadata.annotations.get_or_insert_default();
    if annotations.contains_key(OWNER) {
        return Ok(Mutation::unchanged());
    }
    let team = format!("{}-team", review.namespace.unwrap_or_default());
    annotations.insert(OWNER.into(), team);
    Ok(Mutation::changed(cm))
}

/// Refuses an owner that is not a lower-case name, naming the cluster.
async fn check_owner(review: Review<ClusterName, ConfigMap>) -> Result<Verdict, Infallible> {
    let Some(cm) = review.object else {
        return Ok(Verdict::allow());
    };
    let owner = cm.annotations().get(OWNER).cloned().unwrap_or_default();
    let valid = !owner.is_empty()
        && owner.len() <= 63
        && owner
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    Ok(if valid {
        Verdict::allow()
    } else {
        Verdict::deny(format!(
            "cluster {}: ConfigMap {}/{}: owner {owner:?} is not a lower-case name",
            review.cluster,
            review.namespace.unwrap_or_default(),
            cm.name_any()
        ))
    })
}

fn webhooks(port: u16) -> Webhooks<ClusterName> {
    let managed = LabelSelector {
        match_labels: Some(BTreeMap::from([(MANAGED.to_string(), "true".to_string())])),
        ..Default::default()
    };
    Webhooks::new(
        ([127, 0, 0, 1], port).into(),
        format!("https://127.0.0.1:{port}/fleet"),
    )
    .hook(
        Hook::mutating("default-owner.fleet.example.com", default_owner)
            .object_selector(managed.clone()),
    )
    .hook(Hook::validating("owner.fleet.example.com", check_owner).object_selector(managed))
}
// ANCHOR_END: hooks

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .init();
    let env = TestEnv::builder().clusters(3).start().await?;
    println!("started 3 local control planes");
    let all = env.clusters();
    for c in &all {
        let mut ns = Namespace::default();
        ns.metadata.name = Some("payments".into());
        Api::<Namespace>::all(c.client()?)
            .create(&PostParams::default(), &ns)
            .await?;
    }
    let clusters = Clusters::<ClusterName>::new();
    for c in &all[..2] {
        clusters.add(Cluster::from_config(
            ClusterName::from(c.name()),
            c.config(),
        )?)?;
    }
    // The first control plane is also the host: the webhooks' CA, serving certificate and
    // route key live in a Secret there, shared by every replica.
    let host = Cluster::from_config(ClusterName::from("host"), all[0].config())?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    // ANCHOR: manager
    let hooks = webhooks(port);
    // Made from the URL: every replica computes the same, another manager another one.
    let name = hooks.configuration().to_string();
    let manager = Arc::new(
        Manager::new(clusters.clone())
            .with_local(host)
            .webhooks(hooks),
    );
    // ANCHOR_END: manager
    let run = {
        let manager = manager.clone();
        tokio::spawn(async move { manager.run().await })
    };

    for c in &all[..2] {
        wait_for(&format!("{}: configuration installed", c.name()), || {
            installed(c, &name)
        })
        .await?;
        check_policy(c).await?;
    }
    println!("step 1: both clusters default and check owners through the one server");

    let late = &all[2];
    clusters.add(Cluster::from_config(
        ClusterName::from(late.name()),
        late.config(),
    )?)?;
    wait_for("the late cluster's configuration", || {
        installed(late, &name)
    })
    .await?;
    check_policy(late).await?;
    println!("step 2: {} joined and is covered", late.name());

    let leaving = &all[1];
    clusters.remove(&ClusterName::from(leaving.name()));
    wait_for("the configuration removed", || async {
        !installed(leaving, &name).await
    })
    .await?;
    create(leaving, "unchecked", Some("Anyone At All")).await?;
    println!(
        "step 3: {} left; its configuration is gone, so nothing is checked there",
        leaving.name()
    );

    manager.shutdown();
    run.await??;
    println!("done: one webhook server, a policy in every engaged cluster");
    Ok(())
}

/// Defaults, refusals and the untouched, in cluster `c`.
async fn check_policy(c: &TestCluster) -> Result<(), Box<dyn std::error::Error>> {
    // An API server calls a configuration once its own informer has it, a moment after
    // it is stored: until a dry run with a bad owner is refused, a write may pass unchecked.
    wait_for(&format!("{}: the hooks called", c.name()), || async {
        dry_run_refused(c).await
    })
    .await?;
    let cm = create(c, "ledger", None).await?;
    let owner = cm.annotations().get(OWNER).cloned();
    if owner.as_deref() != Some("payments-team") {
        return Err(format!("{}: default owner {owner:?}", c.name()).into());
    }
    println!(
        "  {}: payments/ledger got the default owner payments-team",
        c.name()
    );
    match create(c, "audit", Some("Bad Owner")).await {
        Err(error)
            if error
                .to_string()
                .contains(&format!("cluster {}:", c.name())) =>
        {
            println!("  {}: payments/audit refused: {error}", c.name());
        }
        other => {
            return Err(format!("{}: a bad owner was not refused: {other:?}", c.name()).into());
        }
    }
    Ok(())
}

/// Whether a dry run of a managed ConfigMap with a bad owner is refused.
async fn dry_run_refused(c: &TestCluster) -> bool {
    let Ok(client) = c.client() else {
        return false;
    };
    let cm = ConfigMap {
        metadata: ObjectMeta {
            name: Some("probe".into()),
            labels: Some(BTreeMap::from([(MANAGED.to_string(), "true".to_string())])),
            annotations: Some(BTreeMap::from([(
                OWNER.to_string(),
                "Bad Owner".to_string(),
            )])),
            ..Default::default()
        },
        ..Default::default()
    };
    let dry = PostParams {
        dry_run: true,
        ..Default::default()
    };
    Api::<ConfigMap>::namespaced(client, "payments")
        .create(&dry, &cm)
        .await
        .is_err()
}

/// A write refused, with the API server's message.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct Refused(String);

/// Creates a managed ConfigMap in `payments` (with `owner`, if given).
async fn create(c: &TestCluster, name: &str, owner: Option<&str>) -> Result<ConfigMap, Refused> {
    let cm = ConfigMap {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some("payments".into()),
            labels: Some(BTreeMap::from([(MANAGED.to_string(), "true".to_string())])),
            annotations: owner.map(|o| BTreeMap::from([(OWNER.to_string(), o.to_string())])),
            ..Default::default()
        },
        ..Default::default()
    };
    let client = c.client().map_err(|e| Refused(e.to_string()))?;
    Api::<ConfigMap>::namespaced(client, "payments")
        .create(&PostParams::default(), &cm)
        .await
        .map_err(|e| match e {
            kube::Error::Api(status) => Refused(status.message),
            other => Refused(other.to_string()),
        })
}

/// Whether `c` has both of the manager's configurations.
async fn installed(c: &TestCluster, name: &str) -> bool {
    let Ok(client) = c.client() else {
        return false;
    };
    matches!(
        Api::<MutatingWebhookConfiguration>::all(client.clone())
            .get_opt(name)
            .await,
        Ok(Some(_))
    ) && matches!(
        Api::<ValidatingWebhookConfiguration>::all(client)
            .get_opt(name)
            .await,
        Ok(Some(_))
    )
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
