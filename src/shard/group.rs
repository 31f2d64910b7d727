//! The group's Leases as a watch keeps them: one listing when the replica joins, then only
//! the changes, however many rounds go by (a listing per round cost every Lease of the group
//! every retry period, on every replica).
//!
//! A round must not judge from a view older than the round: a peer's Lease seen unchanged
//! because the watch stalled would count that peer gone. So a round waits until the watch
//! shows the renewal of this replica's own peer Lease that the round just wrote: the watch
//! delivers changes in order, so every change before that write is in the view too (as a
//! listing made after the write would show them). A replica that does not renew (it cannot
//! see the group: see `Coordinator::round`) counts the view current while the watch has
//! listed, or delivered a change, since its last error.
//!
//! The watch also notes when each peer Lease's current renewal arrived: a peer's silence
//! counts from there (never before the renewal was written), not from the round that next
//! reads the view, up to a retry period later.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use kube::Client;
use kube_runtime::reflector::{self, Store};
use kube_runtime::watcher;
use tokio::time::Instant;
use tokio_util::task::AbortOnDropHandle;

use super::peers;
use super::peers::Arrivals;
use crate::cache::WatchBackoff;
use crate::cache::{Retrying, listing};
use crate::util::sync::lock;

/// A peer Lease: the only kind whose arrivals are kept (fences are many and judged by their
/// holder's peer Lease).
fn is_peer(lease: &Lease) -> bool {
    lease
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(super::ROLE_LABEL))
        .is_some_and(|r| r == "peer")
}

/// How many of its own Lease's resource versions the watch remembers (a renewal is looked
/// for among the latest).
const OWN_VERSIONS: usize = 8;

/// The group's Leases, kept by a watch.
pub(crate) struct GroupWatch {
    store: Store<Lease>,
    seen: Arc<Mutex<Seen>>,
    changed: tokio::sync::watch::Receiver<u64>,
    _task: AbortOnDropHandle<()>,
}

#[derive(Default)]
struct Seen {
    /// The latest resource versions of this replica's peer Lease the watch delivered.
    own: VecDeque<String>,
    /// Those of a listing in progress: in the view once it ends.
    listing_own: Vec<String>,
    /// Since when the watch has worked: listed, or delivered a change, after its last error.
    working_since: Option<Instant>,
    /// Its last error, while it fails.
    error: Option<String>,
    /// When each peer Lease's current renewal arrived: a peer's silence counts from there,
    /// not from the round that next reads the view (up to a retry period later).
    arrivals: Arrivals,
}

impl Seen {
    /// Takes in one event of the watch at `now`: `own` is this replica's peer Lease's name,
    /// `listed` the names the store holds (read at the end of a listing).
    fn observe(
        &mut self,
        event: &watcher::Event<Lease>,
        own: &str,
        now: Instant,
        listed: impl FnOnce() -> std::collections::HashSet<String>,
    ) {
        match event {
            watcher::Event::Apply(lease) | watcher::Event::InitApply(lease) if is_peer(lease) => {
                let name = lease.metadata.name.clone().unwrap_or_default();
                let record = peers::record(lease);
                if self.arrivals.get(&name).is_none_or(|(r, _)| *r != record) {
                    self.arrivals.insert(name, (record, now));
                }
            }
            watcher::Event::Delete(lease) => {
                if let Some(name) = &lease.metadata.name {
                    self.arrivals.remove(name);
                }
            }
            // A relisting: what it no longer shows is gone.
            watcher::Event::InitDone => {
                let names = listed();
                self.arrivals.retain(|name, _| names.contains(name));
            }
            _ => {}
        }
        let version = |lease: &Lease| {
            (lease.metadata.name.as_deref() == Some(own))
                .then(|| lease.metadata.resource_version.clone())
                .flatten()
        };
        match event {
            watcher::Event::Init => self.listing_own.clear(),
            // The reflector serves what it had until the listing ends: a version seen in a
            // listing is in the view only from its end.
            watcher::Event::InitApply(lease) => self.listing_own.extend(version(lease)),
            watcher::Event::InitDone => {
                for version in std::mem::take(&mut self.listing_own) {
                    self.remember_own(version);
                }
            }
            watcher::Event::Apply(lease) | watcher::Event::Delete(lease) => {
                if let Some(version) = version(lease) {
                    self.remember_own(version);
                }
            }
        }
        // A view is its listing's end, or a change: not a listing's start or its items
        // (the store still holds what it had before).
        if matches!(
            event,
            watcher::Event::InitDone | watcher::Event::Apply(_) | watcher::Event::Delete(_)
        ) && (self.error.take().is_some() || self.working_since.is_none())
        {
            self.working_since = Some(now);
        }
    }

    fn remember_own(&mut self, version: String) {
        if self.own.len() == OWN_VERSIONS {
            self.own.pop_front();
        }
        self.own.push_back(version);
    }
}

