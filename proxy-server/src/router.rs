//! [`Router`]: the server's routing state as plain data, without I/O.
//!
//! One struct owns every frontend stream, agent stream (backend), pending
//! dial and established connection, each by id. Each event (a packet from a
//! frontend or an agent, a stream's end, a timer, a transport's report)
//! goes through one method that updates the tables and appends what to
//! send to whom to an output list ([`Out`]). It holds ids and plain data
//! only: no `Arc`, no lock, no waker, and no clock (every event that needs
//! the time is given `now`). It never awaits, never spawns and never
//! touches a socket or a queue: its driver (`control`) and the streams' drivers do
//! all of that, and race every wait against its connection's end
//! (quinn-proto's `Connection` and its driver). A connection's flow state
//! (window, credit, progress) belongs to the driver, which the router tells
//! when a connection opens and closes ([`Out::Opened`], [`Out::Closed`]).
//!
//! The lifecycle is ANP's (`pkg/server/server.go`): DIAL_REQ picks a
//! backend by the strategies and becomes a pending dial, keyed globally by
//! the frontend's random; DIAL_RSP makes it an established connection,
//! keyed by the agent's connect id within its backend; DATA and CLOSE_* are
//! routed by connect id, checked against the frontend that owns it; DIAL_CLS
//! cancels a pending dial from either side; the end of either stream closes
//! what it had open on the other side.

use std::{
    collections::{BTreeSet, HashMap, HashSet, VecDeque},
    sync::Arc,
    time::{Duration, Instant},
};

use bytes::Bytes;
use proto::{DialRequest, Packet, packet::PacketKind};
use tunnel::{
    compact, flow,
    ids::{AgentId, ConnId, DialId},
};

pub(crate) use self::dials::FAILURE_COST;
use self::dials::{
    Attempt, AttemptEnd, Cancelled, Latencies, Median, PeakEwma, PendingDial, retryable,
};
#[cfg(any(test, feature = "fuzzing"))]
pub(crate) use self::dials::{DECAY, FLOOR};
pub use self::dials::{DialCaps, DialPolicy, HedgeDelay};
pub(crate) use crate::ids::{BackendId, Credential, FrontendId};
use crate::{
    events::{CloseReason, DialError, DialFailure, DialRetry, MAX_ADDRESS, MAX_PROTOCOL},
    manager::{BackendManager, Scope},
    strategy::{AgentIdentifiers, ProxyStrategy},
};

mod dials;

/// CLOSE_RSP error when a frontend used a connection id it does not own.
pub const MISMATCHED: &str = "mismatched connection IDs";
/// CLOSE_RSP error of a connection whose frontend took none of its data
/// for `--frontend-stall-timeout`.
pub const STALLED: &str =
    "the frontend took none of this connection's data within --frontend-stall-timeout";
/// CLOSE_RSP error of a connection whose destination took none of its
/// upload for `frontend::lanes::UPLOAD_GRACE` while it held up the
/// other connections of its `Proxy` stream, or its frontend's close.
pub const UPLOAD_STALLED: &str =
    "closed with its upload undelivered: the destination took none of it for 5s";
/// CLOSE_RSP error for DATA from a frontend that never dialed.
pub(crate) const NOT_INITIALIZED: &str = "backend not initialized";
/// CLOSE_RSP error for CLOSE_REQ from a frontend that never dialed.
pub(crate) const UNINITIALIZED: &str = "backend uninitialized";

/// How many closed connection ids a frontend remembers.
const RECENTLY_CLOSED: usize = 32;

/// The protocol of a frontend (ANP counts some events for one only), as
/// the audit log names it.
pub(crate) use ops::audit::record::FrontendKind;

/// What the router asks the transports to do, in order.
#[derive(Debug)]
pub(crate) enum Out {
    /// A control packet for a frontend (never waits).
    ToFrontend(FrontendId, Packet),
    /// A control packet for an agent (never waits).
    ToBackend(BackendId, Packet),
    /// A dial to forward to an agent (its first, a retry or a hedge); the
    /// sender may wait for room (bounded by `--backend-dial-timeout` and
    /// by the dial's end: [`Out::Settled`]) and reports the outcome with
    /// [`Router::dial_forwarded`] or [`Router::dial_not_forwarded`].
    Forward {
        /// Whose dial.
        frontend: FrontendId,
        /// Where it goes.
        backend: BackendId,
        /// The dial.
        dial: DialId,
        /// The DIAL_REQ.
        packet: Packet,
    },
    /// A frontend's DATA for an agent, on a connection the frontend's
    /// driver did not have in its table: the sender waits for credit and
    /// room, raced against the connection's end.
    DataToBackend {
        /// The agent stream.
        backend: BackendId,
        /// The connection.
        conn: ConnId,
        /// The payload.
        data: Bytes,
    },
    /// A connection was established: its flow state starts now, joining
    /// the two streams' drivers.
    Opened {
        /// The agent stream it runs over.
        backend: BackendId,
        /// The connection.
        conn: ConnId,
        /// Its frontend.
        frontend: FrontendId,
    },
    /// A dial failed: its answer to the frontend (never waits).
    DialFailed {
        /// Whose dial.
        frontend: FrontendId,
        /// The dial.
        dial: DialId,
        /// Why.
        error: DialError,
    },
    /// A connection left the tables: every wait on its behalf ends.
    Closed {
        /// The agent stream it ran over.
        backend: BackendId,
        /// The connection.
        conn: ConnId,
    },
    /// A dial succeeded: DIAL_RSP to the frontend. If it cannot be queued,
    /// the transport reports [`Router::dial_rsp_undelivered`]; if it can,
    /// the dial latency is observed.
    Established {
        /// Whose dial.
        frontend: FrontendId,
        /// The agent stream of the connection.
        backend: BackendId,
        /// The connection.
        conn: ConnId,
        /// The DIAL_RSP.
        packet: Packet,
        /// From DIAL_REQ to DIAL_RSP.
        latency: Duration,
    },
    /// A dial left the pending table (established, failed or cancelled):
    /// a DIAL_REQ of it still waiting to go out need not.
    Settled(DialId),
    /// End a frontend's stream (an HTTP CONNECT: close its socket).
    EndFrontend(FrontendId),
    /// End an agent's stream.
    EndBackend(BackendId),
    /// Something to count.
    Count(Event),
}

/// What the router counts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Event {
    /// A dial failed.
    DialFailed(DialFailure),
    /// A dial became pending.
    DialPending,
    /// A dial went to another agent after its agent failed it.
    DialRetried(DialRetry),
    /// A dial went to a second agent while the first had not answered.
    DialHedged,
    /// A hedged dial was established by the second agent.
    HedgeWon,
    /// A connection was established.
    Established,
    /// An established connection ended after the given time.
    Closed(CloseReason, Duration),
}

/// Why a dial could not be forwarded to its agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ForwardFailure {
    /// The agent stream is gone.
    Closed,
    /// The agent stream had no room within `--backend-dial-timeout`: it is
    /// retired.
    TimedOut,
}

/// What a new agent stream announced.
#[derive(Debug, Clone)]
pub(crate) struct AgentInfo {
    /// `agentid`.
    pub(crate) agent_id: AgentId,
    /// `agentidentifiers`.
    pub(crate) identifiers: AgentIdentifiers,
    /// Who vouches for the stream, when something does (its certificate
    /// with `--verify-agent-identifiers`, its node with a bound token);
    /// `None`: its agent id, on its word.
    pub(crate) credential: Option<Credential>,
}

