//! The schedule checker on the uniform example's reconciler: the reconciler as shipped passes
//! every schedule tried; three broken variants of it are each caught, with a seed that
//! replays the failure.

mod support;
#[path = "../../examples/uniform.rs"]
#[allow(dead_code)]
mod uniform;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use kube::ResourceExt;
use kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams};
use multicluster_runtime::{Action, ClusterName, Context};
use multicluster_runtime_fake::{Checker, Violation, World};
use support::seeded;

/// Every enforced namespace of every engaged cluster carries the policy; no exempt one has
/// the ConfigMap.
fn compliant(world: &World) -> Result<(), String> {
    for cluster in world.clusters().filter(|c| world.is_engaged(c)) {
        for ns in world.objects::<Namespace>(cluster) {
            let name = ns.name_any();
            let enforced = ns
                .labels()
                .get("compliance")
                .is_some_and(|v| v == "enforced");
            let cm: Option<ConfigMap> = world.get(cluster, Some(&name), "compliance");
            let policy = cm
                .as_ref()
                .and_then(|c| c.data.as_ref())
                .and_then(|d| d.get("policy"))
                .map(String::as_str);
            match (enforced, policy) {
                (false, _) if cm.is_some() => {
                    return Err(format!("{cluster}: exempt {name} got the ConfigMap"));
                }
                (true, Some(uniform::POLICY)) | (false, _) => {}
                (true, other) => return Err(format!("{cluster}: {name} has policy {other:?}")),
            }
        }
    }
    Ok(())
}

fn checker<F, Fut, E>(reconcile: F) -> Checker<Namespace, ()>
where
    F: Fn(Arc<Namespace>, Context<ClusterName, ()>) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<Action, E>> + Send + 'static,
    E: std::fmt::Display,
{
    Checker::new(reconcile, ())
        .cluster("a", seeded)
        .cluster("b", seeded)
        .labels("compliance=enforced")
        .owns::<ConfigMap>(&format!("managed-by={}", uniform::MANAGER))
        .invariant(compliant)
}

#[test]
fn the_uniform_reconciler_passes_random_schedules_with_faults_relists_and_departures() {
    let report = checker(uniform::reconcile::<ClusterName>)
        .budgets(2, 1, 1, 1)
        .random(300)
        .unwrap_or_else(|f| panic!("{f}"));
    assert_eq!(report.schedules, 300);
}

#[test]
fn the_uniform_reconciler_passes_every_schedule_of_one_cluster_without_faults() {
    let report = Checker::new(uniform::reconcile::<ClusterName>, ())
        .cluster("a", seeded)
        .labels("compliance=enforced")
        .owns::<ConfigMap>(&format!("managed-by={}", uniform::MANAGER))
        .invariant(compliant)
        .budgets(0, 1, 0, 1)
        .exhaustive(20_000)
        .unwrap_or_else(|f| panic!("{f}"));
    eprintln!("{report:?}");
    assert!(report.exhausted, "{report:?}");
}

/// The uniform example's reconcile, its error as a kube error.
async fn comply(
    ns: &Arc<Namespace>,
    ctx: &Context<ClusterName, ()>,
) -> Result<Action, kube::Error> {
    uniform::reconcile(ns.clone(), ctx.clone())
        .await
        .map_err(|e| match e {
            uniform::Error::Kube(k) => k,
            other => kube::Error::Service(other.to_string().into()),
        })
}

/// Broken: counts its applies in an audit ConfigMap beside the policy, so every reconcile
/// writes.
async fn counting(
    ns: Arc<Namespace>,
    ctx: Context<ClusterName, ()>,
) -> Result<Action, kube::Error> {
    comply(&ns, &ctx).await?;
    let api = Api::<ConfigMap>::namespaced(ctx.client(), &ns.name_any());
    let count: u64 = match api.get_opt("compliance-audit").await? {
        Some(audit) => audit
            .annotations()
            .get("applied-count")
            .and_then(|c| c.parse().ok())
            .unwrap_or(0),
        None => 0,
    };
    let audit = serde_json::json!({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "compliance-audit", "annotations": {"applied-count": (count + 1).to_string()}}
    });
    api.patch(
        "compliance-audit",
        &PatchParams::apply("audit").force(),
        &Patch::Apply(&audit),
    )
    .await?;
    Ok(Action::requeue(Duration::from_secs(600)))
}

