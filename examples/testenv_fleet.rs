//! A fleet of local control planes with `testenv`: start three clusters, write and read a
//! ConfigMap in each, add a fourth at run time, remove one, and clean everything up.
//!
//! ```sh
//! scripts/example.sh testenv_fleet          # run and exit
//! scripts/example.sh testenv_fleet --hold   # keep the clusters until Ctrl-C, for kubectl
//! ```

use std::collections::BTreeMap;
use std::time::Instant;

use k8s_openapi::api::core::v1::ConfigMap;
use kube::Api;
use kube::api::{ObjectMeta, PostParams};
use multicluster_runtime_testenv::{TestCluster, TestEnv};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .init();
    let hold = std::env::args().any(|a| a == "--hold");

    let started = Instant::now();
    let env = TestEnv::builder().clusters(3).start().await?;
    println!(
        "started {} clusters in {:.1?}",
        env.clusters().len(),
        started.elapsed()
    );

    for cluster in env.clusters() {
        greet(&cluster).await?;
    }

    let started = Instant::now();
    let fourth = env.add_cluster().await?;
    println!(
        "added {} at run time in {:.1?}",
        fourth.name(),
        started.elapsed()
    );
    greet(&fourth).await?;

    env.remove_cluster("cluster-1").await;
    let names: Vec<String> = env
        .clusters()
        .iter()
        .map(|c| c.name().to_string())
        .collect();
    println!("removed cluster-1; the fleet is now {names:?}");

    if hold {
        for cluster in env.clusters() {
            println!(
                "kubectl --kubeconfig {} get configmaps",
                cluster.kubeconfig_path().display()
            );
        }
        println!("holding the clusters; press Ctrl-C to stop them");
        tokio::signal::ctrl_c().await?;
    }
    // Dropping `env` stops every apiserver and etcd and removes the temporary files.
    drop(env);
    println!("all control planes stopped");
    Ok(())
}

/// Writes a ConfigMap naming the cluster and reads it back.
async fn greet(cluster: &TestCluster) -> Result<(), Box<dyn std::error::Error>> {
    let api: Api<ConfigMap> = Api::namespaced(cluster.client()?, "default");
    let cm = ConfigMap {
        metadata: ObjectMeta {
            name: Some("hello".into()),
            ..Default::default()
        },
        data: Some(BTreeMap::from([(
            "cluster".to_string(),
            cluster.name().to_string(),
        )])),
        ..Default::default()
    };
    api.create(&PostParams::default(), &cm).await?;
    let back = api.get("hello").await?;
    let data = back.data.unwrap_or_default();
    println!(
        "{:<10} {}  configmap default/hello says cluster={}",
        cluster.name(),
        cluster.server(),
        data.get("cluster").map(String::as_str).unwrap_or("?")
    );
    Ok(())
}
