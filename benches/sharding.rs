//! Sharding at scale: replicas (processes) sharing N cluster names over a few testenv API
//! servers, their Leases on another; figures go to `BENCHMARKS.md`.
//!
//! ```sh
//! export MCR_TESTENV_ASSETS=$(scripts/testenv-assets.sh)
//! cargo bench --bench sharding -- [--n 10000] [--replicas 3] [--members 3] [--steady 30]
//! ```
//!
//! Each member API server has namespace `bench` with one ConfigMap labelled `bench=mcr`; the
//! names `c-00000…` go round robin to the members. Each replica is a child process: a manager
//! of all N names (the `Clusters` provider), sharded in group `bench` with the default timings
//! (lease 15 s, renew deadline 10 s, retry period 2 s), one ConfigMap controller that counts
//! its reconciles; it prints how many clusters it owns and how many reconciles it ran, twice
//! a second. The parent measures:
//!
//! - time to a stable assignment: from the replicas' start until every name is owned by one
//!   replica and reconciled there (owned counts summing to N, each replica's reconciles at
//!   least its owned count);
//! - host load at steady state: `apiserver_request_total` of the host for `leases`, by verb,
//!   over `--steady` seconds, as requests per second;
//! - memory: each replica's RSS at steady state;
//! - take-over: one replica is killed (SIGKILL); the time until no fence names it (the
//!   survivors took them) and until the survivors own and have reconciled every name.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

// Shared with the other benchmarks; this one needs only its argument helper.
#[allow(dead_code)]
mod common;

use common::{arg_after, create_namespace};
use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, ObjectMeta, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use multicluster_runtime::providers::Clusters;
use multicluster_runtime::{
    Action, Builder, Cluster, ClusterName, Context, Manager, Sharding, watcher,
};
use multicluster_runtime_testenv::TestEnv;

const GROUP: &str = "bench";
const HOST_NAMESPACE: &str = "mcr-system";

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let number = |flag: &str, default: usize| {
        arg_after(&args, flag)
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    if let Some(id) = arg_after(&args, "--child") {
        // `RUST_LOG` set: the replicas log to stderr, each line with its identity.
        if std::env::var_os("RUST_LOG").is_some() {
            tracing_subscriber::fmt()
                .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
                .with_writer(std::io::stderr)
                .init();
        }
        let members: Vec<String> = args
            .windows(2)
            .filter(|w| w[0] == "--member")
            .map(|w| w[1].clone())
            .collect();
        let host = arg_after(&args, "--host").expect("--host");
        rt.block_on(replica(&id, number("--n", 10_000), &members, &host));
        return;
    }
    rt.block_on(parent(
        number("--n", 10_000),
        number("--replicas", 3),
        number("--members", 3),
        Duration::from_secs(number("--steady", 30) as u64),
    ));
}

/// What the parent knows of a replica from its output.
#[derive(Default)]
struct Seen {
    owned: AtomicUsize,
    reconciled: AtomicUsize,
}

