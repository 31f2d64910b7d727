//! The configurations in each cluster: applied (server-side apply) when a cluster is engaged
//! and whenever the CA bundle changes, retried with backoff while they fail (an Event on the
//! host and a metric each time, never a stop), removed when a cluster leaves the fleet for
//! good: not when it is replaced under its id, handed to another replica, or when the
//! manager stops or loses its lease.

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use k8s_openapi::ByteString;
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhook, MutatingWebhookConfiguration, RuleWithOperations, ValidatingWebhook,
    ValidatingWebhookConfiguration, WebhookClientConfig,
};
use k8s_openapi::api::core::v1::ObjectReference;
use kube::api::{Api, DeleteParams, ObjectMeta, Patch, PatchParams};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::route::RouteKey;
use super::{Install, Keeper, Webhooks};
use crate::controller::Env;
use crate::fleet::FleetEvent;
use crate::{Cluster, ClusterId};

/// The field manager of the configurations.
pub(crate) const FIELD_MANAGER: &str = "multicluster-runtime-webhooks";

/// A manager's webhooks across its runs.
pub(crate) struct Runtime<C: ClusterId> {
    pub(crate) webhooks: Webhooks<C>,
    /// Made at the first run's start (it reads the host Secret).
    pub(crate) keeper: OnceLock<Arc<Keeper>>,
    /// The host Secret, which install failures are recorded on as Events.
    pub(crate) secret: OnceLock<Option<ObjectReference>>,
    /// The recorder of those Events: one, so that a failure repeated is one Event series
    /// (its count going up), not a new Event each time.
    pub(crate) recorder: OnceLock<kube_runtime::events::Recorder>,
}

impl<C: ClusterId> Runtime<C> {
    /// The URL of `cluster`'s `webhook`.
    pub(crate) fn url(&self, key: &RouteKey, cluster: &str, webhook: &str) -> String {
        super::route::path(&self.webhooks.url, key, cluster, webhook)
    }

    fn recorder(&self, env: &Env<C>) -> Option<&kube_runtime::events::Recorder> {
        let local = env.local.as_ref()?;
        Some(self.recorder.get_or_init(|| {
            kube_runtime::events::Recorder::new(
                local.client(),
                kube_runtime::events::Reporter {
                    controller: FIELD_MANAGER.into(),
                    instance: Some(env.instance.to_string()),
                },
            )
        }))
    }

    fn rules(hook: &super::Hook<C>) -> Vec<RuleWithOperations> {
        vec![RuleWithOperations {
            api_groups: Some(vec![hook.group.clone()]),
            api_versions: Some(vec![hook.version.clone()]),
            resources: Some(vec![hook.resource.clone()]),
            operations: Some(
                hook.operations
                    .iter()
                    .map(|op| {
                        match op {
                            super::Operation::Create => "CREATE",
                            super::Operation::Update => "UPDATE",
                            super::Operation::Delete => "DELETE",
                            super::Operation::Connect => "CONNECT",
                        }
                        .to_string()
                    })
                    .collect(),
            ),
            scope: Some("*".into()),
        }]
    }

    fn client_config(
        &self,
        key: &RouteKey,
        cluster: &str,
        hook: &str,
        bundle: &str,
    ) -> WebhookClientConfig {
        WebhookClientConfig {
            url: Some(self.url(key, cluster, hook)),
            ca_bundle: Some(ByteString(bundle.as_bytes().to_vec())),
            service: None,
        }
    }

    fn meta(&self) -> ObjectMeta {
        ObjectMeta {
            name: Some(self.webhooks.configuration.clone()),
            labels: Some(BTreeMap::from([(
                "app.kubernetes.io/managed-by".to_string(),
                "multicluster-runtime".to_string(),
            )])),
            ..ObjectMeta::default()
        }
    }

