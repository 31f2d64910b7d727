//! The namespace provider against a real control plane: namespaces as clusters, the scoped
//! client, one host watch per kind, patch / events / finalizers, namespace deletion and a
//! host restart.

mod common;

use std::sync::Arc;

use common::*;
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SelfSubjectAccessReview, SelfSubjectAccessReviewSpec,
};
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Node};
use k8s_openapi::api::rbac::v1::ClusterRole;
use kube::api::{Api, DeleteParams, ListParams, ObjectMeta, Patch, PatchParams, PostParams};
use kube::{Resource, ResourceExt};
use kube_runtime::events::{Event, EventType, Recorder, Reporter};
use kube_runtime::finalizer::{Event as Finalizer, finalizer};
use kube_runtime::reflector::ObjectRef;
use multicluster_runtime::providers::{ClusterScopedWrite, Namespaces, UnscopableRequest};
use multicluster_runtime::{Action, Builder, ClusterName, Context, Manager};
use multicluster_runtime_testenv::TestEnv;

async fn create(client: &kube::Client, cm: ConfigMap) {
    let ns = cm.namespace().unwrap();
    Api::<ConfigMap>::namespaced(client.clone(), &ns)
        .create(&PostParams::default(), &cm)
        .await
        .unwrap();
}

/// The "kubernetes" finalizer's work, which kube-controller-manager's namespace controller
/// does in a real cluster (testenv runs no controller manager): once the namespace's objects
/// are gone, drop the finalizer so the namespace is removed.
async fn finish_namespace_deletion(client: &kube::Client, ns: &str) {
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let mut namespace = namespaces.get(ns).await.unwrap();
    namespace.spec.get_or_insert_default().finalizers = Some(Vec::new());
    namespaces
        .replace_subresource("finalize", ns, &PostParams::default(), &namespace)
        .await
        .unwrap();
}

fn scoped_error(error: &kube::Error) -> Option<&ClusterScopedWrite> {
    match error {
        kube::Error::Service(e) => e.downcast_ref::<ClusterScopedWrite>(),
        _ => None,
    }
}

