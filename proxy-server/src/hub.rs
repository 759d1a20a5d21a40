//! [`Hub`]: the routing core ([`Router`]) behind one lock, with the links
//! of every stream and the flow state of every connection, shared by the
//! transports: the router's driver. Each transport event takes the lock
//! once: the router decides, then the hub delivers what never waits
//! (control packets, window-admitted DATA, credit, stream ends, counts) and
//! returns what may wait ([`Work`]) for the transport to run outside the
//! lock, raced against its own end. The hub reads the clock and gives the
//! router `now`.

use std::{
    collections::{HashMap, VecDeque},
    net::SocketAddr,
    sync::{Arc, Mutex, MutexGuard},
    time::{Duration, Instant},
};

use bytes::Bytes;
use proto::Packet;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tunnel::{
    compact,
    flow::{self, PushError},
    ids::{AgentId, ConnId, DialId},
};

use crate::{
    link::{BackendLink, ConnFlow, DataRefused, FrontendLink},
    lock,
    metrics::{Live, ServerMetrics},
    router::{
        AgentInfo, BackendId, Event, ForwardFailure, FrontendId, FrontendKind, Out, Router, STALLED,
    },
    strategy::ProxyStrategy,
};

/// The router and where each of its streams' packets go.
struct State {
    /// The routing core.
    router: Router,
    /// Frontend streams' links.
    frontends: HashMap<FrontendId, FrontendLink>,
    /// Agent streams' links.
    backends: HashMap<BackendId, BackendLink>,
    /// Established connections' flow state, from the router's `Opened` to
    /// its `Closed`.
    conns: HashMap<(BackendId, ConnId), Arc<ConnFlow>>,
}

/// See the module documentation.
pub(crate) struct Hub {
    /// The router and the links, under one lock (held only to decide and
    /// queue, never across a wait).
    state: Mutex<State>,
    /// What the server records.
    pub(crate) metrics: Arc<ServerMetrics>,
    /// Woken when a dial deadline is armed, for the timer task.
    clock: Notify,
    /// `--backend-dial-timeout`.
    dial_timeout: Option<Duration>,
}

/// What a transport runs outside the hub's lock after an event: waits that
/// belong to one frontend or one connection.
pub(crate) enum Work {
    /// Forward a dial to its agent, waiting for room in the agent's queue
    /// within `--backend-dial-timeout`.
    Forward {
        /// Whose dial.
        frontend: FrontendId,
        /// The dial.
        dial: DialId,
        /// Where it goes.
        backend: BackendLink,
        /// The DIAL_REQ.
        packet: Packet,
    },
    /// Send a frontend's DATA to its agent in window-sized pieces, each
    /// waiting for credit (negotiated) and for room in the agent's queue.
    SendData {
        /// The connection (credit, end, and its agent's link).
        conn: Arc<ConnFlow>,
        /// The payload.
        data: Bytes,
    },
    /// Queue an agent's DATA for a frontend, waiting for room in the
    /// connection's window (agents without credit only).
    PushData {
        /// Where it goes.
        frontend: FrontendLink,
        /// The connection (window, end).
        conn: Arc<ConnFlow>,
        /// The DATA packet.
        packet: Packet,
    },
}

