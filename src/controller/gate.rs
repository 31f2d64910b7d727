//! Single mode's two lanes. kube-runtime's scheduler hands out whatever is due in no
//! particular order (its due requests wait in a hash set while every worker is busy), so a
//! change made while 10,000 listed objects are due waits behind a random share of them.
//! The objects of a listing that bring no news are therefore held here and handed to the
//! scheduler only as workers take them: never more than the concurrency limit at once, and
//! none while a live change is on its way to a worker. A live change goes to the scheduler
//! directly and finds at most that many listed objects beside it.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Poll, Waker};
use std::time::Duration;

use tokio::time::Instant;

use futures::Stream;
use kube::Resource;
use kube_runtime::reflector::ObjectRef;
use std::future::Future;

use crate::cache::ObjectKey;
use crate::util::hashing::{HashMap, HashSet};

/// How long a live change on its way to a worker holds listed objects back at most.
const LIVE_WAIT: Duration = Duration::from_secs(5);

/// The listed objects held back, and those handed on whose reconciles have not begun.
pub(crate) struct Gate {
    state: Mutex<State>,
    /// `state.released.len() + state.live.len()`, read without the lock on every reconcile.
    outstanding: AtomicUsize,
    /// At most this many handed on and not yet begun.
    limit: usize,
}

#[derive(Default)]
struct State {
    /// Held objects in the order they were listed; an entry no longer in `holding` was
    /// triggered by a live change meanwhile (or is a duplicate) and is skipped.
    held: VecDeque<ObjectKey>,
    holding: HashSet<ObjectKey>,
    /// Handed on, reconcile not begun.
    released: HashSet<ObjectKey>,
    /// Live changes handed to the scheduler whose reconciles have not begun, with when:
    /// nothing is handed on meanwhile. One older than [`LIVE_WAIT`] no longer holds the gate
    /// (a safety net: each is expected to begin or to be found deleted).
    live: HashMap<ObjectKey, Instant>,
    /// Live changes begun since a listed object was last handed on while changes waited:
    /// at [`LOW_SHARE`](super::queue::LOW_SHARE), one listed object goes anyway.
    live_begun: u32,
    /// The release stream's task, waiting for room or for objects.
    waker: Option<Waker>,
}

