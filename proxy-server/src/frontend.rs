//! Frontends: one [`Frontend`] per `ProxyService/Proxy` stream (or, later,
//! per HTTP CONNECT request). Packets for it are queued on a bounded channel
//! whose receiver the transport drains.

pub(crate) mod authority;
pub(crate) mod grpc;
pub(crate) mod http_connect;

use std::{
    collections::{HashMap, VecDeque},
    sync::{Arc, Mutex, MutexGuard},
};

use proto::Packet;
use tonic::Status;
use tracing::warn;
use tunnel::{
    flow::{self, PushError},
    ids::{ConnId, DialId},
    queue::{self, QueueRx, QueueTx},
};

use crate::{
    backend::Backend,
    conn::{ServerConn, ToFrontend},
    lock,
    metrics::{Limit, ServerMetrics},
    stream_end::StreamEnd,
    tunnels::Tunnels,
};

/// One frontend stream.
pub(crate) struct Frontend {
    /// Unique per stream, for logs and ownership checks.
    pub(crate) uid: u64,
    /// Packets to the frontend; the transport drains the receiver and calls
    /// [`ToFrontend::taken`] for each. DATA is bounded per connection by its
    /// window; control packets by [`CONTROL_RESERVE`].
    tx: QueueTx<ToFrontend>,
    /// Ends the stream (its reader, its outbound packets), with a status.
    pub(crate) end: Arc<StreamEnd>,
    /// Dials and connections of this stream.
    state: Mutex<FrontendState>,
    /// Where writes to the frontend are timed.
    metrics: Arc<ServerMetrics>,
    /// Which protocol the frontend speaks.
    pub(crate) kind: FrontendKind,
}

/// The protocol of a frontend: ANP counts some events for one only.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FrontendKind {
    /// A `ProxyService/Proxy` stream: its packets are counted as
    /// `to_client`/`from_client`.
    Grpc,
    /// An HTTP CONNECT request: bytes, not packets, cross to the client.
    HttpConnect,
}

/// Control packets (DIAL_RSP, CLOSE_RSP, DIAL_CLS) a frontend may leave
/// unread before its stream is ended: a frontend that keeps dialing
/// without reading its answers is broken, and must not make the server
/// hold its answers without bound.
pub(crate) const CONTROL_RESERVE: usize = 256 * 1024;

/// A frontend's outbound queue.
pub(crate) fn queue() -> (QueueTx<ToFrontend>, QueueRx<ToFrontend>) {
    // Nobody waits on it: DATA is admitted by its connection's window and
    // control packets up to the reserve.
    queue::queue(0, CONTROL_RESERVE)
}

/// What a frontend has open. Guarded by the frontend's mutex, which is taken
/// before any backend's (never the other way round).
#[derive(Default)]
pub(crate) struct FrontendState {
    /// Set once the stream ended: nothing new may be attached.
    pub(crate) closed: bool,
    /// Set after a protocol violation: further packets are ignored.
    pub(crate) failed: bool,
    /// Dials sent and not yet answered, with the backend each went to.
    pub(crate) pending: HashMap<DialId, Arc<Backend>>,
    /// Established connections.
    pub(crate) conns: HashMap<ConnId, Arc<ServerConn>>,
    /// Whether a dial was ever made on this stream.
    pub(crate) dialed: bool,
    /// The last connections closed under the frontend (agent gone, CLOSE_RSP):
    /// packets it sent for them before it learnt of the close are dropped,
    /// not treated as a protocol error.
    recently_closed: VecDeque<ConnId>,
}

/// How many closed connection ids a frontend remembers.
const RECENTLY_CLOSED: usize = 32;

impl FrontendState {
    /// Removes an established connection and remembers it was closed.
    pub(crate) fn close_conn(&mut self, id: ConnId) -> Option<Arc<ServerConn>> {
        let conn = self.conns.remove(&id)?;
        if self.recently_closed.len() == RECENTLY_CLOSED {
            self.recently_closed.pop_front();
        }
        self.recently_closed.push_back(id);
        Some(conn)
    }

    /// Whether `id` was one of this frontend's connections and is now closed.
    pub(crate) fn was_closed(&self, id: ConnId) -> bool {
        self.recently_closed.contains(&id)
    }
}

impl Frontend {
    pub(crate) fn new(
        uid: u64,
        tx: QueueTx<ToFrontend>,
        end: Arc<StreamEnd>,
        metrics: Arc<ServerMetrics>,
        kind: FrontendKind,
    ) -> Self {
        Self {
            uid,
            tx,
            end,
            state: Mutex::new(FrontendState::default()),
            metrics,
            kind,
        }
    }

    /// Counts a packet that could not reach a gRPC frontend (its stream is
    /// gone) as ANP counts a failed `Send`.
    fn undelivered(&self, packet: &Packet) {
        if self.kind == FrontendKind::Grpc {
            self.metrics.send_error("to_client", packet);
        }
    }

