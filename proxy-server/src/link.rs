//! The outbound side of the server's streams: where the routing core's
//! packets go. A [`FrontendLink`] or [`BackendLink`] owns the sending end
//! of its stream's byte-bounded queue and the stream's [`StreamEnd`]: how
//! a server-side gRPC stream (an agent's `Connect`, a frontend's `Proxy`)
//! is ended from inside the server, with an error status for the peer when
//! it ends on a fault. A [`ConnFlow`] is one established connection's flow
//! state, kept by the router's driver (`hub`) from the router's `Opened` to
//! its `Closed` and shared with the transports that move its bytes: its
//! window towards the frontend, its credit towards the agent (returned on
//! its agent's link as the frontend takes its DATA), its stall clock.

use std::{
    net::SocketAddr,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use futures_util::{Stream, StreamExt, stream};

use proto::Packet;
use tokio_util::sync::CancellationToken;
use tonic::Status;
use tracing::warn;
use tunnel::{
    flow::{self, Budget, Granter, SendCredit},
    ids::{AgentId, ConnId},
    queue::{self, Closed, QueueRx, QueueTx},
};

use crate::{
    events::Limit,
    ids::BackendId,
    lock,
    metrics::ServerMetrics,
    router::{FrontendId, FrontendKind},
};

/// Control packets (DIAL_RSP, CLOSE_RSP, DIAL_CLS) a frontend may leave
/// unread before its stream is ended: a frontend that keeps dialing
/// without reading its answers is broken, and must not make the server
/// hold its answers without bound.
pub(crate) const FRONTEND_CONTROL_RESERVE: usize = 256 * 1024;

/// Room for control packets beyond `--max-agent-queue-bytes`: past it the
/// agent has stopped reading.
pub(crate) const BACKEND_CONTROL_RESERVE: usize = 1024 * 1024;

/// An item of a frontend's outbound queue: a packet, and for DATA the
/// connection and cost to release once the frontend took it.
pub(crate) struct FrontendItem {
    /// The packet.
    pub(crate) packet: Packet,
    /// For DATA: whose bytes, and what they cost.
    pub(crate) data: Option<(Arc<ConnFlow>, usize)>,
}

impl FrontendItem {
    /// The frontend took the packet: releases its window and, when enough
    /// has drained, returns credit to the connection's agent.
    pub(crate) fn taken(self) -> Packet {
        if let Some((conn, cost)) = &self.data
            && let Some(credit) = conn.drained(*cost, Instant::now())
        {
            conn.agent.send_control(credit);
        }
        self.packet
    }
}

/// What a gRPC frontend's response stream sends: the items of its queue,
/// each taken as tonic takes it for the HTTP/2 stream (which has a window
/// of its own): counted, its window released and, with credit, credit
/// returned to its agent.
pub(crate) fn taken_by_frontend(
    rx: QueueRx<FrontendItem>,
    metrics: Arc<ServerMetrics>,
) -> impl Stream<Item = Packet> + Send + 'static {
    rx.map(move |item| {
        metrics.packet("to_client", &item.packet);
        item.taken()
    })
}

/// A frontend's outbound queue: nobody waits on it; DATA is admitted by its
/// connection's window and control packets up to the reserve.
pub(crate) fn frontend_queue() -> (QueueTx<FrontendItem>, QueueRx<FrontendItem>) {
    queue::queue(0, FRONTEND_CONTROL_RESERVE)
}

/// Why DATA could not be queued towards a frontend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DataRefused {
    /// The connection is a window behind: close it.
    Overflow,
    /// The frontend is gone.
    Gone,
}

/// Where packets for one frontend stream go.
#[derive(Clone)]
pub(crate) struct FrontendLink {
    /// The frontend, for logs.
    pub(crate) id: FrontendId,
    /// Its protocol.
    pub(crate) kind: FrontendKind,
    /// Its outbound queue; the transport drains the receiver.
    tx: QueueTx<FrontendItem>,
    /// Ends its stream (its reader, its outbound packets), with a status.
    pub(crate) end: Arc<StreamEnd>,
    /// Where writes to the frontend are timed and lost packets counted.
    metrics: Arc<ServerMetrics>,
}

