//! The Cluster API provider against real apiservers with Cluster API's own `Cluster` CRD
//! (from `sigs.k8s.io/cluster-api`, fetched by `scripts/provider-assets.sh`): a management
//! cluster holding `Cluster` objects and kubeconfig Secrets for two workload clusters.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;

use common::*;
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use multicluster_runtime::providers::ClusterApi;
use multicluster_runtime::{Builder, Manager};
use multicluster_runtime_testenv::TestEnv;
use serde_json::json;

/// Cluster API's `Cluster` CRD, from the provider assets.
fn cluster_crd() -> String {
    let dir = std::env::var("MCR_PROVIDER_ASSETS").expect(
        "MCR_PROVIDER_ASSETS names the directory scripts/provider-assets.sh prints (scripts/test.sh sets it)",
    );
    std::fs::read_to_string(format!("{dir}/crds/cluster-api.yaml")).unwrap()
}

fn clusters_v1beta2() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &kube::api::GroupVersionKind::gvk("cluster.x-k8s.io", "v1beta2", "Cluster"),
        "clusters",
    )
}

/// A `Cluster` (v1beta2) in namespace `capi`; `spec` must not be empty.
fn cluster(name: &str) -> DynamicObject {
    DynamicObject::new(name, &clusters_v1beta2())
        .within("capi")
        .data(json!({"spec": {"paused": false}}))
}

/// The kubeconfig Secret Cluster API writes for cluster `name`.
fn kubeconfig_secret(name: &str, kubeconfig: &str) -> Secret {
    Secret {
        metadata: kube::api::ObjectMeta {
            name: Some(format!("{name}-kubeconfig")),
            labels: Some(BTreeMap::from([(
                "cluster.x-k8s.io/cluster-name".to_string(),
                name.to_string(),
            )])),
            ..Default::default()
        },
        type_: Some("cluster.x-k8s.io/secret".into()),
        data: Some(BTreeMap::from([(
            "value".to_string(),
            ByteString(kubeconfig.as_bytes().to_vec()),
        )])),
        ..Default::default()
    }
}

