//! The fake kept honest: a corpus of request sequences runs against a real kube-apiserver (the
//! test control plane) and against the fake, and what a client observes of each (status
//! codes, reasons, messages, objects modulo uids, versions, times and managed fields, the
//! events of watches) must be the same.
//!
//! The fake runs without its controllers here (no garbage collection, no namespace clean-up):
//! the test control plane has no controller manager either. What the fake is known to do
//! differently is listed in docs/testing.md ("Known limits") and kept out of the corpus.

mod harness;

use harness::Pair;
use multicluster_runtime_fake::ApiServer;
use multicluster_runtime_testenv::TestEnv;
use serde_json::{Value, json};

const CMS: &str = "/api/v1/namespaces/{ns}/configmaps";
const WIDGETS: &str = "/apis/diff.example.com/v1/namespaces/{ns}/widgets";

fn crd() -> Value {
    let open = json!({"type": "object", "x-kubernetes-preserve-unknown-fields": true});
    json!({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "widgets.diff.example.com"},
        "spec": {
            "group": "diff.example.com",
            "scope": "Namespaced",
            "names": {"plural": "widgets", "singular": "widget", "kind": "Widget", "listKind": "WidgetList"},
            "versions": [{
                "name": "v1", "served": true, "storage": true,
                "subresources": {"status": {}},
                "schema": {"openAPIV3Schema": {"type": "object", "properties": {"spec": open, "status": open}}}
            }]
        }
    })
}

/// A CRD without a status subresource: its status is written with the rest.
fn plain_crd() -> Value {
    let mut c = crd();
    c["metadata"]["name"] = json!("gadgets.diff.example.com");
    c["spec"]["names"] = json!({"plural": "gadgets", "singular": "gadget", "kind": "Gadget", "listKind": "GadgetList"});
    if let Some(v) = c["spec"]["versions"][0].as_object_mut() {
        v.remove("subresources");
    }
    c
}

const GADGETS: &str = "/apis/diff.example.com/v1/namespaces/{ns}/gadgets";

fn cm(name: &str, labels: Value, data: Value) -> Value {
    json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "labels": labels}, "data": data})
}

fn widget(name: &str, spec: Value) -> Value {
    json!({"apiVersion": "diff.example.com/v1", "kind": "Widget", "metadata": {"name": name}, "spec": spec})
}

/// Creating, reading and replacing: conflicts, missing objects, invalid names, generated names.
async fn create_get_update(p: &mut Pair) {
    p.req(
        "POST",
        CMS,
        Some(cm("a", json!({"x": "1"}), json!({"k": "v"}))),
    )
    .await;
    p.capture("rv_a", "/metadata/resourceVersion");
    p.req("POST", CMS, Some(cm("a", json!({}), json!({}))))
        .await;
    p.req("GET", &format!("{CMS}/a"), None).await;
    p.req("GET", &format!("{CMS}/missing"), None).await;
    p.req("POST", CMS, Some(cm("Bad_Name", json!({}), json!({}))))
        .await;
    p.req(
        "POST",
        CMS,
        Some(json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {}})),
    )
    .await;
    p.req("POST", CMS, Some(json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "b", "namespace": "elsewhere"}}))).await;
    let mut changed = cm("a", json!({"x": "2"}), json!({"k": "w"}));
    changed["metadata"]["resourceVersion"] = json!("{rv_a}");
    p.req("PUT", &format!("{CMS}/a"), Some(changed.clone()))
        .await;
    // The same version again: stale now.
    p.req("PUT", &format!("{CMS}/a"), Some(changed)).await;
    // No version: an unconditional update, allowed for ConfigMaps.
    p.req(
        "PUT",
        &format!("{CMS}/a"),
        Some(cm("a", json!({"x": "3"}), json!({}))),
    )
    .await;
    // Nothing changes: the version stays.
    p.req(
        "PUT",
        &format!("{CMS}/a"),
        Some(cm("a", json!({"x": "3"}), json!({}))),
    )
    .await;
    p.req(
        "PUT",
        &format!("{CMS}/other"),
        Some(cm("a", json!({}), json!({}))),
    )
    .await;
    p.req(
        "PUT",
        &format!("{CMS}/missing"),
        Some(cm("missing", json!({}), json!({}))),
    )
    .await;
    p.req("GET", &format!("{CMS}/a"), None).await;
}

