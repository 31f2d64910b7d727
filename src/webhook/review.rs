//! One review: the body decoded as the hook's kind, its handler run, the answer written.
//!
//! Every answer the handler gives (or fails to give) travels in an `AdmissionReview` the
//! API server accepts: its `uid` is the request's, a denial has a status code of 400 or more
//! (an answer without one reaches the user as "denied the request without explanation"), a
//! validating answer never carries a patch (the API server would count it as a broken
//! webhook).

use std::future::Future;
use std::sync::Arc;

use futures::FutureExt;
use kube::core::admission::{AdmissionRequest, AdmissionResponse, AdmissionReview};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::{FailurePolicy, Mutation, Review, Verdict};
use crate::cluster::ClusterId;

/// The version of `AdmissionReview` served (the configurations ask for it alone).
const V1: &str = "admission.k8s.io/v1";

/// A hook with its kind erased: the cluster and the body to the answer.
pub(crate) type Handle<C> =
    Arc<dyn Fn(C, bytes::Bytes) -> futures::future::BoxFuture<'static, Answer> + Send + Sync>;

/// What a review came to.
#[derive(Debug)]
pub(crate) struct Answer {
    /// The `AdmissionReview` to send (always with HTTP 200).
    pub(crate) body: Vec<u8>,
    /// The handler panicked.
    pub(crate) panicked: bool,
}

/// A hook's own settings its answers depend on.
#[derive(Clone, Debug)]
pub(crate) struct Settings {
    pub(crate) name: Arc<str>,
    pub(crate) failure_policy: FailurePolicy,
}

/// The request decoded as `K`, or the answer refusing a body that is not a review of it.
fn decode<K>(settings: &Settings, body: &[u8]) -> Result<AdmissionRequest<K>, Answer>
where
    K: kube::Resource + DeserializeOwned,
{
    let review: Result<AdmissionReview<K>, _> = serde_json::from_slice(body);
    let error = match review {
        // Only the version the configurations ask for: the answer is in it.
        Ok(review) if review.types.api_version != V1 || review.types.kind != "AdmissionReview" => {
            format!("not an {V1} AdmissionReview")
        }
        Ok(review) => match TryInto::<AdmissionRequest<K>>::try_into(review) {
            Ok(request) => return Ok(request),
            Err(_) => "the review has no request".to_string(),
        },
        Err(error) => format!("the review cannot be read: {error}"),
    };
    // Answered with the request's uid when it can be read: a denial the user reads, not a
    // broken webhook (which `failurePolicy: Ignore` would let through). Read as any JSON
    // reader would, whatever else is wrong with the body: a key given twice counts once, its
    // last value (a struct's fields would refuse the body, and the uid with it).
    let uid = serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|review| {
            review
                .get("request")?
                .get("uid")?
                .as_str()
                .map(str::to_string)
        })
        .unwrap_or_default();
    let mut response = AdmissionResponse::invalid(format!("webhook {}: {error}", settings.name));
    response.uid = uid;
    response.result.code = 400;
    response.result.reason = "BadRequest".into();
    Err(answer(response, false))
}

fn answer(response: AdmissionResponse, panicked: bool) -> Answer {
    // Serializing these types cannot fail (maps with string keys, no floats from user data
    // in a response); an empty body is a broken webhook to the API server if it ever did.
    let body = serde_json::to_vec(&response.into_review()).unwrap_or_default();
    Answer { body, panicked }
}

fn denied(
    mut response: AdmissionResponse,
    code: u16,
    reason: &str,
    message: String,
) -> AdmissionResponse {
    response = response.deny(message);
    response.result.code = code;
    response.result.reason = reason.into();
    response.result.status = Some(kube::core::response::StatusSummary::Failure);
    response
}

/// What a handler's error (or panic) comes to under the hook's failure policy: a denial
/// with status 500, or an allowed answer with a warning.
fn failed(settings: &Settings, response: AdmissionResponse, error: String) -> AdmissionResponse {
    match settings.failure_policy {
        FailurePolicy::Fail => denied(
            response,
            500,
            "InternalError",
            format!("webhook {} failed: {error}", settings.name),
        ),
        FailurePolicy::Ignore => {
            let mut response = response;
            response.warnings = Some(vec![format!(
                "webhook {} failed and let the request through: {error}",
                settings.name
            )]);
            response
        }
    }
}

fn with_warnings(mut response: AdmissionResponse, warnings: Vec<String>) -> AdmissionResponse {
    if !warnings.is_empty() {
        response.warnings = Some(warnings);
    }
    response
}

fn review_of<C, K: kube::Resource>(cluster: C, request: AdmissionRequest<K>) -> Review<C, K> {
    Review {
        cluster,
        operation: request.operation,
        name: request.name,
        namespace: request.namespace,
        object: request.object,
        old_object: request.old_object,
        user_info: request.user_info,
        dry_run: request.dry_run,
        uid: request.uid,
    }
}

fn panic_text(panic: &(dyn std::any::Any + Send)) -> String {
    format!("panicked: {}", crate::util::panic::panic_message(panic))
}

