//! The reconcile loop controller-runtime users expect, in both modes against a real control
//! plane: per-object failure backoff (its curve, its reset by a change and by a success, a
//! sibling and another cluster unaffected), the rate-limited requeue, terminal errors, the
//! reconcile timeout, live changes before listed objects, the periodic resync, the cache
//! sync timeout, and warm standby.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::ResourceExt;
use kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams};
use kube_runtime::watcher;
use multicluster_runtime::providers::{Clusters, SingleProvider};
use multicluster_runtime::{
    Action, Builder, Cluster, ClusterId, Context, FailureBackoff, Manager, Metrics, Provider,
};
use multicluster_runtime_testenv::TestEnv;

const NS: &str = "loop";
const LABEL: &str = "loop";
const BASE: Duration = Duration::from_millis(100);
const MAX: Duration = Duration::from_millis(3200);
const TIMEOUT: Duration = Duration::from_millis(500);

/// One reconcile as the reconciler saw it.
#[derive(Clone, Debug)]
struct Attempt {
    at: Instant,
    /// `Context::failures` then.
    failures: u32,
    /// The object's resource version.
    version: String,
    /// Whether it succeeded.
    passed: bool,
}

/// Every attempt, by `cluster/name` (the single cluster's id is empty).
#[derive(Default)]
struct Attempts {
    by_key: Mutex<HashMap<String, Vec<Attempt>>>,
    /// Objects labelled `external` whose next attempt succeeds (its failures are not the
    /// object's: nothing in it changes).
    pass_once: Mutex<std::collections::HashSet<String>>,
    /// How many times the error policy was asked about each key.
    policy: Mutex<HashMap<String, usize>>,
}

impl Attempts {
    fn of(&self, key: &str) -> Vec<Attempt> {
        self.by_key
            .lock()
            .unwrap()
            .get(key)
            .cloned()
            .unwrap_or_default()
    }

    /// The attempts of `key` at `version`.
    fn at(&self, key: &str, version: &str) -> Vec<Attempt> {
        self.of(key)
            .into_iter()
            .filter(|a| a.version == version)
            .collect()
    }

    /// Waits until `key` has had `n` attempts at `version`; they are returned.
    async fn wait_at(&self, key: &str, version: &str, n: usize, secs: u64) -> Vec<Attempt> {
        eventually(
            secs,
            &format!("{n} attempts of {key} at {version}"),
            async || self.at(key, version).len() >= n,
        )
        .await;
        self.at(key, version)
    }

    /// Waits until `key` has had `n` attempts; they are returned.
    async fn wait_for(&self, key: &str, n: usize, secs: u64) -> Vec<Attempt> {
        eventually(secs, &format!("{n} attempts of {key}"), async || {
            self.of(key).len() >= n
        })
        .await;
        self.of(key)
    }
}

#[derive(Debug)]
struct Refused;

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("not ok yet")
    }
}

impl std::error::Error for Refused {}

/// Fails while the object's `ok` is not `yes`, except in cluster `two` (where everything
/// succeeds); an object labelled `again` asks for a rate-limited requeue instead, until its
/// fifth attempt.
async fn reconcile<C: ClusterId>(
    cm: Arc<ConfigMap>,
    ctx: Context<C, Attempts>,
) -> Result<Action, Refused> {
    let cluster = ctx.request().cluster.to_string();
    let key = format!("{cluster}/{}", cm.name_any());
    let external = cm.labels().contains_key("external");
    let passed = external && ctx.state().pass_once.lock().unwrap().remove(&key);
    let attempt = Attempt {
        at: Instant::now(),
        failures: ctx.failures(),
        version: cm.resource_version().unwrap_or_default(),
        passed,
    };
    let count = {
        let mut attempts = ctx.state().by_key.lock().unwrap();
        let list = attempts.entry(key).or_default();
        list.push(attempt);
        list.len()
    };
    if external {
        // Succeeds when told to, and looks again soon; fails otherwise.
        return if passed {
            Ok(Action::requeue(Duration::from_millis(300)))
        } else {
            Err(Refused)
        };
    }
    if cm.labels().contains_key("terminal") {
        // Not to be retried until it changes, whatever the error policy says.
        return Err(ctx.terminal(Refused));
    }
    if cm.labels().contains_key("hang") {
        // A call that never answers: dropped at the reconcile timeout.
        std::future::pending::<()>().await;
    }
    if cm.labels().contains_key("polite") {
        // A call that never answers, abandoned when the context ends at the timeout: its
        // error goes to the error policy.
        assert!(ctx.deadline().is_some());
        ctx.cancelled().await;
        return Err(Refused);
    }
    if cm.labels().contains_key("again") {
        return Ok(if count < 5 {
            Action::backoff()
        } else {
            Action::await_change()
        });
    }
    let ok = cm
        .data
        .as_ref()
        .and_then(|d| d.get("ok"))
        .map(String::as_str)
        == Some("yes");
    if ok || cluster == "two" {
        Ok(Action::await_change())
    } else {
        Err(Refused)
    }
}

/// Backs off, and counts who asked.
fn backoff_policy<C: ClusterId>(
    cm: Arc<ConfigMap>,
    _: &Refused,
    ctx: &Context<C, Attempts>,
) -> Action {
    let key = format!("{}/{}", ctx.request().cluster, cm.name_any());
    *ctx.state().policy.lock().unwrap().entry(key).or_default() += 1;
    Action::backoff()
}

