//! The ends of the engaged clusters' credentials, shown: a gauge per cluster
//! (`multicluster_runtime_credential_expiry_seconds`) and a WARN line once a credential is
//! within the manager's lead time of its end ([`Manager::credential_warning`]).
//!
//! [`Manager::credential_warning`]: crate::Manager::credential_warning

use std::collections::HashMap;
use std::time::{Duration, SystemTime};

use crate::cluster::ClusterId;
use crate::run::Env;

/// How often the ends are read again (exec plugins renew theirs; files are rotated).
const EVERY: Duration = Duration::from_secs(60);

/// Reads every engaged cluster's credential end at each engagement and every minute, until
/// the run ends.
pub(crate) async fn watch<C: ClusterId>(env: Env<C>, lead: Duration) {
    let mut events = env.fleet.subscribe();
    // The end each cluster was warned about, so one end warns once.
    let mut warned: HashMap<C, SystemTime> = HashMap::new();
    loop {
        let clusters = env.fleet.clusters();
        let mut ends = Vec::with_capacity(clusters.len());
        for cluster in &clusters {
            let Some(expiry) = cluster.credential_expiry() else {
                continue;
            };
            let source = expiry.source.as_str();
            ends.push((cluster.id().to_string(), source, expiry.unix_seconds()));
            let remaining = expiry.remaining();
            if remaining <= lead && warned.get(cluster.id()) != Some(&expiry.at) {
                warned.insert(cluster.id().clone(), expiry.at);
                tracing::warn!(
                    cluster = %cluster.id(),
                    source,
                    expires_at = expiry.unix_seconds(),
                    remaining_seconds = remaining.as_secs(),
                    "the cluster's credential ends soon: renew it (mcr join again for a joined member), or its requests will be refused"
                );
            }
        }
        let engaged: std::collections::HashSet<&C> = clusters.iter().map(|c| c.id()).collect();
        warned.retain(|id, _| engaged.contains(id));
        if let Some(metrics) = &env.metrics {
            metrics.credential_expiries(&ends);
        }
        tokio::select! {
            () = env.shutdown.cancelled() => break,
            event = events.recv() => if event.is_none() { break },
            () = tokio::time::sleep(EVERY) => {}
        }
    }
    if let Some(metrics) = &env.metrics {
        metrics.credential_expiries(&[]);
    }
}
