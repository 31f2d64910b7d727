//! Sharding the fleet across replicas (issue 16, in progress): which replica owns which
//! cluster. Not wired into the manager yet.

// Used by the sharding coordinator still being written; tested on its own meanwhile.
#[cfg_attr(not(test), allow(dead_code))]
mod peers;
#[cfg_attr(not(test), allow(dead_code))]
mod rendezvous;
