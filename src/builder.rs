//! [`Builder`]: configures a controller for a primary kind and runs it on a manager.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures::future::Either;
use kube::core::PartialObjectMeta;
use kube_runtime::{Predicate, watcher};

use crate::cache::Watchable;
use crate::cluster::Cluster;
use crate::controller::relations::{Owns, Watches};
use crate::controller::sources::{FromFleet, FromLocal, Given, mapped_stream, owners_of};
use crate::controller::{Action, Context, Request};
use crate::controller::{DEFAULT_DISENGAGE_GRACE, FailureBackoff, Spec};
use crate::manager::Manager;
use crate::provider::Provider;
use crate::run::Env;
use futures::StreamExt;

/// Configures and runs a controller for the primary kind `K` on a [`Manager`].
///
/// With a provider that has a single cluster ([`SingleProvider`](crate::providers::SingleProvider))
/// the controller *is* a kube-runtime `Controller`: relations, predicate, concurrency and
/// debounce map onto it one to one, and the reconciler is called directly from its runner.
/// With a fleet provider it runs the fleet queue (see `docs/architecture.md`) instead. The
/// reconciler and error policy are the same functions in both cases.
///
/// Defaults: engage every provider cluster, not the local one; no predicate; unbounded
/// concurrency (with a limit, one cluster may hold all but one slot); no debounce; reconciles
/// of a disengaged cluster dropped after [`DEFAULT_DISENGAGE_GRACE`](crate::DEFAULT_DISENGAGE_GRACE);
/// named after the kind.
#[must_use]
pub struct Builder<'m, P: Provider, K: Watchable> {
    manager: &'m Manager<P>,
    spec: Spec<K, P::Id>,
    /// The fleet collectors of `owns_in_fleet` relations, run beside the controller.
    collectors: Vec<crate::run::component::ControllerFactory<P::Id>>,
}

impl<'m, P: Provider, K: Watchable> Builder<'m, P, K>
where
    K::DynamicType: Default,
{
    /// A controller for `K` objects matching `watcher_config`.
    pub fn new(manager: &'m Manager<P>, watcher_config: watcher::Config) -> Self {
        Self::new_with(manager, K::DynamicType::default(), watcher_config)
    }
}

impl<'m, P: Provider, K: Watchable> Builder<'m, P, K> {
    /// A controller for a kind known at run time: `K` is usually
    /// [`DynamicObject`](kube::api::DynamicObject) and `dt` its
    /// [`ApiResource`](kube::api::ApiResource) (from a group, version and kind with
    /// [`ApiResource::from_gvk_with_plural`](kube::api::ApiResource::from_gvk_with_plural), or
    /// discovered with [`Cluster::discover`](crate::Cluster::discover)). In a cluster that does
    /// not serve the kind, the controller's watch retries (as for a CRD not installed yet)
    /// and its requests wait; the other clusters go on.
    pub fn new_with(
        manager: &'m Manager<P>,
        dt: K::DynamicType,
        watcher_config: watcher::Config,
    ) -> Self {
        Self {
            manager,
            spec: Spec {
                name: Arc::from(K::kind(&dt).as_ref()),
                dt,
                watcher_config,
                relations: Vec::new(),
                sources: Vec::new(),
                bulk: None,
                predicate: None,
                engage_local: false,
                engage_fleet: true,
                cluster_filter: None,
                concurrency: 0,
                per_cluster: None,
                debounce: Duration::ZERO,
                disengage_grace: DEFAULT_DISENGAGE_GRACE,
                failure_backoff: FailureBackoff::default(),
                reconcile_timeout: None,
                changes_first: true,
                resync: Some(crate::controller::DEFAULT_RESYNC),
                warm: false,
                observer: None,
                leader_only: false,
            },
            collectors: Vec::new(),
        }
    }

    /// The controller's name, used in logs (default: the kind).
    pub fn named(mut self, name: impl AsRef<str>) -> Self {
        self.spec.name = Arc::from(name.as_ref());
        self
    }

