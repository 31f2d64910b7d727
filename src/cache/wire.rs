//! The watch protocol of the fleet's caches, spoken over a cluster's service stack.
//!
//! It behaves as kube-runtime's `watcher` does (the same [`Event`]s and errors, the same
//! recovery: a dropped watch resumes from the last resourceVersion seen, a 410 Gone lists
//! again, a watch that goes silent past its timeout is opened again), with two differences
//! that matter at a thousand clusters:
//!
//! - It sends its requests through a [`Requester`](crate::client::requester::Requester): the cluster's tower stack (rate limit,
//!   metrics, authentication, the shared transport) without the request buffer every
//!   `kube::Client` carries (a channel of 32 request slots and a task, about 10 KB). A
//!   cluster whose reconcilers never ask for its client never makes one.
//! - It reads watch events with [`Lines`], which decodes each line from the body's own chunk
//!   where the line is whole and keeps no buffer while the watch waits: kube's reader keeps
//!   an 8 KiB line buffer for the life of each watch request, and copies every line into a
//!   `String` first.

use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::Bytes;
use futures::{Stream, StreamExt};
use kube::api::{ListParams, VersionMatch, WatchParams};
use kube::core::{ObjectList, Status, WatchEvent};
use kube::{Resource, ResourceExt};
use kube_runtime::watcher::{self, Event, InitialListStrategy, ListSemantic};
use serde::de::DeserializeOwned;
use tower::BoxError;

use crate::client::requester::{Requester, ResponseBody, collect};

/// The lines of a body (a watch response: one JSON event per line).
///
/// A line that lies whole in one chunk of the body is a slice of that chunk; only a line cut
/// between chunks is copied, into `partial`. Between lines it holds nothing but the rest of
/// the chunk it is reading: once that is read, no memory of the body stays with it.
pub(crate) struct Lines<B> {
    body: B,
    /// What is left of the chunk being read.
    chunk: Bytes,
    /// The start of a line whose end has not come yet.
    partial: Vec<u8>,
    ended: bool,
}

impl<B> Lines<B>
where
    B: http_body::Body<Data = Bytes> + Unpin,
{
    pub(crate) fn new(body: B) -> Self {
        Self {
            body,
            chunk: Bytes::new(),
            partial: Vec::new(),
            ended: false,
        }
    }

    /// The next line, without its line break; after the body's last, what followed its
    /// last line break, if anything. An error of the body ends the lines.
    pub(crate) fn poll_line(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Bytes, B::Error>>> {
        loop {
            if !self.chunk.is_empty() {
                match memchr::memchr(b'\n', &self.chunk) {
                    Some(end) => {
                        let line = self.chunk.split_to(end + 1);
                        let line = if self.partial.is_empty() {
                            line.slice(..end)
                        } else {
                            self.partial.extend_from_slice(&line[..end]);
                            Bytes::from(std::mem::take(&mut self.partial))
                        };
                        return Poll::Ready(Some(Ok(trim_cr(line))));
                    }
                    None => {
                        self.partial.extend_from_slice(&self.chunk);
                        self.chunk = Bytes::new();
                    }
                }
            }
            if self.ended {
                if self.partial.is_empty() {
                    return Poll::Ready(None);
                }
                return Poll::Ready(Some(Ok(trim_cr(Bytes::from(std::mem::take(
                    &mut self.partial,
                ))))));
            }
            match ready!(Pin::new(&mut self.body).poll_frame(cx)) {
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        self.chunk = data;
                    }
                }
                Some(Err(error)) => {
                    self.ended = true;
                    self.partial = Vec::new();
                    return Poll::Ready(Some(Err(error)));
                }
                None => self.ended = true,
            }
        }
    }
}

fn trim_cr(line: Bytes) -> Bytes {
    match line.last() {
        Some(b'\r') => line.slice(..line.len() - 1),
        _ => line,
    }
}

/// The events of a watch response, decoded as `W`.
pub(crate) struct Events<W> {
    lines: Lines<ResponseBody>,
    _decoded: std::marker::PhantomData<fn() -> W>,
}

impl<W: DeserializeOwned> Events<W> {
    fn new(body: ResponseBody) -> Self {
        Self {
            lines: Lines::new(body),
            _decoded: std::marker::PhantomData,
        }
    }
}

