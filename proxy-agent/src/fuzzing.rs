//! Fuzzing entry points (cargo-fuzz targets in `fuzz/`, and their corpora
//! replayed by the tests below). Not an API: compiled for tests and under
//! the `fuzzing` feature only, which no binary enables.
//!
//! Each function takes bytes a peer controls and panics when an invariant
//! the code promises does not hold (see `docs/fuzzing.md`).

use std::{
    collections::{HashMap, HashSet},
    time::{Duration, Instant},
};

use bytes::Bytes;
use edge::egress::{self, Proxy, ProxyError};
use prost::Message;
use proto::Packet;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tunnel::{
    flow::{self, Core, Offer, Peer, Scheme, Take, Window},
    ids::{ConnId, DialId},
};

use crate::table::{DialTicket, Dialed, Step, StreamTable};

include!("../../fuzz/input.rs");

/// The heap an [`agent_table`] run may use at its peak for `len` bytes.
pub fn agent_table_alloc_bound(len: usize) -> usize {
    1024 * len + 256 * 1024
}

/// A packet from the server: built from a few choices, or decoded from
/// raw protobuf bytes.
fn server_packet(input: &mut Input<'_>) -> Option<Packet> {
    let id = input.id();
    Some(match input.below(9) {
        0 | 1 => Packet::dial_request("tcp", "10.0.0.1:443", id),
        2 => Packet::data(id, Bytes::copy_from_slice(input.bytes(8))),
        3 => Packet::close_request(id),
        4 => Packet::close_dial(id),
        5 => flow::credit_packet(id, input.below(256) * 4096),
        6 => match input.below(3) {
            0 => Packet::dial_response(id, id, ""),
            1 => Packet::close_response(id, ""),
            _ => Packet::drain(),
        },
        _ => Packet::decode(input.bytes(48)).ok()?,
    })
}

/// The agent's connection table of one server stream fed a sequence of
/// events chosen by `data`: packets from the server (built, or decoded
/// from raw bytes), dials ending (with a live ticket or a stale one, in
/// success or failure), connections ending on their own, the stream's
/// end. After every event the table's own invariants hold
/// ([`StreamTable::check`]) and each step is what the protocol says: a dial
/// starts only for a free id and is answered at most once, with a
/// connection id never used before on the stream; DATA, CLOSE_REQ and
/// credit reach only open connections and the rest is answered or
/// ignored; a cancelled dial answers nothing. Once the stream ends,
/// everything is handed back and nothing new enters.
pub fn agent_table(data: &[u8]) {
    let mut input = Input(data);
    let flow_control = input.byte().is_multiple_of(2);
    let mut next_handle = 0u32;
    let mut t: StreamTable<u32, u32> = StreamTable::new(flow_control, move || {
        next_handle += 1;
        next_handle
    });
    let mut model = TableModel {
        flow_control,
        ..TableModel::default()
    };
    while !input.is_empty() {
        match input.below(8) {
            0..=3 => model.packet(&mut t, &mut input),
            4 | 5 => model.dialed(&mut t, &mut input),
            6 => {
                let conn = ConnId(input.id());
                let removed = t.remove(conn);
                assert_eq!(removed.is_some(), model.conns.remove(&conn));
            }
            _ => {
                if input.byte().is_multiple_of(4) {
                    model.stream_ended(&mut t);
                }
            }
        }
        t.check();
        assert_eq!(t.len(), model.conns.len());
        assert_eq!(t.dials_in_progress(), model.live.len());
    }
    model.stream_ended(&mut t);
    for ticket in model.stale {
        assert_eq!(t.dialed::<String>(ticket, Ok(0)), Dialed::Cancelled);
    }
    t.check();
    assert!(t.is_empty());
    assert_eq!(t.dials_in_progress(), 0);
}

/// What [`agent_table`] expects of the table: dials in progress, tickets
/// that ended, open connections.
#[derive(Default)]
struct TableModel {
    flow_control: bool,
    live: HashMap<DialId, DialTicket>,
    stale: Vec<DialTicket>,
    conns: HashSet<ConnId>,
    ids_seen: HashSet<ConnId>,
    ended: bool,
}

