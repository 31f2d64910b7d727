//! How a watch makes its first listing: as a streaming list (one watch request whose first
//! events are the current objects, ended by a bookmark) where the API server serves those,
//! in pages of a list request otherwise.
//!
//! A paged listing holds a whole page (500 objects by default) as JSON and again decoded
//! before the first of them reaches the cache; a streaming list decodes one object at a time.
//! kube-apiserver serves streaming lists from 1.27 behind the `WatchList` feature gate, on by
//! default in 1.32 and from 1.34 (off in 1.33). A server that does not serve them rejects the
//! request (422: `sendInitialEvents` or `resourceVersionMatch` forbidden for a watch); one that
//! ignores the parameters sends the objects but never the bookmark that ends the listing, and
//! the watch request ends without it. Either way the watch lists in pages from then on.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use futures::future::Either;
use futures::stream::BoxStream;
use futures::{Stream, StreamExt, TryStreamExt};
use kube::Resource;
use kube_runtime::watcher::{self, Event, InitialListStrategy};
use pin_project::pin_project;

use super::backoff::{Retrying, WatchBackoff};
use super::map_event::map_event;
use super::namespaces::{NamespaceSet, merged};
use super::transform::{self, Transform};
use super::trim::{InArc, Trimmed, Whole, decoded};
use super::watchable::Watchable;
use super::wire::{self, Watched};
use crate::client::requester::Requester;

/// What a watch lists: a kind (with its dynamic type) through a requester (a client, or the
/// service stack of one), in one namespace or in all.
pub(crate) struct Target<K: Watchable> {
    pub(crate) requester: Requester,
    pub(crate) dt: K::DynamicType,
    /// `None` for every namespace (and for cluster-scoped kinds).
    pub(crate) namespace: Option<String>,
}

impl<K: Watchable> Clone for Target<K> {
    fn clone(&self) -> Self {
        Self {
            requester: self.requester.clone(),
            dt: self.dt.clone(),
            namespace: self.namespace.clone(),
        }
    }
}

impl<K: Watchable> Target<K> {
    /// The kind across all namespaces.
    pub(crate) fn all(requester: impl Into<Requester>, dt: &K::DynamicType) -> Self {
        Self {
            requester: requester.into(),
            dt: dt.clone(),
            namespace: None,
        }
    }

    /// The kind in `namespace` (`None`: all).
    pub(crate) fn within(mut self, namespace: Option<&str>) -> Self {
        self.namespace = namespace.map(str::to_string);
        self
    }

    /// This target, watched as `W`, a wrapper of `K`.
    fn watched<W: Resource<DynamicType = K::DynamicType>>(&self) -> Watched<W> {
        Watched {
            requester: self.requester.clone(),
            dt: self.dt.clone(),
            namespace: self.namespace.clone(),
        }
    }
}

/// How a watch lists and decodes, and which cluster its log lines name.
#[derive(Clone, Debug)]
pub(crate) struct WatchOptions {
    /// List by a streaming list where the server serves them (and the configuration keeps
    /// bookmarks, which streaming lists need), in pages otherwise.
    pub(crate) streaming: bool,
    /// Decode objects without their managed fields ([`Trimmed`]).
    pub(crate) trim: bool,
    /// The cluster the log line of a fallback to pages names.
    pub(crate) cluster: Arc<str>,
}

/// A watcher ([`wire::watcher`], kube-runtime's protocol) of `target` for `config`, listing
/// by a streaming list when `options.streaming` (and `config` keeps bookmarks) and in pages
/// when the server turns out not to serve streaming lists. A `config` that asks for streaming
/// lists itself gets them whatever the options say, and no fallback: that is the caller's
/// choice.
pub(crate) fn watch<K: Watchable>(
    target: Target<K>,
    config: watcher::Config,
    options: &WatchOptions,
) -> Listing<K, impl Stream<Item = watcher::Result<Event<K>>> + Send + use<K>> {
    listing(target, config, options, open::<K>)
}

/// [`watch`], each object in an [`Arc`] from the moment it is decoded
/// ([`InArc`]), for the fleet's caches, which share them.
fn watch_shared<K: Watchable>(
    target: Target<K>,
    config: watcher::Config,
    options: &WatchOptions,
) -> Listing<K, impl Stream<Item = watcher::Result<Event<Arc<K>>>> + Send + use<K>> {
    listing(target, config, options, open_shared::<K>)
}

