//! The webhook servers side by side: this crate's and controller-runtime's `webhook.Server`
//! (`benches/go-webhook`, built by `scripts/go-webhook.sh`), each in a child process of its
//! own, serving the same validating hook (decode a ConfigMap, deny it if labelled `deny`).
//!
//! For each server, in one run:
//! 1. `connect`: as many TLS connections (HTTP/1.1, as members' API servers speak to
//!    webhooks) as asked (10,000 by default), from 100 loopback source addresses
//!    (127.1.0.1-100), each sending one review and then kept open; the server's RSS before
//!    and after gives the bytes an idle connection costs it.
//! 2. `load`: reviews (100,000 by default) over those connections, `--concurrency` at a time
//!    (each takes an idle connection, sends, reads the answer, gives it back): latency
//!    percentiles, reviews a second, and the server's CPU per 1,000 reviews.
//! 3. `floods` (with `--floods`): from 127.0.0.2-9, 3,200 idle TCP connections (reopened once
//!    a second after each close) while 64 connections trickle a body declaring 7,000,000 bytes
//!    on one member's route and 64 full-size (7 MiB) reviews are sent at once on another's:
//!    the server's RSS during the floods, and whether 64 connected members' reviews (one
//!    every 200 ms each) were still answered.
//!
//! Each member of the crate's fleet is a cluster of its own (one connection each, its own
//! route); controller-runtime's server has one path. Every load is on loopback, bounded in
//! count and time, and stops by itself.
//!
//! ```text
//! cargo bench --bench webhooks -- [--connections 10000] [--reviews 100000] [--concurrency 256] [--floods] [--only rust|go]
//! ```

use std::collections::BTreeMap;
use std::io::Write as _;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

#[allow(dead_code)]
mod common;

use common::arg_after;
use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const HOOK: &str = "guard.bench.example.com";

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    if args.iter().any(|a| a == "--child") {
        rt.block_on(child(&args));
        return;
    }
    // `cargo bench` runs every bench target with `--bench`; so does this one's own run.
    rt.block_on(parent(&args));
}

// --- the crate's server, in its child process ---

/// Serves the hook for `--clusters` clusters `c0`... with the certificate of `--cert-dir`;
/// writes each cluster's path (one a line) to `<ready>.paths`, then its port to `--ready`.
async fn child(args: &[String]) {
    use multicluster_runtime::providers::Clusters;
    use multicluster_runtime::webhook::{Hook, Install, Review, Verdict, Webhooks};
    use multicluster_runtime::{Cluster, ClusterName, Manager};
    raise_file_limit();
    let dir = PathBuf::from(arg_after(args, "--cert-dir").expect("--cert-dir"));
    let ready = PathBuf::from(arg_after(args, "--ready").expect("--ready"));
    let clusters: usize = arg_after(args, "--clusters")
        .expect("--clusters")
        .parse()
        .unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let provider = Clusters::<ClusterName>::new();
    // Members nobody talks to: their clients are made on first use, which never comes.
    let config = kube::Config::new("https://127.0.0.1:9".parse().unwrap());
    for i in 0..clusters {
        let id = ClusterName::new(format!("c{i}"));
        provider
            .add(Cluster::from_config(id, config.clone()).unwrap())
            .unwrap();
    }
    let files = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
        .unwrap()
        .0;
    let webhooks = Webhooks::new(
        format!("127.0.0.1:{port}").parse().unwrap(),
        format!("https://127.0.0.1:{port}/admission"),
    )
    .certificate_files(
        dir.join("tls.crt"),
        dir.join("tls.key"),
        dir.join("tls.crt"),
    )
    .install(Install::Nothing)
    // The connections of every member and their unverified share, within the file limit.
    .max_connections(usize::try_from(files).unwrap() - 512)
    .hook(Hook::validating(
        HOOK,
        |review: Review<ClusterName, ConfigMap>| async move {
            let labelled = review
                .object
                .as_ref()
                .and_then(|cm| cm.metadata.labels.as_ref())
                .is_some_and(|labels| labels.contains_key("deny"));
            Ok::<_, std::convert::Infallible>(if labelled {
                Verdict::deny("the ConfigMap has the label \"deny\"")
            } else {
                Verdict::allow()
            })
        },
    ));
    let manager = Arc::new(Manager::new(provider).webhooks(webhooks));
    let running = manager.clone();
    tokio::spawn(async move { running.run().await.expect("run") });
    let first = ClusterName::new("c0");
    while manager.webhook_url(&first, HOOK).is_none()
        || tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_err()
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut paths = String::new();
    for i in 0..clusters {
        let url = manager
            .webhook_url(&ClusterName::new(format!("c{i}")), HOOK)
            .unwrap();
        let path = url.split_once(&format!(":{port}")).unwrap().1;
        paths.push_str(path);
        paths.push('\n');
    }
    std::fs::write(ready.with_extension("paths"), paths).unwrap();
    write_atomically(&ready, &port.to_string());
    let mut term =
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).unwrap();
    term.recv().await;
    manager.shutdown();
}

