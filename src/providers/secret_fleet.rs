//! The loop behind the providers whose clusters are Secrets of one namespace of a host
//! cluster ([`KubeconfigSecrets`](super::KubeconfigSecrets),
//! [`ArgoCdClusters`](super::ArgoCdClusters)): one cluster per selected Secret, named after
//! it, built a few at once, each content reported once when refused.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::future::Future;
use std::pin::pin;
use std::time::SystemTime;

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use k8s_openapi::api::core::v1::Secret;
use kube::{Api, Client, Resource, ResourceExt};
use kube_runtime::WatchStreamExt;
use kube_runtime::events::{Recorder, Reporter};
use kube_runtime::watcher::{self, Event as WatchEvent};
use tokio_util::sync::CancellationToken;

use super::join_renewal::{self, JoinRenewal};
use crate::cluster::{Cluster, ClusterName};
use crate::fleet::Fleet;
use crate::provider::ProviderError;

/// What one kind of cluster Secret says, and how its cluster is made.
pub(crate) trait SecretClusters: Sync {
    /// The Secrets' kind, in log lines ("kubeconfig Secret").
    const WHAT: &'static str;
    /// The log line of a refusal ("kubeconfig Secret refused").
    const REFUSED_LINE: &'static str;
    /// The reason of the Warning Event on a refused Secret.
    const REFUSED: &'static str;
    /// The reporting component of the Events.
    const REPORTER: &'static str;

    /// The data keys the cluster is made from: the others are dropped on arrival, never
    /// kept in memory.
    fn keys(&self) -> Vec<&str>;

    /// The cluster `secret` describes, or why it cannot be used (in words that hold nothing
    /// of the Secret's data).
    fn cluster(
        &self,
        secret: &Secret,
    ) -> impl Future<Output = Result<Cluster<ClusterName>, String>> + Send;

    /// When the credential ends, if the Secret says so.
    fn credential_end(&self, _secret: &Secret) -> Option<SystemTime> {
        None
    }
}

/// The Secrets to watch and what to do with them.
pub(crate) struct SecretFleet<'a, S> {
    pub(crate) host: &'a Client,
    pub(crate) namespace: &'a str,
    pub(crate) selector: String,
    pub(crate) source: &'a S,
    /// Renewal of `mcr join` tokens, with the data key of the kubeconfig.
    pub(crate) renewal: Option<(JoinRenewal, String)>,
}

/// How many clients are built at once (each may run a credential plugin, for up to 30 s).
const BUILDS_AT_ONCE: usize = 4;

/// The longest the loop sleeps between looks at the renewals due.
const HOUR: std::time::Duration = std::time::Duration::from_secs(3600);

