//! The sharding coordinator: one task per manager run that announces the replica, follows
//! its peers, and takes and gives up the fences of the clusters assigned to it, making them
//! members of the fleet or not.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::stream::FuturesUnordered;
use futures::{FutureExt, StreamExt};
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::Api;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::fence;
use super::fence::{Fences, Holder};
use super::group::GroupWatch;
use super::host::{ApiHost, Host};
use super::peers::{Announcement, Observed};
use super::rendezvous::{Peer, owner};
use super::{GROUP_LABEL, ROLE_LABEL, Sharding};
use crate::cluster::ClusterId;
use crate::cluster::Session;
use crate::fleet::Fleet;
use crate::lease::tenure::Tenure;
use crate::metrics::ShardSeries;
use crate::util::sync::lock;

/// What a sharded replica sees and holds, as of its last round
/// ([`Manager::shard_status`](crate::Manager::shard_status)).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ShardStatus {
    /// This replica's identity.
    pub identity: String,
    /// The live peers' identities (this replica's among them while its own Lease is
    /// renewed), in order.
    pub peers: Vec<String>,
    /// How many clusters the provider discovered.
    pub discovered: usize,
    /// How many clusters' fences this replica holds (handing over included).
    pub held: usize,
    /// How many of those it is handing over.
    pub handing_off: usize,
    /// The live peers with their weights' bits, for the owner of each cluster (the
    /// diagnostics view).
    pub(crate) live: Vec<(String, u64)>,
    /// The clusters whose fences it holds, and whether each is being handed over.
    pub(crate) holding: std::collections::BTreeMap<String, bool>,
}

impl ShardStatus {
    /// The live peer the assignment gives each of `clusters` to, as this replica sees the
    /// peers.
    pub(crate) fn owners<'a>(
        &self,
        clusters: impl IntoIterator<Item = &'a str>,
    ) -> Vec<Option<String>> {
        let live: Vec<Peer> = self
            .live
            .iter()
            .map(|(id, weight)| Peer {
                id: id.clone(),
                weight: f64::from_bits(*weight),
            })
            .collect();
        clusters
            .into_iter()
            .map(|cluster| owner(&live, cluster).map(|p| p.id.clone()))
            .collect()
    }
}

/// A fence this replica holds.
struct Held {
    /// As last written or seen (its `resourceVersion` is what the release writes over).
    lease: Lease,
    /// The cluster left the fleet; its work is being waited for before the release.
    handing_off: bool,
    /// The engagements a hand-off waits for: aborted if the fence is lost meanwhile.
    sessions: Vec<Arc<Session>>,
    /// Tells this holding from a later one of the same cluster (a hand-off's wait that
    /// ends after the fence was lost and taken again is about the old one).
    generation: u64,
}

/// A hand-off's wait: the cluster, the holding's generation, and whether its work ended.
type Handoff<C> = futures::future::BoxFuture<'static, (C, u64, bool)>;

/// One replica's side of sharding.
pub(crate) struct Coordinator<C: ClusterId> {
    config: Sharding,
    fleet: Fleet<C>,
    /// The host cluster: the API server (with a watch of the group) in a run.
    host: Arc<dyn Host>,
    me: Announcement,
    peers: Observed,
    fences: Fences,
    held: HashMap<C, Held>,
    /// The ids assigned to this replica at the last round.
    mine: HashSet<C>,
    handoffs: FuturesUnordered<Handoff<C>>,
    /// When the last successful renewal of this replica's peer Lease began: the fences it
    /// holds are good until the renew deadline from then (the others' clocks start no
    /// earlier than that write).
    announced: Option<Instant>,
    /// The diagnostics view is served: the status names each cluster held.
    detailed: bool,
    /// Past the first round.
    started: bool,
    /// Rounds in a row without a view of the group's Leases: a replica that cannot see the
    /// group stops announcing itself, so the others do not assign it clusters it could never
    /// take.
    unseen: u32,
    /// Not announcing itself for that reason now.
    blind: bool,
    /// The next holding's generation.
    generation: u64,
    /// Fences lost, with the engagements whose (aborted) work must end before a fence
    /// still naming this replica is released.
    lost: HashMap<C, Vec<Arc<Session>>>,
    metrics: Option<ShardSeries>,
    status: Arc<Mutex<Option<ShardStatus>>>,
    /// The renew deadline of the fences held, published for the controllers, which start
    /// nothing past it even before this task gets to drop the fences.
    tenure: Arc<Tenure>,
    /// Cancelled when the manager shuts down: nothing more is taken.
    draining: CancellationToken,
}

impl<C: ClusterId> Coordinator<C> {
    pub(crate) fn new(
        config: Sharding,
        fleet: Fleet<C>,
        metrics: Option<&crate::metrics::Metrics>,
        status: Arc<Mutex<Option<ShardStatus>>>,
        tenure: Arc<Tenure>,
        detailed: bool,
    ) -> Self {
        let leases: Api<Lease> = Api::namespaced(config.client.clone(), &config.namespace);
        let me = announcement(&config);
        let host = ApiHost {
            holder: Holder {
                api: leases.clone(),
                claim: claim(&config),
            },
            group: Arc::new(GroupWatch::start(
                config.client.clone(),
                &config.namespace,
                &format!("{GROUP_LABEL}={}", config.group),
                me.lease_name(),
            )),
            leases,
        };
        let mut coordinator =
            Self::with_host(config, fleet, metrics, status, tenure, Arc::new(host));
        coordinator.detailed = detailed;
        coordinator
    }

