//! The `grpc_packets` target's server half: a frontend's gRPC request body
//! through the server's own handling, not only our codec: a real `Proxy`
//! stream (its driver, its read-ahead), a real agent stream (its driver,
//! its connection table) and the control core between them, over
//! in-memory streams on a paused clock.

use std::{
    collections::{HashMap, HashSet},
    sync::{Arc, Mutex},
    time::Duration,
};

use bytes::{BufMut, Bytes, BytesMut};
use futures_util::StreamExt;
use http_body::Frame;
use http_body_util::StreamBody;
use prost::Message;
use proto::{
    Packet, agent_service_server::AgentService, packet::PacketKind,
    proxy_service_server::ProxyService,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::{sync::CancellationToken, task::TaskTracker};
use tonic::{Request, Status, Streaming, codec::Codec};
use tunnel::{flow::Version, ids::ServerId};

use crate::{
    backend::AgentServiceImpl,
    control::{Budgets, Control},
    frontend::grpc::ProxyServiceImpl,
    metrics::ServerMetrics,
    router::DialPolicy,
    server::MAX_FRONTEND_MESSAGE,
    strategy::ProxyStrategy,
};

/// The heap a [`grpc_packets`] run may use at its peak for `len` input
/// bytes: a message whose header claims the limit (tonic reserves it), a
/// server's tables, metrics and runtime, and a few copies of the input
/// (the packets in flight, echoed and recorded).
pub fn grpc_packets_alloc_bound(len: usize) -> usize {
    MAX_FRONTEND_MESSAGE + 64 * len + 4 * 1024 * 1024
}

/// A stream's body, fed by the harness.
type Body = StreamBody<
    futures_util::stream::Map<ReceiverStream<Bytes>, fn(Bytes) -> Result<Frame<Bytes>, Status>>,
>;

/// An in-memory request body and the sender that feeds it.
pub(crate) fn body() -> (mpsc::Sender<Bytes>, Body) {
    let (tx, rx) = mpsc::channel(4096);
    let frames: fn(Bytes) -> Result<Frame<Bytes>, Status> = |b| Ok(Frame::data(b));
    (tx, StreamBody::new(ReceiverStream::new(rx).map(frames)))
}

/// `body` as a server reads a request: our codec, the frontend's limit.
pub(crate) fn streaming(body: Body) -> Streaming<Packet> {
    let decoder = proto::codec::PacketCodec::<Packet, Packet>::default().decoder();
    Streaming::new_request(decoder, body, None, Some(MAX_FRONTEND_MESSAGE))
}

/// `packet` as one gRPC message.
fn message(packet: &Packet) -> Bytes {
    let mut out = BytesMut::new();
    out.put_u8(0);
    out.put_u32(u32::try_from(packet.encoded_len()).unwrap_or(u32::MAX));
    packet.encode(&mut out).unwrap_or_default();
    out.freeze()
}

/// The gRPC messages of a request body: each message's bytes (its 5-byte
/// header and payload; a cut one last), and its payload when whole and
/// uncompressed.
fn messages(mut data: &[u8]) -> Vec<(&[u8], Option<&[u8]>)> {
    let mut out = Vec::new();
    while !data.is_empty() {
        let whole = match data {
            [flag, a, b, c, d, rest @ ..] => {
                let len = u32::from_be_bytes([*a, *b, *c, *d]) as usize;
                (len <= rest.len()).then_some((*flag, len))
            }
            _ => None,
        };
        let Some((flag, len)) = whole else {
            out.push((data, None));
            break;
        };
        let (one, rest) = data.split_at(5 + len);
        out.push((one, (flag == 0).then(|| &one[5..])));
        data = rest;
    }
    out
}

/// The packets the frontend and the agent received, in order.
#[derive(Default)]
struct Received {
    /// By the frontend, from its `Proxy` stream.
    frontend: Vec<Packet>,
    /// Whether the frontend's stream ended (and how).
    frontend_end: Option<Result<(), Status>>,
    /// By the agent: each DIAL_REQ's random and address.
    dials: Vec<(i64, String)>,
    /// Whether the agent's stream ended.
    agent_end: bool,
}

/// What a [`grpc_packets`] run reached, for the tests that show the
/// harness goes where it claims.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Reached {
    /// Connections the frontend was given.
    pub established: usize,
    /// Dials answered with an error.
    pub refused: usize,
    /// Bytes that came back to the frontend.
    pub echoed: usize,
    /// Connections closed under the frontend (CLOSE_RSP of one it had).
    pub closed: usize,
    /// Whether the frontend was answered MISMATCHED.
    pub mismatched: bool,
}

