//! [`WatchSource`]: where a cluster's watches get their events when not from a watch of its
//! own on its API server (a namespace of a host cluster shares the host's watches). Providers
//! implement it; the core knows nothing of them.

use std::any::{Any, TypeId};
use std::sync::Arc;

use futures::stream::BoxStream;
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Client;
use kube_runtime::watcher::{self, Event};
use tokio_util::sync::CancellationToken;

use super::listing::{self, Target, WatchOptions};
use super::map_event::{map_event, try_map_event};
use super::transform::Transform;
use crate::cache::Watchable;

/// An object of any watchable kind, as a shared source passes it on: its metadata, and the
/// typed object back for the cluster's watch.
pub(crate) trait AnyObject: Send + Sync + 'static {
    /// The object's metadata.
    fn meta(&self) -> &ObjectMeta;
    /// The typed object, for a downcast.
    fn into_any(self: Arc<Self>) -> Arc<dyn Any + Send + Sync>;
}

impl<K: Watchable> AnyObject for K {
    fn meta(&self) -> &ObjectMeta {
        kube::Resource::meta(self)
    }

    fn into_any(self: Arc<Self>) -> Arc<dyn Any + Send + Sync> {
        self
    }
}

/// An object of any kind, shared.
pub(crate) type SharedObject = Arc<dyn AnyObject>;

/// A watch of one kind with its objects erased.
pub(crate) type SharedEvents = BoxStream<'static, Result<Event<SharedObject>, watcher::Error>>;

/// Which watch a source is asked for: one kind and watcher configuration. Looked up on every
/// cache read, so it is a copy of the configuration (two short selectors at most), not its
/// text.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct WatchKey {
    pub(crate) kind: TypeId,
    /// `apiVersion/plural` of a kind known only at run time.
    pub(crate) resource: Option<Arc<str>>,
    pub(crate) config: watcher::Config,
}

impl WatchKey {
    /// The key of `K`'s watch for `config`. A kind known only at run time (a dynamic type
    /// other than `()`) is told apart from others of its Rust type by its API version and
    /// plural.
    pub(crate) fn of<K: Watchable>(dt: &K::DynamicType, config: &watcher::Config) -> Self {
        let resource = (TypeId::of::<K::DynamicType>() != TypeId::of::<()>())
            .then(|| Arc::from(format!("{}/{}", K::api_version(dt), K::plural(dt))));
        Self {
            kind: TypeId::of::<K>(),
            resource,
            config: config.clone(),
        }
    }
}

// `watcher::Config`'s equality compares strings, numbers and plain enums: an equivalence.
impl Eq for WatchKey {}

impl std::hash::Hash for WatchKey {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        // The selectors tell watches apart; the rest is compared on a collision only.
        self.kind.hash(state);
        self.resource.hash(state);
        self.config.label_selector.hash(state);
        self.config.field_selector.hash(state);
    }
}

/// A cluster's request for the events of one kind.
pub(crate) struct WatchRequest<'a> {
    /// The kind and configuration: equal keys may share one underlying watch.
    pub(crate) key: WatchKey,
    /// The kind's name, for logs.
    pub(crate) kind: &'a str,
    /// Opens the underlying watch (the kind, with the configuration) through a client; it
    /// waits out the manager's watch backoff after each failure.
    pub(crate) open: &'a (dyn Fn(Client) -> SharedEvents + Send + Sync),
    /// Cancelled when the requesting cluster's engagement ends; the source lets go of the
    /// subscription then.
    pub(crate) engagement: &'a CancellationToken,
}

/// Where a cluster's watches get their events, if not from a watch of their own.
pub(crate) trait WatchSource: Send + Sync + 'static {
    /// The events of the cluster's objects of the requested kind, for as long as the
    /// request's engagement lasts: a listing (`Init`, `InitApply`*, `InitDone`) as soon as
    /// the objects are known and after every relist, changes in between.
    fn events(&self, request: WatchRequest<'_>) -> BoxStream<'static, Event<SharedObject>>;
}

/// The events of `K` objects matching `config` from `source`, typed again.
/// The watch is of the host's objects in the namespaces the settings give `K`.
pub(crate) fn events_from<K: Watchable>(
    source: &dyn WatchSource,
    dt: &K::DynamicType,
    config: &watcher::Config,
    transform: Option<Transform<K>>,
    settings: &super::watch::WatchSettings,
    engagement: &CancellationToken,
) -> BoxStream<'static, Event<Arc<K>>> {
    let watch_config = config.clone();
    let backoff = settings.backoff.clone();
    let streaming = !settings.paged_lists;
    let namespaces = settings.namespaces.of::<K>(dt);
    let target_dt = dt.clone();
    let open = move |client: Client| -> SharedEvents {
        // Each namespace waits out its own failures (the host watch has no other backoff).
        let options = WatchOptions {
            streaming,
            trim: transform.as_ref().is_some_and(Transform::strips),
            cluster: "the namespace provider's host".into(),
        };
        listing::shared(
            Target::<K>::all(client, &target_dt),
            namespaces.clone(),
            watch_config.clone(),
            &options,
            &backoff,
            transform.clone(),
        )
        .map_ok(|event| map_event(event, |o: Arc<K>| o as SharedObject))
        .boxed()
    };
    let kind = K::kind(dt);
    source
        .events(WatchRequest {
            key: WatchKey::of::<K>(dt, config),
            kind: &kind,
            open: &open,
            engagement,
        })
        .filter_map(|event| {
            std::future::ready(try_map_event(event, |o| {
                // The source's own Arc: the cluster's store shares the object, not a copy.
                o.into_any().downcast::<K>().ok()
            }))
        })
        .boxed()
}
