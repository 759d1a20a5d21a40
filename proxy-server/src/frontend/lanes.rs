//! [`Lanes`]: what a `Proxy` stream's driver has read and not yet
//! uploaded, so that one connection waiting for its agent does not stop
//! the stream for the others.
//!
//! The protocol lets a frontend carry several connections on one stream,
//! and frontends get no credit (kube-apiserver's client speaks the plain
//! protocol). So while a connection's upload waits (for credit, or for
//! room on its agent's queue), the driver keeps reading the stream: that
//! connection's DATA (and a CLOSE_REQ behind it, kept in order) goes into
//! its lane, while packets for other connections and other control packets
//! act at once. What the lanes hold is counted as its cost
//! ([`Lanes::cost`]): the bytes, and a fixed overhead for every queued
//! item ([`ITEM_OVERHEAD`]) and every lane ([`LANE_OVERHEAD`]), so that
//! many tiny packets are bounded too. A stream's lanes hold at most
//! [`LANES_MAX_BYTES`] (a packet is admitted while less is held, so one
//! packet more at most), and all streams' lanes together what the
//! process-wide budget allows (`--buffer-budget-bytes`, taken by the
//! driver for the cost its lanes hold). When either is full the driver
//! stops reading the stream, as a stream without read-ahead would:
//! - on a stream that carries only one connection, until the upload goes
//!   on: plain backpressure (a slow `kubectl cp` is slowed, never cut),
//!   unless the budget is full;
//! - on a stream that carries others, or with the budget full, a lane
//!   whose upload made no progress for [`UPLOAD_GRACE`] is cut: its
//!   connection is closed with an error at both ends, its queued bytes and
//!   later DATA are dropped, and the stream reads on.
//!
//! While the budget is full, a stalled lane is cut after [`UPLOAD_GRACE`]
//! on any stream, stopped or not: what it holds is what other streams
//! wait for. A lane that holds the frontend's CLOSE_REQ and makes no
//! progress for [`UPLOAD_GRACE`] is cut too, full or not: the frontend is
//! closing, and a destination that stopped reading must not keep its
//! close unanswered.
//!
//! Plain data with the clock given; the driver (`grpc.rs`) runs the
//! uploads and the waits, and takes the budget.

use std::{
    collections::{HashMap, VecDeque},
    sync::Arc,
    time::{Duration, Instant},
};

use bytes::Bytes;
use proto::Packet;
use tunnel::{flow, ids::ConnId};

use crate::conn::Conn;

/// Cost a stream's lanes hold at most (one connection window): what a
/// stream may have read ahead of its waiting uploads.
pub(crate) const LANES_MAX_BYTES: usize = flow::WINDOW;
/// What a queued item costs beyond its bytes: its slot in its lane's
/// queue (twice over: a queue grows by doubling), and what its payload
/// costs beyond its length (the allocator's rounding, the shared header
/// a payload gets when it is cut into chunks).
pub(crate) const ITEM_OVERHEAD: usize = 2 * std::mem::size_of::<Item>() + 64;
/// What a lane costs beyond its items: its entry in the table, its queue,
/// and the upload in flight (a boxed future with the chunk).
pub(crate) const LANE_OVERHEAD: usize = 1024;
/// How long a lane may make no progress, on a stream stopped for it that
/// carries other connections, before its connection is cut. ANP's agents
/// and ours give a destination that stopped reading as long
/// (`flow::COMPAT_STALL`), so a connection that is merely slow is not cut.
pub const UPLOAD_GRACE: Duration = flow::COMPAT_STALL;

/// What waits in a lane, in the order the frontend sent it.
#[derive(Debug)]
enum Item {
    /// DATA not yet uploaded.
    Data(Bytes),
    /// The frontend's CLOSE_REQ, after the DATA it sent before.
    Close(Packet),
}

/// One connection's uploads in progress.
struct Lane {
    /// The connection.
    conn: Arc<Conn>,
    /// What waits behind the chunk being uploaded.
    items: VecDeque<Item>,
    /// The chunk being uploaded, if any.
    in_flight: usize,
    /// Since when the lane has made no progress.
    since: Instant,
    /// Whether it holds the frontend's CLOSE_REQ (its last item: nothing
    /// is queued behind it).
    closing: bool,
}