/// Broken: applies the ConfigMap through the first cluster of the fleet, whatever cluster
/// the namespace is in.
async fn wrong_cluster(
    ns: Arc<Namespace>,
    ctx: Context<ClusterName, ()>,
) -> Result<Action, kube::Error> {
    let first = ctx
        .fleet()
        .clusters()
        .into_iter()
        .next()
        .map(|c| c.client())
        .unwrap_or_else(|| ctx.client());
    let name = ns.name_any();
    let wanted = ConfigMap {
        metadata: ObjectMeta {
            name: Some("compliance".into()),
            namespace: Some(name.clone()),
            labels: Some(BTreeMap::from([(
                "managed-by".into(),
                uniform::MANAGER.into(),
            )])),
            ..Default::default()
        },
        data: Some(BTreeMap::from([("policy".into(), uniform::POLICY.into())])),
        ..Default::default()
    };
    Api::<ConfigMap>::namespaced(first, &name)
        .patch(
            "compliance",
            &PatchParams::apply(uniform::MANAGER).force(),
            &Patch::Apply(&wanted),
        )
        .await?;
    Ok(Action::requeue(Duration::from_secs(600)))
}

/// Compliance and a fleet-wide report in the hub: every compliant cluster/namespace listed
/// in the ConfigMap `report` of cluster `hub`. `careful` writes the report with its version
/// (a conflict is retried); otherwise it reads, adds and replaces without one, and loses
/// the other cluster's entry when two reconciles interleave.
async fn reporting(
    ns: Arc<Namespace>,
    ctx: Context<ClusterName, ()>,
    careful: bool,
) -> Result<Action, kube::Error> {
    if ctx.cluster_id().as_str() == "hub" {
        return Ok(Action::await_change());
    }
    comply(&ns, &ctx).await?;
    let hub = ctx
        .cluster_by_id(&ClusterName::from("hub"))
        .map(|c| c.client())
        .unwrap_or_else(|| ctx.client());
    let reports = Api::<ConfigMap>::namespaced(hub, "default");
    let entry = format!("{}.{}", ctx.cluster_id(), ns.name_any());
    let mut report = match reports.get_opt("report").await? {
        Some(r) => r,
        None => {
            let mut r = ConfigMap::default();
            r.metadata.name = Some("report".into());
            match reports.create(&PostParams::default(), &r).await {
                Ok(r) => r,
                Err(kube::Error::Api(s)) if s.code == 409 => reports.get("report").await?,
                Err(e) => return Err(e),
            }
        }
    };
    if report.data.as_ref().is_some_and(|d| d.contains_key(&entry)) {
        return Ok(Action::requeue(Duration::from_secs(600)));
    }
    report
        .data
        .get_or_insert_with(BTreeMap::new)
        .insert(entry, "compliant".into());
    if !careful {
        report.metadata.resource_version = None;
    }
    reports
        .replace("report", &PostParams::default(), &report)
        .await?;
    Ok(Action::requeue(Duration::from_secs(600)))
}

fn reported(world: &World) -> Result<(), String> {
    compliant(world)?;
    let report: Option<ConfigMap> = world.get("hub", Some("default"), "report");
    let data = report.and_then(|r| r.data).unwrap_or_default();
    for cluster in ["a", "b"] {
        if !data.contains_key(&format!("{cluster}.team-a")) {
            return Err(format!("the report lacks {cluster}.team-a: {data:?}"));
        }
    }
    Ok(())
}

fn reporting_checker(careful: bool) -> Checker<Namespace, ()> {
    Checker::new(move |ns, ctx| reporting(ns, ctx, careful), ())
        .cluster("a", seeded)
        .cluster("b", seeded)
        .cluster("hub", |b| b)
        .watched_in(|c| c != "hub")
        .labels("compliance=enforced")
        .invariant(reported)
        .budgets(0, 0, 0, 0)
}

/// The failure is replayable: its seed fails again, the same way.
fn assert_replays<S: Send + Sync + 'static>(
    checker: &Checker<Namespace, S>,
    failure: &multicluster_runtime_fake::Failure,
) {
    let again = checker
        .replay(failure.seed)
        .expect_err("the seed should fail again");
    assert_eq!(
        std::mem::discriminant(&again.violation),
        std::mem::discriminant(&failure.violation),
        "{again}"
    );
}

