//! Peer Leases: each replica announces itself with a `coordination.k8s.io` Lease on the host
//! cluster, and the live peers are those whose Lease this replica has seen renewed within the
//! Lease's duration, by its own clock (as the leader elector judges a leader: clocks of
//! different machines are never compared).

use std::collections::HashMap;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::api::{Api, Patch, PatchParams};
use tokio::time::Instant;

use super::rendezvous::Peer;

use super::WEIGHT_ANNOTATION;

/// The field manager of the peer Leases.
const FIELD_MANAGER: &str = "multicluster-runtime-shard";

/// One replica's announcement.
#[derive(Clone, Debug)]
pub(crate) struct Announcement {
    pub(crate) group: String,
    pub(crate) id: String,
    pub(crate) weight: f64,
    /// The duration the Lease records, in seconds.
    pub(crate) lease_seconds: i32,
}

impl Announcement {
    /// The name of this replica's Lease: `mcr-peer-`, then the group and the id reduced to
    /// what a Lease name may hold, then a hash of both (two ids that reduce alike stay apart).
    pub(crate) fn lease_name(&self) -> String {
        super::lease_name("peer", &[&self.group, &self.id])
    }

    /// The Lease as a renewal writes it.
    pub(crate) fn lease(&self) -> Lease {
        Lease {
            metadata: ObjectMeta {
                name: Some(self.lease_name()),
                labels: Some(super::labels(&self.group, "peer")),
                annotations: Some(
                    [(WEIGHT_ANNOTATION.to_string(), self.weight.to_string())].into(),
                ),
                ..Default::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(self.id.clone()),
                lease_duration_seconds: Some(self.lease_seconds),
                renew_time: Some(MicroTime(k8s_openapi::jiff::Timestamp::now())),
                ..Default::default()
            }),
        }
    }

    /// Creates or renews the Lease in `leases`' namespace (server-side apply).
    pub(crate) async fn renew(&self, leases: &Api<Lease>) -> Result<Lease, kube::Error> {
        let lease = self.lease();
        let value = serde_json::json!({
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": lease.metadata,
            "spec": lease.spec,
        });
        leases
            .patch(
                &self.lease_name(),
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(value),
            )
            .await
    }
}

/// When the view of the group got each peer Lease's current renewal: by Lease name, the
/// renewal's record ([`record`]) and the instant it arrived (by this replica's clock).
pub(crate) type Arrivals = HashMap<String, (Option<String>, Instant)>;

/// A peer Lease's renewal record: what changes with each renewal.
pub(crate) fn record(lease: &Lease) -> Option<String> {
    lease
        .spec
        .as_ref()
        .and_then(|s| s.renew_time.as_ref())
        .map(|t| t.0.to_string())
}

/// What this replica has seen of each peer Lease: its last renewal record, and when (by this
/// replica's clock) each peer's record last changed.
#[derive(Default)]
pub(crate) struct Observed {
    /// The Leases of the last listing, by name.
    by_lease: HashMap<String, Seen>,
    /// By peer id: when its Lease last changed (or its id was first seen, on a fence it
    /// holds), and its Lease's duration. Kept after its Lease goes: a fence it holds is
    /// taken over only once it has been silent for that duration.
    heard: HashMap<String, (Instant, Duration)>,
}

struct Seen {
    record: Option<String>,
    peer: Peer,
}

