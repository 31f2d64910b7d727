//! A TLS identity (certificate chain and private key) checked and made ready to serve or
//! present.

use std::sync::Arc;

use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::sign::CertifiedKey;

/// The key of `chain`, loaded with the ring provider and checked to match its leaf
/// certificate. The error says what is wrong, never the key.
pub(crate) fn certified(
    chain: Vec<CertificateDer<'static>>,
    private: PrivateKeyDer<'static>,
) -> Result<Arc<CertifiedKey>, String> {
    let provider = rustls::crypto::ring::default_provider();
    let signing = provider
        .key_provider
        .load_private_key(private)
        .map_err(|_| "the private key is not one this TLS stack can use".to_string())?;
    let key = CertifiedKey::new(chain, signing);
    key.keys_match()
        .map_err(|_| "the private key does not match the certificate".to_string())?;
    Ok(Arc::new(key))
}
