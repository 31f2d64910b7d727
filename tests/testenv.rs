//! The test environment itself, against real etcd and kube-apiserver processes.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, PolicyRule, RoleRef, Subject};
use kube::api::{
    Api, ApiResource, DynamicObject, GroupVersionKind, ListParams, ObjectMeta, PostParams,
};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube_runtime::{WatchStreamExt, watcher};
use multicluster_runtime_testenv::{Assets, Error, EtcdLayout, TestEnv};

mod common;
use common::WIDGET_CRD;

fn config_map(name: &str, data: &[(&str, &str)]) -> ConfigMap {
    ConfigMap {
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            ..Default::default()
        },
        data: Some(
            data.iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<BTreeMap<_, _>>(),
        ),
        ..Default::default()
    }
}

fn is_forbidden(err: &kube::Error) -> bool {
    matches!(err, kube::Error::Api(status) if status.code == 403)
}

#[tokio::test]
async fn three_clusters_each_store_and_return_their_own_configmaps() {
    let env = TestEnv::builder().clusters(3).start().await.unwrap();
    let clusters = env.clusters();
    assert_eq!(clusters.len(), 3);
    assert_eq!(
        clusters.iter().map(|c| c.name()).collect::<Vec<_>>(),
        ["cluster-0", "cluster-1", "cluster-2"]
    );

    for cluster in &clusters {
        let api: Api<ConfigMap> = Api::namespaced(cluster.client().unwrap(), "default");
        api.create(
            &PostParams::default(),
            &config_map("whoami", &[("cluster", cluster.name())]),
        )
        .await
        .unwrap();
    }
    for cluster in &clusters {
        let api: Api<ConfigMap> = Api::namespaced(cluster.client().unwrap(), "default");
        let cm = api.get("whoami").await.unwrap();
        // Each apiserver sees only its own object, although they share one etcd.
        assert_eq!(cm.data.unwrap()["cluster"], cluster.name());
    }
}

async fn wait_for(seen: &mut tokio::sync::mpsc::UnboundedReceiver<String>, name: &str) {
    let found = tokio::time::timeout(Duration::from_secs(90), async {
        while let Some(got) = seen.recv().await {
            if got == name {
                return;
            }
        }
    })
    .await;
    assert!(found.is_ok(), "the watch never delivered {name}");
}

#[tokio::test]
async fn watch_resumes_after_the_apiserver_restarts() {
    let env = TestEnv::start().await.unwrap();
    let cluster = env.cluster(0).unwrap();
    let api: Api<ConfigMap> = Api::namespaced(cluster.client().unwrap(), "default");

    let (tx, mut seen) = tokio::sync::mpsc::unbounded_channel();
    let watch = watcher(api.clone(), watcher::Config::default())
        .default_backoff()
        .applied_objects();
    let task = tokio::spawn(async move {
        let mut watch = std::pin::pin!(watch);
        while let Some(event) = watch.next().await {
            if let Ok(cm) = event {
                let _ = tx.send(cm.metadata.name.unwrap_or_default());
            }
        }
    });
    api.create(&PostParams::default(), &config_map("before", &[]))
        .await
        .unwrap();
    wait_for(&mut seen, "before").await;

    let port_before = cluster.server().to_string();
    cluster.stop().await;
    assert!(!cluster.is_running());
    assert!(
        api.get("before").await.is_err(),
        "a stopped apiserver must not answer"
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    cluster.start().await.unwrap();
    assert!(cluster.is_running());
    assert_eq!(cluster.server(), port_before);

    // The data survived the restart, and a change made afterwards reaches the same watch.
    assert!(api.get("before").await.is_ok());
    api.create(&PostParams::default(), &config_map("after", &[]))
        .await
        .unwrap();
    wait_for(&mut seen, "after").await;
    task.abort();
}

#[tokio::test]
async fn users_are_refused_without_rbac_rights_and_allowed_through_their_groups() {
    let env = TestEnv::start().await.unwrap();
    let cluster = env.cluster(0).unwrap();

    let nobody = cluster.add_user("nobody", &[]).unwrap();
    let err = Api::<ConfigMap>::namespaced(nobody.client().unwrap(), "default")
        .list(&ListParams::default())
        .await
        .unwrap_err();
    assert!(is_forbidden(&err), "expected 403, got {err:?}");

    // Grant reading ConfigMaps to a group, and check both group slots of a certificate.
    let admin = cluster.client().unwrap();
    let role = ClusterRole {
        metadata: ObjectMeta {
            name: Some("cm-reader".into()),
            ..Default::default()
        },
        rules: Some(vec![PolicyRule {
            api_groups: Some(vec![String::new()]),
            resources: Some(vec!["configmaps".into()]),
            verbs: vec!["get".into(), "list".into()],
            ..Default::default()
        }]),
        ..Default::default()
    };
    Api::<ClusterRole>::all(admin.clone())
        .create(&PostParams::default(), &role)
        .await
        .unwrap();
    let binding = ClusterRoleBinding {
        metadata: ObjectMeta {
            name: Some("cm-readers".into()),
            ..Default::default()
        },
        role_ref: RoleRef {
            api_group: Some("rbac.authorization.k8s.io".into()),
            kind: "ClusterRole".into(),
            name: "cm-reader".into(),
        },
        subjects: Some(vec![Subject {
            kind: "Group".into(),
            name: "readers".into(),
            api_group: Some("rbac.authorization.k8s.io".into()),
            ..Default::default()
        }]),
    };
    Api::<ClusterRoleBinding>::all(admin)
        .create(&PostParams::default(), &binding)
        .await
        .unwrap();

    for groups in [&["readers"][..], &["auditors", "readers"][..]] {
        let user = cluster.add_user("reader", groups).unwrap();
        let api = Api::<ConfigMap>::namespaced(user.client().unwrap(), "default");
        // RBAC changes take effect within moments; allow for the authorizer's cache.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match api.list(&ListParams::default()).await {
                Ok(_) => break,
                Err(e) if Instant::now() < deadline && is_forbidden(&e) => {
                    tokio::time::sleep(Duration::from_millis(100)).await
                }
                Err(e) => panic!("user in groups {groups:?} should read configmaps: {e:?}"),
            }
        }
        // Reading is granted, writing is not.
        let err = api
            .create(&PostParams::default(), &config_map("nope", &[]))
            .await
            .unwrap_err();
        assert!(is_forbidden(&err), "expected 403 on create, got {err:?}");
    }

    let err = cluster.add_user("many", &["a", "b", "c"]).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
}

