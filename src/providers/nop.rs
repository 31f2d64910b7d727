//! [`Nop`]: a provider with no clusters.

use std::marker::PhantomData;

use tokio_util::sync::CancellationToken;

use crate::cluster::{ClusterId, ClusterName};
use crate::fleet::Fleet;
use crate::provider::{Provider, ProviderError};

/// No clusters at all: for a manager whose controllers only use its local (host) cluster
/// ([`Manager::with_local`](crate::Manager::with_local) and
/// [`Builder::engage_local`](crate::Builder::engage_local)).
pub struct Nop<C: ClusterId = ClusterName>(PhantomData<fn() -> C>);

impl<C: ClusterId> Nop<C> {
    /// The provider.
    pub fn new() -> Self {
        Self(PhantomData)
    }
}

impl<C: ClusterId> Default for Nop<C> {
    fn default() -> Self {
        Self::new()
    }
}

impl<C: ClusterId> Clone for Nop<C> {
    fn clone(&self) -> Self {
        Self::new()
    }
}

impl<C: ClusterId> std::fmt::Debug for Nop<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Nop")
    }
}

impl<C: ClusterId> Provider for Nop<C> {
    type Id = C;

    async fn run(
        &self,
        _fleet: Fleet<C>,
        shutdown: CancellationToken,
    ) -> Result<(), ProviderError> {
        shutdown.cancelled().await;
        Ok(())
    }
}
