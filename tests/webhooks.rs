//! Admission webhooks for a fleet, called by real kube-apiservers over loopback: validating
//! and mutating in every engaged cluster, each review naming its cluster; configurations
//! following engagement (a cluster engaged at run time, a replaced one kept, a disengaged
//! one removed); a member whose identity may not install them (an Event, a metric, the
//! others served); forged and stale routes refused; handler errors and the webhook down
//! under `Fail` and `Ignore`; host-only webhooks and a CA rotation without a failed
//! admission; sharded replicas.

mod common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
};
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::ResourceExt;
use kube::api::{Api, ObjectMeta, PostParams};
use multicluster_runtime::providers::Clusters;
use multicluster_runtime::webhook::{
    FailurePolicy, Hook, Install, Mutation, Review, Verdict, Webhooks,
};
use multicluster_runtime::{Cluster, ClusterName, Manager, Metrics};
use multicluster_runtime_testenv::TestEnv;

const NS: &str = "hooks";
const MANAGED: &str = "fleet.example.com/managed";
const OWNER: &str = "fleet.example.com/owner";
/// The configurations' name, given (the default, made from the URL, is tested in
/// `tests/admission_edges.rs`).
const CONFIGURATION: &str = "fleet-policy";

/// Every review a handler got: (webhook, cluster, object name).
#[derive(Default)]
struct Seen(
    Mutex<Vec<(String, String, String)>>,
    Mutex<Vec<String>>,
    tokio::sync::Notify,
);

impl Seen {
    fn note(&self, webhook: &str, cluster: &ClusterName, name: &str) {
        self.0
            .lock()
            .unwrap()
            .push((webhook.into(), cluster.to_string(), name.into()));
    }

    fn dry_run(&self, name: &str) {
        self.1.lock().unwrap().push(name.into());
    }

    fn was_dry_run(&self, name: &str) -> bool {
        self.1.lock().unwrap().iter().any(|n| n == name)
    }

    fn has(&self, webhook: &str, cluster: &str, name: &str) -> bool {
        self.0
            .lock()
            .unwrap()
            .iter()
            .any(|(w, c, n)| w == webhook && c == cluster && n == name)
    }

    fn of_name(&self, name: &str) -> Vec<(String, String, String)> {
        self.0
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, _, n)| n == name)
            .cloned()
            .collect()
    }
}

fn selector(label: &str) -> LabelSelector {
    LabelSelector {
        match_labels: Some(BTreeMap::from([(label.to_string(), "true".to_string())])),
        match_expressions: None,
    }
}

fn cm(name: &str, labels: &[&str], owner: Option<&str>) -> ConfigMap {
    ConfigMap {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some(NS.into()),
            labels: Some(
                labels
                    .iter()
                    .map(|l| (l.to_string(), "true".to_string()))
                    .collect(),
            ),
            annotations: owner.map(|o| BTreeMap::from([(OWNER.to_string(), o.to_string())])),
            ..Default::default()
        },
        ..Default::default()
    }
}

