//! [`Metrics`]: Prometheus metrics of a manager, under controller-runtime's names and labels
//! so its dashboards and alerts work, with a `cluster` label on the reconcile and queue
//! series.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use tokio::time::Instant;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::telemetry::TraceMark;

mod process;

/// The `cluster` label, added to controller-runtime's label sets: absent when `None` (without
/// the cluster label, or on a histogram kept per controller), so those sets are exactly
/// controller-runtime's.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct ClusterLabel(Option<Arc<str>>);

impl EncodeLabelSet for ClusterLabel {
    fn encode(
        &self,
        encoder: &mut prometheus_client::encoding::LabelSetEncoder<'_>,
    ) -> Result<(), std::fmt::Error> {
        use prometheus_client::encoding::EncodeLabel;
        match &self.0 {
            Some(cluster) => ("cluster", &**cluster).encode(encoder.encode_label()),
            None => Ok(()),
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReconcileLabels {
    controller: Arc<str>,
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ControllerLabels {
    controller: Arc<str>,
}

/// client-go's workqueue metrics name the queue `name`; controller-runtime adds `controller`
/// (the same value).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct QueueLabels {
    name: Arc<str>,
    controller: Arc<str>,
}

/// `workqueue_depth`'s labels: controller-runtime's priority queue counts its depth by
/// priority; a queue without priorities reports the empty one.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DepthLabels {
    name: Arc<str>,
    controller: Arc<str>,
    priority: &'static str,
}

/// client-go's request counter labels (`host`: the API server's `host:port`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    code: String,
    method: String,
    host: Arc<str>,
}

/// controller-runtime's webhook labels: `webhook` is the webhook's name here (its path
/// carries a cluster's route token, which must not reach a scraper).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WebhookLabels {
    webhook: Arc<str>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WebhookCodeLabels {
    webhook: Arc<str>,
    code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SourceLabels {
    source: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WatchLabels {
    kind: String,
}

/// Label sets with the cluster label beside them.
type With<L> = (L, ClusterLabel);

/// Where the watch gauges come from at scrape time: each source lists its clusters' watches.
type WatchSource = Box<dyn Fn() -> Vec<(String, Vec<WatchRow>)> + Send + Sync>;

/// One watch of a cluster, as the watch gauges count it.
#[derive(Clone, Debug)]
pub(crate) struct WatchRow {
    /// The kind watched.
    pub(crate) kind: String,
    /// Its first listing is in.
    pub(crate) synced: bool,
    /// It fails (forbidden, kind missing, server unreachable).
    pub(crate) failing: bool,
    /// It has not listed within the manager's cache sync timeout.
    pub(crate) overdue: bool,
}

/// The per-cluster watch gauges, computed when scraped (nothing to keep up to date).
struct Watches {
    cluster_label: bool,
    /// By the key of the fleet they read.
    sources: std::sync::Mutex<Vec<(usize, WatchSource)>>,
}

impl std::fmt::Debug for Watches {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watches").finish_non_exhaustive()
    }
}

impl prometheus_client::collector::Collector for Watches {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::DescriptorEncoder,
    ) -> Result<(), std::fmt::Error> {
        let synced = Family::<With<WatchLabels>, Gauge>::default();
        let failing = Family::<With<WatchLabels>, Gauge>::default();
        let overdue = Family::<With<WatchLabels>, Gauge>::default();
        for (_, source) in crate::util::sync::lock(&self.sources).iter() {
            for (cluster, watches) in source() {
                let cluster = ClusterLabel(self.cluster_label.then(|| Arc::from(cluster)));
                for watch in watches {
                    let labels = (WatchLabels { kind: watch.kind }, cluster.clone());
                    // Summed over clusters without the cluster label.
                    synced
                        .get_or_create(&labels)
                        .inc_by(i64::from(watch.synced));
                    failing
                        .get_or_create(&labels)
                        .inc_by(i64::from(watch.failing));
                    overdue
                        .get_or_create(&labels)
                        .inc_by(i64::from(watch.overdue));
                }
            }
        }
        encode_families(
            &mut encoder,
            [
                (
                    "multicluster_runtime_watch_synced",
                    "How many of a cluster's watches of a kind have listed (one per watcher configuration)",
                    &synced,
                ),
                (
                    "multicluster_runtime_watch_failing",
                    "How many of a cluster's watches of a kind fail: forbidden, kind missing, server unreachable",
                    &failing,
                ),
                (
                    "multicluster_runtime_watch_sync_overdue",
                    "How many of a cluster's watches of a kind have not listed within the manager's cache sync timeout",
                    &overdue,
                ),
            ],
        )
    }
}

/// Encodes families a collector computed at scrape time, each under its name and help.
fn encode_families<M: prometheus_client::encoding::EncodeMetric, const N: usize>(
    encoder: &mut prometheus_client::encoding::DescriptorEncoder,
    families: [(&str, &str, &M); N],
) -> Result<(), std::fmt::Error> {
    for (name, help, family) in families {
        family.encode(encoder.encode_descriptor(name, help, None, family.metric_type())?)?;
    }
    Ok(())
}

/// The start times of a queue's reconciles in flight (a multiset: clusters sharing series
/// without the cluster label may start two at the same instant).
#[derive(Debug, Default)]
pub(crate) struct Running(std::sync::Mutex<std::collections::BTreeMap<Instant, u32>>);

impl Running {
    fn start(&self, at: Instant) {
        *crate::util::sync::lock(&self.0).entry(at).or_default() += 1;
    }

