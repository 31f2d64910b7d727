//! Ownership across clusters against real control planes: the native owner reference check
//! of every cluster client, `Context::own` with `Builder::owns_in_fleet`, and the fleet
//! garbage collector (background, foreground, a departure for good, an unreachable owner).

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube_runtime::watcher;
use multicluster_runtime::ownership::{
    FLEET_FINALIZER, FleetGc, FleetOwner, OWNER_ANNOTATION, OwnerReferenceRefused,
};
use multicluster_runtime::providers::Clusters;
use multicluster_runtime::{Action, Builder, Cluster, ClusterName, Context, Manager};
use multicluster_runtime_testenv::TestEnv;

const NS: &str = "fleet-own";

fn config_map(name: &str, labels: &[(&str, &str)], data: &[(&str, &str)]) -> ConfigMap {
    let mut cm = audited::labelled_cm(name, labels);
    cm.metadata.namespace = Some(NS.into());
    cm.data = Some(
        data.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
    );
    cm
}

fn native_reference(owner: &ConfigMap) -> OwnerReference {
    OwnerReference {
        api_version: "v1".into(),
        kind: "ConfigMap".into(),
        name: owner.metadata.name.clone().unwrap(),
        uid: owner.metadata.uid.clone().unwrap(),
        ..Default::default()
    }
}

/// The refusal inside a client's error, if it is one.
fn refusal(error: &kube::Error) -> Option<&OwnerReferenceRefused> {
    match error {
        kube::Error::Service(inner) => inner.downcast_ref::<OwnerReferenceRefused>(),
        _ => None,
    }
}

async fn get(client: &kube::Client, name: &str) -> Option<ConfigMap> {
    Api::<ConfigMap>::namespaced(client.clone(), NS)
        .get_opt(name)
        .await
        .unwrap()
}

