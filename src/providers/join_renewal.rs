//! Renewal of `mcr join` tokens by the operator itself ([`JoinRenewal`]): before a joined
//! member's token ends, [`KubeconfigSecrets`](super::KubeconfigSecrets) asks the member, with
//! that token, for a new one bound to a new anchor Secret, writes it into the kubeconfig
//! Secret, and once the cluster is engaged with it revokes the old token by deleting the old
//! anchor.
//!
//! The member grants this with `mcr join --renewable`: a Role in the identity's namespace
//! that lets the identity create tokens for itself, create Secrets there, and read and delete
//! only its anchors (the join's, and the two names renewals alternate between).

use std::time::{Duration, SystemTime};

use k8s_openapi::api::authentication::v1::{BoundObjectReference, TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{Secret, ServiceAccount};
use kube::api::{Api, DeleteParams, ObjectMeta, Patch, PatchParams, PostParams, Preconditions};
use kube::{Client, ResourceExt};

use crate::client::Shown;
use crate::client::owners::is_path_safe_name;

/// The label `mcr join` puts on what it makes (and on the host Secret): the join's name.
pub const JOINED_AS_LABEL: &str = "multicluster-runtime.sigs.k8s.io/joined-as";
/// On anchors: which destination's token they anchor (16 hex digits).
pub const TOKEN_FOR_LABEL: &str = "multicluster-runtime.sigs.k8s.io/token-for";
/// On the host Secret: the name of the anchor Secret (in the member) of its token.
pub const TOKEN_ANCHOR_ANNOTATION: &str = "multicluster-runtime.sigs.k8s.io/token-anchor";
/// On the host Secret: the member identity, `NAMESPACE/NAME`.
pub const SERVICE_ACCOUNT_ANNOTATION: &str = "multicluster-runtime.sigs.k8s.io/service-account";
/// On the host Secret, written by `mcr join --renewable`: the destination's key (the anchors'
/// `token-for`). Its presence says the member granted renewal.
pub const TOKEN_RENEWAL_ANNOTATION: &str = "multicluster-runtime.sigs.k8s.io/token-renewal";

/// The two anchor names renewals of the join `name`'s token for `token_for` alternate
/// between (a Role can name them ahead of time: generated names cannot be).
pub fn renewal_anchors(name: &str, token_for: &str) -> [String; 2] {
    [0, 1].map(|n| format!("mcr-join-{name}-renew-{token_for}-{n}"))
}

/// When and for how long `mcr join` tokens are renewed
/// ([`KubeconfigSecrets::renew_join_tokens`](super::KubeconfigSecrets::renew_join_tokens)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct JoinRenewal {
    pub(crate) valid_for: Duration,
    pub(crate) ahead: Duration,
}

impl Default for JoinRenewal {
    fn default() -> Self {
        Self::new()
    }
}

/// The least a TokenRequest may ask for.
const SHORTEST: Duration = Duration::from_secs(600);

impl JoinRenewal {
    /// New tokens of 90 days, asked for 30 days before the current one ends.
    pub fn new() -> Self {
        Self {
            valid_for: Duration::from_secs(90 * 24 * 3600),
            ahead: Duration::from_secs(30 * 24 * 3600),
        }
    }

    /// How long new tokens last (at least ten minutes, the least the API server issues; its
    /// `--service-account-max-token-expiration` may shorten them).
    #[must_use]
    pub fn valid_for(mut self, valid_for: Duration) -> Self {
        self.valid_for = valid_for.max(SHORTEST);
        self
    }

    /// How long before the current token's end a new one is asked for. Failures are retried
    /// after a minute, doubling up to an hour, until the token ends (and after).
    #[must_use]
    pub fn ahead(mut self, ahead: Duration) -> Self {
        self.ahead = ahead;
        self
    }
}

/// What a renewable host Secret says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Plan {
    join: String,
    token_for: String,
    sa_namespace: String,
    sa_name: String,
    anchor: String,
    next: String,
}

