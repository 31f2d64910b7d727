//! The leadership campaign of a run with leader election: acquire the Lease, renew it, publish
//! the renew deadline as the leader's tenure, and tell the run when leadership is won or lost.

use std::sync::Arc;
use std::time::Instant;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::lease::leader::{Attempt, Elector, OnLoss};
use crate::lease::tenure::Tenure;

/// What the campaign tells the run.
pub(super) enum Leadership {
    Acquired,
    Lost(String),
}

/// Campaigns for the lease and, once held, renews it, until `stop`; returns the elector (to
/// release the lease with).
pub(super) async fn campaign(
    mut elector: Elector,
    events: mpsc::UnboundedSender<Leadership>,
    stop: CancellationToken,
    tenure: Arc<Tenure>,
) -> Elector {
    // Whatever ends the campaign ends the tenure it published.
    let _ended = EndsTenure(&tenure);
    let lease = format!("{}/{}", elector.config().namespace, elector.config().name);
    let identity = elector.config().identity.clone();
    let renew_deadline = elector.config().timing.renew_deadline;
    loop {
        // A candidate: try every retry period until the lease is ours.
        let mut holder_seen: Option<String> = None;
        let mut failing = false;
        // When the last successful attempt began: the others' lease clocks start no earlier
        // (they start when they see the write), so the renew deadline counts from here.
        let mut renewed;
        loop {
            renewed = Instant::now();
            let attempt = tokio::select! {
                () = stop.cancelled() => return elector,
                attempt = elector.try_acquire_or_renew() => attempt,
            };
            match attempt {
                Ok(Attempt::Held) => break,
                Ok(Attempt::HeldBy(holder)) => {
                    if holder_seen.as_ref() != Some(&holder) {
                        tracing::info!(lease = %lease, %identity, %holder, "another replica leads; waiting for the lease");
                        holder_seen = Some(holder);
                    }
                    failing = false;
                }
                Err(error) => {
                    if !failing {
                        tracing::warn!(lease = %lease, %identity, error = %crate::client::Shown(&error), "cannot read or take the lease; retrying");
                        failing = true;
                    }
                }
            }
            tokio::select! {
                () = stop.cancelled() => return elector,
                () = tokio::time::sleep(elector.config().timing.jittered_retry()) => {}
            }
        }
        tracing::info!(lease = %lease, %identity, transitions = elector.transitions(), "lease acquired");
        tenure.until((renewed + renew_deadline).into());
        if events.send(Leadership::Acquired).is_err() {
            return elector;
        }
        // The leader: renew every retry period; give up the moment the renew deadline has
        // passed since the last renewal began, whatever the reason (never sleeping past it).
        let mut last_error = None;
        let reason = loop {
            let deadline = renewed + renew_deadline;
            let wake = (Instant::now() + elector.config().timing.jittered_retry()).min(deadline);
            tokio::select! {
                () = stop.cancelled() => return elector,
                () = tokio::time::sleep_until(wake.into()) => {}
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break match last_error.take() {
                    // The host client is the user's own: its authentication errors are
                    // kube's, with a credential plugin's command line and output.
                    Some(error) => format!(
                        "not renewed within the renew deadline ({renew_deadline:?}); last error: {}",
                        crate::client::Shown(&error)
                    ),
                    None => format!("not renewed within the renew deadline ({renew_deadline:?})"),
                };
            }
            let began = Instant::now();
            let attempt = tokio::select! {
                () = stop.cancelled() => return elector,
                attempt = tokio::time::timeout(left, elector.try_acquire_or_renew()) => attempt,
            };
            match attempt {
                Ok(Ok(Attempt::Held)) => {
                    renewed = began;
                    tenure.until((renewed + renew_deadline).into());
                    last_error = None;
                }
                Ok(Ok(Attempt::HeldBy(holder))) => break format!("{holder} holds the lease now"),
                Ok(Err(error)) => {
                    tracing::warn!(lease = %lease, error = %crate::client::Shown(&error), "renewing the lease failed; retrying until the renew deadline");
                    last_error = Some(error);
                }
                Err(_) => {
                    break format!(
                        "not renewed within the renew deadline ({renew_deadline:?}): no answer in time"
                    );
                }
            }
        };
        tenure.end();
        if events.send(Leadership::Lost(reason)).is_err() {
            return elector;
        }
        if elector.config().on_loss == OnLoss::Exit {
            stop.cancelled().await;
            return elector;
        }
    }
}

/// Ends a tenure when dropped.
struct EndsTenure<'a>(&'a Tenure);

impl Drop for EndsTenure<'_> {
    fn drop(&mut self) {
        self.0.end();
    }
}
