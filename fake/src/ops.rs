//! The verbs on objects: get, list, create, update, delete, and what the cluster's controllers
//! do after a write (owner-reference garbage collection, namespace clean-up).

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use base64::Engine as _;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use serde_json::{Map, Value, json};

use crate::apply;
use crate::kinds::{Resource, ResourceId};
use crate::selectors::{FieldSelector, LabelSelector};
use crate::status::ApiError;
use crate::store::{Key, Store, finalizers, meta, meta_mut, meta_str};

/// Which objects a request names: a resource at a version, maybe a namespace, a name and a
/// subresource.
#[derive(Clone, Debug)]
pub(crate) struct Target {
    pub(crate) resource: ResourceId,
    pub(crate) version: String,
    pub(crate) namespace: Option<String>,
    pub(crate) name: Option<String>,
    pub(crate) subresource: Option<String>,
}

/// The options of a write.
#[derive(Clone, Debug, Default)]
pub(crate) struct WriteOptions {
    pub(crate) dry_run: bool,
    /// Who writes: the `fieldManager` parameter, else the client's user agent, else
    /// `unknown`. `None` leaves the managed fields as the body has them (an apply).
    pub(crate) manager: Option<String>,
    /// Keep the uid the body gives (objects a test puts in place, so that owner references
    /// among them hold).
    pub(crate) keep_uid: bool,
}

/// The options of a list.
#[derive(Clone, Debug, Default)]
pub(crate) struct ListOptions {
    pub(crate) labels: LabelSelector,
    pub(crate) fields: FieldSelector,
    pub(crate) limit: Option<usize>,
    pub(crate) continue_token: Option<String>,
    pub(crate) resource_version: Option<String>,
    pub(crate) exact: bool,
}

/// The options of a delete (the body a client sends, `DeleteOptions`).
#[derive(Clone, Debug, Default)]
pub(crate) struct DeleteOptions {
    pub(crate) dry_run: bool,
    pub(crate) propagation: Option<String>,
    pub(crate) uid: Option<String>,
    pub(crate) resource_version: Option<String>,
}

/// What a fake server does besides storing objects.
#[derive(Clone, Debug)]
pub(crate) struct Behaviour {
    /// Owner-reference garbage collection and namespace clean-up, done at once after each
    /// write (kube-controller-manager's work in a real cluster).
    pub(crate) controllers: bool,
}

const GENERATED_CHARS: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";

/// The current time as the API server writes it (RFC 3339, whole seconds).
pub(crate) fn now() -> String {
    let t = time::OffsetDateTime::now_utc();
    format!(
        "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}Z",
        t.year(),
        u8::from(t.month()),
        t.day(),
        t.hour(),
        t.minute(),
        t.second()
    )
}

/// Whether `name` is a lowercase RFC 1123 subdomain.
fn is_subdomain(name: &str) -> bool {
    name.len() <= 253 && name.split('.').all(is_label)
}

/// Whether `name` is a lowercase RFC 1123 label.
fn is_label(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-')
        && !name.ends_with('-')
}

fn name_error(resource: &Resource, name: &str) -> ApiError {
    let message = if resource.plural == "namespaces" {
        format!(
            "Invalid value: \"{name}\": a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')"
        )
    } else {
        format!(
            "Invalid value: \"{name}\": a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')"
        )
    };
    ApiError::invalid(
        resource,
        name,
        &[("metadata.name", "FieldValueInvalid", message)],
    )
}

/// What `metadata.generation` counts changes of: the object but its metadata (and its status,
/// when that has a subresource of its own).
fn spec_of(object: &Value, status_subresource: bool) -> Value {
    let mut v = object.clone();
    if let Some(o) = v.as_object_mut() {
        o.remove("metadata");
        // Without a status subresource, the status is part of what the generation counts.
        if status_subresource {
            o.remove("status");
        }
        o.remove("apiVersion");
        o.remove("kind");
    }
    v
}

/// The fields the server keeps however a write sets them.
const SYSTEM_FIELDS: &[&str] = &[
    "uid",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "generation",
    "resourceVersion",
    "managedFields",
    "selfLink",
];

impl Store {
    fn resource(&self, id: ResourceId) -> &Resource {
        self.registry.get(id)
    }

    fn key(t: &Target, name: &str) -> Key {
        Key {
            resource: t.resource,
            namespace: t.namespace.clone().unwrap_or_default(),
            name: name.to_owned(),
        }
    }

    /// An object as served at `version`.
    pub(crate) fn shown(&self, id: ResourceId, version: &str, object: &Value) -> Value {
        let mut v = object.clone();
        v["apiVersion"] = Value::String(self.resource(id).api_version(version));
        v
    }

    pub(crate) fn get_object(&self, t: &Target, name: &str) -> Result<Value, ApiError> {
        let r = self.resource(t.resource);
        let object = self
            .get(&Self::key(t, name))
            .ok_or_else(|| ApiError::not_found(r, name))?;
        Ok(self.shown(t.resource, &t.version, object))
    }

