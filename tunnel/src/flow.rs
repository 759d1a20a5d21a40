//! Per-connection flow control between our own agent and server, and the
//! bound on what a connection buffers with anyone else.
//!
//! The Konnectivity protocol multiplexes every connection of an agent on one
//! gRPC stream and has no per-connection window, so one slow reader stalls
//! everyone (ANP #180, #881). When both ends announce [`HEADER`] =
//! [`VERSION`] in the `Connect` metadata, each side gives the other a
//! window per connection: DATA costs its payload length plus
//! [`PACKET_OVERHEAD`], a sender never has more than the peer's window in
//! flight, and the receiver returns credit (a [`CREDIT_TYPE`] packet) as
//! its writer drains. The receiver therefore never blocks the shared
//! stream, and what it buffers per connection is bounded by its window.
//!
//! Each side announces its own receive window and largest chunk
//! ([`WINDOW_HEADER`], [`CHUNK_HEADER`]; flow control v2) and each sender
//! honours the peer's numbers. A v1 peer (a build before v2) announces
//! neither and assumes [`Window::V1`] on both sides, so against it each
//! side receives within [`Window::V1`] whatever it was configured with.
//! A side pinned to [`Version::V1`] (`--flow-control-version=v1`) behaves
//! on the wire as such a build: it announces no numbers, reads none, and
//! receives and sends within [`Window::V1`].
//!
//! Without negotiation (ANP agents, ANP servers) the same per-connection
//! queues are used with the same bound, and a connection whose reader falls
//! that far behind for [`COMPAT_STALL`] is closed with [`OVERFLOW`] on both
//! ends instead of stalling the stream.
//!
//! # Layout
//! - [`core`]: the pure per-connection state (events in, what to do out,
//!   the clock given).
//! - [`Flow`]: the same behind a lock, with the waits (credit, room) raced
//!   against the connection's end; shared by the connection's two sides.

pub mod core;

use std::{
    fmt,
    sync::Arc,
    time::{Duration, Instant},
};

use bytes::Bytes;
use proto::{Data, Packet, Payload};
use tokio::sync::mpsc;

use crate::sync::{Latch, Mutex, MutexGuard, Signal};

pub use self::core::{Core, Offer, Take};

/// Metadata key (request from the agent, response header from the server):
/// the scheme, [`VERSION`].
pub const HEADER: &str = "konnectivity-rs-flow-control";
/// The scheme's version (v2 adds the window headers, not a new version, so
/// that v1 peers still negotiate credit).
pub const VERSION: &str = "v1";
/// Metadata key: the sender's receive window per connection, in cost units.
pub const WINDOW_HEADER: &str = "konnectivity-rs-flow-window";
/// Metadata key: the largest DATA payload the sender wants to receive.
pub const CHUNK_HEADER: &str = "konnectivity-rs-flow-max-chunk";
/// Packet type of a credit grant: `Data{connectID, data: 4-byte big-endian
/// credit}`. Only ever sent after negotiation, so ANP never sees it.
pub const CREDIT_TYPE: i32 = 100;
/// The default receive window per connection, and v1's fixed one.
pub const WINDOW: usize = 1024 * 1024;
/// Cost of a packet beyond its payload, so that many tiny packets are bounded
/// too.
pub const PACKET_OVERHEAD: usize = 64;
/// The default largest DATA payload, v1's fixed one, and what is sent to
/// peers without credit. Every packet costs a few task wake-ups on each
/// side, whatever its size: 256 KiB instead of 64 KiB cut server+agent CPU
/// per GiB by 9–21 % in bulk (`bench --scenarios bulk,cpu`, each mode and
/// direction). Far below gRPC's 4 MiB message limit, so ANP peers take it.
pub const MAX_CHUNK: usize = 256 * 1024;
/// Smallest window a peer may announce.
pub const MIN_WINDOW: usize = 16 * 1024;
/// Largest window a peer may announce.
pub const MAX_WINDOW: usize = 64 * 1024 * 1024;
/// Smallest chunk a peer may announce.
pub const MIN_CHUNK: usize = 1024;
/// Largest chunk a peer may announce: a DATA message stays far below gRPC's
/// 4 MiB limit.
pub const MAX_CHUNK_LIMIT: usize = 1024 * 1024;
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

