//! [`Metrics`]: Prometheus metrics of a manager, under controller-runtime's names and labels
//! so its dashboards and alerts work, with a `cluster` label on the reconcile and queue
//! series.

use std::sync::Arc;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReconcileLabels {
    controller: Arc<str>,
    cluster: Arc<str>,
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ControllerClusterLabels {
    controller: Arc<str>,
    cluster: Arc<str>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ControllerLabels {
    controller: Arc<str>,
}

/// client-go's workqueue metrics name the queue `name`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct QueueLabels {
    name: Arc<str>,
    cluster: Arc<str>,
}

/// client-go's request counter labels, with the cluster.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    cluster: Arc<str>,
    code: String,
    method: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WatchLabels {
    cluster: Arc<str>,
    kind: String,
}

/// Where the watch gauges come from at scrape time: each source lists its clusters' watches.
type WatchSource = Box<dyn Fn() -> Vec<(String, Vec<crate::CacheStatus>)> + Send + Sync>;

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
        use prometheus_client::encoding::EncodeMetric;
        let synced = Family::<WatchLabels, Gauge>::default();
        let failing = Family::<WatchLabels, Gauge>::default();
        for (_, source) in crate::sync::lock(&self.sources).iter() {
            for (cluster, watches) in source() {
                let cluster: Arc<str> = if self.cluster_label {
                    Arc::from(cluster)
                } else {
                    Arc::from("")
                };
                for watch in watches {
                    let labels = WatchLabels {
                        cluster: cluster.clone(),
                        kind: watch.kind,
                    };
                    // Summed over clusters without the cluster label.
                    synced
                        .get_or_create(&labels)
                        .inc_by(i64::from(watch.synced));
                    failing
                        .get_or_create(&labels)
                        .inc_by(i64::from(watch.error.is_some()));
                }
            }
        }
        for (name, help, family) in [
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
        ] {
            family.encode(encoder.encode_descriptor(name, help, None, family.metric_type())?)?;
        }
        Ok(())
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
    /// The reconciler (or its error policy) panicked: counted as an error, and as a panic.
    Panic = 3,
}

impl Outcome {
    /// A reconcile's outcome: whether it failed, and the action it (or the error policy)
    /// asked for.
    pub(crate) fn of(failed: bool, action: &crate::Action) -> Self {
        if failed {
            Outcome::Error
        } else if action.requeue_after().is_some() {
            Outcome::RequeueAfter
        } else {
            Outcome::Success
        }
    }

    fn label(self) -> &'static str {
        match self {
            Outcome::Success => "success",
            Outcome::Error | Outcome::Panic => "error",
            Outcome::RequeueAfter => "requeue_after",
        }
    }
}

const OUTCOMES: [Outcome; 3] = [Outcome::Success, Outcome::Error, Outcome::RequeueAfter];

fn duration_histogram() -> Histogram {
    // 5 ms to about 82 s, doubling (controller-runtime's reconcile buckets span the same).
    Histogram::new(exponential_buckets(0.005, 2.0, 15))
}

/// Prometheus metrics of a [`Manager`](crate::Manager) and its controllers, registered into
/// a registry of yours (which you can extend with metrics of your own and serve).
///
/// | series | labels | what |
/// | --- | --- | --- |
/// | `controller_runtime_reconcile_total` | `controller`, `cluster`, `result` (`success`, `error`, `requeue_after`) | reconciles ended |
/// | `controller_runtime_reconcile_errors_total` | `controller`, `cluster` | reconciles that returned an error |
/// | `controller_runtime_reconcile_panics_total` | `controller`, `cluster` | reconciles that panicked (caught; also counted as errors) |
/// | `controller_runtime_reconcile_time_seconds` | `controller`, `cluster` | histogram of reconcile durations |
/// | `controller_runtime_max_concurrent_reconciles` | `controller` | the concurrency limit (0: none) |
/// | `controller_runtime_active_workers` | `controller` | reconciles running now |
/// | `workqueue_depth` | `name`, `cluster` | requests due and waiting for a slot |
/// | `workqueue_adds_total` | `name`, `cluster` | requests that came due and were queued |
/// | `workqueue_queue_duration_seconds` | `name`, `cluster` | histogram of waits from due to started |
/// | `workqueue_work_duration_seconds` | `name`, `cluster` | histogram of reconcile durations, as the queue sees them |
/// | `workqueue_retries_total` | `name`, `cluster` | requeues decided by the error policy |
/// | `leader_election_master_status` | `name` (the lease, `namespace/name`) | 1 while leading, else 0 |
/// | `multicluster_runtime_engaged_clusters` | | clusters engaged in the fleet |
/// | `multicluster_runtime_watch_synced` | `cluster`, `kind` | how many of the cluster's watches of the kind have listed (one per watcher configuration) |
/// | `multicluster_runtime_watch_failing` | `cluster`, `kind` | how many of them fail now (forbidden, kind missing, server unreachable) |
/// | `rest_client_requests_total` | `cluster`, `code` (`<error>`: no response), `method` | API requests of each engaged cluster's client, the controllers' and the reconcilers' |
/// | `multicluster_runtime_shard_owned_clusters` | `group` | clusters this replica owns (holds the fence of, not handing over) |
/// | `multicluster_runtime_shard_peers` | `group` | live peers as this replica sees them, itself included |
/// | `multicluster_runtime_shard_handoffs_total` | `group` | clusters this replica handed over (work stopped, fence released) |
/// | `multicluster_runtime_shard_fence_acquisitions_total` | `group` | fences this replica took |
/// | `multicluster_runtime_shard_fence_losses_total` | `group` | fences this replica lost (not renewed within the renew deadline, or taken over) |
///
/// `cluster` is the cluster id as text (`single` for a single-cluster manager). The series of
/// a cluster are removed when a controller stops following it, not left stale. For a very
/// large fleet, [`Metrics::without_cluster_label`] aggregates them across clusters instead.
/// Queue series exist in fleet mode; a single-cluster controller is kube-runtime's, whose
/// queue has no metrics, so it reports the reconcile series only.
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
            .finish_non_exhaustive()
    }
}

