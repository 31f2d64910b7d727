//! What `join` makes in a member cluster, and `unjoin` removes.
//!
//! - Objects that did not exist before `join` (the manifests' objects, the identity's
//!   namespace and ServiceAccount) get the label `joined-as=<name>` and are listed, with their
//!   uids, in a record: the Secret `mcr-join-<name>` in the identity's namespace (a Secret, so
//!   that the identity itself, which may write ConfigMaps there, cannot rewrite it). `unjoin`
//!   deletes a recorded object only if it still carries that label and uid.
//! - Bindings of the roles given are labelled with the cluster name; `join` removes those it
//!   was not given this time, `unjoin` removes them all.
//! - Each token is bound to an object of its own, an empty Secret (its anchor): deleting the
//!   anchor revokes the token. Anchors are kept per destination (a host Secret, a file), so
//!   rotating one destination's token never touches another's. The destination names the
//!   anchor of the token it holds; after a join the destination's new anchor and the one it
//!   held before stay, every other of that destination is deleted.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context as _, Result, anyhow, bail};
use k8s_openapi::api::authentication::v1::{BoundObjectReference, TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{Namespace, Secret, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRoleBinding, Role, RoleBinding};
use kube::api::{
    Api, DeleteParams, DynamicObject, GroupVersionKind, ListParams, ObjectMeta, Patch, PatchParams,
    PostParams, Preconditions,
};
use kube::discovery::{Discovery, Scope, pinned_kind, verbs};
use serde::{Deserialize, Serialize};

use crate::{FIELD_MANAGER, JOINED_AS};

/// On anchors: which destination's token they anchor (a hash of the destination).
use multicluster_runtime::providers::TOKEN_FOR_LABEL as TOKEN_FOR;
/// On the bindings of `--cluster-role` and `--role`, beside `JOINED_AS` (the manifests' own
/// bindings carry `JOINED_AS` too, and are not `bind`'s to remove).
const BINDING: &str = "multicluster-runtime.sigs.k8s.io/join-binding";
/// The renewal's Role and binding are `mcr-join:<name>:renewal-<destination key>`: one per
/// destination, so that joining another destination leaves this one's renewal as it is.
const RENEWAL: &str = "renewal-";
/// On records, beside `JOINED_AS`.
const RECORD: &str = "multicluster-runtime.sigs.k8s.io/join-record";
/// The record's data key.
const CREATED: &str = "created";

/// An object `join` created.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Made {
    #[serde(rename = "apiVersion")]
    api_version: String,
    kind: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    namespace: Option<String>,
    name: String,
    /// Set once created (the entry is written before the object is made, so that a join
    /// stopped in between leaves nothing unrecorded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    uid: Option<String>,
}

impl Made {
    fn same_object(&self, other: &Made) -> bool {
        (&self.api_version, &self.kind, &self.namespace, &self.name)
            == (
                &other.api_version,
                &other.kind,
                &other.namespace,
                &other.name,
            )
    }
}

/// A token `join` issued.
pub struct Issued {
    pub token: String,
    /// When it expires, RFC 3339.
    pub expires: String,
    /// Its anchor's name.
    pub anchor: String,
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

    /// The member's own id: the uid of its `kube-system` namespace, which every cluster has
    /// and which no one renames. Written beside each credential, so that two members joined
    /// under one name are told apart.
    pub async fn fingerprint(client: &kube::Client) -> Result<String> {
        Api::<Namespace>::all(client.clone())
            .get("kube-system")
            .await
            .context("reading the member's kube-system namespace (its id)")?
            .metadata
            .uid
            .ok_or_else(|| anyhow!("the member's kube-system namespace has no uid"))
    }

    fn record_name(&self) -> String {
        format!("mcr-join-{}", self.name)
    }

    fn labels(&self) -> BTreeMap<String, String> {
        [(JOINED_AS.to_string(), self.name.clone())].into()
    }