    /// The configurations of `cluster` (`None` where there is no hook of that type).
    pub(crate) fn configurations(
        &self,
        key: &RouteKey,
        cluster: &str,
        bundle: &str,
    ) -> (
        Option<ValidatingWebhookConfiguration>,
        Option<MutatingWebhookConfiguration>,
    ) {
        let hooks = &self.webhooks.hooks;
        let validating: Vec<ValidatingWebhook> = hooks
            .iter()
            .filter(|h| !h.mutating)
            .map(|hook| ValidatingWebhook {
                name: hook.name.clone(),
                admission_review_versions: vec!["v1".into()],
                client_config: self.client_config(key, cluster, &hook.name, bundle),
                failure_policy: Some(hook.failure_policy.as_str().into()),
                match_policy: Some("Equivalent".into()),
                namespace_selector: hook.namespace_selector.clone(),
                object_selector: hook.object_selector.clone(),
                rules: Some(Self::rules(hook)),
                side_effects: "None".into(),
                timeout_seconds: i32::try_from(hook.timeout.as_secs()).ok(),
                match_conditions: None,
            })
            .collect();
        let mutating: Vec<MutatingWebhook> = hooks
            .iter()
            .filter(|h| h.mutating)
            .map(|hook| MutatingWebhook {
                name: hook.name.clone(),
                admission_review_versions: vec!["v1".into()],
                client_config: self.client_config(key, cluster, &hook.name, bundle),
                failure_policy: Some(hook.failure_policy.as_str().into()),
                match_policy: Some("Equivalent".into()),
                namespace_selector: hook.namespace_selector.clone(),
                object_selector: hook.object_selector.clone(),
                rules: Some(Self::rules(hook)),
                side_effects: "None".into(),
                timeout_seconds: i32::try_from(hook.timeout.as_secs()).ok(),
                reinvocation_policy: Some("Never".into()),
                match_conditions: None,
            })
            .collect();
        (
            (!validating.is_empty()).then(|| ValidatingWebhookConfiguration {
                metadata: self.meta(),
                webhooks: Some(validating),
            }),
            (!mutating.is_empty()).then(|| MutatingWebhookConfiguration {
                metadata: self.meta(),
                webhooks: Some(mutating),
            }),
        )
    }

    /// Applies `cluster`'s configurations.
    async fn apply(
        &self,
        cluster: &Cluster<C>,
        key: &RouteKey,
        bundle: &str,
    ) -> Result<(), String> {
        let id = cluster.id().to_string();
        let (validating, mutating) = self.configurations(key, &id, bundle);
        let params = PatchParams::apply(FIELD_MANAGER).force();
        let name = &self.webhooks.configuration;
        // An API error may quote the configuration (a refused URL, a policy engine's
        // message): the route token is taken out of the text before it reaches a log line
        // or an Event.
        let token = key.token(&id);
        let describe = |kind: &str, e: kube::Error| {
            let text = crate::cluster::redact::safe_text(&e).replace(&token, "<route token>");
            format!("{kind} {name}: {text}")
        };
        // Defaults before checks: a validating webhook alone would refuse what the
        // mutating one is there to fill in.
        if let Some(config) = mutating {
            Api::<MutatingWebhookConfiguration>::all(cluster.client())
                .patch(name, &params, &Patch::Apply(&config))
                .await
                .map_err(|e| describe("MutatingWebhookConfiguration", e))?;
        }
        if let Some(config) = validating {
            Api::<ValidatingWebhookConfiguration>::all(cluster.client())
                .patch(name, &params, &Patch::Apply(&config))
                .await
                .map_err(|e| describe("ValidatingWebhookConfiguration", e))?;
        }
        Ok(())
    }

