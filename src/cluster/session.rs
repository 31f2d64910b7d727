//! One engagement of a cluster ([`Session`]: its watches, its user work, its end) and the
//! handle controllers get of it ([`Engagement`]: the cluster with that session).

use std::any::Any;
use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};

use kube_runtime::watcher;
use tokio_util::sync::CancellationToken;

use super::Cluster;
use super::id::ClusterId;
use crate::cache::CacheError;
use crate::cache::Watchable;
use crate::cache::index::Indexer;
use crate::cache::source::WatchKey;
use crate::cache::watch::{SharedWatch, WatchSettings, WatchState};
use crate::util::sync::lock;

/// How many fleets hold the cluster engaged, and the engagement they share.
#[derive(Default)]
pub(super) struct Attachment {
    pub(super) fleets: usize,
    pub(super) session: Option<Arc<Session>>,
}

/// One engagement of a cluster: from the first fleet engaging it to the last letting go. Its
/// watches stop when it ends; controllers hold it to read the caches of that engagement.
pub(crate) struct Session {
    /// Cancelled when the engagement ends.
    pub(super) token: CancellationToken,
    pub(super) settings: WatchSettings,
    /// One shared watch per (resource type, watcher configuration): `SharedWatch<K>`.
    pub(super) watches: Mutex<HashMap<WatchKey, Arc<dyn ErasedWatch>>>,
    /// The watch tasks, awaited when the engagement ends.
    pub(super) tasks: Mutex<Vec<tokio::task::JoinHandle<()>>>,
    /// User work on this engagement running now (reconciles, per-cluster tasks): a sharded
    /// replica hands a cluster over only once it is none.
    busy: Mutex<usize>,
    idle: tokio::sync::Notify,
    /// Cancelled to drop that work at once rather than after its grace (a sharded replica
    /// whose fence is about to expire).
    abort: CancellationToken,
}

/// One piece of user work on an engagement, counted while it lives.
pub(crate) struct Busy(Arc<Session>);

impl Drop for Busy {
    fn drop(&mut self) {
        let mut busy = lock(&self.0.busy);
        *busy = busy.saturating_sub(1);
        if *busy == 0 {
            self.0.idle.notify_waiters();
        }
    }
}

impl Session {
    pub(super) fn new(settings: WatchSettings) -> Self {
        Self {
            token: CancellationToken::new(),
            settings,
            watches: Mutex::new(HashMap::new()),
            tasks: Mutex::new(Vec::new()),
            busy: Mutex::new(0),
            idle: tokio::sync::Notify::new(),
            abort: CancellationToken::new(),
        }
    }

    /// Counts a piece of user work on this engagement while the guard lives; `None` once
    /// the engagement has ended (nothing new may start on it then).
    pub(crate) fn busy(self: &Arc<Self>) -> Option<Busy> {
        let mut busy = lock(&self.busy);
        // Under the lock: whoever waits for `idle` after the end sees this work counted.
        if self.token.is_cancelled() {
            return None;
        }
        *busy += 1;
        Some(Busy(self.clone()))
    }

    /// Whether no user work runs on this engagement now.
    pub(crate) fn is_idle(&self) -> bool {
        *lock(&self.busy) == 0
    }

    /// Completes when no user work runs on this engagement.
    pub(crate) async fn idle(&self) {
        loop {
            let notified = self.idle.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if *lock(&self.busy) == 0 {
                return;
            }
            notified.await;
        }
    }

    /// Ends the engagement and drops its user work at once (reconciles are not given their
    /// disengage grace).
    pub(crate) fn abort(&self) {
        self.token.cancel();
        self.abort.cancel();
    }

    /// Cancelled when the engagement's work is to be dropped at once.
    pub(crate) fn aborted(&self) -> &CancellationToken {
        &self.abort
    }

    /// Cancelled when the engagement ends.
    pub(crate) fn token(&self) -> &CancellationToken {
        &self.token
    }

    /// Whether the engagement is still on.
    pub(crate) fn is_active(&self) -> bool {
        !self.token.is_cancelled()
    }

    /// The watch of `K` for `config`, if one was started in this engagement.
    pub(crate) fn existing<K: Watchable>(
        &self,
        dt: &K::DynamicType,
        config: &watcher::Config,
    ) -> Option<Arc<SharedWatch<K>>> {
        let existing = lock(&self.watches)
            .get(&WatchKey::of::<K>(dt, config))?
            .clone();
        existing.as_any().downcast::<SharedWatch<K>>().ok()
    }

