//! Shared fixtures: the zoo / jungle / island scenario and a reconciler that feeds animals.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams};
use multicluster_runtime::{Action, ClusterId, Context};

pub mod audited;
pub mod operator_process;

pub const NAMESPACES: [&str; 3] = ["zoo", "jungle", "island"];

pub fn config_map(ns: &str, name: &str, kind: &str) -> ConfigMap {
    ConfigMap {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some(ns.into()),
            labels: Some(BTreeMap::from([("type".to_string(), kind.to_string())])),
            ..Default::default()
        },
        ..Default::default()
    }
}

/// The fixture's ConfigMaps (not the apiserver's own ones in kube-system).
pub fn fixture_objects() -> kube_runtime::watcher::Config {
    kube_runtime::watcher::Config::default().labels("type")
}

/// Creates the namespace `ns`.
pub async fn create_namespace(client: &kube::Client, ns: &str) {
    let namespace = Namespace {
        metadata: ObjectMeta {
            name: Some(ns.into()),
            ..Default::default()
        },
        ..Default::default()
    };
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &namespace)
        .await
        .unwrap();
}

/// Creates the three namespaces, each with an animal, a human and a thing.
pub async fn fixture(client: &kube::Client) {
    for ns in NAMESPACES {
        create_namespace(client, ns).await;
        let cms: Api<ConfigMap> = Api::namespaced(client.clone(), ns);
        for (name, kind) in [
            ("elephant", "animal"),
            ("keeper", "human"),
            ("rock", "thing"),
        ] {
            cms.create(&PostParams::default(), &config_map(ns, name, kind))
                .await
                .unwrap();
        }
    }
}

/// What the reconciler saw: every request, as text (and, for [`record`], the object's
/// resourceVersion at each reconcile).
#[derive(Default)]
pub struct Seen {
    pub requests: Mutex<Vec<String>>,
    pub versions: Mutex<BTreeMap<String, Vec<String>>>,
}

impl Seen {
    /// Whether `request` was reconciled with its object at `version` ([`record`] only).
    pub fn reconciled_at(&self, request: &str, version: &str) -> bool {
        self.versions
            .lock()
            .unwrap()
            .get(request)
            .is_some_and(|v| v.iter().any(|seen| seen == version))
    }

    /// Whether every fixture object `client` reaches now was reconciled, as cluster
    /// `cluster`, at its current resourceVersion (what users care about, whatever relists
    /// added on the way).
    pub async fn reconciled_at_latest(&self, cluster: &str, client: &kube::Client) -> bool {
        let cms: Api<ConfigMap> = Api::all(client.clone());
        let listed = cms
            .list(&kube::api::ListParams::default().labels("type"))
            .await
            .unwrap();
        listed.items.iter().all(|cm| {
            let request = format!(
                "cluster://{cluster}/{}/{}",
                cm.metadata.namespace.as_deref().unwrap_or_default(),
                cm.metadata.name.as_deref().unwrap_or_default()
            );
            self.reconciled_at(
                &request,
                cm.metadata.resource_version.as_deref().unwrap_or_default(),
            )
        })
    }

    pub fn count(&self, request: &str) -> usize {
        self.requests
            .lock()
            .unwrap()
            .iter()
            .filter(|r| *r == request)
            .count()
    }
    pub fn total(&self) -> usize {
        self.requests.lock().unwrap().len()
    }
    pub fn clusters(&self) -> std::collections::BTreeSet<String> {
        self.requests
            .lock()
            .unwrap()
            .iter()
            .filter_map(|r| {
                r.strip_prefix("cluster://")?
                    .split('/')
                    .next()
                    .map(String::from)
            })
            .collect()
    }
}

