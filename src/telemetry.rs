//! Traces across clusters: the runtime's spans, and with the feature `opentelemetry` their
//! export over OTLP, the W3C `traceparent` of each request to an API server and trace ids as
//! exemplars of the reconcile histogram.
//!
//! The runtime makes its spans with `tracing`, whatever subscriber you install:
//!
//! | span | when | fields |
//! |---|---|---|
//! | `watch_event` | a watch event (or another source) asks a fleet controller for a reconcile | `controller`, `cluster`, `object`, `reason` |
//! | `queue` | from then until the request is taken from the queue (a child of `watch_event`) | `controller`, `cluster`, `lane` (`normal` or `low`) |
//! | `reconcile` | the reconcile (a child of `queue` when an event asked for it) | `controller`, `cluster`, `object`, `reason` |
//! | `request` | each request a reconcile makes to an API server (a child of the span it is made in) | `cluster`, `http.request.method`, `url.path`, `http.response.status_code` |
//!
//! A request is spanned only when it is made inside a span: the caches' own lists and watches
//! are not. Requests that came together in the queue run as one reconcile, a child of the
//! first request's `queue` span.
//!
//! With the feature `opentelemetry`, [`Tracing`] exports these spans (and any others of your
//! program) to an OpenTelemetry collector; each spanned request carries the `traceparent` of
//! its span, so an API server that traces (`--tracing-config-file`) continues the trace;
//! and `controller_runtime_reconcile_time_seconds` keeps, per bucket, the trace id of a
//! sampled reconcile as an exemplar (OpenMetrics' `# {trace_id="…"}`), so a slow bucket leads
//! to a trace.
//!
//! ```no_run
//! # #[cfg(feature = "opentelemetry")]
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! use tracing_subscriber::prelude::*;
//! use multicluster_runtime::telemetry::Tracing;
//!
//! let (layer, tracing) = Tracing::otlp()
//!     .endpoint("http://otel-collector.observability:4318")
//!     .service_name("fleet-operator")
//!     .install()?;
//! tracing_subscriber::registry()
//!     .with(tracing_subscriber::fmt::layer())
//!     .with(layer)
//!     .init();
//! // ... run the manager ...
//! tracing.shutdown().await?; // sends what is still buffered
//! # Ok(())
//! # }
//! ```
//!
//! Trust: spans carry cluster ids, object names and namespaces and request paths (never a
//! request's body, query or headers); whoever reads the collector reads those.

/// A sampled span's trace id, for an exemplar (nothing without the feature `opentelemetry`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct TraceMark(#[cfg(feature = "opentelemetry")] Option<[u8; 16]>);

