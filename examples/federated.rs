//! A multi-cluster-aware reconciler: a federated object on the host cluster, fanned out to
//! the member clusters, with each member's outcome aggregated back onto its status.
//!
//! A `FederatedConfig` (a custom resource whose CRD this file ships, installed on the host)
//! holds ConfigMap data. The controller reconciles it on the host only and keeps a ConfigMap
//! of the same name and data in every member cluster through one [`FleetApi`] call; the
//! status says, per member, whether its copy is in place. A member copy that is edited or
//! deleted is put back (the members' ConfigMaps are watched and mapped back to the host
//! object), a member that joins later gets the copy, a member that is down shows as failing
//! without holding up the others, and deleting the host object removes every copy first (a
//! finalizer). Clusters are named by an id type of the example's own, `Site` (a region and
//! a name).
//!
//! ```sh
//! scripts/example.sh federated
//! ```
//!
//! It starts a host and three members (testenv), shows each step, checks its outcome and
//! exits with an error if one is not met.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ObjectMeta, Patch, PatchParams, PostParams};
use multicluster_runtime::finalizer::{Error as FinalizerError, Event, finalizer};
use multicluster_runtime::providers::Clusters;
use multicluster_runtime::{
    Action, Builder, Cluster, ClusterEvent, ClusterId, Context, FleetApi, InvalidClusterId,
    Manager, Request, watcher,
};
use multicluster_runtime_testenv::{TestCluster, TestEnv};
use serde::{Deserialize, Serialize};

// The items below are `pub(crate)` so that the fake crate's unit tests
// (fake/tests/federated.rs) can include this file and test its reconciler without a cluster.

/// The CRD of `FederatedConfig`, installed on the host.
pub(crate) const CRD: &str = r#"
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: federatedconfigs.demo.multicluster.example
spec:
  group: demo.multicluster.example
  scope: Namespaced
  names: {plural: federatedconfigs, singular: federatedconfig, kind: FederatedConfig}
  versions:
    - name: v1
      served: true
      storage: true
      subresources: {status: {}}
      schema:
        openAPIV3Schema:
          type: object
          properties:
            spec:
              type: object
              properties:
                data: {type: object, additionalProperties: {type: string}}
            status:
              type: object
              properties:
                clusters: {type: object, additionalProperties: {type: string}}
                synced: {type: integer}
"#;

/// ConfigMap data to hold in every member cluster.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub(crate) struct FederatedConfig {
    #[serde(rename = "apiVersion")]
    api_version: String,
    kind: String,
    pub(crate) metadata: ObjectMeta,
    pub(crate) spec: FederatedConfigSpec,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) status: Option<FederatedConfigStatus>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub(crate) struct FederatedConfigSpec {
    pub(crate) data: BTreeMap<String, String>,
}

/// Each member's outcome (`Synced`, or what failed) and how many are synced.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub(crate) struct FederatedConfigStatus {
    pub(crate) clusters: BTreeMap<String, String>,
    pub(crate) synced: u32,
}

impl k8s_openapi::Resource for FederatedConfig {
    const API_VERSION: &'static str = "demo.multicluster.example/v1";
    const GROUP: &'static str = "demo.multicluster.example";
    const KIND: &'static str = "FederatedConfig";
    const VERSION: &'static str = "v1";
    const URL_PATH_SEGMENT: &'static str = "federatedconfigs";
    type Scope = k8s_openapi::NamespaceResourceScope;
}

impl k8s_openapi::Metadata for FederatedConfig {
    type Ty = ObjectMeta;
    fn metadata(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn metadata_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

impl FederatedConfig {
    pub(crate) fn new(name: &str, data: &[(&str, &str)]) -> Self {
        Self {
            api_version: <Self as k8s_openapi::Resource>::API_VERSION.into(),
            kind: <Self as k8s_openapi::Resource>::KIND.into(),
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("default".into()),
                ..Default::default()
            },
            spec: FederatedConfigSpec {
                data: data
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            },
            status: None,
        }
    }
}

/// A cluster's id: its region and its name, `region.name` as text. Any type with a text
/// form that reads back can be a [`ClusterId`]; requests, logs, metrics and this example's
/// status use the text form.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct Site {
    region: String,
    name: String,
}

impl Site {
    pub(crate) fn new(region: &str, name: &str) -> Self {
        Self {
            region: region.into(),
            name: name.into(),
        }
    }
}

impl std::fmt::Display for Site {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.region, self.name)
    }
}

impl ClusterId for Site {
    fn parse(s: &str) -> Result<Self, InvalidClusterId> {
        match s.split_once('.') {
            Some((region, name)) if !region.is_empty() && !name.is_empty() => {
                Ok(Self::new(region, name))
            }
            _ => Err(InvalidClusterId::new(s, "expected region.name")),
        }
    }
}