/// A receive window and the largest chunk, as one side announces them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    /// Cost units the peer may have in flight per connection.
    pub bytes: usize,
    /// Largest DATA payload the peer may send.
    pub max_chunk: usize,
}

/// Announced window numbers out of range.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WindowError {
    /// Not a whole number.
    #[error("{key} {value:?} is not a whole number of bytes")]
    NotANumber {
        /// The metadata key or flag.
        key: &'static str,
        /// What was given (at most 64 characters of it).
        value: String,
    },
    /// Outside the accepted range.
    #[error("{key} {value} is outside {min}..={max}")]
    OutOfRange {
        /// The metadata key or flag.
        key: &'static str,
        /// What was given.
        value: usize,
        /// Smallest accepted.
        min: usize,
        /// Largest accepted.
        max: usize,
    },
    /// One of the two keys without the other.
    #[error("{present} given without {missing}")]
    Half {
        /// The key given.
        present: &'static str,
        /// The key missing.
        missing: &'static str,
    },
}

fn in_range(key: &'static str, value: usize, min: usize, max: usize) -> Result<usize, WindowError> {
    if (min..=max).contains(&value) {
        Ok(value)
    } else {
        Err(WindowError::OutOfRange {
            key,
            value,
            min,
            max,
        })
    }
}

impl Window {
    /// What a v1 peer assumes of both sides.
    pub const V1: Self = Self {
        bytes: WINDOW,
        max_chunk: MAX_CHUNK,
    };

    /// A window of `bytes` with chunks of at most `max_chunk`.
    ///
    /// # Errors
    /// A number outside [`MIN_WINDOW`]..=[`MAX_WINDOW`] or
    /// [`MIN_CHUNK`]..=[`MAX_CHUNK_LIMIT`].
    pub fn new(bytes: usize, max_chunk: usize) -> Result<Self, WindowError> {
        Ok(Self {
            bytes: in_range(WINDOW_HEADER, bytes, MIN_WINDOW, MAX_WINDOW)?,
            max_chunk: in_range(CHUNK_HEADER, max_chunk, MIN_CHUNK, MAX_CHUNK_LIMIT)?,
        })
    }

    /// A window from the flags `--flow-control-window` and
    /// `--flow-control-max-chunk`.
    ///
    /// # Errors
    /// The flag out of range, and why.
    pub fn from_flags(bytes: usize, max_chunk: usize) -> Result<Self, (&'static str, String)> {
        Self::new(bytes, max_chunk).map_err(|e| {
            let flag = match &e {
                WindowError::OutOfRange { key, .. } if *key == CHUNK_HEADER => {
                    "flow-control-max-chunk"
                }
                _ => "flow-control-window",
            };
            let reason = match e {
                WindowError::OutOfRange {
                    value, min, max, ..
                } => format!("{value} is outside {min}..={max}"),
                other => other.to_string(),
            };
            (flag, reason)
        })
    }

    /// The metadata that announces credit with this window, as `version`
    /// does: v1 announces the scheme alone, v2 the window too.
    pub fn headers(&self, version: Version) -> Vec<(&'static str, String)> {
        let mut headers = vec![(HEADER, VERSION.to_owned())];
        if version == Version::V2 {
            headers.push((WINDOW_HEADER, self.bytes.to_string()));
            headers.push((CHUNK_HEADER, self.max_chunk.to_string()));
        }
        headers
    }

    /// What a peer's metadata (`get` reads one key) announces.
    ///
    /// # Errors
    /// Window numbers that are not numbers, out of range, or one without
    /// the other.
    pub fn announced<'a>(
        get: impl Fn(&'static str) -> Option<&'a str>,
    ) -> Result<Peer, WindowError> {
        if get(HEADER) != Some(VERSION) {
            return Ok(Peer::NoCredit);
        }
        let number = |key: &'static str| -> Result<Option<usize>, WindowError> {
            get(key)
                .map(|value| {
                    value.trim().parse().map_err(|_| WindowError::NotANumber {
                        key,
                        value: value.chars().take(64).collect(),
                    })
                })
                .transpose()
        };
        match (number(WINDOW_HEADER)?, number(CHUNK_HEADER)?) {
            (None, None) => Ok(Peer::V1),
            (Some(bytes), Some(chunk)) => Self::new(bytes, chunk).map(Peer::V2),
            (Some(_), None) => Err(WindowError::Half {
                present: WINDOW_HEADER,
                missing: CHUNK_HEADER,
            }),
            (None, Some(_)) => Err(WindowError::Half {
                present: CHUNK_HEADER,
                missing: WINDOW_HEADER,
            }),
        }
    }
}

