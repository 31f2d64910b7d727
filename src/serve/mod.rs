//! [`Endpoints`]: the small server of a running manager: `/metrics` for Prometheus,
//! `/healthz` and `/readyz` for the kubelet's probes, and handlers of your own; HTTPS with
//! authentication and authorization by the host cluster unless plain HTTP is asked for.

mod auth;
mod component;
#[cfg(feature = "profiling")]
mod profile;
pub(crate) mod slots;
mod tls;
mod view;

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::fmt::Write as _;
use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::cluster::{Cluster, ClusterId};
use crate::fleet::Fleet;
use slots::{Lease, Slots};

pub(crate) use auth::{AuthVerdict, Authorizer};
pub(crate) use component::EndpointsComponent;
pub(crate) use tls::{Certificates, TlsSource};
pub(crate) use view::{ShardSource, ViewSources};

/// A named check of `/healthz` or `/readyz`: `Err` says why it fails.
pub type Check = Arc<dyn Fn() -> Result<(), String> + Send + Sync>;

/// A handler of your own ([`Endpoints::handler`]): the request (its body read, up to 1 MiB)
/// to the response.
pub type Handler = Arc<
    dyn Fn(Request<Bytes>) -> Pin<Box<dyn Future<Output = Response<Bytes>> + Send>> + Send + Sync,
>;

/// The permission the per-cluster detail (`?verbose`) needs: the metrics' (which name the
/// same clusters and count their errors). Not `/readyz`'s own: Kubernetes' default
/// `system:public-info-viewer` role lets everyone, even unauthenticated, `get` `/healthz`,
/// `/livez` and `/readyz`.
const DETAIL: &str = "/metrics";

/// The endpoints' connections ([`crate::slots`]): a sixteenth of the open-file limit, 128 to
/// 1,024. Connections that have not yet been answered `200` for what they asked (a probe's
/// connection never is: it is closed after its answer) are closed oldest first to make room
/// for newcomers, so that no client, however many connections it opens, keeps the kubelet's
/// probes out; 64 connections of authorized clients (scrapers) stay open between requests.
fn limits() -> crate::serve::slots::Limits {
    let total = crate::serve::slots::file_limit()
        .map(|limit| usize::try_from(limit / 16).unwrap_or(usize::MAX))
        .unwrap_or(256)
        .clamp(128, 1024);
    let verified = 64;
    let unverified = total - verified;
    crate::serve::slots::Limits {
        unverified,
        per_peer: unverified / 4,
        verified,
        per_group: verified,
        handshake: std::time::Duration::from_secs(3),
        // A request's headers, and its token's review (at most `auth::REVIEW_TIMEOUT`).
        first_request: std::time::Duration::from_secs(10),
        idle: std::time::Duration::from_secs(120),
        header: std::time::Duration::from_secs(10),
    }
}

