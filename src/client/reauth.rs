//! Credentials from an exec plugin, run by the crate, kept, and asked for again before they
//! expire or when the server stops accepting them.
//!
//! kube-client runs an exec credential plugin synchronously: when a client is built, and
//! again, for a token with an expiry, inside a request (on the runtime worker polling it,
//! holding a lock). A plugin that takes seconds (`aws`, `gcloud`) stalls a worker for as
//! long; one that hangs stalls it until TCP gives up, and as many hung refreshes as there
//! are workers stop the runtime, probes included. client-go also runs the plugin again when
//! a request is answered 401 Unauthorized: that is how a credential rotated behind the
//! plugin (a token Secret on a hub, a cloud session) reaches a running client.
//!
//! [`ReauthLayer`] does all of this off the workers: the plugin runs as a child process
//! (`exec_plugin`, bounded and killed when given up on), one run per client at a time, whose
//! answer every request waiting for it shares. A token is used until it expires; from a
//! minute before, a run starts in the background while requests go on with the old one.
//! After a 401 to credentials at least [`MIN_AGE`] old, the next request waits for a new
//! run. A client certificate goes to the transport's [`ExecIdentity`].

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use futures::FutureExt as _;
use futures::future::{BoxFuture, Shared};
use http::{HeaderValue, Request, Response, StatusCode};
use kube::client::Body;
use secrecy::ExposeSecret;
use tokio::time::Instant;
use tower::{Layer, Service, ServiceExt};

