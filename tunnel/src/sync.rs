//! The primitives under the queues and the flow waits, and the audit of
//! which streams take which lock.
//!
//! They are built on std's and futures-util's, or on loom's with the
//! `loom` feature, so that `loom` checks every interleaving of the real
//! queue and flow code (as tokio checks its own; tokio's `Notify`, `mpsc`
//! and tokio-util's `CancellationToken` cannot run under loom, which is why
//! the waits of the byte queue and of a connection's flow use these
//! instead).
//!
//! - [`Mutex`]: std's (or loom's), seen by the [`audit`] in debug builds.
//! - [`Signal`]: wakes the one task that waits on it; a signal nobody
//!   waited for is kept for the next wait.
//! - [`Latch`]: a flag set once, which any number of tasks wait for;
//!   reading it takes no lock.
//! - [`audit`]: which streams took which lock, per server instance, for
//!   the test that moving DATA takes no lock a third stream takes.

use std::{
    future::Future,
    pin::Pin,
    sync::PoisonError,
    task::{Context, Poll, Waker},
};

#[cfg(not(feature = "loom"))]
pub(crate) use futures_util::task::AtomicWaker;
#[cfg(feature = "loom")]
pub(crate) use loom::sync::{
    Arc,
    atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering, fence},
};
#[cfg(not(feature = "loom"))]
pub(crate) use std::sync::{
    Arc,
    atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering, fence},
};

#[cfg(feature = "loom")]
use loom::sync as shim;
#[cfg(not(feature = "loom"))]
use std::sync as shim;

/// loom's `AtomicWaker`, registering by reference as futures-util's does.
#[cfg(feature = "loom")]
#[derive(Debug)]
pub(crate) struct AtomicWaker(loom::future::AtomicWaker);

#[cfg(feature = "loom")]
impl AtomicWaker {
    pub(crate) fn new() -> Self {
        Self(loom::future::AtomicWaker::new())
    }

    pub(crate) fn register(&self, waker: &Waker) {
        self.0.register_by_ref(waker);
    }

    pub(crate) fn wake(&self) {
        self.0.wake();
    }
}

/// A guard of [`Mutex`].
pub type MutexGuard<'a, T> = shim::MutexGuard<'a, T>;

/// A mutex whose acquisitions the [`audit`] sees (debug builds). A panic
/// elsewhere while it is held leaves the data to the next holder: every
/// use keeps its data consistent between statements.
#[derive(Debug)]
pub struct Mutex<T> {
    /// The lock.
    inner: shim::Mutex<T>,
    /// What the audit calls it.
    id: audit::LockId,
}

impl<T> Mutex<T> {
    /// A mutex that at most the two streams of one connection, or one
    /// stream's own tasks, take (or the control path).
    pub fn new(value: T) -> Self {
        Self::of_kind(value, audit::LockKind::Plain)
    }

    /// A mutex that every stream may take (the server's control state):
    /// the audit expects it off the DATA path.
    pub fn shared(value: T) -> Self {
        Self::of_kind(value, audit::LockKind::Shared)
    }

    /// The wait list of a queue that many connections share: taken only by
    /// senders that must wait and by releases while some do.
    pub(crate) fn wait_list(value: T) -> Self {
        Self::of_kind(value, audit::LockKind::WaitList)
    }

    fn of_kind(value: T, kind: audit::LockKind) -> Self {
        Self {
            inner: shim::Mutex::new(value),
            id: audit::LockId::new(kind),
        }
    }

    /// Locks it.
    pub fn lock(&self) -> MutexGuard<'_, T> {
        audit::taken(&self.id);
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl<T: Default> Default for Mutex<T> {
    fn default() -> Self {
        Self::new(T::default())
    }
}

/// Wakes the one task waiting on it. A [`notify`](Signal::notify) with
/// nobody waiting is kept, so that the next wait returns at once: a waiter
/// checks its condition, then waits, and a notify in between is not lost.
/// Takes no lock.
#[derive(Debug)]
pub struct Signal {
    /// A notify not yet consumed by a wait.
    permit: AtomicBool,
    /// The waiting task.
    waker: AtomicWaker,
}

impl Default for Signal {
    fn default() -> Self {
        Self::new()
    }
}

impl Signal {
    /// A signal with no permit.
    pub fn new() -> Self {
        Self {
            permit: AtomicBool::new(false),
            waker: AtomicWaker::new(),
        }
    }

    /// Wakes the waiting task, or keeps a permit for the next wait.
    pub fn notify(&self) {
        self.permit.store(true, Ordering::Release);
        self.waker.wake();
    }