#[tokio::test]
async fn every_namespace_is_a_cluster_fed_by_one_watch_per_kind() {
    let env = TestEnv::start().await.unwrap();
    let tc = env.cluster(0).unwrap();
    let host = tc.client().unwrap();
    fixture(&host).await;

    // The API server's own informers watch some kinds too: count from here on.
    let configmap_watches = tc.served_watches("configmaps", true).await.unwrap();
    let namespaced_configmap_watches = tc.served_watches("configmaps", false).await.unwrap();
    let namespace_watches = tc.served_watches("namespaces", true).await.unwrap();

    let provider = Namespaces::new(host.clone());
    let manager = Arc::new(Manager::new(provider.clone()));
    manager.index_field::<ConfigMap>("type", label_type);
    let seen = Arc::new(Seen::default());
    Builder::<_, ConfigMap>::new(&manager, fixture_objects()).start(
        feed_animals,
        retry_soon,
        seen.clone(),
    );
    let run = spawn_manager(&manager);

    for ns in NAMESPACES {
        eventually(30, &format!("the animal of {ns} fed"), async || {
            is_fed(&host, ns, "elephant").await
        })
        .await;
        assert!(seen.count(&format!("cluster://{ns}/{ns}/elephant")) >= 1);
    }
    // Sync point: the keeper's and the rock's reconciles ran; they fed nobody.
    for ns in NAMESPACES {
        for other in ["keeper", "rock"] {
            let request = format!("cluster://{ns}/{ns}/{other}");
            eventually(30, &format!("{request} reconciled"), async || {
                seen.count(&request) >= 1
            })
            .await;
        }
        assert!(!is_fed(&host, ns, "keeper").await && !is_fed(&host, ns, "rock").await);
    }
    // Each cluster sees its own namespace only.
    let zoo = manager.cluster(&name("zoo")).unwrap();
    let zoo_cache = zoo.cache::<ConfigMap>(&fixture_objects()).await.unwrap();
    let in_zoo = zoo_cache.store().state();
    assert_eq!(in_zoo.len(), 3);
    assert!(
        in_zoo
            .iter()
            .all(|cm| cm.namespace().as_deref() == Some("zoo"))
    );
    assert_eq!(zoo_cache.indexed("type", "animal").unwrap().len(), 1);
    // The API server's own namespaces are clusters too.
    assert!(manager.cluster(&name("default")).is_some());

    // A namespace created while the controller runs, and an object changed after
    // engagement.
    create_namespace(&host, "savanna").await;
    create(&host, config_map("savanna", "lion", "animal")).await;
    eventually(30, "the lion in the new namespace fed", async || {
        is_fed(&host, "savanna", "lion").await
    })
    .await;
    assert!(seen.count("cluster://savanna/savanna/lion") >= 1);
    let relabel = serde_json::json!({ "metadata": { "labels": { "type": "animal" } } });
    Api::<ConfigMap>::namespaced(host.clone(), "jungle")
        .patch("keeper", &PatchParams::default(), &Patch::Merge(&relabel))
        .await
        .unwrap();
    eventually(30, "the relabelled keeper fed", async || {
        is_fed(&host, "jungle", "keeper").await
    })
    .await;

    // Many namespaces, one watch of ConfigMaps across the host.
    for i in 0..40 {
        let ns = format!("pen-{i}");
        create_namespace(&host, &ns).await;
        create(&host, config_map(&ns, "goat", "animal")).await;
    }
    for i in 0..40 {
        let ns = format!("pen-{i}");
        eventually(60, &format!("the goat in {ns} fed"), async || {
            is_fed(&host, &ns, "goat").await
        })
        .await;
    }
    assert!(manager.fleet().len() >= 44);
    assert_eq!(provider.host_watches(), 1, "one watch per (kind, selector)");
    assert_eq!(
        tc.served_watches("configmaps", true).await.unwrap(),
        configmap_watches + 1
    );
    assert_eq!(
        tc.served_watches("configmaps", false).await.unwrap(),
        namespaced_configmap_watches,
        "no watch per namespace"
    );
    assert_eq!(
        tc.served_watches("namespaces", true).await.unwrap(),
        namespace_watches + 1,
        "and one for the namespaces themselves"
    );

    manager.shutdown();
    run.await.unwrap();
}

