//! Connection slots of the crate's servers (the webhooks' and the endpoints'): how many
//! connections each holds, how long each may stay, and which one is closed to make room.
//!
//! A connection starts *unverified*: it has shown nothing yet (the webhook server: no request
//! on a valid route; the endpoints: no authorized request). Unverified connections are cheap
//! to hold and cheap to lose: they have short deadlines (the TLS handshake, then the first
//! request), at most [`Limits::per_peer`] of them come from one peer address (an IPv4
//! address, an IPv6 /64), at most [`Limits::unverified`] are open in all, and when either
//! bound is reached the *oldest* of them is closed to make room. A newcomer is never refused:
//! a member's API server, which sends its request within milliseconds of connecting, gets in
//! however many connections someone else holds open.
//!
//! A connection that shows a valid request is *verified* ([`Lease::verify`]) and may stay
//! open, idle up to [`Limits::idle`] between requests (a member's API server keeps its
//! webhook connections for up to 90 s), as long as there is room: at most
//! [`Limits::verified`] in all and [`Limits::per_group`] of one group (a cluster). A
//! request that finds no room is *closing*: no longer evictable, it is answered, and its
//! connection then closes.
//!
//! | state | closed when |
//! | --- | --- |
//! | unverified | the handshake or the first request is late; a newer connection needs its place (oldest first, its peer's first); it is answered without being verified |
//! | verified, idle | idle longer than [`Limits::idle`]; a request's headers take longer than [`Limits::header`] |
//! | verified or closing, in a request | the server's handler bounds it (the webhook's timeout, the body's rate) |
//! | closing, answered | at once (`Connection: close`), or [`Limits::header`] later if the peer does not take the answer |
//!
//! The server's own deadlines are the only ones: hyper's (whose header-read timer is also its
//! idle timer, so it would either close verified connections early or let unverified ones
//! idle) are off.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::util::sync::lock;

/// The bounds of one server's connections.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Limits {
    /// Unverified connections open at once (the oldest is closed for a newcomer).
    pub(crate) unverified: usize,
    /// Unverified connections of one peer address (its oldest is closed for a newcomer).
    pub(crate) per_peer: usize,
    /// Verified connections kept open at once.
    pub(crate) verified: usize,
    /// Verified connections kept open for one group (a cluster).
    pub(crate) per_group: usize,
    /// From accepting to the end of the TLS handshake.
    pub(crate) handshake: Duration,
    /// From accepting to a request's headers, while unverified.
    pub(crate) first_request: Duration,
    /// A verified connection's wait for its next request.
    pub(crate) idle: Duration,
    /// A verified connection's request headers, from their first byte.
    pub(crate) header: Duration,
}

/// The process's limit on open files (its soft limit), if it can be read.
pub(crate) fn file_limit() -> Option<u64> {
    #[cfg(unix)]
    {
        nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
            .ok()
            .map(|(soft, _hard)| soft)
    }
    #[cfg(not(unix))]
    {
        None
    }
}

/// What a peer is counted as: its IPv4 address, or its IPv6 /64 (one host's usual share).
fn peer_key(addr: IpAddr) -> IpAddr {
    match addr.to_canonical() {
        IpAddr::V6(v6) => {
            let bits = u128::from(v6) & !((1u128 << 64) - 1);
            IpAddr::V6(bits.into())
        }
        v4 => v4,
    }
}

/// One server's connections.
pub(crate) struct Slots {
    limits: Limits,
    /// Time zero of the connections' timestamps.
    epoch: Instant,
    table: Mutex<Table>,
}

/// Who holds the slots.
#[derive(Default)]
struct Table {
    /// The number the next connection gets (its age: lower is older).
    next: u64,
    /// Unverified connections, oldest first.
    unverified: BTreeMap<u64, Arc<Conn>>,
    /// The numbers of each peer's unverified connections, oldest first.
    peers: HashMap<IpAddr, BTreeSet<u64>>,
    /// Verified connections open.
    verified: usize,
    /// Verified connections open, by group.
    groups: HashMap<Arc<str>, usize>,
    /// Connections closed to make room, in all.
    evicted: u64,
}

/// One connection's state, shared by its task, its I/O and its requests.
pub(crate) struct Conn {
    number: u64,
    peer: IpAddr,
    /// Milliseconds after the epoch, as the deadlines are.
    accepted: u64,
    /// Set once it showed a valid request: kept (with its group), or closing.
    settled: OnceLock<Settled>,
    /// Closed to make room: its task ends it.
    evicted: AtomicBool,
    /// Told when `evicted` is set.
    wake: Notify,
    /// A request is being answered.
    busy: AtomicBool,
    /// When the first byte of the next request's headers came (ms after the epoch, plus one:
    /// zero while none has).
    reading_since: AtomicU64,
    /// When the last answer was given (ms after the epoch).
    idle_since: AtomicU64,
}

