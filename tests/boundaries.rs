//! Trust at the boundaries, against a real control plane: what a credential plugin is given
//! or prints never leaves through an error (logs, `cache_status`, `/readyz?verbose`, Events,
//! metrics).

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::api::{Api, PostParams};
use kube_runtime::events::{Event, EventType, Recorder, Reporter};
use kube_runtime::watcher;
use multicluster_runtime::providers::Clusters;
use multicluster_runtime::{Action, Builder, Cluster, ClusterName, Context, Manager};
use multicluster_runtime_testenv::{TestCluster, TestEnv};

const MARKER: &str = "mcr-marker-refresh";

/// A kubeconfig user whose exec plugin answers `token`, expiring in 61 s (kube-client
/// refreshes a token a minute before it expires, so it runs the plugin again for the requests
/// after the first second), until the file `fail` appears in `dir`; then it fails: it prints
/// the marker on stdout and stderr, and has it in an argument and in an environment value,
/// and touches `failed` in `dir`.
fn refreshing_plugin(tc: &TestCluster, dir: &std::path::Path, token: &str) -> kube::Config {
    use std::os::unix::fs::PermissionsExt;
    let plugin = dir.join("plugin.sh");
    std::fs::write(
        &plugin,
        format!(
            r#"#!/bin/sh
if [ ! -f '{dir}/fail' ]; then
  expires=$(date -u -d '+61 seconds' +%Y-%m-%dT%H:%M:%SZ)
  printf '{{"apiVersion":"client.authentication.k8s.io/v1","kind":"ExecCredential","status":{{"token":"{token}","expirationTimestamp":"%s"}}}}' "$expires"
  exit 0
fi
touch '{dir}/failed'
echo "{MARKER}-stdout"
echo "{MARKER}-stderr" >&2
exit 1
"#,
            dir = dir.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&plugin, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut config = tc.config();
    config.auth_info = kube::config::AuthInfo {
        exec: Some(kube::config::ExecConfig {
            api_version: Some("client.authentication.k8s.io/v1".into()),
            command: Some(plugin.display().to_string()),
            args: Some(vec![format!("{MARKER}-arg")]),
            env: Some(vec![std::collections::HashMap::from([
                ("name".to_string(), "PLUGIN_SECRET".to_string()),
                ("value".to_string(), format!("{MARKER}-env")),
            ])]),
            drop_env: None,
            install_hint: None,
            provide_cluster_info: false,
            cluster: None,
            // Its stderr is captured (kube passes it through to the terminal otherwise).
            interactive_mode: Some(kube::config::ExecInteractiveMode::Never),
            other: Default::default(),
        }),
        ..Default::default()
    };
    config
}

struct Reader {
    /// Records in the admin's view of the cluster (the plugin's credentials will not work).
    recorder: Recorder,
    /// The clusters where a read succeeded.
    read: std::sync::Mutex<std::collections::BTreeSet<String>>,
}

/// Reads the ConfigMap again through the cluster's client; a failure is recorded as an Event
/// with the error's text, as reconcilers do.
async fn read_again(
    cm: Arc<ConfigMap>,
    ctx: Context<ClusterName, Reader>,
) -> Result<Action, kube::Error> {
    let ns = cm.metadata.namespace.clone().unwrap_or_default();
    let api: Api<ConfigMap> = Api::namespaced(ctx.client(), &ns);
    if let Err(error) = api.get(&cm.metadata.name.clone().unwrap_or_default()).await {
        let mut reference = kube::Resource::object_ref(cm.as_ref(), &());
        reference.name = Some(format!("{}-{}", ctx.cluster_id(), "probe"));
        let event = Event {
            type_: EventType::Warning,
            reason: "ReadFailed".into(),
            note: Some(error.to_string().chars().take(1000).collect()),
            action: "Read".into(),
            secondary: None,
        };
        let _ = ctx.state().recorder.publish(&event, &reference).await;
        return Err(error);
    }
    ctx.state()
        .read
        .lock()
        .unwrap()
        .insert(ctx.cluster_id().to_string());
    Ok(Action::requeue(Duration::from_millis(500)))
}

#[tokio::test]
async fn a_plugin_failing_on_token_refresh_leaves_no_secret_in_logs_readyz_cache_status_events_or_metrics()
 {
    let logs = Logs::capture();
    let env = TestEnv::start().await.unwrap();
    let tc = env.cluster(0).unwrap();
    let admin = tc.client().unwrap();
    create_namespace(&admin, "refresh").await;
    let cms: Api<ConfigMap> = Api::namespaced(admin.clone(), "refresh");
    cms.create(
        &PostParams::default(),
        &config_map("refresh", "probe", "thing"),
    )
    .await
    .unwrap();
    let token = service_account_token(&tc, "refresher").await;

    // Two clusters: one built by the crate (shared transport, its re-auth layer with kube's
    // refreshing layer inside), one given as a kube::Client (kube's own stack).
    let (shared_dir, kube_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let shared = Cluster::from_config(
        name("refresh-shared"),
        refreshing_plugin(&tc, shared_dir.path(), &token),
    )
    .unwrap();
    let own = kube::Client::try_from(refreshing_plugin(&tc, kube_dir.path(), &token)).unwrap();
    let given = Cluster::new(name("refresh-kube"), own);
    let clusters = Clusters::new();
    clusters.add(shared.clone()).unwrap();
    clusters.add(given.clone()).unwrap();

    let mut registry = prometheus_client::registry::Registry::default();
    let metrics = multicluster_runtime::Metrics::new(&mut registry);
    let endpoints = multicluster_runtime::Endpoints::new("127.0.0.1:0".parse().unwrap())
        .metrics(Arc::new(registry));
    let manager = Arc::new(Manager::new(clusters).metrics(metrics).serve(endpoints));
    let reader = Arc::new(Reader {
        recorder: Recorder::new(admin.clone(), Reporter::from("boundaries-test")),
        read: Default::default(),
    });
    Builder::<_, ConfigMap>::new(&manager, watcher::Config::default())
        .named("refresh")
        .start(
            read_again,
            |_, _: &kube::Error, _: &Context<ClusterName, Reader>| {
                Action::requeue(Duration::from_millis(500))
            },
            reader.clone(),
        );
    let run = spawn_manager(&manager);
    eventually(60, "both clusters read", async || {
        reader.read.lock().unwrap().len() == 2
    })
    .await;

    // The plugins fail from now on. Sync point: both failed on a refresh.
    for dir in [&shared_dir, &kube_dir] {
        std::fs::write(dir.path().join("fail"), "").unwrap();
        let failed = dir.path().join("failed");
        eventually(60, "the plugin failed on a refresh", async || {
            failed.exists()
        })
        .await;
    }
    // A watch started now fails on its first listing.
    for cluster in [&shared, &given] {
        cluster
            .store::<Secret>(&watcher::Config::default())
            .unwrap();
    }
    let addr = manager.served_at().unwrap();
    for (cluster, id) in [(&shared, "refresh-shared"), (&given, "refresh-kube")] {
        eventually(
            60,
            &format!("{id}: the Secret watch reports its failure"),
            async || {
                cluster
                    .cache_status()
                    .iter()
                    .any(|s| s.kind == "Secret" && s.error.is_some())
            },
        )
        .await;
        eventually(60, &format!("{id}: a failed read recorded"), async || {
            has_event(&admin, "refresh", "ReadFailed", &format!("{id}-probe"), "").await
        })
        .await;
        eventually(
            60,
            &format!("{id}: a failed reconcile logged"),
            async || {
                !logs
                    .lines(&["WARN", &format!("cluster={id}"), "reconcile failed"])
                    .is_empty()
            },
        )
        .await;
        let status = format!("{:?}", cluster.cache_status());
        assert!(!status.contains(MARKER), "{id}: {status}");
        assert!(
            status.contains("exec credential plugin exited with status 1"),
            "{id}: what failed is said: {status}"
        );
        assert!(
            has_event(
                &admin,
                "refresh",
                "ReadFailed",
                &format!("{id}-probe"),
                "exec credential plugin exited with status 1"
            )
            .await,
            "{id}: the Event says what failed"
        );
    }
    let (_, verbose) = http_get(addr, "/readyz?verbose").await;
    assert!(verbose.contains("refresh-shared"), "{verbose}");
    assert!(!verbose.contains(MARKER), "{verbose}");
    let (_, metrics) = http_get(addr, "/metrics").await;
    assert!(metrics.contains("refresh-kube"), "{metrics}");
    assert!(!metrics.contains(MARKER), "{metrics}");
    let events: Api<k8s_openapi::api::events::v1::Event> =
        Api::namespaced(admin.clone(), "refresh");
    for event in events.list(&Default::default()).await.unwrap() {
        let text = serde_json::to_string(&event).unwrap();
        assert!(!text.contains(MARKER), "an Event holds a secret: {text}");
    }
    assert_eq!(logs.lines(&[MARKER]), Vec::<String>::new());

    manager.shutdown();
    run.await.unwrap();
}