#[tokio::test]
async fn a_namespace_cluster_client_stays_in_its_namespace() {
    let env = TestEnv::start().await.unwrap();
    let host = env.cluster(0).unwrap().client().unwrap();
    fixture(&host).await;
    let manager = Arc::new(Manager::new(Namespaces::new(host.clone())));
    let run = spawn_manager(&manager);
    let fleet = manager.fleet().clone();
    eventually(30, "zoo engaged", async || {
        fleet.get(&name("zoo")).is_some()
    })
    .await;
    let zoo = manager.cluster(&name("zoo")).unwrap().client();
    assert_eq!(zoo.default_namespace(), "zoo");

    // A namespaced request goes to zoo, whatever namespace it names, in the path or the body.
    Api::<ConfigMap>::namespaced(zoo.clone(), "jungle")
        .create(
            &PostParams::default(),
            &config_map("jungle", "parrot", "animal"),
        )
        .await
        .unwrap();
    let mut cm = config_map("island", "tortoise", "animal");
    cm.metadata.namespace = Some("island".into());
    let created = Api::<ConfigMap>::namespaced(zoo.clone(), "island")
        .create(&PostParams::default(), &cm)
        .await
        .unwrap();
    assert_eq!(created.namespace().as_deref(), Some("zoo"));
    let in_host = |ns: &'static str| {
        let host = host.clone();
        async move {
            Api::<ConfigMap>::namespaced(host, ns)
                .list(&ListParams::default().labels("type"))
                .await
                .unwrap()
                .items
                .into_iter()
                .map(|cm| cm.name_any())
                .collect::<Vec<_>>()
        }
    };
    assert!(in_host("zoo").await.contains(&"parrot".to_string()));
    assert!(in_host("zoo").await.contains(&"tortoise".to_string()));
    assert!(!in_host("jungle").await.contains(&"parrot".to_string()));
    assert!(!in_host("island").await.contains(&"tortoise".to_string()));

    // Server-side apply naming another namespace in the body lands in zoo as well.
    let applied = serde_json::json!({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": { "name": "macaw", "namespace": "jungle", "labels": { "type": "animal" } },
        "data": { "colour": "blue" },
    });
    Api::<ConfigMap>::namespaced(zoo.clone(), "jungle")
        .patch(
            "macaw",
            &PatchParams::apply("namespace-test"),
            &Patch::Apply(&applied),
        )
        .await
        .unwrap();
    assert!(in_host("zoo").await.contains(&"macaw".to_string()));

    // "All namespaces" is zoo.
    let all = Api::<ConfigMap>::all(zoo.clone())
        .list(&ListParams::default())
        .await
        .unwrap();
    assert!(!all.items.is_empty());
    assert!(
        all.items
            .iter()
            .all(|cm| cm.namespace().as_deref() == Some("zoo"))
    );
    assert_eq!(
        Api::<ConfigMap>::namespaced(zoo.clone(), "jungle")
            .get("elephant")
            .await
            .unwrap()
            .namespace()
            .as_deref(),
        Some("zoo")
    );

    // Cluster-scoped reads pass; cluster-scoped writes are refused, naming the cluster.
    let namespaces: Api<Namespace> = Api::all(zoo.clone());
    assert!(
        namespaces
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .len()
            >= 3
    );
    assert!(namespaces.get("jungle").await.is_ok());
    zoo.apiserver_version().await.unwrap();
    let error = namespaces
        .delete("jungle", &DeleteParams::default())
        .await
        .unwrap_err();
    let refused = scoped_error(&error).expect("a ClusterScopedWrite");
    assert_eq!(refused.cluster, "zoo");
    assert_eq!(refused.method, "DELETE");
    assert!(error.to_string().contains("cluster zoo"), "{error}");
    assert!(
        Api::<Namespace>::all(host.clone())
            .get("jungle")
            .await
            .is_ok()
    );
    let label = serde_json::json!({ "metadata": { "labels": { "x": "y" } } });
    let error = namespaces
        .patch("zoo", &PatchParams::default(), &Patch::Merge(&label))
        .await
        .unwrap_err();
    assert!(scoped_error(&error).is_some(), "{error}");
    let role = ClusterRole {
        metadata: ObjectMeta {
            name: Some("zookeeper".into()),
            ..Default::default()
        },
        ..Default::default()
    };
    let error = Api::<ClusterRole>::all(zoo.clone())
        .create(&PostParams::default(), &role)
        .await
        .unwrap_err();
    assert!(scoped_error(&error).is_some(), "{error}");
    assert!(
        Api::<ClusterRole>::all(host.clone())
            .get_opt("zookeeper")
            .await
            .unwrap()
            .is_none()
    );

    // Requests that cannot be confined to zoo are refused, whatever the verb: a path a
    // normalising server could read as another namespace's, a node's proxy (it reaches
    // every namespace's pods), a resource discovery does not know.
    for (path, reason) in [
        (
            "/api/v1/namespaces/zoo/configmaps/../../jungle/configmaps/elephant",
            "dot segments",
        ),
        ("/api/v1/nodes/n1/proxy/pods", "subresource"),
        ("/apis/example.com/v1/widgets", "discovery"),
    ] {
        let request = http::Request::get(path).body(Vec::new()).unwrap();
        match zoo.request_text(request).await {
            Err(kube::Error::Service(e)) => {
                let refused = e
                    .downcast_ref::<UnscopableRequest>()
                    .unwrap_or_else(|| panic!("{path}: {e}"));
                assert_eq!(refused.cluster, "zoo");
                assert!(refused.reason.contains(reason), "{path}: {refused}");
            }
            other => panic!("{path}: expected a refusal, got {other:?}"),
        }
    }
    // A node's status is a read like any other.
    let request = http::Request::get("/api/v1/nodes/n1/status")
        .body(Vec::new())
        .unwrap();
    assert!(
        matches!(zoo.request_text(request).await, Err(kube::Error::Api(s)) if s.code == 404),
        "passed to the server, which has no such node"
    );

    // An Event about a cluster-scoped object would have to go to namespace default (the API
    // server refuses it anywhere else): refused here, naming the cluster.
    let namespace_zoo = Api::<Namespace>::all(host.clone())
        .get("zoo")
        .await
        .unwrap();
    let recorder = Recorder::new(zoo.clone(), Reporter::from("test"));
    let event = Event {
        type_: EventType::Normal,
        reason: "Noticed".into(),
        note: None,
        action: "Notice".into(),
        secondary: None,
    };
    match recorder
        .publish(&event, &namespace_zoo.object_ref(&()))
        .await
    {
        Err(kube::Error::Service(e)) => {
            let refused = e
                .downcast_ref::<UnscopableRequest>()
                .expect("UnscopableRequest");
            assert!(refused.reason.contains("cluster-scoped"), "{refused}");
        }
        other => panic!("expected a refusal, got {other:?}"),
    }

    // A create-only review API changes nothing and is allowed.
    let review = SelfSubjectAccessReview {
        spec: SelfSubjectAccessReviewSpec {
            resource_attributes: Some(ResourceAttributes {
                namespace: Some("zoo".into()),
                verb: Some("get".into()),
                resource: Some("configmaps".into()),
                ..Default::default()
            }),
            ..Default::default()
        },
        ..Default::default()
    };
    let answer = Api::<SelfSubjectAccessReview>::all(zoo.clone())
        .create(&PostParams::default(), &review)
        .await
        .unwrap();
    assert!(answer.status.unwrap().allowed);

    manager.shutdown();
    run.await.unwrap();
}

