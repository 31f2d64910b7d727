//! Credentials with a visible end, against a real control plane: a client certificate of two
//! minutes and a ServiceAccount token of an hour show their ends in
//! `multicluster_runtime_credential_expiry_seconds` and warn within the lead time; a
//! credential beyond it does not.

mod common;

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use common::*;
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{Secret, ServiceAccount};
use kube::ResourceExt;
use kube::api::{Api, PostParams};
use multicluster_runtime::providers::Clusters;
use multicluster_runtime::{Cluster, ClusterName, CredentialSource, Manager, Metrics};
use multicluster_runtime_testenv::TestEnv;

fn now() -> i64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

#[tokio::test]
async fn a_short_certificate_and_a_token_show_their_ends_and_warn_within_the_lead() {
    let logs = Logs::capture();
    let env = TestEnv::start().await.unwrap();
    let plane = env.cluster(0).unwrap();
    let admin = plane.client().unwrap();

    // A client certificate of two minutes.
    let short = plane
        .add_user_valid_for("cred-short", &["system:masters"], Duration::from_secs(120))
        .unwrap();
    let minted = now();
    // A ServiceAccount token of an hour; its end as the API server states it.
    service_account_token(&plane, "cred-sa").await;
    let request = TokenRequest {
        spec: Some(TokenRequestSpec {
            expiration_seconds: Some(3600),
            ..Default::default()
        }),
        ..Default::default()
    };
    let status = Api::<ServiceAccount>::namespaced(admin.clone(), "default")
        .create_token_request("cred-sa", &PostParams::default(), &request)
        .await
        .unwrap()
        .status
        .unwrap();
    let token_end = status.expiration_timestamp.clone().unwrap().0.as_second();
    let mut token_config = plane.config();
    token_config.auth_info = Default::default();
    token_config.auth_info.token = Some(status.token.clone().unwrap().into());

    let clusters = Clusters::<ClusterName>::new();
    let cert = Cluster::from_config(name("cred-cert"), short.config()).unwrap();
    let token = Cluster::from_config(name("cred-token"), token_config).unwrap();
    let lasting = Cluster::from_config(name("cred-admin"), plane.config()).unwrap();
    assert_eq!(
        cert.credential_expiry().unwrap().source,
        CredentialSource::ClientCertificate
    );
    assert_eq!(
        token.credential_expiry().unwrap().source,
        CredentialSource::Token
    );
    for cluster in [cert, token, lasting] {
        clusters.add(cluster).unwrap();
    }
    let mut registry = prometheus_client::registry::Registry::default();
    let metrics = Metrics::new(&mut registry);
    let manager = Arc::new(
        Manager::new(clusters)
            .metrics(metrics)
            .credential_warning(Duration::from_secs(2 * 3600)),
    );
    let run = spawn_manager(&manager);

    let scrape = || {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        text
    };
    let end = |text: &str, cluster: &str, source: &str| {
        sample(
            text,
            "multicluster_runtime_credential_expiry_seconds",
            &[("cluster", cluster), ("source", source)],
        )
    };
    // Sync point: every cluster's end is in the gauge, so each was weighed for a warning.
    eventually(30, "the ends of the three credentials", async || {
        let text = scrape();
        end(&text, "cred-cert", "client_certificate").is_some()
            && end(&text, "cred-token", "token").is_some()
            && end(&text, "cred-admin", "client_certificate").is_some()
    })
    .await;
    let text = scrape();
    let cert_end = end(&text, "cred-cert", "client_certificate").unwrap() as i64;
    assert!(
        (minted + 100..=minted + 130).contains(&cert_end),
        "two minutes from {minted}: {cert_end}"
    );
    assert_eq!(end(&text, "cred-token", "token").unwrap() as i64, token_end);
    let admin_end = end(&text, "cred-admin", "client_certificate").unwrap() as i64;
    assert!(admin_end > now() + 2 * 3600, "{admin_end}");

    let warned = |cluster: &str| {
        logs.lines(&[
            "WARN",
            "credential ends soon",
            &format!("cluster={cluster} "),
        ])
    };
    assert_eq!(warned("cred-cert").len(), 1);
    assert_eq!(warned("cred-token").len(), 1);
    assert!(warned("cred-admin").is_empty());
    // The line names no credential (a JWT starts with "eyJ").
    assert!(!warned("cred-token")[0].contains("eyJ"));

    manager.shutdown();
    run.await.unwrap();
    // The series go with the run.
    assert!(end(&scrape(), "cred-cert", "client_certificate").is_none());
}

