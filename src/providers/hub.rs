//! The engine of the providers whose clusters are objects on a hub cluster (Cluster API
//! `Cluster`, Cluster Inventory API `ClusterProfile`, KubeFed `KubeFedCluster`): it finds
//! the kind (installed late is fine), watches the objects and the Secrets holding their
//! credentials, and engages, replaces and disengages one cluster per object as the object
//! and its credentials change. What differs per kind (readiness, where the credentials are,
//! how a client is built) is a [`HubKind`].

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use futures::stream::FuturesUnordered;
use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::Secret;
use kube::api::{ApiResource, DynamicObject};
use kube::{Api, Client, Resource, ResourceExt};
use kube_runtime::WatchStreamExt;
use kube_runtime::events::{Recorder, Reporter};
use kube_runtime::watcher::{self, Event as WatchEvent};
use tokio_util::sync::CancellationToken;

use super::kubeconfig::version_of;
use crate::cluster::{Cluster, ClusterName};
use crate::fleet::Fleet;
use crate::provider::ProviderError;

/// Whether a hub object is ready to be engaged.
pub(crate) type Ready = Arc<dyn Fn(&DynamicObject) -> bool + Send + Sync>;

/// How long to wait before looking again for a kind that is not served.
const DISCOVERY_RETRY: Duration = Duration::from_secs(10);
/// How many clients are built at once (each may run a credential plugin, for up to 30 s).
const BUILDS_AT_ONCE: usize = 4;

/// The reason of the Warning Event on an object not engaged because another one describes the
/// same member cluster.
pub(crate) const DUPLICATE_MEMBER: &str = "DuplicateMember";

/// Which hub objects: a namespace (all if `None`), a label selector, a readiness override;
/// and whether a cluster whose credentials Secret went away stays engaged.
#[derive(Clone, Default)]
pub(crate) struct Scope {
    pub(crate) namespace: Option<String>,
    pub(crate) labels: Option<String>,
    pub(crate) ready: Option<Ready>,
    pub(crate) keep_revoked: bool,
}

impl std::fmt::Debug for Scope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scope")
            .field("namespace", &self.namespace)
            .field("labels", &self.labels)
            .field("custom_ready", &self.ready.is_some())
            .field("keep_revoked", &self.keep_revoked)
            .finish()
    }
}

/// One kind of hub object that describes clusters.
pub(crate) trait HubKind: Send + Sync + 'static {
    /// What a client is built from (a kubeconfig, a configuration).
    type Recipe: Send + 'static;

    /// The kind's group, name and versions (most preferred first).
    const GROUP: &'static str;
    const KIND: &'static str;
    const VERSIONS: &'static [&'static str];
    /// How logs name one such cluster ("Cluster API cluster").
    const WHAT: &'static str;
    /// The reporting controller of the Warning Events.
    const REPORTER: &'static str;

    /// The readiness rule when the user gave none.
    fn default_ready(&self, object: &DynamicObject) -> bool;

    /// The Secrets the credentials are in (the watch's selectors), `None` if in none.
    fn secrets(&self) -> Option<watcher::Config>;

    /// Whether this kind may read the watched Secret, and of it (by its name), the data `key`.
    /// Nothing else is kept: Secrets the watch selects may hold more than clients need
    /// (Cluster API's hold CA, etcd and service-account keys and bootstrap data).
    fn reads_secret(&self, _secret: &Secret) -> bool {
        true
    }

    /// See [`HubKind::reads_secret`].
    fn reads(&self, _name: &str, _key: &str) -> bool {
        true
    }

    /// Whether only the Secrets some object names ([`HubKind::named_secret`]) are kept;
    /// a Secret named later is read then.
    const ONLY_NAMED: bool = false;

    /// The Secret (namespace, name) `object` takes its credentials from.
    fn named_secret(&self, _object: &DynamicObject) -> Option<(String, String)> {
        None
    }

    /// The member cluster `object` describes, if the kind says: of live objects sharing one,
    /// only the earliest created is engaged (see [`State::refile`]).
    fn member_id(&self, _object: &DynamicObject) -> Option<String> {
        None
    }

    /// How to reach the cluster of a live (ready, not being deleted) object, with a version
    /// that changes when the result would: or what is wrong, in words fit for an Event that
    /// hold nothing secret.
    fn recipe(
        &self,
        object: &DynamicObject,
        secrets: &Secrets,
    ) -> Result<(u64, Self::Recipe), NoRecipe>;

    /// Builds the client (this may run a credential plugin).
    fn build(
        &self,
        name: ClusterName,
        recipe: Self::Recipe,
    ) -> impl Future<Output = Result<Cluster<ClusterName>, String>> + Send + 'static;
}