    /// Whether `cluster` has neither configuration (an apply sent before the cluster left
    /// may land after a delete).
    async fn absent(&self, cluster: &Cluster<C>) -> Result<bool, String> {
        let name = &self.webhooks.configuration;
        let read = |e: kube::Error| format!("{name}: {}", crate::cluster::redact::safe_text(&e));
        let validating = Api::<ValidatingWebhookConfiguration>::all(cluster.client())
            .get_opt(name)
            .await
            .map_err(read)?;
        let mutating = Api::<MutatingWebhookConfiguration>::all(cluster.client())
            .get_opt(name)
            .await
            .map_err(read)?;
        Ok(validating.is_none() && mutating.is_none())
    }

    /// Deletes `cluster`'s configurations (those already gone are fine).
    async fn remove(&self, cluster: &Cluster<C>) -> Result<(), String> {
        let name = &self.webhooks.configuration;
        fn gone<T>(r: Result<T, kube::Error>, kind: &str, name: &str) -> Result<(), String> {
            match r {
                Ok(_) => Ok(()),
                Err(kube::Error::Api(status)) if status.code == 404 => Ok(()),
                Err(e) => Err(format!(
                    "{kind} {name}: {}",
                    crate::cluster::redact::safe_text(&e)
                )),
            }
        }
        gone(
            Api::<ValidatingWebhookConfiguration>::all(cluster.client())
                .delete(name, &DeleteParams::default())
                .await,
            "ValidatingWebhookConfiguration",
            name,
        )?;
        gone(
            Api::<MutatingWebhookConfiguration>::all(cluster.client())
                .delete(name, &DeleteParams::default())
                .await,
            "MutatingWebhookConfiguration",
            name,
        )
    }

    async fn failed(&self, env: &Env<C>, cluster: &str, what: &str, problem: &str, first: bool) {
        if let Some(metrics) = &env.metrics {
            metrics.webhook_install_failed(cluster);
        }
        if first {
            tracing::warn!(%cluster, %problem, "webhooks: could not {what} the configurations; trying again");
        }
        let (Some(recorder), Some(Some(secret))) = (self.recorder(env), self.secret.get()) else {
            return;
        };
        let event = kube_runtime::events::Event {
            type_: kube_runtime::events::EventType::Warning,
            reason: "WebhookInstallFailed".into(),
            note: Some(
                format!(
                    "cluster {cluster}: could not {what} the webhook configurations: {problem}"
                )
                .chars()
                .take(1000)
                .collect(),
            ),
            action: "Install".into(),
            secondary: None,
        };
        if let Err(error) = recorder.publish(&event, secret).await {
            tracing::debug!(%cluster, error = %crate::cluster::Shown(&error), "webhooks: could not record the failure as an Event");
        }
    }
}

/// The wait after the `n`th failure in a row (from 1): 1 s doubling to a minute.
fn backoff(n: u32) -> Duration {
    Duration::from_secs(1 << n.saturating_sub(1).min(6)).min(Duration::from_secs(60))
}

/// Keeps `cluster`'s configurations applied with the current bundle until `until`.
async fn keep_applied<C: ClusterId>(
    env: Env<C>,
    rt: Arc<Runtime<C>>,
    cluster: Cluster<C>,
    until: CancellationToken,
) {
    let Some(keeper) = rt.keeper.get().cloned() else {
        return;
    };
    let mut bundles = keeper.bundle();
    let id = cluster.id().to_string();
    'bundle: loop {
        // The bundle now (waiting for the first).
        let bundle = loop {
            if let Some(published) = bundles.borrow_and_update().clone() {
                break published.bundle;
            }
            tokio::select! {
                () = until.cancelled() => return,
                changed = bundles.changed() => if changed.is_err() { return },
            }
        };
        let Some(served) = keeper.served() else {
            return;
        };
        let mut failures = 0u32;
        loop {
            // Given up as soon as the engagement ends: a cluster leaving for good is
            // cleaned up by `remove`, which an apply must not follow.
            let applied = tokio::select! {
                () = until.cancelled() => return,
                applied = rt.apply(&cluster, &served.route, &bundle) => applied,
            };
            match applied {
                Ok(()) => {
                    tracing::debug!(cluster = %id, "webhooks: configurations applied");
                    break;
                }
                Err(problem) => {
                    rt.failed(&env, &id, "install", &problem, failures == 0)
                        .await;
                    failures = failures.saturating_add(1);
                    tokio::select! {
                        () = until.cancelled() => return,
                        // A new bundle is applied at once, with the next try.
                        changed = bundles.changed() => if changed.is_err() { return } else { continue 'bundle },
                        () = tokio::time::sleep(backoff(failures)) => {}
                    }
                }
            }
        }
        tokio::select! {
            () = until.cancelled() => return,
            changed = bundles.changed() => if changed.is_err() { return },
        }
    }
}

