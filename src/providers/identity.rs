//! [`Identified`] and [`ById`]: any provider's clusters with their KEP-2149 identity, read
//! from each cluster's `ClusterProperty` objects, kept by name or keyed by the cluster's own
//! id, optionally only the members of one ClusterSet.

use std::collections::BTreeMap;
use std::pin::pin;

use futures::StreamExt;
use kube::api::DynamicObject;
use kube::{Api, ResourceExt};
use kube_runtime::WatchStreamExt;
use kube_runtime::watcher::{self, Event as WatchEvent};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::cluster::property_value;
use crate::fleet::FleetEvent;
use crate::{Cluster, ClusterId, ClusterIdentity, ClusterName, Fleet, Provider, ProviderError};

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
/// label (as the KEP requires); one without an id is not engaged (a warning says so). Two
/// clusters claiming one id: the first engaged keeps it, the other waits (a warning names
/// both) and takes it when the first goes. With [`ById::clusterset`], only the members of
/// that ClusterSet.
#[derive(Clone, Debug)]
pub struct ById<P> {
    inner: P,
    clusterset: Option<String>,
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
        }
    }

    /// Only the members of ClusterSet `clusterset` (property `clusterset.k8s.io`).
    #[must_use]
    pub fn clusterset(mut self, clusterset: impl Into<String>) -> Self {
        self.clusterset = Some(clusterset.into());
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
                member_of(identity, clusterset.as_deref()).then(|| name.clone())
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
        let rule = Rule {
            wait: true,
            key: Box::new(move |_: &P::Id, identity: &ClusterIdentity| {
                let id = identity.id.as_deref()?;
                (member_of(identity, clusterset.as_deref()) && ClusterIdentity::is_valid_id(id))
                    .then(|| ClusterName::from(id))
            }),
        };
        run(&self.inner, rule, fleet, shutdown).await
    }
}

fn member_of(identity: &ClusterIdentity, clusterset: Option<&str>) -> bool {
    clusterset.is_none_or(|set| identity.clusterset.as_deref() == Some(set))
}

/// The id (if any) a cluster of the inner provider is engaged under, from its name there
/// and its identity.
type Key<I, D> = Box<dyn Fn(&I, &ClusterIdentity) -> Option<D> + Send + Sync>;

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
    /// Where it is engaged in the outer fleet.
    engaged: Option<Outer<I, D>>,
    /// The warning last logged about it (why it is not engaged, with the identity read),
    /// so that each is logged once.
    warned: Option<(String, Option<ClusterIdentity>)>,
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
}

