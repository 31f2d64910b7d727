//! [`Watchable`]: what a kind must be for the crate to watch and cache it.

use std::fmt::Debug;
use std::hash::Hash;

use kube::Resource;
use serde::de::DeserializeOwned;

/// Everything a primary or related kind must be to be watched: a kube [`Resource`] whose
/// objects can be decoded and shared across tasks.
///
/// Kinds known at compile time (k8s-openapi's types, `#[derive(CustomResource)]` types) have
/// `()` as their dynamic type and need no more; kinds known only at run time
/// ([`DynamicObject`](kube::api::DynamicObject) with an [`ApiResource`](kube::api::ApiResource))
/// pass that dynamic type to the `_with` variants ([`Builder::new_with`],
/// [`Builder::owns_with`], [`Builder::watches_with`], [`Cluster::cache_with`](crate::Cluster::cache_with)).
pub trait Watchable:
    Resource<DynamicType: Clone + Eq + Hash + Debug + Unpin + Send + Sync + 'static, Scope: 'static>
    + Clone
    + DeserializeOwned
    + Debug
    + Send
    + Sync
    + 'static
{
}
impl<T> Watchable for T where
    T: Resource<
            DynamicType: Clone + Eq + Hash + Debug + Unpin + Send + Sync + 'static,
            Scope: 'static,
        > + Clone
        + DeserializeOwned
        + Debug
        + Send
        + Sync
        + 'static
{
}
