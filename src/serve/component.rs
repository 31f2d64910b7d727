//! The endpoints as a component of a manager's run: their security checked and their address
//! bound before the run starts anything, served for the whole run, stopped last.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use super::{Authorizer, Certificates, Endpoints, Served};
use crate::cluster::{Cluster, ClusterId};
use crate::run::component::{BoxFuture, Component, Failure, Running, Stage, Start, Starting};
use crate::util::sync::lock;

/// The endpoints' TLS settings (`None`: plain HTTP) and token checker (`None`: everyone may
/// ask).
type Security = (Option<Arc<rustls::ServerConfig>>, Option<Arc<Authorizer>>);

/// Serves `/metrics`, `/healthz` and `/readyz` (and the handlers) for the whole run.
pub(crate) struct EndpointsComponent {
    pub(crate) endpoints: Endpoints,
    /// Where they are served in the current run (`Manager::served_at`).
    pub(crate) served_at: Arc<Mutex<Option<SocketAddr>>>,
    /// What the diagnostics view reads beyond the fleet.
    pub(crate) view: super::ViewSources,
}

impl EndpointsComponent {
    /// The TLS settings and the token checker (`local`: the host cluster, whose client
    /// checks tokens unless the endpoints name another).
    fn security<C: ClusterId>(&self, local: Option<&Cluster<C>>) -> Result<Security, Failure> {
        let endpoints = &self.endpoints;
        if endpoints.plain {
            return Ok((None, None));
        }
        let client = match (&endpoints.authorizer, local) {
            (Some(client), _) => client.clone(),
            (None, Some(local)) => local.client(),
            (None, None) => {
                return Err(Failure::Endpoints(
                    "HTTPS endpoints check tokens with a host cluster: give one with Endpoints::authorize_with or Manager::with_local, or serve plain HTTP with Endpoints::plain_http".into(),
                ));
            }
        };
        let certificates = Certificates::load(endpoints.tls.clone()).map_err(Failure::Endpoints)?;
        let tls = certificates.server_config().map_err(Failure::Endpoints)?;
        Ok((Some(tls), Some(Authorizer::new(client))))
    }
}

impl<C: ClusterId> Component<C> for EndpointsComponent {
    fn name(&self) -> &'static str {
        "endpoints"
    }

    fn stage(&self) -> Stage {
        Stage::Serving
    }

    fn prepare<'a>(
        &'a self,
        local: Option<&'a Cluster<C>>,
    ) -> BoxFuture<'a, Result<Start<C>, Failure>> {
        Box::pin(async move {
            let (tls, authorizer) = self.security(local)?;
            let addr = self.endpoints.addr;
            let listener = TcpListener::bind(addr)
                .await
                .map_err(|error| Failure::Listen { addr, error })?;
            let mut endpoints = self.endpoints.clone();
            let served_at = self.served_at.clone();
            let view = self.view.clone();
            let start: Start<C> = Box::new(move |starting: &mut Starting<C>| {
                endpoints.readyz.extend(starting.ready.iter().cloned());
                let addr = listener.local_addr().ok();
                *lock(&served_at) = addr;
                let scheme = if tls.is_some() { "https" } else { "http" };
                tracing::info!(addr = ?addr, scheme, "serving /metrics, /healthz and /readyz");
                let env = &starting.env;
                let served = Arc::new(Served {
                    fleet: env.fleet.clone(),
                    host: starting.host.clone(),
                    local: env.local.clone(),
                    endpoints,
                    authorizer,
                    stopping: env.shutdown.clone(),
                    view,
                    diagnostics: env.diagnostics.clone(),
                    instance: env.instance.clone(),
                });
                let stop = CancellationToken::new();
                let serving = super::serve(listener, tls, served, stop.clone());
                Running::spawn(
                    stop,
                    async move {
                        serving.await;
                        *lock(&served_at) = None;
                        Ok(())
                    },
                    Failure::Panicked,
                )
            });
            Ok(start)
        })
    }
}
