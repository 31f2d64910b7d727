//! The fleet's webhook configurations in a member: what `unjoin` waits for the fleet to
//! remove before it revokes the identity the fleet removes them with.

use std::time::Duration;

use anyhow::{Context as _, Result};
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
};
use kube::api::{Api, DeleteParams, ListParams, Preconditions};

/// The label every multicluster-runtime manager puts on its configurations.
const MANAGED: &str = "app.kubernetes.io/managed-by=multicluster-runtime";

/// One configuration of a fleet routed to the cluster being unjoined.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Configuration {
    pub(crate) kind: &'static str,
    pub(crate) name: String,
    uid: Option<String>,
}

impl std::fmt::Display for Configuration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.kind, self.name)
    }
}

/// Whether a webhook URL's path routes to the fleet cluster `name`: one of its segments is
/// `name` (a plain name) or `~` and its base64url, or that of an id ending in `#name` (a
/// `Multi` child's).
fn routes_to(url: &str, name: &str) -> bool {
    use base64::Engine as _;
    let path = url.split_once("://").map_or(url, |(_, rest)| rest);
    path.split('/').skip(1).any(|segment| {
        let id = match segment.strip_prefix('~') {
            Some(encoded) => base64::engine::general_purpose::URL_SAFE_NO_PAD
                .decode(encoded)
                .ok()
                .and_then(|b| String::from_utf8(b).ok()),
            None => Some(segment.to_string()),
        };
        id.is_some_and(|id| id == name || id.ends_with(&format!("#{name}")))
    })
}

/// The configurations of multicluster-runtime managers in the member (labelled so) with a
/// webhook routed to `name`.
pub(crate) async fn routed_to(client: &kube::Client, name: &str) -> Result<Vec<Configuration>> {
    let params = ListParams::default().labels(MANAGED);
    let validating = Api::<ValidatingWebhookConfiguration>::all(client.clone())
        .list(&params)
        .await
        .context("listing the member's ValidatingWebhookConfigurations")?;
    let mutating = Api::<MutatingWebhookConfiguration>::all(client.clone())
        .list(&params)
        .await
        .context("listing the member's MutatingWebhookConfigurations")?;
    let found = validating
        .into_iter()
        .filter_map(|c| {
            let urls = c
                .webhooks
                .iter()
                .flatten()
                .map(|w| w.client_config.url.clone());
            routed(
                "ValidatingWebhookConfiguration",
                c.metadata,
                urls.collect(),
                name,
            )
        })
        .chain(mutating.into_iter().filter_map(|c| {
            let urls = c
                .webhooks
                .iter()
                .flatten()
                .map(|w| w.client_config.url.clone());
            routed(
                "MutatingWebhookConfiguration",
                c.metadata,
                urls.collect(),
                name,
            )
        }))
        .collect();
    Ok(found)
}

/// The configuration `kind` of `meta`, if one of its webhooks' `urls` routes to `name`.
fn routed(
    kind: &'static str,
    meta: kube::api::ObjectMeta,
    urls: Vec<Option<String>>,
    name: &str,
) -> Option<Configuration> {
    urls.into_iter()
        .flatten()
        .any(|url| routes_to(&url, name))
        .then(|| Configuration {
            kind,
            name: meta.name.unwrap_or_default(),
            uid: meta.uid,
        })
}

/// Waits, at most `within`, until none of `before` is left in the member (the fleet
/// removed them, or someone did). Returns those left.
pub(crate) async fn wait_gone(
    client: &kube::Client,
    name: &str,
    before: &[Configuration],
    within: Duration,
) -> Result<Vec<Configuration>> {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let now = routed_to(client, name).await?;
        let left: Vec<Configuration> = before
            .iter()
            .filter(|c| now.iter().any(|n| n.kind == c.kind && n.uid == c.uid))
            .cloned()
            .collect();
        if left.is_empty() || tokio::time::Instant::now() >= deadline {
            return Ok(left);
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Deletes `configuration` (that very object: a uid precondition) with the caller's rights.
pub(crate) async fn delete(client: &kube::Client, configuration: &Configuration) -> Result<()> {
    let params = DeleteParams {
        preconditions: Some(Preconditions {
            uid: configuration.uid.clone(),
            resource_version: None,
        }),
        ..DeleteParams::default()
    };
    let deleted = match configuration.kind {
        "MutatingWebhookConfiguration" => Api::<MutatingWebhookConfiguration>::all(client.clone())
            .delete(&configuration.name, &params)
            .await
            .map(|_| ()),
        _ => Api::<ValidatingWebhookConfiguration>::all(client.clone())
            .delete(&configuration.name, &params)
            .await
            .map(|_| ()),
    };
    match deleted {
        Ok(()) => Ok(()),
        Err(kube::Error::Api(status)) if status.code == 404 || status.code == 409 => Ok(()),
        Err(e) => Err(e).with_context(|| format!("deleting {configuration}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_url_routes_to_the_cluster_its_segment_names() {
        let token = "0123456789abcdef0123456789abcdef";
        assert!(routes_to(
            &format!("https://h:8443/admission/east/{token}/w.example.com"),
            "east"
        ));
        assert!(!routes_to(
            &format!("https://h:8443/admission/east-2/{token}/w.example.com"),
            "east"
        ));
        // `secrets#east` (a Multi child's), base64url after `~`.
        assert!(routes_to(
            &format!("https://h/~c2VjcmV0cyNlYXN0/{token}/w.example.com"),
            "east"
        ));
        assert!(!routes_to(
            &format!("https://h/~c2VjcmV0cyNlYXN0/{token}/w.example.com"),
            "west"
        ));
        // The host part is no segment.
        assert!(!routes_to("https://east/admission/x/t/w", "east"));
    }
}
