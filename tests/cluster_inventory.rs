//! The Cluster Inventory API provider against real apiservers with the Cluster Inventory
//! API's own `ClusterProfile` CRD and its reference KEP-5339 exec plugin `secretreader`,
//! both from `sigs.k8s.io/cluster-inventory-api` (fetched and built by
//! `scripts/provider-assets.sh`): a hub holding profiles (and the tokens the plugin hands
//! out) for member clusters.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;

use base64::Engine;
use common::*;
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{ConfigMap, Secret, ServiceAccount};
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use multicluster_runtime::providers::{AccessProviders, ClusterInventory, ProfileNamespaces};
use multicluster_runtime::{Builder, Manager};
use multicluster_runtime_testenv::{TestCluster, TestEnv};
use serde_json::json;

/// The provider assets' directory.
fn assets() -> String {
    std::env::var("MCR_PROVIDER_ASSETS").expect(
        "MCR_PROVIDER_ASSETS names the directory scripts/provider-assets.sh prints (scripts/test.sh sets it)",
    )
}

fn profiles() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &kube::api::GroupVersionKind::gvk("multicluster.x-k8s.io", "v1alpha1", "ClusterProfile"),
        "clusterprofiles",
    )
}

/// A `ClusterProfile` in namespace `fleet`.
fn profile(name: &str) -> DynamicObject {
    DynamicObject::new(name, &profiles())
        .within("fleet")
        .data(json!({"spec": {"clusterManager": {"name": "test-manager"}}}))
}

/// Sets the profile's status: `ControlPlaneHealthy` as `healthy`, and `access` as
/// `status.accessProviders`.
async fn set_status(
    profiles: &Api<DynamicObject>,
    name: &str,
    healthy: bool,
    access: serde_json::Value,
) {
    let condition = json!({
        "type": "ControlPlaneHealthy",
        "status": if healthy { "True" } else { "False" },
        "reason": if healthy { "Healthy" } else { "Unhealthy" },
        "message": "set by the test",
        "lastTransitionTime": "2026-11-24T00:00:00Z",
    });
    profiles
        .patch_status(
            name,
            &PatchParams::default(),
            &Patch::Merge(
                json!({"status": {"conditions": [condition], "accessProviders": access}}),
            ),
        )
        .await
        .unwrap();
}

/// An access provider entry of a profile: `provider` reaches `member`, and hands the
/// plugin `config` (the exec extension) plus `more` extensions.
fn access(
    provider: &str,
    member: &TestCluster,
    config: serde_json::Value,
    more: &[(&str, serde_json::Value)],
) -> serde_json::Value {
    let mut extensions =
        vec![json!({"name": "client.authentication.k8s.io/exec", "extension": config})];
    extensions.extend(
        more.iter()
            .map(|(name, value)| json!({"name": name, "extension": value})),
    );
    json!({
        "name": provider,
        "cluster": {
            "server": member.server(),
            "certificate-authority-data": base64::engine::general_purpose::STANDARD.encode(member.ca_pem()),
            "extensions": extensions,
        }
    })
}

