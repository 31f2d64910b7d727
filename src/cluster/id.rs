//! Cluster identities: the [`ClusterId`] trait, the zero-sized [`SingleCluster`] and the
//! fleet name [`ClusterName`].

use std::borrow::Borrow;
use std::fmt::{self, Debug, Display};
use std::hash::Hash;
use std::sync::Arc;

/// The identity of a cluster in a fleet.
///
/// Implement it for your own type (say a UUID newtype) to make cluster identities typed.
/// [`Display`] writes the text form and [`ClusterId::parse`] must read it back to an equal
/// value; [`Request`](crate::Request)'s text form relies on that.
///
/// Provided implementations: [`SingleCluster`] (zero-sized, for single-cluster controllers)
/// and [`ClusterName`] (a cheaply clonable name, for fleets).
pub trait ClusterId: Clone + Eq + Ord + Hash + Debug + Display + Send + Sync + 'static {
    /// Parses the text form written by [`Display`].
    fn parse(s: &str) -> Result<Self, InvalidClusterId>;
}

/// A text that is not a valid [`ClusterId`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid cluster id {text:?}: {reason}")]
pub struct InvalidClusterId {
    text: String,
    reason: String,
}

impl InvalidClusterId {
    /// An error for `text`, saying why it is invalid.
    pub fn new(text: impl Into<String>, reason: impl Into<String>) -> Self {
        Self {
            text: text.into(),
            reason: reason.into(),
        }
    }
}

/// The identity of the one cluster of a single-cluster controller. It takes no space, so a
/// [`Request<SingleCluster>`](crate::Request) is no bigger than the object key alone.
///
/// Its text form is empty.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SingleCluster;

impl Display for SingleCluster {
    fn fmt(&self, _: &mut fmt::Formatter<'_>) -> fmt::Result {
        Ok(())
    }
}

impl ClusterId for SingleCluster {
    fn parse(s: &str) -> Result<Self, InvalidClusterId> {
        if s.is_empty() {
            Ok(Self)
        } else {
            Err(InvalidClusterId::new(
                s,
                "a single-cluster id has an empty text form",
            ))
        }
    }
}

/// The name of a cluster in a fleet: any string, cloned without copying it.
///
/// ```
/// use multicluster_runtime::ClusterName;
/// let name = ClusterName::from("eu-west/prod");
/// assert_eq!(name.as_str(), "eu-west/prod");
/// assert_eq!(name, "eu-west/prod");
/// ```
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ClusterName(Arc<str>);

impl ClusterName {
    /// A new name.
    pub fn new(name: impl AsRef<str>) -> Self {
        Self(Arc::from(name.as_ref()))
    }

    /// The name as a string.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl Debug for ClusterName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        Debug::fmt(&*self.0, f)
    }
}

impl Display for ClusterName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl ClusterId for ClusterName {
    fn parse(s: &str) -> Result<Self, InvalidClusterId> {
        Ok(Self::new(s))
    }
}

impl From<&str> for ClusterName {
    fn from(s: &str) -> Self {
        Self::new(s)
    }
}

impl From<String> for ClusterName {
    fn from(s: String) -> Self {
        Self(Arc::from(s))
    }
}

impl From<&String> for ClusterName {
    fn from(s: &String) -> Self {
        Self::new(s)
    }
}

impl AsRef<str> for ClusterName {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl Borrow<str> for ClusterName {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl PartialEq<str> for ClusterName {
    fn eq(&self, other: &str) -> bool {
        &*self.0 == other
    }
}

impl PartialEq<&str> for ClusterName {
    fn eq(&self, other: &&str) -> bool {
        &*self.0 == *other
    }
}

/// A cluster id as a span field: the single cluster's empty text form reads `single`, so
/// that both modes' spans name a cluster.
pub(crate) struct ClusterField<'a, C>(pub(crate) &'a C);

impl<C: ClusterId> fmt::Display for ClusterField<'_, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if std::any::TypeId::of::<C>() == std::any::TypeId::of::<crate::cluster::SingleCluster>() {
            f.write_str("single")
        } else {
            fmt::Display::fmt(self.0, f)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn single_cluster_is_zero_sized_and_parses_only_the_empty_text() {
        assert_eq!(std::mem::size_of::<SingleCluster>(), 0);
        assert_eq!(SingleCluster::parse(""), Ok(SingleCluster));
        assert!(SingleCluster::parse("x").is_err());
    }

    #[test]
    fn cluster_names_round_trip_through_text_and_clone_cheaply() {
        let a = ClusterName::from("ns/name+ctx#1");
        assert_eq!(ClusterName::parse(a.as_str()).unwrap(), a);
        let b = a.clone();
        assert!(
            std::ptr::eq(a.as_str(), b.as_str()),
            "a clone shares the string"
        );
    }
}
