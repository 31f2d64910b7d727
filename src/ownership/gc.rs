//! Fleet garbage collection: the children an owner has in other clusters ([`Context::own`])
//! are deleted once the owner is gone from its cluster, or its cluster has left the fleet for
//! good.
//!
//! Each engaged cluster's children (objects with the owner label) and owners (the
//! controller's kind) are followed through the cluster's shared watches. An owner is checked
//! by reading it from its cluster's API server, never from a cache: gone (not found, or
//! another uid under its name) means its children go; a read that fails (the server is
//! unreachable, the cluster paused) deletes nothing and is tried again later. Children are
//! deleted with a uid precondition, so a child recreated meanwhile stays.
//!
//! [`Context::own`]: crate::Context::own

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use kube::Resource;
use kube::api::{DeleteParams, Patch, PatchParams, Preconditions, PropagationPolicy};
use kube_runtime::watcher;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::{FLEET_FINALIZER, FleetOwner, OWNER_LABEL};
use crate::cache::Watchable;
use crate::cluster::{Cluster, ClusterId};
use crate::fleet::FleetEvent;
use crate::run::Env;
use crate::util::sync::lock;

/// What happens to an owner's children in other clusters when the owner goes
/// ([`Builder::owns_in_fleet`](crate::Builder::owns_in_fleet)). Collection deletes objects
/// in the members, so it is off unless asked for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum FleetGc {
    /// Nothing is deleted: a child's change reconciles its owner, and that is all.
    #[default]
    Off,
    /// Once the owner is gone from its cluster (read there, not from a cache), or its cluster
    /// has left the fleet for good, its children are deleted, wherever they are engaged.
    Background,
    /// As `Background`, and the owner is held by the finalizer
    /// [`FLEET_FINALIZER`](super::FLEET_FINALIZER) while it has children: deleting it deletes
    /// the children first (those of the clusters this replica has engaged), then lets the
    /// owner go.
    Foreground,
}

/// How long a check that could not decide waits before it is tried again, at first and at
/// most.
const RETRY: (Duration, Duration) = (Duration::from_secs(2), Duration::from_secs(120));

/// How long one check may wait for its cluster's API server: a server that holds a request
/// delays the other owners' checks no longer than this.
const CHECK_TIMEOUT: Duration = Duration::from_secs(15);

/// An owner, by where it is and its name (every incarnation of the name).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct OwnerKey<C> {
    cluster: C,
    namespace: Option<String>,
    name: String,
}

impl<C: Clone> OwnerKey<C> {
    /// The key of the object `meta` describes, in `cluster`.
    fn of(cluster: &C, meta: &kube::api::ObjectMeta) -> Self {
        Self {
            cluster: cluster.clone(),
            namespace: meta.namespace.clone(),
            name: meta.name.clone().unwrap_or_default(),
        }
    }
}

/// A child, where it is.
type ChildKey<C> = OwnerKey<C>;

#[derive(Clone, Debug)]
struct Child {
    /// The child's own uid (its deletion's precondition).
    uid: String,
    /// The uid of the owner it records.
    owner_uid: String,
    /// Its resourceVersion when indexed: deleted only as it was then (a child that records
    /// another owner since keeps its uid, not its version).
    version: Option<String>,
}

struct State<C> {
    children: HashMap<OwnerKey<C>, HashMap<ChildKey<C>, Child>>,
    owner_of: HashMap<ChildKey<C>, OwnerKey<C>>,
    queue: VecDeque<OwnerKey<C>>,
    queued: HashSet<OwnerKey<C>>,
    /// Clusters that left the fleet for good in this run.
    departed: HashSet<C>,
    /// How many times in a row each owner's check could not decide.
    retries: HashMap<OwnerKey<C>, u32>,
    /// Owners whose next check waits on a timer.
    waiting: HashSet<OwnerKey<C>>,
}

