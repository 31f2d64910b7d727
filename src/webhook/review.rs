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
use crate::ClusterId;

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
    let error = match review.map(TryInto::<AdmissionRequest<K>>::try_into) {
        Ok(Ok(request)) => return Ok(request),
        Ok(Err(_)) => "the review has no request".to_string(),
        Err(error) => format!("the review cannot be read: {error}"),
    };
    // Answered with the request's uid when it can be read: a denial the user reads, not a
    // broken webhook (which `failurePolicy: Ignore` would let through).
    #[derive(serde::Deserialize)]
    struct Uid {
        request: Option<UidOnly>,
    }
    #[derive(serde::Deserialize)]
    struct UidOnly {
        uid: String,
    }
    let uid = serde_json::from_slice::<Uid>(body)
        .ok()
        .and_then(|u| u.request)
        .map(|r| r.uid)
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
    format!("panicked: {}", crate::cluster::panic_message(panic))
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
            let before = request.object.as_ref().map(serde_json::to_value);
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
            let (Some(object), Some(Ok(before))) = (mutation.object, before) else {
                // Unchanged, or nothing to change (a delete has no object).
                return answer(response, false);
            };
            let patch = serde_json::to_value(&object)
                .map(|after| json_patch::diff(&before, &after))
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