/// Merge, JSON and strategic merge patches, with and without a version, on a missing object.
async fn patches(p: &mut Pair) {
    p.req(
        "POST",
        CMS,
        Some(cm(
            "p",
            json!({"a": "1", "b": "2"}),
            json!({"k": "v", "l": "w"}),
        )),
    )
    .await;
    p.capture("rv_p", "/metadata/resourceVersion");
    let merge = Some("application/merge-patch+json");
    let json_patch = Some("application/json-patch+json");
    let strategic = Some("application/strategic-merge-patch+json");
    p.req_typed(
        "PATCH",
        &format!("{CMS}/p"),
        merge,
        Some(json!({"metadata": {"labels": {"a": null, "c": "3"}}, "data": {"k": "v2"}})),
    )
    .await;
    p.req_typed("PATCH", &format!("{CMS}/p"), json_patch, Some(json!([{"op": "add", "path": "/data/m", "value": "x"}, {"op": "remove", "path": "/data/l"}]))).await;
    p.req_typed(
        "PATCH",
        &format!("{CMS}/p"),
        json_patch,
        Some(json!([{"op": "test", "path": "/data/m", "value": "nope"}])),
    )
    .await;
    // kube-runtime's finalizer helper: a test for null on a missing path, then an add.
    p.req_typed(
        "PATCH",
        &format!("{CMS}/p"),
        json_patch,
        Some(json!([
            {"op": "test", "path": "/metadata/annotations", "value": null},
            {"op": "add", "path": "/metadata/annotations", "value": {"a": "1"}}
        ])),
    )
    .await;
    p.req_typed(
        "PATCH",
        &format!("{CMS}/p"),
        json_patch,
        Some(json!([{"op": "test", "path": "/metadata/annotations", "value": null}])),
    )
    .await;
    p.req_typed(
        "PATCH",
        &format!("{CMS}/p"),
        strategic,
        Some(json!({"data": {"s": "1"}, "metadata": {"finalizers": ["example.com/a"]}})),
    )
    .await;
    p.req_typed(
        "PATCH",
        &format!("{CMS}/p"),
        strategic,
        Some(json!({"metadata": {"finalizers": ["example.com/b"]}})),
    )
    .await;
    let owner =
        |uid: &str| json!({"apiVersion": "v1", "kind": "ConfigMap", "name": "o", "uid": uid});
    p.req_typed("PATCH", &format!("{CMS}/p"), strategic, Some(json!({"metadata": {"ownerReferences": [owner("11111111-1111-1111-1111-111111111111")]}}))).await;
    p.req_typed("PATCH", &format!("{CMS}/p"), strategic, Some(json!({"metadata": {"ownerReferences": [owner("22222222-2222-2222-2222-222222222222")]}}))).await;
    p.req_typed("PATCH", &format!("{CMS}/p"), strategic, Some(json!({"metadata": {"ownerReferences": [{"uid": "11111111-1111-1111-1111-111111111111", "$patch": "delete"}]}}))).await;
    p.req_typed(
        "PATCH",
        &format!("{CMS}/p"),
        merge,
        Some(json!({"metadata": {"resourceVersion": "{rv_p}"}, "data": {"z": "1"}})),
    )
    .await;
    p.req_typed(
        "PATCH",
        &format!("{CMS}/missing"),
        merge,
        Some(json!({"data": {"z": "1"}})),
    )
    .await;
    p.req_typed(
        "PATCH",
        &format!("{CMS}/p"),
        merge,
        Some(json!({"metadata": {"finalizers": null}})),
    )
    .await;
    p.req_typed(
        "PATCH",
        &format!("{CMS}/p"),
        Some("text/plain"),
        Some(json!({})),
    )
    .await;
    p.req("POST", WIDGETS, Some(widget("w", json!({"size": 1}))))
        .await;
    p.req_typed(
        "PATCH",
        &format!("{WIDGETS}/w"),
        strategic,
        Some(json!({"spec": {"size": 2}})),
    )
    .await;
    p.req_typed(
        "PATCH",
        &format!("{WIDGETS}/w"),
        merge,
        Some(json!({"spec": {"size": 2, "color": "red"}})),
    )
    .await;
}

