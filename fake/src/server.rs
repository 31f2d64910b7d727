//! [`ApiServer`]: one fake cluster, a `tower::Service` that `kube::Client` takes.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Duration;

use http::{Request, Response};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use serde_json::{Value, json};
use tokio::sync::watch;

use crate::faults::{Answering, Fault, Faults, Verb};
use crate::http::{ResponseBody, handle};
use crate::kinds::{self, Registry, Resource, Scope};
use crate::ops::{Behaviour, Target, WriteOptions};
use crate::store::{Store, watch_line};

/// One request the server received (recorded before faults are applied).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RequestRecord {
    /// The verb.
    pub verb: Verb,
    /// The resource's plural (`configmaps`).
    pub resource: String,
    /// The namespace of the URL, if any.
    pub namespace: Option<String>,
    /// The object's name, if the URL names one.
    pub name: Option<String>,
    /// The subresource (`status`), if any.
    pub subresource: Option<String>,
}

/// What a server holds; shared by every clone of its handle and every client.
pub(crate) struct Shared {
    pub(crate) name: String,
    store: Mutex<Store>,
    faults: Mutex<Faults>,
    pub(crate) answering: watch::Sender<Answering>,
    requests: Mutex<Vec<RequestRecord>>,
    gate: Mutex<Option<Arc<Gate>>>,
}

/// A request held until a schedule checker lets it through (or answers it with an error).
pub(crate) struct Parked {
    pub(crate) server: String,
    pub(crate) record: RequestRecord,
    pub(crate) answer: tokio::sync::oneshot::Sender<Option<u16>>,
}

/// Where the requests of gated servers wait: one for all the servers of a checked fleet.
#[derive(Default)]
pub(crate) struct Gate {
    pub(crate) parked: Mutex<Vec<Parked>>,
}

impl Gate {
    /// Waits until the checker lets the request through: `None` to serve it, or a status
    /// code to answer with instead.
    pub(crate) async fn park(&self, server: &str, record: RequestRecord) -> Option<u16> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        lock(&self.parked).push(Parked {
            server: server.to_owned(),
            record,
            answer: tx,
        });
        // A checker dropped with requests parked: serve them.
        rx.await.unwrap_or(None)
    }
}

/// Every parked request, taken out of the gate.
pub(crate) fn lock_parked(gate: &Gate) -> Vec<Parked> {
    std::mem::take(&mut *lock(&gate.parked))
}

/// Puts parked requests back (in their order).
pub(crate) fn put_parked(gate: &Gate, parked: Vec<Parked>) {
    let mut held = lock(&gate.parked);
    let newer = std::mem::take(&mut *held);
    *held = parked;
    held.extend(newer);
}

/// The parked requests: (server, request), in the order they came.
pub(crate) fn parked_records(gate: &Gate) -> Vec<(String, RequestRecord)> {
    lock(&gate.parked)
        .iter()
        .map(|p| (p.server.clone(), p.record.clone()))
        .collect()
}

/// The `i`-th parked request, taken out of the gate.
pub(crate) fn take_parked(gate: &Gate, i: usize) -> Option<Parked> {
    let mut held = lock(&gate.parked);
    (i < held.len()).then(|| held.remove(i))
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A test that panicked while holding the lock leaves the data as it was; keep serving.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Shared {
    pub(crate) fn store(&self) -> MutexGuard<'_, Store> {
        lock(&self.store)
    }

    pub(crate) fn faults(&self) -> MutexGuard<'_, Faults> {
        lock(&self.faults)
    }

    pub(crate) fn record(&self, r: RequestRecord) {
        lock(&self.requests).push(r);
    }

    pub(crate) fn gate(&self) -> Option<Arc<Gate>> {
        lock(&self.gate).clone()
    }
}

