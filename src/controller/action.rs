//! [`Action`]: what a reconciler asks for next.

use std::time::Duration;

use super::FailureBackoff;
use crate::metrics::Outcome;

/// What to do after a reconcile: requeue after a delay, requeue after the object's own
/// failure backoff, or wait for the next change.
///
/// Unlike kube-runtime's `Action`, the delay can be read back ([`Action::requeue_after`]),
/// which the fleet queue needs; it converts into kube-runtime's type for single-cluster mode.
///
/// ```
/// use std::time::Duration;
/// use multicluster_runtime::Action;
/// assert_eq!(Action::requeue(Duration::from_secs(5)).requeue_after(), Some(Duration::from_secs(5)));
/// assert_eq!(Action::await_change().requeue_after(), None);
/// assert!(Action::backoff().is_backoff());
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Action {
    requeue_after: Option<Duration>,
    backoff: bool,
}

impl Action {
    /// Reconcile again after `duration`, even if nothing changes.
    #[must_use]
    pub const fn requeue(duration: Duration) -> Self {
        Self {
            requeue_after: Some(duration),
            backoff: false,
        }
    }

    /// Reconcile again after this object's own failure backoff
    /// ([`FailureBackoff`](crate::FailureBackoff): 5 ms doubling with each failure or backoff
    /// in a row, up to 1,000 s by default): controller-runtime's rate-limited requeue. From an
    /// error policy, the retry of a failed object (`|_, _, _| Action::backoff()`); from a
    /// reconciler, "again soon, but slower each time" (controller-runtime's `Requeue: true`).
    /// The object starts over after a reconcile that asks for anything else, and when it
    /// changes. Other objects, in this cluster or another, are not delayed.
    #[must_use]
    pub const fn backoff() -> Self {
        Self {
            requeue_after: None,
            backoff: true,
        }
    }

    /// Do nothing until a watched change triggers the next reconcile.
    #[must_use]
    pub const fn await_change() -> Self {
        Self {
            requeue_after: None,
            backoff: false,
        }
    }

    /// The requested delay before the next reconcile, if any (`None` for
    /// [`Action::backoff`], whose delay the controller decides).
    pub const fn requeue_after(&self) -> Option<Duration> {
        self.requeue_after
    }

    /// Whether this is [`Action::backoff`].
    pub const fn is_backoff(&self) -> bool {
        self.backoff
    }

    /// How `controller_runtime_reconcile_total` counts a reconcile that returned `Ok(self)`.
    pub(crate) fn outcome(&self) -> Outcome {
        if self.is_backoff() {
            Outcome::Requeue
        } else if self.requeue_after().is_some() {
            Outcome::RequeueAfter
        } else {
            Outcome::Success
        }
    }
}

impl From<Action> for kube_runtime::controller::Action {
    /// A backoff converts to a requeue after the default backoff's first delay: the
    /// controllers of this crate resolve it per object before it gets here.
    fn from(action: Action) -> Self {
        match action.requeue_after {
            Some(d) => Self::requeue(d),
            None if action.backoff => Self::requeue(FailureBackoff::default().delay(0)),
            None => Self::await_change(),
        }
    }
}
