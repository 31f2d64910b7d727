//! How a cluster's requests travel: the shared HTTP/2 transport, the layer every cluster's
//! client passes through (rate limit, request metrics), exec credential plugins run by the
//! crate with their re-authentication, and the redaction of credential errors.
//!
//! Nothing here knows about caches or fleets; `cache/` sends its watches through
//! [`Requester`](requester::Requester), `cluster/` builds its clients from these parts.

pub(crate) mod endpoint;
pub(crate) mod exec_cert;
pub(crate) mod exec_plugin;
pub(crate) mod expiry;
pub(crate) mod layer;
pub(crate) mod owners;
pub(crate) mod reauth;
pub(crate) mod redact;
pub(crate) mod requester;
pub(crate) mod transport;

pub use expiry::{CredentialExpiry, CredentialHolder, CredentialSource};
pub use layer::{InvalidRateLimit, RateLimit};
pub use redact::CredentialError;
pub(crate) use redact::{Shown, describe_client};
pub use transport::set_keepalive as transport_keepalive;
