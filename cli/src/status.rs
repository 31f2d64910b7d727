//! `mcr status`: the diagnostics view of one replica (`--url`) or of every replica of a
//! Deployment (through the API server's proxy), as a table with what is wrong in the words of
//! the troubleshooting chapter, and what the replicas' views contradict.

use std::fmt::Write as _;
use std::path::PathBuf;

use anyhow::{Context as _, Result, bail};
use clap::Args;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{Pod, ServiceAccount};
use kube::api::{Api, ListParams, PostParams};
use multicluster_runtime::diagnostics::{
    FORWARDED_AUTHORIZATION, PATH, ReplicaView, disagreements, in_words,
};

/// How long a token `status` requests lasts.
const TOKEN_SECONDS: i64 = 600;

#[derive(Args)]
pub(crate) struct Status {
    /// One replica's endpoints, such as https://127.0.0.1:8443 (after `kubectl port-forward`).
    #[arg(
        long,
        required_unless_present = "deployment",
        conflicts_with = "deployment"
    )]
    url: Option<String>,
    /// Every running replica of this Deployment, `NAMESPACE/NAME`, through the API server's
    /// proxy (you need `get` on `pods/proxy` there).
    #[arg(long)]
    deployment: Option<String>,
    /// With --deployment: the container port of the endpoints, by name or number.
    #[arg(long, default_value = "https")]
    port: String,
    /// With --deployment: the endpoints speak plain HTTP (`Endpoints::plain_http`).
    #[arg(long)]
    plain_http: bool,
    /// The kubeconfig (default: $KUBECONFIG, else ~/.kube/config), for --deployment and
    /// --service-account.
    #[arg(long)]
    kubeconfig: Option<PathBuf>,
    /// Its context (default: the current one).
    #[arg(long)]
    context: Option<String>,
    /// A file with the bearer token the endpoints check (`get` on the non-resource URL
    /// /debug/mcr/fleet). Your kubeconfig's credentials are never sent to a replica.
    #[arg(long, conflicts_with = "service_account")]
    token_file: Option<PathBuf>,
    /// Request a 10-minute token for this ServiceAccount, `NAMESPACE/NAME`, and send that:
    /// one that may read the view and nothing else (never the operator's own, which holds
    /// the fleet's credentials).
    #[arg(long)]
    service_account: Option<String>,
    /// With --url: the CA bundle (PEM) the endpoints' certificate is checked with.
    #[arg(long)]
    ca_file: Option<PathBuf>,
    /// With --url: do not check the endpoints' certificate (they sign their own unless given
    /// one).
    #[arg(long)]
    insecure_skip_tls_verify: bool,
    /// Print the views as JSON (an array, one per replica) instead of the table.
    #[arg(long)]
    json: bool,
}

pub(crate) async fn run(status: Status) -> Result<()> {
    let views = views(&status).await?;
    if views.iter().all(|(_, view)| view.is_err()) {
        let why: Vec<String> = views
            .iter()
            .filter_map(|(source, view)| Some(format!("{source}: {:#}", view.as_ref().err()?)))
            .collect();
        bail!("no replica answered: {}", why.join("; "));
    }
    if status.json {
        let fetched: Vec<&ReplicaView> =
            views.iter().filter_map(|(_, v)| v.as_ref().ok()).collect();
        println!("{}", serde_json::to_string_pretty(&fetched)?);
    } else {
        print!("{}", render(&views));
    }
    Ok(())
}

/// Each replica asked (its name or URL) and its view, or why there is none.
type Views = Vec<(String, Result<ReplicaView>)>;

async fn client(status: &Status) -> Result<kube::Client> {
    let kubeconfig = crate::read_kubeconfig(status.kubeconfig.as_ref())?;
    let options = kube::config::KubeConfigOptions {
        context: status.context.clone(),
        ..Default::default()
    };
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &options)
        .await
        .context("the kubeconfig's context")?;
    kube::Client::try_from(config).context("a client for the kubeconfig's context")
}

