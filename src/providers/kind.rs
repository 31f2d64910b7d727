//! [`Kind`]: the clusters of the local `kind` installation, found through its CLI.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::cluster::{Cluster, ClusterName};
use crate::fleet::Fleet;
use crate::provider::{Provider, ProviderError};

/// What `kind get clusters` prints when there are none.
const NO_CLUSTERS: &str = "No kind clusters found.";

/// The kind clusters of this machine, listed with `kind get clusters` every poll interval
/// (2 s by default) and engaged with the kubeconfig `kind get kubeconfig --name <name>`
/// prints. A cluster that disappears from the list is disengaged; one whose kubeconfig
/// changed is replaced. A cluster whose kubeconfig cannot be read or used is reported,
/// naming it, and retried with a growing delay (up to a minute); the others are not held up.
///
/// Cluster names are kind's, optionally only those starting with a prefix.
#[derive(Clone, Debug)]
pub struct Kind {
    command: PathBuf,
    prefix: Option<String>,
    interval: Duration,
}

impl Default for Kind {
    fn default() -> Self {
        Self::new()
    }
}

impl Kind {
    /// Runs `kind` from `PATH`, every cluster, polling every 2 s.
    pub fn new() -> Self {
        Self {
            command: PathBuf::from("kind"),
            prefix: None,
            interval: Duration::from_secs(2),
        }
    }

    /// Only clusters whose name starts with `prefix`.
    #[must_use]
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = Some(prefix.into());
        self
    }

    /// The `kind` executable to run (default: `kind` from `PATH`).
    #[must_use]
    pub fn command(mut self, command: impl Into<PathBuf>) -> Self {
        self.command = command.into();
        self
    }

    /// How often to list clusters (default 2 s).
    #[must_use]
    pub fn interval(mut self, interval: Duration) -> Self {
        self.interval = interval;
        self
    }

    async fn kind(&self, args: &[&str]) -> Result<String, String> {
        let output = tokio::process::Command::new(&self.command)
            .args(args)
            .kill_on_drop(true)
            .output()
            .await
            .map_err(|e| format!("cannot run {}: {e}", self.command.display()))?;
        if !output.status.success() {
            return Err(format!(
                "`{} {}` failed ({}): {}",
                self.command.display(),
                args.join(" "),
                output.status,
                String::from_utf8_lossy(&output.stderr).trim()
            ));
        }
        String::from_utf8(output.stdout).map_err(|_| "output is not UTF-8".to_string())
    }

    async fn list(&self) -> Result<Vec<String>, String> {
        let out = self.kind(&["get", "clusters"]).await?;
        Ok(out
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && *l != NO_CLUSTERS)
            .filter(|l| self.prefix.as_deref().is_none_or(|p| l.starts_with(p)))
            .map(String::from)
            .collect())
    }

    async fn kubeconfig(&self, name: &str) -> Result<String, String> {
        self.kind(&["get", "kubeconfig", "--name", name]).await
    }

    async fn cluster(name: &str, yaml: &str) -> Result<Cluster<ClusterName>, String> {
        let kubeconfig = super::kubeconfig::parse(yaml)?;
        super::cluster_from_kubeconfig(ClusterName::from(name), kubeconfig, None).await
    }
}

/// When a failing cluster is tried next, and how long to wait after the next failure.
struct Retry {
    at: Instant,
    delay: Duration,
}

const MAX_RETRY: Duration = Duration::from_secs(60);

impl Provider for Kind {
    type Id = ClusterName;

    async fn run(
        &self,
        fleet: Fleet<ClusterName>,
        shutdown: CancellationToken,
    ) -> Result<(), ProviderError> {
        let mut failing: HashMap<String, Retry> = HashMap::new();
        // The kubeconfig each engaged cluster was built from: an unchanged one is not
        // turned into a new client every poll.
        let mut engaged_from: HashMap<String, String> = HashMap::new();
        loop {
            match self.list().await {
                Err(error) => tracing::warn!(%error, "listing kind clusters failed; retrying"),
                Ok(names) => {
                    for id in fleet.ids() {
                        if !names.iter().any(|n| n == id.as_str()) {
                            fleet.disengage(&id);
                        }
                    }
                    failing.retain(|name, _| names.contains(name));
                    engaged_from.retain(|name, _| names.contains(name));
                    for name in names {
                        if failing.get(&name).is_some_and(|r| r.at > Instant::now()) {
                            continue;
                        }
                        let built = match self.kubeconfig(&name).await {
                            Ok(yaml) if engaged_from.get(&name) == Some(&yaml) => continue,
                            Ok(yaml) => Self::cluster(&name, &yaml).await.map(|c| (c, yaml)),
                            Err(error) => Err(error),
                        };
                        match built {
                            Ok((cluster, yaml)) => {
                                failing.remove(&name);
                                match fleet.engage(cluster) {
                                    Ok(_) => {
                                        engaged_from.insert(name, yaml);
                                    }
                                    Err(error) => {
                                        tracing::warn!(cluster = %name, %error, "could not engage kind cluster")
                                    }
                                }
                            }
                            Err(error) => {
                                let delay = failing
                                    .get(&name)
                                    .map_or(self.interval, |r| (r.delay * 2).min(MAX_RETRY));
                                tracing::warn!(cluster = %name, %error, retry_in = ?delay, "kind cluster unusable");
                                failing.insert(
                                    name,
                                    Retry {
                                        at: Instant::now() + delay,
                                        delay,
                                    },
                                );
                            }
                        }
                    }
                }
            }
            tokio::select! {
                () = shutdown.cancelled() => return Ok(()),
                () = tokio::time::sleep(self.interval) => {}
            }
        }
    }
}
