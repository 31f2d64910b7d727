//! Providers shipped with the crate.
//!
//! | provider | clusters | names | use |
//! | --- | --- | --- | --- |
//! | [`SingleProvider`] | exactly one, fixed | [`SingleCluster`](crate::SingleCluster) | single-cluster controllers; runs on kube-runtime's own `Controller` |
//! | [`Clusters`] | added, replaced and removed by calls | yours | tests and custom code |
//! | [`Nop`] | none | - | managers that only use their local cluster |
//! | [`Multi`] | those of its child providers, added and removed at run time | `<child>#<cluster>` | composing providers |
//! | `File` (feature `file`) | every context of kubeconfig files, directories and globs; hot-reloaded | `<path>+<context>` | static fleets, GitOps-managed kubeconfigs |
//! | [`KubeconfigSecrets`] | one per labelled Secret in a namespace of the host cluster | the Secret's name | fleets registered by writing Secrets; exec plugins and local files refused unless allowed |
//! | [`ArgoCdClusters`] | one per Argo CD cluster Secret (`argocd.argoproj.io/secret-type=cluster`) in Argo CD's namespace of the host cluster | the Secret's name | fleets already kept in Argo CD; exec and AWS helpers refused unless allowed |
//! | [`ClusterApi`] | one per ready Cluster API `Cluster` of a management cluster, from its `<name>-kubeconfig` Secret | `<namespace>/<name>` | fleets provisioned by Cluster API |
//! | [`ClusterInventory`] | one per healthy Cluster Inventory API `ClusterProfile` of a hub, through the operator's access providers (KEP-5339 exec plugins) or labelled kubeconfig Secrets | `<namespace>/<name>` | fleets registered by a cluster manager (OCM, Fleet, ...) |
//! | [`KubeFed`] | one per ready KubeFed `KubeFedCluster` of the KubeFed system namespace of a hub, with the token of its Secret | `<namespace>/<name>` | fleets joined to KubeFed |
//! | [`Namespaces`] | every namespace of a host cluster (optionally those matching a label selector) | the namespace | local fleets, tenants as namespaces; one watch per kind for all namespaces, scoped clients |
//! | [`Identified`] | those of another provider, with their KEP-2149 identity (`ClusterProperty`), optionally only one ClusterSet's | the other provider's | identity on each cluster |
//! | [`Placed`] | those of another provider (named `<namespace>/<name>` after ClusterProfiles) that the PlacementDecisions of a hub namespace matching a label selector select | the other provider's | engaging the clusters a scheduler places a workload on |
//! | [`ById`] | those of another provider that have a KEP-2149 id, optionally only one ClusterSet's | the cluster's own id (`cluster.clusterset.k8s.io`) | names that survive renames |
//! | `Kind` (feature `kind`) | the local kind clusters, polled through the `kind` CLI | kind's names | development |

mod argocd;
mod by_id;
mod cluster_api;
mod cluster_inventory;
mod clusters;
#[cfg(feature = "file")]
mod file;
mod hub;
mod join_renewal;
#[cfg(feature = "kind")]
mod kind;
mod kubeconfig;
mod kubeconfig_secrets;
mod kubefed;
mod multi;
mod namespace;
mod nop;
mod placement;
mod secret_fleet;
mod single;

