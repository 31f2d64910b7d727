//! Cluster identity (KEP-2149) against real apiservers: `ClusterProperty` objects
//! (`tests/crds/clusterproperty.yaml`, written from the KEP's text) read by the `ById` and
//! `Identified` wrappers around a `Clusters` provider.

mod common;

use std::sync::Arc;

use common::*;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams};
use multicluster_runtime::providers::{ById, Clusters, Identified};
use multicluster_runtime::{Builder, Cluster, ClusterIdentity, ClusterName, Manager};
use multicluster_runtime_testenv::{TestCluster, TestEnv};
use serde_json::json;

const CRD: &str = include_str!("crds/clusterproperty.yaml");
/// The same kind served as `v1beta1` only (the about-api project's current version).
const CRD_V1BETA1: &str = include_str!("crds/clusterproperty-v1beta1.yaml");

fn properties(member: &TestCluster) -> Api<DynamicObject> {
    properties_at(member, "v1alpha1")
}

fn properties_at(member: &TestCluster, version: &str) -> Api<DynamicObject> {
    Api::all_with(
        member.client().unwrap(),
        &ClusterIdentity::resource(version),
    )
}

/// Creates or changes property `name` of `member`.
async fn set_property(member: &TestCluster, name: &str, value: &str) {
    set_property_at(member, "v1alpha1", name, value).await;
}

async fn set_property_at(member: &TestCluster, version: &str, name: &str, value: &str) {
    let object = json!({
        "apiVersion": format!("about.k8s.io/{version}"),
        "kind": "ClusterProperty",
        "metadata": {"name": name},
        "spec": {"value": value},
    });
    properties_at(member, version)
        .patch(
            name,
            &PatchParams::apply("identity-test").force(),
            &Patch::Apply(object),
        )
        .await
        .unwrap();
}

async fn delete_property(member: &TestCluster, name: &str) {
    properties(member)
        .delete(name, &DeleteParams::default())
        .await
        .unwrap();
}

fn member(name: &str, member: &TestCluster) -> Cluster<ClusterName> {
    Cluster::from_config(ClusterName::from(name), member.config()).unwrap()
}

fn identity(id: Option<&str>, clusterset: Option<&str>) -> Option<ClusterIdentity> {
    Some(ClusterIdentity {
        id: id.map(str::to_string),
        clusterset: clusterset.map(str::to_string),
    })
}

