//! [`Sharding`]: several replicas share a fleet, each owning a part of it, coordinated with
//! `coordination.k8s.io/v1` Leases on the host cluster.
//!
//! - Every replica announces itself with a peer Lease (`mcr-peer-…`, labelled with the group)
//!   and renews it; the live peers are those whose Lease this replica saw renewed within its
//!   duration, by its own clock ([`peers`]).
//! - Each cluster belongs to one live peer, by weighted rendezvous hashing of its id
//!   ([`rendezvous`]): a peer joining or leaving moves only the clusters it gains or held.
//! - A replica reconciles a cluster only while it holds the cluster's fence Lease
//!   (`mcr-shard-…`, [`fence`]); only then is the cluster a member of its fleet, with clients
//!   in use, watches and caches. A hand-off: the old owner takes the cluster out of its fleet,
//!   waits (bounded) for its reconciles there, releases the fence; the new owner then takes
//!   the fence and the cluster joins its fleet.
//! - Fences are written when taken and when released, never renewed: a fence holds while its
//!   holder's peer Lease is renewed. A replica whose peer Lease goes unrenewed for the renew
//!   deadline drops its work in every cluster at once, before the others (who wait for the
//!   lease duration) can count it gone and take its fences.

mod component;
mod coordinator;
mod fence;
mod group;
mod host;
mod peers;
mod rendezvous;

use std::time::Duration;

use kube::Client;

use crate::lease::LeaseTiming;

pub(crate) use component::ShardingComponent;
pub(crate) use coordinator::Coordinator;
pub use coordinator::ShardStatus;

/// The label on every Lease of a sharding group, with the group as its value.
pub const GROUP_LABEL: &str = "multicluster-runtime.io/shard-group";
/// The label saying what a group's Lease is: `peer` or `fence`.
pub const ROLE_LABEL: &str = "multicluster-runtime.io/shard-role";
/// The annotation on a peer Lease holding the peer's weight.
pub const WEIGHT_ANNOTATION: &str = "multicluster-runtime.io/shard-weight";
/// The annotation on a fence Lease naming its cluster (as the cluster id's text).
pub const CLUSTER_ANNOTATION: &str = "multicluster-runtime.io/shard-cluster";

/// Sharding settings for a [`Manager`](crate::Manager): replicas of one group split the
/// fleet between them; each builds watches and caches, and reconciles, only for the clusters
/// it owns.
///
/// ```no_run
/// # use multicluster_runtime::{Sharding, Manager, providers::Clusters, ClusterName};
/// # async fn f(host: kube::Client) {
/// let manager = Manager::new(Clusters::<ClusterName>::new())
///     .sharding(Sharding::new(host, "operators", "my-operator"));
/// # }
/// ```
///
/// Timings follow leader election's: every retry period a replica renews its peer Lease,
/// reads the group's Leases (from a watch, once it shows the renewal) and takes the fences of
/// clusters that are now its own. If its
/// peer Lease is not renewed within the renew deadline it gives every fence up at once (its
/// reconciles dropped); another replica takes a fence over once it has seen the holder's
/// peer Lease unchanged for the lease duration. At steady state a replica writes one Lease
/// per retry period however many clusters it owns; a fence is written when taken and when
/// released.
#[derive(Clone)]
pub struct Sharding {
    pub(crate) client: Client,
    pub(crate) namespace: String,
    pub(crate) group: String,
    pub(crate) identity: String,
    pub(crate) weight: f64,
    pub(crate) timing: LeaseTiming,
    pub(crate) handoff_timeout: Duration,
}

impl std::fmt::Debug for Sharding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sharding")
            .field("namespace", &self.namespace)
            .field("group", &self.group)
            .field("identity", &self.identity)
            .field("weight", &self.weight)
            .field("timing", &self.timing)
            .field("handoff_timeout", &self.handoff_timeout)
            .finish()
    }
}

/// Sharding settings that cannot work.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("sharding group {group}: {reason} ({timing}, weight {weight})")]
pub struct InvalidSharding {
    /// The group.
    pub group: String,
    /// What is wrong.
    pub reason: &'static str,
    /// The timings.
    pub timing: LeaseTiming,
    /// The weight.
    pub weight: f64,
}

impl Sharding {
    /// Sharding among the replicas of `group`, with their Leases in `namespace` of the host
    /// cluster `client` reaches; weight 1, leader election's timings
    /// ([`LeaseTiming::default`]), a hand-off timeout of 30 s and an identity of the host
    /// name and a random suffix.
    pub fn new(client: Client, namespace: &str, group: &str) -> Self {
        Self {
            client,
            namespace: namespace.to_string(),
            group: group.to_string(),
            identity: crate::lease::leader::default_identity(),
            weight: 1.0,
            timing: LeaseTiming::default(),
            handoff_timeout: Duration::from_secs(30),
        }
    }

    /// This replica's name among the peers; unique in the group. Two live processes must
    /// never share one: a replica takes a fence naming itself as its own (a stable name
    /// such as a StatefulSet pod's, whose predecessor is gone before it starts, is fine).
    #[must_use]
    pub fn identity(mut self, identity: impl Into<String>) -> Self {
        self.identity = identity.into();
        self
    }