    /// A list, maybe one page of it.
    pub(crate) fn list(&self, t: &Target, o: &ListOptions) -> Result<Value, ApiError> {
        let r = self.resource(t.resource).clone();
        let (rv, start) = match &o.continue_token {
            Some(token) => {
                let (rv, start) = decode_continue(token)?;
                (rv, Some(start))
            }
            None => match (&o.resource_version, o.exact) {
                (Some(v), true) => (
                    v.parse()
                        .map_err(|_| ApiError::bad_request("invalid resource version"))?,
                    None,
                ),
                _ => (self.rv, None),
            },
        };
        if rv > self.rv {
            return Err(ApiError::too_large_resource_version(rv, self.rv));
        }
        let objects: BTreeMap<Key, Arc<Value>> = if rv == self.rv {
            self.of(t.resource, t.namespace.as_deref())
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect()
        } else {
            self.snapshot(t.resource, rv)?
                .into_iter()
                .filter(|(k, _)| t.namespace.as_ref().is_none_or(|ns| *ns == k.namespace))
                .collect()
        };
        let selected = objects.iter().filter(|(k, v)| {
            start
                .as_ref()
                .is_none_or(|s| (&k.namespace, &k.name) > (&s.0, &s.1))
                && o.labels
                    .matches(v.pointer("/metadata/labels").and_then(Value::as_object))
                && o.fields.matches(v)
        });
        let mut items = Vec::new();
        let mut more = None;
        let mut remaining = 0usize;
        for (k, v) in selected {
            if o.limit.is_some_and(|l| l > 0 && items.len() >= l) {
                if more.is_none() {
                    more = items
                        .last()
                        .map(|(k, _): &(Key, Value)| (k.namespace.clone(), k.name.clone()));
                }
                remaining += 1;
                continue;
            }
            let mut shown = self.shown(t.resource, &t.version, v);
            if !r.custom {
                // Items of a built-in kind's list are encoded without their kind.
                if let Some(m) = shown.as_object_mut() {
                    m.remove("apiVersion");
                    m.remove("kind");
                }
            }
            items.push((k.clone(), shown));
        }
        let mut metadata = json!({"resourceVersion": rv.to_string()});
        if let Some(start) = more {
            metadata["continue"] = Value::String(encode_continue(rv, &start));
            if o.labels == LabelSelector::default() && o.fields == FieldSelector::default() {
                metadata["remainingItemCount"] = json!(remaining);
            }
        }
        Ok(json!({
            "kind": format!("{}List", r.kind),
            "apiVersion": r.api_version(&t.version),
            "metadata": metadata,
            "items": items.into_iter().map(|(_, v)| v).collect::<Vec<_>>(),
        }))
    }

    /// Checks the namespace an object is written in exists and takes new objects.
    fn check_namespace(&self, r: &Resource, namespace: &str, name: &str) -> Result<(), ApiError> {
        let Some(ns_id) = self.registry.find("", "v1", "namespaces") else {
            return Ok(());
        };
        let key = Key {
            resource: ns_id,
            namespace: String::new(),
            name: namespace.to_owned(),
        };
        match self.get(&key) {
            None => Err(ApiError::namespace_not_found(namespace)),
            Some(ns) if meta_str(ns, "deletionTimestamp").is_some() => {
                Err(ApiError::namespace_terminating(r, name, namespace))
            }
            Some(_) => Ok(()),
        }
    }

    /// Checks `apiVersion` and `kind` of a body against the URL's.
    fn check_kind(&self, t: &Target, body: &Value) -> Result<(), ApiError> {
        let r = self.resource(t.resource);
        let expected = r.api_version(&t.version);
        match body.get("apiVersion").and_then(Value::as_str) {
            Some(v) if v != expected => {
                return Err(ApiError::bad_request(format!(
                    "the API version in the data ({v}) does not match the expected API version ({expected})"
                )));
            }
            _ => {}
        }
        match body.get("kind").and_then(Value::as_str) {
            Some(k) if k != r.kind => Err(ApiError::bad_request(format!(
                "the kind in the data ({k}) does not match the expected kind ({})",
                r.kind
            ))),
            _ => Ok(()),
        }
    }

    /// Checks the body of a write to the object `name`: an object, of the URL's kind, naming
    /// the URL's object if it names one. Returns the resource.
    fn check_body(&self, t: &Target, name: &str, body: &Value) -> Result<Resource, ApiError> {
        if !body.is_object() {
            return Err(ApiError::bad_request(
                "the body of the request is not an object",
            ));
        }
        self.check_kind(t, body)?;
        if let Some(body_name) = meta_str(body, "name")
            && body_name != name
        {
            return Err(ApiError::bad_request(format!(
                "the name of the object ({body_name}) does not match the name on the URL ({name})"
            )));
        }
        Ok(self.resource(t.resource).clone())
    }

