//! [`ClusterInventory`]: the clusters of SIG Multicluster's Cluster Inventory API
//! (KEP-4322 `ClusterProfile` objects on a hub), reached through the access providers of
//! KEP-5339 or, deprecated, through kubeconfigs in labelled Secrets.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::path::Path;
use std::sync::Arc;

use kube::api::DynamicObject;
use kube::config::{AuthInfo, ExecConfig, ExecInteractiveMode, Kubeconfig};
use kube::{Client, ResourceExt};
use kube_runtime::watcher;
use serde::Deserialize;

use super::hub;
use super::hub::{HubKind, NoRecipe, Scope, Secrets, condition_true, field, kubeconfig_of};
use super::kubeconfig::{canonical_version_of, version_of};
use super::kubeconfig_secrets::{Trust, parse_kubeconfig};
use crate::cluster::{Cluster, ClusterName};

/// The Cluster Inventory API's group.
pub const GROUP: &str = "multicluster.x-k8s.io";
/// The condition a `ClusterProfile` is ready by (status `True`).
pub const HEALTHY_CONDITION: &str = "ControlPlaneHealthy";
/// The label naming the consumer a kubeconfig Secret is for (the deprecated Secret strategy).
pub const CONSUMER_LABEL: &str = "x-k8s.io/cluster-inventory-consumer";
/// The label naming the `ClusterProfile` a kubeconfig Secret is for.
pub const PROFILE_LABEL: &str = "x-k8s.io/cluster-profile";
/// The data key of a kubeconfig Secret.
pub const SECRET_KEY: &str = "Config";
/// The label that ties together the profiles of one member cluster (written by the cluster
/// managers, coordinated on a hub by its administrator).
pub const MEMBER_ID_LABEL: &str = "multicluster.x-k8s.io/inventory-member-id";
/// The cluster extension with arguments a profile adds to the plugin's (a list of strings).
pub const ARGS_EXTENSION: &str = "clusterprofiles.multicluster.x-k8s.io/exec/additional-args";
/// The cluster extension with environment variables a profile adds (a map of strings).
pub const ENVS_EXTENSION: &str = "clusterprofiles.multicluster.x-k8s.io/exec/additional-envs";

/// One cluster per `ClusterProfile` of the hub `host` reaches, named `<namespace>/<name>`;
/// read at `multicluster.x-k8s.io/v1alpha2` where the hub serves it, else at `v1alpha1`.
///
/// A profile is engaged once its condition `ControlPlaneHealthy` is `True`
/// ([`ClusterInventory::ready`] replaces the rule), disengaged for good when it is deleted
/// and when its deletion begins, and paused ([`Fleet::pause`](crate::Fleet::pause)) when it
/// stops being healthy. How a client is built:
///
/// - [`ClusterInventory::with_access_providers`] (KEP-5339): the profile's
///   `status.accessProviders` (and the deprecated `status.credentialProviders`; on a name
///   in both, `accessProviders` wins) give the server, CA and extensions; the operator's
///   [`AccessProviders`] give the exec plugin, of which the first in the file's order that
///   the profile lists is used. The plugin gets the profile's cluster (with the extension
///   `client.authentication.k8s.io/exec` as `spec.cluster.config`) when its configuration
///   asks for the cluster's information. The plugins are the operator's, so they run.
/// - [`ClusterInventory::with_secrets`] (deprecated upstream): a kubeconfig in the Secret
///   of the profile's namespace labelled `x-k8s.io/cluster-inventory-consumer=<consumer>`
///   and `x-k8s.io/cluster-profile=<profile>`, data key `Config`, read under the rules of
///   [`KubeconfigSecrets`](super::KubeconfigSecrets) (no exec plugins or local files unless
///   allowed). The Secrets are watched.
///
/// One member cluster, one engagement: profiles with the same member id (the label
/// `multicluster.x-k8s.io/inventory-member-id`), as two cluster managers each writing one for
/// the same cluster have, engage only the earliest created (then the first by namespace and
/// name) of those that are healthy and whose cluster can be built from what the hub holds.
/// The others get a Warning Event (`DuplicateMember`) and are not engaged; one engaged before
/// is paused once that profile's cluster is engaged. When that profile is deleted, stops
/// being healthy or loses its credentials, the next is engaged.
/// [`ClusterInventory::one_per_member`] turns this off. `v1alpha2` has no
/// `status.credentialProviders`: there, only `status.accessProviders` is read.
///
/// When what the cluster is built from changes (the profile's access data, the Secret), the
/// cluster is replaced. A profile whose cluster cannot be built (no access provider the
/// operator configured, a plugin failing, a Secret missing or malformed) gets a Warning Event
/// (`KubeconfigRefused`) and a log line, once per problem; a cluster engaged before stays
/// engaged meanwhile (with Secrets: unless its Secret is removed, see
/// [`ClusterInventory::keep_when_credentials_removed`]), and no other cluster is affected.
#[derive(Clone)]
pub struct ClusterInventory {
    host: Client,
    scope: Scope,
    kind: Arc<Kind>,
}

impl std::fmt::Debug for ClusterInventory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterInventory")
            .field("scope", &self.scope)
            .field("access", &self.kind.access)
            .finish_non_exhaustive()
    }
}

hub::hub_provider!(ClusterInventory, "ClusterProfiles");

/// How the clients are built.
#[derive(Clone, Debug)]
enum Access {
    Providers(AccessProviders),
    Secrets { consumer: String, trust: Trust },
}

/// The Cluster Inventory API specifics of the hub engine.
#[derive(Clone, Debug)]
struct Kind {
    access: Access,
    /// Profiles sharing a member id engage one cluster.
    one_per_member: bool,
}

/// Where a [`ClusterInventory`] reads `ClusterProfile`s. Whoever may write a profile's
/// status where it reads them chooses the server its credentials are sent to and what its
/// plugin is told: the choice is part of the trust model (see docs/providers.md), so it is
/// always made explicitly.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ProfileNamespaces {
    /// Only the namespace of the cluster manager (where only it and the hub's
    /// administrators write).
    Only(String),
    /// Every namespace the hub client can read: anyone who may write
    /// `clusterprofiles/status` in any namespace steers credentials.
    All,
}

impl ClusterInventory {
    /// The profiles of `namespaces` of the hub, reached through the operator's access
    /// providers (KEP-5339).
    pub fn with_access_providers(
        host: Client,
        providers: AccessProviders,
        namespaces: ProfileNamespaces,
    ) -> Self {
        Self::with(host, Access::Providers(providers), namespaces)
    }

    /// The profiles of `namespaces` of the hub, reached through kubeconfigs in the Secrets
    /// labelled for `consumer` (the Secret strategy, deprecated upstream).
    pub fn with_secrets(
        host: Client,
        consumer: impl Into<String>,
        namespaces: ProfileNamespaces,
    ) -> Self {
        Self::with(
            host,
            Access::Secrets {
                consumer: consumer.into(),
                trust: Trust::default(),
            },
            namespaces,
        )
    }

