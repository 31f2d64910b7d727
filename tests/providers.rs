//! Providers against real control planes: Multi composing children at run time, Nop.

mod common;

use std::sync::Arc;

use common::*;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, PostParams};
use multicluster_runtime::providers::{Clusters, Multi, Nop};
use multicluster_runtime::{Builder, Cluster, Manager};
use multicluster_runtime_testenv::TestEnv;

#[tokio::test]
async fn multi_composes_providers_added_and_removed_while_controllers_run() {
    let env = TestEnv::builder().clusters(2).start().await.unwrap();
    let (c0, c1) = (env.cluster(0).unwrap(), env.cluster(1).unwrap());
    fixture(&c0.client().unwrap()).await;
    fixture(&c1.client().unwrap()).await;

    let multi = Multi::new();
    let a = Clusters::new();
    a.add(Cluster::new(name("x"), c0.client().unwrap()))
        .unwrap();
    multi.add("a", a).unwrap();
    let b = Clusters::new();
    b.add(Cluster::new(name("x"), c1.client().unwrap()))
        .unwrap();
    multi.add("b", b).unwrap();

    let manager = Arc::new(Manager::new(multi.clone()));
    manager.index_field::<ConfigMap>("type", label_type);
    let seen = Arc::new(Seen::default());
    Builder::<_, ConfigMap>::new(&manager, fixture_objects()).start(
        feed_animals,
        retry_soon,
        seen.clone(),
    );
    let run = spawn_manager(&manager);

    let (client0, client1) = (c0.client().unwrap(), c1.client().unwrap());
    eventually(30, "animals fed through child a", async || {
        is_fed(&client0, "zoo", "elephant").await
    })
    .await;
    eventually(30, "animals fed through child b", async || {
        is_fed(&client1, "zoo", "elephant").await
    })
    .await;
    assert!(
        seen.count("cluster://a#x/zoo/elephant") >= 1
            && seen.count("cluster://b#x/zoo/elephant") >= 1
    );

    // The manager's index reaches the children's clusters, once each.
    let animals = async |id: &str| match manager.cluster(&name(id)) {
        Some(c) => Some(
            c.cache::<ConfigMap>(&fixture_objects())
                .await
                .unwrap()
                .indexed("type", "animal")
                .unwrap()
                .len(),
        ),
        None => None,
    };
    eventually(30, "indexed in b#x", async || {
        animals("b#x").await == Some(3)
    })
    .await;

    // A child added at run time: cluster-1 again, under another name.
    let c = Clusters::new();
    c.add(Cluster::new(name("z"), c1.client().unwrap()))
        .unwrap();
    multi.add("c", c).unwrap();
    eventually(30, "the new child's cluster reconciled", async || {
        seen.count("cluster://c#z/island/rock") >= 1
    })
    .await;

    // Removing child a lets its cluster go.
    assert!(multi.remove("a"));
    assert!(manager.cluster(&name("a#x")).is_none());
    Api::<ConfigMap>::namespaced(client0.clone(), "zoo")
        .create(&PostParams::default(), &config_map("zoo", "lion", "animal"))
        .await
        .unwrap();
    Api::<ConfigMap>::namespaced(client1.clone(), "zoo")
        .create(&PostParams::default(), &config_map("zoo", "lion", "animal"))
        .await
        .unwrap();
    eventually(30, "the lion of cluster-1 fed", async || {
        is_fed(&client1, "zoo", "lion").await
    })
    .await;
    // Sync point: cluster-0 under a new child sees the lion; the removed child never did.
    let d = Clusters::new();
    d.add(Cluster::new(name("x"), c0.client().unwrap()))
        .unwrap();
    multi.add("d", d).unwrap();
    eventually(
        30,
        "cluster-0's lion reconciled through child d",
        async || seen.count("cluster://d#x/zoo/lion") >= 1,
    )
    .await;
    assert_eq!(
        seen.count("cluster://a#x/zoo/lion"),
        0,
        "a removed child's cluster is not reconciled"
    );

    manager.shutdown();
    run.await.unwrap();
}

#[tokio::test]
async fn a_nop_manager_reconciles_only_its_local_cluster() {
    let env = TestEnv::start().await.unwrap();
    let c = env.cluster(0).unwrap();
    let client = c.client().unwrap();
    fixture(&client).await;
    let manager =
        Arc::new(Manager::new(Nop::new()).with_local(Cluster::new(name("host"), client.clone())));
    let seen = Arc::new(Seen::default());
    Builder::<_, ConfigMap>::new(&manager, fixture_objects())
        .engage_local(true)
        .start(feed_animals, retry_soon, seen.clone());
    let run = spawn_manager(&manager);
    eventually(30, "the local cluster's animals fed", async || {
        is_fed(&client, "jungle", "elephant").await
    })
    .await;
    assert!(manager.fleet().is_empty());
    assert_eq!(seen.clusters(), ["host".to_string()].into());
    manager.shutdown();
    run.await.unwrap();
}

/// A stand-in `kind` CLI: lists the files of `clusters/` next to it and prints one as a
/// kubeconfig, as `kind get clusters` and `kind get kubeconfig --name N` do.
const FAKE_KIND: &str = include_str!("../scripts/stand-in-kind.sh");