    /// Also reconciles a `K` when a `Child` it owns (an owner reference to it, in the same
    /// cluster) changes or is deleted.
    pub fn owns<Child: Watchable>(self, watcher_config: watcher::Config) -> Self
    where
        Child::DynamicType: Default,
    {
        self.owns_with::<Child>(Child::DynamicType::default(), watcher_config)
    }

    /// [`owns`](Self::owns) for a child kind known at run time, of dynamic type `dt`.
    pub fn owns_with<Child: Watchable>(
        self,
        dt: Child::DynamicType,
        watcher_config: watcher::Config,
    ) -> Self {
        self.owns_relation::<Child>(dt, watcher_config, None)
    }

    /// Adds an `owns` relation.
    fn owns_relation<Child: Watchable>(
        mut self,
        dt: Child::DynamicType,
        watcher_config: watcher::Config,
        predicate: Option<crate::controller::PredicateFn<Child>>,
    ) -> Self {
        self.spec.relations.push(Arc::new(Owns::<K, Child> {
            watcher_config,
            owner: self.spec.dt.clone(),
            child: dt,
            predicate,
        }));
        self
    }

    /// [`owns`](Self::owns), reconciling the owner only when `predicate`'s value for the
    /// child changed (for example `predicates::generation`, to ignore status updates of
    /// children); a deleted child always reconciles its owner. Uses kube-runtime's predicate
    /// filter, as [`with_predicate`](Self::with_predicate) does.
    pub fn owns_filtered<Child: Watchable>(
        self,
        watcher_config: watcher::Config,
        predicate: impl Predicate<Child> + Send + Sync + 'static,
    ) -> Self
    where
        Child::DynamicType: Default,
    {
        let predicate: crate::controller::PredicateFn<Child> =
            Arc::new(move |c: &Child| predicate.hash_property(c));
        self.owns_relation(
            Child::DynamicType::default(),
            watcher_config,
            Some(predicate),
        )
    }

    /// Reconciles the owners of each child `children` yields, as `(cluster, child)`: a
    /// watch of your own (shared with other code, filtered, or from another source) in place
    /// of the one [`owns`](Self::owns) starts. kube-runtime's `Controller::owns_stream`.
    /// Each run of the controller reads the stream in turn (a run gives it back when it ends).
    pub fn owns_stream<Child: Watchable>(
        mut self,
        children: impl futures::Stream<Item = (P::Id, Arc<Child>)> + Send + 'static,
    ) -> Self
    where
        Child::DynamicType: Default,
    {
        let kind: Arc<str> = Arc::from(Child::kind(&Default::default()).as_ref());
        let triggers = owners_of::<P::Id, K, Child>(children, self.spec.dt.clone(), kind);
        self.spec.sources.push(Arc::new(Given::new(triggers)));
        self
    }

    /// [`owns`](Self::owns) with the children's metadata only: the cluster's watch of them
    /// asks the API server for `PartialObjectMeta` (names, labels, annotations, owner
    /// references: no spec, status or data) and caches that, which is all the owner-reference
    /// mapping reads. Prefer it when the reconciler does not read the children from the cache
    /// (`cache::<Child>` would start a second, whole-object watch); a reconciler that reads
    /// them is better served by `owns`, which shares one watch with its reads.
    /// Metadata-only watches work for `watches` and caches too: name the kind
    /// `PartialObjectMeta<Other>`.
    pub fn owns_metadata<Child: Watchable>(self, watcher_config: watcher::Config) -> Self
    where
        Child::DynamicType: Default,
    {
        self.owns::<PartialObjectMeta<Child>>(watcher_config)
    }

