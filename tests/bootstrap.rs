//! Bootstrap per engagement (`Manager::install`) against real control planes: a member
//! without the CRD gets it and reconciles, a deleted CRD comes back, and a bundle is removed
//! from a departed member only when it says so.

mod common;

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ObjectMeta, PostParams,
};
use kube_runtime::watcher;
use multicluster_runtime::bootstrap::{BUNDLE_LABEL, Bundle};
use multicluster_runtime::{Action, Builder, ClusterName, Context, Manager};
use multicluster_runtime_testenv::TestEnv;

/// A namespaced CRD of kind `kind` in `example.com`, any spec.
fn crd(kind: &str, plural: &str) -> DynamicObject {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": format!("{plural}.example.com")},
        "spec": {
            "group": "example.com",
            "scope": "Namespaced",
            "names": {"kind": kind, "plural": plural, "singular": kind.to_lowercase(), "listKind": format!("{kind}List")},
            "versions": [{
                "name": "v1", "served": true, "storage": true,
                "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}},
            }],
        },
    }))
    .unwrap()
}

fn resource(kind: &str, plural: &str) -> ApiResource {
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk("example.com", "v1", kind), plural)
}

fn crds(client: &kube::Client) -> Api<DynamicObject> {
    Api::all_with(
        client.clone(),
        &ApiResource::from_gvk_with_plural(
            &GroupVersionKind::gvk("apiextensions.k8s.io", "v1", "CustomResourceDefinition"),
            "customresourcedefinitions",
        ),
    )
}

/// The CRD's uid, once it is established.
async fn established_crd(client: &kube::Client, name: &str) -> Option<String> {
    let crd = crds(client).get_opt(name).await.ok()??;
    let established = crd.data["status"]["conditions"]
        .as_array()
        .is_some_and(|c| {
            c.iter()
                .any(|c| c["type"] == "Established" && c["status"] == "True")
        });
    established.then(|| crd.metadata.uid.unwrap_or_default())
}

fn settings(name: &str) -> ConfigMap {
    ConfigMap {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some("default".into()),
            ..Default::default()
        },
        data: Some([("mode".to_string(), "strict".to_string())].into()),
        ..Default::default()
    }
}

async fn config_map(client: &kube::Client, name: &str) -> Option<ConfigMap> {
    Api::<ConfigMap>::namespaced(client.clone(), "default")
        .get_opt(name)
        .await
        .unwrap()
}

/// A manager over `env`'s two clusters, named `<prefix>-a` and `<prefix>-b`, and their
/// clients.
fn two_members(
    env: &TestEnv,
    prefix: &str,
) -> (
    Arc<Manager<multicluster_runtime::providers::Clusters<ClusterName>>>,
    Vec<kube::Client>,
) {
    let clients: Vec<_> = env.clusters().iter().map(|c| c.client().unwrap()).collect();
    let manager = Arc::new(Manager::new(clusters_of([
        (format!("{prefix}-a"), clients[0].clone()),
        (format!("{prefix}-b"), clients[1].clone()),
    ])));
    (manager, clients)
}

/// A bundle named `plural` of the CRD of `kind` and the ConfigMap `settings`.
fn bundle_of(kind: &str, plural: &str, settings_name: &str) -> Bundle {
    Bundle::new(plural)
        .unwrap()
        .with_dynamic(crd(kind, plural))
        .unwrap()
        .with(&settings(settings_name))
        .unwrap()
}

