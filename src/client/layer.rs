//! What every cluster's client passes through: a request rate limit (a token bucket, set on
//! the cluster or inherited from the manager that engages it) and, while a manager with
//! metrics has the cluster engaged, `rest_client_requests_total{cluster,code,method}`.
//!
//! It is a tower layer in the client's own service stack (built into it for clusters made
//! from a config), so it costs no extra task or buffer there.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use http::{Method, Request, Response};
use kube::client::Body;
use prometheus_client::metrics::counter::Counter;
use tokio::time::{Instant, Sleep};

use crate::util::sync::lock;

/// Makes a client whose layers are all set up.
pub(crate) type MakeClient = Box<dyn FnOnce() -> kube::Client + Send>;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A limit on a cluster's API requests: `qps` a second on average, up to `burst` at once
/// after a quiet spell (a token bucket, as client-go's `QPS` and `Burst`). Requests over it
/// wait, in order; none is refused. Every request counts once, a watch when it starts.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RateLimit {
    qps: f64,
    burst: u32,
}

/// A [`RateLimit`] that cannot work: a rate that is not a positive finite number, or a
/// burst of 0.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error(
    "a rate limit needs a positive, finite rate and a burst of at least 1 (got {qps} a second, burst {burst})"
)]
pub struct InvalidRateLimit {
    qps: f64,
    burst: u32,
}

impl RateLimit {
    /// At most `qps` requests a second on average and `burst` at once.
    pub fn new(qps: f64, burst: u32) -> Result<Self, InvalidRateLimit> {
        if qps.is_finite() && qps > 0.0 && burst >= 1 {
            Ok(Self { qps, burst })
        } else {
            Err(InvalidRateLimit { qps, burst })
        }
    }

    /// The average rate, a second.
    pub fn qps(&self) -> f64 {
        self.qps
    }

    /// How many requests may go at once.
    pub fn burst(&self) -> u32 {
        self.burst
    }
}

/// A token bucket: `tokens` may go negative, each request reserving its slot in order.
#[derive(Debug)]
struct Bucket {
    limit: RateLimit,
    tokens: f64,
    at: Instant,
}

impl Bucket {
    fn new(limit: RateLimit) -> Self {
        Self {
            limit,
            tokens: f64::from(limit.burst),
            at: Instant::now(),
        }
    }

    /// Returns a token taken and not used (at most up to the burst).
    fn give_back(&mut self) {
        self.tokens = (self.tokens + 1.0).min(f64::from(self.limit.burst));
    }

    /// Takes a token; how long until it is due.
    fn reserve(&mut self) -> Duration {
        let now = Instant::now();
        let refill = now.duration_since(self.at).as_secs_f64() * self.limit.qps;
        self.tokens = (self.tokens + refill).min(f64::from(self.limit.burst));
        self.at = now;
        self.tokens -= 1.0;
        if self.tokens >= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(-self.tokens / self.limit.qps)
        }
    }
}

/// Where a cluster's limit came from: a limit set on the cluster wins over the manager's.
#[derive(Debug, Default)]
enum Limit {
    #[default]
    Unset,
    Inherited(Bucket),
    Own(Option<Bucket>),
}

/// The request counters of one engagement.
struct Requests {
    metrics: crate::metrics::Metrics,
    cluster: String,
    /// The API server's `host:port` (client-go's `host` label), empty when unknown.
    host: Arc<str>,
    counters: HashMap<(u16, Method), Counter>,
}

/// What a cluster's client layer shares with the cluster.
#[derive(Default)]
pub(crate) struct ClientState {
    limit: Mutex<Limit>,
    requests: Mutex<Option<Requests>>,
    /// The check of native owner references (`owners.rs`).
    pub(crate) owners: crate::client::owners::OwnerCheck,
    /// The id of the cluster the client is of, as its spans name it (the latest name of a
    /// renamed cluster, which shares the client).
    cluster: Mutex<Option<Arc<str>>>,
}

impl fmt::Debug for ClientState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientState")
            .field("limit", &*lock(&self.limit))
            .finish_non_exhaustive()
    }
}

impl ClientState {
    /// Sets the cluster's own limit (`None`: none, whatever the manager's).
    pub(crate) fn set_limit(&self, limit: Option<RateLimit>) {
        *lock(&self.limit) = Limit::Own(limit.map(Bucket::new));
    }

    /// The manager's default, unless the cluster has a limit of its own.
    pub(crate) fn inherit(&self, limit: Option<RateLimit>) {
        let mut current = lock(&self.limit);
        if !matches!(*current, Limit::Own(_)) {
            *current = match limit {
                Some(limit) => Limit::Inherited(Bucket::new(limit)),
                None => Limit::Unset,
            };
        }
    }