impl<C: ClusterId> Default for State<C> {
    fn default() -> Self {
        Self {
            children: HashMap::new(),
            owner_of: HashMap::new(),
            queue: VecDeque::new(),
            queued: HashSet::new(),
            departed: HashSet::new(),
            retries: HashMap::new(),
            waiting: HashSet::new(),
        }
    }
}

impl<C: ClusterId> State<C> {
    fn enqueue(&mut self, key: OwnerKey<C>) {
        if self.queued.insert(key.clone()) {
            self.queue.push_back(key);
        }
    }

    /// Forgets the children of cluster `id`; returns their owners.
    fn forget_cluster(&mut self, id: &C) -> Vec<OwnerKey<C>> {
        let children: Vec<_> = self
            .owner_of
            .keys()
            .filter(|c| c.cluster == *id)
            .cloned()
            .collect();
        children
            .iter()
            .filter_map(|child| self.forget_child(child))
            .collect()
    }

    fn forget_child(&mut self, child: &ChildKey<C>) -> Option<OwnerKey<C>> {
        let owner = self.owner_of.remove(child)?;
        if let Some(children) = self.children.get_mut(&owner) {
            children.remove(child);
            if children.is_empty() {
                self.children.remove(&owner);
            }
        }
        Some(owner)
    }
}

/// What a check read of an owner.
enum Owner {
    /// There, with this uid; whether it is being deleted, and whether it has the finalizer.
    Present {
        uid: String,
        deleting: bool,
        held: bool,
    },
    /// Not there (or its cluster left for good).
    Gone,
    /// Could not be read: nothing is decided.
    Unknown(String),
}

/// The collector of one controller's owner kind `K` and child kind `Ch`.
pub(crate) struct Collector<C: ClusterId, K: Watchable, Ch: Watchable> {
    name: Arc<str>,
    mode: FleetGc,
    owner_dt: K::DynamicType,
    owner_config: watcher::Config,
    child_dt: Ch::DynamicType,
    child_config: watcher::Config,
    state: Mutex<State<C>>,
    wake: Notify,
}

impl<C: ClusterId, K: Watchable, Ch: Watchable> Collector<C, K, Ch> {
    pub(crate) fn new(
        name: Arc<str>,
        mode: FleetGc,
        owner_dt: K::DynamicType,
        owner_config: watcher::Config,
        child_dt: Ch::DynamicType,
        child_config: watcher::Config,
    ) -> Self {
        Self {
            name,
            mode,
            owner_dt,
            owner_config,
            child_dt,
            child_config,
            state: Mutex::new(State::default()),
            wake: Notify::new(),
        }
    }

    /// Runs for one run of the manager: a task per engaged cluster following its children
    /// and owners, the fleet's departures, and the checks.
    pub(crate) async fn run(self: Arc<Self>, env: Env<C>) {
        let fleet = env.fleet.clone();
        let shutdown = env.shutdown.clone();
        let tenure = env.tenure.clone();
        *lock(&self.state) = State::default();
        let this = self.clone();
        let task = crate::run::cluster_task::boxed(move |cluster: Cluster<C>, until| {
            this.clone().follow(cluster, until)
        });
        let name: Arc<str> = Arc::from(format!("{} fleet collector", self.name));
        let clusters = crate::run::cluster_task::run(env, name, task);
        let departures = self.clone().departures(fleet.clone(), shutdown.clone());
        let checks = self.clone().checks(fleet, shutdown, tenure);
        tokio::join!(clusters, departures, checks);
    }

