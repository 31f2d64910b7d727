//! [`WatchBackoff`]: how soon a failed watch retries, short enough to resume within seconds of
//! an apiserver coming back, jittered so a fleet does not retry in step.

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use futures::Stream;
use kube_runtime::utils::Backoff;
use kube_runtime::watcher::{self, Event};
use pin_project::pin_project;

/// How a cluster's watches wait between attempts after a failure: exponential from `initial`
/// up to `max`, each delay drawn at random from its upper `jitter` share (with the default
/// 0.5, a delay of 4 s is anywhere in 2 to 4 s), and back to `initial` once a watch works.
///
/// kube-runtime's default (client-go's: 0.8 s doubling to 30 s, reset after 2 minutes) is kind
/// to a struggling apiserver but leaves reconciles stalled for 20 to 30 s after it comes back.
/// The default here retries at most 3 s apart, so a watch resumes within about 3 s of its
/// apiserver serving again; the jitter keeps 1,000 clusters that failed together (a shared
/// network, a proxy) from retrying together.
///
/// ```
/// use std::time::Duration;
/// use multicluster_runtime::WatchBackoff;
///
/// let gentle = WatchBackoff::default().initial(Duration::from_secs(1)).max(Duration::from_secs(30));
/// assert_eq!(gentle.max_delay(), Duration::from_secs(30));
/// ```
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct WatchBackoff {
    initial: Duration,
    max: Duration,
    factor: f64,
    jitter: f64,
}

impl Default for WatchBackoff {
    /// 200 ms, doubling, at most 3 s, jitter 0.5.
    fn default() -> Self {
        Self {
            initial: Duration::from_millis(200),
            max: Duration::from_secs(3),
            factor: 2.0,
            jitter: 0.5,
        }
    }
}

impl WatchBackoff {
    /// The first delay (default 200 ms).
    #[must_use]
    pub fn initial(mut self, delay: Duration) -> Self {
        self.initial = delay;
        self
    }

    /// The longest delay (default 3 s); it bounds how long after an apiserver comes back its
    /// watches resume.
    #[must_use]
    pub fn max(mut self, delay: Duration) -> Self {
        self.max = delay;
        self
    }

    /// How much each delay grows over the previous one (default 2; at least 1).
    #[must_use]
    pub fn factor(mut self, factor: f64) -> Self {
        self.factor = if factor.is_finite() {
            factor.max(1.0)
        } else {
            1.0
        };
        self
    }

    /// Which share of each delay is random, from 0 (none) to 1 (anywhere from zero to the
    /// delay); default 0.5.
    #[must_use]
    pub fn jitter(mut self, jitter: f64) -> Self {
        self.jitter = if jitter.is_finite() {
            jitter.clamp(0.0, 1.0)
        } else {
            0.0
        };
        self
    }

    /// The longest delay.
    pub fn max_delay(&self) -> Duration {
        self.max
    }

    /// The delays, as the kube-runtime [`Backoff`] a watch stream takes.
    pub(crate) fn delays(&self) -> Delays {
        Delays {
            policy: self.clone(),
            next: self.initial.min(self.max),
            random: RandomState::new(),
            drawn: 0,
        }
    }
}

/// The delays of one watch; kube-runtime's `StreamBackoff` resets them after each success.
pub(crate) struct Delays {
    policy: WatchBackoff,
    /// The delay before jitter of the next attempt.
    next: Duration,
    /// Seeded at random per watch: hashing a counter gives each watch its own sequence.
    random: RandomState,
    drawn: u64,
}

impl Delays {
    /// A number in [0, 1).
    fn unit(&mut self) -> f64 {
        self.drawn += 1;
        (self.random.hash_one(self.drawn) >> 11) as f64 / (1u64 << 53) as f64
    }
}

impl Iterator for Delays {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        let base = self.next;
        self.next = base.mul_f64(self.policy.factor).min(self.policy.max);
        let jitter = self.policy.jitter * self.unit();
        Some(base.mul_f64(1.0 - jitter))
    }
}

