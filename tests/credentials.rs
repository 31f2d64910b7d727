//! Credentials with a visible end, against a real control plane: a client certificate of two
//! minutes and a ServiceAccount token of an hour show their ends in
//! `multicluster_runtime_credential_expiry_seconds` and warn within the lead time; a
//! credential beyond it does not.

mod common;

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use common::*;
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::ServiceAccount;
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
