//! What a running manager reports, against real control planes: its metrics (series per
//! cluster that follow reconciles and leave with a disengaged cluster; every series with
//! controller-runtime's name, type and labels, in each way of labelling), `/healthz`, `/readyz`
//! and `/metrics` over HTTP as a cluster's apiserver goes and comes back, panicking reconciles
//! counted and retried, each cluster's client rate limit and its requests counted, and the
//! Event recorder (Events in the object's own cluster, repeats counted in a series).

mod common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::audited::{audited_objects, control_plane, election, labelled, labelled_cm};
use common::*;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, ObjectMeta, PostParams};
use multicluster_runtime::providers::Clusters;
use multicluster_runtime::{
    Action, Builder, Cluster, ClusterName, Context, Failure, LeaderElection, Manager, Metrics,
};
use multicluster_runtime_testenv::TestEnv;

fn scrape(registry: &prometheus_client::registry::Registry) -> String {
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, registry).unwrap();
    text
}

#[derive(Debug)]
struct Told;

impl std::fmt::Display for Told {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("told to fail")
    }
}

impl std::error::Error for Told {}

/// Fails the reconcile of objects labelled `fail=yes` (the error policy requeues them soon).
async fn fail_some(cm: Arc<ConfigMap>, _: Context<ClusterName, ()>) -> Result<Action, Told> {
    if cm.labels_contain("fail", "yes") {
        return Err(Told);
    }
    Ok(Action::await_change())
}

trait Labelled {
    fn labels_contain(&self, key: &str, value: &str) -> bool;
}

impl Labelled for ConfigMap {
    fn labels_contain(&self, key: &str, value: &str) -> bool {
        self.metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(key))
            .is_some_and(|v| v == value)
    }
}

#[tokio::test]
async fn metrics_carry_the_cluster_follow_reconciles_and_leave_with_a_disengaged_cluster() {
    let (_env, tc, host) = control_plane().await;
    let api: Api<ConfigMap> = Api::namespaced(host.clone(), "default");
    let failing = ConfigMap {
        metadata: ObjectMeta {
            name: Some("failing".into()),
            labels: Some(BTreeMap::from([
                ("audit".into(), "yes".into()),
                ("fail".into(), "yes".into()),
            ])),
            ..Default::default()
        },
        ..Default::default()
    };
    api.create(&PostParams::default(), &failing).await.unwrap();

    let mut registry = prometheus_client::registry::Registry::default();
    let metrics = multicluster_runtime::Metrics::new(&mut registry);
    // One apiserver under two cluster names.
    let clusters = Clusters::new();
    for name in ["east", "west"] {
        clusters
            .add(Cluster::new(common::name(name), tc.client().unwrap()))
            .unwrap();
    }
    let manager = Arc::new(
        Manager::new(clusters.clone())
            .metrics(metrics)
            .leader_election(election(host.clone(), "metrics")),
    );
    Builder::<_, ConfigMap>::new(&manager, labelled())
        .named("audited")
        .concurrency(3)
        .start(
            fail_some,
            |_, _: &Told, _: &Context<ClusterName, ()>| Action::requeue(Duration::from_millis(200)),
            Arc::new(()),
        );
    let run = spawn_manager(&manager);
    let reconciled = |text: &str, cluster: &str, result: &str| {
        sample(
            text,
            "controller_runtime_reconcile_total",
            &[
                ("controller", "audited"),
                ("cluster", cluster),
                ("result", result),
            ],
        )
        .unwrap_or(0.0)
    };
    // The three audited objects reconciled in both clusters, the failing one failing and
    // retried in both.
    eventually(30, "reconciles counted per cluster", async || {
        let text = scrape(&registry);
        ["east", "west"].iter().all(|c| {
            reconciled(&text, c, "success") >= 3.0
                && reconciled(&text, c, "error") >= 2.0
                && sample(
                    &text,
                    "workqueue_retries_total",
                    &[("name", "audited"), ("cluster", c)],
                )
                .unwrap_or(0.0)
                    >= 2.0
        })
    })
    .await;
    let text = scrape(&registry);
    for cluster in ["east", "west"] {
        let errors = sample(
            &text,
            "controller_runtime_reconcile_errors_total",
            &[("controller", "audited"), ("cluster", cluster)],
        )
        .unwrap();
        assert!(errors >= 2.0, "{cluster}: {errors}");
        let adds = sample(
            &text,
            "workqueue_adds_total",
            &[("name", "audited"), ("cluster", cluster)],
        )
        .unwrap();
        assert!(adds >= 4.0, "{cluster}: adds {adds}");
        assert_eq!(
            sample(
                &text,
                "workqueue_depth",
                &[("name", "audited"), ("cluster", cluster)]
            )
            .map(|d| d >= 0.0),
            Some(true)
        );
    }
    // The histograms are the controller's, over both clusters.
    let timed = sample(
        &text,
        "controller_runtime_reconcile_time_seconds_count",
        &[("controller", "audited")],
    )
    .unwrap();
    assert!(timed >= 10.0, "timed {timed}");
    assert!(
        sample(
            &text,
            "workqueue_queue_duration_seconds_count",
            &[("name", "audited"), ("controller", "audited")]
        )
        .unwrap()
            >= 10.0
    );
    assert!(!text.contains(
        "controller_runtime_reconcile_time_seconds_count{controller=\"audited\",cluster="
    ));
    assert_eq!(
        sample(
            &text,
            "controller_runtime_max_concurrent_reconciles",
            &[("controller", "audited")]
        ),
        Some(3.0)
    );
    assert_eq!(
        sample(&text, "multicluster_runtime_engaged_clusters", &[]),
        Some(2.0)
    );
    assert_eq!(
        sample(
            &text,
            "leader_election_master_status",
            &[("name", "default/operations-leader")]
        ),
        Some(1.0)
    );

    // A change is counted where it happened... both names are one apiserver: in both.
    let before = reconciled(&scrape(&registry), "east", "success");
    let patch = serde_json::json!({ "data": { "round": "2" } });
    api.patch(
        "audited-0",
        &kube::api::PatchParams::default(),
        &kube::api::Patch::Merge(&patch),
    )
    .await
    .unwrap();
    eventually(30, "the change counted", async || {
        reconciled(&scrape(&registry), "east", "success") > before
    })
    .await;

    // A disengaged cluster's series go; the other's stay.
    clusters.remove(&common::name("west"));
    eventually(30, "west's series removed", async || {
        let text = scrape(&registry);
        !text.contains("cluster=\"west\"")
            && sample(&text, "multicluster_runtime_engaged_clusters", &[]) == Some(1.0)
    })
    .await;
    assert!(reconciled(&scrape(&registry), "east", "success") >= before);

    manager.shutdown();
    run.await.unwrap();
    let text = scrape(&registry);
    assert_eq!(
        sample(
            &text,
            "leader_election_master_status",
            &[("name", "default/operations-leader")]
        ),
        Some(0.0)
    );
    assert_eq!(
        sample(&text, "multicluster_runtime_engaged_clusters", &[]),
        Some(0.0)
    );
}