impl TableModel {
    /// A packet from the server, handled by the table.
    fn packet(&mut self, t: &mut StreamTable<u32, u32>, input: &mut Input<'_>) {
        let Some(packet) = server_packet(input) else {
            return;
        };
        let credit = flow::parse_credit(&packet);
        let kind = packet.clone().into_kind();
        let step = t.handle(packet);
        let Some((conn, amount)) = credit else {
            let Self {
                live,
                stale,
                conns,
                ended,
                ..
            } = self;
            return check_step(&kind, step, *ended, live, stale, conns);
        };
        match step {
            Step::Grant { conn: c, credit } => {
                assert!(self.flow_control && self.conns.contains(&c));
                assert_eq!((c.0, credit), (conn, amount));
            }
            Step::Ignore(_) => {
                assert!(!self.flow_control || !self.conns.contains(&ConnId(conn)));
            }
            other => panic!("credit gave {other:?}"),
        }
    }

    /// A dial's outcome, for a ticket in progress or one that ended.
    fn dialed(&mut self, t: &mut StreamTable<u32, u32>, input: &mut Input<'_>) {
        let ticket = if input.byte().is_multiple_of(2) {
            let mut tickets: Vec<DialTicket> = self.live.values().copied().collect();
            tickets.sort_by_key(|t| t.dial);
            (!tickets.is_empty()).then(|| tickets[input.below(tickets.len())])
        } else {
            (!self.stale.is_empty()).then(|| self.stale[input.below(self.stale.len())])
        };
        let Some(ticket) = ticket else { return };
        let ok = !input.byte().is_multiple_of(3);
        let was_live = self.live.get(&ticket.dial) == Some(&ticket);
        let outcome = if ok { Ok(7u32) } else { Err("refused") };
        match t.dialed(ticket, outcome) {
            Dialed::Open { conn, reply } => {
                assert!(was_live && ok, "a dial not in progress opened");
                assert!(self.ids_seen.insert(conn), "connection id {conn:?} reused");
                assert!(self.conns.insert(conn));
                assert_eq!(
                    reply,
                    Packet::dial_response(ticket.dial.0, conn.0, ""),
                    "the DIAL_RSP"
                );
                self.live.remove(&ticket.dial);
                self.stale.push(ticket);
            }
            Dialed::Failed { reply } => {
                assert!(was_live && !ok, "a dial not in progress failed");
                assert_eq!(reply, Packet::dial_response(ticket.dial.0, 0, "refused"));
                self.live.remove(&ticket.dial);
                self.stale.push(ticket);
            }
            Dialed::Cancelled => assert!(!was_live, "a dial in progress was cancelled"),
        }
    }

    /// The stream ends: every dial and connection is handed back.
    fn stream_ended(&mut self, t: &mut StreamTable<u32, u32>) {
        let (dials, open) = t.stream_ended();
        assert_eq!(
            (dials.len(), open.len()),
            (self.live.len(), self.conns.len())
        );
        self.stale.extend(self.live.drain().map(|(_, t)| t));
        self.conns.clear();
        self.ended = true;
    }
}

/// What a packet other than credit must have done to the table.
fn check_step(
    kind: &proto::packet::PacketKind,
    step: Step<u32, u32>,
    ended: bool,
    live: &mut HashMap<DialId, DialTicket>,
    stale: &mut Vec<DialTicket>,
    conns: &mut HashSet<ConnId>,
) {
    use proto::packet::PacketKind as K;
    match (kind, step) {
        (K::DialReq(req), Step::Dial { ticket, .. }) => {
            assert!(!ended, "a dial after the stream ended");
            assert_eq!(ticket.dial, DialId(req.random));
            assert!(
                live.insert(ticket.dial, ticket).is_none(),
                "a dial id dialed twice"
            );
        }
        (K::DialReq(req), Step::Reply(reply)) => {
            assert!(
                live.contains_key(&DialId(req.random)),
                "a free dial id refused"
            );
            match reply.into_kind() {
                K::DialRsp(rsp) => assert_eq!((rsp.random, rsp.connect_id), (req.random, 0)),
                other => panic!("DIAL_REQ answered with {other:?}"),
            }
        }
        (K::DialReq(_), Step::Ignore(_)) => assert!(ended),
        (K::Data(d), Step::Deliver { conn, data }) => {
            assert_eq!(conn, ConnId(d.connect_id));
            assert_eq!(data, d.data);
            assert!(
                conns.contains(&conn),
                "DATA delivered to a closed connection"
            );
        }
        (K::Data(d), Step::Reply(reply)) => refused(d.connect_id, reply, conns),
        (K::CloseReq(r), Step::Reply(reply)) => refused(r.connect_id, reply, conns),
        (K::CloseReq(r), Step::Close { conn, .. }) => {
            assert_eq!(conn, ConnId(r.connect_id));
            assert!(conns.remove(&conn), "a connection closed twice");
        }
        (K::DialCls(c), Step::CancelDial(_)) => {
            let ticket = live.remove(&DialId(c.random)).expect("cancelled no dial");
            stale.push(ticket);
        }
        (K::DialCls(c), Step::Ignore(_)) => {
            assert!(
                !live.contains_key(&DialId(c.random)),
                "a pending dial not cancelled"
            );
        }
        (K::DialRsp(_) | K::CloseRsp(_) | K::Drain | K::Unknown(_), Step::Ignore(_)) => {}
        (kind, step) => panic!("{kind:?} gave {step:?}"),
    }
}