/// The uniform reconciler: feeds animals (`data.stomach=food`) in whatever cluster it runs.
pub async fn feed_animals<C: ClusterId>(
    cm: Arc<ConfigMap>,
    ctx: Context<C, Seen>,
) -> Result<Action, kube::Error> {
    ctx.state()
        .requests
        .lock()
        .unwrap()
        .push(ctx.request().to_string());
    tracing::debug!("feed_animals reconciling");
    let is_animal = cm
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get("type"))
        .is_some_and(|t| t == "animal");
    let fed = cm
        .data
        .as_ref()
        .and_then(|d| d.get("stomach"))
        .is_some_and(|s| s == "food");
    if is_animal && !fed {
        let api: Api<ConfigMap> = Api::namespaced(
            ctx.client(),
            cm.metadata.namespace.as_deref().unwrap_or("default"),
        );
        let patch = serde_json::json!({ "data": { "stomach": "food" } });
        api.patch(
            &ctx.request().name,
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await?;
    }
    Ok(Action::await_change())
}

pub fn retry_soon<C: ClusterId, S>(
    _: Arc<ConfigMap>,
    _: &kube::Error,
    _: &Context<C, S>,
) -> Action {
    Action::requeue(Duration::from_millis(200))
}

/// Polls `check` every 100 ms until it returns true or `secs` pass.
pub async fn eventually(secs: u64, what: &str, mut check: impl AsyncFnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    loop {
        if check().await {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Whether the named ConfigMap has been fed.
pub async fn is_fed(client: &kube::Client, ns: &str, name: &str) -> bool {
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), ns);
    match api.get_opt(name).await {
        Ok(Some(cm)) => cm.data.and_then(|d| d.get("stomach").cloned()).as_deref() == Some("food"),
        _ => false,
    }
}

/// A reconciler (of any kind) that only records what it was asked to reconcile, and the
/// object's resourceVersion.
pub async fn record<K: kube::Resource, C: ClusterId>(
    object: Arc<K>,
    ctx: Context<C, Seen>,
) -> Result<Action, kube::Error> {
    let request = ctx.request().to_string();
    ctx.state()
        .versions
        .lock()
        .unwrap()
        .entry(request.clone())
        .or_default()
        .push(object.meta().resource_version.clone().unwrap_or_default());
    ctx.state().requests.lock().unwrap().push(request);
    Ok(Action::await_change())
}

/// A fleet cluster name.
pub fn name(s: &str) -> multicluster_runtime::ClusterName {
    multicluster_runtime::ClusterName::from(s)
}

/// The values of a ConfigMap's `type` label, for a field index.
pub fn label_type(cm: &ConfigMap) -> Vec<String> {
    cm.metadata
        .labels
        .iter()
        .flatten()
        .filter(|(k, _)| *k == "type")
        .map(|(_, v)| v.clone())
        .collect()
}

/// Runs the manager in the background until it is shut down.
pub fn spawn_manager<P: multicluster_runtime::Provider>(
    manager: &Arc<multicluster_runtime::Manager<P>>,
) -> tokio::task::JoinHandle<()> {
    let manager = manager.clone();
    tokio::spawn(async move { manager.run().await.unwrap() })
}

/// Whether namespace `ns` has an Event with `reason` about the object `name` whose note
/// contains `note`.
pub async fn has_event(
    client: &kube::Client,
    ns: &str,
    reason: &str,
    name: &str,
    note: &str,
) -> bool {
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(client.clone(), ns);
    events
        .list(&Default::default())
        .await
        .unwrap()
        .items
        .iter()
        .any(|e| {
            e.reason.as_deref() == Some(reason)
                && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name)
                && e.note.as_deref().unwrap_or_default().contains(note)
        })
}

/// A TCP relay in front of an apiserver, to open a real watch gap: [`Relay::cut`] drops every
/// connection through it and refuses new ones until [`Relay::restore`], while the apiserver
/// itself keeps serving direct clients. TLS passes through untouched (the serving
/// certificate names 127.0.0.1, whatever the port).
pub struct Relay {
    url: String,
    cut: tokio::sync::watch::Sender<u64>,
    task: tokio::task::JoinHandle<()>,
    /// Connections relayed so far, and those open now.
    accepted: Arc<std::sync::atomic::AtomicUsize>,
    open: Arc<std::sync::atomic::AtomicUsize>,
    /// Connections accepted before the `deaf`-th have what the server sends dropped rather
    /// than relayed.
    deaf: Arc<std::sync::atomic::AtomicUsize>,
}