const FINALIZER: &str = "example.com/feeder";

/// Feeds animals through a finalizer, recording an Event for each: exercises the JSON
/// patches of kube-runtime's finalizer helper, a merge patch, and the event recorder, all
/// through the namespace-scoped client.
async fn feed_with_finalizer(
    cm: Arc<ConfigMap>,
    ctx: Context<ClusterName, Seen>,
) -> Result<Action, kube_runtime::finalizer::Error<kube::Error>> {
    let client = ctx.client();
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), &cm.namespace().unwrap());
    let seen = ctx.state_arc();
    let request = ctx.request().to_string();
    finalizer(&api, FINALIZER, cm, async |event| match event {
        Finalizer::Apply(cm) => {
            seen.requests.lock().unwrap().push(request);
            if cm.data.as_ref().and_then(|d| d.get("stomach")).is_none() {
                let patch = serde_json::json!({ "data": { "stomach": "food" } });
                api.patch(
                    &cm.name_any(),
                    &PatchParams::default(),
                    &Patch::Merge(&patch),
                )
                .await?;
                let recorder = Recorder::new(client.clone(), Reporter::from("feeder"));
                let event = Event {
                    type_: EventType::Normal,
                    reason: "Fed".into(),
                    note: Some(format!("fed {}", cm.name_any())),
                    action: "Feed".into(),
                    secondary: None,
                };
                recorder.publish(&event, &cm.object_ref(&())).await?;
            }
            Ok(kube_runtime::controller::Action::await_change())
        }
        Finalizer::Cleanup(cm) => {
            seen.requests.lock().unwrap().push(format!(
                "cleanup {}/{}",
                cm.namespace().unwrap(),
                cm.name_any()
            ));
            Ok(kube_runtime::controller::Action::await_change())
        }
    })
    .await?;
    Ok(Action::await_change())
}

fn retry_finalizer(
    _: Arc<ConfigMap>,
    _: &kube_runtime::finalizer::Error<kube::Error>,
    _: &Context<ClusterName, Seen>,
) -> Action {
    Action::requeue(std::time::Duration::from_millis(200))
}

