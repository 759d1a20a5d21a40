//! The agent's connection table without sockets: each transition of ANP's
//! lifecycle as a packet sequence and its expected steps, then properties
//! over random interleavings.

use std::collections::{HashMap, HashSet};

use bytes::Bytes;
use proptest::prelude::*;
use proto::{Packet, packet::PacketKind};
use tunnel::{
    flow,
    ids::{ConnId, DialId},
};

use super::{DialFailed, DialTicket, Dialed, Step, StreamTable};

/// A table whose dial handles count up from 100 and whose connection
/// handles are names.
fn table(flow_control: bool) -> StreamTable<u32, &'static str> {
    let mut next = 100;
    StreamTable::new(flow_control, move || {
        next += 1;
        next
    })
}

fn dial_req(random: i64) -> Packet {
    Packet::dial_request("tcp", "10.0.0.1:443", random)
}

fn data(conn: i64, bytes: &'static [u8]) -> Packet {
    Packet::data(conn, Bytes::from_static(bytes))
}

/// `DIAL_RSP{random, connID, error}` as a tuple.
fn dial_rsp(packet: &Packet) -> (i64, i64, String) {
    match packet.clone().into_kind() {
        PacketKind::DialRsp(rsp) => (rsp.random, rsp.connect_id, rsp.error),
        other => panic!("not a DIAL_RSP: {other:?}"),
    }
}

/// `CLOSE_RSP{connID, error}` as a tuple.
fn close_rsp<C: std::fmt::Debug>(step: Step<u32, C>) -> (i64, String) {
    match step {
        Step::Reply(packet) => match packet.into_kind() {
            PacketKind::CloseRsp(rsp) => (rsp.connect_id, rsp.error),
            other => panic!("not a CLOSE_RSP: {other:?}"),
        },
        other => panic!("not a reply: {other:?}"),
    }
}

/// Starts a dial; returns its ticket.
fn dial<C: std::fmt::Debug>(t: &mut StreamTable<u32, C>, random: i64) -> DialTicket {
    match t.handle(dial_req(random)) {
        Step::Dial { ticket, .. } => ticket,
        other => panic!("unexpected {other:?}"),
    }
}

