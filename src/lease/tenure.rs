//! A replica's tenure: until when, by its own clock, what it holds (its leader Lease, the
//! fences of its clusters under sharding) lets it start work.
//!
//! Leader election and sharding each stop their controllers from a background task when a
//! renewal is overdue. A runtime starved of CPU runs that task late, perhaps after the others
//! have taken over, while a controller that gets the CPU first would go on starting
//! reconciles. So the deadline is published here when it is set, and read where work starts:
//! the fleet loop starts no reconcile past it (single mode calls no reconciler past it), and
//! a reconciler can ask before a write ([`Context::still_owned`](crate::Context::still_owned)).

use std::sync::atomic::{AtomicU64, Ordering};

use tokio::time::Instant;

/// The tenure: unbounded, until an instant, or ended. Read with one atomic load.
pub(crate) struct Tenure {
    /// What `until` counts from.
    base: Instant,
    /// The end as nanoseconds after `base`, plus one; `ENDED` or `UNBOUNDED`.
    until: AtomicU64,
    /// Told of every change (the fleet loop waits on it while past the end).
    changed: tokio::sync::watch::Sender<()>,
}

const ENDED: u64 = 0;
const UNBOUNDED: u64 = u64::MAX;

impl Tenure {
    /// A tenure that has not begun (or has ended).
    pub(crate) fn ended() -> Self {
        Self {
            base: Instant::now(),
            until: AtomicU64::new(ENDED),
            changed: tokio::sync::watch::Sender::new(()),
        }
    }

    /// A tenure nothing bounds.
    pub(crate) fn always() -> Self {
        let tenure = Self::ended();
        tenure.until.store(UNBOUNDED, Ordering::Release);
        tenure
    }

    /// Runs until `at` (a renewal that began at `at - renew deadline` succeeded).
    pub(crate) fn until(&self, at: Instant) {
        let nanos = at.saturating_duration_since(self.base).as_nanos();
        let nanos = u64::try_from(nanos)
            .unwrap_or(UNBOUNDED - 1)
            .saturating_add(1)
            .min(UNBOUNDED - 1);
        self.set(nanos);
    }

    /// Over: nothing more starts until the tenure runs again.
    pub(crate) fn end(&self) {
        self.set(ENDED);
    }

    fn set(&self, value: u64) {
        if self.until.swap(value, Ordering::AcqRel) != value {
            self.changed.send_replace(());
        }
    }

    /// Whether work may start at `now`.
    pub(crate) fn holds_at(&self, now: Instant) -> bool {
        match self.until.load(Ordering::Acquire) {
            ENDED => false,
            UNBOUNDED => true,
            nanos => now < self.base + std::time::Duration::from_nanos(nanos - 1),
        }
    }

    /// Whether work may start now (the clock read only when the tenure is bounded).
    pub(crate) fn holds(&self) -> bool {
        match self.until.load(Ordering::Acquire) {
            ENDED => false,
            UNBOUNDED => true,
            _ => self.holds_at(Instant::now()),
        }
    }

    /// The end: `None` if unbounded, an instant in the past once ended.
    pub(crate) fn end_at(&self) -> Option<Instant> {
        match self.until.load(Ordering::Acquire) {
            ENDED => Some(self.base),
            UNBOUNDED => None,
            nanos => Some(self.base + std::time::Duration::from_nanos(nanos - 1)),
        }
    }

    /// Changes from now on: `changed()` completes at the next change after the last seen.
    pub(crate) fn subscribe(&self) -> tokio::sync::watch::Receiver<()> {
        self.changed.subscribe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test(start_paused = true)]
    async fn a_tenure_holds_until_its_end_and_tells_of_each_change() {
        let tenure = Tenure::ended();
        let mut changes = tenure.subscribe();
        assert!(!tenure.holds());
        assert!(tenure.end_at().is_some_and(|at| at <= Instant::now()));

        let end = Instant::now() + Duration::from_secs(10);
        tenure.until(end);
        assert!(changes.has_changed().unwrap());
        changes.borrow_and_update();
        assert!(tenure.holds());
        assert_eq!(tenure.end_at(), Some(end));
        tokio::time::advance(Duration::from_millis(9_999)).await;
        assert!(tenure.holds());
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(!tenure.holds(), "the end itself is past the tenure");
        assert!(!changes.has_changed().unwrap(), "time passing is no change");

        // A renewal that landed late moves the end on; the same end again tells nobody.
        tenure.until(end + Duration::from_secs(5));
        assert!(tenure.holds());
        assert!(changes.has_changed().unwrap());
        changes.borrow_and_update();
        tenure.until(end + Duration::from_secs(5));
        assert!(!changes.has_changed().unwrap());

        tenure.end();
        assert!(!tenure.holds());
        assert!(changes.has_changed().unwrap());

        let always = Tenure::always();
        tokio::time::advance(Duration::from_secs(3600)).await;
        assert!(always.holds());
        assert_eq!(always.end_at(), None);
    }
}
