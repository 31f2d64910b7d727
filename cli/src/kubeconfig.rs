//! The kubeconfig `join` writes: the member's cluster entry as the user's kubeconfig has it
//! (its CA inlined), the joined identity's token, one context.

use std::io::Write as _;
use std::path::Path;

use anyhow::{Context as _, Result, anyhow};
use base64::Engine as _;
use kube::config::{AuthInfo, Context, Kubeconfig, NamedAuthInfo, NamedCluster, NamedContext};

/// A kubeconfig for `token` at the cluster `member_context` names (its server replaced by
/// `server` if given), with one context `name`.
pub fn for_token(
    kubeconfig: &Kubeconfig,
    member_context: &str,
    server: Option<&str>,
    name: &str,
    token: &str,
) -> Result<String> {
    let context = kubeconfig
        .contexts
        .iter()
        .find(|c| c.name == member_context)
        .and_then(|c| c.context.as_ref())
        .ok_or_else(|| anyhow!("the kubeconfig has no context {member_context:?}"))?;
    let mut cluster = kubeconfig
        .clusters
        .iter()
        .find(|c| c.name == context.cluster)
        .and_then(|c| c.cluster.clone())
        .ok_or_else(|| {
            anyhow!(
                "the kubeconfig has no cluster {:?} (context {member_context:?})",
                context.cluster
            )
        })?;
    // The file a CA path names is not where the fleet runs: its content goes in.
    if let Some(path) = cluster.certificate_authority.take() {
        let pem = std::fs::read(&path)
            .with_context(|| format!("reading the CA file {path} of the member's cluster"))?;
        cluster.certificate_authority_data =
            Some(base64::engine::general_purpose::STANDARD.encode(pem));
    }
    if let Some(server) = server {
        cluster.server = Some(server.to_string());
    }
    let written = Kubeconfig {
        api_version: Some("v1".into()),
        kind: Some("Config".into()),
        clusters: vec![NamedCluster {
            name: name.to_string(),
            cluster: Some(cluster),
            ..Default::default()
        }],
        auth_infos: vec![NamedAuthInfo {
            name: name.to_string(),
            auth_info: Some(AuthInfo {
                token: Some(token.to_string().into()),
                ..Default::default()
            }),
            ..Default::default()
        }],
        contexts: vec![NamedContext {
            name: name.to_string(),
            context: Some(Context {
                cluster: name.to_string(),
                user: Some(name.to_string()),
                ..Default::default()
            }),
            ..Default::default()
        }],
        current_context: Some(name.to_string()),
        ..Default::default()
    };
    serde_saphyr::to_string(&written).map_err(|e| anyhow!("writing the kubeconfig: {e}"))
}

/// Writes `content` to `path`, readable by its owner only, replacing any file there at once
/// (a reader sees the old file or the new one, never half of one).
pub fn write_file(path: &Path, content: &str) -> Result<()> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let file_name = path
        .file_name()
        .ok_or_else(|| anyhow!("{} is not a file path", path.display()))?;
    let partial = dir.join(format!(".{}.partial", file_name.to_string_lossy()));
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&partial)
        .with_context(|| format!("writing {}", partial.display()))?;
    file.write_all(content.as_bytes())
        .and_then(|()| file.sync_all())
        .with_context(|| format!("writing {}", partial.display()))?;
    std::fs::rename(&partial, path)
        .with_context(|| format!("moving the kubeconfig to {}", path.display()))?;
    Ok(())
}
