//! [`LeaderElection`]: one replica of a controller acts at a time, decided with a
//! `coordination.k8s.io/v1` Lease on the host cluster.
//!
//! The protocol is client-go's, so replicas of this crate and Go controllers read the same
//! Lease the same way: the holder renews `spec.renewTime` every retry period; a candidate
//! takes the Lease over only after it has seen the same record unchanged for the record's
//! `leaseDurationSeconds` by its own clock (never comparing clocks across machines); every
//! write carries the `resourceVersion` it read, so two candidates cannot both win. A leader
//! that has not renewed within the renew deadline stops leading at once, before the Lease
//! can expire for the others (`lease_duration > renew_deadline`).
//!
//! The crate has its own implementation rather than `kube-lease-manager` (the maintained
//! crate for kube 5): that crate keeps reporting leadership while its renewals fail (its
//! `watch` channel stays `true` and `changed` returns the error), so a leader cut off from
//! the API server, or whose RBAC was revoked, reconciles on after another replica has taken
//! the Lease over. `tests/leader_election.rs` revokes a leader's RBAC to check this one steps
//! down in time.

use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::Client;
use kube::api::{Api, PostParams};

use crate::lease::LeaseTiming;

/// What a manager does when it loses its lease: see [`LeaderElection::on_loss`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum OnLoss {
    /// [`Manager::run`](crate::Manager::run) returns
    /// [`ManagerError::LeadershipLost`](crate::ManagerError::LeadershipLost); the process
    /// is expected to exit and be restarted (controller-runtime's behaviour).
    #[default]
    Exit,
    /// The manager stops its controllers and becomes a candidate again; they start afresh
    /// when it wins the lease back.
    Candidate,
}

/// Leader election settings for a [`Manager`](crate::Manager): only the replica holding the
/// Lease runs controllers.
///
/// ```no_run
/// # use multicluster_runtime::{LeaderElection, Manager, providers::Clusters, ClusterName};
/// # async fn f(host: kube::Client) {
/// let manager = Manager::new(Clusters::<ClusterName>::new())
///     .leader_election(LeaderElection::new(host, "operators", "my-operator-leader"));
/// # }
/// ```
#[derive(Clone)]
pub struct LeaderElection {
    pub(crate) client: Client,
    pub(crate) namespace: String,
    pub(crate) name: String,
    pub(crate) identity: String,
    pub(crate) timing: LeaseTiming,
    pub(crate) on_loss: OnLoss,
    pub(crate) release_on_shutdown: bool,
}

impl std::fmt::Debug for LeaderElection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaderElection")
            .field("lease", &format_args!("{}/{}", self.namespace, self.name))
            .field("identity", &self.identity)
            .field("timing", &self.timing)
            .field("on_loss", &self.on_loss)
            .field("release_on_shutdown", &self.release_on_shutdown)
            .finish()
    }
}

/// Leader election settings that cannot work.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("leader election for lease {lease}: {reason} ({timing})")]
pub struct InvalidLeaderElection {
    /// The lease, as `namespace/name`.
    pub lease: String,
    /// What is wrong.
    pub reason: &'static str,
    /// The timings.
    pub timing: LeaseTiming,
}

impl LeaderElection {
    /// Leader election with the Lease `namespace/name` through `client` (the host cluster's),
    /// client-go's timings ([`LeaseTiming::default`]), an
    /// identity of the host name and a random suffix, [`OnLoss::Exit`], and the lease released
    /// on a graceful shutdown.
    pub fn new(client: Client, namespace: &str, name: &str) -> Self {
        Self {
            client,
            namespace: namespace.to_string(),
            name: name.to_string(),
            identity: default_identity(),
            timing: LeaseTiming::default(),
            on_loss: OnLoss::Exit,
            release_on_shutdown: true,
        }
    }

    /// This replica's name in the Lease (`spec.holderIdentity`); unique among the replicas.
    #[must_use]
    pub fn identity(mut self, identity: impl Into<String>) -> Self {
        self.identity = identity.into();
        self
    }

