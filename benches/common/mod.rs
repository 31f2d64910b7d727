//! Helpers both benchmark binaries use.

use std::collections::BTreeMap;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use kube::api::{Api, ObjectMeta, PostParams};

/// The argument after `flag`, if any.
pub fn arg_after(args: &[String], flag: &str) -> Option<String> {
    args.iter()
        .position(|a| a == flag)
        .and_then(|i| args.get(i + 1).cloned())
}

/// Every argument after an occurrence of `flag`.
pub fn args_after(args: &[String], flag: &str) -> Vec<String> {
    args.windows(2)
        .filter(|w| w[0] == flag)
        .map(|w| w[1].clone())
        .collect()
}

/// CPU time (user + system) this process has used.
pub fn cpu_time() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the command name (which ends with ')'): utime and stime are the 12th and
    // 13th of them, in clock ticks (100 per second on Linux).
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap_or_default();
    let ticks: u64 = [11, 12]
        .iter()
        .filter_map(|&i| fields.get(i)?.parse::<u64>().ok())
        .sum();
    Duration::from_millis(ticks * 10)
}

/// Creates `count` ConfigMaps `cm-00000…` in `api`'s namespace, labelled `bench=<label>`,
/// each with its index as data; 32 requests at a time.
pub async fn create_config_maps(api: &Api<ConfigMap>, count: usize, label: &str) {
    let mut creates = futures::stream::iter(0..count)
        .map(|i| {
            let cm = ConfigMap {
                metadata: ObjectMeta {
                    name: Some(format!("cm-{i:05}")),
                    labels: Some(BTreeMap::from([("bench".to_string(), label.to_string())])),
                    ..Default::default()
                },
                data: Some(BTreeMap::from([("i".to_string(), i.to_string())])),
                ..Default::default()
            };
            async move {
                api.create(&PostParams::default(), &cm)
                    .await
                    .expect("create")
            }
        })
        .buffer_unordered(32);
    while creates.next().await.is_some() {}
}

/// Creates the namespace `name`.
pub async fn create_namespace(client: &kube::Client, name: &str) {
    let ns = Namespace {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..Default::default()
        },
        ..Default::default()
    };
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await
        .expect("namespace");
}
