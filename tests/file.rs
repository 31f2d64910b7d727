//! The `File` provider on bad input, against real control planes: half-written files, one
//! bad context among good ones, retries that leave working contexts alone, rotated
//! certificate, key, CA and token files, files that would block a reader.
//!
//! Sync points: the provider reads every file of its sources in each pass, so once a file
//! written *after* a change (a sentinel, with a cluster of its own) is engaged, the pass
//! that engaged it has also read the change; a WARN naming a cluster shows its context was
//! handled.

mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use common::*;
use multicluster_runtime::providers::File;
use multicluster_runtime::{ClusterName, Manager};
use multicluster_runtime_testenv::{TestCluster, TestEnv};

fn id(file: &Path, context: &str) -> ClusterName {
    name(&File::default_name(file, context))
}

/// Writes `<dir>/sentinel-<n>.yaml` and waits until its cluster is engaged: the pass that
/// engaged it read every other file as it was before.
async fn sync_point(manager: &Manager<File>, dir: &Path, n: usize, kubeconfig: &str) {
    let path = dir.join(format!("sentinel-{n}.yaml"));
    std::fs::write(&path, kubeconfig).unwrap();
    let sentinel = id(&path, "cluster-0");
    eventually(30, &format!("sentinel {n} engaged"), async || {
        manager.cluster(&sentinel).is_some()
    })
    .await;
}

fn pem(base64_data: &str) -> String {
    String::from_utf8(
        base64::engine::general_purpose::STANDARD
            .decode(base64_data)
            .unwrap(),
    )
    .unwrap()
}

/// The admin user's certificate and key of `cluster`, in PEM.
fn admin_pem(cluster: &TestCluster) -> (String, String) {
    use secrecy::ExposeSecret;
    let auth = cluster.config().auth_info;
    (
        pem(auth.client_certificate_data.as_deref().unwrap()),
        pem(auth.client_key_data.as_ref().unwrap().expose_secret()),
    )
}

