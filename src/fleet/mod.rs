//! [`Fleet`]: the set of engaged clusters, which providers change and controllers follow.

pub(crate) mod api;

pub use api::{
    DEFAULT_FLEET_CONCURRENCY, DEFAULT_FLEET_TIMEOUT, FleetApi, FleetApiError, Members, PerCluster,
};

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::cache::Watchable;
use crate::cache::{Indexer, WatchSettings};
use crate::cluster::{Cluster, ClusterId};
use crate::cluster::{Engagement, Session};
use crate::util::sync::lock;

/// The clusters currently engaged, shared by a manager, its provider and its controllers.
///
/// Providers call [`Fleet::engage`] and [`Fleet::disengage`]; every controller is told about
/// each change, including controllers that start after clusters were engaged (they first
/// receive every cluster already engaged; Go's multicluster-runtime misses those).
///
/// A fleet is open from its creation; its manager closes it when a run ends (every cluster is
/// disengaged and further engagements are refused until the next run opens it again).
pub struct Fleet<C: ClusterId> {
    inner: Arc<Mutex<State<C>>>,
}

struct State<C: ClusterId> {
    /// Refusing engagements: its manager's run has ended.
    closed: bool,
    /// The id of the running manager's local cluster, which no fleet cluster may have.
    local: Option<C>,
    members: BTreeMap<C, Member<C>>,
    /// Clusters paused ([`Fleet::pause`]): not members, but still of the fleet, until they
    /// are engaged again or leave for good.
    paused: BTreeMap<C, Cluster<C>>,
    subscribers: Vec<mpsc::UnboundedSender<FleetEvent<C>>>,
    /// Field indexes every cluster gets, including clusters engaged later.
    indexers: Vec<Indexer>,
    settings: WatchSettings,
    /// Engagements this fleet ended whose watch tasks may still be winding down; awaited when
    /// the fleet closes, so that nothing of a stopped manager runs on.
    ended: Vec<Arc<Session>>,
    /// With sharding: the clusters the provider engaged, of which only those this replica
    /// owns are members.
    shard: Option<Shard<C>>,
}

/// A sharded fleet's view of what its provider discovered and what this replica owns.
struct Shard<C: ClusterId> {
    /// Every cluster the provider engaged, owned here or not: the handle only (its client
    /// is not used, nothing is watched) until this replica owns it.
    discovered: BTreeMap<C, Discovered<C>>,
    /// The ids this replica holds the fence of; those discovered are members.
    owned: std::collections::BTreeSet<C>,
    /// The engagements of owned ids since they were owned: a hand-off waits for their work.
    sessions: std::collections::HashMap<C, Vec<Weak<Session>>>,
    /// Told when `discovered` changes.
    changed: Arc<tokio::sync::Notify>,
}

/// A discovered cluster, and the task that forgets it when the token given to
/// [`Fleet::engage_until`] is cancelled.
struct Discovered<C: ClusterId> {
    cluster: Cluster<C>,
    _until: Option<AbortOnDrop>,
}

/// One engaged cluster.
struct Member<C: ClusterId> {
    engagement: Engagement<C>,
    /// The task that disengages it when the token given to [`Fleet::engage_until`] is
    /// cancelled; aborted (dropped) when the member goes first.
    _until: Option<AbortOnDrop>,
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Why a membership ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Leaving {
    /// The provider's source of the cluster is gone.
    ForGood,
    /// Unhealthy, not ready, contested: still of the fleet ([`Fleet::pause`]).
    Paused,
    /// Handed to another replica, or the run ends.
    Away,
}

/// A change of the fleet, as a controller sees it.
#[derive(Debug)]
pub(crate) enum FleetEvent<C: ClusterId> {
    /// A cluster joined.
    Engaged(Engagement<C>),
    /// A cluster was engaged again with another endpoint or credentials: `old` is
    /// disengaged, `new` takes its place under the same id.
    Replaced {
        old: Engagement<C>,
        new: Engagement<C>,
    },
    /// A cluster left: its work stops. Whether for good shows in a [`FleetEvent::Departed`]
    /// that follows (a cluster paused, handed to another replica or stopped with the run
    /// has none).
    Disengaged(Engagement<C>),
    /// A cluster left the fleet for good: its provider's source of it is gone (after its
    /// `Disengaged`, or alone for a cluster that was paused).
    Departed(Cluster<C>),
}

impl<C: ClusterId> Clone for FleetEvent<C> {
    fn clone(&self) -> Self {
        match self {
            Self::Engaged(c) => Self::Engaged(c.clone()),
            Self::Replaced { old, new } => Self::Replaced {
                old: old.clone(),
                new: new.clone(),
            },
            Self::Disengaged(c) => Self::Disengaged(c.clone()),
            Self::Departed(c) => Self::Departed(c.clone()),
        }
    }
}

/// A change of the fleet, as [`Fleet::events`] reports it (Go's `multicluster.Aware`, as a
/// stream): per-cluster work starts at `Engaged` and stops when its token is cancelled.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub enum ClusterEvent<C: ClusterId> {
    /// `cluster` joined the fleet. `until` is cancelled when this engagement ends: when the
    /// cluster is disengaged or replaced, and when the manager's run ends.
    Engaged {
        /// The engaged cluster.
        cluster: Cluster<C>,
        /// Cancelled when this engagement ends.
        until: CancellationToken,
    },
    /// The id was engaged again with another endpoint or credentials: `old`'s engagement
    /// has ended (its token is cancelled) and `new` takes its place; `until` is `new`'s.
    Replaced {
        /// The cluster that left.
        old: Cluster<C>,
        /// The cluster that took its place under the same id.
        new: Cluster<C>,
        /// Cancelled when `new`'s engagement ends.
        until: CancellationToken,
    },
    /// `cluster` left the fleet (its engagement's token is cancelled): for good, paused
    /// ([`Fleet::pause`]), or with the run's end. A [`ClusterEvent::Departed`] follows when
    /// it was for good.
    Disengaged {
        /// The cluster that left.
        cluster: Cluster<C>,
    },
    /// `cluster` left the fleet for good ([`Fleet::disengage`]: its provider's source of it
    /// is gone), after its `Disengaged`, or alone for a cluster that was paused: what work
    /// left in that cluster may now be cleaned up.
    Departed {
        /// The cluster that left for good.
        cluster: Cluster<C>,
    },
}

