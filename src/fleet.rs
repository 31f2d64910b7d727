//! [`Fleet`]: the set of engaged clusters, which providers change and controllers follow.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::index::Indexer;
use crate::{Cluster, ClusterId, Watchable};

/// The clusters currently engaged, shared by a manager, its provider and its controllers.
///
/// Providers call [`Fleet::engage`] and [`Fleet::disengage`]; every controller is told about
/// each change, including controllers that start after clusters were engaged (they first
/// receive every cluster already engaged; Go's multicluster-runtime misses those).
pub struct Fleet<C: ClusterId> {
    inner: Arc<Mutex<State<C>>>,
}

struct State<C: ClusterId> {
    clusters: BTreeMap<C, Cluster<C>>,
    subscribers: Vec<mpsc::UnboundedSender<FleetEvent<C>>>,
    /// Field indexes every cluster gets, including clusters engaged later.
    indexers: Vec<Indexer>,
}

/// A change of the fleet, as a controller sees it.
#[derive(Debug)]
pub(crate) enum FleetEvent<C: ClusterId> {
    /// A cluster joined.
    Engaged(Cluster<C>),
    /// A cluster was engaged again with another endpoint or credentials: `old` is
    /// disengaged, `new` takes its place under the same id.
    Replaced { old: Cluster<C>, new: Cluster<C> },
    /// A cluster left.
    Disengaged(Cluster<C>),
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
        }
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
    /// changed and the given cluster was dropped.
    Unchanged,
}

/// [`Fleet::engage`] was given a cluster that had already been disengaged.
#[derive(Debug, thiserror::Error)]
#[error("cluster {0} was disengaged before; build a new Cluster to engage it again")]
pub struct EngageError(pub String);

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
                clusters: BTreeMap::new(),
                subscribers: Vec::new(),
                indexers: Vec::new(),
            })),
        }
    }
}

impl<C: ClusterId> fmt::Debug for Fleet<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_set().entries(self.state().clusters.keys()).finish()
    }
}

impl<C: ClusterId> Fleet<C> {
    /// An empty fleet.
    pub fn new() -> Self {
        Self::default()
    }

    fn state(&self) -> MutexGuard<'_, State<C>> {
        // The state stays consistent if a holder panicked: every mutation is one step.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Engages `cluster` under its id. An id engaged with the same instance, or with a
    /// configuration of the same endpoint and credentials, is left as it is; an id engaged
    /// with a different cluster is replaced (the old one is disengaged: its watches stop and
    /// new ones start, with queued requests kept).
    pub fn engage(&self, cluster: Cluster<C>) -> Result<Engaged, EngageError> {
        if !cluster.is_engaged() {
            return Err(EngageError(cluster.id().to_string()));
        }
        let mut state = self.state();
        let previous = state.clusters.get(cluster.id()).cloned();
        if let Some(old) = &previous
            && !old.differs_from(&cluster)
        {
            return Ok(Engaged::Unchanged);
        }
        // Indexes first, so no controller sees the cluster without them.
        for indexer in &state.indexers {
            cluster.add_indexer(indexer);
        }
        let outcome = match previous {
            Some(old) => {
                old.disengage();
                state.broadcast(FleetEvent::Replaced {
                    old,
                    new: cluster.clone(),
                });
                Engaged::Replaced
            }
            None => {
                state.broadcast(FleetEvent::Engaged(cluster.clone()));
                Engaged::New
            }
        };
        tracing::info!(cluster = %cluster.id(), ?outcome, "cluster engaged");
        state.clusters.insert(cluster.id().clone(), cluster);
        Ok(outcome)
    }

    /// Engages `cluster` for as long as `token` is not cancelled: cancelling it disengages
    /// the cluster (if it is still the one engaged under its id). This is the shape of Go's
    /// `Engage(ctx, ...)`, where the context's end is the removal signal.
    pub fn engage_until(
        &self,
        cluster: Cluster<C>,
        token: CancellationToken,
    ) -> Result<Engaged, EngageError> {
        let outcome = self.engage(cluster.clone())?;
        let engaged = match outcome {
            Engaged::Unchanged => self.get(cluster.id()).unwrap_or(cluster),
            _ => cluster,
        };
        let fleet = Arc::downgrade(&self.inner);
        tokio::spawn(async move {
            tokio::select! {
                () = token.cancelled() => {
                    if let Some(inner) = fleet.upgrade() {
                        Fleet { inner }.disengage_instance(&engaged);
                    }
                }
                () = engaged.disengaged() => {}
            }
        });
        Ok(outcome)
    }

