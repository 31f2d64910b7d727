//! Kubernetes controllers that reconcile across a dynamic fleet of clusters, built on kube-rs.
//!
//! `multicluster-runtime` brings the model of Go's `sigs.k8s.io/multicluster-runtime` to
//! kube-rs: providers discover clusters and engage or disengage them at run time, and the
//! same reconciler code runs against one cluster or a whole fleet. See the README for what is
//! done and what is planned.
//!
//! # Features
//!
//! - `testenv`: [`testenv`], real `etcd` + `kube-apiserver` control planes on loopback for
//!   tests of multi-cluster controllers (this crate's and yours).
//! - `file`: the `providers::File` provider (kubeconfig files, hot-reloaded).
//! - `kind`: the `providers::Kind` provider (the `kind` CLI).
//! - `fuzzing`: entry points for the cargo-fuzz targets in `fuzz/`; not a public API.
#![forbid(unsafe_code)]
// Nothing a user or a server can influence may panic the library; tests may unwrap.
#![cfg_attr(not(test), warn(clippy::unwrap_used, clippy::expect_used))]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod action;
mod cluster;
mod controller;
mod fleet;
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing;
mod hashing;
mod leader;
mod manager;
mod metrics;
mod provider;
pub mod providers;
mod request;
mod serve;
mod sync;

pub use action::Action;
#[doc(hidden)]
pub use cluster::transport_keepalive;
pub use cluster::{
    Cache, CacheError, CacheStatus, Cluster, ClusterId, ClusterIdentity, ClusterName, Fault,
    InvalidClusterId, InvalidRateLimit, LAST_APPLIED, RateLimit, SingleCluster, Store,
    WatchBackoff, WeakCluster, strip_managed_fields,
};
pub use controller::{
    Builder, Context, DEFAULT_DISENGAGE_GRACE, Failure, PANIC_REQUEUE, Reconciled, Watchable,
};
pub use fleet::{EngageError, Engaged, Fleet, FleetView};
pub use leader::{InvalidLeaderElection, LeaderElection, OnLoss};
pub use manager::{DEFAULT_GRACEFUL_TIMEOUT, Manager, ManagerError};
pub use metrics::Metrics;
pub use provider::{Provider, ProviderError};
pub use request::{ParseRequestError, Request};
pub use serve::Endpoints;

#[cfg(feature = "testenv")]
#[cfg_attr(docsrs, doc(cfg(feature = "testenv")))]
pub mod testenv;

/// The README's code samples, compiled as doctests so the README stays true.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

/// The code samples of `docs/testenv.md`, compiled as doctests.
#[cfg(all(doctest, feature = "testenv"))]
#[doc = include_str!("../docs/testenv.md")]
struct TestenvDocDoctests;

/// The code samples of `docs/providers.md`, compiled as doctests.
#[cfg(doctest)]
#[doc = include_str!("../docs/providers.md")]
struct ProvidersDocDoctests;

/// The code samples of `docs/operations.md`, compiled as doctests.
#[cfg(doctest)]
#[doc = include_str!("../docs/operations.md")]
struct OperationsDocDoctests;
