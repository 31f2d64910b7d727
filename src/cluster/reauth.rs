//! Credentials from an exec plugin, asked for again when the server stops accepting them.
//!
//! kube-client runs an exec credential plugin once, when the client is built, and keeps a
//! token that came without an expiry for the life of the client. client-go runs the plugin
//! again when a request is answered 401 Unauthorized: that is how a credential rotated
//! behind the plugin (a token Secret on a hub, a cloud session) reaches a running client.
//! [`ReauthLayer`] does the same for the clients this crate builds: kube's own
//! authentication layer, made again (the plugin run again, off the async workers) for the
//! request after a 401.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use http::{Request, Response, StatusCode};
use kube::client::middleware::AuthLayer;
use kube::client::{Body, ConfigExt};
use tokio::time::Instant;
use tower::{Layer, Service, ServiceExt};

use crate::sync::lock;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A 401 to credentials younger than this does not run the plugin again (a plugin whose
/// source was not rotated yet would be run for every request).
const MIN_AGE: Duration = Duration::from_secs(5);
/// How long the plugin may take.
const PLUGIN_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a failed run stands before the plugin is run again.
const RETRY_AFTER: Duration = Duration::from_secs(5);

/// The authentication of a config whose user is an exec plugin.
pub(crate) struct ReauthLayer {
    state: Arc<State>,
}

struct State {
    config: kube::Config,
    /// The client certificate, when the plugin issues one: renewed instead of a header.
    identity: Option<Arc<super::exec_identity::ExecIdentity>>,
    /// The layer in use and when it was made; `None` once a 401 retired it.
    current: Mutex<Option<Current>>,
    /// One plugin run at a time.
    making: tokio::sync::Mutex<()>,
    /// A run that timed out and may still be going (its thread cannot be stopped): no
    /// other starts until it ends.
    running: Arc<std::sync::atomic::AtomicBool>,
    /// When the last run failed, and why: requests meanwhile get that error for
    /// [`RETRY_AFTER`] instead of a run each.
    failed: Mutex<Option<(Instant, String)>>,
}

#[derive(Clone)]
struct Current {
    /// `None`: the plugin answered with a client certificate (used by the TLS set-up), no
    /// header to add.
    layer: Arc<Option<AuthLayer>>,
    made: Instant,
}

impl ReauthLayer {
    /// Runs the plugin once now (as kube does when it builds a client), so that a plugin
    /// that fails is an error of the client's construction.
    pub(crate) fn new(
        config: &kube::Config,
        identity: Option<Arc<super::exec_identity::ExecIdentity>>,
    ) -> Result<Self, kube::Error> {
        // secrets-lint: built in Cluster::from_config, which redacts the error.
        let layer = config.auth_layer()?;
        Ok(Self {
            state: Arc::new(State {
                config: config.clone(),
                identity,
                current: Mutex::new(Some(Current {
                    layer: Arc::new(layer),
                    made: Instant::now(),
                })),
                making: tokio::sync::Mutex::new(()),
                running: Arc::default(),
                failed: Mutex::new(None),
            }),
        })
    }
}

impl State {
    /// The layer to use: the current one, or a new one (the plugin run again).
    async fn current(&self) -> Result<Current, BoxError> {
        if let Some(current) = lock(&self.current).clone() {
            return Ok(current);
        }
        let _making = self.making.lock().await;
        if let Some(current) = lock(&self.current).clone() {
            return Ok(current);
        }
        if let Some((at, error)) = lock(&self.failed).as_ref()
            && at.elapsed() < RETRY_AFTER
        {
            return Err(error.clone().into());
        }
        let layer = match self.run().await {
            Ok(layer) => layer,
            Err(error) => {
                *lock(&self.failed) = Some((Instant::now(), error.clone()));
                return Err(error.into());
            }
        };
        *lock(&self.failed) = None;
        tracing::debug!(server = %self.config.cluster_url, "exec credential plugin run again after a 401");
        let current = Current {
            layer: Arc::new(layer),
            made: Instant::now(),
        };
        *lock(&self.current) = Some(current.clone());
        Ok(current)
    }

    /// Runs the plugin (through kube's construction of its auth layer) off the async
    /// workers, for at most [`PLUGIN_TIMEOUT`].
    async fn run(&self) -> Result<Option<AuthLayer>, String> {
        use std::sync::atomic::Ordering;
        if self.running.swap(true, Ordering::AcqRel) {
            return Err("the exec credential plugin has not returned from an earlier run".into());
        }
        let config = self.config.clone();
        let identity = self.identity.clone();
        let running = self.running.clone();
        let run = tokio::task::spawn_blocking(move || {
            let layer = match identity {
                // A certificate: the TLS identity is renewed; there is no header to add.
                Some(identity) => identity.renew().map(|_| None),
                // secrets-lint: the error is put in fixed words (describe_client) below.
                None => config.auth_layer(),
            };
            running.store(false, Ordering::Release);
            layer
        });
        match tokio::time::timeout(PLUGIN_TIMEOUT, run).await {
            Ok(Ok(Ok(layer))) => Ok(layer),
            // kube's text of a failed run has the plugin's command line (environment
            // included) and output: credentials. Only what failed goes on.
            Ok(Ok(Err(error))) => Err(super::redact::describe_client(&error)),
            Ok(Err(error)) => {
                self.running.store(false, Ordering::Release);
                Err(error.to_string())
            }
            Err(_) => Err(format!(
                "the exec credential plugin did not answer within {} s",
                PLUGIN_TIMEOUT.as_secs()
            )),
        }
    }

    /// The server refused the credentials of `used`: the next request runs the plugin
    /// again, unless they are newer than [`MIN_AGE`] or were retired already.
    fn refused(&self, used: &Current) {
        let mut current = lock(&self.current);
        if current
            .as_ref()
            .is_some_and(|c| Arc::ptr_eq(&c.layer, &used.layer) && c.made.elapsed() >= MIN_AGE)
        {
            *current = None;
        }
    }
}

impl<S> Layer<S> for ReauthLayer {
    type Service = Reauth<S>;

    fn layer(&self, inner: S) -> Reauth<S> {
        Reauth {
            state: self.state.clone(),
            inner,
        }
    }
}

/// See [`ReauthLayer`].
#[derive(Clone)]
pub(crate) struct Reauth<S> {
    state: Arc<State>,
    inner: S,
}

impl<S, B> Service<Request<Body>> for Reauth<S>
where
    S: Service<Request<Body>, Response = Response<B>, Error = BoxError> + Clone + Send + 'static,
    S::Future: Send,
    B: Send + 'static,
{
    type Response = Response<B>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Response<B>, BoxError>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        // The inner service is cloned per request and made ready there.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        let state = self.state.clone();
        let inner = self.inner.clone();
        Box::pin(async move {
            let current = state.current().await?;
            let response = match current.layer.as_ref() {
                Some(layer) => layer.layer(inner).oneshot(request).await?,
                None => inner.oneshot(request).await?,
            };
            if response.status() == StatusCode::UNAUTHORIZED {
                state.refused(&current);
            }
            Ok(response)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A config whose exec plugin fails, printing secrets, with a secret in its arguments
    /// and in its environment.
    fn failing_plugin() -> kube::Config {
        let mut config = kube::Config::new("https://127.0.0.1:1".parse().unwrap());
        config.auth_info.exec = Some(kube::config::ExecConfig {
            api_version: Some("client.authentication.k8s.io/v1".into()),
            command: Some("sh".into()),
            args: Some(vec![
                "-c".into(),
                "echo SECRET-STDOUT; echo SECRET-STDERR >&2; exit 3".into(),
                "SECRET-ARG".into(),
            ]),
            env: Some(vec![std::collections::HashMap::from([
                ("name".to_string(), "TOKEN".to_string()),
                ("value".to_string(), "SECRET-ENV".to_string()),
            ])]),
            drop_env: None,
            install_hint: None,
            provide_cluster_info: false,
            cluster: None,
            interactive_mode: None,
            other: Default::default(),
        });
        config
    }

    #[tokio::test]
    async fn a_plugin_that_fails_on_a_rerun_is_reported_without_its_output_or_command_line() {
        let state = State {
            config: failing_plugin(),
            identity: None,
            current: Mutex::new(None),
            making: tokio::sync::Mutex::new(()),
            running: Arc::default(),
            failed: Mutex::new(None),
        };
        let error = state
            .current()
            .await
            .err()
            .expect("the plugin fails")
            .to_string();
        assert!(!error.contains("SECRET"), "{error}");
        assert!(error.contains("exited with status 3"), "{error}");
    }
}
