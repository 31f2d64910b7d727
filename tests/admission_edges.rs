//! A member's admission through the edges of its lifecycle, against real kube-apiservers: a
//! cluster renamed (a `KubeconfigSecrets` Secret re-created under a new name, in both
//! orders; a `ById` id changed) keeps both configurations, routed to its new id; a member
//! whose id another member contests, whose profile turns unhealthy or whose KubeFed
//! `Ready` flaps keeps them and its reviews are still answered by the hooks; a member
//! admin's delete of a configuration is repaired; a cluster that leaves for good loses
//! them.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use k8s_openapi::ByteString;
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
};
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::ResourceExt;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, ObjectMeta, Patch, PatchParams, PostParams,
};
use multicluster_runtime::webhook::{Hook, Mutation, Review, Verdict, Webhooks};
use multicluster_runtime::{Cluster, ClusterName, Manager};
use multicluster_runtime_testenv::{TestCluster, TestEnv};
use serde_json::json;

const NS: &str = "hooks";
const MANAGED: &str = "fleet.example.com/managed";
const OWNER: &str = "fleet.example.com/owner";
const SEEN_BY: &str = "fleet.example.com/seen-by";

/// The policy: a managed ConfigMap is annotated `seen-by: <cluster>` (mutating), and one
/// without an owner is denied, naming the cluster (validating).
fn policy(port: u16) -> Webhooks<ClusterName> {
    let managed = LabelSelector {
        match_expressions: Some(vec![
            k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelectorRequirement {
                key: MANAGED.into(),
                operator: "Exists".into(),
                values: None,
            },
        ]),
        ..Default::default()
    };
    Webhooks::new(
        format!("127.0.0.1:{port}").parse().unwrap(),
        format!("https://127.0.0.1:{port}/admission"),
    )
    .check_every(Duration::from_millis(500))
    .hook(
        Hook::mutating(
            "seen.fleet.example.com",
            |review: Review<ClusterName, ConfigMap>| async move {
                let mut object = review.object.unwrap();
                object
                    .annotations_mut()
                    .insert(SEEN_BY.into(), review.cluster.to_string());
                Ok::<_, String>(Mutation::changed(object))
            },
        )
        .object_selector(managed.clone()),
    )
    .hook(
        Hook::validating(
            "owners.fleet.example.com",
            |review: Review<ClusterName, ConfigMap>| async move {
                let object = review.object.unwrap();
                Ok::<_, String>(if object.annotations().contains_key(OWNER) {
                    Verdict::allow()
                } else {
                    Verdict::deny(format!(
                        "in cluster {}: ConfigMap {} has no owner",
                        review.cluster,
                        object.name_any()
                    ))
                })
            },
        )
        .object_selector(managed),
    )
}

/// Both configurations of `client`'s cluster: (validating uid, mutating uid, the ids their
/// URLs route to).
async fn configurations(
    client: &kube::Client,
    name: &str,
) -> Option<(String, String, Vec<String>)> {
    let validating = Api::<ValidatingWebhookConfiguration>::all(client.clone())
        .get_opt(name)
        .await
        .ok()??;
    let mutating = Api::<MutatingWebhookConfiguration>::all(client.clone())
        .get_opt(name)
        .await
        .ok()??;
    let mut routes: Vec<String> = validating
        .webhooks
        .iter()
        .flatten()
        .map(|w| w.client_config.url.clone().unwrap_or_default())
        .chain(
            mutating
                .webhooks
                .iter()
                .flatten()
                .map(|w| w.client_config.url.clone().unwrap_or_default()),
        )
        .map(|url| {
            // `https://host/admission/<cluster>/<token>/<webhook>`
            url.split("/admission/")
                .nth(1)
                .and_then(|rest| rest.split('/').next())
                .unwrap_or_default()
                .to_string()
        })
        .collect();
    routes.dedup();
    Some((validating.uid()?, mutating.uid()?, routes))
}

/// Waits until both configurations are in `client`'s cluster, routed to `id`; returns
/// their uids.
async fn routed_to(client: &kube::Client, name: &str, id: &str) -> (String, String) {
    let mut uids = None;
    eventually(
        30,
        &format!("both configurations routed to {id}"),
        async || match configurations(client, name).await {
            Some((v, m, routes)) if routes == [id] => {
                uids = Some((v, m));
                true
            }
            _ => false,
        },
    )
    .await;
    uids.unwrap()
}