/// What the driver does next for a lane.
pub(crate) enum Next {
    /// Upload this chunk of the connection's DATA.
    Upload(Arc<Conn>, Bytes),
    /// Hand this CLOSE_REQ to the control core: the DATA before it is
    /// uploaded.
    Close(Packet),
}

impl std::fmt::Debug for Next {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Upload(conn, chunk) => write!(f, "Upload({}, {} bytes)", conn.id, chunk.len()),
            Self::Close(packet) => write!(f, "Close({packet:?})"),
        }
    }
}

/// A stream's lanes; see the module documentation.
#[derive(Default)]
pub(crate) struct Lanes {
    /// Lanes by connection.
    lanes: HashMap<ConnId, Lane>,
    /// Bytes the lanes hold (queued and in flight).
    bytes: usize,
    /// Items queued in all lanes.
    items: usize,
    /// Lanes that hold a CLOSE_REQ.
    closing: usize,
}

impl Lanes {
    /// Whether `conn` has uploads in progress (its DATA must queue behind).
    pub(crate) fn has_lane(&self, conn: ConnId) -> bool {
        self.lanes.contains_key(&conn)
    }

    /// Whether a packet may be read into the lanes now.
    pub(crate) fn has_room(&self) -> bool {
        self.cost() < LANES_MAX_BYTES
    }

    /// What the lanes hold: their bytes, [`ITEM_OVERHEAD`] per queued item
    /// and [`LANE_OVERHEAD`] per lane.
    pub(crate) fn cost(&self) -> usize {
        self.bytes + self.items * ITEM_OVERHEAD + self.lanes.len() * LANE_OVERHEAD
    }

