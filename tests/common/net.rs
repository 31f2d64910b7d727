//! The network around a control plane: a relay that can cut and hold connections, HTTP(S)
//! requests to the endpoints, free ports.

use super::*;

/// A TCP relay in front of an apiserver, to open a real watch gap: [`Relay::cut`] drops every
/// connection through it and refuses new ones until [`Relay::restore`], while the apiserver
/// itself keeps serving direct clients. TLS passes through untouched (the serving
/// certificate names 127.0.0.1, whatever the port).
pub struct Relay {
    url: String,
    cut: tokio::sync::watch::Sender<u64>,
    task: tokio::task::JoinHandle<()>,
    /// Connections relayed so far, and those open now.
    accepted: Arc<std::sync::atomic::AtomicUsize>,
    open: Arc<std::sync::atomic::AtomicUsize>,
    /// Connections accepted before the `deaf`-th have what the server sends dropped rather
    /// than relayed.
    deaf: Arc<std::sync::atomic::AtomicUsize>,
}

impl Relay {
    /// A relay to `server` (`https://127.0.0.1:<port>`).
    pub async fn start(server: &str) -> Relay {
        let target = server.trim_start_matches("https://").to_string();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("https://{}", listener.local_addr().unwrap());
        // Odd values: cut. Every change ends the connections opened before it.
        let (cut, epochs) = tokio::sync::watch::channel(0u64);
        let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let open = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let deaf = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (accepted_, open_, deaf_) = (accepted.clone(), open.clone(), deaf.clone());
        let task = tokio::spawn(async move {
            let (accepted, open, deaf) = (accepted_, open_, deaf_);
            loop {
                let Ok((mut inbound, _)) = listener.accept().await else {
                    return;
                };
                let mut epochs = epochs.clone();
                if *epochs.borrow_and_update() % 2 == 1 {
                    drop(inbound);
                    continue;
                }
                let target = target.clone();
                let index = accepted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                open.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let (open, deaf) = (open.clone(), deaf.clone());
                tokio::spawn(async move {
                    if let Ok(outbound) = tokio::net::TcpStream::connect(&target).await {
                        use tokio::io::{AsyncReadExt, AsyncWriteExt};
                        let (mut from_client, mut to_client) = inbound.split();
                        let (mut from_server, mut to_server) = outbound.into_split();
                        let up = async {
                            let _ = tokio::io::copy(&mut from_client, &mut to_server).await;
                            let _ = to_server.shutdown().await;
                        };
                        let down = async {
                            let mut buf = vec![0u8; 16 * 1024];
                            while let Ok(n) = from_server.read(&mut buf).await {
                                if n == 0 {
                                    break;
                                }
                                if index >= deaf.load(std::sync::atomic::Ordering::SeqCst)
                                    && to_client.write_all(&buf[..n]).await.is_err()
                                {
                                    break;
                                }
                            }
                            let _ = to_client.shutdown().await;
                        };
                        tokio::select! {
                            _ = futures::future::join(up, down) => {}
                            _ = epochs.changed() => {}
                        }
                    }
                    open.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
                });
            }
        });
        Relay {
            url,
            cut,
            task,
            accepted,
            open,
            deaf,
        }
    }

    /// On the connections open now, what the server sends is dropped from now on (what the
    /// client sends still reaches it); connections accepted later are relayed both ways.
    pub fn deafen(&self) {
        self.deaf
            .store(self.accepted(), std::sync::atomic::Ordering::SeqCst);
    }

    /// Drops every connection open now; new ones are accepted as before.
    pub fn drop_connections(&self) {
        self.cut.send_modify(|e| *e += 2);
    }

