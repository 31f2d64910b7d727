//! What test control planes cost: start time for 1 and 10 clusters, and resident memory per
//! cluster for both etcd layouts. Figures go to `BENCHMARKS.md`.
//!
//! ```sh
//! MCR_TESTENV_ASSETS=$(scripts/testenv-assets.sh) cargo bench --bench testenv
//! ```
//!
//! Environment: `MCR_BENCH_ROUNDS` (default 3) start rounds per configuration,
//! `MCR_BENCH_SETTLE_SECS` (default 10) idle time before memory is read.

use std::time::{Duration, Instant};

use multicluster_runtime_testenv::{EtcdLayout, TestEnv};

fn env_num(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Resident set size of a process in KiB, from `/proc/<pid>/status`.
fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn median(mut xs: Vec<Duration>) -> Duration {
    xs.sort();
    xs[xs.len() / 2]
}

#[tokio::main]
async fn main() {
    let rounds = env_num("MCR_BENCH_ROUNDS", 3) as usize;
    let settle = Duration::from_secs(env_num("MCR_BENCH_SETTLE_SECS", 10));
    println!(
        "rounds={rounds} settle={settle:?} cores={}",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );

    for layout in [EtcdLayout::Shared, EtcdLayout::PerCluster] {
        for clusters in [1usize, 10] {
            let mut times = Vec::new();
            let mut memory = None;
            for round in 0..rounds {
                let t = Instant::now();
                let env = TestEnv::builder()
                    .clusters(clusters)
                    .etcd_layout(layout)
                    .start()
                    .await
                    .unwrap_or_else(|e| panic!("start {clusters} clusters ({layout:?}): {e}"));
                times.push(t.elapsed());
                if round == 0 {
                    tokio::time::sleep(settle).await;
                    let total: u64 = env.pids().iter().map(|&p| rss_kib(p)).sum();
                    let apiservers: u64 = env
                        .clusters()
                        .iter()
                        .filter_map(|c| c.apiserver_pid())
                        .map(rss_kib)
                        .sum();
                    memory = Some((total, apiservers));
                }
                drop(env);
            }
            let (total, apiservers) = memory.unwrap_or_default();
            println!(
                "layout={layout:?} clusters={clusters} start_median={:.2}s start_all={:?} \
                 rss_total={} MiB rss_per_cluster={} MiB (apiservers {} MiB, etcd {} MiB)",
                median(times.clone()).as_secs_f64(),
                times
                    .iter()
                    .map(|t| format!("{:.2}", t.as_secs_f64()))
                    .collect::<Vec<_>>(),
                total / 1024,
                total / 1024 / clusters as u64,
                apiservers / 1024,
                (total - apiservers) / 1024,
            );
        }
    }
}
