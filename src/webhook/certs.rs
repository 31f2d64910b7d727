//! The webhook server's certificates and route key ([`Keeper`]): made by the crate and kept
//! in a host Secret (shared by every replica, kept across restarts, rotated before they
//! expire), or read from files; in both cases the route key lives in that Secret when there
//! is a host cluster.
//!
//! Rotation never leaves a member without the CA of the certificate being served: a new CA
//! is made (and added to the bundle installed everywhere) long before it signs anything,
//! and a CA that signed a certificate some replica may still serve stays in the bundle
//! until it expires.
//!
//! The route key turns over the same way, on its own schedule (`route_every`): a next key
//! is made half-way through the current one's turn and accepted by every replica from
//! then on, without making any URL; at the end of the turn it becomes the current key (the
//! installers give every member its new URLs), and the key it replaces is still accepted
//! until the next turn ends, for members that could not be given them yet.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, ObjectMeta, PostParams};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::route::{KEY_LEN, RouteKey};
use crate::util::sync::lock;

/// Where the serving certificate and the CA bundle come from.
#[derive(Clone, Debug)]
pub(crate) enum CertSource {
    Generated(Generated),
    Files {
        cert: std::path::PathBuf,
        key: std::path::PathBuf,
        ca: std::path::PathBuf,
    },
}

/// The settings of certificates the crate makes.
#[derive(Clone, Debug)]
pub(crate) struct Generated {
    pub(crate) ca_validity: Duration,
    pub(crate) serving_validity: Duration,
}

/// What the server serves now.
#[derive(Clone)]
pub(crate) struct Served {
    pub(crate) key: Arc<CertifiedKey>,
    pub(crate) route: RouteKey,
    /// The PEM CA bundle members are given (`caBundle`).
    pub(crate) bundle: Arc<str>,
}

/// What members are given, told to the installers when it changes: the CA bundle, and the
/// route key (by a fingerprint: the token of a fixed text).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Published {
    pub(crate) bundle: Arc<str>,
    route: String,
}

/// Keeps the certificates and route key current: [`Keeper::run`] reads (and makes, and
/// rotates) them every `check_every`; handshakes and routes read the current ones.
pub(crate) struct Keeper {
    source: CertSource,
    /// The Secret (`namespace`, `name`) on the host, if there is a host.
    secret: Option<(kube::Client, String, String)>,
    /// The names (DNS names, IP addresses) the serving certificate is for.
    names: Vec<String>,
    check_every: Duration,
    /// How long a route key makes the URLs (`None`: it never turns over).
    route_every: Option<Duration>,
    /// The route keys of [`CertSource::Files`] last read (served while the host is out of reach).
    route_cache: Mutex<Option<Material>>,
    served: Mutex<Option<Served>>,
    /// Without a host: what is served, made and rotated here.
    in_process: Mutex<Material>,
    /// With [`CertSource::Files`]: what is served, and the CAs on their way in or out.
    files: Mutex<Option<FilesState>>,
    bundle: watch::Sender<Option<Published>>,
    loaded: AtomicBool,
}

impl std::fmt::Debug for Keeper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Keeper")
            .field("source", &self.source)
            .field("names", &self.names)
            .finish_non_exhaustive()
    }
}

impl ResolvesServerCert for Keeper {
    fn resolve(&self, _: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        lock(&self.served).as_ref().map(|s| s.key.clone())
    }
}

/// What [`CertSource::Files`] serves, as the files change: a certificate from a CA already in
/// the bundle is served at once; one from a new CA (the issuer rotated its key) only once
/// that CA has been in the bundle for a grace period (the installers give it to every
/// member meanwhile), or when the certificate served would otherwise lapse; the CA it
/// replaces stays in the bundle for another grace period (replicas that have not switched
/// yet still serve its certificates).
#[derive(Clone, Debug)]
struct FilesState {
    cert: String,
    key: String,
    /// The CA of the served certificate, as read with it.
    ca: String,
    /// A new CA read from the files, and since when it is in the bundle.
    incoming: Option<(String, Instant)>,
    /// The CA replaced, and until when it stays in the bundle.
    retired: Option<(String, Instant)>,
}

impl FilesState {
    fn next(
        before: Option<Self>,
        (cert, key, ca): (String, String, String),
        now: Instant,
        unix_now: i64,
        grace: Duration,
        margin: i64,
    ) -> Self {
        let Some(mut state) = before else {
            return Self {
                cert,
                key,
                ca,
                incoming: None,
                retired: None,
            };
        };
        if state
            .retired
            .as_ref()
            .is_some_and(|(_, until)| *until <= now)
        {
            state.retired = None;
        }
        if state.ca == ca {
            // The same issuer: a renewed certificate is served at once.
            state.cert = cert;
            state.key = key;
            state.incoming = None;
            return state;
        }
        let since = match &state.incoming {
            Some((incoming, since)) if *incoming == ca => *since,
            _ => {
                state.incoming = Some((ca.clone(), now));
                now
            }
        };
        let lapsing =
            validity_of(&state.cert).is_none_or(|(_, until, _)| unix_now + margin >= until);
        if now.duration_since(since) >= grace || lapsing {
            state.retired = Some((std::mem::replace(&mut state.ca, ca), now + grace));
            state.cert = cert;
            state.key = key;
            state.incoming = None;
        }
        state
    }
}

