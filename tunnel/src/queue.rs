//! [`queue`]: the outbound queue of a stream that many connections share
//! (an agent stream, a frontend stream), bounded in bytes.
//!
//! Two ways in, for two kinds of sender:
//! - [`QueueTx::send`] waits while the queue holds `limit` bytes or more:
//!   for a connection's bulk data, whose sender can wait (raced against its
//!   connection's end by the caller);
//! - [`QueueTx::push`] never waits: for control packets sent by stream
//!   readers, which must keep reading (two readers waiting on each other's
//!   full queues would deadlock). It is admitted up to `limit + reserve`
//!   bytes; beyond that the peer has stopped reading its stream, and the
//!   caller ends the stream instead of queueing more
//!   ([`QueueTx::push_or_end`], with the stream's [`Unread`]).
//!
//! An item's cost is released when the receiver takes it. An item is
//! admitted while the queue holds less than its cap, so the cap is exceeded
//! by one item at most and no item is too large to pass. Waiting senders
//! get room in order of arrival, and each release wakes only the senders
//! it admits ([`Room`]): a thousand connections blocked on one agent
//! stream cost one wake-up per packet the stream sends, not a thousand.
//! The receiver ends ([`QueueRx::recv`] returns `None`) once every sender
//! is gone; dropping the receiver wakes waiting senders with an error.
//!
//! Each item travels boxed ([`Slot`]): tokio's channel allocates its first
//! block of 32 slots when it is made, and every agent stream and every
//! frontend stream has a queue, idle or not. With items inline that block
//! was 32 packets (3 KiB per idle agent on the server, as much per idle
//! tunnel); boxed, it is 32 pointers. The price is one allocation per item,
//! against a packet's encoding and its frame.

use std::{
    collections::VecDeque,
    future::Future,
    pin::Pin,
    task::{Context, Poll},
};

use tokio::sync::mpsc;

use crate::sync::{Arc, AtomicBool, AtomicU8, AtomicUsize, AtomicWaker, Mutex, Ordering, fence};

/// The receiver is gone; the item comes back.
#[derive(Debug, PartialEq, Eq)]
pub struct Closed<T>(pub T);

/// Why [`QueueTx::push`] refused an item; the item comes back.
#[derive(Debug, PartialEq, Eq)]
pub enum PushError<T> {
    /// The queue holds `limit + reserve` bytes: the peer does not read.
    Full(T),
    /// The receiver is gone.
    Closed(T),
}

/// How a stream ends when its peer stops reading it (see
/// [`QueueTx::push_or_end`]).
pub trait Unread {
    /// Whether the stream has ended already (then nothing is logged or
    /// counted again).
    fn is_ended(&self) -> bool;

    /// Ends the stream: its peer stopped reading, with `queued` bytes
    /// waiting; the first time (`first`), logged and counted before.
    fn end_unread(&self, queued: usize, first: bool);
}

/// The byte accounting of a queue: what is queued, and the senders waiting
/// for room, served in order of arrival (a byte semaphore's fairness, as
/// tokio's `Semaphore::acquire_many`): each release of room wakes the
/// waiters it admits, one wake each, never all of them.
///
/// While no sender waits, admitting and releasing are atomic operations
/// and take no lock. The wait list's lock is taken only by a sender that
/// must wait (and then by the releases and drops that serve it), so it is
/// shared only under backpressure.
pub(crate) struct Room {
    /// Bytes admitted and not yet released.
    queued: AtomicUsize,
    /// Senders in the wait list: while there are some, new senders queue
    /// behind them, and releases serve them.
    waiting: AtomicUsize,
    /// The receiver is gone: every wait fails.
    closed: AtomicBool,
    /// The waiting senders, in order of arrival.
    list: Mutex<VecDeque<Arc<Waiter>>>,
    /// Where senders wait.
    limit: usize,
    /// Extra room for [`Room::push`].
    reserve: usize,
}

/// A waiting sender, as the wait list and its future share it.
struct Waiter {
    /// Its cost.
    cost: usize,
    /// [`WAITING`], [`GRANTED`] (its cost is admitted) or [`REFUSED`].
    state: AtomicU8,
    /// Its task.
    waker: AtomicWaker,
}

