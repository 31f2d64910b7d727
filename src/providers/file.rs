//! [`File`]: clusters from kubeconfig files, directories and glob patterns, hot-reloaded.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use kube::config::{Kubeconfig, NamedContext};
use notify::{RecursiveMode, Watcher};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::kubeconfig::{canonical_version_of, version_of};
use crate::cluster::ClusterName;
use crate::fleet::Fleet;
use crate::provider::{Provider, ProviderError};

/// Names a cluster after the file and the context it comes from.
pub type Naming = Arc<dyn Fn(&Path, &str) -> String + Send + Sync>;

/// Every context of every kubeconfig file found is a cluster, named `<path>+<context>` by
/// default.
///
/// Sources are files, directories (their regular files, not recursively; names starting
/// with `.` are skipped) and glob patterns (`/etc/fleet/*.yaml`). With none given, like
/// kubectl: the files of `$KUBECONFIG`, else `~/.kube/config`.
///
/// Hot reload: the directories holding the sources, and those holding the files the
/// kubeconfigs name (`certificate-authority`, `client-certificate`, `client-key`,
/// `tokenFile`, relative paths taken from the kubeconfig's directory, as kubectl does), are
/// watched (inotify through `notify`); after a burst of changes settles (100 ms) the
/// sources are read again, off the async workers. A context is engaged, replaced (when its
/// cluster, user or a file they name changed) or disengaged on its own: one context that
/// cannot be used holds up no other.
///
/// Bad input, and what stays engaged (each problem logged once per content, as a WARN
/// naming the file or the cluster, with the kind and position of the problem and no byte
/// of the kubeconfig):
///
/// | the file | its clusters |
/// | --- | --- |
/// | cannot be read, is not a kubeconfig, or has no `contexts` key (empty, cut short, half written) | stay as they were |
/// | a context cannot be used (its cluster or user is not defined, a file it names is missing, its client cannot be built) | that context's cluster stays as it was (or is not engaged); the others follow the file |
/// | has `contexts: []` | all disengaged: this is how a file says it has no clusters |
/// | is deleted (or no longer matches the sources) | all disengaged |
///
/// What failed is tried again after [`File::retry`], doubling up to five minutes, or at
/// once when the file or a file it names changes; contexts that work are not rebuilt, so
/// their credential plugins do not run again.
///
/// **Trust.** Whoever can write the sources (the files, their directories, the files they
/// name) decides everything about those clusters, and more: by default a kubeconfig file may
/// run an exec plugin (any command, as the controller) and name any local file the
/// controller can read (`tokenFile: /var/run/secrets/kubernetes.io/serviceaccount/token`
/// beside a `server` of the writer's choosing sends the controller's own token there). That
/// suits `~/.kube/config` on an admin's machine. For directories others write (a ConfigMap
/// mounted into the pod, whose writers are often a wider group than a Secret's), turn both
/// off: [`File::allow_exec`] and [`File::allow_local_files`], as `KubeconfigSecrets` does by
/// default. Files are opened without blocking and must be regular files (a FIFO or a device
/// is refused) of at most 4 MiB.
#[derive(Clone)]
pub struct File {
    sources: Vec<PathBuf>,
    naming: Naming,
    retry: Duration,
    trust: super::kubeconfig_secrets::Trust,
}

impl std::fmt::Debug for File {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("File")
            .field("sources", &self.sources)
            .finish_non_exhaustive()
    }
}

/// The quiet time after a file change before the sources are read again.
const DEBOUNCE: Duration = Duration::from_millis(100);
/// The longest wait before trying again what failed.
const MAX_RETRY: Duration = Duration::from_secs(300);
/// How many clients are built at once (each may run a credential plugin).
const BUILDS_AT_ONCE: usize = 4;
/// The largest file a kubeconfig may name (certificates, keys and tokens are a few KiB).
const MAX_NAMED_FILE: u64 = 1 << 20;
/// The largest kubeconfig file (one of many contexts is some tens of KiB).
const MAX_KUBECONFIG: u64 = 4 << 20;

impl File {
    /// Clusters from these files, directories and glob patterns.
    pub fn new<P: Into<PathBuf>>(sources: impl IntoIterator<Item = P>) -> Self {
        Self {
            sources: sources.into_iter().map(Into::into).collect(),
            naming: Arc::new(File::default_name),
            retry: Duration::from_secs(5),
            trust: super::kubeconfig_secrets::Trust {
                exec: true,
                local_files: true,
            },
        }
    }

    /// Whether a file's contexts may run exec credential plugins and auth-providers (the
    /// default, as kubectl does): off for sources others can write, whose exec plugins would
    /// run as the controller. A context that would is then not engaged (a WARN says why).
    #[must_use]
    pub fn allow_exec(mut self, allow: bool) -> Self {
        self.trust.exec = allow;
        self
    }