/// Checks that the policy holds in `client`'s cluster, answered as `id`: an object without
/// an owner is denied naming `id`; one with an owner is admitted and labelled by `id`.
async fn enforced(client: &kube::Client, id: &str, object: &str) {
    let cms = Api::<ConfigMap>::namespaced(client.clone(), NS);
    let mut cm = ConfigMap {
        metadata: ObjectMeta {
            name: Some(object.into()),
            labels: Some(BTreeMap::from([(MANAGED.to_string(), "true".to_string())])),
            ..Default::default()
        },
        ..Default::default()
    };
    // Sync point: the API server calls a configuration only once its informer has it.
    let dry = PostParams {
        dry_run: true,
        ..Default::default()
    };
    eventually(
        30,
        &format!("the API server of {id} calling the hooks"),
        async || cms.create(&dry, &cm).await.is_err(),
    )
    .await;
    let error = cms
        .create(&PostParams::default(), &cm)
        .await
        .expect_err("an object without an owner is denied");
    assert!(
        error
            .to_string()
            .contains(&format!("in cluster {id}: ConfigMap {object} has no owner")),
        "{error}"
    );
    cm.annotations_mut().insert(OWNER.into(), "team-a".into());
    let created = cms.create(&PostParams::default(), &cm).await.unwrap();
    assert_eq!(
        created.annotations().get(SEEN_BY).map(String::as_str),
        Some(id)
    );
}

/// Waits until the installer has taken `id`'s disengagement without a departure (paused,
/// handed off): its log line.
async fn kept_through_disengagement(logs: &Logs, id: &str) {
    eventually(
        30,
        &format!("the installer took {id}'s disengagement"),
        async || {
            !logs
                .lines(&[
                    &format!("cluster={id}"),
                    "webhooks: the cluster is disengaged; its configurations stay",
                ])
                .is_empty()
        },
    )
    .await;
}

