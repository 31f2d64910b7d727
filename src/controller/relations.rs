//! Relations of a controller's primary kind to other objects (`owns`, `watches`), and the
//! change streams they are built on in fleet mode.

use std::collections::HashMap;
use std::sync::Arc;

use crate::cache::Store;
use futures::StreamExt;
use futures::stream::{self, BoxStream};
use kube::core::PartialObjectMeta;
use kube_runtime::WatchStreamExt;
use kube_runtime::reflector::ObjectRef;
use kube_runtime::watcher;

use super::{PredicateFn, ReconcileReason, Trigger};
use crate::cache::Watchable;
use crate::cache::listing::{Target, WatchOptions};
use crate::cache::namespaces::NamespaceScopes;
use crate::cache::{CacheError, Change, ObjectKey, listing};
use crate::cluster::Engagement;
use crate::cluster::{Cluster, ClusterId};
use crate::controller::Request;

/// A relation of the primary kind `K` to other objects (owned, watched), type-erased.
pub(crate) trait Relation<C: ClusterId, K>: Send + Sync {
    /// Requests this relation makes for `cluster` (fleet mode). `reference` is the last
    /// synced engagement of the id before this one, whose caches tell which listed objects
    /// did not change.
    fn triggers(
        &self,
        cluster: &Engagement<C>,
        reference: Option<&Engagement<C>>,
    ) -> Result<BoxStream<'static, Trigger<C>>, CacheError>;

    /// Starts the watch [`Relation::triggers`] will read in `cluster`, without reading it
    /// (warm standby).
    fn warm(&self, cluster: &Engagement<C>) -> Result<(), CacheError>;

    /// Adds the relation to a kube-runtime `Controller` (single-cluster mode). Children and
    /// other objects are watched with `options`, as [`listing::scoped`] does.
    fn attach(
        &self,
        controller: kube_runtime::Controller<K>,
        cluster: &Cluster<C>,
        namespaces: &NamespaceScopes,
        backoff: &crate::cache::WatchBackoff,
        options: &WatchOptions,
    ) -> kube_runtime::Controller<K>
    where
        K: Watchable;
}

/// What a cache held: each object's uid and resourceVersion, without the objects themselves.
pub(crate) struct Baseline<K: Watchable> {
    versions: HashMap<ObjectKey, (Option<String>, Option<String>)>,
    _kind: std::marker::PhantomData<fn() -> K>,
}

impl<K: Watchable> Baseline<K> {
    /// The versions in `store`, if there is one and it holds anything.
    pub(crate) fn of(store: Option<&Store<K>>) -> Option<Self> {
        let versions: HashMap<_, _> = store?
            .state()
            .iter()
            .map(|obj| {
                let meta = obj.meta();
                (
                    ObjectKey::of(&**obj),
                    (meta.uid.clone(), meta.resource_version.clone()),
                )
            })
            .collect();
        (!versions.is_empty()).then_some(Self {
            versions,
            _kind: std::marker::PhantomData,
        })
    }

    /// The versions in the synced cache of `X` for `config` in `engagement`.
    fn of_engagement<C: ClusterId>(
        engagement: Option<&Engagement<C>>,
        dt: &K::DynamicType,
        config: &watcher::Config,
    ) -> Option<Self> {
        let watch = engagement?.session.existing::<K>(dt, config)?;
        watch.is_synced().then(|| Self::of(Some(&watch.store)))?
    }
}

/// Whether `change` is the first listing's version of an object the reference cache already
/// held at the same uid and resourceVersion, so its change was seen there. The baseline is
/// needed only during that listing; it is dropped at the first later change.
pub(crate) fn seen_before<K: Watchable>(
    change: &Change<K>,
    baseline: &mut Option<Baseline<K>>,
) -> bool {
    if !change.initial {
        *baseline = None;
        return false;
    }
    let Some(baseline) = baseline else {
        return false;
    };
    let meta = change.object.meta();
    baseline
        .versions
        .get(&ObjectKey::of(&*change.object))
        .is_some_and(|(uid, rv)| *uid == meta.uid && *rv == meta.resource_version)
}

