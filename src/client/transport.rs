//! The shared transport: every cluster of the process that reaches the same API server with
//! the same TLS identity sends its requests over the same HTTP/2 connections.
//!
//! kube-client's own stack speaks HTTP/1.1 only and builds a connection pool per client, so
//! each cluster name held one TCP+TLS connection per open watch (1,000 names of one API server:
//! 1,000 sockets, next to the common 1,024 open-file limit). Here a [`Transport`] is kept per
//! (scheme, host, port, trust, client identity, timeouts), found again by every
//! [`Cluster::from_config`](super::Cluster::from_config) that needs it and dropped with the
//! last cluster using it (a rotated client certificate is another key, so another transport).
//! Each transport holds HTTP/2 connections (ALPN `h2`), each carrying as many streams as the
//! server allows (its `SETTINGS_MAX_CONCURRENT_STREAMS`; a new connection is opened when all
//! are full), and pings each connection so that one the server or the network dropped
//! silently is noticed and replaced (client-go learned to do this after watches hung on
//! half-open connections, kubernetes/kubernetes#87615). A connection the server winds down
//! (GOAWAY) takes no new streams, while those it still answers finish on it; the requests it
//! did not process are sent again on another. What cannot go over HTTP/2 goes over
//! HTTP/1.1 through kube's own connector: servers that do not offer `h2`, plain `http://`
//! endpoints, and upgrade requests (exec, attach, port-forward).
//!
//! The per-cluster parts of kube's stack (base URI, retries, authentication, extra and
//! impersonation headers) stay in each cluster's client, in front of the transport.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, header};
use http_body::Frame;
use http_body_util::BodyExt;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use kube::client::{Body, ConfigExt};
use rustls::pki_types::ServerName;
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;

use crate::util::sync::lock;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// How often an HTTP/2 connection is pinged, and how long an answer may take before the
/// connection is given up (client-go's `ReadIdleTimeout` and `PingTimeout`).
const PING_INTERVAL: Duration = Duration::from_secs(30);
const PING_TIMEOUT: Duration = Duration::from_secs(15);
/// Streams a new connection may open before the server's settings say how many it allows
/// (RFC 9113 asks servers to allow at least 100).
const INITIAL_STREAMS: usize = 100;
/// Flow-control windows: what the server may send ahead of our reading; nothing is allocated
/// for them up front. Each stream may have its window of data unread (a listing being read
/// slowly, a log followed and never read), and the connection's window holds that of every
/// stream it carries ([`STREAMS_PER_CONNECTION`]): however many of its streams are left
/// unread, the others on the connection still receive. The sizes are Go's HTTP/2 transport's.
const STREAM_WINDOW: u32 = 4 << 20;
const CONNECTION_WINDOW: u32 = 1 << 30;
/// At most this many streams of ours on one connection (fewer if the server allows fewer);
/// another connection is opened beyond.
const STREAMS_PER_CONNECTION: usize = (CONNECTION_WINDOW / STREAM_WINDOW) as usize;

/// Settings of the transports built from now on (tests shorten the pings).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Settings {
    pub(crate) ping_interval: Duration,
    pub(crate) ping_timeout: Duration,
}

static SETTINGS: Mutex<Settings> = Mutex::new(Settings {
    ping_interval: PING_INTERVAL,
    ping_timeout: PING_TIMEOUT,
});

/// The transports in use, by key. Weak: a transport lives as long as a client uses it.
fn registry() -> &'static Mutex<HashMap<Vec<u8>, Weak<Transport>>> {
    static REGISTRY: OnceLock<Mutex<HashMap<Vec<u8>, Weak<Transport>>>> = OnceLock::new();
    REGISTRY.get_or_init(Default::default)
}

/// Sets how often HTTP/2 connections built from now on are pinged and how long an answer
/// may take; `None` restores the defaults (30 s, 15 s).
#[doc(hidden)]
pub fn set_keepalive(ping: Option<(Duration, Duration)>) {
    let (ping_interval, ping_timeout) = ping.unwrap_or((PING_INTERVAL, PING_TIMEOUT));
    *lock(&SETTINGS) = Settings {
        ping_interval,
        ping_timeout,
    };
}

