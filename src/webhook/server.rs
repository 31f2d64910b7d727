//! The webhook server: HTTPS (HTTP/1.1) with the keeper's certificate, each request routed
//! by its path to a hook and a cluster, refused unless the path's token is that cluster's
//! and the cluster is served.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use tokio::net::TcpListener;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::Keeper;
use super::review::Handle;
use super::route;
use super::route::NotARoute;
use crate::cluster::ClusterId;
use crate::fleet::Fleet;
use crate::serve::slots;
use crate::serve::slots::{Lease, Limits, Slots, closing};
use crate::util::sync::lock;

/// The largest review read (controller-runtime's limit): an object is at most 1.5 MiB in
/// etcd, and a review carries two of them.
pub(crate) const MAX_BODY: usize = 7 << 20;

/// How fast a body must come, after the first second: 128 KiB/s. An API server sends a
/// review at once; a client dribbling bytes to hold a slot is cut off within about a second.
const MIN_BODY_RATE: f64 = 128.0 * 1024.0;
const BODY_GRACE: Duration = Duration::from_secs(1);

/// How many connections the webhook server holds, and for how long ([`crate::slots`]):
/// `total` in all (by default half the process's open-file limit, the rest left to the
/// clients of the fleet and everything else); an eighth of them (at most 4,096) for
/// connections that have shown nothing yet, a quarter of those from one address (an API
/// server's burst of new connections fits; one address cannot take them all); 64 kept open for
/// one cluster (a member's API servers keep a few dozen idle connections at most), idle up
/// to 2 minutes (beyond the API server's 90 s, so that it is the one to close them).
pub(crate) fn limits(total: usize) -> Limits {
    let total = total.max(64);
    let unverified = (total / 8).clamp(16, 4096);
    Limits {
        unverified,
        per_peer: (unverified / 4).max(8),
        verified: total - unverified,
        per_group: 64,
        handshake: Duration::from_secs(3),
        first_request: Duration::from_secs(5),
        idle: Duration::from_secs(120),
        header: Duration::from_secs(10),
    }
}

/// The default connection total: half the open-file limit (1,024 if it cannot be read).
pub(crate) fn default_connections() -> usize {
    slots::file_limit()
        .map(|limit| usize::try_from(limit / 2).unwrap_or(usize::MAX))
        .unwrap_or(1024)
}

/// What a review on a valid route may hold: at most `per_cluster` reviews of one cluster in
/// flight, and bodies buffered up to `budget` bytes in all, a quarter of it for one cluster.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Budget {
    pub(crate) per_cluster: usize,
    pub(crate) bytes: usize,
}

impl Budget {
    fn per_cluster_bytes(&self) -> usize {
        (self.bytes / 4).max(MAX_BODY)
    }
}

/// The reviews in flight: how many per cluster, and the bytes their bodies hold.
pub(crate) struct Flights {
    budget: Budget,
    table: std::sync::Mutex<FlightTable>,
}

#[derive(Default)]
struct FlightTable {
    bytes: usize,
    /// By cluster: reviews in flight and the bytes they hold.
    clusters: HashMap<Arc<str>, (usize, usize)>,
}

/// Why a review on a valid route was refused before its body was read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Throttled {
    /// The cluster's reviews in flight are at their cap.
    InFlight,
    /// No room in the budget for buffered bodies (the process's, or the cluster's share).
    Memory,
}

impl Throttled {
    fn label(self) -> &'static str {
        match self {
            Self::InFlight => "in_flight",
            Self::Memory => "memory",
        }
    }
}

impl Flights {
    pub(crate) fn new(budget: Budget) -> Arc<Self> {
        Arc::new(Self {
            budget,
            table: std::sync::Mutex::new(FlightTable::default()),
        })
    }

    /// Room for one more review of `cluster` whose body holds up to `bytes`.
    pub(crate) fn reserve(
        self: &Arc<Self>,
        cluster: &str,
        bytes: usize,
    ) -> Result<Flight, Throttled> {
        let mut table = lock(&self.table);
        let (count, held) = table.clusters.get(cluster).copied().unwrap_or((0, 0));
        if count >= self.budget.per_cluster {
            return Err(Throttled::InFlight);
        }
        if held + bytes > self.budget.per_cluster_bytes() || table.bytes + bytes > self.budget.bytes
        {
            return Err(Throttled::Memory);
        }
        let cluster: Arc<str> = Arc::from(cluster);
        table.bytes += bytes;
        let entry = table.clusters.entry(cluster.clone()).or_default();
        entry.0 += 1;
        entry.1 += bytes;
        Ok(Flight {
            flights: self.clone(),
            cluster,
            bytes,
        })
    }

