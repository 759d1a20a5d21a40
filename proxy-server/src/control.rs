//! [`Control`]: the routing core ([`Router`]) behind the server's one
//! shared lock, with the link of every stream and every established
//! connection: the router's driver, for control events only.
//!
//! A stream's driver calls it for what needs a decision across streams:
//! dials and their answers, closes, a stream's start and end, a
//! connection's overflow, the timers. The lock is taken once per such
//! event and never per DATA: established connections ([`Conn`]) live in
//! the two drivers' own tables, which this module fills when the router
//! opens a connection (the agent stream's driver gets it back from
//! [`Control::backend_packet`], the frontend's through its
//! [`Attachments`](crate::conn::Attachments)) and closes when the router
//! closes one. Each event's output is carried out here when it never waits
//! (control packets, stream ends, counts); what may wait ([`Work`]) is
//! returned for the driver to run outside the lock, raced against its own
//! end. A dial sent again after its agent failed it, or hedged, is a wait
//! no frontend event started: it goes to the dialer ([`Control::run_dialer`]),
//! and every dial's wait ends when the dial settles.

use std::{
    collections::{HashMap, VecDeque},
    net::SocketAddr,
    sync::Arc,
    time::{Duration, Instant},
};

use bytes::Bytes;
use proto::{Packet, Payload};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tunnel::{
    budget::Budget,
    compact,
    ids::{AgentId, ConnId, DialId},
    sync::{Latch as Settled, Mutex, MutexGuard, Signal, audit::LockAudit},
};

use crate::{
    conn::{BackendLink, Conn, FrontendLink, FrontendTx},
    metrics::{Live, ServerMetrics},
    router::{
        AgentInfo, BackendId, DialPolicy, Event, ForwardFailure, FrontendId, FrontendKind, Out,
        Router, STALLED,
    },
    strategy::ProxyStrategy,
    traces::{FrontendPeer, Traces},
};

/// The router and where each of its streams' packets go.
struct State {
    /// The routing core.
    router: Router,
    /// Frontend streams' links.
    frontends: HashMap<FrontendId, FrontendLink>,
    /// Agent streams' links.
    backends: HashMap<BackendId, BackendLink>,
    /// Established connections, from the router's `Opened` to its
    /// `Closed`: for closing them, the stall scan and the gauges.
    conns: HashMap<(BackendId, ConnId), Arc<Conn>>,
    /// Pending dials whose DIAL_REQ waits to go out, until they settle.
    settles: HashMap<DialId, Arc<Settled>>,
    /// The spans of dials and tunnels (`--tracing-config-file`).
    traces: Traces,
}

/// The process-wide buffer budget (`--buffer-budget-bytes`), in two halves
/// so that a flood one way never stops the other: what frontends' streams
/// read ahead of their waiting uploads, and agents' DATA queued for
/// frontends.
#[derive(Debug, Clone)]
pub(crate) struct Budgets {
    /// Frontends' read-ahead (`frontend::lanes`).
    pub(crate) read_ahead: Arc<Budget>,
    /// Agents' DATA waiting for its frontends.
    pub(crate) to_frontend: Arc<Budget>,
}

impl Budgets {
    /// `total` bytes, half each way.
    pub(crate) fn new(total: usize) -> Self {
        let half = (total / 2).max(1);
        Self {
            read_ahead: Arc::new(Budget::new(half)),
            to_frontend: Arc::new(Budget::new(half)),
        }
    }
}

/// See the module documentation.
pub(crate) struct Control {
    /// The router and the links, under the shared lock (held only to
    /// decide and queue, never across a wait).
    state: Mutex<State>,
    /// What the server records.
    pub(crate) metrics: Arc<ServerMetrics>,
    /// The buffer budget every stream takes from.
    pub(crate) budgets: Budgets,
    /// Woken when a dial deadline is armed, for the timer task.
    clock: Notify,
    /// Which streams take which lock (debug builds, when started): the
    /// drivers of this server's streams run in its scope.
    pub(crate) audit: Arc<LockAudit>,
    /// `--backend-dial-timeout`.
    dial_timeout: Option<Duration>,
    /// Waits no frontend event started (retries, hedges), for the dialer.
    dialer: Mutex<Vec<Work>>,
    /// Wakes the dialer.
    dialer_wake: Signal,
}