/// Opens a connection through a dial; returns its id.
fn open(t: &mut StreamTable<u32, &'static str>, random: i64, name: &'static str) -> ConnId {
    let ticket = dial(t, random);
    match t.dialed::<String>(ticket, Ok(name)) {
        Dialed::Open { conn, reply } => {
            assert_eq!(dial_rsp(&reply), (random, conn.0, String::new()));
            conn
        }
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn a_dial_request_starts_a_dial_with_its_address_and_handle() {
    let mut t = table(true);
    match t.handle(dial_req(7)) {
        Step::Dial {
            ticket,
            protocol,
            address,
            traceparent,
            cancel,
        } => {
            assert_eq!(ticket.dial, DialId(7));
            assert_eq!(
                traceparent, "",
                "an ANP server's DIAL_REQ has no trace context"
            );
            assert_eq!(
                (protocol.as_str(), address.as_str()),
                ("tcp", "10.0.0.1:443")
            );
            assert_eq!(cancel, 101);
        }
        other => panic!("unexpected {other:?}"),
    }
    assert_eq!(t.dials_in_progress(), 1);
    assert!(t.is_empty());
}

#[test]
fn a_successful_dial_is_answered_once_with_a_fresh_connection_id() {
    let mut t = table(true);
    let ticket = dial(&mut t, 7);
    let Dialed::Open { conn: first, .. } = t.dialed::<String>(ticket, Ok("a")) else {
        panic!("not open");
    };
    let second = open(&mut t, 8, "b");
    assert_eq!((first, second), (ConnId(1), ConnId(2)), "ids start at 1");
    assert_eq!(t.len(), 2);
    assert_eq!(t.dials_in_progress(), 0);
    assert_eq!(t.conn(first), Some(&"a"));
    // A second outcome for the same dial answers nothing.
    assert_eq!(t.dialed::<String>(ticket, Ok("again")), Dialed::Cancelled);
    assert_eq!(t.len(), 2);
}

#[test]
fn a_failed_dial_is_answered_with_its_error_and_opens_nothing() {
    let mut t = table(true);
    let ticket = dial(&mut t, 9);
    let error = "dial tcp 10.0.0.1:443: connect: connection refused";
    match t.dialed::<String>(ticket, Err(error.into())) {
        Dialed::Failed { reply } => assert_eq!(dial_rsp(&reply), (9, 0, error.into())),
        other => panic!("unexpected {other:?}"),
    }
    assert!(t.is_empty());
    assert_eq!(t.dials_in_progress(), 0);
    // As ANP, the id was taken before dialing: the next one gets 2.
    assert_eq!(open(&mut t, 10, "a"), ConnId(2));
    // An error with a class (as the endpoint's are: its own tests show
    // each) is answered with it, for the server's retry.
    let ticket = dial(&mut t, 11);
    match t.dialed::<Refused>(ticket, Err(Refused)) {
        Dialed::Failed { reply } => match reply.into_kind() {
            PacketKind::DialRsp(rsp) => {
                assert_eq!(rsp.error_class(), proto::DialErrorClass::Refused);
                assert_eq!(rsp.error, error);
            }
            other => panic!("not a DIAL_RSP: {other:?}"),
        },
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn dial_cls_cancels_a_pending_dial_and_no_answer_follows() {
    let mut t = table(true);
    let ticket = dial(&mut t, 7);
    assert_eq!(t.handle(Packet::close_dial(7)), Step::CancelDial(101));
    assert_eq!(t.dials_in_progress(), 0);
    // The dial connected anyway: its socket is dropped, unanswered.
    assert_eq!(t.dialed::<String>(ticket, Ok("late")), Dialed::Cancelled);
    assert!(t.is_empty());
}

#[test]
fn a_cancelled_dial_cannot_answer_for_a_new_one_with_its_id() {
    let mut t = table(true);
    let old = dial(&mut t, 7);
    t.handle(Packet::close_dial(7));
    let new = dial(&mut t, 7);
    assert_eq!(t.dialed::<String>(old, Ok("old socket")), Dialed::Cancelled);
    assert_eq!(t.dials_in_progress(), 1);
    let Dialed::Open { conn, .. } = t.dialed::<String>(new, Ok("new socket")) else {
        panic!("not open");
    };
    assert_eq!(t.conn(conn), Some(&"new socket"));
}

#[test]
fn dial_cls_for_no_pending_dial_is_ignored() {
    let mut t = table(true);
    assert!(matches!(t.handle(Packet::close_dial(5)), Step::Ignore(_)));
    // Nor does it touch a connection its dial opened.
    let conn = open(&mut t, 5, "a");
    assert!(matches!(t.handle(Packet::close_dial(5)), Step::Ignore(_)));
    assert_eq!(t.conn(conn), Some(&"a"));
}

#[test]
fn a_dial_id_already_pending_gets_its_own_error_and_the_first_dial_goes_on() {
    let mut t = table(true);
    let first = dial(&mut t, 7);
    match t.handle(dial_req(7)) {
        Step::Reply(reply) => {
            let (random, conn, error) = dial_rsp(&reply);
            assert_eq!((random, conn), (7, 0));
            assert!(error.contains("already in progress"), "{error}");
        }
        other => panic!("unexpected {other:?}"),
    }
    assert_eq!(t.dials_in_progress(), 1);
    assert!(matches!(
        t.dialed::<String>(first, Ok("a")),
        Dialed::Open { .. }
    ));
}

#[test]
fn data_reaches_its_own_connection() {
    let mut t = table(true);
    let a = open(&mut t, 1, "a");
    let b = open(&mut t, 2, "b");
    assert_eq!(
        t.handle(data(b.0, b"for b")),
        Step::Deliver {
            conn: b,
            data: Bytes::from_static(b"for b")
        }
    );
    assert_eq!(
        t.handle(data(a.0, b"for a")),
        Step::Deliver {
            conn: a,
            data: Bytes::from_static(b"for a")
        }
    );
}

#[test]
fn data_for_an_unknown_connection_is_answered_with_close_rsp() {
    let mut t = table(true);
    assert_eq!(
        close_rsp(t.handle(data(42, b"x"))),
        (42, "unrecognized connectID".into())
    );
    // A DATA without payload names connection 0, which never exists.
    let empty = Packet {
        r#type: proto::PacketType::Data as i32,
        payload: None,
    };
    assert_eq!(
        close_rsp(t.handle(empty)),
        (0, "unrecognized connectID".into())
    );
}

#[test]
fn close_req_takes_the_connection_out_and_hands_it_over() {
    let mut t = table(true);
    let a = open(&mut t, 1, "a");
    assert_eq!(
        t.handle(Packet::close_request(a.0)),
        Step::Close {
            conn: a,
            handle: "a"
        }
    );
    assert!(t.is_empty());
    // Its task ends later and finds it gone.
    assert_eq!(t.remove(a), None);
    // Bytes after the close are refused.
    assert_eq!(
        close_rsp(t.handle(data(a.0, b"late"))),
        (a.0, "unrecognized connectID".into())
    );
}

#[test]
fn close_req_for_an_unknown_connection_is_answered_at_once() {
    let mut t = table(true);
    assert_eq!(
        close_rsp(t.handle(Packet::close_request(3))),
        (3, "Unknown connectID".into())
    );
    // Twice for one connection: the second is unknown.
    let a = open(&mut t, 1, "a");
    assert!(matches!(
        t.handle(Packet::close_request(a.0)),
        Step::Close { .. }
    ));
    assert_eq!(
        close_rsp(t.handle(Packet::close_request(a.0))),
        (a.0, "Unknown connectID".into())
    );
}

#[test]
fn a_connection_that_ends_on_its_own_leaves_the_table_once() {
    let mut t = table(true);
    let a = open(&mut t, 1, "a");
    assert_eq!(t.remove(a), Some("a"));
    assert_eq!(t.remove(a), None);
    assert_eq!(
        close_rsp(t.handle(Packet::close_request(a.0))),
        (a.0, "Unknown connectID".into())
    );
}

#[test]
fn credit_is_granted_to_open_connections_with_flow_control_only() {
    let mut t = table(true);
    let a = open(&mut t, 1, "a");
    assert_eq!(
        t.handle(flow::credit_packet(a.0, 4096)),
        Step::Grant {
            conn: a,
            credit: 4096
        }
    );
    assert!(matches!(
        t.handle(flow::credit_packet(99, 4096)),
        Step::Ignore(_)
    ));
    // Without negotiation a credit packet means nothing.
    let mut plain = table(false);
    let b = open(&mut plain, 1, "b");
    assert!(matches!(
        plain.handle(flow::credit_packet(b.0, 4096)),
        Step::Ignore(_)
    ));
}

#[test]
fn packets_only_agents_send_are_ignored() {
    let mut t = table(true);
    let a = open(&mut t, 1, "a");
    for packet in [
        Packet::dial_response(1, 1, ""),
        Packet::close_response(a.0, ""),
        Packet::drain(),
        Packet {
            r#type: 99,
            payload: None,
        },
    ] {
        assert!(matches!(t.handle(packet), Step::Ignore(_)));
    }
    assert_eq!(t.conn(a), Some(&"a"));
}

#[test]
fn the_stream_ending_empties_the_table_and_later_dials_are_cancelled() {
    let mut t = table(true);
    let a = open(&mut t, 1, "a");
    let pending = dial(&mut t, 2);
    let (dials, conns) = t.stream_ended();
    assert_eq!((dials, conns), (vec![102], vec!["a"]));
    assert!(t.is_empty());
    assert_eq!(t.dials_in_progress(), 0);
    assert_eq!(t.dialed::<String>(pending, Ok("late")), Dialed::Cancelled);
    assert!(matches!(t.handle(dial_req(3)), Step::Ignore(_)));
    assert_eq!(t.remove(a), None);
    assert!(t.is_empty());
}

/// One event of a random interleaving.
#[derive(Clone, Debug)]
enum Event {
    /// DIAL_REQ with this random (from a small set, so they collide).
    DialReq(i64),
    /// One running dial task (picked by index) ends, connected or not.
    DialEnds(usize, bool),
    /// DIAL_CLS.
    DialCls(i64),
    /// DATA for this connection id (from a small set).
    Data(i64),
    /// CLOSE_REQ.
    CloseReq(i64),
    /// A credit packet.
    Credit(i64),
    /// The connection's task ends on its own.
    ConnEnds(i64),
}

fn event() -> impl Strategy<Value = Event> {
    prop_oneof![
        (0..6i64).prop_map(Event::DialReq),
        (any::<usize>(), any::<bool>()).prop_map(|(i, ok)| Event::DialEnds(i, ok)),
        (0..6i64).prop_map(Event::DialCls),
        (0..8i64).prop_map(Event::Data),
        (0..8i64).prop_map(Event::CloseReq),
        (0..8i64).prop_map(Event::Credit),
        (0..8i64).prop_map(Event::ConnEnds),
    ]
}

proptest! {
    /// Over any interleaving, checked against a model: no panic; every
    /// DIAL_REQ gets exactly one answer (DIAL_RSP, or the duplicate's
    /// error) unless DIAL_CLS or the stream's end cancelled it; DATA
    /// reaches only the connection it names; connection ids are never
    /// reused; once the stream ended and every task reported, the table is
    /// empty.
    #[test]
    fn any_interleaving_keeps_the_invariants(
        events in proptest::collection::vec(event(), 0..100),
        flow_control in any::<bool>(),
    ) {
        // Connection handles are unique numbers: which dial opened it.
        let mut t: StreamTable<u32, u64> = StreamTable::new(flow_control, || 0);
        let mut handles = 0u64;
        // Dial tasks still running, and which of them the table awaits.
        let mut running: Vec<DialTicket> = Vec::new();
        let mut live: HashMap<DialId, DialTicket> = HashMap::new();
        // Open connections in the model, with their handle.
        let mut conns: HashMap<ConnId, u64> = HashMap::new();
        let (mut started, mut answered, mut cancelled) = (0, 0, 0);
        let mut ids_seen = HashSet::new();
        for event in events {
            match event {
                Event::DialReq(r) => match t.handle(dial_req(r)) {
                    Step::Dial { ticket, .. } => {
                        prop_assert_eq!(ticket.dial, DialId(r));
                        prop_assert!(live.insert(DialId(r), ticket).is_none());
                        running.push(ticket);
                        started += 1;
                    }
                    Step::Reply(reply) => {
                        prop_assert!(live.contains_key(&DialId(r)), "refused a free id");
                        prop_assert_eq!(dial_rsp(&reply).0, r);
                    }
                    other => prop_assert!(false, "DIAL_REQ gave {:?}", other),
                },
                Event::DialEnds(i, ok) => {
                    if running.is_empty() {
                        continue;
                    }
                    let ticket = running.swap_remove(i % running.len());
                    let awaited = live.get(&ticket.dial) == Some(&ticket);
                    handles += 1;
                    let outcome = if ok { Ok(handles) } else { Err("refused".to_owned()) };
                    match t.dialed::<String>(ticket, outcome) {
                        Dialed::Open { conn, reply } => {
                            prop_assert!(awaited && ok);
                            prop_assert!(ids_seen.insert(conn), "id {} reused", conn.0);
                            prop_assert_eq!(dial_rsp(&reply), (ticket.dial.0, conn.0, String::new()));
                            conns.insert(conn, handles);
                            answered += 1;
                        }
                        Dialed::Failed { reply } => {
                            prop_assert!(awaited && !ok);
                            prop_assert_eq!(dial_rsp(&reply).0, ticket.dial.0);
                            answered += 1;
                        }
                        Dialed::Cancelled => prop_assert!(!awaited),
                    }
                    if awaited {
                        live.remove(&ticket.dial);
                    }
                }
                Event::DialCls(r) => match t.handle(Packet::close_dial(r)) {
                    Step::CancelDial(_) => {
                        prop_assert!(live.remove(&DialId(r)).is_some());
                        cancelled += 1;
                    }
                    step => {
                        prop_assert!(matches!(step, Step::Ignore(_)));
                        prop_assert!(!live.contains_key(&DialId(r)));
                    }
                },
                Event::Data(c) => match t.handle(data(c, b"bytes")) {
                    Step::Deliver { conn, data } => {
                        prop_assert_eq!(conn, ConnId(c));
                        prop_assert_eq!(&data[..], b"bytes");
                        // The connection it names, with the handle its dial gave.
                        prop_assert_eq!(t.conn(conn), conns.get(&conn));
                        prop_assert!(conns.contains_key(&conn));
                    }
                    step => {
                        prop_assert!(!conns.contains_key(&ConnId(c)));
                        prop_assert_eq!(close_rsp(step).0, c);
                    }
                },
                Event::CloseReq(c) => match t.handle(Packet::close_request(c)) {
                    Step::Close { conn, handle } => {
                        prop_assert_eq!(conn, ConnId(c));
                        prop_assert_eq!(conns.remove(&conn), Some(handle));
                    }
                    step => {
                        prop_assert!(!conns.contains_key(&ConnId(c)));
                        prop_assert_eq!(close_rsp(step).0, c);
                    }
                },
                Event::Credit(c) => {
                    let granted = matches!(t.handle(flow::credit_packet(c, 10)), Step::Grant { .. });
                    prop_assert_eq!(granted, flow_control && conns.contains_key(&ConnId(c)));
                }
                Event::ConnEnds(c) => {
                    prop_assert_eq!(t.remove(ConnId(c)), conns.remove(&ConnId(c)));
                }
            }
            t.check();
            prop_assert_eq!(t.dials_in_progress(), live.len());
            prop_assert_eq!(t.len(), conns.len());
        }
        // Each dial was answered once, cancelled, or is still awaited.
        prop_assert_eq!(started, answered + cancelled + live.len());
        // The stream ends: everything leaves; tasks reporting late are
        // cancelled.
        let (dials, ended) = t.stream_ended();
        prop_assert_eq!((dials.len(), ended.len()), (live.len(), conns.len()));
        for ticket in running {
            prop_assert_eq!(t.dialed::<String>(ticket, Ok(0)), Dialed::Cancelled);
        }
        t.check();
        prop_assert!(t.is_empty());
        prop_assert_eq!(t.dials_in_progress(), 0);
    }
}

/// A failed dial with a class, as the endpoint's errors have (the table
/// knows only the trait: the endpoint depends on it, not the reverse).
#[derive(Debug)]
struct Refused;

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("dial tcp 10.0.0.1:443: connect: connection refused")
    }
}

impl DialFailed for Refused {
    fn class(&self) -> proto::DialErrorClass {
        proto::DialErrorClass::Refused
    }
}
