//! Warm standby (controller-runtime's `EnableWarmup`): while this replica waits for the
//! leader Lease, the caches a controller will read are started in every cluster it would
//! follow and kept listed, so that on taking over it reconciles from them at once instead of
//! listing every cluster first.

use std::sync::Arc;

use super::Spec;
use crate::cache::Watchable;
use crate::cluster::ClusterId;
use crate::cluster::Engagement;
use crate::fleet::FleetEvent;
use crate::run::Env;

/// Keeps `spec`'s caches started in every cluster the controller would follow, for the
/// whole run of the manager. The caches belong to each engagement: they stay until it ends,
/// and the controller, once started, reads the same ones.
pub(crate) async fn run<K: Watchable, C: ClusterId>(spec: Arc<Spec<K, C>>, env: Env<C>) {
    if spec.engage_local
        && let Some(engagement) = env.local.as_ref().and_then(|l| l.engagement())
    {
        warm(&spec, &engagement);
    }
    if !spec.engage_fleet {
        return;
    }
    let mut events = env.fleet.subscribe();
    loop {
        tokio::select! {
            () = env.shutdown.cancelled() => return,
            event = events.recv() => match event {
                Some(FleetEvent::Engaged(engagement) | FleetEvent::Replaced { new: engagement, .. }) => {
                    warm(&spec, &engagement);
                }
                Some(FleetEvent::Disengaged(_) | FleetEvent::Departed(_)) => {}
                None => return,
            },
        }
    }
}

/// Starts the controller's watches in `engagement`'s cluster (if its filter takes it).
fn warm<K: Watchable, C: ClusterId>(spec: &Spec<K, C>, engagement: &Engagement<C>) {
    if let Some(filter) = &spec.cluster_filter
        && !filter(&engagement.cluster)
    {
        return;
    }
    let started = engagement
        .watch::<K>(&spec.dt, &spec.watcher_config)
        .map(drop)
        .and_then(|()| spec.relations.iter().try_for_each(|r| r.warm(engagement)));
    match started {
        Ok(()) => {
            tracing::debug!(controller = %spec.name, cluster = %engagement.id(), "caches warming for a take-over");
        }
        // The engagement ended meanwhile: its successor comes as an event of its own.
        Err(error) => {
            tracing::debug!(controller = %spec.name, cluster = %engagement.id(), %error, "caches not warmed");
        }
    }
}
