//! An in-memory Kubernetes API server for unit tests of controllers, kept honest against a
//! real one.
//!
//! [`ApiServer`] is a `tower::Service` that [`kube::Client::new`] takes, so the code under
//! test uses `Api<K>`, watchers and kube-runtime's controllers unchanged. It serves discovery,
//! get, list (label and field selectors, pages), watch (from a version, bookmarks, 410 Gone
//! when too old), create (`generateName`, uids, timestamps), update with optimistic
//! concurrency, merge, JSON and strategic merge patches, delete with finalizers, the status
//! subresource, owner-reference garbage collection and namespace clean-up, for the built-in
//! kinds a controller touches and for any CRD. Faults come on demand: latency, error
//! answers, cut watches, forced 410, a server that stops answering.
//!
//! [`FakeFleet`] is a fleet of such servers with the provider that engages them, for a
//! multicluster-runtime `Manager` under paused time. [`Checker`] runs a reconciler against
//! the orderings a fleet can produce and reports a failing schedule as a seed to replay and a
//! shrunk trace.
//!
//! It is not the real thing, and says where it differs: the repository's differential test
//! runs the same requests against a real `kube-apiserver` and this server and compares what a
//! client sees; the differences it knows of are listed in `docs/testing.md` of the
//! repository. Use it for fast tests of your reconciler's logic; keep integration tests on a
//! real control plane (`multicluster-runtime-testenv`).

#![forbid(unsafe_code)]
#![cfg_attr(not(test), warn(clippy::unwrap_used, clippy::expect_used))]

mod apply;
mod check;
mod discovery;
mod faults;
mod fleet;
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing;
mod http;
mod kinds;
mod ops;
mod patch;
mod selectors;
mod server;
mod status;
mod store;

pub use check::{Checker, Failure, Report, Violation, World};
pub use faults::{Fault, Verb};
pub use fleet::FakeFleet;
pub use http::ResponseBody;
pub use kinds::{Resource, Scope};
pub use server::{ApiServer, ApiServerBuilder, RequestRecord};

/// The book's chapter on testing (`docs/testing.md`), its code samples compiled as this
/// crate's doctests so the chapter stays true.
#[cfg(doctest)]
#[doc = include_str!("../../docs/testing.md")]
struct TestingChapterDoctests;
