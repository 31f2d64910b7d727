//! [`ClusterApi`]: the workload clusters of Cluster API `Cluster` objects on a management
//! cluster.

use std::future::Future;
use std::sync::Arc;

use kube::api::DynamicObject;
use kube::{Client, ResourceExt};
use kube_runtime::watcher;

use super::hub;
use super::hub::{HubKind, NoRecipe, Scope, Secrets};
use super::kubeconfig_secrets::{Trust, parse_kubeconfig};
use crate::cluster::{Cluster, ClusterName};

/// Cluster API's group.
pub const GROUP: &str = "cluster.x-k8s.io";
/// The type Cluster API gives the Secrets it writes (kubeconfigs, CAs).
pub const SECRET_TYPE: &str = "cluster.x-k8s.io/secret";
/// The data key of a kubeconfig Secret.
pub const KUBECONFIG_KEY: &str = "value";
/// What a kubeconfig Secret's name is, after the `Cluster`'s name.
const KUBECONFIG_SUFFIX: &str = "-kubeconfig";

/// One cluster per Cluster API `Cluster` object of the management cluster `host` reaches,
/// named `<namespace>/<name>`, reached with the kubeconfig Cluster API writes for it: the
/// Secret `<name>-kubeconfig` of the Cluster's namespace (type `cluster.x-k8s.io/secret`),
/// data key `value`.
///
/// `cluster.x-k8s.io/v1beta2` is watched where it is served, `v1beta1` otherwise. A Cluster
/// is engaged once it is ready: by default when `status.initialization.controlPlaneInitialized`
/// is true (v1beta2), or `status.controlPlaneReady` is true or `status.phase` is
/// `Provisioned` (v1beta1); [`ClusterApi::ready`] replaces the rule. It is disengaged for
/// good when deleted and when its deletion begins, paused ([`Fleet::pause`](crate::Fleet::pause))
/// when it stops being ready, and engaged again when it is ready again. The kubeconfig Secrets are watched too: a rotated kubeconfig replaces
/// the cluster (when its content changed), without waiting for the Cluster to change.
///
/// Of the Secrets of that type (Cluster API also writes CA, etcd and service-account keys
/// and bootstrap data in them), the provider keeps only the data key `value` of the
/// `<name>-kubeconfig` ones: the others are dropped as the watch delivers them.
///
/// The Secret is read under the same rules as [`KubeconfigSecrets`](super::KubeconfigSecrets):
/// exec plugins, auth-providers and local files are refused unless allowed. A ready Cluster
/// whose kubeconfig is missing or unusable gets a Warning Event (`KubeconfigRefused`) and a
/// log line, once per problem, holding nothing of the Secret; a cluster engaged from an
/// earlier kubeconfig stays engaged meanwhile (but is paused when its Secret is removed,
/// see [`ClusterApi::keep_when_credentials_removed`]), and no other cluster is affected. Until the
/// `Cluster` kind is served (Cluster API installed later), the provider looks again every
/// 10 s.
#[derive(Clone)]
pub struct ClusterApi {
    host: Client,
    scope: Scope,
    kind: Arc<Kind>,
}

/// The Cluster API specifics of the hub engine.
#[derive(Clone, Debug)]
struct Kind {
    trust: Trust,
}

impl std::fmt::Debug for ClusterApi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterApi")
            .field("scope", &self.scope)
            .field("allow_exec", &self.kind.trust.exec)
            .field("allow_local_files", &self.kind.trust.local_files)
            .finish_non_exhaustive()
    }
}

hub::hub_provider!(ClusterApi, "Clusters");

impl ClusterApi {
    /// Clusters of every namespace of the management cluster `host` reaches.
    pub fn new(host: Client) -> Self {
        Self {
            host,
            scope: Scope::default(),
            kind: Arc::new(Kind {
                trust: Trust::default(),
            }),
        }
    }

    /// Lets kubeconfigs run `exec` credential plugins and `auth-provider`s (see
    /// [`KubeconfigSecrets::allow_exec`](super::KubeconfigSecrets::allow_exec)).
    #[must_use]
    pub fn allow_exec(mut self, allow: bool) -> Self {
        Arc::make_mut(&mut self.kind).trust.exec = allow;
        self
    }

    /// Lets kubeconfigs name files of the controller's machine (see
    /// [`KubeconfigSecrets::allow_local_files`](super::KubeconfigSecrets::allow_local_files)).
    #[must_use]
    pub fn allow_local_files(mut self, allow: bool) -> Self {
        Arc::make_mut(&mut self.kind).trust.local_files = allow;
        self
    }
}

