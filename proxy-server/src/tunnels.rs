//! [`Tunnels`]: the packet bookkeeping between frontends and backends.
//!
//! Transports (the gRPC frontend, the agent service) feed packets in and
//! drain the frontends' and backends' channels; everything here is data and
//! channels, no sockets, so it is unit-tested by feeding packets and reading
//! what comes out. Lock order: a frontend's state, then the pending-dial
//! table or a backend's connection map; never the reverse.

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use proto::{DialRequest, Packet, packet::PacketKind};
use tracing::{debug, info, warn};
use tunnel::{
    flow::{self, PushError},
    ids::{ConnId, DialId},
};

use crate::{
    backend::{Backend, manager::BackendManager},
    conn::{BackendConn, ServerConn},
    dial::{PendingDial, PendingDials},
    frontend::{Frontend, FrontendKind},
    lock,
    metrics::{CloseReason, DialFailure, ServerMetrics},
};

/// Answer to a dial when no agent can take it (ANP's text, matched by clients).
pub const NO_AGENT: &str = "No agent available";
/// Answer to a dial whose DIAL_RSP did not come within `--backend-dial-timeout`.
pub const DIAL_TIMED_OUT: &str = "timed out waiting for backend dial";
/// DIAL_RSP error when the chosen agent's stream closed before the dial went out.
pub const AGENT_STREAM_CLOSED: &str = "agent stream closed";
/// CLOSE_RSP error when a frontend used a connection id it does not own.
pub const MISMATCHED: &str = "mismatched connection IDs";
/// CLOSE_RSP error of a connection whose frontend took none of its data
/// for `--frontend-stall-timeout`.
pub const STALLED: &str =
    "the frontend took none of this connection's data within --frontend-stall-timeout";

/// The proxy's shared state.
pub(crate) struct Tunnels {
    /// Connected agents, per strategy.
    pub(crate) backends: BackendManager,
    /// Every live backend by uid (for counts and shutdown).
    all_backends: Mutex<HashMap<u64, Arc<Backend>>>,
    /// Dials in flight.
    pending: PendingDials,
    /// `--backend-dial-timeout`.
    dial_timeout: Option<Duration>,
    /// Source of frontend and backend uids.
    next_uid: AtomicU64,
    /// What the server records.
    pub(crate) metrics: Arc<ServerMetrics>,
}

impl Tunnels {
    pub(crate) fn new(
        backends: BackendManager,
        dial_timeout: Option<Duration>,
        metrics: Arc<ServerMetrics>,
    ) -> Self {
        Self {
            backends,
            all_backends: Mutex::new(HashMap::new()),
            pending: PendingDials::default(),
            dial_timeout,
            next_uid: AtomicU64::new(1),
            metrics,
        }
    }

    pub(crate) fn next_uid(&self) -> u64 {
        self.next_uid.fetch_add(1, Ordering::Relaxed)
    }

    /// Number of connected agent streams.
    pub(crate) fn backend_count(&self) -> usize {
        lock(&self.all_backends).len()
    }

    /// Number of dials waiting for a DIAL_RSP.
    pub(crate) fn pending_count(&self) -> usize {
        self.pending.len()
    }

    /// Number of established connections.
    pub(crate) fn established_count(&self) -> usize {
        lock(&self.all_backends)
            .values()
            .map(|b| b.conn_count())
            .sum()
    }

    pub(crate) fn add_backend(&self, backend: &Arc<Backend>) {
        lock(&self.all_backends).insert(backend.uid, backend.clone());
        self.backends.add(backend);
    }

