//! Leader election against a real control plane: only the leader reconciles and a dead leader
//! is replaced within the lease duration, a leader that cannot renew stops before another takes
//! over, a candidate that lost its lease leads again in the same run, a graceful shutdown gives
//! the lease up, settings that cannot work are refused, SIGTERM drains reconciles and a second
//! signal stops at once, and a standby shutting down takes no lease it would not release. (The
//! example operator's failover, as processes, is in `tests/operator.rs`.)

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::audited::{control_plane, election, labelled, timing};
use common::*;
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::api::rbac::v1::{PolicyRule, Role, RoleBinding, RoleRef, Subject};
use kube::api::{Api, DeleteParams, ObjectMeta, PostParams};
use multicluster_runtime::providers::Clusters;
use multicluster_runtime::{
    Action, Builder, Cluster, ClusterName, Context, LeaderElection, Manager, ManagerError, OnLoss,
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