/// Writes the Secret `secretreader` reads for `cluster_name`: `default/<cluster_name>`, key
/// `token` (created, or its token replaced).
async fn store_token(hub: &kube::Client, cluster_name: &str, token: &str) {
    let secrets: Api<Secret> = Api::namespaced(hub.clone(), "default");
    let secret = Secret {
        metadata: kube::api::ObjectMeta {
            name: Some(cluster_name.into()),
            ..Default::default()
        },
        data: Some(BTreeMap::from([(
            "token".to_string(),
            ByteString(token.as_bytes().to_vec()),
        )])),
        ..Default::default()
    };
    secrets
        .patch(
            cluster_name,
            &PatchParams::apply("cluster-inventory-test").force(),
            &Patch::Apply(secret),
        )
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn profiles_are_reached_through_the_secretreader_plugin_of_the_operators_file() {
    let env = TestEnv::builder().clusters(3).start().await.unwrap();
    let (hub, east, west) = (
        env.cluster(0).unwrap(),
        env.cluster(1).unwrap(),
        env.cluster(2).unwrap(),
    );
    let hc = hub.client().unwrap();
    let (east_client, west_client) = (east.client().unwrap(), west.client().unwrap());
    fixture(&east_client).await;
    fixture(&west_client).await;
    let crd =
        std::fs::read_to_string(format!("{}/crds/cluster-inventory-api.yaml", assets())).unwrap();
    hub.install_crds(&crd).await.unwrap();
    create_namespace(&hc, "fleet").await;

    // The members' credentials: service account tokens, kept on the hub where the plugin
    // (running with the hub's kubeconfig) reads them.
    store_token(
        &hc,
        "east-token",
        &service_account_token(&east, "reader-east").await,
    )
    .await;
    store_token(
        &hc,
        "west-token",
        &service_account_token(&west, "reader-west").await,
    )
    .await;

    // The operator's file: `secretreader` with the hub's kubeconfig; `profile-env` is the
    // same plugin (through a wrapper that reads its kubeconfig's path from `HUB_CONFIG`)
    // pointed at no kubeconfig, which a profile may replace (policy Replace).
    let plugin = format!("{}/bin/secretreader-plugin", assets());
    let hub_kubeconfig = hub.kubeconfig_path().display().to_string();
    let wrapper_dir = tempfile::tempdir().unwrap();
    let wrapper = wrapper_dir.path().join("hub-config-plugin.sh");
    std::fs::write(
        &wrapper,
        format!("#!/bin/sh\nKUBECONFIG=\"$HUB_CONFIG\" exec '{plugin}' \"$@\"\n"),
    )
    .unwrap();
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let providers = AccessProviders::from_json(
        &json!({"providers": [
            {"name": "secretreader", "execConfig": {
                "apiVersion": "client.authentication.k8s.io/v1", "command": plugin,
                "provideClusterInfo": true,
                "env": [{"name": "KUBECONFIG", "value": hub_kubeconfig}]}},
            {"name": "profile-env", "execConfig": {
                "apiVersion": "client.authentication.k8s.io/v1", "command": wrapper,
                "provideClusterInfo": true,
                "env": [{"name": "HUB_CONFIG", "value": "/nonexistent/kubeconfig"}]},
             "profileSourcedEnvVarsPolicy": "Replace",
             "profileEnvAllowed": ["HUB_CONFIG"]},
        ]})
        .to_string(),
    )
    .unwrap();

    let profiles: Api<DynamicObject> = Api::namespaced_with(hc.clone(), "fleet", &profiles());
    let pp = PostParams::default();
    // east lists both providers; the file's order picks secretreader. Not healthy yet.
    profiles.create(&pp, &profile("east")).await.unwrap();
    set_status(
        &profiles,
        "east",
        false,
        json!([
            access(
                "profile-env",
                &east,
                json!({"clusterName": "nothing-here"}),
                &[]
            ),
            access(
                "secretreader",
                &east,
                json!({"clusterName": "east-token"}),
                &[]
            ),
        ]),
    )
    .await;

    let manager = Arc::new(Manager::new(ClusterInventory::with_access_providers(
        hc.clone(),
        providers,
        ProfileNamespaces::Only("fleet".into()),
    )));
    let seen = Arc::new(Seen::default());
    Builder::<_, ConfigMap>::new(&manager, fixture_objects()).start(
        feed_animals,
        retry_soon,
        seen.clone(),
    );
    let run = spawn_manager(&manager);

    // west, created after the start, lists only profile-env and gives the plugin the hub's
    // kubeconfig through the additional-envs extension: it authenticates only because the
    // policy lets the profile's value replace the operator's.
    profiles.create(&pp, &profile("west")).await.unwrap();
    set_status(
        &profiles,
        "west",
        true,
        json!([access(
            "profile-env",
            &west,
            json!({"clusterName": "west-token"}),
            &[(
                "clusterprofiles.multicluster.x-k8s.io/exec/additional-envs",
                json!({"HUB_CONFIG": hub_kubeconfig})
            )],
        )]),
    )
    .await;
    eventually(30, "west fed", async || {
        is_fed(&west_client, "zoo", "elephant").await
    })
    .await;
    // What authenticates is the token the plugin read from the hub.
    assert_eq!(
        identity(&manager, "fleet/west").await.as_deref(),
        Some("system:serviceaccount:default:reader-west")
    );
    // Sync point: east was listed before west was created, and it is not healthy.
    assert_eq!(manager.fleet().ids(), [name("fleet/west")]);
    assert!(!is_fed(&east_client, "zoo", "elephant").await);

    let east_access = |token: &str| {
        json!([
            access(
                "profile-env",
                &east,
                json!({"clusterName": "nothing-here"}),
                &[]
            ),
            access("secretreader", &east, json!({"clusterName": token}), &[]),
        ])
    };
    set_status(&profiles, "east", true, east_access("east-token")).await;
    eventually(30, "east fed once healthy", async || {
        is_fed(&east_client, "zoo", "elephant").await
    })
    .await;
    assert_eq!(
        identity(&manager, "fleet/east").await.as_deref(),
        Some("system:serviceaccount:default:reader-east")
    );

    // Rotation: the profile now points the plugin at another token (another account).
    store_token(
        &hc,
        "east-token-2",
        &service_account_token(&east, "rotated-east").await,
    )
    .await;
    set_status(&profiles, "east", true, east_access("east-token-2")).await;
    eventually(
        30,
        "east re-engaged with the rotated credentials",
        async || {
            identity(&manager, "fleet/east").await.as_deref()
                == Some("system:serviceaccount:default:rotated-east")
        },
    )
    .await;

    // Not healthy: disengaged; healthy again: engaged again.
    set_status(&profiles, "east", false, east_access("east-token-2")).await;
    eventually(30, "east disengaged when unhealthy", async || {
        manager.fleet().ids() == [name("fleet/west")]
    })
    .await;
    set_status(&profiles, "east", true, east_access("east-token-2")).await;
    eventually(30, "east engaged again", async || {
        manager.fleet().ids().contains(&name("fleet/east"))
    })
    .await;

    // Rotation behind the plugin, the profile unchanged: the token Secret it names gets
    // another account's token and the old account is deleted (its tokens revoked). The next
    // request is answered 401, the plugin runs again (as client-go does) and reads the new
    // token; the cluster is not engaged again.
    let engaged = manager.cluster(&name("fleet/east")).unwrap();
    assert_eq!(
        identity(&manager, "fleet/east").await.as_deref(),
        Some("system:serviceaccount:default:rotated-east")
    );
    store_token(
        &hc,
        "east-token-2",
        &service_account_token(&east, "rotated-again").await,
    )
    .await;
    Api::<ServiceAccount>::namespaced(east_client.clone(), "default")
        .delete("rotated-east", &DeleteParams::default())
        .await
        .unwrap();
    eventually(
        60,
        "east authenticated with the token the plugin read again",
        async || {
            identity(&manager, "fleet/east").await.as_deref()
                == Some("system:serviceaccount:default:rotated-again")
        },
    )
    .await;
    assert!(
        manager
            .cluster(&name("fleet/east"))
            .unwrap()
            .same_instance(&engaged)
    );

    // The CRD types an extension as an object: the additional-args extension, a list, is
    // refused by the API server (so a controller only ever sees it from other sources).
    let args = access(
        "secretreader",
        &east,
        json!({"clusterName": "east-token-2"}),
        &[(
            "clusterprofiles.multicluster.x-k8s.io/exec/additional-args",
            json!(["--verbose"]),
        )],
    );
    let refused = profiles
        .patch_status(
            "east",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"accessProviders": [args]}})),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(&refused, kube::Error::Api(status) if status.code == 422),
        "{refused}"
    );

    // Bad input, each reported on its profile: an access provider the controller is not
    // configured for, and the plugin failing (no token Secret for it to read).
    for bad in ["foreign", "failing"] {
        profiles.create(&pp, &profile(bad)).await.unwrap();
    }
    let foreign = json!([{"name": "someone-elses", "cluster": {"server": east.server()}}]);
    set_status(&profiles, "foreign", true, foreign).await;
    set_status(
        &profiles,
        "failing",
        true,
        json!([access(
            "secretreader",
            &west,
            json!({"clusterName": "no-such-token"}),
            &[]
        )]),
    )
    .await;
    for (object, note) in [("foreign", "someone-elses"), ("failing", "plugin")] {
        eventually(
            30,
            &format!("a Warning Event on ClusterProfile {object}"),
            async || has_event(&hc, "fleet", "KubeconfigRefused", object, note).await,
        )
        .await;
    }
    assert_eq!(
        manager.fleet().ids(),
        [name("fleet/east"), name("fleet/west")]
    );

    // The missing token appears, the profile unchanged: the failed build is tried again
    // (after 5 s, then 10, 20, ...) and failing is engaged.
    store_token(
        &hc,
        "no-such-token",
        &service_account_token(&west, "late-west").await,
    )
    .await;
    eventually(60, "failing engaged once its token exists", async || {
        identity(&manager, "fleet/failing").await.as_deref()
            == Some("system:serviceaccount:default:late-west")
    })
    .await;

    // Deletion: west leaves, the others stay.
    profiles
        .delete("west", &DeleteParams::default())
        .await
        .unwrap();
    eventually(30, "west disengaged when deleted", async || {
        !manager.fleet().ids().contains(&name("fleet/west"))
    })
    .await;
    assert_eq!(
        manager.fleet().ids(),
        [name("fleet/east"), name("fleet/failing")]
    );

    manager.shutdown();
    run.await.unwrap();
}

