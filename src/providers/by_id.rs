//! [`Identified`] and [`ById`]: any provider's clusters with their KEP-2149 identity, read
//! from each cluster's `ClusterProperty` objects, kept by name or keyed by the cluster's own
//! id, optionally only the members of one ClusterSet.

use std::collections::{BTreeMap, BTreeSet};
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::ObjectReference;
use kube::api::DynamicObject;
use kube::{Api, ResourceExt};
use kube_runtime::WatchStreamExt;
use kube_runtime::events::{Event, EventType, Recorder, Reporter};
use kube_runtime::watcher::{self, Event as WatchEvent};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::cluster::property_value;
use crate::cluster::{Cluster, ClusterId, ClusterIdentity, ClusterName};
use crate::fleet::Fleet;
use crate::fleet::FleetEvent;
use crate::provider::{Provider, ProviderError};

/// The clusters of `P` under their own names, each with its [`ClusterIdentity`]
/// ([`Cluster::identity`]), read from the cluster's `ClusterProperty` objects
/// (`about.k8s.io/v1alpha1`) and kept up to date by a watch on them while it is engaged.
///
/// Without a ClusterSet filter a cluster is engaged at once, its identity filled in when
/// read (a cluster without the `ClusterProperty` kind has an empty one). With
/// [`Identified::clusterset`], a cluster is engaged only once its properties are read and
/// `clusterset.k8s.io` names that ClusterSet, and disengaged when it stops doing so (it
/// left the set).
#[derive(Clone, Debug)]
pub struct Identified<P> {
    inner: P,
    clusterset: Option<String>,
}

/// The clusters of `P` keyed by their own id (`cluster.clusterset.k8s.io`) instead of the
/// provider's name, so that a cluster keeps its id across renames of whatever the provider
/// reads (a kubeconfig context, a Secret, a hub object). Each carries its
/// [`ClusterIdentity`] ([`Cluster::identity`]).
///
/// A cluster is engaged once its properties are read and its id is a valid RFC 1123 DNS
/// subdomain (as the KEP requires); one without an id is not engaged (a warning says so).
/// With [`ById::clusterset`], only the members of that ClusterSet.
///
/// An id is what a cluster says of itself: whoever may write `ClusterProperty` objects in a
/// member (its admins) can claim any id. So an id claimed by two clusters is engaged for
/// **neither** (a WARN and a Warning Event `ClusterIdContested` on each claimant's
/// `cluster.clusterset.k8s.io` property name them all), until only one claims it; and
/// [`ById::expect_id`] can require every claim to match what the provider side records.
#[derive(Clone)]
pub struct ById<P: Provider> {
    inner: P,
    clusterset: Option<String>,
    expected: Option<Expected<P::Id>>,
}

/// The id the provider side records for a cluster of the inner provider.
type Expected<I> = Arc<dyn Fn(&I) -> Option<String> + Send + Sync>;

impl<P: Provider + std::fmt::Debug> std::fmt::Debug for ById<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ById")
            .field("inner", &self.inner)
            .field("clusterset", &self.clusterset)
            .field("expects_ids", &self.expected.is_some())
            .finish()
    }
}

impl<P: Provider> Identified<P> {
    /// Every cluster of `inner`, with its identity.
    pub fn new(inner: P) -> Self {
        Self {
            inner,
            clusterset: None,
        }
    }

    /// Only the members of ClusterSet `clusterset` (property `clusterset.k8s.io`).
    #[must_use]
    pub fn clusterset(mut self, clusterset: impl Into<String>) -> Self {
        self.clusterset = Some(clusterset.into());
        self
    }
}

impl<P: Provider> ById<P> {
    /// The clusters of `inner` that have an id, keyed by it.
    pub fn new(inner: P) -> Self {
        Self {
            inner,
            clusterset: None,
            expected: None,
        }
    }

    /// Only the members of ClusterSet `clusterset` (property `clusterset.k8s.io`).
    #[must_use]
    pub fn clusterset(mut self, clusterset: impl Into<String>) -> Self {
        self.clusterset = Some(clusterset.into());
        self
    }