/// How much of a request's body a handler gets, and how long it may take to come.
const MAX_BODY: usize = 1 << 20;
const BODY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// What a manager serves while it runs ([`Manager::serve`](crate::Manager::serve)):
///
/// | path | answer | who may ask |
/// | --- | --- | --- |
/// | `/metrics` | the registry in Prometheus' text format (OpenMetrics), if one was given | a bearer token the host authenticates and authorizes for `get` on the non-resource URL `/metrics` |
/// | `/healthz`, `/livez` | `200 ok` while the manager runs and every check of [`Endpoints::healthz_check`] passes (`500` naming the failing checks otherwise): the answer comes from its runtime, so a wedged runtime fails the probe by not answering | anyone |
/// | `/readyz` | `200 ok` once the manager runs, its host cluster's watches have listed (and none fails) and every check of [`Endpoints::readyz_check`] passes; `503` before, and once it is stopping. Member clusters do not count: one cluster of a large fleet still listing, or failing, must not take the replica out of its Service. With [`Endpoints::strict`], every engaged cluster must have listed and none be failing | anyone |
/// | `/readyz?verbose`, `/healthz?verbose` | the same status, with the checks and a line per cluster (its watches, whether they listed, why not) | as `/metrics` (Kubernetes' default roles let everyone `get` `/readyz` itself) |
/// | `/debug/mcr/fleet` | the diagnostics view as JSON ([`crate::diagnostics`]) | a token the host authorizes for `get` on that path; through the API server's proxy, in [`FORWARDED_AUTHORIZATION`](crate::diagnostics::FORWARDED_AUTHORIZATION) |
/// | a path of [`Endpoints::handler`] | yours | as `/metrics`, for the request's verb on that path |
///
/// By default the server speaks HTTPS with a certificate it makes itself (or from
/// [`Endpoints::tls_files`]), and checks bearer tokens with the host cluster's `TokenReview`
/// and `SubjectAccessReview` (answers cached for a minute, denials for 10 s), as
/// controller-runtime's secure metrics do. The host client is
/// [`Endpoints::authorize_with`]'s, else the manager's local cluster's
/// ([`Manager::with_local`](crate::Manager::with_local)); with neither, the run fails at
/// start. [`Endpoints::plain_http`] serves plain HTTP to anyone instead: for local
/// development and tests, never on a network others reach.
///
/// RBAC for a scraper: a ClusterRole with `nonResourceURLs: ["/metrics"]`, `verbs: ["get"]`;
/// for the controller: `create` on `tokenreviews.authentication.k8s.io` and
/// `subjectaccessreviews.authorization.k8s.io` (the `system:auth-delegator` ClusterRole).
#[derive(Clone)]
pub struct Endpoints {
    pub(crate) addr: SocketAddr,
    pub(crate) registry: Option<Arc<Registry>>,
    pub(crate) strict: bool,
    pub(crate) plain: bool,
    pub(crate) tls: TlsSource,
    pub(crate) authorizer: Option<kube::Client>,
    pub(crate) healthz: Vec<(String, Check)>,
    pub(crate) readyz: Vec<(String, Check)>,
    pub(crate) handlers: BTreeMap<String, Handler>,
}

