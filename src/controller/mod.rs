//! Controllers: the reconcile vocabulary ([`Action`], [`Request`], [`Context`], finalizers),
//! the two runners (single mode: kube-runtime's own `Controller`, in `single_mode`; fleet
//! mode: the fleet loop with its per-cluster state machine, in `fleet_mode`), the fair queue
//! and the relations (`owns`, `watches`). The [`Builder`](crate::Builder) that configures
//! them stands above the manager, in `builder.rs`.

pub(crate) mod action;
mod backoff;
mod context;
pub mod finalizer;
pub(crate) mod fleet_mode;
mod gate;
mod queue;
pub(crate) mod relations;
pub(crate) mod request;
pub(crate) mod single_mode;
pub(crate) mod sources;
pub(crate) mod warm;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use kube_runtime::watcher;
use tokio_util::sync::CancellationToken;

pub use action::Action;
pub use backoff::FailureBackoff;
pub(crate) use backoff::{Failures, version_of};
pub use context::Context;
#[cfg(feature = "fuzzing")]
pub(crate) use queue::FleetQueue;
pub use request::{ParseRequestError, Request};

use crate::cache::Watchable;
use crate::cluster::{Cluster, ClusterId};

/// Why a reconcile was queued; shown in the reconcile's span. While a request waits, a later
/// reason replaces an earlier one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum ReconcileReason {
    /// The object itself changed.
    ObjectChanged,
    /// The object was listed (a first listing, or a relist that found it unchanged): it
    /// waits behind live changes.
    Listed,
    /// A related object (owned or watched) of this kind changed.
    RelatedObjectChanged(Arc<str>),
    /// A related object of this kind was listed, unchanged: it waits behind live changes.
    RelatedListed(Arc<str>),
    /// The periodic resync of every cached object: it waits behind live changes.
    Resync,
    /// The previous reconcile asked to be requeued.
    Requeue,
    /// The previous reconcile asked to be requeued after its object's backoff
    /// ([`Action::backoff`](crate::Action::backoff)).
    Backoff,
    /// The previous reconcile failed and the error policy asked for a retry.
    ErrorPolicy,
    /// The previous reconcile was dropped at the reconcile timeout.
    TimedOut,
    /// The previous reconcile (or its error policy) panicked; it runs again after
    /// [`PANIC_REQUEUE`].
    Panicked,
    /// Every object was asked for (`reconcile_all_on`).
    Bulk,
    /// A request from a stream the user brought (`reconcile_on`).
    Given,
}

impl fmt::Display for ReconcileReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::ObjectChanged => f.write_str("object changed"),
            Self::Listed => f.write_str("object listed"),
            Self::RelatedObjectChanged(kind) => write!(f, "related {kind} changed"),
            Self::RelatedListed(kind) => write!(f, "related {kind} listed"),
            Self::Resync => f.write_str("periodic resync"),
            Self::Requeue => f.write_str("requeue"),
            Self::Backoff => f.write_str("backoff requeue"),
            Self::ErrorPolicy => f.write_str("error policy requeue"),
            Self::TimedOut => f.write_str("timeout retry"),
            Self::Panicked => f.write_str("panic requeue"),
            Self::Bulk => f.write_str("bulk reconcile"),
            Self::Given => f.write_str("trigger stream"),
        }
    }
}

/// How long a reconcile may go on after its reconcile timeout, its [`Context`] cancelled,
/// before its future is dropped.
pub(crate) const TIMEOUT_GRACE: Duration = Duration::from_secs(1);

/// How often every cached object is reconciled again by default: controller-runtime's
/// `SyncPeriod` default (10 hours), each period drawn within ±10 % of it.
pub const DEFAULT_RESYNC: Duration = Duration::from_secs(10 * 3600);

/// A resync period drawn within ±10 % of `period` (as controller-runtime spreads its
/// informers' resyncs), so clusters engaged together do not resync together.
pub(crate) fn jittered_resync(period: Duration) -> Duration {
    period.mul_f64(0.9 + 0.2 * crate::util::jitter::random_unit())
}

/// Ticks every [`jittered_resync`] of `period`, until `ended` is cancelled.
pub(crate) fn resync_ticks(
    period: Duration,
    ended: CancellationToken,
) -> impl futures::Stream<Item = ()> + Send + 'static {
    use futures::StreamExt;
    futures::stream::unfold((), move |()| async move {
        tokio::time::sleep(jittered_resync(period)).await;
        Some(((), ()))
    })
    .take_until(ended.cancelled_owned())
}

impl ReconcileReason {
    /// Whether requests queued for this reason wait behind the others (controller-runtime's
    /// low priority for objects of an initial listing and resyncs).
    pub(crate) fn is_low(&self) -> bool {
        matches!(self, Self::Listed | Self::RelatedListed(_) | Self::Resync)
    }
}

/// An object as a span field, `namespace/name` or `name`, in both modes.
pub(crate) struct ObjectField<'a> {
    pub(crate) namespace: Option<&'a str>,
    pub(crate) name: &'a str,
}

impl fmt::Display for ObjectField<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.namespace {
            Some(ns) => write!(f, "{ns}/{}", self.name),
            None => f.write_str(self.name),
        }
    }
}

/// How a reconcile ended, as [`Builder::on_result`] reports it: kube-runtime's
/// `Controller::run` stream items, with the cluster.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Reconciled<C: ClusterId> {
    /// What was reconciled.
    pub request: Request<C>,
    /// What comes next: the reconciler's action, or the error policy's after an error
    /// ([`PANIC_REQUEUE`] after a panic).
    pub action: crate::controller::Action,
    /// Why it failed, if it did.
    pub failure: Option<Failure>,
    /// How long it ran.
    pub took: Duration,
}