pub use argocd::{ARGOCD_SECRET_TYPE_LABEL, ArgoCdClusters};
pub use by_id::{ById, Identified};
pub use cluster_api::ClusterApi;
#[cfg(feature = "fuzzing")]
pub(crate) use cluster_inventory::profile_may_set;
pub use cluster_inventory::{
    AccessProviders, AccessProvidersError, ClusterInventory, EXEC_EXTENSION, INHERITED_ENV,
    ProfileNamespaces,
};
pub use clusters::Clusters;
#[cfg(feature = "file")]
pub use file::{File, Naming};
pub use join_renewal::{
    JOINED_AS_LABEL, JoinRenewal, PREVIOUS_ANCHOR_ANNOTATION, SERVICE_ACCOUNT_ANNOTATION,
    TOKEN_ANCHOR_ANNOTATION, TOKEN_FOR_LABEL, TOKEN_RENEWAL_ANNOTATION, renewal_anchors,
};
#[cfg(feature = "kind")]
pub use kind::Kind;
#[cfg(feature = "fuzzing")]
pub(crate) use kubeconfig::describe_client;
pub use kubeconfig_secrets::{
    DEFAULT_KEY as KUBECONFIG_SECRET_KEY, DEFAULT_LABEL as KUBECONFIG_SECRET_LABEL,
    KubeconfigSecrets, TOKEN_EXPIRES_ANNOTATION,
};
#[cfg(feature = "fuzzing")]
pub(crate) use kubeconfig_secrets::{Trust, parse_kubeconfig};
pub use kubefed::KubeFed;
pub use multi::{DEFAULT_SEPARATOR, Multi, MultiError};
#[cfg(feature = "fuzzing")]
pub(crate) use namespace::{ApiPath, Target, is_plain_path, with_namespace};
pub use namespace::{ClusterScopedWrite, Namespaces, UnscopableRequest};
pub use nop::Nop;
pub use placement::{DECISION_KEY_LABEL, PLACEMENT_KEY_LABEL, Placed};
pub use single::SingleProvider;

/// The client configuration of `context` of `kubeconfig` (its current context if `None`);
/// the error says what is wrong in words fit for a log line, and holds nothing of the
/// kubeconfig. Reads the files the kubeconfig names; runs nothing.
pub(crate) async fn config_from_kubeconfig(
    kubeconfig: kube::config::Kubeconfig,
    context: Option<String>,
) -> Result<kube::Config, String> {
    let options = kube::config::KubeConfigOptions {
        context,
        ..Default::default()
    };
    kube::Config::from_custom_kubeconfig(kubeconfig, &options)
        .await
        .map_err(|e| kubeconfig::describe(&e))
}

/// The cluster `name`, reached through `context` of `kubeconfig` (its current context if
/// `None`); the error says what is wrong in words fit for a log line, and holds nothing
/// of the kubeconfig.
///
/// An exec credential plugin runs here (not on a worker, and killed with its children after
/// the plugin timeout, 30 s), so that one that fails is a refusal. Dropping the future (a
/// newer version of the source, a removed source) kills a plugin still running.
pub(crate) async fn cluster_from_kubeconfig(
    name: crate::cluster::ClusterName,
    kubeconfig: kube::config::Kubeconfig,
    context: Option<String>,
) -> Result<crate::cluster::Cluster<crate::cluster::ClusterName>, String> {
    let config = config_from_kubeconfig(kubeconfig, context).await?;
    let cluster = crate::cluster::Cluster::from_config(name, config)
        .map_err(|e| kubeconfig::describe_client(&e))?;
    cluster
        .credentials_ready()
        .await
        .map_err(|e| e.description().to_string())?;
    Ok(cluster)
}

/// The client builds in flight, by source (a Secret, an object): starting another build of
/// the same source, a newer version wanted, or the source gone ends the one before, and so
/// kills its credential plugin. No source has two plugins running at once.
pub(crate) struct InFlight<K: Ord>(
    std::collections::BTreeMap<K, (u64, futures::future::AbortHandle)>,
);

impl<K: Ord> Default for InFlight<K> {
    fn default() -> Self {
        Self(Default::default())
    }
}

impl<K: Ord> InFlight<K> {
    /// `build` of `version` of `key`, ended if another build of `key` starts or
    /// [`InFlight::supersede`] or [`InFlight::cancel`] says so; the build before (if any)
    /// ends now.
    pub(crate) fn start<F: std::future::Future>(
        &mut self,
        key: K,
        version: u64,
        build: F,
    ) -> futures::future::Abortable<F> {
        let (handle, registration) = futures::future::AbortHandle::new_pair();
        if let Some((_, before)) = self.0.insert(key, (version, handle)) {
            before.abort();
        }
        futures::future::Abortable::new(build, registration)
    }

    /// `version` of `key` is wanted now: a build of another version ends.
    pub(crate) fn supersede(&mut self, key: &K, version: u64) {
        if self.0.get(key).is_some_and(|(v, _)| *v != version) {
            self.cancel(key);
        }
    }

    /// `key`'s source is gone: its build ends.
    pub(crate) fn cancel(&mut self, key: &K) {
        if let Some((_, handle)) = self.0.remove(key) {
            handle.abort();
        }
    }

