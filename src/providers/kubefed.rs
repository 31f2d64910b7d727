//! [`KubeFed`]: the member clusters KubeFed's `KubeFedCluster` objects describe.

use std::future::Future;
use std::sync::Arc;

use kube::api::DynamicObject;
use kube::config::{AuthInfo, Kubeconfig};
use kube::{Client, ResourceExt};
use kube_runtime::watcher;

use super::hub;
use super::hub::{HubKind, NoRecipe, Scope, Secrets, condition_true, field, kubeconfig_of};
use super::kubeconfig::version_of;
use crate::cluster::{Cluster, ClusterName};

/// KubeFed's group.
pub const GROUP: &str = "core.kubefed.io";
/// The namespace KubeFed keeps its clusters in unless told otherwise.
pub const DEFAULT_NAMESPACE: &str = "kube-federation-system";
/// The data key of a member's Secret.
pub const TOKEN_KEY: &str = "token";

/// One cluster per KubeFed `KubeFedCluster` (`core.kubefed.io/v1beta1`) of the KubeFed
/// system namespace (`kube-federation-system` unless [`KubeFed::namespace`] says otherwise)
/// of the hub `host` reaches, named `<namespace>/<name>`.
///
/// The member is reached at `spec.apiEndpoint` (`https://` when it names no scheme), trusting
/// `spec.caBundle`, through `spec.proxyURL` if set, with the bearer token of the Secret
/// `spec.secretRef.name` of the same namespace (data key `token`). It is engaged once its
/// `Ready` condition is `True` ([`KubeFed::ready`] replaces the rule), replaced when the
/// endpoint, CA, proxy or token change, disengaged for good when deleted and when its
/// deletion begins, and paused ([`Fleet::pause`](crate::Fleet::pause)) when it stops being
/// ready. `spec.disabledTLSValidations: ["*"]` turns off the
/// server certificate's verification; the partial values (`SubjectName`,
/// `ValidityPeriod`) are refused, as the TLS stack cannot skip one check alone. KubeFed's
/// controller sets `Ready` from its health checks: where it does not run, nothing does, and
/// a readiness rule of your own is the way.
///
/// A member that cannot be reached as described (its Secret missing or without a token, no
/// endpoint) gets a Warning Event (`KubeconfigRefused`) on its `KubeFedCluster` and a log
/// line, once per problem; no other member is affected. The Opaque Secrets of the namespace
/// are watched (token rotation is seen at once); of them only the `token` of those some
/// `KubeFedCluster` names is kept, a Secret named later read then (RBAC: `get`, `list`,
/// `watch` on Secrets of the namespace).
#[derive(Clone)]
pub struct KubeFed {
    host: Client,
    scope: Scope,
    kind: Arc<Kind>,
}

impl std::fmt::Debug for KubeFed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeFed")
            .field("scope", &self.scope)
            .finish_non_exhaustive()
    }
}

hub::hub_provider!(KubeFed, "KubeFedClusters");

/// The KubeFed specifics of the hub engine.
#[derive(Debug)]
struct Kind;

impl KubeFed {
    /// The members of the hub's `kube-federation-system` namespace.
    pub fn new(host: Client) -> Self {
        Self {
            host,
            scope: Scope {
                namespace: Some(DEFAULT_NAMESPACE.into()),
                ..Scope::default()
            },
            kind: Arc::new(Kind),
        }
    }
}

impl HubKind for Kind {
    type Recipe = Kubeconfig;