    /// A single-cluster controller's primary watch of `K` for `config`, whose reflector store
    /// is `reflector`: shown to the rest of the crate as this engagement's shared watch of
    /// that kind and configuration, so caches and other controllers of the kind use it rather
    /// than open their own. See [`Primary`].
    pub(crate) fn claim_primary<K: Watchable>(
        self: &Arc<Self>,
        cluster: Arc<str>,
        dt: &K::DynamicType,
        config: &watcher::Config,
        reflector: &kube_runtime::reflector::Store<K>,
        indexers: &Mutex<Vec<Indexer>>,
    ) -> Primary<K> {
        let key = WatchKey::of::<K>(dt, config);
        let mut watches = lock(&self.watches);
        if !self.is_active() {
            return Primary::Apart;
        }
        if let Some(existing) = watches.get(&key).cloned() {
            return match existing.as_any().downcast::<SharedWatch<K>>() {
                Ok(watch) => match watch.reflector().cloned() {
                    Some(reflector) => Primary::Subscribe(watch, reflector),
                    None => Primary::Apart,
                },
                Err(_) => Primary::Apart,
            };
        }
        // Under the watches' lock, as `Cluster::add_indexer` reads them: an index added now
        // is either in this list or finds the watch in the map.
        let indexers = lock(indexers).clone();
        let feed = SharedWatch::adopt(
            reflector.clone(),
            dt,
            cluster,
            self.token.child_token(),
            &indexers,
            self.settings.faults.clone(),
        );
        watches.insert(key.clone(), feed.watch().clone());
        Primary::Own(Adopted {
            feed,
            timeout: self.settings.sync_timeout,
            session: self.clone(),
            key,
        })
    }

    /// Whether a watch task of this engagement may still be running.
    pub(crate) fn is_winding_down(&self) -> bool {
        lock(&self.tasks).iter().any(|t| !t.is_finished())
    }

    /// Completes once every watch task of this (ended) engagement has finished.
    pub(crate) async fn stopped(&self) {
        self.token.cancel();
        let tasks = std::mem::take(&mut *lock(&self.tasks));
        for task in tasks {
            let _ = task.await;
        }
    }
}

/// How a single-cluster controller watches its primary kind.
pub(crate) enum Primary<K: Watchable> {
    /// It runs the engagement's watch of the kind itself, handing its events on through the
    /// feed.
    Own(Adopted<K>),
    /// Another controller runs it: this one schedules from that watch's reflector store and
    /// its subscription.
    Subscribe(Arc<SharedWatch<K>>, kube_runtime::reflector::Store<K>),
    /// It runs a watch of its own (the engagement ended, or a cache of the kind started its
    /// own watch first).
    Apart,
}

/// A controller's watch shown among the engagement's watches until dropped.
pub(crate) struct Adopted<K: Watchable> {
    pub(crate) feed: crate::cache::watch::Feed<K>,
    /// The engagement's cache sync timeout.
    pub(crate) timeout: Option<std::time::Duration>,
    session: Arc<Session>,
    key: WatchKey,
}

impl<K: Watchable> Drop for Adopted<K> {
    fn drop(&mut self) {
        let mut watches = lock(&self.session.watches);
        let ours = Arc::as_ptr(self.feed.watch()).cast::<()>();
        if watches
            .get(&self.key)
            .is_some_and(|w| Arc::as_ptr(w).cast::<()>() == ours)
        {
            watches.remove(&self.key);
        }
    }
}

/// A [`SharedWatch`] of any kind.
pub(crate) trait ErasedWatch: Send + Sync {
    fn as_any(self: Arc<Self>) -> Arc<dyn Any + Send + Sync>;
    fn add_indexer(&self, indexer: &Indexer);
    fn kind(&self) -> String;
    fn state(&self) -> WatchState;
    /// When it started.
    fn started(&self) -> std::time::Instant;
    /// When its last event came, and how often it failed.
    fn activity(&self) -> &crate::cache::watch::Activity;
}

impl<K: Watchable> ErasedWatch for SharedWatch<K> {
    fn as_any(self: Arc<Self>) -> Arc<dyn Any + Send + Sync> {
        self
    }

    fn add_indexer(&self, indexer: &Indexer) {
        SharedWatch::add_indexer(self, indexer);
    }

    fn kind(&self) -> String {
        SharedWatch::kind(self).to_string()
    }

    fn state(&self) -> WatchState {
        SharedWatch::state(self)
    }

    fn started(&self) -> std::time::Instant {
        SharedWatch::started(self)
    }

    fn activity(&self) -> &crate::cache::watch::Activity {
        SharedWatch::activity(self)
    }
}

/// One engagement of one cluster, as the fleet hands it to controllers.
pub(crate) struct Engagement<C: ClusterId> {
    pub(crate) cluster: Cluster<C>,
    pub(crate) session: Arc<Session>,
}

impl<C: ClusterId> Clone for Engagement<C> {
    fn clone(&self) -> Self {
        Self {
            cluster: self.cluster.clone(),
            session: self.session.clone(),
        }
    }
}

impl<C: ClusterId> fmt::Debug for Engagement<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Engagement")
            .field("cluster", self.cluster.id())
            .field("active", &self.session.is_active())
            .finish()
    }
}

impl<C: ClusterId> Engagement<C> {
    /// The id.
    pub(crate) fn id(&self) -> &C {
        self.cluster.id()
    }

    /// The shared watch of `K` for `config` in this engagement; started on first use.
    pub(crate) fn watch<K: Watchable>(
        &self,
        dt: &K::DynamicType,
        config: &watcher::Config,
    ) -> Result<Arc<SharedWatch<K>>, CacheError> {
        self.cluster.watch_in(&self.session, dt, config)
    }

    /// Whether both are the same engagement of the same cluster.
    pub(crate) fn same(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.session, &other.session) && self.cluster.same_instance(&other.cluster)
    }
}
