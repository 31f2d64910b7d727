//! The diagnostics view of a running replica: per cluster and per kind, what its watches,
//! queues, shard and credentials are doing now, as JSON at
//! [`Endpoints`](crate::Endpoints)' `/debug/mcr/fleet`, and rendered by `mcr status`.
//!
//! [`ReplicaView`] is the document; [`ReplicaView::problems`] says what is wrong in the words of
//! the troubleshooting chapter, and [`disagreements`] what two or more replicas' views
//! contradict (who owns a cluster, who holds its fence, who the peers are).
//!
//! The view is taken when asked: the watches' state and the credentials' ends are read from
//! the clusters, and each fleet controller is asked for its queues (it answers from its own
//! loop, so a controller whose loop is stuck is named as not answering).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, oneshot};

use crate::cluster::ClusterId;
use crate::util::sync::lock;

/// The path the endpoints serve the view at.
pub const PATH: &str = "/debug/mcr/fleet";

/// A header the endpoints take a bearer token from when `Authorization` has none: the API
/// server's proxy keeps `Authorization` for itself, so `mcr status` sends the endpoints'
/// token through it in this one.
pub const FORWARDED_AUTHORIZATION: &str = "x-forwarded-authorization";

/// How long the view waits for a controller's queues.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(2);

/// Error texts are cut to this many characters (the logs have them whole).
const MAX_ERROR: usize = 400;

/// One replica's view of its fleet, as of `at`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ReplicaView {
    /// The replica: its sharding or leader election identity, else its host name (a pod's
    /// name).
    pub replica: String,
    /// When the view was taken (RFC 3339).
    pub at: String,
    /// The manager is shutting down.
    pub stopping: bool,
    /// Its controllers run now: it leads, or no leader election is configured.
    pub leading: bool,
    /// Its side of sharding, if the manager is sharded.
    pub shard: Option<ShardView>,
    /// The local cluster (if any) first, then every engaged cluster, then (sharded) every
    /// cluster this replica still holds while handing it over.
    pub clusters: Vec<ClusterView>,
    /// The controllers asked for their queues.
    pub controllers: Vec<ControllerView>,
}

/// A sharded replica's side of the group.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ShardView {
    /// This replica's identity in the group.
    pub identity: String,
    /// The live peers it sees (itself among them while its peer Lease is renewed).
    pub peers: Vec<String>,
    /// How many clusters the provider discovered.
    pub discovered: usize,
    /// The clusters whose fence it holds, with whether each is being handed over.
    pub held: BTreeMap<String, bool>,
}

/// One cluster as the replica sees it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ClusterView {
    /// Its id.
    pub name: String,
    /// `host` for the cluster whose caches decide readiness (the local cluster, if there is
    /// one), `cluster` for the fleet's.
    pub role: String,
    /// Engaged now.
    pub engaged: bool,
    /// Each cache of its current engagement.
    pub watches: Vec<WatchView>,
    /// When its credential ends, if that is known.
    pub credential: Option<CredentialView>,
    /// Who owns it, if the manager is sharded.
    pub shard: Option<ClusterShard>,
    /// Each fleet controller's queue of it.
    pub queues: Vec<QueueView>,
}

/// One cache (watch) of a cluster.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct WatchView {
    /// The kind.
    pub kind: String,
    /// Its watcher configuration (selectors), as text.
    pub config: String,
    /// Its first listing is in.
    pub listed: bool,
    /// Its first listing has taken longer than the cache sync timeout.
    pub overdue: bool,
    /// Why it fails now, if it does.
    pub error: Option<String>,
    /// When its last event came (RFC 3339), if one has.
    pub last_event: Option<String>,
    /// How many of its attempts to list or watch failed since it started.
    pub failures: u64,
}

/// When a cluster's credential ends.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct CredentialView {
    /// Where the end comes from: `token`, `client_certificate`, `exec` or `annotation`.
    pub source: String,
    /// When it ends (RFC 3339).
    pub expires: String,
    /// Seconds left; negative once it has ended.
    pub remaining_seconds: i64,
    /// It ends within the manager's warning lead (`Manager::credential_warning`).
    pub warned: bool,
}

/// Who owns a cluster in a sharded group, as this replica sees it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ClusterShard {
    /// The live peer the assignment gives it to.
    pub owner: Option<String>,
    /// This replica holds its fence.
    pub held_here: bool,
    /// This replica is handing it over (its work is being waited for, then the fence
    /// released).
    pub handing_off: bool,
}

