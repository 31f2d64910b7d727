//! The ready queue of a fleet controller: deduplicated, one request in flight per key, and
//! round-robin across clusters so that a busy cluster cannot starve a quiet one.
//!
//! Delays (requeue after, debounce) happen before this queue, in kube-runtime's scheduler;
//! what arrives here is due now. Go's multicluster-runtime shares one FIFO among all
//! clusters, so a cluster with thousands of pending requests delays every other cluster by
//! all of them; here a request waits at most one turn of the rotation per other busy cluster.

use std::collections::{HashMap, HashSet, VecDeque, hash_map::Entry};

use crate::{ClusterId, Request};

/// Ready requests grouped by cluster, served round-robin. Each request carries a payload
/// `R` (why it was queued); for a request pushed twice the first payload is kept.
#[derive(Debug)]
pub(crate) struct FairQueue<C: ClusterId, R = ()> {
    /// Per cluster, its ready requests in arrival order. Never holds an empty deque.
    queues: HashMap<C, VecDeque<(Request<C>, R)>>,
    /// Clusters with ready requests, in the order they are served next; each exactly once,
    /// and exactly the keys of `queues`.
    rotation: VecDeque<C>,
    /// Every request in `queues` (for deduplication).
    queued: HashSet<Request<C>>,
    /// Requests handed out by `pop` and not yet `done`.
    in_flight: HashSet<Request<C>>,
    /// In-flight requests that were pushed again; they are queued once they are done, so the
    /// change that caused the push is not lost, and never run twice at once.
    dirty: HashMap<Request<C>, R>,
}

impl<C: ClusterId, R> Default for FairQueue<C, R> {
    fn default() -> Self {
        Self {
            queues: HashMap::new(),
            rotation: VecDeque::new(),
            queued: HashSet::new(),
            in_flight: HashSet::new(),
            dirty: HashMap::new(),
        }
    }
}

impl<C: ClusterId, R> FairQueue<C, R> {
    /// Adds a request that is due. A request already queued is not added twice; one in
    /// flight is queued again when it is done.
    pub(crate) fn push(&mut self, req: Request<C>, payload: R) {
        if self.in_flight.contains(&req) {
            self.dirty.entry(req).or_insert(payload);
            return;
        }
        if self.queued.contains(&req) {
            return;
        }
        self.queued.insert(req.clone());
        match self.queues.entry(req.cluster.clone()) {
            Entry::Occupied(mut q) => q.get_mut().push_back((req, payload)),
            Entry::Vacant(v) => {
                self.rotation.push_back(req.cluster.clone());
                v.insert(VecDeque::from([(req, payload)]));
            }
        }
    }

    /// Takes the next request: the oldest of the cluster whose turn it is. It counts as in
    /// flight until [`FairQueue::done`].
    pub(crate) fn pop(&mut self) -> Option<(Request<C>, R)> {
        let cluster = self.rotation.pop_front()?;
        let Entry::Occupied(mut entry) = self.queues.entry(cluster) else {
            debug_assert!(false, "a cluster in the rotation has a queue");
            return None;
        };
        let (req, payload) = entry.get_mut().pop_front()?;
        if entry.get().is_empty() {
            entry.remove();
        } else {
            self.rotation.push_back(entry.key().clone());
        }
        self.queued.remove(&req);
        self.in_flight.insert(req.clone());
        Some((req, payload))
    }

    /// Marks an in-flight request finished; if it was pushed meanwhile it is queued again.
    pub(crate) fn done(&mut self, req: &Request<C>) {
        self.in_flight.remove(req);
        if let Some((req, payload)) = self.dirty.remove_entry(req) {
            self.push(req, payload);
        }
    }

