//! Kubernetes controllers that reconcile across a dynamic fleet of clusters, built on kube-rs.
//!
//! `multicluster-runtime` brings the model of Go's `sigs.k8s.io/multicluster-runtime` to
//! kube-rs: providers discover clusters and engage or disengage them at run time, and the
//! same reconciler code runs against one cluster or a whole fleet. See the README for what is
//! done and what is planned.
//!
//! # Features
//!
//! - `file`: the `providers::File` provider (kubeconfig files, hot-reloaded).
//! - `kind`: the `providers::Kind` provider (the `kind` CLI).
//! - `fuzzing`: entry points for the cargo-fuzz targets in `fuzz/`; not a public API.
//!
//! Real `etcd` + `kube-apiserver` control planes for tests (this crate's and yours) are the
//! crate `multicluster-runtime-testenv`, a dev-dependency.
//!
//! # Kubernetes version
//!
//! Like kube-rs, this crate does not pick a `k8s-openapi` version feature: the final binary
//! does (`k8s-openapi = { version = "0.29", features = ["v1_36"] }` in its `Cargo.toml`), so
//! that every library in the build agrees on one. Any version `k8s-openapi` supports works.
//!
//! The kube crates are re-exported, so one dependency keeps their versions in step:
//!
//! ```
//! use multicluster_runtime::k8s_openapi::api::core::v1::ConfigMap;
//! use multicluster_runtime::kube::Resource;
//! use multicluster_runtime::{predicates, watcher};
//!
//! let config = watcher::Config::default().labels("app=web");
//! assert_eq!(config.label_selector.as_deref(), Some("app=web"));
//! let cm = ConfigMap::default();
//! assert_eq!(predicates::generation(&cm), None);
//! assert_eq!(ConfigMap::kind(&()), "ConfigMap");
//! ```
#![forbid(unsafe_code)]
// Nothing a user or a server can influence may panic the library; tests may unwrap.
#![cfg_attr(not(test), warn(clippy::unwrap_used, clippy::expect_used))]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod action;
mod cluster;
mod controller;
pub mod finalizer;
mod fleet;
mod fleet_api;
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing;
mod hashing;
mod leader;
mod lease_timing;
mod manager;
mod metrics;
mod per_cluster;
mod provider;
pub mod providers;
mod request;
mod serve;
pub mod shard;
mod slots;
mod sync;
mod tenure;
pub mod webhook;

/// The Kubernetes API types this crate's and kube's APIs use. The version feature is the
/// final binary's choice (see [the crate docs](crate#kubernetes-version)).
pub use k8s_openapi;
/// kube-rs, as this crate builds on it: `kube::Client`, `kube::Api`, `kube::Config` and the
/// `kube::runtime` pieces in this crate's API (`watcher::Config`, predicates, events). Use it
/// to keep one kube version in step with this crate's.
pub use kube;
/// kube-runtime's watcher configuration, predicates and events, which the [`Builder`] and the
/// [`Context`] take and return. Its finalizer helper is [`finalizer`](mod@finalizer), with
/// this crate's [`Action`].
pub use kube::runtime::{Predicate, events, predicates, watcher};

pub use action::Action;
#[doc(hidden)]
pub use cluster::transport_keepalive;
pub use cluster::{
    Cache, CacheError, CacheStatus, Cluster, ClusterId, ClusterIdentity, ClusterName,
    CredentialError, DiscoveryError, Fault, InvalidClusterId, InvalidRateLimit, LAST_APPLIED,
    RateLimit, SingleCluster, Store, WatchBackoff, WeakCluster, strip_managed_fields,
};
pub use controller::{
    Builder, Context, DEFAULT_DISENGAGE_GRACE, DEFAULT_RESYNC, Failure, FailureBackoff,
    PANIC_REQUEUE, Reconciled, Watchable,
};
pub use fleet::{ClusterEvent, ClusterEvents, EngageError, Engaged, Fleet, FleetView};
pub use fleet_api::{
    DEFAULT_FLEET_CONCURRENCY, DEFAULT_FLEET_TIMEOUT, FleetApi, FleetApiError, Members, PerCluster,
};
pub use leader::{InvalidLeaderElection, LeaderElection, OnLoss};
pub use lease_timing::LeaseTiming;
pub use manager::{DEFAULT_CACHE_SYNC_TIMEOUT, DEFAULT_GRACEFUL_TIMEOUT, Manager, ManagerError};
pub use metrics::Metrics;
pub use provider::{Provider, ProviderError};
pub use request::{ParseRequestError, Request};
pub use serve::{Check, Endpoints, Handler};
pub use shard::{InvalidSharding, ShardStatus, Sharding};

/// The README's code samples, compiled as doctests so the README stays true.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

/// The book's chapters (`docs/`), their code samples compiled as doctests so the book stays
/// true. (`docs/testenv.md` is the testenv crate's.)
#[cfg(doctest)]
mod book {
    #[doc = include_str!("../docs/introduction.md")]
    struct Introduction;
    #[doc = include_str!("../docs/getting-started.md")]
    struct GettingStarted;
    #[doc = include_str!("../docs/concepts/manager.md")]
    struct ConceptsManager;
    #[doc = include_str!("../docs/concepts/providers.md")]
    struct ConceptsProviders;
    #[doc = include_str!("../docs/concepts/clusters.md")]
    struct ConceptsClusters;
    #[doc = include_str!("../docs/concepts/reconcile.md")]
    struct ConceptsReconcile;
    #[doc = include_str!("../docs/patterns/uniform.md")]
    struct PatternsUniform;
    #[doc = include_str!("../docs/patterns/aware.md")]
    struct PatternsAware;
    #[doc = include_str!("../docs/patterns/builder.md")]
    struct PatternsBuilder;
    #[doc = include_str!("../docs/migration.md")]
    struct Migration;
    #[doc = include_str!("../docs/providers.md")]
    struct Providers;
    #[doc = include_str!("../docs/operations.md")]
    struct Operations;
    #[doc = include_str!("../docs/troubleshooting.md")]
    struct Troubleshooting;
    #[doc = include_str!("../docs/sharding.md")]
    struct Sharding;
    #[doc = include_str!("../docs/webhooks.md")]
    struct Webhooks;
    #[doc = include_str!("../docs/architecture.md")]
    struct Architecture;
    #[doc = include_str!("../docs/advanced/events.md")]
    struct AdvancedEvents;
    #[doc = include_str!("../docs/advanced/mapping.md")]
    struct AdvancedMapping;
    #[doc = include_str!("../docs/advanced/authentication.md")]
    struct AdvancedAuthentication;
    #[doc = include_str!("../docs/advanced/identity.md")]
    struct AdvancedIdentity;
    #[doc = include_str!("../docs/contributing.md")]
    struct Contributing;
}