    /// Notes departures for good (their owners' children go) and returns (they do not).
    async fn departures(
        self: Arc<Self>,
        fleet: crate::fleet::Fleet<C>,
        shutdown: CancellationToken,
    ) {
        let mut events = fleet.subscribe();
        loop {
            let event = tokio::select! {
                () = shutdown.cancelled() => return,
                event = events.recv() => match event { Some(e) => e, None => return },
            };
            let mut state = lock(&self.state);
            match event {
                FleetEvent::Engaged(e) | FleetEvent::Replaced { new: e, .. } => {
                    state.departed.remove(e.cluster.id());
                }
                FleetEvent::Departed(cluster) => {
                    let id = cluster.id().clone();
                    state.departed.insert(id.clone());
                    let owners: Vec<_> = state
                        .children
                        .keys()
                        .filter(|k| k.cluster == id)
                        .cloned()
                        .collect();
                    // The departed cluster's own children are out of reach now.
                    let touched = state.forget_cluster(&id);
                    for owner in owners.into_iter().chain(touched) {
                        state.enqueue(owner);
                    }
                    drop(state);
                    self.wake.notify_one();
                }
                FleetEvent::Disengaged(_) => {}
            }
        }
    }

    /// Follows one engaged cluster's children and owners until its engagement ends.
    async fn follow(self: Arc<Self>, cluster: Cluster<C>, until: CancellationToken) {
        let id = cluster.id().clone();
        let children = cluster.changes::<Ch>(&self.child_dt, &self.child_config);
        let owners = cluster.changes::<K>(&self.owner_dt, &self.owner_config);
        let (mut children, mut owners) = match (children, owners) {
            (Ok(c), Ok(o)) => (c, o),
            (Err(error), _) | (_, Err(error)) => {
                tracing::debug!(collector = %self.name, cluster = %id, %error, "fleet collector not following the cluster");
                return;
            }
        };
        loop {
            tokio::select! {
                () = until.cancelled() => break,
                change = children.next() => match change {
                    Some(change) => self.child_changed(&id, &change.object, change.deleted),
                    None => break,
                },
                change = owners.next() => match change {
                    Some(change) => self.owner_changed(&id, &change.object, change.deleted),
                    None => break,
                },
            }
        }
        // Its children are out of reach until it is engaged again (then listed again).
        let mut state = lock(&self.state);
        let touched = state.forget_cluster(&id);
        if self.mode == FleetGc::Foreground {
            for owner in touched {
                state.enqueue(owner);
            }
            drop(state);
            self.wake.notify_one();
        }
    }

    fn child_changed(&self, cluster: &C, child: &Ch, deleted: bool) {
        let meta = child.meta();
        let key = ChildKey::of(cluster, meta);
        let recorded = match FleetOwner::<C>::of_child(child) {
            Some(Ok(owner)) if owner.is_kind::<K>(&self.owner_dt) => Some(owner),
            Some(Err(error)) => {
                tracing::debug!(collector = %self.name, %cluster, child = %key.name, %error, "child with an unreadable owner record ignored");
                None
            }
            _ => None,
        };
        let mut state = lock(&self.state);
        let before = state.forget_child(&key);
        let mut wake = false;
        if let (false, Some(owner), Some(uid)) = (deleted, recorded, meta.uid.clone()) {
            let owner_key = OwnerKey {
                cluster: owner.cluster,
                namespace: owner.namespace,
                name: owner.name,
            };
            let new = !state.children.contains_key(&owner_key);
            state.children.entry(owner_key.clone()).or_default().insert(
                key.clone(),
                Child {
                    uid,
                    owner_uid: owner.uid,
                    version: meta.resource_version.clone(),
                },
            );
            state.owner_of.insert(key, owner_key.clone());
            if new || before.as_ref() != Some(&owner_key) {
                state.enqueue(owner_key);
                wake = true;
            }
        }
        // A child that left its owner: a held owner may be let go.
        if let Some(before) = before
            && self.mode == FleetGc::Foreground
            && !state.children.contains_key(&before)
        {
            state.enqueue(before);
            wake = true;
        }
        drop(state);
        if wake {
            self.wake.notify_one();
        }
    }

