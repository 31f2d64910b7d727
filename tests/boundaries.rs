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

/// A kubeconfig user whose exec plugin answers `token`, expiring in 3 s (kube-client asks
/// again for a token within a minute of its expiry: on every request; the crate's clients
/// in the background, and for the requests after it expired), until the file `fail` appears
/// in `dir`; then it fails: it prints
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
  expires=$(date -u -d '+3 seconds' +%Y-%m-%dT%H:%M:%SZ)
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
        .metrics(Arc::new(registry))
        .plain_http();
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

// ---- Endpoints that authenticate (helpers in tests/common) ----

#[tokio::test]
async fn endpoints_speak_https_and_serve_metrics_detail_and_handlers_only_to_authorized_tokens() {
    let env = TestEnv::start().await.unwrap();
    let tc = env.cluster(0).unwrap();
    let admin = tc.client().unwrap();
    let scraper = account_token(&admin, "scraper").await;
    grant_urls(&admin, "scraper", &["/metrics", "/debug/fleet"]).await;
    let nobody = account_token(&admin, "nobody").await;

    let mut registry = prometheus_client::registry::Registry::default();
    let metrics = multicluster_runtime::Metrics::new(&mut registry);
    let clusters = clusters_of([("member", admin.clone())]);
    let failing = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let endpoints = multicluster_runtime::Endpoints::new("127.0.0.1:0".parse().unwrap())
        .metrics(Arc::new(registry))
        .authorize_with(admin.clone())
        .readyz_check("switch", {
            let failing = failing.clone();
            move || {
                if failing.load(std::sync::atomic::Ordering::SeqCst) {
                    Err("switched off by the test".into())
                } else {
                    Ok(())
                }
            }
        })
        .handler("/debug/fleet", |_request| async {
            http::Response::new(bytes::Bytes::from_static(b"fleet of one\n"))
        });
    let manager = Arc::new(Manager::new(clusters).metrics(metrics).serve(endpoints));
    Builder::<_, ConfigMap>::new(&manager, watcher::Config::default())
        .named("served")
        .start(
            |_, _: Context<ClusterName, ()>| async { Ok::<_, kube::Error>(Action::await_change()) },
            |_, _: &kube::Error, _: &Context<ClusterName, ()>| Action::await_change(),
            Arc::new(()),
        );
    let run = spawn_manager(&manager);
    eventually(30, "serving", async || manager.served_at().is_some()).await;
    let addr = manager.served_at().unwrap();

    // Probes: anyone, status only.
    eventually(30, "ready", async || {
        https_get(addr, "/readyz", None).await.0 == 200
    })
    .await;
    assert_eq!(https_get(addr, "/readyz", None).await.1, "ok\n");
    assert_eq!(https_get(addr, "/healthz", None).await.1, "ok\n");
    // Plain HTTP to the same port gets no answer of the endpoints.
    assert!(
        !matches!(http_get_opt(addr, "/healthz").await, Ok((200, _))),
        "plain HTTP is not served"
    );

    // Metrics, the per-cluster detail and the handler: authenticated and authorized only.
    for path in ["/metrics", "/readyz?verbose", "/debug/fleet"] {
        assert_eq!(https_get(addr, path, None).await.0, 401, "{path}: no token");
        assert_eq!(
            https_get(addr, path, Some("not-a-token")).await.0,
            401,
            "{path}: an unknown token"
        );
        assert_eq!(
            https_get(addr, path, Some(&nobody)).await.0,
            403,
            "{path}: a token without the permission"
        );
        assert_eq!(
            https_get(addr, path, Some(&scraper)).await.0,
            200,
            "{path}: a token with it"
        );
    }
    let (_, text, _) = https_get(addr, "/metrics", Some(&scraper)).await;
    assert!(text.contains("controller_runtime_active_workers"), "{text}");
    let (_, detail, _) = https_get(addr, "/readyz?verbose", Some(&scraper)).await;
    assert!(
        detail.contains("check switch: ok") && detail.contains("cluster member"),
        "{detail}"
    );
    assert_eq!(
        https_get(addr, "/debug/fleet", Some(&scraper)).await.1,
        "fleet of one\n"
    );
    // The detail needs the metrics' permission, not /readyz's (which Kubernetes' default
    // roles give everyone).
    assert_eq!(
        https_get(addr, "/healthz?verbose", Some(&nobody)).await.0,
        403
    );
    assert_eq!(
        https_get(addr, "/healthz?verbose", Some(&scraper)).await.0,
        200
    );

    // A readiness check of the user's fails: not ready, and the detail says which.
    failing.store(true, std::sync::atomic::Ordering::SeqCst);
    assert_eq!(https_get(addr, "/readyz", None).await.0, 503);
    let (_, detail, _) = https_get(addr, "/readyz?verbose", Some(&scraper)).await;
    assert!(
        detail.contains("check switch: failed: switched off by the test"),
        "{detail}"
    );

    manager.shutdown();
    run.await.unwrap();
}