/// In the list.
const WAITING: u8 = 0;
/// Out of the list, its cost counted in: it may go.
const GRANTED: u8 = 1;
/// Out of the list: the receiver is gone.
const REFUSED: u8 = 2;

impl Room {
    /// A room where senders wait at `limit` bytes and pushes fail past
    /// `limit + reserve`.
    pub(crate) fn new(limit: usize, reserve: usize) -> Self {
        Self {
            queued: AtomicUsize::new(0),
            waiting: AtomicUsize::new(0),
            closed: AtomicBool::new(false),
            list: Mutex::wait_list(VecDeque::new()),
            limit,
            reserve,
        }
    }

    /// Counts `cost` in if less than `cap` is queued (so `cap` is exceeded
    /// by one item at most, and no item is too large to pass).
    fn admit(&self, cost: usize, cap: usize) -> bool {
        self.queued
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |q| {
                (q < cap).then_some(q.saturating_add(cost))
            })
            .is_ok()
    }

    /// Admits `cost` without waiting, up to `limit + reserve` (control
    /// packets, which go ahead of waiting senders).
    pub(crate) fn push(&self, cost: usize) -> bool {
        self.admit(cost, self.limit.saturating_add(self.reserve))
    }

    /// Admits `cost` without waiting if nobody waits and less than
    /// `limit` is queued (a budget's take: it goes behind waiters, never
    /// ahead of them).
    pub(crate) fn try_admit(&self, cost: usize) -> bool {
        self.waiting.load(Ordering::SeqCst) == 0 && self.admit(cost, self.limit)
    }

    /// Waits until `cost` is admitted, behind the senders already waiting.
    ///
    /// # Cancel safety
    /// Cancel safe: a dropped wait holds no room (room granted to it
    /// passes to the next waiter).
    pub(crate) fn acquire(&self, cost: usize) -> Acquire<'_> {
        Acquire {
            room: self,
            cost,
            waiter: None,
            done: false,
        }
    }

    /// Releases `cost`, and admits waiting senders while there is room.
    pub(crate) fn release(&self, cost: usize) {
        self.queued.fetch_sub(cost, Ordering::AcqRel);
        // Pairs with the fence in `Acquire::first`: a waiter counts itself,
        // then tries to admit itself; a release lowers `queued`, then looks
        // at `waiting`. With a SeqCst fence between each side's write and
        // read, one of the two sees the other (a fence, not SeqCst
        // accesses: what loom models).
        fence(Ordering::SeqCst);
        if self.waiting.load(Ordering::Acquire) > 0 {
            self.serve(&mut self.list.lock());
        }
    }

    /// Admits waiting senders, first come first, while there is room; one
    /// wake each.
    fn serve(&self, list: &mut VecDeque<Arc<Waiter>>) {
        while let Some(head) = list.front() {
            if !self.admit(head.cost, self.limit) {
                break;
            }
            let head = list.pop_front().expect("a head was seen");
            self.waiting.fetch_sub(1, Ordering::SeqCst);
            head.state.store(GRANTED, Ordering::Release);
            head.waker.wake();
        }
    }

    /// The receiver is gone: every waiting sender fails, and every later one.
    pub(crate) fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        let mut list = self.list.lock();
        for waiter in list.drain(..) {
            self.waiting.fetch_sub(1, Ordering::SeqCst);
            waiter.state.store(REFUSED, Ordering::Release);
            waiter.waker.wake();
        }
    }

    /// Whether the receiver is gone.
    pub(crate) fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }

    /// Bytes admitted and not yet released.
    pub(crate) fn queued(&self) -> usize {
        self.queued.load(Ordering::Acquire)
    }

    /// Senders waiting now.
    pub(crate) fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Acquire)
    }
}

/// The future of [`Room::acquire`]: `Ok` once admitted, `Err` if the
/// receiver went first.
pub(crate) struct Acquire<'a> {
    /// The room.
    room: &'a Room,
    /// What it waits to admit.
    cost: usize,
    /// Its place in the wait list, once it waits.
    waiter: Option<Arc<Waiter>>,
    /// It returned (its room, if any, is the caller's).
    done: bool,
}