    /// Engages a cluster only if the id it claims is the one `expected` gives for its name in
    /// the inner provider: a record the provider side keeps (a hub object's field, a naming
    /// rule, `|name| Some(name.to_string())` where the inner names are the ids). A cluster
    /// claiming another id, or one `expected` has no id for, is not engaged (a WARN and a
    /// Warning Event `ClusterIdUnexpected` on its `cluster.clusterset.k8s.io` property).
    #[must_use]
    pub fn expect_id(
        mut self,
        expected: impl Fn(&P::Id) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        self.expected = Some(Arc::new(expected));
        self
    }
}

impl<P: Provider> Provider for Identified<P> {
    type Id = P::Id;

    async fn run(
        &self,
        fleet: Fleet<P::Id>,
        shutdown: CancellationToken,
    ) -> Result<(), ProviderError> {
        let clusterset = self.clusterset.clone();
        let rule = Rule {
            wait: clusterset.is_some(),
            key: Box::new(move |name: &P::Id, identity: &ClusterIdentity| {
                member_of(identity, clusterset.as_deref())?;
                Ok(name.clone())
            }),
        };
        run(&self.inner, rule, fleet, shutdown).await
    }
}

impl<P: Provider> Provider for ById<P> {
    type Id = ClusterName;

    async fn run(
        &self,
        fleet: Fleet<ClusterName>,
        shutdown: CancellationToken,
    ) -> Result<(), ProviderError> {
        let clusterset = self.clusterset.clone();
        let expected = self.expected.clone();
        let rule = Rule {
            wait: true,
            key: Box::new(move |name: &P::Id, identity: &ClusterIdentity| {
                let Some(id) = identity.id.as_deref() else {
                    return Err(Refusal::Other(format!(
                        "it has no id (no ClusterProperty {})",
                        ClusterIdentity::ID_PROPERTY
                    )));
                };
                if !ClusterIdentity::is_valid_id(id) {
                    return Err(Refusal::Other(format!(
                        "its id {id:?} is not an RFC 1123 DNS subdomain"
                    )));
                }
                member_of(identity, clusterset.as_deref())?;
                if let Some(expected) = &expected {
                    match expected(name) {
                        Some(expected) if expected == id => {}
                        Some(expected) => {
                            return Err(Refusal::Unexpected(format!(
                                "it claims the id {id:?}; the provider expects {expected:?}"
                            )));
                        }
                        None => {
                            return Err(Refusal::Unexpected(format!(
                                "it claims the id {id:?}; the provider expects no id for it"
                            )));
                        }
                    }
                }
                Ok(ClusterName::from(id))
            }),
        };
        run(&self.inner, rule, fleet, shutdown).await
    }
}

fn member_of(identity: &ClusterIdentity, clusterset: Option<&str>) -> Result<(), Refusal> {
    match clusterset {
        Some(set) if identity.clusterset.as_deref() != Some(set) => Err(Refusal::Other(format!(
            "it is not a member of the ClusterSet {set:?}"
        ))),
        _ => Ok(()),
    }
}

/// Why a cluster of the inner provider is not engaged (words for a log line and an Event).
#[derive(Clone, Debug, PartialEq, Eq)]
enum Refusal {
    /// Its claim does not match the provider side's record (an Event says so).
    Unexpected(String),
    /// No valid id, or not a member of the ClusterSet (a log line).
    Other(String),
}

/// The id a cluster of the inner provider is engaged under, from its name there and its
/// identity; or why it is not engaged.
type Key<I, D> = Box<dyn Fn(&I, &ClusterIdentity) -> Result<D, Refusal> + Send + Sync>;

/// Under which id (if any) a cluster of the inner provider is engaged.
struct Rule<I, D> {
    /// Engage only once the properties are read.
    wait: bool,
    key: Key<I, D>,
}

/// One cluster of the inner provider.
struct Member<I: ClusterId, D: ClusterId> {
    cluster: Cluster<I>,
    /// Tells the reports of this instance's property watch from an earlier one's.
    generation: u64,
    /// Stops the property watch.
    _watch: tokio_util::sync::DropGuard,
    /// The identity read, once the first listing is complete.
    identity: Option<ClusterIdentity>,
    /// The `ClusterProperty` version it serves (for Events about its properties).
    version: &'static str,
    /// The outer id it claims.
    claim: Option<D>,
    /// Where it is engaged in the outer fleet (under its claim).
    engaged: Option<Outer<I, D>>,
    /// The warning last logged about it (why it is not engaged, with the identity read),
    /// so that each is logged once.
    warned: Option<(String, Option<ClusterIdentity>)>,
    /// The inner provider paused it: its claim stands, its engagement under it is paused.
    paused: bool,
}