/// The Secret's state record: validity of each part, in Unix seconds.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
struct Record {
    /// The generation of the current CA (its common name carries it).
    ca: Option<Period>,
    next: Option<Period>,
    /// Until when the previous CA stays in the bundle.
    previous_until: Option<i64>,
    serving: Option<ServingRecord>,
    /// When the current route key began making URLs, and the next one was made.
    route: Option<RouteRecord>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
struct RouteRecord {
    issued: i64,
    next: Option<i64>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
struct Period {
    generation: u64,
    issued: i64,
    expires: i64,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
struct ServingRecord {
    issued: i64,
    expires: i64,
    /// The generation of the CA that signed it.
    ca: u64,
    names: Vec<String>,
}

/// The Secret's content, parsed.
#[derive(Clone, Debug, Default, PartialEq)]
struct Material {
    route: Option<Vec<u8>>,
    /// Route keys accepted beside the current one: the next, the previous.
    route_next: Option<Vec<u8>>,
    route_previous: Option<Vec<u8>>,
    record: Record,
    ca: Option<(String, String)>,
    next: Option<(String, String)>,
    previous: Option<String>,
    serving: Option<(String, String)>,
}

const ROUTE: &str = "route.key";
const ROUTE_NEXT: &str = "route-next.key";
const ROUTE_PREVIOUS: &str = "route-previous.key";
const RECORD: &str = "state.json";
const CA: (&str, &str) = ("ca.crt", "ca.key");
const NEXT: (&str, &str) = ("next-ca.crt", "next-ca.key");
const PREVIOUS: &str = "previous-ca.crt";
const SERVING: (&str, &str) = ("tls.crt", "tls.key");

impl Material {
    fn of(secret: &Secret) -> Self {
        let data = secret.data.clone().unwrap_or_default();
        let text = |key: &str| {
            data.get(key)
                .and_then(|b| String::from_utf8(b.0.clone()).ok())
        };
        let pair = |(cert, key): (&str, &str)| Some((text(cert)?, text(key)?));
        let key = |name: &str| {
            data.get(name)
                .map(|b| b.0.clone())
                .filter(|r| r.len() == KEY_LEN)
        };
        Self {
            route: key(ROUTE),
            route_next: key(ROUTE_NEXT),
            route_previous: key(ROUTE_PREVIOUS),
            record: text(RECORD)
                .and_then(|r| serde_json::from_str(&r).ok())
                .unwrap_or_default(),
            ca: pair(CA),
            next: pair(NEXT),
            previous: text(PREVIOUS),
            serving: pair(SERVING),
        }
    }

    fn data(&self) -> BTreeMap<String, ByteString> {
        let mut data = BTreeMap::new();
        let mut put = |key: &str, value: &[u8]| {
            data.insert(key.to_string(), ByteString(value.to_vec()));
        };
        for (name, route) in [
            (ROUTE, &self.route),
            (ROUTE_NEXT, &self.route_next),
            (ROUTE_PREVIOUS, &self.route_previous),
        ] {
            if let Some(route) = route {
                put(name, route);
            }
        }
        put(
            RECORD,
            serde_json::to_string(&self.record)
                .unwrap_or_default()
                .as_bytes(),
        );
        for (names, pair) in [(CA, &self.ca), (NEXT, &self.next), (SERVING, &self.serving)] {
            if let Some((cert, key)) = pair {
                put(names.0, cert.as_bytes());
                put(names.1, key.as_bytes());
            }
        }
        if let Some(previous) = &self.previous {
            put(PREVIOUS, previous.as_bytes());
        }
        data
    }