/// A profile `name` of namespace `ns`, healthy, reached through `access`.
async fn healthy_profile(hub: &kube::Client, ns: &str, name: &str, access: serde_json::Value) {
    let api: Api<DynamicObject> = Api::namespaced_with(hub.clone(), ns, &profiles());
    api.create(&PostParams::default(), &profile(name).within(ns))
        .await
        .unwrap();
    set_status(&api, name, true, json!([access])).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_profile_writer_cannot_steer_credentials_elsewhere_or_into_the_plugins_environment() {
    let env = TestEnv::builder().clusters(2).start().await.unwrap();
    let (hub, member) = (env.cluster(0).unwrap(), env.cluster(1).unwrap());
    let hc = hub.client().unwrap();
    let crd =
        std::fs::read_to_string(format!("{}/crds/cluster-inventory-api.yaml", assets())).unwrap();
    hub.install_crds(&crd).await.unwrap();
    for ns in ["fleet", "tenant"] {
        create_namespace(&hc, ns).await;
    }
    store_token(
        &hc,
        "member-token",
        &service_account_token(&member, "steer-reader").await,
    )
    .await;

    // secretreader behind a wrapper that records each run's environment.
    let dir = tempfile::tempdir().unwrap();
    let runs = dir.path().join("runs");
    let wrapper = dir.path().join("recording-plugin.sh");
    std::fs::write(
        &wrapper,
        format!(
            "#!/bin/sh\n{{ echo '--- run'; /usr/bin/env; }} >> '{}'\nexec '{}/bin/secretreader-plugin' \"$@\"\n",
            runs.display(),
            assets()
        ),
    )
    .unwrap();
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let providers = || {
        AccessProviders::from_json(
            &json!({"providers": [{"name": "secretreader",
                "execConfig": {"apiVersion": "client.authentication.k8s.io/v1",
                    "command": wrapper, "provideClusterInfo": true,
                    "env": [{"name": "KUBECONFIG", "value": hub.kubeconfig_path()}]},
                "profileSourcedEnvVarsPolicy": "AppendIfNotExists",
                // What profiles may set: REGION; the rest listed too, to show that the
                // deny-list stands behind the operator's list.
                "profileEnvAllowed": ["REGION", "KUBECONFIG", "SHELLOPTS", "PS4",
                    "AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ENDPOINT_URL_STS"],
                "allowedServers": [member.server()]}]})
            .to_string(),
        )
        .unwrap()
    };
    let reader = json!({"clusterName": "member-token"});
    // A good profile in each namespace; in fleet also: one sending the credentials to
    // another server (the hub's), one setting KUBECONFIG for the plugin, one turning TLS
    // verification off and naming another server name.
    healthy_profile(
        &hc,
        "fleet",
        "good",
        access("secretreader", &member, reader.clone(), &[]),
    )
    .await;
    healthy_profile(
        &hc,
        "tenant",
        "sneaky",
        access("secretreader", &member, reader.clone(), &[]),
    )
    .await;
    healthy_profile(
        &hc,
        "fleet",
        "elsewhere",
        access("secretreader", &hub, reader.clone(), &[]),
    )
    .await;
    healthy_profile(
        &hc,
        "fleet",
        "steering",
        access(
            "secretreader",
            &member,
            reader.clone(),
            &[(
                "clusterprofiles.multicluster.x-k8s.io/exec/additional-envs",
                json!({"KUBECONFIG": "/tmp/the-tenants-kubeconfig", "REGION": "east"}),
            )],
        ),
    )
    .await;
    // Code run by a shell plugin (bash imports PS4 for a non-root user), the controller's
    // own service account token posted by an AWS SDK plugin, and a variable the operator
    // did not list.
    let marker = dir.path().join("ran");
    for (object, envs) in [
        (
            "shell",
            json!({"SHELLOPTS": "xtrace", "PS4": format!("$(touch {})", marker.display())}),
        ),
        (
            "aws",
            json!({"AWS_ROLE_ARN": "arn:aws:iam::1:role/x",
                   "AWS_WEB_IDENTITY_TOKEN_FILE": "/var/run/secrets/kubernetes.io/serviceaccount/token",
                   "AWS_ENDPOINT_URL_STS": "https://attacker.example.com"}),
        ),
        ("unlisted", json!({"ZONE": "a"})),
    ] {
        healthy_profile(
            &hc,
            "fleet",
            object,
            access(
                "secretreader",
                &member,
                reader.clone(),
                &[(
                    "clusterprofiles.multicluster.x-k8s.io/exec/additional-envs",
                    envs,
                )],
            ),
        )
        .await;
    }
    let mut insecure = access(
        "secretreader",
        &member,
        reader.clone(),
        &[(
            "clusterprofiles.multicluster.x-k8s.io/exec/additional-envs",
            json!({"REGION": "east"}),
        )],
    );
    insecure["cluster"]["insecure-skip-tls-verify"] = json!(true);
    insecure["cluster"]["tls-server-name"] = json!("localhost");
    insecure["cluster"]["certificate-authority"] = json!("/etc/hostname");
    healthy_profile(&hc, "fleet", "insecure", insecure).await;

    // The cluster manager's namespace only; a second manager over all namespaces shows the
    // tenant's profile would be engaged if it were read.
    let only = Arc::new(Manager::new(ClusterInventory::with_access_providers(
        hc.clone(),
        providers(),
        ProfileNamespaces::Only("fleet".into()),
    )));
    let all = Arc::new(Manager::new(ClusterInventory::with_access_providers(
        hc.clone(),
        providers(),
        ProfileNamespaces::All,
    )));
    let runs_only = spawn_manager(&only);
    let runs_all = spawn_manager(&all);
    for (object, note) in [
        ("elsewhere", "is not one this controller allows"),
        ("steering", "KUBECONFIG"),
        ("shell", "PS4"),
        ("aws", "AWS_ENDPOINT_URL_STS"),
        ("unlisted", "profileEnvAllowed"),
    ] {
        eventually(30, &format!("{object} refused"), async || {
            has_event(&hc, "fleet", "KubeconfigRefused", object, note).await
        })
        .await;
    }
    eventually(
        30,
        "the tenant's profile engaged by the all-namespaces manager",
        async || identity(&all, "tenant/sneaky").await.is_some(),
    )
    .await;
    for id in ["fleet/good", "fleet/insecure"] {
        eventually(30, &format!("{id} engaged"), async || {
            identity(&only, id).await.as_deref()
                == Some("system:serviceaccount:default:steer-reader")
        })
        .await;
    }
    // Sync point: everything the all-namespaces manager engaged is engaged.
    assert_eq!(
        only.fleet().ids(),
        [name("fleet/good"), name("fleet/insecure")],
        "the tenant's profile is not read, the refused ones are not engaged"
    );
    // The insecure profile's TLS settings were not taken: verified against its CA data
    // (none: the system's roots would fail; the member's CA came with `access`).
    let config = only
        .cluster(&name("fleet/insecure"))
        .unwrap()
        .config()
        .unwrap()
        .clone();
    assert!(!config.accept_invalid_certs);
    assert_eq!(config.tls_server_name, None);
    assert_eq!(config.root_cert_file, None);

    // Each run's environment: the file's variables, the profile's allowed ones, and the
    // inherited allow-list; nothing else of the controller's (the test binary has
    // MCR_PROVIDER_ASSETS), never the refused profile's KUBECONFIG.
    let log = std::fs::read_to_string(&runs).unwrap();
    let environments: Vec<&str> = log.split("--- run\n").filter(|r| !r.is_empty()).collect();
    assert!(!environments.is_empty());
    for environment in &environments {
        assert!(
            !environment.contains("MCR_PROVIDER_ASSETS="),
            "{environment}"
        );
        assert!(
            !environment.contains("the-tenants-kubeconfig"),
            "{environment}"
        );
        assert!(environment.contains(&format!("KUBECONFIG={}", hub.kubeconfig_path().display())));
        assert!(
            environment.lines().any(|l| l.starts_with("PATH=")),
            "{environment}"
        );
        assert!(
            environment.contains("KUBERNETES_EXEC_INFO="),
            "{environment}"
        );
    }
    assert!(
        environments
            .iter()
            .any(|e| e.lines().any(|l| l == "REGION=east")),
        "a profile's allowed variable reaches the plugin"
    );
    assert!(!marker.exists(), "a profile's PS4 ran");
    // The plugin never ran for the refused profiles: the hub's server is in no run's
    // cluster info.
    let hub_server = hub.server().trim_end_matches('/');
    for quoted in [format!("\"{hub_server}\""), format!("\"{hub_server}/\"")] {
        assert!(
            !environments.iter().any(|e| e.contains(&quoted)),
            "the credential was never fetched for another server"
        );
    }

    only.shutdown();
    all.shutdown();
    runs_only.await.unwrap();
    runs_all.await.unwrap();
}

/// A kubeconfig Secret of the Secret strategy for consumer `mcr`.
fn labelled_secret(name: &str, profile: &str, consumer: &str, config: &str) -> Secret {
    Secret {
        metadata: kube::api::ObjectMeta {
            name: Some(name.into()),
            labels: Some(BTreeMap::from([
                (
                    "x-k8s.io/cluster-inventory-consumer".to_string(),
                    consumer.to_string(),
                ),
                ("x-k8s.io/cluster-profile".to_string(), profile.to_string()),
            ])),
            ..Default::default()
        },
        data: Some(BTreeMap::from([(
            "Config".to_string(),
            ByteString(config.as_bytes().to_vec()),
        )])),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn profiles_are_reached_through_labelled_kubeconfig_secrets() {
    let env = TestEnv::builder().clusters(3).start().await.unwrap();
    let (hub, east, west) = (
        env.cluster(0).unwrap(),
        env.cluster(1).unwrap(),
        env.cluster(2).unwrap(),
    );
    let hc = hub.client().unwrap();
    let crd =
        std::fs::read_to_string(format!("{}/crds/cluster-inventory-api.yaml", assets())).unwrap();
    hub.install_crds(&crd).await.unwrap();
    create_namespace(&hc, "fleet").await;
    let profiles: Api<DynamicObject> = Api::namespaced_with(hc.clone(), "fleet", &profiles());
    let secrets: Api<Secret> = Api::namespaced(hc.clone(), "fleet");
    let pp = PostParams::default();
    for name in ["east", "twice", "broken", "lonely"] {
        profiles.create(&pp, &profile(name)).await.unwrap();
        set_status(&profiles, name, true, json!([])).await;
    }
    secrets
        .create(
            &pp,
            &labelled_secret("east-for-mcr", "east", "mcr", east.kubeconfig()),
        )
        .await
        .unwrap();
    // Another consumer's Secret for east is not ours.
    secrets
        .create(
            &pp,
            &labelled_secret("east-for-other", "east", "other", west.kubeconfig()),
        )
        .await
        .unwrap();
    for n in ["1", "2"] {
        secrets
            .create(
                &pp,
                &labelled_secret(&format!("twice-{n}"), "twice", "mcr", east.kubeconfig()),
            )
            .await
            .unwrap();
    }
    secrets
        .create(
            &pp,
            &labelled_secret("broken-for-mcr", "broken", "mcr", "clusters: [ {"),
        )
        .await
        .unwrap();

    let manager = Arc::new(Manager::new(ClusterInventory::with_secrets(
        hc.clone(),
        "mcr",
        ProfileNamespaces::Only("fleet".into()),
    )));
    let run = spawn_manager(&manager);
    let server_of = |name: &str| {
        manager
            .cluster(&common::name(name))
            .and_then(|c| c.config().map(|c| c.cluster_url.to_string()))
            .map(|s| s.trim_end_matches('/').to_string())
    };
    eventually(30, "east engaged from its Secret", async || {
        server_of("fleet/east").as_deref() == Some(east.server())
    })
    .await;
    for (object, note) in [
        ("twice", "2 Secrets"),
        ("broken", "line"),
        ("lonely", "no Secret"),
    ] {
        eventually(
            30,
            &format!("a Warning Event on ClusterProfile {object}"),
            async || has_event(&hc, "fleet", "KubeconfigRefused", object, note).await,
        )
        .await;
    }
    assert_eq!(manager.fleet().ids(), [name("fleet/east")]);

    // Rotation: east's Secret now reaches the west apiserver; the profile is untouched.
    secrets
        .replace(
            "east-for-mcr",
            &pp,
            &labelled_secret("east-for-mcr", "east", "mcr", west.kubeconfig()),
        )
        .await
        .unwrap();
    eventually(
        30,
        "east re-engaged with the rotated kubeconfig",
        async || server_of("fleet/east").as_deref() == Some(west.server()),
    )
    .await;

    // One of twice's Secrets goes: twice is engaged.
    secrets
        .delete("twice-2", &DeleteParams::default())
        .await
        .unwrap();
    eventually(30, "twice engaged once one Secret is left", async || {
        manager.fleet().ids() == [name("fleet/east"), name("fleet/twice")]
    })
    .await;

    // Unhealthy, then deleted.
    set_status(&profiles, "twice", false, json!([])).await;
    eventually(30, "twice disengaged when unhealthy", async || {
        manager.fleet().ids() == [name("fleet/east")]
    })
    .await;
    profiles
        .delete("east", &DeleteParams::default())
        .await
        .unwrap();
    eventually(30, "east disengaged when deleted", async || {
        manager.fleet().ids().is_empty()
    })
    .await;

    manager.shutdown();
    run.await.unwrap();
}

/// The ClusterProfile kind at the proposed `v1alpha2` (tests/crds/clusterprofile-v1alpha2.yaml).
fn profiles_v1alpha2() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &kube::api::GroupVersionKind::gvk("multicluster.x-k8s.io", "v1alpha2", "ClusterProfile"),
        "clusterprofiles",
    )
}

/// Creates the kubeconfig Secret of consumer `mcr` for `profile`: `<profile>-kubeconfig`.
async fn kubeconfig_for(secrets: &Api<Secret>, profile: &str, kubeconfig: &str) {
    let secret = labelled_secret(&format!("{profile}-kubeconfig"), profile, "mcr", kubeconfig);
    secrets
        .create(&PostParams::default(), &secret)
        .await
        .unwrap();
}

/// Labels the profile with its member id.
async fn set_member(profiles: &Api<DynamicObject>, name: &str, id: &str) {
    profiles
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(
                json!({"metadata": {"labels": {"multicluster.x-k8s.io/inventory-member-id": id}}}),
            ),
        )
        .await
        .unwrap();
}