    fn owner_changed(&self, cluster: &C, owner: &K, deleted: bool) {
        let meta = owner.meta();
        let key = OwnerKey::of(cluster, meta);
        let held = meta
            .finalizers
            .as_ref()
            .is_some_and(|f| f.iter().any(|f| f == FLEET_FINALIZER));
        let mut state = lock(&self.state);
        let relevant = deleted
            || (meta.deletion_timestamp.is_some() && held)
            || state.children.get(&key).is_some_and(|children| {
                children
                    .values()
                    .any(|c| Some(&c.owner_uid) != meta.uid.as_ref())
            })
            || (self.mode == FleetGc::Foreground && !held && state.children.contains_key(&key));
        if relevant {
            state.enqueue(key);
            drop(state);
            self.wake.notify_one();
        }
    }

    /// Works through the queued owners, one at a time.
    async fn checks(
        self: Arc<Self>,
        fleet: crate::fleet::Fleet<C>,
        shutdown: CancellationToken,
        tenure: Arc<crate::lease::tenure::Tenure>,
    ) {
        loop {
            let next = {
                let mut state = lock(&self.state);
                let next = state.queue.pop_front();
                if let Some(key) = &next {
                    state.queued.remove(key);
                }
                next
            };
            let Some(key) = next else {
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    () = self.wake.notified() => continue,
                }
            };
            // Deletions and finalizer changes only while this replica's tenure holds.
            while !tenure.holds() {
                let mut changed = tenure.subscribe();
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    _ = changed.changed() => {}
                }
            }
            if let Err(reason) = self.check(&fleet, &key).await {
                let tries = {
                    let mut state = lock(&self.state);
                    if !state.waiting.insert(key.clone()) {
                        continue;
                    }
                    let tries = state.retries.entry(key.clone()).or_default();
                    *tries += 1;
                    *tries
                };
                let delay = RETRY.0.saturating_mul(1 << tries.min(6)).min(RETRY.1);
                tracing::info!(collector = %self.name, owner = %key.name, cluster = %key.cluster, %reason, retry_in = ?delay, "fleet collector keeps the owner's children for now: the check did not decide");
                let this = self.clone();
                let stop = shutdown.clone();
                tokio::spawn(async move {
                    tokio::select! {
                        () = stop.cancelled() => {}
                        () = tokio::time::sleep(delay) => {
                            let mut state = lock(&this.state);
                            state.waiting.remove(&key);
                            state.enqueue(key);
                            drop(state);
                            this.wake.notify_one();
                        }
                    }
                });
            } else {
                lock(&self.state).retries.remove(&key);
            }
        }
    }

    /// Reads the owner and acts: deletes the children of a gone owner (or of a previous
    /// incarnation), holds or lets go a present one. `Err` when it could not decide.
    async fn check(&self, fleet: &crate::fleet::Fleet<C>, key: &OwnerKey<C>) -> Result<(), String> {
        // The children as indexed before the owner is read: one indexed later (for a new
        // owner of the name, say) waits for a check of its own.
        let children: Vec<(ChildKey<C>, Child)> = lock(&self.state)
            .children
            .get(key)
            .map(|c| c.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
            .unwrap_or_default();
        let owner = match tokio::time::timeout(CHECK_TIMEOUT, self.read(fleet, key)).await {
            Ok(owner) => owner,
            Err(_) => Owner::Unknown(format!("no answer within {CHECK_TIMEOUT:?}")),
        };
        match owner {
            Owner::Unknown(reason) => Err(reason),
            Owner::Gone => {
                if self.mode != FleetGc::Off {
                    self.delete(fleet, key, &children).await?;
                }
                Ok(())
            }
            Owner::Present {
                uid,
                deleting,
                held,
            } => {
                // Children of an earlier owner of the name.
                let stale: Vec<_> = children
                    .iter()
                    .filter(|(_, c)| c.owner_uid != uid)
                    .cloned()
                    .collect();
                if self.mode != FleetGc::Off && !stale.is_empty() {
                    self.delete(fleet, key, &stale).await?;
                }
                let own = children.len() - stale.len();
                match self.mode {
                    // Held (in this mode, or an earlier one of this controller) and being
                    // deleted: the children first, then the owner let go.
                    _ if deleting && held => {
                        if own > 0 {
                            let mine: Vec<_> = children
                                .into_iter()
                                .filter(|(_, c)| c.owner_uid == uid)
                                .collect();
                            // Waits for the children's deletions to be seen, which queue the
                            // owner again.
                            self.delete(fleet, key, &mine).await?;
                            Ok(())
                        } else {
                            self.patch_finalizers(fleet, key, &uid, false).await
                        }
                    }
                    FleetGc::Foreground if !deleting && !held && own > 0 => {
                        self.patch_finalizers(fleet, key, &uid, true).await
                    }
                    // Held by an earlier mode of this controller, with nothing to wait for.
                    FleetGc::Background | FleetGc::Off if held && own == 0 => {
                        self.patch_finalizers(fleet, key, &uid, false).await
                    }
                    _ => Ok(()),
                }
            }
        }
    }

    /// Reads the owner from its cluster's API server.
    async fn read(&self, fleet: &crate::fleet::Fleet<C>, key: &OwnerKey<C>) -> Owner {
        let Some(cluster) = fleet.discovered(&key.cluster) else {
            return if lock(&self.state).departed.contains(&key.cluster) {
                Owner::Gone
            } else {
                Owner::Unknown(format!(
                    "cluster {} is not engaged (paused, not discovered yet, or unknown)",
                    key.cluster
                ))
            };
        };
        match get_opt::<K>(&cluster.client(), &self.owner_dt, key).await {
            Ok(None) => Owner::Gone,
            Ok(Some(owner)) => {
                let meta = owner.meta();
                Owner::Present {
                    uid: meta.uid.clone().unwrap_or_default(),
                    deleting: meta.deletion_timestamp.is_some(),
                    held: meta
                        .finalizers
                        .as_ref()
                        .is_some_and(|f| f.iter().any(|f| f == FLEET_FINALIZER)),
                }
            }
            Err(error) => Owner::Unknown(crate::client::redact::safe_text(&error)),
        }
    }

    /// Deletes `children` of the owner `key` (each with its uid as precondition). A child with
    /// finalizers of its own stays until they are done; a held owner waits for it.
    async fn delete(
        &self,
        fleet: &crate::fleet::Fleet<C>,
        key: &OwnerKey<C>,
        children: &[(ChildKey<C>, Child)],
    ) -> Result<(), String> {
        let mut failed = None;
        for (child, record) in children {
            let Some(cluster) = fleet.get(&child.cluster) else {
                continue;
            };
            let request =
                kube::core::Request::new(Ch::url_path(&self.child_dt, child.namespace.as_deref()));
            let params = DeleteParams {
                preconditions: Some(Preconditions {
                    uid: Some(record.uid.clone()),
                    resource_version: record.version.clone(),
                }),
                // In the background whatever the mode: the child's own dependents are its
                // cluster's collector's; the owner waits for the child, not for them.
                propagation_policy: Some(PropagationPolicy::Background),
                ..DeleteParams::default()
            };
            let sent = match request.delete(&child.name, &params) {
                Ok(request) => cluster.client().request_text(request).await,
                Err(error) => Err(kube::Error::BuildRequest(error)),
            };
            match sent {
                Ok(_) => {
                    tracing::info!(collector = %self.name, owner = %key.name, owner_cluster = %key.cluster, child = %child.name, cluster = %child.cluster, "deleted a child whose owner is gone");
                }
                // Gone already.
                Err(kube::Error::Api(status)) if status.code == 404 => {}
                // Changed since it was indexed (or another object under the name): its
                // change is being indexed; the owner is checked again then.
                Err(kube::Error::Api(status)) if status.code == 409 => {
                    failed = Some(format!(
                        "child {} in cluster {} changed since it was read",
                        child.name, child.cluster
                    ));
                }
                Err(error) => {
                    failed = Some(format!(
                        "deleting child {} in cluster {}: {}",
                        child.name,
                        child.cluster,
                        crate::client::redact::safe_text(&error)
                    ));
                }
            }
        }
        match failed {
            Some(reason) => Err(reason),
            None => Ok(()),
        }
    }

    /// Adds the finalizer to the owner (`hold`) or removes it; only on the incarnation
    /// `uid`, and only if the owner did not change since it was read.
    async fn patch_finalizers(
        &self,
        fleet: &crate::fleet::Fleet<C>,
        key: &OwnerKey<C>,
        uid: &str,
        hold: bool,
    ) -> Result<(), String> {
        let Some(cluster) = fleet.discovered(&key.cluster) else {
            return Err(format!("cluster {} is not engaged", key.cluster));
        };
        let client = cluster.client();
        let owner = match get_opt::<K>(&client, &self.owner_dt, key).await {
            Ok(Some(owner)) => owner,
            Ok(None) => return Ok(()),
            Err(error) => return Err(crate::client::redact::safe_text(&error)),
        };
        let meta = owner.meta();
        if meta.uid.as_deref() != Some(uid) {
            return Ok(());
        }
        let mut finalizers = meta.finalizers.clone().unwrap_or_default();
        let has = finalizers.iter().any(|f| f == FLEET_FINALIZER);
        if has == hold {
            return Ok(());
        }
        if hold {
            finalizers.push(FLEET_FINALIZER.to_string());
        } else {
            finalizers.retain(|f| f != FLEET_FINALIZER);
        }
        // The uid and resourceVersion read are preconditions of the patch: a change meanwhile
        // is a conflict, and a later check.
        let patch = serde_json::json!({"metadata": {
            "uid": uid,
            "resourceVersion": meta.resource_version,
            "finalizers": finalizers,
        }});
        let request = kube::core::Request::new(K::url_path(
            &self.owner_dt,
            key.namespace.as_deref(),
        ))
        .patch(&key.name, &PatchParams::default(), &Patch::Merge(patch));
        let sent = match request {
            Ok(request) => client.request_text(request).await,
            Err(error) => Err(kube::Error::BuildRequest(error)),
        };
        match sent {
            Ok(_) => {
                tracing::debug!(collector = %self.name, owner = %key.name, cluster = %key.cluster, hold, "fleet finalizer changed");
                Ok(())
            }
            Err(kube::Error::Api(status)) if status.code == 404 => Ok(()),
            // Changed since it was read: checked again at once.
            Err(kube::Error::Api(status)) if status.code == 409 => {
                lock(&self.state).enqueue(key.clone());
                self.wake.notify_one();
                Ok(())
            }
            Err(error) => Err(crate::client::redact::safe_text(&error)),
        }
    }
}

/// Reads an object (`None`: not found) from its cluster's API server.
async fn get_opt<R>(
    client: &kube::Client,
    dt: &R::DynamicType,
    key: &OwnerKey<impl ClusterId>,
) -> Result<Option<R>, kube::Error>
where
    R: Resource + serde::de::DeserializeOwned,
{
    let request = kube::core::Request::new(R::url_path(dt, key.namespace.as_deref()))
        .get(&key.name, &Default::default())
        .map_err(kube::Error::BuildRequest)?;
    match client.request::<R>(request).await {
        Ok(object) => Ok(Some(object)),
        // Not found, naming the object; a 404 for a kind not served (now) is an error.
        Err(kube::Error::Api(status))
            if status.code == 404
                && status.details.as_ref().is_some_and(|d| d.name == key.name) =>
        {
            Ok(None)
        }
        Err(error) => Err(error),
    }
}

/// The child watch's configuration: the caller's, restricted to objects with the owner label.
pub(crate) fn child_config(mut config: watcher::Config) -> watcher::Config {
    config.label_selector = Some(match config.label_selector.take() {
        Some(selector) if !selector.trim().is_empty() => format!("{selector},{OWNER_LABEL}"),
        _ => OWNER_LABEL.to_string(),
    });
    config
}
