//! [`Checker`]: runs a reconciler against the orderings a fleet can produce and checks that
//! it converges, is idempotent and writes nothing to a cluster after it left.
//!
//! The checker plays the controller's loop itself, one step at a time, over fake clusters:
//! it delivers each cluster's changes as events (in order within a cluster, interleaved
//! across clusters), turns them into requests (the primary kind, owned kinds, mapped kinds),
//! starts reconciles, and lets each API request of a reconcile through one at a time (so
//! reconciles of different clusters interleave at every request). Between steps it may
//! answer a write with 409 Conflict or 500, relist a cluster (every object again, as after a
//! watch restart), make a cluster leave mid-reconcile and come back under the same id, and
//! fire a requeue while an update is pending. Every choice comes from a seeded random
//! generator, or from a bounded exhaustive search; a failing schedule is reported with its
//! seed (to replay) and its steps, shrunk to the fewest that still fail.
//!
//! When the queue is quiet (no event, request, reconcile or requeue left), it checks:
//! - convergence: the invariant holds;
//! - idempotence: reconciling every object once more writes nothing (no resource version
//!   moves);
//! - departures: no write reached a cluster while it was away from a reconcile that started
//!   after it left (a reconcile in flight when its cluster leaves may still finish its
//!   write: the runtime cancels its context, and a write cannot be taken back; one that
//!   starts later and writes there kept a stale handle).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use kube::Resource;
use multicluster_runtime::{Action, Cluster, ClusterId, ClusterName, Context, Fleet, Request};
use serde::de::DeserializeOwned;
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::selectors::LabelSelector;
use crate::server::{ApiServer, ApiServerBuilder, Gate};

type Reconcile<K, S, C> = Arc<
    dyn Fn(Arc<K>, Context<C, S>) -> Pin<Box<dyn Future<Output = Result<Action, String>> + Send>>
        + Send
        + Sync,
>;
type Seeder = Arc<dyn Fn(ApiServerBuilder) -> ApiServerBuilder + Send + Sync>;
type Mapper<C> = Arc<dyn Fn(&str, &Value) -> Vec<Request<C>> + Send + Sync>;
type Invariant = Arc<dyn Fn(&World) -> Result<(), String> + Send + Sync>;
type ClusterFilter = Arc<dyn Fn(&str) -> bool + Send + Sync>;

/// The clusters as a schedule left them, for an invariant to read.
pub struct World {
    servers: BTreeMap<String, ApiServer>,
    engaged: BTreeSet<String>,
}

impl World {
    /// The clusters' names, engaged or away.
    pub fn clusters(&self) -> impl Iterator<Item = &str> {
        self.servers.keys().map(String::as_str)
    }

    /// Whether `cluster` is engaged (it did not leave, or came back).
    pub fn is_engaged(&self, cluster: &str) -> bool {
        self.engaged.contains(cluster)
    }

    /// The server of `cluster`.
    pub fn server(&self, cluster: &str) -> Option<&ApiServer> {
        self.servers.get(cluster)
    }

    /// Every object of kind `T` in `cluster`.
    pub fn objects<T: Resource<DynamicType = ()> + DeserializeOwned>(
        &self,
        cluster: &str,
    ) -> Vec<T> {
        let (api_version, kind) = (T::api_version(&()), T::kind(&()));
        let Some(server) = self.servers.get(cluster) else {
            return Vec::new();
        };
        server
            .objects()
            .into_iter()
            .filter(|o| o["apiVersion"] == *api_version && o["kind"] == *kind)
            .filter_map(|o| serde_json::from_value(o).ok())
            .collect()
    }

    /// The object of kind `T` named `name` (in `namespace`) in `cluster`.
    pub fn get<T: Resource<DynamicType = ()> + DeserializeOwned>(
        &self,
        cluster: &str,
        namespace: Option<&str>,
        name: &str,
    ) -> Option<T> {
        let server = self.servers.get(cluster)?;
        let v = server.object(&T::api_version(&()), &T::kind(&()), namespace, name)?;
        serde_json::from_value(v).ok()
    }
}

/// A kind whose changes make requests.
struct Source<C: ClusterId> {
    api_version: String,
    kind: String,
    selector: LabelSelector,
    /// `None`: the primary kind (its own request); `Some`: another kind, mapped.
    map: Option<Mapper<C>>,
}

impl<C: ClusterId> Clone for Source<C> {
    fn clone(&self) -> Self {
        Source {
            api_version: self.api_version.clone(),
            kind: self.kind.clone(),
            selector: self.selector.clone(),
            map: self.map.clone(),
        }
    }
}

/// A selector a test gave; one that does not parse is the test's mistake (it would select
/// everything, silently).
fn parse_selector(what: &str, selector: &str) -> LabelSelector {
    match LabelSelector::parse(selector) {
        Ok(s) => s,
        Err(e) => panic!("{what}: {selector:?} is not a label selector: {e}"),
    }
}

/// What a schedule may do besides delivering events and letting requests through.
#[derive(Clone, Copy, Debug)]
struct Budgets {
    faults: usize,
    relists: usize,
    departures: usize,
    requeues: usize,
}

/// How a schedule ended badly.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Violation {
    /// The invariant did not hold once the queue was quiet.
    NotConverged(String),
    /// A second reconcile of an unchanged world wrote.
    NotIdempotent(String),
    /// A write reached a cluster while it was away, and every reconcile in flight started
    /// after it left.
    WroteAfterLeaving(String),
    /// The schedule did not become quiet within the step limit (a reconcile that keeps
    /// writing, or requeues that never end).
    Livelock(usize),
    /// A reconcile panicked.
    Panicked(String),
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Violation::NotConverged(why) => write!(
                f,
                "not converged: the invariant failed once the queue was quiet: {why}"
            ),
            Violation::NotIdempotent(what) => write!(
                f,
                "not idempotent: a second reconcile of an unchanged world wrote: {what}"
            ),
            Violation::WroteAfterLeaving(what) => {
                write!(f, "wrote to a cluster after it left: {what}")
            }
            Violation::Livelock(steps) => write!(f, "no quiet after {steps} steps"),
            Violation::Panicked(what) => write!(f, "a reconcile panicked: {what}"),
        }
    }
}