/// A reconcile that keeps a worker busy for about 20 ms: the function a profile must name.
#[cfg(feature = "profiling")]
#[inline(never)]
fn busy_reconcile_marker() -> u64 {
    let until = std::time::Instant::now() + Duration::from_millis(20);
    let mut x = 1u64;
    while std::time::Instant::now() < until {
        x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
    }
    x
}

#[cfg(feature = "profiling")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cpu_profile_is_served_to_authorized_tokens_only_and_names_the_reconcile() {
    use pprof::protos::Message as _;
    let logs = Logs::capture();
    let env = TestEnv::start().await.unwrap();
    let admin = env.cluster(0).unwrap().client().unwrap();
    let profiler = account_token(&admin, "profiler").await;
    grant_urls(&admin, "profiler", &["/debug/pprof/profile"]).await;
    let nobody = account_token(&admin, "nobody").await;
    let endpoints = multicluster_runtime::Endpoints::new("127.0.0.1:0".parse().unwrap())
        .authorize_with(admin.clone())
        .profiling(true);
    let manager = Arc::new(Manager::new(clusters_of([("member", admin.clone())])).serve(endpoints));
    Builder::<_, ConfigMap>::new(&manager, watcher::Config::default())
        .named("profiled")
        .start(
            |_, _: Context<ClusterName, ()>| async {
                std::hint::black_box(busy_reconcile_marker());
                Ok::<_, kube::Error>(Action::requeue(Duration::from_millis(1)))
            },
            |_, _: &kube::Error, _: &Context<ClusterName, ()>| Action::await_change(),
            Arc::new(()),
        );
    let run = spawn_manager(&manager);
    Api::<ConfigMap>::namespaced(admin.clone(), "default")
        .create(
            &Default::default(),
            &ConfigMap {
                metadata: kube::api::ObjectMeta {
                    name: Some("profiled".into()),
                    ..Default::default()
                },
                ..Default::default()
            },
        )
        .await
        .unwrap();
    eventually(30, "serving", async || manager.served_at().is_some()).await;
    let addr = manager.served_at().unwrap();
    let path = "/debug/pprof/profile?seconds=5";

    assert_eq!(https_get_bytes(addr, path, None).await.0, 401);
    assert_eq!(https_get_bytes(addr, path, Some(&nobody)).await.0, 403);
    let taken = tokio::spawn({
        let profiler = profiler.clone();
        async move { https_get_bytes(addr, path, Some(&profiler)).await }
    });
    // One at a time: a second request while the first samples (for five seconds, from the
    // line that says it began) is refused.
    eventually(10, "the profile begun", async || {
        !logs.lines(&["taking a CPU profile"]).is_empty()
    })
    .await;
    assert_eq!(
        https_get_bytes(addr, "/debug/pprof/profile?seconds=1", Some(&profiler))
            .await
            .0,
        409
    );
    let (status, body) = taken.await.unwrap();
    assert_eq!(status, 200);
    let profile = pprof::protos::Profile::decode(body.as_slice()).unwrap();
    assert!(!profile.sample.is_empty(), "no samples");
    assert!(
        profile
            .string_table
            .iter()
            .any(|name| name.contains("busy_reconcile_marker")),
        "the reconcile's function is not named in the profile"
    );
    assert_eq!(
        https_get_bytes(addr, "/debug/pprof/profile?seconds=0", Some(&profiler))
            .await
            .0,
        400
    );

    manager.shutdown();
    run.await.unwrap();
}