#[tokio::test]
async fn kind_clusters_come_and_go_with_the_cli_and_a_bad_one_holds_nobody_up() {
    use multicluster_runtime::providers::Kind;
    use std::os::unix::fs::PermissionsExt;
    use std::time::Duration;

    let env = TestEnv::builder().clusters(2).start().await.unwrap();
    let (c0, c1) = (env.cluster(0).unwrap(), env.cluster(1).unwrap());
    fixture(&c0.client().unwrap()).await;
    fixture(&c1.client().unwrap()).await;
    let bin = tempfile::tempdir().unwrap();
    let script = bin.path().join("kind");
    std::fs::write(&script, FAKE_KIND).unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    let dir = bin.path().join("clusters");
    std::fs::create_dir(&dir).unwrap();
    std::fs::write(dir.join("kind-a"), c0.kubeconfig()).unwrap();
    std::fs::write(dir.join("kind-b"), c1.kubeconfig()).unwrap();
    std::fs::write(dir.join("other"), c1.kubeconfig()).unwrap();

    let kind = Kind::new()
        .command(&script)
        .prefix("kind-")
        .interval(Duration::from_millis(200));
    let manager = Arc::new(Manager::new(kind));
    let seen = Arc::new(Seen::default());
    Builder::<_, ConfigMap>::new(&manager, fixture_objects()).start(
        feed_animals,
        retry_soon,
        seen.clone(),
    );
    let run = spawn_manager(&manager);
    let (client0, client1) = (c0.client().unwrap(), c1.client().unwrap());
    eventually(30, "kind-a fed", async || {
        is_fed(&client0, "zoo", "elephant").await
    })
    .await;
    eventually(30, "kind-b fed", async || {
        is_fed(&client1, "zoo", "elephant").await
    })
    .await;
    assert_eq!(
        manager.fleet().ids(),
        [name("kind-a"), name("kind-b")],
        "the prefix keeps `other` out"
    );

    // A malformed kubeconfig is reported and retried; the others go on. Sync point: a
    // cluster added after it, listed by the same CLI call, is engaged.
    std::fs::write(dir.join("kind-c"), "this: is: not a kubeconfig").unwrap();
    std::fs::write(dir.join("kind-d"), c0.kubeconfig()).unwrap();
    eventually(30, "kind-d engaged", async || {
        manager.cluster(&name("kind-d")).is_some()
    })
    .await;
    assert!(manager.cluster(&name("kind-c")).is_none());
    assert!(
        manager.cluster(&name("kind-a")).is_some() && manager.cluster(&name("kind-b")).is_some()
    );
    std::fs::write(dir.join("kind-c"), c1.kubeconfig()).unwrap();
    eventually(70, "kind-c engaged once fixed", async || {
        manager.cluster(&name("kind-c")).is_some()
    })
    .await;

    // Gone from the CLI: disengaged.
    std::fs::remove_file(dir.join("kind-b")).unwrap();
    eventually(10, "kind-b disengaged", async || {
        manager.cluster(&name("kind-b")).is_none()
    })
    .await;

    // New credentials for kind-a: replaced, and the controller goes on through them.
    let rotated = c0.add_user("rotated", &["system:masters"]).unwrap();
    std::fs::write(dir.join("kind-a"), rotated.kubeconfig()).unwrap();
    let expected = rotated.config().auth_info.client_certificate_data;
    eventually(10, "kind-a replaced", async || {
        manager.cluster(&name("kind-a")).and_then(|c| {
            c.config()
                .map(|c| c.auth_info.client_certificate_data.clone())
        }) == Some(expected.clone())
    })
    .await;
    Api::<ConfigMap>::namespaced(client0.clone(), "zoo")
        .create(&PostParams::default(), &config_map("zoo", "lion", "animal"))
        .await
        .unwrap();
    eventually(30, "the lion fed through the new credentials", async || {
        is_fed(&client0, "zoo", "lion").await
    })
    .await;

    manager.shutdown();
    run.await.unwrap();
}

#[tokio::test]
async fn kubeconfig_files_are_hot_reloaded_and_a_malformed_one_stops_nobody() {
    use multicluster_runtime::providers::File;
    use std::time::Duration;

    let env = TestEnv::builder().clusters(2).start().await.unwrap();
    let (c0, c1) = (env.cluster(0).unwrap(), env.cluster(1).unwrap());
    fixture(&c0.client().unwrap()).await;
    fixture(&c1.client().unwrap()).await;
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a.yaml");
    let b = dir.path().join("b.yaml");
    std::fs::write(&a, c0.kubeconfig()).unwrap();
    let id_a = name(&format!("{}+cluster-0", a.display()));
    let id_b = name(&format!("{}+cluster-1", b.display()));

    let manager = Arc::new(Manager::new(
        File::new([dir.path()]).retry(Duration::from_millis(300)),
    ));
    let seen = Arc::new(Seen::default());
    Builder::<_, ConfigMap>::new(&manager, fixture_objects()).start(
        feed_animals,
        retry_soon,
        seen.clone(),
    );
    let run = spawn_manager(&manager);
    let (client0, client1) = (c0.client().unwrap(), c1.client().unwrap());
    eventually(30, "a.yaml's cluster fed", async || {
        is_fed(&client0, "zoo", "elephant").await
    })
    .await;
    assert_eq!(manager.fleet().ids(), std::slice::from_ref(&id_a));

    // A new file: a new cluster.
    std::fs::write(&b, c1.kubeconfig()).unwrap();
    eventually(30, "b.yaml's cluster fed", async || {
        is_fed(&client1, "zoo", "elephant").await
    })
    .await;
    assert!(manager.cluster(&id_b).is_some());

    // Half-written: reported, retried; the others run on. Sync point: a file written
    // after it is read in the same pass or a later one.
    let c = dir.path().join("c.yaml");
    std::fs::write(&c, "apiVersion: v1\nkind: Config\nclusters: [ {").unwrap();
    let s1 = dir.path().join("s1.yaml");
    std::fs::write(&s1, c1.kubeconfig()).unwrap();
    let id_s1 = name(&format!("{}+cluster-1", s1.display()));
    eventually(30, "s1.yaml engaged", async || {
        manager.cluster(&id_s1).is_some()
    })
    .await;
    assert!(manager.cluster(&id_a).is_some() && manager.cluster(&id_b).is_some());
    assert!(
        manager
            .cluster(&name(&format!("{}+cluster-1", c.display())))
            .is_none()
    );
    std::fs::write(&c, c1.kubeconfig()).unwrap();
    let id_c = name(&format!("{}+cluster-1", c.display()));
    eventually(30, "c.yaml's cluster once complete", async || {
        manager.cluster(&id_c).is_some()
    })
    .await;

    // Rewritten with the same endpoint and credentials: the cluster stays as it is.
    let before = manager.cluster(&id_a).unwrap();
    std::fs::write(&a, format!("{}\n# touched\n", c0.kubeconfig())).unwrap();
    let s2 = dir.path().join("s2.yaml");
    std::fs::write(&s2, c1.kubeconfig()).unwrap();
    let id_s2 = name(&format!("{}+cluster-1", s2.display()));
    eventually(30, "s2.yaml engaged", async || {
        manager.cluster(&id_s2).is_some()
    })
    .await;
    assert!(
        manager.cluster(&id_a).unwrap().same_instance(&before),
        "no replacement without a change"
    );

    // Replaced atomically with new credentials: the cluster is replaced and used.
    let rotated = c0.add_user("rotated", &["system:masters"]).unwrap();
    let tmp = dir.path().join(".a.yaml.tmp");
    // Same context name (testenv names a user's context `user@cluster`), new credentials.
    std::fs::write(
        &tmp,
        rotated
            .kubeconfig()
            .replace("rotated@cluster-0", "cluster-0"),
    )
    .unwrap();
    std::fs::rename(&tmp, &a).unwrap();
    let expected = rotated.config().auth_info.client_certificate_data;
    eventually(30, "a.yaml's cluster replaced", async || {
        manager.cluster(&id_a).and_then(|c| {
            c.config()
                .map(|c| c.auth_info.client_certificate_data.clone())
        }) == Some(expected.clone())
    })
    .await;
    Api::<ConfigMap>::namespaced(client0.clone(), "zoo")
        .create(&PostParams::default(), &config_map("zoo", "lion", "animal"))
        .await
        .unwrap();
    eventually(30, "the lion fed through the new credentials", async || {
        is_fed(&client0, "zoo", "lion").await
    })
    .await;

    // Deleted: its cluster is disengaged.
    std::fs::remove_file(&b).unwrap();
    eventually(30, "b.yaml's cluster gone", async || {
        manager.cluster(&id_b).is_none()
    })
    .await;
    assert_eq!(manager.fleet().ids().len(), 4, "a, c, s1 and s2 stay");

    manager.shutdown();
    run.await.unwrap();
}

