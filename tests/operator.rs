//! The production-shaped example (examples/operator.rs) run as processes with the manifests
//! of deploy/: it copies and reports with the deploy RBAC and fails over (SIGKILL of the
//! leader, a clean exit on SIGTERM), reports a cluster engaged later in an Event of its own,
//! runs as deployed (HTTPS endpoints, metrics for the scraper only) and repairs drift at once,
//! breaks without any one rule of the deploy RBAC, and copies into namespaces as clusters; and
//! what deploy/operator.yaml's NetworkPolicy admits.

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::audited::labelled_cm;
use common::operator_process::{OperatorProcess, configmap_in, create_original};
use common::*;
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::api::rbac::v1::{PolicyRule, Role, RoleBinding, RoleRef, Subject};
use kube::api::{Api, DeleteParams, ObjectMeta, Patch, PatchParams, PostParams};
use multicluster_runtime_testenv::TestEnv;

/// The operator's NetworkPolicy admits by what only an administrator can set: a namespace by
/// its name (the `kubernetes.io/metadata.name` label the API server keeps), pods by their
/// labels in it. A label of one's choosing on a namespace would admit whoever may label or
/// create one. (The policy itself is enforced by a network plugin, which the test control
/// planes have none of: this checks what it says.)
#[test]
fn the_network_policy_admits_the_scraper_by_what_only_admins_set() {
    use k8s_openapi::api::networking::v1::NetworkPolicy;
    let docs: Vec<serde_json::Value> =
        serde_saphyr::from_multiple(&manifest("operator.yaml")).unwrap();
    let policy: NetworkPolicy = docs
        .into_iter()
        .find(|d| d["kind"] == "NetworkPolicy")
        .map(|d| serde_json::from_value(d).unwrap())
        .expect("a NetworkPolicy");
    let spec = policy.spec.unwrap();
    let ingress = spec.ingress.unwrap();
    assert!(!ingress.is_empty());
    for rule in ingress {
        for peer in rule.from.unwrap() {
            let namespaces = peer.namespace_selector.expect("a namespace selector");
            let labels = namespaces.match_labels.unwrap_or_default();
            assert_eq!(
                labels.keys().collect::<Vec<_>>(),
                ["kubernetes.io/metadata.name"],
                "namespaces chosen by a label anyone with namespaces rights may set"
            );
            assert!(namespaces.match_expressions.is_none());
            assert!(
                peer.pod_selector
                    .is_some_and(|p| p.match_labels.is_some_and(|l| !l.is_empty())),
                "every pod of the namespace admitted"
            );
        }
    }
}

/// The member cluster `east` as a kubeconfig Secret in `namespace` of the host, the way the
/// secrets provider finds it.
async fn member_secret(host: &kube::Client, namespace: &str, kubeconfig: &str) {
    let secret = k8s_openapi::api::core::v1::Secret {
        metadata: ObjectMeta {
            name: Some("east".into()),
            namespace: Some(namespace.into()),
            labels: Some(BTreeMap::from([(
                multicluster_runtime::providers::KUBECONFIG_SECRET_LABEL.into(),
                "true".into(),
            )])),
            ..Default::default()
        },
        string_data: Some(BTreeMap::from([(
            "kubeconfig".into(),
            kubeconfig.to_string(),
        )])),
        ..Default::default()
    };
    Api::<k8s_openapi::api::core::v1::Secret>::namespaced(host.clone(), namespace)
        .create(&PostParams::default(), &secret)
        .await
        .unwrap();
}

/// Two apiservers with `deploy/` applied: the host (`operator.yaml`) and a member
/// (`member.yaml`), and the ServiceAccounts' identities on each.
struct Deployed {
    env: TestEnv,
    host: kube::Client,
    member: kube::Client,
    operator_user: multicluster_runtime_testenv::TestUser,
    member_user: multicluster_runtime_testenv::TestUser,
}

async fn deployed() -> Deployed {
    let env = TestEnv::builder().clusters(2).start().await.unwrap();
    let (host_tc, member_tc) = (env.cluster(0).unwrap(), env.cluster(1).unwrap());
    let (host, member) = (host_tc.client().unwrap(), member_tc.client().unwrap());
    apply_manifests(&host, &manifest("operator.yaml")).await;
    apply_manifests(&member, &manifest("member.yaml")).await;
    // The ServiceAccounts' identities: client certificates with their user names and groups,
    // which RBAC matches as it matches the accounts' tokens.
    let sa_groups = [
        "system:serviceaccounts",
        "system:serviceaccounts:mcr-system",
    ];
    let operator_user = host_tc
        .add_user("system:serviceaccount:mcr-system:mcr-operator", &sa_groups)
        .unwrap();
    let member_user = member_tc
        .add_user("system:serviceaccount:mcr-system:mcr-member", &sa_groups)
        .unwrap();
    Deployed {
        env,
        host,
        member,
        operator_user,
        member_user,
    }
}