    /// A reconcile that started `at` ended (one not counted is ignored).
    pub(crate) fn stop(&self, at: Instant) {
        let mut running = crate::util::sync::lock(&self.0);
        if let std::collections::btree_map::Entry::Occupied(mut n) = running.entry(at) {
            *n.get_mut() -= 1;
            if *n.get() == 0 {
                n.remove();
            }
        }
    }

    /// Seconds of work in flight in all, and the longest-running reconcile's seconds.
    fn seconds(&self, now: Instant) -> (f64, f64) {
        let running = crate::util::sync::lock(&self.0);
        let total = running
            .iter()
            .map(|(at, n)| now.saturating_duration_since(*at).as_secs_f64() * f64::from(*n))
            .sum();
        let longest = running
            .keys()
            .next()
            .map_or(0.0, |at| now.saturating_duration_since(*at).as_secs_f64());
        (total, longest)
    }
}

/// `workqueue_unfinished_work_seconds` and `workqueue_longest_running_processor_seconds`,
/// computed from the reconciles in flight when scraped (client-go updates them on a timer).
#[derive(Debug, Default)]
struct InFlight(std::sync::Mutex<HashMap<With<QueueLabels>, Arc<Running>>>);

impl prometheus_client::collector::Collector for InFlight {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::DescriptorEncoder,
    ) -> Result<(), std::fmt::Error> {
        let unfinished = Family::<With<QueueLabels>, Gauge<f64, AtomicU64>>::default();
        let longest = Family::<With<QueueLabels>, Gauge<f64, AtomicU64>>::default();
        let now = Instant::now();
        for (labels, running) in crate::util::sync::lock(&self.0).iter() {
            let (total, oldest) = running.seconds(now);
            unfinished.get_or_create(labels).set(total);
            longest.get_or_create(labels).set(oldest);
        }
        encode_families(
            &mut encoder,
            [
                (
                    "workqueue_unfinished_work_seconds",
                    "Seconds the reconciles in flight have run so far, summed (a steady rise: reconciles stuck)",
                    &unfinished,
                ),
                (
                    "workqueue_longest_running_processor_seconds",
                    "Seconds the longest-running reconcile in flight has run",
                    &longest,
                ),
            ],
        )
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GroupLabels {
    group: Arc<str>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LeaseLabels {
    name: Arc<str>,
}

/// The outcomes `controller_runtime_reconcile_total` counts, by its `result` label (the
/// discriminant indexes `OUTCOMES`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// `Ok`, not requeued.
    Success = 0,
    /// `Err` (the error policy decided what next).
    Error = 1,
    /// `Ok`, requeued after a delay.
    RequeueAfter = 2,
    /// `Ok`, requeued after the object's backoff ([`Action::backoff`](crate::Action::backoff)):
    /// controller-runtime's `Requeue: true`.
    Requeue = 3,
    /// The reconciler (or its error policy) panicked: counted as an error, and as a panic.
    Panic = 4,
}

impl Outcome {
    fn label(self) -> &'static str {
        match self {
            Outcome::Success => "success",
            Outcome::Error | Outcome::Panic => "error",
            Outcome::RequeueAfter => "requeue_after",
            Outcome::Requeue => "requeue",
        }
    }
}

const OUTCOMES: [Outcome; 4] = [
    Outcome::Success,
    Outcome::Error,
    Outcome::RequeueAfter,
    Outcome::Requeue,
];

/// The reconcile histogram: with the feature `opentelemetry`, each bucket keeps the trace id
/// of its last sampled reconcile as an exemplar.
#[cfg(feature = "opentelemetry")]
type ReconcileHistogram = prometheus_client::metrics::exemplar::HistogramWithExemplars<TraceLabel>;
#[cfg(not(feature = "opentelemetry"))]
type ReconcileHistogram = Histogram;

/// An exemplar's label: the trace a reconcile ran in.
#[cfg(feature = "opentelemetry")]
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TraceLabel {
    trace_id: String,
}

#[cfg(feature = "opentelemetry")]
fn reconcile_histogram() -> ReconcileHistogram {
    ReconcileHistogram::new(duration_buckets())
}

#[cfg(not(feature = "opentelemetry"))]
fn reconcile_histogram() -> ReconcileHistogram {
    duration_histogram()
}

/// Observes a reconcile's duration, with its trace as the exemplar when there is one.
#[cfg(feature = "opentelemetry")]
fn observe_reconcile(histogram: &ReconcileHistogram, took: Duration, mark: TraceMark) {
    let label = mark.trace_id().map(|trace_id| TraceLabel { trace_id });
    let at = label.as_ref().map(|_| std::time::SystemTime::now());
    histogram.observe(took.as_secs_f64(), label, at);
}

#[cfg(not(feature = "opentelemetry"))]
#[inline(always)]
fn observe_reconcile(histogram: &ReconcileHistogram, took: Duration, _mark: TraceMark) {
    histogram.observe(took.as_secs_f64());
}

/// 5 ms to about 82 s, doubling (controller-runtime's reconcile buckets span the same).
fn duration_buckets() -> impl Iterator<Item = f64> {
    exponential_buckets(0.005, 2.0, 15)
}

fn duration_histogram() -> Histogram {
    Histogram::new(duration_buckets())
}

/// Prometheus metrics of a [`Manager`](crate::Manager) and its controllers, registered into
/// a registry of yours (which you can extend with metrics of your own and serve).
///
/// Each series has controller-runtime's name, type and labels (so its dashboards and alerts
/// work), and counters and gauges of a controller in a cluster add a `cluster` label:
///
/// | series | type | labels | what |
/// | --- | --- | --- | --- |
/// | `controller_runtime_reconcile_total` | counter | `controller`, `result` (`success`, `error`, `requeue_after`, `requeue`), `cluster` | reconciles ended |
/// | `controller_runtime_reconcile_errors_total` | counter | `controller`, `cluster` | reconciles that returned an error |
/// | `controller_runtime_terminal_reconcile_errors_total` | counter | `controller`, `cluster` | errors not retried: marked with `Context::terminal`, or the error policy's action awaits a change |
/// | `controller_runtime_reconcile_timeouts_total` | counter | `controller`, `cluster` | reconciles dropped at `Builder::reconcile_timeout` (also counted as errors) |
/// | `controller_runtime_reconcile_panics_total` | counter | `controller`, `cluster` | reconciles that panicked (caught; also counted as errors) |
/// | `controller_runtime_reconcile_time_seconds` | histogram | `controller` | reconcile durations |
/// | `controller_runtime_max_concurrent_reconciles` | gauge | `controller` | the concurrency limit (0: none) |
/// | `controller_runtime_active_workers` | gauge | `controller` | reconciles running now |
/// | `workqueue_depth` | gauge | `name`, `controller`, `priority` (empty), `cluster` | requests due and waiting for a slot |
/// | `workqueue_adds_total` | counter | `name`, `controller`, `cluster` | requests that came due and were queued |
/// | `workqueue_queue_duration_seconds` | histogram | `name`, `controller` | waits from due to started |
/// | `workqueue_work_duration_seconds` | histogram | `name`, `controller` | reconcile durations, as the queue sees them |
/// | `workqueue_unfinished_work_seconds` | gauge | `name`, `controller`, `cluster` | seconds the reconciles in flight have run, summed |
/// | `workqueue_longest_running_processor_seconds` | gauge | `name`, `controller`, `cluster` | seconds the longest reconcile in flight has run |
/// | `workqueue_retries_total` | counter | `name`, `controller`, `cluster` | retries: requeues decided by the error policy, and [`Action::backoff`](crate::Action::backoff) requeues |
/// | `rest_client_requests_total` | counter | `code` (`<error>`: no response), `method`, `host`, `cluster` | API requests of each engaged cluster's client, the controllers' and the reconcilers' |
/// | `leader_election_master_status` | gauge | `name` (the lease, `namespace/name`) | 1 while leading, else 0 |
/// | `multicluster_runtime_engaged_clusters` | gauge | | clusters engaged in the fleet |
/// | `multicluster_runtime_watch_synced` | gauge | `kind`, `cluster` | how many of the cluster's watches of the kind have listed (one per watcher configuration) |
/// | `multicluster_runtime_watch_failing` | gauge | `kind`, `cluster` | how many of them fail now (forbidden, kind missing, server unreachable) |
/// | `multicluster_runtime_shard_owned_clusters` | gauge | `group` | clusters this replica owns (holds the fence of, not handing over) |
/// | `multicluster_runtime_shard_peers` | gauge | `group` | live peers as this replica sees them, itself included |
/// | `multicluster_runtime_shard_handoffs_total` | counter | `group` | clusters this replica handed over (work stopped, fence released) |
/// | `multicluster_runtime_shard_fence_acquisitions_total` | counter | `group` | fences this replica took |
/// | `multicluster_runtime_shard_fence_losses_total` | counter | `group` | fences this replica lost (not renewed within the renew deadline, or taken over) |
///
/// `cluster` is the cluster id as text (`single` for a single-cluster manager). The series of
/// a cluster are removed when a controller stops following it, not left stale. The three
/// histograms are kept per controller, as controller-runtime keeps them: a histogram per
/// cluster is 18 series, too many for a fleet of thousands; [`Metrics::with_cluster_histograms`]
/// adds the `cluster` label to them too. For a very large fleet,
/// [`Metrics::without_cluster_label`] sums every series over the clusters instead, leaving
/// exactly controller-runtime's label sets. Queue series exist in fleet mode; a
/// single-cluster controller is kube-runtime's, whose queue has no metrics, so it reports the
/// reconcile series only.
///
/// Not reported: the Go runtime's and process collectors' series, client-go's
/// `leader_election_slowpath_total` (its elector's fallback from a cached read; this crate's
/// elector reads the Lease each time) and the certificate watcher series. The webhook series
/// ([`Manager::webhooks`](crate::Manager::webhooks)) carry the hook's name as `webhook`
/// (controller-runtime's path label would carry a cluster's route token) and a `cluster`
/// label on the request counter.
///
/// ```
/// use prometheus_client::registry::Registry;
/// let mut registry = Registry::default();
/// let metrics = multicluster_runtime::Metrics::new(&mut registry);
/// // Manager::new(provider).metrics(metrics); serve `registry` (prometheus_client's
/// // text encoder) at /metrics.
/// ```
#[derive(Clone)]
pub struct Metrics {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics")
            .field("cluster_label", &self.inner.cluster_label)
            .field("cluster_histograms", &self.inner.cluster_histograms)
            .finish_non_exhaustive()
    }
}