#[tokio::test]
async fn kubeconfig_secrets_engage_update_and_disengage_and_never_run_exec_plugins() {
    use k8s_openapi::api::core::v1::{Namespace, Secret};
    use kube::api::{Patch, PatchParams};
    use multicluster_runtime::providers::KubeconfigSecrets;

    let env = TestEnv::builder().clusters(3).start().await.unwrap();
    let (host, c1, c2) = (
        env.cluster(0).unwrap(),
        env.cluster(1).unwrap(),
        env.cluster(2).unwrap(),
    );
    fixture(&c1.client().unwrap()).await;
    fixture(&c2.client().unwrap()).await;
    let hc = host.client().unwrap();
    let ns = Namespace {
        metadata: kube::api::ObjectMeta {
            name: Some("fleet".into()),
            ..Default::default()
        },
        ..Default::default()
    };
    Api::<Namespace>::all(hc.clone())
        .create(&PostParams::default(), &ns)
        .await
        .unwrap();
    let secrets: Api<Secret> = Api::namespaced(hc.clone(), "fleet");
    let pp = PostParams::default();
    secrets
        .create(&pp, &kubeconfig_secret("east", c1.kubeconfig(), true))
        .await
        .unwrap();
    secrets
        .create(&pp, &kubeconfig_secret("west", c2.kubeconfig(), true))
        .await
        .unwrap();
    secrets
        .create(
            &pp,
            &kubeconfig_secret("unlabelled", c1.kubeconfig(), false),
        )
        .await
        .unwrap();

    let manager = Arc::new(Manager::new(KubeconfigSecrets::new(hc.clone(), "fleet")));
    let seen = Arc::new(Seen::default());
    Builder::<_, ConfigMap>::new(&manager, fixture_objects()).start(
        feed_animals,
        retry_soon,
        seen.clone(),
    );
    let run = spawn_manager(&manager);
    let (client1, client2) = (c1.client().unwrap(), c2.client().unwrap());
    eventually(30, "east fed", async || {
        is_fed(&client1, "zoo", "elephant").await
    })
    .await;
    eventually(30, "west fed", async || {
        is_fed(&client2, "zoo", "elephant").await
    })
    .await;
    assert_eq!(manager.fleet().ids(), [name("east"), name("west")]);

    // An exec plugin in a Secret's kubeconfig would run code in the controller: refused.
    let marker = tempfile::tempdir().unwrap().keep().join("exec-ran");
    let evil = c1.kubeconfig().replace(
        "    client-certificate-data:",
        &format!(
            "    exec:\n      apiVersion: client.authentication.k8s.io/v1\n      command: /bin/sh\n      args: [\"-c\", \"touch {}\"]\n      interactiveMode: Never\n    client-certificate-data:",
            marker.display()
        ),
    );
    assert!(evil.contains("exec:"));
    secrets
        .create(&pp, &kubeconfig_secret("evil", &evil, true))
        .await
        .unwrap();
    secrets
        .create(&pp, &kubeconfig_secret("broken", "clusters: [ {", true))
        .await
        .unwrap();
    // A token file would have the controller send its own credentials to the Secret's
    // server: refused too.
    let leaky = c1.kubeconfig().replace(
        "    client-certificate-data:",
        "    tokenFile: /var/run/secrets/kubernetes.io/serviceaccount/token\n    client-certificate-data:",
    );
    assert!(leaky.contains("tokenFile"));
    secrets
        .create(&pp, &kubeconfig_secret("leaky", &leaky, true))
        .await
        .unwrap();
    eventually(30, "a Warning Event on the refused Secret", async || {
        has_event(&hc, "fleet", "KubeconfigRefused", "evil", "exec").await
    })
    .await;
    eventually(30, "a Warning Event naming the token file", async || {
        has_event(&hc, "fleet", "KubeconfigRefused", "leaky", "tokenFile").await
    })
    .await;
    // Sync point: the three Secrets have been handled.
    eventually(30, "a Warning Event on the malformed Secret", async || {
        has_event(&hc, "fleet", "KubeconfigRefused", "broken", "line").await
    })
    .await;
    assert!(manager.cluster(&name("evil")).is_none() && manager.cluster(&name("broken")).is_none());
    assert!(manager.cluster(&name("leaky")).is_none());
    assert!(!marker.exists(), "the exec plugin must never run");
    assert_eq!(manager.fleet().len(), 2, "the others are unaffected");

    // New credentials in east: the cluster is replaced.
    let rotated = c1.add_user("rotated", &["system:masters"]).unwrap();
    let rotated_yaml = rotated
        .kubeconfig()
        .replace("rotated@cluster-1", "cluster-1");
    secrets
        .replace("east", &pp, &kubeconfig_secret("east", &rotated_yaml, true))
        .await
        .unwrap();
    let expected = rotated.config().auth_info.client_certificate_data;
    eventually(30, "east replaced", async || {
        manager.cluster(&name("east")).and_then(|c| {
            c.config()
                .map(|c| c.auth_info.client_certificate_data.clone())
        }) == Some(expected.clone())
    })
    .await;

    // Label removed: disengaged. Secret deleted: disengaged.
    let unlabel = serde_json::json!({ "metadata": { "labels": { "sigs.k8s.io/multicluster-runtime-kubeconfig": null } } });
    secrets
        .patch("west", &PatchParams::default(), &Patch::Merge(&unlabel))
        .await
        .unwrap();
    eventually(30, "west disengaged", async || {
        manager.cluster(&name("west")).is_none()
    })
    .await;
    secrets.delete("east", &Default::default()).await.unwrap();
    eventually(30, "east disengaged", async || {
        manager.cluster(&name("east")).is_none()
    })
    .await;
    assert!(manager.fleet().is_empty());

    manager.shutdown();
    run.await.unwrap();
}

