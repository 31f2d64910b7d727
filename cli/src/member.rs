//! What `join` makes in a member cluster, and `unjoin` removes.
//!
//! - Objects that did not exist before `join` (the manifests' objects, the identity's
//!   namespace and ServiceAccount) are listed in a record, the ConfigMap `mcr-join-<name>` in
//!   the identity's namespace; `unjoin` removes those, newest first, and nothing else.
//! - Bindings of the roles given are labelled with the cluster name; `join` removes those it
//!   was not given this time, `unjoin` removes them all.
//! - Each token is bound to an object of its own, an empty Secret labelled as a token anchor:
//!   deleting the anchor revokes the token at once. `join` keeps the newest two (the token it
//!   just issued and the one before, which the fleet may still be using), `unjoin` deletes all.

use std::collections::BTreeSet;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context as _, Result, anyhow, bail};
use k8s_openapi::api::authentication::v1::{BoundObjectReference, TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Secret, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRoleBinding, RoleBinding};
use kube::api::{
    Api, DeleteParams, DynamicObject, GroupVersionKind, ListParams, ObjectMeta, Patch, PatchParams,
    PostParams,
};
use kube::discovery::{Scope, pinned_kind};
use serde::{Deserialize, Serialize};

use crate::{FIELD_MANAGER, JOINED_AS};

/// On token anchors, beside `JOINED_AS`.
const TOKEN_ANCHOR: &str = "multicluster-runtime.sigs.k8s.io/token-anchor";
/// On token anchors: when the token was issued, in nanoseconds since the epoch (finer than
/// creation timestamps, which count seconds).
const ISSUED: &str = "multicluster-runtime.sigs.k8s.io/issued";
/// The record's data key.
const CREATED: &str = "created";
/// How many tokens stay valid after a join: the new one and the one before.
const TOKENS_KEPT: usize = 2;

/// An object `join` created.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
struct Made {
    #[serde(rename = "apiVersion")]
    api_version: String,
    kind: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    namespace: Option<String>,
    name: String,
}

/// A token `join` issued.
pub struct Issued {
    pub token: String,
    /// When it expires, RFC 3339.
    pub expires: String,
}

pub struct Member {
    client: kube::Client,
    name: String,
    sa_namespace: String,
    sa_name: String,
}

impl Member {
    pub fn new(client: kube::Client, name: &str, sa_namespace: &str, sa_name: &str) -> Self {
        Self {
            client,
            name: name.to_string(),
            sa_namespace: sa_namespace.to_string(),
            sa_name: sa_name.to_string(),
        }
    }

    fn record_name(&self) -> String {
        format!("mcr-join-{}", self.name)
    }

    fn joined_selector(&self) -> ListParams {
        ListParams::default().labels(&format!("{JOINED_AS}={}", self.name))
    }

    /// The objects the record lists (none if there is no record).
    async fn record(&self) -> Result<Vec<Made>> {
        let api: Api<ConfigMap> = Api::namespaced(self.client.clone(), &self.sa_namespace);
        let Some(record) = api.get_opt(&self.record_name()).await? else {
            return Ok(Vec::new());
        };
        let text = record
            .data
            .as_ref()
            .and_then(|d| d.get(CREATED))
            .map_or("[]", String::as_str);
        serde_json::from_str(text)
            .with_context(|| format!("the record {}/{}", self.sa_namespace, self.record_name()))
    }

