//! Runtime benchmarks against real control planes; figures go to `BENCHMARKS.md`.
//!
//! ```sh
//! export MCR_TESTENV_ASSETS=$(scripts/testenv-assets.sh)
//! cargo bench --bench runtime -- callgrind [--fleet] [--runs N]   # zero cost of single-cluster mode
//! cargo bench --bench runtime -- callgrind --concurrency [--runs N] # single mode at 4 and 64 at once
//! cargo bench --bench runtime -- throughput [--runs N] [--metrics]   # fleet vs single vs kube-runtime; fleet with/without metrics
//! cargo bench --bench runtime --features opentelemetry -- callgrind --tracing [--runs N] # fleet with metrics, OpenTelemetry layer off, on, on at 1 %
//! cargo bench --bench runtime -- scale        # engage latency, RSS, 1,000 clusters
//! cargo bench --bench runtime -- namespaces   # 1,000 namespaces as clusters, 100 Nodes
//! ```
//!
//! Workload for `callgrind` and `throughput`: 5,000 ConfigMaps in one testenv cluster, created
//! before the controller starts; a run ends when all 5,000 were reconciled once. The same
//! reconcile body (count, stop at 5,000) runs through a hand-written kube-runtime
//! `Controller` (`kube`), `Builder<SingleProvider>` (`single`) and `Builder<Clusters>` with the
//! one cluster (`fleet`). Each run is a child process on a current-thread runtime, so
//! callgrind counts only the controller, not the control plane or the set-up.
//! `MCR_BENCH_CALLGRIND_OUT=DIR` keeps each run's profile as `DIR/callgrind.MODE.PID`
//! (for `callgrind_annotate`).

use std::collections::{BTreeMap, HashMap};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

// Shared with the other benchmarks; this one needs only some of it.
#[allow(dead_code)]
mod common;

use common::{arg_after, cpu_time, create_config_maps};
use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, ObjectMeta, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube_runtime::{Controller, watcher};
use multicluster_runtime::providers::{Clusters, Namespaces, SingleProvider};
use multicluster_runtime::{Action, Builder, Cluster, ClusterId, ClusterName, Context, Manager};
use multicluster_runtime_testenv::TestEnv;

const OBJECTS: usize = 5_000;
const LABEL: &str = "bench=runtime";

fn rss_kib(pid: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(mode) = arg_after(&args, "--child") {
        let kubeconfig = arg_after(&args, "--kubeconfig").expect("--kubeconfig");
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(child(&mode, &kubeconfig));
        return;
    }
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let all = !args
        .iter()
        .any(|a| ["callgrind", "throughput", "scale", "namespaces"].contains(&a.as_str()));
    rt.block_on(async {
        if all || args.iter().any(|a| a == "callgrind") || args.iter().any(|a| a == "throughput") {
            let env = TestEnv::start().await.expect("testenv");
            let cluster = env.cluster(0).expect("cluster");
            populate(cluster.client().expect("client")).await;
            let kubeconfig = cluster.kubeconfig_path().display().to_string();
            if all || args.iter().any(|a| a == "throughput") {
                let runs = arg_after(&args, "--runs")
                    .and_then(|r| r.parse().ok())
                    .unwrap_or(3);
                // `--metrics`: fleet mode with and without metrics, for their overhead.
                let modes: &[&'static str] = if args.iter().any(|a| a == "--metrics") {
                    &["fleet", "fleet-metrics"]
                } else {
                    &["kube", "single", "fleet"]
                };
                throughput(&kubeconfig, runs, modes);
            }
            if all || args.iter().any(|a| a == "callgrind") {
                // `--fleet` adds fleet mode, to compare its instructions across commits.
                let modes: &[&str] = if args.iter().any(|a| a == "--metrics") {
                    &["fleet", "fleet-metrics"]
                } else if args.iter().any(|a| a == "--tracing") {
                    // The layer off, on with every trace sampled and with 1 in 100, metrics on
                    // in all (its exemplars are part of it).
                    &["fleet-metrics", "fleet-traced", "fleet-sampled"]
                } else if args.iter().any(|a| a == "--concurrency") {
                    // Single mode's backlog: kube-runtime's runner polls every running
                    // reconcile on each wake-up, so its cost grows with how many run at once.
                    &["single", "single-c4", "single-c64"]
                } else if args.iter().any(|a| a == "--fleet") {
                    &["kube", "kube-streaming", "single", "fleet"]
                } else {
                    &["kube", "kube-streaming", "single"]
                };
                let runs = arg_after(&args, "--runs")
                    .and_then(|r| r.parse().ok())
                    .unwrap_or(5);
                callgrind(&kubeconfig, modes, runs);
            }
        }
        if all || args.iter().any(|a| a == "scale") {
            let clusters = arg_after(&args, "--clusters")
                .and_then(|n| n.parse().ok())
                .unwrap_or(1000);
            scale(clusters).await;
        }
        if all || args.iter().any(|a| a == "namespaces") {
            let namespaces = arg_after(&args, "--namespaces")
                .and_then(|n| n.parse().ok())
                .unwrap_or(1000);
            let nodes = arg_after(&args, "--nodes")
                .and_then(|n| n.parse().ok())
                .unwrap_or(100);
            namespaces_as_clusters(namespaces, nodes).await;
        }
    });
}

