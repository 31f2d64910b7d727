//! What the coordinator asks of the host cluster, behind one trait: the API server (with the
//! group's watch) in a run, a store in memory in the coordinator's unit tests (which drive
//! its safety rules on paused time).

use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::Api;

use super::fence::Holder;
use super::group::GroupWatch;
use super::peers::{Announcement, Arrivals};

/// The host cluster as the coordinator uses it.
pub(crate) trait Host: Send + Sync + 'static {
    /// Creates or renews this replica's peer Lease; the Lease as written.
    fn renew(&self, me: &Announcement) -> BoxFuture<'static, Result<Lease, kube::Error>>;
    /// Waits (at most `within`) until the view of the group shows this replica's peer Lease
    /// at `version`: whether it did.
    fn caught_up(&self, version: String, within: Duration) -> BoxFuture<'static, bool>;
    /// Whether the view of the group works (for a replica that does not renew).
    fn working(&self) -> bool;
    /// Why the view fails, while it does.
    fn error(&self) -> Option<String>;
    /// The group's Leases as the view has them.
    fn leases(&self) -> Vec<Arc<Lease>>;
    /// When the view got each peer Lease's current renewal.
    fn arrivals(&self) -> Arrivals;
    /// Takes the fence `name` of `cluster`, last seen as `seen`; `Ok(None)`: another wrote
    /// first.
    fn acquire(
        &self,
        name: String,
        cluster: String,
        seen: Option<Lease>,
    ) -> BoxFuture<'static, Result<Option<Lease>, kube::Error>>;
    /// Gives a fence up.
    fn release(&self, held: Lease) -> BoxFuture<'static, Result<(), kube::Error>>;
    /// Deletes this replica's peer Lease (leaving the group).
    fn remove_peer(&self, name: String) -> BoxFuture<'static, Result<(), kube::Error>>;
}

/// The API server, with a watch of the group's Leases.
pub(crate) struct ApiHost {
    pub(crate) leases: Api<Lease>,
    pub(crate) holder: Holder,
    pub(crate) group: Arc<GroupWatch>,
}

impl Host for ApiHost {
    fn renew(&self, me: &Announcement) -> BoxFuture<'static, Result<Lease, kube::Error>> {
        let (me, leases) = (me.clone(), self.leases.clone());
        async move { me.renew(&leases).await }.boxed()
    }

    fn caught_up(&self, version: String, within: Duration) -> BoxFuture<'static, bool> {
        let group = self.group.clone();
        async move { group.caught_up(&version, within).await }.boxed()
    }

    fn working(&self) -> bool {
        self.group.working()
    }

    fn error(&self) -> Option<String> {
        self.group.error()
    }

    fn leases(&self) -> Vec<Arc<Lease>> {
        self.group.leases()
    }

    fn arrivals(&self) -> Arrivals {
        self.group.arrivals()
    }

    fn acquire(
        &self,
        name: String,
        cluster: String,
        seen: Option<Lease>,
    ) -> BoxFuture<'static, Result<Option<Lease>, kube::Error>> {
        let holder = self.holder.clone();
        async move { holder.acquire(&name, &cluster, seen.as_ref()).await }.boxed()
    }

    fn release(&self, held: Lease) -> BoxFuture<'static, Result<(), kube::Error>> {
        let holder = self.holder.clone();
        async move { holder.release(&held).await }.boxed()
    }

    fn remove_peer(&self, name: String) -> BoxFuture<'static, Result<(), kube::Error>> {
        let leases = self.leases.clone();
        async move { leases.delete(&name, &Default::default()).await.map(|_| ()) }.boxed()
    }
}

/// The host in memory, for the coordinator's unit tests: Leases by name with resource
/// versions (a write over a stale one is a conflict, as on the API server), and failures to
/// order.
#[cfg(test)]
pub(crate) mod memory {
    use std::collections::BTreeMap;
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::*;
    use crate::util::sync::lock;

    pub(crate) struct MemoryHost {
        /// Who takes fences (the replica under test).
        claim: crate::shard::fence::Claim,
        pub(crate) store: Arc<Mutex<Store>>,
        /// Renewals fail (the host out of reach).
        pub(crate) renewals_fail: AtomicBool,
        /// The view of the group fails: renewals are not shown, the watch does not work.
        pub(crate) blind: AtomicBool,
        /// How long a take takes before it is written.
        pub(crate) take_delay: Mutex<Duration>,
        /// How long a renewal takes before it is written.
        pub(crate) renew_delay: Mutex<Duration>,
        /// The watch stalled silently (an API server that stops delivering, a half-open
        /// connection): the view frozen at this snapshot, renewals never shown, no error.
        pub(crate) stalled: Mutex<Option<(Vec<Arc<Lease>>, Arrivals)>>,
    }