/// A member's engagement in the outer fleet.
struct Outer<I: ClusterId, D: ClusterId> {
    id: D,
    cluster: Cluster<D>,
    /// Disengages `cluster` when cancelled.
    token: CancellationToken,
    /// The member's instance `cluster` was made from.
    source: Cluster<I>,
}

impl<I: ClusterId, D: ClusterId> Outer<I, D> {
    /// Disengages the cluster now (if it is still the one engaged under its id), not when
    /// the token's task gets to it: a cluster waiting for the id may take it in the same
    /// pass, and one equal to this one would otherwise find it still engaged.
    fn leave(&self, fleet: &Fleet<D>) {
        fleet.disengage_instance(&self.cluster);
        self.token.cancel();
    }

    /// Pauses the cluster ([`Fleet::pause`]): its id is contested, or the inner provider
    /// paused it. The token is left alone (the outer fleet no longer watches it).
    fn pause(self, fleet: &Fleet<D>) {
        fleet.pause_instance(&self.cluster);
    }
}

/// What a property watch reports: the identity after a complete listing or a change.
struct Report<I> {
    name: I,
    generation: u64,
    identity: ClusterIdentity,
    /// The version read.
    version: &'static str,
}

async fn run<P: Provider, D: ClusterId>(
    inner: &P,
    rule: Rule<P::Id, D>,
    fleet: Fleet<D>,
    shutdown: CancellationToken,
) -> Result<(), ProviderError> {
    let own = Fleet::<P::Id>::new();
    let mut events = own.subscribe();
    let (reports, mut reported) = mpsc::unbounded_channel::<Report<P::Id>>();
    let mut members = Members::<P::Id, D>::default();
    let mut generation = 0u64;
    let mut run = pin!(inner.run(own.clone(), shutdown.clone()));
    let mut inner_done = false;
    let result = loop {
        // The member whose cluster or identity changed.
        let changed = tokio::select! {
            () = shutdown.cancelled() => break Ok(()),
            result = &mut run, if !inner_done => match result {
                // A provider may engage its clusters and return; they stay.
                Ok(()) => {
                    inner_done = true;
                    continue;
                }
                Err(error) => break Err(error),
            },
            Some(event) = events.recv() => match event {
                FleetEvent::Engaged(engaged) | FleetEvent::Replaced { new: engaged, .. } => {
                    let cluster = engaged.cluster;
                    generation += 1;
                    let watch = CancellationToken::new();
                    tokio::spawn(watch_properties(
                        cluster.clone(),
                        generation,
                        reports.clone(),
                        watch.clone(),
                    ));
                    let name = cluster.id().clone();
                    let previous = members.by_name.remove(&name);
                    members.by_name.insert(name.clone(), Member {
                        cluster,
                        generation,
                        _watch: watch.drop_guard(),
                        // The identity read from the instance it replaces stands until this
                        // one's is read.
                        identity: previous.as_ref().and_then(|m| m.identity.clone()),
                        version: previous.as_ref().map_or(ClusterIdentity::VERSIONS[0], |m| m.version),
                        claim: previous.as_ref().and_then(|m| m.claim.clone()),
                        engaged: previous.and_then(|m| m.engaged),
                        warned: None,
                        paused: false,
                    });
                    name
                }
                // Paused: a `Departed` follows when it left for good.
                FleetEvent::Disengaged(engaged) => {
                    let id = engaged.cluster.id();
                    if members.by_name.get(id).is_some_and(|m| m.cluster.same_instance(&engaged.cluster)) {
                        members.pause(&fleet, id);
                    }
                    continue;
                }
                FleetEvent::Departed(cluster) => {
                    let id = cluster.id();
                    if members.by_name.get(id).is_some_and(|m| m.cluster.same_instance(&cluster)) {
                        members.remove(&fleet, id);
                    }
                    continue;
                }
            },
            Some(report) = reported.recv() => match members.by_name.get_mut(&report.name) {
                Some(member) if member.generation == report.generation => {
                    member.identity = Some(report.identity);
                    member.version = report.version;
                    report.name
                }
                _ => continue,
            }
        };
        members.place(&rule, &fleet, &changed);
    };
    own.clear();
    for member in members.by_name.into_values() {
        if let Some(outer) = member.engaged {
            outer.leave(&fleet);
        }
    }
    result
}