/// What a property watch reports: the identity after a complete listing or a change.
struct Report<I> {
    name: I,
    generation: u64,
    identity: ClusterIdentity,
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
                        engaged: previous.and_then(|m| m.engaged),
                        warned: None,
                    });
                    name
                }
                FleetEvent::Disengaged(engaged) => {
                    let id = engaged.cluster.id();
                    if members.by_name.get(id).is_some_and(|m| m.cluster.same_instance(&engaged.cluster)) {
                        members.remove(&rule, &fleet, id);
                    }
                    continue;
                }
            },
            Some(report) = reported.recv() => match members.by_name.get_mut(&report.name) {
                Some(member) if member.generation == report.generation => {
                    member.identity = Some(report.identity);
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

/// The clusters of the inner provider, and which of them holds each outer id.
struct Members<I: ClusterId, D: ClusterId> {
    by_name: BTreeMap<I, Member<I, D>>,
    /// The member engaged under each id: a second claimant waits for it.
    holders: BTreeMap<D, I>,
}

impl<I: ClusterId, D: ClusterId> Default for Members<I, D> {
    fn default() -> Self {
        Self {
            by_name: BTreeMap::new(),
            holders: BTreeMap::new(),
        }
    }
}

impl<I: ClusterId, D: ClusterId> Members<I, D> {
    /// The member `name` is gone: its id goes to a member waiting for it.
    fn remove(&mut self, rule: &Rule<I, D>, fleet: &Fleet<D>, name: &I) {
        if let Some(outer) = self.by_name.remove(name).and_then(|m| m.engaged) {
            outer.leave(fleet);
            self.free(rule, fleet, &outer.id);
        }
    }

    /// Nobody holds `id` any more: the first member that wants it takes it.
    fn free(&mut self, rule: &Rule<I, D>, fleet: &Fleet<D>, id: &D) {
        self.holders.remove(id);
        let waiting = self.by_name.iter().find_map(|(name, member)| {
            (member.engaged.is_none() && want(rule, name, member).as_ref() == Some(id))
                .then(|| name.clone())
        });
        if let Some(name) = waiting {
            self.place(rule, fleet, &name);
        }
    }

    /// Brings the outer fleet in line with member `name`'s cluster and identity.
    fn place(&mut self, rule: &Rule<I, D>, fleet: &Fleet<D>, name: &I) {
        let Some(member) = self.by_name.get_mut(name) else {
            return;
        };
        let want = want(rule, name, member);
        // Leave the id it held if it wants another (or none).
        if let Some(outer) = &member.engaged
            && want.as_ref() != Some(&outer.id)
        {
            outer.leave(fleet);
            let freed = outer.id.clone();
            member.engaged = None;
            self.free(rule, fleet, &freed);
            return self.place(rule, fleet, name);
        }
        let Some(id) = want else {
            if member.identity.is_some() {
                warn_once(
                    member,
                    name,
                    "not engaged: no valid id, or not a member of the ClusterSet",
                );
            }
            return;
        };
        let identity = member.identity.clone();
        match &member.engaged {
            // The same instance: its identity refreshed in place.
            Some(outer) if outer.source.same_instance(&member.cluster) => {
                outer.cluster.set_identity(identity);
                return;
            }
            // The inner provider replaced it: engaged again below, from the new instance.
            Some(_) => {}
            None if self.holders.contains_key(&id) => {
                warn_once(
                    member,
                    name,
                    &format!("not engaged: another cluster holds the id {id}"),
                );
                return;
            }
            None => {}
        }
        let renamed = member.cluster.renamed(id.clone());
        renamed.set_identity(identity);
        let token = CancellationToken::new();
        match fleet.engage_until(renamed.clone(), token.clone()) {
            // Equal to the one engaged: that engagement (and its token) stands.
            Ok(crate::Engaged::Unchanged) => {
                if let Some(outer) = &mut member.engaged {
                    outer.source = member.cluster.clone();
                    if let Some(current) = fleet.get(&id) {
                        current.set_identity(member.identity.clone());
                        outer.cluster = current;
                    }
                }
            }
            Ok(_) => {
                self.holders.insert(id.clone(), name.clone());
                member.engaged = Some(Outer {
                    id,
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

/// The id member `name` is to be engaged under, if any.
fn want<I: ClusterId, D: ClusterId>(
    rule: &Rule<I, D>,
    name: &I,
    member: &Member<I, D>,
) -> Option<D> {
    match &member.identity {
        None if rule.wait => None,
        None => (rule.key)(name, &ClusterIdentity::default()),
        Some(identity) => (rule.key)(name, identity),
    }
}

fn warn_once<I: ClusterId, D: ClusterId>(member: &mut Member<I, D>, name: &I, why: &str) {
    let warning = (why.to_string(), member.identity.clone());
    if member.warned.as_ref() != Some(&warning) {
        tracing::warn!(cluster = %name, identity = ?member.identity, "{why}");
        member.warned = Some(warning);
    }
}

/// Watches the `ClusterProperty` objects of `cluster`, reporting its identity after each
/// complete listing and each change, until `stop`. A cluster that does not serve the kind
/// is reported with an empty identity (and watched on: the CRD may come later).
async fn watch_properties<I: ClusterId>(
    cluster: Cluster<I>,
    generation: u64,
    reports: mpsc::UnboundedSender<Report<I>>,
    stop: CancellationToken,
) {
    let api: Api<DynamicObject> = Api::all_with(cluster.client(), &ClusterIdentity::resource());
    let mut events = pin!(watcher::watcher(api, watcher::Config::default()).default_backoff());
    let mut identity = ClusterIdentity::default();
    let mut listing: Option<ClusterIdentity> = None;
    let mut reported_missing = false;
    let report = |identity: &ClusterIdentity| {
        let _ = reports.send(Report {
            name: cluster.id().clone(),
            generation,
            identity: identity.clone(),
        });
    };
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
                report(&identity);
            }
            Some(Ok(WatchEvent::Apply(object))) => {
                identity.set(&object.name_any(), property_value(&object));
                report(&identity);
            }
            Some(Ok(WatchEvent::Delete(object))) => {
                identity.set(&object.name_any(), None);
                report(&identity);
            }
            Some(Err(error)) => {
                let missing = matches!(
                    &error,
                    watcher::Error::InitialListFailed(kube::Error::Api(status)) if status.code == 404
                );
                if missing && !reported_missing {
                    tracing::info!(cluster = %cluster.id(), "the cluster does not serve ClusterProperty (about.k8s.io/v1alpha1): no identity");
                    reported_missing = true;
                    report(&ClusterIdentity::default());
                } else if !missing {
                    tracing::warn!(cluster = %cluster.id(), %error, "watching ClusterProperty failed; retrying");
                }
            }
        }
    }
}