struct Inner {
    cluster_label: bool,
    cluster_histograms: bool,
    reconcile_total: Family<With<ReconcileLabels>, Counter>,
    reconcile_errors: Family<With<ControllerLabels>, Counter>,
    terminal_errors: Family<With<ControllerLabels>, Counter>,
    reconcile_timeouts: Family<With<ControllerLabels>, Counter>,
    reconcile_panics: Family<With<ControllerLabels>, Counter>,
    reconcile_time: Family<With<ControllerLabels>, ReconcileHistogram, fn() -> ReconcileHistogram>,
    max_concurrent: Family<ControllerLabels, Gauge>,
    active_workers: Family<ControllerLabels, Gauge>,
    depth: Family<With<DepthLabels>, Gauge>,
    adds: Family<With<QueueLabels>, Counter>,
    queue_duration: Family<With<QueueLabels>, Histogram, fn() -> Histogram>,
    work_duration: Family<With<QueueLabels>, Histogram, fn() -> Histogram>,
    in_flight: Arc<InFlight>,
    retries: Family<With<QueueLabels>, Counter>,
    leader: Family<LeaseLabels, Gauge>,
    engaged: Gauge,
    requests: Family<With<RequestLabels>, Counter>,
    watches: Arc<Watches>,
    shard_owned: Family<GroupLabels, Gauge>,
    shard_peers: Family<GroupLabels, Gauge>,
    shard_handoffs: Family<GroupLabels, Counter>,
    shard_acquired: Family<GroupLabels, Counter>,
    shard_lost: Family<GroupLabels, Counter>,
    webhook_requests: Family<With<WebhookCodeLabels>, Counter>,
    webhook_latency: Family<WebhookLabels, Histogram, fn() -> Histogram>,
    webhook_in_flight: Family<WebhookLabels, Gauge>,
    webhook_panics: Counter,
    webhook_refused: Family<ReasonLabels, Counter>,
    webhook_throttled: Family<With<ReasonLabels>, Counter>,
    webhook_install_failures: Family<ClusterLabel, Counter>,
    credential_expiry: Family<With<SourceLabels>, Gauge>,
}