#[tokio::test]
async fn patches_events_finalizers_and_namespace_deletion_work() {
    let env = TestEnv::start().await.unwrap();
    let host = env.cluster(0).unwrap().client().unwrap();
    fixture(&host).await;
    let manager = Arc::new(Manager::new(Namespaces::new(host.clone())));
    let seen = Arc::new(Seen::default());
    Builder::<_, ConfigMap>::new(&manager, fixture_objects().labels("type=animal")).start(
        feed_with_finalizer,
        retry_finalizer,
        seen.clone(),
    );
    let run = spawn_manager(&manager);

    for ns in NAMESPACES {
        eventually(30, &format!("the animal of {ns} fed"), async || {
            is_fed(&host, ns, "elephant").await
        })
        .await;
    }
    let elephant = Api::<ConfigMap>::namespaced(host.clone(), "island")
        .get("elephant")
        .await
        .unwrap();
    assert_eq!(elephant.finalizers(), [FINALIZER.to_string()]);
    eventually(30, "a Fed event in island", async || {
        has_event(&host, "island", "Fed", "elephant", "fed elephant").await
    })
    .await;

    // Deleting an object runs the cleanup and removes the finalizer.
    Api::<ConfigMap>::namespaced(host.clone(), "zoo")
        .delete("elephant", &DeleteParams::default())
        .await
        .unwrap();
    eventually(30, "the zoo elephant gone", async || {
        Api::<ConfigMap>::namespaced(host.clone(), "zoo")
            .get_opt("elephant")
            .await
            .unwrap()
            .is_none()
    })
    .await;
    assert_eq!(seen.count("cleanup zoo/elephant"), 1);

    // Deleting a namespace: while it terminates its cluster stays engaged, so the
    // finalizers of its objects can still be removed; once it is gone, the cluster is
    // disengaged.
    let island = manager.cluster(&name("island")).unwrap();
    Api::<Namespace>::all(host.clone())
        .delete("island", &DeleteParams::default())
        .await
        .unwrap();
    // The namespace controller's part: delete the objects in it ...
    Api::<ConfigMap>::namespaced(host.clone(), "island")
        .delete_collection(&DeleteParams::default(), &ListParams::default())
        .await
        .unwrap();
    eventually(30, "the island's objects gone", async || {
        Api::<ConfigMap>::namespaced(host.clone(), "island")
            .list(&ListParams::default().labels("type"))
            .await
            .unwrap()
            .items
            .is_empty()
    })
    .await;
    assert_eq!(seen.count("cleanup island/elephant"), 1);
    assert!(island.is_engaged());
    // ... then let the namespace go.
    finish_namespace_deletion(&host, "island").await;
    eventually(30, "island disengaged", async || !island.is_engaged()).await;
    assert!(manager.cluster(&name("island")).is_none());
    assert!(manager.cluster(&name("jungle")).is_some());

    // A namespace of the same name, created again, is a new cluster.
    create_namespace(&host, "island").await;
    create(&host, config_map("island", "crab", "animal")).await;
    eventually(30, "the new island's crab fed", async || {
        is_fed(&host, "island", "crab").await
    })
    .await;
    assert!(!island.same_instance(&manager.cluster(&name("island")).unwrap()));

    manager.shutdown();
    run.await.unwrap();
}