/// The renewal `secret` allows: `Ok(None)` when it does not (no renewal annotation, or not a
/// Secret `mcr join` wrote); an error when its annotations are not what `mcr join` writes
/// (anyone who can write the Secret writes them: each becomes part of a request path, so
/// each must be a name and nothing else).
pub(crate) fn plan(secret: &Secret) -> Result<Option<Plan>, String> {
    let annotations = secret.annotations();
    let Some(token_for) = annotations.get(TOKEN_RENEWAL_ANNOTATION) else {
        return Ok(None);
    };
    let join = secret.name_any();
    if secret.labels().get(JOINED_AS_LABEL) != Some(&join) {
        return Ok(None);
    }
    if token_for.len() != 16 || !token_for.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(format!(
            "{TOKEN_RENEWAL_ANNOTATION} is not the 16 hex digits mcr join writes"
        ));
    }
    let (sa_namespace, sa_name) = annotations
        .get(SERVICE_ACCOUNT_ANNOTATION)
        .and_then(|s| s.split_once('/'))
        .filter(|(ns, name)| is_path_safe_name(ns) && is_path_safe_name(name))
        .ok_or_else(|| format!("{SERVICE_ACCOUNT_ANNOTATION} is not NAMESPACE/NAME"))?;
    let anchor = annotations
        .get(TOKEN_ANCHOR_ANNOTATION)
        .filter(|a| is_path_safe_name(a))
        .ok_or_else(|| format!("{TOKEN_ANCHOR_ANNOTATION} is not a Secret's name"))?;
    let [first, second] = renewal_anchors(&join, token_for);
    let next = if *anchor == first { second } else { first };
    Ok(Some(Plan {
        join,
        token_for: token_for.clone(),
        sa_namespace: sa_namespace.to_string(),
        sa_name: sa_name.to_string(),
        anchor: anchor.clone(),
        next,
    }))
}

/// A renewal written to the host Secret.
#[derive(Debug)]
pub(crate) struct Renewed {
    /// The version (hash) of the kubeconfig written: once it is engaged, `old` is revoked.
    pub(crate) version: u64,
    pub(crate) expires: SystemTime,
    pub(crate) sa_namespace: String,
    pub(crate) old: String,
    /// The new token's anchor.
    pub(crate) anchor: String,
}

/// An anchor older than this, found where a renewal would make its own, was left by a
/// renewal that failed (a renewal takes seconds); a younger one belongs to one under way
/// (another replica's) and is left alone.
const STALE_ANCHOR: Duration = Duration::from_secs(600);