    /// The bindings `bind` made for this join.
    fn bindings_selector(&self) -> ListParams {
        ListParams::default().labels(&format!("{JOINED_AS}={},{BINDING}", self.name))
    }

    /// The record's entries (none if there is no record).
    async fn record(&self) -> Result<Vec<Made>> {
        let api: Api<Secret> = Api::namespaced(self.client.clone(), &self.sa_namespace);
        let Some(record) = api.get_opt(&self.record_name()).await? else {
            return Ok(Vec::new());
        };
        let ours = record
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(RECORD))
            .is_some();
        if !ours {
            bail!(
                "the Secret {}/{} was not made by `mcr join`",
                self.sa_namespace,
                self.record_name()
            );
        }
        let bytes = record
            .data
            .as_ref()
            .and_then(|d| d.get(CREATED))
            .map(|b| b.0.clone());
        let text = bytes.unwrap_or_else(|| b"[]".to_vec());
        serde_json::from_slice(&text)
            .with_context(|| format!("the record {}/{}", self.sa_namespace, self.record_name()))
    }

    async fn save_record(&self, made: &[Made]) -> Result<()> {
        let mut labels = self.labels();
        labels.insert(RECORD.to_string(), "true".to_string());
        let record = serde_json::json!({
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {
                "name": self.record_name(),
                "namespace": self.sa_namespace,
                "labels": labels,
            },
            "type": "Opaque",
            "stringData": { CREATED: serde_json::to_string(made)? },
        });
        Api::<Secret>::namespaced(self.client.clone(), &self.sa_namespace)
            .patch(
                &self.record_name(),
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(&record),
            )
            .await
            .context("writing the record of what join made")?;
        Ok(())
    }

    /// Records `entry`, then makes it with `create` (which returns its uid), then records the
    /// uid.
    async fn make<F>(&self, made: &mut Vec<Made>, entry: Made, create: F) -> Result<()>
    where
        F: AsyncFnOnce() -> Result<Option<String>>,
    {
        let at = match made.iter().position(|m| m.same_object(&entry)) {
            Some(at) => at,
            None => {
                made.push(entry);
                made.len() - 1
            }
        };
        self.save_record(made).await?;
        made[at].uid = create().await?;
        self.save_record(made).await
    }

    /// Applies the manifests, makes the identity and its bindings, and issues a token for
    /// the destination `token_for`.
    pub async fn join(
        &self,
        manifests: &[String],
        cluster_roles: &[String],
        roles: &[(&str, &str)],
        ttl: Duration,
        token_for: &str,
        renewable: bool,
    ) -> Result<Issued> {
        let mut made = self.record().await?;
        let ns = self.sa_namespace.clone();

        // The identity's namespace first: the record lives there.
        let namespaces: Api<Namespace> = Api::all(self.client.clone());
        if namespaces.get_opt(&ns).await?.is_none() {
            let entry = made_entry("v1", "Namespace", None, &ns);
            let namespace = Namespace {
                metadata: ObjectMeta {
                    name: Some(ns.clone()),
                    labels: Some(self.labels()),
                    ..Default::default()
                },
                ..Default::default()
            };
            // The namespace must exist before the record can be written in it.
            let created = namespaces
                .create(&PostParams::default(), &namespace)
                .await
                .with_context(|| format!("creating the namespace {ns}"))?;
            let mut entry = entry;
            entry.uid = created.metadata.uid;
            remember(&mut made, entry);
        }
        self.save_record(&made).await?;

        for manifest in manifests {
            let documents: Vec<serde_json::Value> =
                serde_saphyr::from_multiple(manifest).map_err(|_| {
                    anyhow!("a manifest is not YAML (its text is not shown: it may hold secrets)")
                })?;
            for document in documents.into_iter().filter(|d| !d.is_null()) {
                let mut object: DynamicObject = serde_json::from_value(document)
                    .map_err(|_| anyhow!("a manifest document is not a Kubernetes object"))?;
                let (api, entry) = self.api_of(&object).await?;
                let name = entry.name.clone();
                let what = format!("{} {name}", entry.kind);
                // A new object, or one an earlier join made, carries the label: unjoin
                // deletes only what still has it. (Applied without it, the label this field
                // manager set before would be taken off.)
                let current = api.get_opt(&name).await?;
                let exists = current.is_some();
                // An object join recorded is its own only as recorded: by its uid, or, for
                // an entry whose create was interrupted (no uid), if join's field manager
                // created it. Anything else of that name someone else made.
                let recorded = made.iter().position(|m| m.same_object(&entry));
                let ours = match (recorded.map(|at| &made[at]), &current) {
                    (Some(m), Some(current)) => match &m.uid {
                        Some(uid) => current.metadata.uid.as_ref() == Some(uid),
                        None => created_by_join(&current.metadata),
                    },
                    _ => false,
                };
                if !exists || ours {
                    object
                        .metadata
                        .labels
                        .get_or_insert_with(Default::default)
                        .insert(JOINED_AS.to_string(), self.name.clone());
                }
                if let Some(current) = current {
                    api.patch(
                        &name,
                        &PatchParams::apply(FIELD_MANAGER),
                        &Patch::Apply(&object),
                    )
                    .await
                    .with_context(|| format!("applying {what}"))?;
                    match recorded {
                        Some(at) if ours => made[at].uid = current.metadata.uid,
                        // Unproven: not join's to remove.
                        Some(at) => {
                            made.remove(at);
                        }
                        None => {}
                    }
                    self.save_record(&made).await?;
                    continue;
                }
                self.make(&mut made, entry, async || {
                    let applied = api
                        .patch(
                            &name,
                            &PatchParams::apply(FIELD_MANAGER),
                            &Patch::Apply(&object),
                        )
                        .await
                        .with_context(|| format!("applying {what}"))?;
                    Ok(applied.metadata.uid)
                })
                .await?;
            }
        }

        let accounts: Api<ServiceAccount> = Api::namespaced(self.client.clone(), &ns);
        if accounts.get_opt(&self.sa_name).await?.is_none() {
            let entry = made_entry("v1", "ServiceAccount", Some(&ns), &self.sa_name);
            let account = ServiceAccount {
                metadata: ObjectMeta {
                    name: Some(self.sa_name.clone()),
                    labels: Some(self.labels()),
                    ..Default::default()
                },
                ..Default::default()
            };
            self.make(&mut made, entry, async || {
                let created = accounts
                    .create(&PostParams::default(), &account)
                    .await
                    .context("creating the ServiceAccount")?;
                Ok(created.metadata.uid)
            })
            .await?;
        }

        self.bind(
            cluster_roles,
            roles,
            renewable.then_some(token_for),
            token_for,
        )
        .await?;
        let issued = self.issue(ttl, token_for).await?;
        if renewable && let Err(error) = self.grant_renewal(token_for, &issued.anchor).await {
            self.drop_anchor(&issued.anchor).await;
            return Err(error);
        }
        Ok(issued)
    }

    /// The Role (and its binding) that lets the operator renew the token of `token_for`,
    /// anchored by `anchor`: tokens for the identity itself, Secrets created in its namespace,
    /// and only the anchors (this one and the two renewals alternate between) read and
    /// deleted.
    async fn grant_renewal(&self, token_for: &str, anchor: &str) -> Result<()> {
        let name = self.renewal_name(token_for);
        let mut labels = self.labels();
        labels.insert(BINDING.to_string(), "true".to_string());
        let mut anchors = vec![anchor.to_string()];
        anchors.extend(multicluster_runtime::providers::renewal_anchors(
            &self.name, token_for,
        ));
        let role = serde_json::json!({
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": { "name": name, "namespace": self.sa_namespace, "labels": labels },
            "rules": [
                { "apiGroups": [""], "resources": ["serviceaccounts/token"], "verbs": ["create"], "resourceNames": [self.sa_name] },
                { "apiGroups": [""], "resources": ["secrets"], "verbs": ["create"] },
                { "apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "delete"], "resourceNames": anchors },
            ],
        });
        Api::<Role>::namespaced(self.client.clone(), &self.sa_namespace)
            .patch(
                &name,
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(&role),
            )
            .await
            .context("granting the token's renewal (a Role)")?;
        let binding = serde_json::json!({
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": { "name": name, "namespace": self.sa_namespace, "labels": labels },
            "roleRef": { "apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name },
            "subjects": [{ "kind": "ServiceAccount", "name": self.sa_name, "namespace": self.sa_namespace }],
        });
        Api::<RoleBinding>::namespaced(self.client.clone(), &self.sa_namespace)
            .patch(
                &name,
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(&binding),
            )
            .await
            .context("granting the token's renewal (a RoleBinding)")?;
        Ok(())
    }

    /// The API of `object`'s kind, and its record entry.
    async fn api_of(&self, object: &DynamicObject) -> Result<(Api<DynamicObject>, Made)> {
        let types = object
            .types
            .clone()
            .ok_or_else(|| anyhow!("a manifest object has no apiVersion and kind"))?;
        let name = object
            .metadata
            .name
            .clone()
            .ok_or_else(|| anyhow!("a {} in a manifest has no name", types.kind))?;
        let entry = made_entry(
            &types.api_version,
            &types.kind,
            object.metadata.namespace.as_deref(),
            &name,
        );
        let api = self.api_for(&entry).await?.ok_or_else(|| {
            anyhow!(
                "the member does not serve {} {}",
                types.api_version,
                types.kind
            )
        })?;
        Ok((api, entry))
    }

    /// The API of a recorded object's kind; `None` if the member no longer serves it.
    async fn api_for(&self, made: &Made) -> Result<Option<Api<DynamicObject>>> {
        let (group, version) = match made.api_version.split_once('/') {
            Some((group, version)) => (group, version),
            None => ("", made.api_version.as_str()),
        };
        let gvk = GroupVersionKind::gvk(group, version, &made.kind);
        let Ok((resource, caps)) = pinned_kind(&self.client, &gvk).await else {
            return Ok(None);
        };
        Ok(Some(match (caps.scope, made.namespace.as_deref()) {
            (Scope::Namespaced, Some(ns)) => {
                Api::namespaced_with(self.client.clone(), ns, &resource)
            }
            (Scope::Namespaced, None) => bail!("the {} {} has no namespace", made.kind, made.name),
            (Scope::Cluster, _) => Api::all_with(self.client.clone(), &resource),
        }))
    }

    fn renewal_name(&self, token_for: &str) -> String {
        self.binding_name(&format!("{RENEWAL}{token_for}"))
    }

    fn binding_name(&self, role: &str) -> String {
        format!("mcr-join:{}:{role}", self.name)
    }

    /// The bindings asked for, and none other of this cluster's.
    async fn bind(
        &self,
        cluster_roles: &[String],
        roles: &[(&str, &str)],
        renewable: Option<&str>,
        token_for: &str,
    ) -> Result<()> {
        let subject = serde_json::json!([{
            "kind": "ServiceAccount",
            "name": self.sa_name,
            "namespace": self.sa_namespace,
        }]);
        let mut labels = self.labels();
        labels.insert(BINDING.to_string(), "true".to_string());
        let cluster_bindings: Api<ClusterRoleBinding> = Api::all(self.client.clone());
        let mut wanted = Vec::new();
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
            wanted.push((None, name));
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
            wanted.push((Some(namespace.to_string()), name));
        }
        if let Some(token_for) = renewable {
            wanted.push((
                Some(self.sa_namespace.clone()),
                self.renewal_name(token_for),
            ));
        }
        // Other destinations' renewals are theirs to keep or drop.
        let renewals = self.binding_name(RENEWAL);
        let this_renewal = self.renewal_name(token_for);
        self.remove_bindings(|key| {
            !wanted.contains(key) && (!key.1.starts_with(&renewals) || key.1 == this_renewal)
        })
        .await?;
        Ok(())
    }

    /// Removes this cluster's bindings for which `stale` holds; how many.
    async fn remove_bindings(
        &self,
        stale: impl Fn(&(Option<String>, String)) -> bool,
    ) -> Result<usize> {
        let mut removed = 0;
        let cluster_bindings: Api<ClusterRoleBinding> = Api::all(self.client.clone());
        for binding in cluster_bindings.list(&self.bindings_selector()).await? {
            let name = binding.metadata.name.unwrap_or_default();
            if stale(&(None, name.clone())) {
                removed += delete(&cluster_bindings, &name, None).await?;
            }
        }
        let bindings: Api<RoleBinding> = Api::all(self.client.clone());
        for binding in bindings.list(&self.bindings_selector()).await? {
            let namespace = binding.metadata.namespace.unwrap_or_default();
            let name = binding.metadata.name.unwrap_or_default();
            if stale(&(Some(namespace.clone()), name.clone())) {
                let api: Api<RoleBinding> = Api::namespaced(self.client.clone(), &namespace);
                removed += delete(&api, &name, None).await?;
            }
        }
        // A renewal's Role goes with its binding.
        let renewals = self.binding_name(RENEWAL);
        let api: Api<Role> = Api::namespaced(self.client.clone(), &self.sa_namespace);
        for role in api.list(&self.bindings_selector()).await? {
            let name = role.metadata.name.clone().unwrap_or_default();
            if name.starts_with(&renewals)
                && stale(&(Some(self.sa_namespace.clone()), name.clone()))
            {
                removed += delete(&api, &name, role.metadata.uid).await?;
            }
        }
        Ok(removed)
    }

    /// A token for the identity, valid for `ttl`, bound to a new anchor of `token_for`'s.
    async fn issue(&self, ttl: Duration, token_for: &str) -> Result<Issued> {
        let anchors: Api<Secret> = Api::namespaced(self.client.clone(), &self.sa_namespace);
        let mut labels = self.labels();
        labels.insert(TOKEN_FOR.to_string(), token_for.to_string());
        let anchor = Secret {
            metadata: ObjectMeta {
                generate_name: Some(format!("mcr-join-{}-token-", self.name)),
                labels: Some(labels),
                ..Default::default()
            },
            type_: Some("Opaque".into()),
            ..Default::default()
        };
        let anchor = anchors
            .create(&PostParams::default(), &anchor)
            .await
            .context("creating the token's anchor Secret")?;
        let anchor_name = anchor.metadata.name.clone().unwrap_or_default();
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
            .await;
        let status = match answer {
            Ok(answer) => answer.status,
            Err(error) => {
                self.drop_anchor(&anchor_name).await;
                return Err(error).context("requesting a token for the ServiceAccount");
            }
        };
        let Some((token, expires)) = status.and_then(|s| {
            let expires = serde_json::to_value(&s.expiration_timestamp).ok()?;
            Some((s.token?, expires.as_str()?.to_string()))
        }) else {
            self.drop_anchor(&anchor_name).await;
            bail!("the API server answered the token request without a token");
        };
        Ok(Issued {
            token,
            expires,
            anchor: anchor_name,
        })
    }

    /// Deletes the anchor of a token that is not going to be used (best effort).
    pub async fn drop_anchor(&self, anchor: &str) {
        let api: Api<Secret> = Api::namespaced(self.client.clone(), &self.sa_namespace);
        if let Err(error) = delete(&api, anchor, None).await {
            eprintln!(
                "warning: could not delete the unused token anchor {anchor}: {}",
                crate::report(&error)
            );
        }
    }

    /// Deletes `token_for`'s anchors but `keep`; how many.
    pub async fn revoke_tokens(&self, token_for: &str, keep: &[&str]) -> Result<usize> {
        let api: Api<Secret> = Api::namespaced(self.client.clone(), &self.sa_namespace);
        let selector = format!("{JOINED_AS}={},{TOKEN_FOR}={token_for}", self.name);
        let mut revoked = 0;
        for anchor in api.list(&ListParams::default().labels(&selector)).await? {
            let name = anchor.metadata.name.unwrap_or_default();
            if !keep.contains(&name.as_str()) {
                revoked += delete(&api, &name, None).await?;
            }
        }
        Ok(revoked)
    }

    /// Whether tokens of destinations other than `token_for` are still anchored here.
    async fn other_destinations(&self, token_for: &str) -> Result<bool> {
        let api: Api<Secret> = Api::namespaced(self.client.clone(), &self.sa_namespace);
        let selector = format!(
            "{JOINED_AS}={},{TOKEN_FOR}!={token_for},{TOKEN_FOR}",
            self.name
        );
        Ok(!api
            .list(&ListParams::default().labels(&selector))
            .await?
            .items
            .is_empty())
    }

    /// Whether the record exists.
    pub async fn joined(&self) -> Result<bool> {
        let api: Api<Secret> = Api::namespaced(self.client.clone(), &self.sa_namespace);
        Ok(api.get_opt(&self.record_name()).await?.is_some())
    }

    /// Revokes `token_for`'s tokens; when no other destination holds one, removes the
    /// bindings and what join made. Returns what it removed, and what it kept and why.
    pub async fn unjoin(&self, token_for: &str) -> Result<(usize, Vec<String>)> {
        let mut removed = self.revoke_tokens(token_for, &[]).await?;
        // This destination's renewal, whatever else stays.
        let renewal = self.renewal_name(token_for);
        removed += self.remove_bindings(|key| key.1 == renewal).await?;
        let mut kept = Vec::new();
        if self.other_destinations(token_for).await? {
            kept.push(format!(
                "the identity and its bindings: another destination of {} still holds a token",
                self.name
            ));
            return Ok((removed, kept));
        }
        removed += self.remove_bindings(|_| true).await?;
        let made = self.record().await?;
        // Other joins' records in the identity's namespace: what they use stays.
        let records: Api<Secret> = Api::namespaced(self.client.clone(), &self.sa_namespace);
        let others: Vec<String> = records
            .list(&ListParams::default().labels(RECORD))
            .await?
            .into_iter()
            .filter(|r| {
                r.metadata.labels.as_ref().and_then(|l| l.get(JOINED_AS)) != Some(&self.name)
            })
            .filter_map(|r| r.metadata.name)
            .collect();
        for object in made.iter().rev() {
            let what = format!("{} {}", object.kind, object.name);
            let shared = object.kind == "ServiceAccount" && object.name == self.sa_name
                || object.kind == "Namespace" && object.name == self.sa_namespace;
            if shared && !others.is_empty() {
                kept.push(format!(
                    "{what}: other joins use it ({})",
                    others.join(", ")
                ));
                continue;
            }
            if object.kind == "Namespace" && object.api_version == "v1" {
                if let Some(holds) = self.namespace_holds_others(&object.name).await? {
                    kept.push(format!("{what}: it holds {holds}, which join did not make"));
                    continue;
                }
                // The record goes before its namespace.
                delete(&records, &self.record_name(), None).await?;
            }
            let Some(api) = self.api_for(object).await? else {
                continue;
            };
            let Some(current) = api.get_opt(&object.name).await? else {
                continue;
            };
            let labelled = current
                .metadata
                .labels
                .as_ref()
                .and_then(|l| l.get(JOINED_AS))
                == Some(&self.name);
            let same = match &object.uid {
                Some(uid) => current.metadata.uid.as_ref() == Some(uid),
                // Recorded, then the join stopped before the create's answer: join's only
                // if its field manager created it.
                None => created_by_join(&current.metadata),
            };
            if !labelled || !same {
                kept.push(format!(
                    "{what}: not the object join made (its label or uid differs)"
                ));
                continue;
            }
            removed += delete(&api, &object.name, current.metadata.uid).await?;
        }
        delete(&records, &self.record_name(), None).await?;
        Ok((removed, kept))
    }

    /// Something in `namespace` that join did not make, if anything (the defaults every
    /// namespace gets aside).
    async fn namespace_holds_others(&self, namespace: &str) -> Result<Option<String>> {
        let discovery = Discovery::new(self.client.clone())
            .run()
            .await
            .context("discovering the member's kinds")?;
        for group in discovery.groups() {
            for (resource, caps) in group.recommended_resources() {
                if caps.scope != Scope::Namespaced || !caps.supports_operation(verbs::LIST) {
                    continue;
                }
                if resource.kind == "Event" {
                    continue;
                }
                let api: Api<DynamicObject> =
                    Api::namespaced_with(self.client.clone(), namespace, &resource);
                // What cannot be listed (a conversion webhook down, a kind this user may
                // not list) may hold anything: the namespace is kept, saying why.
                let list = match api.list(&ListParams::default()).await {
                    Ok(list) => list,
                    Err(error) => {
                        let why = match &error {
                            kube::Error::Api(status) => {
                                format!("{} ({})", status.reason, status.code)
                            }
                            _ => "an error".to_string(),
                        };
                        return Ok(Some(format!(
                            "{} objects that could not be listed: {why}",
                            resource.kind
                        )));
                    }
                };
                for object in list {
                    let name = object.metadata.name.clone().unwrap_or_default();
                    let ours = object
                        .metadata
                        .labels
                        .as_ref()
                        .and_then(|l| l.get(JOINED_AS))
                        == Some(&self.name);
                    let default = matches!(
                        (resource.kind.as_str(), name.as_str()),
                        ("ConfigMap", "kube-root-ca.crt") | ("ServiceAccount", "default")
                    );
                    if !ours && !default {
                        return Ok(Some(format!("{} {name}", resource.kind)));
                    }
                }
            }
        }
        Ok(None)
    }
}

