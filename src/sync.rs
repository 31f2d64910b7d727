//! The one lock helper: a `Mutex` whose poisoning is recovered from.

use std::sync::{Mutex, MutexGuard};

/// Locks `m`, recovering from poisoning. Every critical section in this crate leaves its data
/// consistent at each step (no invariant spans a point where user code could panic), so the
/// data behind a poisoned lock is still sound; refusing it would turn one panic into many.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