impl Gate {
    /// A gate handing on at most `limit` listed objects at a time (at least one).
    pub(crate) fn new(limit: usize) -> Self {
        Self {
            state: Mutex::new(State::default()),
            outstanding: AtomicUsize::new(0),
            limit: limit.max(1),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `object` was listed without news: it waits here for room.
    pub(crate) fn hold<K: Resource>(&self, object: &K) {
        let key = ObjectKey::of(object);
        let mut state = self.lock();
        if state.holding.insert(key.clone()) {
            state.held.push_back(key);
            if let Some(waker) = state.waker.take() {
                waker.wake();
            }
        }
    }

    /// `object` changed live and goes to the scheduler itself: it is not held any more.
    pub(crate) fn pass<K: Resource>(&self, object: &K) {
        let mut state = self.lock();
        if !state.holding.is_empty() {
            state.holding.remove(&ObjectKey::of(object));
        }
    }

    /// `object`'s live change passed the filters and goes to the scheduler: nothing listed
    /// is handed on until its reconcile begins.
    pub(crate) fn live<K: Resource>(&self, object: &K) {
        let mut state = self.lock();
        state.live.insert(ObjectKey::of(object), Instant::now());
        self.count(&state);
    }

    fn count(&self, state: &State) {
        self.outstanding
            .store(state.released.len() + state.live.len(), Ordering::Release);
    }

    /// A reconcile of `object` begins: if it was handed on from here, or is a live change,
    /// it makes room.
    pub(crate) fn started<K: Resource>(&self, object: &K) {
        if self.outstanding.load(Ordering::Acquire) == 0 {
            return;
        }
        self.begun(&ObjectKey::of(object));
    }

    /// [`Gate::started`] by key (also for an object found deleted when its turn came).
    pub(crate) fn begun(&self, key: &ObjectKey) {
        let mut state = self.lock();
        let released = state.released.remove(key);
        let live = state.live.remove(key).is_some();
        if live {
            state.live_begun = state.live_begun.saturating_add(1);
        }
        if released || live {
            self.count(&state);
            if let Some(waker) = state.waker.take() {
                waker.wake();
            }
        }
    }

    /// The held objects, handed on as room frees, for kube-runtime's `reconcile_on`.
    pub(crate) fn releases<K>(
        self: std::sync::Arc<Self>,
        dt: K::DynamicType,
    ) -> impl Stream<Item = ObjectRef<K>> + Send + 'static
    where
        K: Resource + 'static,
        K::DynamicType: Clone + Send + 'static,
    {
        let mut safety: Option<std::pin::Pin<Box<tokio::time::Sleep>>> = None;
        futures::stream::poll_fn(move |cx| {
            let mut state = self.lock();
            if !state.live.is_empty() {
                let now = Instant::now();
                state
                    .live
                    .retain(|_, at| now.duration_since(*at) < LIVE_WAIT);
                self.count(&state);
                // Changes keep coming: every LOW_SHARE-th start is a listed object's, so a
                // listing is never held back for ever.
                if state.live_begun < super::queue::LOW_SHARE
                    && let Some(oldest) = state.live.values().min()
                {
                    // Woken when it begins, or when it no longer holds the gate.
                    let until = *oldest + LIVE_WAIT;
                    let sleep =
                        safety.get_or_insert_with(|| Box::pin(tokio::time::sleep_until(until)));
                    sleep.as_mut().reset(until);
                    if sleep.as_mut().poll(cx).is_pending() {
                        state.waker = Some(cx.waker().clone());
                        return Poll::Pending;
                    }
                }
            }
            while state.released.len() < self.limit {
                let Some(key) = state.held.pop_front() else {
                    break;
                };
                if !state.holding.remove(&key) {
                    continue;
                }
                if state.held.is_empty() && state.held.capacity() > 1024 {
                    // A big listing handed on: its buffers are not kept at their peak.
                    state.held.shrink_to_fit();
                    state.holding.shrink_to_fit();
                }
                state.released.insert(key.clone());
                state.live_begun = 0;
                self.count(&state);
                let mut object = ObjectRef::<K>::new_with(&key.name, dt.clone());
                object.namespace = key.namespace;
                return Poll::Ready(Some(object));
            }
            state.waker = Some(cx.waker().clone());
            Poll::Pending
        })
    }

    /// How many objects are held.
    #[cfg(test)]
    fn held(&self) -> usize {
        self.lock().holding.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::{FutureExt, StreamExt};
    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::api::ObjectMeta;
    use std::sync::Arc;

    fn cm(name: &str) -> ConfigMap {
        ConfigMap {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("ns".into()),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn at_most_the_limit_is_handed_on_until_reconciles_begin() {
        let gate = Arc::new(Gate::new(2));
        let mut out = Box::pin(gate.clone().releases::<ConfigMap>(()));
        for i in 0..5 {
            gate.hold(&cm(&format!("o{i}")));
        }
        let first: Vec<String> = (0..2)
            .map(|_| out.next().now_or_never().flatten().unwrap().name)
            .collect();
        assert_eq!(first, ["o0", "o1"]);
        assert!(out.next().now_or_never().is_none(), "two are out");
        // A reconcile of something else makes no room.
        gate.started(&cm("other"));
        assert!(out.next().now_or_never().is_none());
        gate.started(&cm("o0"));
        assert_eq!(out.next().now_or_never().flatten().unwrap().name, "o2");
        // A live change of a held object takes it out of the gate.
        gate.pass(&cm("o3"));
        gate.begun(&ObjectKey::of(&cm("o1")));
        assert_eq!(out.next().now_or_never().flatten().unwrap().name, "o4");
        assert_eq!(gate.held(), 0);
        // A live change on its way holds the rest back until its reconcile begins.
        gate.started(&cm("o2"));
        gate.hold(&cm("y"));
        gate.live(&cm("z"));
        gate.started(&cm("o4"));
        assert!(out.next().now_or_never().is_none(), "z has not begun");
        gate.started(&cm("z"));
        assert_eq!(out.next().now_or_never().flatten().unwrap().name, "y");
        gate.started(&cm("y"));
        // Held twice: handed on once.
        gate.hold(&cm("x"));
        gate.hold(&cm("x"));
        assert_eq!(out.next().now_or_never().flatten().unwrap().name, "x");
        assert!(out.next().now_or_never().is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn a_live_change_that_never_begins_holds_the_gate_for_a_while_only() {
        let gate = Arc::new(Gate::new(1));
        let mut out = Box::pin(gate.clone().releases::<ConfigMap>(()));
        gate.live(&cm("lost"));
        gate.hold(&cm("a"));
        assert!(out.next().now_or_never().is_none());
        let started = Instant::now();
        assert_eq!(out.next().await.unwrap().name, "a");
        assert!(started.elapsed() >= LIVE_WAIT);
    }

    /// L5 of the 2026-11-27 core review: while live changes keep coming (one always on its
    /// way to a worker), a listed object is still handed on after every 16 of them begin.
    #[tokio::test(start_paused = true)]
    async fn a_stream_of_changes_lets_one_listed_object_through_every_sixteen() {
        let gate = Arc::new(Gate::new(2));
        let mut out = Box::pin(gate.clone().releases::<ConfigMap>(()));
        for i in 0..3 {
            gate.hold(&cm(&format!("listed-{i}")));
        }
        gate.live(&cm("change-0"));
        let mut handed = Vec::new();
        for i in 0..48 {
            // The next change is on its way before this one begins.
            gate.live(&cm(&format!("change-{}", i + 1)));
            gate.started(&cm(&format!("change-{i}")));
            while let Some(Some(object)) = out.next().now_or_never() {
                handed.push((i + 1, object.name.clone()));
                gate.started(&cm(&object.name));
            }
        }
        assert_eq!(
            handed,
            [
                (16, "listed-0".to_string()),
                (32, "listed-1".to_string()),
                (48, "listed-2".to_string())
            ]
        );
    }
}
