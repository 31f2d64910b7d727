//! Every provider in turn, each against local control planes: the zoo / jungle / island
//! fixture (ConfigMaps labelled `type=animal|human|thing`), a uniform controller that feeds
//! the animals (`data.stomach=food`) in whatever cluster it runs, and the fleet changing
//! while it runs (a cluster added, one removed, one refused where the provider refuses).
//!
//! ```sh
//! scripts/example.sh providers                      # all of them
//! scripts/example.sh providers namespaces secrets   # some: nop multi file secrets cluster-api
//!                                                   # cluster-inventory kubefed identity namespaces kind
//! ```
//!
//! The `kind` demo runs a stand-in `kind` script (there is no container engine here) that
//! prints the kubeconfigs of local control planes, as `kind get clusters` and
//! `kind get kubeconfig --name` would.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Secret};
use kube::api::{Api, DeleteParams, ObjectMeta, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use kube_runtime::watcher;
use multicluster_runtime::providers::{
    ArgoCdClusters, ClusterApi, Clusters, File, Kind, KubeconfigSecrets, Multi, Namespaces, Nop,
};
use multicluster_runtime::{
    Action, Builder, Cluster, ClusterId, ClusterName, Context, Manager, Provider,
};
use multicluster_runtime_testenv::{TestCluster, TestEnv};

type Result<T = (), E = Box<dyn std::error::Error>> = std::result::Result<T, E>;

/// The animals fed, per cluster.
#[derive(Default)]
struct Fed(Mutex<BTreeMap<String, BTreeSet<String>>>);

impl Fed {
    fn count(&self, cluster: &str) -> usize {
        self.0
            .lock()
            .map(|m| m.get(cluster).map_or(0, BTreeSet::len))
            .unwrap_or(0)
    }
}

/// The uniform reconciler: the same code whatever the provider.
async fn feed<C: ClusterId>(
    cm: Arc<ConfigMap>,
    ctx: Context<C, Fed>,
) -> Result<Action, kube::Error> {
    let hungry = cm.data.as_ref().and_then(|d| d.get("stomach")).is_none();
    if hungry {
        let ns = cm.namespace().unwrap_or_default();
        let patch = serde_json::json!({ "data": { "stomach": "food" } });
        Api::<ConfigMap>::namespaced(ctx.client(), &ns)
            .patch(
                &cm.name_any(),
                &PatchParams::default(),
                &Patch::Merge(&patch),
            )
            .await?;
        println!("  fed {}", ctx.request());
    }
    if let Ok(mut fed) = ctx.state().0.lock() {
        fed.entry(ctx.cluster_id().to_string())
            .or_default()
            .insert(format!(
                "{}/{}",
                cm.namespace().unwrap_or_default(),
                cm.name_any()
            ));
    }
    Ok(Action::await_change())
}

fn retry<C: ClusterId>(_: Arc<ConfigMap>, error: &kube::Error, ctx: &Context<C, Fed>) -> Action {
    eprintln!("  {} failed: {error}", ctx.request());
    Action::requeue(Duration::from_secs(1))
}

/// A manager for `provider` running the feeding controller.
struct Demo<P: Provider> {
    manager: Arc<Manager<P>>,
    fed: Arc<Fed>,
    run: tokio::task::JoinHandle<Result<(), multicluster_runtime::ManagerError>>,
}

impl<P: Provider> Demo<P> {
    fn start(manager: Manager<P>) -> Self {
        let manager = Arc::new(manager);
        let fed = Arc::new(Fed::default());
        Builder::<_, ConfigMap>::new(&manager, watcher::Config::default().labels("type=animal"))
            .named("feeder")
            .engage_local(manager.local().is_some())
            .start(feed, retry, fed.clone());
        let run = {
            let manager = manager.clone();
            tokio::spawn(async move { manager.run().await })
        };
        Self { manager, fed, run }
    }

    /// Waits until `n` animals were seen in `cluster`.
    async fn fed(&self, cluster: &str, n: usize) -> Result {
        wait_for(&format!("{n} animals fed in {cluster}"), || {
            self.fed.count(cluster) >= n
        })
        .await
    }

    /// Waits until `cluster` is no longer engaged.
    async fn gone(&self, cluster: &str) -> Result {
        let id = P::Id::parse(cluster).map_err(|e| e.to_string())?;
        wait_for(&format!("{cluster} disengaged"), || {
            self.manager.cluster(&id).is_none()
        })
        .await?;
        println!("  {cluster} disengaged");
        Ok(())
    }

    async fn finish(self) -> Result {
        let engaged: Vec<String> = self
            .manager
            .fleet()
            .ids()
            .iter()
            .map(|i| i.to_string())
            .collect();
        self.manager.shutdown();
        self.run.await??;
        println!("  engaged at the end: {engaged:?}");
        Ok(())
    }
}

async fn wait_for(what: &str, mut done: impl FnMut() -> bool) -> Result {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !done() {
        if Instant::now() > deadline {
            return Err(format!("timed out waiting for {what}").into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

fn object_meta(name: &str, ns: Option<&str>, labels: &[(&str, &str)]) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.into()),
        namespace: ns.map(String::from),
        labels: Some(
            labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        ),
        ..Default::default()
    }
}

async fn create_namespace(client: &Client, ns: &str, labels: &[(&str, &str)]) -> Result {
    let namespace = Namespace {
        metadata: object_meta(ns, None, labels),
        ..Default::default()
    };
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &namespace)
        .await?;
    Ok(())
}

async fn create_animal(client: &Client, ns: &str, name: &str, kind: &str) -> Result {
    let cm = ConfigMap {
        metadata: object_meta(name, Some(ns), &[("type", kind)]),
        ..Default::default()
    };
    Api::<ConfigMap>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &cm)
        .await?;
    Ok(())
}

