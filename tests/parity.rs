//! What kube-runtime's `Controller` does and the builder now does too, against real
//! apiservers: watches restricted to namespaces (a controller whose RBAC is namespaced) and
//! kinds known only at run time (`DynamicObject`), in a fleet and with a single cluster.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use k8s_openapi::api::rbac::v1::{PolicyRule, Role, RoleBinding, RoleRef, Subject};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::Resource as _;
use kube::api::{
    Api, ApiResource, DynamicObject, GroupVersionKind, ObjectMeta, Patch, PatchParams, PostParams,
};
use multicluster_runtime::providers::{Clusters, SingleProvider};
use multicluster_runtime::{
    Action, Builder, Cluster, ClusterId, Context, DiscoveryError, Manager, watcher,
};
use multicluster_runtime_testenv::{TestCluster, TestEnv};

/// Lets the user `tenant` read ConfigMaps and Secrets in `namespaces` only (a Role and a
/// RoleBinding in each; nothing cluster-wide).
async fn grant_namespaces(admin: &kube::Client, namespaces: &[&str]) {
    for ns in namespaces {
        let role = Role {
            metadata: ObjectMeta {
                name: Some("reader".into()),
                namespace: Some(ns.to_string()),
                ..Default::default()
            },
            rules: Some(vec![PolicyRule {
                api_groups: Some(vec![String::new()]),
                resources: Some(vec!["configmaps".into(), "secrets".into()]),
                verbs: ["get", "list", "watch"].map(String::from).to_vec(),
                ..Default::default()
            }]),
        };
        Api::<Role>::namespaced(admin.clone(), ns)
            .create(&PostParams::default(), &role)
            .await
            .unwrap();
        let binding = RoleBinding {
            metadata: ObjectMeta {
                name: Some("reader-tenant".into()),
                namespace: Some(ns.to_string()),
                ..Default::default()
            },
            role_ref: RoleRef {
                api_group: Some("rbac.authorization.k8s.io".into()),
                kind: "Role".into(),
                name: "reader".into(),
            },
            subjects: Some(vec![Subject {
                kind: "User".into(),
                name: "tenant".into(),
                api_group: Some("rbac.authorization.k8s.io".into()),
                ..Default::default()
            }]),
        };
        Api::<RoleBinding>::namespaced(admin.clone(), ns)
            .create(&PostParams::default(), &binding)
            .await
            .unwrap();
    }
}

/// The fixture in `c`, and a client of the user `tenant`, who may read zoo and jungle only.
async fn tenant_of(c: &TestCluster) -> kube::Client {
    let admin = c.client().unwrap();
    fixture(&admin).await;
    grant_namespaces(&admin, &["zoo", "jungle"]).await;
    c.add_user("tenant", &[]).unwrap().client().unwrap()
}

async fn create_cm(client: &kube::Client, ns: &str, name: &str) {
    Api::<ConfigMap>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &config_map(ns, name, "animal"))
        .await
        .unwrap();
}