/// A DATA or CLOSE_REQ for connection `id` was answered with `reply`: it
/// must be a CLOSE_RSP for a connection that is not open.
fn refused(id: i64, reply: Packet, conns: &HashSet<ConnId>) {
    assert!(!conns.contains(&ConnId(id)), "an open connection refused");
    match reply.into_kind() {
        proto::packet::PacketKind::CloseRsp(rsp) => assert_eq!(rsp.connect_id, id),
        other => panic!("answered with {other:?}"),
    }
}

/// The heap a [`flow_control`] run may use at its peak for `len` bytes.
pub fn flow_control_alloc_bound(len: usize) -> usize {
    64 * len + 64 * 1024
}

/// A metadata value from `input`: absent, the expected text, digits, or
/// any bytes.
fn header_value(input: &mut Input<'_>, expected: &'static str) -> Option<String> {
    match input.below(5) {
        0 => None,
        1 => Some(expected.to_owned()),
        2 => Some(format!("{}", u64::from_le_bytes(pad(input.bytes(8))))),
        3 => Some(format!(" {} ", input.below(64) * 16 * 1024)),
        _ => Some(String::from_utf8_lossy(input.bytes(80)).into_owned()),
    }
}

fn pad(bytes: &[u8]) -> [u8; 8] {
    let mut out = [0u8; 8];
    out[..bytes.len().min(8)].copy_from_slice(&bytes[..bytes.len().min(8)]);
    out
}

/// The flow-control metadata a peer announces on `Connect` (the three
/// headers, any text), read by [`Window::announced`] and negotiated, then
/// one connection's flow state ([`Core`]) driven by DATA offered and
/// drained, credit taken, and credit packets (built, or decoded from raw
/// bytes) read by [`flow::parse_credit`] and granted. Checks: an
/// announcement is a window in range or an error naming its key, with at
/// most a bounded prefix of the value; a credit packet is recognised by
/// its type only and round-trips; a peer's credit never grows the window
/// (credit plus what is in flight is always the peer's window); a DATA
/// packet is admitted only within the window (or into an empty queue),
/// and past it is an overflow with credit, a wait without.
pub fn flow_control(data: &[u8]) {
    let mut input = Input(data);
    let peer = announced_peer(&mut input);
    let scheme = negotiated(&mut input, peer);
    let mut model = FlowModel {
        core: Core::new(scheme),
        scheme,
        now: Instant::now(),
        queued: 0,
        spent: 0,
        closed: false,
    };
    while !input.is_empty() {
        model.step(&mut input);
        model.check();
    }
}

