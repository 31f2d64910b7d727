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