/// A fleet controller's queue of one cluster.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct QueueView {
    /// The controller.
    pub controller: String,
    /// Its primary cache of the cluster has listed.
    pub listed: bool,
    /// Requests ready in the normal lane (changes).
    pub normal: usize,
    /// Requests ready in the low lane (listed objects with no news, resyncs).
    pub low: usize,
    /// Requests waiting for a delay (a requeue, a backoff, the debounce).
    pub scheduled: usize,
    /// Requests waiting for the cluster's cache to list.
    pub parked: usize,
    /// Reconciles running now.
    pub in_flight: usize,
    /// The last reconcile that ended, if one has.
    pub last: Option<LastReconcile>,
}

/// How a reconcile ended.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct LastReconcile {
    /// When it ended (RFC 3339).
    pub at: String,
    /// The object (`namespace/name`).
    pub object: String,
    /// `success`, `requeue_after`, `requeue` (after the object's backoff), `error`, `panic`,
    /// `timeout`, or `dropped` (it did not run to its end: its cluster left, or the tenure
    /// lapsed).
    pub result: String,
    /// Why it failed, if it did (cut to 400 characters).
    pub error: Option<String>,
}

/// A controller asked for its queues.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ControllerView {
    /// Its name.
    pub name: String,
    /// It answered within 2 s (a controller whose loop is blocked does not).
    pub answered: bool,
}

/// Something wrong a view shows, with the troubleshooting chapter's section about it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Problem {
    /// The cluster, if it is one cluster's.
    pub cluster: Option<String>,
    /// What is wrong.
    pub what: String,
    /// The heading of docs/troubleshooting.md that explains it, if one does.
    pub section: Option<&'static str>,
}

/// The troubleshooting chapter's headings the problems point at.
pub mod sections {
    /// A 403 on a kind.
    pub const FORBIDDEN: &str = "A kind is forbidden in one cluster";
    /// A 404 on a kind.
    pub const MISSING_CRD: &str = "A CRD is missing in a cluster";
    /// Connections fail.
    pub const UNREACHABLE: &str = "An API server is unreachable or hung";
    /// An exec plugin fails.
    pub const EXEC: &str = "An exec credential plugin fails";
    /// A listing overdue.
    pub const OVERDUE: &str = "A cache has not listed within the cache sync timeout";
    /// A credential ended or ends soon.
    pub const CREDENTIALS: &str = "A joined cluster's credentials expired or were revoked";
    /// A sharded replica with nothing to do.
    pub const OWNS_NONE: &str = "A replica owns no clusters";
}

/// The section of the troubleshooting chapter a watch's error is about.
fn section_of(error: &str) -> &'static str {
    let lower = error.to_ascii_lowercase();
    if lower.contains("403") || lower.contains("forbidden") {
        sections::FORBIDDEN
    } else if lower.contains("404") || lower.contains("not found") || lower.contains("not served") {
        sections::MISSING_CRD
    } else if lower.contains("exec") || lower.contains("credential plugin") {
        sections::EXEC
    } else {
        sections::UNREACHABLE
    }
}

impl ReplicaView {
    /// What is wrong, cluster by cluster, then with the replica.
    pub fn problems(&self) -> Vec<Problem> {
        let mut problems = Vec::new();
        for cluster in &self.clusters {
            let at = |what: String, section: Option<&'static str>| Problem {
                cluster: Some(cluster.name.clone()),
                what,
                section,
            };
            for watch in &cluster.watches {
                match (&watch.error, watch.listed, watch.overdue) {
                    (Some(error), listed, _) => {
                        let state = if listed { "stale, failing" } else { "failing" };
                        problems.push(at(
                            format!("{} {state}: {error}", watch.kind),
                            Some(section_of(error)),
                        ));
                    }
                    (None, false, true) => problems.push(at(
                        format!("{} not listed within the cache sync timeout", watch.kind),
                        Some(sections::OVERDUE),
                    )),
                    _ => {}
                }
            }
            if let Some(credential) = &cluster.credential {
                if credential.remaining_seconds <= 0 {
                    problems.push(at(
                        format!(
                            "its {} credential ended at {}",
                            credential.source, credential.expires
                        ),
                        Some(sections::CREDENTIALS),
                    ));
                } else if credential.warned {
                    problems.push(at(
                        format!(
                            "its {} credential ends at {} (in {})",
                            credential.source,
                            credential.expires,
                            in_words(credential.remaining_seconds)
                        ),
                        Some(sections::CREDENTIALS),
                    ));
                }
            }
            for queue in &cluster.queues {
                if let Some(last) = &queue.last
                    && matches!(last.result.as_str(), "error" | "panic" | "timeout")
                {
                    let why = last
                        .error
                        .as_deref()
                        .map(|e| format!(": {e}"))
                        .unwrap_or_default();
                    problems.push(at(
                        format!(
                            "controller {}: the last reconcile ({}) ended in {}{why}",
                            queue.controller, last.object, last.result
                        ),
                        None,
                    ));
                }
            }
            if let Some(shard) = &cluster.shard
                && shard.handing_off
            {
                problems.push(at(
                    format!(
                        "being handed over to {}",
                        shard.owner.as_deref().unwrap_or("no live replica")
                    ),
                    None,
                ));
            }
        }
        for controller in &self.controllers {
            if !controller.answered {
                problems.push(Problem {
                    cluster: None,
                    what: format!(
                        "controller {} did not answer within 2 s (its loop is busy or blocked)",
                        controller.name
                    ),
                    section: None,
                });
            }
        }
        if let Some(shard) = &self.shard
            && shard.held.is_empty()
            && shard.discovered > 0
        {
            problems.push(Problem {
                cluster: None,
                what: format!(
                    "holds none of the {} clusters discovered ({} live peers seen)",
                    shard.discovered,
                    shard.peers.len()
                ),
                section: Some(sections::OWNS_NONE),
            });
        }
        if self.stopping {
            problems.push(Problem {
                cluster: None,
                what: "the manager is stopping".into(),
                section: None,
            });
        }
        problems
    }
}