/// The objects of `X` in `cluster` as they change (deletions included, also those a relist
/// found), leaving out those of the first listing that the reference cache had already seen
/// at the same version, each with whether it is no news (listed unchanged: see
/// [`Change::listed`]). The watch for `config` is started on first use.
/// With a `predicate`, changes whose value for it did not change are left out too
/// (kube-runtime's filter, keyed by uid); deletions always pass.
pub(crate) fn fresh_changes<C: ClusterId, X: Watchable>(
    cluster: &Engagement<C>,
    reference: Option<&Engagement<C>>,
    dt: &X::DynamicType,
    config: &watcher::Config,
    predicate: Option<&PredicateFn<X>>,
) -> Result<BoxStream<'static, (Arc<X>, bool)>, CacheError> {
    let mut baseline = Baseline::of_engagement(reference, dt, config);
    let changes = cluster.watch::<X>(dt, config)?.subscribe();
    let changes = match predicate {
        Some(predicate) => filtered(changes.map(Ok::<_, watcher::Error>), predicate.clone())
            .filter_map(|c| std::future::ready(c.ok()))
            .boxed(),
        None => changes.boxed(),
    };
    Ok(changes
        .filter_map(move |change| {
            let fresh = !seen_before(&change, &mut baseline);
            std::future::ready(fresh.then_some((change.object, change.listed)))
        })
        .boxed())
}

/// `changes` through kube-runtime's predicate filter with `predicate`; deletions pass.
pub(crate) fn filtered<X: Watchable>(
    changes: impl futures::Stream<Item = watcher::Result<Change<X>>> + Send + 'static,
    predicate: PredicateFn<X>,
) -> impl futures::Stream<Item = watcher::Result<Change<X>>> + Send + 'static {
    changes.predicate_filter(
        move |change: &Change<X>| {
            // No value: always passes (a deletion must reach the owner or the mapper).
            (!change.deleted)
                .then(|| predicate(&change.object))
                .flatten()
        },
        kube_runtime::PredicateConfig::default(),
    )
}

/// The objects of `changes` again (each `Arc` is the only one: no copy is made).
pub(crate) fn unchanged<X: Watchable>(
    changes: impl futures::Stream<Item = watcher::Result<Change<X>>> + Send + 'static,
) -> impl futures::Stream<Item = watcher::Result<X>> + Send + 'static {
    changes.map(|change| change.map(|c| Arc::unwrap_or_clone(c.object)))
}

/// The changes a watcher's events show (a listing's objects, changes, deletions).
pub(crate) fn touched<X: Watchable>(
    events: impl futures::Stream<Item = watcher::Result<watcher::Event<X>>> + Send + 'static,
) -> impl futures::Stream<Item = watcher::Result<Change<X>>> + Send + 'static {
    events.filter_map(|event| {
        let change = |object: X, deleted| Change {
            object: Arc::new(object),
            deleted,
            initial: false,
            listed: false,
        };
        std::future::ready(match event {
            Ok(watcher::Event::Apply(o) | watcher::Event::InitApply(o)) => {
                Some(Ok(change(o, false)))
            }
            Ok(watcher::Event::Delete(o)) => Some(Ok(change(o, true))),
            Ok(watcher::Event::Init | watcher::Event::InitDone) => None,
            Err(error) => Some(Err(error)),
        })
    })
}

/// Why a change of a related `kind` queues a request: no news if it was `listed`.
fn related(kind: &Arc<str>, listed: bool) -> ReconcileReason {
    if listed {
        ReconcileReason::RelatedListed(kind.clone())
    } else {
        ReconcileReason::RelatedObjectChanged(kind.clone())
    }
}

/// `K` is reconciled when a `Child` it owns changes.
pub(crate) struct Owns<K: Watchable, Child: Watchable> {
    pub(crate) watcher_config: watcher::Config,
    /// The owners' dynamic type (to recognise their owner references).
    pub(crate) owner: K::DynamicType,
    pub(crate) child: Child::DynamicType,
    /// Only children whose value for it changed reconcile their owners.
    pub(crate) predicate: Option<PredicateFn<Child>>,
}

impl<C: ClusterId, K: Watchable, Child: Watchable> Relation<C, K> for Owns<K, Child> {
    fn warm(&self, cluster: &Engagement<C>) -> Result<(), CacheError> {
        cluster
            .watch::<Child>(&self.child, &self.watcher_config)
            .map(drop)
    }