    /// A coordinator whose host is `host`.
    fn with_host(
        config: Sharding,
        fleet: Fleet<C>,
        metrics: Option<&crate::metrics::Metrics>,
        status: Arc<Mutex<Option<ShardStatus>>>,
        tenure: Arc<Tenure>,
        host: Arc<dyn Host>,
    ) -> Self {
        let me = announcement(&config);
        Self {
            metrics: metrics.map(|m| m.shard(&config.group)),
            config,
            fleet,
            host,
            me,
            peers: Observed::default(),
            fences: Fences::default(),
            held: HashMap::new(),
            mine: HashSet::new(),
            handoffs: FuturesUnordered::new(),
            announced: None,
            started: false,
            unseen: 0,
            blind: false,
            generation: 0,
            lost: HashMap::new(),
            status,
            tenure,
            draining: CancellationToken::new(),
            detailed: false,
        }
    }

    /// Runs until `stop`; then [`Coordinator::leave`] gives everything up. Once `draining`
    /// (the manager's shutdown: its controllers winding down) it goes on renewing and giving
    /// clusters up, but takes none.
    pub(crate) async fn run(
        mut self,
        stop: CancellationToken,
        draining: CancellationToken,
    ) -> Self {
        self.draining = draining;
        let changes = self.fleet.discovery_changes();
        tracing::info!(group = %self.config.group, identity = %self.config.identity, weight = self.config.weight, "sharding: joining the group");
        loop {
            let began = Instant::now();
            self.round().await;
            // Rounds begin a (jittered) retry period apart, however long one took: a round
            // that spent its retry period taking fences is followed at once by the next, which
            // renews and takes on (a replica taking over thousands of clusters takes them
            // without a retry period's pause between batches).
            let wake = tokio::time::sleep_until(began + self.config.timing.jittered_retry());
            tokio::pin!(wake);
            // A change of the discovered clusters starts the next round early, but no sooner
            // than a quarter retry period after this one began: a provider engaging clusters
            // one by one does not set off a round (a write and a list on the host) for each.
            let early = tokio::time::sleep_until(began + self.config.timing.retry_period / 4);
            tokio::pin!(early);
            let mut changed = false;
            // A peer counting gone (or no longer live) changes the assignment without any
            // Lease changing: the next round starts then, not up to a retry period later.
            // Each such moment starts one round (it is past once that round has run), so
            // there is no floor as for discovery changes: a round that began just before it
            // must not hold the take-over back.
            let due = self
                .peers
                .next_due(Instant::now(), self.config.timing.lease_duration);
            // Between rounds: hand-offs finishing and fences reaching their deadline.
            loop {
                let deadline = self.next_deadline();
                tokio::select! {
                    () = stop.cancelled() => return self,
                    () = &mut wake => break,
                    () = notified(changes.as_deref()), if !changed => changed = true,
                    () = &mut early, if changed => break,
                    () = sleep_until(due) => break,
                    Some((id, generation, drained)) = self.handoffs.next(), if !self.handoffs.is_empty() => {
                        self.handed_off(id, generation, drained).await;
                    }
                    () = sleep_until(deadline) => self.expire(),
                }
            }
        }
    }

    /// When fences held by this replica pass their renew deadline: the last renewal of its
    /// peer Lease and the renew deadline; `None` if it was never renewed.
    fn renew_deadline(&self) -> Option<Instant> {
        self.announced
            .map(|at| at + self.config.timing.renew_deadline)
    }

    /// Whether `at` is before the renew deadline.
    fn within_renew_deadline(&self, at: Instant) -> bool {
        self.renew_deadline().is_some_and(|deadline| at < deadline)
    }

    /// When the fences held pass their renew deadline (now if never renewed), if any are held.
    fn next_deadline(&self) -> Option<Instant> {
        (!self.held.is_empty()).then(|| self.renew_deadline().unwrap_or_else(Instant::now))
    }

    /// Runs `work`, dropping fences whose deadline passes meanwhile.
    async fn guarded<T>(&mut self, work: impl std::future::Future<Output = T>) -> T {
        tokio::pin!(work);
        loop {
            let deadline = self.next_deadline();
            tokio::select! {
                out = &mut work => return out,
                () = sleep_until(deadline) => self.expire(),
            }
        }
    }

    /// Drops every fence once this replica's peer Lease has gone unrenewed for the renew
    /// deadline: the others may count it gone from the lease duration on.
    fn expire(&mut self) {
        let Some(deadline) = self.next_deadline() else {
            return;
        };
        if Instant::now() < deadline {
            return;
        }
        let held: Vec<C> = self.held.keys().cloned().collect();
        for id in held {
            self.lose(
                &id,
                "this replica's peer lease was not renewed within the renew deadline (the host unreachable?)",
            );
        }
    }

    /// The fence of `id` is no longer this replica's: its work there stops now.
    fn lose(&mut self, id: &C, reason: &str) {
        let Some(held) = self.held.remove(id) else {
            return;
        };
        // Its current engagements, and those a hand-off in progress waits for.
        let mut sessions = self.fleet.disown(id);
        sessions.extend(held.sessions);
        for session in &sessions {
            session.abort();
        }
        self.lost.insert(id.clone(), sessions);
        if let Some(m) = &self.metrics {
            m.lost.inc();
        }
        tracing::error!(cluster = %id, group = %self.config.group, %reason, "sharding: fence lost; this replica's work in the cluster was dropped");
        self.publish();
    }

    /// The live peers at `now`, by id: the others as the views of the group showed them, and this
    /// replica while its own peer Lease is renewed within the renew deadline.
    fn live(&self, now: Instant) -> Vec<Peer> {
        let mut live: Vec<Peer> = self
            .peers
            .live(now)
            .into_iter()
            .filter(|p| p.id != self.me.id)
            .collect();
        if self.within_renew_deadline(now) {
            live.push(Peer {
                id: self.me.id.clone(),
                weight: self.me.weight,
            });
            live.sort_by(|a, b| a.id.cmp(&b.id));
        }
        live
    }

