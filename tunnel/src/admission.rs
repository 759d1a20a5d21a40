//! Admission of connections to a TLS listener: how many may be between
//! `accept` and a finished handshake, and which to drop when that many are.
//!
//! A storm of real peers (thousands of agents reconnecting after a server
//! restart) and a flood of silent or slow ones (sockets that never send a
//! byte, or stall halfway) both fill the listener with pending handshakes.
//! They differ in one thing the listener can see: a real peer answers
//! within a round trip, so it never keeps its handshake waiting long; a
//! silent or stalling one does. So:
//! - at most `max` connections are pending at once; past that, new ones
//!   wait in the listen backlog (the accept loop stops taking them);
//! - at the cap, the pending connection whose peer has kept it waiting
//!   longest in all is dropped to make room, one per admitted connection,
//!   if that is at least [`STALL`]; a handshake that is making progress,
//!   or waits for this process's own CPU, is never dropped;
//! - every handshake has a deadline from its `accept` (the caller's).
//!
//! [`Watched`] measures the waiting: it sits under rustls and notes when a
//! read or write finds the peer has not answered, and when the socket wakes
//! it again (not when the task next runs: a busy server's own delay is not
//! the peer's).

use std::{
    collections::BTreeMap,
    io,
    pin::Pin,
    sync::{
        Arc, Mutex, MutexGuard, PoisonError,
        atomic::{AtomicU64, Ordering},
    },
    task::{Context, Poll, Wake, Waker},
    time::Duration,
};

use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    sync::{OwnedSemaphorePermit, Semaphore},
    time::Instant,
};
use tokio_util::sync::CancellationToken;

/// How long in all a pending handshake's peer must have kept it waiting
/// before, at the cap, it may be dropped for a new connection. A real
/// peer's wait is a round trip (milliseconds in a cluster, up to a few
/// hundred across the world); a silent one reaches this 200 ms after its
/// `accept`, so a full listener cycles its silent connections five times a
/// second.
pub const STALL: Duration = Duration::from_millis(200);

/// How long one pending handshake has been kept waiting by its peer.
/// Written by its [`Watched`] transport, read by the accept loop.
#[derive(Debug, Default)]
pub struct PeerWait {
    /// Milliseconds since the table's epoch, plus one, when the current
    /// wait began; 0 while the handshake has something to do.
    since: AtomicU64,
    /// Milliseconds of finished waits.
    total: AtomicU64,
}

impl PeerWait {
    /// The handshake found nothing to read or no room to write at `now`.
    fn waiting(&self, now: u64) {
        if self.since.load(Ordering::Relaxed) == 0 {
            self.since.store(now + 1, Ordering::Relaxed);
        }
    }

    /// The peer answered at `now`.
    fn answered(&self, now: u64) {
        let since = self.since.swap(0, Ordering::Relaxed);
        if since != 0 {
            self.total
                .fetch_add(now.saturating_sub(since - 1), Ordering::Relaxed);
        }
    }

    /// Milliseconds the peer has kept the handshake waiting by `now`, if it
    /// is waiting on the peer now.
    fn stalled_for(&self, now: u64) -> Option<u64> {
        let since = self.since.load(Ordering::Relaxed);
        (since != 0).then(|| self.total.load(Ordering::Relaxed) + now.saturating_sub(since - 1))
    }
}

/// What [`Admission::shed_one`] did.
enum Shed {
    /// It stopped a stalled connection.
    Dropped,
    /// None has stalled long enough; the first may in this long.
    NoneFor(Duration),
}

/// One pending connection, as the table sees it.
struct Entry {
    /// Stops its handshake.
    cancel: CancellationToken,
    /// How long its peer has kept it waiting.
    wait: Arc<PeerWait>,
}

/// The pending connections of one listener, by order of `accept`, and the
/// slots they hold.
pub struct Admission {
    /// Pending connections by arrival.
    pending: Mutex<BTreeMap<u64, Entry>>,
    /// One permit per pending connection (`max` in all).
    slots: Arc<Semaphore>,
    /// The next connection's number.
    next: AtomicU64,
    /// Time zero of [`PeerWait`]'s clock.
    epoch: Instant,
}

/// What [`Admission::admit`] hands a new connection: its slot, its number,
/// its stop and its wait clock. Dropping it frees the slot.
pub struct Ticket {
    /// The slot, held until the ticket is dropped.
    _slot: OwnedSemaphorePermit,
    /// Its key in the table.
    id: u64,
    /// Cancelled when the connection is dropped to make room, or on
    /// shutdown (a child of the listener's token).
    pub cancel: CancellationToken,
    /// Its wait clock, for [`Watched`].
    wait: Arc<PeerWait>,
}

impl Admission {
    /// A table of at most `max` pending connections (at least one).
    pub fn new(max: usize) -> Arc<Self> {
        Arc::new(Self {
            pending: Mutex::new(BTreeMap::new()),
            slots: Arc::new(Semaphore::new(max.max(1))),
            next: AtomicU64::new(0),
            epoch: Instant::now(),
        })
    }

