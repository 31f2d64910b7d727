//! From an HTTP request to a verb on the store, and back: routing, query parameters, bodies
//! and watch streams.

use std::io;
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt as _;
use http::{Method, Request, Response, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt as _, Full, StreamBody};
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::discovery;
use crate::faults::{Answering, Verb};
use crate::ops::{DeleteOptions, ListOptions, Target, WriteOptions};
use crate::patch::{self, PatchType};
use crate::selectors::{FieldSelector, LabelSelector, extra_fields};
use crate::server::{RequestRecord, Shared};
use crate::status::ApiError;
use crate::store::{Watcher, watch_line};

/// The body of every answer: whole JSON, or a watch stream.
pub type ResponseBody = UnsyncBoxBody<Bytes, io::Error>;

fn json_response(code: u16, body: &Value) -> Response<ResponseBody> {
    let bytes = serde_json::to_vec(body).unwrap_or_default();
    let mut response = Response::new(
        Full::new(Bytes::from(bytes))
            .map_err(|never| match never {})
            .boxed_unsync(),
    );
    *response.status_mut() =
        StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    response
}

fn error_response(e: &ApiError) -> Response<ResponseBody> {
    let mut response = json_response(e.code, &e.to_status());
    if e.code == 429 {
        response.headers_mut().insert(
            http::header::RETRY_AFTER,
            http::HeaderValue::from_static("1"),
        );
    }
    response
}

