//! The KubeFed provider against real apiservers with KubeFed's own CRDs (from
//! `sigs.k8s.io/kubefed` v0.10.0, fetched by `scripts/provider-assets.sh`): a host cluster
//! whose `kube-federation-system` namespace holds `KubeFedCluster` objects and the token
//! Secrets of two member clusters.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;

use base64::Engine;
use common::*;
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use multicluster_runtime::providers::KubeFed;
use multicluster_runtime::{Builder, Manager};
use multicluster_runtime_testenv::{TestCluster, TestEnv};
use serde_json::json;

const NS: &str = "kube-federation-system";

fn kubefed_crds() -> String {
    let dir = std::env::var("MCR_PROVIDER_ASSETS").expect(
        "MCR_PROVIDER_ASSETS names the directory scripts/provider-assets.sh prints (scripts/test.sh sets it)",
    );
    std::fs::read_to_string(format!("{dir}/crds/kubefed.yaml")).unwrap()
}

fn members() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &kube::api::GroupVersionKind::gvk("core.kubefed.io", "v1beta1", "KubeFedCluster"),
        "kubefedclusters",
    )
}

/// A `KubeFedCluster` for `member` whose token is in Secret `secret`; the endpoint without
/// its scheme, as `kubefedctl join` may write it.
fn member(name: &str, member: &TestCluster, secret: &str) -> DynamicObject {
    DynamicObject::new(name, &members())
        .within(NS)
        .data(json!({"spec": {
            "apiEndpoint": member.server().trim_start_matches("https://"),
            "caBundle": base64::engine::general_purpose::STANDARD.encode(member.ca_pem()),
            "secretRef": {"name": secret},
        }}))
}