/// The fleet policy: a managed ConfigMap gets its creator as owner unless it names one
/// (mutating); one whose owner is empty is denied, naming the cluster, and an owner cannot
/// change (validating). Two more hooks for the failure policies: `strict` (Fail) and
/// `lenient` (Ignore), which fail on objects labelled `broken`; and `slow`, which takes two
/// seconds to allow.
fn webhooks(port: u16, seen: Arc<Seen>) -> Webhooks<ClusterName> {
    let (defaults, owners, strict, lenient, slow) = (
        seen.clone(),
        seen.clone(),
        seen.clone(),
        seen.clone(),
        seen.clone(),
    );
    Webhooks::new(
        format!("127.0.0.1:{port}").parse().unwrap(),
        format!("https://127.0.0.1:{port}/admission"),
    )
    .check_every(Duration::from_millis(500))
    .configuration_name(CONFIGURATION)
    .hook(
        Hook::mutating(
            "defaults.fleet.example.com",
            move |review: Review<ClusterName, ConfigMap>| {
                let seen = defaults.clone();
                async move {
                    let mut object = review.object.unwrap();
                    seen.note("defaults", &review.cluster, &object.name_any());
                    if review.dry_run {
                        seen.dry_run(&object.name_any());
                    }
                    let annotations = object.metadata.annotations.get_or_insert_default();
                    if annotations.contains_key(OWNER) {
                        return Ok::<_, String>(Mutation::unchanged());
                    }
                    let user = review.user_info.username.unwrap_or_default();
                    annotations.insert(OWNER.into(), user);
                    Ok(Mutation::changed(object))
                }
            },
        )
        .object_selector(selector(MANAGED)),
    )
    .hook(
        Hook::validating(
            "owners.fleet.example.com",
            move |review: Review<ClusterName, ConfigMap>| {
                let seen = owners.clone();
                async move {
                    let object = review.object.unwrap();
                    seen.note("owners", &review.cluster, &object.name_any());
                    let owner = object.annotations().get(OWNER).cloned().unwrap_or_default();
                    let was = review
                        .old_object
                        .as_ref()
                        .and_then(|old| old.annotations().get(OWNER).cloned());
                    if let Some(was) = was.filter(|was| *was != owner) {
                        return Ok(Verdict::deny(format!(
                            "the owner of {} is {was}: it cannot change",
                            object.name_any()
                        )));
                    }
                    Ok::<_, String>(if owner.is_empty() {
                        Verdict::deny(format!(
                            "in cluster {}: ConfigMap {} has no owner",
                            review.cluster,
                            object.name_any()
                        ))
                    } else {
                        Verdict::allow()
                    })
                }
            },
        )
        .object_selector(selector(MANAGED)),
    )
    .hook(
        Hook::validating(
            "strict.fleet.example.com",
            move |review: Review<ClusterName, ConfigMap>| {
                let seen = strict.clone();
                async move {
                    let object = review.object.unwrap();
                    seen.note("strict", &review.cluster, &object.name_any());
                    if object.labels().contains_key("broken") {
                        return Err("the policy store is unreachable".to_string());
                    }
                    Ok(Verdict::allow())
                }
            },
        )
        .object_selector(selector("strict")),
    )
    .hook(
        Hook::validating(
            "lenient.fleet.example.com",
            move |review: Review<ClusterName, ConfigMap>| {
                let seen = lenient.clone();
                async move {
                    let object = review.object.unwrap();
                    seen.note("lenient", &review.cluster, &object.name_any());
                    if object.labels().contains_key("broken") {
                        return Err("the policy store is unreachable".to_string());
                    }
                    Ok(Verdict::allow())
                }
            },
        )
        .object_selector(selector("lenient"))
        .failure_policy(FailurePolicy::Ignore),
    )
    .hook(
        Hook::validating(
            "slow.fleet.example.com",
            move |review: Review<ClusterName, ConfigMap>| {
                let seen = slow.clone();
                async move {
                    let object = review.object.unwrap();
                    seen.note("slow", &review.cluster, &object.name_any());
                    seen.2.notify_one();
                    tokio::time::sleep(Duration::from_secs(2)).await;
                    Ok::<_, String>(Verdict::allow())
                }
            },
        )
        .object_selector(selector("slow")),
    )
}

fn configs(client: &kube::Client) -> Api<ValidatingWebhookConfiguration> {
    Api::all(client.clone())
}

fn mutating_configs(client: &kube::Client) -> Api<MutatingWebhookConfiguration> {
    Api::all(client.clone())
}

/// Waits until `client`'s cluster has both configurations of the manager.
async fn installed(client: &kube::Client, what: &str) -> ValidatingWebhookConfiguration {
    eventually(30, &format!("the configurations in {what}"), async || {
        matches!(
            mutating_configs(client).get_opt(CONFIGURATION).await,
            Ok(Some(_))
        ) && matches!(configs(client).get_opt(CONFIGURATION).await, Ok(Some(_)))
    })
    .await;
    in_effect(client, MANAGED, what).await;
    configs(client).get(CONFIGURATION).await.unwrap()
}

/// Waits until `client`'s API server calls the webhooks selecting `label`, which deny an
/// object so labelled with an empty owner (or refuse it): the API server calls a
/// configuration only once its informer has it, so a write just after the configuration
/// is stored may pass unchecked. A dry run that fails is the sync point.
async fn in_effect(client: &kube::Client, label: &str, what: &str) {
    let probe = cm("sync-probe", &[label], Some(""));
    eventually(
        30,
        &format!("the API server calling the webhooks of {what}"),
        async || {
            Api::<ConfigMap>::namespaced(client.clone(), NS)
                .create(
                    &PostParams {
                        dry_run: true,
                        ..Default::default()
                    },
                    &probe,
                )
                .await
                .is_err()
        },
    )
    .await;
}

/// The error of creating `object`, if any: (HTTP code, reason, message).
async fn create(
    client: &kube::Client,
    object: &ConfigMap,
) -> Result<ConfigMap, (u16, String, String)> {
    Api::<ConfigMap>::namespaced(client.clone(), NS)
        .create(&PostParams::default(), object)
        .await
        .map_err(|e| match e {
            kube::Error::Api(status) => {
                (status.code, status.reason.clone(), status.message.clone())
            }
            other => (0, String::new(), other.to_string()),
        })
}

fn scrape(registry: &prometheus_client::registry::Registry) -> String {
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, registry).unwrap();
    text
}

