//! The diagnostics view (`/debug/mcr/fleet`) and `mcr status` against real control planes: a
//! forbidden kind, a killed API server and a shard hand-over each show in the view and in
//! `mcr status`, in the troubleshooting chapter's words; the view needs an authorized token,
//! given directly or through the API server's proxy.

mod common;

use std::sync::Arc;

use common::*;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::api::{Api, ObjectMeta, PostParams};
use multicluster_runtime::diagnostics::{ReplicaView, sections};
use multicluster_runtime::{Action, Builder, ClusterName, Context, Manager, watcher};
use multicluster_runtime_testenv::TestEnv;

/// The view at `addr` with `token`.
async fn view_at(addr: std::net::SocketAddr, token: &str) -> ReplicaView {
    let (status, body, _) = https_get(addr, "/debug/mcr/fleet", Some(token)).await;
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
    grant_urls(&admin, "reader", &["/debug/mcr/fleet"]).await;
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
    assert_eq!(https_get(addr, "/debug/mcr/fleet", None).await.0, 401);
    assert_eq!(
        https_get(addr, "/debug/mcr/fleet", Some(&nobody)).await.0,
        403
    );

    // Both clusters' ConfigMaps reconciled; east's Secrets forbidden.
    let cluster = |view: &ReplicaView, name: &str| {
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
    let (shown, refused) = {
        let (binary, url, token_file) = (binary.clone(), url.clone(), token_file.clone());
        // Off the runtime's workers: the replica's endpoints run on them.
        tokio::task::spawn_blocking(move || {
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
            // Without a token: refused, and told what to give.
            let refused = mcr_refused(
                &binary,
                &["status", "--url", &url, "--insecure-skip-tls-verify"],
            );
            (shown, refused)
        })
        .await
        .unwrap()
    };
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
    assert!(
        refused.contains("401") && refused.contains("--token-file"),
        "{refused}"
    );

    manager.shutdown();
    run.await.unwrap();
}

/// An address of this machine the API server may proxy to: not loopback (it refuses to
/// proxy there), found by the route to a documentation address (nothing is sent).
fn pod_address() -> std::net::IpAddr {
    let socket = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
    socket.connect("203.0.113.1:9").expect(
        "this test needs a route off loopback (the API server proxies to no loopback address)",
    );
    let address = socket.local_addr().unwrap().ip();
    assert!(
        !address.is_loopback() && !address.is_unspecified(),
        "this test needs a non-loopback address, found {address}"
    );
    address
}

/// A pod of the Deployment `op` in `default`, as the kubelet would report it: running at
/// `address`, its container port `https` at `port`.
async fn replica_pod(admin: &kube::Client, name: &str, address: std::net::IpAddr, port: u16) {
    use k8s_openapi::api::core::v1::Pod;
    let pods = Api::<Pod>::namespaced(admin.clone(), "default");
    let pod: Pod = serde_json::from_value(serde_json::json!({
        "metadata": {"name": name, "labels": {"app": "op"}},
        "spec": {
            "serviceAccountName": "op",
            "automountServiceAccountToken": false,
            "containers": [{
                "name": "operator",
                "image": "operator:test",
                "ports": [{"name": "https", "containerPort": port}],
            }],
        },
    }))
    .unwrap();
    pods.create(&PostParams::default(), &pod).await.unwrap();
    let status = serde_json::json!({
        "status": {
            "phase": "Running",
            "podIP": address.to_string(),
            "podIPs": [{"ip": address.to_string()}],
        }
    });
    pods.patch_status(
        name,
        &kube::api::PatchParams::default(),
        &kube::api::Patch::Merge(&status),
    )
    .await
    .unwrap();
}

/// The Deployment `op` in `default`, selecting `app=op` (its pods are made by the test: no
/// controller manager runs).
async fn deployment(admin: &kube::Client) {
    use k8s_openapi::api::apps::v1::Deployment;
    let deployment: Deployment = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "op"},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": {"app": "op"}},
            "template": {
                "metadata": {"labels": {"app": "op"}},
                "spec": {"containers": [{"name": "operator", "image": "operator:test"}]},
            },
        },
    }))
    .unwrap();
    Api::<Deployment>::namespaced(admin.clone(), "default")
        .create(&PostParams::default(), &deployment)
        .await
        .unwrap();
}