/// Why an object's cluster cannot be built, in words fit for an Event that hold nothing
/// secret.
pub(crate) enum NoRecipe {
    /// The Secret holding its credentials is not there (deleted, or no longer labelled or
    /// typed for it): what revoking them looks like.
    Revoked(String),
    /// Anything else: the object says too little, or its credentials are unusable.
    Unusable(String),
}

impl From<String> for NoRecipe {
    fn from(problem: String) -> Self {
        NoRecipe::Unusable(problem)
    }
}

impl From<&str> for NoRecipe {
    fn from(problem: &str) -> Self {
        NoRecipe::Unusable(problem.into())
    }
}

/// One Secret as the engine keeps it: labels, and each data value with its version.
pub(crate) struct StoredSecret {
    pub(crate) labels: BTreeMap<String, String>,
    pub(crate) data: BTreeMap<String, (u64, Vec<u8>)>,
}

/// The watched Secrets by namespace and name.
#[derive(Default)]
pub(crate) struct Secrets {
    by_key: BTreeMap<(String, String), StoredSecret>,
}

impl Secrets {
    /// Secret `name` of `namespace`.
    pub(crate) fn get(&self, namespace: &str, name: &str) -> Option<&StoredSecret> {
        self.by_key.get(&(namespace.to_string(), name.to_string()))
    }

    /// The Secrets of `namespace` with their names.
    pub(crate) fn in_namespace<'a>(
        &'a self,
        namespace: &'a str,
    ) -> impl Iterator<Item = (&'a str, &'a StoredSecret)> + 'a {
        self.by_key
            .range((namespace.to_string(), String::new())..)
            .take_while(move |((ns, _), _)| ns == namespace)
            .map(|((_, name), secret)| (name.as_str(), secret))
    }

    /// Keeps what `kind` reads of `secret` (nothing, if it reads none of it); the Secret's
    /// namespace.
    pub(crate) fn insert(&mut self, secret: Secret, kind: &impl HubKind) -> String {
        let namespace = secret.namespace().unwrap_or_default();
        let name = secret.name_any();
        let read = kind.reads_secret(&secret);
        let data: BTreeMap<_, _> = secret
            .data
            .unwrap_or_default()
            .into_iter()
            .filter(|(key, _)| kind.reads(&name, key))
            .map(|(key, value)| (key, (version_of(&value.0), value.0)))
            .collect();
        let key = (namespace.clone(), name);
        if !read {
            self.by_key.remove(&key);
            return namespace;
        }
        let stored = StoredSecret {
            labels: secret.metadata.labels.unwrap_or_default(),
            data,
        };
        self.by_key.insert(key, stored);
        namespace
    }
}

/// A kubeconfig of one context: `cluster` reached as `user`.
pub(crate) fn kubeconfig_of(
    cluster: kube::config::Cluster,
    user: kube::config::AuthInfo,
) -> kube::config::Kubeconfig {
    use kube::config::{Context, Kubeconfig, NamedAuthInfo, NamedCluster, NamedContext};
    Kubeconfig {
        clusters: vec![NamedCluster {
            name: "cluster".into(),
            cluster: Some(cluster),
            ..Default::default()
        }],
        auth_infos: vec![NamedAuthInfo {
            name: "user".into(),
            auth_info: Some(user),
            ..Default::default()
        }],
        contexts: vec![NamedContext {
            name: "context".into(),
            context: Some(Context {
                cluster: "cluster".into(),
                user: Some("user".into()),
                ..Default::default()
            }),
            ..Default::default()
        }],
        current_context: Some("context".into()),
        ..Default::default()
    }
}

/// `<namespace>/<name>` of an object.
pub(crate) fn key_of(object: &impl Resource) -> String {
    format!(
        "{}/{}",
        object.meta().namespace.as_deref().unwrap_or_default(),
        object.meta().name.as_deref().unwrap_or_default()
    )
}

/// The value at `path` of an object's JSON.
pub(crate) fn field<'a>(object: &'a DynamicObject, path: &[&str]) -> Option<&'a serde_json::Value> {
    path.iter().try_fold(&object.data, |v, key| v.get(key))
}

/// Whether condition `kind` of `status.conditions` has status `True`.
pub(crate) fn condition_true(object: &DynamicObject, kind: &str) -> bool {
    field(object, &["status", "conditions"])
        .and_then(|c| c.as_array())
        .into_iter()
        .flatten()
        .any(|c| {
            c.get("type").and_then(|t| t.as_str()) == Some(kind)
                && c.get("status").and_then(|s| s.as_str()) == Some("True")
        })
}

/// What the engine knows of one hub object.
#[derive(Default)]
struct Known {
    /// The object as last seen; `None` once it is gone.
    object: Option<DynamicObject>,
    /// The version of the recipe its engaged cluster came from.
    engaged: Option<u64>,
    /// The problem last reported (its fingerprint), so each is reported once.
    reported: Option<u64>,
    /// The recipe version being built or waiting to be.
    wanted: Option<u64>,
    /// The recipe version whose build failed, how many times in a row, and whether its
    /// retry is due.
    failed: Option<Failed>,
    /// The member id it is filed under in [`State::members`].
    member: Option<String>,
}

