//! [`ClusterApi`]: the workload clusters of Cluster API `Cluster` objects on a management
//! cluster.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use futures::stream::FuturesUnordered;
use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::Secret;
use kube::api::{ApiResource, DynamicObject};
use kube::{Api, Client, Resource, ResourceExt};
use kube_runtime::WatchStreamExt;
use kube_runtime::events::{Recorder, Reporter};
use kube_runtime::watcher::{self, Event as WatchEvent};
use tokio_util::sync::CancellationToken;

use super::kubeconfig::version_of;
use super::kubeconfig_secrets::{Trust, parse_kubeconfig};
use crate::{ClusterName, Fleet, Provider, ProviderError};

/// Cluster API's group.
pub const GROUP: &str = "cluster.x-k8s.io";
/// The type Cluster API gives the Secrets it writes (kubeconfigs, CAs).
pub const SECRET_TYPE: &str = "cluster.x-k8s.io/secret";
/// The data key of a kubeconfig Secret.
pub const KUBECONFIG_KEY: &str = "value";

/// Whether a `Cluster` object is ready to be engaged.
type Ready = Arc<dyn Fn(&DynamicObject) -> bool + Send + Sync>;

/// One cluster per Cluster API `Cluster` object of the management cluster `host` reaches,
/// named `<namespace>/<name>`, reached with the kubeconfig Cluster API writes for it: the
/// Secret `<name>-kubeconfig` of the Cluster's namespace (type `cluster.x-k8s.io/secret`),
/// data key `value`.
///
/// `cluster.x-k8s.io/v1beta2` is watched where it is served, `v1beta1` otherwise. A Cluster
/// is engaged once it is ready: by default when `status.initialization.controlPlaneInitialized`
/// is true (v1beta2), or `status.controlPlaneReady` is true or `status.phase` is
/// `Provisioned` (v1beta1); [`ClusterApi::ready`] replaces the rule. It is disengaged when
/// deleted, when its deletion begins and when it stops being ready, and engaged again when
/// it is ready again. The kubeconfig Secrets are watched too: a rotated kubeconfig replaces
/// the cluster (when its content changed), without waiting for the Cluster to change.
///
/// The Secret is read under the same rules as [`KubeconfigSecrets`](super::KubeconfigSecrets):
/// exec plugins, auth-providers and local files are refused unless allowed. A ready Cluster
/// whose kubeconfig is missing or unusable gets a Warning Event (`KubeconfigRefused`) and a
/// log line, once per problem, holding nothing of the Secret; a cluster engaged from an
/// earlier kubeconfig stays engaged meanwhile, and no other cluster is affected. Until the
/// `Cluster` kind is served (Cluster API installed later), the provider looks again every
/// 10 s.
#[derive(Clone)]
pub struct ClusterApi {
    host: Client,
    namespace: Option<String>,
    labels: Option<String>,
    trust: Trust,
    ready: Option<Ready>,
}

impl std::fmt::Debug for ClusterApi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterApi")
            .field("namespace", &self.namespace)
            .field("labels", &self.labels)
            .field("allow_exec", &self.trust.exec)
            .field("allow_local_files", &self.trust.local_files)
            .field("custom_ready", &self.ready.is_some())
            .finish_non_exhaustive()
    }
}

/// How long to wait before looking again for the `Cluster` kind.
const DISCOVERY_RETRY: Duration = Duration::from_secs(10);
/// How many clients are built at once (each may run a credential plugin, for up to 30 s).
const BUILDS_AT_ONCE: usize = 4;

impl ClusterApi {
    /// Clusters of every namespace of the management cluster `host` reaches.
    pub fn new(host: Client) -> Self {
        Self {
            host,
            namespace: None,
            labels: None,
            trust: Trust::default(),
            ready: None,
        }
    }

    /// Only the Clusters (and kubeconfig Secrets) of `namespace`.
    #[must_use]
    pub fn namespace(mut self, namespace: impl Into<String>) -> Self {
        self.namespace = Some(namespace.into());
        self
    }

    /// Only the Clusters matching a label selector (`env=prod,tier!=test`).
    #[must_use]
    pub fn labels(mut self, selector: impl Into<String>) -> Self {
        self.labels = Some(selector.into());
        self
    }

    /// Another readiness rule, in place of the default (see the type's docs).
    #[must_use]
    pub fn ready(mut self, ready: impl Fn(&DynamicObject) -> bool + Send + Sync + 'static) -> Self {
        self.ready = Some(Arc::new(ready));
        self
    }

