//! Who may do what: service account tokens, URL grants, RBAC on ConfigMaps.

use super::*;

/// A service account `account` of `member` (namespace `default`) bound to cluster-admin,
/// and a token for it (an hour long).
pub async fn service_account_token(
    member: &multicluster_runtime_testenv::TestCluster,
    account: &str,
) -> String {
    let client = member.client().unwrap();
    let pp = PostParams::default();
    let accounts: Api<k8s_openapi::api::core::v1::ServiceAccount> =
        Api::namespaced(client.clone(), "default");
    let mut sa = k8s_openapi::api::core::v1::ServiceAccount::default();
    sa.metadata.name = Some(account.into());
    accounts.create(&pp, &sa).await.unwrap();
    let bindings: Api<k8s_openapi::api::rbac::v1::ClusterRoleBinding> = Api::all(client.clone());
    bindings
        .create(
            &pp,
            &k8s_openapi::api::rbac::v1::ClusterRoleBinding {
                metadata: kube::api::ObjectMeta {
                    name: Some(format!("{account}-admin")),
                    ..Default::default()
                },
                role_ref: k8s_openapi::api::rbac::v1::RoleRef {
                    api_group: Some("rbac.authorization.k8s.io".into()),
                    kind: "ClusterRole".into(),
                    name: "cluster-admin".into(),
                },
                subjects: Some(vec![k8s_openapi::api::rbac::v1::Subject {
                    kind: "ServiceAccount".into(),
                    name: account.into(),
                    namespace: Some("default".into()),
                    ..Default::default()
                }]),
            },
        )
        .await
        .unwrap();
    let request = k8s_openapi::api::authentication::v1::TokenRequest {
        spec: Some(k8s_openapi::api::authentication::v1::TokenRequestSpec {
            expiration_seconds: Some(3600),
            ..Default::default()
        }),
        ..Default::default()
    };
    accounts
        .create_token_request(account, &pp, &request)
        .await
        .unwrap()
        .status
        .and_then(|s| s.token)
        .unwrap()
}

/// A service account `name` of `default` with no permission, and a token of it.
pub async fn account_token(client: &kube::Client, name: &str) -> String {
    account_token_in(client, "default", name).await
}

/// [`account_token`] for a ServiceAccount of `namespace`.
pub async fn account_token_in(client: &kube::Client, namespace: &str, name: &str) -> String {
    use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
    use k8s_openapi::api::core::v1::ServiceAccount;
    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), namespace);
    let mut account = ServiceAccount::default();
    account.metadata.name = Some(name.into());
    accounts
        .create(&PostParams::default(), &account)
        .await
        .unwrap();
    let request = TokenRequest {
        spec: Some(TokenRequestSpec {
            expiration_seconds: Some(3600),
            ..Default::default()
        }),
        ..Default::default()
    };
    accounts
        .create_token_request(name, &PostParams::default(), &request)
        .await
        .unwrap()
        .status
        .and_then(|s| s.token)
        .unwrap()
}

/// Lets the service account `account` of `default` `get` the non-resource URLs `urls`.
pub async fn grant_urls(client: &kube::Client, account: &str, urls: &[&str]) {
    use k8s_openapi::api::rbac::v1::{
        ClusterRole, ClusterRoleBinding, PolicyRule, RoleRef, Subject,
    };
    let pp = PostParams::default();
    let role = ClusterRole {
        metadata: kube::api::ObjectMeta {
            name: Some(format!("{account}-urls")),
            ..Default::default()
        },
        rules: Some(vec![PolicyRule {
            non_resource_urls: Some(urls.iter().map(|u| u.to_string()).collect()),
            verbs: vec!["get".into()],
            ..Default::default()
        }]),
        ..Default::default()
    };
    Api::<ClusterRole>::all(client.clone())
        .create(&pp, &role)
        .await
        .unwrap();
    let binding = ClusterRoleBinding {
        metadata: kube::api::ObjectMeta {
            name: Some(format!("{account}-urls")),
            ..Default::default()
        },
        role_ref: RoleRef {
            api_group: Some("rbac.authorization.k8s.io".into()),
            kind: "ClusterRole".into(),
            name: format!("{account}-urls"),
        },
        subjects: Some(vec![Subject {
            kind: "ServiceAccount".into(),
            name: account.into(),
            namespace: Some("default".into()),
            ..Default::default()
        }]),
    };
    Api::<ClusterRoleBinding>::all(client.clone())
        .create(&pp, &binding)
        .await
        .unwrap();
}

/// Lets `user` use ConfigMaps with `verbs`, through the ClusterRole `role` (created if need
/// be) and a ClusterRoleBinding `<role>-<user>` (deleted to take it back).
pub async fn allow_config_maps(admin: &kube::Client, user: &str, role: &str, verbs: &[&str]) {
    use k8s_openapi::api::rbac::v1::{
        ClusterRole, ClusterRoleBinding, PolicyRule, RoleRef, Subject,
    };
    let cluster_role = ClusterRole {
        metadata: ObjectMeta {
            name: Some(role.into()),
            ..Default::default()
        },
        rules: Some(vec![PolicyRule {
            api_groups: Some(vec![String::new()]),
            resources: Some(vec!["configmaps".into()]),
            verbs: verbs.iter().map(|v| v.to_string()).collect(),
            ..Default::default()
        }]),
        ..Default::default()
    };
    // Already there for another user: kept.
    let _ = Api::<ClusterRole>::all(admin.clone())
        .create(&PostParams::default(), &cluster_role)
        .await;
    let binding = ClusterRoleBinding {
        metadata: ObjectMeta {
            name: Some(format!("{role}-{user}")),
            ..Default::default()
        },
        role_ref: RoleRef {
            api_group: Some("rbac.authorization.k8s.io".into()),
            kind: "ClusterRole".into(),
            name: role.into(),
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
