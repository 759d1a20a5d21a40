//! Per-connection flow control, negotiated between our own agent and server.
//!
//! The Konnectivity protocol multiplexes every connection of an agent on one
//! gRPC stream and has no per-connection window, so one slow reader stalls
//! everyone (ANP #180, #881). When both ends announce [`HEADER`] =
//! [`VERSION`] in the `Connect` metadata, each side gives the other a window
//! of [`WINDOW`] cost units per connection: DATA costs its payload length
//! plus [`PACKET_OVERHEAD`], a sender never has more than a window in flight,
//! and the receiver returns credit (a [`CREDIT_TYPE`] packet) as its writer
//! drains. The receiver therefore never blocks the shared stream, and what it
//! buffers per connection is bounded by the window.
//!
//! Without negotiation (ANP agents, ANP servers) the same per-connection
//! queues are used with the same bound, and a connection whose reader falls
//! that far behind is closed with [`OVERFLOW`] on both ends instead of
//! stalling the stream.

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use bytes::Bytes;
use proto::{Data, Packet, Payload};
use tokio::sync::{Notify, Semaphore, mpsc};

/// Metadata key (request from the agent, response header from the server).
pub const HEADER: &str = "konnectivity-rs-flow-control";
/// The one version of the scheme.
pub const VERSION: &str = "v1";
/// Packet type of a credit grant: `Data{connectID, data: 4-byte big-endian
/// credit}`. Only ever sent after negotiation, so ANP never sees it.
pub const CREDIT_TYPE: i32 = 100;
/// Cost units a sender may have in flight per connection, and the bound of
/// every per-connection receive queue.
pub const WINDOW: usize = 1024 * 1024;
/// Cost of a packet beyond its payload, so that many tiny packets are bounded
/// too.
pub const PACKET_OVERHEAD: usize = 64;
/// Largest DATA payload sent when credits are in use (a window holds four).
/// Every packet costs a few task wake-ups on each side, whatever its size:
/// 256 KiB instead of 64 KiB cut server+agent CPU per GiB by 9–21 % in
/// bulk (`bench --scenarios bulk,cpu`, each mode and direction). Far below gRPC's 4 MiB message limit,
/// so ANP peers take it.
pub const MAX_CHUNK: usize = 256 * 1024;
/// Credit is returned once this much has drained (fewer packets on the wire).
pub const GRANT_THRESHOLD: usize = WINDOW / 8;
/// Error text of a connection closed because its reader fell a window behind.
pub const OVERFLOW: &str = "receive buffer overflow: the reader is too slow";
/// Without negotiation a full queue makes the shared stream wait (as ANP
/// does), but only while the connection's reader makes progress: after this
/// long without any, the connection is closed with [`OVERFLOW`] and the
/// stream moves on.
pub const COMPAT_STALL: Duration = Duration::from_secs(5);

/// What a DATA packet costs against a window.
pub fn cost(len: usize) -> usize {
    len + PACKET_OVERHEAD
}

/// What any packet costs in a byte-bounded queue: its encoded size plus
/// the per-packet overhead.
pub fn packet_cost(packet: &Packet) -> usize {
    prost::Message::encoded_len(packet) + PACKET_OVERHEAD
}

/// A credit grant for a connection.
pub fn credit_packet(conn_id: i64, credit: usize) -> Packet {
    let credit = u32::try_from(credit).unwrap_or(u32::MAX);
    Packet {
        r#type: CREDIT_TYPE,
        payload: Some(Payload::Data(Data {
            connect_id: conn_id,
            error: String::new(),
            data: Bytes::copy_from_slice(&credit.to_be_bytes()),
        })),
    }
}

/// The connection id and credit of a [`CREDIT_TYPE`] packet.
pub fn parse_credit(packet: &Packet) -> Option<(i64, usize)> {
    if packet.r#type != CREDIT_TYPE {
        return None;
    }
    match &packet.payload {
        Some(Payload::Data(data)) => {
            let bytes: [u8; 4] = data.data.as_ref().try_into().ok()?;
            Some((data.connect_id, u32::from_be_bytes(bytes) as usize))
        }
        _ => None,
    }
}

/// Whether metadata announces our scheme.
pub fn announced(value: Option<&str>) -> bool {
    value == Some(VERSION)
}