    /// The bundle members trust: the current CA, the next one, the previous one.
    fn bundle(&self) -> String {
        let mut bundle = String::new();
        for cert in [
            self.ca.as_ref().map(|c| &c.0),
            self.next.as_ref().map(|c| &c.0),
            self.previous.as_ref(),
        ]
        .into_iter()
        .flatten()
        {
            bundle.push_str(cert);
            if !cert.ends_with('\n') {
                bundle.push('\n');
            }
        }
        bundle
    }
}

fn unix(t: SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

/// Whether `fraction` of `issued..expires` has passed at `now`.
fn past(issued: i64, expires: i64, now: i64, fraction: (i64, i64)) -> bool {
    let life = (expires - issued).max(1);
    (now - issued) * fraction.1 >= life * fraction.0
}

fn ca_params(generation: u64) -> Result<rcgen::CertificateParams, String> {
    let mut params =
        rcgen::CertificateParams::new(Vec::<String>::new()).map_err(|e| e.to_string())?;
    params.distinguished_name = rcgen::DistinguishedName::new();
    params.distinguished_name.push(
        rcgen::DnType::CommonName,
        format!("multicluster-runtime webhook CA {generation}"),
    );
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    params.key_usages = vec![
        rcgen::KeyUsagePurpose::KeyCertSign,
        rcgen::KeyUsagePurpose::CrlSign,
        rcgen::KeyUsagePurpose::DigitalSignature,
    ];
    Ok(params)
}

fn offset(t: i64) -> Result<time::OffsetDateTime, String> {
    time::OffsetDateTime::from_unix_timestamp(t).map_err(|e| e.to_string())
}

/// A new CA of `generation`, valid from a little before `now` (clocks differ) for `validity`.
fn new_ca(
    generation: u64,
    now: i64,
    validity: Duration,
) -> Result<(Period, (String, String)), String> {
    let mut params = ca_params(generation)?;
    let expires = now.saturating_add(i64::try_from(validity.as_secs()).unwrap_or(i64::MAX / 2));
    params.not_before = offset(now - 300)?;
    params.not_after = offset(expires)?;
    let key = rcgen::KeyPair::generate().map_err(|e| e.to_string())?;
    let cert = params.self_signed(&key).map_err(|e| e.to_string())?;
    Ok((
        Period {
            generation,
            issued: now,
            expires,
        },
        (cert.pem(), key.serialize_pem()),
    ))
}

/// A serving certificate for `names`, signed by the CA (`pem`, `generation`), never valid
/// past the CA.
fn new_serving(
    ca: &(String, String),
    period: &Period,
    names: &[String],
    now: i64,
    validity: Duration,
) -> Result<(ServingRecord, (String, String)), String> {
    let ca_key = rcgen::KeyPair::from_pem(&ca.1).map_err(|e| e.to_string())?;
    let issuer = rcgen::Issuer::new(ca_params(period.generation)?, ca_key);
    let mut params = rcgen::CertificateParams::new(names.to_vec()).map_err(|e| e.to_string())?;
    params.distinguished_name = rcgen::DistinguishedName::new();
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "multicluster-runtime webhook");
    params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
    params.use_authority_key_identifier_extension = true;
    let expires = now
        .saturating_add(i64::try_from(validity.as_secs()).unwrap_or(i64::MAX / 2))
        .min(period.expires);
    params.not_before = offset(now - 300)?;
    params.not_after = offset(expires)?;
    let key = rcgen::KeyPair::generate().map_err(|e| e.to_string())?;
    let cert = params.signed_by(&key, &issuer).map_err(|e| e.to_string())?;
    Ok((
        ServingRecord {
            issued: now,
            expires,
            ca: period.generation,
            names: names.to_vec(),
        },
        (cert.pem(), key.serialize_pem()),
    ))
}

/// The validity (Unix seconds) of the first certificate in `pem`, and the generation its
/// common name gives, if it is one of the crate's CAs.
fn validity_of(pem: &str) -> Option<(i64, i64, Option<u64>)> {
    let der = CertificateDer::pem_slice_iter(pem.as_bytes())
        .next()?
        .ok()?;
    let (_, cert) = x509_parser::parse_x509_certificate(&der).ok()?;
    let validity = cert.validity();
    let generation = cert
        .subject()
        .iter_common_name()
        .next()
        .and_then(|cn| cn.as_str().ok())
        .and_then(|cn| cn.strip_prefix("multicluster-runtime webhook CA "))
        .and_then(|g| g.parse().ok());
    Some((
        validity.not_before.timestamp(),
        validity.not_after.timestamp(),
        generation,
    ))
}

/// Fills in, from the certificates themselves, the periods a record lacks (its
/// `state.json` unreadable: edited by another tool, or of another shape): a CA in the
/// Secret is never replaced, nor dropped from the bundle, for want of its record.
fn restore(material: &mut Material) {
    // `new_ca` dates a CA from five minutes before it was made.
    let period = |pem: &str, fallback: u64| {
        validity_of(pem).map(|(from, until, generation)| Period {
            generation: generation.unwrap_or(fallback),
            issued: from + 300,
            expires: until,
        })
    };
    if material.record.ca.is_none()
        && let Some((cert, _)) = &material.ca
    {
        material.record.ca = period(cert, 1);
    }
    if material.record.next.is_none()
        && let Some((cert, _)) = &material.next
    {
        let after = material.record.ca.as_ref().map_or(1, |p| p.generation) + 1;
        material.record.next = period(cert, after);
    }
    if material.record.previous_until.is_none()
        && let Some(previous) = &material.previous
    {
        material.record.previous_until = validity_of(previous).map(|(_, until, _)| until);
    }
}

/// What the Secret should hold at `now`, if not what it holds: what is missing made, a next
/// CA made at two thirds of the current one's life, promoted at five sixths (the previous
/// staying in the bundle until it expires), the serving certificate made again at two
/// thirds of its life, when its CA changed or when its names did. Nothing is left to
/// expire before the check after next (`margin`, twice the check period): a CA about to
/// expire is replaced by the next one that far ahead, and a serving certificate renewed.
fn plan(
    material: &Material,
    now: i64,
    names: &[String],
    settings: &Generated,
    route_every: Option<Duration>,
    margin: i64,
) -> Result<Option<Material>, String> {
    let mut next = material.clone();
    restore(&mut next);
    plan_route(&mut next, now, route_every)?;
    let usable_ca = |pair: &Option<(String, String)>, period: &Option<Period>| {
        pair.is_some() && period.as_ref().is_some_and(|p| p.expires > now)
    };
    if !usable_ca(&next.ca, &next.record.ca) {
        // Nothing usable: start again (a next CA, if usable, takes its place).
        if usable_ca(&next.next, &next.record.next) {
            next.ca = next.next.take();
            next.record.ca = next.record.next.take();
        } else {
            let generation = next.record.ca.as_ref().map_or(1, |p| p.generation + 1);
            let (period, pair) = new_ca(generation, now, settings.ca_validity)?;
            next.ca = Some(pair);
            next.record.ca = Some(period);
            next.next = None;
            next.record.next = None;
        }
    }
    let current = next.record.ca.clone().ok_or("no CA")?;
    if next.next.is_none() || next.record.next.is_none() {
        next.next = None;
        next.record.next = None;
        if past(current.issued, current.expires, now, (2, 3)) {
            let (period, pair) = new_ca(current.generation + 1, now, settings.ca_validity)?;
            next.next = Some(pair);
            next.record.next = Some(period);
        }
    } else if (past(current.issued, current.expires, now, (5, 6))
        && next
            .record
            .next
            .as_ref()
            .is_some_and(|n| now - n.issued >= (current.expires - current.issued) / 6))
        // About to expire: the certificates it signed would lapse before the next check.
        || now + margin >= current.expires
    {
        // Promoted once the next CA has been in the bundle for a sixth of a CA's life at
        // least (installers have had that long to give it to every member), even if no
        // replica could look at the Secret between two thirds and five sixths.
        next.previous = next.ca.take().map(|(cert, _)| cert);
        next.record.previous_until = Some(current.expires);
        next.ca = next.next.take();
        next.record.ca = next.record.next.take();
    }
    if next.record.previous_until.is_none_or(|until| until <= now) {
        next.previous = None;
        next.record.previous_until = None;
    }
    let ca_period = next.record.ca.clone().ok_or("no CA")?;
    let renew = match (&next.serving, &next.record.serving) {
        (Some(_), Some(serving)) => {
            serving.ca != ca_period.generation
                || serving.names != names
                || past(serving.issued, serving.expires, now, (2, 3))
                || now + margin >= serving.expires
        }
        _ => true,
    };
    if renew {
        let ca = next.ca.as_ref().ok_or("no CA")?;
        let (record, pair) = new_serving(ca, &ca_period, names, now, settings.serving_validity)?;
        next.serving = Some(pair);
        next.record.serving = Some(record);
    }
    Ok((next != *material).then_some(next))
}

/// The route keys `material` should hold at `now`: one made if there is none; with
/// `every`, a next one made half-way through the current key's turn, and promoted at its
/// end once it has been accepted for half a turn at least (the previous one accepted until
/// the next promotion).
fn plan_route(material: &mut Material, now: i64, every: Option<Duration>) -> Result<(), String> {
    if material.route.is_none() {
        material.route = Some(random_key()?);
        material.route_next = None;
        material.route_previous = None;
        material.record.route = None;
    }
    let Some(every) = every else {
        // No turns: the current key alone (the others of an earlier turn accepted no more),
        // and nothing written for a key that has no record.
        material.route_next = None;
        material.route_previous = None;
        return Ok(());
    };
    // A key without a record (kept by an earlier version) begins its turn now.
    let record = material.record.route.get_or_insert(RouteRecord {
        issued: now,
        next: None,
    });
    let turn = i64::try_from(every.as_secs())
        .unwrap_or(i64::MAX / 2)
        .max(1);
    match (&material.route_next, record.next) {
        (Some(_), Some(made)) if now - record.issued >= turn && now - made >= turn / 2 => {
            material.route_previous = material.route.take();
            material.route = material.route_next.take();
            *record = RouteRecord {
                issued: now,
                next: None,
            };
        }
        (Some(_), Some(_)) => {}
        _ => {
            material.route_next = None;
            record.next = None;
            if now - record.issued >= turn / 2 {
                material.route_next = Some(random_key()?);
                record.next = Some(now);
            }
        }
    }
    Ok(())
}

fn random_key() -> Result<Vec<u8>, String> {
    use ring::rand::SecureRandom;
    let mut key = vec![0; KEY_LEN];
    ring::rand::SystemRandom::new()
        .fill(&mut key)
        .map_err(|_| "no random numbers".to_string())?;
    Ok(key)
}

fn certified(cert: &str, key: &str) -> Result<Arc<CertifiedKey>, String> {
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert.as_bytes())
        .collect::<Result<_, _>>()
        .map_err(|_| "the certificate is not valid PEM".to_string())?;
    if chain.is_empty() {
        return Err("no certificate".into());
    }
    let private = PrivateKeyDer::from_pem_slice(key.as_bytes())
        .map_err(|_| "the key is not valid PEM".to_string())?;
    crate::util::tls::certified(chain, private)
}

impl Keeper {
    pub(crate) fn new(
        source: CertSource,
        secret: Option<(kube::Client, String, String)>,
        names: Vec<String>,
        check_every: Duration,
        route_every: Option<Duration>,
    ) -> Arc<Self> {
        Arc::new(Self {
            source,
            secret,
            names,
            check_every,
            route_every,
            route_cache: Mutex::new(None),
            served: Mutex::new(None),
            in_process: Mutex::new(Material::default()),
            files: Mutex::new(None),
            bundle: watch::Sender::new(None),
            loaded: AtomicBool::new(false),
        })
    }

