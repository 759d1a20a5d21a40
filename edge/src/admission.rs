//! Admission of connections to a TLS listener: how many may be between
//! `accept` and a finished handshake, in which order this process works on
//! their handshakes, and which it drops when that many are.
//!
//! A handshake goes through three stages ([`Stage`]), and only one costs
//! this process much CPU:
//! - **hello**: waiting for the peer's ClientHello. A real peer sends it
//!   right behind its TCP handshake, so at `accept` it is usually there.
//! - **queued**: the ClientHello is in; the connection waits for its turn.
//!   Turns go in arrival order, at most one per runtime worker at a time
//!   ([`Admission::turn`]). A turn covers the step that costs: taking the
//!   ClientHello up, where rustls makes the key exchange and signs with the
//!   server's key (an RSA-2048 signature is about a millisecond).
//! - **started**: the server's flight is out; what is left is the peer's
//!   answer and checking its certificate (little CPU).
//!
//! So in a storm of thousands, the CPU goes to a few handshakes at a time,
//! each finishing fast, instead of to thousands at once, each advancing by
//! a thousandth and all of them late; and the handshakes already started
//! never wait behind thousands of signatures in the runtime's queue.
//!
//! Memory is bounded by `max` pending connections (from `accept` until the
//! server takes the finished one); past that, new connections wait in the
//! listen backlog (the kernel's queue). At the cap, one pending connection
//! may be dropped for each new one, only while no handshake waits for its
//! turn (while one does, the CPU has work, and making room would gain
//! nothing but the loss of a peer that is merely slow: in a storm, the
//! peers starved of CPU by it), and only one whose peer is truly silent:
//! - in the hello stage, silent for [`HELLO_SILENCE`] (no work spent on
//!   it yet; those go first);
//! - started, silent for [`STARTED_SILENCE`] since its last answer.
//!
//! A queued connection (waiting for this process) is never dropped, nor is
//! a peer that answers, however slowly, within those. Deadlines:
//! [`HELLO_TIMEOUT`] from `accept` for the ClientHello, and
//! [`HANDSHAKE_TIMEOUT`] for the rest from the start of the connection's
//! turn: time in the queue is this process's, not the peer's.
//!
//! [`Watched`] measures the silence: it sits under rustls and notes when a
//! read or write finds the peer has not answered, and when the socket wakes
//! again (not when the task next runs: a busy server's own delay is not
//! the peer's).

