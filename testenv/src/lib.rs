//! Real Kubernetes control planes (`etcd` + `kube-apiserver`) on loopback, for tests.
//!
//! This is what controller-runtime's envtest is to Go controllers, for one cluster or a fleet:
//! each [`TestCluster`] is a real apiserver with its own certificates, reachable through a
//! [`kube::Client`], a [`kube::Config`] and a kubeconfig (as a string and as a file) that
//! providers can read. There are no nodes, controllers or scheduler: objects are stored and
//! watched, RBAC is enforced, CRDs are served.
//!
//! ```no_run
//! use multicluster_runtime_testenv::TestEnv;
//! use k8s_openapi::api::core::v1::ConfigMap;
//! use kube::Api;
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let env = TestEnv::builder().clusters(3).start().await?;
//! for cluster in env.clusters() {
//!     let cms: Api<ConfigMap> = Api::default_namespaced(cluster.client()?);
//!     println!("{}: {} configmaps", cluster.name(), cms.list(&Default::default()).await?.items.len());
//! }
//! // Every process is stopped and every temporary file removed when `env` is dropped.
//! # Ok(())
//! # }
//! ```
//!
//! # Binaries
//!
//! `etcd` and `kube-apiserver` are found as [`Assets::locate`] describes: `$MCR_TESTENV_ASSETS`,
//! else `$KUBEBUILDER_ASSETS` (binaries installed by controller-runtime's `setup-envtest` work),
//! else the cache that [`Assets::locate_or_build`] (or the repository's
//! `scripts/testenv-assets.sh`) fills by building them from their Go modules with the
//! machine's Go toolchain: about five minutes on two cores the first time, reused after.
//!
//! # Clean-up
//!
//! Dropping a [`TestEnv`] stops every process it started (SIGTERM, then SIGKILL after a grace
//! period) and removes its temporary directory, also while a test panics. If the test binary
//! dies without unwinding (killed, aborted, `exit`), a small guardian process it leaves behind
//! stops the control plane and removes the directory instead.

#![forbid(unsafe_code)]
#![cfg_attr(not(test), warn(clippy::unwrap_used, clippy::expect_used))]

mod assets;
mod pki;
mod process;

use std::fmt;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use base64::Engine as _;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, Patch, PatchParams};
use kube::client::ConfigExt as _;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube_runtime::wait::{await_condition, conditions};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_rustls::rustls::pki_types::ServerName;

pub use assets::{ASSETS_ENV, Assets, CACHE_ENV, KUBEBUILDER_ASSETS_ENV, KUBERNETES_VERSION};
use pki::{CertAndKey, ClusterPki, MAX_GROUPS};
use process::{Guardian, ManagedProcess};

/// How many times a process is restarted on fresh ports when it loses a bind race.
const BIND_ATTEMPTS: usize = 5;
/// How many log lines an error quotes.
const LOG_TAIL_LINES: usize = 25;
/// Default readiness timeout; a loaded 2-core machine can take tens of seconds.
pub const DEFAULT_READY_TIMEOUT: Duration = Duration::from_secs(60);
/// How long [`TestCluster::install_crds`] waits for each CRD to become Established.
const CRD_ESTABLISH_TIMEOUT: Duration = Duration::from_secs(30);

/// What went wrong while starting or using a test control plane. Every variant that concerns a
/// cluster names it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The `etcd` / `kube-apiserver` binaries were not found.
    #[error(
        "test control plane binaries not found: {detail}. Build them with \
         `Assets::locate_or_build()` (or the repository's `scripts/testenv-assets.sh`, which \
         prints the directory), or point {ASSETS_ENV} (or {KUBEBUILDER_ASSETS_ENV}) at a \
         directory holding `etcd` and `kube-apiserver`"
    )]
    AssetsNotFound {
        /// Where they were looked for and what was missing.
        detail: String,
    },
    /// Building the binaries ([`Assets::build`]) failed; its log went to standard error.
    #[error("building the test control plane binaries failed: {detail}")]
    AssetsBuild {
        /// What failed: a missing tool, or the build's exit status.
        detail: String,
    },
    /// A file-system or process operation failed.
    #[error("cluster {cluster}: failed to {action}: {source}")]
    Io {
        /// The cluster concerned.
        cluster: String,
        /// What was being done.
        action: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A process exited before it became ready.
    #[error(
        "cluster {cluster}: {process} exited before it was ready ({status}); last lines of {log}:\n{tail}"
    )]
    Exited {
        /// The cluster concerned.
        cluster: String,
        /// `etcd` or `kube-apiserver`.
        process: &'static str,
        /// How it exited.
        status: String,
        /// Its log file.
        log: PathBuf,
        /// The last lines of its log.
        tail: String,
    },
    /// A process did not become ready in time (it has been stopped).
    #[error(
        "cluster {cluster}: {process} was not ready within {timeout:?}; last lines of {log}:\n{tail}"
    )]
    NotReady {
        /// The cluster concerned.
        cluster: String,
        /// `etcd` or `kube-apiserver`.
        process: &'static str,
        /// The readiness timeout.
        timeout: Duration,
        /// Its log file.
        log: PathBuf,
        /// The last lines of its log.
        tail: String,
    },
    /// Generating certificates or keys failed.
    #[error("cluster {cluster}: certificate generation failed: {source}")]
    Certificate {
        /// The cluster concerned.
        cluster: String,
        /// The underlying error.
        #[source]
        source: rcgen::Error,
    },
    /// The generated kubeconfig could not be turned into a [`kube::Config`].
    #[error("cluster {cluster}: kubeconfig: {source}")]
    Kubeconfig {
        /// The cluster concerned.
        cluster: String,
        /// The underlying error.
        #[source]
        source: kube::config::KubeconfigError,
    },
    /// A Kubernetes API call failed.
    #[error("cluster {cluster}: {action}: {source}")]
    Kube {
        /// The cluster concerned.
        cluster: String,
        /// What was being done.
        action: String,
        /// The underlying error.
        #[source]
        source: kube::Error,
    },
    /// A manifest could not be parsed.
    #[error("cluster {cluster}: invalid manifest: {reason}")]
    Manifest {
        /// The cluster concerned.
        cluster: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A CRD was applied but did not become Established in time.
    #[error(
        "cluster {cluster}: CustomResourceDefinition {name} was not Established within {timeout:?}"
    )]
    CrdNotEstablished {
        /// The cluster concerned.
        cluster: String,
        /// The CRD's name.
        name: String,
        /// How long was waited.
        timeout: Duration,
    },
    /// An argument was invalid.
    #[error("{0}")]
    InvalidArgument(String),
    /// The cluster was stopped or removed; it cannot serve this call.
    #[error("cluster {cluster}: {reason}")]
    Unavailable {
        /// The cluster concerned.
        cluster: String,
        /// Why.
        reason: String,
    },
}

