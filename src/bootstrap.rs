//! What a member needs before a controller can run there ([`Manager::install`]): a
//! [`Bundle`] of CRDs and objects applied in every engaged cluster, kept true while it stays,
//! and removed when it leaves for good if the bundle says so.
//!
//! [`Manager::install`]: crate::Manager::install

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, Patch, PatchParams,
    Preconditions,
};
use kube::discovery::Scope;
use kube_runtime::watcher;
use tokio_util::sync::CancellationToken;

use crate::cluster::{Cluster, ClusterId};
use crate::fleet::FleetEvent;
use crate::run::Env;

/// The label every object of a bundle carries: the bundle's name.
pub const BUNDLE_LABEL: &str = "multicluster-runtime.io/bundle";

/// How often a bundle is applied again in full, beside the repairs its watches start.
pub const DEFAULT_REAPPLY: Duration = Duration::from_secs(600);

/// Why a bundle cannot be built.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BundleError {
    /// The bundle's name is not a valid label value (at most 63 letters, digits, `-`, `_`
    /// and `.`, starting and ending with a letter or digit).
    #[error("bundle name {0:?} is not a valid label value")]
    InvalidName(String),
    /// An object has no `apiVersion`, `kind` or name, or does not serialize.
    #[error("object {index} of bundle {bundle}: {reason}")]
    InvalidObject {
        /// The bundle.
        bundle: String,
        /// The object's position in the bundle, from 0.
        index: usize,
        /// What is wrong.
        reason: String,
    },
}

/// CRDs and objects every engaged cluster should have ([`Manager::install`]).
///
/// Each object is applied with server-side apply, field manager
/// `multicluster-runtime-bundle-<name>`, forced (the bundle owns the fields it sets), and
/// labelled [`BUNDLE_LABEL`]. CRDs go first, and the other objects once they are
/// `Established`, in the order given: put a Namespace before what it holds.
///
/// [`Manager::install`]: crate::Manager::install
#[derive(Clone, Debug)]
pub struct Bundle {
    name: String,
    crds: Vec<DynamicObject>,
    objects: Vec<DynamicObject>,
    remove_on_departure: bool,
    reapply: Duration,
}

impl Bundle {
    /// An empty bundle called `name` (a label value: its objects carry it).
    pub fn new(name: &str) -> Result<Self, BundleError> {
        let valid = !name.is_empty()
            && name.len() <= 63
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
            && name.starts_with(|c: char| c.is_ascii_alphanumeric())
            && name.ends_with(|c: char| c.is_ascii_alphanumeric());
        if !valid {
            return Err(BundleError::InvalidName(name.to_string()));
        }
        Ok(Self {
            name: name.to_string(),
            crds: Vec::new(),
            objects: Vec::new(),
            remove_on_departure: false,
            reapply: DEFAULT_REAPPLY,
        })
    }

    /// Adds `object` (a CRD, or any object with its `apiVersion` and `kind`).
    pub fn with<K>(self, object: &K) -> Result<Self, BundleError>
    where
        K: kube::Resource + serde::Serialize,
        K::DynamicType: Default,
    {
        let dt = K::DynamicType::default();
        let index = self.crds.len() + self.objects.len();
        let invalid = |reason: String| BundleError::InvalidObject {
            bundle: self.name.clone(),
            index,
            reason,
        };
        let mut value = serde_json::to_value(object).map_err(|e| invalid(e.to_string()))?;
        if let Some(map) = value.as_object_mut() {
            map.insert("apiVersion".into(), K::api_version(&dt).into());
            map.insert("kind".into(), K::kind(&dt).into());
        }
        let object: DynamicObject =
            serde_json::from_value(value).map_err(|e| invalid(e.to_string()))?;
        self.push(object)
    }

    /// Adds an object given as a `DynamicObject` (its `types` set).
    pub fn with_dynamic(self, object: DynamicObject) -> Result<Self, BundleError> {
        self.push(object)
    }