/// What the frontend knows, as a client would: the dials it made, the
/// connections it was given, the bytes it sent and got on each.
#[derive(Default)]
struct Frontend {
    /// What it saw happen.
    reached: Reached,
    /// DIAL_REQs sent, by random, with their address.
    requests: HashMap<i64, (usize, HashSet<String>)>,
    /// Answers (DIAL_RSP, DIAL_CLS) received, by random.
    answers: HashMap<i64, usize>,
    /// DIAL_CLS sent, by random.
    cancels: HashMap<i64, usize>,
    /// Open connections: the bytes sent on each since its DIAL_RSP, and
    /// those received.
    open: HashMap<i64, (Vec<u8>, Vec<u8>)>,
    /// Packets of `Received::frontend` looked at.
    seen: usize,
    /// Answered MISMATCHED: the server ignores it from then on.
    failed: bool,
}

impl Frontend {
    /// A packet the frontend sends (as it reads it: plain prost).
    fn sends(&mut self, packet: &Packet) {
        match packet.clone().into_kind() {
            PacketKind::DialReq(r) if !self.failed => {
                let (n, addresses) = self.requests.entry(r.random).or_default();
                *n += 1;
                addresses.insert(r.address);
            }
            PacketKind::DialCls(c) => *self.cancels.entry(c.random).or_default() += 1,
            PacketKind::Data(d) if packet.r#type == proto::PacketType::Data as i32 => {
                if let Some((sent, _)) = self.open.get_mut(&d.connect_id) {
                    sent.extend_from_slice(&d.data);
                }
            }
            _ => {}
        }
    }

    /// What the frontend received since last looked at: each packet one
    /// the protocol allows it.
    fn receives(&mut self, packets: &[Packet]) {
        for packet in &packets[self.seen..] {
            match packet.clone().into_kind() {
                PacketKind::DialRsp(r) => {
                    self.answered(r.random);
                    if !r.error.is_empty() {
                        self.reached.refused += 1;
                    } else {
                        self.reached.established += 1;
                        assert!(
                            self.open
                                .insert(r.connect_id, (Vec::new(), Vec::new()))
                                .is_none(),
                            "conn {} given twice",
                            r.connect_id
                        );
                    }
                }
                PacketKind::DialCls(c) => self.answered(c.random),
                PacketKind::Data(d) => {
                    let (sent, got) = self
                        .open
                        .get_mut(&d.connect_id)
                        .unwrap_or_else(|| panic!("DATA on conn {}, not open", d.connect_id));
                    got.extend_from_slice(&d.data);
                    self.reached.echoed += d.data.len();
                    assert!(
                        sent.starts_with(got),
                        "conn {}: got back {got:?}, sent {sent:?}",
                        d.connect_id
                    );
                }
                PacketKind::CloseRsp(c) => {
                    if c.error == crate::MISMATCHED {
                        self.failed = true;
                        self.reached.mismatched = true;
                    }
                    if let Some((sent, got)) = self.open.remove(&c.connect_id) {
                        self.reached.closed += 1;
                        assert!(sent.starts_with(&got), "conn {}", c.connect_id);
                    }
                }
                other => panic!("the frontend was sent {other:?}"),
            }
        }
        self.seen = packets.len();
    }

    fn answered(&mut self, random: i64) {
        let answers = self.answers.entry(random).or_default();
        *answers += 1;
        let made = self.requests.get(&random).map_or(0, |(n, _)| *n);
        assert!(
            *answers <= made,
            "dial {random} answered {answers} times, made {made}"
        );
    }

    /// Once the server is idle: every dial answered (the agent answers
    /// each at once) unless cancelled, every open connection's bytes all
    /// back (the agent echoes them).
    fn settled(&self) {
        if !self.failed {
            for (random, (made, _)) in &self.requests {
                let answered = self.answers.get(random).copied().unwrap_or(0);
                let cancelled = self.cancels.get(random).copied().unwrap_or(0);
                assert!(
                    answered + cancelled >= *made,
                    "dial {random}: {made} made, {answered} answered, {cancelled} cancelled"
                );
            }
        }
        for (conn, (sent, got)) in &self.open {
            assert_eq!(got, sent, "conn {conn}: not all its bytes came back");
        }
    }
}

/// Runs the tasks until every one waits (the clock is paused: it moves
/// only once nothing else can run).
async fn idle() {
    tokio::time::sleep(Duration::from_millis(1)).await;
}