/// Where and as whom a transport connects.
struct Endpoint {
    host: String,
    port: u16,
    /// `None` for `http://`.
    tls: Option<(Arc<rustls::ClientConfig>, ServerName<'static>)>,
    /// The client certificate, when an exec plugin issues it (renewed after a 401).
    identity: Option<Arc<super::exec_cert::ExecIdentity>>,
}

/// What the server speaks, once known.
const UNKNOWN: u8 = 0;
const HTTP2: u8 = 1;
const HTTP1: u8 = 2;

/// Connections to one API server as one TLS identity, shared by every cluster using them.
pub(crate) struct Transport {
    key: Vec<u8>,
    endpoint: Endpoint,
    settings: Settings,
    protocol: AtomicU8,
    /// Live HTTP/2 connections.
    connections: Mutex<Vec<Arc<Connection>>>,
    /// Held while a connection is being opened, so that requests arriving together wait for
    /// it rather than each opening one; one per runtime, as connections are.
    opening: Mutex<HashMap<Option<tokio::runtime::Id>, Arc<tokio::sync::Mutex<()>>>>,
    /// kube's HTTP/1.1 client, for what cannot go over HTTP/2; built on first use.
    http1: OnceLock<Http1Client>,
    config: kube::Config,
}

type Http1Client = hyper_util::client::legacy::Client<
    hyper_timeout::TimeoutConnector<hyper_rustls::HttpsConnector<HttpConnector>>,
    Body,
>;

impl Drop for Transport {
    fn drop(&mut self) {
        let mut registry = lock(registry());
        if registry
            .get(&self.key)
            .is_some_and(|weak| weak.strong_count() == 0)
        {
            registry.remove(&self.key);
        }
        for connection in lock(&self.connections).drain(..) {
            connection.close();
        }
    }
}

/// One HTTP/2 connection.
struct Connection {
    send: h2::client::SendRequest<Bytes>,
    /// Streams of ours open on it (from sending a request to dropping its response body).
    active: AtomicUsize,
    closed: AtomicBool,
    /// Ends the task driving the connection.
    stop: tokio_util::sync::CancellationToken,
    /// The runtime whose task drives the connection. Only requests sent from that runtime use
    /// it: a runtime blocked or starved (or one a test harness runs beside another) stalls its
    /// own connections only, not the other runtimes' clients of the same server.
    runtime: Option<tokio::runtime::Id>,
    /// The client certificate it presented ([`Transport::identity_generation`]): once the
    /// certificate is renewed, it takes no new streams.
    identity: u64,
}

impl Connection {
    fn has_room(&self) -> bool {
        !self.closed.load(Ordering::Acquire)
            && self.active.load(Ordering::Acquire)
                < self
                    .send
                    .current_max_send_streams()
                    .min(STREAMS_PER_CONNECTION)
    }

    /// Ends the connection and every stream on it.
    fn close(&self) {
        self.closed.store(true, Ordering::Release);
        self.stop.cancel();
    }

