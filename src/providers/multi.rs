//! [`Multi`]: several providers composed into one fleet, added and removed at run time.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use tokio_util::sync::CancellationToken;

use crate::cluster::{Cluster, ClusterId, ClusterName};
use crate::fleet::Fleet;
use crate::fleet::{Engaged, FleetEvent};
use crate::provider::{Provider, ProviderError};

/// The default separator between a child provider's name and its cluster's id.
pub const DEFAULT_SEPARATOR: &str = "#";

/// Composes providers: each child is added under a name, and its cluster `c` joins the fleet
/// as `<name><separator><c>` (separator `#` by default). Children can be added and removed
/// while the manager runs; removing one disengages all of its clusters. A child whose run
/// returns an error is reported (naming it), its clusters are paused, and it runs
/// again after a wait (1 s, doubling with each failure in a row up to 60 s); the others
/// carry on.
///
/// Field indexes registered on the manager apply to every child's clusters, once.
///
/// ```
/// use multicluster_runtime::ClusterName;
/// use multicluster_runtime::providers::{Clusters, Multi};
///
/// let multi = Multi::new();
/// multi.add("prod", Clusters::<ClusterName>::new()).unwrap();
/// let name = multi.join("prod", "eu#1");
/// assert_eq!(name, "prod#eu#1");
/// assert_eq!(multi.split(&name), Some(("prod", "eu#1")));
/// ```
#[derive(Clone)]
pub struct Multi {
    separator: Arc<str>,
    inner: Arc<Mutex<Inner>>,
}

struct Inner {
    children: BTreeMap<String, Child>,
    /// The fleet and the shutdown token while the provider runs.
    running: Option<(Fleet<ClusterName>, CancellationToken)>,
    /// The children's tasks of the current run, awaited when it ends.
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

struct Child {
    provider: Arc<dyn ErasedProvider>,
    /// Stops this child; a child of the run's shutdown token once running.
    token: Option<CancellationToken>,
}

/// Why [`Multi::add`] refused a child.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum MultiError {
    /// A child of that name exists.
    #[error("a provider named {0:?} is already added")]
    Duplicate(String),
    /// The name is empty, contains the separator, or ends in a way that runs into the
    /// separator (`a#` with `##`): its clusters' names could not be split back.
    #[error(
        "provider name {name:?} must be non-empty and must neither contain the separator {separator:?} nor end with the start of it"
    )]
    InvalidName {
        /// The name given.
        name: String,
        /// The separator in use.
        separator: String,
    },
}