/// On a hub that serves ClusterProfile only at `v1alpha2`, profiles are read there; two
/// cluster managers each write a profile for one member: one cluster is engaged, that of the
/// earliest created profile whose cluster can be built; the other profile is told why, and
/// takes over when the first stops being healthy or goes. A profile of another member id
/// stands on its own, and one whose id changes to a taken one stands aside.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn profiles_of_one_member_id_engage_one_cluster_and_the_next_takes_over() {
    let env = TestEnv::builder().clusters(2).start().await.unwrap();
    let (hub, member) = (env.cluster(0).unwrap(), env.cluster(1).unwrap());
    let hc = hub.client().unwrap();
    let crd = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/crds/clusterprofile-v1alpha2.yaml"
    ))
    .unwrap();
    hub.install_crds(&crd).await.unwrap();
    create_namespace(&hc, "fleet").await;
    let profiles: Api<DynamicObject> =
        Api::namespaced_with(hc.clone(), "fleet", &profiles_v1alpha2());
    let secrets: Api<Secret> = Api::namespaced(hc.clone(), "fleet");
    let pp = PostParams::default();
    // Created a second apart, in this order (creation times have seconds; on a tie the
    // first by name would win).
    for (name, id) in [
        ("first", "member-1"),
        ("second", "member-1"),
        ("other", "member-2"),
        ("unlabelled", ""),
    ] {
        let object = DynamicObject::new(name, &profiles_v1alpha2())
            .within("fleet")
            .data(json!({"spec": {"clusterManager": {"name": format!("manager-of-{name}")}}}));
        profiles.create(&pp, &object).await.unwrap();
        if !id.is_empty() {
            set_member(&profiles, name, id).await;
        }
        set_status(&profiles, name, true, json!([])).await;
        // first's Secret comes later: until then its cluster cannot be built.
        if name != "first" {
            kubeconfig_for(&secrets, name, member.kubeconfig()).await;
        }
        tokio::time::sleep(std::time::Duration::from_millis(1100)).await;
    }

    let manager = Arc::new(Manager::new(ClusterInventory::with_secrets(
        hc.clone(),
        "mcr",
        ProfileNamespaces::Only("fleet".into()),
    )));
    let run = spawn_manager(&manager);
    let engaged = |names: &[&str]| {
        let names: Vec<_> = names.iter().map(|n| name(&format!("fleet/{n}"))).collect();
        manager.fleet().ids() == names
    };
    // first cannot be built (no Secret): second, the next, is the member's.
    eventually(30, "first refused for its missing Secret", async || {
        has_event(&hc, "fleet", "KubeconfigRefused", "first", "no Secret").await
    })
    .await;
    eventually(30, "second, other and unlabelled engaged", async || {
        engaged(&["other", "second", "unlabelled"])
    })
    .await;

    // first's Secret comes: first is engaged, then second steps aside (paused).
    kubeconfig_for(&secrets, "first", member.kubeconfig()).await;
    eventually(30, "a DuplicateMember Event on second", async || {
        has_event(&hc, "fleet", "DuplicateMember", "second", "fleet/first").await
    })
    .await;
    eventually(30, "first, other and unlabelled engaged", async || {
        engaged(&["first", "other", "unlabelled"])
    })
    .await;
    assert!(manager.cluster(&name("fleet/second")).is_none());
    assert!(
        manager.fleet().paused(&name("fleet/second")).is_some(),
        "second is paused"
    );

    // first stops being healthy: second is engaged, first paused.
    set_status(&profiles, "first", false, json!([])).await;
    eventually(30, "second engaged for the member", async || {
        engaged(&["other", "second", "unlabelled"])
    })
    .await;
    // Healthy again: first (created earlier) is the member's again, second paused.
    set_status(&profiles, "first", true, json!([])).await;
    eventually(30, "first engaged again, second paused", async || {
        engaged(&["first", "other", "unlabelled"])
    })
    .await;

    // first is deleted: second takes over.
    profiles
        .delete("first", &DeleteParams::default())
        .await
        .unwrap();
    eventually(30, "second engaged once first is gone", async || {
        engaged(&["other", "second", "unlabelled"])
    })
    .await;

    // other takes member-1's id: created after second, it is paused; given its own id back,
    // it is engaged again.
    set_member(&profiles, "other", "member-1").await;
    eventually(30, "other paused as second's duplicate", async || {
        engaged(&["second", "unlabelled"])
    })
    .await;
    set_member(&profiles, "other", "member-2").await;
    eventually(30, "other engaged with an id of its own", async || {
        engaged(&["other", "second", "unlabelled"])
    })
    .await;

    manager.shutdown();
    run.await.unwrap();
}