    /// This replica's share relative to the others' (a replica of weight 2 owns about twice
    /// as many clusters as one of weight 1); 0 owns none. Default 1.
    #[must_use]
    pub fn weight(mut self, weight: f64) -> Self {
        self.weight = weight;
        self
    }

    /// How often a replica renews its peer Lease and reads the group's, how long it keeps
    /// its clusters without a renewal (its work in every cluster is dropped once the renew
    /// deadline passes), and how long the others wait before counting it gone and taking its
    /// fences over. The lease duration must exceed the renew deadline and the retry period
    /// together: fences are not renewed, and the others judge a holder from a view up to a
    /// retry period old.
    #[must_use]
    pub fn timing(mut self, timing: LeaseTiming) -> Self {
        self.timing = timing;
        self
    }

    /// How long a hand-off waits for the reconciles and per-cluster tasks still running in
    /// the cluster given up before dropping them and releasing its fence. Each controller's
    /// [`disengage_grace`](crate::Builder::disengage_grace) ends its reconciles sooner.
    #[must_use]
    pub fn handoff_timeout(mut self, timeout: Duration) -> Self {
        self.handoff_timeout = timeout;
        self
    }

    /// This replica's identity.
    pub fn holder_identity(&self) -> &str {
        &self.identity
    }

    /// The settings' consistency: the lease duration longer than the renew deadline and the
    /// retry period together, the renew deadline longer than the retry period with its
    /// jitter, a finite weight that is not negative.
    pub fn validate(&self) -> Result<(), InvalidSharding> {
        // Fences are not renewed: another replica judges a holder gone from a view up to a
        // retry period old, so the holder must have stopped a retry period before the lease
        // duration is up.
        let reason = if let Some(reason) = self.timing.problem(self.timing.retry_period) {
            Some(reason)
        } else if self.identity.is_empty() {
            Some("the identity is empty")
        } else if self.group.is_empty() {
            Some("the group is empty")
        } else if !self.weight.is_finite() || self.weight < 0.0 {
            Some("the weight must be a finite number, 0 or more")
        } else {
            None
        };
        match reason {
            None => Ok(()),
            Some(reason) => Err(InvalidSharding {
                reason,
                ..self.invalid()
            }),
        }
    }

    /// The error for these settings, with its reason to fill in.
    pub(crate) fn invalid(&self) -> InvalidSharding {
        InvalidSharding {
            group: self.group.clone(),
            reason: "",
            timing: self.timing,
            weight: self.weight,
        }
    }
}

/// The labels of a group's Lease of `role` (`peer` or `fence`).
pub(crate) fn labels(group: &str, role: &str) -> std::collections::BTreeMap<String, String> {
    [
        (GROUP_LABEL.to_string(), group.to_string()),
        (ROLE_LABEL.to_string(), role.to_string()),
    ]
    .into()
}

/// The name of the fence Lease of `cluster` (the cluster id's text) in sharding group
/// `group`: `mcr-shard-`, both reduced to what a Lease name may hold, then a hash of both.
pub fn fence_lease_name(group: &str, cluster: &str) -> String {
    fence::name(group, cluster)
}

/// A name for a Lease of `kind` (`peer`, `shard`) about `parts`: `mcr-<kind>-`, the parts
/// reduced to what a Lease name may hold, then the crate's fixed hash of the parts (two that
/// reduce alike stay apart).
pub(crate) fn lease_name(kind: &str, parts: &[&str]) -> String {
    let readable: String = parts
        .join("-")
        .to_ascii_lowercase()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .take(200)
        .collect();
    let digest = rendezvous::digest(parts);
    let readable = readable.trim_matches('-');
    if readable.is_empty() {
        format!("mcr-{kind}-{digest:016x}")
    } else {
        format!("mcr-{kind}-{readable}-{digest:016x}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn settings_leave_a_holder_time_to_stop_before_anyone_counts_it_gone() {
        let client =
            Client::try_from(kube::Config::new("https://127.0.0.1:1".parse().unwrap())).unwrap();
        let sharding = Sharding::new(client, "ns", "group");
        assert_eq!(sharding.validate(), Ok(()), "the defaults");
        let secs = Duration::from_secs;
        // 11 s is longer than the 10 s renew deadline, not than it and the 2 s retry period.
        let timing = LeaseTiming::default();
        let error = sharding
            .clone()
            .timing(timing.lease_duration(secs(11)))
            .validate()
            .unwrap_err();
        assert!(error.reason.contains("retry period together"), "{error}");
        assert!(
            sharding
                .clone()
                .timing(timing.lease_duration(secs(13)))
                .validate()
                .is_ok()
        );
        assert!(sharding.clone().weight(-1.0).validate().is_err());
        assert!(sharding.clone().weight(f64::NAN).validate().is_err());
        assert!(sharding.clone().weight(0.0).validate().is_ok());
        assert!(sharding.identity("").validate().is_err());
    }
}