/// Lists: label and field selectors, refused selectors, pages.
async fn lists(p: &mut Pair) {
    for (name, tier) in [
        ("l1", "web"),
        ("l2", "web"),
        ("l3", "db"),
        ("l4", "cache"),
        ("l5", ""),
    ] {
        let labels = if tier.is_empty() {
            json!({"app": "x"})
        } else {
            json!({"app": "x", "tier": tier})
        };
        p.req("POST", CMS, Some(cm(name, labels, json!({})))).await;
    }
    for selector in [
        "tier%3Dweb",
        "tier!%3Dweb",
        "tier+in+(web,db)",
        "tier+notin+(web)",
        "tier",
        "!tier",
        "app%3Dx,tier%3Ddb",
    ] {
        p.req("GET", &format!("{CMS}?labelSelector={selector}"), None)
            .await;
    }
    p.req("GET", &format!("{CMS}?labelSelector=tier+in+("), None)
        .await;
    p.req(
        "GET",
        &format!("{CMS}?fieldSelector=metadata.name%3Dl3"),
        None,
    )
    .await;
    p.req(
        "GET",
        &format!("{CMS}?fieldSelector=metadata.name!%3Dl3"),
        None,
    )
    .await;
    p.req("GET", &format!("{CMS}?fieldSelector=data.k%3Dv"), None)
        .await;
    p.req("GET", &format!("{CMS}?limit=2"), None).await;
    p.capture("next", "/metadata/continue");
    p.req("GET", &format!("{CMS}?limit=2&continue={{next}}"), None)
        .await;
    p.capture("next", "/metadata/continue");
    // A write between pages: the pages still show the list as it was.
    p.req("DELETE", &format!("{CMS}/l1"), None).await;
    p.req("GET", &format!("{CMS}?limit=2&continue={{next}}"), None)
        .await;
    p.req("GET", &format!("{CMS}?limit=2&labelSelector=app%3Dx"), None)
        .await;
    p.req(
        "GET",
        "/api/v1/namespaces/{ns}/secrets?fieldSelector=type%3DOpaque",
        None,
    )
    .await;
}

/// Deletion: finalizers, preconditions, what a delete answers.
async fn deletion(p: &mut Pair) {
    p.watch("deletion", &format!("{CMS}?watch=true")).await;
    let mut held = cm("held", json!({}), json!({}));
    held["metadata"]["finalizers"] = json!(["example.com/keep"]);
    p.req("POST", CMS, Some(held)).await;
    p.capture("uid_held", "/metadata/uid");
    p.req(
        "DELETE",
        &format!("{CMS}/held"),
        Some(json!({"preconditions": {"uid": "00000000-0000-0000-0000-000000000000"}})),
    )
    .await;
    p.req(
        "DELETE",
        &format!("{CMS}/held"),
        Some(json!({"preconditions": {"uid": "{uid_held}"}})),
    )
    .await;
    p.req("DELETE", &format!("{CMS}/held"), None).await;
    p.req_typed(
        "PATCH",
        &format!("{CMS}/held"),
        Some("application/merge-patch+json"),
        Some(json!({"metadata": {"finalizers": ["example.com/keep", "example.com/more"]}})),
    )
    .await;
    p.req_typed(
        "PATCH",
        &format!("{CMS}/held"),
        Some("application/merge-patch+json"),
        Some(json!({"data": {"still": "writable"}})),
    )
    .await;
    p.req_typed(
        "PATCH",
        &format!("{CMS}/held"),
        Some("application/merge-patch+json"),
        Some(json!({"metadata": {"finalizers": null}})),
    )
    .await;
    p.req("GET", &format!("{CMS}/held"), None).await;
    p.req("POST", CMS, Some(cm("plain", json!({}), json!({}))))
        .await;
    p.req("DELETE", &format!("{CMS}/plain"), None).await;
    p.req("DELETE", &format!("{CMS}/plain"), None).await;
    p.req("POST", WIDGETS, Some(widget("gone", json!({}))))
        .await;
    p.req("DELETE", &format!("{WIDGETS}/gone"), None).await;
    for name in ["c1", "c2", "c3"] {
        p.req(
            "POST",
            CMS,
            Some(cm(
                name,
                json!({"batch": if name == "c3" { "no" } else { "yes" }}),
                json!({}),
            )),
        )
        .await;
    }
    p.req("DELETE", &format!("{CMS}?labelSelector=batch%3Dyes"), None)
        .await;
    p.req("GET", CMS, None).await;
    // Propagation policies: without a garbage collector (the test control plane runs none,
    // the fake runs without its controllers here) the object keeps the policy's finalizer;
    // a resourceVersion precondition that does not hold is refused.
    for (name, policy) in [
        ("fg", "Foreground"),
        ("orphaned", "Orphan"),
        ("bg", "Background"),
    ] {
        p.req("POST", CMS, Some(cm(name, json!({}), json!({}))))
            .await;
        p.req(
            "DELETE",
            &format!("{CMS}/{name}"),
            Some(json!({"propagationPolicy": policy})),
        )
        .await;
    }
    p.req("POST", CMS, Some(cm("pre", json!({}), json!({}))))
        .await;
    p.req(
        "DELETE",
        &format!("{CMS}/pre"),
        Some(json!({"preconditions": {"resourceVersion": "1"}})),
    )
    .await;
    p.req("POST", CMS, Some(cm("zz-sentinel", json!({}), json!({}))))
        .await;
    p.read_watch("deletion", "zz-sentinel").await;
}