fn raise_file_limit() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
    setrlimit(Resource::RLIMIT_NOFILE, hard, hard).unwrap();
}

fn write_atomically(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(tmp, path).unwrap();
}

// --- the parent: certificates, children, clients, figures ---

/// A server under test, in its child process.
struct Server {
    name: &'static str,
    child: std::process::Child,
    addr: SocketAddr,
    /// The path of connection `i`'s reviews (`i` modulo the length).
    paths: Vec<String>,
}

impl Server {
    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// `VmRSS` and `VmHWM` of the server's process, in KiB.
    fn memory(&self) -> (u64, u64) {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap();
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.split_whitespace().next()?.parse().ok())
                .unwrap_or(0)
        };
        (field("VmRSS:"), field("VmHWM:"))
    }

    /// CPU time (user + system) the server's process has used.
    fn cpu(&self) -> Duration {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid())).unwrap();
        let after = stat.rsplit_once(')').unwrap().1;
        let fields: Vec<&str> = after.split_whitespace().collect();
        // utime and stime are fields 14 and 15 of the whole line (12 and 13 after the name).
        let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
        // /proc counts in USER_HZ, 100 a second on Linux whatever the kernel's own tick.
        Duration::from_millis(ticks * 10)
    }

    fn stop(mut self) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn start_rust(dir: &Path, clusters: usize) -> Server {
    let ready = dir.join("rust.ready");
    let child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--child", "--clusters", &clusters.to_string(), "--cert-dir"])
        .arg(dir)
        .arg("--ready")
        .arg(&ready)
        .spawn()
        .expect("the crate's server");
    let port = wait_for(&ready).await;
    let paths = std::fs::read_to_string(ready.with_extension("paths"))
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect();
    Server {
        name: "multicluster-runtime",
        child,
        addr: SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), port),
        paths,
    }
}

async fn start_go(dir: &Path) -> Server {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/go-webhook.sh");
    let built = std::process::Command::new("bash")
        .arg(script)
        .output()
        .expect("scripts/go-webhook.sh");
    assert!(
        built.status.success(),
        "scripts/go-webhook.sh: {}",
        String::from_utf8_lossy(&built.stderr)
    );
    let binary = String::from_utf8(built.stdout).unwrap().trim().to_string();
    let ready = dir.join("go.ready");
    let child = std::process::Command::new(binary)
        .args(["-addr", "127.0.0.1:0", "-cert-dir"])
        .arg(dir)
        .arg("-ready-file")
        .arg(&ready)
        // net/http logs every failed handshake (the floods make thousands).
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("controller-runtime's server");
    let port = wait_for(&ready).await;
    Server {
        name: "controller-runtime",
        child,
        addr: SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), port),
        paths: vec!["/validate".into()],
    }
}