    async fn save_record(&self, made: &[Made]) -> Result<()> {
        let record = serde_json::json!({
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": self.record_name(),
                "namespace": self.sa_namespace,
                "labels": { JOINED_AS: self.name },
            },
            "data": { CREATED: serde_json::to_string(made)? },
        });
        Api::<ConfigMap>::namespaced(self.client.clone(), &self.sa_namespace)
            .patch(
                &self.record_name(),
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(&record),
            )
            .await?;
        Ok(())
    }

    /// Applies the manifests, makes the identity and its bindings, and issues a token.
    pub async fn join(
        &self,
        manifests: &[String],
        cluster_roles: &[String],
        roles: &[(&str, &str)],
        ttl: Duration,
    ) -> Result<Issued> {
        let mut made = self.record().await?;
        let ns = &self.sa_namespace;

        // The identity's namespace first: the record lives there.
        let namespaces: Api<Namespace> = Api::all(self.client.clone());
        if namespaces.get_opt(ns).await?.is_none() {
            let namespace = Namespace {
                metadata: ObjectMeta {
                    name: Some(ns.clone()),
                    labels: Some([(JOINED_AS.to_string(), self.name.clone())].into()),
                    ..Default::default()
                },
                ..Default::default()
            };
            namespaces
                .create(&PostParams::default(), &namespace)
                .await
                .with_context(|| format!("creating the namespace {ns}"))?;
            remember(
                &mut made,
                Made {
                    api_version: "v1".into(),
                    kind: "Namespace".into(),
                    namespace: None,
                    name: ns.clone(),
                },
            );
        }
        self.save_record(&made).await?;

        for manifest in manifests {
            let documents: Vec<serde_json::Value> = serde_saphyr::from_multiple(manifest)
                .map_err(|e| anyhow!("a manifest is not YAML: {e}"))?;
            for document in documents.into_iter().filter(|d| !d.is_null()) {
                let object: DynamicObject = serde_json::from_value(document)
                    .context("a manifest document is not an object")?;
                let (api, made_as) = self.api_of(&object).await?;
                let name = made_as.name.clone();
                let existed = api.get_opt(&name).await?.is_some();
                api.patch(
                    &name,
                    &PatchParams::apply(FIELD_MANAGER),
                    &Patch::Apply(&object),
                )
                .await
                .with_context(|| format!("applying {} {name}", made_as.kind))?;
                if !existed {
                    remember(&mut made, made_as);
                    self.save_record(&made).await?;
                }
            }
        }

        let accounts: Api<ServiceAccount> = Api::namespaced(self.client.clone(), ns);
        if accounts.get_opt(&self.sa_name).await?.is_none() {
            let account = ServiceAccount {
                metadata: ObjectMeta {
                    name: Some(self.sa_name.clone()),
                    labels: Some([(JOINED_AS.to_string(), self.name.clone())].into()),
                    ..Default::default()
                },
                ..Default::default()
            };
            accounts
                .create(&PostParams::default(), &account)
                .await
                .context("creating the ServiceAccount")?;
            remember(
                &mut made,
                Made {
                    api_version: "v1".into(),
                    kind: "ServiceAccount".into(),
                    namespace: Some(ns.clone()),
                    name: self.sa_name.clone(),
                },
            );
            self.save_record(&made).await?;
        }

        self.bind(cluster_roles, roles).await?;
        self.issue(ttl).await
    }

    /// The API of `object`'s kind, and what it would be recorded as.
    async fn api_of(&self, object: &DynamicObject) -> Result<(Api<DynamicObject>, Made)> {
        let types = object
            .types
            .clone()
            .ok_or_else(|| anyhow!("a manifest object has no apiVersion and kind"))?;
        let gvk = GroupVersionKind::try_from(&types).map_err(|e| anyhow!("{e}"))?;
        let name = object
            .metadata
            .name
            .clone()
            .ok_or_else(|| anyhow!("a {} in a manifest has no name", types.kind))?;
        let namespace = object.metadata.namespace.clone();
        let made = Made {
            api_version: types.api_version.clone(),
            kind: types.kind.clone(),
            namespace,
            name,
        };
        Ok((self.api_for(&made, &gvk).await?, made))
    }

    async fn api_for(&self, made: &Made, gvk: &GroupVersionKind) -> Result<Api<DynamicObject>> {
        let (resource, caps) = pinned_kind(&self.client, gvk).await.with_context(|| {
            format!(
                "the member does not serve {} {}",
                made.api_version, made.kind
            )
        })?;
        Ok(match (caps.scope, made.namespace.as_deref()) {
            (Scope::Namespaced, Some(ns)) => {
                Api::namespaced_with(self.client.clone(), ns, &resource)
            }
            (Scope::Namespaced, None) => bail!("the {} {} has no namespace", made.kind, made.name),
            (Scope::Cluster, _) => Api::all_with(self.client.clone(), &resource),
        })
    }

    fn binding_name(&self, role: &str) -> String {
        format!("mcr-join:{}:{role}", self.name)
    }

    /// The bindings asked for, and none other of this cluster's.
    async fn bind(&self, cluster_roles: &[String], roles: &[(&str, &str)]) -> Result<()> {
        let subject = serde_json::json!([{
            "kind": "ServiceAccount",
            "name": self.sa_name,
            "namespace": self.sa_namespace,
        }]);
        let labels = serde_json::json!({ JOINED_AS: self.name });
        let cluster_bindings: Api<ClusterRoleBinding> = Api::all(self.client.clone());
        let mut wanted = BTreeSet::new();
        for role in cluster_roles {
            let name = self.binding_name(role);
            let binding = serde_json::json!({
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "ClusterRoleBinding",
                "metadata": { "name": name, "labels": labels },
                "roleRef": { "apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role },
                "subjects": subject,
            });
            cluster_bindings
                .patch(
                    &name,
                    &PatchParams::apply(FIELD_MANAGER).force(),
                    &Patch::Apply(&binding),
                )
                .await
                .with_context(|| format!("binding the ClusterRole {role}"))?;
            wanted.insert((None, name));
        }
        for (namespace, role) in roles {
            let name = self.binding_name(role);
            let binding = serde_json::json!({
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "RoleBinding",
                "metadata": { "name": name, "namespace": namespace, "labels": labels },
                "roleRef": { "apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role },
                "subjects": subject,
            });
            Api::<RoleBinding>::namespaced(self.client.clone(), namespace)
                .patch(
                    &name,
                    &PatchParams::apply(FIELD_MANAGER).force(),
                    &Patch::Apply(&binding),
                )
                .await
                .with_context(|| format!("binding the Role {namespace}/{role}"))?;
            wanted.insert((Some(namespace.to_string()), name));
        }
        self.remove_bindings(|key| !wanted.contains(key)).await?;
        Ok(())
    }

    /// Removes this cluster's bindings for which `stale` holds; how many.
    async fn remove_bindings(
        &self,
        stale: impl Fn(&(Option<String>, String)) -> bool,
    ) -> Result<usize> {
        let mut removed = 0;
        let cluster_bindings: Api<ClusterRoleBinding> = Api::all(self.client.clone());
        for binding in cluster_bindings.list(&self.joined_selector()).await? {
            let name = binding.metadata.name.unwrap_or_default();
            if stale(&(None, name.clone())) {
                removed += delete(&cluster_bindings, &name).await?;
            }
        }
        let bindings: Api<RoleBinding> = Api::all(self.client.clone());
        for binding in bindings.list(&self.joined_selector()).await? {
            let namespace = binding.metadata.namespace.unwrap_or_default();
            let name = binding.metadata.name.unwrap_or_default();
            if stale(&(Some(namespace.clone()), name.clone())) {
                let api: Api<RoleBinding> = Api::namespaced(self.client.clone(), &namespace);
                removed += delete(&api, &name).await?;
            }
        }
        Ok(removed)
    }

    /// A token for the identity, bound to a new anchor and valid for `ttl`.
    async fn issue(&self, ttl: Duration) -> Result<Issued> {
        let anchors: Api<Secret> = Api::namespaced(self.client.clone(), &self.sa_namespace);
        let issued = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos();
        let anchor = Secret {
            metadata: ObjectMeta {
                generate_name: Some(format!("mcr-join-{}-token-", self.name)),
                labels: Some(
                    [
                        (JOINED_AS.to_string(), self.name.clone()),
                        (TOKEN_ANCHOR.to_string(), "true".to_string()),
                    ]
                    .into(),
                ),
                annotations: Some([(ISSUED.to_string(), issued.to_string())].into()),
                ..Default::default()
            },
            type_: Some("Opaque".into()),
            ..Default::default()
        };
        let anchor = anchors
            .create(&PostParams::default(), &anchor)
            .await
            .context("creating the token's anchor Secret")?;
        let request = TokenRequest {
            spec: Some(TokenRequestSpec {
                audiences: None,
                expiration_seconds: Some(i64::try_from(ttl.as_secs()).unwrap_or(i64::MAX)),
                bound_object_ref: Some(BoundObjectReference {
                    api_version: Some("v1".into()),
                    kind: Some("Secret".into()),
                    name: anchor.metadata.name.clone(),
                    uid: anchor.metadata.uid.clone(),
                }),
            }),
            ..Default::default()
        };
        let accounts: Api<ServiceAccount> =
            Api::namespaced(self.client.clone(), &self.sa_namespace);
        let answer = accounts
            .create_token_request(&self.sa_name, &PostParams::default(), &request)
            .await
            .context("requesting a token for the ServiceAccount")?;
        let status = answer
            .status
            .ok_or_else(|| anyhow!("the API server answered the token request without a token"))?;
        let expires = serde_json::to_value(&status.expiration_timestamp)?
            .as_str()
            .unwrap_or_default()
            .to_string();
        let token = status
            .token
            .ok_or_else(|| anyhow!("the API server answered the token request without a token"))?;
        Ok(Issued { token, expires })
    }

    /// Deletes the anchors of all but the newest tokens; how many.
    pub async fn revoke_older_tokens(&self) -> Result<usize> {
        let mut anchors = self.anchors().await?;
        anchors.sort_by_key(|(issued, _)| std::cmp::Reverse(*issued));
        let api: Api<Secret> = Api::namespaced(self.client.clone(), &self.sa_namespace);
        let mut revoked = 0;
        for (_, name) in anchors.iter().skip(TOKENS_KEPT) {
            revoked += delete(&api, name).await?;
        }
        Ok(revoked)
    }

    /// This cluster's token anchors: when issued, and the name.
    async fn anchors(&self) -> Result<Vec<(u128, String)>> {
        let api: Api<Secret> = Api::namespaced(self.client.clone(), &self.sa_namespace);
        let selector = format!("{JOINED_AS}={},{TOKEN_ANCHOR}=true", self.name);
        Ok(api
            .list(&ListParams::default().labels(&selector))
            .await?
            .into_iter()
            .map(|s| {
                let issued = s
                    .metadata
                    .annotations
                    .as_ref()
                    .and_then(|a| a.get(ISSUED))
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0);
                (issued, s.metadata.name.unwrap_or_default())
            })
            .collect())
    }

    /// Removes every token, binding and recorded object; how many objects went.
    pub async fn unjoin(&self) -> Result<usize> {
        let mut removed = 0;
        let anchors: Api<Secret> = Api::namespaced(self.client.clone(), &self.sa_namespace);
        for (_, name) in self.anchors().await? {
            removed += delete(&anchors, &name).await?;
        }
        removed += self.remove_bindings(|_| true).await?;
        let made = self.record().await?;
        for object in made.iter().rev() {
            let gvk = gvk_of(object)?;
            let api = self.api_for(object, &gvk).await?;
            removed += delete(&api, &object.name).await?;
        }
        let records: Api<ConfigMap> = Api::namespaced(self.client.clone(), &self.sa_namespace);
        delete(&records, &self.record_name()).await?;
        Ok(removed)
    }
}

fn gvk_of(made: &Made) -> Result<GroupVersionKind> {
    let (group, version) = match made.api_version.split_once('/') {
        Some((group, version)) => (group, version),
        None => ("", made.api_version.as_str()),
    };
    Ok(GroupVersionKind::gvk(group, version, &made.kind))
}

fn remember(made: &mut Vec<Made>, object: Made) {
    if !made.contains(&object) {
        made.push(object);
    }
}

/// Deletes `name`; 1 if it was there, 0 if not.
async fn delete<K>(api: &Api<K>, name: &str) -> Result<usize>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    match api.delete(name, &DeleteParams::default()).await {
        Ok(_) => Ok(1),
        Err(kube::Error::Api(status)) if status.code == 404 => Ok(0),
        Err(e) => Err(e).with_context(|| format!("deleting {name}")),
    }
}