impl Backoff for Delays {
    fn reset(&mut self) {
        self.next = self.policy.initial.min(self.policy.max);
    }
}

/// A watcher stream that waits out `delays` after each error. kube-runtime's `StreamBackoff`
/// resets its backoff on every `Ok`, and a watcher yields `Event::Init` before each listing
/// attempt, so a listing that keeps failing (forbidden, a missing CRD) would be retried at
/// the shortest delay forever; here only progress resets it: a completed listing or a change.
#[pin_project]
pub(crate) struct Retrying<S> {
    #[pin]
    stream: S,
    delays: Delays,
    #[pin]
    sleep: Option<tokio::time::Sleep>,
}

impl<S> Retrying<S> {
    pub(crate) fn new(stream: S, delays: Delays) -> Self {
        Self {
            stream,
            delays,
            sleep: None,
        }
    }
}

impl<S, K> Stream for Retrying<S>
where
    S: Stream<Item = Result<Event<K>, watcher::Error>>,
{
    type Item = Result<Event<K>, watcher::Error>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let mut this = self.project();
        if let Some(sleep) = this.sleep.as_mut().as_pin_mut() {
            ready!(sleep.poll(cx));
            this.sleep.set(None);
        }
        let item = ready!(this.stream.poll_next(cx));
        match &item {
            Some(Err(_)) => {
                let delay = this.delays.next().unwrap_or(this.delays.policy.max);
                this.sleep.set(Some(tokio::time::sleep(delay)));
            }
            Some(Ok(Event::InitDone | Event::Apply(_) | Event::Delete(_))) => this.delays.reset(),
            Some(Ok(Event::Init | Event::InitApply(_))) | None => {}
        }
        Poll::Ready(item)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_grow_to_the_max_and_never_exceed_it() {
        let mut delays = WatchBackoff::default().jitter(0.0).delays();
        let first: Vec<u128> = delays.by_ref().take(6).map(|d| d.as_millis()).collect();
        assert_eq!(first, [200, 400, 800, 1600, 3000, 3000]);
        delays.reset();
        assert_eq!(delays.next(), Some(Duration::from_millis(200)));
    }

    #[test]
    fn jitter_spreads_delays_within_the_upper_share() {
        let policy = WatchBackoff::default().initial(Duration::from_secs(3));
        let drawn: Vec<Duration> = (0..200).filter_map(|_| policy.delays().next()).collect();
        assert!(
            drawn
                .iter()
                .all(|d| *d > Duration::from_millis(1500) && *d <= Duration::from_secs(3))
        );
        let distinct: std::collections::HashSet<_> = drawn.iter().collect();
        assert!(
            distinct.len() > 150,
            "watches do not retry in step: {}",
            distinct.len()
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_listing_that_keeps_failing_backs_off_though_each_attempt_starts_with_init() {
        use futures::StreamExt;
        // What a watcher yields while its listing is forbidden: Init, an error, again and again.
        let attempts = futures::stream::iter(0..6).flat_map(|_| {
            futures::stream::iter([
                Ok(Event::<()>::Init),
                Err(watcher::Error::NoResourceVersion),
            ])
        });
        let policy = WatchBackoff::default().jitter(0.0);
        let start = tokio::time::Instant::now();
        let mut stream = std::pin::pin!(Retrying::new(attempts, policy.delays()));
        let mut errors_at = Vec::new();
        while let Some(item) = stream.next().await {
            if item.is_err() {
                errors_at.push((tokio::time::Instant::now() - start).as_millis());
            }
        }
        // 200, 400, 800, 1600 and 3000 ms between the errors: the Init events reset nothing.
        assert_eq!(errors_at, [0, 200, 600, 1400, 3000, 6000]);
    }

    #[test]
    fn silly_settings_are_tamed() {
        let mut delays = WatchBackoff::default()
            .factor(f64::NAN)
            .jitter(7.0)
            .initial(Duration::from_secs(60))
            .delays();
        assert!(delays.next().unwrap() <= Duration::from_secs(3));
    }
}