/// How the apiservers of a [`TestEnv`] store their data.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum EtcdLayout {
    /// One etcd for the whole environment; each apiserver keeps its data under its own
    /// `--etcd-prefix` (as Kubernetes' own integration tests do). The default: it costs one
    /// etcd process instead of one per cluster (figures in `BENCHMARKS.md`).
    #[default]
    Shared,
    /// One etcd per apiserver.
    PerCluster,
}

/// Builds a [`TestEnv`]. Defaults: one cluster, [`EtcdLayout::Shared`], binaries from
/// [`Assets::locate`], a readiness timeout of [`DEFAULT_READY_TIMEOUT`], cluster names
/// `cluster-0`, `cluster-1`, ...
#[derive(Clone, Debug)]
#[must_use]
pub struct TestEnvBuilder {
    clusters: usize,
    prefix: String,
    layout: EtcdLayout,
    assets: Option<Assets>,
    ready_timeout: Duration,
    apiserver_args: Vec<String>,
}

impl Default for TestEnvBuilder {
    fn default() -> Self {
        Self {
            clusters: 1,
            prefix: "cluster".to_string(),
            layout: EtcdLayout::default(),
            assets: None,
            ready_timeout: DEFAULT_READY_TIMEOUT,
            apiserver_args: Vec::new(),
        }
    }
}

impl TestEnvBuilder {
    /// How many clusters to start (default 1; 0 is allowed, add them later with
    /// [`TestEnv::add_cluster`]).
    pub fn clusters(mut self, n: usize) -> Self {
        self.clusters = n;
        self
    }

    /// Cluster names are `<prefix>-<n>` (default prefix `cluster`). The prefix must be a
    /// lowercase DNS label.
    pub fn name_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// How etcd is laid out (default [`EtcdLayout::Shared`]).
    pub fn etcd_layout(mut self, layout: EtcdLayout) -> Self {
        self.layout = layout;
        self
    }

    /// Use these binaries instead of [`Assets::locate`].
    pub fn assets(mut self, assets: Assets) -> Self {
        self.assets = Some(assets);
        self
    }

    /// How long each process may take to become ready (default [`DEFAULT_READY_TIMEOUT`]).
    pub fn ready_timeout(mut self, timeout: Duration) -> Self {
        self.ready_timeout = timeout;
        self
    }

    /// An extra `kube-apiserver` flag for every cluster, e.g. `--feature-gates=...`.
    pub fn apiserver_arg(mut self, arg: impl Into<String>) -> Self {
        self.apiserver_args.push(arg.into());
        self
    }

    /// Starts etcd and every cluster (concurrently) and waits until all are ready.
    pub async fn start(self) -> Result<TestEnv, Error> {
        if !is_dns_label(&self.prefix) {
            return Err(Error::InvalidArgument(format!(
                "cluster name prefix {:?} is not a lowercase DNS label",
                self.prefix
            )));
        }
        let assets = match self.assets {
            Some(assets) => assets,
            None => Assets::locate()?,
        };
        let io_err = |action: &str| {
            let action = action.to_string();
            move |source| Error::Io {
                cluster: "(environment)".into(),
                action,
                source,
            }
        };
        let root = tempfile::Builder::new()
            .prefix("mcr-testenv-")
            .tempdir()
            .map_err(io_err("create the temporary directory"))?;
        let guardian =
            Arc::new(Guardian::spawn(root.path()).map_err(io_err("start the guardian process"))?);
        let shared_etcd = match self.layout {
            EtcdLayout::Shared => Some(
                Etcd::start(
                    &assets,
                    root.path().join("etcd"),
                    "shared-etcd",
                    &guardian,
                    self.ready_timeout,
                )
                .await?,
            ),
            EtcdLayout::PerCluster => None,
        };
        let env = TestEnv {
            clusters: Mutex::new(Vec::new()),
            shared_etcd,
            next_index: AtomicUsize::new(0),
            prefix: self.prefix,
            layout: self.layout,
            assets,
            ready_timeout: self.ready_timeout,
            apiserver_args: self.apiserver_args,
            guardian,
            root,
        };
        // Started concurrently, listed in name order.
        let names: Vec<String> = (0..self.clusters).map(|_| env.next_name()).collect();
        let started =
            futures::future::join_all(names.into_iter().map(|n| env.start_cluster(n))).await;
        let mut clusters = Vec::with_capacity(started.len());
        for cluster in started {
            // On failure `env` is dropped here, stopping whatever did start.
            clusters.push(Arc::new(cluster?));
        }
        *lock(&env.clusters) = clusters;
        Ok(env)
    }
}

/// A set of running test clusters. Dropping it stops them all.
pub struct TestEnv {
    // Field order is drop order: clusters, then etcd, then the guardian and the directory.
    clusters: Mutex<Vec<Arc<TestCluster>>>,
    shared_etcd: Option<Etcd>,
    next_index: AtomicUsize,
    prefix: String,
    layout: EtcdLayout,
    assets: Assets,
    ready_timeout: Duration,
    apiserver_args: Vec<String>,
    guardian: Arc<Guardian>,
    root: tempfile::TempDir,
}

