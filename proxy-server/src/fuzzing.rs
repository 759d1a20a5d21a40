//! Fuzzing entry points (cargo-fuzz targets in `fuzz/`, and their corpora
//! replayed by the tests below). Not an API: compiled for tests and under
//! the `fuzzing` feature only, which no binary enables.
//!
//! Each function takes bytes a peer controls and panics when an invariant
//! the code promises does not hold (see `docs/fuzzing.md`).

use std::{
    collections::{HashMap, HashSet},
    future::Future,
    pin::{Pin, pin},
    task::{Context, Poll, Waker},
    time::{Duration, Instant},
};

use bytes::Bytes;
use http::StatusCode;
use prost::Message;
use proto::Packet;
use tokio::io::{AsyncRead, ReadBuf};
use tunnel::{
    flow,
    ids::{AgentId, ConnId, DialId},
};

use crate::{
    auth::{self, AuthError, claims::ClaimsError},
    events::DialError,
    frontend::http_connect::head::{self, HeadError},
    router::{
        AgentInfo, BackendId, DialPolicy, ForwardFailure, FrontendId, FrontendKind, HedgeDelay,
        Out, Router,
    },
    strategy::{AgentIdentifiers, ProxyStrategy},
};

include!("../../fuzz/input.rs");

pub(crate) mod streams;
pub use streams::{grpc_packets, grpc_packets_alloc_bound};

/// The heap a [`router`] run may use at its peak for `len` input bytes: a
/// few hundred bytes of tables and outputs per step, each step at least a
/// byte.
pub fn router_alloc_bound(len: usize) -> usize {
    1024 * len + 256 * 1024
}

/// What the harness follows of a router's outputs, to check what the
/// router promises its transports.
#[derive(Default)]
struct Watch {
    /// Connections whose flow state the driver holds, and their frontend.
    open: HashMap<(BackendId, ConnId), FrontendId>,
    /// DIAL_REQs sent per (frontend, random).
    requests: HashMap<(FrontendId, i64), usize>,
    /// Answers (DIAL_RSP, DIAL_CLS) per (frontend, random).
    answers: HashMap<(FrontendId, i64), usize>,
    /// Backends connected and neither ended nor retired.
    live: HashSet<BackendId>,
    /// With destHost first: each backend's exact keys (host, ipv4, ipv6).
    keys: Option<HashMap<BackendId, Vec<String>>>,
    /// The DIAL_REQ a frontend sent in this step: its random and
    /// destination host.
    request: Option<(i64, String)>,
    /// Each pending dial's destination host, its agents so far, and
    /// whether its first DIAL_REQ went to an agent whose key is that host.
    sent_to: HashMap<i64, (String, Vec<BackendId>, bool)>,
    /// Pending dials one of whose agents ended or closed before its
    /// DIAL_REQ went out: only they may leave their destHost key.
    agent_gone: HashSet<i64>,
    /// Each pending dial's frontend, from its first DIAL_REQ out.
    owner: HashMap<i64, FrontendId>,
    /// Each pending dial's attempts as far as the harness is sure of them:
    /// the agent stream, and when its DIAL_REQ went out (`dial_forwarded`).
    /// Added when the router sends one, removed on whatever may end it, so
    /// never one the router does not have.
    attempts: HashMap<i64, Vec<(BackendId, Option<Instant>)>>,
    /// When each pending dial forwarded with a `--backend-dial-timeout`
    /// must be answered by: its first DIAL_REQ out, plus the timeout.
    deadlines: HashMap<i64, Instant>,
    /// The earliest each pending dial may be hedged: over every
    /// `dial_forwarded` of it (any of which may arm the hedge), the least
    /// of when it came plus the least delay then (a fixed delay, or the
    /// agents' median and at least [`crate::router::FLOOR`]).
    hedge_after: HashMap<i64, Instant>,
    /// Per agent stream, a lower bound of its latency estimate (seconds,
    /// as of when): the samples the router surely took (a failure weighs
    /// [`crate::router::FAILURE_COST`], an attempt that ended how long it
    /// had waited), decayed as a peak EWMA decays, which no later sample
    /// lowers.
    estimates: HashMap<BackendId, (f64, Instant)>,
    /// Each pending dial's attempts as far as the router may still hold
    /// them: every DIAL_REQ it sent, and when it went out; removed only
    /// when the dial leaves the router's table (`Out::Settled`), so never
    /// fewer than the router has.
    may_hold: HashMap<i64, Vec<(BackendId, Option<Instant>)>>,
    /// Per agent stream, the largest sample the router may have taken of
    /// it from attempts no longer held: how long each had waited when its
    /// dial left the table, and [`crate::router::FAILURE_COST`] once it
    /// answered a dial with an error or a DIAL_CLS. A peak EWMA never
    /// exceeds its largest sample (a slower one is taken as is, a faster
    /// one averaged in), so with the ages of the attempts still held, this
    /// bounds its estimate from above.
    ceilings: HashMap<BackendId, Duration>,
    /// Frontends that broke the protocol (answered MISMATCHED): their
    /// dials may settle unanswered.
    failed: HashSet<FrontendId>,
    /// This event's DIAL_CLS from a frontend: the dial it settles is not
    /// answered.
    cancelling: Option<(FrontendId, i64)>,
    /// Frontends that end in this event: the dials they settle are not
    /// answered.
    closing: HashSet<FrontendId>,
}

impl Watch {
    /// The router's outputs for one event (`sender`: the frontend whose
    /// packet it was, if any), checked as they come: a connection opened
    /// once and closed once, DATA only on the sender's own connections,
    /// dials forwarded as [`Self::saw_forward`] says, no dial answered more
    /// often than it was made; then the dials that left the table
    /// ([`Self::settled`]).
    fn see(&mut self, sender: Option<FrontendId>, out: &[Out], now: Instant) {
        let mut settled = Vec::new();
        let mut answered = HashSet::new();
        let mut hedging = false;
        for o in out {
            match o {
                Out::Opened {
                    backend,
                    conn,
                    frontend,
                } => assert!(
                    self.open.insert((*backend, *conn), *frontend).is_none(),
                    "conn {conn} of be{backend} opened twice"
                ),
                Out::Closed { backend, conn } => assert!(
                    self.open.remove(&(*backend, *conn)).is_some(),
                    "conn {conn} of be{backend} closed but not open"
                ),
                Out::DataToBackend { backend, conn, .. } => {
                    let owner = self.open.get(&(*backend, *conn));
                    assert!(
                        owner.is_some() && owner.copied() == sender,
                        "DATA of {sender:?} sent on conn {conn} of be{backend}, owned by {owner:?}"
                    );
                }
                Out::Forward {
                    frontend,
                    backend,
                    dial,
                    packet,
                } => {
                    // With a traceparent (55 bytes and its framing) it
                    // stays far below any agent's decode limit.
                    assert!(
                        packet.encoded_len() <= FORWARD_LIMIT,
                        "a DIAL_REQ of {} bytes forwarded",
                        packet.encoded_len()
                    );
                    let hedged = std::mem::take(&mut hedging);
                    self.saw_forward(*frontend, *backend, *dial, hedged, now);
                }
                Out::Count(crate::router::Event::DialHedged) => hedging = true,
                Out::Settled(dial) => {
                    self.sent_to.remove(&dial.0);
                    self.agent_gone.remove(&dial.0);
                    settled.push(dial.0);
                }
                Out::EndBackend(backend) => {
                    self.live.remove(backend);
                }
                Out::ToFrontend(fe, packet) => self.saw_to_frontend(*fe, packet, &mut answered),
                Out::Established {
                    frontend, packet, ..
                } => {
                    if let proto::packet::PacketKind::DialRsp(r) = packet.clone().into_kind() {
                        self.answer(*frontend, r.random);
                        answered.insert((*frontend, r.random));
                    }
                }
                Out::DialFailed { frontend, dial, .. } => {
                    self.answer(*frontend, dial.0);
                    answered.insert((*frontend, dial.0));
                }
                _ => {}
            }
        }
        self.check_answer_counts();
        for dial in settled {
            self.settled(dial, &answered, now);
        }
    }

    /// A DIAL_REQ the router sent `backend` for `frontend`'s `dial`
    /// (`hedged`: as the dial's hedge): to a live agent, within the dial's
    /// destHost key, a hedge no earlier than the dial's least hedge delay;
    /// the attempt is followed from here.
    fn saw_forward(
        &mut self,
        frontend: FrontendId,
        backend: BackendId,
        dial: DialId,
        hedged: bool,
        now: Instant,
    ) {
        assert!(
            self.live.contains(&backend),
            "a dial forwarded to be{backend}, which is gone or retired"
        );
        self.stays_in_dest_host(backend, dial.0);
        if hedged && let Some(after) = self.hedge_after.get(&dial.0) {
            assert!(
                now >= *after,
                "dial {dial} hedged {:?} before its least hedge delay",
                after.saturating_duration_since(now)
            );
        }
        self.owner.insert(dial.0, frontend);
        self.attempts
            .entry(dial.0)
            .or_default()
            .push((backend, None));
        self.may_hold
            .entry(dial.0)
            .or_default()
            .push((backend, None));
    }

    /// A packet the router sent frontend `fe`: a DIAL_RSP or DIAL_CLS
    /// answers its dial (in this event: `answered`); a MISMATCHED CLOSE_RSP
    /// marks the frontend as one that broke the protocol.
    fn saw_to_frontend(
        &mut self,
        fe: FrontendId,
        packet: &Packet,
        answered: &mut HashSet<(FrontendId, i64)>,
    ) {
        match packet.clone().into_kind() {
            proto::packet::PacketKind::DialRsp(proto::DialResponse { random, .. })
            | proto::packet::PacketKind::DialCls(proto::CloseDial { random }) => {
                self.answer(fe, random);
                answered.insert((fe, random));
            }
            proto::packet::PacketKind::CloseRsp(c) if c.error == crate::MISMATCHED => {
                self.failed.insert(fe);
            }
            _ => {}
        }
    }

    /// No dial was answered more often than its frontend made it.
    fn check_answer_counts(&self) {
        for (dial, answers) in &self.answers {
            let made = self.requests.get(dial).copied().unwrap_or(0);
            assert!(
                *answers <= made,
                "dial {dial:?} answered {answers} times, made {made}"
            );
        }
    }

    /// A dial left the router's table: answered to its frontend in the
    /// same event, unless that frontend cancelled it, ended or broke the
    /// protocol; the attempts it still had were sampled by how long they
    /// waited.
    fn settled(&mut self, dial: i64, answered: &HashSet<(FrontendId, i64)>, now: Instant) {
        let fe = self
            .owner
            .remove(&dial)
            .unwrap_or_else(|| panic!("dial {dial} settled, never sent"));
        assert!(
            answered.contains(&(fe, dial))
                || self.cancelling == Some((fe, dial))
                || self.closing.contains(&fe)
                || self.failed.contains(&fe),
            "dial {dial} of fe{fe} left the table unanswered"
        );
        for (be, forwarded) in self.attempts.remove(&dial).unwrap_or_default() {
            if let Some(at) = forwarded {
                self.raise(be, now.saturating_duration_since(at), now);
            }
        }
        for (be, forwarded) in self.may_hold.remove(&dial).unwrap_or_default() {
            if let Some(at) = forwarded {
                self.lift(be, now.saturating_duration_since(at));
            }
        }
        self.deadlines.remove(&dial);
        self.hedge_after.remove(&dial);
    }

