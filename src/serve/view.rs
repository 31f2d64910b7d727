//! The diagnostics view ([`crate::diagnostics`]) as one replica takes it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use tokio_util::sync::CancellationToken;

use super::Served;
use crate::cluster::{Cluster, ClusterId};
use crate::diagnostics::{
    ClusterShard, ClusterView, ControllerView, CredentialView, FleetView, QueueView, ShardView,
    WatchView, timestamp,
};
use crate::util::sync::lock;

/// What the view reads beyond the fleet: the manager's shared state.
#[derive(Clone)]
pub(crate) struct ViewSources {
    /// What the sharding coordinator last saw.
    pub(crate) shard: Arc<Mutex<Option<crate::shard::ShardStatus>>>,
    /// How long before a credential ends it is warned about.
    pub(crate) credential_lead: Arc<Mutex<Duration>>,
    /// Set while controllers run (the replica leads, or no election).
    pub(crate) leading: tokio::sync::watch::Receiver<Option<CancellationToken>>,
}

/// The view, now.
pub(crate) async fn take<C: ClusterId>(served: &Served<C>) -> FleetView {
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
    let shard = lock(&served.view.shard).clone();
    let lead = *lock(&served.view.credential_lead);
    let clusters: Vec<Cluster<C>> = served
        .local
        .iter()
        .cloned()
        .chain(served.fleet.clusters())
        .collect();
    let names: Vec<String> = clusters.iter().map(|c| c.id().to_string()).collect();
    let engaged = names.len();
    // Clusters whose fence this replica holds and that are no longer engaged: being handed
    // over (their work is waited for before the fence is released).
    let leaving: Vec<String> = shard
        .iter()
        .flat_map(|s| s.holding.keys())
        .filter(|id| !names.contains(id))
        .cloned()
        .collect();
    let owners = shard
        .as_ref()
        .map(|s| s.owners(names.iter().chain(&leaving).map(String::as_str)));
    let now = SystemTime::now();
    let mut clusters: Vec<ClusterView> = clusters
        .iter()
        .zip(names)
        .enumerate()
        .map(|(i, (cluster, name))| {
            let is_host = served
                .host
                .as_ref()
                .is_some_and(|h| h.same_instance(cluster));
            let is_local = served
                .local
                .as_ref()
                .is_some_and(|l| l.same_instance(cluster));
            let role = match (is_host, is_local) {
                (true, _) => "host",
                (false, true) => "local",
                (false, false) => "cluster",
            };
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
            let cluster_shard = shard.as_ref().map(|s| ClusterShard {
                owner: owners.as_ref().and_then(|o| o[i].clone()),
                held_here: s.holding.contains_key(&name),
                handing_off: s.holding.get(&name).copied().unwrap_or(false),
            });
            let mut cluster_queues = queues.remove(cluster.id()).unwrap_or_default();
            cluster_queues.sort_by(|a, b| a.controller.cmp(&b.controller));
            ClusterView {
                name,
                role: role.into(),
                engaged: cluster.is_engaged(),
                watches,
                credential,
                shard: cluster_shard,
                queues: cluster_queues,
            }
        })
        .collect();
    if let Some(s) = &shard {
        for (i, name) in leaving.into_iter().enumerate() {
            let handing_off = s.holding.get(&name).copied().unwrap_or(false);
            clusters.push(ClusterView {
                shard: Some(ClusterShard {
                    owner: owners
                        .as_ref()
                        .and_then(|o| o.get(engaged + i).cloned().flatten()),
                    held_here: true,
                    handing_off,
                }),
                name,
                role: "cluster".into(),
                ..Default::default()
            });
        }
    }
    FleetView {
        replica: served.instance.to_string(),
        at: timestamp(now),
        stopping: served.stopping.is_cancelled(),
        leading: served.view.leading.borrow().is_some(),
        shard: shard.map(|s| ShardView {
            identity: s.identity.clone(),
            // In one order, to compare with other replicas' (each sees itself last).
            peers: {
                let mut peers = s.peers.clone();
                peers.sort();
                peers
            },
            discovered: s.discovered,
            held: s.holding.clone(),
        }),
        clusters,
        controllers,
    }
}