    /// Handles a packet from a frontend.
    pub(crate) async fn frontend_packet(self: &Arc<Self>, fe: &Arc<Frontend>, packet: Packet) {
        if fe.state().failed {
            debug!(frontend = fe.uid, "ignoring packet after a protocol error");
            return;
        }
        match packet.into_kind() {
            PacketKind::DialReq(req) => self.dial(fe, req).await,
            PacketKind::Data(data) => {
                let id = ConnId(data.connect_id);
                if id.0 == 0 {
                    debug!(frontend = fe.uid, "dropping DATA with connection id 0");
                    return;
                }
                match self.owner(fe, id) {
                    Owner::Ours(conn) => {
                        self.metrics.bytes("to_agent", data.data.len());
                        send_data(&conn, data.data).await;
                    }
                    Owner::Nobody => {
                        fe.notify(Packet::close_response(id.0, "backend not initialized"));
                    }
                    Owner::Closed => {
                        debug!(frontend = fe.uid, conn.id = %id, "dropping DATA for a closed connection")
                    }
                    Owner::Other => self.mismatch(fe, id),
                }
            }
            PacketKind::CloseReq(req) => {
                let id = ConnId(req.connect_id);
                match self.owner(fe, id) {
                    Owner::Ours(conn) => {
                        debug!(frontend = fe.uid, conn.id = %id, "frontend closes connection");
                        conn.backend.send_control(Packet::close_request(id.0));
                    }
                    Owner::Nobody => {
                        fe.notify(Packet::close_response(id.0, "backend uninitialized"));
                    }
                    Owner::Closed => {
                        debug!(frontend = fe.uid, conn.id = %id, "CLOSE_REQ for an already closed connection")
                    }
                    Owner::Other => self.mismatch(fe, id),
                }
            }
            PacketKind::DialCls(cls) => {
                let id = DialId(cls.random);
                if let Some(dial) = self.pending.remove_if(id, |d| d.frontend.uid == fe.uid) {
                    fe.state().pending.remove(&id);
                    debug!(frontend = fe.uid, dial.id = %id, "frontend cancelled dial");
                    self.metrics.dial_failed(DialFailure::FrontendClose);
                    // ANP's agent ignores DIAL_CLS; ours stops dialing.
                    dial.backend.send_control(Packet::close_dial(id.0));
                }
            }
            other => {
                debug!(frontend = fe.uid, packet = ?other, "ignoring unexpected packet from frontend")
            }
        }
    }

    fn owner(&self, fe: &Frontend, id: ConnId) -> Owner {
        let state = fe.state();
        match state.conns.get(&id) {
            Some(conn) => Owner::Ours(conn.clone()),
            None if state.was_closed(id) => Owner::Closed,
            None if state.conns.is_empty() && state.pending.is_empty() && !state.dialed => {
                Owner::Nobody
            }
            None => Owner::Other,
        }
    }

    /// A frontend used a connection id it does not own: answer it and close
    /// the frontend's own connections (ANP), touching nobody else's.
    fn mismatch(&self, fe: &Arc<Frontend>, bad: ConnId) {
        warn!(frontend = fe.uid, conn.id = %bad, "frontend used a connection id it does not own");
        let own: Vec<(ConnId, Arc<ServerConn>)> = {
            let mut state = fe.state();
            state.failed = true;
            let ids: Vec<ConnId> = state.conns.keys().copied().collect();
            ids.into_iter()
                .filter_map(|id| state.close_conn(id).map(|b| (id, b)))
                .collect()
        };
        fe.notify(Packet::close_response(bad.0, MISMATCHED));
        for (id, conn) in own {
            if conn.backend.remove_conn(id).is_some() {
                self.metrics
                    .connection_closed(CloseReason::Mismatch, conn.established.elapsed());
                conn.backend.send_control(Packet::close_request(id.0));
            }
            fe.notify(Packet::close_response(id.0, MISMATCHED));
        }
    }

