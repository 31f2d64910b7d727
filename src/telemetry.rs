//! Traces across clusters: the runtime's spans, and with the feature `opentelemetry` their
//! export over OTLP, the W3C `traceparent` of requests to the API servers and trace ids as
//! exemplars of the reconcile histogram.
//!
//! The runtime makes its spans with `tracing`, whatever subscriber you install:
//!
//! | span | when | fields |
//! |---|---|---|
//! | `watch_event` | a live change (a watch event, or another source's request) asks a fleet controller for a reconcile; the root of its trace | `controller`, `cluster`, `object`, `reason` |
//! | `queue` | from then until the request is taken from the queue or dropped (a child of `watch_event`) | `controller`, `cluster`, `lane` |
//! | `reconcile` | the reconcile (a child of `watch_event` when a live change asked for it, else a trace of its own) | `controller`, `cluster`, `object`, `reason` |
//! | `request` | each request to an API server made inside a span, a reconcile's or your own (its child) | `cluster`, `http.request.method`, `url.path`, `http.response.status_code` |
//!
//! Listed objects and resyncs come in bulk and are no news: they get no `watch_event`. The
//! caches' own lists and watches are made outside any span, and get no `request` span.
//! Requests that came together while one waited run as one reconcile, in the trace of the
//! first.
//!
//! With the feature `opentelemetry`, [`Tracing`] exports these spans (and every other span of
//! your program its layer takes) to an OpenTelemetry collector; each spanned request carries
//! the `traceparent` of its span, so an API server that traces (`--tracing-config-file`)
//! continues the trace; and `controller_runtime_reconcile_time_seconds` keeps, per bucket,
//! the trace id of a sampled reconcile as an exemplar (OpenMetrics' `# {trace_id="…"}`), so
//! a slow bucket leads to a trace.
//!
//! ```no_run
//! # #[cfg(feature = "opentelemetry")]
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! use tracing_subscriber::prelude::*;
//! use tracing_subscriber::filter::LevelFilter;
//! use multicluster_runtime::telemetry::Tracing;
//!
//! let (layer, tracing) = Tracing::otlp()
//!     .endpoint("http://otel-collector.observability:4318")
//!     .service_name("fleet-operator")
//!     .install()?;
//! tracing_subscriber::registry()
//!     .with(tracing_subscriber::fmt::layer())
//!     // At INFO: kube's own DEBUG spans of clients you build with `Client::try_from`
//!     // carry whole URLs, queries included.
//!     .with(layer.with_filter(LevelFilter::INFO))
//!     .init();
//! // ... run the manager ...
//! tracing.shutdown().await?; // sends what is still buffered
//! # Ok(())
//! # }
//! ```
//!
//! Trust: the runtime's spans carry cluster ids, object namespaces and names and request
//! paths, never a request's body, query or headers. Events logged inside a span (the
//! runtime's, such as a reconcile's panic message, and your reconciler's) go with it as span
//! events. Whoever reads the collector reads all of that.

#[cfg(feature = "opentelemetry")]
use std::sync::atomic::{AtomicBool, Ordering};

/// A sampled span's trace id, for an exemplar (nothing without the feature `opentelemetry`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct TraceMark(#[cfg(feature = "opentelemetry")] Option<[u8; 16]>);

/// The OpenTelemetry context of `span`, if it has a valid one.
#[cfg(feature = "opentelemetry")]
fn span_context(span: &tracing::Span) -> Option<opentelemetry::trace::SpanContext> {
    use opentelemetry::trace::TraceContextExt;
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    if span.is_disabled() {
        return None;
    }
    let context = span.context();
    let span_context = context.span().span_context().clone();
    span_context.is_valid().then_some(span_context)
}

impl TraceMark {
    /// The trace of `span`, if OpenTelemetry samples it.
    #[cfg(feature = "opentelemetry")]
    pub(crate) fn of(span: &tracing::Span) -> Self {
        Self(
            span_context(span)
                .filter(|context| context.is_sampled())
                .map(|context| context.trace_id().to_bytes()),
        )
    }

    /// Nothing to mark without OpenTelemetry.
    #[cfg(not(feature = "opentelemetry"))]
    #[inline(always)]
    pub(crate) fn of(_span: &tracing::Span) -> Self {
        Self()
    }