    /// The limit in force.
    pub(crate) fn limit(&self) -> Option<RateLimit> {
        match &*lock(&self.limit) {
            Limit::Inherited(bucket) | Limit::Own(Some(bucket)) => Some(bucket.limit),
            Limit::Unset | Limit::Own(None) => None,
        }
    }

    /// Gives back a token taken by a request that was not sent.
    fn give_back(&self) {
        match &mut *lock(&self.limit) {
            Limit::Inherited(bucket) | Limit::Own(Some(bucket)) => bucket.give_back(),
            Limit::Unset | Limit::Own(None) => {}
        }
    }

    /// How long the next request waits.
    fn reserve(&self) -> Duration {
        match &mut *lock(&self.limit) {
            Limit::Inherited(bucket) | Limit::Own(Some(bucket)) => bucket.reserve(),
            Limit::Unset | Limit::Own(None) => Duration::ZERO,
        }
    }

    /// Names the client's cluster in its spans.
    pub(crate) fn name(&self, cluster: &str) {
        *lock(&self.cluster) = Some(cluster.into());
    }

    /// The name the client's spans give its cluster.
    #[cfg(test)]
    pub(crate) fn named(&self) -> Option<Arc<str>> {
        lock(&self.cluster).clone()
    }

    /// Counts requests into `metrics` under `cluster`, whose API server is `host` (until
    /// [`ClientState::unmeasure`]).
    pub(crate) fn measure(
        &self,
        metrics: &crate::metrics::Metrics,
        cluster: String,
        host: Arc<str>,
    ) {
        self.unmeasure();
        *lock(&self.requests) = Some(Requests {
            metrics: metrics.clone(),
            cluster,
            host,
            counters: HashMap::new(),
        });
    }

    /// Stops counting and removes the series counted.
    pub(crate) fn unmeasure(&self) {
        if let Some(old) = lock(&self.requests).take() {
            old.metrics
                .forget_requests(&old.cluster, &old.host, old.counters.keys());
        }
    }

    fn count(&self, code: u16, method: &Method) {
        let mut requests = lock(&self.requests);
        let Some(requests) = requests.as_mut() else {
            return;
        };
        let key = (code, method.clone());
        if let Some(counter) = requests.counters.get(&key) {
            counter.inc();
            return;
        }
        let counter =
            requests
                .metrics
                .request_counter(&requests.cluster, &requests.host, code, method);
        counter.inc();
        requests.counters.insert(key, counter);
    }
}

/// The tower layer of a cluster's client.
#[derive(Clone)]
pub(crate) struct ClientLayer(pub(crate) Arc<ClientState>);

impl<S> tower_layer::Layer<S> for ClientLayer {
    type Service = Limited<S>;

    fn layer(&self, inner: S) -> Limited<S> {
        Limited {
            inner,
            state: self.0.clone(),
            wait: None,
            granted: false,
        }
    }
}

/// A client's service behind the cluster's limit. It waits for its token in `poll_ready`,
/// so requests queue in the client's buffer in the order they came.
pub(crate) struct Limited<S> {
    inner: S,
    state: Arc<ClientState>,
    wait: Option<Pin<Box<Sleep>>>,
    /// A token is held for the next call.
    granted: bool,
}

/// A request that took its token (or reserved one and waits for it) and is dropped before it
/// is sent gives the token back: watches stopped under throttling do not hold up the next.
impl<S> Drop for Limited<S> {
    fn drop(&mut self) {
        if self.granted || self.wait.is_some() {
            self.state.give_back();
        }
    }
}

/// A copy shares the cluster's limit, not the token or wait of the one copied.
impl<S: Clone> Clone for Limited<S> {
    fn clone(&self) -> Self {
        Limited {
            inner: self.inner.clone(),
            state: self.state.clone(),
            wait: None,
            granted: false,
        }
    }
}