#[tokio::test]
async fn a_fleet_controller_with_namespaced_rbac_watches_and_reads_its_namespaces_only() {
    let env = TestEnv::builder().clusters(2).start().await.unwrap();
    let clusters = Clusters::new();
    let mut admins = Vec::new();
    for c in env.clusters() {
        let tenant = tenant_of(&c).await;
        clusters.add(Cluster::new(name(c.name()), tenant)).unwrap();
        admins.push((c.name().to_string(), c.client().unwrap()));
    }
    let manager = Arc::new(Manager::new(clusters).namespaces(["zoo", "jungle"]));
    let seen = Arc::new(Seen::default());
    Builder::<_, ConfigMap>::new(&manager, fixture_objects())
        .owns::<Secret>(watcher::Config::default())
        .start(record, retry_soon, seen.clone());
    let run = spawn_manager(&manager);

    // Every object of both namespaces in both clusters, each one watched namespace by
    // namespace (a cluster-wide watch is forbidden to this user).
    eventually(
        60,
        "zoo and jungle reconciled in both clusters",
        async || {
            let requests = seen.requests.lock().unwrap().clone();
            admins.iter().all(|(c, _)| {
                ["zoo", "jungle"].iter().all(|ns| {
                    ["elephant", "keeper", "rock"]
                        .iter()
                        .all(|n| requests.contains(&format!("cluster://{c}/{ns}/{n}")))
                })
            })
        },
    )
    .await;

    // Reads go through the same restricted watches: the cache syncs (a cluster-wide one
    // would wait forever on a forbidden list) and holds both namespaces and nothing else.
    let (c0, admin0) = &admins[0];
    let cluster = manager.cluster(&name(c0)).unwrap();
    let cache = tokio::time::timeout(
        Duration::from_secs(30),
        cluster.cache::<ConfigMap>(&fixture_objects()),
    )
    .await
    .expect("the namespaced cache syncs")
    .unwrap();
    let mut namespaces: Vec<String> = cache
        .store()
        .state()
        .iter()
        .map(|cm| cm.metadata.namespace.clone().unwrap())
        .collect();
    namespaces.sort();
    namespaces.dedup();
    assert_eq!(namespaces, ["jungle", "zoo"]);

    // The owns relation is namespaced too: a Secret owned by zoo/keeper reconciles it.
    let keeper = Api::<ConfigMap>::namespaced(admin0.clone(), "zoo")
        .get("keeper")
        .await
        .unwrap();
    let secret = Secret {
        metadata: ObjectMeta {
            name: Some("badge".into()),
            namespace: Some("zoo".into()),
            owner_references: Some(vec![OwnerReference {
                api_version: "v1".into(),
                kind: "ConfigMap".into(),
                name: "keeper".into(),
                uid: keeper.metadata.uid.clone().unwrap(),
                ..Default::default()
            }]),
            ..Default::default()
        },
        ..Default::default()
    };
    Api::<Secret>::namespaced(admin0.clone(), "zoo")
        .create(&PostParams::default(), &secret)
        .await
        .unwrap();
    let keeper_request = format!("cluster://{c0}/zoo/keeper");
    eventually(30, "the keeper reconciled for its secret", async || {
        seen.count(&keeper_request) == 2
    })
    .await;

    // An object outside the namespaces is never seen. Sync point: an object created after
    // it in a watched namespace of the same cluster is reconciled.
    create_cm(admin0, "island", "parrot").await;
    create_cm(admin0, "jungle", "tiger").await;
    let tiger = format!("cluster://{c0}/jungle/tiger");
    eventually(30, "the later jungle object", async || {
        seen.count(&tiger) == 1
    })
    .await;
    let requests = seen.requests.lock().unwrap().clone();
    assert!(
        requests.iter().all(|r| !r.contains("/island/")),
        "nothing outside zoo and jungle: {requests:?}"
    );
    manager.shutdown();
    run.await.unwrap();
}