/// What a driver runs outside the lock after an event: a wait that belongs
/// to one frontend or one connection.
pub(crate) enum Work {
    /// Forward a dial to its agent, waiting for room in the agent's queue
    /// within `--backend-dial-timeout`.
    Forward {
        /// Whose dial.
        frontend: FrontendId,
        /// The dial.
        dial: DialId,
        /// Where it goes.
        backend: (BackendId, BackendLink),
        /// The DIAL_REQ (boxed: the largest variant by far).
        packet: Box<Packet>,
        /// Set when the dial settles: the DIAL_REQ need not go out.
        settled: Arc<Settled>,
    },
    /// Send a frontend's DATA to its agent, on a connection its driver did
    /// not have in its table yet.
    Upload {
        /// The connection.
        conn: Arc<Conn>,
        /// The payload.
        data: Bytes,
    },
}

/// What carrying out an event's output gave the driver.
#[derive(Default)]
#[must_use = "its waits must be run or handed to the dialer"]
struct Carried {
    /// The waits it needs, in order.
    works: Vec<Work>,
    /// A connection the event opened on an agent stream.
    opened: Option<Arc<Conn>>,
}

impl Control {
    pub(crate) fn new(
        strategies: &[ProxyStrategy],
        policy: DialPolicy,
        metrics: Arc<ServerMetrics>,
        budgets: Budgets,
    ) -> Self {
        Self {
            state: Mutex::shared(State {
                router: Router::new(strategies, policy, fastrand::Rng::new()),
                frontends: HashMap::new(),
                backends: HashMap::new(),
                conns: HashMap::new(),
                settles: HashMap::new(),
                traces: Traces::default(),
            }),
            metrics,
            budgets,
            clock: Notify::new(),
            audit: LockAudit::new(),
            dial_timeout: policy.timeout,
            dialer: Mutex::new(Vec::new()),
            dialer_wake: Signal::new(),
        }
    }

    /// Makes spans with `tracing`.
    pub(crate) fn with_tracing(self, tracing: ops::otel::Tracing) -> Self {
        self.state().traces = Traces::new(tracing);
        self
    }

    /// The tracer (to flush it at the end).
    pub(crate) fn tracing(&self) -> ops::otel::Tracing {
        self.state().traces.tracing()
    }

    /// Writes one audit record per frontend dial to `sink`, as `server_id`.
    pub(crate) fn with_audit(
        self,
        sink: ops::audit::Sink<ops::audit::AuditRecord>,
        server_id: String,
        socket: String,
    ) -> Self {
        self.state().traces.set_audit(sink, server_id, socket);
        self
    }

    /// The server shuts down: what ends from now on, its shutdown ended.
    pub(crate) fn shutting_down(&self) {
        self.state().traces.shutting_down();
    }

    /// A frontend's stream carries the W3C trace context `traceparent`
    /// (its dials continue that trace) and comes from `peer` (its
    /// tunnels' audit records say so).
    pub(crate) fn frontend_traced(
        &self,
        fe: FrontendId,
        traceparent: Option<&str>,
        peer: FrontendPeer,
    ) {
        self.state().traces.frontend(fe, traceparent, peer);
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock()
    }

    /// Registers a frontend stream whose outbound queue `tx` makes for its
    /// id.
    pub(crate) fn add_frontend(
        &self,
        kind: FrontendKind,
        tx: impl FnOnce(FrontendId) -> FrontendTx,
    ) -> FrontendLink {
        let mut state = self.state();
        let id = state.router.add_frontend(kind);
        let link = FrontendLink::new(tx(id));
        state.frontends.insert(id, link.clone());
        link
    }

