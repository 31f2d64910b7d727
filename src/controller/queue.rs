//! The ready queue of a fleet controller: deduplicated, one request in flight per key, and
//! round-robin across clusters so that a busy cluster cannot starve a quiet one.
//!
//! Delays (requeue after, debounce) happen before this queue, in kube-runtime's scheduler;
//! what arrives here is due now. Go's multicluster-runtime shares one FIFO among all
//! clusters, so a cluster with thousands of pending requests delays every other cluster by
//! all of them; here a request waits at most one turn of the rotation per other busy cluster.

use std::collections::{VecDeque, hash_map::Entry};

use crate::util::hashing::{HashMap, HashSet};
use std::future::Future;
use std::hash::{Hash, Hasher};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::Stream;
use kube_runtime::scheduler::{ScheduleRequest, Scheduler, debounced_scheduler};
use tokio::sync::mpsc;
use tokio::time::Instant;

use prometheus_client::metrics::gauge::Gauge;

use super::ReconcileReason;
use crate::cluster::ClusterId;
use crate::controller::{Action, Request};
use crate::metrics::{Metrics, Outcome, Series};
use crate::telemetry::TraceMark;

/// After this many requests of the normal lane in a row while listed ones wait, one of the
/// low lane is served: live changes go first, but a steady stream of them cannot starve a
/// cluster's listing for good (controller-runtime's priority queue can).
pub(crate) const LOW_SHARE: u32 = 16;

/// Which lane a request waits in: live changes, or listed objects with no news (a first
/// listing, an unchanged relist, a resync), which go after them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Lane {
    Normal = 0,
    Low = 1,
}

impl Lane {
    /// Its name in spans and the diagnostics view.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Normal => "normal",
            Self::Low => "low",
        }
    }

    /// The lane for requests queued for `reason`.
    pub(crate) fn of(reason: &ReconcileReason) -> Self {
        if reason.is_low() {
            Self::Low
        } else {
            Self::Normal
        }
    }
}

/// Ready requests grouped by cluster and lane, served round-robin within a lane, the normal
/// lane before the low one (but see [`LOW_SHARE`]), with at most `cap` of one cluster in
/// flight at once (so a cluster whose API calls hang cannot hold every slot). Each request
/// carries a payload `R` (why it was queued); for a request pushed twice the first payload is
/// kept, unless the second push moves it to the normal lane.
#[derive(Debug)]
pub(crate) struct FairQueue<C: ClusterId, R = ()> {
    /// Per cluster, its ready requests in arrival order, per lane. A request moved from the
    /// low lane to the normal one stays behind in the low deque (skipped when reached).
    /// Never holds a cluster with both deques empty.
    queues: HashMap<C, [VecDeque<Request<C>>; 2]>,
    /// Per lane, the clusters with requests in it, in the order they are served next; each
    /// once, and exactly the clusters whose deque of that lane is not empty.
    rotation: [VecDeque<C>; 2],
    /// Every queued request, with its payload and lane.
    queued: HashMap<Request<C>, (R, Lane)>,
    /// Requests handed out by `pop` and not yet `done`, with when they were handed out and
    /// from which lane.
    in_flight: HashMap<Request<C>, (Instant, Lane)>,
    /// In-flight requests that were pushed again; they are queued once they are done, so the
    /// change that caused the push is not lost, and never run twice at once.
    dirty: HashMap<Request<C>, (R, Lane)>,
    /// How many requests of each cluster are in flight (clusters with none are absent).
    in_flight_per_cluster: HashMap<C, usize>,
    /// At most this many in flight per cluster; 0 for no limit.
    cap: usize,
    /// Normal requests served in a row while the low lane had some.
    streak: u32,
}

impl<C: ClusterId, R> Default for FairQueue<C, R> {
    fn default() -> Self {
        Self {
            queues: HashMap::default(),
            rotation: [VecDeque::new(), VecDeque::new()],
            queued: HashMap::default(),
            in_flight: HashMap::default(),
            dirty: HashMap::default(),
            in_flight_per_cluster: HashMap::default(),
            cap: 0,
            streak: 0,
        }
    }
}

impl<C: ClusterId, R> FairQueue<C, R> {
    /// An empty queue with at most `cap` requests of one cluster in flight (0: no limit).
    pub(crate) fn with_cap(cap: usize) -> Self {
        Self {
            cap,
            ..Self::default()
        }
    }

    /// Whether `cluster` may start another request.
    fn under_cap(&self, cluster: &C) -> bool {
        self.cap == 0
            || self
                .in_flight_per_cluster
                .get(cluster)
                .copied()
                .unwrap_or(0)
                < self.cap
    }

    /// Adds a request that is due, in `lane`. A request already queued is not added twice
    /// (but moves to the normal lane if pushed there); one in flight is queued again when it
    /// is done. True if it was queued now.
    pub(crate) fn push(&mut self, req: Request<C>, payload: R, lane: Lane) -> bool {
        if self.in_flight.contains_key(&req) {
            match self.dirty.entry(req) {
                Entry::Occupied(mut again) => {
                    if lane == Lane::Normal && again.get().1 == Lane::Low {
                        again.insert((payload, lane));
                    }
                }
                Entry::Vacant(again) => {
                    again.insert((payload, lane));
                }
            }
            return false;
        }
        // One lookup for both cases: the request is hashed once.
        match self.queued.entry(req) {
            Entry::Occupied(mut queued) => {
                if lane == Lane::Normal && queued.get().1 == Lane::Low {
                    *queued.get_mut() = (payload, lane);
                    let req = queued.key().clone();
                    self.append(req, lane);
                }
                false
            }
            Entry::Vacant(slot) => {
                let req = slot.key().clone();
                slot.insert((payload, lane));
                self.append(req, lane);
                true
            }
        }
    }

    /// Puts `req` at the end of its cluster's deque of `lane`.
    fn append(&mut self, req: Request<C>, lane: Lane) {
        let deques = self.queues.entry(req.cluster.clone()).or_default();
        let deque = &mut deques[lane as usize];
        if deque.is_empty() {
            self.rotation[lane as usize].push_back(req.cluster.clone());
        }
        deque.push_back(req);
    }

