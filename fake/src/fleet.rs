//! [`FakeFleet`]: a fleet of fake API servers for a multicluster-runtime manager, engaged,
//! disengaged and replaced by the test.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use multicluster_runtime::providers::Clusters;
use multicluster_runtime::{Cluster, ClusterId, ClusterName};

use crate::server::{ApiServer, ApiServerBuilder};

/// Fake clusters and the provider that engages them: give [`FakeFleet::provider`] to a
/// `Manager` and call [`FakeFleet::add`], [`FakeFleet::leave`], [`FakeFleet::rejoin`] and
/// [`FakeFleet::replace`] while it runs. Works under `tokio::time::pause`: nothing here waits
/// on a real clock. Cheap to clone; clones are the same fleet.
///
/// ```
/// use multicluster_runtime::Manager;
/// use multicluster_runtime_fake::FakeFleet;
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let fleet = FakeFleet::new();
/// let a = fleet.add("a");
/// let manager = Manager::new(fleet.provider());
/// # let _ = (a, manager);
/// # }
/// ```
///
/// Cluster ids are made from the names given (`C::parse`, `ClusterName` by default); a name
/// that is not a valid id of `C` is a mistake of the test, and panics.
pub struct FakeFleet<C: ClusterId = ClusterName> {
    clusters: Clusters<C>,
    servers: Arc<Mutex<BTreeMap<String, Member>>>,
}

impl<C: ClusterId> Clone for FakeFleet<C> {
    fn clone(&self) -> Self {
        FakeFleet {
            clusters: self.clusters.clone(),
            servers: self.servers.clone(),
        }
    }
}

impl<C: ClusterId> Default for FakeFleet<C> {
    fn default() -> Self {
        FakeFleet {
            clusters: Clusters::new(),
            servers: Arc::default(),
        }
    }
}

struct Member {
    server: ApiServer,
    engaged: bool,
}

impl<C: ClusterId> std::fmt::Debug for FakeFleet<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map()
            .entries(self.lock().iter().map(|(k, m)| (k.clone(), m.engaged)))
            .finish()
    }
}

impl FakeFleet {
    /// No clusters yet, with `ClusterName` ids (`FakeFleet::<YourId>::default()` for others).
    pub fn new() -> Self {
        Self::default()
    }
}

impl<C: ClusterId> FakeFleet<C> {
    fn lock(&self) -> MutexGuard<'_, BTreeMap<String, Member>> {
        self.servers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The provider to give the manager.
    pub fn provider(&self) -> Clusters<C> {
        self.clusters.clone()
    }

    /// Adds a cluster named `name` with a default server and engages it; returns its server
    /// (to seed objects, inject faults and read what was written).
    pub fn add(&self, name: &str) -> ApiServer {
        self.add_with(ApiServer::builder(name))
    }

    /// Adds a cluster with a server made as `builder` says (its name is the cluster's).
    pub fn add_with(&self, builder: ApiServerBuilder) -> ApiServer {
        let server = builder.build();
        let name = server.name().to_owned();
        self.lock().insert(
            name.clone(),
            Member {
                server: server.clone(),
                engaged: true,
            },
        );
        self.engage(&name, &server);
        server
    }

    /// The id of cluster `name`.
    pub fn id(name: &str) -> C {
        match C::parse(name) {
            Ok(id) => id,
            Err(e) => panic!("FakeFleet: {name:?} is not a cluster id of this fleet: {e}"),
        }
    }

    fn engage(&self, name: &str, server: &ApiServer) {
        // Engaging a new name cannot be refused but for the local cluster's id, which a
        // fake fleet does not use.
        let _ = self
            .clusters
            .add(Cluster::new(Self::id(name), server.client()));
    }

    /// The server of cluster `name`, engaged or not.
    pub fn server(&self, name: &str) -> Option<ApiServer> {
        self.lock().get(name).map(|m| m.server.clone())
    }

    /// The names of the engaged clusters.
    pub fn engaged(&self) -> Vec<String> {
        self.lock()
            .iter()
            .filter(|(_, m)| m.engaged)
            .map(|(k, _)| k.clone())
            .collect()
    }

    /// Cluster `name` leaves the fleet (disengaged: its watches stop, its queued requests
    /// go); its server and objects stay, for [`FakeFleet::rejoin`]. Returns whether it was
    /// engaged.
    pub fn leave(&self, name: &str) -> bool {
        let was = match self.lock().get_mut(name) {
            Some(m) => std::mem::replace(&mut m.engaged, false),
            None => false,
        };
        self.clusters.remove(&Self::id(name));
        was
    }

    /// Cluster `name` comes back under the same id with the same server and objects (a new
    /// client, so the manager sees a new engagement).
    pub fn rejoin(&self, name: &str) -> Option<ApiServer> {
        let server = {
            let mut servers = self.lock();
            let m = servers.get_mut(name)?;
            m.engaged = true;
            m.server.clone()
        };
        self.engage(name, &server);
        Some(server)
    }

    /// Cluster `name` is replaced by a fresh, empty server under the same id (a cluster
    /// recreated); returns the new server.
    pub fn replace(&self, name: &str) -> ApiServer {
        let server = ApiServer::new(name);
        self.lock().insert(
            name.to_owned(),
            Member {
                server: server.clone(),
                engaged: true,
            },
        );
        self.engage(name, &server);
        server
    }
}