    const GROUP: &'static str = GROUP;
    const KIND: &'static str = "KubeFedCluster";
    const VERSIONS: &'static [&'static str] = &["v1beta1"];
    const WHAT: &'static str = "KubeFed cluster";
    const REPORTER: &'static str = "multicluster-runtime-kubefed";

    fn default_ready(&self, object: &DynamicObject) -> bool {
        condition_true(object, "Ready")
    }

    fn secrets(&self) -> Option<watcher::Config> {
        // KubeFed's Secrets carry no label of their own; `kubefedctl join` writes them
        // without a type (Opaque). Nothing else of the namespace is watched: service account
        // tokens of KubeFed's own controller, its webhook's serving key.
        Some(watcher::Config::default().fields("type=Opaque"))
    }

    fn reads_secret(&self, secret: &k8s_openapi::api::core::v1::Secret) -> bool {
        secret.type_.as_deref().is_none_or(|t| t == "Opaque")
    }

    /// Of a member's Secret, only its token (`ca.crt` and anything else stay out of memory).
    fn reads(&self, _name: &str, key: &str) -> bool {
        key == TOKEN_KEY
    }

    /// Only the Secrets some `KubeFedCluster` names are kept.
    const ONLY_NAMED: bool = true;

    fn named_secret(&self, object: &DynamicObject) -> Option<(String, String)> {
        let name = field(object, &["spec", "secretRef", "name"])?.as_str()?;
        Some((object.namespace().unwrap_or_default(), name.to_string()))
    }

    fn recipe(
        &self,
        object: &DynamicObject,
        secrets: &Secrets,
    ) -> Result<(u64, Kubeconfig), NoRecipe> {
        let text = |path: &[&str]| {
            field(object, path)
                .and_then(|v| v.as_str())
                .filter(|s| !s.is_empty())
        };
        let endpoint = text(&["spec", "apiEndpoint"]).ok_or("spec.apiEndpoint is empty")?;
        let server = if endpoint.contains("://") {
            endpoint.to_string()
        } else {
            format!("https://{endpoint}")
        };
        let secret_name =
            text(&["spec", "secretRef", "name"]).ok_or("spec.secretRef.name is empty")?;
        let namespace = object.namespace().unwrap_or_default();
        let secret = secrets
            .get(&namespace, secret_name)
            .ok_or_else(|| NoRecipe::Revoked(format!("the Secret {secret_name} is not there")))?;
        let (token_version, token) = secret
            .data
            .get(TOKEN_KEY)
            .filter(|(_, t)| !t.is_empty())
            .ok_or_else(|| format!("the Secret {secret_name} has no data key {TOKEN_KEY:?}"))?;
        let token = String::from_utf8(token.clone())
            .map_err(|_| format!("the token of the Secret {secret_name} is not UTF-8"))?;
        let disabled: Vec<&str> = field(object, &["spec", "disabledTLSValidations"])
            .and_then(|v| v.as_array())
            .into_iter()
            .flatten()
            .filter_map(|v| v.as_str())
            .collect();
        let insecure = match disabled.as_slice() {
            [] => false,
            ["*"] => true,
            other => {
                return Err(format!(
                    "spec.disabledTLSValidations {other:?}: only [\"*\"] (no verification) is supported"
                )
                .into());
            }
        };
        let ca = text(&["spec", "caBundle"]).map(str::to_string);
        let proxy = text(&["spec", "proxyURL"]).map(str::to_string);
        let version = version_of(&(&server, &ca, &proxy, insecure, token_version));
        let kubeconfig = kubeconfig_of(
            kube::config::Cluster {
                server: Some(server),
                certificate_authority_data: ca,
                insecure_skip_tls_verify: insecure.then_some(true),
                proxy_url: proxy,
                ..Default::default()
            },
            AuthInfo {
                token: Some(token.into()),
                ..Default::default()
            },
        );
        Ok((version, kubeconfig))
    }

    fn build(
        &self,
        name: ClusterName,
        kubeconfig: Kubeconfig,
    ) -> impl Future<Output = Result<Cluster<ClusterName>, String>> + Send + 'static {
        super::cluster_from_kubeconfig(name, kubeconfig, None)
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::ByteString;
    use k8s_openapi::api::core::v1::Secret;

    use super::*;
    use crate::providers::hub::Secrets;

    fn secret(name: &str, type_: Option<&str>, data: &[(&str, &str)]) -> Secret {
        let mut secret = Secret::default();
        secret.metadata.namespace = Some(DEFAULT_NAMESPACE.into());
        secret.metadata.name = Some(name.into());
        secret.type_ = type_.map(str::to_string);
        secret.data = Some(
            data.iter()
                .map(|(k, v)| (k.to_string(), ByteString(v.as_bytes().to_vec())))
                .collect(),
        );
        secret
    }

    #[test]
    fn of_the_namespaces_secrets_only_the_tokens_of_opaque_ones_are_kept() {
        let mut secrets = Secrets::default();
        secrets.insert(
            secret(
                "kubefed-controller-token",
                Some("kubernetes.io/service-account-token"),
                &[("token", "CONTROLLER-TOKEN"), ("ca.crt", "CA")],
            ),
            &Kind,
        );
        secrets.insert(
            secret(
                "kubefed-webhook",
                Some("kubernetes.io/tls"),
                &[("tls.key", "KEY")],
            ),
            &Kind,
        );
        secrets.insert(
            secret(
                "east-x7k2p",
                None,
                &[("token", "EAST-TOKEN"), ("ca.crt", "CA"), ("other", "O")],
            ),
            &Kind,
        );
        secrets.insert(
            secret("west-9q2zt", Some("Opaque"), &[("token", "WEST-TOKEN")]),
            &Kind,
        );
        assert_eq!(
            secrets
                .in_namespace(DEFAULT_NAMESPACE)
                .map(|(name, _)| name)
                .collect::<Vec<_>>(),
            ["east-x7k2p", "west-9q2zt"]
        );
        let east = secrets.get(DEFAULT_NAMESPACE, "east-x7k2p").unwrap();
        assert_eq!(east.data.keys().collect::<Vec<_>>(), ["token"]);
        assert_eq!(east.data["token"].1, b"EAST-TOKEN");
    }

    /// P4 of the 2026-11-27 security review: of the Opaque Secrets of the namespace, only
    /// those some `KubeFedCluster` names are kept; one named later is read then, one no
    /// longer named is let go.
    #[test]
    fn only_the_secrets_a_kubefedcluster_names_are_kept() {
        use crate::providers::hub::State;
        let member = |name: &str, secret: &str| -> DynamicObject {
            serde_json::from_value(serde_json::json!({
                "apiVersion": "core.kubefed.io/v1beta1",
                "kind": "KubeFedCluster",
                "metadata": {"name": name, "namespace": DEFAULT_NAMESPACE},
                "spec": {"apiEndpoint": "https://east", "secretRef": {"name": secret}},
            }))
            .unwrap()
        };
        let mut state = State::default();
        state.set_object("east", Some(member("east", "east-x7k2p")));
        for name in ["east-x7k2p", "someone-elses"] {
            state.take_secret(secret(name, None, &[("token", "T")]), &Kind);
        }
        assert_eq!(
            state.secret_names(),
            (vec!["east-x7k2p".into()], vec!["someone-elses".into()])
        );
        assert!(state.settle_named(&Kind).is_empty());
        // The member's secretRef changes: the old Secret is let go, the new one to be read.
        state.set_object("east", Some(member("east", "someone-elses")));
        assert_eq!(
            state.settle_named(&Kind),
            [(DEFAULT_NAMESPACE.to_string(), "someone-elses".to_string())]
        );
        assert_eq!(
            state.secret_names(),
            (vec![], vec!["east-x7k2p".into(), "someone-elses".into()])
        );
        state.take_secret(secret("someone-elses", None, &[("token", "T")]), &Kind);
        assert_eq!(
            state.secret_names(),
            (vec!["someone-elses".into()], vec!["east-x7k2p".into()])
        );
        // The member gone: nothing is kept.
        state.set_object("east", None);
        assert!(state.settle_named(&Kind).is_empty());
        assert_eq!(state.secret_names().0, Vec::<String>::new());
    }
}