    /// Also reconciles a `K` when a `Child` it owns across the fleet changes or is deleted:
    /// a child in any engaged cluster whose owner record
    /// ([`Context::own`](crate::Context::own)) names a `K`, in whatever cluster the owner is.
    /// Only objects with the owner label are watched (added to `watcher_config`'s selector).
    ///
    /// `gc` says whether the children go when their owner does ([`FleetGc`]): off, nothing
    /// is deleted; in the background, or in the foreground (the owner held by a finalizer
    /// until they are gone). Children are deleted only after the owner was read gone from
    /// its cluster's API server, or its cluster left the fleet for good
    /// ([`Fleet::disengage`](crate::Fleet::disengage)): never while that cluster is only
    /// unreachable or paused.
    ///
    /// [`FleetGc`]: crate::ownership::FleetGc
    pub fn owns_in_fleet<Child: Watchable>(
        self,
        watcher_config: watcher::Config,
        gc: crate::ownership::FleetGc,
    ) -> Self
    where
        Child::DynamicType: Default,
    {
        self.owns_in_fleet_with::<Child>(Child::DynamicType::default(), watcher_config, gc)
    }

    /// [`owns_in_fleet`](Self::owns_in_fleet) for a child kind known at run time, of dynamic
    /// type `dt`.
    pub fn owns_in_fleet_with<Child: Watchable>(
        mut self,
        dt: Child::DynamicType,
        watcher_config: watcher::Config,
        gc: crate::ownership::FleetGc,
    ) -> Self {
        let config = crate::ownership::gc::child_config(watcher_config);
        let owner_dt = self.spec.dt.clone();
        if gc != crate::ownership::FleetGc::Off {
            let collector = Arc::new(crate::ownership::gc::Collector::<P::Id, K, Child>::new(
                self.spec.name.clone(),
                gc,
                self.spec.dt.clone(),
                self.spec.watcher_config.clone(),
                dt.clone(),
                config.clone(),
            ));
            self.collectors.push(Arc::new(move |env: Env<P::Id>| {
                Box::pin(collector.clone().run(env))
            }));
        }
        self.watches_relation(dt, config, None, move |_: &P::Id, child: &Child| {
            match crate::ownership::FleetOwner::<P::Id>::of_child(child) {
                Some(Ok(owner)) if owner.is_kind::<K>(&owner_dt) => Some(Request::new(
                    owner.cluster,
                    owner.namespace.as_deref(),
                    &owner.name,
                )),
                _ => None,
            }
        })
    }

    /// Also reconciles the requests `mapper` returns when an `Other` changes. The mapper is
    /// given the id of the cluster the `Other` lives in and may return requests for any
    /// cluster (multi-cluster-aware controllers: watch here, act there); requests for
    /// clusters this controller does not engage are dropped.
    pub fn watches<Other, I>(
        self,
        watcher_config: watcher::Config,
        mapper: impl Fn(&P::Id, &Other) -> I + Send + Sync + 'static,
    ) -> Self
    where
        Other: Watchable,
        Other::DynamicType: Default,
        I: IntoIterator<Item = Request<P::Id>>,
    {
        self.watches_with(Other::DynamicType::default(), watcher_config, mapper)
    }

    /// [`watches`](Self::watches) for a kind known at run time, of dynamic type `dt`.
    pub fn watches_with<Other, I>(
        self,
        dt: Other::DynamicType,
        watcher_config: watcher::Config,
        mapper: impl Fn(&P::Id, &Other) -> I + Send + Sync + 'static,
    ) -> Self
    where
        Other: Watchable,
        I: IntoIterator<Item = Request<P::Id>>,
    {
        self.watches_relation(dt, watcher_config, None, mapper)
    }

    /// Adds a `watches` relation.
    fn watches_relation<Other, I>(
        mut self,
        dt: Other::DynamicType,
        watcher_config: watcher::Config,
        predicate: Option<crate::controller::PredicateFn<Other>>,
        mapper: impl Fn(&P::Id, &Other) -> I + Send + Sync + 'static,
    ) -> Self
    where
        Other: Watchable,
        I: IntoIterator<Item = Request<P::Id>>,
    {
        self.spec
            .relations
            .push(Arc::new(Watches::<P::Id, K, Other> {
                watcher_config,
                mapper: collected(mapper),
                primary: self.spec.dt.clone(),
                other: dt,
                predicate,
            }));
        self
    }