use std::{
    collections::BTreeMap,
    io,
    pin::Pin,
    sync::{
        Arc, Mutex, MutexGuard, PoisonError,
        atomic::{AtomicU8, AtomicU64, AtomicUsize, Ordering},
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

/// How long a connection may have sent nothing since its `accept` (no
/// ClientHello, or only part of one) before, at the cap, it may be dropped
/// for a new one. A real peer's ClientHello follows its TCP handshake at
/// once and is in the socket within a round trip (a few hundred
/// milliseconds across the world, one retransmission more if a packet is
/// lost); nothing is spent on a connection before it, so it goes first.
pub const HELLO_SILENCE: Duration = Duration::from_secs(1);

/// How long the peer of a started handshake may have sent nothing since
/// its last answer before, at the cap, it may be dropped for a new one: a
/// real peer answers the server's flight within a round trip and the time
/// its own CPU takes to sign (seconds on a machine as loaded as a storm
/// makes it), and the server's signature is already spent on it.
pub const STARTED_SILENCE: Duration = Duration::from_secs(5);

/// How long after its `accept` a connection may take to send its
/// ClientHello, at the cap or not.
pub const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a handshake may take from the start of its turn (when this
/// process takes its ClientHello up) to its end: long enough for a peer
/// whose own CPU a storm starves (seconds, measured with 10,000 grpc-go
/// agents on the server's CPU), a quarter of grpc-go's server's 120 s.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);

/// How often, at the cap, the accept loop looks again for a silent
/// connection to drop while handshakes wait for their turns.
const BUSY_RECHECK: Duration = Duration::from_millis(250);

/// Where a pending connection's handshake is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Stage {
    /// Waiting for the peer's ClientHello.
    Hello = 0,
    /// The ClientHello is in; waiting for a turn (this process's wait).
    Queued = 1,
    /// Its turn has come: the server's flight is made; the peer answers.
    Started = 2,
}

impl Stage {
    fn from_u8(value: u8) -> Self {
        match value {
            0 => Self::Hello,
            1 => Self::Queued,
            _ => Self::Started,
        }
    }
}

/// Why a pending connection ended without a finished handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dropped {
    /// At the cap: it had sent no ClientHello for [`HELLO_SILENCE`], and a
    /// new connection took its place.
    NoHello,
    /// At the cap: started, its peer had sent nothing for
    /// [`STARTED_SILENCE`], and a new connection took its place.
    Stalled,
    /// No ClientHello within [`HELLO_TIMEOUT`] of its `accept`.
    HelloTimeout,
    /// Not finished within [`HANDSHAKE_TIMEOUT`] of its start.
    Timeout,
    /// What came was no ClientHello (not TLS, or the peer closed first).
    BadHello,
    /// The peer hung up while its handshake waited for its turn: nothing
    /// was spent on it.
    PeerGone,
    /// Started, it failed: a TLS error (a certificate refused, an alert),
    /// or the peer hung up halfway.
    Failed,
}

impl Dropped {
    /// Whether this process had already made its flight (its signature)
    /// for the handshake: work thrown away.
    pub fn after_start(self) -> bool {
        matches!(self, Self::Stalled | Self::Timeout | Self::Failed)
    }

    /// Whether it was dropped at the cap to make room for a new connection.
    pub fn at_cap(self) -> bool {
        matches!(self, Self::NoHello | Self::Stalled)
    }
}

/// How long a pending connection's peer has kept it waiting, and its
/// stage. Written by its [`Watched`] transport and its handshake task,
/// read by the accept loop.
#[derive(Debug, Default)]
pub struct PeerWait {
    /// Milliseconds since the table's epoch, plus one, when the current
    /// wait on the peer began; 0 while the handshake has something to do.
    since: AtomicU64,
    /// The [`Stage`], as a `u8`.
    stage: AtomicU8,
}

impl PeerWait {
    /// The handshake found nothing to read or no room to write at `now`.
    fn waiting(&self, now: u64) {
        if self.since.load(Ordering::Relaxed) == 0 {
            self.since.store(now + 1, Ordering::Relaxed);
        }
    }

    /// The peer answered (or this process's turn came) at `now`.
    fn answered(&self) {
        self.since.store(0, Ordering::Relaxed);
    }

    /// Milliseconds the peer has been silent by `now`, if it is waited on.
    fn silent_for(&self, now: u64) -> Option<u64> {
        let since = self.since.load(Ordering::Relaxed);
        (since != 0).then(|| now.saturating_sub(since - 1))
    }

    /// The stage.
    pub fn stage(&self) -> Stage {
        Stage::from_u8(self.stage.load(Ordering::Relaxed))
    }

    fn set_stage(&self, stage: Stage) {
        self.stage.store(stage as u8, Ordering::Relaxed);
    }
}

/// What [`Admission::shed_one`] did.
enum Shed {
    /// It stopped a silent connection, for this reason.
    Dropped(Dropped),
    /// None has been silent long enough; the first may be in this long.
    NoneFor(Duration),
}

/// One pending connection, as the table sees it.
struct Entry {
    /// Stops its handshake.
    cancel: CancellationToken,
    /// How long its peer has kept it waiting, and its stage.
    wait: Arc<PeerWait>,
}

/// The pending connections of one listener, by order of `accept`, the
/// slots they hold and the turns they take.
pub struct Admission {
    /// Pending connections by arrival, until their handshakes end.
    pending: Mutex<BTreeMap<u64, Entry>>,
    /// One permit per pending connection (`max` in all).
    slots: Arc<Semaphore>,
    /// One permit per handshake being taken up (FIFO: tokio's semaphore
    /// serves waiters in order).
    turns: Arc<Semaphore>,
    /// Handshakes waiting for their turn.
    queued: AtomicUsize,
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
    /// Its wait clock and stage, for [`Watched`] and the accept loop.
    wait: Arc<PeerWait>,
}

impl Ticket {
    /// Its stage.
    pub fn stage(&self) -> Stage {
        self.wait.stage()
    }
}

/// A handshake's turn ([`Admission::turn`]): the CPU is its while it is
/// held. Drop it once the server's flight is made.
pub struct Turn {
    /// The permit.
    _permit: OwnedSemaphorePermit,
    /// When the handshake must be done: [`HANDSHAKE_TIMEOUT`] from now.
    pub deadline: Instant,
}

impl Admission {
    /// A table of at most `max` pending connections (at least one), of
    /// which at most `turns` (at least one) are taken up at a time. A `max`
    /// past what a semaphore holds (2^61) means no admission at all: no cap,
    /// and every handshake taken up as soon as its ClientHello is in.
    pub fn new(max: usize, turns: usize) -> Arc<Self> {
        let turns = if max >= Semaphore::MAX_PERMITS {
            Semaphore::MAX_PERMITS
        } else {
            turns.clamp(1, Semaphore::MAX_PERMITS)
        };
        Arc::new(Self {
            pending: Mutex::new(BTreeMap::new()),
            slots: Arc::new(Semaphore::new(max.clamp(1, Semaphore::MAX_PERMITS))),
            turns: Arc::new(Semaphore::new(turns)),
            queued: AtomicUsize::new(0),
            next: AtomicU64::new(0),
            epoch: Instant::now(),
        })
    }

    /// Milliseconds since the epoch.
    fn now(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Waits for a free slot. At the cap, drops a pending connection whose
    /// peer is silent (see the module documentation), calling `on_shed`
    /// with the reason, then waits for its slot; when none is, waits for a
    /// handshake to end or for one to have been silent long enough.
    /// Returns the new connection's ticket, in the hello stage, its stop a
    /// child of `shutdown`.
    ///
    /// # Cancel safety
    /// Cancel safe: a dropped call holds no slot (a connection it dropped
    /// stays dropped).
    pub async fn admit(
        &self,
        shutdown: &CancellationToken,
        on_shed: &(dyn Fn(Dropped) + Sync),
    ) -> Ticket {
        let slot = loop {
            if let Ok(slot) = self.slots.clone().try_acquire_owned() {
                break slot;
            }
            match self.shed_one() {
                Shed::Dropped(reason) => {
                    on_shed(reason);
                    // Its slot comes back as soon as its task sees the
                    // stop (or another's, when one ends first).
                    break self
                        .slots
                        .clone()
                        .acquire_owned()
                        .await
                        .expect("the slots are never closed");
                }
                Shed::NoneFor(wait) => tokio::select! {
                    slot = self.slots.clone().acquire_owned() => {
                        break slot.expect("the slots are never closed");
                    }
                    () = tokio::time::sleep(wait) => {}
                },
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

    /// The ClientHello of `ticket`'s connection is in: waits for its turn,
    /// behind every connection whose ClientHello came before. Meanwhile it
    /// is queued and cannot be dropped to make room; once the turn comes it
    /// is started, and its deadline runs from then.
    ///
    /// # Cancel safety
    /// Cancel safe: a dropped call holds no turn, and leaves its place.
    pub async fn turn(&self, ticket: &Ticket) -> Turn {
        ticket.wait.answered();
        ticket.wait.set_stage(Stage::Queued);
        let waiting = Queued::new(&self.queued);
        let permit = self
            .turns
            .clone()
            .acquire_owned()
            .await
            .expect("the turns are never closed");
        drop(waiting);
        ticket.wait.set_stage(Stage::Started);
        Turn {
            _permit: permit,
            deadline: Instant::now() + HANDSHAKE_TIMEOUT,
        }
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

    /// Handshakes waiting for their turn now.
    pub fn queued(&self) -> usize {
        self.queued.load(Ordering::Relaxed)
    }

    /// Stops a pending connection whose peer is silent, and takes it out
    /// of the table: the one silent longest of those in the hello stage for
    /// at least [`HELLO_SILENCE`], else of those started and silent for at
    /// least [`STARTED_SILENCE`]; none while a handshake waits for its
    /// turn. Else says how long until one may be.
    fn shed_one(&self) -> Shed {
        if self.queued() > 0 {
            return Shed::NoneFor(BUSY_RECHECK);
        }
        let now = self.now();
        let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        let mut table = self.table();
        // (hello first, silent longest, id)
        let mut best: Option<(bool, u64, u64)> = None;
        let mut soonest = ms(HELLO_SILENCE);
        for (id, entry) in table.iter() {
            let Some(silent) = entry.wait.silent_for(now) else {
                continue;
            };
            let (hello, limit) = match entry.wait.stage() {
                Stage::Hello => (true, ms(HELLO_SILENCE)),
                Stage::Started => (false, ms(STARTED_SILENCE)),
                Stage::Queued => continue,
            };
            if silent < limit {
                soonest = soonest.min(limit - silent);
            } else if best.is_none_or(|(h, s, _)| (hello, silent) > (h, s)) {
                best = Some((hello, silent, *id));
            }
        }
        let Some((hello, _, id)) = best else {
            return Shed::NoneFor(Duration::from_millis(soonest.max(1)));
        };
        if let Some(entry) = table.remove(&id) {
            entry.cancel.cancel();
        }
        Shed::Dropped(if hello {
            Dropped::NoHello
        } else {
            Dropped::Stalled
        })
    }

    fn table(&self) -> MutexGuard<'_, BTreeMap<u64, Entry>> {
        self.pending.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Counts one handshake waiting for its turn while it lives.
struct Queued<'a>(&'a AtomicUsize);

impl<'a> Queued<'a> {
    fn new(count: &'a AtomicUsize) -> Self {
        count.fetch_add(1, Ordering::Relaxed);
        Self(count)
    }
}

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
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

    /// The transport, mutably.
    pub fn get_mut(&mut self) -> &mut T {
        &mut self.inner
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
            wait: wait.clone(),
            task: cx.waker().clone(),
        }));
        let polled = op(Pin::new(&mut self.inner), &mut Context::from_waker(&waker));
        match polled {
            Poll::Pending => wait.waiting(table.now()),
            Poll::Ready(_) => wait.answered(),
        }
        polled
    }
}

/// The waker a pending [`Watched`] hands its transport: ends the wait on
/// the peer when the socket is ready, then wakes the task.
struct WakeNote {
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
        self.wait.answered();
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
    use std::sync::atomic::AtomicUsize;

    use futures_util::FutureExt;
    use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};

    use super::*;

    #[test]
    fn a_wait_counts_only_while_the_peer_is_silent() {
        let wait = PeerWait::default();
        assert_eq!(wait.silent_for(100), None, "not waiting yet");
        wait.waiting(100);
        wait.waiting(150);
        assert_eq!(wait.silent_for(400), Some(300), "from the first wait");
        wait.answered();
        assert_eq!(wait.silent_for(5_000), None, "answered: not silent");
        wait.waiting(5_000);
        assert_eq!(wait.silent_for(5_100), Some(100), "each wait on its own");
    }

    #[tokio::test(start_paused = true)]
    async fn the_wait_ends_when_the_socket_wakes_not_when_the_task_runs() {
        let table = Admission::new(4, 1);
        let shutdown = CancellationToken::new();
        let ticket = table.admit(&shutdown, &|_| {}).await;
        let (near, mut far) = tokio::io::duplex(64);
        let mut io = table.watch(near, &ticket);
        let mut byte = [0u8; 1];
        let read = io.read_exact(&mut byte);
        tokio::pin!(read);
        // Nothing to read: a wait on the peer starts.
        assert!((&mut read).now_or_never().is_none());
        tokio::time::advance(Duration::from_millis(300)).await;
        assert_eq!(ticket.wait.silent_for(table.now()), Some(300));
        // The peer answers; the task runs only later, yet the wait ended
        // when the bytes came.
        far.write_all(b"x").await.unwrap();
        tokio::time::advance(Duration::from_millis(700)).await;
        assert_eq!(ticket.wait.silent_for(table.now()), None);
        read.await.unwrap();
        // Disarmed, it no longer counts.
        io.disarm();
        let read = io.read_exact(&mut byte);
        tokio::pin!(read);
        assert!((&mut read).now_or_never().is_none());
        tokio::time::advance(Duration::from_secs(5)).await;
        assert_eq!(ticket.wait.silent_for(table.now()), None);
    }

    /// A connection of a test: its ticket, its watched end, the peer's end.
    struct Conn {
        ticket: Ticket,
        io: Watched<DuplexStream>,
        far: DuplexStream,
    }

    impl Conn {
        async fn admit(table: &Arc<Admission>, on_shed: &(dyn Fn(Dropped) + Sync)) -> Self {
            let ticket = table.admit(&CancellationToken::new(), on_shed).await;
            let (near, far) = tokio::io::duplex(64);
            let io = table.watch(near, &ticket);
            Self { ticket, io, far }
        }

        /// Reads one byte the peer sends: a wait on the peer until it does.
        async fn read_flight(&mut self) -> Option<()> {
            let mut byte = [0u8; 1];
            tokio::select! {
                () = self.ticket.cancel.cancelled() => None,
                read = self.io.read_exact(&mut byte) => read.ok().map(drop),
            }
        }
    }

    /// Drop reasons as an accept loop would count them.
    #[derive(Default)]
    struct Counts {
        no_hello: AtomicUsize,
        stalled: AtomicUsize,
    }

    impl Counts {
        fn count(&self, reason: Dropped) {
            match reason {
                Dropped::NoHello => &self.no_hello,
                Dropped::Stalled => &self.stalled,
                other => panic!("{other:?} is not a drop at the cap"),
            }
            .fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A peer far away (each of its flights arrives 300 ms after the
    /// server's last) shares a cap of three with silent connections that
    /// keep arriving: every one of those is dropped to make room once
    /// silent for a second, before it sent anything; the far peer, whose
    /// waits add up to much more than that, never is.
    #[tokio::test(start_paused = true)]
    async fn at_the_cap_silent_connections_make_room_and_a_late_answering_peer_never_does() {
        let table = Admission::new(3, 1);
        let counts = Arc::new(Counts::default());
        let on_shed = {
            let counts = counts.clone();
            move |reason| counts.count(reason)
        };
        let mut far = Conn::admit(&table, &on_shed).await;
        let mut peer = std::mem::replace(&mut far.far, tokio::io::duplex(1).0);
        // The peer: a flight 300 ms after each of the server's.
        let flights = 20;
        let peer_task = tokio::spawn(async move {
            for _ in 0..flights {
                tokio::time::sleep(Duration::from_millis(300)).await;
                peer.write_all(b"f").await.unwrap();
            }
            peer
        });
        // The server's side of it: the hello, its turn, then the rest.
        let far_table = table.clone();
        let server_side = tokio::spawn(async move {
            far.read_flight().await?;
            drop(far_table.turn(&far.ticket).await);
            for _ in 1..flights {
                far.read_flight().await?;
            }
            far_table.done(&far.ticket);
            Some(far.ticket)
        });
        // Silent connections arrive one every 200 ms, each held until it
        // is dropped.
        let mut silent = tokio::task::JoinSet::new();
        for _ in 0..40 {
            let mut conn = Conn::admit(&table, &on_shed).await;
            silent.spawn(async move {
                assert_eq!(conn.read_flight().await, None, "a silent one answered");
                assert_eq!(conn.ticket.stage(), Stage::Hello);
            });
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let ticket = server_side
            .await
            .unwrap()
            .expect("the far peer was dropped");
        assert!(!ticket.cancel.is_cancelled());
        drop(peer_task.await.unwrap());
        assert!(counts.no_hello.load(Ordering::Relaxed) >= 30);
        assert_eq!(counts.stalled.load(Ordering::Relaxed), 0);
    }

    /// A handshake whose ClientHello is in waits for its turn as long as it
    /// takes (a minute here, behind one that holds the only turn): it is
    /// never dropped to make room meanwhile, and its deadline runs from
    /// the start of its turn, not from its `accept`.
    #[tokio::test(start_paused = true)]
    async fn a_queued_handshake_is_never_dropped_and_its_deadline_starts_with_its_turn() {
        let table = Admission::new(2, 1);
        let counts = Counts::default();
        let on_shed = |reason| counts.count(reason);
        let first = Conn::admit(&table, &on_shed).await;
        let held = table.turn(&first.ticket).await;
        let mut queued = Conn::admit(&table, &on_shed).await;
        // Its ClientHello came after a wait on the peer.
        queued.far.write_all(b"h").await.unwrap();
        queued.read_flight().await.unwrap();
        let turn = table.turn(&queued.ticket);
        tokio::pin!(turn);
        assert!((&mut turn).now_or_never().is_none(), "one turn at a time");
        assert_eq!(queued.ticket.stage(), Stage::Queued);
        // A third connection waits for room for a minute: neither pending
        // one is silent.
        let third = Conn::admit(&table, &on_shed);
        tokio::pin!(third);
        tokio::select! {
            _ = &mut third => panic!("admitted past the cap"),
            () = tokio::time::sleep(Duration::from_secs(60)) => {}
        }
        assert!(!queued.ticket.cancel.is_cancelled());
        assert_eq!(counts.no_hello.load(Ordering::Relaxed), 0);
        drop(held);
        let turn = turn.await;
        assert_eq!(turn.deadline, Instant::now() + HANDSHAKE_TIMEOUT);
        assert_eq!(queued.ticket.stage(), Stage::Started);
    }

    /// At the cap, a silent connection is not dropped while a handshake
    /// waits for its turn (the CPU has work: a new connection would only
    /// wait too); once none waits, it is.
    #[tokio::test(start_paused = true)]
    async fn no_silent_connection_is_dropped_while_a_handshake_waits_for_its_turn() {
        let table = Admission::new(3, 1);
        let counts = Arc::new(Counts::default());
        let on_shed = {
            let counts = counts.clone();
            move |reason| counts.count(reason)
        };
        let working = Conn::admit(&table, &on_shed).await;
        let held = table.turn(&working.ticket).await;
        let waiting = Conn::admit(&table, &on_shed).await;
        let turn = table.turn(&waiting.ticket);
        tokio::pin!(turn);
        assert!((&mut turn).now_or_never().is_none());
        assert_eq!(table.queued(), 1);
        // A connection that never sends its ClientHello, held by its task.
        let silent = Conn::admit(&table, &on_shed).await;
        let silent = tokio::spawn(async move {
            let mut silent = silent;
            silent.read_flight().await
        });
        let fourth = Conn::admit(&table, &on_shed);
        tokio::pin!(fourth);
        tokio::select! {
            _ = &mut fourth => panic!("admitted past the cap"),
            () = tokio::time::sleep(HELLO_SILENCE * 10) => {}
        }
        assert_eq!(
            counts.no_hello.load(Ordering::Relaxed),
            0,
            "dropped while busy"
        );
        // The queue empties: the silent one makes room.
        drop(held);
        let _turn = turn.await;
        assert_eq!(table.queued(), 0);
        let _fourth = fourth.await;
        assert_eq!(silent.await.unwrap(), None, "the silent one was stopped");
        assert_eq!(counts.no_hello.load(Ordering::Relaxed), 1);
    }

    /// Turns go in arrival order, as many at a time as asked for.
    #[tokio::test(start_paused = true)]
    async fn turns_go_in_arrival_order_two_at_a_time() {
        let table = Admission::new(16, 2);
        let mut conns = Vec::new();
        for _ in 0..6 {
            conns.push(Conn::admit(&table, &|_| {}).await);
        }
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = tokio::task::JoinSet::new();
        for (k, conn) in conns.into_iter().enumerate() {
            let (table, order) = (table.clone(), order.clone());
            tasks.spawn(async move {
                let turn = table.turn(&conn.ticket).await;
                order.lock().unwrap().push(k);
                // The signature: the turn held a while.
                tokio::time::sleep(Duration::from_millis(10)).await;
                drop(turn);
            });
            // Arrival order.
            tokio::task::yield_now().await;
        }
        tokio::time::sleep(Duration::from_millis(15)).await;
        assert_eq!(*order.lock().unwrap(), [0, 1, 2, 3], "two at a time");
        while tasks.join_next().await.is_some() {}
        assert_eq!(*order.lock().unwrap(), [0, 1, 2, 3, 4, 5]);
    }

    /// At the cap, a started handshake whose peer has sent nothing for
    /// five seconds is dropped for a new connection, but a silent one in
    /// the hello stage goes before it.
    #[tokio::test(start_paused = true)]
    async fn a_started_handshake_silent_for_five_seconds_is_dropped_after_silent_hellos() {
        let table = Admission::new(2, 1);
        let counts = Counts::default();
        let on_shed = |reason| counts.count(reason);
        let mut started = Conn::admit(&table, &on_shed).await;
        started.far.write_all(b"h").await.unwrap();
        started.read_flight().await.unwrap();
        drop(table.turn(&started.ticket).await);
        // It waits for its peer's answer (which never comes).
        let waiting = tokio::spawn(async move {
            let read = started.read_flight().await;
            (read, started)
        });
        tokio::task::yield_now().await;
        // A connection with no ClientHello, held by its task until dropped.
        let hello = Conn::admit(&table, &on_shed).await;
        let hello = tokio::spawn(async move {
            let mut hello = hello;
            hello.read_flight().await
        });
        tokio::task::yield_now().await;
        tokio::time::advance(Duration::from_secs(6)).await;
        // Both are droppable; the one nothing was spent on goes first.
        let _third = Conn::admit(&table, &on_shed).await;
        assert_eq!(hello.await.unwrap(), None, "the silent hello was stopped");
        assert_eq!(counts.no_hello.load(Ordering::Relaxed), 1);
        assert_eq!(counts.stalled.load(Ordering::Relaxed), 0);
        // Then the started one: it has been silent for six seconds.
        let fourth = Conn::admit(&table, &on_shed);
        tokio::pin!(fourth);
        assert!((&mut fourth).now_or_never().is_none());
        assert_eq!(counts.stalled.load(Ordering::Relaxed), 1);
        let (read, started) = waiting.await.unwrap();
        assert_eq!(read, None, "the started one was stopped");
        drop(started);
        let _fourth = fourth.await;
        assert_eq!(table.pending(), 2);
    }

    /// Below [`STARTED_SILENCE`], a started handshake is kept at the cap
    /// however long its peer's waits add up to.
    #[tokio::test(start_paused = true)]
    async fn a_started_handshake_silent_for_less_than_five_seconds_is_kept() {
        let table = Admission::new(1, 1);
        let started = Conn::admit(&table, &|_| {}).await;
        drop(table.turn(&started.ticket).await);
        let mut io = started.io;
        let mut byte = [0u8; 1];
        assert!(io.read(&mut byte).now_or_never().is_none());
        let shutdown = CancellationToken::new();
        let next = table.admit(&shutdown, &|_| panic!("dropped"));
        tokio::pin!(next);
        tokio::select! {
            _ = &mut next => panic!("admitted past the cap"),
            () = tokio::time::sleep(STARTED_SILENCE - Duration::from_millis(1)) => {}
        }
        assert!(!started.ticket.cancel.is_cancelled());
    }

    #[test]
    fn the_largest_cap_means_no_admission() {
        let table = Admission::new(usize::MAX, 2);
        assert_eq!(table.slots.available_permits(), Semaphore::MAX_PERMITS);
        assert_eq!(table.turns.available_permits(), Semaphore::MAX_PERMITS);
        let table = Admission::new(Semaphore::MAX_PERMITS - 1, 2);
        assert_eq!(table.turns.available_permits(), 2);
    }
}
