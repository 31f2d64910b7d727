//! `mcr`: joins a member cluster to a multicluster-runtime fleet, and unjoins it.
//!
//! `mcr join MEMBER_CONTEXT --host-context HOST` makes, in the member cluster, an identity for
//! the fleet's controllers (a ServiceAccount, the permissions it is given, and a token bound
//! to an object of its own), and writes a kubeconfig for that identity where a provider reads
//! it: a labelled Secret on the host for `KubeconfigSecrets`, or a file for `File`.
//! `mcr unjoin` removes exactly what `join` made. Running `join` again converges on what it is
//! told and issues a new token (rotation); the book's operations chapter has the details.

mod kubeconfig;
mod member;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use clap::{Args, Parser, Subcommand};
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use multicluster_runtime::providers::{KUBECONFIG_SECRET_KEY, KUBECONFIG_SECRET_LABEL};

/// The field manager of everything `mcr` applies.
const FIELD_MANAGER: &str = "mcr-join";
/// On every object `join` makes: the cluster name it was joined as.
pub(crate) const JOINED_AS: &str = "multicluster-runtime.sigs.k8s.io/joined-as";
/// On the host Secret: when the token in it expires (RFC 3339).
const TOKEN_EXPIRES: &str = "multicluster-runtime.sigs.k8s.io/token-expires";
/// On the host Secret: the member identity the token is for (`namespace/name`).
const SERVICE_ACCOUNT: &str = "multicluster-runtime.sigs.k8s.io/service-account";

#[derive(Parser)]
#[command(
    name = "mcr",
    version,
    about = "Join member clusters to a multicluster-runtime fleet"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Make an identity in the member cluster and write a kubeconfig for it where the fleet's
    /// provider reads it. Again on a joined cluster: converge and issue a new token.
    Join(Join),
    /// Remove what `join` made, in the member and on the host (or the file).
    Unjoin(Common),
}

#[derive(Args)]
struct Common {
    /// The member cluster's context in the kubeconfig.
    member_context: String,
    /// The host cluster's context: the kubeconfig Secret is written there.
    #[arg(long, required_unless_present = "output_file")]
    host_context: Option<String>,
    /// Write a kubeconfig file here instead (for the `File` provider); no host is needed.
    #[arg(long, conflicts_with = "host_context")]
    output_file: Option<PathBuf>,
    /// The kubeconfig holding the contexts (default: $KUBECONFIG, else ~/.kube/config).
    #[arg(long)]
    kubeconfig: Option<PathBuf>,
    /// The cluster's name in the fleet, and the host Secret's name (default: the member
    /// context, lower case, other characters than letters, digits, '-' and '.' made '-').
    #[arg(long)]
    name: Option<String>,
    /// The host namespace of the kubeconfig Secret (the operator's `--namespace`).
    #[arg(long, default_value = "mcr-system")]
    secret_namespace: String,
    /// The member identity, `NAMESPACE/NAME`; made if it does not exist.
    #[arg(long, default_value = "mcr-system/mcr-member")]
    service_account: String,
}

#[derive(Args)]
struct Join {
    #[command(flatten)]
    common: Common,
    /// A manifest applied in the member first (server-side), such as deploy/member.yaml;
    /// the objects it creates are removed by `unjoin`. Repeatable.
    #[arg(long)]
    manifest: Vec<PathBuf>,
    /// A ClusterRole bound to the identity (a ClusterRoleBinding). Repeatable.
    #[arg(long)]
    cluster_role: Vec<String>,
    /// A Role, `NAMESPACE/NAME`, bound to the identity in its namespace. Repeatable.
    #[arg(long)]
    role: Vec<String>,
    /// How long the token is valid: `<n>h`, `<n>m` or `<n>s`, at least 10m. Rotate before
    /// it ends by running `join` again.
    #[arg(long, default_value = "8760h", value_parser = parse_duration)]
    token_ttl: Duration,
    /// The member's API server as the fleet's controllers reach it (default: the context's).
    #[arg(long)]
    server: Option<String>,
}