/// Why a chunk could not be queued for a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PushError {
    /// The connection's queue is a window behind: close it with [`OVERFLOW`].
    Overflow,
    /// The connection's writer is gone.
    Closed,
}

/// What both ends of a receive queue share: the cost queued, and a signal
/// for each drain.
#[derive(Default)]
pub struct Budget {
    /// Cost queued and not yet drained.
    queued: AtomicUsize,
    /// Woken whenever something drained.
    drained: Notify,
}

impl Budget {
    /// Reserves `cost` if it fits the window (anything fits an empty queue).
    pub fn try_reserve(&self, cost: usize) -> bool {
        self.queued
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |q| {
                (q == 0 || q + cost <= WINDOW).then_some(q + cost)
            })
            .is_ok()
    }

    /// Reserves `cost`, waiting while the window is full; gives up when
    /// nothing drained for `stall`.
    ///
    /// # Errors
    /// [`PushError::Overflow`] after `stall` without progress.
    pub async fn reserve(&self, cost: usize, stall: Duration) -> Result<(), PushError> {
        loop {
            let drained = self.drained.notified();
            tokio::pin!(drained);
            drained.as_mut().enable();
            if self.try_reserve(cost) {
                return Ok(());
            }
            if tokio::time::timeout(stall, drained).await.is_err() {
                return Err(PushError::Overflow);
            }
        }
    }

    /// Gives back `cost` (drained, or a reservation not used).
    pub fn release(&self, cost: usize) {
        self.queued.fetch_sub(cost, Ordering::AcqRel);
        self.drained.notify_waiters();
    }

    /// Cost queued now.
    pub fn queued(&self) -> usize {
        self.queued.load(Ordering::Acquire)
    }
}

/// The sending end of a connection's receive queue (what arrived for the
/// local socket): counts what is queued and bounds it by the window.
#[derive(Clone)]
pub struct WindowTx<T> {
    /// The queue.
    tx: mpsc::Sender<(T, usize)>,
    /// Cost queued and not yet drained (shared with the drain end).
    budget: Arc<Budget>,
}

/// The receiving end of a connection's receive queue: its writer drains it
/// into the socket.
pub struct WindowRx<T> {
    /// The queue.
    rx: mpsc::Receiver<(T, usize)>,
    /// Cost queued and not yet drained (shared with the enqueue end).
    budget: Arc<Budget>,
}

/// A per-connection receive queue bounded by [`WINDOW`] cost units.
pub fn queue<T>() -> (WindowTx<T>, WindowRx<T>) {
    // One slot per smallest possible packet of a window; tokio allocates
    // slots in small blocks only as they fill.
    queue_with_slots(WINDOW / PACKET_OVERHEAD)
}

/// A receive queue of `slots` items, for [`WindowTx::send`] (waiting) users.
pub fn queue_with_slots<T>(slots: usize) -> (WindowTx<T>, WindowRx<T>) {
    let (tx, rx) = mpsc::channel(slots.max(1));
    let budget = Arc::new(Budget::default());
    (
        WindowTx {
            tx,
            budget: budget.clone(),
        },
        WindowRx { rx, budget },
    )
}

impl<T> WindowTx<T> {
    /// Queues `item` of `cost` units, or says why not; never waits (the
    /// negotiated path, where a sender past the window broke the protocol).
    ///
    /// # Errors
    /// [`PushError::Overflow`] past the window, [`PushError::Closed`] if the
    /// drain end is gone.
    pub fn push(&self, item: T, cost: usize) -> Result<(), PushError> {
        if !self.budget.try_reserve(cost) {
            return Err(PushError::Overflow);
        }
        self.enqueue(item, cost)
    }

    /// Queues `item`, waiting while the window is full as long as the queue
    /// drains at all (the path without negotiation; see [`COMPAT_STALL`]).
    ///
    /// # Errors
    /// [`PushError::Overflow`] after `stall` without progress,
    /// [`PushError::Closed`] if the drain end is gone.
    pub async fn push_wait(&self, item: T, cost: usize, stall: Duration) -> Result<(), PushError> {
        if self.tx.is_closed() {
            return Err(PushError::Closed);
        }
        self.budget.reserve(cost, stall).await?;
        self.enqueue(item, cost)
    }

    fn enqueue(&self, item: T, cost: usize) -> Result<(), PushError> {
        self.tx.try_send((item, cost)).map_err(|e| {
            self.budget.release(cost);
            match e {
                mpsc::error::TrySendError::Full(_) => PushError::Overflow,
                mpsc::error::TrySendError::Closed(_) => PushError::Closed,
            }
        })
    }

