//! Requests that come from elsewhere than the watches of the controller's own clusters:
//! another fleet (a second provider's clusters), the manager's local cluster, or a stream the
//! user brings (`reconcile_on`, `owns_stream`, `watches_stream`). Each gives one stream of
//! requests per run of the controller, in both modes.

use std::sync::{Arc, Mutex};

use futures::StreamExt;
use futures::stream::{self, BoxStream};
use kube_runtime::watcher;

use super::relations;
use super::{ReconcileReason, Trigger};
use crate::cache::Watchable;
use crate::cluster::ClusterId;
use crate::cluster::Engagement;
use crate::controller::Request;
use crate::fleet::Fleet;
use crate::run::Env;
use crate::util::sync::lock;

/// A source of requests, type-erased.
pub(crate) trait RequestSource<C: ClusterId>: Send + Sync {
    /// The requests for one run of the controller; `None` if there are none for this run.
    fn triggers(&self, env: &Env<C>) -> Option<BoxStream<'static, Trigger<C>>>;
}

/// The objects of `X` in `engagement`'s shared watch as they change (deletions included),
/// each mapped to requests by `map`; empty if the engagement has ended.
fn mapped<D: ClusterId, X: Watchable, C: ClusterId>(
    engagement: &Engagement<D>,
    dt: &X::DynamicType,
    config: &watcher::Config,
    map: impl Fn(&D, &X) -> Vec<Request<C>> + Send + 'static,
    reason: ReconcileReason,
) -> BoxStream<'static, Trigger<C>> {
    let Ok(watch) = engagement.watch::<X>(dt, config) else {
        return stream::empty().boxed();
    };
    let id = engagement.id().clone();
    watch
        .subscribe()
        .flat_map(move |change| {
            let reason = reason.clone();
            stream::iter(
                map(&id, &change.object)
                    .into_iter()
                    .map(move |r| (r, reason.clone())),
            )
        })
        .boxed()
}

/// Maps an object of a cluster `D` to requests for clusters `C`.
pub(crate) type Mapper<D, Other, C> = Arc<dyn Fn(&D, &Other) -> Vec<Request<C>> + Send + Sync>;
/// Maps an object of the local cluster to requests.
pub(crate) type LocalMapper<C, Other> = Arc<dyn Fn(&Other) -> Vec<Request<C>> + Send + Sync>;

/// `Other` objects in the clusters of another fleet (another provider's), mapped to requests
/// for this controller's clusters. Ids of both fleets keep their own types.
pub(crate) struct FromFleet<D: ClusterId, C: ClusterId, Other: Watchable> {
    pub(crate) fleet: Fleet<D>,
    pub(crate) dt: Other::DynamicType,
    pub(crate) config: watcher::Config,
    pub(crate) mapper: Mapper<D, Other, C>,
}

impl<D: ClusterId, C: ClusterId, Other: Watchable> RequestSource<C> for FromFleet<D, C, Other> {
    fn triggers(&self, _: &Env<C>) -> Option<BoxStream<'static, Trigger<C>>> {
        let (dt, config, mapper) = (self.dt.clone(), self.config.clone(), self.mapper.clone());
        let kind: Arc<str> = Arc::from(Other::kind(&dt).as_ref());
        let engagements = self.fleet.engagements();
        // One subscription per engagement, read side by side; each ends with its
        // engagement (its watch stops).
        Some(
            engagements
                .map(move |engagement| {
                    let mapper = mapper.clone();
                    mapped(
                        &engagement,
                        &dt,
                        &config,
                        move |id: &D, obj: &Other| mapper(id, obj),
                        ReconcileReason::RelatedObjectChanged(kind.clone()),
                    )
                })
                .flatten_unordered(None)
                .boxed(),
        )
    }
}

/// `Other` objects in the manager's local cluster, mapped to requests.
pub(crate) struct FromLocal<C: ClusterId, Other: Watchable> {
    pub(crate) dt: Other::DynamicType,
    pub(crate) config: watcher::Config,
    pub(crate) mapper: LocalMapper<C, Other>,
}