/// Why a reconcile failed.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Failure {
    /// The reconciler returned an error (its text).
    Error(String),
    /// The reconciler or its error policy panicked (the panic's message).
    Panic(String),
    /// The reconcile ran past the controller's reconcile timeout (this long) and was dropped.
    Timeout(Duration),
}

/// A callback given every reconcile's end.
pub(crate) type Observer<C> = Arc<dyn Fn(Reconciled<C>) + Send + Sync>;

/// Hands `reconciled` to `observer`; a panic of the observer is logged, not carried on.
pub(crate) fn observe<C: ClusterId>(observer: &Observer<C>, reconciled: Reconciled<C>) {
    let request = reconciled.request.clone();
    if let Err(panic) =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| observer(reconciled)))
    {
        tracing::error!(%request, panic = %crate::util::panic::panic_message(&*panic), "the result observer panicked");
    }
}

/// A request and why it was made.
pub(crate) type Trigger<C> = (Request<C>, ReconcileReason);

/// A predicate's hash of an object (see `kube_runtime::Predicate`).
pub(crate) type PredicateFn<K> = Arc<dyn Fn(&K) -> Option<u64> + Send + Sync>;

/// `items` through `predicate`, if any (kube-runtime's filter: keyed by uid, entries
/// expire), `object` being the controller's object in an item.
pub(crate) fn through_predicate<T, K>(
    items: impl futures::Stream<Item = Result<T, watcher::Error>> + Send + 'static,
    predicate: Option<PredicateFn<K>>,
    object: fn(&T) -> &K,
) -> impl futures::Stream<Item = Result<T, watcher::Error>> + Send + 'static
where
    T: kube::Resource + Send + 'static,
    T::DynamicType: Eq + std::hash::Hash + Clone + Send,
    K: 'static,
{
    use futures::StreamExt;
    use kube_runtime::WatchStreamExt;
    match predicate {
        Some(predicate) => items
            .predicate_filter(move |item: &T| predicate(object(item)), Default::default())
            .left_stream(),
        None => items.right_stream(),
    }
}

/// Which clusters a controller engages.
pub(crate) type ClusterFilter<C> = Arc<dyn Fn(&Cluster<C>) -> bool + Send + Sync>;

/// The controller's settings, fixed when it is built.
pub(crate) struct Spec<K: Watchable, C: ClusterId> {
    pub(crate) name: Arc<str>,
    /// The primary kind's dynamic type (`()` for kinds known at compile time).
    pub(crate) dt: K::DynamicType,
    pub(crate) watcher_config: watcher::Config,
    pub(crate) relations: Vec<Arc<dyn relations::Relation<C, K>>>,
    /// Requests from elsewhere than the watches of the controller's clusters.
    pub(crate) sources: Vec<Arc<dyn sources::RequestSource<C>>>,
    /// `reconcile_all_on`'s stream, lent to each run.
    pub(crate) bulk: Option<Arc<sources::Given<()>>>,
    pub(crate) predicate: Option<PredicateFn<K>>,
    pub(crate) engage_local: bool,
    pub(crate) engage_fleet: bool,
    pub(crate) cluster_filter: Option<ClusterFilter<C>>,
    /// 0 for no limit.
    pub(crate) concurrency: usize,
    /// At most this many reconciles of one cluster at once; `None` for the default.
    pub(crate) per_cluster: Option<usize>,
    pub(crate) debounce: Duration,
    /// How long reconciles of a disengaged (or replaced) cluster may go on before they are
    /// dropped.
    pub(crate) disengage_grace: Duration,
    /// How long an object that keeps failing waits between attempts.
    pub(crate) failure_backoff: FailureBackoff,
    /// How long a reconcile may run before it is dropped; `None` for no limit.
    pub(crate) reconcile_timeout: Option<Duration>,
    /// Whether listed objects without news wait behind live changes.
    pub(crate) changes_first: bool,
    /// Every cached object is reconciled again after about this long; `None`: never.
    pub(crate) resync: Option<Duration>,
    /// Whether its caches are started before this replica leads (warm standby).
    pub(crate) warm: bool,
    pub(crate) observer: Option<Observer<C>>,
    /// Runs on the leader only when the manager is sharded (without sharding, every
    /// controller is the leader's when there is leader election).
    pub(crate) leader_only: bool,
}

impl<K: Watchable, C: ClusterId> Spec<K, C> {
    /// The per-cluster cap: as set, else one less than the concurrency (so one cluster never
    /// holds every slot while others wait), else none.
    pub(crate) fn per_cluster_cap(&self) -> usize {
        match (self.per_cluster, self.concurrency) {
            (Some(n), _) => n.max(1),
            (None, 0) => 0,
            (None, n) => (n - 1).max(1),
        }
    }
}

/// How long after a reconcile panicked it runs again. A panic is caught (the controller and
/// every other cluster go on), logged at ERROR with its message and counted in
/// `controller_runtime_reconcile_panics_total`; there is no error value for the error policy
/// to decide on, so the request is retried after this delay, as an error would be.
pub const PANIC_REQUEUE: Duration = Duration::from_secs(10);

/// The default of [`Builder::disengage_grace`].
pub const DEFAULT_DISENGAGE_GRACE: Duration = Duration::from_secs(10);
