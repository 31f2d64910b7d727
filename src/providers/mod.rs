//! Providers shipped with the crate.
//!
//! | provider | clusters | use |
//! | --- | --- | --- |
//! | [`SingleProvider`] | exactly one, fixed | single-cluster controllers; runs on kube-runtime's own `Controller` |
//! | [`Clusters`] | added, replaced and removed by hand | tests and custom code |

mod clusters;
mod single;

pub use clusters::Clusters;
pub use single::SingleProvider;