/// A failing schedule: its seed (replay it with [`Checker::replay`]), what went wrong and the
/// steps that lead there, shrunk.
#[derive(Clone, Debug)]
pub struct Failure {
    /// The seed of the schedule (random schedules; for an exhaustive search, its number).
    pub seed: u64,
    /// What went wrong.
    pub violation: Violation,
    /// The steps of the shortest schedule found that fails the same way.
    pub trace: Vec<String>,
    /// The choice taken at each step of the failing schedule, as it ran (before shrinking):
    /// [`Checker::replay_choices`] runs it again.
    pub choices: Vec<usize>,
    /// Whether the schedule came from [`Checker::exhaustive`] (replayed by its choices only).
    exhaustive: bool,
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "schedule {} fails: {}", self.seed, self.violation)?;
        if self.exhaustive {
            writeln!(
                f,
                "replay it with Checker::replay_choices(&{:?});",
                self.choices
            )?;
        } else {
            writeln!(f, "replay it with Checker::replay({});", self.seed)?;
        }
        writeln!(f, "the steps, shrunk to {}:", self.trace.len())?;
        for (i, step) in self.trace.iter().enumerate() {
            writeln!(f, "  {:>3}. {step}", i + 1)?;
        }
        Ok(())
    }
}

impl std::error::Error for Failure {}

/// What an exploration covered.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Report {
    /// Schedules run.
    pub schedules: usize,
    /// Steps taken, over all schedules.
    pub steps: usize,
    /// Whether a bounded exhaustive search ran out of schedules (every one was tried).
    pub exhausted: bool,
}

/// Checks a reconciler over the orderings a fleet can produce (see the module's docs).
///
/// ```
/// use std::sync::Arc;
/// use k8s_openapi::api::core::v1::ConfigMap;
/// use multicluster_runtime::{Action, ClusterName, Context};
/// use multicluster_runtime_fake::Checker;
///
/// /// Marks every ConfigMap as seen.
/// async fn reconcile(cm: Arc<ConfigMap>, ctx: Context<ClusterName, ()>) -> Result<Action, kube::Error> {
///     let api = kube::Api::<ConfigMap>::namespaced(ctx.client(), "default");
///     let patch = serde_json::json!({"metadata": {"labels": {"seen": "yes"}}});
///     api.patch(&cm.metadata.name.clone().unwrap_or_default(), &Default::default(), &kube::api::Patch::Merge(patch)).await?;
///     Ok(Action::await_change())
/// }
///
/// let mut cm = ConfigMap::default();
/// cm.metadata.name = Some("x".into());
/// cm.metadata.namespace = Some("default".into());
/// let report = Checker::new(reconcile, ())
///     .cluster("a", move |s| s.object(&cm))
///     .invariant(|world| {
///         let cms = world.objects::<ConfigMap>("a");
///         match cms.iter().all(|c| c.metadata.labels.as_ref().is_some_and(|l| l.contains_key("seen"))) {
///             true => Ok(()),
///             false => Err("a ConfigMap is not marked".into()),
///         }
///     })
///     .random(20)
///     .unwrap();
/// assert_eq!(report.schedules, 20);
/// ```
pub struct Checker<K, S, C: ClusterId = ClusterName> {
    reconcile: Reconcile<K, S, C>,
    state: Arc<dyn Fn() -> S + Send + Sync>,
    clusters: Vec<(String, Seeder)>,
    /// The manager's local cluster, if the reconciler has one: not a fleet member.
    local: Option<(String, Seeder)>,
    sources: Vec<Source<C>>,
    watched_in: Option<ClusterFilter>,
    /// Every primary object again when a cluster leaves or comes back.
    on_fleet_events: bool,
    invariant: Option<Invariant>,
    budgets: Budgets,
    concurrency: usize,
    max_steps: usize,
    seed: u64,
}