impl std::fmt::Debug for Endpoints {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names = |checks: &[(String, Check)]| -> Vec<String> {
            checks.iter().map(|(name, _)| name.clone()).collect()
        };
        f.debug_struct("Endpoints")
            .field("addr", &self.addr)
            .field("metrics", &self.registry.is_some())
            .field("strict", &self.strict)
            .field("plain_http", &self.plain)
            .field("tls", &self.tls)
            .field("authorize_with", &self.authorizer.is_some())
            .field("healthz", &names(&self.healthz))
            .field("readyz", &names(&self.readyz))
            .field("handlers", &self.handlers.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl Endpoints {
    /// HTTPS endpoints at `addr` (port 0: any free port, see
    /// [`Manager::served_at`](crate::Manager::served_at)), with a self-signed certificate and
    /// the host's authentication and authorization.
    pub fn new(addr: SocketAddr) -> Self {
        Self {
            addr,
            registry: None,
            strict: false,
            plain: false,
            tls: TlsSource::SelfSigned,
            authorizer: None,
            healthz: Vec::new(),
            readyz: Vec::new(),
            handlers: BTreeMap::new(),
        }
    }

    /// Serves `registry` at `/metrics` (the one given to [`Metrics::new`](crate::Metrics::new),
    /// with any metrics of your own).
    #[must_use]
    pub fn metrics(mut self, registry: Arc<Registry>) -> Self {
        self.registry = Some(registry);
        self
    }

    /// `/readyz` also waits for every engaged cluster's watches to list, and fails while
    /// any is failing (off by default: only the manager and its host decide).
    #[must_use]
    pub fn strict(mut self, strict: bool) -> Self {
        self.strict = strict;
        self
    }

    /// Serves the certificate chain and key of these PEM files (a mounted Secret's
    /// `tls.crt` and `tls.key`), read again when they change.
    #[must_use]
    pub fn tls_files(mut self, cert: impl Into<PathBuf>, key: impl Into<PathBuf>) -> Self {
        self.tls = TlsSource::Files {
            cert: cert.into(),
            key: key.into(),
        };
        self
    }

    /// Checks tokens with this cluster's `TokenReview` and `SubjectAccessReview` (the
    /// cluster the controller runs in, as a rule).
    #[must_use]
    pub fn authorize_with(mut self, client: kube::Client) -> Self {
        self.authorizer = Some(client);
        self
    }

    /// Plain HTTP, and everything served to anyone who can connect: metrics, the per-cluster
    /// detail, your handlers. For local development and tests only.
    #[must_use]
    pub fn plain_http(mut self) -> Self {
        self.plain = true;
        self
    }

    /// Adds a check of `/healthz` (controller-runtime's `AddHealthzCheck`): the process is
    /// unhealthy (and restarted by the kubelet) while it fails. Keep it cheap and
    /// synchronous: it runs on every probe.
    #[must_use]
    pub fn healthz_check(
        mut self,
        name: impl Into<String>,
        check: impl Fn() -> Result<(), String> + Send + Sync + 'static,
    ) -> Self {
        self.healthz.push((name.into(), Arc::new(check)));
        self
    }

    /// Adds a check of `/readyz` (controller-runtime's `AddReadyzCheck`): the replica is
    /// taken out of its Services while it fails.
    #[must_use]
    pub fn readyz_check(
        mut self,
        name: impl Into<String>,
        check: impl Fn() -> Result<(), String> + Send + Sync + 'static,
    ) -> Self {
        self.readyz.push((name.into(), Arc::new(check)));
        self
    }

    /// Serves a CPU profile of the process at `/debug/pprof/profile?seconds=N` (30 s by
    /// default, 300 at most), in the pprof format that `go tool pprof` and other viewers
    /// read: behind the same authentication and authorization as `/metrics` (`get` on that
    /// path), one profile at a time (a second request meanwhile is answered 409). Off by
    /// default; with [`Endpoints::plain_http`] anyone who can connect may take one. The
    /// profiler samples with `SIGPROF` at 99 Hz while a profile is taken, and not otherwise.
    #[cfg(feature = "profiling")]
    #[must_use]
    pub fn profiling(mut self, on: bool) -> Self {
        if on {
            self.handler(profile::PATH, profile::cpu)
        } else {
            self.handlers.remove(profile::PATH);
            self
        }
    }

    /// Serves `handler` at `path` (exactly; a path the endpoints serve themselves is not
    /// replaced), behind the same authentication and authorization as `/metrics` (the
    /// request's method, lower-cased, as the verb).
    #[must_use]
    pub fn handler<F, Fut>(mut self, path: impl Into<String>, handler: F) -> Self
    where
        F: Fn(Request<Bytes>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Response<Bytes>> + Send + 'static,
    {
        self.handlers.insert(
            path.into(),
            Arc::new(move |request| Box::pin(handler(request))),
        );
        self
    }
}

/// What the handlers read.
pub(crate) struct Served<C: ClusterId> {
    pub(crate) fleet: Fleet<C>,
    /// The cluster whose watches readiness waits for (the local cluster, or the single
    /// provider's).
    pub(crate) host: Option<Cluster<C>>,
    pub(crate) local: Option<Cluster<C>>,
    pub(crate) endpoints: Endpoints,
    /// `None`: plain HTTP, everyone may ask.
    pub(crate) authorizer: Option<Arc<Authorizer>>,
    /// Cancelled once the manager is stopping.
    pub(crate) stopping: CancellationToken,
    /// What the diagnostics view reads beyond the fleet.
    pub(crate) view: ViewSources,
    /// Where fleet controllers answer for their queues.
    pub(crate) diagnostics: Option<Arc<crate::diagnostics::Controllers<C>>>,
    /// Who this replica is.
    pub(crate) instance: Arc<str>,
}

/// Serves on `listener` until `stop`, over TLS with `tls` (plain if `None`); connections open
/// then are closed.
pub(crate) async fn serve<C: ClusterId>(
    listener: TcpListener,
    tls: Option<Arc<rustls::ServerConfig>>,
    served: Arc<Served<C>>,
    stop: CancellationToken,
) {
    let acceptor = tls.map(tokio_rustls::TlsAcceptor::from);
    let connections = TaskTracker::new();
    let slots = Slots::new(limits());
    loop {
        let accepted = tokio::select! {
            () = stop.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(error) => {
                // Out of file descriptors, most likely: let some close before trying again.
                tracing::debug!(%error, "endpoints: accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            }
        };
        // Always a slot: the oldest connection that has not been served yet makes room.
        let slot = slots.admit(peer.ip());
        let served = served.clone();
        let stop = stop.clone();
        let acceptor = acceptor.clone();
        connections.spawn(async move {
            let lease = slot.lease().clone();
            let service = hyper::service::service_fn(move |req| {
                let served = served.clone();
                let lease = lease.clone();
                async move { Ok::<_, Infallible>(answer_on(&served, &lease, req).await) }
            });
            let drain = std::time::Duration::from_secs(1);
            match acceptor {
                Some(acceptor) => {
                    let Some(stream) = slot.handshake(&acceptor, stream).await else {
                        return;
                    };
                    slots::serve_connection(&slot, stream, service, &stop, drain).await;
                }
                None => slots::serve_connection(&slot, stream, service, &stop, drain).await,
            }
        });
    }
    connections.close();
    connections.wait().await;
}

/// The answer to `req`, on a connection that stays open only for clients it served: the
/// probes' connections and every refusal are closed.
async fn answer_on<C: ClusterId>(
    served: &Served<C>,
    lease: &Lease,
    req: Request<Incoming>,
) -> Response<Full<Bytes>> {
    let _busy = lease.busy();
    let probe = matches!(req.uri().path(), "/healthz" | "/livez" | "/readyz");
    let response = answer(served, lease, req).await;
    if response.status().is_success() && !probe && lease.is_verified() {
        response
    } else {
        slots::closing(response)
    }
}

const PLAIN: &str = "text/plain; charset=utf-8";

fn text(
    status: StatusCode,
    body: impl Into<Bytes>,
    content_type: &'static str,
) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(body.into()));
    *response.status_mut() = status;
    if let Ok(value) = hyper::header::HeaderValue::from_str(content_type) {
        response
            .headers_mut()
            .insert(hyper::header::CONTENT_TYPE, value);
    }
    response
}

/// The bearer token of a request, if it has one: in `Authorization`, else (for the
/// diagnostics view only, which `mcr status` reads through the API server's proxy) in
/// [`FORWARDED_AUTHORIZATION`](crate::diagnostics::FORWARDED_AUTHORIZATION).
fn bearer(req: &Request<Incoming>) -> Option<&str> {
    let headers = req.headers();
    let forwarded = || {
        (req.uri().path() == crate::diagnostics::PATH)
            .then(|| headers.get(crate::diagnostics::FORWARDED_AUTHORIZATION))
            .flatten()
    };
    let value = headers
        .get(hyper::header::AUTHORIZATION)
        .or_else(forwarded)?
        .to_str()
        .ok()?;
    let (scheme, token) = value.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

/// Whether the request may have what it asks (`path`, `verb`), or the answer refusing it.
/// An allowed request's connection is evictable no more (and kept, if there is room).
async fn allowed<C: ClusterId>(
    served: &Served<C>,
    lease: &Lease,
    req: &Request<Incoming>,
    path: &str,
    verb: &str,
) -> Result<(), Response<Full<Bytes>>> {
    let Some(authorizer) = &served.authorizer else {
        lease.verify("");
        return Ok(());
    };
    match authorizer.check(bearer(req), path, verb).await {
        AuthVerdict::Allowed => {
            lease.verify("");
            Ok(())
        }
        AuthVerdict::Unauthenticated => {
            let mut response = text(StatusCode::UNAUTHORIZED, "unauthorized\n", PLAIN);
            response.headers_mut().insert(
                hyper::header::WWW_AUTHENTICATE,
                hyper::header::HeaderValue::from_static("Bearer"),
            );
            Err(response)
        }
        AuthVerdict::Forbidden => Err(text(StatusCode::FORBIDDEN, "forbidden\n", PLAIN)),
        AuthVerdict::Unavailable => Err(text(
            StatusCode::SERVICE_UNAVAILABLE,
            "the host cluster could not check the credentials\n",
            PLAIN,
        )),
    }
}

async fn answer<C: ClusterId>(
    served: &Served<C>,
    lease: &Lease,
    req: Request<Incoming>,
) -> Response<Full<Bytes>> {
    let path = req.uri().path().to_string();
    // The verb a handler's request is authorized as is its method lower-cased: only the
    // methods whose names say what they do.
    let known = matches!(
        *req.method(),
        Method::GET | Method::HEAD | Method::POST | Method::PUT | Method::PATCH | Method::DELETE
    );
    if !known {
        return text(
            StatusCode::METHOD_NOT_ALLOWED,
            "method not allowed\n",
            PLAIN,
        );
    }
    if let Some(handler) = served.endpoints.handlers.get(&path).cloned()
        && !matches!(
            path.as_str(),
            "/metrics" | "/healthz" | "/livez" | "/readyz" | crate::diagnostics::PATH
        )
    {
        let verb = req.method().as_str().to_ascii_lowercase();
        if let Err(refused) = allowed(served, lease, &req, &path, &verb).await {
            return refused;
        }
        let (parts, body) = req.into_parts();
        // Authorized, but still bounded: the body comes within `BODY_TIMEOUT` or not at all.
        let body = match tokio::time::timeout(BODY_TIMEOUT, Limited::new(body, MAX_BODY).collect())
            .await
        {
            Ok(Ok(body)) => body.to_bytes(),
            Ok(Err(_)) => return text(StatusCode::PAYLOAD_TOO_LARGE, "body too large\n", PLAIN),
            Err(_) => return text(StatusCode::REQUEST_TIMEOUT, "body too slow\n", PLAIN),
        };
        let (parts, body) = handler(Request::from_parts(parts, body)).await.into_parts();
        return Response::from_parts(parts, Full::new(body));
    }
    if req.method() != Method::GET && req.method() != Method::HEAD {
        return text(StatusCode::METHOD_NOT_ALLOWED, "GET only\n", PLAIN);
    }
    let verbose = req.uri().query().is_some_and(|q| {
        q.split('&')
            .any(|p| p == "verbose" || p.starts_with("verbose="))
    });
    match path.as_str() {
        "/metrics" => {
            if let Err(refused) = allowed(served, lease, &req, "/metrics", "get").await {
                return refused;
            }
            let Some(registry) = served.endpoints.registry.clone() else {
                return text(StatusCode::NOT_FOUND, "no metrics registry\n", PLAIN);
            };
            // Encoding reads every series (tens of thousands in a large fleet): off the
            // async workers.
            let encoded = tokio::task::spawn_blocking(move || {
                let mut body = String::new();
                prometheus_client::encoding::text::encode(&mut body, &registry).map(|()| body)
            })
            .await;
            match encoded {
                Ok(Ok(body)) => text(
                    StatusCode::OK,
                    body,
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                ),
                _ => text(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "could not encode the metrics\n",
                    PLAIN,
                ),
            }
        }
        "/healthz" | "/livez" => {
            if verbose && let Err(refused) = allowed(served, lease, &req, DETAIL, "get").await {
                return refused;
            }
            let (healthy, detail) = checks(&served.endpoints.healthz);
            let mut body = String::from(if healthy { "ok\n" } else { "unhealthy\n" });
            if verbose {
                body.push_str(&detail);
            }
            let status = if healthy {
                StatusCode::OK
            } else {
                StatusCode::INTERNAL_SERVER_ERROR
            };
            text(status, body, PLAIN)
        }
        "/readyz" => {
            if verbose && let Err(refused) = allowed(served, lease, &req, DETAIL, "get").await {
                return refused;
            }
            let (ready, detail) = readiness(served, verbose);
            let status = if ready {
                StatusCode::OK
            } else {
                StatusCode::SERVICE_UNAVAILABLE
            };
            let mut body = String::from(if ready { "ok\n" } else { "not ready\n" });
            if verbose {
                body.push_str(&detail);
            }
            text(status, body, PLAIN)
        }
        crate::diagnostics::PATH => {
            if let Err(refused) =
                allowed(served, lease, &req, crate::diagnostics::PATH, "get").await
            {
                return refused;
            }
            let view = view::take(served).await;
            match serde_json::to_string_pretty(&view) {
                Ok(body) => text(StatusCode::OK, body, "application/json"),
                Err(_) => text(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "could not encode the view\n",
                    PLAIN,
                ),
            }
        }
        _ => text(StatusCode::NOT_FOUND, "not found\n", PLAIN),
    }
}

/// Whether every check passes, and a line per check.
fn checks(checks: &[(String, Check)]) -> (bool, String) {
    let mut passed = true;
    let mut detail = String::new();
    for (name, check) in checks {
        match check() {
            Ok(()) => {
                let _ = writeln!(detail, "check {name}: ok");
            }
            Err(why) => {
                passed = false;
                let _ = writeln!(detail, "check {name}: failed: {why}");
            }
        }
    }
    (passed, detail)
}

/// Whether the manager is ready, and (when `verbose`) a line per check and per cluster. A
/// probe that is neither verbose nor strict looks at the host alone, not at every member of
/// a large fleet.
fn readiness<C: ClusterId>(served: &Served<C>, verbose: bool) -> (bool, String) {
    let (mut ready, mut detail) = checks(&served.endpoints.readyz);
    if served.stopping.is_cancelled() {
        ready = false;
        detail.push_str("manager: stopping\n");
    } else {
        detail.push_str("manager: running\n");
    }
    let clusters: Vec<Cluster<C>> = if verbose || served.endpoints.strict {
        served
            .local
            .iter()
            .cloned()
            .chain(served.fleet.clusters())
            .collect()
    } else {
        served.host.iter().cloned().collect()
    };
    for cluster in clusters {
        let is_host = served
            .host
            .as_ref()
            .is_some_and(|h| h.same_instance(&cluster));
        // The host decides; members only with `strict`.
        let counts = is_host || served.endpoints.strict;
        let status = cluster.cache_status();
        let mut problems = Vec::new();
        for watch in &status {
            match (&watch.error, watch.synced) {
                (None, true) => {}
                (None, false) => {
                    ready &= !counts;
                    let state = if watch.overdue {
                        "not listed within the cache sync timeout"
                    } else {
                        "listing"
                    };
                    problems.push(format!("{} {state}", watch.kind));
                }
                (Some(error), synced) => {
                    ready &= !counts;
                    let state = match (synced, watch.overdue) {
                        (true, _) => "stale, failing",
                        (false, true) => "not listed within the cache sync timeout, failing",
                        (false, false) => "failing",
                    };
                    problems.push(format!("{} {state}: {error}", watch.kind));
                }
            }
        }
        let role = if is_host { "host" } else { "cluster" };
        let _ = write!(detail, "{role} {}: ", cluster.id());
        if problems.is_empty() {
            let _ = writeln!(detail, "ok ({} watches listed)", status.len());
        } else {
            let _ = writeln!(detail, "{}", problems.join("; "));
        }
    }
    (ready, detail)
}
