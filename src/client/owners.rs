//! The check every cluster client makes on native `ownerReferences`: a write whose object
//! names an owner uid its cluster does not hold is refused before it is sent, since that
//! cluster's garbage collector would delete the object (and the controller recreate it, in
//! a loop). The usual way in is an owner from another cluster of the fleet.
//!
//! Cost: a write without `ownerReferences` in its body pays a byte search. A reference to a
//! uid the cluster is known to hold (the object being reconciled there, or one checked
//! before) is let through at once; any other is read back from the cluster first (one GET,
//! and one discovery request per group version), then remembered.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use http::{Method, Request};
use kube::client::Body;

use crate::util::sync::lock;

/// How many uids a cluster's client remembers as held by its cluster.
const KNOWN: usize = 16_384;

/// A native owner reference refused before it was sent: its uid is not of an object in the
/// cluster the write goes to.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "cluster {cluster}: refused to send a native ownerReference to {kind} {owner} (uid {uid}): {why}; the garbage collector of cluster {cluster} would delete the object that carries it. Record an owner in another cluster with Context::own (and Builder::owns_in_fleet); Cluster::with_owner_reference_check(false) turns this check off"
)]
pub struct OwnerReferenceRefused {
    /// The cluster the write was for.
    pub cluster: String,
    /// The owner's kind, as the reference gives it.
    pub kind: String,
    /// The owner's namespace and name (`namespace/name`, or the name of a cluster-scoped
    /// owner), as the reference gives it.
    pub owner: String,
    /// The owner uid of the reference.
    pub uid: String,
    /// The cluster of the fleet that holds an object of that uid, if this process has seen it.
    pub holder: Option<String>,
    why: String,
}

/// One owner reference of a write.
#[derive(Clone, Debug, PartialEq, Eq)]
struct OwnerRef {
    api_version: String,
    kind: String,
    name: String,
    uid: String,
}

/// The guard's part of a cluster client's state.
pub(crate) struct OwnerCheck {
    on: AtomicBool,
    /// The cluster's id, for errors.
    name: Mutex<Arc<str>>,
    known: Mutex<Known>,
    /// `(apiVersion, kind)` → `(resource, namespaced)`, from the cluster's discovery.
    kinds: Mutex<HashMap<(String, String), (kube::api::ApiResource, bool)>>,
    /// The cluster's client, for the reads of a check (through this same layer: reads are
    /// not checked).
    client: OnceLock<Box<dyn Fn() -> Option<kube::Client> + Send + Sync>>,
}

/// Uids the cluster holds, each with the namespace of its object (`None`: cluster-scoped;
/// a uid is one object's): the collector finds an owner in its dependent's namespace only.
/// Looked up by `&str`, so the reconcile that notes its object again allocates nothing.
#[derive(Default)]
struct Known {
    uids: HashMap<Box<str>, Option<Box<str>>>,
    order: VecDeque<Box<str>>,
}

impl Known {
    fn insert(&mut self, namespace: Option<&str>, uid: &str) {
        if self.uids.contains_key(uid) {
            return;
        }
        if self.order.len() >= KNOWN
            && let Some(oldest) = self.order.pop_front()
        {
            self.uids.remove(&oldest);
        }
        self.uids.insert(uid.into(), namespace.map(Box::from));
        self.order.push_back(uid.into());
    }

    fn contains(&self, namespace: Option<&str>, uid: &str) -> bool {
        match self.uids.get(uid) {
            Some(None) => true,
            Some(Some(held)) => namespace == Some(&**held),
            None => false,
        }
    }
}

impl Default for OwnerCheck {
    fn default() -> Self {
        Self {
            on: AtomicBool::new(true),
            name: Mutex::new(Arc::from("")),
            known: Mutex::default(),
            kinds: Mutex::default(),
            client: OnceLock::new(),
        }
    }
}

/// Every cluster client's check, to name the cluster that holds a refused uid.
static CHECKS: Mutex<Vec<Weak<crate::client::layer::ClientState>>> = Mutex::new(Vec::new());