impl GroupWatch {
    /// Starts watching the Leases labelled `selector` in `namespace`; `own` is the name of
    /// this replica's peer Lease.
    pub(crate) fn start(client: Client, namespace: &str, selector: &str, own: String) -> Self {
        let (store, writer) = reflector::store();
        let seen = Arc::new(Mutex::new(Seen::default()));
        let (tell, changed) = tokio::sync::watch::channel(0u64);
        let config = watcher::Config::default().labels(selector);
        // As the clusters' caches list: a streaming list where the server serves them (one
        // request, its start and the changes after it served from the watch cache, so a
        // group whose Leases change fast is still listed once), pages otherwise; without
        // managed fields, most of a Lease's bytes, which nothing here reads.
        let target = listing::Target::<Lease>::all(client, &()).within(Some(namespace));
        let options = listing::WatchOptions {
            streaming: true,
            trim: true,
            cluster: Arc::from("host"),
        };
        let events = listing::watch(target, config, &options);
        let events = Retrying::new(events, WatchBackoff::default().delays());
        let events = reflector::reflector(writer, events);
        let task_seen = seen.clone();
        let task_store = store.clone();
        let task = tokio::spawn(async move {
            let mut events = std::pin::pin!(events);
            while let Some(event) = events.next().await {
                let mut seen = lock(&task_seen);
                match event {
                    Ok(event) => seen.observe(&event, &own, Instant::now(), || {
                        task_store
                            .state()
                            .iter()
                            .filter_map(|l| l.metadata.name.clone())
                            .collect()
                    }),
                    Err(error) => {
                        seen.working_since = None;
                        seen.error = Some(crate::client::Shown(&error).to_string());
                    }
                }
                drop(seen);
                tell.send_modify(|n| *n = n.wrapping_add(1));
            }
        });
        Self {
            store,
            seen,
            changed,
            _task: AbortOnDropHandle::new(task),
        }
    }

    /// Waits (at most `within`) until the watch has delivered this replica's peer Lease at
    /// `version` (the renewal just written): whether it did.
    pub(crate) async fn caught_up(&self, version: &str, within: Duration) -> bool {
        let mut changed = self.changed.clone();
        let wait = async {
            loop {
                changed.borrow_and_update();
                if lock(&self.seen).own.iter().any(|v| v == version) {
                    return;
                }
                if changed.changed().await.is_err() {
                    std::future::pending::<()>().await;
                }
            }
        };
        tokio::time::timeout(within, wait).await.is_ok()
    }

    /// Whether the watch has worked (listed, or delivered a change) since its last error.
    pub(crate) fn working(&self) -> bool {
        lock(&self.seen).working_since.is_some()
    }

    /// Why the watch fails, while it does.
    pub(crate) fn error(&self) -> Option<String> {
        lock(&self.seen).error.clone()
    }

    /// When the watch delivered each peer Lease's current renewal.
    pub(crate) fn arrivals(&self) -> Arrivals {
        lock(&self.seen).arrivals.clone()
    }

    /// Every Lease of the group as the watch has them now.
    pub(crate) fn leases(&self) -> Vec<Arc<Lease>> {
        self.store.state()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(name: &str, version: &str) -> Lease {
        let mut lease = Lease::default();
        lease.metadata.name = Some(name.into());
        lease.metadata.resource_version = Some(version.into());
        lease
    }

    #[test]
    fn a_relisting_is_a_view_only_once_it_ends() {
        let mut seen = Seen::default();
        let now = Instant::now();
        let none = std::collections::HashSet::new;
        // A change: a view, with this replica's renewal in it.
        seen.observe(&watcher::Event::Apply(lease("me", "5")), "me", now, none);
        assert!(seen.working_since.is_some() && seen.own.contains(&"5".to_string()));
        // The watch fails and lists again: the listing's items (its own renewal among them)
        // are not in the view, nor does the watch count as working, before its end.
        seen.working_since = None;
        seen.error = Some("gone (410)".into());
        seen.observe(&watcher::Event::Init, "me", now, none);
        seen.observe(
            &watcher::Event::InitApply(lease("me", "9")),
            "me",
            now,
            none,
        );
        seen.observe(
            &watcher::Event::InitApply(lease("other", "10")),
            "me",
            now,
            none,
        );
        assert!(
            !seen.own.contains(&"9".to_string()),
            "caught up before InitDone"
        );
        assert!(seen.working_since.is_none(), "working before InitDone");
        assert!(seen.error.is_some());
        seen.observe(&watcher::Event::InitDone, "me", now, || {
            ["me".to_string(), "other".to_string()].into()
        });
        assert!(seen.own.contains(&"9".to_string()));
        assert!(seen.working_since.is_some() && seen.error.is_none());
        // Only the own Lease's versions are remembered.
        assert!(!seen.own.contains(&"10".to_string()));
    }
}