    /// Whether a file's contexts may name local files (CA, client certificate and key, token
    /// file; the default, as kubectl does): off for sources others can write, since a
    /// `tokenFile` naming the controller's service account token beside a server of the
    /// writer's choosing sends that token there.
    #[must_use]
    pub fn allow_local_files(mut self, allow: bool) -> Self {
        self.trust.local_files = allow;
        self
    }

    /// Clusters from `$KUBECONFIG` (its files, separated by `:`), else `~/.kube/config`.
    pub fn from_env() -> Self {
        let sources: Vec<PathBuf> = match std::env::var_os("KUBECONFIG").filter(|v| !v.is_empty()) {
            Some(list) => std::env::split_paths(&list).collect(),
            None => std::env::var_os("HOME")
                .map(|h| PathBuf::from(h).join(".kube/config"))
                .into_iter()
                .collect(),
        };
        Self::new(sources)
    }

    /// The default name of `context` in the file at `path`: `<path>+<context>`, with a `%`
    /// or `+` in the context written `%25` / `%2B`, so that the name splits back
    /// ([`File::split_name`]) and two (path, context) pairs never share a name, even when
    /// paths and contexts hold `+`. (A path that is not UTF-8 is named lossily.)
    pub fn default_name(path: &Path, context: &str) -> String {
        let mut name = format!("{}+", path.display());
        for c in context.chars() {
            match c {
                '%' => name.push_str("%25"),
                '+' => name.push_str("%2B"),
                c => name.push(c),
            }
        }
        name
    }

    /// The path and context a [`File::default_name`] was made of; `None` for a name it
    /// cannot have made.
    pub fn split_name(name: &str) -> Option<(PathBuf, String)> {
        let (path, encoded) = name.rsplit_once('+')?;
        let mut context = String::with_capacity(encoded.len());
        let mut rest = encoded;
        while let Some(i) = rest.find('%') {
            context.push_str(&rest[..i]);
            let escape = rest.get(i..i + 3)?;
            context.push(match escape {
                "%25" => '%',
                "%2B" => '+',
                _ => return None,
            });
            rest = &rest[i + 3..];
        }
        context.push_str(rest);
        Some((PathBuf::from(path), context))
    }

    /// How clusters are named from the file's path and the context's name.
    #[must_use]
    pub fn naming(
        mut self,
        naming: impl Fn(&Path, &str) -> String + Send + Sync + 'static,
    ) -> Self {
        self.naming = Arc::new(naming);
        self
    }

    /// How long to wait before reading an unusable file or building a failed context again
    /// when nothing changes (default 5 s); each further failure of the same content doubles
    /// the wait, up to five minutes.
    #[must_use]
    pub fn retry(mut self, retry: Duration) -> Self {
        self.retry = retry;
        self
    }
}

// ----- Reading the sources: blocking file system calls, run on tokio's blocking pool -----

/// What the sources held when they were read.
struct Scan {
    files: Vec<(PathBuf, Read)>,
    /// The directories to watch: the sources' and those of the files the kubeconfigs name.
    dirs: BTreeSet<PathBuf>,
}

/// What one file held.
enum Read {
    /// It cannot be read, is not a kubeconfig, or names no contexts: whatever it gave
    /// before stands. `version` tells one unusable content from another.
    Unusable { problem: String, version: u64 },
    /// Its contexts, each made into a kubeconfig of its own (or why it cannot be).
    Contexts(Vec<(String, Result<Kubeconfig, String>)>),
}

/// Reads every source. Blocking.
fn scan(sources: &[PathBuf], trust: super::kubeconfig_secrets::Trust) -> Scan {
    let mut dirs: BTreeSet<PathBuf> = source_dirs(sources).into_iter().collect();
    let files = expand(sources)
        .into_iter()
        .map(|path| {
            let read = read_file(&path, &mut dirs, trust);
            (path, read)
        })
        .collect();
    Scan { files, dirs }
}

