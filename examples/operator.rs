//! A production-shaped operator: copies labelled ConfigMaps of the host cluster (the cluster
//! it runs in) into every engaged cluster, and reports back on the original where the copy
//! landed (an annotation and Events).
//!
//! ```sh
//! cargo run --example operator -- --kubeconfig ~/.kube/config --provider secrets
//! ```
//!
//! It runs as `deploy/operator.yaml` deploys it: leader election on a Lease in its namespace,
//! `/metrics`, `/healthz` and `/readyz` on `--bind-address`, JSON logs with
//! `--log-format json`, graceful shutdown on SIGTERM. The member clusters come from
//! kubeconfig Secrets in its namespace (`--provider secrets`, the default) or are the host's
//! namespaces (`--provider namespaces`, labelled `--namespace-labels`).
//!
//! A ConfigMap in the operator's namespace labelled `mcr.example.io/copy=true` is applied
//! (server-side, field manager `mcr-operator`) into `--target-namespace` of each cluster
//! (default: the cluster's default namespace; a namespace-cluster's own namespace). The
//! original gets the annotation `mcr.example.io/copied-to` (the clusters, sorted) and an
//! Event when that set changes, a Warning Event naming a cluster where the copy failed. A
//! cluster engaged later gets its copies at once, and a copy edited or deleted in a cluster is
//! put back (the copies are watched in every cluster); every ConfigMap is copied again each
//! `--resync-seconds`.
//!
//! With `--shard-group`, replicas split the clusters between them (see `docs/sharding.md`):
//! each replica watches and copies into the clusters it owns only, and reports its share in
//! Events of its own (the annotation, which would need the whole fleet, is left out).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, ValueEnum};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, ObjectMeta, Patch, PatchParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Resource, ResourceExt};
use kube_runtime::events::{Event, EventType, Recorder};
use kube_runtime::watcher;
use multicluster_runtime::providers::{JoinRenewal, KubeconfigSecrets, Namespaces};
use multicluster_runtime::{
    Action, Builder, Cluster, ClusterName, Context, Endpoints, LeaderElection, LeaseTiming,
    Manager, Metrics, Provider, RateLimit, Request, Sharding,
};

// The items below are `pub(crate)` so that the fake crate's unit tests
// (fake/tests/operator.rs) can include this file and check its reconciler without a cluster.
pub(crate) const COPY_LABEL: &str = "mcr.example.io/copy";
pub(crate) const COPIED_TO: &str = "mcr.example.io/copied-to";
pub(crate) const COPIED_FROM: &str = "mcr.example.io/copied-from";
pub(crate) const FIELD_MANAGER: &str = "mcr-operator";