#[tokio::test]
async fn crds_install_and_serve_custom_objects() {
    let env = TestEnv::start().await.unwrap();
    let cluster = env.cluster(0).unwrap();
    let names = cluster.install_crds(WIDGET_CRD).await.unwrap();
    assert_eq!(names, ["widgets.example.com"]);

    let gvk = GroupVersionKind::gvk("example.com", "v1", "Widget");
    let resource = ApiResource::from_gvk(&gvk);
    let api: Api<DynamicObject> =
        Api::namespaced_with(cluster.client().unwrap(), "default", &resource);
    let mut widget = DynamicObject::new("w1", &resource);
    widget.data = serde_json::json!({ "spec": { "size": 3 } });
    api.create(&PostParams::default(), &widget).await.unwrap();
    let back = api.get("w1").await.unwrap();
    assert_eq!(back.data["spec"]["size"], 3);

    // Installing again is idempotent (server-side apply).
    assert_eq!(
        cluster.install_crds(WIDGET_CRD).await.unwrap(),
        ["widgets.example.com"]
    );

    let err = cluster
        .install_crds("apiVersion: v1\nkind: ConfigMap\n")
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("cluster-0"),
        "errors name the cluster: {err}"
    );
}

#[tokio::test]
async fn kubeconfig_files_reach_the_cluster_and_are_cluster_specific() {
    let env = TestEnv::builder().clusters(2).start().await.unwrap();
    let (a, b) = (env.cluster(0).unwrap(), env.cluster(1).unwrap());

    let kubeconfig = Kubeconfig::read_from(a.kubeconfig_path()).unwrap();
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .unwrap();
    let client = kube::Client::try_from(config).unwrap();
    let version = client.apiserver_version().await.unwrap();
    assert_eq!(format!("{}.{}", version.major, version.minor), "1.36");

    // The kubeconfigs of one environment merge (`KUBECONFIG=a:b`, as getting-started.md does):
    // each context keeps its own cluster's credentials.
    let merged = Kubeconfig::read_from(a.kubeconfig_path())
        .unwrap()
        .merge(Kubeconfig::read_from(b.kubeconfig_path()).unwrap())
        .unwrap();
    for cluster in [&a, &b] {
        let options = KubeConfigOptions {
            context: Some(cluster.name().to_string()),
            ..Default::default()
        };
        let config = kube::Config::from_custom_kubeconfig(merged.clone(), &options)
            .await
            .unwrap();
        assert_eq!(
            config.cluster_url.to_string(),
            format!("{}/", cluster.server())
        );
        let client = kube::Client::try_from(config).unwrap();
        let api: Api<ConfigMap> = Api::namespaced(client, "default");
        api.list(&ListParams::default())
            .await
            .unwrap_or_else(|e| panic!("{} through the merged kubeconfig: {e}", cluster.name()));
    }

    // Cluster a's credentials and CA are worthless against cluster b.
    let mut wrong = a.config();
    wrong.cluster_url = b.server().parse().unwrap();
    let wrong = kube::Client::try_from(wrong).unwrap();
    assert!(wrong.apiserver_version().await.is_err());
}