/// Sets the control plane of `name` initialized or not (the status subresource).
async fn set_ready(clusters: &Api<DynamicObject>, name: &str, ready: bool) {
    clusters
        .patch_status(
            name,
            &PatchParams::default(),
            &Patch::Merge(
                json!({"status": {"initialization": {"controlPlaneInitialized": ready}}}),
            ),
        )
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clusters_engage_when_ready_follow_their_kubeconfig_and_leave_when_deleted_or_unready() {
    let env = TestEnv::builder().clusters(3).start().await.unwrap();
    let (hub, east, west) = (
        env.cluster(0).unwrap(),
        env.cluster(1).unwrap(),
        env.cluster(2).unwrap(),
    );
    let hc = hub.client().unwrap();
    let (east_client, west_client) = (east.client().unwrap(), west.client().unwrap());
    fixture(&east_client).await;
    fixture(&west_client).await;
    hub.install_crds(&cluster_crd()).await.unwrap();
    create_namespace(&hc, "capi").await;
    let clusters: Api<DynamicObject> =
        Api::namespaced_with(hc.clone(), "capi", &clusters_v1beta2());
    let secrets: Api<Secret> = Api::namespaced(hc.clone(), "capi");
    let pp = PostParams::default();
    // east exists with its kubeconfig, but its control plane is not initialized yet.
    clusters.create(&pp, &cluster("east")).await.unwrap();
    secrets
        .create(&pp, &kubeconfig_secret("east", east.kubeconfig()))
        .await
        .unwrap();

    let manager = Arc::new(Manager::new(ClusterApi::new(hc.clone()).namespace("capi")));
    let seen = Arc::new(Seen::default());
    Builder::<_, ConfigMap>::new(&manager, fixture_objects()).start(
        feed_animals,
        retry_soon,
        seen.clone(),
    );
    let run = spawn_manager(&manager);

    // west: created after the start, ready at once.
    clusters.create(&pp, &cluster("west")).await.unwrap();
    secrets
        .create(&pp, &kubeconfig_secret("west", west.kubeconfig()))
        .await
        .unwrap();
    set_ready(&clusters, "west", true).await;
    eventually(30, "west fed", async || {
        is_fed(&west_client, "zoo", "elephant").await
    })
    .await;
    // Sync point: east was listed before west was created, and it is not ready.
    assert_eq!(manager.fleet().ids(), [name("capi/west")]);
    assert!(!is_fed(&east_client, "zoo", "elephant").await);

    set_ready(&clusters, "east", true).await;
    eventually(30, "east fed once ready", async || {
        is_fed(&east_client, "zoo", "elephant").await
    })
    .await;
    assert_eq!(
        manager.fleet().ids(),
        [name("capi/east"), name("capi/west")]
    );

    // Rotation: east's kubeconfig now reaches the west apiserver; the Cluster is untouched.
    let server_of = |m: &Manager<ClusterApi>| {
        m.cluster(&name("capi/east"))
            .and_then(|c| c.config().map(|c| c.cluster_url.to_string()))
    };
    assert_eq!(
        server_of(&manager).unwrap().trim_end_matches('/'),
        east.server()
    );
    secrets
        .replace(
            "east-kubeconfig",
            &pp,
            &kubeconfig_secret("east", west.kubeconfig()),
        )
        .await
        .unwrap();
    eventually(
        30,
        "east re-engaged with the rotated kubeconfig",
        async || server_of(&manager).is_some_and(|s| s.trim_end_matches('/') == west.server()),
    )
    .await;

    // Not ready: disengaged; ready again: engaged again.
    set_ready(&clusters, "east", false).await;
    eventually(30, "east disengaged when not ready", async || {
        manager.fleet().ids() == [name("capi/west")]
    })
    .await;
    set_ready(&clusters, "east", true).await;
    eventually(30, "east engaged again", async || {
        manager.fleet().ids().contains(&name("capi/east"))
    })
    .await;

    // Bad input, each reported on its Cluster: no Secret, a malformed kubeconfig, an exec
    // plugin. None of them holds up the others.
    for bad in ["lost", "broken", "evil"] {
        clusters.create(&pp, &cluster(bad)).await.unwrap();
    }
    secrets
        .create(&pp, &kubeconfig_secret("broken", "clusters: [ {"))
        .await
        .unwrap();
    let evil = east.kubeconfig().replace(
        "    client-certificate-data:",
        "    exec:\n      apiVersion: client.authentication.k8s.io/v1\n      command: /bin/true\n      interactiveMode: Never\n    client-certificate-data:",
    );
    assert!(evil.contains("exec:"));
    secrets
        .create(&pp, &kubeconfig_secret("evil", &evil))
        .await
        .unwrap();
    for bad in ["lost", "broken", "evil"] {
        set_ready(&clusters, bad, true).await;
    }
    for (object, note) in [
        ("lost", "lost-kubeconfig"),
        ("broken", "line"),
        ("evil", "exec"),
    ] {
        eventually(
            30,
            &format!("a Warning Event on Cluster {object}"),
            async || has_event(&hc, "capi", "KubeconfigRefused", object, note).await,
        )
        .await;
    }
    assert_eq!(
        manager.fleet().ids(),
        [name("capi/east"), name("capi/west")]
    );

    // The missing Secret appears: lost is engaged (reaching west's apiserver).
    secrets
        .create(&pp, &kubeconfig_secret("lost", west.kubeconfig()))
        .await
        .unwrap();
    eventually(30, "lost engaged once its Secret exists", async || {
        manager.fleet().ids().contains(&name("capi/lost"))
    })
    .await;

    // Deletion: west leaves, the others stay.
    clusters
        .delete("west", &DeleteParams::default())
        .await
        .unwrap();
    eventually(30, "west disengaged when deleted", async || {
        !manager.fleet().ids().contains(&name("capi/west"))
    })
    .await;
    assert_eq!(
        manager.fleet().ids(),
        [name("capi/east"), name("capi/lost")]
    );

    // Deletion begun (a finalizer holds the object): lost leaves at once.
    clusters
        .patch(
            "lost",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"finalizers": ["test.example/hold"]}})),
        )
        .await
        .unwrap();
    clusters
        .delete("lost", &DeleteParams::default())
        .await
        .unwrap();
    eventually(30, "lost disengaged once its deletion began", async || {
        manager.fleet().ids() == [name("capi/east")]
    })
    .await;
    assert!(
        clusters
            .get("lost")
            .await
            .unwrap()
            .metadata
            .deletion_timestamp
            .is_some()
    );
    clusters
        .patch(
            "lost",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"finalizers": null}})),
        )
        .await
        .unwrap();

    manager.shutdown();
    run.await.unwrap();
}

