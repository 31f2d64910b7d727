//! Admission webhooks for a fleet ([`Webhooks`]): one HTTPS server in the manager, its
//! configuration installed and kept current in every engaged cluster, each review handed to
//! its handler with the cluster it came from.
//!
//! # How a member's review reaches its handler
//!
//! Each engaged cluster gets a `ValidatingWebhookConfiguration` and a
//! `MutatingWebhookConfiguration` (server-side apply, field manager
//! `multicluster-runtime-webhooks`) whose URLs are
//! `<url>/<cluster>/<token>/<webhook name>`, with the CA bundle of the server's certificate.
//! The token is a keyed hash of the cluster's id (HMAC-SHA-256 under a key only the
//! replicas hold, in the host Secret): the API server of a member sends no credential to a
//! URL webhook, so the path is what says which cluster a review is from, and a member's
//! administrator, who can read their own cluster's URL, cannot write another's. A review
//! whose token is not its cluster's, or whose cluster is not engaged, is refused with HTTP
//! 403 (the member's `failurePolicy` then decides), counted in
//! `multicluster_runtime_webhook_refused_total`, and never reaches a handler.
//!
//! # Trust
//!
//! - Anyone on the network who can reach the server can send requests; without a cluster's
//!   token they are refused before their body is read, and their connection is closed. No
//!   peer can hold the connections members' API servers need: connections that have not
//!   shown a valid route have short deadlines and the oldest is closed to make room
//!   (`docs/webhooks.md`, "What a peer can hold").
//! - The token is a low-value bearer credential: it is in the member's webhook
//!   configurations, and the member's API server prints the URL in its `failed calling
//!   webhook` errors, to the user whose write failed among others. It lets its holder send
//!   reviews as that cluster and nothing more, within that cluster's limits (reviews in
//!   flight, buffered bytes, kept connections), until the route key has turned over twice
//!   ([`Webhooks::route_rotation`], a day by default). The host Secret holds the route keys
//!   and the CA key: whoever reads it can impersonate the server to every member.
//! - A member's administrator can send reviews as their own cluster (they can anyway: they
//!   own its API server), and can remove or change the configuration in their cluster
//!   (the manager applies it again on the next engagement or CA rotation, not at once).
//! - Handlers get what the member's API server sent: the object and the user are as that
//!   cluster's API server saw them, nothing more.

mod certs;
mod component;
pub(crate) mod install;
pub(crate) mod review;
pub(crate) mod route;
pub(crate) mod server;

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
pub use kube::core::admission::Operation;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::cluster::ClusterId;

pub(crate) use certs::Keeper;
pub(crate) use component::WebhookServer;
pub(crate) use install::install_task;
#[cfg(feature = "fuzzing")]
pub(crate) use server::{Refusal, route as route_request};
pub(crate) use server::{ServerShared, serve};

/// The name every manager's configuration objects had before the name was made from the
/// URL: one of this name whose webhooks all route under a manager's URL is that manager's,
/// and is removed once the configurations of the new name are applied.
pub(crate) const LEGACY_CONFIGURATION_NAME: &str = "multicluster-runtime";

/// The annotation that marks a configuration as a manager's: its webhooks' base URL. A
/// configuration of the manager's name without it (and whose webhooks do not route under
/// that URL) is someone else's: never forced, never deleted.
pub(crate) const OWNER_ANNOTATION: &str = "webhooks.multicluster-runtime.io/url";

/// `<prefix>-<10 hexadecimal digits of the URL's SHA-256>`: the same for every replica
/// of one product (they share the URL), different for two products (they cannot).
fn derived(prefix: &str, url: &str) -> String {
    let digest = ring::digest::digest(&ring::digest::SHA256, url.as_bytes());
    let mut out = format!("{prefix}-");
    for byte in &digest.as_ref()[..5] {
        use std::fmt::Write as _;
        let _ = write!(out, "{byte:02x}");
    }
    out
}
/// The default name of the host Secret holding the certificates and route key.
pub const DEFAULT_SECRET_NAME: &str = "multicluster-runtime-webhook";

