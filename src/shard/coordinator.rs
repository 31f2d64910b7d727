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
}

/// A hand-off's wait: the cluster, and whether its work ended.
type Handoff<C> = futures::future::BoxFuture<'static, (C, bool)>;

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
    metrics: Option<ShardSeries>,
    status: Arc<Mutex<Option<ShardStatus>>>,
}

impl<C: ClusterId> Coordinator<C> {
    pub(crate) fn new(
        config: Sharding,
        fleet: Fleet<C>,
        metrics: Option<&crate::Metrics>,
        status: Arc<Mutex<Option<ShardStatus>>>,
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
            lease_duration: Duration::from_secs(u64::from(config.lease_seconds().unsigned_abs())),
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
            status,
        }
    }

    /// Runs until `stop`; then [`Coordinator::leave`] gives everything up.
    pub(crate) async fn run(mut self, stop: CancellationToken) -> Self {
        let changes = self.fleet.discovery_changes();
        tracing::info!(group = %self.config.group, identity = %self.config.identity, weight = self.config.weight, "sharding: joining the group");
        loop {
            self.round().await;
            let wake = tokio::time::sleep(self.config.jittered_retry());
            tokio::pin!(wake);
            // Between rounds: hand-offs finishing and fences reaching their deadline.
            loop {
                let deadline = self.next_deadline();
                tokio::select! {
                    () = stop.cancelled() => return self,
                    () = &mut wake => break,
                    () = notified(changes.as_deref()) => break,
                    Some((id, drained)) = self.handoffs.next(), if !self.handoffs.is_empty() => {
                        self.handed_off(id, drained).await;
                    }
                    () = sleep_until(deadline) => self.expire(),
                }
            }
        }
    }

    /// When the fences held pass their renew deadline, if any are held.
    fn next_deadline(&self) -> Option<Instant> {
        if self.held.is_empty() {
            return None;
        }
        Some(match self.announced {
            Some(at) => at + self.config.renew_deadline,
            None => Instant::now(),
        })
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
        if self.held.remove(id).is_none() {
            return;
        }
        for session in self.fleet.disown(id) {
            session.abort();
        }
        if let Some(m) = &self.metrics {
            m.lost.inc();
        }
        tracing::error!(cluster = %id, group = %self.config.group, %reason, "sharding: fence lost; this replica's work in the cluster was dropped");
        self.publish();
    }

    /// One round: renew, list, then give up and take fences as the assignment says.
    async fn round(&mut self) {
        let bound = self.config.retry_period;
        let began = Instant::now();
        let me = self.me.clone();
        let leases = self.leases.clone();
        let peer = async move { tokio::time::timeout(bound, me.renew(&leases)).await };
        let leases = self.leases.clone();
        let selector = format!("{GROUP_LABEL}={}", self.config.group);
        let list = async move {
            tokio::time::timeout(bound, leases.list(&ListParams::default().labels(&selector))).await
        };
        let (peer, list) = self.guarded(futures::future::join(peer, list)).await;
        let now = Instant::now();
        let listed = matches!(list, Ok(Ok(_)));
        match peer {
            Ok(Ok(())) => self.announced = Some(began),
            Ok(Err(error)) => {
                tracing::warn!(group = %self.config.group, %error, "sharding: could not renew this replica's peer lease")
            }
            Err(_) => {
                tracing::warn!(group = %self.config.group, "sharding: renewing this replica's peer lease timed out")
            }
        }
        match list {
            Ok(Ok(list)) => {
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
                tracing::warn!(group = %self.config.group, %error, "sharding: could not list the group's leases")
            }
            Err(_) => {
                tracing::warn!(group = %self.config.group, "sharding: listing the group's leases timed out")
            }
        }
        self.expire();

        // The assignment, over the live peers as this replica sees them.
        let now = Instant::now();
        let mut live: Vec<Peer> = self
            .peers
            .live(now)
            .into_iter()
            .filter(|p| p.id != self.me.id)
            .collect();
        if self
            .announced
            .is_some_and(|t| now.duration_since(t) < self.config.renew_deadline)
        {
            live.push(Peer {
                id: self.me.id.clone(),
                weight: self.me.weight,
            });
        }
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

        // Take what is, where the fence is free; not in the first round, when peers started
        // at the same time may not have announced themselves yet.
        // Nor without this round's listing: fences are not renewed, so whether a holder is
        // gone is judged from its peer Lease alone, which only a fresh listing shows.
        if !std::mem::replace(&mut self.started, true) || !listed {
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
                if self.fences.get(&name).is_none() {
                    return Some((id.clone(), name, None));
                }
                let seen = self.fences.get(&name)?;
                let free = match fence::holder(seen) {
                    None => true,
                    Some(holder) if holder == me => true,
                    Some(holder) => self.peers.gone(holder, now, self.config.lease_duration),
                };
                free.then(|| (id.clone(), name, Some(seen.clone())))
            })
            .collect();
        if !wanted.is_empty() {
            let holder = self.holder.clone();
            let attempts = futures::stream::iter(wanted)
                .map(move |(id, name, seen)| {
                    let holder = holder.clone();
                    async move {
                        let text = id.to_string();
                        let out = tokio::time::timeout(
                            bound,
                            holder.acquire(&name, &text, seen.as_ref()),
                        )
                        .await;
                        (id, out)
                    }
                })
                .buffer_unordered(32)
                .collect::<Vec<_>>();
            let attempts = self.guarded(attempts).await;
            for (id, out) in attempts {
                match out {
                    Ok(Ok(Some(lease))) => {
                        self.fences.wrote(&lease);
                        self.held.insert(
                            id.clone(),
                            Held {
                                lease,
                                handing_off: false,
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
                        tracing::warn!(cluster = %id, %error, "sharding: could not take the fence")
                    }
                    Err(_) => tracing::warn!(cluster = %id, "sharding: taking the fence timed out"),
                }
            }
        }
        self.publish();
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
        let sessions = self.fleet.disown(&id);
        tracing::info!(cluster = %id, group = %self.config.group, "sharding: the cluster is no longer this replica's; stopping its work there");
        let timeout = self.config.handoff_timeout;
        let after_abort = self.config.renew_deadline;
        self.handoffs.push(
            async move {
                let ended = drained(&sessions, timeout, after_abort, &id).await;
                (id, ended)
            }
            .boxed(),
        );
    }

    /// `id`'s work has ended (`drained`; or it would not stop): release its fence (or, if
    /// the work would not stop, let it expire), unless the cluster is this replica's again.
    async fn handed_off(&mut self, id: C, drained: bool) {
        let Some(held) = self.held.get_mut(&id) else {
            return;
        };
        if !drained {
            // Not renewed from now on: the others wait out its lease duration.
            self.held.remove(&id);
            self.publish();
            return;
        }
        if self.mine.contains(&id) {
            held.handing_off = false;
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
        match released {
            Ok(Ok(())) => {
                tracing::info!(cluster = %id, group = %self.config.group, "sharding: cluster handed over; fence released")
            }
            Ok(Err(error)) => {
                tracing::warn!(cluster = %id, %error, "sharding: could not release the fence; it expires on its own")
            }
            Err(_) => {
                tracing::warn!(cluster = %id, "sharding: releasing the fence timed out; it expires on its own")
            }
        }
        if let Some(m) = &self.metrics {
            m.handoffs.inc();
        }
        self.publish();
    }

    fn publish(&self) {
        let now = Instant::now();
        let mut peers: Vec<String> = self
            .peers
            .live(now)
            .into_iter()
            .map(|p| p.id)
            .filter(|id| *id != self.me.id)
            .collect();
        if self
            .announced
            .is_some_and(|t| now.duration_since(t) < self.config.renew_deadline)
        {
            peers.push(self.me.id.clone());
        }
        peers.sort();
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
        let held: Vec<(C, Held)> = self.held.drain().collect();
        let mut releases = Vec::new();
        for (id, h) in held {
            let sessions = self.fleet.disown(&id);
            let holder = self.holder.clone();
            let timeout = self.config.handoff_timeout;
            let after_abort = self.config.renew_deadline;
            let deadline = self
                .announced
                .map_or_else(Instant::now, |at| at + self.config.renew_deadline);
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
