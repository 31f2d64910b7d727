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
