//! Reconcilers and their state: one that feeds animals, one that records, one held at a gate.

use super::*;

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

/// Sets a drop flag: tells whether a future was dropped (abandoned) rather than finished.
pub struct DropFlag(pub Arc<std::sync::atomic::AtomicBool>);

impl Drop for DropFlag {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

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