    /// Registers an agent stream.
    #[cfg(test)]
    pub(crate) fn add_backend(&self, info: AgentInfo, link: BackendLink) -> BackendId {
        let mut state = self.state();
        let id = state.router.add_backend(info);
        state.backends.insert(id, link);
        id
    }

    /// [`Control::add_backend`] unless its credential already has
    /// `--max-agent-streams-per-credential` streams open (`Err` with the
    /// cap; checked and added under one lock).
    pub(crate) fn admit_backend(
        &self,
        info: AgentInfo,
        link: BackendLink,
    ) -> Result<BackendId, usize> {
        let mut state = self.state();
        state.router.admits(&info)?;
        let id = state.router.add_backend(info);
        state.backends.insert(id, link);
        Ok(id)
    }

    /// A control packet from a frontend (or DATA its driver could not
    /// route); the waits it needs, for the frontend's driver to run.
    pub(crate) fn frontend_packet(&self, fe: FrontendId, packet: Packet) -> Vec<Work> {
        let mut state = self.state();
        let kind = match state.frontends.get(&fe).map(|link| link.tx.kind) {
            Some(FrontendKind::HttpConnect) => "http-connect",
            _ => "grpc",
        };
        state.traces.frontend_packet(fe, &packet, kind);
        let mut out = Vec::new();
        state
            .router
            .frontend_packet(Instant::now(), fe, packet, &mut out);
        self.carry(&mut state, out).works
    }

    /// A control packet from an agent (or DATA its driver could not
    /// route); the connection it opened on the agent's stream, if any. A
    /// dial it sends to another agent goes to the dialer.
    pub(crate) fn backend_packet(&self, be: BackendId, packet: Packet) -> Option<Arc<Conn>> {
        let carried =
            self.with_router(|router, out| router.backend_packet(Instant::now(), be, packet, out));
        self.to_dialer(carried.works);
        carried.opened
    }

    /// A frontend stream ended.
    pub(crate) fn frontend_closed(&self, fe: FrontendId) {
        let mut state = self.state();
        let mut out = Vec::new();
        state.router.frontend_closed(Instant::now(), fe, &mut out);
        state.traces.frontend_closed(fe);
        // Its dials settle: no wait is left.
        let carried = self.carry(&mut state, out);
        debug_assert!(carried.works.is_empty(), "a closed frontend's wait");
        // Connections handed over and never taken go with it.
        if let Some(link) = state.frontends.remove(&fe) {
            drop(link.attachments.take());
        }
        compact(&mut state.frontends);
    }

    /// An agent stream ended; the dials it had pending that go to other
    /// agents go to the dialer.
    pub(crate) fn backend_closed(&self, be: BackendId) {
        let carried = {
            let mut state = self.state();
            let mut out = Vec::new();
            state.router.backend_closed(Instant::now(), be, &mut out);
            let carried = self.carry(&mut state, out);
            state.backends.remove(&be);
            carried
        };
        self.to_dialer(carried.works);
    }

    /// A connection's frontend fell a window behind (or, without credit,
    /// took nothing for `COMPAT_STALL`): it is closed on both ends.
    pub(crate) fn overflow(&self, be: BackendId, conn: ConnId) {
        tracing::warn!(conn.id = %conn, "connection closed: its frontend reads too slowly");
        let carried =
            self.with_router(|router, out| router.overflow(Instant::now(), be, conn, out));
        self.to_dialer(carried.works);
    }

    /// A connection's upload stalled while it held up the other
    /// connections of its frontend's stream: it is closed on both ends.
    pub(crate) fn upload_stalled(&self, conn: &Conn) {
        let carried = self.with_router(|router, out| {
            router.upload_stalled(Instant::now(), conn.backend, conn.id, out);
        });
        self.to_dialer(carried.works);
    }

    /// Hands waits no frontend's driver runs (a retried or hedged dial's
    /// DIAL_REQ) to the dialer.
    fn to_dialer(&self, works: Vec<Work>) {
        if works.is_empty() {
            return;
        }
        self.dialer.lock().extend(works);
        self.dialer_wake.notify();
    }

