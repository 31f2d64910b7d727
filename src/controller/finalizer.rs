//! kube-runtime's finalizer helper with this crate's [`Action`]: the same protocol (the
//! finalizer added before the first `Apply`, `Cleanup` once the object is being deleted,
//! the finalizer removed when cleanup succeeds), for reconcilers of either mode.

use std::fmt::Debug;
use std::future::Future;
use std::sync::Arc;

use kube::{Api, Resource};
use serde::Serialize;
use serde::de::DeserializeOwned;

pub use kube::runtime::finalizer::{Error, Event};

use crate::controller::Action;

/// Runs `reconcile` behind the finalizer `finalizer_name` on `obj`, as kube-runtime's
/// `finalizer` does, with `reconcile` returning this crate's [`Action`] (the one a
/// [`Builder`](crate::Builder) reconciler returns). Where kube-runtime's helper acts without
/// calling `reconcile` (adding or removing the finalizer), the action is
/// [`Action::await_change`]: the change it makes triggers the next reconcile.
///
/// ```no_run
/// # use std::sync::Arc;
/// # use k8s_openapi::api::core::v1::ConfigMap;
/// # use kube::Api;
/// use multicluster_runtime::finalizer::{Event, finalizer};
/// use multicluster_runtime::{Action, ClusterName, Context};
///
/// async fn reconcile(cm: Arc<ConfigMap>, ctx: Context<ClusterName, ()>) -> Result<Action, multicluster_runtime::finalizer::Error<kube::Error>> {
///     let ns = cm.metadata.namespace.clone().unwrap_or_default();
///     let api: Api<ConfigMap> = Api::namespaced(ctx.client(), &ns);
///     finalizer(&api, "example.com/cleanup", cm, |event| async move {
///         match event {
///             Event::Apply(_) => Ok::<_, kube::Error>(Action::await_change()),
///             Event::Cleanup(_) => Ok(Action::await_change()),
///         }
///     })
///     .await
/// }
/// ```
pub async fn finalizer<K, F, Fut, E>(
    api: &Api<K>,
    finalizer_name: &str,
    obj: Arc<K>,
    reconcile: F,
) -> Result<Action, Error<E>>
where
    K: Resource + Clone + DeserializeOwned + Serialize + Debug,
    F: FnOnce(Event<K>) -> Fut,
    Fut: Future<Output = Result<Action, E>>,
    E: std::error::Error + 'static,
{
    let mut chosen = None;
    let slot = &mut chosen;
    kube::runtime::finalizer::finalizer(api, finalizer_name, obj, |event| {
        let work = reconcile(event);
        async move {
            let action = work.await?;
            *slot = Some(action);
            Ok::<_, E>(kube::runtime::controller::Action::from(action))
        }
    })
    .await?;
    Ok(chosen.unwrap_or_else(Action::await_change))
}