/// A token for `namespace/name`, valid for [`TOKEN_SECONDS`].
async fn service_account_token(
    client: &kube::Client,
    namespace: &str,
    name: &str,
) -> Result<String> {
    let request = TokenRequest {
        spec: Some(TokenRequestSpec {
            expiration_seconds: Some(TOKEN_SECONDS),
            ..Default::default()
        }),
        ..Default::default()
    };
    let answer = Api::<ServiceAccount>::namespaced(client.clone(), namespace)
        .create_token_request(name, &PostParams::default(), &request)
        .await
        .with_context(|| format!("requesting a token for the ServiceAccount {namespace}/{name}"))?;
    answer
        .status
        .and_then(|s| s.token)
        .filter(|t| !t.is_empty())
        .with_context(|| format!("the token request for {namespace}/{name} gave no token"))
}

fn read_token(path: &PathBuf) -> Result<String> {
    let token = std::fs::read_to_string(path)
        .with_context(|| format!("reading the token file {}", path.display()))?;
    let token = token.trim().to_string();
    if token.is_empty() {
        bail!("the token file {} is empty", path.display());
    }
    Ok(token)
}

async fn views(status: &Status) -> Result<Views> {
    let needs_client = status.deployment.is_some() || status.service_account.is_some();
    let client = if needs_client {
        Some(client(status).await?)
    } else {
        None
    };
    let given = match (&status.token_file, &status.service_account, &client) {
        (Some(path), _, _) => Some(read_token(path)?),
        (None, Some(account), Some(client)) => {
            let (namespace, name) = crate::split_pair(account, "--service-account")?;
            Some(service_account_token(client, namespace, name).await?)
        }
        _ => None,
    };
    match (&status.url, &status.deployment, client) {
        (Some(url), _, _) => {
            let view = direct(status, url, given.as_deref()).await;
            Ok(vec![(url.clone(), view)])
        }
        (None, Some(deployment), Some(client)) => {
            through_proxy(status, &client, deployment, given).await
        }
        _ => bail!("give --url or --deployment"),
    }
}

/// The view of the endpoints at `url`.
async fn direct(status: &Status, url: &str, token: Option<&str>) -> Result<ReplicaView> {
    let mut config = kube::Config::new(
        url.parse()
            .with_context(|| format!("{url:?} is not a URL"))?,
    );
    config.accept_invalid_certs = status.insecure_skip_tls_verify;
    if let Some(path) = &status.ca_file {
        let pem = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        config.root_cert = Some(
            der_certificates(&pem)
                .with_context(|| format!("{} holds no PEM certificate", path.display()))?,
        );
    }
    config.auth_info.token = token.map(|t| t.to_string().into());
    let client = kube::Client::try_from(config).context("a client for the endpoints")?;
    let request = http::Request::get(PATH).body(Vec::new())?;
    let text = client
        .request_text(request)
        .await
        .map_err(|e| anyhow::anyhow!("{}", refusal(&e)))?;
    serde_json::from_str(&text).context("the endpoints' answer is not a diagnostics view")
}

/// The DER certificates of a PEM bundle; `None` if it has none.
fn der_certificates(pem: &[u8]) -> Option<Vec<Vec<u8>>> {
    use base64::Engine as _;
    let text = std::str::from_utf8(pem).ok()?;
    let certificates: Vec<Vec<u8>> = text
        .split("-----BEGIN CERTIFICATE-----")
        .skip(1)
        .filter_map(|block| {
            let body: String = block
                .split("-----END CERTIFICATE-----")
                .next()?
                .split_whitespace()
                .collect();
            base64::engine::general_purpose::STANDARD.decode(body).ok()
        })
        .collect();
    (!certificates.is_empty()).then_some(certificates)
}

/// Why a request was refused, in words that say what to do.
fn refusal(error: &kube::Error) -> String {
    match error {
        kube::Error::Api(status) if status.code == 401 => {
            "401 Unauthorized: the endpoints took no token (give --token-file or --service-account)".into()
        }
        kube::Error::Api(status) if status.code == 403 => {
            "403 Forbidden: the token's user may not get /debug/mcr/fleet (a ClusterRole with nonResourceURLs [\"/debug/mcr/fleet\"], verbs [\"get\"])".into()
        }
        kube::Error::Api(status) if status.code == 404 => {
            "404 Not Found: no diagnostics view there (an older release, or not the endpoints' port)".into()
        }
        other => other.to_string(),
    }
}