/// The fixture: namespaces zoo, jungle and island (labelled `demo=true`), each with an
/// animal, a human and a thing.
async fn fixture(client: &Client) -> Result {
    for ns in ["zoo", "jungle", "island"] {
        create_namespace(client, ns, &[("demo", "true")]).await?;
        for (name, kind) in [
            ("elephant", "animal"),
            ("keeper", "human"),
            ("rock", "thing"),
        ] {
            create_animal(client, ns, name, kind).await?;
        }
    }
    Ok(())
}

async fn env(clusters: usize) -> Result<TestEnv> {
    let env = TestEnv::builder().clusters(clusters).start().await?;
    for c in env.clusters() {
        fixture(&c.client()?).await?;
    }
    Ok(env)
}

fn cluster(env: &TestEnv, i: usize) -> Result<Arc<TestCluster>> {
    Ok(env.cluster(i).ok_or("no such cluster")?)
}

/// `Nop`: no fleet; the controller runs on the manager's local cluster.
async fn nop() -> Result {
    let env = env(1).await?;
    let host = cluster(&env, 0)?.client()?;
    let local = Cluster::new(ClusterName::from("local"), host);
    let demo = Demo::start(Manager::new(Nop::new()).with_local(local));
    demo.fed("local", 3).await?;
    println!("  the fleet is empty; the local cluster's 3 animals are fed");
    demo.finish().await
}