    fn answer(&mut self, fe: FrontendId, random: i64) {
        *self.answers.entry((fe, random)).or_default() += 1;
    }

    /// With destHost first, a dial whose first agent had its destination
    /// as a key is retried and hedged only on agents with that key, unless
    /// one of its agents went away.
    fn stays_in_dest_host(&mut self, backend: BackendId, random: i64) {
        let Some(keys) = &self.keys else {
            return;
        };
        let has_key = |host: &str| {
            keys.get(&backend)
                .is_some_and(|k| k.iter().any(|k| k == host))
        };
        let (host, agents, first_exact) = match self.sent_to.entry(random) {
            std::collections::hash_map::Entry::Occupied(dial) => dial.into_mut(),
            std::collections::hash_map::Entry::Vacant(new) => {
                // A dial's first DIAL_REQ goes out in the step its frontend
                // sent it.
                let Some((_, host)) = self.request.take().filter(|(r, _)| *r == random) else {
                    return;
                };
                let exact = has_key(&host);
                new.insert((host, Vec::new(), exact))
            }
        };
        let exact = has_key(host);
        assert!(
            !*first_exact || exact || self.agent_gone.contains(&random),
            "dial {random} to {host} left its destHost key for be{backend} with its agents alive"
        );
        agents.push(backend);
    }

    /// An agent went away: the dials it was sent may be picked afresh.
    fn agent_went_away(&mut self, backend: BackendId, random: Option<i64>) {
        for (dial, (_, agents, _)) in &self.sent_to {
            if agents.contains(&backend) && random.is_none_or(|r| r == *dial) {
                self.agent_gone.insert(*dial);
            }
        }
    }

    /// The lower bound of `be`'s latency estimate at `now`, in seconds.
    fn estimate(&self, be: BackendId, now: Instant) -> f64 {
        self.estimates.get(&be).map_or(0.0, |(secs, at)| {
            let since = now.saturating_duration_since(*at);
            secs * (-since.as_secs_f64() / crate::router::DECAY.as_secs_f64()).exp()
        })
    }

    /// The router may have sampled `be` with `sample`, and no later
    /// attempt of the dial is held.
    fn lift(&mut self, be: BackendId, sample: Duration) {
        let ceiling = self.ceilings.entry(be).or_default();
        *ceiling = (*ceiling).max(sample);
    }

    /// The most the router may weigh `be` in a pick at `now`, given `open`
    /// connections on it: one more than the attempts it may hold and its
    /// connections, times the larger of its ceiling and the age of every
    /// attempt it may hold (its latency estimate and its oldest dial out
    /// are both below that), in microseconds rounded up.
    fn most_cost(&self, be: BackendId, open: usize, now: Instant) -> usize {
        let mut load = open;
        let mut latency = self.ceilings.get(&be).copied().unwrap_or_default();
        for (b, forwarded) in self.may_hold.values().flatten() {
            if *b == be {
                load += 1;
                if let Some(at) = forwarded {
                    latency = latency.max(now.saturating_duration_since(*at));
                }
            }
        }
        let micros = usize::try_from(latency.as_micros() + 1).unwrap_or(usize::MAX);
        (load + 1).saturating_mul(micros)
    }

    /// The router surely sampled `be` at `now` with at least `sample`.
    fn raise(&mut self, be: BackendId, sample: Duration, now: Instant) {
        let kept = self.estimate(be, now);
        self.estimates
            .insert(be, (kept.max(sample.as_secs_f64()), now));
    }

    /// An agent's packet, before the router gets it: an error DIAL_RSP or
    /// a DIAL_CLS for a dial in flight on it ends that attempt, and is
    /// sampled as a failure (at least [`crate::router::FAILURE_COST`]).
    fn agent_sends(&mut self, be: BackendId, packet: &Packet, now: Instant) {
        if flow::parse_credit(packet).is_some() {
            return;
        }
        let (random, failed) = match packet.clone().into_kind() {
            proto::packet::PacketKind::DialRsp(r) if !r.error.is_empty() => (r.random, true),
            proto::packet::PacketKind::DialCls(c) => (c.random, false),
            _ => return,
        };
        // Whether or not the harness knows the attempt, the router may
        // have sampled it as a failure.
        self.lift(be, crate::router::FAILURE_COST);
        let Some(forwarded) = self.end_attempt(be, random) else {
            return;
        };
        let took = forwarded.map_or(Duration::ZERO, |at| now.saturating_duration_since(at));
        let cost = crate::router::FAILURE_COST;
        self.raise(be, if failed { took.max(cost) } else { cost }, now);
    }

    /// Forgets the attempt of `random` on `be`, if known: when its
    /// DIAL_REQ went out.
    fn end_attempt(&mut self, be: BackendId, random: i64) -> Option<Option<Instant>> {
        let list = self.attempts.get_mut(&random)?;
        let at = list.iter().position(|(b, _)| *b == be)?;
        Some(list.remove(at).1)
    }

    /// `dial_forwarded` of `random` on `be` at `now`, before the router
    /// hears it: the attempt's DIAL_REQ went out; the dial's deadline and
    /// its hedge are armed by the first that finds it.
    fn forwarded(
        &mut self,
        random: i64,
        be: BackendId,
        now: Instant,
        policy: DialPolicy,
        median: Duration,
    ) {
        if let Some(attempt) = self
            .may_hold
            .get_mut(&random)
            .and_then(|list| list.iter_mut().find(|(b, _)| *b == be))
        {
            attempt.1.get_or_insert(now);
        }
        if !self.owner.contains_key(&random) {
            return;
        }
        if let Some(hedge) = policy.hedge {
            let least = match hedge {
                HedgeDelay::Fixed(delay) => delay,
                HedgeDelay::Percentile(_) => median.max(crate::router::FLOOR),
            };
            let at = now + least;
            let earliest = self.hedge_after.entry(random).or_insert(at);
            *earliest = (*earliest).min(at);
        }
        let Some(attempt) = self
            .attempts
            .get_mut(&random)
            .and_then(|list| list.iter_mut().find(|(b, _)| *b == be))
        else {
            return;
        };
        attempt.1.get_or_insert(now);
        if let Some(limit) = policy.timeout {
            self.deadlines.entry(random).or_insert(now + limit);
        }
    }
}

/// The largest DIAL_REQ the router may forward to an agent: the longest
/// address and protocol, a random and their framing.
const FORWARD_LIMIT: usize = crate::events::MAX_ADDRESS + crate::events::MAX_PROTOCOL + 32;

/// A packet from `input`: built from a few choices, or decoded from raw
/// protobuf bytes (anything a peer can send).
fn packet(input: &mut Input<'_>) -> Option<Packet> {
    let id = input.id();
    Some(match input.below(9) {
        0 => {
            let address = ["10.0.0.1:443", "node-a:10250", "[::1]:80", "x"][input.below(4)];
            match input.below(8) {
                // A longest valid address, and one past each limit.
                0 => Packet::dial_request("tcp", &format!("{}:65535", "a".repeat(253)), id),
                1 => Packet::dial_request("tcp", &"a".repeat(crate::events::MAX_ADDRESS + 1), id),
                2 => {
                    Packet::dial_request(&"t".repeat(crate::events::MAX_PROTOCOL + 1), address, id)
                }
                _ => Packet::dial_request("tcp", address, id),
            }
        }
        1 => {
            let conn = input.id();
            let error = match input.byte() % 8 {
                0 => "dial tcp 10.0.0.1:443: connect: connection refused",
                1 => "dial tcp 10.0.0.1:443: i/o timeout",
                _ => "",
            };
            Packet::dial_response(id, conn, error)
        }
        2 => Packet::data(id, Bytes::copy_from_slice(input.bytes(8))),
        3 => Packet::close_request(id),
        4 => Packet::close_response(id, ""),
        5 => Packet::close_dial(id),
        6 => Packet::drain(),
        7 => flow::credit_packet(id, input.below(256) * 4096),
        _ => Packet::decode(input.bytes(48)).ok()?,
    })
}

/// A dial latency chosen by a byte: its cube in microseconds (0 to 16.6
/// s; 1 ms at 10, 125 ms at 50, 1 s at 100).
fn latency(input: &mut Input<'_>) -> Duration {
    Duration::from_micros(u64::from(input.byte()).pow(3))
}

/// The server's routing core fed a sequence of events chosen by `data`:
/// frontends and agent streams coming and going (an agent's identifiers
/// parsed from the bytes, as its metadata is), packets from either side
/// (built or decoded from raw bytes), dials forwarded or not, overflows,
/// stalls (of a frontend, of an upload), DIAL_RSPs that cannot be
/// delivered, and the clock; and sequences as the transports carry them
/// (every DIAL_REQ out at once, agents that answer after a latency the
/// input chooses, the timers when they are due), so that the
/// latency-weighted pick, retries and hedges with fixed and percentile
/// delays are reached.
///
/// After every event the router's own invariants hold
/// ([`Router::check`]) and its outputs keep their promises: a connection
/// is opened once and closed once, a frontend's DATA goes only to its own
/// connections, a dial goes only to a connected agent stream, no dial is
/// answered more often than it was made; liveness: a forwarded dial with
/// a `--backend-dial-timeout` has a timer no later than its deadline,
/// none is left pending once `handle_timeout` passed it, and no dial
/// leaves the table unanswered unless its frontend cancelled it, ended or
/// broke the protocol; fairness on lying agents: no hedge fires before the
/// least delay armed (a fixed delay, or the agents' median and at least
/// 1 ms), and no agent weighs less in a pick than what it surely did (a
/// failure at least `FAILURE_COST`, an attempt that ended what it had
/// waited, both decayed; a dial pending on it its age; its load) nor more
/// than its samples allow (its largest, its dials' ages, its load). Once
/// every stream has ended, every table is empty.
pub fn router(data: &[u8]) {
    let mut input = Input(data);
    let mut run = RouterRun::new(&mut input);
    while !input.is_empty() {
        run.step(&mut input);
    }
    run.finish();
}

/// The router under fuzzing and what the harness knows of it.
struct RouterRun {
    router: Router,
    now: Instant,
    policy: DialPolicy,
    frontends: Vec<FrontendId>,
    backends: Vec<BackendId>,
    watch: Watch,
    out: Vec<Out>,
    /// The next random of a dial the harness makes (op 16).
    next_random: i64,
    /// The next connection id the harness's agents answer with.
    next_conn: i64,
    /// With `default` the only strategy: each agent stream's agent, in
    /// the order they came (a pick's candidates are each agent's first).
    agents: Option<HashMap<BackendId, usize>>,
    /// Agent streams that announced DRAIN.
    draining: HashSet<BackendId>,
}