#[tokio::test]
async fn clusters_can_be_added_and_removed_at_run_time() {
    let env = TestEnv::builder().clusters(1).start().await.unwrap();
    let added = env.add_cluster().await.unwrap();
    assert_eq!(added.name(), "cluster-1");
    assert_eq!(env.clusters().len(), 2);
    added.client().unwrap().apiserver_version().await.unwrap();

    let pid = added.apiserver_pid().unwrap();
    assert!(env.remove_cluster("cluster-1").await);
    assert!(!env.remove_cluster("cluster-1").await);
    assert!(env.cluster_named("cluster-1").is_none());
    assert!(
        !process_alive(pid),
        "a removed cluster's apiserver must be stopped"
    );
    assert!(added.client().unwrap().apiserver_version().await.is_err());
    // The remaining cluster is unaffected.
    env.cluster(0)
        .unwrap()
        .client()
        .unwrap()
        .apiserver_version()
        .await
        .unwrap();
}

#[tokio::test]
async fn one_etcd_per_cluster_layout_runs_isolated_clusters() {
    let env = TestEnv::builder()
        .clusters(2)
        .etcd_layout(EtcdLayout::PerCluster)
        .start()
        .await
        .unwrap();
    assert_eq!(env.etcd_layout(), EtcdLayout::PerCluster);
    // Two apiservers and two etcds.
    assert_eq!(env.pids().len(), 4);
    let (a, b) = (env.cluster(0).unwrap(), env.cluster(1).unwrap());
    Api::<ConfigMap>::namespaced(a.client().unwrap(), "default")
        .create(&PostParams::default(), &config_map("only-in-a", &[]))
        .await
        .unwrap();
    let in_b = Api::<ConfigMap>::namespaced(b.client().unwrap(), "default")
        .get_opt("only-in-a")
        .await
        .unwrap();
    assert!(in_b.is_none());

    // Restarting an apiserver keeps its own etcd's data.
    a.stop().await;
    a.start().await.unwrap();
    Api::<ConfigMap>::namespaced(a.client().unwrap(), "default")
        .get("only-in-a")
        .await
        .unwrap();
}

#[tokio::test]
async fn an_apiserver_that_fails_to_start_reports_its_log() {
    let err = TestEnv::builder()
        .apiserver_arg("--no-such-flag=1")
        .start()
        .await
        .unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(
            err,
            Error::Exited {
                process: "kube-apiserver",
                ..
            }
        ),
        "{msg}"
    );
    assert!(msg.contains("cluster-0"), "{msg}");
    assert!(
        msg.contains("no-such-flag"),
        "the log tail should show the apiserver's complaint: {msg}"
    );
}

#[tokio::test]
async fn a_process_not_ready_in_time_is_stopped_and_reported_with_its_log() {
    let err = TestEnv::builder()
        .ready_timeout(Duration::from_millis(1))
        .start()
        .await
        .unwrap_err();
    let msg = err.to_string();
    let Error::NotReady { log, timeout, .. } = &err else {
        panic!("expected NotReady, got {msg}")
    };
    assert_eq!(*timeout, Duration::from_millis(1));
    assert!(
        msg.contains(&log.display().to_string()),
        "the error names the log file: {msg}"
    );
}

#[tokio::test]
async fn missing_binaries_are_reported_with_the_way_to_get_them() {
    let empty = tempfile::tempdir().unwrap();
    let err = Assets::in_dir(empty.path()).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("Assets::locate_or_build()")
            && msg.contains("scripts/testenv-assets.sh")
            && msg.contains("MCR_TESTENV_ASSETS"),
        "{msg}"
    );
}

