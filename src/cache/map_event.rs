//! Watch events with their object mapped to another type, for the layers between a watch
//! and a cache (trimmed decoding, shared sources, transforms).

use kube_runtime::watcher::Event;

/// `event` with its object mapped by `f`.
pub(crate) fn map_event<A, B>(event: Event<A>, f: impl FnOnce(A) -> B) -> Event<B> {
    match event {
        Event::Apply(o) => Event::Apply(f(o)),
        Event::Delete(o) => Event::Delete(f(o)),
        Event::Init => Event::Init,
        Event::InitApply(o) => Event::InitApply(f(o)),
        Event::InitDone => Event::InitDone,
    }
}

/// `event` with its object mapped by `f`; `None` if `f` gives none.
pub(crate) fn try_map_event<A, B>(
    event: Event<A>,
    f: impl FnOnce(A) -> Option<B>,
) -> Option<Event<B>> {
    Some(match event {
        Event::Apply(o) => Event::Apply(f(o)?),
        Event::Delete(o) => Event::Delete(f(o)?),
        Event::Init => Event::Init,
        Event::InitApply(o) => Event::InitApply(f(o)?),
        Event::InitDone => Event::InitDone,
    })
}