struct Failed {
    version: u64,
    attempts: u32,
    due: bool,
}

/// How long to wait before building a recipe again after `attempts` failures: a credential
/// plugin may fail for a while (its secret not written yet, its backend down).
fn retry_after(attempts: u32) -> Duration {
    (RETRY_FIRST * 2u32.saturating_pow(attempts.saturating_sub(1))).min(RETRY_MAX)
}

/// The first and the longest wait before building a failed recipe again.
const RETRY_FIRST: Duration = Duration::from_secs(5);
const RETRY_MAX: Duration = Duration::from_secs(300);

#[derive(Default)]
pub(crate) struct State {
    objects: BTreeMap<String, Known>,
    secrets: Secrets,
    /// Keys listed by the objects' listing in progress (to forget the vanished ones).
    listing_objects: Option<BTreeSet<String>>,
    /// Secrets listed by the Secrets' listing in progress.
    listing_secrets: Option<BTreeSet<(String, String)>>,
    /// The Secrets' first listing is complete (or there are none to watch): an object is
    /// looked at only from then on, so a Secret not known is missing, not late.
    secrets_listed: bool,
    /// With [`HubKind::ONLY_NAMED`]: the watched Secrets no object names, of which nothing
    /// is kept (read when an object comes to name one).
    unread: BTreeSet<(String, String)>,
    /// The keys of the objects of each member id ([`HubKind::member_id`]).
    members: BTreeMap<String, BTreeSet<String>>,
}

impl State {
    /// `object` as the latest of its kind (for tests: the engine's own events do this).
    #[cfg(test)]
    pub(crate) fn set_object(&mut self, key: &str, object: Option<DynamicObject>) {
        self.objects.entry(key.to_string()).or_default().object = object;
    }

    /// The names of the Secrets kept, and of those seen but not kept.
    #[cfg(test)]
    pub(crate) fn secret_names(&self) -> (Vec<String>, Vec<String>) {
        (
            self.secrets.by_key.keys().map(|(_, n)| n.clone()).collect(),
            self.unread.iter().map(|(_, n)| n.clone()).collect(),
        )
    }

    /// After the objects of `keys` changed: files each under its member id now, and returns
    /// `keys` with every other key that shares a member id with one of them, before or after
    /// the change (which of them is engaged may have changed).
    pub(crate) fn refile<K: HubKind>(&mut self, keys: Vec<String>, kind: &K) -> Vec<String> {
        let mut peers = BTreeSet::new();
        for key in &keys {
            let Some(known) = self.objects.get_mut(key) else {
                continue;
            };
            let now = known.object.as_ref().and_then(|o| kind.member_id(o));
            let before = std::mem::replace(&mut known.member, now.clone());
            if before != now {
                if let Some(id) = &before
                    && let Some(filed) = self.members.get_mut(id)
                {
                    filed.remove(key);
                    if filed.is_empty() {
                        self.members.remove(id);
                    }
                }
                if let Some(id) = &now {
                    self.members
                        .entry(id.clone())
                        .or_default()
                        .insert(key.clone());
                }
            }
            for id in before.iter().chain(now.iter()) {
                peers.extend(self.members.get(id).into_iter().flatten().cloned());
            }
        }
        if peers.is_empty() {
            return keys;
        }
        for key in &keys {
            peers.remove(key);
        }
        keys.into_iter().chain(peers).collect()
    }

    /// The Secrets the objects name.
    fn named<K: HubKind>(&self, kind: &K) -> BTreeSet<(String, String)> {
        self.objects
            .values()
            .filter_map(|known| known.object.as_ref())
            .filter_map(|object| kind.named_secret(object))
            .collect()
    }

    /// Keeps what `kind` reads of the watched `secret` if some object names it (or `kind`
    /// keeps every Secret); the Secret's namespace.
    pub(crate) fn take_secret<K: HubKind>(&mut self, secret: Secret, kind: &K) -> String {
        let key = (secret.namespace().unwrap_or_default(), secret.name_any());
        if K::ONLY_NAMED && !self.named(kind).contains(&key) {
            self.secrets.by_key.remove(&key);
            let namespace = key.0.clone();
            self.unread.insert(key);
            return namespace;
        }
        self.unread.remove(&key);
        self.secrets.insert(secret, kind)
    }