/// The error a fault answers with.
pub(crate) fn fault_error(code: u16) -> ApiError {
    match code {
        429 => ApiError::too_many_requests(),
        500 => ApiError::internal(
            "an error on the server (\"injected by the fake\") has prevented the request from succeeding",
        ),
        _ => ApiError {
            code,
            reason: match code {
                400 => "BadRequest",
                401 => "Unauthorized",
                403 => "Forbidden",
                404 => "NotFound",
                409 => "Conflict",
                410 => "Expired",
                503 => "ServiceUnavailable",
                504 => "Timeout",
                _ => "",
            },
            message: format!("the fake server answered {code} (a fault the test injected)"),
            details: None,
        },
    }
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            // Two hex digits, no sign (`from_str_radix` would take "+1").
            b'%' if i + 2 < bytes.len()
                && bytes[i + 1].is_ascii_hexdigit()
                && bytes[i + 2].is_ascii_hexdigit() =>
            {
                match u8::from_str_radix(
                    std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap_or("zz"),
                    16,
                ) {
                    Ok(b) => {
                        out.push(b);
                        i += 2;
                    }
                    Err(_) => out.push(b'%'),
                }
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The query parameters of a request.
struct Query(Vec<(String, String)>);

impl Query {
    fn parse(query: Option<&str>) -> Self {
        Query(
            query
                .unwrap_or("")
                .split('&')
                .filter(|p| !p.is_empty())
                .map(|p| {
                    let (k, v) = p.split_once('=').unwrap_or((p, ""));
                    (percent_decode(k), percent_decode(v))
                })
                .collect(),
        )
    }

    fn get(&self, key: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    fn flag(&self, key: &str) -> bool {
        matches!(self.get(key), Some("true" | "1"))
    }
}

/// What a path names.
enum Route {
    Version,
    CoreVersions,
    Groups,
    Resources { group: String, version: String },
    Objects(Target),
}

fn route(shared: &Shared, path: &str) -> Result<Route, ApiError> {
    let parts: Vec<&str> = path.split('/').filter(|p| !p.is_empty()).collect();
    let (group, version, rest) = match parts.as_slice() {
        ["version"] => return Ok(Route::Version),
        ["api"] => return Ok(Route::CoreVersions),
        ["apis"] => return Ok(Route::Groups),
        ["api", v] => {
            return Ok(Route::Resources {
                group: String::new(),
                version: (*v).to_owned(),
            });
        }
        ["apis", g, v] => {
            return Ok(Route::Resources {
                group: (*g).to_owned(),
                version: (*v).to_owned(),
            });
        }
        ["api", v, rest @ ..] => ("", *v, rest),
        ["apis", g, v, rest @ ..] => (*g, *v, rest),
        _ => return Err(ApiError::not_found_path()),
    };
    let (namespace, rest): (Option<&str>, &[&str]) = match rest {
        ["namespaces", _, "status" | "finalize"] => (None, rest),
        ["namespaces", ns, tail @ ..] if !tail.is_empty() => (Some(*ns), tail),
        _ => (None, rest),
    };
    let (plural, name, subresource) = match rest {
        [plural] => (*plural, None, None),
        [plural, name] => (*plural, Some(*name), None),
        [plural, name, sub] => (*plural, Some(*name), Some(*sub)),
        _ => return Err(ApiError::not_found_path()),
    };
    let store = shared.store();
    let resource = store
        .registry
        .find(group, version, plural)
        .ok_or_else(ApiError::not_found_path)?;
    let r = store.registry.get(resource);
    if namespace.is_some() && !r.namespaced {
        return Err(ApiError::not_found_path());
    }
    if namespace.is_none() && r.namespaced && name.is_some() {
        return Err(ApiError::not_found_path());
    }
    let allowed = match subresource {
        None => true,
        Some("status") => r.status_subresource,
        Some("finalize") => r.plural == "namespaces",
        Some(_) => false,
    };
    if !allowed {
        // A custom resource's missing subresource reads as its object not being there.
        return Err(match name {
            Some(name) if r.custom => ApiError::not_found(r, name),
            _ => ApiError::not_found_path(),
        });
    }
    Ok(Route::Objects(Target {
        resource,
        version: version.to_owned(),
        namespace: namespace.map(str::to_owned),
        name: name.map(str::to_owned),
        subresource: subresource.map(str::to_owned),
    }))
}

fn verb_of(method: &Method, t: &Target, q: &Query) -> Option<Verb> {
    Some(match (method.as_str(), t.name.is_some()) {
        ("GET", true) => Verb::Get,
        ("GET", false) if q.flag("watch") => Verb::Watch,
        ("GET", false) => Verb::List,
        ("POST", false) => Verb::Create,
        ("PUT", true) => Verb::Update,
        ("PATCH", true) => Verb::Patch,
        ("DELETE", true) => Verb::Delete,
        ("DELETE", false) => Verb::DeleteCollection,
        _ => return None,
    })
}

/// Serves one request (faults first).
pub(crate) async fn handle<B>(
    shared: std::sync::Arc<Shared>,
    req: Request<B>,
) -> Result<Response<ResponseBody>, io::Error>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: std::fmt::Display,
{
    shared.wait_until_answering().await?;
    let latency = shared.faults().latency;
    if !latency.is_zero() {
        tokio::time::sleep(latency).await;
        shared.wait_until_answering().await?;
    }
    let (parts, body) = req.into_parts();
    let body = match body.collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => {
            return Ok(error_response(&ApiError::bad_request(format!(
                "reading the body: {e}"
            ))));
        }
    };
    let q = Query::parse(parts.uri.query());
    let route = match route(&shared, parts.uri.path()) {
        Ok(r) => r,
        Err(e) => return Ok(error_response(&e)),
    };
    let accept = parts
        .headers
        .get(http::header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let aggregated = accept.contains("as=APIGroupDiscoveryList");
    let t = match route {
        Route::Version => return Ok(json_response(200, &discovery::version())),
        Route::CoreVersions if aggregated => {
            return Ok(aggregated_response(&discovery::aggregated(
                &shared.store().registry,
                true,
            )));
        }
        Route::CoreVersions => return Ok(json_response(200, &discovery::core_versions())),
        Route::Groups if aggregated => {
            return Ok(aggregated_response(&discovery::aggregated(
                &shared.store().registry,
                false,
            )));
        }
        Route::Groups => {
            return Ok(json_response(
                200,
                &discovery::group_list(&shared.store().registry),
            ));
        }
        Route::Resources { group, version } => {
            return Ok(
                match discovery::resource_list(&shared.store().registry, &group, &version) {
                    Some(list) => json_response(200, &list),
                    None => error_response(&ApiError::not_found_path()),
                },
            );
        }
        Route::Objects(t) => t,
    };
    let Some(verb) = verb_of(&parts.method, &t, &q) else {
        return Ok(error_response(&ApiError::method_not_allowed()));
    };
    let plural = shared.store().registry.get(t.resource).plural.clone();
    let record = RequestRecord {
        verb,
        resource: plural.clone(),
        namespace: t.namespace.clone(),
        name: t.name.clone(),
        subresource: t.subresource.clone(),
    };
    shared.record(record.clone());
    if let Some(code) = shared.faults().take(verb, &plural, t.name.as_deref()) {
        return Ok(error_response(&fault_error(code)));
    }
    // A schedule checker decides when (and whether) a request goes through.
    let gate = shared.gate();
    if let Some(gate) = gate
        && verb != Verb::Watch
        && let Some(code) = gate.park(&shared.name, record).await
    {
        return Ok(error_response(&fault_error(code)));
    }
    let content_type = parts
        .headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let user_agent = parts
        .headers
        .get(http::header::USER_AGENT)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    Ok(
        match serve(&shared, verb, &t, &q, (content_type, user_agent), &body) {
            Ok(Served::Json(code, v)) => json_response(code, &v),
            Ok(Served::Watch(w)) => watch_response(&shared, w, &q),
            Err(e) => error_response(&e),
        },
    )
}

fn aggregated_response(body: &Value) -> Response<ResponseBody> {
    let mut response = json_response(200, body);
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static(
            "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList",
        ),
    );
    response
}

enum Served {
    Json(u16, Value),
    Watch(mpsc::UnboundedReceiver<Bytes>),
}

fn parse_body(body: &[u8]) -> Result<Value, ApiError> {
    serde_json::from_slice(body).map_err(|e| {
        ApiError::bad_request(format!("the body of the request could not be decoded: {e}"))
    })
}

fn selectors(
    shared: &Shared,
    t: &Target,
    q: &Query,
) -> Result<(LabelSelector, FieldSelector), ApiError> {
    let labels = LabelSelector::parse(q.get("labelSelector").unwrap_or(""))
        .map_err(|e| ApiError::bad_request(format!("unable to parse requirement: {e}")))?;
    let (group, kind) = {
        let store = shared.store();
        let r = store.registry.get(t.resource);
        (r.group.clone(), r.kind.clone())
    };
    let fields = FieldSelector::parse(
        q.get("fieldSelector").unwrap_or(""),
        extra_fields(&group, &kind),
    )
    .map_err(ApiError::bad_request)?;
    Ok((labels, fields))
}

fn write_options(q: &Query, user_agent: &str) -> WriteOptions {
    WriteOptions {
        dry_run: q.get("dryRun") == Some("All"),
        manager: Some(manager_of(q, user_agent)),
        keep_uid: false,
    }
}

/// The field manager of a write: the parameter, else the user agent up to its first `/`.
fn manager_of(q: &Query, user_agent: &str) -> String {
    match q.get("fieldManager").filter(|m| !m.is_empty()) {
        Some(m) => m.to_owned(),
        None => {
            let ua = user_agent.split('/').next().unwrap_or_default();
            if ua.is_empty() {
                "unknown".to_owned()
            } else {
                ua.to_owned()
            }
        }
    }
}

fn serve(
    shared: &Shared,
    verb: Verb,
    t: &Target,
    q: &Query,
    (content_type, user_agent): (&str, &str),
    body: &[u8],
) -> Result<Served, ApiError> {
    let name = t.name.as_deref().unwrap_or_default();
    match verb {
        Verb::Get => Ok(Served::Json(200, shared.store().get_object(t, name)?)),
        Verb::List => {
            let (labels, fields) = selectors(shared, t, q)?;
            let o = ListOptions {
                labels,
                fields,
                limit: q.get("limit").and_then(|l| l.parse().ok()),
                continue_token: q
                    .get("continue")
                    .filter(|c| !c.is_empty())
                    .map(str::to_owned),
                resource_version: q
                    .get("resourceVersion")
                    .filter(|c| !c.is_empty())
                    .map(str::to_owned),
                exact: q.get("resourceVersionMatch") == Some("Exact"),
            };
            Ok(Served::Json(200, shared.store().list(t, &o)?))
        }
        Verb::Watch => open_watch(shared, t, q).map(Served::Watch),
        Verb::Create => {
            let body = parse_body(body)?;
            Ok(Served::Json(
                201,
                shared
                    .store()
                    .create(t, body, &write_options(q, user_agent))?,
            ))
        }
        Verb::Update => {
            let mut body = parse_body(body)?;
            if t.subresource.as_deref() == Some("finalize") {
                // A namespace's finalize writes its spec's finalizers only.
                let spec = body.get("spec").cloned().unwrap_or(json!({}));
                return Ok(Served::Json(
                    200,
                    shared.store().finalize_namespace(t, name, spec)?,
                ));
            }
            if body.get("metadata").is_none() {
                body["metadata"] = json!({});
            }
            Ok(Served::Json(
                200,
                shared
                    .store()
                    .update(t, name, body, &write_options(q, user_agent))?,
            ))
        }
        Verb::Patch => {
            let kind = PatchType::from_content_type(content_type)
                .ok_or_else(|| ApiError::unsupported_media_type(content_type))?;
            let mut store = shared.store();
            if kind == PatchType::Apply {
                let Some(manager) = q.get("fieldManager").filter(|m| !m.is_empty()) else {
                    return Err(ApiError {
                        code: 422,
                        reason: "Invalid",
                        message: "PatchOptions.meta.k8s.io \"\" is invalid: fieldManager: Required value: is required for apply patch".to_owned(),
                        details: Some(json!({
                            "group": "meta.k8s.io",
                            "kind": "PatchOptions",
                            "causes": [{"reason": "FieldValueRequired", "message": "Required value: is required for apply patch", "field": "fieldManager"}]
                        })),
                    });
                };
                let applied = parse_body(body)?;
                let (code, v) = store.apply(
                    t,
                    name,
                    applied,
                    manager,
                    q.flag("force"),
                    q.get("dryRun") == Some("All"),
                )?;
                return Ok(Served::Json(code, v));
            }
            let current = store.get_object(t, name)?;
            let r = store.registry.get(t.resource).clone();
            let mut patched = patch::apply(kind, &r, &current, body)?;
            // A patch writes over the version it read, unless it names one itself.
            let patch_rv = serde_json::from_slice::<Value>(body).ok().and_then(|p| {
                p.pointer("/metadata/resourceVersion")
                    .and_then(Value::as_str)
                    .map(str::to_owned)
            });
            if kind != PatchType::Json
                && patch_rv.is_none()
                && let Some(m) = patched.get_mut("metadata").and_then(Value::as_object_mut)
                && let Some(rv) = current.pointer("/metadata/resourceVersion")
            {
                m.insert("resourceVersion".to_owned(), rv.clone());
            }
            Ok(Served::Json(
                200,
                store.update(t, name, patched, &write_options(q, user_agent))?,
            ))
        }
        Verb::Delete => {
            let o = delete_options(q, body)?;
            let (code, v) = shared.store().delete(t, name, &o)?;
            Ok(Served::Json(code, v))
        }
        Verb::DeleteCollection => {
            let (labels, fields) = selectors(shared, t, q)?;
            let o = delete_options(q, body)?;
            let mut store = shared.store();
            let list = store.list(
                t,
                &ListOptions {
                    labels,
                    fields,
                    ..ListOptions::default()
                },
            )?;
            let mut deleted = Vec::new();
            for item in list["items"].as_array().cloned().unwrap_or_default() {
                let name = item
                    .pointer("/metadata/name")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_owned();
                let item_t = Target {
                    namespace: item
                        .pointer("/metadata/namespace")
                        .and_then(Value::as_str)
                        .map(str::to_owned),
                    ..t.clone()
                };
                // The answer lists each object as it was before its deletion.
                if store.delete(&item_t, &name, &o).is_ok() {
                    deleted.push(item);
                }
            }
            let mut out = list;
            out["items"] = Value::Array(deleted);
            Ok(Served::Json(200, out))
        }
    }
}

fn delete_options(q: &Query, body: &[u8]) -> Result<DeleteOptions, ApiError> {
    let b: Value = if body.is_empty() {
        json!({})
    } else {
        parse_body(body)?
    };
    let dry = b
        .get("dryRun")
        .and_then(Value::as_array)
        .is_some_and(|a| a.iter().any(|v| v == "All"));
    Ok(DeleteOptions {
        dry_run: dry || q.get("dryRun") == Some("All"),
        propagation: b
            .get("propagationPolicy")
            .and_then(Value::as_str)
            .or(q.get("propagationPolicy"))
            .map(str::to_owned),
        uid: b
            .pointer("/preconditions/uid")
            .and_then(Value::as_str)
            .map(str::to_owned),
        resource_version: b
            .pointer("/preconditions/resourceVersion")
            .and_then(Value::as_str)
            .map(str::to_owned),
    })
}

/// Registers a watch and queues its first events: the objects that exist (from no version or
/// "0"), or the changes after the version given (an ERROR event with 410 when they are no
/// longer kept).
fn open_watch(
    shared: &Shared,
    t: &Target,
    q: &Query,
) -> Result<mpsc::UnboundedReceiver<Bytes>, ApiError> {
    let (labels, fields) = selectors(shared, t, q)?;
    let (tx, rx) = mpsc::unbounded_channel();
    let mut store = shared.store();
    let r = store.registry.get(t.resource).clone();
    let watcher = Watcher {
        resource: t.resource,
        namespace: t.namespace.clone(),
        name: None,
        labels,
        fields,
        api_version: r.api_version(&t.version),
        kind: r.kind.clone(),
        bookmarks: q.flag("allowWatchBookmarks"),
        tx,
    };
    let send_initial = q.flag("sendInitialEvents");
    match q
        .get("resourceVersion")
        .filter(|v| !v.is_empty() && *v != "0")
    {
        Some(rv) if !send_initial => {
            let rv: u64 = rv
                .parse()
                .map_err(|_| ApiError::bad_request(format!("invalid resource version: {rv}")))?;
            match store.since(rv) {
                Ok(changes) => {
                    for change in changes {
                        if let Some(line) = watcher.event(change) {
                            let _ = watcher.tx.send(line);
                        }
                    }
                }
                Err(e) => {
                    let _ = watcher.tx.send(watch_line("ERROR", &e.to_status()));
                    return Ok(rx);
                }
            }
        }
        _ => {
            for (key, object) in store.of(t.resource, t.namespace.as_deref()) {
                if watcher.selects(key, object) {
                    let _ = watcher.tx.send(watch_line(
                        "ADDED",
                        &store.shown(t.resource, &t.version, object),
                    ));
                }
            }
            if send_initial {
                let bookmark = json!({
                    "kind": r.kind,
                    "apiVersion": r.api_version(&t.version),
                    "metadata": {
                        "resourceVersion": store.rv.to_string(),
                        "annotations": {"k8s.io/initial-events-end": "true"}
                    }
                });
                let _ = watcher.tx.send(watch_line("BOOKMARK", &bookmark));
            }
        }
    }
    store.watchers.push(watcher);
    Ok(rx)
}

/// A watch's answer: its events as they come, until the watch times out, the test cuts it or
/// the server stops answering.
fn watch_response(
    shared: &std::sync::Arc<Shared>,
    rx: mpsc::UnboundedReceiver<Bytes>,
    q: &Query,
) -> Response<ResponseBody> {
    let timeout = q
        .get("timeoutSeconds")
        .and_then(|s| s.parse::<u64>().ok())
        .map(Duration::from_secs);
    let deadline = timeout.and_then(|t| tokio::time::Instant::now().checked_add(t));
    let shared = shared.clone();
    let stream = futures::stream::unfold((rx, shared), move |(mut rx, shared)| async move {
        let next = async {
            let line = rx.recv().await?;
            // A server that stops answering delivers nothing more until it answers again.
            shared.wait_until_answering().await.ok()?;
            Some(line)
        };
        let line = match deadline {
            Some(d) => tokio::time::timeout_at(d, next).await.ok().flatten(),
            None => next.await,
        }?;
        Some((
            Ok::<_, io::Error>(http_body::Frame::data(line)),
            (rx, shared),
        ))
    });
    let mut response = Response::new(StreamBody::new(stream.boxed()).boxed_unsync());
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    response
}

impl Shared {
    /// Waits while the server hangs; fails when it refuses.
    pub(crate) async fn wait_until_answering(&self) -> Result<(), io::Error> {
        let mut rx = self.answering.subscribe();
        loop {
            match *rx.borrow_and_update() {
                Answering::Yes => return Ok(()),
                Answering::Refuse => {
                    return Err(io::Error::new(
                        io::ErrorKind::ConnectionRefused,
                        format!(
                            "fake API server {} refused the connection (a fault the test injected)",
                            self.name
                        ),
                    ));
                }
                Answering::Hang => {}
            }
            if rx.changed().await.is_err() {
                return Err(io::Error::new(
                    io::ErrorKind::BrokenPipe,
                    "fake API server dropped",
                ));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::percent_decode;

    #[test]
    fn query_values_are_percent_decoded() {
        assert_eq!(
            percent_decode("app%3Dweb%2Ctier+in+%28a%29"),
            "app=web,tier in (a)"
        );
        assert_eq!(percent_decode("100%"), "100%");
        assert_eq!(percent_decode("%+1x"), "% 1x");
    }
}