async fn populate(client: kube::Client) {
    let api: Api<ConfigMap> = Api::namespaced(client, "default");
    let started = Instant::now();
    create_config_maps(&api, OBJECTS, "runtime").await;
    println!("created {OBJECTS} ConfigMaps in {:.1?}", started.elapsed());
}

fn run_child(mode: &str, kubeconfig: &str, under_callgrind: bool) -> (Duration, Option<u64>) {
    let exe = std::env::current_exe().expect("current_exe");
    let mut cmd = if under_callgrind {
        let mut c = Command::new("valgrind");
        let out = match std::env::var("MCR_BENCH_CALLGRIND_OUT") {
            Ok(dir) => format!("--callgrind-out-file={dir}/callgrind.{mode}.%p"),
            Err(_) => "--callgrind-out-file=/dev/null".to_string(),
        };
        c.args(["--tool=callgrind", &out]).arg(&exe);
        c
    } else {
        Command::new(&exe)
    };
    cmd.args(["--child", mode, "--kubeconfig", kubeconfig]);
    let started = Instant::now();
    let out = cmd.output().expect("spawn child");
    let elapsed = started.elapsed();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "child {mode} failed:\n{stdout}\n{stderr}"
    );
    assert!(
        stdout.contains(&format!("reconciled {OBJECTS}")),
        "child {mode}: {stdout}"
    );
    // valgrind reports "==pid== Collected : <instructions>".
    let instructions = stderr
        .lines()
        .find_map(|l| l.split("Collected :").nth(1))
        .and_then(|n| n.trim().replace(',', "").parse().ok());
    (elapsed, instructions)
}