impl Relay {
    /// A relay to `server` (`https://127.0.0.1:<port>`).
    pub async fn start(server: &str) -> Relay {
        let target = server.trim_start_matches("https://").to_string();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("https://{}", listener.local_addr().unwrap());
        // Odd values: cut. Every change ends the connections opened before it.
        let (cut, epochs) = tokio::sync::watch::channel(0u64);
        let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let open = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let deaf = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (accepted_, open_, deaf_) = (accepted.clone(), open.clone(), deaf.clone());
        let task = tokio::spawn(async move {
            let (accepted, open, deaf) = (accepted_, open_, deaf_);
            loop {
                let Ok((mut inbound, _)) = listener.accept().await else {
                    return;
                };
                let mut epochs = epochs.clone();
                if *epochs.borrow_and_update() % 2 == 1 {
                    drop(inbound);
                    continue;
                }
                let target = target.clone();
                let index = accepted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                open.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let (open, deaf) = (open.clone(), deaf.clone());
                tokio::spawn(async move {
                    if let Ok(outbound) = tokio::net::TcpStream::connect(&target).await {
                        use tokio::io::{AsyncReadExt, AsyncWriteExt};
                        let (mut from_client, mut to_client) = inbound.split();
                        let (mut from_server, mut to_server) = outbound.into_split();
                        let up = async {
                            let _ = tokio::io::copy(&mut from_client, &mut to_server).await;
                            let _ = to_server.shutdown().await;
                        };
                        let down = async {
                            let mut buf = vec![0u8; 16 * 1024];
                            while let Ok(n) = from_server.read(&mut buf).await {
                                if n == 0 {
                                    break;
                                }
                                if index >= deaf.load(std::sync::atomic::Ordering::SeqCst)
                                    && to_client.write_all(&buf[..n]).await.is_err()
                                {
                                    break;
                                }
                            }
                            let _ = to_client.shutdown().await;
                        };
                        tokio::select! {
                            _ = futures::future::join(up, down) => {}
                            _ = epochs.changed() => {}
                        }
                    }
                    open.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
                });
            }
        });
        Relay {
            url,
            cut,
            task,
            accepted,
            open,
            deaf,
        }
    }

    /// On the connections open now, what the server sends is dropped from now on (what the
    /// client sends still reaches it); connections accepted later are relayed both ways.
    pub fn deafen(&self) {
        self.deaf
            .store(self.accepted(), std::sync::atomic::Ordering::SeqCst);
    }

    /// Drops every connection open now; new ones are accepted as before.
    pub fn drop_connections(&self) {
        self.cut.send_modify(|e| *e += 2);
    }