    fn triggers(
        &self,
        cluster: &Engagement<C>,
        reference: Option<&Engagement<C>>,
    ) -> Result<BoxStream<'static, Trigger<C>>, CacheError> {
        let changes = fresh_changes::<C, Child>(
            cluster,
            reference,
            &self.child,
            &self.watcher_config,
            self.predicate.as_ref(),
        )?;
        let id = cluster.id().clone();
        let kind: Arc<str> = Arc::from(Child::kind(&self.child).as_ref());
        let owner = self.owner.clone();
        // kube-runtime's owner-reference mapping; the cluster id goes on afterwards.
        Ok(changes
            .flat_map(move |(child, listed)| {
                let meta = child.meta();
                let ns = meta.namespace.as_deref();
                let reason = related(&kind, listed);
                let id = &id;
                let owners: Vec<_> = meta
                    .owner_references
                    .iter()
                    .flatten()
                    .filter_map(|r| ObjectRef::<K>::from_owner_ref(ns, r, owner.clone()))
                    .map(|r| (Request::from_object_ref(id.clone(), r), reason.clone()))
                    .collect();
                stream::iter(owners)
            })
            .boxed())
    }

    fn attach(
        &self,
        controller: kube_runtime::Controller<K>,
        cluster: &Cluster<C>,
        namespaces: &NamespaceScopes,
        backoff: &crate::cache::WatchBackoff,
        options: &WatchOptions,
    ) -> kube_runtime::Controller<K> {
        if let Some(predicate) = &self.predicate {
            // The predicate reads whole children.
            let children = listing::scoped(
                Target::<Child>::all(cluster.requester(), &self.child),
                namespaces.of::<Child>(&self.child),
                self.watcher_config.clone(),
                options,
                backoff,
            );
            return controller.owns_stream_with(
                unchanged(filtered(touched(children), predicate.clone())),
                self.child.clone(),
            );
        }
        // Only the owner references matter here: the children's metadata, as kube-runtime's
        // own `Controller::owns` watches them.
        let children = listing::scoped(
            Target::<PartialObjectMeta<Child>>::all(cluster.requester(), &self.child),
            namespaces.of::<PartialObjectMeta<Child>>(&self.child),
            self.watcher_config.clone(),
            options,
            backoff,
        );
        controller.owns_stream_with(children.touched_objects(), self.child.clone())
    }
}

pub(crate) type Mapper<C, Other> = Arc<dyn Fn(&C, &Other) -> Vec<Request<C>> + Send + Sync>;

/// The requests a mapper returns are reconciled when an `Other` changes.
pub(crate) struct Watches<C: ClusterId, K: Watchable, Other: Watchable> {
    pub(crate) watcher_config: watcher::Config,
    pub(crate) mapper: Mapper<C, Other>,
    /// The primary kind's dynamic type (to look its objects up).
    pub(crate) primary: K::DynamicType,
    pub(crate) other: Other::DynamicType,
    /// Only objects whose value for it changed are mapped.
    pub(crate) predicate: Option<PredicateFn<Other>>,
}

impl<C: ClusterId, K: Watchable, Other: Watchable> Relation<C, K> for Watches<C, K, Other> {
    fn warm(&self, cluster: &Engagement<C>) -> Result<(), CacheError> {
        cluster
            .watch::<Other>(&self.other, &self.watcher_config)
            .map(drop)
    }

    fn triggers(
        &self,
        cluster: &Engagement<C>,
        reference: Option<&Engagement<C>>,
    ) -> Result<BoxStream<'static, Trigger<C>>, CacheError> {
        let id = cluster.id().clone();
        let mapper = self.mapper.clone();
        let kind: Arc<str> = Arc::from(Other::kind(&self.other).as_ref());
        Ok(fresh_changes::<C, Other>(
            cluster,
            reference,
            &self.other,
            &self.watcher_config,
            self.predicate.as_ref(),
        )?
        .flat_map(move |(object, listed)| {
            let reason = related(&kind, listed);
            let requests = mapper(&id, &object).into_iter();
            stream::iter(requests.map(move |r| (r, reason.clone())))
        })
        .boxed())
    }

    fn attach(
        &self,
        controller: kube_runtime::Controller<K>,
        cluster: &Cluster<C>,
        namespaces: &NamespaceScopes,
        backoff: &crate::cache::WatchBackoff,
        options: &WatchOptions,
    ) -> kube_runtime::Controller<K> {
        let id = cluster.id().clone();
        let mapper = self.mapper.clone();
        let others = listing::scoped(
            Target::<Other>::all(cluster.requester(), &self.other),
            namespaces.of::<Other>(&self.other),
            self.watcher_config.clone(),
            options,
            backoff,
        );
        let primary = self.primary.clone();
        let others = match &self.predicate {
            Some(predicate) => unchanged(filtered(touched(others), predicate.clone())).boxed(),
            None => others.touched_objects().boxed(),
        };
        controller.watches_stream_with(
            others,
            move |obj: Other| {
                // One cluster: requests for any other id have nowhere to go.
                mapper(&id, &obj)
                    .into_iter()
                    .filter(|r| r.cluster == id)
                    .map(|r| r.object_ref_with::<K>(primary.clone()))
                    .collect::<Vec<_>>()
            },
            self.other.clone(),
        )
    }
}