impl Acquire<'_> {
    /// First poll: admitted at once when nobody waits and there is room,
    /// else in the wait list.
    fn first(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), ()>> {
        let room = self.room;
        if room.is_closed() {
            return Poll::Ready(Err(()));
        }
        if room.waiting.load(Ordering::SeqCst) == 0 && room.admit(self.cost, room.limit) {
            return Poll::Ready(Ok(()));
        }
        let mut list = room.list.lock();
        if room.is_closed() {
            return Poll::Ready(Err(()));
        }
        room.waiting.fetch_add(1, Ordering::AcqRel);
        // See `Room::release`.
        fence(Ordering::SeqCst);
        // Nobody ahead: room released since the first look is this one's.
        if list.is_empty() && room.admit(self.cost, room.limit) {
            room.waiting.fetch_sub(1, Ordering::SeqCst);
            return Poll::Ready(Ok(()));
        }
        let waiter = Arc::new(Waiter {
            cost: self.cost,
            state: AtomicU8::new(WAITING),
            waker: AtomicWaker::new(),
        });
        waiter.waker.register(cx.waker());
        list.push_back(waiter.clone());
        self.waiter = Some(waiter);
        Poll::Pending
    }
}

impl Future for Acquire<'_> {
    type Output = Result<(), ()>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let result = match &this.waiter {
            None => this.first(cx),
            Some(waiter) => {
                let mut state = waiter.state.load(Ordering::Acquire);
                if state == WAITING {
                    waiter.waker.register(cx.waker());
                    state = waiter.state.load(Ordering::Acquire);
                }
                match state {
                    GRANTED => Poll::Ready(Ok(())),
                    REFUSED => Poll::Ready(Err(())),
                    _ => Poll::Pending,
                }
            }
        };
        if result.is_ready() {
            this.done = true;
        }
        result
    }
}

impl Drop for Acquire<'_> {
    fn drop(&mut self) {
        let Some(waiter) = self.waiter.take() else {
            return;
        };
        if self.done {
            return;
        }
        let room = self.room;
        let mut list = room.list.lock();
        match waiter.state.load(Ordering::Acquire) {
            WAITING => {
                if let Some(at) = list.iter().position(|w| Arc::ptr_eq(w, &waiter)) {
                    list.remove(at);
                    room.waiting.fetch_sub(1, Ordering::SeqCst);
                }
                // Whoever was behind it may fit now.
                room.serve(&mut list);
            }
            GRANTED => {
                // Room given and never used: the next waiter's.
                room.queued.fetch_sub(waiter.cost, Ordering::SeqCst);
                room.serve(&mut list);
            }
            _ => {}
        }
    }
}

/// An item and its cost, as the channel carries them: boxed, so that a
/// queue's first block of slots is small whatever `T` is.
type Slot<T> = Box<(T, usize)>;

/// The sending end; cheap to clone.
pub struct QueueTx<T> {
    /// The items. Unbounded as a channel: the byte count bounds it.
    tx: mpsc::UnboundedSender<Slot<T>>,
    /// Shared accounting.
    room: Arc<Room>,
}

impl<T> Clone for QueueTx<T> {
    fn clone(&self) -> Self {
        Self {
            tx: self.tx.clone(),
            room: self.room.clone(),
        }
    }
}

/// The receiving end.
pub struct QueueRx<T> {
    /// The items.
    rx: mpsc::UnboundedReceiver<Slot<T>>,
    /// Shared accounting.
    room: Arc<Room>,
}

/// A queue: [`QueueTx::send`] waits at `limit` bytes, [`QueueTx::push`]
/// fails past `limit + reserve`.
pub fn queue<T>(limit: usize, reserve: usize) -> (QueueTx<T>, QueueRx<T>) {
    let (tx, rx) = mpsc::unbounded_channel();
    let room = Arc::new(Room::new(limit, reserve));
    (
        QueueTx {
            tx,
            room: room.clone(),
        },
        QueueRx { rx, room },
    )
}

impl<T> QueueTx<T> {
    /// Queues `item` of `cost` bytes, waiting while the queue holds
    /// `limit` bytes or more, behind the senders already waiting.
    ///
    /// # Errors
    /// [`Closed`] if the receiver is gone (also while waiting).
    ///
    /// # Cancel safety
    /// Nothing is queued if the future is dropped before it completes.
    pub async fn send(&self, item: T, cost: usize) -> Result<(), Closed<T>> {
        if self.room.acquire(cost).await.is_err() {
            return Err(Closed(item));
        }
        self.enqueue(item, cost)
            .map_err(|Closed((item, _))| Closed(item))
    }