/// Marks the member copies, naming the host object they come from.
pub(crate) const FROM: &str = "demo.multicluster.example/federated-config";
const FINALIZER: &str = "demo.multicluster.example/cleanup";
const FIELD_MANAGER: &str = "federated-config";

#[derive(Debug, thiserror::Error)]
pub(crate) enum Error {
    #[error(transparent)]
    Kube(#[from] kube::Error),
    #[error("finalizer: {0}")]
    Finalizer(String),
    #[error("{0} of the member clusters failed")]
    Members(usize),
}

// ANCHOR: reconcile
/// The host object: fan out (or clean up), then write each member's outcome to its status.
pub(crate) async fn reconcile(
    fc: Arc<FederatedConfig>,
    ctx: Context<Site, ()>,
) -> Result<Action, Error> {
    let ns = fc.namespace().unwrap_or_default();
    let host = Api::<FederatedConfig>::namespaced(ctx.client(), &ns);
    let copies =
        FleetApi::<_, ConfigMap>::namespaced(ctx.fleet(), &ns).timeout(Duration::from_secs(5));
    finalizer(&host, FINALIZER, fc, |event| async {
        match event {
            Event::Apply(fc) => fan_out(&fc, &host, &copies).await,
            Event::Cleanup(fc) => {
                let removed = copies
                    .delete(&fc.name_any(), &DeleteParams::default())
                    .await;
                match removed.errors().count() {
                    0 => Ok(Action::await_change()),
                    n => Err(Error::Members(n)),
                }
            }
        }
    })
    .await
    .map_err(|e| match e {
        FinalizerError::ApplyFailed(e) | FinalizerError::CleanupFailed(e) => e,
        other => Error::Finalizer(other.to_string()),
    })
}

async fn fan_out(
    fc: &FederatedConfig,
    host: &Api<FederatedConfig>,
    copies: &FleetApi<Site, ConfigMap>,
) -> Result<Action, Error> {
    let name = fc.name_any();
    let copy = ConfigMap {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            labels: Some(BTreeMap::from([(FROM.into(), name.clone())])),
            ..Default::default()
        },
        data: Some(fc.spec.data.clone()),
        ..Default::default()
    };
    let applied = copies.apply(&name, FIELD_MANAGER, &copy).await;
    let status = FederatedConfigStatus {
        clusters: applied
            .iter()
            .map(|(id, r)| {
                let outcome = match r {
                    Ok(_) => "Synced".to_string(),
                    Err(e) => format!("Failed: {e}"),
                };
                (id.to_string(), outcome)
            })
            .collect(),
        synced: applied.successes().count() as u32,
    };
    if fc.status.as_ref() != Some(&status) {
        host.patch_status(
            &name,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({ "status": status })),
        )
        .await?;
    }
    match applied.errors().count() {
        // A failing member is tried again soon; the others are done.
        0 => Ok(Action::requeue(Duration::from_secs(300))),
        n => Err(Error::Members(n)),
    }
}
// ANCHOR_END: reconcile

pub(crate) fn error_policy(
    _: Arc<FederatedConfig>,
    error: &Error,
    ctx: &Context<Site, ()>,
) -> Action {
    println!("  {}: {error}; retrying in 1 s", ctx.request());
    Action::requeue(Duration::from_secs(1))
}