/// `ClusterApi`: Cluster API `Cluster` objects on a management cluster (Cluster API's own CRD,
/// from `scripts/provider-assets.sh`), each with the kubeconfig Secret Cluster API writes.
async fn cluster_api() -> Result {
    use kube::api::{ApiResource, DynamicObject, GroupVersionKind};
    let assets = std::env::var("MCR_PROVIDER_ASSETS")
        .map_err(|_| "MCR_PROVIDER_ASSETS is not set (scripts/example.sh sets it)")?;
    let env = env(3).await?;
    let management = cluster(&env, 0)?;
    let host = management.client()?;
    management
        .install_crds(&std::fs::read_to_string(format!(
            "{assets}/crds/cluster-api.yaml"
        ))?)
        .await?;
    create_namespace(&host, "capi", &[]).await?;
    let resource = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("cluster.x-k8s.io", "v1beta2", "Cluster"),
        "clusters",
    );
    let clusters: Api<DynamicObject> = Api::namespaced_with(host.clone(), "capi", &resource);
    let secrets: Api<Secret> = Api::namespaced(host.clone(), "capi");
    for (i, name) in [(1, "east"), (2, "west")] {
        let object = DynamicObject::new(name, &resource)
            .within("capi")
            .data(serde_json::json!({"spec": {"paused": false}}));
        clusters.create(&PostParams::default(), &object).await?;
        let secret = Secret {
            metadata: object_meta(&format!("{name}-kubeconfig"), Some("capi"), &[]),
            type_: Some("cluster.x-k8s.io/secret".into()),
            data: Some(BTreeMap::from([(
                "value".to_string(),
                ByteString(cluster(&env, i)?.kubeconfig().into()),
            )])),
            ..Default::default()
        };
        secrets.create(&PostParams::default(), &secret).await?;
    }
    let initialized = async |name: &str, ready: bool| -> Result {
        let status =
            serde_json::json!({"status": {"initialization": {"controlPlaneInitialized": ready}}});
        clusters
            .patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
            .await?;
        Ok(())
    };
    let demo = Demo::start(Manager::new(
        ClusterApi::new(host.clone()).namespace("capi"),
    ));
    println!("  Clusters capi/east and capi/west exist, their control planes not yet initialized");
    initialized("east", true).await?;
    demo.fed("capi/east", 3).await?;
    initialized("west", true).await?;
    demo.fed("capi/west", 3).await?;
    println!("  west's control plane no longer initialized:");
    initialized("west", false).await?;
    demo.gone("capi/west").await?;
    println!("  the Cluster east deleted:");
    clusters.delete("east", &DeleteParams::default()).await?;
    demo.gone("capi/east").await?;
    demo.finish().await
}

/// A token of a service account of `member` bound to cluster-admin (what a cluster manager
/// would hand out), for the hub-cluster demos.
async fn admin_token(member: &TestCluster, account: &str) -> Result<String> {
    use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
    use k8s_openapi::api::core::v1::ServiceAccount;
    use k8s_openapi::api::rbac::v1::{ClusterRoleBinding, RoleRef, Subject};
    let client = member.client()?;
    let pp = PostParams::default();
    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), "default");
    let account_object = ServiceAccount {
        metadata: object_meta(account, None, &[]),
        ..Default::default()
    };
    accounts.create(&pp, &account_object).await?;
    let binding = ClusterRoleBinding {
        metadata: object_meta(&format!("{account}-admin"), None, &[]),
        role_ref: RoleRef {
            api_group: Some("rbac.authorization.k8s.io".into()),
            kind: "ClusterRole".into(),
            name: "cluster-admin".into(),
        },
        subjects: Some(vec![Subject {
            kind: "ServiceAccount".into(),
            name: account.into(),
            namespace: Some("default".into()),
            ..Default::default()
        }]),
    };
    Api::<ClusterRoleBinding>::all(client)
        .create(&pp, &binding)
        .await?;
    let request = TokenRequest {
        spec: Some(TokenRequestSpec {
            expiration_seconds: Some(3600),
            ..Default::default()
        }),
        ..Default::default()
    };
    let answer = accounts
        .create_token_request(account, &pp, &request)
        .await?;
    Ok(answer
        .status
        .and_then(|s| s.token)
        .ok_or("no token in the answer")?)
}

