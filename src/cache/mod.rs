//! The watch → cache pipeline: the watch protocol ([`wire`]), first listings ([`listing`]),
//! objects decoded without their managed fields ([`trim`]), per-namespace watches merged
//! ([`namespaces`]), retries ([`backoff`]), transforms, shared sources, and the shared watch
//! of one kind in one cluster ([`watch`]) feeding its [`Store`], its field indexes and every
//! subscriber. [`Cache`] is the typed reader a user gets.
//!
//! A watch is assembled here and started by its cluster's engagement (`cluster/`); the
//! controllers subscribe to it (`controller/`).

pub(crate) mod backoff;
pub(crate) mod errors;
pub(crate) mod handle;
pub(crate) mod index;
pub(crate) mod listing;
pub(crate) mod map_event;
pub(crate) mod namespaces;
pub(crate) mod source;
pub(crate) mod store;
pub(crate) mod transform;
pub(crate) mod trim;
pub(crate) mod watch;
pub(crate) mod watchable;
pub(crate) mod wire;

pub(crate) use backoff::Retrying;
pub use backoff::WatchBackoff;
pub use errors::CacheError;
pub use handle::Cache;
pub(crate) use index::Indexer;
pub(crate) use source::{SharedObject, WatchKey, WatchRequest, WatchSource};
pub(crate) use store::ObjectKey;
pub use store::Store;
pub(crate) use transform::Transforms;
pub use transform::{LAST_APPLIED, strip_managed_fields};
pub use watch::Fault;
pub(crate) use watch::{Change, SharedWatch, WatchSettings, same_version};
pub use watchable::Watchable;
