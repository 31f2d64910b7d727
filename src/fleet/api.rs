//! [`FleetApi`]: one kube `Api` over the engaged clusters of a fleet, acting as one client:
//! reads and writes fanned out to every cluster (or a subset) with bounded concurrency and a
//! result per cluster, a watch that follows the fleet, and reads of the shared caches.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use futures::stream::{self, BoxStream};
use futures::{Future, Stream, StreamExt};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::core::NamespaceScope;
use kube::{Client, Resource};
use kube_runtime::watcher;
use serde::Serialize;

use crate::cache::{CacheError, Watchable};
use crate::cluster::{Cluster, ClusterId};
use crate::fleet::Fleet;

/// How many clusters a fan-out call talks to at once, by default.
pub const DEFAULT_FLEET_CONCURRENCY: usize = 16;
/// How long a fan-out call waits for one cluster, by default.
pub const DEFAULT_FLEET_TIMEOUT: Duration = Duration::from_secs(30);

/// Why one cluster's part of a [`FleetApi`] call failed. Always names the cluster.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FleetApiError {
    /// The API server answered with an error, or could not be reached.
    #[error("cluster {cluster}: {source}")]
    Api {
        /// The cluster.
        cluster: String,
        /// kube's error.
        #[source]
        source: kube::Error,
    },
    /// No answer within the call's timeout ([`FleetApi::timeout`]).
    #[error("cluster {cluster}: no answer within {timeout:?}")]
    Timeout {
        /// The cluster.
        cluster: String,
        /// The timeout.
        timeout: Duration,
    },
    /// The cluster asked for by id is not engaged in the fleet (or filtered out).
    #[error("cluster {cluster} is not engaged")]
    NotEngaged {
        /// The cluster.
        cluster: String,
    },
    /// A call on one object of a namespaced kind through [`FleetApi::all`]: such an object
    /// is reached through [`FleetApi::namespaced`].
    #[error(
        "cluster {cluster}: {kind} is namespaced: calls on one object need FleetApi::namespaced"
    )]
    NoNamespace {
        /// The cluster.
        cluster: String,
        /// The kind.
        kind: String,
    },
    /// A cached read failed (the cache is not there or stopped).
    #[error(transparent)]
    Cache(#[from] CacheError),
}

impl FleetApiError {
    /// The cluster the error is about.
    pub fn cluster(&self) -> &str {
        match self {
            Self::Api { cluster, .. }
            | Self::Timeout { cluster, .. }
            | Self::NotEngaged { cluster }
            | Self::NoNamespace { cluster, .. } => cluster,
            Self::Cache(
                CacheError::NotEngaged { cluster }
                | CacheError::NoRuntime { cluster }
                | CacheError::WatchFailed { cluster, .. }
                | CacheError::UnknownIndex { cluster, .. }
                | CacheError::NotSynced { cluster, .. },
            ) => cluster,
        }
    }
}

/// The outcome of a fan-out call: a result per cluster, by id. One cluster failing is an
/// error entry, never a failed call.
pub struct PerCluster<C: ClusterId, T> {
    results: BTreeMap<C, Result<T, FleetApiError>>,
}

impl<C: ClusterId, T: fmt::Debug> fmt::Debug for PerCluster<C, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.results.iter()).finish()
    }
}

impl<C: ClusterId, T> PerCluster<C, T> {
    /// The result of cluster `id`, if the call reached it.
    pub fn get(&self, id: &C) -> Option<&Result<T, FleetApiError>> {
        self.results.get(id)
    }

    /// Every result, by cluster id.
    pub fn iter(&self) -> impl Iterator<Item = (&C, &Result<T, FleetApiError>)> {
        self.results.iter()
    }

    /// The successful results.
    pub fn successes(&self) -> impl Iterator<Item = (&C, &T)> {
        self.results
            .iter()
            .filter_map(|(id, r)| r.as_ref().ok().map(|t| (id, t)))
    }

    /// The failures.
    pub fn errors(&self) -> impl Iterator<Item = &FleetApiError> {
        self.results.values().filter_map(|r| r.as_ref().err())
    }

    /// Whether every cluster succeeded.
    pub fn all_succeeded(&self) -> bool {
        self.results.values().all(Result::is_ok)
    }

    /// How many clusters the call reached.
    pub fn len(&self) -> usize {
        self.results.len()
    }