/// `ClusterInventory`: `ClusterProfile` objects on a hub (the Cluster Inventory API's own
/// CRD), reached through the reference `secretreader` exec plugin (built from
/// cluster-inventory-api by `scripts/provider-assets.sh`), which reads each member's token
/// from a Secret on the hub.
async fn cluster_inventory() -> Result {
    use base64::Engine;
    use kube::api::{ApiResource, DynamicObject, GroupVersionKind};
    use multicluster_runtime::providers::{AccessProviders, ClusterInventory, ProfileNamespaces};
    let assets = std::env::var("MCR_PROVIDER_ASSETS")
        .map_err(|_| "MCR_PROVIDER_ASSETS is not set (scripts/example.sh sets it)")?;
    let env = env(3).await?;
    let hub = cluster(&env, 0)?;
    let host = hub.client()?;
    hub.install_crds(&std::fs::read_to_string(format!(
        "{assets}/crds/cluster-inventory-api.yaml"
    ))?)
    .await?;
    create_namespace(&host, "fleet", &[]).await?;
    let providers = AccessProviders::from_json(
        &serde_json::json!({"providers": [{"name": "secretreader", "execConfig": {
            "apiVersion": "client.authentication.k8s.io/v1",
            "command": format!("{assets}/bin/secretreader-plugin"),
            "provideClusterInfo": true,
            "env": [{"name": "KUBECONFIG", "value": hub.kubeconfig_path()}],
        }}]})
        .to_string(),
    )?;
    let resource = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("multicluster.x-k8s.io", "v1alpha1", "ClusterProfile"),
        "clusterprofiles",
    );
    let profiles: Api<DynamicObject> = Api::namespaced_with(host.clone(), "fleet", &resource);
    let tokens: Api<Secret> = Api::namespaced(host.clone(), "default");
    for (i, name) in [(1, "east"), (2, "west")] {
        let member = cluster(&env, i)?;
        let token = admin_token(&member, "fleet-reader").await?;
        let secret = Secret {
            metadata: object_meta(&format!("{name}-token"), None, &[]),
            data: Some(BTreeMap::from([(
                "token".to_string(),
                ByteString(token.into()),
            )])),
            ..Default::default()
        };
        tokens.create(&PostParams::default(), &secret).await?;
        let object = DynamicObject::new(name, &resource)
            .within("fleet")
            .data(serde_json::json!({"spec": {"clusterManager": {"name": "demo"}}}));
        profiles.create(&PostParams::default(), &object).await?;
        let status = serde_json::json!({"status": {"accessProviders": [{
            "name": "secretreader",
            "cluster": {
                "server": member.server(),
                "certificate-authority-data": base64::engine::general_purpose::STANDARD.encode(member.ca_pem()),
                "extensions": [{"name": "client.authentication.k8s.io/exec",
                                "extension": {"clusterName": format!("{name}-token")}}],
            },
        }]}});
        profiles
            .patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
            .await?;
    }
    let healthy = async |name: &str, healthy: bool| -> Result {
        let status = serde_json::json!({"status": {"conditions": [{
            "type": "ControlPlaneHealthy",
            "status": if healthy { "True" } else { "False" },
            "reason": "Demo", "message": "set by the demo",
            "lastTransitionTime": "2026-11-24T00:00:00Z",
        }]}});
        profiles
            .patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
            .await?;
        Ok(())
    };
    let demo = Demo::start(Manager::new(ClusterInventory::with_access_providers(
        host.clone(),
        providers,
        ProfileNamespaces::Only("fleet".into()),
    )));
    println!("  ClusterProfiles fleet/east and fleet/west exist, not yet healthy");
    healthy("east", true).await?;
    demo.fed("fleet/east", 3).await?;
    healthy("west", true).await?;
    demo.fed("fleet/west", 3).await?;
    println!("  both reached with the tokens the secretreader plugin read from the hub");
    println!("  west no longer healthy:");
    healthy("west", false).await?;
    demo.gone("fleet/west").await?;
    println!("  the ClusterProfile east deleted:");
    profiles.delete("east", &DeleteParams::default()).await?;
    demo.gone("fleet/east").await?;
    demo.finish().await
}