/// A sharding group's series.
#[derive(Clone)]
pub(crate) struct ShardSeries {
    pub(crate) owned: Gauge,
    pub(crate) peers: Gauge,
    pub(crate) handoffs: Counter,
    pub(crate) acquired: Counter,
    pub(crate) lost: Counter,
}

impl Metrics {
    /// The metrics, registered into `registry`: counters and gauges per cluster, histograms
    /// per controller.
    pub fn new(registry: &mut Registry) -> Self {
        Self::build(registry, true, false)
    }

    /// As [`Metrics::new`], with the three histograms kept per cluster too (18 series per
    /// controller and cluster each: for fleets small enough to afford them).
    pub fn with_cluster_histograms(registry: &mut Registry) -> Self {
        Self::build(registry, true, true)
    }

    /// As [`Metrics::new`], with the `cluster` label left out: each controller's series are
    /// summed over its clusters (for fleets of many thousands of clusters, where a series per
    /// cluster costs the Prometheus server too much). The label sets are controller-runtime's.
    pub fn without_cluster_label(registry: &mut Registry) -> Self {
        Self::build(registry, false, false)
    }

    fn build(registry: &mut Registry, cluster_label: bool, cluster_histograms: bool) -> Self {
        let inner = Inner {
            cluster_label,
            cluster_histograms,
            reconcile_total: Family::default(),
            reconcile_errors: Family::default(),
            terminal_errors: Family::default(),
            reconcile_timeouts: Family::default(),
            reconcile_panics: Family::default(),
            reconcile_time: Family::new_with_constructor(reconcile_histogram),
            max_concurrent: Family::default(),
            active_workers: Family::default(),
            depth: Family::default(),
            adds: Family::default(),
            queue_duration: Family::new_with_constructor(duration_histogram),
            work_duration: Family::new_with_constructor(duration_histogram),
            in_flight: Arc::default(),
            retries: Family::default(),
            leader: Family::default(),
            engaged: Gauge::default(),
            requests: Family::default(),
            watches: Arc::new(Watches {
                cluster_label,
                sources: std::sync::Mutex::new(Vec::new()),
            }),
            shard_owned: Family::default(),
            shard_peers: Family::default(),
            shard_handoffs: Family::default(),
            shard_acquired: Family::default(),
            shard_lost: Family::default(),
            webhook_requests: Family::default(),
            webhook_latency: Family::new_with_constructor(duration_histogram),
            webhook_in_flight: Family::default(),
            webhook_panics: Counter::default(),
            webhook_refused: Family::default(),
            webhook_throttled: Family::default(),
            webhook_install_failures: Family::default(),
            credential_expiry: Family::default(),
        };
        registry.register_collector(Box::new(inner.watches.clone()));
        registry.register_collector(Box::new(inner.in_flight.clone()));
        registry.register_collector(Box::new(process::Process {
            runtime: tokio::runtime::Handle::try_current().ok(),
        }));
        // prometheus-client adds `_total` to counters' names.
        Self::register_controllers(registry, &inner);
        Self::register_queues(registry, &inner);
        Self::register_clusters(registry, &inner);
        Self::register_sharding(registry, &inner);
        Self::register_webhooks(registry, &inner);
        Self {
            inner: Arc::new(inner),
        }
    }