impl Default for Multi {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for Multi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Multi")
            .field("separator", &self.separator)
            .field("children", &self.lock().children.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl Multi {
    /// No children yet, separator `#`.
    pub fn new() -> Self {
        Self::with_separator(DEFAULT_SEPARATOR)
    }

    /// No children yet, with another separator. An empty separator is replaced by the
    /// default, since names could not be split.
    pub fn with_separator(separator: &str) -> Self {
        let separator = if separator.is_empty() {
            DEFAULT_SEPARATOR
        } else {
            separator
        };
        Self {
            separator: Arc::from(separator),
            inner: Arc::new(Mutex::new(Inner {
                children: BTreeMap::new(),
                running: None,
                tasks: Vec::new(),
            })),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        crate::util::sync::lock(&self.inner)
    }

    /// The separator between a child's name and its cluster's id.
    pub fn separator(&self) -> &str {
        &self.separator
    }

    /// Whether `name` can name a child: non-empty, and the first separator in
    /// `<name><separator><cluster>` is the one after `name`, whatever the cluster's id (so
    /// the name neither contains the separator nor ends with a prefix of it that, followed
    /// by the separator, would form one earlier).
    pub fn accepts_name(&self, name: &str) -> bool {
        // An earlier separator would start inside `name`, so it would end within
        // `<name><separator>`: checking that string is enough.
        !name.is_empty()
            && format!("{name}{}", self.separator).find(&*self.separator) == Some(name.len())
    }

    /// The fleet name of cluster `cluster` of child `provider`.
    pub fn join(&self, provider: &str, cluster: &str) -> ClusterName {
        ClusterName::from(format!("{provider}{}{cluster}", self.separator))
    }

    /// The child provider's name and the cluster's own id, from a fleet name this provider
    /// made; `None` for any other name. Child names never contain the separator, so the
    /// first separator is the boundary and the cluster part may contain separators too.
    pub fn split<'a>(&self, name: &'a ClusterName) -> Option<(&'a str, &'a str)> {
        name.as_str().split_once(&*self.separator)
    }

    /// Adds a child provider under `name`. While the manager runs, the child starts at once.
    pub fn add<P: Provider>(&self, name: &str, provider: P) -> Result<(), MultiError> {
        if !self.accepts_name(name) {
            return Err(MultiError::InvalidName {
                name: name.to_string(),
                separator: self.separator.to_string(),
            });
        }
        let mut inner = self.lock();
        if inner.children.contains_key(name) {
            return Err(MultiError::Duplicate(name.to_string()));
        }
        let mut child = Child {
            provider: Arc::new(Wrapped(provider)),
            token: None,
        };
        if let Some((fleet, shutdown)) = &inner.running {
            let (token, task) = self.start(name, &child.provider, fleet, shutdown);
            child.token = Some(token);
            inner.tasks.retain(|t| !t.is_finished());
            inner.tasks.push(task);
        }
        inner.children.insert(name.to_string(), child);
        Ok(())
    }

    /// Removes the child `name`: it stops and all of its clusters are disengaged. Returns
    /// whether there was such a child.
    pub fn remove(&self, name: &str) -> bool {
        let (child, fleet) = {
            let mut inner = self.lock();
            let fleet = inner.running.as_ref().map(|(fleet, _)| fleet.clone());
            (inner.children.remove(name), fleet)
        };
        let Some(child) = child else { return false };
        if let Some(token) = child.token {
            token.cancel();
        }
        // Disengage now rather than when the child's task gets to it, so that the caller
        // sees the fleet without them on return.
        if let Some(fleet) = fleet {
            disengage_prefixed(&fleet, &format!("{name}{}", self.separator));
        }
        true
    }

    /// The names of the children, in order.
    pub fn names(&self) -> Vec<String> {
        self.lock().children.keys().cloned().collect()
    }

    fn start(
        &self,
        name: &str,
        provider: &Arc<dyn ErasedProvider>,
        fleet: &Fleet<ClusterName>,
        shutdown: &CancellationToken,
    ) -> (CancellationToken, tokio::task::JoinHandle<()>) {
        let token = shutdown.child_token();
        let prefix = format!("{name}{}", self.separator);
        let task = tokio::spawn(provider.clone().run(
            fleet.clone(),
            name.to_string(),
            prefix,
            token.clone(),
        ));
        (token, task)
    }
}

impl Provider for Multi {
    type Id = ClusterName;

    async fn run(
        &self,
        fleet: Fleet<ClusterName>,
        shutdown: CancellationToken,
    ) -> Result<(), ProviderError> {
        {
            let mut inner = self.lock();
            let mut tokens = Vec::new();
            for (name, child) in &inner.children {
                tokens.push((
                    name.clone(),
                    self.start(name, &child.provider, &fleet, &shutdown),
                ));
            }
            for (name, (token, task)) in tokens {
                if let Some(child) = inner.children.get_mut(&name) {
                    child.token = Some(token);
                }
                inner.tasks.push(task);
            }
            inner.running = Some((fleet, shutdown.clone()));
        }
        shutdown.cancelled().await;
        let tasks = {
            let mut inner = self.lock();
            inner.running = None;
            for child in inner.children.values_mut() {
                child.token = None;
            }
            std::mem::take(&mut inner.tasks)
        };
        // The children wind down (each disengages what it engaged) before the run returns.
        for task in tasks {
            let _ = task.await;
        }
        Ok(())
    }
}

/// Disengages for good every cluster (engaged or paused) whose name starts with `prefix`.
fn disengage_prefixed(fleet: &Fleet<ClusterName>, prefix: &str) {
    for id in fleet.ids().into_iter().chain(fleet.paused_ids()) {
        if id.as_str().starts_with(prefix) {
            fleet.disengage(&id);
        }
    }
}

/// A child provider of any id type.
trait ErasedProvider: Send + Sync {
    /// Runs the child until `token` is cancelled (or it fails), mirroring its clusters into
    /// `parent` under `prefix`, and disengages them at the end.
    fn run(
        self: Arc<Self>,
        parent: Fleet<ClusterName>,
        name: String,
        prefix: String,
        token: CancellationToken,
    ) -> BoxFuture<'static, ()>;
}

struct Wrapped<P>(P);

/// The first wait before a failed child runs again; it doubles with each failure in a
/// row, up to [`MAX_RESTART_DELAY`].
const RESTART_DELAY: Duration = Duration::from_secs(1);
/// The longest wait before a failed child runs again.
const MAX_RESTART_DELAY: Duration = Duration::from_secs(60);
/// A run at least this long counts as healthy: the next failure waits [`RESTART_DELAY`].
const HEALTHY_RUN: Duration = Duration::from_secs(60);

impl<P: Provider> ErasedProvider for Wrapped<P> {
    fn run(
        self: Arc<Self>,
        parent: Fleet<ClusterName>,
        name: String,
        prefix: String,
        token: CancellationToken,
    ) -> BoxFuture<'static, ()> {
        async move {
            // Cancelled when this task ends: disengages exactly the clusters it engaged in
            // the parent, not those of a child added again under the same name meanwhile.
            let engagements = CancellationToken::new();
            let _disengage_on_exit = engagements.clone().drop_guard();
            let mut failures: u32 = 0;
            loop {
                let started = tokio::time::Instant::now();
                let own = Fleet::<P::Id>::new();
                let mut events = own.subscribe();
                // The parent's clusters this run engaged, by name.
                let mut mirrored = Mirrored::new();
                let mut run = std::pin::pin!(self.0.run(own.clone(), token.clone()));
                let failure = loop {
                    tokio::select! {
                        result = &mut run => {
                            match result {
                                Ok(()) if token.is_cancelled() => {}
                                // A provider may engage its clusters and return; they stay.
                                Ok(()) => {
                                    while let Ok(event) = events.try_recv() {
                                        forward(&parent, &prefix, &engagements, &mut mirrored, event);
                                    }
                                    token.cancelled().await;
                                }
                                Err(error) => break Some(error),
                            }
                            break None;
                        }
                        // Once removed, the child engages nothing more in the parent.
                        Some(event) = events.recv(), if !token.is_cancelled() => {
                            forward(&parent, &prefix, &engagements, &mut mirrored, event);
                        }
                    }
                };
                own.clear();
                let Some(error) = failure else { return };
                // Its clusters are paused with the failed run (a provider failing is not its
                // clusters leaving); the next run engages them again.
                for cluster in mirrored.values() {
                    parent.pause_instance(cluster);
                }
                failures = if started.elapsed() >= HEALTHY_RUN {
                    1
                } else {
                    failures.saturating_add(1)
                };
                let wait = RESTART_DELAY
                    .saturating_mul(1 << (failures - 1).min(16))
                    .min(MAX_RESTART_DELAY);
                tracing::error!(provider = %name, %error, failures, restart_in = ?wait, "provider failed; its clusters are disengaged until it runs again");
                tokio::select! {
                    () = token.cancelled() => return,
                    () = tokio::time::sleep(wait) => {}
                }
                tracing::info!(provider = %name, "provider restarting");
            }
        }
        .boxed()
    }
}

/// The parent's clusters a child's run engaged, by their names in the parent.
type Mirrored = BTreeMap<ClusterName, Cluster<ClusterName>>;

/// Mirrors one change of a child's fleet into the parent fleet. A disengagement removes
/// the cluster this child engaged under that name, never one engaged since by another
/// child of the same name.
fn forward<C: ClusterId>(
    parent: &Fleet<ClusterName>,
    prefix: &str,
    engagements: &CancellationToken,
    mirrored: &mut Mirrored,
    event: FleetEvent<C>,
) {
    match event {
        FleetEvent::Engaged(engaged) | FleetEvent::Replaced { new: engaged, .. } => {
            let cluster = engaged.cluster;
            let name = ClusterName::from(format!("{prefix}{}", cluster.id()));
            // The same client, config (so that an unchanged re-engagement stays a no-op in
            // the parent too) and watch source (a namespace-cluster keeps sharing its
            // host's watches).
            let renamed = cluster.renamed(name.clone());
            match parent.engage_until(renamed.clone(), engagements.clone()) {
                Ok(Engaged::New | Engaged::Replaced) => {
                    mirrored.insert(name, renamed);
                }
                Ok(Engaged::Unchanged) => {}
                Err(error) => tracing::warn!(cluster = %name, %error, "could not engage"),
            }
        }
        // Paused in the parent, as the child's cluster may be only paused: a `Departed`
        // follows when it left for good.
        FleetEvent::Disengaged(engaged) => {
            let name = ClusterName::from(format!("{prefix}{}", engaged.id()));
            if let Some(cluster) = mirrored.get(&name) {
                parent.pause_instance(cluster);
            }
        }
        FleetEvent::Departed(cluster) => {
            let name = ClusterName::from(format!("{prefix}{}", cluster.id()));
            if let Some(cluster) = mirrored.remove(&name) {
                parent.disengage_instance(&cluster);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::Cluster;
    use crate::providers::Clusters;

    fn cluster(name: &str, port: u16) -> Cluster<ClusterName> {
        let config = kube::Config::new(format!("https://127.0.0.1:{port}").parse().unwrap());
        Cluster::from_config(ClusterName::from(name), config).unwrap()
    }

    /// `multi` running in a task, into a fleet of its own, until the token is cancelled.
    fn running(
        multi: &Multi,
    ) -> (
        Fleet<ClusterName>,
        CancellationToken,
        tokio::task::JoinHandle<()>,
    ) {
        let (fleet, shutdown) = (Fleet::new(), CancellationToken::new());
        let run = tokio::spawn({
            let (multi, fleet, shutdown) = (multi.clone(), fleet.clone(), shutdown.clone());
            async move { multi.run(fleet, shutdown).await.unwrap() }
        });
        (fleet, shutdown, run)
    }

    async fn settle() {
        for _ in 0..20 {
            tokio::task::yield_now().await;
        }
    }

    #[test]
    fn names_split_back_even_when_the_cluster_part_holds_the_separator() {
        let multi = Multi::with_separator("::");
        for (p, c) in [("a", "b"), ("a", "b::c"), ("a", ""), ("x", "::")] {
            let joined = multi.join(p, c);
            assert_eq!(multi.split(&joined), Some((p, c)));
        }
        assert_eq!(multi.split(&ClusterName::from("plain")), None);
        assert!(matches!(
            multi.add("a::b", Clusters::<ClusterName>::new()),
            Err(MultiError::InvalidName { .. })
        ));
        assert!(matches!(
            multi.add("", Clusters::<ClusterName>::new()),
            Err(MultiError::InvalidName { .. })
        ));
        // Found by fuzzing: "a:" joined with "::" reads "a:::x", whose first "::" comes one
        // character early.
        assert_eq!(multi.split(&multi.join("a:", "x")), Some(("a", ":x")));
        assert!(!multi.accepts_name("a:"));
        assert!(matches!(
            multi.add("a:", Clusters::<ClusterName>::new()),
            Err(MultiError::InvalidName { .. })
        ));
        assert!(multi.accepts_name(":a"));
        assert_eq!(multi.split(&multi.join(":a", "x")), Some((":a", "x")));
        multi.add("a", Clusters::<ClusterName>::new()).unwrap();
        assert_eq!(
            multi.add("a", Clusters::<ClusterName>::new()),
            Err(MultiError::Duplicate("a".into()))
        );
    }

    #[tokio::test]
    async fn children_added_before_and_during_the_run_mirror_their_clusters_and_leave_with_them() {
        let multi = Multi::new();
        let first = Clusters::new();
        first.add(cluster("x", 1)).unwrap();
        multi.add("first", first.clone()).unwrap();
        let (fleet, shutdown, run) = running(&multi);
        settle().await;
        assert_eq!(fleet.ids(), [ClusterName::from("first#x")]);

        // The same child id in another child does not collide.
        let second = Clusters::new();
        second.add(cluster("x", 2)).unwrap();
        multi.add("second", second.clone()).unwrap();
        settle().await;
        assert_eq!(fleet.ids(), ["first#x", "second#x"].map(ClusterName::from));

        // Changes inside a child are mirrored.
        second.add(cluster("y", 3)).unwrap();
        first.remove(&ClusterName::from("x"));
        settle().await;
        assert_eq!(fleet.ids(), ["second#x", "second#y"].map(ClusterName::from));

        assert!(multi.remove("second"));
        assert!(
            fleet.is_empty(),
            "removing a child disengages its clusters at once"
        );
        assert!(!multi.remove("second"));

        shutdown.cancel();
        run.await.unwrap();
    }

    #[tokio::test]
    async fn a_child_removed_and_added_again_at_once_keeps_its_new_clusters() {
        let multi = Multi::new();
        let old = Clusters::new();
        old.add(cluster("x", 1)).unwrap();
        multi.add("a", old).unwrap();
        let (fleet, shutdown, run) = running(&multi);
        settle().await;
        assert_eq!(fleet.ids(), [ClusterName::from("a#x")]);

        // Found in review: the old child's task, ending after the new child engaged, used
        // to disengage everything named `a#...`, the new child's clusters included.
        assert!(multi.remove("a"));
        let new = Clusters::new();
        new.add(cluster("x", 2)).unwrap();
        new.add(cluster("y", 3)).unwrap();
        multi.add("a", new).unwrap();
        settle().await;
        settle().await;
        assert_eq!(fleet.ids(), ["a#x", "a#y"].map(ClusterName::from));
        let x = fleet.get(&ClusterName::from("a#x")).unwrap();
        assert_eq!(
            x.config().map(|c| c.cluster_url.port_u16()),
            Some(Some(2)),
            "the new child's a#x"
        );

        shutdown.cancel();
        run.await.unwrap();
    }

    /// Engages `x` and fails, `failures` times; then engages `x` and runs until shut down.
    /// Records when each run started.
    struct Flaky {
        failures: usize,
        starts: Arc<Mutex<Vec<tokio::time::Instant>>>,
    }

    impl Provider for Flaky {
        type Id = ClusterName;

        async fn run(
            &self,
            fleet: Fleet<ClusterName>,
            shutdown: CancellationToken,
        ) -> Result<(), ProviderError> {
            let run = {
                let mut starts = self.starts.lock().unwrap();
                starts.push(tokio::time::Instant::now());
                starts.len()
            };
            fleet.engage(cluster("x", 1)).unwrap();
            if run <= self.failures {
                tokio::task::yield_now().await;
                return Err(ProviderError::from(format!("run {run} fails")));
            }
            shutdown.cancelled().await;
            Ok(())
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_child_runs_again_after_growing_waits_and_its_clusters_return() {
        let starts = Arc::new(Mutex::new(Vec::new()));
        let multi = Multi::new();
        multi
            .add(
                "flaky",
                Flaky {
                    failures: 3,
                    starts: starts.clone(),
                },
            )
            .unwrap();
        let (fleet, shutdown, run) = running(&multi);
        // The fourth run's cluster joins (a failed run's leaves before the next run starts).
        let deadline = tokio::time::Instant::now() + Duration::from_secs(600);
        while starts.lock().unwrap().len() < 4 || fleet.ids() != [ClusterName::from("flaky#x")] {
            assert!(tokio::time::Instant::now() < deadline, "never ran again");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(multi.names(), ["flaky"]);
        let starts = starts.lock().unwrap().clone();
        let waits: Vec<Duration> = starts.windows(2).map(|w| w[1] - w[0]).collect();
        assert_eq!(
            waits,
            [1, 2, 4].map(Duration::from_secs),
            "waits double between failures"
        );
        shutdown.cancel();
        run.await.unwrap();
    }

    #[tokio::test]
    async fn a_disengagement_from_a_removed_child_leaves_the_new_childs_cluster_alone() {
        // The old child's task may still forward an event after `remove` and `add`: it must
        // not take the new child's cluster of the same name with it.
        let parent = Fleet::new();
        let engagements = CancellationToken::new();
        let old_child = Fleet::<ClusterName>::new();
        let mut old_events = old_child.subscribe();
        let mut old_mirrored = Mirrored::new();
        old_child.engage(cluster("x", 1)).unwrap();
        let engaged = old_events.try_recv().unwrap();
        forward(&parent, "a#", &engagements, &mut old_mirrored, engaged);
        assert_eq!(parent.ids(), [ClusterName::from("a#x")]);

        // Removed and added again: the new child engages a#x, elsewhere.
        parent.disengage(&ClusterName::from("a#x"));
        let new_cluster = cluster("a#x", 2);
        parent.engage(new_cluster.clone()).unwrap();

        // The old child's late disengagement of x.
        old_child.disengage(&ClusterName::from("x"));
        let disengaged = old_events.try_recv().unwrap();
        assert!(matches!(disengaged, FleetEvent::Disengaged(_)));
        forward(&parent, "a#", &engagements, &mut old_mirrored, disengaged);
        assert!(
            parent
                .get(&ClusterName::from("a#x"))
                .is_some_and(|c| c.same_instance(&new_cluster)),
            "the new child's a#x stays"
        );
    }
}
