//! [`ArgoCdClusters`]: the clusters Argo CD keeps as labelled Secrets of its namespace.

use std::collections::BTreeMap;

use base64::Engine as _;
use k8s_openapi::api::core::v1::Secret;
use kube::config::Kubeconfig;
use kube::{Client, Resource, ResourceExt};
use serde::Deserialize;
use tokio_util::sync::CancellationToken;

use super::secret_fleet::{SecretClusters, SecretFleet};
use crate::client::CredentialHolder;
use crate::cluster::{Cluster, ClusterName};
use crate::fleet::Fleet;
use crate::provider::{Provider, ProviderError};

/// The label Argo CD marks its Secrets with; cluster Secrets have the value `cluster`.
pub const ARGOCD_SECRET_TYPE_LABEL: &str = "argocd.argoproj.io/secret-type";

/// The data keys of an Argo CD cluster Secret the provider reads; the others (`name`,
/// `namespaces`, `project`, `shard`, ...) are dropped as the Secret arrives.
const KEYS: [&str; 2] = ["server", "config"];

/// One cluster per Argo CD cluster Secret (label `argocd.argoproj.io/secret-type=cluster`) in
/// one namespace of the host cluster, usually `argocd`; the cluster is named after the Secret
/// and reached at its `server` with the credentials of its `config` JSON, as Argo CD reads
/// them: `bearerToken`, `username` and `password`, `tlsClientConfig` (`caData`, `certData`,
/// `keyData`, `serverName`, `insecure`), `execProviderConfig` and `awsAuthConfig`, one
/// credential in Argo CD's order (AWS, then a command, then a token or basic
/// authentication), field names matched as Go matches them (case aside).
///
/// Creating such a Secret engages its cluster; changing its `server` or `config` re-engages
/// it; deleting the Secret, or a label that no longer selects it, disengages it. A further
/// label selector ([`ArgoCdClusters::labels`]) takes a part of the fleet (one team's).
///
/// Security: the provider holds the same line as
/// [`KubeconfigSecrets`](super::KubeconfigSecrets). Whoever can write a cluster Secret in
/// that namespace chooses the server and the credentials sent to it, and no more:
/// - `execProviderConfig` runs a command of the Secret's choosing, and is refused unless
///   [`ArgoCdClusters::allow_exec`];
/// - `awsAuthConfig` runs `aws eks get-token` with the Secret's cluster name, role and
///   profile, and is refused unless [`ArgoCdClusters::allow_aws`];
/// - a Secret for Argo CD's own cluster (`https://kubernetes.default.svc` without a bearer
///   token or basic credentials) is refused: Argo CD would lend it its service account, and
///   the provider never lends the controller's identity to a Secret;
/// - a `server` with user information and a `proxyUrl` are refused (the crate's clients do
///   not go through proxies);
/// - a refusal or a malformed Secret is logged and recorded as a Warning Event
///   (`ClusterSecretRefused`) on the Secret, in words that name a key or a field path and a
///   position, never a value; each content is reported once, and the other clusters are
///   not affected.
///
/// Argo CD's `namespaces` and `clusterResources` (limits of what Argo CD itself deploys) and
/// `project` are not read: the controller's reach in a member is what its credentials allow.
#[derive(Clone)]
pub struct ArgoCdClusters {
    host: Client,
    namespace: String,
    labels: Option<String>,
    allowed: Allowed,
}

impl std::fmt::Debug for ArgoCdClusters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ArgoCdClusters")
            .field("namespace", &self.namespace)
            .field("labels", &self.labels)
            .field("allow_exec", &self.allowed.exec)
            .field("allow_aws", &self.allowed.aws)
            .finish_non_exhaustive()
    }
}

impl ArgoCdClusters {
    /// The cluster Secrets in `namespace` (Argo CD's, usually `argocd`) of the cluster `host`
    /// reaches.
    pub fn new(host: Client, namespace: impl Into<String>) -> Self {
        Self {
            host,
            namespace: namespace.into(),
            labels: None,
            allowed: Allowed::default(),
        }
    }

