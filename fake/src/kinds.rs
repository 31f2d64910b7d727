//! The kinds a fake server serves: built-in ones from k8s-openapi and custom ones from CRDs.

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::{ClusterResourceScope, NamespaceResourceScope};

/// Whether a k8s-openapi kind lives in namespaces (implemented for the two scopes a kind the
/// server serves can have).
pub trait Scope {
    /// `true` for namespaced kinds.
    const NAMESPACED: bool;
}

impl Scope for NamespaceResourceScope {
    const NAMESPACED: bool = true;
}

impl Scope for ClusterResourceScope {
    const NAMESPACED: bool = false;
}

/// One resource the server serves (a group and a plural), in one or more versions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resource {
    /// The API group, empty for the core group.
    pub group: String,
    /// The versions served, the storage version first; none once a CRD is deleted.
    pub versions: Vec<String>,
    /// The version objects are kept in (kept when the versions stop being served).
    pub storage: String,
    /// The kind, as in `kind:`.
    pub kind: String,
    /// The plural, as in the URL.
    pub plural: String,
    /// The singular name, lower case.
    pub singular: String,
    /// Whether objects live in namespaces.
    pub namespaced: bool,
    /// Whether `.status` is written through the `/status` subresource only.
    pub status_subresource: bool,
    /// Whether `metadata.generation` counts changes of everything but metadata and status.
    pub generation: bool,
    /// Whether this is a custom resource (no strategic merge patch; items of lists carry
    /// their kind).
    pub custom: bool,
    /// For a built-in kind, the list fields merged by key in a strategic merge patch and
    /// tracked by key in managed fields: (field name, merge key).
    pub merge_keys: &'static [(&'static str, &'static str)],
    /// Whether a delete answers with the deleted object (otherwise with a `Status`).
    pub returns_deleted: bool,
}

impl Resource {
    /// The `apiVersion` of `version`.
    pub fn api_version(&self, version: &str) -> String {
        if self.group.is_empty() {
            version.to_owned()
        } else {
            format!("{}/{}", self.group, version)
        }
    }

    /// The storage version.
    pub fn storage_version(&self) -> &str {
        &self.storage
    }

    /// The name used in error messages: `configmaps`, `deployments.apps`.
    pub fn qualified(&self) -> String {
        if self.group.is_empty() {
            self.plural.clone()
        } else {
            format!("{}.{}", self.plural, self.group)
        }
    }

    /// A built-in kind of k8s-openapi.
    pub fn of<K>() -> Self
    where
        K: k8s_openapi::Resource,
        K::Scope: Scope,
    {
        let (status_subresource, generation) = builtin_traits(K::GROUP, K::KIND);
        Resource {
            group: K::GROUP.to_owned(),
            versions: vec![K::VERSION.to_owned()],
            storage: K::VERSION.to_owned(),
            kind: K::KIND.to_owned(),
            plural: K::URL_PATH_SEGMENT.to_owned(),
            singular: K::KIND.to_ascii_lowercase(),
            namespaced: <K::Scope as Scope>::NAMESPACED,
            status_subresource,
            generation,
            custom: false,
            merge_keys: builtin_merge_keys(K::KIND),
            returns_deleted: matches!((K::GROUP, K::KIND), ("", "Pod" | "ServiceAccount")),
        }
    }

    /// The custom resource a CRD defines, or `None` when it serves no version.
    pub fn from_crd(crd: &CustomResourceDefinition) -> Option<Self> {
        let spec = &crd.spec;
        let mut versions: Vec<_> = spec.versions.iter().filter(|v| v.served).collect();
        // The storage version first: it is the one objects are kept in.
        versions.sort_by_key(|v| !v.storage);
        let first = versions.first()?;
        let status_subresource = first
            .subresources
            .as_ref()
            .is_some_and(|s| s.status.is_some());
        Some(Resource {
            group: spec.group.clone(),
            versions: versions.iter().map(|v| v.name.clone()).collect(),
            storage: first.name.clone(),
            kind: spec.names.kind.clone(),
            plural: spec.names.plural.clone(),
            singular: spec
                .names
                .singular
                .clone()
                .unwrap_or_else(|| spec.names.kind.to_ascii_lowercase()),
            namespaced: spec.scope == "Namespaced",
            status_subresource,
            generation: true,
            custom: true,
            merge_keys: &[],
            returns_deleted: false,
        })
    }
}

/// Whether a built-in kind has a status subresource and counts its generation (the apiserver's
/// registry strategies; the kinds not named have neither).
fn builtin_traits(group: &str, kind: &str) -> (bool, bool) {
    match (group, kind) {
        ("", "Namespace")
        | ("", "Node")
        | ("", "PersistentVolume")
        | ("", "PersistentVolumeClaim") => (true, false),
        ("", "Pod") => (true, true),
        ("", "Service") | ("", "ReplicationController") => (true, true),
        ("apps", "Deployment" | "ReplicaSet" | "StatefulSet" | "DaemonSet") => (true, true),
        ("batch", "Job" | "CronJob") => (true, true),
        ("autoscaling", "HorizontalPodAutoscaler") => (true, true),
        ("policy", "PodDisruptionBudget") => (true, true),
        ("networking.k8s.io", "Ingress") => (true, true),
        ("networking.k8s.io", "NetworkPolicy") => (false, true),
        ("apiextensions.k8s.io", "CustomResourceDefinition") => (true, true),
        (
            "admissionregistration.k8s.io",
            "ValidatingWebhookConfiguration" | "MutatingWebhookConfiguration",
        ) => (false, true),
        _ => (false, false),
    }
}