    /// Queues `item` of `cost` bytes without waiting, while the queue holds
    /// less than `limit + reserve` bytes (ahead of waiting senders).
    ///
    /// # Errors
    /// [`PushError::Full`] past the reserve, [`PushError::Closed`] if the
    /// receiver is gone.
    pub fn push(&self, item: T, cost: usize) -> Result<(), PushError<T>> {
        if self.room.is_closed() {
            return Err(PushError::Closed(item));
        }
        if !self.room.push(cost) {
            return Err(PushError::Full(item));
        }
        self.enqueue(item, cost)
            .map_err(|Closed((item, _))| PushError::Closed(item))
    }

    /// Queues `item` of `cost` bytes without waiting, as
    /// [`push`](Self::push); an item not queued goes to `lost`. Past the
    /// reserve the peer has stopped reading, and `end` ends the stream.
    /// `false` if the item was not queued.
    pub fn push_or_end(
        &self,
        item: T,
        cost: usize,
        end: &impl Unread,
        lost: impl FnOnce(T),
    ) -> bool {
        match self.push(item, cost) {
            Ok(()) => true,
            Err(PushError::Closed(item)) => {
                lost(item);
                false
            }
            Err(PushError::Full(item)) => {
                lost(item);
                end.end_unread(self.queued(), !end.is_ended());
                false
            }
        }
    }

    fn enqueue(&self, item: T, cost: usize) -> Result<(), Closed<(T, usize)>> {
        self.tx
            .send(Box::new((item, cost)))
            .map_err(|mpsc::error::SendError(back)| {
                self.room.release(cost);
                Closed(*back)
            })
    }

    /// Whether the receiver is gone.
    pub fn is_closed(&self) -> bool {
        self.room.is_closed()
    }

    /// Resolves once the receiver is gone.
    pub async fn closed(&self) {
        self.tx.closed().await;
    }

    /// Bytes queued and not yet taken.
    pub fn queued(&self) -> usize {
        self.room.queued()
    }

    /// Senders waiting for room now.
    pub fn waiting(&self) -> usize {
        self.room.waiting()
    }
}

impl<T> QueueRx<T> {
    /// The next item; `None` once every sender is gone and the queue is
    /// empty. Its cost is released.
    pub async fn recv(&mut self) -> Option<T> {
        std::future::poll_fn(|cx| self.poll_recv(cx)).await
    }

    /// Polls for the next item (see [`QueueRx::recv`]).
    pub fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Option<T>> {
        self.rx.poll_recv(cx).map(|next| {
            next.map(|slot| {
                let (item, cost) = *slot;
                self.room.release(cost);
                item
            })
        })
    }

    /// Whether nothing is queued right now.
    pub fn is_empty(&self) -> bool {
        self.rx.is_empty()
    }
}

impl<T> Drop for QueueRx<T> {
    fn drop(&mut self) {
        self.rx.close();
        // Senders waiting for room see the close.
        self.room.close();
    }
}

impl<T> futures_util::Stream for QueueRx<T> {
    type Item = T;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<T>> {
        self.get_mut().poll_recv(cx)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// What an idle queue of `T` holds on the heap.
    fn idle_heap<T>() -> usize {
        assert!(heap_count::installed());
        let (queue, held) = heap_count::peak_during(|| queue::<T>(1 << 20, 1 << 10));
        drop(queue);
        held
    }

    #[test]
    fn an_idle_queue_holds_the_same_small_heap_whatever_its_items() {
        // A packet is about 100 bytes: with items inline, tokio's first
        // block of 32 slots made an idle queue of them 3 KiB.
        let small = idle_heap::<u8>();
        let large = idle_heap::<[u8; 256]>();
        assert_eq!(small, large, "an idle queue's heap grows with its items");
        assert!(small < 2048, "an idle queue holds {small} bytes");
    }

    #[tokio::test]
    async fn send_waits_at_the_limit_and_goes_on_as_bytes_are_taken() {
        let (tx, mut rx) = queue::<u32>(100, 10);
        tx.send(1, 60).await.unwrap();
        tx.send(2, 60).await.unwrap(); // 60 < 100: admitted, now 120
        let waiting = tokio::spawn({
            let tx = tx.clone();
            async move { tx.send(3, 10).await }
        });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished());
        assert_eq!(rx.recv().await, Some(1));
        waiting.await.unwrap().unwrap();
        assert_eq!(tx.queued(), 70);
    }

