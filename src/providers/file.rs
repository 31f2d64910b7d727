//! [`File`]: clusters from kubeconfig files, directories and glob patterns, hot-reloaded.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use kube::config::Kubeconfig;
use notify::{RecursiveMode, Watcher};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::{Cluster, ClusterName, Fleet, Provider, ProviderError};

/// Names a cluster after the file and the context it comes from.
pub type Naming = Arc<dyn Fn(&Path, &str) -> String + Send + Sync>;

/// Every context of every kubeconfig file found is a cluster, named `<path>+<context>` by
/// default.
///
/// Sources are files, directories (their regular files, not recursively; names starting
/// with `.` are skipped) and glob patterns (`/etc/fleet/*.yaml`). With none given, like
/// kubectl: the files of `$KUBECONFIG`, else `~/.kube/config`.
///
/// Hot reload: the directories holding the sources are watched (inotify through `notify`);
/// after a burst of changes settles (100 ms) the sources are read again. A file written,
/// replaced atomically (renamed over) or deleted adds, replaces (only when a context's
/// endpoint or credentials changed) or removes its clusters. A half-written or malformed
/// file is reported, naming it, and read again on the next change or after a retry delay;
/// meanwhile its clusters keep running as they were, and so do all the others.
#[derive(Clone)]
pub struct File {
    sources: Vec<PathBuf>,
    naming: Naming,
    retry: Duration,
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

impl File {
    /// Clusters from these files, directories and glob patterns.
    pub fn new<P: Into<PathBuf>>(sources: impl IntoIterator<Item = P>) -> Self {
        Self {
            sources: sources.into_iter().map(Into::into).collect(),
            naming: Arc::new(File::default_name),
            retry: Duration::from_secs(5),
        }
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

    /// How long to wait before reading a malformed file again when nothing changes (default 5 s).
    #[must_use]
    pub fn retry(mut self, retry: Duration) -> Self {
        self.retry = retry;
        self
    }

    /// The files the sources stand for now.
    fn files(&self) -> Vec<PathBuf> {
        let mut files = Vec::new();
        for source in &self.sources {
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

    /// The directories to watch: each source's directory (or the part of a pattern before
    /// its first wildcard).
    fn watch_dirs(&self) -> Vec<PathBuf> {
        let mut dirs: Vec<PathBuf> = self
            .sources
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

    /// The clusters of one file, or why it cannot be used.
    async fn load(&self, path: &Path, text: &str) -> Result<Vec<Cluster<ClusterName>>, String> {
        let kubeconfig = Kubeconfig::from_yaml(text).map_err(|e| e.to_string())?;
        let mut clusters = Vec::new();
        for context in &kubeconfig.contexts {
            let name = ClusterName::from((self.naming)(path, &context.name));
            let cluster = super::cluster_from_kubeconfig(
                name,
                kubeconfig.clone(),
                Some(context.name.clone()),
            )
            .await
            .map_err(|e| format!("context {}: {e}", context.name))?;
            clusters.push(cluster);
        }
        Ok(clusters)
    }
}

/// What was last read from one file.
struct Loaded {
    text: String,
    clusters: Vec<ClusterName>,
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
        for dir in self.watch_dirs() {
            if let Err(error) = watcher.watch(&dir, RecursiveMode::NonRecursive) {
                tracing::warn!(dir = %dir.display(), %error, "cannot watch; changes there are seen only on retries");
            }
        }
        let mut loaded: HashMap<PathBuf, Loaded> = HashMap::new();
        loop {
            let failed = self.sync(&fleet, &mut loaded).await;
            let retry = async {
                if failed {
                    tokio::time::sleep(self.retry).await
                } else {
                    std::future::pending().await
                }
            };
            tokio::select! {
                () = shutdown.cancelled() => return Ok(()),
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
        }
    }
}

impl File {
    /// Reads the sources and brings the fleet in line. Returns whether some file failed.
    async fn sync(
        &self,
        fleet: &Fleet<ClusterName>,
        loaded: &mut HashMap<PathBuf, Loaded>,
    ) -> bool {
        let files = self.files();
        let mut failed = false;
        // Files that are gone take their clusters with them.
        let gone: Vec<PathBuf> = loaded
            .keys()
            .filter(|p| !files.contains(p))
            .cloned()
            .collect();
        for path in gone {
            if let Some(old) = loaded.remove(&path) {
                for id in old.clusters {
                    fleet.disengage(&id);
                }
            }
        }
        for path in files {
            let text = match std::fs::read_to_string(&path) {
                Ok(text) => text,
                Err(error) => {
                    tracing::warn!(file = %path.display(), %error, "cannot read kubeconfig; will retry");
                    failed = true;
                    continue;
                }
            };
            if loaded.get(&path).is_some_and(|l| l.text == text) {
                continue;
            }
            match self.load(&path, &text).await {
                Ok(clusters) => {
                    let names: BTreeMap<ClusterName, ()> =
                        clusters.iter().map(|c| (c.id().clone(), ())).collect();
                    if let Some(old) = loaded.get(&path) {
                        for id in old.clusters.iter().filter(|id| !names.contains_key(*id)) {
                            fleet.disengage(id);
                        }
                    }
                    for cluster in clusters {
                        let id = cluster.id().clone();
                        if let Err(error) = fleet.engage(cluster) {
                            tracing::warn!(cluster = %id, %error, "could not engage");
                        }
                    }
                    loaded.insert(
                        path,
                        Loaded {
                            text,
                            clusters: names.into_keys().collect(),
                        },
                    );
                }
                Err(error) => {
                    // Possibly half-written: keep what it gave before, try again later.
                    tracing::warn!(file = %path.display(), %error, "malformed kubeconfig; its clusters stay as they were");
                    failed = true;
                }
            }
        }
        failed
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
            file.files()
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
            File::new([dir.path().join("*.yaml")]).watch_dirs(),
            [dir.path().to_path_buf()]
        );
        assert_eq!(
            File::new([dir.path().join("y.yml")]).watch_dirs(),
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
}
