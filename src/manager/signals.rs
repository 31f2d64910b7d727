//! [`Manager::run_until_signal`]: a run stopped gracefully by SIGTERM or SIGINT, and at once by
//! a second one.

use super::{Manager, ManagerError};
use crate::provider::Provider;

impl<P: Provider> Manager<P> {
    /// [`Manager::run`] until the process gets SIGTERM or SIGINT (Ctrl-C), then a graceful
    /// shutdown (kube-runtime's `shutdown_on_signal`): reconciles in flight get the graceful
    /// timeout, a leader gives its lease up. A second signal during that stops at once:
    /// everything is dropped without waiting (the lease then expires on its own), and the
    /// run returns [`ManagerError::ForcedStop`], telling it apart from a clean stop.
    pub async fn run_until_signal(&self) -> Result<(), ManagerError> {
        // Listening before the run starts: a signal from then on is never the default
        // action (the process killed).
        let mut signals = Signals::listen().map_err(ManagerError::Signals)?;
        let run = self.run();
        tokio::pin!(run);
        tokio::select! {
            result = &mut run => return result,
            signal = signals.next() => {
                tracing::info!(%signal, "signal received: shutting down gracefully (a second one stops at once)");
                self.shutdown();
            }
        }
        tokio::select! {
            result = &mut run => result,
            signal = signals.next() => {
                tracing::warn!(%signal, "second signal: stopping now, without waiting for reconciles");
                Err(ManagerError::ForcedStop { signal })
            }
        }
    }
}

/// SIGTERM and SIGINT (Ctrl-C where there are no Unix signals).
struct Signals {
    #[cfg(unix)]
    terminate: tokio::signal::unix::Signal,
    #[cfg(unix)]
    interrupt: tokio::signal::unix::Signal,
}

impl Signals {
    fn listen() -> std::io::Result<Self> {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            Ok(Self {
                terminate: signal(SignalKind::terminate())?,
                interrupt: signal(SignalKind::interrupt())?,
            })
        }
        #[cfg(not(unix))]
        Ok(Self {})
    }

    /// The next signal's name.
    async fn next(&mut self) -> &'static str {
        #[cfg(unix)]
        {
            tokio::select! {
                _ = self.terminate.recv() => "SIGTERM",
                _ = self.interrupt.recv() => "SIGINT",
            }
        }
        #[cfg(not(unix))]
        {
            let _ = tokio::signal::ctrl_c().await;
            "Ctrl-C"
        }
    }
}