    /// Registers controller-runtime's reconcile series.
    fn register_controllers(registry: &mut Registry, inner: &Inner) {
        registry.register(
            "controller_runtime_reconcile",
            "Reconciles ended, per controller, cluster and result",
            inner.reconcile_total.clone(),
        );
        registry.register(
            "controller_runtime_reconcile_errors",
            "Reconciles that returned an error, per controller and cluster",
            inner.reconcile_errors.clone(),
        );
        registry.register(
            "controller_runtime_terminal_reconcile_errors",
            "Reconcile errors the error policy did not retry, per controller and cluster",
            inner.terminal_errors.clone(),
        );
        registry.register(
            "controller_runtime_reconcile_timeouts",
            "Reconciles dropped at the controller's reconcile timeout (also counted as errors), per controller and cluster",
            inner.reconcile_timeouts.clone(),
        );
        registry.register(
            "controller_runtime_reconcile_panics",
            "Reconciles that panicked (also counted as errors), per controller and cluster",
            inner.reconcile_panics.clone(),
        );
        registry.register(
            "controller_runtime_reconcile_time_seconds",
            "How long reconciles took, per controller",
            inner.reconcile_time.clone(),
        );
        registry.register(
            "controller_runtime_max_concurrent_reconciles",
            "The most reconciles a controller runs at once (0: no limit)",
            inner.max_concurrent.clone(),
        );
        registry.register(
            "controller_runtime_active_workers",
            "Reconciles running now, per controller",
            inner.active_workers.clone(),
        );
    }

    /// Registers the work queues' series (controller-runtime's workqueue names).
    fn register_queues(registry: &mut Registry, inner: &Inner) {
        registry.register(
            "workqueue_depth",
            "Requests due and waiting for a reconcile slot, per controller and cluster",
            inner.depth.clone(),
        );
        registry.register(
            "workqueue_adds",
            "Requests that came due and were queued, per controller and cluster",
            inner.adds.clone(),
        );
        registry.register(
            "workqueue_queue_duration_seconds",
            "How long requests waited between coming due and starting",
            inner.queue_duration.clone(),
        );
        registry.register(
            "workqueue_work_duration_seconds",
            "How long requests took from starting to finishing",
            inner.work_duration.clone(),
        );
        registry.register(
            "workqueue_retries",
            "Requeues the error policy asked for, per controller and cluster",
            inner.retries.clone(),
        );
    }

    /// Registers leader election, the fleet and the clients' requests.
    fn register_clusters(registry: &mut Registry, inner: &Inner) {
        registry.register(
            "leader_election_master_status",
            "1 while this replica holds the lease, else 0",
            inner.leader.clone(),
        );
        registry.register(
            "multicluster_runtime_engaged_clusters",
            "Clusters engaged in the manager's fleet",
            inner.engaged.clone(),
        );
        registry.register(
            "rest_client_requests",
            "API requests made by each cluster's client, per status code, method, API server and cluster",
            inner.requests.clone(),
        );
    }

    /// Registers the sharding group's series.
    fn register_sharding(registry: &mut Registry, inner: &Inner) {
        registry.register(
            "multicluster_runtime_shard_owned_clusters",
            "Clusters this replica owns in its sharding group",
            inner.shard_owned.clone(),
        );
        registry.register(
            "multicluster_runtime_shard_peers",
            "Live peers of the sharding group as this replica sees them, itself included",
            inner.shard_peers.clone(),
        );
        registry.register(
            "multicluster_runtime_shard_handoffs",
            "Clusters this replica handed over to another",
            inner.shard_handoffs.clone(),
        );
        registry.register(
            "multicluster_runtime_shard_fence_acquisitions",
            "Cluster fences this replica took",
            inner.shard_acquired.clone(),
        );
        registry.register(
            "multicluster_runtime_shard_fence_losses",
            "Cluster fences this replica lost without handing the cluster over",
            inner.shard_lost.clone(),
        );
    }

    /// Registers the admission webhooks' series.
    fn register_webhooks(registry: &mut Registry, inner: &Inner) {
        registry.register(
            "controller_runtime_webhook_requests",
            "Admission reviews answered, per webhook, HTTP status and cluster",
            inner.webhook_requests.clone(),
        );
        registry.register(
            "controller_runtime_webhook_latency_seconds",
            "How long admission reviews took, per webhook",
            inner.webhook_latency.clone(),
        );
        registry.register(
            "controller_runtime_webhook_requests_in_flight",
            "Admission reviews being handled now, per webhook",
            inner.webhook_in_flight.clone(),
        );
        registry.register(
            "controller_runtime_webhook_panics",
            "Admission handlers that panicked",
            inner.webhook_panics.clone(),
        );
        registry.register(
            "multicluster_runtime_webhook_refused",
            "Webhook requests refused before any handler saw them, per reason (not_a_route, unknown_webhook, bad_token, unknown_cluster)",
            inner.webhook_refused.clone(),
        );
        registry.register(
            "multicluster_runtime_webhook_throttled",
            "Reviews on a valid route refused with 429 or cut off, per cluster and reason (in_flight: the cluster's reviews in flight at their cap; memory: no room in the budget for buffered bodies; slow_body: the body came slower than the minimum rate or past the hook's timeout)",
            inner.webhook_throttled.clone(),
        );
        registry.register(
            "multicluster_runtime_webhook_install_failures",
            "Failed attempts to install (or remove) the webhook configurations, per cluster",
            inner.webhook_install_failures.clone(),
        );
        registry.register(
            "multicluster_runtime_credential_expiry_seconds",
            "When each engaged cluster's credential ends, in seconds since the Unix epoch, per cluster and source (token: a bearer token's exp; client_certificate: its notAfter; exec: the plugin's expirationTimestamp); without the cluster label, the earliest of the fleet per source",
            inner.credential_expiry.clone(),
        );
    }