    pub(crate) fn create(
        &mut self,
        t: &Target,
        mut body: Value,
        o: &WriteOptions,
    ) -> Result<Value, ApiError> {
        if !body.is_object() {
            return Err(ApiError::bad_request(
                "the body of the request is not an object",
            ));
        }
        self.check_kind(t, &body)?;
        let r = self.resource(t.resource).clone();
        let generate = meta_str(&body, "generateName").map(str::to_owned);
        let mut name = meta_str(&body, "name").map(str::to_owned);
        if r.namespaced {
            let ns = t.namespace.clone().unwrap_or_default();
            if let Some(body_ns) = meta_str(&body, "namespace")
                && body_ns != ns
            {
                return Err(ApiError::bad_request(
                    "the namespace of the provided object does not match the namespace sent on the request",
                ));
            }
            meta_mut(&mut body).insert("namespace".into(), json!(ns));
        }
        if name.is_none() {
            let Some(prefix) = &generate else {
                return Err(ApiError::invalid(
                    &r,
                    "",
                    &[(
                        "metadata.name",
                        "FieldValueRequired",
                        "Required value: name or generateName is required".into(),
                    )],
                ));
            };
            let suffix: String = (0..5)
                .map(|_| GENERATED_CHARS[self.rng.usize(..GENERATED_CHARS.len())] as char)
                .collect();
            name = Some(format!("{prefix}{suffix}"));
        }
        let name = name.unwrap_or_default();
        let valid = if r.plural == "namespaces" {
            is_label(&name)
        } else {
            is_subdomain(&name)
        };
        if !valid {
            return Err(name_error(&r, &name));
        }
        if r.namespaced {
            self.check_namespace(&r, t.namespace.as_deref().unwrap_or_default(), &name)?;
        }
        let key = Self::key(t, &name);
        if self.get(&key).is_some() {
            return Err(ApiError::already_exists(&r, &name));
        }
        body["apiVersion"] = json!(r.api_version(r.storage_version()));
        body["kind"] = json!(r.kind);
        let given_uid = meta_str(&body, "uid")
            .map(str::to_owned)
            .filter(|_| o.keep_uid);
        let uid = match given_uid {
            Some(uid) => uid,
            None => self.uid(),
        };
        let meta = meta_mut(&mut body);
        for field in SYSTEM_FIELDS {
            // An apply that creates brings the managed fields it computed.
            if *field != "managedFields" || o.manager.is_some() {
                meta.remove(*field);
            }
        }
        meta.insert("name".into(), json!(name));
        meta.insert("uid".into(), json!(uid));
        meta.insert("creationTimestamp".into(), json!(now()));
        if r.generation {
            meta.insert("generation".into(), json!(1));
        }
        if r.status_subresource {
            prepare_status_for_create(&r, &mut body);
        }
        shape(&r, &mut body);
        // The writer owns what it wrote, not what the server adds after (a namespace's spec
        // and phase).
        if let Some(manager) = &o.manager {
            let api_version = r.api_version(&t.version);
            apply::record_update(&r, None, &mut body, manager, &api_version, false, &now());
        }
        if r.plural == "namespaces" {
            body["spec"] = json!({"finalizers": ["kubernetes"]});
            body["status"] = json!({"phase": "Active"});
        }
        defaults(&r, &mut body);
        if o.dry_run {
            return Ok(self.shown(t.resource, &t.version, &body));
        }
        let stored = self.commit(key, Some(body));
        self.after_write();
        let stored = stored.map(|s| (*s).clone()).unwrap_or(Value::Null);
        Ok(self.shown(t.resource, &t.version, &stored))
    }

    /// A new uid, from the server's seeded randomness.
    fn uid(&mut self) -> String {
        let a = self.rng.u64(..);
        let b = self.rng.u64(..);
        format!(
            "{:08x}-{:04x}-4{:03x}-{:04x}-{:012x}",
            a >> 32,
            (a >> 16) & 0xffff,
            a & 0xfff,
            0x8000 | ((b >> 48) & 0x3fff),
            b & 0xffff_ffff_ffff
        )
    }