#[tokio::test]
async fn a_half_written_file_keeps_its_clusters_until_a_good_version_or_a_deliberate_removal() {
    let env = TestEnv::start().await.unwrap();
    let c0 = env.cluster(0).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let good = c0.kubeconfig();
    let a = dir.path().join("a.yaml");
    std::fs::write(&a, good).unwrap();
    let id_a = id(&a, "cluster-0");
    let manager = Arc::new(Manager::new(
        File::new([dir.path()]).retry(Duration::from_millis(200)),
    ));
    let run = spawn_manager(&manager);
    eventually(30, "a.yaml engaged", async || {
        manager.cluster(&id_a).is_some()
    })
    .await;
    let engaged = manager.cluster(&id_a).unwrap();

    let cut_before_contexts = &good[..good.find("contexts:").unwrap()];
    let half = &good[..good.len() / 2];
    let versions = [
        ("cut before contexts:", cut_before_contexts),
        ("empty", ""),
        ("half the bytes", half),
        ("cut inside the last line", &good[..good.len() - 4]),
        ("not YAML", "clusters: [ {"),
    ];
    for (n, (what, text)) in versions.into_iter().enumerate() {
        std::fs::write(&a, text).unwrap();
        sync_point(&manager, dir.path(), n, good).await;
        assert!(
            manager
                .cluster(&id_a)
                .is_some_and(|c| c.same_instance(&engaged)),
            "{what}: the last good cluster stays engaged"
        );
    }

    // An editor's non-atomic save: truncate, then write in two parts.
    std::fs::write(&a, "").unwrap();
    std::fs::write(&a, half).unwrap();
    std::fs::write(&a, good).unwrap();
    sync_point(&manager, dir.path(), 10, good).await;
    assert!(
        manager
            .cluster(&id_a)
            .is_some_and(|c| c.same_instance(&engaged)),
        "the same version again changes nothing"
    );

    // Deliberately empty: `contexts: []`.
    std::fs::write(&a, "apiVersion: v1\nkind: Config\ncontexts: []\n").unwrap();
    eventually(30, "a.yaml's cluster gone with contexts: []", async || {
        manager.cluster(&id_a).is_none()
    })
    .await;
    std::fs::write(&a, good).unwrap();
    eventually(30, "a.yaml engaged again", async || {
        manager.cluster(&id_a).is_some()
    })
    .await;
    // Deleted.
    std::fs::remove_file(&a).unwrap();
    eventually(30, "a.yaml's cluster gone with the file", async || {
        manager.cluster(&id_a).is_none()
    })
    .await;

    manager.shutdown();
    run.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_unusable_context_holds_up_no_other_and_a_named_file_appearing_is_seen() {
    let logs = Logs::capture();
    let env = TestEnv::start().await.unwrap();
    let c0 = env.cluster(0).unwrap();
    let config = c0.config();
    let (cert, key) = admin_pem(&c0);
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("elsewhere")).unwrap();
    // A FIFO named as a CA file: reading it would block until a writer comes (never).
    let fifo = dir.path().join("elsewhere/fifo");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap();
    assert!(made.success());
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
    let kubeconfig = format!(
        r#"apiVersion: v1
kind: Config
clusters:
- name: inline
  cluster: {{server: "{server}", certificate-authority-data: "{ca}"}}
- name: fifo
  cluster: {{server: "{server}", certificate-authority: elsewhere/fifo}}
- name: later
  cluster: {{server: "{server}", certificate-authority: elsewhere/ca.crt}}
users:
- name: admin
  user: {{client-certificate-data: "{cert}", client-key-data: "{key}"}}
- name: plugin
  user:
    exec: {{apiVersion: client.authentication.k8s.io/v1, command: /nonexistent/plugin, interactiveMode: Never}}
contexts:
- name: aa-fifo
  context: {{cluster: fifo, user: admin}}
- name: ab-ca-not-yet-there
  context: {{cluster: later, user: admin}}
- name: ac-ghost-user
  context: {{cluster: inline, user: ghost}}
- name: ad-missing-plugin
  context: {{cluster: inline, user: plugin}}
- name: zz-good
  context: {{cluster: inline, user: admin}}
"#,
        server = config.cluster_url,
        ca = b64(c0.ca_pem()),
        cert = b64(&cert),
        key = b64(&key),
    );
    let path = dir.path().join("fleet.yaml");
    std::fs::write(&path, kubeconfig).unwrap();
    // Retries an hour apart: what happens here is the watch's doing.
    let manager = Arc::new(Manager::new(
        File::new([&path]).retry(Duration::from_secs(3600)),
    ));
    let run = spawn_manager(&manager);

    let good = id(&path, "zz-good");
    eventually(30, "the good context engaged", async || {
        manager.cluster(&good).is_some()
    })
    .await;
    let bad = [
        "aa-fifo",
        "ab-ca-not-yet-there",
        "ac-ghost-user",
        "ad-missing-plugin",
    ];
    for context in bad {
        let bad_id = id(&path, context);
        eventually(30, &format!("{context} reported"), async || {
            !logs
                .lines(&["WARN", &format!("cluster={bad_id} "), "unusable"])
                .is_empty()
        })
        .await;
        assert!(manager.cluster(&bad_id).is_none(), "{context}");
    }
    for (context, says) in [
        (
            "aa-fifo",
            "certificate-authority: the file it names is not a regular file",
        ),
        (
            "ab-ca-not-yet-there",
            "certificate-authority: cannot read the file it names",
        ),
        ("ac-ghost-user", "the user the context names is not defined"),
        (
            "ad-missing-plugin",
            "the exec credential plugin cannot be started",
        ),
    ] {
        let bad_id = id(&path, context);
        assert_eq!(
            logs.lines(&["WARN", &format!("cluster={bad_id} "), says])
                .len(),
            1,
            "{context}: reported once, saying what is wrong"
        );
    }
    let good_client = manager.cluster(&good).unwrap().client();
    kube::Api::<k8s_openapi::api::core::v1::Namespace>::all(good_client)
        .list(&Default::default())
        .await
        .unwrap();

    // The CA file appears, in a directory of its own: seen through the watch.
    std::fs::write(dir.path().join("elsewhere/ca.crt"), c0.ca_pem()).unwrap();
    let later = id(&path, "ab-ca-not-yet-there");
    eventually(
        30,
        "the context engaged once its CA file exists",
        async || manager.cluster(&later).is_some(),
    )
    .await;

    manager.shutdown();
    run.await.unwrap();
}