/// The clusters of the inner provider, the outer ids they claim, and which of them holds
/// each.
struct Members<I: ClusterId, D: ClusterId> {
    by_name: BTreeMap<I, Member<I, D>>,
    /// The members claiming each outer id: one is engaged under it only while it is the only
    /// claimant (a contested id is engaged for none).
    claims: BTreeMap<D, BTreeSet<I>>,
    /// The member engaged under each id.
    holders: BTreeMap<D, I>,
}

impl<I: ClusterId, D: ClusterId> Default for Members<I, D> {
    fn default() -> Self {
        Self {
            by_name: BTreeMap::new(),
            claims: BTreeMap::new(),
            holders: BTreeMap::new(),
        }
    }
}

/// The id a member is to be engaged under, from its identity.
enum Wanted<D> {
    /// Its identity is not read yet (and the rule waits for it).
    Unread,
    Id(D),
    Not(Refusal),
}

impl<I: ClusterId, D: ClusterId> Members<I, D> {
    /// The member `name` is gone: the id it claimed is settled without it.
    fn remove(&mut self, fleet: &Fleet<D>, name: &I) {
        let Some(member) = self.by_name.remove(name) else {
            return;
        };
        if let Some(outer) = member.engaged {
            outer.leave(fleet);
            self.holders.remove(&outer.id);
        }
        if let Some(claim) = member.claim {
            self.unclaim(&claim, name);
            self.settle(fleet, &claim);
        }
    }

    /// The inner provider paused member `name`: its claim stands (a contest still counts
    /// it), and its engagement is paused until the inner provider engages it again.
    fn pause(&mut self, fleet: &Fleet<D>, name: &I) {
        let Some(member) = self.by_name.get_mut(name) else {
            return;
        };
        member.paused = true;
        if let Some(outer) = member.engaged.take() {
            outer.pause(fleet);
        }
    }

    fn unclaim(&mut self, id: &D, name: &I) {
        if let Some(claimants) = self.claims.get_mut(id) {
            claimants.remove(name);
            if claimants.is_empty() {
                self.claims.remove(id);
            }
        }
    }

    /// Brings the outer fleet in line with member `name`'s cluster and identity.
    fn place(&mut self, rule: &Rule<I, D>, fleet: &Fleet<D>, name: &I) {
        let Some(member) = self.by_name.get_mut(name) else {
            return;
        };
        let wanted = want(rule, name, member);
        let claim = match &wanted {
            Wanted::Id(id) => Some(id.clone()),
            Wanted::Unread | Wanted::Not(_) => None,
        };
        let before = std::mem::replace(&mut member.claim, claim.clone());
        if let Wanted::Not(refusal) = &wanted {
            let (why, event) = match refusal {
                Refusal::Unexpected(why) => (why.as_str(), Some("ClusterIdUnexpected")),
                Refusal::Other(why) => (why.as_str(), None),
            };
            let why = format!("not engaged: {why}");
            warn_once(
                member,
                name,
                &why,
                event.map(|reason| (reason, why.as_str())),
            );
        }
        if before != claim {
            if let Some(old) = &before {
                self.unclaim(old, name);
            }
            if let Some(new) = &claim {
                self.claims
                    .entry(new.clone())
                    .or_default()
                    .insert(name.clone());
            }
            if let Some(old) = &before {
                self.settle(fleet, old);
            }
        }
        if let Some(id) = &claim {
            self.settle(fleet, id);
        }
    }

    /// Brings the engagement under `id` in line with its claims: the only claimant is
    /// engaged under it; a contested id is engaged for none.
    fn settle(&mut self, fleet: &Fleet<D>, id: &D) {
        let claimants: Vec<I> = self
            .claims
            .get(id)
            .map(|c| c.iter().cloned().collect())
            .unwrap_or_default();
        if let Some(holder) = self.holders.get(id).cloned()
            && claimants != [holder.clone()]
        {
            if let Some(outer) = self.by_name.get_mut(&holder).and_then(|m| m.engaged.take()) {
                if claimants.contains(&holder) {
                    // Contested: the holder's claim stands, so it is paused, not gone. Its
                    // webhook configurations stay and its reviews are answered: another
                    // member claiming its id cannot turn its admission off.
                    outer.pause(fleet);
                } else {
                    outer.leave(fleet);
                }
            }
            self.holders.remove(id);
        }
        match claimants.as_slice() {
            // Nobody claims the id any more: a cluster paused under it leaves for good.
            [] => {
                fleet.disengage(id);
            }
            [only] => self.engage(fleet, only, id),
            all => {
                let names: Vec<String> = all.iter().map(ToString::to_string).collect();
                let why = format!(
                    "not engaged: the id {id} is claimed by {} clusters ({}); none is engaged under it until one claim is withdrawn",
                    all.len(),
                    names.join(", ")
                );
                // In each claimant's cluster, only that the id is contested: the other
                // claimants' names (file paths, Secret and profile names) are the host's.
                let note = format!(
                    "not engaged: the id {id} is claimed by another cluster too; none is engaged under it until one claim is withdrawn"
                );
                for name in all {
                    if let Some(member) = self.by_name.get_mut(name) {
                        warn_once(member, name, &why, Some(("ClusterIdContested", &note)));
                    }
                }
            }
        }
    }