    /// Lets kubeconfigs run `exec` credential plugins and `auth-provider`s (see
    /// [`KubeconfigSecrets::allow_exec`](super::KubeconfigSecrets::allow_exec)).
    #[must_use]
    pub fn allow_exec(mut self, allow: bool) -> Self {
        self.trust.exec = allow;
        self
    }

    /// Lets kubeconfigs name files of the controller's machine (see
    /// [`KubeconfigSecrets::allow_local_files`](super::KubeconfigSecrets::allow_local_files)).
    #[must_use]
    pub fn allow_local_files(mut self, allow: bool) -> Self {
        self.trust.local_files = allow;
        self
    }

    /// The `Cluster` kind as the management cluster serves it: v1beta2, else v1beta1; `None`
    /// while Cluster API is not installed.
    async fn discover(&self) -> Result<Option<ApiResource>, kube::Error> {
        let group = match kube::discovery::group(&self.host, GROUP).await {
            Ok(group) => group,
            Err(kube::Error::Api(status)) if status.code == 404 => return Ok(None),
            Err(error) => return Err(error),
        };
        for version in ["v1beta2", "v1beta1"] {
            if let Some((resource, _)) = group
                .versioned_resources(version)
                .into_iter()
                .find(|(r, _)| r.kind == "Cluster")
            {
                return Ok(Some(resource));
            }
        }
        Ok(None)
    }

    fn is_ready(&self, cluster: &DynamicObject) -> bool {
        match &self.ready {
            Some(ready) => ready(cluster),
            None => default_ready(cluster),
        }
    }

    fn clusters(
        &self,
        resource: &ApiResource,
    ) -> impl Stream<Item = watcher::Result<WatchEvent<DynamicObject>>> + use<> {
        let api = match &self.namespace {
            Some(ns) => Api::<DynamicObject>::namespaced_with(self.host.clone(), ns, resource),
            None => Api::<DynamicObject>::all_with(self.host.clone(), resource),
        };
        let mut config = watcher::Config::default();
        if let Some(labels) = &self.labels {
            config = config.labels(labels);
        }
        watcher::watcher(api, config).default_backoff()
    }

    fn secrets(&self) -> impl Stream<Item = watcher::Result<WatchEvent<Secret>>> + use<> {
        let api = match &self.namespace {
            Some(ns) => Api::<Secret>::namespaced(self.host.clone(), ns),
            None => Api::<Secret>::all(self.host.clone()),
        };
        // Only Cluster API's Secrets, and of those only the kubeconfigs are kept.
        let config = watcher::Config::default().fields(&format!("type={SECRET_TYPE}"));
        watcher::watcher(api, config).default_backoff()
    }
}

/// Cluster API's own readiness: the control plane is initialized.
fn default_ready(cluster: &DynamicObject) -> bool {
    let status = cluster.data.get("status");
    let field = |path: &[&str]| path.iter().try_fold(status?, |v, key| v.get(key)).cloned();
    let v1beta2 = cluster
        .types
        .as_ref()
        .is_none_or(|t| t.api_version.ends_with("/v1beta2"));
    if v1beta2 {
        field(&["initialization", "controlPlaneInitialized"]) == Some(serde_json::Value::Bool(true))
    } else {
        field(&["controlPlaneReady"]) == Some(serde_json::Value::Bool(true))
            || field(&["phase"]).as_ref().and_then(|p| p.as_str()) == Some("Provisioned")
    }
}

/// `<namespace>/<name>` of an object.
fn key_of(object: &impl Resource) -> String {
    format!(
        "{}/{}",
        object.meta().namespace.as_deref().unwrap_or_default(),
        object.meta().name.as_deref().unwrap_or_default()
    )
}

/// What the provider knows of one `Cluster` object.
#[derive(Default)]
struct Known {
    /// The object as last seen; `None` once it is gone.
    object: Option<DynamicObject>,
    /// The version (hash) of the kubeconfig its engaged cluster came from.
    engaged: Option<u64>,
    /// The problem last reported (its hash), so each is reported once.
    reported: Option<u64>,
    /// The kubeconfig version being built or waiting to be.
    wanted: Option<u64>,
}

/// The provider's state: Clusters by key and kubeconfigs by the key of their Cluster.
#[derive(Default)]
struct State {
    clusters: BTreeMap<String, Known>,
    /// The kubeconfig with its version (hash), `None` for a Secret without the data key.
    kubeconfigs: BTreeMap<String, Option<(u64, Vec<u8>)>>,
    /// Keys listed by the watch's listing in progress (to forget the vanished ones).
    listing_clusters: Option<BTreeSet<String>>,
    listing_secrets: Option<BTreeSet<String>>,
    /// The Secrets' first listing is complete: a kubeconfig not known by now is missing.
    secrets_listed: bool,
}