/// `KubeFed`: `KubeFedCluster` objects in `kube-federation-system` (KubeFed's own CRDs),
/// each with the token Secret `kubefedctl join` writes.
async fn kubefed() -> Result {
    use base64::Engine;
    use kube::api::{ApiResource, DynamicObject, GroupVersionKind};
    use multicluster_runtime::providers::KubeFed;
    let assets = std::env::var("MCR_PROVIDER_ASSETS")
        .map_err(|_| "MCR_PROVIDER_ASSETS is not set (scripts/example.sh sets it)")?;
    let env = env(3).await?;
    let hub = cluster(&env, 0)?;
    let host = hub.client()?;
    hub.install_crds(&std::fs::read_to_string(format!(
        "{assets}/crds/kubefed.yaml"
    ))?)
    .await?;
    let ns = "kube-federation-system";
    create_namespace(&host, ns, &[]).await?;
    let resource = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("core.kubefed.io", "v1beta1", "KubeFedCluster"),
        "kubefedclusters",
    );
    let members: Api<DynamicObject> = Api::namespaced_with(host.clone(), ns, &resource);
    let secrets: Api<Secret> = Api::namespaced(host.clone(), ns);
    for (i, name) in [(1, "east"), (2, "west")] {
        let member = cluster(&env, i)?;
        let token = admin_token(&member, "kubefed").await?;
        let secret = Secret {
            metadata: object_meta(&format!("{name}-secret"), Some(ns), &[]),
            data: Some(BTreeMap::from([(
                "token".to_string(),
                ByteString(token.into()),
            )])),
            ..Default::default()
        };
        secrets.create(&PostParams::default(), &secret).await?;
        let object = DynamicObject::new(name, &resource)
            .within(ns)
            .data(serde_json::json!({
                "spec": {
                    "apiEndpoint": member.server(),
                    "caBundle": base64::engine::general_purpose::STANDARD.encode(member.ca_pem()),
                    "secretRef": {"name": format!("{name}-secret")},
                }
            }));
        members.create(&PostParams::default(), &object).await?;
    }
    let ready = async |name: &str, ready: bool| -> Result {
        let status = serde_json::json!({"status": {"conditions": [{
            "type": "Ready",
            "status": if ready { "True" } else { "False" },
            "lastProbeTime": "2026-11-24T00:00:00Z",
            "lastTransitionTime": "2026-11-24T00:00:00Z",
        }]}});
        members
            .patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
            .await?;
        Ok(())
    };
    let demo = Demo::start(Manager::new(KubeFed::new(host.clone())));
    println!("  KubeFedClusters east and west joined, not yet ready");
    ready("east", true).await?;
    demo.fed(&format!("{ns}/east"), 3).await?;
    ready("west", true).await?;
    demo.fed(&format!("{ns}/west"), 3).await?;
    println!("  west unjoined (its KubeFedCluster deleted):");
    members.delete("west", &DeleteParams::default()).await?;
    demo.gone(&format!("{ns}/west")).await?;
    demo.finish().await
}

/// `Namespaces`: every namespace labelled demo=true of one host is a cluster.
async fn namespaces() -> Result {
    let env = env(1).await?;
    let host = cluster(&env, 0)?.client()?;
    let provider = Namespaces::new(host.clone()).labels("demo=true");
    let demo = Demo::start(Manager::new(provider.clone()));
    for ns in ["zoo", "jungle", "island"] {
        demo.fed(ns, 1).await?;
    }
    println!("  a namespace created while running:");
    create_namespace(&host, "savanna", &[("demo", "true")]).await?;
    create_animal(&host, "savanna", "lion", "animal").await?;
    demo.fed("savanna", 1).await?;
    println!("  island's label removed:");
    let unlabel = serde_json::json!({ "metadata": { "labels": { "demo": null } } });
    Api::<Namespace>::all(host)
        .patch("island", &PatchParams::default(), &Patch::Merge(&unlabel))
        .await?;
    demo.gone("island").await?;
    println!(
        "  {} clusters, {} watch of ConfigMaps on the host",
        demo.manager.fleet().len(),
        provider.host_watches()
    );
    demo.finish().await
}

/// `File`: every context of the kubeconfig files in a directory, hot-reloaded.
async fn file() -> Result {
    let env = env(2).await?;
    let dir = tempfile::tempdir()?;
    let (c0, c1) = (cluster(&env, 0)?, cluster(&env, 1)?);
    let write = |name: &str, text: &str| -> Result {
        // Written aside, then renamed into place: the provider never sees half a file.
        let tmp = dir.path().join(format!(".{name}.tmp"));
        std::fs::write(&tmp, text)?;
        std::fs::rename(&tmp, dir.path().join(name))?;
        Ok(())
    };
    write("first.yaml", c0.kubeconfig())?;
    let demo = Demo::start(Manager::new(File::new([dir.path()])));
    let first = file_cluster(dir.path(), "first.yaml", c0.name());
    demo.fed(&first, 3).await?;
    println!("  a second file written while running, and a malformed one (logged, retried):");
    write("broken.yaml", "clusters: [this is not a kubeconfig")?;
    write("second.yaml", c1.kubeconfig())?;
    demo.fed(&file_cluster(dir.path(), "second.yaml", c1.name()), 3)
        .await?;
    println!("  the first file deleted:");
    std::fs::remove_file(dir.path().join("first.yaml"))?;
    demo.gone(&first).await?;
    demo.finish().await
}