/// Writes by hand, in `client`'s cluster, a configuration `name` holding the `owners` hook of
/// `from` (one of the manager's), sent to `url` (`from`'s if `None`) and, with `label`, for
/// objects so labelled only. Returns the URL it carries.
async fn hand_written(
    client: &kube::Client,
    from: &ValidatingWebhookConfiguration,
    name: &str,
    url: Option<String>,
    label: Option<&str>,
) -> String {
    let mut config = from.clone();
    config.metadata = ObjectMeta {
        name: Some(name.into()),
        ..Default::default()
    };
    let hooks = config.webhooks.as_mut().unwrap();
    hooks.retain(|h| h.name == "owners.fleet.example.com");
    if let Some(url) = url {
        hooks[0].client_config.url = Some(url);
    }
    if let Some(label) = label {
        hooks[0].object_selector = Some(selector(label));
    }
    let carried = hooks[0].client_config.url.clone().unwrap();
    configs(client)
        .create(&PostParams::default(), &config)
        .await
        .unwrap();
    // Each of these configurations makes a write it selects fail (refused, or denied for
    // want of an owner).
    in_effect(client, label.unwrap_or(MANAGED), name).await;
    carried
}

/// Lets `user` manage webhook configurations (`ClusterRole` `webhook-installer`).
async fn allow_webhook_configurations(admin: &kube::Client, user: &str) {
    use k8s_openapi::api::rbac::v1::{
        ClusterRole, ClusterRoleBinding, PolicyRule, RoleRef, Subject,
    };
    let role = ClusterRole {
        metadata: ObjectMeta {
            name: Some("webhook-installer".into()),
            ..Default::default()
        },
        rules: Some(vec![PolicyRule {
            api_groups: Some(vec!["admissionregistration.k8s.io".into()]),
            resources: Some(vec![
                "validatingwebhookconfigurations".into(),
                "mutatingwebhookconfigurations".into(),
            ]),
            verbs: ["get", "create", "patch", "update", "delete"]
                .iter()
                .map(|v| v.to_string())
                .collect(),
            ..Default::default()
        }]),
        ..Default::default()
    };
    Api::<ClusterRole>::all(admin.clone())
        .create(&PostParams::default(), &role)
        .await
        .unwrap();
    let binding = ClusterRoleBinding {
        metadata: ObjectMeta {
            name: Some(format!("webhook-installer-{user}")),
            ..Default::default()
        },
        role_ref: RoleRef {
            api_group: Some("rbac.authorization.k8s.io".into()),
            kind: "ClusterRole".into(),
            name: "webhook-installer".into(),
        },
        subjects: Some(vec![Subject {
            kind: "User".into(),
            name: user.into(),
            api_group: Some("rbac.authorization.k8s.io".into()),
            ..Default::default()
        }]),
    };
    Api::<ClusterRoleBinding>::all(admin.clone())
        .create(&PostParams::default(), &binding)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_is_served_and_its_configurations_follow_engagement() {
    let env = TestEnv::builder().clusters(4).start().await.unwrap();
    let [c0, c1, c2, c3] = [0, 1, 2, 3].map(|i| env.cluster(i).unwrap());
    let admins: Vec<kube::Client> = [&c0, &c1, &c2, &c3]
        .iter()
        .map(|c| c.client().unwrap())
        .collect();
    for admin in &admins {
        create_namespace(admin, NS).await;
    }
    let member = |id: &str, c: &multicluster_runtime_testenv::TestCluster| {
        Cluster::from_config(name(id), c.config()).unwrap()
    };
    let provider = Clusters::new();
    for (id, c) in [("a", &c1), ("b", &c2), ("c", &c3)] {
        provider.add(member(id, c)).unwrap();
    }
    let port = free_port();
    let seen = Arc::new(Seen::default());
    let mut registry = prometheus_client::registry::Registry::default();
    let metrics = Metrics::new(&mut registry);
    let manager = Arc::new(
        Manager::new(provider.clone())
            .with_local(member("host", &c0))
            .metrics(metrics)
            .serve(
                multicluster_runtime::Endpoints::new("127.0.0.1:0".parse().unwrap()).plain_http(),
            )
            .webhooks(webhooks(port, seen.clone())),
    );
    let run = spawn_manager(&manager);

    // The host Secret holds the CA, the serving certificate and the route key.
    eventually(30, "the webhook Secret on the host", async || {
        matches!(
            Api::<Secret>::namespaced(admins[0].clone(), "default")
                .get_opt("multicluster-runtime-webhook")
                .await,
            Ok(Some(_))
        )
    })
    .await;

    // Three clusters: each installs, mutates, allows and denies, naming itself.
    for (id, admin) in [("a", &admins[1]), ("b", &admins[2]), ("c", &admins[3])] {
        let config = installed(admin, id).await;
        let url = config.webhooks.unwrap()[0]
            .client_config
            .url
            .clone()
            .unwrap();
        assert!(url.contains(&format!("/admission/{id}/")), "{url}");
        let created = create(admin, &cm("defaulted", &[MANAGED], None))
            .await
            .unwrap();
        let owner = created
            .annotations()
            .get(OWNER)
            .cloned()
            .unwrap_or_default();
        assert!(
            !owner.is_empty(),
            "in {id}: the creator is the default owner"
        );
        assert!(seen.has("defaults", id, "defaulted") && seen.has("owners", id, "defaulted"));
        create(admin, &cm("owned", &[MANAGED], Some("team-x")))
            .await
            .unwrap();
        let (code, reason, message) = create(admin, &cm("orphan", &[MANAGED], Some("")))
            .await
            .unwrap_err();
        assert_eq!((code, reason.as_str()), (403, "Forbidden"), "{message}");
        assert!(
            message.contains("denied the request")
                && message.contains(&format!("in cluster {id}: ConfigMap orphan has no owner")),
            "{message}"
        );
        // Not selected: no review at all.
        create(admin, &cm("unmanaged", &[], None)).await.unwrap();
        assert!(seen.of_name("unmanaged").is_empty());
    }
    // The old object: an owner cannot change.
    let cms = Api::<ConfigMap>::namespaced(admins[1].clone(), NS);
    let mut owned = cms.get("owned").await.unwrap();
    owned
        .annotations_mut()
        .insert(OWNER.into(), "team-y".into());
    let error = cms
        .replace("owned", &PostParams::default(), &owned)
        .await
        .unwrap_err();
    assert!(
        error
            .to_string()
            .contains("the owner of owned is team-x: it cannot change"),
        "{error}"
    );
    // A dry run is reviewed as one, and stores nothing.
    cms.create(
        &PostParams {
            dry_run: true,
            ..Default::default()
        },
        &cm("dry", &[MANAGED], None),
    )
    .await
    .unwrap();
    assert!(seen.was_dry_run("dry"));
    assert!(cms.get_opt("dry").await.unwrap().is_none());
    // Readiness counts the webhook server.
    let endpoints = manager.served_at().unwrap();
    let (status, body) = http_get(endpoints, "/readyz?verbose").await;
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("check webhooks: ok"), "{body}");
    let text = scrape(&registry);
    for id in ["a", "b", "c"] {
        let answered = sample(
            &text,
            "controller_runtime_webhook_requests_total",
            &[
                ("webhook", "owners.fleet.example.com"),
                ("code", "200"),
                ("cluster", id),
            ],
        );
        assert!(answered.is_some_and(|n| n >= 3.0), "{id}: {answered:?}");
    }

    // A handler's error: a denial with status 500 under Fail, an allowed answer under Ignore.
    let (code, _, message) = create(
        &admins[1],
        &cm("broken-strict", &["strict", "broken"], None),
    )
    .await
    .unwrap_err();
    assert_eq!(code, 500, "{message}");
    assert!(
        message
            .contains("webhook strict.fleet.example.com failed: the policy store is unreachable"),
        "{message}"
    );
    create(
        &admins[1],
        &cm("broken-lenient", &["lenient", "broken"], None),
    )
    .await
    .unwrap();
    assert!(seen.has("lenient", "a", "broken-lenient"));

    // A fourth cluster engaged at run time, with an id a URL path cannot carry as it is (as
    // the Cluster API and Cluster Inventory providers' `namespace/name`): installed and served.
    provider.add(member("fleet/d", &c0)).unwrap();
    let config = installed(&admins[0], "fleet/d").await;
    let url = config.webhooks.unwrap()[0]
        .client_config
        .url
        .clone()
        .unwrap();
    assert!(!url.contains("fleet/d") && !url.contains('%'), "{url}");
    let created = create(&admins[0], &cm("late", &[MANAGED], None))
        .await
        .unwrap();
    assert!(created.annotations().contains_key(OWNER));
    assert!(seen.has("defaults", "fleet/d", "late"));

    // `b` replaced under its id (other credentials): its configuration stays as it was.
    let before = configs(&admins[2]).get(CONFIGURATION).await.unwrap();
    let other = c2.add_user("b-admin", &["system:masters"]).unwrap();
    let replaced = Cluster::from_config(name("b"), other.config()).unwrap();
    assert_eq!(
        provider.add(replaced).unwrap(),
        multicluster_runtime::Engaged::Replaced
    );
    create(&admins[2], &cm("after-replacement", &[MANAGED], None))
        .await
        .unwrap();
    assert!(seen.has("defaults", "b", "after-replacement"));
    let after = configs(&admins[2]).get(CONFIGURATION).await.unwrap();
    assert_eq!(
        after.uid(),
        before.uid(),
        "b's configuration was not removed"
    );

    // A forged route: b's administrator points a webhook at a's id with b's token (all they
    // can read). Refused before any handler, so the write fails under Fail.
    let b_url = manager
        .webhook_url(&name("b"), "owners.fleet.example.com")
        .unwrap();
    let forged = b_url.replace("/admission/b/", "/admission/a/");
    let b_config = configs(&admins[2]).get(CONFIGURATION).await.unwrap();
    hand_written(
        &admins[2],
        &b_config,
        "forged",
        Some(forged),
        Some("forged"),
    )
    .await;
    let refused_before = sample(
        &scrape(&registry),
        "multicluster_runtime_webhook_refused_total",
        &[("reason", "bad_token")],
    )
    .unwrap_or(0.0);
    let (code, _, message) = create(&admins[2], &cm("forged-object", &["forged"], Some("x")))
        .await
        .unwrap_err();
    assert_eq!(code, 500, "{message}");
    assert!(message.contains("failed calling webhook"), "{message}");
    assert!(
        seen.of_name("forged-object").is_empty(),
        "no handler saw the forged review: {:?}",
        seen.of_name("forged-object")
    );
    let refused = sample(
        &scrape(&registry),
        "multicluster_runtime_webhook_refused_total",
        &[("reason", "bad_token")],
    )
    .unwrap_or(0.0);
    assert!(refused > refused_before, "{refused_before} -> {refused}");
    configs(&admins[2])
        .delete("forged", &Default::default())
        .await
        .unwrap();

    // `c` disengaged for good: its configurations removed; its old URL (written back by
    // its administrator) is refused as an unknown cluster.
    let c_url = manager
        .webhook_url(&name("c"), "owners.fleet.example.com")
        .unwrap();
    let stale = configs(&admins[3]).get(CONFIGURATION).await.unwrap();
    assert!(provider.remove(&name("c")));
    eventually(30, "c's configurations removed", async || {
        matches!(configs(&admins[3]).get_opt(CONFIGURATION).await, Ok(None))
            && matches!(
                mutating_configs(&admins[3]).get_opt(CONFIGURATION).await,
                Ok(None)
            )
    })
    .await;
    let carried = hand_written(&admins[3], &stale, "stale", None, None).await;
    assert_eq!(carried, c_url);
    let (code, _, message) = create(&admins[3], &cm("after-leaving", &[MANAGED], Some("x")))
        .await
        .unwrap_err();
    assert_eq!(code, 500, "{message}");
    assert!(seen.of_name("after-leaving").is_empty());
    assert!(
        sample(
            &scrape(&registry),
            "multicluster_runtime_webhook_refused_total",
            &[("reason", "unknown_cluster")],
        )
        .is_some_and(|n| n >= 1.0)
    );
    configs(&admins[3])
        .delete("stale", &Default::default())
        .await
        .unwrap();

    // A member whose identity may not install: an Event on the host and a metric; the
    // others are served meanwhile; once allowed, it is installed.
    let nobody = c3.add_user("nobody", &[]).unwrap();
    provider
        .add(Cluster::from_config(name("e"), nobody.config()).unwrap())
        .unwrap();
    eventually(30, "the install failure counted", async || {
        sample(
            &scrape(&registry),
            "multicluster_runtime_webhook_install_failures_total",
            &[("cluster", "e")],
        )
        .is_some_and(|n| n >= 1.0)
    })
    .await;
    eventually(
        30,
        "an Event on the host's webhook Secret naming the cluster",
        async || {
            has_event(
                &admins[0],
                "default",
                "WebhookInstallFailed",
                "multicluster-runtime-webhook",
                "cluster e",
            )
            .await
        },
    )
    .await;
    create(&admins[1], &cm("meanwhile", &[MANAGED], None))
        .await
        .unwrap();
    assert!(seen.has("defaults", "a", "meanwhile"));
    allow_webhook_configurations(&admins[3], "nobody").await;
    installed(&admins[3], "e").await;

    // Stopped while a review is in flight: it is answered before the server goes (the
    // write succeeds); the configurations stay (a restart is not a departure); with the
    // server down, Fail refuses writes and Ignore lets them through.
    let admin = admins[1].clone();
    let in_flight =
        tokio::spawn(async move { create(&admin, &cm("in-flight", &["slow"], None)).await });
    seen.2.notified().await;
    manager.shutdown();
    in_flight.await.unwrap().unwrap();
    tokio::time::timeout(Duration::from_secs(30), run)
        .await
        .unwrap()
        .unwrap();
    installed(&admins[1], "a after the stop").await;
    let (code, reason, message) = create(&admins[1], &cm("down-strict", &["strict"], None))
        .await
        .unwrap_err();
    assert_eq!((code, reason.as_str()), (500, "InternalError"), "{message}");
    assert!(
        message.contains("failed calling webhook \"strict.fleet.example.com\""),
        "{message}"
    );
    create(&admins[1], &cm("down-lenient", &["lenient"], None))
        .await
        .unwrap();
    assert!(seen.of_name("down-lenient").is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_only_webhooks_turn_over_their_ca_without_a_failed_admission() {
    let env = TestEnv::start().await.unwrap();
    let c0 = env.cluster(0).unwrap();
    let admin = c0.client().unwrap();
    create_namespace(&admin, NS).await;
    let provider = Clusters::new();
    provider
        .add(Cluster::from_config(name("only"), c0.config()).unwrap())
        .unwrap();
    let port = free_port();
    let seen = Arc::new(Seen::default());
    let mut registry = prometheus_client::registry::Registry::default();
    let metrics = Metrics::new(&mut registry);
    // Host only, as Go's multicluster-runtime serves webhooks: the fleet's cluster `only`
    // (the same API server here) is neither installed nor served. A CA of 12 s: the next
    // one joins the bundle at 8 s and signs from 10 s on; serving certificates of 6 s are
    // made again every 4 s.
    let manager = Arc::new(
        Manager::new(provider)
            .with_local(Cluster::from_config(name("host"), c0.config()).unwrap())
            .metrics(metrics)
            .webhooks(
                webhooks(port, seen.clone())
                    .install(Install::Host)
                    .validity(Duration::from_secs(12), Duration::from_secs(6))
                    .secret(Some(NS.into()), "rotating"),
            ),
    );
    let run = spawn_manager(&manager);
    let first = installed(&admin, "the host").await;
    let url = first.webhooks.as_ref().unwrap()[0]
        .client_config
        .url
        .clone()
        .unwrap();
    assert!(url.contains("/admission/host/"), "{url}");
    // The fleet cluster's own route, written by hand, is refused: not served in this mode.
    let only = manager.webhook_url(&name("only"), "owners.fleet.example.com");
    hand_written(&admin, &first, "member", only, Some("member")).await;
    let (code, _, message) = create(&admin, &cm("from-member", &["member"], Some("x")))
        .await
        .unwrap_err();
    assert_eq!(code, 500, "{message}");
    assert!(seen.of_name("from-member").is_empty());
    assert!(
        sample(
            &scrape(&registry),
            "multicluster_runtime_webhook_refused_total",
            &[("reason", "unknown_cluster")],
        )
        .is_some_and(|n| n >= 1.0)
    );
    configs(&admin)
        .delete("member", &Default::default())
        .await
        .unwrap();
    let first_bundle = first.webhooks.unwrap()[0]
        .client_config
        .ca_bundle
        .clone()
        .unwrap();
    let first_ca = manager.webhook_ca_bundle().unwrap();
    // Admissions go on while the CA turns over: each one mutated and allowed.
    let mut admitted = 0;
    let mut bundles = vec![first_bundle.clone()];
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let object = cm(&format!("rotation-{admitted}"), &[MANAGED], None);
        let created = create(&admin, &object)
            .await
            .unwrap_or_else(|e| panic!("admission {admitted} failed during the rotation: {e:?}"));
        assert!(created.annotations().contains_key(OWNER));
        admitted += 1;
        let bundle = configs(&admin)
            .get(CONFIGURATION)
            .await
            .unwrap()
            .webhooks
            .unwrap()[0]
            .client_config
            .ca_bundle
            .clone()
            .unwrap();
        if bundles.last() != Some(&bundle) {
            bundles.push(bundle);
        }
        // Done once the first CA has left the bundle: the new one signs, everywhere.
        let current = manager.webhook_ca_bundle().unwrap();
        let first_pem = first_ca.trim();
        if !current.contains(first_pem) && bundles.len() >= 3 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the CA did not turn over: {} bundles seen",
            bundles.len()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(admitted > 10, "{admitted} admissions");
    let secret = Api::<Secret>::namespaced(admin.clone(), NS)
        .get("rotating")
        .await
        .unwrap();
    assert!(secret.data.unwrap().contains_key("route.key"));
    manager.shutdown();
    tokio::time::timeout(Duration::from_secs(30), run)
        .await
        .unwrap()
        .unwrap();
}

/// A CA and a serving certificate for 127.0.0.1 it signs: (CA PEM, certificate PEM, key PEM).
fn issued(generation: u32) -> (String, String, String) {
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.distinguished_name.push(
        rcgen::DnType::CommonName,
        format!("test issuer {generation}"),
    );
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca_params.key_usages = vec![
        rcgen::KeyUsagePurpose::KeyCertSign,
        rcgen::KeyUsagePurpose::DigitalSignature,
    ];
    let ca = ca_params.self_signed(&ca_key).unwrap();
    let issuer = rcgen::Issuer::new(ca_params, ca_key);
    let key = rcgen::KeyPair::generate().unwrap();
    let mut params = rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()]).unwrap();
    params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
    let cert = params.signed_by(&key, &issuer).unwrap();
    (ca.pem(), cert.pem(), key.serialize_pem())
}

