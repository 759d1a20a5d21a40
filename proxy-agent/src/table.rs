//! The connection table of one server stream, without I/O: pending dials
//! and established connections by id, and what each packet from the server
//! means for them.
//!
//! [`StreamTable::handle`] takes a packet and returns one [`Step`] for the
//! stream's reader to carry out; [`dialed`](StreamTable::dialed),
//! [`remove`](StreamTable::remove) and [`stream_ended`](StreamTable::stream_ended)
//! are the other events. Nothing here awaits or spawns: the reader and the
//! connection tasks own the sockets and queues, do all the waiting, and hold
//! the table's lock only to call these.
//!
//! `D` is what a pending dial is cancelled through and `C` what an
//! established connection is reached through; the tests use plain values.
//!
//! ANP's agent lifecycle, which the table follows (`DialId` is the
//! server's `random`, `ConnId` ours, unique on the stream from 1):
//! - `DIAL_REQ{random}` → take the next connection id and dial; its end
//!   answers `DIAL_RSP{random, connID}` or `DIAL_RSP{random, error}` (the
//!   id is then unused), once. A `DIAL_CLS{random}` before then
//!   cancels it and no answer follows.
//! - `DATA{connID}` → the connection's socket; for an unknown id,
//!   `CLOSE_RSP{connID, "unrecognized connectID"}`.
//! - `CLOSE_REQ{connID}` → the connection leaves the table and closes once
//!   its queued bytes are written; its task answers `CLOSE_RSP`. Unknown:
//!   `CLOSE_RSP{connID, "Unknown connectID"}` at once.
//! - A connection that ends on its own leaves the table and its task sends
//!   `CLOSE_RSP` unprompted.

use std::collections::HashMap;

use bytes::Bytes;
use proto::{Packet, packet::PacketKind};
use tunnel::{
    flow,
    ids::{ConnId, DialId},
};

/// A failed dial as the server is told it: its text (what ANP's agents
/// send) and its class (`DialResponse.errorClass`, which ours add).
pub trait DialFailed: std::fmt::Display {
    /// Its class; the server retries a refused or unreachable dial on
    /// another agent by it.
    fn class(&self) -> proto::DialErrorClass;
}

/// A bare text: no class, as ANP's agents answer.
impl DialFailed for String {
    fn class(&self) -> proto::DialErrorClass {
        proto::DialErrorClass::Unspecified
    }
}

/// A bare text: no class, as ANP's agents answer.
impl DialFailed for &str {
    fn class(&self) -> proto::DialErrorClass {
        proto::DialErrorClass::Unspecified
    }
}

/// What the stream's reader does for one packet.
#[derive(Debug, PartialEq, Eq)]
pub enum Step<D, C> {
    /// Dial `address`, cancellable through `cancel`; report the outcome to
    /// [`StreamTable::dialed`].
    Dial {
        /// Which dial: report its end with it.
        ticket: DialTicket,
        /// `tcp` (ANP accepts nothing else).
        protocol: String,
        /// `host:port`.
        address: String,
        /// The server's dial span (`DialRequest.traceparent`; empty if none).
        traceparent: String,
        /// The pending dial's handle, as recorded in the table.
        cancel: D,
    },
    /// Write `data` to connection `conn`'s socket (it is in the table).
    Deliver {
        /// The connection.
        conn: ConnId,
        /// The bytes.
        data: Bytes,
    },
    /// The server returned credit for `conn`'s DATA (it is in the table).
    Grant {
        /// The connection.
        conn: ConnId,
        /// Bytes of cost.
        credit: usize,
    },
    /// The server closed `conn`, which has left the table: write what is
    /// queued, close, answer CLOSE_RSP (the connection's task does).
    Close {
        /// The connection.
        conn: ConnId,
        /// Its handle.
        handle: C,
    },
    /// The server cancelled a pending dial, which has left the table.
    CancelDial(D),
    /// A control packet to queue for the server.
    Reply(Packet),
    /// Nothing to do.
    Ignore(&'static str),
}

/// One dial request, as its task reports it: a cancelled dial whose
/// `random` the server then reuses cannot answer for the new one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DialTicket {
    /// The server's `random`.
    pub dial: DialId,
    /// The connection id taken for it (as ANP, before dialing: a failed
    /// dial uses one up).
    conn: ConnId,
}