impl<C: ClusterId> ClusterEvent<C> {
    fn of(event: FleetEvent<C>) -> Self {
        match event {
            FleetEvent::Engaged(e) => Self::Engaged {
                until: e.session.token().child_token(),
                cluster: e.cluster,
            },
            FleetEvent::Replaced { old, new } => Self::Replaced {
                old: old.cluster,
                until: new.session.token().child_token(),
                new: new.cluster,
            },
            FleetEvent::Disengaged(e) => Self::Disengaged { cluster: e.cluster },
            FleetEvent::Departed(cluster) => Self::Departed { cluster },
        }
    }

    /// The id of the cluster the event is about.
    pub fn id(&self) -> &C {
        match self {
            Self::Engaged { cluster, .. }
            | Self::Disengaged { cluster }
            | Self::Departed { cluster } => cluster.id(),
            Self::Replaced { new, .. } => new.id(),
        }
    }
}

/// The changes of a fleet from the moment [`Fleet::events`] was called, starting with an
/// `Engaged` for every cluster engaged then. Unbounded: a subscriber that does not read
/// holds the events for it. The stream ends when the fleet is dropped.
pub struct ClusterEvents<C: ClusterId> {
    rx: mpsc::UnboundedReceiver<FleetEvent<C>>,
}

impl<C: ClusterId> futures::Stream for ClusterEvents<C> {
    type Item = ClusterEvent<C>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        self.rx.poll_recv(cx).map(|e| e.map(ClusterEvent::of))
    }
}

impl<C: ClusterId> fmt::Debug for ClusterEvents<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClusterEvents").finish_non_exhaustive()
    }
}

/// What [`Fleet::engage`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Engaged {
    /// The id was not engaged; the cluster joined.
    New,
    /// The id was engaged with another endpoint or other credentials; the old cluster was
    /// disengaged and this one took its place.
    Replaced,
    /// The id was already engaged with this cluster (or an equal configuration); nothing
    /// changed. The handle given stays unengaged; [`Fleet::get`] has the engaged one.
    Unchanged,
}

/// Why [`Fleet::engage`] refused a cluster.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EngageError {
    /// The fleet's manager has stopped; clusters can be engaged again once it runs again.
    #[error("cannot engage cluster {cluster}: the manager is not running")]
    Stopped {
        /// The cluster refused.
        cluster: String,
    },
    /// The id is the manager's local cluster's ([`Manager::with_local`](crate::Manager::with_local)):
    /// a fleet cluster under it would be taken for the host (its webhook reviews, `cluster_by_id`).
    #[error("cannot engage cluster {cluster}: the manager's local cluster has that id")]
    LocalId {
        /// The cluster refused.
        cluster: String,
    },
    /// [`Fleet::engage_until`] watches its token from a task, and was called outside a Tokio
    /// runtime.
    #[error("cannot engage cluster {cluster} until a token: not within a Tokio runtime")]
    NoRuntime {
        /// The cluster refused.
        cluster: String,
    },
}

impl<C: ClusterId> Clone for Fleet<C> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
        }
    }
}

impl<C: ClusterId> Default for Fleet<C> {
    fn default() -> Self {
        Self {
            inner: Arc::new(Mutex::new(State {
                closed: false,
                local: None,
                members: BTreeMap::new(),
                paused: BTreeMap::new(),
                subscribers: Vec::new(),
                indexers: Vec::new(),
                settings: WatchSettings::default(),
                ended: Vec::new(),
                shard: None,
            })),
        }
    }
}

impl<C: ClusterId> fmt::Debug for Fleet<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_set().entries(self.state().members.keys()).finish()
    }
}

impl<C: ClusterId> Fleet<C> {
    /// An empty, open fleet.
    pub fn new() -> Self {
        Self::default()
    }