#[tokio::test]
async fn the_example_operator_reports_a_cluster_engaged_later_in_an_event_of_its_own() {
    let binary = operator_binary();
    let Deployed {
        env: _env,
        host,
        member,
        operator_user,
        member_user,
    } = deployed().await;
    create_original(&host).await;
    let dir = tempfile::tempdir().unwrap();
    let _operator = OperatorProcess::start(
        &binary,
        operator_user.kubeconfig_path(),
        "replica-a",
        dir.path(),
    );
    // No cluster yet: the operator reports that, before any cluster is engaged.
    eventually(60, "the report of no cluster", async || {
        has_event(
            &host,
            "mcr-system",
            "Copied",
            "settings",
            "copied into 0 clusters",
        )
        .await
    })
    .await;
    // A cluster engaged later: its copy, and the change reported in an Event of its own
    // (kube-runtime's recorder would have counted it into the first one's series, note and all).
    member_secret(&host, "mcr-system", member_user.kubeconfig()).await;
    eventually(
        60,
        "the copy in the member and the Event naming it",
        async || {
            configmap_in(&member, "mcr-system", "settings")
                .await
                .is_some()
                && has_event(
                    &host,
                    "mcr-system",
                    "Copied",
                    "settings",
                    "copied into 1 clusters: east",
                )
                .await
        },
    )
    .await;
}

#[tokio::test]
async fn the_example_operator_runs_with_the_deploy_rbac_copies_reports_and_fails_over() {
    let binary = operator_binary();
    let Deployed {
        env: _env,
        host,
        member,
        operator_user,
        member_user,
    } = deployed().await;
    // The member as a kubeconfig Secret, the way the secrets provider finds it.
    member_secret(&host, "mcr-system", member_user.kubeconfig()).await;
    let originals: Api<ConfigMap> = Api::namespaced(host.clone(), "mcr-system");
    create_original(&host).await;

    let dir = tempfile::tempdir().unwrap();
    let mut a = OperatorProcess::start(
        &binary,
        operator_user.kubeconfig_path(),
        "replica-a",
        dir.path(),
    );
    eventually(60, "replica-a leads", async || a.leads().await).await;
    let mut b = OperatorProcess::start(
        &binary,
        operator_user.kubeconfig_path(),
        "replica-b",
        dir.path(),
    );

    // Copied into the member as its ServiceAccount, reported back on the host.
    eventually(60, "the copy in the member", async || {
        configmap_in(&member, "mcr-system", "settings")
            .await
            .and_then(|c| c.data)
            == Some(BTreeMap::from([("colour".into(), "blue".into())]))
    })
    .await;
    eventually(30, "the copied-to annotation and Event", async || {
        let annotated = configmap_in(&host, "mcr-system", "settings")
            .await
            .and_then(|c| c.metadata.annotations)
            .and_then(|a| a.get("mcr.example.io/copied-to").cloned());
        annotated.as_deref() == Some("east")
            && has_event(
                &host,
                "mcr-system",
                "Copied",
                "settings",
                "copied into 1 clusters: east",
            )
            .await
    })
    .await;
    // Both replicas are ready (readiness does not depend on leading), b does not lead.
    eventually(30, "both ready", async || {
        http_get_opt(a.addr, "/readyz").await.map(|r| r.0) == Ok(200)
            && http_get_opt(b.addr, "/readyz").await.map(|r| r.0) == Ok(200)
    })
    .await;
    assert!(!b.leads().await, "b waits while a leads");
    // JSON logs, one object per line.
    let log = std::fs::read_to_string(&a.log).unwrap();
    let first = log.lines().next().expect("a logged");
    let line: serde_json::Value =
        serde_json::from_str(first).unwrap_or_else(|e| panic!("{e}: {first}"));
    assert!(
        line.get("level").is_some() && line.get("fields").is_some(),
        "{first}"
    );

    // SIGKILL the leader: b takes over within the lease duration (4 s) + 5 s.
    let killed = Instant::now();
    a.child.start_kill().unwrap();
    a.child.wait().await.unwrap();
    eventually(30, "b leads", async || b.leads().await).await;
    let took_over = killed.elapsed();
    println!("b led {took_over:?} after a was killed");
    assert!(took_over <= Duration::from_secs(9), "{took_over:?}");
    // And acts: a change of the original reaches the member.
    let patch = serde_json::json!({"data": {"colour": "green"}});
    originals
        .patch(
            "settings",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&patch),
        )
        .await
        .unwrap();
    eventually(30, "the new data in the member", async || {
        configmap_in(&member, "mcr-system", "settings")
            .await
            .and_then(|c| c.data)
            == Some(BTreeMap::from([("colour".into(), "green".into())]))
    })
    .await;

    // SIGTERM: b drains, gives the Lease up and exits cleanly.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(b.child.id().unwrap() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let status = tokio::time::timeout(Duration::from_secs(30), b.child.wait())
        .await
        .expect("b exits after SIGTERM")
        .unwrap();
    assert!(status.success(), "{status:?}");
    let lease =
        Api::<k8s_openapi::api::coordination::v1::Lease>::namespaced(host.clone(), "mcr-system")
            .get("mcr-operator")
            .await
            .unwrap();
    let holder = lease
        .spec
        .and_then(|s| s.holder_identity)
        .unwrap_or_default();
    assert!(holder.is_empty(), "the Lease was released: {holder:?}");
}