/// An in-memory Kubernetes API server: give [`ApiServer::client`] to the code under test and
/// every `Api<K>` call works as against a real cluster, in microseconds and without a
/// process. Cheap to clone; clones are the same server.
///
/// ```
/// use k8s_openapi::api::core::v1::ConfigMap;
/// use kube::api::{Api, PostParams};
/// use multicluster_runtime_fake::ApiServer;
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), kube::Error> {
/// let server = ApiServer::new("c0");
/// let cms: Api<ConfigMap> = Api::default_namespaced(server.client());
/// let mut cm = ConfigMap::default();
/// cm.metadata.name = Some("settings".into());
/// let created = cms.create(&PostParams::default(), &cm).await?;
/// assert!(created.metadata.uid.is_some());
/// assert_eq!(cms.get("settings").await?.metadata.resource_version, created.metadata.resource_version);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct ApiServer {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for ApiServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiServer")
            .field("name", &self.shared.name)
            .finish_non_exhaustive()
    }
}

/// How to make an [`ApiServer`]: its kinds, randomness and behaviour.
#[derive(Debug)]
#[must_use]
pub struct ApiServerBuilder {
    name: String,
    registry: Registry,
    seed: u64,
    history: usize,
    controllers: bool,
    namespaces: Vec<String>,
    objects: Vec<Value>,
}

impl ApiServerBuilder {
    /// Serves a built-in kind of k8s-openapi too (the defaults are listed at [`ApiServer::builder`]).
    pub fn kind<K>(mut self) -> Self
    where
        K: k8s_openapi::Resource,
        K::Scope: Scope,
    {
        self.registry.add(Resource::of::<K>());
        self
    }

    /// Serves a kind described by hand (a custom resource without its CRD object, or a
    /// built-in kind with traits the defaults do not know).
    pub fn resource(mut self, resource: Resource) -> Self {
        self.registry.add(resource);
        self
    }

    /// Installs a CRD, as if it had been created and become `Established`; its kind is
    /// served at once.
    pub fn crd(mut self, crd: CustomResourceDefinition) -> Self {
        if let Ok(v) = serde_json::to_value(&crd) {
            self.objects.push(v);
        }
        if let Some(r) = Resource::from_crd(&crd) {
            self.registry.add(r);
        }
        self
    }

    /// The seed of generated names and uids (the default is 0): the same seed and the same
    /// requests give the same names.
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// How many writes the server keeps for watches to resume from (the default is 10,000);
    /// a watch from before them gets 410 Gone and has to list again.
    pub fn history(mut self, writes: usize) -> Self {
        self.history = writes.max(1);
        self
    }

    /// Whether the server also does what a cluster's controller manager does after each
    /// write: owner-reference garbage collection (background, foreground, orphan) and the
    /// clean-up of a deleted namespace. On by default; a real API server alone (as the
    /// differential test runs it) does neither.
    pub fn controllers(mut self, on: bool) -> Self {
        self.controllers = on;
        self
    }

    /// Namespaces that exist from the start, besides `default`, `kube-system`, `kube-public`
    /// and `kube-node-lease`.
    pub fn namespace(mut self, name: impl Into<String>) -> Self {
        self.namespaces.push(name.into());
        self
    }

    /// An object that exists from the start (any kind the server serves; its namespace is
    /// made if missing).
    pub fn object<K: serde::Serialize>(mut self, object: &K) -> Self {
        if let Ok(v) = serde_json::to_value(object) {
            self.objects.push(v);
        }
        self
    }

    /// Makes the server.
    pub fn build(self) -> ApiServer {
        let behaviour = Behaviour {
            controllers: self.controllers,
        };
        let store = Store::new(self.registry, self.history, self.seed, behaviour);
        let (answering, _) = watch::channel(Answering::Yes);
        let server = ApiServer {
            shared: Arc::new(Shared {
                name: self.name,
                store: Mutex::new(store),
                faults: Mutex::new(Faults::default()),
                answering,
                requests: Mutex::new(Vec::new()),
                gate: Mutex::new(None),
            }),
        };
        let mut namespaces: Vec<String> =
            ["default", "kube-system", "kube-public", "kube-node-lease"]
                .iter()
                .map(|s| (*s).to_owned())
                .collect();
        namespaces.extend(self.namespaces);
        for o in &self.objects {
            if let Some(ns) = o.pointer("/metadata/namespace").and_then(Value::as_str) {
                namespaces.push(ns.to_owned());
            }
        }
        for ns in namespaces {
            let _ = server
                .insert(json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}));
        }
        for o in self.objects {
            let _ = server.insert(o);
        }
        server
    }
}

