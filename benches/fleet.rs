//! Fleet benchmarks W1 and W2 (the efficiency workloads), against two testenv apiservers;
//! figures go to `BENCHMARKS.md`.
//!
//! ```sh
//! export MCR_TESTENV_ASSETS=$(scripts/testenv-assets.sh)
//! cargo bench --bench fleet -- w1 [--runs 3] [--n 1000] [--sequential 200 (0: none)] [--variant FLAG]
//! cargo bench --bench fleet -- w2 [--runs 3] [--compare] [--variant FLAG]...
//!
//! Child flags for `--variant`: `--paged-lists`, `--keep-managed-fields`, `--kube-client`.
//! `MCR_BENCH_WRAP="valgrind --tool=massif"` runs each child under that command.
//! cargo bench --bench fleet -- scale [--n 10000]   # with metrics served; one scrape at the end
//! ```
//!
//! W1: each apiserver has namespace `bench` with 10 ConfigMaps labelled `bench=mcr`. A child
//! process starts a manager with one ConfigMap controller (that selector, concurrency 4, a
//! reconcile that only counts), then adds N cluster names `c-0000…` at once, assigned round
//! robin to the two apiservers, each `Cluster::from_config` of its own copy of the config (as
//! providers build them). 10 s after the N×10th reconcile it reads /proc/self: RSS, the file
//! descriptors that are sockets, and CPU (user + system since the process started). Runs with
//! N = 1 and N alternate; RSS per cluster is (RSS(N) − RSS(1)) / (N − 1) on the medians.
//! `--sequential M`: M names engaged one after another, each waiting for its first reconcile
//! (engage → first reconcile latency).
//!
//! W2: 1,000 labelled ConfigMaps per apiserver, created before the child starts; 10 names,
//! 5 per apiserver, so 10,000 first reconciles; then the parent patches every object once
//! (10,000 more). Start is the child's first instruction after its runtime is built.
//! `--ceiling`, which W2 also runs: a bare kube-runtime `watcher` per name (each with its own
//! client) drains the same objects, no controller: the physical limit for the same listing.
//! It runs three ways: streaming lists (as the manager lists), paged lists, and streaming
//! lists over the shared transport (the clients `Cluster::from_config` builds).

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

mod common;

use common::{arg_after, cpu_time, create_config_maps, create_namespace};
use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, Patch, PatchParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube_runtime::{WatchStreamExt, watcher};
use multicluster_runtime::providers::Clusters;
use multicluster_runtime::{Action, Builder, Cluster, ClusterName, Context, Manager};
use multicluster_runtime_testenv::TestEnv;

const NAMESPACE: &str = "bench";
const LABEL: &str = "bench=mcr";

fn args_after(args: &[String], flag: &str) -> Vec<String> {
    args.windows(2)
        .filter(|w| w[0] == flag)
        .map(|w| w[1].clone())
        .collect()
}