/// controller-runtime's series (`pkg/internal/controller/metrics`, `pkg/metrics/workqueue.go`,
/// `client_go_adapter.go`, `leaderelection.go` as of v0.22): name, type, label names.
const CONTROLLER_RUNTIME: &[(&str, &str, &[&str])] = &[
    // The webhook series with labels appear once a webhook is served (tests/webhooks.rs);
    // this one is there from the start.
    ("controller_runtime_webhook_panics_total", "counter", &[]),
    (
        "controller_runtime_reconcile_total",
        "counter",
        &["controller", "result"],
    ),
    (
        "controller_runtime_reconcile_errors_total",
        "counter",
        &["controller"],
    ),
    (
        "controller_runtime_terminal_reconcile_errors_total",
        "counter",
        &["controller"],
    ),
    (
        "controller_runtime_reconcile_panics_total",
        "counter",
        &["controller"],
    ),
    (
        "controller_runtime_reconcile_timeouts_total",
        "counter",
        &["controller"],
    ),
    (
        "controller_runtime_reconcile_time_seconds",
        "histogram",
        &["controller"],
    ),
    (
        "controller_runtime_max_concurrent_reconciles",
        "gauge",
        &["controller"],
    ),
    (
        "controller_runtime_active_workers",
        "gauge",
        &["controller"],
    ),
    (
        "workqueue_depth",
        "gauge",
        &["name", "controller", "priority"],
    ),
    ("workqueue_adds_total", "counter", &["name", "controller"]),
    (
        "workqueue_queue_duration_seconds",
        "histogram",
        &["name", "controller"],
    ),
    (
        "workqueue_work_duration_seconds",
        "histogram",
        &["name", "controller"],
    ),
    (
        "workqueue_unfinished_work_seconds",
        "gauge",
        &["name", "controller"],
    ),
    (
        "workqueue_longest_running_processor_seconds",
        "gauge",
        &["name", "controller"],
    ),
    (
        "workqueue_retries_total",
        "counter",
        &["name", "controller"],
    ),
    (
        "rest_client_requests_total",
        "counter",
        &["code", "method", "host"],
    ),
    ("leader_election_master_status", "gauge", &["name"]),
];

/// Every series of a scrape: (name as Prometheus stores it, type) to the label-name sets of
/// its samples (a histogram's `le` left out).
fn series_of(text: &str) -> BTreeMap<(String, String), std::collections::BTreeSet<Vec<String>>> {
    let mut types: BTreeMap<String, String> = BTreeMap::new();
    let mut out: BTreeMap<(String, String), std::collections::BTreeSet<Vec<String>>> =
        BTreeMap::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (family, kind) = rest.split_once(' ').unwrap();
            types.insert(family.to_string(), kind.to_string());
            continue;
        }
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        let name_end = line.find(['{', ' ']).unwrap();
        let sample = &line[..name_end];
        let mut labels = Vec::new();
        if line[name_end..].starts_with('{') {
            // name="value" pairs; the values here hold no quotes.
            let body = &line[name_end + 1..line.rfind('}').unwrap()];
            for pair in body.split("\",") {
                let (name, _) = pair.split_once('=').unwrap();
                let name = name.trim_start_matches(',');
                if !name.is_empty() && name != "le" {
                    labels.push(name.to_string());
                }
            }
        }
        // The family: the longest TYPE name the sample's name extends with a known suffix.
        let (family, kind) = types
            .iter()
            .filter(|(f, _)| {
                sample.strip_prefix(f.as_str()).is_some_and(|suffix| {
                    ["", "_total", "_bucket", "_sum", "_count", "_created"].contains(&suffix)
                })
            })
            .max_by_key(|(f, _)| f.len())
            .unwrap_or_else(|| panic!("no TYPE for {sample}"));
        // A counter is stored (and queried) with `_total`, as controller-runtime names it.
        let name = if kind == "counter" {
            format!("{family}_total")
        } else {
            family.clone()
        };
        labels.sort();
        out.entry((name, kind.clone())).or_default().insert(labels);
    }
    out
}

