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
//! cluster engaged later gets its copies at the next resync (`--resync-seconds`).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, ValueEnum};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, ObjectMeta, Patch, PatchParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Resource, ResourceExt};
use kube_runtime::events::{Event, EventType, Recorder};
use kube_runtime::watcher;
use multicluster_runtime::providers::{KubeconfigSecrets, Namespaces};
use multicluster_runtime::{
    Action, Builder, Cluster, ClusterName, Context, Endpoints, LeaderElection, Manager, Metrics,
    Provider, RateLimit,
};

const COPY_LABEL: &str = "mcr.example.io/copy";
const COPIED_TO: &str = "mcr.example.io/copied-to";
const COPIED_FROM: &str = "mcr.example.io/copied-from";
const FIELD_MANAGER: &str = "mcr-operator";

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
    /// Where `/metrics`, `/healthz` and `/readyz` are served.
    #[arg(long, default_value = "0.0.0.0:8080")]
    bind_address: SocketAddr,
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
}

#[derive(Debug, thiserror::Error)]
enum Error {
    #[error("copying into {failed} of {clusters} clusters failed: {first}")]
    Copy {
        failed: usize,
        clusters: usize,
        first: String,
    },
    #[error("reporting back on the host: {0}")]
    Host(#[from] kube::Error),
}

struct State {
    target_namespace: Option<String>,
    resync: Duration,
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
    let host = Client::try_from(config)?;
    match args.provider {
        ProviderKind::Secrets => {
            let provider = KubeconfigSecrets::new(host.clone(), args.namespace.clone());
            operate(provider, host, &args).await
        }
        ProviderKind::Namespaces => {
            let provider = Namespaces::new(host.clone()).labels(&args.namespace_labels);
            operate(provider, host, &args).await
        }
    }
}

/// Runs the operator with `provider`'s clusters until SIGTERM or SIGINT.
async fn operate<P: Provider<Id = ClusterName>>(
    provider: P,
    host: Client,
    args: &Args,
) -> anyhow::Result<()> {
    let mut registry = prometheus_client::registry::Registry::default();
    let metrics = Metrics::new(&mut registry);
    let mut manager = Manager::new(provider)
        .with_local(Cluster::new(ClusterName::from("host"), host.clone()))
        .metrics(metrics)
        .client_rate_limit(RateLimit::new(args.qps, args.burst)?)
        .serve(Endpoints::new(args.bind_address).metrics(Arc::new(registry)));
    if args.leader_elect {
        let mut election = LeaderElection::new(host.clone(), &args.namespace, "mcr-operator")
            .lease_duration(Duration::try_from_secs_f64(args.lease_duration_seconds)?)
            .renew_deadline(Duration::try_from_secs_f64(args.renew_deadline_seconds)?)
            .retry_period(Duration::try_from_secs_f64(args.retry_period_seconds)?);
        if let Some(identity) = &args.identity {
            election = election.identity(identity);
        }
        manager = manager.leader_election(election);
    }
    // The ConfigMaps to copy: labelled, in the operator's namespace, on the host only.
    let originals = watcher::Config::default()
        .labels(&format!("{COPY_LABEL}=true"))
        .fields(&format!("metadata.namespace={}", args.namespace));
    Builder::<_, ConfigMap>::new(&manager, originals)
        .named("mcr-operator")
        .engage_local(true)
        .engage_provider(false)
        .start(
            reconcile,
            |_, error: &Error, _| {
                tracing::warn!(%error, "retrying in 5 s");
                Action::requeue(Duration::from_secs(5))
            },
            Arc::new(State {
                target_namespace: args.target_namespace.clone(),
                resync: Duration::try_from_secs_f64(args.resync_seconds)?
                    .max(Duration::from_secs(1)),
            }),
        );
    tracing::info!(provider = ?args.provider, namespace = %args.namespace, "starting");
    manager.run_until_signal().await?;
    tracing::info!("stopped");
    Ok(())
}

/// Copies `original` into every engaged cluster and reports where it landed.
async fn reconcile(
    original: Arc<ConfigMap>,
    ctx: Context<ClusterName, State>,
) -> Result<Action, Error> {
    let name = original.name_any();
    let from = format!("{}/{}", original.namespace().unwrap_or_default(), name);
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
    if original.annotations().get(COPIED_TO) != Some(&copied_to) {
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