    /// Takes no new stream; the streams open on it go on until they end or the server
    /// closes the connection.
    fn retire(&self) {
        self.closed.store(true, Ordering::Release);
    }
}

/// A stream's place on its connection, given back when dropped.
pub(crate) struct Slot(Arc<Connection>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The runtime the caller runs on, if any.
fn current_runtime() -> Option<tokio::runtime::Id> {
    tokio::runtime::Handle::try_current().ok().map(|h| h.id())
}

/// The transport for `config`, shared with every other client of the same key; `None` when
/// the configuration needs what the transport does not do (a proxy): such a cluster keeps
/// kube's own stack.
pub(crate) fn shared(config: &kube::Config) -> Result<Option<Arc<Transport>>, kube::Error> {
    if config.proxy_url.is_some() {
        return Ok(None);
    }
    let Some(key) = key(config) else {
        return Ok(None);
    };
    if let Some(transport) = lock(registry()).get(&key).and_then(Weak::upgrade) {
        return Ok(Some(transport));
    }
    // Built outside the registry's lock: the TLS configuration reads files.
    let endpoint = endpoint(config)?;
    let mut registry = lock(registry());
    if let Some(transport) = registry.get(&key).and_then(Weak::upgrade) {
        return Ok(Some(transport));
    }
    let transport = Arc::new(Transport {
        key: key.clone(),
        protocol: AtomicU8::new(if endpoint.tls.is_some() {
            UNKNOWN
        } else {
            HTTP1
        }),
        endpoint,
        settings: *lock(&SETTINGS),
        connections: Mutex::new(Vec::new()),
        opening: Mutex::new(HashMap::new()),
        http1: OnceLock::new(),
        config: config.clone(),
    });
    registry.insert(key, Arc::downgrade(&transport));
    Ok(Some(transport))
}

/// What decides whether two configurations may share connections: the server (scheme,
/// host, port, TLS server name), whom it is trusted as (CA, verification), whom we are to it
/// (client certificate and key, or the exec plugin that makes them) and the timeouts. Paths
/// are read, so a rotated file is another key. `None` if a file cannot be read: the cluster
/// then keeps kube's own stack, which reports the error.
pub(super) fn key(config: &kube::Config) -> Option<Vec<u8>> {
    fn field(key: &mut Vec<u8>, bytes: &[u8]) {
        key.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
        key.extend_from_slice(bytes);
    }
    fn file(key: &mut Vec<u8>, path: Option<&String>) -> Option<()> {
        match path {
            Some(path) => field(key, &std::fs::read(path).ok()?),
            None => field(key, b""),
        }
        Some(())
    }
    let mut key = Vec::with_capacity(4096);
    let url = &config.cluster_url;
    field(&mut key, url.scheme_str().unwrap_or("").as_bytes());
    field(
        &mut key,
        url.authority().map(|a| a.as_str()).unwrap_or("").as_bytes(),
    );
    for cert in config.root_cert.iter().flatten() {
        field(&mut key, cert);
    }
    field(&mut key, b"|");
    let path = config
        .root_cert_file
        .as_ref()
        .map(|p| p.display().to_string());
    field(&mut key, path.as_deref().unwrap_or("").as_bytes());
    field(
        &mut key,
        &[
            u8::from(config.accept_invalid_certs),
            u8::from(config.reset_reader_on_write),
        ],
    );
    field(
        &mut key,
        config.tls_server_name.as_deref().unwrap_or("").as_bytes(),
    );
    for timeout in [
        config.connect_timeout,
        config.read_timeout,
        config.write_timeout,
    ] {
        field(
            &mut key,
            &timeout.map_or(u128::MAX, |t| t.as_nanos()).to_le_bytes(),
        );
    }
    let auth = &config.auth_info;
    field(
        &mut key,
        auth.client_certificate_data
            .as_deref()
            .unwrap_or("")
            .as_bytes(),
    );
    {
        use secrecy::ExposeSecret;
        let data = auth
            .client_key_data
            .as_ref()
            .map(|k| k.expose_secret().to_string());
        field(&mut key, data.as_deref().unwrap_or("").as_bytes());
    }
    file(&mut key, auth.client_certificate.as_ref())?;
    file(&mut key, auth.client_key.as_ref())?;
    // An exec plugin may answer with a client certificate: its configuration is part of the
    // identity (kube runs it when the TLS configuration is built).
    let exec = auth
        .exec
        .as_ref()
        .and_then(|_| super::endpoint::credentials(auth))
        .map(|value| value["exec"].to_string());
    field(&mut key, exec.as_deref().unwrap_or("").as_bytes());
    Some(key)
}

fn endpoint(config: &kube::Config) -> Result<Endpoint, kube::Error> {
    let url = &config.cluster_url;
    let https = url.scheme() != Some(&http::uri::Scheme::HTTP);
    let host = url
        .host()
        .unwrap_or("")
        .trim_matches(['[', ']'])
        .to_string();
    let port = url.port_u16().unwrap_or(if https { 443 } else { 80 });
    let mut identity = None;
    let tls = if https {
        // kube would run an exec plugin here, synchronously, for a client certificate: the
        // plugin runs later, off the workers, and its certificate comes through `identity`.
        let mut plain = config.clone();
        plain.auth_info.exec = None;
        let mut tls = plain.rustls_client_config()?;
        identity = super::exec_cert::ExecIdentity::wrap(config, &mut tls);
        tls.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        let name = config
            .tls_server_name
            .clone()
            .unwrap_or_else(|| host.clone());
        let name = ServerName::try_from(name).map_err(|error| {
            kube::Error::RustlsTls(kube::client::RustlsTlsError::InvalidServerName(error))
        })?;
        Some((Arc::new(tls), name))
    } else {
        None
    };
    Ok(Endpoint {
        host,
        port,
        tls,
        identity,
    })
}

impl Transport {
    fn http1(&self) -> Result<&Http1Client, BoxError> {
        if let Some(client) = self.http1.get() {
            return Ok(client);
        }
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        // The endpoint's TLS configuration (trust, and the client certificate that an exec
        // plugin renews), offering HTTP/1.1 only.
        let https = match &self.endpoint.tls {
            Some((tls, name)) => {
                let mut tls = (**tls).clone();
                // The builder offers HTTP/1.1 (it insists on setting the protocols itself).
                tls.alpn_protocols = Vec::new();
                hyper_rustls::HttpsConnectorBuilder::new()
                    .with_tls_config(tls)
                    .https_or_http()
                    .with_server_name_resolver(hyper_rustls::FixedServerNameResolver::new(
                        name.clone(),
                    ))
                    .enable_http1()
                    .wrap_connector(http)
            }
            None => self.config.rustls_https_connector_with_connector(http)?,
        };
        let mut connector = hyper_timeout::TimeoutConnector::new(https);
        connector.set_connect_timeout(self.config.connect_timeout);
        connector.set_read_timeout(self.config.read_timeout);
        connector.set_write_timeout(self.config.write_timeout);
        connector.set_reset_reader_on_write(self.config.reset_reader_on_write);
        let client =
            hyper_util::client::legacy::Builder::new(TokioExecutor::new()).build(connector);
        Ok(self.http1.get_or_init(|| client))
    }

    async fn send(
        self: Arc<Self>,
        request: Request<Body>,
    ) -> Result<Response<TransportBody>, BoxError> {
        let upgrade = request.headers().contains_key(header::UPGRADE);
        if upgrade || self.protocol.load(Ordering::Acquire) == HTTP1 {
            return self.send_http1(request).await;
        }
        let (mut parts, body) = request.into_parts();
        let body = body.collect().await?.to_bytes();
        // Headers HTTP/2 forbids (RFC 9113 8.2.2); kube sends none of them on these requests.
        for name in [
            header::CONNECTION,
            header::TRANSFER_ENCODING,
            header::HOST,
            http::HeaderName::from_static("keep-alive"),
            http::HeaderName::from_static("proxy-connection"),
        ] {
            parts.headers.remove(name);
        }
        // A request the server did not process is sent once more, on another connection:
        // one that never left (the connection had closed), one the server refused
        // (REFUSED_STREAM) or one above the last stream a GOAWAY said it processed. A request
        // that was sent and then lost its connection may have been processed: only reads
        // (GET, HEAD, OPTIONS) are sent again; a create or a patch is not sent twice, its
        // caller gets the error.
        let replayable = matches!(
            parts.method,
            http::Method::GET | http::Method::HEAD | http::Method::OPTIONS
        );
        let mut attempts = 0;
        loop {
            attempts += 1;
            let Some(slot) = self.slot().await? else {
                let request = Request::from_parts(parts, Body::from(body.to_vec()));
                return self.send_http1(request).await;
            };
            let head = Request::from_parts(parts.clone(), ());
            let sent = send_h2(&slot, head, body.clone(), self.config.write_timeout);
            // The read timeout bounds the wait for the response's head, as it bounds each read
            // on HTTP/1.1; a stream that times out is reset (dropped), its connection kept.
            let answered = match self.config.read_timeout {
                Some(limit) => tokio::time::timeout(limit, sent)
                    .await
                    .map_err(|_| timed_out("the response's head", limit))?,
                None => sent.await,
            };
            match answered {
                Ok(response) => {
                    let (head, recv) = response.into_parts();
                    let idle = self.config.read_timeout.map(|limit| Idle {
                        limit,
                        timer: Box::pin(tokio::time::sleep(limit)),
                    });
                    return Ok(Response::from_parts(
                        head,
                        HandBack::new(Protocol::Http2 {
                            recv,
                            idle,
                            _slot: slot,
                        }),
                    ));
                }
                Err(Failed::TimedOut(error)) => return Err(error),
                Err(Failed::H2 { error, sent }) => {
                    let broken = error.is_go_away()
                        || slot.0.closed.load(Ordering::Acquire)
                        || error.is_io();
                    if error.is_io() {
                        // Dead: every stream on it has failed already.
                        slot.0.close();
                    } else if broken || error.reason() == Some(h2::Reason::REFUSED_STREAM) {
                        // Winding down (GOAWAY) or full: no new streams there, but the
                        // streams the server is still answering keep their connection.
                        slot.0.retire();
                    }
                    if !(attempts < 2 && (!sent || unprocessed(&error) || (replayable && broken))) {
                        return Err(error.into());
                    }
                }
            }
        }
    }

    async fn send_http1(
        &self,
        request: Request<Body>,
    ) -> Result<Response<TransportBody>, BoxError> {
        let response = self.http1()?.request(request).await?;
        Ok(response.map(|body| HandBack::new(Protocol::Http1(body))))
    }

    /// A place for one more stream on a connection with room, opening a connection if none
    /// has; `None` once the server turned out not to speak HTTP/2.
    async fn slot(&self) -> Result<Option<Slot>, BoxError> {
        if let Some(slot) = self.free_slot() {
            return Ok(Some(slot));
        }
        let opening = {
            let mut opening = lock(&self.opening);
            // Those nobody waits on are let go (runtimes come and go, in tests).
            opening.retain(|_, lock| Arc::strong_count(lock) > 1);
            opening.entry(current_runtime()).or_default().clone()
        };
        let _opening = opening.lock().await;
        if let Some(slot) = self.free_slot() {
            return Ok(Some(slot));
        }
        if self.protocol.load(Ordering::Acquire) == HTTP1 {
            return Ok(None);
        }
        let Some(connection) = self.connect().await? else {
            self.protocol.store(HTTP1, Ordering::Release);
            return Ok(None);
        };
        self.protocol.store(HTTP2, Ordering::Release);
        connection.active.fetch_add(1, Ordering::AcqRel);
        let slot = Slot(connection.clone());
        let mut connections = lock(&self.connections);
        // Those closed, and those of an older client certificate: let go, they end when
        // their last stream does.
        let identity = self.identity_generation();
        connections.retain(|c| !c.closed.load(Ordering::Acquire) && c.identity == identity);
        connections.push(connection);
        Ok(Some(slot))
    }

    /// Which of the exec plugin's client certificates is current (0 without one).
    fn identity_generation(&self) -> u64 {
        self.endpoint
            .identity
            .as_ref()
            .map_or(0, |identity| identity.generation())
    }

    fn free_slot(&self) -> Option<Slot> {
        let runtime = current_runtime();
        let identity = self.identity_generation();
        let connections = lock(&self.connections);
        // The fullest connection with room: streams gather on few connections, and one that
        // empties can be closed by the server when idle.
        let connection = connections
            .iter()
            .filter(|c| c.runtime == runtime && c.identity == identity && c.has_room())
            .max_by_key(|c| c.active.load(Ordering::Acquire))?;
        connection.active.fetch_add(1, Ordering::AcqRel);
        Some(Slot(connection.clone()))
    }

    /// Opens a TLS connection offering `h2`, within the configuration's connect timeout;
    /// `None` if the server chose HTTP/1.1.
    async fn connect(&self) -> Result<Option<Arc<Connection>>, BoxError> {
        match self.config.connect_timeout {
            Some(timeout) => tokio::time::timeout(timeout, self.handshake())
                .await
                .map_err(|_| {
                    format!(
                        "connecting to {}:{} timed out after {timeout:?}",
                        self.endpoint.host, self.endpoint.port
                    )
                })?,
            None => self.handshake().await,
        }
    }

    async fn handshake(&self) -> Result<Option<Arc<Connection>>, BoxError> {
        let Some((tls, name)) = &self.endpoint.tls else {
            return Ok(None);
        };
        // Read before the handshake: a renewal meanwhile retires the connection at once.
        let identity = self.identity_generation();
        let tcp = TcpStream::connect((self.endpoint.host.as_str(), self.endpoint.port)).await?;
        tcp.set_nodelay(true)?;
        let stream = TlsConnector::from(tls.clone())
            .connect(name.clone(), tcp)
            .await?;
        if stream.get_ref().1.alpn_protocol() != Some(b"h2") {
            tracing::debug!(
                server = %self.config.cluster_url,
                "the API server does not offer HTTP/2; using HTTP/1.1"
            );
            return Ok(None);
        }
        let (send, mut connection) = h2::client::Builder::new()
            .initial_max_send_streams(INITIAL_STREAMS)
            .initial_window_size(STREAM_WINDOW)
            .initial_connection_window_size(CONNECTION_WINDOW)
            .enable_push(false)
            .handshake::<_, Bytes>(stream)
            .await?;
        let mut pings = connection
            .ping_pong()
            .ok_or("the HTTP/2 connection gave no ping handle")?;
        let stop = tokio_util::sync::CancellationToken::new();
        let state = Arc::new(Connection {
            send,
            active: AtomicUsize::new(0),
            closed: AtomicBool::new(false),
            stop: stop.clone(),
            runtime: current_runtime(),
            identity,
        });
        let server = self.config.cluster_url.to_string();
        let weak = Arc::downgrade(&state);
        let driver_stop = stop.clone();
        let driver_server = server.clone();
        tokio::spawn(async move {
            let why = tokio::select! {
                result = &mut connection => match result {
                    Ok(()) => "the server closed it".to_string(),
                    Err(error) => format!("it failed: {error}"),
                },
                () = driver_stop.cancelled() => "it was given up".to_string(),
            };
            if let Some(state) = weak.upgrade() {
                state.closed.store(true, Ordering::Release);
            }
            driver_stop.cancel();
            tracing::debug!(server = %driver_server, why, "HTTP/2 connection to the API server closed");
            // Dropping the connection ends every stream still open on it with an error, which
            // their watches see and retry on another connection.
            drop(connection);
        });
        // The server's SETTINGS come before its answer to a ping: once the answer is in, the
        // connection knows how many streams it may open (h2 assumes INITIAL_STREAMS before).
        // Given up if this request is dropped meanwhile: nothing would use the connection.
        let settings = self.settings;
        let unused = stop.clone().drop_guard();
        match tokio::time::timeout(settings.ping_timeout, pings.ping(h2::Ping::opaque())).await {
            Ok(Ok(_)) => {}
            Ok(Err(error)) => return Err(error.into()),
            Err(_) => return Err(format!("no answer to the first ping from {server}").into()),
        }
        unused.disarm();
        let keepalive_stop = stop.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    () = tokio::time::sleep(settings.ping_interval) => {}
                    () = keepalive_stop.cancelled() => return,
                }
                let answer =
                    tokio::time::timeout(settings.ping_timeout, pings.ping(h2::Ping::opaque()));
                let failed = tokio::select! {
                    answer = answer => match answer {
                        Ok(Ok(_)) => continue,
                        Ok(Err(_)) => false,
                        Err(_) => true,
                    },
                    () = keepalive_stop.cancelled() => return,
                };
                if failed {
                    tracing::warn!(
                        %server,
                        timeout = ?settings.ping_timeout,
                        "no answer to a keep-alive ping; closing the HTTP/2 connection to the API server"
                    );
                }
                keepalive_stop.cancel();
                return;
            }
        });
        tracing::debug!(
            server = %self.config.cluster_url,
            streams = state.send.current_max_send_streams(),
            "HTTP/2 connection to the API server opened"
        );
        Ok(Some(state))
    }
}