    /// With [`HubKind::ONLY_NAMED`], after the objects changed: the Secrets no object names
    /// any more are let go (and remembered as unread); returns the unread ones an object
    /// names now, to be read.
    pub(crate) fn settle_named<K: HubKind>(&mut self, kind: &K) -> Vec<(String, String)> {
        if !K::ONLY_NAMED {
            return Vec::new();
        }
        let named = self.named(kind);
        let dropped: Vec<_> = self
            .secrets
            .by_key
            .keys()
            .filter(|key| !named.contains(*key))
            .cloned()
            .collect();
        for key in dropped {
            self.secrets.by_key.remove(&key);
            self.unread.insert(key);
        }
        self.unread.intersection(&named).cloned().collect()
    }
}

/// What to do about one object after a change.
enum Step<R> {
    Nothing,
    /// Disengage for good (the object is gone or being deleted).
    Depart,
    /// Pause (not ready): still of the fleet.
    Pause,
    Build(u64, R),
    Report(String),
    /// Not engaged: another object describes the same member cluster (paused if it was
    /// engaged); why.
    Duplicate(String, bool),
    /// Pause, the credentials having been revoked, and report why.
    Revoke(String),
}

struct Engine<K: HubKind> {
    kind: Arc<K>,
    host: Client,
    scope: Scope,
}

impl<K: HubKind> Engine<K> {
    /// The kind as the hub serves it (the most preferred version); `None` while it is not.
    async fn discover(&self) -> Result<Option<ApiResource>, kube::Error> {
        let group = match kube::discovery::group(&self.host, K::GROUP).await {
            Ok(group) => group,
            Err(kube::Error::Api(status)) if status.code == 404 => return Ok(None),
            Err(kube::Error::Discovery(kube::error::DiscoveryError::MissingApiGroup(_))) => {
                return Ok(None);
            }
            Err(error) => return Err(error),
        };
        for version in K::VERSIONS {
            if let Some((resource, _)) = group
                .versioned_resources(version)
                .into_iter()
                .find(|(r, _)| r.kind == K::KIND)
            {
                return Ok(Some(resource));
            }
        }
        Ok(None)
    }

    fn objects(
        &self,
        resource: &ApiResource,
    ) -> impl Stream<Item = watcher::Result<WatchEvent<DynamicObject>>> + use<K> {
        let api = match &self.scope.namespace {
            Some(ns) => Api::<DynamicObject>::namespaced_with(self.host.clone(), ns, resource),
            None => Api::<DynamicObject>::all_with(self.host.clone(), resource),
        };
        let mut config = watcher::Config::default();
        if let Some(labels) = &self.scope.labels {
            config = config.labels(labels);
        }
        watcher::watcher(api, config).default_backoff()
    }

    fn secrets(
        &self,
        config: watcher::Config,
    ) -> impl Stream<Item = watcher::Result<WatchEvent<Secret>>> + use<K> {
        let api = match &self.scope.namespace {
            Some(ns) => Api::<Secret>::namespaced(self.host.clone(), ns),
            None => Api::<Secret>::all(self.host.clone()),
        };
        watcher::watcher(api, config).default_backoff()
    }

    fn is_ready(&self, object: &DynamicObject) -> bool {
        match &self.scope.ready {
            Some(ready) => ready(object),
            None => self.kind.default_ready(object),
        }
    }

    /// Whether `object` is live: present, not being deleted, ready.
    fn is_live(&self, object: Option<&DynamicObject>) -> bool {
        object.is_some_and(|o| o.meta().deletion_timestamp.is_none() && self.is_ready(o))
    }

    /// Whether an object with this recipe may stand for its member: its cluster can be built
    /// from what the hub holds, or its credentials were revoked and are kept.
    fn may_hold(&self, recipe: &Result<(u64, K::Recipe), NoRecipe>) -> bool {
        match recipe {
            Ok(_) => true,
            Err(NoRecipe::Revoked(_)) => self.scope.keep_revoked,
            Err(NoRecipe::Unusable(_)) => false,
        }
    }

    /// The object that stands for the member cluster `key`'s object describes, if another
    /// does: of the objects filed under its member id that are live and whose cluster can be
    /// built from what the hub holds (a recipe), the earliest created, then the first by key.
    /// It depends on the hub's objects alone, so every replica picks the same one.
    fn member_holder(&self, state: &State, key: &str) -> Option<String> {
        let id = state.objects.get(key)?.member.as_ref()?;
        let holder = state
            .members
            .get(id)?
            .iter()
            .filter_map(|k| Some((k, state.objects.get(k)?.object.as_ref()?)))
            .filter(|(_, o)| self.is_live(Some(o)))
            .filter(|(_, o)| self.may_hold(&self.kind.recipe(o, &state.secrets)))
            .min_by(|(a, x), (b, y)| {
                let created = |o: &DynamicObject| o.meta().creation_timestamp.clone().map(|t| t.0);
                created(x).cmp(&created(y)).then_with(|| a.cmp(b))
            })
            .map(|(k, _)| k.clone())?;
        (holder != key).then_some(holder)
    }