impl<S, B> tower_service::Service<Request<Body>> for Limited<S>
where
    S: tower_service::Service<Request<Body>, Response = Response<B>> + Clone + Send + 'static,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
    B: Send + 'static,
{
    type Response = Response<B>;
    type Error = BoxError;
    type Future = Guarded<S::Future, B>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        if !self.granted {
            if self.wait.is_none() {
                let delay = self.state.reserve();
                if !delay.is_zero() {
                    self.wait = Some(Box::pin(tokio::time::sleep(delay)));
                }
            }
            if let Some(wait) = &mut self.wait {
                ready!(wait.as_mut().poll(cx));
                self.wait = None;
            }
            self.granted = true;
        }
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, request: Request<Body>) -> Guarded<S::Future, B> {
        self.granted = false;
        let (request, span) = spanned(&self.state, request);
        let method = request.method().clone();
        if let Some(pending) = self.state.owners.needs_check(&request) {
            // Sent after the check through a clone made ready then: the ready service stays
            // here for the next request (a buffer's slot it reserved is not held through the
            // check, whose own reads need slots of the same buffer).
            let service = self.inner.clone();
            let state = self.state.clone();
            return Guarded::Checking(Box::pin(async move {
                if let Err(refused) = state.owners.verify(pending).await {
                    tracing::warn!(cluster = %refused.cluster, owner = %refused.owner, kind = %refused.kind, holder = ?refused.holder, "refused a native ownerReference the cluster cannot resolve");
                    return Err(Box::new(refused) as BoxError);
                }
                Counted {
                    future: tower::ServiceExt::oneshot(service, request),
                    method,
                    state,
                    span,
                }
                .await
            }));
        }
        Guarded::Sent(Counted {
            method,
            future: self.inner.call(request),
            state: self.state.clone(),
            span,
        })
    }
}

/// A span for `request` if it is made inside one (a reconcile's: the caches' lists and watches
/// are not), and with the feature `opentelemetry` its W3C `traceparent`.
fn spanned(state: &ClientState, request: Request<Body>) -> (Request<Body>, tracing::Span) {
    if tracing::Span::current().is_none() {
        return (request, tracing::Span::none());
    }
    let cluster = lock(&state.cluster).clone();
    let span = tracing::info_span!(
        "request",
        otel.name = %request.method(),
        otel.kind = "client",
        cluster = cluster.as_deref().unwrap_or_default(),
        http.request.method = %request.method(),
        url.path = request.uri().path(),
        http.response.status_code = tracing::field::Empty,
    );
    #[cfg(feature = "opentelemetry")]
    let request = {
        let mut request = request;
        if let Some(value) = crate::telemetry::traceparent(&span) {
            request.headers_mut().insert("traceparent", value);
        }
        request
    };
    (request, span)
}

/// A request on its way: sent at once, or after its owner references were checked.
#[pin_project::pin_project(project = GuardedProj)]
pub(crate) enum Guarded<F, B> {
    Sent(#[pin] Counted<F>),
    Checking(Pin<Box<dyn Future<Output = Result<Response<B>, BoxError>> + Send>>),
}

impl<F, B, E> Future for Guarded<F, B>
where
    F: Future<Output = Result<Response<B>, E>>,
    E: Into<BoxError>,
{
    type Output = Result<Response<B>, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project() {
            GuardedProj::Sent(sent) => sent.poll(cx),
            GuardedProj::Checking(checking) => checking.as_mut().poll(cx),
        }
    }
}

/// A request in flight; counted when it ends (`code` 0 for a request that got no response).
#[pin_project::pin_project]
pub(crate) struct Counted<F> {
    #[pin]
    future: F,
    method: Method,
    state: Arc<ClientState>,
    /// The request's span (none unless it was made inside a span).
    span: tracing::Span,
}

impl<F, B, E> Future for Counted<F>
where
    F: Future<Output = Result<Response<B>, E>>,
    E: Into<BoxError>,
{
    type Output = Result<Response<B>, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let result = {
            let _entered = this.span.enter();
            ready!(this.future.poll(cx))
        };
        let code = match &result {
            Ok(response) => response.status().as_u16(),
            Err(_) => 0,
        };
        if !this.span.is_none() {
            this.span.record("http.response.status_code", code);
        }
        this.state.count(code, this.method);
        // Outermost on every client's stack: whatever authentication layer is underneath
        // (kube's, or ours), its errors leave without the plugin's command line and output.
        Poll::Ready(result.map_err(|error| super::redact::redact_boxed(error.into())))
    }
}

/// A finished [`kube::Client`] as a service, to put behind the layer.
#[derive(Clone)]
pub(crate) struct Forward(pub(crate) kube::Client);

