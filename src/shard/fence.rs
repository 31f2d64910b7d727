//! Fence Leases: one per cluster and group, held by the replica that may reconcile the
//! cluster. Every write carries the `resourceVersion` this replica last saw, so two replicas
//! can never both take a fence: the second write fails with a conflict.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::api::{Api, PostParams};
use tokio::time::Instant;

use super::{CLUSTER_ANNOTATION, GROUP_LABEL, ROLE_LABEL};

/// The fence Lease's name for `cluster` in `group`.
pub(crate) fn name(group: &str, cluster: &str) -> String {
    super::lease_name("shard", &[group, cluster])
}

/// What this replica saw of a fence: the Lease and when (by its own clock) it last changed.
#[derive(Clone, Debug)]
pub(crate) struct Seen {
    pub(crate) lease: Lease,
    pub(crate) changed: Instant,
}

impl Seen {
    /// Its holder, if any.
    pub(crate) fn holder(&self) -> Option<&str> {
        holder(&self.lease)
    }

    /// Whether `me` may try to take it at `now`: nobody holds it, `me` does, or it has not
    /// changed for its duration.
    pub(crate) fn free_for(&self, me: &str, now: Instant) -> bool {
        match self.holder() {
            None => true,
            Some(holder) if holder == me => true,
            Some(_) => now.duration_since(self.changed) >= duration(&self.lease),
        }
    }
}

/// The fences of a group as last listed, by Lease name.
#[derive(Default)]
pub(crate) struct Fences {
    seen: std::collections::HashMap<String, Seen>,
}

impl Fences {
    /// Takes in a listing at `now`: a Lease whose `resourceVersion` changed (or that is new)
    /// counts from `now`; Leases gone from the listing are dropped.
    pub(crate) fn update(&mut self, leases: Vec<Lease>, now: Instant) {
        let mut next = std::collections::HashMap::with_capacity(leases.len());
        for lease in leases {
            let Some(name) = lease.metadata.name.clone() else {
                continue;
            };
            let changed = match self.seen.get(&name) {
                Some(seen)
                    if seen.lease.metadata.resource_version == lease.metadata.resource_version =>
                {
                    seen.changed
                }
                _ => now,
            };
            next.insert(name, Seen { lease, changed });
        }
        self.seen = next;
    }

    /// The fence named `name`, as last seen.
    pub(crate) fn get(&self, name: &str) -> Option<&Seen> {
        self.seen.get(name)
    }

    /// Notes a Lease this replica wrote (so its next listing is not taken for a change by
    /// someone else).
    pub(crate) fn wrote(&mut self, lease: &Lease, now: Instant) {
        if let Some(name) = &lease.metadata.name {
            self.seen.insert(
                name.clone(),
                Seen {
                    lease: lease.clone(),
                    changed: now,
                },
            );
        }
    }
}

fn holder(lease: &Lease) -> Option<&str> {
    lease
        .spec
        .as_ref()
        .and_then(|s| s.holder_identity.as_deref())
        .filter(|h| !h.is_empty())
}

fn duration(lease: &Lease) -> Duration {
    Duration::from_secs(
        lease
            .spec
            .as_ref()
            .and_then(|s| s.lease_duration_seconds)
            .and_then(|s| u64::try_from(s).ok())
            .unwrap_or(0),
    )
}

fn now() -> MicroTime {
    MicroTime(k8s_openapi::jiff::Timestamp::now())
}

/// Who takes fences, and how long they hold them.
#[derive(Clone)]
pub(crate) struct Holder {
    pub(crate) api: Api<Lease>,
    pub(crate) group: String,
    pub(crate) identity: String,
    pub(crate) lease_seconds: i32,
}

/// Why a renewal failed.
#[derive(Debug)]
pub(crate) enum RenewError {
    /// Another replica holds the fence now (or it is gone).
    Lost(String),
    /// The host could not be reached, or refused: retried until the renew deadline.
    Api(kube::Error),
}

