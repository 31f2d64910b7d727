//! The scoped client: a namespace-cluster's requests rewritten into its namespace, and
//! cluster-scoped writes refused.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context as TaskContext, Poll};
use std::time::{Duration, Instant};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::APIResourceList;
use kube::Client;
use kube::client::Body;

use crate::util::sync::lock;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A namespace-cluster's client refused a write to a cluster-scoped resource (or to a path
/// outside the resource APIs): a namespace-cluster may only change objects in its namespace.
///
/// It reaches callers as [`kube::Error::Service`]; `downcast_ref::<ClusterScopedWrite>()`
/// on the boxed error recognises it. Cluster-scoped reads (listing namespaces or nodes,
/// discovery) and create-only review APIs such as `SelfSubjectAccessReview` are allowed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "cluster {cluster}: {method} {path} refused: {cluster} is a namespace of its host cluster and may not write cluster-scoped resources"
)]
pub struct ClusterScopedWrite {
    /// The namespace-cluster.
    pub cluster: String,
    /// The HTTP method of the refused request.
    pub method: String,
    /// Its path.
    pub path: String,
}

/// A namespace-cluster's client refused a request it cannot confine to its namespace, for
/// any verb:
///
/// - a path with `.` or `..` segments, empty segments or percent-escapes, which a server or
///   proxy normalising paths could read as another path (no Kubernetes name produces one);
/// - a resource the host's discovery does not list (not served, or a CRD still being
///   installed), since whether it is namespaced is unknown;
/// - a subresource of a cluster-scoped object other than `status` (a node's `proxy`
///   reaches the pods of every namespace);
/// - a write to a namespaced resource named without a namespace.
///
/// It reaches callers as [`kube::Error::Service`], like [`ClusterScopedWrite`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "cluster {cluster}: {method} {path} refused: {reason}, so it cannot be confined to namespace {cluster}"
)]
pub struct UnscopableRequest {
    /// The namespace-cluster.
    pub cluster: String,
    /// The HTTP method of the refused request.
    pub method: String,
    /// Its path.
    pub path: String,
    /// Why.
    pub reason: &'static str,
}

/// Whether `path` has no segment that could be normalised into another path: no `.` or
/// `..`, no empty segment (but a trailing `/`), no percent-escape.
pub(crate) fn is_plain_path(path: &str) -> bool {
    let Some(rest) = path.strip_prefix('/') else {
        return false;
    };
    let rest = rest.strip_suffix('/').unwrap_or(rest);
    rest.is_empty()
        || rest
            .split('/')
            .all(|s| !s.is_empty() && s != "." && s != ".." && !s.contains('%'))
}

/// Whether each resource of an API group version is namespaced, from the host's discovery.
pub(super) struct Discovery {
    host: Client,
    /// By group-version path (`/api/v1`, `/apis/apps/v1`): when it was read, and the
    /// resources by plural.
    groups: Mutex<HashMap<String, (Instant, Arc<Scopes>)>>,
}

/// The scopes of one group version's resources, by plural.
type Scopes = HashMap<String, ResourceScope>;

/// How long a group version's discovery is trusted. A CRD deleted and created again with
/// another scope is noticed within this time.
const DISCOVERY_TTL: Duration = Duration::from_secs(30);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ResourceScope {
    namespaced: bool,
    /// Only `create` is served: a review API that changes nothing.
    create_only: bool,
}

impl Discovery {
    /// An empty cache of `host`'s discovery documents.
    pub(super) fn new(host: Client) -> Self {
        Self {
            host,
            groups: Mutex::new(HashMap::new()),
        }
    }

