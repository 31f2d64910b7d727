//! `mcr unjoin` against real API servers, where a fleet installed webhooks: the member is
//! left without the fleet's configurations (removed by the fleet before the identity is
//! revoked, or, the fleet away, listed or removed with the admin's rights); a namespace
//! holding what cannot be listed is kept; an object join recorded but did not create is
//! never taken.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Secret};
use k8s_openapi::api::rbac::v1::{ClusterRole, PolicyRule};
use kube::ResourceExt;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, ObjectMeta, PostParams};
use multicluster_runtime::providers::KubeconfigSecrets;
use multicluster_runtime::webhook::{Hook, Review, Verdict, Webhooks};
use multicluster_runtime::{Cluster, ClusterName, Manager};
use multicluster_runtime_testenv::TestEnv;

const MANAGED: &str = "fleet.example.com/managed";

/// A CRD whose conversion webhook is down: its objects are stored as v1 and listed as v2
/// (the preferred version), which cannot be converted.
const BROKEN_CRD: &str = r#"
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: gadgets.example.com
spec:
  group: example.com
  names: {kind: Gadget, plural: gadgets, singular: gadget}
  scope: Namespaced
  conversion:
    strategy: Webhook
    webhook:
      conversionReviewVersions: ["v1"]
      clientConfig: {url: "https://127.0.0.1:1/convert"}
  versions:
  - name: v1
    served: true
    storage: true
    schema: {openAPIV3Schema: {type: object, x-kubernetes-preserve-unknown-fields: true}}
  - name: v2
    served: true
    storage: false
    schema: {openAPIV3Schema: {type: object, x-kubernetes-preserve-unknown-fields: true}}
"#;

/// Fail policy: a managed ConfigMap without an owner annotation is denied.
fn policy(port: u16) -> Webhooks<ClusterName> {
    Webhooks::new(
        format!("127.0.0.1:{port}").parse().unwrap(),
        format!("https://127.0.0.1:{port}/admission"),
    )
    .check_every(Duration::from_millis(500))
    .hook(
        Hook::validating(
            "owners.fleet.example.com",
            |review: Review<ClusterName, ConfigMap>| async move {
                let object = review.object.unwrap();
                Ok::<_, String>(if object.annotations().contains_key("owner") {
                    Verdict::allow()
                } else {
                    Verdict::deny("no owner")
                })
            },
        )
        .object_selector(
            k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector {
                match_labels: Some(BTreeMap::from([(MANAGED.to_string(), "true".to_string())])),
                ..Default::default()
            },
        ),
    )
}

fn managed(name: &str) -> ConfigMap {
    ConfigMap {
        metadata: ObjectMeta {
            name: Some(name.into()),
            labels: Some(BTreeMap::from([(MANAGED.to_string(), "true".to_string())])),
            ..Default::default()
        },
        ..Default::default()
    }
}

/// Whether a write the policy denies is denied in `member` now (a dry run).
async fn policed(member: &kube::Client) -> bool {
    let dry = PostParams {
        dry_run: true,
        ..Default::default()
    };
    Api::<ConfigMap>::namespaced(member.clone(), "default")
        .create(&dry, &managed("probe"))
        .await
        .is_err()
}