    /// Writes `new` over the object at `t`/`name`: an update (PUT) or the result of a patch.
    /// `status` says it is the `/status` subresource.
    pub(crate) fn update(
        &mut self,
        t: &Target,
        name: &str,
        mut new: Value,
        o: &WriteOptions,
    ) -> Result<Value, ApiError> {
        let r = self.check_body(t, name, &new)?;
        let key = Self::key(t, name);
        let old = self
            .get(&key)
            .cloned()
            .ok_or_else(|| ApiError::not_found(&r, name))?;
        if r.namespaced
            && let Some(body_ns) = meta_str(&new, "namespace")
            && Some(body_ns) != t.namespace.as_deref()
        {
            return Err(ApiError::bad_request(
                "the namespace of the provided object does not match the namespace sent on the request",
            ));
        }
        let old_rv = meta_str(&old, "resourceVersion")
            .unwrap_or_default()
            .to_owned();
        match meta_str(&new, "resourceVersion") {
            Some(rv) if rv != old_rv => return Err(ApiError::modified(&r, name)),
            None if r.custom => {
                return Err(ApiError::invalid(
                    &r,
                    name,
                    &[(
                        "metadata.resourceVersion",
                        "FieldValueInvalid",
                        "Invalid value: 0: must be specified for an update".into(),
                    )],
                ));
            }
            _ => {}
        }
        if let Some(uid) = meta_str(&new, "uid") {
            let old_uid = meta_str(&old, "uid").unwrap_or_default();
            if uid != old_uid {
                return Err(ApiError::conflict(
                    &r,
                    name,
                    &format!(
                        "Precondition failed: UID in precondition: {uid}, UID in object meta: {old_uid}"
                    ),
                ));
            }
        }
        let status_write = t.subresource.as_deref() == Some("status");
        if status_write {
            // The status subresource writes the status and nothing else.
            let status = new.get("status").cloned();
            let computed = new.pointer("/metadata/managedFields").cloned();
            new = (*old).clone();
            // An apply to the status brings the managed fields it computed.
            if o.manager.is_none() {
                match computed {
                    Some(v) => meta_mut(&mut new).insert("managedFields".to_owned(), v),
                    None => meta_mut(&mut new).remove("managedFields"),
                };
            }
            match status {
                Some(s) => new["status"] = s,
                None => {
                    if let Some(m) = new.as_object_mut() {
                        m.remove("status");
                    }
                }
            }
        } else if r.status_subresource {
            match old.get("status") {
                Some(s) => new["status"] = s.clone(),
                None => {
                    if let Some(m) = new.as_object_mut() {
                        m.remove("status");
                    }
                }
            }
        }
        new["apiVersion"] = json!(r.api_version(r.storage_version()));
        new["kind"] = json!(r.kind);
        let old_meta = meta(&old).cloned().unwrap_or_default();
        {
            let given = new.pointer("/metadata/managedFields").cloned();
            let m = meta_mut(&mut new);
            for field in SYSTEM_FIELDS {
                if *field == "managedFields" && o.manager.is_none() {
                    // An apply computed them.
                    match &given {
                        Some(v) => m.insert("managedFields".to_owned(), v.clone()),
                        None => m.remove("managedFields"),
                    };
                    continue;
                }
                match old_meta.get(*field) {
                    Some(v) => m.insert((*field).to_owned(), v.clone()),
                    None => m.remove(*field),
                };
            }
            m.insert("name".into(), json!(name));
            if let Some(ns) = old_meta.get("namespace") {
                m.insert("namespace".into(), ns.clone());
            }
            if m.get("labels")
                .is_some_and(|l| l.as_object().is_some_and(Map::is_empty))
            {
                m.remove("labels");
            }
            if m.get("annotations")
                .is_some_and(|l| l.as_object().is_some_and(Map::is_empty))
            {
                m.remove("annotations");
            }
            if m.get("finalizers")
                .is_some_and(|l| l.as_array().is_some_and(Vec::is_empty))
            {
                m.remove("finalizers");
            }
        }
        if r.plural == "namespaces" && !status_write {
            // A namespace's spec (its finalizers) is written through /finalize.
            match old.get("spec") {
                Some(s) => new["spec"] = s.clone(),
                None => {
                    if let Some(m) = new.as_object_mut() {
                        m.remove("spec");
                    }
                }
            }
        }
        let deleting = old_meta.contains_key("deletionTimestamp");
        if deleting {
            let before: HashSet<String> = finalizers(&old).into_iter().collect();
            let added: Vec<String> = finalizers(&new)
                .into_iter()
                .filter(|f| !before.contains(f))
                .collect();
            if !added.is_empty() {
                let quoted: Vec<String> = added.iter().map(|f| format!("{f:?}")).collect();
                let message = format!(
                    "Forbidden: no new finalizers can be added if the object is being deleted, found new finalizers []string{{{}}}",
                    quoted.join(", ")
                );
                // The API server names the cause twice (two validations find it); its message once.
                let mut e = ApiError::invalid(
                    &r,
                    name,
                    &[(
                        "metadata.finalizers",
                        "FieldValueForbidden",
                        message.clone(),
                    )],
                );
                if let Some(causes) = e
                    .details
                    .as_mut()
                    .and_then(|d| d.get_mut("causes"))
                    .and_then(Value::as_array_mut)
                {
                    let again = causes[0].clone();
                    causes.push(again);
                }
                return Err(e);
            }
        }
        shape(&r, &mut new);
        if let Some(manager) = &o.manager {
            let api_version = r.api_version(&t.version);
            apply::record_update(
                &r,
                Some(&old),
                &mut new,
                manager,
                &api_version,
                status_write,
                &now(),
            );
        }
        defaults(&r, &mut new);
        if r.generation
            && spec_of(&new, r.status_subresource) != spec_of(&old, r.status_subresource)
        {
            let g = old_meta
                .get("generation")
                .and_then(Value::as_i64)
                .unwrap_or(0);
            meta_mut(&mut new).insert("generation".into(), json!(g + 1));
        }
        if without_times(&new) == without_times(&old) {
            // Nothing changed (but the times of managed fields): nothing is written and the
            // version stays.
            return Ok(self.shown(t.resource, &t.version, &old));
        }
        if o.dry_run {
            return Ok(self.shown(t.resource, &t.version, &new));
        }
        let gone = deleting
            && finalizers(&new).is_empty()
            && new
                .pointer("/spec/finalizers")
                .and_then(Value::as_array)
                .is_none_or(Vec::is_empty);
        if gone {
            // The last finalizer of an object being deleted: the object is deleted instead of
            // written (the answer shows it without the finalizer, at the version it had).
            self.commit(key, None);
            self.after_write();
            return Ok(self.shown(t.resource, &t.version, &new));
        }
        let stored = self
            .commit(key, Some(new))
            .map(|s| (*s).clone())
            .unwrap_or(Value::Null);
        self.after_write();
        Ok(self.shown(t.resource, &t.version, &stored))
    }