/// Fails objects labelled `fail=yes` (retried) or `fail=terminal` (not retried); takes
/// 8 s over `slow=yes`.
async fn varied(cm: Arc<ConfigMap>, _: Context<ClusterName, ()>) -> Result<Action, Told> {
    if cm.labels_contain("fail", "yes") || cm.labels_contain("fail", "terminal") {
        return Err(Told);
    }
    if cm.labels_contain("slow", "yes") {
        tokio::time::sleep(Duration::from_secs(8)).await;
    }
    Ok(Action::await_change())
}

#[tokio::test]
async fn every_series_has_controller_runtime_s_name_type_and_labels_with_the_cluster_beside_them() {
    let logs = Logs::capture();
    let (_env, tc, host) = control_plane().await;
    let api: Api<ConfigMap> = Api::namespaced(host.clone(), "default");
    for (name, labels) in [
        ("retried", [("audit", "yes"), ("fail", "yes")]),
        ("terminal", [("audit", "yes"), ("fail", "terminal")]),
        ("slow", [("audit", "yes"), ("slow", "yes")]),
    ] {
        api.create(&PostParams::default(), &labelled_cm(name, &labels))
            .await
            .unwrap();
    }
    let server = tc.config().cluster_url.authority().unwrap().to_string();
    // Three managers of the same two cluster names, one per way of labelling.
    type Build = fn(&mut prometheus_client::registry::Registry) -> Metrics;
    let modes: [(&str, Build); 3] = [
        ("default", Metrics::new),
        ("cluster histograms", Metrics::with_cluster_histograms),
        ("no cluster label", Metrics::without_cluster_label),
    ];
    let mut runs = Vec::new();
    let mut registries = Vec::new();
    for (i, (mode, metrics)) in modes.iter().enumerate() {
        let mut registry = prometheus_client::registry::Registry::default();
        let metrics = metrics(&mut registry);
        let clusters = Clusters::new();
        for name in ["east", "west"] {
            clusters
                .add(Cluster::from_config(common::name(name), tc.config()).unwrap())
                .unwrap();
        }
        let manager = Arc::new(Manager::new(clusters).metrics(metrics).leader_election(
            LeaderElection::new(host.clone(), "default", &format!("metrics-{i}")).identity(*mode),
        ));
        Builder::<_, ConfigMap>::new(&manager, labelled())
            .named("audited")
            .start(
                varied,
                |cm, _: &Told, _: &Context<ClusterName, ()>| {
                    if cm.labels_contain("fail", "terminal") {
                        Action::await_change()
                    } else {
                        Action::requeue(Duration::from_millis(200))
                    }
                },
                Arc::new(()),
            );
        runs.push((manager.clone(), spawn_manager(&manager)));
        registries.push((*mode, registry));
    }

    // While the slow object's reconciles run, each cluster's queue reports them in flight.
    let mut seen = std::collections::BTreeSet::new();
    eventually(30, "the slow reconciles in flight reported", async || {
        for (mode, registry) in &registries {
            let per_cluster = *mode != "no cluster label";
            let text = scrape(registry);
            let clusters: &[&str] = if per_cluster {
                &["east", "west"]
            } else {
                &[""]
            };
            let in_flight = clusters.iter().all(|c| {
                let mut labels = vec![("name", "audited"), ("controller", "audited")];
                if per_cluster {
                    labels.push(("cluster", c));
                }
                let longest = sample(
                    &text,
                    "workqueue_longest_running_processor_seconds",
                    &labels,
                )
                .unwrap_or(0.0);
                let unfinished =
                    sample(&text, "workqueue_unfinished_work_seconds", &labels).unwrap_or(0.0);
                longest >= 1.0 && unfinished >= longest
            });
            if in_flight {
                seen.insert(*mode);
            }
        }
        seen.len() == registries.len()
    })
    .await;
    // The terminal error counted once per cluster and not retried; the other retried.
    eventually(30, "errors counted", async || {
        registries.iter().all(|(mode, registry)| {
            let text = scrape(registry);
            let per = if *mode == "no cluster label" {
                2.0
            } else {
                1.0
            };
            let terminal = sample(
                &text,
                "controller_runtime_terminal_reconcile_errors_total",
                &[("controller", "audited")],
            )
            .unwrap_or(0.0);
            let retries = sample(
                &text,
                "workqueue_retries_total",
                &[("controller", "audited")],
            )
            .unwrap_or(0.0);
            terminal == per && retries >= 2.0
        })
    })
    .await;
    // Once the slow ones are done, nothing is in flight.
    eventually(30, "the slow reconciles finished", async || {
        registries.iter().all(|(_, registry)| {
            let text = scrape(registry);
            // (The retried object's reconciles are in flight for moments only.)
            text.lines()
                .filter(|l| l.starts_with("workqueue_longest_running_processor_seconds"))
                .all(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap() < 1.0)
        })
    })
    .await;

    for (mode, registry) in &registries {
        let text = scrape(registry);
        let ours = series_of(&text);
        for (name, kind, labels) in CONTROLLER_RUNTIME {
            let mut expected: Vec<String> = labels.iter().map(ToString::to_string).collect();
            let per_controller = [
                "controller_runtime_max_concurrent_reconciles",
                "controller_runtime_active_workers",
                "leader_election_master_status",
                "controller_runtime_webhook_panics_total",
            ]
            .contains(name);
            let cluster = match *mode {
                "no cluster label" => false,
                "cluster histograms" => !per_controller,
                _ => !per_controller && *kind != "histogram",
            };
            if cluster {
                expected.push("cluster".into());
            }
            expected.sort();
            let found = ours
                .get(&(name.to_string(), kind.to_string()))
                .unwrap_or_else(|| panic!("{mode}: no {kind} {name} in\n{text}"));
            assert_eq!(
                found.iter().collect::<Vec<_>>(),
                [&expected],
                "{mode}: {name}'s label sets"
            );
        }
        // Prometheus' standard process series (controller-runtime's registry has them too),
        // unlabelled, and the runtime's.
        for (name, kind) in [
            ("process_cpu_seconds_total", "counter"),
            ("process_start_time_seconds", "gauge"),
            ("process_resident_memory_bytes", "gauge"),
            ("process_virtual_memory_bytes", "gauge"),
            ("process_open_fds", "gauge"),
            ("process_max_fds", "gauge"),
            ("process_threads", "gauge"),
            ("multicluster_runtime_tokio_workers", "gauge"),
            ("multicluster_runtime_tokio_busy_seconds_total", "counter"),
        ] {
            let found = ours
                .get(&(name.to_string(), kind.to_string()))
                .unwrap_or_else(|| panic!("{mode}: no {kind} {name} in\n{text}"));
            assert_eq!(
                found.iter().collect::<Vec<_>>(),
                [&Vec::<String>::new()],
                "{mode}: {name}"
            );
        }
        // Nothing else but this crate's own series.
        for (name, _) in ours.keys() {
            assert!(
                name.starts_with("multicluster_runtime_")
                    || name.starts_with("process_")
                    || CONTROLLER_RUNTIME.iter().any(|(n, _, _)| n == name),
                "{mode}: {name} is neither controller-runtime's nor this crate's"
            );
        }
        // client-go's host: the API server's host:port.
        assert!(
            sample(
                &text,
                "rest_client_requests_total",
                &[("host", &server), ("method", "GET")]
            )
            .is_some_and(|n| n >= 1.0),
            "{mode}: no request counted for host {server}"
        );
        assert!(
            sample(&text, "workqueue_depth", &[("priority", "")]).is_some(),
            "{mode}"
        );
    }

    // The objects deleted: their requests (the retried one's requeue among them) are
    // popped and finished without a reconcile, for want of the object. After the term,
    // nothing is in flight and no gauge says otherwise.
    for name in ["retried", "terminal", "slow"] {
        api.delete(name, &Default::default()).await.unwrap();
    }
    eventually(30, "a request of a deleted object skipped", async || {
        !logs
            .lines(&["object not in the cache (deleted)", "retried"])
            .is_empty()
    })
    .await;
    for (manager, run) in runs {
        manager.shutdown();
        run.await.unwrap();
    }
    for (mode, registry) in &registries {
        let text = scrape(registry);
        for metric in [
            "workqueue_longest_running_processor_seconds",
            "workqueue_unfinished_work_seconds",
            "controller_runtime_active_workers",
        ] {
            let up: Vec<&str> = text
                .lines()
                .filter(|l| l.starts_with(metric))
                .filter(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap() != 0.0)
                .collect();
            assert!(up.is_empty(), "{mode}: {up:?}");
        }
    }
}