fn status_kib(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

fn threads() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// Inodes of this process's sockets.
fn socket_inodes() -> Vec<String> {
    std::fs::read_dir("/proc/self/fd")
        .map(|dir| {
            dir.filter_map(Result::ok)
                .filter_map(|e| {
                    let target = std::fs::read_link(e.path()).ok()?;
                    let target = target.to_string_lossy();
                    Some(
                        target
                            .strip_prefix("socket:[")?
                            .trim_end_matches(']')
                            .to_string(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

/// File descriptors of this process that are sockets (TCP and others: the runtime's own).
fn sockets() -> usize {
    socket_inodes().len()
}

/// File descriptors of this process that are TCP sockets.
fn tcp_sockets() -> usize {
    let mut tcp = std::collections::HashSet::new();
    for table in ["/proc/self/net/tcp", "/proc/self/net/tcp6"] {
        for line in std::fs::read_to_string(table)
            .unwrap_or_default()
            .lines()
            .skip(1)
        {
            if let Some(inode) = line.split_whitespace().nth(9) {
                tcp.insert(inode.to_string());
            }
        }
    }
    socket_inodes().iter().filter(|i| tcp.contains(*i)).count()
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(|a, b| a.total_cmp(b));
    values[values.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(mode) = arg_after(&args, "--child") {
        let kubeconfigs = args_after(&args, "--kubeconfig");
        if std::env::var_os("RUST_LOG").is_some() {
            tracing_subscriber::fmt()
                .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
                .with_writer(std::io::stderr)
                .init();
        }
        let rt = tokio::runtime::Runtime::new().expect("runtime");
        rt.block_on(child(&mode, &args, &kubeconfigs));
        return;
    }
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let runs: usize = arg_after(&args, "--runs")
        .and_then(|r| r.parse().ok())
        .unwrap_or(3);
    rt.block_on(async {
        if args.iter().any(|a| a == "w1") {
            let n = arg_after(&args, "--n")
                .and_then(|n| n.parse().ok())
                .unwrap_or(1000);
            let sequential = arg_after(&args, "--sequential")
                .and_then(|n| n.parse().ok())
                .unwrap_or(200);
            // `--variant FLAG`: W1's children all run with that flag.
            w1(n, sequential, runs, &args_after(&args, "--variant")).await;
        }
        if args.iter().any(|a| a == "w2") {
            // `--compare`: the same runs also with kube's own clients, and with whole objects.
            // `--variant FLAG` (repeatable): the same runs also with that child flag.
            let mut variants: Vec<Vec<String>> = vec![vec![]];
            if args.iter().any(|a| a == "--compare") {
                variants.push(vec!["--kube-client".into()]);
                variants.push(vec!["--keep-managed-fields".into()]);
            }
            for flag in args_after(&args, "--variant") {
                variants.push(vec![flag]);
            }
            w2(runs, &variants).await;
        }
        if args.iter().any(|a| a == "scale") {
            let n = arg_after(&args, "--n")
                .and_then(|n| n.parse().ok())
                .unwrap_or(10_000);
            scale(n).await;
        }
    });
}

async fn two_apiservers(objects: usize) -> (TestEnv, Vec<String>) {
    let env = TestEnv::builder()
        .clusters(2)
        .start()
        .await
        .expect("testenv");
    let mut kubeconfigs = Vec::new();
    for tc in env.clusters() {
        let client = tc.client().expect("client");
        populate(client, objects).await;
        kubeconfigs.push(tc.kubeconfig_path().display().to_string());
    }
    (env, kubeconfigs)
}

async fn populate(client: kube::Client, objects: usize) {
    create_namespace(&client, NAMESPACE).await;
    let api: Api<ConfigMap> = Api::namespaced(client, NAMESPACE);
    create_config_maps(&api, objects, "mcr").await;
}

/// Runs a child; returns its `key=value` figures (the line starting with `RESULT`). With
/// `between`, the child's `PAUSE` line makes the parent answer, then run it.
async fn run_child(
    mode: &str,
    extra: &[String],
    kubeconfigs: &[String],
    between: Option<&(dyn Fn() -> futures::future::BoxFuture<'static, ()> + Sync)>,
) -> BTreeMap<String, f64> {
    let exe = std::env::current_exe().expect("current_exe");
    // `MCR_BENCH_WRAP="valgrind --tool=massif"`: the child runs under that command (profiles).
    let wrap = std::env::var("MCR_BENCH_WRAP").unwrap_or_default();
    let mut wrap = wrap.split_whitespace();
    let mut cmd = match wrap.next() {
        Some(program) => {
            let mut cmd = Command::new(program);
            cmd.args(wrap).arg(&exe);
            cmd
        }
        None => Command::new(&exe),
    };
    cmd.args(["--child", mode]).args(extra);
    for kc in kubeconfigs {
        cmd.args(["--kubeconfig", kc]);
    }
    cmd.stdin(Stdio::piped()).stdout(Stdio::piped());
    let mut child = cmd.spawn().expect("spawn child");
    let mut stdin = child.stdin.take().expect("stdin");
    let stdout = child.stdout.take().expect("stdout");
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut figures = BTreeMap::new();
    while let Some(line) = rx.recv().await {
        if line == "PAUSE" {
            writeln!(stdin, "go").expect("answer child");
            if let Some(between) = between {
                between().await;
            }
        } else if let Some(rest) = line.strip_prefix("RESULT ") {
            for pair in rest.split_whitespace() {
                if let Some((k, v)) = pair.split_once('=') {
                    figures.insert(k.to_string(), v.parse().expect("figure"));
                }
            }
        } else {
            println!("  child {mode}: {line}");
        }
    }
    let status = child.wait().expect("child");
    assert!(status.success(), "child {mode} failed");
    figures
}

async fn w1(n: usize, sequential: usize, runs: usize, flags: &[String]) {
    println!("\n== W1: {n} names over 2 apiservers, 10 ConfigMaps each, {runs} runs");
    let (env, kubeconfigs) = two_apiservers(10).await;
    let args = |n: usize| [&["--n".to_string(), n.to_string()], flags].concat();
    let mut one = Vec::new();
    let mut many = Vec::new();
    for run in 0..runs {
        one.push(run_child("w1", &args(1), &kubeconfigs, None).await);
        many.push(run_child("w1", &args(n), &kubeconfigs, None).await);
        println!("  run {run}: N=1 {:?}", one[run]);
        println!("  run {run}: N={n} {:?}", many[run]);
    }
    let pick = |set: &[BTreeMap<String, f64>], key: &str| -> Vec<f64> {
        set.iter().map(|f| f[key]).collect::<Vec<_>>()
    };
    let rss1 = median(&mut pick(&one, "rss_kib"));
    let rss_n = median(&mut pick(&many, "rss_kib"));
    println!(
        "RSS N=1 {rss1:.0} KiB, N={n} {rss_n:.0} KiB (runs {:?}); per cluster {:.1} KiB",
        pick(&many, "rss_kib"),
        (rss_n - rss1) / (n as f64 - 1.0)
    );
    println!(
        "TCP sockets N={n}: median {} (runs {:?}); all sockets {:?}; N=1: TCP {:?}, all {:?}",
        median(&mut pick(&many, "tcp")),
        pick(&many, "tcp"),
        pick(&many, "sockets"),
        pick(&one, "tcp"),
        pick(&one, "sockets")
    );
    println!(
        "CPU s to idle N={n}: median {:.2} (runs {:?})",
        median(&mut pick(&many, "cpu_s")),
        pick(&many, "cpu_s")
    );
    println!(
        "all N×10 first reconciles after adding: median {:.3} s (runs {:?})",
        median(&mut pick(&many, "all_s")),
        pick(&many, "all_s")
    );
    if sequential == 0 {
        drop(env);
        return;
    }
    let mut seq = Vec::new();
    for _ in 0..runs {
        seq.push(
            run_child(
                "w1",
                &[&args(sequential)[..], &["--sequential".to_string()]].concat(),
                &kubeconfigs,
                None,
            )
            .await,
        );
    }
    println!(
        "sequential engage → first reconcile ({sequential} names): p50 median {:.2} ms (runs {:?}), p99 {:?}",
        median(&mut pick(&seq, "p50_ms")),
        pick(&seq, "p50_ms"),
        pick(&seq, "p99_ms")
    );
    drop(env);
}

async fn w2(runs: usize, variants: &[Vec<String>]) {
    println!("\n== W2: 10 names over 2 apiservers, 1,000 ConfigMaps each, {runs} runs");
    let (env, kubeconfigs) = two_apiservers(1000).await;
    let clients: Vec<kube::Client> = env
        .clusters()
        .iter()
        .map(|c| c.client().expect("client"))
        .collect();
    let round = Arc::new(AtomicUsize::new(0));
    let patch_all = {
        let clients = clients.clone();
        let round = round.clone();
        move || -> futures::future::BoxFuture<'static, ()> {
            let clients = clients.clone();
            let round = round.fetch_add(1, Ordering::SeqCst);
            Box::pin(async move {
                let work: Vec<(Api<ConfigMap>, usize)> = clients
                    .iter()
                    .flat_map(|client| {
                        let api: Api<ConfigMap> = Api::namespaced(client.clone(), NAMESPACE);
                        (0..1000).map(move |i| (api.clone(), i))
                    })
                    .collect();
                let mut patches = futures::stream::iter(work)
                    .map(|(api, i)| async move {
                        let patch = serde_json::json!({"data": {"round": round.to_string()}});
                        api.patch(
                            &format!("cm-{i:05}"),
                            &PatchParams::default(),
                            &Patch::Merge(&patch),
                        )
                        .await
                        .expect("patch")
                    })
                    .buffer_unordered(32);
                while patches.next().await.is_some() {}
            })
        }
    };
    let mut results = Vec::new();
    let mut ceilings = Vec::new();
    let mut paged_ceilings = Vec::new();
    let mut shared_ceilings = Vec::new();
    let mut variant_results: BTreeMap<String, Vec<BTreeMap<String, f64>>> = BTreeMap::new();
    for run in 0..runs {
        for variant in variants.iter().skip(1) {
            let figures = run_child("w2", variant, &kubeconfigs, Some(&patch_all)).await;
            println!("  run {run} {variant:?}: {figures:?}");
            let entry = variant_results.entry(variant.join(" ")).or_default();
            entry.push(figures);
        }
        let figures = run_child("w2", &variants[0], &kubeconfigs, Some(&patch_all)).await;
        println!("  run {run}: {figures:?}");
        results.push(figures);
        let ceiling = run_child("w2-ceiling", &[], &kubeconfigs, None).await;
        println!("  run {run} ceiling: {ceiling:?}");
        ceilings.push(ceiling);
        let paged = run_child("w2-ceiling", &["--paged-lists".into()], &kubeconfigs, None).await;
        println!("  run {run} ceiling, paged lists: {paged:?}");
        paged_ceilings.push(paged);
        let shared = run_child(
            "w2-ceiling",
            &["--shared-transport".into()],
            &kubeconfigs,
            None,
        )
        .await;
        println!("  run {run} ceiling, shared transport: {shared:?}");
        shared_ceilings.push(shared);
    }
    let pick = |set: &[BTreeMap<String, f64>], key: &str| -> Vec<f64> {
        set.iter().map(|f| f[key]).collect::<Vec<_>>()
    };
    for (key, what) in [
        ("first_s", "start → first reconcile (s)"),
        ("synced_s", "start → every cache listed (s)"),
        ("all_s", "start → 10,000 reconciles (s)"),
        (
            "cpu_per_1000_s",
            "CPU s per 1,000 reconciles, listing included",
        ),
        (
            "patched_s",
            "10,000 reconciles of the patches, from the first patch sent (s)",
        ),
        (
            "cpu_patch_per_1000_s",
            "CPU s per 1,000 reconciles of patches",
        ),
        ("peak_rss_kib", "peak RSS (KiB)"),
        (
            "listed_peak_rss_kib",
            "peak RSS up to the 10,000th reconcile (KiB)",
        ),
        ("base_rss_kib", "RSS before the names are added (KiB)"),
    ] {
        println!(
            "{what}: median {:.3} (runs {:?})",
            median(&mut pick(&results, key)),
            pick(&results, key)
        );
    }
    for (variant, set) in &variant_results {
        for key in [
            "first_s",
            "all_s",
            "cpu_per_1000_s",
            "cpu_patch_per_1000_s",
            "peak_rss_kib",
            "listed_peak_rss_kib",
            "base_rss_kib",
        ] {
            println!(
                "  {variant}: {key} median {:.4} (runs {:?})",
                median(&mut pick(set, key)),
                pick(set, key)
            );
        }
    }
    let all = median(&mut pick(&results, "all_s"));
    let ceiling = median(&mut pick(&ceilings, "all_s"));
    println!(
        "ceiling: bare watchers drained 10,000 objects in {ceiling:.3} s (runs {:?}): {:.0} events/s; \
         reconciles {:.0}/s = {:.0} % of it",
        pick(&ceilings, "all_s"),
        10_000.0 / ceiling,
        10_000.0 / all,
        100.0 * ceiling / all
    );
    println!(
        "ceiling CPU s per 1,000 events, process start included: median {:.4} (runs {:?})",
        median(&mut pick(&ceilings, "cpu_per_1000_s")),
        pick(&ceilings, "cpu_per_1000_s")
    );
    let paged = median(&mut pick(&paged_ceilings, "all_s"));
    println!(
        "ceiling with paged lists: {paged:.3} s (runs {:?}): reconciles at {:.0} % of it",
        pick(&paged_ceilings, "all_s"),
        100.0 * paged / all
    );
    let shared = median(&mut pick(&shared_ceilings, "all_s"));
    println!(
        "ceiling over the shared transport: {shared:.3} s (runs {:?}): reconciles at {:.0} % of it",
        pick(&shared_ceilings, "all_s"),
        100.0 * shared / all
    );
    drop(env);
}

/// 10,000 names over two apiservers (10 ConfigMaps each), all added at once, in one process,
/// with metrics kept and served; `/metrics` is scraped once at the end.
async fn scale(n: usize) {
    println!("\n== scale: {n} names over 2 apiservers, 10 ConfigMaps each");
    let (env, kubeconfigs) = two_apiservers(10).await;
    let args = ["--n".into(), n.to_string(), "--metrics".into()];
    let figures = run_child("w1", &args, &kubeconfigs, None).await;
    println!("{figures:?}");
    drop(env);
}

/// One GET of `/metrics` at `at`: its time, the bytes of the answer, and how far the
/// process's resident memory rose above what it was before (its peak, reset just before).
async fn scrape(at: std::net::SocketAddr) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    // "5": resets the peak resident set size (VmHWM) to the current one.
    std::fs::write("/proc/self/clear_refs", "5").expect("reset VmHWM");
    let before = status_kib("VmRSS:");
    let started = Instant::now();
    let mut stream = tokio::net::TcpStream::connect(at).await.expect("connect");
    stream
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n")
        .await
        .expect("request");
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).await.expect("answer");
    let took = started.elapsed();
    assert!(answer.starts_with(b"HTTP/1.1 200"), "scrape refused");
    format!(
        " scrape_s={:.3} scrape_mib={:.1} scrape_peak_extra_kib={}",
        took.as_secs_f64(),
        answer.len() as f64 / (1024.0 * 1024.0),
        status_kib("VmHWM:").saturating_sub(before)
    )
}

struct Counter {
    count: AtomicUsize,
    first: OnceLock<Instant>,
    target: AtomicUsize,
    done: tokio::sync::Notify,
}

impl Default for Counter {
    fn default() -> Self {
        Self {
            count: AtomicUsize::new(0),
            first: OnceLock::new(),
            target: AtomicUsize::new(usize::MAX),
            done: tokio::sync::Notify::new(),
        }
    }
}

impl Counter {
    fn hit(&self) {
        self.first.get_or_init(Instant::now);
        let count = self.count.fetch_add(1, Ordering::SeqCst) + 1;
        if count >= self.target.load(Ordering::SeqCst) {
            self.done.notify_waiters();
        }
    }

    async fn reach(&self, target: usize) {
        self.target.store(target, Ordering::SeqCst);
        loop {
            let notified = self.done.notified();
            if self.count.load(Ordering::SeqCst) >= target {
                return;
            }
            notified.await;
        }
    }
}

async fn count(
    _: Arc<ConfigMap>,
    ctx: Context<ClusterName, Counter>,
) -> Result<Action, kube::Error> {
    ctx.state().hit();
    Ok(Action::await_change())
}

fn never(_: Arc<ConfigMap>, _: &kube::Error, _: &Context<ClusterName, Counter>) -> Action {
    Action::await_change()
}

async fn configs(kubeconfigs: &[String]) -> Vec<kube::Config> {
    let mut configs = Vec::new();
    for path in kubeconfigs {
        let kc = Kubeconfig::read_from(path).expect("kubeconfig");
        configs.push(
            kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
                .await
                .expect("config"),
        );
    }
    configs
}

fn pause() {
    println!("PAUSE");
    let _ = std::io::stdout().flush();
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
}

async fn child(mode: &str, args: &[String], kubeconfigs: &[String]) {
    let start = Instant::now();
    let configs = configs(kubeconfigs).await;
    let n: usize = arg_after(args, "--n")
        .and_then(|n| n.parse().ok())
        .unwrap_or(10);
    let wc = watcher::Config::default().labels(LABEL);
    if mode == "w2-ceiling" {
        // Listed as the manager lists by default (a streaming list), or in pages.
        let wc = if args.iter().any(|a| a == "--paged-lists") {
            wc
        } else {
            wc.streaming_lists()
        };
        let drained = Arc::new(AtomicUsize::new(0));
        let done = Arc::new(tokio::sync::Notify::new());
        for i in 0..10 {
            let config = configs[i % configs.len()].clone();
            // `--shared-transport`: the client `Cluster::from_config` builds (HTTP/2, one
            // connection per apiserver), to tell the transport's share from the runtime's.
            let client = if args.iter().any(|a| a == "--shared-transport") {
                Cluster::from_config(ClusterName::from(format!("c-{i}")), config)
                    .expect("cluster")
                    .client()
            } else {
                kube::Client::try_from(config).expect("client")
            };
            let api: Api<ConfigMap> = Api::namespaced(client, NAMESPACE);
            let (drained, done, wc) = (drained.clone(), done.clone(), wc.clone());
            tokio::spawn(async move {
                let mut events = std::pin::pin!(watcher(api, wc).default_backoff());
                while let Some(event) = events.next().await {
                    match event {
                        Ok(watcher::Event::InitApply(_)) => {
                            if drained.fetch_add(1, Ordering::SeqCst) + 1 == 10_000 {
                                done.notify_one();
                            }
                        }
                        Ok(_) => {}
                        Err(error) => eprintln!("watcher {i}: {error}"),
                    }
                }
            });
        }
        done.notified().await;
        println!(
            "RESULT all_s={:.4} cpu_per_1000_s={:.4}",
            start.elapsed().as_secs_f64(),
            cpu_time().as_secs_f64() / 10.0
        );
        return;
    }
    let clusters = Clusters::new();
    // `--keep-managed-fields`: caches keep objects whole (the default before transforms).
    let mut manager = Manager::new(clusters.clone());
    if args.iter().any(|a| a == "--keep-managed-fields") {
        manager = manager.keep_managed_fields();
    }
    // `--paged-lists`: listings in pages of list requests, not streaming lists.
    if args.iter().any(|a| a == "--paged-lists") {
        manager = manager.paged_lists();
    }
    // `--metrics`: the manager keeps its metrics and serves `/metrics` (plain HTTP on
    // loopback); after the idle wait the child scrapes it once and reports the scrape.
    let metrics = args.iter().any(|a| a == "--metrics");
    if metrics {
        let mut registry = prometheus_client::registry::Registry::default();
        manager = manager.metrics(multicluster_runtime::Metrics::new(&mut registry));
        let endpoints = multicluster_runtime::Endpoints::new(([127, 0, 0, 1], 0).into())
            .plain_http()
            .metrics(Arc::new(registry));
        manager = manager.serve(endpoints);
    }
    let manager = Arc::new(manager);
    // `--kube-client`: each name gets a client of kube's own stack (HTTP/1.1, a pool per
    // client), as `Cluster::from_config` built them before the shared transport.
    let kube_client = args.iter().any(|a| a == "--kube-client");
    let counter = Arc::new(Counter::default());
    Builder::<_, ConfigMap>::new(&manager, wc.clone())
        .concurrency(4)
        .start(count, never, counter.clone());
    let run = {
        let manager = manager.clone();
        tokio::spawn(async move { manager.run().await })
    };
    let add = |i: usize| {
        let id = ClusterName::from(format!("c-{i:04}"));
        let config = configs[i % configs.len()].clone();
        let cluster = if kube_client {
            Cluster::new(id, kube::Client::try_from(config).expect("client"))
        } else {
            Cluster::from_config(id, config).expect("cluster")
        };
        clusters.add(cluster.clone()).expect("engage");
        cluster
    };
    match mode {
        "w1" if args.iter().any(|a| a == "--sequential") => {
            // A warm-up name first: one-time costs (TLS provider, the first watch).
            add(n);
            counter.reach(10).await;
            let mut latencies = Vec::with_capacity(n);
            for i in 0..n {
                let before = counter.count.load(Ordering::SeqCst);
                let started = Instant::now();
                add(i);
                counter.reach(before + 1).await;
                latencies.push(started.elapsed().as_secs_f64() * 1000.0);
                counter.reach(before + 10).await;
            }
            latencies.sort_by(|a, b| a.total_cmp(b));
            let pct = |p: f64| {
                latencies[((latencies.len() as f64 * p) as usize).min(latencies.len() - 1)]
            };
            println!("RESULT p50_ms={:.3} p99_ms={:.3}", pct(0.5), pct(0.99));
        }
        "w1" => {
            let added = Instant::now();
            for i in 0..n {
                add(i);
            }
            let engaged = added.elapsed();
            counter.reach(n * 10).await;
            let all = added.elapsed();
            tokio::time::sleep(Duration::from_secs(10)).await;
            let (rss, sockets, tcp, cpu) =
                (status_kib("VmRSS:"), sockets(), tcp_sockets(), cpu_time());
            let scrape = if metrics {
                let at = manager.served_at().expect("serving");
                scrape(at).await
            } else {
                String::new()
            };
            println!(
                "RESULT rss_kib={} sockets={} tcp={} cpu_s={:.2} all_s={:.3} engage_s={:.3} threads={} reconciles={}{scrape}",
                rss,
                sockets,
                tcp,
                cpu.as_secs_f64(),
                all.as_secs_f64(),
                engaged.as_secs_f64(),
                threads(),
                counter.count.load(Ordering::SeqCst)
            );
        }
        "w2" => {
            let base_rss = status_kib("VmRSS:");
            let (base_anon, base_file) = (status_kib("RssAnon:"), status_kib("RssFile:"));
            // When every name's cache has listed (the ceiling's work, done by the runtime).
            let synced = Arc::new(std::sync::OnceLock::new());
            let mut caches = Vec::new();
            for i in 0..10 {
                let cluster = add(i);
                let wc = wc.clone();
                caches.push(async move {
                    // Engaged by the running manager a moment after `add`.
                    while cluster.cache::<ConfigMap>(&wc).await.is_err() {
                        tokio::time::sleep(Duration::from_millis(1)).await;
                    }
                });
            }
            tokio::spawn({
                let synced = synced.clone();
                async move {
                    futures::future::join_all(caches).await;
                    let _ = synced.set(start.elapsed());
                }
            });
            counter.reach(10_000).await;
            let all = start.elapsed();
            let cpu_all = cpu_time();
            let listed_peak = status_kib("VmHWM:");
            if std::env::var_os("MCR_BENCH_RSS_DETAIL").is_some() {
                eprintln!(
                    "at 10,000: RssAnon {} RssFile {} base anon {} file {}",
                    status_kib("RssAnon:"),
                    status_kib("RssFile:"),
                    base_anon,
                    base_file
                );
                let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap_or_default();
                let mut current = String::new();
                let mut per: BTreeMap<String, u64> = BTreeMap::new();
                for line in smaps.lines() {
                    let fields: Vec<&str> = line.split_whitespace().collect();
                    if fields.len() >= 5 && fields[0].contains('-') && !fields[0].ends_with(':') {
                        current = fields.get(5).unwrap_or(&"[anon]").to_string();
                    } else if fields.first() == Some(&"Rss:") {
                        *per.entry(current.clone()).or_default() +=
                            fields[1].parse::<u64>().unwrap_or(0);
                    }
                }
                for (mapping, kib) in per {
                    if kib >= 256 {
                        eprintln!("  {kib:>8} KiB {mapping}");
                    }
                }
            }
            let first = *counter.first.get().expect("first") - start;
            tokio::task::block_in_place(pause);
            let patched = Instant::now();
            counter.reach(20_000).await;
            let patched = patched.elapsed();
            let cpu_patch = cpu_time() - cpu_all;
            println!(
                "RESULT first_s={:.4} all_s={:.4} cpu_per_1000_s={:.4} patched_s={:.4} cpu_patch_per_1000_s={:.4} peak_rss_kib={} listed_peak_rss_kib={} base_rss_kib={} synced_s={:.4} sockets={}",
                first.as_secs_f64(),
                all.as_secs_f64(),
                cpu_all.as_secs_f64() / 10.0,
                patched.as_secs_f64(),
                cpu_patch.as_secs_f64() / 10.0,
                status_kib("VmHWM:"),
                listed_peak,
                base_rss,
                synced.get().map_or(f64::NAN, |d| d.as_secs_f64()),
                sockets()
            );
        }
        other => panic!("unknown mode {other}"),
    }
    manager.shutdown();
    let _ = run.await;
}
