//! Operations against a real control plane: leader election (failover, a leader that cannot
//! renew, release on shutdown, campaigning again).

mod common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::api::rbac::v1::{PolicyRule, Role, RoleBinding, RoleRef, Subject};
use kube::api::{Api, DeleteParams, ObjectMeta, Patch, PatchParams, PostParams};
use multicluster_runtime::providers::Clusters;
use multicluster_runtime::{
    Action, Builder, Cluster, ClusterName, Context, Failure, LeaderElection, LeaseTiming, Manager,
    ManagerError, Metrics, OnLoss,
};
use multicluster_runtime_testenv::{TestCluster, TestEnv};

/// One reconcile: which replica ran it, and when it started and ended (ended includes
/// dropped: the record is closed when the reconcile's future is dropped, finished or not).
#[derive(Clone, Debug)]
struct Reconcile {
    replica: &'static str,
    start: Instant,
    end: Option<Instant>,
    /// Whether it ran to its end (not dropped).
    completed: bool,
    /// What `Context::still_owned` said as it began.
    owned: bool,
    /// How long `Context::owned_until` gave it then (`None`: unbounded).
    left: Option<Duration>,
}

#[derive(Default)]
struct Audit {
    reconciles: Mutex<Vec<Reconcile>>,
}

impl Audit {
    fn of(&self, replica: &str) -> Vec<Reconcile> {
        self.reconciles
            .lock()
            .unwrap()
            .iter()
            .filter(|r| r.replica == replica)
            .cloned()
            .collect()
    }

    /// Every reconcile of `earlier` had ended before the first of `later` started; the
    /// number of each.
    fn assert_before(&self, earlier: &str, later: &str) -> (usize, usize) {
        let (first, second) = (self.of(earlier), self.of(later));
        let last_end = first
            .iter()
            .map(|r| {
                r.end
                    .expect("every reconcile of the earlier leader has ended")
            })
            .max()
            .expect("the earlier leader reconciled");
        let first_start = second
            .iter()
            .map(|r| r.start)
            .min()
            .expect("the later leader reconciled");
        assert!(
            last_end <= first_start,
            "{earlier}'s reconciles ran until {:?} after {later}'s first one started",
            last_end - first_start
        );
        (first.len(), second.len())
    }
}

/// Closes a reconcile's record when dropped.
struct Running {
    audit: Arc<Audit>,
    index: usize,
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Ok(mut reconciles) = self.audit.reconciles.lock() {
            reconciles[self.index].end = Some(Instant::now());
        }
    }
}

struct Replica {
    name: &'static str,
    audit: Arc<Audit>,
    /// While set, reconciles wait before they end.
    hold: Arc<std::sync::atomic::AtomicBool>,
}

async fn reconcile(
    _: Arc<ConfigMap>,
    ctx: Context<ClusterName, Replica>,
) -> Result<Action, kube::Error> {
    let state = ctx.state();
    let index = {
        let mut reconciles = state.audit.reconciles.lock().unwrap();
        reconciles.push(Reconcile {
            replica: state.name,
            start: Instant::now(),
            end: None,
            completed: false,
            owned: ctx.still_owned(),
            left: ctx
                .owned_until()
                .map(|until| until.saturating_duration_since(tokio::time::Instant::now())),
        });
        reconciles.len() - 1
    };
    let _running = Running {
        audit: state.audit.clone(),
        index,
    };
    // Long enough that a leader losing its lease is likely caught mid-reconcile.
    tokio::time::sleep(Duration::from_millis(50)).await;
    while state.hold.load(std::sync::atomic::Ordering::SeqCst) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    state.audit.reconciles.lock().unwrap()[index].completed = true;
    Ok(Action::requeue(Duration::from_millis(100)))
}

fn labelled() -> kube_runtime::watcher::Config {
    kube_runtime::watcher::Config::default().labels("audit=yes")
}

async fn audited_objects(host: &kube::Client) {
    let api: Api<ConfigMap> = Api::namespaced(host.clone(), "default");
    for i in 0..3 {
        let cm = ConfigMap {
            metadata: ObjectMeta {
                name: Some(format!("audited-{i}")),
                labels: Some(BTreeMap::from([("audit".into(), "yes".into())])),
                ..Default::default()
            },
            ..Default::default()
        };
        api.create(&PostParams::default(), &cm).await.unwrap();
    }
}

/// A control plane with the audited objects: the environment (kept alive by the caller),
/// its cluster and an admin client.
async fn control_plane() -> (TestEnv, Arc<TestCluster>, kube::Client) {
    let env = TestEnv::start().await.unwrap();
    let tc = env.cluster(0).unwrap();
    let host = tc.client().unwrap();
    audited_objects(&host).await;
    (env, tc, host)
}

/// Short timings so failover takes seconds: lease 4 s, renew deadline 2 s (a 2 s margin for
/// a loaded machine), retry 0.5 s.
fn election(client: kube::Client, identity: &str) -> LeaderElection {
    LeaderElection::new(client, "default", "operations-leader")
        .identity(identity)
        .timing(timing())
}

/// The tests' lease timings: quick hand-overs.
fn timing() -> LeaseTiming {
    LeaseTiming::default()
        .lease_duration(Duration::from_secs(4))
        .renew_deadline(Duration::from_secs(2))
        .retry_period(Duration::from_millis(500))
}

/// A replica: a manager of the one member cluster whose controller records its reconciles.
fn replica(
    name: &'static str,
    tc: &TestCluster,
    election: LeaderElection,
    audit: &Arc<Audit>,
) -> Arc<Manager<Clusters<ClusterName>>> {
    replica_holding_on(name, tc, election, audit, Arc::default())
}

/// A replica whose reconciles wait before they end while `hold` is set.
fn replica_holding_on(
    name: &'static str,
    tc: &TestCluster,
    election: LeaderElection,
    audit: &Arc<Audit>,
    hold: Arc<std::sync::atomic::AtomicBool>,
) -> Arc<Manager<Clusters<ClusterName>>> {
    let clusters = Clusters::new();
    clusters
        .add(Cluster::new(common::name("member"), tc.client().unwrap()))
        .unwrap();
    let manager = Arc::new(Manager::new(clusters).leader_election(election));
    Builder::<_, ConfigMap>::new(&manager, labelled()).start(
        reconcile,
        |_, _: &kube::Error, _: &Context<ClusterName, Replica>| Action::await_change(),
        Arc::new(Replica {
            name,
            audit: audit.clone(),
            hold,
        }),
    );
    manager
}

fn run(
    manager: &Arc<Manager<Clusters<ClusterName>>>,
) -> tokio::task::JoinHandle<Result<(), ManagerError>> {
    let manager = manager.clone();
    tokio::spawn(async move { manager.run().await })
}

async fn elected(manager: &Manager<Clusters<ClusterName>>, secs: u64, what: &str) -> Duration {
    let started = Instant::now();
    tokio::time::timeout(Duration::from_secs(secs), manager.elected())
        .await
        .unwrap_or_else(|_| panic!("timed out waiting for: {what}"));
    started.elapsed()
}

async fn reconciled_by(audit: &Audit, replica: &str, n: usize) {
    eventually(30, &format!("{n} reconciles by {replica}"), async || {
        audit.of(replica).len() >= n
    })
    .await;
}

/// The operator's NetworkPolicy admits by what only an administrator can set: a namespace by
/// its name (the `kubernetes.io/metadata.name` label the API server keeps), pods by their
/// labels in it. A label of one's choosing on a namespace would admit whoever may label or
/// create one. (The policy itself is enforced by a network plugin, which the test control
/// planes have none of: this checks what it says.)
#[test]
fn the_network_policy_admits_the_scraper_by_what_only_admins_set() {
    use k8s_openapi::api::networking::v1::NetworkPolicy;
    let docs: Vec<serde_json::Value> =
        serde_saphyr::from_multiple(&manifest("operator.yaml")).unwrap();
    let policy: NetworkPolicy = docs
        .into_iter()
        .find(|d| d["kind"] == "NetworkPolicy")
        .map(|d| serde_json::from_value(d).unwrap())
        .expect("a NetworkPolicy");
    let spec = policy.spec.unwrap();
    let ingress = spec.ingress.unwrap();
    assert!(!ingress.is_empty());
    for rule in ingress {
        for peer in rule.from.unwrap() {
            let namespaces = peer.namespace_selector.expect("a namespace selector");
            let labels = namespaces.match_labels.unwrap_or_default();
            assert_eq!(
                labels.keys().collect::<Vec<_>>(),
                ["kubernetes.io/metadata.name"],
                "namespaces chosen by a label anyone with namespaces rights may set"
            );
            assert!(namespaces.match_expressions.is_none());
            assert!(
                peer.pod_selector
                    .is_some_and(|p| p.match_labels.is_some_and(|l| !l.is_empty())),
                "every pod of the namespace admitted"
            );
        }
    }
}