impl RouterRun {
    /// A router with strategies, a dial policy and a seed drawn from `input`.
    fn new(input: &mut Input<'_>) -> Self {
        let strategies: &[ProxyStrategy] = match input.below(4) {
            0 => &[ProxyStrategy::Default],
            1 => &[ProxyStrategy::DestHost, ProxyStrategy::Default],
            2 => &[ProxyStrategy::DefaultRoute],
            _ => &[ProxyStrategy::DestHost, ProxyStrategy::DefaultRoute],
        };
        let timeout = input
            .byte()
            .is_multiple_of(2)
            .then_some(Duration::from_secs(5));
        let policy = DialPolicy {
            timeout,
            retries: u32::from(input.byte() % 3),
            hedge: match input.byte() % 8 {
                1 => Some(HedgeDelay::Fixed(Duration::from_secs(1))),
                2 => Some(HedgeDelay::Percentile(95)),
                3 => Some(HedgeDelay::Fixed(Duration::from_millis(50))),
                4 => Some(HedgeDelay::Percentile(50)),
                5 => Some(HedgeDelay::Percentile(99)),
                6 => Some(HedgeDelay::Percentile(90)),
                _ => None,
            },
            // Now and then caps small enough to be reached.
            caps: if input.byte().is_multiple_of(4) {
                crate::router::DialCaps {
                    per_frontend: 1 + input.below(4),
                    per_agent: 1 + input.below(4),
                    ..crate::router::DialCaps::default()
                }
            } else {
                crate::router::DialCaps::default()
            },
        };
        let seed = u64::from(input.byte());
        let watch = Watch {
            keys: (strategies[0] == ProxyStrategy::DestHost).then(HashMap::new),
            ..Watch::default()
        };
        Self {
            router: Router::new(strategies, policy, fastrand::Rng::with_seed(seed)),
            now: Instant::now(),
            policy,
            frontends: Vec::new(),
            backends: Vec::new(),
            watch,
            out: Vec::new(),
            next_random: 1 << 20,
            next_conn: 1 << 20,
            agents: (strategies == [ProxyStrategy::Default]).then(HashMap::new),
            draining: HashSet::new(),
        }
    }

    /// One event (ops 0 to 15; bytes 240 to 255 are ops 16 to 19, the
    /// transports' sequences) drawn from `input`, every invariant checked
    /// after each event.
    fn step(&mut self, input: &mut Input<'_>) {
        let op = match input.byte() {
            b @ 240.. => 16 + usize::from(b - 240) % 4,
            b => usize::from(b) % 16,
        };
        let fe =
            (!self.frontends.is_empty()).then(|| self.frontends[input.below(self.frontends.len())]);
        let be =
            (!self.backends.is_empty()).then(|| self.backends[input.below(self.backends.len())]);
        match op {
            16 => return self.full_dial(fe, input),
            17 => return self.agent_answers(input),
            18 => return self.timers(input),
            19 => return self.forward_all(),
            _ => {}
        }
        self.out.clear();
        let sender = match op {
            0..=1 => {
                self.add_stream(op, input);
                None
            }
            2..=11 => self.packet_event(op, fe, be, input),
            12 => {
                if let (Some(fe), Some(be)) = (fe, be) {
                    self.connection_event(fe, be, input);
                }
                None
            }
            13..=14 => {
                self.end_stream(op, fe, be);
                None
            }
            _ => {
                let b = input.byte();
                self.now += if b < 64 {
                    Duration::from_secs(u64::from(b % 8))
                } else {
                    Duration::from_millis(u64::from(b - 64) * 10)
                };
                self.router.handle_timeout(self.now, &mut self.out);
                None
            }
        };
        self.after(sender, op == 15);
    }

    /// What every event is followed by: its outputs seen, the router's
    /// invariants and the harness's checked; `ticked`: `handle_timeout`
    /// ran at `now`.
    fn after(&mut self, sender: Option<FrontendId>, ticked: bool) {
        self.watch.see(sender, &self.out, self.now);
        self.watch.request = None;
        self.watch.cancelling = None;
        self.watch.closing.clear();
        self.router.check();
        assert_eq!(self.watch.open.len(), self.router.established_count());
        let timer = self.router.poll_timeout();
        if let Some(at) = timer {
            assert!(
                at > self.now || !ticked,
                "a deadline at or before now survived handle_timeout"
            );
        }
        if let Some((dial, deadline)) = self.watch.deadlines.iter().min_by_key(|(_, at)| **at) {
            assert!(
                timer.is_some_and(|at| at <= *deadline),
                "dial {dial} forwarded with a deadline has no timer by then (next: {timer:?})"
            );
            assert!(
                !ticked || *deadline > self.now,
                "dial {dial} still pending after handle_timeout passed its deadline"
            );
        }
        self.check_costs();
        self.check_pick();
    }

    /// With `default` the only strategy and no agent draining, a new
    /// dial's agent is never costlier than every other candidate (each
    /// agent's first stream): the pick takes the cheaper of two.
    fn check_pick(&self) {
        let Some(agents) = &self.agents else {
            return;
        };
        let mut outs = self.out.iter();
        if !outs.any(|o| matches!(o, Out::Count(crate::router::Event::DialPending))) {
            return;
        }
        let Some(chosen) = outs.find_map(|o| match o {
            Out::Forward { backend, .. } => Some(*backend),
            _ => None,
        }) else {
            return;
        };
        let live: Vec<BackendId> = self
            .backends
            .iter()
            .copied()
            .filter(|b| self.watch.live.contains(b))
            .collect();
        if live.iter().any(|b| self.draining.contains(b)) {
            return;
        }
        // Each agent's first stream that was not at its cap of pending
        // dials.
        let mut candidates = Vec::new();
        for agent in 0..3 {
            if let Some(first) = live
                .iter()
                .find(|b| agents.get(b) == Some(&agent) && !self.router.was_full(**b, chosen))
            {
                candidates.push(*first);
            }
        }
        assert!(
            candidates.contains(&chosen),
            "the pick chose be{chosen}, not an agent's first stream with room: {candidates:?}"
        );
        if candidates.len() < 2 {
            return;
        }
        let cost = self.router.picked_cost(self.now, chosen, true);
        let others: Vec<(BackendId, usize)> = candidates
            .iter()
            .filter(|b| **b != chosen)
            .map(|b| (*b, self.router.picked_cost(self.now, *b, false)))
            .collect();
        assert!(
            others.iter().any(|(_, other)| *other >= cost),
            "the pick chose be{chosen} weighing {cost} over cheaper candidates {others:?}"
        );
    }

    /// No agent stream weighs less in a pick than what the harness knows
    /// it did: its load times the greater of its latency estimate's lower
    /// bound and the age of its oldest dial out; nor more than its samples
    /// and dials allow ([`Watch::most_cost`]): a router that inflated a
    /// healthy agent's cost would let a failing one win its picks.
    fn check_costs(&self) {
        for &be in &self.backends {
            let cost = self
                .router
                .least_cost(self.now, be)
                .unwrap_or_else(|| panic!("be{be} connected but not in the router"));
            let mut load = self.watch.open.keys().filter(|(b, _)| *b == be).count();
            let mut waited = Duration::ZERO;
            for attempts in self.watch.attempts.values() {
                for (b, forwarded) in attempts {
                    if *b == be {
                        load += 1;
                        if let Some(at) = forwarded {
                            waited = waited.max(self.now.saturating_duration_since(*at));
                        }
                    }
                }
            }
            let latency = self.watch.estimate(be, self.now).max(waited.as_secs_f64());
            // Microseconds, less what rounding may take off the router's.
            let micros = (latency * 1e6 * (1.0 - 1e-9) - 2.0).max(1.0);
            #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
            let least = (load + 1).saturating_mul(micros as usize);
            assert!(
                cost >= least,
                "be{be} weighs {cost} in a pick, less than the {least} it surely did ({load} dials and connections, {latency} s)"
            );
            let open = self.watch.open.keys().filter(|(b, _)| *b == be).count();
            let most = self.watch.most_cost(be, open, self.now);
            assert!(
                cost <= most,
                "be{be} weighs {cost} in a pick, more than the {most} its samples and dials allow"
            );
        }
    }

    /// Runs one router event at `now`, then what follows every event.
    fn act(
        &mut self,
        sender: Option<FrontendId>,
        ticked: bool,
        event: impl FnOnce(&mut Router, Instant, &mut Vec<Out>),
    ) {
        self.out.clear();
        event(&mut self.router, self.now, &mut self.out);
        self.after(sender, ticked);
    }

    /// The transport reports a DIAL_REQ out (`dial_forwarded`).
    fn forward(&mut self, dial: DialId, be: BackendId) {
        let median = self.router.median();
        self.watch
            .forwarded(dial.0, be, self.now, self.policy, median);
        self.router.dial_forwarded(self.now, dial, be);
        self.out.clear();
        self.after(None, false);
    }

    /// The transports carry the last event's DIAL_REQs out at once.
    fn carry(&mut self) {
        let forwards: Vec<(DialId, BackendId)> = self
            .out
            .iter()
            .filter_map(|o| match o {
                Out::Forward { dial, backend, .. } => Some((*dial, *backend)),
                _ => None,
            })
            .collect();
        for (dial, be) in forwards {
            self.forward(dial, be);
        }
    }

    /// The clock moves on by `by`; the timers due by then run.
    fn advance(&mut self, by: Duration) {
        self.now += by;
        if self.router.poll_timeout().is_some_and(|at| at <= self.now) {
            self.act(None, true, |router, now, out| {
                router.handle_timeout(now, out)
            });
            self.carry();
        }
    }

    /// An agent's packet as its stream's driver hands it over.
    fn agent_packet(&mut self, be: BackendId, packet: Packet) {
        self.watch.agent_sends(be, &packet, self.now);
        self.act(None, false, |router, now, out| {
            router.backend_packet(now, be, packet, out);
        });
    }

    /// Op 16: a dial as the transports carry it: a frontend's DIAL_REQ
    /// (a random of its own), its DIAL_REQ out at once, and after a
    /// latency the input chooses, its agent's answer.
    fn full_dial(&mut self, fe: Option<FrontendId>, input: &mut Input<'_>) {
        let Some(fe) = fe else {
            return;
        };
        let random = self.next_random;
        self.next_random += 1;
        let address = ["10.0.0.1:443", "node-a:10250"][input.below(2)];
        *self.watch.requests.entry((fe, random)).or_default() += 1;
        self.watch.request = Some((random, crate::strategy::host_of(address).to_owned()));
        let packet = Packet::dial_request("tcp", address, random);
        self.act(Some(fe), false, |router, now, out| {
            router.frontend_packet(now, fe, packet, out);
        });
        self.carry();
        let be = self
            .watch
            .attempts
            .get(&random)
            .and_then(|list| list.first())
            .map(|(be, _)| *be);
        if let Some(be) = be {
            self.answer(random, be, input);
        }
    }

    /// Op 17: an agent answers one of the dials in flight on it (the
    /// input picks which) after a latency the input chooses.
    fn agent_answers(&mut self, input: &mut Input<'_>) {
        let mut attempts: Vec<(i64, BackendId)> = self
            .watch
            .attempts
            .iter()
            .flat_map(|(dial, list)| list.iter().map(|(be, _)| (*dial, *be)))
            .collect();
        if attempts.is_empty() {
            return;
        }
        attempts.sort_unstable();
        let (random, be) = attempts[input.below(attempts.len())];
        self.answer(random, be, input);
    }

    /// After a latency the input chooses (the timers due meanwhile run
    /// first), `be` answers dial `random`: established, refused (another
    /// agent may serve it), timed out (none would), its own DIAL_CLS, or
    /// nothing. What the router sends on goes out at once.
    fn answer(&mut self, random: i64, be: BackendId, input: &mut Input<'_>) {
        self.advance(latency(input));
        let packet = match input.below(6) {
            0 | 1 => {
                let conn = self.next_conn;
                self.next_conn += 1;
                Packet::dial_response(random, conn, "")
            }
            2 => Packet::dial_response(
                random,
                0,
                "dial tcp 10.0.0.1:443: connect: connection refused",
            ),
            3 => Packet::dial_response(random, 0, "dial tcp 10.0.0.1:443: i/o timeout"),
            4 => Packet::close_dial(random),
            _ => return,
        };
        if self.backends.contains(&be) {
            self.agent_packet(be, packet);
            self.carry();
        }
    }