impl ApiServer {
    /// A server named `name` with the default kinds: Namespace, ConfigMap, Secret,
    /// ServiceAccount, Pod, Service, Event (core and `events.k8s.io`), Node, Deployment,
    /// ReplicaSet, StatefulSet, DaemonSet, Job, Lease, the RBAC kinds, the webhook
    /// configurations and CustomResourceDefinition.
    pub fn new(name: impl Into<String>) -> Self {
        Self::builder(name).build()
    }

    /// A server to configure.
    pub fn builder(name: impl Into<String>) -> ApiServerBuilder {
        let mut registry = Registry::default();
        for r in kinds::defaults() {
            registry.add(r);
        }
        ApiServerBuilder {
            name: name.into(),
            registry,
            seed: 0,
            history: 10_000,
            controllers: true,
            namespaces: Vec::new(),
            objects: Vec::new(),
        }
    }

    /// The server's name.
    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// A client of this server (default namespace `default`).
    pub fn client(&self) -> kube::Client {
        kube::Client::new(self.clone(), "default")
    }

    /// Creates an object as a client would (any kind the server serves), keeping a uid it
    /// gives. Returns the object as stored, or the `Status` of the refusal.
    pub fn insert(&self, object: Value) -> Result<Value, Value> {
        let mut store = self.shared.store();
        let api_version = object
            .get("apiVersion")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned();
        let kind = object
            .get("kind")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned();
        let resource = store
            .registry
            .by_kind(&api_version, &kind)
            .ok_or_else(|| json!({"message": format!("{api_version} {kind} is not served")}))?;
        let version = api_version
            .rsplit('/')
            .next()
            .unwrap_or_default()
            .to_owned();
        let namespace = object
            .pointer("/metadata/namespace")
            .and_then(Value::as_str)
            .map(str::to_owned);
        let t = Target {
            resource,
            version,
            namespace,
            name: None,
            subresource: None,
        };
        // A uid the test gives is kept, so that owner references among its objects hold.
        let o = WriteOptions {
            keep_uid: true,
            ..WriteOptions::default()
        };
        store.create(&t, object, &o).map_err(|e| e.to_status())
    }

    /// Every object of every kind, as stored (a view for assertions and traces).
    pub fn objects(&self) -> Vec<Value> {
        self.shared
            .store()
            .objects
            .values()
            .map(|v| (**v).clone())
            .collect()
    }

    /// The current resource version (it grows by one with every write).
    pub fn resource_version(&self) -> u64 {
        self.shared.store().rv
    }

    /// The requests served so far, oldest first, and forgets them.
    pub fn take_requests(&self) -> Vec<RequestRecord> {
        std::mem::take(&mut *lock(&self.shared.requests))
    }

    /// Turns a fault on (see [`Fault`]).
    pub fn inject(&self, fault: Fault) {
        self.shared.faults().rules.push(fault);
    }

    /// Turns every fault off, and answers again.
    pub fn heal(&self) {
        let mut f = self.shared.faults();
        f.rules.clear();
        f.latency = Duration::ZERO;
        drop(f);
        self.shared.answering.send_replace(Answering::Yes);
    }

    /// Every request waits this long before it is served.
    pub fn set_latency(&self, latency: Duration) {
        self.shared.faults().latency = latency;
    }

    /// Ends every open watch stream (clients see the stream end and watch again from their
    /// last version).
    pub fn cut_watches(&self) {
        self.shared.store().watchers.clear();
    }

    /// Forgets the history and ends every watch: a client that resumes from its last version
    /// gets 410 Gone and lists again.
    pub fn expire_watches(&self) {
        let mut store = self.shared.store();
        store.compact();
        store.watchers.clear();
    }

    /// Sends a bookmark at the current version to every watch that asked for bookmarks.
    pub fn bookmark(&self) {
        let store = self.shared.store();
        let rv = store.rv.to_string();
        for w in &store.watchers {
            if w.bookmarks {
                let b = json!({"kind": w.kind, "apiVersion": w.api_version, "metadata": {"resourceVersion": rv}});
                let _ = w.tx.send(watch_line("BOOKMARK", &b));
            }
        }
    }