/// The files the sources stand for now. Blocking.
fn expand(sources: &[PathBuf]) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for source in sources {
        let text = source.to_string_lossy();
        if text.contains(['*', '?', '[']) {
            // `*` does not match a leading dot, like a shell: editors' and tools' hidden
            // temporary files stay out.
            let options = glob::MatchOptions {
                require_literal_leading_dot: true,
                ..Default::default()
            };
            match glob::glob_with(&text, options) {
                Ok(paths) => files.extend(paths.flatten().filter(|p| p.is_file())),
                Err(error) => tracing::warn!(pattern = %text, %error, "invalid glob pattern"),
            }
        } else if source.is_dir() {
            if let Ok(entries) = std::fs::read_dir(source) {
                let mut found: Vec<PathBuf> = entries
                    .flatten()
                    .map(|e| e.path())
                    .filter(|p| {
                        p.is_file()
                            && !p
                                .file_name()
                                .is_some_and(|n| n.to_string_lossy().starts_with('.'))
                    })
                    .collect();
                found.sort();
                files.extend(found);
            }
        } else if source.is_file() {
            files.push(source.clone());
        }
    }
    files.dedup();
    files
}

/// The directories holding the sources: each source's directory (or the part of a pattern
/// before its first wildcard). Blocking.
fn source_dirs(sources: &[PathBuf]) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = sources
        .iter()
        .map(|source| {
            let literal: PathBuf = source
                .components()
                .take_while(|c| !c.as_os_str().to_string_lossy().contains(['*', '?', '[']))
                .collect();
            if literal != *source || source.is_dir() {
                literal
            } else {
                source.parent().map(Path::to_path_buf).unwrap_or_default()
            }
        })
        .filter(|d| d.is_dir())
        .collect();
    dirs.sort();
    dirs.dedup();
    dirs
}

/// Reads one kubeconfig file, adding the directories of the files it names to `dirs`.
/// Blocking.
fn read_file(
    path: &Path,
    dirs: &mut BTreeSet<PathBuf>,
    trust: super::kubeconfig_secrets::Trust,
) -> Read {
    let text = match read_regular(path, MAX_KUBECONFIG, "the file")
        .and_then(|data| String::from_utf8(data).map_err(|_| "the file is not UTF-8".to_string()))
    {
        Ok(text) => text,
        Err(problem) => {
            let version = version_of(&problem);
            return Read::Unusable { problem, version };
        }
    };
    let unusable = |problem: String| Read::Unusable {
        version: version_of(&(&problem, &text)),
        problem,
    };
    let kubeconfig = match super::kubeconfig_secrets::parse_trusted(
        text.as_bytes(),
        trust,
        "this File provider's kubeconfigs",
    ) {
        Ok(kubeconfig) => kubeconfig,
        Err(problem) => return unusable(problem),
    };
    if kubeconfig.contexts.is_empty() && !says_no_contexts(&text) {
        return unusable(
            "it has no contexts key (empty or cut short?); write `contexts: []` or delete the file to remove its clusters"
                .to_string(),
        );
    }
    let base = path.parent().unwrap_or(Path::new("."));
    let mut seen = BTreeSet::new();
    let contexts = kubeconfig
        .contexts
        .iter()
        // As kubectl: the first of several entries with one name counts.
        .filter(|c| seen.insert(c.name.clone()))
        .map(|context| {
            let standalone = standalone(&kubeconfig, context, base, dirs);
            (context.name.clone(), standalone)
        })
        .collect();
    Read::Contexts(contexts)
}

/// Whether the text says, with a `contexts` key holding an empty list, that it has no
/// contexts (rather than having lost them to a truncation).
fn says_no_contexts(text: &str) -> bool {
    serde_saphyr::from_multiple::<serde_json::Value>(text).is_ok_and(|documents| {
        documents
            .iter()
            .any(|d| d.get("contexts").is_some_and(|c| c.as_array().is_some()))
    })
}

