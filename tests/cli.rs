//! `mcr join` / `mcr unjoin` (cli/) against real control planes: members joined with
//! identities of their own and a token that lasts (a year, its expiry beside it), rotated by
//! joining again (the older token revoked), the example operator engaging them and following
//! the rotation, unjoin removing what join made and nothing else, and a kubeconfig file for the
//! File provider.

mod common;

use common::operator_process::{OperatorProcess, configmap_in, create_original};
use common::*;
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams};
use multicluster_runtime_testenv::TestEnv;

/// The kubeconfig and the token in the host Secret `mcr-system/<name>` that `mcr join` wrote.
async fn joined_secret(
    host: &kube::Client,
    name: &str,
) -> (k8s_openapi::api::core::v1::Secret, String, String) {
    use secrecy::ExposeSecret;
    let secret = Api::<k8s_openapi::api::core::v1::Secret>::namespaced(host.clone(), "mcr-system")
        .get(name)
        .await
        .unwrap();
    let bytes = &secret.data.as_ref().unwrap()["kubeconfig"].0;
    let kubeconfig = String::from_utf8(bytes.clone()).unwrap();
    let parsed = kube::config::Kubeconfig::from_yaml(&kubeconfig).unwrap();
    let token = parsed.auth_infos[0]
        .auth_info
        .as_ref()
        .unwrap()
        .token
        .as_ref()
        .unwrap()
        .expose_secret()
        .to_string();
    (secret, kubeconfig, token)
}

/// Who the API server at `server` (CA `ca_pem`) takes `token` for; `None` if it refuses it.
async fn who_is(server: &str, ca_pem: &str, token: &str) -> Option<String> {
    use k8s_openapi::api::authentication::v1::SelfSubjectReview;
    let mut config = kube::Config::new(server.parse().unwrap());
    config.root_cert = Some(rustls_pemfile_certs(ca_pem));
    config.auth_info.token = Some(token.to_string().into());
    let client = kube::Client::try_from(config).unwrap();
    match Api::<SelfSubjectReview>::all(client)
        .create(&PostParams::default(), &SelfSubjectReview::default())
        .await
    {
        Ok(review) => review
            .status
            .and_then(|s| s.user_info)
            .and_then(|u| u.username),
        Err(kube::Error::Api(status)) if status.code == 401 => None,
        Err(e) => panic!("SelfSubjectReview: {e}"),
    }
}

/// The DER certificates of a PEM bundle.
fn rustls_pemfile_certs(pem: &str) -> Vec<Vec<u8>> {
    use base64::Engine as _;
    pem.split("-----BEGIN CERTIFICATE-----")
        .skip(1)
        .map(|block| {
            let body: String = block
                .split("-----END CERTIFICATE-----")
                .next()
                .unwrap()
                .split_whitespace()
                .collect();
            base64::engine::general_purpose::STANDARD
                .decode(body)
                .unwrap()
        })
        .collect()
}

/// The `exp` claim of a JWT, in seconds since the epoch.
fn jwt_expiry(token: &str) -> i64 {
    use base64::Engine as _;
    let payload = token.split('.').nth(1).unwrap();
    let claims: serde_json::Value = serde_json::from_slice(
        &base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(payload)
            .unwrap(),
    )
    .unwrap();
    claims["exp"].as_i64().unwrap()
}

/// Whether deploy/member.yaml's Role or RoleBinding is in `member`.
async fn member_manifest_rbac_left(member: &kube::Client) -> bool {
    exists(
        &Api::<Role>::namespaced(member.clone(), "mcr-system"),
        "mcr-member",
    )
    .await
        || exists(
            &Api::<RoleBinding>::namespaced(member.clone(), "mcr-system"),
            "mcr-member",
        )
        .await
}

async fn exists<K>(api: &Api<K>, name: &str) -> bool
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    api.get_opt(name).await.unwrap().is_some()
}