/// The kubeconfig of the host Secret `mcr-system/<name>` with its token made `token`.
fn with_token(secret: &Secret, token: &str) -> String {
    let bytes = &secret.data.as_ref().unwrap()["kubeconfig"].0;
    let mut kubeconfig =
        kube::config::Kubeconfig::from_yaml(std::str::from_utf8(bytes).unwrap()).unwrap();
    kubeconfig.auth_infos[0].auth_info.as_mut().unwrap().token = Some(token.to_string().into());
    serde_json::to_string(&kubeconfig).unwrap()
}

fn token_of(secret: &Secret) -> String {
    use secrecy::ExposeSecret;
    let bytes = &secret.data.as_ref().unwrap()["kubeconfig"].0;
    let kubeconfig =
        kube::config::Kubeconfig::from_yaml(std::str::from_utf8(bytes).unwrap()).unwrap();
    kubeconfig.auth_infos[0]
        .auth_info
        .as_ref()
        .unwrap()
        .token
        .as_ref()
        .unwrap()
        .expose_secret()
        .to_string()
}

/// Who the member takes `token` for; `None` if it refuses it.
async fn who_is(plane: &multicluster_runtime_testenv::TestCluster, token: &str) -> Option<String> {
    use k8s_openapi::api::authentication::v1::SelfSubjectReview;
    let mut config = plane.config();
    config.auth_info = Default::default();
    config.auth_info.token = Some(token.to_string().into());
    let client = kube::Client::try_from(config).unwrap();
    match Api::<SelfSubjectReview>::all(client)
        .create(&PostParams::default(), &SelfSubjectReview::default())
        .await
    {
        Ok(review) => review.status?.user_info?.username,
        Err(kube::Error::Api(status)) if status.code == 401 => None,
        Err(e) => panic!("SelfSubjectReview: {e}"),
    }
}

fn rfc3339(unix: i64) -> String {
    serde_json::to_value(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
        k8s_openapi::jiff::Timestamp::from_second(unix).unwrap(),
    ))
    .unwrap()
    .as_str()
    .unwrap()
    .to_string()
}