    fn state(&self) -> MutexGuard<'_, State<C>> {
        lock(&self.inner)
    }

    /// Engages `cluster` under its id. An id engaged with the same instance, or with a
    /// configuration of the same endpoint, default namespace and credentials, is left as it
    /// is; an id engaged with a different cluster is replaced (the old one is disengaged: its
    /// watches stop and new ones start, with queued requests kept). The id of the running
    /// manager's local cluster is refused ([`EngageError::LocalId`]).
    pub fn engage(&self, cluster: Cluster<C>) -> Result<Engaged, EngageError> {
        self.engage_with(cluster, None)
    }

    /// Engages `cluster` for as long as `token` is not cancelled: cancelling it disengages
    /// the cluster (if it is still the one engaged under its id). This is the shape of Go's
    /// `Engage(ctx, ...)`, where the context's end is the removal signal. When the id is
    /// already engaged with an equal cluster (`Engaged::Unchanged`), that engagement keeps
    /// its own token and this one is not watched.
    pub fn engage_until(
        &self,
        cluster: Cluster<C>,
        token: CancellationToken,
    ) -> Result<Engaged, EngageError> {
        let runtime =
            tokio::runtime::Handle::try_current().map_err(|_| EngageError::NoRuntime {
                cluster: cluster.id().to_string(),
            })?;
        self.engage_with(cluster, Some((token, runtime)))
    }

    fn engage_with(
        &self,
        cluster: Cluster<C>,
        until: Option<(CancellationToken, tokio::runtime::Handle)>,
    ) -> Result<Engaged, EngageError> {
        let mut state = self.state();
        if state.closed {
            return Err(EngageError::Stopped {
                cluster: cluster.id().to_string(),
            });
        }
        if state.local.as_ref() == Some(cluster.id()) {
            return Err(EngageError::LocalId {
                cluster: cluster.id().to_string(),
            });
        }
        let fleet = Arc::downgrade(&self.inner);
        let Some(shard) = &mut state.shard else {
            return Ok(state.admit(&fleet, cluster, until));
        };
        // Sharded: the cluster is discovered; it joins only where this replica owns it.
        if let Some(known) = shard.discovered.get(cluster.id())
            && !known.cluster.differs_from(&cluster)
        {
            return Ok(Engaged::Unchanged);
        }
        let until = until.map(|(token, runtime)| {
            let instance = cluster.clone();
            AbortOnDrop(runtime.spawn(async move {
                token.cancelled().await;
                forget_instance(&fleet, &instance);
            }))
        });
        let id = cluster.id().clone();
        let known = Discovered {
            cluster: cluster.clone(),
            _until: until,
        };
        let outcome = match shard.discovered.insert(id.clone(), known) {
            Some(_) => Engaged::Replaced,
            None => Engaged::New,
        };
        shard.changed.notify_one();
        let owned = shard.owned.contains(&id);
        state.paused.remove(&id);
        if owned {
            state.admit(&Weak::new(), cluster, None);
        } else {
            tracing::debug!(cluster = %id, ?outcome, "cluster discovered (not owned by this replica)");
        }
        Ok(outcome)
    }

    /// Disengages the cluster with this id for good: its provider's source of it is gone
    /// (its Secret, file, profile or object deleted). Its watches stop, controllers drop its
    /// queued requests, reconciles in flight see [`Cluster::disengaged`] complete, and what
    /// the fleet keeps in it is removed (the webhook configurations). A paused cluster
    /// leaves for good the same way. Returns whether it was engaged.
    ///
    /// A cluster that is only unhealthy, not ready, unreachable or contested is
    /// [paused](Fleet::pause) instead.
    pub fn disengage(&self, id: &C) -> bool {
        let mut state = self.state();
        if let Some(shard) = &mut state.shard {
            let known = shard.discovered.remove(id).is_some();
            if known {
                shard.changed.notify_one();
            }
            state.remove(id, Leaving::ForGood);
            return known;
        }
        state.remove(id, Leaving::ForGood)
    }

    /// Disengages the cluster with this id for now, not for good: it is unhealthy, not
    /// ready, its credentials were taken away, or its id is contested. Its work stops as
    /// with [`Fleet::disengage`], but it stays of the fleet: the webhook server keeps
    /// answering its reviews by the hooks, and its webhook configurations stay, so that
    /// nobody turns a member's admission off by making it look unwell. Engaging the id again
    /// resumes it; [`Fleet::disengage`] ends it for good. Returns whether it was engaged.
    pub fn pause(&self, id: &C) -> bool {
        let mut state = self.state();
        let discovered = match &mut state.shard {
            Some(shard) => {
                let Some(known) = shard.discovered.remove(id) else {
                    return false;
                };
                shard.changed.notify_one();
                Some(known.cluster)
            }
            None => None,
        };
        let engaged = state.remove(id, Leaving::Paused);
        match discovered {
            Some(cluster) => {
                state.paused.insert(id.clone(), cluster);
                true
            }
            None => engaged,
        }
    }

    /// The paused cluster with this id ([`Fleet::pause`]).
    pub fn paused(&self, id: &C) -> Option<Cluster<C>> {
        self.state().paused.get(id).cloned()
    }

    /// The ids of the paused clusters, in order.
    pub(crate) fn paused_ids(&self) -> Vec<C> {
        self.state().paused.keys().cloned().collect()
    }

    /// Whether `id` is of the fleet: engaged (here or, with sharding, on another replica)
    /// or paused.
    pub(crate) fn holds(&self, id: &C) -> bool {
        let state = self.state();
        state.paused.contains_key(id)
            || match &state.shard {
                Some(shard) => shard.discovered.contains_key(id),
                None => state.members.contains_key(id),
            }
    }

    /// Disengages `cluster` for good if it is the one engaged (or paused) under its id (not
    /// a cluster engaged under the same id since). Returns whether it was.
    pub(crate) fn disengage_instance(&self, cluster: &Cluster<C>) -> bool {
        let mut state = self.state();
        if state.shard.is_some() {
            return state.forget(cluster) || state.depart_paused(cluster);
        }
        let ours = state
            .members
            .get(cluster.id())
            .is_some_and(|m| m.engagement.cluster.same_instance(cluster));
        if ours {
            return state.remove(cluster.id(), Leaving::ForGood);
        }
        state.depart_paused(cluster)
    }

    /// Pauses `cluster` ([`Fleet::pause`]) if it is the one engaged under its id. Returns
    /// whether it was.
    pub(crate) fn pause_instance(&self, cluster: &Cluster<C>) -> bool {
        let ours = {
            let state = self.state();
            match &state.shard {
                Some(shard) => shard
                    .discovered
                    .get(cluster.id())
                    .is_some_and(|d| d.cluster.same_instance(cluster)),
                None => state
                    .members
                    .get(cluster.id())
                    .is_some_and(|m| m.engagement.cluster.same_instance(cluster)),
            }
        };
        // Nothing else engages under the id between the check and the pause: a provider's
        // changes come from its one task.
        ours && self.pause(cluster.id())
    }

    /// Any cluster the provider engaged, whether this replica owns it or not: with
    /// [`Manager::sharding`](crate::Manager::sharding), the way to reach a cluster another
    /// replica owns. Its client works (requests go straight to its API server); it has no
    /// caches here unless this replica owns it ([`Cluster::cache`] says `NotEngaged`), and
    /// no controller reconciles it here. Without sharding, the same as [`Fleet::get`].
    pub fn discovered(&self, id: &C) -> Option<Cluster<C>> {
        let state = self.state();
        match &state.shard {
            Some(shard) => shard.discovered.get(id).map(|d| d.cluster.clone()),
            None => state.members.get(id).map(|m| m.engagement.cluster.clone()),
        }
    }

    /// The ids of every cluster the provider engaged, owned here or not, in order (see
    /// [`Fleet::discovered`]); without sharding, the same as [`Fleet::ids`].
    pub fn discovered_ids(&self) -> Vec<C> {
        let state = self.state();
        match &state.shard {
            Some(shard) => shard.discovered.keys().cloned().collect(),
            None => state.members.keys().cloned().collect(),
        }
    }

    /// Told whenever the discovered clusters change (sharded fleets).
    pub(crate) fn discovery_changes(&self) -> Option<Arc<tokio::sync::Notify>> {
        self.state().shard.as_ref().map(|s| s.changed.clone())
    }

    /// This replica now owns `id` (it holds the fence): the cluster joins if it was
    /// discovered, and any cluster engaged under the id later joins too. Returns whether it
    /// joined now.
    pub(crate) fn own(&self, id: &C) -> bool {
        let mut state = self.state();
        let Some(shard) = &mut state.shard else {
            return false;
        };
        shard.owned.insert(id.clone());
        let Some(cluster) = shard.discovered.get(id).map(|d| d.cluster.clone()) else {
            return false;
        };
        state.admit(&Weak::new(), cluster, None);
        true
    }

    /// This replica gives `id` up: the cluster leaves (if it was a member) and the
    /// engagements it had since it was owned are returned, to wait for their work.
    pub(crate) fn disown(&self, id: &C) -> Vec<Arc<Session>> {
        let mut state = self.state();
        let Some(shard) = &mut state.shard else {
            return Vec::new();
        };
        shard.owned.remove(id);
        let sessions = shard.sessions.remove(id).unwrap_or_default();
        state.remove(id, Leaving::Away);
        sessions.iter().filter_map(Weak::upgrade).collect()
    }

    /// The engaged cluster with this id.
    pub fn get(&self, id: &C) -> Option<Cluster<C>> {
        let state = self.state();
        state.members.get(id).map(|m| m.engagement.cluster.clone())
    }

    /// Every engaged cluster, ordered by id.
    pub fn clusters(&self) -> Vec<Cluster<C>> {
        self.state().clusters()
    }

    /// The ids of every engaged cluster, in order.
    pub fn ids(&self) -> Vec<C> {
        self.state().members.keys().cloned().collect()
    }

    /// How many clusters are engaged.
    pub fn len(&self) -> usize {
        self.state().members.len()
    }

    /// Whether no cluster is engaged.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Registers a field index on `K` objects for every engaged cluster and every cluster
    /// engaged later: `extract` gives the values an object is filed under, and
    /// [`Cache::indexed`](crate::Cache::indexed) finds the cached objects filed under a value.
    /// An index of the same kind and name is registered once. An extractor that panics stops
    /// the watch it runs in, and with it the manager (with an error naming the cluster).
    ///
    /// ```
    /// # use multicluster_runtime::{ClusterName, Fleet};
    /// use k8s_openapi::api::core::v1::ConfigMap;
    /// let fleet = Fleet::<ClusterName>::new();
    /// fleet.index_field::<ConfigMap>("type", |cm| {
    ///     cm.metadata.labels.iter().flatten().filter(|(k, _)| *k == "type").map(|(_, v)| v.clone()).collect()
    /// });
    /// ```
    pub fn index_field<K: Watchable>(
        &self,
        name: &str,
        extract: impl Fn(&K) -> Vec<String> + Send + Sync + 'static,
    ) where
        // Indexes are kept by Rust type: one for `DynamicObject` would run on every kind a
        // `DynamicObject` stands for.
        K::DynamicType: Default,
    {
        let indexer = Indexer::new::<K>(name, extract);
        let clusters = {
            let mut state = self.state();
            if state.indexers.iter().any(|i| i.same_as(&indexer)) {
                return;
            }
            // Registered first: a cluster engaged from now on gets it in `engage`.
            state.indexers.push(indexer.clone());
            state.clusters()
        };
        // Filling the index runs the user's extractor over every cached object: not under
        // the fleet's lock. A cluster that got it in `engage` too ignores the second call.
        for cluster in clusters {
            cluster.add_indexer(&indexer);
        }
    }

    /// Disengages every cluster.
    pub fn clear(&self) {
        let mut state = self.state();
        if let Some(shard) = &mut state.shard {
            shard.discovered.clear();
            shard.changed.notify_one();
        }
        let mut ids: Vec<C> = state.members.keys().cloned().collect();
        ids.extend(state.paused.keys().cloned());
        for id in ids {
            state.remove(&id, Leaving::ForGood);
        }
    }

    /// Changes from now on, starting with an [`FleetEvent::Engaged`] for every cluster
    /// already engaged.
    pub(crate) fn subscribe(&self) -> mpsc::UnboundedReceiver<FleetEvent<C>> {
        let (tx, rx) = mpsc::unbounded_channel();
        let mut state = self.state();
        for member in state.members.values() {
            let _ = tx.send(FleetEvent::Engaged(member.engagement.clone()));
        }
        state.subscribers.push(tx);
        rx
    }

    /// Every change of the fleet from now on, starting with an `Engaged` for each cluster
    /// engaged now: for components that run per-cluster work (Go's `multicluster.Aware`).
    /// [`Manager::per_cluster`](crate::Manager::per_cluster) runs a task per engagement
    /// with it. On a sharded manager, prefer that: a hand-off waits for its tasks (and
    /// drops them at the hand-off timeout), while work started from these events is only
    /// told through `until`. The stream ends when the run of the manager that owns the
    /// fleet ends (after the disengagement of each cluster it had).
    ///
    /// ```no_run
    /// # use futures::StreamExt;
    /// # use multicluster_runtime::{ClusterEvent, ClusterName, Fleet};
    /// # async fn f(fleet: Fleet<ClusterName>) {
    /// let mut events = fleet.events();
    /// while let Some(event) = events.next().await {
    ///     if let ClusterEvent::Engaged { cluster, until } = event {
    ///         tokio::spawn(async move {
    ///             // ... per-cluster work with cluster.client() ...
    ///             until.cancelled().await;
    ///         });
    ///     }
    /// }
    /// # }
    /// ```
    pub fn events(&self) -> ClusterEvents<C> {
        ClusterEvents {
            rx: self.subscribe(),
        }
    }

    /// Every engagement from now on (those engaged now first, then each new or replacing
    /// one); an engagement's end shows in its session token.
    pub(crate) fn engagements(
        &self,
    ) -> impl futures::Stream<Item = Engagement<C>> + Send + 'static + use<C> {
        use futures::StreamExt;
        let mut events = self.subscribe();
        futures::stream::poll_fn(move |cx| events.poll_recv(cx)).filter_map(|event| {
            std::future::ready(match event {
                FleetEvent::Engaged(e) | FleetEvent::Replaced { new: e, .. } => Some(e),
                FleetEvent::Disengaged(_) | FleetEvent::Departed(_) => None,
            })
        })
    }

    /// How its clusters' watches retry (the running manager's setting).
    pub(crate) fn watch_backoff(&self) -> crate::cache::WatchBackoff {
        self.state().settings.backoff.clone()
    }

    /// An identity of this fleet (shared by its clones).
    pub(crate) fn key(&self) -> usize {
        Arc::as_ptr(&self.inner) as usize
    }

    /// Opens the fleet for a manager's run, with the settings its clusters' watches get and
    /// the id of its local cluster (which no fleet cluster may have).
    pub(crate) fn open(&self, settings: WatchSettings, sharded: bool, local: Option<C>) {
        let mut state = self.state();
        state.closed = false;
        state.local = local;
        state.settings = settings;
        state.shard = sharded.then(|| Shard {
            discovered: BTreeMap::new(),
            owned: std::collections::BTreeSet::new(),
            sessions: std::collections::HashMap::new(),
            changed: Arc::new(tokio::sync::Notify::new()),
        });
    }

    /// Ends a manager's run: disengages every cluster, refuses engagements until the next
    /// [`Fleet::open`], and waits until every watch task of the engagements it ended is gone.
    pub(crate) async fn close(&self) {
        for session in self.close_now() {
            session.stopped().await;
        }
    }

    /// Whether the fleet is closed (between runs).
    #[cfg(test)]
    pub(crate) fn is_closed(&self) -> bool {
        self.state().closed
    }

    /// [`Fleet::close`] without waiting (a run dropped before it returned): returns the
    /// engagements it ended.
    pub(crate) fn close_now(&self) -> Vec<Arc<Session>> {
        let mut state = self.state();
        state.closed = true;
        state.settings.faults = None;
        state.shard = None;
        state.paused.clear();
        let ids: Vec<C> = state.members.keys().cloned().collect();
        for id in ids {
            state.remove(&id, Leaving::Away);
        }
        // Their disengagements told, the subscribers' streams end with the run
        // (`FleetApi::watch`, `Fleet::events`).
        state.subscribers.clear();
        std::mem::take(&mut state.ended)
    }
}