#[tokio::test]
async fn readyz_follows_a_clusters_apiserver_and_metrics_are_served_over_http() {
    let env = TestEnv::builder().clusters(2).start().await.unwrap();
    let (steady, flaky) = (env.cluster(0).unwrap(), env.cluster(1).unwrap());
    for tc in [&steady, &flaky] {
        audited_objects(&tc.client().unwrap()).await;
    }
    let mut registry = prometheus_client::registry::Registry::default();
    let metrics = multicluster_runtime::Metrics::new(&mut registry);
    let registry = Arc::new(registry);
    let clusters = Clusters::new();
    clusters
        .add(Cluster::new(
            common::name("steady"),
            steady.client().unwrap(),
        ))
        .unwrap();
    clusters
        .add(Cluster::new(common::name("flaky"), flaky.client().unwrap()))
        .unwrap();
    // Strict: a failing cluster makes the pod unready (the default only reports it).
    let endpoints = multicluster_runtime::Endpoints::new("127.0.0.1:0".parse().unwrap())
        .plain_http()
        .metrics(registry.clone())
        .strict(true);
    let manager = Arc::new(Manager::new(clusters).metrics(metrics).serve(endpoints));
    Builder::<_, ConfigMap>::new(&manager, labelled())
        .named("probed")
        .start(
            |_, _: Context<ClusterName, ()>| async { Ok::<_, kube::Error>(Action::await_change()) },
            |_, _: &kube::Error, _: &Context<ClusterName, ()>| Action::await_change(),
            Arc::new(()),
        );
    let run = spawn_manager(&manager);
    eventually(30, "the endpoints listening", async || {
        manager.served_at().is_some()
    })
    .await;
    let addr = manager.served_at().unwrap();
    assert_eq!(http_get(addr, "/healthz").await.0, 200);
    eventually(30, "ready", async || {
        http_get(addr, "/readyz").await.0 == 200
    })
    .await;
    let (_, verbose) = http_get(addr, "/readyz?verbose").await;
    assert!(
        verbose.contains("cluster steady: ok") && verbose.contains("cluster flaky: ok"),
        "{verbose}"
    );

    // Scraped over HTTP: reconciles counted per cluster.
    eventually(30, "reconciles in both clusters scraped", async || {
        let (status, text) = http_get(addr, "/metrics").await;
        status == 200
            && ["steady", "flaky"].iter().all(|c| {
                sample(
                    &text,
                    "controller_runtime_reconcile_total",
                    &[
                        ("controller", "probed"),
                        ("cluster", c),
                        ("result", "success"),
                    ],
                )
                .unwrap_or(0.0)
                    >= 3.0
            })
    })
    .await;

    let watch = |text: &str, gauge: &str, cluster: &str| {
        sample(text, gauge, &[("cluster", cluster), ("kind", "ConfigMap")])
    };
    let (_, text) = http_get(addr, "/metrics").await;
    for cluster in ["steady", "flaky"] {
        assert_eq!(
            watch(&text, "multicluster_runtime_watch_synced", cluster),
            Some(1.0),
            "{text}"
        );
        assert_eq!(
            watch(&text, "multicluster_runtime_watch_failing", cluster),
            Some(0.0),
            "{text}"
        );
    }

    // flaky's apiserver stops: not ready, and the detail names the cluster; steady is fine.
    flaky.stop().await;
    eventually(60, "unready while flaky is down", async || {
        http_get(addr, "/readyz").await.0 == 503
    })
    .await;
    // The watch gauges say the same.
    let (_, text) = http_get(addr, "/metrics").await;
    assert_eq!(
        watch(&text, "multicluster_runtime_watch_failing", "flaky"),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        watch(&text, "multicluster_runtime_watch_failing", "steady"),
        Some(0.0),
        "{text}"
    );
    let (_, verbose) = http_get(addr, "/readyz?verbose").await;
    assert!(verbose.contains("cluster steady: ok"), "{verbose}");
    assert!(verbose.contains("cluster flaky: ConfigMap"), "{verbose}");
    assert_eq!(http_get(addr, "/healthz").await.0, 200);
    // Back: ready again.
    flaky.start().await.unwrap();
    eventually(60, "ready again", async || {
        http_get(addr, "/readyz").await.0 == 200
    })
    .await;
    let (_, text) = http_get(addr, "/metrics").await;
    assert_eq!(
        watch(&text, "multicluster_runtime_watch_failing", "flaky"),
        Some(0.0),
        "{text}"
    );
    assert_eq!(
        watch(&text, "multicluster_runtime_watch_synced", "flaky"),
        Some(1.0),
        "{text}"
    );

    manager.shutdown();
    run.await.unwrap();
    assert!(manager.served_at().is_none());
    assert!(
        tokio::net::TcpStream::connect(addr).await.is_err(),
        "the port is closed after the run"
    );
}

