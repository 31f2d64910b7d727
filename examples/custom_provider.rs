//! A provider of your own: one cluster per kubeconfig file in a directory, the file's name
//! (without `.yaml`) as the cluster's name. The book's "Writing your own" (docs/providers.md)
//! shows the provider part of this file.
//!
//! It behaves as a provider must when other people write its input:
//! - a file it cannot use (half written, not a kubeconfig, a credential plugin that fails)
//!   is reported once and keeps its cluster as it was; only a file that is gone removes it;
//! - files are read, and clients built (where exec credential plugins run), off the async
//!   workers, and a build that does not return in time is given up;
//! - nothing stops the provider but shutdown: one bad file, a failed engagement or a
//!   directory that cannot be read is reported and retried at the next poll.
//!
//! Run against local control planes, it checks all of that itself and exits:
//!
//! ```sh
//! bash scripts/example.sh custom_provider
//! ```

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, ObjectMeta, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use multicluster_runtime::{
    Action, Builder, Cluster, ClusterId, ClusterName, Context, Fleet, Manager, Provider,
    ProviderError, watcher,
};
use multicluster_runtime_testenv::TestEnv;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

// ANCHOR: provider
/// One cluster per `*.yaml` kubeconfig file in a directory, polled.
struct Directory {
    dir: PathBuf,
    every: Duration,
    /// When a file that could not be used is tried again, if it does not change before.
    retry: Duration,
    /// How long building one client may take (an exec credential plugin runs then).
    build_timeout: Duration,
    /// Polls completed, for anyone who waits for the provider to have seen a change.
    polls: Arc<AtomicU64>,
}

/// What the provider knows of one file.
#[derive(Default)]
struct Known {
    /// The bytes of the last poll: a file is used once it is the same two polls in a row (a
    /// writer may be half-way through it).
    seen: Vec<u8>,
    /// The bytes it last tried: an unchanged file is not built again, and not reported again.
    tried: Option<Vec<u8>>,
    /// For bytes that gave no cluster, when to try them again (a credential plugin may work
    /// later); `None` once they gave an engaged cluster.
    retry_at: Option<Instant>,
    /// A build that did not finish in time and still holds its thread: no other starts
    /// for this file until it ends.
    stuck: Option<tokio::task::JoinHandle<Result<Cluster<ClusterName>, &'static str>>>,
}

impl Directory {
    fn new(dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: dir.into(),
            every: Duration::from_secs(5),
            retry: Duration::from_secs(60),
            build_timeout: Duration::from_secs(30),
            polls: Arc::default(),
        }
    }
}

impl Provider for Directory {
    type Id = ClusterName;

    async fn run(
        &self,
        fleet: Fleet<ClusterName>,
        shutdown: CancellationToken,
    ) -> Result<(), ProviderError> {
        let mut known: BTreeMap<ClusterName, Known> = BTreeMap::new();
        loop {
            // Reading files blocks: off the async workers.
            let dir = self.dir.clone();
            match tokio::task::spawn_blocking(move || read_kubeconfigs(&dir)).await {
                Ok(Ok(files)) => {
                    for (name, file) in &files {
                        let known = known.entry(name.clone()).or_default();
                        let content = match file {
                            Ok(content) => content,
                            Err(error) => {
                                // Unreadable: its cluster stays as it was.
                                tracing::warn!(cluster = %name, %error, "kubeconfig unreadable");
                                continue;
                            }
                        };
                        let settled = known.seen == *content;
                        known.seen.clone_from(content);
                        let tried = known.tried.as_ref() == Some(content);
                        let due = known.retry_at.is_some_and(|at| Instant::now() >= at);
                        if !settled || (tried && !due) {
                            continue;
                        }
                        if known
                            .stuck
                            .as_ref()
                            .is_some_and(|build| !build.is_finished())
                        {
                            continue;
                        }
                        known.tried = Some(content.clone());
                        known.retry_at = match self.build(name, content, &mut known.stuck).await {
                            Ok(cluster) => match fleet.engage(cluster) {
                                Ok(_) => None,
                                Err(error) => {
                                    if !tried {
                                        tracing::warn!(cluster = %name, %error, "not engaged");
                                    }
                                    Some(Instant::now() + self.every)
                                }
                            },
                            Err(problem) => {
                                // Its cluster, if it has one, stays as it was. Reported once
                                // per content.
                                if !tried {
                                    tracing::warn!(cluster = %name, problem, "kubeconfig unusable");
                                }
                                Some(Instant::now() + self.retry)
                            }
                        };
                    }
                    // Only a file that is gone takes its cluster away.
                    known.retain(|name, _| files.contains_key(name));
                    for id in fleet.ids() {
                        if !files.contains_key(&id) {
                            fleet.disengage(&id);
                        }
                    }
                }
                Ok(Err(error)) => {
                    tracing::warn!(dir = %self.dir.display(), %error, "cannot read the directory; clusters stay as they were");
                }
                Err(error) => tracing::warn!(%error, "the directory read did not finish"),
            }
            self.polls.fetch_add(1, Ordering::SeqCst);
            tokio::select! {
                () = shutdown.cancelled() => return Ok(()),
                () = tokio::time::sleep(self.every) => {}
            }
        }
    }
}