/// Disengages `engagement` if it is still the one engaged under its id.
fn disengage_instance<C: ClusterId>(fleet: &Weak<Mutex<State<C>>>, engagement: &Engagement<C>) {
    let Some(inner) = fleet.upgrade() else {
        return;
    };
    let mut state = lock(&inner);
    if state
        .members
        .get(engagement.id())
        .is_some_and(|m| m.engagement.same(engagement))
    {
        state.remove(engagement.id(), Leaving::ForGood);
    }
}

/// Forgets `cluster` if it is still the one discovered under its id (sharded fleets).
fn forget_instance<C: ClusterId>(fleet: &Weak<Mutex<State<C>>>, cluster: &Cluster<C>) {
    if let Some(inner) = fleet.upgrade() {
        lock(&inner).forget(cluster);
    }
}

impl<C: ClusterId> State<C> {
    /// Makes `cluster` a member: engaged, or replacing the member of its id. `fleet` is the
    /// fleet itself, for the task watching `until`.
    fn admit(
        &mut self,
        fleet: &Weak<Mutex<State<C>>>,
        cluster: Cluster<C>,
        until: Option<(CancellationToken, tokio::runtime::Handle)>,
    ) -> Engaged {
        if let Some(member) = self.members.get(cluster.id())
            && !member.engagement.cluster.differs_from(&cluster)
        {
            return Engaged::Unchanged;
        }
        self.paused.remove(cluster.id());
        // Indexes first, so no controller sees the cluster without them.
        for indexer in &self.indexers {
            cluster.add_indexer(indexer);
        }
        let engagement = cluster.attach(&self.settings);
        let until = until.map(|(token, runtime)| {
            let fleet = fleet.clone();
            let engaged = engagement.clone();
            AbortOnDrop(runtime.spawn(async move {
                tokio::select! {
                    () = token.cancelled() => disengage_instance(&fleet, &engaged),
                    () = engaged.session.token().cancelled() => {}
                }
            }))
        });
        if let Some(shard) = &mut self.shard {
            let sessions = shard.sessions.entry(cluster.id().clone()).or_default();
            sessions.retain(|s| s.strong_count() > 0);
            sessions.push(Arc::downgrade(&engagement.session));
        }
        let member = Member {
            engagement: engagement.clone(),
            _until: until,
        };
        let outcome = match self.members.insert(cluster.id().clone(), member) {
            Some(old) => {
                let old = self.end(old);
                self.broadcast(FleetEvent::Replaced {
                    old,
                    new: engagement,
                });
                Engaged::Replaced
            }
            None => {
                self.broadcast(FleetEvent::Engaged(engagement));
                Engaged::New
            }
        };
        tracing::info!(cluster = %cluster.id(), ?outcome, "cluster engaged");
        outcome
    }