impl<K, S, C> Checker<K, S, C>
where
    K: Resource<DynamicType = ()> + DeserializeOwned + Clone + Send + Sync + 'static,
    S: Send + Sync + 'static,
    C: ClusterId,
{
    /// A checker of `reconcile` (a reconciler as the runtime takes it), each schedule with a
    /// fresh clone of `state`.
    pub fn new<F, Fut, E>(reconcile: F, state: S) -> Self
    where
        F: Fn(Arc<K>, Context<C, S>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Action, E>> + Send + 'static,
        E: fmt::Display,
        S: Clone,
    {
        Self::with_state(reconcile, move || state.clone())
    }

    /// A checker of `reconcile`, each schedule with the state `state` makes (for a state
    /// that is not `Clone`, or that must start empty).
    pub fn with_state<F, Fut, E>(
        reconcile: F,
        state: impl Fn() -> S + Send + Sync + 'static,
    ) -> Self
    where
        F: Fn(Arc<K>, Context<C, S>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Action, E>> + Send + 'static,
        E: fmt::Display,
    {
        let reconcile = Arc::new(reconcile);
        Checker {
            reconcile: Arc::new(move |object, ctx| {
                let fut = reconcile(object, ctx);
                Box::pin(async move { fut.await.map_err(|e| e.to_string()) })
            }),
            state: Arc::new(state),
            clusters: Vec::new(),
            local: None,
            sources: vec![Source {
                api_version: K::api_version(&()).into_owned(),
                kind: K::kind(&()).into_owned(),
                selector: LabelSelector::default(),
                map: None,
            }],
            watched_in: None,
            on_fleet_events: false,
            invariant: None,
            budgets: Budgets {
                faults: 1,
                relists: 1,
                departures: 1,
                requeues: 1,
            },
            concurrency: 2,
            max_steps: 400,
            seed: 0,
        }
    }

    /// A cluster named `name`, its server made by `seed` from the default builder (add the
    /// objects that exist from the start with [`ApiServerBuilder::object`]).
    #[must_use]
    pub fn cluster(
        mut self,
        name: &str,
        seed: impl Fn(ApiServerBuilder) -> ApiServerBuilder + Send + Sync + 'static,
    ) -> Self {
        self.clusters.push((name.to_owned(), Arc::new(seed)));
        self
    }

    /// The manager's local (host) cluster: not a fleet member (it never leaves), reached
    /// through `ctx.local()` and `ctx.cluster_by_id`, watched like the others unless
    /// [`Checker::watched_in`] says otherwise.
    #[must_use]
    pub fn local(
        mut self,
        name: &str,
        seed: impl Fn(ApiServerBuilder) -> ApiServerBuilder + Send + Sync + 'static,
    ) -> Self {
        self.local = Some((name.to_owned(), Arc::new(seed)));
        self
    }

    /// Only objects of the primary kind with these labels make requests (a watch's label
    /// selector, as `watcher::Config::labels` says it).
    #[must_use]
    pub fn labels(mut self, selector: &str) -> Self {
        self.sources[0].selector = parse_selector("Checker::labels", selector);
        self
    }

    /// The primary kind is watched only in the clusters `watched` accepts (a multi-cluster-
    /// aware reconciler that watches some clusters and acts on others).
    #[must_use]
    pub fn watched_in(mut self, watched: impl Fn(&str) -> bool + Send + Sync + 'static) -> Self {
        self.watched_in = Some(Arc::new(watched));
        self
    }

    /// Changes of `T` whose controller owner reference names an object of the primary kind
    /// request that owner, in the same cluster (`Builder::owns`); `selector` as for
    /// [`Checker::labels`] ("" for all).
    #[must_use]
    pub fn owns<T: Resource<DynamicType = ()>>(mut self, selector: &str) -> Self {
        let (owner_version, owner_kind) =
            (K::api_version(&()).into_owned(), K::kind(&()).into_owned());
        let map: Mapper<C> = Arc::new(move |cluster: &str, object: &Value| {
            let refs = object
                .pointer("/metadata/ownerReferences")
                .and_then(Value::as_array);
            let namespace = object
                .pointer("/metadata/namespace")
                .and_then(Value::as_str);
            refs.into_iter()
                .flatten()
                .filter(|r| {
                    r["controller"] == true
                        && r["kind"] == *owner_kind
                        && r["apiVersion"] == *owner_version
                })
                .filter_map(|r| r["name"].as_str())
                .filter_map(|owner| Some(Request::new(C::parse(cluster).ok()?, namespace, owner)))
                .collect()
        });
        self.sources.push(Source {
            api_version: T::api_version(&()).into_owned(),
            kind: T::kind(&()).into_owned(),
            selector: parse_selector("Checker::owns", selector),
            map: Some(map),
        });
        self
    }

    /// Changes of `T` in any cluster make the requests `map` returns (any cluster's: a
    /// relation across clusters).
    #[must_use]
    pub fn maps<T, M>(mut self, map: M) -> Self
    where
        T: Resource<DynamicType = ()> + DeserializeOwned,
        M: Fn(&str, &T) -> Vec<Request<C>> + Send + Sync + 'static,
    {
        let mapper: Mapper<C> = Arc::new(move |cluster: &str, object: &Value| {
            match serde_json::from_value::<T>(object.clone()) {
                Ok(o) => map(cluster, &o),
                Err(_) => Vec::new(),
            }
        });
        self.sources.push(Source {
            api_version: T::api_version(&()).into_owned(),
            kind: T::kind(&()).into_owned(),
            selector: LabelSelector::default(),
            map: Some(mapper),
        });
        self
    }

    /// Every selected object of the primary kind is requested again when a cluster leaves or
    /// comes back (`Builder::reconcile_all_on` with the fleet's events).
    #[must_use]
    pub fn reconcile_all_on_fleet_events(mut self) -> Self {
        self.on_fleet_events = true;
        self
    }

    /// What must hold once the queue is quiet.
    #[must_use]
    pub fn invariant(
        mut self,
        invariant: impl Fn(&World) -> Result<(), String> + Send + Sync + 'static,
    ) -> Self {
        self.invariant = Some(Arc::new(invariant));
        self
    }

    /// How many reconciles may run at once (default 2, so that reconciles of different
    /// clusters interleave).
    #[must_use]
    pub fn concurrency(mut self, n: usize) -> Self {
        self.concurrency = n.max(1);
        self
    }

    /// How many faults (409 or 500 answers), relists, departures (each with its return) and
    /// early requeues one schedule may have (default 1 each).
    #[must_use]
    pub fn budgets(
        mut self,
        faults: usize,
        relists: usize,
        departures: usize,
        requeues: usize,
    ) -> Self {
        self.budgets = Budgets {
            faults,
            relists,
            departures,
            requeues,
        };
        self
    }

    /// The most steps a schedule may take before it counts as a livelock (default 400).
    #[must_use]
    pub fn max_steps(mut self, steps: usize) -> Self {
        self.max_steps = steps;
        self
    }

    /// The first seed of [`Checker::random`] (default 0).
    #[must_use]
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Whether a source watches objects of this kind with these labels.
    fn selects(&self, api_version: &str, kind: &str, object: &Value) -> bool {
        let labels = object
            .pointer("/metadata/labels")
            .and_then(Value::as_object);
        self.sources
            .iter()
            .any(|s| s.api_version == api_version && s.kind == kind && s.selector.matches(labels))
    }

    /// Runs `schedules` random schedules (seeds `seed`, `seed + 1`, …); the first that fails
    /// is shrunk and returned.
    pub fn random(&self, schedules: usize) -> Result<Report, Failure> {
        let mut report = Report::default();
        for i in 0..schedules as u64 {
            let seed = self.seed.wrapping_add(i);
            let outcome = self.run_one(Choices::Random(fastrand::Rng::with_seed(seed)));
            report.schedules += 1;
            report.steps += outcome.trace.len();
            if let Some(violation) = outcome.violation {
                let choices = outcome.taken.iter().map(|(c, _)| *c).collect();
                return Err(self.shrink(seed, violation, outcome.trace, choices, false));
            }
        }
        Ok(report)
    }

    /// Tries every schedule (every choice at every step), up to `limit` schedules; stops at
    /// the first that fails. `Report::exhausted` says whether all were tried.
    pub fn exhaustive(&self, limit: usize) -> Result<Report, Failure> {
        let mut report = Report::default();
        let mut prefix: Vec<usize> = Vec::new();
        while report.schedules < limit {
            let outcome = self.run_one(Choices::Script(prefix.clone(), Vec::new()));
            report.schedules += 1;
            report.steps += outcome.trace.len();
            if let Some(violation) = outcome.violation {
                let seed = report.schedules as u64 - 1;
                let choices = outcome.taken.iter().map(|(c, _)| *c).collect();
                return Err(self.shrink(seed, violation, outcome.trace, choices, true));
            }
            // The next schedule: the deepest step with a choice not tried yet.
            let mut taken = outcome.taken;
            loop {
                match taken.pop() {
                    None => {
                        report.exhausted = true;
                        return Ok(report);
                    }
                    Some((chosen, options)) if chosen + 1 < options => {
                        prefix = taken.iter().map(|(c, _)| *c).collect();
                        prefix.push(chosen + 1);
                        break;
                    }
                    Some(_) => {}
                }
            }
        }
        Ok(report)
    }

    /// Runs the random schedule `seed` again and returns how it ended (`Ok` with its steps
    /// when it passes).
    pub fn replay(&self, seed: u64) -> Result<Vec<String>, Failure> {
        let outcome = self.run_one(Choices::Random(fastrand::Rng::with_seed(seed)));
        Self::ended(seed, outcome, false)
    }

    /// Runs the schedule that takes these choices (a [`Failure`]'s `choices`, from either
    /// kind of search) again; after them, the first choice at each step.
    pub fn replay_choices(&self, choices: &[usize]) -> Result<Vec<String>, Failure> {
        let outcome = self.run_one(Choices::Script(choices.to_vec(), Vec::new()));
        Self::ended(0, outcome, true)
    }

    fn ended(seed: u64, outcome: Outcome, exhaustive: bool) -> Result<Vec<String>, Failure> {
        let choices = outcome.taken.iter().map(|(c, _)| *c).collect();
        match outcome.violation {
            None => Ok(outcome.trace),
            Some(violation) => Err(Failure {
                seed,
                violation,
                trace: outcome.trace,
                choices,
                exhaustive,
            }),
        }
    }

    /// The shortest schedule found that fails as `violation` did: steps of `trace` taken out
    /// a chunk at a time, kept out while the schedule (finished by the default choices) still
    /// fails the same way.
    fn shrink(
        &self,
        seed: u64,
        violation: Violation,
        trace: Vec<String>,
        choices: Vec<usize>,
        exhaustive: bool,
    ) -> Failure {
        let same = |v: &Violation| std::mem::discriminant(v) == std::mem::discriminant(&violation);
        let mut best = trace;
        let mut chunk = best.len().div_ceil(2).max(1);
        let mut runs = 0;
        while chunk >= 1 && runs < 400 {
            let mut i = 0;
            let mut shrunk = false;
            while i < best.len() && runs < 400 {
                let mut candidate = best.clone();
                candidate.drain(i..(i + chunk).min(candidate.len()));
                runs += 1;
                let outcome = self.run_one(Choices::Script(Vec::new(), candidate));
                if outcome.violation.as_ref().is_some_and(same) && outcome.trace.len() < best.len()
                {
                    best = outcome.trace;
                    shrunk = true;
                } else {
                    i += chunk;
                }
            }
            if !shrunk {
                if chunk == 1 {
                    break;
                }
                chunk /= 2;
            }
        }
        Failure {
            seed,
            violation,
            trace: best,
            choices,
            exhaustive,
        }
    }

    /// One schedule, on a fresh fleet, in a runtime of its own with paused time.
    fn run_one(&self, choices: Choices) -> Outcome {
        // Called from async code (a `#[tokio::test]`): the schedule gets a thread of its own,
        // since a runtime cannot block inside another.
        if tokio::runtime::Handle::try_current().is_ok() {
            return std::thread::scope(|scope| {
                match scope.spawn(|| self.run_here(choices)).join() {
                    Ok(outcome) => outcome,
                    Err(_) => Outcome {
                        violation: Some(Violation::Panicked(
                            "the schedule's thread panicked".into(),
                        )),
                        trace: Vec::new(),
                        taken: Vec::new(),
                    },
                }
            });
        }
        self.run_here(choices)
    }

    fn run_here(&self, choices: Choices) -> Outcome {
        let runtime = match tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
        {
            Ok(r) => r,
            Err(e) => {
                return Outcome {
                    violation: Some(Violation::Panicked(format!("no runtime: {e}"))),
                    trace: Vec::new(),
                    taken: Vec::new(),
                };
            }
        };
        runtime.block_on(Run::new(self, choices).go())
    }
}

/// Where a schedule's choices come from.
enum Choices {
    Random(fastrand::Rng),
    /// Choice indices for the first steps, then steps named by their labels (skipped when
    /// not possible), then the first choice.
    Script(Vec<usize>, Vec<String>),
}

struct Outcome {
    violation: Option<Violation>,
    trace: Vec<String>,
    /// At each step, the choice taken and how many there were.
    taken: Vec<(usize, usize)>,
}

/// A reconcile in flight.
struct InFlight<C: ClusterId> {
    request: Request<C>,
    /// The step it started at.
    started: usize,
    task: tokio::task::JoinHandle<Result<Action, String>>,
}

/// One event: a change of an object in a cluster.
struct Event {
    api_version: String,
    kind: String,
    object: Value,
}

/// One step a schedule can take.
#[derive(Clone, Debug)]
enum Step {
    Deliver(String),
    Start(usize),
    Release(usize),
    Fault(usize, u16),
    Relist(String),
    Leave(String),
    Rejoin(String),
    Requeue(usize),
    Retry(usize),
    /// Reconciles are in flight but none waits at the gate (a timer, say): time passes.
    Wait,
}

/// The state of one schedule.
struct Run<'c, K, S, C: ClusterId> {
    checker: &'c Checker<K, S, C>,
    /// The local cluster's handle, if there is one.
    local: Option<Cluster<C>>,
    choices: Choices,
    servers: BTreeMap<String, ApiServer>,
    fleet: Fleet<C>,
    engaged: BTreeMap<String, CancellationToken>,
    /// The clusters away, and the step each left at.
    away: BTreeMap<String, usize>,
    cursors: BTreeMap<String, u64>,
    pending: BTreeMap<String, VecDeque<Event>>,
    queue: Vec<Request<C>>,
    /// Requests a reconcile asked to see again later (`Action::requeue`): fired early, racing
    /// the events, within the budget; a quiet queue does not wait for them (the checks
    /// reconcile everything once more anyway).
    requeues: Vec<Request<C>>,
    /// Requests whose reconcile failed: retried, also when everything else is quiet.
    retries: Vec<Request<C>>,
    in_flight: Vec<InFlight<C>>,
    gate: Arc<Gate>,
    state: Arc<S>,
    budgets: Budgets,
    trace: Vec<String>,
    taken: Vec<(usize, usize)>,
    violation: Option<Violation>,
}

impl<'c, K, S, C> Run<'c, K, S, C>
where
    K: Resource<DynamicType = ()> + DeserializeOwned + Clone + Send + Sync + 'static,
    S: Send + Sync + 'static,
    C: ClusterId,
{
    fn new(checker: &'c Checker<K, S, C>, choices: Choices) -> Self {
        Run {
            checker,
            local: None,
            choices,
            servers: BTreeMap::new(),
            fleet: Fleet::new(),
            engaged: BTreeMap::new(),
            away: BTreeMap::new(),
            cursors: BTreeMap::new(),
            pending: BTreeMap::new(),
            queue: Vec::new(),
            requeues: Vec::new(),
            retries: Vec::new(),
            in_flight: Vec::new(),
            gate: Arc::new(Gate::default()),
            state: Arc::new((checker.state)()),
            budgets: checker.budgets,
            trace: Vec::new(),
            taken: Vec::new(),
            violation: None,
        }
    }

    async fn go(mut self) -> Outcome {
        if let Some((name, seed)) = &self.checker.local {
            let server = seed(ApiServer::builder(name.as_str())).build();
            server.set_gate(Some(self.gate.clone()));
            if let Ok(id) = C::parse(name) {
                self.local = Some(Cluster::new(id, server.client()));
            }
            self.servers.insert(name.clone(), server);
            self.engage(name);
        }
        for (name, seed) in &self.checker.clusters {
            let server = seed(ApiServer::builder(name.as_str())).build();
            server.set_gate(Some(self.gate.clone()));
            self.servers.insert(name.clone(), server);
            self.engage(name);
        }
        let mut steps = 0;
        loop {
            self.settle().await;
            if self.violation.is_some() {
                break;
            }
            let steps_now = self.steps();
            if steps_now.is_empty() {
                self.quiet().await;
                break;
            }
            steps += 1;
            if steps > self.checker.max_steps {
                self.violation = Some(Violation::Livelock(self.checker.max_steps));
                break;
            }
            let Some(step) = self.choose(&steps_now) else {
                break;
            };
            self.take(step).await;
        }
        // Parked requests of a run that stopped early are let through and the tasks dropped.
        for p in crate::server::lock_parked(&self.gate) {
            let _ = p.answer.send(None);
        }
        for f in self.in_flight.drain(..) {
            f.task.abort();
        }
        Outcome {
            violation: self.violation,
            trace: self.trace,
            taken: self.taken,
        }
    }

    fn engage(&mut self, name: &str) {
        let Some(server) = self.servers.get(name).cloned() else {
            return;
        };
        let token = CancellationToken::new();
        let Ok(id) = C::parse(name) else { return };
        if self.local.as_ref().is_some_and(|l| *l.id() == id) {
            // The local cluster is no fleet member: it is only watched.
        } else {
            let _ = self
                .fleet
                .engage_until(Cluster::new(id, server.client()), token.clone());
        }
        self.engaged.insert(name.to_owned(), token);
        self.away.remove(name);
        // Engaging lists everything: each object is an event.
        self.relist(name);
        self.cursors
            .insert(name.to_owned(), server.resource_version());
    }

    fn watched(&self, cluster: &str) -> bool {
        self.checker.watched_in.as_ref().is_none_or(|w| w(cluster))
    }

    /// Every object a source of `cluster` selects, as events (a list).
    fn relist(&mut self, cluster: &str) {
        let Some(server) = self.servers.get(cluster) else {
            return;
        };
        let mut events = VecDeque::new();
        for object in server.objects() {
            let (v, k) = (
                object["apiVersion"].as_str().unwrap_or_default(),
                object["kind"].as_str().unwrap_or_default(),
            );
            if self.checker.selects(v, k, &object) {
                events.push_back(Event {
                    api_version: v.to_owned(),
                    kind: k.to_owned(),
                    object,
                });
            }
        }
        self.pending
            .entry(cluster.to_owned())
            .or_default()
            .extend(events);
    }

    /// Lets every task run until each has finished or waits at the gate.
    async fn settle(&mut self) {
        // Paused time moves only when every task waits: this sleep ends at quiescence.
        for _ in 0..3 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        self.collect_changes();
        self.finish_reconciles().await;
        self.check_departures();
    }

    /// New changes of each engaged cluster become pending events.
    fn collect_changes(&mut self) {
        for (name, server) in &self.servers {
            let cursor = self.cursors.get(name).copied().unwrap_or(0);
            let changes = server.changes_after(cursor);
            if let Some(last) = changes.last() {
                self.cursors.insert(name.clone(), last.rv);
            }
            if !self.engaged.contains_key(name) {
                continue;
            }
            for crate::server::ChangeView {
                api_version: v,
                kind: k,
                new,
                old,
                ..
            } in changes
            {
                // A watch with a selector sees an object that enters or leaves it.
                let seen = [&new, &old]
                    .iter()
                    .any(|o| o.as_ref().is_some_and(|o| self.checker.selects(&v, &k, o)));
                if !seen {
                    continue;
                }
                // A deletion is delivered as the object it was.
                let Some(object) = new.or(old) else { continue };
                self.pending
                    .entry(name.clone())
                    .or_default()
                    .push_back(Event {
                        api_version: v,
                        kind: k,
                        object,
                    });
            }
        }
    }

    async fn finish_reconciles(&mut self) {
        let mut i = 0;
        while i < self.in_flight.len() {
            if !self.in_flight[i].task.is_finished() {
                i += 1;
                continue;
            }
            let f = self.in_flight.remove(i);
            match f.task.await {
                Ok(Ok(action)) => {
                    if action.requeue_after().is_some() {
                        self.requeues.push(f.request);
                    }
                }
                // An error is retried (the runtime's error policy requeues it).
                Ok(Err(_)) => self.retries.push(f.request),
                Err(e) if e.is_panic() => {
                    self.violation = Some(Violation::Panicked(format!("{}: {e}", f.request)));
                }
                Err(_) => {}
            }
        }
    }

    fn check_departures(&mut self) {
        let parked = crate::server::lock_parked(&self.gate);
        let mut keep = Vec::new();
        for p in parked {
            let left_at = self.away.get(&p.server).copied();
            // Only when some reconcile is in flight and every one started after the departure
            // is the write surely stale (a request is not traced to its reconcile).
            let stale = left_at.is_some_and(|at| {
                !self.in_flight.is_empty() && self.in_flight.iter().all(|f| f.started > at)
            });
            if stale && p.record.verb.writes() && self.violation.is_none() {
                let r = &p.record;
                self.violation = Some(Violation::WroteAfterLeaving(format!(
                    "{:?} {}/{}/{} in {}",
                    r.verb,
                    r.resource,
                    r.namespace.as_deref().unwrap_or(""),
                    r.name.as_deref().unwrap_or(""),
                    p.server
                )));
            }
            keep.push(p);
        }
        crate::server::put_parked(&self.gate, keep);
    }

    /// The steps possible now.
    fn steps(&self) -> Vec<Step> {
        let mut steps = Vec::new();
        let parked = crate::server::parked_records(&self.gate);
        for (i, (_, record)) in parked.iter().enumerate() {
            steps.push(Step::Release(i));
            if self.budgets.faults > 0 && record.verb.writes() {
                steps.push(Step::Fault(i, 409));
                steps.push(Step::Fault(i, 500));
            }
        }
        for (cluster, events) in &self.pending {
            if !events.is_empty() && self.engaged.contains_key(cluster) {
                steps.push(Step::Deliver(cluster.clone()));
            }
        }
        if self.in_flight.len() < self.checker.concurrency {
            for (i, r) in self.queue.iter().enumerate() {
                if !self.in_flight.iter().any(|f| f.request == *r) {
                    steps.push(Step::Start(i));
                }
            }
        }
        // Retries fire at any time; requeues only early (racing an update), within budget.
        let idle = steps.is_empty();
        for i in 0..self.retries.len() {
            steps.push(Step::Retry(i));
        }
        if !idle && self.budgets.requeues > 0 {
            for i in 0..self.requeues.len() {
                steps.push(Step::Requeue(i));
            }
        }
        if !idle {
            for cluster in self.servers.keys() {
                if self.engaged.contains_key(cluster) {
                    if self.budgets.relists > 0 {
                        steps.push(Step::Relist(cluster.clone()));
                    }
                    let local = self
                        .local
                        .as_ref()
                        .is_some_and(|l| l.id().to_string() == *cluster);
                    if self.budgets.departures > 0 && !local {
                        steps.push(Step::Leave(cluster.clone()));
                    }
                }
            }
        }
        for cluster in self.away.keys() {
            steps.push(Step::Rejoin(cluster.clone()));
        }
        if steps.is_empty() && !self.in_flight.is_empty() {
            steps.push(Step::Wait);
        }
        steps
    }

    /// How a step reads in a trace (`parked`: the requests at the gate, in order).
    fn label(&self, step: &Step, parked: &[(String, crate::server::RequestRecord)]) -> String {
        let request = |i: usize| {
            parked.get(i).map_or_else(String::new, |(server, r)| {
                let ns = r.namespace.as_deref();
                let target = match (ns, r.name.as_deref()) {
                    (Some(ns), Some(name)) => format!("{ns}/{name}"),
                    (None, Some(name)) => name.to_owned(),
                    (Some(ns), None) => format!("in {ns}"),
                    (None, None) => String::new(),
                };
                let sub = r
                    .subresource
                    .as_deref()
                    .map(|s| format!(" ({s})"))
                    .unwrap_or_default();
                format!("{:?} {} {target}{sub} in {server}", r.verb, r.resource)
            })
        };
        match step {
            Step::Deliver(c) => {
                let e = self.pending.get(c).and_then(|q| q.front());
                let what = e.map_or_else(String::new, |e| {
                    format!(
                        "{} {}{}",
                        e.kind,
                        e.object
                            .pointer("/metadata/namespace")
                            .and_then(Value::as_str)
                            .map(|n| format!("{n}/"))
                            .unwrap_or_default(),
                        e.object
                            .pointer("/metadata/name")
                            .and_then(Value::as_str)
                            .unwrap_or("")
                    )
                });
                format!("deliver {c}: {what}")
            }
            Step::Start(i) => format!(
                "reconcile {}",
                self.queue
                    .get(*i)
                    .map(ToString::to_string)
                    .unwrap_or_default()
            ),
            Step::Release(i) => format!("serve {}", request(*i)),
            Step::Fault(i, code) => format!("answer {code} to {}", request(*i)),
            Step::Relist(c) => format!("relist {c}"),
            Step::Leave(c) => format!("{c} leaves"),
            Step::Rejoin(c) => format!("{c} comes back"),
            Step::Requeue(i) => format!(
                "requeue {}",
                self.requeues
                    .get(*i)
                    .map(ToString::to_string)
                    .unwrap_or_default()
            ),
            Step::Retry(i) => format!(
                "retry {}",
                self.retries
                    .get(*i)
                    .map(ToString::to_string)
                    .unwrap_or_default()
            ),
            Step::Wait => "time passes (1 s)".to_owned(),
        }
    }

    fn choose(&mut self, steps: &[Step]) -> Option<Step> {
        // Two steps alike (two reconciles asking the same, say) are told apart by their order,
        // so a script of labels replays the same one.
        let parked = crate::server::parked_records(&self.gate);
        let mut labels: Vec<String> = Vec::with_capacity(steps.len());
        for step in steps {
            let label = self.label(step, &parked);
            let seen = labels
                .iter()
                .filter(|l| l.split(" #").next() == Some(label.as_str()))
                .count();
            labels.push(if seen == 0 {
                label
            } else {
                format!("{label} #{}", seen + 1)
            });
        }
        let at = match &mut self.choices {
            Choices::Random(rng) => rng.usize(..steps.len()),
            Choices::Script(indices, names) => {
                let k = self.taken.len();
                if k < indices.len() {
                    indices[k].min(steps.len() - 1)
                } else {
                    // Named steps, in order; one not possible now is skipped.
                    let mut found = None;
                    while let Some(name) = names.first() {
                        let hit = labels.iter().position(|l| l == name);
                        names.remove(0);
                        if hit.is_some() {
                            found = hit;
                            break;
                        }
                    }
                    found.unwrap_or(0)
                }
            }
        };
        self.taken.push((at, steps.len()));
        self.trace.push(labels[at].clone());
        steps.get(at).cloned()
    }

    async fn take(&mut self, step: Step) {
        match step {
            Step::Deliver(cluster) => {
                let Some(event) = self.pending.get_mut(&cluster).and_then(VecDeque::pop_front)
                else {
                    return;
                };
                for request in self.requests_of(&cluster, &event) {
                    self.enqueue(request);
                }
            }
            Step::Start(i) => {
                let request = self.queue.remove(i);
                self.start(request);
            }
            Step::Release(i) => {
                if let Some(p) = crate::server::take_parked(&self.gate, i) {
                    let _ = p.answer.send(None);
                }
            }
            Step::Fault(i, code) => {
                self.budgets.faults = self.budgets.faults.saturating_sub(1);
                if let Some(p) = crate::server::take_parked(&self.gate, i) {
                    let _ = p.answer.send(Some(code));
                }
            }
            Step::Relist(cluster) => {
                self.budgets.relists = self.budgets.relists.saturating_sub(1);
                self.relist(&cluster);
            }
            Step::Leave(cluster) => {
                self.budgets.departures = self.budgets.departures.saturating_sub(1);
                if let Some(token) = self.engaged.remove(&cluster) {
                    token.cancel();
                }
                if let Ok(id) = C::parse(&cluster) {
                    self.fleet.disengage(&id);
                }
                self.away.insert(cluster.clone(), self.trace.len());
                self.reconcile_all();
                self.pending.remove(&cluster);
                self.queue.retain(|r| r.cluster.to_string() != cluster);
                self.requeues.retain(|r| r.cluster.to_string() != cluster);
                self.retries.retain(|r| r.cluster.to_string() != cluster);
            }
            Step::Rejoin(cluster) => {
                self.engage(&cluster);
                self.reconcile_all();
            }
            Step::Requeue(i) => {
                self.budgets.requeues = self.budgets.requeues.saturating_sub(1);
                let request = self.requeues.remove(i);
                self.enqueue(request);
            }
            Step::Retry(i) => {
                let request = self.retries.remove(i);
                self.enqueue(request);
            }
            Step::Wait => tokio::time::sleep(Duration::from_secs(1)).await,
        }
    }

    /// Queues `request` unless it is queued already (requests coalesce, as in the runtime).
    fn enqueue(&mut self, request: Request<C>) {
        if !self.queue.contains(&request) {
            self.queue.push(request);
        }
    }

    /// With `reconcile_all_on_fleet_events`, every selected primary object of the watched,
    /// engaged clusters is queued.
    fn reconcile_all(&mut self) {
        if !self.checker.on_fleet_events {
            return;
        }
        let primary = self.checker.sources[0].clone();
        let clusters: Vec<String> = self
            .engaged
            .keys()
            .filter(|c| self.watched(c))
            .cloned()
            .collect();
        for cluster in clusters {
            let Some(server) = self.servers.get(&cluster) else {
                continue;
            };
            let Ok(id) = C::parse(&cluster) else { continue };
            for object in server.objects() {
                let labels = object
                    .pointer("/metadata/labels")
                    .and_then(Value::as_object);
                if object["apiVersion"] != *primary.api_version
                    || object["kind"] != *primary.kind
                    || !primary.selector.matches(labels)
                {
                    continue;
                }
                let ns = object
                    .pointer("/metadata/namespace")
                    .and_then(Value::as_str);
                let name = object
                    .pointer("/metadata/name")
                    .and_then(Value::as_str)
                    .unwrap_or_default();
                self.enqueue(Request::new(id.clone(), ns, name));
            }
        }
    }

    /// The requests an event makes.
    fn requests_of(&self, cluster: &str, event: &Event) -> Vec<Request<C>> {
        let mut out = Vec::new();
        for source in self
            .checker
            .sources
            .iter()
            .filter(|s| s.api_version == event.api_version && s.kind == event.kind)
        {
            let labels = event
                .object
                .pointer("/metadata/labels")
                .and_then(Value::as_object);
            if !source.selector.matches(labels) {
                continue;
            }
            match &source.map {
                None if self.watched(cluster) => {
                    let ns = event
                        .object
                        .pointer("/metadata/namespace")
                        .and_then(Value::as_str);
                    let name = event
                        .object
                        .pointer("/metadata/name")
                        .and_then(Value::as_str)
                        .unwrap_or_default();
                    if let Ok(id) = C::parse(cluster) {
                        out.push(Request::new(id, ns, name));
                    }
                }
                None => {}
                Some(map) => out.extend(map(cluster, &event.object)),
            }
        }
        out.retain(|r| self.engaged.contains_key(&r.cluster.to_string()));
        // A cluster-scoped primary kind has no namespace in its requests (an owner reference
        // names no namespace; the child's is not the owner's).
        let primary = &self.checker.sources[0];
        for r in &mut out {
            let server = self.servers.get(&r.cluster.to_string());
            if server.and_then(|s| s.namespaced(&primary.api_version, &primary.kind)) == Some(false)
            {
                r.namespace = None;
            }
        }
        out
    }

    /// Starts the reconcile of `request`, if its object exists and is selected (the runtime
    /// reconciles only what its cache holds).
    fn start(&mut self, request: Request<C>) {
        let cluster = request.cluster.to_string();
        let (Some(server), Some(token)) = (self.servers.get(&cluster), self.engaged.get(&cluster))
        else {
            return;
        };
        let primary = &self.checker.sources[0];
        let Some(value) = server.object(
            &primary.api_version,
            &primary.kind,
            request.namespace.as_deref(),
            &request.name,
        ) else {
            return;
        };
        if !primary
            .selector
            .matches(value.pointer("/metadata/labels").and_then(Value::as_object))
        {
            return;
        }
        let Ok(object) = serde_json::from_value::<K>(value) else {
            return;
        };
        let local = self.local.clone().filter(|l| *l.id() == request.cluster);
        let Some(handle) = local.or_else(|| self.fleet.get(&request.cluster)) else {
            return;
        };
        let ctx = Context::detached(
            request.clone(),
            Arc::new(object.clone()),
            handle,
            &self.fleet,
            self.local.clone(),
            self.state.clone(),
            token.clone(),
        );
        let reconcile = self.checker.reconcile.clone();
        let task = tokio::spawn(reconcile(Arc::new(object), ctx));
        self.in_flight.push(InFlight {
            request,
            started: self.trace.len(),
            task,
        });
    }

    /// The checks of a quiet queue.
    async fn quiet(&mut self) {
        let world = World {
            servers: self.servers.clone(),
            engaged: self.engaged.keys().cloned().collect(),
        };
        if let Some(invariant) = &self.checker.invariant
            && let Err(why) = invariant(&world)
        {
            self.violation = Some(Violation::NotConverged(why));
            return;
        }
        // Idempotence: every selected object of every watched, engaged cluster once more,
        // each request let through at once.
        let before: BTreeMap<String, u64> = self
            .servers
            .iter()
            .map(|(k, s)| (k.clone(), s.resource_version()))
            .collect();
        let primary = self.checker.sources[0].clone();
        let mut wrote = Vec::new();
        let clusters: Vec<String> = self
            .engaged
            .keys()
            .filter(|c| self.watched(c))
            .cloned()
            .collect();
        for cluster in &clusters {
            let Some(server) = self.servers.get(cluster).cloned() else {
                continue;
            };
            for object in server.objects() {
                if object["apiVersion"] != *primary.api_version || object["kind"] != *primary.kind {
                    continue;
                }
                let ns = object
                    .pointer("/metadata/namespace")
                    .and_then(Value::as_str)
                    .map(str::to_owned);
                let name = object
                    .pointer("/metadata/name")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_owned();
                let Ok(id) = C::parse(cluster) else { continue };
                let request = Request::new(id, ns, name);
                let marks: BTreeMap<String, u64> = self
                    .servers
                    .iter()
                    .map(|(k, s)| (k.clone(), s.resource_version()))
                    .collect();
                self.start(request.clone());
                let mut rounds = 0;
                while !self.in_flight.is_empty() {
                    rounds += 1;
                    if rounds > 100_000 {
                        self.violation = Some(Violation::Livelock(rounds));
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    for p in crate::server::lock_parked(&self.gate) {
                        let _ = p.answer.send(None);
                    }
                    self.finish_reconciles().await;
                }
                for (k, s) in &self.servers {
                    if marks.get(k) != Some(&s.resource_version()) {
                        wrote.push(format!("reconcile {request} wrote to {k}"));
                    }
                }
            }
        }
        let after: BTreeMap<String, u64> = self
            .servers
            .iter()
            .map(|(k, s)| (k.clone(), s.resource_version()))
            .collect();
        if before != after && self.violation.is_none() {
            self.violation = Some(Violation::NotIdempotent(wrote.join("; ")));
        }
    }
}
