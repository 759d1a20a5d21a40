//! What frontends receive (issue 50): random sequences of agent and
//! frontend events (answers, refusals, closes, DIAL_CLS, deaths, new
//! agents, retries, hedges, timeouts, cancels, a stalled upload cut, a
//! frontend's end) through
//! the real router, the control core that carries its output out, and each
//! frontend's outbound queue and writer ([`FrontendWriter`]).
//!
//! Each frontend reads its stream as konnectivity-client does: in
//! batches (whatever its stream holds when it reads), registering each
//! connection only after the batch its DIAL_RSP came in; a CLOSE_RSP for a
//! connection it has not registered is dropped, and the request that
//! connection serves would wait for ever. The property: every packet a
//! frontend receives is one the protocol allows it at that point (an
//! answer per dial it made, DATA and CLOSE_RSP only on a connection it
//! has, no CLOSE_RSP it would drop), and once every agent is gone and the
//! clock has moved on, every dial it made is answered and every connection
//! it was given is closed.
//!
//! With the audit log on (issue 51, item 3): every DIAL_RSP success a
//! frontend saw has exactly one record of its frontend carrying its dial id
//! and connection id; a frontend's records of a dial are no more than the
//! DIAL_REQs it sent with that random (a duplicate is refused with a record
//! of its own, never in place of the pending dial's); once every stream is
//! gone, the traces keep nothing.

use std::{
    collections::{HashMap, HashSet},
    sync::Arc,
    time::{Duration, Instant},
};

use bytes::Bytes;
use futures_util::{FutureExt, StreamExt};
use proptest::prelude::*;
use proto::{Packet, packet::PacketKind};
use tokio_util::sync::CancellationToken;
use tunnel::{
    flow::{Scheme, Window},
    ids::{AgentId, ConnId},
    queue::{self, QueueRx},
};

use ops::audit::AuditRecord;

use super::{Budgets, Control, Work};
use crate::{
    conn::{
        ANSWER_GRACE, BackendLink, Conn, FrontendLink, FrontendTx, FrontendWriter, frontend_queue,
    },
    metrics::ServerMetrics,
    router::{AgentInfo, BackendId, DialPolicy, FrontendKind, HedgeDelay},
    strategy::{AgentIdentifiers, ProxyStrategy},
    stream::StreamEnd,
    traces::FrontendPeer,
};

/// The frontends of a run.
const FRONTENDS: usize = 2;

/// One event.
#[derive(Debug, Clone)]
enum Op {
    /// A frontend dials.
    Dial(usize),
    /// A frontend sends a pending dial's DIAL_REQ again, the same random
    /// (to another destination).
    DialAgain(usize, usize),
    /// An agent answers one of its dials: established, refused (another
    /// agent may serve it) or failed.
    Answer(usize, usize, u8),
    /// An agent closes one of its connections.
    AgentCloses(usize, usize),
    /// An agent sends DATA on one of its connections that its frontend has
    /// named (a destination answers a request).
    AgentData(usize, usize),
    /// An agent gives a dial up (DIAL_CLS).
    AgentGivesUp(usize, usize),
    /// An agent's stream ends.
    AgentDies(usize),
    /// A new agent connects.
    AgentJoins,
    /// A frontend reads what its stream holds.
    Read(usize),
    /// A frontend sends DATA on one of its connections.
    Name(usize, usize),
    /// A frontend closes one of its connections (CLOSE_REQ).
    CloseReq(usize, usize),
    /// A frontend cancels one of its pending dials (DIAL_CLS).
    Cancel(usize, usize),
    /// A frontend's driver cuts one of its connections whose upload
    /// stalled (the read-ahead's grace, on the frontend's task).
    UploadCut(usize, usize),
    /// A frontend's stream ends.
    FrontendGone(usize),
    /// Dial timeouts and hedges fire.
    Timers,
    /// The clock moves on by the grace of a held close.
    Later,
}