fn file_cluster(dir: &Path, file: &str, context: &str) -> String {
    format!("{}+{context}", dir.join(file).display())
}

/// `KubeconfigSecrets`: a Secret per cluster in namespace `fleet` of the host.
async fn secrets() -> Result {
    let env = env(3).await?;
    let host = cluster(&env, 0)?.client()?;
    create_namespace(&host, "fleet", &[]).await?;
    let secrets: Api<Secret> = Api::namespaced(host.clone(), "fleet");
    let secret = |name: &str, kubeconfig: &str| Secret {
        metadata: object_meta(
            name,
            Some("fleet"),
            &[(
                multicluster_runtime::providers::KUBECONFIG_SECRET_LABEL,
                "true",
            )],
        ),
        data: Some(BTreeMap::from([(
            "kubeconfig".to_string(),
            ByteString(kubeconfig.into()),
        )])),
        ..Default::default()
    };
    secrets
        .create(
            &PostParams::default(),
            &secret("east", cluster(&env, 1)?.kubeconfig()),
        )
        .await?;
    let demo = Demo::start(Manager::new(KubeconfigSecrets::new(host.clone(), "fleet")));
    demo.fed("east", 3).await?;
    println!("  a second Secret while running, and one whose kubeconfig runs a command:");
    secrets
        .create(
            &PostParams::default(),
            &secret("west", cluster(&env, 2)?.kubeconfig()),
        )
        .await?;
    let sneaky = cluster(&env, 2)?.kubeconfig().replace(
        "    client-certificate-data:",
        "    exec:\n      apiVersion: client.authentication.k8s.io/v1\n      command: /bin/sh\n      args: [\"-c\", \"echo pwned\"]\n      interactiveMode: Never\n    client-certificate-data:",
    );
    secrets
        .create(&PostParams::default(), &secret("sneaky", &sneaky))
        .await?;
    demo.fed("west", 3).await?;
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(host.clone(), "fleet");
    wait_for_async("the refusal recorded", async || {
        events.list(&Default::default()).await.is_ok_and(|l| {
            l.items
                .iter()
                .any(|e| e.reason.as_deref() == Some("KubeconfigRefused"))
        })
    })
    .await?;
    if demo.manager.cluster(&ClusterName::from("sneaky")).is_some() {
        return Err("a kubeconfig with an exec plugin was engaged".into());
    }
    println!("  sneaky refused (a Warning Event KubeconfigRefused on the Secret); not engaged");
    println!("  east's Secret deleted:");
    secrets.delete("east", &DeleteParams::default()).await?;
    demo.gone("east").await?;
    demo.finish().await
}