/// The views of every running pod of `deployment`, through the API server's proxy.
async fn through_proxy(
    status: &Status,
    client: &kube::Client,
    deployment: &str,
    given: Option<String>,
) -> Result<Views> {
    let (namespace, name) = crate::split_pair(deployment, "--deployment")?;
    let found = Api::<Deployment>::namespaced(client.clone(), namespace)
        .get(name)
        .await
        .with_context(|| format!("reading the Deployment {namespace}/{name}"))?;
    let selector = found
        .spec
        .as_ref()
        .map(|s| &s.selector)
        .context("the Deployment has no spec")?;
    if selector
        .match_expressions
        .as_ref()
        .is_some_and(|e| !e.is_empty())
    {
        bail!("the Deployment's selector has matchExpressions; only matchLabels are read");
    }
    let labels: Vec<String> = selector
        .match_labels
        .iter()
        .flatten()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    if labels.is_empty() {
        bail!("the Deployment's selector has no matchLabels");
    }
    let pods = Api::<Pod>::namespaced(client.clone(), namespace)
        .list(&ListParams::default().labels(&labels.join(",")))
        .await
        .with_context(|| format!("listing the pods of {namespace}/{name}"))?;
    let running: Vec<&Pod> = pods
        .items
        .iter()
        .filter(|p| {
            p.status.as_ref().is_some_and(|s| {
                s.phase.as_deref() == Some("Running")
                    && s.pod_ip.as_deref().is_some_and(|ip| !ip.is_empty())
            }) && p.metadata.deletion_timestamp.is_none()
        })
        .collect();
    if running.is_empty() {
        bail!("no running pod of {namespace}/{name}");
    }
    let Some(token) = given else {
        bail!(
            "give the token the replicas check: --token-file, or --service-account for a ServiceAccount that may read the view"
        );
    };
    let scheme = if status.plain_http { "http" } else { "https" };
    let mut views = Vec::new();
    for pod in running {
        let pod_name = pod.metadata.name.clone().unwrap_or_default();
        let view = async {
            let port = port_of(pod, &status.port)?;
            let path = format!(
                "/api/v1/namespaces/{namespace}/pods/{scheme}:{pod_name}:{port}/proxy{PATH}"
            );
            let request = http::Request::get(path)
                .header(FORWARDED_AUTHORIZATION, format!("Bearer {token}"))
                .body(Vec::new())?;
            let text = client
                .request_text(request)
                .await
                .map_err(|e| anyhow::anyhow!("{}", refusal(&e)))?;
            serde_json::from_str::<ReplicaView>(&text)
                .context("the replica's answer is not a diagnostics view")
        }
        .await;
        views.push((pod_name, view));
    }
    Ok(views)
}

/// The port `wanted` names in `pod`: a number, or a container port's name.
fn port_of(pod: &Pod, wanted: &str) -> Result<u16> {
    if let Ok(number) = wanted.parse::<u16>() {
        return Ok(number);
    }
    pod.spec
        .iter()
        .flat_map(|s| &s.containers)
        .flat_map(|c| c.ports.iter().flatten())
        .find(|p| p.name.as_deref() == Some(wanted))
        .and_then(|p| u16::try_from(p.container_port).ok())
        .with_context(|| format!("the pod has no container port named {wanted:?} (give --port)"))
}

