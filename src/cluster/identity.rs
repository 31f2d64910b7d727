//! [`ClusterIdentity`]: who a cluster says it is (KEP-2149 `ClusterProperty` objects).

/// A cluster's own statement of its identity, from its KEP-2149 `ClusterProperty` objects
/// (`about.k8s.io`, cluster-scoped, the value in `spec.value`).
///
/// Read and kept up to date by the [`Identified`](crate::providers::Identified) and
/// [`ById`](crate::providers::ById) providers, and available on each cluster they engage
/// ([`Cluster::identity`](crate::Cluster::identity)); read once with
/// [`ClusterIdentity::read`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct ClusterIdentity {
    /// `cluster.clusterset.k8s.io`: the cluster's id, unique in its ClusterSet for as long as
    /// it is a member (an RFC 1123 DNS subdomain; the kube-system namespace's UID is the KEP's
    /// recommendation).
    pub id: Option<String>,
    /// `clusterset.k8s.io`: the ClusterSet the cluster is a member of (present only while
    /// it is one).
    pub clusterset: Option<String>,
}

const ID_PROPERTY: &str = ClusterIdentity::ID_PROPERTY;
const CLUSTERSET_PROPERTY: &str = ClusterIdentity::CLUSTERSET_PROPERTY;

impl ClusterIdentity {
    /// The name of the property holding a cluster's id.
    pub const ID_PROPERTY: &str = "cluster.clusterset.k8s.io";
    /// The name of the property holding the ClusterSet a cluster is a member of.
    pub const CLUSTERSET_PROPERTY: &str = "clusterset.k8s.io";
    /// The group of `ClusterProperty`.
    pub const GROUP: &str = "about.k8s.io";
    /// The versions of `ClusterProperty` read, the preferred first: `v1beta1` (the about-api
    /// project's storage version) where it is served, `v1alpha1` otherwise.
    pub const VERSIONS: [&str; 2] = ["v1beta1", "v1alpha1"];

    /// The `ClusterProperty` kind at `version` (one of [`ClusterIdentity::VERSIONS`]).
    pub fn resource(version: &str) -> kube::api::ApiResource {
        kube::api::ApiResource::from_gvk_with_plural(
            &kube::api::GroupVersionKind::gvk(Self::GROUP, version, "ClusterProperty"),
            "clusterproperties",
        )
    }

    /// The `ClusterProperty` kind as the cluster `client` reaches serves it (the first of
    /// [`ClusterIdentity::VERSIONS`] it serves); `None` if it serves neither.
    pub async fn served(
        client: &kube::Client,
    ) -> Result<Option<kube::api::ApiResource>, kube::Error> {
        let group = match kube::discovery::group(client, Self::GROUP).await {
            Ok(group) => group,
            Err(kube::Error::Api(status)) if status.code == 404 => return Ok(None),
            Err(kube::Error::Discovery(kube::error::DiscoveryError::MissingApiGroup(_))) => {
                return Ok(None);
            }
            Err(error) => return Err(error),
        };
        Ok(Self::VERSIONS.iter().find_map(|version| {
            group
                .versioned_resources(version)
                .into_iter()
                .find(|(resource, _)| resource.kind == "ClusterProperty")
                .map(|(resource, _)| resource)
        }))
    }

    /// Reads the two properties of the cluster `client` reaches, once. A cluster without
    /// the `ClusterProperty` kind (the CRD not installed) has an empty identity.
    pub async fn read(client: &kube::Client) -> Result<Self, kube::Error> {
        let mut identity = Self::default();
        let Some(resource) = Self::served(client).await? else {
            return Ok(identity);
        };
        let api: kube::Api<kube::api::DynamicObject> =
            kube::Api::all_with(client.clone(), &resource);
        for name in [ID_PROPERTY, CLUSTERSET_PROPERTY] {
            match api.get_opt(name).await {
                Ok(Some(object)) => identity.set(name, value_of(&object)),
                Ok(None) => {}
                Err(kube::Error::Api(status)) if status.code == 404 => return Ok(identity),
                Err(error) => return Err(error),
            }
        }
        Ok(identity)
    }

    /// Sets property `name` (one of the two; others are not kept).
    pub(crate) fn set(&mut self, name: &str, value: Option<String>) {
        match name {
            ID_PROPERTY => self.id = value,
            CLUSTERSET_PROPERTY => self.clusterset = value,
            _ => {}
        }
    }

    /// Whether `id` is a valid RFC 1123 DNS subdomain, as KEP-2149 requires of an id: at most
    /// 253 characters, dot-separated labels of 1 to 63 lowercase letters, digits and `-`,
    /// each starting and ending with a letter or digit. (The KEP adds that an id *should* be
    /// shorter than 128 characters; longer ones are valid.)
    pub fn is_valid_id(id: &str) -> bool {
        id.len() <= 253
            && id.split('.').all(|label| {
                !label.is_empty()
                    && label.len() <= 63
                    && label
                        .bytes()
                        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                    && !label.starts_with('-')
                    && !label.ends_with('-')
            })
    }
}

/// `spec.value` of a `ClusterProperty`.
pub(crate) fn value_of(object: &kube::api::DynamicObject) -> Option<String> {
    object
        .data
        .get("spec")
        .and_then(|s| s.get("value"))
        .and_then(|v| v.as_str())
        .map(str::to_string)
}

#[cfg(test)]
mod tests {
    use super::ClusterIdentity;

    #[test]
    fn ids_are_dns_subdomains() {
        let long = [
            "a".repeat(63),
            "b".repeat(63),
            "c".repeat(63),
            "d".repeat(61),
        ]
        .join(".");
        assert_eq!(long.len(), 253);
        for good in [
            "a",
            "east-1",
            "0f3c9a7e-5b1d-4c2a-9e8f-123456789abc",
            "east.prod.example.com",
            &"a".repeat(63),
            &long,
        ] {
            assert!(ClusterIdentity::is_valid_id(good), "{good}");
        }
        for bad in [
            "",
            "-a",
            "a-",
            "East",
            "a_b",
            "a..b",
            ".a",
            "a.",
            "a.-b",
            &"a".repeat(64),
            &format!("{long}x"),
        ] {
            assert!(!ClusterIdentity::is_valid_id(bad), "{bad}");
        }
    }
}