    /// Bytes held by reviews in flight now.
    #[cfg(test)]
    fn held(&self) -> usize {
        lock(&self.table).bytes
    }
}

/// One review's place in [`Flights`], given back when dropped.
pub(crate) struct Flight {
    flights: Arc<Flights>,
    cluster: Arc<str>,
    bytes: usize,
}

impl Drop for Flight {
    fn drop(&mut self) {
        let mut table = lock(&self.flights.table);
        table.bytes -= self.bytes;
        if let Some(entry) = table.clusters.get_mut(&self.cluster) {
            entry.0 -= 1;
            entry.1 -= self.bytes;
            if entry.0 == 0 {
                table.clusters.remove(&self.cluster);
            }
        }
    }
}

/// What the server reads.
pub(crate) struct ServerShared<C: ClusterId> {
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
    pub(crate) metrics: Option<crate::metrics::Metrics>,
    /// Set once the server accepts connections; cleared when it stops.
    pub(crate) listening: AtomicBool,
    /// The connections' slots.
    pub(crate) slots: Arc<Slots>,
    /// The reviews in flight.
    pub(crate) flights: Arc<Flights>,
}

impl<C: ClusterId> ServerShared<C> {
    /// Whether reviews of `id` are served now: a cluster of the fleet (engaged, here or on
    /// another replica: every replica serves every cluster; or paused: its policy holds
    /// while it is unwell or contested), or the host.
    fn serves(&self, id: &C) -> bool {
        self.host.as_ref() == Some(id) || (self.serve_fleet && self.fleet.holds(id))
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
    shared: Arc<ServerShared<C>>,
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
    let closing = CancellationToken::new();
    shared.listening.store(true, Ordering::Relaxed);
    loop {
        let accepted = tokio::select! {
            () = stop.cancelled() => break,
            accepted = listener.accept() => accepted,
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(error) => {
                tracing::debug!(%error, "webhooks: accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        // Always a slot: the oldest connection that has shown nothing yet makes room.
        let slot = shared.slots.admit(peer.ip());
        let shared = shared.clone();
        let acceptor = acceptor.clone();
        let closing = closing.clone();
        connections.spawn(async move {
            let Some(stream) = slot.handshake(&acceptor, stream).await else {
                return;
            };
            let lease = slot.lease().clone();
            let service = hyper::service::service_fn(move |req| {
                let shared = shared.clone();
                let lease = lease.clone();
                async move { Ok::<_, Infallible>(answer(&shared, &lease, req).await) }
            });
            // The review in flight is answered when the server stops; the connection then
            // closes (the drain bounds the wait).
            slots::serve_connection(&slot, stream, service, &closing, drain).await;
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
        // A refused client keeps no connection (and no slot of the server's) open.
        closing(match self {
            Self::NotFound | Self::UnknownWebhook => text(StatusCode::NOT_FOUND, "not found\n"),
            Self::BadToken | Self::UnknownCluster => text(StatusCode::FORBIDDEN, "forbidden\n"),
        })
    }
}

/// The hook and cluster of `path`, or why there are none (the fuzz target's entry point).
pub(crate) fn route<'s, C: ClusterId, H>(
    base: &str,
    hooks: &'s HashMap<String, H>,
    key: &route::RouteKey,
    host: Option<&C>,
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
    // An id that does not parse has no valid token: refused as such.
    let id = C::parse(&route.cluster).map_err(|_| Refusal::BadToken)?;
    let side = if host == Some(&id) {
        route::Side::Host
    } else {
        route::Side::Fleet
    };
    if !key.verify(side, &route.cluster, route.token) {
        return Err(Refusal::BadToken);
    }
    if !serves(&id) {
        return Err(Refusal::UnknownCluster);
    }
    Ok((id, hook))
}

async fn answer<C: ClusterId>(
    shared: &ServerShared<C>,
    lease: &Lease,
    req: Request<Incoming>,
) -> Response<Full<Bytes>> {
    let _busy = lease.busy();
    let response = review(shared, lease, req).await;
    // Only a review answered, on a connection that has shown a valid route (and found room),
    // keeps its connection: every other answer (403, 404, 405, 429, 503, ...) closes it, so
    // nobody holds a slot by asking for what is not there.
    if response.status() == StatusCode::OK && lease.is_verified() {
        response
    } else {
        closing(response)
    }
}

async fn review<C: ClusterId>(
    shared: &ServerShared<C>,
    lease: &Lease,
    req: Request<Incoming>,
) -> Response<Full<Bytes>> {
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
        shared.host.as_ref(),
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
    let cluster_text = cluster.to_string();
    // A valid route: the connection may stay open, if its cluster has room.
    lease.verify(&cluster_text);
    let started = Instant::now();
    let answered = |response: Response<Full<Bytes>>| {
        if let Some(metrics) = &shared.metrics {
            metrics.webhook_answered(
                label,
                &cluster_text,
                response.status().as_u16(),
                started.elapsed(),
            );
        }
        response
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
    if !json {
        return answered(closing(text(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "application/json only\n",
        )));
    }
    let declared = req
        .headers()
        .get(hyper::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    if declared.is_some_and(|length| length > MAX_BODY) {
        return answered(closing(too_large()));
    }
    // Room for the body before a byte of it is read: without a length, room for the largest.
    let flight = match shared
        .flights
        .reserve(&cluster_text, declared.unwrap_or(MAX_BODY))
    {
        Ok(flight) => flight,
        Err(throttled) => {
            if let Some(metrics) = &shared.metrics {
                metrics.webhook_throttled(&cluster_text, throttled.label());
            }
            tracing::debug!(cluster = %cluster_text, reason = throttled.label(), "webhooks: review refused");
            let mut response = closing(text(
                StatusCode::TOO_MANY_REQUESTS,
                "too many reviews of this cluster at once\n",
            ));
            response.headers_mut().insert(
                hyper::header::RETRY_AFTER,
                hyper::header::HeaderValue::from_static("1"),
            );
            return answered(response);
        }
    };
    let in_flight = shared.metrics.as_ref().map(|m| m.webhook_in_flight(label));
    let _flight = in_flight.as_ref().map(InFlight::new);
    // The API server gives up at the hook's timeout: the body must have come by then.
    let deadline = started + *timeout;
    let body = match read_body(req.into_body(), declared, deadline).await {
        Ok(body) => body,
        Err(BodyError::TooLarge) => return answered(closing(too_large())),
        Err(BodyError::Slow) => {
            if let Some(metrics) = &shared.metrics {
                metrics.webhook_throttled(&cluster_text, "slow_body");
            }
            tracing::debug!(cluster = %cluster_text, "webhooks: a review's body came too slowly");
            return answered(closing(text(
                StatusCode::REQUEST_TIMEOUT,
                "the review came too slowly\n",
            )));
        }
        Err(BodyError::Broken) => {
            return answered(closing(text(
                StatusCode::BAD_REQUEST,
                "the review could not be read\n",
            )));
        }
    };
    // A handler still running a second after the API server gave up (the hook's timeout
    // from the request's start) is dropped rather than left holding the connection.
    let answer =
        tokio::time::timeout_at(deadline + Duration::from_secs(1), handle(cluster, body)).await;
    drop(flight);
    let Ok(answer) = answer else {
        return answered(text(
            StatusCode::GATEWAY_TIMEOUT,
            "the handler did not answer in time\n",
        ));
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
    answered(response)
}

fn too_large() -> Response<Full<Bytes>> {
    text(StatusCode::PAYLOAD_TOO_LARGE, "the review is too large\n")
}

/// Why a body was not read.
#[derive(Debug, PartialEq, Eq)]
enum BodyError {
    /// Larger than [`MAX_BODY`].
    TooLarge,
    /// Slower than [`MIN_BODY_RATE`] after [`BODY_GRACE`], or not done by the deadline.
    Slow,
    /// The connection failed.
    Broken,
}

/// The body, read into one buffer (of the declared length), by `deadline` and no slower
/// than the minimum rate.
async fn read_body<B>(
    mut body: B,
    declared: Option<usize>,
    deadline: Instant,
) -> Result<Bytes, BodyError>
where
    B: hyper::body::Body<Data = Bytes> + Unpin,
{
    let started = Instant::now();
    let mut buffer = BytesMut::with_capacity(declared.unwrap_or(0).min(MAX_BODY));
    loop {
        #[allow(clippy::cast_precision_loss)]
        let owed = Duration::from_secs_f64(buffer.len() as f64 / MIN_BODY_RATE);
        let by = (started + BODY_GRACE + owed).min(deadline);
        let frame = match tokio::time::timeout_at(by, body.frame()).await {
            Err(_) => return Err(BodyError::Slow),
            Ok(None) => return Ok(buffer.freeze()),
            Ok(Some(Err(_))) => return Err(BodyError::Broken),
            Ok(Some(Ok(frame))) => frame,
        };
        if let Ok(data) = frame.into_data() {
            if buffer.len() + data.len() > MAX_BODY {
                return Err(BodyError::TooLarge);
            }
            buffer.extend_from_slice(&data);
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cluster_gets_its_share_of_reviews_and_bytes_and_gives_them_back() {
        let flights = Flights::new(Budget {
            per_cluster: 2,
            bytes: 40 << 20,
        });
        // A quarter of 40 MiB is 10 MiB: one full-size review, then no more for this cluster.
        let east = flights.reserve("east", MAX_BODY).unwrap();
        assert_eq!(
            flights.reserve("east", MAX_BODY).err(),
            Some(Throttled::Memory)
        );
        let small = flights.reserve("east", 1000).unwrap();
        assert_eq!(flights.reserve("east", 10).err(), Some(Throttled::InFlight));
        // Others are not held back by east.
        let west = flights.reserve("west", MAX_BODY).unwrap();
        assert_eq!(flights.held(), 2 * MAX_BODY + 1000);
        drop((east, small, west));
        assert_eq!(flights.held(), 0);
        assert!(flights.reserve("east", MAX_BODY).is_ok());
    }

    #[test]
    fn the_process_budget_bounds_every_cluster_together() {
        let flights = Flights::new(Budget {
            per_cluster: 32,
            bytes: 16 << 20,
        });
        let held: Vec<Flight> = ["a", "b"]
            .iter()
            .map(|c| flights.reserve(c, MAX_BODY).unwrap())
            .collect();
        assert_eq!(
            flights.reserve("c", MAX_BODY).err(),
            Some(Throttled::Memory)
        );
        drop(held);
        assert!(flights.reserve("c", MAX_BODY).is_ok());
    }

    /// A body of `chunks`, each sent after its delay.
    fn body(
        chunks: Vec<(Duration, &'static [u8])>,
    ) -> http_body_util::StreamBody<
        impl futures::Stream<Item = Result<hyper::body::Frame<Bytes>, Infallible>> + Unpin,
    > {
        let stream = futures::stream::iter(chunks).then(|(delay, chunk)| async move {
            tokio::time::sleep(delay).await;
            Ok(hyper::body::Frame::data(Bytes::from_static(chunk)))
        });
        http_body_util::StreamBody::new(Box::pin(stream))
    }

    use futures::StreamExt as _;

    #[tokio::test(start_paused = true)]
    async fn a_body_that_comes_at_once_is_read_whole() {
        let deadline = Instant::now() + Duration::from_secs(10);
        let chunks = vec![
            (Duration::ZERO, &b"{\"a\":"[..]),
            (Duration::from_millis(5), b"1}"),
        ];
        let read = read_body(body(chunks), Some(7), deadline).await;
        assert_eq!(read.unwrap(), Bytes::from_static(b"{\"a\":1}"));
    }

    #[tokio::test(start_paused = true)]
    async fn a_trickled_body_is_cut_off_within_the_grace_second() {
        let deadline = Instant::now() + Duration::from_secs(10);
        let started = Instant::now();
        let chunks = (0..100)
            .map(|_| (Duration::from_millis(400), &b"x"[..]))
            .collect();
        let read = read_body(body(chunks), Some(7_000_000), deadline).await;
        assert_eq!(read.err(), Some(BodyError::Slow));
        // Two bytes came in time: they buy microseconds (the timer's millisecond, here).
        let took = started.elapsed();
        assert!(
            took >= BODY_GRACE && took < BODY_GRACE + Duration::from_millis(10),
            "{took:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_at_the_minimum_rate_is_cut_off_at_the_hooks_deadline() {
        let deadline = Instant::now() + Duration::from_secs(3);
        let started = Instant::now();
        // 64 KiB every 100 ms is 640 KiB/s: well above the rate, but not done by the deadline.
        static CHUNK: [u8; 64 << 10] = [b' '; 64 << 10];
        let chunks = (0..100)
            .map(|_| (Duration::from_millis(100), &CHUNK[..]))
            .collect();
        let read = read_body(body(chunks), Some(100 * CHUNK.len()), deadline).await;
        assert_eq!(read.err(), Some(BodyError::Slow));
        assert_eq!(started.elapsed(), Duration::from_secs(3));
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_larger_than_the_largest_review_is_refused() {
        static CHUNK: [u8; 1 << 20] = [b' '; 1 << 20];
        let chunks = (0..8).map(|_| (Duration::ZERO, &CHUNK[..])).collect();
        let deadline = Instant::now() + Duration::from_secs(10);
        let read = read_body(body(chunks), None, deadline).await;
        assert_eq!(read.err(), Some(BodyError::TooLarge));
    }
}
