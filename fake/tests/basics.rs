//! The fake server through kube's own client: each verb as a controller uses it.

use std::time::Duration;

use futures::{StreamExt as _, TryStreamExt as _};
use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use multicluster_runtime_fake::{ApiServer, Fault, Verb};

fn cm(name: &str) -> ConfigMap {
    let mut cm = ConfigMap::default();
    cm.metadata.name = Some(name.to_owned());
    cm.data = Some([("a".to_owned(), "1".to_owned())].into());
    cm
}

#[tokio::test]
async fn an_update_with_a_stale_version_is_refused_with_409() {
    let server = ApiServer::new("c0");
    let cms: Api<ConfigMap> = Api::default_namespaced(server.client());
    let first = cms.create(&PostParams::default(), &cm("x")).await.unwrap();
    let mut changed = first.clone();
    changed.data = Some([("a".to_owned(), "2".to_owned())].into());
    cms.replace("x", &PostParams::default(), &changed)
        .await
        .unwrap();
    let err = cms
        .replace("x", &PostParams::default(), &changed)
        .await
        .unwrap_err();
    match err {
        kube::Error::Api(s) => {
            assert_eq!(s.code, 409);
            assert_eq!(s.reason, "Conflict");
        }
        other => panic!("expected 409, got {other:?}"),
    }
}

#[tokio::test]
async fn a_watcher_sees_writes_in_order_and_relists_after_410() {
    let server = ApiServer::new("c0");
    let cms: Api<ConfigMap> = Api::default_namespaced(server.client());
    cms.create(&PostParams::default(), &cm("a")).await.unwrap();
    let mut events = watcher(cms.clone(), watcher::Config::default()).boxed();
    let mut seen = Vec::new();
    // Init, InitApply(a), InitDone
    while let Some(e) = events.try_next().await.unwrap() {
        let done = matches!(e, watcher::Event::InitDone);
        seen.push(
            format!("{e:?}")
                .split('(')
                .next()
                .unwrap_or_default()
                .to_owned(),
        );
        if done {
            break;
        }
    }
    assert_eq!(seen, ["Init", "InitApply", "InitDone"]);
    cms.create(&PostParams::default(), &cm("b")).await.unwrap();
    match events.try_next().await.unwrap() {
        Some(watcher::Event::Apply(o)) => assert_eq!(o.metadata.name.as_deref(), Some("b")),
        other => panic!("expected b applied, got {other:?}"),
    }
    server.expire_watches();
    cms.create(&PostParams::default(), &cm("c")).await.unwrap();
    // After the cut the watcher resumes from its version, gets 410 and lists again.
    let mut relisted = Vec::new();
    let mut gone = false;
    loop {
        match tokio::time::timeout(Duration::from_secs(10), events.next())
            .await
            .unwrap()
        {
            Some(Ok(watcher::Event::InitApply(o))) => {
                relisted.push(o.metadata.name.unwrap_or_default())
            }
            Some(Ok(watcher::Event::InitDone)) => break,
            Some(Err(watcher::Error::WatchError(e))) => gone |= e.code == 410,
            Some(_) => {}
            None => panic!("the watcher ended"),
        }
    }
    assert!(gone, "the resumed watch should have been told 410 Gone");
    assert_eq!(relisted, ["a", "b", "c"]);
}