    /// [`FairQueue::pop_at`] now.
    #[cfg(test)]
    pub(crate) fn pop(&mut self) -> Option<(Request<C>, R)> {
        self.pop_at(Instant::now())
    }

    /// Takes the next request: from the normal lane if it has one for a cluster under its
    /// cap (every [`LOW_SHARE`]th time from the low lane first), the oldest of the first
    /// cluster in that lane's turn (a cluster at its cap keeps its place). It counts as in
    /// flight from `now` until [`FairQueue::done`].
    pub(crate) fn pop_at(&mut self, now: Instant) -> Option<(Request<C>, R)> {
        let order = if self.streak >= LOW_SHARE {
            [Lane::Low, Lane::Normal]
        } else {
            [Lane::Normal, Lane::Low]
        };
        let (req, key, payload, lane) = order
            .into_iter()
            .find_map(|lane| self.pop_lane(lane).map(|(r, k, p)| (r, k, p, lane)))?;
        if lane == Lane::Normal && !self.rotation[Lane::Low as usize].is_empty() {
            self.streak += 1;
        } else {
            self.streak = 0;
        }
        if self.queued.is_empty() && self.queued.capacity() > 1024 {
            // A backlog (a thousand clusters' first listings) drained: its tables are not
            // kept at their peak size.
            self.queued.shrink_to_fit();
            self.queues.shrink_to_fit();
            for rotation in &mut self.rotation {
                rotation.shrink_to_fit();
            }
        }
        self.in_flight.insert(key, (now, lane));
        *self
            .in_flight_per_cluster
            .entry(req.cluster.clone())
            .or_default() += 1;
        Some((req, payload))
    }

    /// The oldest request of `lane` of the first cluster in that lane's turn that is under
    /// its cap, taken out of the queue: the deque's copy, then the one that keyed it in
    /// `queued` (which keys it in `in_flight` next, so a pop copies no request).
    fn pop_lane(&mut self, lane: Lane) -> Option<(Request<C>, Request<C>, R)> {
        let l = lane as usize;
        loop {
            let turn = self.rotation[l].iter().position(|c| self.under_cap(c))?;
            let cluster = self.rotation[l].remove(turn)?;
            let Entry::Occupied(mut entry) = self.queues.entry(cluster) else {
                debug_assert!(false, "a cluster in the rotation has a queue");
                return None;
            };
            let deque = &mut entry.get_mut()[l];
            let mut found = None;
            while let Some(req) = deque.pop_front() {
                // Taken out with one lookup; skipped (and put back) if it moved to the normal
                // lane, skipped if it was served there.
                match self.queued.remove_entry(&req) {
                    Some((key, (payload, at))) if at == lane => {
                        found = Some((req, key, payload));
                        break;
                    }
                    Some((key, value)) => {
                        self.queued.insert(key, value);
                    }
                    None => {}
                }
            }
            if !deque.is_empty() {
                self.rotation[l].push_back(entry.key().clone());
            }
            if entry.get().iter().all(VecDeque::is_empty) {
                entry.remove();
            }
            if found.is_some() {
                return found;
            }
        }
    }

    /// Marks an in-flight request finished; if it was pushed meanwhile it is queued again
    /// (true then).
    #[cfg(test)]
    pub(crate) fn done(&mut self, req: &Request<C>) -> bool {
        self.done_started(req).0
    }

    /// [`FairQueue::done`], with when the request was handed out and from which lane (if it
    /// was in flight).
    pub(crate) fn done_started(&mut self, req: &Request<C>) -> (bool, Option<(Instant, Lane)>) {
        let Some(started) = self.in_flight.remove(req) else {
            return (false, None);
        };
        if let Entry::Occupied(mut count) = self.in_flight_per_cluster.entry(req.cluster.clone()) {
            *count.get_mut() -= 1;
            if *count.get() == 0 {
                count.remove();
            }
        }
        // Checked first: a lookup in an empty table still hashes the request.
        let again = if self.dirty.is_empty() {
            None
        } else {
            self.dirty.remove_entry(req)
        };
        let requeued = match again {
            Some((req, (payload, lane))) => self.push(req, payload, lane),
            None => false,
        };
        (requeued, Some(started))
    }

    /// When the requests of `cluster` in flight were handed out.
    pub(crate) fn started_in<'a>(&'a self, cluster: &'a C) -> impl Iterator<Item = Instant> + 'a {
        self.in_flight
            .iter()
            .filter(move |(r, _)| &r.cluster == cluster)
            .map(|(_, (at, _))| *at)
    }

    /// Drops everything queued for `cluster` (it was disengaged), and returns how many
    /// requests were waiting. In-flight requests finish on their own; their pending re-runs
    /// are dropped too.
    pub(crate) fn remove_cluster(&mut self, cluster: &C) -> usize {
        let mut dropped = 0;
        if let Some(deques) = self.queues.remove(cluster) {
            for req in deques.iter().flatten() {
                // A stale low-lane copy of a request also queued normally is one request.
                dropped += usize::from(self.queued.remove(req).is_some());
            }
            for rotation in &mut self.rotation {
                rotation.retain(|c| c != cluster);
            }
        }
        self.dirty.retain(|r, _| &r.cluster != cluster);
        dropped
    }

    /// Requests waiting (not in flight).
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.queued.len()
    }

    /// Whether `req` is in flight.
    #[cfg(test)]
    pub(crate) fn is_in_flight(&self, req: &Request<C>) -> bool {
        self.in_flight.contains_key(req)
    }

    /// How many requests are in flight.
    pub(crate) fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// Per cluster with any: its requests ready in each lane, and in flight (for the
    /// diagnostics view; walks every request).
    fn depths(&self) -> HashMap<C, Depth> {
        let mut depths: HashMap<C, Depth> = HashMap::default();
        for (req, (_, lane)) in &self.queued {
            let depth = depths.entry(req.cluster.clone()).or_default();
            match lane {
                Lane::Normal => depth.normal += 1,
                Lane::Low => depth.low += 1,
            }
        }
        for (cluster, count) in &self.in_flight_per_cluster {
            depths.entry(cluster.clone()).or_default().in_flight = *count;
        }
        depths
    }
}

