//! The webhook server: HTTPS (HTTP/1.1) with the keeper's certificate, each request routed
//! by its path to a hook and a cluster, refused unless the path's token is that cluster's
//! and the cluster is served.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::Keeper;
use super::review::Handle;
use super::route::{self, NotARoute};
use crate::{ClusterId, Fleet};

/// The largest review read (controller-runtime's limit): an object is at most 1.5 MiB in
/// etcd, and a review carries two of them.
const MAX_BODY: usize = 7 << 20;
const HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// A TLS handshake takes milliseconds on the paths API servers use; a client that idles in
/// it holds a connection slot for no more than this.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
const MAX_CONNECTIONS: usize = 1024;

/// What the server reads.
pub(crate) struct Shared<C: ClusterId> {
    pub(crate) fleet: Fleet<C>,
    /// Reviews from the fleet's clusters are served.
    pub(crate) serve_fleet: bool,
    /// The host's id, when reviews from the host are served.
    pub(crate) host: Option<C>,
    /// The routes' base path (the URL's path, no trailing slash).
    pub(crate) base: String,
    /// By webhook name: the handle, the metrics label and the hook's timeout.
    pub(crate) hooks: HashMap<String, (Handle<C>, Arc<str>, Duration)>,
    pub(crate) keeper: Arc<Keeper>,
    pub(crate) metrics: Option<crate::Metrics>,
    /// Set once the server accepts connections; cleared when it stops.
    pub(crate) listening: AtomicBool,
}

impl<C: ClusterId> Shared<C> {
    /// Whether reviews of `id` are served now: an engaged cluster of the fleet (or one the
    /// provider engaged that another replica owns: every replica serves every cluster), or
    /// the host.
    fn serves(&self, id: &C) -> bool {
        self.host.as_ref() == Some(id) || (self.serve_fleet && self.fleet.discovered(id).is_some())
    }

    /// Whether the server can take reviews: listening, with a certificate.
    pub(crate) fn ready(&self) -> Result<(), String> {
        if !self.listening.load(Ordering::Relaxed) {
            return Err("the webhook server is not listening".into());
        }
        if !self.keeper.is_loaded() {
            return Err("the webhook server has no certificate yet".into());
        }
        Ok(())
    }
}

/// Serves on `listener` until `stop`; then it takes no new connection, and reviews in
/// flight get `drain` to finish.
pub(crate) async fn serve<C: ClusterId>(
    listener: TcpListener,
    shared: Arc<Shared<C>>,
    stop: CancellationToken,
    drain: Duration,
) {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = match rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
    {
        Ok(builder) => builder
            .with_no_client_auth()
            .with_cert_resolver(shared.keeper.clone()),
        Err(error) => {
            tracing::error!(%error, "webhooks: TLS settings");
            return;
        }
    };
    let mut config = config;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let mut connections = tokio::task::JoinSet::new();
    let room = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    let closing = CancellationToken::new();
    shared.listening.store(true, Ordering::Relaxed);
    loop {
        let accepted = tokio::select! {
            () = stop.cancelled() => break,
            accepted = listener.accept() => accepted,
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(error) => {
                tracing::debug!(%error, "webhooks: accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(permit) = room.clone().try_acquire_owned() else {
            continue;
        };
        let shared = shared.clone();
        let acceptor = acceptor.clone();
        let closing = closing.clone();
        connections.spawn(async move {
            let _permit = permit;
            let handshake = tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream));
            let stream = tokio::select! {
                () = closing.cancelled() => return,
                stream = handshake => match stream {
                    Ok(Ok(stream)) => stream,
                    _ => return,
                },
            };
            let service = hyper::service::service_fn(move |req| {
                let shared = shared.clone();
                async move { Ok::<_, Infallible>(answer(&shared, req).await) }
            });
            let connection = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                .serve_connection(TokioIo::new(stream), service);
            tokio::pin!(connection);
            tokio::select! {
                _ = connection.as_mut() => {}
                () = closing.cancelled() => {
                    // The review in flight is answered; the connection then closes.
                    connection.as_mut().graceful_shutdown();
                    let _ = connection.await;
                }
            }
        });
    }
    drop(listener);
    shared.listening.store(false, Ordering::Relaxed);
    closing.cancel();
    let all = async { while connections.join_next().await.is_some() {} };
    if tokio::time::timeout(drain, all).await.is_err() {
        tracing::warn!(
            ?drain,
            "webhooks: reviews still in flight at the end of the drain were dropped"
        );
        connections.shutdown().await;
    }
}

const PLAIN: &str = "text/plain; charset=utf-8";

fn text(status: StatusCode, body: &'static str) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from_static(body.as_bytes())));
    *response.status_mut() = status;
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static(PLAIN),
    );
    response
}

/// Why a request was refused before any handler saw it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// Not a route: another path, or a bad encoding.
    NotFound,
    /// No hook of that name.
    UnknownWebhook,
    /// The token is not the cluster's (or the id is not one the provider can have).
    BadToken,
    /// The token is right, but the cluster is not served (disengaged, or never engaged).
    UnknownCluster,
}