    fn push(mut self, mut object: DynamicObject) -> Result<Self, BundleError> {
        let index = self.crds.len() + self.objects.len();
        let invalid = |reason: &str| BundleError::InvalidObject {
            bundle: self.name.clone(),
            index,
            reason: reason.to_string(),
        };
        let types = object
            .types
            .clone()
            .ok_or_else(|| invalid("no apiVersion and kind"))?;
        if object
            .metadata
            .name
            .as_deref()
            .unwrap_or_default()
            .is_empty()
        {
            return Err(invalid("no name"));
        }
        object
            .metadata
            .labels
            .get_or_insert_with(Default::default)
            .insert(BUNDLE_LABEL.to_string(), self.name.clone());
        // Server-side apply refuses these.
        object.metadata.resource_version = None;
        object.metadata.uid = None;
        object.metadata.managed_fields = None;
        object.metadata.creation_timestamp = None;
        if is_crd(&types.api_version, &types.kind) {
            self.crds.push(object);
        } else {
            self.objects.push(object);
        }
        Ok(self)
    }

    /// Whether the bundle's objects are deleted from a cluster that leaves the fleet for
    /// good ([`Fleet::disengage`](crate::Fleet::disengage)); off by default: a departed
    /// member keeps what was installed. Only objects that still carry the bundle's label are
    /// deleted, CRDs last (deleting a CRD deletes every object of its kind).
    pub fn remove_on_departure(mut self, yes: bool) -> Self {
        self.remove_on_departure = yes;
        self
    }

    /// How often the bundle is applied again in full in each cluster, beside the repairs its
    /// watches start when an object is changed or deleted ([`DEFAULT_REAPPLY`]).
    pub fn reapply_every(mut self, every: Duration) -> Self {
        self.reapply = every.max(Duration::from_secs(1));
        self
    }

    /// The bundle's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The names (`<plural>.<group>`) of the bundle's CRDs.
    pub(crate) fn crd_names(&self) -> Vec<String> {
        self.crds
            .iter()
            .filter_map(|crd| crd.metadata.name.clone())
            .collect()
    }

    fn field_manager(&self) -> String {
        format!("multicluster-runtime-bundle-{}", self.name)
    }

    fn selector(&self) -> watcher::Config {
        watcher::Config::default().labels(&format!("{BUNDLE_LABEL}={}", self.name))
    }
}

fn is_crd(api_version: &str, kind: &str) -> bool {
    kind == "CustomResourceDefinition" && api_version.starts_with("apiextensions.k8s.io/")
}

/// Where an object of a bundle is served in one cluster.
#[derive(Clone)]
struct Served {
    resource: ApiResource,
    namespaced: bool,
}

/// The installer of one bundle, for one run of the manager.
pub(crate) struct Installer {
    bundle: Bundle,
}

impl Installer {
    pub(crate) fn new(bundle: Bundle) -> Self {
        Self { bundle }
    }

    /// Installs and keeps the bundle in each engaged cluster; removes it from departed ones
    /// when the bundle says so.
    pub(crate) async fn run<C: ClusterId>(self: Arc<Self>, env: Env<C>) {
        let fleet = env.fleet.clone();
        let shutdown = env.shutdown.clone();
        let this = self.clone();
        let task = crate::run::cluster_task::boxed(move |cluster: Cluster<C>, until| {
            this.clone().keep(cluster, until)
        });
        let name: Arc<str> = Arc::from(format!("bundle {}", self.bundle.name));
        let clusters = crate::run::cluster_task::run(env, name, task);
        let departures = async {
            if !self.bundle.remove_on_departure {
                return;
            }
            let mut events = fleet.subscribe();
            loop {
                let event = tokio::select! {
                    () = shutdown.cancelled() => return,
                    event = events.recv() => match event { Some(e) => e, None => return },
                };
                if let FleetEvent::Departed(cluster) = event {
                    self.remove(&cluster).await;
                }
            }
        };
        tokio::join!(clusters, departures);
    }