    /// The version of `key` being built, if any.
    pub(crate) fn building(&self, key: &K) -> Option<u64> {
        self.0.get(key).map(|(version, _)| *version)
    }

    /// The build of `version` of `key` is done; whether it was the one in flight (not
    /// superseded meanwhile).
    pub(crate) fn done(&mut self, key: &K, version: u64) -> bool {
        let current = self.building(key) == Some(version);
        if current {
            self.0.remove(key);
        }
        current
    }
}

/// The reason of the Warning Event on an object whose cluster could not be built.
pub(crate) const KUBECONFIG_REFUSED: &str = "KubeconfigRefused";

/// Records why `cluster` was not engaged as a Warning Event with `reason` on the object that
/// describes it; `note` must hold nothing of the kubeconfig.
pub(crate) async fn record_refusal_as(
    recorder: &kube_runtime::events::Recorder,
    reference: &k8s_openapi::api::core::v1::ObjectReference,
    cluster: &str,
    reason: &str,
    note: &str,
) {
    let event = kube_runtime::events::Event {
        type_: kube_runtime::events::EventType::Warning,
        reason: reason.into(),
        note: Some(note.chars().take(1000).collect()),
        action: "Engage".into(),
        secondary: None,
    };
    if let Err(error) = recorder.publish(&event, reference).await {
        tracing::warn!(%cluster, error = %crate::client::Shown(&error), "could not record the refusal as an Event");
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

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

    /// The processes a plugin started (it writes its own pid and its child's to `pids`)
    /// that still live.
    fn living(pids: &std::path::Path) -> Vec<i32> {
        std::fs::read_to_string(pids)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .filter(|&pid| alive(pid))
            .collect()
    }

    /// Ends whatever the plugin left (on the old code, processes a timeout abandoned).
    struct Reap(std::path::PathBuf);
    impl Drop for Reap {
        fn drop(&mut self) {
            for pid in living(&self.0) {
                let _ = std::process::Command::new("kill")
                    .args(["-9", &pid.to_string()])
                    .status();
            }
        }
    }

    /// A build given up on (the caller's timeout, a newer version of the kubeconfig, a
    /// removed source) ends its plugin, the plugin's own children too; so a plugin that
    /// always hangs, tried again each second ten times, never has more than one run alive.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_hanging_plugin_tried_again_each_second_leaves_at_most_one_process() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let pids = dir.path().join("pids");
        let _reap = Reap(pids.clone());
        let plugin = dir.path().join("plugin.sh");
        std::fs::write(
            &plugin,
            format!(
                "#!/bin/sh\necho $$ >> '{p}'\nsleep 3600 &\necho $! >> '{p}'\nwait\n",
                p = pids.display()
            ),
        )
        .unwrap();
        std::fs::set_permissions(&plugin, std::fs::Permissions::from_mode(0o755)).unwrap();
        let kubeconfig = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster: {{server: \"https://127.0.0.1:1\"}}\nusers:\n- name: u\n  user:\n    exec:\n      apiVersion: client.authentication.k8s.io/v1\n      command: \"{}\"\n      interactiveMode: Never\ncontexts:\n- name: c\n  context: {{cluster: c, user: u}}\ncurrent-context: c\n",
            plugin.display()
        );
        let mut most = 0;
        for attempt in 0..10 {
            let kubeconfig = kube::config::Kubeconfig::from_yaml(&kubeconfig).unwrap();
            let build = super::cluster_from_kubeconfig(
                crate::cluster::ClusterName::from("hangs"),
                kubeconfig,
                None,
            );
            assert!(
                tokio::time::timeout(Duration::from_secs(1), build)
                    .await
                    .is_err(),
                "attempt {attempt}: the plugin hangs, so the build cannot finish"
            );
            // Each attempt ran the plugin (which wrote its pid first).
            let runs = std::fs::read_to_string(&pids)
                .unwrap_or_default()
                .lines()
                .count();
            assert!(runs > attempt, "attempt {attempt}: {runs} pids written");
            // A process just killed may take a moment to be gone; a living one stays.
            let mut living_now = living(&pids).len();
            for _ in 0..50 {
                if living_now == 0 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
                living_now = living(&pids).len();
            }
            most = most.max(living_now);
        }
        assert_eq!(most, 0, "a run given up on leaves no process behind");
    }
}
