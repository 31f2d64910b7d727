//! The diagnostics view ([`crate::diagnostics`]) as one replica takes it.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use tokio_util::sync::CancellationToken;

use super::Served;
use crate::cluster::{Cluster, ClusterId};
use crate::diagnostics::{
    ClusterShard, ClusterView, ControllerView, CredentialView, QueueView, ReplicaView, ShardView,
    WatchView, timestamp,
};
use crate::util::sync::lock;

/// This replica's side of sharding as the coordinator last saw it, and the owner of each of
/// the clusters named (in their order); given by the manager (sharding stands above the
/// endpoints). `None` when the manager is not sharded or the coordinator has not run yet.
pub(crate) type ShardSource =
    Arc<dyn Fn(&[&str]) -> Option<(ShardView, Vec<Option<String>>)> + Send + Sync>;

/// What the view reads beyond the fleet: the manager's shared state.
#[derive(Clone)]
pub(crate) struct ViewSources {
    /// The shard's side.
    pub(crate) shard: ShardSource,
    /// How long before a credential ends it is warned about.
    pub(crate) credential_lead: Arc<Mutex<Duration>>,
    /// Set while controllers run (the replica leads, or no election).
    pub(crate) leading: tokio::sync::watch::Receiver<Option<CancellationToken>>,
}

/// The view, now.
pub(crate) async fn take<C: ClusterId>(served: &Served<C>) -> ReplicaView {
    let answers = match &served.diagnostics {
        Some(controllers) => controllers.ask().await,
        None => Vec::new(),
    };
    let mut queues: HashMap<C, Vec<QueueView>> = HashMap::new();
    let mut controllers = Vec::with_capacity(answers.len());
    for (name, answer) in answers {
        controllers.push(ControllerView {
            name: name.to_string(),
            answered: answer.is_some(),
        });
        for (id, queue) in answer.into_iter().flatten() {
            queues.entry(id).or_default().push(queue);
        }
    }
    let lead = *lock(&served.view.credential_lead);
    let local = served.local.clone();
    let members = served.fleet.clusters();
    let names: Vec<String> = members.iter().map(|c| c.id().to_string()).collect();
    let shard = (served.view.shard)(&names.iter().map(String::as_str).collect::<Vec<_>>());
    // Clusters whose fence this replica holds, no longer engaged, being handed over (their
    // work is waited for before the fence is released).
    let engaged: HashSet<&str> = names.iter().map(String::as_str).collect();
    let leaving: Vec<String> = shard
        .iter()
        .flat_map(|(s, _)| &s.held)
        .filter(|(id, handing_off)| **handing_off && !engaged.contains(id.as_str()))
        .map(|(id, _)| id.clone())
        .collect();
    let leaving_owners =
        (served.view.shard)(&leaving.iter().map(String::as_str).collect::<Vec<_>>())
            .map(|(_, owners)| owners)
            .unwrap_or_default();
    let now = SystemTime::now();
    let view_of =
        |cluster: &Cluster<C>, sharded: Option<ClusterShard>, mut queues: Vec<QueueView>| {
            queues.sort_by(|a, b| a.controller.cmp(&b.controller));
            let is_host = served
                .host
                .as_ref()
                .is_some_and(|h| h.same_instance(cluster));
            let watches = cluster
                .cache_status()
                .into_iter()
                .map(|w| WatchView {
                    kind: w.kind,
                    config: w.config,
                    listed: w.synced,
                    overdue: w.overdue,
                    error: w.error.map(crate::diagnostics::cut),
                    last_event: w.last_event.map(timestamp),
                    failures: w.failures,
                })
                .collect();
            let credential = cluster.credential_expiry().map(|expiry| {
                let remaining = match expiry.at.duration_since(now) {
                    Ok(left) => i64::try_from(left.as_secs()).unwrap_or(i64::MAX),
                    Err(past) => -i64::try_from(past.duration().as_secs()).unwrap_or(i64::MAX),
                };
                CredentialView {
                    source: expiry.source.as_str().into(),
                    expires: timestamp(expiry.at),
                    remaining_seconds: remaining,
                    warned: expiry.remaining() <= lead,
                }
            });
            ClusterView {
                name: cluster.id().to_string(),
                role: if is_host { "host" } else { "cluster" }.into(),
                engaged: cluster.is_engaged(),
                watches,
                credential,
                shard: sharded,
                queues,
            }
        };
    let mut clusters: Vec<ClusterView> = Vec::with_capacity(members.len() + 1 + leaving.len());
    // The local cluster is never sharded.
    if let Some(l) = &local {
        clusters.push(view_of(l, None, queues.remove(l.id()).unwrap_or_default()));
    }
    for (i, cluster) in members.iter().enumerate() {
        let sharded = shard.as_ref().map(|(s, owners)| {
            let name = &names[i];
            ClusterShard {
                owner: owners.get(i).cloned().flatten(),
                held_here: s.held.contains_key(name),
                handing_off: s.held.get(name).copied().unwrap_or(false),
            }
        });
        let mine = queues.remove(cluster.id()).unwrap_or_default();
        clusters.push(view_of(cluster, sharded, mine));
    }
    for (i, name) in leaving.into_iter().enumerate() {
        clusters.push(ClusterView {
            name,
            role: "cluster".into(),
            shard: Some(ClusterShard {
                owner: leaving_owners.get(i).cloned().flatten(),
                held_here: true,
                handing_off: true,
            }),
            ..Default::default()
        });
    }
    ReplicaView {
        replica: served.instance.to_string(),
        at: timestamp(now),
        stopping: served.stopping.is_cancelled(),
        leading: served.view.leading.borrow().is_some(),
        shard: shard.map(|(s, _)| s),
        clusters,
        controllers,
    }
}
