//! The diagnostics view (`/debug/fleet`) and `mcr status` against real control planes: a
//! forbidden kind, a killed API server and a shard hand-over each show in the view and in
//! `mcr status`, in the troubleshooting chapter's words; the view needs an authorized token,
//! given directly or through the API server's proxy.

mod common;

use std::sync::Arc;

use common::*;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::api::{Api, ObjectMeta, PostParams};
use multicluster_runtime::diagnostics::{FleetView, sections};
use multicluster_runtime::{Action, Builder, ClusterName, Context, Manager, watcher};
use multicluster_runtime_testenv::TestEnv;

/// The view at `addr` with `token`.
async fn view_at(addr: std::net::SocketAddr, token: &str) -> FleetView {
    let (status, body, _) = https_get(addr, "/debug/fleet", Some(token)).await;
    assert_eq!(status, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

async fn config_map(client: &kube::Client, name: &str) {
    Api::<ConfigMap>::namespaced(client.clone(), "default")
        .create(
            &PostParams::default(),
            &ConfigMap {
                metadata: ObjectMeta {
                    name: Some(name.into()),
                    labels: Some([("status".to_string(), "seen".to_string())].into()),
                    ..Default::default()
                },
                ..Default::default()
            },
        )
        .await
        .unwrap();
}

/// Lets `user` list and watch ConfigMaps (and nothing else).
async fn config_maps_only(admin: &kube::Client, user: &str) {
    use k8s_openapi::api::rbac::v1::{
        ClusterRole, ClusterRoleBinding, PolicyRule, RoleRef, Subject,
    };
    let pp = PostParams::default();
    Api::<ClusterRole>::all(admin.clone())
        .create(
            &pp,
            &ClusterRole {
                metadata: ObjectMeta {
                    name: Some(format!("{user}-config-maps")),
                    ..Default::default()
                },
                rules: Some(vec![PolicyRule {
                    api_groups: Some(vec![String::new()]),
                    resources: Some(vec!["configmaps".into()]),
                    verbs: vec!["get".into(), "list".into(), "watch".into()],
                    ..Default::default()
                }]),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    Api::<ClusterRoleBinding>::all(admin.clone())
        .create(
            &pp,
            &ClusterRoleBinding {
                metadata: ObjectMeta {
                    name: Some(format!("{user}-config-maps")),
                    ..Default::default()
                },
                role_ref: RoleRef {
                    api_group: Some("rbac.authorization.k8s.io".into()),
                    kind: "ClusterRole".into(),
                    name: format!("{user}-config-maps"),
                },
                subjects: Some(vec![Subject {
                    kind: "User".into(),
                    name: user.into(),
                    ..Default::default()
                }]),
            },
        )
        .await
        .unwrap();
}

/// Issue 48 part 4: a kind forbidden in one cluster and a killed API server show in the view
/// (and in `mcr status`, in the troubleshooting chapter's words), beside the queues and the
/// last reconcile of the healthy ones; no token gets 401.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forbidden_kind_and_a_killed_apiserver_show_in_the_view_and_in_mcr_status() {
    let binary = mcr_binary();
    let env = TestEnv::builder().clusters(3).start().await.unwrap();
    let (host, east, west) = (
        env.cluster(0).unwrap(),
        env.cluster(1).unwrap(),
        env.cluster(2).unwrap(),
    );
    let admin = host.client().unwrap();
    let reader = account_token(&admin, "reader").await;
    grant_urls(&admin, "reader", &["/debug/fleet"]).await;
    let nobody = account_token(&admin, "nobody").await;
    // east: a user who may read ConfigMaps, not Secrets.
    let limited = east.add_user("limited", &[]).unwrap();
    config_maps_only(&east.client().unwrap(), "limited").await;
    for tc in [&east, &west] {
        config_map(&tc.client().unwrap(), "seen").await;
    }
    let provider = clusters_of([
        ("east", kube::Client::try_from(limited.config()).unwrap()),
        ("west", west.client().unwrap()),
    ]);
    let endpoints = multicluster_runtime::Endpoints::new("127.0.0.1:0".parse().unwrap())
        .authorize_with(admin.clone());
    let manager = Arc::new(Manager::new(provider).serve(endpoints));
    Builder::<_, ConfigMap>::new(&manager, watcher::Config::default().labels("status=seen"))
        .named("configs")
        .start(
            |_, _: Context<ClusterName, ()>| async { Ok::<_, kube::Error>(Action::await_change()) },
            |_, _: &kube::Error, _: &Context<ClusterName, ()>| Action::await_change(),
            Arc::new(()),
        );
    Builder::<_, Secret>::new(&manager, watcher::Config::default())
        .named("secrets")
        .start(
            |_, _: Context<ClusterName, ()>| async { Ok::<_, kube::Error>(Action::await_change()) },
            |_, _: &kube::Error, _: &Context<ClusterName, ()>| Action::await_change(),
            Arc::new(()),
        );
    let run = spawn_manager(&manager);
    eventually(30, "serving", async || manager.served_at().is_some()).await;
    let addr = manager.served_at().unwrap();
    assert_eq!(https_get(addr, "/debug/fleet", None).await.0, 401);
    assert_eq!(https_get(addr, "/debug/fleet", Some(&nobody)).await.0, 403);

    // Both clusters' ConfigMaps reconciled; east's Secrets forbidden.
    let cluster = |view: &FleetView, name: &str| {
        view.clusters
            .iter()
            .find(|c| c.name == name)
            .cloned()
            .unwrap_or_else(|| panic!("no cluster {name} in {view:#?}"))
    };
    eventually(
        60,
        "ConfigMaps reconciled in both, east's Secrets forbidden",
        async || {
            let view = view_at(addr, &reader).await;
            let reconciled = |name: &str| {
                cluster(&view, name).queues.iter().any(|q| {
                    q.controller == "configs"
                        && q.listed
                        && q.last
                            .as_ref()
                            .is_some_and(|l| l.result == "success" && l.object == "default/seen")
                })
            };
            let forbidden = cluster(&view, "east").watches.iter().any(|w| {
                w.kind == "Secret"
                    && w.error.as_deref().is_some_and(|e| e.contains("forbidden"))
                    && w.failures > 0
            });
            reconciled("east") && reconciled("west") && forbidden
        },
    )
    .await;
    let view = view_at(addr, &reader).await;
    assert_eq!(view.controllers.len(), 2, "{view:#?}");
    assert!(view.controllers.iter().all(|c| c.answered), "{view:#?}");
    let west_view = cluster(&view, "west");
    assert!(
        west_view.engaged && west_view.role == "cluster",
        "{west_view:#?}"
    );
    assert!(
        west_view
            .watches
            .iter()
            .all(|w| w.listed && w.error.is_none() && w.last_event.is_some()),
        "{west_view:#?}"
    );
    let problems = view.problems();
    assert!(
        problems.iter().any(|p| p.cluster.as_deref() == Some("east")
            && p.what.starts_with("Secret failing")
            && p.section == Some(sections::FORBIDDEN)),
        "{problems:#?}"
    );
    assert!(
        !problems
            .iter()
            .any(|p| p.cluster.as_deref() == Some("west")),
        "{problems:#?}"
    );

    // west's API server dies: its watches fail, in the view and in `mcr status`.
    west.kill().await;
    eventually(60, "west's watches failing", async || {
        let view = view_at(addr, &reader).await;
        cluster(&view, "west")
            .watches
            .iter()
            .filter(|w| w.error.is_some())
            .count()
            == 2
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, &reader).unwrap();
    let url = format!("https://{addr}");
    let shown = mcr(
        &binary,
        &[
            "status",
            "--url",
            &url,
            "--token-file",
            token_file.to_str().unwrap(),
            "--insecure-skip-tls-verify",
        ],
    );
    let lines: Vec<&str> = shown.lines().collect();
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("east ") && l.contains("1/2 ok, 1 failing")),
        "{shown}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("west ") && l.contains("0/2 ok, 2 failing")),
        "{shown}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l.contains("cluster east: Secret failing")
                && l.ends_with(&format!(
                    "(docs/troubleshooting.md: \"{}\")",
                    sections::FORBIDDEN
                ))),
        "{shown}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l.contains("cluster west: ConfigMap stale, failing")
                && l.ends_with(&format!(
                    "(docs/troubleshooting.md: \"{}\")",
                    sections::UNREACHABLE
                ))),
        "{shown}"
    );
    // Without a token: refused, and told what to give.
    let refused = mcr_refused(
        &binary,
        &["status", "--url", &url, "--insecure-skip-tls-verify"],
    );
    assert!(
        refused.contains("401") && refused.contains("--token-file"),
        "{refused}"
    );

    manager.shutdown();
    run.await.unwrap();
}