/// Cluster API's own readiness: the control plane is initialized.
fn default_ready(cluster: &DynamicObject) -> bool {
    let is_true = |path: &[&str]| hub::field(cluster, path).and_then(|v| v.as_bool()) == Some(true);
    let v1beta2 = cluster
        .types
        .as_ref()
        .is_none_or(|t| t.api_version.ends_with("/v1beta2"));
    if v1beta2 {
        is_true(&["status", "initialization", "controlPlaneInitialized"])
    } else {
        is_true(&["status", "controlPlaneReady"])
            || hub::field(cluster, &["status", "phase"]).and_then(|p| p.as_str())
                == Some("Provisioned")
    }
}

impl HubKind for Kind {
    /// The kubeconfig.
    type Recipe = Vec<u8>;

    const GROUP: &'static str = GROUP;
    const KIND: &'static str = "Cluster";
    const VERSIONS: &'static [&'static str] = &["v1beta2", "v1beta1"];
    const WHAT: &'static str = "Cluster API cluster";
    const REPORTER: &'static str = "multicluster-runtime-cluster-api";

    fn default_ready(&self, object: &DynamicObject) -> bool {
        default_ready(object)
    }

    fn secrets(&self) -> Option<watcher::Config> {
        // Only Cluster API's Secrets; of those, the kubeconfigs are looked up by name.
        Some(watcher::Config::default().fields(&format!("type={SECRET_TYPE}")))
    }

    fn reads_secret(&self, secret: &k8s_openapi::api::core::v1::Secret) -> bool {
        secret
            .metadata
            .name
            .as_deref()
            .is_some_and(|name| name.ends_with(KUBECONFIG_SUFFIX))
    }

    fn reads(&self, _name: &str, key: &str) -> bool {
        key == KUBECONFIG_KEY
    }

    fn recipe(
        &self,
        object: &DynamicObject,
        secrets: &Secrets,
    ) -> Result<(u64, Vec<u8>), NoRecipe> {
        let namespace = object.namespace().unwrap_or_default();
        let name = format!("{}{KUBECONFIG_SUFFIX}", object.name_any());
        let secret = secrets.get(&namespace, &name).ok_or_else(|| {
            NoRecipe::Revoked(format!(
                "the kubeconfig Secret {name} (type {SECRET_TYPE}) is not there"
            ))
        })?;
        let (version, bytes) = secret
            .data
            .get(KUBECONFIG_KEY)
            .ok_or_else(|| format!("the Secret {name} has no data key {KUBECONFIG_KEY:?}"))?;
        Ok((*version, bytes.clone()))
    }

    fn build(
        &self,
        name: ClusterName,
        kubeconfig: Vec<u8>,
    ) -> impl Future<Output = Result<Cluster<ClusterName>, String>> + Send + 'static {
        let trust = self.trust;
        async move {
            let kubeconfig = parse_kubeconfig(&kubeconfig, trust)?;
            super::cluster_from_kubeconfig(name, kubeconfig, None).await
        }
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::ByteString;
    use k8s_openapi::api::core::v1::Secret;

    use super::*;

    fn secret(name: &str, data: &[(&str, &str)]) -> Secret {
        let mut secret = Secret::default();
        secret.metadata.namespace = Some("fleet".into());
        secret.metadata.name = Some(name.into());
        secret.metadata.labels =
            Some([("cluster.x-k8s.io/cluster-name".into(), "c".into())].into());
        secret.data = Some(
            data.iter()
                .map(|(k, v)| (k.to_string(), ByteString(v.as_bytes().to_vec())))
                .collect(),
        );
        secret
    }

    #[test]
    fn of_cluster_apis_secrets_only_the_kubeconfigs_value_is_kept() {
        let kind = Kind {
            trust: Trust::default(),
        };
        let mut secrets = Secrets::default();
        secrets.insert(
            secret("c-ca", &[("tls.crt", "CERT"), ("tls.key", "CA-KEY")]),
            &kind,
        );
        secrets.insert(secret("c-etcd", &[("tls.key", "ETCD-KEY")]), &kind);
        secrets.insert(secret("c-sa", &[("tls.key", "SA-KEY")]), &kind);
        secrets.insert(
            secret(
                "c-kubeconfig",
                &[("value", "KUBECONFIG"), ("extra", "OTHER")],
            ),
            &kind,
        );
        assert_eq!(
            secrets
                .in_namespace("fleet")
                .map(|(name, _)| name)
                .collect::<Vec<_>>(),
            ["c-kubeconfig"]
        );
        let kept = secrets.get("fleet", "c-kubeconfig").unwrap();
        assert_eq!(kept.data.keys().collect::<Vec<_>>(), ["value"]);
        assert_eq!(kept.data["value"].1, b"KUBECONFIG");
    }
}
