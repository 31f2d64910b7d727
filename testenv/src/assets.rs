//! Where the `etcd` and `kube-apiserver` binaries of the test control plane are found.

use std::path::{Path, PathBuf};

use super::Error;

/// The Kubernetes version of the test control plane this crate is built and tested against.
///
/// It matches the `k8s-openapi` feature this crate enables and the version that
/// `scripts/testenv-assets.sh` builds by default.
pub const KUBERNETES_VERSION: &str = "1.36.3";

/// Variable naming a directory that holds `etcd` and `kube-apiserver` (checked first).
pub const ASSETS_ENV: &str = "MCR_TESTENV_ASSETS";
/// controller-runtime's envtest variable, honoured so its users can reuse their binaries.
pub const KUBEBUILDER_ASSETS_ENV: &str = "KUBEBUILDER_ASSETS";
/// Variable overriding the root of the default cache (`<root>/<kubernetes version>`).
pub const CACHE_ENV: &str = "MCR_TESTENV_CACHE";

/// The build of the test control plane: the crate's `build-assets.sh`, run by
/// [`Assets::build`] (and by the repository's `scripts/testenv-assets.sh`).
const BUILD_SCRIPT: &str = include_str!("../build-assets.sh");

const ETCD: &str = "etcd";
const KUBE_APISERVER: &str = "kube-apiserver";

/// A directory holding the test control plane's binaries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Assets {
    dir: PathBuf,
}

impl Assets {
    /// Finds the binaries: in `$MCR_TESTENV_ASSETS`, else `$KUBEBUILDER_ASSETS`, else the default
    /// cache directory [`Assets::default_dir`].
    ///
    /// A variable that is set but names a directory without both binaries is an error (it is
    /// not silently skipped), so a typo does not quietly pick up other binaries.
    pub fn locate() -> Result<Self, Error> {
        Self::locate_with(|name| {
            std::env::var_os(name)
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
        })
    }

    /// [`Assets::locate`] with the environment given as a function (for tests and embedders).
    pub fn locate_with(env: impl Fn(&str) -> Option<PathBuf>) -> Result<Self, Error> {
        for var in [ASSETS_ENV, KUBEBUILDER_ASSETS_ENV] {
            if let Some(dir) = env(var) {
                return Self::from_dir(&dir).map_err(|missing| Error::AssetsNotFound {
                    detail: format!("{var}={} has no {missing}", dir.display()),
                });
            }
        }
        let Some(dir) = default_dir_with(&env) else {
            return Err(Error::AssetsNotFound {
                detail: format!(
                    "{ASSETS_ENV} and {KUBEBUILDER_ASSETS_ENV} are unset and neither HOME, \
                     XDG_CACHE_HOME nor {CACHE_ENV} is set to find the default cache"
                ),
            });
        };
        Self::from_dir(&dir).map_err(|missing| Error::AssetsNotFound {
            detail: format!(
                "{ASSETS_ENV} and {KUBEBUILDER_ASSETS_ENV} are unset and the default cache {} has no {missing}",
                dir.display()
            ),
        })
    }

    /// Uses the binaries in `dir`; the error names the first one missing.
    fn from_dir(dir: &Path) -> Result<Self, &'static str> {
        for bin in [ETCD, KUBE_APISERVER] {
            if !dir.join(bin).is_file() {
                return Err(bin);
            }
        }
        Ok(Self {
            dir: dir.to_path_buf(),
        })
    }

    /// [`Assets::locate`], building the binaries into the default cache when they are not
    /// there yet (with [`Assets::build`]).
    ///
    /// Only the default cache is filled: when `$MCR_TESTENV_ASSETS` or `$KUBEBUILDER_ASSETS`
    /// names a directory without the binaries, that is an error, as with `locate`. The first
    /// call builds for about five minutes on two cores and needs `go` (1.26 or newer, or an
    /// older one that can fetch it through the Go module proxy), `bash` and `flock`; later
    /// calls find the cache at once. Concurrent calls, also from other processes, wait for
    /// one build.
    pub async fn locate_or_build() -> Result<Self, Error> {
        let env = |name: &str| {
            std::env::var_os(name)
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
        };
        if [ASSETS_ENV, KUBEBUILDER_ASSETS_ENV]
            .iter()
            .any(|var| env(var).is_some())
        {
            return Self::locate();
        }
        match Self::locate() {
            Ok(assets) => Ok(assets),
            Err(Error::AssetsNotFound { .. }) => Self::build().await,
            Err(other) => Err(other),
        }
    }

    /// Builds `kube-apiserver` [`KUBERNETES_VERSION`] and its `etcd` from their Go modules into
    /// the default cache ([`Assets::default_dir`]), or finds them there already built and
    /// checked. The build's progress goes to standard error.
    ///
    /// Runs the crate's own build script with `bash`; needs `go` and `flock` on `PATH`.
    pub async fn build() -> Result<Self, Error> {
        Self::build_with(None).await
    }

    /// [`Assets::build`] into the cache root `root` (the binaries go to
    /// `root/<KUBERNETES_VERSION>`) instead of the default one.
    pub async fn build_into(root: impl AsRef<Path>) -> Result<Self, Error> {
        Self::build_with(Some(root.as_ref().to_path_buf())).await
    }

    async fn build_with(root: Option<PathBuf>) -> Result<Self, Error> {
        let script = tokio::task::spawn_blocking(move || run_build_script(root.as_deref()));
        let dir = script.await.map_err(|e| Error::AssetsBuild {
            detail: format!("the build task ended: {e}"),
        })??;
        Self::in_dir(&dir)
    }

    /// Uses the binaries in `dir`, checking that both are there.
    pub fn in_dir(dir: impl AsRef<Path>) -> Result<Self, Error> {
        let dir = dir.as_ref();
        Self::from_dir(dir).map_err(|missing| Error::AssetsNotFound {
            detail: format!("{} has no {missing}", dir.display()),
        })
    }

    /// The default cache directory for [`KUBERNETES_VERSION`]:
    /// `$MCR_TESTENV_CACHE/<version>`, else
    /// `${XDG_CACHE_HOME:-$HOME/.cache}/multicluster-runtime/testenv/<version>`.
    pub fn default_dir() -> Option<PathBuf> {
        default_dir_with(|name| {
            std::env::var_os(name)
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
        })
    }

    /// The directory holding the binaries.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Path of the `etcd` binary.
    pub fn etcd(&self) -> PathBuf {
        self.dir.join(ETCD)
    }

    /// Path of the `kube-apiserver` binary.
    pub fn kube_apiserver(&self) -> PathBuf {
        self.dir.join(KUBE_APISERVER)
    }
}

