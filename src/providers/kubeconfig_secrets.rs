//! [`KubeconfigSecrets`]: clusters from kubeconfigs stored in labelled Secrets of the host
//! cluster.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::pin::pin;

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use k8s_openapi::api::core::v1::Secret;
use kube::config::Kubeconfig;
use kube::{Api, Client, Resource, ResourceExt};
use kube_runtime::WatchStreamExt;
use kube_runtime::events::{Recorder, Reporter};
use kube_runtime::watcher::{self, Event as WatchEvent};
use tokio_util::sync::CancellationToken;

use super::join_renewal::{self, JoinRenewal};
use super::kubeconfig::version_of;
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

    async fn refuse(&self, recorder: &Recorder, secret: &Secret, reason: &str) {
        tracing::warn!(cluster = %secret.name_any(), namespace = %self.namespace, error = %reason, "kubeconfig Secret refused");
        super::record_refusal(
            recorder,
            &secret.object_ref(&()),
            &secret.name_any(),
            reason,
        )
        .await;
    }
}

/// How many clients are built at once (each may run a credential plugin, for up to 30 s).
const BUILDS_AT_ONCE: usize = 4;

impl Provider for KubeconfigSecrets {
    type Id = ClusterName;

    async fn run(
        &self,
        fleet: Fleet<ClusterName>,
        shutdown: CancellationToken,
    ) -> Result<(), ProviderError> {
        let api: Api<Secret> = Api::namespaced(self.host.clone(), &self.namespace);
        let selector = watcher::Config::default().labels(&format!("{}=true", self.label));
        let recorder = Recorder::new(
            self.host.clone(),
            Reporter::from("multicluster-runtime-kubeconfig-secrets"),
        );
        let mut events = pin!(watcher::watcher(api.clone(), selector).default_backoff());
        // The Secrets of a listing in progress, to forget those that vanished meanwhile.
        let mut listing: BTreeSet<String> = BTreeSet::new();
        let mut known: BTreeMap<String, Known> = BTreeMap::new();
        // Builds run a few at once; the rest wait their turn in arrival order.
        let mut building = FuturesUnordered::new();
        let mut inflight = super::InFlight::default();
        let mut waiting: VecDeque<(u64, Secret)> = VecDeque::new();
        // Renewals of `mcr join` tokens, and revocations of the tokens they replaced.
        let mut renewals = self.renewal.map(|settings| {
            join_renewal::Renewals::new(settings, api.clone(), self.key.clone(), recorder.clone())
        });
        let mut renewing = FuturesUnordered::new();
        loop {
            while building.len() < BUILDS_AT_ONCE
                && let Some((version, secret)) = waiting.pop_front()
            {
                if known.get(&secret.name_any()).and_then(|k| k.wanted) == Some(version) {
                    building.push(inflight.start(secret.name_any(), version, async move {
                        let cluster = self.cluster(&secret).await;
                        (version, secret, cluster)
                    }));
                }
            }
            let next_due = renewals
                .as_ref()
                .map_or(HOUR, join_renewal::Renewals::next_due);
            let event = tokio::select! {
                () = shutdown.cancelled() => return Ok(()),
                () = tokio::time::sleep(next_due), if renewals.is_some() => {
                    if let Some(renewals) = &mut renewals {
                        let engaged = |name: &str| known.get(name).and_then(|k| k.engaged);
                        renewing.extend(renewals.start(&fleet, engaged));
                    }
                    continue;
                }
                Some(done) = renewing.next(), if !renewing.is_empty() => {
                    if let Some(renewals) = &mut renewals {
                        renewals.done(done).await;
                    }
                    continue;
                }
                Some(built) = building.next(), if !building.is_empty() => {
                    // Ended: superseded, or its Secret gone.
                    let Ok((version, secret, cluster)) = built else {
                        continue;
                    };
                    let name = secret.name_any();
                    inflight.done(&name, version);
                    // A newer version, or a deletion, came while this one was built.
                    let Some(entry) = known.get_mut(&name).filter(|k| k.wanted == Some(version)) else {
                        continue;
                    };
                    entry.wanted = None;
                    match cluster {
                        Ok(cluster) => match fleet.engage(cluster) {
                            Ok(_) => {
                                entry.refused = None;
                                entry.engaged = Some(version);
                                // Engaged with a renewed token: the one it replaced goes.
                                if let Some(renewals) = &mut renewals {
                                    renewals.engaged(&name);
                                }
                            }
                            Err(error) => tracing::warn!(cluster = %name, %error, "could not engage"),
                        },
                        Err(reason) => {
                            entry.refused = Some(version);
                            self.refuse(&recorder, &secret, &reason).await;
                        }
                    }
                    continue;
                }
                event = events.next() => event,
            };
            let secret = match event {
                None => return Ok(()),
                Some(Err(error)) => {
                    tracing::warn!(namespace = %self.namespace, error = %crate::client::Shown(&error), "watching kubeconfig Secrets failed; retrying");
                    continue;
                }
                Some(Ok(WatchEvent::Init)) => {
                    listing.clear();
                    continue;
                }
                Some(Ok(WatchEvent::InitDone)) => {
                    // Secrets gone while the watch was away: forgotten, their clusters leave.
                    known.retain(|name, _| {
                        listing.contains(name) || {
                            if let Some(renewals) = &mut renewals {
                                renewals.forget(name);
                            }
                            inflight.cancel(name);
                            fleet.disengage(&ClusterName::from(name.clone()));
                            false
                        }
                    });
                    continue;
                }
                Some(Ok(WatchEvent::Delete(secret))) => {
                    // Deleted, or the label was removed (it left the selection).
                    let name = secret.name_any();
                    known.remove(&name);
                    if let Some(renewals) = &mut renewals {
                        renewals.forget(&name);
                    }
                    inflight.cancel(&name);
                    fleet.disengage(&ClusterName::from(name));
                    continue;
                }
                Some(Ok(WatchEvent::InitApply(secret))) => {
                    listing.insert(secret.name_any());
                    secret
                }
                Some(Ok(WatchEvent::Apply(secret))) => secret,
            };
            let name = secret.name_any();
            let data = secret.data.as_ref().and_then(|d| d.get(&self.key));
            let version = version_of(&data.map(|b| b.0.as_slice()));
            let entry = known.entry(name).or_default();
            let expires = token_expiry(&secret);
            if let Some(renewals) = &mut renewals {
                renewals.seen(&secret, expires);
            }
            // The end the Secret states may change alone (the kubeconfig did not).
            if entry.engaged == Some(version)
                && let Some(cluster) = fleet.get(&ClusterName::from(secret.name_any()))
            {
                cluster.restate_credential_end(expires);
            }
            // Unchanged (another field of the Secret changed, or a relist): nothing to do,
            // and a refusal is not repeated.
            if entry.settled(version) {
                continue;
            }
            inflight.supersede(&secret.name_any(), version);
            entry.wanted = Some(version);
            waiting.push_back((version, secret));
        }
    }
}

