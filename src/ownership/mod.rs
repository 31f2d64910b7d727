//! Ownership across clusters: a child in one cluster that belongs to an object in another.
//!
//! A native `ownerReferences` entry only works inside one cluster: the garbage collector of
//! the child's cluster looks the owner's uid up there, does not find it, and deletes the
//! child. [`Context::own`](crate::Context::own) records the owner on the child instead (an
//! annotation naming the owner's cluster, kind, namespace, name and uid, and a label to find
//! the owner's children by); [`Builder::owns_in_fleet`](crate::Builder::owns_in_fleet)
//! reconciles the owner when such a child changes and, when asked, deletes the children when
//! the owner goes ([`FleetGc`]). Every cluster client the crate builds refuses to send a native
//! reference to a uid its cluster does not hold ([`OwnerReferenceRefused`]).
//!
//! Trust: whoever may write a child may write its annotation. A child that names an owner it
//! does not belong to gets that owner reconciled (a request, nothing more), and is deleted
//! when that owner goes: it could have been deleted by its writer anyway. The collector
//! deletes only objects that carry the annotation, in the cluster they are in, and only
//! after it read the owner gone (or its cluster departed for good), never because the
//! owner's cluster cannot be reached.

pub(crate) mod gc;

use std::fmt;

use kube::Resource;
use serde::{Deserialize, Serialize};

use crate::cluster::ClusterId;

pub use crate::client::owners::OwnerReferenceRefused;
pub use gc::FleetGc;

/// The annotation that records a child's owner in the fleet (JSON: cluster, apiVersion, kind,
/// namespace, name, uid).
pub const OWNER_ANNOTATION: &str = "multicluster-runtime.io/owner";

/// The label that finds an owner's children: a digest of the owner's cluster, group, kind,
/// namespace and name ([`FleetOwner::label_value`]).
pub const OWNER_LABEL: &str = "multicluster-runtime.io/owner";

/// The finalizer that holds an owner while its children in other clusters are deleted
/// ([`FleetGc::Foreground`]).
pub const FLEET_FINALIZER: &str = "multicluster-runtime.io/fleet-children";

/// The longest annotation value read; a longer one is refused unread.
const MAX_ANNOTATION: usize = 2048;

/// An owner in the fleet, as a child records it: which cluster, and which object there.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FleetOwner<C> {
    /// The cluster the owner lives in.
    pub cluster: C,
    /// The owner's `apiVersion` (`v1`, `apps/v1`, `example.com/v1`).
    pub api_version: String,
    /// The owner's kind.
    pub kind: String,
    /// The owner's namespace; `None` for a cluster-scoped owner.
    pub namespace: Option<String>,
    /// The owner's name.
    pub name: String,
    /// The owner's uid: a child belongs to this incarnation of the owner only.
    pub uid: String,
}

/// Why an owner cannot be recorded, or a recorded owner cannot be read.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum OwnerError {
    /// The owner has no name or no uid yet (it was not read from a server).
    #[error(
        "the owner {kind} {name:?} has no {missing} yet: own a child by an object read from its cluster"
    )]
    Incomplete {
        /// The owner's kind.
        kind: String,
        /// The owner's name, if it has one.
        name: String,
        /// What is missing (`name`, `uid`).
        missing: &'static str,
    },
    /// The annotation on a child is not a record of an owner (by position, never quoting it).
    #[error("the {annotation} annotation is not an owner record: {reason}")]
    Malformed {
        /// The annotation's key.
        annotation: &'static str,
        /// What is wrong with it.
        reason: String,
    },
}

/// The annotation's JSON form.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Record<'a> {
    cluster: std::borrow::Cow<'a, str>,
    api_version: std::borrow::Cow<'a, str>,
    kind: std::borrow::Cow<'a, str>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    namespace: Option<std::borrow::Cow<'a, str>>,
    name: std::borrow::Cow<'a, str>,
    uid: std::borrow::Cow<'a, str>,
}

impl<C: ClusterId> FleetOwner<C> {
    /// The owner `owner`, an object of cluster `cluster` read from its server.
    pub fn of<K: Resource>(cluster: &C, owner: &K) -> Result<Self, OwnerError>
    where
        K::DynamicType: Default,
    {
        Self::of_with(cluster, owner, &K::DynamicType::default())
    }

    /// [`FleetOwner::of`] for a kind known at run time, of dynamic type `dt`.
    pub fn of_with<K: Resource>(
        cluster: &C,
        owner: &K,
        dt: &K::DynamicType,
    ) -> Result<Self, OwnerError> {
        let kind = K::kind(dt).to_string();
        let meta = owner.meta();
        let incomplete = |missing| OwnerError::Incomplete {
            kind: kind.clone(),
            name: meta.name.clone().unwrap_or_default(),
            missing,
        };
        let name = meta.name.clone().ok_or_else(|| incomplete("name"))?;
        let uid = meta.uid.clone().ok_or_else(|| incomplete("uid"))?;
        Ok(Self {
            cluster: cluster.clone(),
            api_version: K::api_version(dt).to_string(),
            kind,
            namespace: meta.namespace.clone(),
            name,
            uid,
        })
    }