    /// Whether the call reached no cluster (none engaged, or all filtered out).
    pub fn is_empty(&self) -> bool {
        self.results.is_empty()
    }

    /// The results, by cluster id.
    pub fn into_results(self) -> BTreeMap<C, Result<T, FleetApiError>> {
        self.results
    }
}

impl<C: ClusterId, K> PerCluster<C, Vec<K>> {
    /// Every object listed, with its cluster (the failures left out: see
    /// [`PerCluster::errors`] first).
    pub fn objects(&self) -> Vec<(C, &K)> {
        self.successes()
            .flat_map(|(id, items)| items.iter().map(move |k| (id.clone(), k)))
            .collect()
    }
}

/// What a [`FleetApi`] can be made from: a [`Fleet`] or a reconciler's read-only
/// [`FleetView`](crate::FleetView). Sealed.
pub trait Members<C: ClusterId>: sealed::Sealed {
    /// The fleet. Callable only from within this crate (the token cannot be named outside
    /// it): a view never hands out the fleet's power to engage clusters.
    #[doc(hidden)]
    fn members(&self, _: sealed::Token) -> Fleet<C>;
}

mod sealed {
    pub trait Sealed {}
    /// Proves the caller is this crate.
    #[derive(Clone, Copy)]
    pub struct Token;
}

impl<C: ClusterId> sealed::Sealed for Fleet<C> {}
impl<C: ClusterId> Members<C> for Fleet<C> {
    fn members(&self, _: sealed::Token) -> Fleet<C> {
        self.clone()
    }
}

impl<C: ClusterId> sealed::Sealed for crate::fleet::FleetView<C> {}
impl<C: ClusterId> Members<C> for crate::fleet::FleetView<C> {
    fn members(&self, _: sealed::Token) -> Fleet<C> {
        self.fleet().clone()
    }
}

/// Builds the `Api` of a cluster, in a namespace or across all.
type MakeApi<K> = fn(Client, &<K as Resource>::DynamicType, Option<&str>) -> Api<K>;

fn across_all<K: Resource>(client: Client, dt: &K::DynamicType, _: Option<&str>) -> Api<K> {
    Api::all_with(client, dt)
}

fn within<K: Resource>(client: Client, dt: &K::DynamicType, ns: Option<&str>) -> Api<K>
where
    K::Scope: NamespaceScope,
{
    let api = Api::all_with(client, dt);
    match ns {
        Some(ns) => api.constrain(ns),
        None => api,
    }
}

/// Which clusters a [`FleetApi`] reaches.
type ClusterFilter<C> = Arc<dyn Fn(&Cluster<C>) -> bool + Send + Sync>;

/// One client over the engaged clusters of a fleet: kube's `Api<K>`, fanned out.
///
/// Calls without `_in` reach every engaged cluster (or those [`FleetApi::clusters`] keeps),
/// at most [`FleetApi::concurrency`] at once, each bounded by [`FleetApi::timeout`], and
/// return a [`PerCluster`] result: an unreachable or failing cluster is an error entry naming
/// it, and the others' results are there. Calls with `_in` reach one cluster by id.
/// [`FleetApi::watch`] follows the fleet as clusters join and leave; [`FleetApi::cached`]
/// reads the clusters' shared caches (once they have synced) instead of the API servers.
///
/// ```no_run
/// # use multicluster_runtime::{providers::Clusters, ClusterName, FleetApi, Manager};
/// # use k8s_openapi::api::core::v1::ConfigMap;
/// # async fn f(manager: Manager<Clusters<ClusterName>>) {
/// let configmaps = FleetApi::<_, ConfigMap>::namespaced(manager.fleet(), "default");
/// let listed = configmaps.list(&Default::default()).await;
/// for (cluster, cm) in listed.objects() {
///     println!("{cluster}: {:?}", cm.metadata.name);
/// }
/// for error in listed.errors() {
///     eprintln!("{error}"); // "cluster eu-1: ..."
/// }
/// # }
/// ```
pub struct FleetApi<C: ClusterId, K: Watchable> {
    fleet: Fleet<C>,
    dt: K::DynamicType,
    namespace: Option<String>,
    make: MakeApi<K>,
    filter: Option<ClusterFilter<C>>,
    concurrency: usize,
    timeout: Duration,
}