impl tower_service::Service<Request<Body>> for Forward {
    type Response = Response<Body>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, BoxError>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        let client = self.0.clone();
        Box::pin(async move {
            client.send(request).await.map_err(|error| match error {
                // Not wrapped twice: the outer client wraps it again.
                kube::Error::Service(inner) => inner,
                other => Box::new(other) as BoxError,
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use tower_layer::Layer;

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn the_bucket_lets_a_burst_go_then_spaces_requests_at_the_rate() {
        let mut bucket = Bucket::new(RateLimit::new(10.0, 3).unwrap());
        for _ in 0..3 {
            assert_eq!(bucket.reserve(), Duration::ZERO);
        }
        // Reserved in order: 100 ms, then 200 ms from now.
        assert_eq!(bucket.reserve(), Duration::from_millis(100));
        assert_eq!(bucket.reserve(), Duration::from_millis(200));
        tokio::time::advance(Duration::from_secs(1)).await;
        // A second refilled ten tokens, less the two owed, capped at the burst.
        for _ in 0..3 {
            assert_eq!(bucket.reserve(), Duration::ZERO);
        }
        assert_eq!(bucket.reserve(), Duration::from_millis(100));
    }

    /// A request dropped after it took its token (or while waiting for it) gives the token
    /// back: a watch stopped under throttling does not slow the cluster's next request.
    #[tokio::test(start_paused = true)]
    async fn a_request_dropped_before_it_is_sent_gives_its_token_back() {
        let state = Arc::new(ClientState::default());
        state.set_limit(Some(RateLimit::new(1.0, 1).unwrap()));
        let service = tower::service_fn(|_: Request<Body>| async {
            Ok::<_, std::io::Error>(Response::new(Body::empty()))
        });
        let mut limited = ClientLayer(state.clone()).layer(service);
        let waker = futures::task::noop_waker();
        let mut cx = Context::from_waker(&waker);
        // Granted the only token, then dropped without a call.
        assert!(tower_service::Service::poll_ready(&mut limited, &mut cx).is_ready());
        let mut waiting = limited.clone();
        drop(limited);
        // The next request finds the token there, without waiting a second for the refill.
        assert!(tower_service::Service::poll_ready(&mut waiting, &mut cx).is_ready());
        // And one dropped while waiting for its token gives its reservation back too.
        let mut third = waiting.clone();
        assert!(tower_service::Service::poll_ready(&mut third, &mut cx).is_pending());
        drop(third);
        drop(waiting);
        let mut fourth =
            ClientLayer(state.clone()).layer(tower::service_fn(|_: Request<Body>| async {
                Ok::<_, std::io::Error>(Response::new(Body::empty()))
            }));
        assert!(tower_service::Service::poll_ready(&mut fourth, &mut cx).is_ready());
    }

    /// A request made inside a span is spanned, and carries the W3C `traceparent` of its
    /// own span (a child of the caller's); one made outside any span carries none.
    #[cfg(feature = "opentelemetry")]
    #[test]
    fn a_request_inside_a_span_carries_the_traceparent_of_its_span() {
        use opentelemetry::trace::TracerProvider as _;
        use tracing_subscriber::layer::SubscriberExt;
        let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder().build();
        let subscriber = tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
        tracing::subscriber::with_default(subscriber, || {
            let state = ClientState::default();
            state.name("member-a");
            let request = || {
                Request::builder()
                    .uri("/api/v1/namespaces")
                    .body(Body::empty())
            };
            let (outside, span) = spanned(&state, request().unwrap());
            assert!(span.is_none());
            assert!(outside.headers().get("traceparent").is_none());

            let reconcile = tracing::info_span!("reconcile");
            let (inside, span) = reconcile.in_scope(|| spanned(&state, request().unwrap()));
            let header = inside.headers()["traceparent"]
                .to_str()
                .unwrap()
                .to_string();
            assert_eq!(
                crate::telemetry::traceparent(&span)
                    .unwrap()
                    .to_str()
                    .unwrap(),
                header,
                "the request's own span"
            );
            let caller = crate::telemetry::traceparent(&reconcile).unwrap();
            let caller: Vec<&str> = caller.to_str().unwrap().split('-').collect();
            let sent: Vec<&str> = header.split('-').collect();
            assert_eq!(sent[1], caller[1], "the caller's trace");
            assert_ne!(sent[2], caller[2], "a span of its own");
        });
    }

    #[test]
    fn limits_that_cannot_work_are_refused() {
        for (qps, burst) in [
            (0.0, 1),
            (-1.0, 1),
            (f64::NAN, 1),
            (f64::INFINITY, 1),
            (1.0, 0),
        ] {
            assert!(RateLimit::new(qps, burst).is_err(), "{qps} {burst}");
        }
        assert!(RateLimit::new(0.5, 1).is_ok());
    }

    #[test]
    fn a_limit_set_on_the_cluster_wins_over_the_managers() {
        let own = ClientState::default();
        own.set_limit(Some(RateLimit::new(20.0, 1).unwrap()));
        own.inherit(Some(RateLimit::new(5.0, 1).unwrap()));
        assert_eq!(own.limit(), RateLimit::new(20.0, 1).ok());
        let none = ClientState::default();
        none.set_limit(None);
        none.inherit(Some(RateLimit::new(5.0, 1).unwrap()));
        assert_eq!(none.limit(), None);
        let inherited = ClientState::default();
        inherited.inherit(Some(RateLimit::new(5.0, 1).unwrap()));
        assert_eq!(inherited.limit(), RateLimit::new(5.0, 1).ok());
        inherited.inherit(None);
        assert_eq!(inherited.limit(), None);
    }
}