/// Reconciles seen, as (cluster, object name), by a reconciler that panics on objects
/// labelled `panic=yes` in the cluster `panics_in`.
struct Panicky {
    panics_in: String,
    seen: Mutex<Vec<(String, String)>>,
}

async fn panic_some<C: multicluster_runtime::ClusterId>(
    cm: Arc<ConfigMap>,
    ctx: Context<C, Panicky>,
) -> Result<Action, Told> {
    let cluster = ctx.cluster_id().to_string();
    let name = cm.metadata.name.clone().unwrap_or_default();
    ctx.state()
        .seen
        .lock()
        .unwrap()
        .push((cluster.clone(), name.clone()));
    if cluster == ctx.state().panics_in && cm.labels_contain("panic", "yes") {
        panic!("reconciler bug on {name}");
    }
    if cm.labels_contain("fail", "yes") {
        return Err(Told);
    }
    Ok(Action::await_change())
}

fn panicky(panics_in: &str) -> Arc<Panicky> {
    Arc::new(Panicky {
        panics_in: panics_in.into(),
        seen: Mutex::default(),
    })
}

/// How many reconciles of `name` in `cluster` `state` has seen.
fn seen(state: &Panicky, cluster: &str, name: &str) -> usize {
    state
        .seen
        .lock()
        .unwrap()
        .iter()
        .filter(|(c, n)| c == cluster && n == name)
        .count()
}