    /// The server stops answering: requests wait and watches deliver nothing, until
    /// [`ApiServer::heal`] (a stopped process, a partition).
    pub fn stop_answering(&self) {
        self.shared.answering.send_replace(Answering::Hang);
    }

    /// The server refuses connections: requests fail at once and open watches end, until
    /// [`ApiServer::heal`].
    pub fn refuse_connections(&self) {
        self.shared.answering.send_replace(Answering::Refuse);
        self.shared.store().watchers.clear();
    }
}

/// One change, as the schedule checker reads it.
pub(crate) struct ChangeView {
    pub(crate) rv: u64,
    pub(crate) api_version: String,
    pub(crate) kind: String,
    /// The object after the change; `None` when it was deleted.
    pub(crate) new: Option<Value>,
    pub(crate) old: Option<Value>,
}

/// What the schedule checker reads and sets directly, past the HTTP surface (and its gate).
impl ApiServer {
    pub(crate) fn set_gate(&self, gate: Option<Arc<Gate>>) {
        *lock(&self.shared.gate) = gate;
    }

    /// The changes after `rv`, oldest first.
    pub(crate) fn changes_after(&self, rv: u64) -> Vec<ChangeView> {
        let store = self.shared.store();
        let Ok(changes) = store.since(rv) else {
            return Vec::new();
        };
        changes
            .map(|c| {
                let r = store.registry.get(c.key.resource);
                ChangeView {
                    rv: c.rv,
                    api_version: r.api_version(r.storage_version()),
                    kind: r.kind.clone(),
                    new: c.new.as_deref().cloned(),
                    old: c.old.as_deref().cloned(),
                }
            })
            .collect()
    }

    /// Whether objects of this kind live in namespaces (`None` when it is not served).
    pub(crate) fn namespaced(&self, api_version: &str, kind: &str) -> Option<bool> {
        let store = self.shared.store();
        store
            .registry
            .by_kind(api_version, kind)
            .map(|id| store.registry.get(id).namespaced)
    }

    /// The object of this kind, namespace and name, as stored.
    pub(crate) fn object(
        &self,
        api_version: &str,
        kind: &str,
        namespace: Option<&str>,
        name: &str,
    ) -> Option<Value> {
        let store = self.shared.store();
        let resource = store.registry.by_kind(api_version, kind)?;
        let key = crate::store::Key {
            resource,
            namespace: namespace.unwrap_or_default().to_owned(),
            name: name.to_owned(),
        };
        store.get(&key).map(|v| (**v).clone())
    }
}

impl tower_service::Service<Request<kube::client::Body>> for ApiServer {
    type Response = Response<ResponseBody>;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<kube::client::Body>) -> Self::Future {
        let shared = self.shared.clone();
        Box::pin(handle(shared, req))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
    use kube::api::{Api, DeleteParams, PostParams};

    #[tokio::test]
    async fn the_changes_of_a_deleted_crds_objects_are_read_without_a_panic() {
        let server = ApiServer::new("c0");
        let crd: CustomResourceDefinition = serde_json::from_value(json!({
            "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
            "metadata": {"name": "widgets.example.com"},
            "spec": {"group": "example.com", "scope": "Namespaced",
                     "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
                     "versions": [{"name": "v1", "served": true, "storage": true,
                                   "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}}}]}
        }))
        .unwrap();
        let crds = Api::<CustomResourceDefinition>::all(server.client());
        crds.create(&PostParams::default(), &crd).await.unwrap();
        server
            .insert(json!({"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w", "namespace": "default"}}))
            .unwrap();
        crds.delete("widgets.example.com", &DeleteParams::default())
            .await
            .unwrap();
        let changes = server.changes_after(0);
        let widget = changes
            .iter()
            .filter(|c| c.kind == "Widget")
            .map(|c| c.api_version.as_str())
            .collect::<Vec<_>>();
        assert_eq!(
            widget,
            ["example.com/v1", "example.com/v1"],
            "created, then deleted with its CRD"
        );
    }
}
