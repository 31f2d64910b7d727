//! The kubeconfig `join` writes: the member's cluster entry as the user's kubeconfig has it
//! (its CA inlined), the joined identity's token, one context.

use std::io::Write as _;
use std::path::Path;

use anyhow::{Context as _, Result, anyhow};
use base64::Engine as _;
use kube::config::{
    AuthInfo, Context, Kubeconfig, NamedAuthInfo, NamedCluster, NamedContext, NamedExtension,
};

/// What a destination written by `join` says about the credential it holds (kept in the
/// kubeconfig it wrote, and in a Secret's annotations).
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Held {
    /// The host Secret's uid, as read (none for a file, or one being written).
    #[serde(skip)]
    pub uid: Option<String>,
    /// The name of the token's anchor in the member.
    pub anchor: Option<String>,
    /// The member's id (its kube-system namespace's uid).
    pub member_uid: Option<String>,
    /// The identity, `namespace/name`.
    pub service_account: Option<String>,
    /// When the token expires, RFC 3339.
    pub expires: Option<String>,
    /// With `--renewable`: the destination's key, which lets the operator renew the token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub renewal: Option<String>,
}

/// The context extension in which a written kubeconfig says what it holds.
pub const NOTE: &str = "multicluster-runtime.sigs.k8s.io/joined";

/// What of the admin's own transport settings may go into the unattended credential.
#[derive(Clone, Copy, Debug, Default)]
pub struct Carry {
    /// `insecure-skip-tls-verify` (`--insecure-skip-tls-verify`).
    pub insecure: bool,
    /// `proxy-url` (`--keep-proxy`).
    pub proxy: bool,
}

/// A kubeconfig for `token` at the cluster `member_context` names (its server replaced by
/// `server` if given), with one context `name`, which carries `note`. A cluster entry that
/// skips TLS verification or goes through a proxy is refused unless `carry` says so: those
/// are often an admin's laptop settings (a tunnel, a test cluster), not what a credential
/// the fleet uses for a year should hold.
pub fn for_token(
    kubeconfig: &Kubeconfig,
    member_context: &str,
    server: Option<&str>,
    name: &str,
    token: &str,
    note: Option<&Held>,
    carry: Carry,
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
    if cluster.insecure_skip_tls_verify == Some(true) && !carry.insecure {
        return Err(anyhow!(
            "the cluster of context {member_context:?} skips TLS verification (insecure-skip-tls-verify): the credential join writes would too, for as long as it lasts; give the cluster entry its CA, or --insecure-skip-tls-verify to copy the setting"
        ));
    }
    if cluster.proxy_url.is_some() && !carry.proxy {
        return Err(anyhow!(
            "the cluster of context {member_context:?} is reached through a proxy (proxy-url), likely one of this machine's that the fleet cannot reach: give --keep-proxy to copy it"
        ));
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
                extensions: note
                    .map(|note| -> Result<_> {
                        Ok(vec![NamedExtension {
                            name: NOTE.to_string(),
                            extension: serde_json::to_value(note)?,
                        }])
                    })
                    .transpose()?,
                ..Default::default()
            }),
            ..Default::default()
        }],
        current_context: Some(name.to_string()),
        ..Default::default()
    };
    serde_saphyr::to_string(&written).map_err(|e| anyhow!("writing the kubeconfig: {e}"))
}

/// What a kubeconfig `join` wrote says it holds; `None` for any other content.
pub fn note_of(content: &[u8]) -> Option<Held> {
    let kubeconfig = Kubeconfig::from_yaml(std::str::from_utf8(content).ok()?).ok()?;
    let [context] = kubeconfig.contexts.as_slice() else {
        return None;
    };
    let extension = context
        .context
        .as_ref()?
        .extensions
        .as_ref()?
        .iter()
        .find(|e| e.name == NOTE)?;
    serde_json::from_value(extension.extension.clone()).ok()
}

/// Writes `content` to `path`, readable by its owner only, replacing any file there at once
/// (a reader sees the old file or the new one, never half of one). The temporary file is new
/// (`O_EXCL`: never an existing file or a symlink someone planted), hidden (the File provider
/// skips hidden files) and removed if anything fails.
pub fn write_file(path: &Path, content: &str) -> Result<()> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let file_name = path
        .file_name()
        .ok_or_else(|| anyhow!("{} is not a file path", path.display()))?;
    let nonce = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos();
    let partial = dir.join(format!(
        ".{}.{}-{nonce}.partial",
        file_name.to_string_lossy(),
        std::process::id()
    ));
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&partial)
        .and_then(|mut file| {
            file.write_all(content.as_bytes())?;
            file.sync_all()
        })
        .and_then(|()| std::fs::rename(&partial, path));
    if let Err(error) = written {
        let _ = std::fs::remove_file(&partial);
        return Err(error).with_context(|| format!("writing {}", path.display()));
    }
    // The rename itself survives a crash once the directory is synced.
    if let Ok(dir) = std::fs::File::open(dir) {
        let _ = dir.sync_all();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kubeconfig(extra: &str) -> Kubeconfig {
        Kubeconfig::from_yaml(&format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: m\n  cluster:\n    server: https://127.0.0.1:6443\n{extra}contexts:\n- name: m\n  context:\n    cluster: m\n    user: m\nusers:\n- name: m\n  user:\n    token: t\n"
        ))
        .unwrap()
    }

    #[test]
    fn an_admins_insecure_or_proxied_transport_is_copied_only_when_asked() {
        let write = |k: &Kubeconfig, carry| for_token(k, "m", None, "m", "token", None, carry);
        let insecure = kubeconfig("    insecure-skip-tls-verify: true\n");
        let error = write(&insecure, Carry::default()).unwrap_err().to_string();
        assert!(error.contains("insecure-skip-tls-verify"), "{error}");
        let copied = write(
            &insecure,
            Carry {
                insecure: true,
                proxy: false,
            },
        )
        .unwrap();
        assert!(
            copied.contains("insecure-skip-tls-verify: true"),
            "{copied}"
        );
        let proxied = kubeconfig("    proxy-url: socks5://localhost:1080\n");
        let error = write(&proxied, Carry::default()).unwrap_err().to_string();
        assert!(error.contains("--keep-proxy"), "{error}");
        assert!(
            write(
                &proxied,
                Carry {
                    insecure: false,
                    proxy: true
                }
            )
            .unwrap()
            .contains("socks5://localhost:1080")
        );
        assert!(write(&kubeconfig(""), Carry::default()).is_ok());
    }
}