impl Refusal {
    pub(crate) fn label(self) -> &'static str {
        match self {
            Self::NotFound => "not_a_route",
            Self::UnknownWebhook => "unknown_webhook",
            Self::BadToken => "bad_token",
            Self::UnknownCluster => "unknown_cluster",
        }
    }

    fn response(self) -> Response<Full<Bytes>> {
        let mut response = match self {
            Self::NotFound | Self::UnknownWebhook => text(StatusCode::NOT_FOUND, "not found\n"),
            Self::BadToken | Self::UnknownCluster => text(StatusCode::FORBIDDEN, "forbidden\n"),
        };
        // A refused client keeps no connection (and no slot of the server's) open.
        response.headers_mut().insert(
            hyper::header::CONNECTION,
            hyper::header::HeaderValue::from_static("close"),
        );
        response
    }
}

/// The hook and cluster of `path`, or why there are none (the fuzz target's entry point).
pub(crate) fn route<'s, C: ClusterId, H>(
    base: &str,
    hooks: &'s HashMap<String, H>,
    key: &route::RouteKey,
    serves: impl Fn(&C) -> bool,
    path: &str,
) -> Result<(C, &'s H), Refusal> {
    let route = match route::parse(base, path) {
        Ok(route) => route,
        Err(NotARoute::Shape | NotARoute::Encoding) => return Err(Refusal::NotFound),
    };
    let Some(hook) = hooks.get(route.webhook) else {
        return Err(Refusal::UnknownWebhook);
    };
    if !key.verify(&route.cluster, route.token) {
        return Err(Refusal::BadToken);
    }
    // A valid token for an id that does not parse cannot be made without the key; refused
    // the same way all the same.
    let id = C::parse(&route.cluster).map_err(|_| Refusal::BadToken)?;
    if !serves(&id) {
        return Err(Refusal::UnknownCluster);
    }
    Ok((id, hook))
}

async fn answer<C: ClusterId>(shared: &Shared<C>, req: Request<Incoming>) -> Response<Full<Bytes>> {
    if req.method() != Method::POST {
        return text(StatusCode::METHOD_NOT_ALLOWED, "POST only\n");
    }
    let Some(served) = shared.keeper.served() else {
        return text(StatusCode::SERVICE_UNAVAILABLE, "not ready\n");
    };
    let routed = route(
        &shared.base,
        &shared.hooks,
        &served.route,
        |id: &C| shared.serves(id),
        req.uri().path(),
    );
    let (cluster, (handle, label, timeout)) = match routed {
        Ok(routed) => routed,
        Err(refusal) => {
            if let Some(metrics) = &shared.metrics {
                metrics.webhook_refused(refusal.label());
            }
            tracing::debug!(reason = refusal.label(), "webhooks: request refused");
            return refusal.response();
        }
    };
    let json = req
        .headers()
        .get(hyper::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| {
            v.split(';')
                .next()
                .is_some_and(|t| t.trim().eq_ignore_ascii_case("application/json"))
        });
    let cluster_text = cluster.to_string();
    let started = Instant::now();
    let in_flight = shared.metrics.as_ref().map(|m| m.webhook_in_flight(label));
    let _flight = in_flight.as_ref().map(InFlight::new);
    let response = if json {
        match Limited::new(req.into_body(), MAX_BODY).collect().await {
            Ok(body) => {
                // The API server gives up at the hook's timeout: a handler still running a
                // second later is dropped rather than left holding the connection.
                let answer = tokio::time::timeout(
                    *timeout + Duration::from_secs(1),
                    handle(cluster, body.to_bytes()),
                )
                .await;
                let Ok(answer) = answer else {
                    let response = text(
                        StatusCode::GATEWAY_TIMEOUT,
                        "the handler did not answer in time\n",
                    );
                    if let Some(metrics) = &shared.metrics {
                        metrics.webhook_answered(label, &cluster_text, 504, started.elapsed());
                    }
                    return response;
                };
                if answer.panicked
                    && let Some(metrics) = &shared.metrics
                {
                    metrics.webhook_panicked();
                }
                let mut response = Response::new(Full::new(Bytes::from(answer.body)));
                response.headers_mut().insert(
                    hyper::header::CONTENT_TYPE,
                    hyper::header::HeaderValue::from_static("application/json"),
                );
                response
            }
            Err(_) => text(StatusCode::PAYLOAD_TOO_LARGE, "the review is too large\n"),
        }
    } else {
        text(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "application/json only\n",
        )
    };
    if let Some(metrics) = &shared.metrics {
        metrics.webhook_answered(
            label,
            &cluster_text,
            response.status().as_u16(),
            started.elapsed(),
        );
    }
    response
}

/// The in-flight gauge, up while a review is handled.
struct InFlight<'a>(&'a prometheus_client::metrics::gauge::Gauge);

impl<'a> InFlight<'a> {
    fn new(gauge: &'a prometheus_client::metrics::gauge::Gauge) -> Self {
        gauge.inc();
        Self(gauge)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.dec();
    }
}
