//! Jitter: random fractions that spread retries and renewals apart.

use std::hash::BuildHasher;

use std::collections::hash_map::RandomState;

/// A random number in [0, 1), for jitter (not for anything secret).
pub(crate) fn random_unit() -> f64 {
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    (RandomState::new().hash_one(seed) >> 11) as f64 / (1u64 << 53) as f64
}