    fn with(host: Client, access: Access, namespaces: ProfileNamespaces) -> Self {
        Self {
            host,
            scope: Scope {
                namespace: match namespaces {
                    ProfileNamespaces::Only(namespace) => Some(namespace),
                    ProfileNamespaces::All => None,
                },
                ..Scope::default()
            },
            kind: Arc::new(Kind {
                access,
                one_per_member: true,
            }),
        }
    }

    /// With the Secret strategy: lets kubeconfigs run exec plugins and auth-providers (see
    /// [`KubeconfigSecrets::allow_exec`](super::KubeconfigSecrets::allow_exec)). The access
    /// providers' plugins are the operator's and always run.
    #[must_use]
    pub fn allow_exec(mut self, allow: bool) -> Self {
        if let Access::Secrets { trust, .. } = &mut Arc::make_mut(&mut self.kind).access {
            trust.exec = allow;
        }
        self
    }

    /// Whether profiles that give the same member id engage one cluster (the earliest
    /// created), as by default; with `false`, each profile is a cluster of its own.
    #[must_use]
    pub fn one_per_member(mut self, one: bool) -> Self {
        Arc::make_mut(&mut self.kind).one_per_member = one;
        self
    }

    /// With the Secret strategy: lets kubeconfigs name files of the controller's machine
    /// (see [`KubeconfigSecrets::allow_local_files`](super::KubeconfigSecrets::allow_local_files)).
    #[must_use]
    pub fn allow_local_files(mut self, allow: bool) -> Self {
        if let Access::Secrets { trust, .. } = &mut Arc::make_mut(&mut self.kind).access {
            trust.local_files = allow;
        }
        self
    }
}

/// The operator's access providers (KEP-5339): which exec credential plugin reaches the
/// clusters of which access provider, in the JSON of cluster-inventory-api's `pkg/access`:
///
/// ```json
/// {"providers": [{
///   "name": "secretreader",
///   "execConfig": {"apiVersion": "client.authentication.k8s.io/v1",
///                  "command": "/bin/secretreader-plugin", "provideClusterInfo": true},
///   "profileSourcedCLIArgsPolicy": "Ignore",
///   "profileSourcedEnvVarsPolicy": "AppendIfNotExists"
/// }]}
/// ```
///
/// Three fields are this crate's additions (upstream ignores them):
///
/// - `profileEnvAllowed`: the variables a profile may set for the plugin, where
///   `profileSourcedEnvVarsPolicy` lets profiles set any (none if absent). A profile
///   setting another is refused.
///
/// - `allowedServers`: the servers the provider's credentials may be sent to
///   (`https://host[:port]`, the host perhaps `*.domain`); a profile naming another is
///   refused. Any server if absent.
/// - `inheritEnv`: the variables of the controller's environment the plugin inherits
///   ([`INHERITED_ENV`] if absent). Every other variable is removed: the plugin's environment
///   is what the file (and, by the policies, the profile) sets plus these. Variables whose
///   names are not UTF-8 cannot be removed and stay.
///
/// The order is the operator's preference. A profile may add arguments
/// (extension `clusterprofiles.multicluster.x-k8s.io/exec/additional-args`, a list of
/// strings) only where `profileSourcedCLIArgsPolicy` is `Append`, and environment variables
/// (`.../additional-envs`, a map) only where `profileSourcedEnvVarsPolicy` is
/// `AppendIfNotExists` (the operator's values win) or `Replace` (the profile's win); the
/// default of both is `Ignore`. A profile may set only the variables its provider's
/// `profileEnvAllowed` lists, and whatever that list says, never one this crate knows to run
/// code, load settings or libraries, send requests elsewhere or re-trust them, or pick the
/// plugin's own credentials (`LD_*`, `PATH`, `BASH_ENV`, `SHELLOPTS`, `PS4`, `*_PROXY`,
/// `SSL_CERT_*`, `NODE_*`, `AWS_*`, `GOOGLE_*`, `KUBECONFIG`, `HOME` and more: the list
/// is in the book's providers chapter); such a profile is refused. That list cannot be complete for every
/// plugin: the allow-list is the boundary, the deny-list a second line. A variable the
/// plugin inherits from the controller is not overridden under `AppendIfNotExists`. With
/// `allowedServers`, a profile's `proxy-url` is refused too. Plugins run without a terminal
/// (`interactiveMode: Never`).
///
/// Of a profile's cluster, only `server`, `certificate-authority-data`, `proxy-url` and the
/// extension `client.authentication.k8s.io/exec` are used (as upstream's `pkg/access`);
/// `insecure-skip-tls-verify`, `tls-server-name` and `disable-compression` only with
/// [`AccessProviders::danger_profile_tls_overrides`].
#[derive(Clone, Debug, Deserialize)]
pub struct AccessProviders {
    providers: Vec<AccessProvider>,
    /// Profiles may turn TLS verification off and name another server name.
    #[serde(skip)]
    profile_tls_overrides: bool,
}

/// A provider's plugin as the file configures it.
#[cfg(feature = "fuzzing")]
pub(crate) struct PluginView<'a> {
    pub(crate) command: &'a str,
    pub(crate) args: &'a [String],
    pub(crate) env: Vec<(&'a String, &'a String)>,
    pub(crate) appends_args: bool,
    pub(crate) replaces_env: bool,
    pub(crate) allowed_env: &'a [String],
}

/// One access provider of the operator's file.
#[derive(Clone, Debug, Deserialize)]
struct AccessProvider {
    name: String,
    #[serde(rename = "execConfig", default)]
    exec: Option<ExecSpec>,
    #[serde(rename = "profileSourcedCLIArgsPolicy", default)]
    args_policy: ArgsPolicy,
    #[serde(rename = "profileSourcedEnvVarsPolicy", default)]
    envs_policy: EnvsPolicy,
    /// The servers this provider's credentials may be sent to (this crate's addition to
    /// the file); any if absent.
    #[serde(rename = "allowedServers", default)]
    allowed_servers: Option<Vec<ServerPattern>>,
    /// The variables of the controller's environment the plugin inherits (this crate's
    /// addition to the file); [`INHERITED_ENV`] if absent.
    #[serde(rename = "inheritEnv", default)]
    inherit_env: Option<Vec<String>>,
    /// The variables a profile may set for the plugin (this crate's addition); none if
    /// absent.
    #[serde(rename = "profileEnvAllowed", default)]
    profile_env_allowed: Vec<String>,
}

/// The variables of the controller's environment a plugin inherits unless its provider's
/// `inheritEnv` says otherwise: what finding programs, a home and a temporary directory, and
/// the in-cluster API server (for plugins that read their sources from the hub) need.
pub const INHERITED_ENV: &[&str] = &[
    "PATH",
    "HOME",
    "TMPDIR",
    "KUBERNETES_SERVICE_HOST",
    "KUBERNETES_SERVICE_PORT",
];