    /// The scope of `resource` in `group_version`; `None` if the host does not serve it.
    async fn scope(
        &self,
        group_version: &str,
        resource: &str,
    ) -> Result<Option<ResourceScope>, kube::Error> {
        let cached = lock(&self.groups).get(group_version).cloned();
        if let Some((read, scopes)) = cached
            && read.elapsed() < DISCOVERY_TTL
            && let Some(found) = scopes.get(resource)
        {
            return Ok(Some(*found));
        }
        // Not known (yet), or known too long ago: a CRD may have been added or changed.
        let request = http::Request::get(group_version)
            .body(Vec::new())
            .map_err(kube::Error::HttpError)?;
        let list: APIResourceList = match self.host.request(request).await {
            Ok(list) => list,
            Err(kube::Error::Api(status)) if status.code == 404 => return Ok(None),
            Err(error) => return Err(error),
        };
        let scopes: Scopes = list
            .resources
            .iter()
            .filter(|r| !r.name.contains('/'))
            .map(|r| {
                let scope = ResourceScope {
                    namespaced: r.namespaced,
                    create_only: r.verbs == ["create"],
                };
                (r.name.clone(), scope)
            })
            .collect();
        let found = scopes.get(resource).copied();
        lock(&self.groups).insert(
            group_version.to_string(),
            (Instant::now(), Arc::new(scopes)),
        );
        Ok(found)
    }
}

/// An API path taken apart: `<group_version>[/watch]/<rest>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ApiPath<'a> {
    /// `/api/<version>` or `/apis/<group>/<version>`.
    pub(crate) group_version: &'a str,
    /// The deprecated `watch/` prefix.
    pub(crate) watch: bool,
    /// What it addresses.
    pub(crate) target: Target<'a>,
}

/// What an API path addresses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Target<'a> {
    /// The group version's discovery document.
    Discovery,
    /// `namespaces/<namespace>/<resource>[/<name>[/<subresource>...]]`.
    Namespaced {
        /// The namespace named.
        namespace: &'a str,
        /// The resource and whatever follows it.
        rest: Vec<&'a str>,
    },
    /// `<resource>[/<name>...]`: a cluster-scoped resource, or a namespaced one across all
    /// namespaces (discovery tells which).
    Unqualified {
        /// The resource plural.
        resource: &'a str,
        /// Whatever follows it.
        rest: Vec<&'a str>,
    },
}

impl<'a> ApiPath<'a> {
    /// Takes apart a request path (without query); `None` for paths outside the resource
    /// APIs (`/version`, `/openapi/v2`, `/apis`, ...).
    pub(crate) fn parse(path: &'a str) -> Option<Self> {
        let (group_version, rest) = if let Some(after) = path.strip_prefix("/api/") {
            let version = after.split('/').next().filter(|s| !s.is_empty())?;
            let len = "/api/".len() + version.len();
            (&path[..len], &path[len..])
        } else {
            let after = path.strip_prefix("/apis/")?;
            let mut parts = after.splitn(3, '/');
            let group = parts.next().filter(|s| !s.is_empty())?;
            let version = parts.next().filter(|s| !s.is_empty())?;
            let len = "/apis/".len() + group.len() + 1 + version.len();
            (&path[..len], &path[len..])
        };
        if !(rest.is_empty() || rest.starts_with('/')) {
            return None;
        }
        let mut segments: Vec<&str> = rest.split('/').skip(1).collect();
        if segments.last() == Some(&"") {
            segments.pop();
        }
        if segments.iter().any(|s| s.is_empty()) {
            return None;
        }
        let watch = segments.first() == Some(&"watch");
        if watch {
            segments.remove(0);
        }
        let target = match segments.as_slice() {
            [] => Target::Discovery,
            // The Namespace object's own subresources, `namespaces/<ns>/status|finalize`
            // (the API server reads them so in every group, whatever follows).
            ["namespaces", _, "status" | "finalize", ..] => Target::Unqualified {
                resource: segments[0],
                rest: segments[1..].to_vec(),
            },
            ["namespaces", namespace, _, ..] => Target::Namespaced {
                namespace,
                rest: segments[2..].to_vec(),
            },
            [resource, rest @ ..] => Target::Unqualified {
                resource,
                rest: rest.to_vec(),
            },
        };
        Some(Self {
            group_version,
            watch,
            target,
        })
    }