    #[derive(Default)]
    pub(crate) struct Store {
        pub(crate) leases: BTreeMap<String, Lease>,
        version: u64,
        /// The names of the fences released, in order.
        pub(crate) releases: Vec<String>,
        /// When each Lease's renewal record was written (the view has it at once).
        arrivals: Arrivals,
    }

    impl Store {
        /// Writes `lease` (a new resource version).
        pub(crate) fn put(&mut self, mut lease: Lease) -> Lease {
            self.version += 1;
            lease.metadata.resource_version = Some(self.version.to_string());
            let name = lease.metadata.name.clone().unwrap_or_default();
            let record = crate::shard::peers::record(&lease);
            if self
                .arrivals
                .get(&name)
                .is_none_or(|(seen, _)| *seen != record)
            {
                self.arrivals
                    .insert(name.clone(), (record, tokio::time::Instant::now()));
            }
            self.leases.insert(name, lease.clone());
            lease
        }

        fn current(&self, name: &str) -> Option<&str> {
            self.leases
                .get(name)
                .and_then(|l| l.metadata.resource_version.as_deref())
        }
    }

    impl MemoryHost {
        pub(crate) fn new(claim: crate::shard::fence::Claim) -> Self {
            Self {
                claim,
                store: Arc::default(),
                renewals_fail: AtomicBool::new(false),
                blind: AtomicBool::new(false),
                take_delay: Mutex::new(Duration::ZERO),
                renew_delay: Mutex::new(Duration::ZERO),
                stalled: Mutex::new(None),
            }
        }

        /// The watch stalls now: the view stays as it is.
        pub(crate) fn stall(&self) {
            let snapshot = (self.leases(), self.arrivals());
            *lock(&self.stalled) = Some(snapshot);
        }
    }

    fn refused() -> kube::Error {
        kube::Error::Service("the host is out of reach (test)".into())
    }

    impl Host for MemoryHost {
        fn renew(&self, me: &Announcement) -> BoxFuture<'static, Result<Lease, kube::Error>> {
            let fails = self.renewals_fail.load(Ordering::SeqCst);
            let (store, lease) = (self.store.clone(), me.lease());
            let delay = *lock(&self.renew_delay);
            async move {
                tokio::time::sleep(delay).await;
                if fails {
                    return Err(refused());
                }
                Ok(lock(&store).put(lease))
            }
            .boxed()
        }

        fn caught_up(&self, _: String, _: Duration) -> BoxFuture<'static, bool> {
            let shown = !self.blind.load(Ordering::SeqCst) && lock(&self.stalled).is_none();
            std::future::ready(shown).boxed()
        }

        fn working(&self) -> bool {
            !self.blind.load(Ordering::SeqCst)
        }

        fn error(&self) -> Option<String> {
            self.blind
                .load(Ordering::SeqCst)
                .then(|| "forbidden (test)".to_string())
        }

        fn leases(&self) -> Vec<Arc<Lease>> {
            if let Some((leases, _)) = &*lock(&self.stalled) {
                return leases.clone();
            }
            lock(&self.store)
                .leases
                .values()
                .cloned()
                .map(Arc::new)
                .collect()
        }

        fn arrivals(&self) -> Arrivals {
            if let Some((_, arrivals)) = &*lock(&self.stalled) {
                return arrivals.clone();
            }
            lock(&self.store).arrivals.clone()
        }

        fn acquire(
            &self,
            name: String,
            cluster: String,
            seen: Option<Lease>,
        ) -> BoxFuture<'static, Result<Option<Lease>, kube::Error>> {
            let store = self.store.clone();
            let claim = self.claim.clone();
            let delay = *lock(&self.take_delay);
            async move {
                tokio::time::sleep(delay).await;
                let mut store = lock(&store);
                let seen_version = seen
                    .as_ref()
                    .and_then(|l| l.metadata.resource_version.clone());
                if store.current(&name).map(str::to_string) != seen_version {
                    return Ok(None);
                }
                Ok(Some(store.put(claim.taken(&name, &cluster, seen.as_ref()))))
            }
            .boxed()
        }

        fn release(&self, held: Lease) -> BoxFuture<'static, Result<(), kube::Error>> {
            let mut store = lock(&self.store);
            let name = held.metadata.name.clone().unwrap_or_default();
            if store.current(&name) == held.metadata.resource_version.as_deref() {
                store.put(crate::shard::fence::released(&held));
                store.releases.push(name);
            }
            std::future::ready(Ok(())).boxed()
        }

        fn remove_peer(&self, name: String) -> BoxFuture<'static, Result<(), kube::Error>> {
            lock(&self.store).leases.remove(&name);
            std::future::ready(Ok(())).boxed()
        }
    }
}
