//! Live changes and a big listing (issue 29 item 5): how long a change made while a cluster's
//! 10,000 objects are being reconciled waits, in that cluster and in another, with live
//! changes first (the default) and in one lane (`Builder::changes_first(false)`); figures go
//! to `BENCHMARKS.md`.
//!
//! ```sh
//! export MCR_TESTENV_ASSETS=$(scripts/testenv-assets.sh)
//! cargo bench --bench priority [-- --n 10000 --concurrency 16 --work-ms 10 --probes 5]
//! ```
//!
//! Two testenv apiservers: A holds `n` ConfigMaps labelled `bench=prio`, B none. Fleet mode:
//! a manager follows cluster `b` (B), then cluster `a` (A) is engaged, so A's objects arrive
//! as a listing. Single mode: the manager's one cluster is A. The controller (that selector,
//! `--concurrency`, a reconcile that records its start and waits `--work-ms`, like an API
//! call) reconciles the listing; once 1,000 of it have started, a probe every 300 ms creates
//! one object in A (and, in fleet mode, one in B). For each probe: create → reconcile start,
//! how many listed objects started in between, and how many of those started after the
//! probe's event had reached the process (a watch of the probes alone sees it arrive).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

// Shared with the other benchmarks; this one needs only some of it.
#[allow(dead_code)]
mod common;

use common::{arg_after, create_config_maps, create_namespace};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, ObjectMeta, PostParams};
use kube_runtime::watcher;
use multicluster_runtime::providers::{Clusters, SingleProvider};
use multicluster_runtime::{Action, Builder, Cluster, ClusterName, Context, Manager, Provider};
use multicluster_runtime_testenv::TestEnv;

const NAMESPACE: &str = "bench";

#[derive(Default)]
struct Probe {
    /// When each live object's first reconcile began, by `cluster/name`.
    live: Mutex<HashMap<String, Instant>>,
    /// When each listed object's reconcile began, in order.
    listed: Mutex<Vec<Instant>>,
    started: AtomicUsize,
    work: Mutex<Duration>,
}

async fn reconcile<C: multicluster_runtime::ClusterId>(
    cm: Arc<ConfigMap>,
    ctx: Context<C, Probe>,
) -> Result<Action, kube::Error> {
    let now = Instant::now();
    let name = cm.metadata.name.clone().unwrap_or_default();
    let probe = ctx.state();
    if name.starts_with("live-") {
        let key = format!("{}/{name}", ctx.request().cluster);
        probe.live.lock().unwrap().entry(key).or_insert(now);
    } else {
        probe.listed.lock().unwrap().push(now);
        probe.started.fetch_add(1, Ordering::SeqCst);
    }
    let work = *probe.work.lock().unwrap();
    tokio::time::sleep(work).await;
    Ok(Action::await_change())
}

fn never<C: multicluster_runtime::ClusterId>(
    _: Arc<ConfigMap>,
    _: &kube::Error,
    _: &Context<C, Probe>,
) -> Action {
    Action::await_change()
}

fn live_object(name: &str) -> ConfigMap {
    ConfigMap {
        metadata: ObjectMeta {
            name: Some(name.into()),
            labels: Some(
                [
                    ("bench".to_string(), "prio".to_string()),
                    ("probe".to_string(), "yes".to_string()),
                ]
                .into(),
            ),
            ..Default::default()
        },
        ..Default::default()
    }
}

struct Settings {
    n: usize,
    concurrency: u16,
    work: Duration,
    probes: usize,
}

