//! Fence Leases: one per cluster and group, naming the replica that may reconcile the
//! cluster. A fence is written when it is taken and when it is given up, never renewed: it
//! holds for as long as its holder's peer Lease is renewed (a holder that cannot renew that
//! stops all its work within its renew deadline, before the others count it gone). Every
//! write carries the `resourceVersion` this replica last saw, so two replicas can never
//! both take a fence: the second write fails with a conflict.

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::api::{Api, PostParams};

use super::CLUSTER_ANNOTATION;

/// The fence Lease's name for `cluster` in `group`.
pub(crate) fn name(group: &str, cluster: &str) -> String {
    super::lease_name("shard", &[group, cluster])
}

/// The fences of a group as last listed, by Lease name.
#[derive(Default)]
pub(crate) struct Fences {
    seen: std::collections::HashMap<String, std::sync::Arc<Lease>>,
}

impl Fences {
    /// Takes in a view of the group's fences.
    pub(crate) fn update(&mut self, leases: Vec<std::sync::Arc<Lease>>) {
        self.seen = leases
            .into_iter()
            .filter_map(|lease| Some((lease.metadata.name.clone()?, lease)))
            .collect();
    }

    /// The fence named `name`, as last seen.
    pub(crate) fn get(&self, name: &str) -> Option<&Lease> {
        self.seen.get(name).map(|l| &**l)
    }

    /// The fences naming `holder`.
    pub(crate) fn held_by(&self, holder: &str) -> Vec<Lease> {
        self.seen
            .values()
            .filter(|l| self::holder(l) == Some(holder))
            .map(|l| (**l).clone())
            .collect()
    }

    /// Notes a Lease this replica wrote.
    pub(crate) fn wrote(&mut self, lease: &Lease) {
        if let Some(name) = &lease.metadata.name {
            self.seen
                .insert(name.clone(), std::sync::Arc::new(lease.clone()));
        }
    }
}

/// A fence's holder, if any.
pub(crate) fn holder(lease: &Lease) -> Option<&str> {
    lease
        .spec
        .as_ref()
        .and_then(|s| s.holder_identity.as_deref())
        .filter(|h| !h.is_empty())
}

fn now() -> MicroTime {
    MicroTime(k8s_openapi::jiff::Timestamp::now())
}

/// Who takes fences, and how long they hold them.
#[derive(Clone)]
pub(crate) struct Claim {
    pub(crate) group: String,
    pub(crate) identity: String,
    pub(crate) lease_seconds: i32,
}

impl Claim {
    /// The fence `name` of `cluster` as this replica writes it to take it, over `seen` (the
    /// fence as last seen; `None`: never created).
    pub(crate) fn taken(&self, name: &str, cluster: &str, seen: Option<&Lease>) -> Lease {
        let now = now();
        match seen {
            None => Lease {
                metadata: ObjectMeta {
                    name: Some(name.to_string()),
                    labels: Some(super::labels(&self.group, "fence")),
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
            },
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
                lease
            }
        }
    }
}

/// `held` as written to give it up: no holder, so the next owner takes it at its next
/// attempt.
pub(crate) fn released(held: &Lease) -> Lease {
    let mut lease = held.clone();
    let now = now();
    if let Some(spec) = &mut lease.spec {
        spec.holder_identity = None;
        spec.lease_duration_seconds = Some(1);
        spec.renew_time = Some(now.clone());
        spec.acquire_time = Some(now);
    }
    lease
}

/// Takes and gives up fences on the API server.
#[derive(Clone)]
pub(crate) struct Holder {
    pub(crate) api: Api<Lease>,
    pub(crate) claim: Claim,
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
        let lease = self.claim.taken(name, cluster, seen);
        let result = match seen {
            None => self.api.create(&PostParams::default(), &lease).await,
            Some(_) => self.api.replace(name, &PostParams::default(), &lease).await,
        };
        match result {
            Ok(lease) => Ok(Some(lease)),
            // Someone wrote since this replica looked (or created it first).
            Err(kube::Error::Api(e)) if e.code == 409 => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Gives the fence up (no holder, so the next owner takes it at its next attempt),
    /// if this replica still holds it.
    pub(crate) async fn release(&self, held: &Lease) -> Result<(), kube::Error> {
        let name = held.metadata.name.clone().unwrap_or_default();
        let mut lease = released(held);
        for _ in 0..2 {
            match self
                .api
                .replace(&name, &PostParams::default(), &lease)
                .await
            {
                Ok(_) => return Ok(()),
                Err(kube::Error::Api(e)) if e.code == 409 => {
                    match self.api.get_opt(&name).await? {
                        Some(current) if holder(&current) == Some(self.claim.identity.as_str()) => {
                            lease = released(&current);
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