fn parse_duration(text: &str) -> Result<Duration, String> {
    let (number, unit) = text.split_at(
        text.find(|c: char| !c.is_ascii_digit())
            .unwrap_or(text.len()),
    );
    let n: u64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a duration such as 8760h"))?;
    let seconds = match unit {
        "h" => n.checked_mul(3600),
        "m" => n.checked_mul(60),
        "s" => Some(n),
        _ => None,
    }
    .ok_or_else(|| format!("{text:?} is not a duration such as 8760h"))?;
    if seconds < 600 {
        return Err("the API server issues tokens for at least 10 minutes".into());
    }
    Ok(Duration::from_secs(seconds))
}

/// A name the fleet and a Secret can carry (an RFC 1123 subdomain).
fn cluster_name(common: &Common) -> Result<String> {
    let name = match &common.name {
        Some(name) => name.clone(),
        None => common
            .member_context
            .to_lowercase()
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
                    c
                } else {
                    '-'
                }
            })
            .collect::<String>()
            .trim_matches(|c| c == '-' || c == '.')
            .to_string(),
    };
    let valid = !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        });
    if !valid {
        bail!("{name:?} is not a cluster name (an RFC 1123 subdomain); give one with --name");
    }
    Ok(name)
}

fn split_pair<'a>(text: &'a str, what: &str) -> Result<(&'a str, &'a str)> {
    match text.split_once('/') {
        Some((ns, name)) if !ns.is_empty() && !name.is_empty() && !name.contains('/') => {
            Ok((ns, name))
        }
        _ => bail!("{what} {text:?} is not NAMESPACE/NAME"),
    }
}

async fn client_for(kubeconfig: &Kubeconfig, context: &str, role: &str) -> Result<kube::Client> {
    let options = KubeConfigOptions {
        context: Some(context.to_string()),
        ..Default::default()
    };
    let config = kube::Config::from_custom_kubeconfig(kubeconfig.clone(), &options)
        .await
        .with_context(|| format!("the {role} context {context:?} of the kubeconfig"))?;
    kube::Client::try_from(config)
        .with_context(|| format!("a client for the {role} context {context:?}"))
}

fn read_kubeconfig(path: Option<&PathBuf>) -> Result<Kubeconfig> {
    match path {
        Some(path) => Kubeconfig::read_from(path)
            .with_context(|| format!("reading the kubeconfig {}", path.display())),
        None => {
            Kubeconfig::read().context("reading the kubeconfig ($KUBECONFIG or ~/.kube/config)")
        }
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    match Cli::parse().command {
        Command::Join(join) => run_join(join).await,
        Command::Unjoin(common) => run_unjoin(common).await,
    }
}

async fn run_join(join: Join) -> Result<()> {
    let common = &join.common;
    let name = cluster_name(common)?;
    let (sa_namespace, sa_name) = split_pair(&common.service_account, "--service-account")?;
    let roles = join
        .role
        .iter()
        .map(|r| split_pair(r, "--role"))
        .collect::<Result<Vec<_>>>()?;
    let kubeconfig = read_kubeconfig(common.kubeconfig.as_ref())?;
    let member_context = &common.member_context;
    let member = client_for(&kubeconfig, member_context, "member").await?;
    let host = match &common.host_context {
        Some(context) => Some(client_for(&kubeconfig, context, "host").await?),
        None => None,
    };
    let manifests = join
        .manifest
        .iter()
        .map(|path| {
            std::fs::read_to_string(path)
                .with_context(|| format!("reading the manifest {}", path.display()))
        })
        .collect::<Result<Vec<_>>>()?;

    let joined = member::Member::new(member, &name, sa_namespace, sa_name);
    let issued = joined
        .join(&manifests, &join.cluster_role, &roles, join.token_ttl)
        .await
        .with_context(|| format!("joining the member context {member_context:?} as {name}"))?;
    let written = kubeconfig::for_token(
        &kubeconfig,
        member_context,
        join.server.as_deref(),
        &name,
        &issued.token,
    )?;

    match (&host, &common.output_file) {
        (Some(host), _) => {
            write_secret(
                host,
                &common.secret_namespace,
                &name,
                &written,
                &issued.expires,
                &common.service_account,
            )
            .await
            .with_context(|| {
                format!(
                    "writing the kubeconfig Secret {}/{name} on the host",
                    common.secret_namespace
                )
            })?;
            println!(
                "wrote the kubeconfig Secret {}/{name} on the host",
                common.secret_namespace
            );
        }
        (None, Some(path)) => {
            kubeconfig::write_file(path, &written)?;
            println!("wrote the kubeconfig file {}", path.display());
        }
        (None, None) => bail!("give --host-context or --output-file"),
    }
    // Only now that the new token is where the provider reads it: tokens older than the one
    // before are revoked (the one before keeps working until the next join).
    let revoked = joined.revoke_older_tokens().await?;
    println!(
        "joined {member_context:?} as {name}: ServiceAccount {sa_namespace}/{sa_name}, token valid until {} \
         (run `mcr join` again before then to rotate it){}",
        issued.expires,
        if revoked > 0 {
            format!("; {revoked} older token(s) revoked")
        } else {
            String::new()
        }
    );
    Ok(())
}

async fn write_secret(
    host: &kube::Client,
    namespace: &str,
    name: &str,
    kubeconfig: &str,
    expires: &str,
    service_account: &str,
) -> Result<()> {
    let secret = serde_json::json!({
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {
                KUBECONFIG_SECRET_LABEL: "true",
                JOINED_AS: name,
            },
            "annotations": {
                TOKEN_EXPIRES: expires,
                SERVICE_ACCOUNT: service_account,
            },
        },
        "type": "Opaque",
        "stringData": { KUBECONFIG_SECRET_KEY: kubeconfig },
    });
    let api: Api<Secret> = Api::namespaced(host.clone(), namespace);
    if let Some(existing) = api.get_opt(name).await? {
        let ours = existing
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(JOINED_AS))
            .map(String::as_str)
            == Some(name);
        if !ours {
            bail!(
                "a Secret {namespace}/{name} exists that `mcr join` did not make; choose another --name"
            );
        }
    }
    api.patch(
        name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&secret),
    )
    .await?;
    Ok(())
}