    /// Queues `item`, waiting for a free slot (for a queue whose producer
    /// may block, as on a connection with a stream of its own).
    ///
    /// # Errors
    /// [`PushError::Closed`] if the drain end is gone.
    pub async fn send(&self, item: T, cost: usize) -> Result<(), PushError> {
        self.budget.queued.fetch_add(cost, Ordering::AcqRel);
        self.tx.send((item, cost)).await.map_err(|_| {
            self.budget.release(cost);
            PushError::Closed
        })
    }

    /// Cost units queued now.
    pub fn queued(&self) -> usize {
        self.budget.queued()
    }
}

impl<T> WindowRx<T> {
    /// The next item and its cost; the cost stays counted until
    /// [`WindowRx::drained`] is called for it (after it was written).
    pub async fn recv(&mut self) -> Option<(T, usize)> {
        self.rx.recv().await
    }

    /// Whether nothing is queued right now.
    pub fn is_empty(&self) -> bool {
        self.rx.is_empty()
    }

    /// Marks `cost` units as written out.
    pub fn drained(&self, cost: usize) {
        self.budget.release(cost);
    }
}

/// The connection of a [`SendCredit`] is gone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the connection is closed")]
pub struct CreditClosed;

/// Credit a sender may spend on one connection (starts at one window).
#[derive(Clone)]
pub struct SendCredit {
    /// Units available.
    available: Arc<Semaphore>,
    /// Units spent and not yet returned; `available + spent` is the window.
    spent: Arc<AtomicUsize>,
}