    fn step(&self, state: &mut State, key: &str) -> Step<K::Recipe> {
        if !state.secrets_listed {
            return Step::Nothing;
        }
        // While the objects are being listed, one with a member id waits for the listing's
        // end (which steps every object): an older object of its id may come later in it.
        if state.listing_objects.is_some()
            && state.objects.get(key).is_some_and(|k| k.member.is_some())
        {
            return Step::Nothing;
        }
        let holder = self.member_holder(state, key);
        // The holder's own cluster, once engaged, takes over: until then an engaged one stays.
        let holder_engaged = holder
            .as_ref()
            .and_then(|h| state.objects.get(h))
            .is_some_and(|h| h.engaged.is_some());
        let Some(known) = state.objects.get_mut(key) else {
            return Step::Nothing;
        };
        let present = known
            .object
            .as_ref()
            .filter(|o| o.meta().deletion_timestamp.is_none());
        let Some(object) = present.filter(|o| self.is_ready(o)) else {
            known.wanted = None;
            known.reported = None;
            known.failed = None;
            let engaged = known.engaged.take().is_some();
            // Gone or being deleted: for good (a cluster paused before leaves too). Not
            // ready: paused, still of the fleet.
            return match (present, engaged) {
                (None, _) => Step::Depart,
                (Some(_), true) => Step::Pause,
                (Some(_), false) => Step::Nothing,
            };
        };
        let recipe = self.kind.recipe(object, &state.secrets);
        // Only an object that could stand for its member stands aside for another; one that
        // could not says why (below).
        if let Some(holder) = holder.filter(|_| self.may_hold(&recipe)) {
            if known.engaged.is_some() && !holder_engaged {
                return Step::Nothing;
            }
            known.wanted = None;
            known.failed = None;
            // Another namespace's object is not named (a tenant reading Events of its own
            // namespace would learn of it).
            let other = if holder.split_once('/').map(|(ns, _)| ns)
                == key.split_once('/').map(|(ns, _)| ns)
            {
                format!("{} {holder}", K::WHAT)
            } else {
                format!("a {} of another namespace", K::WHAT)
            };
            let problem = format!(
                "{other} has the same member id and comes first (created earlier, or first by name): only that one is engaged"
            );
            let fingerprint = version_of(&problem);
            let paused = known.engaged.take().is_some();
            if !paused && known.reported == Some(fingerprint) {
                return Step::Nothing;
            }
            known.reported = Some(fingerprint);
            return Step::Duplicate(problem, paused);
        }
        match recipe {
            Ok((version, recipe)) => {
                if known.engaged == Some(version) {
                    // Back to what is engaged: a build of something else in flight is
                    // dropped when it lands, and a problem seen meanwhile is reported
                    // again if it comes back.
                    known.wanted = None;
                    known.failed = None;
                    known.reported = None;
                    return Step::Nothing;
                }
                if known.wanted == Some(version) {
                    return Step::Nothing;
                }
                match &mut known.failed {
                    // Built again when its retry is due.
                    Some(failed) if failed.version == version && !failed.due => {
                        return Step::Nothing;
                    }
                    Some(failed) if failed.version == version => failed.due = false,
                    _ => known.failed = None,
                }
                known.wanted = Some(version);
                Step::Build(version, recipe)
            }
            Err(refusal) => {
                let (problem, revoked) = match refusal {
                    NoRecipe::Revoked(problem) => (problem, !self.scope.keep_revoked),
                    NoRecipe::Unusable(problem) => (problem, false),
                };
                let fingerprint = version_of(&problem);
                known.wanted = None;
                known.failed = None;
                if revoked && known.engaged.take().is_some() {
                    known.reported = Some(fingerprint);
                    return Step::Revoke(problem);
                }
                if known.reported == Some(fingerprint) {
                    return Step::Nothing;
                }
                known.reported = Some(fingerprint);
                Step::Report(problem)
            }
        }
    }

    async fn report(
        &self,
        recorder: &Recorder,
        object: &DynamicObject,
        resource: &ApiResource,
        problem: &str,
    ) {
        self.report_as(
            recorder,
            object,
            resource,
            super::KUBECONFIG_REFUSED,
            problem,
        )
        .await;
    }

    async fn report_as(
        &self,
        recorder: &Recorder,
        object: &DynamicObject,
        resource: &ApiResource,
        reason: &str,
        problem: &str,
    ) {
        let key = key_of(object);
        tracing::warn!(cluster = %key, error = %problem, "{} not engaged", K::WHAT);
        super::record_refusal_as(
            recorder,
            &object.object_ref(resource),
            &key,
            reason,
            problem,
        )
        .await;
    }

