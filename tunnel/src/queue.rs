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
//!   caller ends the stream instead of queueing more.
//!
//! An item's cost is released when the receiver takes it. An item is
//! admitted while the queue holds less than its cap, so the cap is exceeded
//! by one item at most and no item is too large to pass. The receiver ends ([`QueueRx::recv`] returns `None`) once every
//! sender is gone; dropping the receiver wakes waiting senders with an
//! error.

use std::{
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    task::{Context, Poll},
};

use tokio::sync::{Notify, mpsc};

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

/// What both ends share.
struct State {
    /// Bytes queued and not yet taken.
    queued: AtomicUsize,
    /// Woken when bytes are taken and when the receiver goes.
    room: Notify,
    /// Senders waiting for room: taking an item notifies only when there
    /// are some, so that the bytes' path takes no lock when nobody waits.
    waiters: AtomicUsize,
    /// Where [`QueueTx::send`] waits.
    limit: usize,
    /// Extra room for [`QueueTx::push`].
    reserve: usize,
}

impl State {
    /// Counts `cost` in if the queue holds less than `cap` (so it exceeds
    /// `cap` by at most one item, and no item is too large to pass).
    fn admit(&self, cost: usize, cap: usize) -> bool {
        // SeqCst pairs with `release`: a waiter counts itself, then looks
        // at `queued`; a release lowers `queued`, then looks at the count.
        // One of the two sees the other.
        self.queued
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |q| {
                (q < cap).then_some(q.saturating_add(cost))
            })
            .is_ok()
    }

    fn release(&self, cost: usize) {
        self.queued.fetch_sub(cost, Ordering::SeqCst);
        if self.waiters.load(Ordering::SeqCst) > 0 {
            self.room.notify_waiters();
        }
    }
}

/// A sender counted among the waiters while it lives.
struct Waiting<'a>(&'a State);

impl<'a> Waiting<'a> {
    fn new(state: &'a State) -> Self {
        state.waiters.fetch_add(1, Ordering::SeqCst);
        Self(state)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.waiters.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The sending end; cheap to clone.
pub struct QueueTx<T> {
    /// The items. Unbounded as a channel: the byte count bounds it.
    tx: mpsc::UnboundedSender<(T, usize)>,
    /// Shared accounting.
    state: Arc<State>,
}

impl<T> Clone for QueueTx<T> {
    fn clone(&self) -> Self {
        Self {
            tx: self.tx.clone(),
            state: self.state.clone(),
        }
    }
}

/// The receiving end.
pub struct QueueRx<T> {
    /// The items.
    rx: mpsc::UnboundedReceiver<(T, usize)>,
    /// Shared accounting.
    state: Arc<State>,
}

/// A queue: [`QueueTx::send`] waits at `limit` bytes, [`QueueTx::push`]
/// fails past `limit + reserve`.
pub fn queue<T>(limit: usize, reserve: usize) -> (QueueTx<T>, QueueRx<T>) {
    let (tx, rx) = mpsc::unbounded_channel();
    let state = Arc::new(State {
        queued: AtomicUsize::new(0),
        room: Notify::new(),
        waiters: AtomicUsize::new(0),
        limit,
        reserve,
    });
    (
        QueueTx {
            tx,
            state: state.clone(),
        },
        QueueRx { rx, state },
    )
}

impl<T> QueueTx<T> {
    /// Queues `item` of `cost` bytes, waiting while the queue holds
    /// `limit` bytes or more.
    ///
    /// # Errors
    /// [`Closed`] if the receiver is gone (also while waiting).
    ///
    /// # Cancel safety
    /// Nothing is queued if the future is dropped before it completes.
    pub async fn send(&self, item: T, cost: usize) -> Result<(), Closed<T>> {
        if self.tx.is_closed() {
            return Err(Closed(item));
        }
        if !self.state.admit(cost, self.state.limit) {
            // Counted while it waits (also if the future is dropped).
            let _waiting = Waiting::new(&self.state);
            loop {
                let room = self.state.room.notified();
                tokio::pin!(room);
                room.as_mut().enable();
                if self.tx.is_closed() {
                    return Err(Closed(item));
                }
                if self.state.admit(cost, self.state.limit) {
                    break;
                }
                room.await;
            }
        }
        self.enqueue(item, cost)
            .map_err(|Closed((item, _))| Closed(item))
    }

    /// Queues `item` of `cost` bytes without waiting, while the queue holds
    /// less than `limit + reserve` bytes.
    ///
    /// # Errors
    /// [`PushError::Full`] past the reserve, [`PushError::Closed`] if the
    /// receiver is gone.
    pub fn push(&self, item: T, cost: usize) -> Result<(), PushError<T>> {
        if self.tx.is_closed() {
            return Err(PushError::Closed(item));
        }
        if !self
            .state
            .admit(cost, self.state.limit.saturating_add(self.state.reserve))
        {
            return Err(PushError::Full(item));
        }
        self.enqueue(item, cost)
            .map_err(|Closed((item, _))| PushError::Closed(item))
    }

    fn enqueue(&self, item: T, cost: usize) -> Result<(), Closed<(T, usize)>> {
        self.tx
            .send((item, cost))
            .map_err(|mpsc::error::SendError(back)| {
                self.state.release(cost);
                Closed(back)
            })
    }

    /// Whether the receiver is gone.
    pub fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }

    /// Resolves once the receiver is gone.
    pub async fn closed(&self) {
        self.tx.closed().await;
    }

    /// Bytes queued and not yet taken.
    pub fn queued(&self) -> usize {
        self.state.queued.load(Ordering::Acquire)
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
            next.map(|(item, cost)| {
                self.state.release(cost);
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
        self.state.room.notify_waiters();
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
}