    /// Sharded: forgets `cluster` if it is the one discovered under its id (and ends its
    /// membership). Returns whether it was.
    fn forget(&mut self, cluster: &Cluster<C>) -> bool {
        let Some(shard) = &mut self.shard else {
            return false;
        };
        let ours = shard
            .discovered
            .get(cluster.id())
            .is_some_and(|d| d.cluster.same_instance(cluster));
        if ours {
            shard.discovered.remove(cluster.id());
            shard.changed.notify_one();
            self.remove(cluster.id(), Leaving::ForGood);
        }
        ours
    }

    /// Ends `cluster` for good if it is the one paused under its id. Returns whether it was.
    fn depart_paused(&mut self, cluster: &Cluster<C>) -> bool {
        let ours = self
            .paused
            .get(cluster.id())
            .is_some_and(|p| p.same_instance(cluster));
        if ours {
            self.remove(cluster.id(), Leaving::ForGood);
        }
        ours
    }

    fn clusters(&self) -> Vec<Cluster<C>> {
        self.members
            .values()
            .map(|m| m.engagement.cluster.clone())
            .collect()
    }

    /// Ends the membership of `id` (returns whether it was a member), and `leaving` says
    /// what that is: for good (a paused cluster of that id leaves too), a pause, or neither.
    fn remove(&mut self, id: &C, leaving: Leaving) -> bool {
        let Some(member) = self.members.remove(id) else {
            if leaving == Leaving::ForGood
                && let Some(cluster) = self.paused.remove(id)
            {
                self.broadcast(FleetEvent::Departed(cluster));
                tracing::info!(cluster = %id, "paused cluster left for good");
            }
            return false;
        };
        let engagement = self.end(member);
        let cluster = engagement.cluster.clone();
        self.broadcast(FleetEvent::Disengaged(engagement));
        match leaving {
            Leaving::ForGood => {
                self.paused.remove(id);
                self.broadcast(FleetEvent::Departed(cluster));
                tracing::info!(cluster = %id, "cluster disengaged for good");
            }
            Leaving::Paused => {
                self.paused.insert(id.clone(), cluster);
                tracing::info!(cluster = %id, "cluster paused");
            }
            Leaving::Away => tracing::info!(cluster = %id, "cluster disengaged"),
        }
        true
    }