struct Inner {
    cluster_label: bool,
    reconcile_total: Family<ReconcileLabels, Counter>,
    reconcile_errors: Family<ControllerClusterLabels, Counter>,
    reconcile_panics: Family<ControllerClusterLabels, Counter>,
    reconcile_time: Family<ControllerClusterLabels, Histogram, fn() -> Histogram>,
    max_concurrent: Family<ControllerLabels, Gauge>,
    active_workers: Family<ControllerLabels, Gauge>,
    depth: Family<QueueLabels, Gauge>,
    adds: Family<QueueLabels, Counter>,
    queue_duration: Family<QueueLabels, Histogram, fn() -> Histogram>,
    work_duration: Family<QueueLabels, Histogram, fn() -> Histogram>,
    retries: Family<QueueLabels, Counter>,
    leader: Family<LeaseLabels, Gauge>,
    engaged: Gauge,
    requests: Family<RequestLabels, Counter>,
    watches: Arc<Watches>,
    shard_owned: Family<GroupLabels, Gauge>,
    shard_peers: Family<GroupLabels, Gauge>,
    shard_handoffs: Family<GroupLabels, Counter>,
    shard_acquired: Family<GroupLabels, Counter>,
    shard_lost: Family<GroupLabels, Counter>,
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
    /// The metrics, registered into `registry`.
    pub fn new(registry: &mut Registry) -> Self {
        Self::build(registry, true)
    }

    /// As [`Metrics::new`], with the `cluster` label left out: each controller's series are
    /// summed over its clusters (for fleets of many thousands of clusters, where a series per
    /// cluster costs the Prometheus server too much).
    pub fn without_cluster_label(registry: &mut Registry) -> Self {
        Self::build(registry, false)
    }