#[tokio::test]
async fn the_deploy_rbac_suffices_the_operator_runs_as_deployed_and_repairs_drift_at_once() {
    let binary = operator_binary();
    let Deployed {
        env: _env,
        host,
        member,
        operator_user,
        member_user,
    } = deployed().await;
    // A scraper, as Prometheus would be: bound to the metrics reader the manifests ship.
    let scraper = account_token(&host, "prometheus").await;
    {
        use k8s_openapi::api::rbac::v1::ClusterRoleBinding;
        let binding = ClusterRoleBinding {
            metadata: ObjectMeta {
                name: Some("prometheus-mcr-metrics".into()),
                ..Default::default()
            },
            role_ref: RoleRef {
                api_group: Some("rbac.authorization.k8s.io".into()),
                kind: "ClusterRole".into(),
                name: "mcr-operator-metrics-reader".into(),
            },
            subjects: Some(vec![Subject {
                kind: "ServiceAccount".into(),
                name: "prometheus".into(),
                namespace: Some("default".into()),
                ..Default::default()
            }]),
        };
        Api::<ClusterRoleBinding>::all(host.clone())
            .create(&PostParams::default(), &binding)
            .await
            .unwrap();
    }
    member_secret(&host, "mcr-system", member_user.kubeconfig()).await;
    create_original(&host).await;
    let dir = tempfile::tempdir().unwrap();
    // As the Deployment runs it (HTTPS, tokens checked by the host, copies in mcr-system),
    // resyncing only after the test is over: whatever is repaired is repaired by the watch.
    let operator = OperatorProcess::as_deployed(
        &binary,
        operator_user.kubeconfig_path(),
        "deployed",
        dir.path(),
    );
    let blue = Some(BTreeMap::from([("colour".to_string(), "blue".to_string())]));
    let copied = async || {
        configmap_in(&member, "mcr-system", "settings")
            .await
            .and_then(|c| c.data)
            == blue
    };
    eventually(60, "the copy in the member", copied).await;
    let readiness = async || https_get(operator.addr, "/readyz?verbose", Some(&scraper)).await;
    eventually(30, "ready, every watch listed", async || {
        let (status, detail, _) = readiness().await;
        status == 200 && detail.contains("host host: ok") && detail.contains("cluster east: ok")
    })
    .await;

    // Drift: a copy edited in the member is put back, then one deleted is made again, each
    // well before a resync (the operator resyncs every 2 s in the other tests; here the
    // watch of the copies must do it: the deadline is 30 s, the resync 600 s).
    let copies: Api<ConfigMap> = Api::namespaced(member.clone(), "mcr-system");
    copies
        .patch(
            "settings",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"data": {"colour": "red"}})),
        )
        .await
        .unwrap();
    eventually(30, "the edited copy put back", copied).await;
    copies
        .delete("settings", &DeleteParams::default())
        .await
        .unwrap();
    eventually(30, "the deleted copy made again", copied).await;

    // Metrics for the scraper only; nothing was refused anywhere.
    assert_eq!(https_get(operator.addr, "/metrics", None).await.0, 401);
    let (status, metrics, _) = https_get(operator.addr, "/metrics", Some(&scraper)).await;
    assert_eq!(status, 200, "{metrics}");
    let (_, detail, _) = readiness().await;
    let log = std::fs::read_to_string(&operator.log).unwrap();
    for text in [&detail, &log] {
        assert!(
            !text.to_lowercase().contains("forbidden"),
            "a refusal under the deploy RBAC: {text}"
        );
    }
}