    async fn dial(self: &Arc<Self>, fe: &Arc<Frontend>, req: DialRequest) {
        let id = DialId(req.random);
        let Some(backend) = self.backends.pick(&req.address) else {
            debug!(frontend = fe.uid, dial.id = %id, address = %req.address, "no agent for dial");
            // ANP counts it for gRPC frontends only; HTTP CONNECT answers 503.
            if fe.kind == FrontendKind::Grpc {
                self.metrics.dial_failed(DialFailure::NoAgent);
            }
            fe.notify(Packet::dial_response(id.0, 0, NO_AGENT));
            return;
        };
        let registered = {
            let mut state = fe.state();
            if state.closed {
                return;
            }
            let dial = PendingDial {
                frontend: fe.clone(),
                backend: backend.clone(),
                started: Instant::now(),
            };
            let fresh = self.pending.insert(id, dial);
            if fresh {
                state.pending.insert(id, backend.clone());
                state.dialed = true;
            }
            fresh
        };
        if registered {
            self.metrics.dial_pending();
        }
        if !registered {
            fe.notify(Packet::dial_response(id.0, 0, "dial id already pending"));
            return;
        }
        debug!(frontend = fe.uid, dial.id = %id, address = %req.address, agent.id = %backend.agent_id, "dial");
        let forward = backend.send(Packet::dial_request(&req.protocol, &req.address, id.0));
        let closed = || (DialFailure::BackendClose, AGENT_STREAM_CLOSED);
        let sent = match self.dial_timeout {
            None => forward.await.map_err(|_| closed()),
            Some(limit) => match tokio::time::timeout(limit, forward).await {
                Ok(sent) => sent.map_err(|_| closed()),
                Err(_) => {
                    warn!(agent.id = %backend.agent_id, "agent did not take a dial in time; retiring its stream");
                    self.retire(&backend);
                    Err((DialFailure::BackendDialTimeout, DIAL_TIMED_OUT))
                }
            },
        };
        if let Err((failure, error)) = sent {
            // Counted once: whoever removes the pending dial counts it.
            if self
                .pending
                .remove_if(id, |d| d.frontend.uid == fe.uid)
                .is_some()
            {
                self.metrics.dial_failed(failure);
                fe.state().pending.remove(&id);
                fe.notify(Packet::dial_response(id.0, 0, error));
            }
            return;
        }
        if let Some(limit) = self.dial_timeout {
            // Weak: the timer must not keep a finished frontend alive, and
            // it ends with the frontend.
            let tunnels = Arc::downgrade(self);
            let weak_fe = Arc::downgrade(fe);
            let end = fe.end.clone();
            tokio::spawn(async move {
                tokio::select! {
                    () = end.ended() => return,
                    () = tokio::time::sleep(limit) => {}
                }
                let (Some(tunnels), Some(fe)) = (tunnels.upgrade(), weak_fe.upgrade()) else {
                    return;
                };
                if let Some(dial) = tunnels.pending.remove_if(id, |d| d.frontend.uid == fe.uid) {
                    fe.state().pending.remove(&id);
                    debug!(dial.id = %id, "dial timed out");
                    tunnels.metrics.dial_failed(DialFailure::BackendDialTimeout);
                    fe.notify(Packet::dial_response(id.0, 0, DIAL_TIMED_OUT));
                    dial.backend.send_control(Packet::close_dial(id.0));
                }
            });
        }
    }

    /// Takes a backend out of service: no new dials, stream ended.
    fn retire(&self, backend: &Backend) {
        backend.set_draining();
        self.backends.remove(backend);
        backend.end.end();
    }