#[derive(Clone, Copy, Debug, ValueEnum)]
enum ProviderKind {
    /// Kubeconfig Secrets in the operator's namespace, one cluster each.
    Secrets,
    /// The host's namespaces, each a cluster.
    Namespaces,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

/// Copies labelled ConfigMaps of the host cluster into every cluster of the fleet.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// Kubeconfig of the host cluster (default: in-cluster, then $KUBECONFIG, ~/.kube/config).
    #[arg(long)]
    kubeconfig: Option<PathBuf>,
    /// Where the member clusters come from.
    #[arg(long, value_enum, default_value = "secrets")]
    provider: ProviderKind,
    /// The operator's namespace on the host: ConfigMaps to copy, kubeconfig Secrets, Lease.
    #[arg(long, default_value = "mcr-system", env = "POD_NAMESPACE")]
    namespace: String,
    /// Label selector of the namespaces that are clusters (`--provider namespaces`).
    #[arg(long, default_value = "mcr.example.io/member=true")]
    namespace_labels: String,
    /// Renew the tokens of members joined with `mcr join --renewable` 30 days before they
    /// end (`--provider secrets`; the host Role then needs `patch` on Secrets).
    #[arg(long)]
    renew_join_tokens: bool,
    /// Namespace of the copies in each cluster (default: the cluster's default namespace).
    #[arg(long)]
    target_namespace: Option<String>,
    /// Run only while holding the Lease `mcr-operator` in the operator's namespace.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    leader_elect: bool,
    /// This replica's name in the Lease and Events (default: host name and a random suffix).
    #[arg(long, env = "POD_NAME")]
    identity: Option<String>,
    /// How long a Lease holds without renewal before another replica may take it.
    #[arg(long, default_value_t = 15.0)]
    lease_duration_seconds: f64,
    /// How long the leader keeps trying to renew before it stops acting.
    #[arg(long, default_value_t = 10.0)]
    renew_deadline_seconds: f64,
    /// How often candidates try and the leader renews.
    #[arg(long, default_value_t = 2.0)]
    retry_period_seconds: f64,
    /// Where `/metrics`, `/healthz` and `/readyz` are served (HTTPS; `/metrics` and
    /// `/readyz?verbose` for tokens the host authorizes).
    #[arg(long, default_value = "0.0.0.0:8443")]
    bind_address: SocketAddr,
    /// Serve the endpoints over plain HTTP to anyone who can connect (local development
    /// and tests only).
    #[arg(long)]
    plain_http: bool,
    /// The serving certificate (PEM; read again when it changes). Default: self-signed.
    #[arg(long, requires = "tls_key_file")]
    tls_cert_file: Option<PathBuf>,
    /// The serving certificate's private key (PEM).
    #[arg(long, requires = "tls_cert_file")]
    tls_key_file: Option<PathBuf>,
    /// Log lines as text or JSON (filter with RUST_LOG; default info).
    #[arg(long, value_enum, default_value = "text")]
    log_format: LogFormat,
    /// How often every ConfigMap is copied again (a cluster engaged since gets it then).
    #[arg(long, default_value_t = 30.0)]
    resync_seconds: f64,
    /// Requests a second to each cluster (a token bucket with `--burst`).
    #[arg(long, default_value_t = 20.0)]
    qps: f64,
    /// Requests at once to each cluster.
    #[arg(long, default_value_t = 40)]
    burst: u32,
    /// Split the clusters between the replicas of this group (Leases in the operator's
    /// namespace; the lease timings above apply).
    #[arg(long)]
    shard_group: Option<String>,
    /// This replica's share relative to the others' (with `--shard-group`).
    #[arg(long, default_value_t = 1.0)]
    shard_weight: f64,
}