    /// Op 18: the clock moves to the next timer (and up to 2 ms past),
    /// which runs; what it sends goes out at once.
    fn timers(&mut self, input: &mut Input<'_>) {
        let Some(at) = self.router.poll_timeout() else {
            return;
        };
        let past = Duration::from_millis(input.below(3) as u64);
        self.now = self.now.max(at) + past;
        self.act(None, true, |router, now, out| {
            router.handle_timeout(now, out)
        });
        self.carry();
    }

    /// Op 19: every DIAL_REQ not yet reported out is.
    fn forward_all(&mut self) {
        let mut waiting: Vec<(i64, BackendId)> = self
            .watch
            .attempts
            .iter()
            .flat_map(|(dial, list)| {
                list.iter()
                    .filter(|(_, at)| at.is_none())
                    .map(|(be, _)| (*dial, *be))
            })
            .collect();
        waiting.sort_unstable();
        for (random, be) in waiting {
            self.forward(DialId(random), be);
        }
    }

    /// Op 0: a frontend stream; op 1: an agent stream.
    fn add_stream(&mut self, op: usize, input: &mut Input<'_>) {
        if op == 0 {
            let kind = if input.byte().is_multiple_of(2) {
                FrontendKind::Grpc
            } else {
                FrontendKind::HttpConnect
            };
            self.frontends.push(self.router.add_frontend(kind));
            return;
        }
        let which = input.below(3);
        let agent = ["a", "b", "c"][which];
        let query = String::from_utf8_lossy(input.bytes(40)).into_owned();
        let identifiers = AgentIdentifiers::parse(&query);
        let keys: Vec<String> = identifiers.dest_host_keys().map(str::to_owned).collect();
        let id = self.router.add_backend(AgentInfo {
            agent_id: AgentId(agent.to_owned()),
            identifiers,
            credential: None,
        });
        if let Some(all) = &mut self.watch.keys {
            all.insert(id, keys);
        }
        self.watch.live.insert(id);
        self.backends.push(id);
        if let Some(agents) = &mut self.agents {
            agents.insert(id, which);
        }
    }

    /// Ops 2 to 11: a packet from a frontend or an agent, a DIAL_REQ
    /// forwarded or not. Returns the frontend that sent a packet.
    fn packet_event(
        &mut self,
        op: usize,
        fe: Option<FrontendId>,
        be: Option<BackendId>,
        input: &mut Input<'_>,
    ) -> Option<FrontendId> {
        let now = self.now;
        match op {
            2..=5 => {
                let (Some(fe), Some(packet)) = (fe, packet(input)) else {
                    return None;
                };
                match packet.clone().into_kind() {
                    proto::packet::PacketKind::DialReq(r) => {
                        *self.watch.requests.entry((fe, r.random)).or_default() += 1;
                        let host = crate::strategy::host_of(&r.address).to_owned();
                        self.watch.request = Some((r.random, host));
                    }
                    proto::packet::PacketKind::DialCls(c) => {
                        self.watch.cancelling = Some((fe, c.random));
                    }
                    _ => {}
                }
                self.router.frontend_packet(now, fe, packet, &mut self.out);
                return Some(fe);
            }
            6..=9 => {
                if let (Some(be), Some(packet)) = (be, packet(input)) {
                    if packet.r#type == proto::PacketType::Drain as i32 {
                        self.draining.insert(be);
                    }
                    self.watch.agent_sends(be, &packet, now);
                    self.router.backend_packet(now, be, packet, &mut self.out);
                }
            }
            10 => {
                if let Some(be) = be {
                    let dial = DialId(input.id());
                    let median = self.router.median();
                    self.watch.forwarded(dial.0, be, now, self.policy, median);
                    self.router.dial_forwarded(now, dial, be);
                }
            }
            _ => {
                if let (Some(fe), Some(be)) = (fe, be) {
                    let why = if input.byte().is_multiple_of(2) {
                        ForwardFailure::Closed
                    } else {
                        ForwardFailure::TimedOut
                    };
                    let dial = DialId(input.id());
                    if why == ForwardFailure::Closed {
                        self.watch.agent_went_away(be, Some(dial.0));
                    }
                    self.watch.end_attempt(be, dial.0);
                    self.router
                        .dial_not_forwarded(now, fe, dial, be, why, &mut self.out);
                }
            }
        }
        None
    }

    /// Op 12: a DIAL_RSP undelivered, an overflow or a stall of one connection.
    fn connection_event(&mut self, fe: FrontendId, be: BackendId, input: &mut Input<'_>) {
        let (now, out) = (self.now, &mut self.out);
        let conn = ConnId(input.id());
        match input.below(4) {
            0 => self.router.dial_rsp_undelivered(fe, be, conn, out),
            1 => self.router.overflow(now, be, conn, out),
            2 => self.router.upload_stalled(now, be, conn, out),
            _ => self.router.close_stalled(now, &[(be, conn)], out),
        }
    }

    /// Op 13: a frontend stream ends; op 14: an agent stream ends.
    fn end_stream(&mut self, op: usize, fe: Option<FrontendId>, be: Option<BackendId>) {
        match (op, fe, be) {
            (13, Some(fe), _) => {
                self.watch.closing.insert(fe);
                self.router.frontend_closed(self.now, fe, &mut self.out);
                self.frontends.retain(|f| *f != fe);
            }
            (14, _, Some(be)) => self.backend_ends(be),
            _ => {}
        }
    }

    /// An agent stream ends: its attempts end with it.
    fn backend_ends(&mut self, be: BackendId) {
        self.watch.agent_went_away(be, None);
        for list in self.watch.attempts.values_mut() {
            list.retain(|(b, _)| *b != be);
        }
        self.router.backend_closed(self.now, be, &mut self.out);
        self.backends.retain(|b| *b != be);
        self.watch.live.remove(&be);
    }

    /// Every stream ends: every table must be empty.
    fn finish(mut self) {
        self.out.clear();
        for fe in std::mem::take(&mut self.frontends) {
            self.watch.closing.insert(fe);
            self.router.frontend_closed(self.now, fe, &mut self.out);
        }
        for be in self.backends.clone() {
            self.backend_ends(be);
        }
        self.watch.see(None, &self.out, self.now);
        let router = &self.router;
        router.check();
        assert!(
            self.watch.open.is_empty(),
            "flow state left for {:?}",
            self.watch.open
        );
        assert!(
            self.watch.owner.is_empty() && self.watch.deadlines.is_empty(),
            "dials left pending for the harness: {:?}",
            self.watch.owner
        );
        assert_eq!(
            (
                router.frontend_count(),
                router.backend_count(),
                router.pending_count(),
                router.established_count()
            ),
            (0, 0, 0, 0)
        );
        assert_eq!(router.poll_timeout(), None);
        assert!(!router.is_ready());
    }
}

/// A reader that hands over `pieces` one per read, then the end.
struct Pieces<'a> {
    pieces: Vec<&'a [u8]>,
}

impl AsyncRead for Pieces<'_> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if let Some(first) = self.pieces.first_mut() {
            let n = first.len().min(buf.remaining());
            buf.put_slice(&first[..n]);
            *first = &first[n..];
            if first.is_empty() {
                self.pieces.remove(0);
            }
        }
        Poll::Ready(Ok(()))
    }
}

/// Polls a future that never waits (every byte is in memory) to its end.
fn ready<F: Future>(future: F) -> F::Output {
    let mut future = pin!(future);
    let mut cx = Context::from_waker(Waker::noop());
    match future.as_mut().poll(&mut cx) {
        Poll::Ready(output) => output,
        Poll::Pending => panic!("an in-memory read made the parser wait"),
    }
}

/// The heap a [`connect_head`] run may use at its peak for `len` bytes.
pub fn connect_head_alloc_bound(len: usize) -> usize {
    16 * len + 256 * 1024
}

/// Reads a CONNECT request head from the bytes after a few choices, as
/// they would arrive cut into pieces (the cuts chosen too), then answers a
/// failed dial with an agent's error text (also from the bytes). Checks,
/// against the head as [`Reading`] reads it by hand: a head accepted is
/// complete there; its method is the request line's and its target the
/// request line's (else the `Host`'s); what followed the head, the bytes
/// kept with it and those still unread, is exactly what the client sent
/// after it, in a buffer of its own size; the head parses the same
/// however it is cut (accepted whole, accepted in pieces; refused alike);
/// the error page repeats at most a bounded prefix of the target and the
/// agent's text.
pub fn connect_head(data: &[u8]) {
    let mut input = Input(data);
    let cuts: Vec<usize> = (0..input.below(8)).map(|_| input.below(64) + 1).collect();
    let error_text = String::from_utf8_lossy(input.bytes(64)).repeat(input.below(4) * 64 + 1);
    let stream = input.0;
    let whole = read(vec![stream]);
    let mut pieces = Vec::new();
    let mut rest = stream;
    for cut in cuts {
        let (piece, tail) = rest.split_at(cut.min(rest.len()));
        pieces.push(piece);
        rest = tail;
    }
    pieces.push(rest);
    let cut = read(pieces);
    match (&whole, &cut) {
        (Ok(a), Ok(b)) => assert_eq!(a, b, "cut differently, parsed differently"),
        (Ok(_), Err(e)) => panic!("a head accepted whole is refused in pieces ({e})"),
        (Err(_), Ok(_)) => panic!("a head refused whole is accepted in pieces"),
        (Err(_), Err(_)) => {}
    }
    if let Ok((_, target, _)) = &whole {
        let error = DialError::Agent {
            text: error_text.clone(),
            class: proto::DialErrorClass::Unspecified,
        };
        let page = head::dial_error_response(&error, target);
        let bound = 6 * proto::text::ECHO_LIMIT + 256;
        assert!(page.len() <= bound, "an error page of {} bytes", page.len());
        assert!(page.starts_with(b"HTTP/1.1 50"));
    }
}

/// `read_head` over `pieces`: the method, the target and every byte the
/// client sent after the head (those read with it, then those still
/// unread), each checked against the [`Reading`] of the whole stream.
fn read(pieces: Vec<&[u8]>) -> Result<(String, String, Vec<u8>), &'static str> {
    let stream: Vec<u8> = pieces.concat();
    let mut reader = Pieces { pieces };
    match ready(head::read_head(&mut reader)) {
        Ok(head) => {
            let reading = Reading::of(&stream).expect("a head accepted before its blank line");
            let after = [&head.rest[..], &reader.pieces.concat()].concat();
            assert!(
                after == stream[reading.end..],
                "{} bytes after the head, {} sent ({} kept with it, {} unread)",
                after.len(),
                stream.len() - reading.end,
                head.rest.len(),
                after.len() - head.rest.len()
            );
            assert!(
                head.rest.capacity() <= head.rest.len().max(64),
                "{} bytes kept in a buffer of {}",
                head.rest.len(),
                head.rest.capacity()
            );
            assert_eq!(
                head.method.as_bytes(),
                reading.method,
                "the method is not the request line's"
            );
            assert!(
                head.target.as_bytes() == reading.target.as_slice(),
                "the target {:?} is not the request line's or the Host's, {:?}",
                head.target,
                String::from_utf8_lossy(&reading.target)
            );
            Ok((head.method, head.target, after))
        }
        Err(HeadError::Gone) => Err("gone"),
        Err(HeadError::Malformed) => Err("malformed"),
        Err(HeadError::TooLarge) => Err("too large"),
    }
}