impl FrontendLink {
    pub(crate) fn new(
        id: FrontendId,
        kind: FrontendKind,
        tx: QueueTx<FrontendItem>,
        end: Arc<StreamEnd>,
        metrics: Arc<ServerMetrics>,
    ) -> Self {
        Self {
            id,
            kind,
            tx,
            end,
            metrics,
        }
    }

    /// Counts a packet that could not reach a gRPC frontend (its stream is
    /// gone) as ANP counts a failed `Send`.
    fn undelivered(&self, packet: &Packet) {
        if self.kind == FrontendKind::Grpc {
            self.metrics.send_error("to_client", packet);
        }
    }

    /// Queues a control packet without waiting; `false` if it could not be
    /// queued. A frontend that leaves [`FRONTEND_CONTROL_RESERVE`] of them
    /// unread has its stream ended with an error.
    pub(crate) fn send_control(&self, packet: Packet) -> bool {
        tracing::trace!(frontend = %self.id, packet = packet.type_name(), "to frontend");
        let started = std::time::Instant::now();
        let cost = flow::packet_cost(&packet);
        let pushed = self.tx.push(FrontendItem { packet, data: None }, cost);
        self.metrics.frontend_write(started.elapsed());
        match pushed {
            Ok(()) => true,
            Err(queue::PushError::Closed(item)) => {
                self.undelivered(&item.packet);
                false
            }
            Err(queue::PushError::Full(item)) => {
                self.undelivered(&item.packet);
                self.fail_unread();
                false
            }
        }
    }

    /// Ends a frontend that does not read its stream.
    fn fail_unread(&self) {
        if !self.end.is_ended() {
            warn!(frontend = %self.id, "frontend does not read its stream; closing it");
            self.metrics.limit_reached(Limit::FrontendQueue);
        }
        self.end.fail(Status::resource_exhausted(
            "the frontend does not read its stream: too many answers queued",
        ));
    }

    /// Queues agent DATA of `conn` whose `cost` the window already admitted
    /// (the window, not the control reserve, bounds DATA).
    pub(crate) fn push_data(
        &self,
        conn: Arc<ConnFlow>,
        packet: Packet,
        cost: usize,
    ) -> Result<(), DataRefused> {
        if conn.budget.queued() == cost {
            // The only DATA queued: the frontend's wait starts now.
            conn.mark_progress(std::time::Instant::now());
        }
        let item = FrontendItem {
            packet,
            data: Some((conn, cost)),
        };
        self.tx.push(item, 0).map_err(|e| {
            let item = match e {
                queue::PushError::Full(item) => {
                    self.fail_unread();
                    item
                }
                queue::PushError::Closed(item) => {
                    self.undelivered(&item.packet);
                    item
                }
            };
            if let Some((conn, cost)) = &item.data {
                conn.budget.release(*cost);
            }
            DataRefused::Gone
        })
    }

    /// Times a write to the frontend (ANP's `frontend_write_duration`).
    pub(crate) fn timed(&self, took: std::time::Duration) {
        self.metrics.frontend_write(took);
    }

    /// Resolves once the stream is over: ended from inside the server, or
    /// its transport dropped the receiving end.
    pub(crate) async fn gone(&self) {
        tokio::select! {
            () = self.tx.closed() => {}
            () = self.end.ended() => {}
        }
    }
}

/// The agent stream is gone; the packet was not sent.
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error("agent stream closed")]
pub(crate) struct BackendGone;

/// Where packets for one agent stream go.
#[derive(Clone)]
pub(crate) struct BackendLink {
    /// The agent's self-asserted id.
    pub(crate) agent_id: AgentId,
    /// The agent's address, if known.
    pub(crate) peer: Option<SocketAddr>,
    /// Outbound packets, bounded in bytes; tonic drains the receiver into
    /// the stream.
    tx: QueueTx<Packet>,
    /// Ends the stream (agent gone, retired, shutdown, a fault).
    pub(crate) end: Arc<StreamEnd>,
    /// Where packets that cannot be sent are counted.
    metrics: Arc<ServerMetrics>,
}