/// One probe's figures: its wait, the listed objects that started during it, and those that
/// started after its event had reached this process.
struct Waited {
    wait: Duration,
    ahead: usize,
    after_arrival: usize,
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn report(case: &str, cluster: &str, waited: &[Waited], listing_left: usize) {
    let waits: Vec<f64> = waited.iter().map(|w| w.wait.as_secs_f64() * 1e3).collect();
    let ahead: Vec<f64> = waited.iter().map(|w| w.ahead as f64).collect();
    let after: Vec<f64> = waited.iter().map(|w| w.after_arrival as f64).collect();
    println!(
        "RESULT case={case} cluster={cluster} wait_ms_median={:.1} wait_ms_max={:.1} \
         listed_ahead_median={} listed_ahead_max={} listed_after_arrival_median={} \
         listed_after_arrival_max={} listing_left_after_last_probe={listing_left}",
        median(waits.clone()),
        waits.iter().copied().fold(0.0, f64::max),
        median(ahead.clone()),
        ahead.iter().copied().fold(0.0, f64::max),
        median(after.clone()),
        after.iter().copied().fold(0.0, f64::max),
    );
}

/// Runs one case: the controller on `manager`, `engage` called once it runs (fleet mode
/// engages A then), probes created in A (`a`) and, if given, B (`b`), named with `case`.
async fn case<P: Provider>(
    case: &str,
    settings: &Settings,
    manager: Manager<P>,
    changes_first: bool,
    engage: impl FnOnce(),
    a: (&str, &kube::Client),
    b: Option<(&str, &kube::Client)>,
) {
    let manager = Arc::new(manager);
    let probe = Arc::new(Probe::default());
    *probe.work.lock().unwrap() = settings.work;
    Builder::<_, ConfigMap>::new(&manager, watcher::Config::default().labels("bench=prio"))
        .concurrency(settings.concurrency)
        .changes_first(changes_first)
        .start(reconcile, never, probe.clone());
    // When each probe's event reaches this process: a watch of the probes alone, on the same
    // API servers as the controller's.
    let arrivals: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    let mut watchers = Vec::new();
    let mut probed = vec![a];
    probed.extend(b);
    for (cluster, client) in probed {
        let api = Api::<ConfigMap>::namespaced(client.clone(), NAMESPACE);
        let arrivals = arrivals.clone();
        let cluster = cluster.to_string();
        watchers.push(tokio::spawn(async move {
            use futures::StreamExt;
            let events = watcher(api, watcher::Config::default().labels("probe=yes"));
            let mut events = std::pin::pin!(events);
            while let Some(event) = events.next().await {
                if let Ok(watcher::Event::Apply(cm)) = event {
                    let key = format!("{cluster}/{}", cm.metadata.name.unwrap_or_default());
                    arrivals
                        .lock()
                        .unwrap()
                        .entry(key)
                        .or_insert_with(Instant::now);
                }
            }
        }));
    }
    let running = manager.clone();
    let run = tokio::spawn(async move { running.run().await });
    engage();
    while probe.started.load(Ordering::SeqCst) < 1_000 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let mut made: Vec<(String, Instant)> = Vec::new();
    for i in 0..settings.probes {
        let name = format!("live-{case}-{i}");
        let mut targets = vec![a];
        targets.extend(b);
        for (cluster, client) in targets {
            let api = Api::<ConfigMap>::namespaced(client.clone(), NAMESPACE);
            let at = Instant::now();
            api.create(&PostParams::default(), &live_object(&name))
                .await
                .expect("create");
            made.push((format!("{cluster}/{name}"), at));
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let listing_left = settings
        .n
        .saturating_sub(probe.started.load(Ordering::SeqCst));
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        let done = {
            let live = probe.live.lock().unwrap();
            made.iter().all(|(k, _)| live.contains_key(k))
        };
        if done {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{case}: a probe was not reconciled"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let live = probe.live.lock().unwrap().clone();
    let listed = probe.listed.lock().unwrap().clone();
    let arrived = arrivals.lock().unwrap().clone();
    for watcher in watchers {
        watcher.abort();
    }
    let mut by_cluster: HashMap<String, Vec<Waited>> = HashMap::new();
    for (key, made_at) in &made {
        let began = live[key];
        let ahead = listed
            .iter()
            .filter(|at| **at > *made_at && **at < began)
            .count();
        let after_arrival = arrived.get(key).map_or(ahead, |arrival| {
            listed
                .iter()
                .filter(|at| **at > *arrival && **at < began)
                .count()
        });
        let cluster = key.split('/').next().unwrap_or_default().to_string();
        by_cluster.entry(cluster).or_default().push(Waited {
            wait: began - *made_at,
            ahead,
            after_arrival,
        });
    }
    let mut clusters: Vec<_> = by_cluster.into_iter().collect();
    clusters.sort_by(|x, y| x.0.cmp(&y.0));
    for (cluster, waited) in clusters {
        let label = if cluster.is_empty() {
            "single"
        } else {
            &cluster
        };
        report(case, label, &waited, listing_left);
    }
    manager.shutdown();
    let _ = run.await;
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let settings = Settings {
        n: arg_after(&args, "--n")
            .and_then(|n| n.parse().ok())
            .unwrap_or(10_000),
        concurrency: arg_after(&args, "--concurrency")
            .and_then(|n| n.parse().ok())
            .unwrap_or(16),
        work: Duration::from_millis(
            arg_after(&args, "--work-ms")
                .and_then(|n| n.parse().ok())
                .unwrap_or(10),
        ),
        probes: arg_after(&args, "--probes")
            .and_then(|n| n.parse().ok())
            .unwrap_or(5),
    };
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let env = TestEnv::builder()
            .clusters(2)
            .start()
            .await
            .expect("testenv");
        let a = env.cluster(0).unwrap().client().expect("client");
        let b = env.cluster(1).unwrap().client().expect("client");
        create_namespace(&a, NAMESPACE).await;
        create_namespace(&b, NAMESPACE).await;
        let started = Instant::now();
        create_config_maps(
            &Api::<ConfigMap>::namespaced(a.clone(), NAMESPACE),
            settings.n,
            "prio",
        )
        .await;
        println!(
            "{} objects in A in {:.1} s; concurrency {}, {} ms a reconcile, {} probes 300 ms apart",
            settings.n,
            started.elapsed().as_secs_f64(),
            settings.concurrency,
            settings.work.as_millis(),
            settings.probes
        );
        for changes_first in [true, false] {
            let lanes = if changes_first { "lanes" } else { "one-lane" };
            let clusters = Clusters::new();
            clusters
                .add(Cluster::new(ClusterName::from("b"), b.clone()))
                .expect("b");
            let engage_a = {
                let clusters = clusters.clone();
                let a = a.clone();
                move || {
                    clusters
                        .add(Cluster::new(ClusterName::from("a"), a))
                        .expect("a");
                }
            };
            case(
                &format!("fleet-{lanes}"),
                &settings,
                Manager::new(clusters),
                changes_first,
                engage_a,
                ("a", &a),
                Some(("b", &b)),
            )
            .await;
            case(
                &format!("single-{lanes}"),
                &settings,
                Manager::new(SingleProvider::new(a.clone())),
                changes_first,
                || {},
                ("", &a),
                None,
            )
            .await;
        }
    });
}