    /// Lets go of a member's cluster, keeping its engagement to await if it ended here.
    fn end(&mut self, member: Member<C>) -> Engagement<C> {
        if let Some(session) = member.engagement.cluster.detach() {
            self.ended.retain(|s| s.is_winding_down());
            self.ended.push(session);
        }
        member.engagement
    }

    fn broadcast(&mut self, event: FleetEvent<C>) {
        self.subscribers.retain(|tx| tx.send(event.clone()).is_ok());
        if let Some(metrics) = &self.settings.metrics {
            metrics.engaged_clusters(self.members.len());
        }
    }
}

/// A read-only view of a fleet, for reconcilers: which clusters are engaged, without the
/// power to change that.
///
/// ```compile_fail
/// # use multicluster_runtime::{ClusterName, Context};
/// fn reconcile(ctx: &Context<ClusterName, ()>) {
///     // Only providers engage and disengage clusters.
///     ctx.fleet().disengage(&ClusterName::from("other"));
/// }
/// ```
pub struct FleetView<C: ClusterId> {
    fleet: Fleet<C>,
}

impl<C: ClusterId> Clone for FleetView<C> {
    fn clone(&self) -> Self {
        Self {
            fleet: self.fleet.clone(),
        }
    }
}

impl<C: ClusterId> fmt::Debug for FleetView<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.fleet.fmt(f)
    }
}

impl<C: ClusterId> FleetView<C> {
    /// The fleet behind the view.
    pub(crate) fn fleet(&self) -> &Fleet<C> {
        &self.fleet
    }

    /// The fleet's changes from now on; see [`Fleet::events`].
    pub fn events(&self) -> ClusterEvents<C> {
        self.fleet.events()
    }

    pub(crate) fn new(fleet: Fleet<C>) -> Self {
        Self { fleet }
    }

    /// The engaged cluster with this id.
    pub fn get(&self, id: &C) -> Option<Cluster<C>> {
        self.fleet.get(id)
    }

    /// Any cluster the provider engaged, owned by this replica or not; see
    /// [`Fleet::discovered`]. For reads of clusters another replica owns: never cached here,
    /// never reconciled here.
    pub fn discovered(&self, id: &C) -> Option<Cluster<C>> {
        self.fleet.discovered(id)
    }

    /// The ids of every cluster the provider engaged; see [`Fleet::discovered_ids`].
    pub fn discovered_ids(&self) -> Vec<C> {
        self.fleet.discovered_ids()
    }

    /// Every engaged cluster, ordered by id.
    pub fn clusters(&self) -> Vec<Cluster<C>> {
        self.fleet.clusters()
    }

    /// The ids of every engaged cluster, in order.
    pub fn ids(&self) -> Vec<C> {
        self.fleet.ids()
    }

    /// How many clusters are engaged.
    pub fn len(&self) -> usize {
        self.fleet.len()
    }