    /// Ready once notified (consuming the permit). Only one task may wait
    /// at a time: a second waiter's registration replaces the first's.
    pub fn poll_wait(&self, cx: &mut Context<'_>) -> Poll<()> {
        if self.take_permit() {
            return Poll::Ready(());
        }
        self.waker.register(cx.waker());
        if self.take_permit() {
            return Poll::Ready(());
        }
        Poll::Pending
    }

    /// Consumes the permit, if there is one. A compare-exchange rather
    /// than a swap: the same for a flag, and what loom models correctly
    /// (tokio-rs/loom#254).
    fn take_permit(&self) -> bool {
        self.permit
            .compare_exchange(true, false, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// Waits to be notified (see [`Signal::poll_wait`]).
    ///
    /// # Cancel safety
    /// Cancel safe: a permit is consumed only when this returns.
    pub async fn wait(&self) {
        std::future::poll_fn(|cx| self.poll_wait(cx)).await;
    }
}

/// A flag set once, which any number of tasks may wait for. Reading it is
/// an atomic load; only a waiting task's poll takes its lock.
#[derive(Debug)]
pub struct Latch {
    /// Whether it was set.
    set: AtomicBool,
    /// The waiting tasks, by key.
    waiters: Mutex<Waiters>,
}

/// The wakers of an [`Latch`]'s waiting tasks.
#[derive(Debug, Default)]
struct Waiters {
    /// The next key.
    next: u64,
    /// Registered wakers by key (few: a connection has one or two waits).
    wakers: Vec<(u64, Waker)>,
}

impl Default for Latch {
    fn default() -> Self {
        Self::new()
    }
}

impl Latch {
    /// An event not yet set.
    pub fn new() -> Self {
        Self {
            set: AtomicBool::new(false),
            waiters: Mutex::new(Waiters::default()),
        }
    }

    /// Sets it, waking every waiting task.
    pub fn set(&self) {
        if self
            .set
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return;
        }
        let wakers = std::mem::take(&mut self.waiters.lock().wakers);
        for (_, waker) in wakers {
            waker.wake();
        }
    }

    /// Whether it was set.
    pub fn is_set(&self) -> bool {
        self.set.load(Ordering::Acquire)
    }

    /// Resolves once it is set.
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub fn wait(&self) -> LatchWait<'_> {
        LatchWait {
            event: self,
            key: None,
        }
    }
}

/// The future of [`Latch::wait`].
#[derive(Debug)]
pub struct LatchWait<'a> {
    /// The event.
    event: &'a Latch,
    /// Its key among the waiters, once registered.
    key: Option<u64>,
}

impl Future for LatchWait<'_> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        if this.event.is_set() {
            return Poll::Ready(());
        }
        let mut waiters = this.event.waiters.lock();
        // `set` stores the flag before it takes the lock: seen here, or
        // this waker is in the list it empties.
        if this.event.is_set() {
            return Poll::Ready(());
        }
        let key = match this.key {
            Some(key) => key,
            None => {
                let key = waiters.next;
                waiters.next += 1;
                this.key = Some(key);
                key
            }
        };
        match waiters.wakers.iter_mut().find(|(k, _)| *k == key) {
            Some((_, waker)) => waker.clone_from(cx.waker()),
            None => waiters.wakers.push((key, cx.waker().clone())),
        }
        Poll::Pending
    }
}

impl Drop for LatchWait<'_> {
    fn drop(&mut self) {
        if let Some(key) = self.key
            && !self.event.is_set()
        {
            self.event.waiters.lock().wakers.retain(|(k, _)| *k != key);
        }
    }
}

pub mod audit {
    //! Which streams take which [`Mutex`](super::Mutex), so that a test can
    //! check the invariant of the DATA path: moving a connection's bytes
    //! takes no lock that a third stream takes. What a connection's two
    //! streams share (its flow state) is allowed; so is the wait list of a
    //! stream's outbound queue, which only senders that must wait take
    //! ([`LockKind::WaitList`]); a [`LockKind::Shared`] lock (the server's
    //! control state) is not.
    //!
    //! A server's drivers run inside [`scope`] (or [`sync_scope`] for a
    //! stream polled by a library's task) with its [`LockAudit`] and the
    //! stream they drive; debug builds record each lock taken there while
    //! the audit is [`LockAudit::start`]ed. Release builds record nothing.

    use std::{
        collections::{BTreeSet, HashMap},
        future::Future,
        sync::{Arc, Mutex, PoisonError},
    };

    #[cfg(all(debug_assertions, not(feature = "loom")))]
    use std::sync::atomic::AtomicU64;
    #[cfg(not(feature = "loom"))]
    use std::sync::atomic::{AtomicBool, Ordering};