/// Kubeconfigs that break on a line holding a secret (marked `mcr-marker-…`), in YAML and
/// JSON: where the parser trips over it, as a value of the wrong type, as bad base64 and
/// as an exec command line.
fn kubeconfigs_with_planted_secrets(good: &str) -> Vec<(&'static str, String)> {
    let insert = |line: &str| {
        let out = good.replacen(
            "    client-certificate-data:",
            &format!("{line}\n    client-certificate-data:"),
            1,
        );
        assert_ne!(out, good);
        out
    };
    vec![
        ("m-yaml-syntax", insert("    token: \"mcr-marker-unterminated")),
        (
            "m-yaml-type",
            "apiVersion: v1\nkind: Config\nusers: mcr-marker-not-a-list\n".to_string(),
        ),
        (
            "m-json-syntax",
            r#"{"apiVersion": "v1", "kind": "Config", "users": [{"name": "u", "user": {"token": "mcr-marker-json" "x"}}]}"#
                .to_string(),
        ),
        (
            "m-json-type",
            r#"{"apiVersion": "v1", "kind": "Config", "contexts": "mcr-marker-json-value"}"#
                .to_string(),
        ),
        ("m-base64", {
            let start = good.find("client-key-data: ").unwrap() + "client-key-data: ".len();
            let end = start + good[start..].find('\n').unwrap();
            format!("{}mcr-marker-b64!{}", &good[..start], &good[end..])
        }),
        (
            "m-exec",
            insert(
                "    exec:\n      apiVersion: client.authentication.k8s.io/v1\n      command: /nonexistent/mcr-marker-command\n      args: [\"mcr-marker-arg\"]\n      interactiveMode: Never",
            ),
        ),
    ]
}

async fn no_event_holds(client: &kube::Client, ns: &str, marker: &str) {
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(client.clone(), ns);
    for event in events.list(&Default::default()).await.unwrap() {
        let text = serde_json::to_string(&event).unwrap();
        assert!(!text.contains(marker), "an Event holds a secret: {text}");
    }
}

#[tokio::test]
async fn a_broken_kubeconfig_secret_leaves_no_byte_in_logs_or_events() {
    use k8s_openapi::api::core::v1::Secret;
    use multicluster_runtime::providers::KubeconfigSecrets;

    let logs = Logs::capture();
    let env = TestEnv::start().await.unwrap();
    let host = env.cluster(0).unwrap();
    let hc = host.client().unwrap();
    create_namespace(&hc, "leaks").await;
    let secrets: Api<Secret> = Api::namespaced(hc.clone(), "leaks");
    let planted = kubeconfigs_with_planted_secrets(host.kubeconfig());
    for (name, kubeconfig) in &planted {
        secrets
            .create(
                &PostParams::default(),
                &kubeconfig_secret(name, kubeconfig, true),
            )
            .await
            .unwrap();
    }
    let manager = Arc::new(Manager::new(
        KubeconfigSecrets::new(hc.clone(), "leaks").allow_exec(true),
    ));
    let run = spawn_manager(&manager);
    // Sync point: every Secret has been read and refused.
    for (secret, _) in &planted {
        eventually(30, &format!("{secret} refused"), async || {
            has_event(&hc, "leaks", "KubeconfigRefused", secret, "").await
        })
        .await;
        assert!(manager.cluster(&name(secret)).is_none());
        assert!(
            !logs
                .lines(&["WARN", &format!("cluster={secret} ")])
                .is_empty(),
            "{secret}'s problem is logged"
        );
    }
    no_event_holds(&hc, "leaks", "mcr-marker").await;
    assert_eq!(logs.lines(&["mcr-marker"]), Vec::<String>::new());
    manager.shutdown();
    run.await.unwrap();
}