    #[tokio::test]
    async fn push_never_waits_and_stops_past_the_reserve() {
        let (tx, mut rx) = queue::<u32>(100, 50);
        tx.push(1, 100).unwrap();
        tx.push(2, 60).unwrap(); // 100 < 150: admitted, now 160
        assert_eq!(tx.push(3, 1), Err(PushError::Full(3)));
        assert_eq!(rx.recv().await, Some(1));
        tx.push(4, 100).unwrap();
    }

    /// A stream that records how it was ended.
    #[derive(Default)]
    struct Ends(std::sync::Mutex<Vec<(usize, bool)>>);

    impl Unread for Ends {
        fn is_ended(&self) -> bool {
            !self.0.lock().unwrap().is_empty()
        }

        fn end_unread(&self, queued: usize, first: bool) {
            self.0.lock().unwrap().push((queued, first));
        }
    }

    #[tokio::test]
    async fn past_the_reserve_push_or_end_ends_the_stream_once_first() {
        let (tx, rx) = queue::<u32>(100, 50);
        let ends = Ends::default();
        let mut lost = Vec::new();
        assert!(tx.push_or_end(1, 100, &ends, |i| lost.push(i)));
        assert!(tx.push_or_end(2, 60, &ends, |i| lost.push(i)));
        assert!(ends.0.lock().unwrap().is_empty(), "within the reserve");
        assert!(!tx.push_or_end(3, 1, &ends, |i| lost.push(i)));
        assert!(!tx.push_or_end(4, 1, &ends, |i| lost.push(i)));
        assert_eq!(*ends.0.lock().unwrap(), [(160, true), (160, false)]);
        drop(rx);
        // A gone receiver loses the item and ends nothing.
        assert!(!tx.push_or_end(5, 1, &ends, |i| lost.push(i)));
        assert_eq!(lost, [3, 4, 5]);
        assert_eq!(ends.0.lock().unwrap().len(), 2);
    }

    #[tokio::test]
    async fn an_item_larger_than_the_limit_passes_an_empty_queue() {
        let (tx, mut rx) = queue::<u32>(10, 0);
        tx.send(1, 1000).await.unwrap();
        assert_eq!(tx.push(2, 1), Err(PushError::Full(2)));
        assert_eq!(rx.recv().await, Some(1));
        tx.push(3, 1000).unwrap();
    }

    #[tokio::test]
    async fn a_gone_receiver_fails_senders_also_while_they_wait() {
        let (tx, rx) = queue::<u32>(10, 0);
        tx.send(1, 10).await.unwrap();
        let waiting = tokio::spawn({
            let tx = tx.clone();
            async move { tx.send(2, 10).await }
        });
        tokio::task::yield_now().await;
        drop(rx);
        let failed = tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("the waiting sender was not woken")
            .unwrap();
        assert_eq!(failed, Err(Closed(2)));
        assert_eq!(tx.push(3, 1), Err(PushError::Closed(3)));
        assert!(tx.is_closed());
        assert_eq!(tx.queued(), 10, "refused items are not counted");
    }

    #[tokio::test]
    async fn the_receiver_ends_once_every_sender_is_gone() {
        let (tx, mut rx) = queue::<u32>(10, 0);
        tx.push(1, 1).unwrap();
        drop(tx);
        assert_eq!(rx.recv().await, Some(1));
        assert_eq!(rx.recv().await, None);
    }

    /// A waker that counts its wakes.
    struct Counting(std::sync::atomic::AtomicUsize);

    impl std::task::Wake for Counting {
        fn wake(self: std::sync::Arc<Self>) {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }

    fn wakes(counts: &[std::sync::Arc<Counting>]) -> usize {
        counts
            .iter()
            .map(|c| c.0.load(std::sync::atomic::Ordering::SeqCst))
            .sum()
    }