/// The cluster extension whose value the plugin gets as `spec.cluster.config`.
pub const EXEC_EXTENSION: &str = "client.authentication.k8s.io/exec";

/// Whether a profile may ever set the variable `name` for a plugin, whatever its provider
/// allows (the second line behind `profileEnvAllowed`): a plain name (letters, digits, `_`,
/// not starting with a digit: no `=` that would smuggle another variable past this check),
/// and not one known to change
/// - what code runs, or which libraries and settings load: `LD_*`, `DYLD_*`, `PATH`,
///   `BASH_ENV`, `ENV`, `SHELLOPTS`, `BASHOPTS`, `PS4`, `NODE_*`, `PYTHON*`, `PERL*`,
///   `RUBYOPT`, `RUBYLIB`, `*JAVA_OPTIONS`, `JAVA_TOOL_OPTIONS`, `LUA_*`, `GIT_*`,
///   `GCONV_PATH`, `OPENSSL_*`;
/// - where requests go or whom they trust: `*_PROXY`, `SSL_CERT_*`, `*_CA_BUNDLE`,
///   `*_CA_CERTS`;
/// - which identity or configuration the plugin takes: `KUBECONFIG`, `KUBERNETES_*`, the
///   cloud SDKs' (`AWS_*`, `AZURE_*`, `GOOGLE_*`, `CLOUDSDK_*`, `GCE_*`), `HOME`, `TMPDIR`,
///   `XDG_*`.
pub(crate) fn profile_may_set(name: &str) -> bool {
    let plain = name
        .bytes()
        .next()
        .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_')
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
    let upper = name.to_ascii_uppercase();
    const PREFIXES: &[&str] = &[
        "LD_",
        "DYLD_",
        "PYTHON",
        "PERL",
        "NODE_",
        "LUA_",
        "GIT_",
        "OPENSSL_",
        "SSL_CERT_",
        "KUBERNETES_",
        "AWS_",
        "AZURE_",
        "GOOGLE_",
        "CLOUDSDK_",
        "GCE_",
        "XDG_",
    ];
    const SUFFIXES: &[&str] = &["_PROXY", "_CA_BUNDLE", "_CA_CERTS", "JAVA_OPTIONS"];
    const NAMES: &[&str] = &[
        "PATH",
        "BASH_ENV",
        "ENV",
        "SHELLOPTS",
        "BASHOPTS",
        "PS4",
        "RUBYOPT",
        "RUBYLIB",
        "JAVA_TOOL_OPTIONS",
        "GCONV_PATH",
        "KUBECONFIG",
        "HOME",
        "TMPDIR",
    ];
    plain
        && !(PREFIXES.iter().any(|p| upper.starts_with(p))
            || SUFFIXES.iter().any(|s| upper.ends_with(s))
            || NAMES.contains(&upper.as_str()))
}

/// The variables of the controller's environment to remove from the plugin's: all but the
/// inherited ones and those the plugin is given (`set`).
fn not_inherited(set: &[(String, String)], inherit: Option<&[String]>) -> Vec<String> {
    let inherited = |name: &str| match inherit {
        Some(list) => list.iter().any(|n| n == name),
        None => INHERITED_ENV.contains(&name),
    };
    let mut names: Vec<String> = std::env::vars_os()
        .filter_map(|(name, _)| name.into_string().ok())
        .filter(|name| !inherited(name) && !set.iter().any(|(n, _)| n == name))
        .collect();
    names.sort_unstable();
    names
}

/// A server an access provider's credentials may go to: `https://host[:port]`, where the
/// host may start with `*.` for any name under a domain.
#[derive(Clone, Debug, PartialEq, Eq)]
struct ServerPattern {
    scheme: String,
    host: String,
    port: u16,
}

impl ServerPattern {
    fn parse(text: &str) -> Option<Self> {
        let uri: http::Uri = text.parse().ok()?;
        let scheme = uri.scheme_str()?.to_ascii_lowercase();
        let authority = uri.authority()?;
        let port = authority
            .port_u16()
            .unwrap_or(if scheme == "http" { 80 } else { 443 });
        if !matches!(uri.path(), "" | "/") || uri.query().is_some() {
            return None;
        }
        Some(Self {
            scheme,
            host: authority.host().to_ascii_lowercase(),
            port,
        })
    }

    /// Whether `server` (a profile's) is this one.
    fn matches(&self, server: &str) -> bool {
        let Some(server) = Self::parse(server) else {
            return false;
        };
        let host = match self.host.strip_prefix("*.") {
            Some(domain) => server
                .host
                .strip_suffix(domain)
                .is_some_and(|sub| sub.len() > 1 && sub.ends_with('.')),
            None => server.host == self.host,
        };
        host && server.scheme == self.scheme && server.port == self.port
    }
}

impl<'de> Deserialize<'de> for ServerPattern {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        Self::parse(&text).ok_or_else(|| {
            serde::de::Error::custom(format!(
                "{text:?} is not a server (https://host[:port], the host perhaps *.domain)"
            ))
        })
    }
}

/// An exec plugin as client-go's kubeconfig describes it.
#[derive(Clone, Debug, Deserialize)]
struct ExecSpec {
    #[serde(default)]
    command: String,
    #[serde(default)]
    args: Option<Vec<String>>,
    #[serde(default)]
    env: Option<Vec<EnvVar>>,
    #[serde(rename = "apiVersion", default)]
    api_version: Option<String>,
    #[serde(rename = "provideClusterInfo", default)]
    provide_cluster_info: bool,
}

#[derive(Clone, Debug, Deserialize)]
struct EnvVar {
    name: String,
    value: String,
}

/// Whether a profile may add arguments to the plugin's.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
enum ArgsPolicy {
    #[default]
    #[serde(rename = "Ignore", alias = "")]
    Ignore,
    Append,
}

/// Whether a profile may add environment variables to the plugin's.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
enum EnvsPolicy {
    #[default]
    #[serde(rename = "Ignore", alias = "")]
    Ignore,
    AppendIfNotExists,
    Replace,
}

/// An access providers file that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum AccessProvidersError {
    /// The file could not be read.
    #[error("reading the access providers file {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not valid.
    #[error("the access providers {0}")]
    Invalid(String),
}