/// [`watch`] over the watchers `open` makes.
fn listing<K: Watchable, S>(
    target: Target<K>,
    config: watcher::Config,
    options: &WatchOptions,
    open: fn(&Target<K>, watcher::Config, bool) -> S,
) -> Listing<K, S> {
    let WatchOptions {
        streaming,
        trim,
        ref cluster,
    } = *options;
    let cluster = cluster.clone();
    let asked = config.initial_list_strategy == InitialListStrategy::StreamingList;
    let state = if asked || !streaming || !config.bookmarks {
        State::AsConfigured
    } else {
        State::Trying { listing: false }
    };
    let first = match state {
        State::Trying { .. } => config.clone().streaming_lists(),
        _ => config.clone(),
    };
    Listing {
        inner: open(&target, first, trim),
        open,
        cluster,
        target,
        trim,
        config,
        state,
    }
}

/// When the watches of a kind's namespaces wait out their own failures ([`Retrying`]).
#[derive(Clone, Copy)]
pub(crate) enum Retry<'a> {
    /// Every watch, a single one too: nothing after it retries.
    Each(&'a WatchBackoff),
    /// Only merged namespaces' watches, so that one failing namespace neither holds up the
    /// others nor is retried at their pace; a single watch is left to the caller's backoff.
    WhenMerged(&'a WatchBackoff),
}

/// The watches `one` opens, one per namespace of `namespaces` (one of all namespaces if
/// `None`), merged into one stream with a single watch's semantics ([`merged`]) when there
/// are several. `name` is an object's name.
fn per_namespace<T: Clone + Send + 'static>(
    namespaces: Option<&[String]>,
    retry: Retry<'_>,
    name: fn(&T) -> String,
    one: impl Fn(Option<&str>) -> BoxStream<'static, watcher::Result<Event<T>>>,
) -> BoxStream<'static, watcher::Result<Event<T>>> {
    let retried = |backoff: &WatchBackoff, namespace: Option<&str>| {
        Retrying::new(one(namespace), backoff.delays()).boxed()
    };
    match (namespaces, retry) {
        (None, Retry::Each(backoff)) => retried(backoff, None),
        (None, Retry::WhenMerged(_)) => one(None),
        (Some([namespace]), Retry::Each(backoff)) => retried(backoff, Some(namespace)),
        (Some([namespace]), Retry::WhenMerged(_)) => one(Some(namespace)),
        (Some(list), Retry::Each(backoff) | Retry::WhenMerged(backoff)) => {
            let parts = list.iter().map(|ns| retried(backoff, Some(ns))).collect();
            merged(parts, name).boxed()
        }
    }
}

/// [`watch`] of `target` in each of `namespaces` (all if `None`), merged when there are
/// several; a single watch is left to the caller's backoff (single mode's controller has
/// its own).
pub(crate) fn scoped<K: Watchable>(
    target: Target<K>,
    namespaces: Option<NamespaceSet>,
    config: watcher::Config,
    options: &WatchOptions,
    backoff: &WatchBackoff,
) -> BoxStream<'static, watcher::Result<Event<K>>> {
    per_namespace(
        namespaces.as_deref(),
        Retry::WhenMerged(backoff),
        |o: &K| o.meta().name.clone().unwrap_or_default(),
        |namespace| watch(target.clone().within(namespace), config.clone(), options).boxed(),
    )
}

/// The fleet's caches' watch of `target` in each of `namespaces` (all if `None`): each
/// object in an [`Arc`] from the moment it is decoded ([`InArc`]) and transformed
/// there, every namespace's watch retried after its own failures, merged when there are
/// several.
pub(crate) fn shared<K: Watchable>(
    target: Target<K>,
    namespaces: Option<NamespaceSet>,
    config: watcher::Config,
    options: &WatchOptions,
    backoff: &WatchBackoff,
    transform: Option<Transform<K>>,
) -> BoxStream<'static, watcher::Result<Event<Arc<K>>>> {
    per_namespace(
        namespaces.as_deref(),
        Retry::Each(backoff),
        |o: &Arc<K>| o.meta().name.clone().unwrap_or_default(),
        |namespace| watch_shared(target.clone().within(namespace), config.clone(), options).boxed(),
    )
    .map_ok(move |event| map_event(event, |o| transform::shared(o, transform.as_ref())))
    .boxed()
}

/// The watcher of `target` ([`wire::watcher`]), of objects decoded without managed fields if
/// `trim`.
fn open<K: Watchable>(
    target: &Target<K>,
    config: watcher::Config,
    trim: bool,
) -> impl Stream<Item = watcher::Result<Event<K>>> + Send + use<K> {
    if trim {
        let watched = target.watched::<Trimmed<K>>();
        Either::Left(wire::watcher(watched, config).map_ok(decoded as fn(_) -> _))
    } else {
        let watched = target.watched::<Whole<K>>();
        Either::Right(wire::watcher(watched, config).map_ok(decoded as fn(_) -> _))
    }
}