/// The status subresource and generation of a custom resource.
async fn status_and_generation(p: &mut Pair) {
    let mut w = widget("s", json!({"size": 1}));
    w["status"] = json!({"ready": true});
    p.req("POST", WIDGETS, Some(w)).await;
    p.capture("rv_s", "/metadata/resourceVersion");
    let mut changed = widget("s", json!({"size": 2}));
    changed["status"] = json!({"ready": false});
    changed["metadata"]["resourceVersion"] = json!("{rv_s}");
    p.req("PUT", &format!("{WIDGETS}/s"), Some(changed)).await;
    p.capture("rv_s", "/metadata/resourceVersion");
    let mut status = widget("s", json!({"size": 99}));
    status["status"] = json!({"ready": true, "seen": 2});
    status["metadata"]["resourceVersion"] = json!("{rv_s}");
    status["metadata"]["labels"] = json!({"ignored": "yes"});
    p.req("PUT", &format!("{WIDGETS}/s/status"), Some(status))
        .await;
    p.req_typed(
        "PATCH",
        &format!("{WIDGETS}/s/status"),
        Some("application/merge-patch+json"),
        Some(json!({"status": {"seen": 3}})),
    )
    .await;
    p.req_typed(
        "PATCH",
        &format!("{WIDGETS}/s"),
        Some("application/merge-patch+json"),
        Some(json!({"metadata": {"labels": {"l": "1"}}})),
    )
    .await;
    // A custom resource needs a version to be replaced.
    p.req(
        "PUT",
        &format!("{WIDGETS}/s"),
        Some(widget("s", json!({"size": 3}))),
    )
    .await;
    p.req("GET", &format!("{WIDGETS}/s"), None).await;
    p.req("GET", &format!("{WIDGETS}/missing/status"), None)
        .await;
    p.req_typed(
        "PATCH",
        &format!("{WIDGETS}/missing/status?fieldManager=test-s"),
        Some("application/apply-patch+yaml"),
        Some(json!({"apiVersion": "diff.example.com/v1", "kind": "Widget", "metadata": {"name": "missing"}, "status": {"ready": true}})),
    )
    .await;
    // Without a status subresource, a change of the status counts in the generation.
    let mut g = json!({"apiVersion": "diff.example.com/v1", "kind": "Gadget", "metadata": {"name": "g"}, "spec": {"size": 1}});
    p.req("POST", GADGETS, Some(g.clone())).await;
    p.capture("rv_g", "/metadata/resourceVersion");
    g["status"] = json!({"ready": true});
    g["metadata"]["resourceVersion"] = json!("{rv_g}");
    p.req("PUT", &format!("{GADGETS}/g"), Some(g)).await;
    p.req("GET", &format!("{GADGETS}/g/status"), None).await;
}

