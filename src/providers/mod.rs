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
//! | [`ClusterApi`] | one per ready Cluster API `Cluster` of a management cluster, from its `<name>-kubeconfig` Secret | `<namespace>/<name>` | fleets provisioned by Cluster API |
//! | [`ClusterInventory`] | one per healthy Cluster Inventory API `ClusterProfile` of a hub, through the operator's access providers (KEP-5339 exec plugins) or labelled kubeconfig Secrets | `<namespace>/<name>` | fleets registered by a cluster manager (OCM, Fleet, ...) |
//! | [`KubeFed`] | one per ready KubeFed `KubeFedCluster` of the KubeFed system namespace of a hub, with the token of its Secret | `<namespace>/<name>` | fleets joined to KubeFed |
//! | [`Namespaces`] | every namespace of a host cluster (optionally those matching a label selector) | the namespace | local fleets, tenants as namespaces; one watch per kind for all namespaces, scoped clients |
//! | [`Identified`] | those of another provider, with their KEP-2149 identity (`ClusterProperty`), optionally only one ClusterSet's | the other provider's | identity on each cluster |
//! | [`ById`] | those of another provider that have a KEP-2149 id, optionally only one ClusterSet's | the cluster's own id (`cluster.clusterset.k8s.io`) | names that survive renames |
//! | `Kind` (feature `kind`) | the local kind clusters, polled through the `kind` CLI | kind's names | development |

mod cluster_api;
mod cluster_inventory;
mod clusters;
#[cfg(feature = "file")]
mod file;
mod hub;
mod identity;
#[cfg(feature = "kind")]
mod kind;
mod kubeconfig;
mod kubeconfig_secrets;
mod kubefed;
mod multi;
mod namespace;
mod nop;
mod single;

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
pub use identity::{ById, Identified};
#[cfg(feature = "kind")]
pub use kind::Kind;
#[cfg(feature = "fuzzing")]
pub(crate) use kubeconfig::describe_client;
pub use kubeconfig_secrets::{
    DEFAULT_KEY as KUBECONFIG_SECRET_KEY, DEFAULT_LABEL as KUBECONFIG_SECRET_LABEL,
    KubeconfigSecrets,
};
#[cfg(feature = "fuzzing")]
pub(crate) use kubeconfig_secrets::{Trust, parse_kubeconfig};
pub use kubefed::KubeFed;
pub use multi::{DEFAULT_SEPARATOR, Multi, MultiError};
#[cfg(feature = "fuzzing")]
pub(crate) use namespace::{ApiPath, Target, is_plain_path, with_namespace};
pub use namespace::{ClusterScopedWrite, Namespaces, UnscopableRequest};
pub use nop::Nop;
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

/// How long building a client may take: kube-client runs exec credential plugins
/// synchronously while building one, and a plugin can hang.
const CLIENT_BUILD_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// The cluster `name`, reached through `context` of `kubeconfig` (its current context if
/// `None`); the error says what is wrong in words fit for a log line, and holds nothing
/// of the kubeconfig.
pub(crate) async fn cluster_from_kubeconfig(
    name: crate::ClusterName,
    kubeconfig: kube::config::Kubeconfig,
    context: Option<String>,
) -> Result<crate::Cluster<crate::ClusterName>, String> {
    let config = config_from_kubeconfig(kubeconfig, context).await?;
    // Off the async workers, and bounded: an exec plugin that hangs costs one blocking
    // thread, not a worker, and is reported.
    let build = tokio::task::spawn_blocking(move || crate::Cluster::from_config(name, config));
    match tokio::time::timeout(CLIENT_BUILD_TIMEOUT, build).await {
        Ok(Ok(Ok(cluster))) => Ok(cluster),
        Ok(Ok(Err(e))) => Err(kubeconfig::describe_client(&e)),
        Ok(Err(e)) => Err(format!("building a client failed: {e}")),
        Err(_) => Err(format!(
            "building a client took more than {} s (a credential plugin that does not return?)",
            CLIENT_BUILD_TIMEOUT.as_secs()
        )),
    }
}

/// Records why `cluster` was not engaged as a Warning Event (`KubeconfigRefused`) on the
/// object that describes it; `note` must hold nothing of the kubeconfig.
pub(crate) async fn record_refusal(
    recorder: &kube_runtime::events::Recorder,
    reference: &k8s_openapi::api::core::v1::ObjectReference,
    cluster: &str,
    note: &str,
) {
    let event = kube_runtime::events::Event {
        type_: kube_runtime::events::EventType::Warning,
        reason: "KubeconfigRefused".into(),
        note: Some(note.chars().take(1000).collect()),
        action: "Engage".into(),
        secondary: None,
    };
    if let Err(error) = recorder.publish(&event, reference).await {
        tracing::warn!(%cluster, error = %crate::cluster::Shown(&error), "could not record the refusal as an Event");
    }
}