/// [`open`], each object in an [`Arc`] from the moment it is decoded.
fn open_shared<K: Watchable>(
    target: &Target<K>,
    config: watcher::Config,
    trim: bool,
) -> impl Stream<Item = watcher::Result<Event<Arc<K>>>> + Send + use<K> {
    if trim {
        let watched = target.watched::<InArc<Trimmed<K>>>();
        Either::Left(wire::watcher(watched, config).map_ok(decoded as fn(_) -> _))
    } else {
        let watched = target.watched::<InArc<Whole<K>>>();
        Either::Right(wire::watcher(watched, config).map_ok(decoded as fn(_) -> _))
    }
}

/// See [`watch`].
#[pin_project]
pub(crate) struct Listing<K: Watchable, S> {
    #[pin]
    inner: S,
    /// [`open`] (a pointer, so that the stream type can be named).
    open: fn(&Target<K>, watcher::Config, bool) -> S,
    cluster: Arc<str>,
    target: Target<K>,
    /// Objects are decoded without managed fields.
    trim: bool,
    /// The caller's configuration, as given.
    config: watcher::Config,
    state: State,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Streaming lists, not yet known to work; `listing` while one is under way.
    Trying { listing: bool },
    /// Streaming lists work on this server: they stay.
    Streaming,
    /// The configuration's own strategy (or pages after a fallback).
    AsConfigured,
}

impl<K, S> Listing<K, S>
where
    K: Watchable,
{
    /// Whether `event` shows that the server does not serve streaming lists.
    fn unsupported<O>(state: State, event: &watcher::Result<Event<O>>) -> bool {
        let State::Trying { listing } = state else {
            return false;
        };
        match event {
            // Rejected: the parameters are invalid (422) or not understood (400) here.
            Err(watcher::Error::WatchStartFailed(kube::Error::Api(status))) => {
                status.code == 422 || status.code == 400
            }
            // A new listing while one was under way, with no error in between: the request
            // ended cleanly without the bookmark that closes a streaming list.
            Ok(Event::Init) => listing,
            _ => false,
        }
    }
}

