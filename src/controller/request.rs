//! [`Request`]: which object of which cluster to reconcile, with a lossless text form.

use std::fmt::{self, Display, Write as _};
use std::str::FromStr;

use kube::Resource;
use kube_runtime::reflector::ObjectRef;

use crate::cluster::{ClusterId, InvalidClusterId};

/// A request to reconcile one object in one cluster: the cluster's id and the object's key.
///
/// Its text form is `cluster://<cluster>/<namespace>/<name>`; a cluster-scoped object drops
/// the namespace (`cluster://<cluster>/<name>`) and the single-cluster id is empty
/// (`cluster:///<namespace>/<name>`). `%` and `/` inside a part are percent-encoded, so every
/// request prints to a string that [`FromStr`] parses back to an equal request, whatever its
/// parts contain.
///
/// ```
/// use multicluster_runtime::{ClusterName, Request, SingleCluster};
///
/// let r = Request::new(ClusterName::from("capi/prod"), Some("default"), "web");
/// assert_eq!(r.to_string(), "cluster://capi%2Fprod/default/web");
/// assert_eq!(r.to_string().parse::<Request<ClusterName>>().unwrap(), r);
///
/// let single = Request::new(SingleCluster, None::<&str>, "node-1");
/// assert_eq!(single.to_string(), "cluster:///node-1");
/// // The zero-sized id adds nothing to the key.
/// assert_eq!(
///     std::mem::size_of::<Request<SingleCluster>>(),
///     std::mem::size_of::<(Option<String>, String)>()
/// );
/// ```
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Request<C: ClusterId> {
    /// The cluster the object lives in.
    pub cluster: C,
    /// The object's namespace; `None` for cluster-scoped objects.
    pub namespace: Option<String>,
    /// The object's name.
    pub name: String,
}

const SCHEME: &str = "cluster://";

impl<C: ClusterId> Request<C> {
    /// A request for `name` in `namespace` (or cluster-scoped with `None`) in `cluster`.
    pub fn new(cluster: C, namespace: Option<impl Into<String>>, name: impl Into<String>) -> Self {
        Self {
            cluster,
            namespace: namespace.map(Into::into),
            name: name.into(),
        }
    }

    /// The request for `obj` in `cluster`.
    pub fn from_obj<K: Resource>(cluster: C, obj: &K) -> Self {
        let meta = obj.meta();
        Self {
            cluster,
            namespace: meta.namespace.clone(),
            name: meta.name.clone().unwrap_or_default(),
        }
    }

    /// The request for the object `obj_ref` points at, in `cluster` (moves its strings).
    pub fn from_object_ref<K: kube_runtime::reflector::Lookup + ?Sized>(
        cluster: C,
        obj_ref: ObjectRef<K>,
    ) -> Self {
        Self {
            cluster,
            namespace: obj_ref.namespace,
            name: obj_ref.name,
        }
    }

    /// The kube-runtime reference to the object, for looking it up in a reflector store.
    pub fn object_ref<K>(&self) -> ObjectRef<K>
    where
        K: kube_runtime::reflector::Lookup,
        K::DynamicType: Default,
    {
        let r = ObjectRef::new(&self.name);
        match &self.namespace {
            Some(ns) => r.within(ns),
            None => r,
        }
    }

    /// [`Request::object_ref`] for a kind known at run time, whose dynamic type is `dt`.
    pub fn object_ref_with<K>(&self, dt: K::DynamicType) -> ObjectRef<K>
    where
        K: kube_runtime::reflector::Lookup,
    {
        let r = ObjectRef::new_with(&self.name, dt);
        match &self.namespace {
            Some(ns) => r.within(ns),
            None => r,
        }
    }

    /// The same object key in another cluster.
    pub fn in_cluster<D: ClusterId>(&self, cluster: D) -> Request<D> {
        Request {
            cluster,
            namespace: self.namespace.clone(),
            name: self.name.clone(),
        }
    }
}

impl<C: ClusterId> Display for Request<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(SCHEME)?;
        // Display of the id is written through the encoder without an intermediate String.
        write!(Encoder(f), "{}", self.cluster)?;
        f.write_char('/')?;
        if let Some(ns) = &self.namespace {
            Encoder(f).write_str(ns)?;
            f.write_char('/')?;
        }
        Encoder(f).write_str(&self.name)
    }
}

/// Percent-encodes `%` and `/` on the way through to the formatter.
struct Encoder<'a, 'b>(&'a mut fmt::Formatter<'b>);

impl fmt::Write for Encoder<'_, '_> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        let mut rest = s;
        while let Some(i) = rest.find(['%', '/']) {
            self.0.write_str(&rest[..i])?;
            self.0.write_str(if rest.as_bytes()[i] == b'%' {
                "%25"
            } else {
                "%2F"
            })?;
            rest = &rest[i + 1..];
        }
        self.0.write_str(rest)
    }
}