#[tokio::test]
async fn a_native_owner_reference_to_another_clusters_object_is_refused_before_it_is_sent() {
    let env = TestEnv::builder().clusters(2).start().await.unwrap();
    let (a, b) = (
        env.cluster(0).unwrap().client().unwrap(),
        env.cluster(1).unwrap().client().unwrap(),
    );
    for client in [&a, &b] {
        create_namespace(client, NS).await;
    }
    create_namespace(&a, "fleet-own-other").await;
    let hub = Api::<ConfigMap>::namespaced(a.clone(), NS)
        .create(
            &PostParams::default(),
            &config_map("source", &[("role", "source")], &[]),
        )
        .await
        .unwrap();
    let clusters = clusters_of([("guard-a", a.clone()), ("guard-b", b.clone())]);
    let manager = Arc::new(Manager::new(clusters));
    // The trap: a reconcile of a's object writes a child into b with a native reference
    // to it. Each attempt's error is kept.
    let errors = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let refusals = Arc::new(std::sync::Mutex::new(Vec::<OwnerReferenceRefused>::new()));
    let (seen_errors, seen_refusals) = (errors.clone(), refusals.clone());
    Builder::<_, ConfigMap>::new(&manager, watcher::Config::default().labels("role=source")).start(
        move |source: Arc<ConfigMap>, ctx: Context<ClusterName, ()>| {
            let (errors, refusals) = (seen_errors.clone(), seen_refusals.clone());
            async move {
                let mut child = config_map("child", &[], &[]);
                child.metadata.owner_references = Some(vec![native_reference(&source)]);
                // The same child in the owner's own cluster is fine.
                Api::<ConfigMap>::namespaced(ctx.client(), NS)
                    .patch(
                        "child",
                        &PatchParams::apply("guard-test").force(),
                        &Patch::Apply(&child),
                    )
                    .await?;
                // The same child in another namespace of the owner's cluster: its collector
                // looks for the owner in the child's namespace, and does not find it there.
                let mut elsewhere = child.clone();
                elsewhere.metadata.namespace = Some("fleet-own-other".into());
                if let Err(error) = Api::<ConfigMap>::namespaced(ctx.client(), "fleet-own-other")
                    .patch(
                        "child",
                        &PatchParams::apply("guard-test").force(),
                        &Patch::Apply(&elsewhere),
                    )
                    .await
                {
                    errors.lock().unwrap().push(error.to_string());
                }
                let Some(member) = ctx.cluster_by_id(&name("guard-b")) else {
                    return Ok(Action::requeue(Duration::from_millis(200)));
                };
                let sent = Api::<ConfigMap>::namespaced(member.client(), NS)
                    .patch(
                        "child",
                        &PatchParams::apply("guard-test").force(),
                        &Patch::Apply(&child),
                    )
                    .await;
                if let Err(error) = &sent {
                    errors.lock().unwrap().push(error.to_string());
                    refusals.lock().unwrap().extend(refusal(error).cloned());
                }
                Ok::<_, kube::Error>(Action::await_change())
            }
        },
        |_, _, _| Action::requeue(Duration::from_secs(1)),
        Arc::new(()),
    );
    let run = spawn_manager(&manager);
    eventually(
        60,
        "the reconcile's write into guard-b refused",
        async || !refusals.lock().unwrap().is_empty(),
    )
    .await;
    let refused = refusals.lock().unwrap()[0].clone();
    assert_eq!(refused.cluster, "guard-b");
    assert_eq!(refused.holder.as_deref(), Some("guard-a"));
    assert_eq!(refused.owner, format!("{NS}/source"));
    assert_eq!(refused.uid, hub.metadata.uid.clone().unwrap());
    let message = errors
        .lock()
        .unwrap()
        .iter()
        .find(|e| e.contains("cluster guard-b:"))
        .unwrap()
        .clone();
    assert!(
        message.contains("cluster guard-b")
            && message.contains("cluster guard-a")
            && message.contains("Context::own"),
        "{message}"
    );
    // The other namespace's write was refused too, saying why.
    assert!(
        errors
            .lock()
            .unwrap()
            .iter()
            .any(|e| e.contains("another namespace of cluster guard-a")),
        "{:?}",
        errors.lock().unwrap()
    );
    assert!(
        Api::<ConfigMap>::namespaced(a.clone(), "fleet-own-other")
            .get_opt("child")
            .await
            .unwrap()
            .is_none()
    );
    // Never sent: the child is in a (same cluster, allowed) and not in b.
    assert!(get(&a, "child").await.is_some());
    assert!(get(&b, "child").await.is_none());

    // Outside a reconcile, through b's fleet client: a uid b does not hold (checked by
    // reading it back) is refused, naming no holder...
    let b_cluster = manager.fleet().get(&name("guard-b")).unwrap();
    let mut stray = config_map("stray", &[], &[]);
    stray.metadata.owner_references = Some(vec![OwnerReference {
        uid: "00000000-0000-4000-8000-00000000dead".into(),
        ..native_reference(&hub)
    }]);
    let error = Api::<ConfigMap>::namespaced(b_cluster.client(), NS)
        .create(&PostParams::default(), &stray)
        .await
        .unwrap_err();
    let refused = refusal(&error).unwrap_or_else(|| panic!("not a refusal: {error}"));
    assert_eq!(refused.holder, None);
    assert!(
        error
            .to_string()
            .contains("cluster guard-b holds no object of that uid"),
        "{error}"
    );
    // ...and one b does hold (an object of b never reconciled) is read back and let through.
    let local_owner = Api::<ConfigMap>::namespaced(b.clone(), NS)
        .create(&PostParams::default(), &config_map("local-owner", &[], &[]))
        .await
        .unwrap();
    let mut local_child = config_map("local-child", &[], &[]);
    local_child.metadata.owner_references = Some(vec![native_reference(&local_owner)]);
    Api::<ConfigMap>::namespaced(b_cluster.client(), NS)
        .create(&PostParams::default(), &local_child)
        .await
        .unwrap();
    // A JSON patch adding the foreign reference is refused too.
    let patch: json_patch::Patch = serde_json::from_value(serde_json::json!([
        {"op": "add", "path": "/metadata/ownerReferences", "value": [native_reference(&hub)]}
    ]))
    .unwrap();
    let error = Api::<ConfigMap>::namespaced(b_cluster.client(), NS)
        .patch(
            "local-child",
            &PatchParams::default(),
            &Patch::<()>::Json(patch),
        )
        .await
        .unwrap_err();
    assert!(refusal(&error).is_some(), "{error}");
    assert_eq!(
        get(&b, "local-child")
            .await
            .unwrap()
            .metadata
            .owner_references
            .unwrap()[0]
            .uid,
        local_owner.metadata.uid.clone().unwrap()
    );
    // With the check turned off, the write goes as it is.
    let unchecked =
        Cluster::new(name("guard-b-unchecked"), b.clone()).with_owner_reference_check(false);
    Api::<ConfigMap>::namespaced(unchecked.client(), NS)
        .create(&PostParams::default(), &stray)
        .await
        .unwrap();
    assert!(get(&b, "stray").await.is_some());

    manager.shutdown();
    run.await.unwrap();
}