/// `ArgoCdClusters`: the cluster Secrets Argo CD keeps in its namespace.
async fn argocd() -> Result {
    let env = env(3).await?;
    let host = cluster(&env, 0)?.client()?;
    create_namespace(&host, "argocd", &[]).await?;
    let secrets: Api<Secret> = Api::namespaced(host.clone(), "argocd");
    // As Argo CD's declarative setup writes them: `server`, and `config` as JSON.
    let field = |kubeconfig: &str, key: &str| {
        let prefix = format!("{key}: ");
        kubeconfig
            .lines()
            .find_map(|l| l.trim().strip_prefix(&prefix).map(str::to_string))
            .unwrap_or_default()
    };
    let secret = |name: &str, server: &str, config: serde_json::Value| Secret {
        metadata: object_meta(
            name,
            Some("argocd"),
            &[(
                multicluster_runtime::providers::ARGOCD_SECRET_TYPE_LABEL,
                "cluster",
            )],
        ),
        string_data: Some(BTreeMap::from([
            ("name".to_string(), format!("{name}.example")),
            ("server".to_string(), server.to_string()),
            ("config".to_string(), config.to_string()),
        ])),
        ..Default::default()
    };
    let member = |i: usize| -> std::result::Result<
        (String, serde_json::Value),
        Box<dyn std::error::Error>,
    > {
        let c = cluster(&env, i)?;
        let k = c.kubeconfig();
        let config = serde_json::json!({ "tlsClientConfig": {
            "caData": field(k, "certificate-authority-data"),
            "certData": field(k, "client-certificate-data"),
            "keyData": field(k, "client-key-data"),
        }});
        Ok((c.server().to_string(), config))
    };
    let (server, config) = member(1)?;
    secrets
        .create(&PostParams::default(), &secret("east", &server, config))
        .await?;
    let demo = Demo::start(Manager::new(ArgoCdClusters::new(host.clone(), "argocd")));
    demo.fed("east", 3).await?;
    println!("  a second cluster Secret while running, and one whose config runs a command:");
    let (server, config) = member(2)?;
    secrets
        .create(&PostParams::default(), &secret("west", &server, config))
        .await?;
    let sneaky = serde_json::json!({ "execProviderConfig": { "command": "/bin/sh", "args": ["-c", "echo pwned"] } });
    secrets
        .create(&PostParams::default(), &secret("sneaky", &server, sneaky))
        .await?;
    demo.fed("west", 3).await?;
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(host.clone(), "argocd");
    wait_for_async("the refusal recorded", async || {
        events.list(&Default::default()).await.is_ok_and(|l| {
            l.items
                .iter()
                .any(|e| e.reason.as_deref() == Some("ClusterSecretRefused"))
        })
    })
    .await?;
    if demo.manager.cluster(&ClusterName::from("sneaky")).is_some() {
        return Err("a config with a command was engaged".into());
    }
    println!("  sneaky refused (a Warning Event ClusterSecretRefused on the Secret); not engaged");
    println!("  east's Secret deleted:");
    secrets.delete("east", &DeleteParams::default()).await?;
    demo.gone("east").await?;
    demo.finish().await
}

async fn wait_for_async(what: &str, mut done: impl AsyncFnMut() -> bool) -> Result {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !done().await {
        if Instant::now() > deadline {
            return Err(format!("timed out waiting for {what}").into());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}

/// A stand-in `kind` CLI: `kind get clusters` lists the files of `clusters/` beside it,
/// `kind get kubeconfig --name N` prints one.
const STAND_IN_KIND: &str = include_str!("../scripts/stand-in-kind.sh");

/// `Kind`: the clusters the `kind` CLI lists, polled.
async fn kind() -> Result {
    use std::os::unix::fs::PermissionsExt;
    let env = env(2).await?;
    let dir = tempfile::tempdir()?;
    let script = dir.path().join("kind");
    std::fs::write(&script, STAND_IN_KIND)?;
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755))?;
    let clusters = dir.path().join("clusters");
    std::fs::create_dir(&clusters)?;
    std::fs::write(clusters.join("dev"), cluster(&env, 0)?.kubeconfig())?;
    let provider = Kind::new()
        .command(&script)
        .interval(Duration::from_millis(500));
    let demo = Demo::start(Manager::new(provider));
    demo.fed("dev", 3).await?;
    println!("  `kind create cluster --name staging` (in effect):");
    std::fs::write(clusters.join("staging"), cluster(&env, 1)?.kubeconfig())?;
    demo.fed("staging", 3).await?;
    println!("  `kind delete cluster --name dev` (in effect):");
    std::fs::remove_file(clusters.join("dev"))?;
    demo.gone("dev").await?;
    demo.finish().await
}