#[tokio::test]
async fn the_serving_certificate_is_read_again_when_its_files_change() {
    let logs = Logs::capture();
    let env = TestEnv::start().await.unwrap();
    let admin = env.cluster(0).unwrap().client().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
    let write = |names: Vec<String>| {
        let rcgen::CertifiedKey {
            cert: made,
            signing_key,
        } = rcgen::generate_simple_self_signed(names).unwrap();
        // Replaced as a mounted Secret is: new files renamed over the old.
        std::fs::write(dir.path().join("tls.crt.new"), made.pem()).unwrap();
        std::fs::write(dir.path().join("tls.key.new"), signing_key.serialize_pem()).unwrap();
        std::fs::rename(dir.path().join("tls.key.new"), &key).unwrap();
        std::fs::rename(dir.path().join("tls.crt.new"), &cert).unwrap();
        made.der().to_vec()
    };
    let first = write(vec!["localhost".into(), "first.example".into()]);
    let manager = Arc::new(
        Manager::new(Clusters::<ClusterName>::new()).serve(
            multicluster_runtime::Endpoints::new("127.0.0.1:0".parse().unwrap())
                .tls_files(&cert, &key)
                .authorize_with(admin),
        ),
    );
    let run = spawn_manager(&manager);
    eventually(30, "serving", async || manager.served_at().is_some()).await;
    let addr = manager.served_at().unwrap();
    assert_eq!(https_get(addr, "/healthz", None).await.2, first);

    let second = write(vec!["localhost".into(), "second.example".into()]);
    eventually(30, "the new certificate served", async || {
        https_get(addr, "/healthz", None).await.2 == second
    })
    .await;
    // A broken replacement: the last good certificate stays. Sync point: the warning that
    // a handshake read the broken file.
    std::fs::write(&cert, "not a certificate").unwrap();
    eventually(30, "the broken certificate read and refused", async || {
        let (status, _, served) = https_get(addr, "/healthz", None).await;
        assert_eq!((status, served), (200, second.clone()));
        !logs
            .lines(&["WARN", "serving certificate cannot be used", "tls.crt"])
            .is_empty()
    })
    .await;
    let (status, _, served) = https_get(addr, "/healthz", None).await;
    assert_eq!((status, served), (200, second.clone()));

    manager.shutdown();
    run.await.unwrap();
}

#[tokio::test]
async fn https_endpoints_without_a_host_to_check_tokens_are_refused_at_start() {
    let manager = Manager::new(Clusters::<ClusterName>::new()).serve(
        multicluster_runtime::Endpoints::new("127.0.0.1:0".parse().unwrap()),
    );
    let error = manager.run().await.unwrap_err();
    assert!(
        matches!(error, multicluster_runtime::ManagerError::Endpoints(_)),
        "{error}"
    );
    let bad_files = Manager::new(Clusters::<ClusterName>::new()).serve(
        multicluster_runtime::Endpoints::new("127.0.0.1:0".parse().unwrap())
            .tls_files("/nonexistent/tls.crt", "/nonexistent/tls.key")
            .plain_http(),
    );
    // Plain HTTP needs neither (the files are not read).
    let bad_files = Arc::new(bad_files);
    let run = spawn_manager(&bad_files);
    eventually(30, "serving plain HTTP", async || {
        bad_files.served_at().is_some()
    })
    .await;
    bad_files.shutdown();
    run.await.unwrap();
}