impl Holder {
    /// Tries to take the fence `name` of `cluster`, last seen as `seen` (absent: never
    /// created). `Ok(None)`: another replica wrote first.
    pub(crate) async fn acquire(
        &self,
        name: &str,
        cluster: &str,
        seen: Option<&Lease>,
    ) -> Result<Option<Lease>, kube::Error> {
        let now = now();
        let result = match seen {
            None => {
                let lease = Lease {
                    metadata: ObjectMeta {
                        name: Some(name.to_string()),
                        labels: Some(
                            [
                                (GROUP_LABEL.to_string(), self.group.clone()),
                                (ROLE_LABEL.to_string(), "fence".to_string()),
                            ]
                            .into(),
                        ),
                        annotations: Some(
                            [(CLUSTER_ANNOTATION.to_string(), cluster.to_string())].into(),
                        ),
                        ..Default::default()
                    },
                    spec: Some(LeaseSpec {
                        holder_identity: Some(self.identity.clone()),
                        lease_duration_seconds: Some(self.lease_seconds),
                        acquire_time: Some(now.clone()),
                        renew_time: Some(now),
                        lease_transitions: Some(0),
                        ..Default::default()
                    }),
                };
                self.api.create(&PostParams::default(), &lease).await
            }
            Some(seen) => {
                let mut lease = seen.clone();
                let spec = lease.spec.take().unwrap_or_default();
                let transitions = spec.lease_transitions.unwrap_or(0);
                lease.spec = Some(LeaseSpec {
                    holder_identity: Some(self.identity.clone()),
                    lease_duration_seconds: Some(self.lease_seconds),
                    acquire_time: Some(now.clone()),
                    renew_time: Some(now),
                    lease_transitions: Some(transitions.saturating_add(1)),
                    ..spec
                });
                self.api.replace(name, &PostParams::default(), &lease).await
            }
        };
        match result {
            Ok(lease) => Ok(Some(lease)),
            // Someone wrote since this replica looked (or created it first).
            Err(kube::Error::Api(e)) if e.code == 409 => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Renews the fence this replica holds, last written as `held`.
    pub(crate) async fn renew(&self, held: &Lease) -> Result<Lease, RenewError> {
        let name = held.metadata.name.clone().unwrap_or_default();
        let mut lease = held.clone();
        for _ in 0..2 {
            if let Some(spec) = &mut lease.spec {
                spec.renew_time = Some(now());
            }
            match self
                .api
                .replace(&name, &PostParams::default(), &lease)
                .await
            {
                Ok(renewed) => return Ok(renewed),
                Err(kube::Error::Api(e)) if e.code == 409 => {
                    // Written by someone else since: still ours (a label added) or taken.
                    match self.api.get_opt(&name).await.map_err(RenewError::Api)? {
                        Some(current) if holder(&current) == Some(self.identity.as_str()) => {
                            lease = current;
                        }
                        Some(current) => {
                            return Err(RenewError::Lost(
                                holder(&current).unwrap_or("nobody").to_string(),
                            ));
                        }
                        None => return Err(RenewError::Lost("nobody (deleted)".to_string())),
                    }
                }
                Err(kube::Error::Api(e)) if e.code == 404 => {
                    return Err(RenewError::Lost("nobody (deleted)".to_string()));
                }
                Err(e) => return Err(RenewError::Api(e)),
            }
        }
        Err(RenewError::Lost(
            "unknown (it kept changing under this replica)".to_string(),
        ))
    }

    /// Gives the fence up (no holder, so the next owner takes it at its next attempt),
    /// if this replica still holds it.
    pub(crate) async fn release(&self, held: &Lease) -> Result<(), kube::Error> {
        let name = held.metadata.name.clone().unwrap_or_default();
        let mut lease = held.clone();
        for _ in 0..2 {
            let now = now();
            if let Some(spec) = &mut lease.spec {
                spec.holder_identity = None;
                spec.lease_duration_seconds = Some(1);
                spec.renew_time = Some(now.clone());
                spec.acquire_time = Some(now);
            }
            match self
                .api
                .replace(&name, &PostParams::default(), &lease)
                .await
            {
                Ok(_) => return Ok(()),
                Err(kube::Error::Api(e)) if e.code == 409 => {
                    match self.api.get_opt(&name).await? {
                        Some(current) if holder(&current) == Some(self.identity.as_str()) => {
                            lease = current;
                        }
                        // Not ours any more.
                        _ => return Ok(()),
                    }
                }
                Err(kube::Error::Api(e)) if e.code == 404 => return Ok(()),
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(holder: Option<&str>, rv: &str, seconds: i32) -> Lease {
        Lease {
            metadata: ObjectMeta {
                name: Some("f".into()),
                resource_version: Some(rv.into()),
                ..Default::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: holder.map(Into::into),
                lease_duration_seconds: Some(seconds),
                ..Default::default()
            }),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_fence_is_free_when_unheld_mine_or_unchanged_for_its_duration() {
        let mut fences = Fences::default();
        let t0 = Instant::now();
        fences.update(vec![lease(Some("a"), "1", 10)], t0);
        let seen = fences.get("f").unwrap();
        assert!(!seen.free_for("b", t0));
        assert!(seen.free_for("a", t0), "its holder may renew it");
        tokio::time::advance(Duration::from_secs(9)).await;
        // Renewed (a new resourceVersion): the clock starts again.
        fences.update(vec![lease(Some("a"), "2", 10)], Instant::now());
        tokio::time::advance(Duration::from_secs(9)).await;
        fences.update(vec![lease(Some("a"), "2", 10)], Instant::now());
        assert!(!fences.get("f").unwrap().free_for("b", Instant::now()));
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(fences.get("f").unwrap().free_for("b", Instant::now()));
        // Released: free at once.
        fences.update(vec![lease(None, "3", 1)], Instant::now());
        assert!(fences.get("f").unwrap().free_for("b", Instant::now()));
    }

    #[test]
    fn fence_names_are_valid_lease_names_and_apart() {
        let a = name("fleet", "Cluster_One");
        let b = name("fleet", "cluster.one");
        let c = name("other", "Cluster_One");
        assert!(a.starts_with("mcr-shard-fleet-cluster-one-"), "{a}");
        assert!(a != b && a != c);
        let long = name("fleet", &"x".repeat(1000));
        for n in [a, b, c, long, name("", "")] {
            assert!(n.len() <= 253, "{n}");
            assert!(
                n.chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'),
                "{n}"
            );
            assert!(n.ends_with(|c: char| c.is_ascii_alphanumeric()));
        }
    }
}