impl Default for Window {
    fn default() -> Self {
        Self::V1
    }
}

/// The flow-control version a side presents itself as
/// (`--flow-control-version`), so that a new build can behave on the wire
/// as the last one before flow control v2 while a rolling upgrade mixes
/// them, and version skew can be tested without that build.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Version {
    /// As a build before v2: the scheme announced without window numbers,
    /// a peer's numbers ignored, [`Window::V1`] on both sides whatever
    /// this side was configured with (with credit and without).
    V1,
    /// Each side announces its window and honours the peer's.
    #[default]
    V2,
}

/// What a peer announced of flow control in its `Connect` metadata.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Peer {
    /// No credit: an ANP peer, or flow control off.
    NoCredit,
    /// Credit without window numbers: a build before v2, which assumes
    /// [`Window::V1`] on both sides.
    V1,
    /// Credit with this window.
    V2(Window),
}

/// What one stream agreed on; every connection of the stream uses it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scheme {
    /// Credit both ways: this side receives within `ours` and sends within
    /// `theirs`.
    Credit {
        /// This side's receive window.
        ours: Window,
        /// The peer's receive window.
        theirs: Window,
    },
    /// No credit (an ANP peer, or flow control off): a connection buffers
    /// at most `ours.bytes` for its writer.
    Compat {
        /// This side's receive window.
        ours: Window,
    },
}

impl Scheme {
    /// The scheme of a stream on which this side offered credit (or not,
    /// `offered`) with window `ours` and the peer announced `peer` (see
    /// [`Window::announced`]). A v1 peer never saw `ours` and assumes
    /// [`Window::V1`] on both sides: this side then receives within that,
    /// and returns credit as the peer expects. A side pinned to
    /// [`Version::V1`] takes every credit peer for a v1 one and its own
    /// window for [`Window::V1`], as a v1 build did.
    pub fn negotiate(offered: bool, version: Version, ours: Window, peer: Peer) -> Self {
        let (ours, peer) = match (version, peer) {
            (Version::V2, _) => (ours, peer),
            (Version::V1, Peer::V2(_)) => (Window::V1, Peer::V1),
            (Version::V1, _) => (Window::V1, peer),
        };
        match peer {
            _ if !offered => Self::Compat { ours },
            Peer::NoCredit => Self::Compat { ours },
            Peer::V1 => Self::Credit {
                ours: Window::V1,
                theirs: Window::V1,
            },
            Peer::V2(theirs) => Self::Credit { ours, theirs },
        }
    }

    /// This side's receive window.
    pub fn ours(&self) -> Window {
        match self {
            Self::Credit { ours, .. } | Self::Compat { ours } => *ours,
        }
    }

    /// Whether credit is in use.
    pub fn is_credit(&self) -> bool {
        matches!(self, Self::Credit { .. })
    }
}

/// Why a received DATA packet was not queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// The reader fell a window behind: close the connection with
    /// [`OVERFLOW`].
    Overflow,
    /// The connection is closed.
    Closed,
}

/// The connection is closed; nothing more may be sent on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the connection is closed")]
pub struct FlowClosed;

/// The clock of the waits: tokio's (paused in tests), as a std instant.
fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}

/// One connection's flow state ([`Core`]) shared by its two sides, with
/// the waits: the sender's for credit, and without credit the receiver's
/// for room. Every wait ends when the connection is closed.
///
/// Its lock and its waits belong to this connection alone: its two
/// streams take them, no third one does. Checking whether it is closed
/// takes no lock.
pub struct Flow {
    /// The state; held only for one call of the core, never across a wait.
    core: Mutex<Core>,
    /// The largest payload to send the peer (fixed by the scheme).
    chunk: usize,
    /// Whether credit is in use (fixed by the scheme).
    credit: bool,
    /// Wakes the sender waiting for credit (one sender per connection).
    granted: Signal,
    /// Wakes the receiver waiting for room (without credit; one receiver).
    drained: Signal,
    /// Set when the connection closes.
    closed: Latch,
}