    /// The path of the same request for the namespaced `resource` (followed by `rest`) in
    /// `namespace`.
    pub(crate) fn in_namespace(&self, namespace: &str, rest: &[&str]) -> String {
        let mut path = String::from(self.group_version);
        if self.watch {
            path.push_str("/watch");
        }
        path.push_str("/namespaces/");
        path.push_str(namespace);
        for segment in rest {
            path.push('/');
            path.push_str(segment);
        }
        path
    }
}

/// What the scoped client does with a request.
#[derive(Debug, PartialEq, Eq)]
enum Decision {
    /// Send it as it is.
    Pass,
    /// Send it to this path instead; `body` says whether the body may name a namespace.
    Rewrite { path: String, body: bool },
    /// Refuse it: a cluster-scoped write.
    Refuse,
    /// Refuse it: it cannot be confined to the namespace, for this reason.
    Unscopable(&'static str),
}

/// The tower service behind a namespace-cluster's [`Client`]: it scopes each request to the
/// namespace and sends it with the host's client.
#[derive(Clone)]
pub(super) struct Scoped {
    pub(super) host: Client,
    pub(super) namespace: Arc<str>,
    pub(super) discovery: Arc<Discovery>,
}

impl Scoped {
    async fn decide(&self, method: &http::Method, path: &str) -> Result<Decision, BoxError> {
        let write = !matches!(
            *method,
            http::Method::GET | http::Method::HEAD | http::Method::OPTIONS
        );
        if !is_plain_path(path) {
            return Ok(Decision::Unscopable(
                "a path with dot segments, empty segments or escapes could be read as another path",
            ));
        }
        let Some(api) = ApiPath::parse(path) else {
            return Ok(if write {
                Decision::Refuse
            } else {
                Decision::Pass
            });
        };
        match &api.target {
            Target::Discovery => Ok(if write {
                Decision::Refuse
            } else {
                Decision::Pass
            }),
            Target::Namespaced { rest, .. } => Ok(Decision::Rewrite {
                path: api.in_namespace(&self.namespace, rest),
                body: write,
            }),
            Target::Unqualified { resource, rest } => {
                let scope = self.discovery.scope(api.group_version, resource).await?;
                Ok(match scope {
                    // Not served, or not yet in discovery (a CRD being installed): whether
                    // it is namespaced is unknown, so it cannot be confined.
                    None => Decision::Unscopable("the host's discovery does not list the resource"),
                    // Across all namespaces: within this one.
                    Some(s) if s.namespaced && rest.is_empty() => Decision::Rewrite {
                        path: api.in_namespace(&self.namespace, &[resource]),
                        body: write,
                    },
                    // Not a path the server serves; a write is refused in case discovery
                    // is stale and the resource turned cluster-scoped.
                    Some(s) if s.namespaced && write => {
                        Decision::Unscopable("a namespaced resource named without a namespace")
                    }
                    Some(s) if s.namespaced => Decision::Pass,
                    // Cluster-scoped. Review APIs (create only) change nothing.
                    Some(s) if write && s.create_only && rest.is_empty() => Decision::Pass,
                    Some(_) if write => Decision::Refuse,
                    // Reads of the collection, an object and its status only: subresources
                    // such as a node's `proxy` reach into every namespace.
                    Some(_) if matches!(rest.as_slice(), [] | [_] | [_, "status"]) => {
                        Decision::Pass
                    }
                    Some(_) => Decision::Unscopable(
                        "a cluster-scoped subresource other than status, which may reach into other namespaces",
                    ),
                })
            }
        }
    }