    /// The annotation's value for this owner.
    pub fn annotation(&self) -> String {
        let cluster = self.cluster.to_string();
        let record = Record {
            cluster: cluster.as_str().into(),
            api_version: self.api_version.as_str().into(),
            kind: self.kind.as_str().into(),
            namespace: self.namespace.as_deref().map(Into::into),
            name: self.name.as_str().into(),
            uid: self.uid.as_str().into(),
        };
        // Strings always serialize.
        serde_json::to_string(&record).unwrap_or_default()
    }

    /// Reads an owner from an annotation's value. Anyone who may write the child may write
    /// it: it is checked as hostile input (its size, its fields, the cluster id's own
    /// parser), and errors say what is wrong without quoting it.
    pub fn parse(text: &str) -> Result<Self, OwnerError> {
        let malformed = |reason: String| OwnerError::Malformed {
            annotation: OWNER_ANNOTATION,
            reason,
        };
        if text.len() > MAX_ANNOTATION {
            return Err(malformed(format!(
                "{} bytes, more than the {MAX_ANNOTATION} read",
                text.len()
            )));
        }
        let record: Record<'_> = serde_json::from_str(text).map_err(|e| {
            malformed(format!(
                "not the JSON of an owner ({:?} at line {} column {})",
                e.classify(),
                e.line(),
                e.column()
            ))
        })?;
        let field = |name: &str, value: &str, max: usize| -> Result<(), OwnerError> {
            if value.is_empty() {
                return Err(malformed(format!("its {name} is empty")));
            }
            if value.len() > max {
                return Err(malformed(format!("its {name} is longer than {max} bytes")));
            }
            if value.chars().any(char::is_control) {
                return Err(malformed(format!("its {name} holds a control character")));
            }
            Ok(())
        };
        field("apiVersion", &record.api_version, 317)?;
        field("kind", &record.kind, 253)?;
        field("name", &record.name, 253)?;
        field("uid", &record.uid, 128)?;
        if let Some(namespace) = &record.namespace {
            field("namespace", namespace, 63)?;
        }
        // The collector puts these in request paths: only what an object can have, so that
        // no record changes a path or adds a query.
        use crate::client::owners::{is_api_version, is_path_safe_name};
        let shape = |name: &str, ok: bool| -> Result<(), OwnerError> {
            if ok {
                Ok(())
            } else {
                Err(malformed(format!(
                    "its {name} is not one an object can have"
                )))
            }
        };
        shape("apiVersion", is_api_version(&record.api_version))?;
        shape(
            "kind",
            record.kind.chars().all(|c| c.is_ascii_alphanumeric()),
        )?;
        shape("name", is_path_safe_name(&record.name))?;
        if let Some(namespace) = &record.namespace {
            shape(
                "namespace",
                namespace
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'),
            )?;
        }
        let cluster = C::parse(&record.cluster)
            .map_err(|_| malformed("its cluster is not a valid cluster id".into()))?;
        Ok(Self {
            cluster,
            api_version: record.api_version.into_owned(),
            kind: record.kind.into_owned(),
            namespace: record.namespace.map(|n| n.into_owned()),
            name: record.name.into_owned(),
            uid: record.uid.into_owned(),
        })
    }

    /// The owner recorded on `child`: `None` if it has no record, an error if the record is
    /// malformed.
    pub fn of_child<K: Resource>(child: &K) -> Option<Result<Self, OwnerError>> {
        let text = child.meta().annotations.as_ref()?.get(OWNER_ANNOTATION)?;
        Some(Self::parse(text))
    }

    /// The value of [`OWNER_LABEL`] on this owner's children: the first 20 bytes of the
    /// SHA-256 of its cluster, group, kind, namespace and name (not its uid: the children of
    /// every incarnation of a name are found together), in hex. A label value is at most 63
    /// characters of a restricted set; a digest fits whatever the ids hold.
    pub fn label_value(&self) -> String {
        let group = group_of(&self.api_version);
        let key = serde_json::json!([
            self.cluster.to_string(),
            group,
            self.kind,
            self.namespace.as_deref().unwrap_or(""),
            self.name,
        ]);
        let digest = ring::digest::digest(&ring::digest::SHA256, key.to_string().as_bytes());
        digest.as_ref()[..20]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    /// Records this owner on `child` (the annotation and the label), in place of any owner
    /// recorded before.
    pub fn record<K: Resource>(&self, child: &mut K) {
        let meta = child.meta_mut();
        meta.annotations
            .get_or_insert_with(Default::default)
            .insert(OWNER_ANNOTATION.to_string(), self.annotation());
        meta.labels
            .get_or_insert_with(Default::default)
            .insert(OWNER_LABEL.to_string(), self.label_value());
    }

    /// Whether the owner is of the kind `K` (same group and kind, any version).
    pub(crate) fn is_kind<K: Resource>(&self, dt: &K::DynamicType) -> bool {
        self.kind == K::kind(dt) && group_of(&self.api_version) == K::group(dt)
    }
}