#[tokio::test]
async fn a_single_cluster_controller_watches_the_one_namespace_it_is_given() {
    let env = TestEnv::start().await.unwrap();
    let c = env.cluster(0).unwrap();
    let tenant = tenant_of(&c).await;
    let admin = c.client().unwrap();
    // Without a namespace the tenant's watch of ConfigMaps is forbidden cluster-wide.
    let unscoped = Manager::new(SingleProvider::new(tenant.clone()));
    let forbidden = Arc::new(Seen::default());
    Builder::<_, ConfigMap>::new(&unscoped, fixture_objects()).start(
        record,
        retry_soon,
        forbidden.clone(),
    );
    // With one: its namespace only, through the single-cluster (kube-runtime) path.
    let manager = Arc::new(Manager::new(SingleProvider::new(tenant)).namespaces(["zoo"]));
    let seen = Arc::new(Seen::default());
    Builder::<_, ConfigMap>::new(&manager, fixture_objects()).start(
        record,
        retry_soon,
        seen.clone(),
    );
    let unscoped = Arc::new(unscoped);
    let unscoped_run = spawn_manager(&unscoped);
    let run = spawn_manager(&manager);
    eventually(60, "zoo reconciled", async || {
        ["elephant", "keeper", "rock"]
            .iter()
            .all(|n| seen.count(&format!("cluster:///zoo/{n}")) == 1)
    })
    .await;
    // jungle is readable to the user but not given: a jungle object is not reconciled.
    // Sync point: a zoo object created after it is.
    create_cm(&admin, "jungle", "tiger").await;
    create_cm(&admin, "zoo", "lion").await;
    eventually(30, "the later zoo object", async || {
        seen.count("cluster:///zoo/lion") == 1
    })
    .await;
    assert_eq!(
        seen.total(),
        4,
        "zoo only: {:?}",
        seen.requests.lock().unwrap()
    );
    // The unscoped controller was refused all along (its listing is forbidden).
    assert_eq!(forbidden.total(), 0);
    manager.shutdown();
    unscoped.shutdown();
    run.await.unwrap();
    unscoped_run.await.unwrap();
}

fn widget_gvk() -> GroupVersionKind {
    GroupVersionKind::gvk("example.com", "v1", "Widget")
}

async fn create_widget(client: &kube::Client, widgets: &ApiResource, name: &str) {
    let mut widget = DynamicObject::new(name, widgets).within("default");
    widget.data = serde_json::json!({"spec": {"size": 3}});
    Api::<DynamicObject>::namespaced_with(client.clone(), "default", widgets)
        .create(&PostParams::default(), &widget)
        .await
        .unwrap();
}

/// Creates `<widget>-part`, a ConfigMap the widget owns, unless it exists.
async fn make_part<C: ClusterId>(
    widget: Arc<DynamicObject>,
    ctx: Context<C, Seen>,
) -> Result<Action, kube::Error> {
    record(widget.clone(), ctx.clone()).await?;
    let widgets = ApiResource::from_gvk_with_plural(&widget_gvk(), "widgets");
    let owner = widget.controller_owner_ref(&widgets).unwrap();
    let part = ConfigMap {
        metadata: ObjectMeta {
            name: Some(format!("{}-part", widget.metadata.name.as_deref().unwrap())),
            namespace: widget.metadata.namespace.clone(),
            owner_references: Some(vec![owner]),
            ..Default::default()
        },
        ..Default::default()
    };
    let api = Api::<ConfigMap>::namespaced(ctx.client(), "default");
    match api.create(&PostParams::default(), &part).await {
        Ok(_) => Ok(Action::await_change()),
        Err(kube::Error::Api(status)) if status.code == 409 => Ok(Action::await_change()),
        Err(error) => Err(error),
    }
}

/// Changes the part `gear-part` and waits for its owner (`gear`, requested as `request`) to
/// be reconciled for it.
async fn wear_part(parts: &Api<ConfigMap>, seen: &Seen, request: &str) {
    let before = seen.count(request);
    parts
        .patch(
            "gear-part",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"data": {"worn": "yes"}})),
        )
        .await
        .unwrap();
    eventually(30, "the widget reconciled for its part", async || {
        seen.count(request) > before
    })
    .await;
}

fn retry_dynamic<C: ClusterId>(
    _: Arc<DynamicObject>,
    _: &kube::Error,
    _: &Context<C, Seen>,
) -> Action {
    Action::requeue(Duration::from_millis(200))
}