#[tokio::test]
async fn readiness_waits_for_the_manager_and_its_host_not_for_a_member_still_listing_unless_strict()
{
    let env = TestEnv::builder().clusters(2).start().await.unwrap();
    let (host, frozen) = (env.cluster(0).unwrap(), env.cluster(1).unwrap());
    let admin = host.client().unwrap();
    // The member's apiserver is stopped (SIGSTOP): its listing hangs without an error.
    let paused = frozen.pause().unwrap();
    let member = |id: &str| Cluster::from_config(name(id), frozen.config()).unwrap();
    let serve = |strict: bool| {
        let clusters = Clusters::new();
        clusters
            .add(member(if strict { "frozen-strict" } else { "frozen" }))
            .unwrap();
        let manager = Arc::new(
            Manager::new(clusters)
                .with_local(Cluster::new(name("host"), admin.clone()))
                .serve(
                    multicluster_runtime::Endpoints::new("127.0.0.1:0".parse().unwrap())
                        .plain_http()
                        .strict(strict),
                ),
        );
        Builder::<_, ConfigMap>::new(&manager, watcher::Config::default())
            .engage_local(true)
            .start(
                |_, _: Context<ClusterName, ()>| async {
                    Ok::<_, kube::Error>(Action::await_change())
                },
                |_, _: &kube::Error, _: &Context<ClusterName, ()>| Action::await_change(),
                Arc::new(()),
            );
        manager
    };
    let (lenient, strict) = (serve(false), serve(true));
    let runs = [spawn_manager(&lenient), spawn_manager(&strict)];
    for manager in [&lenient, &strict] {
        eventually(30, "serving", async || manager.served_at().is_some()).await;
    }
    let (lenient_at, strict_at) = (lenient.served_at().unwrap(), strict.served_at().unwrap());
    // Sync point: the host has listed and the member's watch is listing (hung).
    for (addr, id) in [(lenient_at, "frozen"), (strict_at, "frozen-strict")] {
        eventually(30, "the host listed, the member listing", async || {
            let (_, detail) = http_get(addr, "/readyz?verbose").await;
            detail.contains("host host: ok")
                && detail.contains(&format!("cluster {id}: ConfigMap listing"))
        })
        .await;
    }
    assert_eq!(
        http_get(lenient_at, "/readyz").await.0,
        200,
        "one member still listing does not make the replica unready"
    );
    assert_eq!(
        http_get(strict_at, "/readyz").await.0,
        503,
        "strict: every member counts"
    );

    drop(paused);
    lenient.shutdown();
    strict.shutdown();
    for run in runs {
        run.await.unwrap();
    }
}

/// The host client of leader election is the user's own `kube::Client`, so its errors are
/// kube's, plugin output and all. A leader whose exec plugin starts failing loses the lease
/// at the renew deadline, and the reason it gives (the manager's error, the ERROR line) says
/// what failed in fixed words.
#[tokio::test]
async fn a_leader_whose_credential_plugin_fails_reports_the_loss_without_the_plugins_output() {
    use multicluster_runtime::{LeaderElection, LeaseTiming};
    let logs = Logs::capture();
    let env = TestEnv::start().await.unwrap();
    let tc = env.cluster(0).unwrap();
    let token = service_account_token(&tc, "lease-holder").await;
    let dir = tempfile::tempdir().unwrap();
    let host = kube::Client::try_from(refreshing_plugin(&tc, dir.path(), &token)).unwrap();
    let timing = LeaseTiming::default()
        .lease_duration(Duration::from_secs(4))
        .renew_deadline(Duration::from_secs(2))
        .retry_period(Duration::from_millis(500));
    let manager = Arc::new(
        Manager::new(multicluster_runtime::providers::Nop::<ClusterName>::new())
            .leader_election(LeaderElection::new(host, "default", "plugin-leader").timing(timing)),
    );
    let run = tokio::spawn({
        let manager = manager.clone();
        async move { manager.run().await }
    });
    tokio::time::timeout(Duration::from_secs(60), manager.elected())
        .await
        .expect("elected");

    std::fs::write(dir.path().join("fail"), "").unwrap();
    let result = tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .expect("the manager stops after losing the lease")
        .unwrap();
    let error = result.expect_err("leadership lost");
    let text = format!("{error} / {error:?}");
    assert!(
        matches!(
            error,
            multicluster_runtime::ManagerError::LeadershipLost { .. }
        ),
        "{text}"
    );
    assert!(
        dir.path().join("failed").exists(),
        "the plugin failed: {text}"
    );
    assert!(!text.contains(MARKER), "{text}");
    assert!(
        text.contains("exec credential plugin exited with status 1"),
        "what failed is said: {text}"
    );
    assert_eq!(logs.lines(&[MARKER]), Vec::<String>::new());
}