/// Whether `meta`'s object was created by `mcr join`: its field manager's entry is dated at
/// the object's creation.
fn created_by_join(meta: &ObjectMeta) -> bool {
    let Some(created) = &meta.creation_timestamp else {
        return false;
    };
    meta.managed_fields
        .iter()
        .flatten()
        .any(|f| f.manager.as_deref() == Some(FIELD_MANAGER) && f.time.as_ref() == Some(created))
}

fn made_entry(api_version: &str, kind: &str, namespace: Option<&str>, name: &str) -> Made {
    Made {
        api_version: api_version.to_string(),
        kind: kind.to_string(),
        namespace: namespace.map(str::to_string),
        name: name.to_string(),
        uid: None,
    }
}

fn remember(made: &mut Vec<Made>, entry: Made) {
    match made.iter_mut().find(|m| m.same_object(&entry)) {
        Some(known) => known.uid = entry.uid,
        None => made.push(entry),
    }
}

/// Deletes `name` (only the object with `uid`, if given); 1 if it was there, 0 if not.
async fn delete<K>(api: &Api<K>, name: &str, uid: Option<String>) -> Result<usize>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let params = DeleteParams {
        preconditions: uid.map(|uid| Preconditions {
            uid: Some(uid),
            resource_version: None,
        }),
        ..Default::default()
    };
    match api.delete(name, &params).await {
        Ok(_) => Ok(1),
        Err(kube::Error::Api(status)) if status.code == 404 => Ok(0),
        Err(e) => Err(e).with_context(|| format!("deleting {name}")),
    }
}
