//! The certificates and keys of one test cluster, generated in-process.
//!
//! Each cluster gets its own serving CA, client CA and service-account key, so a kubeconfig of
//! one cluster is of no use against another (as with real clusters).

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

/// The object identifier of the X.509 `O` (organization) attribute, where Kubernetes reads groups.
const ORGANIZATION_OID: &[u64] = &[2, 5, 4, 10];

/// A PEM certificate and its PEM (PKCS#8) private key.
#[derive(Clone)]
pub(crate) struct CertAndKey {
    pub(crate) cert_pem: String,
    pub(crate) key_pem: String,
}

/// The PKI of one test cluster.
pub(crate) struct ClusterPki {
    /// CA that signed the apiserver's serving certificate; clients trust it.
    pub(crate) serving_ca_pem: String,
    /// The apiserver's serving certificate (localhost, 127.0.0.1).
    pub(crate) serving: CertAndKey,
    /// CA whose certificates authenticate users (`--client-ca-file`).
    pub(crate) client_ca_pem: String,
    client_ca: Issuer<'static, KeyPair>,
    /// Service-account signing key (private key PEM) and its public key PEM.
    pub(crate) service_account_key_pem: String,
    pub(crate) service_account_pub_pem: String,
}

impl ClusterPki {
    /// Generates a fresh PKI for a cluster named `cluster`.
    pub(crate) fn generate(cluster: &str) -> Result<Self, rcgen::Error> {
        let (serving_ca_pem, serving_ca) = new_ca(&format!("{cluster} serving CA"))?;
        let (client_ca_pem, client_ca) = new_ca(&format!("{cluster} client CA"))?;

        let mut params =
            CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()])?;
        params
            .distinguished_name
            .push(DnType::CommonName, "localhost");
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &serving_ca)?;
        let serving = CertAndKey {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        };

        let sa_key = KeyPair::generate()?;
        Ok(Self {
            serving_ca_pem,
            serving,
            client_ca_pem,
            client_ca,
            service_account_key_pem: sa_key.serialize_pem(),
            service_account_pub_pem: sa_key.public_key_pem(),
        })
    }

    /// Issues a client certificate for `user` in `groups` (`CN=user`, one `O` per group).
    ///
    /// rcgen keeps one value per attribute type in a name, so the first group goes in the
    /// standard `O` attribute and the second in a custom attribute carrying the same object
    /// identifier; the apiserver reads both as groups. More than two groups cannot be encoded.
    /// With `valid_for`, the certificate expires that long from now (it was valid from a
    /// minute ago); without, it is rcgen's default (years).
    pub(crate) fn issue_client(
        &self,
        user: &str,
        groups: &[String],
        valid_for: Option<std::time::Duration>,
    ) -> Result<CertAndKey, rcgen::Error> {
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        if let Some(valid_for) = valid_for {
            let now = time::OffsetDateTime::now_utc();
            params.not_before = now - time::Duration::minutes(1);
            params.not_after = now + valid_for;
        }
        params.distinguished_name.push(DnType::CommonName, user);
        if let Some(first) = groups.first() {
            params
                .distinguished_name
                .push(DnType::OrganizationName, first.as_str());
        }
        if let Some(second) = groups.get(1) {
            params.distinguished_name.push(
                DnType::CustomDnType(ORGANIZATION_OID.to_vec()),
                second.as_str(),
            );
        }
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &self.client_ca)?;
        Ok(CertAndKey {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }
}

/// The most groups [`ClusterPki::issue_client`] can put in one certificate.
pub(crate) const MAX_GROUPS: usize = 2;

