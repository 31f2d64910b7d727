//! Leases: leader election ([`leader`]), the timings a Lease is held with ([`timing`]) and
//! the tenure that says until when a holder may still start work ([`tenure`]). Leader
//! election and sharding both build on them.

pub(crate) mod leader;
pub(crate) mod tenure;
pub(crate) mod timing;

pub use leader::{InvalidLeaderElection, LeaderElection, OnLoss};
pub use timing::LeaseTiming;