impl Slots {
    pub(crate) fn new(limits: Limits) -> Arc<Self> {
        Arc::new(Self {
            limits,
            epoch: Instant::now(),
            table: Mutex::new(Table::default()),
        })
    }

    fn now(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn at(&self, ms: u64) -> Instant {
        self.epoch + Duration::from_millis(ms)
    }

    /// A slot for a connection just accepted from `peer`: always given, closing the oldest
    /// unverified connection (of this peer first) when there is no room.
    pub(crate) fn admit(self: &Arc<Self>, peer: IpAddr) -> Slot {
        let peer = peer_key(peer);
        let now = self.now();
        let mut table = lock(&self.table);
        let number = table.next;
        table.next += 1;
        let oldest_of_peer = table
            .peers
            .get(&peer)
            .filter(|numbers| numbers.len() >= self.limits.per_peer)
            .and_then(|numbers| numbers.first().copied());
        if let Some(oldest) = oldest_of_peer {
            table.evict(oldest);
        }
        if table.unverified.len() >= self.limits.unverified
            && let Some(oldest) = table.unverified.keys().next().copied()
        {
            table.evict(oldest);
        }
        let conn = Arc::new(Conn {
            number,
            peer,
            accepted: now,
            settled: OnceLock::new(),
            evicted: AtomicBool::new(false),
            wake: Notify::new(),
            busy: AtomicBool::new(false),
            reading_since: AtomicU64::new(0),
            idle_since: AtomicU64::new(now),
        });
        table.unverified.insert(number, conn.clone());
        table.peers.entry(peer).or_default().insert(number);
        drop(table);
        Slot(Lease {
            slots: self.clone(),
            conn,
        })
    }

    /// Unverified and verified connections open now, and those closed to make room so far.
    #[cfg(test)]
    pub(crate) fn counts(&self) -> (usize, usize, u64) {
        let table = lock(&self.table);
        (table.unverified.len(), table.verified, table.evicted)
    }
}

impl Table {
    /// Closes unverified connection `number` to make room.
    fn evict(&mut self, number: u64) {
        if let Some(conn) = self.unverified.remove(&number) {
            self.forget_peer(&conn);
            self.evicted += 1;
            conn.evicted.store(true, Ordering::Release);
            conn.wake.notify_one();
        }
    }

    fn forget_peer(&mut self, conn: &Conn) {
        if let Some(numbers) = self.peers.get_mut(&conn.peer) {
            numbers.remove(&conn.number);
            if numbers.is_empty() {
                self.peers.remove(&conn.peer);
            }
        }
    }
}

/// What a connection that showed a valid request became.
enum Settled {
    /// Verified: it may stay open; counted in its group.
    Kept(Arc<str>),
    /// No room to keep it: answered, then closed; counted nowhere, evictable no more.
    Closing,
}

/// A connection's handle on its slot, for its requests (clone it into the service).
#[derive(Clone)]
pub(crate) struct Lease {
    slots: Arc<Slots>,
    conn: Arc<Conn>,
}

impl Lease {
    /// The connection showed a valid request for `group` (a cluster): it is evictable no
    /// more, and verified if there is room for one more verified connection (and one more of
    /// the group), else closing. Whether it is verified (may stay open after its answer); a
    /// connection settled before stays as it is, whatever group it asks for now.
    pub(crate) fn verify(&self, group: &str) -> bool {
        if let Some(settled) = self.conn.settled.get() {
            return matches!(settled, Settled::Kept(_));
        }
        let limits = &self.slots.limits;
        let mut table = lock(&self.slots.table);
        // Closed to make room since the request came: it ends with this answer.
        let Some(conn) = table.unverified.remove(&self.conn.number) else {
            return false;
        };
        table.forget_peer(&conn);
        if table.verified >= limits.verified
            || table.groups.get(group).copied().unwrap_or(0) >= limits.per_group
        {
            let _ = self.conn.settled.set(Settled::Closing);
            return false;
        }
        let group: Arc<str> = Arc::from(group);
        table.verified += 1;
        *table.groups.entry(group.clone()).or_default() += 1;
        let _ = self.conn.settled.set(Settled::Kept(group));
        true
    }

    /// Whether the connection is verified (may stay open after this answer).
    pub(crate) fn is_verified(&self) -> bool {
        matches!(self.conn.settled.get(), Some(Settled::Kept(_)))
    }