    /// Milliseconds since the epoch.
    fn now(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Waits for a free slot. At the cap, drops the pending connection
    /// whose peer has kept it waiting longest, if at least [`STALL`]
    /// (calling `on_shed`), then waits for its slot; when none has, waits
    /// for a handshake to end or for one to stall that long. Returns the new
    /// connection's ticket, its stop a child of `shutdown`.
    ///
    /// # Cancel safety
    /// Cancel safe: a dropped call holds no slot (a connection it dropped
    /// stays dropped).
    pub async fn admit(&self, shutdown: &CancellationToken, on_shed: &(dyn Fn() + Sync)) -> Ticket {
        let slot = loop {
            if let Ok(slot) = self.slots.clone().try_acquire_owned() {
                break slot;
            }
            let recheck = match self.shed_one() {
                Shed::Dropped => {
                    on_shed();
                    // Its slot comes back as soon as its task sees the stop.
                    STALL
                }
                Shed::NoneFor(wait) => wait,
            };
            tokio::select! {
                slot = self.slots.clone().acquire_owned() => {
                    break slot.expect("the slots are never closed");
                }
                () = tokio::time::sleep(recheck) => {}
            }
        };
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let entry = Entry {
            cancel: shutdown.child_token(),
            wait: Arc::default(),
        };
        let ticket = Ticket {
            _slot: slot,
            id,
            cancel: entry.cancel.clone(),
            wait: entry.wait.clone(),
        };
        self.table().insert(id, entry);
        ticket
    }

    /// The connection of `ticket` is no longer pending (handshake done or
    /// failed): it can no longer be dropped to make room. Its slot is freed
    /// when the ticket is dropped.
    pub fn done(&self, ticket: &Ticket) {
        self.table().remove(&ticket.id);
    }

    /// A [`Watched`] transport for `ticket`'s connection.
    pub fn watch<T>(self: &Arc<Self>, io: T, ticket: &Ticket) -> Watched<T> {
        Watched {
            inner: io,
            clock: Some((self.clone(), ticket.wait.clone())),
        }
    }

    /// Pending connections now.
    pub fn pending(&self) -> usize {
        self.table().len()
    }

    /// Stops the pending connection whose peer has kept it waiting longest,
    /// if at least [`STALL`], and takes it out of the table; else says how
    /// long until one may have.
    fn shed_one(&self) -> Shed {
        let now = self.now();
        let stall = u64::try_from(STALL.as_millis()).unwrap_or(u64::MAX);
        let mut table = self.table();
        let longest = table
            .iter()
            .filter_map(|(id, entry)| entry.wait.stalled_for(now).map(|ms| (ms, *id)))
            .max();
        match longest {
            Some((ms, id)) if ms >= stall => {
                if let Some(entry) = table.remove(&id) {
                    entry.cancel.cancel();
                }
                Shed::Dropped
            }
            Some((ms, _)) => Shed::NoneFor(Duration::from_millis(stall - ms)),
            None => Shed::NoneFor(STALL),
        }
    }

    fn table(&self) -> MutexGuard<'_, BTreeMap<u64, Entry>> {
        self.pending.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A transport that tells its connection's [`PeerWait`] when a read or
/// write finds the peer has not answered (`Pending`) and when the socket
/// is ready again. [`disarm`](Self::disarm)ed once the handshake is done:
/// from then on it only passes through.
pub struct Watched<T> {
    /// The transport.
    inner: T,
    /// The table (for its clock) and the wait to tell, while pending.
    clock: Option<(Arc<Admission>, Arc<PeerWait>)>,
}

impl<T> Watched<T> {
    /// Stops telling: the handshake is over.
    pub fn disarm(&mut self) {
        self.clock = None;
    }

    /// The transport.
    pub fn get_ref(&self) -> &T {
        &self.inner
    }
}

impl<T: Unpin> Watched<T> {
    /// Polls `op` on the transport; notes a `Pending` as the start of a
    /// wait on the peer, and the socket's wake-up (or a `Ready`) as its end.
    fn watched<R>(
        &mut self,
        cx: &mut Context<'_>,
        op: impl FnOnce(Pin<&mut T>, &mut Context<'_>) -> Poll<R>,
    ) -> Poll<R> {
        let Some((table, wait)) = &self.clock else {
            return op(Pin::new(&mut self.inner), cx);
        };
        let waker = Waker::from(Arc::new(WakeNote {
            table: table.clone(),
            wait: wait.clone(),
            task: cx.waker().clone(),
        }));
        let polled = op(Pin::new(&mut self.inner), &mut Context::from_waker(&waker));
        match polled {
            Poll::Pending => wait.waiting(table.now()),
            Poll::Ready(_) => wait.answered(table.now()),
        }
        polled
    }
}

/// The waker a pending [`Watched`] hands its transport: ends the wait on
/// the peer when the socket is ready, then wakes the task.
struct WakeNote {
    /// The clock.
    table: Arc<Admission>,
    /// The wait to end.
    wait: Arc<PeerWait>,
    /// The handshake's task.
    task: Waker,
}

impl Wake for WakeNote {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.wait.answered(self.table.now());
        self.task.wake_by_ref();
    }
}

impl<T: tonic::transport::server::Connected> tonic::transport::server::Connected for Watched<T> {
    type ConnectInfo = T::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Watched<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        self.watched(cx, |io, cx| io.poll_read(cx, buf))
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Watched<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.watched(cx, |io, cx| io.poll_write(cx, buf))
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.watched(cx, |io, cx| io.poll_flush(cx))
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.watched(cx, |io, cx| io.poll_write_vectored(cx, bufs))
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use futures_util::FutureExt;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    #[test]
    fn a_wait_counts_only_while_the_peer_is_silent() {
        let wait = PeerWait::default();
        assert_eq!(wait.stalled_for(100), None, "not waiting yet");
        wait.waiting(100);
        wait.waiting(150);
        assert_eq!(wait.stalled_for(400), Some(300), "from the first wait");
        wait.answered(400);
        assert_eq!(wait.stalled_for(5_000), None, "busy: never stalled");
        wait.waiting(5_000);
        assert_eq!(wait.stalled_for(5_100), Some(400), "waits add up");
    }

    #[tokio::test(start_paused = true)]
    async fn the_wait_ends_when_the_socket_wakes_not_when_the_task_runs() {
        let table = Admission::new(4);
        let shutdown = CancellationToken::new();
        let ticket = table.admit(&shutdown, &|| {}).await;
        let (near, mut far) = tokio::io::duplex(64);
        let mut io = table.watch(near, &ticket);
        let mut byte = [0u8; 1];
        let read = io.read_exact(&mut byte);
        tokio::pin!(read);
        // Nothing to read: a wait on the peer starts.
        assert!((&mut read).now_or_never().is_none());
        tokio::time::advance(Duration::from_millis(300)).await;
        assert_eq!(ticket.wait.stalled_for(table.now()), Some(300));
        // The peer answers; the task runs only later, yet the wait ended
        // when the bytes came.
        far.write_all(b"x").await.unwrap();
        tokio::time::advance(Duration::from_millis(700)).await;
        assert_eq!(ticket.wait.stalled_for(table.now()), None);
        read.await.unwrap();
        assert_eq!(ticket.wait.total.load(Ordering::Relaxed), 300);
        // Disarmed, it no longer counts.
        io.disarm();
        let read = io.read_exact(&mut byte);
        tokio::pin!(read);
        assert!((&mut read).now_or_never().is_none());
        tokio::time::advance(Duration::from_secs(5)).await;
        assert_eq!(ticket.wait.stalled_for(table.now()), None);
    }

    #[tokio::test(start_paused = true)]
    async fn at_the_cap_the_most_stalled_connection_makes_room_and_a_busy_one_does_not() {
        let table = Admission::new(3);
        let shutdown = CancellationToken::new();
        let shed = std::sync::atomic::AtomicUsize::new(0);
        let on_shed = || {
            shed.fetch_add(1, Ordering::Relaxed);
        };
        // Three pending: one silent since its accept, one silent since a
        // little later, one whose peer answers.
        let silent = table.admit(&shutdown, &on_shed).await;
        silent.wait.waiting(table.now());
        tokio::time::advance(Duration::from_millis(50)).await;
        let later = table.admit(&shutdown, &on_shed).await;
        later.wait.waiting(table.now());
        let busy = table.admit(&shutdown, &on_shed).await;
        assert_eq!(table.pending(), 3);

        // A fourth waits: nobody has stalled long enough yet.
        let fourth = table.admit(&shutdown, &on_shed);
        tokio::pin!(fourth);
        tokio::select! {
            _ = &mut fourth => panic!("admitted past the cap"),
            () = tokio::time::sleep(STALL / 2) => {}
        }
        assert!(!silent.cancel.is_cancelled());

        // Past the stall the longest-silent one is dropped; its slot goes
        // to the fourth once its handshake task lets go of it.
        let admitted = tokio::select! {
            t = &mut fourth => Some(t),
            () = tokio::time::sleep(STALL) => None,
        };
        assert!(admitted.is_none(), "the dropped one still holds its slot");
        assert!(
            silent.cancel.is_cancelled(),
            "the longest silent is dropped"
        );
        assert!(!later.cancel.is_cancelled(), "one at a time");
        assert!(!busy.cancel.is_cancelled(), "the busy one is kept");
        assert_eq!(shed.load(Ordering::Relaxed), 1);
        drop(silent);
        let fourth = fourth.await;
        assert_eq!(table.pending(), 3);

        // Handshakes that end free their slots: no drop below the cap.
        for ticket in [later, busy, fourth] {
            table.done(&ticket);
        }
        assert_eq!(table.pending(), 0);
        let _fifth = table.admit(&shutdown, &on_shed).await;
        assert_eq!(shed.load(Ordering::Relaxed), 1);
    }
}