/// How a reconcile ended, from what it asks for next and why: a timeout counts as an error.
pub(crate) fn outcome_of(reason: &ReconcileReason, action: &Action) -> Outcome {
    match reason {
        ReconcileReason::Panicked => Outcome::Panic,
        ReconcileReason::ErrorPolicy | ReconcileReason::TimedOut => Outcome::Error,
        ReconcileReason::Backoff => Outcome::Requeue,
        _ => action.outcome(),
    }
}

/// One cluster's requests in a fleet queue ([`FleetQueue::depths`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Depth {
    pub(crate) normal: usize,
    pub(crate) low: usize,
    pub(crate) scheduled: usize,
    pub(crate) in_flight: usize,
}

/// A scheduler message: equal (and hashed) by request only, so that kube-runtime's scheduler
/// deduplicates requests whatever their reasons.
#[derive(Clone, Debug)]
struct Queued<C: ClusterId>(Request<C>, ReconcileReason, Lane);

impl<C: ClusterId> PartialEq for Queued<C> {
    fn eq(&self, other: &Self) -> bool {
        self.0 == other.0
    }
}
impl<C: ClusterId> Eq for Queued<C> {}
impl<C: ClusterId> Hash for Queued<C> {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.0.hash(state)
    }
}

/// The longest requeue delay honoured.
const MAX_DELAY: Duration = Duration::from_secs(180 * 24 * 3600);

type Requests<C> = Pin<Box<dyn Stream<Item = ScheduleRequest<Queued<C>>> + Send>>;

/// The whole queue of one fleet controller, without any Kubernetes in it: kube-runtime's
/// debounced scheduler (delays, requeues, deduplication) in front of a [`FairQueue`] (one in
/// flight per request, clusters served in turn), a concurrency limit, and the set of engaged
/// clusters (requests for any other cluster are dropped when they come due, once).
///
/// A trigger that is due at once (no debounce) for a request the scheduler does not hold
/// goes straight to the fair queue: the scheduler's timer and maps cost about 2,000
/// instructions a request (a tenth of a fleet reconcile's), and its timer wheel adds up to a
/// millisecond. A request the scheduler holds for later is triggered through it, which moves
/// that entry to now rather than leaving it to run a second time.
pub(crate) struct FleetQueue<C: ClusterId> {
    schedule_tx: mpsc::UnboundedSender<ScheduleRequest<Queued<C>>>,
    scheduler: Pin<Box<Scheduler<Queued<C>, Requests<C>>>>,
    /// Requests sent to the scheduler and not yet come due.
    scheduled: HashSet<Request<C>>,
    /// Triggers wait this long for further triggers (zero: none).
    debounce: Duration,
    /// Each request with why it was queued and when it came due.
    ready: FairQueue<C, (ReconcileReason, Instant)>,
    engaged: HashSet<C>,
    /// 0 for no limit.
    concurrency: usize,
    /// Whether listed requests go to the low lane (else every request is normal).
    lanes: bool,
    metrics: Option<QueueMetrics<C>>,
    /// The spans of requests waiting, while a subscriber takes them: kept exactly as long as
    /// their request is (dropped with it, taken with it).
    origins: HashMap<Request<C>, Origin>,
}

/// The spans of a request waiting: the watch event (or other source) that asked for it, and
/// its wait, which ends (its span closes) when the request is taken or dropped.
pub(crate) struct Origin {
    pub(crate) event: tracing::Span,
    /// Held (open) while the request waits.
    pub(crate) _waiting: tracing::Span,
}

/// The Prometheus series a fleet queue keeps up to date.
struct QueueMetrics<C: ClusterId> {
    metrics: Metrics,
    controller: Arc<str>,
    /// Per engaged cluster.
    series: HashMap<C, Series>,
    /// Reconciles running now.
    active: Gauge,
}

impl<C: ClusterId> Drop for FleetQueue<C> {
    /// A queue dropped with reconciles in flight (a term's end, a run dropped): they no
    /// longer run here, and the gauges the next term shares say so.
    fn drop(&mut self) {
        let Some(m) = &self.metrics else {
            return;
        };
        m.active
            .dec_by(i64::try_from(self.ready.in_flight()).unwrap_or(i64::MAX));
        for (cluster, series) in &m.series {
            for began in self.ready.started_in(cluster) {
                series.running.stop(began);
            }
        }
    }
}

impl<C: ClusterId> FleetQueue<C> {
    /// An empty queue running at most `concurrency` requests at once and `per_cluster` of one
    /// cluster (0: no limit), waiting `debounce` for further triggers of a request before it
    /// comes due.
    pub(crate) fn new(concurrency: usize, per_cluster: usize, debounce: Duration) -> Self {
        let (schedule_tx, mut rx) = mpsc::unbounded_channel();
        let requests: Requests<C> = Box::pin(futures::stream::poll_fn(move |cx| rx.poll_recv(cx)));
        Self {
            schedule_tx,
            scheduler: Box::pin(debounced_scheduler(requests, debounce)),
            scheduled: HashSet::default(),
            debounce,
            ready: FairQueue::with_cap(per_cluster),
            engaged: HashSet::default(),
            concurrency,
            lanes: true,
            metrics: None,
            origins: HashMap::default(),
        }
    }

    /// With `false`, one lane for every request: listed objects are not put behind live
    /// changes.
    pub(crate) fn with_lanes(mut self, lanes: bool) -> Self {
        self.lanes = lanes;
        self
    }

    /// Keeps `controller`'s series in `metrics` up to date.
    pub(crate) fn with_metrics(mut self, metrics: Metrics, controller: Arc<str>) -> Self {
        let active = metrics.controller(&controller, self.concurrency);
        self.metrics = Some(QueueMetrics {
            metrics,
            controller,
            series: HashMap::default(),
            active,
        });
        self
    }

    /// Starts accepting requests for `cluster`.
    pub(crate) fn engage(&mut self, cluster: C) {
        if let Some(m) = &mut self.metrics
            && !m.series.contains_key(&cluster)
        {
            let series = m.metrics.series(&m.controller, &cluster.to_string(), true);
            m.series.insert(cluster.clone(), series);
        }
        self.engaged.insert(cluster);
    }