/// One review, as a handler gets it.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Review<C, K> {
    /// The cluster whose API server sent the review.
    pub cluster: C,
    /// `CREATE`, `UPDATE`, `DELETE` or `CONNECT`.
    pub operation: Operation,
    /// The object's name (empty on a create with `generateName`).
    pub name: String,
    /// The object's namespace, if it has one.
    pub namespace: Option<String>,
    /// The object as it would be stored (`None` on `DELETE`).
    pub object: Option<K>,
    /// The object as it is stored now (on `UPDATE` and `DELETE`).
    pub old_object: Option<K>,
    /// Who is asking, as that cluster's API server authenticated them.
    pub user_info: k8s_openapi::api::authentication::v1::UserInfo,
    /// The request will not be stored (`kubectl --dry-run=server`): do nothing outside the
    /// answer.
    pub dry_run: bool,
    /// The review's id, unique per request.
    pub uid: String,
}

/// A validating handler's answer: allowed, or denied with a reason the user reads (HTTP 403,
/// reason `Forbidden`, as controller-runtime denies), with warnings either way.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Verdict {
    pub(crate) denied: Option<String>,
    pub(crate) warnings: Vec<String>,
}

impl Verdict {
    /// Allowed.
    pub fn allow() -> Self {
        Self::default()
    }

    /// Denied: `reason` is shown as `admission webhook "<name>" denied the request: <reason>`.
    pub fn deny(reason: impl Into<String>) -> Self {
        Self {
            denied: Some(reason.into()),
            warnings: Vec::new(),
        }
    }

    /// Adds a warning, shown to the client (kubectl prints it) whatever the outcome.
    #[must_use]
    pub fn warn(mut self, warning: impl Into<String>) -> Self {
        self.warnings.push(warning.into());
        self
    }

    /// Whether the request is allowed.
    pub fn is_allowed(&self) -> bool {
        self.denied.is_none()
    }
}

/// A mutating handler's answer: the object unchanged, or changed (the patch sent is the
/// difference), or the request denied; with warnings.
#[derive(Clone, Debug)]
pub struct Mutation<K> {
    pub(crate) object: Option<K>,
    pub(crate) denied: Option<String>,
    pub(crate) warnings: Vec<String>,
}

impl<K> Mutation<K> {
    /// Nothing to change.
    pub fn unchanged() -> Self {
        Self {
            object: None,
            denied: None,
            warnings: Vec::new(),
        }
    }

    /// The object as it should be stored (the review's `object`, changed).
    pub fn changed(object: K) -> Self {
        Self {
            object: Some(object),
            ..Self::unchanged()
        }
    }

    /// Denied, as [`Verdict::deny`].
    pub fn deny(reason: impl Into<String>) -> Self {
        Self {
            denied: Some(reason.into()),
            ..Self::unchanged()
        }
    }

    /// Adds a warning, shown to the client.
    #[must_use]
    pub fn warn(mut self, warning: impl Into<String>) -> Self {
        self.warnings.push(warning.into());
        self
    }
}

/// What the member's API server does when the webhook cannot answer (unreachable, timed
/// out, refused) and what a handler's error (or panic) comes to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FailurePolicy {
    /// The request fails: the API server answers 500 `InternalError` ("failed calling
    /// webhook"); a handler's error is a denial with status 500. Kubernetes' default.
    #[default]
    Fail,
    /// The request goes on as if the webhook allowed it; a handler's error is an allowed
    /// answer with a warning naming the webhook.
    Ignore,
}

impl FailurePolicy {
    fn as_str(self) -> &'static str {
        match self {
            Self::Fail => "Fail",
            Self::Ignore => "Ignore",
        }
    }
}

/// Where the webhook configurations are installed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Install {
    /// In every engaged cluster of the fleet (with sharding, each replica installs in the
    /// clusters it owns; every replica serves them all).
    #[default]
    Fleet,
    /// In the host (the manager's local cluster) only, as Go's multicluster-runtime and
    /// controller-runtime serve webhooks.
    Host,
    /// In the host and every engaged cluster.
    FleetAndHost,
    /// Nowhere: the configurations are yours to write ([`Manager::webhook_url`](crate::Manager::webhook_url)
    /// gives each cluster's URLs). Reviews from the fleet's clusters and the host are served.
    Nothing,
}