/// How a dial ended, for the table.
#[derive(Debug, PartialEq, Eq)]
pub enum Dialed {
    /// Connected: the connection is in the table as `conn`; send `reply`
    /// (the DIAL_RSP), then move its bytes.
    Open {
        /// Its id.
        conn: ConnId,
        /// `DIAL_RSP{random, connID}`.
        reply: Packet,
    },
    /// Failed: send `reply` (a DIAL_RSP with the error).
    Failed {
        /// `DIAL_RSP{random, error}`.
        reply: Packet,
    },
    /// The dial was cancelled (DIAL_CLS, or the stream ended) meanwhile:
    /// drop the socket, answer nothing.
    Cancelled,
}

/// Pending dials and established connections of one server stream.
pub struct StreamTable<D, C> {
    /// Whether per-connection credits are in use on the stream.
    flow_control: bool,
    /// Makes a pending dial's handle.
    new_dial: Box<dyn FnMut() -> D + Send>,
    /// The next connection id.
    next_conn: i64,
    /// Dials in progress, with the connection id each took.
    dials: HashMap<DialId, (ConnId, D)>,
    /// Established connections.
    conns: HashMap<ConnId, C>,
    /// Set once the stream ended: nothing new enters.
    ended: bool,
}

impl<D: Clone, C> StreamTable<D, C> {
    /// An empty table; `new_dial` makes each pending dial's handle.
    pub fn new(flow_control: bool, new_dial: impl FnMut() -> D + Send + 'static) -> Self {
        Self {
            flow_control,
            new_dial: Box::new(new_dial),
            next_conn: 1,
            dials: HashMap::new(),
            conns: HashMap::new(),
            ended: false,
        }
    }

    /// What `packet` from the server means; see the module docs.
    pub fn handle(&mut self, packet: Packet) -> Step<D, C> {
        if let Some((conn, credit)) = flow::parse_credit(&packet) {
            let conn = ConnId(conn);
            return if !self.flow_control {
                Step::Ignore("credit without flow control")
            } else if self.conns.contains_key(&conn) {
                Step::Grant { conn, credit }
            } else {
                // The connection has just closed: its credit is moot.
                Step::Ignore("credit for an unknown connection")
            };
        }
        match packet.into_kind() {
            PacketKind::DialReq(req) => {
                let dial = DialId(req.random);
                if self.ended {
                    return Step::Ignore("dial after the stream ended");
                }
                if self.dials.contains_key(&dial) {
                    // The first dial keeps its single answer; this one gets
                    // its own.
                    return Step::Reply(Packet::dial_response(
                        dial.0,
                        0,
                        &format!("dial id {} already in progress", dial.0),
                    ));
                }
                // A draining agent still dials (ANP): the server sends it
                // new dials only when no other agent fits.
                let cancel = (self.new_dial)();
                let ticket = DialTicket {
                    dial,
                    conn: ConnId(self.next_conn),
                };
                self.next_conn += 1;
                self.dials.insert(dial, (ticket.conn, cancel.clone()));
                Step::Dial {
                    ticket,
                    protocol: req.protocol,
                    address: req.address,
                    traceparent: req.traceparent,
                    cancel,
                }
            }
            PacketKind::Data(data) => {
                let conn = ConnId(data.connect_id);
                if self.conns.contains_key(&conn) {
                    Step::Deliver {
                        conn,
                        data: data.data,
                    }
                } else {
                    Step::Reply(Packet::close_response(conn.0, "unrecognized connectID"))
                }
            }
            PacketKind::CloseReq(req) => {
                let conn = ConnId(req.connect_id);
                if let Some(handle) = self.remove(conn) {
                    Step::Close { conn, handle }
                } else {
                    Step::Reply(Packet::close_response(conn.0, "Unknown connectID"))
                }
            }
            PacketKind::DialCls(cls) => match self.dials.remove(&DialId(cls.random)) {
                Some((_, cancel)) => Step::CancelDial(cancel),
                None => Step::Ignore("DIAL_CLS for no pending dial"),
            },
            PacketKind::DialRsp(_) | PacketKind::CloseRsp(_) | PacketKind::Drain => {
                Step::Ignore("a packet only agents send")
            }
            PacketKind::Unknown(_) => Step::Ignore("unknown packet type"),
        }
    }

