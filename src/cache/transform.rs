//! What a cache keeps of each object: by default everything but `metadata.managedFields` and
//! the `kubectl.kubernetes.io/last-applied-configuration` annotation, then a manager's own
//! transform of the kind, if it has one (controller-runtime's cache `TransformFunc`).
//!
//! Both dropped parts are bookkeeping for writers (server-side apply, `kubectl apply`) that a
//! reconciler reading the cache does not use, and together they are most of a small object's
//! memory: a ConfigMap with two keys holds about 3 KiB of managed fields once decoded (each
//! `fieldsV1` node is a JSON map). An object is transformed once, when its watch receives it,
//! and the one transformed copy is shared by every store and reconcile that reads it.

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::sync::Arc;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use crate::cache::Watchable;

/// The annotation `kubectl apply` keeps the applied configuration in.
pub const LAST_APPLIED: &str = "kubectl.kubernetes.io/last-applied-configuration";

/// Drops what caches do not keep by default: `managedFields` and the last-applied annotation.
pub fn strip_managed_fields(meta: &mut ObjectMeta) {
    meta.managed_fields = None;
    if let Some(annotations) = &mut meta.annotations
        && annotations.remove(LAST_APPLIED).is_some()
        && annotations.is_empty()
    {
        meta.annotations = None;
    }
}

/// A user's transform of one kind.
type UserTransform<K> = Arc<dyn Fn(&mut K) + Send + Sync>;

/// The transforms of a manager's caches.
#[derive(Clone, Default)]
pub(crate) struct Transforms {
    /// Objects are cached whole (no default strip).
    pub(crate) keep_managed_fields: bool,
    /// `UserTransform<K>` by `K`.
    by_kind: HashMap<TypeId, Arc<dyn Any + Send + Sync>>,
}

impl std::fmt::Debug for Transforms {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transforms")
            .field("keep_managed_fields", &self.keep_managed_fields)
            .field("kinds", &self.by_kind.len())
            .finish()
    }
}

impl Transforms {
    /// Sets the transform of `K` (replacing an earlier one).
    pub(crate) fn set<K: Watchable>(&mut self, transform: impl Fn(&mut K) + Send + Sync + 'static) {
        let transform: UserTransform<K> = Arc::new(transform);
        self.by_kind.insert(TypeId::of::<K>(), Arc::new(transform));
    }

    /// What a watch of `K` does to each object it receives; `None` when it keeps them as
    /// they came.
    pub(crate) fn of<K: Watchable>(&self) -> Option<Transform<K>> {
        let user = self
            .by_kind
            .get(&TypeId::of::<K>())
            .and_then(|t| t.downcast_ref::<UserTransform<K>>())
            .cloned();
        if self.keep_managed_fields && user.is_none() {
            return None;
        }
        Some(Transform {
            strip: !self.keep_managed_fields,
            user,
        })
    }
}

/// The transform of one kind, resolved once per watch.
pub(crate) struct Transform<K> {
    strip: bool,
    user: Option<UserTransform<K>>,
}

impl<K> Clone for Transform<K> {
    fn clone(&self) -> Self {
        Self {
            strip: self.strip,
            user: self.user.clone(),
        }
    }
}

impl<K: Watchable> Transform<K> {
    /// Whether managed fields are dropped (so they need not be decoded).
    pub(crate) fn strips(&self) -> bool {
        self.strip
    }

    pub(crate) fn apply(&self, object: &mut K) {
        if self.strip {
            strip_managed_fields(kube::Resource::meta_mut(object));
        }
        if let Some(user) = &self.user {
            user(object);
        }
    }
}

/// `object`, decoded into its own [`Arc`], transformed in place to share (`make_mut` copies
/// nothing: the decoder's is the only reference).
pub(crate) fn shared<K: Watchable>(mut object: Arc<K>, transform: Option<&Transform<K>>) -> Arc<K> {
    if let Some(transform) = transform {
        transform.apply(Arc::make_mut(&mut object));
    }
    object
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::ConfigMap;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ManagedFieldsEntry;
    use std::collections::BTreeMap;

    fn configmap() -> ConfigMap {
        ConfigMap {
            metadata: ObjectMeta {
                name: Some("a".into()),
                managed_fields: Some(vec![ManagedFieldsEntry {
                    manager: Some("kubectl".into()),
                    ..Default::default()
                }]),
                annotations: Some(BTreeMap::from([
                    (LAST_APPLIED.to_string(), "{}".to_string()),
                    ("keep".to_string(), "me".to_string()),
                ])),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    #[test]
    fn the_default_drops_managed_fields_and_the_last_applied_annotation_only() {
        let transform = Transforms::default().of::<ConfigMap>().unwrap();
        let mut cm = configmap();
        transform.apply(&mut cm);
        assert_eq!(cm.metadata.managed_fields, None);
        assert_eq!(
            cm.metadata.annotations,
            Some(BTreeMap::from([("keep".to_string(), "me".to_string())]))
        );
        assert_eq!(cm.metadata.name.as_deref(), Some("a"));
    }

    #[test]
    fn keeping_managed_fields_without_a_transform_leaves_objects_alone() {
        let transforms = Transforms {
            keep_managed_fields: true,
            ..Default::default()
        };
        assert!(transforms.of::<ConfigMap>().is_none());
    }

    #[test]
    fn a_kinds_own_transform_runs_after_the_default_and_only_for_its_kind() {
        let mut transforms = Transforms::default();
        transforms.set(|cm: &mut ConfigMap| {
            let seen = cm.metadata.managed_fields.is_some();
            cm.data = Some(BTreeMap::from([(
                "saw-managed-fields".into(),
                seen.to_string(),
            )]));
        });
        let mut cm = configmap();
        transforms.of::<ConfigMap>().unwrap().apply(&mut cm);
        assert_eq!(
            cm.data.unwrap()["saw-managed-fields"],
            "false",
            "the default ran first"
        );
        let secret = transforms
            .of::<k8s_openapi::api::core::v1::Secret>()
            .unwrap();
        assert!(secret.user.is_none());
    }
}