    /// Handles a packet from an agent.
    pub(crate) async fn backend_packet(&self, be: &Arc<Backend>, packet: Packet) {
        if let Some((id, credit)) = flow::parse_credit(&packet) {
            if let Some(credit_of) = be.conn(ConnId(id)).and_then(|c| c.conn.send_credit.clone()) {
                credit_of.grant(credit);
            }
            return;
        }
        match packet.into_kind() {
            PacketKind::DialRsp(rsp) => {
                let id = DialId(rsp.random);
                let conn = ConnId(rsp.connect_id);
                let Some(dial) = self.pending.remove_if(id, |d| d.backend.uid == be.uid) else {
                    debug!(agent.id = %be.agent_id, dial.id = %id, conn.id = %conn, "DIAL_RSP for no pending dial");
                    self.metrics.dial_failed(DialFailure::UnrecognizedResponse);
                    if conn.0 != 0 {
                        be.send_control(Packet::close_request(conn.0));
                    }
                    return;
                };
                let fe = dial.frontend;
                if !rsp.error.is_empty() {
                    fe.state().pending.remove(&id);
                    debug!(dial.id = %id, error = %rsp.error, "dial failed");
                    self.metrics.dial_failed(DialFailure::ErrorResponse);
                    fe.notify(Packet::dial_response(id.0, 0, &rsp.error));
                    return;
                }
                let attached = {
                    let mut state = fe.state();
                    state.pending.remove(&id);
                    if state.closed || state.failed {
                        false
                    } else {
                        let server_conn = Arc::new(ServerConn::new(conn, be.clone()));
                        state.conns.insert(conn, server_conn.clone());
                        be.insert_conn(
                            conn,
                            BackendConn {
                                conn: server_conn,
                                frontend: fe.clone(),
                            },
                        );
                        true
                    }
                };
                if !attached {
                    self.metrics.dial_failed(DialFailure::FrontendClose);
                    be.send_control(Packet::close_request(conn.0));
                    return;
                }
                self.metrics.connection_established();
                let latency = dial.started.elapsed();
                debug!(dial.id = %id, conn.id = %conn, ?latency, "connection established");
                if fe.notify(Packet::dial_response(id.0, conn.0, "")) {
                    // ANP observes the latency once the DIAL_RSP is delivered.
                    self.metrics.dial_succeeded(latency);
                } else {
                    self.metrics.dial_failed(DialFailure::SendRsp);
                    fe.state().close_conn(conn);
                    if be.remove_conn(conn).is_some() {
                        be.send_control(Packet::close_request(conn.0));
                    }
                }
            }
            PacketKind::Data(data) => {
                let id = ConnId(data.connect_id);
                match be.conn(id) {
                    Some(BackendConn { conn, frontend }) => {
                        let len = data.data.len();
                        self.metrics.bytes("to_frontend", len);
                        match frontend
                            .push_data(&conn, Packet::data(id.0, data.data), len)
                            .await
                        {
                            // Closed: a gone frontend closes its connections itself.
                            Ok(()) | Err(PushError::Closed) => {}
                            Err(PushError::Overflow) => self.overflow(be, &frontend, id),
                        }
                    }
                    None if id.0 != 0 => {
                        debug!(agent.id = %be.agent_id, conn.id = %id, "DATA for unknown connection");
                        be.send_control(Packet::close_request(id.0));
                    }
                    None => debug!(agent.id = %be.agent_id, "dropping DATA with connection id 0"),
                }
            }
            PacketKind::CloseRsp(rsp) => {
                let id = ConnId(rsp.connect_id);
                if let Some(BackendConn { frontend, conn }) = be.remove_conn(id) {
                    frontend.state().close_conn(id);
                    let reason = if rsp.error.is_empty() {
                        CloseReason::Closed
                    } else {
                        CloseReason::Error
                    };
                    self.metrics
                        .connection_closed(reason, conn.established.elapsed());
                    debug!(conn.id = %id, error = %rsp.error, "connection closed");
                    frontend.notify(Packet::close_response(id.0, &rsp.error));
                }
            }
            PacketKind::DialCls(cls) => {
                let id = DialId(cls.random);
                if let Some(dial) = self.pending.remove_if(id, |d| d.backend.uid == be.uid) {
                    dial.frontend.state().pending.remove(&id);
                    dial.frontend.notify(Packet::close_dial(id.0));
                }
            }
            PacketKind::Drain => {
                info!(agent.id = %be.agent_id, "agent is draining");
                be.set_draining();
            }
            other => {
                debug!(agent.id = %be.agent_id, packet = ?other, "ignoring unexpected packet from agent")
            }
        }
    }

    /// A frontend stream ended: cancel its dials and close its connections
    /// on the agents.
    pub(crate) fn frontend_closed(&self, fe: &Arc<Frontend>) {
        let (pending, conns) = {
            let mut state = fe.state();
            state.closed = true;
            (
                std::mem::take(&mut state.pending),
                std::mem::take(&mut state.conns),
            )
        };
        for (id, backend) in pending {
            if self
                .pending
                .remove_if(id, |d| d.frontend.uid == fe.uid)
                .is_some()
            {
                debug!(frontend = fe.uid, dial.id = %id, "frontend gone; cancelling dial");
                // ANP counts a gRPC frontend's pending dials only on DIAL_CLS.
                if fe.kind == FrontendKind::HttpConnect {
                    self.metrics.dial_failed(DialFailure::FrontendClose);
                }
                backend.send_control(Packet::close_dial(id.0));
            }
        }
        for (id, conn) in conns {
            if conn.backend.remove_conn(id).is_some() {
                debug!(frontend = fe.uid, conn.id = %id, "frontend gone; closing connection");
                self.metrics
                    .connection_closed(CloseReason::FrontendGone, conn.established.elapsed());
                conn.backend.send_control(Packet::close_request(id.0));
            }
        }
    }

    /// An agent stream ended: its connections are closed towards their
    /// frontends and its pending dials fail at once (not left to a backstop).
    pub(crate) fn backend_closed(&self, be: &Arc<Backend>) {
        lock(&self.all_backends).remove(&be.uid);
        self.backends.remove(be);
        be.end.end();
        let conns = be.take_conns();
        let dials = self.pending.remove_for_backend(be.uid);
        info!(agent.id = %be.agent_id, peer.addr = ?be.peer, connections = conns.len(), dials = dials.len(), "agent disconnected");
        let reason = format!("agent {} disconnected", be.agent_id);
        for (id, BackendConn { frontend, conn }) in conns {
            self.metrics
                .connection_closed(CloseReason::AgentGone, conn.established.elapsed());
            frontend.state().close_conn(id);
            frontend.notify(Packet::close_response(id.0, &reason));
        }
        for (id, dial) in dials {
            self.metrics.dial_failed(DialFailure::BackendClose);
            dial.frontend.state().pending.remove(&id);
            dial.frontend
                .notify(Packet::dial_response(id.0, 0, &reason));
        }
    }