/// A frontend's gRPC request body (`data`: length-prefixed messages, as
/// h2 hands them to tonic) read by a real `Proxy` stream of a server with
/// one agent stream, message by message, each after the server has done
/// all it could with the one before. The agent is a harness: it answers a
/// DIAL_REQ at once (refused when its random is 2 modulo 3, else
/// established with a connection id of its own: 1, 2, …), echoes DATA
/// (and closes the connection itself after DATA starting with `!`),
/// answers CLOSE_REQ.
///
/// Checks, each time the server is idle: the frontend was sent only what
/// the protocol allows it (an answer per DIAL_REQ at most, DATA only on a
/// connection it was given and still has, a connection given once); every
/// DIAL_REQ was answered unless the frontend cancelled it or broke the
/// protocol, and none is pending in the server; every open connection's
/// bytes came back whole and in order through both drivers (a closed one's
/// a prefix); the agent was sent only DIAL_REQs the frontend made, with
/// their address. At the end (the frontend's stream ends, then the
/// agent's), both streams end and the server holds nothing.
pub fn grpc_packets(data: &[u8]) -> Reached {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .expect("a runtime");
    runtime.block_on(session(data))
}

/// [`grpc_packets`] on the runtime: the server's control core, an agent
/// stream, then the frontend's `Proxy` stream and its messages.
async fn session(data: &[u8]) -> Reached {
    let control = control();
    let (tasks, shutdown) = (TaskTracker::new(), CancellationToken::new());
    let received = Arc::new(Mutex::new(Received::default()));
    let agent_tx = agent(&control, &tasks, &shutdown, &received).await;
    let frontend_tx = proxy_stream(&control, &tasks, &shutdown, &received).await;
    let mut frontend = Frontend::default();
    let messages = messages(data);
    let packets: Vec<Option<Packet>> = messages
        .iter()
        .map(|(_, payload)| payload.and_then(|p| Packet::decode(p).ok()))
        .collect();
    let is_data = |p: Option<&Option<Packet>>| {
        p.and_then(Option::as_ref)
            .is_some_and(|p| p.r#type == proto::PacketType::Data as i32)
    };
    for (at, (bytes, _)) in messages.iter().enumerate() {
        let packet = &packets[at];
        if let Some(packet) = packet {
            frontend.sends(packet);
        }
        if frontend_tx
            .send(Bytes::copy_from_slice(bytes))
            .await
            .is_err()
        {
            break;
        }
        if is_data(Some(packet)) && is_data(packets.get(at + 1)) {
            // DATA after DATA comes at once, as a frontend streams it: it
            // meets the uploads still waiting for the agent (its lanes).
            continue;
        }
        idle().await;
        let got = received.lock().expect("not poisoned");
        frontend.receives(&got.frontend);
        for (random, address) in &got.dials {
            assert!(
                frontend
                    .requests
                    .get(random)
                    .is_some_and(|(_, sent)| sent.contains(address)),
                "the agent was sent a dial {random} to {address} no frontend made"
            );
        }
        assert!(!got.agent_end, "the agent's stream ended under it");
        if got.frontend_end.is_some() {
            // Only a message the server cannot read ends the stream (a
            // driver that panicked ends it too, quietly: tokio catches it).
            assert!(
                packet.is_none() || messages[..at].iter().any(|(_, p)| p.is_none()),
                "the Proxy stream ended under a frontend that sent only valid messages: {:?}",
                got.frontend_end
            );
            break;
        }
        drop(got);
        assert_eq!(control.pending_count(), 0, "a dial pending, its agent idle");
        frontend.settled();
        if packet.is_none() {
            // Not a message the server reads: the stream fails on it.
            break;
        }
    }
    end_streams(&control, &mut frontend, frontend_tx, agent_tx, &received).await;
    shutdown.cancel();
    tasks.close();
    tasks.wait().await;
    frontend.reached
}

/// The server's control core: one strategy (default), dials neither timed
/// out, retried nor hedged, a 64 MiB buffer budget.
pub(crate) fn control() -> Arc<Control> {
    let strategies = [ProxyStrategy::Default];
    let metrics = Arc::new(ServerMetrics::new(&strategies));
    Arc::new(Control::new(
        &strategies,
        DialPolicy {
            timeout: None,
            retries: 0,
            hedge: None,
            caps: crate::router::DialCaps::default(),
        },
        metrics,
        Budgets::new(64 << 20),
    ))
}

/// Opens the harness's frontend's `Proxy` stream, whose packets (and how
/// it ends) are recorded in `received`; the sender of its request body
/// (dropped: the frontend ends its stream).
async fn proxy_stream(
    control: &Arc<Control>,
    tasks: &TaskTracker,
    shutdown: &CancellationToken,
    received: &Arc<Mutex<Received>>,
) -> mpsc::Sender<Bytes> {
    let frontends = ProxyServiceImpl {
        control: control.clone(),
        tasks: tasks.clone(),
        shutdown: shutdown.clone(),
    };
    let (frontend_tx, frontend_body) = body();
    let response = frontends
        .proxy(Request::new(streaming(frontend_body)))
        .await
        .expect("a Proxy stream");
    let mut outbound = response.into_inner();
    tokio::spawn({
        let received = received.clone();
        async move {
            while let Some(next) = outbound.next().await {
                match next {
                    Ok(packet) => received.lock().expect("not poisoned").frontend.push(packet),
                    Err(status) => {
                        received.lock().expect("not poisoned").frontend_end = Some(Err(status));
                        return;
                    }
                }
            }
            received.lock().expect("not poisoned").frontend_end = Some(Ok(()));
        }
    });
    frontend_tx
}

/// The end of a session: the frontend ends its side (its stream ends, its
/// dials and connections go), then the agent (its stream ends, and the
/// server forgets it).
async fn end_streams(
    control: &Control,
    frontend: &mut Frontend,
    frontend_tx: mpsc::Sender<Bytes>,
    agent_tx: mpsc::Sender<Bytes>,
    received: &Mutex<Received>,
) {
    // A CLOSE_RSP right behind its DIAL_RSP, of a connection the frontend
    // never named, comes within the grace (`conn::ANSWER_GRACE`): the
    // frontend reads that long before it ends its side.
    tokio::time::sleep(crate::conn::ANSWER_GRACE).await;
    frontend.receives(&received.lock().expect("not poisoned").frontend);
    drop(frontend_tx);
    idle().await;
    {
        let got = received.lock().expect("not poisoned");
        frontend.receives(&got.frontend);
        assert!(got.frontend_end.is_some(), "the Proxy stream did not end");
    }
    assert_eq!(
        (
            control.frontend_count(),
            control.pending_count(),
            control.established_count()
        ),
        (0, 0, 0),
        "the frontend's stream ended, its dials and connections stayed"
    );
    drop(agent_tx);
    idle().await;
    assert!(received.lock().expect("not poisoned").agent_end);
    assert_eq!(
        control.backend_count(),
        0,
        "the agent's stream ended and stayed"
    );
}

/// Connects the harness's agent; the sender of its stream (dropped: the
/// agent ends its stream).
async fn agent(
    control: &Arc<Control>,
    tasks: &TaskTracker,
    shutdown: &CancellationToken,
    received: &Arc<Mutex<Received>>,
) -> mpsc::Sender<Bytes> {
    let agents = AgentServiceImpl {
        control: control.clone(),
        server_id: ServerId("fuzz".to_owned()),
        server_count: 1,
        tasks: tasks.clone(),
        shutdown: shutdown.clone(),
        flow_window: None,
        flow_version: Version::default(),
        token_auth: None,
        // One packet at a time: the agent's queue is full whenever it has
        // not read, so that uploads wait and the frontend's lanes fill.
        queue_bytes: 1,
        verify_identifiers: false,
    };
    let (tx, agent_body) = body();
    let mut request = Request::new(streaming(agent_body));
    request.metadata_mut().insert(
        proto::header::AGENT_ID,
        tonic::metadata::MetadataValue::from_static("fuzz-agent"),
    );
    let mut outbound = agents
        .connect(request)
        .await
        .expect("the agent admitted")
        .into_inner();
    // Weak: the harness's sender is the one that ends the agent's stream.
    let answers = tx.downgrade();
    let received = received.clone();
    tokio::spawn(async move {
        let mut open = HashSet::new();
        let mut next_conn = 1;
        while let Some(Ok(packet)) = outbound.next().await {
            let reply = agent_reply(packet, &mut open, &mut next_conn, &received);
            let Some(answers) = answers.upgrade() else {
                continue;
            };
            for packet in reply {
                if answers.send(message(&packet)).await.is_err() {
                    break;
                }
            }
        }
        received.lock().expect("not poisoned").agent_end = true;
    });
    tx
}

/// The harness's agent's answer to a packet from the server (`open`: its
/// connections; `next_conn`: the id of its next one): a DIAL_REQ, recorded
/// in `received`, refused when its random is 2 modulo 3, else established;
/// DATA on an open connection echoed, then the connection closed if the
/// DATA starts with `!`; CLOSE_REQ answered.
fn agent_reply(
    packet: Packet,
    open: &mut HashSet<i64>,
    next_conn: &mut i64,
    received: &Mutex<Received>,
) -> Vec<Packet> {
    let mut reply = Vec::new();
    match packet.into_kind() {
        PacketKind::DialReq(r) => {
            received
                .lock()
                .expect("not poisoned")
                .dials
                .push((r.random, r.address.clone()));
            if r.random.rem_euclid(3) == 2 {
                let refused = format!("dial tcp {}: connect: connection refused", r.address);
                reply.push(Packet::dial_response(r.random, 0, &refused));
            } else {
                open.insert(*next_conn);
                reply.push(Packet::dial_response(r.random, *next_conn, ""));
                *next_conn += 1;
            }
        }
        PacketKind::Data(d) if open.contains(&d.connect_id) => {
            let closes = d.data.first() == Some(&b'!');
            reply.push(Packet::data(d.connect_id, d.data));
            if closes {
                open.remove(&d.connect_id);
                reply.push(Packet::close_response(d.connect_id, "closed by the agent"));
            }
        }
        PacketKind::CloseReq(c) => {
            open.remove(&c.connect_id);
            reply.push(Packet::close_response(c.connect_id, ""));
        }
        _ => {}
    }
    reply
}

#[cfg(test)]
mod tests {
    use super::*;

    include!("../../../fuzz/replay.rs");

    replay!(
        fuzz_corpus_grpc_packets => grpc_packets within grpc_packets_alloc_bound
            reaching |r: &Reached| r.established > 0 && r.echoed > 0 && r.closed > 0
    );

    /// A `Proxy` stream ended from inside (shutdown) right after its
    /// DIAL_RSP ends only once the answer's grace is over
    /// (`conn::ANSWER_GRACE`): konnectivity-client closes, at the end, the
    /// connections it has registered by then.
    #[test]
    fn a_stream_ended_right_after_its_answer_ends_after_the_grace() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .expect("a runtime");
        runtime.block_on(async {
            let control = control();
            let (tasks, shutdown) = (TaskTracker::new(), CancellationToken::new());
            let received = Arc::new(Mutex::new(Received::default()));
            let _agent_tx = agent(&control, &tasks, &shutdown, &received).await;
            let frontend_tx = proxy_stream(&control, &tasks, &shutdown, &received).await;
            let dial = Packet::dial_request("tcp", "10.0.0.1:443", 1);
            frontend_tx.send(message(&dial)).await.expect("the body");
            idle().await;
            assert_eq!(received.lock().expect("not poisoned").frontend.len(), 1);
            let started = tokio::time::Instant::now();
            shutdown.cancel();
            while received
                .lock()
                .expect("not poisoned")
                .frontend_end
                .is_none()
            {
                idle().await;
            }
            let waited = started.elapsed();
            assert!(
                waited + Duration::from_millis(2) >= crate::conn::ANSWER_GRACE,
                "ended {waited:?} after the shutdown"
            );
        });
    }

    /// The harness reaches the server's paths: a dial established and one
    /// refused, DATA echoed through a lane (DATA after DATA, an empty one
    /// among them), a close by each side, a mismatch.
    #[test]
    fn a_session_goes_through_both_drivers() {
        let session = |packets: &[Packet]| {
            let body: Vec<u8> = packets.iter().flat_map(|p| message(p).to_vec()).collect();
            grpc_packets(&body)
        };
        let data = |conn: i64, bytes: &'static [u8]| Packet::data(conn, Bytes::from_static(bytes));
        let reached = session(&[
            Packet::dial_request("tcp", "10.0.0.1:443", 1),
            Packet::dial_request("tcp", "10.0.0.1:443", 2),
            data(1, &[b'a'; 300]),
            data(1, &[b'b'; 200]),
            data(1, b""),
            data(1, b"!bye"),
            Packet::dial_request("tcp", "10.0.0.1:443", 3),
            data(2, b"x"),
            Packet::close_request(2),
        ]);
        let want = Reached {
            established: 2,
            refused: 1,
            echoed: 505,
            closed: 2,
            mismatched: false,
        };
        assert_eq!(reached, want);
        let reached = session(&[
            Packet::dial_request("tcp", "10.0.0.1:443", 1),
            data(9, b"not ours"),
        ]);
        assert!(reached.mismatched && reached.closed == 1, "{reached:?}");
    }
}
