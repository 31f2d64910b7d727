//! Hash maps keyed by requests, cluster ids and object names, on the hot path of every event
//! and reconcile. std's default hasher (SipHash-1-3) costs about 500 instructions per
//! request key, a tenth of a fleet reconcile's instructions in the callgrind profile
//! (BENCHMARKS.md); these use hashbrown's default (foldhash), seeded per process.

pub(crate) type HashMap<K, V> = std::collections::HashMap<K, V, hashbrown::DefaultHashBuilder>;
pub(crate) type HashSet<T> = std::collections::HashSet<T, hashbrown::DefaultHashBuilder>;