    /// The goal of issue 37: with 1,000 senders waiting on a full queue,
    /// each item taken wakes about one of them, and they get room in order
    /// of arrival.
    #[tokio::test]
    async fn a_thousand_waiting_senders_get_room_in_order_one_wake_each() {
        const WAITING: usize = 1000;
        let (tx, mut rx) = queue::<usize>(100, 0);
        tx.send(usize::MAX, 100).await.unwrap();
        let counts: Vec<_> = (0..WAITING)
            .map(|_| std::sync::Arc::new(Counting(Default::default())))
            .collect();
        let mut sends: Vec<_> = (0..WAITING)
            .map(|i| Some(Box::pin(tx.send(i, 100))))
            .collect();
        for (send, count) in sends.iter_mut().zip(&counts) {
            let waker = std::task::Waker::from(count.clone());
            let mut cx = Context::from_waker(&waker);
            assert!(send.as_mut().unwrap().as_mut().poll(&mut cx).is_pending());
        }
        assert_eq!(tx.waiting(), WAITING);
        let mut order = Vec::new();
        for taken in 0..WAITING {
            let before = wakes(&counts);
            assert!(rx.recv().await.is_some());
            assert_eq!(wakes(&counts) - before, 1, "wakes for item {taken}");
            // Poll only the woken sender: it is the next in arrival order.
            let woken = counts
                .iter()
                .position(|c| c.0.load(std::sync::atomic::Ordering::SeqCst) == 1)
                .expect("one was woken");
            counts[woken]
                .0
                .store(2, std::sync::atomic::Ordering::SeqCst);
            let waker = std::task::Waker::from(counts[woken].clone());
            let mut cx = Context::from_waker(&waker);
            let send = sends[woken].as_mut().unwrap().as_mut();
            assert_eq!(send.poll(&mut cx), Poll::Ready(Ok(())));
            sends[woken] = None;
            order.push(woken);
        }
        assert_eq!(
            order,
            (0..WAITING).collect::<Vec<_>>(),
            "first come, first served"
        );
        assert_eq!(tx.waiting(), 0);
    }

    #[tokio::test]
    async fn a_waiter_that_gives_up_passes_its_room_on() {
        let (tx, mut rx) = queue::<u32>(10, 0);
        tx.send(1, 10).await.unwrap();
        let noop = std::task::Waker::noop();
        let mut cx = Context::from_waker(noop);
        let mut first = Box::pin(tx.send(2, 10));
        let mut second = Box::pin(tx.send(3, 10));
        assert!(first.as_mut().poll(&mut cx).is_pending());
        assert!(second.as_mut().poll(&mut cx).is_pending());
        // Room goes to the first, which is dropped before it runs.
        assert_eq!(rx.recv().await, Some(1));
        assert_eq!(tx.waiting(), 1);
        drop(first);
        assert_eq!(second.as_mut().poll(&mut cx), Poll::Ready(Ok(())));
        assert_eq!(tx.queued(), 10);
        // A waiter dropped while still waiting leaves the list.
        let mut third = Box::pin(tx.send(4, 10));
        assert!(third.as_mut().poll(&mut cx).is_pending());
        drop(third);
        assert_eq!(tx.waiting(), 0);
        assert_eq!(rx.recv().await, Some(3));
        assert_eq!(tx.queued(), 0);
    }

    #[tokio::test]
    async fn a_new_sender_queues_behind_waiting_ones() {
        let (tx, mut rx) = queue::<u32>(10, 100);
        tx.send(1, 10).await.unwrap();
        let noop = std::task::Waker::noop();
        let mut cx = Context::from_waker(noop);
        let mut big = Box::pin(tx.send(2, 10));
        assert!(big.as_mut().poll(&mut cx).is_pending());
        // Control packets go ahead; senders do not.
        tx.push(9, 5).unwrap();
        assert_eq!(rx.recv().await, Some(1));
        let mut late = Box::pin(tx.send(3, 1));
        assert!(late.as_mut().poll(&mut cx).is_pending(), "jumped the line");
        assert_eq!(rx.recv().await, Some(9));
        assert_eq!(big.as_mut().poll(&mut cx), Poll::Ready(Ok(())));
        assert_eq!(rx.recv().await, Some(2));
        assert_eq!(late.as_mut().poll(&mut cx), Poll::Ready(Ok(())));
    }
}