fn object(name: &str, ok: bool, labels: &[&str]) -> ConfigMap {
    ConfigMap {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some(NS.into()),
            labels: Some(
                std::iter::once(LABEL)
                    .chain(labels.iter().copied())
                    .map(|l| (l.to_string(), "yes".to_string()))
                    .collect(),
            ),
            ..Default::default()
        },
        data: Some([("ok".to_string(), if ok { "yes" } else { "no" }.to_string())].into()),
        ..Default::default()
    }
}

/// Patches `name` with `patch`; its new resource version.
async fn patch(api: &Api<ConfigMap>, name: &str, patch: serde_json::Value) -> String {
    api.patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap()
        .resource_version()
        .unwrap()
}

/// Waits until the attempts of `key` satisfy `done`; they are returned.
async fn eventually_tries(
    attempts: &Attempts,
    key: &str,
    done: impl Fn(&[Attempt]) -> bool,
) -> Vec<Attempt> {
    eventually(30, &format!("the attempts of {key}"), async || {
        done(&attempts.of(key))
    })
    .await;
    attempts.of(key)
}

/// The gaps between consecutive attempts.
fn gaps(attempts: &[Attempt]) -> Vec<Duration> {
    attempts.windows(2).map(|w| w[1].at - w[0].at).collect()
}

/// Each gap at least its delay of the curve (base doubling, capped), and not much more.
fn assert_curve(what: &str, gaps: &[Duration], first: u32) {
    for (i, gap) in gaps.iter().enumerate() {
        let expected = FailureBackoff::default()
            .base(BASE)
            .max(MAX)
            .delay(first + i as u32);
        assert!(
            *gap + Duration::from_millis(2) >= expected && *gap < expected + Duration::from_secs(2),
            "{what}: gap {i} was {gap:?}, the curve says {expected:?} (all: {gaps:?})"
        );
    }
}

