//! Shared fixtures, by kind; every one of them is reachable as `common::…`.
#![allow(dead_code)]
// Each test crate uses some of the kinds below: the others are unused there.
#![allow(unused_imports)]

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams};
use multicluster_runtime::{Action, ClusterId, Context};

pub mod audited;
pub mod operator_process;

mod objects;
pub use objects::*;
mod reconcilers;
pub use reconcilers::*;
mod fleet;
pub use fleet::*;
mod net;
pub use net::*;
mod access;
pub use access::*;
mod binaries;
pub use binaries::*;
