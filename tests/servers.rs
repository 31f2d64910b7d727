//! The manager's two servers under floods from another loopback address (127.0.0.2), beside
//! real member API servers and probes on 127.0.0.1: idle TCP connections, TLS connections
//! repeating `GET`s, slow bodies and full-size reviews on one member's valid route, and made-up
//! tokens against a host that stopped answering. Every review of the other members is
//! answered by the hook, and every probe by the endpoints, while the flood goes on.
//!
//! Each flood is bounded: a fixed number of connections, each reopened at most a fixed
//! number of times, and stopped by the test (or by its own deadline, two minutes after it
//! started). The tests take turns (`SERIAL`): two floods at once would measure each other.

mod common;

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::*;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::ResourceExt;
use kube::api::{Api, ObjectMeta, PostParams};
use multicluster_runtime::providers::Clusters;
use multicluster_runtime::webhook::{Hook, Review, Verdict, Webhooks};
use multicluster_runtime::{Cluster, ClusterName, Endpoints, Manager, Metrics};
use multicluster_runtime_testenv::TestEnv;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const NS: &str = "guarded";
const GUARDED: &str = "fleet.example.com/guarded";
const HOOK: &str = "guard.fleet.example.com";
/// The hook's timeout: the API server's wait, and the server's for a body.
const HOOK_TIMEOUT: Duration = Duration::from_secs(5);

/// Where floods come from, and where members and probes do.
fn attacker() -> IpAddr {
    "127.0.0.2".parse().unwrap()
}

fn member_side() -> IpAddr {
    "127.0.0.1".parse().unwrap()
}

/// Raises this process's open-file limit to its hard limit: a flood and the server it floods
/// both hold their ends of every connection here.
fn enough_files(needed: u64) {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
    assert!(
        hard >= needed,
        "this test needs {needed} open files; the hard limit is {hard}"
    );
    setrlimit(Resource::RLIMIT_NOFILE, hard, hard).unwrap();
}

/// A TCP connection from `from` to `to`.
async fn connect_from(from: IpAddr, to: SocketAddr) -> std::io::Result<tokio::net::TcpStream> {
    let socket = tokio::net::TcpSocket::new_v4()?;
    socket.bind(SocketAddr::new(from, 0))?;
    socket.connect(to).await
}

type Tls = tokio_rustls::client::TlsStream<tokio::net::TcpStream>;

/// Writes `bytes` and flushes them: TLS keeps what the socket did not take in its buffer
/// until the next write or flush, and a reader waiting for the answer would wait for good.
async fn send(tls: &mut Tls, bytes: &[u8]) -> std::io::Result<()> {
    tls.write_all(bytes).await?;
    tls.flush().await
}

/// A TLS connection from `from` to `to`, trusting any certificate (a flood does not care).
async fn tls_from(from: IpAddr, to: SocketAddr) -> std::io::Result<Tls> {
    let tcp = connect_from(from, to).await?;
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    tokio::time::timeout(
        Duration::from_secs(10),
        any_certificate_tls().connect(name, tcp),
    )
    .await
    .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))?
}

/// Connections held by one flood: each task opens a connection, holds it as its kind says
/// until the server closes it, pauses, and opens it again.
struct Flood {
    stop: CancellationToken,
    tasks: tokio::task::JoinSet<()>,
    /// Connections opened (TCP connected, or TLS established) so far.
    opened: Arc<AtomicUsize>,
}

/// How many times one of a flood's connections is opened at most, and how long a flood
/// lasts at most, whatever the test does.
const REOPENS: usize = 200;
const FLOOD_LIMIT: Duration = Duration::from_secs(120);

