//! Unit tests of the shipped examples' reconcilers, on a fake fleet under paused time: no
//! control plane, milliseconds per test.

#[path = "../../examples/quickstart.rs"]
#[allow(dead_code)]
mod quickstart;
mod support;
#[path = "../../examples/uniform.rs"]
#[allow(dead_code)]
mod uniform;

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use multicluster_runtime::Manager;
use multicluster_runtime_fake::{ApiServer, FakeFleet, Verb};

/// Namespaces `team-a` (enforced) and `sandbox` (exempt) in `server`.
async fn namespaces(server: &ApiServer) {
    for (name, enforced) in [("team-a", true), ("sandbox", false)] {
        let mut ns = Namespace::default();
        ns.metadata.name = Some(name.into());
        if enforced {
            ns.metadata.labels = Some(BTreeMap::from([("compliance".into(), "enforced".into())]));
        }
        Api::<Namespace>::all(server.client())
            .create(&PostParams::default(), &ns)
            .await
            .unwrap();
    }
}

async fn policy_of(server: &ApiServer, namespace: &str) -> Option<String> {
    let cm = Api::<ConfigMap>::namespaced(server.client(), namespace)
        .get_opt("compliance")
        .await
        .ok()??;
    cm.data?.get("policy").cloned()
}

fn start(
    fleet: &FakeFleet,
) -> (
    Arc<Manager<multicluster_runtime::providers::Clusters>>,
    tokio::task::JoinHandle<()>,
) {
    let manager = Arc::new(Manager::new(fleet.provider()));
    uniform::start_controller(&manager);
    let run = tokio::spawn({
        let manager = manager.clone();
        async move { manager.run().await.unwrap() }
    });
    (manager, run)
}

#[tokio::test(start_paused = true)]
async fn uniform_makes_every_enforced_namespace_of_three_clusters_compliant_and_repairs_drift() {
    let fleet = FakeFleet::new();
    let servers: Vec<ApiServer> = ["a", "b", "c"].iter().map(|n| fleet.add(n)).collect();
    for s in &servers {
        namespaces(s).await;
    }
    let (manager, run) = start(&fleet);
    for s in &servers {
        support::eventually(&format!("{}: team-a compliant", s.name()), || async {
            policy_of(s, "team-a").await.as_deref() == Some(uniform::POLICY)
        })
        .await;
    }
    // A namespace enforced later is the sync point: once it is compliant, the initial lists
    // (which held `sandbox`) have been handled.
    for s in &servers {
        let mut ns = Namespace::default();
        ns.metadata.name = Some("team-b".into());
        ns.metadata.labels = Some(BTreeMap::from([("compliance".into(), "enforced".into())]));
        Api::<Namespace>::all(s.client())
            .create(&PostParams::default(), &ns)
            .await
            .unwrap();
        support::eventually("team-b compliant", || async {
            policy_of(s, "team-b").await.is_some()
        })
        .await;
        assert_eq!(
            policy_of(s, "sandbox").await,
            None,
            "{}: the exempt namespace got the ConfigMap",
            s.name()
        );
    }
    // Drift in b: deleted, then edited; both put back.
    let b = &servers[1];
    let cms = Api::<ConfigMap>::namespaced(b.client(), "team-a");
    cms.delete("compliance", &DeleteParams::default())
        .await
        .unwrap();
    support::eventually("the deleted ConfigMap restored", || async {
        policy_of(b, "team-a").await.as_deref() == Some(uniform::POLICY)
    })
    .await;
    cms.patch(
        "compliance",
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({"data": {"policy": "anything"}})),
    )
    .await
    .unwrap();
    support::eventually("the edited ConfigMap restored", || async {
        policy_of(b, "team-a").await.as_deref() == Some(uniform::POLICY)
    })
    .await;
    manager.shutdown();
    run.await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn uniform_writes_nothing_to_a_cluster_after_it_left_and_serves_it_again_when_it_returns() {
    let fleet = FakeFleet::new();
    let a = fleet.add("a");
    let b = fleet.add("b");
    namespaces(&a).await;
    namespaces(&b).await;
    let (manager, run) = start(&fleet);
    for s in [&a, &b] {
        support::eventually("compliant", || async {
            policy_of(s, "team-a").await.is_some()
        })
        .await;
    }
    assert!(fleet.leave("b"));
    let _ = b.take_requests();
    // A change in b while it is away, and a change in a as the sync point: once a's is
    // handled, the manager has had every chance to act on b's.
    Api::<ConfigMap>::namespaced(b.client(), "team-a")
        .delete("compliance", &DeleteParams::default())
        .await
        .unwrap();
    Api::<ConfigMap>::namespaced(a.client(), "team-a")
        .delete("compliance", &DeleteParams::default())
        .await
        .unwrap();
    support::eventually("a repaired", || async {
        policy_of(&a, "team-a").await.is_some()
    })
    .await;
    let writes: Vec<_> = b
        .take_requests()
        .into_iter()
        .filter(|r| r.verb.writes())
        .collect();
    // The test's own delete is the only write b saw.
    assert_eq!(writes.len(), 1, "writes to b after it left: {writes:?}");
    assert_eq!(writes[0].verb, Verb::Delete);
    fleet.rejoin("b");
    support::eventually("b repaired after it returned", || async {
        policy_of(&b, "team-a").await.is_some()
    })
    .await;
    manager.shutdown();
    run.await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn quickstart_reconciles_each_clusters_configmaps_a_late_cluster_and_none_of_a_removed_one() {
    let fleet = FakeFleet::new();
    let servers: Vec<ApiServer> = ["c0", "c1", "c2"].iter().map(|n| fleet.add(n)).collect();
    let tally = Arc::new(quickstart::Tally::default());
    let manager = quickstart::manager_with_controller(&fleet.provider(), &tally);
    let run = tokio::spawn({
        let manager = manager.clone();
        async move { manager.run().await.unwrap() }
    });
    for s in &servers {
        let cms = Api::<ConfigMap>::default_namespaced(s.client());
        cms.create(
            &PostParams::default(),
            &quickstart::greeting("hello", "world"),
        )
        .await
        .unwrap();
        let name = s.name().to_owned();
        support::eventually("the first reconcile", || {
            let tally = tally.clone();
            let name = name.clone();
            async move { tally.count(&name) >= 1 }
        })
        .await;
    }
    let late = fleet.add("c3");
    Api::<ConfigMap>::default_namespaced(late.client())
        .create(
            &PostParams::default(),
            &quickstart::greeting("hello", "late"),
        )
        .await
        .unwrap();
    support::eventually("the late cluster's reconcile", || {
        let tally = tally.clone();
        async move { tally.count("c3") >= 1 }
    })
    .await;
    // c1 leaves; a change there and one in c0 (the sync point: once c0's is reconciled, c1's
    // had every chance to be).
    assert!(fleet.leave("c1"));
    let before = tally.count("c1");
    let c0_before = tally.count("c0");
    for (s, text) in [(&servers[1], "unseen"), (&servers[0], "seen")] {
        Api::<ConfigMap>::default_namespaced(s.client())
            .patch(
                "hello",
                &PatchParams::default(),
                &Patch::Merge(serde_json::json!({"data": {"greeting": text}})),
            )
            .await
            .unwrap();
    }
    support::eventually("c0's change reconciled", || {
        let tally = tally.clone();
        async move { tally.count("c0") > c0_before }
    })
    .await;
    assert_eq!(tally.count("c1"), before, "c1 was reconciled after it left");
    manager.shutdown();
    run.await.unwrap();
}