/// `context` of `kubeconfig` as a kubeconfig of its own: the context, its cluster and its
/// user, with the files they name read and put in as data (so that the configuration
/// changes when they do, and building it reads nothing). Blocking.
fn standalone(
    kubeconfig: &Kubeconfig,
    context: &NamedContext,
    base: &Path,
    dirs: &mut BTreeSet<PathBuf>,
) -> Result<Kubeconfig, String> {
    let Some(spec) = &context.context else {
        return Err("the context names no cluster".into());
    };
    let mut cluster = kubeconfig
        .clusters
        .iter()
        .find(|c| c.name == spec.cluster)
        .cloned()
        .ok_or("the cluster the context names is not defined")?;
    let user_name = spec.user.as_deref().unwrap_or_default();
    let mut user = match kubeconfig.auth_infos.iter().find(|u| u.name == user_name) {
        Some(user) => Some(user.clone()),
        // A user cut off the end of a half-written file would otherwise make an anonymous
        // client.
        None if !user_name.is_empty() => {
            return Err("the user the context names is not defined".into());
        }
        None => None,
    };
    let mut read = |field: &str, file: &str| -> Result<Vec<u8>, String> {
        let path = base.join(file);
        if let Some(dir) = path.parent() {
            dirs.insert(dir.to_path_buf());
        }
        read_named(&path).map_err(|problem| format!("{field}: {problem}"))
    };
    use base64::Engine as _;
    let encode = |data: Vec<u8>| base64::engine::general_purpose::STANDARD.encode(data);
    if let Some(c) = cluster.cluster.as_mut()
        && let Some(file) = c.certificate_authority.take()
        && c.certificate_authority_data.is_none()
    {
        c.certificate_authority_data = Some(encode(read("certificate-authority", &file)?));
    }
    if let Some(auth) = user.as_mut().and_then(|u| u.auth_info.as_mut()) {
        if let Some(file) = auth.client_certificate.take()
            && auth.client_certificate_data.is_none()
        {
            auth.client_certificate_data = Some(encode(read("client-certificate", &file)?));
        }
        if let Some(file) = auth.client_key.take()
            && auth.client_key_data.is_none()
        {
            auth.client_key_data = Some(encode(read("client-key", &file)?).into());
        }
        if let Some(file) = auth.token_file.take()
            && auth.token.is_none()
        {
            let token = String::from_utf8(read("tokenFile", &file)?)
                .map_err(|_| "tokenFile: the file it names is not UTF-8".to_string())?;
            auth.token = Some(token.trim().to_string().into());
        }
    }
    let mut own = Kubeconfig::default();
    own.api_version.clone_from(&kubeconfig.api_version);
    own.kind.clone_from(&kubeconfig.kind);
    own.clusters = vec![cluster];
    own.auth_infos = user.into_iter().collect();
    own.contexts = vec![context.clone()];
    own.current_context = Some(context.name.clone());
    Ok(own)
}

/// A file a kubeconfig names: a regular file of at most [`MAX_NAMED_FILE`] bytes (a FIFO
/// or a device would block or never end). Blocking.
fn read_named(path: &Path) -> Result<Vec<u8>, String> {
    read_regular(path, MAX_NAMED_FILE, "the file it names")
}

/// The content of the regular file at `path`, of at most `max` bytes. It is opened without
/// blocking (a FIFO put there would block the opening itself) and checked once open (what
/// was checked before the opening may have been swapped for something else since).
/// Blocking.
fn read_regular(path: &Path, max: u64, subject: &str) -> Result<Vec<u8>, String> {
    let cannot = |e: std::io::Error| format!("cannot read {subject} ({})", e.kind());
    let mut options = std::fs::OpenOptions::new();
    options.read(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt as _;
        options.custom_flags(nix::fcntl::OFlag::O_NONBLOCK.bits());
    }
    let file = options.open(path).map_err(cannot)?;
    let meta = file.metadata().map_err(cannot)?;
    if !meta.is_file() {
        return Err(format!("{subject} is not a regular file"));
    }
    let larger = || format!("{subject} is larger than {} KiB", max / 1024);
    if meta.len() > max {
        return Err(larger());
    }
    let mut data = Vec::new();
    file.take(max + 1).read_to_end(&mut data).map_err(cannot)?;
    if data.len() as u64 > max {
        return Err(larger());
    }
    Ok(data)
}

// ----- Bringing the fleet in line with what was read -----

/// What the provider holds for one file.
#[derive(Default)]
struct FileState {
    contexts: BTreeMap<String, ContextState>,
    /// The unusable version of the file last reported, and when to read it again.
    unusable: Option<Failing>,
}

/// One context of a file.
struct ContextState {
    id: ClusterName,
    /// The version engaged (of its standalone kubeconfig), if any.
    engaged: Option<u64>,
    /// The latest version, while it cannot be engaged.
    failing: Option<Failing>,
}

/// The builds in flight, by file and context.
type Builds = super::InFlight<(PathBuf, String)>;

/// A build to start: the file, the context, the cluster, the version and its kubeconfig.
type Build = (PathBuf, String, ClusterName, u64, kube::config::Kubeconfig);
/// A build's outcome.
type Built = (
    PathBuf,
    String,
    u64,
    Result<crate::cluster::Cluster<ClusterName>, String>,
);

/// A version that could not be used: reported once, tried again with backoff.
struct Failing {
    version: u64,
    attempts: u32,
    at: Instant,
}

/// What noting a failure did.
enum Noted {
    /// A version not seen failing before: to be reported.
    First,
    /// A due retry failed again; the next waits this long.
    Again(Duration),
    /// The same version, its retry not yet due: nothing to do.
    Waiting,
}