impl SendCredit {
    /// A full window.
    pub fn new() -> Self {
        Self {
            available: Arc::new(Semaphore::new(WINDOW)),
            spent: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// Waits until `cost` units are available and takes them.
    ///
    /// # Errors
    /// [`CreditClosed`] once [`SendCredit::close`] was called: the
    /// connection is gone and nothing more may be sent on it.
    ///
    /// # Cancel safety
    /// Nothing is taken if the future is dropped before it completes.
    pub async fn take(&self, cost: usize) -> Result<(), CreditClosed> {
        let cost = cost.min(WINDOW);
        let want = u32::try_from(cost).unwrap_or(u32::MAX);
        let permit = self
            .available
            .acquire_many(want)
            .await
            .map_err(|_| CreditClosed)?;
        permit.forget();
        self.spent.fetch_add(cost, Ordering::AcqRel);
        Ok(())
    }

    /// Ends the credit: every waiting and later [`SendCredit::take`] fails.
    pub fn close(&self) {
        self.available.close();
    }

    /// Adds credit the peer returned; a peer cannot return more than was
    /// spent, so the window never grows.
    pub fn grant(&self, credit: usize) {
        let mut returned = 0;
        let _ = self
            .spent
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |spent| {
                returned = credit.min(spent);
                Some(spent - returned)
            });
        self.available.add_permits(returned);
    }

    /// Units available now.
    pub fn available(&self) -> usize {
        self.available.available_permits()
    }
}

impl Default for SendCredit {
    fn default() -> Self {
        Self::new()
    }
}

/// Accumulates drained cost and says when to send a grant.
#[derive(Debug, Default)]
pub struct Granter {
    /// Drained and not yet returned.
    pending: usize,
}

impl Granter {
    /// Records `cost` drained; returns the credit to send now, if any.
    pub fn drained(&mut self, cost: usize, queue_empty: bool) -> Option<usize> {
        self.pending += cost;
        if self.pending >= GRANT_THRESHOLD || (queue_empty && self.pending > 0) {
            Some(std::mem::take(&mut self.pending))
        } else {
            None
        }
    }
}

/// HTTP/2 frame size we accept (peers may send DATA frames this large), so
/// that a DATA packet of `MAX_CHUNK` crosses in one frame, not sixteen of 16 KiB.
pub const H2_MAX_FRAME_SIZE: u32 = 256 * 1024;
/// HTTP/2 stream window: an agent stream carries many connections and is
/// always drained (readers never block), so a large window only saves
/// WINDOW_UPDATE round trips; a frontend stream carries one connection.
pub const H2_STREAM_WINDOW: u32 = 4 * 1024 * 1024;
/// HTTP/2 connection window.
pub const H2_CONNECTION_WINDOW: u32 = 8 * 1024 * 1024;

/// How long an HTTP/2 keepalive ping sent every `interval` waits for its
/// ack: gRPC's 20 s, or the interval itself when shorter, so that a peer
/// that vanished is dropped within twice a short `--keepalive-time`.
pub fn keepalive_timeout(interval: std::time::Duration) -> std::time::Duration {
    interval.clamp(
        std::time::Duration::from_millis(100),
        std::time::Duration::from_secs(20),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credit_packets_round_trip() {
        let p = credit_packet(7, 123_456);
        assert_eq!(parse_credit(&p), Some((7, 123_456)));
        assert_eq!(
            parse_credit(&Packet::data(7, Bytes::from_static(b"abcd"))),
            None
        );
    }

    #[tokio::test]
    async fn the_queue_refuses_past_the_window_and_counts_drains() {
        let (inbound, mut outbound) = queue::<u32>();
        let big = WINDOW / 2;
        assert_eq!(inbound.push(1, big), Ok(()));
        assert_eq!(inbound.push(2, big), Ok(()));
        assert_eq!(inbound.push(3, 1), Err(PushError::Overflow));
        // A packet larger than the window fits only an empty queue.
        assert_eq!(inbound.queued(), WINDOW);
        let (item, cost) = outbound.recv().await.unwrap();
        assert_eq!((item, cost), (1, big));
        outbound.drained(cost);
        assert_eq!(inbound.queued(), big);
        assert_eq!(inbound.push(4, 10), Ok(()));
        drop(outbound);
        assert_eq!(inbound.push(5, 10), Err(PushError::Closed));
    }

    #[tokio::test(start_paused = true)]
    async fn without_negotiation_a_full_queue_waits_while_it_drains_then_gives_up() {
        let (inbound, mut outbound) = queue::<u32>();
        inbound.push(1, WINDOW).unwrap();
        // Room appears: the waiting push goes through.
        let waiting = tokio::spawn({
            let inbound = inbound.clone();
            async move { inbound.push_wait(2, 10, COMPAT_STALL).await }
        });
        tokio::time::sleep(COMPAT_STALL / 2).await;
        let (_, cost) = outbound.recv().await.unwrap();
        outbound.drained(cost);
        assert_eq!(waiting.await.unwrap(), Ok(()));
        // Nothing drains: it gives up after the stall time.
        inbound.push(3, WINDOW - 10).unwrap();
        let start = tokio::time::Instant::now();
        assert_eq!(
            inbound.push_wait(4, 100, COMPAT_STALL).await,
            Err(PushError::Overflow)
        );
        assert_eq!(start.elapsed(), COMPAT_STALL);
    }

    #[tokio::test]
    async fn many_tiny_packets_are_bounded_too() {
        let (inbound, _outbound) = queue::<()>();
        let mut accepted = 0;
        while inbound.push((), cost(1)).is_ok() {
            accepted += 1;
        }
        assert_eq!(accepted, WINDOW / cost(1));
    }

    #[tokio::test]
    async fn credit_is_spent_and_returned_but_never_above_a_window() {
        let credit = SendCredit::new();
        credit.take(WINDOW - 10).await.unwrap();
        assert_eq!(credit.available(), 10);
        let waiting = tokio::spawn({
            let credit = credit.clone();
            async move { credit.take(100).await }
        });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished());
        credit.grant(WINDOW * 4);
        waiting.await.unwrap().unwrap();
        assert_eq!(credit.available(), WINDOW - 100);
    }

    #[tokio::test]
    async fn closing_the_credit_wakes_a_waiting_sender_with_an_error() {
        let credit = SendCredit::new();
        credit.take(WINDOW).await.unwrap();
        let waiting = tokio::spawn({
            let credit = credit.clone();
            async move { credit.take(1).await }
        });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished());
        credit.close();
        assert_eq!(waiting.await.unwrap(), Err(CreditClosed));
        assert_eq!(credit.take(1).await, Err(CreditClosed));
    }

    #[test]
    fn grants_are_batched() {
        let mut g = Granter::default();
        assert_eq!(g.drained(100, false), None);
        assert_eq!(
            g.drained(GRANT_THRESHOLD, false),
            Some(GRANT_THRESHOLD + 100)
        );
        assert_eq!(g.drained(5, true), Some(5));
    }
}