impl<W: DeserializeOwned> Stream for Events<W> {
    type Item = kube::Result<WatchEvent<W>>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        loop {
            let line = match ready!(this.lines.poll_line(cx)) {
                None => return Poll::Ready(None),
                Some(Ok(line)) => line,
                Some(Err(error)) => match read_error(error) {
                    // Ends the response: the watch resumes from where it was.
                    None => return Poll::Ready(None),
                    Some(error) => return Poll::Ready(Some(Err(error))),
                },
            };
            if line.is_empty() {
                continue;
            }
            let line = match text(&line) {
                Ok(line) => line,
                Err(error) => return Poll::Ready(Some(Err(error))),
            };
            match serde_json::from_str::<WatchEvent<W>>(line) {
                Ok(event) => return Poll::Ready(Some(Ok(event))),
                // A line cut off by the end of the response.
                Err(error) if error.is_eof() => continue,
                Err(error) => {
                    if let Ok(status) = serde_json::from_str::<Status>(line) {
                        return Poll::Ready(Some(Err(kube::Error::Api(status.boxed()))));
                    }
                    return Poll::Ready(Some(Err(kube::Error::SerdeError(error))));
                }
            }
        }
    }
}

/// `bytes` as text, checked as UTF-8 once: decoding from a `str` then checks no string of
/// it on its own.
fn text(bytes: &[u8]) -> kube::Result<&str> {
    std::str::from_utf8(bytes).map_err(|error| {
        kube::Error::ReadEvents(std::io::Error::new(std::io::ErrorKind::InvalidData, error))
    })
}

/// What a failed read of a watch response is: `None` for the connection ending under it (the
/// watch resumes, as kube's reader does on an unexpected EOF), a
/// [`kube::Error::ReadEvents`] otherwise (a read timeout included: the watch reports it and
/// waits out its backoff).
fn read_error(error: BoxError) -> Option<kube::Error> {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&*error);
    while let Some(error) = source {
        if let Some(io) = error.downcast_ref::<std::io::Error>()
            && io.kind() == std::io::ErrorKind::UnexpectedEof
        {
            tracing::debug!(error = %io, "a watch response ended early; resuming");
            return None;
        }
        source = error.source();
    }
    if error.to_string().contains("unexpected EOF during chunk") {
        return None;
    }
    Some(kube::Error::ReadEvents(std::io::Error::other(error)))
}

/// What a watcher watches: a resource's path and how its requests go.
pub(crate) struct Watched<W: Resource> {
    pub(crate) requester: Requester,
    pub(crate) dt: W::DynamicType,
    pub(crate) namespace: Option<String>,
}

impl<W: Resource> Watched<W> {
    fn request(&self) -> kube::core::Request {
        kube::core::Request::new(W::url_path(&self.dt, self.namespace.as_deref()))
    }

    async fn list(&self, params: &ListParams) -> kube::Result<ObjectList<W>>
    where
        W: DeserializeOwned + Clone,
    {
        let request = if W::metadata_api() {
            self.request().list_metadata(params)
        } else {
            self.request().list(params)
        };
        let mut request = request.map_err(kube::Error::BuildRequest)?;
        request.extensions_mut().insert("list");
        let body = self.requester.send(request).await?.into_body();
        let bytes = collect(body).await?;
        serde_json::from_str(text(&bytes)?).map_err(kube::Error::SerdeError)
    }

    async fn watch(&self, params: &WatchParams, version: &str) -> kube::Result<Pin<Box<Events<W>>>>
    where
        W: DeserializeOwned,
    {
        let request = if W::metadata_api() {
            self.request().watch_metadata(params, version)
        } else {
            self.request().watch(params, version)
        };
        let mut request = request.map_err(kube::Error::BuildRequest)?;
        request.extensions_mut().insert("watch");
        // One JSON event per line, uncompressed (kube asks the same of its watches).
        request
            .headers_mut()
            .entry(http::header::ACCEPT_ENCODING)
            .or_insert(http::HeaderValue::from_static("identity"));
        let body = self.requester.send(request).await?.into_body();
        Ok(Box::pin(Events::new(body)))
    }
}