impl Failing {
    /// Notes that `version` failed, in `slot`: a new version is tried again after `retry`,
    /// a due retry of the same version that failed again waits twice as long as before (up
    /// to [`MAX_RETRY`]), one not yet due is left alone.
    fn note(slot: &mut Option<Failing>, version: u64, retry: Duration) -> Noted {
        let now = Instant::now();
        match slot {
            Some(failing) if failing.version == version && failing.at > now => Noted::Waiting,
            Some(failing) if failing.version == version => {
                failing.attempts = failing.attempts.saturating_add(1);
                let wait = retry
                    .saturating_mul(1 << failing.attempts.saturating_sub(1).min(16))
                    .min(MAX_RETRY.max(retry));
                failing.at = now + wait;
                Noted::Again(wait)
            }
            _ => {
                *slot = Some(Failing {
                    version,
                    attempts: 1,
                    at: now + retry,
                });
                Noted::First
            }
        }
    }

    /// Whether `version` is this one and its retry is not yet due.
    fn waits(&self, version: u64) -> bool {
        self.version == version && self.at > Instant::now()
    }
}

impl ContextState {
    /// Notes that `version` cannot be used: a WARN the first time for this version, a
    /// DEBUG for each retry that fails again.
    fn fail(&mut self, version: u64, problem: &str, retry: Duration) {
        match Failing::note(&mut self.failing, version, retry) {
            Noted::First if self.engaged.is_some() => {
                tracing::warn!(cluster = %self.id, error = %problem, "kubeconfig context unusable; the cluster stays as it was");
            }
            Noted::First => {
                tracing::warn!(cluster = %self.id, error = %problem, "kubeconfig context unusable; not engaged");
            }
            Noted::Again(wait) => {
                let attempts = self.failing.as_ref().map_or(0, |f| f.attempts);
                tracing::debug!(cluster = %self.id, error = %problem, attempts, next_in = ?wait, "kubeconfig context still unusable");
            }
            Noted::Waiting => {}
        }
    }
}

impl Provider for File {
    type Id = ClusterName;

    async fn run(
        &self,
        fleet: Fleet<ClusterName>,
        shutdown: CancellationToken,
    ) -> Result<(), ProviderError> {
        let (tx, mut changes) = mpsc::unbounded_channel();
        let mut watcher =
            notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
                // Reading the files ourselves raises access events; only changes count, or
                // every read would trigger another.
                use notify::event::{EventKind, ModifyKind};
                if let Ok(event) = event
                    && matches!(
                        event.kind,
                        EventKind::Create(_)
                            | EventKind::Remove(_)
                            | EventKind::Modify(
                                ModifyKind::Data(_) | ModifyKind::Name(_) | ModifyKind::Any
                            )
                    )
                {
                    let _ = tx.send(());
                }
            })?;
        let mut watched: BTreeSet<PathBuf> = BTreeSet::new();
        let mut state: BTreeMap<PathBuf, FileState> = BTreeMap::new();
        // Builds run a few at once beside this loop, each engaged when it is done: one whose
        // credential plugin hangs (until the plugin's timeout) delays no other, nor the
        // reading of changes meanwhile. A newer version, or the context gone, ends a build.
        let mut builds = FuturesUnordered::new();
        let mut inflight = Builds::default();
        let permits = Arc::new(tokio::sync::Semaphore::new(BUILDS_AT_ONCE));
        loop {
            let (sources, trust) = (self.sources.clone(), self.trust);
            let Ok(scan) = tokio::task::spawn_blocking(move || scan(&sources, trust)).await else {
                // Only a panic ends the blocking read early; the next round reads again.
                tracing::warn!("reading the kubeconfig files failed; will retry");
                tokio::time::sleep(self.retry).await;
                continue;
            };
            for dir in watched.difference(&scan.dirs) {
                let _ = watcher.unwatch(dir);
            }
            for dir in scan.dirs.difference(&watched) {
                if let Err(error) = watcher.watch(dir, RecursiveMode::NonRecursive) {
                    tracing::warn!(dir = %dir.display(), %error, "cannot watch; changes there are seen only on retries");
                }
            }
            watched = scan.dirs.clone();
            let started = self.sync(&fleet, &mut state, &mut inflight, scan.files);
            for (path, name, id, version, kubeconfig) in started {
                let permits = permits.clone();
                let key = (path.clone(), name.clone());
                builds.push(inflight.start(key, version, async move {
                    let _permit = permits.acquire().await;
                    let cluster =
                        super::cluster_from_kubeconfig(id, kubeconfig, Some(name.clone())).await;
                    (path, name, version, cluster)
                }));
            }
            loop {
                let next = state
                    .values()
                    .flat_map(|f| {
                        f.unusable
                            .iter()
                            .chain(f.contexts.values().filter_map(|c| c.failing.as_ref()))
                    })
                    .map(|f| f.at)
                    .min();
                let retry = async {
                    match next {
                        Some(at) => tokio::time::sleep_until(at).await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    () = shutdown.cancelled() => return Ok(()),
                    Some(built) = builds.next(), if !builds.is_empty() => {
                        // Ended builds (replaced, or of a context gone) are nothing.
                        if let Ok(built) = built {
                            self.engage_built(&fleet, &mut state, &mut inflight, built);
                        }
                        continue;
                    }
                    Some(()) = changes.recv() => {
                        // Let a burst of events (write, rename, chmod) settle.
                        loop {
                            tokio::select! {
                                Some(()) = changes.recv() => {}
                                () = tokio::time::sleep(DEBOUNCE) => break,
                            }
                        }
                    }
                    () = retry => {}
                }
                break;
            }
        }
    }
}