    /// Stops serving `cluster`: what is ready for it is dropped now, what is scheduled for
    /// later is dropped when it comes due, and reconciles in flight are not requeued. Its
    /// series are removed.
    pub(crate) fn disengage(&mut self, cluster: &C) {
        self.engaged.remove(cluster);
        if !self.origins.is_empty() {
            self.origins
                .retain(|request, _| request.cluster != *cluster);
        }
        let dropped = self.ready.remove_cluster(cluster);
        if let Some(m) = &mut self.metrics
            && let Some(series) = m.series.remove(cluster)
        {
            // Its reconciles still in flight and its requests dropped no longer count
            // (their series may be shared with other clusters', without the cluster label).
            for began in self.ready.started_in(cluster) {
                series.running.stop(began);
            }
            series
                .depth
                .dec_by(i64::try_from(dropped).unwrap_or(i64::MAX));
            m.metrics.forget(&series);
        }
    }

    /// The series of `cluster`, if metrics are kept and it is engaged.
    fn series(&self, cluster: &C) -> Option<&Series> {
        self.metrics.as_ref()?.series.get(cluster)
    }

    /// A request of `cluster` was queued.
    fn queued(&self, cluster: &C) {
        if let Some(series) = self.series(cluster) {
            series.adds.inc();
            series.depth.inc();
        }
    }

    /// Keeps the spans `origin` makes (given the lane) for `req`, about to be triggered for
    /// `reason`: only for a live change (listed objects and resyncs come in bulk, and are no
    /// news), of an engaged cluster, and not already waiting with spans of its own.
    pub(crate) fn trace(
        &mut self,
        req: &Request<C>,
        reason: &ReconcileReason,
        origin: impl FnOnce(Lane) -> Option<Origin>,
    ) {
        if reason.is_low()
            || !self.engaged.contains(&req.cluster)
            || (!self.origins.is_empty() && self.origins.contains_key(req))
        {
            return;
        }
        if let Some(origin) = origin(self.lane_of(reason)) {
            self.origins.insert(req.clone(), origin);
        }
    }

    /// The spans of `req`, just taken from the queue (its wait ends when they are dropped).
    pub(crate) fn take_origin(&mut self, req: &Request<C>) -> Option<Origin> {
        if self.origins.is_empty() {
            return None;
        }
        self.origins.remove(req)
    }

    /// How many requests have spans kept.
    #[cfg(test)]
    pub(crate) fn origins(&self) -> usize {
        self.origins.len()
    }

    /// Whether `cluster` is engaged.
    #[cfg(test)]
    pub(crate) fn is_engaged(&self, cluster: &C) -> bool {
        self.engaged.contains(cluster)
    }

    /// The lane a request queued for `reason` waits in.
    pub(crate) fn lane_of(&self, reason: &ReconcileReason) -> Lane {
        if self.lanes {
            Lane::of(reason)
        } else {
            Lane::Normal
        }
    }

    /// Asks for `req` to be reconciled now (after the debounce), in the low lane if
    /// `reason` says it is no news.
    pub(crate) fn trigger(&mut self, req: Request<C>, reason: ReconcileReason) {
        let lane = self.lane_of(&reason);
        if self.debounce.is_zero() && !self.scheduled.contains(&req) {
            self.due(req, reason, lane);
        } else {
            self.schedule(req, reason, lane, Instant::now());
        }
    }

    /// `req` is due: into the fair queue if its cluster is engaged.
    fn due(&mut self, req: Request<C>, reason: ReconcileReason, lane: Lane) {
        if self.engaged.contains(&req.cluster) {
            let cluster = req.cluster.clone();
            if self.ready.push(req, (reason, Instant::now()), lane) {
                self.queued(&cluster);
            }
        } else {
            tracing::debug!(request = %req, "dropping a request for a cluster that is not engaged");
        }
    }

    fn schedule(&mut self, req: Request<C>, reason: ReconcileReason, lane: Lane, run_at: Instant) {
        self.scheduled.insert(req.clone());
        // The receiver lives in `self.scheduler`, so the send cannot fail.
        let _ = self.schedule_tx.send(ScheduleRequest {
            message: Queued(req, reason, lane),
            run_at,
        });
    }

    /// Counts a reconcile of `cluster` that returned after its reconcile timeout.
    pub(crate) fn timed_out(&self, cluster: &C) {
        if let Some(series) = self.series(cluster) {
            series.timed_out();
        }
    }

    /// Marks `req`, handed out by [`FleetQueue::poll_next`], finished; schedules it again
    /// after the action's delay, in the lane it came from, if its cluster is still engaged.
    /// `took` is how long the reconcile ran, if it was timed (metrics are kept).
    pub(crate) fn finish(
        &mut self,
        req: Request<C>,
        action: Action,
        reason: ReconcileReason,
        took: Option<Duration>,
    ) {
        self.finish_marked(req, action, reason, took, TraceMark::default());
    }

    /// [`FleetQueue::finish`], with the trace the reconcile ran in (an exemplar of its
    /// duration).
    pub(crate) fn finish_marked(
        &mut self,
        req: Request<C>,
        action: Action,
        reason: ReconcileReason,
        took: Option<Duration>,
        mark: TraceMark,
    ) {
        if let Some(m) = &self.metrics {
            m.active.dec();
        }
        let (requeued, began) = self.ready.done_started(&req);
        let (began, lane) = match began {
            Some((at, lane)) => (Some(at), lane),
            None => (None, Lane::Normal),
        };
        // Stopped whether it reconciled or not (its object gone, its cluster no longer
        // followed, its tenure lapsed): an entry left would read as a reconcile stuck.
        if took.is_none()
            && let (Some(began), Some(series)) = (began, self.series(&req.cluster))
        {
            series.running.stop(began);
        }
        if let Some(took) = took
            && let Some(series) = self.series(&req.cluster)
        {
            if reason == ReconcileReason::TimedOut {
                series.timed_out();
            }
            let outcome = outcome_of(&reason, &action);
            let retried = matches!(outcome, Outcome::Error | Outcome::Panic | Outcome::Requeue)
                && action.requeue_after().is_some();
            series.ended(outcome, began, took, retried, mark);
        }
        if requeued {
            self.queued(&req.cluster);
        }
        if let Some(delay) = action.requeue_after()
            && self.engaged.contains(&req.cluster)
        {
            // Any delay a user can ask for is accepted: beyond half a year (where tokio's
            // delay queue would panic) it is capped, as kube-runtime's scheduler does.
            let delay = delay.min(MAX_DELAY);
            self.schedule(req, reason, lane, Instant::now() + delay);
        }
    }

