//! Operations against a real control plane: leader election (failover, a leader that cannot
//! renew, release on shutdown, campaigning again).

mod common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::api::rbac::v1::{PolicyRule, Role, RoleBinding, RoleRef, Subject};
use kube::api::{Api, DeleteParams, ObjectMeta, PostParams};
use multicluster_runtime::providers::Clusters;
use multicluster_runtime::testenv::{TestCluster, TestEnv};
use multicluster_runtime::{
    Action, Builder, Cluster, ClusterName, Context, LeaderElection, Manager, ManagerError, OnLoss,
};

/// One reconcile: which replica ran it, and when it started and ended (ended includes
/// dropped: the record is closed when the reconcile's future is dropped, finished or not).
#[derive(Clone, Debug)]
struct Reconcile {
    replica: &'static str,
    start: Instant,
    end: Option<Instant>,
    /// Whether it ran to its end (not dropped).
    completed: bool,
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
    /// While set, reconciles started from then on never end on their own.
    hang: Arc<std::sync::atomic::AtomicBool>,
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
        });
        reconciles.len() - 1
    };
    let _running = Running {
        audit: state.audit.clone(),
        index,
    };
    // Long enough that a leader losing its lease is likely caught mid-reconcile.
    tokio::time::sleep(Duration::from_millis(50)).await;
    if state.hang.load(std::sync::atomic::Ordering::SeqCst) {
        std::future::pending::<()>().await;
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

/// Short timings so failover takes seconds: lease 3 s, renew deadline 2 s, retry 0.5 s.
fn election(client: kube::Client, identity: &str) -> LeaderElection {
    LeaderElection::new(client, "default", "operations-leader")
        .identity(identity)
        .lease_duration(Duration::from_secs(3))
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
    replica_hanging_on(name, tc, election, audit, Arc::default())
}

/// A replica whose reconciles hang once `hang` is set.
fn replica_hanging_on(
    name: &'static str,
    tc: &TestCluster,
    election: LeaderElection,
    audit: &Arc<Audit>,
    hang: Arc<std::sync::atomic::AtomicBool>,
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
            hang,
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
    elected(&b, 3 + 5, "b leads within the lease duration + 5 s").await;
    let takeover = died.elapsed();
    reconciled_by(&audit, "b", 3).await;
    let (by_a, by_b) = audit.assert_before("a", "b");
    println!("takeover after a died: {takeover:?}; reconciles: a {by_a}, b {by_b}");

    b.shutdown();
    b_run.await.unwrap().unwrap();
}

#[tokio::test]
async fn a_leader_that_cannot_renew_stops_before_another_takes_over() {
    let (_env, tc, host) = control_plane().await;
    // a renews through a user of its own, allowed Leases by a RoleBinding the test revokes.
    let roles: Api<Role> = Api::namespaced(host.clone(), "default");
    roles
        .create(
            &PostParams::default(),
            &Role {
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
            },
        )
        .await
        .unwrap();
    let bindings: Api<RoleBinding> = Api::namespaced(host.clone(), "default");
    let binding = RoleBinding {
        metadata: ObjectMeta {
            name: Some("replica-a-leases".into()),
            ..Default::default()
        },
        role_ref: RoleRef {
            api_group: Some("rbac.authorization.k8s.io".into()),
            kind: "Role".into(),
            name: "leases".into(),
        },
        subjects: Some(vec![Subject {
            kind: "User".into(),
            name: "replica-a".into(),
            api_group: Some("rbac.authorization.k8s.io".into()),
            ..Default::default()
        }]),
    };
    bindings
        .create(&PostParams::default(), &binding)
        .await
        .unwrap();
    let a_user = tc.add_user("replica-a", &[]).unwrap();
    let audit = Arc::new(Audit::default());
    let a = replica("a", &tc, election(a_user.client().unwrap(), "a"), &audit);
    let a_run = run(&a);
    // RBAC takes effect through the apiserver's informers: wait for a to win.
    elected(&a, 30, "a leads").await;
    reconciled_by(&audit, "a", 3).await;
    let b = replica("b", &tc, election(host.clone(), "b"), &audit);
    let b_run = run(&b);
    let a_so_far = audit.of("a").len();
    reconciled_by(&audit, "a", a_so_far + 10).await;

    // a can no longer renew: it stops its controllers at the renew deadline, before the
    // lease expires for b, and its run reports why.
    bindings
        .delete("replica-a-leases", &DeleteParams::default())
        .await
        .unwrap();
    let result = tokio::time::timeout(Duration::from_secs(30), a_run)
        .await
        .expect("a's run ends")
        .unwrap();
    assert!(
        matches!(&result, Err(ManagerError::LeadershipLost { lease, reason }) if lease == "default/operations-leader" && reason.contains("renew deadline")),
        "{result:?}"
    );
    assert!(!a.is_leader());
    elected(&b, 30, "b leads").await;
    reconciled_by(&audit, "b", 3).await;
    let (by_a, by_b) = audit.assert_before("a", "b");
    println!("reconciles: a {by_a}, b {by_b}");

    b.shutdown();
    b_run.await.unwrap().unwrap();
}

#[tokio::test]
async fn a_graceful_shutdown_gives_the_lease_up_and_a_candidate_campaigns_again() {
    let (_env, tc, host) = control_plane().await;
    let audit = Arc::new(Audit::default());
    // A lease of a minute: b can win it within 30 s only if a gives it up.
    let long = |identity| {
        election(host.clone(), identity)
            .lease_duration(Duration::from_secs(60))
            .renew_deadline(Duration::from_secs(40))
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
    let bad = election(host, "a").renew_deadline(Duration::from_secs(5));
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
    let (_env, tc, host) = control_plane().await;
    let audit = Arc::new(Audit::default());
    let long = |identity| {
        election(host.clone(), identity)
            .lease_duration(Duration::from_secs(60))
            .renew_deadline(Duration::from_secs(40))
    };
    let a = replica("a", &tc, long("a"), &audit);
    let a_run = {
        let a = a.clone();
        tokio::spawn(async move { a.run_until_signal().await })
    };
    elected(&a, 30, "a leads").await;
    // A reconcile is in flight when SIGTERM arrives.
    eventually(30, "a reconcile in flight", async || {
        audit.of("a").iter().any(|r| r.end.is_none())
    })
    .await;
    kill(Pid::this(), Signal::SIGTERM).unwrap();
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
    let hang = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let b = replica_hanging_on("b", &tc, long("b"), &audit, hang.clone());
    let b_run = {
        let b = b.clone();
        tokio::spawn(async move { b.run_until_signal().await })
    };
    elected(&b, 30, "b leads within 30 s of a 60 s lease").await;
    reconciled_by(&audit, "b", 3).await;
    audit.assert_before("a", "b");

    // b's reconciles hang from now on: SIGINT starts a graceful shutdown that would wait for
    // them (the graceful timeout is 30 s), and a second signal ends it at once.
    hang.store(true, std::sync::atomic::Ordering::SeqCst);
    let so_far = audit.of("b").len();
    eventually(30, "a hung reconcile of b", async || {
        audit.of("b")[so_far..].iter().any(|r| r.end.is_none())
    })
    .await;
    kill(Pid::this(), Signal::SIGINT).unwrap();
    // The graceful shutdown is under way once the manager's token is cancelled.
    eventually(30, "b's graceful shutdown under way", async || {
        b.shutdown_token().is_cancelled()
    })
    .await;
    let signalled = Instant::now();
    kill(Pid::this(), Signal::SIGINT).unwrap();
    tokio::time::timeout(Duration::from_secs(20), b_run)
        .await
        .expect("b stops at the second signal, long before the graceful timeout")
        .unwrap()
        .unwrap();
    let stopped_after = signalled.elapsed();
    let hung: Vec<_> = audit.of("b")[so_far..]
        .iter()
        .filter(|r| !r.completed)
        .cloned()
        .collect();
    assert!(!hung.is_empty(), "the hung reconcile never completed");
    // Dropped without waiting: the runtime drops the aborted tasks' futures soon after.
    eventually(30, "the hung reconciles dropped", async || {
        audit.of("b")[so_far..]
            .iter()
            .all(|r| r.completed || r.end.is_some())
    })
    .await;
    println!("stopped {stopped_after:?} after the second signal");
}