/// Copies each hub source into every other engaged cluster, owned by the source.
async fn copy(
    source: Arc<ConfigMap>,
    ctx: Context<ClusterName, ()>,
) -> Result<Action, kube::Error> {
    // An owner being deleted gets no new children.
    if source.metadata.deletion_timestamp.is_some() {
        return Ok(Action::await_change());
    }
    let name = source.metadata.name.clone().unwrap();
    let mut child = config_map(&name, &[("role", "copy")], &[]);
    child.data = source.data.clone();
    ctx.own(&mut child, source.as_ref())
        .expect("the source was read from its cluster");
    for member in ctx.fleet().clusters() {
        if member.id() == ctx.cluster_id() {
            continue;
        }
        Api::<ConfigMap>::namespaced(member.client(), NS)
            .patch(
                &name,
                &PatchParams::apply("fleet-copier").force(),
                &Patch::Apply(&child),
            )
            .await?;
    }
    Ok(Action::await_change())
}

/// A hub and two members, with the copier on the hub's sources and a namespace in each.
async fn copier_fleet(
    env: &TestEnv,
    prefix: &str,
    gc: FleetGc,
) -> (
    Arc<Manager<Clusters<ClusterName>>>,
    Vec<kube::Client>,
    Vec<String>,
) {
    let clients: Vec<_> = env.clusters().iter().map(|c| c.client().unwrap()).collect();
    for client in &clients {
        create_namespace(client, NS).await;
    }
    let names: Vec<String> = ["hub", "b", "c"]
        .iter()
        .map(|n| format!("{prefix}-{n}"))
        .collect();
    let clusters = clusters_of(names.iter().cloned().zip(clients.iter().cloned()));
    let manager = Arc::new(Manager::new(clusters));
    Builder::<_, ConfigMap>::new(&manager, watcher::Config::default().labels("role=source"))
        .owns_in_fleet::<ConfigMap>(watcher::Config::default().labels("role=copy"), gc)
        .start(
            copy,
            |_, _, _| Action::requeue(Duration::from_secs(1)),
            Arc::new(()),
        );
    (manager, clients, names)
}

async fn copies_are(members: &[kube::Client], name: &str, value: Option<&str>) -> bool {
    for member in members {
        let copy = get(member, name).await;
        let found = copy.as_ref().map(|c| {
            c.data
                .clone()
                .unwrap_or_default()
                .get("v")
                .cloned()
                .unwrap_or_default()
        });
        if found.as_deref() != value {
            return false;
        }
    }
    true
}

/// Creates the hub source `name` (`v=1`) and waits for its copies in `members`.
async fn source_copied(
    sources: &Api<ConfigMap>,
    members: &[kube::Client],
    name: &str,
) -> ConfigMap {
    let source = sources
        .create(
            &PostParams::default(),
            &config_map(name, &[("role", "source")], &[("v", "1")]),
        )
        .await
        .unwrap();
    eventually(
        60,
        &format!("copies of {name} in both members"),
        async || copies_are(members, name, Some("1")).await,
    )
    .await;
    source
}