    /// Engages member `name` under `id` (its only claimant), or refreshes the identity of
    /// the engagement it has.
    fn engage(&mut self, fleet: &Fleet<D>, name: &I, id: &D) {
        let Some(member) = self.by_name.get_mut(name) else {
            return;
        };
        if member.paused {
            return;
        }
        let identity = member.identity.clone();
        if let Some(outer) = &member.engaged
            && outer.source.same_instance(&member.cluster)
        {
            outer.cluster.set_identity(identity);
            return;
        }
        // Not engaged, or the inner provider replaced its cluster: engaged from this one.
        let renamed = member.cluster.renamed(id.clone());
        renamed.set_identity(identity);
        let token = CancellationToken::new();
        match fleet.engage_until(renamed.clone(), token.clone()) {
            // Equal to the one engaged: that engagement (and its token) stands.
            Ok(crate::fleet::Engaged::Unchanged) => {
                if let Some(outer) = &mut member.engaged {
                    outer.source = member.cluster.clone();
                    if let Some(current) = fleet.get(id) {
                        current.set_identity(member.identity.clone());
                        outer.cluster = current;
                    }
                }
            }
            Ok(_) => {
                self.holders.insert(id.clone(), name.clone());
                member.engaged = Some(Outer {
                    id: id.clone(),
                    cluster: renamed,
                    token,
                    source: member.cluster.clone(),
                });
                member.warned = None;
            }
            Err(error) => tracing::warn!(cluster = %name, %error, "could not engage"),
        }
    }
}

/// The id member `name` is to be engaged under, or why not.
fn want<I: ClusterId, D: ClusterId>(
    rule: &Rule<I, D>,
    name: &I,
    member: &Member<I, D>,
) -> Wanted<D> {
    let result = match &member.identity {
        None if rule.wait => return Wanted::Unread,
        None => (rule.key)(name, &ClusterIdentity::default()),
        Some(identity) => (rule.key)(name, identity),
    };
    match result {
        Ok(id) => Wanted::Id(id),
        Err(refusal) => Wanted::Not(refusal),
    }
}

/// The reporting controller of the identity Events.
const REPORTER: &str = "multicluster-runtime-identity";