impl fmt::Debug for Flow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Flow").field("core", &*self.core()).finish()
    }
}

impl Flow {
    /// A new connection's flow under `scheme`.
    pub fn new(scheme: Scheme) -> Self {
        let core = Core::new(scheme);
        Self {
            chunk: core.send_chunk(),
            credit: scheme.is_credit(),
            core: Mutex::new(core),
            granted: Signal::new(),
            drained: Signal::new(),
            closed: Latch::new(),
        }
    }

    fn core(&self) -> MutexGuard<'_, Core> {
        self.core.lock()
    }

    /// What the stream agreed.
    pub fn scheme(&self) -> Scheme {
        self.core().scheme()
    }

    /// Offers a received DATA packet of `cost` now, without waiting.
    pub fn offer(&self, cost: usize) -> Offer {
        self.core().offer(cost, now())
    }

    /// Admits a received DATA packet of `cost`: at once with credit (or
    /// [`Refused::Overflow`] if the peer exceeded the window); without,
    /// waiting while the writer drains, up to [`COMPAT_STALL`] without
    /// progress.
    ///
    /// # Errors
    /// [`Refused::Overflow`]: close the connection; [`Refused::Closed`]: it
    /// closed meanwhile.
    ///
    /// # Cancel safety
    /// Nothing is admitted if the future is dropped before it completes.
    pub async fn admit(&self, cost: usize) -> Result<(), Refused> {
        loop {
            // A drain between this offer and the wait leaves a permit.
            match self.offer(cost) {
                Offer::Admitted => return Ok(()),
                Offer::Overflow => return Err(Refused::Overflow),
                Offer::Closed => return Err(Refused::Closed),
                Offer::Wait(until) => {
                    // Biased: deterministic, as loom needs; the close first.
                    tokio::select! {
                        biased;
                        () = self.closed.wait() => return Err(Refused::Closed),
                        () = self.drained.wait() => {}
                        () = tokio::time::sleep_until(until.into()) => {}
                    }
                }
            }
        }
    }

    /// The writer took `cost`: the credit to return to the peer, if it is
    /// time (credit only).
    pub fn drained(&self, cost: usize) -> Option<usize> {
        let credit = self.core().drained(cost, now());
        if !self.credit {
            // Only a receiver without credit waits for room (lock-free).
            self.drained.notify();
        }
        credit
    }

    /// Waits until `cost` of the peer's window is free and takes it (at
    /// once without credit).
    ///
    /// # Errors
    /// [`FlowClosed`] once the connection is closed.
    ///
    /// # Cancel safety
    /// Nothing is taken if the future is dropped before it completes.
    pub async fn take(&self, cost: usize) -> Result<(), FlowClosed> {
        loop {
            // A grant between this take and the wait leaves a permit.
            match self.core().take(cost) {
                Take::Taken => return Ok(()),
                Take::Closed => return Err(FlowClosed),
                Take::Wait => {}
            }
            // Biased: deterministic, as loom needs; the close first.
            tokio::select! {
                biased;
                () = self.closed.wait() => return Err(FlowClosed),
                () = self.granted.wait() => {}
            }
        }
    }

    /// The peer returned `credit`.
    pub fn grant(&self, credit: usize) {
        if self.core().grant(credit) {
            self.granted.notify();
        }
    }

    /// The largest DATA payload to send the peer.
    pub fn send_chunk(&self) -> usize {
        self.chunk
    }

    /// `data` in pieces of this connection's send chunk.
    pub fn chunks(&self, data: Bytes) -> Chunks {
        Chunks::new(data, self.chunk)
    }

    /// Closes the connection: every wait on its behalf ends with an error.
    pub fn close(&self) {
        self.core().close();
        self.closed.set();
    }

    /// Whether the connection is closed (an atomic load).
    pub fn is_closed(&self) -> bool {
        self.closed.is_set()
    }

    /// Resolves once the connection is closed.
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub async fn closed(&self) {
        self.closed.wait().await;
    }

    /// Cost received and not yet drained.
    pub fn queued(&self) -> usize {
        self.core().queued()
    }

    /// How long the writer has left queued data untaken, at `now`.
    pub fn stalled_for(&self, now: Instant) -> Duration {
        self.core().stalled_for(now)
    }

    /// Credit available now (tests).
    pub fn credit(&self) -> usize {
        self.core().credit()
    }
}