/// A request head read by hand as RFC 9112 lays it out (§2.2, §3, §5),
/// for the [`connect_head`] oracle: lines end with LF (a CR before it is
/// dropped), blank lines before the request line are skipped, the request
/// line is method SP target SP version, and the head ends with the first
/// empty line after it. It does not judge validity (httparse does, in the
/// server): it only says where a head ends and what it names.
struct Reading<'a> {
    /// The request line's first word.
    method: &'a [u8],
    /// The request line's second word; when that is empty, the first
    /// `Host` header's value without surrounding blanks.
    target: Vec<u8>,
    /// Where the head ends: its empty line's LF, plus one.
    end: usize,
}

impl<'a> Reading<'a> {
    /// The head at the start of `stream`, if its empty line has come.
    fn of(stream: &'a [u8]) -> Option<Self> {
        let mut at = 0;
        let mut line = || {
            let len = stream[at..].iter().position(|b| *b == b'\n')?;
            let line = &stream[at..at + len];
            at += len + 1;
            Some(line.strip_suffix(b"\r").unwrap_or(line))
        };
        let request = loop {
            let request = line()?;
            if !request.is_empty() {
                break request;
            }
        };
        let mut words = request.splitn(3, |b| *b == b' ');
        let method = words.next().unwrap_or_default();
        let mut target = words.next().unwrap_or_default().to_vec();
        let mut host = None;
        loop {
            let header = line()?;
            if header.is_empty() {
                break;
            }
            if let Some(colon) = header.iter().position(|b| *b == b':')
                && header[..colon].eq_ignore_ascii_case(b"host")
                && host.is_none()
            {
                host = Some(header[colon + 1..].trim_ascii().to_vec());
            }
        }
        if target.is_empty() {
            target = host.unwrap_or_default();
        }
        Some(Self {
            method,
            target,
            end: at,
        })
    }
}

/// The heap a [`token_review`] run may use at its peak for `len` bytes:
/// the body read twice, its log lines, a runtime and a kube client.
pub fn token_review_alloc_bound(len: usize) -> usize {
    64 * len + 1024 * 1024
}

/// Whom the fuzzed reviews must name to admit an agent.
const EXPECTED: auth::Expected<'static> = auth::Expected {
    namespace: "kube-system",
    service_account: "konnectivity-agent",
    audience: "system:konnectivity-server",
};

/// The token the fuzzed reviews are about: a JWT that passes the local
/// checks (our audience, expiring in 2100; its signature segment is
/// base64url of "s3cr3t-fuzz-token"), so that every check reaches the API.
/// No error and no log line may show it.
const TOKEN: &str = "eyJhbGciOiJSUzI1NiJ9.eyJhdWQiOlsic3lzdGVtOmtvbm5lY3Rpdml0eS1zZXJ2ZXIiXSwiZXhwIjo0MTAyNDQ0ODAwfQ.czNjcjN0LWZ1enotdG9rZW4";

/// A request the [`StubApi`] was sent: its method, path and body.
type Sent = (http::Method, String, Bytes);

/// The kube API of [`token_review`]: answers every request with one status
/// code and body, and keeps the requests. A 1xx code stands for no answer:
/// 100, none ever (the review times out); the others, a failed connection
/// whose error text is the body.
#[derive(Clone)]
struct StubApi {
    /// The answer's status code.
    code: StatusCode,
    /// The answer's body.
    body: Bytes,
    /// What was sent, in order.
    sent: std::sync::Arc<std::sync::Mutex<Vec<Sent>>>,
}

impl tower::Service<http::Request<kube::client::Body>> for StubApi {
    type Response = http::Response<http_body_util::Full<Bytes>>;
    type Error = std::io::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<kube::client::Body>) -> Self::Future {
        use http_body_util::BodyExt as _;
        let api = self.clone();
        Box::pin(async move {
            let (parts, body) = request.into_parts();
            let body = body
                .collect()
                .await
                .map(|b| b.to_bytes())
                .unwrap_or_default();
            let sent = (parts.method, parts.uri.path().to_owned(), body);
            api.sent.lock().expect("not poisoned").push(sent);
            match api.code.as_u16() {
                100 => std::future::pending().await,
                101..=199 => Err(std::io::Error::other(
                    String::from_utf8_lossy(&api.body).into_owned(),
                )),
                _ => Ok(http::Response::builder()
                    .status(api.code)
                    .body(http_body_util::Full::new(api.body))
                    .expect("a status and a body make a response")),
            }
        })
    }
}

/// Every log line written while it is the writer, as the binaries format
/// them (`tracing_subscriber::fmt`).
#[derive(Clone, Default)]
struct Logs(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Logs {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .expect("not poisoned")
            .extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Logs {
    type Writer = Self;

    fn make_writer(&'a self) -> Self {
        self.clone()
    }
}

/// A TokenReview answer (the status code from the first two bytes, the
/// body after them) to an agent's `Connect`, through the real path: the
/// `authorization` metadata, the local checks, the reviews' cache and
/// bounds (`auth::reviews`), the POST through a kube client, the reading
/// of the answer and its verdict (`TokenAuth::authenticate`, its kube
/// client on [`StubApi`]); the agent connects twice. Every log line at
/// any level is captured. Checks: the token is in no log line and in no
/// error's text, debug form or gRPC status; the API was asked about this
/// token, for our audience, once, and again only if its first answer may
/// not be reused; both connects get the same verdict; a verdict on the
/// token comes from a 2xx answer only, and an agent is admitted only if
/// the answer, read independently as plain JSON, says the token is
/// authenticated, for our audience, as our service account; the reading
/// alone (`auth::read_answer`) never quotes a 2xx body.
pub fn token_review(data: &[u8]) {
    let mut input = Input(data);
    let code = 100 + (usize::from(input.byte()) << 8 | usize::from(input.byte())) % 500;
    let code = StatusCode::from_u16(u16::try_from(code).unwrap_or(200)).unwrap_or(StatusCode::OK);
    let body = input.0;
    if code.is_success()
        && let Err(reason) = auth::read_answer(code, body)
    {
        assert!(
            !reason.contains(TOKEN),
            "a 2xx answer's body quoted: {reason}"
        );
    }
    let api = StubApi {
        code,
        body: Bytes::copy_from_slice(body),
        sent: std::sync::Arc::default(),
    };
    let (verdicts, checked) = connect_twice_logged(api.clone());
    for error in verdicts.iter().filter_map(|v| v.as_ref().err()) {
        let shown = format!("{error}\n{error:?}\n{}", error.status().message());
        assert!(!shown.contains(TOKEN), "the token shown: {shown}");
    }
    // The reviews; reads of the signing keys (a GET) are not.
    let sent: Vec<Sent> = api
        .sent
        .lock()
        .expect("not poisoned")
        .iter()
        .filter(|(method, ..)| method != http::Method::GET)
        .cloned()
        .collect();
    let first = &verdicts[0];
    let reused = match first {
        Ok(_) => true,
        Err(AuthError::Review(_) | AuthError::StatusError(_)) => false,
        Err(error) => !error.is_load(),
    };
    assert_eq!(
        sent.len(),
        if reused { 1 } else { 2 },
        "TokenReview calls for two connects, after {first:?}"
    );
    check_reviews_sent(&sent);
    assert_eq!(
        checked.first(),
        Some(&auth::Checked::Answered(auth::reviews::Source::Api))
    );
    assert_eq!(verdicts[0], verdicts[1], "the same answer, another verdict");
    check_verdict(code, body, first);
}

/// [`connect_twice`] with every log line at any level captured, as the
/// binaries format them: the token is in none of them.
fn connect_twice_logged(
    api: StubApi,
) -> (Vec<Result<auth::Admitted, AuthError>>, Vec<auth::Checked>) {
    let logs = Logs::default();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_writer(logs.clone())
        .with_ansi(false)
        .finish();
    let outcome = tracing::subscriber::with_default(subscriber, || connect_twice(api));
    let logs = String::from_utf8_lossy(&logs.0.lock().expect("not poisoned")).into_owned();
    assert!(!logs.contains(TOKEN), "the token logged:\n{logs}");
    outcome
}

/// The TokenReviews the API was sent: each a POST to the TokenReview
/// path, about [`TOKEN`], for our audience.
fn check_reviews_sent(sent: &[Sent]) {
    for (method, path, request) in sent {
        assert_eq!(
            (method, path.as_str()),
            (
                &http::Method::POST,
                "/apis/authentication.k8s.io/v1/tokenreviews"
            )
        );
        let review: k8s_openapi::api::authentication::v1::TokenReview =
            serde_json::from_slice(request).expect("a TokenReview sent");
        assert_eq!(review.spec.token.as_deref(), Some(TOKEN));
        assert_eq!(
            review.spec.audiences,
            Some(vec![EXPECTED.audience.to_owned()])
        );
    }
}

/// The first verdict on the token against the answer (`code`, `body`)
/// it came from: a verdict on the token from a 2xx answer only, and an
/// agent admitted only if the answer, read independently as plain JSON,
/// says the token is authenticated, for our audience, as our service
/// account; refused never on a 2xx answer that says so.
fn check_verdict(code: StatusCode, body: &[u8], first: &Result<auth::Admitted, AuthError>) {
    // Strictly: JSON is UTF-8 (RFC 8259), so a body with bad UTF-8 in a
    // key is no answer, however it would read with the bytes replaced.
    let json = serde_json::from_slice::<serde_json::Value>(body).ok();
    match first {
        // A refusal: never on a 2xx answer that, read as plain JSON,
        // admits (our own agent refused is as much a failure as a
        // stranger admitted).
        Err(error) => {
            assert!(
                matches!(error, AuthError::Review(_)) || code.is_success(),
                "a verdict from a {code} answer"
            );
            // An answer the typed reader refuses (a known field of the
            // wrong type) is refused rightly, whatever it says.
            let readable = auth::read_answer(code, body).is_ok();
            assert!(
                !(code.is_success() && readable && json.as_ref().is_some_and(json_admits)),
                "refused ({error}) on a {code} answer that admits"
            );
            return;
        }
        Ok(admitted) => {
            assert!(code.is_success(), "admitted on a {code} answer");
            // The node it is bound to is the answer's first node-name
            // extra, whole up to the record limit, when there is one.
            if let Some(json) = &json {
                let named = json["status"]["user"]["extra"][auth::NODE_NAME_EXTRA][0]
                    .as_str()
                    .filter(|n| !n.is_empty());
                assert_eq!(
                    admitted.node,
                    named.map(|n| proto::text::for_record(n.to_owned())),
                    "the node of an admitted token"
                );
            }
        }
    }
    // Admitted: the answer says so, read as plain JSON. serde_json skips
    // an unknown field's string without checking it (bad UTF-8, a lone
    // surrogate escape), where a `Value` refuses the whole body; then the
    // typed answer is read field by field instead.
    let admitted = match json {
        Some(json) => json_admits(&json),
        None => {
            let review = auth::read_answer(code, body).expect("admitted on an unreadable answer");
            let status = review.status.unwrap_or_default();
            status.authenticated == Some(true)
                && status.error.is_none_or(|e| e.is_empty())
                && status.user.and_then(|u| u.username).as_deref()
                    == Some("system:serviceaccount:kube-system:konnectivity-agent")
                && status
                    .audiences
                    .unwrap_or_default()
                    .iter()
                    .any(|a| a == "system:konnectivity-server")
        }
    };
    assert!(admitted, "admitted on an answer that does not say so");
}

/// Whether a TokenReview, read as plain JSON, admits our agent: its token
/// authenticated, no error, our service account, our audience.
fn json_admits(json: &serde_json::Value) -> bool {
    let status = &json["status"];
    status["authenticated"] == serde_json::Value::Bool(true)
        && (status["error"].is_null() || status["error"] == "")
        && status["user"]["username"] == "system:serviceaccount:kube-system:konnectivity-agent"
        && status["audiences"]
            .as_array()
            .is_some_and(|a| a.iter().any(|a| a == "system:konnectivity-server"))
}

/// Two `Connect`s with [`TOKEN`] from one agent, checked by a
/// `TokenAuth` whose kube client is `api`: their verdicts, and what the
/// metrics were told of each.
fn connect_twice(api: StubApi) -> (Vec<Result<auth::Admitted, AuthError>>, Vec<auth::Checked>) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .expect("a current-thread runtime");
    runtime.block_on(async {
        let config = auth::TokenAuthConfig {
            namespace: EXPECTED.namespace.to_owned(),
            service_account: EXPECTED.service_account.to_owned(),
            audience: EXPECTED.audience.to_owned(),
            kubeconfig: None,
            cache_ttl: auth::DEFAULT_CACHE_TTL,
            max_in_flight: auth::DEFAULT_MAX_IN_FLIGHT,
            max_pending: auth::DEFAULT_MAX_PENDING,
            local_checks: true,
        };
        let checked = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let on_review: auth::OnReview = {
            let checked = checked.clone();
            std::sync::Arc::new(move |c| checked.lock().expect("not poisoned").push(c))
        };
        let auth =
            auth::TokenAuth::with_client(config, kube::Client::new(api, "default"), on_review);
        let mut metadata = tonic::metadata::MetadataMap::new();
        let bearer = format!("{}{TOKEN}", proto::header::BEARER_PREFIX);
        metadata.insert(
            proto::header::AUTHORIZATION,
            bearer.parse().expect("a token is header text"),
        );
        let peer = Some(std::net::IpAddr::from([10, 0, 0, 7]));
        let mut verdicts = Vec::new();
        for _ in 0..2 {
            verdicts.push(auth.authenticate(&metadata, peer).await);
        }
        let checked = checked.lock().expect("not poisoned").clone();
        (verdicts, checked)
    })
}

/// The heap a [`token_claims`] run may use at its peak for `len` bytes:
/// the decoded segments and the claims as JSON values.
pub fn token_claims_alloc_bound(len: usize) -> usize {
    64 * len + 64 * 1024
}

/// A bearer token (the input after three bytes of choices: whether an
/// audience is required, and the clock) through the checks made before a
/// TokenReview (`auth::claims`, and `auth::keys` judging its signature
/// against two keys: [`check_signature`]). Checks: a bad token is an error, never a
/// panic; the error holds nothing read from the token; a token passes only if,
/// re-read independently, it is three base64url segments, a JSON object
/// header, JSON object claims, a non-empty signature, an `aud` naming the
/// audience (when one is required), `exp` not past and `nbf` not ahead
/// beyond the skew; its expiry is its `exp`. Returns whether it passed.
pub fn token_claims(data: &[u8]) -> bool {
    let mut input = Input(data);
    let audience = if input.byte() % 2 == 0 {
        EXPECTED.audience
    } else {
        ""
    };
    // Around 2023-11-14, up to 9 hours either way, by the second.
    let offset = i64::from(i16::from_be_bytes([input.byte(), input.byte()]));
    let now_secs = 1_700_000_000 + offset;
    let now = std::time::SystemTime::UNIX_EPOCH
        + Duration::from_secs(u64::try_from(now_secs).unwrap_or_default());
    let token = String::from_utf8_lossy(input.0);
    check_signature(&token);
    let claims = auth::claims::Claims::read(&token);
    let verdict = claims
        .as_ref()
        .map_err(Clone::clone)
        .and_then(|claims| claims.check(audience, now));
    match verdict {
        Ok(()) => {
            reread_passed(&token, audience, now_secs);
            true
        }
        Err(error) => {
            check_refusal(error, audience);
            false
        }
    }
}

/// A JWK set of one RSA-2048 and one P-256 public key, whose private
/// keys no harness holds.
const FUZZ_JWKS: &str = r#"{"keys":[
{"kty":"RSA","kid":"fuzz-rsa","alg":"RS256","use":"sig","e":"AQAB","n":"ywnSxFpI1qeY8XEN3D3Z8fDWI-JkvXCzNlL40xPR3Nj0pqdWpI3pdikxOi2YssbNTxkSXkgAHbgfhVA43TgSNQnAYOpIkxIsNRNclM8awOvLwCTwROI-f-e-UWGd9QGXJqfbjeyLvRBncSBGuEsDZraRL2P66JJ7KrUoSoG5sdin8ZRWE_t8enpdTzLWSbfStxycVm739drJmeq-OIupLMJBSCVrgPvU02y3pNE9cRytu_HJgocHBV3SD5aOwyq7K02DrQFaVB82GEjWNYiLRiLXU0O0NSkfPFt-EOGest41cxlgf22bUKoZr6rqn3cSBjuegKV-M4iCamjmQN1gnQ"},
{"kty":"EC","kid":"fuzz-ec","crv":"P-256","x":"AZKdRUbfj79Vpx9nIHP2RBWIlq0rloioKamU923y5o0","y":"LRSE2MtruXGTQhghXhE5Sa4e_NPdRDT9ceXZcfb-PzA"}
]}"#;