/// `Assets::build`, the crate's own way to the binaries (for users without the repository's
/// scripts), runs the build script the crate carries. Into a cache root of the test's own
/// that already holds the suite's binaries (links to them), so the script's own check finds
/// them and no Go build runs: the script text, its environment and the directory it prints
/// are what is tested. (The Go build itself is the same script, which CI runs cold through
/// scripts/testenv-assets.sh.)
#[tokio::test]
async fn the_crate_builds_or_finds_its_binaries_through_its_own_script() {
    let located = Assets::locate().unwrap();
    let root = tempfile::tempdir().unwrap();
    let dir = root
        .path()
        .join(multicluster_runtime_testenv::KUBERNETES_VERSION);
    std::fs::create_dir(&dir).unwrap();
    std::os::unix::fs::symlink(located.etcd(), dir.join("etcd")).unwrap();
    std::os::unix::fs::symlink(located.kube_apiserver(), dir.join("kube-apiserver")).unwrap();
    let built = Assets::build_into(root.path()).await.unwrap();
    assert_eq!(built.dir(), dir);
    let env = TestEnv::builder().assets(built).start().await.unwrap();
    let version = env
        .cluster(0)
        .unwrap()
        .client()
        .unwrap()
        .apiserver_version()
        .await
        .unwrap();
    assert_eq!(format!("{}.{}", version.major, version.minor), "1.36");
}

// --- no orphans ---------------------------------------------------------------------------

const HELPER_ENV: &str = "MCR_TESTENV_ORPHAN_HELPER";

/// Not a test of its own: `no_process_or_directory_outlives_the_test_binary` runs this binary again with
/// `HELPER_ENV` set, and this starts clusters, prints their process ids and ends as told.
#[tokio::test]
#[ignore = "helper process for no_process_or_directory_outlives_the_test_binary"]
async fn orphan_helper() {
    let Ok(mode) = std::env::var(HELPER_ENV) else {
        return;
    };
    let env = TestEnv::builder().clusters(2).start().await.unwrap();
    let pids: Vec<String> = env.pids().iter().map(u32::to_string).collect();
    println!("DIR {}", env.dir().display());
    println!("PIDS {}", pids.join(" "));
    match mode.as_str() {
        "abort" => std::process::abort(),
        "exit" => std::process::exit(0),
        "panic" => panic!("helper panics with the environment alive"),
        _ => drop(env),
    }
}

fn process_alive(pid: u32) -> bool {
    // A zombie has exited; it only waits for its (possibly absent) parent to reap it.
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit(')')
            .next()
            .is_some_and(|rest| !rest.trim_start().starts_with('Z')),
        Err(_) => false,
    }
}

/// The helper's process ids and its environment's directory.
fn run_helper(mode: &str) -> (Vec<u32>, std::path::PathBuf) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "orphan_helper",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(HELPER_ENV, mode)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut pids = Vec::new();
    let mut dir = std::path::PathBuf::new();
    for line in BufReader::new(child.stdout.take().unwrap()).lines() {
        let line = line.unwrap();
        if let Some((_, path)) = line.split_once("DIR ") {
            dir = path.trim().into();
        }
        // The harness prints "test orphan_helper ... " on the same line first.
        if let Some((_, list)) = line.split_once("PIDS ") {
            pids = list
                .split_whitespace()
                .map(|p| p.parse().unwrap())
                .collect();
        }
    }
    child.wait().unwrap();
    assert_eq!(
        pids.len(),
        3,
        "helper ({mode}) should report 2 apiservers and 1 etcd"
    );
    assert!(
        !dir.as_os_str().is_empty(),
        "helper ({mode}) reported no directory"
    );
    (pids, dir)
}

#[test]
fn no_process_or_directory_outlives_the_test_binary() {
    for mode in ["return", "panic", "abort", "exit"] {
        let (pids, dir) = run_helper(mode);
        // The guardian gives processes a grace period before SIGKILL, then removes the
        // directory (etcd's data: about 120 MiB); allow for it.
        let deadline = Instant::now() + Duration::from_secs(20);
        while (pids.iter().any(|&p| process_alive(p)) || dir.exists()) && Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(100));
        }
        assert!(
            !dir.exists(),
            "after the helper ended by {mode}, its directory {} is left",
            dir.display()
        );
        let alive: Vec<u32> = pids.iter().copied().filter(|&p| process_alive(p)).collect();
        assert!(
            alive.is_empty(),
            "after the helper ended by {mode}, processes {alive:?} still run"
        );
    }
}