impl OwnerCheck {
    /// Names the cluster and gives the check its client; registers it.
    pub(crate) fn attach(
        state: &Arc<crate::client::layer::ClientState>,
        name: &str,
        client: Box<dyn Fn() -> Option<kube::Client> + Send + Sync>,
    ) {
        *lock(&state.owners.name) = Arc::from(name);
        if state.owners.client.set(client).is_ok() {
            let mut checks = lock(&CHECKS);
            checks.retain(|w| w.strong_count() > 0);
            checks.push(Arc::downgrade(state));
        }
    }

    /// Turns the check on or off.
    pub(crate) fn set(&self, on: bool) {
        self.on.store(on, Ordering::Relaxed);
    }

    /// Whether the check is on.
    pub(crate) fn is_on(&self) -> bool {
        self.on.load(Ordering::Relaxed)
    }

    /// Remembers that the cluster holds an object of `uid` in `namespace` (`None`:
    /// cluster-scoped).
    pub(crate) fn know(&self, namespace: Option<&str>, uid: &str) {
        lock(&self.known).insert(namespace, uid);
    }

    /// Whether an owner of `uid` is known to be where a write to `namespace` finds it.
    fn knows(&self, namespace: Option<&str>, uid: &str) -> bool {
        lock(&self.known).contains(namespace, uid)
    }

    /// Whether an object of `uid` is known in any namespace of the cluster.
    fn knows_anywhere(&self, uid: &str) -> bool {
        lock(&self.known).uids.contains_key(uid)
    }

    /// The owner references of `request` that need a check: none for a read, a write
    /// without references, or references to uids the cluster is known to hold.
    pub(crate) fn needs_check(&self, request: &Request<Body>) -> Option<Pending> {
        if !self.is_on()
            || !matches!(
                *request.method(),
                Method::POST | Method::PUT | Method::PATCH
            )
        {
            return None;
        }
        let body = request.body().try_clone()?;
        let bytes = futures::FutureExt::now_or_never(http_body_util::BodyExt::collect(body))?
            .ok()?
            .to_bytes();
        memchr::memmem::find(&bytes, b"ownerReferences")?;
        let json_patch = request
            .headers()
            .get(http::header::CONTENT_TYPE)
            .is_some_and(|v| v.as_bytes().starts_with(b"application/json-patch"));
        let value: serde_json::Value = serde_json::from_slice(&bytes).ok()?;
        let mut refs = Vec::new();
        if json_patch {
            references_of_patch(&value, &mut refs);
        } else {
            references_of(value.pointer("/metadata/ownerReferences"), &mut refs);
        }
        let namespace = namespace_of(request.uri().path());
        refs.retain(|r| !self.knows(namespace.as_deref(), &r.uid));
        if refs.is_empty() {
            return None;
        }
        Some(Pending { refs, namespace })
    }

    /// Reads each reference's owner back from the cluster; the first that is not there is
    /// refused.
    pub(crate) async fn verify(&self, pending: Pending) -> Result<(), OwnerReferenceRefused> {
        let cluster = lock(&self.name).to_string();
        let client = self.client.get().and_then(|make| make());
        for reference in pending.refs {
            let refused = |why: String, holder: Option<String>| OwnerReferenceRefused {
                cluster: cluster.clone(),
                kind: reference.kind.clone(),
                owner: match &pending.namespace {
                    Some(ns) => format!("{ns}/{}", reference.name),
                    None => reference.name.clone(),
                },
                uid: reference.uid.clone(),
                holder,
                why,
            };
            if !is_path_safe_name(&reference.name)
                || !is_api_version(&reference.api_version)
                || reference.kind.is_empty()
                || !reference.kind.chars().all(|c| c.is_ascii_alphanumeric())
            {
                return Err(refused(
                    "the reference cannot be checked: its apiVersion, kind or name is not one an object can have, or a JSON patch changes a part of it alone; write the whole entry".into(),
                    None,
                ));
            }
            let Some(client) = &client else {
                return Err(refused(
                    "it could not be checked (the cluster's client is gone)".into(),
                    None,
                ));
            };
            match self
                .holds(client, &reference, pending.namespace.as_deref())
                .await
            {
                Ok(Some(namespaced)) => self.know(
                    pending.namespace.as_deref().filter(|_| namespaced),
                    &reference.uid,
                ),
                Ok(None) => {
                    let holder = holder_of(&reference.uid, &cluster);
                    let why = match &holder {
                        Some(holder) => format!("that uid is of an object in cluster {holder}"),
                        None if self.knows_anywhere(&reference.uid) => format!(
                            "that uid is of an object in another namespace of cluster {cluster}, where the collector does not look"
                        ),
                        None => format!("cluster {cluster} holds no object of that uid"),
                    };
                    return Err(refused(why, holder));
                }
                Err(reason) => {
                    return Err(refused(format!("it could not be checked ({reason})"), None));
                }
            }
        }
        Ok(())
    }