#[tokio::test]
async fn only_the_leader_reconciles_and_a_dead_leader_is_replaced_within_the_lease_duration() {
    let (_env, tc, host) = control_plane().await;
    let audit = Arc::new(Audit::default());

    let a = replica("a", &tc, election(host.clone(), "a"), &audit);
    let a_run = run(&a);
    elected(&a, 30, "a leads").await;
    reconciled_by(&audit, "a", 3).await;

    let b = replica("b", &tc, election(host.clone(), "b"), &audit);
    let b_run = run(&b);
    // b campaigns while a leads and reconciles on.
    let a_so_far = audit.of("a").len();
    reconciled_by(&audit, "a", a_so_far + 20).await;
    assert!(!b.is_leader());

    // a dies without giving the lease up (its run is dropped, as a killed process's would
    // be): b takes over within the lease duration and a margin.
    a_run.abort();
    let died = Instant::now();
    let _ = a_run.await;
    assert!(!a.is_leader());
    elected(&b, 4 + 5, "b leads within the lease duration + 5 s").await;
    let takeover = died.elapsed();
    reconciled_by(&audit, "b", 3).await;
    let (by_a, by_b) = audit.assert_before("a", "b");
    println!("takeover after a died: {takeover:?}; reconciles: a {by_a}, b {by_b}");

    b.shutdown();
    b_run.await.unwrap().unwrap();
}

/// A user of its own for a replica's lease, allowed Leases in `default` by a RoleBinding
/// that [`LeaseRights::revoke`] deletes and [`LeaseRights::grant`] creates again.
struct LeaseRights {
    bindings: Api<RoleBinding>,
    user: multicluster_runtime_testenv::TestUser,
}

impl LeaseRights {
    async fn new(host: &kube::Client, tc: &TestCluster, user: &str) -> Self {
        let roles: Api<Role> = Api::namespaced(host.clone(), "default");
        let role = Role {
            metadata: ObjectMeta {
                name: Some("leases".into()),
                ..Default::default()
            },
            rules: Some(vec![PolicyRule {
                api_groups: Some(vec!["coordination.k8s.io".into()]),
                resources: Some(vec!["leases".into()]),
                verbs: vec!["get".into(), "create".into(), "update".into()],
                ..Default::default()
            }]),
        };
        roles.create(&PostParams::default(), &role).await.unwrap();
        let rights = Self {
            bindings: Api::namespaced(host.clone(), "default"),
            user: tc.add_user(user, &[]).unwrap(),
        };
        rights.grant().await;
        rights
    }

    fn binding(&self) -> String {
        format!("{}-leases", self.user.name())
    }

    async fn grant(&self) {
        let binding = RoleBinding {
            metadata: ObjectMeta {
                name: Some(self.binding()),
                ..Default::default()
            },
            role_ref: RoleRef {
                api_group: Some("rbac.authorization.k8s.io".into()),
                kind: "Role".into(),
                name: "leases".into(),
            },
            subjects: Some(vec![Subject {
                kind: "User".into(),
                name: self.user.name().into(),
                api_group: Some("rbac.authorization.k8s.io".into()),
                ..Default::default()
            }]),
        };
        self.bindings
            .create(&PostParams::default(), &binding)
            .await
            .unwrap();
    }

    async fn revoke(&self) {
        self.bindings
            .delete(&self.binding(), &DeleteParams::default())
            .await
            .unwrap();
    }
}

/// When `manager` next leads, by a task that watches for it.
fn when_elected(manager: &Arc<Manager<Clusters<ClusterName>>>) -> tokio::task::JoinHandle<Instant> {
    let manager = manager.clone();
    tokio::spawn(async move {
        manager.elected().await;
        Instant::now()
    })
}

#[tokio::test]
async fn a_leader_that_cannot_renew_stops_before_another_takes_over() {
    let logs = Logs::capture();
    let (_env, tc, host) = control_plane().await;
    // a renews as a user of its own, whose Lease rights the test revokes.
    let rights = LeaseRights::new(&host, &tc, "replica-a").await;
    let audit = Arc::new(Audit::default());
    let a = replica(
        "a",
        &tc,
        election(rights.user.client().unwrap(), "a"),
        &audit,
    );
    let a_run = run(&a);
    // RBAC takes effect through the apiserver's informers: wait for a to win.
    elected(&a, 30, "a leads").await;
    reconciled_by(&audit, "a", 3).await;
    let b = replica("b", &tc, election(host.clone(), "b"), &audit);
    let b_elected = when_elected(&b);
    let b_run = run(&b);
    let a_so_far = audit.of("a").len();
    reconciled_by(&audit, "a", a_so_far + 10).await;

    // a can no longer renew: it stops its controllers at the renew deadline, before the
    // lease expires for b, and its run reports why.
    rights.revoke().await;
    let result = tokio::time::timeout(Duration::from_secs(30), a_run)
        .await
        .expect("a's run ends")
        .unwrap();
    let a_stopped = Instant::now();
    assert!(
        matches!(&result, Err(ManagerError::LeadershipLost { lease, reason }) if lease == "default/operations-leader" && reason.contains("renew deadline")),
        "{result:?}"
    );
    assert!(!a.is_leader());
    // A lease lost is not given up on the way out: the host may be out of reach (here the
    // rights are gone), and nothing of it is this replica's any more.
    for attempt in [
        "could not release the lease",
        "releasing the lease timed out",
    ] {
        assert!(
            logs.lines(&[attempt]).is_empty(),
            "{:?}",
            logs.lines(&[attempt])
        );
    }
    let b_elected = tokio::time::timeout(Duration::from_secs(30), b_elected)
        .await
        .expect("b leads")
        .unwrap();
    // a had stopped, its reconciles dropped, before b started leading.
    assert!(
        a_stopped < b_elected,
        "a stopped {:?} after b was elected",
        a_stopped - b_elected
    );
    let last_of_a = audit.of("a").iter().filter_map(|r| r.end).max().unwrap();
    assert!(last_of_a < b_elected);
    reconciled_by(&audit, "b", 3).await;
    // Every reconcile began with its replica leading by its own clock, within the renew
    // deadline (2 s) of a renewal.
    for reconcile in audit.of("a").iter().chain(&audit.of("b")) {
        assert!(reconcile.owned, "{reconcile:?}");
        assert!(
            reconcile
                .left
                .is_some_and(|left| !left.is_zero() && left <= Duration::from_secs(2)),
            "{reconcile:?}"
        );
    }
    let (by_a, by_b) = audit.assert_before("a", "b");
    println!(
        "a stopped {:?} before b led; reconciles: a {by_a}, b {by_b}",
        b_elected - a_stopped
    );

    b.shutdown();
    b_run.await.unwrap().unwrap();
}

#[tokio::test]
async fn a_candidate_that_lost_its_lease_leads_again_in_the_same_run() {
    let (_env, tc, host) = control_plane().await;
    let rights = LeaseRights::new(&host, &tc, "replica-a").await;
    let audit = Arc::new(Audit::default());
    let a = replica(
        "a",
        &tc,
        election(rights.user.client().unwrap(), "a").on_loss(OnLoss::Candidate),
        &audit,
    );
    let a_run = run(&a);
    elected(&a, 30, "a leads").await;
    let term = a.elected().await;
    reconciled_by(&audit, "a", 3).await;
    let b = replica("b", &tc, election(host.clone(), "b"), &audit);
    let b_elected = when_elected(&b);
    let b_run = run(&b);

    // a loses the lease: its term ends (the token elected() gave is cancelled), its run
    // goes on as a candidate, and b takes over.
    rights.revoke().await;
    tokio::time::timeout(Duration::from_secs(30), term.cancelled())
        .await
        .expect("a's term ends");
    let a_stopped = Instant::now();
    let b_elected = tokio::time::timeout(Duration::from_secs(30), b_elected)
        .await
        .expect("b leads")
        .unwrap();
    assert!(a_stopped < b_elected);
    reconciled_by(&audit, "b", 3).await;
    audit.assert_before("a", "b");
    assert!(!a_run.is_finished(), "a campaigns on");

    // a may renew again; b gives the lease up: a leads again in the same run, with its
    // controllers started afresh.
    rights.grant().await;
    let a_again = when_elected(&a);
    b.shutdown();
    b_run.await.unwrap().unwrap();
    let b_stopped = Instant::now();
    let a_again = tokio::time::timeout(Duration::from_secs(30), a_again)
        .await
        .expect("a leads again")
        .unwrap();
    assert!(b_stopped <= a_again);
    let before = audit.of("a").len();
    reconciled_by(&audit, "a", before + 3).await;
    a.shutdown();
    a_run.await.unwrap().unwrap();
}