impl AgentInfo {
    /// Its voice: the credential that vouches for it, else its agent id.
    pub(crate) fn voice(&self) -> Credential {
        self.credential
            .clone()
            .unwrap_or_else(|| Credential(format!("agent:{}", self.agent_id.0)))
    }
}

/// What a pick weighs each backend at (`BackendEntry::cost`), and
/// `usize::MAX` for one that takes no more dials: gone, or at `cap`
/// pending dials (`--max-pending-dials-per-agent`).
fn weigh(
    backends: &HashMap<BackendId, BackendEntry>,
    cap: usize,
    now: Instant,
    typical: Duration,
    floor: Duration,
) -> impl Fn(BackendId) -> usize + '_ {
    move |b| {
        backends
            .get(&b)
            .filter(|entry| entry.pending < cap)
            .map_or(usize::MAX, |entry| entry.cost(now, typical, floor))
    }
}

/// A frontend stream's dials and connections.
struct FrontendEntry {
    /// Its protocol.
    kind: FrontendKind,
    /// Set after a protocol violation: further packets are ignored.
    failed: bool,
    /// Whether a dial was ever made on this stream.
    dialed: bool,
    /// Dials sent and not yet answered.
    pending: HashSet<DialId>,
    /// Established connections and the backend of each.
    conns: HashMap<ConnId, BackendId>,
    /// The last connections closed under the frontend: packets it sent for
    /// them before it learnt of the close are dropped, not treated as a
    /// protocol error.
    recently_closed: VecDeque<ConnId>,
}

impl FrontendEntry {
    /// Forgets an established connection, remembering it was closed.
    fn close_conn(&mut self, id: ConnId) {
        if self.conns.remove(&id).is_none() {
            return;
        }
        if self.recently_closed.len() == RECENTLY_CLOSED {
            self.recently_closed.pop_front();
        }
        self.recently_closed.push_back(id);
    }
}

/// An agent stream's connections.
struct BackendEntry {
    /// What it announced.
    info: AgentInfo,
    /// Its voice in picks and votes ([`AgentInfo::voice`]).
    voice: Arc<str>,
    /// Established connections.
    conns: HashMap<ConnId, ConnEntry>,
    /// Pending dials in flight on it.
    pending: usize,
    /// Of those, the ones whose DIAL_REQ went out, by when it did: the
    /// oldest one's age weighs in its latency.
    forwarded: BTreeSet<(Instant, DialId)>,
    /// How long its dials take.
    latency: PeakEwma,
}

impl BackendEntry {
    /// Open connections and dials in flight.
    fn load(&self) -> usize {
        self.conns.len() + self.pending
    }

    /// What the less-loaded pick weighs: one more than its load, times
    /// its dial latency (`typical` until it has one), raised to how long
    /// its oldest pending dial has waited, and never below `floor` (the
    /// agents' median), in microseconds.
    fn cost(&self, now: Instant, typical: Duration, floor: Duration) -> usize {
        let waiting = self
            .forwarded
            .first()
            .map_or(Duration::ZERO, |(at, _)| now.saturating_duration_since(*at));
        let latency = self
            .latency
            .get(now)
            .unwrap_or(typical)
            .max(waiting)
            .max(floor);
        let micros = usize::try_from(latency.as_micros()).unwrap_or(usize::MAX);
        (self.load() + 1).saturating_mul(micros.max(1))
    }

    /// An attempt at `dial` on it ended, whichever way.
    fn release(&mut self, dial: DialId, attempt: &Attempt) {
        self.pending -= 1;
        if let Some(at) = attempt.forwarded {
            self.forwarded.remove(&(at, dial));
        }
    }
}

/// An established connection.
#[derive(Debug, Clone, Copy)]
struct ConnEntry {
    /// Its frontend.
    frontend: FrontendId,
    /// When the dial succeeded, for its lifetime.
    established: Instant,
}

/// Who owns a connection id a frontend used.
enum Owner {
    /// This frontend's connection over this backend.
    Ours(BackendId),
    /// Nobody: the frontend never dialed.
    Nobody,
    /// This frontend's, but already closed (the frontend has not learnt it yet).
    Closed,
    /// Not this frontend.
    Other,
}

/// The routing state. See the module documentation.
pub(crate) struct Router {
    /// Frontend streams by id.
    frontends: HashMap<FrontendId, FrontendEntry>,
    /// Agent streams by id.
    backends: HashMap<BackendId, BackendEntry>,
    /// The agent streams indexed by strategy.
    manager: BackendManager,
    /// Dials in flight, by the frontend's random (global, as in ANP).
    pending: HashMap<DialId, PendingDial>,
    /// Pending dials by deadline.
    deadlines: BTreeSet<(Instant, DialId)>,
    /// Pending dials by when a second agent is asked.
    hedges: BTreeSet<(Instant, DialId)>,
    /// How dials are bounded, retried and hedged.
    policy: DialPolicy,
    /// The latest dials' latencies, for the hedge delay.
    latencies: Latencies,
    /// Agent streams open per voice ([`AgentInfo::voice`]), for
    /// `--max-agent-streams-per-credential`.
    voices: HashMap<Arc<str>, usize>,
    /// The agents' median dial latency: no agent weighs less, no hedge
    /// delay is shorter.
    median: Median,
    /// Attempts closed because another agent answered first.
    cancelled: Cancelled,
    /// Next frontend or backend id.
    next_id: u64,
}

impl Router {
    /// An empty router for `strategies`; `rng` seeds the default strategy's
    /// random start.
    pub(crate) fn new(
        strategies: &[ProxyStrategy],
        policy: DialPolicy,
        rng: fastrand::Rng,
    ) -> Self {
        Self {
            frontends: HashMap::new(),
            backends: HashMap::new(),
            manager: BackendManager::new(strategies, rng),
            pending: HashMap::new(),
            deadlines: BTreeSet::new(),
            hedges: BTreeSet::new(),
            policy,
            latencies: Latencies::default(),
            voices: HashMap::new(),
            median: Median::default(),
            cancelled: Cancelled::default(),
            next_id: 1,
        }
    }