/// Server-side apply: creation, what a second apply removes, shared fields, conflicts with
/// another applier and with an updater, force, the status subresource.
async fn server_side_apply(p: &mut Pair) {
    let apply = Some("application/apply-patch+yaml");
    let a = |data: Value| cm("ssa", json!({"app": "x"}), data);
    p.req_typed(
        "PATCH",
        &format!("{CMS}/ssa?fieldManager=test-a"),
        apply,
        Some(a(json!({"one": "1", "two": "2"}))),
    )
    .await;
    p.req_typed(
        "PATCH",
        &format!("{CMS}/ssa?fieldManager=test-a"),
        apply,
        Some(a(json!({"one": "1"}))),
    )
    .await;
    p.req_typed(
        "PATCH",
        &format!("{CMS}/ssa?fieldManager=test-b"),
        apply,
        Some(cm("ssa", json!({}), json!({"one": "1", "three": "3"}))),
    )
    .await;
    p.req_typed(
        "PATCH",
        &format!("{CMS}/ssa?fieldManager=test-b"),
        apply,
        Some(cm("ssa", json!({}), json!({"one": "changed"}))),
    )
    .await;
    p.req_typed(
        "PATCH",
        &format!("{CMS}/ssa?fieldManager=test-b&force=true"),
        apply,
        Some(cm("ssa", json!({}), json!({"one": "changed"}))),
    )
    .await;
    p.req_typed(
        "PATCH",
        &format!("{CMS}/ssa?fieldManager=test-u"),
        Some("application/merge-patch+json"),
        Some(json!({"data": {"four": "4"}})),
    )
    .await;
    p.req_typed(
        "PATCH",
        &format!("{CMS}/ssa?fieldManager=test-a"),
        apply,
        Some(a(json!({"four": "four"}))),
    )
    .await;
    p.req_typed("PATCH", &format!("{CMS}/ssa"), apply, Some(a(json!({}))))
        .await;
    p.req_typed(
        "PATCH",
        &format!("{CMS}/other?fieldManager=test-a"),
        apply,
        Some(a(json!({}))),
    )
    .await;
    let mut w = widget("applied", json!({"size": 1}));
    p.req_typed(
        "PATCH",
        &format!("{WIDGETS}/applied?fieldManager=test-a"),
        apply,
        Some(w.clone()),
    )
    .await;
    w["status"] = json!({"ready": true});
    p.req_typed(
        "PATCH",
        &format!("{WIDGETS}/applied/status?fieldManager=test-s"),
        apply,
        Some(w),
    )
    .await;
    p.req("GET", &format!("{WIDGETS}/applied"), None).await;
}

/// Watches: from a listed version with a label selector (objects entering and leaving the
/// selection), and from no version (the objects that exist, as ADDED).
async fn watches(p: &mut Pair) {
    p.req(
        "POST",
        CMS,
        Some(cm("before", json!({"watched": "yes"}), json!({}))),
    )
    .await;
    p.req("GET", CMS, None).await;
    p.capture("rv_list", "/metadata/resourceVersion");
    p.watch(
        "sel",
        &format!("{CMS}?watch=true&resourceVersion={{rv_list}}&labelSelector=watched%3Dyes"),
    )
    .await;
    p.watch("all", &format!("{CMS}?watch=true")).await;
    p.req(
        "POST",
        CMS,
        Some(cm("w1", json!({"watched": "yes"}), json!({"n": "1"}))),
    )
    .await;
    p.req_typed(
        "PATCH",
        &format!("{CMS}/w1"),
        Some("application/merge-patch+json"),
        Some(json!({"data": {"n": "2"}})),
    )
    .await;
    p.req_typed(
        "PATCH",
        &format!("{CMS}/w1"),
        Some("application/merge-patch+json"),
        Some(json!({"metadata": {"labels": {"watched": "no"}}})),
    )
    .await;
    p.req_typed(
        "PATCH",
        &format!("{CMS}/w1"),
        Some("application/merge-patch+json"),
        Some(json!({"metadata": {"labels": {"watched": "yes"}}})),
    )
    .await;
    p.req(
        "POST",
        CMS,
        Some(cm("w2", json!({"watched": "no"}), json!({}))),
    )
    .await;
    p.req("DELETE", &format!("{CMS}/w1"), None).await;
    p.req(
        "POST",
        CMS,
        Some(cm("zz-sentinel", json!({"watched": "yes"}), json!({}))),
    )
    .await;
    p.read_watch("sel", "zz-sentinel").await;
    p.read_watch("all", "zz-sentinel").await;
    p.watch("initial", &format!("{CMS}?watch=true&sendInitialEvents=true&resourceVersionMatch=NotOlderThan&allowWatchBookmarks=true")).await;
    p.read_watch("initial", "zz-sentinel").await;
}

