//! The webhook server as a component of a manager's run: its settings checked, its
//! certificate keeper made (on the first run) and its address bound before the run starts
//! anything; served for the whole run on every replica; told to stop once the controllers
//! have, and awaited (reviews in flight answered) after the fleet is closed. The installers
//! are controllers: they run where the controllers run.

use std::net::SocketAddr;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

use k8s_openapi::api::core::v1::ObjectReference;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;

use super::install::Runtime;
use super::{Install, Keeper, ServerShared};
use crate::cluster::{Cluster, ClusterId};
use crate::run::component::{BoxFuture, Component, Failure, Running, Stage, Start, Starting};
use crate::util::sync::lock;

/// Serves the admission webhooks and keeps their certificates for the whole run.
pub(crate) struct WebhookServer<C: ClusterId> {
    pub(crate) runtime: Arc<Runtime<C>>,
    /// Where they are served in the current run (`Manager::webhooks_served_at`).
    pub(crate) served_at: Arc<Mutex<Option<SocketAddr>>>,
}

impl<C: ClusterId> WebhookServer<C> {
    /// The certificate keeper: made on the first run (with the host Secret it keeps them
    /// in, if there is a host), the same one after that.
    fn keeper(&self, local: Option<&Cluster<C>>) -> Arc<Keeper> {
        let runtime = &self.runtime;
        if let Some(keeper) = runtime.keeper.get() {
            return keeper.clone();
        }
        let webhooks = &runtime.webhooks;
        let secret = match (&webhooks.secret, local) {
            (Some((namespace, name)), Some(local)) => {
                let client = local.client();
                let namespace = namespace
                    .clone()
                    .unwrap_or_else(|| client.default_namespace().to_string());
                Some((client, namespace, name.clone()))
            }
            _ => None,
        };
        if secret.is_none() {
            tracing::info!(
                "webhooks: no host cluster: the certificates and route key live in this process only (one replica)"
            );
        }
        let _ = runtime
            .secret
            .set(secret.as_ref().map(|(_, namespace, name)| ObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Secret".into()),
                namespace: Some(namespace.clone()),
                name: Some(name.clone()),
                ..Default::default()
            }));
        let (host_name, _) = webhooks.url_parts().unwrap_or_default();
        let mut names = vec![host_name];
        names.extend(webhooks.names.iter().cloned());
        // In one order whatever the settings' order: replicas compare the names the
        // certificate is for, and must agree.
        names.sort();
        names.dedup();
        let keeper = Keeper::new(
            webhooks.certificates.clone(),
            secret,
            names,
            webhooks.check_every,
            webhooks.route_rotation_period(),
        );
        let _ = runtime.keeper.set(keeper.clone());
        keeper
    }

    /// What the server shares with every connection (`host`: the host cluster's id, if the
    /// host's webhooks are served).
    fn shared(&self, starting: &Starting<C>, keeper: Arc<Keeper>) -> Arc<ServerShared<C>> {
        let webhooks = &self.runtime.webhooks;
        let (_, base) = webhooks.url_parts().unwrap_or_default();
        let host = match webhooks.install {
            Install::Fleet => None,
            _ => starting.env.local.as_ref().map(|l| l.id().clone()),
        };
        Arc::new(ServerShared {
            fleet: starting.env.fleet.clone(),
            serve_fleet: webhooks.install != Install::Host,
            host,
            base,
            hooks: webhooks
                .hooks
                .iter()
                .map(|hook| {
                    (
                        hook.name.clone(),
                        (hook.handle(), Arc::from(hook.name.as_str()), hook.timeout),
                    )
                })
                .collect(),
            keeper,
            metrics: starting.env.metrics.clone(),
            listening: AtomicBool::new(false),
            slots: crate::serve::slots::Slots::new(super::server::limits(
                webhooks
                    .connections
                    .unwrap_or_else(super::server::default_connections),
            )),
            flights: super::server::Flights::new(webhooks.budget),
        })
    }
}

impl<C: ClusterId> Component<C> for WebhookServer<C> {
    fn name(&self) -> &'static str {
        "webhooks"
    }

    fn stage(&self) -> Stage {
        Stage::Admission
    }

    fn prepare<'a>(
        &'a self,
        local: Option<&'a Cluster<C>>,
    ) -> BoxFuture<'a, Result<Start<C>, Failure>> {
        Box::pin(async move {
            let webhooks = &self.runtime.webhooks;
            webhooks.validate().map_err(Failure::Webhooks)?;
            if local.is_none() && matches!(webhooks.install, Install::Host | Install::FleetAndHost)
            {
                return Err(Failure::Webhooks(
                    "webhooks installed in the host need one: Manager::with_local".into(),
                ));
            }
            webhooks.url_parts().map_err(Failure::Webhooks)?;
            let keeper = self.keeper(local);
            let addr = webhooks.addr;
            let listener = TcpListener::bind(addr)
                .await
                .map_err(|error| Failure::Listen { addr, error })?;
            let this = WebhookServer {
                runtime: self.runtime.clone(),
                served_at: self.served_at.clone(),
            };
            let start: Start<C> = Box::new(move |starting: &mut Starting<C>| {
                let addr = listener.local_addr().ok();
                *lock(&this.served_at) = addr;
                tracing::info!(addr = ?addr, url = %this.runtime.webhooks.url, "serving admission webhooks");
                let shared = this.shared(starting, keeper.clone());
                let ready = shared.clone();
                starting
                    .ready
                    .push(("webhooks".into(), Arc::new(move || ready.ready())));
                let stop = CancellationToken::new();
                let keeping = keeper.run(stop.clone());
                // Reviews in flight are answered within the graceful timeout once it stops.
                let drain = starting.env.grace.timeout;
                let serving = super::serve(listener, shared, stop.clone(), drain);
                let served_at = this.served_at;
                Running::spawn(
                    stop,
                    async move {
                        // Each on a task of its own (a panic in one leaves the other be).
                        let keeping = AbortOnDropHandle::new(tokio::spawn(keeping));
                        let serving = AbortOnDropHandle::new(tokio::spawn(serving));
                        let _ = serving.await;
                        let _ = keeping.await;
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