/// Waits until the installer's removal for `id`, which left for good, is done.
async fn removal_done(logs: &Logs, id: &str) {
    eventually(30, &format!("the removal for {id} done"), async || {
        !logs
            .lines(&[
                &format!("cluster={id}"),
                "webhooks: the cluster left for good; no configuration routed to it is left",
            ])
            .is_empty()
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renamed_member_keeps_its_admission_routed_to_its_new_id_in_either_order() {
    use multicluster_runtime::providers::KubeconfigSecrets;
    let logs = Logs::capture();
    let env = TestEnv::builder().clusters(2).start().await.unwrap();
    let (host, member) = (env.cluster(0).unwrap(), env.cluster(1).unwrap());
    let (hc, mc) = (host.client().unwrap(), member.client().unwrap());
    create_namespace(&hc, "fleet").await;
    create_namespace(&mc, NS).await;
    let secrets: Api<Secret> = Api::namespaced(hc.clone(), "fleet");
    let pp = PostParams::default();
    secrets
        .create(&pp, &kubeconfig_secret("east", member.kubeconfig(), true))
        .await
        .unwrap();
    let port = free_port();
    let hooks = policy(port);
    // Made from the URL (`multicluster-runtime-<hash>`).
    let configuration = hooks.configuration().to_string();
    let manager = Arc::new(
        Manager::new(KubeconfigSecrets::new(hc.clone(), "fleet"))
            .with_local(Cluster::from_config(name("rename-host"), host.config()).unwrap())
            .webhooks(hooks),
    );
    let run = spawn_manager(&manager);
    routed_to(&mc, &configuration, "east").await;
    enforced(&mc, "east", "first").await;

    // The new id engaged before the old one leaves (`mcr join --name east-2`, then
    // `mcr unjoin --name east`): the configurations follow the new id, and the old id's
    // removal leaves them alone.
    secrets
        .create(&pp, &kubeconfig_secret("east-2", member.kubeconfig(), true))
        .await
        .unwrap();
    let uids = routed_to(&mc, &configuration, "east-2").await;
    secrets
        .delete("east", &DeleteParams::default())
        .await
        .unwrap();
    removal_done(&logs, "east").await;
    // A check period of the installer later (its drift repair would have made new ones).
    let (v, m, routes) = configurations(&mc, &configuration)
        .await
        .expect("both configurations stay");
    assert_eq!((v, m), uids, "the same configurations, never deleted");
    assert_eq!(routes, ["east-2"]);
    enforced(&mc, "east-2", "second").await;

    // The old id leaves first, the new one comes after.
    secrets
        .delete("east-2", &DeleteParams::default())
        .await
        .unwrap();
    removal_done(&logs, "east-2").await;
    eventually(30, "the configurations removed", async || {
        Api::<ValidatingWebhookConfiguration>::all(mc.clone())
            .get_opt(&configuration)
            .await
            .is_ok_and(|c| c.is_none())
    })
    .await;
    secrets
        .create(&pp, &kubeconfig_secret("east-3", member.kubeconfig(), true))
        .await
        .unwrap();
    routed_to(&mc, &configuration, "east-3").await;
    enforced(&mc, "east-3", "third").await;

    // A member admin deletes a configuration: it is back within a check period.
    let before = configurations(&mc, &configuration).await.unwrap();
    Api::<ValidatingWebhookConfiguration>::all(mc.clone())
        .delete(&configuration, &DeleteParams::default())
        .await
        .unwrap();
    let (v, _) = routed_to(&mc, &configuration, "east-3").await;
    assert_ne!(v, before.0, "made again");
    enforced(&mc, "east-3", "fourth").await;

    run.abort();
}

const PROPERTY_CRD: &str = include_str!("crds/clusterproperty.yaml");

async fn set_id(member: &TestCluster, id: &str) {
    let object = json!({
        "apiVersion": "about.k8s.io/v1alpha1",
        "kind": "ClusterProperty",
        "metadata": {"name": "cluster.clusterset.k8s.io"},
        "spec": {"value": id},
    });
    Api::<DynamicObject>::all_with(
        member.client().unwrap(),
        &multicluster_runtime::ClusterIdentity::resource("v1alpha1"),
    )
    .patch(
        "cluster.clusterset.k8s.io",
        &PatchParams::apply("admission-test").force(),
        &Patch::Apply(object),
    )
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_whose_id_is_changed_or_contested_keeps_its_admission() {
    use multicluster_runtime::providers::{ById, Clusters};
    let logs = Logs::capture();
    let env = TestEnv::builder().clusters(3).start().await.unwrap();
    let (host, a, b) = (
        env.cluster(0).unwrap(),
        env.cluster(1).unwrap(),
        env.cluster(2).unwrap(),
    );
    let (ac, bc) = (a.client().unwrap(), b.client().unwrap());
    for (member, id) in [(&a, "alpha"), (&b, "beta")] {
        member.install_crds(PROPERTY_CRD).await.unwrap();
        set_id(member, id).await;
        create_namespace(&member.client().unwrap(), NS).await;
    }
    let clusters = Clusters::new();
    let port = free_port();
    let hooks = policy(port);
    // Made from the URL (`multicluster-runtime-<hash>`).
    let configuration = hooks.configuration().to_string();
    let manager = Arc::new(
        Manager::new(ById::new(clusters.clone()))
            .with_local(Cluster::from_config(name("byid-host"), host.config()).unwrap())
            .webhooks(hooks),
    );
    let run = spawn_manager(&manager);
    for (n, m) in [("first", &a), ("second", &b)] {
        clusters
            .add(Cluster::from_config(name(n), m.config()).unwrap())
            .unwrap();
    }
    routed_to(&ac, &configuration, "alpha").await;
    routed_to(&bc, &configuration, "beta").await;
    enforced(&ac, "alpha", "first").await;

    // a's id changes: its configurations follow, and the removal for the old id leaves
    // them alone.
    set_id(&a, "alpha-2").await;
    routed_to(&ac, &configuration, "alpha-2").await;
    removal_done(&logs, "alpha").await;
    let (_, _, routes) = configurations(&ac, &configuration)
        .await
        .expect("both configurations stay");
    assert_eq!(routes, ["alpha-2"]);
    enforced(&ac, "alpha-2", "second").await;

    // b's admin claims a's id: a is engaged for neither, but paused, not gone. Its
    // configurations stay, and its reviews are still answered by the hooks.
    let before = configurations(&ac, &configuration).await.unwrap();
    set_id(&b, "alpha-2").await;
    eventually(30, "alpha-2 paused", async || {
        manager.fleet().get(&name("alpha-2")).is_none()
            && manager.fleet().paused(&name("alpha-2")).is_some()
    })
    .await;
    kept_through_disengagement(&logs, "alpha-2").await;
    let after = configurations(&ac, &configuration)
        .await
        .expect("both configurations stay");
    assert_eq!(after, before, "a's configurations untouched");
    enforced(&ac, "alpha-2", "third").await;

    // b's admin claims the host's id: never engaged under it (its reviews would pass as
    // the host's).
    set_id(&b, "byid-host").await;
    eventually(30, "the host's id refused", async || {
        !logs
            .lines(&["cannot engage cluster byid-host: the manager's local cluster has that id"])
            .is_empty()
    })
    .await;
    assert!(manager.fleet().get(&name("byid-host")).is_none());

    // The claim withdrawn: a is engaged again, with the same configurations.
    set_id(&b, "beta").await;
    eventually(30, "alpha-2 engaged again", async || {
        manager.fleet().get(&name("alpha-2")).is_some()
    })
    .await;
    assert_eq!(configurations(&ac, &configuration).await.unwrap(), before);
    run.abort();
}

fn profiles() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &kube::api::GroupVersionKind::gvk("multicluster.x-k8s.io", "v1alpha1", "ClusterProfile"),
        "clusterprofiles",
    )
}

async fn set_health(profiles: &Api<DynamicObject>, name: &str, healthy: bool) {
    let condition = json!({
        "type": "ControlPlaneHealthy",
        "status": if healthy { "True" } else { "False" },
        "reason": if healthy { "Healthy" } else { "Unhealthy" },
        "message": "set by the test",
        "lastTransitionTime": "2026-11-24T00:00:00Z",
    });
    profiles
        .patch_status(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"conditions": [condition]}})),
        )
        .await
        .unwrap();
}