/// A member joined with `mcr join --renewable`, its token then one of two minutes (signed by
/// the member's service-account key, as its TokenRequests are: a TokenRequest lasts ten
/// minutes at least). The operator shows the end (from the Secret's annotation), warns with a
/// WARN line and an Event on the Secret, renews the token well before its end, revokes the
/// old one (the member refuses it), and the cluster keeps reconciling past the old token's end.
#[tokio::test]
async fn a_renewable_join_token_of_two_minutes_is_renewed_and_the_cluster_reconciles_past_its_end()
{
    use multicluster_runtime::providers::{
        JoinRenewal, KubeconfigSecrets, PREVIOUS_ANCHOR_ANNOTATION, SERVICE_ACCOUNT_ANNOTATION,
        TOKEN_ANCHOR_ANNOTATION, TOKEN_EXPIRES_ANNOTATION, TOKEN_RENEWAL_ANNOTATION,
        renewal_anchors,
    };
    use multicluster_runtime::{Action, Builder, Context};
    let logs = Logs::capture();
    let mcr_bin = mcr_binary();
    let env = TestEnv::builder().clusters(2).start().await.unwrap();
    let (host_tc, member_tc) = (env.cluster(0).unwrap(), env.cluster(1).unwrap());
    let (host, member) = (host_tc.client().unwrap(), member_tc.client().unwrap());
    create_namespace(&host, "mcr-system").await;
    // What the reconciler reads, granted by join (`view` is aggregated: no controller
    // manager fills it here).
    let reader: k8s_openapi::api::rbac::v1::ClusterRole = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "configmap-reader"},
        "rules": [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list", "watch"]}],
    }))
    .unwrap();
    Api::<k8s_openapi::api::rbac::v1::ClusterRole>::all(member.clone())
        .create(&PostParams::default(), &reader)
        .await
        .unwrap();

    let dir = tempfile::tempdir().unwrap();
    let merged = kube::config::Kubeconfig::from_yaml(host_tc.kubeconfig())
        .unwrap()
        .merge(kube::config::Kubeconfig::from_yaml(member_tc.kubeconfig()).unwrap())
        .unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(&kubeconfig, serde_json::to_string(&merged).unwrap()).unwrap();
    let out = mcr(
        &mcr_bin,
        &[
            "join",
            member_tc.name(),
            "--host-context",
            host_tc.name(),
            "--kubeconfig",
            kubeconfig.to_str().unwrap(),
            "--name",
            "renewed",
            "--cluster-role",
            "configmap-reader",
            "--token-ttl",
            "1h",
            "--renewable",
        ],
    );
    assert!(out.contains("joined"), "{out}");

    // The join's token made one of two minutes, bound to the same anchor.
    let secrets: Api<Secret> = Api::namespaced(host.clone(), "mcr-system");
    let joined = secrets.get("renewed").await.unwrap();
    let annotations = joined.metadata.annotations.clone().unwrap();
    let key = annotations[TOKEN_RENEWAL_ANNOTATION].clone();
    let anchor = annotations[TOKEN_ANCHOR_ANNOTATION].clone();
    assert_eq!(
        annotations[SERVICE_ACCOUNT_ANNOTATION],
        "mcr-system/mcr-member"
    );
    let anchor_uid = Api::<Secret>::namespaced(member.clone(), "mcr-system")
        .get(&anchor)
        .await
        .unwrap()
        .metadata
        .uid
        .unwrap();
    let account_uid = Api::<ServiceAccount>::namespaced(member.clone(), "mcr-system")
        .get("mcr-member")
        .await
        .unwrap()
        .metadata
        .uid
        .unwrap();
    let minted = now();
    let short = member_tc
        .service_account_token(
            "mcr-system",
            ("mcr-member", &account_uid),
            Some((&anchor, &anchor_uid)),
            Duration::from_secs(120),
        )
        .unwrap();
    let identity = "system:serviceaccount:mcr-system:mcr-member";
    assert_eq!(who_is(&member_tc, &short).await.as_deref(), Some(identity));
    // The member granted renewal to this destination alone.
    let roles: Api<k8s_openapi::api::rbac::v1::Role> =
        Api::namespaced(member.clone(), "mcr-system");
    let renewal_role = format!("mcr-join:renewed:renewal-{key}");
    assert!(roles.get_opt(&renewal_role).await.unwrap().is_some());
    // A hostile writer of the host Secret names a Secret that is not one of this join's
    // anchors (one of the renewal names, unlabelled) as a replaced token's anchor: it is left
    // alone, and said.
    let [first_renewal, second_renewal] = renewal_anchors("renewed", &key);
    let member_secrets = Api::<Secret>::namespaced(member.clone(), "mcr-system");
    let decoy: Secret = serde_json::from_value(serde_json::json!({
        "metadata": {"name": second_renewal},
        "type": "Opaque",
    }))
    .unwrap();
    member_secrets
        .create(&PostParams::default(), &decoy)
        .await
        .unwrap();
    // The annotation says a little less than the token: the end shown is the annotation's.
    let stated_end = minted + 115;
    let patch = serde_json::json!({
        "metadata": {"annotations": {
            TOKEN_EXPIRES_ANNOTATION: rfc3339(stated_end),
            PREVIOUS_ANCHOR_ANNOTATION: second_renewal,
        }},
        "stringData": {"kubeconfig": with_token(&joined, &short)},
    });
    secrets
        .patch(
            "renewed",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&patch),
        )
        .await
        .unwrap();

    let mut registry = prometheus_client::registry::Registry::default();
    let metrics = Metrics::new(&mut registry);
    let provider = KubeconfigSecrets::new(host.clone(), "mcr-system").renew_join_tokens(
        JoinRenewal::new()
            .valid_for(Duration::from_secs(3600))
            .ahead(Duration::from_secs(80)),
    );
    let manager = Arc::new(
        Manager::new(provider)
            .metrics(metrics)
            .credential_warning(Duration::from_secs(3600)),
    );
    let (seen_tx, mut seen) = tokio::sync::mpsc::unbounded_channel::<String>();
    Builder::<_, k8s_openapi::api::core::v1::ConfigMap>::new(&manager, Default::default()).start(
        move |cm: Arc<k8s_openapi::api::core::v1::ConfigMap>, ctx: Context<ClusterName, ()>| {
            let seen_tx = seen_tx.clone();
            async move {
                let _ = seen_tx.send(format!(
                    "{}/{}",
                    ctx.cluster_id(),
                    cm.metadata.name.clone().unwrap_or_default()
                ));
                Ok::<_, kube::Error>(Action::await_change())
            }
        },
        |_, _, _| Action::requeue(Duration::from_secs(1)),
        Arc::new(()),
    );
    let run = spawn_manager(&manager);
    let cms: Api<k8s_openapi::api::core::v1::ConfigMap> =
        Api::namespaced(member.clone(), "default");
    let reconciled = async |seen: &mut tokio::sync::mpsc::UnboundedReceiver<String>, cm: &str| {
        let wanted = format!("renewed/{cm}");
        tokio::time::timeout(Duration::from_secs(30), async {
            while let Some(key) = seen.recv().await {
                if key == wanted {
                    return;
                }
            }
        })
        .await
        .unwrap_or_else(|_| {
            panic!(
                "{wanted} was not reconciled; logs:\n{}",
                logs.lines(&["renewed"]).join("\n")
            )
        });
    };
    cms.create(&PostParams::default(), &config_map("before-renewal"))
        .await
        .unwrap();
    reconciled(&mut seen, "before-renewal").await;

    // Its end shown (the annotation's), a WARN line and an Event on the Secret.
    let scrape = || {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        text
    };
    let shown = |source: &str| {
        sample(
            &scrape(),
            "multicluster_runtime_credential_expiry_seconds",
            &[("cluster", "renewed"), ("source", source)],
        )
        .map(|v| v as i64)
    };
    eventually(30, "the stated end in the gauge", async || {
        shown("annotation") == Some(stated_end)
    })
    .await;
    eventually(30, "a WARN line and an Event", async || {
        !logs
            .lines(&["WARN", "credential ends soon", "renewed"])
            .is_empty()
            && has_event(
                &host,
                "mcr-system",
                "CredentialExpiring",
                "renewed",
                "cluster renewed",
            )
            .await
    })
    .await;

    eventually(30, "the decoy refused as an anchor", async || {
        has_event(
            &host,
            "mcr-system",
            "TokenRevocationRefused",
            "renewed",
            "is not an anchor",
        )
        .await
    })
    .await;
    assert!(
        member_secrets
            .get_opt(&second_renewal)
            .await
            .unwrap()
            .is_some()
    );

    // Renewed before the end: a token of an hour, bound to the first renewal anchor.
    let mut renewed = None;
    eventually(60, "the token renewed", async || {
        let secret = secrets.get("renewed").await.unwrap();
        let done = secret.annotations().get(TOKEN_ANCHOR_ANNOTATION) == Some(&first_renewal);
        if done {
            renewed = Some(secret);
        }
        done
    })
    .await;
    assert!(
        now() < minted + 120,
        "renewed only after the old token's end"
    );
    let renewed = renewed.unwrap();
    let new_token = token_of(&renewed);
    assert_ne!(new_token, short);
    assert_eq!(
        who_is(&member_tc, &new_token).await.as_deref(),
        Some(identity)
    );
    // The old token revoked (its anchor deleted once the new one was engaged), and the
    // join's own token with it (the same anchor).
    let refused = async {
        for _ in 0..60 {
            if who_is(&member_tc, &short).await.is_none() {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        false
    };
    assert!(
        refused.await,
        "the old token is still taken; logs:\n{}",
        logs.lines(&["renewed"]).join("\n")
    );
    eventually(
        30,
        "the revoked anchor's name taken off the Secret",
        async || {
            let secret = secrets.get("renewed").await.unwrap();
            !secret
                .annotations()
                .contains_key(PREVIOUS_ANCHOR_ANNOTATION)
        },
    )
    .await;
    eventually(30, "the new end in the gauge", async || {
        [shown("token"), shown("annotation")]
            .into_iter()
            .flatten()
            .any(|end| end > now() + 50 * 60)
    })
    .await;

    // Past the old token's end, the cluster still reconciles.
    while now() <= minted + 120 {
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    cms.create(&PostParams::default(), &config_map("after-end"))
        .await
        .unwrap();
    reconciled(&mut seen, "after-end").await;
    assert!(fleet_has(&manager, "renewed"));
    manager.shutdown();
    run.await.unwrap();

    // unjoin finds what the renewal made: the renewed token's anchor, and the Role.
    mcr(
        &mcr_bin,
        &[
            "unjoin",
            member_tc.name(),
            "--host-context",
            host_tc.name(),
            "--kubeconfig",
            kubeconfig.to_str().unwrap(),
            "--name",
            "renewed",
        ],
    );
    assert!(roles.get_opt(&renewal_role).await.unwrap().is_none());
    assert!(
        Api::<Secret>::namespaced(member.clone(), "mcr-system")
            .get_opt(&first_renewal)
            .await
            .unwrap()
            .is_none()
    );
    eventually(30, "the renewed token revoked by unjoin", async || {
        who_is(&member_tc, &new_token).await.is_none()
    })
    .await;
}

fn config_map(name: &str) -> k8s_openapi::api::core::v1::ConfigMap {
    k8s_openapi::api::core::v1::ConfigMap {
        metadata: kube::api::ObjectMeta {
            name: Some(name.into()),
            ..Default::default()
        },
        ..Default::default()
    }
}

fn fleet_has<P: multicluster_runtime::Provider<Id = ClusterName>>(
    manager: &Manager<P>,
    name: &str,
) -> bool {
    manager.fleet().get(&ClusterName::from(name)).is_some()
}