/// Renews the token of `secret` (data key `key`) by `plan`: a new anchor and token in the
/// member (through `member`, the cluster's client, which holds the current token), then the
/// kubeconfig and annotations of the host Secret, written only if it has not changed since
/// (`resourceVersion`). Anything made in the member is deleted again if a later step fails.
pub(crate) async fn renew(
    host: &Api<Secret>,
    key: &str,
    secret: &Secret,
    plan: &Plan,
    member: Client,
    valid_for: Duration,
) -> Result<Renewed, String> {
    let anchors: Api<Secret> = Api::namespaced(member.clone(), &plan.sa_namespace);
    let anchor = make_anchor(&anchors, plan).await?;
    let uid = anchor.metadata.uid.clone();
    let written = async {
        let request = TokenRequest {
            spec: Some(TokenRequestSpec {
                audiences: None,
                expiration_seconds: Some(i64::try_from(valid_for.as_secs()).unwrap_or(i64::MAX)),
                bound_object_ref: Some(BoundObjectReference {
                    api_version: Some("v1".into()),
                    kind: Some("Secret".into()),
                    name: Some(plan.next.clone()),
                    uid: uid.clone(),
                }),
            }),
            ..Default::default()
        };
        let status = Api::<ServiceAccount>::namespaced(member, &plan.sa_namespace)
            .create_token_request(&plan.sa_name, &PostParams::default(), &request)
            .await
            .map_err(|e| format!("requesting a token for {}/{}: {}", plan.sa_namespace, plan.sa_name, Shown(&e)))?
            .status
            .ok_or("the member answered the token request without a token")?;
        let (Some(token), Some(end)) = (status.token, status.expiration_timestamp) else {
            return Err("the member answered the token request without a token or its end".to_string());
        };
        let expires_text = serde_json::to_value(&end)
            .ok()
            .and_then(|v| v.as_str().map(str::to_string))
            .ok_or("the member's token came without its end")?;
        let expires = SystemTime::UNIX_EPOCH
            + Duration::from_secs(u64::try_from(end.0.as_second()).unwrap_or(0));
        let kubeconfig = with_token(secret, key, &token)?;
        let version = super::kubeconfig::version_of(&Some(kubeconfig.as_slice()));
        let encoded = {
            use base64::Engine as _;
            base64::engine::general_purpose::STANDARD.encode(&kubeconfig)
        };
        let patch = serde_json::json!({
            "metadata": {
                "resourceVersion": secret.resource_version(),
                "annotations": {
                    TOKEN_ANCHOR_ANNOTATION: plan.next,
                    super::kubeconfig_secrets::TOKEN_EXPIRES_ANNOTATION: expires_text,
                },
            },
            "data": { key: encoded },
        });
        host.patch(&secret.name_any(), &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map_err(|e| match e {
                kube::Error::Api(s) if s.code == 409 => {
                    "the Secret changed while the token was renewed (it is renewed again from what it holds now)".to_string()
                }
                e => format!("writing the renewed kubeconfig to the Secret: {}", Shown(&e)),
            })?;
        Ok::<_, String>((version, expires))
    }
    .await;
    match written {
        Ok((version, expires)) => Ok(Renewed {
            version,
            expires,
            sa_namespace: plan.sa_namespace.clone(),
            old: plan.anchor.clone(),
            anchor: plan.next.clone(),
        }),
        Err(error) => {
            // The new token is not used: revoked with its anchor.
            if let Err(e) = delete_anchor(&anchors, &plan.next, uid).await {
                tracing::debug!(anchor = %plan.next, error = %e, "could not delete an unused anchor");
            }
            Err(error)
        }
    }
}

/// Creates `plan`'s next anchor, after deleting a stale one of its name.
async fn make_anchor(anchors: &Api<Secret>, plan: &Plan) -> Result<Secret, String> {
    let anchor = Secret {
        metadata: ObjectMeta {
            name: Some(plan.next.clone()),
            labels: Some(
                [
                    (JOINED_AS_LABEL.to_string(), plan.join.clone()),
                    (TOKEN_FOR_LABEL.to_string(), plan.token_for.clone()),
                ]
                .into(),
            ),
            ..Default::default()
        },
        type_: Some("Opaque".into()),
        ..Default::default()
    };
    for _ in 0..2 {
        match anchors.create(&PostParams::default(), &anchor).await {
            Ok(made) => return Ok(made),
            Err(kube::Error::Api(s)) if s.code == 409 => {
                let found = anchors
                    .get_opt(&plan.next)
                    .await
                    .map_err(|e| format!("reading the anchor {}: {}", plan.next, Shown(&e)))?;
                let Some(found) = found else { continue };
                let age = found
                    .creation_timestamp()
                    .map(|t| t.0)
                    .and_then(|t| {
                        SystemTime::UNIX_EPOCH.checked_add(Duration::from_secs(
                            u64::try_from(t.as_second()).unwrap_or(0),
                        ))
                    })
                    .and_then(|t| SystemTime::now().duration_since(t).ok())
                    .unwrap_or_default();
                if age < STALE_ANCHOR {
                    return Err(format!(
                        "the anchor {} was made {}s ago: another renewal is under way",
                        plan.next,
                        age.as_secs()
                    ));
                }
                delete_anchor(anchors, &plan.next, found.metadata.uid.clone()).await?;
            }
            Err(e) => {
                return Err(format!(
                    "creating the anchor {}/{}: {}",
                    plan.sa_namespace,
                    plan.next,
                    Shown(&e)
                ));
            }
        }
    }
    Err(format!("the anchor {} kept coming back", plan.next))
}

/// Deletes the anchor `name` (of `uid`, if given): its token is refused from then on.
async fn delete_anchor(
    anchors: &Api<Secret>,
    name: &str,
    uid: Option<String>,
) -> Result<(), String> {
    let params = DeleteParams {
        preconditions: uid.map(|uid| Preconditions {
            uid: Some(uid),
            resource_version: None,
        }),
        ..DeleteParams::default()
    };
    match anchors.delete(name, &params).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
        Err(e) => Err(format!("deleting the anchor {name}: {}", Shown(&e))),
    }
}

/// Revokes the token anchored by `old` (in `sa_namespace` of the member `member` reaches).
pub(crate) async fn revoke(member: Client, sa_namespace: &str, old: &str) -> Result<(), String> {
    delete_anchor(&Api::namespaced(member, sa_namespace), old, None).await
}

