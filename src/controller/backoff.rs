//! Per-object failure backoff: each object (per cluster) that fails is retried after a delay
//! of its own that doubles with each failure in a row, as controller-runtime's default rate
//! limiter does (5 ms doubling up to 1,000 s). A success, or a change of the object, starts
//! it over; one object failing never delays another.

use std::collections::{HashMap, HashSet};
use std::hash::Hash;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use kube::Resource;
use tokio::time::Instant;

use crate::util::sync::lock;

/// How long an object that keeps failing waits before its next attempt: `base` after its
/// first failure, doubling with each failure in a row, at most `max`. controller-runtime's
/// defaults: 5 ms and 1,000 s.
///
/// A reconciler or error policy asks for it with [`Action::backoff`](crate::Action::backoff);
/// set it per controller with [`Builder::failure_backoff`](crate::Builder::failure_backoff).
///
/// ```
/// use std::time::Duration;
/// use multicluster_runtime::FailureBackoff;
///
/// let backoff = FailureBackoff::default();
/// assert_eq!(backoff.delay(0), Duration::from_millis(5));
/// assert_eq!(backoff.delay(3), Duration::from_millis(40));
/// assert_eq!(backoff.delay(40), Duration::from_secs(1000));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FailureBackoff {
    base: Duration,
    max: Duration,
}

impl Default for FailureBackoff {
    fn default() -> Self {
        Self {
            base: Duration::from_millis(5),
            max: Duration::from_secs(1000),
        }
    }
}

impl FailureBackoff {
    /// The delay after the first failure.
    #[must_use]
    pub fn base(mut self, base: Duration) -> Self {
        self.base = base;
        self
    }

    /// The longest delay.
    #[must_use]
    pub fn max(mut self, max: Duration) -> Self {
        self.max = max;
        self
    }

    /// The delay after `failures` earlier failures in a row: `base × 2^failures`, at most
    /// `max`.
    pub fn delay(&self, failures: u32) -> Duration {
        let factor = 2u32.checked_pow(failures).unwrap_or(u32::MAX);
        self.base.saturating_mul(factor).min(self.max)
    }
}

/// What an object was when it failed: its generation where the kind keeps one (a status write
/// does not change it), else its resource version. Another one is a change of the object.
pub(crate) fn version_of<K: Resource>(object: &K) -> Option<String> {
    let meta = object.meta();
    match meta.generation {
        Some(generation) => Some(generation.to_string()),
        None => meta.resource_version.clone(),
    }
}

/// The failures in a row of each object of one controller, by request (cluster and object).
pub(crate) struct Failures<R> {
    backoff: FailureBackoff,
    counts: Mutex<Counts<R>>,
    /// How many objects have a count: read without the lock on every reconcile, so that a
    /// controller none of whose objects fails pays one atomic load.
    len: AtomicUsize,
}

struct Counts<R> {
    by_request: HashMap<R, Count>,
    /// Requests whose reconcile in flight called `Context::terminal`.
    terminal: HashSet<R>,
    /// The size after the last pruning: the next one comes when it has doubled.
    pruned_at: usize,
}

impl<R> Counts<R> {
    /// Makes the number of entries (counts and marks) readable without the lock.
    fn publish(&self, len: &AtomicUsize) {
        len.store(
            self.by_request.len() + self.terminal.len(),
            Ordering::Relaxed,
        );
    }
}

struct Count {
    failures: u32,
    version: Option<String>,
    /// The last failure.
    at: Instant,
}

impl<R: Hash + Eq + Clone> Failures<R> {
    pub(crate) fn new(backoff: FailureBackoff) -> Self {
        Self {
            backoff,
            counts: Mutex::new(Counts {
                by_request: HashMap::new(),
                terminal: HashSet::new(),
                pruned_at: 64,
            }),
            len: AtomicUsize::new(0),
        }
    }

    /// Whether no object has failures counted (nor a terminal mark).
    pub(crate) fn is_empty(&self) -> bool {
        self.len.load(Ordering::Relaxed) == 0
    }

    /// What comes after a reconcile of `request` at `version` that asked for `action` (from
    /// the error policy if it `failed`): a backoff becomes the object's own delay; a failure
    /// is counted; anything else starts the object over.
    pub(crate) fn settle(
        &self,
        request: &R,
        version: Option<&str>,
        action: crate::controller::Action,
        failed: bool,
    ) -> crate::controller::Action {
        // The reconcile is over: a terminal mark it left (one not taken by an error it
        // returned: it timed out, or succeeded) must not make the next one's error terminal.
        self.clear_terminal(request);
        if action.is_backoff() {
            return crate::controller::Action::requeue(self.failed(request, version));
        }
        if failed {
            self.failed(request, version);
        } else if !self.is_empty() {
            self.succeeded(request);
        }
        action
    }

    /// How many times in a row `request` failed before, at `version` (0 if the object has
    /// changed since).
    pub(crate) fn prior(&self, request: &R, version: Option<&str>) -> u32 {
        if self.is_empty() {
            return 0;
        }
        let counts = lock(&self.counts);
        counts
            .by_request
            .get(request)
            .filter(|c| c.version.as_deref() == version)
            .map_or(0, |c| c.failures)
    }