impl BackendLink {
    pub(crate) fn new(
        agent_id: AgentId,
        peer: Option<SocketAddr>,
        tx: QueueTx<Packet>,
        end: Arc<StreamEnd>,
        metrics: Arc<ServerMetrics>,
    ) -> Self {
        Self {
            agent_id,
            peer,
            tx,
            end,
            metrics,
        }
    }

    /// Queues a packet for the agent, waiting while the stream's queue is
    /// full (`--max-agent-queue-bytes`). For a frontend's DATA and dials,
    /// whose callers race the wait against their own end.
    pub(crate) async fn send(&self, packet: Packet) -> Result<(), BackendGone> {
        tracing::trace!(agent.id = %self.agent_id, packet = packet.type_name(), "to agent");
        let cost = flow::packet_cost(&packet);
        self.tx.send(packet, cost).await.map_err(|Closed(packet)| {
            self.metrics.send_error("to_agent", &packet);
            BackendGone
        })
    }

    /// Queues a control packet without waiting: stream readers and cleanup
    /// send these and must not wait on an agent (two full queues waiting
    /// on each other would deadlock). Past the queue's reserve the agent has
    /// stopped reading its stream: the stream is ended with an error.
    pub(crate) fn send_control(&self, packet: Packet) {
        tracing::trace!(agent.id = %self.agent_id, packet = packet.type_name(), "to agent");
        let cost = flow::packet_cost(&packet);
        match self.tx.push(packet, cost) {
            Ok(()) => {}
            Err(queue::PushError::Closed(packet)) => self.metrics.send_error("to_agent", &packet),
            Err(queue::PushError::Full(packet)) => {
                self.metrics.send_error("to_agent", &packet);
                if !self.end.is_ended() {
                    warn!(agent.id = %self.agent_id, queued = self.tx.queued(), "agent does not read its stream; closing it");
                    self.metrics.limit_reached(Limit::AgentQueue);
                }
                self.end.fail(Status::resource_exhausted(
                    "the agent does not read its stream: its outbound queue is full",
                ));
            }
        }
    }
}

/// The end of one stream: a token that stops its reader and its outbound
/// packets, and the status the peer gets.
pub(crate) struct StreamEnd {
    /// Cancelled when the stream must end (the reader stops, the outbound
    /// stream stops after the packet being sent).
    cancel: CancellationToken,
    /// The status the stream ends with; `None` is OK.
    status: Mutex<Option<Status>>,
}

impl StreamEnd {
    /// An end triggered by `cancel` (a child of the server's shutdown).
    pub(crate) fn new(cancel: CancellationToken) -> Arc<Self> {
        Arc::new(Self {
            cancel,
            status: Mutex::new(None),
        })
    }

    /// Ends the stream with OK (unless it already failed).
    pub(crate) fn end(&self) {
        self.cancel.cancel();
    }

    /// Ends the stream with `status`; the first failure wins.
    pub(crate) fn fail(&self, status: Status) {
        lock(&self.status).get_or_insert(status);
        self.cancel.cancel();
    }

    /// Whether the stream was ended.
    pub(crate) fn is_ended(&self) -> bool {
        self.cancel.is_cancelled()
    }

    /// Resolves once the stream is ended.
    pub(crate) async fn ended(&self) {
        self.cancel.cancelled().await;
    }

    /// What tonic sends the peer: `packets` until the stream is ended, then
    /// the failure status, if any (tonic ends the stream with it).
    pub(crate) fn outbound<S>(
        self: Arc<Self>,
        packets: S,
    ) -> impl Stream<Item = Result<Packet, Status>> + Send + 'static
    where
        S: Stream<Item = Packet> + Send + 'static,
    {
        let cancel = self.cancel.clone();
        packets.map(Ok).take_until(cancel.cancelled_owned()).chain(
            stream::once(async move { lock(&self.status).take() })
                .filter_map(|status| std::future::ready(status.map(Err))),
        )
    }
}