/// The function that makes a hook's handle for its settings.
type MakeHandle<C> = Arc<dyn Fn(review::Settings) -> review::Handle<C> + Send + Sync>;

/// One webhook: a handler of reviews of one kind, and what its configuration says.
#[derive(Clone)]
pub struct Hook<C: ClusterId> {
    pub(crate) name: String,
    pub(crate) mutating: bool,
    pub(crate) group: String,
    pub(crate) version: String,
    pub(crate) resource: String,
    pub(crate) operations: Vec<Operation>,
    pub(crate) namespace_selector: Option<LabelSelector>,
    pub(crate) object_selector: Option<LabelSelector>,
    pub(crate) failure_policy: FailurePolicy,
    pub(crate) timeout: Duration,
    make: MakeHandle<C>,
}

impl<C: ClusterId> std::fmt::Debug for Hook<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hook")
            .field("name", &self.name)
            .field("mutating", &self.mutating)
            .field(
                "resource",
                &format!("{}/{}/{}", self.group, self.version, self.resource),
            )
            .field("operations", &self.operations)
            .field("failure_policy", &self.failure_policy)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

/// The namespaces a hook leaves alone by default: Kubernetes' own.
const SYSTEM_NAMESPACES: [&str; 3] = ["kube-system", "kube-public", "kube-node-lease"];

impl<C: ClusterId> Hook<C> {
    fn new<K>(name: String, mutating: bool, make: MakeHandle<C>) -> Self
    where
        K: kube::Resource<DynamicType = ()>,
    {
        Self {
            name,
            mutating,
            group: K::group(&()).into_owned(),
            version: K::version(&()).into_owned(),
            resource: K::plural(&()).into_owned(),
            operations: vec![Operation::Create, Operation::Update],
            namespace_selector: Some(LabelSelector {
                match_expressions: Some(vec![
                    k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelectorRequirement {
                        key: "kubernetes.io/metadata.name".into(),
                        operator: "NotIn".into(),
                        values: Some(SYSTEM_NAMESPACES.iter().map(|s| s.to_string()).collect()),
                    },
                ]),
                match_labels: None,
            }),
            object_selector: None,
            failure_policy: FailurePolicy::Fail,
            timeout: Duration::from_secs(10),
            make,
        }
    }