    /// How often the leader renews, how long it leads without a renewal, how long a
    /// candidate waits before taking over; client-go's defaults unless set.
    #[must_use]
    pub fn timing(mut self, timing: LeaseTiming) -> Self {
        self.timing = timing;
        self
    }

    /// What the manager does when it loses the lease; [`OnLoss::Exit`] by default.
    #[must_use]
    pub fn on_loss(mut self, on_loss: OnLoss) -> Self {
        self.on_loss = on_loss;
        self
    }

    /// Whether a graceful shutdown (once every reconcile has ended) gives the Lease up, so
    /// another replica takes over at once rather than after the lease duration. On by
    /// default.
    #[must_use]
    pub fn release_on_shutdown(mut self, release: bool) -> Self {
        self.release_on_shutdown = release;
        self
    }

    /// This replica's identity.
    pub fn holder_identity(&self) -> &str {
        &self.identity
    }

    /// The settings' consistency: the lease duration longer than the renew deadline, which is
    /// longer than the retry period with its jitter.
    pub fn validate(&self) -> Result<(), InvalidLeaderElection> {
        let reason = if let Some(reason) = self.timing.problem(Duration::ZERO) {
            Some(reason)
        } else if self.identity.is_empty() {
            Some("the identity is empty")
        } else {
            None
        };
        match reason {
            None => Ok(()),
            Some(reason) => Err(InvalidLeaderElection {
                lease: format!("{}/{}", self.namespace, self.name),
                reason,
                timing: self.timing,
            }),
        }
    }
}

/// The machine's host name: a pod's name in a cluster.
pub(crate) fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "replica".to_string())
}

/// The host name, then `_` and eight random hex digits.
pub(crate) fn default_identity() -> String {
    let host = host_name();
    let suffix = (crate::util::jitter::random_unit() * f64::from(u32::MAX)) as u32;
    format!("{host}_{suffix:08x}")
}

/// The Lease record as last seen, and when (by this replica's clock) it last changed.
struct Observed {
    holder: Option<String>,
    renew_time: Option<MicroTime>,
    transitions: i32,
    lease_duration: Duration,
    changed_at: Instant,
}

/// One replica's side of the election.
pub(crate) struct Elector {
    config: LeaderElection,
    api: Api<Lease>,
    observed: Option<Observed>,
}

/// The outcome of one attempt to acquire or renew.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Attempt {
    /// This replica holds the Lease (acquired or renewed just now).
    Held,
    /// Another replica holds it, and it has not expired.
    HeldBy(String),
}

impl Elector {
    pub(crate) fn new(config: LeaderElection) -> Self {
        let api = Api::namespaced(config.client.clone(), &config.namespace);
        Self {
            config,
            api,
            observed: None,
        }
    }

    pub(crate) fn config(&self) -> &LeaderElection {
        &self.config
    }

