//! [`Placed`]: the clusters of another provider that a scheduler's PlacementDecisions select.

use std::collections::{BTreeMap, BTreeSet};
use std::pin::pin;
use std::time::Duration;

use futures::StreamExt;
use kube::api::{ApiResource, DynamicObject};
use kube::{Api, Client, ResourceExt};
use kube_runtime::WatchStreamExt;
use kube_runtime::watcher::{self, Event as WatchEvent};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::cluster::ClusterName;
use crate::fleet::{Fleet, FleetEvent};
use crate::provider::{Provider, ProviderError};

/// The label a scheduler puts on the PlacementDecisions of one workload.
pub const PLACEMENT_KEY_LABEL: &str = "multicluster.x-k8s.io/placement-key";
/// The label that ties together the slices of one decision.
pub const DECISION_KEY_LABEL: &str = "multicluster.x-k8s.io/decision-key";

/// The PlacementDecision kind of the Cluster Inventory API (`multicluster.x-k8s.io/v1alpha1`).
fn placement_decisions() -> ApiResource {
    ApiResource {
        group: "multicluster.x-k8s.io".into(),
        version: "v1alpha1".into(),
        api_version: "multicluster.x-k8s.io/v1alpha1".into(),
        kind: "PlacementDecision".into(),
        plural: "placementdecisions".into(),
    }
}

/// The clusters of another provider (named `<namespace>/<name>` after their ClusterProfiles,
/// as [`ClusterInventory`](super::ClusterInventory) names them) that the PlacementDecisions
/// of one namespace of a hub select: those matching a label selector (a workload's
/// `multicluster.x-k8s.io/placement-key=<key>`), all their slices together.
///
/// A cluster is engaged once a decision selects it and the inner provider engages it; it is
/// paused when the inner provider pauses it. One that no decision selects any more leaves
/// after the hand-over time ([`Placed::hand_over`], 5 s by default), so a cluster a
/// scheduler moves from one slice to another (two writes) never leaves. Before the decisions
/// are first listed, and while they cannot be read (the kind not served, access denied),
/// no cluster is engaged that was not engaged before: the decorator never widens the fleet
/// on a failure.
///
/// Over a [`ClusterInventory`](super::ClusterInventory) that engages one profile per member
/// id, a decision naming a profile that is not its member's engages nothing for that member.
///
/// Trust: whoever can write PlacementDecisions in that namespace chooses which of the inner
/// provider's clusters this controller works on, and nothing else (a reference outside the
/// inner provider's clusters engages nothing).
#[derive(Clone)]
pub struct Placed<P> {
    inner: P,
    hub: Client,
    namespace: String,
    selector: String,
    hand_over: Duration,
}

impl<P: std::fmt::Debug> std::fmt::Debug for Placed<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Placed")
            .field("inner", &self.inner)
            .field("namespace", &self.namespace)
            .field("selector", &self.selector)
            .field("hand_over", &self.hand_over)
            .finish_non_exhaustive()
    }
}

impl<P: Provider<Id = ClusterName>> Placed<P> {
    /// The clusters of `inner` selected by the PlacementDecisions in `namespace` of the hub
    /// `hub` reaches that match the label `selector` (for one workload:
    /// `multicluster.x-k8s.io/placement-key=<key>`).
    pub fn new(
        inner: P,
        hub: Client,
        namespace: impl Into<String>,
        selector: impl Into<String>,
    ) -> Self {
        Self {
            inner,
            hub,
            namespace: namespace.into(),
            selector: selector.into(),
            hand_over: Duration::from_secs(5),
        }
    }

    /// How long a cluster no decision selects stays engaged (in case a decision selects it
    /// again, as when a scheduler moves it between slices).
    #[must_use]
    pub fn hand_over(mut self, hand_over: Duration) -> Self {
        self.hand_over = hand_over;
        self
    }
}

/// The clusters one PlacementDecision selects, by the ids the inner provider gives them;
/// entries without a name are skipped (counted, by position).
fn selected_by(decision: &DynamicObject) -> (BTreeSet<ClusterName>, Vec<usize>) {
    let own = decision.namespace().unwrap_or_default();
    let mut selected = BTreeSet::new();
    let mut skipped = Vec::new();
    let entries = decision
        .data
        .get("decisions")
        .and_then(|d| d.as_array())
        .map(Vec::as_slice)
        .unwrap_or_default();
    for (i, entry) in entries.iter().enumerate() {
        let reference = entry.get("clusterProfileRef");
        let text = |key: &str| {
            reference
                .and_then(|r| r.get(key))
                .and_then(|v| v.as_str())
                .filter(|s| !s.is_empty())
        };
        match text("name") {
            Some(name) => {
                let namespace = text("namespace").unwrap_or(&own);
                selected.insert(ClusterName::from(format!("{namespace}/{name}")));
            }
            None => skipped.push(i),
        }
    }
    (selected, skipped)
}

impl<P: Provider<Id = ClusterName>> Provider for Placed<P> {
    type Id = ClusterName;