fn token_secret(name: &str, token: Option<&str>) -> Secret {
    Secret {
        metadata: kube::api::ObjectMeta {
            name: Some(name.into()),
            ..Default::default()
        },
        data: Some(
            token
                .map(|t| ("token".to_string(), ByteString(t.as_bytes().to_vec())))
                .into_iter()
                .collect::<BTreeMap<_, _>>(),
        ),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubefed_clusters_engage_when_ready_follow_their_token_and_leave_when_deleted() {
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
    hub.install_crds(&kubefed_crds()).await.unwrap();
    create_namespace(&hc, NS).await;
    let objects: Api<DynamicObject> = Api::namespaced_with(hc.clone(), NS, &members());
    let secrets: Api<Secret> = Api::namespaced(hc.clone(), NS);
    let pp = PostParams::default();

    let east_token = service_account_token(&east, "kubefed-east").await;
    secrets
        .create(&pp, &token_secret("east-secret", Some(&east_token)))
        .await
        .unwrap();
    // east exists with its token, but is not ready yet.
    objects
        .create(&pp, &member("east", &east, "east-secret"))
        .await
        .unwrap();

    let manager = Arc::new(Manager::new(KubeFed::new(hc.clone())));
    let seen = Arc::new(Seen::default());
    Builder::<_, ConfigMap>::new(&manager, fixture_objects()).start(
        feed_animals,
        retry_soon,
        seen.clone(),
    );
    let run = spawn_manager(&manager);

    // west: joined after the start, ready at once.
    let west_token = service_account_token(&west, "kubefed-west").await;
    secrets
        .create(&pp, &token_secret("west-secret", Some(&west_token)))
        .await
        .unwrap();
    objects
        .create(&pp, &member("west", &west, "west-secret"))
        .await
        .unwrap();
    set_kubefed_ready(&objects, "west", true).await;
    eventually(30, "west fed", async || {
        is_fed(&west_client, "zoo", "elephant").await
    })
    .await;
    assert_eq!(
        identity(&manager, &format!("{NS}/west")).await.as_deref(),
        Some("system:serviceaccount:default:kubefed-west")
    );
    // Sync point: east was listed before west was created, and it is not ready.
    assert_eq!(manager.fleet().ids(), [name(&format!("{NS}/west"))]);
    assert!(!is_fed(&east_client, "zoo", "elephant").await);

    set_kubefed_ready(&objects, "east", true).await;
    eventually(30, "east fed once ready", async || {
        is_fed(&east_client, "zoo", "elephant").await
    })
    .await;

    // Rotation: east's Secret gets another account's token; the object is untouched.
    let rotated = service_account_token(&east, "kubefed-east-rotated").await;
    secrets
        .replace(
            "east-secret",
            &pp,
            &token_secret("east-secret", Some(&rotated)),
        )
        .await
        .unwrap();
    eventually(30, "east re-engaged with the rotated token", async || {
        identity(&manager, &format!("{NS}/east")).await.as_deref()
            == Some("system:serviceaccount:default:kubefed-east-rotated")
    })
    .await;

    // Not ready: disengaged; ready again: engaged again.
    set_kubefed_ready(&objects, "east", false).await;
    eventually(30, "east disengaged when not ready", async || {
        manager.fleet().ids() == [name(&format!("{NS}/west"))]
    })
    .await;
    set_kubefed_ready(&objects, "east", true).await;
    eventually(30, "east engaged again", async || {
        manager.fleet().ids().contains(&name(&format!("{NS}/east")))
    })
    .await;

    // Bad input, each reported on its object: no Secret, a Secret without a token, a TLS
    // validation that cannot be turned off alone.
    objects
        .create(&pp, &member("lost", &west, "lost-secret"))
        .await
        .unwrap();
    secrets
        .create(&pp, &token_secret("empty-secret", None))
        .await
        .unwrap();
    objects
        .create(&pp, &member("empty", &west, "empty-secret"))
        .await
        .unwrap();
    let mut picky = member("picky", &west, "west-secret");
    picky.data["spec"]["disabledTLSValidations"] = json!(["SubjectName"]);
    objects.create(&pp, &picky).await.unwrap();
    for bad in ["lost", "empty", "picky"] {
        set_kubefed_ready(&objects, bad, true).await;
    }
    for (object, note) in [
        ("lost", "lost-secret"),
        ("empty", "token"),
        ("picky", "SubjectName"),
    ] {
        eventually(
            30,
            &format!("a Warning Event on KubeFedCluster {object}"),
            async || has_event(&hc, NS, "KubeconfigRefused", object, note).await,
        )
        .await;
    }
    assert_eq!(
        manager.fleet().ids(),
        [name(&format!("{NS}/east")), name(&format!("{NS}/west"))]
    );

    // The missing Secret appears: lost is engaged.
    secrets
        .create(&pp, &token_secret("lost-secret", Some(&west_token)))
        .await
        .unwrap();
    eventually(30, "lost engaged once its Secret exists", async || {
        manager.fleet().ids().contains(&name(&format!("{NS}/lost")))
    })
    .await;

    // Joined again elsewhere: east's object now names west's endpoint, CA and Secret.
    let moved = member("east", &west, "west-secret");
    objects
        .patch(
            "east",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": moved.data["spec"]})),
        )
        .await
        .unwrap();
    eventually(30, "east re-engaged at west's endpoint", async || {
        identity(&manager, &format!("{NS}/east")).await.as_deref()
            == Some("system:serviceaccount:default:kubefed-west")
    })
    .await;
    let server = manager
        .cluster(&name(&format!("{NS}/east")))
        .and_then(|c| c.config().map(|c| c.cluster_url.to_string()));
    assert_eq!(
        server.as_deref().map(|s| s.trim_end_matches('/')),
        Some(west.server())
    );

    // Unjoined: west leaves, the others stay.
    objects
        .delete("west", &DeleteParams::default())
        .await
        .unwrap();
    eventually(30, "west disengaged when deleted", async || {
        !manager.fleet().ids().contains(&name(&format!("{NS}/west")))
    })
    .await;
    assert_eq!(
        manager.fleet().ids(),
        [name(&format!("{NS}/east")), name(&format!("{NS}/lost"))]
    );

    manager.shutdown();
    run.await.unwrap();
}