    /// Queues a control packet for the frontend without waiting; `false`
    /// if it could not be queued. A frontend that leaves
    /// [`CONTROL_RESERVE`] of them unread has its stream ended with an
    /// error.
    pub(crate) fn notify(&self, packet: Packet) -> bool {
        tracing::trace!(
            frontend = self.uid,
            packet = packet.type_name(),
            "to frontend"
        );
        let started = std::time::Instant::now();
        let cost = flow::packet_cost(&packet);
        let pushed = self.tx.push(ToFrontend { packet, data: None }, cost);
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
            warn!(
                frontend = self.uid,
                "frontend does not read its stream; closing it"
            );
            self.metrics.limit_reached(Limit::FrontendQueue);
        }
        self.end.fail(Status::resource_exhausted(
            "the frontend does not read its stream: too many answers queued",
        ));
    }

    /// Queues agent DATA of `conn`, bounded by the connection's window: with
    /// flow control it never waits (the agent respects the window); without,
    /// it waits while the frontend drains and gives up after
    /// [`flow::COMPAT_STALL`] without progress. The wait ends with the
    /// connection and with the frontend.
    pub(crate) async fn push_data(
        &self,
        conn: &Arc<ServerConn>,
        packet: Packet,
        len: usize,
    ) -> Result<(), PushError> {
        let started = std::time::Instant::now();
        let pushed = tokio::select! {
            () = conn.closed.cancelled() => Err(PushError::Closed),
            () = self.gone() => Err(PushError::Closed),
            pushed = self.push_data_inner(conn, packet, len) => pushed,
        };
        self.metrics.frontend_write(started.elapsed());
        pushed
    }

    async fn push_data_inner(
        &self,
        conn: &Arc<ServerConn>,
        packet: Packet,
        len: usize,
    ) -> Result<(), PushError> {
        let cost = flow::cost(len);
        let was_empty = conn.budget.queued() == 0;
        if conn.backend.flow_control {
            if !conn.budget.try_reserve(cost) {
                return Err(PushError::Overflow);
            }
        } else {
            if self.tx.is_closed() {
                self.undelivered(&packet);
                return Err(PushError::Closed);
            }
            conn.budget.reserve(cost, flow::COMPAT_STALL).await?;
        }
        if was_empty {
            conn.mark_progress();
        }
        // The window bounds DATA: it costs nothing against the control reserve.
        let item = ToFrontend {
            packet,
            data: Some((conn.clone(), cost)),
        };
        self.tx.push(item, 0).map_err(|e| {
            conn.budget.release(cost);
            match e {
                queue::PushError::Full(_) => {
                    self.fail_unread();
                    PushError::Closed
                }
                queue::PushError::Closed(item) => {
                    self.undelivered(&item.packet);
                    PushError::Closed
                }
            }
        })
    }

    /// Resolves once the stream is over: ended from inside the server, or
    /// its transport dropped the receiving end.
    pub(crate) async fn gone(&self) {
        tokio::select! {
            () = self.tx.closed() => {}
            () = self.end.ended() => {}
        }
    }

    pub(crate) fn state(&self) -> MutexGuard<'_, FrontendState> {
        lock(&self.state)
    }
}

impl std::fmt::Debug for Frontend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Frontend")
            .field("uid", &self.uid)
            .finish_non_exhaustive()
    }
}

/// Closes the frontend's dials and connections and ends its stream when
/// its task ends, on error, cancel and panic alike. The cleanup never
/// waits, so it runs in place.
pub(crate) struct FrontendGuard {
    /// Shared proxy state.
    tunnels: Arc<Tunnels>,
    /// The frontend.
    frontend: Arc<Frontend>,
}

impl FrontendGuard {
    pub(crate) fn new(tunnels: Arc<Tunnels>, frontend: Arc<Frontend>) -> Self {
        Self { tunnels, frontend }
    }
}

impl Drop for FrontendGuard {
    fn drop(&mut self) {
        self.tunnels.frontend_closed(&self.frontend);
        self.frontend.end.end();
    }
}

#[cfg(test)]
mod tests {
    use tokio_util::sync::CancellationToken;

    use super::*;

    fn frontend(kind: FrontendKind) -> (Arc<Frontend>, Arc<ServerMetrics>, QueueRx<ToFrontend>) {
        let metrics = Arc::new(ServerMetrics::new(&[]));
        let (tx, rx) = queue();
        let end = StreamEnd::new(CancellationToken::new());
        (
            Arc::new(Frontend::new(1, tx, end, metrics.clone(), kind)),
            metrics,
            rx,
        )
    }

    #[tokio::test]
    async fn packets_for_a_gone_grpc_frontend_are_send_errors() {
        let (fe, metrics, rx) = frontend(FrontendKind::Grpc);
        drop(rx);
        fe.notify(Packet::dial_response(1, 0, "x"));
        fe.notify(Packet::close_response(2, ""));
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
        fe.notify(Packet::dial_response(1, 0, "x"));
        assert!(!metrics.text().contains("stream_errors_total{"));
    }

    #[tokio::test]
    async fn a_frontend_that_leaves_its_answers_unread_is_ended_with_an_error() {
        let (fe, metrics, _rx) = frontend(FrontendKind::Grpc);
        let answer = Packet::dial_response(1, 0, &"x".repeat(1000));
        let mut sent = 0;
        while !fe.end.is_ended() {
            fe.notify(answer.clone());
            sent += 1;
            assert!(sent <= CONTROL_RESERVE / 1000 + 1, "{sent} answers queued");
        }
        assert!(sent >= CONTROL_RESERVE / flow::packet_cost(&answer));
        assert!(
            metrics.text().contains(
                "konnectivity_rs_server_limit_reached_total{limit=\"frontend_queue\"} 1\n"
            )
        );
    }
}