    async fn call(self, request: http::Request<Body>) -> Result<http::Response<Body>, BoxError> {
        let (mut parts, body) = request.into_parts();
        let path = parts.uri.path().to_string();
        let decision = self.decide(&parts.method, &path).await?;
        let body = match decision {
            Decision::Pass => body,
            Decision::Refuse => {
                return Err(Box::new(ClusterScopedWrite {
                    cluster: self.namespace.to_string(),
                    method: parts.method.to_string(),
                    path,
                }));
            }
            Decision::Unscopable(reason) => {
                return Err(Box::new(UnscopableRequest {
                    cluster: self.namespace.to_string(),
                    method: parts.method.to_string(),
                    path,
                    reason,
                }));
            }
            Decision::Rewrite {
                path,
                body: rewrite_body,
            } => {
                let path_and_query = match parts.uri.query() {
                    Some(query) => format!("{path}?{query}"),
                    None => path,
                };
                let mut uri = parts.uri.into_parts();
                uri.path_and_query = Some(path_and_query.parse()?);
                parts.uri = http::Uri::from_parts(uri)?;
                if rewrite_body {
                    let bytes = body.collect_bytes().await?;
                    match with_namespace(&bytes, &self.namespace) {
                        Ok(Some(rewritten)) => {
                            parts.headers.remove(http::header::CONTENT_LENGTH);
                            Body::from(rewritten)
                        }
                        Ok(None) => Body::from(bytes),
                        Err(reason) => {
                            return Err(Box::new(UnscopableRequest {
                                cluster: self.namespace.to_string(),
                                method: parts.method.to_string(),
                                path: parts.uri.path().to_string(),
                                reason,
                            }));
                        }
                    }
                } else {
                    body
                }
            }
        };
        Ok(self
            .host
            .send(http::Request::from_parts(parts, body))
            .await?)
    }
}

/// The body with `metadata.namespace` set to `namespace`, if it is a JSON object naming
/// another namespace; `Ok(None)` to send it unchanged; an error for an Event about a
/// cluster-scoped object, which the API server only accepts outside the namespace (in
/// `default`).
pub(crate) fn with_namespace(
    body: &[u8],
    namespace: &str,
) -> Result<Option<Vec<u8>>, &'static str> {
    let Ok(mut value) = serde_json::from_slice::<serde_json::Value>(body) else {
        return Ok(None);
    };
    let about_cluster_scoped = value.get("kind").and_then(|k| k.as_str()) == Some("Event")
        && ["regarding", "involvedObject"].iter().any(|field| {
            value.get(*field).is_some_and(|object| {
                object.is_object()
                    && object
                        .get("namespace")
                        .and_then(|n| n.as_str())
                        .is_none_or(str::is_empty)
            })
        });
    if about_cluster_scoped {
        return Err("an Event about a cluster-scoped object belongs in namespace default");
    }
    let Some(slot) = value
        .get_mut("metadata")
        .and_then(|m| m.get_mut("namespace"))
    else {
        return Ok(None);
    };
    if slot.as_str() == Some(namespace) || !slot.is_string() {
        return Ok(None);
    }
    *slot = serde_json::Value::String(namespace.to_string());
    Ok(serde_json::to_vec(&value).ok())
}

impl tower_service::Service<http::Request<Body>> for Scoped {
    type Response = http::Response<Body>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<http::Response<Body>, BoxError>> + Send>>;