    /// Server-side apply of `applied` by `manager` to the object at `t`/`name`: creates it
    /// when missing (201), else merges it in (200), or refuses with the conflicts.
    pub(crate) fn apply(
        &mut self,
        t: &Target,
        name: &str,
        applied: Value,
        manager: &str,
        force: bool,
        dry_run: bool,
    ) -> Result<(u16, Value), ApiError> {
        let r = self.check_body(t, name, &applied)?;
        let api_version = r.api_version(&t.version);
        let status = t.subresource.as_deref() == Some("status");
        let existing = self.get(&Self::key(t, name)).cloned();
        if existing.is_none() && status {
            // An apply to the status of an object that is not there creates nothing.
            return Err(ApiError::not_found(&r, name));
        }
        let live = match &existing {
            Some(v) => (**v).clone(),
            None => {
                let mut fresh =
                    json!({"apiVersion": api_version, "kind": r.kind, "metadata": {"name": name}});
                if let Some(ns) = &t.namespace {
                    fresh["metadata"]["namespace"] = json!(ns);
                }
                fresh
            }
        };
        let merged = apply::apply(
            &r,
            &live,
            &applied,
            &apply::Writer {
                manager,
                api_version: &api_version,
                status,
                now: &now(),
            },
            force,
        )
        .map_err(|c| {
            let (message, causes) = c.describe();
            ApiError {
                code: 409,
                reason: "Conflict",
                message,
                details: Some(json!({"causes": causes})),
            }
        })?;
        let o = WriteOptions {
            dry_run,
            manager: None,
            keep_uid: false,
        };
        match existing {
            None => Ok((201, self.create(t, merged, &o)?)),
            Some(_) => {
                let mut merged = merged;
                // The write is over the version the apply read.
                if let Some(rv) = live.pointer("/metadata/resourceVersion") {
                    meta_mut(&mut merged).insert("resourceVersion".to_owned(), rv.clone());
                }
                Ok((200, self.update(t, name, merged, &o)?))
            }
        }
    }

    /// Deletes the object at `t`/`name`: at once, or by marking it when finalizers hold it.
    /// Returns the answer's status code and body.
    pub(crate) fn delete(
        &mut self,
        t: &Target,
        name: &str,
        o: &DeleteOptions,
    ) -> Result<(u16, Value), ApiError> {
        let r = self.resource(t.resource).clone();
        let key = Self::key(t, name);
        let old = self
            .get(&key)
            .cloned()
            .ok_or_else(|| ApiError::not_found(&r, name))?;
        if let Some(uid) = &o.uid {
            let old_uid = meta_str(&old, "uid").unwrap_or_default();
            if uid != old_uid {
                return Err(ApiError::uid_precondition(&r, name, uid, old_uid));
            }
        }
        if let Some(rv) = &o.resource_version {
            let old_rv = meta_str(&old, "resourceVersion").unwrap_or_default();
            if rv != old_rv {
                return Err(ApiError::rv_precondition(&r, name, rv, old_rv));
            }
        }
        let mut marked = (*old).clone();
        let mut holds = finalizers(&marked);
        match o.propagation.as_deref() {
            Some("Foreground") if !holds.iter().any(|f| f == "foregroundDeletion") => {
                holds.push("foregroundDeletion".into())
            }
            Some("Orphan") if !holds.iter().any(|f| f == "orphan") => holds.push("orphan".into()),
            _ => {}
        }
        let namespace_spec_holds = r.plural == "namespaces"
            && old
                .pointer("/spec/finalizers")
                .and_then(Value::as_array)
                .is_some_and(|a| !a.is_empty());
        if holds.is_empty() && !namespace_spec_holds {
            if !o.dry_run {
                self.commit(key, None);
                self.after_write();
            }
            let shown = self.shown(t.resource, &t.version, &old);
            return Ok((
                200,
                if r.returns_deleted {
                    shown
                } else {
                    deleted_status(&r, name, &old)
                },
            ));
        }
        if meta_str(&old, "deletionTimestamp").is_some() && holds == finalizers(&old) {
            return Ok((200, self.shown(t.resource, &t.version, &old)));
        }
        {
            mark_deleting(&r, &mut marked);
            let m = meta_mut(&mut marked);
            m.insert("finalizers".into(), json!(holds));
            if holds.is_empty() {
                m.remove("finalizers");
            }
        }
        if r.plural == "namespaces" {
            marked["status"] = json!({"phase": "Terminating"});
        }
        if o.dry_run {
            return Ok((200, self.shown(t.resource, &t.version, &marked)));
        }
        let stored = self
            .commit(key, Some(marked))
            .map(|s| (*s).clone())
            .unwrap_or(Value::Null);
        self.after_write();
        Ok((200, self.shown(t.resource, &t.version, &stored)))
    }

