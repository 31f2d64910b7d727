//! The lock helpers: a `Mutex` or `RwLock` whose poisoning is recovered from.

use std::sync::{Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// Locks `m`, recovering from poisoning. Every critical section in this crate leaves its data
/// consistent at each step (no invariant spans a point where user code could panic), so the
/// data behind a poisoned lock is still sound; refusing it would turn one panic into many.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Locks `l` for reading, recovering from poisoning (as [`lock`]).
pub(crate) fn read<T>(l: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    l.read().unwrap_or_else(|e| e.into_inner())
}

/// Locks `l` for writing, recovering from poisoning (as [`lock`]).
pub(crate) fn write<T>(l: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    l.write().unwrap_or_else(|e| e.into_inner())
}
