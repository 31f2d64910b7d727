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
//! `MCR_BENCH_CHILD_EXE=PATH` runs that child binary instead (a copy of another commit's, to
//! compare two builds the same hour).
//! The children are `benches/fleet_child.rs`, a binary of the controller alone (the parent
//! builds it with `cargo bench --bench fleet_child --no-run`), so their memory figures hold
//! no code of the parent's (testenv, the writer).
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

#[allow(dead_code)]
mod common;

use common::{arg_after, args_after, create_config_maps, create_namespace};
use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, Patch, PatchParams};
use multicluster_runtime_testenv::TestEnv;

const NAMESPACE: &str = "bench";

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(|a, b| a.total_cmp(b));
    values[values.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
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

/// The child binary (`benches/fleet_child.rs`), built by cargo as this bench's own build
/// is: the same profile and target directory.
fn child_exe() -> std::path::PathBuf {
    static EXE: OnceLock<std::path::PathBuf> = OnceLock::new();
    EXE.get_or_init(|| {
        // `MCR_BENCH_CHILD_EXE=PATH`: a child built before (another commit's, to compare
        // builds the same hour with one parent).
        if let Some(exe) = std::env::var_os("MCR_BENCH_CHILD_EXE") {
            return exe.into();
        }
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut command = Command::new(cargo);
        // Without the variables cargo sets for the bench it runs: build scripts that watch
        // one (ring's watches CARGO_MANIFEST_DIR) would rebuild half the tree, twice a run.
        for (name, _) in std::env::vars_os() {
            let name = name.to_string_lossy();
            let set_by_cargo = name == "OUT_DIR"
                || name.starts_with("CARGO_PKG_")
                || [
                    "CARGO_MANIFEST_DIR",
                    "CARGO_MANIFEST_PATH",
                    "CARGO_CRATE_NAME",
                    "CARGO_BIN_NAME",
                    "CARGO_PRIMARY_PACKAGE",
                    "CARGO_TARGET_TMPDIR",
                ]
                .contains(&name.as_ref());
            if set_by_cargo {
                command.env_remove(name.as_ref());
            }
        }
        let output = command
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .args([
                "bench",
                "--bench",
                "fleet_child",
                "--no-run",
                "--message-format=json",
            ])
            .stderr(Stdio::inherit())
            .output()
            .expect("cargo bench --bench fleet_child --no-run");
        assert!(output.status.success(), "the child binary did not build");
        String::from_utf8_lossy(&output.stdout)
            .lines()
            .filter(|l| l.contains("\"fleet_child\""))
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .find_map(|m| m["executable"].as_str().map(std::path::PathBuf::from))
            .expect("the child binary's path")
    })
    .clone()
}

/// Runs a child; returns its `key=value` figures (the line starting with `RESULT`). With
/// `between`, the child's `PAUSE` line makes the parent answer, then run it.
async fn run_child(
    mode: &str,
    extra: &[String],
    kubeconfigs: &[String],
    between: Option<&(dyn Fn() -> futures::future::BoxFuture<'static, ()> + Sync)>,
) -> BTreeMap<String, f64> {
    let exe = child_exe();
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
            "{what}: median {:.5} (runs {:?})",
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
                "  {variant}: {key} median {:.5} (runs {:?})",
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