impl<C: ClusterId, Other: Watchable> RequestSource<C> for FromLocal<C, Other> {
    fn triggers(&self, env: &Env<C>) -> Option<BoxStream<'static, Trigger<C>>> {
        let Some(engagement) = env.local.as_ref().and_then(|local| local.engagement()) else {
            tracing::warn!(
                kind = %Other::kind(&self.dt),
                "a relation watches the local cluster, which the manager does not have (Manager::with_local) or has not engaged; it is left out"
            );
            return None;
        };
        let mapper = self.mapper.clone();
        let kind: Arc<str> = Arc::from(Other::kind(&self.dt).as_ref());
        Some(mapped(
            &engagement,
            &self.dt,
            &self.config,
            move |_: &C, obj: &Other| mapper(obj),
            ReconcileReason::RelatedObjectChanged(kind),
        ))
    }
}

/// A stream the user brings. A run of the controller borrows it and gives it back when the
/// run ends, so the next run (leadership won again, the manager run again) goes on reading
/// it; a stream that ended is not given back.
pub(crate) struct Given<T> {
    stream: Arc<Mutex<Option<BoxStream<'static, T>>>>,
}

impl<T: Send + 'static> Given<T> {
    pub(crate) fn new(stream: BoxStream<'static, T>) -> Self {
        Self {
            stream: Arc::new(Mutex::new(Some(stream))),
        }
    }

    /// The stream for one run; `None` if another run holds it or it has ended.
    pub(crate) fn lend(&self) -> Option<BoxStream<'static, T>> {
        let stream = lock(&self.stream).take()?;
        Some(
            Lent {
                stream: Some(stream),
                home: self.stream.clone(),
            }
            .boxed(),
        )
    }
}

/// A [`Given`] stream lent to a run; it goes back when the run drops it.
struct Lent<T> {
    /// `None` once it ended.
    stream: Option<BoxStream<'static, T>>,
    home: Arc<Mutex<Option<BoxStream<'static, T>>>>,
}

impl<T> futures::Stream for Lent<T> {
    type Item = T;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<T>> {
        let Some(stream) = self.stream.as_mut() else {
            return std::task::Poll::Ready(None);
        };
        let item = std::task::ready!(stream.poll_next_unpin(cx));
        if item.is_none() {
            self.stream = None;
        }
        std::task::Poll::Ready(item)
    }
}

impl<T> Drop for Lent<T> {
    fn drop(&mut self) {
        if let Some(stream) = self.stream.take() {
            *lock(&self.home) = Some(stream);
        }
    }
}

impl<C: ClusterId> RequestSource<C> for Given<Trigger<C>> {
    fn triggers(&self, _: &Env<C>) -> Option<BoxStream<'static, Trigger<C>>> {
        self.lend()
    }
}

/// Requests for the owners of each `(cluster, child)` of `children`, for owners of the
/// dynamic type `owner`: kube-runtime's owner-reference mapping, cluster by cluster.
pub(crate) fn owners_of<C, K, Child>(
    children: impl futures::Stream<Item = (C, Arc<Child>)> + Send + 'static,
    owner: K::DynamicType,
    kind: Arc<str>,
) -> BoxStream<'static, Trigger<C>>
where
    C: ClusterId,
    K: Watchable,
    Child: Watchable,
{
    children
        .flat_map(move |(id, child)| {
            let meta = child.meta();
            let ns = meta.namespace.as_deref();
            let reason = ReconcileReason::RelatedObjectChanged(kind.clone());
            let requests: Vec<Trigger<C>> = meta
                .owner_references
                .iter()
                .flatten()
                .filter_map(|r| {
                    kube_runtime::reflector::ObjectRef::<K>::from_owner_ref(ns, r, owner.clone())
                })
                .map(|r| (Request::from_object_ref(id.clone(), r), reason.clone()))
                .collect();
            stream::iter(requests)
        })
        .boxed()
}

/// The requests `mapper` returns for each `(cluster, object)` of `objects`.
pub(crate) fn mapped_stream<C: ClusterId, Other: Watchable>(
    objects: impl futures::Stream<Item = (C, Arc<Other>)> + Send + 'static,
    kind: Arc<str>,
    mapper: relations::Mapper<C, Other>,
) -> BoxStream<'static, Trigger<C>> {
    objects
        .flat_map(move |(id, obj)| {
            let reason = ReconcileReason::RelatedObjectChanged(kind.clone());
            stream::iter(
                mapper(&id, &obj)
                    .into_iter()
                    .map(move |r| (r, reason.clone())),
            )
        })
        .boxed()
}
