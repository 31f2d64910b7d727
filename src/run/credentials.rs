//! The ends of the engaged clusters' credentials, shown: a gauge per cluster
//! (`multicluster_runtime_credential_expiry_seconds`) and, once a credential is within the
//! manager's lead time of its end ([`Manager::credential_warning`]), a WARN line and a Warning
//! Event `CredentialExpiring` on the object holding it (where its provider names one). An
//! exec plugin's credential is only shown: the plugin renews it, and an hour-long credential
//! nearing its end is routine.
//!
//! [`Manager::credential_warning`]: crate::Manager::credential_warning

use std::collections::HashMap;
use std::time::{Duration, SystemTime};

use crate::client::{CredentialExpiry, CredentialHolder, CredentialSource};
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
            if expiry.source != CredentialSource::Exec
                && remaining <= lead
                && warned.get(cluster.id()) != Some(&expiry.at)
            {
                warned.insert(cluster.id().clone(), expiry.at);
                tracing::warn!(
                    cluster = %cluster.id(),
                    source,
                    expires_at = expiry.unix_seconds(),
                    remaining_seconds = remaining.as_secs(),
                    "the cluster's credential ends soon: renew it (mcr join again for a joined member), or its requests will be refused"
                );
                if let Some(holder) = cluster.credential_holder() {
                    record(&holder, &cluster.id().to_string(), &expiry).await;
                }
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

/// How long recording one Event may take: a slow host delays the next cluster's reading.
const RECORD_WITHIN: Duration = Duration::from_secs(10);

/// Records the Warning Event `CredentialExpiring` on the object holding the credential of
/// `cluster` (best effort: a failure is logged at DEBUG, the WARN line has been written).
async fn record(holder: &CredentialHolder, cluster: &str, expiry: &CredentialExpiry) {
    use kube_runtime::events::{Event, EventType, Recorder, Reporter};
    let remaining = expiry.remaining().as_secs();
    let note = if remaining == 0 {
        format!(
            "the credential ({}) of cluster {cluster} has ended: its requests are refused; renew it (mcr join again for a joined member)",
            expiry.source.as_str()
        )
    } else {
        format!(
            "the credential ({}) of cluster {cluster} ends in {}h{:02}m: renew it before then (mcr join again for a joined member)",
            expiry.source.as_str(),
            remaining / 3600,
            remaining % 3600 / 60
        )
    };
    let event = Event {
        type_: EventType::Warning,
        reason: "CredentialExpiring".into(),
        note: Some(note),
        action: "Engage".into(),
        secondary: None,
    };
    let recorder = Recorder::new(
        holder.client.clone(),
        Reporter::from("multicluster-runtime"),
    );
    match tokio::time::timeout(RECORD_WITHIN, recorder.publish(&event, &holder.object)).await {
        Ok(Ok(())) => {}
        Ok(Err(error)) => {
            tracing::debug!(cluster, error = %crate::client::Shown(&error), "could not record the credential's coming end")
        }
        Err(_) => tracing::debug!(cluster, "recording the credential's coming end timed out"),
    }
}