    /// [`watches`](Self::watches), mapping an `Other` only when `predicate`'s value for it
    /// changed; a deleted `Other` is always mapped.
    pub fn watches_filtered<Other, I>(
        self,
        watcher_config: watcher::Config,
        predicate: impl Predicate<Other> + Send + Sync + 'static,
        mapper: impl Fn(&P::Id, &Other) -> I + Send + Sync + 'static,
    ) -> Self
    where
        Other: Watchable,
        Other::DynamicType: Default,
        I: IntoIterator<Item = Request<P::Id>>,
    {
        let predicate: crate::controller::PredicateFn<Other> =
            Arc::new(move |o: &Other| predicate.hash_property(o));
        self.watches_relation(
            Other::DynamicType::default(),
            watcher_config,
            Some(predicate),
            mapper,
        )
    }

    /// Reconciles the requests `mapper` returns for each `(cluster, object)` `objects`
    /// yields: a stream of your own in place of the watch [`watches`](Self::watches) starts
    /// (kube-runtime's `Controller::watches_stream`). Read by each run of the controller in turn
    /// (a run gives it back when it ends).
    pub fn watches_stream<Other, I>(
        mut self,
        objects: impl futures::Stream<Item = (P::Id, Arc<Other>)> + Send + 'static,
        mapper: impl Fn(&P::Id, &Other) -> I + Send + Sync + 'static,
    ) -> Self
    where
        Other: Watchable,
        Other::DynamicType: Default,
        I: IntoIterator<Item = Request<P::Id>>,
    {
        let kind: Arc<str> = Arc::from(Other::kind(&Default::default()).as_ref());
        let triggers = mapped_stream(objects, kind, collected(mapper));
        self.spec.sources.push(Arc::new(Given::new(triggers)));
        self
    }

    /// Also reconciles the requests `mapper` returns when an `Other` changes in any cluster
    /// of `fleet`: another provider's clusters (run by a manager of its own), whose ids have
    /// their own type `D`. The controller reconciles in its own clusters; `fleet`'s are
    /// only watched (Go multicluster-runtime's "local cluster as just another provider").
    /// Requests for clusters this controller does not engage are dropped.
    pub fn watches_from<D, Other, I>(
        mut self,
        fleet: &crate::fleet::Fleet<D>,
        watcher_config: watcher::Config,
        mapper: impl Fn(&D, &Other) -> I + Send + Sync + 'static,
    ) -> Self
    where
        D: crate::cluster::ClusterId,
        Other: Watchable,
        Other::DynamicType: Default,
        I: IntoIterator<Item = Request<P::Id>>,
    {
        self.spec.sources.push(Arc::new(FromFleet {
            fleet: fleet.clone(),
            dt: Other::DynamicType::default(),
            config: watcher_config,
            mapper: collected(mapper),
        }));
        self
    }

    /// Also reconciles the requests `mapper` returns when an `Other` changes in the
    /// manager's local cluster ([`Manager::with_local`](crate::Manager::with_local)), while
    /// the controller reconciles in the provider's clusters: the multi-cluster-aware pattern
    /// where a resource on the host drives work in the fleet.
    pub fn watches_local<Other, I>(
        mut self,
        watcher_config: watcher::Config,
        mapper: impl Fn(&Other) -> I + Send + Sync + 'static,
    ) -> Self
    where
        Other: Watchable,
        Other::DynamicType: Default,
        I: IntoIterator<Item = Request<P::Id>>,
    {
        self.spec.sources.push(Arc::new(FromLocal {
            dt: Other::DynamicType::default(),
            config: watcher_config,
            mapper: Arc::new(move |obj: &Other| mapper(obj).into_iter().collect::<Vec<_>>()),
        }));
        self
    }

    /// Reconciles each request `requests` yields (kube-runtime's `Controller::reconcile_on`):
    /// for triggers from outside Kubernetes, or from a source of your own. Requests for
    /// clusters this controller does not engage, or for objects not in its caches, are
    /// dropped. Each run of the controller reads the stream in turn (a run gives it back
    /// when it ends).
    pub fn reconcile_on(
        mut self,
        requests: impl futures::Stream<Item = Request<P::Id>> + Send + 'static,
    ) -> Self {
        let triggers = requests
            .map(|r| (r, crate::controller::ReconcileReason::Given))
            .boxed();
        self.spec.sources.push(Arc::new(Given::new(triggers)));
        self
    }