/// What [`FUZZ_JWKS`] says of `token` (`auth::keys`): never valid (no
/// input can sign), and forged only when its header, re-read as plain
/// JSON, names one of the two keys with an algorithm that key signs with.
fn check_signature(token: &str) {
    static KEYS: std::sync::LazyLock<auth::keys::SigningKeys> = std::sync::LazyLock::new(|| {
        auth::keys::SigningKeys::from_jwks(FUZZ_JWKS.as_bytes()).expect("the fuzz keys")
    });
    assert_eq!(KEYS.len(), 2);
    match KEYS.judge(token) {
        auth::keys::Signature::Valid => panic!("a signature verified: {token:?}"),
        auth::keys::Signature::Forged { kid } => {
            use base64::Engine as _;
            let header = token
                .split('.')
                .next()
                .and_then(|h| {
                    base64::engine::general_purpose::URL_SAFE_NO_PAD
                        .decode(h.trim_end_matches('='))
                        .ok()
                })
                .and_then(|h| serde_json::from_slice::<serde_json::Value>(&h).ok())
                .unwrap_or_default();
            assert_eq!(header["kid"].as_str(), Some(kid.as_str()));
            let algs: &[&str] = match kid.as_str() {
                "fuzz-rsa" => &["RS256", "RS384", "RS512"],
                "fuzz-ec" => &["ES256"],
                other => panic!("forged under {other:?}, a key not held"),
            };
            let alg = header["alg"].as_str().unwrap_or_default();
            assert!(algs.contains(&alg), "forged with {alg:?} under {kid}");
        }
        auth::keys::Signature::Unknown => {}
    }
}

/// A token that passed [`token_claims`]'s checks at `now_secs` (seconds
/// since 1970), re-read independently: three base64url segments, a JSON
/// object header, JSON object claims, a non-empty signature, an `aud`
/// naming `audience` (unless empty), `exp` not past and `nbf` not ahead
/// beyond the skew; its expiry is its `exp`.
fn reread_passed(token: &str, audience: &str, now_secs: i64) {
    use base64::Engine as _;
    use serde_json::Value;
    let decode = |segment: &str| {
        base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(segment.trim_end_matches('='))
            .expect("a segment that passed is base64url")
    };
    let parts: Vec<&str> = token.split('.').collect();
    assert_eq!(parts.len(), 3, "passed without three segments");
    let header: Value = serde_json::from_slice(&decode(parts[0])).expect("header JSON");
    assert!(header.is_object(), "the header is not an object");
    assert!(!decode(parts[2]).is_empty(), "passed without a signature");
    let claims: Value = serde_json::from_slice(&decode(parts[1])).expect("claims JSON");
    assert!(claims.is_object(), "the claims are not an object");
    if !audience.is_empty() {
        let aud = &claims["aud"];
        assert!(
            aud == audience
                || aud
                    .as_array()
                    .is_some_and(|a| a.iter().any(|a| a == audience)),
            "passed with aud {aud}"
        );
    }
    let skew = auth::claims::CLOCK_SKEW.as_secs_f64();
    #[allow(clippy::cast_precision_loss)] // seconds since 1970 fit
    let now_f = now_secs as f64;
    for name in ["exp", "nbf"] {
        match &claims[name] {
            Value::Null => {}
            Value::Number(n) => {
                let t = n.as_f64().expect("a JSON number is an f64");
                let ok = if name == "exp" {
                    t + skew >= now_f
                } else {
                    t - skew <= now_f
                };
                assert!(ok, "passed with {name} {t} at {now_f}");
            }
            other => panic!("passed with {name} {other}"),
        }
    }
    let expiry = claims["exp"]
        .as_f64()
        .and_then(|exp| Duration::try_from_secs_f64(exp).ok())
        .and_then(|exp| std::time::SystemTime::UNIX_EPOCH.checked_add(exp));
    assert_eq!(auth::claims::expiry(token), expiry);
}

/// A token [`token_claims`]'s checks refused with `error`: the error holds
/// nothing read from the token (static reasons, our own `audience`, whole
/// seconds; a check of its text against the token fails when the token is
/// our own message, as the fuzzer found), and refuses the agent
/// Unauthenticated.
fn check_refusal(error: ClaimsError, audience: &str) {
    match &error {
        ClaimsError::Malformed(_)
        | ClaimsError::Expired { .. }
        | ClaimsError::NotYetValid { .. } => {}
        ClaimsError::Audience { want } => assert_eq!(want, audience),
    }
    assert!(!AuthError::Claims(error.clone()).to_string().is_empty());
    let refused = AuthError::Claims(error).status();
    assert_eq!(refused.code(), tonic::Code::Unauthenticated);
}

/// The heap a [`review_peers`] run may use at its peak for `len` bytes:
/// a place per step, and at most 8 records.
pub fn review_peers_alloc_bound(len: usize) -> usize {
    64 * len + 64 * 1024
}

