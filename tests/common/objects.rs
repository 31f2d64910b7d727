//! Objects the tests create: the zoo / jungle / island scenario, the widget CRD, manifests,
//! kubeconfig Secrets, KubeFed members, admission reviews.

use super::*;

pub const NAMESPACES: [&str; 3] = ["zoo", "jungle", "island"];

pub fn config_map(ns: &str, name: &str, kind: &str) -> ConfigMap {
    ConfigMap {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some(ns.into()),
            labels: Some(BTreeMap::from([("type".to_string(), kind.to_string())])),
            ..Default::default()
        },
        ..Default::default()
    }
}

/// The fixture's ConfigMaps (not the apiserver's own ones in kube-system).
pub fn fixture_objects() -> kube_runtime::watcher::Config {
    kube_runtime::watcher::Config::default().labels("type")
}

/// Creates the namespace `ns`.
pub async fn create_namespace(client: &kube::Client, ns: &str) {
    let namespace = Namespace {
        metadata: ObjectMeta {
            name: Some(ns.into()),
            ..Default::default()
        },
        ..Default::default()
    };
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &namespace)
        .await
        .unwrap();
}

/// Creates the three namespaces, each with an animal, a human and a thing.
pub async fn fixture(client: &kube::Client) {
    for ns in NAMESPACES {
        create_namespace(client, ns).await;
        let cms: Api<ConfigMap> = Api::namespaced(client.clone(), ns);
        for (name, kind) in [
            ("elephant", "animal"),
            ("keeper", "human"),
            ("rock", "thing"),
        ] {
            cms.create(&PostParams::default(), &config_map(ns, name, kind))
                .await
                .unwrap();
        }
    }
}

/// Whether the named ConfigMap has been fed.
pub async fn is_fed(client: &kube::Client, ns: &str, name: &str) -> bool {
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), ns);
    match api.get_opt(name).await {
        Ok(Some(cm)) => cm.data.and_then(|d| d.get("stomach").cloned()).as_deref() == Some("food"),
        _ => false,
    }
}

/// The values of a ConfigMap's `type` label, for a field index.
pub fn label_type(cm: &ConfigMap) -> Vec<String> {
    cm.metadata
        .labels
        .iter()
        .flatten()
        .filter(|(k, _)| *k == "type")
        .map(|(_, v)| v.clone())
        .collect()
}

/// A namespaced custom resource, `widgets.example.com/v1` `Widget`, with any fields.
pub const WIDGET_CRD: &str = r#"
---
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: widgets.example.com
spec:
  group: example.com
  names: {kind: Widget, plural: widgets, singular: widget}
  scope: Namespaced
  versions:
  - name: v1
    served: true
    storage: true
    schema:
      openAPIV3Schema:
        type: object
        properties:
          spec:
            type: object
            properties:
              size: {type: integer}
"#;

/// Applies every document of `yaml` server-side, as `client`'s user.
pub async fn apply_manifests(client: &kube::Client, yaml: &str) {
    use kube::api::{DynamicObject, Patch, PatchParams};
    use kube::discovery::{Scope, pinned_kind};
    let docs: Vec<serde_json::Value> = serde_saphyr::from_multiple(yaml).unwrap();
    for doc in docs.into_iter().filter(|d| !d.is_null()) {
        let object: DynamicObject = serde_json::from_value(doc).unwrap();
        let types = object.types.clone().unwrap();
        let gvk = kube::api::GroupVersionKind::try_from(&types).unwrap();
        let (resource, caps) = pinned_kind(client, &gvk).await.unwrap();
        let api: Api<DynamicObject> = match (caps.scope, object.metadata.namespace.as_deref()) {
            (Scope::Namespaced, Some(ns)) => Api::namespaced_with(client.clone(), ns, &resource),
            _ => Api::all_with(client.clone(), &resource),
        };
        let name = object.metadata.name.clone().unwrap();
        api.patch(
            &name,
            &PatchParams::apply("operations-test"),
            &Patch::Apply(&object),
        )
        .await
        .unwrap_or_else(|e| panic!("applying {} {name}: {e}", gvk.kind));
    }
}

pub fn manifest(file: &str) -> String {
    std::fs::read_to_string(format!("{}/deploy/{file}", env!("CARGO_MANIFEST_DIR"))).unwrap()
}

// HTTPS endpoints: a client that accepts their certificates, tokens and their permissions.

/// An `AdmissionReview` of the creation of ConfigMap `name` in `namespace`, as a member's API
/// server sends one, its object's `data` being `data`.
pub fn config_map_review(
    name: &str,
    namespace: &str,
    data: serde_json::Value,
) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "00000000-0000-0000-0000-000000000001",
            "kind": {"group": "", "version": "v1", "kind": "ConfigMap"},
            "resource": {"group": "", "version": "v1", "resource": "configmaps"},
            "operation": "CREATE",
            "name": name,
            "namespace": namespace,
            "userInfo": {"username": "by-hand"},
            "object": {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": name, "namespace": namespace},
                "data": data,
            },
        },
    })
}

/// A Secret of `KubeconfigSecrets` holding `kubeconfig` (key `kubeconfig`), with its label
/// when `labelled`.
pub fn kubeconfig_secret(
    name: &str,
    kubeconfig: &str,
    labelled: bool,
) -> k8s_openapi::api::core::v1::Secret {
    use k8s_openapi::ByteString;
    use std::collections::BTreeMap;
    k8s_openapi::api::core::v1::Secret {
        metadata: kube::api::ObjectMeta {
            name: Some(name.into()),
            labels: labelled.then(|| {
                BTreeMap::from([(
                    "sigs.k8s.io/multicluster-runtime-kubeconfig".to_string(),
                    "true".to_string(),
                )])
            }),
            ..Default::default()
        },
        data: Some(BTreeMap::from([(
            "kubeconfig".to_string(),
            ByteString(kubeconfig.as_bytes().to_vec()),
        )])),
        ..Default::default()
    }
}

/// Sets the `Ready` condition as KubeFed's health check does.
pub async fn set_kubefed_ready(members: &Api<kube::api::DynamicObject>, name: &str, ready: bool) {
    let status = if ready { "True" } else { "False" };
    members
        .patch_status(
            name,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"status": {"conditions": [{
                "type": "Ready", "status": status,
                "reason": if ready { "ClusterReady" } else { "ClusterNotReachable" },
                "lastProbeTime": "2026-11-24T00:00:00Z",
                "lastTransitionTime": "2026-11-24T00:00:00Z",
            }]}})),
        )
        .await
        .unwrap();
}