    /// Reconciles every object of every cluster the controller follows each time `trigger`
    /// yields (kube-runtime's `Controller::reconcile_all_on`), for example when a
    /// configuration the reconciler reads changes. Read by each run of the controller in turn
    /// (a run gives it back when it ends).
    pub fn reconcile_all_on(
        mut self,
        trigger: impl futures::Stream<Item = ()> + Send + 'static,
    ) -> Self {
        self.spec.bulk = Some(Arc::new(Given::new(trigger.boxed())));
        self
    }

    /// Reconciles a changed `K` only if `predicate`'s value for it changed (for example
    /// `kube::runtime::predicates::generation`). Both modes filter with kube-runtime's own
    /// predicate filter: its cache is keyed by uid (an object deleted and created again under
    /// the same name passes), and entries not seen for an hour are dropped.
    pub fn with_predicate(mut self, predicate: impl Predicate<K> + Send + Sync + 'static) -> Self {
        self.spec.predicate = Some(Arc::new(move |obj: &K| predicate.hash_property(obj)));
        self
    }

    /// Whether to reconcile in the manager's local cluster (default: no).
    pub fn engage_local(mut self, yes: bool) -> Self {
        self.spec.engage_local = yes;
        self
    }

    /// Whether to reconcile in the provider's clusters (default: yes).
    pub fn engage_provider(mut self, yes: bool) -> Self {
        self.spec.engage_fleet = yes;
        self
    }

    /// Reconciles only in clusters for which `filter` returns true.
    pub fn cluster_filter(
        mut self,
        filter: impl Fn(&Cluster<P::Id>) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.spec.cluster_filter = Some(Arc::new(filter));
        self
    }

    /// At most `n` reconciles at once across all clusters; 0 (the default) for no limit.
    pub fn concurrency(mut self, n: u16) -> Self {
        self.spec.concurrency = usize::from(n);
        self
    }

    /// At most `n` reconciles of one cluster at once (fleet mode). By default one less than
    /// [`Builder::concurrency`] (at least 1), so a cluster whose API calls hang can never hold
    /// every slot while others wait; no limit when the concurrency has none.
    pub fn max_in_flight_per_cluster(mut self, n: u16) -> Self {
        self.spec.per_cluster = Some(usize::from(n));
        self
    }

    /// How long reconciles of a cluster that was disengaged (or replaced) may go on before
    /// they are dropped and their slots freed (fleet mode); default
    /// [`DEFAULT_DISENGAGE_GRACE`](crate::DEFAULT_DISENGAGE_GRACE). They see
    /// [`Context::cancelled`] at once.
    pub fn disengage_grace(mut self, grace: Duration) -> Self {
        self.spec.disengage_grace = grace;
        self
    }

    /// The delays of [`Action::backoff`] for this controller's objects: each object (in each
    /// cluster) that fails again and again waits `base`, then twice as long, and so on up to
    /// `max`; default 5 ms to 1,000 s (controller-runtime's). See [`FailureBackoff`].
    pub fn failure_backoff(mut self, backoff: FailureBackoff) -> Self {
        self.spec.failure_backoff = backoff;
        self
    }

    /// Ends a reconcile that has run for `timeout` (controller-runtime's
    /// `ReconciliationTimeout`): its [`Context`] is cancelled at the deadline, and one still
    /// running a second later is dropped, counted as an error and retried after the object's
    /// [`Action::backoff`] (the error policy is not called then). Off by default. The
    /// details, with the metrics and [`Failure::Timeout`](crate::Failure::Timeout): the
    /// book's *Reconcile* chapter (`docs/concepts/reconcile.md`, "Errors and panics").
    pub fn reconcile_timeout(mut self, timeout: Duration) -> Self {
        self.spec.reconcile_timeout = Some(timeout);
        self
    }