/// Runs [`BUILD_SCRIPT`] (with the cache root `root`, if given) and returns the directory it
/// printed last.
fn run_build_script(root: Option<&Path>) -> Result<PathBuf, Error> {
    use std::process::{Command, Stdio};
    let mut command = Command::new("bash");
    if let Some(root) = root {
        command.env(CACHE_ENV, root);
    }
    let output = command
        .arg("-c")
        .arg(BUILD_SCRIPT)
        .arg("build-assets.sh")
        // The cache directory is named after the version this crate looks for.
        .env("MCR_K8S_VERSION", KUBERNETES_VERSION)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| Error::AssetsBuild {
            detail: format!("could not run bash: {e}"),
        })?;
    if !output.status.success() {
        return Err(Error::AssetsBuild {
            detail: format!(
                "the build script exited with {} (its log is above, on standard error)",
                output.status
            ),
        });
    }
    let stdout = String::from_utf8_lossy(&output.stdout);
    match stdout.lines().rev().find(|line| !line.trim().is_empty()) {
        Some(dir) => Ok(PathBuf::from(dir.trim())),
        None => Err(Error::AssetsBuild {
            detail: "the build script printed no directory".to_string(),
        }),
    }
}

fn default_dir_with(env: impl Fn(&str) -> Option<PathBuf>) -> Option<PathBuf> {
    let root = env(CACHE_ENV).or_else(|| {
        env("XDG_CACHE_HOME")
            .or_else(|| env("HOME").map(|home| home.join(".cache")))
            .map(|cache| cache.join("multicluster-runtime").join("testenv"))
    })?;
    Some(root.join(KUBERNETES_VERSION))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn fake_assets() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        for bin in [ETCD, KUBE_APISERVER] {
            std::fs::write(dir.path().join(bin), b"").unwrap();
        }
        dir
    }

    fn env_of(vars: &[(&str, &Path)]) -> impl Fn(&str) -> Option<PathBuf> {
        let map: HashMap<String, PathBuf> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_path_buf()))
            .collect();
        move |name| map.get(name).cloned()
    }

    #[test]
    fn mcr_variable_wins_over_kubebuilder_assets() {
        let ours = fake_assets();
        let theirs = fake_assets();
        let found = Assets::locate_with(env_of(&[
            (ASSETS_ENV, ours.path()),
            (KUBEBUILDER_ASSETS_ENV, theirs.path()),
        ]))
        .unwrap();
        assert_eq!(found.dir(), ours.path());
    }

    #[test]
    fn kubebuilder_assets_is_used_when_ours_is_unset() {
        let theirs = fake_assets();
        let found =
            Assets::locate_with(env_of(&[(KUBEBUILDER_ASSETS_ENV, theirs.path())])).unwrap();
        assert_eq!(found.etcd(), theirs.path().join("etcd"));
    }

    #[test]
    fn default_cache_is_keyed_by_kubernetes_version() {
        let home = tempfile::tempdir().unwrap();
        let dir = home
            .path()
            .join(".cache/multicluster-runtime/testenv")
            .join(KUBERNETES_VERSION);
        std::fs::create_dir_all(&dir).unwrap();
        for bin in [ETCD, KUBE_APISERVER] {
            std::fs::write(dir.join(bin), b"").unwrap();
        }
        let found = Assets::locate_with(env_of(&[("HOME", home.path())])).unwrap();
        assert_eq!(found.dir(), dir);
    }

    #[test]
    fn missing_binaries_error_names_the_variables_and_the_script() {
        let empty = tempfile::tempdir().unwrap();
        let err = Assets::locate_with(env_of(&[(ASSETS_ENV, empty.path())])).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("MCR_TESTENV_ASSETS"), "{msg}");
        assert!(msg.contains("KUBEBUILDER_ASSETS"), "{msg}");
        assert!(msg.contains("scripts/testenv-assets.sh"), "{msg}");
        assert!(msg.contains("Assets::locate_or_build()"), "{msg}");
        assert!(msg.contains("etcd"), "{msg}");

        let err = Assets::locate_with(env_of(&[("HOME", empty.path())])).unwrap_err();
        assert!(err.to_string().contains("default cache"), "{err}");
    }
}