/// The three flow-control headers drawn from `input`, read as
/// [`Window::announced`] reads them; an error leaves a peer without credit.
fn announced_peer(input: &mut Input<'_>) -> Peer {
    let headers = [
        (flow::HEADER, header_value(input, flow::VERSION)),
        (flow::WINDOW_HEADER, header_value(input, "1048576")),
        (flow::CHUNK_HEADER, header_value(input, "262144")),
    ];
    let get = |key: &'static str| {
        headers
            .iter()
            .find(|(k, _)| *k == key)
            .and_then(|(_, v)| v.as_deref())
    };
    match Window::announced(get) {
        Ok(peer) => {
            match peer {
                Peer::NoCredit => assert_ne!(get(flow::HEADER), Some(flow::VERSION)),
                Peer::V1 => assert!(get(flow::WINDOW_HEADER).is_none()),
                Peer::V2(w) => assert_eq!(Window::new(w.bytes, w.max_chunk), Ok(w)),
            }
            peer
        }
        Err(error) => {
            assert_eq!(get(flow::HEADER), Some(flow::VERSION));
            let text = error.to_string();
            assert!(text.len() <= 512, "an error of {} bytes", text.len());
            Peer::NoCredit
        }
    }
}

/// Our window, whether credit is offered and the version pinned, drawn
/// from `input`, negotiated with `peer`.
fn negotiated(input: &mut Input<'_>, peer: Peer) -> Scheme {
    let ours = match input.below(3) {
        0 => Window::V1,
        1 => Window::new(flow::MIN_WINDOW, flow::MIN_CHUNK).expect("in range"),
        _ => Window::new(flow::MAX_WINDOW, flow::MAX_CHUNK_LIMIT).expect("in range"),
    };
    // One byte draws both whether credit was offered and the version.
    let byte = input.byte();
    let version = if byte & 4 == 0 {
        flow::Version::V2
    } else {
        flow::Version::V1
    };
    let scheme = Scheme::negotiate(!byte.is_multiple_of(4), version, ours, peer);
    if version == flow::Version::V1 {
        assert_eq!(
            scheme.ours(),
            Window::V1,
            "a side pinned to v1 kept its own window"
        );
    }
    scheme
}

/// One connection's flow state and what [`flow_control`] expects of it:
/// cost queued, credit in flight, whether closed.
struct FlowModel {
    core: Core,
    scheme: Scheme,
    now: Instant,
    queued: usize,
    spent: usize,
    closed: bool,
}

impl FlowModel {
    /// One event drawn from `input`.
    fn step(&mut self, input: &mut Input<'_>) {
        let cost = match input.below(4) {
            0 => flow::PACKET_OVERHEAD,
            1 => input.below(256) * 1024,
            2 => flow::cost(usize::from(input.byte()) << 12),
            _ => usize::from(input.byte()) << 20,
        };
        match input.below(7) {
            0 => self.offer(cost),
            1 => {
                let grant = self.core.drained(cost, self.now);
                self.queued = self.queued.saturating_sub(cost);
                if let Some(grant) = grant {
                    assert!(self.scheme.is_credit() && !self.closed && grant > 0);
                }
            }
            2 => self.take(cost),
            3 | 4 => self.credit_packet(cost, input),
            5 => {
                self.now += Duration::from_millis(u64::from(input.byte()) * 100);
            }
            _ => {
                if input.byte().is_multiple_of(8) {
                    self.core.close();
                    self.closed = true;
                }
            }
        }
    }

    /// DATA of `cost` offered: admitted only within the window.
    fn offer(&mut self, cost: usize) {
        let (before, closed) = (self.queued, self.closed);
        let offer = self.core.offer(cost, self.now);
        let window = self.scheme.ours().bytes;
        let fits = before == 0 || before.saturating_add(cost) <= window;
        match offer {
            Offer::Admitted => {
                assert!(!closed && fits, "admitted past the window");
                self.queued += cost;
            }
            Offer::Overflow => assert!(!closed && !fits),
            Offer::Wait(until) => {
                assert!(!closed && !fits && !self.scheme.is_credit());
                assert!(until > self.now && until <= self.now + flow::COMPAT_STALL);
            }
            Offer::Closed => assert!(closed),
        }
    }

    /// Credit for `cost` taken before sending.
    fn take(&mut self, cost: usize) {
        let taken = self.core.take(cost);
        match (self.scheme, taken) {
            (_, Take::Closed) => assert!(self.closed),
            (Scheme::Compat { .. }, t) => assert!(t == Take::Taken && !self.closed),
            (Scheme::Credit { theirs, .. }, Take::Taken) => {
                assert!(!self.closed);
                self.spent += cost.min(theirs.bytes);
            }
            (Scheme::Credit { theirs, .. }, Take::Wait) => {
                assert!(self.core.credit() < cost.min(theirs.bytes));
            }
        }
    }