    fn next_id(&mut self) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        id
    }

    /// A new frontend stream.
    pub(crate) fn add_frontend(&mut self, kind: FrontendKind) -> FrontendId {
        let id = FrontendId(self.next_id());
        self.frontends.insert(
            id,
            FrontendEntry {
                kind,
                failed: false,
                dialed: false,
                pending: HashSet::new(),
                conns: HashMap::new(),
                recently_closed: VecDeque::new(),
            },
        );
        id
    }

    /// A new agent stream, available to dials at once.
    pub(crate) fn add_backend(&mut self, info: AgentInfo) -> BackendId {
        let id = BackendId(self.next_id());
        let voice: Arc<str> = Arc::from(info.voice().0);
        *self.voices.entry(voice.clone()).or_default() += 1;
        self.manager.add(id, &voice, &info.identifiers);
        self.backends.insert(
            id,
            BackendEntry {
                info,
                voice,
                conns: HashMap::new(),
                pending: 0,
                forwarded: BTreeSet::new(),
                latency: PeakEwma::default(),
            },
        );
        id
    }

    /// Whether `info`'s voice may open another agent stream
    /// (`--max-agent-streams-per-credential`); `Err` with the cap if not.
    pub(crate) fn admits(&self, info: &AgentInfo) -> Result<(), usize> {
        let cap = self.policy.caps.streams_per_credential;
        let open = self
            .voices
            .get(info.voice().0.as_str())
            .copied()
            .unwrap_or(0);
        if open >= cap { Err(cap) } else { Ok(()) }
    }

    /// A packet from a frontend.
    pub(crate) fn frontend_packet(
        &mut self,
        now: Instant,
        fe: FrontendId,
        packet: Packet,
        out: &mut Vec<Out>,
    ) {
        let Some(entry) = self.frontends.get(&fe) else {
            return;
        };
        if entry.failed {
            return;
        }
        match packet.into_kind() {
            PacketKind::DialReq(req) => self.dial(now, fe, req, out),
            PacketKind::Data(data) => {
                let id = ConnId(data.connect_id);
                if id.0 == 0 {
                    return;
                }
                match self.owner(fe, id) {
                    Owner::Ours(backend) => {
                        out.push(Out::DataToBackend {
                            backend,
                            conn: id,
                            data: data.data,
                        });
                    }
                    Owner::Nobody => {
                        out.push(Out::ToFrontend(
                            fe,
                            Packet::close_response(id.0, NOT_INITIALIZED),
                        ));
                    }
                    Owner::Closed => {}
                    Owner::Other => self.mismatch(now, fe, id, out),
                }
            }
            PacketKind::CloseReq(req) => {
                let id = ConnId(req.connect_id);
                match self.owner(fe, id) {
                    Owner::Ours(backend) => {
                        out.push(Out::ToBackend(backend, Packet::close_request(id.0)));
                    }
                    Owner::Nobody => {
                        out.push(Out::ToFrontend(
                            fe,
                            Packet::close_response(id.0, UNINITIALIZED),
                        ));
                    }
                    Owner::Closed => {}
                    Owner::Other => self.mismatch(now, fe, id, out),
                }
            }
            PacketKind::DialCls(cls) => {
                let id = DialId(cls.random);
                if let Some(dial) = self.settle_if(id, |d| d.frontend == fe, out) {
                    self.sample_cut_short(now, &dial);
                    out.push(Out::Count(Event::DialFailed(DialFailure::FrontendClose)));
                    // ANP's agent ignores DIAL_CLS; ours stops dialing.
                    for attempt in &dial.attempts {
                        out.push(Out::ToBackend(attempt.backend, Packet::close_dial(id.0)));
                    }
                }
            }
            _ => {}
        }
    }

    fn owner(&self, fe: FrontendId, id: ConnId) -> Owner {
        let Some(entry) = self.frontends.get(&fe) else {
            return Owner::Other;
        };
        match entry.conns.get(&id) {
            Some(backend) => Owner::Ours(*backend),
            None if entry.recently_closed.contains(&id) => Owner::Closed,
            None if entry.conns.is_empty() && entry.pending.is_empty() && !entry.dialed => {
                Owner::Nobody
            }
            None => Owner::Other,
        }
    }

    /// The agent stream of a frontend's established connection.
    #[cfg(test)]
    pub(crate) fn route(&self, fe: FrontendId, id: ConnId) -> Option<BackendId> {
        let backend = *self.frontends.get(&fe)?.conns.get(&id)?;
        self.conn(backend, id).map(|_| backend)
    }

    fn conn(&self, backend: BackendId, id: ConnId) -> Option<ConnEntry> {
        self.backends.get(&backend)?.conns.get(&id).copied()
    }

    /// A frontend used a connection id it does not own: answer it and close
    /// the frontend's own connections (ANP), touching nobody else's.
    fn mismatch(&mut self, now: Instant, fe: FrontendId, bad: ConnId, out: &mut Vec<Out>) {
        let Some(entry) = self.frontends.get_mut(&fe) else {
            return;
        };
        entry.failed = true;
        let mut own: Vec<(ConnId, BackendId)> = entry.conns.iter().map(|(c, b)| (*c, *b)).collect();
        own.sort_unstable();
        out.push(Out::ToFrontend(
            fe,
            Packet::close_response(bad.0, MISMATCHED),
        ));
        for (id, backend) in own {
            self.remove_conn(now, backend, id, CloseReason::Mismatch, out);
            out.push(Out::ToBackend(backend, Packet::close_request(id.0)));
            out.push(Out::ToFrontend(
                fe,
                Packet::close_response(id.0, MISMATCHED),
            ));
        }
    }

    fn dial(&mut self, now: Instant, fe: FrontendId, req: DialRequest, out: &mut Vec<Out>) {
        let id = DialId(req.random);
        let too_long = if req.address.len() > MAX_ADDRESS {
            Some(DialError::AddressTooLong(req.address.len()))
        } else if req.protocol.len() > MAX_PROTOCOL {
            Some(DialError::ProtocolTooLong(req.protocol.len()))
        } else {
            None
        };
        let caps = self.policy.caps;
        let crowded = self
            .frontends
            .get(&fe)
            .is_some_and(|e| e.pending.len() >= caps.per_frontend);
        let refused = too_long.or(crowded.then_some(DialError::TooManyPending(caps.per_frontend)));
        if let Some(error) = refused {
            out.push(Out::DialFailed {
                frontend: fe,
                dial: id,
                error,
            });
            return;
        }
        let kind = self.frontends.get(&fe).map(|e| e.kind);
        let Some((backend, scope)) = self.pick(now, &req.address, &[]) else {
            // ANP counts it for gRPC frontends only; HTTP CONNECT answers 500.
            if kind == Some(FrontendKind::Grpc) {
                out.push(Out::Count(Event::DialFailed(DialFailure::NoAgent)));
            }
            // Agents at their cap are not picked: say so rather than "no
            // agent" when one of them is why.
            let error = if self.backends.values().any(|b| b.pending >= caps.per_agent) {
                DialError::AgentsBusy(caps.per_agent)
            } else {
                DialError::NoAgent
            };
            out.push(Out::DialFailed {
                frontend: fe,
                dial: id,
                error,
            });
            return;
        };
        if self.pending.contains_key(&id) {
            out.push(Out::DialFailed {
                frontend: fe,
                dial: id,
                error: DialError::IdPending,
            });
            return;
        }
        if let Some(entry) = self.frontends.get_mut(&fe) {
            entry.pending.insert(id);
            entry.dialed = true;
        }
        self.pending.insert(
            id,
            PendingDial {
                frontend: fe,
                protocol: req.protocol,
                address: req.address,
                attempts: Vec::with_capacity(1),
                tried: Vec::with_capacity(1),
                scope,
                retries_left: self.policy.retries,
                hedge: None,
                hedge_at: None,
                started: now,
                deadline: None,
            },
        );
        out.push(Out::Count(Event::DialPending));
        self.send_attempt(id, backend, out);
    }

    /// The backend for a dial to `address`, other than `tried`: by the
    /// strategies, the less loaded of two, load weighed by latency (an
    /// agent not dialed yet counts the median of the latest dials); and
    /// the candidates it was chosen among.
    fn pick(
        &mut self,
        now: Instant,
        address: &str,
        tried: &[BackendId],
    ) -> Option<(BackendId, Scope)> {
        let (typical, floor) = self.weights(now);
        let cost = weigh(
            &self.backends,
            self.policy.caps.per_agent,
            now,
            typical,
            floor,
        );
        self.manager.pick(address, tried, &cost)
    }

    /// Another backend among the candidates of `scope`, other than
    /// `tried`, weighed as [`Router::pick`] weighs them: a retry's or a
    /// hedge's, which never leaves the strategy and key of the first pick.
    fn pick_within(
        &mut self,
        now: Instant,
        scope: &Scope,
        tried: &[BackendId],
    ) -> Option<BackendId> {
        let (typical, floor) = self.weights(now);
        let cost = weigh(
            &self.backends,
            self.policy.caps.per_agent,
            now,
            typical,
            floor,
        );
        self.manager.pick_within(scope, tried, &cost)
    }

    /// What a pick weighs an agent with no estimate yet (the median of
    /// the latest dials), and the floor of every agent's latency (the
    /// agents' median, recomputed when stale).
    fn weights(&mut self, now: Instant) -> (Duration, Duration) {
        if self.median.is_stale(now) {
            self.median
                .recompute(now, self.backends.values().map(|b| (&*b.voice, &b.latency)));
        }
        let floor = self.median.get();
        let typical = self.latencies.delay(HedgeDelay::Percentile(50), floor);
        (typical, floor)
    }

    /// A sample of `backend`'s dial latency: `took`, or with `at_least`
    /// a lower bound that only raises its estimate.
    fn sample(&mut self, now: Instant, backend: BackendId, took: Duration, at_least: bool) {
        if let Some(entry) = self.backends.get_mut(&backend) {
            if at_least {
                entry.latency.observe_at_least(now, took);
            } else {
                entry.latency.observe(now, took);
            }
            self.median.sampled();
        }
    }

    /// Samples every attempt of a dial cut short (timed out, cancelled):
    /// each took at least as long as it has waited.
    fn sample_cut_short(&mut self, now: Instant, dial: &PendingDial) {
        for attempt in &dial.attempts {
            if let Some(forwarded) = attempt.forwarded {
                let waited = now.saturating_duration_since(forwarded);
                self.sample(now, attempt.backend, waited, true);
            }
        }
    }

    /// The agent stream a pending dial was hedged to, if it was.
    pub(crate) fn hedged_to(&self, dial: DialId) -> Option<BackendId> {
        self.pending.get(&dial)?.hedge
    }

    /// Sends a pending dial to `backend` too.
    fn send_attempt(&mut self, id: DialId, backend: BackendId, out: &mut Vec<Out>) {
        let Some(dial) = self.pending.get_mut(&id) else {
            return;
        };
        dial.attempts.push(Attempt {
            backend,
            forwarded: None,
        });
        dial.tried.push(backend);
        if let Some(entry) = self.backends.get_mut(&backend) {
            entry.pending += 1;
        }
        out.push(Out::Forward {
            frontend: dial.frontend,
            backend,
            dial: id,
            packet: Packet::dial_request(&dial.protocol, &dial.address, id.0),
        });
    }

    /// A dial's DIAL_REQ went out to `backend`: its answer is awaited for
    /// `--backend-dial-timeout` from the first one that did, and a second
    /// agent is asked after the hedge delay.
    pub(crate) fn dial_forwarded(&mut self, now: Instant, dial: DialId, backend: BackendId) {
        let Some(pending) = self.pending.get_mut(&dial) else {
            return;
        };
        let Some(attempt) = pending.attempts.iter_mut().find(|a| a.backend == backend) else {
            return;
        };
        if attempt.forwarded.is_none() {
            attempt.forwarded = Some(now);
            if let Some(entry) = self.backends.get_mut(&backend) {
                entry.forwarded.insert((now, dial));
            }
        }
        if let Some(limit) = self.policy.timeout
            && pending.deadline.is_none()
        {
            let deadline = now + limit;
            pending.deadline = Some(deadline);
            self.deadlines.insert((deadline, dial));
        }
        if let Some(hedge) = self.policy.hedge
            && pending.hedge.is_none()
            && pending.hedge_at.is_none()
        {
            let at = now + self.latencies.delay(hedge, self.median.get());
            pending.hedge_at = Some(at);
            self.hedges.insert((at, dial));
        }
    }

    /// A dial's DIAL_REQ could not go out to `backend`; a timed-out agent
    /// stream is retired (no new dials, its stream ended), as ANP does,
    /// and the dial fails; a closed one's dial is retried.
    pub(crate) fn dial_not_forwarded(
        &mut self,
        now: Instant,
        fe: FrontendId,
        dial: DialId,
        backend: BackendId,
        why: ForwardFailure,
        out: &mut Vec<Out>,
    ) {
        if !self
            .pending
            .get(&dial)
            .is_some_and(|d| d.frontend == fe && d.on(backend))
        {
            return;
        }
        let end = match why {
            ForwardFailure::Closed => AttemptEnd::Retry(
                DialRetry::NotForwarded,
                DialFailure::BackendClose,
                DialError::AgentStreamClosed,
            ),
            ForwardFailure::TimedOut => {
                self.retire(backend, out);
                AttemptEnd::Final(DialFailure::BackendDialTimeout, DialError::TimedOut)
            }
        };
        self.attempt_failed(now, dial, backend, end, out);
    }

    /// An agent's attempt at a dial ended without a connection: the dial
    /// goes on on its other attempt, is retried on another agent if `end`
    /// allows and the budget has room, or fails.
    fn attempt_failed(
        &mut self,
        now: Instant,
        id: DialId,
        backend: BackendId,
        end: AttemptEnd,
        out: &mut Vec<Out>,
    ) {
        let Some(dial) = self.pending.get_mut(&id) else {
            return;
        };
        let Some(at) = dial.attempts.iter().position(|a| a.backend == backend) else {
            return;
        };
        let attempt = dial.attempts.swap_remove(at);
        if let Some(entry) = self.backends.get_mut(&backend) {
            entry.release(id, &attempt);
        }
        // A refusal ends the dial whatever else is in flight (below).
        if !matches!(end, AttemptEnd::Refused(..)) && !dial.attempts.is_empty() {
            return;
        }
        let (failure, error) = match end {
            AttemptEnd::Retry(reason, failure, error) => {
                if dial.retries_left > 0 && self.retry(now, id, reason, out) {
                    return;
                }
                (failure, error)
            }
            AttemptEnd::Final(failure, error) | AttemptEnd::Refused(failure, error) => {
                (failure, error)
            }
        };
        if let Some(dial) = self.settle_if(id, |_| true, out) {
            // Attempts still in flight (a refused dial's hedge) are
            // cancelled as a won dial's losers are: late answers closed.
            for other in &dial.attempts {
                self.cancelled.insert(id, other.backend);
                out.push(Out::ToBackend(other.backend, Packet::close_dial(id.0)));
            }
            out.push(Out::Count(Event::DialFailed(failure)));
            out.push(Out::DialFailed {
                frontend: dial.frontend,
                dial: id,
                error,
            });
        }
    }

    /// Sends a dial whose last attempt failed to another agent, if one
    /// fits: among the candidates of its first pick, or, when its agent is
    /// gone, by a fresh pick (which may fall through the strategy list, as
    /// a new dial would). Whether it did.
    fn retry(&mut self, now: Instant, id: DialId, reason: DialRetry, out: &mut Vec<Out>) -> bool {
        let Some(dial) = self.pending.get(&id) else {
            return false;
        };
        let tried = dial.tried.clone();
        let next = if reason.agent_gone() {
            let address = dial.address.clone();
            self.pick(now, &address, &tried).map(|(next, scope)| {
                if let Some(dial) = self.pending.get_mut(&id) {
                    dial.scope = scope;
                }
                next
            })
        } else {
            let scope = dial.scope.clone();
            self.pick_within(now, &scope, &tried)
        };
        let Some(next) = next else {
            return false;
        };
        if let Some(dial) = self.pending.get_mut(&id) {
            dial.retries_left -= 1;
        }
        out.push(Out::Count(Event::DialRetried(reason)));
        self.send_attempt(id, next, out);
        true
    }

    /// Takes a backend out of service: no new dials, its stream ended.
    fn retire(&mut self, backend: BackendId, out: &mut Vec<Out>) {
        self.manager.set_draining(backend);
        self.manager.remove(backend);
        out.push(Out::EndBackend(backend));
    }

    /// Removes a pending dial if `belongs` says it is the caller's, forgets
    /// it in its frontend and its agents' loads, and says it is settled.
    fn settle_if(
        &mut self,
        id: DialId,
        belongs: impl FnOnce(&PendingDial) -> bool,
        out: &mut Vec<Out>,
    ) -> Option<PendingDial> {
        if !self.pending.get(&id).is_some_and(belongs) {
            return None;
        }
        let dial = self.pending.remove(&id)?;
        compact(&mut self.pending);
        if let Some(deadline) = dial.deadline {
            self.deadlines.remove(&(deadline, id));
        }
        if let Some(at) = dial.hedge_at {
            self.hedges.remove(&(at, id));
        }
        for attempt in &dial.attempts {
            if let Some(entry) = self.backends.get_mut(&attempt.backend) {
                entry.release(id, attempt);
            }
        }
        if let Some(entry) = self.frontends.get_mut(&dial.frontend) {
            entry.pending.remove(&id);
        }
        out.push(Out::Settled(id));
        Some(dial)
    }

    /// A packet from an agent (its DATA and credit only when the agent
    /// stream's driver did not know the connection).
    pub(crate) fn backend_packet(
        &mut self,
        now: Instant,
        be: BackendId,
        packet: Packet,
        out: &mut Vec<Out>,
    ) {
        if !self.backends.contains_key(&be) || flow::parse_credit(&packet).is_some() {
            // Credit for a connection that is gone is moot.
            return;
        }
        match packet.into_kind() {
            PacketKind::DialRsp(rsp) => self.dial_response(now, be, rsp, out),
            PacketKind::Data(data) => {
                let id = ConnId(data.connect_id);
                if self.conn(be, id).is_none() && id.0 != 0 {
                    out.push(Out::ToBackend(be, Packet::close_request(id.0)));
                }
            }
            PacketKind::CloseRsp(rsp) => {
                let id = ConnId(rsp.connect_id);
                let reason = if rsp.error.is_empty() {
                    CloseReason::Closed
                } else {
                    CloseReason::Error
                };
                if let Some(frontend) = self.remove_conn(now, be, id, reason, out) {
                    out.push(Out::ToFrontend(
                        frontend,
                        Packet::close_response(id.0, &rsp.error),
                    ));
                }
            }
            PacketKind::DialCls(cls) => {
                let id = DialId(cls.random);
                // With another attempt in flight, the dial goes on there.
                let last = self
                    .pending
                    .get(&id)
                    .is_some_and(|d| d.on(be) && d.attempts.len() == 1);
                if self.pending.get(&id).is_some_and(|d| d.on(be)) {
                    // The agent gave the dial up: a failure of its own.
                    self.sample(now, be, FAILURE_COST, true);
                }
                if last {
                    if let Some(dial) = self.settle_if(id, |_| true, out) {
                        out.push(Out::ToFrontend(dial.frontend, Packet::close_dial(id.0)));
                    }
                } else if let Some(dial) = self.pending.get_mut(&id)
                    && let Some(at) = dial.attempts.iter().position(|a| a.backend == be)
                {
                    let attempt = dial.attempts.swap_remove(at);
                    if let Some(entry) = self.backends.get_mut(&be) {
                        entry.release(id, &attempt);
                    }
                }
            }
            PacketKind::Drain => self.manager.set_draining(be),
            _ => {}
        }
    }

    /// An agent's DIAL_RSP: the dial fails, or its connection opens.
    fn dial_response(
        &mut self,
        now: Instant,
        be: BackendId,
        rsp: proto::DialResponse,
        out: &mut Vec<Out>,
    ) {
        let id = DialId(rsp.random);
        let conn = ConnId(rsp.connect_id);
        if !self.pending.get(&id).is_some_and(|d| d.on(be)) {
            self.stray_response(be, id, &rsp, out);
            return;
        }
        if !rsp.error.is_empty() {
            self.dial_refused(now, be, id, rsp, out);
            return;
        }
        let Some(dial) = self.settle_if(id, |_| true, out) else {
            return;
        };
        self.dial_won(id, be, &dial, now, out);
        let fe = dial.frontend;
        let Some(entry) = self.frontends.get(&fe).filter(|e| !e.failed) else {
            // The frontend is gone or failed.
            out.push(Out::Count(Event::DialFailed(DialFailure::FrontendClose)));
            out.push(Out::ToBackend(be, Packet::close_request(conn.0)));
            return;
        };
        let reused = self
            .backends
            .get(&be)
            .is_some_and(|b| b.conns.contains_key(&conn));
        if reused || entry.conns.contains_key(&conn) {
            // The agent answered with an id that is already in use, by
            // this stream (only a broken agent does that: the live
            // connection is left alone) or by another connection of the
            // frontend, over another agent.
            out.push(Out::Count(Event::DialFailed(DialFailure::ErrorResponse)));
            if !reused {
                out.push(Out::ToBackend(be, Packet::close_request(conn.0)));
            }
            out.push(Out::DialFailed {
                frontend: fe,
                dial: id,
                error: DialError::ConnIdInUse(conn),
            });
            return;
        }
        self.open(now, fe, be, conn, out);
        out.push(Out::Established {
            frontend: fe,
            backend: be,
            conn,
            packet: Packet::dial_response(id.0, conn.0, ""),
            latency: now.saturating_duration_since(dial.started),
        });
    }

    /// A DIAL_RSP from `be` for no dial in flight on it: counted as
    /// unrecognized, unless it answers an attempt closed because another
    /// agent answered first; either way a connection it opened is closed.
    fn stray_response(
        &mut self,
        be: BackendId,
        id: DialId,
        rsp: &proto::DialResponse,
        out: &mut Vec<Out>,
    ) {
        if !self.cancelled.take(id, be) {
            out.push(Out::Count(Event::DialFailed(
                DialFailure::UnrecognizedResponse,
            )));
        }
        if rsp.connect_id != 0 && rsp.error.is_empty() {
            out.push(Out::ToBackend(be, Packet::close_request(rsp.connect_id)));
        }
    }

    /// An error DIAL_RSP from `be` for a dial in flight on it: sampled as a
    /// failure, and the attempt ends ([`Self::attempt_failed`]), as one
    /// that may be retried if the error is [`retryable`].
    fn dial_refused(
        &mut self,
        now: Instant,
        be: BackendId,
        id: DialId,
        rsp: proto::DialResponse,
        out: &mut Vec<Out>,
    ) {
        // A failure weighs at least FAILURE_COST: an agent that fails
        // dials at once must not look fast.
        let took = self
            .pending
            .get(&id)
            .and_then(|d| d.attempts.iter().find(|a| a.backend == be))
            .and_then(|a| a.forwarded)
            .map_or(Duration::ZERO, |at| now.saturating_duration_since(at));
        self.sample(now, be, took.max(FAILURE_COST), false);
        let retry = retryable(&rsp);
        let denied = rsp.error_class() == proto::DialErrorClass::Denied;
        let error = DialError::Agent {
            class: rsp.error_class(),
            text: rsp.error,
        };
        let end = if denied {
            AttemptEnd::Refused(DialFailure::ErrorResponse, error)
        } else if retry {
            AttemptEnd::Retry(DialRetry::Refused, DialFailure::ErrorResponse, error)
        } else {
            AttemptEnd::Final(DialFailure::ErrorResponse, error)
        };
        self.attempt_failed(now, id, be, end, out);
    }

    /// A dial's attempt on `be` succeeded: its other attempt is cancelled
    /// (DIAL_CLS; its late answer closed), its latency learnt.
    fn dial_won(
        &mut self,
        id: DialId,
        be: BackendId,
        dial: &PendingDial,
        now: Instant,
        out: &mut Vec<Out>,
    ) {
        for attempt in &dial.attempts {
            let took = attempt
                .forwarded
                .map(|forwarded| now.saturating_duration_since(forwarded));
            if let Some(took) = took {
                // The loser's is how long it had taken so far: a lower bound.
                self.sample(now, attempt.backend, took, attempt.backend != be);
            }
            if attempt.backend == be {
                if let (Some(took), Some(entry)) = (took, self.backends.get(&be)) {
                    self.latencies.observe(took, &entry.voice);
                }
            } else {
                self.cancelled.insert(id, attempt.backend);
                out.push(Out::ToBackend(attempt.backend, Packet::close_dial(id.0)));
            }
        }
        if dial.hedge == Some(be) {
            out.push(Out::Count(Event::HedgeWon));
        }
    }

    /// Enters an established connection in both tables.
    fn open(
        &mut self,
        now: Instant,
        fe: FrontendId,
        be: BackendId,
        conn: ConnId,
        out: &mut Vec<Out>,
    ) {
        if let Some(entry) = self.frontends.get_mut(&fe) {
            entry.conns.insert(conn, be);
        }
        if let Some(backend) = self.backends.get_mut(&be) {
            backend.conns.insert(
                conn,
                ConnEntry {
                    frontend: fe,
                    established: now,
                },
            );
        }
        out.push(Out::Opened {
            backend: be,
            conn,
            frontend: fe,
        });
        out.push(Out::Count(Event::Established));
    }

    /// Removes an established connection from both tables (its waits end)
    /// and counts its end; the frontend it belonged to, if it was there.
    fn remove_conn(
        &mut self,
        now: Instant,
        be: BackendId,
        id: ConnId,
        reason: CloseReason,
        out: &mut Vec<Out>,
    ) -> Option<FrontendId> {
        let backend = self.backends.get_mut(&be)?;
        let conn = backend.conns.remove(&id)?;
        compact(&mut backend.conns);
        out.push(Out::Closed {
            backend: be,
            conn: id,
        });
        if let Some(entry) = self.frontends.get_mut(&conn.frontend) {
            entry.close_conn(id);
        }
        out.push(Out::Count(Event::Closed(
            reason,
            now.saturating_duration_since(conn.established),
        )));
        Some(conn.frontend)
    }

    /// The DIAL_RSP of an established connection could not reach its
    /// frontend (its stream is gone): the connection is closed on the agent.
    pub(crate) fn dial_rsp_undelivered(
        &mut self,
        fe: FrontendId,
        be: BackendId,
        conn: ConnId,
        out: &mut Vec<Out>,
    ) {
        if self
            .conn(be, conn)
            .is_some_and(|entry| entry.frontend == fe)
        {
            out.push(Out::Count(Event::DialFailed(DialFailure::SendRsp)));
            if let Some(backend) = self.backends.get_mut(&be)
                && backend.conns.remove(&conn).is_some()
            {
                compact(&mut backend.conns);
                out.push(Out::Closed { backend: be, conn });
            }
            if let Some(entry) = self.frontends.get_mut(&fe) {
                entry.close_conn(conn);
            }
            out.push(Out::ToBackend(be, Packet::close_request(conn.0)));
        }
    }

    /// A connection's frontend fell a window behind: it is closed on both
    /// ends with [`flow::OVERFLOW`] rather than stall the agent stream.
    pub(crate) fn overflow(&mut self, now: Instant, be: BackendId, id: ConnId, out: &mut Vec<Out>) {
        self.close_on_both_ends(now, be, id, CloseReason::Overflow, flow::OVERFLOW, out);
    }

    fn close_on_both_ends(
        &mut self,
        now: Instant,
        be: BackendId,
        id: ConnId,
        reason: CloseReason,
        error: &str,
        out: &mut Vec<Out>,
    ) {
        if let Some(frontend) = self.remove_conn(now, be, id, reason, out) {
            out.push(Out::ToBackend(be, Packet::close_request(id.0)));
            out.push(Out::ToFrontend(
                frontend,
                Packet::close_response(id.0, error),
            ));
        }
    }

    /// Closes a connection whose upload stalled while it held up the other
    /// connections of its frontend's stream, or the frontend's close, with
    /// an error at both ends:
    /// CLOSE_REQ to the agent, CLOSE_RSP with [`UPLOAD_STALLED`] to the
    /// frontend.
    pub(crate) fn upload_stalled(
        &mut self,
        now: Instant,
        be: BackendId,
        id: ConnId,
        out: &mut Vec<Out>,
    ) {
        self.close_on_both_ends(now, be, id, CloseReason::UploadStalled, UPLOAD_STALLED, out);
    }

    /// Closes the connections whose frontend left their queued DATA untaken
    /// for `--frontend-stall-timeout` (the driver, which keeps their flow
    /// state, found them), with an error at both ends: CLOSE_REQ to the
    /// agent, CLOSE_RSP with [`STALLED`] to the frontend; an HTTP CONNECT
    /// frontend's stream is ended (its socket closed), as its one
    /// connection is.
    pub(crate) fn close_stalled(
        &mut self,
        now: Instant,
        stalled: &[(BackendId, ConnId)],
        out: &mut Vec<Out>,
    ) {
        let mut stalled: Vec<(BackendId, ConnId, FrontendId)> = stalled
            .iter()
            .filter_map(|&(be, id)| Some((be, id, self.conn(be, id)?.frontend)))
            .collect();
        stalled.sort_unstable();
        for (be, id, fe) in stalled {
            self.close_on_both_ends(now, be, id, CloseReason::Stalled, STALLED, out);
            if self
                .frontends
                .get(&fe)
                .is_some_and(|e| e.kind == FrontendKind::HttpConnect)
            {
                out.push(Out::EndFrontend(fe));
            }
        }
    }

    /// A frontend stream ended: its dials are cancelled and its
    /// connections closed on the agents.
    pub(crate) fn frontend_closed(&mut self, now: Instant, fe: FrontendId, out: &mut Vec<Out>) {
        let Some(entry) = self.frontends.remove(&fe) else {
            return;
        };
        compact(&mut self.frontends);
        let mut pending: Vec<DialId> = entry.pending.iter().copied().collect();
        pending.sort_unstable();
        for id in pending {
            if let Some(dial) = self.settle_if(id, |d| d.frontend == fe, out) {
                self.sample_cut_short(now, &dial);
                // ANP counts a gRPC frontend's pending dials only on DIAL_CLS.
                if entry.kind == FrontendKind::HttpConnect {
                    out.push(Out::Count(Event::DialFailed(DialFailure::FrontendClose)));
                }
                for attempt in &dial.attempts {
                    out.push(Out::ToBackend(attempt.backend, Packet::close_dial(id.0)));
                }
            }
        }
        let mut conns: Vec<(ConnId, BackendId)> = entry.conns.into_iter().collect();
        conns.sort_unstable();
        for (id, be) in conns {
            if self
                .remove_conn(now, be, id, CloseReason::FrontendGone, out)
                .is_some()
            {
                out.push(Out::ToBackend(be, Packet::close_request(id.0)));
            }
        }
    }

    /// An agent stream ended: its connections are closed towards their
    /// frontends and its pending dials go to another agent (within the
    /// retry budget) or fail at once (not left to a backstop).
    pub(crate) fn backend_closed(&mut self, now: Instant, be: BackendId, out: &mut Vec<Out>) {
        let Some(entry) = self.backends.remove(&be) else {
            return;
        };
        self.manager.remove(be);
        if let Some(streams) = self.voices.get_mut(&entry.voice) {
            *streams -= 1;
            if *streams == 0 {
                self.voices.remove(&entry.voice);
            }
        }
        let agent = entry.info.agent_id.clone();
        let reason = DialError::AgentGone(agent.clone()).to_string();
        let mut conns: Vec<_> = entry.conns.into_iter().collect();
        conns.sort_unstable_by_key(|(id, _)| *id);
        for (id, conn) in conns {
            out.push(Out::Closed {
                backend: be,
                conn: id,
            });
            out.push(Out::Count(Event::Closed(
                CloseReason::AgentGone,
                now.saturating_duration_since(conn.established),
            )));
            if let Some(frontend) = self.frontends.get_mut(&conn.frontend) {
                frontend.close_conn(id);
            }
            out.push(Out::ToFrontend(
                conn.frontend,
                Packet::close_response(id.0, &reason),
            ));
        }
        let mut dials: Vec<DialId> = self
            .pending
            .iter()
            .filter(|(_, d)| d.on(be))
            .map(|(id, _)| *id)
            .collect();
        dials.sort_unstable();
        for id in dials {
            let end = AttemptEnd::Retry(
                DialRetry::AgentGone,
                DialFailure::BackendClose,
                DialError::AgentGone(agent.clone()),
            );
            self.attempt_failed(now, id, be, end, out);
        }
    }

    /// When the earliest pending dial times out or is hedged, if any.
    pub(crate) fn poll_timeout(&self) -> Option<Instant> {
        let deadline = self.deadlines.first().map(|(at, _)| *at);
        let hedge = self.hedges.first().map(|(at, _)| *at);
        deadline.into_iter().chain(hedge).min()
    }

    /// Fails the dials whose `--backend-dial-timeout` passed by `now`:
    /// DIAL_RSP with [`DialError::TimedOut`] to the frontend, DIAL_CLS to
    /// each agent it was in flight on; hedges those whose hedge delay
    /// passed.
    pub(crate) fn handle_timeout(&mut self, now: Instant, out: &mut Vec<Out>) {
        while let Some((at, id)) = self.deadlines.first().copied() {
            if at > now {
                break;
            }
            self.deadlines.remove(&(at, id));
            if let Some(dial) = self.settle_if(id, |_| true, out) {
                self.sample_cut_short(now, &dial);
                out.push(Out::Count(Event::DialFailed(
                    DialFailure::BackendDialTimeout,
                )));
                out.push(Out::DialFailed {
                    frontend: dial.frontend,
                    dial: id,
                    error: DialError::TimedOut,
                });
                for attempt in &dial.attempts {
                    out.push(Out::ToBackend(attempt.backend, Packet::close_dial(id.0)));
                }
            }
        }
        while let Some((at, id)) = self.hedges.first().copied() {
            if at > now {
                break;
            }
            self.hedges.remove(&(at, id));
            self.hedge(now, id, out);
        }
    }

    /// A dial's hedge delay passed without a DIAL_RSP: a second agent is
    /// asked, if the strategies offer one.
    fn hedge(&mut self, now: Instant, id: DialId, out: &mut Vec<Out>) {
        let Some(dial) = self.pending.get_mut(&id) else {
            return;
        };
        dial.hedge_at = None;
        if dial.hedge.is_some() || dial.attempts.len() != 1 {
            return;
        }
        let (scope, tried) = (dial.scope.clone(), dial.tried.clone());
        let Some(second) = self.pick_within(now, &scope, &tried) else {
            return;
        };
        if let Some(dial) = self.pending.get_mut(&id) {
            dial.hedge = Some(second);
        }
        out.push(Out::Count(Event::DialHedged));
        self.send_attempt(id, second, out);
    }

    /// Checks that the tables agree with each other; panics naming the
    /// first that does not. The fuzz target (`fuzz/fuzz_targets/router.rs`)
    /// and the property tests call it after every event:
    /// - an established connection is in both its backend's and its
    ///   frontend's table, pointing at each other, and a failed frontend
    ///   has none;
    /// - a pending dial is in its frontend's pending set and in flight on
    ///   one or (hedged) two connected backends, each tried once, within
    ///   its retry budget, each a candidate of the strategy and key of the
    ///   pick that chose it (a retry or hedge never leaves them; only a new
    ///   pick after an agent is gone may); the dials forwarded on a
    ///   backend are in flight there; a frontend's pending set names only its own
    ///   dials; a backend's load counts exactly the dials in flight on it;
    /// - the deadlines and hedge timers are exactly the pending dials';
    /// - the strategies index connected backends only;
    /// - a frontend remembers at most [`RECENTLY_CLOSED`] closed ids.
    #[cfg(any(test, feature = "fuzzing"))]
    pub(crate) fn check(&self) {
        let caps = self.policy.caps;
        let mut voices: HashMap<&str, usize> = HashMap::new();
        for backend in self.backends.values() {
            *voices.entry(&backend.voice).or_default() += 1;
        }
        assert_eq!(
            voices,
            self.voices.iter().map(|(v, n)| (&**v, *n)).collect(),
            "the streams counted per voice are the streams open"
        );
        for (be, backend) in &self.backends {
            assert!(
                backend.pending <= caps.per_agent,
                "be{be} has {} dials pending, over its cap",
                backend.pending
            );
            for (id, conn) in &backend.conns {
                let frontend = self.frontends.get(&conn.frontend).unwrap_or_else(|| {
                    panic!("conn {id} of be{be}: frontend fe{} gone", conn.frontend)
                });
                assert_eq!(
                    frontend.conns.get(id),
                    Some(be),
                    "conn {id} of be{be} missing from fe{}",
                    conn.frontend
                );
            }
        }
        for (fe, frontend) in &self.frontends {
            assert!(
                !frontend.failed || frontend.conns.is_empty(),
                "failed fe{fe} keeps connections"
            );
            assert!(frontend.recently_closed.len() <= RECENTLY_CLOSED);
            assert!(
                frontend.pending.len() <= caps.per_frontend,
                "fe{fe} has {} dials pending, over its cap",
                frontend.pending.len()
            );
            for (id, be) in &frontend.conns {
                assert_eq!(
                    self.conn(*be, *id).map(|c| c.frontend),
                    Some(*fe),
                    "conn {id} of fe{fe} missing from be{be}"
                );
            }
            for dial in &frontend.pending {
                assert_eq!(
                    self.pending.get(dial).map(|d| d.frontend),
                    Some(*fe),
                    "dial {dial} of fe{fe} is not pending for it"
                );
            }
        }
        self.check_dials();
        for be in self.manager.indexed() {
            assert!(self.backends.contains_key(&be), "be{be} indexed but gone");
        }
    }

    /// [`Router::check`]'s part for pending dials.
    #[cfg(any(test, feature = "fuzzing"))]
    fn check_dials(&self) {
        let mut deadlines = 0;
        let mut hedges = 0;
        let mut loads: HashMap<BackendId, usize> = HashMap::new();
        for (id, dial) in &self.pending {
            assert!(
                self.frontends
                    .get(&dial.frontend)
                    .is_some_and(|f| f.pending.contains(id)),
                "dial {id} missing from fe{}",
                dial.frontend
            );
            assert!(
                (1..=2).contains(&dial.attempts.len()),
                "dial {id} in flight on {} agents",
                dial.attempts.len()
            );
            self.check_attempts(*id, dial, &mut loads);
            let mut tried = dial.tried.clone();
            tried.sort_unstable();
            tried.dedup();
            assert_eq!(
                tried.len(),
                dial.tried.len(),
                "dial {id} sent twice to one agent"
            );
            assert!(
                dial.tried.len() <= 2 + self.policy.retries as usize,
                "dial {id} tried past its budget"
            );
            assert!(
                dial.attempts.len() < 2 || dial.hedge.is_some(),
                "dial {id}: two attempts unhedged"
            );
            if let Some(at) = dial.deadline {
                assert!(
                    self.deadlines.contains(&(at, *id)),
                    "dial {id}: deadline not kept"
                );
                deadlines += 1;
            }
            if let Some(at) = dial.hedge_at {
                assert!(
                    self.hedges.contains(&(at, *id)),
                    "dial {id}: hedge not kept"
                );
                hedges += 1;
            }
        }
        assert_eq!(
            deadlines,
            self.deadlines.len(),
            "deadlines of no pending dial"
        );
        assert_eq!(hedges, self.hedges.len(), "hedges of no pending dial");
        self.check_loads(&loads);
    }

    /// [`Router::check_dials`]'s part for the attempts of dial `id`: each
    /// on a connected backend that was tried, in the dial's scope unless
    /// retired; each counted in `loads`, by backend.
    #[cfg(any(test, feature = "fuzzing"))]
    fn check_attempts(
        &self,
        id: DialId,
        dial: &PendingDial,
        loads: &mut HashMap<BackendId, usize>,
    ) {
        for attempt in &dial.attempts {
            assert!(
                self.backends.contains_key(&attempt.backend),
                "dial {id} pending on a gone be{}",
                attempt.backend
            );
            // A retired agent is no longer indexed; any other is one of
            // the candidates of the pick that chose it.
            assert!(
                !self.manager.is_indexed(attempt.backend)
                    || self.manager.in_scope(&dial.scope, attempt.backend),
                "dial {id} in flight on be{} outside its strategy and key {:?}",
                attempt.backend,
                dial.scope
            );
            assert!(
                dial.tried.contains(&attempt.backend),
                "dial {id}: attempt not tried"
            );
            *loads.entry(attempt.backend).or_default() += 1;
        }
    }

    /// [`Router::check_dials`]'s part for the backends: each one's load is
    /// its count in `loads` (the attempts in flight on it), and the dials
    /// it counts as forwarded are in flight there.
    #[cfg(any(test, feature = "fuzzing"))]
    fn check_loads(&self, loads: &HashMap<BackendId, usize>) {
        for (be, backend) in &self.backends {
            assert_eq!(
                backend.pending,
                loads.get(be).copied().unwrap_or(0),
                "be{be}: pending dials miscounted"
            );
            for (at, id) in &backend.forwarded {
                assert!(
                    self.pending.get(id).is_some_and(|d| d
                        .attempts
                        .iter()
                        .any(|a| a.backend == *be && a.forwarded == Some(*at))),
                    "be{be}: dial {id} counted as forwarded, not in flight there"
                );
            }
            assert!(backend.forwarded.len() <= backend.pending);
        }
    }

    /// The least a pick at `now` can weigh `backend`: its cost with no
    /// latency for an agent without an estimate and no floor (a pick's
    /// is never lower); `None` for a backend that is gone. For the fuzz
    /// target's bounds; it changes nothing (a pick recomputes the median).
    #[cfg(any(test, feature = "fuzzing"))]
    pub(crate) fn least_cost(&self, now: Instant, backend: BackendId) -> Option<usize> {
        let entry = self.backends.get(&backend)?;
        Some(entry.cost(now, Duration::ZERO, Duration::ZERO))
    }

    /// Whether `backend` was at its cap of pending dials
    /// (`--max-pending-dials-per-agent`) before the dial just sent to
    /// `chosen`; for the fuzz target's pick check.
    #[cfg(any(test, feature = "fuzzing"))]
    pub(crate) fn was_full(&self, backend: BackendId, chosen: BackendId) -> bool {
        self.backends.get(&backend).is_some_and(|entry| {
            entry.pending - usize::from(backend == chosen) >= self.policy.caps.per_agent
        })
    }

    /// What the pick that just chose weighed `backend` at `now`, as it
    /// weighed it (the median and the typical latency as it left them;
    /// `chosen`: the pick then sent it the dial, one more than it weighed).
    /// Read only.
    #[cfg(any(test, feature = "fuzzing"))]
    pub(crate) fn picked_cost(&self, now: Instant, backend: BackendId, chosen: bool) -> usize {
        let floor = self.median.get();
        let typical = self.latencies.last_delay(50, floor);
        self.backends.get(&backend).map_or(usize::MAX, |entry| {
            let mut cost = entry.cost(now, typical, floor);
            if chosen {
                cost = cost / (entry.load() + 1) * entry.load();
            }
            cost
        })
    }

    /// The agents' median as last computed: what a hedge armed now is
    /// floored at.
    #[cfg(any(test, feature = "fuzzing"))]
    pub(crate) fn median(&self) -> Duration {
        self.median.get()
    }

    /// The hedge delay a dial forwarded at `now` would get.
    #[cfg(test)]
    pub(crate) fn hedge_delay(&mut self, now: Instant) -> Duration {
        let hedge = self.policy.hedge.unwrap_or(HedgeDelay::Percentile(95));
        let (_, floor) = self.weights(now);
        self.latencies.delay(hedge, floor)
    }

    /// Connected agent streams.
    pub(crate) fn backend_count(&self) -> usize {
        self.backends.len()
    }

    /// Frontend streams.
    pub(crate) fn frontend_count(&self) -> usize {
        self.frontends.len()
    }

    /// Dials waiting for a DIAL_RSP.
    pub(crate) fn pending_count(&self) -> usize {
        self.pending.len()
    }

    /// Established connections.
    pub(crate) fn established_count(&self) -> usize {
        self.backends.values().map(|b| b.conns.len()).sum()
    }

    /// Ready when the first strategy has an agent (ANP's `/readyz`).
    pub(crate) fn is_ready(&self) -> bool {
        self.manager.is_ready()
    }

    /// Distinct agent keys per strategy (`ready_backends`).
    pub(crate) fn ready_backends(&self) -> Vec<(ProxyStrategy, usize)> {
        self.manager.ready_backends()
    }

    /// Each agent stream: its agent id and whether it is draining.
    pub(crate) fn agents(&self) -> Vec<(BackendId, AgentId, bool)> {
        self.backends
            .iter()
            .map(|(id, b)| (*id, b.info.agent_id.clone(), self.manager.is_draining(*id)))
            .collect()
    }
}

#[cfg(test)]
mod tests;