    /// The next request to reconcile, if one is due and a concurrency slot is free. It
    /// counts as in flight until [`FleetQueue::finish`].
    pub(crate) fn poll_next(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<(Request<C>, ReconcileReason)> {
        // Move everything due into the fair queue first, so clusters take turns among all
        // that is due rather than in the order their delays ran out. With nothing scheduled
        // (the rule without a debounce) the scheduler has nothing to give, and is not polled
        // (its timer costs about 500 instructions a poll): only this queue's owner schedules,
        // and it polls the queue again before it waits whenever it may start work (while it
        // may not, it polls nothing here, as before).
        while !self.scheduled.is_empty()
            && let Poll::Ready(Some(Queued(req, reason, lane))) =
                self.scheduler.as_mut().poll_next(cx)
        {
            self.scheduled.remove(&req);
            self.due(req, reason, lane);
        }
        if self.scheduled.is_empty() && self.scheduled.capacity() > 1024 {
            // A debounced burst came due: its table is not kept at its peak size.
            self.scheduled.shrink_to_fit();
        }
        if self.concurrency != 0 && self.ready.in_flight() >= self.concurrency {
            // Woken again by whoever finishes a request (it polls us after `finish`).
            return Poll::Pending;
        }
        let now = Instant::now();
        match self.ready.pop_at(now) {
            Some((req, (reason, due))) => {
                if let Some(m) = &self.metrics {
                    m.active.inc();
                    if let Some(series) = m.series.get(&req.cluster) {
                        series.depth.dec();
                        series.started(now, now.saturating_duration_since(due));
                    }
                }
                Poll::Ready((req, reason))
            }
            None => Poll::Pending,
        }
    }

    /// [`FleetQueue::poll_next`] as a future.
    ///
    /// It runs outside tokio's cooperative budget: the scheduler's timer charges that budget
    /// per item, so within it a poll would move only about 128 due requests into the fair
    /// queue, and a request that came due after a backlog of thousands would wait for the
    /// whole backlog to be moved, one batch per reconcile, before its cluster got a turn.
    pub(crate) fn next(&mut self) -> impl Future<Output = (Request<C>, ReconcileReason)> + '_ {
        tokio::task::unconstrained(futures::future::poll_fn(move |cx| self.poll_next(cx)))
    }

    /// How many requests are in flight.
    #[cfg(test)]
    pub(crate) fn in_flight(&self) -> usize {
        self.ready.in_flight()
    }

