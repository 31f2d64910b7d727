//! [`KubeconfigSecrets`]: clusters from kubeconfigs stored in labelled Secrets of the host
//! cluster.

use k8s_openapi::api::core::v1::Secret;
use kube::config::Kubeconfig;
use kube::{Client, Resource, ResourceExt};
use tokio_util::sync::CancellationToken;

use super::join_renewal::JoinRenewal;
use super::secret_fleet::{SecretClusters, SecretFleet};
use crate::client::CredentialHolder;
use crate::cluster::{Cluster, ClusterName};
use crate::fleet::Fleet;
use crate::provider::{Provider, ProviderError};

/// The label that marks a Secret as holding a cluster's kubeconfig (value `true`).
pub const DEFAULT_LABEL: &str = "sigs.k8s.io/multicluster-runtime-kubeconfig";
/// The data key holding the kubeconfig.
pub const DEFAULT_KEY: &str = "kubeconfig";

/// One cluster per Secret in one namespace of the host cluster that carries the label
/// `sigs.k8s.io/multicluster-runtime-kubeconfig=true`; the cluster is named after the Secret
/// and reached with the kubeconfig in its data key `kubeconfig` (label, namespace and key
/// configurable).
///
/// Creating such a Secret engages its cluster; changing the kubeconfig re-engages it (only if
/// the endpoint or credentials changed); deleting the Secret or removing the label
/// disengages it.
///
/// Security: whoever can write a Secret in that namespace must not get to run commands in
/// the controller, nor make it use its own files. A kubeconfig with an `exec` credential
/// plugin or an `auth-provider` is therefore refused unless
/// [`KubeconfigSecrets::allow_exec`] is set, and one naming a local file (CA, client
/// certificate or key, token file) unless [`KubeconfigSecrets::allow_local_files`] is; the
/// refusal is logged and recorded as a Warning Event (`KubeconfigRefused`) on the Secret.
/// Malformed kubeconfigs are reported the same way, naming the Secret; the other clusters
/// are not affected. Each content of a Secret is reported once (a write to another field,
/// or a relist, repeats nothing), and the report holds no byte of the kubeconfig: the kind
/// of problem, its line and column, a field path. A refused update leaves a cluster engaged
/// from an earlier version as it was. Clients are built four at once, so a credential
/// plugin that hangs (up to 30 s) delays no other Secret.
#[derive(Clone)]
pub struct KubeconfigSecrets {
    host: Client,
    namespace: String,
    label: String,
    key: String,
    trust: Trust,
    renewal: Option<JoinRenewal>,
}

impl std::fmt::Debug for KubeconfigSecrets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeconfigSecrets")
            .field("namespace", &self.namespace)
            .field("label", &self.label)
            .field("key", &self.key)
            .field("allow_exec", &self.trust.exec)
            .field("allow_local_files", &self.trust.local_files)
            .field("renewal", &self.renewal)
            .finish_non_exhaustive()
    }
}

impl KubeconfigSecrets {
    /// Secrets in `namespace` of the cluster `host` reaches.
    pub fn new(host: Client, namespace: impl Into<String>) -> Self {
        Self {
            host,
            namespace: namespace.into(),
            label: DEFAULT_LABEL.to_string(),
            key: DEFAULT_KEY.to_string(),
            trust: Trust::default(),
            renewal: None,
        }
    }

    /// Another marker label (its value must be `true`).
    #[must_use]
    pub fn label(mut self, label: impl Into<String>) -> Self {
        self.label = label.into();
        self
    }

    /// Another data key for the kubeconfig.
    #[must_use]
    pub fn key(mut self, key: impl Into<String>) -> Self {
        self.key = key.into();
        self
    }

    /// Lets kubeconfigs run `exec` credential plugins and `auth-provider`s. Only for
    /// namespaces whose writers you would also let run code in this controller.
    #[must_use]
    pub fn allow_exec(mut self, allow: bool) -> Self {
        self.trust.exec = allow;
        self
    }

    /// Lets kubeconfigs name files of the controller's machine (`certificate-authority`,
    /// `client-certificate`, `client-key`, `tokenFile`). Refused by default: a Secret could
    /// otherwise have the controller send its own service account token
    /// (`tokenFile: /var/run/secrets/kubernetes.io/serviceaccount/token`) to a server of the
    /// writer's choosing, or read `/dev/zero` until it runs out of memory.
    #[must_use]
    pub fn allow_local_files(mut self, allow: bool) -> Self {
        self.trust.local_files = allow;
        self
    }

    /// Renews the tokens `mcr join --renewable` wrote before they end (off by default: it
    /// writes to members and to these Secrets). With the member's current token, a new token
    /// is requested for the member's ServiceAccount, bound to a new anchor Secret there; the
    /// kubeconfig Secret gets it (with its end and anchor in its annotations), and once the
    /// cluster is engaged with the new token the old one is revoked by deleting its anchor.
    /// A failed renewal is logged (WARN) and recorded as a Warning Event
    /// `TokenRenewalFailed` on the Secret, and retried. The provider's host identity then
    /// needs `patch` on these Secrets. See [`JoinRenewal`].
    #[must_use]
    pub fn renew_join_tokens(mut self, renewal: JoinRenewal) -> Self {
        self.renewal = Some(renewal);
        self
    }
}