/// The scenario, in whichever mode `manager` runs: `first` is the cluster whose object fails
/// (`""` in single mode), `other` a second cluster where it does not (fleet mode).
async fn backoff_scenario<P: Provider>(
    manager: Arc<Manager<P>>,
    client: kube::Client,
    first: &str,
    other: Option<&str>,
    registry: Arc<prometheus_client::registry::Registry>,
) where
    P::Id: ClusterId,
{
    create_namespace(&client, NS).await;
    let api = Api::<ConfigMap>::namespaced(client.clone(), NS);
    let attempts = Arc::new(Attempts::default());
    Builder::<_, ConfigMap>::new(&manager, watcher::Config::default().labels(LABEL))
        .failure_backoff(FailureBackoff::default().base(BASE).max(MAX))
        .reconcile_timeout(TIMEOUT)
        .start(reconcile, backoff_policy, attempts.clone());
    let run = spawn_manager(&manager);
    let bad = format!("{first}/bad");
    let good = format!("{first}/good");
    api.create(&PostParams::default(), &object("bad", false, &[]))
        .await
        .unwrap();

    // An object that always fails: 100 ms, 200, 400, 800, 1.6 s, 3.2 s, 3.2 s between tries.
    let tries = attempts.wait_for(&bad, 7, 60).await;
    assert_curve("failing", &gaps(&tries[..7]), 0);
    let counted: Vec<u32> = tries[..7].iter().map(|a| a.failures).collect();
    let tries_before = tries.clone();
    assert_eq!(
        counted,
        [0, 1, 2, 3, 4, 5, 6],
        "Context::failures of each try"
    );

    // A sibling in the same cluster is reconciled as it changes, whatever bad's wait.
    api.create(&PostParams::default(), &object("good", true, &[]))
        .await
        .unwrap();
    attempts.wait_for(&good, 1, 10).await;
    let waiting_since = attempts.of(&bad).last().unwrap().at;
    let patched = Instant::now();
    let touched = patch(
        &api,
        "good",
        serde_json::json!({"metadata": {"annotations": {"touched": "1"}}}),
    )
    .await;
    let good_tries = attempts.wait_at(&good, &touched, 1, 10).await;
    assert!(
        good_tries[0].at - patched < MAX,
        "the sibling's change waited {:?}",
        good_tries[0].at - patched
    );
    assert_eq!(good_tries[0].failures, 0);
    // Sync point: bad has tried again since; the sibling ran once per change only.
    let before = attempts.of(&bad).len();
    attempts.wait_for(&bad, before + 1, 20).await;
    assert!(attempts.of(&bad).last().unwrap().at > waiting_since);
    assert_eq!(attempts.of(&good).len(), 2, "the sibling is not retried");

    // Another cluster's reconcile of the same object succeeded at once and is not retried.
    if let Some(other) = other {
        let theirs = attempts.of(&format!("{other}/bad"));
        assert_eq!(theirs.len(), 1, "{other}/bad: {theirs:?}");
        assert_eq!(theirs[0].failures, 0);
        assert!(
            theirs[0].at < tries_before[1].at + Duration::from_secs(2),
            "{other}/bad waited"
        );
    }

    // A change of the object starts its curve over: reconciled at once, then 100 ms, 200 ms.
    let changed = Instant::now();
    let version = patch(
        &api,
        "bad",
        serde_json::json!({"metadata": {"annotations": {"try": "2"}}}),
    )
    .await;
    let after = attempts.wait_at(&bad, &version, 3, 20).await;
    assert!(
        after[0].at - changed < Duration::from_secs(2),
        "the change waited {:?}",
        after[0].at - changed
    );
    assert_eq!(after[0].failures, 0, "a change starts the count over");
    assert_curve("after a change", &gaps(&after[..3]), 0);

    // A success is not retried: fixed, then broken again (a sync point for the fix).
    let fixed = patch(&api, "bad", serde_json::json!({"data": {"ok": "yes"}})).await;
    attempts.wait_at(&bad, &fixed, 1, 20).await;
    let broken = patch(&api, "bad", serde_json::json!({"data": {"ok": "no"}})).await;
    attempts.wait_at(&bad, &broken, 1, 20).await;
    assert_eq!(
        attempts.at(&bad, &fixed).len(),
        1,
        "a success is not retried"
    );

    // A success starts the count over even if the object did not change: an object failing
    // for reasons outside it fails five times, succeeds once (and asks to be looked at
    // again in 300 ms), then fails again from the start of the curve.
    let flaky = format!("{first}/flaky");
    api.create(
        &PostParams::default(),
        &object("flaky", true, &["external"]),
    )
    .await
    .unwrap();
    attempts.wait_for(&flaky, 5, 20).await;
    attempts.pass_once.lock().unwrap().insert(flaky.clone());
    let tries = eventually_tries(&attempts, &flaky, |tries| {
        tries
            .iter()
            .position(|a| a.passed)
            .is_some_and(|p| tries.len() >= p + 4)
    })
    .await;
    let passed = tries.iter().position(|a| a.passed).unwrap();
    assert!(tries[passed].failures >= 5, "{tries:?}");
    let again = &tries[passed + 1..];
    assert_eq!(again[0].failures, 0, "a success starts the count over");
    assert_curve("after a success", &gaps(&again[..3]), 0);
    assert!(
        tries.iter().all(|a| a.version == tries[0].version),
        "the object did not change"
    );

    // A rate-limited requeue (Action::backoff from the reconciler) follows the same curve and
    // is counted as `requeue`.
    let again_key = format!("{first}/again");
    api.create(&PostParams::default(), &object("again", true, &["again"]))
        .await
        .unwrap();
    let requeued = attempts.wait_for(&again_key, 5, 20).await;
    assert_curve("requeue", &gaps(&requeued[..5]), 0);
    let counted: Vec<u32> = requeued[..5].iter().map(|a| a.failures).collect();
    assert_eq!(counted, [0, 1, 2, 3, 4]);

    // A terminal error is not retried (the error policy would back off): sync point, another
    // failing object's next three tries (100 + 200 + 400 ms of backoff); a change runs it again,
    // once.
    let terminal = format!("{first}/terminal");
    let pulse = format!("{first}/pulse");
    api.create(
        &PostParams::default(),
        &object("terminal", true, &["terminal"]),
    )
    .await
    .unwrap();
    let first_try = attempts.wait_for(&terminal, 1, 20).await[0].clone();
    api.create(&PostParams::default(), &object("pulse", false, &[]))
        .await
        .unwrap();
    eventually_tries(&attempts, &pulse, |tries| {
        tries.iter().filter(|a| a.at > first_try.at).count() >= 4
    })
    .await;
    assert_eq!(
        attempts.of(&terminal).len(),
        1,
        "a terminal error is not retried"
    );
    let edited = patch(
        &api,
        "terminal",
        serde_json::json!({"metadata": {"annotations": {"edited": "1"}}}),
    )
    .await;
    let after_edit = attempts.wait_at(&terminal, &edited, 1, 20).await[0].clone();
    eventually_tries(&attempts, &pulse, |tries| {
        tries.iter().filter(|a| a.at > after_edit.at).count() >= 3
    })
    .await;
    assert_eq!(attempts.of(&terminal).len(), 2, "once per change");
    assert_eq!(after_edit.failures, 0, "a change starts the count over");

    // A reconcile that hangs is dropped at the timeout and retried after the object's backoff.
    let hang = format!("{first}/hang");
    api.create(&PostParams::default(), &object("hang", true, &["hang"]))
        .await
        .unwrap();
    let hung = attempts.wait_for(&hang, 3, 20).await;
    let counted: Vec<u32> = hung[..3].iter().map(|a| a.failures).collect();
    assert_eq!(counted, [0, 1, 2], "a timeout counts as a failure");
    // Dropped a second after its timeout (its context ended at the timeout).
    for (i, gap) in gaps(&hung[..3]).iter().enumerate() {
        let least = TIMEOUT + Duration::from_secs(1) + BASE * 2u32.pow(i as u32);
        assert!(
            *gap >= least && *gap < least + Duration::from_secs(2),
            "hang: gap {i} was {gap:?}, at least {least:?}"
        );
    }

    assert_eq!(
        attempts.policy.lock().unwrap().get(&hang),
        None,
        "a dropped reconcile has no error for the error policy"
    );

    // A reconcile that ends when its context does (at the timeout) returns its own error:
    // the error policy sees it, and the object backs off.
    let polite = format!("{first}/polite");
    api.create(&PostParams::default(), &object("polite", true, &["polite"]))
        .await
        .unwrap();
    eventually(
        30,
        "the error policy asked twice about polite",
        async || attempts.policy.lock().unwrap().get(&polite).copied() >= Some(2),
    )
    .await;
    let tries = attempts.of(&polite);
    for (i, gap) in gaps(&tries[..2]).iter().enumerate() {
        let least = TIMEOUT + BASE * 2u32.pow(i as u32);
        assert!(
            *gap >= least && *gap < least + Duration::from_millis(900),
            "polite: gap {i} was {gap:?}, at least {least:?} (and not the drop's second more)"
        );
    }

    let text = {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        text
    };
    let cluster_label = if first.is_empty() { "single" } else { first };
    let requeues = sample(
        &text,
        "controller_runtime_reconcile_total",
        &[("result", "requeue"), ("cluster", cluster_label)],
    );
    assert!(
        requeues.is_some_and(|n| n >= 4.0),
        "reconcile_total{{result=requeue}}: {requeues:?}"
    );
    for (metric, least) in [
        ("controller_runtime_terminal_reconcile_errors_total", 2.0),
        // Two of hang's drops, two of polite's returns past the deadline.
        ("controller_runtime_reconcile_timeouts_total", 4.0),
    ] {
        let counted = sample(&text, metric, &[("cluster", cluster_label)]);
        assert!(counted.is_some_and(|n| n >= least), "{metric}: {counted:?}");
    }
    if other.is_some() {
        // The fleet queue's retries: every failure of bad and every requeue of again.
        let retries = sample(
            &text,
            "workqueue_retries_total",
            &[("cluster", cluster_label)],
        );
        assert!(
            retries.is_some_and(|n| n >= 14.0),
            "workqueue_retries_total: {retries:?}"
        );
    }
    manager.shutdown();
    run.await.unwrap();
}

