//! The fleet set-up most tests share (a `Clusters` provider over a test environment's
//! clusters, a manager run in the background) and what tests wait and look for in it.

use super::*;

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

/// A fleet cluster name.
pub fn name(s: &str) -> multicluster_runtime::ClusterName {
    multicluster_runtime::ClusterName::from(s)
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

/// A `Clusters` provider holding each `(name, client)` as a cluster of that name: the fleet
/// most tests run a manager on.
pub fn clusters_of(
    members: impl IntoIterator<Item = (impl AsRef<str>, kube::Client)>,
) -> multicluster_runtime::providers::Clusters<multicluster_runtime::ClusterName> {
    let clusters = multicluster_runtime::providers::Clusters::new();
    for (id, client) in members {
        clusters
            .add(multicluster_runtime::Cluster::new(
                name(id.as_ref()),
                client,
            ))
            .unwrap();
    }
    clusters
}

/// Every cluster of `env`, by its own name (`cluster-0`, `cluster-1`, …), as their admin.
pub fn clusters_of_env(
    env: &multicluster_runtime_testenv::TestEnv,
) -> multicluster_runtime::providers::Clusters<multicluster_runtime::ClusterName> {
    clusters_of(
        env.clusters()
            .iter()
            .map(|c| (c.name().to_string(), c.client().unwrap())),
    )
}

/// [`clusters_of_env`], with the zoo scenario ([`fixture`]) created in every cluster first.
pub async fn zoo_fleet(
    env: &multicluster_runtime_testenv::TestEnv,
) -> multicluster_runtime::providers::Clusters<multicluster_runtime::ClusterName> {
    for c in env.clusters() {
        fixture(&c.client().unwrap()).await;
    }
    clusters_of_env(env)
}