    /// `PUT /api/v1/namespaces/{name}/finalize`: writes the namespace's spec (its finalizers);
    /// a namespace being deleted whose last finalizer goes is deleted.
    pub(crate) fn finalize_namespace(
        &mut self,
        t: &Target,
        name: &str,
        spec: Value,
    ) -> Result<Value, ApiError> {
        let r = self.resource(t.resource).clone();
        let key = Self::key(t, name);
        let old = self
            .get(&key)
            .cloned()
            .ok_or_else(|| ApiError::not_found(&r, name))?;
        let mut new = (*old).clone();
        new["spec"] = spec;
        if new == *old {
            return Ok(self.shown(t.resource, &t.version, &old));
        }
        let gone = meta_str(&new, "deletionTimestamp").is_some()
            && finalizers(&new).is_empty()
            && new
                .pointer("/spec/finalizers")
                .and_then(Value::as_array)
                .is_none_or(Vec::is_empty);
        let stored = self
            .commit(key.clone(), Some(new))
            .map(|s| (*s).clone())
            .unwrap_or(Value::Null);
        if gone {
            self.commit(key, None);
        }
        self.after_write();
        Ok(self.shown(t.resource, &t.version, &stored))
    }

    /// What the cluster's controllers do after a write, until nothing is left to do.
    pub(crate) fn after_write(&mut self) {
        self.sync_crds();
        if !self.behaviour.controllers {
            return;
        }
        // Each round acts on a snapshot; bounded, since every action deletes an object or
        // removes a finalizer or an owner reference.
        for _ in 0..10_000 {
            if !self.controllers_round() {
                break;
            }
        }
    }

    /// The API server's own CRD handling: a CRD created or changed serves its kind and
    /// becomes `Established`; a CRD deleted stops serving it and its objects go.
    fn sync_crds(&mut self) {
        let Some(crd_id) =
            self.registry
                .find("apiextensions.k8s.io", "v1", "customresourcedefinitions")
        else {
            return;
        };
        let crds: Vec<(Key, Arc<Value>)> = self
            .of(crd_id, None)
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let mut defined = HashSet::new();
        for (key, object) in crds {
            let Ok(crd) = serde_json::from_value::<CustomResourceDefinition>((*object).clone())
            else {
                continue;
            };
            let Some(resource) = Resource::from_crd(&crd) else {
                continue;
            };
            defined.insert((resource.group.clone(), resource.plural.clone()));
            let served = self.registry.iter().any(|(_, r)| *r == resource);
            if !served {
                self.registry.add(resource);
            }
            let established = object
                .pointer("/status/conditions")
                .and_then(Value::as_array)
                .is_some_and(|c| {
                    c.iter()
                        .any(|c| c["type"] == "Established" && c["status"] == "True")
                });
            if !established {
                let mut v = (*object).clone();
                let now = now();
                let condition = |kind: &str, reason: &str, message: &str| json!({"type": kind, "status": "True", "lastTransitionTime": now, "reason": reason, "message": message});
                v["status"] = json!({
                    "conditions": [
                        condition("NamesAccepted", "NoConflicts", "no conflicts found"),
                        condition("Established", "InitialNamesAccepted", "the initial names have been accepted"),
                    ],
                    "acceptedNames": serde_json::to_value(&crd.spec.names).unwrap_or(Value::Null),
                    "storedVersions": [crd.spec.versions.iter().find(|v| v.storage).map(|v| v.name.clone()).unwrap_or_default()],
                });
                self.commit(key, Some(v));
            }
        }
        let orphaned: Vec<(ResourceId, String, String)> = self
            .registry
            .iter()
            .filter(|(_, r)| {
                r.custom
                    && !r.versions.is_empty()
                    && !defined.contains(&(r.group.clone(), r.plural.clone()))
            })
            .map(|(id, r)| (id, r.group.clone(), r.plural.clone()))
            .collect();
        for (id, group, plural) in orphaned {
            self.registry.remove_versions(&group, &plural);
            let keys: Vec<Key> = self.of(id, None).map(|(k, _)| k.clone()).collect();
            for k in keys {
                self.commit(k, None);
            }
        }
    }