    /// The series of sharding group `group`.
    /// An answered review.
    pub(crate) fn webhook_answered(
        &self,
        webhook: &Arc<str>,
        cluster: &str,
        code: u16,
        took: Duration,
    ) {
        let labels = WebhookCodeLabels {
            webhook: webhook.clone(),
            code: code.to_string(),
        };
        self.inner
            .webhook_requests
            .get_or_create(&(labels, self.cluster(cluster)))
            .inc();
        self.inner
            .webhook_latency
            .get_or_create(&WebhookLabels {
                webhook: webhook.clone(),
            })
            .observe(took.as_secs_f64());
    }

    /// The in-flight gauge of `webhook`.
    pub(crate) fn webhook_in_flight(&self, webhook: &Arc<str>) -> Gauge {
        self.inner
            .webhook_in_flight
            .get_or_create(&WebhookLabels {
                webhook: webhook.clone(),
            })
            .clone()
    }

    pub(crate) fn webhook_panicked(&self) {
        self.inner.webhook_panics.inc();
    }

    pub(crate) fn webhook_refused(&self, reason: &'static str) {
        self.inner
            .webhook_refused
            .get_or_create(&ReasonLabels { reason })
            .inc();
    }

    /// A review on a valid route refused or cut off for `reason` (see the metric's help).
    pub(crate) fn webhook_throttled(&self, cluster: &str, reason: &'static str) {
        self.inner
            .webhook_throttled
            .get_or_create(&(ReasonLabels { reason }, self.cluster(cluster)))
            .inc();
    }