/// Writes `files` (CA, certificate, key) into `dir` as a mounted Secret changes: each
/// replaced at once (a new file renamed over the old).
fn write_files(dir: &std::path::Path, (ca, cert, key): &(String, String, String)) {
    for (name, content) in [("ca.crt", ca), ("tls.crt", cert), ("tls.key", key)] {
        let tmp = dir.join(format!(".{name}.new"));
        std::fs::write(&tmp, content).unwrap();
        std::fs::rename(&tmp, dir.join(name)).unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificate_files_from_a_new_ca_are_served_without_a_failed_admission() {
    let env = TestEnv::start().await.unwrap();
    let c0 = env.cluster(0).unwrap();
    let admin = c0.client().unwrap();
    create_namespace(&admin, NS).await;
    let dir = tempfile::tempdir().unwrap();
    let first = issued(1);
    write_files(dir.path(), &first);
    let port = free_port();
    let seen = Arc::new(Seen::default());
    // Files as cert-manager keeps them in a mounted Secret; the route key in the host Secret.
    let manager = Arc::new(
        Manager::new(Clusters::<ClusterName>::new())
            .with_local(Cluster::from_config(name("host"), c0.config()).unwrap())
            .webhooks(
                webhooks(port, seen.clone())
                    .install(Install::Host)
                    .secret(Some(NS.into()), "files-route")
                    .certificate_files(
                        dir.path().join("tls.crt"),
                        dir.path().join("tls.key"),
                        dir.path().join("ca.crt"),
                    ),
            ),
    );
    let run = spawn_manager(&manager);
    installed(&admin, "the host").await;
    // The issuer's key rotates (cert-manager's `rotationPolicy: Always` on its CA): a new
    // CA and a certificate it signs, at once. Admissions go on throughout.
    let second = issued(2);
    write_files(dir.path(), &second);
    let mut admitted = 0;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    let mut saw_both = false;
    loop {
        let object = cm(&format!("files-{admitted}"), &[MANAGED], None);
        create(&admin, &object).await.unwrap_or_else(|e| {
            panic!("admission {admitted} failed while the CA turned over: {e:?}")
        });
        admitted += 1;
        let bundle = manager.webhook_ca_bundle().unwrap();
        let (old, new) = (
            bundle.contains(first.0.trim()),
            bundle.contains(second.0.trim()),
        );
        saw_both |= old && new;
        // Done once the old CA has left the bundle: the new one's certificate is served.
        if new && !old {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the CA did not turn over"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        saw_both,
        "the new CA joined the bundle beside the old one first"
    );
    assert!(admitted > 10, "{admitted} admissions");
    // And after it, still admitted.
    create(&admin, &cm("files-after", &[MANAGED], None))
        .await
        .unwrap();
    manager.shutdown();
    tokio::time::timeout(Duration::from_secs(30), run)
        .await
        .unwrap()
        .unwrap();
}

/// POSTs an `AdmissionReview` of a ConfigMap to `url` as a member's API server would (any
/// certificate trusted): the HTTP status.
async fn post_review(url: &str) -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let path = url.trim_start_matches("https://127.0.0.1:");
    let path = &path[path.find('/').unwrap()..];
    let mut review = config_map_review("by-hand", NS, serde_json::json!({}));
    review["request"]["object"]["metadata"]["annotations"] = serde_json::json!({OWNER: "x"});
    let body = serde_json::to_vec(&review).unwrap();
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port_of(url)))
        .await
        .unwrap();
    let mut tls = any_certificate_tls()
        .connect(
            rustls::pki_types::ServerName::try_from("localhost").unwrap(),
            tcp,
        )
        .await
        .unwrap();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    tls.write_all(head.as_bytes()).await.unwrap();
    tls.write_all(&body).await.unwrap();
    tls.flush().await.unwrap();
    let mut answer = Vec::new();
    let _ = tls.read_to_end(&mut answer).await;
    String::from_utf8_lossy(&answer)
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_route_key_turns_over_without_a_failed_admission_and_old_urls_stop_working() {
    let env = TestEnv::builder().clusters(2).start().await.unwrap();
    let [c0, c1] = [0, 1].map(|i| env.cluster(i).unwrap());
    let member = c1.client().unwrap();
    create_namespace(&member, NS).await;
    let provider = Clusters::new();
    provider
        .add(Cluster::from_config(name("a"), c1.config()).unwrap())
        .unwrap();
    let port = free_port();
    let seen = Arc::new(Seen::default());
    // A turn of 6 s: the next key is made at 3 s, makes the URLs from 6 s on; the one before
    // it is accepted until 12 s.
    let manager = Arc::new(
        Manager::new(provider)
            .with_local(Cluster::from_config(name("host"), c0.config()).unwrap())
            .webhooks(webhooks(port, seen.clone()).route_rotation(Some(Duration::from_secs(6)))),
    );
    let run = spawn_manager(&manager);
    let url_now = async || {
        configs(&member)
            .get(CONFIGURATION)
            .await
            .unwrap()
            .webhooks
            .unwrap()[0]
            .client_config
            .url
            .clone()
            .unwrap()
    };
    installed(&member, "a").await;
    let mut urls = vec![url_now().await];
    assert_eq!(post_review(&urls[0]).await, 200);
    // Admissions go on while the key turns over twice: each one mutated and allowed, and
    // the member given each new URL.
    let mut admitted = 0;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while urls.len() < 3 {
        let object = cm(&format!("turn-{admitted}"), &[MANAGED], None);
        let created = create(&member, &object)
            .await
            .unwrap_or_else(|e| panic!("admission {admitted} failed during the turnover: {e:?}"));
        assert!(created.annotations().contains_key(OWNER));
        admitted += 1;
        let url = url_now().await;
        if urls.last() != Some(&url) {
            urls.push(url);
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the route key did not turn over twice: {} URLs seen",
            urls.len()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(admitted > 10, "{admitted} admissions");
    // The second turn has begun: its URL and the one before are accepted, the first is not
    // (once every replica has read the Secret again: within a check).
    assert_eq!(post_review(&urls[2]).await, 200);
    assert_eq!(post_review(&urls[1]).await, 200);
    eventually(5, "the first URL refused", async || {
        post_review(&urls[0]).await == 403
    })
    .await;
    // The keys live in the host Secret, for every replica.
    let secret = Api::<Secret>::namespaced(c0.client().unwrap(), "default")
        .get("multicluster-runtime-webhook")
        .await
        .unwrap();
    let data = secret.data.unwrap();
    assert!(data.contains_key("route.key") && data.contains_key("route-previous.key"));
    manager.shutdown();
    tokio::time::timeout(Duration::from_secs(30), run)
        .await
        .unwrap()
        .unwrap();
}

/// The port of a webhook URL (`https://127.0.0.1:<port>/...`).
fn port_of(url: &str) -> u16 {
    url.trim_start_matches("https://127.0.0.1:")
        .split('/')
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sharded_replicas_install_what_they_own_and_serve_every_cluster() {
    use multicluster_runtime::{LeaseTiming, Sharding};
    let env = TestEnv::builder().clusters(3).start().await.unwrap();
    let [c0, c1, c2] = [0, 1, 2].map(|i| env.cluster(i).unwrap());
    let host = c0.client().unwrap();
    let members = [("x", c1.client().unwrap()), ("y", c2.client().unwrap())];
    for (_, admin) in &members {
        create_namespace(admin, NS).await;
    }
    let timing = LeaseTiming::default()
        .lease_duration(Duration::from_secs(6))
        .renew_deadline(Duration::from_secs(4))
        .retry_period(Duration::from_secs(1));
    let replica = |id: &str| {
        let provider = Clusters::new();
        for (cluster, tc) in [("x", &c1), ("y", &c2)] {
            provider
                .add(Cluster::from_config(name(cluster), tc.config()).unwrap())
                .unwrap();
        }
        let port = free_port();
        let seen = Arc::new(Seen::default());
        let manager = Arc::new(
            Manager::new(provider)
                .with_local(Cluster::new(name("host"), host.clone()))
                .graceful_timeout(Duration::from_secs(5))
                .sharding(
                    Sharding::new(host.clone(), "default", "hooks")
                        .identity(id)
                        .timing(timing),
                )
                .webhooks(webhooks(port, seen.clone())),
        );
        (manager, port, seen)
    };
    let replicas = [replica("r1"), replica("r2")];
    let runs: Vec<_> = replicas.iter().map(|(m, _, _)| spawn_manager(m)).collect();
    // Each cluster's configuration points at the replica that owns it, once both run.
    let owner_port = |id: &str| {
        let owners: Vec<u16> = replicas
            .iter()
            .filter(|(m, _, _)| m.fleet().get(&name(id)).is_some())
            .map(|(_, port, _)| *port)
            .collect();
        (owners.len() == 1).then(|| owners[0])
    };
    eventually(60, "each cluster installed by its owner", async || {
        let both_peers = replicas
            .iter()
            .all(|(m, _, _)| m.shard_status().is_some_and(|s| s.peers.len() == 2));
        let mut right = both_peers;
        for (id, admin) in &members {
            let installed = configs(admin)
                .get_opt(CONFIGURATION)
                .await
                .ok()
                .flatten()
                .and_then(|c| c.webhooks?.first()?.client_config.url.clone());
            right &= match (installed, owner_port(id)) {
                (Some(url), Some(port)) => port_of(&url) == port,
                _ => false,
            };
        }
        right
    })
    .await;
    // Both replicas route with the key of the shared Secret.
    let token_path = |m: &Manager<Clusters<ClusterName>>| {
        let url = m
            .webhook_url(&name("x"), "owners.fleet.example.com")
            .unwrap();
        url.split_once("/admission/").unwrap().1.to_string()
    };
    assert_eq!(token_path(&replicas[0].0), token_path(&replicas[1].0));
    // A review of `x` sent to the replica that does not own it is served there.
    let owner = owner_port("x").unwrap();
    let (other, other_seen) = replicas
        .iter()
        .find(|(_, port, _)| *port != owner)
        .map(|(m, _, seen)| (m, seen))
        .unwrap();
    let admin = &members[0].1;
    let x_config = configs(admin).get(CONFIGURATION).await.unwrap();
    let url = other.webhook_url(&name("x"), "owners.fleet.example.com");
    hand_written(admin, &x_config, "via-other", url, Some("via-other")).await;
    let (code, _, message) = create(admin, &cm("served-elsewhere", &["via-other"], Some("")))
        .await
        .unwrap_err();
    assert_eq!(code, 403, "{message}");
    assert!(
        message.contains("in cluster x: ConfigMap served-elsewhere has no owner"),
        "{message}"
    );
    assert!(other_seen.has("owners", "x", "served-elsewhere"));
    for (manager, _, _) in &replicas {
        manager.shutdown();
    }
    for run in runs {
        tokio::time::timeout(Duration::from_secs(30), run)
            .await
            .unwrap()
            .unwrap();
    }
}