    /// Whether the cluster holds the reference's owner with its uid where the collector
    /// looks for it: `Some(namespaced)` if it does.
    async fn holds(
        &self,
        client: &kube::Client,
        reference: &OwnerRef,
        namespace: Option<&str>,
    ) -> Result<Option<bool>, String> {
        let Some((resource, namespaced)) = self.resource(client, reference).await? else {
            return Ok(None);
        };
        let api: kube::Api<kube::api::DynamicObject> = match (namespaced, namespace) {
            (true, Some(ns)) => kube::Api::namespaced_with(client.clone(), ns, &resource),
            // A namespaced owner of a cluster-scoped object is not found by the collector.
            (true, None) => return Ok(None),
            (false, _) => kube::Api::all_with(client.clone(), &resource),
        };
        match api.get_opt(&reference.name).await {
            Ok(object) => Ok(object
                .is_some_and(|o| o.metadata.uid.as_deref() == Some(reference.uid.as_str()))
                .then_some(namespaced)),
            Err(error) => Err(crate::client::redact::safe_text(&error)),
        }
    }

    /// The resource of the reference's kind and whether it is namespaced (kube's discovery,
    /// remembered per kind); `None` for a kind the cluster does not serve.
    async fn resource(
        &self,
        client: &kube::Client,
        reference: &OwnerRef,
    ) -> Result<Option<(kube::api::ApiResource, bool)>, String> {
        let key = (reference.api_version.clone(), reference.kind.clone());
        if let Some(found) = lock(&self.kinds).get(&key) {
            return Ok(Some(found.clone()));
        }
        let (group, version) = reference
            .api_version
            .rsplit_once('/')
            .unwrap_or(("", &reference.api_version));
        let gvk = kube::api::GroupVersionKind::gvk(group, version, &reference.kind);
        let found = match kube::discovery::pinned_kind(client, &gvk).await {
            Ok((resource, capabilities)) => (
                resource,
                capabilities.scope == kube::discovery::Scope::Namespaced,
            ),
            Err(kube::Error::Discovery(_)) => return Ok(None),
            Err(kube::Error::Api(status)) if status.code == 404 => return Ok(None),
            Err(error) => return Err(crate::client::redact::safe_text(&error)),
        };
        lock(&self.kinds).insert(key, found.clone());
        Ok(Some(found))
    }
}

/// Whether `name` can be an object's name in a request path: not empty, not `.` or `..`,
/// and only letters, digits and `-._:@~+` (no `/`, `?`, `#`, `%` or space, which would
/// change the path or the query).
pub(crate) fn is_path_safe_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name != "."
        && name != ".."
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-._:@~+".contains(c))
}

/// Whether `api_version` is `<version>` or `<group>/<version>` of letters, digits, `-` and
/// (in the group) `.`.
pub(crate) fn is_api_version(api_version: &str) -> bool {
    let (group, version) = api_version.rsplit_once('/').unwrap_or(("", api_version));
    !version.is_empty()
        && version.chars().all(|c| c.is_ascii_alphanumeric())
        && group
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.')
        && (group.is_empty() || !group.starts_with('.'))
}