    /// The trace id in hex (32 digits), if there is one.
    #[cfg(feature = "opentelemetry")]
    pub(crate) fn trace_id(&self) -> Option<String> {
        self.0
            .map(|id| opentelemetry::trace::TraceId::from_bytes(id).to_string())
    }
}

/// Whether requests carry a `traceparent` ([`Tracing::traceparent`]).
#[cfg(feature = "opentelemetry")]
static PROPAGATE: AtomicBool = AtomicBool::new(true);

/// The W3C `traceparent` of `span` (`00-<trace id>-<span id>-<flags>`), if it has a valid
/// OpenTelemetry context and requests carry one.
#[cfg(feature = "opentelemetry")]
pub(crate) fn traceparent(span: &tracing::Span) -> Option<http::HeaderValue> {
    if !PROPAGATE.load(Ordering::Relaxed) {
        return None;
    }
    let context = span_context(span)?;
    let value = format!(
        "00-{}-{}-{:02x}",
        context.trace_id(),
        context.span_id(),
        context.trace_flags().to_u8()
    );
    http::HeaderValue::from_str(&value).ok()
}

#[cfg(feature = "opentelemetry")]
pub use otlp::{Tracing, TracingError, TracingGuard};

#[cfg(feature = "opentelemetry")]
mod otlp {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::{Duration, SystemTime, UNIX_EPOCH};

