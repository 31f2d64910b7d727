//! Traces across clusters (feature `opentelemetry`), on real API servers: one change on a hub
//! is followed through its watch event and its wait in the queue into the reconcile and the
//! reconcile's writes into two members, all one trace, as an in-process OTLP/HTTP collector
//! receives it; and the reconcile histogram names that trace as an exemplar.
//!
//! One test in this binary: it installs the process's global subscriber.
#![cfg(feature = "opentelemetry")]

mod common;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use common::*;
use http_body_util::{BodyExt, Full};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams};
use multicluster_runtime::providers::Clusters;
use multicluster_runtime::telemetry::Tracing;
use multicluster_runtime::{Action, Builder, Cluster, ClusterName, Context, Manager, Metrics};
use multicluster_runtime_testenv::TestEnv;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;
use tracing_subscriber::prelude::*;

const NS: &str = "traced";

/// The spans a collector received.
type Received = Arc<Mutex<Vec<Span>>>;

/// An OTLP/HTTP collector on loopback: takes `POST /v1/traces` (protobuf) until the test ends.
async fn collector() -> (SocketAddr, Received) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let received = Received::default();
    let spans = received.clone();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let spans = spans.clone();
            tokio::spawn(async move {
                let service = hyper::service::service_fn(
                    move |request: hyper::Request<hyper::body::Incoming>| {
                        let spans = spans.clone();
                        async move {
                            let path_ok = request.method() == hyper::Method::POST
                                && request.uri().path() == "/v1/traces";
                            let body = request.into_body().collect().await;
                            let decoded = body
                                .ok()
                                .and_then(|b| ExportTraceServiceRequest::decode(b.to_bytes()).ok());
                            let status = match decoded {
                                Some(export) if path_ok => {
                                    let mut spans = spans.lock().unwrap();
                                    for resource in export.resource_spans {
                                        for scope in resource.scope_spans {
                                            spans.extend(scope.spans);
                                        }
                                    }
                                    200
                                }
                                _ => 400,
                            };
                            hyper::Response::builder()
                                .status(status)
                                .header("content-type", "application/x-protobuf")
                                .body(Full::new(Bytes::new()))
                        }
                    },
                );
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    (address, received)
}

/// A span's string attribute.
fn attribute<'a>(span: &'a Span, key: &str) -> Option<&'a str> {
    span.attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref())
        .and_then(|v| match &v.value {
            Some(Value::StringValue(s)) => Some(s.as_str()),
            _ => None,
        })
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Copies the hub's ConfigMap into both members (server-side apply).
async fn copy_to_members(
    source: Arc<ConfigMap>,
    ctx: Context<ClusterName, ()>,
) -> Result<Action, kube::Error> {
    for member in ["member-a", "member-b"] {
        let Some(cluster) = ctx.cluster_by_id(&name(member)) else {
            return Ok(Action::requeue(Duration::from_millis(200)));
        };
        let copy = ConfigMap {
            metadata: ObjectMeta {
                name: Some("copy".into()),
                namespace: Some(NS.into()),
                ..ObjectMeta::default()
            },
            data: source.data.clone(),
            ..ConfigMap::default()
        };
        Api::<ConfigMap>::namespaced(cluster.client(), NS)
            .patch(
                "copy",
                &PatchParams::apply("tracing-test").force(),
                &Patch::Apply(&copy),
            )
            .await?;
    }
    Ok(Action::await_change())
}

/// The spans of the trace of a reconcile of the change (`object changed`) that holds writes
/// into both members, once one was received.
fn change_trace(spans: &[Span]) -> Option<Vec<Span>> {
    let mut traces: HashMap<&[u8], Vec<&Span>> = HashMap::new();
    for span in spans {
        traces.entry(&span.trace_id).or_default().push(span);
    }
    traces
        .into_values()
        .find(|trace| {
            let reconciled = trace.iter().any(|s| {
                s.name == "reconcile"
                    && attribute(s, "object") == Some("traced/source")
                    && attribute(s, "reason") == Some("object changed")
            });
            let written: BTreeSet<&str> = trace
                .iter()
                .filter(|s| attribute(s, "http.request.method") == Some("PATCH"))
                .filter_map(|s| attribute(s, "cluster"))
                .collect();
            // The event's span ends last (the reconcile holds it open): all of it is here.
            let started = trace.iter().any(|s| s.name == "watch_event");
            reconciled && started && written.len() == 2
        })
        .map(|trace| trace.into_iter().cloned().collect())
}