/// An established connection's flow state in both directions.
pub(crate) struct ConnFlow {
    /// The agent-assigned id.
    pub(crate) id: ConnId,
    /// The agent stream it runs over.
    pub(crate) backend: BackendId,
    /// Where its DATA and its credit go.
    pub(crate) agent: BackendLink,
    /// Whether the agent stream negotiated credit (`tunnel::flow`).
    pub(crate) flow_control: bool,
    /// Cost of agent DATA queued towards the frontend and not yet taken by it
    /// (bounded by [`flow::WINDOW`]).
    pub(crate) budget: Budget,
    /// Credit to return to the agent as the frontend drains (negotiated only).
    granter: Mutex<Granter>,
    /// Credit for DATA to the agent (negotiated only).
    pub(crate) send_credit: Option<SendCredit>,
    /// When the dial succeeded.
    pub(crate) established: Instant,
    /// When the frontend last took DATA of this connection, or when DATA
    /// was queued for it while nothing was (milliseconds after
    /// `established`): how long its frontend has left its bytes unread.
    progress: AtomicU64,
    /// Cancelled once the connection leaves the routing core's tables:
    /// every wait on its behalf (credit, room in the agent queue) ends with
    /// it.
    pub(crate) closed: CancellationToken,
}

impl ConnFlow {
    pub(crate) fn new(
        id: ConnId,
        backend: BackendId,
        agent: BackendLink,
        flow_control: bool,
        now: Instant,
    ) -> Self {
        Self {
            id,
            backend,
            agent,
            flow_control,
            budget: Budget::default(),
            granter: Mutex::new(Granter::default()),
            send_credit: flow_control.then(SendCredit::new),
            established: now,
            progress: AtomicU64::new(0),
            closed: CancellationToken::new(),
        }
    }

    /// Ends every wait on this connection's behalf.
    pub(crate) fn close(&self) {
        self.closed.cancel();
        if let Some(credit) = &self.send_credit {
            credit.close();
        }
    }

    /// Records that the frontend took `cost` of this connection's DATA at
    /// `now`; the credit grant to send the agent when enough has drained.
    pub(crate) fn drained(&self, cost: usize, now: Instant) -> Option<Packet> {
        self.budget.release(cost);
        self.mark_progress(now);
        if !self.flow_control {
            return None;
        }
        let empty = self.budget.queued() == 0;
        let credit = lock(&self.granter).drained(cost, empty)?;
        Some(flow::credit_packet(self.id.0, credit))
    }

    /// Records progress at `now`: the frontend took DATA, or DATA was
    /// queued while none was (its wait starts then).
    pub(crate) fn mark_progress(&self, now: Instant) {
        let at = now.saturating_duration_since(self.established).as_millis();
        self.progress
            .store(u64::try_from(at).unwrap_or(u64::MAX), Ordering::Relaxed);
    }

    /// How long, at `now`, the frontend has left queued DATA unread (zero
    /// when none is queued).
    pub(crate) fn stalled_for(&self, now: Instant) -> Duration {
        if self.budget.queued() == 0 {
            return Duration::ZERO;
        }
        let since = Duration::from_millis(self.progress.load(Ordering::Relaxed));
        now.saturating_duration_since(self.established)
            .saturating_sub(since)
    }

    /// Cost units queued towards the frontend now.
    pub(crate) fn queued(&self) -> usize {
        self.budget.queued()
    }
}

impl std::fmt::Debug for ConnFlow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnFlow")
            .field("id", &self.id)
            .field("backend", &self.backend)
            .finish_non_exhaustive()
    }
}

/// The most and the total cost queued towards frontends over `conns`.
pub(crate) fn buffered<'a>(conns: impl Iterator<Item = &'a ConnFlow>) -> (usize, usize) {
    conns
        .map(ConnFlow::queued)
        .fold((0, 0), |(max, total), q| (max.max(q), total + q))
}

#[cfg(test)]
mod tests {
    use tokio_util::sync::CancellationToken;

    use super::*;