fn op() -> impl Strategy<Value = Op> {
    let fe = 0..FRONTENDS;
    let any_index = 0usize..8;
    prop_oneof![
        4 => fe.clone().prop_map(Op::Dial),
        1 => (fe.clone(), any_index.clone()).prop_map(|(f, i)| Op::DialAgain(f, i)),
        4 => (0usize..4, any_index.clone(), 0u8..4).prop_map(|(a, i, how)| Op::Answer(a, i, how)),
        2 => (0usize..4, any_index.clone()).prop_map(|(a, i)| Op::AgentCloses(a, i)),
        2 => (0usize..4, any_index.clone()).prop_map(|(a, i)| Op::AgentData(a, i)),
        1 => (0usize..4, any_index.clone()).prop_map(|(a, i)| Op::AgentGivesUp(a, i)),
        2 => (0usize..4).prop_map(Op::AgentDies),
        1 => Just(Op::AgentJoins),
        4 => fe.clone().prop_map(Op::Read),
        2 => (fe.clone(), any_index.clone()).prop_map(|(f, i)| Op::Name(f, i)),
        1 => (fe.clone(), any_index.clone()).prop_map(|(f, i)| Op::CloseReq(f, i)),
        1 => (fe.clone(), any_index.clone()).prop_map(|(f, i)| Op::Cancel(f, i)),
        1 => (fe.clone(), any_index).prop_map(|(f, i)| Op::UploadCut(f, i)),
        1 => fe.prop_map(Op::FrontendGone),
        1 => Just(Op::Timers),
        1 => Just(Op::Later),
    ]
}

/// An agent: its stream's queue and what it has.
struct Agent {
    id: BackendId,
    /// What the server sent it.
    rx: QueueRx<Packet>,
    /// DIAL_REQs it has not answered (randoms).
    pending: Vec<i64>,
    /// Its connections.
    conns: Vec<Arc<Conn>>,
    alive: bool,
}

/// A dial (a random) as its frontend knows it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Dial {
    /// DIAL_REQs sent with it.
    made: u32,
    /// Answers (DIAL_RSP, DIAL_CLS) received.
    answered: u32,
    /// Whether the frontend cancelled it.
    cancelled: bool,
}

impl Dial {
    fn pending(&self) -> bool {
        self.answered < self.made && !self.cancelled
    }
}

/// A frontend, reading as konnectivity-client does.
struct Client {
    link: FrontendLink,
    writer: FrontendWriter,
    alive: bool,
    dials: HashMap<i64, Dial>,
    /// Connections it registered, in order.
    registered: Vec<ConnId>,
    /// The server's handles of its connections (the driver's table).
    attached: HashMap<ConnId, Arc<Conn>>,
    /// Its peer, as its audit records name it.
    peer: String,
    /// The connections it was given: (dial id, connection id).
    given: Vec<(i64, ConnId)>,
}

impl Client {
    /// Reads what its stream holds, checking each packet; connections
    /// answered in the batch are registered after it.
    fn read(&mut self, who: usize) -> Result<(), TestCaseError> {
        let mut batch: Vec<ConnId> = Vec::new();
        while let Some(Some(packet)) = self.writer.next().now_or_never() {
            match packet.into_kind() {
                PacketKind::DialRsp(rsp) => {
                    self.answered(who, rsp.random)?;
                    if rsp.error.is_empty() {
                        let id = ConnId(rsp.connect_id);
                        prop_assert!(
                            !self.registered.contains(&id) && !batch.contains(&id),
                            "frontend {who}: connection {id} given twice"
                        );
                        batch.push(id);
                        self.given.push((rsp.random, id));
                    }
                }
                PacketKind::DialCls(cls) => self.answered(who, cls.random)?,
                PacketKind::Data(data) => {
                    let id = ConnId(data.connect_id);
                    prop_assert!(
                        self.registered.contains(&id),
                        "frontend {who}: DATA on connection {id}, which it does not have"
                    );
                }
                PacketKind::CloseRsp(close) => {
                    let id = ConnId(close.connect_id);
                    prop_assert!(
                        !batch.contains(&id),
                        "frontend {who}: CLOSE_RSP of connection {id} in the read of its DIAL_RSP: \
                         dropped before the connection is registered, its request waits for ever"
                    );
                    let at = self.registered.iter().position(|c| *c == id);
                    prop_assert!(
                        at.is_some(),
                        "frontend {who}: CLOSE_RSP of connection {id}, which it does not have"
                    );
                    if let Some(at) = at {
                        self.registered.remove(at);
                    }
                }
                other => prop_assert!(false, "frontend {who} was sent {other:?}"),
            }
        }
        self.registered.extend(batch);
        for conn in self.link.attachments.take() {
            self.attached.insert(conn.id, conn);
        }
        Ok(())
    }