impl fmt::Debug for TestEnv {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TestEnv")
            .field(
                "clusters",
                &self
                    .clusters()
                    .iter()
                    .map(|c| c.name().to_string())
                    .collect::<Vec<_>>(),
            )
            .field("layout", &self.layout)
            .field("root", &self.root.path())
            .finish()
    }
}

impl TestEnv {
    /// A builder; see [`TestEnvBuilder`] for the defaults.
    pub fn builder() -> TestEnvBuilder {
        TestEnvBuilder::default()
    }

    /// Starts one cluster with the defaults.
    pub async fn start() -> Result<Self, Error> {
        Self::builder().start().await
    }

    /// The running clusters, in the order they were added.
    pub fn clusters(&self) -> Vec<Arc<TestCluster>> {
        lock(&self.clusters).clone()
    }

    /// The cluster at position `index` in [`TestEnv::clusters`].
    pub fn cluster(&self, index: usize) -> Option<Arc<TestCluster>> {
        lock(&self.clusters).get(index).cloned()
    }

    /// The cluster named `name`.
    pub fn cluster_named(&self, name: &str) -> Option<Arc<TestCluster>> {
        lock(&self.clusters)
            .iter()
            .find(|c| c.name == name)
            .cloned()
    }

    /// The etcd layout in use.
    pub fn etcd_layout(&self) -> EtcdLayout {
        self.layout
    }

    /// The environment's temporary directory (removed on drop).
    pub fn dir(&self) -> &Path {
        self.root.path()
    }

    /// Process ids of every running `etcd` and `kube-apiserver` of this environment.
    pub fn pids(&self) -> Vec<u32> {
        let mut pids: Vec<u32> = self.shared_etcd.iter().filter_map(Etcd::pid).collect();
        for cluster in self.clusters() {
            pids.extend(cluster.pids());
        }
        pids
    }

    /// Starts one more cluster, named `<prefix>-<n>`, and waits until it is ready.
    pub async fn add_cluster(&self) -> Result<Arc<TestCluster>, Error> {
        let cluster = Arc::new(self.start_cluster(self.next_name()).await?);
        lock(&self.clusters).push(cluster.clone());
        Ok(cluster)
    }

    /// Stops the cluster named `name` for good and forgets it (as if it were deleted). Its
    /// clients and kubeconfig stop working. Returns whether such a cluster existed.
    pub async fn remove_cluster(&self, name: &str) -> bool {
        let removed = {
            let mut clusters = lock(&self.clusters);
            let at = clusters.iter().position(|c| c.name == name);
            at.map(|i| clusters.remove(i))
        };
        match removed {
            Some(cluster) => {
                cluster.shut_down().await;
                true
            }
            None => false,
        }
    }

    fn next_name(&self) -> String {
        format!(
            "{}-{}",
            self.prefix,
            self.next_index.fetch_add(1, Ordering::SeqCst)
        )
    }

    async fn start_cluster(&self, name: String) -> Result<TestCluster, Error> {
        let dir = self.root.path().join(&name);
        let io = |action: &str| {
            let (cluster, action) = (name.clone(), action.to_string());
            move |source| Error::Io {
                cluster,
                action,
                source,
            }
        };
        let cert_dir = dir.join("certs");
        std::fs::create_dir_all(&cert_dir).map_err(io("create its directory"))?;
        let pki = ClusterPki::generate(&name).map_err(|source| Error::Certificate {
            cluster: name.clone(),
            source,
        })?;
        let admin = pki
            .issue_client("admin", &["system:masters".to_string()], None)
            .map_err(|source| Error::Certificate {
                cluster: name.clone(),
                source,
            })?;
        let files = [
            ("apiserver.crt", &pki.serving.cert_pem),
            ("apiserver.key", &pki.serving.key_pem),
            ("client-ca.crt", &pki.client_ca_pem),
            ("sa.key", &pki.service_account_key_pem),
            ("sa.pub", &pki.service_account_pub_pem),
        ];
        for (file, content) in files {
            std::fs::write(cert_dir.join(file), content).map_err(io("write its certificates"))?;
        }

        let (etcd, etcd_url) = match &self.shared_etcd {
            Some(shared) => (None, shared.url.clone()),
            None => {
                let etcd = Etcd::start(
                    &self.assets,
                    dir.join("etcd"),
                    &name,
                    &self.guardian,
                    self.ready_timeout,
                )
                .await?;
                let url = etcd.url.clone();
                (Some(etcd), url)
            }
        };

        let mut last_bind_error = None;
        for _ in 0..BIND_ATTEMPTS {
            let port = free_port().map_err(io("find a free port"))?;
            let server = format!("https://127.0.0.1:{port}");
            let kubeconfig = kubeconfig_yaml(&name, &server, &pki.serving_ca_pem, "admin", &admin);
            let config = config_from_kubeconfig(&name, &kubeconfig).await?;
            let args = apiserver_args(&cert_dir, &etcd_url, &name, port, &self.apiserver_args);
            let log = dir.join("kube-apiserver.log");
            let mut apiserver = ManagedProcess::spawn(
                "kube-apiserver",
                &self.assets.kube_apiserver(),
                &args,
                log,
                self.guardian.clone(),
            )
            .map_err(io("start kube-apiserver"))?;
            match wait_apiserver_ready(&name, &mut apiserver, &config, self.ready_timeout).await {
                Ok(()) => {
                    let kubeconfig_path = dir.join("kubeconfig");
                    std::fs::write(&kubeconfig_path, &kubeconfig)
                        .map_err(io("write its kubeconfig"))?;
                    tracing::debug!(cluster = %name, %server, "test cluster ready");
                    return Ok(TestCluster {
                        name,
                        server,
                        dir,
                        pki,
                        config,
                        kubeconfig,
                        kubeconfig_path,
                        apiserver_binary: self.assets.kube_apiserver(),
                        apiserver_args: args,
                        ready_timeout: self.ready_timeout,
                        guardian: self.guardian.clone(),
                        apiserver: Mutex::new(Some(apiserver)),
                        lifecycle: tokio::sync::Mutex::new(()),
                        etcd,
                        users: AtomicUsize::new(0),
                    });
                }
                Err(err) if lost_bind_race(&err) => {
                    tracing::debug!(cluster = %name, port, "kube-apiserver lost a bind race; retrying on another port");
                    last_bind_error = Some(err);
                }
                Err(err) => return Err(err),
            }
        }
        Err(last_bind_error
            .unwrap_or_else(|| Error::InvalidArgument("no bind attempt was made".into())))
    }
}