#[tokio::test]
async fn a_failing_context_is_retried_without_running_the_working_ones_plugin_again() {
    use std::os::unix::fs::PermissionsExt;

    let logs = Logs::capture();
    let env = TestEnv::start().await.unwrap();
    let c0 = env.cluster(0).unwrap();
    let (cert, key) = admin_pem(&c0);
    let dir = tempfile::tempdir().unwrap();
    let counter = dir.path().join("runs");
    let credential = serde_json::json!({
        "apiVersion": "client.authentication.k8s.io/v1",
        "kind": "ExecCredential",
        "status": {"clientCertificateData": cert, "clientKeyData": key},
    });
    let plugin = dir.path().join("plugin.sh");
    std::fs::write(
        &plugin,
        format!(
            "#!/bin/sh\necho run >> '{}'\ncat <<'EOF'\n{credential}\nEOF\n",
            counter.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&plugin, std::fs::Permissions::from_mode(0o755)).unwrap();
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
    let kubeconfig = format!(
        r#"apiVersion: v1
kind: Config
clusters:
- name: inline
  cluster: {{server: "{server}", certificate-authority-data: "{ca}"}}
- name: broken
  cluster: {{server: "{server}", certificate-authority: /nonexistent/ca.crt}}
users:
- name: plugin
  user:
    exec:
      apiVersion: client.authentication.k8s.io/v1
      command: "{plugin}"
      interactiveMode: Never
      # Each variable is a map of its own when parsed: in no fixed order.
      env:
      - {{name: PLUGIN_REGION, value: east}}
      - {{name: PLUGIN_ROLE, value: reader}}
      - {{name: PLUGIN_TENANT, value: blue}}
contexts:
- name: a-plugin
  context: {{cluster: inline, user: plugin}}
- name: b-broken
  context: {{cluster: broken, user: plugin}}
"#,
        server = c0.config().cluster_url,
        ca = b64(c0.ca_pem()),
        plugin = plugin.display(),
    );
    let path = dir.path().join("fleet.yaml");
    std::fs::write(&path, kubeconfig).unwrap();
    let manager = Arc::new(Manager::new(
        File::new([&path]).retry(Duration::from_millis(100)),
    ));
    let run = spawn_manager(&manager);
    let working = id(&path, "a-plugin");
    eventually(30, "the plugin's context engaged", async || {
        manager.cluster(&working).is_some()
    })
    .await;
    let engaged = manager.cluster(&working).unwrap();
    kube::Api::<k8s_openapi::api::core::v1::Namespace>::all(engaged.client())
        .list(&Default::default())
        .await
        .expect("the plugin's credentials work");
    let runs = || std::fs::read_to_string(&counter).unwrap().lines().count();
    let before = runs();
    assert!(before >= 1);

    // Sync point: the broken context has been tried again three times.
    let broken = id(&path, "b-broken");
    eventually(30, "three retries of the broken context", async || {
        logs.lines(&[&format!("cluster={broken} "), "still unusable"])
            .len()
            >= 3
    })
    .await;
    assert_eq!(
        runs(),
        before,
        "the working context's plugin did not run again"
    );
    assert!(manager.cluster(&working).unwrap().same_instance(&engaged));
    assert_eq!(
        logs.lines(&["WARN", &format!("cluster={broken} ")]).len(),
        1,
        "one WARN for one unusable version, retries at DEBUG"
    );
    // Backoff: the waits between retries grow.
    let waits: Vec<String> = logs
        .lines(&[&format!("cluster={broken} "), "still unusable"])
        .iter()
        .filter_map(|l| l.split("next_in=").nth(1).map(|w| w.to_string()))
        .collect();
    assert!(
        waits.len() >= 3 && waits[0] != waits[2],
        "the waits grow: {waits:?}"
    );

    manager.shutdown();
    run.await.unwrap();
}

#[tokio::test]
async fn rotating_the_certificate_key_ca_and_token_files_a_kubeconfig_names_replaces_its_cluster() {
    use secrecy::ExposeSecret;

    let env = TestEnv::start().await.unwrap();
    let c0 = env.cluster(0).unwrap();
    let (cert, key) = admin_pem(&c0);
    let dir = tempfile::tempdir().unwrap();
    let certs = dir.path().join("certs");
    std::fs::create_dir(&certs).unwrap();
    // Atomic replacement, as a Secret volume or cert-manager does it.
    let put = |name: &str, data: &str| {
        let tmp = certs.join(format!(".{name}.tmp"));
        std::fs::write(&tmp, data).unwrap();
        std::fs::rename(&tmp, certs.join(name)).unwrap();
    };
    put("ca.crt", c0.ca_pem());
    put("tls.crt", &cert);
    put("tls.key", &key);
    put("token", "first-token\n");
    let kubeconfig = format!(
        r#"apiVersion: v1
kind: Config
clusters:
- name: c
  cluster: {{server: "{server}", certificate-authority: certs/ca.crt}}
users:
- name: u
  user: {{client-certificate: certs/tls.crt, client-key: certs/tls.key}}
- name: t
  user: {{tokenFile: certs/token}}
contexts:
- name: certs
  context: {{cluster: c, user: u}}
- name: token
  context: {{cluster: c, user: t}}
"#,
        server = c0.config().cluster_url,
    );
    let path = dir.path().join("fleet.yaml");
    std::fs::write(&path, kubeconfig).unwrap();
    let manager = Arc::new(Manager::new(
        File::new([&path]).retry(Duration::from_secs(3600)),
    ));
    let run = spawn_manager(&manager);
    let (by_certs, by_token) = (id(&path, "certs"), id(&path, "token"));
    eventually(30, "both contexts engaged", async || {
        manager.cluster(&by_certs).is_some() && manager.cluster(&by_token).is_some()
    })
    .await;
    let list = async |id: &ClusterName| {
        kube::Api::<k8s_openapi::api::core::v1::Namespace>::all(
            manager.cluster(id).unwrap().client(),
        )
        .list(&Default::default())
        .await
    };
    list(&by_certs).await.expect("the certificate files work");

    // New client certificate and key.
    let rotated = c0.add_user("rotated", &["system:masters"]).unwrap();
    let new_auth = rotated.config().auth_info;
    let new_cert = new_auth.client_certificate_data.clone().unwrap();
    put("tls.crt", &pem(&new_cert));
    put(
        "tls.key",
        &pem(new_auth.client_key_data.as_ref().unwrap().expose_secret()),
    );
    eventually(30, "replaced with the new certificate", async || {
        manager.cluster(&by_certs).and_then(|c| {
            c.config()
                .and_then(|c| c.auth_info.client_certificate_data.clone())
        }) == Some(new_cert.clone())
    })
    .await;
    list(&by_certs).await.expect("the new certificate works");

    // New CA bundle (the old CA and itself again: a rotation's first step).
    let bundle = format!("{}{}", c0.ca_pem(), c0.ca_pem());
    put("ca.crt", &bundle);
    eventually(30, "replaced with the new CA bundle", async || {
        manager
            .cluster(&by_certs)
            .and_then(|c| c.config().and_then(|c| c.root_cert.clone()))
            .is_some_and(|roots| roots.len() == 2)
    })
    .await;

    // New token.
    put("token", "second-token\n");
    eventually(30, "replaced with the new token", async || {
        manager.cluster(&by_token).and_then(|c| {
            c.config().and_then(|c| {
                c.auth_info
                    .token
                    .as_ref()
                    .map(|t| t.expose_secret().to_string())
            })
        }) == Some("second-token".to_string())
    })
    .await;

    manager.shutdown();
    run.await.unwrap();
}

#[tokio::test]
async fn a_file_whose_plugin_never_answers_holds_up_no_other_file() {
    use std::os::unix::fs::PermissionsExt;

    let env = TestEnv::start().await.unwrap();
    let c0 = env.cluster(0).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let plugins = tempfile::tempdir().unwrap();
    let started = plugins.path().join("started");
    // A plugin that never answers (it ends when the test's directory is removed).
    let plugin = plugins.path().join("plugin.sh");
    std::fs::write(
        &plugin,
        format!(
            "#!/bin/sh\ntouch '{s}'\nwhile [ -d '{d}' ]; do sleep 0.1; done\nexit 1\n",
            s = started.display(),
            d = plugins.path().display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&plugin, std::fs::Permissions::from_mode(0o755)).unwrap();
    let hanging = c0.kubeconfig().replace(
        "    client-certificate-data:",
        &format!(
            "    exec:\n      apiVersion: client.authentication.k8s.io/v1\n      command: {}\n      interactiveMode: Never\n    client-certificate-data:",
            plugin.display()
        ),
    );
    assert_ne!(hanging, c0.kubeconfig(), "the plugin is in the kubeconfig");
    std::fs::write(dir.path().join("a-hangs.yaml"), &hanging).unwrap();
    std::fs::write(dir.path().join("b-healthy.yaml"), c0.kubeconfig()).unwrap();

    let admin = c0.client().unwrap();
    create_namespace(&admin, "beside").await;
    kube::Api::<k8s_openapi::api::core::v1::ConfigMap>::namespaced(admin, "beside")
        .create(&Default::default(), &config_map("beside", "probe", "thing"))
        .await
        .unwrap();
    let manager = Arc::new(Manager::new(File::new([dir.path()])));
    let seen = Arc::new(Seen::default());
    multicluster_runtime::Builder::<_, k8s_openapi::api::core::v1::ConfigMap>::new(
        &manager,
        fixture_objects(),
    )
    .start(record, retry_soon, seen.clone());
    let run = spawn_manager(&manager);
    eventually(20, "the plugin started", async || started.exists()).await;
    // The healthy file's cluster is engaged while the other's plugin hangs (the build
    // timeout is 30 s), and a file written meanwhile is read and engaged too.
    let healthy = id(&dir.path().join("b-healthy.yaml"), "cluster-0");
    eventually(
        10,
        "the healthy cluster engaged beside the hanging one",
        async || manager.cluster(&healthy).is_some(),
    )
    .await;
    // It reconciles (the only cluster engaged holds the probe).
    eventually(10, "the healthy cluster reconciled", async || {
        seen.requests
            .lock()
            .unwrap()
            .iter()
            .any(|r| r.ends_with("/beside/probe"))
    })
    .await;
    let later = dir.path().join("c-later.yaml");
    std::fs::write(&later, c0.kubeconfig()).unwrap();
    eventually(10, "a file written meanwhile engaged", async || {
        manager.cluster(&id(&later, "cluster-0")).is_some()
    })
    .await;
    assert!(
        manager
            .cluster(&id(&dir.path().join("a-hangs.yaml"), "cluster-0"))
            .is_none()
    );

    manager.shutdown();
    run.await.unwrap();
    drop(plugins);
}