#[tokio::test]
async fn a_member_without_the_crd_gets_it_and_reconciles_and_a_deleted_crd_comes_back() {
    let logs = Logs::capture();
    let env = TestEnv::builder().clusters(2).start().await.unwrap();
    let (manager, clients) = two_members(&env, "boot");
    manager.install(bundle_of("Widget", "widgets", "widget-settings"));
    let widgets = resource("Widget", "widgets");
    let seen = Arc::new(Mutex::new(BTreeSet::<String>::new()));
    let record = seen.clone();
    Builder::<_, DynamicObject>::new_with(&manager, widgets.clone(), watcher::Config::default())
        .start(
            move |widget: Arc<DynamicObject>, ctx: Context<ClusterName, ()>| {
                let record = record.clone();
                async move {
                    record.lock().unwrap().insert(format!(
                        "{}/{}",
                        ctx.cluster_id(),
                        widget.metadata.name.clone().unwrap_or_default()
                    ));
                    Ok::<_, kube::Error>(Action::await_change())
                }
            },
            |_, _, _| Action::requeue(Duration::from_secs(1)),
            Arc::new(()),
        );
    let run = spawn_manager(&manager);

    // Neither member had the CRD: both get it, and the bundle's ConfigMap, labelled.
    for client in &clients {
        eventually(60, "the CRD established", async || {
            established_crd(client, "widgets.example.com")
                .await
                .is_some()
        })
        .await;
        eventually(60, "the bundle's ConfigMap", async || {
            config_map(client, "widget-settings")
                .await
                .is_some_and(|cm| {
                    cm.metadata
                        .labels
                        .unwrap_or_default()
                        .get(BUNDLE_LABEL)
                        .map(String::as_str)
                        == Some("widgets")
                })
        })
        .await;
    }
    let member = Api::<DynamicObject>::namespaced_with(clients[1].clone(), "default", &widgets);
    let widget = |name: &str| {
        let mut w = DynamicObject::new(name, &widgets).within("default");
        w.data = serde_json::json!({"spec": {"size": 1}});
        w
    };
    member
        .create(&PostParams::default(), &widget("w1"))
        .await
        .unwrap();
    eventually(30, "w1 reconciled in boot-b", async || {
        seen.lock().unwrap().contains("boot-b/w1")
    })
    .await;
    // The controller's watch of Widget in boot-b waited for the CRD: it never failed (it
    // listed once, which the reconcile above needed).
    let failed = logs.lines(&["watch failed", "cluster=boot-b", "kind=Widget"]);
    assert!(failed.is_empty(), "{failed:?}");

    // A member admin deletes the CRD (and every Widget with it): it comes back.
    let before = established_crd(&clients[1], "widgets.example.com")
        .await
        .unwrap();
    crds(&clients[1])
        .delete("widgets.example.com", &DeleteParams::default())
        .await
        .unwrap();
    eventually(60, "the CRD put back in boot-b", async || {
        established_crd(&clients[1], "widgets.example.com")
            .await
            .is_some_and(|uid| uid != before)
    })
    .await;
    // And the controller follows the new CRD's objects.
    eventually(60, "w2 created and reconciled in boot-b", async || {
        let _ = member.create(&PostParams::default(), &widget("w2")).await;
        seen.lock().unwrap().contains("boot-b/w2")
    })
    .await;
    // The bundle's ConfigMap, changed by an admin, is repaired.
    Api::<ConfigMap>::namespaced(clients[0].clone(), "default")
        .patch(
            "widget-settings",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(serde_json::json!({"data": {"mode": "off"}})),
        )
        .await
        .unwrap();
    eventually(30, "the ConfigMap repaired in boot-a", async || {
        config_map(&clients[0], "widget-settings")
            .await
            .and_then(|cm| cm.data)
            .is_some_and(|d| d.get("mode").map(String::as_str) == Some("strict"))
    })
    .await;

    manager.shutdown();
    run.await.unwrap();
}

#[tokio::test]
async fn a_bundle_leaves_a_departed_member_only_when_it_says_so() {
    let logs = Logs::capture();
    let env = TestEnv::builder().clusters(2).start().await.unwrap();
    let (manager, clients) = two_members(&env, "dep");
    manager.install(bundle_of("Gadget", "gadgets", "gadget-settings").remove_on_departure(true));
    manager.install(
        Bundle::new("notes")
            .unwrap()
            .with(&settings("notes"))
            .unwrap(),
    );
    let run = spawn_manager(&manager);
    for client in &clients {
        eventually(60, "both bundles installed", async || {
            established_crd(client, "gadgets.example.com")
                .await
                .is_some()
                && config_map(client, "gadget-settings").await.is_some()
                && config_map(client, "notes").await.is_some()
        })
        .await;
    }
    // Drift in the bundle's own label is repaired too.
    Api::<ConfigMap>::namespaced(clients[1].clone(), "default")
        .patch(
            "gadget-settings",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(
                serde_json::json!({"metadata": {"labels": {BUNDLE_LABEL: null}}}),
            ),
        )
        .await
        .unwrap();
    eventually(30, "the label repaired", async || {
        config_map(&clients[1], "gadget-settings")
            .await
            .is_some_and(|cm| {
                cm.metadata
                    .labels
                    .unwrap_or_default()
                    .contains_key(BUNDLE_LABEL)
            })
    })
    .await;

    assert!(manager.provider().remove(&name("dep-b")));
    eventually(60, "the gadgets bundle removed from dep-b", async || {
        config_map(&clients[1], "gadget-settings").await.is_none()
            && crds(&clients[1])
                .get_opt("gadgets.example.com")
                .await
                .unwrap()
                .is_none()
    })
    .await;
    assert!(
        !logs
            .lines(&[
                "bundle object removed from a departed cluster",
                "cluster=dep-b",
                "gadgets.example.com"
            ])
            .is_empty()
    );
    // The notes bundle was not asked to leave: it stays. Its installer does nothing on a
    // departure (nothing to wait for); dep-a keeps both.
    assert!(config_map(&clients[1], "notes").await.is_some());
    assert!(config_map(&clients[0], "gadget-settings").await.is_some());
    assert!(
        established_crd(&clients[0], "gadgets.example.com")
            .await
            .is_some()
    );

    manager.shutdown();
    run.await.unwrap();
}