/// The keyed lists of the built-in kinds a controller commonly writes.
fn builtin_merge_keys(kind: &str) -> &'static [(&'static str, &'static str)] {
    const POD_LIKE: &[(&str, &str)] = &[
        ("containers", "name"),
        ("initContainers", "name"),
        ("ephemeralContainers", "name"),
        ("volumes", "name"),
        ("env", "name"),
        ("ports", "containerPort"),
        ("volumeMounts", "mountPath"),
        ("volumeDevices", "devicePath"),
        ("imagePullSecrets", "name"),
        ("tolerations", ""),
        ("conditions", "type"),
        ("ownerReferences", "uid"),
        ("finalizers", ""),
    ];
    const SERVICE: &[(&str, &str)] = &[
        ("ports", "port"),
        ("conditions", "type"),
        ("ownerReferences", "uid"),
        ("finalizers", ""),
    ];
    const ANY: &[(&str, &str)] = &[
        ("conditions", "type"),
        ("ownerReferences", "uid"),
        ("finalizers", ""),
    ];
    match kind {
        "Pod"
        | "Deployment"
        | "ReplicaSet"
        | "StatefulSet"
        | "DaemonSet"
        | "Job"
        | "CronJob"
        | "ReplicationController"
        | "PodTemplate" => POD_LIKE,
        "Service" => SERVICE,
        _ => ANY,
    }
}

/// The kinds every fake server serves unless told otherwise: the core and workload kinds a
/// controller touches, events, leases, RBAC, webhooks and CRDs.
pub(crate) fn defaults() -> Vec<Resource> {
    use k8s_openapi::api::{admissionregistration, apps, batch, coordination, core, events, rbac};
    vec![
        Resource::of::<core::v1::Namespace>(),
        Resource::of::<core::v1::ConfigMap>(),
        Resource::of::<core::v1::Secret>(),
        Resource::of::<core::v1::ServiceAccount>(),
        Resource::of::<core::v1::Pod>(),
        Resource::of::<core::v1::Service>(),
        Resource::of::<core::v1::Event>(),
        Resource::of::<core::v1::Node>(),
        Resource::of::<apps::v1::Deployment>(),
        Resource::of::<apps::v1::ReplicaSet>(),
        Resource::of::<apps::v1::StatefulSet>(),
        Resource::of::<apps::v1::DaemonSet>(),
        Resource::of::<batch::v1::Job>(),
        Resource::of::<coordination::v1::Lease>(),
        Resource::of::<events::v1::Event>(),
        Resource::of::<rbac::v1::Role>(),
        Resource::of::<rbac::v1::RoleBinding>(),
        Resource::of::<rbac::v1::ClusterRole>(),
        Resource::of::<rbac::v1::ClusterRoleBinding>(),
        Resource::of::<admissionregistration::v1::ValidatingWebhookConfiguration>(),
        Resource::of::<admissionregistration::v1::MutatingWebhookConfiguration>(),
        Resource::of::<CustomResourceDefinition>(),
    ]
}

/// Every resource a server serves, found by group and plural or by group, version and kind.
#[derive(Clone, Debug, Default)]
pub(crate) struct Registry {
    resources: Vec<Resource>,
}

/// A resource's place in the registry (stable: resources are never removed, a CRD deleted is
/// only no longer served).
pub(crate) type ResourceId = usize;

impl Registry {
    pub(crate) fn add(&mut self, resource: Resource) -> ResourceId {
        if let Some(i) = self
            .resources
            .iter()
            .position(|r| r.group == resource.group && r.plural == resource.plural)
        {
            self.resources[i] = resource;
            return i;
        }
        self.resources.push(resource);
        self.resources.len() - 1
    }

    pub(crate) fn get(&self, id: ResourceId) -> &Resource {
        &self.resources[id]
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (ResourceId, &Resource)> {
        self.resources.iter().enumerate()
    }

    /// The resource at `/apis/{group}/{version}/{plural}` (or `/api/v1/{plural}`).
    pub(crate) fn find(&self, group: &str, version: &str, plural: &str) -> Option<ResourceId> {
        self.resources.iter().position(|r| {
            r.group == group && r.plural == plural && r.versions.iter().any(|v| v == version)
        })
    }

    /// The resource whose `apiVersion` and `kind` are these.
    pub(crate) fn by_kind(&self, api_version: &str, kind: &str) -> Option<ResourceId> {
        let (group, version) = api_version.rsplit_once('/').unwrap_or(("", api_version));
        self.resources.iter().position(|r| {
            r.group == group && r.kind == kind && r.versions.iter().any(|v| v == version)
        })
    }

    pub(crate) fn remove_versions(&mut self, group: &str, plural: &str) {
        if let Some(r) = self
            .resources
            .iter_mut()
            .find(|r| r.group == group && r.plural == plural)
        {
            r.versions.clear();
        }
    }
}