#[tokio::test]
async fn the_host_restarting_holds_nobody_up_for_long() {
    let env = TestEnv::start().await.unwrap();
    let c = env.cluster(0).unwrap();
    let host = c.client().unwrap();
    fixture(&host).await;
    let manager = Arc::new(Manager::new(
        Namespaces::new(host.clone()).labels("fixture"),
    ));
    for ns in NAMESPACES {
        let label = serde_json::json!({ "metadata": { "labels": { "fixture": "yes" } } });
        Api::<Namespace>::all(host.clone())
            .patch(ns, &PatchParams::default(), &Patch::Merge(&label))
            .await
            .unwrap();
    }
    let seen = Arc::new(Seen::default());
    Builder::<_, ConfigMap>::new(&manager, fixture_objects()).start(
        feed_animals,
        retry_soon,
        seen.clone(),
    );
    let run = spawn_manager(&manager);
    eventually(30, "zoo fed", async || {
        is_fed(&host, "zoo", "elephant").await
    })
    .await;
    // Only the labelled namespaces are clusters.
    let mut ids: Vec<String> = manager
        .fleet()
        .ids()
        .iter()
        .map(|i| i.to_string())
        .collect();
    ids.sort();
    assert_eq!(ids, ["island", "jungle", "zoo"]);

    c.stop().await;
    c.start().await.unwrap();
    let host = c.client().unwrap();
    create(&host, config_map("jungle", "tiger", "animal")).await;
    eventually(60, "an animal created after the restart fed", async || {
        is_fed(&host, "jungle", "tiger").await
    })
    .await;

    // A namespace that stops matching the selector is disengaged.
    let unlabel = serde_json::json!({ "metadata": { "labels": { "fixture": null } } });
    Api::<Namespace>::all(host.clone())
        .patch("zoo", &PatchParams::default(), &Patch::Merge(&unlabel))
        .await
        .unwrap();
    let fleet = manager.fleet().clone();
    eventually(30, "zoo disengaged", async || {
        fleet.get(&name("zoo")).is_none()
    })
    .await;
    create(&host, config_map("zoo", "lion", "animal")).await;
    // Sync point: a lion created after it in a namespace still engaged, delivered by the
    // same host watch, is fed; zoo's would have been queued first.
    create(&host, config_map("jungle", "lion", "animal")).await;
    eventually(30, "jungle's lion fed", async || {
        is_fed(&host, "jungle", "lion").await
    })
    .await;
    assert!(!is_fed(&host, "zoo", "lion").await);
    assert_eq!(seen.count("cluster://zoo/zoo/lion"), 0);

    manager.shutdown();
    run.await.unwrap();
}

#[tokio::test]
async fn a_host_watch_lives_as_long_as_a_cluster_needs_it_also_under_multi() {
    let env = TestEnv::start().await.unwrap();
    let tc = env.cluster(0).unwrap();
    let host = tc.client().unwrap();
    fixture(&host).await;
    let label =
        |value: Option<&str>| serde_json::json!({ "metadata": { "labels": { "solo": value } } });
    let namespaces: Api<Namespace> = Api::all(host.clone());
    namespaces
        .patch(
            "zoo",
            &PatchParams::default(),
            &Patch::Merge(&label(Some("true"))),
        )
        .await
        .unwrap();
    let baseline = tc.served_watches("configmaps", true).await.unwrap();
    let baseline_namespaced = tc.served_watches("configmaps", false).await.unwrap();

    // Under Multi, a namespace-cluster still shares the host's watches.
    let provider = Namespaces::new(host.clone()).labels("solo=true");
    let multi = multicluster_runtime::providers::Multi::new();
    multi.add("tenants", provider.clone()).unwrap();
    let manager = Arc::new(Manager::new(multi));
    let seen = Arc::new(Seen::default());
    Builder::<_, ConfigMap>::new(&manager, fixture_objects()).start(
        feed_animals,
        retry_soon,
        seen.clone(),
    );
    let run = spawn_manager(&manager);
    eventually(30, "zoo fed through Multi", async || {
        is_fed(&host, "zoo", "elephant").await
    })
    .await;
    assert!(seen.count("cluster://tenants#zoo/zoo/elephant") >= 1);
    assert_eq!(provider.host_watches(), 1);
    eventually(30, "one watch more on the host", async || {
        tc.served_watches("configmaps", true).await.unwrap() == baseline + 1
    })
    .await;
    assert_eq!(
        tc.served_watches("configmaps", false).await.unwrap(),
        baseline_namespaced,
        "no watch of its own"
    );

    // The only cluster gone, the host watch stops.
    namespaces
        .patch("zoo", &PatchParams::default(), &Patch::Merge(&label(None)))
        .await
        .unwrap();
    eventually(30, "the host watch stopped", async || {
        provider.host_watches() == 0
    })
    .await;
    eventually(30, "the apiserver serves it no more", async || {
        tc.served_watches("configmaps", true).await.unwrap() == baseline
    })
    .await;

    // Needed again, it starts again, and the namespace's objects are all there.
    namespaces
        .patch(
            "jungle",
            &PatchParams::default(),
            &Patch::Merge(&label(Some("true"))),
        )
        .await
        .unwrap();
    eventually(30, "jungle fed", async || {
        is_fed(&host, "jungle", "elephant").await
    })
    .await;
    assert_eq!(provider.host_watches(), 1);
    let jungle = manager.cluster(&name("tenants#jungle")).unwrap();
    assert_eq!(
        jungle
            .cache::<ConfigMap>(&fixture_objects())
            .await
            .unwrap()
            .store()
            .len(),
        3
    );

    manager.shutdown();
    run.await.unwrap();
}