    /// One round: renew and look at the group, work out the assignment, give up what is no
    /// longer this replica's, then take fences as the assignment says.
    async fn round(&mut self) {
        let began = Instant::now();
        let blind = self.blindness();
        let fresh = self.renew_and_view(began, blind).await;
        let now = self.assign();
        // Release fences still naming this replica that it no longer holds and that are not
        // its own (a release that failed, a fence lost, a take that landed after its cut),
        // once the work it had there has ended: they would stay blocked while it lives.
        if fresh {
            self.release_strays().await;
        }

        // Take what is, where the fence is free; not in the first round, when peers started
        // at the same time may not have announced themselves yet.
        // Nor without this round's view: fences are not renewed, so whether a holder is gone
        // is judged from its peer Lease alone, which only a current view shows.
        // Nor while the manager drains at shutdown: a cluster taken now would engage (watches,
        // per-cluster tasks) only to be given up again, and hold up the others meanwhile.
        // Nor while blind: its view's only freshness is a watch that has not failed, which a
        // silently stalled watch passes with a view of any age; its tenure ends soon anyway.
        if !std::mem::replace(&mut self.started, true)
            || !fresh
            || blind
            || self.draining.is_cancelled()
        {
            self.publish();
            return;
        }
        self.take_fences(began, now).await;
        self.publish();
    }

    /// Whether this replica is blind to its group this round, said when that changes.
    fn blindness(&mut self) -> bool {
        // Unable to see the group for two rounds in a row (its watch did not show two renewals,
        // or fails), this replica stops renewing its peer Lease: it drops its fences at its
        // renew deadline, and the others count it gone and take its clusters, rather than
        // leaving them assigned to a replica that cannot take them. A single round without a
        // view costs nothing. Rounds, not time: a round that takes many fences lasts longer
        // than a retry period, and is no sign of blindness.
        let blind = self.unseen >= 2;
        if blind != std::mem::replace(&mut self.blind, blind) {
            if blind {
                tracing::warn!(group = %self.config.group, identity = %self.config.identity, error = self.host.error().unwrap_or_default(), "sharding: the group's Leases could not be seen for two rounds; this replica stops announcing itself until they can (the others take its clusters)");
            } else {
                tracing::info!(group = %self.config.group, identity = %self.config.identity, "sharding: the group's Leases are seen again; this replica announces itself again");
            }
        }
        blind
    }

    /// Renews this replica's peer Lease (unless `blind`) and waits for the group's watch to
    /// show the renewal; with a fresh view, updates the peers and fences seen. Whether the
    /// view is fresh.
    async fn renew_and_view(&mut self, began: Instant, blind: bool) -> bool {
        let bound = self.config.timing.retry_period;
        let me = (!blind).then(|| self.me.clone());
        let host = self.host.clone();
        // Renew, then wait for the watch to show the renewal: the view is then at least as
        // recent as the renewal (see `group`).
        let renew = async move {
            let me = me?;
            let renewed = tokio::time::timeout(bound, host.renew(&me)).await;
            let caught_up = match &renewed {
                Ok(Ok(lease)) => {
                    let version = lease.metadata.resource_version.clone().unwrap_or_default();
                    let left = bound.saturating_sub(began.elapsed()).max(bound / 4);
                    host.caught_up(version, left).await
                }
                _ => false,
            };
            Some((renewed, caught_up))
        };
        let renewed = self.guarded(renew).await;
        let now = Instant::now();
        let fresh = match renewed {
            Some((Ok(Ok(_)), caught_up)) => {
                self.announced = Some(began);
                self.tenure.until(began + self.config.timing.renew_deadline);
                if !caught_up {
                    tracing::warn!(group = %self.config.group, error = self.host.error().unwrap_or_default(), "sharding: the watch of the group's leases did not show this replica's renewal in time; no view of the group this round");
                }
                caught_up
            }
            Some((Ok(Err(error)), _)) => {
                tracing::warn!(group = %self.config.group, error = %crate::client::Shown(&error), "sharding: could not renew this replica's peer lease");
                false
            }
            Some((Err(_), _)) => {
                tracing::warn!(group = %self.config.group, "sharding: renewing this replica's peer lease timed out");
                false
            }
            // Not announcing itself: the view counts once the watch works again.
            None => self.host.working(),
        };
        self.unseen = if fresh {
            0
        } else {
            self.unseen.saturating_add(1)
        };
        if fresh {
            let (peers, fences): (Vec<Arc<Lease>>, Vec<Arc<Lease>>) =
                self.host.leases().into_iter().partition(|l| {
                    l.metadata
                        .labels
                        .as_ref()
                        .and_then(|l| l.get(ROLE_LABEL))
                        .is_some_and(|r| r == "peer")
                });
            let arrivals = self.host.arrivals();
            self.peers
                .update(peers.iter().map(|l| &**l), &arrivals, now);
            self.fences.update(fences);
            self.verify();
        }
        self.expire();
        fresh
    }

    /// The clusters this replica is assigned, over the live peers it sees; gives up those it
    /// holds and no longer is. When it looked.
    fn assign(&mut self) -> Instant {
        // The assignment, over the live peers as this replica sees them.
        let now = Instant::now();
        let live = self.live(now);
        let discovered = self.fleet.discovered_ids();
        let mine: HashSet<C> = discovered
            .iter()
            .filter(|id| owner(&live, &id.to_string()).is_some_and(|p| p.id == self.me.id))
            .cloned()
            .collect();
        self.mine = mine;
        if let Some(m) = &self.metrics {
            m.peers.set(i64::try_from(live.len()).unwrap_or(i64::MAX));
        }

        // Give up what is no longer this replica's.
        let leaving: Vec<C> = self
            .held
            .iter()
            .filter(|(id, h)| !h.handing_off && !self.mine.contains(*id))
            .map(|(id, _)| id.clone())
            .collect();
        for id in leaving {
            self.hand_off(id);
        }
        now
    }

