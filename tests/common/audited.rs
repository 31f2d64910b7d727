//! The audited objects (ConfigMaps of `default` labelled `audit=yes`), the control plane
//! holding them, the quick leader election of the tests' replicas, and ConfigMaps with labels
//! of one's choosing (tests/leader_election.rs, tests/endpoints.rs, tests/operator.rs).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, ObjectMeta, PostParams};
use multicluster_runtime::{LeaderElection, LeaseTiming};
use multicluster_runtime_testenv::{TestCluster, TestEnv};

pub fn labelled() -> kube_runtime::watcher::Config {
    kube_runtime::watcher::Config::default().labels("audit=yes")
}

pub async fn audited_objects(host: &kube::Client) {
    let api: Api<ConfigMap> = Api::namespaced(host.clone(), "default");
    for i in 0..3 {
        let cm = ConfigMap {
            metadata: ObjectMeta {
                name: Some(format!("audited-{i}")),
                labels: Some(BTreeMap::from([("audit".into(), "yes".into())])),
                ..Default::default()
            },
            ..Default::default()
        };
        api.create(&PostParams::default(), &cm).await.unwrap();
    }
}

/// A control plane with the audited objects: the environment (kept alive by the caller),
/// its cluster and an admin client.
pub async fn control_plane() -> (TestEnv, Arc<TestCluster>, kube::Client) {
    let env = TestEnv::start().await.unwrap();
    let tc = env.cluster(0).unwrap();
    let host = tc.client().unwrap();
    audited_objects(&host).await;
    (env, tc, host)
}

/// Short timings so failover takes seconds: lease 4 s, renew deadline 2 s (a 2 s margin for
/// a loaded machine), retry 0.5 s.
pub fn election(client: kube::Client, identity: &str) -> LeaderElection {
    LeaderElection::new(client, "default", "operations-leader")
        .identity(identity)
        .timing(timing())
}

/// The tests' lease timings: quick hand-overs.
pub fn timing() -> LeaseTiming {
    LeaseTiming::default()
        .lease_duration(Duration::from_secs(4))
        .renew_deadline(Duration::from_secs(2))
        .retry_period(Duration::from_millis(500))
}

pub fn labelled_cm(name: &str, labels: &[(&str, &str)]) -> ConfigMap {
    ConfigMap {
        metadata: ObjectMeta {
            name: Some(name.into()),
            labels: Some(
                labels
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            ),
            ..Default::default()
        },
        ..Default::default()
    }
}