#[tokio::test]
async fn a_graceful_shutdown_gives_the_lease_up_and_a_candidate_campaigns_again() {
    let (_env, tc, host) = control_plane().await;
    let audit = Arc::new(Audit::default());
    // A lease of a minute: b can win it within 30 s only if a gives it up.
    let long = |identity| {
        election(host.clone(), identity)
            .timing(
                timing()
                    .lease_duration(Duration::from_secs(60))
                    .renew_deadline(Duration::from_secs(40)),
            )
            .on_loss(OnLoss::Candidate)
    };
    let a = replica("a", &tc, long("a"), &audit);
    let a_run = run(&a);
    elected(&a, 30, "a leads").await;
    reconciled_by(&audit, "a", 3).await;
    let b = replica("b", &tc, long("b"), &audit);
    let b_run = run(&b);

    a.shutdown();
    a_run.await.unwrap().unwrap();
    elected(&b, 30, "b leads at once after a gave the lease up").await;
    reconciled_by(&audit, "b", 3).await;
    audit.assert_before("a", "b");

    // a runs again and campaigns; b gives the lease up in turn, and a leads again.
    let a_run = run(&a);
    let b_so_far = audit.of("b").len();
    reconciled_by(&audit, "b", b_so_far + 10).await;
    assert!(!a.is_leader());
    b.shutdown();
    b_run.await.unwrap().unwrap();
    elected(&a, 30, "a leads again").await;
    let a_again = audit.of("a").len();
    reconciled_by(&audit, "a", a_again + 3).await;
    a.shutdown();
    a_run.await.unwrap().unwrap();
}

#[tokio::test]
async fn settings_that_cannot_work_are_refused_before_anything_runs() {
    let env = TestEnv::start().await.unwrap();
    let tc = env.cluster(0).unwrap();
    let host = tc.client().unwrap();
    let audit = Arc::new(Audit::default());
    let bad = election(host, "a").timing(timing().renew_deadline(Duration::from_secs(5)));
    let a = replica("a", &tc, bad, &audit);
    let result = a.run().await;
    assert!(
        matches!(&result, Err(ManagerError::InvalidLeaderElection(e)) if e.reason.contains("lease duration")),
        "{result:?}"
    );
    assert!(!a.is_leader());
}