/// `Multi`: a hand-managed cluster and the namespaces of another host, composed; a child
/// removed at run time takes its clusters with it.
async fn multi() -> Result {
    let env = env(2).await?;
    let multi = Multi::new();
    let by_hand = Clusters::new();
    by_hand.add(Cluster::from_config(
        ClusterName::from("c0"),
        cluster(&env, 0)?.config(),
    )?)?;
    multi.add("static", by_hand)?;
    let demo = Demo::start(Manager::new(multi.clone()));
    demo.fed("static#c0", 3).await?;
    println!("  a child provider added while running (the namespaces of another host):");
    multi.add(
        "tenants",
        Namespaces::new(cluster(&env, 1)?.client()?).labels("demo=true"),
    )?;
    for ns in ["zoo", "jungle", "island"] {
        demo.fed(&format!("tenants#{ns}"), 1).await?;
    }
    println!("  child `static` removed:");
    multi.remove("static");
    demo.gone("static#c0").await?;
    demo.finish().await
}

/// `ById`: the clusters of another provider (here `Clusters`, by hand) named by their own
/// KEP-2149 id, read from their `ClusterProperty` objects (a CRD written from the KEP).
async fn identity() -> Result {
    use kube::api::{DynamicObject, Patch};
    use multicluster_runtime::ClusterIdentity;
    use multicluster_runtime::providers::ById;
    let env = env(2).await?;
    let set_id = async |member: &TestCluster, id: &str| -> Result {
        let object = serde_json::json!({
            "apiVersion": "about.k8s.io/v1alpha1", "kind": "ClusterProperty",
            "metadata": {"name": "cluster.clusterset.k8s.io"}, "spec": {"value": id},
        });
        Api::<DynamicObject>::all_with(member.client()?, &ClusterIdentity::resource("v1alpha1"))
            .patch(
                "cluster.clusterset.k8s.io",
                &PatchParams::apply("demo").force(),
                &Patch::Apply(object),
            )
            .await?;
        Ok(())
    };
    for (i, id) in [(0, "alpha"), (1, "beta")] {
        let member = cluster(&env, i)?;
        member
            .install_crds(include_str!("../tests/crds/clusterproperty.yaml"))
            .await?;
        set_id(&member, id).await?;
    }
    let by_hand = Clusters::new();
    let demo = Demo::start(Manager::new(ById::new(by_hand.clone())));
    for (i, name) in [(0, "prod-eu"), (1, "prod-us")] {
        by_hand.add(Cluster::from_config(
            ClusterName::from(name),
            cluster(&env, i)?.config(),
        )?)?;
    }
    println!("  clusters prod-eu and prod-us added, with ids alpha and beta:");
    demo.fed("alpha", 3).await?;
    demo.fed("beta", 3).await?;
    println!("  prod-eu renamed europe by its provider; the fleet still calls it alpha:");
    let alpha = ClusterName::from("alpha");
    let before = demo.manager.cluster(&alpha).ok_or("alpha is not engaged")?;
    by_hand.remove(&ClusterName::from("prod-eu"));
    by_hand.add(Cluster::from_config(
        ClusterName::from("europe"),
        cluster(&env, 0)?.config(),
    )?)?;
    wait_for("alpha engaged again from europe", || {
        demo.manager
            .cluster(&alpha)
            .is_some_and(|c| !c.same_instance(&before))
    })
    .await?;
    println!("  alpha engaged again, from europe");
    demo.finish().await
}

#[tokio::main]
async fn main() -> Result {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .init();
    let all = [
        "nop",
        "multi",
        "file",
        "secrets",
        "argocd",
        "cluster-api",
        "cluster-inventory",
        "kubefed",
        "identity",
        "namespaces",
        "kind",
    ];
    let mut chosen: Vec<String> = std::env::args().skip(1).collect();
    if chosen.is_empty() {
        chosen = all.iter().map(|s| s.to_string()).collect();
    }
    for name in &chosen {
        println!("== {name} ==");
        let started = Instant::now();
        match name.as_str() {
            "nop" => nop().await?,
            "multi" => multi().await?,
            "file" => file().await?,
            "secrets" => secrets().await?,
            "argocd" => argocd().await?,
            "cluster-api" => cluster_api().await?,
            "cluster-inventory" => cluster_inventory().await?,
            "kubefed" => kubefed().await?,
            "identity" => identity().await?,
            "namespaces" => namespaces().await?,
            "kind" => kind().await?,
            other => return Err(format!("unknown provider {other:?}; one of {all:?}").into()),
        }
        println!("  ({:.1?})", started.elapsed());
    }
    Ok(())
}
