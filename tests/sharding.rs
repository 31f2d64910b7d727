//! Sharding the fleet across replicas with Leases, against real API servers: 300 cluster
//! names over three API servers, replicas in this process (each with clients of its own) and
//! processes of the operator example.

mod common;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{eventually, name};
use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use kube_runtime::watcher;
use multicluster_runtime::providers::Clusters;
use multicluster_runtime::{
    Action, Builder, Cluster, ClusterName, Context, LeaderElection, Manager, Metrics, OnLoss,
    Sharding,
};
use multicluster_runtime_testenv::TestEnv;

const CLUSTERS: usize = 300;
/// The API server holding the Leases; the clusters are on the three others.
const HOST: usize = 3;
const LEASE: Duration = Duration::from_secs(6);
const RENEW_DEADLINE: Duration = Duration::from_secs(4);
const RETRY: Duration = Duration::from_secs(1);
/// What the issue allows between a change and its reconcile across hand-offs.
const ALLOWED_LAG: Duration = Duration::from_secs(6 + 5);

fn cluster_name(i: usize) -> String {
    format!("c{i:03}")
}

/// One reconcile: who, where, when.
#[derive(Clone, Debug)]
struct Interval {
    replica: String,
    cluster: String,
    start: Instant,
    end: Instant,
}

/// What every replica's reconciles recorded.
#[derive(Default)]
struct Audit {
    intervals: Mutex<Vec<Interval>>,
    /// (cluster, round seen on its probe, when) for each reconcile of a cluster's own probe.
    seen: Mutex<Vec<(String, u64, Instant, String)>>,
    /// Reconciles of the leader-only controller, by replica.
    leader_only: Mutex<Vec<String>>,
}

impl Audit {
    /// Rounds of `cluster` seen so far, by the latest.
    fn latest(&self) -> HashMap<String, u64> {
        let mut latest = HashMap::new();
        for (cluster, round, _, _) in self.seen.lock().unwrap().iter() {
            let entry = latest.entry(cluster.clone()).or_insert(0);
            *entry = (*entry).max(*round);
        }
        latest
    }

    /// The first moment each (cluster, round) or a later round was seen.
    fn first_seen(&self, cluster: &str, round: u64) -> Option<Instant> {
        self.seen
            .lock()
            .unwrap()
            .iter()
            .filter(|(c, r, _, _)| c == cluster && *r >= round)
            .map(|(_, _, at, _)| *at)
            .min()
    }

    /// Pairs of reconciles of one cluster by two replicas that overlapped in time.
    fn overlaps(&self) -> Vec<(Interval, Interval)> {
        let mut by_cluster: BTreeMap<String, Vec<Interval>> = BTreeMap::new();
        for interval in self.intervals.lock().unwrap().iter() {
            by_cluster
                .entry(interval.cluster.clone())
                .or_default()
                .push(interval.clone());
        }
        let mut overlaps = Vec::new();
        for (_, mut intervals) in by_cluster {
            intervals.sort_by_key(|i| i.start);
            // The latest end seen so far per replica.
            let mut open: HashMap<String, Interval> = HashMap::new();
            for interval in intervals {
                for (replica, other) in &open {
                    if *replica != interval.replica && other.end > interval.start {
                        overlaps.push((other.clone(), interval.clone()));
                    }
                }
                let entry = open
                    .entry(interval.replica.clone())
                    .or_insert_with(|| interval.clone());
                if interval.end > entry.end {
                    *entry = interval.clone();
                }
            }
        }
        overlaps
    }
}

/// Records its interval when dropped: at the end of a reconcile, or when it is cut short.
struct Recording {
    audit: Arc<Audit>,
    replica: String,
    cluster: String,
    start: Instant,
}

impl Drop for Recording {
    fn drop(&mut self) {
        self.audit.intervals.lock().unwrap().push(Interval {
            replica: self.replica.clone(),
            cluster: self.cluster.clone(),
            start: self.start,
            end: Instant::now(),
        });
    }
}

struct State {
    replica: String,
    audit: Arc<Audit>,
}