impl<K, O, S> Stream for Listing<K, S>
where
    K: Watchable,
    S: Stream<Item = watcher::Result<Event<O>>>,
{
    type Item = watcher::Result<Event<O>>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let mut this = self.project();
        loop {
            let Some(event) = ready!(this.inner.as_mut().poll_next(cx)) else {
                return Poll::Ready(None);
            };
            if Self::unsupported(*this.state, &event) {
                tracing::info!(
                    cluster = %this.cluster,
                    kind = %K::kind(&this.target.dt),
                    reason = %match &event {
                        Err(error) => error.to_string(),
                        Ok(_) => "the listing ended without its closing bookmark".to_string(),
                    },
                    "the API server does not serve streaming lists; this watch lists in pages"
                );
                *this.state = State::AsConfigured;
                this.inner
                    .set((this.open)(this.target, this.config.clone(), *this.trim));
                continue;
            }
            if let State::Trying { listing } = this.state {
                match &event {
                    Ok(Event::Init) => *listing = true,
                    Ok(Event::InitDone) => *this.state = State::Streaming,
                    // A listing cut short by an error (a dropped connection) says nothing
                    // about the server: the next one tries again.
                    Err(_) => *listing = false,
                    _ => {}
                }
            }
            return Poll::Ready(Some(event));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use futures::StreamExt;
    use futures::stream::{self, BoxStream};
    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::core::Status;

    use super::*;

    type Events = BoxStream<'static, watcher::Result<Event<ConfigMap>>>;

    fn object(name: &str) -> ConfigMap {
        let mut cm = ConfigMap::default();
        cm.metadata.name = Some(name.into());
        cm
    }

    fn refused(code: u16, reason: &str) -> watcher::Result<Event<ConfigMap>> {
        Err(watcher::Error::WatchStartFailed(kube::Error::Api(
            Status::failure("refused", reason).with_code(code).boxed(),
        )))
    }

    /// A target whose client is never called: the streams below are canned.
    fn target() -> Target<ConfigMap> {
        let service = tower::service_fn(|_: http::Request<kube::client::Body>| async {
            Err::<http::Response<kube::client::Body>, _>(std::io::Error::other("no server"))
        });
        Target::all(kube::Client::new(service, "default"), &())
    }

    /// What the events the listing passes on look like: `Init`, `Apply:a`, `Done`, `Err`.
    async fn shapes(listing: impl Stream<Item = watcher::Result<Event<ConfigMap>>>) -> Vec<String> {
        listing
            .map(|event| match event {
                Ok(Event::Init) => "Init".to_string(),
                Ok(Event::InitApply(o)) => format!("InitApply:{}", o.metadata.name.unwrap()),
                Ok(Event::InitDone) => "Done".to_string(),
                Ok(Event::Apply(o)) => format!("Apply:{}", o.metadata.name.unwrap()),
                Ok(Event::Delete(o)) => format!("Delete:{}", o.metadata.name.unwrap()),
                Err(_) => "Err".to_string(),
            })
            .collect()
            .await
    }

    /// A listing over `first` (as if it were the streaming watcher) that falls back to `open`.
    fn listing(
        first: Vec<watcher::Result<Event<ConfigMap>>>,
        open: fn(&Target<ConfigMap>, watcher::Config, bool) -> Events,
    ) -> Listing<ConfigMap, Events> {
        Listing {
            inner: stream::iter(first).boxed(),
            open,
            cluster: "test".into(),
            target: target(),
            trim: false,
            config: watcher::Config::default(),
            state: State::Trying { listing: false },
        }
    }

    static OPENED_A: AtomicUsize = AtomicUsize::new(0);
    static OPENED_B: AtomicUsize = AtomicUsize::new(0);

    fn paged(config: watcher::Config, opened: &'static AtomicUsize) -> Events {
        assert_eq!(
            config.initial_list_strategy,
            InitialListStrategy::ListWatch,
            "the fallback lists in pages"
        );
        opened.fetch_add(1, Ordering::SeqCst);
        stream::iter(vec![
            Ok(Event::Init),
            Ok(Event::InitApply(object("a"))),
            Ok(Event::InitDone),
        ])
        .boxed()
    }

    #[tokio::test]
    async fn a_streaming_list_refused_or_left_unfinished_falls_back_to_pages() {
        // Refused (422): the error is not passed on; the paged listing is.
        let events = shapes(listing(vec![refused(422, "Invalid")], |_, c, _| {
            paged(c, &OPENED_A)
        }))
        .await;
        assert_eq!(events, ["Init", "InitApply:a", "Done"]);
        assert_eq!(OPENED_A.load(Ordering::SeqCst), 1);
        // Ignored: objects came, then a new listing began without the closing bookmark.
        let events = shapes(listing(
            vec![
                Ok(Event::Init),
                Ok(Event::InitApply(object("a"))),
                Ok(Event::Init),
                Ok(Event::InitApply(object("never"))),
            ],
            |_, c, _| paged(c, &OPENED_B),
        ))
        .await;
        assert_eq!(
            events,
            ["Init", "InitApply:a", "Init", "InitApply:a", "Done"]
        );
        assert_eq!(OPENED_B.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn a_streaming_list_that_works_stays_and_other_errors_do_not_switch() {
        static UNUSED: AtomicUsize = AtomicUsize::new(0);
        let events = vec![
            // A listing cut by an error, then started again: not a server without them.
            Ok(Event::Init),
            Ok(Event::InitApply(object("b"))),
            Err(watcher::Error::WatchFailed(kube::Error::Api(
                Status::failure("reset", "InternalError")
                    .with_code(500)
                    .boxed(),
            ))),
            // Forbidden and unreachable are retried as they are: not a missing feature.
            refused(403, "Forbidden"),
            Err(watcher::Error::WatchStartFailed(kube::Error::Api(
                Status::failure("down", "ServiceUnavailable")
                    .with_code(503)
                    .boxed(),
            ))),
            Ok(Event::Init),
            Ok(Event::InitApply(object("b"))),
            Ok(Event::InitDone),
            Ok(Event::Apply(object("b"))),
            // A relist after 410 Gone: listed by streaming again, a 422 now is an error.
            Ok(Event::Init),
            refused(422, "Invalid"),
        ];
        let events = shapes(listing(events, |_, c, _| paged(c, &UNUSED))).await;
        assert_eq!(
            events,
            [
                "Init",
                "InitApply:b",
                "Err",
                "Err",
                "Err",
                "Init",
                "InitApply:b",
                "Done",
                "Apply:b",
                "Init",
                "Err"
            ]
        );
        assert_eq!(UNUSED.load(Ordering::SeqCst), 0, "never fell back");
    }

    #[test]
    fn streaming_is_asked_for_only_with_bookmarks_and_unless_the_config_chose() {
        let state = |config: watcher::Config, streaming| {
            tokio::runtime::Builder::new_current_thread()
                .build()
                .unwrap()
                .block_on(async {
                    let options = WatchOptions {
                        streaming,
                        trim: false,
                        cluster: "test".into(),
                    };
                    watch(target(), config, &options).state
                })
        };
        assert_eq!(
            state(watcher::Config::default(), true),
            State::Trying { listing: false }
        );
        assert_eq!(
            state(watcher::Config::default(), false),
            State::AsConfigured
        );
        assert_eq!(
            state(watcher::Config::default().disable_bookmarks(), true),
            State::AsConfigured
        );
        assert_eq!(
            state(watcher::Config::default().streaming_lists(), false),
            State::AsConfigured
        );
    }
}