#[tokio::test]
async fn children_in_two_members_follow_their_hub_owner_and_go_with_it_or_its_cluster() {
    let env = TestEnv::builder().clusters(3).start().await.unwrap();
    let (manager, clients, names) = copier_fleet(&env, "bg", FleetGc::Background).await;
    let (hub, members) = (clients[0].clone(), clients[1..].to_vec());
    let run = spawn_manager(&manager);
    let sources = Api::<ConfigMap>::namespaced(hub.clone(), NS);
    let source = source_copied(&sources, &members, "s1").await;
    // Each copy records its owner; no native reference, no finalizer in background mode.
    let copy = get(&members[0], "s1").await.unwrap();
    let owner = FleetOwner::<ClusterName>::of_child(&copy).unwrap().unwrap();
    assert_eq!(owner.cluster, name(&names[0]));
    assert_eq!(owner.uid, source.metadata.uid.clone().unwrap());
    assert!(copy.metadata.owner_references.is_none());
    assert!(
        copy.metadata
            .annotations
            .unwrap()
            .contains_key(OWNER_ANNOTATION)
    );

    // The owner's update reaches the copies.
    sources
        .patch(
            "s1",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"data": {"v": "2"}})),
        )
        .await
        .unwrap();
    eventually(60, "copies of s1 updated", async || {
        copies_are(&members, "s1", Some("2")).await
    })
    .await;
    // A copy deleted in a member is a change of a child: its owner in the hub is reconciled
    // and puts it back.
    let deleted = get(&members[1], "s1").await.unwrap().metadata.uid.unwrap();
    Api::<ConfigMap>::namespaced(members[1].clone(), NS)
        .delete("s1", &DeleteParams::default())
        .await
        .unwrap();
    eventually(60, "the deleted copy put back", async || {
        get(&members[1], "s1")
            .await
            .is_some_and(|c| c.metadata.uid.as_deref() != Some(&deleted))
    })
    .await;

    // The owner deleted: its children go, in both members.
    sources
        .delete("s1", &DeleteParams::default())
        .await
        .unwrap();
    eventually(60, "copies of s1 collected", async || {
        copies_are(&members, "s1", None).await
    })
    .await;

    // An object that is not a copy, and a copy whose owner record is unreadable, stay.
    let bystander = config_map("bystander", &[("role", "copy")], &[("v", "x")]);
    Api::<ConfigMap>::namespaced(members[0].clone(), NS)
        .create(&PostParams::default(), &bystander)
        .await
        .unwrap();

    // The owner's cluster leaving for good takes its children with it.
    source_copied(&sources, &members, "s2").await;
    assert!(manager.provider().remove(&name(&names[0])));
    eventually(
        60,
        "copies of s2 collected after the hub left",
        async || copies_are(&members, "s2", None).await,
    )
    .await;
    assert!(get(&members[0], "bystander").await.is_some());
    // The owner itself is untouched in its cluster.
    assert!(get(&hub, "s2").await.is_some());

    manager.shutdown();
    run.await.unwrap();
}

#[tokio::test]
async fn the_foreground_holds_the_owner_until_its_children_are_gone_and_an_unreachable_owner_loses_none()
 {
    let logs = Logs::capture();
    let env = TestEnv::builder().clusters(3).start().await.unwrap();
    let (manager, clients, names) = copier_fleet(&env, "fg", FleetGc::Foreground).await;
    let (hub, members) = (clients[0].clone(), clients[1..].to_vec());
    let run = spawn_manager(&manager);
    let sources = Api::<ConfigMap>::namespaced(hub.clone(), NS);
    let source = source_copied(&sources, &members, "s3").await;
    eventually(60, "s3 held by the fleet finalizer", async || {
        get(&hub, "s3").await.is_some_and(|s| {
            s.metadata
                .finalizers
                .unwrap_or_default()
                .iter()
                .any(|f| f == FLEET_FINALIZER)
        })
    })
    .await;

    // The hub's API server killed: the owner cannot be read. A child added meanwhile makes
    // the collector check the owner; the check fails, and nothing is deleted.
    let hub_plane = env.cluster(0).unwrap();
    hub_plane.kill().await;
    let mut extra = config_map("s3-extra", &[("role", "copy")], &[("v", "1")]);
    FleetOwner::<ClusterName>::of(&name(&names[0]), &source)
        .unwrap()
        .record(&mut extra);
    Api::<ConfigMap>::namespaced(members[0].clone(), NS)
        .create(&PostParams::default(), &extra)
        .await
        .unwrap();
    eventually(60, "the collector's check of s3 failing", async || {
        !logs
            .lines(&[
                "fleet collector keeps the owner's children",
                "owner=s3",
                &names[0],
            ])
            .is_empty()
    })
    .await;
    assert!(copies_are(&members, "s3", Some("1")).await);
    assert!(get(&members[0], "s3-extra").await.is_some());

    // Back up: the owner is there, so its children stay (the retry reads it present);
    // deleting it now deletes them all first, then lets the owner go.
    hub_plane.start().await.unwrap();
    let hub = hub_plane.client().unwrap();
    let sources = Api::<ConfigMap>::namespaced(hub.clone(), NS);
    sources
        .delete("s3", &DeleteParams::default())
        .await
        .unwrap();
    // Children first: whenever the owner is read gone, its children are gone already.
    eventually(60, "s3 let go", async || {
        if get(&hub, "s3").await.is_some() {
            return false;
        }
        assert!(
            copies_are(&members, "s3", None).await && get(&members[0], "s3-extra").await.is_none(),
            "s3 was let go before its children were deleted"
        );
        true
    })
    .await;

    manager.shutdown();
    run.await.unwrap();
}
