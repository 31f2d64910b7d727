//! [`Builder`]: configures a controller for a primary kind and runs it on a manager.

use std::convert::Infallible;
use std::fmt::Debug;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use futures::future::Either;
use futures::stream::{self, BoxStream};
use kube::{Api, Resource};
use kube_runtime::controller::trigger_with;
use kube_runtime::reflector::ObjectRef;
use kube_runtime::{Predicate, WatchStreamExt, watcher};
use serde::de::DeserializeOwned;

use crate::context::Shared;
use crate::controller::{Env, ReconcileReason, Relation, Spec, Trigger, fresh_changes, run_fleet};
use crate::{Action, Cluster, ClusterId, Context, Manager, Provider, Request};

/// Configures and runs a controller for the primary kind `K` on a [`Manager`].
///
/// With a provider that has a single cluster ([`SingleProvider`](crate::providers::SingleProvider))
/// the controller *is* a kube-runtime `Controller`: relations, predicate, concurrency and
/// debounce map onto it one to one, and the reconciler is called directly from its runner.
/// With a fleet provider it runs the fleet queue (see `docs/architecture.md`) instead. The
/// reconciler and error policy are the same functions in both cases.
///
/// Defaults: engage every provider cluster, not the local one; no predicate; unbounded
/// concurrency; no debounce; named after the kind.
#[must_use]
pub struct Builder<'m, P: Provider, K> {
    manager: &'m Manager<P>,
    spec: Spec<K, P::Id>,
}

/// Everything a primary or related kind must be to be watched.
pub trait Watchable:
    Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug + Send + Sync + 'static
{
}
impl<T> Watchable for T where
    T: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug + Send + Sync + 'static
{
}

impl<'m, P: Provider, K: Watchable> Builder<'m, P, K> {
    /// A controller for `K` objects matching `watcher_config`.
    pub fn new(manager: &'m Manager<P>, watcher_config: watcher::Config) -> Self {
        Self {
            manager,
            spec: Spec {
                name: Arc::from(K::kind(&()).as_ref()),
                watcher_config,
                relations: Vec::new(),
                predicate: None,
                engage_local: false,
                engage_fleet: true,
                cluster_filter: None,
                concurrency: 0,
                debounce: Duration::ZERO,
            },
        }
    }

    /// The controller's name, used in logs (default: the kind).
    pub fn named(mut self, name: impl AsRef<str>) -> Self {
        self.spec.name = Arc::from(name.as_ref());
        self
    }

    /// Also reconciles a `K` when a `Child` it owns (an owner reference to it, in the same
    /// cluster) changes or is deleted.
    pub fn owns<Child: Watchable>(mut self, watcher_config: watcher::Config) -> Self {
        self.spec.relations.push(Arc::new(Owns::<Child> {
            watcher_config,
            _child: std::marker::PhantomData,
        }));
        self
    }

    /// Also reconciles the requests `mapper` returns when an `Other` changes. The mapper is
    /// given the id of the cluster the `Other` lives in and may return requests for any
    /// cluster (multi-cluster-aware controllers: watch here, act there); requests for
    /// clusters this controller does not engage are dropped.
    pub fn watches<Other, I>(
        mut self,
        watcher_config: watcher::Config,
        mapper: impl Fn(&P::Id, &Other) -> I + Send + Sync + 'static,
    ) -> Self
    where
        Other: Watchable,
        I: IntoIterator<Item = Request<P::Id>>,
    {
        let mapper = Arc::new(move |id: &P::Id, obj: &Other| {
            mapper(id, obj).into_iter().collect::<Vec<_>>()
        });
        self.spec.relations.push(Arc::new(Watches {
            watcher_config,
            mapper,
        }));
        self
    }

    /// Reconciles a changed `K` only if `predicate`'s value for it changed (for example
    /// `kube::runtime::predicates::generation`).
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

    /// Waits `debounce` for further changes before reconciling (default: none).
    pub fn debounce(mut self, debounce: Duration) -> Self {
        self.spec.debounce = debounce;
        self
    }