impl Drop for TestEnv {
    fn drop(&mut self) {
        // Apiservers first (they would log errors against a vanished etcd), then etcd; the
        // temporary directory goes last with the remaining fields.
        for cluster in lock(&self.clusters).drain(..) {
            cluster.shut_down_blocking();
        }
        if let Some(etcd) = &self.shared_etcd {
            etcd.stop_blocking();
        }
    }
}

/// A frozen apiserver (see [`TestCluster::pause`]); it runs on when this is resumed or dropped.
#[derive(Debug)]
#[must_use = "dropping it resumes the apiserver at once"]
pub struct Paused {
    pid: u32,
    cluster: String,
}

impl Paused {
    /// Lets the apiserver run on (SIGCONT).
    pub fn resume(self) {}

    /// The cluster whose apiserver is frozen.
    pub fn cluster(&self) -> &str {
        &self.cluster
    }
}

impl Drop for Paused {
    fn drop(&mut self) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.pid as i32),
            nix::sys::signal::Signal::SIGCONT,
        );
    }
}

/// One running test cluster: a kube-apiserver with its own certificates (and, with
/// [`EtcdLayout::PerCluster`], its own etcd).
pub struct TestCluster {
    name: String,
    server: String,
    dir: PathBuf,
    pki: ClusterPki,
    config: kube::Config,
    kubeconfig: String,
    kubeconfig_path: PathBuf,
    apiserver_binary: PathBuf,
    apiserver_args: Vec<String>,
    ready_timeout: Duration,
    guardian: Arc<Guardian>,
    /// The running apiserver; `None` while stopped.
    apiserver: Mutex<Option<ManagedProcess>>,
    /// Serialises [`TestCluster::stop`] and [`TestCluster::start`].
    lifecycle: tokio::sync::Mutex<()>,
    etcd: Option<Etcd>,
    users: AtomicUsize,
}

impl fmt::Debug for TestCluster {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TestCluster")
            .field("name", &self.name)
            .field("server", &self.server)
            .field("dir", &self.dir)
            .finish()
    }
}

impl TestCluster {
    /// The cluster's name, e.g. `cluster-0`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The apiserver's URL, `https://127.0.0.1:<port>`; it stays the same across
    /// [`TestCluster::stop`] and [`TestCluster::start`].
    pub fn server(&self) -> &str {
        &self.server
    }

    /// A client configuration for the cluster admin (group `system:masters`).
    pub fn config(&self) -> kube::Config {
        self.config.clone()
    }

    /// A new client for the cluster admin. Must be called within a tokio runtime.
    pub fn client(&self) -> Result<kube::Client, Error> {
        // secrets-lint: a certificate user, no credential plugin to fail.
        kube::Client::try_from(self.config.clone()).map_err(|source| Error::Kube {
            cluster: self.name.clone(),
            action: "build a client".into(),
            source,
        })
    }

    /// The admin kubeconfig as YAML (one cluster, user and context, all named after the
    /// cluster except the user `admin`; certificates embedded).
    pub fn kubeconfig(&self) -> &str {
        &self.kubeconfig
    }

    /// Path of a file holding [`TestCluster::kubeconfig`].
    pub fn kubeconfig_path(&self) -> &Path {
        &self.kubeconfig_path
    }

    /// The PEM certificate of the CA that signed the apiserver's serving certificate.
    pub fn ca_pem(&self) -> &str {
        &self.pki.serving_ca_pem
    }

    /// The cluster's directory (certificates, kubeconfigs, logs).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Path of the apiserver's log file.
    pub fn apiserver_log(&self) -> PathBuf {
        self.dir.join("kube-apiserver.log")
    }

    /// The apiserver's process id, if it is running.
    pub fn apiserver_pid(&self) -> Option<u32> {
        lock(&self.apiserver).as_ref().map(ManagedProcess::pid)
    }

    /// Whether the apiserver is running (not stopped and not exited).
    pub fn is_running(&self) -> bool {
        lock(&self.apiserver)
            .as_mut()
            .is_some_and(|p| p.try_exited().is_none())
    }

    fn pids(&self) -> Vec<u32> {
        self.apiserver_pid()
            .into_iter()
            .chain(self.etcd.as_ref().and_then(Etcd::pid))
            .collect()
    }

    /// Stops the apiserver (SIGTERM, then SIGKILL). Its data stays in etcd; [`TestCluster::start`]
    /// brings it back on the same port with the same certificates. Stopping a stopped cluster
    /// does nothing.
    pub async fn stop(&self) {
        let _serial = self.lifecycle.lock().await;
        let running = lock(&self.apiserver).take();
        if let Some(mut apiserver) = running {
            apiserver.stop().await;
        }
    }

    /// Kills the apiserver at once (SIGKILL: no graceful shutdown, connections cut mid-stream),
    /// as a crash would. [`TestCluster::start`] brings it back. Killing a stopped cluster does
    /// nothing.
    pub async fn kill(&self) {
        let _serial = self.lifecycle.lock().await;
        let running = lock(&self.apiserver).take();
        if let Some(mut apiserver) = running {
            apiserver.kill_now();
        }
    }