#[tokio::test]
async fn a_broken_kubeconfig_file_leaves_no_byte_in_logs() {
    use multicluster_runtime::providers::File;

    let logs = Logs::capture();
    let env = TestEnv::start().await.unwrap();
    let c0 = env.cluster(0).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let planted = kubeconfigs_with_planted_secrets(c0.kubeconfig());
    for (file, kubeconfig) in &planted {
        std::fs::write(dir.path().join(format!("{file}.yaml")), kubeconfig).unwrap();
    }
    let manager = Arc::new(Manager::new(File::new([dir.path()])));
    let run = spawn_manager(&manager);
    // Sync point: every file's problem has been logged.
    for (file, _) in &planted {
        let file = format!("{file}.yaml");
        eventually(30, &format!("{file} reported"), async || {
            !logs.lines(&["WARN", &file]).is_empty()
        })
        .await;
    }
    assert!(manager.fleet().is_empty());
    assert_eq!(logs.lines(&["mcr-marker"]), Vec::<String>::new());
    manager.shutdown();
    run.await.unwrap();
}

#[tokio::test]
async fn kubeconfig_secrets_build_side_by_side_so_a_hanging_plugin_delays_no_other() {
    use k8s_openapi::api::core::v1::Secret;
    use multicluster_runtime::providers::KubeconfigSecrets;
    use std::os::unix::fs::PermissionsExt;

    let env = TestEnv::builder().clusters(2).start().await.unwrap();
    let (host, c1) = (env.cluster(0).unwrap(), env.cluster(1).unwrap());
    let hc = host.client().unwrap();
    create_namespace(&hc, "side").await;
    let secrets: Api<Secret> = Api::namespaced(hc.clone(), "side");
    let pp = PostParams::default();

    // A credential plugin that hangs until the test lets it go.
    let dir = tempfile::tempdir().unwrap();
    let (started, release) = (dir.path().join("started"), dir.path().join("release"));
    let plugin = dir.path().join("plugin.sh");
    std::fs::write(
        &plugin,
        format!(
            // It also ends when the test's directory is removed.
            "#!/bin/sh\ntouch '{s}'\nwhile [ -f '{s}' ] && [ ! -f '{r}' ]; do sleep 0.05; done\nexit 1\n",
            s = started.display(),
            r = release.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&plugin, std::fs::Permissions::from_mode(0o755)).unwrap();
    // Whatever happens, the plugin ends with the test (the runtime waits for its thread).
    struct Release(std::path::PathBuf);
    impl Drop for Release {
        fn drop(&mut self) {
            let _ = std::fs::write(&self.0, "");
        }
    }
    let _release = Release(release.clone());
    let slow = c1.kubeconfig().replace(
        "    client-certificate-data:",
        &format!(
            "    exec:\n      apiVersion: client.authentication.k8s.io/v1\n      command: {}\n      interactiveMode: Never\n    client-certificate-data:",
            plugin.display()
        ),
    );
    secrets
        .create(&pp, &kubeconfig_secret("slow", &slow, true))
        .await
        .unwrap();
    let manager = Arc::new(Manager::new(
        KubeconfigSecrets::new(hc.clone(), "side").allow_exec(true),
    ));
    let run = spawn_manager(&manager);
    eventually(30, "the slow plugin started", async || started.exists()).await;

    // While it hangs, another Secret's cluster is built and engaged.
    secrets
        .create(&pp, &kubeconfig_secret("fast", c1.kubeconfig(), true))
        .await
        .unwrap();
    eventually(20, "fast engaged while slow still builds", async || {
        manager.cluster(&name("fast")).is_some()
    })
    .await;
    assert!(!release.exists() && manager.cluster(&name("slow")).is_none());
    std::fs::write(&release, "").unwrap();
    eventually(40, "slow refused once its plugin failed", async || {
        has_event(
            &hc,
            "side",
            "KubeconfigRefused",
            "slow",
            "exited with status 1",
        )
        .await
    })
    .await;

    manager.shutdown();
    run.await.unwrap();
}

#[tokio::test]
async fn kubeconfig_secrets_refuse_each_content_once() {
    use k8s_openapi::api::core::v1::Secret;
    use kube::api::{Patch, PatchParams};
    use multicluster_runtime::providers::KubeconfigSecrets;

    let logs = Logs::capture();
    let env = TestEnv::start().await.unwrap();
    let hc = env.cluster(0).unwrap().client().unwrap();
    create_namespace(&hc, "once").await;
    let secrets: Api<Secret> = Api::namespaced(hc.clone(), "once");
    let pp = PostParams::default();
    secrets
        .create(&pp, &kubeconfig_secret("garbled", "clusters: [ {", true))
        .await
        .unwrap();
    let manager = Arc::new(Manager::new(KubeconfigSecrets::new(hc.clone(), "once")));
    let run = spawn_manager(&manager);
    // The garbled Secret is refused once; a change to another field is no new content.
    eventually(30, "garbled refused", async || {
        has_event(&hc, "once", "KubeconfigRefused", "garbled", "line 1").await
    })
    .await;
    let touch = serde_json::json!({ "metadata": { "annotations": { "touched": "yes" } } });
    secrets
        .patch("garbled", &PatchParams::default(), &Patch::Merge(&touch))
        .await
        .unwrap();
    // Sync point: a Secret written after that patch has been handled (one watch, in order).
    secrets
        .create(&pp, &kubeconfig_secret("after", "users: [ {", true))
        .await
        .unwrap();
    eventually(30, "after refused", async || {
        has_event(&hc, "once", "KubeconfigRefused", "after", "line 1").await
    })
    .await;
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(hc.clone(), "once");
    let about_garbled: Vec<_> = events
        .list(&Default::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("garbled"))
        .collect();
    assert_eq!(about_garbled.len(), 1, "{about_garbled:?}");
    assert!(
        about_garbled[0].series.is_none(),
        "recorded once, not as a series: {:?}",
        about_garbled[0].series
    );
    assert_eq!(
        logs.lines(&["WARN", "cluster=garbled ", "refused"]).len(),
        1,
        "logged once"
    );

    manager.shutdown();
    run.await.unwrap();
}

#[tokio::test]
async fn a_kubeconfig_secrets_token_about_to_expire_is_said_ahead_of_time() {
    use k8s_openapi::api::core::v1::Secret;
    use multicluster_runtime::providers::KubeconfigSecrets;
    let env = TestEnv::builder().clusters(2).start().await.unwrap();
    let (host, member) = (env.cluster(0).unwrap(), env.cluster(1).unwrap());
    let hc = host.client().unwrap();
    create_namespace(&hc, "expiring").await;
    let secrets: Api<Secret> = Api::namespaced(hc.clone(), "expiring");
    let in_days = |days: i64| {
        let at = k8s_openapi::jiff::Timestamp::now()
            + k8s_openapi::jiff::SignedDuration::from_hours(24 * days);
        serde_json::to_value(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(at))
            .unwrap()
            .as_str()
            .unwrap()
            .to_string()
    };
    // Listed in name order: a-later's expiry is looked at before b-soon's.
    for (name, days) in [("a-later", 100), ("b-soon", 10)] {
        let mut secret = kubeconfig_secret(name, member.kubeconfig(), true);
        secret.metadata.annotations = Some(
            [(
                "multicluster-runtime.sigs.k8s.io/token-expires".to_string(),
                in_days(days),
            )]
            .into(),
        );
        secrets
            .create(&PostParams::default(), &secret)
            .await
            .unwrap();
    }
    // Warned 30 days ahead: b-soon is within, a-later is not.
    let mut registry = prometheus_client::registry::Registry::default();
    let metrics = multicluster_runtime::Metrics::new(&mut registry);
    let manager = Arc::new(
        Manager::new(KubeconfigSecrets::new(hc.clone(), "expiring"))
            .metrics(metrics)
            .credential_warning(std::time::Duration::from_secs(30 * 24 * 3600)),
    );
    let run = spawn_manager(&manager);
    let shown = |cluster: &str| {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        sample(
            &text,
            "multicluster_runtime_credential_expiry_seconds",
            &[("cluster", cluster), ("source", "annotation")],
        )
        .is_some()
    };
    // Sync point: both ends are in the gauge, so both were weighed (the Event of a
    // credential within the lead is recorded before the gauge is set).
    eventually(30, "the coming end said on b-soon", async || {
        shown("a-later")
            && shown("b-soon")
            && has_event(
                &hc,
                "expiring",
                "CredentialExpiring",
                "b-soon",
                "cluster b-soon ends in",
            )
            .await
    })
    .await;
    assert!(!has_event(&hc, "expiring", "CredentialExpiring", "a-later", "").await);
    manager.shutdown();
    run.await.unwrap();
}

/// Whether `pid` is a process that has not ended (a zombie has ended).
fn alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| {
            let state = stat
                .rsplit_once(')')?
                .1
                .split_whitespace()
                .next()?
                .to_string();
            Some(state != "Z" && state != "X")
        })
        .unwrap_or(false)
}