#[tokio::test]
async fn mcr_join_gives_members_identities_that_last_rotates_them_and_unjoin_removes_what_it_made()
{
    use k8s_openapi::api::core::v1::{Namespace, Secret, ServiceAccount};
    use k8s_openapi::api::rbac::v1::ClusterRoleBinding;
    let (operator, mcr_bin) = (operator_binary(), mcr_binary());
    let env = TestEnv::builder().clusters(3).start().await.unwrap();
    let (host_tc, a_tc, b_tc) = (
        env.cluster(0).unwrap(),
        env.cluster(1).unwrap(),
        env.cluster(2).unwrap(),
    );
    let (host, a, b) = (
        host_tc.client().unwrap(),
        a_tc.client().unwrap(),
        b_tc.client().unwrap(),
    );
    apply_manifests(&host, &manifest("operator.yaml")).await;
    // In b, the identity's namespace and ServiceAccount were there before: unjoin keeps them.
    create_namespace(&b, "mcr-system").await;
    let b_accounts: Api<ServiceAccount> = Api::namespaced(b.clone(), "mcr-system");
    let account = ServiceAccount {
        metadata: ObjectMeta {
            name: Some("mcr-member".into()),
            ..Default::default()
        },
        ..Default::default()
    };
    b_accounts
        .create(&PostParams::default(), &account)
        .await
        .unwrap();

    // One kubeconfig with the three contexts, as an administrator has it.
    let dir = tempfile::tempdir().unwrap();
    let mut merged = kube::config::Kubeconfig::from_yaml(host_tc.kubeconfig()).unwrap();
    for tc in [&a_tc, &b_tc] {
        merged = merged
            .merge(kube::config::Kubeconfig::from_yaml(tc.kubeconfig()).unwrap())
            .unwrap();
    }
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(&kubeconfig, serde_json::to_string(&merged).unwrap()).unwrap();
    let kubeconfig = kubeconfig.to_str().unwrap();
    let member_manifest = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/member.yaml");
    let join = |context: &str, name: &str, extra: &[&str]| {
        let mut args = vec![
            "join",
            context,
            "--host-context",
            host_tc.name(),
            "--kubeconfig",
            kubeconfig,
            "--name",
        ];
        args.push(name);
        args.extend(["--manifest", member_manifest]);
        args.extend(extra);
        let args: Vec<String> = args.into_iter().map(String::from).collect();
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        mcr(&mcr_bin, &args)
    };

    let joined_at = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    let out = join(a_tc.name(), "a", &["--cluster-role", "view"]);
    assert!(out.contains("joined"), "{out}");
    join(b_tc.name(), "b", &[]);

    // The host Secrets, labelled for the provider, with a token as documented: a year long,
    // its expiry written beside it, and the member's ServiceAccount as its identity.
    let member_identity = "system:serviceaccount:mcr-system:mcr-member";
    let (secret, _, first_token) = joined_secret(&host, "a").await;
    let labels = secret.metadata.labels.clone().unwrap_or_default();
    assert_eq!(
        labels
            .get(multicluster_runtime::providers::KUBECONFIG_SECRET_LABEL)
            .map(String::as_str),
        Some("true")
    );
    let expiry = jwt_expiry(&first_token);
    let year = 8760 * 3600;
    assert!(
        (expiry - (joined_at + year)).abs() < 300,
        "the token expires at {expiry}, not a year after {joined_at}"
    );
    let written: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time = serde_json::from_value(
        serde_json::Value::String(
            secret.metadata.annotations.as_ref().unwrap()
                ["multicluster-runtime.sigs.k8s.io/token-expires"]
                .clone(),
        ),
    )
    .unwrap();
    assert_eq!(written.0.as_second(), expiry);
    assert_eq!(
        who_is(a_tc.server(), a_tc.ca_pem(), &first_token)
            .await
            .as_deref(),
        Some(member_identity)
    );
    let (_, _, b_token) = joined_secret(&host, "b").await;
    assert_eq!(
        who_is(b_tc.server(), b_tc.ca_pem(), &b_token)
            .await
            .as_deref(),
        Some(member_identity)
    );
    let bindings: Api<ClusterRoleBinding> = Api::all(a.clone());
    assert!(exists(&bindings, "mcr-join:a:view").await);
    // The manifest's own binding is the manifest's, not one of the bindings join prunes.
    let a_rolebindings: Api<RoleBinding> = Api::namespaced(a.clone(), "mcr-system");
    assert!(exists(&a_rolebindings, "mcr-member").await);
    // Another member under a name in use is refused before anything is made in it.
    let refused = mcr_refused(
        &mcr_bin,
        &[
            "join",
            b_tc.name(),
            "--host-context",
            host_tc.name(),
            "--kubeconfig",
            kubeconfig,
            "--name",
            "a",
        ],
    );
    assert!(refused.contains("another member"), "{refused}");
    assert!(
        !exists(
            &Api::<Secret>::namespaced(b.clone(), "mcr-system"),
            "mcr-join-a"
        )
        .await
    );

    // The example operator engages both through the Secrets and copies into them as that
    // identity (deploy/member.yaml's Role is all it has there).
    let operator_user = host_tc
        .add_user(
            "system:serviceaccount:mcr-system:mcr-operator",
            &[
                "system:serviceaccounts",
                "system:serviceaccounts:mcr-system",
            ],
        )
        .unwrap();
    let _operator = OperatorProcess::start(
        &operator,
        operator_user.kubeconfig_path(),
        "replica-a",
        dir.path(),
    );
    create_original(&host).await;
    eventually(60, "the copies in a and b", async || {
        configmap_in(&a, "mcr-system", "settings").await.is_some()
            && configmap_in(&b, "mcr-system", "settings").await.is_some()
    })
    .await;

    // Joining again converges (the view binding not asked for again goes; the record of what
    // join made is unchanged) and rotates: a new token, the one before still valid, and on
    // the next join the first one revoked.
    let records: Api<Secret> = Api::namespaced(a.clone(), "mcr-system");
    let record = records.get("mcr-join-a").await.unwrap().data;
    join(a_tc.name(), "a", &[]);
    assert!(!exists(&bindings, "mcr-join:a:view").await);
    assert_eq!(records.get("mcr-join-a").await.unwrap().data, record);
    let (_, _, second_token) = joined_secret(&host, "a").await;
    assert_ne!(second_token, first_token);
    assert!(
        who_is(a_tc.server(), a_tc.ca_pem(), &first_token)
            .await
            .is_some()
    );
    let out = join(a_tc.name(), "a", &[]);
    assert!(out.contains("1 older token(s) revoked"), "{out}");
    eventually(30, "the first token refused", async || {
        who_is(a_tc.server(), a_tc.ca_pem(), &first_token)
            .await
            .is_none()
    })
    .await;
    assert!(
        who_is(a_tc.server(), a_tc.ca_pem(), &second_token)
            .await
            .is_some()
    );
    // The operator follows the rotated Secret: a change is copied into a.
    let originals: Api<ConfigMap> = Api::namespaced(host.clone(), "mcr-system");
    originals
        .patch(
            "settings",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"data": {"colour": "green"}})),
        )
        .await
        .unwrap();
    eventually(
        60,
        "the change copied into a after the rotation",
        async || {
            configmap_in(&a, "mcr-system", "settings")
                .await
                .and_then(|cm| cm.data)
                .is_some_and(|d| d.get("colour").map(String::as_str) == Some("green"))
        },
    )
    .await;

    // Unjoin a: the host Secret goes (the operator disengages a), and in a everything join
    // made (the manifest's Role and RoleBinding, the ServiceAccount, the namespace, the token
    // anchors, the record).
    let (_, _, last_token) = joined_secret(&host, "a").await;
    let out = mcr(
        &mcr_bin,
        &[
            "unjoin",
            a_tc.name(),
            "--host-context",
            host_tc.name(),
            "--kubeconfig",
            kubeconfig,
            "--name",
            "a",
        ],
    );
    let secrets: Api<Secret> = Api::namespaced(host.clone(), "mcr-system");
    assert!(!exists(&secrets, "a").await);
    assert!(exists(&secrets, "b").await);
    let a_accounts: Api<ServiceAccount> = Api::namespaced(a.clone(), "mcr-system");
    assert!(!exists(&a_accounts, "mcr-member").await, "{out}");
    assert!(!member_manifest_rbac_left(&a).await, "{out}");
    assert!(!exists(&records, "mcr-join-a").await);
    let anchors = Api::<Secret>::namespaced(a.clone(), "mcr-system")
        .list(
            &kube::api::ListParams::default()
                .labels("multicluster-runtime.sigs.k8s.io/joined-as=a"),
        )
        .await
        .unwrap();
    assert!(
        anchors.items.is_empty(),
        "token anchors left: {}",
        anchors.items.len()
    );
    // The namespace join made holds the operator's copy, which join did not make: it stays.
    let namespace = Api::<Namespace>::all(a.clone())
        .get("mcr-system")
        .await
        .unwrap();
    assert!(namespace.metadata.deletion_timestamp.is_none());
    assert!(configmap_in(&a, "mcr-system", "settings").await.is_some());
    assert!(
        out.contains("kept Namespace mcr-system: it holds ConfigMap settings"),
        "{out}"
    );
    eventually(30, "a's last token refused", async || {
        who_is(a_tc.server(), a_tc.ca_pem(), &last_token)
            .await
            .is_none()
    })
    .await;
    let log = _operator.log.clone();
    eventually(30, "the operator disengaging a", async || {
        std::fs::read_to_string(&log)
            .unwrap()
            .lines()
            .any(|line| line.contains("cluster disengaged") && line.contains("\"cluster\":\"a\""))
    })
    .await;

    // A record rewritten to name an object join did not make (a ConfigMap of someone
    // else's): unjoin leaves it, as it does every object without its label and uid.
    let b_cms: Api<ConfigMap> = Api::namespaced(b.clone(), "mcr-system");
    let victim = ConfigMap {
        metadata: ObjectMeta {
            name: Some("victim".into()),
            ..Default::default()
        },
        ..Default::default()
    };
    b_cms.create(&PostParams::default(), &victim).await.unwrap();
    let b_records: Api<Secret> = Api::namespaced(b.clone(), "mcr-system");
    let mut entries: Vec<serde_json::Value> = serde_json::from_slice(
        &b_records.get("mcr-join-b").await.unwrap().data.unwrap()["created"].0,
    )
    .unwrap();
    entries.push(serde_json::json!({
        "apiVersion": "v1", "kind": "ConfigMap", "namespace": "mcr-system", "name": "victim"
    }));
    b_records
        .patch(
            "mcr-join-b",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({
                "stringData": { "created": serde_json::to_string(&entries).unwrap() }
            })),
        )
        .await
        .unwrap();

    // Unjoin b: what join made goes, what was there before stays.
    mcr(
        &mcr_bin,
        &[
            "unjoin",
            b_tc.name(),
            "--host-context",
            host_tc.name(),
            "--kubeconfig",
            kubeconfig,
            "--name",
            "b",
        ],
    );
    assert!(!exists(&secrets, "b").await);
    assert!(exists(&b_accounts, "mcr-member").await);
    assert!(exists(&b_cms, "victim").await);
    let b_namespace = Api::<Namespace>::all(b.clone())
        .get("mcr-system")
        .await
        .unwrap();
    assert!(b_namespace.metadata.deletion_timestamp.is_none());
    assert!(!member_manifest_rbac_left(&b).await);
    assert!(!exists(&b_records, "mcr-join-b").await);
    eventually(30, "b's token refused", async || {
        who_is(b_tc.server(), b_tc.ca_pem(), &b_token)
            .await
            .is_none()
    })
    .await;

    // For the File provider: a kubeconfig file, its owner's only, and no host.
    let file = dir.path().join("b.yaml");
    let file_arg = file.to_str().unwrap();
    let common = [
        "--kubeconfig",
        kubeconfig,
        "--name",
        "b-file",
        "--output-file",
        file_arg,
    ];
    let mut args = vec![
        "join",
        b_tc.name(),
        "--manifest",
        member_manifest,
        "--role",
        "mcr-system/mcr-member",
    ];
    args.extend(common);
    // A file that join did not write is not overwritten.
    std::fs::write(&file, "someone else's").unwrap();
    let refused = mcr_refused(&mcr_bin, &args);
    assert!(refused.contains("left alone"), "{refused}");
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "someone else's");
    std::fs::remove_file(&file).unwrap();
    mcr(&mcr_bin, &args);
    assert!(
        exists(
            &Api::<RoleBinding>::namespaced(b.clone(), "mcr-system"),
            "mcr-join:b-file:mcr-member"
        )
        .await
    );
    use std::os::unix::fs::PermissionsExt as _;
    assert_eq!(
        std::fs::metadata(&file).unwrap().permissions().mode() & 0o777,
        0o600
    );
    let written = kube::config::Kubeconfig::read_from(&file).unwrap();
    let config = kube::Config::from_custom_kubeconfig(written, &Default::default())
        .await
        .unwrap();
    let client = kube::Client::try_from(config).unwrap();
    // The identity can do what the Role it was bound to allows.
    Api::<ConfigMap>::namespaced(client.clone(), "mcr-system")
        .list(&Default::default())
        .await
        .unwrap();
    let review = Api::<k8s_openapi::api::authentication::v1::SelfSubjectReview>::all(client)
        .create(&PostParams::default(), &Default::default())
        .await
        .unwrap();
    assert_eq!(
        review
            .status
            .unwrap()
            .user_info
            .unwrap()
            .username
            .as_deref(),
        Some(member_identity)
    );
    let mut args = vec!["unjoin", b_tc.name()];
    args.extend(common);
    mcr(&mcr_bin, &args);
    assert!(!file.exists());
    assert!(
        !exists(
            &Api::<RoleBinding>::namespaced(b.clone(), "mcr-system"),
            "mcr-join:b-file:mcr-member"
        )
        .await
    );
    assert!(exists(&b_accounts, "mcr-member").await);
}