    fn build(registry: &mut Registry, cluster_label: bool) -> Self {
        let inner = Inner {
            cluster_label,
            reconcile_total: Family::default(),
            reconcile_errors: Family::default(),
            reconcile_panics: Family::default(),
            reconcile_time: Family::new_with_constructor(duration_histogram),
            max_concurrent: Family::default(),
            active_workers: Family::default(),
            depth: Family::default(),
            adds: Family::default(),
            queue_duration: Family::new_with_constructor(duration_histogram),
            work_duration: Family::new_with_constructor(duration_histogram),
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
        };
        registry.register_collector(Box::new(inner.watches.clone()));
        // prometheus-client adds `_total` to counters' names.
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
            "controller_runtime_reconcile_panics",
            "Reconciles that panicked (also counted as errors), per controller and cluster",
            inner.reconcile_panics.clone(),
        );
        registry.register(
            "controller_runtime_reconcile_time_seconds",
            "How long reconciles took, per controller and cluster",
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
            "API requests made by each cluster's client, per cluster, status code and method",
            inner.requests.clone(),
        );
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
        Self {
            inner: Arc::new(inner),
        }
    }

    /// The series of sharding group `group`.
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

    fn request_labels(&self, cluster: &str, code: u16, method: &http::Method) -> RequestLabels {
        RequestLabels {
            cluster: self.cluster(cluster),
            // client-go's label for a request that got no response.
            code: if code == 0 {
                "<error>".to_string()
            } else {
                code.to_string()
            },
            method: method.as_str().to_string(),
        }
    }

    /// The request counter of `cluster` for `code` (0: no response) and `method`.
    pub(crate) fn request_counter(
        &self,
        cluster: &str,
        code: u16,
        method: &http::Method,
    ) -> Counter {
        self.inner
            .requests
            .get_or_create_owned(&self.request_labels(cluster, code, method))
    }

    /// Removes the request counters of `cluster` (unless shared, without the cluster label).
    pub(crate) fn forget_requests<'a>(
        &self,
        cluster: &str,
        keys: impl Iterator<Item = &'a (u16, http::Method)>,
    ) {
        if !self.inner.cluster_label {
            return;
        }
        for (code, method) in keys {
            self.inner
                .requests
                .remove(&self.request_labels(cluster, *code, method));
        }
    }

    fn cluster(&self, cluster: &str) -> Arc<str> {
        if self.inner.cluster_label {
            Arc::from(cluster)
        } else {
            Arc::from("")
        }
    }

    /// The series of `controller` in `cluster`, to update without a lookup per event; the
    /// queue's only if `queue` (a single-cluster controller's queue is kube-runtime's).
    pub(crate) fn series(&self, controller: &Arc<str>, cluster: &str, queue: bool) -> Series {
        let cluster = self.cluster(cluster);
        let both = ControllerClusterLabels {
            controller: controller.clone(),
            cluster: cluster.clone(),
        };
        let labels = QueueLabels {
            name: controller.clone(),
            cluster: cluster.clone(),
        };
        let outcomes = OUTCOMES.map(|outcome| {
            self.inner
                .reconcile_total
                .get_or_create_owned(&ReconcileLabels {
                    controller: controller.clone(),
                    cluster: cluster.clone(),
                    result: outcome.label(),
                })
        });
        // Without a queue of ours, its metrics are not registered: updates go nowhere.
        let (depth, adds, queue_duration, work_duration, retries) = if queue {
            (
                self.inner.depth.get_or_create_owned(&labels),
                self.inner.adds.get_or_create_owned(&labels),
                self.inner.queue_duration.get_or_create_owned(&labels),
                self.inner.work_duration.get_or_create_owned(&labels),
                self.inner.retries.get_or_create_owned(&labels),
            )
        } else {
            (
                Gauge::default(),
                Counter::default(),
                duration_histogram(),
                duration_histogram(),
                Counter::default(),
            )
        };
        Series {
            outcomes,
            errors: self.inner.reconcile_errors.get_or_create_owned(&both),
            panics: self.inner.reconcile_panics.get_or_create_owned(&both),
            time: self.inner.reconcile_time.get_or_create_owned(&both),
            depth,
            adds,
            queue_duration,
            work_duration,
            retries,
            labels: (both, labels),
        }
    }

    /// Removes the series of `series`' controller and cluster (unless they are shared by
    /// every cluster, without the cluster label).
    pub(crate) fn forget(&self, series: &Series) {
        if !self.inner.cluster_label {
            return;
        }
        let (both, queue) = &series.labels;
        for outcome in OUTCOMES {
            self.inner.reconcile_total.remove(&ReconcileLabels {
                controller: both.controller.clone(),
                cluster: both.cluster.clone(),
                result: outcome.label(),
            });
        }
        self.inner.reconcile_errors.remove(both);
        self.inner.reconcile_panics.remove(both);
        self.inner.reconcile_time.remove(both);
        self.inner.depth.remove(queue);
        self.inner.adds.remove(queue);
        self.inner.queue_duration.remove(queue);
        self.inner.work_duration.remove(queue);
        self.inner.retries.remove(queue);
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
        source: impl Fn() -> Vec<(String, Vec<crate::CacheStatus>)> + Send + Sync + 'static,
    ) {
        let mut sources = crate::sync::lock(&self.inner.watches.sources);
        sources.retain(|(k, _)| *k != key);
        sources.push((key, Box::new(source)));
    }

    /// How many clusters the fleet has engaged.
    pub(crate) fn engaged_clusters(&self, n: usize) {
        self.inner.engaged.set(i64::try_from(n).unwrap_or(i64::MAX));
    }
}

/// One controller's series in one cluster.
#[derive(Clone)]
pub(crate) struct Series {
    outcomes: [Counter; 3],
    errors: Counter,
    panics: Counter,
    time: Histogram,
    pub(crate) depth: Gauge,
    pub(crate) adds: Counter,
    queue_duration: Histogram,
    work_duration: Histogram,
    retries: Counter,
    labels: (ControllerClusterLabels, QueueLabels),
}

impl Series {
    /// A request waited `waited` between coming due and starting.
    pub(crate) fn started(&self, waited: Duration) {
        self.queue_duration.observe(waited.as_secs_f64());
    }

    /// A reconcile of the fleet queue ended after `took`.
    pub(crate) fn ended(&self, outcome: Outcome, took: Duration, retried: bool) {
        self.reconciled(outcome, took);
        if retried {
            self.retries.inc();
        }
        self.work_duration.observe(took.as_secs_f64());
    }

    /// A reconcile ended after `took`: the reconcile series only (all there is in
    /// single-cluster mode, whose queue is kube-runtime's).
    pub(crate) fn reconciled(&self, outcome: Outcome, took: Duration) {
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
        self.time.observe(took.as_secs_f64());
    }
}