    /// What kind of lock it is, as its owner declared it.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub enum LockKind {
        /// One connection's (its two streams take it) or one stream's own.
        Plain,
        /// A queue's wait list: taken only under backpressure.
        WaitList,
        /// Taken by every stream: never on the DATA path.
        Shared,
    }

    /// A lock's identity: unique in the process, with its kind (debug
    /// builds only: release builds record nothing).
    #[derive(Debug)]
    pub(crate) struct LockId {
        /// Unique number.
        #[cfg(all(debug_assertions, not(feature = "loom")))]
        number: u64,
        /// Its kind.
        #[cfg(all(debug_assertions, not(feature = "loom")))]
        kind: LockKind,
    }

    #[cfg(all(debug_assertions, not(feature = "loom")))]
    static NEXT_LOCK: AtomicU64 = AtomicU64::new(0);

    impl LockId {
        pub(crate) fn new(kind: LockKind) -> Self {
            #[cfg(all(debug_assertions, not(feature = "loom")))]
            {
                Self {
                    number: NEXT_LOCK.fetch_add(1, Ordering::Relaxed),
                    kind,
                }
            }
            #[cfg(not(all(debug_assertions, not(feature = "loom"))))]
            {
                let _ = kind;
                Self {}
            }
        }
    }

    /// Who took a lock: a stream, by the kind of stream and its id.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
    pub struct Taker {
        /// What kind of stream (`"frontend"`, `"backend"`, …).
        pub kind: &'static str,
        /// Its id among those of its kind.
        pub id: u64,
    }

    /// What the audit saw of one lock.
    #[derive(Debug, Clone)]
    pub struct Record {
        /// Its kind.
        pub kind: LockKind,
        /// The streams that took it.
        pub takers: BTreeSet<Taker>,
        /// How many times it was taken.
        pub count: u64,
    }

    /// The locks one server instance's streams took; see the module
    /// documentation.
    #[derive(Debug, Default)]
    pub struct LockAudit {
        /// Whether locks are recorded now.
        #[cfg(not(feature = "loom"))]
        recording: AtomicBool,
        /// What was recorded, by lock number.
        records: Mutex<HashMap<u64, Record>>,
    }

    impl LockAudit {
        /// A new audit, not recording.
        pub fn new() -> Arc<Self> {
            Arc::default()
        }

        /// Forgets what was recorded and records from now on (debug builds).
        pub fn start(&self) {
            self.records().clear();
            #[cfg(not(feature = "loom"))]
            self.recording.store(true, Ordering::SeqCst);
        }

        /// Stops recording; what was recorded since [`LockAudit::start`].
        pub fn stop(&self) -> Vec<Record> {
            #[cfg(not(feature = "loom"))]
            self.recording.store(false, Ordering::SeqCst);
            self.records().drain().map(|(_, record)| record).collect()
        }

        /// Whether this build records (debug builds do).
        pub fn records_locks() -> bool {
            cfg!(all(debug_assertions, not(feature = "loom")))
        }

        #[cfg(all(debug_assertions, not(feature = "loom")))]
        fn record(&self, lock: &LockId, taker: Taker) {
            if !self.recording.load(Ordering::Relaxed) {
                return;
            }
            let mut records = self.records();
            let record = records.entry(lock.number).or_insert_with(|| Record {
                kind: lock.kind,
                takers: BTreeSet::new(),
                count: 0,
            });
            record.takers.insert(taker);
            record.count += 1;
        }

        fn records(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Record>> {
            self.records.lock().unwrap_or_else(PoisonError::into_inner)
        }
    }

    #[cfg(all(debug_assertions, not(feature = "loom")))]
    tokio::task_local! {
        /// The audit and the stream of the task being polled.
        static CURRENT: (Arc<LockAudit>, Taker);
    }

    /// Runs `future` as `taker`'s, recorded by `audit` (debug builds).
    #[cfg(all(debug_assertions, not(feature = "loom")))]
    pub fn scope<F: Future>(
        audit: Arc<LockAudit>,
        taker: Taker,
        future: F,
    ) -> impl Future<Output = F::Output> {
        CURRENT.scope((audit, taker), future)
    }

    /// Runs `future` as it is (release builds record nothing).
    #[cfg(not(all(debug_assertions, not(feature = "loom"))))]
    pub fn scope<F: Future>(
        _audit: Arc<LockAudit>,
        _taker: Taker,
        future: F,
    ) -> impl Future<Output = F::Output> {
        future
    }

    /// Runs `f` as `taker`'s, recorded by `audit` (debug builds): for a
    /// stream that a library's task polls.
    pub fn sync_scope<R>(audit: &Arc<LockAudit>, taker: Taker, f: impl FnOnce() -> R) -> R {
        #[cfg(all(debug_assertions, not(feature = "loom")))]
        {
            CURRENT.sync_scope((audit.clone(), taker), f)
        }
        #[cfg(not(all(debug_assertions, not(feature = "loom"))))]
        {
            let _ = (audit, taker);
            f()
        }
    }

    /// Notes that `lock` was taken, if the current task is audited.
    pub(crate) fn taken(lock: &LockId) {
        #[cfg(all(debug_assertions, not(feature = "loom")))]
        {
            let _ = CURRENT.try_with(|(audit, taker)| audit.record(lock, *taker));
        }
        #[cfg(not(all(debug_assertions, not(feature = "loom"))))]
        {
            let _ = lock;
        }
    }
}