    /// Connections accepted since the relay started.
    pub fn accepted(&self) -> usize {
        self.accepted.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Connections relayed now (a connection counts until both of its directions ended).
    pub fn open(&self) -> usize {
        self.open.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// `config` pointed at the relay.
    pub fn config(&self, mut config: kube::Config) -> kube::Config {
        config.cluster_url = self.url.parse().unwrap();
        config
    }

    /// Drops every connection and refuses new ones.
    pub fn cut(&self) {
        self.cut.send_modify(|e| {
            if *e % 2 == 0 {
                *e += 1
            }
        });
    }

    /// Accepts connections again.
    pub fn restore(&self) {
        self.cut.send_modify(|e| {
            if *e % 2 == 1 {
                *e += 1
            }
        });
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The value of the series `name` whose labels include `labels`, in Prometheus text.
pub fn sample(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    text.lines().find_map(|line| {
        let rest = line.strip_prefix(name)?;
        let (label_text, value) = match rest.strip_prefix('{') {
            Some(rest) => rest.split_once("} ")?,
            None => ("", rest.strip_prefix(' ')?),
        };
        labels
            .iter()
            .all(|(k, v)| label_text.contains(&format!("{k}=\"{v}\"")))
            .then(|| value.trim().parse().ok())?
    })
}

/// GET `path` from `addr` over plain HTTP/1.1: the status code and the body.
pub async fn http_get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = format!("GET {path} HTTP/1.1\r\nHost: probe\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    let status = response
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `http_get`, or `Err` when nothing listens (yet).
pub async fn http_get_opt(addr: std::net::SocketAddr, path: &str) -> Result<(u16, String), ()> {
    if tokio::net::TcpStream::connect(addr).await.is_err() {
        return Err(());
    }
    Ok(http_get(addr, path).await)
}

/// Accepts any server certificate (the endpoints' own are self-signed), keeping none: the
/// test compares what was served itself.
#[derive(Debug)]
pub struct AnyCertificate;

impl rustls::client::danger::ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _: &rustls::pki_types::CertificateDer<'_>,
        _: &[rustls::pki_types::CertificateDer<'_>],
        _: &rustls::pki_types::ServerName<'_>,
        _: &[u8],
        _: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        _: &[u8],
        _: &rustls::pki_types::CertificateDer<'_>,
        _: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        Ok(rustls::client::danger::HandshakeSignatureValid::assertion())
    }

    fn verify_tls13_signature(
        &self,
        _: &[u8],
        _: &rustls::pki_types::CertificateDer<'_>,
        _: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        Ok(rustls::client::danger::HandshakeSignatureValid::assertion())
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        rustls::crypto::ring::default_provider()
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// A TLS client that accepts any server certificate.
pub fn any_certificate_tls() -> tokio_rustls::TlsConnector {
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .dangerous()
    .with_custom_certificate_verifier(Arc::new(AnyCertificate))
    .with_no_client_auth();
    tokio_rustls::TlsConnector::from(Arc::new(config))
}

/// An HTTPS GET of `path` from `addr`, with `token` as bearer: the status, the body and the
/// certificate the server presented.
pub async fn https_get(
    addr: std::net::SocketAddr,
    path: &str,
    token: Option<&str>,
) -> (u16, String, Vec<u8>) {
    let (status, body, certificate) = https_exchange(addr, path, token).await;
    (
        status,
        String::from_utf8_lossy(&body).to_string(),
        certificate,
    )
}

/// `GET path` over TLS (any certificate), then the connection closed: the status, the body's
/// bytes and the server's certificate.
async fn https_exchange(
    addr: std::net::SocketAddr,
    path: &str,
    token: Option<&str>,
) -> (u16, Vec<u8>, Vec<u8>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut tls = any_certificate_tls()
        .connect(
            rustls::pki_types::ServerName::try_from("localhost").unwrap(),
            tcp,
        )
        .await
        .unwrap();
    let certificate = tls.get_ref().1.peer_certificates().unwrap()[0].to_vec();
    let authorization = token
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    let request =
        format!("GET {path} HTTP/1.1\r\nHost: probe\r\n{authorization}Connection: close\r\n\r\n");
    tls.write_all(request.as_bytes()).await.unwrap();
    let mut response = Vec::new();
    // A server closing without close_notify is fine here.
    let _ = tls.read_to_end(&mut response).await;
    let end = response
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or(response.len());
    let head = String::from_utf8_lossy(&response[..end]).to_string();
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = response.get(end + 4..).unwrap_or_default().to_vec();
    (status, body, certificate)
}

/// As [`https_get`], the body as the bytes sent (a binary answer: a profile).
pub async fn https_get_bytes(
    addr: std::net::SocketAddr,
    path: &str,
    token: Option<&str>,
) -> (u16, Vec<u8>) {
    let (status, body, _) = https_exchange(addr, path, token).await;
    (status, body)
}
