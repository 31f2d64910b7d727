//! Unit tests of the federated example's multi-cluster-aware reconciler (a host object fanned
//! out to member clusters, with a custom cluster id type), on fake clusters: under a manager,
//! and under the schedule checker.

#[path = "../../examples/federated.rs"]
#[allow(dead_code)]
mod federated;
mod support;

use std::sync::Arc;

use federated::{FROM, FederatedConfig, Site};
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, PostParams};
use multicluster_runtime::{Cluster, Manager, Request};
use multicluster_runtime_fake::{ApiServer, ApiServerBuilder, Checker, FakeFleet, World};

fn crd() -> CustomResourceDefinition {
    serde_saphyr::from_str(federated::CRD).expect("the example's CRD")
}

fn host_builder() -> ApiServerBuilder {
    ApiServer::builder("global.host").crd(crd())
}

async fn copy_is(server: &ApiServer, value: &str) -> bool {
    let cm = Api::<ConfigMap>::namespaced(server.client(), "default")
        .get_opt("greeting")
        .await
        .ok()
        .flatten();
    cm.and_then(|c| c.data)
        .and_then(|d| d.get("hello").cloned())
        .as_deref()
        == Some(value)
}

async fn synced(host: &ApiServer) -> Option<u32> {
    let fc = Api::<FederatedConfig>::namespaced(host.client(), "default")
        .get_opt("greeting")
        .await
        .ok()??;
    fc.status.map(|s| s.synced)
}

#[tokio::test(start_paused = true)]
async fn federated_fans_out_to_members_repairs_them_serves_a_late_one_and_cleans_up_first() {
    let fleet = FakeFleet::<Site>::default();
    let m1 = fleet.add("eu.m1");
    let m2 = fleet.add("eu.m2");
    let host = host_builder().build();
    let hub = Site::new("global", "host");
    let manager = Arc::new(
        Manager::new(fleet.provider()).with_local(Cluster::new(hub.clone(), host.client())),
    );
    federated::start_controller(&manager, hub);
    let run = tokio::spawn({
        let manager = manager.clone();
        async move { manager.run().await.unwrap() }
    });

    let host_api = Api::<FederatedConfig>::namespaced(host.client(), "default");
    host_api
        .create(
            &PostParams::default(),
            &FederatedConfig::new("greeting", &[("hello", "world")]),
        )
        .await
        .unwrap();
    for m in [&m1, &m2] {
        support::eventually("the copy in a member", || copy_is(m, "world")).await;
    }
    support::eventually("status: 2 synced", || async {
        synced(&host).await == Some(2)
    })
    .await;

    Api::<ConfigMap>::namespaced(m1.client(), "default")
        .delete("greeting", &DeleteParams::default())
        .await
        .unwrap();
    support::eventually("the deleted copy restored", || copy_is(&m1, "world")).await;

    let late = fleet.add("us.m3");
    support::eventually("the copy in the late member", || copy_is(&late, "world")).await;
    support::eventually("status: 3 synced", || async {
        synced(&host).await == Some(3)
    })
    .await;

    host_api
        .delete("greeting", &DeleteParams::default())
        .await
        .unwrap();
    support::eventually("the host object gone", || async {
        host_api.get_opt("greeting").await.ok().flatten().is_none()
    })
    .await;
    for m in [&m1, &m2, &late] {
        let left = Api::<ConfigMap>::namespaced(m.client(), "default")
            .get_opt("greeting")
            .await
            .unwrap();
        assert!(
            left.is_none(),
            "{}: the copy outlived the host object",
            m.name()
        );
    }
    manager.shutdown();
    run.await.unwrap();
}

/// Every member that is engaged holds the host object's data.
fn fanned_out(world: &World) -> Result<(), String> {
    let Some(fc) = world.get::<FederatedConfig>("global.host", Some("default"), "greeting") else {
        return Err("the host object is gone".into());
    };
    for member in world
        .clusters()
        .filter(|c| *c != "global.host" && world.is_engaged(c))
    {
        let copy: Option<ConfigMap> = world.get(member, Some("default"), "greeting");
        if copy.as_ref().and_then(|c| c.data.as_ref()) != Some(&fc.spec.data) {
            return Err(format!("{member}: the copy is {copy:?}"));
        }
    }
    Ok(())
}

#[test]
fn federated_converges_over_interleavings_conflicts_relists_and_a_member_leaving() {
    let greeting = FederatedConfig::new("greeting", &[("hello", "world")]);
    let hub = Site::new("global", "host");
    let report = Checker::new(federated::reconcile, ())
        .local("global.host", move |_| host_builder().object(&greeting))
        .cluster("eu.m1", |b| b)
        .cluster("eu.m2", |b| b)
        .watched_in(|c| c == "global.host")
        .maps::<ConfigMap, _>(move |_, cm| {
            cm.labels()
                .get(FROM)
                .map(|name| Request::new(hub.clone(), cm.namespace(), name.clone()))
                .into_iter()
                .collect()
        })
        .invariant(fanned_out)
        .budgets(1, 1, 1, 1)
        .random(200)
        .unwrap_or_else(|f| panic!("{f}"));
    assert_eq!(report.schedules, 200);
}