    /// Tries once to acquire the Lease, or to renew it if this replica holds it.
    pub(crate) async fn try_acquire_or_renew(&mut self) -> Result<Attempt, kube::Error> {
        let now = MicroTime(k8s_openapi::jiff::Timestamp::now());
        let duration_seconds = self.config.timing.lease_seconds();
        let existing = match self.api.get_opt(&self.config.name).await? {
            Some(lease) => lease,
            None => {
                let lease = Lease {
                    metadata: ObjectMeta {
                        name: Some(self.config.name.clone()),
                        namespace: Some(self.config.namespace.clone()),
                        ..Default::default()
                    },
                    spec: Some(LeaseSpec {
                        holder_identity: Some(self.config.identity.clone()),
                        lease_duration_seconds: Some(duration_seconds),
                        acquire_time: Some(now.clone()),
                        renew_time: Some(now),
                        lease_transitions: Some(0),
                        ..Default::default()
                    }),
                };
                return match self.api.create(&PostParams::default(), &lease).await {
                    Ok(created) => {
                        self.observe(&created);
                        Ok(Attempt::Held)
                    }
                    // Another replica created it first.
                    Err(kube::Error::Api(e)) if e.code == 409 => Ok(Attempt::HeldBy(
                        "another replica (it created the lease first)".to_string(),
                    )),
                    Err(e) => Err(e),
                };
            }
        };
        self.observe(&existing);
        let spec = existing.spec.clone().unwrap_or_default();
        let holder = spec.holder_identity.clone().filter(|h| !h.is_empty());
        let mine = holder.as_deref() == Some(self.config.identity.as_str());
        if let Some(other) = holder.as_ref().filter(|_| !mine)
            && self
                .observed
                .as_ref()
                .is_some_and(|o| o.changed_at.elapsed() < o.lease_duration)
        {
            return Ok(Attempt::HeldBy(other.clone()));
        }
        let transitions = spec.lease_transitions.unwrap_or(0);
        let mut lease = existing;
        lease.spec = Some(LeaseSpec {
            holder_identity: Some(self.config.identity.clone()),
            lease_duration_seconds: Some(duration_seconds),
            acquire_time: if mine {
                spec.acquire_time.clone()
            } else {
                Some(now.clone())
            },
            renew_time: Some(now),
            lease_transitions: Some(if mine {
                transitions
            } else {
                transitions.saturating_add(1)
            }),
            ..spec
        });
        // A replace carries the resourceVersion read above: if anyone wrote in between, it
        // fails with a conflict and this attempt has not acquired anything.
        match self
            .api
            .replace(&self.config.name, &PostParams::default(), &lease)
            .await
        {
            Ok(updated) => {
                self.observe(&updated);
                Ok(Attempt::Held)
            }
            // Someone else wrote in between. Taking over, that means another candidate won;
            // renewing, it may be anything (a label added to the Lease): retried until the
            // renew deadline, as any failed renewal.
            Err(kube::Error::Api(e)) if e.code == 409 && !mine => {
                Ok(Attempt::HeldBy(holder.unwrap_or_else(|| {
                    "another replica (it wrote first)".to_string()
                })))
            }
            Err(e) => Err(e),
        }
    }

    /// Gives the Lease up if this replica holds it: no holder, so a candidate takes it at its
    /// next attempt.
    pub(crate) async fn release(&mut self) -> Result<(), kube::Error> {
        let Some(mut lease) = self.api.get_opt(&self.config.name).await? else {
            return Ok(());
        };
        let mut spec = lease.spec.clone().unwrap_or_default();
        if spec.holder_identity.as_deref() != Some(self.config.identity.as_str()) {
            return Ok(());
        }
        let now = MicroTime(k8s_openapi::jiff::Timestamp::now());
        spec.holder_identity = None;
        spec.lease_duration_seconds = Some(1);
        spec.renew_time = Some(now.clone());
        spec.acquire_time = Some(now);
        lease.spec = Some(spec);
        self.api
            .replace(&self.config.name, &PostParams::default(), &lease)
            .await?;
        self.observed = None;
        Ok(())
    }

    /// Notes the record; restarts the expiry clock when it changed.
    fn observe(&mut self, lease: &Lease) {
        let spec = lease.spec.clone().unwrap_or_default();
        let holder = spec.holder_identity.filter(|h| !h.is_empty());
        let unchanged = self
            .observed
            .as_ref()
            .is_some_and(|o| o.holder == holder && o.renew_time == spec.renew_time);
        if unchanged {
            return;
        }
        let lease_duration = spec
            .lease_duration_seconds
            .and_then(|s| u64::try_from(s).ok())
            .filter(|s| *s > 0)
            .map_or(self.config.timing.lease_duration, Duration::from_secs);
        self.observed = Some(Observed {
            holder,
            renew_time: spec.renew_time,
            transitions: spec.lease_transitions.unwrap_or(0),
            lease_duration,
            changed_at: Instant::now(),
        });
    }

    /// How many times the Lease changed hands, as last seen.
    pub(crate) fn transitions(&self) -> i32 {
        self.observed.as_ref().map_or(0, |o| o.transitions)
    }
}