#[tokio::test]
async fn a_finalizer_holds_a_deleted_object_until_it_is_removed() {
    let server = ApiServer::new("c0");
    let cms: Api<ConfigMap> = Api::default_namespaced(server.client());
    let mut held = cm("held");
    held.metadata.finalizers = Some(vec!["example.com/keep".into()]);
    cms.create(&PostParams::default(), &held).await.unwrap();
    cms.delete("held", &DeleteParams::default()).await.unwrap();
    let marked = cms.get("held").await.unwrap();
    assert!(marked.metadata.deletion_timestamp.is_some());
    let patch = serde_json::json!({"metadata": {"finalizers": null}});
    cms.patch("held", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
    assert!(cms.get_opt("held").await.unwrap().is_none());
}

#[tokio::test]
async fn deleting_a_namespace_removes_what_it_holds() {
    let server = ApiServer::builder("c0").namespace("team").build();
    let cms: Api<ConfigMap> = Api::namespaced(server.client(), "team");
    cms.create(&PostParams::default(), &cm("x")).await.unwrap();
    let nss: Api<Namespace> = Api::all(server.client());
    nss.delete("team", &DeleteParams::default()).await.unwrap();
    assert!(nss.get_opt("team").await.unwrap().is_none());
    assert!(
        cms.list(&ListParams::default())
            .await
            .unwrap()
            .items
            .is_empty()
    );
}

#[tokio::test]
async fn a_fault_answers_its_status_the_given_number_of_times() {
    let server = ApiServer::new("c0");
    let cms: Api<ConfigMap> = Api::default_namespaced(server.client());
    server.inject(Fault::on(Verb::Create).status(429).times(1));
    let e = cms
        .create(&PostParams::default(), &cm("x"))
        .await
        .unwrap_err();
    assert!(
        matches!(e, kube::Error::Api(ref s) if s.code == 429),
        "{e:?}"
    );
    cms.create(&PostParams::default(), &cm("x")).await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_server_that_stops_answering_holds_requests_until_healed() {
    let server = ApiServer::new("c0");
    let cms: Api<ConfigMap> = Api::default_namespaced(server.client());
    server.stop_answering();
    let pending = tokio::spawn({
        let cms = cms.clone();
        async move { cms.create(&PostParams::default(), &cm("x")).await }
    });
    // Paused time moves only when every task waits: the request had every chance to finish.
    tokio::time::sleep(Duration::from_secs(30)).await;
    assert!(!pending.is_finished());
    server.heal();
    pending.await.unwrap().unwrap();
}

fn owned_by(name: &str, owner: &ConfigMap) -> ConfigMap {
    let mut child = cm(name);
    child.metadata.owner_references = Some(vec![
        k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference {
            api_version: "v1".into(),
            kind: "ConfigMap".into(),
            name: owner.metadata.name.clone().unwrap_or_default(),
            uid: owner.metadata.uid.clone().unwrap_or_default(),
            block_owner_deletion: Some(true),
            controller: Some(true),
        },
    ]);
    child
}

#[tokio::test]
async fn deleting_an_owner_collects_its_dependents_in_the_background_and_in_the_foreground() {
    let server = ApiServer::new("c0");
    let cms: Api<ConfigMap> = Api::default_namespaced(server.client());
    for (owner, policy) in [
        ("bg", DeleteParams::background()),
        ("fg", DeleteParams::foreground()),
    ] {
        let o = cms
            .create(&PostParams::default(), &cm(owner))
            .await
            .unwrap();
        let child = format!("{owner}-child");
        cms.create(&PostParams::default(), &owned_by(&child, &o))
            .await
            .unwrap();
        cms.delete(owner, &policy).await.unwrap();
        assert!(
            cms.get_opt(owner).await.unwrap().is_none(),
            "{owner} should be gone"
        );
        assert!(
            cms.get_opt(&child).await.unwrap().is_none(),
            "{child} should be collected"
        );
    }
}

#[tokio::test]
async fn an_orphaning_delete_leaves_the_dependent_without_its_owner_reference() {
    let server = ApiServer::new("c0");
    let cms: Api<ConfigMap> = Api::default_namespaced(server.client());
    let o = cms
        .create(&PostParams::default(), &cm("owner"))
        .await
        .unwrap();
    cms.create(&PostParams::default(), &owned_by("child", &o))
        .await
        .unwrap();
    cms.delete("owner", &DeleteParams::orphan()).await.unwrap();
    assert!(cms.get_opt("owner").await.unwrap().is_none());
    let child = cms.get("child").await.unwrap();
    assert!(child.metadata.owner_references.is_none(), "{child:?}");
}

#[tokio::test]
async fn a_dependent_whose_owner_uid_the_cluster_does_not_hold_is_collected() {
    // The cross-cluster ownerReference trap: an owner uid from another cluster.
    let server = ApiServer::new("c0");
    let cms: Api<ConfigMap> = Api::default_namespaced(server.client());
    let mut elsewhere = cm("owner-in-another-cluster");
    elsewhere.metadata.uid = Some("00000000-0000-4000-8000-000000000001".into());
    cms.create(&PostParams::default(), &owned_by("child", &elsewhere))
        .await
        .unwrap();
    assert!(cms.get_opt("child").await.unwrap().is_none());
}

#[tokio::test]
async fn kubes_discovery_finds_the_served_kinds_and_a_crd_created_at_run_time() {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
    let server = ApiServer::new("c0");
    let discovery = kube::Discovery::new(server.client()).run().await.unwrap();
    assert!(discovery.has_group("apps"));
    let crd: CustomResourceDefinition = serde_json::from_value(serde_json::json!({
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": "widgets.example.com"},
        "spec": {"group": "example.com", "scope": "Namespaced",
                 "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
                 "versions": [{"name": "v1", "served": true, "storage": true,
                               "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}}}]}
    }))
    .unwrap();
    Api::<CustomResourceDefinition>::all(server.client())
        .create(&PostParams::default(), &crd)
        .await
        .unwrap();
    let established = Api::<CustomResourceDefinition>::all(server.client())
        .get("widgets.example.com")
        .await
        .unwrap();
    let conditions = established
        .status
        .and_then(|s| s.conditions)
        .unwrap_or_default();
    assert!(
        conditions
            .iter()
            .any(|c| c.type_ == "Established" && c.status == "True"),
        "{conditions:?}"
    );
    let discovery = kube::Discovery::new(server.client())
        .run_aggregated()
        .await
        .unwrap();
    let (resource, _) = discovery
        .resolve_gvk(&kube::api::GroupVersionKind::gvk(
            "example.com",
            "v1",
            "Widget",
        ))
        .expect("the new kind is discovered");
    assert_eq!(resource.plural, "widgets");
}

#[tokio::test(start_paused = true)]
async fn latency_delays_every_answer_by_the_time_set() {
    let server = ApiServer::new("c0");
    let cms: Api<ConfigMap> = Api::default_namespaced(server.client());
    server.set_latency(Duration::from_secs(3));
    let start = tokio::time::Instant::now();
    cms.list(&ListParams::default()).await.unwrap();
    assert!(
        start.elapsed() >= Duration::from_secs(3),
        "{:?}",
        start.elapsed()
    );
}

#[tokio::test]
async fn a_cut_watch_ends_and_a_watcher_resumes_without_losing_a_write() {
    let server = ApiServer::new("c0");
    let cms: Api<ConfigMap> = Api::default_namespaced(server.client());
    let mut events = watcher(cms.clone(), watcher::Config::default()).boxed();
    while !matches!(
        events.try_next().await.unwrap(),
        Some(watcher::Event::InitDone)
    ) {}
    server.cut_watches();
    cms.create(&PostParams::default(), &cm("after-the-cut"))
        .await
        .unwrap();
    loop {
        match tokio::time::timeout(Duration::from_secs(10), events.next())
            .await
            .unwrap()
        {
            Some(Ok(watcher::Event::Apply(o))) => {
                assert_eq!(o.metadata.name.as_deref(), Some("after-the-cut"));
                break;
            }
            Some(_) => {}
            None => panic!("the watcher ended"),
        }
    }
}

#[tokio::test]
async fn a_server_that_refuses_connections_fails_requests_at_once_until_healed() {
    let server = ApiServer::new("c0");
    let cms: Api<ConfigMap> = Api::default_namespaced(server.client());
    server.refuse_connections();
    let e = cms.list(&ListParams::default()).await.unwrap_err();
    assert!(
        !matches!(e, kube::Error::Api(_)),
        "a refused connection is no API answer: {e:?}"
    );
    server.heal();
    cms.list(&ListParams::default()).await.unwrap();
}

#[tokio::test]
async fn absurd_versions_tokens_and_timeouts_are_answered_never_a_panic() {
    use base64::Engine as _;
    let server = ApiServer::new("c0");
    let client = server.client();
    let max = u64::MAX;
    let token = base64::engine::general_purpose::URL_SAFE.encode(format!(
        r#"{{"v":"meta.k8s.io/v1","rv":{max},"start":"a\u0000"}}"#
    ));
    for query in [
        format!("watch=true&resourceVersion={max}"),
        format!("resourceVersion={max}&resourceVersionMatch=Exact"),
        format!("limit=1&continue={token}"),
        format!("watch=true&timeoutSeconds={max}"),
        "labelSelector=a%+1".to_owned(),
    ] {
        let req = http::Request::get(format!("/api/v1/namespaces/default/configmaps?{query}"))
            .body(kube::client::Body::empty())
            .unwrap();
        let answer = tokio::time::timeout(Duration::from_secs(5), client.send(req)).await;
        // Answered (a watch: its head came), with a status, not a failure of the server.
        let res = answer.expect("an answer").expect("no transport error");
        assert_ne!(res.status().as_u16(), 500, "{query}");
    }
}

#[tokio::test]
async fn a_fault_for_zero_requests_takes_none() {
    let server = ApiServer::new("c0");
    let cms: Api<ConfigMap> = Api::default_namespaced(server.client());
    server.inject(Fault::on(Verb::Create).status(500).times(0));
    cms.create(&PostParams::default(), &cm("x")).await.unwrap();
}

#[tokio::test]
async fn objects_put_in_place_by_the_test_keep_their_uids_so_owner_references_among_them_hold() {
    let mut owner = cm("owner");
    owner.metadata.namespace = Some("default".into());
    owner.metadata.uid = Some("00000000-0000-4000-8000-00000000000a".into());
    let mut child = owned_by("child", &owner);
    child.metadata.namespace = Some("default".into());
    let server = ApiServer::builder("c0")
        .object(&owner)
        .object(&child)
        .build();
    let cms: Api<ConfigMap> = Api::default_namespaced(server.client());
    assert_eq!(
        cms.get("owner").await.unwrap().metadata.uid,
        owner.metadata.uid
    );
    assert!(
        cms.get_opt("child").await.unwrap().is_some(),
        "the child's owner is there: no collection"
    );
}