/// The group of an `apiVersion` (empty for the core group's `v1`).
fn group_of(api_version: &str) -> &str {
    api_version.rsplit_once('/').map_or("", |(group, _)| group)
}

impl<C: ClusterId> fmt::Display for FleetOwner<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.namespace {
            Some(ns) => write!(
                f,
                "{} {}/{} in cluster {}",
                self.kind, ns, self.name, self.cluster
            ),
            None => write!(f, "{} {} in cluster {}", self.kind, self.name, self.cluster),
        }
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::api::ObjectMeta;

    use super::*;
    use crate::cluster::ClusterName;

    fn owner() -> FleetOwner<ClusterName> {
        FleetOwner {
            cluster: ClusterName::from("hub"),
            api_version: "example.com/v1".into(),
            kind: "Widget".into(),
            namespace: Some("team-a".into()),
            name: "w".into(),
            uid: "6b1c7a7e-0000-4000-8000-000000000001".into(),
        }
    }

    #[test]
    fn an_owner_survives_its_annotation_and_labels_its_child_with_a_valid_value() {
        let owner = owner();
        let mut child = ConfigMap::default();
        owner.record(&mut child);
        assert_eq!(FleetOwner::of_child(&child), Some(Ok(owner.clone())));
        let label = &child.metadata.labels.as_ref().unwrap()[OWNER_LABEL];
        assert_eq!(label.len(), 40);
        assert!(label.chars().all(|c| c.is_ascii_hexdigit()));
        // Another incarnation of the same name: same label, another record.
        let again = FleetOwner {
            uid: "other".into(),
            ..owner.clone()
        };
        assert_eq!(again.label_value(), owner.label_value());
        assert_ne!(again.annotation(), owner.annotation());
        // Another cluster: another label.
        let elsewhere = FleetOwner {
            cluster: ClusterName::from("hub2"),
            ..owner
        };
        assert_ne!(elsewhere.label_value(), again.label_value());
    }

    #[test]
    fn hostile_annotations_are_refused_without_being_quoted() {
        let secret = "s3cr3t-token-value";
        for text in [
            format!("{{\"token\":\"{secret}\"}}"),
            format!("not json {secret}"),
            format!(
                "{{\"cluster\":\"a\",\"apiVersion\":\"v1\",\"kind\":\"\",\"name\":\"{secret}\",\"uid\":\"u\"}}"
            ),
            format!(
                "{{\"cluster\":\"a\",\"apiVersion\":\"v1\",\"kind\":\"K\",\"name\":\"{secret}\u{0007}\",\"uid\":\"u\"}}"
            ),
            format!(
                "{{\"cluster\":\"a\",\"apiVersion\":\"v1\",\"kind\":\"K\",\"name\":\"{secret}\",\"uid\":\"\"}}"
            ),
            "x".repeat(MAX_ANNOTATION + 1),
            // Names that would change the collector's request path or query.
            format!(
                "{{\"cluster\":\"a\",\"apiVersion\":\"v1\",\"kind\":\"K\",\"name\":\"{secret}?watch=true\",\"uid\":\"u\"}}"
            ),
            format!(
                "{{\"cluster\":\"a\",\"apiVersion\":\"v1\",\"kind\":\"K\",\"name\":\"{secret}/status\",\"uid\":\"u\"}}"
            ),
            format!(
                "{{\"cluster\":\"a\",\"apiVersion\":\"v1\",\"kind\":\"K\",\"namespace\":\"../{secret}\",\"name\":\"n\",\"uid\":\"u\"}}"
            ),
            format!(
                "{{\"cluster\":\"a\",\"apiVersion\":\"v1/../{secret}\",\"kind\":\"K\",\"name\":\"n\",\"uid\":\"u\"}}"
            ),
        ] {
            let error = FleetOwner::<ClusterName>::parse(&text).unwrap_err();
            assert!(!error.to_string().contains(secret), "{error}");
        }
    }

    #[test]
    fn an_owner_without_a_uid_cannot_be_recorded() {
        let unsaved = ConfigMap {
            metadata: ObjectMeta {
                name: Some("new".into()),
                ..Default::default()
            },
            ..Default::default()
        };
        let error = FleetOwner::of(&ClusterName::from("a"), &unsaved).unwrap_err();
        assert!(matches!(
            error,
            OwnerError::Incomplete { missing: "uid", .. }
        ));
    }

    #[test]
    fn the_kind_check_ignores_the_version_not_the_group() {
        let mut owner = owner();
        owner.api_version = "v1".into();
        owner.kind = "ConfigMap".into();
        assert!(owner.is_kind::<ConfigMap>(&()));
        owner.api_version = "example.com/v1".into();
        assert!(!owner.is_kind::<ConfigMap>(&()));
    }
}
