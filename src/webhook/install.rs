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

use super::route::{RouteKey, Side};
use super::{Install, Keeper, Webhooks};
use crate::cluster::{Cluster, ClusterId};
use crate::fleet::FleetEvent;
use crate::run::Env;

/// The reporting controller of the installer's Events.
pub(crate) const REPORTER: &str = "multicluster-runtime-webhooks";

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
    /// The URL of `cluster`'s `webhook` (the host's, on [`Side::Host`]).
    pub(crate) fn url(&self, key: &RouteKey, side: Side, cluster: &str, webhook: &str) -> String {
        super::route::path(&self.webhooks.url, key, side, cluster, webhook)
    }

    fn recorder(&self, env: &Env<C>) -> Option<&kube_runtime::events::Recorder> {
        let local = env.local.as_ref()?;
        Some(self.recorder.get_or_init(|| {
            kube_runtime::events::Recorder::new(
                local.client(),
                kube_runtime::events::Reporter {
                    controller: REPORTER.into(),
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
        side: Side,
        cluster: &str,
        hook: &str,
        bundle: &str,
    ) -> WebhookClientConfig {
        WebhookClientConfig {
            url: Some(self.url(key, side, cluster, hook)),
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
            annotations: Some(BTreeMap::from([(
                super::OWNER_ANNOTATION.to_string(),
                self.webhooks.url.clone(),
            )])),
            ..ObjectMeta::default()
        }
    }

    /// The configurations of `cluster` (`None` where there is no hook of that type).
    pub(crate) fn configurations(
        &self,
        key: &RouteKey,
        side: Side,
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
                client_config: self.client_config(key, side, cluster, &hook.name, bundle),
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
                client_config: self.client_config(key, side, cluster, &hook.name, bundle),
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
        side: Side,
        key: &RouteKey,
        bundle: &str,
    ) -> Result<(), String> {
        let id = cluster.id().to_string();
        let (validating, mutating) = self.configurations(key, side, &id, bundle);
        // Forced only over what `keep` found to be this manager's (or nothing).
        let params = PatchParams::apply(&self.webhooks.field_manager).force();
        let name = &self.webhooks.configuration;
        // An API error may quote the configuration (a refused URL, a policy engine's
        // message): the route token is taken out of the text before it reaches a log line
        // or an Event.
        let token = key.token(side, &id);
        let describe = |kind: &str, e: kube::Error| {
            let text = crate::client::redact::safe_text(&e).replace(&token, "<route token>");
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

    /// The id of the fleet a configuration's webhooks are routed to, when each of them
    /// is routed under this manager's URL to the same id (whatever token it carries).
    fn routed_to<'u>(&self, urls: impl IntoIterator<Item = Option<&'u str>>) -> Option<String> {
        let mut id = None;
        for url in urls {
            let route = super::route::parse(&self.webhooks.url, url?).ok()?;
            match &id {
                None => id = Some(route.cluster),
                Some(seen) if *seen == route.cluster => {}
                Some(_) => return None,
            }
        }
        id
    }

    /// Reads `cluster`'s configurations: what each holds and where its webhooks are
    /// routed.
    async fn read(&self, cluster: &Cluster<C>, name: &str) -> Result<Live, String> {
        let read = |e: kube::Error| format!("{name}: {}", crate::client::redact::safe_text(&e));
        let validating = Api::<ValidatingWebhookConfiguration>::all(cluster.client())
            .get_opt(name)
            .await
            .map_err(read)?;
        let mutating = Api::<MutatingWebhookConfiguration>::all(cluster.client())
            .get_opt(name)
            .await
            .map_err(read)?;
        Ok(Live {
            validating: validating.map(|c| self.found(&c.metadata, &c.webhooks)),
            mutating: mutating.map(|c| self.found(&c.metadata, &c.webhooks)),
        })
    }

    /// A configuration as read: its identity, the id its webhooks route to, whether it is
    /// this manager's, and its webhooks as JSON.
    fn found(
        &self,
        meta: &ObjectMeta,
        webhooks: &impl serde::Serialize,
    ) -> (Found, serde_json::Value) {
        let webhooks = serde_json::to_value(webhooks).unwrap_or_default();
        let urls = webhooks
            .as_array()
            .into_iter()
            .flatten()
            .map(|w| w.pointer("/clientConfig/url").and_then(|u| u.as_str()));
        let routed_to = self.routed_to(urls);
        // Marked by this manager, or each of its webhooks routed under its URL (made by a
        // version before the mark).
        let marked = meta
            .annotations
            .as_ref()
            .and_then(|a| a.get(super::OWNER_ANNOTATION))
            .is_some_and(|url| *url == self.webhooks.url);
        let ours = marked || routed_to.is_some();
        (Found::of(meta, routed_to, ours), webhooks)
    }

    /// Keeps `cluster`'s configurations as they should be: applied where one is missing
    /// or differs (a member admin's edit or delete, a new bundle or route), left alone
    /// where they are in place. After the `first` keep of an engagement, also left alone
    /// where they are routed to another id the fleet holds: the member is engaged under
    /// two ids (renamed), the newer engagement applied them at its start, and the old id's
    /// removal will leave them alone too.
    async fn keep(
        &self,
        env: &Env<C>,
        cluster: &Cluster<C>,
        key: &RouteKey,
        bundle: &str,
        first: bool,
    ) -> Result<Kept, String> {
        let id = cluster.id().to_string();
        let name = &self.webhooks.configuration;
        let live = self.read(cluster, name).await?;
        for (kind, found) in [
            ("ValidatingWebhookConfiguration", &live.validating),
            ("MutatingWebhookConfiguration", &live.mutating),
        ] {
            if found.as_ref().is_some_and(|(found, _)| !found.ours) {
                return Err(format!(
                    "{kind} {name} was not made by this manager (no mark, and its webhooks do not route under {}): left alone; give this manager another Webhooks::configuration_name",
                    self.webhooks.url
                ));
            }
        }
        // The fleet engages no cluster under the local cluster's id.
        let side = if env.local.as_ref().is_some_and(|l| l.id() == cluster.id()) {
            Side::Host
        } else {
            Side::Fleet
        };
        let (validating, mutating) = self.configurations(key, side, &id, bundle);
        let another = |found: &Found| {
            !first
                && found.routed_to.as_ref().is_some_and(|other| {
                    *other != id && C::parse(other).is_ok_and(|other| env.fleet.holds(&other))
                })
        };
        let mut in_place = true;
        for (wanted, live) in [
            (
                validating.map(|c| serde_json::to_value(&c.webhooks).unwrap_or_default()),
                &live.validating,
            ),
            (
                mutating.map(|c| serde_json::to_value(&c.webhooks).unwrap_or_default()),
                &live.mutating,
            ),
        ] {
            match (wanted, live) {
                (None, _) => {}
                (Some(_), Some((found, _))) if another(found) => return Ok(Kept::Yielded),
                (Some(wanted), Some((_, live))) if contains(live, &wanted) => {}
                (Some(_), _) => in_place = false,
            }
        }
        if in_place {
            return Ok(Kept::InPlace);
        }
        self.apply(cluster, side, key, bundle).await?;
        if first && *name != super::LEGACY_CONFIGURATION_NAME {
            self.remove_legacy(cluster, &id).await?;
        }
        Ok(Kept::Applied)
    }

    /// Deletes the configurations of the name every manager had before names were made
    /// from the URL, where each of their webhooks routes to `id` under this manager's URL
    /// (this manager made them): the configurations of the new name replace them.
    async fn remove_legacy(&self, cluster: &Cluster<C>, id: &str) -> Result<(), String> {
        let name = super::LEGACY_CONFIGURATION_NAME;
        let live = self.read(cluster, name).await?;
        let validating = live.validating.as_ref().map(|(found, _)| found);
        let mutating = live.mutating.as_ref().map(|(found, _)| found);
        delete_routed::<ValidatingWebhookConfiguration>(cluster, name, validating, id).await?;
        delete_routed::<MutatingWebhookConfiguration>(cluster, name, mutating, id).await?;
        Ok(())
    }

    /// Deletes the configurations of `cluster` routed to `id` (which left for good), each
    /// only as read (a `resourceVersion` precondition): one routed to another id (the
    /// cluster renamed, the newer id's) or changed since is left alone. Returns whether
    /// none routed to `id` is left.
    async fn remove(&self, cluster: &Cluster<C>, id: &str) -> Result<bool, String> {
        let name = &self.webhooks.configuration;
        let live = self.read(cluster, name).await?;
        let validating = live.validating.as_ref().map(|(found, _)| found);
        let mutating = live.mutating.as_ref().map(|(found, _)| found);
        let none_validating =
            delete_routed::<ValidatingWebhookConfiguration>(cluster, name, validating, id).await?;
        let none_mutating =
            delete_routed::<MutatingWebhookConfiguration>(cluster, name, mutating, id).await?;
        Ok(none_validating && none_mutating)
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
            tracing::debug!(%cluster, error = %crate::client::Shown(&error), "webhooks: could not record the failure as an Event");
        }
    }
}

/// The wait after the `n`th failure in a row (from 1): 1 s doubling to a minute.
fn backoff(n: u32) -> Duration {
    Duration::from_secs(1 << n.saturating_sub(1).min(6)).min(Duration::from_secs(60))
}

/// Deletes `found`, the configuration `name` of kind `K` as read, if it is routed to `id`
/// (exactly as read). Returns whether there was none routed to `id`.
async fn delete_routed<K>(
    cluster: &Cluster<impl ClusterId>,
    name: &str,
    found: Option<&Found>,
    id: &str,
) -> Result<bool, String>
where
    K: kube::Resource<DynamicType = (), Scope = kube::core::ClusterResourceScope>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
{
    let Some(found) = found.filter(|f| f.routed_to.as_deref() == Some(id)) else {
        return Ok(true);
    };
    match Api::<K>::all(cluster.client())
        .delete(name, &found.precondition())
        .await
    {
        // Gone, or changed since it was read: read again.
        Ok(_) => Ok(false),
        Err(kube::Error::Api(status)) if status.code == 404 || status.code == 409 => Ok(false),
        Err(e) => Err(format!(
            "{} {name}: {}",
            K::kind(&()),
            crate::client::redact::safe_text(&e)
        )),
    }
}

/// A configuration as read from a member.
struct Found {
    uid: Option<String>,
    resource_version: Option<String>,
    /// The id its webhooks are routed to (all the same one, under the manager's URL).
    routed_to: Option<String>,
    /// This manager's: marked, or routed under its URL.
    ours: bool,
}

impl Found {
    fn of(meta: &ObjectMeta, routed_to: Option<String>, ours: bool) -> Self {
        Self {
            uid: meta.uid.clone(),
            resource_version: meta.resource_version.clone(),
            routed_to,
            ours,
        }
    }

    /// A delete of exactly this version.
    fn precondition(&self) -> DeleteParams {
        DeleteParams {
            preconditions: Some(kube::api::Preconditions {
                uid: self.uid.clone(),
                resource_version: self.resource_version.clone(),
            }),
            ..DeleteParams::default()
        }
    }
}

/// A member's configurations, and their webhooks as JSON.
struct Live {
    validating: Option<(Found, serde_json::Value)>,
    mutating: Option<(Found, serde_json::Value)>,
}

/// What [`Runtime::keep`] did.
#[derive(Debug, PartialEq, Eq)]
enum Kept {
    InPlace,
    Applied,
    /// Routed to another id the fleet holds.
    Yielded,
}

/// Whether `live` holds everything `wanted` sets: each field `wanted` gives (not null) is
/// in `live` with the same value, lists item by item; what the API server fills in by
/// default is not a difference.
fn contains(live: &serde_json::Value, wanted: &serde_json::Value) -> bool {
    use serde_json::Value;
    match (live, wanted) {
        (_, Value::Null) => true,
        (Value::Object(live), Value::Object(wanted)) => wanted
            .iter()
            .all(|(k, w)| w.is_null() || live.get(k).is_some_and(|l| contains(l, w))),
        (Value::Array(live), Value::Array(wanted)) => {
            live.len() == wanted.len() && live.iter().zip(wanted).all(|(l, w)| contains(l, w))
        }
        (live, wanted) => live == wanted,
    }
}

/// Keeps `cluster`'s configurations applied with the current bundle until `until`: at
/// once, at each new bundle, and every `check_every` (a member admin's edit or delete is
/// repaired); with backoff while they fail.
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
    let mut failures = 0u32;
    let mut first = true;
    loop {
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
        // Given up as soon as the engagement ends: a cluster leaving for good is cleaned
        // up by `remove`, which an apply must not follow.
        let kept = tokio::select! {
            () = until.cancelled() => return,
            kept = rt.keep(&env, &cluster, &served.route, &bundle, first) => kept,
        };
        let wait = match kept {
            Ok(kept) => {
                first = false;
                if kept != Kept::InPlace || failures > 0 {
                    tracing::debug!(cluster = %id, ?kept, "webhooks: configurations in place");
                }
                failures = 0;
                rt.webhooks.check_every
            }
            Err(problem) => {
                rt.failed(&env, &id, "install", &problem, failures == 0)
                    .await;
                failures = failures.saturating_add(1);
                backoff(failures)
            }
        };
        // A new bundle is applied at once.
        tokio::select! {
            () = until.cancelled() => return,
            changed = bundles.changed() => if changed.is_err() { return },
            () = tokio::time::sleep(wait) => {}
        }
    }
}

/// Removes the configurations routed to `cluster`'s id, which left the fleet for good:
/// retried with backoff until none is left (read again after each delete: an apply sent
/// before the cluster left may land after it), the id is of the fleet again, or the
/// installer stops.
async fn remove<C: ClusterId>(env: Env<C>, rt: Arc<Runtime<C>>, cluster: Cluster<C>) {
    let id = cluster.id().to_string();
    let mut failures = 0u32;
    loop {
        if env.fleet.holds(cluster.id()) {
            return;
        }
        match rt.remove(&cluster, &id).await {
            Ok(true) => {
                tracing::debug!(cluster = %id, "webhooks: the cluster left for good; no configuration routed to it is left");
                return;
            }
            // Deleted (or changed since read): read again at once.
            Ok(false) => continue,
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
                    let until = crate::util::task::until_either(
                        engagement.session.token().child_token(),
                        stop.clone(),
                    );
                    tasks.spawn(keep_applied(env.clone(), rt.clone(), engagement.cluster, until));
                }
                // Paused, handed to another replica or stopped: the configurations stay.
                Some(FleetEvent::Disengaged(engagement)) => {
                    tracing::debug!(cluster = %engagement.cluster.id(), "webhooks: the cluster is disengaged; its configurations stay unless it leaves for good");
                }
                // For good (its source is gone), and not of the fleet again since.
                Some(FleetEvent::Departed(cluster)) => {
                    if !env.shutdown.is_cancelled() && !env.fleet.holds(cluster.id()) {
                        tasks.spawn(remove(env.clone(), rt.clone(), cluster));
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
