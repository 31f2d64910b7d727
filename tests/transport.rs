//! The shared transport against real API servers: cluster names of one API server share
//! HTTP/2 connections within the server's stream limit, connections that break or stop
//! answering are replaced and the watches on them resume, a rotated client certificate gets
//! connections of its own, a server without HTTP/2 is served over HTTP/1.1, and an upgrade
//! request goes over HTTP/1.1 and is upgraded; a create whose response was lost is not sent
//! again; the read timeout applies to each HTTP/2 stream; token users sharing a connection are
//! each seen as themselves; a server's GOAWAY loses and repeats no request.
//!
//! Connections are counted where they cannot hide: every cluster reaches its API server
//! through a TCP relay (`common::Relay`) that counts what passes through it.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use k8s_openapi::api::authentication::v1::SelfSubjectReview;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::api::{Api, ObjectMeta, PostParams};
use kube_runtime::watcher;
use multicluster_runtime::providers::Clusters;
use multicluster_runtime::{Action, Builder, Cluster, ClusterId, ClusterName, Context, Manager};
use multicluster_runtime_testenv::{TestCluster, TestEnv};

fn never<K, C: ClusterId, S>(_: Arc<K>, _: &kube::Error, _: &Context<C, S>) -> Action {
    Action::await_change()
}

/// A manager over `clusters` with a ConfigMap controller (objects labelled `type`) recording
/// into the returned `Seen`, running.
fn configmap_manager(
    clusters: &Clusters<ClusterName>,
) -> (
    Arc<Manager<Clusters<ClusterName>>>,
    Arc<Seen>,
    tokio::task::JoinHandle<()>,
) {
    let manager = Arc::new(Manager::new(clusters.clone()));
    let seen = Arc::new(Seen::default());
    Builder::<_, ConfigMap>::new(&manager, fixture_objects()).start(
        record::<ConfigMap, ClusterName>,
        never,
        seen.clone(),
    );
    let run = spawn_manager(&manager);
    (manager, seen, run)
}

async fn create_configmap(tc: &TestCluster, ns: &str, name: &str) -> String {
    Api::<ConfigMap>::namespaced(tc.client().unwrap(), ns)
        .create(&PostParams::default(), &config_map(ns, name, "t"))
        .await
        .unwrap()
        .metadata
        .resource_version
        .unwrap()
}

/// Every one of `names` reconciled `ns/object` at `version`.
fn all_reconciled(seen: &Seen, names: &[String], ns: &str, object: &str, version: &str) -> bool {
    names
        .iter()
        .all(|n| seen.reconciled_at(&format!("cluster://{n}/{ns}/{object}"), version))
}