    /// A connection's frontend fell a window behind: close it on both ends
    /// with [`flow::OVERFLOW`] rather than stall the agent stream.
    fn overflow(&self, be: &Arc<Backend>, frontend: &Arc<Frontend>, id: ConnId) {
        warn!(agent.id = %be.agent_id, conn.id = %id, "connection closed: its frontend reads too slowly");
        self.close_on_both_ends(be, frontend, id, CloseReason::Overflow, flow::OVERFLOW);
    }

    /// Closes every connection whose frontend has left its queued DATA
    /// untaken for `limit` (`--frontend-stall-timeout`), with an error at
    /// both ends: CLOSE_REQ to the agent, CLOSE_RSP with [`STALLED`] to a
    /// gRPC frontend; an HTTP-CONNECT client's socket is closed.
    pub(crate) fn close_stalled(&self, limit: Duration) {
        for be in self.backends_snapshot() {
            for (id, frontend) in be.stalled(limit) {
                warn!(agent.id = %be.agent_id, conn.id = %id, ?limit, "connection closed: its frontend took none of its data");
                self.close_on_both_ends(&be, &frontend, id, CloseReason::Stalled, STALLED);
                if frontend.kind == FrontendKind::HttpConnect {
                    frontend.end.fail(tonic::Status::deadline_exceeded(STALLED));
                }
            }
        }
    }

    fn close_on_both_ends(
        &self,
        be: &Arc<Backend>,
        frontend: &Arc<Frontend>,
        id: ConnId,
        reason: CloseReason,
        error: &str,
    ) {
        let Some(BackendConn { conn, .. }) = be.remove_conn(id) else {
            return;
        };
        self.metrics
            .connection_closed(reason, conn.established.elapsed());
        frontend.state().close_conn(id);
        be.send_control(Packet::close_request(id.0));
        frontend.notify(Packet::close_response(id.0, error));
    }

    /// The most cost any connection has queued towards its frontend.
    pub(crate) fn max_buffered(&self) -> usize {
        self.buffered().0
    }

    /// The most and the total cost queued towards frontends.
    pub(crate) fn buffered(&self) -> (usize, usize) {
        lock(&self.all_backends)
            .values()
            .map(|b| b.queued())
            .fold((0, 0), |(max, total), (m, t)| (max.max(m), total + t))
    }

    /// Every live backend (for shutdown).
    pub(crate) fn backends_snapshot(&self) -> Vec<Arc<Backend>> {
        lock(&self.all_backends).values().cloned().collect()
    }
}

/// Who owns a connection id a frontend used.
enum Owner {
    /// This frontend's connection.
    Ours(Arc<ServerConn>),
    /// Nobody: the frontend never dialed.
    Nobody,
    /// This frontend's, but already closed (the frontend has not learnt it yet).
    Closed,
    /// Not this frontend.
    Other,
}

/// Sends frontend DATA to the agent; with flow control, in pieces that fit a
/// window, each waiting for credit (this holds up only this frontend).
/// Every wait ends when the connection is closed.
async fn send_data(conn: &ServerConn, data: bytes::Bytes) {
    tokio::select! {
        () = conn.closed.cancelled() => {
            debug!(conn.id = %conn.id, "dropping DATA for a connection closed while it waited");
        }
        () = send_data_inner(conn, data) => {}
    }
}

async fn send_data_inner(conn: &ServerConn, mut data: bytes::Bytes) {
    let Some(credit) = &conn.send_credit else {
        // A dead backend is reported to the frontend by its teardown.
        let _ = conn.backend.send(Packet::data(conn.id.0, data)).await;
        return;
    };
    while !data.is_empty() {
        let piece = data.split_to(data.len().min(flow::MAX_CHUNK));
        if credit.take(flow::cost(piece.len())).await.is_err()
            || conn
                .backend
                .send(Packet::data(conn.id.0, piece))
                .await
                .is_err()
        {
            return;
        }
    }
}