/// Checks of agent tokens from a few peers (IPv4 addresses, and IPv6
/// addresses of which two share a /64 and three /64s a /48) entering (some
/// with tokens the cluster's keys sign), calling, ending with a pass, a
/// failure or nothing, leaving, in the order the bytes say, the clock
/// moving, at most 1-8 peers remembered (`auth::peers`). Checks: the
/// records stay whole after every step (`Peers::check`); a peer none of
/// whose reviews ever failed is never refused; a signed token's check is
/// never refused, on entering or calling; a refusal names a peer with
/// at least `SLOW_AFTER` failures counted, and a cap of at least
/// `SLOWED_PENDING`; once every check has left, no record counts one.
/// Returns how many checks were refused.
pub fn review_peers(data: &[u8]) -> usize {
    use auth::peers::{Outcome, PeerKey, Peers};
    let mut input = Input(data);
    let mut peers = Peers::with_capacity(1 + input.below(8));
    let keys: Vec<PeerKey> = [
        "10.0.0.1",
        "10.0.0.2",
        "::ffff:10.0.0.1",
        "2001:db8::1",
        "2001:db8::2",
        "2001:db8:0:1::1",
        "2001:db8:0:2::1",
        "2001:db8:1::1",
    ]
    .iter()
    .map(|ip| PeerKey::of(ip.parse().expect("an address")))
    .collect();
    let mut failed = HashMap::<PeerKey, u32>::new();
    // Checks counted: (place, calling).
    let mut places = Vec::new();
    let mut now = tokio::time::Instant::now();
    let mut refusals = 0;
    let mut refused =
        |failed: &HashMap<PeerKey, u32>, key: PeerKey, slowed: auth::peers::Slowed| {
            check_slowed(failed, key, slowed);
            refusals += 1;
        };
    while !input.is_empty() {
        let key = keys[input.below(keys.len())];
        match input.below(8) {
            0 => match peers.enter(key, now) {
                Ok(place) => places.push((place, false)),
                Err(slowed) => refused(&failed, key, slowed),
            },
            1 | 2 => {
                if places.is_empty() {
                    continue;
                }
                let step = call_step(&mut peers, &mut places, &mut failed, &mut input, now);
                if let Some((key, slowed)) = step {
                    refused(&failed, key, slowed);
                }
            }
            3 => {
                if places.is_empty() {
                    continue;
                }
                let (place, calling) = places.swap_remove(input.below(places.len()));
                if calling {
                    // Abandoned while the API had it.
                    peers.end_call(place);
                    count_failure(&mut failed, place.key);
                    peers.count(place.key, Outcome::Failed, now);
                }
                peers.leave(place);
            }
            4 => {
                count_failure(&mut failed, key);
                peers.count(key, Outcome::Failed, now);
            }
            5 => now += Duration::from_secs(u64::from(input.byte())),
            6 => {
                peers.count(key, Outcome::Passed, now);
            }
            // A check whose token the cluster's keys vouch for.
            _ => places.push((peers.enter_signed(key, now), false)),
        }
        peers.check();
    }
    for (place, calling) in places {
        if calling {
            peers.end_call(place);
        }
        peers.leave(place);
    }
    peers.check();
    assert!(peers.idle(), "a record still counts a check");
    refusals
}

/// A failed review of `key` in [`review_peers`]'s own books: it counts
/// for the /64 and for its /48.
fn count_failure(failed: &mut HashMap<auth::peers::PeerKey, u32>, key: auth::peers::PeerKey) {
    for key in std::iter::once(key).chain(key.wider()) {
        *failed.entry(key).or_default() += 1;
    }
}

/// A refusal of a check of `key` in [`review_peers`] names the peer slowed
/// (the check's own or its /48), which has at least `SLOW_AFTER` failures,
/// and a cap of at least `SLOWED_PENDING`.
fn check_slowed(
    failed: &HashMap<auth::peers::PeerKey, u32>,
    key: auth::peers::PeerKey,
    slowed: auth::peers::Slowed,
) {
    use auth::peers::{SLOW_AFTER, SLOWED_PENDING};
    assert!(
        slowed.key == key || key.wider() == Some(slowed.key),
        "{key} refused as {}",
        slowed.key
    );
    let count = failed.get(&slowed.key).copied().unwrap_or(0);
    assert!(
        count >= SLOW_AFTER,
        "{} refused after {count} failures",
        slowed.key
    );
    assert!(slowed.limit >= SLOWED_PENDING && slowed.failed >= SLOW_AFTER);
}

/// A step of a check of [`review_peers`] (one of `places`, the input
/// says which: `(place, calling)`): the answer to its call (a pass, a
/// failure, or nothing said; a failure counted in `failed`), or, if it is
/// not calling, its call started. A check refused its call leaves: the
/// refusal, naming its peer.
fn call_step(
    peers: &mut auth::peers::Peers,
    places: &mut Vec<(auth::peers::Place, bool)>,
    failed: &mut HashMap<auth::peers::PeerKey, u32>,
    input: &mut Input<'_>,
    now: tokio::time::Instant,
) -> Option<(auth::peers::PeerKey, auth::peers::Slowed)> {
    use auth::peers::Outcome;
    let i = input.below(places.len());
    let (place, calling) = places[i];
    if calling {
        peers.end_call(place);
        places[i].1 = false;
        let outcome = [Some(Outcome::Passed), Some(Outcome::Failed), None][input.below(3)];
        if let Some(outcome) = outcome {
            if outcome == Outcome::Failed {
                count_failure(failed, place.key);
            }
            peers.count(place.key, outcome, now);
        }
        return None;
    }
    match peers.start_call(place, now) {
        Ok(()) => {
            places[i].1 = true;
            None
        }
        Err(slowed) => {
            assert!(!place.signed, "a signed token's call capped: {slowed:?}");
            peers.leave(place);
            places.swap_remove(i);
            Some((place.key, slowed))
        }
    }
}

/// The heap a [`lanes`] run may use at its peak for `len` input bytes: a
/// step of two bytes may queue a payload of up to [`LANE_PAYLOAD`] bytes.
pub fn lanes_alloc_bound(len: usize) -> usize {
    (LANE_PAYLOAD + 256) * len + 256 * 1024
}

/// The largest DATA payload the [`lanes`] harness sends: a few chunks.
const LANE_PAYLOAD: usize = 3 * flow::MIN_CHUNK + 7;

/// One connection as the [`lanes`] harness follows it.
#[derive(Default)]
struct LaneModel {
    /// Bytes the frontend sent, in order.
    sent: Vec<u8>,
    /// Bytes that reached the agent, in order.
    uploaded: Vec<u8>,
    /// The chunk whose upload waits.
    in_flight: Option<Bytes>,
    /// The frontend sent its CLOSE_REQ.
    closed: bool,
    /// Its CLOSE_REQ reached the control core.
    close_delivered: bool,
    /// The connection is gone (its upload failed, or its lane was cut).
    gone: bool,
}

/// A `Proxy` stream's read-ahead ([`Lanes`](crate::frontend::lanes::Lanes))
/// driven as its driver drives it, by frontend packets (DATA of any
/// length, empty included; CLOSE_REQ, repeated too) for three connections,
/// uploads that finish, fail or wait, and lanes cut, its cost settled
/// after every step with a small buffer budget that another stream takes
/// from and gives back to. After every step, each connection's uploaded
/// bytes are a prefix of what its frontend sent, its close reaches the
/// control core only after every byte before it (and once), the lanes
/// count exactly the bytes they hold, and the budget holds exactly what
/// the two streams took: the lanes' cost, less what they still owe, owed
/// only while the budget is full. At the end, with every upload let
/// through, every byte sent arrived, in order, followed by the close, and
/// the lanes and the budget hold nothing.
pub fn lanes(data: &[u8]) {
    use tunnel::budget::{Account, Budget};

    use crate::frontend::lanes::Lanes;

    let conns = lane_conns();
    let mut models: Vec<LaneModel> = conns.iter().map(|_| LaneModel::default()).collect();
    let mut ahead = Lanes::default();
    let mut now = Instant::now();
    let mut input = Input(data);
    let budget = std::sync::Arc::new(Budget::new(256 * (1 + input.below(64))));
    let mut account = Account::new(budget.clone());
    let mut other: Option<Account> = None;
    while !input.is_empty() {
        let c = input.below(conns.len());
        let (conn, model) = (&conns[c], &mut models[c]);
        match input.below(7) {
            0 | 1 if !model.gone && !model.closed => {
                lane_data(conn, model, &mut ahead, &mut input, now);
            }
            // CLOSE_REQ, maybe a second one (without a lane it goes to the
            // control core, which ignores a close for a closed connection).
            2 if !model.gone => {
                model.closed = true;
                if ahead
                    .close(conn.id, Packet::close_request(conn.id.0))
                    .is_some()
                    && !model.close_delivered
                {
                    deliver_close(model);
                }
            }
            // The upload in flight finishes, or the connection is gone.
            3 | 4 => {
                let Some(chunk) = model.in_flight.take() else {
                    continue;
                };
                let ok = input.byte() % 8 != 0;
                if ok {
                    model.uploaded.extend_from_slice(&chunk);
                } else {
                    model.gone = true;
                }
                let step = ahead.uploaded(conn.id, ok, now);
                lane_next(model, step);
            }
            // The lane is cut.
            5 => {
                lane_cut(conn, model, &mut ahead);
                now += Duration::from_millis(u64::from(input.byte()));
            }
            // Another stream takes from the budget, or gives back.
            6 => {
                other = match other {
                    Some(_) => None,
                    None => Account::try_new(&budget, 64 * input.below(16)),
                };
            }
            _ => {}
        }
        check_lanes(&conns, &models, &ahead);
        check_budget(&ahead, &mut account, other.as_ref());
    }
    lanes_let_through(&conns, &mut models, &mut ahead, now);
    drop(other);
    check_budget(&ahead, &mut account, None);
    drop(account);
    assert_eq!(budget.held(), 0, "the budget kept bytes nobody holds");
}

/// The [`lanes`] harness's three connections (ids 1 to 3), with flow
/// control by credit: our window V1's, theirs the smallest allowed.
fn lane_conns() -> Vec<std::sync::Arc<crate::conn::Conn>> {
    let scheme = flow::Scheme::Credit {
        ours: flow::Window::V1,
        theirs: flow::Window::new(flow::MIN_WINDOW, flow::MIN_CHUNK).expect("in range"),
    };
    (1..=3)
        .map(|id| crate::conn::test_conn(id, scheme).0)
        .collect()
}

/// The lane of `conn` is cut, if it has one: the connection is gone, and
/// a CLOSE_REQ its lane held is delivered.
fn lane_cut(
    conn: &crate::conn::Conn,
    model: &mut LaneModel,
    ahead: &mut crate::frontend::lanes::Lanes,
) {
    if let Some((cut, close)) = ahead.cut(conn.id) {
        assert_eq!(cut.id, conn.id);
        model.gone = true;
        model.in_flight = None;
        if close.is_some() {
            deliver_close(model);
        }
    }
}

/// DATA from the frontend of `conn`, as `FrontendDriver::data` takes it:
/// a payload of the length the input says (empty, a few bytes, or up to
/// [`LANE_PAYLOAD`]), queued behind the connection's lane if it has one;
/// else uploaded chunk by chunk until the input says a chunk waits, which
/// opens a lane holding the rest.
fn lane_data(
    conn: &std::sync::Arc<crate::conn::Conn>,
    model: &mut LaneModel,
    ahead: &mut crate::frontend::lanes::Lanes,
    input: &mut Input<'_>,
    now: Instant,
) {
    let len = match input.below(4) {
        0 => 0,
        1 => input.below(8),
        _ => usize::from(input.byte()) * LANE_PAYLOAD / 255,
    };
    let start = model.sent.len();
    let payload: Vec<u8> = (start..start + len).map(|i| (i % 251) as u8).collect();
    model.sent.extend_from_slice(&payload);
    let payload = Bytes::from(payload);
    if ahead.has_lane(conn.id) {
        ahead.queue(conn.id, payload);
        return;
    }
    let mut chunks = conn.flow.chunks(payload);
    while let Some(piece) = chunks.next() {
        if input.byte().is_multiple_of(2) {
            model.uploaded.extend_from_slice(&piece);
        } else {
            ahead.open(conn.clone(), piece.len(), chunks.rest(), now);
            model.in_flight = Some(piece);
            break;
        }
    }
}