/// What the provider knows of one Secret, by versions (hashes) of its kubeconfig.
#[derive(Default)]
struct Known {
    /// The version its engaged cluster came from.
    engaged: Option<u64>,
    /// The version last refused (each version is refused, and reported, once).
    refused: Option<u64>,
    /// The version whose client is being built or waits to be.
    wanted: Option<u64>,
}

/// The annotation `mcr join` writes: when the token in the kubeconfig ends (RFC 3339).
pub const TOKEN_EXPIRES_ANNOTATION: &str = "multicluster-runtime.sigs.k8s.io/token-expires";

/// The longest the provider sleeps between looks at the renewals due.
const HOUR: std::time::Duration = std::time::Duration::from_secs(3600);

/// When `secret`'s token ends, if `mcr join` said so.
fn token_expiry(secret: &Secret) -> Option<std::time::SystemTime> {
    let text = secret.annotations().get(TOKEN_EXPIRES_ANNOTATION)?;
    let time: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time =
        serde_json::from_value(serde_json::Value::String(text.clone())).ok()?;
    let seconds = u64::try_from(time.0.as_second()).ok()?;
    std::time::SystemTime::UNIX_EPOCH.checked_add(std::time::Duration::from_secs(seconds))
}

impl Known {
    /// Whether `version` needs nothing done: it is being built, or it is the one engaged
    /// or the one refused.
    fn settled(&self, version: u64) -> bool {
        match self.wanted {
            Some(wanted) => wanted == version,
            None => self.engaged == Some(version) || self.refused == Some(version),
        }
    }
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