    /// The controller as a future that runs until the manager shuts down. Spawn it, await
    /// it, or hand it to [`Manager::add`] (what [`Builder::start`] does).
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
        let env = Env {
            fleet: self.manager.fleet().clone(),
            local: self.manager.local().cloned(),
            shutdown: self.manager.shutdown_token(),
            graceful: self.manager.graceful(),
        };
        match self.manager.provider().single() {
            Some(cluster) if self.spec.engage_fleet && !self.spec.engage_local => Either::Left(
                run_single(self.spec, env, cluster, reconcile, error_policy, state),
            ),
            _ => Either::Right(run_fleet(self.spec, env, reconcile, error_policy, state)),
        }
    }

    /// Builds the controller and runs it with the manager ([`Manager::add`]).
    pub fn start<S, F, Fut, E, EP>(self, reconcile: F, error_policy: EP, state: Arc<S>)
    where
        S: Send + Sync + 'static,
        F: Fn(Arc<K>, Context<P::Id, S>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Action, E>> + Send + 'static,
        E: std::error::Error + Send + 'static,
        EP: Fn(Arc<K>, &E, &Context<P::Id, S>) -> Action + Send + Sync + 'static,
    {
        let manager = self.manager;
        manager.add(self.run(reconcile, error_policy, state));
    }
}

/// What the single-cluster runner hands to each call: everything a [`Context`] needs, behind
/// the one `Arc` kube-runtime passes around, so a call costs two reference-count increments
/// and the request.
struct Single<C: ClusterId, S, F, EP> {
    cluster: Cluster<C>,
    shared: Arc<Shared<C, S>>,
    reconcile: F,
    error_policy: EP,
}

impl<C: ClusterId, S, F, EP> Single<C, S, F, EP> {
    /// Three reference counts; the request is built only if the reconciler asks for it.
    fn context<K: Resource + Send + Sync + 'static>(&self, obj: &Arc<K>) -> Context<C, S> {
        Context::for_object(obj.clone(), self.cluster.clone(), self.shared.clone())
    }
}