impl Hub {
    pub(crate) fn new(
        strategies: &[ProxyStrategy],
        dial_timeout: Option<Duration>,
        metrics: Arc<ServerMetrics>,
    ) -> Self {
        Self {
            state: Mutex::new(State {
                router: Router::new(strategies, dial_timeout, fastrand::Rng::new()),
                frontends: HashMap::new(),
                backends: HashMap::new(),
                conns: HashMap::new(),
            }),
            metrics,
            clock: Notify::new(),
            dial_timeout,
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }

    /// Registers a frontend stream; `link` is made for its id.
    pub(crate) fn add_frontend(
        &self,
        kind: FrontendKind,
        link: impl FnOnce(FrontendId) -> FrontendLink,
    ) -> FrontendLink {
        let mut state = self.state();
        let id = state.router.add_frontend(kind);
        let link = link(id);
        state.frontends.insert(id, link.clone());
        link
    }

    /// Registers an agent stream.
    pub(crate) fn add_backend(&self, info: AgentInfo, link: BackendLink) -> BackendId {
        let mut state = self.state();
        let id = state.router.add_backend(info);
        state.backends.insert(id, link);
        id
    }

    /// A packet from a frontend; the wait it needs, if any.
    pub(crate) fn frontend_packet(&self, fe: FrontendId, packet: Packet) -> Option<Work> {
        self.with_router(|router, out| router.frontend_packet(Instant::now(), fe, packet, out))
    }

    /// A packet from an agent; the wait it needs, if any.
    pub(crate) fn backend_packet(&self, be: BackendId, packet: Packet) -> Option<Work> {
        self.with_router(|router, out| router.backend_packet(Instant::now(), be, packet, out))
    }

    /// A frontend stream ended.
    pub(crate) fn frontend_closed(&self, fe: FrontendId) {
        self.with_router(|router, out| router.frontend_closed(Instant::now(), fe, out));
        let mut state = self.state();
        state.frontends.remove(&fe);
        compact(&mut state.frontends);
    }

    /// An agent stream ended.
    pub(crate) fn backend_closed(&self, be: BackendId) {
        self.with_router(|router, out| router.backend_closed(Instant::now(), be, out));
        self.state().backends.remove(&be);
    }

    /// A connection's flow state (with its agent's link), for a transport
    /// that moves its bytes itself.
    pub(crate) fn route(&self, fe: FrontendId, conn: ConnId) -> Option<Arc<ConnFlow>> {
        let state = self.state();
        let backend = state.router.route(fe, conn)?;
        state.conns.get(&(backend, conn)).cloned()
    }

    /// Runs `decide` on the router and delivers its output.
    fn with_router(&self, decide: impl FnOnce(&mut Router, &mut Vec<Out>)) -> Option<Work> {
        let mut state = self.state();
        let mut out = Vec::new();
        decide(&mut state.router, &mut out);
        self.deliver(&mut state, out)
    }

    /// Delivers the router's output in order; reports from the delivery
    /// (an overflow, an undelivered DIAL_RSP) go back to the router and
    /// their output is delivered too. What must wait is returned (an event
    /// produces one such wait at most).
    fn deliver(&self, state: &mut State, out: Vec<Out>) -> Option<Work> {
        let mut queue: VecDeque<Out> = out.into();
        let mut work = None;
        while let Some(next) = queue.pop_front() {
            let mut more = Vec::new();
            match next {
                Out::ToFrontend(fe, packet) => {
                    if let Some(link) = state.frontends.get(&fe) {
                        link.send_control(packet);
                    }
                }
                Out::ToBackend(be, packet) => {
                    if let Some(link) = state.backends.get(&be) {
                        link.send_control(packet);
                    }
                }
                Out::Forward {
                    frontend,
                    backend,
                    dial,
                    packet,
                } => match state.backends.get(&backend) {
                    Some(link) => {
                        work = Some(Work::Forward {
                            frontend,
                            dial,
                            backend: link.clone(),
                            packet,
                        });
                    }
                    None => state.router.dial_not_forwarded(
                        frontend,
                        dial,
                        ForwardFailure::Closed,
                        &mut more,
                    ),
                },
                Out::DataToBackend {
                    backend,
                    conn,
                    data,
                } => {
                    if let Some(conn) = state.conns.get(&(backend, conn)) {
                        work = Some(Work::SendData {
                            conn: conn.clone(),
                            data,
                        });
                    }
                }
                Out::DataToFrontend {
                    frontend,
                    backend,
                    conn,
                    packet,
                } => {
                    let (Some(link), Some(conn)) = (
                        state.frontends.get(&frontend),
                        state.conns.get(&(backend, conn)).cloned(),
                    ) else {
                        continue;
                    };
                    let cost = flow::cost(data_len(&packet));
                    if conn.flow_control {
                        // The agent respects the window: this never waits.
                        let started = Instant::now();
                        let pushed = if conn.budget.try_reserve(cost) {
                            link.push_data(conn.clone(), packet, cost)
                        } else {
                            Err(DataRefused::Overflow)
                        };
                        link.timed(started.elapsed());
                        if pushed == Err(DataRefused::Overflow) {
                            tracing::warn!(conn.id = %conn.id, "connection closed: its frontend reads too slowly");
                            state
                                .router
                                .overflow(Instant::now(), conn.backend, conn.id, &mut more);
                        }
                    } else {
                        work = Some(Work::PushData {
                            frontend: link.clone(),
                            conn,
                            packet,
                        });
                    }
                }
                Out::Credit {
                    backend,
                    conn,
                    credit,
                } => {
                    if let Some(send_credit) = state
                        .conns
                        .get(&(backend, conn))
                        .and_then(|c| c.send_credit.as_ref())
                    {
                        send_credit.grant(credit);
                    }
                }
                Out::Opened {
                    backend,
                    conn,
                    flow_control,
                } => {
                    if let Some(agent) = state.backends.get(&backend) {
                        let flow = ConnFlow::new(
                            conn,
                            backend,
                            agent.clone(),
                            flow_control,
                            Instant::now(),
                        );
                        state.conns.insert((backend, conn), Arc::new(flow));
                    }
                }
                Out::Closed { backend, conn } => {
                    if let Some(server_conn) = state.conns.remove(&(backend, conn)) {
                        server_conn.close();
                    }
                    compact(&mut state.conns);
                }
                Out::Established {
                    frontend,
                    backend,
                    conn,
                    packet,
                    latency,
                } => {
                    let delivered = state
                        .frontends
                        .get(&frontend)
                        .is_some_and(|link| link.send_control(packet));
                    if delivered {
                        // ANP observes the latency once the DIAL_RSP is delivered.
                        self.metrics.dial_succeeded(latency);
                    } else {
                        state
                            .router
                            .dial_rsp_undelivered(frontend, backend, conn, &mut more);
                    }
                }
                Out::EndFrontend(fe) => {
                    if let Some(link) = state.frontends.get(&fe) {
                        link.end.fail(tonic::Status::deadline_exceeded(STALLED));
                    }
                }
                Out::EndBackend(be) => {
                    if let Some(link) = state.backends.get(&be) {
                        tracing::warn!(agent.id = %link.agent_id, "agent did not take a dial in time; retiring its stream");
                        link.end.end();
                    }
                }
                Out::Count(event) => self.count(event),
            }
            queue.extend(more);
        }
        work
    }

    fn count(&self, event: Event) {
        match event {
            Event::DialFailed(reason) => self.metrics.dial_failed(reason),
            Event::DialPending => self.metrics.dial_pending(),
            Event::Established => self.metrics.connection_established(),
            Event::Closed(reason, lived) => self.metrics.connection_closed(reason, lived),
            Event::BytesToAgent(len) => self.metrics.bytes("to_agent", len),
            Event::BytesToFrontend(len) => self.metrics.bytes("to_frontend", len),
        }
    }

    /// Runs `work`; every wait ends with the connection or dial it serves.
    /// The caller races it against its stream's end and shutdown.
    pub(crate) async fn run(&self, work: Work) {
        match work {
            Work::Forward {
                frontend,
                dial,
                backend,
                packet,
            } => {
                let sent = match self.dial_timeout {
                    None => backend
                        .send(packet)
                        .await
                        .map_err(|_| ForwardFailure::Closed),
                    Some(limit) => match tokio::time::timeout(limit, backend.send(packet)).await {
                        Ok(sent) => sent.map_err(|_| ForwardFailure::Closed),
                        Err(_) => Err(ForwardFailure::TimedOut),
                    },
                };
                match sent {
                    Ok(()) => {
                        lock(&self.state)
                            .router
                            .dial_forwarded(Instant::now(), dial);
                        self.clock.notify_one();
                    }
                    Err(why) => {
                        self.with_router(|router, out| {
                            router.dial_not_forwarded(frontend, dial, why, out);
                        });
                    }
                }
            }
            Work::SendData { conn, data } => {
                tokio::select! {
                    () = conn.closed.cancelled() => {
                        tracing::debug!(conn.id = %conn.id, "dropping DATA for a connection closed while it waited");
                    }
                    () = send_data(&conn, data) => {}
                }
            }
            Work::PushData {
                frontend,
                conn,
                packet,
            } => {
                let started = Instant::now();
                let cost = flow::cost(data_len(&packet));
                // An agent without credit: wait while the frontend drains,
                // give up after COMPAT_STALL without progress.
                let pushed = tokio::select! {
                    () = conn.closed.cancelled() => Err(DataRefused::Gone),
                    () = frontend.gone() => Err(DataRefused::Gone),
                    reserved = conn.budget.reserve(cost, flow::COMPAT_STALL) => match reserved {
                        Ok(()) => frontend.push_data(conn.clone(), packet, cost),
                        Err(PushError::Overflow | PushError::Closed) => Err(DataRefused::Overflow),
                    },
                };
                frontend.timed(started.elapsed());
                if pushed == Err(DataRefused::Overflow) {
                    tracing::warn!(conn.id = %conn.id, "connection closed: its frontend reads too slowly");
                    self.with_router(|router, out| {
                        router.overflow(Instant::now(), conn.backend, conn.id, out);
                    });
                }
            }
        }
    }

    /// Runs the dial timers until `shutdown`.
    pub(crate) async fn run_timers(&self, shutdown: CancellationToken) {
        loop {
            let next = lock(&self.state).router.poll_timeout();
            let armed = self.clock.notified();
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = armed => continue,
                () = async {
                    match next {
                        Some(at) => tokio::time::sleep_until(at.into()).await,
                        None => std::future::pending().await,
                    }
                } => {
                    self.with_router(|router, out| router.handle_timeout(Instant::now(), out));
                }
            }
        }
    }

