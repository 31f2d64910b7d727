//! [`Manager`]: runs a provider and the controllers that follow its fleet.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::{Cluster, Fleet, Provider, ProviderError};

type Task = Pin<Box<dyn Future<Output = ()> + Send + 'static>>;

/// Runs a [`Provider`], holds the engaged clusters (its [`Fleet`]) and the optional local
/// (host) cluster, and runs controllers until shutdown.
///
/// Controllers are built with [`Builder`](crate::Builder); they can be added before
/// [`Manager::run`] or while it runs, and each one reconciles every cluster engaged before or
/// after it started.
pub struct Manager<P: Provider> {
    provider: Arc<P>,
    fleet: Fleet<P::Id>,
    local: Option<Cluster<P::Id>>,
    shutdown: CancellationToken,
    graceful_timeout: Duration,
    tasks_tx: mpsc::UnboundedSender<Task>,
    tasks_rx: Mutex<Option<mpsc::UnboundedReceiver<Task>>>,
}

/// Why [`Manager::run`] failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ManagerError {
    /// The provider returned an error.
    #[error("provider failed: {0}")]
    Provider(#[source] ProviderError),
    /// A controller panicked; the manager shut down.
    #[error("a controller panicked: {0}")]
    ControllerPanicked(String),
    /// `run` was called twice.
    #[error("the manager is already running")]
    AlreadyRunning,
}

impl<P: Provider> std::fmt::Debug for Manager<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Manager")
            .field("fleet", &self.fleet)
            .field("local", &self.local)
            .finish_non_exhaustive()
    }
}

/// The default bound on how long shutdown waits for reconciles in flight.
pub const DEFAULT_GRACEFUL_TIMEOUT: Duration = Duration::from_secs(30);

impl<P: Provider> Manager<P> {
    /// A manager for `provider`, with no local cluster and a graceful-shutdown bound of
    /// [`DEFAULT_GRACEFUL_TIMEOUT`].
    pub fn new(provider: P) -> Self {
        let (tasks_tx, tasks_rx) = mpsc::unbounded_channel();
        Self {
            provider: Arc::new(provider),
            fleet: Fleet::new(),
            local: None,
            shutdown: CancellationToken::new(),
            graceful_timeout: DEFAULT_GRACEFUL_TIMEOUT,
            tasks_tx,
            tasks_rx: Mutex::new(Some(tasks_rx)),
        }
    }

    /// Sets the local (host) cluster, the one the controller runs in or is configured for.
    /// Controllers engage it when built with [`Builder::engage_local`](crate::Builder::engage_local).
    #[must_use]
    pub fn with_local(mut self, cluster: Cluster<P::Id>) -> Self {
        self.local = Some(cluster);
        self
    }

    /// How long shutdown waits for reconciles in flight before abandoning them.
    #[must_use]
    pub fn graceful_timeout(mut self, timeout: Duration) -> Self {
        self.graceful_timeout = timeout;
        self
    }

    /// The provider.
    pub fn provider(&self) -> &P {
        &self.provider
    }

    /// The engaged clusters.
    pub fn fleet(&self) -> &Fleet<P::Id> {
        &self.fleet
    }

    /// The engaged cluster with this id, or the local cluster if it has this id.
    pub fn cluster(&self, id: &P::Id) -> Option<Cluster<P::Id>> {
        match &self.local {
            Some(local) if local.id() == id => Some(local.clone()),
            _ => self.fleet.get(id),
        }
    }

    /// Every engaged cluster (not including the local cluster).
    pub fn clusters(&self) -> Vec<Cluster<P::Id>> {
        self.fleet.clusters()
    }

    /// The local (host) cluster, if set.
    pub fn local(&self) -> Option<&Cluster<P::Id>> {
        self.local.as_ref()
    }

    /// Registers a field index on `K` objects in every cluster, present and future, and in
    /// the local cluster; see [`Fleet::index_field`].
    pub fn index_field<K: crate::Watchable>(
        &self,
        name: &str,
        extract: impl Fn(&K) -> Vec<String> + Send + Sync + 'static,
    ) {
        let extract = Arc::new(extract);
        if let Some(local) = &self.local {
            let extract = extract.clone();
            local.add_indexer(&crate::index::Indexer::new::<K>(name, move |k: &K| {
                extract(k)
            }));
        }
        self.fleet.index_field::<K>(name, move |k: &K| extract(k));
    }