    /// Reconciles every cached object again about every `period` (controller-runtime's
    /// `SyncPeriod`, each period within ±10 %, per cluster), read from the cache; `None`
    /// turns it off. Default [`DEFAULT_RESYNC`](crate::DEFAULT_RESYNC), 10 hours. Resync
    /// requests wait behind live changes and pass the [`Builder::predicate`] unfiltered
    /// (`docs/concepts/reconcile.md`, "What starts a reconcile").
    pub fn resync_every(mut self, period: Option<Duration>) -> Self {
        self.spec.resync = period.filter(|p| !p.is_zero());
        self
    }

    /// Warm standby (controller-runtime's `EnableWarmup`): with leader election, a replica
    /// that is not leading keeps this controller's caches listed in every cluster it would
    /// follow, without reconciling, so that it reconciles at once when it takes the Lease.
    /// Off by default; without leader election it changes nothing. Its costs and its effect
    /// on single mode: `docs/concepts/reconcile.md`, "Warm standby".
    pub fn warm_standby(mut self, on: bool) -> Self {
        self.spec.warm = on;
        self
    }

    /// Whether objects that come from a listing or a resync without news wait behind live
    /// changes (controller-runtime's priority queue): on by default. One listed object still
    /// starts after every 16 changes while both wait; `false` keeps one lane, in arrival
    /// order. Which objects count as listed, and how the lanes meet the concurrency limit:
    /// `docs/concepts/reconcile.md`, "Live changes first".
    pub fn changes_first(mut self, on: bool) -> Self {
        self.spec.changes_first = on;
        self
    }

    /// On a sharded manager ([`Manager::sharding`](crate::Manager::sharding)), runs this
    /// controller only on the replica holding the leader election Lease, for work done once
    /// for the whole group; its fleet is still that replica's share
    /// ([`FleetView::discovered`](crate::FleetView::discovered) reaches the rest). Without
    /// sharding it changes nothing (`docs/sharding.md`).
    pub fn leader_only(mut self) -> Self {
        self.spec.leader_only = true;
        self
    }

    /// Waits `debounce` for further changes before reconciling (default: none).
    pub fn debounce(mut self, debounce: Duration) -> Self {
        self.spec.debounce = debounce;
        self
    }

    /// Calls `observer` at the end of every reconcile with its request, the action that
    /// follows, the failure if any and how long it ran: kube-runtime's `Controller::run`
    /// stream, as a callback (in both modes). It runs on the controller's task: keep it
    /// quick, or send the result into a channel to have a stream:
    ///
    /// ```no_run
    /// # use std::sync::Arc;
    /// # use k8s_openapi::api::core::v1::ConfigMap;
    /// # use multicluster_runtime::{providers::Clusters, Action, Builder, ClusterName, Context, Manager};
    /// # let manager = Manager::new(Clusters::<ClusterName>::new());
    /// let (tx, mut results) = tokio::sync::mpsc::unbounded_channel();
    /// Builder::<_, ConfigMap>::new(&manager, Default::default())
    ///     .on_result(move |reconciled| { let _ = tx.send(reconciled); })
    ///     .start(
    ///         |_, _: Context<ClusterName, ()>| async { Ok::<_, kube::Error>(Action::await_change()) },
    ///         |_, _, _| Action::await_change(),
    ///         Arc::new(()),
    ///     );
    /// // results.recv().await: Some(Reconciled { request, action, failure, took, .. })
    /// ```
    pub fn on_result(
        mut self,
        observer: impl Fn(crate::controller::Reconciled<P::Id>) + Send + Sync + 'static,
    ) -> Self {
        self.spec.observer = Some(Arc::new(observer));
        self
    }

