//! [`Action`]: what a reconciler asks for next.

use std::time::Duration;

/// What to do after a reconcile: requeue after a delay, or wait for the next change.
///
/// Unlike kube-runtime's `Action`, the delay can be read back ([`Action::requeue_after`]),
/// which the fleet queue needs; it converts into kube-runtime's type for single-cluster mode.
///
/// ```
/// use std::time::Duration;
/// use multicluster_runtime::Action;
/// assert_eq!(Action::requeue(Duration::from_secs(5)).requeue_after(), Some(Duration::from_secs(5)));
/// assert_eq!(Action::await_change().requeue_after(), None);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Action {
    requeue_after: Option<Duration>,
}

impl Action {
    /// Reconcile again after `duration`, even if nothing changes.
    #[must_use]
    pub const fn requeue(duration: Duration) -> Self {
        Self {
            requeue_after: Some(duration),
        }
    }

    /// Do nothing until a watched change triggers the next reconcile.
    #[must_use]
    pub const fn await_change() -> Self {
        Self {
            requeue_after: None,
        }
    }

    /// The requested delay before the next reconcile, if any.
    pub const fn requeue_after(&self) -> Option<Duration> {
        self.requeue_after
    }
}

impl From<Action> for kube_runtime::controller::Action {
    fn from(action: Action) -> Self {
        match action.requeue_after {
            Some(d) => Self::requeue(d),
            None => Self::await_change(),
        }
    }
}