/// What the driver does with a lane's next step: the upload of its next
/// chunk starts, or its CLOSE_REQ reaches the control core.
fn lane_next(model: &mut LaneModel, step: Option<crate::frontend::lanes::Next>) {
    use crate::frontend::lanes::Next;
    match step {
        None => {}
        Some(Next::Upload(_, chunk)) => {
            assert!(!chunk.is_empty(), "an empty chunk in flight");
            model.in_flight = Some(chunk);
        }
        Some(Next::Close(_)) => deliver_close(model),
    }
}

/// The end of a [`lanes`] run: every upload let through, each connection
/// still there got every byte its frontend sent, in order, then its close
/// (if sent); no lane is left, and the lanes count nothing.
fn lanes_let_through(
    conns: &[std::sync::Arc<crate::conn::Conn>],
    models: &mut [LaneModel],
    ahead: &mut crate::frontend::lanes::Lanes,
    now: Instant,
) {
    for (conn, model) in conns.iter().zip(models) {
        while let Some(chunk) = model.in_flight.take() {
            model.uploaded.extend_from_slice(&chunk);
            let step = ahead.uploaded(conn.id, true, now);
            lane_next(model, step);
        }
        assert!(!ahead.has_lane(conn.id), "conn {}: a lane left", conn.id);
        if !model.gone {
            assert!(
                model.uploaded == model.sent,
                "conn {}: {} of {} bytes arrived",
                conn.id,
                model.uploaded.len(),
                model.sent.len()
            );
            assert_eq!(
                model.close_delivered, model.closed,
                "conn {}: close",
                conn.id
            );
        }
    }
    assert_eq!(ahead.bytes(), 0, "bytes counted in no lane");
    assert_eq!(ahead.closing(), 0, "closes counted in no lane");
    assert_eq!((ahead.cost(), ahead.items()), (0, 0), "cost in no lane");
}

/// The read-ahead's account settled to its cost, as the driver does after
/// every step: the budget holds what the two streams took, the lanes'
/// cost less what they owe, and they owe only while it is full.
fn check_budget(
    ahead: &crate::frontend::lanes::Lanes,
    account: &mut tunnel::budget::Account,
    other: Option<&tunnel::budget::Account>,
) {
    let budget = account.budget().clone();
    let owed = account.settle(ahead.cost());
    assert!(ahead.cost() >= ahead.bytes(), "a cost below the bytes");
    assert_eq!(
        account.taken() + owed,
        ahead.cost(),
        "the account miscounts"
    );
    let others = other.map_or(0, tunnel::budget::Account::taken);
    assert_eq!(
        budget.held(),
        account.taken() + others,
        "the budget miscounts"
    );
    if owed > 0 {
        assert!(
            budget.held() >= budget.limit(),
            "owed with room in the budget"
        );
    }
}

/// A connection's CLOSE_REQ reaches the control core: once, and only
/// after every byte sent before it.
fn deliver_close(model: &mut LaneModel) {
    assert!(model.closed, "a close the frontend never sent");
    assert!(!model.close_delivered, "a close delivered twice");
    assert!(
        model.gone || model.uploaded == model.sent,
        "the close overtook {} bytes",
        model.sent.len() - model.uploaded.len()
    );
    model.close_delivered = true;
}

/// What holds after every step of [`lanes`].
fn check_lanes(
    conns: &[std::sync::Arc<crate::conn::Conn>],
    models: &[LaneModel],
    ahead: &crate::frontend::lanes::Lanes,
) {
    let mut held = 0;
    for (conn, model) in conns.iter().zip(models) {
        assert!(
            model.sent.starts_with(&model.uploaded),
            "conn {}: bytes uploaded out of order",
            conn.id
        );
        if ahead.has_lane(conn.id) {
            assert!(
                !model.gone,
                "conn {}: a gone connection keeps its lane",
                conn.id
            );
            assert!(
                model.in_flight.is_some(),
                "conn {}: a lane with nothing in flight",
                conn.id
            );
            held += model.sent.len() - model.uploaded.len();
        } else {
            assert!(
                model.in_flight.is_none(),
                "conn {}: in flight without a lane",
                conn.id
            );
        }
    }
    assert_eq!(ahead.bytes(), held, "the lanes miscount their bytes");
}

#[cfg(test)]
mod tests {
    use super::*;

    use base64::Engine as _;

    include!("../../fuzz/replay.rs");

    replay!(
        fuzz_corpus_router => router within router_alloc_bound,
        fuzz_corpus_connect_head => connect_head within connect_head_alloc_bound,
        fuzz_corpus_token_review => token_review within token_review_alloc_bound,
        fuzz_corpus_lanes => lanes within lanes_alloc_bound,
        fuzz_corpus_token_claims => token_claims within token_claims_alloc_bound
            reaching |passed: &bool| *passed,
        fuzz_corpus_review_peers => review_peers within review_peers_alloc_bound
            reaching |refused: &usize| *refused > 0,
    );

    /// The router oracle's own arithmetic, which no replay of a correct
    /// router can check (a bound made weaker still holds): what it is sure
    /// the router sampled is a lower bound at once, decayed as the peak
    /// EWMA decays and never lowered by a smaller sample; what the router
    /// may have sampled and the attempts it may hold make the upper bound.
    #[test]
    fn the_router_oracles_bounds_follow_their_samples() {
        let mut watch = Watch::default();
        let (be, t0) = (BackendId(7), Instant::now());
        let decay = crate::router::DECAY;
        let near = |a: f64, b: f64| (a - b).abs() < 1e-9;
        assert!(near(watch.estimate(be, t0), 0.0));
        watch.raise(be, Duration::from_secs(1), t0);
        assert!(near(watch.estimate(be, t0), 1.0));
        assert!(near(watch.estimate(be, t0 + decay), (-1f64).exp()));
        watch.raise(be, Duration::from_millis(10), t0 + decay);
        assert!(near(watch.estimate(be, t0 + decay), (-1f64).exp()));
        assert!(near(watch.estimate(BackendId(8), t0), 0.0));
        // The upper bound: 1 µs at the least, times one more than its load.
        assert_eq!(watch.most_cost(be, 0, t0), 1);
        watch.lift(be, Duration::from_millis(5));
        watch.lift(be, Duration::from_millis(3));
        assert_eq!(watch.most_cost(be, 2, t0), 3 * 5_001);
        watch
            .may_hold
            .insert(1, vec![(be, Some(t0)), (BackendId(8), None)]);
        assert_eq!(
            watch.most_cost(be, 2, t0 + Duration::from_millis(8)),
            4 * 8_001
        );
    }

    /// The CONNECT head oracle's own reading: where a head ends (lines
    /// ending with LF or CRLF, blank lines before the request line
    /// skipped), its method, its target, else the Host's; no head before
    /// its empty line.
    #[test]
    fn the_connect_head_oracle_reads_heads_by_hand() {
        type Head<'a> = Option<(&'a [u8], &'a [u8], usize)>;
        let cases: [(&[u8], Head<'_>); 6] = [
            (
                b"CONNECT a:1 HTTP/1.1\r\n\r\nxyz",
                Some((b"CONNECT", b"a:1", 24)),
            ),
            (
                b"CONNECT a:1 HTTP/1.1\n\r\n\r\n",
                Some((b"CONNECT", b"a:1", 23)),
            ),
            (
                b"\r\n\nGET /x HTTP/1.1\nHost:  h:2 \n\n",
                Some((b"GET", b"/x", 32)),
            ),
            (
                b"CONNECT  HTTP/1.1\r\nhOsT: h:2\r\nHost: no\r\n\r\n",
                Some((b"CONNECT", b"h:2", 42)),
            ),
            (b"CONNECT a:1 HTTP/1.1\r\nHost: a:1\r\n", None),
            (b"\r\n\r\n", None),
        ];
        for (stream, expected) in cases {
            let reading = Reading::of(stream);
            let got = reading
                .as_ref()
                .map(|r| (r.method, r.target.as_slice(), r.end));
            assert_eq!(got, expected, "{:?}", String::from_utf8_lossy(stream));
        }
        // What `read` finds after a head cut anywhere: every byte sent.
        let stream = b"CONNECT a:1 HTTP/1.1\n\r\nearly\r\n\r\nlate";
        for cut in 1..stream.len() {
            let (method, target, after) = read(vec![&stream[..cut], &stream[cut..]]).unwrap();
            assert_eq!((method.as_str(), target.as_str()), ("CONNECT", "a:1"));
            assert_eq!(after, b"early\r\n\r\nlate", "cut at {cut}");
        }
    }

    /// The harnesses see what they claim: a valid CONNECT head in pieces,
    /// an admitting TokenReview answer, a dial through the router.
    #[test]
    fn the_harnesses_reach_their_success_paths() {
        let ok = read(vec![b"CONNECT a:1 HTTP/1.1\r\n", b"\r\nrest"]).unwrap();
        assert_eq!(ok, ("CONNECT".into(), "a:1".into(), b"rest".to_vec()));
        let body = br#"{"status":{"authenticated":true,"audiences":["system:konnectivity-server"],"user":{"username":"system:serviceaccount:kube-system:konnectivity-agent"}}}"#;
        let review = auth::read_answer(StatusCode::OK, body).unwrap();
        assert_eq!(
            auth::verdict(&EXPECTED, review),
            Ok(auth::Admitted::default())
        );
        let mut input = vec![0u8, 100];
        input.extend_from_slice(body);
        token_review(&input);
        // A token that passes the local checks.
        let claims = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .encode(br#"{"aud":["system:konnectivity-server"],"exp":1700003600}"#);
        let token = format!("eyJhbGciOiJSUzI1NiJ9.{claims}.c2ln");
        let claims = auth::claims::Claims::read(&token).unwrap();
        let now = std::time::SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        assert_eq!(claims.check(EXPECTED.audience, now), Ok(()));
        let mut input = vec![0u8, 0, 0];
        input.extend_from_slice(token.as_bytes());
        assert!(token_claims(&input));
        assert!(!token_claims(b"\0\0\0not-a-jwt"));
        // Ten failures of one peer, then six of its checks: two refused.
        let mut flood = vec![7u8];
        flood.extend([0, 4].repeat(10));
        flood.extend([0, 0].repeat(6));
        assert_eq!(review_peers(&flood), 2);
        // The same with a pass first: the cap is one higher.
        let mut lifted = vec![7u8, 0, 6];
        lifted.extend([0, 4].repeat(10));
        lifted.extend([0, 0].repeat(6));
        assert_eq!(review_peers(&lifted), 1);
        // The same six checks with signed tokens: none refused.
        let mut signed = vec![7u8];
        signed.extend([0, 4].repeat(10));
        signed.extend([0, 7].repeat(6));
        assert_eq!(review_peers(&signed), 0);
    }
}