/// A kubeconfig user whose exec plugin answers `token`, expiring in 61 s, on its first run
/// (kube-client asks again a minute before expiry: from the next second on), and hangs on
/// every later run, touching `refreshing` in `dir`, for as long as `dir` exists.
fn plugin_hanging_on_refresh(tc: &TestCluster, dir: &std::path::Path, token: &str) -> kube::Config {
    use std::os::unix::fs::PermissionsExt;
    let plugin = dir.join("hanging.sh");
    std::fs::write(
        &plugin,
        format!(
            r#"#!/bin/sh
if [ ! -f '{dir}/answered' ]; then
  touch '{dir}/answered'
  expires=$(date -u -d '+61 seconds' +%Y-%m-%dT%H:%M:%SZ)
  printf '{{"apiVersion":"client.authentication.k8s.io/v1","kind":"ExecCredential","status":{{"token":"{token}","expirationTimestamp":"%s"}}}}' "$expires"
  exit 0
fi
touch '{dir}/refreshing'
while [ -d '{dir}' ]; do sleep 0.1; done
exit 1
"#,
            dir = dir.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&plugin, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut config = refreshing_plugin(tc, dir, token);
    let exec = config.auth_info.exec.as_mut().unwrap();
    (exec.command, exec.args, exec.env) = (Some(plugin.display().to_string()), None, None);
    config
}

/// `GET /healthz` over plain HTTP from a thread of its own (not through the runtime under
/// test, whose workers may be the ones stuck), answered within 1 s, as the kubelet probes.
fn probe_from_outside(addr: std::net::SocketAddr) -> Result<(), String> {
    use std::io::{Read, Write};
    std::thread::spawn(move || {
        let limit = Duration::from_secs(1);
        let mut stream =
            std::net::TcpStream::connect_timeout(&addr, limit).map_err(|e| e.to_string())?;
        stream
            .set_read_timeout(Some(limit))
            .map_err(|e| e.to_string())?;
        stream
            .set_write_timeout(Some(limit))
            .map_err(|e| e.to_string())?;
        stream
            .write_all(b"GET /healthz HTTP/1.1\r\nHost: kubelet\r\nConnection: close\r\n\r\n")
            .map_err(|e| e.to_string())?;
        let started = std::time::Instant::now();
        let mut answer = Vec::new();
        let read = stream.read_to_end(&mut answer);
        let answer = String::from_utf8_lossy(&answer).to_string();
        match read {
            Ok(_) if answer.starts_with("HTTP/1.1 200") && started.elapsed() <= limit => Ok(()),
            Ok(_) => Err(format!("answered {answer:?}")),
            Err(e) => Err(format!("no answer within 1 s ({e})")),
        }
    })
    .join()
    .unwrap()
}

/// Whether every path in `paths` exists, waited for up to `secs` on this thread (not through
/// the runtime's timers, which stop with its workers).
fn files_appear(paths: &[std::path::PathBuf], secs: u64) -> bool {
    let until = std::time::Instant::now() + Duration::from_secs(secs);
    while std::time::Instant::now() < until {
        if paths.iter().all(|p| p.exists()) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    false
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plugins_hanging_on_refresh_hold_no_async_worker_so_probes_answer_and_other_clusters_reconcile()
 {
    const WORKERS: usize = 2;
    let env = TestEnv::start().await.unwrap();
    let tc = env.cluster(0).unwrap();
    let admin = tc.client().unwrap();
    create_namespace(&admin, "hang").await;
    let token = service_account_token(&tc, "hanger").await;

    // (workers + 1) clusters whose plugin hangs from its second run on, and one without.
    let dirs: Vec<_> = (0..=WORKERS)
        .map(|_| tempfile::tempdir().unwrap())
        .collect();
    let clusters = Clusters::new();
    for (i, dir) in dirs.iter().enumerate() {
        let config = plugin_hanging_on_refresh(&tc, dir.path(), &token);
        clusters
            .add(Cluster::from_config(name(&format!("hangs-{i}")), config).unwrap())
            .unwrap();
    }
    clusters
        .add(Cluster::from_config(name("plain"), tc.config()).unwrap())
        .unwrap();
    let endpoints =
        multicluster_runtime::Endpoints::new("127.0.0.1:0".parse().unwrap()).plain_http();
    let manager = Arc::new(Manager::new(clusters).serve(endpoints));
    let reconciled: Arc<std::sync::Mutex<std::collections::BTreeSet<(String, String)>>> =
        Arc::default();
    // Each reconcile reads its object again through the cluster's client, twice a second.
    async fn read(
        cm: Arc<ConfigMap>,
        ctx: Context<ClusterName, std::sync::Mutex<std::collections::BTreeSet<(String, String)>>>,
    ) -> Result<Action, kube::Error> {
        let api: Api<ConfigMap> = Api::namespaced(ctx.client(), "hang");
        api.get(&cm.metadata.name.clone().unwrap_or_default())
            .await?;
        ctx.state().lock().unwrap().insert((
            ctx.cluster_id().to_string(),
            cm.metadata.name.clone().unwrap_or_default(),
        ));
        Ok(Action::requeue(Duration::from_millis(500)))
    }
    Builder::<_, ConfigMap>::new(&manager, watcher::Config::default())
        .named("hang")
        .start(
            read,
            |_, _: &kube::Error, _: &Context<ClusterName, _>| {
                Action::requeue(Duration::from_millis(500))
            },
            reconciled.clone(),
        );
    let cms: Api<ConfigMap> = Api::namespaced(admin.clone(), "hang");
    cms.create(
        &PostParams::default(),
        &config_map("hang", "before", "thing"),
    )
    .await
    .unwrap();
    let run = spawn_manager(&manager);
    eventually(60, "every cluster reconciled once", async || {
        reconciled.lock().unwrap().len() == WORKERS + 2
    })
    .await;
    let addr = manager.served_at().unwrap();

    // Sync point: as many plugins as there are workers hang in a refresh.
    let refreshing: Vec<_> = dirs.iter().map(|d| d.path().join("refreshing")).collect();
    assert!(
        files_appear(&refreshing[..WORKERS], 60),
        "the plugins were run again for a refresh"
    );
    for attempt in 0..3 {
        if let Err(why) = probe_from_outside(addr) {
            panic!("probe {attempt} while plugins hang: {why}");
        }
        std::thread::sleep(Duration::from_millis(300));
    }
    assert!(
        files_appear(&refreshing, 30),
        "every plugin hangs in a refresh"
    );
    // The cluster without a plugin reconciles a change meanwhile.
    cms.create(
        &PostParams::default(),
        &config_map("hang", "after", "thing"),
    )
    .await
    .unwrap();
    eventually(30, "the plain cluster reconciled the change", async || {
        reconciled
            .lock()
            .unwrap()
            .contains(&("plain".to_string(), "after".to_string()))
    })
    .await;
    probe_from_outside(addr).expect("a probe after the change");

    manager.shutdown();
    run.await.unwrap();
    drop(dirs);
}