    /// A validating webhook of kind `K` named `name` (a fully qualified name, as Kubernetes
    /// asks: `owners.fleet.example.com`). The handler's error is treated as the failure
    /// policy says.
    pub fn validating<K, F, Fut, E>(name: impl Into<String>, handler: F) -> Self
    where
        K: kube::Resource<DynamicType = ()> + DeserializeOwned + Send + 'static,
        F: Fn(Review<C, K>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Verdict, E>> + Send + 'static,
        E: std::fmt::Display,
    {
        let handler = Arc::new(handler);
        let make: MakeHandle<C> = Arc::new(move |settings| {
            let handler = handler.clone();
            review::validating(settings, move |review| handler(review))
        });
        Self::new::<K>(name.into(), false, make)
    }

    /// A mutating webhook of kind `K` named `name`: the handler returns the object as it
    /// should be, and the patch sent is the difference, in `K`'s form (fields `K` does not
    /// know are left as they are).
    pub fn mutating<K, F, Fut, E>(name: impl Into<String>, handler: F) -> Self
    where
        K: kube::Resource<DynamicType = ()> + DeserializeOwned + Serialize + Clone + Send + 'static,
        F: Fn(Review<C, K>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Mutation<K>, E>> + Send + 'static,
        E: std::fmt::Display,
    {
        let handler = Arc::new(handler);
        let make: MakeHandle<C> = Arc::new(move |settings| {
            let handler = handler.clone();
            review::mutating(settings, move |review| handler(review))
        });
        Self::new::<K>(name.into(), true, make)
    }

    /// The operations reviewed (default `CREATE` and `UPDATE`).
    #[must_use]
    pub fn operations(mut self, operations: impl IntoIterator<Item = Operation>) -> Self {
        self.operations = operations.into_iter().collect();
        self
    }

    /// Only objects in namespaces this selects are reviewed (default: every namespace but
    /// `kube-system`, `kube-public` and `kube-node-lease`; `None`: all).
    #[must_use]
    pub fn namespace_selector(mut self, selector: Option<LabelSelector>) -> Self {
        self.namespace_selector = selector;
        self
    }

    /// Only objects whose labels this selects are reviewed (default: all).
    #[must_use]
    pub fn object_selector(mut self, selector: LabelSelector) -> Self {
        self.object_selector = Some(selector);
        self
    }

    /// What happens when the webhook cannot answer, or its handler fails (default
    /// [`FailurePolicy::Fail`]).
    #[must_use]
    pub fn failure_policy(mut self, policy: FailurePolicy) -> Self {
        self.failure_policy = policy;
        self
    }

    /// How long the API server waits for an answer (1 to 30 s; default 10 s).
    #[must_use]
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    pub(crate) fn handle(&self) -> review::Handle<C> {
        (self.make)(review::Settings {
            name: Arc::from(self.name.as_str()),
            failure_policy: self.failure_policy,
        })
    }
}

/// A fleet's admission webhooks: the server's address, the URL members reach it at, the
/// hooks, where the certificates come from and where the configurations go. Given to
/// [`Manager::webhooks`](crate::Manager::webhooks).
///
/// ```no_run
/// use k8s_openapi::api::core::v1::ConfigMap;
/// use multicluster_runtime::webhook::{Hook, Review, Verdict, Webhooks};
/// use multicluster_runtime::ClusterName;
///
/// let webhooks = Webhooks::<ClusterName>::new(
///     "0.0.0.0:9443".parse().unwrap(),
///     "https://webhooks.example.com:9443",
/// )
/// .hook(Hook::validating(
///     "owners.fleet.example.com",
///     |review: Review<ClusterName, ConfigMap>| async move {
///         let owned = review.object.as_ref().and_then(|cm| cm.metadata.annotations.as_ref())
///             .is_some_and(|a| a.contains_key("fleet.example.com/owner"));
///         Ok::<_, std::convert::Infallible>(if owned {
///             Verdict::allow()
///         } else {
///             Verdict::deny(format!("in cluster {}: no owner annotation", review.cluster))
///         })
///     },
/// ));
/// ```
#[derive(Clone)]
pub struct Webhooks<C: ClusterId> {
    pub(crate) addr: SocketAddr,
    pub(crate) url: String,
    pub(crate) configuration: String,
    /// The field manager of the configurations (made from the URL).
    pub(crate) field_manager: String,
    pub(crate) hooks: Vec<Hook<C>>,
    pub(crate) certificates: certs::CertSource,
    pub(crate) secret: Option<(Option<String>, String)>,
    pub(crate) names: Vec<String>,
    pub(crate) install: Install,
    pub(crate) check_every: Duration,
    /// `None`: sized from the open-file limit.
    pub(crate) connections: Option<usize>,
    /// `None`: the default for the install (a day, or never with [`Install::Nothing`]).
    pub(crate) route_every: Option<Option<Duration>>,
    pub(crate) budget: server::Budget,
}

impl<C: ClusterId> std::fmt::Debug for Webhooks<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Webhooks")
            .field("addr", &self.addr)
            .field("url", &self.url)
            .field("configuration", &self.configuration)
            .field("hooks", &self.hooks)
            .field("install", &self.install)
            .finish_non_exhaustive()
    }
}

impl<C: ClusterId> Webhooks<C> {
    /// Webhooks served at `addr` (port 0: any free port) and reached by members at `url`
    /// (`https://host:port` with an optional path: a Service's or load balancer's address
    /// in production, `https://127.0.0.1:<port>` on one machine). Certificates are made by the
    /// crate and kept in the host Secret [`DEFAULT_SECRET_NAME`] of the host client's
    /// default namespace (a CA valid a year, serving certificates 90 days, both rotated
    /// ahead of time); configurations are named `multicluster-runtime-<hash of the URL>`
    /// ([`Webhooks::configuration`]) and installed in every engaged cluster.
    pub fn new(addr: SocketAddr, url: impl Into<String>) -> Self {
        let url = url.into().trim_end_matches('/').to_string();
        Self {
            addr,
            configuration: derived("multicluster-runtime", &url),
            field_manager: derived("multicluster-runtime-webhooks", &url),
            url,
            hooks: Vec::new(),
            certificates: certs::CertSource::Generated(certs::Generated {
                ca_validity: Duration::from_secs(365 * 24 * 3600),
                serving_validity: Duration::from_secs(90 * 24 * 3600),
            }),
            secret: Some((None, DEFAULT_SECRET_NAME.into())),
            names: Vec::new(),
            install: Install::Fleet,
            check_every: Duration::from_secs(60),
            connections: None,
            route_every: None,
            budget: server::Budget {
                per_cluster: 32,
                bytes: 64 << 20,
            },
        }
    }