/// The ids of the sharded fleet: eight names of one member cluster.
const SHARDED: usize = 8;

/// A sharded replica `id` of the fleet, serving its endpoints on `address`; its reconciles
/// wait while `hold` says so (replica `a`'s only), and each start is counted in `started`.
fn sharded_replica(
    id: &'static str,
    host: &kube::Client,
    member: &multicluster_runtime_testenv::TestCluster,
    address: std::net::IpAddr,
    hold: tokio::sync::watch::Receiver<bool>,
    started: Arc<std::sync::atomic::AtomicUsize>,
) -> Arc<Manager<multicluster_runtime::providers::Clusters<ClusterName>>> {
    use multicluster_runtime::{LeaseTiming, Sharding};
    let provider = multicluster_runtime::providers::Clusters::<ClusterName>::new();
    for i in 0..SHARDED {
        provider
            .add(
                multicluster_runtime::Cluster::from_config(name(&format!("s{i}")), member.config())
                    .unwrap(),
            )
            .unwrap();
    }
    let timing = LeaseTiming::default()
        .lease_duration(std::time::Duration::from_secs(6))
        .renew_deadline(std::time::Duration::from_secs(4))
        .retry_period(std::time::Duration::from_secs(1));
    let sharding = Sharding::new(host.clone(), "default", "status")
        .identity(id)
        .timing(timing)
        .handoff_timeout(std::time::Duration::from_secs(120));
    let endpoints = multicluster_runtime::Endpoints::new(std::net::SocketAddr::new(address, 0))
        .authorize_with(host.clone());
    let manager = Arc::new(Manager::new(provider).sharding(sharding).serve(endpoints));
    Builder::<_, ConfigMap>::new(&manager, watcher::Config::default().labels("status=seen"))
        .named("held")
        // A reconcile of a cluster handed over runs on until released (not the default 10 s).
        .disengage_grace(std::time::Duration::from_secs(600))
        .start(
            move |_, _: Context<ClusterName, ()>| {
                let mut hold = hold.clone();
                let started = started.clone();
                async move {
                    started.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    let _ = hold.wait_for(|held| !held).await;
                    Ok::<_, kube::Error>(Action::await_change())
                }
            },
            |_, _: &kube::Error, _: &Context<ClusterName, ()>| Action::await_change(),
            Arc::new(()),
        );
    manager
}