#[tokio::test]
async fn single_mode_backs_off_per_object_and_starts_over_on_change_or_success() {
    let env = TestEnv::start().await.unwrap();
    let client = env.cluster(0).unwrap().client().unwrap();
    let mut registry = prometheus_client::registry::Registry::default();
    let metrics = Metrics::new(&mut registry);
    let manager = Arc::new(Manager::new(SingleProvider::new(client.clone())).metrics(metrics));
    backoff_scenario(manager, client, "", None, Arc::new(registry)).await;
}

#[tokio::test]
async fn fleet_mode_backs_off_per_object_and_cluster_and_starts_over_on_change_or_success() {
    let env = TestEnv::start().await.unwrap();
    let client = env.cluster(0).unwrap().client().unwrap();
    // Two cluster names for one API server: the same objects, failing in `one` only.
    let clusters = Clusters::new();
    for id in ["one", "two"] {
        clusters
            .add(Cluster::new(name(id), client.clone()))
            .unwrap();
    }
    let mut registry = prometheus_client::registry::Registry::default();
    let metrics = Metrics::new(&mut registry);
    let manager = Arc::new(Manager::new(clusters).metrics(metrics));
    backoff_scenario(manager, client, "one", Some("two"), Arc::new(registry)).await;
}

/// Every reconcile's start, in order: `(cluster/name, when)`.
#[derive(Default)]
struct Starts(Mutex<Vec<(String, Instant)>>);

impl Starts {
    fn all(&self) -> Vec<(String, Instant)> {
        self.0.lock().unwrap().clone()
    }
}

const ORDER_NS: &str = "order";
const LISTED: usize = 80;
const ORDER_CONCURRENCY: u16 = 2;

/// Records the start, then takes 100 ms.
async fn slow<C: ClusterId>(
    cm: Arc<ConfigMap>,
    ctx: Context<C, Starts>,
) -> Result<Action, Refused> {
    let key = format!("{}/{}", ctx.request().cluster, cm.name_any());
    ctx.state().0.lock().unwrap().push((key, Instant::now()));
    tokio::time::sleep(Duration::from_millis(100)).await;
    Ok(Action::await_change())
}

/// The attempts of a resync controller: when, at which version.
#[derive(Default)]
struct Seen(Mutex<HashMap<String, Vec<(Instant, String)>>>);

async fn seen<C: ClusterId>(cm: Arc<ConfigMap>, ctx: Context<C, Seen>) -> Result<Action, Refused> {
    let key = format!("{}/{}", ctx.request().cluster, cm.name_any());
    let version = cm.resource_version().unwrap_or_default();
    ctx.state()
        .0
        .lock()
        .unwrap()
        .entry(key)
        .or_default()
        .push((Instant::now(), version));
    Ok(Action::await_change())
}