    /// Applies the bundle in `cluster` (again until it succeeds), then repairs what is
    /// changed or deleted, until the engagement ends.
    async fn keep<C: ClusterId>(self: Arc<Self>, cluster: Cluster<C>, until: CancellationToken) {
        let name = &self.bundle.name;
        let mut served = HashMap::new();
        let mut delay = Duration::from_secs(1);
        loop {
            match self.apply_all(&cluster, &mut served, &until).await {
                Ok(()) => {
                    tracing::info!(bundle = %name, cluster = %cluster.id(), "bundle installed");
                    break;
                }
                Err(reason) => {
                    tracing::warn!(bundle = %name, cluster = %cluster.id(), %reason, retry_in = ?delay, "bundle not installed yet");
                }
            }
            tokio::select! {
                () = until.cancelled() => return,
                () = tokio::time::sleep(delay) => {}
            }
            delay = (delay * 2).min(Duration::from_secs(60));
        }
        // One watch per kind of the bundle, of its labelled objects: a change or a deletion
        // by anyone applies that object again.
        let mut changes = futures::stream::SelectAll::new();
        for served in served.values() {
            match cluster.changes::<DynamicObject>(&served.resource, &self.bundle.selector()) {
                Ok(stream) => changes.push(stream),
                Err(error) => {
                    tracing::debug!(bundle = %name, cluster = %cluster.id(), %error, "bundle not watched");
                    return;
                }
            }
        }
        let mut full = tokio::time::interval(self.bundle.reapply);
        full.reset();
        // A full apply after a failure (1 s, doubling to a minute), or soon after a repair
        // that came too quickly after the last one (a field another manager fights over).
        let mut again: Option<(tokio::time::Instant, Duration)> = None;
        let mut repaired: HashMap<String, tokio::time::Instant> = HashMap::new();
        loop {
            let due = again.map(|(at, _)| at);
            tokio::select! {
                () = until.cancelled() => return,
                _ = full.tick() => {
                    if let Err(reason) = self.apply_all(&cluster, &mut served, &until).await {
                        tracing::warn!(bundle = %name, cluster = %cluster.id(), %reason, "bundle not applied again");
                        again = Some(later(again));
                    }
                }
                () = sleep_until(due), if due.is_some() => {
                    match self.apply_all(&cluster, &mut served, &until).await {
                        Ok(()) => again = None,
                        Err(reason) => {
                            tracing::warn!(bundle = %name, cluster = %cluster.id(), %reason, "bundle not applied again");
                            again = Some(later(again));
                        }
                    }
                }
                change = changes.next(), if !changes.is_empty() => {
                    let Some(change) = change else { continue };
                    if change.initial {
                        continue;
                    }
                    let object = &change.object;
                    let wanted = self.bundle.crds.iter().chain(&self.bundle.objects).find(|o| {
                        o.types == object.types
                            && o.metadata.name == object.metadata.name
                            && o.metadata.namespace == object.metadata.namespace
                    });
                    let Some(wanted) = wanted else { continue };
                    let key = format!("{:?}/{:?}/{:?}", wanted.types, wanted.metadata.namespace, wanted.metadata.name);
                    let now = tokio::time::Instant::now();
                    if repaired.get(&key).is_some_and(|at| now.duration_since(*at) < Duration::from_secs(1)) {
                        again.get_or_insert((now + Duration::from_secs(1), Duration::from_secs(1)));
                        continue;
                    }
                    repaired.insert(key, now);
                    match self.apply(&cluster, &mut served, wanted).await {
                        Ok(()) => {
                            if change.deleted {
                                tracing::info!(bundle = %name, cluster = %cluster.id(), object = %wanted.metadata.name.as_deref().unwrap_or_default(), "bundle object put back after its deletion");
                            }
                        }
                        Err(reason) => {
                            tracing::warn!(bundle = %name, cluster = %cluster.id(), %reason, "bundle object not repaired");
                            again = Some(later(again));
                        }
                    }
                }
            }
        }
    }

