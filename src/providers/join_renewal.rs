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

use k8s_openapi::api::authentication::v1::TokenRequest;
use k8s_openapi::api::core::v1::{Secret, ServiceAccount};
use kube::api::{Api, DeleteParams, ObjectMeta, Patch, PatchParams, PostParams, Preconditions};
use kube::{Client, Resource as _, ResourceExt};

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
/// On the host Secret, written with a renewed token: the anchor of the token it replaced,
/// until that anchor is deleted (so a revocation survives a restart of the operator).
pub const PREVIOUS_ANCHOR_ANNOTATION: &str =
    "multicluster-runtime.sigs.k8s.io/token-previous-anchor";
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
    /// The anchor of the token a renewal replaced, not yet revoked.
    previous: Option<String>,
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
    let previous = match annotations.get(PREVIOUS_ANCHOR_ANNOTATION) {
        Some(p) if is_path_safe_name(p) => (p != anchor).then(|| p.clone()),
        Some(_) => {
            return Err(format!(
                "{PREVIOUS_ANCHOR_ANNOTATION} is not a Secret's name"
            ));
        }
        None => None,
    };
    let [first, second] = renewal_anchors(&join, token_for);
    let next = if *anchor == first { second } else { first };
    Ok(Some(Plan {
        join,
        token_for: token_for.clone(),
        sa_namespace: sa_namespace.to_string(),
        sa_name: sa_name.to_string(),
        anchor: anchor.clone(),
        next,
        previous,
    }))
}

/// A renewal written to the host Secret: when the new token ends.
#[derive(Debug)]
pub(crate) struct Renewed {
    pub(crate) expires: SystemTime,
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
        // As JSON: the Rust types' optional fields differ between Kubernetes versions.
        let request: TokenRequest = serde_json::from_value(serde_json::json!({
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {
                "expirationSeconds": valid_for.as_secs(),
                "boundObjectRef": {
                    "apiVersion": "v1",
                    "kind": "Secret",
                    "name": plan.next,
                    "uid": uid,
                },
            },
        }))
        .map_err(|_| "the token request could not be made".to_string())?;
        let answer = Api::<ServiceAccount>::namespaced(member, &plan.sa_namespace)
            .create_token_request(&plan.sa_name, &PostParams::default(), &request)
            .await
            .map_err(|e| format!("requesting a token for {}/{}: {}", plan.sa_namespace, plan.sa_name, Shown(&e)))?;
        let status = serde_json::to_value(&answer)
            .ok()
            .and_then(|v| v.get("status").cloned())
            .unwrap_or_default();
        let (Some(token), Some(expires_text)) = (
            status.get("token").and_then(|t| t.as_str()).map(str::to_string),
            status
                .get("expirationTimestamp")
                .and_then(|t| t.as_str())
                .map(str::to_string),
        ) else {
            return Err(Unwritten(
                "the member answered the token request without a token or its end".to_string(),
            ));
        };
        let end: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time =
            serde_json::from_value(serde_json::Value::String(expires_text.clone()))
                .map_err(|_| "the member's token came with an end that is not a time".to_string())?;
        let expires = SystemTime::UNIX_EPOCH
            + Duration::from_secs(u64::try_from(end.0.as_second()).unwrap_or(0));
        let kubeconfig = with_token(secret, key, &token)?;
        let encoded = {
            use base64::Engine as _;
            base64::engine::general_purpose::STANDARD.encode(&kubeconfig)
        };
        let patch = serde_json::json!({
            "metadata": {
                "resourceVersion": secret.resource_version(),
                "annotations": {
                    TOKEN_ANCHOR_ANNOTATION: plan.next,
                    PREVIOUS_ANCHOR_ANNOTATION: plan.anchor,
                    super::kubeconfig_secrets::TOKEN_EXPIRES_ANNOTATION: expires_text,
                },
            },
            "data": { key: encoded },
        });
        let written = host
            .patch(&secret.name_any(), &PatchParams::default(), &Patch::Merge(&patch))
            .await;
        match written {
            Ok(_) => Ok::<_, Failed>(expires),
            Err(kube::Error::Api(s)) if s.code == 409 || s.code == 404 => Err(Unwritten(
                "the Secret changed while the token was renewed (it is renewed again from what it holds now)".to_string(),
            )),
            // No answer, or an error after the write may have landed: the anchor stays
            // unless the Secret is seen without it (deleting it would kill the token in use).
            Err(e) => {
                let reason = format!("writing the renewed kubeconfig to the Secret: {}", Shown(&e));
                match host.get_opt(&secret.name_any()).await {
                    Ok(Some(now)) if now.annotations().get(TOKEN_ANCHOR_ANNOTATION) == Some(&plan.next) => Ok(expires),
                    Ok(_) => Err(Unwritten(reason)),
                    Err(_) => Err(Unsure(reason)),
                }
            }
        }
    }
    .await;
    match written {
        Ok(expires) => Ok(Renewed { expires }),
        Err(Unwritten(error)) => {
            // The new token is not used: revoked with its anchor.
            if let Err(e) = delete_anchor(&anchors, &plan.next, uid).await {
                tracing::debug!(anchor = %plan.next, error = %e, "could not delete an unused anchor");
            }
            Err(error)
        }
        Err(Unsure(error)) => Err(format!(
            "{error} (whether it was written is unknown: its anchor {} is kept)",
            plan.next
        )),
    }
}