/// Removes the configurations of `cluster`, which left the fleet for good: retried with
/// backoff until both are gone (checked after the delete: an apply sent before the cluster
/// left may land after it), the cluster is engaged again, or the installer stops.
async fn remove<C: ClusterId>(env: Env<C>, rt: Arc<Runtime<C>>, cluster: Cluster<C>) {
    let id = cluster.id().to_string();
    let mut failures = 0u32;
    loop {
        if env.fleet.get(cluster.id()).is_some() || env.fleet.discovered(cluster.id()).is_some() {
            return;
        }
        let outcome = match rt.remove(&cluster).await {
            Ok(()) => rt.absent(&cluster).await,
            Err(problem) => Err(problem),
        };
        match outcome {
            Ok(true) => {
                tracing::debug!(cluster = %id, "webhooks: configurations removed");
                return;
            }
            // Applied again behind the delete: delete again.
            Ok(false) => {}
            Err(problem) => {
                failures = failures.saturating_add(1);
                rt.failed(&env, &id, "remove", &problem, failures == 1)
                    .await;
            }
        }
        tokio::select! {
            () = env.shutdown.cancelled() => return,
            () = tokio::time::sleep(backoff(failures.max(1))) => {}
        }
    }
}

/// The installer: runs where the controllers run (the leader; with sharding, each replica
/// for the clusters it owns), until its term ends.
pub(crate) async fn install_task<C: ClusterId>(env: Env<C>, rt: Arc<Runtime<C>>) {
    let install = rt.webhooks.install;
    let mut tasks = JoinSet::new();
    let stop = env.shutdown.child_token();
    if matches!(install, Install::Host | Install::FleetAndHost)
        && let Some(local) = env.local.clone()
    {
        tasks.spawn(keep_applied(env.clone(), rt.clone(), local, stop.clone()));
    }
    if !matches!(install, Install::Fleet | Install::FleetAndHost) {
        stop.cancelled().await;
        tasks.shutdown().await;
        return;
    }
    let mut events = env.fleet.subscribe();
    loop {
        tokio::select! {
            () = env.shutdown.cancelled() => break,
            event = events.recv() => match event {
                Some(FleetEvent::Engaged(engagement) | FleetEvent::Replaced { new: engagement, .. }) => {
                    let until = crate::per_cluster::until_either(
                        engagement.session.token().child_token(),
                        stop.clone(),
                    );
                    tasks.spawn(keep_applied(env.clone(), rt.clone(), engagement.cluster, until));
                }
                Some(FleetEvent::Disengaged(engagement)) => {
                    let id = engagement.cluster.id();
                    // For good: not stopping, not engaged again, not handed to another replica.
                    if !env.shutdown.is_cancelled()
                        && env.fleet.get(id).is_none()
                        && env.fleet.discovered(id).is_none()
                    {
                        tasks.spawn(remove(env.clone(), rt.clone(), engagement.cluster));
                    }
                }
                None => break,
            },
            Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
        }
    }
    stop.cancel();
    let drain = async { while tasks.join_next().await.is_some() {} };
    tokio::select! {
        () = drain => {}
        () = env.grace.over() => {}
    }
}