    /// One round of garbage collection and namespace clean-up; whether it did anything.
    fn controllers_round(&mut self) -> bool {
        let uids: HashSet<String> = self
            .objects
            .values()
            .filter_map(|v| meta_str(v, "uid").map(str::to_owned))
            .collect();
        let ns_id = self.registry.find("", "v1", "namespaces");
        let terminating: HashSet<String> = self
            .objects
            .iter()
            .filter(|(k, v)| {
                Some(k.resource) == ns_id && meta_str(v, "deletionTimestamp").is_some()
            })
            .map(|(k, _)| k.name.clone())
            .collect();
        for (key, object) in self.objects.clone() {
            let deleting = meta_str(&object, "deletionTimestamp").is_some();
            let own_uid = meta_str(&object, "uid").unwrap_or_default().to_owned();
            // A namespace being deleted: its objects first, then its own finalizer.
            if Some(key.resource) == ns_id && deleting {
                let has_content = self
                    .objects
                    .keys()
                    .any(|k| k.namespace == key.name && !k.namespace.is_empty());
                let spec_holds = object
                    .pointer("/spec/finalizers")
                    .and_then(Value::as_array)
                    .is_some_and(|a| !a.is_empty());
                if !has_content && spec_holds {
                    let mut v = (*object).clone();
                    v["spec"] = json!({});
                    let done = finalizers(&v).is_empty();
                    self.commit(key.clone(), Some(v));
                    if done {
                        self.commit(key, None);
                    }
                    return true;
                }
                continue;
            }
            if !key.namespace.is_empty() && terminating.contains(&key.namespace) && !deleting {
                self.delete_by_controller(&key, &object);
                return true;
            }
            let held: Vec<String> = finalizers(&object);
            // Foreground deletion: the owner waits until its blocking dependents are gone.
            if deleting && held.iter().any(|f| f == "foregroundDeletion") {
                let dependents: Vec<(Key, Arc<Value>)> = self.dependents_of(&own_uid);
                if let Some((k, v)) = dependents
                    .iter()
                    .find(|(_, v)| meta_str(v, "deletionTimestamp").is_none())
                {
                    let (k, v) = (k.clone(), v.clone());
                    self.delete_by_controller(&k, &v);
                    return true;
                }
                if dependents.is_empty() {
                    self.remove_finalizer(&key, &object, "foregroundDeletion");
                    return true;
                }
                continue;
            }
            if deleting && held.iter().any(|f| f == "orphan") {
                for (k, v) in self.dependents_of(&own_uid) {
                    let mut v = (*v).clone();
                    if let Some(refs) = meta_mut(&mut v)
                        .get_mut("ownerReferences")
                        .and_then(Value::as_array_mut)
                    {
                        refs.retain(|r| {
                            r.get("uid").and_then(Value::as_str) != Some(own_uid.as_str())
                        });
                        if refs.is_empty() {
                            meta_mut(&mut v).remove("ownerReferences");
                        }
                    }
                    self.commit(k, Some(v));
                }
                self.remove_finalizer(&key, &object, "orphan");
                return true;
            }
            // Background: an object all of whose owners are gone goes too.
            let owners: Vec<String> = meta(&object)
                .and_then(|m| m.get("ownerReferences"))
                .and_then(Value::as_array)
                .map(|a| {
                    a.iter()
                        .filter_map(|r| r.get("uid").and_then(Value::as_str))
                        .map(str::to_owned)
                        .collect()
                })
                .unwrap_or_default();
            if !deleting && !owners.is_empty() && owners.iter().all(|u| !uids.contains(u)) {
                self.delete_by_controller(&key, &object);
                return true;
            }
        }
        false
    }

    fn dependents_of(&self, uid: &str) -> Vec<(Key, Arc<Value>)> {
        self.objects
            .iter()
            .filter(|(_, v)| {
                meta(v)
                    .and_then(|m| m.get("ownerReferences"))
                    .and_then(Value::as_array)
                    .is_some_and(|a| {
                        a.iter()
                            .any(|r| r.get("uid").and_then(Value::as_str) == Some(uid))
                    })
            })
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }

    fn delete_by_controller(&mut self, key: &Key, object: &Value) {
        if finalizers(object).is_empty() {
            self.commit(key.clone(), None);
        } else {
            let mut v = object.clone();
            mark_deleting(self.resource(key.resource), &mut v);
            self.commit(key.clone(), Some(v));
        }
    }

    fn remove_finalizer(&mut self, key: &Key, object: &Value, finalizer: &str) {
        let mut v = object.clone();
        let left: Vec<String> = finalizers(object)
            .into_iter()
            .filter(|f| f != finalizer)
            .collect();
        let m = meta_mut(&mut v);
        if left.is_empty() {
            m.remove("finalizers");
        } else {
            m.insert("finalizers".into(), json!(left));
        }
        let spec_holds = v
            .pointer("/spec/finalizers")
            .and_then(Value::as_array)
            .is_some_and(|a| !a.is_empty());
        let gone = left.is_empty() && !spec_holds;
        self.commit(key.clone(), Some(v));
        if gone {
            self.commit(key.clone(), None);
        }
    }
}

/// Marks an object as being deleted (once): its deletion time, a grace period of 0 (but for
/// a namespace) and, for a kind that counts it, a new generation.
fn mark_deleting(r: &Resource, object: &mut Value) {
    let m = meta_mut(object);
    if m.contains_key("deletionTimestamp") {
        return;
    }
    m.insert("deletionTimestamp".into(), json!(now()));
    if r.plural != "namespaces" {
        m.insert("deletionGracePeriodSeconds".into(), json!(0));
    }
    if r.generation {
        let g = m.get("generation").and_then(Value::as_i64).unwrap_or(0);
        m.insert("generation".into(), json!(g + 1));
    }
}