    /// Takes the fences of assigned clusters that are free (or held by a holder gone), for
    /// at most a retry period.
    async fn take_fences(&mut self, began: Instant, now: Instant) {
        let bound = self.config.timing.retry_period;
        // A holder counts gone from its last renewal the view showed, stamped when the view got
        // it (not earlier than its write). The view is current up to this round's own renewal:
        // a later renewal of the holder is not in it. That holder renewed before its previous
        // renew deadline, so it is still counted live unless this round has run for the gap
        // between lease duration and renew deadline since it began; a round that slow (a
        // host slow to answer) judges no holder gone.
        let judges = now.duration_since(began)
            < self
                .config
                .timing
                .lease_duration
                .saturating_sub(self.config.timing.renew_deadline);
        let me = self.me.id.clone();
        let wanted: Vec<(C, String, Option<Lease>)> = self
            .mine
            .iter()
            .filter(|id| !self.held.contains_key(*id))
            .filter_map(|id| {
                let name = fence::name(&self.config.group, &id.to_string());
                let Some(seen) = self.fences.get(&name) else {
                    return Some((id.clone(), name, None));
                };
                let free = match fence::holder(seen) {
                    None => true,
                    Some(holder) if holder == me => true,
                    Some(holder) => {
                        judges
                            && self
                                .peers
                                .gone(holder, now, self.config.timing.lease_duration)
                    }
                };
                free.then(|| (id.clone(), name, Some(seen.clone())))
            })
            .collect();
        if !wanted.is_empty() {
            // At most a retry period of taking per round, so that this replica's peer Lease
            // is renewed in time however many fences it wants; what is left is taken in the
            // next rounds (a write that landed after the cut shows as a fence naming this
            // replica, taken back then).
            let host = self.host.clone();
            let attempts = within(bound, wanted, move |(id, name, seen)| {
                let host = host.clone();
                async move {
                    let text = id.to_string();
                    let out = host.acquire(name, text, seen);
                    (id, tokio::time::timeout(bound, out).await)
                }
            });
            let attempts = self.guarded(attempts).await;
            for (id, out) in attempts {
                match out {
                    // Past the renew deadline the fence would be dropped at once: left named
                    // after this replica, it is taken back (or released) in a later round.
                    Ok(Ok(Some(lease))) if !self.within_renew_deadline(Instant::now()) => {
                        self.fences.wrote(&lease);
                    }
                    Ok(Ok(Some(lease))) => {
                        self.fences.wrote(&lease);
                        self.generation += 1;
                        self.held.insert(
                            id.clone(),
                            Held {
                                lease,
                                handing_off: false,
                                sessions: Vec::new(),
                                generation: self.generation,
                            },
                        );
                        if let Some(m) = &self.metrics {
                            m.acquired.inc();
                        }
                        tracing::info!(cluster = %id, group = %self.config.group, "sharding: fence acquired; this replica owns the cluster");
                        self.fleet.own(&id);
                    }
                    Ok(Ok(None)) => {
                        tracing::debug!(cluster = %id, "sharding: another replica wrote the fence first")
                    }
                    Ok(Err(error)) => {
                        tracing::warn!(cluster = %id, error = %crate::client::Shown(&error), "sharding: could not take the fence")
                    }
                    Err(_) => tracing::warn!(cluster = %id, "sharding: taking the fence timed out"),
                }
            }
        }
    }

    /// Releases the fences of the latest view that name this replica but are neither held
    /// nor assigned to it, where no work of it runs in the cluster any more.
    async fn release_strays(&mut self) {
        let strays: Vec<(Option<C>, Lease)> = self
            .fences
            .held_by(&self.me.id)
            .into_iter()
            .map(|lease| {
                let id = lease
                    .metadata
                    .annotations
                    .as_ref()
                    .and_then(|a| a.get(super::CLUSTER_ANNOTATION))
                    .and_then(|text| C::parse(text).ok());
                (id, lease)
            })
            .filter(|(id, _)| match id {
                Some(id) => {
                    !self.held.contains_key(id)
                        && !self.mine.contains(id)
                        && self
                            .lost
                            .get(id)
                            .is_none_or(|sessions| sessions.iter().all(|s| s.is_idle()))
                }
                // Not a cluster id of this replica's kind: nothing of it runs here.
                None => true,
            })
            .collect();
        self.lost.retain(|id, sessions| {
            self.held.contains_key(id) || sessions.iter().any(|s| !s.is_idle())
        });
        if strays.is_empty() {
            return;
        }
        let host = self.host.clone();
        let bound = self.config.timing.retry_period;
        let releases = within(bound, strays, move |(id, lease)| {
            let host = host.clone();
            async move { (id, tokio::time::timeout(bound, host.release(lease)).await) }
        });
        for (id, released) in self.guarded(releases).await {
            let cluster = id.map(|id| id.to_string()).unwrap_or_default();
            match released {
                Ok(Ok(())) => {
                    tracing::info!(%cluster, "sharding: released a fence this replica no longer held")
                }
                Ok(Err(error)) => {
                    tracing::warn!(%cluster, error = %crate::client::Shown(&error), "sharding: could not release a fence this replica no longer holds; trying again at the next round")
                }
                Err(_) => {
                    tracing::warn!(%cluster, "sharding: releasing a fence timed out; trying again at the next round")
                }
            }
        }
    }