/// Seconds as their largest whole unit: `3d`, `5h`, `12m`, `40s` (what is left of a
/// credential, in `problems` and `mcr status`).
pub fn in_words(seconds: i64) -> String {
    match seconds {
        s if s >= 86_400 => format!("{}d", s / 86_400),
        s if s >= 3_600 => format!("{}h", s / 3_600),
        s if s >= 60 => format!("{}m", s / 60),
        s => format!("{s}s"),
    }
}

/// What the views of several replicas of one group contradict: the peers they see, a cluster
/// whose fence two hold, a cluster each gives to a different owner.
pub fn disagreements(views: &[ReplicaView]) -> Vec<String> {
    let mut found = Vec::new();
    let sharded: Vec<(&str, &ShardView)> = views
        .iter()
        .filter_map(|v| Some((v.replica.as_str(), v.shard.as_ref()?)))
        .collect();
    if let Some((first, first_shard)) = sharded.first() {
        for (replica, shard) in &sharded[1..] {
            if shard.peers != first_shard.peers {
                found.push(format!(
                    "{first} sees the peers [{}], {replica} sees [{}]",
                    first_shard.peers.join(", "),
                    shard.peers.join(", ")
                ));
            }
        }
    }
    let mut holders: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (replica, shard) in &sharded {
        for cluster in shard.held.keys() {
            holders.entry(cluster).or_default().push(replica);
        }
    }
    for (cluster, replicas) in &holders {
        if replicas.len() > 1 {
            found.push(format!(
                "cluster {cluster}: {} each say they hold its fence",
                replicas.join(" and ")
            ));
        }
    }
    let mut owners: BTreeMap<&str, BTreeMap<&str, Vec<&str>>> = BTreeMap::new();
    for view in views {
        for cluster in &view.clusters {
            if let Some(owner) = cluster.shard.as_ref().and_then(|s| s.owner.as_deref()) {
                owners
                    .entry(cluster.name.as_str())
                    .or_default()
                    .entry(owner)
                    .or_default()
                    .push(view.replica.as_str());
            }
        }
    }
    for (cluster, by_owner) in owners {
        if by_owner.len() > 1 {
            let said: Vec<String> = by_owner
                .iter()
                .map(|(owner, replicas)| format!("{} say {owner}", replicas.join(" and ")))
                .collect();
            found.push(format!(
                "cluster {cluster}: the owner differs: {}",
                said.join("; ")
            ));
        }
    }
    found
}

/// A time as RFC 3339 (UTC, seconds).
pub(crate) fn timestamp(at: SystemTime) -> String {
    k8s_openapi::jiff::Timestamp::try_from(at)
        .map(|t| {
            t.round(k8s_openapi::jiff::Unit::Second)
                .unwrap_or(t)
                .to_string()
        })
        .unwrap_or_default()
}

/// An error text for the view, cut to [`MAX_ERROR`] characters (the logs have it whole).
pub(crate) fn cut(text: String) -> String {
    crate::util::cut(text, MAX_ERROR)
}

/// A controller's queues of each cluster, as its loop answers.
pub(crate) type Queues<C> = Vec<(C, QueueView)>;

/// The question a controller's loop answers.
pub(crate) type Ask<C> = oneshot::Sender<Queues<C>>;

/// A controller's name, and where its loop takes questions.
type Registered<C> = (Arc<str>, mpsc::Sender<Ask<C>>);

/// The fleet controllers that answer for their queues, for the view.
pub(crate) struct Controllers<C: ClusterId> {
    registered: Mutex<Vec<Registered<C>>>,
}

impl<C: ClusterId> Default for Controllers<C> {
    fn default() -> Self {
        Self {
            registered: Mutex::new(Vec::new()),
        }
    }
}