    /// What is served now (`None` until the first load).
    pub(crate) fn served(&self) -> Option<Served> {
        lock(&self.served).clone()
    }

    /// The CA bundle and route key, told when either changes (`None` until the first load).
    pub(crate) fn bundle(&self) -> watch::Receiver<Option<Published>> {
        self.bundle.subscribe()
    }

    pub(crate) fn is_loaded(&self) -> bool {
        self.loaded.load(Ordering::Relaxed)
    }

    /// Loads, makes and rotates until `stop`: every `check_every`, and again soon after a
    /// failure (a WARN line names the Secret and the reason).
    pub(crate) async fn run(self: Arc<Self>, stop: CancellationToken) {
        let mut failures = 0u32;
        let mut warned = false;
        loop {
            let wait = match self.refresh().await {
                Ok(()) => {
                    failures = 0;
                    warned = false;
                    self.check_every
                }
                Err(problem) => {
                    failures = failures.saturating_add(1);
                    if !warned || failures.is_multiple_of(30) {
                        tracing::warn!(%problem, "webhooks: the serving certificate could not be loaded or rotated; trying again");
                        warned = true;
                    }
                    self.check_every
                        .min(Duration::from_millis(200) * failures.min(25))
                }
            };
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(wait) => {}
            }
        }
    }