impl Directory {
    /// The cluster a kubeconfig describes: parsed on a blocking thread (reading the files it
    /// names), then with its exec credential plugin's first credentials in (the crate runs
    /// the plugin as a child process, killed after 30 s), all bounded in time; a build that
    /// does not finish is left in `stuck`. The error is in words of its own: the parsers'
    /// messages can quote the file, and a kubeconfig holds credentials.
    async fn build(
        &self,
        name: &ClusterName,
        content: &[u8],
        stuck: &mut Option<tokio::task::JoinHandle<Result<Cluster<ClusterName>, &'static str>>>,
    ) -> Result<Cluster<ClusterName>, &'static str> {
        let (id, content) = (name.clone(), content.to_vec());
        let runtime = tokio::runtime::Handle::current();
        let parse = move || {
            let text = std::str::from_utf8(&content).map_err(|_| "not UTF-8")?;
            let kubeconfig =
                Kubeconfig::from_yaml(text).map_err(|_| "not a kubeconfig (cut short?)")?;
            // kube makes an anonymous client of a context whose user is missing: a file cut
            // short before its user's credentials would replace a working cluster.
            if !has_credentials(&kubeconfig) {
                return Err("its context's user has no credentials (cut short?)");
            }
            let options = KubeConfigOptions::default();
            let config = runtime
                .block_on(kube::Config::from_custom_kubeconfig(kubeconfig, &options))
                .map_err(|_| "no usable current context (cut short?)")?;
            // The crate's client errors hold no plugin output; still, a fixed phrase is enough.
            Cluster::from_config(id, config).map_err(|_| "its credentials do not give a client")
        };
        let mut build = tokio::spawn(async move {
            let cluster = tokio::task::spawn_blocking(parse)
                .await
                .map_err(|_| "building its client panicked")??;
            // A cluster whose plugin fails or hangs is not engaged: its every request would
            // fail or wait.
            cluster
                .credentials_ready()
                .await
                .map_err(|_| "its credential plugin gave no credentials")?;
            Ok(cluster)
        });
        match tokio::time::timeout(self.build_timeout, &mut build).await {
            Ok(Ok(built)) => built,
            Ok(Err(_)) => Err("building its client panicked"),
            Err(_) => {
                *stuck = Some(build);
                Err("building its client did not finish in time (a hung credential plugin?)")
            }
        }
    }
}

/// Whether the current context names a user that is defined and has a credential.
fn has_credentials(kubeconfig: &Kubeconfig) -> bool {
    let Some(context) = kubeconfig.current_context.as_deref().and_then(|current| {
        kubeconfig
            .contexts
            .iter()
            .find(|c| c.name == current)
            .and_then(|c| c.context.as_ref())
    }) else {
        return false;
    };
    let Some(user) = context.user.as_deref() else {
        return false;
    };
    kubeconfig
        .auth_infos
        .iter()
        .find(|u| u.name == user)
        .and_then(|u| u.auth_info.as_ref())
        .is_some_and(|u| {
            u.token.is_some()
                || u.token_file.is_some()
                || u.exec.is_some()
                || u.auth_provider.is_some()
                || u.username.is_some()
                || (u.client_certificate_data.is_some() || u.client_certificate.is_some())
                    && (u.client_key_data.is_some() || u.client_key.is_some())
        })
}