/// Every result, as the controllers report them: (cluster, object, failure, action).
type Results = Arc<Mutex<Vec<(String, String, Option<Failure>, Action)>>>;

fn observer<C: multicluster_runtime::ClusterId>(
    results: &Results,
) -> impl Fn(multicluster_runtime::Reconciled<C>) + Send + Sync + 'static {
    let results = results.clone();
    move |r| {
        results.lock().unwrap().push((
            r.request.cluster.to_string(),
            r.request.name,
            r.failure,
            r.action,
        ))
    }
}

#[tokio::test]
async fn a_panicking_reconcile_is_counted_and_retried_and_stops_no_other_cluster_or_object() {
    let (_env, tc, host) = control_plane().await;
    let api: Api<ConfigMap> = Api::namespaced(host.clone(), "default");
    api.create(
        &PostParams::default(),
        &labelled_cm("bomb", &[("audit", "yes"), ("panic", "yes")]),
    )
    .await
    .unwrap();
    api.create(
        &PostParams::default(),
        &labelled_cm("dud", &[("audit", "yes"), ("fail", "yes")]),
    )
    .await
    .unwrap();
    let fleet_results = Results::default();
    let single_results = Results::default();

    // Fleet mode: the panics are in east only.
    let mut registry = prometheus_client::registry::Registry::default();
    let metrics = multicluster_runtime::Metrics::new(&mut registry);
    let clusters = Clusters::new();
    for name in ["east", "west"] {
        clusters
            .add(Cluster::new(common::name(name), tc.client().unwrap()))
            .unwrap();
    }
    let fleet = Arc::new(Manager::new(clusters).metrics(metrics));
    let fleet_state = panicky("east");
    Builder::<_, ConfigMap>::new(&fleet, labelled())
        .named("panicky")
        .on_result(observer(&fleet_results))
        .start(
            panic_some,
            |_, _: &Told, _: &Context<ClusterName, Panicky>| Action::await_change(),
            fleet_state.clone(),
        );
    let fleet_run = spawn_manager(&fleet);

    // Single mode: the same reconciler on kube-runtime's controller.
    let mut single_registry = prometheus_client::registry::Registry::default();
    let single_metrics = multicluster_runtime::Metrics::new(&mut single_registry);
    let single = Arc::new(
        Manager::new(multicluster_runtime::providers::SingleProvider::new(
            tc.client().unwrap(),
        ))
        .metrics(single_metrics),
    );
    let single_state = panicky("");
    Builder::<_, ConfigMap>::new(&single, labelled())
        .named("panicky")
        .on_result(observer(&single_results))
        .start(
            panic_some,
            |_, _: &Told, _: &Context<multicluster_runtime::SingleCluster, Panicky>| {
                Action::await_change()
            },
            single_state.clone(),
        );
    let single_run = spawn_manager(&single);

    // The panicking object is retried (after PANIC_REQUEUE, 10 s): the controller lived
    // through the first panic.
    eventually(
        60,
        "the bomb retried in east and in single mode",
        async || seen(&fleet_state, "east", "bomb") >= 2 && seen(&single_state, "", "bomb") >= 2,
    )
    .await;
    // A later object is reconciled everywhere: neither controller stopped, west never did.
    api.create(
        &PostParams::default(),
        &labelled_cm("after-the-panics", &[("audit", "yes")]),
    )
    .await
    .unwrap();
    eventually(30, "the later object reconciled everywhere", async || {
        seen(&fleet_state, "east", "after-the-panics") == 1
            && seen(&fleet_state, "west", "after-the-panics") == 1
            && seen(&single_state, "", "after-the-panics") == 1
    })
    .await;
    assert_eq!(
        seen(&fleet_state, "west", "bomb"),
        1,
        "west reconciled the bomb once"
    );
    for i in 0..3 {
        let name = format!("audited-{i}");
        assert_eq!(seen(&fleet_state, "east", &name), 1);
        assert_eq!(seen(&fleet_state, "west", &name), 1);
        assert_eq!(seen(&single_state, "", &name), 1);
    }

    let text = scrape(&registry);
    let panics = |text: &str, cluster: &str| {
        sample(
            text,
            "controller_runtime_reconcile_panics_total",
            &[("controller", "panicky"), ("cluster", cluster)],
        )
    };
    assert!(panics(&text, "east").unwrap() >= 2.0, "{text}");
    assert_eq!(panics(&text, "west"), Some(0.0), "{text}");
    let errors = sample(
        &text,
        "controller_runtime_reconcile_total",
        &[
            ("controller", "panicky"),
            ("cluster", "east"),
            ("result", "error"),
        ],
    )
    .unwrap();
    assert!(errors >= 2.0, "a panic counts as an error: {text}");
    let single_text = scrape(&single_registry);
    assert!(
        panics(&single_text, "single").unwrap() >= 2.0,
        "{single_text}"
    );

    // The result callbacks saw each outcome, with the cluster, in both modes.
    let panic = Some(Failure::Panic("reconciler bug on bomb".into()));
    let error = Some(Failure::Error("told to fail".into()));
    let requeue = Action::requeue(multicluster_runtime::PANIC_REQUEUE);
    for (results, cluster, bomb) in [
        (&fleet_results, "east", (panic.clone(), requeue)),
        (&fleet_results, "west", (None, Action::await_change())),
        (&single_results, "", (panic.clone(), requeue)),
    ] {
        let results = results.lock().unwrap();
        let of = |name: &str| -> Vec<(Option<Failure>, Action)> {
            results
                .iter()
                .filter(|r| r.0 == cluster && r.1 == name)
                .map(|r| (r.2.clone(), r.3))
                .collect()
        };
        let expected_bombs = if cluster == "west" { 1 } else { 2 };
        assert!(
            of("bomb").len() >= expected_bombs,
            "{cluster}: {:?}",
            of("bomb")
        );
        assert!(
            of("bomb").iter().all(|r| *r == bomb),
            "{cluster}: {:?}",
            of("bomb")
        );
        assert_eq!(
            of("dud"),
            vec![(error.clone(), Action::await_change())],
            "{cluster}"
        );
        assert_eq!(
            of("audited-0"),
            vec![(None, Action::await_change())],
            "{cluster}"
        );
    }

    fleet.shutdown();
    single.shutdown();
    fleet_run.await.unwrap();
    single_run.await.unwrap();
}