/// The rules of the RBAC object `kind`/`name` in the manifests `yaml`.
fn rules_of(yaml: &str, kind: &str, name: &str) -> Vec<PolicyRule> {
    let docs: Vec<serde_json::Value> = serde_saphyr::from_multiple(yaml).unwrap();
    let doc = docs
        .into_iter()
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("{kind} {name} in the manifests"));
    serde_json::from_value(doc["rules"].clone()).unwrap()
}

/// Grants `rules` to `user`: cluster-wide (`namespace` None) or in `namespace`.
async fn grant(client: &kube::Client, user: &str, namespace: Option<&str>, rules: Vec<PolicyRule>) {
    use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
    let meta = |ns: Option<&str>| ObjectMeta {
        name: Some(format!("grant-{user}")),
        namespace: ns.map(str::to_string),
        ..Default::default()
    };
    let subjects = Some(vec![Subject {
        kind: "User".into(),
        name: user.into(),
        api_group: Some("rbac.authorization.k8s.io".into()),
        ..Default::default()
    }]);
    let pp = PostParams::default();
    match namespace {
        None => {
            Api::<ClusterRole>::all(client.clone())
                .create(
                    &pp,
                    &ClusterRole {
                        metadata: meta(None),
                        rules: Some(rules),
                        ..Default::default()
                    },
                )
                .await
                .unwrap();
            Api::<ClusterRoleBinding>::all(client.clone())
                .create(
                    &pp,
                    &ClusterRoleBinding {
                        metadata: meta(None),
                        role_ref: RoleRef {
                            api_group: Some("rbac.authorization.k8s.io".into()),
                            kind: "ClusterRole".into(),
                            name: format!("grant-{user}"),
                        },
                        subjects,
                    },
                )
                .await
                .unwrap();
        }
        Some(ns) => {
            Api::<Role>::namespaced(client.clone(), ns)
                .create(
                    &pp,
                    &Role {
                        metadata: meta(Some(ns)),
                        rules: Some(rules),
                    },
                )
                .await
                .unwrap();
            Api::<RoleBinding>::namespaced(client.clone(), ns)
                .create(
                    &pp,
                    &RoleBinding {
                        metadata: meta(Some(ns)),
                        role_ref: RoleRef {
                            api_group: Some("rbac.authorization.k8s.io".into()),
                            kind: "Role".into(),
                            name: format!("grant-{user}"),
                        },
                        subjects,
                    },
                )
                .await
                .unwrap();
        }
    }
}

/// Whether the operator's log (or its readiness detail) shows the API server refusing one of
/// `rule`'s verbs on one of its resources.
fn refused(text: &str, rule: &PolicyRule) -> bool {
    let text = text.replace("\\\"", "\"");
    rule.verbs.iter().any(|verb| {
        rule.resources
            .iter()
            .flatten()
            .any(|resource| text.contains(&format!("cannot {verb} resource \"{resource}\"")))
    })
}