/// Issue 48 part 4: a shard hand-over shows in both replicas' views and in `mcr status
/// --deployment`, which reads every replica through the API server's proxy with a token for
/// the pods' own ServiceAccount: the replica handing clusters over names their new owner
/// while its reconciles there hold them, then the new owner holds them, and the replicas
/// agree.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_hand_over_shows_in_both_views_and_in_mcr_status_through_the_proxy() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let address = pod_address();
    let binary = mcr_binary();
    let env = TestEnv::builder().clusters(2).start().await.unwrap();
    let (host, member) = (env.cluster(0).unwrap(), env.cluster(1).unwrap());
    let admin = host.client().unwrap();
    // A ServiceAccount that may read the view, and the pods' own (which may not).
    let token = account_token(&admin, "reader").await;
    grant_urls(&admin, "reader", &["/debug/mcr/fleet"]).await;
    account_token(&admin, "op").await;
    config_map(&member.client().unwrap(), "held").await;

    // Replica a alone: it takes every cluster, and its reconciles hold there.
    let (hold, held) = tokio::sync::watch::channel(true);
    let started_a = Arc::new(AtomicUsize::new(0));
    let a = sharded_replica("a", &admin, &member, address, held, started_a.clone());
    let run_a = spawn_manager(&a);
    eventually(60, "a reconciling in every cluster", async || {
        started_a.load(Ordering::SeqCst) == SHARDED
    })
    .await;
    let addr_a = a.served_at().unwrap();
    eventually(
        30,
        "a's view: every fence held, a reconcile running in each",
        async || {
            let view = view_at(addr_a, &token).await;
            view.shard.as_ref().is_some_and(|s| s.held.len() == SHARDED)
                && view.clusters.len() == SHARDED
                && view
                    .clusters
                    .iter()
                    .all(|c| c.queues.iter().any(|q| q.in_flight == 1))
        },
    )
    .await;

    // Replica b joins: a hands its share over, waiting for the reconciles there.
    let (_never, unheld) = tokio::sync::watch::channel(false);
    let b = sharded_replica(
        "b",
        &admin,
        &member,
        address,
        unheld,
        Arc::new(AtomicUsize::new(0)),
    );
    let run_b = spawn_manager(&b);
    eventually(60, "b serving", async || b.served_at().is_some()).await;
    let addr_b = b.served_at().unwrap();
    let mut handing: Vec<String> = Vec::new();
    eventually(60, "a handing clusters over to b", async || {
        let view = view_at(addr_a, &token).await;
        handing = view
            .clusters
            .iter()
            .filter(|c| {
                c.shard.as_ref().is_some_and(|s| {
                    s.handing_off && s.held_here && s.owner.as_deref() == Some("b")
                })
            })
            .map(|c| c.name.clone())
            .collect();
        let peers = view
            .shard
            .as_ref()
            .map(|s| s.peers.clone())
            .unwrap_or_default();
        !handing.is_empty() && peers == ["a", "b"]
    })
    .await;
    eventually(
        30,
        "b's view: both peers, none of what a hands over held",
        async || {
            let view = view_at(addr_b, &token).await;
            view.shard.as_ref().is_some_and(|s| {
                s.peers == ["a", "b"] && handing.iter().all(|c| !s.held.contains_key(c))
            })
        },
    )
    .await;

    // `mcr status` over both pods, through the API server's proxy.
    deployment(&admin).await;
    replica_pod(&admin, "op-a", address, addr_a.port()).await;
    replica_pod(&admin, "op-b", address, addr_b.port()).await;
    let status = |binary: std::path::PathBuf| {
        let kubeconfig = host.kubeconfig_path().to_path_buf();
        async move {
            tokio::task::spawn_blocking(move || {
                mcr(
                    &binary,
                    &[
                        "status",
                        "--deployment",
                        "default/op",
                        "--service-account",
                        "default/reader",
                        "--kubeconfig",
                        kubeconfig.to_str().unwrap(),
                    ],
                )
            })
            .await
            .unwrap()
        }
    };
    let shown = status(binary.clone()).await;
    assert!(
        shown.contains("replica a at ") && shown.contains("replica b at "),
        "{shown}"
    );
    for cluster in &handing {
        assert!(
            shown
                .lines()
                .any(|l| l.starts_with(&format!("{cluster} ")) && l.contains("b (handing over)")),
            "{shown}"
        );
        assert!(
            shown.contains(&format!("cluster {cluster}: being handed over to b")),
            "{shown}"
        );
    }

    // The reconciles end: b takes what it owns, and the replicas agree.
    hold.send(false).unwrap();
    eventually(60, "b holding what a handed over", async || {
        let view = view_at(addr_b, &token).await;
        let held = view.shard.map(|s| s.held).unwrap_or_default();
        handing.iter().all(|c| held.get(c) == Some(&false))
    })
    .await;
    eventually(60, "the replicas agreeing in mcr status", async || {
        let shown = status(binary.clone()).await;
        shown.contains("the 2 replicas agree") && !shown.contains("handing over")
    })
    .await;
    let view_a = view_at(addr_a, &token).await;
    assert!(
        handing
            .iter()
            .all(|c| !view_a.shard.as_ref().unwrap().held.contains_key(c)),
        "{view_a:#?}"
    );

    b.shutdown();
    a.shutdown();
    run_b.await.unwrap();
    run_a.await.unwrap();
}