impl File {
    /// Brings the fleet in line with what the files hold: disengages what is gone, and
    /// returns the builds to start.
    fn sync(
        &self,
        fleet: &Fleet<ClusterName>,
        state: &mut BTreeMap<PathBuf, FileState>,
        inflight: &mut Builds,
        files: Vec<(PathBuf, Read)>,
    ) -> Vec<Build> {
        // Files that are gone take their clusters (and builds) with them.
        let present: BTreeSet<&PathBuf> = files.iter().map(|(p, _)| p).collect();
        state.retain(|path, file| {
            let keep = present.contains(path);
            if !keep {
                for (name, context) in &file.contexts {
                    inflight.cancel(&(path.clone(), name.clone()));
                    if context.engaged.is_some() {
                        fleet.disengage(&context.id);
                    }
                }
            }
            keep
        });
        let mut builds = Vec::new();
        for (path, read) in files {
            let file = state.entry(path.clone()).or_default();
            let contexts = match read {
                Read::Unusable { problem, version } => {
                    let engaged = file
                        .contexts
                        .values()
                        .filter(|c| c.engaged.is_some())
                        .count();
                    if let Noted::First = Failing::note(&mut file.unusable, version, self.retry) {
                        tracing::warn!(file = %path.display(), error = %problem, engaged, "kubeconfig file unusable; its clusters stay as they were");
                    }
                    continue;
                }
                Read::Contexts(contexts) => contexts,
            };
            file.unusable = None;
            // Contexts no longer in the file leave.
            file.contexts.retain(|name, context| {
                let keep = contexts.iter().any(|(n, _)| n == name);
                if !keep {
                    inflight.cancel(&(path.clone(), name.clone()));
                    if context.engaged.is_some() {
                        fleet.disengage(&context.id);
                    }
                }
                keep
            });
            for (name, standalone) in contexts {
                let context = file
                    .contexts
                    .entry(name.clone())
                    .or_insert_with(|| ContextState {
                        id: ClusterName::from((self.naming)(&path, &name)),
                        engaged: None,
                        failing: None,
                    });
                let key = (path.clone(), name.clone());
                match standalone {
                    Err(problem) => {
                        inflight.cancel(&key);
                        context.fail(version_of(&problem), &problem, self.retry);
                    }
                    Ok(kubeconfig) => {
                        let version = canonical_version_of(&kubeconfig);
                        if context.engaged == Some(version) {
                            context.failing = None;
                            inflight.cancel(&key);
                        } else if inflight.building(&key) == Some(version) {
                            // Being built.
                        } else if !context.failing.as_ref().is_some_and(|f| f.waits(version)) {
                            builds.push((
                                path.clone(),
                                name,
                                context.id.clone(),
                                version,
                                kubeconfig,
                            ));
                        }
                    }
                }
            }
        }
        builds
    }