/// An object with the times of its managed fields left out.
fn without_times(object: &Value) -> Value {
    let mut v = object.clone();
    if let Some(entries) = v
        .pointer_mut("/metadata/managedFields")
        .and_then(Value::as_array_mut)
    {
        for e in entries {
            if let Some(e) = e.as_object_mut() {
                e.remove("time");
            }
        }
    }
    v
}

/// What the API server's encoding and defaulting make of a written object, for the kinds and
/// fields the fake knows: empty metadata maps and lists dropped, a built-in kind's empty
/// `data` dropped, a Secret's `stringData` folded into `data`, a namespace's name label.
fn shape(r: &Resource, object: &mut Value) {
    let name = meta_str(object, "name").unwrap_or_default().to_owned();
    let m = meta_mut(object);
    if r.plural == "namespaces" && r.group.is_empty() {
        let labels = m.entry("labels").or_insert_with(|| json!({}));
        if !labels.is_object() {
            *labels = json!({});
        }
        labels["kubernetes.io/metadata.name"] = json!(name);
    }
    for field in ["labels", "annotations", "finalizers", "ownerReferences"] {
        let empty = match m.get(field) {
            Some(Value::Object(o)) => o.is_empty(),
            Some(Value::Array(a)) => a.is_empty(),
            Some(Value::Null) => true,
            _ => false,
        };
        if empty {
            m.remove(field);
        }
    }
    if r.custom {
        return;
    }
    let Some(top) = object.as_object_mut() else {
        return;
    };
    if r.group.is_empty() && r.kind == "Secret" {
        if let Some(Value::Object(strings)) = top.remove("stringData") {
            let data = top.entry("data").or_insert_with(|| json!({}));
            if let Value::Object(data) = data {
                for (k, v) in strings {
                    let text = v.as_str().unwrap_or_default();
                    data.insert(
                        k,
                        json!(base64::engine::general_purpose::STANDARD.encode(text)),
                    );
                }
            }
        }
        top.entry("type").or_insert_with(|| json!("Opaque"));
    }
    for field in ["data", "binaryData"] {
        if top
            .get(field)
            .is_some_and(|d| d.as_object().is_some_and(Map::is_empty) || d.is_null())
        {
            top.remove(field);
        }
    }
}

/// Fields the server's defaulting adds after it has recorded who wrote what (nobody owns
/// them).
fn defaults(r: &Resource, object: &mut Value) {
    let Some(top) = object.as_object_mut() else {
        return;
    };
    if r.group == "events.k8s.io" && r.kind == "Event" {
        top.entry("deprecatedFirstTimestamp").or_insert(Value::Null);
        top.entry("deprecatedLastTimestamp").or_insert(Value::Null);
        top.entry("deprecatedSource").or_insert_with(|| json!({}));
    }
}

/// A CR or built-in with a status subresource starts without the status its creator wrote.
fn prepare_status_for_create(r: &Resource, body: &mut Value) {
    if let Some(m) = body.as_object_mut() {
        if r.custom {
            m.remove("status");
        } else {
            m.insert("status".into(), json!({}));
        }
    }
}

fn deleted_status(r: &Resource, name: &str, old: &Value) -> Value {
    let mut details =
        json!({"name": name, "kind": r.plural, "uid": meta_str(old, "uid").unwrap_or_default()});
    if !r.group.is_empty() {
        details["group"] = json!(r.group);
    }
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "details": details})
}

/// A continue token: the version of the first page and the (namespace, name) the next page
/// starts after, written as the real server writes its key ("namespace/name" and a zero byte).
fn encode_continue(rv: u64, after: &(String, String)) -> String {
    let start = if after.0.is_empty() {
        format!("{}\u{0}", after.1)
    } else {
        format!("{}/{}\u{0}", after.0, after.1)
    };
    let token = json!({"v": "meta.k8s.io/v1", "rv": rv, "start": start});
    base64::engine::general_purpose::URL_SAFE.encode(token.to_string())
}

fn decode_continue(token: &str) -> Result<(u64, (String, String)), ApiError> {
    let bad = || ApiError::bad_request(format!("continue key is not valid: {token}"));
    let bytes = base64::engine::general_purpose::URL_SAFE
        .decode(token)
        .map_err(|_| bad())?;
    let v: Value = serde_json::from_slice(&bytes).map_err(|_| bad())?;
    let rv = v.get("rv").and_then(Value::as_u64).ok_or_else(bad)?;
    let start = v.get("start").and_then(Value::as_str).ok_or_else(bad)?;
    let start = start.strip_suffix('\u{0}').unwrap_or(start);
    let after = match start.split_once('/') {
        Some((ns, name)) => (ns.to_owned(), name.to_owned()),
        None => (String::new(), start.to_owned()),
    };
    Ok((rv, after))
}