    /// The dial of `ticket` ended with `outcome` (the connection's handle,
    /// or why it failed, whose text and class go to the server).
    pub fn dialed<E: DialFailed>(&mut self, ticket: DialTicket, outcome: Result<C, E>) -> Dialed {
        let dial = ticket.dial;
        if self
            .dials
            .get(&dial)
            .is_none_or(|(conn, _)| *conn != ticket.conn)
        {
            return Dialed::Cancelled;
        }
        self.dials.remove(&dial);
        match outcome {
            Ok(handle) => {
                let conn = ticket.conn;
                self.conns.insert(conn, handle);
                Dialed::Open {
                    conn,
                    reply: Packet::dial_response(dial.0, conn.0, ""),
                }
            }
            Err(error) => Dialed::Failed {
                reply: Packet::dial_failure(dial.0, 0, &error.to_string(), error.class()),
            },
        }
    }

    /// An established connection.
    pub fn conn(&self, conn: ConnId) -> Option<&C> {
        self.conns.get(&conn)
    }

    /// Takes a connection out of the table (it ended, was closed by the
    /// server, or overflowed); `None` if it already left.
    pub fn remove(&mut self, conn: ConnId) -> Option<C> {
        let handle = self.conns.remove(&conn);
        tunnel::compact(&mut self.conns);
        handle
    }

    /// The stream ended: every pending dial and connection leaves the table
    /// (to be cancelled by the caller); dials that finish later are
    /// [`Dialed::Cancelled`].
    pub fn stream_ended(&mut self) -> (Vec<D>, Vec<C>) {
        self.ended = true;
        (
            std::mem::take(&mut self.dials)
                .into_values()
                .map(|(_, d)| d)
                .collect(),
            std::mem::take(&mut self.conns).into_values().collect(),
        )
    }

    /// Established connections.
    pub fn len(&self) -> usize {
        self.conns.len()
    }

    /// Whether no connection is established.
    pub fn is_empty(&self) -> bool {
        self.conns.is_empty()
    }

    /// Checks that the table is consistent; panics naming what is not. The
    /// fuzz target (`fuzz/fuzz_targets/agent_table.rs`) and the property
    /// tests call it after every event:
    /// - every connection id, of a pending dial or an established
    ///   connection, was handed out (1 ≤ id < the next one) and names one
    ///   of them only: no two dials share an id, and no dial shares one
    ///   with a connection;
    /// - once the stream ended, nothing is left.
    #[cfg(any(test, feature = "fuzzing"))]
    pub fn check(&self) {
        let handed_out = |id: ConnId| (1..self.next_conn).contains(&id.0);
        let mut ids = std::collections::HashSet::new();
        for (dial, (conn, _)) in &self.dials {
            assert!(
                handed_out(*conn),
                "dial {dial:?} holds id {conn:?}, never handed out"
            );
            assert!(ids.insert(*conn), "id {conn:?} held by two dials");
        }
        for conn in self.conns.keys() {
            assert!(handed_out(*conn), "connection {conn:?} never handed out");
            assert!(!ids.contains(conn), "id {conn:?} both dialing and open");
        }
        assert!(
            !self.ended || (self.dials.is_empty() && self.conns.is_empty()),
            "the stream ended with {} dials and {} connections left",
            self.dials.len(),
            self.conns.len()
        );
    }

    /// Dials in progress.
    pub fn dials_in_progress(&self) -> usize {
        self.dials.len()
    }
}

#[cfg(test)]
mod tests;