    /// Waits until the hub serves the kind (looking again every 10 s); `None` at shutdown.
    async fn kind_served(&self, shutdown: &CancellationToken) -> Option<ApiResource> {
        let mut waited = false;
        loop {
            match self.discover().await {
                Ok(Some(resource)) => return Some(resource),
                Ok(None) if !waited => {
                    tracing::warn!(
                        group = K::GROUP,
                        kind = K::KIND,
                        "the kind is not served (not installed?); looking again every 10 s"
                    );
                    waited = true;
                }
                Ok(None) => {}
                Err(error) => {
                    tracing::warn!(group = K::GROUP, error = %crate::client::Shown(&error), "discovery failed; retrying")
                }
            }
            tokio::select! {
                () = shutdown.cancelled() => return None,
                () = tokio::time::sleep(DISCOVERY_RETRY) => {}
            }
        }
    }

    /// Follows an event of the kind's watch: the keys whose object changed, or `None`.
    fn object_event(
        state: &mut State,
        event: watcher::Result<WatchEvent<DynamicObject>>,
    ) -> Option<Vec<String>> {
        let keys = match event {
            Err(error) => {
                tracing::warn!(error = %crate::client::Shown(&error), "watching {}s failed; retrying", K::WHAT);
                return None;
            }
            Ok(WatchEvent::Init) => {
                state.listing_objects = Some(BTreeSet::new());
                return None;
            }
            Ok(WatchEvent::InitDone) => {
                let listed = state.listing_objects.take().unwrap_or_default();
                state
                    .objects
                    .iter_mut()
                    .filter(|(key, _)| !listed.contains(key.as_str()))
                    .for_each(|(_, known)| known.object = None);
                state.objects.keys().cloned().collect()
            }
            Ok(WatchEvent::InitApply(object)) => {
                let key = key_of(&object);
                if let Some(listing) = &mut state.listing_objects {
                    listing.insert(key.clone());
                }
                state.objects.entry(key.clone()).or_default().object = Some(object);
                vec![key]
            }
            Ok(WatchEvent::Apply(object)) => {
                let key = key_of(&object);
                state.objects.entry(key.clone()).or_default().object = Some(object);
                vec![key]
            }
            Ok(WatchEvent::Delete(object)) => {
                let key = key_of(&object);
                if let Some(known) = state.objects.get_mut(&key) {
                    known.object = None;
                }
                vec![key]
            }
        };
        Some(keys)
    }

    /// Follows an event of the Secrets' watch: the keys whose credentials may have changed,
    /// or `None`.
    fn secret_event(
        &self,
        state: &mut State,
        event: watcher::Result<WatchEvent<Secret>>,
    ) -> Option<Vec<String>> {
        let keys = match event {
            Err(error) => {
                tracing::warn!(error = %crate::client::Shown(&error), "watching the Secrets of {}s failed; retrying", K::WHAT);
                return None;
            }
            Ok(WatchEvent::Init) => {
                state.listing_secrets = Some(BTreeSet::new());
                return None;
            }
            Ok(WatchEvent::InitDone) => {
                let listed = state.listing_secrets.take().unwrap_or_default();
                state.secrets.by_key.retain(|key, _| listed.contains(key));
                state.unread.retain(|key| listed.contains(key));
                state.secrets_listed = true;
                state.objects.keys().cloned().collect()
            }
            Ok(WatchEvent::InitApply(secret)) => {
                // Looked at all together when the listing is complete.
                let key = (secret.namespace().unwrap_or_default(), secret.name_any());
                if let Some(listing) = &mut state.listing_secrets {
                    listing.insert(key);
                }
                state.take_secret(secret, self.kind.as_ref());
                return None;
            }
            Ok(WatchEvent::Apply(secret)) => {
                let namespace = state.take_secret(secret, self.kind.as_ref());
                in_namespace(&state.objects, &namespace)
            }
            Ok(WatchEvent::Delete(secret)) => {
                let namespace = secret.namespace().unwrap_or_default();
                let key = (namespace.clone(), secret.name_any());
                state.secrets.by_key.remove(&key);
                state.unread.remove(&key);
                in_namespace(&state.objects, &namespace)
            }
        };
        Some(keys)
    }

    /// Reads the Secrets objects name that were seen but not kept.
    async fn read_named(&self, state: &mut State) {
        for (namespace, name) in state.settle_named(self.kind.as_ref()) {
            // An object names a Secret seen but not kept: read it now.
            let api: Api<Secret> = Api::namespaced(self.host.clone(), &namespace);
            match api.get_opt(&name).await {
                Ok(Some(secret)) if self.kind.reads_secret(&secret) => {
                    state.take_secret(secret, self.kind.as_ref());
                }
                Ok(_) => {
                    state.unread.remove(&(namespace, name));
                }
                Err(error) => {
                    tracing::warn!(%namespace, secret = %name, error = %crate::client::Shown(&error), "reading a Secret {}s name failed; read again with its next change", K::WHAT);
                }
            }
        }
    }