#[tokio::test]
async fn sigterm_drains_reconciles_and_gives_the_lease_up_and_a_second_signal_stops_at_once() {
    use nix::sys::signal::{Signal, kill};
    use nix::unistd::Pid;
    use std::sync::atomic::{AtomicBool, Ordering};
    let (_env, tc, host) = control_plane().await;
    let audit = Arc::new(Audit::default());
    let long = |identity| {
        election(host.clone(), identity).timing(
            timing()
                .lease_duration(Duration::from_secs(60))
                .renew_deadline(Duration::from_secs(40)),
        )
    };
    let hold_a = Arc::new(AtomicBool::new(false));
    let a = replica_holding_on("a", &tc, long("a"), &audit, hold_a.clone());
    let a_run = {
        let a = a.clone();
        tokio::spawn(async move { a.run_until_signal().await })
    };
    elected(&a, 30, "a leads").await;
    reconciled_by(&audit, "a", 3).await;
    // A reconcile is held in flight when SIGTERM arrives, and let go once the graceful
    // shutdown is under way (the manager's token cancelled).
    hold_a.store(true, Ordering::SeqCst);
    let so_far = audit.of("a").len();
    eventually(30, "a reconcile of a in flight", async || {
        audit.of("a")[so_far..].iter().any(|r| r.end.is_none())
    })
    .await;
    kill(Pid::this(), Signal::SIGTERM).unwrap();
    eventually(30, "a's graceful shutdown under way", async || {
        a.shutdown_token().is_cancelled()
    })
    .await;
    hold_a.store(false, Ordering::SeqCst);
    tokio::time::timeout(Duration::from_secs(30), a_run)
        .await
        .expect("a stops on SIGTERM")
        .unwrap()
        .unwrap();
    let reconciles = audit.of("a");
    assert!(
        reconciles.iter().all(|r| r.completed),
        "every reconcile of a ran to its end: {reconciles:?}"
    );

    // The lease was given up: b leads long before it could have expired.
    let hold_b = Arc::new(AtomicBool::new(false));
    let b = replica_holding_on("b", &tc, long("b"), &audit, hold_b.clone());
    let b_run = {
        let b = b.clone();
        tokio::spawn(async move { b.run_until_signal().await })
    };
    elected(&b, 30, "b leads within 30 s of a 60 s lease").await;
    reconciled_by(&audit, "b", 3).await;
    audit.assert_before("a", "b");

    // b's reconciles are held and never let go: SIGINT starts a graceful shutdown that
    // would wait for them (the graceful timeout is 30 s), and a second signal ends it at once.
    hold_b.store(true, Ordering::SeqCst);
    let so_far = audit.of("b").len();
    eventually(30, "a held reconcile of b", async || {
        audit.of("b")[so_far..].iter().any(|r| r.end.is_none())
    })
    .await;
    kill(Pid::this(), Signal::SIGINT).unwrap();
    eventually(30, "b's graceful shutdown under way", async || {
        b.shutdown_token().is_cancelled()
    })
    .await;
    let signalled = Instant::now();
    kill(Pid::this(), Signal::SIGINT).unwrap();
    let forced = tokio::time::timeout(Duration::from_secs(20), b_run)
        .await
        .expect("b stops at the second signal, long before the graceful timeout")
        .unwrap();
    // Told apart from a clean stop.
    assert!(
        matches!(forced, Err(ManagerError::ForcedStop { signal: "SIGINT" })),
        "{forced:?}"
    );
    let stopped_after = signalled.elapsed();
    let held: Vec<_> = audit.of("b")[so_far..]
        .iter()
        .filter(|r| !r.completed)
        .cloned()
        .collect();
    assert!(!held.is_empty(), "the held reconcile never completed");
    // Dropped without waiting: the runtime drops the aborted tasks' futures soon after.
    eventually(30, "the held reconciles dropped", async || {
        audit.of("b")[so_far..]
            .iter()
            .all(|r| r.completed || r.end.is_some())
    })
    .await;
    println!("stopped {stopped_after:?} after the second signal");
}

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
        // Nothing else but this crate's own series.
        for (name, _) in ours.keys() {
            assert!(
                name.starts_with("multicluster_runtime_")
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

fn labelled_cm(name: &str, labels: &[(&str, &str)]) -> ConfigMap {
    ConfigMap {
        metadata: ObjectMeta {
            name: Some(name.into()),
            labels: Some(
                labels
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            ),
            ..Default::default()
        },
        ..Default::default()
    }
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

// ---------------------------------------------------------------------------------------
// The production-shaped example (examples/operator.rs) with the manifests of deploy/.

/// The member cluster `east` as a kubeconfig Secret in `namespace` of the host, the way the
/// secrets provider finds it.
async fn member_secret(host: &kube::Client, namespace: &str, kubeconfig: &str) {
    let secret = k8s_openapi::api::core::v1::Secret {
        metadata: ObjectMeta {
            name: Some("east".into()),
            namespace: Some(namespace.into()),
            labels: Some(BTreeMap::from([(
                multicluster_runtime::providers::KUBECONFIG_SECRET_LABEL.into(),
                "true".into(),
            )])),
            ..Default::default()
        },
        string_data: Some(BTreeMap::from([(
            "kubeconfig".into(),
            kubeconfig.to_string(),
        )])),
        ..Default::default()
    };
    Api::<k8s_openapi::api::core::v1::Secret>::namespaced(host.clone(), namespace)
        .create(&PostParams::default(), &secret)
        .await
        .unwrap();
}

/// One operator process: its endpoints' address and its log file.
struct OperatorProcess {
    child: tokio::process::Child,
    addr: std::net::SocketAddr,
    log: std::path::PathBuf,
}

impl OperatorProcess {
    fn start(
        binary: &std::path::Path,
        kubeconfig: &std::path::Path,
        identity: &str,
        dir: &std::path::Path,
    ) -> Self {
        Self::start_in(binary, kubeconfig, identity, "mcr-system", dir)
    }

    /// As [`OperatorProcess::start`], with the operator's namespace `namespace` (the copies'
    /// too), endpoints over plain HTTP.
    fn start_in(
        binary: &std::path::Path,
        kubeconfig: &std::path::Path,
        identity: &str,
        namespace: &str,
        dir: &std::path::Path,
    ) -> Self {
        let extra = ["--plain-http", "--resync-seconds", "2"];
        Self::spawn(binary, kubeconfig, identity, namespace, dir, &extra)
    }

    /// As `deploy/operator.yaml` runs it (HTTPS endpoints, tokens checked by the host),
    /// resyncing only every 600 s.
    fn as_deployed(
        binary: &std::path::Path,
        kubeconfig: &std::path::Path,
        identity: &str,
        dir: &std::path::Path,
    ) -> Self {
        let extra = ["--resync-seconds", "600"];
        Self::spawn(binary, kubeconfig, identity, "mcr-system", dir, &extra)
    }

    fn spawn(
        binary: &std::path::Path,
        kubeconfig: &std::path::Path,
        identity: &str,
        namespace: &str,
        dir: &std::path::Path,
        extra: &[&str],
    ) -> Self {
        let addr: std::net::SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let log = dir.join(format!("{identity}.log"));
        let child = tokio::process::Command::new(binary)
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .args(["--namespace", namespace, "--target-namespace", namespace])
            .args(["--identity", identity, "--log-format", "json"])
            .args([
                "--lease-duration-seconds",
                "4",
                "--renew-deadline-seconds",
                "2",
                "--retry-period-seconds",
                "0.5",
            ])
            .arg(format!("--bind-address={addr}"))
            .args(extra)
            .env("RUST_LOG", "info")
            .stdout(std::fs::File::create(&log).unwrap())
            .stderr(std::process::Stdio::inherit())
            // A failing test ends it.
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        Self { child, addr, log }
    }

    /// Whether it reports leading, on /metrics.
    async fn leads(&self) -> bool {
        let Ok((200, text)) =
            tokio::time::timeout(Duration::from_secs(2), http_get_opt(self.addr, "/metrics"))
                .await
                .unwrap_or(Err(()))
        else {
            return false;
        };
        sample(
            &text,
            "leader_election_master_status",
            &[("name", "mcr-system/mcr-operator")],
        ) == Some(1.0)
    }
}

/// The ConfigMap `mcr-system/settings` of the host, labelled to be copied, `colour: blue`.
async fn create_original(host: &kube::Client) {
    let mut original = labelled_cm("settings", &[("mcr.example.io/copy", "true")]);
    original.data = Some(BTreeMap::from([("colour".into(), "blue".into())]));
    Api::<ConfigMap>::namespaced(host.clone(), "mcr-system")
        .create(&PostParams::default(), &original)
        .await
        .unwrap();
}

async fn configmap_in(client: &kube::Client, ns: &str, name: &str) -> Option<ConfigMap> {
    Api::<ConfigMap>::namespaced(client.clone(), ns)
        .get_opt(name)
        .await
        .unwrap()
}

/// Two apiservers with `deploy/` applied: the host (`operator.yaml`) and a member
/// (`member.yaml`), and the ServiceAccounts' identities on each.
struct Deployed {
    env: TestEnv,
    host: kube::Client,
    member: kube::Client,
    operator_user: multicluster_runtime_testenv::TestUser,
    member_user: multicluster_runtime_testenv::TestUser,
}

async fn deployed() -> Deployed {
    let env = TestEnv::builder().clusters(2).start().await.unwrap();
    let (host_tc, member_tc) = (env.cluster(0).unwrap(), env.cluster(1).unwrap());
    let (host, member) = (host_tc.client().unwrap(), member_tc.client().unwrap());
    apply_manifests(&host, &manifest("operator.yaml")).await;
    apply_manifests(&member, &manifest("member.yaml")).await;
    // The ServiceAccounts' identities: client certificates with their user names and groups,
    // which RBAC matches as it matches the accounts' tokens.
    let sa_groups = [
        "system:serviceaccounts",
        "system:serviceaccounts:mcr-system",
    ];
    let operator_user = host_tc
        .add_user("system:serviceaccount:mcr-system:mcr-operator", &sa_groups)
        .unwrap();
    let member_user = member_tc
        .add_user("system:serviceaccount:mcr-system:mcr-member", &sa_groups)
        .unwrap();
    Deployed {
        env,
        host,
        member,
        operator_user,
        member_user,
    }
}

#[tokio::test]
async fn the_example_operator_reports_a_cluster_engaged_later_in_an_event_of_its_own() {
    let binary = operator_binary();
    let Deployed {
        env: _env,
        host,
        member,
        operator_user,
        member_user,
    } = deployed().await;
    create_original(&host).await;
    let dir = tempfile::tempdir().unwrap();
    let _operator = OperatorProcess::start(
        &binary,
        operator_user.kubeconfig_path(),
        "replica-a",
        dir.path(),
    );
    // No cluster yet: the operator reports that, before any cluster is engaged.
    eventually(60, "the report of no cluster", async || {
        has_event(
            &host,
            "mcr-system",
            "Copied",
            "settings",
            "copied into 0 clusters",
        )
        .await
    })
    .await;
    // A cluster engaged later: its copy, and the change reported in an Event of its own
    // (kube-runtime's recorder would have counted it into the first one's series, note and all).
    member_secret(&host, "mcr-system", member_user.kubeconfig()).await;
    eventually(
        60,
        "the copy in the member and the Event naming it",
        async || {
            configmap_in(&member, "mcr-system", "settings")
                .await
                .is_some()
                && has_event(
                    &host,
                    "mcr-system",
                    "Copied",
                    "settings",
                    "copied into 1 clusters: east",
                )
                .await
        },
    )
    .await;
}

#[tokio::test]
async fn the_example_operator_runs_with_the_deploy_rbac_copies_reports_and_fails_over() {
    let binary = operator_binary();
    let Deployed {
        env: _env,
        host,
        member,
        operator_user,
        member_user,
    } = deployed().await;
    // The member as a kubeconfig Secret, the way the secrets provider finds it.
    member_secret(&host, "mcr-system", member_user.kubeconfig()).await;
    let originals: Api<ConfigMap> = Api::namespaced(host.clone(), "mcr-system");
    create_original(&host).await;

    let dir = tempfile::tempdir().unwrap();
    let mut a = OperatorProcess::start(
        &binary,
        operator_user.kubeconfig_path(),
        "replica-a",
        dir.path(),
    );
    eventually(60, "replica-a leads", async || a.leads().await).await;
    let mut b = OperatorProcess::start(
        &binary,
        operator_user.kubeconfig_path(),
        "replica-b",
        dir.path(),
    );

    // Copied into the member as its ServiceAccount, reported back on the host.
    eventually(60, "the copy in the member", async || {
        configmap_in(&member, "mcr-system", "settings")
            .await
            .and_then(|c| c.data)
            == Some(BTreeMap::from([("colour".into(), "blue".into())]))
    })
    .await;
    eventually(30, "the copied-to annotation and Event", async || {
        let annotated = configmap_in(&host, "mcr-system", "settings")
            .await
            .and_then(|c| c.metadata.annotations)
            .and_then(|a| a.get("mcr.example.io/copied-to").cloned());
        annotated.as_deref() == Some("east")
            && has_event(
                &host,
                "mcr-system",
                "Copied",
                "settings",
                "copied into 1 clusters: east",
            )
            .await
    })
    .await;
    // Both replicas are ready (readiness does not depend on leading), b does not lead.
    eventually(30, "both ready", async || {
        http_get_opt(a.addr, "/readyz").await.map(|r| r.0) == Ok(200)
            && http_get_opt(b.addr, "/readyz").await.map(|r| r.0) == Ok(200)
    })
    .await;
    assert!(!b.leads().await, "b waits while a leads");
    // JSON logs, one object per line.
    let log = std::fs::read_to_string(&a.log).unwrap();
    let first = log.lines().next().expect("a logged");
    let line: serde_json::Value =
        serde_json::from_str(first).unwrap_or_else(|e| panic!("{e}: {first}"));
    assert!(
        line.get("level").is_some() && line.get("fields").is_some(),
        "{first}"
    );

    // SIGKILL the leader: b takes over within the lease duration (4 s) + 5 s.
    let killed = Instant::now();
    a.child.start_kill().unwrap();
    a.child.wait().await.unwrap();
    eventually(30, "b leads", async || b.leads().await).await;
    let took_over = killed.elapsed();
    println!("b led {took_over:?} after a was killed");
    assert!(took_over <= Duration::from_secs(9), "{took_over:?}");
    // And acts: a change of the original reaches the member.
    let patch = serde_json::json!({"data": {"colour": "green"}});
    originals
        .patch(
            "settings",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&patch),
        )
        .await
        .unwrap();
    eventually(30, "the new data in the member", async || {
        configmap_in(&member, "mcr-system", "settings")
            .await
            .and_then(|c| c.data)
            == Some(BTreeMap::from([("colour".into(), "green".into())]))
    })
    .await;

    // SIGTERM: b drains, gives the Lease up and exits cleanly.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(b.child.id().unwrap() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let status = tokio::time::timeout(Duration::from_secs(30), b.child.wait())
        .await
        .expect("b exits after SIGTERM")
        .unwrap();
    assert!(status.success(), "{status:?}");
    let lease =
        Api::<k8s_openapi::api::coordination::v1::Lease>::namespaced(host.clone(), "mcr-system")
            .get("mcr-operator")
            .await
            .unwrap();
    let holder = lease
        .spec
        .and_then(|s| s.holder_identity)
        .unwrap_or_default();
    assert!(holder.is_empty(), "the Lease was released: {holder:?}");
}

/// A provider that takes a while to stop after the shutdown: the run's drain lasts that long.
struct SlowToStop(Duration);

impl multicluster_runtime::Provider for SlowToStop {
    type Id = ClusterName;

    async fn run(
        &self,
        _: multicluster_runtime::Fleet<ClusterName>,
        shutdown: tokio_util::sync::CancellationToken,
    ) -> Result<(), multicluster_runtime::ProviderError> {
        shutdown.cancelled().await;
        tokio::time::sleep(self.0).await;
        Ok(())
    }
}

#[tokio::test]
async fn a_standby_shutting_down_takes_no_lease_it_would_not_release() {
    use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
    let logs = Logs::capture();
    let env = TestEnv::start().await.unwrap();
    let host = env.cluster(0).unwrap().client().unwrap();
    let leases: Api<Lease> = Api::namespaced(host.clone(), "default");
    // Another replica leads.
    let now = k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime(
        k8s_openapi::jiff::Timestamp::now(),
    );
    leases
        .create(
            &PostParams::default(),
            &Lease {
                metadata: ObjectMeta {
                    name: Some("operations-leader".into()),
                    ..Default::default()
                },
                spec: Some(LeaseSpec {
                    holder_identity: Some("the-leader".into()),
                    lease_duration_seconds: Some(3600),
                    acquire_time: Some(now.clone()),
                    renew_time: Some(now),
                    ..Default::default()
                }),
            },
        )
        .await
        .unwrap();
    // A standby whose shutdown takes 3 s to drain (its provider is slow to stop).
    let manager = Arc::new(
        Manager::new(SlowToStop(Duration::from_secs(3)))
            .leader_election(election(host.clone(), "standby")),
    );
    let run = spawn_manager(&manager);
    // Sync point: the standby has tried the lease (its campaign saw it held).
    eventually(30, "the standby campaigning", async || {
        !logs
            .lines(&[
                "another replica leads; waiting for the lease",
                "identity=standby",
            ])
            .is_empty()
    })
    .await;
    assert!(!manager.is_leader());
    // The two are terminated together (a node drain): the standby starts winding down, and
    // meanwhile the leader releases the lease.
    manager.shutdown();
    let mut lease = leases.get("operations-leader").await.unwrap();
    let spec = lease.spec.as_mut().unwrap();
    spec.holder_identity = None;
    spec.lease_duration_seconds = Some(1);
    leases
        .replace("operations-leader", &PostParams::default(), &lease)
        .await
        .unwrap();
    run.await.unwrap();
    // The standby's drain lasted several retry periods: a campaign still running would have
    // taken the lease and, not leading, never released it.
    let holder = leases
        .get("operations-leader")
        .await
        .unwrap()
        .spec
        .and_then(|s| s.holder_identity)
        .unwrap_or_default();
    assert!(holder.is_empty(), "held by {holder:?} after the run");
}

#[tokio::test]
async fn the_deploy_rbac_suffices_the_operator_runs_as_deployed_and_repairs_drift_at_once() {
    let binary = operator_binary();
    let Deployed {
        env: _env,
        host,
        member,
        operator_user,
        member_user,
    } = deployed().await;
    // A scraper, as Prometheus would be: bound to the metrics reader the manifests ship.
    let scraper = account_token(&host, "prometheus").await;
    {
        use k8s_openapi::api::rbac::v1::ClusterRoleBinding;
        let binding = ClusterRoleBinding {
            metadata: ObjectMeta {
                name: Some("prometheus-mcr-metrics".into()),
                ..Default::default()
            },
            role_ref: RoleRef {
                api_group: Some("rbac.authorization.k8s.io".into()),
                kind: "ClusterRole".into(),
                name: "mcr-operator-metrics-reader".into(),
            },
            subjects: Some(vec![Subject {
                kind: "ServiceAccount".into(),
                name: "prometheus".into(),
                namespace: Some("default".into()),
                ..Default::default()
            }]),
        };
        Api::<ClusterRoleBinding>::all(host.clone())
            .create(&PostParams::default(), &binding)
            .await
            .unwrap();
    }
    member_secret(&host, "mcr-system", member_user.kubeconfig()).await;
    create_original(&host).await;
    let dir = tempfile::tempdir().unwrap();
    // As the Deployment runs it (HTTPS, tokens checked by the host, copies in mcr-system),
    // resyncing only after the test is over: whatever is repaired is repaired by the watch.
    let operator = OperatorProcess::as_deployed(
        &binary,
        operator_user.kubeconfig_path(),
        "deployed",
        dir.path(),
    );
    let blue = Some(BTreeMap::from([("colour".to_string(), "blue".to_string())]));
    let copied = async || {
        configmap_in(&member, "mcr-system", "settings")
            .await
            .and_then(|c| c.data)
            == blue
    };
    eventually(60, "the copy in the member", copied).await;
    let readiness = async || https_get(operator.addr, "/readyz?verbose", Some(&scraper)).await;
    eventually(30, "ready, every watch listed", async || {
        let (status, detail, _) = readiness().await;
        status == 200 && detail.contains("host host: ok") && detail.contains("cluster east: ok")
    })
    .await;

    // Drift: a copy edited in the member is put back, then one deleted is made again, each
    // well before a resync (the operator resyncs every 2 s in the other tests; here the
    // watch of the copies must do it: the deadline is 30 s, the resync 600 s).
    let copies: Api<ConfigMap> = Api::namespaced(member.clone(), "mcr-system");
    copies
        .patch(
            "settings",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"data": {"colour": "red"}})),
        )
        .await
        .unwrap();
    eventually(30, "the edited copy put back", copied).await;
    copies
        .delete("settings", &DeleteParams::default())
        .await
        .unwrap();
    eventually(30, "the deleted copy made again", copied).await;

    // Metrics for the scraper only; nothing was refused anywhere.
    assert_eq!(https_get(operator.addr, "/metrics", None).await.0, 401);
    let (status, metrics, _) = https_get(operator.addr, "/metrics", Some(&scraper)).await;
    assert_eq!(status, 200, "{metrics}");
    let (_, detail, _) = readiness().await;
    let log = std::fs::read_to_string(&operator.log).unwrap();
    for text in [&detail, &log] {
        assert!(
            !text.to_lowercase().contains("forbidden"),
            "a refusal under the deploy RBAC: {text}"
        );
    }
}