#[tokio::test]
async fn namespace_clusters_share_the_hosts_copy_of_each_object() {
    let env = TestEnv::start().await.unwrap();
    let tc = env.cluster(0).unwrap();
    let host = tc.client().unwrap();
    fixture(&host).await;
    let nodes: Api<Node> = Api::all(host.clone());
    let node = Node {
        metadata: ObjectMeta {
            name: Some("shared".into()),
            labels: Some([("fleet".to_string(), "shared".to_string())].into()),
            ..Default::default()
        },
        ..Default::default()
    };
    nodes.create(&PostParams::default(), &node).await.unwrap();
    let node_config = kube_runtime::watcher::Config::default().labels("fleet=shared");

    // One provider under two names: each namespace is two clusters, all fed by one hub.
    let provider = Namespaces::new(host.clone());
    let multi = multicluster_runtime::providers::Multi::new();
    multi.add("a", provider.clone()).unwrap();
    multi.add("b", provider.clone()).unwrap();
    let manager = Arc::new(Manager::new(multi));
    let run = spawn_manager(&manager);
    let ids = ["a#zoo", "a#jungle", "b#zoo"];
    eventually(30, "the namespaces engaged under both names", async || {
        ids.iter().all(|id| manager.cluster(&name(id)).is_some())
    })
    .await;
    let mut node_caches = Vec::new();
    let mut animal_caches = Vec::new();
    for id in ids {
        let cluster = manager.cluster(&name(id)).unwrap();
        node_caches.push(cluster.cache::<Node>(&node_config).await.unwrap());
        animal_caches.push(
            cluster
                .cache::<ConfigMap>(&fixture_objects())
                .await
                .unwrap(),
        );
    }
    let node_ref = ObjectRef::new("shared");
    let versions = |caches: &[multicluster_runtime::Cache<Node>]| -> Vec<Option<String>> {
        caches
            .iter()
            .map(|c| c.store().get(&node_ref)?.resource_version())
            .collect()
    };
    let one_copy = |caches: &[multicluster_runtime::Cache<Node>]| {
        let first = caches[0].store().get(&node_ref).unwrap();
        caches
            .iter()
            .all(|c| Arc::ptr_eq(&c.store().get(&node_ref).unwrap(), &first))
    };
    // A cluster-scoped object: one copy for every namespace-cluster, not one each.
    assert!(
        one_copy(&node_caches),
        "the Node copied per namespace-cluster"
    );
    // A namespaced one: the same namespace under two names holds the same copy.
    let elephant = ObjectRef::new("elephant").within("zoo");
    let a_zoo = animal_caches[0].store().get(&elephant).unwrap();
    let b_zoo = animal_caches[2].store().get(&elephant).unwrap();
    assert!(
        Arc::ptr_eq(&a_zoo, &b_zoo),
        "the ConfigMap copied per cluster"
    );
    assert!(animal_caches[1].store().get(&elephant).is_none());

    // A change is shared the same way.
    let changed = nodes
        .patch(
            "shared",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({ "metadata": { "labels": { "round": "2" } } })),
        )
        .await
        .unwrap();
    eventually(30, "every cache has the changed Node", async || {
        versions(&node_caches)
            .iter()
            .all(|v| *v == changed.resource_version())
    })
    .await;
    assert!(
        one_copy(&node_caches),
        "the changed Node copied per namespace-cluster"
    );

    nodes
        .delete("shared", &DeleteParams::default())
        .await
        .unwrap();
    manager.shutdown();
    run.await.unwrap();
}