async fn reconcile(
    probe: Arc<ConfigMap>,
    ctx: Context<ClusterName, State>,
) -> Result<Action, kube::Error> {
    let state = ctx.state();
    let cluster = ctx.cluster_id().to_string();
    let _recording = Recording {
        audit: state.audit.clone(),
        replica: state.replica.clone(),
        cluster: cluster.clone(),
        start: Instant::now(),
    };
    // Every cluster of an API server sees every probe there; its own is in its namespace.
    if probe.namespace().as_deref() == Some(cluster.as_str()) {
        let round = probe
            .data
            .as_ref()
            .and_then(|d| d.get("round"))
            .and_then(|r| r.parse().ok())
            .unwrap_or(0);
        state.audit.seen.lock().unwrap().push((
            cluster,
            round,
            Instant::now(),
            state.replica.clone(),
        ));
        // Long enough that a second replica reconciling at the same time would overlap.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(Action::await_change())
}

async fn leader_only(
    _: Arc<ConfigMap>,
    ctx: Context<ClusterName, State>,
) -> Result<Action, kube::Error> {
    let state = ctx.state();
    state
        .audit
        .leader_only
        .lock()
        .unwrap()
        .push(state.replica.clone());
    Ok(Action::await_change())
}

struct Replica {
    id: String,
    manager: Arc<Manager<Clusters<ClusterName>>>,
    run: tokio::task::JoinHandle<()>,
    registry: Arc<prometheus_client::registry::Registry>,
}

impl Replica {
    /// Starts replica `id`: its own clients for all 300 clusters and the host.
    fn start(env: &TestEnv, id: &str, audit: &Arc<Audit>) -> Replica {
        let provider = Clusters::<ClusterName>::new();
        for i in 0..CLUSTERS {
            let mut config = env.cluster(i % 3).unwrap().config();
            config.default_namespace = cluster_name(i);
            provider
                .add(Cluster::from_config(name(&cluster_name(i)), config).unwrap())
                .unwrap();
        }
        let host = env.cluster(HOST).unwrap().client().unwrap();
        let mut registry = prometheus_client::registry::Registry::default();
        let metrics = Metrics::new(&mut registry);
        let manager = Arc::new(
            Manager::new(provider)
                .with_local(Cluster::new(name("host"), host.clone()))
                .metrics(metrics)
                .graceful_timeout(Duration::from_secs(5))
                .sharding(
                    Sharding::new(host.clone(), "shard", "test")
                        .identity(id)
                        .lease_duration(LEASE)
                        .renew_deadline(RENEW_DEADLINE)
                        .retry_period(RETRY),
                )
                .leader_election(
                    LeaderElection::new(host, "shard", "test-leader")
                        .identity(id)
                        .lease_duration(LEASE)
                        .renew_deadline(RENEW_DEADLINE)
                        .retry_period(RETRY)
                        .on_loss(OnLoss::Candidate),
                ),
        );
        let state = Arc::new(State {
            replica: id.to_string(),
            audit: audit.clone(),
        });
        Builder::<_, ConfigMap>::new(&manager, watcher::Config::default().labels("probe"))
            .named("probes")
            .disengage_grace(Duration::from_secs(1))
            .start(reconcile, |_, _, _| Action::requeue(RETRY), state.clone());
        Builder::<_, ConfigMap>::new(&manager, watcher::Config::default().labels("leader-probe"))
            .named("leader-only")
            .engage_local(true)
            .engage_provider(false)
            .leader_only()
            .start(leader_only, |_, _, _| Action::requeue(RETRY), state);
        let run = {
            let manager = manager.clone();
            let id = id.to_string();
            tokio::spawn(async move {
                if let Err(error) = manager.run().await {
                    panic!("replica {id}: {error}");
                }
            })
        };
        Replica {
            id: id.to_string(),
            manager,
            run,
            registry: Arc::new(registry),
        }
    }

    /// The clusters this replica reconciles now (its fleet's members).
    fn owned(&self) -> Vec<String> {
        self.manager
            .fleet()
            .ids()
            .iter()
            .map(ToString::to_string)
            .collect()
    }

    /// A series' value in this replica's metrics (summed over its labels).
    fn metric(&self, series: &str) -> f64 {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.registry).unwrap();
        text.lines()
            .filter(|l| l.starts_with(series) && l[series.len()..].starts_with(['{', ' ']))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    async fn stop(self) {
        self.manager.shutdown();
        self.run.await.unwrap();
    }
}

/// Whether every cluster is owned by exactly one of `replicas`, each of which sees all of
/// them as peers; the owners by cluster.
fn settled(replicas: &[&Replica]) -> Option<BTreeMap<String, String>> {
    let ids: Vec<String> = replicas.iter().map(|r| r.id.clone()).collect();
    let mut owners = BTreeMap::new();
    for replica in replicas {
        let status = replica.manager.shard_status()?;
        let mut peers = status.peers.clone();
        peers.sort();
        let mut expected = ids.clone();
        expected.sort();
        if peers != expected || status.handing_off > 0 {
            return None;
        }
        for cluster in replica.owned() {
            if owners.insert(cluster, replica.id.clone()).is_some() {
                return None;
            }
        }
    }
    (owners.len() == CLUSTERS).then_some(owners)
}

/// Writes `round` into every cluster's probe; returns when each write began.
async fn write_round(env: &TestEnv, round: u64) -> Vec<(String, Instant)> {
    let clients: Vec<Client> = (0..3)
        .map(|i| env.cluster(i).unwrap().client().unwrap())
        .collect();
    futures::stream::iter(0..CLUSTERS)
        .map(|i| {
            let client = clients[i % 3].clone();
            async move {
                let cluster = cluster_name(i);
                let api: Api<ConfigMap> = Api::namespaced(client, &cluster);
                let patch = serde_json::json!({"data": {"round": round.to_string()}});
                let began = Instant::now();
                api.patch("probe", &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                    .unwrap();
                (cluster, began)
            }
        })
        .buffer_unordered(32)
        .collect()
        .await
}

async fn fixture(env: &TestEnv) {
    common::create_namespace(&env.cluster(HOST).unwrap().client().unwrap(), "shard").await;
    let clients: Vec<Client> = (0..3)
        .map(|i| env.cluster(i).unwrap().client().unwrap())
        .collect();
    futures::stream::iter(0..CLUSTERS)
        .for_each_concurrent(32, |i| {
            let client = clients[i % 3].clone();
            async move {
                let cluster = cluster_name(i);
                common::create_namespace(&client, &cluster).await;
                let probe = ConfigMap {
                    metadata: ObjectMeta {
                        name: Some("probe".into()),
                        namespace: Some(cluster.clone()),
                        labels: Some([("probe".to_string(), "yes".to_string())].into()),
                        ..Default::default()
                    },
                    data: Some([("round".to_string(), "0".to_string())].into()),
                    ..Default::default()
                };
                Api::<ConfigMap>::namespaced(client, &cluster)
                    .create(&PostParams::default(), &probe)
                    .await
                    .unwrap();
            }
        })
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replicas_split_300_clusters_evenly_hand_them_over_without_overlap_and_leave_none_behind() {
    let env = TestEnv::builder().clusters(4).start().await.unwrap();
    fixture(&env).await;
    let audit = Arc::new(Audit::default());

    // Three replicas: each cluster owned by exactly one, shares within 20 % of even.
    let r1 = Replica::start(&env, "r1", &audit);
    let r2 = Replica::start(&env, "r2", &audit);
    let r3 = Replica::start(&env, "r3", &audit);
    let mut owners = BTreeMap::new();
    eventually(
        120,
        "300 clusters split between r1, r2 and r3",
        async || match settled(&[&r1, &r2, &r3]) {
            Some(o) => {
                owners = o;
                true
            }
            None => false,
        },
    )
    .await;
    for replica in [&r1, &r2, &r3] {
        let share = owners.values().filter(|o| **o == replica.id).count();
        assert!(
            (80..=120).contains(&share),
            "{} owns {share} of 300 clusters",
            replica.id
        );
        assert_eq!(
            replica.metric("multicluster_runtime_shard_owned_clusters"),
            share as f64
        );
    }
    eventually(60, "every cluster's probe reconciled", async || {
        audit.latest().len() == CLUSTERS
    })
    .await;
    // Each cluster's probe was last reconciled by its owner (replicas that started a moment
    // apart may have handed clusters over to each other before this point).
    eventually(
        60,
        "every probe last reconciled by its cluster's owner",
        async || {
            let mut last = BTreeMap::new();
            for (cluster, _, _, replica) in audit.seen.lock().unwrap().iter() {
                last.insert(cluster.clone(), replica.clone());
            }
            last == owners
        },
    )
    .await;

    // The leader-only controller runs on the lease holder only; the others never start it.
    let host = env.cluster(HOST).unwrap().client().unwrap();
    let leader_probe = ConfigMap {
        metadata: ObjectMeta {
            name: Some("leader-probe".into()),
            labels: Some([("leader-probe".to_string(), "yes".to_string())].into()),
            ..Default::default()
        },
        ..Default::default()
    };
    Api::<ConfigMap>::namespaced(host.clone(), "shard")
        .create(&PostParams::default(), &leader_probe)
        .await
        .unwrap();
    eventually(30, "the leader-only controller reconciled", async || {
        !audit.leader_only.lock().unwrap().is_empty()
    })
    .await;
    let leaders: Vec<&Replica> = [&r1, &r2, &r3]
        .into_iter()
        .filter(|r| r.manager.is_leader())
        .collect();
    assert_eq!(leaders.len(), 1, "one leader");
    assert!(
        audit
            .leader_only
            .lock()
            .unwrap()
            .iter()
            .all(|r| *r == leaders[0].id),
        "{:?}",
        audit.leader_only.lock().unwrap()
    );

    // A replica reads a cluster another owns through the explicit API: its client works, it
    // has no cache there, and it never reconciles it.
    let read_at = Instant::now();
    let (theirs, owner) = owners.iter().find(|(_, o)| *o != "r1").unwrap();
    let cluster = r1.manager.fleet().discovered(&name(theirs)).unwrap();
    assert!(r1.manager.fleet().get(&name(theirs)).is_none());
    assert!(!cluster.is_engaged());
    let probe = Api::<ConfigMap>::namespaced(cluster.client(), theirs)
        .get("probe")
        .await
        .unwrap();
    assert_eq!(probe.data.unwrap()["round"], "0");
    assert!(matches!(
        cluster
            .cache::<ConfigMap>(&watcher::Config::default())
            .await,
        Err(multicluster_runtime::CacheError::NotEngaged { .. })
    ));
    assert_eq!(r1.manager.fleet().discovered_ids().len(), CLUSTERS);
    // A change there is reconciled by its owner, and r1 has never reconciled it.
    let client = env
        .cluster(theirs[1..].parse::<usize>().unwrap() % 3)
        .unwrap()
        .client()
        .unwrap();
    Api::<ConfigMap>::namespaced(client, theirs)
        .patch(
            "probe",
            &PatchParams::default(),
            &Patch::Merge(&serde_json::json!({"data": {"read": "yes"}})),
        )
        .await
        .unwrap();
    let owner = owner.clone();
    eventually(30, "the owner reconciled the change", async || {
        audit
            .intervals
            .lock()
            .unwrap()
            .iter()
            .filter(|i| i.cluster == *theirs && i.replica == owner)
            .count()
            > 1
    })
    .await;
    assert!(
        audit
            .intervals
            .lock()
            .unwrap()
            .iter()
            .all(|i| !(i.cluster == *theirs && i.replica == "r1" && i.start > read_at)),
        "r1 reconciled {theirs}, which it reads but does not own"
    );

    // Objects change all along while the group grows to 4 and shrinks to 2.
    let writes: Arc<Mutex<Vec<(String, u64, Instant)>>> = Arc::default();
    let stop_writing = tokio_util::sync::CancellationToken::new();
    let writer = {
        let (writes, stop) = (writes.clone(), stop_writing.clone());
        let env = &env;
        async move {
            let mut round = 0;
            while !stop.is_cancelled() {
                round += 1;
                for (cluster, began) in write_round(env, round).await {
                    writes.lock().unwrap().push((cluster, round, began));
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            round
        }
    };
    let handoffs = |replicas: &[&Replica]| -> f64 {
        replicas
            .iter()
            .map(|r| r.metric("multicluster_runtime_shard_handoffs_total"))
            .sum()
    };
    let handed_before = handoffs(&[&r1, &r2, &r3]);
    let phases: Arc<Mutex<Vec<(&str, Instant)>>> = Arc::default();
    let phase = |what: &'static str| phases.lock().unwrap().push((what, Instant::now()));
    let scaling = async {
        phase("r4 starts");
        let r4 = Replica::start(&env, "r4", &audit);
        phase("r4 started");
        eventually(120, "300 clusters split between r1 to r4", async || {
            settled(&[&r1, &r2, &r3, &r4]).is_some()
        })
        .await;
        let r4_share = r4.owned().len();
        for r in [&r1, &r2, &r3, &r4] {
            eprintln!(
                "{}: owns {}, acquired {}, handed over {}, lost {}",
                r.id,
                r.owned().len(),
                r.metric("multicluster_runtime_shard_fence_acquisitions_total"),
                r.metric("multicluster_runtime_shard_handoffs_total"),
                r.metric("multicluster_runtime_shard_fence_losses_total")
            );
        }
        assert!((1..CLUSTERS).contains(&r4_share), "r4 owns {r4_share}");
        assert_eq!(
            r4.metric("multicluster_runtime_shard_fence_acquisitions_total"),
            r4_share as f64
        );
        assert_eq!(
            handoffs(&[&r1, &r2, &r3]) - handed_before,
            r4_share as f64,
            "r4's clusters, and only those, were handed over to it"
        );
        // 4 → 2: r1 and r2 leave gracefully.
        phase("4 settled");
        let (stop1, stop2) = (r1.stop(), r2.stop());
        futures::join!(stop1, stop2);
        phase("r1 r2 stopped");
        eventually(120, "300 clusters split between r3 and r4", async || {
            settled(&[&r3, &r4]).is_some()
        })
        .await;
        phase("2 settled");
        // A few more rounds with the final two.
        tokio::time::sleep(Duration::from_secs(3)).await;
        stop_writing.cancel();
        r4
    };
    let (last_round, r4) = futures::join!(writer, scaling);

    eventually(60, "the last round reconciled everywhere", async || {
        let latest = audit.latest();
        latest.len() == CLUSTERS && latest.values().all(|r| *r >= last_round)
    })
    .await;

    // No change waited longer than a lease duration and 5 s for its reconcile.
    let mut worst = (Duration::ZERO, String::new(), 0);
    for (cluster, round, began) in writes.lock().unwrap().iter() {
        let seen = audit
            .first_seen(cluster, *round)
            .unwrap_or_else(|| panic!("{cluster} round {round} never reconciled"));
        let lag = seen.saturating_duration_since(*began);
        if lag > worst.0 {
            worst = (lag, cluster.clone(), *round);
        }
    }
    assert!(
        worst.0 <= ALLOWED_LAG,
        "{} round {} reconciled {:?} after it was written",
        worst.1,
        worst.2,
        worst.0
    );
    eprintln!("worst lag from a change to its reconcile: {:?}", worst.0);
    {
        let writes = writes.lock().unwrap();
        let t0 = writes.iter().map(|w| w.2).min().unwrap();
        let mut lags: Vec<(Duration, String, u64, Duration)> = writes
            .iter()
            .map(|(c, r, b)| {
                let seen = audit.first_seen(c, *r).unwrap();
                (seen.saturating_duration_since(*b), c.clone(), *r, *b - t0)
            })
            .collect();
        lags.sort();
        for l in lags.iter().rev().take(8) {
            eprintln!("lag {:?} {} round {} written at +{:?}", l.0, l.1, l.2, l.3);
        }
        for (what, at) in phases.lock().unwrap().iter() {
            eprintln!("phase {what} at +{:?}", at.saturating_duration_since(t0));
        }
    }

    // No cluster was ever reconciled by two replicas at once.
    let overlaps = audit.overlaps();
    assert!(
        overlaps.is_empty(),
        "{} overlapping reconciles, first: {:?}",
        overlaps.len(),
        overlaps.first()
    );
    let intervals = audit.intervals.lock().unwrap().len();
    assert!(
        intervals > CLUSTERS * 3,
        "only {intervals} reconciles audited"
    );

    // The host stops answering (SIGSTOP) while the clusters stay reachable: each replica drops
    // every cluster at its fences' renew deadline, before they could expire for anyone
    // else, and picks them up again once the host is back.
    let lost = |replicas: &[&Replica]| -> f64 {
        replicas
            .iter()
            .map(|r| r.metric("multicluster_runtime_shard_fence_losses_total"))
            .sum()
    };
    let lost_before = lost(&[&r3, &r4]);
    let paused_at = Instant::now();
    let paused = env.cluster(HOST).unwrap().pause().unwrap();
    eventually(30, "both replicas dropped every cluster", async || {
        r3.owned().is_empty() && r4.owned().is_empty()
    })
    .await;
    let dropped_after = paused_at.elapsed();
    assert!(
        dropped_after < LEASE,
        "dropped {dropped_after:?} after the host stopped"
    );
    assert_eq!(lost(&[&r3, &r4]) - lost_before, CLUSTERS as f64);
    // A change while the host is away waits for it.
    let round = last_round + 1;
    write_round(&env, round).await;
    let resumed_at = Instant::now();
    paused.resume();
    eventually(
        60,
        "the change made while the host was away reconciled",
        async || {
            let latest = audit.latest();
            latest.len() == CLUSTERS && latest.values().all(|r| *r >= round)
        },
    )
    .await;
    eventually(
        60,
        "300 clusters split between r3 and r4 again",
        async || settled(&[&r3, &r4]).is_some(),
    )
    .await;
    let margin = Duration::from_millis(500);
    let late: Vec<Interval> = audit
        .intervals
        .lock()
        .unwrap()
        .iter()
        .filter(|i| i.end > paused_at + RENEW_DEADLINE + margin && i.start < resumed_at)
        .cloned()
        .collect();
    assert!(
        late.is_empty(),
        "{} reconciles ran while the host was away past the renew deadline, first {:?}",
        late.len(),
        late.first()
    );

    futures::join!(r3.stop(), r4.stop());
}

#[test]
fn the_audit_finds_reconciles_of_two_replicas_that_overlap() {
    let t = Instant::now();
    let at = |ms: u64| t + Duration::from_millis(ms);
    let interval = |replica: &str, cluster: &str, start: u64, end: u64| Interval {
        replica: replica.into(),
        cluster: cluster.into(),
        start: at(start),
        end: at(end),
    };
    let audit = Audit::default();
    audit.intervals.lock().unwrap().extend([
        interval("a", "c1", 0, 100),
        // The same replica may overlap itself (two objects of one cluster).
        interval("a", "c1", 50, 150),
        // Another replica right after: fine.
        interval("b", "c1", 150, 200),
        // Another cluster at the same time: fine.
        interval("b", "c2", 0, 300),
    ]);
    assert!(audit.overlaps().is_empty());
    // b starts in c2 while a's long reconcile there still runs.
    audit.intervals.lock().unwrap().extend([
        interval("a", "c2", 400, 1000),
        interval("a", "c2", 500, 600),
        interval("b", "c2", 700, 800),
    ]);
    let overlaps = audit.overlaps();
    assert_eq!(overlaps.len(), 1, "{overlaps:?}");
    assert_eq!(overlaps[0].0.end, at(1000));
}