#[derive(Debug, thiserror::Error)]
pub(crate) enum Error {
    #[error("copying into {failed} of {clusters} clusters failed: {first}")]
    Copy {
        failed: usize,
        clusters: usize,
        first: String,
    },
    #[error("reporting back on the host: {0}")]
    Host(#[from] kube::Error),
}

pub(crate) struct State {
    pub(crate) target_namespace: Option<String>,
    pub(crate) resync: Duration,
    /// Sharded: this replica's identity, and the share last reported for each original.
    pub(crate) shard: Option<(String, std::sync::Mutex<BTreeMap<String, String>>)>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    match args.log_format {
        LogFormat::Json => tracing_subscriber::fmt()
            .json()
            .with_env_filter(filter)
            .with_current_span(true)
            .init(),
        LogFormat::Text => tracing_subscriber::fmt().with_env_filter(filter).init(),
    }
    let config = match &args.kubeconfig {
        Some(path) => {
            kube::Config::from_custom_kubeconfig(
                Kubeconfig::read_from(path)?,
                &KubeConfigOptions::default(),
            )
            .await?
        }
        None => kube::Config::infer().await?,
    };
    // The host through the crate's shared transport (HTTP/2, one connection per API server
    // for every client of the process) rather than kube's own pool of HTTP/1.1 connections,
    // which opens one per request in flight: the Leases of a sharded replica are many.
    let local = Cluster::from_config(ClusterName::from("host"), config)?;
    let host = local.client();
    match args.provider {
        ProviderKind::Secrets => {
            let mut provider = KubeconfigSecrets::new(host.clone(), args.namespace.clone());
            if args.renew_join_tokens {
                provider = provider.renew_join_tokens(JoinRenewal::new());
            }
            operate(provider, local, &args).await
        }
        ProviderKind::Namespaces => {
            let provider = Namespaces::new(host.clone()).labels(&args.namespace_labels);
            operate(provider, local, &args).await
        }
    }
}

/// Runs the operator with `provider`'s clusters until SIGTERM or SIGINT.
async fn operate<P: Provider<Id = ClusterName>>(
    provider: P,
    local: Cluster<ClusterName>,
    args: &Args,
) -> anyhow::Result<()> {
    let host = local.client();
    let local_config = local.config().cloned();
    let mut registry = prometheus_client::registry::Registry::default();
    let metrics = Metrics::new(&mut registry);
    // HTTPS, tokens checked by the host (the local cluster), unless told otherwise.
    let mut endpoints = Endpoints::new(args.bind_address).metrics(Arc::new(registry));
    if let (Some(cert), Some(key)) = (&args.tls_cert_file, &args.tls_key_file) {
        endpoints = endpoints.tls_files(cert, key);
    }
    if args.plain_http {
        endpoints = endpoints.plain_http();
    }
    let mut manager = Manager::new(provider)
        .with_local(local)
        .metrics(metrics)
        .client_rate_limit(RateLimit::new(args.qps, args.burst)?)
        .serve(endpoints);
    // With a target namespace, every ConfigMap watch (the originals on the host, the copies
    // in each cluster) looks only at the operator's namespace and the target: its RBAC is
    // then Roles there, not a read of every ConfigMap of every cluster.
    if let Some(target) = &args.target_namespace {
        manager = manager.namespaces_for::<ConfigMap>([args.namespace.clone(), target.clone()]);
    }
    let timing = LeaseTiming::default()
        .lease_duration(Duration::try_from_secs_f64(args.lease_duration_seconds)?)
        .renew_deadline(Duration::try_from_secs_f64(args.renew_deadline_seconds)?)
        .retry_period(Duration::try_from_secs_f64(args.retry_period_seconds)?);
    // Leases go through a client of their own: the manager's rate limit, which the local
    // cluster's client gets, must not hold up the renewals that keep this replica's share.
    let coordination = match local_config {
        Some(config) => Cluster::from_config(ClusterName::from("host"), config)?.client(),
        None => host.clone(),
    };
    let mut shard = None;
    if let Some(group) = &args.shard_group {
        // Every replica copies, each into its own share: no leader election needed.
        let mut sharding = Sharding::new(coordination.clone(), &args.namespace, group)
            .weight(args.shard_weight)
            .timing(timing);
        if let Some(identity) = &args.identity {
            sharding = sharding.identity(identity);
        }
        shard = Some((sharding.holder_identity().to_string(), Default::default()));
        manager = manager.sharding(sharding);
    } else if args.leader_elect {
        let mut election =
            LeaderElection::new(coordination.clone(), &args.namespace, "mcr-operator")
                .timing(timing);
        if let Some(identity) = &args.identity {
            election = election.identity(identity);
        }
        manager = manager.leader_election(election);
    }
    // The ConfigMaps to copy: labelled, in the operator's namespace, on the host only.
    let originals = watcher::Config::default()
        .labels(&format!("{COPY_LABEL}=true"))
        .fields(&format!("metadata.namespace={}", args.namespace));
    // Each cluster's copies are watched: one edited or deleted there is put back.
    let copies =
        watcher::Config::default().labels(&format!("app.kubernetes.io/managed-by={FIELD_MANAGER}"));
    let local = ClusterName::from("host");
    // Clusters joining the fleet (or this replica's share) get their copies at once.
    let joined = futures::StreamExt::map(manager.fleet().events(), |_| ());
    Builder::<_, ConfigMap>::new(&manager, originals)
        .named("mcr-operator")
        .engage_local(true)
        .watches(copies, move |_, copy: &ConfigMap| {
            copy.annotations()
                .get(COPIED_FROM)
                .and_then(|from| from.split_once('/'))
                .map(|(ns, name)| Request::new(local.clone(), Some(ns), name))
        })
        .reconcile_all_on(joined)
        // Clusters joining together are caught up in one round.
        .debounce(Duration::from_millis(300))
        .start(
            reconcile,
            |_, error: &Error, ctx| {
                tracing::warn!(%error, failures = ctx.failures(), "retrying after the object's backoff");
                Action::backoff()
            },
            Arc::new(State {
                target_namespace: args.target_namespace.clone(),
                resync: Duration::try_from_secs_f64(args.resync_seconds)?
                    .max(Duration::from_secs(1)),
                shard,
            }),
        );
    tracing::info!(provider = ?args.provider, namespace = %args.namespace, "starting");
    manager.run_until_signal().await?;
    tracing::info!("stopped");
    Ok(())
}

/// Copies `original` into every engaged cluster and reports where it landed.
pub(crate) async fn reconcile(
    original: Arc<ConfigMap>,
    ctx: Context<ClusterName, State>,
) -> Result<Action, Error> {
    let name = original.name_any();
    let from = format!("{}/{}", original.namespace().unwrap_or_default(), name);
    // The originals are on the host; the fleet's clusters only hold copies.
    if ctx.cluster_id().as_str() != "host" {
        return Ok(Action::await_change());
    }
    let mut clusters = ctx.fleet().clusters();
    clusters.sort_by(|a, b| a.id().cmp(b.id()));
    let copies = clusters.iter().map(|cluster| {
        let target = ctx
            .state()
            .target_namespace
            .clone()
            .unwrap_or_else(|| cluster.client().default_namespace().to_string());
        let copy = ConfigMap {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                namespace: Some(target.clone()),
                labels: Some(BTreeMap::from([(
                    "app.kubernetes.io/managed-by".into(),
                    FIELD_MANAGER.into(),
                )])),
                annotations: Some(BTreeMap::from([(COPIED_FROM.into(), from.clone())])),
                ..Default::default()
            },
            data: original.data.clone(),
            binary_data: original.binary_data.clone(),
            ..Default::default()
        };
        async move {
            let api: Api<ConfigMap> = Api::namespaced(cluster.client(), &target);
            let applied = api
                .patch(
                    &copy.name_any(),
                    &PatchParams::apply(FIELD_MANAGER).force(),
                    &Patch::Apply(&copy),
                )
                .await;
            (cluster.id().clone(), applied)
        }
    });
    let results = futures::future::join_all(copies).await;
    let mut copied = Vec::new();
    let mut failures = Vec::new();
    for (cluster, result) in results {
        match result {
            Ok(_) => copied.push(cluster.to_string()),
            Err(error) => {
                tracing::warn!(%cluster, %error, "copy failed");
                failures.push(format!("cluster {cluster}: {error}"));
            }
        }
    }