    async fn run(
        &self,
        fleet: Fleet<ClusterName>,
        shutdown: CancellationToken,
    ) -> Result<(), ProviderError> {
        let Some(resource) = self.kind_served(&shutdown).await else {
            return Ok(());
        };
        tracing::info!(group = K::GROUP, kind = K::KIND, version = %resource.version, "watching {}s", K::WHAT);
        let recorder = Recorder::new(self.host.clone(), Reporter::from(K::REPORTER));
        let mut objects = pin!(self.objects(&resource));
        let secret_config = self.kind.secrets();
        let mut state = State {
            secrets_listed: secret_config.is_none(),
            ..State::default()
        };
        let mut secrets = pin!(match secret_config {
            Some(config) => self.secrets(config).left_stream(),
            None => futures::stream::pending().right_stream(),
        });
        let mut building = FuturesUnordered::new();
        let mut inflight = super::InFlight::default();
        let mut retries = FuturesUnordered::new();
        let mut waiting: VecDeque<(String, u64, K::Recipe)> = VecDeque::new();
        loop {
            while building.len() < BUILDS_AT_ONCE
                && let Some((key, version, recipe)) = waiting.pop_front()
            {
                if state.objects.get(&key).and_then(|k| k.wanted) == Some(version) {
                    let build = self.kind.build(ClusterName::from(key.clone()), recipe);
                    let started = key.clone();
                    building.push(
                        inflight.start(
                            started,
                            version,
                            async move { (key, version, build.await) },
                        ),
                    );
                }
            }
            // The keys whose object or credentials changed.
            let changed: Vec<String> = tokio::select! {
                () = shutdown.cancelled() => return Ok(()),
                Some(built) = building.next(), if !building.is_empty() => {
                    // Ended: superseded, or its object gone.
                    let Ok((key, version, built)) = built else {
                        continue;
                    };
                    inflight.done(&key, version);
                    let Some(known) = state.objects.get_mut(&key).filter(|k| k.wanted == Some(version)) else {
                        continue;
                    };
                    known.wanted = None;
                    match built {
                        Ok(cluster) => match fleet.engage(cluster) {
                            Ok(_) => {
                                known.engaged = Some(version);
                                known.reported = None;
                                known.failed = None;
                                // Its member's other object, engaged until now, steps aside.
                                let peers = state.refile(vec![key], self.kind.as_ref());
                                if peers.len() > 1 {
                                    peers
                                } else {
                                    continue;
                                }
                            }
                            Err(error) => {
                                tracing::warn!(cluster = %key, %error, "could not engage");
                                continue;
                            }
                        },
                        Err(reason) => {
                            let attempts = match &known.failed {
                                Some(failed) if failed.version == version => failed.attempts + 1,
                                _ => 1,
                            };
                            known.failed = Some(Failed { version, attempts, due: false });
                            let wait = retry_after(attempts);
                            retries.push(async move {
                                tokio::time::sleep(wait).await;
                                (key, version)
                            });
                            let fingerprint = version_of(&reason);
                            if known.reported != Some(fingerprint) {
                                known.reported = Some(fingerprint);
                                if let Some(object) = known.object.clone() {
                                    self.report(&recorder, &object, &resource, &reason).await;
                                }
                            }
                            continue;
                        }
                    }
                }
                Some((key, version)) = retries.next(), if !retries.is_empty() => {
                    match state.objects.get_mut(&key).and_then(|k| k.failed.as_mut()) {
                        Some(failed) if failed.version == version => failed.due = true,
                        _ => continue,
                    }
                    vec![key]
                }
                event = objects.next() => match event {
                    None => return Ok(()),
                    Some(event) => match Self::object_event(&mut state, event) {
                        Some(keys) => state.refile(keys, self.kind.as_ref()),
                        None => continue,
                    },
                },
                event = secrets.next() => match event {
                    None => return Ok(()),
                    // Which object of a member id comes first depends on its credentials too.
                    Some(event) => match self.secret_event(&mut state, event) {
                        Some(keys) => state.refile(keys, self.kind.as_ref()),
                        None => continue,
                    },
                },
            };
            self.read_named(&mut state).await;
            for key in changed {
                match self.step(&mut state, &key) {
                    Step::Nothing => {}
                    Step::Depart => {
                        let id = ClusterName::from(key.clone());
                        if fleet.holds(&id) {
                            tracing::info!(cluster = %key, "{} gone or being deleted; disengaged for good", K::WHAT);
                            fleet.disengage(&id);
                        }
                    }
                    Step::Pause => {
                        tracing::info!(cluster = %key, "{} not ready; paused (its webhook configurations stay)", K::WHAT);
                        fleet.pause(&ClusterName::from(key.clone()));
                    }
                    Step::Build(version, recipe) => {
                        waiting.push_back((key.clone(), version, recipe))
                    }
                    Step::Report(problem) => {
                        if let Some(object) = state.objects.get(&key).and_then(|k| k.object.clone())
                        {
                            self.report(&recorder, &object, &resource, &problem).await;
                        }
                    }
                    Step::Duplicate(problem, paused) => {
                        if paused {
                            fleet.pause(&ClusterName::from(key.clone()));
                        }
                        if let Some(object) = state.objects.get(&key).and_then(|k| k.object.clone())
                        {
                            self.report_as(
                                &recorder,
                                &object,
                                &resource,
                                DUPLICATE_MEMBER,
                                &problem,
                            )
                            .await;
                        }
                    }
                    Step::Revoke(problem) => {
                        fleet.pause(&ClusterName::from(key.clone()));
                        let problem = format!("{problem}; paused (its credentials were removed)");
                        if let Some(object) = state.objects.get(&key).and_then(|k| k.object.clone())
                        {
                            self.report(&recorder, &object, &resource, &problem).await;
                        }
                    }
                }
                // A build of another version than the one wanted (or of none) ends.
                match state.objects.get(&key).and_then(|k| k.wanted) {
                    Some(version) => inflight.supersede(&key, version),
                    None => inflight.cancel(&key),
                }
                // Forget objects that are gone and hold nothing (refiled without an object, so
                // filed under no member id).
                if state.objects.get(&key).is_some_and(|k| {
                    k.object.is_none() && k.engaged.is_none() && k.wanted.is_none()
                }) {
                    state.objects.remove(&key);
                }
            }
        }
    }
}