/// The request's object as sent.
fn raw_object(body: &[u8]) -> serde_json::Value {
    #[derive(serde::Deserialize)]
    struct Body {
        request: Option<Request>,
    }
    #[derive(serde::Deserialize)]
    struct Request {
        object: Option<serde_json::Value>,
    }
    serde_json::from_slice::<Body>(body)
        .ok()
        .and_then(|b| b.request?.object)
        .unwrap_or(serde_json::Value::Null)
}

/// `raw` with what the handler changed between `before` and `after` (the typed forms): each
/// change applied to `raw` as it is where `raw` has the same shape there; elsewhere (a
/// parent `raw` lacks, an array of another length) `after`'s value written at the deepest
/// point `raw` has (a whole array when the change is inside one). The rest of `raw`, fields
/// the type does not know among it, stays as it was.
fn changed(
    raw: &serde_json::Value,
    before: &serde_json::Value,
    after: &serde_json::Value,
) -> serde_json::Value {
    use serde_json::Value;
    let mut out = raw.clone();
    for op in json_patch::diff(before, after).0 {
        // Where the object as sent has the same shape as its typed form, the handler's change
        // applies to it as it is, and everything around it stays, unknown fields included.
        if json_patch::patch(&mut out, std::slice::from_ref(&op)).is_ok() {
            continue;
        }
        let path = op.path().as_str();
        // Tokens of the pointer: `/a/b~1c` is `a`, `b/c`.
        let tokens: Vec<&str> = path.split('/').skip(1).collect();
        // The deepest container `out` has on the way, and the token below it.
        let mut depth = 0;
        while depth < tokens.len() {
            let prefix = pointer(&tokens[..depth]);
            let container = out.pointer(&prefix);
            let has_next = match container {
                Some(Value::Object(map)) => map.contains_key(&unescape(tokens[depth])),
                Some(Value::Array(items)) => tokens[depth]
                    .parse::<usize>()
                    .is_ok_and(|i| i < items.len()),
                _ => false,
            };
            if !has_next || depth + 1 == tokens.len() {
                break;
            }
            depth += 1;
        }
        let prefix = pointer(&tokens[..depth]);
        match out.pointer_mut(&prefix) {
            Some(Value::Array(items)) => {
                // Inside an array: the whole array as the handler left it.
                if let Some(Value::Array(new)) = after.pointer(&prefix) {
                    *items = new.clone();
                }
            }
            Some(Value::Object(map)) if depth < tokens.len() => {
                let key = unescape(tokens[depth]);
                match after.pointer(&pointer(&tokens[..=depth])) {
                    Some(value) => {
                        map.insert(key, value.clone());
                    }
                    None => {
                        map.remove(&key);
                    }
                }
            }
            Some(slot) => {
                if let Some(value) = after.pointer(&prefix) {
                    *slot = value.clone();
                }
            }
            None => {}
        }
    }
    out
}

fn pointer(tokens: &[&str]) -> String {
    tokens.iter().map(|t| format!("/{t}")).collect()
}

fn unescape(token: &str) -> String {
    token.replace("~1", "/").replace("~0", "~")
}