/// Where a watcher is.
enum Phase<W> {
    /// Nothing listed yet (or a relist is due): the next step lists from scratch.
    Start,
    /// Listing in pages: `objects` of the current page are still to be handed out.
    Paging {
        continue_token: Option<String>,
        objects: std::vec::IntoIter<W>,
        version: Option<String>,
    },
    /// A streaming list: its first events are the current objects, up to the bookmark that
    /// ends them.
    Streaming(Pin<Box<Events<W>>>),
    /// Listed at `version`: the next step opens a watch from there.
    Listed(String),
    /// Watching from `version` (the last resourceVersion seen).
    Watching(String, Pin<Box<Events<W>>>),
}

/// A watch's idle limit beyond its server-side timeout: a connection that goes silent for the
/// server's timeout and this much more is taken as dead (kube-runtime's margin).
const IDLE_MARGIN: Duration = Duration::from_secs(5);

/// The events of a watch of `watched` under `config`, as kube-runtime's `watcher` gives them
/// (see the module's documentation for what differs underneath).
pub(crate) fn watcher<W>(
    watched: Watched<W>,
    config: watcher::Config,
) -> impl Stream<Item = watcher::Result<Event<W>>> + Send + 'static
where
    W: Resource + DeserializeOwned + Clone + Send + 'static,
    W::DynamicType: Send + Sync + 'static,
{
    let idle = match config.timeout {
        Some(0) => None,
        timeout => Some(Duration::from_secs(u64::from(timeout.unwrap_or(290))) + IDLE_MARGIN),
    };
    let machine = Machine {
        watched,
        config,
        idle,
    };
    futures::stream::unfold((machine, Phase::Start), |(machine, phase)| async move {
        let mut phase = phase;
        loop {
            let (event, next) = machine.step(phase).await;
            phase = next;
            if let Some(event) = event {
                return Some((event, (machine, phase)));
            }
        }
    })
}

struct Machine<W: Resource> {
    watched: Watched<W>,
    config: watcher::Config,
    idle: Option<Duration>,
}