/// A request on HTTP/2 that failed: on its stream (and whether any of it may have reached the
/// server), or waiting for its stream to open.
enum Failed {
    H2 { error: h2::Error, sent: bool },
    TimedOut(BoxError),
}

/// Whether the server said it did not process the request: it refused the stream, or its
/// GOAWAY named a last stream below this one (h2 fails only those streams with the remote
/// GOAWAY; the streams it processed end with the connection, as I/O errors).
fn unprocessed(error: &h2::Error) -> bool {
    error.is_remote() && (error.is_go_away() || error.reason() == Some(h2::Reason::REFUSED_STREAM))
}

/// The error of a stream that waited longer than `limit` for `what`.
fn timed_out(what: &str, limit: Duration) -> BoxError {
    timeout_error(format!(
        "no data for {what} within the read timeout ({limit:?})"
    ))
}

fn timeout_error(text: String) -> BoxError {
    Box::new(std::io::Error::new(std::io::ErrorKind::TimedOut, text))
}

/// The write timeout on HTTP/2: how long a request may wait for the connection to take a
/// stream, and then for its stream to open (queued by h2 while the server's stream limit is
/// reached). Bytes stuck in the socket are the keep-alive pings' to find, for every stream
/// of the connection at once.
async fn send_h2(
    slot: &Slot,
    head: Request<()>,
    body: Bytes,
    write_timeout: Option<Duration>,
) -> Result<Response<h2::RecvStream>, Failed> {
    let unsent = |error| Failed::H2 { error, sent: false };
    let sent = |error| Failed::H2 { error, sent: true };
    let ready = slot.0.send.clone().ready();
    let mut send = match write_timeout {
        Some(limit) => tokio::time::timeout(limit, ready).await.map_err(|_| {
            Failed::TimedOut(timeout_error(format!(
                "the request's stream did not open within the write timeout ({limit:?})"
            )))
        })?,
        None => ready.await,
    }
    .map_err(unsent)?;
    let empty = body.is_empty();
    // An error here comes before the stream was opened: nothing was written.
    let (response, stream) = send.send_request(head, empty).map_err(unsent)?;
    // Over the server's stream limit (lowered below the streams in use after this
    // connection was picked), h2 queues the stream until another ends; `ready` on the handle
    // that sent it resolves once it is open (at once if it is). Dropped unopened, nothing
    // of it reached the server.
    if let Some(limit) = write_timeout
        && tokio::time::timeout(limit, send.ready()).await.is_err()
    {
        return Err(Failed::TimedOut(timeout_error(format!(
            "the request's stream did not open within the write timeout ({limit:?})"
        ))));
    }
    if empty {
        return response.await.map_err(sent);
    }
    send_body(stream, body, response).await
}

