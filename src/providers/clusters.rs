//! [`Clusters`]: clusters added, replaced and removed by hand.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio_util::sync::CancellationToken;

use crate::cluster::{Cluster, ClusterId, ClusterName};
use crate::fleet::{EngageError, Engaged, Fleet};
use crate::provider::{Provider, ProviderError};

/// A provider whose clusters are added, replaced and removed by calls, for tests and for
/// code that discovers clusters itself. It is a cheap handle: keep a clone to change the
/// fleet while the manager runs.
///
/// Clusters added before the manager runs are engaged when it starts; later ones at once.
pub struct Clusters<C: ClusterId = ClusterName> {
    inner: Arc<Mutex<Inner<C>>>,
}

struct Inner<C: ClusterId> {
    /// What the user asked for, engaged or not yet.
    wanted: BTreeMap<C, Cluster<C>>,
    /// The fleet while the provider runs.
    fleet: Option<Fleet<C>>,
}

impl<C: ClusterId> Clone for Clusters<C> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
        }
    }
}

impl<C: ClusterId> Default for Clusters<C> {
    fn default() -> Self {
        Self {
            inner: Arc::new(Mutex::new(Inner {
                wanted: BTreeMap::new(),
                fleet: None,
            })),
        }
    }
}

impl<C: ClusterId> std::fmt::Debug for Clusters<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_set().entries(self.lock().wanted.keys()).finish()
    }
}

impl<C: ClusterId> Clusters<C> {
    /// No clusters yet.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, Inner<C>> {
        crate::util::sync::lock(&self.inner)
    }

    /// Adds `cluster`, or replaces the cluster of the same id if it reaches the cluster
    /// differently (see [`Fleet::engage`]).
    pub fn add(&self, cluster: Cluster<C>) -> Result<Engaged, EngageError> {
        let mut inner = self.lock();
        let outcome = match &inner.fleet {
            Some(fleet) => fleet.engage(cluster.clone())?,
            None => match inner.wanted.get(cluster.id()) {
                None => Engaged::New,
                Some(old) if old.differs_from(&cluster) => Engaged::Replaced,
                Some(_) => return Ok(Engaged::Unchanged),
            },
        };
        if outcome != Engaged::Unchanged {
            inner.wanted.insert(cluster.id().clone(), cluster);
        }
        Ok(outcome)
    }

    /// Removes the cluster with this id; returns whether there was one.
    pub fn remove(&self, id: &C) -> bool {
        let mut inner = self.lock();
        let existed = inner.wanted.remove(id).is_some();
        if let Some(fleet) = &inner.fleet {
            fleet.disengage(id);
        }
        existed
    }

    /// The ids of the clusters added and not removed.
    pub fn ids(&self) -> Vec<C> {
        self.lock().wanted.keys().cloned().collect()
    }
}

impl<C: ClusterId> Provider for Clusters<C> {
    type Id = C;

    async fn run(&self, fleet: Fleet<C>, shutdown: CancellationToken) -> Result<(), ProviderError> {
        {
            let mut inner = self.lock();
            for cluster in inner.wanted.values() {
                match fleet.engage(cluster.clone()) {
                    Ok(_) => {}
                    // One cluster refused (the local cluster's id) stops no other.
                    Err(error @ EngageError::LocalId { .. }) => {
                        tracing::warn!(cluster = %cluster.id(), %error, "could not engage");
                    }
                    Err(error) => return Err(error.into()),
                }
            }
            inner.fleet = Some(fleet.clone());
        }
        shutdown.cancelled().await;
        self.lock().fleet = None;
        Ok(())
    }
}