    /// Only the cluster Secrets that also match this label selector (`team=payments`,
    /// `env in (prod)`).
    #[must_use]
    pub fn labels(mut self, selector: impl Into<String>) -> Self {
        let selector: String = selector.into();
        // A blank selector selects nothing more (and would make the watch's selector invalid).
        self.labels = Some(selector.trim().to_string()).filter(|s| !s.is_empty());
        self
    }

    /// Lets Secrets run their `execProviderConfig` command. Only for namespaces whose
    /// writers you would also let run code in this controller.
    #[must_use]
    pub fn allow_exec(mut self, allow: bool) -> Self {
        self.allowed.exec = allow;
        self
    }

    /// Lets Secrets with an `awsAuthConfig` get EKS tokens through the `aws` CLI
    /// (`aws eks get-token`, with the controller's AWS identity, the Secret's cluster name and
    /// role): a Secret writer can then have the controller assume any role its identity
    /// may. Argo CD runs its own `argocd-k8s-auth aws` for the same.
    #[must_use]
    pub fn allow_aws(mut self, allow: bool) -> Self {
        self.allowed.aws = allow;
        self
    }
}

impl SecretClusters for ArgoCdClusters {
    const WHAT: &'static str = "Argo CD cluster Secret";
    const REFUSED_LINE: &'static str = "Argo CD cluster Secret refused";
    const REFUSED: &'static str = "ClusterSecretRefused";
    const REPORTER: &'static str = "multicluster-runtime-argocd-clusters";

    fn keys(&self) -> Vec<&str> {
        KEYS.to_vec()
    }

    async fn cluster(&self, secret: &Secret) -> Result<Cluster<ClusterName>, String> {
        let data = |key: &str| {
            secret
                .data
                .as_ref()
                .and_then(|d| d.get(key))
                .map(|b| b.0.as_slice())
                .ok_or_else(|| format!("no data key {key:?}"))
        };
        let kubeconfig = kubeconfig_of(data("server")?, data("config")?, self.allowed)?;
        let cluster =
            super::cluster_from_kubeconfig(ClusterName::from(secret.name_any()), kubeconfig, None)
                .await?;
        let holder = CredentialHolder::new(self.host.clone(), secret.object_ref(&()));
        Ok(cluster.with_credential_holder(holder))
    }
}

impl Provider for ArgoCdClusters {
    type Id = ClusterName;

    async fn run(
        &self,
        fleet: Fleet<ClusterName>,
        shutdown: CancellationToken,
    ) -> Result<(), ProviderError> {
        let mut selector = format!("{ARGOCD_SECRET_TYPE_LABEL}=cluster");
        if let Some(labels) = &self.labels {
            selector = format!("{selector},{labels}");
        }
        SecretFleet {
            host: &self.host,
            namespace: &self.namespace,
            selector,
            source: self,
            renewal: None,
        }
        .run(fleet, shutdown)
        .await
    }
}

/// What a Secret may have the controller run.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Allowed {
    pub(crate) exec: bool,
    pub(crate) aws: bool,
}