/// Why a renewal's write failed: it surely did not happen (the new anchor goes), or it may
/// have (the new anchor stays: it may hold the token in use).
enum Failed {
    Unwritten(String),
    Unsure(String),
}
use Failed::{Unsure, Unwritten};

impl From<String> for Failed {
    fn from(reason: String) -> Self {
        Unwritten(reason)
    }
}

impl From<&str> for Failed {
    fn from(reason: &str) -> Self {
        Unwritten(reason.to_string())
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

/// What became of the anchor a renewal replaced.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Revoked {
    /// Deleted: its token is refused from now on.
    Deleted,
    /// Gone already.
    Gone,
    /// The name is not one of this join's anchors (its labels differ): left alone.
    NotAnAnchor,
}

/// Revokes the token of `plan`'s previous anchor (in the member `member` reaches): deleted
/// only if it carries this join's and destination's labels, and as read (its uid); then
/// the annotation that named it is taken off the host Secret (under its resourceVersion).
pub(crate) async fn revoke_previous(
    host: &Api<Secret>,
    secret: &Secret,
    plan: &Plan,
    member: Client,
) -> Result<Revoked, String> {
    let Some(previous) = &plan.previous else {
        return Ok(Revoked::Gone);
    };
    let anchors: Api<Secret> = Api::namespaced(member, &plan.sa_namespace);
    let found = anchors
        .get_opt(previous)
        .await
        .map_err(|e| format!("reading the replaced anchor {previous}: {}", Shown(&e)))?;
    let revoked = match found {
        None => Revoked::Gone,
        Some(anchor) => {
            let labels = anchor.labels();
            if labels.get(JOINED_AS_LABEL) != Some(&plan.join)
                || labels.get(TOKEN_FOR_LABEL) != Some(&plan.token_for)
            {
                Revoked::NotAnAnchor
            } else {
                delete_anchor(&anchors, previous, anchor.metadata.uid.clone()).await?;
                Revoked::Deleted
            }
        }
    };
    let patch = serde_json::json!({
        "metadata": {
            "resourceVersion": secret.resource_version(),
            "annotations": { PREVIOUS_ANCHOR_ANNOTATION: null },
        },
    });
    host.patch(
        &secret.name_any(),
        &PatchParams::default(),
        &Patch::Merge(&patch),
    )
    .await
    .map_err(|e| {
        format!(
            "taking the revoked anchor's name off the Secret: {}",
            Shown(&e)
        )
    })?;
    Ok(revoked)
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

/// When the renewal of a token ending at `end` is due, seen at `now`: `ahead` before its
/// end, but not before half of what is left of it has passed (at most an hour), so a token
/// shorter than `ahead` (the member's API server may cap them) is renewed at its half-life
/// rather than again and again.
pub(crate) fn due(end: SystemTime, ahead: Duration, now: SystemTime) -> SystemTime {
    let left = end.duration_since(now).unwrap_or_default();
    let floor = now + (left / 2).min(Duration::from_secs(3600));
    end.checked_sub(ahead)
        .unwrap_or(SystemTime::UNIX_EPOCH)
        .max(floor)
}

/// How long to wait after `failures` failed renewals: a minute, doubling up to an hour.
pub(crate) fn backoff(failures: u32) -> Duration {
    Duration::from_secs(
        60u64
            .saturating_mul(1u64 << failures.saturating_sub(1).min(6))
            .min(3600),
    )
}

/// How a renewal or a revocation ended, for the entry of `generation`.
pub(crate) enum Outcome {
    Renewed {
        name: String,
        generation: u64,
        /// The Secret's resourceVersion it started from.
        from: Option<String>,
        renewed: Result<Renewed, String>,
    },
    Revoked {
        name: String,
        generation: u64,
        anchor: String,
        revoked: Result<Revoked, String>,
    },
}

/// One renewable Secret's state.
struct Entry {
    /// The Secret as last seen.
    secret: Secret,
    plan: Plan,
    /// A new entry for a Secret deleted and made again: outcomes of the old one are ignored.
    generation: u64,
    due: SystemTime,
    failures: u32,
    running: bool,
    revoke_due: SystemTime,
    revoke_failures: u32,
    revoking: bool,
}

/// The renewals of a provider's Secrets: when each is due, and the revocations of the
/// tokens they replaced (named by the Secret's `token-previous-anchor` until done).
pub(crate) struct Renewals {
    settings: JoinRenewal,
    host: Api<Secret>,
    key: String,
    recorder: kube_runtime::events::Recorder,
    entries: std::collections::BTreeMap<String, Entry>,
    generations: u64,
}

/// The longest wait between looks at what is due (the wall clock may jump).
const LOOK_AGAIN: Duration = Duration::from_secs(3600);
/// A cluster not engaged here with the Secret's kubeconfig is looked at again after this.
const NOT_HERE: Duration = Duration::from_secs(60);

impl Renewals {
    pub(crate) fn new(
        settings: JoinRenewal,
        host: Api<Secret>,
        key: String,
        recorder: kube_runtime::events::Recorder,
    ) -> Self {
        Self {
            settings,
            host,
            key,
            recorder,
            entries: Default::default(),
            generations: 0,
        }
    }

    /// The Secret was seen (its token ending at `expires`).
    pub(crate) fn seen(&mut self, secret: &Secret, expires: Option<SystemTime>) {
        let name = secret.name_any();
        let plan = match plan(secret) {
            Ok(Some(plan)) => plan,
            Ok(None) => {
                self.entries.remove(&name);
                return;
            }
            Err(reason) => {
                tracing::warn!(cluster = %name, %reason, "the Secret asks for its token's renewal in a form mcr join does not write: not renewed");
                self.entries.remove(&name);
                return;
            }
        };
        let Some(end) = expires else {
            self.entries.remove(&name);
            return;
        };
        let now = SystemTime::now();
        let due = due(end, self.settings.ahead, now);
        match self.entries.get_mut(&name) {
            Some(entry) => {
                // A new token (renewed, or joined again): its own schedule, failures forgotten.
                if entry
                    .secret
                    .annotations()
                    .get(super::kubeconfig_secrets::TOKEN_EXPIRES_ANNOTATION)
                    != secret
                        .annotations()
                        .get(super::kubeconfig_secrets::TOKEN_EXPIRES_ANNOTATION)
                {
                    entry.due = due;
                    entry.failures = 0;
                }
                entry.secret = secret.clone();
                entry.plan = plan;
            }
            None => {
                self.generations += 1;
                self.entries.insert(
                    name,
                    Entry {
                        secret: secret.clone(),
                        plan,
                        generation: self.generations,
                        due,
                        failures: 0,
                        running: false,
                        revoke_due: now,
                        revoke_failures: 0,
                        revoking: false,
                    },
                );
            }
        }
    }

    /// The Secret is gone (or no longer selected).
    pub(crate) fn forget(&mut self, name: &str) {
        self.entries.remove(name);
    }

    /// The cluster `name` was engaged (with a new kubeconfig): a replaced token is revoked now.
    pub(crate) fn engaged(&mut self, name: &str) {
        if let Some(entry) = self.entries.get_mut(name) {
            entry.revoke_due = SystemTime::now();
            entry.revoke_failures = 0;
        }
    }

    /// How long until something is due.
    pub(crate) fn next_due(&self) -> Duration {
        let now = SystemTime::now();
        self.entries
            .values()
            .flat_map(|e| {
                let renew = (!e.running && e.plan.previous.is_none()).then_some(e.due);
                let revoke = (!e.revoking && e.plan.previous.is_some()).then_some(e.revoke_due);
                [renew, revoke]
            })
            .flatten()
            .min()
            .map_or(LOOK_AGAIN, |at| at.duration_since(now).unwrap_or_default())
            .min(LOOK_AGAIN)
    }

    /// Starts what is due, for the clusters engaged here with their Secret's current
    /// kubeconfig (`engaged` gives the version the provider engaged a Secret's cluster from).
    /// With sharding, the replica that holds a cluster renews its token.
    pub(crate) fn start(
        &mut self,
        fleet: &crate::fleet::Fleet<crate::cluster::ClusterName>,
        engaged: impl Fn(&str) -> Option<u64>,
    ) -> Vec<futures::future::BoxFuture<'static, Outcome>> {
        let now = SystemTime::now();
        let mut started = Vec::new();
        for (name, entry) in &mut self.entries {
            let revoke =
                entry.plan.previous.is_some() && !entry.revoking && entry.revoke_due <= now;
            // A replaced token is revoked before the next renewal.
            let renew_due = entry.plan.previous.is_none() && !entry.running && entry.due <= now;
            if !revoke && !renew_due {
                continue;
            }
            let current = engaged(name)
                == Some(super::secret_fleet::version(
                    &entry.secret,
                    &[self.key.as_str()],
                ));
            let cluster = fleet.get(&crate::cluster::ClusterName::from(name.clone()));
            let (Some(cluster), true) = (cluster, current) else {
                if revoke {
                    entry.revoke_due = now + NOT_HERE;
                } else {
                    entry.due = now + NOT_HERE;
                }
                continue;
            };
            let client = cluster.client().clone();
            let (host, secret, plan, name, generation) = (
                self.host.clone(),
                entry.secret.clone(),
                entry.plan.clone(),
                name.clone(),
                entry.generation,
            );
            if revoke {
                entry.revoking = true;
                let anchor = plan.previous.clone().unwrap_or_default();
                started.push(Box::pin(async move {
                    let revoked = revoke_previous(&host, &secret, &plan, client).await;
                    Outcome::Revoked {
                        name,
                        generation,
                        anchor,
                        revoked,
                    }
                })
                    as futures::future::BoxFuture<'static, Outcome>);
            } else {
                entry.running = true;
                let (key, valid_for) = (self.key.clone(), self.settings.valid_for);
                started.push(Box::pin(async move {
                    let from = secret.resource_version();
                    let renewed = renew(&host, &key, &secret, &plan, client, valid_for).await;
                    Outcome::Renewed {
                        name,
                        generation,
                        from,
                        renewed,
                    }
                }));
            }
        }
        started
    }

    /// Takes in how a renewal or a revocation ended.
    pub(crate) async fn done(&mut self, outcome: Outcome) {
        let (name, generation) = match &outcome {
            Outcome::Renewed {
                name, generation, ..
            }
            | Outcome::Revoked {
                name, generation, ..
            } => (name.clone(), *generation),
        };
        // For a Secret since deleted (and perhaps made again): nothing to update.
        let Some(entry) = self
            .entries
            .get_mut(&name)
            .filter(|e| e.generation == generation)
        else {
            return;
        };
        let now = SystemTime::now();
        let failure = match outcome {
            Outcome::Renewed { renewed, from, .. } => {
                entry.running = false;
                match renewed {
                    Ok(renewed) => {
                        let until = k8s_openapi::jiff::Timestamp::try_from(renewed.expires)
                            .map(|t| t.to_string())
                            .unwrap_or_default();
                        tracing::info!(cluster = %name, until, "renewed the cluster's mcr join token");
                        entry.failures = 0;
                        // Due again once the Secret with the new token is seen (unless it
                        // was seen already and set it).
                        if entry.secret.resource_version() == from {
                            entry.due = now + LOOK_AGAIN;
                        }
                        None
                    }
                    Err(reason) => {
                        entry.failures += 1;
                        // A Secret written meanwhile set its own schedule.
                        if entry.secret.resource_version() == from {
                            entry.due = now + backoff(entry.failures);
                        }
                        tracing::warn!(cluster = %name, %reason, failures = entry.failures, "could not renew the cluster's mcr join token; retrying");
                        Some(("TokenRenewalFailed", "Renew", reason))
                    }
                }
            }
            Outcome::Revoked {
                revoked, anchor, ..
            } => {
                entry.revoking = false;
                match revoked {
                    Ok(Revoked::Deleted | Revoked::Gone) => {
                        tracing::info!(cluster = %name, %anchor, "revoked the cluster's replaced mcr join token");
                        entry.revoke_failures = 0;
                        None
                    }
                    Ok(Revoked::NotAnAnchor) => {
                        let reason = format!(
                            "{anchor} is not an anchor of this join's tokens (its labels differ): left alone"
                        );
                        tracing::warn!(cluster = %name, %reason, "the Secret named a replaced token's anchor that is not one");
                        Some(("TokenRevocationRefused", "Revoke", reason))
                    }
                    Err(reason) => {
                        entry.revoke_failures += 1;
                        entry.revoke_due = now + backoff(entry.revoke_failures);
                        tracing::warn!(cluster = %name, %anchor, %reason, "could not revoke the cluster's replaced mcr join token; retrying");
                        Some(("TokenRevocationFailed", "Revoke", reason))
                    }
                }
            }
        };
        if let Some((reason, action, note)) = failure {
            let event = kube_runtime::events::Event {
                type_: kube_runtime::events::EventType::Warning,
                reason: reason.into(),
                note: Some(note),
                action: action.into(),
                secondary: None,
            };
            let reference = entry.secret.object_ref(&());
            if let Err(error) = self.recorder.publish(&event, &reference).await {
                tracing::debug!(cluster = %name, error = %Shown(&error), "could not record a renewal's failure");
            }
        }
    }
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
    fn a_renewal_is_due_ahead_of_the_end_but_never_again_at_once() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let days = |n: u64| Duration::from_secs(n * 24 * 3600);
        // 90 days left, 30 ahead: at 60 days.
        assert_eq!(due(now + days(90), days(30), now), now + days(60));
        // A token of a day (capped by the member), 30 days ahead: an hour on, not now.
        assert_eq!(
            due(now + days(1), days(30), now),
            now + Duration::from_secs(3600)
        );
        // 2 minutes left, 80 s ahead: in 60 s (half of what is left), not in 40 s.
        assert_eq!(
            due(now + Duration::from_secs(120), Duration::from_secs(80), now),
            now + Duration::from_secs(60)
        );
        // Ended: now.
        assert_eq!(due(now - Duration::from_secs(5), days(30), now), now);
    }

    #[test]
    fn failures_back_off_from_a_minute_to_an_hour() {
        assert_eq!(backoff(1), Duration::from_secs(60));
        assert_eq!(backoff(2), Duration::from_secs(120));
        assert_eq!(backoff(7), Duration::from_secs(3600));
        assert_eq!(backoff(40), Duration::from_secs(3600));
    }
}
