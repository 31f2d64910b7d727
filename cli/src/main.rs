//! `mcr`: joins a member cluster to a multicluster-runtime fleet, and unjoins it.
//!
//! `mcr join MEMBER_CONTEXT --host-context HOST` makes, in the member cluster, an identity for
//! the fleet's controllers (a ServiceAccount, the permissions it is given, and a token bound
//! to an object of its own), and writes a kubeconfig for that identity where a provider reads
//! it: a labelled Secret on the host for `KubeconfigSecrets`, or a file for `File`.
//! `mcr unjoin` removes exactly what `join` made. Running `join` again converges on what it is
//! told and issues a new token (rotation); the book's operations chapter has the details.
//! `mcr status` shows what a running fleet's replicas see (their diagnostics view).

mod destination;
mod kubeconfig;
mod member;
mod status;
mod webhooks;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use clap::{Args, Parser, Subcommand};
use kube::config::{KubeConfigOptions, Kubeconfig};

use destination::Destination;
use kubeconfig::Held;

/// The field manager of everything `mcr` applies.
const FIELD_MANAGER: &str = "mcr-join";
/// On every object `join` makes: the cluster name it was joined as.
pub(crate) use multicluster_runtime::providers::JOINED_AS_LABEL as JOINED_AS;

#[derive(Parser)]
#[command(
    name = "mcr",
    version,
    about = "Join member clusters to a multicluster-runtime fleet, and see what its replicas see"
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
    Unjoin(Unjoin),
    /// Show what a running fleet's replicas see (their diagnostics view): per cluster and
    /// kind, watches, queues, last reconcile, shard owner, credential; what is wrong, and
    /// where the replicas disagree.
    Status(status::Status),
}

#[derive(Args)]
struct Unjoin {
    #[command(flatten)]
    common: Common,
    /// How long to wait, once the credential is removed, for the fleet to remove its webhook
    /// configurations from the member (it needs the identity unjoin then revokes): `<n>s`,
    /// `<n>m` or `<n>h`.
    #[arg(long, default_value = "60s", value_parser = parse_wait)]
    webhook_wait: Duration,
    /// Delete, with your own rights, the fleet's webhook configurations routed to this
    /// cluster that are still in the member after the wait (otherwise they are listed, and
    /// the writes they cover may fail once the fleet no longer answers for the cluster).
    #[arg(long)]
    remove_webhooks: bool,
}