impl AccessProviders {
    /// Reads the operator's file (the JSON above).
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, AccessProvidersError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| AccessProvidersError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_json(&text)
    }

    /// Parses the operator's file (the JSON above). Every provider needs a name (each
    /// once) and a command; the policies must be among those above.
    pub fn from_json(text: &str) -> Result<Self, AccessProvidersError> {
        // serde_json's text quotes the value it could not take (a secret in a mistyped
        // `args`, say): the position and the kind of mistake only.
        let parsed: Self = serde_json::from_str(text).map_err(|e| {
            let what = match e.classify() {
                serde_json::error::Category::Io | serde_json::error::Category::Syntax => "not JSON",
                serde_json::error::Category::Eof => "cut short",
                serde_json::error::Category::Data => {
                    "a value of the wrong type, a missing field or an unknown one"
                }
            };
            AccessProvidersError::Invalid(format!(
                "are not valid: {what} at line {}, column {}",
                e.line(),
                e.column()
            ))
        })?;
        let mut seen = std::collections::BTreeSet::new();
        for (i, provider) in parsed.providers.iter().enumerate() {
            if provider.name.is_empty() {
                return Err(AccessProvidersError::Invalid(format!(
                    "providers[{i}] has no name"
                )));
            }
            if !seen.insert(provider.name.as_str()) {
                return Err(AccessProvidersError::Invalid(format!(
                    "name {:?} more than once",
                    provider.name
                )));
            }
            if provider.exec.as_ref().is_some_and(|e| e.command.is_empty()) {
                return Err(AccessProvidersError::Invalid(format!(
                    "provider {:?}: execConfig has no command",
                    provider.name
                )));
            }
        }
        Ok(parsed)
    }

    /// Provider `name`'s plugin as the file configures it (for the fuzz target's checks).
    #[cfg(feature = "fuzzing")]
    pub(crate) fn plugin_of(&self, name: &str) -> Option<PluginView<'_>> {
        let provider = self.providers.iter().find(|p| p.name == name)?;
        let exec = provider.exec.as_ref()?;
        Some(PluginView {
            command: &exec.command,
            args: exec.args.as_deref().unwrap_or_default(),
            env: exec
                .env
                .iter()
                .flatten()
                .map(|v| (&v.name, &v.value))
                .collect(),
            appends_args: provider.args_policy == ArgsPolicy::Append,
            replaces_env: provider.envs_policy == EnvsPolicy::Replace,
            allowed_env: &provider.profile_env_allowed,
        })
    }

    /// Lets profiles turn off the verification of their server's certificate
    /// (`insecure-skip-tls-verify`), verify it against another name (`tls-server-name`) and
    /// turn off compression. Off by default, as in upstream's `pkg/access`: whoever can write
    /// a profile's status could otherwise have the credentials sent to a server that is
    /// not the one named.
    #[must_use]
    pub fn danger_profile_tls_overrides(mut self, allow: bool) -> Self {
        self.profile_tls_overrides = allow;
        self
    }

    /// The providers' names, in the file's order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.providers.iter().map(|p| p.name.as_str())
    }

    /// The first of the operator's providers that the profile lists.
    fn chosen(
        &self,
        entries: &BTreeMap<String, &serde_json::Value>,
    ) -> Result<&AccessProvider, String> {
        let Some(provider) = self
            .providers
            .iter()
            .find(|p| entries.contains_key(&p.name))
        else {
            let listed: Vec<&str> = entries.keys().map(String::as_str).collect();
            let configured: Vec<&str> = self.names().collect();
            return Err(format!(
                "no access provider of the profile ({}) is one this controller is configured for ({})",
                if listed.is_empty() {
                    "none listed".to_string()
                } else {
                    listed.join(", ")
                },
                configured.join(", ")
            ));
        };
        Ok(provider)
    }

    /// The cluster a kubeconfig may say of its cluster, as upstream's pkg/access takes it
    /// from what the profile wrote.
    fn cluster_of(&self, written: &kube::config::Cluster) -> kube::config::Cluster {
        // What the profile may say of its cluster, as upstream's pkg/access takes it: the
        // server, its CA's data, a proxy, and the plugin's configuration. A path on the
        // controller's machine (certificate-authority) is not the profile's to name; turning
        // verification off or trusting another name is the operator's choice to allow.
        let mut cluster = kube::config::Cluster {
            server: written.server.clone(),
            certificate_authority_data: written.certificate_authority_data.clone(),
            proxy_url: written.proxy_url.clone(),
            extensions: written.extensions.as_ref().map(|all| {
                all.iter()
                    .filter(|e| e.name == EXEC_EXTENSION)
                    .cloned()
                    .collect()
            }),
            ..Default::default()
        };
        if self.profile_tls_overrides {
            cluster.insecure_skip_tls_verify = written.insecure_skip_tls_verify;
            cluster.tls_server_name = written.tls_server_name.clone();
            cluster.disable_compression = written.disable_compression;
        }
        cluster
    }

    /// The kubeconfig that reaches the cluster of `profile`: its access entries by name
    /// (credentialProviders, then accessProviders over them), the first of the operator's
    /// providers the profile lists, that provider's plugin with what the policies let the
    /// profile add. Returns the provider's name with the kubeconfig.
    pub(crate) fn kubeconfig_for(
        &self,
        profile: &DynamicObject,
    ) -> Result<(String, Kubeconfig), String> {
        let entries = access_entries(profile);
        let provider = self.chosen(&entries)?;
        let name = &provider.name;
        let exec = provider
            .exec
            .as_ref()
            .ok_or_else(|| format!("access provider {name:?} has no execConfig"))?;
        let written = provider.written_cluster(entries[name])?;
        let extension = |wanted: &str| {
            written
                .extensions
                .iter()
                .flatten()
                .find(|e| e.name == wanted)
                .map(|e| e.extension.clone())
        };
        let cluster = self.cluster_of(&written);
        let mut args = exec.args.clone().unwrap_or_default();
        if let Some(extra) = extension(ARGS_EXTENSION)
            && provider.args_policy == ArgsPolicy::Append
        {
            let extra: Vec<String> = serde_json::from_value(extra).map_err(|_| {
                format!("the extension {ARGS_EXTENSION} of access provider {name:?} is not a list of strings")
            })?;
            args.extend(extra);
        }
        let env = provider.env_with(exec, extension(ENVS_EXTENSION))?;
        let drop_env = not_inherited(&env, provider.inherit_env.as_deref());
        let exec = ExecConfig {
            api_version: Some(
                exec.api_version
                    .clone()
                    .unwrap_or_else(|| "client.authentication.k8s.io/v1".into()),
            ),
            command: Some(exec.command.clone()),
            args: Some(args),
            env: Some(
                env.into_iter()
                    .map(|(name, value)| {
                        HashMap::from([("name".to_string(), name), ("value".to_string(), value)])
                    })
                    .collect(),
            ),
            drop_env: Some(drop_env),
            install_hint: None,
            interactive_mode: Some(ExecInteractiveMode::Never),
            provide_cluster_info: exec.provide_cluster_info,
            cluster: None,
            other: Default::default(),
        };
        let kubeconfig = kubeconfig_of(
            cluster,
            AuthInfo {
                exec: Some(exec),
                ..Default::default()
            },
        );
        Ok((name.clone(), kubeconfig))
    }
}

/// A profile's access entries by name: its credentialProviders, then its accessProviders
/// over them.
fn access_entries(profile: &DynamicObject) -> BTreeMap<String, &serde_json::Value> {
    let mut entries: BTreeMap<String, &serde_json::Value> = BTreeMap::new();
    for list in ["credentialProviders", "accessProviders"] {
        for entry in field(profile, &["status", list])
            .and_then(|l| l.as_array())
            .into_iter()
            .flatten()
        {
            if let Some(name) = entry.get("name").and_then(|n| n.as_str()) {
                entries.insert(name.to_string(), entry);
            }
        }
    }
    entries
}

