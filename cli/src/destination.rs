//! Where `join` writes the kubeconfig: a labelled Secret on the host (for `KubeconfigSecrets`)
//! or a file (for `File`). Each says which token it holds (its anchor in the member), which
//! member it is for and for which identity, so that a later join rotates only its own token
//! and an unjoin removes only a credential `join` wrote for that member.

use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result, anyhow, bail};
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use multicluster_runtime::providers::{
    KUBECONFIG_SECRET_KEY, KUBECONFIG_SECRET_LABEL, TOKEN_RENEWAL_ANNOTATION,
};

use crate::kubeconfig::{self, Held};
use crate::{FIELD_MANAGER, JOINED_AS};

const MEMBER_UID: &str = "multicluster-runtime.sigs.k8s.io/member-uid";
// The annotations the operator reads (and renews) are the library's.
use multicluster_runtime::providers::{
    SERVICE_ACCOUNT_ANNOTATION as SERVICE_ACCOUNT, TOKEN_ANCHOR_ANNOTATION as TOKEN_ANCHOR,
    TOKEN_EXPIRES_ANNOTATION as TOKEN_EXPIRES,
};

pub enum Destination {
    Secret {
        api: Box<Api<Secret>>,
        server: String,
        namespace: String,
        name: String,
    },
    File(PathBuf),
}

impl Destination {
    pub fn secret(host: kube::Client, server: &str, namespace: &str, name: &str) -> Self {
        Self::Secret {
            api: Box::new(Api::namespaced(host, namespace)),
            server: server.to_string(),
            namespace: namespace.to_string(),
            name: name.to_string(),
        }
    }

    pub fn file(path: &Path) -> Result<Self> {
        let absolute =
            std::path::absolute(path).with_context(|| format!("the path {}", path.display()))?;
        Ok(Self::File(absolute))
    }

    pub fn describe(&self) -> String {
        match self {
            Self::Secret {
                namespace, name, ..
            } => format!("the kubeconfig Secret {namespace}/{name} on the host"),
            Self::File(path) => format!("the kubeconfig file {}", path.display()),
        }
    }

    /// The destination's key in label values: a hash of where it is.
    pub fn key(&self) -> String {
        let place = match self {
            Self::Secret {
                server,
                namespace,
                name,
                ..
            } => format!("secret:{server}/{namespace}/{name}"),
            Self::File(path) => format!("file:{}", path.display()),
        };
        format!("{:016x}", fnv1a(place.as_bytes()))
    }

    /// What the destination holds: `None` if there is nothing; an error if something is
    /// there that `join` did not write under this name.
    pub async fn held(&self) -> Result<Option<Held>> {
        match self {
            Self::Secret {
                api,
                namespace,
                name,
                ..
            } => {
                let Some(secret) = api.get_opt(name).await? else {
                    return Ok(None);
                };
                let labels = secret.metadata.labels.unwrap_or_default();
                if labels.get(JOINED_AS) != Some(name) {
                    bail!(
                        "a Secret {namespace}/{name} exists on the host that `mcr join` did not write; choose another --name"
                    );
                }
                let annotations = secret.metadata.annotations.unwrap_or_default();
                let get = |key: &str| annotations.get(key).cloned();
                Ok(Some(Held {
                    uid: secret.metadata.uid.clone(),
                    anchor: get(TOKEN_ANCHOR),
                    member_uid: get(MEMBER_UID),
                    service_account: get(SERVICE_ACCOUNT),
                    expires: get(TOKEN_EXPIRES),
                    renewal: get(TOKEN_RENEWAL_ANNOTATION),
                }))
            }
            Self::File(path) => {
                let content = match std::fs::read(path) {
                    Ok(content) => content,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
                    Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
                };
                match kubeconfig::note_of(&content) {
                    Some(held) => Ok(Some(held)),
                    None => bail!(
                        "{} exists and is not a kubeconfig `mcr join` wrote; it is left alone",
                        path.display()
                    ),
                }
            }
        }
    }

    /// Writes the kubeconfig `content` with `note`.
    pub async fn write(&self, content: &str, note: &Held) -> Result<()> {
        match self {
            Self::Secret {
                api,
                namespace,
                name,
                ..
            } => {
                let secret = serde_json::json!({
                    "apiVersion": "v1",
                    "kind": "Secret",
                    "metadata": {
                        "name": name,
                        "namespace": namespace,
                        "labels": { KUBECONFIG_SECRET_LABEL: "true", JOINED_AS: name },
                        "annotations": {
                            TOKEN_ANCHOR: note.anchor,
                            MEMBER_UID: note.member_uid,
                            SERVICE_ACCOUNT: note.service_account,
                            TOKEN_EXPIRES: note.expires,
                            TOKEN_RENEWAL_ANNOTATION: note.renewal,
                        },
                    },
                    "type": "Opaque",
                    "stringData": { KUBECONFIG_SECRET_KEY: content },
                });
                api.patch(
                    name,
                    &PatchParams::apply(FIELD_MANAGER).force(),
                    &Patch::Apply(&secret),
                )
                .await?;
                Ok(())
            }
            Self::File(path) => kubeconfig::write_file(path, content),
        }
    }

    /// Removes the credential `held` (the Secret read then: one written since, by another
    /// member's `join --force`, stays).
    pub async fn remove(&self, held: &Held) -> Result<()> {
        match self {
            Self::Secret { api, name, .. } => {
                let params = DeleteParams {
                    preconditions: held.uid.clone().map(|uid| kube::api::Preconditions {
                        uid: Some(uid),
                        resource_version: None,
                    }),
                    ..DeleteParams::default()
                };
                match api.delete(name, &params).await {
                    Ok(_) => Ok(()),
                    Err(kube::Error::Api(status)) if status.code == 404 => Ok(()),
                    Err(kube::Error::Api(status)) if status.code == 409 => bail!(
                        "the Secret {name} was written again since it was read (another join?): it is left alone"
                    ),
                    Err(e) => Err(e.into()),
                }
            }
            Self::File(path) => match std::fs::remove_file(path) {
                Ok(()) => Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
                Err(e) => Err(anyhow!(e)).with_context(|| format!("removing {}", path.display())),
            },
        }
    }
}

/// 64-bit FNV-1a: a stable hash for label values (no secret in its input).
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, byte| {
        (hash ^ u64::from(*byte)).wrapping_mul(0x0100_0000_01b3)
    })
}