    /// Connections accepted since the relay started.
    pub fn accepted(&self) -> usize {
        self.accepted.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Connections relayed now (a connection counts until both of its directions ended).
    pub fn open(&self) -> usize {
        self.open.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// `config` pointed at the relay.
    pub fn config(&self, mut config: kube::Config) -> kube::Config {
        config.cluster_url = self.url.parse().unwrap();
        config
    }

    /// Drops every connection and refuses new ones.
    pub fn cut(&self) {
        self.cut.send_modify(|e| {
            if *e % 2 == 0 {
                *e += 1
            }
        });
    }

    /// Accepts connections again.
    pub fn restore(&self) {
        self.cut.send_modify(|e| {
            if *e % 2 == 1 {
                *e += 1
            }
        });
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Sets a drop flag: tells whether a future was dropped (abandoned) rather than finished.
pub struct DropFlag(pub Arc<std::sync::atomic::AtomicBool>);

impl Drop for DropFlag {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

/// The `multicluster_runtime` log lines (DEBUG and above) of the whole test binary, from the
/// first [`Logs::capture`] on. Tests pick their own lines by the unique cluster names they
/// use (a thread-local subscriber would miss callsites whose interest another thread cached).
#[derive(Clone)]
pub struct Logs(Arc<Mutex<Vec<u8>>>);

impl Logs {
    /// Starts capturing (once per test binary).
    pub fn capture() -> Logs {
        static LOGS: std::sync::OnceLock<Logs> = std::sync::OnceLock::new();
        LOGS.get_or_init(|| {
            let logs = Logs(Arc::default());
            let writer = logs.clone();
            // This crate's lines, and the test binary's own (`<binary>::common`).
            let binary = module_path!().split("::").next().unwrap_or_default();
            tracing_subscriber::fmt()
                .with_env_filter(format!("multicluster_runtime=debug,{binary}=debug"))
                .with_ansi(false)
                .with_writer(move || writer.clone())
                .init();
            logs
        })
        .clone()
    }

    /// The captured lines that contain every one of `parts`.
    pub fn lines(&self, parts: &[&str]) -> Vec<String> {
        String::from_utf8_lossy(&self.0.lock().unwrap())
            .lines()
            .filter(|l| parts.iter().all(|p| l.contains(p)))
            .map(String::from)
            .collect()
    }
}

impl std::io::Write for Logs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A namespaced custom resource, `widgets.example.com/v1` `Widget`, with any fields.
pub const WIDGET_CRD: &str = r#"
---
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: widgets.example.com
spec:
  group: example.com
  names: {kind: Widget, plural: widgets, singular: widget}
  scope: Namespaced
  versions:
  - name: v1
    served: true
    storage: true
    schema:
      openAPIV3Schema:
        type: object
        properties:
          spec:
            type: object
            properties:
              size: {type: integer}
"#;

/// The state of [`gated`] reconciles, which start and then wait for a gate the test
/// controls.
pub struct Gated {
    pub started: AtomicUsize,
    pub finished: AtomicUsize,
    /// Reconciles dropped before they finished.
    pub dropped: AtomicUsize,
    gate: tokio::sync::watch::Receiver<bool>,
}

impl Gated {
    /// A closed gate (open it by sending `true`) and the state.
    pub fn new() -> (tokio::sync::watch::Sender<bool>, Arc<Gated>) {
        let (open, gate) = tokio::sync::watch::channel(false);
        let state = Gated {
            started: AtomicUsize::new(0),
            finished: AtomicUsize::new(0),
            dropped: AtomicUsize::new(0),
            gate,
        };
        (open, Arc::new(state))
    }
}

/// Counts a reconcile dropped before it finished.
struct Unfinished<'a>(&'a AtomicUsize, bool);

impl Drop for Unfinished<'_> {
    fn drop(&mut self) {
        if !self.1 {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
}

/// Counts itself started, waits for the gate, counts itself finished.
pub async fn gated<C: ClusterId>(
    _: Arc<ConfigMap>,
    ctx: Context<C, Gated>,
) -> Result<Action, kube::Error> {
    let state = ctx.state();
    state.started.fetch_add(1, Ordering::SeqCst);
    let mut guard = Unfinished(&state.dropped, false);
    let mut gate = state.gate.clone();
    let _ = gate.wait_for(|open| *open).await;
    state.finished.fetch_add(1, Ordering::SeqCst);
    guard.1 = true;
    Ok(Action::await_change())
}

/// A service account `account` of `member` (namespace `default`) bound to cluster-admin,
/// and a token for it (an hour long).
pub async fn service_account_token(
    member: &multicluster_runtime_testenv::TestCluster,
    account: &str,
) -> String {
    let client = member.client().unwrap();
    let pp = PostParams::default();
    let accounts: Api<k8s_openapi::api::core::v1::ServiceAccount> =
        Api::namespaced(client.clone(), "default");
    let mut sa = k8s_openapi::api::core::v1::ServiceAccount::default();
    sa.metadata.name = Some(account.into());
    accounts.create(&pp, &sa).await.unwrap();
    let bindings: Api<k8s_openapi::api::rbac::v1::ClusterRoleBinding> = Api::all(client.clone());
    bindings
        .create(
            &pp,
            &k8s_openapi::api::rbac::v1::ClusterRoleBinding {
                metadata: kube::api::ObjectMeta {
                    name: Some(format!("{account}-admin")),
                    ..Default::default()
                },
                role_ref: k8s_openapi::api::rbac::v1::RoleRef {
                    api_group: Some("rbac.authorization.k8s.io".into()),
                    kind: "ClusterRole".into(),
                    name: "cluster-admin".into(),
                },
                subjects: Some(vec![k8s_openapi::api::rbac::v1::Subject {
                    kind: "ServiceAccount".into(),
                    name: account.into(),
                    namespace: Some("default".into()),
                    ..Default::default()
                }]),
            },
        )
        .await
        .unwrap();
    let request = k8s_openapi::api::authentication::v1::TokenRequest {
        spec: Some(k8s_openapi::api::authentication::v1::TokenRequestSpec {
            expiration_seconds: Some(3600),
            ..Default::default()
        }),
        ..Default::default()
    };
    accounts
        .create_token_request(account, &pp, &request)
        .await
        .unwrap()
        .status
        .and_then(|s| s.token)
        .unwrap()
}

/// Who the engaged cluster `name` is authenticated as, asked of its apiserver
/// (`None` if it is not engaged or not authenticated).
pub async fn identity<P: multicluster_runtime::Provider<Id = multicluster_runtime::ClusterName>>(
    manager: &multicluster_runtime::Manager<P>,
    name: &str,
) -> Option<String> {
    let cluster = manager.cluster(&self::name(name))?;
    let reviews: Api<k8s_openapi::api::authentication::v1::SelfSubjectReview> =
        Api::all(cluster.client());
    let review = reviews
        .create(
            &PostParams::default(),
            &k8s_openapi::api::authentication::v1::SelfSubjectReview::default(),
        )
        .await
        .ok()?;
    review.status?.user_info?.username
}

// The example operator's process and endpoints (tests/endpoints.rs, tests/operator.rs,
// tests/cli.rs, tests/sharding.rs; the process itself: operator_process.rs).

/// The value of the series `name` whose labels include `labels`, in Prometheus text.
pub fn sample(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    text.lines().find_map(|line| {
        let rest = line.strip_prefix(name)?;
        let (label_text, value) = match rest.strip_prefix('{') {
            Some(rest) => rest.split_once("} ")?,
            None => ("", rest.strip_prefix(' ')?),
        };
        labels
            .iter()
            .all(|(k, v)| label_text.contains(&format!("{k}=\"{v}\"")))
            .then(|| value.trim().parse().ok())?
    })
}

/// GET `path` from `addr` over plain HTTP/1.1: the status code and the body.
pub async fn http_get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = format!("GET {path} HTTP/1.1\r\nHost: probe\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    let status = response
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

/// The example binary, built (or found fresh) in this test's target directory.
pub fn operator_binary() -> std::path::PathBuf {
    built(&["--all-features", "--example", "operator"])
        .join("examples")
        .join("operator")
}

/// `mcr` (cli/), built (or found fresh) in this test's target directory.
pub fn mcr_binary() -> std::path::PathBuf {
    built(&["-p", "multicluster-runtime-cli", "--bin", "mcr"]).join("mcr")
}

/// Runs `cargo build ARGS` into this test's target directory; the profile's directory.
fn built(args: &[&str]) -> std::path::PathBuf {
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe.parent().unwrap().parent().unwrap().to_path_buf();
    let target_dir = profile_dir.parent().unwrap();
    let mut build = std::process::Command::new(env!("CARGO"));
    build
        .arg("build")
        .args(args)
        .arg("--target-dir")
        .arg(target_dir);
    if profile_dir.ends_with("release") {
        build.arg("--release");
    }
    let status = build
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .status()
        .unwrap();
    assert!(status.success(), "cargo build {args:?}");
    profile_dir
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `http_get`, or `Err` when nothing listens (yet).
pub async fn http_get_opt(addr: std::net::SocketAddr, path: &str) -> Result<(u16, String), ()> {
    if tokio::net::TcpStream::connect(addr).await.is_err() {
        return Err(());
    }
    Ok(http_get(addr, path).await)
}

/// Applies every document of `yaml` server-side, as `client`'s user.
pub async fn apply_manifests(client: &kube::Client, yaml: &str) {
    use kube::api::{DynamicObject, Patch, PatchParams};
    use kube::discovery::{Scope, pinned_kind};
    let docs: Vec<serde_json::Value> = serde_saphyr::from_multiple(yaml).unwrap();
    for doc in docs.into_iter().filter(|d| !d.is_null()) {
        let object: DynamicObject = serde_json::from_value(doc).unwrap();
        let types = object.types.clone().unwrap();
        let gvk = kube::api::GroupVersionKind::try_from(&types).unwrap();
        let (resource, caps) = pinned_kind(client, &gvk).await.unwrap();
        let api: Api<DynamicObject> = match (caps.scope, object.metadata.namespace.as_deref()) {
            (Scope::Namespaced, Some(ns)) => Api::namespaced_with(client.clone(), ns, &resource),
            _ => Api::all_with(client.clone(), &resource),
        };
        let name = object.metadata.name.clone().unwrap();
        api.patch(
            &name,
            &PatchParams::apply("operations-test"),
            &Patch::Apply(&object),
        )
        .await
        .unwrap_or_else(|e| panic!("applying {} {name}: {e}", gvk.kind));
    }
}

pub fn manifest(file: &str) -> String {
    std::fs::read_to_string(format!("{}/deploy/{file}", env!("CARGO_MANIFEST_DIR"))).unwrap()
}

// HTTPS endpoints: a client that accepts their certificates, tokens and their permissions.

/// Accepts any server certificate (the endpoints' own are self-signed), keeping none: the
/// test compares what was served itself.
#[derive(Debug)]
pub struct AnyCertificate;

impl rustls::client::danger::ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _: &rustls::pki_types::CertificateDer<'_>,
        _: &[rustls::pki_types::CertificateDer<'_>],
        _: &rustls::pki_types::ServerName<'_>,
        _: &[u8],
        _: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        _: &[u8],
        _: &rustls::pki_types::CertificateDer<'_>,
        _: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        Ok(rustls::client::danger::HandshakeSignatureValid::assertion())
    }

    fn verify_tls13_signature(
        &self,
        _: &[u8],
        _: &rustls::pki_types::CertificateDer<'_>,
        _: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        Ok(rustls::client::danger::HandshakeSignatureValid::assertion())
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        rustls::crypto::ring::default_provider()
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// A TLS client that accepts any server certificate.
pub fn any_certificate_tls() -> tokio_rustls::TlsConnector {
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .dangerous()
    .with_custom_certificate_verifier(Arc::new(AnyCertificate))
    .with_no_client_auth();
    tokio_rustls::TlsConnector::from(Arc::new(config))
}

/// An `AdmissionReview` of the creation of ConfigMap `name` in `namespace`, as a member's API
/// server sends one, its object's `data` being `data`.
pub fn config_map_review(
    name: &str,
    namespace: &str,
    data: serde_json::Value,
) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "00000000-0000-0000-0000-000000000001",
            "kind": {"group": "", "version": "v1", "kind": "ConfigMap"},
            "resource": {"group": "", "version": "v1", "resource": "configmaps"},
            "operation": "CREATE",
            "name": name,
            "namespace": namespace,
            "userInfo": {"username": "by-hand"},
            "object": {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": name, "namespace": namespace},
                "data": data,
            },
        },
    })
}

/// An HTTPS GET of `path` from `addr`, with `token` as bearer: the status, the body and the
/// certificate the server presented.
pub async fn https_get(
    addr: std::net::SocketAddr,
    path: &str,
    token: Option<&str>,
) -> (u16, String, Vec<u8>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let connector = any_certificate_tls();
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut tls = connector
        .connect(
            rustls::pki_types::ServerName::try_from("localhost").unwrap(),
            tcp,
        )
        .await
        .unwrap();
    let certificate = tls.get_ref().1.peer_certificates().unwrap()[0].to_vec();
    let authorization = token
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    let request =
        format!("GET {path} HTTP/1.1\r\nHost: probe\r\n{authorization}Connection: close\r\n\r\n");
    tls.write_all(request.as_bytes()).await.unwrap();
    let mut response = Vec::new();
    // A server closing without close_notify is fine here.
    let _ = tls.read_to_end(&mut response).await;
    let response = String::from_utf8_lossy(&response).to_string();
    let status = response
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body, certificate)
}

/// A service account `name` of `default` with no permission, and a token of it.
pub async fn account_token(client: &kube::Client, name: &str) -> String {
    account_token_in(client, "default", name).await
}

/// [`account_token`] for a ServiceAccount of `namespace`.
pub async fn account_token_in(client: &kube::Client, namespace: &str, name: &str) -> String {
    use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
    use k8s_openapi::api::core::v1::ServiceAccount;
    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), namespace);
    let mut account = ServiceAccount::default();
    account.metadata.name = Some(name.into());
    accounts
        .create(&PostParams::default(), &account)
        .await
        .unwrap();
    let request = TokenRequest {
        spec: Some(TokenRequestSpec {
            expiration_seconds: Some(3600),
            ..Default::default()
        }),
        ..Default::default()
    };
    accounts
        .create_token_request(name, &PostParams::default(), &request)
        .await
        .unwrap()
        .status
        .and_then(|s| s.token)
        .unwrap()
}

/// Lets the service account `account` of `default` `get` the non-resource URLs `urls`.
pub async fn grant_urls(client: &kube::Client, account: &str, urls: &[&str]) {
    use k8s_openapi::api::rbac::v1::{
        ClusterRole, ClusterRoleBinding, PolicyRule, RoleRef, Subject,
    };
    let pp = PostParams::default();
    let role = ClusterRole {
        metadata: kube::api::ObjectMeta {
            name: Some(format!("{account}-urls")),
            ..Default::default()
        },
        rules: Some(vec![PolicyRule {
            non_resource_urls: Some(urls.iter().map(|u| u.to_string()).collect()),
            verbs: vec!["get".into()],
            ..Default::default()
        }]),
        ..Default::default()
    };
    Api::<ClusterRole>::all(client.clone())
        .create(&pp, &role)
        .await
        .unwrap();
    let binding = ClusterRoleBinding {
        metadata: kube::api::ObjectMeta {
            name: Some(format!("{account}-urls")),
            ..Default::default()
        },
        role_ref: RoleRef {
            api_group: Some("rbac.authorization.k8s.io".into()),
            kind: "ClusterRole".into(),
            name: format!("{account}-urls"),
        },
        subjects: Some(vec![Subject {
            kind: "ServiceAccount".into(),
            name: account.into(),
            namespace: Some("default".into()),
            ..Default::default()
        }]),
    };
    Api::<ClusterRoleBinding>::all(client.clone())
        .create(&pp, &binding)
        .await
        .unwrap();
}

/// Lets `user` use ConfigMaps with `verbs`, through the ClusterRole `role` (created if need
/// be) and a ClusterRoleBinding `<role>-<user>` (deleted to take it back).
pub async fn allow_config_maps(admin: &kube::Client, user: &str, role: &str, verbs: &[&str]) {
    use k8s_openapi::api::rbac::v1::{
        ClusterRole, ClusterRoleBinding, PolicyRule, RoleRef, Subject,
    };
    let cluster_role = ClusterRole {
        metadata: ObjectMeta {
            name: Some(role.into()),
            ..Default::default()
        },
        rules: Some(vec![PolicyRule {
            api_groups: Some(vec![String::new()]),
            resources: Some(vec!["configmaps".into()]),
            verbs: verbs.iter().map(|v| v.to_string()).collect(),
            ..Default::default()
        }]),
        ..Default::default()
    };
    // Already there for another user: kept.
    let _ = Api::<ClusterRole>::all(admin.clone())
        .create(&PostParams::default(), &cluster_role)
        .await;
    let binding = ClusterRoleBinding {
        metadata: ObjectMeta {
            name: Some(format!("{role}-{user}")),
            ..Default::default()
        },
        role_ref: RoleRef {
            api_group: Some("rbac.authorization.k8s.io".into()),
            kind: "ClusterRole".into(),
            name: role.into(),
        },
        subjects: Some(vec![Subject {
            kind: "User".into(),
            name: user.into(),
            api_group: Some("rbac.authorization.k8s.io".into()),
            ..Default::default()
        }]),
    };
    Api::<ClusterRoleBinding>::all(admin.clone())
        .create(&PostParams::default(), &binding)
        .await
        .unwrap();
}

/// A Secret of `KubeconfigSecrets` holding `kubeconfig` (key `kubeconfig`), with its label
/// when `labelled`.
pub fn kubeconfig_secret(
    name: &str,
    kubeconfig: &str,
    labelled: bool,
) -> k8s_openapi::api::core::v1::Secret {
    use k8s_openapi::ByteString;
    use std::collections::BTreeMap;
    k8s_openapi::api::core::v1::Secret {
        metadata: kube::api::ObjectMeta {
            name: Some(name.into()),
            labels: labelled.then(|| {
                BTreeMap::from([(
                    "sigs.k8s.io/multicluster-runtime-kubeconfig".to_string(),
                    "true".to_string(),
                )])
            }),
            ..Default::default()
        },
        data: Some(BTreeMap::from([(
            "kubeconfig".to_string(),
            ByteString(kubeconfig.as_bytes().to_vec()),
        )])),
        ..Default::default()
    }
}

/// Sets the `Ready` condition as KubeFed's health check does.
pub async fn set_kubefed_ready(members: &Api<kube::api::DynamicObject>, name: &str, ready: bool) {
    let status = if ready { "True" } else { "False" };
    members
        .patch_status(
            name,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"status": {"conditions": [{
                "type": "Ready", "status": status,
                "reason": if ready { "ClusterReady" } else { "ClusterNotReachable" },
                "lastProbeTime": "2026-11-24T00:00:00Z",
                "lastTransitionTime": "2026-11-24T00:00:00Z",
            }]}})),
        )
        .await
        .unwrap();
}

/// Runs `mcr ARGS`; its standard output, or a panic with both outputs.
pub fn mcr(binary: &std::path::Path, args: &[&str]) -> String {
    mcr_both(binary, args).0
}

/// Runs `mcr ARGS`, which must fail; its standard error.
pub fn mcr_refused(binary: &std::path::Path, args: &[&str]) -> String {
    let output = std::process::Command::new(binary)
        .args(args)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(!output.status.success(), "mcr {args:?} succeeded: {stderr}");
    stderr
}

/// Runs `mcr ARGS`, which must succeed; its standard output and standard error.
pub fn mcr_both(binary: &std::path::Path, args: &[&str]) -> (String, String) {
    let output = std::process::Command::new(binary)
        .args(args)
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    );
    assert!(
        output.status.success(),
        "mcr {args:?} failed:\n{stdout}\n{stderr}"
    );
    (stdout, stderr)
}