/// The rules of the RBAC object `kind`/`name` in the manifests `yaml`.
fn rules_of(yaml: &str, kind: &str, name: &str) -> Vec<PolicyRule> {
    let docs: Vec<serde_json::Value> = serde_saphyr::from_multiple(yaml).unwrap();
    let doc = docs
        .into_iter()
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("{kind} {name} in the manifests"));
    serde_json::from_value(doc["rules"].clone()).unwrap()
}

/// Grants `rules` to `user`: cluster-wide (`namespace` None) or in `namespace`.
async fn grant(client: &kube::Client, user: &str, namespace: Option<&str>, rules: Vec<PolicyRule>) {
    use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
    let meta = |ns: Option<&str>| ObjectMeta {
        name: Some(format!("grant-{user}")),
        namespace: ns.map(str::to_string),
        ..Default::default()
    };
    let subjects = Some(vec![Subject {
        kind: "User".into(),
        name: user.into(),
        api_group: Some("rbac.authorization.k8s.io".into()),
        ..Default::default()
    }]);
    let pp = PostParams::default();
    match namespace {
        None => {
            Api::<ClusterRole>::all(client.clone())
                .create(
                    &pp,
                    &ClusterRole {
                        metadata: meta(None),
                        rules: Some(rules),
                        ..Default::default()
                    },
                )
                .await
                .unwrap();
            Api::<ClusterRoleBinding>::all(client.clone())
                .create(
                    &pp,
                    &ClusterRoleBinding {
                        metadata: meta(None),
                        role_ref: RoleRef {
                            api_group: Some("rbac.authorization.k8s.io".into()),
                            kind: "ClusterRole".into(),
                            name: format!("grant-{user}"),
                        },
                        subjects,
                    },
                )
                .await
                .unwrap();
        }
        Some(ns) => {
            Api::<Role>::namespaced(client.clone(), ns)
                .create(
                    &pp,
                    &Role {
                        metadata: meta(Some(ns)),
                        rules: Some(rules),
                    },
                )
                .await
                .unwrap();
            Api::<RoleBinding>::namespaced(client.clone(), ns)
                .create(
                    &pp,
                    &RoleBinding {
                        metadata: meta(Some(ns)),
                        role_ref: RoleRef {
                            api_group: Some("rbac.authorization.k8s.io".into()),
                            kind: "Role".into(),
                            name: format!("grant-{user}"),
                        },
                        subjects,
                    },
                )
                .await
                .unwrap();
        }
    }
}

