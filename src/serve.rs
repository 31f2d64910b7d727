//! [`Endpoints`]: the small HTTP server of a running manager: `/metrics` for Prometheus,
//! `/healthz` and `/readyz` for the kubelet's probes.

use std::convert::Infallible;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::Arc;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::{Cluster, ClusterId, Fleet};

/// What a manager serves over HTTP while it runs ([`Manager::serve`](crate::Manager::serve)):
///
/// | path | answer |
/// | --- | --- |
/// | `/metrics` | the registry in Prometheus' text format (OpenMetrics), if one was given |
/// | `/healthz` | `200 ok` while the manager runs: the answer comes from its runtime, so a wedged runtime fails the probe by not answering |
/// | `/readyz` | `200` while the manager runs and no engaged cluster's watch is still listing for the first time; a watch that is failing (an unreachable server, a forbidden kind, a missing CRD) is reported, not made the pod's problem: one bad cluster must not take the controller out of its Service. With [`Endpoints::strict`], any failing watch makes it `503` too |
/// | `/readyz?verbose` | the same status, with a line per cluster: its watches' kinds, whether they listed, and why not |
///
/// Off unless set; bind to `0.0.0.0:8080`-like addresses in a pod.
#[derive(Clone, Debug)]
pub struct Endpoints {
    pub(crate) addr: SocketAddr,
    pub(crate) registry: Option<Arc<Registry>>,
    pub(crate) strict: bool,
}

impl Endpoints {
    /// The endpoints at `addr` (port 0: any free port, see
    /// [`Manager::served_at`](crate::Manager::served_at)).
    pub fn new(addr: SocketAddr) -> Self {
        Self {
            addr,
            registry: None,
            strict: false,
        }
    }

    /// Serves `registry` at `/metrics` (the one given to [`Metrics::new`](crate::Metrics::new),
    /// with any metrics of your own).
    #[must_use]
    pub fn metrics(mut self, registry: Arc<Registry>) -> Self {
        self.registry = Some(registry);
        self
    }

    /// `/readyz` fails while any engaged cluster's watch is failing, as well as while one is
    /// still listing (off by default: failing clusters are only reported).
    #[must_use]
    pub fn strict(mut self, strict: bool) -> Self {
        self.strict = strict;
        self
    }
}

/// What the handlers read.
pub(crate) struct Served<C: ClusterId> {
    pub(crate) fleet: Fleet<C>,
    pub(crate) local: Option<Cluster<C>>,
    pub(crate) registry: Option<Arc<Registry>>,
    pub(crate) strict: bool,
}

/// Serves on `listener` until `stop`; connections open then are closed.
pub(crate) async fn serve<C: ClusterId>(
    listener: TcpListener,
    served: Arc<Served<C>>,
    stop: CancellationToken,
) {
    let connections = TaskTracker::new();
    loop {
        let accepted = tokio::select! {
            () = stop.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(error) => {
                tracing::debug!(%error, "endpoints: accept failed");
                continue;
            }
        };
        let served = served.clone();
        let stop = stop.clone();
        connections.spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                let served = served.clone();
                async move { Ok::<_, Infallible>(answer(&served, &req)) }
            });
            let connection =
                hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), service);
            tokio::pin!(connection);
            tokio::select! {
                _ = connection.as_mut() => {}
                () = stop.cancelled() => {
                    connection.as_mut().graceful_shutdown();
                    let _ = tokio::time::timeout(std::time::Duration::from_secs(1), connection).await;
                }
            }
        });
    }
    connections.close();
    connections.wait().await;
}

fn text(status: StatusCode, body: String, content_type: &'static str) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    if let Ok(value) = hyper::header::HeaderValue::from_str(content_type) {
        response
            .headers_mut()
            .insert(hyper::header::CONTENT_TYPE, value);
    }
    response
}

fn answer<C: ClusterId>(served: &Served<C>, req: &Request<Incoming>) -> Response<Full<Bytes>> {
    const PLAIN: &str = "text/plain; charset=utf-8";
    if req.method() != Method::GET && req.method() != Method::HEAD {
        return text(StatusCode::METHOD_NOT_ALLOWED, "GET only\n".into(), PLAIN);
    }
    let verbose = req.uri().query().is_some_and(|q| {
        q.split('&')
            .any(|p| p == "verbose" || p.starts_with("verbose="))
    });
    match req.uri().path() {
        "/metrics" => match &served.registry {
            Some(registry) => {
                let mut body = String::new();
                match prometheus_client::encoding::text::encode(&mut body, registry) {
                    Ok(()) => text(
                        StatusCode::OK,
                        body,
                        "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    ),
                    Err(_) => text(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        "could not encode the metrics\n".into(),
                        PLAIN,
                    ),
                }
            }
            None => text(StatusCode::NOT_FOUND, "no metrics registry\n".into(), PLAIN),
        },
        "/healthz" | "/livez" => text(StatusCode::OK, "ok\n".into(), PLAIN),
        "/readyz" => {
            let (ready, detail) = readiness(served);
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
        _ => text(StatusCode::NOT_FOUND, "not found\n".into(), PLAIN),
    }
}

/// Whether the manager is ready, and a line per cluster.
fn readiness<C: ClusterId>(served: &Served<C>) -> (bool, String) {
    let mut ready = true;
    let mut detail = String::new();
    let clusters = served.local.iter().cloned().chain(served.fleet.clusters());
    for cluster in clusters {
        let status = cluster.cache_status();
        let mut problems = Vec::new();
        for watch in &status {
            match (&watch.error, watch.synced) {
                (None, true) => {}
                // Still listing, without an error yet: wait for it.
                (None, false) => {
                    ready = false;
                    problems.push(format!("{} listing", watch.kind));
                }
                // Failing (before its first listing, or since): reported; only strict waits.
                (Some(error), synced) => {
                    if served.strict {
                        ready = false;
                    }
                    let state = if synced { "stale, failing" } else { "failing" };
                    problems.push(format!("{} {state}: {error}", watch.kind));
                }
            }
        }
        let _ = write!(detail, "cluster {}: ", cluster.id());
        if problems.is_empty() {
            let _ = writeln!(detail, "ok ({} watches listed)", status.len());
        } else {
            let _ = writeln!(detail, "{}", problems.join("; "));
        }
    }
    (ready, detail)
}
