//! Watches restricted to some namespaces: which namespaces a kind is watched in
//! ([`Manager::namespaces`](crate::Manager::namespaces)), and one watch per namespace merged
//! into one stream that lists and changes as a single watch does.

use std::any::TypeId;
use std::collections::HashMap;
use std::sync::Arc;

use futures::stream::{self, BoxStream, SelectAll};
use futures::{Stream, StreamExt};
use kube::core::{ClusterResourceScope, NamespaceResourceScope};
use kube_runtime::watcher::Event;

use crate::cache::Watchable;

/// A set of namespaces, sorted, without duplicates; never empty.
pub(crate) type NamespaceSet = Arc<[String]>;

/// The namespaces each kind is watched in. A kind named on its own gets its own set (or all
/// namespaces); other namespaced kinds get the default, if one is set. Cluster-scoped kinds
/// are watched whole, even when named; a kind known only at run time gets a set only when
/// named on its own (its scope is not known before the API server is asked: naming a
/// cluster-scoped one is a mistake its watch reports as not found).
#[derive(Clone, Debug, Default)]
pub(crate) struct NamespaceScopes {
    default: Option<NamespaceSet>,
    /// By (API group, kind); `None` for every namespace.
    by_kind: HashMap<(String, String), Option<NamespaceSet>>,
}

impl NamespaceScopes {
    /// The set of `namespaces`, or `None` (every namespace) for an empty one.
    pub(crate) fn set(
        namespaces: impl IntoIterator<Item = impl Into<String>>,
    ) -> Option<NamespaceSet> {
        let mut list: Vec<String> = namespaces.into_iter().map(Into::into).collect();
        list.sort();
        list.dedup();
        (!list.is_empty()).then(|| list.into())
    }

    /// Every namespaced kind not named on its own is watched in `namespaces`.
    pub(crate) fn set_default(&mut self, namespaces: Option<NamespaceSet>) {
        self.default = namespaces;
    }

    /// The kind `kind` of `group` is watched in `namespaces` (`None`: all).
    pub(crate) fn set_for(&mut self, group: &str, kind: &str, namespaces: Option<NamespaceSet>) {
        self.by_kind
            .insert((group.to_string(), kind.to_string()), namespaces);
    }

    /// The namespaces `K` (of dynamic type `dt`) is watched in; `None` for all.
    pub(crate) fn of<K: Watchable>(&self, dt: &K::DynamicType) -> Option<NamespaceSet> {
        if self.default.is_none() && self.by_kind.is_empty() {
            return None;
        }
        // A cluster-scoped kind has no namespaces to restrict to (its URL has none).
        if TypeId::of::<K::Scope>() == TypeId::of::<ClusterResourceScope>() {
            return None;
        }
        let named = self
            .by_kind
            .get(&(K::group(dt).into_owned(), K::kind(dt).into_owned()));
        match named {
            Some(set) => set.clone(),
            None if TypeId::of::<K::Scope>() == TypeId::of::<NamespaceResourceScope>() => {
                self.default.clone()
            }
            None => None,
        }
    }
}

/// What one namespace's watch has shown so far.
struct Part<T> {
    /// Its objects by name.
    objects: HashMap<String, T>,
    /// A listing under way (from its `Init` to its `InitDone`).
    listing: Option<HashMap<String, T>>,
    /// Its first listing is in.
    listed: bool,
}