#[tokio::test]
async fn a_kind_known_at_run_time_is_reconciled_in_the_clusters_that_serve_it() {
    let env = TestEnv::builder().clusters(2).start().await.unwrap();
    let (c0, c1) = (env.cluster(0).unwrap(), env.cluster(1).unwrap());
    c0.install_crds(WIDGET_CRD).await.unwrap();
    let clusters = Clusters::new();
    for c in [&c0, &c1] {
        clusters
            .add(Cluster::new(name(c.name()), c.client().unwrap()))
            .unwrap();
    }
    let manager = Arc::new(Manager::new(clusters));
    let run = spawn_manager(&manager);
    eventually(30, "both clusters engaged", async || {
        [&c0, &c1].iter().all(|c| {
            manager
                .cluster(&name(c.name()))
                .is_some_and(|c| c.is_engaged())
        })
    })
    .await;
    let first = manager.cluster(&name(c0.name())).unwrap();
    let second = manager.cluster(&name(c1.name())).unwrap();

    // Discovery per cluster: the kind is served in c0 only.
    let widgets = first.discover(&widget_gvk()).await.unwrap();
    assert_eq!(widgets.plural, "widgets");
    assert!(matches!(
        second.discover(&widget_gvk()).await,
        Err(DiscoveryError::NotServed { ref cluster, .. }) if cluster == c1.name()
    ));

    let seen = Arc::new(Seen::default());
    Builder::<_, DynamicObject>::new_with(&manager, widgets.clone(), watcher::Config::default())
        .owns::<ConfigMap>(watcher::Config::default())
        .start(make_part, retry_dynamic, seen.clone());

    let (a0, a1) = (c0.client().unwrap(), c1.client().unwrap());
    create_widget(&a0, &widgets, "gear").await;
    let gear = format!("cluster://{}/default/gear", c0.name());
    eventually(30, "the widget reconciled", async || seen.count(&gear) >= 1).await;
    let parts = Api::<ConfigMap>::namespaced(a0.clone(), "default");
    eventually(30, "its part created", async || {
        parts.get_opt("gear-part").await.unwrap().is_some()
    })
    .await;
    // The owner references of a kind known at run time are followed: a change to the part
    // reconciles the widget.
    wear_part(&parts, &seen, &gear).await;

    // c1 does not serve it: its watch waits, and says why.
    let status = second
        .cache_status()
        .into_iter()
        .find(|s| s.kind == "Widget")
        .expect("the controller's watch of widgets in c1");
    assert!(!status.synced);
    // Served later: the watch lists and the widget is reconciled, without a restart.
    c1.install_crds(WIDGET_CRD).await.unwrap();
    create_widget(&a1, &widgets, "cog").await;
    let cog = format!("cluster://{}/default/cog", c1.name());
    eventually(
        60,
        "the widget of the cluster that serves it now",
        async || seen.count(&cog) >= 1,
    )
    .await;
    assert!(second.discover(&widget_gvk()).await.is_ok());
    manager.shutdown();
    run.await.unwrap();
}

#[tokio::test]
async fn a_single_cluster_controller_of_a_kind_known_at_run_time_runs_on_kube_runtime() {
    let env = TestEnv::start().await.unwrap();
    let c = env.cluster(0).unwrap();
    c.install_crds(WIDGET_CRD).await.unwrap();
    let admin = c.client().unwrap();
    let manager = Arc::new(Manager::new(SingleProvider::new(admin.clone())));
    let widgets = ApiResource::from_gvk_with_plural(&widget_gvk(), "widgets");
    let seen = Arc::new(Seen::default());
    Builder::<_, DynamicObject>::new_with(&manager, widgets.clone(), watcher::Config::default())
        .owns::<ConfigMap>(watcher::Config::default())
        .start(make_part, retry_dynamic, seen.clone());
    let run = spawn_manager(&manager);
    create_widget(&admin, &widgets, "gear").await;
    eventually(30, "the widget reconciled", async || {
        seen.count("cluster:///default/gear") >= 1
    })
    .await;
    let parts = Api::<ConfigMap>::namespaced(admin.clone(), "default");
    eventually(30, "its part created", async || {
        parts.get_opt("gear-part").await.unwrap().is_some()
    })
    .await;
    wear_part(&parts, &seen, "cluster:///default/gear").await;
    manager.shutdown();
    run.await.unwrap();
}