    /// One round: read what there is, write what changed, serve it.
    async fn refresh(&self) -> Result<(), String> {
        match &self.source {
            CertSource::Generated(settings) => {
                let material = self
                    .planned(|material, now| {
                        let margin = i64::try_from(self.check_every.as_secs().saturating_mul(2))
                            .unwrap_or(i64::MAX / 4);
                        plan(
                            material,
                            now,
                            &self.names,
                            settings,
                            self.route_every,
                            margin,
                        )
                    })
                    .await?;
                self.install(&material)
            }
            CertSource::Files { cert, key, ca } => {
                let routes = self.route_keys().await?;
                let read = |path: &std::path::Path| {
                    std::fs::read_to_string(path)
                        .map_err(|e| format!("{}: cannot be read ({})", path.display(), e.kind()))
                };
                let (cert_pem, key_pem, ca_pem) = (read(cert)?, read(key)?, read(ca)?);
                // Checked before anything changes: a pair that does not load is not served.
                certified(&cert_pem, &key_pem)
                    .map_err(|e| format!("{} and {}: {e}", cert.display(), key.display()))?;
                let grace = self
                    .check_every
                    .saturating_mul(3)
                    .max(Duration::from_secs(10));
                let margin = i64::try_from(self.check_every.as_secs().saturating_mul(2))
                    .unwrap_or(i64::MAX / 4);
                let state = {
                    let mut files = lock(&self.files);
                    let state = FilesState::next(
                        files.take(),
                        (cert_pem, key_pem, ca_pem),
                        Instant::now(),
                        unix(SystemTime::now()),
                        grace,
                        margin,
                    );
                    *files = Some(state.clone());
                    state
                };
                let material = Material {
                    ca: Some((state.ca, String::new())),
                    next: state.incoming.map(|(ca, _)| (ca, String::new())),
                    previous: state.retired.map(|(ca, _)| ca),
                    serving: Some((state.cert, state.key)),
                    ..routes
                };
                self.install(&material)
                    .map_err(|e| format!("{} and {}: {e}", cert.display(), key.display()))
            }
        }
    }

    async fn write(
        &self,
        api: &Api<Secret>,
        name: &str,
        existing: Option<Secret>,
        material: &Material,
    ) -> Result<(), kube::Error> {
        let mut secret = existing.unwrap_or_else(|| Secret {
            metadata: ObjectMeta {
                name: Some(name.to_string()),
                labels: Some(BTreeMap::from([(
                    "app.kubernetes.io/managed-by".to_string(),
                    "multicluster-runtime".to_string(),
                )])),
                ..ObjectMeta::default()
            },
            type_: Some("Opaque".into()),
            ..Secret::default()
        });
        secret.data = Some(material.data());
        secret.string_data = None;
        if secret.metadata.resource_version.is_some() {
            api.replace(name, &PostParams::default(), &secret).await?;
        } else {
            api.create(&PostParams::default(), &secret).await?;
        }
        Ok(())
    }

    /// The route keys kept in the host Secret, or the last ones read while the host is out
    /// of reach (so that certificates changed on disk are served all the same).
    async fn route_keys(&self) -> Result<Material, String> {
        match self.read_route_keys().await {
            Ok(keys) => {
                *lock(&self.route_cache) = Some(keys.clone());
                Ok(keys)
            }
            Err(problem) => {
                let last = lock(&self.route_cache).clone();
                match last {
                    Some(keys) => {
                        tracing::debug!(%problem, "webhooks: the route keys last read are served");
                        Ok(keys)
                    }
                    None => Err(problem),
                }
            }
        }
    }

    /// The route keys kept in the host Secret (made, and turned over, as `plan_route` says),
    /// or this process's: a [`Material`] holding them and nothing else.
    async fn read_route_keys(&self) -> Result<Material, String> {
        let material = self
            .planned(|material, now| {
                let mut planned = material.clone();
                plan_route(&mut planned, now, self.route_every)?;
                Ok((planned != *material).then_some(planned))
            })
            .await?;
        Ok(Material {
            route: material.route,
            route_next: material.route_next,
            route_previous: material.route_previous,
            ..Material::default()
        })
    }

    /// What the host Secret holds once `plan` (what it should hold at a time, if not what it
    /// holds) has been applied: read, planned, written if changed, read again when another
    /// replica wrote first. Without a host, this process's material, planned the same way.
    async fn planned(
        &self,
        plan: impl Fn(&Material, i64) -> Result<Option<Material>, String>,
    ) -> Result<Material, String> {
        let Some((client, namespace, name)) = &self.secret else {
            let mut kept = lock(&self.in_process);
            if let Some(planned) = plan(&kept, unix(SystemTime::now()))? {
                *kept = planned;
            }
            return Ok(kept.clone());
        };
        let api: Api<Secret> = Api::namespaced(client.clone(), namespace);
        let what = format!("Secret {namespace}/{name} on the host");
        for _ in 0..3 {
            let existing = api
                .get_opt(name)
                .await
                .map_err(|e| format!("{what}: {}", crate::client::redact::safe_text(&e)))?;
            let material = existing.as_ref().map(Material::of).unwrap_or_default();
            let Some(planned) = plan(&material, unix(SystemTime::now()))? else {
                return Ok(material);
            };
            match self.write(&api, name, existing, &planned).await {
                Ok(()) => {
                    tracing::info!(secret = %format!("{namespace}/{name}"), "webhooks: certificates or route keys written");
                    return Ok(planned);
                }
                // Another replica wrote first: read again.
                Err(kube::Error::Api(status)) if status.code == 409 => continue,
                Err(e) => {
                    return Err(format!("{what}: {}", crate::client::redact::safe_text(&e)));
                }
            }
        }
        Err(format!("{what}: written by others meanwhile, three times"))
    }