impl<W> Machine<W>
where
    W: Resource + DeserializeOwned + Clone + Send + 'static,
{
    fn list_params(&self, continue_token: Option<String>) -> ListParams {
        let (resource_version, version_match) = match self.config.list_semantic {
            ListSemantic::Any => (Some("0".to_string()), Some(VersionMatch::NotOlderThan)),
            ListSemantic::MostRecent => (None, None),
        };
        ListParams {
            label_selector: self.config.label_selector.clone(),
            field_selector: self.config.field_selector.clone(),
            version_match,
            resource_version,
            limit: self.config.page_size,
            continue_token,
            ..ListParams::default()
        }
    }

    fn watch_params(&self, initial_events: bool) -> WatchParams {
        WatchParams {
            label_selector: self.config.label_selector.clone(),
            field_selector: self.config.field_selector.clone(),
            timeout: self.config.timeout,
            bookmarks: self.config.bookmarks,
            send_initial_events: initial_events,
        }
    }

    /// The next event of `events`; `None` once it ends, or goes silent past the idle limit.
    async fn next(&self, events: &mut Pin<Box<Events<W>>>) -> Option<kube::Result<WatchEvent<W>>> {
        match self.idle {
            None => events.next().await,
            Some(limit) => tokio::time::timeout(limit, events.next())
                .await
                .unwrap_or_else(|_| {
                    tracing::debug!(
                        seconds = limit.as_secs(),
                        "a watch went silent; opening it again"
                    );
                    None
                }),
        }
    }

    /// One step: an event to hand out (or none yet) and the phase after it.
    async fn step(&self, phase: Phase<W>) -> (Option<watcher::Result<Event<W>>>, Phase<W>) {
        match phase {
            Phase::Start => self.start().await,
            Phase::Paging {
                continue_token,
                objects,
                version,
            } => self.page(continue_token, objects, version).await,
            Phase::Streaming(events) => self.streaming(events).await,
            Phase::Listed(version) => self.open(version).await,
            Phase::Watching(version, events) => self.watching(version, events).await,
        }
    }

    /// A listing from scratch: in pages, or as a streaming list.
    async fn start(&self) -> (Option<watcher::Result<Event<W>>>, Phase<W>) {
        match self.config.initial_list_strategy {
            InitialListStrategy::ListWatch => (
                Some(Ok(Event::Init)),
                Phase::Paging {
                    continue_token: None,
                    objects: Vec::new().into_iter(),
                    version: None,
                },
            ),
            InitialListStrategy::StreamingList => {
                match Box::pin(self.watched.watch(&self.watch_params(true), "0")).await {
                    Ok(events) => (Some(Ok(Event::Init)), Phase::Streaming(events)),
                    Err(error) => {
                        logged(&error, "starting a streaming list");
                        (
                            Some(Err(watcher::Error::WatchStartFailed(error))),
                            Phase::Start,
                        )
                    }
                }
            }
        }
    }

    /// The next object of the current page, or the next page, or the listing's end.
    async fn page(
        &self,
        continue_token: Option<String>,
        mut objects: std::vec::IntoIter<W>,
        version: Option<String>,
    ) -> (Option<watcher::Result<Event<W>>>, Phase<W>) {
        if let Some(object) = objects.next() {
            let next = Phase::Paging {
                continue_token,
                objects,
                version,
            };
            return (Some(Ok(Event::InitApply(object))), next);
        }
        if continue_token.is_none()
            && let Some(version) = version
        {
            return (Some(Ok(Event::InitDone)), Phase::Listed(version));
        }
        match Box::pin(self.watched.list(&self.list_params(continue_token))).await {
            Ok(list) => {
                let version = list.metadata.resource_version.filter(|v| !v.is_empty());
                let continue_token = list.metadata.continue_.filter(|t| !t.is_empty());
                if version.is_none() && continue_token.is_none() {
                    return (Some(Err(watcher::Error::NoResourceVersion)), Phase::Start);
                }
                let next = Phase::Paging {
                    continue_token,
                    objects: list.items.into_iter(),
                    version,
                };
                (None, next)
            }
            Err(error) => {
                logged(&error, "listing");
                (
                    Some(Err(watcher::Error::InitialListFailed(error))),
                    Phase::Start,
                )
            }
        }
    }

    /// The next event of a streaming list, up to the bookmark that ends it.
    async fn streaming(
        &self,
        mut events: Pin<Box<Events<W>>>,
    ) -> (Option<watcher::Result<Event<W>>>, Phase<W>) {
        match self.next(&mut events).await {
            Some(Ok(WatchEvent::Added(object) | WatchEvent::Modified(object))) => {
                (Some(Ok(Event::InitApply(object))), Phase::Streaming(events))
            }
            Some(Ok(WatchEvent::Deleted(_))) => {
                // The API server sends none while listing; nothing to remove yet anyway.
                tracing::warn!("a streaming list sent a deletion; ignored");
                (None, Phase::Streaming(events))
            }
            Some(Ok(WatchEvent::Bookmark(mark))) => {
                if mark
                    .metadata
                    .annotations
                    .contains_key("k8s.io/initial-events-end")
                {
                    let version = mark.metadata.resource_version;
                    (Some(Ok(Event::InitDone)), Phase::Watching(version, events))
                } else {
                    (None, Phase::Streaming(events))
                }
            }
            Some(Ok(WatchEvent::Error(status))) => {
                status_logged(&status);
                let next = if status.code == 410 {
                    Phase::Start
                } else {
                    Phase::Streaming(events)
                };
                (Some(Err(watcher::Error::WatchError(status.boxed()))), next)
            }
            Some(Err(error)) => {
                logged(&error, "reading a streaming list");
                (
                    Some(Err(watcher::Error::WatchFailed(error))),
                    Phase::Streaming(events),
                )
            }
            // Ended before its closing bookmark: the listing starts again.
            None => (None, Phase::Start),
        }
    }

    /// A watch opened from `version`.
    async fn open(&self, version: String) -> (Option<watcher::Result<Event<W>>>, Phase<W>) {
        match Box::pin(self.watched.watch(&self.watch_params(false), &version)).await {
            Ok(events) => (None, Phase::Watching(version, events)),
            Err(error) => {
                logged(&error, "starting a watch");
                (
                    Some(Err(watcher::Error::WatchStartFailed(error))),
                    Phase::Listed(version),
                )
            }
        }
    }

    /// The next change of a watch from `version`.
    async fn watching(
        &self,
        version: String,
        mut events: Pin<Box<Events<W>>>,
    ) -> (Option<watcher::Result<Event<W>>>, Phase<W>) {
        match self.next(&mut events).await {
            Some(Ok(WatchEvent::Added(object) | WatchEvent::Modified(object))) => {
                match seen_version(&object) {
                    Some(seen) => (
                        Some(Ok(Event::Apply(object))),
                        Phase::Watching(seen, events),
                    ),
                    None => (Some(Err(watcher::Error::NoResourceVersion)), Phase::Start),
                }
            }
            Some(Ok(WatchEvent::Deleted(object))) => match seen_version(&object) {
                Some(seen) => (
                    Some(Ok(Event::Delete(object))),
                    Phase::Watching(seen, events),
                ),
                None => (Some(Err(watcher::Error::NoResourceVersion)), Phase::Start),
            },
            Some(Ok(WatchEvent::Bookmark(mark))) => (
                None,
                Phase::Watching(mark.metadata.resource_version, events),
            ),
            Some(Ok(WatchEvent::Error(status))) => {
                status_logged(&status);
                // 410 Gone: the version is out of the server's window; list again.
                let next = if status.code == 410 {
                    Phase::Start
                } else {
                    Phase::Watching(version, events)
                };
                (Some(Err(watcher::Error::WatchError(status.boxed()))), next)
            }
            Some(Err(error)) => {
                logged(&error, "reading a watch");
                (
                    Some(Err(watcher::Error::WatchFailed(error))),
                    Phase::Watching(version, events),
                )
            }
            None => (None, Phase::Listed(version)),
        }
    }
}