/// A payload cut into pieces of at most `chunk` bytes, in order, without
/// copying (an empty payload has none); [`Chunks::rest`] is what is left.
/// How every sender of DATA cuts a payload to the peer's chunk.
#[derive(Debug)]
pub struct Chunks {
    /// What is left to cut.
    data: Bytes,
    /// The largest piece.
    chunk: usize,
}

impl Chunks {
    /// `data` in pieces of at most `chunk` bytes (at least one byte each).
    pub fn new(data: Bytes, chunk: usize) -> Self {
        Self {
            data,
            chunk: chunk.max(1),
        }
    }

    /// What has not been cut yet.
    pub fn rest(self) -> Bytes {
        self.data
    }
}

impl Iterator for Chunks {
    type Item = Bytes;

    fn next(&mut self) -> Option<Bytes> {
        if self.data.is_empty() {
            return None;
        }
        Some(self.data.split_to(self.data.len().min(self.chunk)))
    }
}

/// The sending end of a connection's receive queue: bytes for the local
/// socket, admitted by the connection's [`Flow`] when it has one.
#[derive(Clone)]
pub struct InboundTx {
    /// The queue.
    tx: mpsc::Sender<(Bytes, usize)>,
    /// The connection's flow; `None`: the queue's slots bound it.
    flow: Option<Arc<Flow>>,
}

/// The receiving end of a connection's receive queue: its writer drains it
/// into the socket.
pub struct InboundRx {
    /// The queue.
    rx: mpsc::Receiver<(Bytes, usize)>,
    /// The connection's flow, told of each drain.
    flow: Option<Arc<Flow>>,
}

/// A connection's receive queue. With `flow`, its window bounds it (one
/// slot per smallest packet of the window; tokio allocates slots in small
/// blocks only as they fill); without, `slots` items.
pub fn inbound(flow: Option<Arc<Flow>>, slots: usize) -> (InboundTx, InboundRx) {
    let slots = match &flow {
        Some(flow) => flow.scheme().ours().bytes / PACKET_OVERHEAD + 1,
        None => slots.max(1),
    };
    let (tx, rx) = mpsc::channel(slots);
    (
        InboundTx {
            tx,
            flow: flow.clone(),
        },
        InboundRx { rx, flow },
    )
}

impl InboundTx {
    /// Queues `data`: with a flow, admitted by its window (waiting only
    /// without credit, see [`Flow::admit`]); without, waiting for a slot.
    ///
    /// # Errors
    /// [`Refused::Overflow`] when the writer fell a window behind;
    /// [`Refused::Closed`] when the connection or its writer is gone.
    pub async fn send(&self, data: Bytes) -> Result<(), Refused> {
        let cost = cost(data.len());
        let Some(flow) = &self.flow else {
            return self
                .tx
                .send((data, cost))
                .await
                .map_err(|_| Refused::Closed);
        };
        flow.admit(cost).await?;
        self.tx.try_send((data, cost)).map_err(|_| {
            // The writer is gone: the connection is ending.
            let _ = flow.drained(cost);
            Refused::Closed
        })
    }
}

impl InboundRx {
    /// The next bytes and their cost; the cost stays counted until
    /// [`InboundRx::drained`] is called for it (after it was written).
    pub async fn recv(&mut self) -> Option<(Bytes, usize)> {
        self.rx.recv().await
    }

    /// Whether nothing is queued right now.
    pub fn is_empty(&self) -> bool {
        self.rx.is_empty()
    }