fn new_ca(common_name: &str) -> Result<(String, Issuer<'static, KeyPair>), rcgen::Error> {
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    params
        .distinguished_name
        .push(DnType::CommonName, common_name);
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let key = KeyPair::generate()?;
    let cert = params.self_signed(&key)?;
    Ok((cert.pem(), Issuer::new(params, key)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_certificates_carry_user_and_two_groups() {
        let pki = ClusterPki::generate("t").unwrap();
        let cert = pki
            .issue_client(
                "alice",
                &["readers".to_string(), "writers".to_string()],
                None,
            )
            .unwrap();
        let der = pem_body(&cert.cert_pem);
        // Both group names and the user name are encoded in the subject.
        for needle in ["alice", "readers", "writers"] {
            assert!(
                der.windows(needle.len()).any(|w| w == needle.as_bytes()),
                "{needle} missing from certificate"
            );
        }
        // The O attribute's OID (2.5.4.10 = 55 04 0a) appears once per group.
        let oid = [0x06, 0x03, 0x55, 0x04, 0x0a];
        assert_eq!(der.windows(oid.len()).filter(|w| *w == oid).count(), 2);
    }

    fn pem_body(pem: &str) -> Vec<u8> {
        use base64::Engine;
        let b64: String = pem.lines().filter(|l| !l.starts_with("-----")).collect();
        base64::engine::general_purpose::STANDARD
            .decode(b64)
            .unwrap()
    }
}

impl ClusterPki {
    /// Signs the JWT `claims` (ES256) with the service-account key, as the apiserver signs
    /// the tokens of its TokenRequests (no `kid`: the apiserver then tries every key it has).
    pub(crate) fn sign_service_account_jwt(
        &self,
        claims: &serde_json::Value,
    ) -> Result<String, rcgen::Error> {
        use base64::Engine as _;
        use rcgen::SigningKey as _;
        let b64 = |bytes: &[u8]| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes);
        let header = serde_json::json!({"alg": "ES256", "typ": "JWT"});
        let input = format!(
            "{}.{}",
            b64(header.to_string().as_bytes()),
            b64(claims.to_string().as_bytes())
        );
        let key = KeyPair::from_pem(&self.service_account_key_pem)?;
        let der = key.sign(input.as_bytes())?;
        let raw = ecdsa_der_to_raw(&der).ok_or(rcgen::Error::CouldNotParseKeyPair)?;
        Ok(format!("{input}.{}", b64(&raw)))
    }
}

/// An ECDSA P-256 signature as DER (`SEQUENCE { INTEGER r, INTEGER s }`) made the 64 bytes
/// `r || s` a JWT carries.
fn ecdsa_der_to_raw(der: &[u8]) -> Option<[u8; 64]> {
    let (&tag, rest) = der.split_first()?;
    if tag != 0x30 {
        return None;
    }
    let (&len, mut rest) = rest.split_first()?;
    if usize::from(len) != rest.len() {
        return None;
    }
    let mut raw = [0u8; 64];
    for half in raw.chunks_mut(32) {
        let (&tag, after) = rest.split_first()?;
        let (&len, after) = after.split_first()?;
        let len = usize::from(len);
        if tag != 0x02 || after.len() < len {
            return None;
        }
        let (int, after) = after.split_at(len);
        let int = match int {
            [0, tail @ ..] => tail,
            int => int,
        };
        if int.len() > 32 {
            return None;
        }
        half[32 - int.len()..].copy_from_slice(int);
        rest = after;
    }
    rest.is_empty().then_some(raw)
}

#[cfg(test)]
mod jwt_tests {
    use super::ecdsa_der_to_raw;

    #[test]
    fn der_signatures_become_r_and_s_padded_to_32_bytes() {
        // r = 0x00 0x80.. (a leading zero for the sign bit), s = 0x01 (short).
        let mut der = vec![0x30, 0x26, 0x02, 0x21, 0x00];
        der.extend([0x80; 32]);
        der.extend([0x02, 0x01, 0x01]);
        let raw = ecdsa_der_to_raw(&der).unwrap();
        assert_eq!(&raw[..32], &[0x80; 32]);
        assert_eq!(&raw[32..63], &[0; 31]);
        assert_eq!(raw[63], 1);
        assert_eq!(ecdsa_der_to_raw(&der[..der.len() - 1]), None);
    }
}