    /// Serves `material`: its serving certificate, its route key, its bundle (members told
    /// when the bundle changed).
    fn install(&self, material: &Material) -> Result<(), String> {
        let (cert, key) = material.serving.as_ref().ok_or("no serving certificate")?;
        let key = certified(cert, key)?;
        let route = material.route.as_ref().ok_or("no route key")?;
        let bundle: Arc<str> = Arc::from(material.bundle());
        let accepted = [&material.route_next, &material.route_previous];
        let route =
            RouteKey::with_accepted(route, accepted.into_iter().flatten().map(Vec::as_slice));
        let published = Published {
            bundle: bundle.clone(),
            route: route.token(super::route::Side::Fleet, "\0fingerprint"),
        };
        *lock(&self.served) = Some(Served { key, route, bundle });
        self.loaded.store(true, Ordering::Relaxed);
        self.bundle.send_if_modified(|current| {
            if current.as_ref() == Some(&published) {
                false
            } else {
                *current = Some(published);
                true
            }
        });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_route_key_turns_over_with_an_overlap_on_both_sides() {
        let day = Some(Duration::from_secs(600));
        let mut m = Material::default();
        plan_route(&mut m, 1000, day).unwrap();
        let first = m.route.clone().unwrap();
        assert_eq!(
            (m.route_next.as_ref(), m.route_previous.as_ref()),
            (None, None)
        );
        // Before half a turn: nothing changes.
        let before = m.clone();
        plan_route(&mut m, 1299, day).unwrap();
        assert_eq!(m, before);
        // Half a turn: a next key, accepted, not yet making URLs.
        plan_route(&mut m, 1300, day).unwrap();
        let next = m.route_next.clone().unwrap();
        assert_eq!(m.route.as_ref(), Some(&first));
        // The turn's end: the next key makes URLs, the first is still accepted.
        plan_route(&mut m, 1600, day).unwrap();
        assert_eq!(m.route.as_ref(), Some(&next));
        assert_eq!(m.route_previous.as_ref(), Some(&first));
        assert_eq!(m.route_next, None);
        // Half of the next turn: a third key; at its end the first is accepted no more.
        plan_route(&mut m, 1900, day).unwrap();
        let third = m.route_next.clone().unwrap();
        plan_route(&mut m, 2200, day).unwrap();
        assert_eq!(m.route.as_ref(), Some(&third));
        assert_eq!(m.route_previous.as_ref(), Some(&next));
        assert!(![&m.route, &m.route_next, &m.route_previous].contains(&&Some(first)));
    }

    #[test]
    fn a_next_route_key_seen_late_is_accepted_for_half_a_turn_before_it_makes_urls() {
        let day = Some(Duration::from_secs(600));
        let mut m = Material::default();
        plan_route(&mut m, 0, day).unwrap();
        // Nobody looked at the Secret for a whole turn: the next key is made now, and
        // promoted only half a turn later.
        plan_route(&mut m, 900, day).unwrap();
        let next = m.route_next.clone().unwrap();
        plan_route(&mut m, 1199, day).unwrap();
        assert_eq!(m.route_next.as_ref(), Some(&next));
        plan_route(&mut m, 1200, day).unwrap();
        assert_eq!(m.route.as_ref(), Some(&next));
    }

    #[test]
    fn without_a_turn_or_with_a_key_of_an_earlier_version_the_key_stays() {
        let mut m = Material {
            route: Some(vec![5; KEY_LEN]),
            ..Material::default()
        };
        let kept = m.clone();
        plan_route(&mut m, 50, None).unwrap();
        plan_route(&mut m, 5_000_000, None).unwrap();
        assert_eq!(
            m, kept,
            "nothing to write: a Secret readable only stays as it is"
        );
        // Turns switched off: the keys of the last turn are accepted no more.
        m.route_previous = Some(vec![6; KEY_LEN]);
        m.route_next = Some(vec![7; KEY_LEN]);
        plan_route(&mut m, 5_000_001, None).unwrap();
        assert_eq!(m, kept);
        // With a turn, the key kept by an earlier version (no record) begins its turn when
        // first seen.
        let mut m = Material {
            route: Some(vec![5; KEY_LEN]),
            ..Material::default()
        };
        plan_route(&mut m, 100, Some(Duration::from_secs(600))).unwrap();
        assert_eq!(m.record.route.as_ref().map(|r| r.issued), Some(100));
        plan_route(&mut m, 399, Some(Duration::from_secs(600))).unwrap();
        assert_eq!(m.route_next, None);
    }

    fn settings() -> Generated {
        Generated {
            ca_validity: Duration::from_secs(600),
            serving_validity: Duration::from_secs(300),
        }
    }

    fn names() -> Vec<String> {
        vec!["127.0.0.1".into(), "localhost".into()]
    }

    /// The CAs in a bundle, by generation.
    fn generations(material: &Material) -> Vec<u64> {
        let r = &material.record;
        let mut out: Vec<u64> = [r.ca.as_ref(), r.next.as_ref()]
            .into_iter()
            .flatten()
            .map(|p| p.generation)
            .collect();
        if material.previous.is_some() {
            out.push(0);
        }
        out
    }

    #[test]
    fn rotation_adds_a_ca_to_the_bundle_before_it_signs_and_keeps_the_old_one_until_it_expires() {
        let t0 = 1_000_000;
        let first = plan(&Material::default(), t0, &names(), &settings(), None, 0)
            .unwrap()
            .unwrap();
        assert!(first.route.is_some() && first.serving.is_some());
        assert_eq!(generations(&first), vec![1]);
        certified(
            &first.serving.as_ref().unwrap().0,
            &first.serving.as_ref().unwrap().1,
        )
        .unwrap();
        // Nothing to do soon after.
        assert_eq!(
            plan(&first, t0 + 10, &names(), &settings(), None, 0).unwrap(),
            None
        );
        // Two thirds of the CA's life: a next CA in the bundle, the serving certificate still
        // the first CA's (renewed at two thirds of its own life, by the same CA).
        let second = plan(&first, t0 + 400, &names(), &settings(), None, 0)
            .unwrap()
            .unwrap();
        assert_eq!(generations(&second), vec![1, 2]);
        assert_eq!(second.record.serving.as_ref().unwrap().ca, 1);
        assert_eq!(second.route, first.route);
        // Five sixths: the next CA signs; the first stays in the bundle until it expires.
        let third = plan(&second, t0 + 500, &names(), &settings(), None, 0)
            .unwrap()
            .unwrap();
        assert_eq!(generations(&third), vec![2, 0]);
        assert_eq!(third.record.serving.as_ref().unwrap().ca, 2);
        assert_eq!(
            third.previous.as_deref(),
            Some(first.ca.as_ref().unwrap().0.as_str())
        );
        assert!(third.bundle().contains(&first.ca.as_ref().unwrap().0));
        // Nobody looked between two thirds and five sixths: the next CA made at five sixths
        // does not sign before it has been in the bundle a sixth of a CA's life.
        let late = plan(&first, t0 + 500, &names(), &settings(), None, 0)
            .unwrap()
            .unwrap();
        assert_eq!(generations(&late), vec![1, 2]);
        assert_eq!(
            plan(&late, t0 + 560, &names(), &settings(), None, 0).unwrap(),
            None
        );
        let waiting = plan(&late, t0 + 590, &names(), &settings(), None, 0)
            .unwrap()
            .unwrap();
        assert_eq!(waiting.record.serving.as_ref().unwrap().ca, 1);
        let promoted = plan(&waiting, t0 + 600, &names(), &settings(), None, 0)
            .unwrap()
            .unwrap();
        assert_eq!(promoted.record.serving.as_ref().unwrap().ca, 2);
        // Expired: gone from the bundle.
        let fourth = plan(&third, t0 + 601, &names(), &settings(), None, 0)
            .unwrap()
            .unwrap();
        assert_eq!(generations(&fourth), vec![2]);
        // Other names: a new serving certificate, same CA.
        let renamed = plan(
            &fourth,
            t0 + 602,
            &["example.com".to_string()],
            &settings(),
            None,
            0,
        )
        .unwrap()
        .unwrap();
        assert_eq!(
            renamed.record.serving.as_ref().unwrap().names,
            ["example.com"]
        );
        assert_eq!(renamed.ca, fourth.ca);
    }

    #[test]
    fn a_record_lost_or_edited_keeps_the_cas_of_the_secret_in_the_bundle() {
        let t0 = 1_000_000;
        let plan_at = |m: &Material, t: i64| {
            plan(m, t, &names(), &settings(), None, 0)
                .unwrap()
                .unwrap_or_else(|| m.clone())
        };
        let first = plan_at(&Material::default(), t0);
        let second = plan_at(&first, t0 + 400);
        let third = plan_at(&second, t0 + 500);
        assert_eq!(generations(&third), vec![2, 0]);
        // `state.json` unreadable (another tool's edit, another shape): the record is
        // rebuilt from the certificates, and no CA is made in their place.
        for (material, at) in [(&first, t0 + 10), (&second, t0 + 410), (&third, t0 + 510)] {
            let mut lost = material.clone();
            lost.record = Record {
                route: lost.record.route.clone(),
                ..Record::default()
            };
            let again = plan_at(&lost, at);
            assert_eq!(again.ca, material.ca, "the CA kept");
            assert_eq!(again.next, material.next, "the next CA kept");
            assert_eq!(again.previous, material.previous, "the previous CA kept");
            assert_eq!(generations(&again), generations(material));
            assert_eq!(again.record.ca, material.record.ca, "its period read back");
            for (cert, _) in [&material.ca, &material.next].into_iter().flatten() {
                assert!(again.bundle().contains(cert.as_str()));
            }
        }
        // The previous CA's end read back from it: dropped when it expires, not before.
        let mut lost = third.clone();
        lost.record.previous_until = None;
        assert!(plan_at(&lost, t0 + 590).previous.is_some());
        assert!(plan_at(&lost, t0 + 601).previous.is_none());
    }

    #[test]
    fn nothing_served_lapses_before_the_check_after_next() {
        let t0 = 1_000_000;
        let first = plan(&Material::default(), t0, &names(), &settings(), None, 0)
            .unwrap()
            .unwrap();
        // The serving certificate (300 s) within a margin of 20 s of its end: renewed now,
        // not at the first check past its end.
        assert_eq!(
            plan(&first, t0 + 285, &names(), &settings(), None, 0)
                .unwrap()
                .map(|m| m.record.serving.unwrap().issued),
            Some(t0 + 285),
            "two thirds passed anyway"
        );
        // Nobody looked between two thirds and five sixths of the CA's life (600 s): the
        // next CA is made at five sixths, and without a margin it signs only once the first
        // has expired, after serving certificates capped at that instant have lapsed.
        let late = plan(&first, t0 + 500, &names(), &settings(), None, 0)
            .unwrap()
            .unwrap();
        let waiting = plan(&late, t0 + 585, &names(), &settings(), None, 0)
            .unwrap()
            .unwrap_or(late.clone());
        assert_eq!(waiting.record.serving.as_ref().unwrap().ca, 1);
        assert!(waiting.record.serving.as_ref().unwrap().expires <= t0 + 600);
        // With a margin of two checks (20 s), the next CA signs before the first expires.
        let promoted = plan(&late, t0 + 585, &names(), &settings(), None, 20)
            .unwrap()
            .unwrap();
        let serving = promoted.record.serving.as_ref().unwrap();
        assert_eq!(serving.ca, 2);
        assert!(serving.expires > t0 + 600 + 20, "{serving:?}");
        assert!(promoted.bundle().contains(&first.ca.as_ref().unwrap().0));
    }

    #[tokio::test]
    async fn certificate_files_are_read_again_when_they_change() {
        let dir = tempfile::tempdir().unwrap();
        let dir = dir.path();
        let (cert, key, ca) = (dir.join("tls.crt"), dir.join("tls.key"), dir.join("ca.crt"));
        let write = |material: &Material| {
            let (c, k) = material.serving.clone().unwrap();
            std::fs::write(&cert, c).unwrap();
            std::fs::write(&key, k).unwrap();
            std::fs::write(&ca, material.bundle()).unwrap();
        };
        let now = unix(SystemTime::now());
        let first = plan(&Material::default(), now, &names(), &settings(), None, 0)
            .unwrap()
            .unwrap();
        write(&first);
        let keeper = Keeper::new(
            CertSource::Files {
                cert: cert.clone(),
                key: key.clone(),
                ca: ca.clone(),
            },
            None,
            names(),
            Duration::from_secs(1),
            None,
        );
        let mut published = keeper.bundle();
        keeper.refresh().await.unwrap();
        let served = keeper.served().unwrap();
        assert_eq!(&*served.bundle, first.bundle().as_str());
        assert!(published.has_changed().unwrap());
        published.borrow_and_update();
        // Renewed by the same CA (as a mounted Secret is): served at once.
        let renewed = plan(&first, now + 250, &names(), &settings(), None, 0)
            .unwrap()
            .unwrap();
        assert_eq!(renewed.ca, first.ca);
        write(&renewed);
        keeper.refresh().await.unwrap();
        let again = keeper.served().unwrap();
        assert_ne!(
            again.key.cert, served.key.cert,
            "the renewed certificate served"
        );
        assert_eq!(&*again.bundle, first.bundle().as_str());
        assert_eq!(
            again.route.token(crate::webhook::route::Side::Fleet, "x"),
            served.route.token(crate::webhook::route::Side::Fleet, "x")
        );
        // A new CA (the issuer's key rotated): published beside the old one at once, its
        // certificate not served yet (members have not been given it).
        let rotated = plan(&Material::default(), now, &names(), &settings(), None, 0)
            .unwrap()
            .unwrap();
        write(&rotated);
        keeper.refresh().await.unwrap();
        let during = keeper.served().unwrap();
        assert_eq!(
            during.key.cert, again.key.cert,
            "the new CA's certificate served at once"
        );
        let (old_ca, new_ca) = (
            &first.ca.as_ref().unwrap().0,
            &rotated.ca.as_ref().unwrap().0,
        );
        assert!(during.bundle.contains(old_ca.as_str()) && during.bundle.contains(new_ca.as_str()));
        assert!(published.has_changed().unwrap());
        // Half written: the previous pair is kept, and the error names the file.
        std::fs::write(&key, "not a key").unwrap();
        let problem = keeper.refresh().await.unwrap_err();
        assert!(problem.contains("tls.key"), "{problem}");
        assert_eq!(keeper.served().unwrap().key.cert, again.key.cert);
    }

    #[test]
    fn a_certificate_of_a_new_ca_is_served_after_a_grace_and_the_old_ca_kept_as_long_again() {
        let now = unix(SystemTime::now());
        let pair = |m: &Material| {
            let (cert, key) = m.serving.clone().unwrap();
            (cert, key, m.ca.clone().unwrap().0)
        };
        let old = plan(&Material::default(), now, &names(), &settings(), None, 0)
            .unwrap()
            .unwrap();
        let new = plan(&Material::default(), now, &names(), &settings(), None, 0)
            .unwrap()
            .unwrap();
        let (grace, margin) = (Duration::from_secs(30), 20);
        let t0 = Instant::now();
        let state = FilesState::next(None, pair(&old), t0, now, grace, margin);
        // The new CA seen: published (incoming), the old certificate still served.
        let state = FilesState::next(Some(state), pair(&new), t0, now, grace, margin);
        assert_eq!(state.ca, pair(&old).2);
        assert_eq!(
            state.incoming.as_ref().map(|(ca, _)| ca),
            Some(&pair(&new).2)
        );
        let state = FilesState::next(
            Some(state),
            pair(&new),
            t0 + grace / 2,
            now + 15,
            grace,
            margin,
        );
        assert_eq!(state.cert, pair(&old).0, "switched before the grace");
        // After the grace: the new certificate served, the old CA kept as long again.
        let switched = t0 + grace;
        let state = FilesState::next(Some(state), pair(&new), switched, now + 30, grace, margin);
        assert_eq!(
            (state.cert.as_str(), state.ca.as_str()),
            (pair(&new).0.as_str(), pair(&new).2.as_str())
        );
        assert_eq!(
            state.retired.as_ref().map(|(ca, _)| ca),
            Some(&pair(&old).2)
        );
        assert!(state.incoming.is_none());
        let state = FilesState::next(
            Some(state),
            pair(&new),
            switched + grace / 2,
            now + 45,
            grace,
            margin,
        );
        assert!(state.retired.is_some());
        let state = FilesState::next(
            Some(state),
            pair(&new),
            switched + grace,
            now + 60,
            grace,
            margin,
        );
        assert!(state.retired.is_none());
        // The served certificate about to lapse (within the margin): switched at once.
        let late = FilesState::next(None, pair(&old), t0, now, grace, margin);
        let late = FilesState::next(Some(late), pair(&new), t0, now + 290, grace, margin);
        assert_eq!(late.cert, pair(&new).0);
    }

    #[test]
    fn a_secret_read_back_is_the_material_written() {
        let material = plan(&Material::default(), 5, &names(), &settings(), None, 0)
            .unwrap()
            .unwrap();
        let secret = Secret {
            data: Some(material.data()),
            ..Secret::default()
        };
        assert_eq!(Material::of(&secret), material);
        // Anything unreadable is made again, not served.
        let mut broken = material.data();
        broken.insert(RECORD.into(), ByteString(b"{".to_vec()));
        let broken = Material::of(&Secret {
            data: Some(broken),
            ..Secret::default()
        });
        let fixed = plan(&broken, 6, &names(), &settings(), None, 0)
            .unwrap()
            .unwrap();
        assert!(fixed.record.ca.is_some());
        assert_eq!(fixed.route, material.route);
    }
}