/// The controller, on `manager` whose local cluster is `hub` (the fake crate's unit tests
/// start it the same way).
pub(crate) fn start_controller(manager: &Arc<Manager<Clusters<Site>>>, hub: Site) {
    // ANCHOR: builder
    // Every host object again whenever a member joins (or comes back replaced).
    let joined = manager.fleet().events().filter_map(|event| {
        std::future::ready(
            matches!(
                event,
                ClusterEvent::Engaged { .. } | ClusterEvent::Replaced { .. }
            )
            .then_some(()),
        )
    });
    Builder::<_, FederatedConfig>::new(manager, watcher::Config::default())
        .named("federated-config")
        .engage_local(true)
        .engage_provider(false)
        // A member copy that changes or goes reconciles its host object.
        .watches_from(
            manager.fleet(),
            watcher::Config::default().labels(FROM),
            move |_: &Site, cm: &ConfigMap| {
                let from = cm.labels().get(FROM).cloned();
                let ns = cm.namespace();
                from.map(|name| Request::new(hub.clone(), ns, name))
            },
        )
        .reconcile_all_on(joined)
        .start(reconcile, error_policy, Arc::new(()));
    // ANCHOR_END: builder
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .init();
    let env = TestEnv::builder().clusters(4).start().await?;
    let all = env.clusters();
    let (host, members) = (&all[0], &all[1..]);
    host.install_crds(CRD).await?;
    println!("started a host and 3 members; the FederatedConfig CRD is on the host");

    // The members' ids are typed: a region and a name (`eu.cluster-1`).
    let fleet = Clusters::<Site>::new();
    for m in &members[..2] {
        fleet.add(Cluster::from_config(Site::new("eu", m.name()), m.config())?)?;
    }
    let hub = Site::new("global", "host");
    let host_cluster = Cluster::from_config(hub.clone(), host.config())?;
    let manager = Arc::new(Manager::new(fleet.clone()).with_local(host_cluster));
    start_controller(&manager, hub);
    let run = {
        let manager = manager.clone();
        tokio::spawn(async move { manager.run().await })
    };

    let host_api = Api::<FederatedConfig>::namespaced(host.client()?, "default");
    host_api
        .create(
            &PostParams::default(),
            &FederatedConfig::new("greeting", &[("hello", "world")]),
        )
        .await?;
    for m in &members[..2] {
        wait_for(&format!("the copy in {}", m.name()), || {
            copy_is(m, "greeting", "hello", "world")
        })
        .await?;
    }
    wait_for("status: 2 synced", || synced_is(&host_api, "greeting", 2)).await?;
    println!("step 1: the host object is in both members, and its status says so");

    // A member that is down fails alone; the others get the update.
    let down = &members[1];
    down.stop().await;
    host_api
        .patch(
            "greeting",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"spec": {"data": {"hello": "fleet"}}})),
        )
        .await?;
    wait_for("the update in the running member", || {
        copy_is(&members[0], "greeting", "hello", "fleet")
    })
    .await?;
    wait_for("status: the stopped member failing, by name", || {
        let api = host_api.clone();
        let down = Site::new("eu", down.name()).to_string();
        async move {
            let Ok(fc) = api.get("greeting").await else {
                return false;
            };
            fc.status.is_some_and(|s| {
                s.synced == 1
                    && s.clusters
                        .get(&down)
                        .is_some_and(|o| o.starts_with("Failed: cluster "))
            })
        }
    })
    .await?;
    println!(
        "step 2: {} is down: its entry in the status fails, the other member is updated",
        down.name()
    );
    down.start().await?;
    wait_for("the member back in step", || {
        copy_is(down, "greeting", "hello", "fleet")
    })
    .await?;
    wait_for("status: 2 synced again", || {
        synced_is(&host_api, "greeting", 2)
    })
    .await?;
    println!("step 3: {} is back and in step", down.name());

    // Drift in a member is put back.
    Api::<ConfigMap>::namespaced(members[0].client()?, "default")
        .delete("greeting", &Default::default())
        .await?;
    wait_for("the deleted copy restored", || {
        copy_is(&members[0], "greeting", "hello", "fleet")
    })
    .await?;
    println!(
        "step 4: a copy deleted in {} was put back",
        members[0].name()
    );

    // A member that joins later gets the copy.
    let late = &members[2];
    fleet.add(Cluster::from_config(
        Site::new("us", late.name()),
        late.config(),
    )?)?;
    wait_for("the copy in the late member", || {
        copy_is(late, "greeting", "hello", "fleet")
    })
    .await?;
    wait_for("status: 3 synced", || synced_is(&host_api, "greeting", 3)).await?;
    println!("step 5: {} joined and got the copy", late.name());

    // Deleting the host object removes every copy first.
    host_api
        .delete("greeting", &DeleteParams::default())
        .await?;
    wait_for("the host object gone", || {
        let api = host_api.clone();
        async move { matches!(api.get_opt("greeting").await, Ok(None)) }
    })
    .await?;
    for m in members {
        if Api::<ConfigMap>::namespaced(m.client()?, "default")
            .get_opt("greeting")
            .await?
            .is_some()
        {
            return Err(format!("{}: the copy outlived the host object", m.name()).into());
        }
    }
    println!("step 6: deleting the host object removed the copies in all 3 members first");

    manager.shutdown();
    run.await??;
    println!("done");
    Ok(())
}

/// Whether `c` holds the ConfigMap `name` with `key=value`.
async fn copy_is(c: &TestCluster, name: &str, key: &str, value: &str) -> bool {
    let Ok(client) = c.client() else { return false };
    matches!(Api::<ConfigMap>::namespaced(client, "default").get_opt(name).await,
        Ok(Some(cm)) if cm.data.as_ref().and_then(|d| d.get(key)).map(String::as_str) == Some(value))
}

/// Whether the host object's status counts `n` synced members.
async fn synced_is(api: &Api<FederatedConfig>, name: &str, n: u32) -> bool {
    matches!(api.get(name).await, Ok(fc) if fc.status.as_ref().is_some_and(|s| s.synced == n && s.clusters.len() == n as usize))
}

/// Polls `done` until it holds, for at most a minute.
async fn wait_for<F, Fut>(what: &str, mut done: F) -> Result<(), Box<dyn std::error::Error>>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + Duration::from_secs(60);
    while !done().await {
        if Instant::now() > deadline {
            return Err(format!("timed out waiting for {what}").into());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}
