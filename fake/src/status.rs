//! The API server's errors, as `Status` objects with the codes, reasons and messages a real
//! server gives.

use serde_json::{Value, json};

use crate::kinds::Resource;

/// An answer other than success: a `Status` with an HTTP code.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct ApiError {
    pub(crate) code: u16,
    pub(crate) reason: &'static str,
    pub(crate) message: String,
    pub(crate) details: Option<Value>,
}

impl ApiError {
    pub(crate) fn to_status(&self) -> Value {
        let mut status = json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        });
        if let Some(details) = &self.details {
            status["details"] = details.clone();
        }
        if self.reason.is_empty()
            && let Some(s) = status.as_object_mut()
        {
            s.remove("reason");
        }
        status
    }

    pub(crate) fn bad_request(message: impl Into<String>) -> Self {
        ApiError {
            code: 400,
            reason: "BadRequest",
            message: message.into(),
            details: None,
        }
    }

    pub(crate) fn not_found_path() -> Self {
        ApiError {
            code: 404,
            reason: "NotFound",
            message: "the server could not find the requested resource".to_owned(),
            details: Some(json!({})),
        }
    }

    pub(crate) fn not_found(resource: &Resource, name: &str) -> Self {
        ApiError {
            code: 404,
            reason: "NotFound",
            message: format!("{} \"{}\" not found", resource.qualified(), name),
            details: Some(details(resource, name)),
        }
    }

    pub(crate) fn namespace_not_found(name: &str) -> Self {
        ApiError {
            code: 404,
            reason: "NotFound",
            message: format!("namespaces \"{name}\" not found"),
            details: Some(json!({"name": name, "kind": "namespaces"})),
        }
    }

    pub(crate) fn already_exists(resource: &Resource, name: &str) -> Self {
        ApiError {
            code: 409,
            reason: "AlreadyExists",
            message: format!("{} \"{}\" already exists", resource.qualified(), name),
            details: Some(details(resource, name)),
        }
    }

    pub(crate) fn conflict(resource: &Resource, name: &str, why: &str) -> Self {
        ApiError {
            code: 409,
            reason: "Conflict",
            message: format!(
                "Operation cannot be fulfilled on {} \"{}\": {}",
                resource.qualified(),
                name,
                why
            ),
            details: Some(details(resource, name)),
        }
    }

    pub(crate) fn modified(resource: &Resource, name: &str) -> Self {
        Self::conflict(
            resource,
            name,
            "the object has been modified; please apply your changes to the latest version and try again",
        )
    }

    /// 422 Invalid. A built-in kind is named by its kind (`ConfigMap "x" is invalid`), a
    /// custom resource by its qualified plural (`widgets.example.com "x" is invalid`).
    pub(crate) fn invalid(
        resource: &Resource,
        name: &str,
        causes: &[(&str, &str, String)],
    ) -> Self {
        let text: Vec<String> = causes
            .iter()
            .map(|(field, _, message)| format!("{field}: {message}"))
            .collect();
        let causes: Vec<Value> = causes
            .iter()
            .map(|(field, reason, message)| json!({"reason": reason, "message": message, "field": field}))
            .collect();
        let mut d = kind_details(resource, name);
        d["causes"] = json!(causes);
        ApiError {
            code: 422,
            reason: "Invalid",
            message: format!(
                "{} \"{name}\" is invalid: {}",
                kind_name(resource),
                join_causes(&text)
            ),
            details: Some(d),
        }
    }

    /// 409 Conflict of a delete whose uid precondition fails.
    pub(crate) fn uid_precondition(
        resource: &Resource,
        name: &str,
        given: &str,
        held: &str,
    ) -> Self {
        Self::precondition(
            resource,
            name,
            "UID",
            given,
            held,
            "deleted and then recreated",
        )
    }

    /// 409 Conflict of a delete whose resourceVersion precondition fails.
    pub(crate) fn rv_precondition(
        resource: &Resource,
        name: &str,
        given: &str,
        held: &str,
    ) -> Self {
        Self::precondition(resource, name, "ResourceVersion", given, held, "modified")
    }

    fn precondition(
        resource: &Resource,
        name: &str,
        field: &str,
        given: &str,
        held: &str,
        maybe: &str,
    ) -> Self {
        ApiError {
            code: 409,
            reason: "Conflict",
            message: format!(
                "Operation cannot be fulfilled on {} \"{name}\": the {field} in the precondition ({given}) does not match the {field} in record ({held}). The object might have been {maybe}",
                kind_name(resource)
            ),
            details: Some(kind_details(resource, name)),
        }
    }

    pub(crate) fn namespace_terminating(resource: &Resource, name: &str, namespace: &str) -> Self {
        let mut e = Self::forbidden(
            resource,
            name,
            &format!(
                "unable to create new content in namespace {namespace} because it is being terminated"
            ),
        );
        if let Some(d) = e.details.as_mut() {
            d["causes"] = json!([{
                "reason": "NamespaceTerminating",
                "message": format!("namespace {namespace} is being terminated"),
                "field": "metadata.namespace"
            }]);
        }
        e
    }

    pub(crate) fn forbidden(resource: &Resource, name: &str, why: &str) -> Self {
        ApiError {
            code: 403,
            reason: "Forbidden",
            message: format!(
                "{} \"{}\" is forbidden: {}",
                resource.qualified(),
                name,
                why
            ),
            details: Some(details(resource, name)),
        }
    }

    pub(crate) fn method_not_allowed() -> Self {
        ApiError {
            code: 405,
            reason: "MethodNotAllowed",
            message: "the server does not allow this method on the requested resource".to_owned(),
            details: Some(json!({})),
        }
    }

    pub(crate) fn unsupported_media_type(content_type: &str) -> Self {
        ApiError {
            code: 415,
            reason: "UnsupportedMediaType",
            message: if content_type.starts_with("application/strategic-merge-patch+json") {
                "the body of the request was in an unknown format - accepted media types include: application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml".to_owned()
            } else {
                "415: Unsupported Media Type".to_owned()
            },
            details: if content_type.starts_with("application/strategic-merge-patch+json") {
                None
            } else {
                Some(json!({}))
            },
        }
    }

    pub(crate) fn expired(message: impl Into<String>) -> Self {
        ApiError {
            code: 410,
            reason: "Expired",
            message: message.into(),
            details: None,
        }
    }

    /// A list at a version the server has not reached.
    pub(crate) fn too_large_resource_version(asked: u64, current: u64) -> Self {
        ApiError {
            code: 504,
            reason: "Timeout",
            message: format!("Too large resource version: {asked}, current: {current}"),
            details: Some(json!({
                "causes": [{"reason": "ResourceVersionTooLarge", "message": "Too large resource version"}],
                "retryAfterSeconds": 1
            })),
        }
    }

    pub(crate) fn too_many_requests() -> Self {
        ApiError {
            code: 429,
            reason: "TooManyRequests",
            message: "Too many requests, please try again later.".to_owned(),
            details: Some(json!({"retryAfterSeconds": 1})),
        }
    }

    pub(crate) fn internal(message: impl Into<String>) -> Self {
        ApiError {
            code: 500,
            reason: "InternalError",
            message: message.into(),
            details: None,
        }
    }

    /// A JSON patch whose operation fails (a `test` that does not hold, a path that is not there).
    pub(crate) fn patch_rejected() -> Self {
        ApiError {
            code: 422,
            reason: "Invalid",
            message: "the server rejected our request due to an error in our request".to_owned(),
            details: Some(json!({})),
        }
    }
}

fn join_causes(text: &[String]) -> String {
    if text.len() == 1 {
        text[0].clone()
    } else {
        format!("[{}]", text.join(", "))
    }
}

/// How validation names a kind: built-in kinds by kind, custom resources by qualified plural.
fn kind_name(resource: &Resource) -> String {
    if resource.custom {
        resource.qualified()
    } else {
        resource.kind.clone()
    }
}

fn kind_details(resource: &Resource, name: &str) -> Value {
    let mut d = if resource.custom {
        json!({"kind": resource.plural})
    } else {
        json!({"kind": resource.kind})
    };
    if !name.is_empty() {
        d["name"] = json!(name);
    }
    if resource.custom && !resource.group.is_empty() {
        d["group"] = json!(resource.group);
    }
    d
}

fn details(resource: &Resource, name: &str) -> Value {
    let mut d = json!({"name": name, "kind": resource.plural});
    if !resource.group.is_empty() {
        d["group"] = json!(resource.group);
    }
    d
}