/// References waiting for their check, and the namespace of the write.
pub(crate) struct Pending {
    refs: Vec<OwnerRef>,
    namespace: Option<String>,
}

impl fmt::Debug for Pending {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pending")
            .field("refs", &self.refs.len())
            .finish()
    }
}

/// The cluster other than `except` whose client knows `uid`.
fn holder_of(uid: &str, except: &str) -> Option<String> {
    let checks: Vec<_> = lock(&CHECKS).iter().filter_map(Weak::upgrade).collect();
    checks.into_iter().find_map(|state| {
        let name = lock(&state.owners.name).clone();
        (&*name != except && state.owners.knows_anywhere(uid)).then(|| name.to_string())
    })
}

/// The namespace a request's path is in: the segment after `namespaces` when a resource
/// follows it.
fn namespace_of(path: &str) -> Option<String> {
    let segments: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let at = segments.iter().position(|s| *s == "namespaces")?;
    // `…/namespaces/{ns}/{resource}…`; `/api/v1/namespaces/{ns}` is a Namespace itself.
    (segments.len() > at + 2).then(|| segments[at + 1].to_string())
}

/// The references in an `ownerReferences` value (a list, or one entry).
fn references_of(value: Option<&serde_json::Value>, out: &mut Vec<OwnerRef>) {
    let one = |v: &serde_json::Value| -> Option<OwnerRef> {
        Some(OwnerRef {
            api_version: v.get("apiVersion")?.as_str()?.to_string(),
            kind: v.get("kind")?.as_str()?.to_string(),
            name: v.get("name")?.as_str()?.to_string(),
            uid: v.get("uid")?.as_str()?.to_string(),
        })
    };
    match value {
        Some(serde_json::Value::Array(items)) => out.extend(items.iter().filter_map(one)),
        Some(item @ serde_json::Value::Object(_)) => out.extend(one(item)),
        _ => {}
    }
}