    /// Its dials still waiting for an answer, in order.
    fn pending_dials(&self) -> Vec<i64> {
        let mut pending: Vec<i64> = self
            .dials
            .iter()
            .filter(|(_, d)| d.pending())
            .map(|(r, _)| *r)
            .collect();
        pending.sort_unstable();
        pending
    }

    /// An answer to dial `random`: no more than it made.
    fn answered(&mut self, who: usize, random: i64) -> Result<(), TestCaseError> {
        let dial = self.dials.entry(random).or_default();
        prop_assert!(
            dial.answered < dial.made,
            "frontend {who}: an answer to dial {random} ({dial:?})"
        );
        dial.answered += 1;
        Ok(())
    }
}

/// The server's side and the peers of a run.
struct Run {
    control: Arc<Control>,
    /// The audit log, written to `audit_path`.
    audit: ops::audit::AuditLog<AuditRecord>,
    audit_path: std::path::PathBuf,
    metrics: Arc<ServerMetrics>,
    agents: Vec<Agent>,
    clients: Vec<Client>,
    /// Connections their frontend named: agents send DATA only on these.
    named: HashSet<(BackendId, ConnId)>,
    next_random: i64,
    next_conn: i64,
}

impl Run {
    fn new(policy: DialPolicy, dir: &std::path::Path) -> Self {
        let strategies = [ProxyStrategy::Default];
        let metrics = Arc::new(ServerMetrics::new(&strategies));
        let audit_path = dir.join("audit.jsonl");
        let config = ops::audit::AuditConfig {
            output: ops::audit::Output::File {
                path: audit_path.clone(),
                rotation: ops::audit::Rotation {
                    max_bytes: 1 << 30,
                    max_backups: 0,
                    max_age: None,
                },
            },
            queue: 1 << 16,
        };
        let audit =
            ops::audit::AuditLog::start(Some(&config), ops::audit::AuditMetrics::unregistered())
                .expect("the audit log");
        let control = Control::new(&strategies, policy, metrics.clone(), Budgets::new(64 << 20))
            .with_audit(audit.sink(), "server".to_owned(), "unix:test".to_owned());
        let mut run = Self {
            control: Arc::new(control),
            audit,
            audit_path,
            metrics,
            agents: Vec::new(),
            clients: Vec::new(),
            named: HashSet::new(),
            next_random: 1,
            next_conn: 1,
        };
        for _ in 0..FRONTENDS {
            run.add_client();
        }
        for _ in 0..3 {
            run.add_agent();
        }
        run
    }

    fn add_client(&mut self) {
        let (tx, rx) = frontend_queue();
        let end = StreamEnd::new(CancellationToken::new());
        let metrics = self.metrics.clone();
        let budget = self.control.budgets.to_frontend.clone();
        let link = self.control.add_frontend(FrontendKind::Grpc, |id| {
            FrontendTx::new(id, FrontendKind::Grpc, tx, end, metrics, budget)
        });
        let writer = FrontendWriter::new(&link.tx, rx);
        let peer = format!("frontend-{}", self.clients.len());
        self.control.frontend_traced(
            link.id(),
            None,
            FrontendPeer {
                kind: FrontendKind::Grpc,
                peer: peer.clone(),
                subject: None,
            },
        );
        self.clients.push(Client {
            link,
            writer,
            alive: true,
            dials: HashMap::new(),
            registered: Vec::new(),
            attached: HashMap::new(),
            peer,
            given: Vec::new(),
        });
    }

    fn add_agent(&mut self) {
        let (tx, rx) = queue::queue(1 << 20, 1 << 20);
        let link = BackendLink::new(
            AgentId(format!("agent-{}", self.agents.len())),
            None,
            Scheme::Credit {
                ours: Window::V1,
                theirs: Window::V1,
            },
            tx,
            StreamEnd::new(CancellationToken::new()),
            self.metrics.clone(),
        );
        let info = AgentInfo {
            agent_id: link.agent_id.clone(),
            identifiers: AgentIdentifiers::default(),
            credential: None,
        };
        let id = self.control.add_backend(info, link);
        self.agents.push(Agent {
            id,
            rx,
            pending: Vec::new(),
            conns: Vec::new(),
            alive: true,
        });
    }