    async fn run(
        &self,
        fleet: Fleet<ClusterName>,
        shutdown: CancellationToken,
    ) -> Result<(), ProviderError> {
        let own = Fleet::<ClusterName>::new();
        let mut inner_events = own.subscribe();
        let mut inner_run = pin!(self.inner.run(own.clone(), shutdown.clone()));
        let mut inner_done = false;
        let api: Api<DynamicObject> =
            Api::namespaced_with(self.hub.clone(), &self.namespace, &placement_decisions());
        let config = watcher::Config::default().labels(&self.selector);
        let mut decisions = pin!(watcher::watcher(api, config).default_backoff());
        // What each decision slice selects; the slices of a listing in progress.
        let mut slices: BTreeMap<String, BTreeSet<ClusterName>> = BTreeMap::new();
        let mut listing: Option<BTreeMap<String, BTreeSet<ClusterName>>> = None;
        let mut listed = false;
        let mut failing = false;
        // Selected now (by some slice), and those no slice selects, until their hand-over ends.
        let mut selected: BTreeSet<ClusterName> = BTreeSet::new();
        let mut leaving: BTreeMap<ClusterName, Instant> = BTreeMap::new();
        // Engaging a cluster engaged already does nothing.
        let engage = |id: &ClusterName| {
            if let Some(cluster) = own.get(id)
                && let Err(error) = fleet.engage(cluster)
            {
                tracing::warn!(cluster = %id, %error, "could not engage");
            }
        };
        let result = loop {
            let next_leave = leaving.values().min().copied();
            tokio::select! {
                () = shutdown.cancelled() => break Ok(()),
                result = &mut inner_run, if !inner_done => match result {
                    // A provider may engage its clusters and return; they stay.
                    Ok(()) => inner_done = true,
                    Err(error) => break Err(error),
                },
                () = tokio::time::sleep_until(next_leave.unwrap_or_else(Instant::now)), if next_leave.is_some() => {
                    let now = Instant::now();
                    leaving.retain(|id, at| {
                        *at > now || {
                            tracing::info!(cluster = %id, "no placement decision selects the cluster; disengaged");
                            fleet.disengage(id);
                            false
                        }
                    });
                }
                Some(event) = inner_events.recv() => match event {
                    FleetEvent::Engaged(engaged) | FleetEvent::Replaced { new: engaged, .. } => {
                        let id = engaged.cluster.id().clone();
                        if selected.contains(&id) || leaving.contains_key(&id) {
                            engage(&id);
                        }
                    }
                    // Paused: a `Departed` follows when it left for good.
                    FleetEvent::Disengaged(engaged) => {
                        fleet.pause_instance(&engaged.cluster);
                    }
                    FleetEvent::Departed(cluster) => {
                        leaving.remove(cluster.id());
                        fleet.disengage_instance(&cluster);
                    }
                },
                event = decisions.next() => {
                    let changed = match event {
                        None => break Ok(()),
                        Some(Err(error)) => {
                            // Once per outage: the clusters engaged stay, none is added.
                            if !failing {
                                tracing::warn!(namespace = %self.namespace, error = %crate::client::Shown(&error), "reading PlacementDecisions failed; retrying");
                            }
                            failing = true;
                            false
                        }
                        Some(Ok(event)) => {
                            failing = false;
                            match event {
                                WatchEvent::Init => {
                                    listing = Some(BTreeMap::new());
                                    false
                                }
                                WatchEvent::InitApply(decision) => {
                                    let (chosen, skipped) = selected_by(&decision);
                                    report_skipped(&decision, &skipped);
                                    listing.get_or_insert_default().insert(decision.name_any(), chosen);
                                    false
                                }
                                WatchEvent::InitDone => {
                                    slices = listing.take().unwrap_or_default();
                                    listed = true;
                                    true
                                }
                                WatchEvent::Apply(decision) => {
                                    let (chosen, skipped) = selected_by(&decision);
                                    report_skipped(&decision, &skipped);
                                    slices.insert(decision.name_any(), chosen);
                                    true
                                }
                                WatchEvent::Delete(decision) => {
                                    slices.remove(&decision.name_any());
                                    true
                                }
                            }
                        }
                    };
                    if changed && listed {
                        let now: BTreeSet<ClusterName> = slices.values().flatten().cloned().collect();
                        for id in now.difference(&selected) {
                            leaving.remove(id);
                            engage(id);
                        }
                        for id in selected.difference(&now) {
                            leaving.insert(id.clone(), Instant::now() + self.hand_over);
                        }
                        selected = now;
                    }
                }
            }
        };
        own.clear();
        for cluster in fleet.clusters() {
            fleet.disengage_instance(&cluster);
        }
        result
    }
}

/// A WARN for the entries of `decision` that name no cluster (by position).
fn report_skipped(decision: &DynamicObject, skipped: &[usize]) {
    if !skipped.is_empty() {
        tracing::warn!(decision = %decision.name_any(), entries = ?skipped, "PlacementDecision entries without clusterProfileRef.name skipped");
    }
}
