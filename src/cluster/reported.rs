//! The state of a watch this crate does not run itself (single mode's kube-runtime
//! controller lists its primary kind on its own), shown beside the shared watches by
//! [`Cluster::cache_status`](crate::Cluster::cache_status), `/readyz` and the watch metrics.

use std::any::Any;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kube_runtime::watcher;

use super::session::{ErasedWatch, Session};
use crate::cache::index::Indexer;
use crate::cache::source::WatchKey;
use crate::cache::watch::WatchState;
use crate::util::sync::lock;

/// One watch's state as its events show it.
pub(crate) struct ReportedWatch {
    kind: String,
    state: Mutex<WatchState>,
    /// Whether `state` holds an error (read on every event without the lock).
    failing: AtomicBool,
    started: Instant,
    cluster: String,
    activity: crate::cache::watch::Activity,
}

impl ReportedWatch {
    /// Follows one event of the watch: its first listing done, a failure, a success after one.
    pub(crate) fn observe<K>(&self, event: &Result<watcher::Event<K>, watcher::Error>) {
        match event {
            Ok(watcher::Event::Init) => {}
            Ok(_) => self.activity.event(),
            Err(_) => self.activity.failed(),
        }
        match event {
            Ok(watcher::Event::InitDone) => {
                *lock(&self.state) = WatchState::Synced { error: None };
                self.failing.store(false, Ordering::Release);
            }
            Ok(_) => {
                // Every event passes here: a plain load while the watch works.
                if self.failing.load(Ordering::Acquire)
                    && self.failing.swap(false, Ordering::AcqRel)
                {
                    let mut state = lock(&self.state);
                    if let WatchState::Listing { error } | WatchState::Synced { error } =
                        &mut *state
                    {
                        *error = None;
                    }
                }
            }
            Err(error) => {
                let error = crate::client::redact::safe_text(error);
                let mut state = lock(&self.state);
                if let WatchState::Listing { error: e } | WatchState::Synced { error: e } =
                    &mut *state
                {
                    *e = Some(error);
                }
                self.failing.store(true, Ordering::Release);
            }
        }
    }

    /// Completes after `timeout`, having reported the watch if it had not listed by then.
    pub(crate) async fn report_if_overdue(self: Arc<Self>, timeout: Duration) {
        tokio::time::sleep_until((self.started + timeout).into()).await;
        if let WatchState::Listing { error } = lock(&self.state).clone() {
            crate::cache::watch::warn_overdue(&self.cluster, &self.kind, timeout, error.as_deref());
        }
    }
}

impl ErasedWatch for ReportedWatch {
    fn as_any(self: Arc<Self>) -> Arc<dyn Any + Send + Sync> {
        self
    }

    fn add_indexer(&self, _: &Indexer) {}

    fn kind(&self) -> String {
        self.kind.clone()
    }

    fn state(&self) -> WatchState {
        lock(&self.state).clone()
    }

    fn started(&self) -> Instant {
        self.started
    }

    fn activity(&self) -> &crate::cache::watch::Activity {
        &self.activity
    }
}

/// A [`ReportedWatch`] listed in an engagement's watches until dropped.
pub(crate) struct Report {
    pub(crate) watch: Arc<ReportedWatch>,
    /// The engagement's cache sync timeout.
    pub(crate) timeout: Option<Duration>,
    session: Arc<Session>,
    key: WatchKey,
}

impl Report {
    /// Lists a watch of `kind` for `config`, run by `owner` (a controller's name), in
    /// `session`'s watches.
    pub(crate) fn start(
        session: Arc<Session>,
        cluster: String,
        kind: String,
        owner: &str,
        config: &watcher::Config,
    ) -> Self {
        let watch = Arc::new(ReportedWatch {
            kind,
            state: Mutex::new(WatchState::Listing { error: None }),
            failing: AtomicBool::new(false),
            started: Instant::now(),
            activity: Default::default(),
            cluster,
        });
        // Its own key: never taken for a shared watch of the kind, nor given its indexes.
        let key = WatchKey {
            kind: std::any::TypeId::of::<ReportedWatch>(),
            resource: Some(Arc::from(format!("controller {owner}"))),
            config: config.clone(),
        };
        lock(&session.watches).insert(key.clone(), watch.clone());
        Self {
            watch,
            timeout: session.settings.sync_timeout,
            session,
            key,
        }
    }
}

impl Drop for Report {
    fn drop(&mut self) {
        let mut watches = lock(&self.session.watches);
        let ours = Arc::as_ptr(&self.watch).cast::<()>();
        if watches
            .get(&self.key)
            .is_some_and(|w| Arc::as_ptr(w).cast::<()>() == ours)
        {
            watches.remove(&self.key);
        }
    }
}