/// The fleet's validating configurations in `member`.
async fn fleet_configurations(member: &kube::Client) -> Vec<String> {
    Api::<ValidatingWebhookConfiguration>::all(member.clone())
        .list(
            &kube::api::ListParams::default()
                .labels("app.kubernetes.io/managed-by=multicluster-runtime"),
        )
        .await
        .unwrap()
        .into_iter()
        .map(|c| c.name_any())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unjoin_leaves_no_fleet_webhook_behind_and_removes_only_what_it_can_prove_it_made() {
    let mcr_bin = mcr_binary();
    let env = TestEnv::builder().clusters(2).start().await.unwrap();
    let (host_tc, member_tc) = (env.cluster(0).unwrap(), env.cluster(1).unwrap());
    let (host, member) = (host_tc.client().unwrap(), member_tc.client().unwrap());
    create_namespace(&host, "mcr-system").await;
    // The fleet's identity may manage webhook configurations in the member.
    Api::<ClusterRole>::all(member.clone())
        .create(
            &PostParams::default(),
            &ClusterRole {
                metadata: ObjectMeta {
                    name: Some("webhook-installer".into()),
                    ..Default::default()
                },
                rules: Some(vec![PolicyRule {
                    api_groups: Some(vec!["admissionregistration.k8s.io".into()]),
                    resources: Some(vec![
                        "validatingwebhookconfigurations".into(),
                        "mutatingwebhookconfigurations".into(),
                    ]),
                    verbs: ["get", "list", "create", "patch", "update", "delete"]
                        .map(String::from)
                        .to_vec(),
                    ..Default::default()
                }]),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    member_tc.install_crds(BROKEN_CRD).await.unwrap();

    let dir = tempfile::tempdir().unwrap();
    let merged = kube::config::Kubeconfig::from_yaml(host_tc.kubeconfig())
        .unwrap()
        .merge(kube::config::Kubeconfig::from_yaml(member_tc.kubeconfig()).unwrap())
        .unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(&kubeconfig, serde_json::to_string(&merged).unwrap()).unwrap();
    let kubeconfig = kubeconfig.to_str().unwrap().to_string();
    // A manifest of one ConfigMap.
    let manifest = dir.path().join("hand-made.yaml");
    std::fs::write(
        &manifest,
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: hand-made, namespace: default}\ndata: {made: by-hand}\n",
    )
    .unwrap();
    let base = |verb: &str| {
        vec![
            verb.to_string(),
            member_tc.name().to_string(),
            "--host-context".into(),
            host_tc.name().to_string(),
            "--kubeconfig".into(),
            kubeconfig.clone(),
            "--name".into(),
            "m".into(),
        ]
    };
    let run = |args: Vec<String>| {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        mcr_both(&mcr_bin, &args)
    };
    let mut join = base("join");
    join.extend(["--cluster-role".into(), "webhook-installer".into()]);
    run(join.clone());

    // An entry join recorded without a uid (a join stopped between its record and its
    // create), for an object someone else then made by hand.
    let records: Api<Secret> = Api::namespaced(member.clone(), "mcr-system");
    let mut record = records.get("mcr-join-m").await.unwrap();
    let data = record.data.as_mut().unwrap();
    let (key, value) = data.iter_mut().next().unwrap();
    let mut made: Vec<serde_json::Value> = serde_json::from_slice(&value.0).unwrap();
    made.push(serde_json::json!({"apiVersion": "v1", "kind": "ConfigMap", "namespace": "default", "name": "hand-made"}));
    let key = key.clone();
    data.insert(
        key,
        k8s_openapi::ByteString(serde_json::to_vec(&made).unwrap()),
    );
    records
        .replace("mcr-join-m", &PostParams::default(), &record)
        .await
        .unwrap();
    let by_hand = Api::<ConfigMap>::namespaced(member.clone(), "default")
        .create(
            &PostParams::default(),
            &ConfigMap {
                metadata: ObjectMeta {
                    name: Some("hand-made".into()),
                    ..Default::default()
                },
                data: Some(BTreeMap::from([(
                    "made".to_string(),
                    "by-hand".to_string(),
                )])),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    // Join again, with a manifest of the same object.
    let mut again = join.clone();
    again.extend(["--manifest".into(), manifest.to_str().unwrap().into()]);
    run(again);
    // Something in join's namespace that cannot be listed (its conversion webhook is down).
    let gadgets = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("example.com", "v1", "Gadget"),
        "gadgets",
    );
    Api::<DynamicObject>::namespaced_with(member.clone(), "mcr-system", &gadgets)
        .create(
            &PostParams::default(),
            &DynamicObject::new("kept", &gadgets).within("mcr-system"),
        )
        .await
        .unwrap();

    // The fleet: its webhooks installed in the member through the joined identity.
    let port = free_port();
    let start = || {
        let manager = Arc::new(
            Manager::new(KubeconfigSecrets::new(host.clone(), "mcr-system"))
                .with_local(Cluster::from_config(name("hub"), host_tc.config()).unwrap())
                .webhooks(policy(port)),
        );
        let run = spawn_manager(&manager);
        (manager, run)
    };
    let (manager, running) = start();
    eventually(60, "the fleet's policy in the member", async || {
        policed(&member).await
    })
    .await;

    // Unjoined while the fleet runs: the credential goes, the fleet removes its
    // configurations, and only then is the identity revoked.
    let (out, err) = run(base("unjoin"));
    assert!(out.contains("waiting up to"), "{out}");
    assert!(!err.contains("warning"), "{err}");
    assert!(fleet_configurations(&member).await.is_empty());
    Api::<ConfigMap>::namespaced(member.clone(), "default")
        .create(&PostParams::default(), &managed("after-unjoin"))
        .await
        .expect("no configuration of the fleet checks writes any more");
    // The namespace held what could not be listed: kept, saying why.
    assert!(out.contains("could not be listed"), "{out}");
    let namespace = Api::<Namespace>::all(member.clone())
        .get_opt("mcr-system")
        .await
        .unwrap();
    assert!(
        namespace.is_some_and(|ns| ns.metadata.deletion_timestamp.is_none()),
        "the namespace is being deleted"
    );
    // The hand-made ConfigMap join never proved it made: there, untouched.
    let now = Api::<ConfigMap>::namespaced(member.clone(), "default")
        .get("hand-made")
        .await
        .unwrap();
    assert_eq!(now.uid(), by_hand.uid());
    assert!(
        now.labels()
            .get("multicluster-runtime.sigs.k8s.io/joined-as")
            .is_none()
    );

    // Joined again; the fleet is down when the member is unjoined: nobody can remove its
    // configurations but the admin. Listed, then removed with the admin's rights.
    run(join);
    eventually(60, "the fleet's policy in the member again", async || {
        policed(&member).await
    })
    .await;
    manager.shutdown();
    running.await.unwrap();
    let mut unjoin = base("unjoin");
    unjoin.extend(["--webhook-wait".into(), "2s".into()]);
    let (_, err) = run(unjoin);
    assert!(
        err.contains("warning: the fleet did not remove its webhook configurations"),
        "{err}"
    );
    assert!(!fleet_configurations(&member).await.is_empty());
    let mut remove = base("unjoin");
    remove.extend([
        "--webhook-wait".into(),
        "1s".into(),
        "--remove-webhooks".into(),
    ]);
    let (out, _) = run(remove);
    assert!(out.contains("with your rights"), "{out}");
    assert!(fleet_configurations(&member).await.is_empty());
    Api::<ConfigMap>::namespaced(member.clone(), "default")
        .create(&PostParams::default(), &managed("after-the-fleet"))
        .await
        .expect("no configuration of the fleet checks writes any more");
}