    /// Whether no cluster is engaged.
    pub fn is_empty(&self) -> bool {
        self.fleet.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::ClusterName;

    /// A cluster at `url`; nothing connects to it unless something watches.
    fn cluster(name: &str, url: &str) -> Cluster<ClusterName> {
        Cluster::from_config(
            ClusterName::from(name),
            kube::Config::new(url.parse().unwrap()),
        )
        .unwrap()
    }

    fn kinds(rx: &mut mpsc::UnboundedReceiver<FleetEvent<ClusterName>>) -> Vec<String> {
        std::iter::from_fn(|| rx.try_recv().ok())
            .map(|e| match e {
                FleetEvent::Engaged(c) => format!("+{}", c.id()),
                FleetEvent::Replaced { new, .. } => format!("~{}", new.id()),
                FleetEvent::Disengaged(c) => format!("-{}", c.id()),
                FleetEvent::Departed(c) => format!("x{}", c.id()),
            })
            .collect()
    }

    #[tokio::test]
    async fn engagement_outcomes_follow_endpoint_and_credentials() {
        let fleet = Fleet::new();
        let a = cluster("a", "https://127.0.0.1:1");
        assert!(!a.is_engaged(), "a new handle is not engaged");
        assert_eq!(fleet.engage(a.clone()).unwrap(), Engaged::New);
        assert!(a.is_engaged());
        assert_eq!(
            fleet.engage(a.clone()).unwrap(),
            Engaged::Unchanged,
            "same instance"
        );
        let equal = cluster("a", "https://127.0.0.1:1");
        assert_eq!(fleet.engage(equal.clone()).unwrap(), Engaged::Unchanged);
        assert!(!equal.is_engaged(), "the equal handle was not engaged");
        let mut elsewhere = kube::Config::new("https://127.0.0.1:1".parse().unwrap());
        elsewhere.default_namespace = "other".into();
        let other_namespace = Cluster::from_config(ClusterName::from("a"), elsewhere).unwrap();
        assert_eq!(
            fleet.engage(other_namespace.clone()).unwrap(),
            Engaged::Replaced,
            "the default namespace is part of where requests go"
        );
        let moved = cluster("a", "https://127.0.0.1:2");
        assert_eq!(fleet.engage(moved.clone()).unwrap(), Engaged::Replaced);
        assert!(!a.is_engaged() && !other_namespace.is_engaged());
        assert!(
            fleet
                .get(&ClusterName::from("a"))
                .unwrap()
                .same_instance(&moved)
        );
        assert_eq!(
            fleet.engage(a.clone()).unwrap(),
            Engaged::Replaced,
            "a disengaged cluster can come back"
        );
        assert!(a.is_engaged());
    }

    #[tokio::test]
    async fn late_subscribers_first_hear_of_every_engaged_cluster() {
        let fleet = Fleet::new();
        fleet.engage(cluster("a", "https://127.0.0.1:1")).unwrap();
        fleet.engage(cluster("b", "https://127.0.0.1:2")).unwrap();
        let mut rx = fleet.subscribe();
        fleet.engage(cluster("b", "https://127.0.0.1:3")).unwrap();
        assert!(fleet.disengage(&ClusterName::from("a")));
        assert!(!fleet.disengage(&ClusterName::from("a")));
        assert_eq!(kinds(&mut rx), ["+a", "+b", "~b", "-a", "xa"]);
    }

    #[test]
    fn no_cluster_is_engaged_under_the_local_clusters_id() {
        let fleet = Fleet::new();
        fleet.open(
            WatchSettings::default(),
            false,
            Some(ClusterName::from("host")),
        );
        let error = fleet
            .engage(cluster("host", "https://127.0.0.1:1"))
            .unwrap_err();
        assert!(matches!(error, EngageError::LocalId { .. }), "{error}");
        assert!(fleet.is_empty());
        fleet
            .engage(cluster("east", "https://127.0.0.1:1"))
            .unwrap();
        // Sharded too.
        let sharded = Fleet::new();
        sharded.open(
            WatchSettings::default(),
            true,
            Some(ClusterName::from("host")),
        );
        assert!(
            sharded
                .engage(cluster("host", "https://127.0.0.1:1"))
                .is_err()
        );
        assert!(sharded.discovered_ids().is_empty());
    }

    #[tokio::test]
    async fn a_paused_cluster_stays_of_the_fleet_until_it_is_engaged_again_or_leaves_for_good() {
        let fleet = Fleet::new();
        let a = cluster("a", "https://127.0.0.1:1");
        fleet.engage(a.clone()).unwrap();
        let mut rx = fleet.subscribe();
        let id = ClusterName::from("a");
        // Paused: its work stops, but it is held, and nothing says it left for good.
        assert!(fleet.pause(&id));
        assert!(fleet.get(&id).is_none() && fleet.paused(&id).is_some() && fleet.holds(&id));
        assert!(!fleet.pause(&id), "paused once");
        assert_eq!(kinds(&mut rx), ["+a", "-a"]);
        // Engaged again: no longer paused.
        let again = cluster("a", "https://127.0.0.1:2");
        fleet.engage(again.clone()).unwrap();
        assert!(fleet.paused(&id).is_none() && fleet.holds(&id));
        // Paused again, then its source is gone: it leaves for good, with no second
        // `Disengaged`.
        assert!(fleet.pause_instance(&again));
        assert!(!fleet.disengage_instance(&a), "another instance");
        assert!(fleet.paused(&id).is_some());
        assert!(fleet.disengage_instance(&again));
        assert!(!fleet.holds(&id));
        assert_eq!(kinds(&mut rx), ["+a", "-a", "xa"]);
        // An engaged cluster disengaged: both events, in order.
        fleet.engage(cluster("b", "https://127.0.0.1:3")).unwrap();
        fleet.disengage(&ClusterName::from("b"));
        assert_eq!(kinds(&mut rx), ["+b", "-b", "xb"]);
        // The end of a run is neither.
        fleet.engage(cluster("c", "https://127.0.0.1:4")).unwrap();
        fleet.pause(&ClusterName::from("c"));
        fleet.engage(cluster("d", "https://127.0.0.1:5")).unwrap();
        fleet.close_now();
        assert!(!fleet.holds(&ClusterName::from("c")));
        assert_eq!(kinds(&mut rx), ["+c", "-c", "+d", "-d"]);
    }

    #[tokio::test]
    async fn cancelling_the_engagement_token_disengages_only_that_instance() {
        let fleet = Fleet::new();
        let token = CancellationToken::new();
        let first = cluster("a", "https://127.0.0.1:1");
        fleet.engage_until(first.clone(), token.clone()).unwrap();
        // Replaced by another instance: the old token no longer speaks for the id.
        let second = cluster("a", "https://127.0.0.1:2");
        let second_token = CancellationToken::new();
        fleet
            .engage_until(second.clone(), second_token.clone())
            .unwrap();
        token.cancel();
        tokio::task::yield_now().await;
        assert!(second.is_engaged() && fleet.len() == 1);
        second_token.cancel();
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        assert!(fleet.is_empty() && !second.is_engaged());
    }

    #[tokio::test]
    async fn an_unchanged_engagement_spawns_no_waiter() {
        let fleet = Fleet::new();
        let token = CancellationToken::new();
        let a = cluster("a", "https://127.0.0.1:1");
        let metrics = tokio::runtime::Handle::current().metrics();
        fleet.engage_until(a.clone(), token.clone()).unwrap();
        let after_first = metrics.num_alive_tasks();
        for _ in 0..100 {
            assert_eq!(
                fleet.engage_until(a.clone(), token.clone()).unwrap(),
                Engaged::Unchanged
            );
        }
        assert_eq!(metrics.num_alive_tasks(), after_first);
        // Disengaging aborts the waiter.
        fleet.disengage(&ClusterName::from("a"));
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        assert_eq!(metrics.num_alive_tasks(), after_first - 1);
    }

    #[test]
    fn engage_until_outside_a_runtime_is_an_error_not_a_panic() {
        let fleet = Fleet::new();
        let a = Cluster::new(
            ClusterName::from("a"),
            // A client needs a runtime only once it sends something.
            tokio::runtime::Runtime::new().unwrap().block_on(async {
                kube::Client::try_from(kube::Config::new("https://127.0.0.1:1".parse().unwrap()))
                    .unwrap()
            }),
        );
        assert!(matches!(
            fleet.engage_until(a, CancellationToken::new()),
            Err(EngageError::NoRuntime { .. })
        ));
    }

    #[test]
    fn caches_outside_a_runtime_are_an_error_not_a_panic() {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let fleet = Fleet::new();
        let a = runtime.block_on(async {
            let a = cluster("a", "https://127.0.0.1:1");
            fleet.engage(a.clone()).unwrap();
            a
        });
        let store = a.store::<k8s_openapi::api::core::v1::ConfigMap>(&Default::default());
        assert!(
            matches!(store, Err(crate::cache::CacheError::NoRuntime { ref cluster }) if cluster == "a"),
            "{store:?}"
        );
        let never = runtime.block_on(async {
            let never = cluster("b", "https://127.0.0.1:1");
            never
                .cache::<k8s_openapi::api::core::v1::ConfigMap>(&Default::default())
                .await
        });
        assert!(matches!(
            never,
            Err(crate::cache::CacheError::NotEngaged { .. })
        ));
    }

    #[tokio::test]
    async fn a_sharded_fleet_makes_members_of_the_discovered_clusters_it_owns_only() {
        let fleet = Fleet::new();
        fleet.open(WatchSettings::default(), true, None);
        let mut rx = fleet.subscribe();
        let id = ClusterName::from;
        let a = cluster("a", "https://127.0.0.1:1");
        assert_eq!(fleet.engage(a.clone()).unwrap(), Engaged::New);
        assert_eq!(
            fleet.engage(cluster("b", "https://127.0.0.1:2")).unwrap(),
            Engaged::New
        );
        assert_eq!(
            fleet.engage(cluster("b", "https://127.0.0.1:2")).unwrap(),
            Engaged::Unchanged
        );
        // Discovered, reachable for reads, not members: nothing engaged, nothing told.
        assert!(fleet.is_empty() && !a.is_engaged());
        assert_eq!(fleet.discovered_ids(), [id("a"), id("b")]);
        assert!(fleet.discovered(&id("a")).unwrap().same_instance(&a));
        assert!(kinds(&mut rx).is_empty());
        // Owned: a member.
        assert!(fleet.own(&id("a")));
        assert!(a.is_engaged() && fleet.ids() == [id("a")]);
        // Replaced by its provider while owned: the member is replaced too.
        let moved = cluster("a", "https://127.0.0.1:3");
        assert_eq!(fleet.engage(moved.clone()).unwrap(), Engaged::Replaced);
        assert!(moved.is_engaged() && !a.is_engaged());
        // Owned before it is discovered: a member once it is.
        assert!(!fleet.own(&id("c")));
        fleet.engage(cluster("c", "https://127.0.0.1:4")).unwrap();
        assert_eq!(fleet.ids(), [id("a"), id("c")]);
        // Given up: no longer a member, still discovered; its engagements are handed back,
        // ended, and take no new work.
        let sessions = fleet.disown(&id("a"));
        assert!(!sessions.is_empty());
        assert!(
            sessions
                .iter()
                .all(|s| !s.is_active() && s.busy().is_none())
        );
        assert_eq!(fleet.ids(), [id("c")]);
        assert!(fleet.discovered(&id("a")).unwrap().same_instance(&moved));
        // The provider forgets one: gone from both.
        assert!(fleet.disengage(&id("c")));
        assert!(fleet.is_empty());
        assert_eq!(fleet.discovered_ids(), [id("a"), id("b")]);
        // Handed off: no departure; forgotten: one.
        assert_eq!(kinds(&mut rx), ["+a", "~a", "+c", "-a", "-c", "xc"]);
    }

    #[tokio::test]
    async fn a_hand_off_waits_until_the_work_on_an_engagement_has_ended() {
        let fleet = Fleet::new();
        fleet.open(WatchSettings::default(), true, None);
        let a = ClusterName::from("a");
        fleet.engage(cluster("a", "https://127.0.0.1:1")).unwrap();
        fleet.own(&a);
        let engagement = fleet.get(&a).unwrap().engagement().unwrap();
        let work = engagement.session.busy().unwrap();
        let sessions = fleet.disown(&a);
        let idle = sessions[0].idle();
        tokio::pin!(idle);
        assert!(
            futures::poll!(idle.as_mut()).is_pending(),
            "work still runs"
        );
        assert!(!sessions[0].aborted().is_cancelled());
        drop(work);
        assert!(futures::poll!(idle.as_mut()).is_ready());
        // Aborting tells work to stop at once.
        sessions[0].abort();
        assert!(sessions[0].aborted().is_cancelled());
    }

    #[tokio::test]
    async fn a_closed_fleet_refuses_clusters_until_it_is_opened_again() {
        let fleet = Fleet::new();
        let a = cluster("a", "https://127.0.0.1:1");
        fleet.engage(a.clone()).unwrap();
        fleet.close().await;
        assert!(fleet.is_empty() && !a.is_engaged());
        assert!(matches!(
            fleet.engage(a.clone()),
            Err(EngageError::Stopped { .. })
        ));
        fleet.open(WatchSettings::default(), false, None);
        assert_eq!(fleet.engage(a.clone()).unwrap(), Engaged::New);
        assert!(a.is_engaged());
    }
}