    /// Adds a hook.
    #[must_use]
    pub fn hook(mut self, hook: Hook<C>) -> Self {
        self.hooks.push(hook);
        self
    }

    /// The name of the configuration objects (one validating, one mutating) in each cluster,
    /// in place of the one made from the URL. Two managers serving the same clusters need
    /// different names: a configuration of this name that another manager or tool made is
    /// left alone (an install failure says so), never overwritten or deleted.
    #[must_use]
    pub fn configuration_name(mut self, name: impl Into<String>) -> Self {
        self.configuration = name.into();
        self
    }

    /// The name of the configuration objects: the one given to
    /// [`Webhooks::configuration_name`], else `multicluster-runtime-` and ten hexadecimal
    /// digits of the URL's SHA-256 (every replica of a manager computes the same; two
    /// managers, at two URLs, never do). Give it to `resourceNames` in the members' RBAC.
    pub fn configuration(&self) -> &str {
        &self.configuration
    }

    /// Where the configurations are installed (default [`Install::Fleet`]).
    #[must_use]
    pub fn install(mut self, install: Install) -> Self {
        self.install = install;
        self
    }

    /// The host Secret holding the certificates the crate makes and the route key
    /// (`namespace`: `None` for the host client's default namespace). Every replica must
    /// name the same one.
    #[must_use]
    pub fn secret(mut self, namespace: Option<String>, name: impl Into<String>) -> Self {
        self.secret = Some((namespace, name.into()));
        self
    }

    /// How long the CA and the serving certificates the crate makes are valid. A new CA is
    /// added to the bundle at two thirds of the current one's life and signs from five
    /// sixths on; a serving certificate is made again at two thirds of its life.
    #[must_use]
    pub fn validity(mut self, ca: Duration, serving: Duration) -> Self {
        self.certificates = certs::CertSource::Generated(certs::Generated {
            ca_validity: ca,
            serving_validity: serving,
        });
        self
    }

    /// Serves the certificate chain and key of these PEM files and gives members the CA
    /// bundle of `ca` (all read again when they change), instead of certificates the crate
    /// makes. The route key still lives in the host Secret (or, without a host, in this
    /// process only: one replica).
    #[must_use]
    pub fn certificate_files(
        mut self,
        cert: impl Into<PathBuf>,
        key: impl Into<PathBuf>,
        ca: impl Into<PathBuf>,
    ) -> Self {
        self.certificates = certs::CertSource::Files {
            cert: cert.into(),
            key: key.into(),
            ca: ca.into(),
        };
        self
    }

    /// More names (DNS names, IP addresses) for the certificate the crate makes, beside the
    /// URL's host.
    #[must_use]
    pub fn names(mut self, names: impl IntoIterator<Item = impl Into<String>>) -> Self {
        self.names.extend(names.into_iter().map(Into::into));
        self
    }

    /// How often certificates are looked at (read, rotated) and files read again (default
    /// one minute).
    #[must_use]
    pub fn check_every(mut self, every: Duration) -> Self {
        self.check_every = every;
        self
    }

    /// How long a route key makes the members' URLs before the next one takes over (default
    /// one day; never with [`Install::Nothing`], whose configurations are yours to write;
    /// `None`: never). The next key is made half-way through a turn and accepted by every
    /// replica from then on; at the turn's end it makes the URLs (the configurations are
    /// applied again in every member), and the key before it is still accepted until the
    /// next turn ends. A token a member's error message revealed is worthless after two
    /// turns at most. At least six times [`Webhooks::check_every`].
    #[must_use]
    pub fn route_rotation(mut self, every: Option<Duration>) -> Self {
        self.route_every = Some(every);
        self
    }