async fn parent(n: usize, replicas: usize, members: usize, steady: Duration) {
    println!(
        "\n== sharding: {replicas} replicas, {n} cluster names over {members} API servers, Leases on another"
    );
    let env = TestEnv::builder()
        .clusters(members + 1)
        .start()
        .await
        .expect("testenv");
    let host_cluster = env.cluster(members).expect("host");
    let host = host_cluster.client().expect("host client");
    create_namespace(&host, HOST_NAMESPACE).await;
    let mut member_configs = Vec::new();
    for i in 0..members {
        let tc = env.cluster(i).expect("member");
        let client = tc.client().expect("client");
        create_namespace(&client, "bench").await;
        let cm = ConfigMap {
            metadata: ObjectMeta {
                name: Some("probe".into()),
                labels: Some(BTreeMap::from([("bench".to_string(), "mcr".to_string())])),
                ..Default::default()
            },
            ..Default::default()
        };
        Api::<ConfigMap>::namespaced(client, "bench")
            .create(&PostParams::default(), &cm)
            .await
            .expect("probe");
        member_configs.push(tc.kubeconfig_path().display().to_string());
    }
    let host_config = host_cluster.kubeconfig_path().display().to_string();

    let started = Instant::now();
    let mut children: Vec<(String, Child, Arc<Seen>)> = (0..replicas)
        .map(|i| {
            let id = format!("r{i}");
            let (child, seen) = spawn(&id, n, &member_configs, &host_config);
            (id, child, seen)
        })
        .collect();
    let all_reconciled = |children: &[(String, Child, Arc<Seen>)]| {
        let owned: usize = children
            .iter()
            .map(|(_, _, s)| s.owned.load(Ordering::SeqCst))
            .sum();
        owned == n
            && children.iter().all(|(_, _, s)| {
                let owned = s.owned.load(Ordering::SeqCst);
                owned > 0 && s.reconciled.load(Ordering::SeqCst) >= owned
            })
    };
    wait(Duration::from_secs(600), "a stable assignment", || {
        all_reconciled(&children)
    })
    .await;
    let stable = started.elapsed();
    println!("stable assignment, every name reconciled: {stable:.2?} after the replicas started");
    for (id, child, seen) in &children {
        println!(
            "  {id}: owns {}, RSS {:.0} MiB",
            seen.owned.load(Ordering::SeqCst),
            rss_mib(child.id())
        );
    }

    // Steady state: what the host serves on Leases.
    tokio::time::sleep(Duration::from_secs(10)).await;
    let before = lease_requests(&host).await;
    let window = Instant::now();
    tokio::time::sleep(steady).await;
    let after = lease_requests(&host).await;
    let seconds = window.elapsed().as_secs_f64();
    println!("host requests on leases at steady state, per second over {seconds:.0} s:");
    for (verb, count) in &after {
        let rate = (count - before.get(verb).copied().unwrap_or(0.0)) / seconds;
        println!("  {verb}: {rate:.2}");
    }
    for (id, child, _) in &children {
        println!("  {id}: RSS {:.0} MiB at steady state", rss_mib(child.id()));
    }

    // Take-over: the last replica is killed.
    let (killed_id, mut killed, _) = children.pop().expect("a replica");
    // The fences as a watch keeps them (listing 10,000 Leases every poll would load the
    // host the survivors write to).
    let fences = Api::<Lease>::namespaced(host.clone(), HOST_NAMESPACE);
    let (held, writer) = kube::runtime::reflector::store::<Lease>();
    let selector = format!(
        "{}={GROUP},{}=fence",
        multicluster_runtime::shard::GROUP_LABEL,
        multicluster_runtime::shard::ROLE_LABEL
    );
    let follow = tokio::spawn(
        kube::runtime::reflector::reflector(
            writer,
            kube::runtime::watcher::watcher(fences, watcher::Config::default().labels(&selector)),
        )
        .for_each(|_| std::future::ready(())),
    );
    held.wait_until_ready().await.expect("the fences listed");
    let held_by_killed = || async {
        held.state()
            .iter()
            .filter(|l| {
                l.spec.as_ref().and_then(|s| s.holder_identity.as_deref()) == Some(&killed_id)
            })
            .count()
    };
    let had = held_by_killed().await;
    let reconciled_before: usize = children
        .iter()
        .map(|(_, _, s)| s.reconciled.load(Ordering::SeqCst))
        .sum();
    killed.kill().expect("SIGKILL");
    let _ = killed.wait();
    let kill = Instant::now();
    // When the first of its fences changed hands: the survivors counted it gone.
    let mut first_taken = None;
    loop {
        let left = held_by_killed().await;
        if left < had && first_taken.is_none() {
            first_taken = Some(kill.elapsed());
        }
        if left == 0 {
            break;
        }
        assert!(
            kill.elapsed() < Duration::from_secs(300),
            "fences never taken over"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let fences_taken = kill.elapsed();
    follow.abort();
    // Each name taken over reconciles its one object once more.
    wait(
        Duration::from_secs(300),
        "the survivors own every name",
        || {
            let (owned, reconciled) = children.iter().fold((0, 0), |(o, r), (_, _, s)| {
                (
                    o + s.owned.load(Ordering::SeqCst),
                    r + s.reconciled.load(Ordering::SeqCst),
                )
            });
            owned == n && reconciled >= reconciled_before + had
        },
    )
    .await;
    let reconciled = kill.elapsed();
    println!(
        "take-over after SIGKILL of {killed_id} ({had} fences): the first fence taken {:.2?}, all held by the survivors {fences_taken:.2?}, every name owned and reconciled {reconciled:.2?} after the kill",
        first_taken.unwrap_or(fences_taken)
    );
    for (_, child, _) in &mut children {
        let _ = child.kill();
        let _ = child.wait();
    }
    drop(env);
}

fn spawn(id: &str, n: usize, members: &[String], host: &str) -> (Child, Arc<Seen>) {
    let exe = std::env::current_exe().expect("current_exe");
    let mut cmd = Command::new(exe);
    cmd.args(["--child", id, "--n", &n.to_string(), "--host", host]);
    for member in members {
        cmd.args(["--member", member]);
    }
    cmd.stdout(Stdio::piped());
    let mut child = cmd.spawn().expect("spawn replica");
    let stdout = child.stdout.take().expect("stdout");
    let seen = Arc::new(Seen::default());
    let reader = seen.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let mut fields = line.split_whitespace().filter_map(|f| f.split_once('='));
            if let (Some(("owned", owned)), Some(("reconciled", reconciled))) =
                (fields.next(), fields.next())
            {
                reader
                    .owned
                    .store(owned.parse().unwrap_or(0), Ordering::SeqCst);
                reader
                    .reconciled
                    .store(reconciled.parse().unwrap_or(0), Ordering::SeqCst);
            }
        }
    });
    (child, seen)
}