/// Sends the body of a request whose stream is open, then waits for the response's head.
/// The stream may have closed before the body went: a GOAWAY above its id or a reset says
/// why, and that decides whether the request is sent again. Or the server answered from the
/// head alone (a 401 or a 413 needs no body) and then reset the stream with NO_ERROR, as Go's
/// server does with a body it will not read (RFC 9113 section 8.1): its answer is the
/// response.
async fn send_body(
    mut stream: h2::SendStream<Bytes>,
    body: Bytes,
    response: h2::client::ResponseFuture,
) -> Result<Response<h2::RecvStream>, Failed> {
    let sent = |error| Failed::H2 { error, sent: true };
    // Buffered by h2 and sent as the stream's window allows.
    match stream.send_data(body, true) {
        Ok(()) => response.await.map_err(sent),
        // Closed: what ended it has reached the response, which is ready.
        Err(error) => match futures::FutureExt::now_or_never(response) {
            Some(Ok(response)) => Ok(response),
            Some(Err(why)) => Err(sent(why)),
            // Open, and the body refused (too big for a frame): dropped, the stream is reset.
            None => Err(sent(error)),
        },
    }
}

/// The service in every cluster's client stack that hands requests to its transport.
#[derive(Clone)]
pub(crate) struct Shared(pub(crate) Arc<Transport>);