    /// Marks a request in progress until the guard is dropped (no idle or header deadline
    /// meanwhile: the handler bounds its own time).
    pub(crate) fn busy(&self) -> Busy {
        self.conn.busy.store(true, Ordering::Release);
        self.conn.reading_since.store(0, Ordering::Release);
        Busy(self.clone())
    }

    /// When the connection is to be closed, if it is not busy: its deadline now.
    fn deadline(&self) -> Option<Instant> {
        let conn = &self.conn;
        let limits = &self.slots.limits;
        if conn.evicted.load(Ordering::Acquire) {
            return Some(Instant::now());
        }
        let Some(settled) = conn.settled.get() else {
            return Some(self.slots.at(conn.accepted) + limits.first_request);
        };
        if conn.busy.load(Ordering::Acquire) {
            return None;
        }
        if let Settled::Closing = settled {
            // Answered: hyper closes it once the answer is written.
            return Some(self.slots.at(conn.idle_since.load(Ordering::Acquire)) + limits.header);
        }
        match conn.reading_since.load(Ordering::Acquire) {
            0 => Some(self.slots.at(conn.idle_since.load(Ordering::Acquire)) + limits.idle),
            since => Some(self.slots.at(since - 1) + limits.header),
        }
    }

    /// Bytes came in: the start of the next request's headers if the connection was idle.
    fn read(&self) {
        let conn = &self.conn;
        if !conn.busy.load(Ordering::Acquire) && conn.reading_since.load(Ordering::Acquire) == 0 {
            let now = self.slots.now() + 1;
            let started =
                conn.reading_since
                    .compare_exchange(0, now, Ordering::AcqRel, Ordering::Acquire);
            if started.is_ok() {
                // The deadline moved nearer: the connection's task looks again.
                conn.wake.notify_one();
            }
        }
    }
}

/// A request in progress ([`Lease::busy`]).
pub(crate) struct Busy(Lease);

impl Drop for Busy {
    fn drop(&mut self) {
        let conn = &self.0.conn;
        conn.idle_since.store(self.0.slots.now(), Ordering::Release);
        conn.busy.store(false, Ordering::Release);
        // A deadline applies again: the connection's task looks at it.
        conn.wake.notify_one();
    }
}

/// A connection's slot: given back when dropped.
pub(crate) struct Slot(Lease);

impl Slot {
    pub(crate) fn lease(&self) -> &Lease {
        &self.0
    }

    /// Completes when the connection is to be closed: evicted, or past its deadline.
    pub(crate) async fn expired(&self) {
        loop {
            let notified = self.0.conn.wake.notified();
            match self.0.deadline() {
                Some(deadline) if deadline <= Instant::now() => return,
                Some(deadline) => {
                    tokio::select! {
                        () = notified => {}
                        () = tokio::time::sleep_until(deadline) => {}
                    }
                }
                // Busy: its handler bounds it; looked at again when it is done, at the
                // latest after the idle time.
                None => {
                    let later = Instant::now() + self.0.slots.limits.idle;
                    tokio::select! {
                        () = notified => {}
                        () = tokio::time::sleep_until(later) => {}
                    }
                }
            }
        }
    }

    /// The TLS handshake on `stream`, or `None` if it fails, is late or the slot is taken back.
    pub(crate) async fn handshake<S>(
        &self,
        acceptor: &tokio_rustls::TlsAcceptor,
        stream: S,
    ) -> Option<tokio_rustls::server::TlsStream<S>>
    where
        S: AsyncRead + AsyncWrite + Unpin,
    {
        let deadline = self.0.slots.at(self.0.conn.accepted) + self.0.slots.limits.handshake;
        tokio::select! {
            accepted = tokio::time::timeout_at(deadline, acceptor.accept(stream)) => {
                accepted.ok()?.ok()
            }
            () = self.expired() => None,
        }
    }

    /// `io` watched for the bytes of a request's headers.
    pub(crate) fn watch<S>(&self, io: S) -> Watched<S> {
        Watched {
            io,
            lease: self.0.clone(),
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let conn = &self.0.conn;
        let mut table = lock(&self.0.slots.table);
        match conn.settled.get() {
            Some(Settled::Closing) => {}
            Some(Settled::Kept(group)) => {
                table.verified = table.verified.saturating_sub(1);
                if let Some(count) = table.groups.get_mut(group) {
                    *count -= 1;
                    if *count == 0 {
                        table.groups.remove(group);
                    }
                }
            }
            None => {
                if table.unverified.remove(&conn.number).is_some() {
                    table.forget_peer(conn);
                }
            }
        }
    }
}

/// A connection's I/O, telling its slot when bytes come in.
#[pin_project::pin_project]
pub(crate) struct Watched<S> {
    #[pin]
    io: S,
    lease: Lease,
}

impl<S: AsyncRead> AsyncRead for Watched<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.project();
        let before = buf.filled().len();
        let polled = this.io.poll_read(cx, buf);
        if matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            this.lease.read();
        }
        polled
    }
}