    /// Applies every object: the CRDs, then (once they are established) the rest.
    async fn apply_all<C: ClusterId>(
        &self,
        cluster: &Cluster<C>,
        served: &mut HashMap<(String, String), Served>,
        until: &CancellationToken,
    ) -> Result<(), String> {
        for crd in &self.bundle.crds {
            self.apply(cluster, served, crd).await?;
        }
        for crd in self.bundle.crd_names() {
            let client = cluster.client();
            let api: Api<DynamicObject> = Api::all_with(client, &crd_resource());
            let mut waited = 0;
            loop {
                let established = api
                    .get_opt(&crd)
                    .await
                    .map_err(|e| {
                        format!(
                            "reading CRD {crd}: {}",
                            crate::client::redact::safe_text(&e)
                        )
                    })?
                    .is_some_and(|o| crate::cluster::crd_established(&o.data));
                if established {
                    break;
                }
                waited += 1;
                if waited > 120 {
                    return Err(format!("CRD {crd} not established after a minute"));
                }
                tokio::select! {
                    () = until.cancelled() => return Err("the engagement ended".into()),
                    () = tokio::time::sleep(Duration::from_millis(500)) => {}
                }
            }
        }
        for object in &self.bundle.objects {
            self.apply(cluster, served, object).await?;
        }
        Ok(())
    }

    /// Applies one object (server-side apply, forced).
    async fn apply<C: ClusterId>(
        &self,
        cluster: &Cluster<C>,
        served: &mut HashMap<(String, String), Served>,
        object: &DynamicObject,
    ) -> Result<(), String> {
        let name = object.metadata.name.clone().unwrap_or_default();
        let api = self.api(cluster, served, object).await?;
        api.patch(
            &name,
            &PatchParams::apply(&self.bundle.field_manager()).force(),
            &Patch::Apply(object),
        )
        .await
        .map(|_| ())
        .map_err(|e| {
            let kind = object
                .types
                .as_ref()
                .map(|t| t.kind.as_str())
                .unwrap_or_default();
            format!(
                "applying {kind} {name}: {}",
                crate::client::redact::safe_text(&e)
            )
        })
    }

    /// The `Api` of `object` in `cluster`, its resource found by discovery once.
    async fn api<C: ClusterId>(
        &self,
        cluster: &Cluster<C>,
        served: &mut HashMap<(String, String), Served>,
        object: &DynamicObject,
    ) -> Result<Api<DynamicObject>, String> {
        let types = object.types.clone().unwrap_or_default();
        let key = (types.api_version.clone(), types.kind.clone());
        let found = match served.get(&key) {
            Some(found) => found.clone(),
            None => {
                let (group, version) = match types.api_version.rsplit_once('/') {
                    Some((g, v)) => (g.to_string(), v.to_string()),
                    None => (String::new(), types.api_version.clone()),
                };
                let gvk = GroupVersionKind::gvk(&group, &version, &types.kind);
                let (resource, capabilities) =
                    kube::discovery::pinned_kind(&cluster.client(), &gvk)
                        .await
                        .map_err(|e| {
                            format!(
                                "{} {} is not served: {}",
                                types.api_version,
                                types.kind,
                                crate::client::redact::safe_text(&e)
                            )
                        })?;
                let found = Served {
                    resource,
                    namespaced: capabilities.scope == Scope::Namespaced,
                };
                served.insert(key, found.clone());
                found
            }
        };
        let client = cluster.client();
        Ok(
            match (found.namespaced, object.metadata.namespace.as_deref()) {
                (true, Some(ns)) => Api::namespaced_with(client, ns, &found.resource),
                (true, None) => Api::default_namespaced_with(client, &found.resource),
                (false, _) => Api::all_with(client, &found.resource),
            },
        )
    }

