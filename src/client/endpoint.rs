//! Whether two configurations reach a cluster the same way: the same endpoint as the same
//! user. Re-engaging an id with an equal configuration changes nothing; the shared transport
//! keys its connections by the same credentials.

/// Compares what decides where and as whom requests go: the endpoint, the CA, the TLS
/// name, proxy, extra headers, the default namespace and the user's credentials (everything in
/// `AuthInfo`, secrets included: exec plugins, auth providers, impersonation). Timeouts and
/// the like do not matter.
pub(crate) fn same_endpoint_and_credentials(a: &kube::Config, b: &kube::Config) -> bool {
    a.cluster_url == b.cluster_url
        && a.default_namespace == b.default_namespace
        && a.root_cert == b.root_cert
        && a.root_cert_file == b.root_cert_file
        && a.tls_server_name == b.tls_server_name
        && a.accept_invalid_certs == b.accept_invalid_certs
        && a.proxy_url == b.proxy_url
        && a.headers == b.headers
        && credentials(&a.auth_info).is_some_and(|auth| Some(auth) == credentials(&b.auth_info))
}

/// Everything in `auth` that decides as whom requests go, comparable: `AuthInfo` has no
/// `PartialEq`, and its serde form writes secrets out but leaves out two fields of an exec
/// plugin's configuration: the cluster it is handed (`spec.cluster`, whose `config` may say
/// whose credentials to return) and the variables it does not inherit.
pub(crate) fn credentials(auth: &kube::config::AuthInfo) -> Option<serde_json::Value> {
    let mut value = serde_json::to_value(auth).ok()?;
    if let Some(exec) = &auth.exec
        && let Some(object) = value.get_mut("exec").and_then(|e| e.as_object_mut())
    {
        object.insert("cluster".into(), serde_json::to_value(&exec.cluster).ok()?);
        object.insert("dropEnv".into(), serde_json::to_value(&exec.drop_env).ok()?);
    }
    Some(value)
}

#[cfg(test)]
mod tests {
    use kube::config::{AuthInfo, ExecAuthCluster, ExecConfig};

    use super::same_endpoint_and_credentials;
    use crate::client::transport;

    fn with_exec(cluster_config: serde_json::Value, drop_env: Option<Vec<String>>) -> kube::Config {
        let mut config = kube::Config::new("https://127.0.0.1:6443".parse().unwrap());
        config.auth_info = AuthInfo {
            exec: Some(ExecConfig {
                api_version: Some("client.authentication.k8s.io/v1".into()),
                command: Some("/bin/plugin".into()),
                args: None,
                env: None,
                drop_env,
                install_hint: None,
                interactive_mode: None,
                provide_cluster_info: true,
                cluster: Some(ExecAuthCluster {
                    server: Some("https://127.0.0.1:6443".into()),
                    insecure_skip_tls_verify: None,
                    certificate_authority_data: None,
                    proxy_url: None,
                    tls_server_name: None,
                    config: Some(cluster_config),
                }),
                other: Default::default(),
            }),
            ..Default::default()
        };
        config
    }

    /// What an exec plugin is handed (`spec.cluster`, where the Cluster Inventory API puts
    /// which credentials to read) and the variables it does not get decide who it answers
    /// for, though kube's serde form of `ExecConfig` leaves both out.
    #[test]
    fn an_exec_plugin_handed_another_cluster_config_is_other_credentials() {
        let a = with_exec(serde_json::json!({"clusterName": "a"}), None);
        assert!(same_endpoint_and_credentials(&a, &a.clone()));
        let b = with_exec(serde_json::json!({"clusterName": "b"}), None);
        assert!(!same_endpoint_and_credentials(&a, &b));
        let dropped = with_exec(
            serde_json::json!({"clusterName": "a"}),
            Some(vec!["HOME".into()]),
        );
        assert!(!same_endpoint_and_credentials(&a, &dropped));
        // Nor do they share a transport (the plugin may answer with a client certificate).
        assert_eq!(transport::key(&a), transport::key(&a.clone()));
        assert_ne!(transport::key(&a), transport::key(&b));
        assert_ne!(transport::key(&a), transport::key(&dropped));
    }
}