/// Whom the API server takes `client` for.
async fn whoami(client: kube::Client) -> String {
    Api::<SelfSubjectReview>::all(client)
        .create(&PostParams::default(), &SelfSubjectReview::default())
        .await
        .unwrap()
        .status
        .and_then(|s| s.user_info)
        .and_then(|u| u.username)
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn names_of_one_apiserver_share_http2_connections_within_the_servers_stream_limit() {
    // 30 names × 2 kinds = 60 watches, at most 20 streams per connection: 3 connections.
    let env = TestEnv::builder()
        .apiserver_arg("--http2-max-streams-per-connection=20")
        .start()
        .await
        .unwrap();
    let tc = env.cluster(0).unwrap();
    let client = tc.client().unwrap();
    create_namespace(&client, "shared").await;
    let version = create_configmap(&tc, "shared", "one").await;
    let secret = Secret {
        metadata: ObjectMeta {
            name: Some("one".into()),
            namespace: Some("shared".into()),
            ..Default::default()
        },
        ..Default::default()
    };
    Api::<Secret>::namespaced(client.clone(), "shared")
        .create(&PostParams::default(), &secret)
        .await
        .unwrap();

    let cm_watches = tc.served_watches("configmaps", true).await.unwrap();
    let secret_watches = tc.served_watches("secrets", true).await.unwrap();
    let relay = Relay::start(tc.server()).await;
    let clusters = Clusters::new();
    let (manager, seen, run) = configmap_manager(&clusters);
    let secrets = Arc::new(Seen::default());
    Builder::<_, Secret>::new(&manager, watcher::Config::default()).start(
        record::<Secret, ClusterName>,
        never,
        secrets.clone(),
    );
    let names: Vec<String> = (0..30).map(|i| format!("shared-{i:02}")).collect();
    for n in &names {
        // Each its own config, as providers build them.
        let cluster = Cluster::from_config(name(n), relay.config(tc.config())).unwrap();
        clusters.add(cluster).unwrap();
    }
    eventually(
        60,
        "every name reconciled the ConfigMap and the Secret",
        async || {
            all_reconciled(&seen, &names, "shared", "one", &version)
                && names
                    .iter()
                    .all(|n| secrets.count(&format!("cluster://{n}/shared/one")) > 0)
        },
    )
    .await;
    // All 60 watches are open, at the server: none was refused or left waiting for a stream.
    // (The API server watches Secrets itself.)
    eventually(30, "the API server serves all 60 watches", async || {
        tc.served_watches("configmaps", true).await.unwrap() == cm_watches + 30
            && tc.served_watches("secrets", true).await.unwrap() == secret_watches + 30
    })
    .await;
    assert!(
        relay.open() <= 3 && relay.accepted() <= 3,
        "60 streams at 20 per connection need 3 connections; open {}, opened {}",
        relay.open(),
        relay.accepted()
    );
    // A change still reaches every name over the shared connections.
    let version = create_configmap(&tc, "shared", "two").await;
    eventually(30, "every name reconciled the new ConfigMap", async || {
        all_reconciled(&seen, &names, "shared", "two", &version)
    })
    .await;
    manager.shutdown();
    run.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_connection_is_opened_again_and_the_watches_resume() {
    let env = TestEnv::start().await.unwrap();
    let tc = env.cluster(0).unwrap();
    create_namespace(&tc.client().unwrap(), "dropped").await;
    let relay = Relay::start(tc.server()).await;
    let clusters = Clusters::new();
    let (manager, seen, run) = configmap_manager(&clusters);
    let names: Vec<String> = (0..5).map(|i| format!("dropped-{i}")).collect();
    for n in &names {
        clusters
            .add(Cluster::from_config(name(n), relay.config(tc.config())).unwrap())
            .unwrap();
    }
    let version = create_configmap(&tc, "dropped", "before").await;
    eventually(
        30,
        "every name reconciled the first ConfigMap",
        async || all_reconciled(&seen, &names, "dropped", "before", &version),
    )
    .await;
    assert_eq!(
        relay.open(),
        1,
        "five names of one server share one connection"
    );
    let opened = relay.accepted();

    // The connection breaks (every relayed connection dropped); a change made meanwhile
    // must still reach every name.
    relay.cut();
    let version = create_configmap(&tc, "dropped", "during").await;
    relay.restore();
    eventually(
        60,
        "every name reconciled the ConfigMap made while cut off",
        async || all_reconciled(&seen, &names, "dropped", "during", &version),
    )
    .await;
    assert!(relay.accepted() > opened, "a new connection was opened");
    assert_eq!(relay.open(), 1, "the names share the new connection");
    manager.shutdown();
    run.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_that_stops_answering_pings_is_replaced() {
    let logs = Logs::capture();
    // Short pings for the transports built in this test (the relay's address is its own key).
    multicluster_runtime::transport_keepalive(Some((
        Duration::from_millis(500),
        Duration::from_secs(2),
    )));
    let env = TestEnv::start().await.unwrap();
    let tc = env.cluster(0).unwrap();
    create_namespace(&tc.client().unwrap(), "frozen").await;
    let relay = Relay::start(tc.server()).await;
    let server = relay.config(tc.config()).cluster_url.to_string();
    let clusters = Clusters::new();
    let (manager, seen, run) = configmap_manager(&clusters);
    let names: Vec<String> = (0..3).map(|i| format!("frozen-{i}")).collect();
    for n in &names {
        clusters
            .add(Cluster::from_config(name(n), relay.config(tc.config())).unwrap())
            .unwrap();
    }
    multicluster_runtime::transport_keepalive(None);
    let version = create_configmap(&tc, "frozen", "before").await;
    eventually(
        30,
        "every name reconciled the first ConfigMap",
        async || all_reconciled(&seen, &names, "frozen", "before", &version),
    )
    .await;
    let opened = relay.accepted();

    // The server stops answering without closing anything (SIGSTOP): only the pings can tell.
    let paused = tc.pause().unwrap();
    eventually(
        30,
        "the transport gave the silent connection up",
        async || {
            !logs
                .lines(&["no answer to a keep-alive ping", &server])
                .is_empty()
        },
    )
    .await;
    paused.resume();
    let version = create_configmap(&tc, "frozen", "after").await;
    eventually(
        60,
        "every name reconciled the ConfigMap made after the freeze",
        async || all_reconciled(&seen, &names, "frozen", "after", &version),
    )
    .await;
    assert!(
        relay.accepted() > opened,
        "the watches resumed on a new connection"
    );
    manager.shutdown();
    run.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_client_certificate_gets_connections_of_its_own() {
    let env = TestEnv::start().await.unwrap();
    let tc = env.cluster(0).unwrap();
    create_namespace(&tc.client().unwrap(), "rotated").await;
    let alice = tc.add_user("alice", &["system:masters"]).unwrap();
    let bob = tc.add_user("bob", &["system:masters"]).unwrap();
    let relay = Relay::start(tc.server()).await;
    let clusters = Clusters::new();
    let (manager, seen, run) = configmap_manager(&clusters);
    let id = name("rotated");
    clusters
        .add(Cluster::from_config(id.clone(), relay.config(alice.config())).unwrap())
        .unwrap();
    // A second name with alice's identity shares her connection.
    clusters
        .add(Cluster::from_config(name("alice-too"), relay.config(alice.config())).unwrap())
        .unwrap();
    let version = create_configmap(&tc, "rotated", "before").await;
    let names = vec!["rotated".to_string(), "alice-too".to_string()];
    eventually(
        30,
        "both names reconciled the first ConfigMap",
        async || all_reconciled(&seen, &names, "rotated", "before", &version),
    )
    .await;
    let engaged = |id: &ClusterName| manager.fleet().get(id).unwrap().client();
    assert_eq!(whoami(engaged(&id)).await, "alice");
    assert_eq!(relay.open(), 1, "one identity, one connection");

    // The credentials rotate: the same name comes back with bob's certificate.
    clusters
        .add(Cluster::from_config(id.clone(), relay.config(bob.config())).unwrap())
        .unwrap();
    assert_eq!(whoami(engaged(&id)).await, "bob");
    assert_eq!(whoami(engaged(&name("alice-too"))).await, "alice");
    assert_eq!(
        relay.open(),
        2,
        "bob's certificate has a connection of its own"
    );
    let version = create_configmap(&tc, "rotated", "after").await;
    eventually(
        30,
        "both names reconciled the ConfigMap made after the rotation",
        async || all_reconciled(&seen, &names, "rotated", "after", &version),
    )
    .await;

    // When alice's last cluster goes, so does her connection.
    assert!(clusters.remove(&name("alice-too")));
    eventually(30, "alice's connection is closed", async || {
        relay.open() == 1
    })
    .await;
    manager.shutdown();
    run.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_without_http2_is_served_over_http1() {
    let env = TestEnv::builder()
        .apiserver_arg("--disable-http2-serving")
        .start()
        .await
        .unwrap();
    let tc = env.cluster(0).unwrap();
    create_namespace(&tc.client().unwrap(), "plain").await;
    let relay = Relay::start(tc.server()).await;
    let clusters = Clusters::new();
    let (manager, seen, run) = configmap_manager(&clusters);
    let names: Vec<String> = (0..3).map(|i| format!("plain-{i}")).collect();
    for n in &names {
        clusters
            .add(Cluster::from_config(name(n), relay.config(tc.config())).unwrap())
            .unwrap();
    }
    let version = create_configmap(&tc, "plain", "one").await;
    eventually(30, "every name reconciled the ConfigMap", async || {
        all_reconciled(&seen, &names, "plain", "one", &version)
    })
    .await;
    // HTTP/1.1 holds a connection per open watch.
    assert!(
        relay.open() >= 3,
        "three watches over HTTP/1.1 need three connections; open {}",
        relay.open()
    );
    let version = create_configmap(&tc, "plain", "two").await;
    eventually(
        30,
        "every name reconciled the second ConfigMap",
        async || all_reconciled(&seen, &names, "plain", "two", &version),
    )
    .await;
    manager.shutdown();
    run.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_request_goes_over_http1_and_is_upgraded() {
    use tokio::io::AsyncReadExt;

    let env = TestEnv::start().await.unwrap();
    let tc = env.cluster(0).unwrap();
    create_namespace(&tc.client().unwrap(), "upgrade").await;
    let relay = Relay::start(tc.server()).await;
    let client = Cluster::from_config(name("upgrading"), relay.config(tc.config()))
        .unwrap()
        .client();
    let configmaps = Api::<ConfigMap>::namespaced(client.clone(), "upgrade");
    configmaps.list(&Default::default()).await.unwrap();
    assert_eq!(
        relay.accepted(),
        1,
        "ordinary requests: one HTTP/2 connection"
    );
    create_configmap(&tc, "upgrade", "sent-over-a-websocket").await;
    // kube-apiserver serves a watch over a WebSocket to a request that asks to upgrade (as
    // exec, attach and port-forward do, which need a kubelet). HTTP/2 has no such upgrade.
    let request = http::Request::get("/api/v1/namespaces/upgrade/configmaps?watch=true")
        .header(http::header::CONNECTION, "Upgrade")
        .header(http::header::UPGRADE, "websocket")
        .header(http::header::SEC_WEBSOCKET_VERSION, "13")
        .header(http::header::SEC_WEBSOCKET_KEY, "dGhlIHNhbXBsZSBub25jZQ==")
        // The server's WebSocket handshake wants an origin, any origin.
        .header(http::header::ORIGIN, "https://127.0.0.1")
        .body(kube::client::Body::from(Vec::new()))
        .unwrap();
    let mut response = client.send(request).await.unwrap();
    if response.status() != http::StatusCode::SWITCHING_PROTOCOLS {
        use http_body_util::BodyExt;
        let status = response.status();
        let body = response.into_body().collect().await.unwrap().to_bytes();
        panic!("not upgraded: {status} {}", String::from_utf8_lossy(&body));
    }
    let upgraded = hyper::upgrade::on(&mut response).await.unwrap();
    let mut upgraded = hyper_util::rt::TokioIo::new(upgraded);
    // The watch's first event, in a WebSocket frame, names the ConfigMap.
    let mut received = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), async {
        while !String::from_utf8_lossy(&received).contains("sent-over-a-websocket") {
            let mut buf = [0u8; 4096];
            let n = upgraded.read(&mut buf).await.unwrap();
            assert!(n > 0, "the upgraded connection ended before the event");
            received.extend_from_slice(&buf[..n]);
        }
    })
    .await
    .expect("the WebSocket watch sent the ConfigMap");
    assert_eq!(
        relay.accepted(),
        2,
        "the upgrade took an HTTP/1.1 connection of its own"
    );
    // The HTTP/2 connection still serves everything else.
    configmaps.list(&Default::default()).await.unwrap();
    assert_eq!(relay.accepted(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_whose_response_was_lost_is_not_sent_again() {
    let env = TestEnv::start().await.unwrap();
    let tc = env.cluster(0).unwrap();
    let admin = tc.client().unwrap();
    create_namespace(&admin, "once").await;
    let direct: Api<ConfigMap> = Api::namespaced(admin, "once");
    let made = async || generated(&direct, "once-").await;
    let relay = Relay::start(tc.server()).await;
    let cluster = Cluster::from_config(name("once"), relay.config(tc.config())).unwrap();
    let api: Api<ConfigMap> = Api::namespaced(cluster.client(), "once");
    // A read first: the shared connection is open.
    api.list(&Default::default()).await.unwrap();

    // The create reaches the API server, which makes the object; its answer never comes back,
    // and then the connection breaks.
    relay.deafen();
    let create = tokio::spawn(async move {
        let cm = ConfigMap {
            metadata: ObjectMeta {
                generate_name: Some("once-".into()),
                ..Default::default()
            },
            ..Default::default()
        };
        api.create(&PostParams::default(), &cm).await
    });
    eventually(30, "the create reached the API server", async || {
        !made().await.is_empty()
    })
    .await;
    relay.drop_connections();
    let result = tokio::time::timeout(Duration::from_secs(30), create)
        .await
        .expect("the create returned")
        .unwrap();
    // The caller learns that it failed (it may read and decide); the create was not sent
    // again, which would have made a second object under a new generated name.
    assert!(result.is_err(), "{result:?}");
    assert_eq!(made().await.len(), 1, "{:?}", made().await);

    // Reads are sent again on a new connection, and the cluster's client works on.
    let again: Api<ConfigMap> = Api::namespaced(cluster.client(), "once");
    assert_eq!(generated(&again, "once-").await.len(), 1);
}

/// The names of the ConfigMaps `api` lists that start with `prefix`.
async fn generated(api: &Api<ConfigMap>, prefix: &str) -> Vec<String> {
    api.list(&Default::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter_map(|c| c.metadata.name)
        .filter(|n| n.starts_with(prefix))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_read_timeout_applies_to_each_stream_over_http2() {
    use futures::StreamExt;
    let env = TestEnv::start().await.unwrap();
    let tc = env.cluster(0).unwrap();
    create_namespace(&tc.client().unwrap(), "slow").await;
    let relay = Relay::start(tc.server()).await;
    let mut config = relay.config(tc.config());
    let limit = Duration::from_secs(2);
    config.read_timeout = Some(limit);
    let cluster = Cluster::from_config(name("slow"), config).unwrap();
    let api: Api<ConfigMap> = Api::namespaced(cluster.client(), "slow");
    api.list(&Default::default()).await.unwrap();

    // A watch that sees nothing for longer than the read timeout ends with a timeout, as a
    // read on HTTP/1.1 would (the server would have kept it open for minutes).
    let mut events = api
        .watch(&kube::api::WatchParams::default(), "0")
        .await
        .unwrap()
        .boxed();
    let ended = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            match events.next().await {
                Some(Ok(_)) => continue,
                other => return other,
            }
        }
    })
    .await
    .expect("the idle watch ended");
    let error = format!("{:?}", ended);
    assert!(error.contains("read timeout"), "{error}");

    // A request whose answer never comes (the relay drops what the server sends) fails with
    // the timeout too.
    relay.deafen();
    let answered = tokio::time::timeout(Duration::from_secs(20), api.get_opt("nothing"))
        .await
        .expect("the request ended");
    let error = format!("{answered:?}");
    assert!(error.contains("read timeout"), "{error}");
}

/// Issue 28 item 5: two clusters of one API server whose credentials are bearer tokens (no
/// client certificate: the same TLS identity) share one connection, and each request is
/// still made as its own cluster's user.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_users_of_one_connection_are_each_seen_as_themselves() {
    let env = TestEnv::start().await.unwrap();
    let tc = env.cluster(0).unwrap();
    let admin = tc.client().unwrap();
    create_namespace(&admin, "tokens").await;
    let relay = Relay::start(tc.server()).await;
    let mut users = Vec::new();
    for user in ["alice", "bob"] {
        let token = account_token_in(&admin, "tokens", user).await;
        let mut config = relay.config(tc.config());
        config.auth_info.client_certificate_data = None;
        config.auth_info.client_key_data = None;
        config.auth_info.token = Some(token.into());
        let cluster = Cluster::from_config(name(user), config).unwrap();
        users.push((user, cluster));
    }
    // Interleaved, at the same time: twenty reviews each.
    let reviews = users.iter().flat_map(|(user, cluster)| {
        (0..20).map(move |_| async move { (*user, whoami(cluster.client()).await) })
    });
    for (user, seen) in futures::future::join_all(reviews).await {
        assert_eq!(seen, format!("system:serviceaccount:tokens:{user}"));
    }
    assert_eq!(
        relay.accepted(),
        1,
        "both token users went over one connection"
    );
}

/// Issue 28 item 5: an API server that sends GOAWAY now and then (`--goaway-chance`, as
/// API servers behind a load balancer are run) loses no request and duplicates none: the
/// requests it did not process are sent again on a new connection, the others are answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn goaway_from_the_server_loses_and_repeats_no_request() {
    const REQUESTS: usize = 400;
    let env = TestEnv::builder()
        .apiserver_arg("--goaway-chance=0.02")
        .start()
        .await
        .unwrap();
    let tc = env.cluster(0).unwrap();
    create_namespace(&tc.client().unwrap(), "goaway").await;
    let relay = Relay::start(tc.server()).await;
    let cluster = Cluster::from_config(name("goaway"), relay.config(tc.config())).unwrap();
    let api = Api::<ConfigMap>::namespaced(cluster.client(), "goaway");
    // Eight at a time, so that GOAWAY finds requests in flight on the connection it ends.
    use futures::StreamExt;
    let outcomes: Vec<Result<(), kube::Error>> = futures::stream::iter(0..REQUESTS)
        .map(|i| {
            let api = api.clone();
            async move {
                let cm = ConfigMap {
                    metadata: ObjectMeta {
                        generate_name: Some("away-".into()),
                        ..Default::default()
                    },
                    ..Default::default()
                };
                let created = api.create(&PostParams::default(), &cm).await?;
                if i % 2 == 0 {
                    api.get(&created.metadata.name.unwrap()).await?;
                }
                Ok(())
            }
        })
        .buffer_unordered(8)
        .collect()
        .await;
    let failed: Vec<String> = outcomes
        .iter()
        .filter_map(|o| o.as_ref().err().map(ToString::to_string))
        .collect();
    assert!(failed.is_empty(), "{} failed: {failed:?}", failed.len());
    assert_eq!(generated(&api, "away-").await.len(), REQUESTS);
    // The server did send GOAWAY: the client opened connections again.
    assert!(
        relay.accepted() > 1,
        "{} connections for {REQUESTS} creates",
        relay.accepted()
    );
    eprintln!(
        "{} connections for {REQUESTS} creates and {} reads",
        relay.accepted(),
        REQUESTS / 2
    );
}

/// Issue 28 item 4: responses one cluster leaves unread (a log followed and never read, a
/// listing held) cannot stall the other clusters sharing its connection: each stream may have
/// at most its own window unread, and a connection never carries more streams than its window
/// holds of those.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_left_unread_do_not_stall_the_others_on_their_connection() {
    let env = TestEnv::start().await.unwrap();
    let tc = env.cluster(0).unwrap();
    let admin = tc.client().unwrap();
    create_namespace(&admin, "unread").await;
    // A listing of about 4.5 MB: more than one stream's window (4 MiB).
    let direct = Api::<ConfigMap>::namespaced(admin, "unread");
    for i in 0..5 {
        let cm = ConfigMap {
            metadata: ObjectMeta {
                name: Some(format!("big-{i}")),
                ..Default::default()
            },
            data: Some([("blob".to_string(), "x".repeat(900_000))].into()),
            ..Default::default()
        };
        direct.create(&PostParams::default(), &cm).await.unwrap();
    }
    let relay = Relay::start(tc.server()).await;
    let hog = Cluster::from_config(name("hog"), relay.config(tc.config())).unwrap();
    let quiet = Cluster::from_config(name("quiet"), relay.config(tc.config())).unwrap();
    // Seventeen listings whose bodies are never read: seventeen full stream windows, more
    // than a 64 MiB connection window.
    let mut held = Vec::new();
    for _ in 0..17 {
        let request = http::Request::get("/api/v1/namespaces/unread/configmaps")
            .body(kube::client::Body::empty())
            .unwrap();
        held.push(hog.client().send(request).await.unwrap());
    }
    // The other cluster still reads, over the same connection.
    for _ in 0..5 {
        let read = tokio::time::timeout(
            Duration::from_secs(20),
            Api::<ConfigMap>::namespaced(quiet.client(), "unread").get("big-0"),
        )
        .await
        .expect("a read of the other cluster is not stalled by the unread streams")
        .unwrap();
        assert_eq!(read.data.unwrap()["blob"].len(), 900_000);
    }
    assert_eq!(relay.accepted(), 1, "all of it over one connection");
    drop(held);
}

/// An ExecCredential answering with `user`'s client certificate and key.
fn certificate_credential(user: &multicluster_runtime_testenv::TestUser) -> String {
    use base64::Engine;
    use secrecy::ExposeSecret;
    let config = user.config();
    let decode = |b64: &str| {
        String::from_utf8(
            base64::engine::general_purpose::STANDARD
                .decode(b64)
                .unwrap(),
        )
        .unwrap()
    };
    let cert = decode(config.auth_info.client_certificate_data.as_deref().unwrap());
    let key = decode(
        config
            .auth_info
            .client_key_data
            .as_ref()
            .unwrap()
            .expose_secret(),
    );
    serde_json::json!({
        "apiVersion": "client.authentication.k8s.io/v1",
        "kind": "ExecCredential",
        "status": {"clientCertificateData": cert, "clientKeyData": key},
    })
    .to_string()
}

/// Issue 28 item 2: a client certificate an exec plugin issues is used until the server
/// refuses it (it expired), then the plugin's new one reaches the TLS identity: new
/// connections present it, and requests go on as the new certificate's user.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_certificate_from_an_exec_plugin_is_renewed_when_it_expires() {
    let env = TestEnv::start().await.unwrap();
    let tc = env.cluster(0).unwrap();
    // The first certificate lasts seconds (12-hour ones are common; the test has no day).
    let first = tc
        .add_user_valid_for("rotating-1", &["system:masters"], Duration::from_secs(8))
        .unwrap();
    let second = tc.add_user("rotating-2", &["system:masters"]).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let credential = dir.path().join("credential.json");
    std::fs::write(&credential, certificate_credential(&first)).unwrap();
    let mut config = tc.config();
    config.auth_info.client_certificate_data = None;
    config.auth_info.client_key_data = None;
    config.auth_info.exec = Some(kube::config::ExecConfig {
        api_version: Some("client.authentication.k8s.io/v1".into()),
        command: Some("cat".into()),
        args: Some(vec![credential.display().to_string()]),
        env: None,
        drop_env: None,
        install_hint: None,
        provide_cluster_info: false,
        cluster: None,
        interactive_mode: Some(kube::config::ExecInteractiveMode::Never),
        other: Default::default(),
    });
    let relay = Relay::start(tc.server()).await;
    let cluster = Cluster::from_config(name("rotating"), relay.config(config)).unwrap();
    let whoami = async || -> Result<String, kube::Error> {
        Ok(Api::<SelfSubjectReview>::all(cluster.client())
            .create(&PostParams::default(), &SelfSubjectReview::default())
            .await?
            .status
            .and_then(|s| s.user_info)
            .and_then(|u| u.username)
            .unwrap_or_default())
    };
    assert_eq!(whoami().await.unwrap(), "rotating-1");
    // The plugin now answers with the next certificate; the first one expires.
    std::fs::write(&credential, certificate_credential(&second)).unwrap();
    let mut refused = 0;
    eventually(
        60,
        "requests are made as rotating-2",
        async || match whoami().await {
            Ok(user) => user == "rotating-2",
            Err(kube::Error::Api(status)) if status.code == 401 => {
                refused += 1;
                false
            }
            Err(error) => panic!("{error}"),
        },
    )
    .await;
    assert!(refused <= 1, "{refused} requests refused after the expiry");
    assert!(
        relay.accepted() >= 2,
        "the new certificate on a new connection"
    );
}
