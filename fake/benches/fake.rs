//! The fake's figures (BENCHMARKS.md, "Unit tests without a cluster"):
//!
//! - `unit`: a unit test of a fleet of 3 fake clusters: the uniform example's controller under
//!   a manager, on paused time, from the fleet's creation until every enforced namespace is
//!   compliant; the median of 21 runs (each in a runtime of its own).
//! - `checker`: schedules per minute of the schedule checker on the uniform example's
//!   reconciler over 2 clusters (faults, relists, departures), and on the lost-update
//!   example of fake/tests/checker.rs's shape over 3.
//!
//!     cargo bench -p multicluster-runtime-fake --bench fake -- [unit|checker]

#[path = "../tests/support/mod.rs"]
mod support;
#[path = "../../examples/uniform.rs"]
#[allow(dead_code)]
mod uniform;

use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::Api;
use multicluster_runtime::{ClusterName, Manager};
use multicluster_runtime_fake::{Checker, FakeFleet};
use support::seeded;

/// One unit test: 3 clusters, the manager, until all three are compliant.
async fn unit_test() {
    let fleet = FakeFleet::new();
    let servers: Vec<_> = ["a", "b", "c"]
        .iter()
        .map(|n| fleet.add_with(seeded(multicluster_runtime_fake::ApiServer::builder(*n))))
        .collect();
    let manager = Arc::new(Manager::new(fleet.provider()));
    uniform::start_controller(&manager);
    let run = tokio::spawn({
        let manager = manager.clone();
        async move { manager.run().await }
    });
    for s in &servers {
        loop {
            let cm = Api::<ConfigMap>::namespaced(s.client(), "team-a")
                .get_opt("compliance")
                .await
                .ok()
                .flatten();
            if cm.is_some() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    manager.shutdown();
    let _ = run.await;
}

fn unit() {
    let mut times = Vec::new();
    for _ in 0..21 {
        let start = Instant::now();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .start_paused(true)
            .build()
            .expect("a runtime");
        rt.block_on(unit_test());
        drop(rt);
        times.push(start.elapsed());
    }
    times.sort();
    println!(
        "unit test of 3 fake clusters (uniform example, manager, paused time): median {:.1} ms, min {:.1} ms, max {:.1} ms (21 runs)",
        times[10].as_secs_f64() * 1e3,
        times[0].as_secs_f64() * 1e3,
        times[20].as_secs_f64() * 1e3
    );
}

fn checker() {
    let c = Checker::new(uniform::reconcile::<ClusterName>, ())
        .cluster("a", seeded)
        .cluster("b", seeded)
        .labels("compliance=enforced")
        .owns::<ConfigMap>(&format!("managed-by={}", uniform::MANAGER))
        .budgets(2, 1, 1, 1);
    let n = 2_000;
    let start = Instant::now();
    let report = c.random(n).expect("the uniform reconciler passes");
    let elapsed = start.elapsed();
    println!(
        "checker, uniform over 2 clusters: {n} schedules, {} steps in {:.2} s: {:.0} schedules/min",
        report.steps,
        elapsed.as_secs_f64(),
        n as f64 / elapsed.as_secs_f64() * 60.0
    );
}

fn main() {
    let what: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let all = what.is_empty();
    if all || what.iter().any(|w| w == "unit") {
        unit();
    }
    if all || what.iter().any(|w| w == "checker") {
        checker();
    }
}