    /// Freezes the apiserver (SIGSTOP): connections stay open and requests hang, as with a
    /// host that stopped answering. It runs on when the returned guard is resumed or dropped
    /// (SIGCONT), so a test cannot leave it frozen.
    pub fn pause(&self) -> Result<Paused, Error> {
        let mut apiserver = lock(&self.apiserver);
        if let Some(process) = apiserver.as_mut()
            && process.signal(nix::sys::signal::Signal::SIGSTOP)
        {
            return Ok(Paused {
                pid: process.pid(),
                cluster: self.name.clone(),
            });
        }
        Err(Error::Unavailable {
            cluster: self.name.clone(),
            reason: "the apiserver is not running".into(),
        })
    }

    /// Starts the apiserver again after [`TestCluster::stop`] (same port, same data) and waits
    /// until it is ready. Starting a running cluster does nothing.
    pub async fn start(&self) -> Result<(), Error> {
        let _serial = self.lifecycle.lock().await;
        if self.is_running() {
            return Ok(());
        }
        if let Some(etcd) = &self.etcd
            && etcd.pid().is_none()
        {
            return Err(Error::Unavailable {
                cluster: self.name.clone(),
                reason: "the cluster was removed".into(),
            });
        }
        let io = |source| Error::Io {
            cluster: self.name.clone(),
            action: "start kube-apiserver".into(),
            source,
        };
        // The old port may linger briefly in the kernel; a few tries ride that out.
        let mut attempt = 0;
        loop {
            let mut apiserver = ManagedProcess::spawn(
                "kube-apiserver",
                &self.apiserver_binary,
                &self.apiserver_args,
                self.apiserver_log(),
                self.guardian.clone(),
            )
            .map_err(io)?;
            match wait_apiserver_ready(&self.name, &mut apiserver, &self.config, self.ready_timeout)
                .await
            {
                Ok(()) => {
                    *lock(&self.apiserver) = Some(apiserver);
                    return Ok(());
                }
                Err(err) if lost_bind_race(&err) && attempt < BIND_ATTEMPTS => {
                    attempt += 1;
                    tokio::time::sleep(Duration::from_millis(200 * attempt as u64)).await;
                }
                Err(err) => return Err(err),
            }
        }
    }

    /// How many WATCH requests for `resource` (a plural such as `configmaps`) the
    /// API server is serving right now, across all namespaces (`cluster_wide`) or in single
    /// namespaces, from its own `apiserver_longrunning_requests` metric. For tests that pin
    /// how many watches a controller opens; the API server's own informers count too, so
    /// compare against a figure taken before.
    pub async fn served_watches(&self, resource: &str, cluster_wide: bool) -> Result<usize, Error> {
        let kube_error = |source| Error::Kube {
            cluster: self.name.clone(),
            action: "read the apiserver's metrics".into(),
            source,
        };
        let request = http::Request::get("/metrics")
            .body(Vec::new())
            .map_err(|e| kube_error(kube::Error::HttpError(e)))?;
        let metrics = self
            .client()?
            .request_text(request)
            .await
            .map_err(kube_error)?;
        let scope = if cluster_wide { "cluster" } else { "namespace" };
        let (resource, scope) = (
            format!("resource=\"{resource}\""),
            format!("scope=\"{scope}\""),
        );
        Ok(metrics
            .lines()
            .filter(|l| l.starts_with("apiserver_longrunning_requests{"))
            .filter(|l| l.contains(&resource) && l.contains(&scope) && l.contains("verb=\"WATCH\""))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>() as usize)
    }

    /// Applies every `CustomResourceDefinition` in `yaml` (one or more YAML documents) with
    /// server-side apply and waits until each is Established. Returns their names.
    pub async fn install_crds(&self, yaml: &str) -> Result<Vec<String>, Error> {
        let manifest_err = |reason: String| Error::Manifest {
            cluster: self.name.clone(),
            reason,
        };
        let docs: Vec<serde_json::Value> =
            serde_saphyr::from_multiple(yaml).map_err(|e| manifest_err(e.to_string()))?;
        let mut crds = Vec::new();
        for doc in docs.into_iter().filter(|d| !d.is_null()) {
            let kind = doc
                .get("kind")
                .and_then(|k| k.as_str())
                .unwrap_or_default()
                .to_string();
            if kind != "CustomResourceDefinition" {
                return Err(manifest_err(format!(
                    "expected kind CustomResourceDefinition, found {kind:?}"
                )));
            }
            let crd: CustomResourceDefinition =
                serde_json::from_value(doc).map_err(|e| manifest_err(e.to_string()))?;
            crds.push(crd);
        }
        let api: Api<CustomResourceDefinition> = Api::all(self.client()?);
        let params = PatchParams::apply("multicluster-runtime-testenv").force();
        let mut names = Vec::new();
        for crd in &crds {
            let name = crd.metadata.name.clone().unwrap_or_default();
            api.patch(&name, &params, &Patch::Apply(crd))
                .await
                .map_err(|source| Error::Kube {
                    cluster: self.name.clone(),
                    action: format!("apply CustomResourceDefinition {name}"),
                    source,
                })?;
            names.push(name);
        }
        for name in &names {
            let established = await_condition(api.clone(), name, conditions::is_crd_established());
            match tokio::time::timeout(CRD_ESTABLISH_TIMEOUT, established).await {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => {
                    return Err(Error::Manifest {
                        cluster: self.name.clone(),
                        reason: format!("watching CustomResourceDefinition {name}: {e}"),
                    });
                }
                Err(_) => {
                    return Err(Error::CrdNotEstablished {
                        cluster: self.name.clone(),
                        name: name.clone(),
                        timeout: CRD_ESTABLISH_TIMEOUT,
                    });
                }
            }
        }
        Ok(names)
    }