/// Argo CD's `config`: the fields it reads, the others ignored (and not kept).
#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct ClusterConfig {
    username: Option<String>,
    password: Option<String>,
    bearer_token: Option<String>,
    tls_client_config: Option<TlsClientConfig>,
    aws_auth_config: Option<AwsAuthConfig>,
    exec_provider_config: Option<ExecProviderConfig>,
    proxy_url: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct TlsClientConfig {
    insecure: Option<bool>,
    server_name: Option<String>,
    cert_data: Option<String>,
    key_data: Option<String>,
    ca_data: Option<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct AwsAuthConfig {
    cluster_name: Option<String>,
    #[serde(rename = "roleARN")]
    role_arn: Option<String>,
    profile: Option<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ExecProviderConfig {
    command: Option<String>,
    args: Option<Vec<String>>,
    env: Option<BTreeMap<String, String>>,
    api_version: Option<String>,
}

/// The kubeconfig an Argo CD cluster Secret's `server` and `config` amount to, as `allowed`
/// lets it be; errors name keys, field paths and positions, never a value.
pub(crate) fn kubeconfig_of(
    server: &[u8],
    config: &[u8],
    allowed: Allowed,
) -> Result<Kubeconfig, String> {
    let server = std::str::from_utf8(server)
        .map_err(|_| "data key \"server\": not UTF-8".to_string())?
        .trim();
    let uri: http::Uri = server
        .parse()
        .map_err(|_| "data key \"server\": not a URL".to_string())?;
    if !matches!(uri.scheme_str(), Some("https" | "http")) || uri.host().is_none() {
        return Err("data key \"server\": not an http(s) URL with a host".into());
    }
    // User information would be shown wherever the server is (debug lines, metric labels).
    if uri.authority().is_some_and(|a| a.as_str().contains('@')) {
        return Err("data key \"server\": a URL with user information".into());
    }
    let config = read_config(config)?;
    let tls = config.tls_client_config.unwrap_or_default();
    // As Argo CD decides it: its own cluster, reached with its own service account.
    let in_cluster = uri.scheme_str() == Some("https")
        && uri.port_u16().is_none_or(|p| p == 443)
        && uri.host().is_some_and(|h| {
            let h = h.to_ascii_lowercase();
            h == "kubernetes.default.svc" || h == "kubernetes.default.svc.cluster.local"
        });
    if in_cluster
        && config.bearer_token.is_none()
        && config.username.is_none()
        && config.password.is_none()
    {
        return Err("data key \"server\": Argo CD's own cluster (kubernetes.default.svc without a bearer token or basic credentials) would be reached with the controller's identity, which is never lent to a Secret; add the host cluster with another provider".into());
    }
    if config.proxy_url.is_some() {
        return Err("config.proxyUrl: the crate's clients do not go through proxies".into());
    }

    let mut cluster = serde_json::json!({ "server": server });
    let mut user = serde_json::Map::new();
    // Go writes []byte as standard base64, as the kubeconfig's *-data fields are; its
    // decoder skips line breaks, so wrapped values are taken too.
    let base64 = |field: &str, value: &Option<String>| match value {
        None => Ok(None),
        Some(value) => {
            let value: String = value
                .trim()
                .chars()
                .filter(|c| !matches!(c, '\r' | '\n'))
                .collect();
            base64::engine::general_purpose::STANDARD
                .decode(&value)
                .map(|_| Some(value))
                .map_err(|_| format!("config.tlsClientConfig.{field}: not base64"))
        }
    };
    if let Some(ca) = base64("caData", &tls.ca_data)? {
        cluster["certificate-authority-data"] = ca.into();
    }
    if let Some(cert) = base64("certData", &tls.cert_data)? {
        user.insert("client-certificate-data".into(), cert.into());
    }
    if let Some(key) = base64("keyData", &tls.key_data)? {
        user.insert("client-key-data".into(), key.into());
    }
    if tls.insecure == Some(true) {
        cluster["insecure-skip-tls-verify"] = true.into();
    }
    if let Some(name) = tls.server_name {
        cluster["tls-server-name"] = name.into();
    }
    // One credential, in Argo CD's order: AWS, then a command, then a token or basic
    // authentication (never several, so the one Argo CD uses is the one used here).
    if let Some(aws) = config.aws_auth_config {
        if !allowed.aws {
            return Err("config.awsAuthConfig: Argo CD cluster Secrets may not have the controller get AWS tokens (see the provider's allow_aws)".into());
        }
        user.insert("exec".into(), aws_exec(&aws)?);
    } else if let Some(exec) = config.exec_provider_config {
        if !allowed.exec {
            return Err("config.execProviderConfig: Argo CD cluster Secrets may not run commands in the controller (see the provider's allow_exec)".into());
        }
        let command = exec
            .command
            .filter(|c| !c.is_empty())
            .ok_or("config.execProviderConfig.command: missing")?;
        let env: Vec<_> = exec
            .env
            .unwrap_or_default()
            .into_iter()
            .map(|(name, value)| serde_json::json!({ "name": name, "value": value }))
            .collect();
        user.insert(
            "exec".into(),
            serde_json::json!({
                "apiVersion": exec.api_version.unwrap_or_else(|| "client.authentication.k8s.io/v1beta1".into()),
                "command": command,
                "args": exec.args.unwrap_or_default(),
                "env": env,
                "interactiveMode": "Never",
            }),
        );
    } else {
        if let Some(token) = config.bearer_token {
            user.insert("token".into(), token.into());
        }
        if let Some(username) = config.username {
            user.insert("username".into(), username.into());
        }
        if let Some(password) = config.password {
            user.insert("password".into(), password.into());
        }
    }
    serde_json::from_value(serde_json::json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{ "name": "argocd", "cluster": cluster }],
        "users": [{ "name": "argocd", "user": user }],
        "contexts": [{ "name": "argocd", "context": { "cluster": "argocd", "user": "argocd" } }],
        "current-context": "argocd",
    }))
    .map_err(|_| "config: does not make a kubeconfig".to_string())
}