impl<C: ClusterId> Controllers<C> {
    /// Registers the controller `name`: its loop answers what comes on the receiver, and is
    /// forgotten once it drops it.
    pub(crate) fn register(&self, name: Arc<str>) -> mpsc::Receiver<Ask<C>> {
        let (tx, rx) = mpsc::channel(4);
        let mut registered = lock(&self.registered);
        registered.retain(|(_, tx)| !tx.is_closed());
        registered.push((name, tx));
        rx
    }

    /// Asks every controller for its queues; each that does not answer within
    /// [`ANSWER_TIMEOUT`] is named so.
    pub(crate) async fn ask(&self) -> Vec<(Arc<str>, Option<Queues<C>>)> {
        let registered: Vec<Registered<C>> = {
            let mut registered = lock(&self.registered);
            registered.retain(|(_, tx)| !tx.is_closed());
            registered.clone()
        };
        let asks = registered.into_iter().map(|(name, tx)| async move {
            let (answer, answered) = oneshot::channel();
            let queues = match tx.try_send(answer) {
                Ok(()) => tokio::time::timeout(ANSWER_TIMEOUT, answered)
                    .await
                    .ok()
                    .and_then(Result::ok),
                Err(_) => None,
            };
            (name, queues)
        });
        futures::future::join_all(asks).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(replica: &str, peers: &[&str], held: &[&str], owners: &[(&str, &str)]) -> ReplicaView {
        ReplicaView {
            replica: replica.into(),
            shard: Some(ShardView {
                identity: replica.into(),
                peers: peers.iter().map(|p| p.to_string()).collect(),
                discovered: 3,
                held: held.iter().map(|c| (c.to_string(), false)).collect(),
            }),
            clusters: owners
                .iter()
                .map(|(cluster, owner)| ClusterView {
                    name: cluster.to_string(),
                    shard: Some(ClusterShard {
                        owner: Some(owner.to_string()),
                        held_here: held.contains(cluster),
                        handing_off: false,
                    }),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn agreeing_replicas_show_no_disagreement_and_contradictions_are_named() {
        let a = view("a", &["a", "b"], &["one"], &[("one", "a")]);
        let b = view("b", &["a", "b"], &["two"], &[("two", "b")]);
        assert_eq!(disagreements(&[a.clone(), b]), Vec::<String>::new());

        let b = view("b", &["b"], &["one", "two"], &[("one", "b"), ("two", "b")]);
        let found = disagreements(&[a, b]);
        assert_eq!(
            found,
            [
                "a sees the peers [a, b], b sees [b]",
                "cluster one: a and b each say they hold its fence",
                "cluster one: the owner differs: a say a; b say b",
            ],
        );
    }

    #[test]
    fn problems_are_put_in_the_troubleshooting_chapters_words() {
        let watch = |kind: &str, error: Option<&str>, listed: bool, overdue: bool| WatchView {
            kind: kind.into(),
            listed,
            overdue,
            error: error.map(str::to_string),
            ..Default::default()
        };
        let view = ReplicaView {
            clusters: vec![ClusterView {
                name: "east".into(),
                watches: vec![
                    watch(
                        "Secret",
                        Some("ApiError: secrets is forbidden (403)"),
                        false,
                        false,
                    ),
                    watch("Widget", Some("ApiError: 404 page not found"), true, false),
                    watch("Pod", Some("connection refused"), false, true),
                    watch("ConfigMap", None, false, true),
                    watch("Service", None, true, false),
                ],
                credential: Some(CredentialView {
                    source: "token".into(),
                    expires: "2026-11-29T00:00:00Z".into(),
                    remaining_seconds: 7_200,
                    warned: true,
                }),
                ..Default::default()
            }],
            controllers: vec![ControllerView {
                name: "stuck".into(),
                answered: false,
            }],
            ..Default::default()
        };
        let problems = view.problems();
        let sections: Vec<Option<&str>> = problems.iter().map(|p| p.section).collect();
        assert_eq!(
            sections,
            [
                Some(sections::FORBIDDEN),
                Some(sections::MISSING_CRD),
                Some(sections::UNREACHABLE),
                Some(sections::OVERDUE),
                Some(sections::CREDENTIALS),
                None,
            ]
        );
        assert_eq!(
            problems[1].what,
            "Widget stale, failing: ApiError: 404 page not found"
        );
        assert_eq!(
            problems[4].what,
            "its token credential ends at 2026-11-29T00:00:00Z (in 2h)"
        );
        assert!(problems[5].what.contains("controller stuck did not answer"));
    }

    #[test]
    fn error_texts_are_cut() {
        assert_eq!(cut("short".into()), "short");
        let text = cut("é".repeat(1000));
        assert_eq!(text.chars().count(), MAX_ERROR + 1);
        assert!(text.ends_with('…'));
    }
}