    /// Checks the fences held against the latest view: one that shows another holder, or
    /// is gone, is no longer this replica's (someone deleted or overwrote it).
    fn verify(&mut self) {
        let checks: Vec<(C, String)> = self
            .held
            .keys()
            .map(|id| (id.clone(), fence::name(&self.config.group, &id.to_string())))
            .collect();
        for (id, name) in checks {
            match self
                .fences
                .get(&name)
                .map(|l| (fence::holder(l).map(str::to_string), l.clone()))
            {
                Some((Some(holder), lease)) if holder == self.me.id => {
                    if let Some(held) = self.held.get_mut(&id) {
                        held.lease = lease;
                    }
                }
                Some((holder, _)) => self.lose(
                    &id,
                    &format!(
                        "its fence names {} now",
                        holder.as_deref().unwrap_or("no holder")
                    ),
                ),
                None => self.lose(&id, "its fence was deleted"),
            }
        }
    }

    /// Starts handing `id` over: it leaves the fleet now; the fence is released once its
    /// work has ended (bounded by the hand-off timeout).
    fn hand_off(&mut self, id: C) {
        let Some(held) = self.held.get_mut(&id) else {
            return;
        };
        held.handing_off = true;
        let generation = held.generation;
        let sessions = self.fleet.disown(&id);
        held.sessions = sessions.clone();
        tracing::info!(cluster = %id, group = %self.config.group, "sharding: the cluster is no longer this replica's; stopping its work there");
        let timeout = self.config.handoff_timeout;
        let after_abort = self.config.timing.renew_deadline;
        self.handoffs.push(
            async move {
                let ended = drained(&sessions, timeout, after_abort, &id).await;
                (id, generation, ended)
            }
            .boxed(),
        );
    }

    /// `id`'s work has ended (`drained`; or it would not stop): release its fence (or, if
    /// the work would not stop, let it expire), unless the cluster is this replica's again.
    async fn handed_off(&mut self, id: C, generation: u64, drained: bool) {
        let Some(held) = self
            .held
            .get_mut(&id)
            .filter(|h| h.generation == generation)
        else {
            // Lost meanwhile (and maybe taken again since: a later holding).
            return;
        };
        if !drained {
            // Its fence stays named after this replica, released once the work has ended
            // (checked each round), so nobody else reconciles the cluster meanwhile.
            let held = self.held.remove(&id);
            self.lost
                .insert(id.clone(), held.map(|h| h.sessions).unwrap_or_default());
            self.publish();
            return;
        }
        if self.mine.contains(&id) && !self.draining.is_cancelled() {
            held.handing_off = false;
            held.sessions.clear();
            tracing::info!(cluster = %id, "sharding: the cluster is this replica's again");
            self.fleet.own(&id);
            return;
        }
        let lease = held.lease.clone();
        let released = self
            .guarded(tokio::time::timeout(
                self.config.timing.retry_period,
                self.host.release(lease),
            ))
            .await;
        if self.held.remove(&id).is_none() {
            // Lost meanwhile (its deadline passed).
            return;
        }
        // A release that failed leaves the fence named after this replica: released again
        // at a later round.
        match released {
            Ok(Ok(())) => {
                tracing::info!(cluster = %id, group = %self.config.group, "sharding: cluster handed over; fence released")
            }
            Ok(Err(error)) => {
                tracing::warn!(cluster = %id, error = %crate::client::Shown(&error), "sharding: could not release the fence; trying again at the next round")
            }
            Err(_) => {
                tracing::warn!(cluster = %id, "sharding: releasing the fence timed out; trying again at the next round")
            }
        }
        if let Some(m) = &self.metrics {
            m.handoffs.inc();
        }
        self.publish();
    }

    fn publish(&self) {
        let now = Instant::now();
        let live = self.live(now);
        let peers: Vec<String> = live.iter().map(|p| p.id.clone()).collect();
        let handing_off = self.held.values().filter(|h| h.handing_off).count();
        if let Some(m) = &self.metrics {
            m.owned
                .set(i64::try_from(self.held.len() - handing_off).unwrap_or(i64::MAX));
        }
        *lock(&self.status) = Some(ShardStatus {
            identity: self.me.id.clone(),
            peers,
            discovered: self.fleet.discovered_ids().len(),
            held: self.held.len(),
            handing_off,
            live: live
                .into_iter()
                .map(|p| (p.id, p.weight.to_bits()))
                .collect(),
            // Per cluster only for the diagnostics view (a string per held cluster and round).
            holding: if self.detailed {
                self.held
                    .iter()
                    .map(|(id, h)| (id.to_string(), h.handing_off))
                    .collect()
            } else {
                std::collections::BTreeMap::new()
            },
        });
    }

    /// Leaves the group at the end of a run: every cluster leaves the fleet, their work is
    /// waited for (briefly: the manager has stopped its controllers already), the fences are
    /// released and the peer Lease deleted, so the others take over at once.
    pub(crate) async fn leave(mut self) {
        self.tenure.end();
        let held: Vec<(C, Held)> = self.held.drain().collect();
        let mut releases = Vec::new();
        for (id, h) in held {
            let sessions = self.fleet.disown(&id);
            let host = self.host.clone();
            let timeout = self.config.handoff_timeout;
            let after_abort = self.config.timing.renew_deadline;
            let deadline = self.renew_deadline().unwrap_or_else(Instant::now);
            releases.push(async move {
                if drained(&sessions, timeout, after_abort, &id).await && Instant::now() < deadline
                {
                    let _ =
                        tokio::time::timeout(Duration::from_secs(5), host.release(h.lease)).await;
                }
            });
        }
        let name = self.me.lease_name();
        futures::future::join_all(releases).await;
        let _ = tokio::time::timeout(Duration::from_secs(5), self.host.remove_peer(name)).await;
        if let Some(m) = &self.metrics {
            m.owned.set(0);
        }
        *lock(&self.status) = None;
        tracing::info!(group = %self.config.group, identity = %self.config.identity, "sharding: left the group; fences released");
    }
}