    /// Runs waits that need no more than the room the queues have.
    fn run_works(&self, works: Vec<Work>) {
        for work in works {
            let _ = self.control.run(work).now_or_never();
        }
    }

    /// Runs what the dialer holds (retries, hedges).
    fn run_dialer(&self) {
        let works = std::mem::take(&mut *self.control.dialer.lock());
        self.run_works(works);
    }

    /// Each agent reads its stream: DIAL_REQs are pending, DIAL_CLS drops
    /// one, CLOSE_REQ is answered at once; until nothing more comes.
    fn agents_read(&mut self) {
        loop {
            let mut read = false;
            for at in 0..self.agents.len() {
                while let Some(Some(packet)) = self.agents[at].rx.recv().now_or_never() {
                    read = true;
                    self.agent_receives(at, packet);
                }
            }
            self.run_dialer();
            if !read {
                return;
            }
        }
    }

    fn agent_receives(&mut self, at: usize, packet: Packet) {
        let agent = &mut self.agents[at];
        if !agent.alive {
            return;
        }
        match packet.into_kind() {
            PacketKind::DialReq(req) => agent.pending.push(req.random),
            PacketKind::DialCls(cls) => agent.pending.retain(|r| *r != cls.random),
            PacketKind::CloseReq(req) => {
                let id = ConnId(req.connect_id);
                agent.conns.retain(|c| c.id != id);
                let be = agent.id;
                let _ = self
                    .control
                    .backend_packet(be, Packet::close_response(id.0, ""));
            }
            _ => {}
        }
    }

    fn pick<T>(list: &[T], at: usize) -> Option<usize> {
        (!list.is_empty()).then(|| at % list.len())
    }

    async fn step(&mut self, op: Op) -> Result<(), TestCaseError> {
        match op {
            Op::Dial(fe) => {
                let random = self.next_random;
                self.next_random += 1;
                self.dial(fe, random, "10.0.0.1:443");
            }
            Op::DialAgain(fe, i) => {
                let pending = self.clients[fe].pending_dials();
                if let Some(at) = Self::pick(&pending, i) {
                    self.dial(fe, pending[at], "10.0.0.9:443");
                }
            }
            Op::Answer(a, i, how) => self.answer(a, i, how),
            Op::AgentCloses(a, i) => {
                if let Some(agent) = self.live_agent(a)
                    && let Some(at) = Self::pick(&agent.conns, i)
                {
                    let conn = agent.conns.remove(at);
                    let be = agent.id;
                    let _ = self
                        .control
                        .backend_packet(be, Packet::close_response(conn.id.0, ""));
                }
            }
            Op::AgentData(a, i) => {
                if let Some(agent) = self.agents.get(a % self.agents.len().max(1))
                    && agent.alive
                    && let Some(at) = Self::pick(&agent.conns, i)
                    && self.named.contains(&(agent.id, agent.conns[at].id))
                {
                    let _ = agent.conns[at].deliver(&Bytes::from_static(b"answer"));
                }
            }
            Op::AgentGivesUp(a, i) => {
                if let Some(agent) = self.live_agent(a)
                    && let Some(at) = Self::pick(&agent.pending, i)
                {
                    let random = agent.pending.remove(at);
                    let be = agent.id;
                    let _ = self.control.backend_packet(be, Packet::close_dial(random));
                }
            }
            Op::AgentDies(a) => {
                if let Some(agent) = self.live_agent(a) {
                    agent.alive = false;
                    agent.pending.clear();
                    agent.conns.clear();
                    let be = agent.id;
                    self.control.backend_closed(be);
                }
            }
            Op::AgentJoins => self.add_agent(),
            Op::Read(fe) => return self.read(fe),
            Op::Name(fe, i) => {
                self.name(fe, i);
            }
            Op::CloseReq(fe, i) => {
                if let Some(id) = self.name(fe, i) {
                    let fe_id = self.clients[fe].link.id();
                    let works = self
                        .control
                        .frontend_packet(fe_id, Packet::close_request(id.0));
                    self.run_works(works);
                }
            }
            Op::Cancel(fe, i) => self.cancel(fe, i),
            Op::UploadCut(fe, i) => {
                let client = &self.clients[fe];
                if client.alive
                    && let Some(at) = Self::pick(&client.registered, i)
                    && let Some(conn) = client.attached.get(&client.registered[at])
                {
                    self.control.upload_stalled(conn);
                }
            }
            Op::FrontendGone(fe) => {
                let client = &mut self.clients[fe];
                if client.alive {
                    client.alive = false;
                    self.control.frontend_closed(client.link.id());
                }
            }
            Op::Timers => {
                let later = Instant::now() + Duration::from_secs(3600);
                let carried = self
                    .control
                    .with_router(|router, out| router.handle_timeout(later, out));
                self.control.to_dialer(carried.works);
            }
            Op::Later => tokio::time::advance(ANSWER_GRACE).await,
        }
        Ok(())
    }