    /// Engages (or notes as failing) what a build made, if its context still waits for
    /// that version.
    fn engage_built(
        &self,
        fleet: &Fleet<ClusterName>,
        state: &mut BTreeMap<PathBuf, FileState>,
        inflight: &mut Builds,
        (path, name, version, cluster): Built,
    ) {
        if !inflight.done(&(path.clone(), name.clone()), version) {
            return;
        }
        let Some(context) = state.get_mut(&path).and_then(|f| f.contexts.get_mut(&name)) else {
            return;
        };
        match cluster {
            Ok(cluster) => match fleet.engage(cluster) {
                Ok(_) => {
                    context.engaged = Some(version);
                    context.failing = None;
                }
                Err(error) => {
                    tracing::warn!(cluster = %context.id, %error, "could not engage");
                }
            },
            Err(problem) => context.fail(version, &problem, self.retry),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_expand_to_files_skipping_hidden_ones_and_honouring_globs() {
        let dir = tempfile::tempdir().unwrap();
        for name in ["x.yaml", "y.yml", ".hidden.yaml"] {
            std::fs::write(dir.path().join(name), "").unwrap();
        }
        let names = |file: File| -> Vec<String> {
            expand(&file.sources)
                .iter()
                .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
                .collect()
        };
        assert_eq!(names(File::new([dir.path()])), ["x.yaml", "y.yml"]);
        assert_eq!(names(File::new([dir.path().join("*.yaml")])), ["x.yaml"]);
        assert_eq!(
            names(File::new([
                dir.path().join("y.yml"),
                dir.path().join("missing")
            ])),
            ["y.yml"]
        );
        assert_eq!(
            source_dirs(&File::new([dir.path().join("*.yaml")]).sources),
            [dir.path().to_path_buf()]
        );
        assert_eq!(
            source_dirs(&File::new([dir.path().join("y.yml")]).sources),
            [dir.path().to_path_buf()]
        );
    }

    #[test]
    fn clusters_are_named_after_path_and_context_unless_told_otherwise() {
        let file = File::new(["/k/config"]);
        assert_eq!(
            (file.naming)(Path::new("/k/config"), "prod"),
            "/k/config+prod"
        );
        let file = file.naming(|_, ctx| ctx.to_uppercase());
        assert_eq!((file.naming)(Path::new("/k/config"), "prod"), "PROD");
    }

    #[test]
    fn default_names_split_back_even_with_plus_signs_on_both_sides() {
        // Without escaping, these two would both be "/a+b+c".
        let one = File::default_name(Path::new("/a+b"), "c");
        let two = File::default_name(Path::new("/a"), "b+c");
        assert_ne!(one, two);
        assert_eq!(two, "/a+b%2Bc");
        for (path, context) in [("/a+b", "c"), ("/a", "b+c"), ("/k/x", "50%+1"), ("/p", "")] {
            let name = File::default_name(Path::new(path), context);
            assert_eq!(
                File::split_name(&name),
                Some((PathBuf::from(path), context.to_string())),
                "{name}"
            );
        }
        assert_eq!(File::split_name("no-plus"), None);
        assert_eq!(File::split_name("/p+bad%2"), None);
        assert_eq!(File::split_name("/p+bad%41"), None);
    }

    #[test]
    fn only_an_explicit_empty_contexts_list_says_a_file_has_no_clusters() {
        assert!(says_no_contexts(
            "apiVersion: v1\nkind: Config\ncontexts: []\n"
        ));
        assert!(says_no_contexts(r#"{"kind": "Config", "contexts": []}"#));
        for cut_short in [
            "",
            "apiVersion: v1\nkind: Config\nclusters: []\n",
            "apiVersion: v1\ncontexts:\n",
            "clusters: [ {",
        ] {
            assert!(!says_no_contexts(cut_short), "{cut_short:?}");
        }
    }

    #[test]
    fn a_context_stands_alone_with_the_files_it_names_read_relative_to_its_kubeconfig() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("certs")).unwrap();
        std::fs::write(dir.path().join("certs/ca.crt"), "CA").unwrap();
        std::fs::write(dir.path().join("certs/token"), "tok\n").unwrap();
        let kubeconfig = crate::providers::kubeconfig::parse(
            r#"
clusters:
- {name: c, cluster: {server: "https://127.0.0.1:1", certificate-authority: certs/ca.crt}}
- {name: other, cluster: {server: "https://127.0.0.1:2"}}
users:
- {name: u, user: {tokenFile: certs/token}}
contexts:
- {name: a, context: {cluster: c, user: u}}
- {name: b, context: {cluster: c, user: ghost}}
- {name: d, context: {cluster: missing, user: u}}
"#,
        )
        .unwrap();
        let mut dirs = BTreeSet::new();
        let own = standalone(&kubeconfig, &kubeconfig.contexts[0], dir.path(), &mut dirs).unwrap();
        assert_eq!(own.clusters.len(), 1, "only its own cluster");
        let cluster = own.clusters[0].cluster.as_ref().unwrap();
        assert_eq!(cluster.certificate_authority, None);
        assert_eq!(cluster.certificate_authority_data.as_deref(), Some("Q0E="));
        let auth = own.auth_infos[0].auth_info.as_ref().unwrap();
        assert_eq!(auth.token_file, None);
        use secrecy::ExposeSecret;
        assert_eq!(auth.token.as_ref().map(|t| t.expose_secret()), Some("tok"));
        assert_eq!(dirs, BTreeSet::from([dir.path().join("certs")]));
        assert_eq!(
            standalone(&kubeconfig, &kubeconfig.contexts[1], dir.path(), &mut dirs).unwrap_err(),
            "the user the context names is not defined"
        );
        assert_eq!(
            standalone(&kubeconfig, &kubeconfig.contexts[2], dir.path(), &mut dirs).unwrap_err(),
            "the cluster the context names is not defined"
        );
        std::fs::remove_file(dir.path().join("certs/ca.crt")).unwrap();
        std::fs::create_dir(dir.path().join("certs/ca.crt")).unwrap();
        assert_eq!(
            standalone(&kubeconfig, &kubeconfig.contexts[0], dir.path(), &mut dirs).unwrap_err(),
            "certificate-authority: the file it names is not a regular file"
        );
    }

    /// `read_file` on another thread, given five seconds (a read that blocks fails the test
    /// instead of hanging it).
    fn read_within(path: &Path, trust: super::super::kubeconfig_secrets::Trust) -> Read {
        let path = path.to_path_buf();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(read_file(&path, &mut BTreeSet::new(), trust));
        });
        rx.recv_timeout(Duration::from_secs(5))
            .expect("the read blocked")
    }

