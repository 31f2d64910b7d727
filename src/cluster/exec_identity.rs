//! A client certificate from an exec credential plugin, renewed while the client runs.
//!
//! kube builds a client's TLS configuration once, running the plugin for the certificate
//! then; a plugin's certificates are often short-lived (hours), and one that expired is
//! refused (401) on every request from then on. client-go asks the plugin again when the
//! server refuses the credentials and closes the connections made with the old certificate.
//! Here the TLS configuration's certificate comes through [`ExecIdentity`], which hands out
//! the plugin's latest answer; after a 401 (`reauth`) the plugin is run again, and if the
//! certificate changed, the transport's connections made with the old one take no new
//! streams (those open finish there) while new connections present the new one.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kube::client::ConfigExt;
use rustls::SignatureScheme;
use rustls::client::ResolvesClientCert;
use rustls::sign::CertifiedKey;

use crate::sync::lock;

/// A certificate younger than this is not asked for again (every cluster sharing the
/// identity may see the same 401).
const MIN_AGE: Duration = Duration::from_secs(5);

/// The certificate an exec plugin answered with last.
pub(crate) struct ExecIdentity {
    config: kube::Config,
    current: Mutex<Current>,
    /// Counts the certificates that replaced the first (connections remember theirs).
    generation: AtomicU64,
    /// One run of the plugin at a time.
    renewing: Mutex<()>,
}

struct Current {
    resolver: Arc<dyn ResolvesClientCert>,
    made: Instant,
}

impl std::fmt::Debug for ExecIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExecIdentity")
            .field("server", &self.config.cluster_url)
            .field("generation", &self.generation())
            .finish_non_exhaustive()
    }
}

impl ExecIdentity {
    /// The identity of `tls`, built from `config`, if `config`'s user is an exec plugin and it
    /// answered with a certificate; `tls` then resolves its certificate through it.
    pub(crate) fn wrap(config: &kube::Config, tls: &mut rustls::ClientConfig) -> Option<Arc<Self>> {
        if config.auth_info.exec.is_none() || !tls.client_auth_cert_resolver.has_certs() {
            return None;
        }
        let identity = Arc::new(Self {
            config: config.clone(),
            current: Mutex::new(Current {
                resolver: tls.client_auth_cert_resolver.clone(),
                made: Instant::now(),
            }),
            generation: AtomicU64::new(0),
            renewing: Mutex::new(()),
        });
        tls.client_auth_cert_resolver = identity.clone();
        Some(identity)
    }

    /// Which certificate is current: connections opened under an older one take no new
    /// streams.
    pub(crate) fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Runs the plugin again (blocking: call off the async workers) and takes its
    /// certificate. Returns whether it differs from the one before; a certificate younger
    /// than [`MIN_AGE`] is kept without a run.
    pub(crate) fn renew(&self) -> Result<bool, kube::Error> {
        let _one = lock(&self.renewing);
        if lock(&self.current).made.elapsed() < MIN_AGE {
            return Ok(false);
        }
        // secrets-lint: the caller (reauth) puts a failure in fixed words.
        let tls = self.config.rustls_client_config()?;
        let resolver = tls.client_auth_cert_resolver;
        let mut current = lock(&self.current);
        let changed = leaf(&*resolver) != leaf(&*current.resolver);
        *current = Current {
            resolver,
            made: Instant::now(),
        };
        if changed {
            self.generation.fetch_add(1, Ordering::AcqRel);
            tracing::info!(server = %self.config.cluster_url, "the exec credential plugin issued a new client certificate; new connections present it");
        }
        Ok(changed)
    }
}

/// The end-entity certificate a resolver presents.
fn leaf(resolver: &dyn ResolvesClientCert) -> Option<Vec<u8>> {
    resolver
        .resolve(&[], SCHEMES)
        .and_then(|key| key.cert.first().map(|cert| cert.as_ref().to_vec()))
}

/// What TLS 1.3 and 1.2 servers commonly accept.
const SCHEMES: &[SignatureScheme] = &[
    SignatureScheme::ECDSA_NISTP256_SHA256,
    SignatureScheme::ECDSA_NISTP384_SHA384,
    SignatureScheme::ED25519,
    SignatureScheme::RSA_PSS_SHA256,
    SignatureScheme::RSA_PSS_SHA384,
    SignatureScheme::RSA_PSS_SHA512,
    SignatureScheme::RSA_PKCS1_SHA256,
    SignatureScheme::RSA_PKCS1_SHA384,
    SignatureScheme::RSA_PKCS1_SHA512,
];

impl ResolvesClientCert for ExecIdentity {
    fn resolve(
        &self,
        root_hint_subjects: &[&[u8]],
        sigschemes: &[SignatureScheme],
    ) -> Option<Arc<CertifiedKey>> {
        let resolver = lock(&self.current).resolver.clone();
        resolver.resolve(root_hint_subjects, sigschemes)
    }

    fn has_certs(&self) -> bool {
        true
    }
}