impl tower_service::Service<Request<Body>> for Shared {
    type Response = Response<TransportBody>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Response<TransportBody>, BoxError>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        Box::pin(self.0.clone().send(request))
    }
}

/// A response body from either protocol.
pub(crate) type TransportBody = HandBack<Protocol>;

/// A stream's read timeout: the time allowed between two frames of the body.
pub(crate) struct Idle {
    limit: Duration,
    timer: Pin<Box<tokio::time::Sleep>>,
}

pub(crate) enum Protocol {
    Http2 {
        recv: h2::RecvStream,
        /// With a read timeout: when the body counts as stalled.
        idle: Option<Idle>,
        /// Keeps the stream counted on its connection until the body is dropped.
        _slot: Slot,
    },
    Http1(hyper::body::Incoming),
}

impl http_body::Body for Protocol {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.get_mut() {
            Protocol::Http1(body) => Pin::new(body).poll_frame(cx).map_err(Into::into),
            Protocol::Http2 { recv, idle, .. } => match recv.poll_data(cx) {
                Poll::Pending => {
                    if let Some(idle) = idle
                        && idle.timer.as_mut().poll(cx).is_ready()
                    {
                        return Poll::Ready(Some(Err(timed_out(
                            "the next part of the body",
                            idle.limit,
                        ))));
                    }
                    Poll::Pending
                }
                Poll::Ready(frame) => poll_h2_frame(frame, recv, idle, cx),
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            Protocol::Http1(body) => body.is_end_stream(),
            Protocol::Http2 { recv, .. } => recv.is_end_stream(),
        }
    }
}

/// A data frame (or the end) of an HTTP/2 body; each data frame restarts the read timeout.
fn poll_h2_frame(
    frame: Option<Result<Bytes, h2::Error>>,
    recv: &mut h2::RecvStream,
    idle: &mut Option<Idle>,
    cx: &mut Context<'_>,
) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
    if let Some(idle) = idle {
        idle.timer
            .as_mut()
            .reset(tokio::time::Instant::now() + idle.limit);
    }
    match frame {
        Some(Ok(data)) => {
            // Read: the server may send as much again.
            let _ = recv.flow_control().release_capacity(data.len());
            Poll::Ready(Some(Ok(Frame::data(data))))
        }
        Some(Err(error)) => Poll::Ready(Some(Err(error.into()))),
        None => match ready!(recv.poll_trailers(cx)) {
            Ok(Some(trailers)) => Poll::Ready(Some(Ok(Frame::trailers(trailers)))),
            Ok(None) => Poll::Ready(None),
            Err(error) => Poll::Ready(Some(Err(error.into()))),
        },
    }
}

/// A body that answers an empty data frame after each data frame, so that its reader lets go
/// of the chunk it has read.
///
/// A chunk's bytes are a slice of the connection's read buffer, and keep all of that buffer
/// allocated while they live. kube reads a watch through tokio-util's `StreamReader`, which
/// holds the chunk it has read (empty by then) until the next one arrives: for a watch that
/// sees no change for hours, that is hours of a read buffer shared with other streams (1,000
/// clusters that listed ten objects each held 2.3 MB so). An empty chunk arriving replaces
/// the one read, without waiting for the next.
pub(crate) struct HandBack<B> {
    body: B,
    /// A data frame went out: the next poll answers an empty one first.
    handed_out: bool,
}