impl AccessProvider {
    /// The cluster the profile's entry for this provider writes, checked: it has a server,
    /// one this provider allows, and no proxy where servers are pinned.
    fn written_cluster(&self, entry: &serde_json::Value) -> Result<kube::config::Cluster, String> {
        let name = &self.name;
        let written: kube::config::Cluster = entry
            .get("cluster")
            .cloned()
            .map(serde_json::from_value)
            .transpose()
            .map_err(|e| format!("access provider {name:?}: the cluster is not valid: {e}"))?
            .ok_or_else(|| format!("access provider {name:?} has no cluster"))?;
        let server = written.server.clone().unwrap_or_default();
        if server.is_empty() {
            return Err(format!(
                "access provider {name:?}: the cluster has no server"
            ));
        }
        if let Some(allowed) = &self.allowed_servers {
            if !allowed.iter().any(|pattern| pattern.matches(&server)) {
                return Err(format!(
                    "access provider {name:?}: the server {server} is not one this controller allows for it"
                ));
            }
            // A proxy of the profile's choosing would see (or answer) the allowed server's
            // traffic: where servers are pinned, so are the routes to them.
            if written.proxy_url.as_deref().is_some_and(|p| !p.is_empty()) {
                return Err(format!(
                    "access provider {name:?}: the profile names a proxy-url, which a provider with allowedServers does not take"
                ));
            }
        }
        Ok(written)
    }

    /// The plugin's environment: the provider's own, with what the profile's extension adds
    /// as the provider's policy lets it.
    fn env_with(
        &self,
        exec: &ExecSpec,
        extra: Option<serde_json::Value>,
    ) -> Result<Vec<(String, String)>, String> {
        let (name, provider) = (&self.name, self);
        let mut env: Vec<(String, String)> = exec
            .env
            .iter()
            .flatten()
            .map(|v| (v.name.clone(), v.value.clone()))
            .collect();
        if let Some(extra) = extra
            && provider.envs_policy != EnvsPolicy::Ignore
        {
            let extra: BTreeMap<String, String> = serde_json::from_value(extra).map_err(|_| {
                format!("the extension {ENVS_EXTENSION} of access provider {name:?} is not a map of strings")
            })?;
            if let Some(refused) = extra.keys().find(|key| !profile_may_set(key)) {
                return Err(format!(
                    "the extension {ENVS_EXTENSION} of access provider {name:?} sets {refused}, which a profile may not set"
                ));
            }
            if let Some(unlisted) = extra
                .keys()
                .find(|key| !provider.profile_env_allowed.contains(key))
            {
                return Err(format!(
                    "the extension {ENVS_EXTENSION} of access provider {name:?} sets {unlisted}, which is not in the provider's profileEnvAllowed"
                ));
            }
            let inherited = |key: &str| match provider.inherit_env.as_deref() {
                Some(list) => list.iter().any(|n| n == key),
                None => INHERITED_ENV.contains(&key),
            };
            for (key, value) in extra {
                // Under AppendIfNotExists, what the plugin inherits is there already.
                if provider.envs_policy == EnvsPolicy::AppendIfNotExists && inherited(&key) {
                    continue;
                }
                match env.iter_mut().find(|(k, _)| *k == key) {
                    Some(existing) if provider.envs_policy == EnvsPolicy::Replace => {
                        existing.1 = value
                    }
                    Some(_) => {}
                    None => env.push((key, value)),
                }
            }
        }
        Ok(env)
    }
}

/// What a client is built from.
enum Recipe {
    /// From the access providers: run as it is (the operator's plugin).
    Access(Box<Kubeconfig>),
    /// From a Secret: parsed under `trust`.
    Secret(Vec<u8>, Trust),
}

impl HubKind for Kind {
    type Recipe = Recipe;

    const GROUP: &'static str = GROUP;
    const KIND: &'static str = "ClusterProfile";
    // The proposed v1alpha2 where the hub serves it: the fields read are the same.
    const VERSIONS: &'static [&'static str] = &["v1alpha2", "v1alpha1"];
    const WHAT: &'static str = "ClusterProfile";
    const REPORTER: &'static str = "multicluster-runtime-cluster-inventory";

    fn default_ready(&self, object: &DynamicObject) -> bool {
        condition_true(object, HEALTHY_CONDITION)
    }

    fn member_id(&self, object: &DynamicObject) -> Option<String> {
        if !self.one_per_member {
            return None;
        }
        object
            .labels()
            .get(MEMBER_ID_LABEL)
            .filter(|id| !id.is_empty())
            .cloned()
    }

    fn secrets(&self) -> Option<watcher::Config> {
        match &self.access {
            Access::Providers(_) => None,
            Access::Secrets { consumer, .. } => Some(
                watcher::Config::default()
                    .labels(&format!("{CONSUMER_LABEL}={consumer},{PROFILE_LABEL}")),
            ),
        }
    }

    fn recipe(&self, object: &DynamicObject, secrets: &Secrets) -> Result<(u64, Recipe), NoRecipe> {
        match &self.access {
            Access::Providers(providers) => {
                let (name, kubeconfig) = providers.kubeconfig_for(object)?;
                // What the client would be built from (the plugin's answer is not known
                // before it runs), in a form whose maps are ordered: the plugin's variables
                // are hash maps.
                let exec = kubeconfig.auth_infos[0]
                    .auth_info
                    .as_ref()
                    .and_then(|a| a.exec.as_ref());
                let version = version_of(&(
                    name,
                    canonical_version_of(&kubeconfig.clusters),
                    canonical_version_of(&exec),
                ));
                Ok((version, Recipe::Access(Box::new(kubeconfig))))
            }
            Access::Secrets { consumer, trust } => {
                let namespace = object.namespace().unwrap_or_default();
                let profile = object.name_any();
                let found: Vec<_> = secrets
                    .in_namespace(&namespace)
                    .filter(|(_, s)| {
                        s.labels.get(PROFILE_LABEL) == Some(&profile)
                            && s.labels.get(CONSUMER_LABEL) == Some(consumer)
                    })
                    .collect();
                let (name, secret) = match found.as_slice() {
                    [one] => *one,
                    [] => {
                        return Err(NoRecipe::Revoked(format!(
                            "no Secret of namespace {namespace} is labelled {CONSUMER_LABEL}={consumer} and {PROFILE_LABEL}={profile}"
                        )));
                    }
                    many => {
                        let names: Vec<&str> = many.iter().map(|(n, _)| *n).collect();
                        return Err(format!(
                            "{} Secrets are labelled for this profile and consumer {consumer} ({}); one is expected",
                            many.len(),
                            names.join(", ")
                        )
                        .into());
                    }
                };
                let (version, bytes) = secret
                    .data
                    .get(SECRET_KEY)
                    .ok_or_else(|| format!("the Secret {name} has no data key {SECRET_KEY:?}"))?;
                Ok((*version, Recipe::Secret(bytes.clone(), *trust)))
            }
        }
    }

    // Not `async fn`: the future must not hold `&self` (the engine runs it on its own).
    #[allow(clippy::manual_async_fn)]
    fn build(
        &self,
        name: ClusterName,
        recipe: Recipe,
    ) -> impl Future<Output = Result<Cluster<ClusterName>, String>> + Send + 'static {
        async move {
            let kubeconfig = match recipe {
                Recipe::Access(kubeconfig) => *kubeconfig,
                Recipe::Secret(bytes, trust) => parse_kubeconfig(&bytes, trust)?,
            };
            super::cluster_from_kubeconfig(name, kubeconfig, None).await
        }
    }
}