/// The resourceVersion of `object`, if it has one.
fn seen_version<W: Resource>(object: &W) -> Option<String> {
    object.resource_version().filter(|v| !v.is_empty())
}

/// A failed request, logged as kube-runtime's watcher logs it: a refusal (403) as a warning,
/// anything else at debug (the caller reports it).
fn logged(error: &kube::Error, doing: &str) {
    // Through the redaction: a host client (sharding's group watch) is the user's own, not
    // wrapped by the crate, and its exec plugin's failure quotes its command line and output.
    let shown = crate::client::Shown(error);
    if matches!(error, kube::Error::Api(status) if status.is_forbidden()) {
        tracing::warn!(error = %shown, "{doing}: forbidden");
    } else {
        tracing::debug!(error = %shown, "{doing} failed");
    }
}

fn status_logged(status: &Status) {
    if status.code == 403 {
        tracing::warn!(message = %status.message, "a watch was refused (403)");
    } else {
        tracing::debug!(code = status.code, message = %status.message, "a watch reported an error");
    }
}

#[cfg(test)]
mod tests {
    use std::task::Poll;

    #[test]
    fn a_host_clients_plugin_failure_is_logged_without_its_text() {
        use std::os::unix::process::ExitStatusExt as _;
        #[derive(Clone, Default)]
        struct Buffer(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);
        impl std::io::Write for Buffer {
            fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(bytes);
                Ok(bytes.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let buffer = Buffer::default();
        let writer = buffer.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::DEBUG)
            .with_writer(move || writer.clone())
            .finish();
        let failure = kube::client::AuthError::AuthExecRun {
            cmd: "plugin --secret=MARKER-ARG".into(),
            out: Box::new(std::process::Output {
                status: std::process::ExitStatus::from_raw(256),
                stdout: b"MARKER-OUT".to_vec(),
                stderr: Vec::new(),
            }),
        };
        tracing::subscriber::with_default(subscriber, || {
            super::logged(&kube::Error::Auth(failure), "listing the group's Leases");
        });
        let text = String::from_utf8(buffer.0.lock().unwrap().clone()).unwrap();
        assert!(text.contains("listing the group's Leases failed"), "{text}");
        assert!(!text.contains("MARKER"), "{text}");
    }

    use bytes::Bytes;
    use futures::StreamExt;
    use http_body::Frame;
    use http_body_util::StreamBody;
    use k8s_openapi::api::core::v1::ConfigMap;

    use super::*;

    type Chunks = futures::channel::mpsc::UnboundedSender<Result<Frame<Bytes>, BoxError>>;

    fn body() -> (Chunks, ResponseBody) {
        let (tx, rx) = futures::channel::mpsc::unbounded();
        (tx, Box::pin(StreamBody::new(rx)))
    }

    fn send(tx: &Chunks, text: &'static str) {
        tx.unbounded_send(Ok(Frame::data(Bytes::from_static(text.as_bytes()))))
            .unwrap();
    }

    async fn line(lines: &mut Lines<ResponseBody>) -> Option<String> {
        futures::future::poll_fn(|cx| lines.poll_line(cx))
            .await
            .map(|line| String::from_utf8(line.unwrap().to_vec()).unwrap())
    }

    /// Lines whole in a chunk, cut between chunks, ended by `\r\n`, and the last one without
    /// a line break: each comes out once, in order, without its break.
    #[tokio::test]
    async fn lines_come_out_whole_wherever_the_chunks_cut_them() {
        let (tx, body) = body();
        let mut lines = Lines::new(body);
        send(&tx, "{\"a\":1}\n{\"b\"");
        send(&tx, ":2}\r\n{\"c\":3}\n");
        send(&tx, "{\"d\":");
        send(&tx, "4}");
        drop(tx);
        let mut seen = Vec::new();
        while let Some(line) = line(&mut lines).await {
            seen.push(line);
        }
        assert_eq!(
            seen,
            [r#"{"a":1}"#, r#"{"b":2}"#, r#"{"c":3}"#, r#"{"d":4}"#]
        );
    }

    /// Waiting for the next line, the reader holds nothing of the chunks it read: no slice of
    /// a connection's read buffer, no line buffer of its own.
    #[tokio::test]
    async fn a_waiting_reader_holds_no_memory_of_what_it_read() {
        let (tx, body) = body();
        let mut lines = Lines::new(body);
        let chunk = Bytes::from(b"{\"a\":1}\n{\"b\":2}\n".to_vec());
        tx.unbounded_send(Ok(Frame::data(chunk.clone()))).unwrap();
        assert_eq!(line(&mut lines).await.unwrap(), r#"{"a":1}"#);
        assert_eq!(line(&mut lines).await.unwrap(), r#"{"b":2}"#);
        let waker = futures::task::noop_waker();
        assert!(matches!(
            lines.poll_line(&mut Context::from_waker(&waker)),
            Poll::Pending
        ));
        // Only the test's own handle is left on the chunk's memory.
        assert!(chunk.is_unique());
        assert_eq!(lines.partial.capacity(), 0);
    }

    /// Events decode from their lines; a `Status` line is the server's error; a connection
    /// cut under the response ends the events without an error (the watcher resumes).
    #[tokio::test]
    async fn events_decode_and_a_cut_connection_ends_them_quietly() {
        let (tx, body) = body();
        let mut events = Box::pin(Events::<ConfigMap>::new(body));
        send(
            &tx,
            "{\"type\":\"ADDED\",\"object\":{\"apiVersion\":\"v1\",\"kind\":\"ConfigMap\",\"metadata\":{\"name\":\"a\",\"resourceVersion\":\"5\"}}}\n",
        );
        send(
            &tx,
            "{\"kind\":\"Status\",\"apiVersion\":\"v1\",\"status\":\"Failure\",\"message\":\"too old\",\"reason\":\"Expired\",\"code\":410}\n",
        );
        let Some(Ok(WatchEvent::Added(cm))) = events.next().await else {
            panic!("an added ConfigMap first");
        };
        assert_eq!(cm.metadata.name.as_deref(), Some("a"));
        match events.next().await {
            Some(Err(kube::Error::Api(status))) => assert_eq!(status.code, 410),
            other => panic!("a Status line is the server's error: {other:?}"),
        }
        tx.unbounded_send(Err(Box::new(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            "cut",
        ))))
        .unwrap();
        assert!(events.next().await.is_none());
    }

    /// A body that stalls past the transport's read timeout is an error of the watch (which
    /// its backoff and status report, and which tells a streaming list cut short from one
    /// the server does not serve), not a quiet end.
    #[tokio::test]
    async fn a_read_timeout_is_an_error_not_an_end() {
        let (tx, body) = body();
        let mut events = Box::pin(Events::<ConfigMap>::new(body));
        tx.unbounded_send(Err(Box::new(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            "no frame within the read timeout",
        ))))
        .unwrap();
        match events.next().await {
            Some(Err(kube::Error::ReadEvents(error))) => {
                assert!(error.to_string().contains("read timeout"), "{error}");
            }
            other => panic!("a read timeout is a ReadEvents error: {other:?}"),
        }
    }
}