/// `n` GETs at once through `cluster`'s client; how long until all had their answers.
async fn burst_of_gets(cluster: &Cluster<ClusterName>, n: usize) -> Duration {
    let api: Api<ConfigMap> = Api::namespaced(cluster.client(), "default");
    let started = Instant::now();
    let gets = (0..n).map(|_| api.get("audited-0"));
    for result in futures::future::join_all(gets).await {
        result.unwrap();
    }
    started.elapsed()
}

#[tokio::test]
async fn each_clusters_client_keeps_its_rate_limit_and_its_requests_are_counted() {
    use multicluster_runtime::RateLimit;
    let (_env, tc, _host) = control_plane().await;
    let mut registry = prometheus_client::registry::Registry::default();
    let metrics = multicluster_runtime::Metrics::new(&mut registry);
    // One apiserver under three names: the manager's default limit, one of the cluster's
    // own, none.
    let slow = Cluster::new(common::name("slow"), tc.client().unwrap());
    let fast = Cluster::new(common::name("fast"), tc.client().unwrap())
        .with_rate_limit(Some(RateLimit::new(20.0, 1).unwrap()));
    let free = Cluster::new(common::name("free"), tc.client().unwrap()).with_rate_limit(None);
    let clusters = Clusters::new();
    for cluster in [&slow, &fast, &free] {
        clusters.add(cluster.clone()).unwrap();
    }
    let manager = Arc::new(
        Manager::new(clusters.clone())
            .metrics(metrics)
            .client_rate_limit(RateLimit::new(5.0, 1).unwrap()),
    );
    let state = panicky("nowhere");
    Builder::<_, ConfigMap>::new(&manager, labelled()).start(
        panic_some,
        |_, _: &Told, _: &Context<ClusterName, Panicky>| Action::await_change(),
        state.clone(),
    );
    let run = spawn_manager(&manager);
    // Engaged, the watches listed (they were rate limited too).
    eventually(30, "the three clusters reconciled", async || {
        ["slow", "fast", "free"]
            .iter()
            .all(|c| seen(&state, c, "audited-0") == 1)
    })
    .await;
    assert_eq!(slow.rate_limit(), RateLimit::new(5.0, 1).ok(), "inherited");
    assert_eq!(fast.rate_limit(), RateLimit::new(20.0, 1).ok(), "its own");
    assert_eq!(free.rate_limit(), None);

    // 20 requests at once on each: at 5 a second with a burst of 1, the last can go 3.8 s
    // after the first; at 20 a second, 0.95 s after.
    let n = 20;
    let (slow_took, fast_took, free_took) = tokio::join!(
        burst_of_gets(&slow, n),
        burst_of_gets(&fast, n),
        burst_of_gets(&free, n)
    );
    println!("{n} GETs took: slow {slow_took:?}, fast {fast_took:?}, free {free_took:?}");
    let rate = |took: Duration| (n - 1) as f64 / took.as_secs_f64();
    assert!(
        rate(slow_took) <= 5.0 * 1.02,
        "slow: {} a second",
        rate(slow_took)
    );
    assert!(
        rate(fast_took) <= 20.0 * 1.02,
        "fast: {} a second",
        rate(fast_took)
    );
    assert!(fast_took < slow_took, "each cluster has its own bucket");
    assert!(free_took < slow_took, "no limit on free");

    // Counted per cluster, code and method, a 404 apart.
    let api: Api<ConfigMap> = Api::namespaced(fast.client(), "default");
    assert!(api.get_opt("not-there").await.unwrap().is_none());
    let requests = |text: &str, cluster: &str, code: &str| {
        sample(
            text,
            "rest_client_requests_total",
            &[("cluster", cluster), ("code", code), ("method", "GET")],
        )
        .unwrap_or(0.0)
    };
    let text = scrape(&registry);
    for cluster in ["slow", "fast", "free"] {
        // The burst, and the watch's list (GET as well).
        assert!(
            requests(&text, cluster, "200") >= (n + 1) as f64,
            "{cluster}: {text}"
        );
    }
    assert_eq!(requests(&text, "fast", "404"), 1.0, "{text}");
    assert_eq!(requests(&text, "slow", "404"), 0.0, "{text}");

    // A disengaged cluster's request series are gone.
    assert!(clusters.remove(&common::name("free")));
    // The request series go at the disengagement, the controller's when it lets go.
    eventually(30, "free disengaged", async || !free.is_engaged()).await;
    assert!(
        !scrape(&registry)
            .lines()
            .any(|l| l.starts_with("rest_client_requests_total{") && l.contains("cluster=\"free\""))
    );
    eventually(30, "no series of free left", async || {
        !scrape(&registry).contains("cluster=\"free\"")
    })
    .await;
    let text = scrape(&registry);
    assert!(requests(&text, "slow", "200") >= (n + 1) as f64, "{text}");

    manager.shutdown();
    run.await.unwrap();
}