    use bytes::Bytes;
    use http::{Request, Response};
    use http_body_util::{BodyExt, Full, Limited};
    use opentelemetry::trace::TracerProvider as _;
    use opentelemetry_otlp::{WithExportConfig, WithHttpConfig};
    use opentelemetry_sdk::Resource;
    use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider};

    /// The OTLP/HTTP path of traces, added to an endpoint given without a path.
    const TRACES_PATH: &str = "/v1/traces";
    /// The collector's default endpoint (OTLP/HTTP), as OpenTelemetry's SDKs have it.
    const DEFAULT_ENDPOINT: &str = "http://localhost:4318";
    /// The largest answer of a collector read (its answers are small).
    const MAX_ANSWER: usize = 1 << 20;
    /// The longest error text kept (a collector's answer may be long).
    const MAX_ERROR: usize = 400;
    /// A failed export is logged at most once in this many seconds.
    const LOG_EVERY: u64 = 60;

    /// Export of the process's `tracing` spans as OpenTelemetry traces, over OTLP/HTTP with
    /// protobuf bodies, in batches. See [the module](super) for the spans the runtime makes.
    #[derive(Clone, Debug)]
    pub struct Tracing {
        endpoint: Option<String>,
        service: String,
        ratio: f64,
        timeout: Duration,
        traceparent: bool,
    }

    /// Why [`Tracing`] could not be installed, or could not send what it holds. Its text
    /// never quotes the endpoint (it may hold a user and password).
    #[derive(Debug, thiserror::Error)]
    #[non_exhaustive]
    pub enum TracingError {
        /// The endpoint (given, or from the environment) is not an `http://` or `https://` URL.
        #[error("the OTLP endpoint is not an http:// or https:// URL")]
        Endpoint,
        /// [`Tracing::install`] was called outside a tokio runtime.
        #[error("Tracing::install was called outside a tokio runtime")]
        NoRuntime,
        /// The system's root certificates, for an `https://` endpoint, could not be read.
        #[error("the system's root certificates could not be read ({0:?})")]
        RootCertificates(std::io::ErrorKind),
        /// The OpenTelemetry SDK refused the exporter's configuration.
        #[error("the OTLP exporter could not be built")]
        Exporter,
        /// A flush or shutdown did not complete (a timeout, an export that failed).
        #[error("the spans were not all sent: {0}")]
        Export(String),
    }

    /// The installed exporter: [`TracingGuard::shutdown`] sends what is buffered and stops.
    ///
    /// The SDK sends from a thread of its own, through requests made on the runtime
    /// [`Tracing::install`] was called on: that runtime must outlive the exports. Dropping the
    /// last handle of the tracer provider (the layer's, in a subscriber that ends) on a
    /// thread of a current-thread runtime blocks that thread for up to 5 s, the SDK waiting
    /// for an export only that thread could send: call [`TracingGuard::shutdown`] first.
    #[derive(Debug)]
    pub struct TracingGuard {
        provider: SdkTracerProvider,
        timeout: Duration,
    }

    impl Tracing {
        /// OTLP/HTTP to the endpoint of `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` (as it is) or
        /// `OTEL_EXPORTER_OTLP_ENDPOINT` (with `/v1/traces`), else `http://localhost:4318`;
        /// the service name of `OTEL_SERVICE_NAME`, else `multicluster-runtime`; every trace
        /// sampled; `traceparent` sent.
        pub fn otlp() -> Self {
            Self {
                endpoint: None,
                service: std::env::var("OTEL_SERVICE_NAME")
                    .ok()
                    .filter(|name| !name.is_empty())
                    .unwrap_or_else(|| "multicluster-runtime".into()),
                ratio: 1.0,
                timeout: Duration::from_secs(10),
                traceparent: true,
            }
        }

        /// The collector's OTLP/HTTP endpoint, `http://` or `https://` (checked against the
        /// system's roots). Given without a path, traces go to its `/v1/traces`.
        #[must_use]
        pub fn endpoint(mut self, url: impl Into<String>) -> Self {
            self.endpoint = Some(url.into());
            self
        }

        /// The `service.name` of the traces.
        #[must_use]
        pub fn service_name(mut self, name: impl Into<String>) -> Self {
            self.service = name.into();
            self
        }

        /// The share of new traces sampled (0 to 1; 1 by default). A span whose parent came
        /// sampled or not follows its parent.
        #[must_use]
        pub fn sample_ratio(mut self, ratio: f64) -> Self {
            self.ratio = if ratio.is_nan() {
                0.0
            } else {
                ratio.clamp(0.0, 1.0)
            };
            self
        }

        /// How long one export may take (10 s by default).
        #[must_use]
        pub fn timeout(mut self, timeout: Duration) -> Self {
            self.timeout = timeout;
            self
        }

        /// Whether requests to the API servers carry the `traceparent` of their span (on by
        /// default). Off, member clusters' API servers (which may be tenants') see no trace
        /// ids. Process-wide, set at [`Tracing::install`].
        #[must_use]
        pub fn traceparent(mut self, send: bool) -> Self {
            self.traceparent = send;
            self
        }

        /// The layer to add to your `tracing_subscriber` registry, and the guard that
        /// flushes at shutdown. Call it on the tokio runtime the exports are to be sent from.
        pub fn install<S>(
            self,
        ) -> Result<(impl tracing_subscriber::Layer<S> + use<S>, TracingGuard), TracingError>
        where
            S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
        {
            let handle =
                tokio::runtime::Handle::try_current().map_err(|_| TracingError::NoRuntime)?;
            let endpoint = resolve(self.endpoint.as_deref())?;
            let https = endpoint.starts_with("https://");
            let exporter = opentelemetry_otlp::SpanExporter::builder()
                .with_http()
                .with_http_client(Sender::new(handle, self.timeout, https)?)
                .with_timeout(self.timeout)
                .with_endpoint(endpoint)
                .build()
                .map_err(|_| TracingError::Exporter)?;
            let provider = SdkTracerProvider::builder()
                .with_batch_exporter(exporter)
                .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
                    self.ratio,
                ))))
                .with_resource(
                    Resource::builder()
                        .with_service_name(self.service.clone())
                        .build(),
                )
                .build();
            super::PROPAGATE.store(self.traceparent, Ordering::Relaxed);
            let tracer = provider.tracer("multicluster-runtime");
            let layer = tracing_opentelemetry::layer().with_tracer(tracer);
            Ok((
                layer,
                TracingGuard {
                    provider,
                    timeout: self.timeout,
                },
            ))
        }
    }

    /// The traces endpoint: `given`, else the environment's, else the default; with
    /// `/v1/traces` where it has no path (and no query).
    fn resolve(given: Option<&str>) -> Result<String, TracingError> {
        let from_env = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        let (endpoint, as_is) = match given {
            Some(given) => (given.to_string(), false),
            None => match from_env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") {
                Some(endpoint) => (endpoint, true),
                None => (
                    from_env("OTEL_EXPORTER_OTLP_ENDPOINT")
                        .unwrap_or_else(|| DEFAULT_ENDPOINT.into()),
                    false,
                ),
            },
        };
        let uri: http::Uri = endpoint.parse().map_err(|_| TracingError::Endpoint)?;
        if !matches!(uri.scheme_str(), Some("http" | "https")) || uri.host().is_none() {
            return Err(TracingError::Endpoint);
        }
        let bare = matches!(uri.path(), "" | "/") && uri.query().is_none();
        Ok(if bare && !as_is {
            format!("{}{TRACES_PATH}", endpoint.trim_end_matches('/'))
        } else {
            endpoint
        })
    }

    impl TracingGuard {
        /// Sends the spans still buffered (waiting at most 5 s, the SDK's bound).
        pub async fn flush(&self) -> Result<(), TracingError> {
            let provider = self.provider.clone();
            blocking(move || provider.force_flush()).await
        }

        /// Sends the spans still buffered and stops exporting (waiting at most the export
        /// timeout and a second).
        pub async fn shutdown(self) -> Result<(), TracingError> {
            let (provider, wait) = (self.provider, self.timeout + Duration::from_secs(1));
            blocking(move || provider.shutdown_with_timeout(wait)).await
        }
    }

    /// The SDK's flush and shutdown wait for its exporting thread, which waits on requests
    /// sent from the runtime: they wait off the runtime's threads.
    async fn blocking(
        call: impl FnOnce() -> opentelemetry_sdk::error::OTelSdkResult + Send + 'static,
    ) -> Result<(), TracingError> {
        match tokio::task::spawn_blocking(call).await {
            Ok(result) => result.map_err(|error| {
                TracingError::Export(crate::util::cut(error.to_string(), MAX_ERROR))
            }),
            Err(error) if error.is_panic() => Err(TracingError::Export("it panicked".into())),
            Err(_) => Err(TracingError::Export("the runtime is shutting down".into())),
        }
    }

    type Client = hyper_util::client::legacy::Client<
        hyper_rustls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector>,
        Full<Bytes>,
    >;

    /// The exporter's HTTP client: hyper, its requests sent on the runtime it was made on
    /// (the SDK exports from a thread of its own, outside any runtime).
    #[derive(Clone)]
    struct Sender {
        client: Client,
        handle: tokio::runtime::Handle,
        timeout: Duration,
        /// When a failure was last logged (seconds since the epoch).
        logged: std::sync::Arc<AtomicU64>,
    }

    impl std::fmt::Debug for Sender {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("Sender").finish_non_exhaustive()
        }
    }

    impl Sender {
        fn new(
            handle: tokio::runtime::Handle,
            timeout: Duration,
            https: bool,
        ) -> Result<Self, TracingError> {
            let provider = || std::sync::Arc::new(rustls::crypto::ring::default_provider());
            let builder = hyper_rustls::HttpsConnectorBuilder::new();
            let builder = if https {
                builder
                    .with_provider_and_native_roots(provider())
                    .map_err(|error| TracingError::RootCertificates(error.kind()))?
            } else {
                // No TLS is spoken: no roots read (an image may have none).
                let config = rustls::ClientConfig::builder_with_provider(provider())
                    .with_safe_default_protocol_versions()
                    .map_err(|_| TracingError::Exporter)?
                    .with_root_certificates(rustls::RootCertStore::empty())
                    .with_no_client_auth();
                builder.with_tls_config(config)
            };
            let connector = builder.https_or_http().enable_http1().build();
            let client =
                hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                    .build(connector);
            Ok(Self {
                client,
                handle,
                timeout,
                logged: std::sync::Arc::default(),
            })
        }

        /// Logs a failed export, at most once a minute (the SDK's own logs are off).
        fn failed(&self, what: &str) {
            let now = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs());
            let last = self.logged.load(Ordering::Relaxed);
            if (last == 0 || now >= last + LOG_EVERY)
                && self
                    .logged
                    .compare_exchange(last, now.max(1), Ordering::Relaxed, Ordering::Relaxed)
                    .is_ok()
            {
                tracing::warn!(error = %what, "sending spans to the OpenTelemetry collector failed (said at most once a minute)");
            }
        }
    }

    #[async_trait::async_trait]
    impl opentelemetry_http::HttpClient for Sender {
        async fn send_bytes(
            &self,
            request: Request<Bytes>,
        ) -> Result<Response<Bytes>, opentelemetry_http::HttpError> {
            let client = self.client.clone();
            let timeout = self.timeout;
            let sent = self.handle.spawn(async move {
                tokio::time::timeout(timeout, async move {
                    let response = client
                        .request(request.map(Full::new))
                        .await
                        .map_err(|error| crate::util::cut(error.to_string(), MAX_ERROR))?;
                    let (head, body) = response.into_parts();
                    let body = Limited::new(body, MAX_ANSWER)
                        .collect()
                        .await
                        .map_err(|error| crate::util::cut(error.to_string(), MAX_ERROR))?
                        .to_bytes();
                    Ok::<_, String>(Response::from_parts(head, body))
                })
                .await
                .map_err(|_| "the collector did not answer in time".to_string())?
            });
            let answer = match sent.await {
                Ok(answer) => answer,
                Err(_) => Err("the runtime it sends from has stopped".to_string()),
            };
            match &answer {
                Ok(response) if !response.status().is_success() => {
                    self.failed(&format!("the collector answered {}", response.status()));
                }
                Ok(_) => {}
                Err(error) => self.failed(error),
            }
            answer.map_err(Into::into)
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn an_endpoint_without_a_path_takes_the_traces_path() {
            assert_eq!(
                resolve(Some("http://collector:4318")).unwrap(),
                "http://collector:4318/v1/traces"
            );
            assert_eq!(
                resolve(Some("https://collector:4318/")).unwrap(),
                "https://collector:4318/v1/traces"
            );
            assert_eq!(
                resolve(Some("http://collector:4318/custom/traces")).unwrap(),
                "http://collector:4318/custom/traces"
            );
            assert_eq!(
                resolve(Some("http://collector:4318?tenant=a")).unwrap(),
                "http://collector:4318?tenant=a",
                "a query is left as it is"
            );
            for refused in ["collector:4318", "ftp://collector/", "http://", "not a url"] {
                assert!(
                    matches!(resolve(Some(refused)), Err(TracingError::Endpoint)),
                    "{refused}"
                );
            }
            let error = resolve(Some("ftp://user:secret@collector/")).unwrap_err();
            assert!(!error.to_string().contains("secret"), "{error}");
        }
    }
}

