//! What the fake crate's tests (and its bench) share: the uniform example's namespaces and a
//! wait on paused time.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::future::Future;
use std::time::Duration;

use k8s_openapi::api::core::v1::Namespace;
use multicluster_runtime_fake::ApiServerBuilder;

/// A namespace, labelled `compliance=enforced` when `enforced`.
pub fn namespace(name: &str, enforced: bool) -> Namespace {
    let mut ns = Namespace::default();
    ns.metadata.name = Some(name.into());
    if enforced {
        ns.metadata.labels = Some(BTreeMap::from([("compliance".into(), "enforced".into())]));
    }
    ns
}

/// A server with `team-a` (enforced) and `sandbox` (exempt).
pub fn seeded(b: ApiServerBuilder) -> ApiServerBuilder {
    b.object(&namespace("team-a", true))
        .object(&namespace("sandbox", false))
}

/// Waits (in paused time, which moves only when every task waits) until `done` holds.
pub async fn eventually<F, Fut>(what: &str, mut done: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    for _ in 0..600 {
        if done().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("{what}: not within 60 s of paused time");
}