#[tokio::test]
async fn a_secret_changed_while_its_plugin_hangs_never_has_two_plugins_running() {
    use k8s_openapi::api::core::v1::Secret;
    use kube::api::{Patch, PatchParams};
    use multicluster_runtime::providers::KubeconfigSecrets;
    use std::os::unix::fs::PermissionsExt;

    let env = TestEnv::builder().clusters(2).start().await.unwrap();
    let (host, c1) = (env.cluster(0).unwrap(), env.cluster(1).unwrap());
    let hc = host.client().unwrap();
    create_namespace(&hc, "again").await;
    let secrets: Api<Secret> = Api::namespaced(hc.clone(), "again");

    // A plugin that writes its pid and hangs (it ends when the test's directory goes).
    let dir = tempfile::tempdir().unwrap();
    let pids = dir.path().join("pids");
    let plugin = dir.path().join("plugin.sh");
    std::fs::write(
        &plugin,
        format!(
            "#!/bin/sh\necho $$ >> '{p}'\nwhile [ -d '{d}' ]; do sleep 0.1; done\nexit 1\n",
            p = pids.display(),
            d = dir.path().display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&plugin, std::fs::Permissions::from_mode(0o755)).unwrap();
    let kubeconfig = |version: &str| {
        c1.kubeconfig().replace(
            "    client-certificate-data:",
            &format!(
                "    exec:\n      apiVersion: client.authentication.k8s.io/v1\n      command: {}\n      args: [\"{version}\"]\n      interactiveMode: Never\n    client-certificate-data:",
                plugin.display()
            ),
        )
    };
    let started = || -> Vec<i32> {
        std::fs::read_to_string(&pids)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect()
    };
    secrets
        .create(
            &PostParams::default(),
            &kubeconfig_secret("hangs", &kubeconfig("v1"), true),
        )
        .await
        .unwrap();
    let manager = Arc::new(Manager::new(
        KubeconfigSecrets::new(hc.clone(), "again").allow_exec(true),
    ));
    let run = spawn_manager(&manager);
    eventually(30, "the first plugin started", async || {
        started().len() == 1
    })
    .await;

    // A new version of the Secret while the first plugin hangs: its build replaces the
    // first, whose plugin is ended.
    for (n, version) in [(2, "v2"), (3, "v3")] {
        let data = std::collections::BTreeMap::from([(
            "kubeconfig".to_string(),
            k8s_openapi::ByteString(kubeconfig(version).into_bytes()),
        )]);
        secrets
            .patch(
                "hangs",
                &PatchParams::default(),
                &Patch::Merge(serde_json::json!({ "data": data })),
            )
            .await
            .unwrap();
        eventually(30, &format!("plugin {n} started"), async || {
            started().len() == n
        })
        .await;
        eventually(10, "the plugins before it ended", async || {
            started().iter().filter(|pid| alive(**pid)).count() == 1
        })
        .await;
        assert!(alive(*started().last().unwrap()), "the newest plugin runs");
    }

    manager.shutdown();
    run.await.unwrap();
    drop(dir);
}

/// The value of `key` in a kubeconfig's YAML (the first one).
fn kubeconfig_field(kubeconfig: &str, key: &str) -> String {
    let prefix = format!("{key}: ");
    kubeconfig
        .lines()
        .find_map(|line| line.trim().strip_prefix(&prefix))
        .unwrap_or_else(|| panic!("no {key} in the kubeconfig"))
        .to_string()
}

/// An Argo CD Secret of `kind` (`cluster`, `repository`) in its documented shape, with the
/// keys Argo CD writes that the provider does not read.
fn argo_secret(
    name: &str,
    kind: &str,
    server: &str,
    config: &str,
) -> k8s_openapi::api::core::v1::Secret {
    use std::collections::BTreeMap;
    k8s_openapi::api::core::v1::Secret {
        metadata: kube::api::ObjectMeta {
            name: Some(name.into()),
            labels: Some(BTreeMap::from([(
                "argocd.argoproj.io/secret-type".to_string(),
                kind.to_string(),
            )])),
            ..Default::default()
        },
        type_: Some("Opaque".into()),
        string_data: Some(BTreeMap::from([
            ("name".to_string(), format!("{name}.example")),
            ("server".to_string(), server.to_string()),
            ("config".to_string(), config.to_string()),
            ("project".to_string(), "default".to_string()),
            ("namespaces".to_string(), "zoo".to_string()),
        ])),
        ..Default::default()
    }
}

#[tokio::test]
async fn argo_cd_cluster_secrets_engage_follow_changes_and_refuse_commands_and_garbage() {
    use k8s_openapi::api::core::v1::Secret;
    use kube::api::{Patch, PatchParams};
    use multicluster_runtime::providers::ArgoCdClusters;
    use std::os::unix::fs::PermissionsExt;

    let logs = Logs::capture();
    let env = TestEnv::builder().clusters(3).start().await.unwrap();
    let (host, c1, c2) = (
        env.cluster(0).unwrap(),
        env.cluster(1).unwrap(),
        env.cluster(2).unwrap(),
    );
    fixture(&c1.client().unwrap()).await;
    fixture(&c2.client().unwrap()).await;
    let hc = host.client().unwrap();
    create_namespace(&hc, "argocd").await;
    let secrets: Api<Secret> = Api::namespaced(hc.clone(), "argocd");
    let pp = PostParams::default();

    // east: the bearer token of a ServiceAccount, as `argocd cluster add` makes one.
    let token = service_account_token(&c1, "argocd-manager").await;
    let ca1 = kubeconfig_field(c1.kubeconfig(), "certificate-authority-data");
    let east = serde_json::json!({
        "bearerToken": token,
        "tlsClientConfig": { "insecure": false, "caData": ca1 },
    })
    .to_string();
    // west: a client certificate.
    let kubeconfig2 = c2.kubeconfig();
    let west = serde_json::json!({
        "tlsClientConfig": {
            "caData": kubeconfig_field(kubeconfig2, "certificate-authority-data"),
            "certData": kubeconfig_field(kubeconfig2, "client-certificate-data"),
            "keyData": kubeconfig_field(kubeconfig2, "client-key-data"),
        },
    })
    .to_string();
    let marker = tempfile::tempdir().unwrap().keep().join("exec-ran");
    let hostile = [
        (
            "argo-exec",
            serde_json::json!({ "execProviderConfig": {
                "command": "/bin/sh",
                "args": ["-c", format!("touch {}", marker.display())],
                "apiVersion": "client.authentication.k8s.io/v1beta1",
            }})
            .to_string(),
            "execProviderConfig",
        ),
        (
            "argo-aws",
            r#"{"awsAuthConfig": {"clusterName": "mcr-marker-aws", "roleARN": "arn:aws:iam::1:role/mcr-marker"}}"#.to_string(),
            "awsAuthConfig",
        ),
        (
            "argo-unparsable",
            r#"{"bearerToken": "mcr-marker-json" "x"}"#.to_string(),
            "line 1",
        ),
        (
            "argo-typed",
            r#"{"tlsClientConfig": {"insecure": "mcr-marker-type"}}"#.to_string(),
            "wrong type",
        ),
        (
            "argo-badca",
            r#"{"bearerToken": "mcr-marker-token", "tlsClientConfig": {"caData": "mcr-marker-b64!"}}"#.to_string(),
            "caData",
        ),
    ];
    for (name, server, config) in [
        ("east", c1.server(), east.as_str()),
        ("west", c2.server(), west.as_str()),
    ] {
        secrets
            .create(&pp, &argo_secret(name, "cluster", server, config))
            .await
            .unwrap();
    }
    // Argo CD's other Secrets carry the same label with other values: not clusters.
    secrets
        .create(&pp, &argo_secret("repo", "repository", c1.server(), &east))
        .await
        .unwrap();
    for (name, config, _) in &hostile {
        secrets
            .create(&pp, &argo_secret(name, "cluster", c1.server(), config))
            .await
            .unwrap();
    }
    // Argo CD's own cluster, named as Argo CD names it, without credentials.
    secrets
        .create(
            &pp,
            &argo_secret(
                "in-cluster",
                "cluster",
                "https://kubernetes.default.svc",
                r#"{"tlsClientConfig": {"insecure": false}}"#,
            ),
        )
        .await
        .unwrap();

    let manager = Arc::new(Manager::new(ArgoCdClusters::new(hc.clone(), "argocd")));
    let seen = Arc::new(Seen::default());
    Builder::<_, ConfigMap>::new(&manager, fixture_objects()).start(
        feed_animals,
        retry_soon,
        seen.clone(),
    );
    let run = spawn_manager(&manager);
    let (client1, client2) = (c1.client().unwrap(), c2.client().unwrap());
    eventually(30, "east fed through its bearer token", async || {
        is_fed(&client1, "zoo", "elephant").await
    })
    .await;
    eventually(30, "west fed through its client certificate", async || {
        is_fed(&client2, "zoo", "elephant").await
    })
    .await;
    for (name, _, named) in &hostile {
        eventually(30, &format!("{name} refused"), async || {
            has_event(&hc, "argocd", "ClusterSecretRefused", name, named).await
        })
        .await;
    }
    eventually(30, "Argo CD's own cluster refused", async || {
        has_event(
            &hc,
            "argocd",
            "ClusterSecretRefused",
            "in-cluster",
            "never lent",
        )
        .await
    })
    .await;
    // Sync point: every Secret was read (the refusals above came after the list).
    assert_eq!(manager.fleet().ids(), [name("east"), name("west")]);
    assert!(!marker.exists(), "the exec command must never run");
    no_event_holds(&hc, "argocd", "mcr-marker").await;
    no_event_holds(&hc, "argocd", &token).await;
    assert!(
        !logs
            .lines(&["Argo CD cluster Secret refused", "cluster=argo-exec "])
            .is_empty(),
        "the refusals are logged (the log capture works)"
    );
    assert_eq!(logs.lines(&["mcr-marker"]), Vec::<String>::new());
    assert_eq!(logs.lines(&[&token]), Vec::<String>::new());

    // A second provider takes one team's clusters only.
    let team = serde_json::json!({ "metadata": { "labels": { "team": "a" } } });
    secrets
        .patch("west", &PatchParams::default(), &Patch::Merge(&team))
        .await
        .unwrap();
    let team_a = Arc::new(Manager::new(
        ArgoCdClusters::new(hc.clone(), "argocd").labels("team=a"),
    ));
    let team_run = spawn_manager(&team_a);
    eventually(30, "team a's cluster engaged", async || {
        team_a.cluster(&name("west")).is_some()
    })
    .await;
    // Sync point: a Secret of the team created now is built after every Secret of the first
    // list (builds start in arrival order); east, had it been listed, would be there first.
    let mut late = argo_secret("late", "cluster", c2.server(), &west);
    late.metadata
        .labels
        .get_or_insert_default()
        .insert("team".into(), "a".into());
    secrets.create(&pp, &late).await.unwrap();
    eventually(30, "team a's later cluster engaged", async || {
        team_a.cluster(&name("late")).is_some()
    })
    .await;
    assert_eq!(
        team_a.fleet().ids(),
        [name("late"), name("west")],
        "only team a's clusters"
    );
    secrets.delete("late", &Default::default()).await.unwrap();
    team_a.shutdown();
    team_run.await.unwrap();

    // New credentials in east's config: the cluster is replaced.
    let rotated = c1.add_user("rotated", &["system:masters"]).unwrap();
    let rotated_config = serde_json::json!({
        "tlsClientConfig": {
            "caData": ca1,
            "certData": kubeconfig_field(rotated.kubeconfig(), "client-certificate-data"),
            "keyData": kubeconfig_field(rotated.kubeconfig(), "client-key-data"),
        },
    })
    .to_string();
    secrets
        .replace(
            "east",
            &pp,
            &argo_secret("east", "cluster", c1.server(), &rotated_config),
        )
        .await
        .unwrap();
    let expected = rotated.config().auth_info.client_certificate_data;
    eventually(30, "east replaced", async || {
        manager.cluster(&name("east")).and_then(|c| {
            c.config()
                .map(|c| c.auth_info.client_certificate_data.clone())
        }) == Some(expected.clone())
    })
    .await;

    // A label that no longer selects it, and a deletion: disengaged.
    let repository = serde_json::json!({ "metadata": { "labels": { "argocd.argoproj.io/secret-type": "repository" } } });
    secrets
        .patch("west", &PatchParams::default(), &Patch::Merge(&repository))
        .await
        .unwrap();
    eventually(30, "west disengaged", async || {
        manager.cluster(&name("west")).is_none()
    })
    .await;
    secrets.delete("east", &Default::default()).await.unwrap();
    eventually(30, "east disengaged", async || {
        manager.cluster(&name("east")).is_none()
    })
    .await;
    manager.shutdown();
    run.await.unwrap();

    // Where exec is allowed, the Secret's command gives the credential.
    create_namespace(&hc, "argocd-trusted").await;
    let dir = tempfile::tempdir().unwrap();
    let plugin = dir.path().join("credential.sh");
    let credential = serde_json::json!({
        "apiVersion": "client.authentication.k8s.io/v1beta1",
        "kind": "ExecCredential",
        "status": { "token": token },
    });
    std::fs::write(
        &plugin,
        format!("#!/bin/sh\n[ \"$1\" = token ] && [ \"$MCR_WHO\" = argocd ] && cat <<'EOF'\n{credential}\nEOF\n"),
    )
    .unwrap();
    std::fs::set_permissions(&plugin, std::fs::Permissions::from_mode(0o755)).unwrap();
    let plugged = serde_json::json!({
        "execProviderConfig": {
            "command": plugin.display().to_string(),
            "args": ["token"],
            "env": { "MCR_WHO": "argocd" },
            "apiVersion": "client.authentication.k8s.io/v1beta1",
        },
        "tlsClientConfig": { "caData": ca1 },
    })
    .to_string();
    Api::<Secret>::namespaced(hc.clone(), "argocd-trusted")
        .create(
            &pp,
            &argo_secret("plugged", "cluster", c1.server(), &plugged),
        )
        .await
        .unwrap();
    let trusted = Arc::new(Manager::new(
        ArgoCdClusters::new(hc.clone(), "argocd-trusted").allow_exec(true),
    ));
    let trusted_run = spawn_manager(&trusted);
    eventually(30, "the plugin's cluster engaged", async || {
        trusted.cluster(&name("plugged")).is_some()
    })
    .await;
    let cluster = trusted.cluster(&name("plugged")).unwrap();
    let zoo: Api<ConfigMap> = Api::namespaced(cluster.client().clone(), "zoo");
    assert!(
        !zoo.list(&Default::default())
            .await
            .unwrap()
            .items
            .is_empty(),
        "the plugin's token reads the member"
    );
    trusted.shutdown();
    trusted_run.await.unwrap();
}