/// Single-cluster mode: kube-runtime's `Controller`, nothing in between.
async fn run_single<K, C, S, F, Fut, E, EP>(
    spec: Spec<K, C>,
    env: Env<C>,
    cluster: Cluster<C>,
    reconcile: F,
    error_policy: EP,
    state: Arc<S>,
) where
    K: Watchable,
    C: ClusterId,
    S: Send + Sync + 'static,
    F: Fn(Arc<K>, Context<C, S>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Action, E>> + Send + 'static,
    E: std::error::Error + Send + 'static,
    EP: Fn(Arc<K>, &E, &Context<C, S>) -> Action + Send + Sync + 'static,
{
    use kube_runtime::Controller;
    use kube_runtime::controller::{Action as KubeAction, Error as KubeError};

    if let Some(filter) = &spec.cluster_filter
        && !filter(&cluster)
    {
        tracing::info!(controller = %spec.name, "the only cluster is filtered out; nothing to reconcile");
        env.shutdown.cancelled().await;
        return;
    }
    let api = Api::<K>::all(cluster.client());
    let mut controller = match spec.predicate {
        None => Controller::new(api, spec.watcher_config.clone()),
        Some(predicate) => {
            let (reader, writer) = kube_runtime::reflector::store();
            let stream = watcher(api, spec.watcher_config.clone())
                .default_backoff()
                .reflect(writer)
                .applied_objects()
                .predicate_filter(move |obj: &K| predicate(obj), Default::default());
            Controller::for_stream(stream, reader)
        }
    };
    for relation in &spec.relations {
        controller = relation.attach(controller, &cluster);
    }
    let config = kube_runtime::controller::Config::default()
        .concurrency(u16::try_from(spec.concurrency).unwrap_or(u16::MAX))
        .debounce(spec.debounce);
    let shutdown = env.shutdown.clone();
    let name = spec.name.clone();
    let shared = Arc::new(Shared {
        state,
        fleet: env.fleet,
        local: env.local,
        shutdown: env.shutdown,
    });
    let single = Arc::new(Single {
        cluster,
        shared,
        reconcile,
        error_policy,
    });
    controller
        .with_config(config)
        .graceful_shutdown_on(shutdown.cancelled_owned())
        .run(
            |obj, single| {
                let ctx = single.context(&obj);
                let fut = (single.reconcile)(obj, ctx);
                async move { fut.await.map(KubeAction::from) }
            },
            |obj, error, single| {
                let ctx = single.context(&obj);
                (single.error_policy)(obj, error, &ctx).into()
            },
            single,
        )
        .for_each(move |result| {
            match result {
                Ok(_) => {}
                Err(KubeError::ObjectNotFound(obj)) => {
                    tracing::debug!(controller = %name, object = %obj, "object not in the cache (deleted); skipping");
                }
                Err(KubeError::ReconcilerFailed(error, obj)) => {
                    tracing::warn!(controller = %name, object = %obj, %error, "reconcile failed");
                }
                Err(error) => tracing::warn!(controller = %name, %error, "controller error"),
            }
            std::future::ready(())
        })
        .await;
}

/// `K` is reconciled when a `Child` it owns changes.
struct Owns<Child> {
    watcher_config: watcher::Config,
    _child: std::marker::PhantomData<fn() -> Child>,
}

impl<C: ClusterId, K: Watchable, Child: Watchable> Relation<C, K> for Owns<Child> {
    fn triggers(
        &self,
        cluster: &Cluster<C>,
        baseline: Option<&Cluster<C>>,
    ) -> BoxStream<'static, Trigger<C>> {
        let changes = fresh_changes::<C, Child>(cluster, baseline, &self.watcher_config)
            .map(Ok::<_, Infallible>);
        let id = cluster.id().clone();
        let kind: Arc<str> = Arc::from(Child::kind(&()).as_ref());
        // kube-runtime's trigger primitive with its owner-reference mapping; the cluster id
        // goes on afterwards.
        let owners = move |child: Arc<Child>| {
            let meta = child.meta();
            let ns = meta.namespace.as_deref();
            meta.owner_references
                .iter()
                .flatten()
                .filter_map(|owner| ObjectRef::<K>::from_owner_ref(ns, owner, ()))
                .collect::<Vec<_>>()
        };
        trigger_with(changes, owners)
            .filter_map(move |request| {
                let trigger = request.ok().map(|r| {
                    let req = Request::from_object_ref(id.clone(), r.obj_ref);
                    (req, ReconcileReason::RelatedObjectChanged(kind.clone()))
                });
                std::future::ready(trigger)
            })
            .boxed()
    }

    fn attach(
        &self,
        controller: kube_runtime::Controller<K>,
        cluster: &Cluster<C>,
    ) -> kube_runtime::Controller<K> {
        controller.owns(
            Api::<Child>::all(cluster.client()),
            self.watcher_config.clone(),
        )
    }
}

type Mapper<C, Other> = Arc<dyn Fn(&C, &Other) -> Vec<Request<C>> + Send + Sync>;

/// The requests a mapper returns are reconciled when an `Other` changes.
struct Watches<C: ClusterId, Other> {
    watcher_config: watcher::Config,
    mapper: Mapper<C, Other>,
}

impl<C: ClusterId, K: Watchable, Other: Watchable> Relation<C, K> for Watches<C, Other> {
    fn triggers(
        &self,
        cluster: &Cluster<C>,
        baseline: Option<&Cluster<C>>,
    ) -> BoxStream<'static, Trigger<C>> {
        let id = cluster.id().clone();
        let mapper = self.mapper.clone();
        let kind: Arc<str> = Arc::from(Other::kind(&()).as_ref());
        fresh_changes::<C, Other>(cluster, baseline, &self.watcher_config)
            .flat_map(move |object| {
                let kind = kind.clone();
                let requests = mapper(&id, &object).into_iter();
                stream::iter(
                    requests.map(move |r| (r, ReconcileReason::RelatedObjectChanged(kind.clone()))),
                )
            })
            .boxed()
    }

    fn attach(
        &self,
        controller: kube_runtime::Controller<K>,
        cluster: &Cluster<C>,
    ) -> kube_runtime::Controller<K> {
        let id = cluster.id().clone();
        let mapper = self.mapper.clone();
        controller.watches(
            Api::<Other>::all(cluster.client()),
            self.watcher_config.clone(),
            move |obj: Other| {
                // One cluster: requests for any other id have nowhere to go.
                mapper(&id, &obj)
                    .into_iter()
                    .filter(|r| r.cluster == id)
                    .map(|r| r.object_ref::<K>())
                    .collect::<Vec<_>>()
            },
        )
    }
}