    fn problem(read: Read) -> String {
        match read {
            Read::Unusable { problem, .. } => problem,
            Read::Contexts(contexts) => match &contexts[0].1 {
                Err(problem) => problem.clone(),
                Ok(_) => panic!("usable"),
            },
        }
    }

    #[test]
    fn fifos_huge_files_and_what_the_trust_forbids_are_refused_without_blocking() {
        let all = super::super::kubeconfig_secrets::Trust {
            exec: true,
            local_files: true,
        };
        let dir = tempfile::tempdir().unwrap();
        // A FIFO where a kubeconfig was (nobody writes it: opening it to read would block).
        let fifo = dir.path().join("config");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
        assert_eq!(
            problem(read_within(&fifo, all)),
            "the file is not a regular file"
        );
        // A FIFO a kubeconfig names.
        let named = dir.path().join("named");
        std::fs::write(
            &named,
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: https://127.0.0.1:1\n    certificate-authority: ca-fifo\ncontexts:\n- name: x\n  context:\n    cluster: c\n",
        )
        .unwrap();
        nix::unistd::mkfifo(&dir.path().join("ca-fifo"), nix::sys::stat::Mode::S_IRWXU).unwrap();
        assert_eq!(
            problem(read_within(&named, all)),
            "certificate-authority: the file it names is not a regular file"
        );
        // A sparse file of 8 GiB: not read into memory.
        let huge = dir.path().join("huge");
        std::fs::File::create(&huge)
            .unwrap()
            .set_len(8 << 30)
            .unwrap();
        assert_eq!(
            problem(read_within(&huge, all)),
            "the file is larger than 4096 KiB"
        );
        // What the trust forbids.
        let exec = dir.path().join("exec");
        std::fs::write(
            &exec,
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster: {server: https://127.0.0.1:1}\nusers:\n- name: u\n  user:\n    exec: {apiVersion: client.authentication.k8s.io/v1, command: /bin/true}\ncontexts:\n- name: x\n  context: {cluster: c, user: u}\n",
        )
        .unwrap();
        let no_exec = super::super::kubeconfig_secrets::Trust {
            exec: false,
            local_files: true,
        };
        assert!(problem(read_within(&exec, no_exec)).contains("allow_exec"));
        assert!(matches!(read_within(&exec, all), Read::Contexts(_)));
        let token_file = dir.path().join("token-file");
        std::fs::write(
            &token_file,
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster: {server: https://127.0.0.1:1}\nusers:\n- name: u\n  user: {tokenFile: /var/run/secrets/kubernetes.io/serviceaccount/token}\ncontexts:\n- name: x\n  context: {cluster: c, user: u}\n",
        )
        .unwrap();
        let no_files = super::super::kubeconfig_secrets::Trust {
            exec: true,
            local_files: false,
        };
        assert!(problem(read_within(&token_file, no_files)).contains("allow_local_files"));
    }

    #[test]
    fn retry_waits_double_up_to_five_minutes() {
        let retry = Duration::from_secs(5);
        let mut slot = None;
        assert!(matches!(Failing::note(&mut slot, 1, retry), Noted::First));
        assert!(matches!(Failing::note(&mut slot, 1, retry), Noted::Waiting));
        let waits: Vec<u64> = (0..9)
            .map(|_| {
                // The retry comes due, and fails again.
                if let Some(failing) = slot.as_mut() {
                    failing.at = Instant::now();
                }
                match Failing::note(&mut slot, 1, retry) {
                    Noted::Again(wait) => wait.as_secs(),
                    _ => panic!("a due retry that failed again"),
                }
            })
            .collect();
        assert_eq!(waits, [10, 20, 40, 80, 160, 300, 300, 300, 300]);
    }
}