/// The table: per replica, its clusters, then the problems; then the disagreements.
fn render(views: &Views) -> String {
    let mut out = String::new();
    for (source, view) in views {
        let view = match view {
            Ok(view) => view,
            Err(error) => {
                let _ = writeln!(out, "replica {source}: no view: {error:#}\n");
                continue;
            }
        };
        let mut head = format!("replica {} at {}", view.replica, view.at);
        if !view.leading {
            head.push_str(", not leading (its controllers wait)");
        }
        if let Some(shard) = &view.shard {
            let _ = write!(
                head,
                ", shard {}: holds {} of {} clusters, peers {}",
                shard.identity,
                shard.held.len(),
                shard.discovered,
                shard.peers.join(" ")
            );
        }
        let _ = writeln!(out, "{head}");
        let mut rows = vec![
            [
                "CLUSTER",
                "ROLE",
                "ENGAGED",
                "WATCHES",
                "QUEUE",
                "LAST RECONCILE",
                "OWNER",
                "CREDENTIAL",
            ]
            .map(String::from),
        ];
        for cluster in &view.clusters {
            let listed = cluster
                .watches
                .iter()
                .filter(|w| w.listed && w.error.is_none())
                .count();
            let failing = cluster.watches.iter().filter(|w| w.error.is_some()).count();
            let watches = if failing > 0 {
                format!("{listed}/{} ok, {failing} failing", cluster.watches.len())
            } else {
                format!("{listed}/{} ok", cluster.watches.len())
            };
            let (normal, low, scheduled, in_flight) =
                cluster.queues.iter().fold((0, 0, 0, 0), |t, q| {
                    (
                        t.0 + q.normal,
                        t.1 + q.low,
                        t.2 + q.scheduled + q.parked,
                        t.3 + q.in_flight,
                    )
                });
            let queue = format!("{normal}+{low} ready, {scheduled} waiting, {in_flight} running");
            let last = cluster
                .queues
                .iter()
                .filter_map(|q| q.last.as_ref())
                .max_by(|a, b| a.at.cmp(&b.at))
                .map(|l| format!("{} {}", l.result, l.object))
                .unwrap_or_else(|| "-".into());
            let owner = match &cluster.shard {
                Some(s) if s.handing_off => {
                    format!("{} (handing over)", s.owner.as_deref().unwrap_or("none"))
                }
                Some(s) => s.owner.clone().unwrap_or_else(|| "none".into()),
                None => "-".into(),
            };
            let credential = match &cluster.credential {
                Some(c) if c.remaining_seconds <= 0 => format!("{} ended", c.source),
                Some(c) => format!("{} {}", c.source, in_words(c.remaining_seconds)),
                None => "-".into(),
            };
            let engaged = if cluster.engaged { "yes" } else { "no" };
            // A cluster no longer engaged (being handed over) has no watches or queues here.
            let (watches, queue) = if cluster.engaged {
                (watches, queue)
            } else {
                ("-".into(), "-".into())
            };
            rows.push([
                cluster.name.clone(),
                cluster.role.clone(),
                engaged.into(),
                watches,
                queue,
                last,
                owner,
                credential,
            ]);
        }
        out.push_str(&table(&rows));
        let problems = view.problems();
        if problems.is_empty() {
            out.push_str("no problems seen\n");
        } else {
            out.push_str("problems:\n");
            for problem in problems {
                let whose = problem
                    .cluster
                    .as_deref()
                    .map(|c| format!("cluster {c}: "))
                    .unwrap_or_default();
                let see = problem
                    .section
                    .map(|s| format!(" (docs/troubleshooting.md: \"{s}\")"))
                    .unwrap_or_default();
                let _ = writeln!(out, "  {whose}{}{see}", problem.what);
            }
        }
        out.push('\n');
    }
    let fetched: Vec<ReplicaView> = views
        .iter()
        .filter_map(|(_, v)| v.as_ref().ok().cloned())
        .collect();
    if fetched.len() > 1 {
        let found = disagreements(&fetched);
        if found.is_empty() {
            let _ = writeln!(out, "the {} replicas agree", fetched.len());
        } else {
            out.push_str("the replicas disagree:\n");
            for line in found {
                let _ = writeln!(out, "  {line}");
            }
        }
    }
    out
}

/// Rows in columns two spaces apart.
fn table(rows: &[[String; 8]]) -> String {
    let mut widths = [0usize; 8];
    for row in rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    for row in rows {
        let mut line = String::new();
        for (i, (cell, width)) in row.iter().zip(widths).enumerate() {
            if i + 1 == row.len() {
                line.push_str(cell);
            } else {
                let _ = write!(line, "{cell:<width$}  ");
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}