    fn live_agent(&mut self, a: usize) -> Option<&mut Agent> {
        let len = self.agents.len();
        self.agents.get_mut(a % len.max(1)).filter(|a| a.alive)
    }

    fn dial(&mut self, fe: usize, random: i64, address: &str) {
        let client = &mut self.clients[fe];
        if !client.alive {
            return;
        }
        client.dials.entry(random).or_default().made += 1;
        let works = self.control.frontend_packet(
            client.link.id(),
            Packet::dial_request("tcp", address, random),
        );
        self.run_works(works);
    }

    fn answer(&mut self, a: usize, i: usize, how: u8) {
        let next_conn = self.next_conn;
        let Some(agent) = self.live_agent(a) else {
            return;
        };
        let Some(at) = Self::pick(&agent.pending, i) else {
            return;
        };
        let random = agent.pending.remove(at);
        let be = agent.id;
        let packet = match how {
            0 | 1 => Packet::dial_response(random, next_conn, ""),
            2 => Packet::dial_response(
                random,
                0,
                "dial tcp 10.0.0.1:443: connect: connection refused",
            ),
            _ => Packet::dial_response(random, 0, "dial tcp 10.0.0.1:443: i/o timeout"),
        };
        if how <= 1 {
            self.next_conn += 1;
        }
        if let Some(conn) = self.control.backend_packet(be, packet)
            && let Some(agent) = self.agents.iter_mut().find(|a| a.id == be)
        {
            agent.conns.push(conn);
        }
    }

    /// A frontend names one of its registered connections (DATA); its id.
    fn name(&mut self, fe: usize, i: usize) -> Option<ConnId> {
        let client = &mut self.clients[fe];
        if !client.alive {
            return None;
        }
        let id = client.registered[Self::pick(&client.registered, i)?];
        if let Some(conn) = client.attached.get(&id) {
            conn.named_by_frontend();
            self.named.insert((conn.backend, id));
        }
        Some(id)
    }

    fn cancel(&mut self, fe: usize, i: usize) {
        let client = &mut self.clients[fe];
        if !client.alive {
            return;
        }
        let pending = client.pending_dials();
        let Some(at) = Self::pick(&pending, i) else {
            return;
        };
        client.dials.entry(pending[at]).or_default().cancelled = true;
        let works = self
            .control
            .frontend_packet(client.link.id(), Packet::close_dial(pending[at]));
        self.run_works(works);
    }

    fn read(&mut self, fe: usize) -> Result<(), TestCaseError> {
        let client = &mut self.clients[fe];
        if client.alive {
            client.read(fe)?;
        }
        Ok(())
    }

    /// Every agent goes, the timers fire, the clock moves past every
    /// grace; then every dial a frontend made is answered (or it cancelled
    /// it) and every connection it was given is closed.
    async fn finish(&mut self) -> Result<(), TestCaseError> {
        for a in 0..self.agents.len() {
            self.step(Op::AgentDies(a)).await?;
        }
        self.agents_read();
        self.step(Op::Timers).await?;
        self.run_dialer();
        for _ in 0..3 {
            self.step(Op::Later).await?;
            for fe in 0..FRONTENDS {
                self.read(fe)?;
            }
        }
        for (who, client) in self.clients.iter().enumerate() {
            if !client.alive {
                continue;
            }
            let unanswered: Vec<_> = client.dials.iter().filter(|(_, d)| d.pending()).collect();
            prop_assert!(
                unanswered.is_empty(),
                "frontend {who}: dials never answered: {unanswered:?}"
            );
            prop_assert!(
                client.registered.is_empty(),
                "frontend {who}: connections never closed: {:?}",
                client.registered
            );
        }
        prop_assert_eq!(self.control.pending_count(), 0);
        prop_assert_eq!(self.control.established_count(), 0);
        for fe in 0..FRONTENDS {
            self.step(Op::FrontendGone(fe)).await?;
        }
        prop_assert!(
            self.control.state().traces.is_empty(),
            "the traces keep something once every stream is gone"
        );
        Ok(())
    }