/// Publishes a `Seen` Event about each object it reconciles, twice (it asks for one requeue).
async fn record_seen(
    cm: Arc<ConfigMap>,
    ctx: Context<ClusterName, Mutex<Vec<(String, String)>>>,
) -> Result<Action, kube::Error> {
    use kube::Resource;
    use kube_runtime::events::{Event, EventType};
    let cluster = ctx.cluster_id().to_string();
    let name = cm.metadata.name.clone().unwrap_or_default();
    let event = Event {
        type_: EventType::Normal,
        reason: "Seen".into(),
        note: Some(format!("seen in {cluster}")),
        action: "Reconcile".into(),
        secondary: None,
    };
    ctx.recorder().publish(&event, &cm.object_ref(&())).await?;
    let mut seen = ctx.state().lock().unwrap();
    seen.push((cluster.clone(), name.clone()));
    let times = seen
        .iter()
        .filter(|s| **s == (cluster.clone(), name.clone()))
        .count();
    Ok(if times < 2 {
        Action::requeue(Duration::from_millis(100))
    } else {
        Action::await_change()
    })
}

/// The `Seen` Events of namespace default in `client`'s cluster: (object, note, series count,
/// reporting controller, reporting instance).
async fn seen_events(client: &kube::Client) -> Vec<(String, String, i32, String, String)> {
    let events: Api<k8s_openapi::api::events::v1::Event> =
        Api::namespaced(client.clone(), "default");
    events
        .list(&Default::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| e.reason.as_deref() == Some("Seen"))
        .map(|e| {
            (
                e.regarding.and_then(|r| r.name).unwrap_or_default(),
                e.note.unwrap_or_default(),
                e.series.map_or(1, |s| s.count),
                e.reporting_controller.unwrap_or_default(),
                e.reporting_instance.unwrap_or_default(),
            )
        })
        .collect()
}

#[tokio::test]
async fn the_recorder_puts_events_in_the_objects_cluster_and_counts_repeats_across_reconciles() {
    let env = TestEnv::builder().clusters(2).start().await.unwrap();
    let (east, west) = (env.cluster(0).unwrap(), env.cluster(1).unwrap());
    let (east_client, west_client) = (east.client().unwrap(), west.client().unwrap());
    // "shared" in both clusters, "east-only" in east.
    for (client, names) in [
        (&east_client, &["shared", "east-only"][..]),
        (&west_client, &["shared"][..]),
    ] {
        let api: Api<ConfigMap> = Api::namespaced(client.clone(), "default");
        for name in names {
            api.create(
                &PostParams::default(),
                &labelled_cm(name, &[("audit", "yes")]),
            )
            .await
            .unwrap();
        }
    }
    let clusters = Clusters::new();
    clusters
        .add(Cluster::new(common::name("east"), east_client.clone()))
        .unwrap();
    clusters
        .add(Cluster::new(common::name("west"), west_client.clone()))
        .unwrap();
    let manager = Arc::new(
        Manager::new(clusters).leader_election(election(east_client.clone(), "recorder-replica")),
    );
    Builder::<_, ConfigMap>::new(&manager, labelled())
        .named("seen-recorder")
        .start(
            record_seen,
            |_, _: &kube::Error, _: &Context<ClusterName, _>| {
                Action::requeue(Duration::from_secs(1))
            },
            Arc::new(Mutex::new(Vec::new())),
        );
    let run = spawn_manager(&manager);

    // Each object's two reconciles made one Event with a series of 2, in its own cluster.
    let expected = |name: &str, cluster: &str| {
        (
            name.to_string(),
            format!("seen in {cluster}"),
            2,
            "seen-recorder".to_string(),
            "recorder-replica".to_string(),
        )
    };
    eventually(30, "east's Events", async || {
        let mut events = seen_events(&east_client).await;
        events.sort();
        events == vec![expected("east-only", "east"), expected("shared", "east")]
    })
    .await;
    eventually(30, "west's Events", async || {
        seen_events(&west_client).await == vec![expected("shared", "west")]
    })
    .await;
    // Both of east's were complete before the wait above ended, and no Event of east's
    // objects went to west (the list would have shown it).
    assert_eq!(
        seen_events(&west_client).await,
        vec![expected("shared", "west")]
    );

    manager.shutdown();
    run.await.unwrap();
}