use super::exec_cert::ExecIdentity;
use super::redact::CredentialError;
use crate::util::sync::lock;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A 401 to credentials younger than this does not run the plugin again (a plugin whose
/// source was not rotated yet would be run for every request); an answer already expired
/// (a skewed clock) is used for this long.
const MIN_AGE: Duration = Duration::from_secs(5);
/// How long a failed run stands before the plugin is run again.
const RETRY_AFTER: Duration = Duration::from_secs(5);
/// How long before its expiry a token is asked for again (as kube-client does).
const REFRESH_AHEAD: Duration = Duration::from_secs(60);

/// The authentication of a config whose user is an exec plugin.
pub(crate) struct ReauthLayer {
    state: Arc<State>,
}

/// A handle on a client's exec credentials: [`Credentials::ready`] runs the plugin if no
/// credential is held yet.
#[derive(Clone)]
pub(crate) struct Credentials(Arc<State>);

struct State {
    exec: Option<kube::config::ExecConfig>,
    server: String,
    /// The client certificate, when the plugin issues one: given to the transport.
    identity: Option<Arc<ExecIdentity>>,
    /// The credential in use; `None` before the first run and once a 401 retired it.
    current: Mutex<Option<Current>>,
    /// The run in flight, shared by every request waiting for it; ended (its plugin
    /// killed) when the client is dropped.
    running: Mutex<Option<(Run, tokio::task::AbortHandle)>>,
    /// When the last run failed, and why: requests meanwhile get that error for
    /// [`RETRY_AFTER`] instead of a run each.
    failed: Mutex<Option<(Instant, String)>>,
    runs: AtomicU64,
}

type Run = Shared<BoxFuture<'static, Result<Current, String>>>;

#[derive(Clone)]
struct Current {
    /// `None`: the plugin answered with a client certificate only.
    header: Option<HeaderValue>,
    expires: Option<Instant>,
    made: Instant,
    /// Which run made it.
    run: u64,
}

impl ReauthLayer {
    /// The authentication of `config` (whose user must be an exec plugin). Runs nothing:
    /// the plugin runs when a request first needs it, or at [`Credentials::ready`].
    pub(crate) fn new(config: &kube::Config, identity: Option<Arc<ExecIdentity>>) -> Self {
        Self {
            state: Arc::new(State {
                exec: config.auth_info.exec.clone(),
                server: config.cluster_url.to_string(),
                identity,
                current: Mutex::new(None),
                running: Mutex::new(None),
                failed: Mutex::new(None),
                runs: AtomicU64::new(0),
            }),
        }
    }

    pub(crate) fn credentials(&self) -> Credentials {
        Credentials(self.state.clone())
    }
}

impl Credentials {
    /// When the credential held ends, as the plugin said (`expirationTimestamp`); `None`
    /// before the plugin ran, and for a credential without an end.
    pub(crate) fn expires(&self) -> Option<SystemTime> {
        let current = lock(&self.0.current).clone()?;
        let left = current.expires?.checked_duration_since(Instant::now())?;
        Some(SystemTime::now() + left)
    }

    /// Has the plugin run (unless a credential is held and valid); the error says what
    /// failed, in words that hold nothing of the plugin's command line or output.
    pub(crate) async fn ready(&self) -> Result<(), String> {
        self.0.credential().await.map(|_| ())
    }
}

impl State {
    /// The credential to use: the current one, or a new one (the plugin run again).
    async fn credential(self: &Arc<Self>) -> Result<Current, String> {
        let now = Instant::now();
        if let Some(current) = lock(&self.current).clone() {
            match current.expires {
                None => return Ok(current),
                Some(at) if at > now + REFRESH_AHEAD => return Ok(current),
                Some(at) if at > now => {
                    // Expiring soon: asked for again meanwhile (not more often than every
                    // MIN_AGE, for tokens shorter-lived than REFRESH_AHEAD), used until then.
                    if current.made.elapsed() >= MIN_AGE && self.failed_lately().is_none() {
                        drop(self.start());
                    }
                    return Ok(current);
                }
                Some(_) => {}
            }
        }
        if let Some(error) = self.failed_lately() {
            return Err(error);
        }
        self.start().await
    }

    /// Why the last run failed, if that was less than [`RETRY_AFTER`] ago.
    fn failed_lately(&self) -> Option<String> {
        lock(&self.failed)
            .as_ref()
            .filter(|(at, _)| at.elapsed() < RETRY_AFTER)
            .map(|(_, error)| error.clone())
    }

    /// The run in flight, or a new one: a task of its own, so that a request giving up does
    /// not end it for the others (the run is bounded by the plugin's timeout). The task
    /// holds the state weakly: a client dropped meanwhile ends it.
    fn start(self: &Arc<Self>) -> Run {
        let mut running = lock(&self.running);
        if let Some((run, _)) = running.as_ref() {
            return run.clone();
        }
        let weak = Arc::downgrade(self);
        let exec = self.exec.clone();
        let task = tokio::spawn(async move {
            let answer = match &exec {
                Some(exec) => super::exec_plugin::run(exec, super::exec_plugin::timeout()).await,
                None => Err("the exec credential plugin has no command".to_string()),
            };
            let Some(state) = weak.upgrade() else {
                return Err("the client is gone".to_string());
            };
            let run = state.runs.fetch_add(1, Ordering::AcqRel) + 1;
            let outcome = answer.and_then(|credential| state.take(credential, run));
            match &outcome {
                Ok(current) => {
                    *lock(&state.failed) = None;
                    *lock(&state.current) = Some(current.clone());
                    if run > 1 {
                        tracing::debug!(server = %state.server, "exec credential plugin run again");
                    }
                }
                Err(error) => *lock(&state.failed) = Some((Instant::now(), error.clone())),
            }
            *lock(&state.running) = None;
            outcome
        });
        let abort = task.abort_handle();
        let run = async move {
            task.await
                .unwrap_or_else(|_| Err("the exec credential plugin's run was stopped".into()))
        }
        .boxed()
        .shared();
        *running = Some((run.clone(), abort));
        run
    }

    /// What the request header and the transport get of `credential`.
    fn take(
        &self,
        credential: super::exec_plugin::Credential,
        run: u64,
    ) -> Result<Current, String> {
        let made = Instant::now();
        if let Some((chain, key)) = &credential.certificate {
            match &self.identity {
                Some(identity) => {
                    identity.set(chain, key)?;
                }
                None if credential.token.is_none() => {
                    return Err("the exec credential plugin answered with a client certificate, which this client cannot present (http://, or a proxy-url)".into());
                }
                None => {}
            }
        }
        let header = match &credential.token {
            Some(token) => {
                let mut value = HeaderValue::from_str(&format!("Bearer {}", token.expose_secret()))
                    .map_err(|_| "the token cannot form an HTTP header".to_string())?;
                value.set_sensitive(true);
                Some(value)
            }
            None => None,
        };
        let expires = credential.expires.map(|at| {
            let left = at
                .duration_since(SystemTime::now())
                .unwrap_or(Duration::ZERO);
            (made + left).max(made + MIN_AGE)
        });
        Ok(Current {
            header,
            expires,
            made,
            run,
        })
    }

    /// The server refused the credentials of `used`: the next request runs the plugin
    /// again, unless they are newer than [`MIN_AGE`] or were retired already.
    fn refused(&self, used: &Current) {
        let mut current = lock(&self.current);
        if current
            .as_ref()
            .is_some_and(|c| c.run == used.run && c.made.elapsed() >= MIN_AGE)
        {
            *current = None;
        }
    }
}

impl Drop for State {
    fn drop(&mut self) {
        if let Some((_, task)) = lock(&self.running).take() {
            task.abort();
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

    fn call(&mut self, mut request: Request<Body>) -> Self::Future {
        let state = self.state.clone();
        let inner = self.inner.clone();
        Box::pin(async move {
            let current = state
                .credential()
                .await
                .map_err(|e| Box::new(CredentialError::new(e)) as BoxError)?;
            if let Some(header) = &current.header {
                request
                    .headers_mut()
                    .insert(http::header::AUTHORIZATION, header.clone());
            }
            let response = inner.oneshot(request).await?;
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
    async fn a_plugin_that_fails_is_reported_without_its_output_or_command_line() {
        let layer = ReauthLayer::new(&failing_plugin(), None);
        let error = layer
            .credentials()
            .ready()
            .await
            .expect_err("the plugin fails");
        assert!(!error.contains("SECRET"), "{error}");
        assert!(error.contains("exited with status 3"), "{error}");
    }

    /// A plugin that answers a token expiring in 61 s on its first run and hangs on every
    /// later one: while the refresh hangs, requests go on with the token it has; ten
    /// requests meanwhile start no second run beside the one in flight.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_hanging_refresh_is_one_run_in_the_background_while_the_token_lasts() {
        let dir = tempfile::tempdir().unwrap();
        let (answered, runs) = (dir.path().join("answered"), dir.path().join("runs"));
        let mut config = failing_plugin();
        let exec = config.auth_info.exec.as_mut().unwrap();
        exec.args = Some(vec![
            "-c".into(),
            format!(
                r#"echo run >> '{runs}'
if [ ! -f '{answered}' ]; then
  touch '{answered}'
  printf '{{"apiVersion":"client.authentication.k8s.io/v1","status":{{"token":"t","expirationTimestamp":"%s"}}}}' "$(date -u -d '+61 seconds' +%Y-%m-%dT%H:%M:%SZ)"
  exit 0
fi
exec sleep 3600"#,
                runs = runs.display(),
                answered = answered.display()
            ),
        ]);
        let layer = ReauthLayer::new(&config, None);
        let credentials = layer.credentials();
        credentials.ready().await.unwrap();
        let first = lock(&layer.state.current).clone().unwrap();
        let count = || std::fs::read_to_string(&runs).unwrap().lines().count();
        // The token is within a minute of expiry; it is asked for again once it is MIN_AGE
        // old.
        tokio::time::sleep(MIN_AGE + Duration::from_millis(100)).await;
        for _ in 0..10 {
            let current =
                tokio::time::timeout(Duration::from_millis(200), layer.state.credential())
                    .await
                    .expect("a token that still lasts is used at once")
                    .unwrap();
            assert_eq!(current.run, first.run);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(count(), 2, "one refresh, in flight for all the requests");
        assert!(lock(&layer.state.running).is_some());
    }
}