impl Flood {
    /// `connections` tasks of `hold`: each call opens one connection and holds it until the
    /// server closes it (or the flood stops); the task pauses `pause` between calls.
    fn start<F, Fut>(connections: usize, pause: Duration, hold: F) -> Self
    where
        F: Fn(Arc<AtomicUsize>, CancellationToken) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        let stop = CancellationToken::new();
        let opened = Arc::new(AtomicUsize::new(0));
        let hold = Arc::new(hold);
        let mut tasks = tokio::task::JoinSet::new();
        let until = Instant::now() + FLOOD_LIMIT;
        for _ in 0..connections {
            let (stop, opened, hold) = (stop.clone(), opened.clone(), hold.clone());
            tasks.spawn(async move {
                for _ in 0..REOPENS {
                    if stop.is_cancelled() || Instant::now() >= until {
                        return;
                    }
                    tokio::select! {
                        () = hold(opened.clone(), stop.clone()) => {}
                        () = stop.cancelled() => return,
                        () = tokio::time::sleep_until(until) => return,
                    }
                    tokio::select! {
                        () = tokio::time::sleep(pause) => {}
                        () = stop.cancelled() => return,
                    }
                }
            });
        }
        Self {
            stop,
            tasks,
            opened,
        }
    }

    /// Waits until `count` connections were opened (the flood is on).
    async fn opened_at_least(&self, count: usize) {
        let opened = self.opened.clone();
        eventually(
            60,
            &format!("{count} flood connections opened"),
            async || opened.load(Ordering::Relaxed) >= count,
        )
        .await;
    }

    async fn stop(mut self) {
        self.stop.cancel();
        while self.tasks.join_next().await.is_some() {}
    }
}

/// Idle TCP: connect, send nothing, wait for the server to close.
fn idle_tcp(to: SocketAddr, connections: usize) -> Flood {
    Flood::start(
        connections,
        Duration::from_secs(1),
        move |opened, _stop| async move {
            if let Ok(mut tcp) = connect_from(attacker(), to).await {
                opened.fetch_add(1, Ordering::Relaxed);
                let _ = tcp.read(&mut [0; 64]).await;
            }
        },
    )
}

/// TLS connections sending `GET <path>` every 9 s (with `headers`), each kept while the
/// server keeps it.
fn repeated_gets(
    to: SocketAddr,
    connections: usize,
    path: &'static str,
    headers: fn() -> String,
) -> Flood {
    Flood::start(
        connections,
        Duration::from_secs(1),
        move |opened, stop| async move {
            let Ok(mut tls) = tls_from(attacker(), to).await else {
                return;
            };
            opened.fetch_add(1, Ordering::Relaxed);
            let mut buffer = vec![0; 4096];
            loop {
                let request = format!("GET {path} HTTP/1.1\r\nHost: flood\r\n{}\r\n", headers());
                if send(&mut tls, request.as_bytes()).await.is_err() {
                    return;
                }
                // The answer (small: one read), or the end.
                match tls.read(&mut buffer).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
                tokio::select! {
                    () = tokio::time::sleep(Duration::from_secs(9)) => {}
                    () = stop.cancelled() => return,
                    // Closed by the server while waiting.
                    read = tls.read(&mut buffer) => if matches!(read, Ok(0) | Err(_)) { return },
                }
            }
        },
    )
}

// --- the webhook server ---

/// What the hook saw: reviews by name, and the most full-size reviews it held at once.
#[derive(Default)]
struct Hooked {
    seen: std::sync::Mutex<Vec<String>>,
    big_now: AtomicUsize,
    big_most: AtomicUsize,
}