impl<C: ClusterId, K: Watchable> Clone for FleetApi<C, K> {
    fn clone(&self) -> Self {
        Self {
            fleet: self.fleet.clone(),
            dt: self.dt.clone(),
            namespace: self.namespace.clone(),
            make: self.make,
            filter: self.filter.clone(),
            concurrency: self.concurrency,
            timeout: self.timeout,
        }
    }
}

impl<C: ClusterId, K: Watchable> fmt::Debug for FleetApi<C, K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FleetApi")
            .field("kind", &K::kind(&self.dt))
            .field("namespace", &self.namespace)
            .field("filtered", &self.filter.is_some())
            .field("concurrency", &self.concurrency)
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl<C: ClusterId, K: Watchable> FleetApi<C, K>
where
    K::DynamicType: Default,
{
    /// `K` across all namespaces of every cluster (or cluster-scoped objects) of `fleet` (a
    /// [`Fleet`] or a [`FleetView`](crate::FleetView)). For a namespaced kind this lists,
    /// watches and reads caches across namespaces; calls on one object are refused
    /// ([`FleetApiError::NoNamespace`]): use [`FleetApi::namespaced`].
    pub fn all(fleet: &impl Members<C>) -> Self {
        Self::all_with(fleet, K::DynamicType::default())
    }

    /// `K` in namespace `ns` of every cluster.
    pub fn namespaced(fleet: &impl Members<C>, ns: &str) -> Self
    where
        K::Scope: NamespaceScope,
    {
        Self::namespaced_with(fleet, ns, K::DynamicType::default())
    }
}

impl<C: ClusterId, K: Watchable> FleetApi<C, K> {
    /// [`FleetApi::all`] for a kind known at run time.
    pub fn all_with(fleet: &impl Members<C>, dt: K::DynamicType) -> Self {
        Self {
            fleet: fleet.members(sealed::Token),
            dt,
            namespace: None,
            make: across_all::<K>,
            filter: None,
            concurrency: DEFAULT_FLEET_CONCURRENCY,
            timeout: DEFAULT_FLEET_TIMEOUT,
        }
    }

    /// [`FleetApi::namespaced`] for a kind known at run time.
    pub fn namespaced_with(fleet: &impl Members<C>, ns: &str, dt: K::DynamicType) -> Self
    where
        K::Scope: NamespaceScope,
    {
        Self {
            namespace: Some(ns.to_string()),
            make: within::<K>,
            ..Self::all_with(fleet, dt)
        }
    }

    /// Reaches only the engaged clusters `filter` accepts.
    #[must_use]
    pub fn clusters(
        mut self,
        filter: impl Fn(&Cluster<C>) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.filter = Some(Arc::new(filter));
        self
    }

    /// Talks to at most `n` clusters at once (at least 1); default
    /// [`DEFAULT_FLEET_CONCURRENCY`].
    #[must_use]
    pub fn concurrency(mut self, n: usize) -> Self {
        self.concurrency = n.max(1);
        self
    }

    /// Waits at most `timeout` for each cluster's answer (a frozen API server accepts
    /// connections and never answers); default [`DEFAULT_FLEET_TIMEOUT`].
    #[must_use]
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The engaged clusters this client reaches now.
    pub fn targets(&self) -> Vec<Cluster<C>> {
        let mut clusters = self.fleet.clusters();
        if let Some(filter) = &self.filter {
            clusters.retain(|c| filter(c));
        }
        clusters
    }

    /// kube's `Api` for `cluster`, in this client's namespace.
    pub fn api(&self, cluster: &Cluster<C>) -> Api<K> {
        (self.make)(cluster.client(), &self.dt, self.namespace.as_deref())
    }

    /// The engaged (and not filtered out) cluster `id`.
    fn target(&self, id: &C) -> Result<Cluster<C>, FleetApiError> {
        self.fleet
            .get(id)
            .filter(|c| self.filter.as_ref().is_none_or(|f| f(c)))
            .ok_or_else(|| FleetApiError::NotEngaged {
                cluster: id.to_string(),
            })
    }

    /// Whether calls on one object are refused: a namespaced kind (known at compile time)
    /// without a namespace would reach a cluster-wide URL, which serves lists and watches
    /// only (every object would look absent).
    fn needs_namespace(&self) -> bool {
        let namespaced = std::any::TypeId::of::<K::Scope>()
            == std::any::TypeId::of::<kube::core::NamespaceResourceScope>();
        namespaced && self.namespace.is_none()
    }