    /// Closes the connections whose frontend left their data untaken for
    /// `limit` (`--frontend-stall-timeout`).
    pub(crate) fn close_stalled(&self, limit: Duration) {
        let mut state = self.state();
        let now = Instant::now();
        let stalled: Vec<(BackendId, ConnId)> = state
            .conns
            .iter()
            .filter(|(_, conn)| conn.stalled_for(now) >= limit)
            .map(|(key, _)| *key)
            .collect();
        if stalled.is_empty() {
            return;
        }
        let mut out = Vec::new();
        state.router.close_stalled(now, &stalled, &mut out);
        let work = self.deliver(&mut state, out);
        debug_assert!(work.is_none(), "closing waits for nothing");
    }

    /// Ends every agent stream (shutdown).
    pub(crate) fn end_backends(&self) {
        for link in self.state().backends.values() {
            link.end.end();
        }
    }

    /// The live state the gauges show.
    pub(crate) fn live(&self) -> Live {
        let state = self.state();
        let (max_buffered, buffered) = crate::link::buffered(state.conns.values().map(|c| &**c));
        Live {
            ready: state.router.ready_backends(),
            pending: state.router.pending_count(),
            established: state.router.established_count(),
            max_buffered,
            buffered,
        }
    }

    /// Connected agent streams.
    pub(crate) fn backend_count(&self) -> usize {
        self.state().router.backend_count()
    }

