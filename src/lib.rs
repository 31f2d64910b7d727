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

pub mod bootstrap;
mod builder;
mod cache;
mod client;
mod cluster;
mod controller;
pub mod diagnostics;
mod fleet;
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing;
mod lease;
mod manager;
mod metrics;
pub mod ownership;
mod provider;
pub mod providers;
mod run;
mod serve;
pub mod shard;
pub mod telemetry;
mod util;
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

pub use builder::Builder;
pub use cache::{
    Cache, CacheError, Fault, LAST_APPLIED, Store, WatchBackoff, Watchable, strip_managed_fields,
};
#[doc(hidden)]
pub use client::transport_keepalive;
pub use client::{
    CredentialError, CredentialExpiry, CredentialHolder, CredentialSource, InvalidRateLimit,
    RateLimit,
};
pub use cluster::{
    CacheStatus, Cluster, ClusterId, ClusterIdentity, ClusterName, DiscoveryError,
    InvalidClusterId, SingleCluster, WeakCluster,
};
pub use controller::finalizer;
pub use controller::{
    Action, Context, DEFAULT_DISENGAGE_GRACE, DEFAULT_RESYNC, Failure, FailureBackoff,
    PANIC_REQUEUE, ParseRequestError, Reconciled, Request,
};
pub use fleet::{
    ClusterEvent, ClusterEvents, DEFAULT_FLEET_CONCURRENCY, DEFAULT_FLEET_TIMEOUT, EngageError,
    Engaged, Fleet, FleetApi, FleetApiError, FleetView, Members, PerCluster,
};
pub use lease::{InvalidLeaderElection, LeaderElection, LeaseTiming, OnLoss};
pub use manager::{
    DEFAULT_CACHE_SYNC_TIMEOUT, DEFAULT_CREDENTIAL_LEAD, DEFAULT_GRACEFUL_TIMEOUT, Manager,
    ManagerError,
};
pub use metrics::Metrics;
pub use provider::{Provider, ProviderError};
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
    #[doc = include_str!("../docs/advanced/ownership.md")]
    struct AdvancedOwnership;
    #[doc = include_str!("../docs/advanced/bootstrap.md")]
    struct AdvancedBootstrap;
    #[doc = include_str!("../docs/advanced/authentication.md")]
    struct AdvancedAuthentication;
    #[doc = include_str!("../docs/advanced/identity.md")]
    struct AdvancedIdentity;
    #[doc = include_str!("../docs/contributing.md")]
    struct Contributing;
}