impl<S: SecretClusters> SecretFleet<'_, S> {
    async fn refuse(&self, recorder: &Recorder, secret: &Secret, reason: &str) {
        tracing::warn!(cluster = %secret.name_any(), namespace = %self.namespace, error = %reason, "{}", S::REFUSED_LINE);
        super::record_refusal_as(
            recorder,
            &secret.object_ref(&()),
            &secret.name_any(),
            S::REFUSED,
            reason,
        )
        .await;
    }

    /// Engages the clusters of the Secrets until `shutdown`.
    pub(crate) async fn run(
        self,
        fleet: Fleet<ClusterName>,
        shutdown: CancellationToken,
    ) -> Result<(), ProviderError> {
        let api: Api<Secret> = Api::namespaced(self.host.clone(), self.namespace);
        let selector = watcher::Config::default().labels(&self.selector);
        let recorder = Recorder::new(self.host.clone(), Reporter::from(S::REPORTER));
        let mut events = pin!(watcher::watcher(api.clone(), selector).default_backoff());
        // The Secrets of a listing in progress, to forget those that vanished meanwhile.
        let mut listing: BTreeSet<String> = BTreeSet::new();
        let mut known: BTreeMap<String, Known> = BTreeMap::new();
        // Builds run a few at once; the rest wait their turn in arrival order.
        let mut building = FuturesUnordered::new();
        let mut inflight = super::InFlight::default();
        let mut waiting: VecDeque<(u64, Secret)> = VecDeque::new();
        // Renewals of `mcr join` tokens, and revocations of the tokens they replaced.
        let mut renewals = self.renewal.clone().map(|(settings, key)| {
            join_renewal::Renewals::new(settings, api.clone(), key, recorder.clone())
        });
        let mut renewing = FuturesUnordered::new();
        loop {
            while building.len() < BUILDS_AT_ONCE
                && let Some((version, secret)) = waiting.pop_front()
            {
                if known.get(&secret.name_any()).and_then(|k| k.wanted) == Some(version) {
                    let source = self.source;
                    building.push(inflight.start(secret.name_any(), version, async move {
                        let cluster = source.cluster(&secret).await;
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
                    tracing::warn!(namespace = %self.namespace, error = %crate::client::Shown(&error), "watching {}s failed; retrying", S::WHAT);
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
                    // Deleted, or a label changed (it left the selection).
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
                    trim(secret, &self.source.keys())
                }
                Some(Ok(WatchEvent::Apply(secret))) => trim(secret, &self.source.keys()),
            };
            let name = secret.name_any();
            let version = version(&secret, &self.source.keys());
            let entry = known.entry(name).or_default();
            let expires = self.source.credential_end(&secret);
            if let Some(renewals) = &mut renewals {
                renewals.seen(&secret, expires);
            }
            // The end the Secret states may change alone (the cluster's data did not).
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

/// `secret` with only what the loop and the source need: the data `keys` and the metadata
/// (without the managed fields).
fn trim(mut secret: Secret, keys: &[&str]) -> Secret {
    if let Some(data) = &mut secret.data {
        data.retain(|key, _| keys.contains(&key.as_str()));
    }
    secret.string_data = None;
    secret.metadata.managed_fields = None;
    secret
}

/// The version of what makes a Secret's cluster: the values of its data `keys`.
pub(crate) fn version(secret: &Secret, keys: &[&str]) -> u64 {
    let values: Vec<Option<&[u8]>> = keys
        .iter()
        .map(|key| {
            secret
                .data
                .as_ref()
                .and_then(|d| d.get(*key))
                .map(|b| b.0.as_slice())
        })
        .collect();
    super::kubeconfig::version_of(&values)
}

/// What the loop knows of one Secret, by versions (hashes) of its cluster's data.
#[derive(Default)]
struct Known {
    /// The version its engaged cluster came from.
    engaged: Option<u64>,
    /// The version last refused (each version is refused, and reported, once).
    refused: Option<u64>,
    /// The version whose client is being built or waits to be.
    wanted: Option<u64>,
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

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::ByteString;

    #[test]
    fn only_the_keys_a_cluster_is_made_from_are_kept() {
        let mut secret = Secret {
            data: Some(
                [
                    ("server", "s"),
                    ("config", "c"),
                    ("name", "n"),
                    ("other", "o"),
                ]
                .into_iter()
                .map(|(k, v)| (k.to_string(), ByteString(v.as_bytes().to_vec())))
                .collect(),
            ),
            ..Default::default()
        };
        secret.metadata.managed_fields = Some(vec![Default::default()]);
        let trimmed = trim(secret.clone(), &["server", "config"]);
        let kept: Vec<_> = trimmed.data.as_ref().unwrap().keys().cloned().collect();
        assert_eq!(kept, ["config", "server"]);
        assert!(trimmed.metadata.managed_fields.is_none());
        // The version depends on the chosen keys only.
        assert_eq!(
            version(&secret, &["server", "config"]),
            version(&trimmed, &["server", "config"])
        );
        let mut changed = trimmed.clone();
        changed
            .data
            .as_mut()
            .unwrap()
            .insert("config".into(), ByteString(b"d".to_vec()));
        assert_ne!(
            version(&changed, &["server", "config"]),
            version(&trimmed, &["server", "config"])
        );
    }
}