    fn poll_ready(&mut self, _: &mut TaskContext<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        Box::pin(self.clone().call(request))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_taken_apart() {
        let p = ApiPath::parse("/api/v1/namespaces/zoo/configmaps/elephant").unwrap();
        assert_eq!(p.group_version, "/api/v1");
        assert_eq!(
            p.target,
            Target::Namespaced {
                namespace: "zoo",
                rest: vec!["configmaps", "elephant"]
            }
        );
        assert_eq!(
            p.in_namespace("jungle", &["configmaps", "elephant"]),
            "/api/v1/namespaces/jungle/configmaps/elephant"
        );

        let p = ApiPath::parse("/apis/apps/v1/watch/namespaces/zoo/deployments").unwrap();
        assert_eq!(p.group_version, "/apis/apps/v1");
        assert!(p.watch);
        assert_eq!(
            p.in_namespace("island", &["deployments"]),
            "/apis/apps/v1/watch/namespaces/island/deployments"
        );

        // The Namespace object and its subresources are cluster-scoped, in any group (as
        // the API server reads them; found in review).
        for path in [
            "/api/v1/namespaces/zoo",
            "/api/v1/namespaces/zoo/status",
            "/api/v1/namespaces/zoo/finalize",
            "/api/v1/namespaces/zoo/status/more",
            "/apis/example.com/v1/namespaces/zoo/status",
            "/api/v1/namespaces",
        ] {
            let p = ApiPath::parse(path).unwrap();
            assert!(
                matches!(
                    p.target,
                    Target::Unqualified {
                        resource: "namespaces",
                        ..
                    }
                ),
                "{path}: {p:?}"
            );
        }
        assert_eq!(
            ApiPath::parse("/api/v1/configmaps").unwrap().target,
            Target::Unqualified {
                resource: "configmaps",
                rest: vec![]
            }
        );
        assert_eq!(
            ApiPath::parse("/apis/apps/v1").unwrap().target,
            Target::Discovery
        );
        for outside in [
            "/version",
            "/apis",
            "/api",
            "/apis/apps",
            "/openapi/v2",
            "/api/v1//pods",
        ] {
            assert_eq!(ApiPath::parse(outside), None, "{outside}");
        }
    }

    #[test]
    fn paths_that_could_be_normalised_elsewhere_are_not_plain() {
        for plain in [
            "/",
            "/version",
            "/api/v1/namespaces/zoo/configmaps/a.b",
            "/apis/apps/v1/",
            "/api/v1/namespaces/zoo/configmaps/...",
        ] {
            assert!(is_plain_path(plain), "{plain}");
        }
        for tricky in [
            "/api/v1/namespaces/zoo/configmaps/../../../nodes/n1",
            "/api/v1/namespaces/zoo/./configmaps",
            "/api/v1//nodes/n1",
            "/api/v1/namespaces/zoo/configmaps/%2e%2e",
            "api/v1/nodes",
            "",
        ] {
            assert!(!is_plain_path(tricky), "{tricky}");
        }
    }

    #[test]
    fn only_a_foreign_namespace_in_the_body_is_rewritten() {
        let body = br#"{"metadata":{"name":"a","namespace":"jungle"},"data":{"x":"1"}}"#;
        let out = with_namespace(body, "zoo").unwrap().unwrap();
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["metadata"]["namespace"], "zoo");
        assert_eq!(v["data"]["x"], "1");
        assert_eq!(
            with_namespace(br#"{"metadata":{"namespace":"zoo"}}"#, "zoo"),
            Ok(None)
        );
        assert_eq!(
            with_namespace(br#"{"metadata":{"name":"a"}}"#, "zoo"),
            Ok(None)
        );
        assert_eq!(with_namespace(br#"[{"op":"add"}]"#, "zoo"), Ok(None));
        assert_eq!(with_namespace(b"not json", "zoo"), Ok(None));
        // Events: about an object in the namespace, fine; about a cluster-scoped one, not.
        let event = |regarding: &str| {
            format!(
                r#"{{"kind":"Event","metadata":{{"namespace":"default"}},"regarding":{regarding}}}"#
            )
        };
        assert!(
            with_namespace(
                event(r#"{"kind":"ConfigMap","namespace":"x"}"#).as_bytes(),
                "zoo"
            )
            .unwrap()
            .is_some()
        );
        assert!(with_namespace(event(r#"{"kind":"Node","name":"n1"}"#).as_bytes(), "zoo").is_err());
        assert!(
            with_namespace(event(r#"{"kind":"Node","namespace":""}"#).as_bytes(), "zoo").is_err()
        );
    }
}