#[cfg(test)]
mod tests {
    use kube::api::{ApiResource, GroupVersionKind};
    use serde_json::json;

    use super::*;

    fn profile(status: serde_json::Value) -> DynamicObject {
        let resource =
            ApiResource::from_gvk(&GroupVersionKind::gvk(GROUP, "v1alpha1", "ClusterProfile"));
        DynamicObject::new("east", &resource)
            .within("fleet")
            .data(json!({ "spec": {"clusterManager": {"name": "test"}}, "status": status }))
    }

    #[test]
    fn a_member_id_is_the_label_of_the_profile() {
        let kind = |one_per_member| Kind {
            access: Access::Secrets {
                consumer: "mcr".into(),
                trust: Trust::default(),
            },
            one_per_member,
        };
        let labelled = |value: Option<&str>| {
            let mut object = profile(json!({}));
            if let Some(value) = value {
                object
                    .labels_mut()
                    .insert(MEMBER_ID_LABEL.into(), value.into());
            }
            object
        };
        assert_eq!(
            kind(true).member_id(&labelled(Some("m-1"))).as_deref(),
            Some("m-1")
        );
        assert_eq!(
            kind(true).member_id(&labelled(Some(""))),
            None,
            "an empty id"
        );
        assert_eq!(kind(true).member_id(&labelled(None)), None);
        assert_eq!(
            kind(false).member_id(&labelled(Some("m-1"))),
            None,
            "one_per_member(false)"
        );
    }

    fn exec_of(kubeconfig: &Kubeconfig) -> &ExecConfig {
        kubeconfig.auth_infos[0]
            .auth_info
            .as_ref()
            .unwrap()
            .exec
            .as_ref()
            .unwrap()
    }

    fn env_of(exec: &ExecConfig) -> Vec<(String, String)> {
        exec.env
            .iter()
            .flatten()
            .map(|v| (v["name"].clone(), v["value"].clone()))
            .collect()
    }

    #[test]
    fn a_profile_never_sets_what_runs_code_redirects_or_picks_the_plugins_identity() {
        for name in [
            "LD_PRELOAD",
            "PATH",
            "SHELLOPTS",
            "BASHOPTS",
            "PS4",
            "BASH_ENV",
            "NODE_OPTIONS",
            "NODE_TLS_REJECT_UNAUTHORIZED",
            "NODE_EXTRA_CA_CERTS",
            "_JAVA_OPTIONS",
            "JDK_JAVA_OPTIONS",
            "JAVA_TOOL_OPTIONS",
            "LUA_INIT",
            "PERLLIB",
            "PERL5OPT",
            "GIT_SSH_COMMAND",
            "GCONV_PATH",
            "OPENSSL_CONF",
            "HTTPS_PROXY",
            "https_proxy",
            "SSL_CERT_FILE",
            "AWS_CA_BUNDLE",
            "AWS_ENDPOINT_URL_STS",
            "AWS_PROFILE",
            "AWS_WEB_IDENTITY_TOKEN_FILE",
            "AZURE_CONFIG_DIR",
            "GOOGLE_APPLICATION_CREDENTIALS",
            "CLOUDSDK_CONFIG",
            "GCE_METADATA_HOST",
            "KUBECONFIG",
            "KUBERNETES_SERVICE_HOST",
            "HOME",
            "TMPDIR",
            "XDG_CONFIG_HOME",
            "A=B",
            "1X",
            "",
        ] {
            assert!(!profile_may_set(name), "{name}");
        }
        for name in ["REGION", "CLUSTER_NAME", "zone", "_X"] {
            assert!(profile_may_set(name), "{name}");
        }
    }

    #[test]
    fn a_malformed_file_is_reported_by_position_never_by_value() {
        for text in [
            // A string where a list is expected.
            r#"{"providers": [{"name": "a", "execConfig": {"command": "/a", "args": "--client-secret=MARKER"}}]}"#,
            // A number where a string is expected, after the secret.
            r#"{"providers": [{"name": "MARKER", "execConfig": {"command": 7}}]}"#,
            // Not JSON past a value.
            r#"{"providers": [{"name": "a", "execConfig": {"command": "MARKER" x}}]}"#,
        ] {
            let error = AccessProviders::from_json(text).unwrap_err().to_string();
            assert!(!error.contains("MARKER"), "{error}");
            assert!(error.contains("line 1, column"), "{error}");
        }
    }