/// Every `*.yaml` file of `dir`: the cluster name and the content, or why it could not be
/// read (that file only: the others go on).
type Files = BTreeMap<ClusterName, Result<Vec<u8>, String>>;

fn read_kubeconfigs(dir: &Path) -> std::io::Result<Files> {
    let mut files = BTreeMap::new();
    for entry in std::fs::read_dir(dir)? {
        let Ok(entry) = entry else { continue };
        let path = entry.path();
        let (Some(stem), Some("yaml")) = (
            path.file_stem().and_then(|s| s.to_str()),
            path.extension().and_then(|e| e.to_str()),
        ) else {
            continue;
        };
        match std::fs::read(&path) {
            Ok(content) => {
                files.insert(ClusterName::from(stem), Ok(content));
            }
            // Removed between the listing and the read: simply not there.
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
            Err(error) => {
                files.insert(ClusterName::from(stem), Err(error.kind().to_string()));
            }
        }
    }
    Ok(files)
}
// ANCHOR_END: provider

// --- The check: the provider above against local control planes ---------------------------

#[derive(Debug, thiserror::Error)]
#[error("kube: {0}")]
struct Error(#[from] kube::Error);

async fn reconcile<C: ClusterId>(
    _: Arc<ConfigMap>,
    ctx: Context<C, mpsc::UnboundedSender<String>>,
) -> Result<Action, Error> {
    let _ = ctx.state().send(ctx.request().to_string());
    Ok(Action::await_change())
}

fn error_policy<C: ClusterId>(
    _: Arc<ConfigMap>,
    error: &Error,
    ctx: &Context<C, mpsc::UnboundedSender<String>>,
) -> Action {
    eprintln!("{} failed: {error}", ctx.request());
    Action::backoff()
}

type Check = Result<(), Box<dyn std::error::Error>>;

/// A kubeconfig as kubectl orders one (users last), cut short inside its user: every context
/// is there, the credentials are not.
fn cut_inside_users(full: &str) -> Result<String, Box<dyn std::error::Error>> {
    let users = full.find("\nusers:").ok_or("no users")? + 1;
    let contexts = full.find("\ncontexts:").ok_or("no contexts")? + 1;
    let (head, user_block, tail) = (&full[..users], &full[users..contexts], &full[contexts..]);
    let cut = user_block.find("  user:\n").ok_or("no user")? + "  user:\n".len();
    Ok(format!("{head}{tail}{}", &user_block[..cut]))
}

/// Waits until `done` holds, polling; fails after 60 s.
async fn wait_for(what: &str, mut done: impl FnMut() -> bool) -> Check {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !done() {
        if Instant::now() > deadline {
            return Err(format!("timed out waiting for {what}").into());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

/// Creates ConfigMap `name` in `cluster` and waits until the controller reconciles it.
async fn create_and_see(
    client: kube::Client,
    cluster: &str,
    name: &str,
    seen: &mut mpsc::UnboundedReceiver<String>,
) -> Check {
    let cm = ConfigMap {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..Default::default()
        },
        ..Default::default()
    };
    Api::<ConfigMap>::namespaced(client, "default")
        .create(&PostParams::default(), &cm)
        .await?;
    let want = format!("cluster://{cluster}/default/{name}");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        match tokio::time::timeout_at(deadline, seen.recv()).await {
            Ok(Some(request)) if request == want => return Ok(()),
            Ok(Some(_)) => {}
            Ok(None) => return Err("the controller stopped".into()),
            Err(_) => return Err(format!("{want} was not reconciled").into()),
        }
    }
}

#[tokio::main]
async fn main() -> Check {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .init();
    let env = TestEnv::builder().clusters(2).start().await?;
    let (c0, c1) = (
        env.cluster(0).ok_or("no cluster-0")?,
        env.cluster(1).ok_or("no cluster-1")?,
    );
    let dir = tempfile::tempdir()?;
    let write = |name: &str, content: &str| {
        std::fs::write(dir.path().join(format!("{name}.yaml")), content)
    };

    let provider = Directory {
        every: Duration::from_millis(100),
        build_timeout: Duration::from_secs(2),
        ..Directory::new(dir.path())
    };
    let polls = provider.polls.clone();
    // A sync point: two polls after this call began, the provider has read the directory as
    // it was when the call began.
    let polled = || {
        let start = polls.load(Ordering::SeqCst);
        let polls = polls.clone();
        move || polls.load(Ordering::SeqCst) >= start + 2
    };
    let manager = Arc::new(Manager::new(provider));
    let (reconciled, mut seen) = mpsc::unbounded_channel();
    Builder::<_, ConfigMap>::new(&manager, watcher::Config::default())
        .named("custom-provider")
        .start(reconcile, error_policy, Arc::new(reconciled));
    let run = tokio::spawn({
        let manager = manager.clone();
        async move { manager.run().await }
    });
    let ids = || -> BTreeSet<String> {
        manager
            .fleet()
            .ids()
            .iter()
            .map(ToString::to_string)
            .collect()
    };

    println!("two kubeconfig files: east and west");
    write("east", c0.kubeconfig())?;
    write("west", c1.kubeconfig())?;
    create_and_see(c0.client()?, "east", "one", &mut seen).await?;
    create_and_see(c1.client()?, "west", "one", &mut seen).await?;
    println!("  both engaged and reconciled");

    println!("west's file half written, and a file that is not a kubeconfig");
    let full = c1.kubeconfig().to_string();
    write("west", &full[..full.len() / 2])?;
    write("junk", "{ this is not: [ yaml")?;
    wait_for("the provider to read them", polled()).await?;
    if !ids().contains("west") {
        return Err("a half-written file disengaged its cluster".into());
    }
    if ids().contains("junk") {
        return Err("a file that is not a kubeconfig was engaged".into());
    }
    create_and_see(c1.client()?, "west", "two", &mut seen).await?;
    println!("  west stays engaged and reconciled; junk is reported, not engaged");

    println!("west's file written as kubectl orders one (users last), cut inside its user");
    write("west", &cut_inside_users(&full)?)?;
    wait_for("the provider to read it", polled()).await?;
    create_and_see(c1.client()?, "west", "three", &mut seen).await?;
    println!("  west keeps its credentials, not an anonymous client");

    println!("a credential plugin that hangs, beside the others");
    let mut hung = Kubeconfig::from_yaml(c0.kubeconfig())?;
    for named in &mut hung.auth_infos {
        if let Some(user) = named.auth_info.as_mut() {
            user.client_certificate_data = None;
            user.client_key = None;
            user.client_key_data = None;
            user.exec = Some(serde_json::from_value(serde_json::json!({
                "apiVersion": "client.authentication.k8s.io/v1",
                "command": "sleep",
                "args": ["6"],
                "interactiveMode": "Never",
            }))?);
        }
    }
    let hung_yaml = serde_json::to_string(&hung)?;
    write("hung", &hung_yaml)?;
    write("west", &full)?;
    write("north", c0.kubeconfig())?;
    wait_for("the provider to go on past the hung plugin", || {
        ids().contains("north")
    })
    .await?;
    if ids().contains("hung") {
        return Err("a cluster whose plugin never answered was engaged".into());
    }
    create_and_see(c0.client()?, "north", "four", &mut seen).await?;
    println!("  north engaged after the hung build was given up; the rest unaffected");

    println!("west's file removed");
    std::fs::remove_file(dir.path().join("west.yaml"))?;
    wait_for("west to be disengaged", || !ids().contains("west")).await?;
    create_and_see(c0.client()?, "east", "five", &mut seen).await?;
    println!("  west disengaged; east still reconciled");

    let engaged = ids();
    manager.shutdown();
    run.await??;
    let expected: BTreeSet<String> = ["east", "north"].map(String::from).into();
    if engaged != expected {
        return Err(format!("engaged at the end: {engaged:?}, expected {expected:?}").into());
    }
    println!("engaged at the end: {engaged:?}; every check passed");
    Ok(())
}