#[cfg(all(test, feature = "opentelemetry"))]
mod tests {
    use tracing_subscriber::layer::SubscriberExt;

    use super::*;

    #[test]
    fn a_sampled_span_gives_its_traceparent_and_trace_id() {
        use opentelemetry::trace::TracerProvider as _;
        let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder().build();
        let subscriber = tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
        tracing::subscriber::with_default(subscriber, || {
            let span = tracing::info_span!("request");
            let header = traceparent(&span).expect("a traceparent");
            let header = header.to_str().unwrap();
            let parts: Vec<&str> = header.split('-').collect();
            assert_eq!(parts.len(), 4, "{header}");
            assert_eq!(parts[0], "00");
            assert_eq!(parts[1].len(), 32);
            assert_eq!(parts[2].len(), 16);
            assert_eq!(parts[3], "01", "sampled");
            assert_eq!(TraceMark::of(&span).trace_id().as_deref(), Some(parts[1]));
            // A child shares the trace, with a span id of its own.
            let child = tracing::info_span!(parent: &span, "child");
            let child_header = traceparent(&child).unwrap();
            let child_parts: Vec<String> = child_header
                .to_str()
                .unwrap()
                .split('-')
                .map(String::from)
                .collect();
            assert_eq!(child_parts[1], parts[1]);
            assert_ne!(child_parts[2], parts[2]);
        });
        // No OpenTelemetry layer: nothing.
        let span = tracing::info_span!("request");
        assert!(traceparent(&span).is_none());
        assert_eq!(TraceMark::of(&span), TraceMark::default());
    }
}