fn throughput(kubeconfig: &str, runs: usize, modes: &[&'static str]) {
    println!(
        "\n== throughput: {OBJECTS} reconciles on one cluster, {runs} runs each, wall time of the child process"
    );
    let mut times: HashMap<&str, Vec<Duration>> = HashMap::new();
    for _ in 0..runs {
        // Alternating, so drift on the machine affects every mode alike.
        for &mode in modes {
            times
                .entry(mode)
                .or_default()
                .push(run_child(mode, kubeconfig, false).0);
        }
    }
    let mut medians = HashMap::new();
    for &mode in modes {
        let mut times = times[mode].clone();
        times.sort();
        let median = times[times.len() / 2];
        medians.insert(mode, median);
        println!(
            "{mode:<14} median {:.3}s ({:.0} reconciles/s)  runs {:?}",
            median.as_secs_f64(),
            OBJECTS as f64 / median.as_secs_f64(),
            times
                .iter()
                .map(|t| format!("{:.3}", t.as_secs_f64()))
                .collect::<Vec<_>>()
        );
    }
    if let (Some(single), Some(fleet)) = (medians.get("single"), medians.get("fleet")) {
        let ratio = single.as_secs_f64() / fleet.as_secs_f64();
        println!("fleet throughput / single throughput = {ratio:.3}");
    }
    if let (Some(fleet), Some(metrics)) = (medians.get("fleet"), medians.get("fleet-metrics")) {
        let ratio = fleet.as_secs_f64() / metrics.as_secs_f64();
        println!("fleet throughput with metrics / without = {ratio:.3}");
    }
}

fn callgrind(kubeconfig: &str, modes: &[&'static str], runs: usize) {
    println!(
        "\n== callgrind: instructions of the whole controller process, {OBJECTS} reconciles, {runs} runs each"
    );
    let mut counts: HashMap<&str, Vec<u64>> = HashMap::new();
    for _ in 0..runs {
        // Alternating, so drift on the machine affects every mode alike.
        for &mode in modes {
            let (_, instructions) = run_child(mode, kubeconfig, true);
            counts
                .entry(mode)
                .or_default()
                .push(instructions.expect("valgrind printed no instruction count"));
        }
    }
    let median = |m: &str| {
        let mut v = counts[m].clone();
        v.sort();
        v[v.len() / 2]
    };
    for &mode in modes {
        println!("{mode:<14} median {} runs {:?}", median(mode), counts[mode]);
    }
    let ratio = |a: &str, b: &str| {
        let (a, b) = (median(a), median(b));
        println!(
            " {:.4} (medians); difference {} instructions per reconcile",
            a as f64 / b as f64,
            (a as i64 - b as i64) / OBJECTS as i64
        );
    };
    if modes.contains(&"single") && modes.contains(&"kube") {
        print!("single / kube:");
        ratio("single", "kube");
    }
    if modes.contains(&"kube-streaming") {
        print!("single / kube-streaming:");
        ratio("single", "kube-streaming");
    }
    for limited in ["single-c4", "single-c64"] {
        if modes.contains(&limited) {
            print!("{limited} / single:");
            ratio(limited, "single");
        }
    }
    if modes.contains(&"fleet-metrics") && modes.contains(&"fleet") {
        print!("fleet-metrics / fleet:");
        ratio("fleet-metrics", "fleet");
    }
    for traced in ["fleet-traced", "fleet-sampled"] {
        if modes.contains(&traced) {
            print!("{traced} / fleet-metrics:");
            ratio(traced, "fleet-metrics");
        }
    }
}

/// `fleet-traced`: the OpenTelemetry layer exporting every span (OTLP/HTTP, in batches) to a
/// collector in this process that answers 200 to each export; `fleet-sampled`: 1 trace in 100.
/// The guard is kept to the end.
#[cfg(feature = "opentelemetry")]
async fn traced(ratio: f64) -> multicluster_runtime::telemetry::TracingGuard {
    use tracing_subscriber::prelude::*;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("collector");
    let address = listener.local_addr().expect("address");
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let service = hyper::service::service_fn(
                    |request: hyper::Request<hyper::body::Incoming>| async move {
                        use http_body_util::BodyExt;
                        let _ = request.into_body().collect().await;
                        Ok::<_, std::convert::Infallible>(hyper::Response::new(
                            http_body_util::Full::new(bytes::Bytes::new()),
                        ))
                    },
                );
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    let (layer, guard) = multicluster_runtime::telemetry::Tracing::otlp()
        .endpoint(format!("http://{address}"))
        .sample_ratio(ratio)
        .install()
        .expect("tracing");
    tracing_subscriber::registry()
        .with(layer.with_filter(tracing_subscriber::filter::LevelFilter::INFO))
        .init();
    guard
}

/// Counts reconciles and ends the process at `OBJECTS`.
#[derive(Default)]
struct Counter(AtomicUsize);

impl Counter {
    fn hit(&self) {
        if self.0.fetch_add(1, Ordering::Relaxed) + 1 == OBJECTS {
            println!("reconciled {OBJECTS}");
            std::process::exit(0);
        }
    }
}

async fn count<C: ClusterId>(
    _: Arc<ConfigMap>,
    ctx: Context<C, Counter>,
) -> Result<Action, kube::Error> {
    ctx.state().hit();
    Ok(Action::await_change())
}

fn never<C: ClusterId>(_: Arc<ConfigMap>, _: &kube::Error, _: &Context<C, Counter>) -> Action {
    Action::await_change()
}

async fn child(mode: &str, kubeconfig: &str) {
    let kc = Kubeconfig::read_from(kubeconfig).expect("kubeconfig");
    let config = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
        .await
        .expect("config");
    let client = kube::Client::try_from(config).expect("client");
    let wc = watcher::Config::default().labels(LABEL);
    match mode {
        // `kube-streaming`: the same controller listing by a streaming list, as this crate's
        // watches do by default.
        "kube" | "kube-streaming" => {
            let wc = if mode == "kube-streaming" {
                wc.streaming_lists()
            } else {
                wc
            };
            Controller::new(Api::<ConfigMap>::all(client), wc)
                .run(
                    |_, counter: Arc<Counter>| async move {
                        counter.hit();
                        Ok::<_, kube::Error>(kube_runtime::controller::Action::await_change())
                    },
                    |_, _, _| kube_runtime::controller::Action::await_change(),
                    Arc::new(Counter::default()),
                )
                .for_each(|_| std::future::ready(()))
                .await
        }
        "single" => {
            let manager = Manager::new(SingleProvider::new(client));
            Builder::<_, ConfigMap>::new(&manager, wc)
                .run(count, never, Arc::new(Counter::default()))
                .await
        }
        // `single-cN`: the same with at most N reconciles at once.
        limited if limited.starts_with("single-c") => {
            let n: u16 = limited["single-c".len()..].parse().expect("concurrency");
            let manager = Manager::new(SingleProvider::new(client));
            Builder::<_, ConfigMap>::new(&manager, wc)
                .concurrency(n)
                .run(count, never, Arc::new(Counter::default()))
                .await
        }
        "fleet" | "fleet-metrics" | "fleet-traced" | "fleet-sampled" => {
            #[cfg(feature = "opentelemetry")]
            let _tracing = match mode {
                "fleet-traced" => Some(traced(1.0).await),
                "fleet-sampled" => Some(traced(0.01).await),
                _ => None,
            };
            #[cfg(not(feature = "opentelemetry"))]
            assert!(
                !mode.ends_with("-traced") && !mode.ends_with("-sampled"),
                "{mode} needs --features opentelemetry"
            );
            let clusters = Clusters::new();
            clusters
                .add(Cluster::new(ClusterName::from("only"), client))
                .expect("add");
            let mut registry = prometheus_client::registry::Registry::default();
            let manager = if mode != "fleet" {
                Manager::new(clusters).metrics(multicluster_runtime::Metrics::new(&mut registry))
            } else {
                Manager::new(clusters)
            };
            let controller = Builder::<_, ConfigMap>::new(&manager, wc).run(
                count,
                never,
                Arc::new(Counter::default()),
            );
            let _ = tokio::join!(manager.run(), controller);
        }
        other => panic!("unknown mode {other}"),
    }
}

/// First-reconcile times per cluster.
#[derive(Default)]
struct FirstSeen {
    at: Mutex<HashMap<ClusterName, Instant>>,
    notify: tokio::sync::Notify,
}

async fn note(
    _: Arc<ConfigMap>,
    ctx: Context<ClusterName, FirstSeen>,
) -> Result<Action, kube::Error> {
    let state = ctx.state();
    if let Ok(mut at) = state.at.lock() {
        at.entry(ctx.cluster_id().clone())
            .or_insert_with(Instant::now);
    }
    state.notify.notify_waiters();
    Ok(Action::await_change())
}

async fn scale(n: usize) {
    println!("\n== scale: {n} clusters engaged one after another, all names of one apiserver");
    let env = TestEnv::start().await.expect("testenv");
    let tc = env.cluster(0).expect("cluster");
    let api: Api<ConfigMap> = Api::namespaced(tc.client().expect("client"), "default");
    let cm = ConfigMap {
        metadata: ObjectMeta {
            name: Some("scale".into()),
            labels: Some(BTreeMap::from([("bench".to_string(), "scale".to_string())])),
            ..Default::default()
        },
        ..Default::default()
    };
    api.create(&PostParams::default(), &cm)
        .await
        .expect("create");

    let clusters = Clusters::new();
    let manager = Arc::new(Manager::new(clusters.clone()));
    let seen = Arc::new(FirstSeen::default());
    Builder::<_, ConfigMap>::new(&manager, watcher::Config::default().labels("bench=scale")).start(
        note,
        |_, _: &kube::Error, _: &Context<ClusterName, FirstSeen>| Action::await_change(),
        seen.clone(),
    );
    let run = {
        let manager = manager.clone();
        tokio::spawn(async move { manager.run().await })
    };

    let engage = |name: String| {
        let seen = seen.clone();
        let clusters = clusters.clone();
        let config = tc.config();
        async move {
            let id = ClusterName::from(name);
            let started = Instant::now();
            let cluster = Cluster::from_config(id.clone(), config).expect("cluster");
            clusters.add(cluster).expect("engage");
            loop {
                let notified = seen.notify.notified();
                if let Some(at) = seen.at.lock().ok().and_then(|m| m.get(&id).copied()) {
                    return at - started;
                }
                let _ = tokio::time::timeout(Duration::from_millis(50), notified).await;
            }
        }
    };
    // One-time costs (TLS provider, first watch) are not per cluster.
    engage("warm-up".to_string()).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let base = rss_kib("self");
    let mut latencies = Vec::with_capacity(n);
    let started = Instant::now();
    for i in 0..n {
        latencies.push(engage(format!("c-{i:04}")).await);
    }
    let engage_all = started.elapsed();
    tokio::time::sleep(Duration::from_secs(10)).await;
    let after = rss_kib("self");
    assert_eq!(manager.fleet().len(), n + 1);
    latencies.sort();
    let pct = |p: f64| latencies[((latencies.len() as f64 * p) as usize).min(latencies.len() - 1)];
    println!(
        "engage-to-first-reconcile: p50 {:.1?} p95 {:.1?} p99 {:.1?} max {:.1?} (all {n} engaged in {:.1?})",
        pct(0.50),
        pct(0.95),
        pct(0.99),
        latencies[latencies.len() - 1],
        engage_all
    );
    println!(
        "RSS: {} MiB before, {} MiB with {n} more idle clusters; {} KiB per cluster (each caching 1 ConfigMap, with its own client and TLS connection)",
        base / 1024,
        after / 1024,
        (after.saturating_sub(base)) / n as u64
    );
    println!(
        "apiserver RSS: {} MiB",
        tc.apiserver_pid()
            .map(|p| rss_kib(&p.to_string()))
            .unwrap_or(0)
            / 1024
    );
    manager.shutdown();
    let _ = run.await;
}

/// What the namespace-clusters reconciled: per cluster, its ConfigMap seen, which Nodes were
/// seen, and which Nodes were seen at the update round's version (bit i: `node-i`).
#[derive(Default)]
struct NamespaceSeen {
    by_cluster: Mutex<HashMap<ClusterName, (bool, u128, u128)>>,
    /// How many clusters have seen everything of the first listing / the update round.
    listed: AtomicUsize,
    updated: AtomicUsize,
    nodes: usize,
    notify: tokio::sync::Notify,
}

impl NamespaceSeen {
    fn all_nodes(&self) -> u128 {
        if self.nodes >= 128 {
            u128::MAX
        } else {
            (1u128 << self.nodes) - 1
        }
    }

    fn note(&self, cluster: &ClusterName, configmap: bool, node: Option<(usize, bool)>) {
        let all = self.all_nodes();
        let Ok(mut seen) = self.by_cluster.lock() else {
            return;
        };
        let entry = seen.entry(cluster.clone()).or_default();
        let before = (entry.0 && entry.1 == all, entry.2 == all);
        entry.0 |= configmap;
        if let Some((i, updated)) = node {
            entry.1 |= 1 << i;
            if updated {
                entry.2 |= 1 << i;
            }
        }
        let after = (entry.0 && entry.1 == all, entry.2 == all);
        if after.0 && !before.0 {
            self.listed.fetch_add(1, Ordering::SeqCst);
        }
        if after.1 && !before.1 {
            self.updated.fetch_add(1, Ordering::SeqCst);
        }
        drop(seen);
        self.notify.notify_waiters();
    }

    async fn wait(&self, counter: &AtomicUsize, n: usize) {
        loop {
            let notified = self.notify.notified();
            if counter.load(Ordering::SeqCst) >= n {
                return;
            }
            let _ = tokio::time::timeout(Duration::from_millis(50), notified).await;
        }
    }
}

/// `n` namespaces labelled `bench=ns`, each with one ConfigMap carrying 1 KiB of data, and
/// `nodes` Nodes carrying 4 KiB of annotations (about the size of a small real Node), all on
/// one apiserver; then the Namespaces provider with a ConfigMap and a Node controller. The
/// Nodes are cluster-scoped, so every namespace-cluster sees all of them.
async fn namespaces_as_clusters(n: usize, nodes: usize) {
    use k8s_openapi::api::core::v1::Node;
    assert!(nodes <= 128, "--nodes is at most 128");
    println!(
        "\n== namespaces: {n} namespaces of one apiserver as clusters (Namespaces provider), {nodes} Nodes"
    );
    let env = TestEnv::start().await.expect("testenv");
    let tc = env.cluster(0).expect("cluster");
    let host = tc.client().expect("client");
    let created = Instant::now();
    futures::stream::iter(0..n)
        .for_each_concurrent(32, |i| {
            let host = host.clone();
            async move {
                let name = format!("ns-{i:04}");
                let ns = k8s_openapi::api::core::v1::Namespace {
                    metadata: ObjectMeta {
                        name: Some(name.clone()),
                        labels: Some(BTreeMap::from([("bench".to_string(), "ns".to_string())])),
                        ..Default::default()
                    },
                    ..Default::default()
                };
                Api::all(host.clone())
                    .create(&PostParams::default(), &ns)
                    .await
                    .expect("namespace");
                let cm = ConfigMap {
                    metadata: ObjectMeta {
                        name: Some("scale".into()),
                        labels: Some(BTreeMap::from([("bench".to_string(), "scale".to_string())])),
                        ..Default::default()
                    },
                    data: Some(BTreeMap::from([("payload".to_string(), "x".repeat(1024))])),
                    ..Default::default()
                };
                Api::<ConfigMap>::namespaced(host, &name)
                    .create(&PostParams::default(), &cm)
                    .await
                    .expect("configmap");
            }
        })
        .await;
    let node_api = Api::<Node>::all(host.clone());
    for i in 0..nodes {
        let annotations = (0..16)
            .map(|j| (format!("bench.example/a{j:02}"), format!("{j}").repeat(256)))
            .collect();
        let node = Node {
            metadata: ObjectMeta {
                name: Some(format!("node-{i:03}")),
                labels: Some(BTreeMap::from([("bench".to_string(), "node".to_string())])),
                annotations: Some(annotations),
                ..Default::default()
            },
            ..Default::default()
        };
        node_api
            .create(&PostParams::default(), &node)
            .await
            .expect("node");
    }
    println!(
        "created {n} namespaces with a ConfigMap each and {nodes} Nodes in {:.1?}",
        created.elapsed()
    );
    let cluster_watches = tc
        .served_watches("configmaps", true)
        .await
        .expect("metrics");
    let namespace_watches = tc
        .served_watches("configmaps", false)
        .await
        .expect("metrics");

    tokio::time::sleep(Duration::from_secs(2)).await;
    let base = rss_kib("self");
    let provider = Namespaces::new(host.clone()).labels("bench=ns");
    let manager = Arc::new(Manager::new(provider.clone()));
    let seen = Arc::new(NamespaceSeen {
        nodes,
        ..Default::default()
    });
    Builder::<_, ConfigMap>::new(&manager, watcher::Config::default().labels("bench=scale")).start(
        |_, ctx: Context<ClusterName, NamespaceSeen>| async move {
            ctx.state().note(ctx.cluster_id(), true, None);
            Ok::<_, kube::Error>(Action::await_change())
        },
        |_, _: &kube::Error, _: &Context<ClusterName, NamespaceSeen>| Action::await_change(),
        seen.clone(),
    );
    Builder::<_, Node>::new(&manager, watcher::Config::default().labels("bench=node")).start(
        |node: Arc<Node>, ctx: Context<ClusterName, NamespaceSeen>| async move {
            let index = node
                .metadata
                .name
                .as_deref()
                .and_then(|name| name.strip_prefix("node-")?.parse::<usize>().ok());
            let updated = node
                .metadata
                .labels
                .as_ref()
                .is_some_and(|l| l.get("round").map(String::as_str) == Some("1"));
            if let Some(i) = index {
                ctx.state()
                    .note(ctx.cluster_id(), false, Some((i, updated)));
            }
            Ok::<_, kube::Error>(Action::await_change())
        },
        |_, _: &kube::Error, _: &Context<ClusterName, NamespaceSeen>| Action::await_change(),
        seen.clone(),
    );
    let started = Instant::now();
    let cpu = cpu_time();
    let run = {
        let manager = manager.clone();
        tokio::spawn(async move { manager.run().await })
    };
    seen.wait(&seen.listed, n).await;
    let all = started.elapsed();
    let all_cpu = cpu_time() - cpu;
    tokio::time::sleep(Duration::from_secs(10)).await;
    let after = rss_kib("self");
    println!(
        "all {n} namespace-clusters engaged, each reconciled its ConfigMap and {nodes} Nodes, in {all:.1?} ({all_cpu:.1?} CPU)"
    );
    println!(
        "RSS: {} MiB before, {} MiB after; {} KiB per namespace-cluster (each caching 1 ConfigMap and {nodes} Nodes)",
        base / 1024,
        after / 1024,
        after.saturating_sub(base) / n as u64
    );
    let fds: Vec<String> = std::fs::read_dir("/proc/self/fd")
        .map(|dir| {
            dir.filter_map(Result::ok)
                .filter_map(|e| std::fs::read_link(e.path()).ok())
                .map(|t| t.to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    let threads = std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("Threads:").map(|t| t.trim().to_string()))
        .unwrap_or_default();
    println!(
        "open files: {} ({} sockets; the bench process's own setup clients included); threads: {threads}",
        fds.len(),
        fds.iter().filter(|t| t.starts_with("socket:")).count()
    );

    // One update of every Node, seen by every namespace-cluster.
    if nodes > 0 {
        node_round(&node_api, &seen, n, nodes).await;
    }
    println!(
        "host watches kept by the provider: {}; apiserver: +{} cluster-wide ConfigMap watches, +{} per-namespace ones",
        provider.host_watches(),
        tc.served_watches("configmaps", true)
            .await
            .expect("metrics")
            - cluster_watches,
        tc.served_watches("configmaps", false)
            .await
            .expect("metrics")
            - namespace_watches,
    );
    manager.shutdown();
    let _ = run.await;
}

/// Updates every Node once and waits until each of the `n` namespace-clusters reconciled
/// every Node at its new version.
async fn node_round(
    node_api: &Api<k8s_openapi::api::core::v1::Node>,
    seen: &NamespaceSeen,
    n: usize,
    nodes: usize,
) {
    let round = Instant::now();
    let cpu = cpu_time();
    for i in 0..nodes {
        node_api
            .patch(
                &format!("node-{i:03}"),
                &kube::api::PatchParams::default(),
                &kube::api::Patch::Merge(
                    serde_json::json!({"metadata": {"labels": {"round": "1"}}}),
                ),
            )
            .await
            .expect("patch node");
    }
    seen.wait(&seen.updated, n).await;
    let round_time = round.elapsed();
    let round_cpu = cpu_time() - cpu;
    tokio::time::sleep(Duration::from_secs(10)).await;
    println!(
        "{nodes} Node updates reconciled in all {n} namespace-clusters in {round_time:.1?} ({round_cpu:.1?} CPU); RSS after: {} MiB",
        rss_kib("self") / 1024
    );
}