    /// Bytes held.
    #[cfg(any(test, feature = "fuzzing"))]
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }

    /// Items queued.
    #[cfg(any(test, feature = "fuzzing"))]
    pub(crate) fn items(&self) -> usize {
        self.items
    }

    /// Lanes that hold a CLOSE_REQ.
    #[cfg(any(test, feature = "fuzzing"))]
    pub(crate) fn closing(&self) -> usize {
        self.closing
    }

    /// Opens `conn`'s lane with a chunk whose upload is waiting and `rest`
    /// of its packet behind it.
    pub(crate) fn open(&mut self, conn: Arc<Conn>, in_flight: usize, rest: Bytes, now: Instant) {
        let mut items = VecDeque::new();
        let queued = rest.len();
        if !rest.is_empty() {
            items.push_back(Item::Data(rest));
        }
        self.bytes += in_flight + queued;
        self.items += items.len();
        self.lanes.insert(
            conn.id,
            Lane {
                conn,
                items,
                in_flight,
                since: now,
                closing: false,
            },
        );
    }

    /// Queues DATA behind `conn`'s uploads (its lane exists: see
    /// [`Lanes::has_lane`]; the caller checked [`Lanes::has_room`]). An
    /// empty DATA carries nothing and is dropped, as is DATA the frontend
    /// sent after its CLOSE_REQ.
    pub(crate) fn queue(&mut self, conn: ConnId, data: Bytes) {
        if data.is_empty() {
            return;
        }
        if let Some(lane) = self.lanes.get_mut(&conn)
            && !lane.closing
        {
            self.bytes += data.len();
            self.items += 1;
            lane.items.push_back(Item::Data(data));
        }
    }

    /// Queues the frontend's CLOSE_REQ for `conn` behind its DATA (a
    /// second one is dropped: the first closes it); gives it back if
    /// `conn` has no lane (it acts at once).
    pub(crate) fn close(&mut self, conn: ConnId, packet: Packet) -> Option<Packet> {
        let Some(lane) = self.lanes.get_mut(&conn) else {
            return Some(packet);
        };
        if !lane.closing {
            lane.closing = true;
            self.closing += 1;
            self.items += 1;
            lane.items.push_back(Item::Close(packet));
        }
        None
    }

    /// The chunk in flight on `conn` was uploaded (`ok`) or its connection
    /// is gone; what to do next for it. When the lane is done (or its
    /// connection gone) it is removed; a CLOSE_REQ it held is still
    /// returned, so the frontend's close reaches the control core.
    pub(crate) fn uploaded(&mut self, conn: ConnId, ok: bool, now: Instant) -> Option<Next> {
        let lane = self.lanes.get_mut(&conn)?;
        self.bytes -= std::mem::take(&mut lane.in_flight);
        lane.since = now;
        if !ok {
            let lane = self.lanes.remove(&conn).expect("looked up above");
            return self.drop_lane(lane);
        }
        let next = match lane.items.pop_front() {
            None => None,
            Some(Item::Close(packet)) => {
                self.closing -= 1;
                self.items -= 1;
                lane.closing = false;
                Some(Next::Close(packet))
            }
            Some(Item::Data(mut data)) => {
                // Never empty (`queue`, `open`): an empty chunk would end
                // the lane with items behind it.
                let chunk = data.split_to(data.len().min(lane.conn.flow.send_chunk()));
                if data.is_empty() {
                    self.items -= 1;
                } else {
                    lane.items.push_front(Item::Data(data));
                }
                lane.in_flight = chunk.len();
                Some(Next::Upload(lane.conn.clone(), chunk))
            }
        };
        // A lane with nothing in flight is done: it held nothing else (a
        // CLOSE_REQ is its last item).
        if lane.in_flight == 0 {
            debug_assert!(lane.items.is_empty(), "a lane ended with items queued");
            let lane = self.lanes.remove(&conn).expect("looked up above");
            self.bytes -= queued_bytes(&lane.items);
            self.items -= lane.items.len();
        }
        next
    }

    /// The lane that has made no progress for longest, and since when.
    pub(crate) fn most_stalled(&self) -> Option<(ConnId, Instant)> {
        self.lanes
            .values()
            .map(|lane| (lane.conn.id, lane.since))
            .min_by_key(|(_, since)| *since)
    }

    /// Of the lanes that hold a CLOSE_REQ, the one that has made no
    /// progress for longest, and since when.
    pub(crate) fn most_stalled_closing(&self) -> Option<(ConnId, Instant)> {
        if self.closing == 0 {
            return None;
        }
        self.lanes
            .values()
            .filter(|lane| lane.closing)
            .map(|lane| (lane.conn.id, lane.since))
            .min_by_key(|(_, since)| *since)
    }

    /// Takes `conn`'s lane out (its connection is being cut): its
    /// connection, and a CLOSE_REQ it held.
    pub(crate) fn cut(&mut self, conn: ConnId) -> Option<(Arc<Conn>, Option<Packet>)> {
        let lane = self.lanes.remove(&conn)?;
        let conn = lane.conn.clone();
        let close = match self.drop_lane(lane) {
            Some(Next::Close(packet)) => Some(packet),
            _ => None,
        };
        Some((conn, close))
    }

    /// Forgets a removed lane's bytes; its CLOSE_REQ, if it held one.
    fn drop_lane(&mut self, lane: Lane) -> Option<Next> {
        self.bytes -= lane.in_flight + queued_bytes(&lane.items);
        self.items -= lane.items.len();
        if lane.closing {
            self.closing -= 1;
        }
        lane.items.into_iter().find_map(|item| match item {
            Item::Close(packet) => Some(Next::Close(packet)),
            Item::Data(_) => None,
        })
    }
}