async fn copied(client: &kube::Client, version: &str) -> bool {
    Api::<ConfigMap>::namespaced(client.clone(), NS)
        .get_opt("copy")
        .await
        .ok()
        .flatten()
        .and_then(|cm| cm.data)
        .and_then(|data| data.get("version").cloned())
        .as_deref()
        == Some(version)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_hub_change_is_one_trace_from_its_watch_event_to_the_writes_into_two_members() {
    let (address, received) = collector().await;
    let (layer, tracing) = Tracing::otlp()
        .endpoint(format!("http://{address}"))
        .service_name("tracing-test")
        .install()
        .unwrap();
    tracing_subscriber::registry()
        .with(layer.with_filter(tracing_subscriber::filter::LevelFilter::INFO))
        .init();

    let env = TestEnv::builder().clusters(3).start().await.unwrap();
    let hub = env.cluster(0).unwrap().client().unwrap();
    let members = [
        env.cluster(1).unwrap().client().unwrap(),
        env.cluster(2).unwrap().client().unwrap(),
    ];
    for client in [&hub, &members[0], &members[1]] {
        create_namespace(client, NS).await;
    }
    let clusters = Clusters::new();
    for (id, client) in ["member-a", "member-b"].iter().zip(&members) {
        clusters
            .add(Cluster::new(name(id), client.clone()))
            .unwrap();
    }
    let mut registry = prometheus_client::registry::Registry::default();
    let manager = Arc::new(
        Manager::new(clusters)
            .with_local(Cluster::new(name("hub"), hub.clone()))
            .metrics(Metrics::new(&mut registry)),
    );
    Builder::<_, ConfigMap>::new(
        &manager,
        kube_runtime::watcher::Config::default().labels("traced"),
    )
    .named("copier")
    .engage_local(true)
    .engage_provider(false)
    .start(
        copy_to_members,
        |_, _, _| Action::requeue(Duration::from_millis(200)),
        Arc::new(()),
    );
    let run = spawn_manager(&manager);

    let sources: Api<ConfigMap> = Api::namespaced(hub.clone(), NS);
    let source = |version: &str| ConfigMap {
        metadata: ObjectMeta {
            name: Some("source".into()),
            labels: Some(BTreeMap::from([("traced".into(), "yes".into())])),
            ..ObjectMeta::default()
        },
        data: Some(BTreeMap::from([("version".into(), version.into())])),
        ..ConfigMap::default()
    };
    sources
        .create(&PostParams::default(), &source("1"))
        .await
        .unwrap();
    eventually(
        60,
        "the first version copied into both members",
        async || copied(&members[0], "1").await && copied(&members[1], "1").await,
    )
    .await;
    // The change followed: the hub's object changes once more.
    sources
        .patch(
            "source",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"data": {"version": "2"}})),
        )
        .await
        .unwrap();
    eventually(
        60,
        "the second version copied into both members",
        async || copied(&members[0], "2").await && copied(&members[1], "2").await,
    )
    .await;
    // Sync point: the trace is exported once its reconcile span closed (after its writes).
    let mut found = None;
    eventually(30, "the trace of the change at the collector", async || {
        tracing.flush().await.unwrap();
        found = change_trace(&received.lock().unwrap());
        found.is_some()
    })
    .await;
    let trace = found.unwrap();
    let spans = received.lock().unwrap().clone();
    let by_name = |name: &str| -> Vec<&Span> { trace.iter().filter(|s| s.name == name).collect() };
    let events = by_name("watch_event");
    assert_eq!(events.len(), 1, "one watch event starts the trace");
    let event = events[0];
    assert!(
        event.parent_span_id.is_empty(),
        "the watch event is the root"
    );
    assert_eq!(attribute(event, "cluster"), Some("hub"));
    assert_eq!(attribute(event, "controller"), Some("copier"));
    assert_eq!(attribute(event, "object"), Some("traced/source"));
    let queue = by_name("queue");
    assert_eq!(queue.len(), 1, "one wait in the queue");
    assert_eq!(queue[0].parent_span_id, event.span_id);
    assert_eq!(attribute(queue[0], "lane"), Some("normal"));
    assert_eq!(attribute(queue[0], "cluster"), Some("hub"));
    let reconciles = by_name("reconcile");
    assert_eq!(reconciles.len(), 1);
    let reconcile = reconciles[0];
    assert_eq!(reconcile.parent_span_id, event.span_id);
    assert!(
        reconcile.start_time_unix_nano >= queue[0].end_time_unix_nano,
        "the reconcile starts once its wait ended"
    );
    let writes: Vec<&Span> = trace
        .iter()
        .filter(|s| attribute(s, "http.request.method") == Some("PATCH"))
        .collect();
    let mut written: Vec<&str> = writes
        .iter()
        .map(|s| attribute(s, "cluster").unwrap())
        .collect();
    written.sort();
    assert_eq!(written, ["member-a", "member-b"]);
    for write in &writes {
        assert_eq!(
            write.parent_span_id, reconcile.span_id,
            "a write is the reconcile's child"
        );
        assert_eq!(
            write.name, "PATCH",
            "a request's span is named by its method"
        );
        assert_eq!(
            attribute(write, "url.path"),
            Some("/api/v1/namespaces/traced/configmaps/copy")
        );
    }

    // The reconcile histogram's exemplars name traces of reconciles.
    let reconcile_traces: BTreeSet<String> = spans
        .iter()
        .filter(|s| s.name == "reconcile")
        .map(|s| hex(&s.trace_id))
        .collect();
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    let exemplars: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("controller_runtime_reconcile_time_seconds_bucket"))
        .filter_map(|l| l.split_once("# {trace_id=\"").map(|(_, rest)| &rest[..32]))
        .collect();
    assert!(
        !exemplars.is_empty(),
        "the reconcile histogram has exemplars:\n{text}"
    );
    for exemplar in exemplars {
        assert!(
            reconcile_traces.contains(exemplar),
            "the exemplar {exemplar} is the trace of a reconcile"
        );
    }

    manager.shutdown();
    run.await.unwrap();
    tracing.shutdown().await.unwrap();
}