/// The server `id` of `manager`'s fleet reaches.
fn server<P: multicluster_runtime::Provider<Id = ClusterName>>(
    manager: &Manager<P>,
    id: &str,
) -> Option<String> {
    manager
        .cluster(&name(id))
        .and_then(|c| c.config().map(|c| c.cluster_url.to_string()))
        .map(|s| s.trim_end_matches('/').to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_keyed_by_cluster_id_follows_the_properties_across_renames() {
    let logs = Logs::capture();
    let env = TestEnv::builder().clusters(3).start().await.unwrap();
    let (a, b, c) = (
        env.cluster(0).unwrap(),
        env.cluster(1).unwrap(),
        env.cluster(2).unwrap(),
    );
    for (member, id, set) in [(&a, "alpha", "set-1"), (&b, "beta", "set-2")] {
        member.install_crds(CRD).await.unwrap();
        set_property(member, "cluster.clusterset.k8s.io", id).await;
        set_property(member, "clusterset.k8s.io", set).await;
        fixture(&member.client().unwrap()).await;
    }
    fixture(&c.client().unwrap()).await;

    let clusters = Clusters::new();
    let manager = Arc::new(Manager::new(ById::new(clusters.clone())));
    let seen = Arc::new(Seen::default());
    Builder::<_, ConfigMap>::new(&manager, fixture_objects()).start(
        feed_animals,
        retry_soon,
        seen.clone(),
    );
    let run = spawn_manager(&manager);
    for (n, m) in [("first", &a), ("second", &b), ("third", &c)] {
        clusters.add(member(n, m)).unwrap();
    }
    eventually(30, "alpha and beta engaged under their ids", async || {
        manager.fleet().ids() == [name("alpha"), name("beta")]
    })
    .await;
    eventually(30, "alpha fed", async || {
        is_fed(&a.client().unwrap(), "zoo", "elephant").await
    })
    .await;
    assert!(seen.clusters().contains("alpha"));
    assert_eq!(server(&manager, "alpha").as_deref(), Some(a.server()));
    assert_eq!(
        manager.cluster(&name("alpha")).unwrap().identity(),
        identity(Some("alpha"), Some("set-1"))
    );

    // A change of a property is seen on the engaged cluster, without engaging it again.
    let before = manager.cluster(&name("alpha")).unwrap();
    set_property(&a, "clusterset.k8s.io", "set-3").await;
    eventually(30, "alpha's identity refreshed", async || {
        before.identity() == identity(Some("alpha"), Some("set-3"))
    })
    .await;
    assert!(
        manager
            .cluster(&name("alpha"))
            .unwrap()
            .same_instance(&before)
    );

    // The provider renames a's cluster: the fleet still knows it as alpha.
    clusters.remove(&name("first"));
    clusters.add(member("renamed-first", &a)).unwrap();
    eventually(
        30,
        "alpha engaged again from the renamed cluster",
        async || {
            manager.fleet().ids() == [name("alpha"), name("beta")]
                && !manager
                    .cluster(&name("alpha"))
                    .unwrap()
                    .same_instance(&before)
        },
    )
    .await;
    assert_eq!(server(&manager, "alpha").as_deref(), Some(a.server()));

    // A second name for a's cluster (same endpoint and credentials) claims alpha too: the id
    // is contested, so neither is engaged under it (both named in a WARN and in an Event on
    // the id property); when the first name goes, the second takes alpha.
    clusters.add(member("twin", &a)).unwrap();
    let held = manager.cluster(&name("alpha")).unwrap();
    eventually(30, "alpha engaged for neither claimant", async || {
        manager.fleet().ids() == [name("beta")]
    })
    .await;
    let contested = ["not engaged", "claimed by 2 clusters (renamed-first, twin)"];
    eventually(30, "a WARN for each claimant", async || {
        logs.lines(&contested).len() == 2
    })
    .await;
    eventually(
        30,
        "the contest recorded in the claimant's cluster",
        async || {
            has_event(
                &a.client().unwrap(),
                "default",
                "ClusterIdContested",
                "cluster.clusterset.k8s.io",
                "claimed by another cluster",
            )
            .await
        },
    )
    .await;
    // The member's readers learn that the id is contested, not what else the fleet holds:
    // the claimants' names stay in the host's log.
    let events: Api<k8s_openapi::api::events::v1::Event> =
        Api::namespaced(a.client().unwrap(), "default");
    for event in events.list(&Default::default()).await.unwrap() {
        let note = event.note.unwrap_or_default();
        assert!(
            !note.contains("renamed-first") && !note.contains("twin"),
            "{note}"
        );
    }
    clusters.remove(&name("renamed-first"));
    eventually(30, "alpha taken over by twin", async || {
        manager
            .cluster(&name("alpha"))
            .is_some_and(|c| !c.same_instance(&held))
    })
    .await;
    assert_eq!(server(&manager, "alpha").as_deref(), Some(a.server()));

    // c had no ClusterProperty kind; installed late with an id, it is engaged as gamma (its
    // property watch retries).
    c.install_crds(CRD).await.unwrap();
    set_property(&c, "cluster.clusterset.k8s.io", "gamma").await;
    eventually(60, "gamma engaged once c has an id", async || {
        manager.fleet().ids().contains(&name("gamma"))
    })
    .await;
    assert_eq!(server(&manager, "gamma").as_deref(), Some(c.server()));

    // c claims alpha too: contested, engaged for neither; c takes it when a's cluster goes.
    set_property(&c, "cluster.clusterset.k8s.io", "alpha").await;
    eventually(
        30,
        "neither gamma nor alpha once c claims alpha",
        async || manager.fleet().ids() == [name("beta")],
    )
    .await;
    clusters.remove(&name("twin"));
    eventually(30, "alpha taken over by c", async || {
        server(&manager, "alpha").as_deref() == Some(c.server())
    })
    .await;

    // b's id property deleted, and an id that is not a DNS label: not engaged.
    delete_property(&b, "cluster.clusterset.k8s.io").await;
    eventually(30, "beta disengaged without its id", async || {
        manager.fleet().ids() == [name("alpha")]
    })
    .await;
    set_property(&b, "cluster.clusterset.k8s.io", "Not_A_Label").await;
    // Sync point: the warning about that id.
    eventually(30, "a warning about b's invalid id", async || {
        !logs
            .lines(&["not engaged", "second", "Not_A_Label"])
            .is_empty()
    })
    .await;
    assert_eq!(manager.fleet().ids(), [name("alpha")]);
    set_property(&b, "cluster.clusterset.k8s.io", "beta-2").await;
    eventually(30, "beta-2 engaged", async || {
        manager.fleet().ids() == [name("alpha"), name("beta-2")]
    })
    .await;

    manager.shutdown();
    run.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clusters_carry_their_identity_and_a_clusterset_filter_follows_membership() {
    let env = TestEnv::builder().clusters(3).start().await.unwrap();
    let (a, b, c) = (
        env.cluster(0).unwrap(),
        env.cluster(1).unwrap(),
        env.cluster(2).unwrap(),
    );
    for (member, id, set) in [(&a, "alpha", "set-1"), (&b, "beta", "set-2")] {
        member.install_crds(CRD).await.unwrap();
        set_property(member, "cluster.clusterset.k8s.io", id).await;
        set_property(member, "clusterset.k8s.io", set).await;
    }
    let (all, filtered) = (Clusters::new(), Clusters::new());
    let everyone = Arc::new(Manager::new(Identified::new(all.clone())));
    let members = Arc::new(Manager::new(
        Identified::new(filtered.clone()).clusterset("set-1"),
    ));
    let runs = [spawn_manager(&everyone), spawn_manager(&members)];
    for (n, m) in [("a", &a), ("b", &b), ("c", &c)] {
        all.add(member(n, m)).unwrap();
        filtered.add(member(n, m)).unwrap();
    }

    // Without a filter every cluster is engaged under its own name, its identity read.
    let read = async |n: &str| everyone.cluster(&name(n)).and_then(|c| c.identity());
    eventually(30, "every identity read", async || {
        read("a").await == identity(Some("alpha"), Some("set-1"))
            && read("b").await == identity(Some("beta"), Some("set-2"))
            // c does not serve ClusterProperty: read, and empty.
            && read("c").await == Some(ClusterIdentity::default())
    })
    .await;
    assert_eq!(everyone.fleet().ids(), [name("a"), name("b"), name("c")]);

    // With the filter, only set-1's members; b joins and leaves.
    eventually(30, "a engaged as set-1's only member", async || {
        members.fleet().ids() == [name("a")]
    })
    .await;
    set_property(&b, "clusterset.k8s.io", "set-1").await;
    eventually(30, "b engaged once it joins set-1", async || {
        members.fleet().ids() == [name("a"), name("b")]
    })
    .await;
    delete_property(&b, "clusterset.k8s.io").await;
    eventually(30, "b disengaged once it leaves", async || {
        members.fleet().ids() == [name("a")]
    })
    .await;
    // Sync point for the unfiltered fleet: b's change is seen there too.
    eventually(30, "b's identity without a clusterset", async || {
        read("b").await == identity(Some("beta"), None)
    })
    .await;
    assert_eq!(everyone.fleet().ids(), [name("a"), name("b"), name("c")]);

    everyone.shutdown();
    members.shutdown();
    for run in runs {
        run.await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ids_are_read_from_v1beta1_where_served_and_must_match_the_providers_record() {
    let env = TestEnv::builder().clusters(2).start().await.unwrap();
    let (a, b) = (env.cluster(0).unwrap(), env.cluster(1).unwrap());
    // a serves ClusterProperty as v1beta1 only, b as v1alpha1.
    a.install_crds(CRD_V1BETA1).await.unwrap();
    set_property_at(
        &a,
        "v1beta1",
        "cluster.clusterset.k8s.io",
        "east.example.com",
    )
    .await;
    b.install_crds(CRD).await.unwrap();
    set_property(&b, "cluster.clusterset.k8s.io", "west").await;
    assert_eq!(
        ClusterIdentity::read(&a.client().unwrap()).await.unwrap(),
        identity(Some("east.example.com"), None).unwrap()
    );

    // The provider side's record: first is east.example.com, second is south (b claims west).
    let clusters = Clusters::new();
    let manager = Arc::new(Manager::new(ById::new(clusters.clone()).expect_id(
        |name: &ClusterName| match name.as_str() {
            "first" => Some("east.example.com".to_string()),
            "second" => Some("south".to_string()),
            _ => None,
        },
    )));
    let run = spawn_manager(&manager);
    clusters.add(member("first", &a)).unwrap();
    clusters.add(member("second", &b)).unwrap();
    eventually(30, "east.example.com engaged from v1beta1", async || {
        manager.fleet().ids() == [name("east.example.com")]
    })
    .await;
    assert_eq!(
        manager
            .cluster(&name("east.example.com"))
            .unwrap()
            .identity(),
        identity(Some("east.example.com"), None)
    );
    eventually(30, "b's unexpected claim recorded in b", async || {
        has_event(
            &b.client().unwrap(),
            "default",
            "ClusterIdUnexpected",
            "cluster.clusterset.k8s.io",
            "the provider expects \"south\"",
        )
        .await
    })
    .await;
    assert_eq!(manager.fleet().ids(), [name("east.example.com")]);
    // b's admin corrects the claim: engaged.
    set_property(&b, "cluster.clusterset.k8s.io", "south").await;
    eventually(30, "south engaged once it matches", async || {
        manager.fleet().ids() == [name("east.example.com"), name("south")]
    })
    .await;

    manager.shutdown();
    run.await.unwrap();
}
