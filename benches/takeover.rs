//! Leader take-over with and without warm standby (issue 29 item 6); figures go to
//! `BENCHMARKS.md`.
//!
//! ```sh
//! export MCR_TESTENV_ASSETS=$(scripts/testenv-assets.sh)
//! cargo bench --bench takeover [-- --n 1000 --runs 1]
//! ```
//!
//! Three testenv apiservers: two members, each with namespace `bench` holding 10 ConfigMaps
//! labelled `bench=mcr`, and a host for the leader Lease (lease 4 s, renew deadline 2 s,
//! retry 0.5 s). Each replica is a child process with a manager of `n` cluster names over the
//! members (round robin, as W1) and one ConfigMap controller (that selector, concurrency 64,
//! a reconcile that only counts), with or without `Builder::warm_standby`. A leader starts
//! and reconciles all `n` × 10 objects; a follower starts and waits until every name is
//! engaged (and, warm, every cache listed); its RSS then is the standby's memory. The leader
//! is killed (SIGKILL); the follower reports, on the wall clock, when it took the Lease and
//! when its first and its `n` × 10th reconcile began.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

// Shared with the other benchmarks; this one needs only some of it.
#[allow(dead_code)]
mod common;

use common::arg_after;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::Api;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube_runtime::watcher;
use multicluster_runtime::providers::Clusters;
use multicluster_runtime::{
    Action, Builder, Cluster, ClusterName, Context, LeaderElection, LeaseTiming, Manager,
};
use multicluster_runtime_testenv::TestEnv;

const OBJECTS: usize = 10;

fn now_ms() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64()
        * 1e3
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    if let Some(id) = arg_after(&args, "--child") {
        rt.block_on(replica(&id, &args));
        return;
    }
    let n: usize = arg_after(&args, "--n")
        .and_then(|n| n.parse().ok())
        .unwrap_or(1000);
    let runs: usize = arg_after(&args, "--runs")
        .and_then(|n| n.parse().ok())
        .unwrap_or(1);
    rt.block_on(parent(n, runs));
}

/// What a replica said: its `key=value` lines, latest value per key.
#[derive(Default)]
struct Said(std::sync::Mutex<BTreeMap<String, f64>>);

impl Said {
    fn get(&self, key: &str) -> Option<f64> {
        self.0.lock().unwrap().get(key).copied()
    }
}

fn spawn(id: &str, n: usize, warm: bool, members: &[String], host: &str) -> (Child, Arc<Said>) {
    let exe = std::env::current_exe().expect("current_exe");
    let mut cmd = Command::new(exe);
    cmd.args(["--child", id, "--n", &n.to_string(), "--host", host]);
    if warm {
        cmd.arg("--warm");
    }
    for member in members {
        cmd.args(["--member", member]);
    }
    cmd.stdout(Stdio::piped());
    let mut child = cmd.spawn().expect("spawn replica");
    let stdout = child.stdout.take().expect("stdout");
    let said = Arc::new(Said::default());
    let writer = said.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let mut said = writer.0.lock().unwrap();
            for (k, v) in line.split_whitespace().filter_map(|f| f.split_once('=')) {
                if let Ok(v) = v.parse() {
                    said.insert(k.to_string(), v);
                }
            }
        }
    });
    (child, said)
}