#[test]
fn a_reconciler_that_writes_on_every_reconcile_is_caught_as_not_idempotent() {
    let c = checker(counting);
    let failure = c.random(50).expect_err("the checker should catch it");
    assert!(
        matches!(failure.violation, Violation::NotIdempotent(_)),
        "{failure}"
    );
    assert_replays(&c, &failure);
}

#[test]
fn a_reconciler_that_acts_on_the_wrong_cluster_is_caught_as_not_converged() {
    let c = checker(wrong_cluster).budgets(0, 0, 0, 0);
    let failure = c.random(50).expect_err("the checker should catch it");
    assert!(
        matches!(failure.violation, Violation::NotConverged(_)),
        "{failure}"
    );
    assert_replays(&c, &failure);
}

#[test]
fn a_reconciler_that_loses_an_update_when_two_clusters_interleave_is_caught() {
    let c = reporting_checker(false);
    let failure = c.random(500).expect_err("the checker should catch it");
    eprintln!("{failure}");
    assert!(
        matches!(failure.violation, Violation::NotConverged(_)),
        "{failure}"
    );
    assert_replays(&c, &failure);
    // With its version, the same reconciler retries the conflict and passes.
    reporting_checker(true)
        .random(500)
        .unwrap_or_else(|f| panic!("{f}"));
}

/// Keeps a client of every cluster it reconciled in (state shared by its reconciles, fresh
/// for each schedule).
#[derive(Default)]
struct Seen(std::sync::Mutex<Vec<(String, kube::Client)>>);

impl Clone for Seen {
    fn clone(&self) -> Self {
        Seen::default()
    }
}

/// Broken: mirrors the policy into every cluster it has seen, through clients it kept, so a
/// cluster that left keeps receiving writes.
async fn stale_handles(
    ns: Arc<Namespace>,
    ctx: Context<ClusterName, Seen>,
) -> Result<Action, kube::Error> {
    let me = ctx.cluster_id().to_string();
    let targets = {
        let mut seen = ctx
            .state()
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if !seen.iter().any(|(id, _)| *id == me) {
            seen.push((me.clone(), ctx.client()));
        }
        seen.clone()
    };
    for (_, client) in targets {
        let mirror = serde_json::json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "mirror"},
            "data": {"from": ns.name_any()}
        });
        Api::<ConfigMap>::namespaced(client, "default")
            .patch(
                "mirror",
                &PatchParams::apply("mirror").force(),
                &Patch::Apply(&mirror),
            )
            .await?;
    }
    Ok(Action::requeue(Duration::from_secs(600)))
}

#[test]
fn a_reconciler_that_writes_through_a_departed_clusters_kept_client_is_caught() {
    let c = Checker::new(stale_handles, Seen::default())
        .cluster("a", seeded)
        .cluster("b", seeded)
        .labels("compliance=enforced")
        .budgets(0, 2, 1, 1);
    let failure = c.random(300).expect_err("the checker should catch it");
    assert!(
        matches!(failure.violation, Violation::WroteAfterLeaving(_)),
        "{failure}"
    );
    assert_replays(&c, &failure);
}

/// Waits ten seconds (a backoff, say) before it applies.
async fn slow(ns: Arc<Namespace>, ctx: Context<ClusterName, ()>) -> Result<Action, kube::Error> {
    tokio::time::sleep(Duration::from_secs(10)).await;
    comply(&ns, &ctx).await
}

#[test]
fn a_reconcile_waiting_on_a_timer_is_waited_for_not_judged_half_way() {
    checker(slow)
        .budgets(0, 0, 0, 0)
        .random(20)
        .unwrap_or_else(|f| panic!("{f}"));
}

#[test]
fn the_checker_runs_inside_an_async_test_too() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        checker(uniform::reconcile::<ClusterName>)
            .budgets(0, 0, 0, 0)
            .random(5)
            .unwrap_or_else(|f| panic!("{f}"));
    });
}

#[test]
fn an_exhaustive_failure_replays_from_its_choices() {
    let c = checker(counting).budgets(0, 0, 0, 0);
    let failure = c
        .exhaustive(1_000)
        .expect_err("the checker should catch it");
    assert!(
        matches!(failure.violation, Violation::NotIdempotent(_)),
        "{failure}"
    );
    assert!(failure.to_string().contains("replay_choices"), "{failure}");
    let again = c
        .replay_choices(&failure.choices)
        .expect_err("the choices should fail again");
    assert_eq!(
        std::mem::discriminant(&again.violation),
        std::mem::discriminant(&failure.violation),
        "{again}"
    );
}