    /// Issues a client certificate for a new user `name` in `groups` and returns its
    /// credentials. The user has no rights until RBAC grants some. At most two groups can be
    /// given (a limit of the certificate generator); `system:authenticated` is added by the
    /// apiserver itself.
    pub fn add_user(&self, name: &str, groups: &[&str]) -> Result<TestUser, Error> {
        self.add_user_with(name, groups, None)
    }

    /// A token for the ServiceAccount `namespace/account` (its `uid`), bound to the Secret
    /// `bound` (name, uid) if given, that ends `valid_for` from now: signed with the cluster's
    /// service-account key, as the apiserver signs its TokenRequests, so the apiserver takes
    /// it as its own (and refuses it once the ServiceAccount or the bound Secret is deleted).
    /// Unlike a TokenRequest, which lasts at least ten minutes, it may be short: to test
    /// tokens reaching their end.
    pub fn service_account_token(
        &self,
        namespace: &str,
        account: (&str, &str),
        bound: Option<(&str, &str)>,
        valid_for: Duration,
    ) -> Result<String, Error> {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let issuer = format!("{}/", self.server);
        let mut private = serde_json::json!({
            "namespace": namespace,
            "serviceaccount": { "name": account.0, "uid": account.1 },
        });
        if let Some((name, uid)) = bound {
            private["secret"] = serde_json::json!({ "name": name, "uid": uid });
        }
        let claims = serde_json::json!({
            "iss": issuer,
            "aud": [issuer],
            "sub": format!("system:serviceaccount:{namespace}:{}", account.0),
            "iat": now,
            "nbf": now,
            "exp": now + valid_for.as_secs(),
            "kubernetes.io": private,
        });
        self.pki
            .sign_service_account_jwt(&claims)
            .map_err(|source| Error::Certificate {
                cluster: self.name.clone(),
                source,
            })
    }

    /// As [`TestCluster::add_user`], with a certificate that expires `valid_for` from now:
    /// to test credentials that rotate.
    pub fn add_user_valid_for(
        &self,
        name: &str,
        groups: &[&str],
        valid_for: Duration,
    ) -> Result<TestUser, Error> {
        self.add_user_with(name, groups, Some(valid_for))
    }

    fn add_user_with(
        &self,
        name: &str,
        groups: &[&str],
        valid_for: Option<Duration>,
    ) -> Result<TestUser, Error> {
        if name.is_empty() || name.contains(['\n', '\r']) {
            return Err(Error::InvalidArgument(format!(
                "invalid user name {name:?}"
            )));
        }
        if groups.len() > MAX_GROUPS {
            return Err(Error::InvalidArgument(format!(
                "user {name}: at most {MAX_GROUPS} groups can be encoded in a test certificate, got {}",
                groups.len()
            )));
        }
        let groups: Vec<String> = groups.iter().map(|g| g.to_string()).collect();
        let creds = self
            .pki
            .issue_client(name, &groups, valid_for)
            .map_err(|source| Error::Certificate {
                cluster: self.name.clone(),
                source,
            })?;
        let kubeconfig = kubeconfig_yaml(
            &self.name,
            &self.server,
            &self.pki.serving_ca_pem,
            name,
            &creds,
        );
        let n = self.users.fetch_add(1, Ordering::SeqCst);
        let kubeconfig_path = self.dir.join(format!("kubeconfig-user-{n}"));
        std::fs::write(&kubeconfig_path, &kubeconfig).map_err(|source| Error::Io {
            cluster: self.name.clone(),
            action: format!("write the kubeconfig of user {name}"),
            source,
        })?;
        let mut config = self.config.clone();
        config.auth_info.client_certificate_data = Some(b64(&creds.cert_pem));
        config.auth_info.client_key_data = Some(b64(&creds.key_pem).into());
        Ok(TestUser {
            name: name.to_string(),
            groups,
            cluster: self.name.clone(),
            config,
            kubeconfig,
            kubeconfig_path,
        })
    }

    async fn shut_down(&self) {
        self.stop().await;
        if let Some(etcd) = &self.etcd {
            etcd.stop().await;
        }
    }

    fn shut_down_blocking(&self) {
        if let Some(mut apiserver) = lock(&self.apiserver).take() {
            apiserver.stop_blocking();
        }
        if let Some(etcd) = &self.etcd {
            etcd.stop_blocking();
        }
    }
}

/// Credentials of a user added with [`TestCluster::add_user`].
#[derive(Clone)]
pub struct TestUser {
    name: String,
    groups: Vec<String>,
    cluster: String,
    config: kube::Config,
    kubeconfig: String,
    kubeconfig_path: PathBuf,
}

// Not derived: the kubeconfig holds the user's private key.
impl fmt::Debug for TestUser {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TestUser")
            .field("name", &self.name)
            .field("groups", &self.groups)
            .field("cluster", &self.cluster)
            .finish_non_exhaustive()
    }
}

impl TestUser {
    /// The user name (the certificate's common name).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The groups the certificate carries.
    pub fn groups(&self) -> &[String] {
        &self.groups
    }

    /// A client configuration authenticating as this user.
    pub fn config(&self) -> kube::Config {
        self.config.clone()
    }

    /// A new client authenticating as this user. Must be called within a tokio runtime.
    pub fn client(&self) -> Result<kube::Client, Error> {
        // secrets-lint: a certificate user, no credential plugin to fail.
        kube::Client::try_from(self.config.clone()).map_err(|source| Error::Kube {
            cluster: self.cluster.clone(),
            action: format!("build a client for user {}", self.name),
            source,
        })
    }

    /// The user's kubeconfig as YAML.
    pub fn kubeconfig(&self) -> &str {
        &self.kubeconfig
    }

    /// Path of a file holding [`TestUser::kubeconfig`].
    pub fn kubeconfig_path(&self) -> &Path {
        &self.kubeconfig_path
    }
}