    /// Runs the waits handed to the dialer until `shutdown`; each ends
    /// when it is done or its dial settles.
    pub(crate) async fn run_dialer(&self, shutdown: CancellationToken) {
        let mut running = futures_util::stream::FuturesUnordered::new();
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = self.dialer_wake.wait() => {
                    let works = std::mem::take(&mut *self.dialer.lock());
                    running.extend(works.into_iter().map(|work| self.run(work)));
                }
                Some(()) = futures_util::StreamExt::next(&mut running), if !running.is_empty() => {}
            }
        }
    }

    /// Runs `decide` on the router and carries out its output.
    fn with_router(&self, decide: impl FnOnce(&mut Router, &mut Vec<Out>)) -> Carried {
        let mut state = self.state();
        let mut out = Vec::new();
        decide(&mut state.router, &mut out);
        self.carry(&mut state, out)
    }

    /// Carries out the router's output in order; reports from carrying it
    /// out (an undelivered DIAL_RSP, a dial whose agent is gone) go back to
    /// the router and their output is carried out too.
    fn carry(&self, state: &mut State, out: Vec<Out>) -> Carried {
        let mut queue: VecDeque<Out> = out.into();
        let mut carried = Carried::default();
        while let Some(next) = queue.pop_front() {
            let mut more = Vec::new();
            self.carry_one(state, next, &mut carried, &mut more);
            queue.extend(more);
        }
        state.traces.flush();
        carried
    }

    fn carry_one(&self, state: &mut State, out: Out, carried: &mut Carried, more: &mut Vec<Out>) {
        match out {
            Out::Forward {
                frontend,
                backend,
                dial,
                packet,
            } => {
                state.traces.accepted(frontend, dial);
                Self::forward_out(state, (frontend, backend, dial), packet, carried, more);
            }
            Out::Settled(dial) => {
                state.traces.settled(dial);
                if let Some(settled) = state.settles.remove(&dial) {
                    settled.set();
                }
                compact(&mut state.settles);
            }
            Out::DataToBackend {
                backend,
                conn,
                data,
            } => {
                if let Some(conn) = state.conns.get(&(backend, conn)) {
                    carried.works.push(Work::Upload {
                        conn: conn.clone(),
                        data,
                    });
                }
            }
            Out::Opened {
                backend,
                conn,
                frontend,
            } => carried.opened = Self::open(state, backend, conn, frontend),
            Out::Closed { backend, conn } => {
                if let Some(conn) = state.conns.remove(&(backend, conn)) {
                    conn.close();
                    state.traces.closed((backend, conn.id), conn.bytes());
                }
                compact(&mut state.conns);
            }
            Out::Established {
                frontend,
                backend,
                conn,
                packet,
                latency,
            } => self.established(state, (frontend, backend, conn), packet, latency, more),
            Out::Count(event) => {
                if let Event::Closed(reason, _) = event {
                    state.traces.close_reason(reason);
                }
                self.count(event);
            }
            out => {
                if let Out::DialFailed {
                    frontend,
                    dial,
                    error,
                } = &out
                {
                    state.traces.failed(*frontend, *dial, error);
                }
                Self::send(state, out);
            }
        }
    }

    /// A DIAL_REQ for `backend`: a wait that sends it, carrying the dial
    /// span's context; the dial fails over if the backend is gone.
    fn forward_out(
        state: &mut State,
        (frontend, backend, dial): (FrontendId, BackendId, DialId),
        mut packet: Packet,
        carried: &mut Carried,
        more: &mut Vec<Out>,
    ) {
        let Some(link) = state.backends.get(&backend).cloned() else {
            let now = Instant::now();
            let failure = ForwardFailure::Closed;
            state
                .router
                .dial_not_forwarded(now, frontend, dial, backend, failure, more);
            return;
        };
        let hedge = state.router.hedged_to(dial) == Some(backend);
        state
            .traces
            .forward(dial, &link.agent_id, hedge, &mut packet);
        let settled = state.settles.entry(dial).or_default().clone();
        carried.works.push(Work::Forward {
            frontend,
            dial,
            backend: (backend, link),
            packet: Box::new(packet),
            settled,
        });
    }

    /// Carries out what goes to one stream and never waits: a control
    /// packet, a dial's failure, the stream's end.
    fn send(state: &State, out: Out) {
        match out {
            Out::ToFrontend(fe, packet) => {
                if let Some(link) = state.frontends.get(&fe) {
                    link.tx.send_control(packet);
                }
            }
            Out::ToBackend(be, packet) => {
                if let Some(link) = state.backends.get(&be) {
                    link.send_control(packet);
                }
            }
            Out::DialFailed {
                frontend,
                dial,
                error,
            } => {
                if let Some(link) = state.frontends.get(&frontend) {
                    link.tx.dial_failed(dial, error);
                }
            }
            Out::EndFrontend(fe) => {
                if let Some(link) = state.frontends.get(&fe) {
                    link.tx.end.fail(tonic::Status::deadline_exceeded(STALLED));
                }
            }
            Out::EndBackend(be) => {
                if let Some(link) = state.backends.get(&be) {
                    tracing::warn!(agent.id = %link.agent_id, "agent did not take a dial in time; retiring its stream");
                    link.end.end();
                }
            }
            other => debug_assert!(false, "not a send: {other:?}"),
        }
    }

    /// A dial succeeded: its DIAL_RSP goes to the frontend, and the latency
    /// is observed once it is delivered (as ANP does); if it cannot be
    /// delivered, the router closes the connection.
    fn established(
        &self,
        state: &mut State,
        (frontend, backend, conn): (FrontendId, BackendId, ConnId),
        packet: Packet,
        latency: Duration,
        more: &mut Vec<Out>,
    ) {
        if let (Some(link), Some(Payload::DialResponse(rsp))) =
            (state.backends.get(&backend), &packet.payload)
        {
            let dial = DialId(rsp.random);
            state
                .traces
                .established((frontend, dial), (backend, conn), &link.agent_id, latency);
        }
        let opened = state.conns.get(&(backend, conn)).cloned();
        let delivered = state
            .frontends
            .get(&frontend)
            .is_some_and(|link| link.tx.answer(packet, opened));
        if delivered {
            self.metrics.dial_succeeded(latency);
        } else {
            state
                .router
                .dial_rsp_undelivered(frontend, backend, conn, more);
        }
    }

    /// A connection the router opened: made, kept, handed to its frontend's
    /// driver, and returned for its agent stream's driver.
    fn open(
        state: &mut State,
        backend: BackendId,
        id: ConnId,
        frontend: FrontendId,
    ) -> Option<Arc<Conn>> {
        let agent = state.backends.get(&backend)?;
        let link = state.frontends.get(&frontend)?;
        let conn = Arc::new(Conn::new(id, backend, agent.clone(), link.tx.clone()));
        link.attachments.attach(conn.clone());
        state.conns.insert((backend, id), conn.clone());
        Some(conn)
    }

    fn count(&self, event: Event) {
        match event {
            Event::DialFailed(reason) => self.metrics.dial_failed(reason),
            Event::DialPending => self.metrics.dial_pending(),
            Event::DialRetried(reason) => self.metrics.dial_retried(reason),
            Event::DialHedged => self.metrics.dial_hedged(),
            Event::HedgeWon => self.metrics.hedge_won(),
            Event::Established => self.metrics.connection_established(),
            Event::Closed(reason, lived) => self.metrics.connection_closed(reason, lived),
        }
    }

    /// Runs `work`, and the retry it may lead to; every wait ends with the
    /// connection or dial it serves. The caller races it against its
    /// stream's end and shutdown.
    pub(crate) async fn run(&self, work: Work) {
        let mut next = Some(work);
        while let Some(work) = next.take() {
            match work {
                Work::Forward {
                    frontend,
                    dial,
                    backend,
                    packet,
                    settled,
                } => {
                    let mut more = self
                        .forward(frontend, dial, backend, *packet, &settled)
                        .await;
                    next = more.pop();
                    self.to_dialer(more);
                }
                Work::Upload { conn, data } => {
                    if !conn.upload(data).await {
                        tracing::debug!(conn.id = %conn.id, "DATA for a connection closed while it waited");
                    }
                }
            }
        }
    }

    /// Forwards a dial to its agent within `--backend-dial-timeout`, unless
    /// it settles first; the waits that follows (a retry), if any.
    async fn forward(
        &self,
        frontend: FrontendId,
        dial: DialId,
        (id, backend): (BackendId, BackendLink),
        packet: Packet,
        settled: &Settled,
    ) -> Vec<Work> {
        let send = async {
            match self.dial_timeout {
                None => backend
                    .send(packet)
                    .await
                    .map_err(|_| ForwardFailure::Closed),
                Some(limit) => match tokio::time::timeout(limit, backend.send(packet)).await {
                    Ok(sent) => sent.map_err(|_| ForwardFailure::Closed),
                    Err(_) => Err(ForwardFailure::TimedOut),
                },
            }
        };
        let sent = tokio::select! {
            sent = send => sent,
            () = settled.wait() => return Vec::new(),
        };
        match sent {
            Ok(()) => {
                self.state().router.dial_forwarded(Instant::now(), dial, id);
                self.clock.notify_one();
                Vec::new()
            }
            Err(why) => {
                self.with_router(|router, out| {
                    router.dial_not_forwarded(Instant::now(), frontend, dial, id, why, out);
                })
                .works
            }
        }
    }

    /// Runs the dial timers until `shutdown`.
    pub(crate) async fn run_timers(&self, shutdown: CancellationToken) {
        loop {
            let next = self.state().router.poll_timeout();
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
                    let carried =
                        self.with_router(|router, out| router.handle_timeout(Instant::now(), out));
                    self.to_dialer(carried.works);
                }
            }
        }
    }

    /// The established connections now (the lock is held only to copy
    /// them out, so a scan does not stop control events, and DATA never
    /// waits for it).
    fn conns(&self) -> Vec<Arc<Conn>> {
        self.state().conns.values().cloned().collect()
    }

    /// Closes the connections whose frontend left their data untaken for
    /// `limit` (`--frontend-stall-timeout`).
    pub(crate) fn close_stalled(&self, limit: Duration) {
        let now = Instant::now();
        let stalled: Vec<(BackendId, ConnId)> = self
            .conns()
            .iter()
            .filter(|conn| conn.stalled_for(now) >= limit)
            .map(|conn| (conn.backend, conn.id))
            .collect();
        if stalled.is_empty() {
            return;
        }
        let carried = self.with_router(|router, out| router.close_stalled(now, &stalled, out));
        self.to_dialer(carried.works);
    }

    /// Ends every agent stream (shutdown).
    pub(crate) fn end_backends(&self) {
        for link in self.state().backends.values() {
            link.end.end();
        }
    }

    /// The live state the gauges show.
    pub(crate) fn live(&self) -> Live {
        let (ready, pending, established) = {
            let state = self.state();
            (
                state.router.ready_backends(),
                state.router.pending_count(),
                state.router.established_count(),
            )
        };
        let queued: Vec<usize> = self.conns().iter().map(|c| c.flow.queued()).collect();
        Live {
            ready,
            pending,
            established,
            max_buffered: queued.iter().copied().max().unwrap_or(0),
            buffered: queued.iter().sum(),
            read_ahead: (
                self.budgets.read_ahead.held(),
                self.budgets.read_ahead.limit(),
            ),
            to_frontend: (
                self.budgets.to_frontend.held(),
                self.budgets.to_frontend.limit(),
            ),
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

#[cfg(test)]
mod tests;