/// What to do about one Cluster after a change.
enum Step {
    Nothing,
    Disengage,
    Build(u64, Vec<u8>),
    Report(String),
}

impl ClusterApi {
    fn step(&self, state: &mut State, key: &str) -> Step {
        let State {
            clusters,
            kubeconfigs,
            secrets_listed,
            ..
        } = state;
        let Some(known) = clusters.get_mut(key) else {
            return Step::Nothing;
        };
        let live = known
            .object
            .as_ref()
            .filter(|o| o.meta().deletion_timestamp.is_none())
            .filter(|o| self.is_ready(o));
        if live.is_none() {
            known.wanted = None;
            known.reported = None;
            return match known.engaged.take() {
                Some(_) => Step::Disengage,
                None => Step::Nothing,
            };
        }
        let name = key.rsplit('/').next().unwrap_or_default();
        let problem = match kubeconfigs.get(key) {
            // The Secrets are not listed yet (the Clusters' watch was quicker): their listing
            // looks at every Cluster again.
            None if !*secrets_listed => return Step::Nothing,
            None => {
                format!("the kubeconfig Secret {name}-kubeconfig (type {SECRET_TYPE}) is not there")
            }
            Some(None) => {
                format!("the Secret {name}-kubeconfig has no data key {KUBECONFIG_KEY:?}")
            }
            Some(Some((version, bytes))) => {
                let version = *version;
                if known.engaged == Some(version)
                    || known.wanted == Some(version)
                    || known.reported == Some(version)
                {
                    return Step::Nothing;
                }
                known.wanted = Some(version);
                return Step::Build(version, bytes.clone());
            }
        };
        let fingerprint = version_of(&problem);
        if known.reported == Some(fingerprint) {
            return Step::Nothing;
        }
        known.reported = Some(fingerprint);
        known.wanted = None;
        Step::Report(problem)
    }

    async fn report(
        &self,
        recorder: &Recorder,
        object: &DynamicObject,
        resource: &ApiResource,
        problem: &str,
    ) {
        tracing::warn!(cluster = %key_of(object), error = %problem, "Cluster API cluster not engaged");
        super::record_refusal(
            recorder,
            &object.object_ref(resource),
            &key_of(object),
            problem,
        )
        .await;
    }
}

impl Provider for ClusterApi {
    type Id = ClusterName;