impl<B> HandBack<B> {
    pub(crate) fn new(body: B) -> HandBack<B> {
        HandBack {
            body,
            handed_out: false,
        }
    }
}

impl<B> http_body::Body for HandBack<B>
where
    B: http_body::Body<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let this = self.get_mut();
        if std::mem::take(&mut this.handed_out) {
            return Poll::Ready(Some(Ok(Frame::data(Bytes::new()))));
        }
        let frame = ready!(Pin::new(&mut this.body).poll_frame(cx));
        if let Some(Ok(frame)) = &frame {
            this.handed_out = frame.data_ref().is_some_and(|data| !data.is_empty());
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        !self.handed_out && self.body.is_end_stream()
    }
}

/// The authentication for `config`: for an exec plugin's credentials, the crate's own (see
/// `reauth`), whose handle comes along; kube's for the rest.
#[allow(clippy::type_complexity)]
fn auth_layer(
    config: &kube::Config,
    identity: Option<Arc<super::exec_cert::ExecIdentity>>,
) -> Result<
    (
        tower::util::Either<
            super::reauth::ReauthLayer,
            tower::util::Either<kube::client::middleware::AuthLayer, tower::layer::util::Identity>,
        >,
        Option<super::reauth::Credentials>,
    ),
    kube::Error,
> {
    use tower::util::Either;
    Ok(if config.auth_info.exec.is_some() {
        let layer = super::reauth::ReauthLayer::new(config, identity);
        let credentials = layer.credentials();
        (Either::Left(layer), Some(credentials))
    } else {
        // secrets-lint: built in Cluster::from_config, which redacts the error.
        let layer = match config.auth_layer()? {
            Some(layer) => Either::Left(layer),
            None => Either::Right(tower::layer::util::Identity::new()),
        };
        (Either::Right(layer), None)
    })
}

/// A client for `config` whose requests go through `transport`, behind `outer` (the
/// cluster's own layer) and kube's per-client layers: base URI, retries (if the
/// configuration asks for them), authentication, extra and impersonation headers; and the
/// same stack without the client, for the cluster's watches.
///
/// The client itself (whose request buffer is a task of its own) is made when the returned
/// function is called: everything that can fail is done here.
#[allow(clippy::type_complexity)]
pub(crate) fn client(
    config: &kube::Config,
    transport: Arc<Transport>,
    outer: super::layer::ClientLayer,
) -> Result<
    (
        super::layer::MakeClient,
        super::requester::RawService,
        Option<super::reauth::Credentials>,
    ),
    kube::Error,