/// The port written to `ready`, once it is.
async fn wait_for(ready: &Path) -> u16 {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if let Ok(text) = std::fs::read_to_string(ready)
            && let Ok(port) = text.trim().parse()
        {
            return port;
        }
        assert!(Instant::now() < deadline, "{} never came", ready.display());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A self-signed certificate for 127.0.0.1 in `dir` (`tls.crt`, `tls.key`), and a client
/// configuration that trusts it and speaks HTTP/1.1 only.
fn certificates(dir: &Path) -> Arc<rustls::ClientConfig> {
    let key = rcgen::KeyPair::generate().unwrap();
    let mut params = rcgen::CertificateParams::new(vec!["localhost".into()]).unwrap();
    params
        .subject_alt_names
        .push(rcgen::SanType::IpAddress(IpAddr::V4(Ipv4Addr::LOCALHOST)));
    let cert = params.self_signed(&key).unwrap();
    std::fs::write(dir.join("tls.crt"), cert.pem()).unwrap();
    std::fs::write(dir.join("tls.key"), key.serialize_pem()).unwrap();
    let mut roots = rustls::RootCertStore::empty();
    roots.add(cert.der().clone()).unwrap();
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Arc::new(config)
}

type Tls = tokio_rustls::client::TlsStream<tokio::net::TcpStream>;

/// A kept-alive connection to a server, for reviews on `path`.
struct Conn {
    tls: Tls,
    path: String,
    buffer: Vec<u8>,
}

async fn connect(
    tls: &tokio_rustls::TlsConnector,
    from: IpAddr,
    to: SocketAddr,
    path: String,
) -> std::io::Result<Conn> {
    let socket = tokio::net::TcpSocket::new_v4()?;
    socket.bind(SocketAddr::new(from, 0))?;
    let tcp = socket.connect(to).await?;
    tcp.set_nodelay(true)?;
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let tls = tls.connect(name, tcp).await?;
    Ok(Conn {
        tls,
        path,
        buffer: Vec::with_capacity(1024),
    })
}

impl Conn {
    /// Sends `body` as a review and reads the answer's status (the connection stays open).
    async fn review(&mut self, body: &[u8]) -> std::io::Result<u16> {
        self.send(body).await?;
        self.read_answer().await
    }

    async fn send(&mut self, body: &[u8]) -> std::io::Result<()> {
        let head = format!(
            "POST {}?timeout=10s HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nAccept: application/json\r\nContent-Length: {}\r\n\r\n",
            self.path,
            body.len()
        );
        let mut request = Vec::with_capacity(head.len() + body.len());
        request.extend_from_slice(head.as_bytes());
        request.extend_from_slice(body);
        self.write(&request).await
    }

    /// Writes and flushes: TLS keeps what the socket did not take until the next write or
    /// flush, and a reader waiting for the answer would wait for good.
    async fn write(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.tls.write_all(bytes).await?;
        self.tls.flush().await
    }

    async fn read_answer(&mut self) -> std::io::Result<u16> {
        let closed = || std::io::Error::from(std::io::ErrorKind::UnexpectedEof);
        self.buffer.clear();
        let mut chunk = [0u8; 4096];
        let head_end = loop {
            if let Some(end) = find(&self.buffer, b"\r\n\r\n") {
                break end + 4;
            }
            let n = self.tls.read(&mut chunk).await?;
            if n == 0 {
                return Err(closed());
            }
            self.buffer.extend_from_slice(&chunk[..n]);
        };
        let head = String::from_utf8_lossy(&self.buffer[..head_end]).to_ascii_lowercase();
        let status: u16 = head
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        let length: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0);
        while self.buffer.len() < head_end + length {
            let n = self.tls.read(&mut chunk).await?;
            if n == 0 {
                return Err(closed());
            }
            self.buffer.extend_from_slice(&chunk[..n]);
        }
        if head.contains("connection: close") {
            // Answered, and closed: the status, as an error that says so.
            return Err(std::io::Error::new(
                std::io::ErrorKind::ConnectionAborted,
                status.to_string(),
            ));
        }
        Ok(status)
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// A review of the creation of ConfigMap `name` holding `data`, as a member's API server
/// sends one.
fn review(name: &str, data: BTreeMap<String, String>) -> Vec<u8> {
    let review = serde_json::json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "4f1c2a9e-0000-4000-8000-000000000001",
            "kind": {"group": "", "version": "v1", "kind": "ConfigMap"},
            "resource": {"group": "", "version": "v1", "resource": "configmaps"},
            "requestKind": {"group": "", "version": "v1", "kind": "ConfigMap"},
            "requestResource": {"group": "", "version": "v1", "resource": "configmaps"},
            "operation": "CREATE",
            "name": name,
            "namespace": "bench",
            "userInfo": {"username": "system:serviceaccount:bench:writer", "groups": ["system:serviceaccounts", "system:authenticated"]},
            "object": {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": name, "namespace": "bench", "labels": {"app": "bench", "tier": "web"}},
                "data": data,
            },
            "oldObject": null,
            "dryRun": false,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"},
        },
    });
    serde_json::to_vec(&review).unwrap()
}