/// Namespaces: a missing one, a terminating one (without a controller manager it stays so).
async fn namespaces(p: &mut Pair) {
    p.req(
        "POST",
        "/api/v1/namespaces/{ns}-absent/configmaps",
        Some(cm("x", json!({}), json!({}))),
    )
    .await;
    p.req(
        "POST",
        "/api/v1/namespaces",
        Some(json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "{ns}-doomed"}})),
    )
    .await;
    p.req(
        "POST",
        "/api/v1/namespaces/{ns}-doomed/configmaps",
        Some(cm("x", json!({}), json!({}))),
    )
    .await;
    p.req("DELETE", "/api/v1/namespaces/{ns}-doomed", None)
        .await;
    p.req(
        "POST",
        "/api/v1/namespaces/{ns}-doomed/configmaps",
        Some(cm("y", json!({}), json!({}))),
    )
    .await;
    p.req("GET", "/api/v1/namespaces/{ns}-doomed/configmaps/x", None)
        .await;
    p.req(
        "POST",
        "/api/v1/namespaces",
        Some(json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "Not.A.Label"}})),
    )
    .await;
}

/// Kinds a controller writes besides its own: Leases, Events, Secrets.
async fn other_kinds(p: &mut Pair) {
    let lease = json!({
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": "leader"},
        "spec": {"holderIdentity": "a", "leaseDurationSeconds": 15}
    });
    p.req(
        "POST",
        "/apis/coordination.k8s.io/v1/namespaces/{ns}/leases",
        Some(lease),
    )
    .await;
    p.req_typed(
        "PATCH",
        "/apis/coordination.k8s.io/v1/namespaces/{ns}/leases/leader",
        Some("application/merge-patch+json"),
        Some(json!({"spec": {"holderIdentity": "b"}})),
    )
    .await;
    let event = json!({
        "apiVersion": "events.k8s.io/v1", "kind": "Event",
        "metadata": {"name": "e1"},
        "eventTime": "2026-01-01T00:00:00.000000Z",
        "reportingController": "example.com/ctl", "reportingInstance": "ctl-1",
        "action": "Reconcile", "reason": "Done", "type": "Normal", "note": "ok",
        "regarding": {"kind": "ConfigMap", "name": "a", "namespace": "{ns}", "apiVersion": "v1"}
    });
    p.req(
        "POST",
        "/apis/events.k8s.io/v1/namespaces/{ns}/events",
        Some(event),
    )
    .await;
    let secret = json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s"}, "stringData": {"password": "hunter2"}});
    p.req("POST", "/api/v1/namespaces/{ns}/secrets", Some(secret))
        .await;
    p.req(
        "GET",
        "/api/v1/namespaces/{ns}/secrets?fieldSelector=type%3DOpaque",
        None,
    )
    .await;
    p.req(
        "POST",
        &format!("{CMS}?dryRun=All"),
        Some(cm("dry", json!({}), json!({}))),
    )
    .await;
    p.req("GET", &format!("{CMS}/dry"), None).await;
}

#[tokio::test]
async fn the_fake_answers_every_request_of_the_corpus_as_the_real_api_server_does() {
    let env = TestEnv::builder()
        .clusters(1)
        .name_prefix("diff")
        .start()
        .await
        .expect("a test control plane");
    let cluster = env.cluster(0).expect("one cluster");
    for c in [crd(), plain_crd()] {
        cluster
            .install_crds(&c.to_string())
            .await
            .expect("the CRD installs");
    }
    let real = cluster.client().expect("a client");
    let fake = ApiServer::builder("fake")
        .controllers(false)
        .crd(serde_json::from_value(crd()).expect("a CRD"))
        .crd(serde_json::from_value(plain_crd()).expect("a CRD"))
        .build();

    let mut differences = Vec::new();
    let mut compared = 0;
    macro_rules! run {
        ($($scenario:ident),* $(,)?) => {$(
            let mut p = Pair::new(stringify!($scenario).replace('_', "-").as_str(), real.clone(), fake.client());
            p.req("POST", "/api/v1/namespaces", Some(json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "{ns}"}}))).await;
            $scenario(&mut p).await;
            compared += p.len();
            p.show();
            if let Some(d) = p.difference() {
                differences.push(d);
            }
        )*};
    }
    run!(
        create_get_update,
        patches,
        lists,
        deletion,
        status_and_generation,
        server_side_apply,
        watches,
        namespaces,
        other_kinds
    );
    eprintln!("compared {compared} requests and watch events in 9 sequences");
    assert!(
        differences.is_empty(),
        "{} sequence(s) differ:\n{}",
        differences.len(),
        differences.join("\n")
    );
}
