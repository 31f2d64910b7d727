//! The sharding coordinator: one task per manager run that announces the replica, follows
//! its peers, and takes and gives up the fences of the clusters assigned to it, making them
//! members of the fleet or not.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::stream::FuturesUnordered;
use futures::{FutureExt, StreamExt};
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{Api, ListParams};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::fence::{self, Fences, Holder};
use super::peers::{Announcement, Observed};
use super::rendezvous::{Peer, owner};
use super::{GROUP_LABEL, ROLE_LABEL, Sharding};
use crate::cluster::Session;
use crate::metrics::ShardSeries;
use crate::sync::lock;
use crate::tenure::Tenure;
use crate::{ClusterId, Fleet};

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
}

/// A fence this replica holds.
struct Held {
    /// As last written or listed (its `resourceVersion` is what the release writes over).
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
    leases: Api<Lease>,
    holder: Holder,
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
    /// Past the first round.
    started: bool,
    /// When the round that last listed the group's Leases began (or the coordinator, before
    /// the first listing): a replica that cannot see the group stops announcing itself, so
    /// the others do not assign it clusters it could never take.
    seen_group: Instant,
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
        metrics: Option<&crate::Metrics>,
        status: Arc<Mutex<Option<ShardStatus>>>,
        tenure: Arc<Tenure>,
    ) -> Self {
        let leases = Api::namespaced(config.client.clone(), &config.namespace);
        let holder = Holder {
            api: leases.clone(),
            group: config.group.clone(),
            identity: config.identity.clone(),
            lease_seconds: config.lease_seconds(),
        };
        let me = Announcement {
            group: config.group.clone(),
            id: config.identity.clone(),
            weight: config.weight,
            lease_seconds: config.lease_seconds(),
        };
        Self {
            metrics: metrics.map(|m| m.shard(&config.group)),
            config,
            fleet,
            leases,
            holder,
            me,
            peers: Observed::default(),
            fences: Fences::default(),
            held: HashMap::new(),
            mine: HashSet::new(),
            handoffs: FuturesUnordered::new(),
            announced: None,
            started: false,
            seen_group: Instant::now(),
            blind: false,
            generation: 0,
            lost: HashMap::new(),
            status,
            tenure,
            draining: CancellationToken::new(),
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
            let wake = tokio::time::sleep(self.config.jittered_retry());
            tokio::pin!(wake);
            // A change of the discovered clusters starts the next round early, but no sooner
            // than a quarter retry period after this one began: a provider engaging clusters
            // one by one does not set off a round (a write and a list on the host) for each.
            let early = tokio::time::sleep_until(began + self.config.retry_period / 4);
            tokio::pin!(early);
            let mut changed = false;
            // Between rounds: hand-offs finishing and fences reaching their deadline.
            loop {
                let deadline = self.next_deadline();
                tokio::select! {
                    () = stop.cancelled() => return self,
                    () = &mut wake => break,
                    () = notified(changes.as_deref()), if !changed => changed = true,
                    () = &mut early, if changed => break,
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
        self.announced.map(|at| at + self.config.renew_deadline)
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

    /// The live peers at `now`, by id: the others as the listings showed them, and this
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

    /// One round: renew, list, then give up and take fences as the assignment says.
    async fn round(&mut self) {
        let bound = self.config.retry_period;
        let began = Instant::now();
        // Unable to list the group for two retry periods (two listings in a row failed), this
        // replica stops renewing its peer Lease: it drops its fences at its renew deadline,
        // and the others count it gone and take its clusters, rather than leaving them
        // assigned to a replica that cannot take them. A single failed listing costs nothing.
        let blindness = (self.config.retry_period * 2).min(self.config.renew_deadline);
        let blind = began.saturating_duration_since(self.seen_group) > blindness;
        if blind != std::mem::replace(&mut self.blind, blind) {
            if blind {
                tracing::warn!(group = %self.config.group, identity = %self.config.identity, "sharding: the group's Leases could not be listed for two retry periods; this replica stops announcing itself until they can (the others take its clusters)");
            } else {
                tracing::info!(group = %self.config.group, identity = %self.config.identity, "sharding: the group's Leases are listed again; this replica announces itself again");
            }
        }
        let me = (!blind).then(|| self.me.clone());
        let leases = self.leases.clone();
        let peer = async move {
            match me {
                Some(me) => Some(tokio::time::timeout(bound, me.renew(&leases)).await),
                None => None,
            }
        };
        let leases = self.leases.clone();
        let selector = format!("{GROUP_LABEL}={}", self.config.group);
        let list = async move {
            tokio::time::timeout(bound, leases.list(&ListParams::default().labels(&selector))).await
        };
        let (peer, list) = self.guarded(futures::future::join(peer, list)).await;
        let now = Instant::now();
        let listed = matches!(list, Ok(Ok(_)));
        match peer {
            Some(Ok(Ok(()))) => {
                self.announced = Some(began);
                self.tenure.until(began + self.config.renew_deadline);
            }
            Some(Ok(Err(error))) => {
                tracing::warn!(group = %self.config.group, error = %crate::cluster::Shown(&error), "sharding: could not renew this replica's peer lease")
            }
            Some(Err(_)) => {
                tracing::warn!(group = %self.config.group, "sharding: renewing this replica's peer lease timed out")
            }
            None => {}
        }
        match list {
            Ok(Ok(list)) => {
                self.seen_group = began;
                let (peers, fences): (Vec<Lease>, Vec<Lease>) =
                    list.items.into_iter().partition(|l| {
                        l.metadata
                            .labels
                            .as_ref()
                            .and_then(|l| l.get(ROLE_LABEL))
                            .is_some_and(|r| r == "peer")
                    });
                self.peers.update(&peers, now);
                self.fences.update(fences);
                self.verify();
            }
            Ok(Err(error)) => {
                tracing::warn!(group = %self.config.group, error = %crate::cluster::Shown(&error), "sharding: could not list the group's leases")
            }
            Err(_) => {
                tracing::warn!(group = %self.config.group, "sharding: listing the group's leases timed out")
            }
        }
        self.expire();

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

        // Release fences still naming this replica that it no longer holds and that are not
        // its own (a release that failed, a fence lost, a take that landed after its cut),
        // once the work it had there has ended: they would stay blocked while it lives.
        if listed {
            self.release_strays().await;
        }

        // Take what is, where the fence is free; not in the first round, when peers started
        // at the same time may not have announced themselves yet.
        // Nor without this round's listing: fences are not renewed, so whether a holder is
        // gone is judged from its peer Lease alone, which only a fresh listing shows.
        // Nor while the manager drains at shutdown: a cluster taken now would engage (watches,
        // per-cluster tasks) only to be given up again, and hold up the others meanwhile.
        if !std::mem::replace(&mut self.started, true) || !listed || self.draining.is_cancelled() {
            self.publish();
            return;
        }
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
                    Some(holder) => self.peers.gone(holder, now, self.config.lease_duration),
                };
                free.then(|| (id.clone(), name, Some(seen.clone())))
            })
            .collect();
        if !wanted.is_empty() {
            // At most a retry period of taking per round, so that this replica's peer Lease
            // is renewed in time however many fences it wants; what is left is taken in the
            // next rounds (a write that landed after the cut shows as a fence naming this
            // replica, taken back then).
            let holder = self.holder.clone();
            let attempts = within(bound, wanted, move |(id, name, seen)| {
                let holder = holder.clone();
                async move {
                    let text = id.to_string();
                    let out = holder.acquire(&name, &text, seen.as_ref());
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
                        tracing::warn!(cluster = %id, error = %crate::cluster::Shown(&error), "sharding: could not take the fence")
                    }
                    Err(_) => tracing::warn!(cluster = %id, "sharding: taking the fence timed out"),
                }
            }
        }
        self.publish();
    }

    /// Releases the fences of the latest listing that name this replica but are neither held
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
        let holder = self.holder.clone();
        let bound = self.config.retry_period;
        let releases = within(bound, strays, move |(id, lease)| {
            let holder = holder.clone();
            async move {
                (
                    id,
                    tokio::time::timeout(bound, holder.release(&lease)).await,
                )
            }
        });
        for (id, released) in self.guarded(releases).await {
            let cluster = id.map(|id| id.to_string()).unwrap_or_default();
            match released {
                Ok(Ok(())) => {
                    tracing::info!(%cluster, "sharding: released a fence this replica no longer held")
                }
                Ok(Err(error)) => {
                    tracing::warn!(%cluster, error = %crate::cluster::Shown(&error), "sharding: could not release a fence this replica no longer holds; trying again at the next round")
                }
                Err(_) => {
                    tracing::warn!(%cluster, "sharding: releasing a fence timed out; trying again at the next round")
                }
            }
        }
    }

    /// Checks the fences held against the latest listing: one that shows another holder, or
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
        let after_abort = self.config.renew_deadline;
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
        let holder = self.holder.clone();
        let released = self
            .guarded(tokio::time::timeout(
                self.config.retry_period,
                holder.release(&lease),
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
                tracing::warn!(cluster = %id, error = %crate::cluster::Shown(&error), "sharding: could not release the fence; trying again at the next round")
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
        let peers: Vec<String> = self.live(now).into_iter().map(|p| p.id).collect();
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
            let holder = self.holder.clone();
            let timeout = self.config.handoff_timeout;
            let after_abort = self.config.renew_deadline;
            let deadline = self.renew_deadline().unwrap_or_else(Instant::now);
            releases.push(async move {
                if drained(&sessions, timeout, after_abort, &id).await && Instant::now() < deadline
                {
                    let _ = tokio::time::timeout(Duration::from_secs(5), holder.release(&h.lease))
                        .await;
                }
            });
        }
        let leases = self.leases.clone();
        let name = self.me.lease_name();
        futures::future::join_all(releases).await;
        let _ = tokio::time::timeout(
            Duration::from_secs(5),
            leases.delete(&name, &Default::default()),
        )
        .await;
        if let Some(m) = &self.metrics {
            m.owned.set(0);
        }
        *lock(&self.status) = None;
        tracing::info!(group = %self.config.group, identity = %self.config.identity, "sharding: left the group; fences released");
    }
}

/// Runs `call` on `items`, 32 at a time, for at most `bound`: the results of those that
/// finished in time (a call cut short may still have reached the host).
async fn within<I, F, Fut, K, T>(bound: Duration, items: Vec<I>, call: F) -> Vec<(K, T)>
where
    F: FnMut(I) -> Fut,
    Fut: std::future::Future<Output = (K, T)>,
{
    futures::stream::iter(items)
        .map(call)
        .buffer_unordered(32)
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