    /// The route key's turn: as set, or the install's default.
    pub(crate) fn route_rotation_period(&self) -> Option<Duration> {
        self.route_every.unwrap_or(match self.install {
            Install::Nothing => None,
            _ => Some(Duration::from_secs(24 * 3600)),
        })
    }

    /// How many connections the server holds at once (default: half the process's
    /// open-file limit). An eighth of them (at most 4,096) is for connections that have not
    /// shown a valid route yet, which are closed oldest first to make room for newcomers;
    /// the rest stay open for members' API servers, 64 at most for one cluster. See
    /// `docs/webhooks.md` for what a peer can hold.
    #[must_use]
    pub fn max_connections(mut self, connections: usize) -> Self {
        self.connections = Some(connections);
        self
    }

    /// How many reviews of one cluster are handled at once (default 32): more are answered
    /// `429 Too Many Requests` (the member's failure policy decides), and counted in
    /// `multicluster_runtime_webhook_throttled_total{reason="in_flight"}`.
    #[must_use]
    pub fn reviews_per_cluster(mut self, reviews: usize) -> Self {
        self.budget.per_cluster = reviews.max(1);
        self
    }

    /// How many bytes of review bodies are held in memory at once (default 64 MiB; a
    /// quarter of it for one cluster, but always room for one review of the largest size,
    /// 7 MiB): a review is given room for its declared length before its body is read, and
    /// answered `429` when there is none (`reason="memory"`).
    #[must_use]
    pub fn body_budget(mut self, bytes: usize) -> Self {
        self.budget.bytes = bytes;
        self
    }

    /// The URL's host (for the certificate) and path (the routes' base), or why the URL
    /// cannot be used.
    pub(crate) fn url_parts(&self) -> Result<(String, String), String> {
        let uri: http::Uri = self
            .url
            .parse()
            .map_err(|e| format!("the webhook URL {:?} is not a URL: {e}", self.url))?;
        // Kubernetes refuses user info and fragments in a webhook URL.
        if uri.authority().is_some_and(|a| a.as_str().contains('@')) || self.url.contains('#') {
            return Err(format!(
                "the webhook URL {:?} may not have user info or a fragment",
                self.url
            ));
        }
        if uri.scheme_str() != Some("https") {
            return Err(format!("the webhook URL {:?} must be https", self.url));
        }
        if uri.query().is_some() {
            return Err(format!(
                "the webhook URL {:?} may not have a query",
                self.url
            ));
        }
        let host = uri
            .host()
            .ok_or_else(|| format!("the webhook URL {:?} has no host", self.url))?
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_string();
        let path = uri.path().trim_end_matches('/');
        // The API server sends the path decoded and cleaned (`path.Join`): a base written
        // otherwise would match no review.
        let rewritten = path.contains('%')
            || path
                .split('/')
                .skip(1)
                .any(|segment| segment.is_empty() || segment == "." || segment == "..");
        if rewritten {
            return Err(format!(
                "the webhook URL {:?} has a path the API server would rewrite (an empty, `.` or `..` segment, or a `%` escape): write it as it would be sent",
                self.url
            ));
        }
        Ok((host, path.to_string()))
    }

