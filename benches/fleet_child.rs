//! The child process of the fleet benchmarks (`benches/fleet.rs` starts it): only the
//! controller (or, for `w2-ceiling`, bare watchers) and the figures it reports, so its memory
//! is what an operator built on the crate holds, not the benchmark's parent (testenv, the
//! writer) as well. Not run on its own: `cargo bench --bench fleet` builds and starts it.

use std::collections::BTreeMap;
use std::io::Write;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

#[allow(dead_code)]
mod common;

use common::{arg_after, args_after, cpu_time};
use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::Api;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube_runtime::{WatchStreamExt, watcher};
use multicluster_runtime::providers::Clusters;
use multicluster_runtime::{Action, Builder, Cluster, ClusterName, Context, Manager};

const NAMESPACE: &str = "bench";
const LABEL: &str = "bench=mcr";

fn main() {
    let args: Vec<String> = std::env::args().collect();
    // `cargo bench` runs every bench target with `--bench`: this one does nothing then.
    let Some(mode) = arg_after(&args, "--child") else {
        return;
    };
    let kubeconfigs = args_after(&args, "--kubeconfig");
    if std::env::var_os("RUST_LOG").is_some() {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .init();
    }
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(child(&mode, &args, &kubeconfigs));
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
            "RESULT all_s={:.4} cpu_per_1000_s={:.5}",
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
                "RESULT first_s={:.4} all_s={:.4} cpu_per_1000_s={:.5} patched_s={:.4} cpu_patch_per_1000_s={:.5} peak_rss_kib={} listed_peak_rss_kib={} base_rss_kib={} synced_s={:.4} sockets={}",
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