/// The guard: denies ConfigMaps labelled `deny`, allows the others; holds a full-size one
/// (named `big-*`) for 300 ms, counting how many it holds at once.
fn webhooks(port: u16, hooked: Arc<Hooked>) -> Webhooks<ClusterName> {
    Webhooks::new(
        format!("127.0.0.1:{port}").parse().unwrap(),
        format!("https://127.0.0.1:{port}/admission"),
    )
    .check_every(Duration::from_millis(500))
    .hook(
        Hook::validating(HOOK, move |review: Review<ClusterName, ConfigMap>| {
            let hooked = hooked.clone();
            async move {
                let object = review.object.unwrap_or_default();
                let name = object.name_any();
                hooked.seen.lock().unwrap().push(name.clone());
                if name.starts_with("big-") {
                    let now = hooked.big_now.fetch_add(1, Ordering::SeqCst) + 1;
                    hooked.big_most.fetch_max(now, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    hooked.big_now.fetch_sub(1, Ordering::SeqCst);
                }
                Ok::<_, String>(if object.labels().contains_key("deny") {
                    Verdict::deny(format!("{name} is labelled deny"))
                } else {
                    Verdict::allow()
                })
            }
        })
        .object_selector(
            k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector {
                match_labels: Some([(GUARDED.to_string(), "true".to_string())].into()),
                match_expressions: None,
            },
        )
        .timeout(HOOK_TIMEOUT),
    )
}

/// A fleet of two members (`a`, `b`) and a host, served by one manager's webhooks.
struct Fleet {
    _env: TestEnv,
    manager: Arc<Manager<Clusters<ClusterName>>>,
    run: tokio::task::JoinHandle<()>,
    port: u16,
    a: kube::Client,
    b: kube::Client,
    hooked: Arc<Hooked>,
    registry: Arc<prometheus_client::registry::Registry>,
}

impl Fleet {
    async fn start() -> Self {
        let env = TestEnv::builder().clusters(3).start().await.unwrap();
        let [host, a, b] = [0, 1, 2].map(|i| env.cluster(i).unwrap());
        let member = |id: &str, c: &multicluster_runtime_testenv::TestCluster| {
            Cluster::from_config(name(id), c.config()).unwrap()
        };
        let provider = Clusters::new();
        provider.add(member("a", &a)).unwrap();
        provider.add(member("b", &b)).unwrap();
        let port = free_port();
        let hooked = Arc::new(Hooked::default());
        let mut registry = prometheus_client::registry::Registry::default();
        let metrics = Metrics::new(&mut registry);
        let hooks = webhooks(port, hooked.clone());
        // Made from the URL.
        let name = hooks.configuration().to_string();
        let manager = Arc::new(
            Manager::new(provider)
                .with_local(member("host", &host))
                .metrics(metrics)
                .webhooks(hooks),
        );
        let run = spawn_manager(&manager);
        let (a, b) = (a.client().unwrap(), b.client().unwrap());
        for (id, client) in [("a", &a), ("b", &b)] {
            create_namespace(client, NS).await;
            eventually(60, &format!("the configuration in {id}"), async || {
                matches!(
                    Api::<
                        k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration,
                    >::all(client.clone())
                    .get_opt(&name)
                    .await,
                    Ok(Some(_))
                )
            })
            .await;
        }
        let fleet = Self {
            _env: env,
            manager,
            run,
            port,
            a,
            b,
            hooked,
            registry: Arc::new(registry),
        };
        // Served before any flood (the checks below are the flood's doing, not a setup's), by
        // member a: b's API server has no connection to the server yet, so its writes during
        // a flood need new ones.
        fleet.member_writes(&fleet.a, "before").await;
        fleet
    }

    fn server(&self) -> SocketAddr {
        SocketAddr::new(member_side(), self.port)
    }

    /// Member `a`'s route: the path of its review URL.
    fn route_of_a(&self) -> String {
        let url = self.manager.webhook_url(&name("a"), HOOK).unwrap();
        let path = url.split_once("127.0.0.1").unwrap().1;
        path.split_once('/').map(|(_, p)| format!("/{p}")).unwrap()
    }

    /// A member writes 24 guarded ConfigMaps in bursts of 8 (every fourth labelled `deny`):
    /// each must be admitted or denied by the hook, as it asks; never a failed call.
    async fn member_writes(&self, member: &kube::Client, tag: &str) {
        let api = Api::<ConfigMap>::namespaced(member.clone(), NS);
        let mut wrong = Vec::new();
        for burst in 0..3 {
            let writes = (0..8).map(|i| {
                let api = api.clone();
                let name = format!("{tag}-{burst}-{i}");
                let deny = i % 4 == 3;
                async move {
                    let mut labels = vec![(GUARDED.to_string(), "true".to_string())];
                    if deny {
                        labels.push(("deny".into(), "true".into()));
                    }
                    let cm = ConfigMap {
                        metadata: ObjectMeta {
                            name: Some(name.clone()),
                            labels: Some(labels.into_iter().collect()),
                            ..Default::default()
                        },
                        ..Default::default()
                    };
                    let outcome = api.create(&PostParams::default(), &cm).await;
                    let right = match (&outcome, deny) {
                        (Ok(_), false) => true,
                        (Err(kube::Error::Api(status)), true) => {
                            status.code == 403
                                && status.message.contains(&format!("{name} is labelled deny"))
                        }
                        _ => false,
                    };
                    let said = match outcome {
                        Ok(_) => "admitted".to_string(),
                        Err(kube::Error::Api(status)) => {
                            format!("{}: {}", status.code, status.message)
                        }
                        Err(other) => other.to_string(),
                    };
                    (!right).then(|| format!("{name}: {said}"))
                }
            });
            wrong.extend(
                futures::future::join_all(writes)
                    .await
                    .into_iter()
                    .flatten(),
            );
        }
        assert!(
            wrong.is_empty(),
            "{tag}: {} of 24 writes were not answered by the hook:\n{}",
            wrong.len(),
            wrong.join("\n")
        );
    }

    fn scrape(&self) -> String {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.registry).unwrap();
        text
    }

    async fn stop(self) {
        self.manager.shutdown();
        let _ = tokio::time::timeout(Duration::from_secs(30), self.run).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_are_answered_while_another_address_holds_idle_connections() {
    let _serial = SERIAL.lock().await;
    enough_files(4096);
    let fleet = Fleet::start().await;
    // More connections than the server ever held before: 1,500, each opened again a
    // second after the server closes it.
    let flood = idle_tcp(fleet.server(), 1500);
    flood.opened_at_least(1500).await;
    fleet.member_writes(&fleet.b, "idle").await;
    flood.stop().await;
    fleet.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_are_answered_while_another_address_repeats_gets_on_kept_connections() {
    let _serial = SERIAL.lock().await;
    enough_files(4096);
    let fleet = Fleet::start().await;
    // 1,100 connections, more than the server ever held before (1,024): the flood is on
    // once 1,000 are established.
    let flood = repeated_gets(fleet.server(), 1100, "/", String::new);
    flood.opened_at_least(1000).await;
    fleet.member_writes(&fleet.b, "gets").await;
    flood.stop().await;
    fleet.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_connection_is_closed_by_an_answer_that_is_not_a_review() {
    let _serial = SERIAL.lock().await;
    let fleet = Fleet::start().await;
    let route = fleet.route_of_a();
    let review = serde_json::to_vec(&config_map_review("kept", NS, serde_json::json!({}))).unwrap();
    let mut tls = tls_from(attacker(), fleet.server()).await.unwrap();
    let post = format!(
        "POST {route}?timeout=5s HTTP/1.1\r\nHost: member\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        review.len()
    );
    // A review on a's valid route: answered, and the connection kept.
    let mut request = post.into_bytes();
    request.extend_from_slice(&review);
    send(&mut tls, &request).await.unwrap();
    let answer = read_answer(&mut tls).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(
        !answer.to_ascii_lowercase().contains("connection: close"),
        "{answer}"
    );
    // Then a GET on the same connection: 405, and the connection closes.
    send(&mut tls, b"GET / HTTP/1.1\r\nHost: member\r\n\r\n")
        .await
        .unwrap();
    let answer = read_answer(&mut tls).await;
    assert!(answer.starts_with("HTTP/1.1 405"), "{answer}");
    let mut rest = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(5), tls.read_to_end(&mut rest)).await;
    assert!(
        matches!(closed, Ok(Ok(_)) | Ok(Err(_))),
        "the connection stayed open after the 405"
    );
    fleet.stop().await;
}

/// One answer's head and body (its `Content-Length`), read off `tls`.
async fn read_answer(tls: &mut Tls) -> String {
    let mut answer = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let text = String::from_utf8_lossy(&answer).to_string();
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let length: usize = head
                .to_ascii_lowercase()
                .lines()
                .find_map(|l| {
                    l.strip_prefix("content-length:")
                        .map(|v| v.trim().parse().unwrap())
                })
                .unwrap_or(0);
            if body.len() >= length {
                return text;
            }
        }
        let n = tls.read(&mut chunk).await.unwrap();
        assert!(
            n > 0,
            "closed before the answer: {:?}",
            String::from_utf8_lossy(&answer)
        );
        answer.extend_from_slice(&chunk[..n]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_bodies_on_one_members_route_are_cut_off_and_the_others_are_answered() {
    let _serial = SERIAL.lock().await;
    enough_files(4096);
    let fleet = Fleet::start().await;
    let route = fleet.route_of_a();
    let server = fleet.server();
    // 64 connections on a's valid route, each declaring a 7,000,000-byte review and sending
    // a byte every two seconds: when did the server let go of each?
    let trickles: Vec<_> = (0..64)
        .map(|_| {
            let route = route.clone();
            tokio::spawn(async move {
                let mut tls = tls_from(attacker(), server).await.unwrap();
                let head = format!(
                    "POST {route}?timeout=5s HTTP/1.1\r\nHost: flood\r\nContent-Type: application/json\r\nContent-Length: 7000000\r\n\r\n{{"
                );
                send(&mut tls, head.as_bytes()).await.unwrap();
                let sent = Instant::now();
                let mut buffer = vec![0; 4096];
                // At most 30 s: a server that holds on longer fails the assertion below.
                while sent.elapsed() < Duration::from_secs(30) {
                    tokio::select! {
                        read = tls.read(&mut buffer) => match read {
                            Ok(0) | Err(_) => return sent.elapsed(),
                            // An answer: read on to the close.
                            Ok(_) => {}
                        },
                        () = tokio::time::sleep(Duration::from_secs(2)) => {
                            if send(&mut tls, b" ").await.is_err() {
                                return sent.elapsed();
                            }
                        }
                    }
                }
                sent.elapsed()
            })
        })
        .collect();
    fleet.member_writes(&fleet.b, "trickled").await;
    let mut held = Vec::new();
    for trickle in trickles {
        held.push(trickle.await.unwrap());
    }
    let longest = held.iter().max().unwrap();
    assert!(
        *longest <= HOOK_TIMEOUT + Duration::from_secs(2),
        "a slow body held its connection for {longest:?} (the hook's timeout is {HOOK_TIMEOUT:?})"
    );
    fleet.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_size_reviews_on_one_route_stay_within_the_body_budget_or_get_429() {
    let _serial = SERIAL.lock().await;
    enough_files(4096);
    let fleet = Fleet::start().await;
    let route = fleet.route_of_a();
    let server = fleet.server();
    // A review as large as the server reads (7 MiB): a ConfigMap with one large value.
    let filler = 7 * 1024 * 1024 - 1024;
    let review = config_map_review(
        "big-one",
        NS,
        serde_json::json!({"filler": "x".repeat(filler)}),
    );
    let body = bytes::Bytes::from(serde_json::to_vec(&review).unwrap());
    assert!(body.len() <= 7 << 20, "{}", body.len());
    let reviews: Vec<_> = (0..64)
        .map(|_| {
            let (route, body) = (route.clone(), body.clone());
            tokio::spawn(async move {
                let mut tls = tls_from(attacker(), server).await.unwrap();
                let head = format!(
                    "POST {route}?timeout=5s HTTP/1.1\r\nHost: flood\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                    body.len()
                );
                send(&mut tls, head.as_bytes()).await.unwrap();
                // A refused review may be answered before its body is sent: a write error
                // then is the server's refusal, read below.
                let _ = send(&mut tls, &body).await;
                let mut answer = Vec::new();
                let _ = tokio::time::timeout(Duration::from_secs(30), tls.read_to_end(&mut answer)).await;
                let answer = String::from_utf8_lossy(&answer);
                answer
                    .split_whitespace()
                    .nth(1)
                    .and_then(|code| code.parse::<u16>().ok())
                    .unwrap_or(0)
            })
        })
        .collect();
    let mut codes = Vec::new();
    for review in reviews {
        codes.push(review.await.unwrap());
    }
    // The default budget is 64 MiB, a quarter of it for one cluster: two full-size reviews
    // of one cluster at once, never more.
    let most = fleet.hooked.big_most.load(Ordering::SeqCst);
    assert!(
        most <= 2,
        "the hook held {most} full-size reviews of one cluster at once"
    );
    let (answered, refused) = (
        codes.iter().filter(|c| **c == 200).count(),
        codes.iter().filter(|c| **c == 429).count(),
    );
    assert_eq!(
        answered + refused,
        64,
        "every review answered or refused with 429: {codes:?}"
    );
    assert!(answered >= 1, "{codes:?}");
    let refusals = sample(
        &fleet.scrape(),
        "multicluster_runtime_webhook_throttled_total",
        &[("reason", "memory"), ("cluster", "a")],
    )
    .unwrap_or(0.0);
    assert_eq!(refusals as usize, refused, "each 429 is counted");
    // The server lives: members are served.
    fleet.member_writes(&fleet.b, "after").await;
    fleet.stop().await;
}

// --- the endpoints ---

/// A manager serving its endpoints over HTTPS, checking tokens with `host`'s reviews.
async fn endpoints(
    host: &multicluster_runtime_testenv::TestCluster,
) -> (
    Arc<Manager<Clusters<ClusterName>>>,
    tokio::task::JoinHandle<()>,
    SocketAddr,
) {
    let manager = Arc::new(Manager::new(Clusters::<ClusterName>::new()).serve(
        Endpoints::new("127.0.0.1:0".parse().unwrap()).authorize_with(host.client().unwrap()),
    ));
    let run = spawn_manager(&manager);
    let manager_ = manager.clone();
    eventually(30, "the endpoints", async || manager_.served_at().is_some()).await;
    let addr = manager.served_at().unwrap();
    (manager, run, addr)
}

/// `GET /healthz` from the member side with a 1 s timeout, as the kubelet probes.
async fn probe(addr: SocketAddr) -> Result<(), String> {
    let attempt = async {
        let mut tls = tls_from(member_side(), addr)
            .await
            .map_err(|e| e.to_string())?;
        send(
            &mut tls,
            b"GET /healthz HTTP/1.1\r\nHost: kubelet\r\nConnection: close\r\n\r\n",
        )
        .await
        .map_err(|e| e.to_string())?;
        let mut answer = Vec::new();
        let _ = tls.read_to_end(&mut answer).await;
        let answer = String::from_utf8_lossy(&answer).to_string();
        if answer.starts_with("HTTP/1.1 200") {
            Ok(())
        } else {
            Err(format!("answered {answer:?}"))
        }
    };
    tokio::time::timeout(Duration::from_secs(1), attempt)
        .await
        .unwrap_or_else(|_| Err("no answer within 1 s".into()))
}

/// A probe a second for 30 s: none may fail.
async fn probes_for_30s(addr: SocketAddr) {
    let mut failed = Vec::new();
    for i in 0..30 {
        let started = Instant::now();
        if let Err(why) = probe(addr).await {
            failed.push(format!("probe {i}: {why}"));
        }
        tokio::time::sleep_until(started + Duration::from_secs(1)).await;
    }
    assert!(
        failed.is_empty(),
        "{} of 30 probes failed:\n{}",
        failed.len(),
        failed.join("\n")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probes_are_answered_while_another_address_holds_600_idle_connections() {
    let _serial = SERIAL.lock().await;
    enough_files(4096);
    let env = TestEnv::builder().clusters(1).start().await.unwrap();
    let (manager, run, addr) = endpoints(&env.cluster(0).unwrap()).await;
    probe(addr).await.unwrap();
    let flood = idle_tcp(addr, 600);
    flood.opened_at_least(600).await;
    probes_for_30s(addr).await;
    flood.stop().await;
    manager.shutdown();
    let _ = tokio::time::timeout(Duration::from_secs(30), run).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probes_are_answered_while_made_up_tokens_wait_on_a_host_that_does_not_answer() {
    let _serial = SERIAL.lock().await;
    enough_files(4096);
    let env = TestEnv::builder().clusters(1).start().await.unwrap();
    let host = env.cluster(0).unwrap();
    let (manager, run, addr) = endpoints(&host).await;
    probe(addr).await.unwrap();
    // The host stops answering (SIGSTOP): every token review hangs.
    let paused = host.pause().unwrap();
    fn made_up() -> String {
        use std::sync::atomic::AtomicU64;
        static NEXT: AtomicU64 = AtomicU64::new(0);
        format!(
            "Authorization: Bearer made-up-{}\r\n",
            NEXT.fetch_add(1, Ordering::Relaxed)
        )
    }
    let flood = repeated_gets(addr, 256, "/metrics", made_up);
    flood.opened_at_least(256).await;
    probes_for_30s(addr).await;
    flood.stop().await;
    paused.resume();
    manager.shutdown();
    let _ = tokio::time::timeout(Duration::from_secs(30), run).await;
}