    // Report back on the original: the annotation (written only when it changes, so the
    // write does not start another round) and an Event per change or failure.
    let copied_to = copied.join(",");
    let recorder = ctx.recorder();
    let reference = original.object_ref(&());
    if let Some((identity, reported)) = &ctx.state().shard {
        // Sharded: this replica's share, in an Event when it changes.
        let changed = reported
            .lock()
            .unwrap()
            .insert(from.clone(), copied_to.clone())
            != Some(copied_to.clone());
        if changed {
            let event = Event {
                type_: EventType::Normal,
                reason: "Copied".into(),
                note: Some(format!(
                    "replica {identity} copied into its {} clusters",
                    copied.len()
                )),
                action: "Copy".into(),
                secondary: None,
            };
            Recorder::new(ctx.client(), ctx.reporter().clone())
                .publish(&event, &reference)
                .await?;
        }
    } else if original.annotations().get(COPIED_TO) != Some(&copied_to) {
        let api: Api<ConfigMap> =
            Api::namespaced(ctx.client(), &original.namespace().unwrap_or_default());
        let patch = serde_json::json!({"metadata": {"annotations": {COPIED_TO: copied_to}}});
        api.patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await?;
        let note = format!("copied into {} clusters: {copied_to}", copied.len());
        let event = Event {
            type_: EventType::Normal,
            reason: "Copied".into(),
            note: Some(note),
            action: "Copy".into(),
            secondary: None,
        };
        // A recorder of its own: kube-runtime's recorder counts Events of the same reason and
        // action about the same object as one series whatever their note, which would keep
        // the first set's note (say, "0 clusters" from a reconcile before any cluster was
        // engaged) on every later change. Each change of the set is news.
        Recorder::new(ctx.client(), ctx.reporter().clone())
            .publish(&event, &reference)
            .await?;
    }
    for failure in &failures {
        let event = Event {
            type_: EventType::Warning,
            reason: "CopyFailed".into(),
            note: Some(failure.chars().take(1000).collect()),
            action: "Copy".into(),
            secondary: None,
        };
        recorder.publish(&event, &reference).await?;
    }
    match failures.first() {
        None => Ok(Action::requeue(ctx.state().resync)),
        Some(first) => Err(Error::Copy {
            failed: failures.len(),
            clusters: clusters.len(),
            first: first.clone(),
        }),
    }
}