    /// The settings checked: names fully qualified and unique, timeouts in range, the URL
    /// usable.
    pub(crate) fn validate(&self) -> Result<(), String> {
        self.url_parts()?;
        let mut seen = std::collections::BTreeSet::new();
        for hook in &self.hooks {
            let name = &hook.name;
            let valid = name.split('.').count() >= 3
                && name.split('.').all(|part| {
                    !part.is_empty()
                        && part
                            .bytes()
                            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                });
            if !valid {
                return Err(format!(
                    "webhook name {name:?} must be fully qualified (three or more lower-case DNS labels: owners.fleet.example.com)"
                ));
            }
            if !seen.insert(name.clone()) {
                return Err(format!("webhook name {name:?} is used twice"));
            }
            if !(1..=30).contains(&hook.timeout.as_secs()) {
                return Err(format!(
                    "webhook {name}: the timeout must be 1 to 30 seconds"
                ));
            }
            if hook.operations.is_empty() {
                return Err(format!("webhook {name}: no operation to review"));
            }
        }
        if self.hooks.is_empty() {
            return Err("no hook: add one with Webhooks::hook".into());
        }
        if let Some(every) = self.route_rotation_period()
            && self.check_every.saturating_mul(6) > every
        {
            // Each replica reads the next key twice at least before it makes URLs.
            return Err(format!(
                "check_every ({:?}) must be at most a sixth of the route rotation ({every:?})",
                self.check_every
            ));
        }
        if let certs::CertSource::Generated(generated) = &self.certificates
            && self.check_every.saturating_mul(6) > generated.ca_validity
        {
            // A rotation has a sixth of the CA's life between its steps.
            return Err(format!(
                "check_every ({:?}) must be at most a sixth of the CA's validity ({:?})",
                self.check_every, generated.ca_validity
            ));
        }
        if let certs::CertSource::Generated(generated) = &self.certificates
            && self.check_every.saturating_mul(3) > generated.serving_validity
        {
            // A serving certificate is renewed two checks ahead of its end, and must
            // outlive one more check.
            return Err(format!(
                "check_every ({:?}) must be at most a third of the serving certificates' validity ({:?})",
                self.check_every, generated.serving_validity
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::ClusterName;
    use k8s_openapi::api::core::v1::ConfigMap;

    fn at(url: &str) -> Webhooks<ClusterName> {
        Webhooks::new("127.0.0.1:0".parse().unwrap(), url).hook(Hook::validating(
            "owners.fleet.example.com",
            |_: Review<ClusterName, ConfigMap>| async { Ok::<_, String>(Verdict::allow()) },
        ))
    }

    #[test]
    fn two_managers_get_their_own_configuration_name_and_field_manager() {
        let (a, b) = (
            at("https://hooks-a.example.com/admission"),
            at("https://hooks-b.example.com/admission"),
        );
        assert_ne!(a.configuration(), b.configuration());
        assert_ne!(a.field_manager, b.field_manager);
        assert_ne!(a.configuration(), LEGACY_CONFIGURATION_NAME);
        // Every replica of one manager computes the same (a trailing slash is no other URL).
        let again = at("https://hooks-a.example.com/admission/");
        assert_eq!(a.configuration(), again.configuration());
        assert_eq!(a.field_manager, again.field_manager);
        assert!(a.configuration().starts_with("multicluster-runtime-"));
        assert_eq!(a.configuration().len(), "multicluster-runtime-".len() + 10);
        assert_eq!(
            at("https://h").configuration_name("mine").configuration(),
            "mine"
        );
    }

    #[test]
    fn a_serving_validity_shorter_than_three_checks_is_refused() {
        let hooks = at("https://h")
            .check_every(Duration::from_secs(60))
            .validity(Duration::from_secs(3600), Duration::from_secs(179));
        let error = hooks.validate().unwrap_err();
        assert!(error.contains("serving"), "{error}");
        let hooks = at("https://h")
            .check_every(Duration::from_secs(60))
            .validity(Duration::from_secs(3600), Duration::from_secs(180));
        assert_eq!(hooks.validate(), Ok(()));
    }

    #[test]
    fn a_base_path_the_api_server_would_rewrite_is_refused() {
        for good in [
            "https://hooks.example.com",
            "https://hooks.example.com/",
            "https://hooks.example.com/admission",
            "https://hooks.example.com/a/b-c_d.e~f/",
        ] {
            assert_eq!(at(good).validate(), Ok(()), "{good}");
        }
        // The API server sends the cleaned, decoded path: routes under these would never
        // match, and every review would be a 404.
        for bad in [
            "https://hooks.example.com/a//b",
            "https://hooks.example.com/a/./b",
            "https://hooks.example.com/a/../b",
            "https://hooks.example.com/.",
            "https://hooks.example.com/x%41",
            "https://hooks.example.com/a%2Fb",
        ] {
            let error = at(bad).validate().unwrap_err();
            assert!(error.contains("path"), "{bad}: {error}");
        }
    }
}