impl TraceMark {
    /// The trace of `span`, if OpenTelemetry samples it.
    #[cfg(feature = "opentelemetry")]
    pub(crate) fn of(span: &tracing::Span) -> Self {
        use opentelemetry::trace::TraceContextExt;
        use tracing_opentelemetry::OpenTelemetrySpanExt;
        if span.is_disabled() {
            return Self(None);
        }
        let context = span.context();
        let span_context = context.span().span_context().clone();
        Self(
            (span_context.is_valid() && span_context.is_sampled())
                .then(|| span_context.trace_id().to_bytes()),
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

/// The W3C `traceparent` of `span` (`00-<trace id>-<span id>-<flags>`), if it has a valid
/// OpenTelemetry context.
#[cfg(feature = "opentelemetry")]
pub(crate) fn traceparent(span: &tracing::Span) -> Option<http::HeaderValue> {
    use opentelemetry::trace::TraceContextExt;
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    if span.is_disabled() {
        return None;
    }
    let context = span.context();
    let span_context = context.span().span_context().clone();
    if !span_context.is_valid() {
        return None;
    }
    let value = format!(
        "00-{}-{}-{:02x}",
        span_context.trace_id(),
        span_context.span_id(),
        span_context.trace_flags().to_u8()
    );
    http::HeaderValue::from_str(&value).ok()
}

#[cfg(feature = "opentelemetry")]
pub use otlp::{Tracing, TracingError, TracingGuard};

#[cfg(feature = "opentelemetry")]
mod otlp {
    use std::time::Duration;

    use bytes::Bytes;
    use http::{Request, Response};
    use http_body_util::{BodyExt, Full, Limited};
    use opentelemetry::trace::TracerProvider as _;
    use opentelemetry_otlp::{WithExportConfig, WithHttpConfig};
    use opentelemetry_sdk::Resource;
    use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider};

    /// The OTLP/HTTP path of traces, added to an endpoint given without a path.
    const TRACES_PATH: &str = "/v1/traces";
    /// The largest answer of a collector read (its answers are small).
    const MAX_ANSWER: usize = 1 << 20;

    /// Export of the process's `tracing` spans as OpenTelemetry traces, over OTLP/HTTP with
    /// protobuf bodies, in batches. See [the module](super) for the spans the runtime makes.
    #[derive(Clone, Debug)]
    pub struct Tracing {
        endpoint: Option<String>,
        service: String,
        ratio: f64,
        timeout: Duration,
    }

    /// A [`Tracing`] that could not be installed: its endpoint is not a URL, or there is no
    /// tokio runtime to send from.
    #[derive(Debug, thiserror::Error)]
    #[error("OpenTelemetry tracing: {0}")]
    pub struct TracingError(String);

    /// The installed exporter: [`TracingGuard::shutdown`] sends what is buffered and stops.
    #[derive(Debug)]
    pub struct TracingGuard {
        provider: SdkTracerProvider,
    }

    impl Tracing {
        /// OTLP/HTTP to the endpoint of `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` (as it is) or
        /// `OTEL_EXPORTER_OTLP_ENDPOINT` (with `/v1/traces`), else `http://localhost:4318`;
        /// the service name of `OTEL_SERVICE_NAME`, else `multicluster-runtime`; every trace
        /// sampled.
        pub fn otlp() -> Self {
            Self {
                endpoint: None,
                service: std::env::var("OTEL_SERVICE_NAME")
                    .ok()
                    .filter(|name| !name.is_empty())
                    .unwrap_or_else(|| "multicluster-runtime".into()),
                ratio: 1.0,
                timeout: Duration::from_secs(10),
            }
        }

        /// The collector's OTLP/HTTP endpoint, `http://` or `https://` (the system's roots).
        /// Given without a path, traces go to its `/v1/traces`.
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

        /// The layer to add to your `tracing_subscriber` registry, and the guard that
        /// flushes at shutdown. Call it on the tokio runtime the exports are to be sent from.
        pub fn install<S>(
            self,
        ) -> Result<
            (
                tracing_opentelemetry::OpenTelemetryLayer<S, opentelemetry_sdk::trace::Tracer>,
                TracingGuard,
            ),
            TracingError,
        >
        where
            S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
        {
            let handle = tokio::runtime::Handle::try_current()
                .map_err(|_| TracingError("install it from within a tokio runtime".into()))?;
            let mut exporter = opentelemetry_otlp::SpanExporter::builder()
                .with_http()
                .with_http_client(Sender::new(handle, self.timeout)?)
                .with_timeout(self.timeout);
            if let Some(endpoint) = &self.endpoint {
                exporter = exporter.with_endpoint(with_traces_path(endpoint)?);
            }
            let exporter = exporter
                .build()
                .map_err(|error| TracingError(format!("the exporter: {error}")))?;
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
            let tracer = provider.tracer("multicluster-runtime");
            let layer = tracing_opentelemetry::layer().with_tracer(tracer);
            Ok((layer, TracingGuard { provider }))
        }
    }

    /// `endpoint` with `/v1/traces` if it has no path.
    fn with_traces_path(endpoint: &str) -> Result<String, TracingError> {
        let uri: http::Uri = endpoint
            .parse()
            .map_err(|_| TracingError("the endpoint is not a URL".into()))?;
        if !matches!(uri.scheme_str(), Some("http" | "https")) {
            return Err(TracingError(
                "the endpoint's scheme is neither http nor https".into(),
            ));
        }
        Ok(match uri.path() {
            "" | "/" => format!("{}{TRACES_PATH}", endpoint.trim_end_matches('/')),
            _ => endpoint.to_string(),
        })
    }

    impl TracingGuard {
        /// Sends the spans still buffered.
        pub async fn flush(&self) -> Result<(), TracingError> {
            let provider = self.provider.clone();
            blocking(move || provider.force_flush()).await
        }

        /// Sends the spans still buffered and stops exporting.
        pub async fn shutdown(self) -> Result<(), TracingError> {
            let provider = self.provider;
            blocking(move || provider.shutdown()).await
        }
    }

    /// The SDK's flush and shutdown wait for its exporting thread, which waits on requests
    /// sent from the runtime: they wait off the runtime's threads.
    async fn blocking(
        call: impl FnOnce() -> opentelemetry_sdk::error::OTelSdkResult + Send + 'static,
    ) -> Result<(), TracingError> {
        tokio::task::spawn_blocking(call)
            .await
            .map_err(|_| TracingError("the flush panicked".into()))?
            .map_err(|error| TracingError(error.to_string()))
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
    }

    impl std::fmt::Debug for Sender {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("Sender").finish_non_exhaustive()
        }
    }

    impl Sender {
        fn new(handle: tokio::runtime::Handle, timeout: Duration) -> Result<Self, TracingError> {
            let connector = hyper_rustls::HttpsConnectorBuilder::new()
                .with_native_roots()
                .map_err(|_| TracingError("the system's root certificates".into()))?
                .https_or_http()
                .enable_http1()
                .build();
            let client =
                hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                    .build(connector);
            Ok(Self {
                client,
                handle,
                timeout,
            })
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
                    let response = client.request(request.map(Full::new)).await?;
                    let (head, body) = response.into_parts();
                    let body = Limited::new(body, MAX_ANSWER)
                        .collect()
                        .await
                        .map_err(|error| error.to_string())?
                        .to_bytes();
                    Ok::<_, opentelemetry_http::HttpError>(Response::from_parts(head, body))
                })
                .await
                .map_err(|_| "the collector did not answer in time")?
            });
            sent.await.map_err(|_| "the export task ended")?
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn an_endpoint_without_a_path_takes_the_traces_path() {
            assert_eq!(
                with_traces_path("http://collector:4318").unwrap(),
                "http://collector:4318/v1/traces"
            );
            assert_eq!(
                with_traces_path("https://collector:4318/").unwrap(),
                "https://collector:4318/v1/traces"
            );
            assert_eq!(
                with_traces_path("http://collector:4318/custom/traces").unwrap(),
                "http://collector:4318/custom/traces"
            );
            assert!(with_traces_path("collector:4318").is_err());
            assert!(with_traces_path("ftp://collector/").is_err());
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