    fn frontend(kind: FrontendKind) -> (FrontendLink, Arc<ServerMetrics>, QueueRx<FrontendItem>) {
        let metrics = Arc::new(ServerMetrics::new(&[]));
        let (tx, rx) = frontend_queue();
        let end = StreamEnd::new(CancellationToken::new());
        (
            FrontendLink::new(FrontendId(1), kind, tx, end, metrics.clone()),
            metrics,
            rx,
        )
    }

    #[tokio::test]
    async fn packets_for_a_gone_grpc_frontend_are_send_errors() {
        let (fe, metrics, rx) = frontend(FrontendKind::Grpc);
        drop(rx);
        assert!(!fe.send_control(Packet::dial_response(1, 0, "x")));
        fe.send_control(Packet::close_response(2, ""));
        let text = metrics.text();
        let series = |kind: &str| {
            format!(
                "konnectivity_network_proxy_server_stream_errors_total{{code=\"Unavailable\",packet_type=\"{kind}\",segment=\"to_client\"}} 1\n"
            )
        };
        assert!(text.contains(&series("DIAL_RSP")), "{text}");
        assert!(text.contains(&series("CLOSE_RSP")), "{text}");
        // Both writes were timed, as ANP times every frontend send.
        assert!(
            text.contains(
                "konnectivity_network_proxy_server_frontend_write_duration_seconds_count 2\n"
            ),
            "{text}"
        );
    }

    #[tokio::test]
    async fn an_http_connect_frontend_has_no_packet_errors() {
        let (fe, metrics, rx) = frontend(FrontendKind::HttpConnect);
        drop(rx);
        fe.send_control(Packet::dial_response(1, 0, "x"));
        assert!(!metrics.text().contains("stream_errors_total{"));
    }

    #[tokio::test]
    async fn a_frontend_that_leaves_its_answers_unread_is_ended_with_an_error() {
        let (fe, metrics, _rx) = frontend(FrontendKind::Grpc);
        let answer = Packet::dial_response(1, 0, &"x".repeat(1000));
        let mut sent = 0;
        while !fe.end.is_ended() {
            fe.send_control(answer.clone());
            sent += 1;
            assert!(
                sent <= FRONTEND_CONTROL_RESERVE / 1000 + 1,
                "{sent} answers queued"
            );
        }
        assert!(sent >= FRONTEND_CONTROL_RESERVE / flow::packet_cost(&answer));
        assert!(
            metrics.text().contains(
                "konnectivity_rs_server_limit_reached_total{limit=\"frontend_queue\"} 1\n"
            )
        );
    }

    fn backend(limit: usize) -> (BackendLink, Arc<ServerMetrics>, QueueRx<Packet>) {
        let metrics = Arc::new(ServerMetrics::new(&[]));
        let (tx, rx) = queue::queue(limit, limit);
        let link = BackendLink::new(
            AgentId("a".to_owned()),
            None,
            tx,
            StreamEnd::new(CancellationToken::new()),
            metrics.clone(),
        );
        (link, metrics, rx)
    }

    const CLOSE_REQ_LOST: &str = "konnectivity_network_proxy_server_stream_errors_total{code=\"Unavailable\",packet_type=\"CLOSE_REQ\",segment=\"to_agent\"}";

    #[tokio::test]
    async fn a_packet_for_a_gone_agent_is_counted_as_a_send_error() {
        let (backend, metrics, rx) = backend(1024);
        backend.send(Packet::close_request(1)).await.unwrap();
        assert!(!metrics.text().contains("stream_errors_total{"));
        drop(rx);
        assert!(backend.send(Packet::close_request(1)).await.is_err());
        backend.send_control(Packet::close_request(2));
        let text = metrics.text();
        assert!(text.contains(&format!("\n{CLOSE_REQ_LOST} 2\n")), "{text}");
    }