fn parse_wait(text: &str) -> Result<Duration, String> {
    let (number, unit) = text.split_at(
        text.find(|c: char| !c.is_ascii_digit())
            .unwrap_or(text.len()),
    );
    let n: u64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a duration such as 60s"))?;
    match unit {
        "s" => Some(n),
        "m" => n.checked_mul(60),
        "h" => n.checked_mul(3600),
        _ => None,
    }
    .map(Duration::from_secs)
    .ok_or_else(|| format!("{text:?} is not a duration such as 60s"))
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
    /// The join's name: the host Secret's name (which `KubeconfigSecrets` makes the
    /// cluster's name in the fleet) and the label on what join makes in the member. Default:
    /// the member context, lower case, other characters than letters, digits, '-' and '.'
    /// made '-'. At most 63 characters.
    #[arg(long)]
    name: Option<String>,
    /// Replace (join) or remove (unjoin) a credential that another member's join wrote under
    /// this name.
    #[arg(long)]
    force: bool,
    /// The host namespace of the kubeconfig Secret (the operator's `--namespace`).
    #[arg(long, default_value = "mcr-system")]
    secret_namespace: String,
    /// The member identity, `NAMESPACE/NAME`; made if it does not exist. `unjoin` takes it
    /// from the credential it removes when it can.
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
    /// Copy the context's `insecure-skip-tls-verify` into the credential (refused without).
    #[arg(long)]
    insecure_skip_tls_verify: bool,
    /// Copy the context's `proxy-url` into the credential (refused without).
    #[arg(long)]
    keep_proxy: bool,
    /// Let the operator renew the token before it ends (`KubeconfigSecrets::
    /// renew_join_tokens`): a Role in the identity's namespace lets the identity request
    /// tokens for itself, create Secrets there and read and delete its token anchors. Only
    /// with --host-context.
    #[arg(long)]
    renewable: bool,
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

/// A name the fleet, a Secret and a label value can all carry: an RFC 1123 subdomain of at
/// most 63 characters.
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
        && name.len() <= 63
        && name.split('.').all(|label| {
            !label.is_empty()
                && label
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        });
    if !valid {
        bail!(
            "{name:?} is not a join name (an RFC 1123 subdomain of at most 63 characters); give one with --name"
        );
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

async fn client_for(
    kubeconfig: &Kubeconfig,
    context: &str,
    role: &str,
) -> Result<(kube::Client, String)> {
    let options = KubeConfigOptions {
        context: Some(context.to_string()),
        ..Default::default()
    };
    let config = kube::Config::from_custom_kubeconfig(kubeconfig.clone(), &options)
        .await
        .with_context(|| format!("the {role} context {context:?} of the kubeconfig"))?;
    let server = config.cluster_url.to_string();
    let client = kube::Client::try_from(config)
        .with_context(|| format!("a client for the {role} context {context:?}"))?;
    Ok((client, server))
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

async fn destination(common: &Common, kubeconfig: &Kubeconfig, name: &str) -> Result<Destination> {
    match (&common.host_context, &common.output_file) {
        (Some(context), _) => {
            let (host, server) = client_for(kubeconfig, context, "host").await?;
            Ok(Destination::secret(
                host,
                &server,
                &common.secret_namespace,
                name,
            ))
        }
        (None, Some(path)) => Destination::file(path),
        (None, None) => bail!("give --host-context or --output-file"),
    }
}

/// What `dest` holds under `name`, refused if it is another member's (unless `force`).
async fn held_for(dest: &Destination, member_uid: &str, force: bool) -> Result<Option<Held>> {
    let held = dest.held().await?;
    if let Some(held) = &held
        && held.member_uid.as_deref() != Some(member_uid)
        && !force
    {
        bail!(
            "{} holds the credential of another member joined under this name; choose another --name, or give --force",
            dest.describe()
        );
    }
    Ok(held)
}

fn main() -> ExitCode {
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("error: starting the runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        match Cli::parse().command {
            Command::Join(join) => run_join(join).await,
            Command::Unjoin(unjoin) => run_unjoin(unjoin).await,
            Command::Status(status) => status::run(status).await,
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {}", report(&error));
            ExitCode::FAILURE
        }
    }
}

fn list(configurations: &[webhooks::Configuration]) -> String {
    configurations
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// The error and its causes, but a credential plugin's failure in fixed words: kube's text of
/// it holds the plugin's command line and output, which can hold secrets.
fn report(error: &anyhow::Error) -> String {
    let mut parts = Vec::new();
    for cause in error.chain() {
        // Anywhere below this cause (a `Service` error quotes the one it wraps).
        if carries_plugin_text(cause) {
            parts.push(
                "the kubeconfig's credentials could not be obtained (an exec plugin or auth provider failed; its output is not shown)"
                    .to_string(),
            );
            break;
        }
        parts.push(cause.to_string());
    }
    parts.join(": ")
}

/// Whether `error`'s own text may hold a credential plugin's command line, environment and
/// output: an authentication error, or kube's `Service` error, which quotes what it wraps,
/// wrapping one. (A context's text is its own.)
fn carries_plugin_text(error: &(dyn std::error::Error + 'static)) -> bool {
    match error.downcast_ref::<kube::Error>() {
        Some(kube::Error::Auth(_)) => true,
        Some(kube::Error::Service(inner)) => {
            let mut next: Option<&(dyn std::error::Error + 'static)> = Some(inner.as_ref());
            while let Some(error) = next {
                if carries_plugin_text(error) {
                    return true;
                }
                next = error.source();
            }
            false
        }
        _ => error.downcast_ref::<kube::client::AuthError>().is_some(),
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
    let carry = kubeconfig::Carry {
        insecure: join.insecure_skip_tls_verify,
        proxy: join.keep_proxy,
    };
    let manifests = join
        .manifest
        .iter()
        .map(|path| {
            std::fs::read_to_string(path)
                .with_context(|| format!("reading the manifest {}", path.display()))
        })
        .collect::<Result<Vec<_>>>()?;
    // Everything that can fail without the member is checked before anything is made there:
    // the kubeconfig to write (the CA file it names), the destination and what it holds.
    kubeconfig::for_token(
        &kubeconfig,
        member_context,
        join.server.as_deref(),
        &name,
        "",
        None,
        carry,
    )?;
    if join.renewable && common.output_file.is_some() {
        bail!(
            "--renewable needs --host-context: the operator renews tokens it reads from host Secrets"
        );
    }
    let (member, _) = client_for(&kubeconfig, member_context, "member").await?;
    let member_uid = member::Member::fingerprint(&member).await?;
    let dest = destination(common, &kubeconfig, &name).await?;
    let held = held_for(&dest, &member_uid, common.force).await?;

    let joined = member::Member::new(member, &name, sa_namespace, sa_name);
    let issued = joined
        .join(
            &manifests,
            &join.cluster_role,
            &roles,
            join.token_ttl,
            &dest.key(),
            join.renewable,
        )
        .await
        .with_context(|| format!("joining the member context {member_context:?} as {name}"))?;
    let note = Held {
        uid: None,
        anchor: Some(issued.anchor.clone()),
        member_uid: Some(member_uid),
        service_account: Some(common.service_account.clone()),
        expires: Some(issued.expires.clone()),
        renewal: join.renewable.then(|| dest.key()),
    };
    let written = kubeconfig::for_token(
        &kubeconfig,
        member_context,
        join.server.as_deref(),
        &name,
        &issued.token,
        Some(&note),
        carry,
    );
    let stored = match written {
        Ok(written) => dest.write(&written, &note).await,
        Err(error) => Err(error),
    };
    if let Err(error) = stored {
        joined.drop_anchor(&issued.anchor).await;
        return Err(error).with_context(|| format!("writing {}", dest.describe()));
    }
    println!("wrote {}", dest.describe());
    // The new token is where the provider reads it: of this destination's tokens only the new
    // one and the one it held before stay valid (a replica may still use that one).
    let previous = held.and_then(|h| h.anchor);
    let keep: Vec<&str> = [Some(issued.anchor.as_str()), previous.as_deref()]
        .into_iter()
        .flatten()
        .collect();
    let revoked = joined.revoke_tokens(&dest.key(), &keep).await?;
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

async fn run_unjoin(unjoin: Unjoin) -> Result<()> {
    let common = unjoin.common;
    let name = cluster_name(&common)?;
    let kubeconfig = read_kubeconfig(common.kubeconfig.as_ref())?;
    let member_context = &common.member_context;
    let (member, _) = client_for(&kubeconfig, member_context, "member").await?;
    let member_uid = member::Member::fingerprint(&member).await?;
    let dest = destination(&common, &kubeconfig, &name).await?;
    let held = held_for(&dest, &member_uid, common.force).await?;
    // The identity the credential was for, else the flag's.
    let account = held
        .as_ref()
        .and_then(|h| h.service_account.clone())
        .unwrap_or_else(|| common.service_account.clone());
    let (sa_namespace, sa_name) = split_pair(&account, "the service account")?;
    let admin = member.clone();
    let joined = member::Member::new(member, &name, sa_namespace, sa_name);
    let was_joined = joined.joined().await?;
    // The fleet's webhook configurations routed to this cluster: the fleet removes them
    // when the cluster leaves, with the identity about to be revoked.
    let configurations = webhooks::routed_to(&admin, &name).await?;

    // The credential goes first, so the fleet disengages the cluster before its identity
    // goes away; then the fleet is given time to remove its webhook configurations.
    if let Some(held) = &held {
        dest.remove(held).await?;
        println!("removed {}", dest.describe());
    }
    let left = if held.is_some() && !configurations.is_empty() {
        println!(
            "waiting up to {:?} for the fleet to remove its webhook configurations ({})",
            unjoin.webhook_wait,
            list(&configurations)
        );
        webhooks::wait_gone(&admin, &name, &configurations, unjoin.webhook_wait).await?
    } else {
        configurations
    };
    if !left.is_empty() {
        if unjoin.remove_webhooks {
            for configuration in &left {
                webhooks::delete(&admin, configuration).await?;
                println!("removed {configuration} (with your rights; the fleet had not)");
            }
        } else {
            eprintln!(
                "warning: the fleet did not remove its webhook configurations routed to {name} ({}): once the identity is revoked it cannot, and the writes they cover may fail (failurePolicy Fail). Run unjoin again with --remove-webhooks, or delete them",
                list(&left)
            );
        }
    }
    if held.is_none() && !was_joined {
        if unjoin.remove_webhooks && !left.is_empty() {
            // A second run for what the fleet left behind.
            return Ok(());
        }
        bail!(
            "nothing of a join named {name} was found: no credential in {}, no record in the member's {sa_namespace} (give the --name, and the --service-account, join was given)",
            dest.describe()
        );
    }
    let (removed, kept) = joined
        .unjoin(&dest.key())
        .await
        .with_context(|| format!("unjoining the member context {member_context:?} ({name})"))?;
    println!("unjoined {member_context:?} ({name}): {removed} object(s) removed from the member");
    for what in kept {
        println!("kept {what}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plugin_failure() -> kube::client::AuthError {
        use std::os::unix::process::ExitStatusExt as _;
        kube::client::AuthError::AuthExecRun {
            cmd: "get-token --client-secret=MARKER-secret".into(),
            out: Box::new(std::process::Output {
                status: std::process::ExitStatus::from_raw(256),
                stdout: b"MARKER-stdout".to_vec(),
                stderr: b"MARKER-stderr".to_vec(),
            }),
        }
    }

    #[test]
    fn a_plugins_failure_is_reported_without_its_text_however_it_is_wrapped() {
        for error in [
            kube::Error::Auth(plugin_failure()),
            // At request time kube's auth layer fails the service with it.
            kube::Error::Service(Box::new(plugin_failure())),
        ] {
            let error = anyhow::Error::new(error).context("joining the member context");
            let text = report(&error);
            assert!(!text.contains("MARKER"), "{text}");
            assert!(text.contains("joining the member context"), "{text}");
            assert!(text.contains("its output is not shown"), "{text}");
        }
    }
}