/// Cluster API's CRD as an older release served it: v1beta1 only.
fn cluster_crd_v1beta1_only() -> String {
    let mut crd: serde_json::Value = serde_saphyr::from_str(&cluster_crd()).unwrap();
    let versions = crd["spec"]["versions"].as_array_mut().unwrap();
    versions.retain(|v| v["name"] == "v1beta1");
    versions[0]["storage"] = json!(true);
    // JSON is YAML.
    crd.to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_api_installed_late_and_serving_v1beta1_only_is_found_and_watched() {
    let env = TestEnv::builder().clusters(2).start().await.unwrap();
    let (hub, workload) = (env.cluster(0).unwrap(), env.cluster(1).unwrap());
    let hc = hub.client().unwrap();
    let workload_client = workload.client().unwrap();
    fixture(&workload_client).await;
    // The manager starts before Cluster API is installed.
    let manager = Arc::new(Manager::new(ClusterApi::new(hc.clone())));
    let seen = Arc::new(Seen::default());
    Builder::<_, ConfigMap>::new(&manager, fixture_objects()).start(
        feed_animals,
        retry_soon,
        seen.clone(),
    );
    let run = spawn_manager(&manager);
    hub.install_crds(&cluster_crd_v1beta1_only()).await.unwrap();
    create_namespace(&hc, "capi").await;
    let v1beta1 = ApiResource::from_gvk_with_plural(
        &kube::api::GroupVersionKind::gvk("cluster.x-k8s.io", "v1beta1", "Cluster"),
        "clusters",
    );
    let clusters: Api<DynamicObject> = Api::namespaced_with(hc.clone(), "capi", &v1beta1);
    let secrets: Api<Secret> = Api::namespaced(hc.clone(), "capi");
    let pp = PostParams::default();
    // v1beta1's readiness: `status.controlPlaneReady`, or the phase `Provisioned`.
    for (name, status) in [
        ("ready", json!({"controlPlaneReady": true})),
        ("provisioned", json!({"phase": "Provisioned"})),
        ("pending", json!({"phase": "Pending"})),
    ] {
        clusters
            .create(
                &pp,
                &DynamicObject::new(name, &v1beta1)
                    .within("capi")
                    .data(json!({"spec": {"paused": false}})),
            )
            .await
            .unwrap();
        secrets
            .create(&pp, &kubeconfig_secret(name, workload.kubeconfig()))
            .await
            .unwrap();
        clusters
            .patch_status(
                name,
                &PatchParams::default(),
                &Patch::Merge(json!({"status": status})),
            )
            .await
            .unwrap();
    }
    // The provider looks for the kind every 10 s.
    eventually(60, "both ready v1beta1 clusters engaged", async || {
        manager.fleet().ids() == [name("capi/provisioned"), name("capi/ready")]
    })
    .await;
    eventually(30, "the workload cluster fed", async || {
        is_fed(&workload_client, "zoo", "elephant").await
    })
    .await;
    // The Clusters were listed with their Secrets already there: whichever watch listed
    // first, no Secret was reported missing.
    for name in ["ready", "provisioned"] {
        assert!(
            !has_event(&hc, "capi", "KubeconfigRefused", name, "").await,
            "{name}: a Secret that exists was reported missing"
        );
    }
    // Sync point for `pending`: a change made after it was listed is seen.
    clusters
        .patch_status(
            "ready",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"controlPlaneReady": false}})),
        )
        .await
        .unwrap();
    eventually(30, "ready disengaged once not ready", async || {
        manager.fleet().ids() == [name("capi/provisioned")]
    })
    .await;
    manager.shutdown();
    run.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_kubeconfig_secret_revokes_the_cluster_unless_kept() {
    let env = TestEnv::builder().clusters(2).start().await.unwrap();
    let (hub, member) = (env.cluster(0).unwrap(), env.cluster(1).unwrap());
    let hc = hub.client().unwrap();
    hub.install_crds(&cluster_crd()).await.unwrap();
    create_namespace(&hc, "capi").await;
    let clusters: Api<DynamicObject> =
        Api::namespaced_with(hc.clone(), "capi", &clusters_v1beta2());
    let secrets: Api<Secret> = Api::namespaced(hc.clone(), "capi");
    let pp = PostParams::default();
    for name in ["revoked", "retyped"] {
        clusters.create(&pp, &cluster(name)).await.unwrap();
        secrets
            .create(&pp, &kubeconfig_secret(name, member.kubeconfig()))
            .await
            .unwrap();
        set_ready(&clusters, name, true).await;
    }
    // By default, and kept by choice.
    let revoking = Arc::new(Manager::new(ClusterApi::new(hc.clone()).namespace("capi")));
    let keeping = Arc::new(Manager::new(
        ClusterApi::new(hc.clone())
            .namespace("capi")
            .keep_when_credentials_removed(true),
    ));
    let runs = [spawn_manager(&revoking), spawn_manager(&keeping)];
    let both = [name("capi/retyped"), name("capi/revoked")];
    for manager in [&revoking, &keeping] {
        eventually(30, "both engaged", async || manager.fleet().ids() == both).await;
    }

    // One Secret deleted; the other no longer of Cluster API's type (out of the watch).
    secrets
        .delete("revoked-kubeconfig", &DeleteParams::default())
        .await
        .unwrap();
    secrets
        .delete("retyped-kubeconfig", &DeleteParams::default())
        .await
        .unwrap();
    let mut retyped = kubeconfig_secret("retyped", member.kubeconfig());
    retyped.type_ = Some("Opaque".into());
    secrets.create(&pp, &retyped).await.unwrap();
    eventually(30, "both revoked by default", async || {
        revoking.fleet().is_empty()
    })
    .await;
    for object in ["revoked", "retyped"] {
        eventually(30, &format!("{object}: the revocation said"), async || {
            has_event(&hc, "capi", "KubeconfigRefused", object, "paused").await
        })
        .await;
    }
    // A new Secret for `revoked`, reaching another server: engaged again from it by both.
    // Sync point for the keeping manager: its Secret watch delivered the deletions before.
    secrets
        .create(&pp, &kubeconfig_secret("revoked", hub.kubeconfig()))
        .await
        .unwrap();
    let server_of = |manager: &Manager<ClusterApi>| {
        manager
            .cluster(&name("capi/revoked"))
            .and_then(|c| c.config().map(|c| c.cluster_url.to_string()))
            .map(|s| s.trim_end_matches('/').to_string())
    };
    for manager in [&revoking, &keeping] {
        eventually(30, "revoked engaged from its new Secret", async || {
            server_of(manager).as_deref() == Some(hub.server().trim_end_matches('/'))
        })
        .await;
    }
    assert_eq!(revoking.fleet().ids(), [name("capi/revoked")]);
    assert_eq!(
        keeping.fleet().ids(),
        both,
        "kept: retyped stays engaged with the credentials it has"
    );
    for manager in [&revoking, &keeping] {
        manager.shutdown();
    }
    for run in runs {
        run.await.unwrap();
    }
}