async fn wait(limit: Duration, what: &str, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < limit, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `apiserver_request_total` for `leases`, summed by verb.
async fn lease_requests(host: &kube::Client) -> BTreeMap<String, f64> {
    let request = http::Request::get("/metrics")
        .body(Vec::new())
        .expect("request");
    let text = host.request_text(request).await.expect("metrics");
    let mut by_verb = BTreeMap::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("apiserver_request_total{") else {
            continue;
        };
        let Some((labels, value)) = rest.split_once("} ") else {
            continue;
        };
        if !labels.contains("resource=\"leases\"") {
            continue;
        }
        let verb = labels
            .split(',')
            .find_map(|l| l.strip_prefix("verb=\""))
            .map(|v| v.trim_end_matches('"').to_string())
            .unwrap_or_default();
        *by_verb.entry(verb).or_insert(0.0) += value.trim().parse::<f64>().unwrap_or(0.0);
    }
    by_verb
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

/// A replica: every name, sharded; prints what it owns and has reconciled.
async fn replica(id: &str, n: usize, members: &[String], host: &str) {
    let mut configs = Vec::new();
    for path in members {
        configs.push(config(path).await);
    }
    let host = kube::Client::try_from(config(host).await).expect("host client");
    let clusters = Clusters::<ClusterName>::new();
    for i in 0..n {
        let cluster = Cluster::from_config(
            ClusterName::from(format!("c-{i:05}")),
            configs[i % configs.len()].clone(),
        )
        .expect("cluster");
        clusters.add(cluster).expect("add");
    }
    let manager = Arc::new(
        Manager::new(clusters).sharding(Sharding::new(host, HOST_NAMESPACE, GROUP).identity(id)),
    );
    let reconciled = Arc::new(AtomicUsize::new(0));
    Builder::<_, ConfigMap>::new(&manager, watcher::Config::default().labels("bench=mcr"))
        .concurrency(16)
        .start(count, never, reconciled.clone());
    let run = {
        let manager = manager.clone();
        tokio::spawn(async move { manager.run().await })
    };
    let mut last = String::new();
    while !run.is_finished() {
        let line = format!(
            "owned={} reconciled={}",
            manager.fleet().len(),
            reconciled.load(Ordering::SeqCst)
        );
        if last != line {
            println!("{line}");
            last = line;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    eprintln!("replica {id}: {:?}", run.await);
}

async fn config(path: &str) -> kube::Config {
    let kc = Kubeconfig::read_from(path).expect("kubeconfig");
    kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
        .await
        .expect("config")
}

async fn count(
    _: Arc<ConfigMap>,
    ctx: Context<ClusterName, AtomicUsize>,
) -> Result<Action, kube::Error> {
    ctx.state().fetch_add(1, Ordering::SeqCst);
    Ok(Action::await_change())
}

fn never(_: Arc<ConfigMap>, _: &kube::Error, _: &Context<ClusterName, AtomicUsize>) -> Action {
    Action::await_change()
}