    /// The ends of the engaged clusters' credentials, `(cluster, source, Unix seconds)`, in
    /// place of those set before (clusters gone or without a readable end lose theirs).
    pub(crate) fn credential_expiries(&self, ends: &[(String, &'static str, i64)]) {
        let mut earliest: std::collections::HashMap<With<SourceLabels>, i64> =
            std::collections::HashMap::new();
        for (cluster, source, at) in ends {
            let key = (SourceLabels { source }, self.cluster(cluster));
            let entry = earliest.entry(key).or_insert(*at);
            *entry = (*entry).min(*at);
        }
        let family = &self.inner.credential_expiry;
        family.clear();
        for (key, at) in earliest {
            family.get_or_create(&key).set(at);
        }
    }

    pub(crate) fn webhook_install_failed(&self, cluster: &str) {
        self.inner
            .webhook_install_failures
            .get_or_create(&self.cluster(cluster))
            .inc();
    }

    pub(crate) fn shard(&self, group: &str) -> ShardSeries {
        let labels = GroupLabels {
            group: Arc::from(group),
        };
        ShardSeries {
            owned: self.inner.shard_owned.get_or_create_owned(&labels),
            peers: self.inner.shard_peers.get_or_create_owned(&labels),
            handoffs: self.inner.shard_handoffs.get_or_create_owned(&labels),
            acquired: self.inner.shard_acquired.get_or_create_owned(&labels),
            lost: self.inner.shard_lost.get_or_create_owned(&labels),
        }
    }

    fn request_labels(
        &self,
        cluster: &str,
        host: &Arc<str>,
        code: u16,
        method: &http::Method,
    ) -> With<RequestLabels> {
        let labels = RequestLabels {
            // client-go's label for a request that got no response.
            code: if code == 0 {
                "<error>".to_string()
            } else {
                code.to_string()
            },
            method: method.as_str().to_string(),
            host: host.clone(),
        };
        (labels, self.cluster(cluster))
    }

    /// The request counter of `cluster` (whose API server is `host`) for `code` (0: no
    /// response) and `method`.
    pub(crate) fn request_counter(
        &self,
        cluster: &str,
        host: &Arc<str>,
        code: u16,
        method: &http::Method,
    ) -> Counter {
        self.inner
            .requests
            .get_or_create_owned(&self.request_labels(cluster, host, code, method))
    }

    /// Removes the request counters of `cluster` (unless shared, without the cluster label).
    pub(crate) fn forget_requests<'a>(
        &self,
        cluster: &str,
        host: &Arc<str>,
        keys: impl Iterator<Item = &'a (u16, http::Method)>,
    ) {
        if !self.inner.cluster_label {
            return;
        }
        for (code, method) in keys {
            self.inner
                .requests
                .remove(&self.request_labels(cluster, host, *code, method));
        }
    }

    fn cluster(&self, cluster: &str) -> ClusterLabel {
        ClusterLabel(self.inner.cluster_label.then(|| Arc::from(cluster)))
    }

    /// The series of `controller` in `cluster`, to update without a lookup per event; the
    /// queue's only if `queue` (a single-cluster controller's queue is kube-runtime's).
    pub(crate) fn series(&self, controller: &Arc<str>, cluster: &str, queue: bool) -> Series {
        let cluster = self.cluster(cluster);
        // Histograms carry the cluster only when asked to.
        let histogram_cluster = if self.inner.cluster_histograms {
            cluster.clone()
        } else {
            ClusterLabel(None)
        };
        let by_controller = ControllerLabels {
            controller: controller.clone(),
        };
        let both = (by_controller.clone(), cluster.clone());
        let queue_labels = QueueLabels {
            name: controller.clone(),
            controller: controller.clone(),
        };
        let labels = (queue_labels.clone(), cluster.clone());
        let depth_labels = (
            DepthLabels {
                name: controller.clone(),
                controller: controller.clone(),
                priority: "",
            },
            cluster.clone(),
        );
        let outcomes = OUTCOMES.map(|outcome| {
            self.inner.reconcile_total.get_or_create_owned(&(
                ReconcileLabels {
                    controller: controller.clone(),
                    result: outcome.label(),
                },
                cluster.clone(),
            ))
        });
        // Without a queue of ours, its metrics are not registered: updates go nowhere.
        let (depth, adds, queue_duration, work_duration, retries, running) = if queue {
            let histogram_labels = (queue_labels, histogram_cluster.clone());
            let running = crate::util::sync::lock(&self.inner.in_flight.0)
                .entry(labels.clone())
                .or_default()
                .clone();
            (
                self.inner.depth.get_or_create_owned(&depth_labels),
                self.inner.adds.get_or_create_owned(&labels),
                self.inner
                    .queue_duration
                    .get_or_create_owned(&histogram_labels),
                self.inner
                    .work_duration
                    .get_or_create_owned(&histogram_labels),
                self.inner.retries.get_or_create_owned(&labels),
                running,
            )
        } else {
            (
                Gauge::default(),
                Counter::default(),
                duration_histogram(),
                duration_histogram(),
                Counter::default(),
                Arc::default(),
            )
        };
        Series {
            outcomes,
            errors: self.inner.reconcile_errors.get_or_create_owned(&both),
            terminal: self.inner.terminal_errors.get_or_create_owned(&both),
            timeouts: self.inner.reconcile_timeouts.get_or_create_owned(&both),
            panics: self.inner.reconcile_panics.get_or_create_owned(&both),
            time: self
                .inner
                .reconcile_time
                .get_or_create_owned(&(by_controller, histogram_cluster)),
            depth,
            adds,
            queue_duration,
            work_duration,
            retries,
            running,
            labels: SeriesLabels {
                both,
                queue: labels,
                depth: depth_labels,
            },
        }
    }

    /// Removes the series of `series`' controller and cluster (unless they are shared by
    /// every cluster, without the cluster label). Histograms kept per controller stay.
    pub(crate) fn forget(&self, series: &Series) {
        if !self.inner.cluster_label {
            return;
        }
        let SeriesLabels { both, queue, depth } = &series.labels;
        for outcome in OUTCOMES {
            self.inner.reconcile_total.remove(&(
                ReconcileLabels {
                    controller: both.0.controller.clone(),
                    result: outcome.label(),
                },
                both.1.clone(),
            ));
        }
        self.inner.reconcile_errors.remove(both);
        self.inner.terminal_errors.remove(both);
        self.inner.reconcile_timeouts.remove(both);
        self.inner.reconcile_panics.remove(both);
        self.inner.depth.remove(depth);
        self.inner.adds.remove(queue);
        self.inner.retries.remove(queue);
        crate::util::sync::lock(&self.inner.in_flight.0).remove(queue);
        if self.inner.cluster_histograms {
            self.inner.reconcile_time.remove(both);
            self.inner.queue_duration.remove(queue);
            self.inner.work_duration.remove(queue);
        }
    }

    /// The gauges of `controller`: its concurrency limit and its reconciles running.
    pub(crate) fn controller(&self, controller: &Arc<str>, concurrency: usize) -> Gauge {
        let labels = ControllerLabels {
            controller: controller.clone(),
        };
        self.inner
            .max_concurrent
            .get_or_create(&labels)
            .set(i64::try_from(concurrency).unwrap_or(i64::MAX));
        self.inner.active_workers.get_or_create_owned(&labels)
    }

    /// Whether this replica holds `lease` now.
    pub(crate) fn leading(&self, lease: &str, leading: bool) {
        self.inner
            .leader
            .get_or_create(&LeaseLabels {
                name: Arc::from(lease),
            })
            .set(i64::from(leading));
    }

    /// Reports the watches of the clusters `source` lists, at every scrape.
    pub(crate) fn watch_source(
        &self,
        key: usize,
        source: impl Fn() -> Vec<(String, Vec<WatchRow>)> + Send + Sync + 'static,
    ) {
        let mut sources = crate::util::sync::lock(&self.inner.watches.sources);
        sources.retain(|(k, _)| *k != key);
        sources.push((key, Box::new(source)));
    }

    /// How many clusters the fleet has engaged.
    pub(crate) fn engaged_clusters(&self, n: usize) {
        self.inner.engaged.set(i64::try_from(n).unwrap_or(i64::MAX));
    }
}

/// The label sets of one controller's series in one cluster, to remove them.
#[derive(Clone)]
struct SeriesLabels {
    both: With<ControllerLabels>,
    queue: With<QueueLabels>,
    depth: With<DepthLabels>,
}

/// One controller's series in one cluster.
#[derive(Clone)]
pub(crate) struct Series {
    outcomes: [Counter; 4],
    errors: Counter,
    terminal: Counter,
    timeouts: Counter,
    panics: Counter,
    time: ReconcileHistogram,
    pub(crate) depth: Gauge,
    pub(crate) adds: Counter,
    queue_duration: Histogram,
    work_duration: Histogram,
    retries: Counter,
    /// The queue's reconciles in flight.
    pub(crate) running: Arc<Running>,
    labels: SeriesLabels,
}

impl Series {
    /// A request that came due `waited` ago started now (`now`).
    pub(crate) fn started(&self, now: Instant, waited: Duration) {
        self.queue_duration.observe(waited.as_secs_f64());
        self.running.start(now);
    }

