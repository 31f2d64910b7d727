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

/// CPU time (user + system) this process has used, its exited threads included.
///
/// From `getrusage(RUSAGE_SELF)`, in microseconds: Linux sums each thread's scheduler run
/// time in nanoseconds for it. `/proc/self/stat` counts in 10 ms ticks, too coarse for a
/// workload of 0.1 CPU-seconds.
pub fn cpu_time() -> Duration {
    use nix::sys::resource::{UsageWho, getrusage};
    let Ok(usage) = getrusage(UsageWho::RUSAGE_SELF) else {
        return Duration::ZERO;
    };
    let micros = |t: nix::sys::time::TimeVal| {
        Duration::from_secs(t.tv_sec().max(0) as u64)
            + Duration::from_micros(t.tv_usec().max(0) as u64)
    };
    micros(usage.user_time()) + micros(usage.system_time())
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