impl<S: AsyncWrite> AsyncWrite for Watched<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        self.project().io.poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        self.project().io.poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        self.project().io.poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        self.project().io.poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

/// Serves one connection over HTTP/1.1 with `service` until it ends, its slot expires, or
/// `stop` (then the request in flight gets `drain` to be answered, and the connection
/// closes).
pub(crate) async fn serve_connection<S, Svc>(
    slot: &Slot,
    io: S,
    service: Svc,
    stop: &CancellationToken,
    drain: Duration,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    Svc: hyper::service::HttpService<hyper::body::Incoming> + Send,
    Svc::ResBody: 'static,
    <Svc::ResBody as hyper::body::Body>::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    Svc::Future: Send,
{
    // No timer: hyper's deadlines are off (this module's are the only ones).
    let connection = hyper::server::conn::http1::Builder::new()
        .header_read_timeout(None)
        .serve_connection(hyper_util::rt::TokioIo::new(slot.watch(io)), service);
    tokio::pin!(connection);
    tokio::select! {
        _ = connection.as_mut() => {}
        () = slot.expired() => {}
        () = stop.cancelled() => {
            connection.as_mut().graceful_shutdown();
            let _ = tokio::time::timeout(drain, connection).await;
        }
    }
}

/// `response`, closing its connection once written (`Connection: close`).
pub(crate) fn closing<B>(mut response: http::Response<B>) -> http::Response<B> {
    response.headers_mut().insert(
        http::header::CONNECTION,
        http::HeaderValue::from_static("close"),
    );
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> Limits {
        Limits {
            unverified: 4,
            per_peer: 2,
            verified: 3,
            per_group: 2,
            handshake: Duration::from_secs(3),
            first_request: Duration::from_secs(5),
            idle: Duration::from_secs(120),
            header: Duration::from_secs(10),
        }
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn evicted(slot: &Slot) -> bool {
        slot.0.conn.evicted.load(Ordering::Acquire)
    }

    #[tokio::test]
    async fn a_peer_over_its_share_loses_its_own_oldest_connection() {
        let slots = Slots::new(limits());
        let a1 = slots.admit(ip("127.0.0.2"));
        let a2 = slots.admit(ip("127.0.0.2"));
        let b1 = slots.admit(ip("127.0.0.1"));
        let a3 = slots.admit(ip("127.0.0.2"));
        assert!(evicted(&a1), "the peer's oldest goes");
        assert!(!evicted(&a2) && !evicted(&a3) && !evicted(&b1));
        assert_eq!(slots.counts(), (3, 0, 1));
    }

    #[tokio::test]
    async fn a_full_server_closes_its_oldest_unverified_connection_for_a_newcomer() {
        let slots = Slots::new(limits());
        let held: Vec<Slot> = ["127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"]
            .iter()
            .map(|p| slots.admit(ip(p)))
            .collect();
        let newcomer = slots.admit(ip("127.0.0.1"));
        assert!(evicted(&held[0]) && !evicted(&newcomer));
        assert!(held[1..].iter().all(|s| !evicted(s)));
        assert_eq!(slots.counts(), (4, 0, 1));
        // The evicted connection's task ends at once.
        tokio::time::timeout(Duration::from_secs(1), held[0].expired())
            .await
            .unwrap();
    }

    #[tokio::test]
    async fn verified_connections_are_never_closed_for_newcomers() {
        let slots = Slots::new(limits());
        let member = slots.admit(ip("127.0.0.1"));
        assert!(member.lease().verify("east"));
        let flood: Vec<Slot> = (0..20).map(|_| slots.admit(ip("127.0.0.2"))).collect();
        assert!(!evicted(&member));
        assert_eq!(flood.iter().filter(|s| !evicted(s)).count(), 2);
        assert_eq!(slots.counts().1, 1);
    }

    #[tokio::test]
    async fn a_group_keeps_no_more_than_its_share_of_verified_connections() {
        let slots = Slots::new(limits());
        let mut conns: Vec<Slot> = (0..4)
            .map(|i| slots.admit(ip(&format!("10.0.0.{i}"))))
            .collect();
        assert!(conns[0].lease().verify("east"));
        assert!(conns[1].lease().verify("east"));
        assert!(!conns[2].lease().verify("east"), "east has its share");
        assert!(
            !conns[2].lease().verify("west"),
            "a connection answered without room closes, whatever it asks next"
        );
        assert!(conns[3].lease().verify("west"));
        conns.push(slots.admit(ip("10.0.0.4")));
        assert!(
            !conns[4].lease().verify("north"),
            "every verified slot is taken"
        );
        assert_eq!(slots.counts(), (0, 3, 0));
        drop(conns);
        assert_eq!(slots.counts(), (0, 0, 0), "every slot is given back");
        let again = slots.admit(ip("10.0.0.9"));
        assert!(again.lease().verify("north"));
    }

    #[tokio::test]
    async fn ipv6_peers_are_counted_by_their_64_bit_prefix() {
        let slots = Slots::new(limits());
        let a = slots.admit(ip("2001:db8::1"));
        let _b = slots.admit(ip("2001:db8::2"));
        let _c = slots.admit(ip("2001:db8::3"));
        assert!(evicted(&a), "one /64 is one peer");
        let mapped = slots.admit(ip("::ffff:127.0.0.2"));
        let _d = slots.admit(ip("127.0.0.2"));
        let _e = slots.admit(ip("127.0.0.2"));
        assert!(evicted(&mapped), "a mapped IPv4 address is that address");
    }

    #[tokio::test(start_paused = true)]
    async fn an_unverified_connection_expires_at_its_first_request_deadline() {
        let slots = Slots::new(limits());
        let slot = slots.admit(ip("127.0.0.2"));
        let started = Instant::now();
        // Busy with a refused request: the deadline still stands.
        let _busy = slot.lease().busy();
        slot.expired().await;
        assert_eq!(started.elapsed(), Duration::from_secs(5));
    }

    #[tokio::test(start_paused = true)]
    async fn a_verified_connection_idles_until_its_idle_deadline() {
        let slots = Slots::new(limits());
        let slot = slots.admit(ip("127.0.0.1"));
        assert!(slot.lease().verify("east"));
        let busy = slot.lease().busy();
        // While busy, no deadline: a minute passes.
        let waited = tokio::time::timeout(Duration::from_secs(60), slot.expired()).await;
        assert!(waited.is_err());
        drop(busy);
        let idle = Instant::now();
        slot.expired().await;
        assert_eq!(idle.elapsed(), Duration::from_secs(120));
    }

    #[tokio::test(start_paused = true)]
    async fn a_verified_connection_trickling_headers_expires_at_the_header_deadline() {
        let slots = Slots::new(limits());
        let slot = Arc::new(slots.admit(ip("127.0.0.1")));
        assert!(slot.lease().verify("east"));
        drop(slot.lease().busy());
        // The connection's task waits on its idle deadline when the first byte comes.
        let waiting = slot.clone();
        let expired = tokio::spawn(async move { waiting.expired().await });
        tokio::time::advance(Duration::from_secs(30)).await;
        let first_byte = Instant::now();
        slot.lease().read();
        tokio::time::advance(Duration::from_secs(3)).await;
        slot.lease().read();
        expired.await.unwrap();
        assert_eq!(first_byte.elapsed(), Duration::from_secs(10));
    }

    #[tokio::test(start_paused = true)]
    async fn a_valid_request_without_room_is_answered_then_closed_and_never_evicted() {
        let slots = Slots::new(limits());
        let kept: Vec<Slot> = (0..2)
            .map(|i| slots.admit(ip(&format!("10.0.1.{i}"))))
            .collect();
        assert!(kept.iter().all(|s| s.lease().verify("east")));
        let slot = slots.admit(ip("127.0.0.1"));
        let busy = slot.lease().busy();
        assert!(!slot.lease().verify("east"), "east has no room");
        // Busy past the first-request deadline, with a flood of newcomers: still there.
        let flood: Vec<Slot> = (0..20).map(|_| slots.admit(ip("127.0.0.2"))).collect();
        assert!(!evicted(&slot));
        let waited = tokio::time::timeout(Duration::from_secs(30), slot.expired()).await;
        assert!(
            waited.is_err(),
            "a request in progress has no deadline of the slot's"
        );
        // Answered: closed by hyper, or by the slot if the peer does not take the answer.
        drop(busy);
        let answered = Instant::now();
        slot.expired().await;
        assert_eq!(answered.elapsed(), Duration::from_secs(10));
        drop((flood, kept, slot));
        assert_eq!(slots.counts(), (0, 0, 18), "every slot is given back");
    }
}
