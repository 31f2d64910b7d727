//! The endpoints' serving certificate: from files (read again when they change, as a
//! Secret mounted in a pod is rotated) or made by the process at start (self-signed, for
//! scrapers that skip verification, as the kubelet's probes and most in-cluster Prometheus
//! setups do).

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use tokio::time::Instant;

use crate::util::sync::lock;
use crate::util::tls::certified;

/// How often the files are looked at (on a handshake) for a change.
const LOOK_EVERY: Duration = Duration::from_secs(1);

/// Where the serving certificate comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum TlsSource {
    /// Made at start: a key and a certificate for `localhost` and the pod's addresses,
    /// signed by itself.
    SelfSigned,
    /// PEM files: a certificate chain and its private key.
    Files { cert: PathBuf, key: PathBuf },
}

/// The certificate served, read again from its files when they change.
#[derive(Debug)]
pub(crate) struct Certificates {
    source: TlsSource,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    key: Arc<CertifiedKey>,
    /// The files' modification times and lengths when read.
    stamp: Option<Stamp>,
    looked: Instant,
}

type Stamp = [(SystemTime, u64); 2];

impl Certificates {
    /// Loads the certificate (or makes one); the error says which file is wrong and how,
    /// never a byte of the key.
    pub(crate) fn load(source: TlsSource) -> Result<Arc<Self>, String> {
        let (key, stamp) = match &source {
            TlsSource::SelfSigned => (self_signed()?, None),
            TlsSource::Files { cert, key } => {
                let stamp = stamp(cert, key);
                (from_files(cert, key)?, stamp)
            }
        };
        Ok(Arc::new(Self {
            source,
            state: Mutex::new(State {
                key,
                stamp,
                looked: Instant::now(),
            }),
        }))
    }

    /// The TLS settings of the server: HTTP/1.1, this certificate.
    pub(crate) fn server_config(self: &Arc<Self>) -> Result<Arc<rustls::ServerConfig>, String> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("TLS settings: {e}"))?
            .with_no_client_auth()
            .with_cert_resolver(self.clone());
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Arc::new(config))
    }

    /// The certificate now, read again if its files changed since they were last read.
    fn current(&self) -> Arc<CertifiedKey> {
        let mut state = lock(&self.state);
        if let TlsSource::Files { cert, key } = &self.source
            && state.looked.elapsed() >= LOOK_EVERY
        {
            state.looked = Instant::now();
            let now = stamp(cert, key);
            if now.is_some() && now != state.stamp {
                match from_files(cert, key) {
                    Ok(loaded) => {
                        tracing::info!(cert = %cert.display(), "endpoints: serving certificate read again");
                        state.key = loaded;
                        state.stamp = now;
                    }
                    // Half written, or wrong: the old one is served until the files are right.
                    Err(problem) => {
                        tracing::warn!(%problem, "endpoints: the new serving certificate cannot be used; serving the previous one");
                        state.stamp = now;
                    }
                }
            }
        }
        state.key.clone()
    }
}

impl ResolvesServerCert for Certificates {
    fn resolve(&self, _: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current())
    }
}

fn stamp(cert: &std::path::Path, key: &std::path::Path) -> Option<Stamp> {
    let one = |path: &std::path::Path| {
        let metadata = std::fs::metadata(path).ok()?;
        Some((metadata.modified().ok()?, metadata.len()))
    };
    Some([one(cert)?, one(key)?])
}

fn from_files(cert: &std::path::Path, key: &std::path::Path) -> Result<Arc<CertifiedKey>, String> {
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
        .map_err(|e| format!("{}: {}", cert.display(), describe_pem(&e)))?
        .collect::<Result<_, _>>()
        .map_err(|e| format!("{}: {}", cert.display(), describe_pem(&e)))?;
    if chain.is_empty() {
        return Err(format!("{}: no certificate", cert.display()));
    }
    let private = PrivateKeyDer::from_pem_file(key)
        .map_err(|e| format!("{}: {}", key.display(), describe_pem(&e)))?;
    certified(chain, private).map_err(|e| format!("{}: {e}", key.display()))
}

/// What is wrong with a PEM file, without its content.
fn describe_pem(error: &rustls::pki_types::pem::Error) -> String {
    use rustls::pki_types::pem::Error as E;
    match error {
        E::Io(e) => format!("cannot be read ({})", e.kind()),
        E::NoItemsFound => "no PEM item of the expected kind".into(),
        _ => "not valid PEM".into(),
    }
}

/// A key and a certificate for `localhost`, `127.0.0.1`, `::1` and the host's name, signed by
/// themselves, valid for a year.
fn self_signed() -> Result<Arc<CertifiedKey>, String> {
    let mut names = vec!["localhost".to_string(), "127.0.0.1".into(), "::1".into()];
    if let Ok(host) = std::env::var("HOSTNAME")
        && !host.is_empty()
    {
        names.push(host);
    }
    let rcgen::CertifiedKey { cert, signing_key } = rcgen::generate_simple_self_signed(names)
        .map_err(|e| format!("a self-signed certificate could not be made: {e}"))?;
    let private = PrivateKeyDer::try_from(signing_key.serialize_der())
        .map_err(|e| format!("a self-signed certificate could not be made: {e}"))?;
    certified(vec![cert.der().clone()], private)
}