    /// The refusal of a call on one object in `cluster`.
    fn no_namespace(&self, cluster: &C) -> FleetApiError {
        FleetApiError::NoNamespace {
            cluster: cluster.to_string(),
            kind: K::kind(&self.dt).into_owned(),
        }
    }

    /// Every target's refusal of a call on one object, if calls on one object are refused.
    fn refused<T>(&self) -> Option<PerCluster<C, T>> {
        self.needs_namespace().then(|| PerCluster {
            results: self
                .targets()
                .into_iter()
                .map(|c| (c.id().clone(), Err(self.no_namespace(c.id()))))
                .collect(),
        })
    }

    /// The engaged cluster `id`, if a call on one object may be made there.
    fn target_for_object(&self, id: &C) -> Result<Cluster<C>, FleetApiError> {
        if self.needs_namespace() {
            return Err(self.no_namespace(id));
        }
        self.target(id)
    }

    /// `call` on `cluster`'s `Api`, bounded by the timeout, its errors naming the cluster.
    async fn one<T, Fut>(
        &self,
        cluster: &Cluster<C>,
        call: impl FnOnce(Api<K>) -> Fut,
    ) -> Result<T, FleetApiError>
    where
        Fut: Future<Output = Result<T, kube::Error>>,
    {
        let id = cluster.id().to_string();
        match tokio::time::timeout(self.timeout, call(self.api(cluster))).await {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(source)) => Err(FleetApiError::Api {
                cluster: id,
                source,
            }),
            Err(_) => Err(FleetApiError::Timeout {
                cluster: id,
                timeout: self.timeout,
            }),
        }
    }

    /// `call` on every target, at most `concurrency` at once.
    async fn fan_out<T, F, Fut>(&self, call: F) -> PerCluster<C, T>
    where
        F: Fn(Api<K>) -> Fut,
        Fut: Future<Output = Result<T, kube::Error>>,
    {
        let results = stream::iter(self.targets())
            .map(|cluster| {
                let call = &call;
                async move {
                    let result = self.one(&cluster, call).await;
                    (cluster.id().clone(), result)
                }
            })
            .buffer_unordered(self.concurrency)
            .collect()
            .await;
        PerCluster { results }
    }

    /// The objects matching `params` in every cluster.
    pub async fn list(&self, params: &ListParams) -> PerCluster<C, Vec<K>> {
        self.fan_out(|api| async move { api.list(params).await.map(|l| l.items) })
            .await
    }

    /// The object `name` in every cluster (`None` where there is none).
    pub async fn get(&self, name: &str) -> PerCluster<C, Option<K>> {
        if let Some(refused) = self.refused() {
            return refused;
        }
        self.fan_out(|api| async move { api.get_opt(name).await })
            .await
    }

    /// The object `name` in cluster `id`.
    pub async fn get_in(&self, id: &C, name: &str) -> Result<Option<K>, FleetApiError> {
        let cluster = self.target_for_object(id)?;
        self.one(&cluster, |api| async move { api.get_opt(name).await })
            .await
    }

    /// Creates `object` in every cluster.
    pub async fn create(&self, params: &PostParams, object: &K) -> PerCluster<C, K>
    where
        K: Serialize,
    {
        if let Some(refused) = self.refused() {
            return refused;
        }
        self.fan_out(|api| async move { api.create(params, object).await })
            .await
    }

    /// Creates `object` in cluster `id`.
    pub async fn create_in(
        &self,
        id: &C,
        params: &PostParams,
        object: &K,
    ) -> Result<K, FleetApiError>
    where
        K: Serialize,
    {
        let cluster = self.target_for_object(id)?;
        self.one(
            &cluster,
            |api| async move { api.create(params, object).await },
        )
        .await
    }

    /// Server-side applies `object` as `name` in every cluster, as field manager
    /// `field_manager` (taking conflicting fields over: the fleet's copy is this caller's).
    pub async fn apply(&self, name: &str, field_manager: &str, object: &K) -> PerCluster<C, K>
    where
        K: Serialize,
    {
        if let Some(refused) = self.refused() {
            return refused;
        }
        let params = PatchParams::apply(field_manager).force();
        let params = &params;
        self.fan_out(|api| async move { api.patch(name, params, &Patch::Apply(object)).await })
            .await
    }

    /// [`FleetApi::apply`] in cluster `id` only.
    pub async fn apply_in(
        &self,
        id: &C,
        name: &str,
        field_manager: &str,
        object: &K,
    ) -> Result<K, FleetApiError>
    where
        K: Serialize,
    {
        let cluster = self.target_for_object(id)?;
        let params = PatchParams::apply(field_manager).force();
        let params = &params;
        self.one(&cluster, |api| async move {
            api.patch(name, params, &Patch::Apply(object)).await
        })
        .await
    }

    /// Deletes the object `name` in every cluster. Each result says whether there was one
    /// (a cluster without it is not an error).
    pub async fn delete(&self, name: &str, params: &DeleteParams) -> PerCluster<C, bool> {
        if let Some(refused) = self.refused() {
            return refused;
        }
        self.fan_out(|api| async move { deleted(api.delete(name, params).await) })
            .await
    }

    /// Deletes the object `name` in cluster `id`; whether there was one.
    pub async fn delete_in(
        &self,
        id: &C,
        name: &str,
        params: &DeleteParams,
    ) -> Result<bool, FleetApiError> {
        let cluster = self.target_for_object(id)?;
        self.one(&cluster, |api| async move {
            deleted(api.delete(name, params).await)
        })
        .await
    }

    /// Watches `K` in every cluster this client reaches, as clusters join and leave: each
    /// event comes with its cluster's id; a cluster that joins later starts with a listing
    /// of its own (kube-runtime's watcher events, `Init` to `InitDone`), a cluster that
    /// leaves stops (when the stream is next polled: read it from a task of its own). A
    /// cluster's errors come through and its watch retries them on its own, with the
    /// manager's watch backoff, while the others go on. The stream ends when the run of the
    /// manager that owns the fleet ends (or the fleet is dropped).
    pub fn watch(
        &self,
        config: watcher::Config,
    ) -> impl Stream<Item = (C, Result<watcher::Event<K>, watcher::Error>)> + Send + 'static {
        let backoff = self.fleet.watch_backoff();
        let this = self.clone();
        self.fleet
            .engagements()
            .filter_map(move |engagement| {
                let keep = this.filter.as_ref().is_none_or(|f| f(&engagement.cluster));
                let watch: Option<BoxStream<'static, _>> = keep.then(|| {
                    let id = engagement.id().clone();
                    let until = engagement.session.token().clone().cancelled_owned();
                    let watch = watcher::watcher(this.api(&engagement.cluster), config.clone());
                    crate::cache::Retrying::new(watch, backoff.delays())
                        .take_until(until)
                        .map(move |event| (id.clone(), event))
                        .boxed()
                });
                std::future::ready(watch)
            })
            .flatten_unordered(None)
    }

    /// The objects in every cluster's shared cache of `K` for `config` (the one
    /// controllers and [`Cluster::cache`] read, started if need be), in this client's
    /// namespace; each cluster's once its cache has synced, or a timeout error after
    /// [`FleetApi::timeout`]. No API request is made when the caches are running.
    pub async fn cached(&self, config: &watcher::Config) -> PerCluster<C, Vec<Arc<K>>> {
        let results = stream::iter(self.targets())
            .map(|cluster| async move {
                let id = cluster.id().clone();
                let result = self.cached_in(&cluster, config).await;
                (id, result)
            })
            .buffer_unordered(self.concurrency)
            .collect()
            .await;
        PerCluster { results }
    }

    async fn cached_in(
        &self,
        cluster: &Cluster<C>,
        config: &watcher::Config,
    ) -> Result<Vec<Arc<K>>, FleetApiError> {
        let cache = tokio::time::timeout(self.timeout, cluster.cache_with::<K>(&self.dt, config))
            .await
            .map_err(|_| FleetApiError::Timeout {
                cluster: cluster.id().to_string(),
                timeout: self.timeout,
            })??;
        let namespace = self.namespace.as_deref();
        Ok(cache
            .store()
            .state_filter(|o| namespace.is_none() || o.meta().namespace.as_deref() == namespace))
    }
}

/// Whether a delete found something: a 404 is "nothing to delete".
fn deleted<T>(result: Result<T, kube::Error>) -> Result<bool, kube::Error> {
    match result {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(status)) if status.code == 404 => Ok(false),
        Err(error) => Err(error),
    }
}