    async fn run(
        &self,
        fleet: Fleet<ClusterName>,
        shutdown: CancellationToken,
    ) -> Result<(), ProviderError> {
        let mut waited = false;
        let resource = loop {
            match self.discover().await {
                Ok(Some(resource)) => break resource,
                Ok(None) if !waited => {
                    tracing::warn!(
                        group = GROUP,
                        "the Cluster kind is not served (Cluster API not installed?); looking again every 10 s"
                    );
                    waited = true;
                }
                Ok(None) => {}
                Err(error) => {
                    tracing::warn!(group = GROUP, %error, "discovering Cluster API failed; retrying")
                }
            }
            tokio::select! {
                () = shutdown.cancelled() => return Ok(()),
                () = tokio::time::sleep(DISCOVERY_RETRY) => {}
            }
        };
        tracing::info!(version = %resource.version, "watching Cluster API clusters");
        let recorder = Recorder::new(
            self.host.clone(),
            Reporter::from("multicluster-runtime-cluster-api"),
        );
        let mut clusters = pin!(self.clusters(&resource));
        let mut secrets = pin!(self.secrets());
        let mut state = State::default();
        let mut building = FuturesUnordered::new();
        let mut waiting: VecDeque<(String, u64, Vec<u8>)> = VecDeque::new();
        loop {
            while building.len() < BUILDS_AT_ONCE
                && let Some((key, version, bytes)) = waiting.pop_front()
            {
                if state.clusters.get(&key).and_then(|k| k.wanted) == Some(version) {
                    let trust = self.trust;
                    building.push(async move {
                        let built = match parse_kubeconfig(&bytes, trust) {
                            Ok(kubeconfig) => {
                                super::cluster_from_kubeconfig(
                                    ClusterName::from(key.clone()),
                                    kubeconfig,
                                    None,
                                )
                                .await
                            }
                            Err(reason) => Err(reason),
                        };
                        (key, version, built)
                    });
                }
            }
            // The keys whose Cluster or kubeconfig changed.
            let changed: Vec<String> = tokio::select! {
                () = shutdown.cancelled() => return Ok(()),
                Some((key, version, built)) = building.next(), if !building.is_empty() => {
                    let Some(known) = state.clusters.get_mut(&key).filter(|k| k.wanted == Some(version)) else {
                        continue;
                    };
                    known.wanted = None;
                    match built {
                        Ok(cluster) => match fleet.engage(cluster) {
                            Ok(_) => {
                                known.engaged = Some(version);
                                known.reported = None;
                            }
                            Err(error) => tracing::warn!(cluster = %key, %error, "could not engage"),
                        },
                        Err(reason) => {
                            known.reported = Some(version);
                            if let Some(object) = known.object.clone() {
                                self.report(&recorder, &object, &resource, &reason).await;
                            }
                        }
                    }
                    continue;
                }
                event = clusters.next() => match event {
                    None => return Ok(()),
                    Some(Err(error)) => {
                        tracing::warn!(%error, "watching Cluster API clusters failed; retrying");
                        continue;
                    }
                    Some(Ok(WatchEvent::Init)) => {
                        state.listing_clusters = Some(BTreeSet::new());
                        continue;
                    }
                    Some(Ok(WatchEvent::InitDone)) => {
                        let listed = state.listing_clusters.take().unwrap_or_default();
                        state.clusters.iter_mut()
                            .filter(|(key, _)| !listed.contains(key.as_str()))
                            .for_each(|(_, known)| known.object = None);
                        state.clusters.keys().cloned().collect()
                    }
                    Some(Ok(WatchEvent::InitApply(object))) => {
                        let key = key_of(&object);
                        if let Some(listing) = &mut state.listing_clusters {
                            listing.insert(key.clone());
                        }
                        state.clusters.entry(key.clone()).or_default().object = Some(object);
                        vec![key]
                    }
                    Some(Ok(WatchEvent::Apply(object))) => {
                        let key = key_of(&object);
                        state.clusters.entry(key.clone()).or_default().object = Some(object);
                        vec![key]
                    }
                    Some(Ok(WatchEvent::Delete(object))) => {
                        let key = key_of(&object);
                        if let Some(known) = state.clusters.get_mut(&key) {
                            known.object = None;
                        }
                        vec![key]
                    }
                },
                event = secrets.next() => match event {
                    None => return Ok(()),
                    Some(Err(error)) => {
                        tracing::warn!(%error, "watching Cluster API kubeconfig Secrets failed; retrying");
                        continue;
                    }
                    Some(Ok(WatchEvent::Init)) => {
                        state.listing_secrets = Some(BTreeSet::new());
                        continue;
                    }
                    Some(Ok(WatchEvent::InitDone)) => {
                        let listed = state.listing_secrets.take().unwrap_or_default();
                        state.kubeconfigs.retain(|key, _| listed.contains(key.as_str()));
                        state.secrets_listed = true;
                        state.clusters.keys().cloned().collect()
                    }
                    Some(Ok(WatchEvent::InitApply(secret) | WatchEvent::Apply(secret))) => {
                        let Some(key) = cluster_of(&secret) else { continue };
                        if let Some(listing) = &mut state.listing_secrets {
                            listing.insert(key.clone());
                        }
                        let value = secret
                            .data
                            .and_then(|mut d| d.remove(KUBECONFIG_KEY))
                            .map(|b| (version_of(&b.0), b.0));
                        state.kubeconfigs.insert(key.clone(), value);
                        vec![key]
                    }
                    Some(Ok(WatchEvent::Delete(secret))) => {
                        let Some(key) = cluster_of(&secret) else { continue };
                        state.kubeconfigs.remove(&key);
                        vec![key]
                    }
                },
            };
            for key in changed {
                match self.step(&mut state, &key) {
                    Step::Nothing => {}
                    Step::Disengage => {
                        tracing::info!(cluster = %key, "Cluster API cluster gone, being deleted or not ready; disengaged");
                        fleet.disengage(&ClusterName::from(key.clone()));
                    }
                    Step::Build(version, bytes) => waiting.push_back((key.clone(), version, bytes)),
                    Step::Report(problem) => {
                        if let Some(object) =
                            state.clusters.get(&key).and_then(|k| k.object.clone())
                        {
                            self.report(&recorder, &object, &resource, &problem).await;
                        }
                    }
                }
                // Forget Clusters that are gone and hold nothing.
                if state.clusters.get(&key).is_some_and(|k| {
                    k.object.is_none() && k.engaged.is_none() && k.wanted.is_none()
                }) {
                    state.clusters.remove(&key);
                }
            }
        }
    }
}

/// The key of the Cluster a kubeconfig Secret (`<cluster>-kubeconfig`) belongs to.
fn cluster_of(secret: &Secret) -> Option<String> {
    let name = secret.meta().name.as_deref()?.strip_suffix("-kubeconfig")?;
    Some(format!("{}/{name}", secret.namespace().unwrap_or_default()))
}