    /// Drops everything queued for `cluster` (it was disengaged). In-flight requests finish
    /// on their own; their pending re-runs are dropped too.
    pub(crate) fn remove_cluster(&mut self, cluster: &C) {
        if let Some(q) = self.queues.remove(cluster) {
            for (req, _) in q {
                self.queued.remove(&req);
            }
            self.rotation.retain(|c| c != cluster);
        }
        self.dirty.retain(|r, _| &r.cluster != cluster);
    }

    /// Requests waiting (not in flight).
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.queued.len()
    }

    /// Whether `req` is in flight.
    #[cfg(test)]
    pub(crate) fn is_in_flight(&self, req: &Request<C>) -> bool {
        self.in_flight.contains(req)
    }

    /// How many requests are in flight.
    #[cfg(test)]
    pub(crate) fn in_flight(&self) -> usize {
        self.in_flight.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ClusterName;

    impl FairQueue<ClusterName> {
        fn push_(&mut self, r: Request<ClusterName>) {
            self.push(r, ());
        }
    }

    fn req(cluster: &str, name: &str) -> Request<ClusterName> {
        Request::new(ClusterName::from(cluster), Some("ns"), name)
    }

    #[test]
    fn a_quiet_cluster_is_served_within_one_rotation_of_a_flooded_one() {
        let mut q = FairQueue::default();
        for i in 0..10_000 {
            q.push_(req("noisy", &format!("o{i}")));
        }
        q.pop().map(|(r, ())| r);
        q.push_(req("quiet", "only"));
        // quiet joins the rotation behind noisy: one noisy request, then quiet, not after
        // the 9,999 others.
        assert_eq!(q.pop().map(|(r, ())| r).unwrap().cluster, "noisy");
        assert_eq!(q.pop().map(|(r, ())| r).unwrap(), req("quiet", "only"));
        assert_eq!(q.pop().map(|(r, ())| r).unwrap().cluster, "noisy");
    }

    #[test]
    fn clusters_take_turns() {
        let mut q = FairQueue::default();
        for i in 0..3 {
            q.push_(req("a", &format!("{i}")));
        }
        q.push_(req("b", "0"));
        q.push_(req("c", "0"));
        let order: Vec<String> = std::iter::from_fn(|| q.pop().map(|(r, ())| r))
            .map(|r| format!("{}{}", r.cluster, r.name))
            .collect();
        assert_eq!(order, ["a0", "b0", "c0", "a1", "a2"]);
    }

    #[test]
    fn duplicates_are_queued_once() {
        let mut q = FairQueue::default();
        q.push_(req("a", "x"));
        q.push_(req("a", "x"));
        assert_eq!(q.len(), 1);
        q.pop().map(|(r, ())| r);
        assert!(q.pop().map(|(r, ())| r).is_none());
    }

    #[test]
    fn a_request_pushed_while_in_flight_runs_again_after_it_is_done_not_before() {
        let mut q = FairQueue::default();
        q.push_(req("a", "x"));
        let r = q.pop().map(|(r, ())| r).unwrap();
        q.push_(req("a", "x"));
        assert!(
            q.pop().map(|(r, ())| r).is_none(),
            "must not run twice at once"
        );
        q.done(&r);
        assert_eq!(q.pop().map(|(r, ())| r).unwrap(), r);
        assert!(q.is_in_flight(&r));
        q.done(&r);
        assert!(q.pop().map(|(r, ())| r).is_none(), "one push, one re-run");
    }

    #[test]
    fn removing_a_cluster_drops_its_queue_and_pending_reruns() {
        let mut q = FairQueue::default();
        q.push_(req("a", "x"));
        q.push_(req("a", "y"));
        q.push_(req("b", "z"));
        let x = q.pop().map(|(r, ())| r).unwrap();
        q.push_(x.clone());
        q.remove_cluster(&ClusterName::from("a"));
        q.done(&x);
        assert_eq!(q.pop().map(|(r, ())| r).unwrap(), req("b", "z"));
        assert!(q.pop().map(|(r, ())| r).is_none());
        assert_eq!(q.len(), 0);
    }
}