async fn wait(limit: Duration, what: &str, mut done: impl FnMut() -> bool) {
    let start = std::time::Instant::now();
    while !done() {
        assert!(start.elapsed() < limit, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn rss_mib(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .unwrap_or(0.0)
        / 1024.0
}

async fn parent(n: usize, runs: usize) {
    println!(
        "\n== take-over: {n} cluster names over 2 API servers, {OBJECTS} objects each, Lease on a third"
    );
    let env = TestEnv::builder()
        .clusters(3)
        .start()
        .await
        .expect("testenv");
    let mut members = Vec::new();
    for i in 0..2 {
        let tc = env.cluster(i).expect("member");
        let client = tc.client().expect("client");
        common::create_namespace(&client, "bench").await;
        common::create_config_maps(&Api::namespaced(client, "bench"), OBJECTS, "mcr").await;
        members.push(tc.kubeconfig_path().display().to_string());
    }
    let host = env
        .cluster(2)
        .expect("host")
        .kubeconfig_path()
        .display()
        .to_string();
    let total = (n * OBJECTS) as f64;
    let mut rows = Vec::new();
    for run in 0..runs {
        for warm in [false, true] {
            let mode = if warm { "warm" } else { "cold" };
            let (mut leader, led) = spawn(&format!("a{run}{mode}"), n, warm, &members, &host);
            wait(Duration::from_secs(300), "the leader's reconciles", || {
                led.get("reconciled").is_some_and(|r| r >= total)
            })
            .await;
            let (mut follower, follows) = spawn(&format!("b{run}{mode}"), n, warm, &members, &host);
            wait(Duration::from_secs(300), "the follower ready", || {
                follows.get("ready").is_some()
            })
            .await;
            tokio::time::sleep(Duration::from_secs(3)).await;
            let standby_rss = rss_mib(follower.id());
            let leader_rss = rss_mib(leader.id());
            leader.kill().expect("SIGKILL");
            let _ = leader.wait();
            let killed = now_ms();
            wait(
                Duration::from_secs(300),
                "the follower's reconciles",
                || follows.get("reconciled").is_some_and(|r| r >= total),
            )
            .await;
            let acquired = follows.get("leading_ms").expect("leading");
            let first = follows.get("first_ms").expect("first");
            let last = follows.get("all_ms").expect("all");
            let row = format!(
                "RESULT mode={mode} run={run} lease_taken_after_kill_s={:.2} first_reconcile_after_lease_s={:.3} all_after_lease_s={:.2} standby_rss_mib={standby_rss:.0} leader_rss_mib={leader_rss:.0}",
                (acquired - killed) / 1e3,
                (first - acquired) / 1e3,
                (last - acquired) / 1e3,
            );
            println!("{row}");
            rows.push(row);
            follower.kill().expect("stop the follower");
            let _ = follower.wait();
            // The next pair's leader must not wait out this one's Lease.
            tokio::time::sleep(Duration::from_secs(5)).await;
        }
    }
    println!("\nsummary:");
    for row in rows {
        println!("{row}");
    }
}

async fn config(path: &str) -> kube::Config {
    let kc = Kubeconfig::read_from(path).expect("kubeconfig");
    kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
        .await
        .expect("config")
}

#[derive(Default)]
struct Counter {
    count: AtomicUsize,
    first: std::sync::OnceLock<f64>,
    all: std::sync::OnceLock<f64>,
    total: usize,
}

async fn count(
    _: Arc<ConfigMap>,
    ctx: Context<ClusterName, Counter>,
) -> Result<Action, kube::Error> {
    let counter = ctx.state();
    counter.first.get_or_init(now_ms);
    if counter.count.fetch_add(1, Ordering::SeqCst) + 1 == counter.total {
        counter.all.get_or_init(now_ms);
    }
    Ok(Action::await_change())
}

fn never(_: Arc<ConfigMap>, _: &kube::Error, _: &Context<ClusterName, Counter>) -> Action {
    Action::await_change()
}

/// A replica: every name, leader election, the controller warm or cold; prints what it does.
async fn replica(id: &str, args: &[String]) {
    let n: usize = arg_after(args, "--n")
        .and_then(|n| n.parse().ok())
        .unwrap_or(1000);
    let warm = args.iter().any(|a| a == "--warm");
    let mut configs = Vec::new();
    for path in args.windows(2).filter(|w| w[0] == "--member") {
        configs.push(config(&path[1]).await);
    }
    let host = kube::Client::try_from(config(&arg_after(args, "--host").expect("--host")).await)
        .expect("host client");
    let clusters = Clusters::<ClusterName>::new();
    let ids: Vec<ClusterName> = (0..n)
        .map(|i| ClusterName::from(format!("c-{i:04}")))
        .collect();
    for (i, id) in ids.iter().enumerate() {
        let cluster =
            Cluster::from_config(id.clone(), configs[i % configs.len()].clone()).expect("cluster");
        clusters.add(cluster).expect("add");
    }
    let election = LeaderElection::new(host, "default", "bench-takeover")
        .identity(id)
        .timing(
            LeaseTiming::default()
                .lease_duration(Duration::from_secs(4))
                .renew_deadline(Duration::from_secs(2))
                .retry_period(Duration::from_millis(500)),
        );
    let manager = Arc::new(Manager::new(clusters).leader_election(election));
    let counter = Arc::new(Counter {
        total: n * OBJECTS,
        ..Counter::default()
    });
    let wc = watcher::Config::default().labels("bench=mcr");
    Builder::<_, ConfigMap>::new(&manager, wc.clone())
        .concurrency(64)
        .warm_standby(warm)
        .start(count, never, counter.clone());
    let run = {
        let manager = manager.clone();
        tokio::spawn(async move { manager.run().await })
    };
    // Ready to stand by: every name engaged and, warm, every cache listed.
    loop {
        let ready = ids.iter().all(|id| {
            manager.cluster(id).is_some_and(|c| {
                !warm
                    || c.cache_status()
                        .iter()
                        .any(|s| s.kind == "ConfigMap" && s.synced)
            })
        });
        if ready || manager.is_leader() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    println!("ready=1");
    let leading = {
        let manager = manager.clone();
        tokio::spawn(async move {
            manager.elected().await;
            println!("leading_ms={:.1}", now_ms());
        })
    };
    let mut last = String::new();
    while !run.is_finished() {
        let mut line = format!("reconciled={}", counter.count.load(Ordering::SeqCst));
        if let Some(first) = counter.first.get() {
            line.push_str(&format!(" first_ms={first:.1}"));
        }
        if let Some(all) = counter.all.get() {
            line.push_str(&format!(" all_ms={all:.1}"));
        }
        if last != line {
            println!("{line}");
            last = line;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    leading.abort();
    eprintln!("replica {id}: {:?}", run.await);
}
