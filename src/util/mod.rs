//! Helpers that know nothing of Kubernetes or of this crate's concepts: poison-tolerant
//! locks, the hot path's hash maps, jitter, a panic's text, cancellation tokens and a TLS key check. Every
//! other module may import them; they import nothing of the crate.

pub(crate) mod hashing;
pub(crate) mod jitter;
pub(crate) mod panic;
pub(crate) mod sync;
pub(crate) mod task;
pub(crate) mod tls;

/// `text` cut to `max` characters, with `…` where it was cut (an error shown where a whole one
/// does not belong; the logs have it whole).
pub(crate) fn cut(mut text: String, max: usize) -> String {
    if let Some((at, _)) = text.char_indices().nth(max) {
        text.truncate(at);
        text.push('…');
    }
    text
}
