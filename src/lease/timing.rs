//! [`LeaseTiming`]: how often a Lease is renewed, how long its holder keeps acting without a
//! renewal, and how long the others wait before taking it over. Leader election and sharding
//! both hold their Leases on it.

use std::fmt;
use std::time::Duration;

/// The timings of a held Lease, shared by [`LeaderElection`](crate::LeaderElection) and
/// [`Sharding`](crate::Sharding): client-go's defaults (lease duration 15 s, renew deadline
/// 10 s, retry period 2 s) unless changed.
///
/// The holder renews every retry period and stops acting once the renew deadline passes
/// without a renewal; the others take over once they have seen the Lease unchanged for the
/// lease duration, by their own clocks. The gap between the two is what keeps two holders
/// from acting at once: keep it wider than a replica's worst pause.
///
/// ```
/// # use std::time::Duration;
/// use multicluster_runtime::LeaseTiming;
///
/// let slower = LeaseTiming::default()
///     .lease_duration(Duration::from_secs(60))
///     .renew_deadline(Duration::from_secs(40))
///     .retry_period(Duration::from_secs(5));
/// # let _ = slower;
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LeaseTiming {
    pub(crate) lease_duration: Duration,
    pub(crate) renew_deadline: Duration,
    pub(crate) retry_period: Duration,
}

impl Default for LeaseTiming {
    fn default() -> Self {
        Self {
            lease_duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry_period: Duration::from_secs(2),
        }
    }
}

impl fmt::Display for LeaseTiming {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "lease duration {:?}, renew deadline {:?}, retry period {:?}",
            self.lease_duration, self.renew_deadline, self.retry_period
        )
    }
}

impl LeaseTiming {
    /// How long the others wait, after the Lease was last renewed (as they saw it), before
    /// they count its holder gone and take over. Longer than the renew deadline.
    #[must_use]
    pub fn lease_duration(mut self, duration: Duration) -> Self {
        self.lease_duration = duration;
        self
    }

    /// How long the holder goes on acting after its last successful renewal: its work is
    /// dropped (reconciles in flight cancelled, not awaited) as soon as this passes. The gap
    /// to the lease duration is the margin for that.
    #[must_use]
    pub fn renew_deadline(mut self, deadline: Duration) -> Self {
        self.renew_deadline = deadline;
        self
    }

    /// How often the holder renews and the others look (jittered by up to 20 %).
    #[must_use]
    pub fn retry_period(mut self, period: Duration) -> Self {
        self.retry_period = period;
        self
    }

    /// What is wrong with these timings, if anything, when the others may judge the holder
    /// from a view up to `stale` old: a zero retry period, a renew deadline that one jittered
    /// period can miss, or a lease duration not longer than the renew deadline and `stale`.
    pub(crate) fn problem(&self, stale: Duration) -> Option<&'static str> {
        if self.retry_period.is_zero() {
            Some("the retry period is zero")
        } else if self.renew_deadline <= self.retry_period.mul_f64(1.2) {
            Some("the renew deadline must be longer than the retry period (with its 20 % jitter)")
        } else if self.lease_duration <= self.renew_deadline + stale {
            Some(if stale.is_zero() {
                "the lease duration must be longer than the renew deadline"
            } else {
                "the lease duration must be longer than the renew deadline and the retry period together"
            })
        } else {
            None
        }
    }

    /// The lease duration as a Lease records it: whole seconds, rounded up (rounding down
    /// would let the others take over before the holder's renew deadline), at least 1.
    pub(crate) fn lease_seconds(&self) -> i32 {
        let d = self.lease_duration;
        let seconds = d.as_secs() + u64::from(d.subsec_nanos() > 0);
        i32::try_from(seconds.max(1)).unwrap_or(i32::MAX)
    }

    /// The retry period, jittered by up to 20 %.
    pub(crate) fn jittered_retry(&self) -> Duration {
        self.retry_period
            .mul_f64(1.0 + 0.2 * crate::util::jitter::random_unit())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    #[test]
    fn a_lease_duration_is_recorded_in_whole_seconds_rounded_up() {
        let timing = LeaseTiming::default();
        assert_eq!(timing.lease_seconds(), 15);
        assert_eq!(
            timing
                .lease_duration(Duration::from_millis(2500))
                .lease_seconds(),
            3
        );
        assert_eq!(timing.lease_duration(Duration::ZERO).lease_seconds(), 1);
    }

    #[test]
    fn the_rules_name_what_is_wrong() {
        let timing = LeaseTiming::default();
        assert_eq!(timing.problem(Duration::ZERO), None);
        assert_eq!(timing.problem(secs(2)), None);
        assert_eq!(
            timing.retry_period(Duration::ZERO).problem(Duration::ZERO),
            Some("the retry period is zero")
        );
        assert!(
            timing
                .retry_period(Duration::from_millis(8500))
                .problem(Duration::ZERO)
                .is_some_and(|p| p.contains("jitter"))
        );
        assert_eq!(
            timing.lease_duration(secs(10)).problem(Duration::ZERO),
            Some("the lease duration must be longer than the renew deadline")
        );
        assert!(
            timing
                .lease_duration(secs(12))
                .problem(secs(2))
                .is_some_and(|p| p.contains("retry period together"))
        );
        assert_eq!(
            timing.to_string(),
            "lease duration 15s, renew deadline 10s, retry period 2s"
        );
    }
}