/// The references a JSON patch adds or replaces.
fn references_of_patch(patch: &serde_json::Value, out: &mut Vec<OwnerRef>) {
    let Some(ops) = patch.as_array() else { return };
    for op in ops {
        if !matches!(
            op.get("op").and_then(|o| o.as_str()),
            Some("add" | "replace" | "copy" | "move")
        ) {
            continue;
        }
        let (Some(path), Some(value)) = (op.get("path").and_then(|p| p.as_str()), op.get("value"))
        else {
            continue;
        };
        match path {
            "" => references_of(value.pointer("/metadata/ownerReferences"), out),
            "/metadata" => references_of(value.get("ownerReferences"), out),
            "/metadata/ownerReferences" => references_of(Some(value), out),
            _ => {
                if let Some(rest) = path.strip_prefix("/metadata/ownerReferences/") {
                    if !rest.contains('/') {
                        references_of(Some(value), out);
                    } else {
                        // A part of an entry alone (its uid, its name): it cannot be checked
                        // without the rest, so it is refused as unresolvable.
                        out.push(OwnerRef {
                            api_version: String::new(),
                            kind: String::new(),
                            name: String::new(),
                            uid: value.as_str().unwrap_or_default().to_string(),
                        });
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(
        method: Method,
        path: &str,
        content_type: &str,
        body: serde_json::Value,
    ) -> Request<Body> {
        Request::builder()
            .method(method)
            .uri(path)
            .header(http::header::CONTENT_TYPE, content_type)
            .body(Body::from(serde_json::to_vec(&body).unwrap()))
            .unwrap()
    }

    fn reference(uid: &str) -> serde_json::Value {
        serde_json::json!({"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": uid})
    }

    #[test]
    fn the_references_of_every_write_shape_are_found_and_known_uids_pass() {
        let check = OwnerCheck::default();
        let object =
            serde_json::json!({"metadata": {"name": "c", "ownerReferences": [reference("u1")]}});
        for (method, content_type) in [
            (Method::POST, "application/json"),
            (Method::PUT, "application/json"),
            (Method::PATCH, "application/merge-patch+json"),
            (Method::PATCH, "application/apply-patch+yaml"),
            (Method::PATCH, "application/strategic-merge-patch+json"),
        ] {
            let request = write(
                method.clone(),
                "/api/v1/namespaces/ns/configmaps/c",
                content_type,
                object.clone(),
            );
            let pending = check.needs_check(&request).expect("a reference to check");
            assert_eq!(pending.refs[0].uid, "u1", "{method} {content_type}");
            assert_eq!(pending.namespace.as_deref(), Some("ns"));
        }
        for patch in [
            serde_json::json!([{"op": "add", "path": "/metadata/ownerReferences", "value": [reference("u1")]}]),
            serde_json::json!([{"op": "add", "path": "/metadata/ownerReferences/-", "value": reference("u1")}]),
            serde_json::json!([{"op": "replace", "path": "/metadata", "value": {"ownerReferences": [reference("u1")]}}]),
            serde_json::json!([{"op": "replace", "path": "", "value": object.clone()}]),
            // A part of an entry alone cannot be checked: it is held for the check (which
            // refuses it).
            serde_json::json!([{"op": "replace", "path": "/metadata/ownerReferences/0/uid", "value": "u1"}]),
        ] {
            let request = write(
                Method::PATCH,
                "/api/v1/namespaces/ns/configmaps/c",
                "application/json-patch+json",
                patch.clone(),
            );
            assert!(check.needs_check(&request).is_some(), "{patch}");
        }
        // A removal, a read, a body without references, a known uid: nothing to check.
        let removal = serde_json::json!([{"op": "remove", "path": "/metadata/ownerReferences"}]);
        let request = write(
            Method::PATCH,
            "/api/v1/namespaces/ns/configmaps/c",
            "application/json-patch+json",
            removal,
        );
        assert!(check.needs_check(&request).is_none());
        let get = Request::get("/api/v1/namespaces/ns/configmaps/c")
            .body(Body::empty())
            .unwrap();
        assert!(check.needs_check(&get).is_none());
        let plain = write(
            Method::POST,
            "/api/v1/namespaces/ns/configmaps",
            "application/json",
            serde_json::json!({"metadata": {"name": "c"}}),
        );
        assert!(check.needs_check(&plain).is_none());
        check.know(Some("ns"), "u1");
        let request = write(
            Method::POST,
            "/api/v1/namespaces/ns/configmaps",
            "application/json",
            object.clone(),
        );
        assert!(check.needs_check(&request).is_none());
        // Off: nothing is checked.
        let off = OwnerCheck::default();
        off.set(false);
        assert!(off.needs_check(&request).is_none());
    }

    #[test]
    fn the_namespace_is_the_writes_not_a_namespace_objects_name() {
        assert_eq!(
            namespace_of("/api/v1/namespaces/a/configmaps"),
            Some("a".into())
        );
        assert_eq!(
            namespace_of("/apis/apps/v1/namespaces/b/deployments/d"),
            Some("b".into())
        );
        assert_eq!(namespace_of("/api/v1/namespaces/c"), None);
        assert_eq!(namespace_of("/api/v1/namespaces"), None);
        assert_eq!(
            namespace_of("/apis/rbac.authorization.k8s.io/v1/clusterroles/r"),
            None
        );
    }

    #[test]
    fn the_set_of_known_uids_is_bounded() {
        let mut known = Known::default();
        for i in 0..KNOWN + 10 {
            known.insert(None, &i.to_string());
        }
        assert_eq!(known.uids.len(), KNOWN);
        assert!(!known.contains(None, "0"));
        assert!(known.contains(Some("any"), &(KNOWN + 9).to_string()));
        // A namespaced owner is known in its own namespace only.
        known.insert(Some("a"), "u");
        assert!(known.contains(Some("a"), "u"));
        assert!(!known.contains(Some("b"), "u"));
        assert!(!known.contains(None, "u"));
    }
}