    /// The token that stops the manager and its controllers when cancelled.
    pub fn shutdown_token(&self) -> CancellationToken {
        self.shutdown.clone()
    }

    /// Stops the manager: controllers stop taking work, let reconciles in flight finish
    /// (bounded by the graceful timeout), and [`Manager::run`] returns.
    pub fn shutdown(&self) {
        self.shutdown.cancel();
    }

    pub(crate) fn graceful(&self) -> Duration {
        self.graceful_timeout
    }

    /// Runs `task` (a controller) with the manager: from [`Manager::run`] if it has not
    /// started yet, at once otherwise.
    pub fn add(&self, task: impl Future<Output = ()> + Send + 'static) {
        // If run has returned, the receiver is gone and the task is dropped unrun, as
        // the manager is shut down.
        let _ = self.tasks_tx.send(Box::pin(task));
    }

    /// Runs the provider and every controller added with [`Manager::add`] (before or during
    /// the run) until [`Manager::shutdown`] or a provider error; then shuts controllers down
    /// gracefully and returns.
    pub async fn run(&self) -> Result<(), ManagerError> {
        let Some(mut tasks_rx) = self
            .tasks_rx
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        else {
            return Err(ManagerError::AlreadyRunning);
        };
        let provider = self
            .provider
            .run(self.fleet.clone(), self.shutdown.child_token());
        let mut provider = std::pin::pin!(provider);
        let mut provider_done = false;
        let mut result = Ok(());
        let mut tasks = FuturesUnordered::new();
        loop {
            tokio::select! {
                () = self.shutdown.cancelled() => break,
                res = &mut provider, if !provider_done => {
                    provider_done = true;
                    if let Err(e) = res {
                        tracing::error!(error = %e, "provider failed; shutting down");
                        result = Err(ManagerError::Provider(e));
                        self.shutdown.cancel();
                        break;
                    }
                }
                Some(task) = tasks_rx.recv() => tasks.push(tokio::spawn(task)),
                Some(joined) = tasks.next(), if !tasks.is_empty() => {
                    if let Err(error) = joined && error.is_panic() {
                        // A controller that died would leave its clusters unreconciled while
                        // everything looks alive; stop instead, loudly.
                        tracing::error!(%error, "a controller panicked; shutting down");
                        result = Err(ManagerError::ControllerPanicked(error.to_string()));
                        self.shutdown.cancel();
                        break;
                    }
                }
            }
        }
        // Controllers see the same token and wind down on their own, each within the
        // graceful timeout; wait for them a little longer than that.
        let drain = async { while tasks.next().await.is_some() {} };
        if tokio::time::timeout(
            self.graceful_timeout.saturating_add(Duration::from_secs(1)),
            drain,
        )
        .await
        .is_err()
        {
            tracing::warn!("controllers did not stop within the graceful timeout");
        }
        self.fleet.clear();
        result
    }
}

impl<P: Provider> Drop for Manager<P> {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::providers::Clusters;

    #[tokio::test]
    async fn a_panicking_controller_stops_the_manager_with_an_error() {
        let manager = Manager::new(Clusters::<crate::ClusterName>::new());
        manager.add(async { panic!("controller bug") });
        let result = tokio::time::timeout(Duration::from_secs(10), manager.run())
            .await
            .unwrap();
        assert!(
            matches!(result, Err(ManagerError::ControllerPanicked(ref m)) if m.contains("controller bug")),
            "{result:?}"
        );
        assert!(manager.shutdown_token().is_cancelled());
    }

    #[tokio::test]
    async fn run_returns_after_shutdown_and_refuses_a_second_run() {
        let manager = Arc::new(Manager::new(Clusters::<crate::ClusterName>::new()));
        let run = tokio::spawn({
            let manager = manager.clone();
            async move { manager.run().await }
        });
        tokio::task::yield_now().await;
        manager.shutdown();
        tokio::time::timeout(Duration::from_secs(10), run)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert!(matches!(
            manager.run().await,
            Err(ManagerError::AlreadyRunning)
        ));
    }
}