    /// Per cluster with any: its requests ready in each lane, waiting for a delay, and in
    /// flight (for the diagnostics view; walks every request).
    pub(crate) fn depths(&self) -> HashMap<C, Depth> {
        let mut depths = self.ready.depths();
        for req in &self.scheduled {
            depths.entry(req.cluster.clone()).or_default().scheduled += 1;
        }
        depths
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::ClusterName;

    impl FairQueue<ClusterName> {
        fn push_(&mut self, r: Request<ClusterName>) {
            self.push(r, (), Lane::Normal);
        }
        fn push_low(&mut self, r: Request<ClusterName>) {
            self.push(r, (), Lane::Low);
        }
    }

    fn req(cluster: &str, name: &str) -> Request<ClusterName> {
        Request::new(ClusterName::from(cluster), Some("ns"), name)
    }

    #[test]
    fn a_quiet_cluster_is_served_within_one_rotation_of_a_flooded_one() {
        let mut q = FairQueue::default();
        for i in 0..10_000 {
            q.push_(req("noisy", &format!("o{i}")));
        }
        q.pop().map(|(r, ())| r);
        q.push_(req("quiet", "only"));
        // quiet joins the rotation behind noisy: one noisy request, then quiet, not after
        // the 9,999 others.
        assert_eq!(q.pop().map(|(r, ())| r).unwrap().cluster, "noisy");
        assert_eq!(q.pop().map(|(r, ())| r).unwrap(), req("quiet", "only"));
        assert_eq!(q.pop().map(|(r, ())| r).unwrap().cluster, "noisy");
    }

    #[test]
    fn a_drained_backlog_does_not_keep_its_tables_at_peak_size() {
        let mut q = FairQueue::default();
        for c in 0..1_000 {
            for i in 0..10 {
                q.push_(req(&format!("c{c}"), &format!("o{i}")));
            }
        }
        let peak = q.queued.capacity();
        assert!(peak >= 10_000);
        while let Some((r, ())) = q.pop() {
            q.done(&r);
        }
        assert!(
            q.queued.capacity() < 1_000 && q.queues.capacity() < 1_000,
            "capacity kept: queued {} (peak {peak}), queues {}",
            q.queued.capacity(),
            q.queues.capacity()
        );
        // Still a working queue.
        q.push_(req("a", "x"));
        assert_eq!(q.pop().map(|(r, ())| r), Some(req("a", "x")));
    }

    #[test]
    fn clusters_take_turns() {
        let mut q = FairQueue::default();
        for i in 0..3 {
            q.push_(req("a", &format!("{i}")));
        }
        q.push_(req("b", "0"));
        q.push_(req("c", "0"));
        let order: Vec<String> = std::iter::from_fn(|| q.pop().map(|(r, ())| r))
            .map(|r| format!("{}{}", r.cluster, r.name))
            .collect();
        assert_eq!(order, ["a0", "b0", "c0", "a1", "a2"]);
    }

    #[test]
    fn duplicates_are_queued_once() {
        let mut q = FairQueue::default();
        q.push_(req("a", "x"));
        q.push_(req("a", "x"));
        assert_eq!(q.len(), 1);
        q.pop().map(|(r, ())| r);
        assert!(q.pop().map(|(r, ())| r).is_none());
    }

    #[test]
    fn a_request_pushed_while_in_flight_runs_again_after_it_is_done_not_before() {
        let mut q = FairQueue::default();
        q.push_(req("a", "x"));
        let r = q.pop().map(|(r, ())| r).unwrap();
        q.push_(req("a", "x"));
        assert!(
            q.pop().map(|(r, ())| r).is_none(),
            "must not run twice at once"
        );
        q.done(&r);
        assert_eq!(q.pop().map(|(r, ())| r).unwrap(), r);
        assert!(q.is_in_flight(&r));
        q.done(&r);
        assert!(q.pop().map(|(r, ())| r).is_none(), "one push, one re-run");
    }

    #[test]
    fn live_changes_go_before_listed_objects_in_every_cluster() {
        let mut q = FairQueue::default();
        for i in 0..1_000 {
            q.push_low(req("a", &format!("l{i}")));
            q.push_low(req("b", &format!("l{i}")));
        }
        q.push_(req("b", "live"));
        q.push_(req("a", "live"));
        let first: Vec<_> = (0..2).map(|_| q.pop().unwrap().0).collect();
        assert_eq!(first, [req("b", "live"), req("a", "live")]);
        // Then the listings, clusters in turn.
        let next: Vec<_> = (0..4).map(|_| q.pop().unwrap().0.cluster).collect();
        assert_eq!(next, ["a", "b", "a", "b"]);
    }

    #[test]
    fn a_listed_request_changed_while_queued_moves_ahead_and_runs_once() {
        let mut q = FairQueue::default();
        for i in 0..100 {
            q.push_low(req("a", &format!("l{i}")));
        }
        assert!(!q.push(req("a", "l50"), (), Lane::Normal), "already queued");
        assert_eq!(q.len(), 100);
        assert_eq!(q.pop().unwrap().0, req("a", "l50"));
        let mut rest = Vec::new();
        while let Some((r, ())) = q.pop() {
            rest.push(r);
        }
        assert_eq!(rest.len(), 99, "l50 left behind in the low lane is skipped");
        assert!(!rest.contains(&req("a", "l50")));
        // A listed push does not demote a live one.
        q.push_(req("a", "x"));
        q.push_low(req("a", "y"));
        q.push_low(req("a", "x"));
        assert_eq!(q.pop().unwrap().0, req("a", "x"));
    }

    /// The diagnostics view's depths: per cluster and lane, a request moved to the normal
    /// lane counted there once, those in flight apart.
    #[test]
    fn depths_count_each_request_once_in_its_lane() {
        let mut q = FairQueue::default();
        for i in 0..3 {
            q.push_low(req("a", &format!("l{i}")));
        }
        q.push_(req("a", "l1"));
        q.push_(req("b", "x"));
        q.push_(req("b", "y"));
        let (taken, ()) = q.pop().unwrap();
        let depths = q.depths();
        let depth = |c: &str| {
            depths
                .get(&ClusterName::from(c))
                .copied()
                .unwrap_or_default()
        };
        let in_a = usize::from(taken.cluster == "a");
        assert_eq!(depth("a").low, 2);
        assert_eq!(depth("a").normal + depth("b").normal, 2);
        assert_eq!(depth("a").in_flight, in_a);
        assert_eq!(depth("b").in_flight, 1 - in_a);
        assert_eq!(depth("a").scheduled + depth("b").scheduled, 0);
    }

    #[test]
    fn a_stream_of_live_changes_cannot_starve_a_listing() {
        let mut q = FairQueue::default();
        q.push_low(req("a", "listed"));
        let mut served = 0;
        loop {
            q.push_(req("b", &format!("live{served}")));
            let (r, ()) = q.pop().unwrap();
            q.done(&r);
            served += 1;
            if r.name == "listed" {
                break;
            }
            assert!(served <= LOW_SHARE as usize, "the listed object starved");
        }
        assert_eq!(served, LOW_SHARE as usize + 1);
    }

    #[test]
    fn a_rerun_keeps_the_higher_lane_of_its_pushes() {
        let mut q = FairQueue::default();
        q.push_low(req("a", "x"));
        let (x, ()) = q.pop().unwrap();
        q.push_low(x.clone());
        q.push_(x.clone());
        for i in 0..10 {
            q.push_low(req("a", &format!("l{i}")));
        }
        q.done(&x);
        assert_eq!(q.pop().unwrap().0, x, "re-run in the normal lane");
    }

    #[test]
    fn a_cluster_at_its_cap_keeps_its_turn_while_others_are_served() {
        let mut q = FairQueue::with_cap(1);
        q.push_(req("a", "x"));
        q.push_(req("a", "y"));
        q.push_(req("b", "z"));
        let x = q.pop().map(|(r, ())| r).unwrap();
        assert_eq!(x, req("a", "x"));
        assert_eq!(
            q.pop().map(|(r, ())| r),
            Some(req("b", "z")),
            "a is at its cap"
        );
        assert_eq!(q.pop().map(|(r, ())| r), None, "a still is; b has nothing");
        q.done(&x);
        assert_eq!(q.pop().map(|(r, ())| r), Some(req("a", "y")));
    }

    #[test]
    fn removing_a_cluster_drops_its_queue_and_pending_reruns() {
        let mut q = FairQueue::default();
        q.push_(req("a", "x"));
        q.push_(req("a", "y"));
        q.push_(req("b", "z"));
        let x = q.pop().map(|(r, ())| r).unwrap();
        q.push_(x.clone());
        q.remove_cluster(&ClusterName::from("a"));
        q.done(&x);
        assert_eq!(q.pop().map(|(r, ())| r).unwrap(), req("b", "z"));
        assert!(q.pop().map(|(r, ())| r).is_none());
        assert_eq!(q.len(), 0);
    }

    mod fleet_queue {
        use super::*;
        use crate::controller::ReconcileReason::{ObjectChanged, Requeue};
        use std::time::Duration;

        fn name(s: &str) -> ClusterName {
            ClusterName::from(s)
        }

        fn queue(concurrency: usize, clusters: &[&str]) -> FleetQueue<ClusterName> {
            let mut q = FleetQueue::new(concurrency, 0, Duration::ZERO);
            for c in clusters {
                q.engage(name(c));
            }
            q
        }

        /// `next()` within `secs` of paused time, or None.
        async fn next_within(
            q: &mut FleetQueue<ClusterName>,
            secs: u64,
        ) -> Option<Request<ClusterName>> {
            tokio::time::timeout(Duration::from_secs(secs), q.next())
                .await
                .ok()
                .map(|(r, _)| r)
        }

        /// The largest value of `metric` in `registry`'s text (0 when it has no sample).
        fn largest(registry: &prometheus_client::registry::Registry, metric: &str) -> f64 {
            let mut text = String::new();
            prometheus_client::encoding::text::encode(&mut text, registry).unwrap();
            text.lines()
                .filter(|l| l.starts_with(metric) && l[metric.len()..].starts_with(['{', ' ']))
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .fold(0.0, f64::max)
        }

        #[tokio::test(start_paused = true)]
        async fn requests_that_never_reconciled_a_dropped_queue_and_a_dropped_backlog_leave_no_gauge_up()
         {
            for with_cluster in [true, false] {
                let mut registry = prometheus_client::registry::Registry::default();
                let metrics = if with_cluster {
                    crate::metrics::Metrics::new(&mut registry)
                } else {
                    crate::metrics::Metrics::without_cluster_label(&mut registry)
                };
                let mut q = FleetQueue::new(2, 0, Duration::ZERO)
                    .with_metrics(metrics.clone(), Arc::from("owners"));
                q.engage(name("a"));
                q.engage(name("b"));
                // Popped, then finished untimed: its object was gone from the cache (an
                // owner deleted, its children's deletions mapping to it).
                q.trigger(req("a", "gone"), ObjectChanged);
                let (r, why) = q.next().await;
                q.finish(r, Action::await_change(), why, None);
                tokio::time::advance(Duration::from_secs(10)).await;
                let nothing_running = |when: &str| {
                    for metric in [
                        "workqueue_longest_running_processor_seconds",
                        "workqueue_unfinished_work_seconds",
                        "controller_runtime_active_workers",
                    ] {
                        assert_eq!(
                            largest(&registry, metric),
                            0.0,
                            "{metric}{when}, with_cluster {with_cluster}"
                        );
                    }
                };
                nothing_running("");
                // A backlog dropped with its cluster: not counted in the depth any more.
                q.trigger(req("b", "x"), ObjectChanged);
                q.trigger(req("b", "y"), ObjectChanged);
                q.trigger(req("a", "z"), ObjectChanged);
                let (r, why) = q.next().await;
                q.disengage(&r.cluster);
                let other = if r.cluster == "a" { "b" } else { "a" };
                q.disengage(&name(other));
                // The reconcile in flight of the disengaged cluster ends after it.
                q.finish(r, Action::await_change(), why, None);
                drop(q);
                assert_eq!(
                    largest(&registry, "workqueue_depth"),
                    0.0,
                    "with_cluster {with_cluster}"
                );
                // A queue dropped at the end of a term with a reconcile in flight.
                let mut q = FleetQueue::new(2, 0, Duration::ZERO)
                    .with_metrics(metrics.clone(), Arc::from("owners"));
                q.engage(name("c"));
                q.trigger(req("c", "busy"), ObjectChanged);
                let _in_flight = q.next().await;
                tokio::time::advance(Duration::from_secs(1)).await;
                assert_eq!(largest(&registry, "controller_runtime_active_workers"), 1.0);
                drop(q);
                tokio::time::advance(Duration::from_secs(10)).await;
                nothing_running(" after the drop");
            }
        }

        #[tokio::test(start_paused = true)]
        async fn a_cluster_with_10000_pending_requests_delays_another_by_at_most_one_slot() {
            let mut q = queue(1, &["noisy", "quiet"]);
            for i in 0..10_000 {
                q.trigger(req("noisy", &format!("o{i}")), ObjectChanged);
            }
            let (first, why) = q.next().await;
            assert_eq!(first.cluster, "noisy");
            // The quiet cluster's only request arrives while the noisy backlog is due.
            q.trigger(req("quiet", "only"), ObjectChanged);
            q.finish(first, Action::await_change(), why, None);
            let mut slots_before_quiet = 0;
            loop {
                let (r, why) = q.next().await;
                // Each reconcile takes 10 ms of (paused) time.
                tokio::time::sleep(Duration::from_millis(10)).await;
                q.finish(r.clone(), Action::await_change(), why, None);
                if r.cluster == "quiet" {
                    break;
                }
                slots_before_quiet += 1;
            }
            assert!(
                slots_before_quiet <= 1,
                "quiet waited {slots_before_quiet} reconcile slots"
            );
        }

        #[tokio::test(start_paused = true)]
        async fn a_live_change_waits_behind_at_most_the_listed_objects_in_flight() {
            const CONCURRENCY: usize = 8;
            let mut q = queue(CONCURRENCY, &["a", "b"]);
            for i in 0..10_000 {
                q.trigger(req("a", &format!("o{i}")), ReconcileReason::Listed);
            }
            let mut running = Vec::new();
            for _ in 0..CONCURRENCY {
                running.push(q.next().await);
            }
            // Live changes in the listing cluster and in another arrive now.
            q.trigger(req("a", "live"), ObjectChanged);
            q.trigger(req("b", "live"), ObjectChanged);
            let mut listed_started_after = 0;
            let mut live = 0;
            while live < 2 {
                let (r, why) = running.remove(0);
                q.finish(r, Action::await_change(), why, None);
                let (r, why) = q.next().await;
                if r.name == "live" {
                    assert_eq!(why, ObjectChanged);
                    live += 1;
                } else {
                    listed_started_after += 1;
                }
                running.push((r, why));
            }
            assert_eq!(listed_started_after, 0);
        }

        #[tokio::test(start_paused = true)]
        async fn a_requeue_keeps_the_lane_its_request_came_from() {
            let mut q = queue(1, &["a"]);
            q.trigger(req("a", "listed"), ReconcileReason::Listed);
            let (r, why) = q.next().await;
            q.finish(r, Action::requeue(Duration::from_secs(1)), Requeue, None);
            let _ = why;
            for i in 0..3 {
                q.trigger(req("a", &format!("l{i}")), ReconcileReason::Listed);
            }
            tokio::time::sleep(Duration::from_secs(2)).await;
            q.trigger(req("a", "live"), ObjectChanged);
            let order: Vec<String> = {
                let mut order = Vec::new();
                for _ in 0..5 {
                    let (r, why) = q.next().await;
                    order.push(r.name.clone());
                    q.finish(r, Action::await_change(), why, None);
                }
                order
            };
            // The requeue came due after the three listed ones were queued, in their lane.
            assert_eq!(order, ["live", "l0", "l1", "l2", "listed"]);
        }

        #[tokio::test(start_paused = true)]
        async fn a_requeue_comes_due_after_its_delay_and_not_before() {
            let mut q = queue(0, &["a"]);
            q.trigger(req("a", "x"), ObjectChanged);
            let (r, _) = q.next().await;
            q.finish(r, Action::requeue(Duration::from_secs(30)), Requeue, None);
            assert_eq!(next_within(&mut q, 29).await, None);
            assert_eq!(next_within(&mut q, 2).await, Some(req("a", "x")));
        }

        #[tokio::test(start_paused = true)]
        async fn a_trigger_brings_a_scheduled_requeue_forward_and_it_runs_once() {
            let mut q = queue(0, &["a"]);
            q.trigger(req("a", "x"), ObjectChanged);
            let (r, why) = q.next().await;
            q.finish(r, Action::requeue(Duration::from_secs(3600)), why, None);
            // A change now: reconciled now, and the hour-later requeue is gone with it.
            q.trigger(req("a", "x"), ObjectChanged);
            let (r, why) = q.next().await;
            assert_eq!(r, req("a", "x"));
            q.finish(r, Action::await_change(), why, None);
            assert_eq!(
                next_within(&mut q, 2 * 3600).await,
                None,
                "the requeue ran a second time"
            );
            // Due at once, nothing scheduled: straight to the fair queue, and deduplicated.
            q.trigger(req("a", "y"), ObjectChanged);
            q.trigger(req("a", "y"), ObjectChanged);
            assert_eq!(next_within(&mut q, 0).await, Some(req("a", "y")));
            assert_eq!(next_within(&mut q, 60).await, None);
        }

        #[tokio::test(start_paused = true)]
        async fn the_concurrency_limit_holds_requests_until_a_slot_frees() {
            let mut q = queue(2, &["a", "b"]);
            for n in ["1", "2", "3"] {
                q.trigger(req("a", n), ObjectChanged);
            }
            let (r1, w1) = q.next().await;
            let _r2 = q.next().await;
            assert_eq!(q.in_flight(), 2);
            assert_eq!(next_within(&mut q, 60).await, None, "a third may not start");
            q.finish(r1, Action::await_change(), w1, None);
            assert!(next_within(&mut q, 1).await.is_some());
        }

        #[tokio::test(start_paused = true)]
        async fn a_request_never_runs_twice_at_once_and_a_change_during_a_run_is_not_lost() {
            let mut q = queue(0, &["a"]);
            q.trigger(req("a", "x"), ObjectChanged);
            let (r, why) = q.next().await;
            q.trigger(req("a", "x"), ObjectChanged);
            assert_eq!(next_within(&mut q, 60).await, None);
            q.finish(r, Action::await_change(), why, None);
            assert_eq!(next_within(&mut q, 1).await, Some(req("a", "x")));
        }

        #[tokio::test(start_paused = true)]
        async fn requests_for_a_disengaged_cluster_are_dropped_once_and_never_requeued() {
            let mut q = queue(0, &["a", "b"]);
            q.trigger(req("a", "ready"), ObjectChanged);
            q.trigger(req("a", "running"), ObjectChanged);
            let (running, why) = q.next().await;
            // A requeue scheduled for later, then the cluster goes away.
            q.finish(
                running.clone(),
                Action::requeue(Duration::from_secs(5)),
                why.clone(),
                None,
            );
            let (running, why) = (q.next().await.0, why);
            q.disengage(&name("a"));
            assert!(!q.is_engaged(&name("a")));
            // The reconcile in flight finishes and asks for a requeue: refused.
            q.finish(running, Action::requeue(Duration::from_secs(1)), why, None);
            q.trigger(req("a", "late"), ObjectChanged);
            q.trigger(req("b", "other"), ObjectChanged);
            assert_eq!(next_within(&mut q, 60).await, Some(req("b", "other")));
            assert_eq!(
                next_within(&mut q, 600).await,
                None,
                "nothing of cluster a comes back"
            );
        }

        #[tokio::test(start_paused = true)]
        async fn an_absurd_requeue_delay_is_capped_not_a_panic() {
            let mut q = queue(0, &["a"]);
            q.trigger(req("a", "x"), ObjectChanged);
            let (r, why) = q.next().await;
            q.finish(r, Action::requeue(Duration::MAX), why, None);
            assert_eq!(next_within(&mut q, 24 * 3600).await, None);
        }

        /// The spans of a request live as long as it does: none for a listing, a cluster not
        /// engaged or a request already waiting with its own; taken with it; dropped with a
        /// cluster that leaves.
        #[tokio::test(start_paused = true)]
        async fn a_requests_spans_live_as_long_as_it_does() {
            let origin = |_: Lane| {
                Some(Origin {
                    event: tracing::Span::none(),
                    _waiting: tracing::Span::none(),
                })
            };
            let mut q = queue(0, &["a", "b"]);
            q.trace(&req("a", "listed"), &ReconcileReason::Listed, origin);
            q.trace(&req("c", "elsewhere"), &ObjectChanged, origin);
            assert_eq!(
                q.origins(),
                0,
                "no spans for a listing or a cluster not engaged"
            );
            q.trace(&req("a", "x"), &ObjectChanged, origin);
            q.trigger(req("a", "x"), ObjectChanged);
            let mut asked = 0;
            q.trace(&req("a", "x"), &ObjectChanged, |_| {
                asked += 1;
                None
            });
            assert_eq!(asked, 0, "a request waiting keeps the spans it came with");
            let (taken, _) = q.next().await;
            assert!(q.take_origin(&taken).is_some());
            assert_eq!(q.origins(), 0, "taken with the request");
            q.trace(&req("b", "y"), &ObjectChanged, origin);
            q.trigger(req("b", "y"), ObjectChanged);
            assert_eq!(q.origins(), 1);
            q.disengage(&name("b"));
            assert_eq!(q.origins(), 0, "dropped with its cluster");
        }
    }
}