/// How many LIST and finished WATCH requests for ConfigMaps the API server has served (a
/// relist shows as both; a healthy watch counts when it ends).
async fn configmap_lists_and_watches(client: &kube::Client) -> u64 {
    let request = http::Request::get("/metrics").body(Vec::new()).unwrap();
    let text = client.request_text(request).await.unwrap();
    text.lines()
        .filter(|l| {
            l.starts_with("apiserver_request_total{")
                && l.contains("resource=\"configmaps\"")
                && (l.contains("verb=\"LIST\"") || l.contains("verb=\"WATCH\""))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// Live changes before listed objects, and the periodic resync without a relist, in
/// whichever mode `manager` runs; `clusters` are the cluster ids as the reconciler sees them.
async fn order_and_resync_scenario<P: Provider>(
    manager: Arc<Manager<P>>,
    client: kube::Client,
    clusters: &[&str],
) where
    P::Id: ClusterId,
{
    create_namespace(&client, ORDER_NS).await;
    let api = Api::<ConfigMap>::namespaced(client.clone(), ORDER_NS);
    let order_object = |name: &str, label: &str| ConfigMap {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some(ORDER_NS.into()),
            labels: Some([(label.to_string(), "yes".to_string())].into()),
            ..Default::default()
        },
        ..Default::default()
    };
    for i in 0..LISTED {
        api.create(
            &PostParams::default(),
            &order_object(&format!("listed-{i:03}"), "order"),
        )
        .await
        .unwrap();
    }
    api.create(&PostParams::default(), &order_object("r", "resync"))
        .await
        .unwrap();
    let starts = Arc::new(Starts::default());
    Builder::<_, ConfigMap>::new(&manager, watcher::Config::default().labels("order"))
        .named("order")
        .concurrency(ORDER_CONCURRENCY)
        .start(slow, |_, _, _| Action::await_change(), starts.clone());
    const PERIOD: Duration = Duration::from_secs(2);
    let resyncs = Arc::new(Seen::default());
    Builder::<_, ConfigMap>::new(&manager, watcher::Config::default().labels("resync"))
        .named("resync")
        .resync_every(Some(PERIOD))
        .start(seen, |_, _, _| Action::await_change(), resyncs.clone());
    let run = spawn_manager(&manager);

    // The listing is being reconciled, two at a time, 100 ms each: a change now.
    eventually(30, "the listing's first reconciles", async || {
        starts.all().len() >= 6
    })
    .await;
    let created = Instant::now();
    api.create(&PostParams::default(), &order_object("live", "order"))
        .await
        .unwrap();
    let live_keys: Vec<String> = clusters.iter().map(|c| format!("{c}/live")).collect();
    eventually(30, "the live object's reconciles", async || {
        let all = starts.all();
        live_keys.iter().all(|k| all.iter().any(|(s, _)| s == k))
    })
    .await;
    let all = starts.all();
    for (cluster, key) in clusters.iter().zip(&live_keys) {
        let prefix = format!("{cluster}/listed-");
        let live_at = all.iter().find(|(s, _)| s == key).unwrap().1;
        let listed: Vec<Instant> = all
            .iter()
            .filter(|(s, _)| s.starts_with(&prefix))
            .map(|(_, at)| *at)
            .collect();
        let ahead = listed
            .iter()
            .filter(|at| **at > created && **at < live_at)
            .count();
        // The ones running when the change came, plus what started while its event was on
        // its way (at most 0.6 s of it): not the listing's rest.
        assert!(
            ahead <= 8,
            "{key}: {ahead} listed objects started between the change and its reconcile"
        );
        // Not vacuous: most of the listing was still waiting when the change ran.
        eventually(60, &format!("{cluster}'s listing done"), async || {
            starts
                .all()
                .iter()
                .filter(|(s, _)| s.starts_with(&prefix))
                .count()
                >= LISTED
        })
        .await;
        let after = starts
            .all()
            .iter()
            .filter(|(s, at)| s.starts_with(&prefix) && *at > live_at)
            .count();
        assert!(
            after >= LISTED / 2,
            "{key} ran after all but {after} of the listing: it was not ahead of it"
        );
    }

    // The resync: every period (±10 %) again, the object unchanged, nothing listed again.
    let key = format!("{}/r", clusters[0]);
    let lists = {
        eventually(30, "the resync object's first reconcile", async || {
            resyncs
                .0
                .lock()
                .unwrap()
                .get(&key)
                .is_some_and(|v| !v.is_empty())
        })
        .await;
        configmap_lists_and_watches(&client).await
    };
    eventually(30, "three resyncs", async || {
        resyncs
            .0
            .lock()
            .unwrap()
            .get(&key)
            .is_some_and(|v| v.len() >= 4)
    })
    .await;
    let attempts = resyncs.0.lock().unwrap().get(&key).cloned().unwrap();
    assert!(
        attempts.iter().all(|(_, v)| *v == attempts[0].1),
        "the object did not change: {attempts:?}"
    );
    // From the first resync on (the first reconcile came with the listing, after the
    // period had begun).
    for pair in attempts[1..4].windows(2) {
        let gap = pair[1].0 - pair[0].0;
        assert!(
            gap >= PERIOD.mul_f64(0.9) - Duration::from_millis(5)
                && gap < PERIOD.mul_f64(1.1) + Duration::from_secs(1),
            "resync gap {gap:?} for a period of {PERIOD:?}"
        );
    }
    assert_eq!(
        configmap_lists_and_watches(&client).await,
        lists,
        "a resync reads the cache: no list, no watch restarted"
    );
    manager.shutdown();
    run.await.unwrap();
}

#[tokio::test]
async fn single_mode_puts_live_changes_before_listed_objects_and_resyncs_from_the_cache() {
    let env = TestEnv::start().await.unwrap();
    let client = env.cluster(0).unwrap().client().unwrap();
    let manager = Arc::new(Manager::new(SingleProvider::new(client.clone())));
    order_and_resync_scenario(manager, client, &[""]).await;
}

#[tokio::test]
async fn fleet_mode_puts_live_changes_before_listed_objects_and_resyncs_from_the_cache() {
    let env = TestEnv::start().await.unwrap();
    let client = env.cluster(0).unwrap().client().unwrap();
    let clusters = Clusters::new();
    for id in ["one", "two"] {
        clusters
            .add(Cluster::new(name(id), client.clone()))
            .unwrap();
    }
    let manager = Arc::new(Manager::new(clusters));
    order_and_resync_scenario(manager, client, &["one", "two"]).await;
}

/// L5 of the 2026-11-27 core review: in single mode a periodic resync waits behind live
/// changes as a listing does. A change made just after a resync began starts before most of
/// the resync's objects (kube-runtime's own bulk trigger makes them all due at once, and the
/// change waits behind a random share of them).
#[tokio::test]
async fn single_mode_puts_a_live_change_before_the_objects_of_a_resync() {
    const NS: &str = "resync-order";
    let env = TestEnv::start().await.unwrap();
    let client = env.cluster(0).unwrap().client().unwrap();
    let manager = Arc::new(Manager::new(SingleProvider::new(client.clone())));
    create_namespace(&client, NS).await;
    let api = Api::<ConfigMap>::namespaced(client.clone(), NS);
    let object = |name: &str| ConfigMap {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some(NS.into()),
            labels: Some([("resync-order".to_string(), "yes".to_string())].into()),
            ..Default::default()
        },
        ..Default::default()
    };
    for i in 0..LISTED {
        api.create(&PostParams::default(), &object(&format!("listed-{i:03}")))
            .await
            .unwrap();
    }
    let starts = Arc::new(Starts::default());
    // A pass over the objects takes about 4 s (80 of 100 ms, two at a time).
    Builder::<_, ConfigMap>::new(&manager, watcher::Config::default().labels("resync-order"))
        .named("resync-order")
        .concurrency(ORDER_CONCURRENCY)
        .resync_every(Some(Duration::from_secs(8)))
        .start(slow, |_, _, _| Action::await_change(), starts.clone());
    let run = spawn_manager(&manager);
    let starts_of = |key: &str| starts.all().iter().filter(|(k, _)| k == key).count();
    // Sync point: the resync began (an object started a second time).
    eventually(60, "the resync's first reconciles", async || {
        (0..LISTED).any(|i| starts_of(&format!("/listed-{i:03}")) >= 2)
    })
    .await;
    let created = Instant::now();
    api.create(&PostParams::default(), &object("live"))
        .await
        .unwrap();
    eventually(30, "the live object's reconcile", async || {
        starts_of("/live") >= 1
    })
    .await;
    let all = starts.all();
    let live_at = all.iter().find(|(k, _)| k == "/live").unwrap().1;
    let ahead = all
        .iter()
        .filter(|(k, at)| k.starts_with("/listed-") && *at > created && *at < live_at)
        .count();
    assert!(
        ahead <= 8,
        "{ahead} objects of the resync started between the change and its reconcile"
    );
    // Not vacuous: most of the resync was still waiting when the change ran.
    eventually(60, "the resync done", async || {
        (0..LISTED).all(|i| starts_of(&format!("/listed-{i:03}")) >= 2)
    })
    .await;
    let after = starts
        .all()
        .iter()
        .filter(|(k, at)| k.starts_with("/listed-") && *at > live_at)
        .count();
    assert!(
        after >= LISTED / 2,
        "the change ran after all but {after} objects of the resync"
    );
    manager.shutdown();
    run.await.unwrap();
}

const SYNC_NS: &str = "sync";

/// A cache that cannot list (its identity may not list ConfigMaps) is reported once the cache
/// sync timeout passes, in its cluster alone (`refused`; `allowed` goes on), and the report
/// clears once it may. `grant` gives the identity what it needs.
async fn sync_timeout_scenario<P: Provider>(
    manager: Arc<Manager<P>>,
    admin: kube::Client,
    refused: &str,
    allowed: Option<&str>,
    grant: impl AsyncFnOnce(),
    registry: Arc<prometheus_client::registry::Registry>,
) where
    P::Id: ClusterId,
{
    let logs = Logs::capture();
    create_namespace(&admin, SYNC_NS).await;
    let api = Api::<ConfigMap>::namespaced(admin.clone(), SYNC_NS);
    let mut cm = object("a", true, &[]);
    cm.metadata.namespace = Some(SYNC_NS.into());
    cm.metadata.labels = Some([("synctest".to_string(), "yes".to_string())].into());
    api.create(&PostParams::default(), &cm).await.unwrap();
    let seen_by = Arc::new(Seen::default());
    Builder::<_, ConfigMap>::new(&manager, watcher::Config::default().labels("synctest"))
        .named("synctest")
        .start(seen, |_, _, _| Action::await_change(), seen_by.clone());
    let run = spawn_manager(&manager);
    eventually(30, "serving", async || manager.served_at().is_some()).await;
    let addr = manager.served_at().unwrap();
    let id = P::Id::parse(refused).unwrap();
    eventually(30, "the refused cluster engaged", async || {
        manager.cluster(&id).is_some()
    })
    .await;
    let cluster = manager.cluster(&id).unwrap();
    if let Some(allowed) = allowed {
        eventually(30, "the allowed cluster reconciles", async || {
            seen_by
                .0
                .lock()
                .unwrap()
                .contains_key(&format!("{allowed}/a"))
        })
        .await;
    }
    let overdue = |cluster: &Cluster<P::Id>| {
        cluster
            .cache_status()
            .iter()
            .any(|s| s.kind == "ConfigMap" && s.overdue && !s.synced)
    };
    eventually(30, "the refused cache reported overdue", async || {
        overdue(&cluster)
    })
    .await;
    let status = cluster.cache_status();
    let line = status.iter().find(|s| s.overdue).unwrap();
    assert!(
        line.error
            .as_deref()
            .is_some_and(|e| e.contains("forbidden") || e.contains("403")),
        "why: {status:?}"
    );
    let label = if refused.is_empty() {
        "single"
    } else {
        refused
    };
    eventually(10, "the WARN line", async || {
        !logs
            .lines(&[
                "WARN",
                &format!("cluster={label}"),
                "kind=ConfigMap",
                "cache sync timeout",
            ])
            .is_empty()
    })
    .await;
    let (code, verbose) = http_get(addr, "/readyz?verbose").await;
    assert!(
        verbose.contains("ConfigMap not listed within the cache sync timeout, failing"),
        "{code}: {verbose}"
    );
    if allowed.is_none() {
        // The single cluster is the host: its controller's cache counts for readiness.
        assert_eq!(code, 503, "{verbose}");
    }
    let scraped = |text: &str| {
        sample(
            text,
            "multicluster_runtime_watch_sync_overdue",
            &[("cluster", label), ("kind", "ConfigMap")],
        )
    };
    let text = {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        text
    };
    assert_eq!(scraped(&text), Some(1.0), "the overdue gauge");
    if let Some(allowed) = allowed {
        assert_eq!(
            sample(
                &text,
                "multicluster_runtime_watch_sync_overdue",
                &[("cluster", allowed), ("kind", "ConfigMap")],
            ),
            Some(0.0)
        );
    }

    // Allowed now: the watch lists on its next try, the object is reconciled, the report
    // clears.
    grant().await;
    let key = format!("{refused}/a");
    eventually(
        60,
        "the refused cluster reconciles once allowed",
        async || seen_by.0.lock().unwrap().contains_key(&key),
    )
    .await;
    assert!(!overdue(&cluster), "{:?}", cluster.cache_status());
    let text = {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        text
    };
    assert_eq!(scraped(&text), Some(0.0), "the overdue gauge cleared");
    eventually(30, "ready", async || {
        http_get(addr, "/readyz").await.0 == 200
    })
    .await;
    manager.shutdown();
    run.await.unwrap();
}

fn served(
    registry: &Arc<prometheus_client::registry::Registry>,
) -> multicluster_runtime::Endpoints {
    multicluster_runtime::Endpoints::new("127.0.0.1:0".parse().unwrap())
        .plain_http()
        .metrics(registry.clone())
}

#[tokio::test]
async fn single_mode_reports_a_cache_that_does_not_list_in_time_and_clears_it_once_it_does() {
    let env = TestEnv::start().await.unwrap();
    let tc = env.cluster(0).unwrap();
    let admin = tc.client().unwrap();
    let nobody = tc.add_user("nobody", &[]).unwrap();
    let mut registry = prometheus_client::registry::Registry::default();
    let metrics = Metrics::new(&mut registry);
    let registry = Arc::new(registry);
    let client = kube::Client::try_from(nobody.config()).unwrap();
    let manager = Arc::new(
        Manager::new(SingleProvider::new(client))
            .metrics(metrics)
            .cache_sync_timeout(Duration::from_secs(2))
            .serve(served(&registry)),
    );
    let granting = admin.clone();
    sync_timeout_scenario(
        manager,
        admin,
        "",
        None,
        async move || {
            allow_config_maps(&granting, "nobody", "cm-reader", &["get", "list", "watch"]).await
        },
        registry,
    )
    .await;
}

#[tokio::test]
async fn fleet_mode_reports_a_cache_that_does_not_list_in_time_in_its_cluster_alone() {
    let env = TestEnv::start().await.unwrap();
    let tc = env.cluster(0).unwrap();
    let admin = tc.client().unwrap();
    let nobody = tc.add_user("nobody", &[]).unwrap();
    let clusters = clusters_of([("allowed", admin.clone())]);
    clusters
        .add(Cluster::from_config(name("refused"), nobody.config()).unwrap())
        .unwrap();
    let mut registry = prometheus_client::registry::Registry::default();
    let metrics = Metrics::new(&mut registry);
    let registry = Arc::new(registry);
    let manager = Arc::new(
        Manager::new(clusters)
            .metrics(metrics)
            .cache_sync_timeout(Duration::from_secs(2))
            .serve(served(&registry)),
    );
    let granting = admin.clone();
    sync_timeout_scenario(
        manager,
        admin,
        "refused",
        Some("allowed"),
        async move || {
            allow_config_maps(&granting, "nobody", "cm-reader", &["get", "list", "watch"]).await
        },
        registry,
    )
    .await;
}

const WARM_NS: &str = "warm";
const WARM_OBJECTS: usize = 20;

/// Reconciles by replica: `(replica, name, when)`.
#[derive(Default)]
struct ByReplica(Mutex<Vec<(String, String, Instant)>>);

impl ByReplica {
    fn of(&self, replica: &str) -> Vec<(String, Instant)> {
        self.0
            .lock()
            .unwrap()
            .iter()
            .filter(|(r, _, _)| r == replica)
            .map(|(_, n, at)| (n.clone(), *at))
            .collect()
    }
}

struct Replica {
    name: &'static str,
    log: Arc<ByReplica>,
}

async fn by_replica<C: ClusterId>(
    cm: Arc<ConfigMap>,
    ctx: Context<C, Replica>,
) -> Result<Action, Refused> {
    let replica = ctx.state();
    replica
        .log
        .0
        .lock()
        .unwrap()
        .push((replica.name.to_string(), cm.name_any(), Instant::now()));
    Ok(Action::await_change())
}

fn warm_election(client: kube::Client, identity: &str) -> multicluster_runtime::LeaderElection {
    multicluster_runtime::LeaderElection::new(client, "default", "warm-leader")
        .identity(identity)
        .timing(
            multicluster_runtime::LeaseTiming::default()
                .lease_duration(Duration::from_secs(4))
                .renew_deadline(Duration::from_secs(2))
                .retry_period(Duration::from_millis(500)),
        )
}

/// Whether `manager`'s cluster `id` has a listed cache of the warm objects.
fn warm_cache<P: Provider>(manager: &Manager<P>, id: &P::Id) -> bool {
    manager.cluster(id).is_some_and(|c| {
        c.cache_status()
            .iter()
            .any(|s| s.kind == "ConfigMap" && s.config.contains("warm") && s.synced)
    })
}

/// A follower with warm standby keeps the controller's caches listed without reconciling,
/// and takes over from them; one without starts nothing before it leads. `replica` builds a
/// replica (`name`, warm or not) with leader election, its controller's state given.
async fn warm_standby_scenario<P: Provider>(
    admin: kube::Client,
    id: &str,
    replica: impl Fn(&'static str, bool, Arc<ByReplica>) -> Arc<Manager<P>>,
) where
    P::Id: ClusterId,
{
    let id = P::Id::parse(id).unwrap();
    create_namespace(&admin, WARM_NS).await;
    let api = Api::<ConfigMap>::namespaced(admin.clone(), WARM_NS);
    let warm_object = |name: String| ConfigMap {
        metadata: ObjectMeta {
            name: Some(name),
            namespace: Some(WARM_NS.into()),
            labels: Some([("warm".to_string(), "yes".to_string())].into()),
            ..Default::default()
        },
        ..Default::default()
    };
    for i in 0..WARM_OBJECTS {
        api.create(&PostParams::default(), &warm_object(format!("o{i:02}")))
            .await
            .unwrap();
    }
    let log = Arc::new(ByReplica::default());
    let a = replica("a", false, log.clone());
    let a_run = spawn_manager(&a);
    tokio::time::timeout(Duration::from_secs(30), a.elected())
        .await
        .expect("a leads");
    eventually(30, "a reconciles everything", async || {
        log.of("a").len() >= WARM_OBJECTS
    })
    .await;

    // Two followers: b warm, c cold.
    let b = replica("b", true, log.clone());
    let b_run = spawn_manager(&b);
    let c = replica("c", false, log.clone());
    let c_run = spawn_manager(&c);
    eventually(30, "b's caches listed while it follows", async || {
        warm_cache(&b, &id)
    })
    .await;
    // A change while they follow: b's cache has it; a reconciles it (the sync point for
    // what the followers did meanwhile).
    api.create(&PostParams::default(), &warm_object("late".into()))
        .await
        .unwrap();
    eventually(30, "a reconciles the late object", async || {
        log.of("a").iter().any(|(n, _)| n == "late")
    })
    .await;
    eventually(30, "b's cache has the late object", async || {
        b.cluster(&id).is_some_and(|c| {
            c.store::<ConfigMap>(&watcher::Config::default().labels("warm"))
                .is_ok_and(|s| s.find(|o| o.name_any() == "late").is_some())
        })
    })
    .await;
    assert!(!b.is_leader() && !c.is_leader());
    assert!(
        log.of("b").is_empty(),
        "a follower reconciled: {:?}",
        log.of("b")
    );
    assert!(
        !warm_cache(&c, &id),
        "a cold follower started the controller's cache"
    );
    c.shutdown();
    c_run.await.unwrap();

    // a dies without giving the Lease up: b takes over and reconciles from its caches.
    a_run.abort();
    let _ = a_run.await;
    tokio::time::timeout(Duration::from_secs(15), b.elected())
        .await
        .expect("b leads");
    let leading = Instant::now();
    eventually(30, "b reconciles everything", async || {
        log.of("b").len() > WARM_OBJECTS
    })
    .await;
    let first = log.of("b").iter().map(|(_, at)| *at).min().unwrap();
    assert!(
        first + Duration::from_millis(100) >= leading,
        "b reconciled before it led"
    );
    b.shutdown();
    b_run.await.unwrap();
}

#[tokio::test]
async fn fleet_mode_warm_standby_keeps_caches_listed_and_takes_over_from_them() {
    let env = TestEnv::start().await.unwrap();
    let admin = env.cluster(0).unwrap().client().unwrap();
    let host = admin.clone();
    warm_standby_scenario(admin.clone(), "member", move |name, warm, log| {
        let clusters = Clusters::new();
        clusters
            .add(Cluster::new(common::name("member"), host.clone()))
            .unwrap();
        let manager =
            Arc::new(Manager::new(clusters).leader_election(warm_election(host.clone(), name)));
        Builder::<_, ConfigMap>::new(&manager, watcher::Config::default().labels("warm"))
            .warm_standby(warm)
            .start(
                by_replica,
                |_, _, _| Action::await_change(),
                Arc::new(Replica { name, log }),
            );
        manager
    })
    .await;
}

#[tokio::test]
async fn single_mode_warm_standby_keeps_caches_listed_and_takes_over_from_them() {
    let env = TestEnv::start().await.unwrap();
    let admin = env.cluster(0).unwrap().client().unwrap();
    let host = admin.clone();
    warm_standby_scenario(admin.clone(), "", move |name, warm, log| {
        let manager = Arc::new(
            Manager::new(SingleProvider::new(host.clone()))
                .leader_election(warm_election(host.clone(), name)),
        );
        Builder::<_, ConfigMap>::new(&manager, watcher::Config::default().labels("warm"))
            .warm_standby(warm)
            .start(
                by_replica,
                |_, _, _| Action::await_change(),
                Arc::new(Replica { name, log }),
            );
        manager
    })
    .await;
}