/// A review of a ConfigMap of about 1.5 KiB.
fn review_body(name: &str) -> Vec<u8> {
    review(
        name,
        (0..8)
            .map(|i| (format!("key-{i}"), "v".repeat(96)))
            .collect(),
    )
}

/// Source address of connection `i`: 127.1.0.1 to 127.1.0.100.
fn source(i: usize) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(127, 1, 0, 1 + (i % 100) as u8))
}

/// What one server did.
#[derive(Default)]
struct Figures {
    base_kib: u64,
    idle_kib: u64,
    connected: usize,
    connect_took: Duration,
    reviews: usize,
    failed: usize,
    reconnects: usize,
    took: Duration,
    latencies: Vec<Duration>,
    cpu: Duration,
    peak_kib: u64,
    flood: Option<FloodFigures>,
}

#[derive(Default)]
struct FloodFigures {
    /// VmHWM after the floods, and the most VmRSS seen during them (sampled every 100 ms).
    peak_kib: u64,
    during_kib: u64,
    member_reviews: usize,
    member_failed: usize,
    big_codes: BTreeMap<u16, usize>,
    trickles_longest: Duration,
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

async fn measure(
    server: &Server,
    tls: &tokio_rustls::TlsConnector,
    connections: usize,
    reviews: usize,
    concurrency: usize,
    floods: bool,
) -> Figures {
    let mut figures = Figures::default();
    tokio::time::sleep(Duration::from_secs(1)).await;
    figures.base_kib = server.memory().0;
    let body = Arc::new(review_body("bench"));

    // 1. connect: every connection sends one review, then stays open.
    let started = Instant::now();
    let conns: Vec<Conn> = futures::stream::iter(0..connections)
        .map(|i| {
            let path = server.paths[i % server.paths.len()].clone();
            let body = body.clone();
            async move {
                let mut conn = connect(tls, source(i), server.addr, path).await.ok()?;
                (conn.review(&body).await.ok()? == 200).then_some(conn)
            }
        })
        .buffer_unordered(128)
        .filter_map(|c| async move { c })
        .collect()
        .await;
    figures.connect_took = started.elapsed();
    figures.connected = conns.len();
    tokio::time::sleep(Duration::from_secs(2)).await;
    figures.idle_kib = server.memory().0;

    // 2. load: reviews over the kept connections, `concurrency` at a time.
    let (give, take) = async_channel(conns);
    let done = Arc::new(AtomicUsize::new(0));
    let failed = Arc::new(AtomicUsize::new(0));
    let reconnects = Arc::new(AtomicUsize::new(0));
    let cpu_before = server.cpu();
    let started = Instant::now();
    let workers: Vec<_> = (0..concurrency)
        .map(|w| {
            let (give, take) = (give.clone(), take.clone());
            let (done, failed, reconnects, body) = (
                done.clone(),
                failed.clone(),
                reconnects.clone(),
                body.clone(),
            );
            let (tls, addr) = (tls.clone(), server.addr);
            tokio::spawn(async move {
                let mut latencies = Vec::new();
                while done.fetch_add(1, Ordering::Relaxed) < reviews {
                    let mut conn = take.lock().await.recv().await.unwrap();
                    let sent = Instant::now();
                    match conn.review(&body).await {
                        Ok(200) => {
                            latencies.push(sent.elapsed());
                            give.send(conn).unwrap();
                        }
                        outcome => {
                            failed.fetch_add(1, Ordering::Relaxed);
                            if outcome.is_err() {
                                // Closed: a new connection in its place.
                                reconnects.fetch_add(1, Ordering::Relaxed);
                                let path = conn.path.clone();
                                drop(conn);
                                match connect(&tls, source(w), addr, path).await {
                                    Ok(new) => give.send(new).unwrap(),
                                    Err(_) => return latencies,
                                }
                            } else {
                                give.send(conn).unwrap();
                            }
                        }
                    }
                }
                latencies
            })
        })
        .collect();
    for worker in workers {
        figures.latencies.extend(worker.await.unwrap());
    }
    figures.took = started.elapsed();
    figures.cpu = server.cpu().saturating_sub(cpu_before);
    figures.reviews = figures.latencies.len();
    figures.failed = failed.load(Ordering::Relaxed);
    figures.reconnects = reconnects.load(Ordering::Relaxed);
    figures.latencies.sort_unstable();
    figures.peak_kib = server.memory().1;

    // 3. floods, with the members' connections still open.
    if floods {
        let mut members = Vec::new();
        let mut rx = take.lock().await;
        while let Ok(conn) = rx.try_recv() {
            members.push(conn);
            if members.len() == 64 {
                break;
            }
        }
        drop(rx);
        figures.flood = Some(flood(server, tls, members, &body).await);
    }
    figures
}

/// A simple shared queue of idle connections.
fn async_channel(
    conns: Vec<Conn>,
) -> (
    tokio::sync::mpsc::UnboundedSender<Conn>,
    Arc<tokio::sync::Mutex<tokio::sync::mpsc::UnboundedReceiver<Conn>>>,
) {
    let (give, take) = tokio::sync::mpsc::unbounded_channel();
    for conn in conns {
        give.send(conn).unwrap();
    }
    (give, Arc::new(tokio::sync::Mutex::new(take)))
}

/// The floods of the servers' tests, at once, from 127.0.0.2, while `members` (kept
/// connections) send a review each every 200 ms.
async fn flood(
    server: &Server,
    tls: &tokio_rustls::TlsConnector,
    mut members: Vec<Conn>,
    body: &Arc<Vec<u8>>,
) -> FloodFigures {
    let attacker = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2));
    let stop = tokio_util::sync::CancellationToken::new();
    let until = Instant::now() + Duration::from_secs(60);
    // The slow bodies on one member's route, the full-size reviews on another's (on the
    // crate's server each member has a share of the body budget of its own).
    let route = server.paths[0].clone();
    let big_route = server.paths[1 % server.paths.len()].clone();
    // 3,200 idle TCP connections from 127.0.0.2-9 (more than the crate's server keeps
    // unverified here, from more addresses than one peer's share), each reopened a second
    // after the server closes it.
    let mut idle = tokio::task::JoinSet::new();
    for i in 0..3200 {
        let (stop, addr) = (stop.clone(), server.addr);
        let attacker = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2 + (i % 8) as u8));
        idle.spawn(async move {
            for _ in 0..100 {
                if stop.is_cancelled() || Instant::now() > until {
                    return;
                }
                if let Ok(socket) = tokio::net::TcpSocket::new_v4()
                    && socket.bind(SocketAddr::new(attacker, 0)).is_ok()
                    && let Ok(mut tcp) = socket.connect(addr).await
                {
                    let mut buffer = [0u8; 16];
                    tokio::select! {
                        _ = tcp.read(&mut buffer) => {}
                        () = stop.cancelled() => return,
                    }
                }
                tokio::select! {
                    () = tokio::time::sleep(Duration::from_secs(1)) => {}
                    () = stop.cancelled() => return,
                }
            }
        });
    }
    // 64 slow bodies on one route.
    let trickles: Vec<_> = (0..64)
        .map(|_| {
            let (tls, addr, route) = (tls.clone(), server.addr, route.clone());
            tokio::spawn(async move {
                let Ok(mut conn) = connect(&tls, attacker, addr, route.clone()).await else {
                    return Duration::ZERO;
                };
                let head = format!(
                    "POST {route}?timeout=10s HTTP/1.1\r\nHost: flood\r\nContent-Type: application/json\r\nContent-Length: 7000000\r\n\r\n{{"
                );
                if conn.write(head.as_bytes()).await.is_err() {
                    return Duration::ZERO;
                }
                let sent = Instant::now();
                let mut buffer = [0u8; 1024];
                while sent.elapsed() < Duration::from_secs(30) {
                    tokio::select! {
                        read = conn.tls.read(&mut buffer) => if matches!(read, Ok(0) | Err(_)) { break },
                        () = tokio::time::sleep(Duration::from_secs(2)) => {
                            if conn.write(b" ").await.is_err() { break }
                        }
                    }
                }
                sent.elapsed()
            })
        })
        .collect();
    // 64 full-size reviews at once on the same route.
    let big = Arc::new(big_review());
    let bigs: Vec<_> = (0..64)
        .map(|_| {
            let (tls, addr, route, big) =
                (tls.clone(), server.addr, big_route.clone(), big.clone());
            tokio::spawn(async move {
                let Ok(mut conn) = connect(&tls, attacker, addr, route).await else {
                    return 0;
                };
                // A refusal may come (and the connection close) before the body is sent:
                // a failed write is read past, for the answer.
                let sent = tokio::time::timeout(Duration::from_secs(30), async {
                    let _ = conn.send(&big).await;
                    conn.read_answer().await
                });
                match sent.await {
                    Ok(Ok(code)) => code,
                    Ok(Err(error)) if error.kind() == std::io::ErrorKind::ConnectionAborted => 429,
                    _ => 0,
                }
            })
        })
        .collect();
    // The server's RSS while the floods last.
    let pid = server.pid();
    let sampling = stop.clone();
    let sampler = tokio::spawn(async move {
        let mut most = 0;
        while !sampling.is_cancelled() {
            let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
            let rss = status
                .lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
                .unwrap_or(0);
            most = most.max(rss);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        most
    });
    // Members keep writing meanwhile: 15 s, a review each every 200 ms.
    let mut figures = FloodFigures::default();
    let end = Instant::now() + Duration::from_secs(15);
    while Instant::now() < end {
        let round = members.iter_mut().map(|m| async {
            tokio::time::timeout(Duration::from_secs(10), m.review(body))
                .await
                .unwrap_or_else(|_| Err(std::io::ErrorKind::TimedOut.into()))
        });
        for outcome in futures::future::join_all(round).await {
            figures.member_reviews += 1;
            if !matches!(outcome, Ok(200)) {
                figures.member_failed += 1;
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for big in bigs {
        *figures.big_codes.entry(big.await.unwrap()).or_default() += 1;
    }
    for trickle in trickles {
        figures.trickles_longest = figures.trickles_longest.max(trickle.await.unwrap());
    }
    stop.cancel();
    while idle.join_next().await.is_some() {}
    figures.during_kib = sampler.await.unwrap();
    figures.peak_kib = server.memory().1;
    figures
}

/// A review of 7 MiB, the largest either server reads.
fn big_review() -> Vec<u8> {
    let filler = 7 * 1024 * 1024 - 2048;
    let body = review(
        "big",
        BTreeMap::from([("filler".to_string(), "x".repeat(filler))]),
    );
    assert!(body.len() <= 7 << 20, "{}", body.len());
    body
}

fn report(server: &str, f: &Figures, connections: usize) {
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    let per_conn = f.idle_kib.saturating_sub(f.base_kib) * 1024 / f.connected.max(1) as u64;
    println!("== {server}");
    println!(
        "connect: {} of {connections} connections in {:.1} s; RSS {:.1} MiB before, {:.1} MiB with them idle: {per_conn} bytes a connection",
        f.connected,
        f.connect_took.as_secs_f64(),
        f.base_kib as f64 / 1024.0,
        f.idle_kib as f64 / 1024.0,
    );
    println!(
        "load: {} reviews in {:.1} s ({:.0}/s), {} failed, {} reconnects; latency p50 {:.2} ms, p99 {:.2} ms, p99.9 {:.2} ms, max {:.2} ms",
        f.reviews,
        f.took.as_secs_f64(),
        f.reviews as f64 / f.took.as_secs_f64(),
        f.failed,
        f.reconnects,
        ms(percentile(&f.latencies, 0.5)),
        ms(percentile(&f.latencies, 0.99)),
        ms(percentile(&f.latencies, 0.999)),
        ms(f.latencies.last().copied().unwrap_or_default()),
    );
    println!(
        "cpu: {:.0} ms per 1,000 reviews; peak RSS {:.1} MiB",
        f.cpu.as_secs_f64() * 1000.0 * 1000.0 / f.reviews.max(1) as f64,
        f.peak_kib as f64 / 1024.0,
    );
    if let Some(flood) = &f.flood {
        println!(
            "floods: members' reviews {} of {} answered 200; full-size reviews {:?} (status: count; 0 = no answer); longest slow body held {:.1} s; RSS during the floods at most {:.1} MiB; peak RSS {:.1} MiB",
            flood.member_reviews - flood.member_failed,
            flood.member_reviews,
            flood.big_codes,
            flood.trickles_longest.as_secs_f64(),
            flood.during_kib as f64 / 1024.0,
            flood.peak_kib as f64 / 1024.0,
        );
    }
    let _ = std::io::stdout().flush();
}

async fn parent(args: &[String]) {
    raise_file_limit();
    let number = |flag: &str, default: usize| {
        arg_after(args, flag)
            .map(|v| v.parse().expect(flag))
            .unwrap_or(default)
    };
    let connections = number("--connections", 10_000);
    let reviews = number("--reviews", 100_000);
    let concurrency = number("--concurrency", 256);
    let floods = args.iter().any(|a| a == "--floods");
    let only = arg_after(args, "--only");
    let dir = tempfile::tempdir().unwrap();
    let tls = tokio_rustls::TlsConnector::from(certificates(dir.path()));
    println!(
        "webhook servers side by side: {connections} connections from 100 loopback addresses, {reviews} reviews {concurrency} at a time{}",
        if floods { ", then the floods" } else { "" }
    );
    if only.as_deref() != Some("go") {
        let server = start_rust(dir.path(), connections).await;
        let figures = measure(&server, &tls, connections, reviews, concurrency, floods).await;
        report(server.name, &figures, connections);
        server.stop();
    }
    if only.as_deref() != Some("rust") {
        let server = start_go(dir.path()).await;
        let figures = measure(&server, &tls, connections, reviews, concurrency, floods).await;
        report(server.name, &figures, connections);
        server.stop();
    }
}