    /// Marks `cost` as written out; the credit to return, if it is time.
    pub fn drained(&self, cost: usize) -> Option<usize> {
        self.flow.as_ref().and_then(|flow| flow.drained(cost))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    #[test]
    fn chunks_cut_a_payload_in_order_without_empty_pieces() {
        let data = Bytes::from((0..=255u8).cycle().take(1000).collect::<Vec<u8>>());
        for chunk in [1, 7, 256, 999, 1000, 1001, usize::MAX] {
            let pieces: Vec<Bytes> = Chunks::new(data.clone(), chunk).collect();
            assert!(pieces.iter().all(|p| !p.is_empty() && p.len() <= chunk));
            assert_eq!(pieces.len(), data.len().div_ceil(chunk.min(data.len())));
            assert_eq!(pieces.concat(), data, "chunk {chunk}");
        }
        assert_eq!(Chunks::new(Bytes::new(), 16).next(), None);
        let mut chunks = Chunks::new(data.clone(), 300);
        assert_eq!(chunks.next().map(|p| p.len()), Some(300));
        assert_eq!(chunks.rest(), data.slice(300..));
    }

    #[test]
    fn credit_packets_round_trip() {
        let p = credit_packet(7, 123_456);
        assert_eq!(parse_credit(&p), Some((7, 123_456)));
        assert_eq!(
            parse_credit(&Packet::data(7, Bytes::from_static(b"abcd"))),
            None
        );
    }

    fn announced(pairs: &[(&'static str, &'static str)]) -> Result<Peer, WindowError> {
        let map: HashMap<&str, &str> = pairs.iter().copied().collect();
        Window::announced(|key| map.get(key).copied())
    }

    #[test]
    fn a_window_is_announced_and_read_back() {
        let window = Window::new(64 * 1024, 16 * 1024).unwrap();
        let headers = window.headers(Version::V2);
        let map: HashMap<&str, &str> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
        assert_eq!(
            Window::announced(|key| map.get(key).copied()),
            Ok(Peer::V2(window))
        );
    }

    #[test]
    fn a_side_pinned_to_v1_announces_the_scheme_alone() {
        let window = Window::new(64 * 1024, 16 * 1024).unwrap();
        let headers = window.headers(Version::V1);
        assert_eq!(headers, vec![(HEADER, VERSION.to_owned())]);
        let map: HashMap<&str, &str> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
        assert_eq!(Window::announced(|key| map.get(key).copied()), Ok(Peer::V1));
    }

    #[test]
    fn a_side_pinned_to_v1_uses_v1s_window_whatever_either_side_announced() {
        let small = Window::new(64 * 1024, 16 * 1024).unwrap();
        let v1 = Scheme::Credit {
            ours: Window::V1,
            theirs: Window::V1,
        };
        assert_eq!(
            Scheme::negotiate(true, Version::V1, small, Peer::V2(small)),
            v1
        );
        assert_eq!(Scheme::negotiate(true, Version::V1, small, Peer::V1), v1);
        // Without credit, v1's fixed bound too.
        assert_eq!(
            Scheme::negotiate(true, Version::V1, small, Peer::NoCredit),
            Scheme::Compat { ours: Window::V1 }
        );
        assert_eq!(
            Scheme::negotiate(false, Version::V1, small, Peer::V2(small)),
            Scheme::Compat { ours: Window::V1 }
        );
    }

    #[test]
    fn peers_are_told_apart_by_what_they_announce() {
        // ANP (or flow control off): no credit.
        assert_eq!(announced(&[]), Ok(Peer::NoCredit));
        assert_eq!(announced(&[(HEADER, "v9")]), Ok(Peer::NoCredit));
        // A v1 build: credit with v1's fixed numbers.
        assert_eq!(announced(&[(HEADER, VERSION)]), Ok(Peer::V1));
        // A v2 peer that announces v1's numbers is still a v2 peer.
        assert_eq!(
            announced(&[
                (HEADER, VERSION),
                (WINDOW_HEADER, "1048576"),
                (CHUNK_HEADER, "262144")
            ]),
            Ok(Peer::V2(Window::V1))
        );
        // Broken numbers are refused, naming the key.
        let err = announced(&[
            (HEADER, VERSION),
            (WINDOW_HEADER, "lots"),
            (CHUNK_HEADER, "1"),
        ])
        .unwrap_err();
        assert!(err.to_string().contains(WINDOW_HEADER), "{err}");
        let err = announced(&[
            (HEADER, VERSION),
            (WINDOW_HEADER, "1024"),
            (CHUNK_HEADER, "1024"),
        ])
        .unwrap_err();
        assert!(matches!(err, WindowError::OutOfRange { .. }), "{err}");
        let err = announced(&[(HEADER, VERSION), (WINDOW_HEADER, "65536")]).unwrap_err();
        assert!(matches!(err, WindowError::Half { .. }), "{err}");
    }

    #[test]
    fn against_a_v1_peer_each_side_receives_within_v1s_window() {
        let small = Window::new(64 * 1024, 16 * 1024).unwrap();
        assert_eq!(
            Scheme::negotiate(true, Version::V2, small, Peer::V1),
            Scheme::Credit {
                ours: Window::V1,
                theirs: Window::V1
            }
        );
        let big = Window::new(4 << 20, 512 * 1024).unwrap();
        assert_eq!(
            Scheme::negotiate(true, Version::V2, small, Peer::V2(big)),
            Scheme::Credit {
                ours: small,
                theirs: big
            }
        );
        // Announcing v1's numbers does not make a v2 peer a v1 one.
        assert_eq!(
            Scheme::negotiate(true, Version::V2, small, Peer::V2(Window::V1)),
            Scheme::Credit {
                ours: small,
                theirs: Window::V1
            }
        );
        assert_eq!(
            Scheme::negotiate(false, Version::V2, small, Peer::V2(big)),
            Scheme::Compat { ours: small }
        );
        assert_eq!(
            Scheme::negotiate(true, Version::V2, small, Peer::NoCredit),
            Scheme::Compat { ours: small }
        );
    }

    fn credit_flow(theirs: usize) -> Arc<Flow> {
        Arc::new(Flow::new(Scheme::Credit {
            ours: Window::V1,
            theirs: Window::new(theirs, theirs / 4).unwrap(),
        }))
    }

    #[tokio::test]
    async fn a_sender_waits_for_credit_and_a_grant_wakes_it() {
        let flow = credit_flow(64 * 1024);
        flow.take(60 * 1024).await.unwrap();
        let waiting = tokio::spawn({
            let flow = flow.clone();
            async move { flow.take(8 * 1024).await }
        });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished());
        flow.grant(8 * 1024);
        waiting.await.unwrap().unwrap();
        assert_eq!(flow.credit(), 64 * 1024 - 60 * 1024);
    }