    /// A credit packet, built for `cost` or decoded from raw bytes, read
    /// and granted.
    fn credit_packet(&mut self, cost: usize, input: &mut Input<'_>) {
        let packet = if input.byte().is_multiple_of(2) {
            let id = input.id();
            let packet = flow::credit_packet(id, cost);
            let want = (id, cost.min(u32::MAX as usize));
            assert_eq!(flow::parse_credit(&packet), Some(want));
            packet
        } else {
            match Packet::decode(input.bytes(24)) {
                Ok(packet) => packet,
                Err(_) => return,
            }
        };
        if let Some((_, credit)) = flow::parse_credit(&packet) {
            assert_eq!(packet.r#type, flow::CREDIT_TYPE);
            let returned = credit.min(self.spent);
            assert_eq!(self.core.grant(credit), returned > 0);
            self.spent -= returned;
        } else {
            assert!(packet.r#type != flow::CREDIT_TYPE || !is_credit_shaped(&packet));
        }
    }

    /// The flow state agrees with the model.
    fn check(&self) {
        assert_eq!(self.core.queued(), self.queued, "queued cost");
        assert_eq!(self.core.is_closed(), self.closed);
        match self.scheme {
            Scheme::Credit { theirs, .. } => {
                assert_eq!(
                    self.core.credit() + self.spent,
                    theirs.bytes,
                    "the window grew or shrank"
                );
                let chunk = self.core.send_chunk();
                assert!(chunk >= 1 && chunk <= theirs.max_chunk);
            }
            Scheme::Compat { .. } => assert_eq!(self.core.send_chunk(), flow::MAX_CHUNK),
        }
    }
}

/// Whether a packet is a DATA payload of exactly four bytes.
fn is_credit_shaped(packet: &Packet) -> bool {
    matches!(&packet.payload, Some(proto::Payload::Data(d)) if d.data.len() == 4)
}

/// The heap a [`proxy_reply`] run may use at its peak for `len` bytes:
/// hyper's and tokio-socks's buffers and a runtime.
pub fn proxy_reply_alloc_bound(len: usize) -> usize {
    64 * len + 2 * 1024 * 1024
}

/// The password of the fuzzed proxies: no error may show it.
const PASSWORD: &str = "pr0xy-s3cr3t";

/// What the fuzzed proxies send once their reply is read: the
/// destination's first bytes, which must reach the agent after whatever
/// followed the reply.
const LATER: &[u8] = b"\0the destination speaks\r\n\r\n\xff";

/// A SOCKS5 or HTTP CONNECT proxy (which, with or without credentials,
/// chosen by the first byte) answering the agent's request with the rest
/// of the bytes, then, a second later, [`LATER`], then closing: the
/// agent's proxy client ([`egress::handshake`], tokio-socks and hyper
/// underneath) runs against it over an in-memory pipe, and reads what a
/// tunnel it got carries to its end. Checks: it ends (a reply cut short
/// is an error, not a wait); a tunnel only on a reply that grants one from
/// its first byte on, as [`http_grant`] and [`socks5_grant`] read it by
/// hand (a well-formed 2xx status line after interim 1xx answers; a
/// SOCKS5 method we offered, the credentials accepted if asked for, a
/// success reply with a well-formed bound address); what the tunnel
/// carries is exactly the bytes after that reply, then [`LATER`]; every
/// SOCKS5 grant gives a tunnel; an error names the proxy and never shows
/// the password. Whether a tunnel opened.
pub fn proxy_reply(data: &[u8]) -> bool {
    let mut input = Input(data);
    let choice = input.byte();
    let auth = (choice & 1 == 1).then(|| ("ops".to_owned(), PASSWORD.to_owned()));
    let (kind, host) = match (choice >> 1) % 3 {
        0 => (egress::ProxyKind::Http, "proxy-server.example"),
        1 => (
            egress::ProxyKind::Socks5 { remote_dns: true },
            "proxy-server.example",
        ),
        _ => (egress::ProxyKind::Socks5 { remote_dns: false }, "10.0.0.1"),
    };
    let proxy = Proxy {
        kind,
        host: "proxy.corp".to_owned(),
        port: 3128,
        auth,
    };
    let reply = input.0;
    let result = handshake_against(&proxy, host, reply.to_vec());
    if std::env::var_os("FUZZ_DEBUG").is_some() {
        eprintln!("{result:?}");
    }
    // The client sees one stream: a reply cut short may be completed by
    // what the proxy sends next.
    let sent = [reply, LATER].concat();
    let granted = match kind {
        egress::ProxyKind::Http => http_grant(&sent),
        egress::ProxyKind::Socks5 { .. } => socks5_grant(&sent, proxy.auth.is_some()),
    };
    match result {
        Ok(carried) => {
            let Some(end) = granted else {
                panic!("a tunnel on a reply that does not grant one");
            };
            assert!(
                carried == sent[end..],
                "the tunnel carried {} bytes ({:?}…), the proxy sent {} after its {end}-byte reply",
                carried.len(),
                String::from_utf8_lossy(&carried[..carried.len().min(32)]),
                sent.len() - end
            );
            true
        }
        Err(error) => {
            let shown = format!("{error} {error:?}");
            assert!(!shown.contains(PASSWORD), "the password shown: {shown}");
            assert!(
                shown.contains("proxy.corp:3128"),
                "the proxy not named: {shown}"
            );
            if let ProxyError::TargetRefused { reason, .. } = &error {
                assert!(reason.len() <= 4096, "a reason of {} bytes", reason.len());
            }
            if proxy.kind != egress::ProxyKind::Http {
                assert!(granted.is_none(), "a SOCKS5 grant refused: {shown}");
            }
            false
        }
    }
}

/// The line of `bytes` at `at` (without its LF, nor a CR before it) and
/// where the next begins; `None` before its LF.
fn line_at(bytes: &[u8], at: usize) -> Option<(&[u8], usize)> {
    let len = bytes.get(at..)?.iter().position(|b| *b == b'\n')?;
    let line = &bytes[at..at + len];
    Some((line.strip_suffix(b"\r").unwrap_or(line), at + len + 1))
}

/// Where an HTTP proxy's reply to CONNECT ends, if it grants the tunnel,
/// read by hand (RFC 9112 §2.2, §4, RFC 9110 §15.2, §9.3.6): heads, each
/// a status line `HTTP/1.0` or `HTTP/1.1`, SP, three digits, then SP and
/// a reason or the line end, then header lines up to an empty line; lines
/// end with LF or CRLF, and empty lines before a status line are skipped
/// (as httparse does); interim answers (1xx but 101) come before the
/// final one, which grants the tunnel if it is 2xx. It does not judge the
/// header lines (hyper does): it says where the reply ends and whether
/// its final status grants the tunnel.
fn http_grant(reply: &[u8]) -> Option<usize> {
    let mut at = 0;
    loop {
        let (line, next) = line_at(reply, at)?;
        at = next;
        if line.is_empty() {
            continue;
        }
        let status = line
            .strip_prefix(b"HTTP/1.1 ")
            .or_else(|| line.strip_prefix(b"HTTP/1.0 "))?;
        let code = match status {
            [a, b, c] | [a, b, c, b' ', ..] if [a, b, c].iter().all(|d| d.is_ascii_digit()) => {
                [a, b, c]
                    .iter()
                    .fold(0u16, |n, d| n * 10 + u16::from(**d - b'0'))
            }
            _ => return None,
        };
        loop {
            let (header, next) = line_at(reply, at)?;
            at = next;
            if header.is_empty() {
                break;
            }
        }
        match code {
            100 | 102..=199 => {}
            200..=299 => return Some(at),
            _ => return None,
        }
    }
}

/// Where a SOCKS5 proxy's replies end, if they grant the tunnel, read by
/// hand (RFC 1928 §3, §6, RFC 1929 §2): the method chosen, no
/// authentication, or username and password if we offered them (`auth`),
/// and then their status 0 (version 1); then a reply of version 5, code
/// 0 (succeeded), reserved 0 and a bound address: IPv4, IPv6, or a domain
/// name (as text: UTF-8), and a port.
fn socks5_grant(reply: &[u8], auth: bool) -> Option<usize> {
    let at = match reply.get(..2)? {
        [5, 0] => 2,
        [5, 2] if auth => match reply.get(2..4)? {
            [1, 0] => 4,
            _ => return None,
        },
        _ => return None,
    };
    let [5, 0, 0, kind] = *reply.get(at..at + 4)? else {
        return None;
    };
    let address = match kind {
        1 => 4,
        4 => 16,
        3 => {
            let len = usize::from(*reply.get(at + 4)?);
            std::str::from_utf8(reply.get(at + 5..at + 5 + len)?).ok()?;
            1 + len
        }
        _ => return None,
    };
    let end = at + 4 + address + 2;
    (end <= reply.len()).then_some(end)
}

/// The agent's proxy client asking `proxy` for a tunnel to `host`, over
/// an in-memory pipe to a proxy that answers `reply`, a second later sends
/// [`LATER`], then closes; on success, what the tunnel carried to its end.
fn handshake_against(proxy: &Proxy, host: &str, reply: Vec<u8>) -> Result<Vec<u8>, ProxyError> {
    // A paused clock moves only when every task waits: the proxy sends on
    // and closes its side once the client can make no progress with what
    // it has (a real proxy would keep a granted tunnel open; one that
    // closes at once makes hyper cancel the upgrade).
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .expect("a current-thread runtime");
    runtime.block_on(async {
        let (client, mut server) = tokio::io::duplex(64 * 1024);
        let is_http = proxy.kind == egress::ProxyKind::Http;
        let peer = tokio::spawn(async move {
            // An HTTP proxy answers the request (hyper refuses a reply
            // before it); a SOCKS5 client reads each reply in turn.
            let mut request = Vec::new();
            let mut chunk = [0u8; 1024];
            while is_http && !request.windows(4).any(|w| w == b"\r\n\r\n") {
                match server.read(&mut chunk).await {
                    Ok(n) if n > 0 => request.extend_from_slice(&chunk[..n]),
                    _ => break,
                }
            }
            let _ = server.write_all(&reply).await;
            tokio::time::sleep(Duration::from_secs(1)).await;
            let _ = server.write_all(LATER).await;
            let _ = server.shutdown().await;
            let mut sink = [0u8; 1024];
            while matches!(server.read(&mut sink).await, Ok(n) if n > 0) {}
        });
        let result = match egress::handshake(client, proxy, host, 8132).await {
            Ok(mut tunnel) => {
                let mut carried = Vec::new();
                match tunnel.read_to_end(&mut carried).await {
                    Ok(_) => Ok(carried),
                    Err(e) => panic!("a tunnel failed after {} bytes: {e}", carried.len()),
                }
            }
            Err(error) => Err(error),
        };
        drop(peer);
        result
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    include!("../../fuzz/replay.rs");

    replay!(
        fuzz_corpus_agent_table => agent_table within agent_table_alloc_bound,
        fuzz_corpus_flow_control => flow_control within flow_control_alloc_bound,
        fuzz_corpus_proxy_reply => proxy_reply within proxy_reply_alloc_bound
            reaching |tunnel: &bool| *tunnel,
    );

    /// The harness reaches success: a proxy that grants the tunnel.
    #[test]
    fn proxy_reply_reaches_a_tunnel() {
        let mut http = vec![0u8];
        http.extend_from_slice(b"HTTP/1.1 200 Connection established\r\n\r\n");
        assert!(proxy_reply(&http));
        http[0] = 1;
        assert!(proxy_reply(&http), "with credentials");
        http[10] = b'4';
        assert!(!proxy_reply(&http), "HTTP 400");
        // SOCKS5 (socks5h, no auth): method "none", then success with a
        // bound IPv4 address.
        let socks = [2u8, 5, 0, 5, 0, 0, 1, 127, 0, 0, 1, 0x1f, 0x90];
        assert!(proxy_reply(&socks));
        // Cut short, even with what the proxy sends next: an error.
        assert!(!proxy_reply(&[2, 5, 0, 5, 0, 0, 3, 255, b'h']), "cut short");
        // Bytes after the reply reach the tunnel (checked inside).
        let mut early = socks.to_vec();
        early.extend_from_slice(b"early");
        assert!(proxy_reply(&early));
        http[10] = b'2';
        http.extend_from_slice(b"\x16\x03\x01");
        assert!(proxy_reply(&http));
    }
}