/// An etcd server (shared or one cluster's).
struct Etcd {
    url: String,
    process: Mutex<Option<ManagedProcess>>,
}

impl Etcd {
    async fn start(
        assets: &Assets,
        dir: PathBuf,
        owner: &str,
        guardian: &Arc<Guardian>,
        timeout: Duration,
    ) -> Result<Self, Error> {
        let io = |action: &str| {
            let (cluster, action) = (owner.to_string(), action.to_string());
            move |source| Error::Io {
                cluster,
                action,
                source,
            }
        };
        std::fs::create_dir_all(&dir).map_err(io("create the etcd directory"))?;
        let mut last_bind_error = None;
        for _ in 0..BIND_ATTEMPTS {
            let client_port = free_port().map_err(io("find a free port"))?;
            let peer_port = free_port().map_err(io("find a free port"))?;
            let url = format!("http://127.0.0.1:{client_port}");
            let peer = format!("http://127.0.0.1:{peer_port}");
            let data = dir.join("data");
            // A failed attempt may have left a half-initialised member behind.
            let _ = std::fs::remove_dir_all(&data);
            let args = vec![
                "--name=default".to_string(),
                format!("--data-dir={}", data.display()),
                format!("--listen-client-urls={url}"),
                format!("--advertise-client-urls={url}"),
                format!("--listen-peer-urls={peer}"),
                format!("--initial-advertise-peer-urls={peer}"),
                format!("--initial-cluster=default={peer}"),
                "--unsafe-no-fsync=true".to_string(),
                "--log-level=warn".to_string(),
            ];
            let mut process = ManagedProcess::spawn(
                "etcd",
                &assets.etcd(),
                &args,
                dir.join("etcd.log"),
                guardian.clone(),
            )
            .map_err(io("start etcd"))?;
            match wait_etcd_ready(owner, &mut process, client_port, timeout).await {
                Ok(()) => {
                    return Ok(Self {
                        url,
                        process: Mutex::new(Some(process)),
                    });
                }
                Err(err) if lost_bind_race(&err) => last_bind_error = Some(err),
                Err(err) => return Err(err),
            }
        }
        Err(last_bind_error
            .unwrap_or_else(|| Error::InvalidArgument("no bind attempt was made".into())))
    }

    fn pid(&self) -> Option<u32> {
        lock(&self.process).as_ref().map(ManagedProcess::pid)
    }

    async fn stop(&self) {
        let running = lock(&self.process).take();
        if let Some(mut process) = running {
            process.stop().await;
        }
    }

    fn stop_blocking(&self) {
        if let Some(mut process) = lock(&self.process).take() {
            process.stop_blocking();
        }
    }
}

fn apiserver_args(
    cert_dir: &Path,
    etcd_url: &str,
    name: &str,
    port: u16,
    extra: &[String],
) -> Vec<String> {
    let certs = |f: &str| cert_dir.join(f).display().to_string();
    let mut args = vec![
        format!("--etcd-servers={etcd_url}"),
        // Distinct per cluster, so that apiservers can share one etcd.
        format!("--etcd-prefix=/mcr/{name}/registry"),
        format!("--cert-dir={}", cert_dir.display()),
        format!("--tls-cert-file={}", certs("apiserver.crt")),
        format!("--tls-private-key-file={}", certs("apiserver.key")),
        format!("--secure-port={port}"),
        "--bind-address=127.0.0.1".to_string(),
        "--advertise-address=127.0.0.1".to_string(),
        "--service-cluster-ip-range=10.0.0.0/24".to_string(),
        "--allow-privileged=true".to_string(),
        "--authorization-mode=RBAC".to_string(),
        "--disable-admission-plugins=ServiceAccount".to_string(),
        format!("--client-ca-file={}", certs("client-ca.crt")),
        format!("--service-account-issuer=https://127.0.0.1:{port}/"),
        format!("--service-account-key-file={}", certs("sa.pub")),
        format!("--service-account-signing-key-file={}", certs("sa.key")),
        // No endpoints for the `kubernetes` Service: there is no network behind it, and
        // several apiservers must not fight over one Endpoints object.
        "--endpoint-reconciler-type=none".to_string(),
        "--profiling=false".to_string(),
    ];
    args.extend(extra.iter().cloned());
    args
}