    /// Disengages `cluster` if it is the instance engaged under its id.
    fn disengage_instance(&self, cluster: &Cluster<C>) -> bool {
        let mut state = self.state();
        if !state
            .clusters
            .get(cluster.id())
            .is_some_and(|c| c.same_instance(cluster))
        {
            return false;
        }
        state.remove(cluster.id())
    }

    /// Disengages the cluster with this id: its watches stop, controllers drop its queued
    /// requests, and reconciles in flight see [`Cluster::disengaged`] complete. Returns
    /// whether it was engaged.
    pub fn disengage(&self, id: &C) -> bool {
        self.state().remove(id)
    }

    /// The engaged cluster with this id.
    pub fn get(&self, id: &C) -> Option<Cluster<C>> {
        self.state().clusters.get(id).cloned()
    }

    /// Every engaged cluster, ordered by id.
    pub fn clusters(&self) -> Vec<Cluster<C>> {
        self.state().clusters.values().cloned().collect()
    }

    /// The ids of every engaged cluster, in order.
    pub fn ids(&self) -> Vec<C> {
        self.state().clusters.keys().cloned().collect()
    }

    /// How many clusters are engaged.
    pub fn len(&self) -> usize {
        self.state().clusters.len()
    }

    /// Whether no cluster is engaged.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Registers a field index on `K` objects for every engaged cluster and every cluster
    /// engaged later: `extract` gives the values an object is filed under, and
    /// [`Cluster::indexed`] finds the cached objects filed under a value. An index of the
    /// same kind and name is registered once.
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
    ) {
        let indexer = Indexer::new::<K>(name, extract);
        let clusters = {
            let mut state = self.state();
            if state.indexers.iter().any(|i| i.same_as(&indexer)) {
                return;
            }
            // Registered first: a cluster engaged from now on gets it in `engage`.
            state.indexers.push(indexer.clone());
            state.clusters.values().cloned().collect::<Vec<_>>()
        };
        // Filling the index runs the user's extractor over every cached object: not under
        // the fleet's lock. A cluster that got it in `engage` too ignores the second call.
        for cluster in clusters {
            cluster.add_indexer(&indexer);
        }
    }

    /// Disengages every cluster.
    pub fn clear(&self) {
        for id in self.ids() {
            self.disengage(&id);
        }
    }

    /// Changes from now on, starting with an [`FleetEvent::Engaged`] for every cluster
    /// already engaged.
    pub(crate) fn subscribe(&self) -> mpsc::UnboundedReceiver<FleetEvent<C>> {
        let (tx, rx) = mpsc::unbounded_channel();
        let mut state = self.state();
        for cluster in state.clusters.values() {
            let _ = tx.send(FleetEvent::Engaged(cluster.clone()));
        }
        state.subscribers.push(tx);
        rx
    }
}

impl<C: ClusterId> State<C> {
    fn remove(&mut self, id: &C) -> bool {
        let Some(cluster) = self.clusters.remove(id) else {
            return false;
        };
        cluster.disengage();
        self.broadcast(FleetEvent::Disengaged(cluster));
        tracing::info!(cluster = %id, "cluster disengaged");
        true
    }

    fn broadcast(&mut self, event: FleetEvent<C>) {
        self.subscribers.retain(|tx| tx.send(event.clone()).is_ok());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ClusterName;

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
            })
            .collect()
    }

    #[tokio::test]
    async fn engagement_outcomes_follow_endpoint_and_credentials() {
        let fleet = Fleet::new();
        let a = cluster("a", "https://127.0.0.1:1");
        assert_eq!(fleet.engage(a.clone()).unwrap(), Engaged::New);
        assert_eq!(
            fleet.engage(a.clone()).unwrap(),
            Engaged::Unchanged,
            "same instance"
        );
        assert_eq!(
            fleet.engage(cluster("a", "https://127.0.0.1:1")).unwrap(),
            Engaged::Unchanged,
            "same config"
        );
        let moved = cluster("a", "https://127.0.0.1:2");
        assert_eq!(fleet.engage(moved.clone()).unwrap(), Engaged::Replaced);
        assert!(!a.is_engaged(), "the replaced cluster is disengaged");
        assert!(
            fleet
                .get(&ClusterName::from("a"))
                .unwrap()
                .same_instance(&moved)
        );
        assert!(
            fleet.engage(a).is_err(),
            "a disengaged cluster cannot come back"
        );
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
        assert_eq!(kinds(&mut rx), ["+a", "+b", "~b", "-a"]);
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
}