    /// The audit log's records, once it is closed, checked against what
    /// each frontend made and saw.
    fn check_records(self) -> Result<(), TestCaseError> {
        let Self {
            control,
            audit,
            audit_path,
            clients,
            ..
        } = self;
        drop(control);
        let closing = tokio::runtime::Runtime::new().expect("a runtime");
        closing.block_on(audit.close(Duration::from_secs(30)));
        let text = std::fs::read_to_string(&audit_path).unwrap_or_default();
        let mut records: HashMap<(String, i64), Vec<Option<i64>>> = HashMap::new();
        for line in text.lines() {
            let record: serde_json::Value = serde_json::from_str(line).expect("a JSON record");
            let peer = record["frontend_peer"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            let dial = record["dial_id"].as_i64().unwrap_or_default();
            let conn = record["connection_id"].as_i64();
            records.entry((peer, dial)).or_default().push(conn);
        }
        for client in &clients {
            for (dial, conn) in &client.given {
                let of = records.get(&(client.peer.clone(), *dial));
                let carrying = of.map_or(0, |r| r.iter().filter(|c| **c == Some(conn.0)).count());
                prop_assert_eq!(
                    carrying,
                    1,
                    "{}: dial {} given connection {}: records {:?}",
                    &client.peer,
                    dial,
                    conn,
                    of
                );
            }
        }
        for ((peer, dial), of) in &records {
            let made = clients
                .iter()
                .find(|c| &c.peer == peer)
                .and_then(|c| c.dials.get(dial))
                .map_or(0, |d| d.made);
            prop_assert!(
                of.len() <= made as usize,
                "{peer}: {} records of dial {dial}, {made} DIAL_REQs",
                of.len()
            );
        }
        Ok(())
    }
}

fn run_case(ops: Vec<Op>, policy: DialPolicy) -> Result<(), TestCaseError> {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .expect("a runtime");
    let run = runtime.block_on(async {
        let mut run = Run::new(policy, dir.path());
        for op in ops {
            run.step(op).await?;
            run.agents_read();
        }
        run.finish().await?;
        Ok::<_, TestCaseError>(run)
    })?;
    drop(runtime);
    run.check_records()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// See the module documentation.
    #[test]
    fn every_frontend_receives_a_valid_sequence_and_every_dial_ends(
        ops in proptest::collection::vec(op(), 1..80),
        retries in 0u32..3,
        hedge in any::<bool>(),
    ) {
        let policy = DialPolicy {
            timeout: Some(Duration::from_secs(5)),
            retries,
            hedge: hedge.then_some(HedgeDelay::Fixed(Duration::from_secs(1))),
            caps: crate::router::DialCaps::default(),
        };
        run_case(ops, policy)?;
    }
}

/// The shape of issue 50 alone: an agent answers a dial and dies before
/// its frontend reads; the frontend reads the DIAL_RSP, and the CLOSE_RSP
/// only in a later read (after it named the connection, or the grace).
#[test]
fn an_agent_that_dies_right_after_answering_closes_in_a_later_read() {
    for name in [true, false] {
        let ops = vec![
            Op::Dial(0),
            Op::Answer(0, 0, 0),
            Op::Answer(1, 0, 0),
            Op::Answer(2, 0, 0),
            Op::AgentDies(0),
            Op::AgentDies(1),
            Op::AgentDies(2),
            Op::Read(0),
            if name { Op::Name(0, 0) } else { Op::Later },
            Op::Read(0),
        ];
        let policy = DialPolicy::plain(Some(Duration::from_secs(5)));
        let result = run_case(ops, policy);
        assert!(result.is_ok(), "{result:?}");
    }
}