/// The keys of the objects of `namespace` (their credentials may be in its Secrets).
fn in_namespace(objects: &BTreeMap<String, Known>, namespace: &str) -> Vec<String> {
    let prefix = format!("{namespace}/");
    objects
        .range(prefix.clone()..)
        .take_while(|(key, _)| key.starts_with(&prefix))
        .map(|(key, _)| key.clone())
        .collect()
}

/// Runs the provider of `kind` on the hub `host` until `shutdown`.
pub(crate) async fn run<K: HubKind>(
    kind: Arc<K>,
    host: Client,
    scope: Scope,
    fleet: Fleet<ClusterName>,
    shutdown: CancellationToken,
) -> Result<(), ProviderError> {
    Engine { kind, host, scope }.run(fleet, shutdown).await
}

/// What every hub provider (a struct with `host: Client`, `scope: Scope` and
/// `kind: Arc<impl HubKind>`) has alike: the scope's builder methods and the [`Provider`]
/// implementation. `$objects` names its objects in the docs ("Clusters").
macro_rules! hub_provider {
    ($provider:ident, $objects:literal) => {
        impl $provider {
            #[doc = concat!("Only the ", $objects, " (and Secrets) of `namespace`.")]
            #[must_use]
            pub fn namespace(mut self, namespace: impl Into<String>) -> Self {
                self.scope.namespace = Some(namespace.into());
                self
            }

            #[doc = concat!("Only the ", $objects, " matching a label selector (`env=prod,tier!=test`).")]
            #[must_use]
            pub fn labels(mut self, selector: impl Into<String>) -> Self {
                self.scope.labels = Some(selector.into());
                self
            }

            /// Whether a cluster stays engaged, with the credentials it was built from, when
            /// the Secret holding them is deleted or no longer selected (unlabelled,
            /// retyped). By default it is paused ([`Fleet::pause`](crate::Fleet::pause),
            /// with a Warning Event saying why), as removing the Secret is how credentials
            /// are revoked; engaged again when a Secret is back. A Secret that is there but
            /// unusable never disengages a cluster. Nothing to revoke for clusters reached through exec plugins.
            #[must_use]
            pub fn keep_when_credentials_removed(mut self, keep: bool) -> Self {
                self.scope.keep_revoked = keep;
                self
            }

            /// Another readiness rule, in place of the default (see the type's docs).
            #[must_use]
            pub fn ready(
                mut self,
                ready: impl Fn(&kube::api::DynamicObject) -> bool + Send + Sync + 'static,
            ) -> Self {
                self.scope.ready = Some(std::sync::Arc::new(ready));
                self
            }
        }

        impl $crate::provider::Provider for $provider {
            type Id = $crate::cluster::ClusterName;

            async fn run(
                &self,
                fleet: $crate::fleet::Fleet<$crate::cluster::ClusterName>,
                shutdown: tokio_util::sync::CancellationToken,
            ) -> Result<(), $crate::provider::ProviderError> {
                super::hub::run(
                    self.kind.clone(),
                    self.host.clone(),
                    self.scope.clone(),
                    fleet,
                    shutdown,
                )
                .await
            }
        }
    };
}
pub(crate) use hub_provider;
