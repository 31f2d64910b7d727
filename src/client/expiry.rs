//! When a cluster's credential ends, where the crate can read it: a bearer token's `exp` (a
//! JWT's claim, read without checking its signature: only the server trusts it), a client
//! certificate's `notAfter`, an exec plugin's `expirationTimestamp`. Nothing here is ever
//! written anywhere but the instant itself.

use std::time::{Duration, SystemTime};

use base64::Engine as _;
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject as _;
use secrecy::ExposeSecret as _;

/// What a credential's end was read from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CredentialSource {
    /// A bearer token's `exp` claim (the kubeconfig's `token` or `tokenFile`).
    Token,
    /// The client certificate's `notAfter`.
    ClientCertificate,
    /// The exec plugin's `expirationTimestamp` (the credential it gave last).
    Exec,
    /// What the object holding the credential says of its end (the annotation
    /// `multicluster-runtime.sigs.k8s.io/token-expires` that `mcr join` writes), given by the
    /// provider with [`CredentialHolder::ends_at`].
    Annotation,
}

impl CredentialSource {
    /// The name used in the metric's `source` label and in logs.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Token => "token",
            Self::ClientCertificate => "client_certificate",
            Self::Exec => "exec",
            Self::Annotation => "annotation",
        }
    }
}

/// When a cluster's credential ends ([`Cluster::credential_expiry`](crate::Cluster::credential_expiry)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CredentialExpiry {
    /// The end.
    pub at: SystemTime,
    /// Where it was read.
    pub source: CredentialSource,
}

impl CredentialExpiry {
    /// How long until the end (zero once it has passed).
    pub fn remaining(&self) -> Duration {
        self.at
            .duration_since(SystemTime::now())
            .unwrap_or(Duration::ZERO)
    }

    /// The end in seconds since the Unix epoch.
    pub fn unix_seconds(&self) -> i64 {
        match self.at.duration_since(SystemTime::UNIX_EPOCH) {
            Ok(d) => i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
            Err(e) => -i64::try_from(e.duration().as_secs()).unwrap_or(i64::MAX),
        }
    }
}

/// Where a cluster's credential is kept, when it is kept in an object: a kubeconfig Secret of
/// a host cluster, say. A provider gives it with [`Cluster::with_credential_holder`]; the
/// manager then records its Warning Event `CredentialExpiring` on that object (through
/// `client`) when the credential comes within [`Manager::credential_warning`] of its end.
///
/// [`Cluster::with_credential_holder`]: crate::Cluster::with_credential_holder
/// [`Manager::credential_warning`]: crate::Manager::credential_warning
#[derive(Clone)]
pub struct CredentialHolder {
    pub(crate) client: kube::Client,
    pub(crate) object: k8s_openapi::api::core::v1::ObjectReference,
    pub(crate) end: Option<SystemTime>,
}

impl std::fmt::Debug for CredentialHolder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CredentialHolder")
            .field("object", &self.object)
            .field("end", &self.end)
            .finish_non_exhaustive()
    }
}

impl CredentialHolder {
    /// The credential is kept in `object`, of the cluster `client` reaches.
    pub fn new(client: kube::Client, object: k8s_openapi::api::core::v1::ObjectReference) -> Self {
        Self {
            client,
            object,
            end: None,
        }
    }

    /// The object states the credential's end (source [`CredentialSource::Annotation`]): it
    /// counts beside the ends read from the credential itself, the earliest first.
    #[must_use]
    pub fn ends_at(mut self, end: Option<SystemTime>) -> Self {
        self.end = end;
        self
    }
}

/// The earliest end of the static credentials of `config` (token, client certificate).
pub(crate) fn of_config(config: &kube::Config) -> Option<CredentialExpiry> {
    let auth = &config.auth_info;
    let token = auth
        .token
        .as_ref()
        .map(|t| t.expose_secret().to_string())
        .or_else(|| {
            auth.token_file
                .as_ref()
                .and_then(|f| std::fs::read_to_string(f).ok())
        })
        .and_then(|t| token_expiry(t.trim()))
        .map(|at| CredentialExpiry {
            at,
            source: CredentialSource::Token,
        });
    let pem = auth
        .client_certificate_data
        .as_ref()
        .and_then(|d| {
            base64::engine::general_purpose::STANDARD
                .decode(d.trim())
                .ok()
        })
        .or_else(|| {
            auth.client_certificate
                .as_ref()
                .and_then(|f| std::fs::read(f).ok())
        });
    let certificate = pem
        .and_then(|pem| certificate_expiry(&pem))
        .map(|at| CredentialExpiry {
            at,
            source: CredentialSource::ClientCertificate,
        });
    [token, certificate]
        .into_iter()
        .flatten()
        .min_by_key(|e| e.at)
}

/// The `exp` claim of a JWT (seconds since the epoch), unverified; `None` for a token that
/// is not a JWT or has no `exp`.
pub(crate) fn token_expiry(token: &str) -> Option<SystemTime> {
    let mut parts = token.split('.');
    let (_, payload, _) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() || payload.len() > 16 * 1024 {
        return None;
    }
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(payload.trim_end_matches('='))
        .ok()?;
    let claims: serde_json::Value = serde_json::from_slice(&bytes).ok()?;
    let exp = claims.get("exp")?.as_u64()?;
    SystemTime::UNIX_EPOCH.checked_add(Duration::from_secs(exp))
}

/// The `notAfter` of the first certificate of `pem`.
pub(crate) fn certificate_expiry(pem: &[u8]) -> Option<SystemTime> {
    let der = CertificateDer::pem_slice_iter(pem).next()?.ok()?;
    let (_, cert) = x509_parser::parse_x509_certificate(&der).ok()?;
    let secs = u64::try_from(cert.validity().not_after.timestamp()).ok()?;
    SystemTime::UNIX_EPOCH.checked_add(Duration::from_secs(secs))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn jwt(claims: serde_json::Value) -> String {
        let enc = |v: &serde_json::Value| {
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(v.to_string())
        };
        format!(
            "{}.{}.sig",
            enc(&serde_json::json!({"alg": "RS256"})),
            enc(&claims)
        )
    }

    #[test]
    fn a_tokens_exp_is_read_and_anything_else_is_none() {
        let at = token_expiry(&jwt(serde_json::json!({"exp": 2_000_000_000u64}))).unwrap();
        assert_eq!(
            at,
            SystemTime::UNIX_EPOCH + Duration::from_secs(2_000_000_000)
        );
        for token in [
            "not-a-jwt".to_string(),
            jwt(serde_json::json!({"sub": "x"})),
            jwt(serde_json::json!({"exp": "soon"})),
            "a.b.c.d".to_string(),
            "a.!!!.c".to_string(),
        ] {
            assert_eq!(token_expiry(&token), None, "{token}");
        }
    }

    #[test]
    fn a_certificates_not_after_is_read() {
        let mut params = rcgen::CertificateParams::new(vec!["x".to_string()]).unwrap();
        params.not_after = rcgen::date_time_ymd(2031, 1, 2);
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        let at = certificate_expiry(cert.pem().as_bytes()).unwrap();
        assert_eq!(
            at,
            SystemTime::UNIX_EPOCH + Duration::from_secs(1_925_078_400)
        );
        assert_eq!(certificate_expiry(b"no certificate"), None);
    }
}