/// Without de-duplication, each profile is a cluster (on a `v1alpha1` hub).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_one_per_member_off_each_profile_of_a_member_is_a_cluster() {
    let env = TestEnv::builder().clusters(2).start().await.unwrap();
    let (hub, member) = (env.cluster(0).unwrap(), env.cluster(1).unwrap());
    let hc = hub.client().unwrap();
    let crd =
        std::fs::read_to_string(format!("{}/crds/cluster-inventory-api.yaml", assets())).unwrap();
    hub.install_crds(&crd).await.unwrap();
    create_namespace(&hc, "fleet").await;
    let profiles: Api<DynamicObject> = Api::namespaced_with(hc.clone(), "fleet", &profiles());
    let secrets: Api<Secret> = Api::namespaced(hc.clone(), "fleet");
    let pp = PostParams::default();
    for name in ["first", "second"] {
        profiles.create(&pp, &profile(name)).await.unwrap();
        kubeconfig_for(&secrets, name, member.kubeconfig()).await;
        set_member(&profiles, name, "member-1").await;
        set_status(&profiles, name, true, json!([])).await;
    }
    let manager = Arc::new(Manager::new(
        ClusterInventory::with_secrets(hc.clone(), "mcr", ProfileNamespaces::Only("fleet".into()))
            .one_per_member(false),
    ));
    let run = spawn_manager(&manager);
    eventually(30, "both profiles engaged", async || {
        manager.fleet().ids() == [name("fleet/first"), name("fleet/second")]
    })
    .await;
    manager.shutdown();
    run.await.unwrap();
}