    /// Deletes the bundle's objects from a departed cluster: those that still carry its
    /// label, the CRDs last.
    async fn remove<C: ClusterId>(&self, cluster: &Cluster<C>) {
        let name = &self.bundle.name;
        let mut served = HashMap::new();
        for object in self
            .bundle
            .objects
            .iter()
            .rev()
            .chain(self.bundle.crds.iter())
        {
            let object_name = object.metadata.name.clone().unwrap_or_default();
            let api = match self.api(cluster, &mut served, object).await {
                Ok(api) => api,
                Err(reason) => {
                    tracing::debug!(bundle = %name, cluster = %cluster.id(), %reason, "bundle object not removed");
                    continue;
                }
            };
            let present = match api.get_opt(&object_name).await {
                Ok(present) => present,
                Err(error) => {
                    tracing::warn!(bundle = %name, cluster = %cluster.id(), object = %object_name, error = %crate::client::redact::safe_text(&error), "bundle object not removed from a departed cluster");
                    continue;
                }
            };
            // Only what is still ours (labelled by this bundle), and that very object.
            let Some(present) = present.filter(|p| {
                p.metadata.labels.as_ref().and_then(|l| l.get(BUNDLE_LABEL)) == Some(name)
            }) else {
                continue;
            };
            let params = DeleteParams {
                preconditions: present.metadata.uid.clone().map(|uid| Preconditions {
                    uid: Some(uid),
                    resource_version: None,
                }),
                ..DeleteParams::default()
            };
            match api.delete(&object_name, &params).await {
                Ok(_) => {
                    tracing::info!(bundle = %name, cluster = %cluster.id(), object = %object_name, "bundle object removed from a departed cluster");
                }
                Err(error) => {
                    tracing::warn!(bundle = %name, cluster = %cluster.id(), object = %object_name, error = %crate::client::redact::safe_text(&error), "bundle object not removed from a departed cluster");
                }
            }
        }
    }
}

/// The next full apply after a failure: 1 s after the first, doubling to a minute.
fn later(again: Option<(tokio::time::Instant, Duration)>) -> (tokio::time::Instant, Duration) {
    let wait = match again {
        Some((_, wait)) => (wait * 2).min(Duration::from_secs(60)),
        None => Duration::from_secs(1),
    };
    (tokio::time::Instant::now() + wait, wait)
}

/// Sleeps until `at` (forever for `None`, a branch its caller turns off then).
async fn sleep_until(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// The CRD resource.
fn crd_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("apiextensions.k8s.io", "v1", "CustomResourceDefinition"),
        "customresourcedefinitions",
    )
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::ConfigMap;

    use super::*;

    #[test]
    fn a_bundle_sorts_crds_first_labels_its_objects_and_refuses_bad_names() {
        let mut cm = ConfigMap::default();
        cm.metadata.name = Some("settings".into());
        cm.metadata.resource_version = Some("12".into());
        let crd: DynamicObject = serde_json::from_value(serde_json::json!({
            "apiVersion": "apiextensions.k8s.io/v1",
            "kind": "CustomResourceDefinition",
            "metadata": {"name": "widgets.example.com"},
        }))
        .unwrap();
        let bundle = Bundle::new("widgets")
            .unwrap()
            .with(&cm)
            .unwrap()
            .with_dynamic(crd)
            .unwrap();
        assert_eq!(bundle.crd_names(), vec!["widgets.example.com".to_string()]);
        let object = &bundle.objects[0];
        assert_eq!(object.types.as_ref().unwrap().kind, "ConfigMap");
        assert_eq!(
            object.metadata.labels.as_ref().unwrap()[BUNDLE_LABEL],
            "widgets"
        );
        assert_eq!(object.metadata.resource_version, None);
        for bad in ["", "-x", "x-", "a/b", &"x".repeat(64)] {
            assert!(Bundle::new(bad).is_err(), "{bad:?}");
        }
        let unnamed = ConfigMap::default();
        assert!(Bundle::new("b").unwrap().with(&unnamed).is_err());
    }
}