/// Bytes of DATA in `items`.
fn queued_bytes(items: &VecDeque<Item>) -> usize {
    items
        .iter()
        .map(|item| match item {
            Item::Data(data) => data.len(),
            Item::Close(_) => 0,
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conn::test_conn;

    fn compat() -> flow::Scheme {
        flow::Scheme::Compat {
            ours: flow::Window::V1,
        }
    }

    fn bytes(len: usize, fill: u8) -> Bytes {
        Bytes::from(vec![fill; len])
    }

    /// Drives one lane to its end: every chunk in order, then the CLOSE_REQ.
    #[test]
    fn a_lane_uploads_in_order_then_hands_over_its_close() {
        let (conn, _agent, _fe) = test_conn(7, compat());
        let chunk = conn.flow.send_chunk();
        let now = Instant::now();
        let mut ahead = Lanes::default();
        ahead.open(conn.clone(), 10, bytes(chunk + 5, 1), now);
        ahead.queue(conn.id, bytes(3, 2));
        assert!(ahead.close(conn.id, Packet::close_request(7)).is_none());
        assert_eq!(ahead.bytes(), 10 + chunk + 5 + 3);
        let mut got = Vec::new();
        let mut next = ahead.uploaded(conn.id, true, now);
        while let Some(step) = next {
            match step {
                Next::Upload(c, data) => {
                    assert_eq!(c.id, conn.id);
                    got.push(data.len());
                }
                Next::Close(packet) => {
                    assert!(matches!(
                        packet.into_kind(),
                        proto::packet::PacketKind::CloseReq(_)
                    ));
                    got.push(0);
                }
            }
            next = ahead.uploaded(conn.id, true, now);
        }
        assert_eq!(got, [chunk, 5, 3, 0]);
        assert!(!ahead.has_lane(conn.id));
        assert_eq!(ahead.bytes(), 0);
        assert_eq!(ahead.cost(), 0);
    }

    #[test]
    fn full_lanes_have_no_room_until_a_lane_is_cut() {
        let (a, _agent_a, _fe_a) = test_conn(1, compat());
        let (b, _agent_b, _fe_b) = test_conn(2, compat());
        let t0 = Instant::now();
        let mut ahead = Lanes::default();
        let rest = LANES_MAX_BYTES - 300 - 2 * LANE_OVERHEAD - ITEM_OVERHEAD;
        ahead.open(a.clone(), 100, bytes(rest, 1), t0);
        assert!(ahead.has_room());
        ahead.open(b.clone(), 100, Bytes::new(), t0 + Duration::from_secs(1));
        assert_eq!(ahead.cost(), LANES_MAX_BYTES - 100);
        assert!(ahead.has_room());
        // Admitted while less than LANES_MAX_BYTES was held: one packet over.
        ahead.queue(a.id, bytes(5000, 1));
        assert!(!ahead.has_room());
        assert_eq!(ahead.most_stalled(), Some((a.id, t0)));
        ahead.close(a.id, Packet::close_request(1));
        let (cut, close) = ahead.cut(a.id).expect("a's lane");
        assert_eq!(cut.id, a.id);
        assert!(close.is_some(), "its CLOSE_REQ comes back");
        assert!(ahead.has_room());
        assert_eq!(ahead.bytes(), 100);
        assert_eq!(ahead.cost(), 100 + LANE_OVERHEAD);
        assert_eq!(
            ahead.most_stalled(),
            Some((b.id, t0 + Duration::from_secs(1)))
        );
    }

    /// Tiny packets cost their overhead: a flood of 1-byte DATA behind a
    /// stalled upload fills the lanes after about a thousandth of the
    /// packets their bytes alone would allow. Before, each counted 1 byte:
    /// a million of them fitted in 1 MiB.
    #[test]
    fn tiny_packets_fill_the_lanes_by_their_overhead() {
        let (conn, _agent, _fe) = test_conn(8, compat());
        let mut ahead = Lanes::default();
        ahead.open(conn.clone(), 1, Bytes::new(), Instant::now());
        let mut queued = 0;
        while ahead.has_room() {
            ahead.queue(conn.id, Bytes::from_static(b"x"));
            queued += 1;
            assert!(queued <= LANES_MAX_BYTES / ITEM_OVERHEAD, "{queued} queued");
        }
        assert_eq!(ahead.items(), queued);
        assert_eq!(
            ahead.cost(),
            1 + queued * (1 + ITEM_OVERHEAD) + LANE_OVERHEAD
        );
        // A CLOSE_REQ costs its overhead too; the lane's end gives all back.
        ahead.close(conn.id, Packet::close_request(8));
        assert_eq!(ahead.items(), queued + 1);
        ahead.cut(conn.id);
        assert_eq!((ahead.cost(), ahead.items()), (0, 0));
    }

    #[test]
    fn a_gone_connection_drops_its_lane_but_not_its_close() {
        let (conn, _agent, _fe) = test_conn(3, compat());
        let now = Instant::now();
        let mut ahead = Lanes::default();
        ahead.open(conn.clone(), 10, bytes(10, 1), now);
        ahead.close(conn.id, Packet::close_request(3));
        let next = ahead.uploaded(conn.id, false, now);
        assert!(matches!(next, Some(Next::Close(_))), "{next:?}");
        assert!(!ahead.has_lane(conn.id));
        assert_eq!(ahead.bytes(), 0);
        // A connection without a lane: its CLOSE_REQ acts at once.
        assert!(ahead.close(conn.id, Packet::close_request(3)).is_some());
    }

    #[test]
    fn only_lanes_holding_a_close_are_closing() {
        let (a, _agent_a, _fe_a) = test_conn(1, compat());
        let (b, _agent_b, _fe_b) = test_conn(2, compat());
        let t0 = Instant::now();
        let mut ahead = Lanes::default();
        ahead.open(a.clone(), 10, Bytes::new(), t0);
        ahead.open(b.clone(), 10, Bytes::new(), t0 + Duration::from_secs(1));
        assert_eq!(ahead.most_stalled_closing(), None);
        ahead.close(b.id, Packet::close_request(2));
        assert_eq!(
            ahead.most_stalled_closing(),
            Some((b.id, t0 + Duration::from_secs(1)))
        );
        assert!(matches!(
            ahead.uploaded(b.id, true, t0),
            Some(Next::Close(_))
        ));
        assert_eq!(ahead.most_stalled_closing(), None);
        ahead.close(a.id, Packet::close_request(1));
        ahead.cut(a.id);
        assert_eq!(ahead.most_stalled_closing(), None);
        assert_eq!(ahead.closing, 0);
    }

    #[test]
    fn progress_restarts_a_lanes_stall_clock() {
        let (conn, _agent, _fe) = test_conn(4, compat());
        let t0 = Instant::now();
        let mut ahead = Lanes::default();
        ahead.open(conn.clone(), 10, bytes(10, 1), t0);
        let later = t0 + UPLOAD_GRACE;
        assert!(ahead.uploaded(conn.id, true, later).is_some());
        assert_eq!(ahead.most_stalled(), Some((conn.id, later)));
    }

    /// An empty DATA in a lane holds nothing back: what was queued behind
    /// it is uploaded, then the close.
    #[test]
    fn an_empty_data_never_drops_what_is_queued_behind_it() {
        let (conn, _agent, _fe) = test_conn(5, compat());
        let now = Instant::now();
        let mut ahead = Lanes::default();
        ahead.open(conn.clone(), 10, Bytes::new(), now);
        ahead.queue(conn.id, Bytes::new());
        ahead.queue(conn.id, Bytes::from_static(b"abc"));
        assert!(ahead.close(conn.id, Packet::close_request(5)).is_none());
        match ahead.uploaded(conn.id, true, now) {
            Some(Next::Upload(c, data)) => {
                assert_eq!(c.id, conn.id);
                assert_eq!(data, Bytes::from_static(b"abc"));
            }
            other => panic!("want Upload(abc), got {other:?}"),
        }
        assert!(
            matches!(ahead.uploaded(conn.id, true, now), Some(Next::Close(_))),
            "then the close"
        );
        assert!(!ahead.has_lane(conn.id));
        assert_eq!(ahead.bytes(), 0);
        assert_eq!(ahead.closing, 0);
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2048))]

        /// Any sequence of DATA (empty too), closes (repeated too),
        /// uploads that end or fail, and cuts: every byte queued is
        /// uploaded, in order, then the close (`fuzzing::lanes` checks).
        #[test]
        fn any_sequence_uploads_every_byte_in_order_then_the_close(
            ops in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..600),
        ) {
            crate::fuzzing::lanes(&ops);
        }
    }
}