    /// The controller as a future that runs until the manager shuts down. Spawn it or await
    /// it yourself; [`Builder::start`] is the usual way. It is bound to the manager's current
    /// (or next) run: it engages the local cluster only if that run has started. It does not
    /// follow leader election: to run it on the leader only, start it after
    /// [`Manager::elected`](crate::Manager::elected) and stop it with the token that returns.
    pub fn run<S, F, Fut, E, EP>(
        self,
        reconcile: F,
        error_policy: EP,
        state: Arc<S>,
    ) -> impl Future<Output = ()> + Send + 'static
    where
        S: Send + Sync + 'static,
        F: Fn(Arc<K>, Context<P::Id, S>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Action, E>> + Send + 'static,
        E: std::error::Error + Send + 'static,
        EP: Fn(Arc<K>, &E, &Context<P::Id, S>) -> Action + Send + Sync + 'static,
    {
        let env = self.manager.env();
        let single = self.manager.provider().single();
        let collectors: Vec<_> = self
            .collectors
            .iter()
            .map(|collector| collector(self.manager.env()))
            .collect();
        let controller = run(
            Arc::new(self.spec),
            env,
            single,
            Arc::new(reconcile),
            Arc::new(error_policy),
            state,
        );
        async move {
            futures::join!(controller, futures::future::join_all(collectors));
        }
    }

    /// Builds the controller and runs it with the manager: in its current run, if any, and
    /// in every later run (each starts it afresh).
    pub fn start<S, F, Fut, E, EP>(self, reconcile: F, error_policy: EP, state: Arc<S>)
    where
        S: Send + Sync + 'static,
        F: Fn(Arc<K>, Context<P::Id, S>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Action, E>> + Send + 'static,
        E: std::error::Error + Send + 'static,
        EP: Fn(Arc<K>, &E, &Context<P::Id, S>) -> Action + Send + Sync + 'static,
    {
        let manager = self.manager;
        for collector in self.collectors {
            manager.add_controller(self.spec.leader_only, collector);
        }
        let spec = Arc::new(self.spec);
        let single = manager.provider().single();
        let (reconcile, error_policy) = (Arc::new(reconcile), Arc::new(error_policy));
        let leader_only = spec.leader_only;
        if spec.warm {
            let spec = spec.clone();
            manager.add_warmer(Arc::new(move |env: Env<P::Id>| {
                Box::pin(crate::controller::warm::run(spec.clone(), env))
            }));
        }
        manager.add_controller(
            leader_only,
            Arc::new(move |env: Env<P::Id>| {
                Box::pin(run(
                    spec.clone(),
                    env,
                    single.clone(),
                    reconcile.clone(),
                    error_policy.clone(),
                    state.clone(),
                ))
            }),
        );
    }
}

/// One run of a controller, in the mode its provider calls for.
fn run<K, C, S, F, Fut, E, EP>(
    spec: Arc<Spec<K, C>>,
    env: Env<C>,
    single: Option<Cluster<C>>,
    reconcile: Arc<F>,
    error_policy: Arc<EP>,
    state: Arc<S>,
) -> impl Future<Output = ()> + Send + 'static
where
    K: Watchable,
    C: crate::cluster::ClusterId,
    S: Send + Sync + 'static,
    F: Fn(Arc<K>, Context<C, S>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Action, E>> + Send + 'static,
    E: std::error::Error + Send + 'static,
    EP: Fn(Arc<K>, &E, &Context<C, S>) -> Action + Send + Sync + 'static,
{
    match single {
        Some(cluster) if spec.engage_fleet && !spec.engage_local && !spec.warm => Either::Left(
            crate::controller::single_mode::run(spec, env, cluster, reconcile, error_policy, state),
        ),
        _ => Either::Right(crate::controller::fleet_mode::run(
            spec,
            env,
            reconcile,
            error_policy,
            state,
        )),
    }
}

/// `mapper` returning its requests collected, type-erased.
fn collected<D, X, C, I>(
    mapper: impl Fn(&D, &X) -> I + Send + Sync + 'static,
) -> crate::controller::sources::Mapper<D, X, C>
where
    D: 'static,
    X: 'static,
    C: crate::cluster::ClusterId,
    I: IntoIterator<Item = Request<C>>,
{
    Arc::new(move |id: &D, obj: &X| mapper(id, obj).into_iter().collect())
}