    /// A reconcile of the fleet queue that started at `began` ended after `took`; an error
    /// not `retried` is terminal.
    pub(crate) fn ended(
        &self,
        outcome: Outcome,
        began: Option<Instant>,
        took: Duration,
        retried: bool,
        mark: TraceMark,
    ) {
        self.reconciled(outcome, took, mark);
        if retried {
            self.retries.inc();
        } else if outcome == Outcome::Error {
            self.terminal();
        }
        if let Some(began) = began {
            self.running.stop(began);
        }
        self.work_duration.observe(took.as_secs_f64());
    }

    /// A reconcile ended after `took`: the reconcile series only (all there is in
    /// single-cluster mode, whose queue is kube-runtime's).
    pub(crate) fn reconciled(&self, outcome: Outcome, took: Duration, mark: TraceMark) {
        // A panic is an error with a counter of its own, as controller-runtime counts it.
        let counted = if outcome == Outcome::Panic {
            self.panics.inc();
            Outcome::Error
        } else {
            outcome
        };
        self.outcomes[counted as usize].inc();
        if counted == Outcome::Error {
            self.errors.inc();
        }
        observe_reconcile(&self.time, took, mark);
    }

    /// The error policy did not retry an error (its action awaits a change).
    pub(crate) fn terminal(&self) {
        self.terminal.inc();
    }

    /// A reconcile was dropped at the reconcile timeout.
    pub(crate) fn timed_out(&self) {
        self.timeouts.inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_flight_seconds_count_each_reconcile_and_the_oldest() {
        let running = Running::default();
        let now = Instant::now();
        let (a, b) = (now - Duration::from_secs(3), now - Duration::from_secs(1));
        running.start(a);
        running.start(b);
        // Two clusters sharing series (no cluster label) start at the same instant.
        running.start(b);
        let (total, longest) = running.seconds(now);
        assert!((total - 5.0).abs() < 1e-6, "{total}");
        assert!((longest - 3.0).abs() < 1e-6, "{longest}");
        running.stop(a);
        running.stop(b);
        assert_eq!(running.seconds(now), (1.0, 1.0));
        // One never started (or already stopped at a disengagement) is ignored.
        running.stop(a);
        running.stop(b);
        running.stop(b);
        assert_eq!(running.seconds(now), (0.0, 0.0));
    }

    fn rss_kib() -> u64 {
        std::fs::read_to_string("/proc/self/status")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find_map(|l| l.strip_prefix("VmRSS:"))
                    .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            })
            .unwrap_or(0)
    }

    /// The figures of BENCHMARKS.md: the series of one controller in 10,000 clusters, made as
    /// a controller's queue makes them when the clusters are engaged, with each cluster's
    /// client having made GETs (200 and 404), LISTs and a PATCH.
    /// `cargo test --release --lib --all-features scrape_at_ten_thousand -- --ignored --nocapture`
    #[test]
    #[ignore = "a benchmark: prints figures"]
    fn scrape_at_ten_thousand_clusters() {
        const CLUSTERS: usize = 10_000;
        let controller: Arc<str> = Arc::from("copies");
        let host: Arc<str> = Arc::from("10.0.0.1:6443");
        type Build = fn(&mut Registry) -> Metrics;
        let modes: [(&str, Build); 3] = [
            ("Metrics::new", Metrics::new),
            (
                "Metrics::with_cluster_histograms",
                Metrics::with_cluster_histograms,
            ),
            (
                "Metrics::without_cluster_label",
                Metrics::without_cluster_label,
            ),
        ];
        for (mode, build) in modes {
            let before = rss_kib();
            let mut registry = Registry::default();
            let metrics = build(&mut registry);
            let mut kept = Vec::with_capacity(CLUSTERS);
            for i in 0..CLUSTERS {
                let cluster = format!("cluster-{i:05}");
                let series = metrics.series(&controller, &cluster, true);
                series.reconciled(
                    Outcome::Success,
                    Duration::from_millis(3),
                    TraceMark::default(),
                );
                let requests: Vec<Counter> = [
                    (200, http::Method::GET),
                    (404, http::Method::GET),
                    (200, http::Method::PATCH),
                ]
                .iter()
                .map(|(code, method)| metrics.request_counter(&cluster, &host, *code, method))
                .collect();
                kept.push((series, requests));
            }
            let made = rss_kib().saturating_sub(before);
            let mut times = Vec::new();
            let mut text = String::new();
            for _ in 0..5 {
                text.clear();
                let began = std::time::Instant::now();
                prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
                times.push(began.elapsed());
            }
            times.sort();
            let samples = text.lines().filter(|l| !l.starts_with('#')).count();
            println!(
                "{mode}: {samples} samples, scrape {:?} (median of 5), {} KiB of text, RSS +{made} KiB for the series",
                times[2],
                text.len() / 1024
            );
            drop(kept);
        }
    }
}