/// How this replica takes fences in `config`'s group.
fn claim(config: &Sharding) -> super::fence::Claim {
    super::fence::Claim {
        group: config.group.clone(),
        identity: config.identity.clone(),
        lease_seconds: config.timing.lease_seconds(),
    }
}

/// How this replica announces itself in `config`'s group.
fn announcement(config: &Sharding) -> Announcement {
    Announcement {
        group: config.group.clone(),
        id: config.identity.clone(),
        weight: config.weight,
        lease_seconds: config.timing.lease_seconds(),
    }
}

/// Runs `call` on `items`, 64 at a time, for at most `bound`: the results of those that
/// finished in time (a call cut short may still have reached the host).
async fn within<I, F, Fut, K, T>(bound: Duration, items: Vec<I>, call: F) -> Vec<(K, T)>
where
    F: FnMut(I) -> Fut,
    Fut: std::future::Future<Output = (K, T)>,
{
    futures::stream::iter(items)
        .map(call)
        .buffer_unordered(64)
        .take_until(tokio::time::sleep(bound))
        .collect()
        .await
}

/// Waits until no work runs on `sessions`: for `timeout`, then (the work dropped) for
/// `after_abort` more. Returns whether it all ended.
async fn drained<C: ClusterId>(
    sessions: &[Arc<Session>],
    timeout: Duration,
    after_abort: Duration,
    id: &C,
) -> bool {
    let idle = || futures::future::join_all(sessions.iter().map(|s| s.idle()));
    if tokio::time::timeout(timeout, idle()).await.is_ok() {
        return true;
    }
    tracing::warn!(cluster = %id, ?timeout, "sharding: work in the cluster given up still ran after the hand-off timeout; dropping it");
    for session in sessions {
        session.abort();
    }
    if tokio::time::timeout(after_abort, idle()).await.is_ok() {
        return true;
    }
    tracing::error!(cluster = %id, "sharding: work in the cluster given up did not stop when dropped (a task of its own?)");
    false
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

async fn notified(notify: Option<&tokio::sync::Notify>) {
    match notify {
        Some(notify) => notify.notified().await,
        None => std::future::pending().await,
    }
}

/// The coordinator's safety rules on paused time, against a host in memory
/// (`host::memory`): the integration tests (`tests/sharding.rs`) run them on a real API
/// server, in real time.
#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use super::super::host::memory::MemoryHost;
    use super::super::peers::Announcement;
    use super::*;
    use crate::cluster::{Cluster, ClusterName};
    use crate::fleet::FleetEvent;
    use crate::lease::LeaseTiming;

    const LEASE: Duration = Duration::from_secs(6);
    const RENEW_DEADLINE: Duration = Duration::from_secs(4);
    const RETRY: Duration = Duration::from_secs(1);

    struct Replica {
        fleet: Fleet<ClusterName>,
        host: Arc<MemoryHost>,
        tenure: Arc<Tenure>,
        config: Sharding,
    }

    impl Replica {
        /// A replica `me` of group `g` that has discovered `clusters`.
        fn new(me: &str, clusters: &[&str]) -> (Self, Coordinator<ClusterName>) {
            Self::with(me, clusters, |s| s)
        }

        fn with(
            me: &str,
            clusters: &[&str],
            settings: impl FnOnce(Sharding) -> Sharding,
        ) -> (Self, Coordinator<ClusterName>) {
            let client =
                kube::Client::try_from(kube::Config::new("https://127.0.0.1:1".parse().unwrap()))
                    .unwrap();
            let config = settings(
                Sharding::new(client, "ns", "g").identity(me).timing(
                    LeaseTiming::default()
                        .lease_duration(LEASE)
                        .renew_deadline(RENEW_DEADLINE)
                        .retry_period(RETRY),
                ),
            );
            let fleet = Fleet::<ClusterName>::new();
            fleet.open(crate::cache::WatchSettings::default(), true, None);
            for name in clusters {
                let cluster = Cluster::from_config(
                    ClusterName::new(name),
                    kube::Config::new("https://127.0.0.1:1".parse().unwrap()),
                )
                .unwrap();
                fleet.engage(cluster).unwrap();
            }
            let host = Arc::new(MemoryHost::new(claim(&config)));
            let tenure = Arc::new(Tenure::ended());
            let coordinator = Coordinator::with_host(
                config.clone(),
                fleet.clone(),
                None,
                Arc::default(),
                tenure.clone(),
                host.clone(),
            );
            let replica = Self {
                fleet,
                host,
                tenure,
                config,
            };
            (replica, coordinator)
        }

        fn owned(&self) -> Vec<String> {
            self.fleet.ids().iter().map(ToString::to_string).collect()
        }

        /// Who the fence of `cluster` names in the host.
        fn fence_holder(&self, cluster: &str) -> Option<String> {
            let name = fence::name(&self.config.group, cluster);
            lock(&self.host.store)
                .leases
                .get(&name)
                .and_then(|l| fence::holder(l).map(str::to_string))
        }

        /// Another replica writes the fence of `cluster`, naming `holder`.
        fn overwrite_fence(&self, cluster: &str, holder: &str) {
            let name = fence::name(&self.config.group, cluster);
            let mut store = lock(&self.host.store);
            let seen = store.leases.get(&name).cloned();
            let claim = fence::Claim {
                group: self.config.group.clone(),
                identity: holder.to_string(),
                lease_seconds: 6,
            };
            store.put(claim.taken(&name, cluster, seen.as_ref()));
        }

        /// Peer `id` announces itself (once: renew it again to keep it live).
        fn announce(&self, id: &str) {
            let peer = Announcement {
                group: self.config.group.clone(),
                id: id.to_string(),
                weight: 1.0,
                lease_seconds: 6,
            };
            lock(&self.host.store).put(peer.lease());
        }
    }

    /// Runs rounds of `coordinator` until `until` (paused time: each sleep jumps).
    async fn rounds(coordinator: &mut Coordinator<ClusterName>, count: usize) {
        for _ in 0..count {
            coordinator.round().await;
            tokio::time::sleep(RETRY).await;
        }
    }

    #[tokio::test(start_paused = true)]
    async fn fences_held_are_dropped_at_the_renew_deadline_and_not_before() {
        let (replica, coordinator) = Replica::new("a", &["x", "y"]);
        let stop = CancellationToken::new();
        let run = tokio::spawn(coordinator.run(stop.clone(), CancellationToken::new()));
        // A first round takes nothing; the second takes both.
        tokio::time::sleep(RETRY * 3).await;
        assert_eq!(replica.owned(), ["x", "y"]);
        assert!(replica.tenure.holds());

        // The host stops answering: the last renewal's deadline stands.
        replica.host.renewals_fail.store(true, Ordering::SeqCst);
        let deadline = replica.tenure.end_at().unwrap();
        tokio::time::sleep_until(deadline - Duration::from_millis(1)).await;
        assert_eq!(replica.owned(), ["x", "y"], "dropped before the deadline");
        assert!(replica.tenure.holds());
        tokio::time::sleep_until(deadline + Duration::from_millis(1)).await;
        assert!(replica.owned().is_empty(), "kept past the deadline");
        assert!(!replica.tenure.holds());
        // The fences still name it (nobody could be told), for the others to count it gone.
        assert_eq!(replica.fence_holder("x").as_deref(), Some("a"));
        stop.cancel();
        run.await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn a_fence_someone_else_wrote_is_dropped_and_taken_back_once_its_holder_is_silent() {
        let (replica, mut coordinator) = Replica::new("a", &["x"]);
        rounds(&mut coordinator, 2).await;
        assert_eq!(replica.owned(), ["x"]);

        // Someone wrote the fence, naming a replica that never announced itself.
        replica.overwrite_fence("x", "intruder");
        let seen = Instant::now();
        rounds(&mut coordinator, 1).await;
        assert!(replica.owned().is_empty(), "the fence names another now");
        assert_eq!(replica.fence_holder("x").as_deref(), Some("intruder"));

        // Its holder is counted gone once silent for the lease duration, from when this
        // replica first saw it: only then is the fence taken back.
        while replica.owned().is_empty() {
            rounds(&mut coordinator, 1).await;
            assert!(seen.elapsed() < LEASE * 2, "never taken back");
        }
        assert!(
            seen.elapsed() >= LEASE,
            "taken back after {:?}",
            seen.elapsed()
        );
        assert_eq!(replica.fence_holder("x").as_deref(), Some("a"));
    }

    #[tokio::test(start_paused = true)]
    async fn a_fence_naming_this_replica_that_it_does_not_hold_is_released() {
        let (replica, mut coordinator) = Replica::new("a", &["x"]);
        // A fence naming a, of a cluster it has not discovered (left by an earlier run).
        replica.overwrite_fence("gone", "a");
        rounds(&mut coordinator, 1).await;
        let released = lock(&replica.host.store).releases.clone();
        assert_eq!(released, [fence::name("g", "gone")]);
        assert_eq!(replica.fence_holder("gone"), None);
    }

    #[tokio::test(start_paused = true)]
    async fn a_take_that_lands_past_the_renew_deadline_is_not_owned_and_is_taken_back() {
        // A renew deadline a round can overrun: a slow renewal and a slow take.
        let (replica, mut coordinator) = Replica::with("a", &["x"], |s| {
            let timing = s.timing;
            s.timing(
                timing
                    .renew_deadline(Duration::from_millis(1300))
                    .lease_duration(Duration::from_millis(2500)),
            )
        });
        rounds(&mut coordinator, 1).await;
        *lock(&replica.host.renew_delay) = Duration::from_millis(900);
        *lock(&replica.host.take_delay) = Duration::from_millis(900);
        rounds(&mut coordinator, 1).await;
        assert!(replica.owned().is_empty(), "owned past the deadline");
        assert!(coordinator.held.is_empty());
        // The write landed: the fence names this replica, which takes it back when it can.
        assert_eq!(replica.fence_holder("x").as_deref(), Some("a"));
        // Then rounds are quick again (the slow one counted as a round without a view, so the
        // next may not announce: the cluster is taken within a few).
        *lock(&replica.host.renew_delay) = Duration::ZERO;
        *lock(&replica.host.take_delay) = Duration::ZERO;
        for _ in 0..4 {
            rounds(&mut coordinator, 1).await;
        }
        assert_eq!(replica.owned(), ["x"]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_hand_off_whose_fence_is_lost_meanwhile_releases_nothing() {
        let clusters = ["c0", "c1", "c2", "c3", "c4", "c5", "c6", "c7"];
        let (replica, mut coordinator) = Replica::new("a", &clusters);
        let mut events = replica.fleet.subscribe();
        rounds(&mut coordinator, 2).await;
        assert_eq!(replica.owned().len(), clusters.len());
        // A cluster that peer b will win, with work of a running there that does not end.
        let both = [
            Peer {
                id: "a".into(),
                weight: 1.0,
            },
            Peer {
                id: "b".into(),
                weight: 1.0,
            },
        ];
        let moving = clusters
            .iter()
            .find(|c| owner(&both, c).is_some_and(|p| p.id == "b"))
            .expect("b wins one of eight");
        let mut busy = None;
        while let Ok(event) = events.try_recv() {
            if let FleetEvent::Engaged(engagement) = event
                && engagement.id().as_str() == *moving
            {
                busy = engagement.session.busy();
            }
        }
        assert!(busy.is_some());

        // b joins: a hands the cluster over and waits for its work.
        replica.announce("b");
        rounds(&mut coordinator, 1).await;
        assert!(!replica.owned().contains(&moving.to_string()));
        assert!(coordinator.held[&ClusterName::new(moving)].handing_off);
        // Meanwhile the fence is written by b (as after a hand-off that timed out elsewhere):
        // a drops the cluster; when its work ends, it releases nothing of b's.
        replica.overwrite_fence(moving, "b");
        replica.announce("b");
        rounds(&mut coordinator, 1).await;
        assert!(!coordinator.held.contains_key(&ClusterName::new(moving)));
        drop(busy);
        // Every hand-off's wait ends (the others' at once): the lost one's is let go.
        while !coordinator.handoffs.is_empty() {
            let (id, generation, drained) =
                tokio::time::timeout(Duration::from_secs(1), coordinator.handoffs.next())
                    .await
                    .expect("the hand-off's wait ends with the work")
                    .unwrap();
            coordinator.handed_off(id, generation, drained).await;
        }
        replica.announce("b");
        rounds(&mut coordinator, 1).await;
        assert_eq!(replica.fence_holder(moving).as_deref(), Some("b"));
        let released = lock(&replica.host.store).releases.clone();
        assert!(
            !released.contains(&fence::name("g", moving)),
            "{released:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_hand_off_wait_that_ends_after_the_cluster_was_lost_and_taken_again_is_ignored() {
        let (replica, mut coordinator) = Replica::new("a", &["x"]);
        rounds(&mut coordinator, 2).await;
        let x = ClusterName::new("x");
        let first = coordinator.held[&x].generation;
        // The holding that a hand-off began with is lost, and x is taken again (its fence
        // was written by a holder that then went silent for the lease duration).
        replica.overwrite_fence("x", "intruder");
        rounds(&mut coordinator, 1).await;
        assert!(!coordinator.held.contains_key(&x));
        for _ in 0..10 {
            rounds(&mut coordinator, 1).await;
        }
        let again = coordinator.held[&x].generation;
        assert!(again > first);
        // The old hand-off's wait ends now, while x is (say) no longer assigned here: it
        // is about the old holding, so the new one is neither released nor touched.
        coordinator.mine.clear();
        coordinator.handed_off(x.clone(), first, true).await;
        assert_eq!(coordinator.held[&x].generation, again);
        assert_eq!(replica.fence_holder("x").as_deref(), Some("a"));
        assert!(lock(&replica.host.store).releases.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn a_replica_whose_watch_stalls_silently_takes_no_live_peers_fence() {
        // Valid timings where a blind replica's last announcement outlives a peer's silence
        // in its frozen view: LD 6 s, RD 4.5 s, RP 1 s.
        let (replica, coordinator) = Replica::with("a", &["x", "y", "z", "w"], |s| {
            let timing = s.timing;
            s.timing(timing.renew_deadline(Duration::from_millis(4500)))
        });
        // b is live and holds every fence.
        replica.announce("b");
        for cluster in ["x", "y", "z", "w"] {
            replica.overwrite_fence(cluster, "b");
        }
        let stop = CancellationToken::new();
        let run = tokio::spawn(coordinator.run(stop.clone(), CancellationToken::new()));
        tokio::time::sleep(Duration::from_millis(500)).await;
        // a's view of the group stalls: no error, the watch "works", nothing new arrives.
        replica.host.stall();
        // b renews every second for the next 20 s; a must never take a fence from it.
        for _ in 0..20 {
            replica.announce("b");
            tokio::time::sleep(Duration::from_secs(1)).await;
            for cluster in ["x", "y", "z", "w"] {
                assert_eq!(
                    replica.fence_holder(cluster).as_deref(),
                    Some("b"),
                    "a took {cluster} from a live b at {:?}",
                    tokio::time::Instant::now()
                );
            }
        }
        assert!(replica.owned().is_empty());
        stop.cancel();
        run.await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn a_silent_peer_counts_gone_a_lease_duration_after_its_renewal_arrived_and_no_later() {
        // Rounds two seconds apart: a take that waited for a round would show.
        let (replica, coordinator) = Replica::with("a", &["x"], |s| {
            let timing = s.timing;
            s.timing(
                timing
                    .retry_period(Duration::from_secs(2))
                    .renew_deadline(Duration::from_secs(3)),
            )
        });
        replica.overwrite_fence("x", "b");
        let stop = CancellationToken::new();
        let run = tokio::spawn(coordinator.run(stop.clone(), CancellationToken::new()));
        // b renews between two of a's rounds (the second starts early, a quarter period in,
        // for the clusters discovered before the start), then falls silent.
        tokio::time::sleep(Duration::from_millis(900)).await;
        replica.announce("b");
        let silent = Instant::now();
        while replica.owned().is_empty() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let waited = silent.elapsed();
        assert_eq!(replica.owned(), ["x"]);
        assert_eq!(replica.fence_holder("x").as_deref(), Some("a"));
        // Not before b has been silent for the lease duration (counted from when the view got
        // its renewal, not from a's next round), and not a round later either.
        assert!(waited >= LEASE, "taken {waited:?} after b's last renewal");
        assert!(
            waited < LEASE + Duration::from_millis(100),
            "taken {waited:?} after b's last renewal"
        );
        stop.cancel();
        run.await.unwrap();
    }
}