/// Logs `why` member `name` is not engaged, once per reason and identity; with `event` (a
/// reason and a note), also records a Warning Event on the member's id property (in the
/// member cluster, where its admins see it: the note says what they may know).
fn warn_once<I: ClusterId, D: ClusterId>(
    member: &mut Member<I, D>,
    name: &I,
    why: &str,
    event: Option<(&'static str, &str)>,
) {
    let warning = (why.to_string(), member.identity.clone());
    if member.warned.as_ref() == Some(&warning) {
        return;
    }
    tracing::warn!(cluster = %name, identity = ?member.identity, "{why}");
    member.warned = Some(warning);
    let Some((reason, note)) = event else {
        return;
    };
    let recorder = Recorder::new(member.cluster.client(), Reporter::from(REPORTER));
    let reference = ObjectReference {
        api_version: Some(format!("{}/{}", ClusterIdentity::GROUP, member.version)),
        kind: Some("ClusterProperty".into()),
        name: Some(ClusterIdentity::ID_PROPERTY.into()),
        ..Default::default()
    };
    let event = Event {
        type_: EventType::Warning,
        reason: reason.into(),
        note: Some(note.chars().take(1000).collect()),
        action: "Engage".into(),
        secondary: None,
    };
    let cluster = name.to_string();
    tokio::spawn(async move {
        if let Err(error) = recorder.publish(&event, &reference).await {
            tracing::debug!(%cluster, %error, "could not record why the cluster is not engaged");
        }
    });
}

/// How long to wait before looking again for the `ClusterProperty` kind in a cluster that
/// does not serve it (or whose discovery failed).
const DISCOVERY_RETRY: Duration = Duration::from_secs(10);

/// Watches the `ClusterProperty` objects of `cluster` (the first of
/// [`ClusterIdentity::VERSIONS`] it serves), reporting its identity after each complete
/// listing and each change, until `stop`. A cluster that does not serve the kind is reported
/// with an empty identity and looked at again every 10 s (the CRD may come later); one whose
/// version goes away is looked at again after a second.
async fn watch_properties<I: ClusterId>(
    cluster: Cluster<I>,
    generation: u64,
    reports: mpsc::UnboundedSender<Report<I>>,
    stop: CancellationToken,
) {
    let (mut reported_missing, mut discovery_failing) = (false, false);
    let report = |identity: &ClusterIdentity, version: &'static str| {
        let _ = reports.send(Report {
            name: cluster.id().clone(),
            generation,
            identity: identity.clone(),
            version,
        });
    };
    let client = cluster.client();
    loop {
        let served = tokio::select! {
            () = stop.cancelled() => return,
            served = ClusterIdentity::served(&client) => served,
        };
        if served.is_ok() {
            discovery_failing = false;
        }
        let resource = match served {
            Ok(Some(resource)) => resource,
            Ok(None) => {
                if !reported_missing {
                    tracing::info!(cluster = %cluster.id(), "the cluster does not serve ClusterProperty (about.k8s.io): no identity");
                    reported_missing = true;
                    report(&ClusterIdentity::default(), ClusterIdentity::VERSIONS[0]);
                }
                tokio::select! {
                    () = stop.cancelled() => return,
                    () = tokio::time::sleep(DISCOVERY_RETRY) => continue,
                }
            }
            Err(error) => {
                if std::mem::replace(&mut discovery_failing, true) {
                    tracing::debug!(cluster = %cluster.id(), %error, "finding the ClusterProperty kind failed again; retrying");
                } else {
                    tracing::warn!(cluster = %cluster.id(), %error, "finding the ClusterProperty kind failed; retrying");
                }
                tokio::select! {
                    () = stop.cancelled() => return,
                    () = tokio::time::sleep(DISCOVERY_RETRY) => continue,
                }
            }
        };
        let version = ClusterIdentity::VERSIONS
            .into_iter()
            .find(|v| *v == resource.version)
            .unwrap_or(ClusterIdentity::VERSIONS[0]);
        let api: Api<DynamicObject> = Api::all_with(client.clone(), &resource);
        let mut events = pin!(watcher::watcher(api, watcher::Config::default()).default_backoff());
        let mut identity = ClusterIdentity::default();
        let mut listing: Option<ClusterIdentity> = None;
        loop {
            let event = tokio::select! {
                () = stop.cancelled() => return,
                event = events.next() => event,
            };
            match event {
                None => return,
                Some(Ok(WatchEvent::Init)) => listing = Some(ClusterIdentity::default()),
                Some(Ok(WatchEvent::InitApply(object))) => {
                    if let Some(listing) = &mut listing {
                        listing.set(&object.name_any(), property_value(&object));
                    }
                }
                Some(Ok(WatchEvent::InitDone)) => {
                    identity = listing.take().unwrap_or_default();
                    reported_missing = false;
                    report(&identity, version);
                }
                Some(Ok(WatchEvent::Apply(object))) => {
                    identity.set(&object.name_any(), property_value(&object));
                    report(&identity, version);
                }
                Some(Ok(WatchEvent::Delete(object))) => {
                    identity.set(&object.name_any(), None);
                    report(&identity, version);
                }
                // The version is not served any more (the CRD changed or went): find the
                // kind again, after a pause (discovery may not show the change yet).
                Some(Err(watcher::Error::InitialListFailed(kube::Error::Api(status))))
                    if status.code == 404 =>
                {
                    tokio::select! {
                        () = stop.cancelled() => return,
                        () = tokio::time::sleep(Duration::from_secs(1)) => break,
                    }
                }
                Some(Err(error)) => {
                    tracing::warn!(cluster = %cluster.id(), %error, "watching ClusterProperty failed; retrying");
                }
            }
        }
    }
}