/// A text that is not a [`Request`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ParseRequestError {
    /// It does not start with `cluster://`.
    #[error("a request starts with \"cluster://\"")]
    MissingScheme,
    /// The path has neither one part (`<name>`) nor two (`<namespace>/<name>`).
    #[error("expected cluster://<cluster>/<namespace>/<name> or cluster://<cluster>/<name>")]
    BadPath,
    /// A `%` is not followed by `25` or `2F`, or the decoded text is not UTF-8.
    #[error("invalid percent-encoding in {0:?}")]
    BadEscape(String),
    /// The cluster part is not a valid id of the cluster id type.
    #[error(transparent)]
    Cluster(#[from] InvalidClusterId),
}

fn decode(part: &str) -> Result<String, ParseRequestError> {
    let mut out = String::with_capacity(part.len());
    let mut rest = part;
    while let Some(i) = rest.find('%') {
        out.push_str(&rest[..i]);
        let escape = rest
            .get(i + 1..i + 3)
            .ok_or_else(|| ParseRequestError::BadEscape(part.to_string()))?;
        out.push(match escape {
            "25" => '%',
            "2F" | "2f" => '/',
            _ => return Err(ParseRequestError::BadEscape(part.to_string())),
        });
        rest = &rest[i + 3..];
    }
    out.push_str(rest);
    Ok(out)
}

impl<C: ClusterId> FromStr for Request<C> {
    type Err = ParseRequestError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let rest = s
            .strip_prefix(SCHEME)
            .ok_or(ParseRequestError::MissingScheme)?;
        let mut parts = rest.split('/');
        let (Some(cluster), Some(first)) = (parts.next(), parts.next()) else {
            return Err(ParseRequestError::BadPath);
        };
        let (namespace, name) = match (parts.next(), parts.next()) {
            (None, _) => (None, first),
            (Some(name), None) => (Some(decode(first)?), name),
            (Some(_), Some(_)) => return Err(ParseRequestError::BadPath),
        };
        Ok(Self {
            cluster: C::parse(&decode(cluster)?)?,
            namespace,
            name: decode(name)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::{ClusterName, SingleCluster};

    fn round_trip<C: ClusterId>(r: Request<C>) -> String {
        let text = r.to_string();
        assert_eq!(text.parse::<Request<C>>().unwrap(), r, "{text}");
        text
    }

    #[test]
    fn namespaced_and_cluster_scoped_requests_print_and_parse_back() {
        let c = ClusterName::from("kind-a");
        assert_eq!(
            round_trip(Request::new(c.clone(), Some("ns"), "n")),
            "cluster://kind-a/ns/n"
        );
        assert_eq!(
            round_trip(Request::new(c, None::<String>, "n")),
            "cluster://kind-a/n"
        );
        assert_eq!(
            round_trip(Request::new(SingleCluster, Some("ns"), "n")),
            "cluster:///ns/n"
        );
    }

    #[test]
    fn separators_and_percent_signs_inside_parts_survive() {
        let odd = Request::new(ClusterName::from("a/b%2F/c"), Some("x/%y"), "%/%25");
        let text = round_trip(odd);
        assert_eq!(
            text.matches('/').count(),
            4,
            "only the structural slashes remain: {text}"
        );
        round_trip(Request::new(ClusterName::from(""), Some(""), ""));
    }

    #[test]
    fn malformed_text_is_an_error() {
        type R = Request<ClusterName>;
        assert_eq!(
            "kind-a/ns/n".parse::<R>(),
            Err(ParseRequestError::MissingScheme)
        );
        assert_eq!(
            "cluster://only".parse::<R>(),
            Err(ParseRequestError::BadPath)
        );
        assert_eq!(
            "cluster://c/a/b/c".parse::<R>(),
            Err(ParseRequestError::BadPath)
        );
        assert!(matches!(
            "cluster://c/%zz".parse::<R>(),
            Err(ParseRequestError::BadEscape(_))
        ));
        assert!(matches!(
            "cluster://c/%2".parse::<R>(),
            Err(ParseRequestError::BadEscape(_))
        ));
        assert!(matches!(
            "cluster://x/ns/n".parse::<Request<SingleCluster>>(),
            Err(ParseRequestError::Cluster(_))
        ));
    }

    #[test]
    fn object_refs_convert_both_ways() {
        use k8s_openapi::api::core::v1::ConfigMap;
        let r = Request::new(ClusterName::from("c"), Some("ns"), "n");
        let o: ObjectRef<ConfigMap> = r.object_ref();
        assert_eq!((o.namespace.as_deref(), o.name.as_str()), (Some("ns"), "n"));
        assert_eq!(Request::from_object_ref(ClusterName::from("c"), o), r);
    }
}