async fn wait_apiserver_ready(
    cluster: &str,
    apiserver: &mut ManagedProcess,
    config: &kube::Config,
    timeout: Duration,
) -> Result<(), Error> {
    let port = config.cluster_url.port_u16().unwrap_or(443);
    let mut tls = config
        .rustls_client_config()
        .map_err(|source| Error::Kube {
            cluster: cluster.to_string(),
            action: "build the readiness probe's TLS configuration".into(),
            source,
        })?;
    tls.alpn_protocols = vec![b"http/1.1".to_vec()];
    let tls = Arc::new(tls);
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = apiserver.try_exited() {
            return Err(exited(cluster, apiserver, status));
        }
        let probe = apiserver_ready(tls.clone(), port);
        if let Ok(Ok(true)) = tokio::time::timeout(Duration::from_secs(5), probe).await {
            return Ok(());
        }
        if Instant::now() >= deadline {
            apiserver.stop().await;
            return Err(not_ready(cluster, apiserver, timeout));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `/readyz` answers 200 and the `default` namespace exists. The namespace is created by a
/// loop inside the apiserver that `/readyz` does not cover, so without the second check a
/// test's first write to `default` can race it (envtest waits for it too).
///
/// The probe speaks plain HTTP/1.1 over TLS instead of going through `kube::Client`, whose
/// tracing layer logs every 5xx (normal while the apiserver starts) at ERROR level.
async fn apiserver_ready(
    tls: Arc<tokio_rustls::rustls::ClientConfig>,
    port: u16,
) -> std::io::Result<bool> {
    for path in ["/readyz", "/api/v1/namespaces/default"] {
        let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
        let name = ServerName::IpAddress(std::net::Ipv4Addr::LOCALHOST.into());
        let stream = tokio_rustls::TlsConnector::from(tls.clone())
            .connect(name, tcp)
            .await?;
        if http_get_status(stream, path).await? != 200 {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Sends `GET path` over `stream` and returns the response's status code.
async fn http_get_status<S>(mut stream: S, path: &str) -> std::io::Result<u16>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let request = format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await?;
    stream.flush().await?;
    // The status line is all we need; it fits in the first read of any real response.
    let mut head = [0u8; 64];
    let mut len = 0;
    while len < head.len() {
        let n = stream.read(&mut head[len..]).await?;
        if n == 0 {
            break;
        }
        len += n;
        if head[..len].contains(&b'\n') {
            break;
        }
    }
    let line = String::from_utf8_lossy(&head[..len]);
    line.split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("bad status line {line:?}"),
            )
        })
}

async fn wait_etcd_ready(
    owner: &str,
    etcd: &mut ManagedProcess,
    port: u16,
    timeout: Duration,
) -> Result<(), Error> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = etcd.try_exited() {
            return Err(exited(owner, etcd, status));
        }
        if let Ok(Ok(true)) = tokio::time::timeout(Duration::from_secs(2), etcd_healthy(port)).await
        {
            return Ok(());
        }
        if Instant::now() >= deadline {
            etcd.stop().await;
            return Err(not_ready(owner, etcd, timeout));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `GET /health` on etcd's plain-HTTP client port answers 200.
async fn etcd_healthy(port: u16) -> std::io::Result<bool> {
    let stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    Ok(http_get_status(stream, "/health").await? == 200)
}

fn exited(cluster: &str, process: &ManagedProcess, status: std::process::ExitStatus) -> Error {
    Error::Exited {
        cluster: cluster.to_string(),
        process: process.kind,
        status: status.to_string(),
        log: process.log.clone(),
        tail: process.log_tail(LOG_TAIL_LINES),
    }
}

fn not_ready(cluster: &str, process: &ManagedProcess, timeout: Duration) -> Error {
    Error::NotReady {
        cluster: cluster.to_string(),
        process: process.kind,
        timeout,
        log: process.log.clone(),
        tail: process.log_tail(LOG_TAIL_LINES),
    }
}

/// Whether a start failed because another process took the port between our probe and the
/// child's bind.
fn lost_bind_race(err: &Error) -> bool {
    matches!(err, Error::Exited { tail, .. } if tail.contains("address already in use"))
}

/// A port that was free a moment ago. The child binds it later, so another process can take
/// it in between; callers retry on "address already in use".
fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind(("127.0.0.1", 0))?.local_addr()?.port())
}

fn b64(data: &str) -> String {
    base64::engine::general_purpose::STANDARD.encode(data)
}

fn kubeconfig_yaml(
    cluster: &str,
    server: &str,
    ca_pem: &str,
    user: &str,
    creds: &CertAndKey,
) -> String {
    // JSON strings are valid YAML scalars, which quotes arbitrary names safely.
    let q = |s: &str| serde_json::Value::from(s).to_string();
    // The user entry is named per cluster too, so that the kubeconfigs of one environment
    // merge (`KUBECONFIG=a:b`) without one cluster's admin credentials standing for another's.
    let user_entry = format!("{user}@{cluster}");
    let context = if user == "admin" {
        cluster.to_string()
    } else {
        user_entry.clone()
    };
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: {c}\n  cluster:\n    server: {server}\n    \
         certificate-authority-data: {ca}\nusers:\n- name: {u}\n  user:\n    client-certificate-data: {cert}\n    \
         client-key-data: {key}\ncontexts:\n- name: {ctx}\n  context:\n    cluster: {c}\n    user: {u}\n\
         current-context: {ctx}\n",
        c = q(cluster),
        server = q(server),
        ca = b64(ca_pem),
        u = q(&user_entry),
        cert = b64(&creds.cert_pem),
        key = b64(&creds.key_pem),
        ctx = q(&context),
    )
}

async fn config_from_kubeconfig(cluster: &str, yaml: &str) -> Result<kube::Config, Error> {
    let err = |source| Error::Kubeconfig {
        cluster: cluster.to_string(),
        source,
    };
    let kubeconfig = Kubeconfig::from_yaml(yaml).map_err(err)?;
    kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .map_err(err)
}

fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 40
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// Locks a mutex, recovering from poisoning: the data guarded here (process handles) stays
/// valid if a thread panicked while holding the lock, and clean-up must still run.
pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The code samples of `docs/testenv.md`, compiled as doctests.
#[cfg(doctest)]
#[doc = include_str!("../../docs/testenv.md")]
struct TestenvDocDoctests;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_kubeconfig_parses_and_quotes_names() {
        let pki = ClusterPki::generate("c").unwrap();
        let creds = pki.issue_client("we: \"odd\" user", &[], None).unwrap();
        let yaml = kubeconfig_yaml(
            "c",
            "https://127.0.0.1:1",
            &pki.serving_ca_pem,
            "we: \"odd\" user",
            &creds,
        );
        let kc = Kubeconfig::from_yaml(&yaml).unwrap();
        assert_eq!(kc.auth_infos[0].name, "we: \"odd\" user@c");
        assert_eq!(kc.current_context.as_deref(), Some("we: \"odd\" user@c"));
        assert_eq!(
            kc.clusters[0].cluster.as_ref().unwrap().server.as_deref(),
            Some("https://127.0.0.1:1")
        );
    }

    #[test]
    fn prefixes_must_be_dns_labels() {
        assert!(is_dns_label("cluster"));
        assert!(is_dns_label("a-1"));
        assert!(!is_dns_label("Cluster"));
        assert!(!is_dns_label("a/b"));
        assert!(!is_dns_label("-a"));
        assert!(!is_dns_label(""));
    }
}
