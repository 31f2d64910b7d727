//! A client certificate from an exec credential plugin, renewed while the client runs.
//!
//! kube builds a client's TLS configuration once, running the plugin for the certificate
//! then; a plugin's certificates are often short-lived (hours), and one that expired is
//! refused (401) on every request from then on. client-go asks the plugin again when the
//! server refuses the credentials and closes the connections made with the old certificate.
//! Here the TLS configuration's certificate comes through [`ExecIdentity`], which hands out
//! the plugin's latest answer (`reauth` runs the plugin, `exec_plugin`); after a 401 or
//! before the certificate expires the plugin is run again, and if the certificate changed, the transport's connections made with the old one take no new
//! streams (those open finish there) while new connections present the new one.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use rustls::SignatureScheme;
use rustls::client::ResolvesClientCert;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::sign::CertifiedKey;
use secrecy::{ExposeSecret, SecretString};

use crate::util::sync::lock;

/// The certificate an exec plugin answered with last.
pub(crate) struct ExecIdentity {
    server: String,
    /// `None` until the plugin answered with a certificate (a certificate given beside the
    /// plugin in the kubeconfig until then).
    current: Mutex<Option<Current>>,
    /// Counts the certificates that replaced the first (connections remember theirs).
    generation: AtomicU64,
}

struct Current {
    resolver: Arc<dyn ResolvesClientCert>,
}

impl std::fmt::Debug for ExecIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExecIdentity")
            .field("server", &self.server)
            .field("generation", &self.generation())
            .finish_non_exhaustive()
    }
}

impl ExecIdentity {
    /// The identity of `tls`, built from `config`, if `config`'s user is an exec plugin;
    /// `tls` then resolves its certificate through it. (`tls` was built without running
    /// the plugin: the certificate comes when the plugin first answers, before the first
    /// connection.)
    pub(crate) fn wrap(config: &kube::Config, tls: &mut rustls::ClientConfig) -> Option<Arc<Self>> {
        config.auth_info.exec.as_ref()?;
        let given = tls.client_auth_cert_resolver.clone();
        let identity = Arc::new(Self {
            server: config.cluster_url.to_string(),
            current: Mutex::new(given.has_certs().then_some(Current { resolver: given })),
            generation: AtomicU64::new(0),
        });
        tls.client_auth_cert_resolver = identity.clone();
        Some(identity)
    }

    /// Which certificate is current: connections opened under an older one take no new
    /// streams.
    pub(crate) fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Takes the plugin's certificate chain and key (PEM). Returns whether it differs from
    /// the one before; the error holds nothing of either.
    pub(crate) fn set(&self, chain: &str, key: &SecretString) -> Result<bool, String> {
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(chain.as_bytes())
            .collect::<Result<_, _>>()
            .map_err(|_| {
                "the exec credential plugin's client certificate is not valid PEM".to_string()
            })?;
        if certs.is_empty() {
            return Err("the exec credential plugin's client certificate is not valid PEM".into());
        }
        let private = PrivateKeyDer::from_pem_slice(key.expose_secret().as_bytes())
            .map_err(|_| "the exec credential plugin's client key is not valid PEM".to_string())?;
        let key = crate::util::tls::certified(certs, private)
            .map_err(|e| format!("the exec credential plugin's client certificate: {e}"))?;
        let resolver: Arc<dyn ResolvesClientCert> = Arc::new(Fixed(key));
        let mut current = lock(&self.current);
        let changed = current
            .as_ref()
            .is_some_and(|c| leaf(&*resolver) != leaf(&*c.resolver));
        *current = Some(Current { resolver });
        if changed {
            self.generation.fetch_add(1, Ordering::AcqRel);
            tracing::info!(server = %self.server, "the exec credential plugin issued a new client certificate; new connections present it");
        }
        Ok(changed)
    }
}

/// One certificate, always.
#[derive(Debug)]
struct Fixed(Arc<CertifiedKey>);

impl ResolvesClientCert for Fixed {
    fn resolve(&self, _: &[&[u8]], _: &[SignatureScheme]) -> Option<Arc<CertifiedKey>> {
        Some(self.0.clone())
    }

    fn has_certs(&self) -> bool {
        true
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
        let resolver = lock(&self.current).as_ref()?.resolver.clone();
        resolver.resolve(root_hint_subjects, sigschemes)
    }

    fn has_certs(&self) -> bool {
        true
    }
}