impl Observed {
    /// Takes in a view of the group's Leases at `now`: a Lease whose renewal record changed
    /// (or that is new) counts from when the view got that record (`arrivals`; `now` if it
    /// does not say), never earlier than its write; Leases gone from the view are dropped.
    pub(crate) fn update<'a>(
        &mut self,
        leases: impl IntoIterator<Item = &'a Lease>,
        arrivals: &Arrivals,
        now: Instant,
    ) {
        let mut next = HashMap::new();
        for lease in leases {
            let Some(name) = lease.metadata.name.clone() else {
                continue;
            };
            let spec = lease.spec.as_ref();
            let Some(id) = spec.and_then(|s| s.holder_identity.clone()) else {
                continue;
            };
            let record = record(lease);
            let duration = Duration::from_secs(
                spec.and_then(|s| s.lease_duration_seconds)
                    .and_then(|s| u64::try_from(s).ok())
                    .unwrap_or(0),
            );
            let weight = lease
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(WEIGHT_ANNOTATION))
                .and_then(|w| w.parse::<f64>().ok())
                .filter(|w| w.is_finite() && *w >= 0.0)
                .unwrap_or(1.0);
            let unchanged = self
                .by_lease
                .get(&name)
                .is_some_and(|seen| seen.record == record);
            if !unchanged {
                // The arrival of this very record: a later renewal's would be too early.
                let at = arrivals
                    .get(&name)
                    .filter(|(arrived, _)| *arrived == record)
                    .map_or(now, |(_, at)| (*at).min(now));
                self.heard.insert(id.clone(), (at, duration));
            }
            next.insert(
                name,
                Seen {
                    record,
                    peer: Peer { id, weight },
                },
            );
        }
        self.by_lease = next;
        // Ids silent for ten of their durations are forgotten: one seen again (on a fence)
        // starts a new wait.
        self.heard
            .retain(|_, (at, duration)| now.duration_since(*at) < duration.saturating_mul(10));
    }

    /// Whether peer `id` has been silent (its Lease unchanged, or gone) for its Lease's
    /// duration (at least `minimum`) as this replica saw it, at `now`. An id never heard of
    /// counts from now on: it is not gone until it has been silent that long.
    pub(crate) fn gone(&mut self, id: &str, now: Instant, minimum: Duration) -> bool {
        let (at, duration) = *self.heard.entry(id.to_string()).or_insert((now, minimum));
        now.duration_since(at) >= duration.max(minimum)
    }

    /// The next instant after `now` at which a peer heard of stops counting as live, or
    /// counts as gone (silent for its duration, at least `minimum`): when the assignment
    /// or a fence's holder may change without any Lease changing.
    pub(crate) fn next_due(&self, now: Instant, minimum: Duration) -> Option<Instant> {
        self.heard
            .values()
            .flat_map(|(at, duration)| [*at + *duration, *at + (*duration).max(minimum)])
            .filter(|due| *due > now)
            .min()
    }

    /// The peers whose Lease was renewed (as seen here) within its duration before `now`,
    /// by id.
    pub(crate) fn live(&self, now: Instant) -> Vec<Peer> {
        let mut peers: Vec<Peer> = self
            .by_lease
            .values()
            .filter(|seen| {
                self.heard
                    .get(&seen.peer.id)
                    .is_some_and(|(at, duration)| now.duration_since(*at) < *duration)
            })
            .map(|seen| seen.peer.clone())
            .collect();
        peers.sort_by(|a, b| a.id.cmp(&b.id));
        peers.dedup_by(|a, b| a.id == b.id);
        peers
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(name: &str, id: &str, renewed: &str, seconds: i32, weight: Option<&str>) -> Lease {
        Lease {
            metadata: ObjectMeta {
                name: Some(name.into()),
                annotations: weight
                    .map(|w| [(WEIGHT_ANNOTATION.to_string(), w.to_string())].into()),
                ..Default::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(id.into()),
                lease_duration_seconds: Some(seconds),
                renew_time: Some(MicroTime(renewed.parse().unwrap())),
                ..Default::default()
            }),
        }
    }

    fn ids(peers: &[Peer]) -> Vec<&str> {
        peers.iter().map(|p| p.id.as_str()).collect()
    }

    #[tokio::test(start_paused = true)]
    async fn a_peer_is_live_while_its_lease_changes_within_its_duration_by_our_clock() {
        let mut observed = Observed::default();
        // b's renew time lies far in the past by the wall clock: only changes count.
        let t0 = Instant::now();
        observed.update(
            &[
                lease("a", "replica-a", "2026-11-24T10:00:00Z", 10, None),
                lease("b", "replica-b", "2000-01-01T00:00:00Z", 10, Some("2.5")),
            ],
            &Arrivals::new(),
            t0,
        );
        assert_eq!(ids(&observed.live(t0)), ["replica-a", "replica-b"]);
        assert_eq!(observed.live(t0)[1].weight, 2.5);
        // 8 s later a renewed, b did not.
        tokio::time::advance(Duration::from_secs(8)).await;
        let t1 = Instant::now();
        observed.update(
            &[
                lease("a", "replica-a", "2026-11-24T10:00:08Z", 10, None),
                lease("b", "replica-b", "2000-01-01T00:00:00Z", 10, Some("2.5")),
            ],
            &Arrivals::new(),
            t1,
        );
        assert_eq!(ids(&observed.live(t1)), ["replica-a", "replica-b"]);
        // 3 s more: b's last change is 11 s old, past its 10 s.
        tokio::time::advance(Duration::from_secs(3)).await;
        let t2 = Instant::now();
        assert_eq!(ids(&observed.live(t2)), ["replica-a"]);
        // A Lease deleted (a replica that gave its place up) is gone at once.
        observed.update(
            &[lease(
                "b",
                "replica-b",
                "2000-01-01T00:00:01Z",
                10,
                Some("x"),
            )],
            &Arrivals::new(),
            t2,
        );
        assert_eq!(ids(&observed.live(t2)), ["replica-b"]);
        assert_eq!(
            observed.live(t2)[0].weight,
            1.0,
            "an invalid weight counts as 1"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_fence_holder_is_gone_once_its_peer_lease_was_silent_for_its_duration() {
        let mut observed = Observed::default();
        let minimum = Duration::from_secs(5);
        let listing = |renewed: &str| [lease("a", "replica-a", renewed, 10, None)];
        observed.update(
            &listing("2026-11-24T10:00:00Z"),
            &Arrivals::new(),
            Instant::now(),
        );
        assert!(!observed.gone("replica-a", Instant::now(), minimum));
        // Renewed within its 10 s: alive; silent for 10 s: gone.
        tokio::time::advance(Duration::from_secs(9)).await;
        observed.update(
            &listing("2026-11-24T10:00:09Z"),
            &Arrivals::new(),
            Instant::now(),
        );
        tokio::time::advance(Duration::from_secs(9)).await;
        observed.update(
            &listing("2026-11-24T10:00:09Z"),
            &Arrivals::new(),
            Instant::now(),
        );
        assert!(!observed.gone("replica-a", Instant::now(), minimum));
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(observed.gone("replica-a", Instant::now(), minimum));
        // A Lease deleted is not taken for a holder gone: its silence counts from its last
        // change, as if it were still there.
        observed.update(
            &listing("2026-11-24T10:00:20Z"),
            &Arrivals::new(),
            Instant::now(),
        );
        observed.update(&[], &Arrivals::new(), Instant::now());
        assert!(!observed.gone("replica-a", Instant::now(), minimum));
        tokio::time::advance(Duration::from_secs(10)).await;
        assert!(observed.gone("replica-a", Instant::now(), minimum));
        // A holder never heard of (only its fence seen) counts from the first sight.
        assert!(!observed.gone("replica-x", Instant::now(), minimum));
        tokio::time::advance(Duration::from_secs(4)).await;
        assert!(!observed.gone("replica-x", Instant::now(), minimum));
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(observed.gone("replica-x", Instant::now(), minimum));
    }

    #[test]
    fn lease_names_are_valid_and_apart_for_ids_that_reduce_alike() {
        let a = Announcement {
            group: "Fleet".into(),
            id: "host_1".into(),
            weight: 1.0,
            lease_seconds: 15,
        };
        let b = Announcement {
            id: "host.1".into(),
            ..a.clone()
        };
        let (na, nb) = (a.lease_name(), b.lease_name());
        assert!(na.starts_with("mcr-peer-fleet-host-1-"), "{na}");
        assert_ne!(na, nb);
        for name in [na, nb] {
            assert!(name.len() <= 253);
            assert!(
                name.chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
            );
        }
    }

    #[tokio::test]
    async fn peers_announce_themselves_with_labelled_leases_on_a_real_apiserver() {
        let env = multicluster_runtime_testenv::TestEnv::start()
            .await
            .unwrap();
        let leases: Api<Lease> =
            Api::namespaced(env.cluster(0).unwrap().client().unwrap(), "default");
        let announce = |id: &str, weight: f64| Announcement {
            group: "fleet".into(),
            id: id.into(),
            weight,
            lease_seconds: 15,
        };
        let (a, b) = (announce("replica-a", 1.0), announce("replica-b", 3.0));
        a.renew(&leases).await.unwrap();
        b.renew(&leases).await.unwrap();
        // Another group's peer is not listed with this group.
        Announcement {
            group: "other".into(),
            ..announce("replica-c", 1.0)
        }
        .renew(&leases)
        .await
        .unwrap();
        let listed = leases
            .list(
                &kube::api::ListParams::default()
                    .labels(&format!("{}=fleet", super::super::GROUP_LABEL)),
            )
            .await
            .unwrap()
            .items;
        let mut observed = Observed::default();
        observed.update(&listed, &Arrivals::new(), Instant::now());
        let live = observed.live(Instant::now());
        assert_eq!(ids(&live), ["replica-a", "replica-b"]);
        assert_eq!(live[1].weight, 3.0);
        // A renewal changes the record (and so keeps the peer live for others).
        let before = leases.get(&a.lease_name()).await.unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
        a.renew(&leases).await.unwrap();
        let after = leases.get(&a.lease_name()).await.unwrap();
        assert_ne!(
            before.spec.unwrap().renew_time,
            after.spec.unwrap().renew_time
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_renewal_counts_from_when_the_view_got_it_and_its_end_is_due_then() {
        let minimum = Duration::from_secs(6);
        let b = lease("peer-b", "b", "2026-11-24T10:00:00Z", 6, None);
        let c = lease("peer-c", "c", "2026-11-24T10:00:00Z", 6, None);
        let arrived = Instant::now();
        // The round reads the view two seconds after the renewals arrived; the view's record
        // of c's arrival is of another renewal than the one it shows (not to be used).
        tokio::time::sleep(Duration::from_secs(2)).await;
        let read = Instant::now();
        let arrivals: Arrivals = [
            ("peer-b".to_string(), (record(&b), arrived)),
            ("peer-c".to_string(), (Some("another".to_string()), arrived)),
        ]
        .into();
        let mut observed = Observed::default();
        observed.update([&b, &c], &arrivals, read);
        assert_eq!(observed.next_due(read, minimum), Some(arrived + minimum));
        tokio::time::sleep_until(arrived + minimum - Duration::from_millis(1)).await;
        assert_eq!(ids(&observed.live(Instant::now())), ["b", "c"]);
        tokio::time::sleep_until(arrived + minimum).await;
        assert_eq!(ids(&observed.live(Instant::now())), ["c"]);
        assert!(observed.gone("b", Instant::now(), minimum));
        assert!(!observed.gone("c", Instant::now(), minimum));
        assert_eq!(
            observed.next_due(Instant::now(), minimum),
            Some(read + minimum)
        );
    }
}