    #[test]
    fn the_first_provider_of_the_file_that_the_profile_lists_is_used() {
        let providers = AccessProviders::from_json(
            r#"{"providers": [
                {"name": "a", "execConfig": {"command": "/a"}},
                {"name": "b", "execConfig": {"command": "/b"}},
                {"name": "c", "execConfig": {"command": "/c"}}]}"#,
        )
        .unwrap();
        let profile = profile(json!({
            "accessProviders": [
                {"name": "c", "cluster": {"server": "https://c"}},
                {"name": "b", "cluster": {"server": "https://b"}}],
        }));
        let (name, kubeconfig) = providers.kubeconfig_for(&profile).unwrap();
        assert_eq!(name, "b");
        assert_eq!(exec_of(&kubeconfig).command.as_deref(), Some("/b"));
        let cluster = kubeconfig.clusters[0].cluster.as_ref().unwrap();
        assert_eq!(cluster.server.as_deref(), Some("https://b"));
    }

    #[test]
    fn access_providers_win_over_credential_providers_of_the_same_name() {
        let providers = AccessProviders::from_json(
            r#"{"providers": [{"name": "a", "execConfig": {"command": "/a"}}]}"#,
        )
        .unwrap();
        let both = profile(json!({
            "credentialProviders": [{"name": "a", "cluster": {"server": "https://old"}}],
            "accessProviders": [{"name": "a", "cluster": {"server": "https://new"}}],
        }));
        let (_, kubeconfig) = providers.kubeconfig_for(&both).unwrap();
        let cluster = kubeconfig.clusters[0].cluster.as_ref().unwrap();
        assert_eq!(cluster.server.as_deref(), Some("https://new"));
        // The deprecated list alone is used too.
        let old = profile(json!({
            "credentialProviders": [{"name": "a", "cluster": {"server": "https://old"}}],
        }));
        let (_, kubeconfig) = providers.kubeconfig_for(&old).unwrap();
        let cluster = kubeconfig.clusters[0].cluster.as_ref().unwrap();
        assert_eq!(cluster.server.as_deref(), Some("https://old"));
    }

    #[test]
    fn a_profile_adds_arguments_and_environment_only_as_the_policies_allow() {
        let status = json!({"accessProviders": [{"name": "p", "cluster": {
        "server": "https://p",
        "extensions": [
            {"name": ARGS_EXTENSION, "extension": ["--extra"]},
            {"name": ENVS_EXTENSION, "extension": {"KEEP": "profile", "NEW": "profile"}},
        ]}}]});
        let file = |args: &str, envs: &str| {
            AccessProviders::from_json(&format!(
                r#"{{"providers": [{{"name": "p",
                    "execConfig": {{"command": "/p", "args": ["--own"],
                                    "env": [{{"name": "KEEP", "value": "operator"}}]}},
                    "profileSourcedCLIArgsPolicy": "{args}",
                    "profileSourcedEnvVarsPolicy": "{envs}",
                    "profileEnvAllowed": ["KEEP", "NEW"]}}]}}"#
            ))
            .unwrap()
        };
        let pairs = |v: &[(&str, &str)]| -> Vec<(String, String)> {
            v.iter()
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .collect()
        };

        let (_, ignored) = file("", "")
            .kubeconfig_for(&profile(status.clone()))
            .unwrap();
        assert_eq!(exec_of(&ignored).args, Some(vec!["--own".to_string()]));
        assert_eq!(env_of(exec_of(&ignored)), pairs(&[("KEEP", "operator")]));

        let (_, appended) = file("Append", "AppendIfNotExists")
            .kubeconfig_for(&profile(status.clone()))
            .unwrap();
        assert_eq!(
            exec_of(&appended).args,
            Some(vec!["--own".to_string(), "--extra".to_string()])
        );
        assert_eq!(
            env_of(exec_of(&appended)),
            pairs(&[("KEEP", "operator"), ("NEW", "profile")])
        );

        let providers = file("Ignore", "Replace");
        let (_, replaced) = providers.kubeconfig_for(&profile(status.clone())).unwrap();
        assert_eq!(
            env_of(exec_of(&replaced)),
            pairs(&[("KEEP", "profile"), ("NEW", "profile")])
        );
        // Building again starts from the operator's configuration, not the last result.
        let (_, again) = providers.kubeconfig_for(&profile(status)).unwrap();
        assert_eq!(env_of(exec_of(&again)), env_of(exec_of(&replaced)));
        assert_eq!(exec_of(&again).args, Some(vec!["--own".to_string()]));
    }

    /// The version decides whether the plugin runs again: the same profile must give the
    /// same version every time (the plugin's variables were serialized in hash order).
    #[test]
    fn the_same_profile_gives_the_same_version() {
        let providers = AccessProviders::from_json(
            r#"{"providers": [{"name": "a", "execConfig": {"command": "/a",
                "env": [{"name": "ONE", "value": "1"}, {"name": "TWO", "value": "2"}]}}]}"#,
        )
        .unwrap();
        let kind = Kind {
            access: Access::Providers(providers),
            one_per_member: true,
        };
        let profile = profile(json!({
            "accessProviders": [{"name": "a", "cluster": {"server": "https://a"}}],
        }));
        let version = |_| kind.recipe(&profile, &Secrets::default()).ok().unwrap().0;
        let first = version(());
        for _ in 0..20 {
            assert_eq!(version(()), first);
        }
    }

    #[test]
    fn bad_files_and_profiles_are_refused_with_the_reason() {
        for (file, expected) in [
            (
                r#"{"providers": [{"name": "a", "profileSourcedCLIArgsPolicy": "Sometimes"}]}"#,
                "wrong type, a missing field or an unknown one at line 1, column 71",
            ),
            (
                r#"{"providers": [{"name": "a"}, {"name": "a"}]}"#,
                "more than once",
            ),
            (
                r#"{"providers": [{"name": "", "execConfig": {"command": "/x"}}]}"#,
                "no name",
            ),
            (
                r#"{"providers": [{"name": "a", "execConfig": {}}]}"#,
                "no command",
            ),
            ("not json", "not valid"),
        ] {
            let error = AccessProviders::from_json(file).unwrap_err().to_string();
            assert!(error.contains(expected), "{file}: {error}");
        }
        let providers = AccessProviders::from_json(
            r#"{"providers": [{"name": "a", "execConfig": {"command": "/a"}},
                              {"name": "b", "profileSourcedCLIArgsPolicy": "Append",
                               "execConfig": {"command": "/b"}}]}"#,
        )
        .unwrap();
        for (status, expected) in [
            (json!({}), "none listed"),
            (
                json!({"accessProviders": [{"name": "z", "cluster": {"server": "https://z"}}]}),
                "(z)",
            ),
            (
                json!({"accessProviders": [{"name": "a", "cluster": {}}]}),
                "no server",
            ),
            (json!({"accessProviders": [{"name": "a"}]}), "no cluster"),
            (
                json!({"accessProviders": [{"name": "b", "cluster": {"server": "https://b",
                    "extensions": [{"name": ARGS_EXTENSION, "extension": {"not": "a list"}}]}}]}),
                "not a list of strings",
            ),
        ] {
            let error = providers.kubeconfig_for(&profile(status)).unwrap_err();
            assert!(error.contains(expected), "{error}");
        }
    }

    #[test]
    fn of_a_profiles_cluster_only_server_ca_proxy_and_the_plugins_config_are_taken() {
        let status = json!({"accessProviders": [{"name": "a", "cluster": {
            "server": "https://a:6443",
            "certificate-authority-data": "Q0E=",
            "certificate-authority": "/etc/controller/ca.crt",
            "proxy-url": "http://proxy:3128",
            "insecure-skip-tls-verify": true,
            "tls-server-name": "somebody-else",
            "disable-compression": true,
            "extensions": [
                {"name": EXEC_EXTENSION, "extension": {"clusterName": "a"}},
                {"name": "example.com/other", "extension": {"x": 1}},
            ],
        }}]});
        let providers = AccessProviders::from_json(
            r#"{"providers": [{"name": "a", "execConfig": {"command": "/a"}}]}"#,
        )
        .unwrap();
        let (_, kubeconfig) = providers.kubeconfig_for(&profile(status.clone())).unwrap();
        let cluster = kubeconfig.clusters[0].cluster.as_ref().unwrap();
        assert_eq!(cluster.server.as_deref(), Some("https://a:6443"));
        assert_eq!(cluster.certificate_authority_data.as_deref(), Some("Q0E="));
        assert_eq!(cluster.proxy_url.as_deref(), Some("http://proxy:3128"));
        assert_eq!(cluster.certificate_authority, None);
        assert_eq!(cluster.insecure_skip_tls_verify, None);
        assert_eq!(cluster.tls_server_name, None);
        assert_eq!(cluster.disable_compression, None);
        let names: Vec<&str> = cluster
            .extensions
            .iter()
            .flatten()
            .map(|e| e.name.as_str())
            .collect();
        assert_eq!(names, [EXEC_EXTENSION]);

        // Only by the operator's loud choice.
        let (_, overridden) = providers
            .danger_profile_tls_overrides(true)
            .kubeconfig_for(&profile(status))
            .unwrap();
        let cluster = overridden.clusters[0].cluster.as_ref().unwrap();
        assert_eq!(cluster.insecure_skip_tls_verify, Some(true));
        assert_eq!(cluster.tls_server_name.as_deref(), Some("somebody-else"));
        assert_eq!(cluster.certificate_authority, None);
    }

    #[test]
    fn a_server_outside_the_providers_allowed_servers_is_refused() {
        let providers = AccessProviders::from_json(
            r#"{"providers": [{"name": "a", "execConfig": {"command": "/a"},
                "allowedServers": ["https://hub.example.com:6443", "https://*.fleet.example.com"]}]}"#,
        )
        .unwrap();
        let at = |server: &str| {
            providers.kubeconfig_for(&profile(
                json!({"accessProviders": [{"name": "a", "cluster": {"server": server}}]}),
            ))
        };
        for good in [
            "https://hub.example.com:6443",
            "https://HUB.example.com:6443/",
            "https://east.fleet.example.com",
            "https://a.b.fleet.example.com:443",
        ] {
            assert!(at(good).is_ok(), "{good}");
        }
        for bad in [
            "https://hub.example.com",
            "http://hub.example.com:6443",
            "https://evil.example.com:6443",
            "https://fleet.example.com",
            "https://evilfleet.example.com",
            "https://east.fleet.example.com:6443",
            "https://east.fleet.example.com.evil.io",
            "not a url",
        ] {
            let error = at(bad).unwrap_err();
            assert!(
                error.contains("is not one this controller allows"),
                "{bad}: {error}"
            );
        }
        // A pinned server is not reached through a proxy of the profile's choosing.
        let proxied = providers.kubeconfig_for(&profile(json!({"accessProviders": [{"name": "a",
            "cluster": {"server": "https://hub.example.com:6443", "proxy-url": "http://evil:3128"}}]})));
        assert!(proxied.unwrap_err().contains("proxy-url"));
        let bad_pattern = AccessProviders::from_json(
            r#"{"providers": [{"name": "a", "execConfig": {"command": "/a"},
                "allowedServers": ["hub.example.com"]}]}"#,
        );
        assert!(bad_pattern.is_err());
    }

    #[test]
    fn a_profile_may_not_set_variables_that_steer_code_requests_or_credentials() {
        let refused = [
            "LD_PRELOAD",
            "ld_library_path",
            "DYLD_INSERT_LIBRARIES",
            "PATH",
            "HTTPS_PROXY",
            "http_proxy",
            "NO_PROXY",
            "KUBECONFIG",
            "KUBERNETES_SERVICE_HOST",
            // A name with `=` would set another variable (std's Command does not refuse it).
            "KUBECONFIG=/tmp/other",
            "https_proxy=http://evil:3128/#",
            "BASH_ENV",
            "NODE_OPTIONS",
            "PYTHONPATH",
            "SSL_CERT_FILE",
            "REQUESTS_CA_BUNDLE",
            "SHELLOPTS",
            "PS4",
            "AWS_ENDPOINT_URL_STS",
            "1ST",
            "A-B",
            "",
        ];
        // Listed by the operator, or not: the deny-list stands behind the allow-list.
        let mut allowed: Vec<&str> = refused.to_vec();
        allowed.push("REGION");
        let providers = AccessProviders::from_json(
            &json!({"providers": [{"name": "a", "execConfig": {"command": "/a"},
                "profileSourcedEnvVarsPolicy": "Replace",
                "profileEnvAllowed": allowed}]})
            .to_string(),
        )
        .unwrap();
        for variable in refused {
            let status = json!({"accessProviders": [{"name": "a", "cluster": {
                "server": "https://a",
                "extensions": [{"name": ENVS_EXTENSION, "extension": {variable: "x"}}]}}]});
            let error = providers.kubeconfig_for(&profile(status)).unwrap_err();
            assert!(
                error.contains("which a profile may not set"),
                "{variable}: {error}"
            );
        }
        // A plain variable the operator did not list.
        let status = json!({"accessProviders": [{"name": "a", "cluster": {
            "server": "https://a",
            "extensions": [{"name": ENVS_EXTENSION, "extension": {"ZONE": "a"}}]}}]});
        let error = providers.kubeconfig_for(&profile(status)).unwrap_err();
        assert!(error.contains("profileEnvAllowed"), "{error}");
        let status = json!({"accessProviders": [{"name": "a", "cluster": {
            "server": "https://a",
            "extensions": [{"name": ENVS_EXTENSION, "extension": {"REGION": "east"}}]}}]});
        assert!(providers.kubeconfig_for(&profile(status)).is_ok());
    }

    #[test]
    fn the_plugin_inherits_only_the_allowed_variables_of_the_controller() {
        // The test binary's environment has PATH and variables of its own (cargo's).
        let present: Vec<String> = std::env::vars().map(|(name, _)| name).collect();
        assert!(present.iter().any(|n| n == "PATH"));
        let other = present
            .iter()
            .find(|n| !INHERITED_ENV.contains(&n.as_str()))
            .expect("a variable of the test's environment outside the default list")
            .clone();
        let status =
            json!({"accessProviders": [{"name": "a", "cluster": {"server": "https://a"}}]});
        let dropped = |file: &str| {
            let (_, kubeconfig) = AccessProviders::from_json(file)
                .unwrap()
                .kubeconfig_for(&profile(status.clone()))
                .unwrap();
            exec_of(&kubeconfig).drop_env.clone().unwrap_or_default()
        };
        let default = dropped(r#"{"providers": [{"name": "a", "execConfig": {"command": "/a"}}]}"#);
        assert!(default.contains(&other), "{other} is removed: {default:?}");
        assert!(!default.iter().any(|n| n == "PATH"), "{default:?}");
        // The file's own variables are set, not removed; inheritEnv replaces the default.
        let file = format!(
            r#"{{"providers": [{{"name": "a", "inheritEnv": ["{other}"],
                "execConfig": {{"command": "/a", "env": [{{"name": "HOME", "value": "/h"}}]}}}}]}}"#
        );
        let listed = dropped(&file);
        assert!(!listed.contains(&other), "{listed:?}");
        assert!(listed.iter().any(|n| n == "PATH"), "{listed:?}");
        assert!(!listed.iter().any(|n| n == "HOME"), "{listed:?}");
    }
}