> {
    let retry = config
        .default_retry
        .then(|| tower::retry::RetryLayer::new(kube::client::retry::RetryPolicy::server_retry()));
    let (auth, credentials) = auth_layer(config, transport.endpoint.identity.clone())?;
    let service = tower::ServiceBuilder::new()
        .layer(outer)
        .layer(config.base_uri_layer())
        .option_layer(retry)
        .layer(auth)
        .layer(config.extra_headers_layer()?)
        .service(Shared(transport));
    let raw = super::requester::RawService::new(tower::ServiceExt::map_response(
        service.clone(),
        |response: Response<TransportBody>| {
            response.map(|body| Box::pin(body) as super::requester::ResponseBody)
        },
    ));
    let namespace = config.default_namespace.clone();
    Ok((
        Box::new(move || kube::Client::new(service, namespace)),
        raw,
        credentials,
    ))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    use bytes::Bytes;
    use futures::{FutureExt, StreamExt, TryStreamExt};
    use http_body::Frame;
    use http_body_util::{BodyExt, StreamBody};
    use tokio_util::codec::{FramedRead, LinesCodec};
    use tokio_util::io::StreamReader;

    use super::HandBack;

    /// Bytes whose memory says when it is let go.
    struct Watched(&'static [u8], Arc<AtomicBool>);

    impl AsRef<[u8]> for Watched {
        fn as_ref(&self) -> &[u8] {
            self.0
        }
    }

    impl Drop for Watched {
        fn drop(&mut self) {
            self.1.store(true, Ordering::SeqCst);
        }
    }

    /// kube's watch reader (`Client::request_events`): lines of the body's data frames, read
    /// through tokio-util's `StreamReader`. With the chunk handed back, its memory is let go
    /// once the lines in it are read, while the stream waits for more; without, the reader
    /// holds it until the next chunk.
    #[tokio::test]
    async fn a_read_chunk_is_let_go_before_the_next_arrives() {
        for hand_back in [true, false] {
            let (tx, rx) =
                futures::channel::mpsc::unbounded::<Result<Frame<Bytes>, std::io::Error>>();
            let dropped = Arc::new(AtomicBool::new(false));
            let chunk = Bytes::from_owner(Watched(b"{\"a\":1}\n{\"b\":2}\n", dropped.clone()));
            tx.unbounded_send(Ok(Frame::data(chunk))).unwrap();
            let body = StreamBody::new(rx);
            let data = if hand_back {
                HandBack::new(body).into_data_stream().boxed()
            } else {
                body.into_data_stream().boxed()
            };
            let mut lines = FramedRead::new(
                StreamReader::new(data.map_err(std::io::Error::other)),
                LinesCodec::new(),
            );
            assert_eq!(lines.next().await.unwrap().unwrap(), r#"{"a":1}"#);
            assert_eq!(lines.next().await.unwrap().unwrap(), r#"{"b":2}"#);
            // Waiting for the next line: nothing more has come.
            assert!(lines.next().now_or_never().is_none());
            assert_eq!(
                dropped.load(Ordering::SeqCst),
                hand_back,
                "hand_back {hand_back}"
            );
            // A later chunk still reads, and the end of the body ends the lines.
            tx.unbounded_send(Ok(Frame::data(Bytes::from_static(b"{\"c\":3}\n"))))
                .unwrap();
            drop(tx);
            assert_eq!(lines.next().await.unwrap().unwrap(), r#"{"c":3}"#);
            assert!(lines.next().await.is_none());
            assert!(dropped.load(Ordering::SeqCst));
        }
    }

    /// CI of stop 55: a server may answer from a request's head (a 401 to an expired client
    /// certificate) and reset the stream with NO_ERROR before the body went, as Go's server
    /// does with a body it will not read. The answer is the response, not the failed body.
    #[tokio::test]
    async fn an_answer_before_the_body_went_is_the_response() {
        let (client_io, server_io) = tokio::io::duplex(1 << 16);
        tokio::spawn(async move {
            let mut server = h2::server::handshake(server_io).await.unwrap();
            let mut pings = server.ping_pong().unwrap();
            let (_, mut respond) = server.accept().await.unwrap().unwrap();
            let refused = http::Response::builder().status(401).body(()).unwrap();
            respond.send_response(refused, true).unwrap();
            // h2 drops what a reset stream has not written yet: the answer goes first (the
            // client's pong comes after it has read it), as with Go.
            let answered = tokio::spawn(async move {
                pings.ping(h2::Ping::opaque()).await.unwrap();
                respond.send_reset(h2::Reason::NO_ERROR);
            });
            // Accepting drives the connection.
            tokio::select! {
                _ = server.accept() => panic!("one request only"),
                _ = answered => {}
            }
            futures::future::poll_fn(|cx| server.poll_closed(cx))
                .await
                .ok();
        });
        let (send, connection) = h2::client::handshake(client_io).await.unwrap();
        tokio::spawn(async move {
            let _ = connection.await;
        });
        let mut send = send.ready().await.unwrap();
        let head = http::Request::post("https://server/apis").body(()).unwrap();
        let (response, mut stream) = send.send_request(head, false).unwrap();
        // Sync point: the server's reset has reached the stream (its answer came before).
        let reason = futures::future::poll_fn(|cx| stream.poll_reset(cx))
            .await
            .unwrap();
        assert_eq!(reason, h2::Reason::NO_ERROR);
        match super::send_body(stream, Bytes::from_static(b"{}"), response).await {
            Ok(response) => assert_eq!(response.status(), 401),
            Err(super::Failed::H2 { error, .. }) => panic!("failed: {error}"),
            Err(super::Failed::TimedOut(error)) => panic!("timed out: {error}"),
        }
    }

    /// L1 of the 2026-11-27 core review: a request over the server's stream limit is queued
    /// by h2 until another stream ends; the write timeout bounds that wait (the read
    /// timeout unset, the server never answering).
    #[tokio::test]
    async fn a_stream_over_the_servers_limit_waits_no_longer_than_the_write_timeout() {
        use std::sync::atomic::AtomicUsize;
        use std::time::Duration;

        let (client_io, server_io) = tokio::io::duplex(1 << 16);
        // A server of one stream at a time that takes requests and answers none.
        tokio::spawn(async move {
            let mut server = h2::server::Builder::new()
                .max_concurrent_streams(1)
                .handshake::<_, Bytes>(server_io)
                .await
                .unwrap();
            let mut held = Vec::new();
            while let Some(Ok(request)) = server.accept().await {
                held.push(request);
            }
        });
        let (send, connection) = h2::client::handshake(client_io).await.unwrap();
        tokio::spawn(async move {
            let _ = connection.await;
        });
        let mut send = send.ready().await.unwrap();
        // Sync point: the server's SETTINGS are in.
        for _ in 0..500 {
            if send.current_max_send_streams() == 1 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(send.current_max_send_streams(), 1);
        let request = |path: &str| {
            http::Request::get(format!("https://server{path}"))
                .body(())
                .unwrap()
        };
        // The one stream, open and unanswered.
        let (_first, _stream) = send.send_request(request("/first"), true).unwrap();
        let connection = Arc::new(super::Connection {
            send,
            active: AtomicUsize::new(1),
            closed: AtomicBool::new(false),
            stop: tokio_util::sync::CancellationToken::new(),
            runtime: None,
            identity: 0,
        });
        let slot = super::Slot(connection);
        let limit = Duration::from_millis(300);
        let waited = tokio::time::timeout(
            Duration::from_secs(10),
            super::send_h2(&slot, request("/second"), Bytes::new(), Some(limit)),
        )
        .await
        .expect("the write timeout ends the wait for the stream");
        match waited {
            Err(super::Failed::TimedOut(error)) => {
                assert!(error.to_string().contains("write timeout"), "{error}");
            }
            Err(super::Failed::H2 { error, .. }) => panic!("failed otherwise: {error}"),
            Ok(_) => panic!("the server answers nothing"),
        }
    }
}