fn kubefed_members() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &kube::api::GroupVersionKind::gvk("core.kubefed.io", "v1beta1", "KubeFedCluster"),
        "kubefedclusters",
    )
}

/// The provider assets' directory.
fn assets() -> String {
    std::env::var("MCR_PROVIDER_ASSETS").expect(
        "MCR_PROVIDER_ASSETS names the directory scripts/provider-assets.sh prints (scripts/test.sh sets it)",
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unhealthy_profile_or_a_kubefed_ready_flap_keeps_the_members_admission() {
    use multicluster_runtime::providers::{ClusterInventory, KubeFed, Multi, ProfileNamespaces};
    let logs = Logs::capture();
    let env = TestEnv::builder().clusters(3).start().await.unwrap();
    let (hub, east, west) = (
        env.cluster(0).unwrap(),
        env.cluster(1).unwrap(),
        env.cluster(2).unwrap(),
    );
    let (hc, ec, wc) = (
        hub.client().unwrap(),
        east.client().unwrap(),
        west.client().unwrap(),
    );
    create_namespace(&ec, NS).await;
    create_namespace(&wc, NS).await;
    let inventory =
        std::fs::read_to_string(format!("{}/crds/cluster-inventory-api.yaml", assets())).unwrap();
    hub.install_crds(&inventory).await.unwrap();
    let kubefed = std::fs::read_to_string(format!("{}/crds/kubefed.yaml", assets())).unwrap();
    hub.install_crds(&kubefed).await.unwrap();
    create_namespace(&hc, "fleet").await;
    create_namespace(&hc, "kube-federation-system").await;
    let pp = PostParams::default();

    // east: a ClusterProfile reached through a labelled kubeconfig Secret.
    let profiles: Api<DynamicObject> = Api::namespaced_with(hc.clone(), "fleet", &profiles());
    profiles
        .create(
            &pp,
            &DynamicObject::new("east", &self::profiles())
                .within("fleet")
                .data(json!({"spec": {"clusterManager": {"name": "test-manager"}}})),
        )
        .await
        .unwrap();
    set_health(&profiles, "east", true).await;
    let mut secret = kubeconfig_secret("east-for-mcr", east.kubeconfig(), true);
    secret.metadata.labels = Some(BTreeMap::from([
        ("x-k8s.io/cluster-inventory-consumer".into(), "mcr".into()),
        ("x-k8s.io/cluster-profile".into(), "east".into()),
    ]));
    secret.data = Some(BTreeMap::from([(
        "Config".into(),
        ByteString(east.kubeconfig().as_bytes().to_vec()),
    )]));
    Api::<Secret>::namespaced(hc.clone(), "fleet")
        .create(&pp, &secret)
        .await
        .unwrap();

    // west: a KubeFedCluster with a service account token.
    let token = service_account_token(&west, "kubefed-west").await;
    let token_secret = Secret {
        metadata: ObjectMeta {
            name: Some("west-secret".into()),
            ..Default::default()
        },
        data: Some(BTreeMap::from([(
            "token".into(),
            ByteString(token.as_bytes().to_vec()),
        )])),
        ..Default::default()
    };
    Api::<Secret>::namespaced(hc.clone(), "kube-federation-system")
        .create(&pp, &token_secret)
        .await
        .unwrap();
    let members: Api<DynamicObject> =
        Api::namespaced_with(hc.clone(), "kube-federation-system", &kubefed_members());
    use base64::Engine as _;
    members
        .create(
            &pp,
            &DynamicObject::new("west", &kubefed_members())
                .within("kube-federation-system")
                .data(json!({"spec": {
                    "apiEndpoint": west.server(),
                    "caBundle": base64::engine::general_purpose::STANDARD.encode(west.ca_pem()),
                    "secretRef": {"name": "west-secret"},
                }})),
        )
        .await
        .unwrap();
    set_kubefed_ready(&members, "west", true).await;

    let multi = Multi::new();
    multi
        .add(
            "inventory",
            ClusterInventory::with_secrets(
                hc.clone(),
                "mcr",
                ProfileNamespaces::Only("fleet".into()),
            ),
        )
        .unwrap();
    multi.add("kubefed", KubeFed::new(hc.clone())).unwrap();
    let port = free_port();
    let hooks = policy(port);
    // Made from the URL (`multicluster-runtime-<hash>`).
    let configuration = hooks.configuration().to_string();
    let manager = Arc::new(
        Manager::new(multi)
            .with_local(Cluster::from_config(name("hub"), hub.config()).unwrap())
            .webhooks(hooks),
    );
    let run = spawn_manager(&manager);
    let (east_id, west_id) = (
        "inventory#fleet/east".to_string(),
        "kubefed#kube-federation-system/west".to_string(),
    );
    let east_route = format!("~{}", route_segment(&east_id));
    let west_route = format!("~{}", route_segment(&west_id));
    let east_uids = routed_to(&ec, &configuration, &east_route).await;
    let west_uids = routed_to(&wc, &configuration, &west_route).await;
    enforced(&ec, &east_id, "first").await;
    enforced(&wc, &west_id, "first").await;

    // The profile's control plane reported unhealthy, the KubeFedCluster not ready: both
    // paused, their configurations untouched, their reviews answered by the hooks.
    set_health(&profiles, "east", false).await;
    set_kubefed_ready(&members, "west", false).await;
    for id in [&east_id, &west_id] {
        eventually(30, &format!("{id} paused"), async || {
            manager.fleet().paused(&name(id)).is_some()
        })
        .await;
        kept_through_disengagement(&logs, id).await;
    }
    let (v, m, _) = configurations(&ec, &configuration)
        .await
        .expect("east's configurations stay");
    assert_eq!((v, m), east_uids);
    let (v, m, _) = configurations(&wc, &configuration)
        .await
        .expect("west's configurations stay");
    assert_eq!((v, m), west_uids);
    enforced(&ec, &east_id, "second").await;
    enforced(&wc, &west_id, "second").await;

    // Healthy and ready again: engaged, the same configurations.
    set_health(&profiles, "east", true).await;
    set_kubefed_ready(&members, "west", true).await;
    for id in [&east_id, &west_id] {
        eventually(30, &format!("{id} engaged again"), async || {
            manager.fleet().get(&name(id)).is_some()
        })
        .await;
    }
    assert_eq!(routed_to(&ec, &configuration, &east_route).await, east_uids);
    assert_eq!(routed_to(&wc, &configuration, &west_route).await, west_uids);

    // Paused, then deleted: it leaves for good, and its configurations go.
    set_health(&profiles, "east", false).await;
    eventually(30, "east paused", async || {
        manager.fleet().paused(&name(&east_id)).is_some()
    })
    .await;
    profiles
        .delete("east", &DeleteParams::default())
        .await
        .unwrap();
    removal_done(&logs, &east_id).await;
    assert!(configurations(&ec, &configuration).await.is_none());
    let created = Api::<ConfigMap>::namespaced(ec.clone(), NS)
        .create(
            &pp,
            &ConfigMap {
                metadata: ObjectMeta {
                    name: Some("after".into()),
                    labels: Some(BTreeMap::from([(MANAGED.to_string(), "true".to_string())])),
                    ..Default::default()
                },
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert!(
        created.annotations().get(SEEN_BY).is_none(),
        "no hook any more"
    );
    run.abort();
}

/// The base64url form of an id that is not a plain name (its route segment after `~`).
fn route_segment(id: &str) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(id)
}

/// A validating configuration `name` of one webhook sent to `url`, for objects labelled
/// `nothing` (so no write depends on it), failing open.
fn hand_made(name: &str, url: &str) -> ValidatingWebhookConfiguration {
    serde_json::from_value(json!({
        "metadata": {"name": name},
        "webhooks": [{
            "name": "other.example.com",
            "admissionReviewVersions": ["v1"],
            "clientConfig": {"url": url},
            "failurePolicy": "Ignore",
            "sideEffects": "None",
            "objectSelector": {"matchLabels": {"nothing": "true"}},
            "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "resources": ["configmaps"], "operations": ["CREATE"]}],
        }],
    }))
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configuration_the_manager_did_not_make_is_neither_forced_nor_deleted() {
    use multicluster_runtime::providers::Clusters;
    let logs = Logs::capture();
    let env = TestEnv::builder().clusters(3).start().await.unwrap();
    let (host, m1, m2) = (
        env.cluster(0).unwrap(),
        env.cluster(1).unwrap(),
        env.cluster(2).unwrap(),
    );
    let (c1, c2) = (m1.client().unwrap(), m2.client().unwrap());
    create_namespace(&c2, NS).await;
    let port = free_port();
    let hooks = policy(port);
    let configuration = hooks.configuration().to_string();
    let pp = PostParams::default();
    // m1: another product's configuration under this manager's name (a typo'd or shared
    // `configuration_name`).
    let foreign = Api::<ValidatingWebhookConfiguration>::all(c1.clone())
        .create(
            &pp,
            &hand_made(&configuration, "https://127.0.0.1:1/another-product"),
        )
        .await
        .unwrap();
    // m2: this manager's configuration of the name every manager had before (routed under
    // its URL to m2): replaced by the new name, then removed.
    let legacy_url =
        format!("https://127.0.0.1:{port}/admission/m2/0123456789abcdef/owners.fleet.example.com");
    Api::<ValidatingWebhookConfiguration>::all(c2.clone())
        .create(&pp, &hand_made("multicluster-runtime", &legacy_url))
        .await
        .unwrap();
    let clusters = Clusters::new();
    for (id, m) in [("m1", &m1), ("m2", &m2)] {
        clusters
            .add(Cluster::from_config(name(id), m.config()).unwrap())
            .unwrap();
    }
    let manager = Arc::new(
        Manager::new(clusters.clone())
            .with_local(Cluster::from_config(name("owner-host"), host.config()).unwrap())
            .webhooks(hooks),
    );
    let run = spawn_manager(&manager);

    routed_to(&c2, &configuration, "m2").await;
    eventually(30, "the legacy configuration removed", async || {
        Api::<ValidatingWebhookConfiguration>::all(c2.clone())
            .get_opt("multicluster-runtime")
            .await
            .is_ok_and(|c| c.is_none())
    })
    .await;
    enforced(&c2, "m2", "first").await;

    // m1: the install is refused, saying why; the foreign configuration is untouched.
    eventually(30, "m1's install refused", async || {
        !logs
            .lines(&["cluster=m1", "was not made by this manager"])
            .is_empty()
    })
    .await;
    let unchanged = |now: &ValidatingWebhookConfiguration| {
        now.resource_version() == foreign.resource_version() && now.uid() == foreign.uid()
    };
    let now = Api::<ValidatingWebhookConfiguration>::all(c1.clone())
        .get(&configuration)
        .await
        .unwrap();
    assert!(unchanged(&now), "{now:?}");
    // m1 leaves for good: nothing of it is deleted either.
    clusters.remove(&name("m1"));
    removal_done(&logs, "m1").await;
    let now = Api::<ValidatingWebhookConfiguration>::all(c1.clone())
        .get(&configuration)
        .await
        .unwrap();
    assert!(unchanged(&now), "{now:?}");
    run.abort();
}