    /// Counts a failure (or a requeue with backoff) of `request` at `version`; the delay its
    /// backoff asks for before the next attempt.
    pub(crate) fn failed(&self, request: &R, version: Option<&str>) -> Duration {
        let now = Instant::now();
        let mut counts = lock(&self.counts);
        let count = counts
            .by_request
            .entry(request.clone())
            .or_insert_with(|| Count {
                failures: 0,
                version: version.map(str::to_string),
                at: now,
            });
        if count.version.as_deref() != version {
            count.failures = 0;
            count.version = version.map(str::to_string);
        }
        let delay = self.backoff.delay(count.failures);
        count.failures = count.failures.saturating_add(1);
        count.at = now;
        // Objects deleted while failing are never forgotten by a success: drop the counts
        // that have not failed again for twice the longest delay, once the map has doubled.
        if counts.by_request.len() >= counts.pruned_at * 2 {
            let keep = self.backoff.max.saturating_mul(2);
            counts
                .by_request
                .retain(|_, c| now.duration_since(c.at) < keep);
            counts.pruned_at = counts.by_request.len().max(64);
        }
        counts.publish(&self.len);
        delay
    }

    /// A success: `request` starts over.
    pub(crate) fn succeeded(&self, request: &R) {
        let mut counts = lock(&self.counts);
        counts.by_request.remove(request);
        counts.terminal.remove(request);
        counts.publish(&self.len);
    }

    /// The reconcile of `request` in flight says its error is terminal.
    pub(crate) fn mark_terminal(&self, request: R) {
        let mut counts = lock(&self.counts);
        counts.terminal.insert(request);
        counts.publish(&self.len);
    }

    /// Drops a terminal mark of `request` (its reconcile ended without its error being
    /// looked at: dropped, panicked, timed out).
    pub(crate) fn clear_terminal(&self, request: &R) {
        if self.is_empty() {
            return;
        }
        let mut counts = lock(&self.counts);
        if counts.terminal.remove(request) {
            counts.publish(&self.len);
        }
    }

    /// Whether the reconcile of `request` that just failed said its error was terminal (the
    /// mark is taken).
    pub(crate) fn take_terminal(&self, request: &R) -> bool {
        if self.is_empty() {
            return false;
        }
        let mut counts = lock(&self.counts);
        let terminal = counts.terminal.remove(request);
        counts.publish(&self.len);
        terminal
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        lock(&self.counts).by_request.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn delays_double_from_the_base_up_to_the_max() {
        let backoff = FailureBackoff::default();
        let delays: Vec<Duration> = (0..6).map(|n| backoff.delay(n)).collect();
        assert_eq!(delays, [ms(5), ms(10), ms(20), ms(40), ms(80), ms(160)]);
        // 5 ms × 2^18 = 1,310 s: capped.
        assert_eq!(backoff.delay(17), ms(655_360));
        assert_eq!(backoff.delay(18), Duration::from_secs(1000));
        assert_eq!(backoff.delay(u32::MAX), Duration::from_secs(1000));
    }

    #[test]
    fn a_terminal_mark_never_outlives_its_reconcile() {
        let failures = Failures::new(FailureBackoff::default());
        // Marked, then the reconcile timed out (settled as a failed backoff): the next
        // reconcile's ordinary error is not terminal.
        failures.mark_terminal("a");
        failures.settle(&"a", Some("1"), crate::controller::Action::backoff(), true);
        assert!(!failures.take_terminal(&"a"), "the mark outlived a timeout");
        // Marked, then the reconcile panicked or was dropped (nothing settled).
        failures.mark_terminal("b");
        failures.clear_terminal(&"b");
        assert!(!failures.take_terminal(&"b"));
        // Marked and returned with the error: taken once.
        failures.mark_terminal("c");
        assert!(failures.take_terminal(&"c"));
        assert!(!failures.take_terminal(&"c"));
    }

    #[tokio::test(start_paused = true)]
    async fn each_object_counts_its_own_failures_until_it_succeeds_or_changes() {
        let failures = Failures::new(FailureBackoff::default().base(ms(100)).max(ms(1000)));
        let delays: Vec<Duration> = (0..6).map(|_| failures.failed(&"a", Some("1"))).collect();
        assert_eq!(
            delays,
            [ms(100), ms(200), ms(400), ms(800), ms(1000), ms(1000)]
        );
        assert_eq!(failures.prior(&"a", Some("1")), 6);
        // Another object is not affected.
        assert_eq!(failures.prior(&"b", Some("1")), 0);
        assert_eq!(failures.failed(&"b", Some("1")), ms(100));
        // A change of the object starts it over.
        assert_eq!(failures.prior(&"a", Some("2")), 0);
        assert_eq!(failures.failed(&"a", Some("2")), ms(100));
        assert_eq!(failures.failed(&"a", Some("2")), ms(200));
        // So does a success.
        failures.succeeded(&"a");
        assert_eq!(failures.prior(&"a", Some("2")), 0);
        assert_eq!(failures.failed(&"a", Some("2")), ms(100));
    }

    #[tokio::test(start_paused = true)]
    async fn counts_of_objects_that_stopped_failing_are_dropped_in_time() {
        let failures = Failures::new(FailureBackoff::default().max(Duration::from_secs(1)));
        for n in 0..64 {
            failures.failed(&n, None);
        }
        tokio::time::advance(Duration::from_secs(3)).await;
        // Still failing: kept.
        failures.failed(&0, None);
        for n in 1000..1064 {
            failures.failed(&n, None);
        }
        // The map doubled (128): the 63 old ones that did not fail again in 2 s went.
        assert_eq!(failures.len(), 65);
        assert_eq!(failures.prior(&0, None), 2);
        assert_eq!(failures.prior(&1, None), 0);
    }
}