#[tokio::test]
async fn removing_any_rule_of_the_deploy_rbac_breaks_the_operator() {
    let binary = operator_binary();
    let env = TestEnv::builder().clusters(2).start().await.unwrap();
    let (host_tc, member_tc) = (env.cluster(0).unwrap(), env.cluster(1).unwrap());
    let (host, member) = (host_tc.client().unwrap(), member_tc.client().unwrap());
    let (operator_yaml, member_yaml) = (manifest("operator.yaml"), manifest("member.yaml"));
    // Every permission is a Role in the operator's namespace, on each side (the TokenReview
    // delegation of the HTTPS endpoints aside: these processes serve plain HTTP).
    let host_rules = rules_of(&operator_yaml, "Role", "mcr-operator");
    let member_rules = rules_of(&member_yaml, "Role", "mcr-member");
    // Every rule, by where it is granted.
    let mut variants = Vec::new();
    for (place, rules) in [("host", &host_rules), ("member", &member_rules)] {
        for i in 0..rules.len() {
            variants.push((place, i));
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let mut running = Vec::new();
    for (n, (place, removed)) in variants.iter().enumerate() {
        let without = |p: &str, rules: &Vec<PolicyRule>| -> Vec<PolicyRule> {
            rules
                .iter()
                .enumerate()
                .filter(|(i, _)| !(p == *place && i == removed))
                .map(|(_, r)| r.clone())
                .collect()
        };
        // Each variant in a namespace of its own (its Lease, Secret and ConfigMap), as a
        // user of its own on each side.
        let ns = format!("least-{n}");
        for client in [&host, &member] {
            create_namespace(client, &ns).await;
        }
        let (user, member_user) = (format!("least-{n}"), format!("member-least-{n}"));
        grant(&host, &user, Some(&ns), without("host", &host_rules)).await;
        grant(
            &member,
            &member_user,
            Some(&ns),
            without("member", &member_rules),
        )
        .await;
        let operator_identity = host_tc.add_user(&user, &[]).unwrap();
        let member_identity = member_tc.add_user(&member_user, &[]).unwrap();
        member_secret(&host, &ns, member_identity.kubeconfig()).await;
        // Named per variant, so no two variants apply the same copy in the member.
        let mut original =
            labelled_cm(&format!("settings-{n}"), &[("mcr.example.io/copy", "true")]);
        original.data = Some(BTreeMap::from([("colour".into(), "blue".into())]));
        Api::<ConfigMap>::namespaced(host.clone(), &ns)
            .create(&PostParams::default(), &original)
            .await
            .unwrap();
        let process = OperatorProcess::start_in(
            &binary,
            operator_identity.kubeconfig_path(),
            &user,
            &ns,
            dir.path(),
        );
        running.push((place, *removed, process));
    }

    // Each variant shows the API server refusing what its removed rule allowed.
    for (place, removed, process) in &running {
        let rule = match **place {
            "host" => &host_rules[*removed],
            _ => &member_rules[*removed],
        };
        let what = format!("{place} rule {:?} {:?}", rule.verbs, rule.resources);
        eventually(60, &format!("without the {what}: a refusal"), async || {
            let log = std::fs::read_to_string(&process.log).unwrap_or_default();
            let readiness = http_get_opt(process.addr, "/readyz?verbose")
                .await
                .map(|r| r.1)
                .unwrap_or_default();
            refused(&log, rule) || refused(&readiness, rule)
        })
        .await;
        println!("without the {what}: refused, as expected");
    }
    for (_, _, mut process) in running {
        process.child.start_kill().unwrap();
        process.child.wait().await.unwrap();
    }
}

#[tokio::test]
async fn the_example_operator_copies_into_namespaces_as_clusters() {
    let binary = operator_binary();
    let env = TestEnv::start().await.unwrap();
    let tc = env.cluster(0).unwrap();
    let host = tc.client().unwrap();
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(host.clone());
    for (name, member) in [
        ("mcr-system", false),
        ("team-a", true),
        ("team-b", true),
        ("other", false),
    ] {
        let labels =
            member.then(|| BTreeMap::from([("mcr.example.io/member".into(), "true".into())]));
        namespaces
            .create(
                &PostParams::default(),
                &k8s_openapi::api::core::v1::Namespace {
                    metadata: ObjectMeta {
                        name: Some(name.into()),
                        labels,
                        ..Default::default()
                    },
                    ..Default::default()
                },
            )
            .await
            .unwrap();
    }
    create_original(&host).await;
    let dir = tempfile::tempdir().unwrap();
    let mut child = tokio::process::Command::new(&binary)
        .arg("--kubeconfig")
        .arg(tc.kubeconfig_path())
        .args(["--provider", "namespaces", "--leader-elect", "false"])
        .arg(format!("--bind-address=127.0.0.1:{}", free_port()))
        .arg("--plain-http")
        .stdout(std::fs::File::create(dir.path().join("log")).unwrap())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    // Each member namespace is a cluster: the copy lands in it, and only there.
    eventually(60, "copies in team-a and team-b", async || {
        configmap_in(&host, "team-a", "settings").await.is_some()
            && configmap_in(&host, "team-b", "settings").await.is_some()
    })
    .await;
    eventually(30, "the copied-to annotation", async || {
        configmap_in(&host, "mcr-system", "settings")
            .await
            .and_then(|c| c.metadata.annotations)
            .and_then(|a| a.get("mcr.example.io/copied-to").cloned())
            .as_deref()
            == Some("team-a,team-b")
    })
    .await;
    // The annotation was written after both copies: a copy into `other` would have shown.
    assert!(configmap_in(&host, "other", "settings").await.is_none());
    child.start_kill().unwrap();
    child.wait().await.unwrap();
}