/// The PlacementDecision kind.
fn placement_decisions() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &kube::api::GroupVersionKind::gvk("multicluster.x-k8s.io", "v1alpha1", "PlacementDecision"),
        "placementdecisions",
    )
}

/// A PlacementDecision slice `name` for the workload `key`, selecting ClusterProfiles of the
/// namespace `fleet`.
fn decision(name: &str, key: &str, clusters: &[&str]) -> DynamicObject {
    let mut object = DynamicObject::new(name, &placement_decisions()).data(json!({
        "decisions": clusters
            .iter()
            .map(|c| json!({ "clusterProfileRef": { "name": c, "namespace": "fleet" }, "reason": "test" }))
            .collect::<Vec<_>>(),
        "schedulerName": "test-scheduler",
    }));
    object.metadata.labels = Some(BTreeMap::from([(
        multicluster_runtime::providers::PLACEMENT_KEY_LABEL.to_string(),
        key.to_string(),
    )]));
    object
}

#[tokio::test]
async fn placement_decisions_choose_the_clusters_and_a_move_between_slices_is_no_departure() {
    use futures::StreamExt;
    use multicluster_runtime::providers::{Clusters, Placed};
    use multicluster_runtime::{Cluster, ClusterEvent};

    let env = TestEnv::builder().clusters(2).start().await.unwrap();
    let (hub, member) = (env.cluster(0).unwrap(), env.cluster(1).unwrap());
    let hc = hub.client().unwrap();
    let crd =
        std::fs::read_to_string(format!("{}/crds/placement-decisions.yaml", assets())).unwrap();
    hub.install_crds(&crd).await.unwrap();
    create_namespace(&hc, "placement").await;
    let decisions: Api<DynamicObject> =
        Api::namespaced_with(hc.clone(), "placement", &placement_decisions());
    let pp = PostParams::default();

    // The inner provider's clusters, named as ClusterInventory names them.
    let inner = Clusters::new();
    for id in ["fleet/a", "fleet/b", "fleet/c"] {
        inner
            .add(Cluster::from_config(name(id), member.config()).unwrap())
            .unwrap();
    }
    decisions
        .create(&pp, &decision("app-0", "app", &["a"]))
        .await
        .unwrap();
    decisions
        .create(&pp, &decision("app-1", "app", &["b", "d"]))
        .await
        .unwrap();
    // Another workload's decision: not this controller's.
    decisions
        .create(&pp, &decision("other-0", "other", &["c"]))
        .await
        .unwrap();

    let placed = Placed::new(
        inner.clone(),
        hc.clone(),
        "placement",
        "multicluster.x-k8s.io/placement-key=app",
    )
    .hand_over(std::time::Duration::from_secs(8));
    let manager = Arc::new(Manager::new(placed));
    let run = spawn_manager(&manager);
    eventually(30, "the decided clusters engaged", async || {
        manager.fleet().ids() == [name("fleet/a"), name("fleet/b")]
    })
    .await;
    let mut events = manager.fleet().events();

    // d is decided before the inner provider has it: engaged when it comes.
    inner
        .add(Cluster::from_config(name("fleet/d"), member.config()).unwrap())
        .unwrap();
    eventually(30, "d engaged once the inner provider has it", async || {
        manager.cluster(&name("fleet/d")).is_some()
    })
    .await;

    // The scheduler moves a from slice 0 to slice 1 (two writes): a stays.
    decisions
        .replace("app-0", &pp, &{
            let mut d = decision("app-0", "app", &[]);
            d.metadata.resource_version = decisions
                .get("app-0")
                .await
                .unwrap()
                .metadata
                .resource_version;
            d
        })
        .await
        .unwrap();
    let mut moved = decisions.get("app-1").await.unwrap();
    moved.data["decisions"] = decision("x", "app", &["b", "d", "a"]).data["decisions"].clone();
    decisions.replace("app-1", &pp, &moved).await.unwrap();
    // Then drops b: b leaves after the hand-over.
    let mut dropped = decisions.get("app-1").await.unwrap();
    dropped.data["decisions"] = decision("x", "app", &["d", "a"]).data["decisions"].clone();
    decisions.replace("app-1", &pp, &dropped).await.unwrap();
    let mut departed = Vec::new();
    let waited = tokio::time::timeout(std::time::Duration::from_secs(60), async {
        while let Some(event) = events.next().await {
            if let ClusterEvent::Departed { cluster, .. } = &event {
                departed.push(cluster.id().clone());
                if cluster.id() == &name("fleet/b") {
                    break;
                }
            }
        }
    })
    .await;
    assert!(waited.is_ok(), "b departed after its hand-over");
    // Sync point: b's departure came after both writes that moved a.
    assert_eq!(departed, [name("fleet/b")], "a never departed");
    assert!(manager.cluster(&name("fleet/a")).is_some());
    assert!(
        manager.cluster(&name("fleet/c")).is_none(),
        "another workload's cluster"
    );

    // The inner provider removes a decided cluster: it leaves at once.
    assert!(inner.remove(&name("fleet/d")));
    eventually(30, "d gone with its source", async || {
        manager.cluster(&name("fleet/d")).is_none()
    })
    .await;
    // The decision deleted: its clusters leave after the hand-over.
    decisions
        .delete("app-1", &DeleteParams::default())
        .await
        .unwrap();
    eventually(30, "a gone with its decision", async || {
        manager.fleet().is_empty()
    })
    .await;

    manager.shutdown();
    run.await.unwrap();
}
