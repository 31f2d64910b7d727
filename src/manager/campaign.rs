//! The leadership campaign of a run with leader election: acquire the Lease, renew it, publish
//! the renew deadline as the leader's tenure, and tell the run when leadership is won or lost.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;

use crate::lease::leader::{Attempt, Elector, LeaderElection, OnLoss};
use crate::lease::tenure::Tenure;

/// A run's leadership: its campaign for the lease (with leader election) and what the
/// campaign tells the run.
pub(super) struct Campaign {
    pub(super) election: Option<LeaderElection>,
    /// The lease as `namespace/name` (empty without an election), for logs and metrics.
    pub(super) lease: String,
    pub(super) events: mpsc::UnboundedReceiver<Leadership>,
    /// Whether more events may come.
    pub(super) listening: bool,
    /// The campaign's task and the token that ends it.
    task: Option<(AbortOnDropHandle<Elector>, CancellationToken)>,
}

impl Campaign {
    /// Campaigns for `election`'s lease, publishing the leader's renew deadline in `tenure`;
    /// without an election, leadership is won at once.
    pub(super) fn start(election: Option<LeaderElection>, tenure: Arc<Tenure>) -> Self {
        let (tx, events) = mpsc::unbounded_channel();
        let task = match &election {
            Some(election) => {
                let stop = CancellationToken::new();
                let task = AbortOnDropHandle::new(tokio::spawn(campaign(
                    Elector::new(election.clone()),
                    tx,
                    stop.clone(),
                    tenure,
                )));
                Some((task, stop))
            }
            None => {
                let _ = tx.send(Leadership::Acquired);
                None
            }
        };
        let lease = election
            .as_ref()
            .map(|e| format!("{}/{}", e.namespace, e.name))
            .unwrap_or_default();
        Self {
            election,
            lease,
            events,
            listening: true,
            task,
        }
    }

    /// Ends the campaign, if it goes on; then gives the lease up (bounded) if `give_up` says
    /// this replica holds it and the election's settings release it on shutdown.
    pub(super) async fn end(&mut self, give_up: impl FnOnce() -> bool) {
        let Some((task, stop)) = self.task.take() else {
            return;
        };
        stop.cancel();
        if let Ok(elector) = task.await
            && give_up()
            && elector.config().release_on_shutdown
        {
            release(elector, &self.lease).await;
        }
    }
}

/// Gives the lease up on the way out, bounded: if that fails, it expires on its own.
async fn release(mut elector: Elector, lease: &str) {
    match tokio::time::timeout(Duration::from_secs(5), elector.release()).await {
        Ok(Ok(())) => tracing::info!(lease = %lease, "lease released"),
        Ok(Err(error)) => {
            tracing::warn!(lease = %lease, error = %crate::client::Shown(&error), "could not release the lease; it expires on its own");
        }
        Err(_) => {
            tracing::warn!(lease = %lease, "releasing the lease timed out; it expires on its own")
        }
    }
}

/// What the campaign tells the run.
pub(super) enum Leadership {
    Acquired,
    Lost(String),
}

/// Campaigns for the lease and, once held, renews it, until `stop`; returns the elector (to
/// release the lease with).
async fn campaign(
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