#[cfg(all(test, not(feature = "loom")))]
mod tests {
    use std::sync::atomic::AtomicUsize as StdCount;

    use super::*;

    /// A waker that counts its wakes.
    struct Counting(StdCount);

    impl std::task::Wake for Counting {
        fn wake(self: std::sync::Arc<Self>) {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }

    fn counting() -> (std::sync::Arc<Counting>, Waker) {
        let count = std::sync::Arc::new(Counting(StdCount::new(0)));
        (count.clone(), Waker::from(count))
    }

    #[test]
    fn a_signal_before_the_wait_is_kept_for_it() {
        let signal = Signal::new();
        let (count, waker) = counting();
        let mut cx = Context::from_waker(&waker);
        signal.notify();
        assert_eq!(signal.poll_wait(&mut cx), Poll::Ready(()));
        assert_eq!(signal.poll_wait(&mut cx), Poll::Pending, "one permit");
        signal.notify();
        assert_eq!(count.0.load(std::sync::atomic::Ordering::SeqCst), 1);
        assert_eq!(signal.poll_wait(&mut cx), Poll::Ready(()));
    }

    #[test]
    fn a_latch_wakes_every_waiter_and_forgets_dropped_ones() {
        let event = Latch::new();
        let (count, waker) = counting();
        let mut cx = Context::from_waker(&waker);
        let mut first = Box::pin(event.wait());
        let mut second = Box::pin(event.wait());
        let mut dropped = Box::pin(event.wait());
        for wait in [&mut first, &mut second, &mut dropped] {
            assert_eq!(wait.as_mut().poll(&mut cx), Poll::Pending);
        }
        // Polled again: the waker is replaced, not added.
        assert_eq!(first.as_mut().poll(&mut cx), Poll::Pending);
        assert_eq!(event.waiters.lock().wakers.len(), 3);
        drop(dropped);
        assert_eq!(event.waiters.lock().wakers.len(), 2);
        assert!(!event.is_set());
        event.set();
        assert_eq!(count.0.load(std::sync::atomic::Ordering::SeqCst), 2);
        assert_eq!(first.as_mut().poll(&mut cx), Poll::Ready(()));
        assert_eq!(second.as_mut().poll(&mut cx), Poll::Ready(()));
        assert_eq!(
            Box::pin(event.wait()).as_mut().poll(&mut cx),
            Poll::Ready(())
        );
    }

    #[tokio::test]
    async fn the_audit_records_the_streams_that_take_each_lock() {
        let audit = audit::LockAudit::new();
        let lock = std::sync::Arc::new(Mutex::new(0));
        let other = std::sync::Arc::new(Mutex::shared(0));
        let fe = audit::Taker {
            kind: "frontend",
            id: 1,
        };
        let be = audit::Taker {
            kind: "backend",
            id: 1,
        };
        // Not recording yet.
        audit::scope(audit.clone(), fe, async { *lock.lock() += 1 }).await;
        audit.start();
        audit::scope(audit.clone(), fe, async { *lock.lock() += 1 }).await;
        audit::sync_scope(&audit, be, || *lock.lock() += 1);
        audit::sync_scope(&audit, be, || *other.lock() += 1);
        // Outside any scope: not recorded.
        *other.lock() += 1;
        let mut records = audit.stop();
        if !audit::LockAudit::records_locks() {
            assert!(records.is_empty());
            return;
        }
        records.sort_by_key(|r| r.count);
        assert_eq!(records.len(), 2);
        assert_eq!(records[0].kind, audit::LockKind::Shared);
        assert_eq!(records[0].takers.iter().copied().collect::<Vec<_>>(), [be]);
        assert_eq!(records[1].kind, audit::LockKind::Plain);
        assert_eq!(records[1].count, 2);
        assert_eq!(records[1].takers.len(), 2);
    }
}