/// Whether the operator's log (or its readiness detail) shows the API server refusing one of
/// `rule`'s verbs on one of its resources.
fn refused(text: &str, rule: &PolicyRule) -> bool {
    let text = text.replace("\\\"", "\"");
    rule.verbs.iter().any(|verb| {
        rule.resources
            .iter()
            .flatten()
            .any(|resource| text.contains(&format!("cannot {verb} resource \"{resource}\"")))
    })
}

#[tokio::test]
async fn removing_any_rule_of_the_deploy_rbac_breaks_the_operator() {
    let binary = operator_binary();
    let env = TestEnv::builder().clusters(2).start().await.unwrap();
    let (host_tc, member_tc) = (env.cluster(0).unwrap(), env.cluster(1).unwrap());
    let (host, member) = (host_tc.client().unwrap(), member_tc.client().unwrap());
    let (operator_yaml, member_yaml) = (manifest("operator.yaml"), manifest("member.yaml"));
    // Every permission is a Role in the operator's namespace, on each side (the TokenReview
    // delegation of the HTTPS endpoints aside: these processes serve plain HTTP).
    let host_rules = rules_of(&operator_yaml, "Role", "mcr-operator");
    let member_rules = rules_of(&member_yaml, "Role", "mcr-member");
    // Every rule, by where it is granted.
    let mut variants = Vec::new();
    for (place, rules) in [("host", &host_rules), ("member", &member_rules)] {
        for i in 0..rules.len() {
            variants.push((place, i));
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let mut running = Vec::new();
    for (n, (place, removed)) in variants.iter().enumerate() {
        let without = |p: &str, rules: &Vec<PolicyRule>| -> Vec<PolicyRule> {
            rules
                .iter()
                .enumerate()
                .filter(|(i, _)| !(p == *place && i == removed))
                .map(|(_, r)| r.clone())
                .collect()
        };
        // Each variant in a namespace of its own (its Lease, Secret and ConfigMap), as a
        // user of its own on each side.
        let ns = format!("least-{n}");
        for client in [&host, &member] {
            create_namespace(client, &ns).await;
        }
        let (user, member_user) = (format!("least-{n}"), format!("member-least-{n}"));
        grant(&host, &user, Some(&ns), without("host", &host_rules)).await;
        grant(
            &member,
            &member_user,
            Some(&ns),
            without("member", &member_rules),
        )
        .await;
        let operator_identity = host_tc.add_user(&user, &[]).unwrap();
        let member_identity = member_tc.add_user(&member_user, &[]).unwrap();
        member_secret(&host, &ns, member_identity.kubeconfig()).await;
        // Named per variant, so no two variants apply the same copy in the member.
        let mut original =
            labelled_cm(&format!("settings-{n}"), &[("mcr.example.io/copy", "true")]);
        original.data = Some(BTreeMap::from([("colour".into(), "blue".into())]));
        Api::<ConfigMap>::namespaced(host.clone(), &ns)
            .create(&PostParams::default(), &original)
            .await
            .unwrap();
        let process = OperatorProcess::start_in(
            &binary,
            operator_identity.kubeconfig_path(),
            &user,
            &ns,
            dir.path(),
        );
        running.push((place, *removed, process));
    }

    // Each variant shows the API server refusing what its removed rule allowed.
    for (place, removed, process) in &running {
        let rule = match **place {
            "host" => &host_rules[*removed],
            _ => &member_rules[*removed],
        };
        let what = format!("{place} rule {:?} {:?}", rule.verbs, rule.resources);
        eventually(60, &format!("without the {what}: a refusal"), async || {
            let log = std::fs::read_to_string(&process.log).unwrap_or_default();
            let readiness = http_get_opt(process.addr, "/readyz?verbose")
                .await
                .map(|r| r.1)
                .unwrap_or_default();
            refused(&log, rule) || refused(&readiness, rule)
        })
        .await;
        println!("without the {what}: refused, as expected");
    }
    for (_, _, mut process) in running {
        process.child.start_kill().unwrap();
        process.child.wait().await.unwrap();
    }
}

#[tokio::test]
async fn the_example_operator_copies_into_namespaces_as_clusters() {
    let binary = operator_binary();
    let env = TestEnv::start().await.unwrap();
    let tc = env.cluster(0).unwrap();
    let host = tc.client().unwrap();
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(host.clone());
    for (name, member) in [
        ("mcr-system", false),
        ("team-a", true),
        ("team-b", true),
        ("other", false),
    ] {
        let labels =
            member.then(|| BTreeMap::from([("mcr.example.io/member".into(), "true".into())]));
        namespaces
            .create(
                &PostParams::default(),
                &k8s_openapi::api::core::v1::Namespace {
                    metadata: ObjectMeta {
                        name: Some(name.into()),
                        labels,
                        ..Default::default()
                    },
                    ..Default::default()
                },
            )
            .await
            .unwrap();
    }
    create_original(&host).await;
    let dir = tempfile::tempdir().unwrap();
    let mut child = tokio::process::Command::new(&binary)
        .arg("--kubeconfig")
        .arg(tc.kubeconfig_path())
        .args(["--provider", "namespaces", "--leader-elect", "false"])
        .arg(format!("--bind-address=127.0.0.1:{}", free_port()))
        .arg("--plain-http")
        .stdout(std::fs::File::create(dir.path().join("log")).unwrap())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    // Each member namespace is a cluster: the copy lands in it, and only there.
    eventually(60, "copies in team-a and team-b", async || {
        configmap_in(&host, "team-a", "settings").await.is_some()
            && configmap_in(&host, "team-b", "settings").await.is_some()
    })
    .await;
    eventually(30, "the copied-to annotation", async || {
        configmap_in(&host, "mcr-system", "settings")
            .await
            .and_then(|c| c.metadata.annotations)
            .and_then(|a| a.get("mcr.example.io/copied-to").cloned())
            .as_deref()
            == Some("team-a,team-b")
    })
    .await;
    // The annotation was written after both copies: a copy into `other` would have shown.
    assert!(configmap_in(&host, "other", "settings").await.is_none());
    child.start_kill().unwrap();
    child.wait().await.unwrap();
}

// ---------------------------------------------------------------------------------------
// `mcr join` / `mcr unjoin` (cli/): members joined with identities of their own.

/// The kubeconfig and the token in the host Secret `mcr-system/<name>` that `mcr join` wrote.
async fn joined_secret(
    host: &kube::Client,
    name: &str,
) -> (k8s_openapi::api::core::v1::Secret, String, String) {
    use secrecy::ExposeSecret;
    let secret = Api::<k8s_openapi::api::core::v1::Secret>::namespaced(host.clone(), "mcr-system")
        .get(name)
        .await
        .unwrap();
    let bytes = &secret.data.as_ref().unwrap()["kubeconfig"].0;
    let kubeconfig = String::from_utf8(bytes.clone()).unwrap();
    let parsed = kube::config::Kubeconfig::from_yaml(&kubeconfig).unwrap();
    let token = parsed.auth_infos[0]
        .auth_info
        .as_ref()
        .unwrap()
        .token
        .as_ref()
        .unwrap()
        .expose_secret()
        .to_string();
    (secret, kubeconfig, token)
}

/// Who the API server at `server` (CA `ca_pem`) takes `token` for; `None` if it refuses it.
async fn who_is(server: &str, ca_pem: &str, token: &str) -> Option<String> {
    use k8s_openapi::api::authentication::v1::SelfSubjectReview;
    let mut config = kube::Config::new(server.parse().unwrap());
    config.root_cert = Some(rustls_pemfile_certs(ca_pem));
    config.auth_info.token = Some(token.to_string().into());
    let client = kube::Client::try_from(config).unwrap();
    match Api::<SelfSubjectReview>::all(client)
        .create(&PostParams::default(), &SelfSubjectReview::default())
        .await
    {
        Ok(review) => review
            .status
            .and_then(|s| s.user_info)
            .and_then(|u| u.username),
        Err(kube::Error::Api(status)) if status.code == 401 => None,
        Err(e) => panic!("SelfSubjectReview: {e}"),
    }
}

/// The DER certificates of a PEM bundle.
fn rustls_pemfile_certs(pem: &str) -> Vec<Vec<u8>> {
    use base64::Engine as _;
    pem.split("-----BEGIN CERTIFICATE-----")
        .skip(1)
        .map(|block| {
            let body: String = block
                .split("-----END CERTIFICATE-----")
                .next()
                .unwrap()
                .split_whitespace()
                .collect();
            base64::engine::general_purpose::STANDARD
                .decode(body)
                .unwrap()
        })
        .collect()
}

/// The `exp` claim of a JWT, in seconds since the epoch.
fn jwt_expiry(token: &str) -> i64 {
    use base64::Engine as _;
    let payload = token.split('.').nth(1).unwrap();
    let claims: serde_json::Value = serde_json::from_slice(
        &base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(payload)
            .unwrap(),
    )
    .unwrap();
    claims["exp"].as_i64().unwrap()
}

/// Whether deploy/member.yaml's Role or RoleBinding is in `member`.
async fn member_manifest_rbac_left(member: &kube::Client) -> bool {
    exists(
        &Api::<Role>::namespaced(member.clone(), "mcr-system"),
        "mcr-member",
    )
    .await
        || exists(
            &Api::<RoleBinding>::namespaced(member.clone(), "mcr-system"),
            "mcr-member",
        )
        .await
}

async fn exists<K>(api: &Api<K>, name: &str) -> bool
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    api.get_opt(name).await.unwrap().is_some()
}

#[tokio::test]
async fn mcr_join_gives_members_identities_that_last_rotates_them_and_unjoin_removes_what_it_made()
{
    use k8s_openapi::api::core::v1::{Namespace, Secret, ServiceAccount};
    use k8s_openapi::api::rbac::v1::ClusterRoleBinding;
    let (operator, mcr_bin) = (operator_binary(), mcr_binary());
    let env = TestEnv::builder().clusters(3).start().await.unwrap();
    let (host_tc, a_tc, b_tc) = (
        env.cluster(0).unwrap(),
        env.cluster(1).unwrap(),
        env.cluster(2).unwrap(),
    );
    let (host, a, b) = (
        host_tc.client().unwrap(),
        a_tc.client().unwrap(),
        b_tc.client().unwrap(),
    );
    apply_manifests(&host, &manifest("operator.yaml")).await;
    // In b, the identity's namespace and ServiceAccount were there before: unjoin keeps them.
    create_namespace(&b, "mcr-system").await;
    let b_accounts: Api<ServiceAccount> = Api::namespaced(b.clone(), "mcr-system");
    let account = ServiceAccount {
        metadata: ObjectMeta {
            name: Some("mcr-member".into()),
            ..Default::default()
        },
        ..Default::default()
    };
    b_accounts
        .create(&PostParams::default(), &account)
        .await
        .unwrap();

    // One kubeconfig with the three contexts, as an administrator has it.
    let dir = tempfile::tempdir().unwrap();
    let mut merged = kube::config::Kubeconfig::from_yaml(host_tc.kubeconfig()).unwrap();
    for tc in [&a_tc, &b_tc] {
        merged = merged
            .merge(kube::config::Kubeconfig::from_yaml(tc.kubeconfig()).unwrap())
            .unwrap();
    }
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(&kubeconfig, serde_json::to_string(&merged).unwrap()).unwrap();
    let kubeconfig = kubeconfig.to_str().unwrap();
    let member_manifest = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/member.yaml");
    let join = |context: &str, name: &str, extra: &[&str]| {
        let mut args = vec![
            "join",
            context,
            "--host-context",
            host_tc.name(),
            "--kubeconfig",
            kubeconfig,
            "--name",
        ];
        args.push(name);
        args.extend(["--manifest", member_manifest]);
        args.extend(extra);
        let args: Vec<String> = args.into_iter().map(String::from).collect();
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        mcr(&mcr_bin, &args)
    };

    let joined_at = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    let out = join(a_tc.name(), "a", &["--cluster-role", "view"]);
    assert!(out.contains("joined"), "{out}");
    join(b_tc.name(), "b", &[]);

    // The host Secrets, labelled for the provider, with a token as documented: a year long,
    // its expiry written beside it, and the member's ServiceAccount as its identity.
    let member_identity = "system:serviceaccount:mcr-system:mcr-member";
    let (secret, _, first_token) = joined_secret(&host, "a").await;
    let labels = secret.metadata.labels.clone().unwrap_or_default();
    assert_eq!(
        labels
            .get(multicluster_runtime::providers::KUBECONFIG_SECRET_LABEL)
            .map(String::as_str),
        Some("true")
    );
    let expiry = jwt_expiry(&first_token);
    let year = 8760 * 3600;
    assert!(
        (expiry - (joined_at + year)).abs() < 300,
        "the token expires at {expiry}, not a year after {joined_at}"
    );
    let written: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time = serde_json::from_value(
        serde_json::Value::String(
            secret.metadata.annotations.as_ref().unwrap()
                ["multicluster-runtime.sigs.k8s.io/token-expires"]
                .clone(),
        ),
    )
    .unwrap();
    assert_eq!(written.0.as_second(), expiry);
    assert_eq!(
        who_is(a_tc.server(), a_tc.ca_pem(), &first_token)
            .await
            .as_deref(),
        Some(member_identity)
    );
    let (_, _, b_token) = joined_secret(&host, "b").await;
    assert_eq!(
        who_is(b_tc.server(), b_tc.ca_pem(), &b_token)
            .await
            .as_deref(),
        Some(member_identity)
    );
    let bindings: Api<ClusterRoleBinding> = Api::all(a.clone());
    assert!(exists(&bindings, "mcr-join:a:view").await);
    // The manifest's own binding is the manifest's, not one of the bindings join prunes.
    let a_rolebindings: Api<RoleBinding> = Api::namespaced(a.clone(), "mcr-system");
    assert!(exists(&a_rolebindings, "mcr-member").await);
    // Another member under a name in use is refused before anything is made in it.
    let refused = mcr_refused(
        &mcr_bin,
        &[
            "join",
            b_tc.name(),
            "--host-context",
            host_tc.name(),
            "--kubeconfig",
            kubeconfig,
            "--name",
            "a",
        ],
    );
    assert!(refused.contains("another member"), "{refused}");
    assert!(
        !exists(
            &Api::<Secret>::namespaced(b.clone(), "mcr-system"),
            "mcr-join-a"
        )
        .await
    );

    // The example operator engages both through the Secrets and copies into them as that
    // identity (deploy/member.yaml's Role is all it has there).
    let operator_user = host_tc
        .add_user(
            "system:serviceaccount:mcr-system:mcr-operator",
            &[
                "system:serviceaccounts",
                "system:serviceaccounts:mcr-system",
            ],
        )
        .unwrap();
    let _operator = OperatorProcess::start(
        &operator,
        operator_user.kubeconfig_path(),
        "replica-a",
        dir.path(),
    );
    create_original(&host).await;
    eventually(60, "the copies in a and b", async || {
        configmap_in(&a, "mcr-system", "settings").await.is_some()
            && configmap_in(&b, "mcr-system", "settings").await.is_some()
    })
    .await;

    // Joining again converges (the view binding not asked for again goes; the record of what
    // join made is unchanged) and rotates: a new token, the one before still valid, and on
    // the next join the first one revoked.
    let records: Api<Secret> = Api::namespaced(a.clone(), "mcr-system");
    let record = records.get("mcr-join-a").await.unwrap().data;
    join(a_tc.name(), "a", &[]);
    assert!(!exists(&bindings, "mcr-join:a:view").await);
    assert_eq!(records.get("mcr-join-a").await.unwrap().data, record);
    let (_, _, second_token) = joined_secret(&host, "a").await;
    assert_ne!(second_token, first_token);
    assert!(
        who_is(a_tc.server(), a_tc.ca_pem(), &first_token)
            .await
            .is_some()
    );
    let out = join(a_tc.name(), "a", &[]);
    assert!(out.contains("1 older token(s) revoked"), "{out}");
    eventually(30, "the first token refused", async || {
        who_is(a_tc.server(), a_tc.ca_pem(), &first_token)
            .await
            .is_none()
    })
    .await;
    assert!(
        who_is(a_tc.server(), a_tc.ca_pem(), &second_token)
            .await
            .is_some()
    );
    // The operator follows the rotated Secret: a change is copied into a.
    let originals: Api<ConfigMap> = Api::namespaced(host.clone(), "mcr-system");
    originals
        .patch(
            "settings",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"data": {"colour": "green"}})),
        )
        .await
        .unwrap();
    eventually(
        60,
        "the change copied into a after the rotation",
        async || {
            configmap_in(&a, "mcr-system", "settings")
                .await
                .and_then(|cm| cm.data)
                .is_some_and(|d| d.get("colour").map(String::as_str) == Some("green"))
        },
    )
    .await;

    // Unjoin a: the host Secret goes (the operator disengages a), and in a everything join
    // made (the manifest's Role and RoleBinding, the ServiceAccount, the namespace, the token
    // anchors, the record).
    let (_, _, last_token) = joined_secret(&host, "a").await;
    let out = mcr(
        &mcr_bin,
        &[
            "unjoin",
            a_tc.name(),
            "--host-context",
            host_tc.name(),
            "--kubeconfig",
            kubeconfig,
            "--name",
            "a",
        ],
    );
    let secrets: Api<Secret> = Api::namespaced(host.clone(), "mcr-system");
    assert!(!exists(&secrets, "a").await);
    assert!(exists(&secrets, "b").await);
    let a_accounts: Api<ServiceAccount> = Api::namespaced(a.clone(), "mcr-system");
    assert!(!exists(&a_accounts, "mcr-member").await, "{out}");
    assert!(!member_manifest_rbac_left(&a).await, "{out}");
    assert!(!exists(&records, "mcr-join-a").await);
    let anchors = Api::<Secret>::namespaced(a.clone(), "mcr-system")
        .list(
            &kube::api::ListParams::default()
                .labels("multicluster-runtime.sigs.k8s.io/joined-as=a"),
        )
        .await
        .unwrap();
    assert!(
        anchors.items.is_empty(),
        "token anchors left: {}",
        anchors.items.len()
    );
    // The namespace join made holds the operator's copy, which join did not make: it stays.
    let namespace = Api::<Namespace>::all(a.clone())
        .get("mcr-system")
        .await
        .unwrap();
    assert!(namespace.metadata.deletion_timestamp.is_none());
    assert!(configmap_in(&a, "mcr-system", "settings").await.is_some());
    assert!(
        out.contains("kept Namespace mcr-system: it holds ConfigMap settings"),
        "{out}"
    );
    eventually(30, "a's last token refused", async || {
        who_is(a_tc.server(), a_tc.ca_pem(), &last_token)
            .await
            .is_none()
    })
    .await;
    let log = _operator.log.clone();
    eventually(30, "the operator disengaging a", async || {
        std::fs::read_to_string(&log)
            .unwrap()
            .lines()
            .any(|line| line.contains("cluster disengaged") && line.contains("\"cluster\":\"a\""))
    })
    .await;

    // A record rewritten to name an object join did not make (a ConfigMap of someone
    // else's): unjoin leaves it, as it does every object without its label and uid.
    let b_cms: Api<ConfigMap> = Api::namespaced(b.clone(), "mcr-system");
    let victim = ConfigMap {
        metadata: ObjectMeta {
            name: Some("victim".into()),
            ..Default::default()
        },
        ..Default::default()
    };
    b_cms.create(&PostParams::default(), &victim).await.unwrap();
    let b_records: Api<Secret> = Api::namespaced(b.clone(), "mcr-system");
    let mut entries: Vec<serde_json::Value> = serde_json::from_slice(
        &b_records.get("mcr-join-b").await.unwrap().data.unwrap()["created"].0,
    )
    .unwrap();
    entries.push(serde_json::json!({
        "apiVersion": "v1", "kind": "ConfigMap", "namespace": "mcr-system", "name": "victim"
    }));
    b_records
        .patch(
            "mcr-join-b",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({
                "stringData": { "created": serde_json::to_string(&entries).unwrap() }
            })),
        )
        .await
        .unwrap();

    // Unjoin b: what join made goes, what was there before stays.
    mcr(
        &mcr_bin,
        &[
            "unjoin",
            b_tc.name(),
            "--host-context",
            host_tc.name(),
            "--kubeconfig",
            kubeconfig,
            "--name",
            "b",
        ],
    );
    assert!(!exists(&secrets, "b").await);
    assert!(exists(&b_accounts, "mcr-member").await);
    assert!(exists(&b_cms, "victim").await);
    let b_namespace = Api::<Namespace>::all(b.clone())
        .get("mcr-system")
        .await
        .unwrap();
    assert!(b_namespace.metadata.deletion_timestamp.is_none());
    assert!(!member_manifest_rbac_left(&b).await);
    assert!(!exists(&b_records, "mcr-join-b").await);
    eventually(30, "b's token refused", async || {
        who_is(b_tc.server(), b_tc.ca_pem(), &b_token)
            .await
            .is_none()
    })
    .await;

    // For the File provider: a kubeconfig file, its owner's only, and no host.
    let file = dir.path().join("b.yaml");
    let file_arg = file.to_str().unwrap();
    let common = [
        "--kubeconfig",
        kubeconfig,
        "--name",
        "b-file",
        "--output-file",
        file_arg,
    ];
    let mut args = vec![
        "join",
        b_tc.name(),
        "--manifest",
        member_manifest,
        "--role",
        "mcr-system/mcr-member",
    ];
    args.extend(common);
    // A file that join did not write is not overwritten.
    std::fs::write(&file, "someone else's").unwrap();
    let refused = mcr_refused(&mcr_bin, &args);
    assert!(refused.contains("left alone"), "{refused}");
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "someone else's");
    std::fs::remove_file(&file).unwrap();
    mcr(&mcr_bin, &args);
    assert!(
        exists(
            &Api::<RoleBinding>::namespaced(b.clone(), "mcr-system"),
            "mcr-join:b-file:mcr-member"
        )
        .await
    );
    use std::os::unix::fs::PermissionsExt as _;
    assert_eq!(
        std::fs::metadata(&file).unwrap().permissions().mode() & 0o777,
        0o600
    );
    let written = kube::config::Kubeconfig::read_from(&file).unwrap();
    let config = kube::Config::from_custom_kubeconfig(written, &Default::default())
        .await
        .unwrap();
    let client = kube::Client::try_from(config).unwrap();
    // The identity can do what the Role it was bound to allows.
    Api::<ConfigMap>::namespaced(client.clone(), "mcr-system")
        .list(&Default::default())
        .await
        .unwrap();
    let review = Api::<k8s_openapi::api::authentication::v1::SelfSubjectReview>::all(client)
        .create(&PostParams::default(), &Default::default())
        .await
        .unwrap();
    assert_eq!(
        review
            .status
            .unwrap()
            .user_info
            .unwrap()
            .username
            .as_deref(),
        Some(member_identity)
    );
    let mut args = vec!["unjoin", b_tc.name()];
    args.extend(common);
    mcr(&mcr_bin, &args);
    assert!(!file.exists());
    assert!(
        !exists(
            &Api::<RoleBinding>::namespaced(b.clone(), "mcr-system"),
            "mcr-join:b-file:mcr-member"
        )
        .await
    );
    assert!(exists(&b_accounts, "mcr-member").await);
}