/// One stream of the watches of `parts` (one per namespace), with a single watch's
/// semantics: one listing (`Init`, `InitApply`*, `InitDone`) once every namespace has listed,
/// changes after it; a namespace that lists again later (after a watch gap) shows as the
/// changes that listing finds (each object it lists applied, each it lost deleted), so the
/// other namespaces' objects are neither listed nor announced again. Errors pass through.
/// `name` is an object's name (unique within one namespace's watch).
pub(crate) fn merged<T, E>(
    parts: Vec<BoxStream<'static, Result<Event<T>, E>>>,
    name: fn(&T) -> String,
) -> impl Stream<Item = Result<Event<T>, E>> + Send + 'static
where
    T: Clone + Send + 'static,
    E: Send + 'static,
{
    let count = parts.len();
    let tagged: SelectAll<_> = parts
        .into_iter()
        .enumerate()
        .map(|(i, part)| part.map(move |event| (i, event)).boxed())
        .collect();
    let mut state: Vec<Part<T>> = (0..count)
        .map(|_| Part {
            objects: HashMap::new(),
            listing: None,
            listed: false,
        })
        .collect();
    let mut synced = false;
    tagged.flat_map(move |(i, event)| {
        let mut out: Vec<Result<Event<T>, E>> = Vec::new();
        let part = &mut state[i];
        match event {
            Err(error) => out.push(Err(error)),
            Ok(Event::Init) => part.listing = Some(HashMap::new()),
            Ok(Event::InitApply(object)) => {
                part.listing
                    .get_or_insert_with(HashMap::new)
                    .insert(name(&object), object);
            }
            Ok(Event::InitDone) => {
                let listed = part.listing.take().unwrap_or_default();
                if synced {
                    for (key, old) in &part.objects {
                        if !listed.contains_key(key) {
                            out.push(Ok(Event::Delete(old.clone())));
                        }
                    }
                    out.extend(listed.values().cloned().map(|o| Ok(Event::Apply(o))));
                    part.objects = listed;
                } else {
                    part.objects = listed;
                    part.listed = true;
                    if state.iter().all(|p| p.listed) {
                        synced = true;
                        out.push(Ok(Event::Init));
                        for p in state.iter() {
                            out.extend(
                                p.objects.values().cloned().map(|o| Ok(Event::InitApply(o))),
                            );
                        }
                        out.push(Ok(Event::InitDone));
                    }
                }
            }
            Ok(Event::Apply(object)) => {
                part.objects.insert(name(&object), object.clone());
                if synced {
                    out.push(Ok(Event::Apply(object)));
                }
            }
            Ok(Event::Delete(object)) => {
                part.objects.remove(&name(&object));
                if synced {
                    out.push(Ok(Event::Delete(object)));
                }
            }
        }
        stream::iter(out)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::channel::mpsc;
    use k8s_openapi::api::core::v1::{ConfigMap, Node};
    use k8s_openapi::api::rbac::v1::ClusterRole;

    #[test]
    fn the_default_applies_to_namespaced_kinds_and_no_set_to_cluster_scoped_ones() {
        let mut scopes = NamespaceScopes::default();
        scopes.set_default(NamespaceScopes::set(["b", "a", "a"]));
        scopes.set_for(
            "rbac.authorization.k8s.io",
            "ClusterRole",
            NamespaceScopes::set(["x"]),
        );
        scopes.set_for("", "Secret", None);
        assert_eq!(
            scopes.of::<ConfigMap>(&()).as_deref(),
            Some(&["a".to_string(), "b".to_string()][..])
        );
        assert_eq!(
            scopes.of::<k8s_openapi::api::core::v1::Secret>(&()),
            None,
            "named: all"
        );
        assert_eq!(scopes.of::<Node>(&()), None);
        assert_eq!(
            scopes.of::<ClusterRole>(&()),
            None,
            "cluster-scoped even when named"
        );
        assert_eq!(NamespaceScopes::set(Vec::<String>::new()), None);
    }

    type Ev = Result<Event<(String, u32)>, String>;

    fn name(o: &(String, u32)) -> String {
        o.0.clone()
    }

    fn shape(event: &Ev) -> String {
        match event {
            Ok(Event::Init) => "Init".into(),
            Ok(Event::InitApply(o)) => format!("InitApply:{}@{}", o.0, o.1),
            Ok(Event::InitDone) => "Done".into(),
            Ok(Event::Apply(o)) => format!("Apply:{}@{}", o.0, o.1),
            Ok(Event::Delete(o)) => format!("Delete:{}", o.0),
            Err(e) => format!("Err:{e}"),
        }
    }

    fn obj(n: &str, v: u32) -> (String, u32) {
        (n.to_string(), v)
    }

    /// Takes the merged events that are ready now.
    async fn ready(merged: &mut (impl Stream<Item = Ev> + Unpin)) -> Vec<String> {
        let mut seen = Vec::new();
        while let Some(Some(event)) = futures::FutureExt::now_or_never(merged.next()) {
            seen.push(shape(&event));
        }
        seen
    }

    #[tokio::test]
    async fn one_listing_once_every_namespace_has_listed_then_changes() {
        let (a, a_rx) = mpsc::unbounded::<Ev>();
        let (b, b_rx) = mpsc::unbounded::<Ev>();
        let mut merged = Box::pin(merged(vec![a_rx.boxed(), b_rx.boxed()], name));
        for e in [Event::Init, Event::InitApply(obj("a1", 1)), Event::InitDone] {
            a.unbounded_send(Ok(e)).unwrap();
        }
        // `a` has listed and changes; nothing shows while `b` lists.
        a.unbounded_send(Ok(Event::Apply(obj("a2", 1)))).unwrap();
        a.unbounded_send(Ok(Event::Delete(obj("a1", 1)))).unwrap();
        b.unbounded_send(Err("b is forbidden".into())).unwrap();
        assert_eq!(ready(&mut merged).await, ["Err:b is forbidden"]);
        for e in [Event::Init, Event::InitApply(obj("b1", 1)), Event::InitDone] {
            b.unbounded_send(Ok(e)).unwrap();
        }
        let mut listing = ready(&mut merged).await;
        assert_eq!(listing.remove(0), "Init");
        assert_eq!(listing.pop().unwrap(), "Done");
        listing.sort();
        assert_eq!(listing, ["InitApply:a2@1", "InitApply:b1@1"]);
        b.unbounded_send(Ok(Event::Apply(obj("b1", 2)))).unwrap();
        assert_eq!(ready(&mut merged).await, ["Apply:b1@2"]);
    }

    #[tokio::test]
    async fn a_namespace_that_lists_again_shows_as_its_changes_only() {
        let (a, a_rx) = mpsc::unbounded::<Ev>();
        let (b, b_rx) = mpsc::unbounded::<Ev>();
        let mut merged = Box::pin(merged(vec![a_rx.boxed(), b_rx.boxed()], name));
        for e in [
            Event::Init,
            Event::InitApply(obj("a1", 1)),
            Event::InitApply(obj("a2", 1)),
            Event::InitDone,
        ] {
            a.unbounded_send(Ok(e)).unwrap();
        }
        for e in [Event::Init, Event::InitApply(obj("b1", 1)), Event::InitDone] {
            b.unbounded_send(Ok(e)).unwrap();
        }
        assert_eq!(ready(&mut merged).await.len(), 5);
        // `a` relists after a gap: a1 changed, a2 went, a3 came. Nothing of `b` shows.
        for e in [
            Event::Init,
            Event::InitApply(obj("a1", 2)),
            Event::InitApply(obj("a3", 1)),
        ] {
            a.unbounded_send(Ok(e)).unwrap();
        }
        assert!(
            ready(&mut merged).await.is_empty(),
            "nothing before the listing ends"
        );
        a.unbounded_send(Ok(Event::InitDone)).unwrap();
        let mut changes = ready(&mut merged).await;
        changes.sort();
        assert_eq!(changes, ["Apply:a1@2", "Apply:a3@1", "Delete:a2"]);
    }
}
