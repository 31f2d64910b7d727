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
    /// it is a member (an RFC 1123 DNS label; the kube-system namespace's UID is the KEP's
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
    /// The version of `ClusterProperty` read.
    pub const VERSION: &str = "v1alpha1";

    /// The `ClusterProperty` kind.
    pub fn resource() -> kube::api::ApiResource {
        kube::api::ApiResource::from_gvk_with_plural(
            &kube::api::GroupVersionKind::gvk(Self::GROUP, Self::VERSION, "ClusterProperty"),
            "clusterproperties",
        )
    }

    /// Reads the two properties of the cluster `client` reaches, once. A cluster without
    /// the `ClusterProperty` kind (the CRD not installed) has an empty identity.
    pub async fn read(client: &kube::Client) -> Result<Self, kube::Error> {
        let api: kube::Api<kube::api::DynamicObject> =
            kube::Api::all_with(client.clone(), &Self::resource());
        let mut identity = Self::default();
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

    /// Whether `id` is an RFC 1123 DNS label, as the KEP requires of an id.
    pub fn is_valid_id(id: &str) -> bool {
        !id.is_empty()
            && id.len() <= 63
            && id
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            && !id.starts_with('-')
            && !id.ends_with('-')
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
    fn ids_are_dns_labels() {
        for good in [
            "a",
            "east-1",
            "0f3c9a7e-5b1d-4c2a-9e8f-123456789abc",
            &"a".repeat(63),
        ] {
            assert!(ClusterIdentity::is_valid_id(good), "{good}");
        }
        for bad in ["", "-a", "a-", "East", "a.b", "a_b", &"a".repeat(64)] {
            assert!(!ClusterIdentity::is_valid_id(bad), "{bad}");
        }
    }
}