/// A validating hook's handle.
pub(crate) fn validating<C, K, F, Fut, E>(settings: Settings, handler: F) -> Handle<C>
where
    C: ClusterId,
    K: kube::Resource + DeserializeOwned + Send + 'static,
    F: Fn(Review<C, K>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Verdict, E>> + Send + 'static,
    E: std::fmt::Display,
{
    let handler = Arc::new(handler);
    Arc::new(move |cluster, body| {
        let settings = settings.clone();
        let handler = handler.clone();
        Box::pin(async move {
            let request = match decode::<K>(&settings, &body) {
                Ok(request) => request,
                Err(answer) => return answer,
            };
            let response = AdmissionResponse::from(&request);
            let review = review_of(cluster, request);
            let outcome = std::panic::AssertUnwindSafe(async move { handler(review).await })
                .catch_unwind()
                .await;
            match outcome {
                Ok(Ok(verdict)) => {
                    let response = with_warnings(response, verdict.warnings);
                    let response = match verdict.denied {
                        None => response,
                        Some(reason) => denied(response, 403, "Forbidden", reason),
                    };
                    answer(response, false)
                }
                Ok(Err(error)) => answer(failed(&settings, response, error.to_string()), false),
                Err(panic) => answer(failed(&settings, response, panic_text(&*panic)), true),
            }
        })
    })
}

/// A mutating hook's handle: the patch is the difference between the object as the handler
/// got it and as it returned it, both in `K`'s form (fields `K` does not know are neither
/// seen nor removed).
pub(crate) fn mutating<C, K, F, Fut, E>(settings: Settings, handler: F) -> Handle<C>
where
    C: ClusterId,
    K: kube::Resource + DeserializeOwned + Serialize + Clone + Send + 'static,
    F: Fn(Review<C, K>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Mutation<K>, E>> + Send + 'static,
    E: std::fmt::Display,
{
    let handler = Arc::new(handler);
    Arc::new(move |cluster, body| {
        let settings = settings.clone();
        let handler = handler.clone();
        Box::pin(async move {
            let request = match decode::<K>(&settings, &body) {
                Ok(request) => request,
                Err(answer) => return answer,
            };
            let response = AdmissionResponse::from(&request);
            let review = review_of(cluster, request);
            let outcome = std::panic::AssertUnwindSafe(async move { handler(review).await })
                .catch_unwind()
                .await;
            let mutation = match outcome {
                Ok(Ok(mutation)) => mutation,
                Ok(Err(error)) => {
                    return answer(failed(&settings, response, error.to_string()), false);
                }
                Err(panic) => {
                    return answer(failed(&settings, response, panic_text(&*panic)), true);
                }
            };
            let response = with_warnings(response, mutation.warnings);
            if let Some(reason) = mutation.denied {
                return answer(denied(response, 403, "Forbidden", reason), false);
            }
            let Some(object) = mutation.object else {
                return answer(response, false);
            };
            // Changed: only now is the object read again from the body, as the API server sent
            // it (the patch must apply to it, not to its typed form, which may have fields the
            // raw one lacks or lack some it has) and in its typed form as the handler got it.
            // An unchanged review is parsed once, as a validating one is.
            let raw = raw_object(&body);
            let before = K::deserialize(&raw).and_then(|before| serde_json::to_value(&before));
            let Ok(before) = before else {
                // Nothing to change (a delete has no object).
                return answer(response, false);
            };
            let patch = serde_json::to_value(&object)
                .map(|after| json_patch::diff(&raw, &changed(&raw, &before, &after)))
                .map_err(|e| e.to_string())
                .and_then(|patch| {
                    if patch.0.is_empty() {
                        Ok(None)
                    } else {
                        Some(patch)
                            .map(|p| response.clone().with_patch(p))
                            .transpose()
                            .map_err(|e| e.to_string())
                    }
                });
            match patch {
                Ok(Some(patched)) => answer(patched, false),
                Ok(None) => answer(response, false),
                Err(error) => answer(
                    failed(
                        &settings,
                        response,
                        format!("the changed object cannot be written: {error}"),
                    ),
                    false,
                ),
            }
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_patch_carries_the_handlers_change_onto_the_object_as_sent() {
        // Sent without `metadata` and with a field the type does not know; the typed forms
        // have an empty `metadata` and lack the unknown field.
        let raw = json!({"kind": "ConfigMap", "unknown": {"keep": 1}, "data": {"a": "1"}, "list": [1, 2]});
        let before =
            json!({"kind": "ConfigMap", "metadata": {}, "data": {"a": "1"}, "list": [1, 2]});
        let after = json!({"kind": "ConfigMap", "metadata": {"annotations": {"o/w": "x"}},
            "data": {"b": "2"}, "list": [1, 3, 4]});
        let out = changed(&raw, &before, &after);
        assert_eq!(
            out,
            json!({"kind": "ConfigMap", "unknown": {"keep": 1},
                "metadata": {"annotations": {"o/w": "x"}}, "data": {"b": "2"}, "list": [1, 3, 4]})
        );
        let mut patched = raw.clone();
        json_patch::patch(&mut patched, &json_patch::diff(&raw, &out)).unwrap();
        assert_eq!(patched, out);
        // An element appended to an array whose elements have fields the type does not know:
        // those fields stay.
        let raw = json!({"list": [{"name": "a", "unknown": 1}]});
        let before = json!({"list": [{"name": "a"}]});
        let after = json!({"list": [{"name": "a"}, {"name": "b"}]});
        assert_eq!(
            changed(&raw, &before, &after),
            json!({"list": [{"name": "a", "unknown": 1}, {"name": "b"}]})
        );
        // Nothing changed: nothing to send.
        assert!(
            json_patch::diff(&raw, &changed(&raw, &before, &before))
                .0
                .is_empty()
        );
    }

    #[test]
    fn an_unreadable_review_with_a_key_given_twice_is_denied_under_the_last_uid() {
        use futures::FutureExt;
        let settings = Settings {
            name: Arc::from("v.example.com"),
            failure_policy: FailurePolicy::Ignore,
        };
        let handle = validating(
            settings,
            |_: Review<crate::cluster::ClusterName, k8s_openapi::api::core::v1::ConfigMap>| async {
                Ok::<_, String>(Verdict::allow())
            },
        );
        // `kind` a string, not a group-version-kind: unreadable as a review; `request` twice.
        let body = r#"{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": "first", "kind": "ConfigMap"},
            "request": {"uid": "u-1", "kind": "ConfigMap"}}"#;
        let answer = handle("east".into(), bytes::Bytes::from(body))
            .now_or_never()
            .unwrap();
        let review: serde_json::Value = serde_json::from_slice(&answer.body).unwrap();
        let response = &review["response"];
        assert_eq!(response["uid"], "u-1", "{review}");
        assert_eq!(response["allowed"], false, "{review}");
        assert_eq!(response["status"]["code"], 400, "{review}");
    }
}