/// The kubeconfig of `secret`'s data key `key`, its current user's token made `token` (as
/// JSON, which every kubeconfig reader takes).
fn with_token(secret: &Secret, key: &str, token: &str) -> Result<Vec<u8>, String> {
    let data = secret
        .data
        .as_ref()
        .and_then(|d| d.get(key))
        .ok_or_else(|| format!("no data key {key:?}"))?;
    let text =
        std::str::from_utf8(&data.0).map_err(|_| "the kubeconfig is not UTF-8".to_string())?;
    let mut kubeconfig = super::kubeconfig::parse(text)?;
    let user = match &kubeconfig.current_context {
        Some(current) => kubeconfig
            .contexts
            .iter()
            .find(|c| &c.name == current)
            .and_then(|c| c.context.as_ref())
            .and_then(|c| c.user.clone())
            .ok_or("the kubeconfig's current context is not in it, or names no user")?,
        None if kubeconfig.auth_infos.len() == 1 => kubeconfig.auth_infos[0].name.clone(),
        None => return Err("the kubeconfig has no current context".into()),
    };
    let auth = kubeconfig
        .auth_infos
        .iter_mut()
        .find(|a| a.name == user)
        .and_then(|a| a.auth_info.as_mut())
        .ok_or("the kubeconfig's current user is not in it")?;
    if auth.token.is_none() {
        return Err("the kubeconfig's user has no token to renew".into());
    }
    auth.token = Some(token.to_string().into());
    serde_json::to_vec(&kubeconfig)
        .map_err(|_| "the renewed kubeconfig could not be written".to_string())
}

/// When the renewal of a token ending at `end` is due, `ahead` before it.
pub(crate) fn due(end: SystemTime, ahead: Duration) -> SystemTime {
    end.checked_sub(ahead).unwrap_or(SystemTime::UNIX_EPOCH)
}

/// How long to wait after `failures` failed renewals: a minute, doubling up to an hour.
pub(crate) fn backoff(failures: u32) -> Duration {
    Duration::from_secs(
        60u64
            .saturating_mul(1u64 << failures.saturating_sub(1).min(6))
            .min(3600),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret(annotations: &[(&str, &str)]) -> Secret {
        Secret {
            metadata: ObjectMeta {
                name: Some("a".into()),
                labels: Some([(JOINED_AS_LABEL.to_string(), "a".to_string())].into()),
                annotations: Some(
                    annotations
                        .iter()
                        .map(|(k, v)| (k.to_string(), v.to_string()))
                        .collect(),
                ),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    #[test]
    fn a_renewable_secret_alternates_anchors_and_hostile_annotations_are_refused() {
        let good = [
            (TOKEN_RENEWAL_ANNOTATION, "0123456789abcdef"),
            (SERVICE_ACCOUNT_ANNOTATION, "mcr-system/mcr-member"),
            (TOKEN_ANCHOR_ANNOTATION, "mcr-join-a-token-xyz"),
        ];
        let plan1 = plan(&secret(&good)).unwrap().unwrap();
        assert_eq!(plan1.next, "mcr-join-a-renew-0123456789abcdef-0");
        let mut second = good;
        second[2].1 = "mcr-join-a-renew-0123456789abcdef-0";
        assert_eq!(
            plan(&secret(&second)).unwrap().unwrap().next,
            "mcr-join-a-renew-0123456789abcdef-1"
        );
        assert_eq!(plan(&secret(&good[1..])).unwrap(), None);
        for (at, bad) in [
            (0, "../../secrets"),
            (0, "0123456789abcdeg"),
            (1, "mcr-system/../x"),
            (1, "mcr-system"),
            (1, "ns/a?b"),
            (2, "a/b"),
            (2, ""),
        ] {
            let mut hostile = good;
            hostile[at].1 = bad;
            assert!(plan(&secret(&hostile)).is_err(), "{bad}");
        }
        // Not a Secret mcr join wrote under this name: not renewed.
        let mut other = secret(&good);
        other.metadata.labels = None;
        assert_eq!(plan(&other).unwrap(), None);
    }

    #[test]
    fn failures_back_off_from_a_minute_to_an_hour() {
        assert_eq!(backoff(1), Duration::from_secs(60));
        assert_eq!(backoff(2), Duration::from_secs(120));
        assert_eq!(backoff(7), Duration::from_secs(3600));
        assert_eq!(backoff(40), Duration::from_secs(3600));
    }
}
