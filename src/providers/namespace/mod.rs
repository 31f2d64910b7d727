//! [`Namespaces`]: every namespace of one host cluster is a cluster of the fleet.
//!
//! Two parts make a namespace behave like a cluster of its own:
//!
//! - **One watch per kind for the whole host.** A [`HostWatches`] keeps, per resource type and
//!   watcher configuration, a single watch across all namespaces of the host and hands each
//!   namespace-cluster the events of its namespace (replaying the current objects to a
//!   namespace that comes later, and a fresh listing after the host watch relists). A
//!   thousand namespaces cost one watch per kind, not a thousand.
//! - **A scoped client.** Each namespace-cluster's [`Client`] rewrites namespaced requests
//!   into its namespace whatever namespace the caller names (in the path and in the body),
//!   lists "across all namespaces" within it, passes cluster-scoped reads through and
//!   refuses cluster-scoped writes with [`ClusterScopedWrite`]. Whether a resource is
//!   namespaced comes from the host's discovery documents, cached per API group version.
//!
//! The provider is here; the shared host watches are in `hub`, the scoped client in
//! `scope`.

mod host_watches;
mod scope;

use std::collections::BTreeSet;
use std::pin::pin;
use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Namespace;
use kube::{Api, Client, ResourceExt};
use kube_runtime::WatchStreamExt;
use kube_runtime::watcher::{self, Event};
use tokio_util::sync::CancellationToken;

use crate::cluster::{Cluster, ClusterName};
use crate::fleet::Fleet;
use crate::provider::{Provider, ProviderError};
use crate::util::sync::lock;

use host_watches::{HostWatches, NamespaceSlice};
use scope::Scoped;
#[cfg(feature = "fuzzing")]
pub(crate) use scope::{ApiPath, Target, is_plain_path, with_namespace};
pub use scope::{ClusterScopedWrite, UnscopableRequest};

/// Every namespace of one host cluster is a cluster, named after the namespace.
///
/// A namespace-cluster's client is scoped to its namespace (see [`ClusterScopedWrite`] for
/// what is refused), and its watches are fed by one watch per resource type across the
/// host, shared by all namespaces. Creating a namespace engages its cluster; deleting it
/// disengages the cluster once the namespace is gone. A namespace that is terminating
/// stays engaged, so controllers can still remove their finalizers from the objects in it
/// (otherwise the namespace could never finish terminating).
///
/// It is the cheapest way to run a fleet locally (many "clusters" on one API server), and a
/// fit for tenants-as-namespaces designs. The isolation is the client's, not the API
/// server's: every namespace-cluster acts with the host client's credentials.
///
/// ```no_run
/// # async fn f(host: kube::Client) {
/// use multicluster_runtime::Manager;
/// use multicluster_runtime::providers::Namespaces;
///
/// // Every namespace labelled tenant=true is a cluster.
/// let manager = Manager::new(Namespaces::new(host).labels("tenant=true"));
/// # }
/// ```
#[derive(Clone)]
pub struct Namespaces {
    host: Client,
    selector: watcher::Config,
    host_watches: Arc<HostWatches>,
}

impl std::fmt::Debug for Namespaces {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Namespaces")
            .field("selector", &self.selector.label_selector)
            .finish_non_exhaustive()
    }
}

impl Namespaces {
    /// Every namespace of the cluster `host` reaches.
    pub fn new(host: Client) -> Self {
        Self {
            host_watches: Arc::new(HostWatches::new(host.clone())),
            host,
            selector: watcher::Config::default(),
        }
    }

    /// Only the namespaces matching a label selector (`tenant=true`, `env in (a,b)`).
    /// A namespace that stops matching is disengaged.
    #[must_use]
    pub fn labels(mut self, selector: &str) -> Self {
        self.selector = self.selector.labels(selector);
        self
    }

    /// How many watches this provider keeps open on the host for its namespace-clusters
    /// (one per resource type and watcher configuration in use by an engaged cluster), for
    /// diagnostics.
    pub fn host_watches(&self) -> usize {
        lock(&self.host_watches.watches)
            .values()
            .filter(|w| w.is_running())
            .count()
    }

    fn cluster(&self, namespace: &str) -> Cluster<ClusterName> {
        let service = Scoped {
            host: self.host.clone(),
            namespace: Arc::from(namespace),
            discovery: self.host_watches.discovery.clone(),
        };
        Cluster::with_source(
            ClusterName::from(namespace),
            service,
            namespace,
            Arc::new(NamespaceSlice {
                host_watches: self.host_watches.clone(),
                namespace: Arc::from(namespace),
            }),
        )
    }
}

impl Provider for Namespaces {
    type Id = ClusterName;

    async fn run(
        &self,
        fleet: Fleet<ClusterName>,
        shutdown: CancellationToken,
    ) -> Result<(), ProviderError> {
        let api: Api<Namespace> = Api::all(self.host.clone());
        let mut events = pin!(watcher::watcher(api, self.selector.clone()).default_backoff());
        let mut engaged: BTreeSet<String> = BTreeSet::new();
        let mut listing: BTreeSet<String> = BTreeSet::new();
        loop {
            let event = tokio::select! {
                () = shutdown.cancelled() => return Ok(()),
                event = events.next() => event,
            };
            match event {
                None => return Ok(()),
                Some(Err(error)) => {
                    tracing::warn!(error = %crate::client::Shown(&error), "watching the host's namespaces failed; retrying");
                }
                Some(Ok(Event::Init)) => listing.clear(),
                Some(Ok(Event::InitApply(ns))) => {
                    listing.insert(ns.name_any());
                    self.engage(&fleet, &mut engaged, ns.name_any());
                }
                Some(Ok(Event::Apply(ns))) => self.engage(&fleet, &mut engaged, ns.name_any()),
                Some(Ok(Event::InitDone)) => {
                    let vanished: Vec<String> = engaged.difference(&listing).cloned().collect();
                    for name in vanished {
                        self.disengage(&fleet, &mut engaged, &name);
                    }
                }
                Some(Ok(Event::Delete(ns))) => {
                    self.disengage(&fleet, &mut engaged, &ns.name_any());
                }
            }
        }
    }
}

impl Namespaces {
    fn engage(&self, fleet: &Fleet<ClusterName>, engaged: &mut BTreeSet<String>, name: String) {
        if engaged.contains(&name) {
            return;
        }
        match fleet.engage(self.cluster(&name)) {
            Ok(_) => {
                engaged.insert(name);
            }
            Err(error) => tracing::warn!(cluster = %name, %error, "could not engage namespace"),
        }
    }

    fn disengage(&self, fleet: &Fleet<ClusterName>, engaged: &mut BTreeSet<String>, name: &str) {
        engaged.remove(name);
        // The host watches notice the cluster's engagement ending and let go of its
        // subscriptions (and stop when nobody is left).
        fleet.disengage(&ClusterName::from(name));
    }
}