/// The fields of `config` and of its parts, as Go's JSON decoder matches them: an exact
/// name first, else one that differs in case only.
const TOP: &[&str] = &[
    "username",
    "password",
    "bearerToken",
    "tlsClientConfig",
    "awsAuthConfig",
    "execProviderConfig",
    "proxyUrl",
    "disableCompression",
];
const TLS: &[&str] = &["insecure", "serverName", "certData", "keyData", "caData"];
const AWS: &[&str] = &["clusterName", "roleARN", "profile"];
const EXEC: &[&str] = &["command", "args", "env", "apiVersion", "installHint"];

/// Renames the keys of `value` (an object) that match a name of `known` but for case.
fn canonical_keys(value: &mut serde_json::Value, known: &[&str]) {
    let Some(map) = value.as_object_mut() else {
        return;
    };
    let renames: Vec<(String, &str)> = map
        .keys()
        .filter(|k| !known.contains(&k.as_str()))
        .filter_map(|k| {
            let name = known.iter().find(|n| n.eq_ignore_ascii_case(k))?;
            Some((k.clone(), *name))
        })
        .collect();
    for (from, to) in renames {
        if let Some(v) = map.remove(&from)
            && !map.contains_key(to)
        {
            map.insert(to.to_string(), v);
        }
    }
}

/// `config` read as Argo CD reads it; a problem is said by position or field path.
fn read_config(config: &[u8]) -> Result<ClusterConfig, String> {
    let mut value: serde_json::Value = serde_json::from_slice(config).map_err(|e| {
        use serde_json::error::Category;
        let what = match e.classify() {
            Category::Syntax => "not valid JSON",
            Category::Eof => "JSON that ends early",
            Category::Data => "a value of the wrong type",
            Category::Io => "unreadable",
        };
        format!(
            "data key \"config\": {what} at line {} column {}",
            e.line(),
            e.column()
        )
    })?;
    canonical_keys(&mut value, TOP);
    for (field, known) in [
        ("tlsClientConfig", TLS),
        ("awsAuthConfig", AWS),
        ("execProviderConfig", EXEC),
    ] {
        if let Some(part) = value.get_mut(field) {
            canonical_keys(part, known);
        }
    }
    if !value.is_object() {
        return Err("data key \"config\": not a JSON object".into());
    }
    ClusterConfig::deserialize(&value).map_err(|_| {
        // Which field: each is tried alone (serde's own words would quote the value).
        fn fits<T: serde::de::DeserializeOwned>(value: &serde_json::Value) -> bool {
            Option::<T>::deserialize(value).is_ok()
        }
        let wrong = TOP.iter().find(|field| {
            let Some(v) = value.get(**field) else {
                return false;
            };
            !match **field {
                "tlsClientConfig" => fits::<TlsClientConfig>(v),
                "awsAuthConfig" => fits::<AwsAuthConfig>(v),
                "execProviderConfig" => fits::<ExecProviderConfig>(v),
                "disableCompression" => true,
                _ => fits::<String>(v),
            }
        });
        match wrong {
            Some(field) => format!("config.{field}: a value of the wrong type"),
            None => "data key \"config\": a value of the wrong type".to_string(),
        }
    })
}