async fn run_unjoin(common: Common) -> Result<()> {
    let name = cluster_name(&common)?;
    let (sa_namespace, sa_name) = split_pair(&common.service_account, "--service-account")?;
    let kubeconfig = read_kubeconfig(common.kubeconfig.as_ref())?;
    let member_context = &common.member_context;
    let member = client_for(&kubeconfig, member_context, "member").await?;

    // The credential goes first, so the fleet disengages the cluster before its identity
    // goes away.
    match (&common.host_context, &common.output_file) {
        (Some(context), _) => {
            let host = client_for(&kubeconfig, context, "host").await?;
            let api: Api<Secret> = Api::namespaced(host, &common.secret_namespace);
            match api.get_opt(&name).await? {
                Some(secret)
                    if secret
                        .metadata
                        .labels
                        .as_ref()
                        .and_then(|l| l.get(JOINED_AS))
                        .map(String::as_str)
                        == Some(name.as_str()) =>
                {
                    api.delete(&name, &DeleteParams::default()).await?;
                    println!(
                        "removed the kubeconfig Secret {}/{name} from the host",
                        common.secret_namespace
                    );
                }
                Some(_) => bail!(
                    "the Secret {}/{name} on the host was not made by `mcr join`; left alone",
                    common.secret_namespace
                ),
                None => println!(
                    "no kubeconfig Secret {}/{name} on the host",
                    common.secret_namespace
                ),
            }
        }
        (None, Some(path)) => match std::fs::remove_file(path) {
            Ok(()) => println!("removed the kubeconfig file {}", path.display()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                println!("no kubeconfig file {}", path.display())
            }
            Err(e) => return Err(e).with_context(|| format!("removing {}", path.display())),
        },
        (None, None) => bail!("give --host-context or --output-file"),
    }
    let removed = member::Member::new(member, &name, sa_namespace, sa_name)
        .unjoin()
        .await
        .with_context(|| format!("unjoining the member context {member_context:?} ({name})"))?;
    println!("unjoined {member_context:?} ({name}): {removed} object(s) removed from the member");
    Ok(())
}