impl SecretClusters for KubeconfigSecrets {
    const WHAT: &'static str = "kubeconfig Secret";
    const REFUSED_LINE: &'static str = "kubeconfig Secret refused";
    const REFUSED: &'static str = super::KUBECONFIG_REFUSED;
    const REPORTER: &'static str = "multicluster-runtime-kubeconfig-secrets";

    fn keys(&self) -> Vec<&str> {
        vec![self.key.as_str()]
    }

    /// The cluster a Secret describes, or why it cannot be used.
    async fn cluster(&self, secret: &Secret) -> Result<Cluster<ClusterName>, String> {
        let name = secret.name_any();
        let data = secret
            .data
            .as_ref()
            .and_then(|d| d.get(&self.key))
            .ok_or_else(|| format!("no data key {:?}", self.key))?;
        let kubeconfig = parse_kubeconfig(&data.0, self.trust)?;
        let cluster =
            super::cluster_from_kubeconfig(ClusterName::from(name), kubeconfig, None).await?;
        // The Secret holds the credential: its coming end is recorded there.
        let holder = CredentialHolder::new(self.host.clone(), secret.object_ref(&()))
            .ends_at(token_expiry(secret));
        Ok(cluster.with_credential_holder(holder))
    }

    fn credential_end(&self, secret: &Secret) -> Option<std::time::SystemTime> {
        token_expiry(secret)
    }
}

impl Provider for KubeconfigSecrets {
    type Id = ClusterName;

    async fn run(
        &self,
        fleet: Fleet<ClusterName>,
        shutdown: CancellationToken,
    ) -> Result<(), ProviderError> {
        SecretFleet {
            host: &self.host,
            namespace: &self.namespace,
            selector: format!("{}=true", self.label),
            source: self,
            renewal: self.renewal.map(|r| (r, self.key.clone())),
        }
        .run(fleet, shutdown)
        .await
    }
}

/// The annotation `mcr join` writes: when the token in the kubeconfig ends (RFC 3339).
pub const TOKEN_EXPIRES_ANNOTATION: &str = "multicluster-runtime.sigs.k8s.io/token-expires";

/// When `secret`'s token ends, if `mcr join` said so.
fn token_expiry(secret: &Secret) -> Option<std::time::SystemTime> {
    let text = secret.annotations().get(TOKEN_EXPIRES_ANNOTATION)?;
    let time: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time =
        serde_json::from_value(serde_json::Value::String(text.clone())).ok()?;
    let seconds = u64::try_from(time.0.as_second()).ok()?;
    std::time::SystemTime::UNIX_EPOCH.checked_add(std::time::Duration::from_secs(seconds))
}

/// What a kubeconfig from a Secret may do beyond talking to its server.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Trust {
    /// Run exec credential plugins and auth-providers.
    pub(crate) exec: bool,
    /// Read files of the controller's machine (CA, client certificate and key, token file).
    pub(crate) local_files: bool,
}

/// A kubeconfig as read from a Secret's data: UTF-8 YAML that, unless `trust` allows it,
/// neither runs commands (exec plugins, auth-providers) nor reads local files.
pub(crate) fn parse_kubeconfig(data: &[u8], trust: Trust) -> Result<Kubeconfig, String> {
    parse_trusted(data, trust, "kubeconfigs from Secrets")
}

/// A kubeconfig as `trust` lets it be (`what` says where it comes from, in the refusals).
pub(crate) fn parse_trusted(data: &[u8], trust: Trust, what: &str) -> Result<Kubeconfig, String> {
    let text = std::str::from_utf8(data).map_err(|_| "the kubeconfig is not UTF-8".to_string())?;
    let kubeconfig = super::kubeconfig::parse(text)?;
    // Entries are named by position: their names are the Secret's content too.
    for (i, user) in kubeconfig.auth_infos.iter().enumerate() {
        let Some(auth) = &user.auth_info else {
            continue;
        };
        if !trust.exec {
            let field = if auth.exec.is_some() {
                Some("exec")
            } else if auth.auth_provider.is_some() {
                Some("auth-provider")
            } else {
                None
            };
            if let Some(field) = field {
                return Err(format!(
                    "users[{i}].user.{field}: {what} may not run exec credential plugins or auth-providers (see the provider's allow_exec)"
                ));
            }
        }
        let files = [
            ("tokenFile", &auth.token_file),
            ("client-certificate", &auth.client_certificate),
            ("client-key", &auth.client_key),
        ];
        if !trust.local_files
            && let Some((field, _)) = files.iter().find(|(_, f)| f.is_some())
        {
            return Err(format!(
                "users[{i}].user.{field}: {what} may not read local files, it would send or use the controller's own files (see the provider's allow_local_files)"
            ));
        }
    }
    for (i, cluster) in kubeconfig.clusters.iter().enumerate() {
        if !trust.local_files
            && cluster
                .cluster
                .as_ref()
                .is_some_and(|c| c.certificate_authority.is_some())
        {
            return Err(format!(
                "clusters[{i}].cluster.certificate-authority: {what} may not read local files (see the provider's allow_local_files)"
            ));
        }
    }
    Ok(kubeconfig)
}