/// The `aws eks get-token` credential plugin for `aws`: each value checked to be what its
/// field can hold, and passed as `--flag=value` (never read as another flag).
fn aws_exec(aws: &AwsAuthConfig) -> Result<serde_json::Value, String> {
    let plain = |field: &str, value: &str, extra: &str| {
        let ok = !value.is_empty()
            && value.len() <= 2048
            && !value.starts_with('-')
            && value
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || extra.contains(c));
        if ok {
            Ok(())
        } else {
            Err(format!(
                "config.awsAuthConfig.{field}: not a valid value for it"
            ))
        }
    };
    let cluster = aws
        .cluster_name
        .as_deref()
        .ok_or("config.awsAuthConfig.clusterName: missing")?;
    plain("clusterName", cluster, "-_")?;
    let mut args = vec![
        "eks".to_string(),
        "get-token".into(),
        format!("--cluster-name={cluster}"),
        "--output=json".into(),
    ];
    if let Some(role) = &aws.role_arn {
        plain("roleARN", role, ":/_+=,.@-")?;
        if !role.starts_with("arn:") {
            return Err("config.awsAuthConfig.roleARN: not an ARN".into());
        }
        args.push(format!("--role-arn={role}"));
    }
    let mut env = Vec::new();
    if let Some(profile) = &aws.profile {
        plain("profile", profile, "-_.")?;
        env.push(serde_json::json!({ "name": "AWS_PROFILE", "value": profile }));
    }
    Ok(serde_json::json!({
        "apiVersion": "client.authentication.k8s.io/v1beta1",
        "command": "aws",
        "args": args,
        "env": env,
        "interactiveMode": "Never",
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    const SERVER: &[u8] = b"https://127.0.0.1:6443";

    fn user(kubeconfig: &Kubeconfig) -> &kube::config::AuthInfo {
        kubeconfig.auth_infos[0].auth_info.as_ref().unwrap()
    }

    #[test]
    fn a_bearer_token_and_tls_settings_become_the_kubeconfig() {
        let config = br#"{"bearerToken": "t0k", "tlsClientConfig": {"insecure": false, "caData": "Q0E=", "serverName": "api.example"}, "disableCompression": true, "unknown": 1}"#;
        let kubeconfig = kubeconfig_of(SERVER, config, Allowed::default()).unwrap();
        let cluster = kubeconfig.clusters[0].cluster.as_ref().unwrap();
        assert_eq!(cluster.server.as_deref(), Some("https://127.0.0.1:6443"));
        assert_eq!(cluster.certificate_authority_data.as_deref(), Some("Q0E="));
        assert_eq!(cluster.tls_server_name.as_deref(), Some("api.example"));
        assert_eq!(cluster.insecure_skip_tls_verify, None);
        use secrecy::ExposeSecret as _;
        assert_eq!(
            user(&kubeconfig)
                .token
                .as_ref()
                .map(|t| t.expose_secret().to_string()),
            Some("t0k".to_string())
        );
        assert!(user(&kubeconfig).exec.is_none());
    }

    #[test]
    fn a_client_certificate_and_basic_auth_become_the_kubeconfig() {
        let config = br#"{"username": "u", "password": "p", "tlsClientConfig": {"insecure": true, "certData": "Q0VSVA==", "keyData": "S0VZ"}}"#;
        let kubeconfig = kubeconfig_of(SERVER, config, Allowed::default()).unwrap();
        let cluster = kubeconfig.clusters[0].cluster.as_ref().unwrap();
        assert_eq!(cluster.insecure_skip_tls_verify, Some(true));
        let user = user(&kubeconfig);
        assert_eq!(user.client_certificate_data.as_deref(), Some("Q0VSVA=="));
        assert!(user.client_key_data.is_some() && user.username.as_deref() == Some("u"));
    }

    #[test]
    fn commands_are_refused_unless_allowed() {
        let exec = br#"{"execProviderConfig": {"command": "/bin/mcr-marker", "args": ["a"], "env": {"K": "V"}, "apiVersion": "client.authentication.k8s.io/v1"}}"#;
        let refused = kubeconfig_of(SERVER, exec, Allowed::default()).unwrap_err();
        assert!(refused.contains("execProviderConfig") && !refused.contains("mcr-marker"));
        let allowed = Allowed {
            exec: true,
            aws: false,
        };
        let kubeconfig = kubeconfig_of(SERVER, exec, allowed).unwrap();
        let plugin = user(&kubeconfig).exec.as_ref().unwrap();
        assert_eq!(plugin.command.as_deref(), Some("/bin/mcr-marker"));
        assert_eq!(plugin.args.as_deref(), Some(&["a".to_string()][..]));
        assert_eq!(
            plugin.api_version.as_deref(),
            Some("client.authentication.k8s.io/v1")
        );
        let env = plugin.env.as_ref().unwrap();
        assert_eq!(env[0].get("name").map(String::as_str), Some("K"));

        let aws = br#"{"awsAuthConfig": {"clusterName": "prod-1", "roleARN": "arn:aws:iam::123456789012:role/deployer", "profile": "ops"}}"#;
        let refused = kubeconfig_of(SERVER, aws, allowed).unwrap_err();
        assert!(refused.contains("awsAuthConfig") && refused.contains("allow_aws"));
        let allowed = Allowed {
            exec: false,
            aws: true,
        };
        let kubeconfig = kubeconfig_of(SERVER, aws, allowed).unwrap();
        let plugin = user(&kubeconfig).exec.as_ref().unwrap();
        assert_eq!(plugin.command.as_deref(), Some("aws"));
        assert_eq!(
            plugin.args.clone().unwrap(),
            [
                "eks",
                "get-token",
                "--cluster-name=prod-1",
                "--output=json",
                "--role-arn=arn:aws:iam::123456789012:role/deployer"
            ]
        );
        assert_eq!(
            plugin.env.as_ref().unwrap()[0]
                .get("value")
                .map(String::as_str),
            Some("ops")
        );
        // An exec config is still refused when only AWS is allowed.
        assert!(kubeconfig_of(SERVER, exec, allowed).is_err());
    }

    #[test]
    fn aws_values_that_could_be_read_as_flags_are_refused_without_quoting_them() {
        let allowed = Allowed {
            exec: false,
            aws: true,
        };
        for config in [
            r#"{"awsAuthConfig": {"clusterName": "--endpoint-url=mcr-marker"}}"#,
            r#"{"awsAuthConfig": {"clusterName": "a mcr-marker"}}"#,
            r#"{"awsAuthConfig": {"clusterName": "c", "roleARN": "mcr-marker"}}"#,
            r#"{"awsAuthConfig": {"clusterName": "c", "profile": "x;mcr-marker"}}"#,
            r#"{"awsAuthConfig": {}}"#,
        ] {
            let error = kubeconfig_of(SERVER, config.as_bytes(), allowed).unwrap_err();
            assert!(
                error.starts_with("config.awsAuthConfig.") && !error.contains("mcr-marker"),
                "{config}: {error}"
            );
        }
    }

    #[test]
    fn malformed_secrets_are_reported_by_key_and_position_never_by_value() {
        let cases: [(&[u8], &[u8], &str); 11] = [
            (
                SERVER,
                br#"{"bearerToken": "mcr-marker" "x"}"#,
                "not valid JSON at line 1",
            ),
            (
                SERVER,
                br#"{"tlsClientConfig": "mcr-marker"}"#,
                "config.tlsClientConfig: a value of the wrong type",
            ),
            (SERVER, br#"{"bearerToken": "mcr-marker"#, "ends early"),
            (
                SERVER,
                br#"{"bearerToken": 7, "tlsClientConfig": {"insecure": "mcr-marker"}}"#,
                "config.bearerToken: a value",
            ),
            (SERVER, br#"["mcr-marker"]"#, "not a JSON object"),
            (
                SERVER,
                br#"{"proxyUrl": "http://mcr-marker"}"#,
                "proxyUrl: the crate's clients",
            ),
            (
                b"https://admin:mcr-marker@127.0.0.1",
                b"{}",
                "user information",
            ),
            (
                SERVER,
                br#"{"tlsClientConfig": {"caData": "mcr-marker!"}}"#,
                "caData: not base64",
            ),
            (
                SERVER,
                br#"{"tlsClientConfig": {"keyData": "mcr-marker!"}}"#,
                "keyData: not base64",
            ),
            (b"mcr-marker", b"{}", "\"server\": not"),
            (b"file:///mcr-marker", b"{}", "\"server\": not"),
        ];
        for (server, config, expected) in cases {
            let error = kubeconfig_of(server, config, Allowed::default()).unwrap_err();
            assert!(
                error.contains(expected) && !error.contains("mcr-marker"),
                "{expected}: {error}"
            );
        }
    }

    #[test]
    fn argo_cds_own_cluster_is_not_lent_the_controllers_identity() {
        for server in [
            "https://kubernetes.default.svc",
            "https://kubernetes.default.svc/",
            "https://Kubernetes.Default.Svc:443",
            "https://kubernetes.default.svc.cluster.local",
        ] {
            for config in [
                r#"{"tlsClientConfig": {"insecure": false}}"#,
                // Argo CD takes its own service account here too, whatever else is set.
                r#"{"tlsClientConfig": {"certData": "Q0VSVA==", "keyData": "S0VZ"}}"#,
                r#"{"execProviderConfig": {"command": "x"}}"#,
            ] {
                let allowed = Allowed {
                    exec: true,
                    aws: true,
                };
                let error =
                    kubeconfig_of(server.as_bytes(), config.as_bytes(), allowed).unwrap_err();
                assert!(error.contains("never lent"), "{server} {config}: {error}");
            }
        }
        // With credentials of its own, it is a cluster like any other.
        assert!(
            kubeconfig_of(
                b"https://kubernetes.default.svc",
                br#"{"bearerToken": "t"}"#,
                Allowed::default()
            )
            .is_ok()
        );
    }

    #[test]
    fn one_credential_is_used_in_argo_cds_order() {
        use secrecy::ExposeSecret as _;
        let both = br#"{"bearerToken": "t", "username": "u", "password": "p", "execProviderConfig": {"command": "c"}}"#;
        let exec = Allowed {
            exec: true,
            aws: false,
        };
        let kubeconfig = kubeconfig_of(SERVER, both, exec).unwrap();
        let used = user(&kubeconfig);
        assert!(used.exec.is_some());
        assert!(used.token.is_none() && used.username.is_none() && used.password.is_none());
        // AWS comes before a command: allowed AWS is enough.
        let aws_and_exec =
            br#"{"awsAuthConfig": {"clusterName": "c"}, "execProviderConfig": {"command": "x"}}"#;
        let aws = Allowed {
            exec: false,
            aws: true,
        };
        let kubeconfig = kubeconfig_of(SERVER, aws_and_exec, aws).unwrap();
        assert_eq!(
            user(&kubeconfig).exec.as_ref().unwrap().command.as_deref(),
            Some("aws")
        );
        let plain = kubeconfig_of(SERVER, br#"{"bearerToken": "t"}"#, exec).unwrap();
        assert_eq!(
            user(&plain)
                .token
                .as_ref()
                .map(|t| t.expose_secret().to_string()),
            Some("t".to_string())
        );
    }

    #[test]
    fn fields_are_matched_as_go_matches_them_and_wrapped_base64_is_taken() {
        let config = b"{\"BearerToken\": \"t\", \"TLSClientConfig\": {\"CAData\": \"Q0\\nFB\\r\\nQkM=\", \"Insecure\": true}}";
        let kubeconfig = kubeconfig_of(SERVER, config, Allowed::default()).unwrap();
        let cluster = kubeconfig.clusters[0].cluster.as_ref().unwrap();
        assert_eq!(
            cluster.certificate_authority_data.as_deref(),
            Some("Q0FBQkM=")
        );
        assert_eq!(cluster.insecure_skip_tls_verify, Some(true));
        assert!(user(&kubeconfig).token.is_some());
        // A command spelled otherwise is a command still.
        let exec = br#"{"ExecProviderConfig": {"Command": "/bin/mcr-marker"}}"#;
        let error = kubeconfig_of(SERVER, exec, Allowed::default()).unwrap_err();
        assert!(error.contains("execProviderConfig") && !error.contains("mcr-marker"));
    }
}