    #[tokio::test]
    async fn closing_wakes_a_waiting_sender_with_an_error() {
        let flow = credit_flow(64 * 1024);
        flow.take(64 * 1024).await.unwrap();
        let waiting = tokio::spawn({
            let flow = flow.clone();
            async move { flow.take(1).await }
        });
        tokio::task::yield_now().await;
        flow.close();
        assert_eq!(waiting.await.unwrap(), Err(FlowClosed));
        assert_eq!(flow.take(1).await, Err(FlowClosed));
    }

    #[tokio::test(start_paused = true)]
    async fn without_credit_a_full_queue_waits_while_it_drains_then_gives_up() {
        let flow = Arc::new(Flow::new(Scheme::Compat { ours: Window::V1 }));
        let (tx, mut rx) = inbound(Some(flow.clone()), 0);
        tx.send(Bytes::from(vec![0u8; WINDOW - PACKET_OVERHEAD]))
            .await
            .unwrap();
        // Room appears: the waiting send goes through.
        let waiting = tokio::spawn({
            let tx = tx.clone();
            async move { tx.send(Bytes::from_static(b"more")).await }
        });
        tokio::time::sleep(COMPAT_STALL / 2).await;
        assert!(!waiting.is_finished());
        let (_, cost) = rx.recv().await.unwrap();
        assert_eq!(rx.drained(cost), None, "no credit without negotiation");
        assert_eq!(waiting.await.unwrap(), Ok(()));
        let (_, cost) = rx.recv().await.unwrap();
        let _ = rx.drained(cost);
        // Nothing drains: it gives up after the stall time.
        tx.send(Bytes::from(vec![0u8; WINDOW - 200])).await.unwrap();
        let start = tokio::time::Instant::now();
        assert_eq!(
            tx.send(Bytes::from(vec![0u8; 1000])).await,
            Err(Refused::Overflow)
        );
        assert_eq!(start.elapsed(), COMPAT_STALL);
    }

    #[tokio::test]
    async fn with_credit_a_queue_past_its_window_overflows_at_once() {
        let flow = Arc::new(Flow::new(Scheme::Credit {
            ours: Window::new(64 * 1024, 16 * 1024).unwrap(),
            theirs: Window::V1,
        }));
        let (tx, _rx) = inbound(Some(flow), 0);
        let mut accepted = 0;
        let refused = loop {
            match tx.send(Bytes::from_static(b"x")).await {
                Ok(()) => accepted += 1,
                Err(refused) => break refused,
            }
        };
        assert_eq!(refused, Refused::Overflow);
        assert_eq!(accepted, 64 * 1024 / cost(1));
    }
}