    #[tokio::test]
    async fn an_agent_that_does_not_read_has_its_stream_ended_not_a_task_per_packet() {
        let (backend, metrics, _rx) = backend(64);
        // Control packets never wait; once past the reserve the stream ends.
        let mut sent = 0;
        while !backend.end.is_ended() {
            backend.send_control(Packet::close_request(sent));
            sent += 1;
            assert!(sent < 100, "the queue took {sent} packets");
        }
        assert!(backend.tx.queued() < 2 * 64 + flow::packet_cost(&Packet::close_request(1)));
        let text = metrics.text();
        assert!(
            text.contains("konnectivity_rs_server_limit_reached_total{limit=\"agent_queue\"} 1\n"),
            "{text}"
        );
    }

    #[tokio::test]
    async fn a_failed_stream_ends_with_its_status_after_what_was_sent() {
        let end = StreamEnd::new(CancellationToken::new());
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let mut out = Box::pin(
            end.clone()
                .outbound(tokio_stream::wrappers::ReceiverStream::new(rx)),
        );
        tx.send(Packet::close_request(1)).await.unwrap();
        assert!(matches!(out.next().await, Some(Ok(_))));
        end.fail(Status::resource_exhausted("too large"));
        end.fail(Status::internal("second"));
        let status = out.next().await.unwrap().unwrap_err();
        assert_eq!(status.code(), tonic::Code::ResourceExhausted);
        assert!(out.next().await.is_none());
    }

    #[tokio::test]
    async fn an_ended_stream_ends_ok() {
        let end = StreamEnd::new(CancellationToken::new());
        let mut out = Box::pin(end.clone().outbound(stream::pending::<Packet>()));
        end.end();
        assert!(out.next().await.is_none());
        assert!(end.is_ended());
    }

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn a_connection_is_stalled_from_when_its_data_waited_untaken() {
        let start = Instant::now();
        let conn = ConnFlow::new(ConnId(3), BackendId(1), backend(1 << 20).0, true, start);
        // Nothing queued: never stalled.
        assert_eq!(conn.stalled_for(start + 3600 * 1000 * MS), Duration::ZERO);
        assert!(conn.budget.try_reserve(1000));
        conn.mark_progress(start + 10 * MS);
        assert_eq!(conn.stalled_for(start + 30 * MS), 20 * MS);
        // Taking part of it is progress; the wait starts again.
        let _credit = conn.drained(500, start + 40 * MS);
        assert_eq!(conn.stalled_for(start + 45 * MS), 5 * MS);
        // Taking the rest: nothing queued, not stalled.
        let _credit = conn.drained(500, start + 50 * MS);
        assert_eq!(conn.stalled_for(start + 3600 * 1000 * MS), Duration::ZERO);
    }

    /// The frontend taking a connection's DATA returns credit on the
    /// connection's own agent link (no lock of the hub on the way).
    #[tokio::test]
    async fn a_taken_item_returns_credit_to_its_agent() {
        let (agent, _metrics, mut agent_rx) = backend(1 << 20);
        let conn = Arc::new(ConnFlow::new(
            ConnId(3),
            BackendId(1),
            agent,
            true,
            Instant::now(),
        ));
        let data = Packet::data(3, bytes::Bytes::from_static(b"hello"));
        let cost = flow::cost(5);
        assert!(conn.budget.try_reserve(cost));
        let item = FrontendItem {
            packet: data,
            data: Some((conn.clone(), cost)),
        };
        let packet = item.taken();
        assert_eq!(packet.r#type, proto::PacketType::Data as i32);
        assert_eq!(conn.queued(), 0);
        let credit = agent_rx.recv().await.expect("a credit packet");
        assert_eq!(flow::parse_credit(&credit).map(|(id, _)| id), Some(3));
    }

    #[test]
    fn buffered_bytes_are_summed_over_connections() {
        let now = Instant::now();
        let one = ConnFlow::new(ConnId(3), BackendId(1), backend(1 << 20).0, true, now);
        let two = ConnFlow::new(ConnId(4), BackendId(1), backend(1 << 20).0, true, now);
        assert!(one.budget.try_reserve(100));
        assert!(two.budget.try_reserve(300));
        assert_eq!(buffered([&one, &two].into_iter()), (300, 400));
        assert_eq!(buffered(std::iter::empty()), (0, 0));
    }
}