    /// Frontend streams.
    pub(crate) fn frontend_count(&self) -> usize {
        self.state().router.frontend_count()
    }

    /// Dials waiting for a DIAL_RSP.
    pub(crate) fn pending_count(&self) -> usize {
        self.state().router.pending_count()
    }

    /// Established connections.
    pub(crate) fn established_count(&self) -> usize {
        self.state().router.established_count()
    }

    /// Whether `/readyz` says ready.
    pub(crate) fn is_ready(&self) -> bool {
        self.state().router.is_ready()
    }

    /// Each agent stream: its agent id, whether it is draining, its address.
    pub(crate) fn agents(&self) -> Vec<(AgentId, bool, Option<SocketAddr>)> {
        let state = self.state();
        state
            .router
            .agents()
            .into_iter()
            .map(|(id, agent, draining)| {
                let peer = state.backends.get(&id).and_then(|l| l.peer);
                (agent, draining, peer)
            })
            .collect()
    }
}

/// The payload length of a DATA packet.
fn data_len(packet: &Packet) -> usize {
    match &packet.payload {
        Some(proto::Payload::Data(data)) => data.data.len(),
        _ => 0,
    }
}

/// Sends a frontend's DATA to the agent; with credit, in pieces that fit a
/// window, each waiting for credit (this holds up only this connection).
async fn send_data(conn: &ConnFlow, mut data: Bytes) {
    let backend = &conn.agent;
    let Some(credit) = &conn.send_credit else {
        // A dead agent stream is reported to the frontend by its teardown.
        let _ = backend.send(Packet::data(conn.id.0, data)).await;
        return;
    };
    while !data.is_empty() {
        let piece = data.split_to(data.len().min(flow::MAX_CHUNK));
        if credit.take(flow::cost(piece.len())).await.is_err()
            || backend.send(Packet::data(conn.id.0, piece)).await.is_err()
        {
            return;
        }
    }
}
