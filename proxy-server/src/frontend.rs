//! Frontends: one [`Frontend`] per `ProxyService/Proxy` stream (or, later,
//! per HTTP CONNECT request). Packets for it are queued on a bounded channel
//! whose receiver the transport drains.

pub(crate) mod authority;
pub(crate) mod grpc;
pub(crate) mod http_connect;

use std::{
    collections::{HashMap, VecDeque},
    sync::{Arc, Mutex, MutexGuard},
    time::Duration,
};

use proto::Packet;
use tokio::sync::mpsc;
use tunnel::{
    flow::{self, PushError},
    ids::{ConnId, DialId},
};

use crate::{
    backend::Backend,
    conn::{ServerConn, ToFrontend},
    lock,
    metrics::ServerMetrics,
    tunnels::Tunnels,
};

/// The frontend is gone; the packet was not delivered.
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error("frontend closed")]
pub(crate) struct FrontendGone;

/// One frontend stream.
pub(crate) struct Frontend {
    /// Unique per stream, for logs and ownership checks.
    pub(crate) uid: u64,
    /// Packets to the frontend; the transport drains the receiver and calls
    /// [`ToFrontend::taken`] for each.
    tx: mpsc::Sender<ToFrontend>,
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

/// Slots of a frontend's queue: a window of the smallest DATA packets of one
/// connection, plus room for control packets. Bytes are bounded per
/// connection by [`flow::WINDOW`].
pub(crate) fn queue_slots(control: usize) -> usize {
    flow::WINDOW / flow::PACKET_OVERHEAD + control
}

/// How long a control packet may wait for room in a full frontend queue.
const CONTROL_TIMEOUT: Duration = Duration::from_secs(5);

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
        tx: mpsc::Sender<ToFrontend>,
        metrics: Arc<ServerMetrics>,
        kind: FrontendKind,
    ) -> Self {
        Self {
            uid,
            tx,
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

    /// Queues a control packet for the frontend, waiting while its queue is full.
    pub(crate) async fn send(&self, packet: Packet) -> Result<(), FrontendGone> {
        tracing::trace!(
            frontend = self.uid,
            packet = packet.type_name(),
            "to frontend"
        );
        let started = std::time::Instant::now();
        let sent = self.tx.send(ToFrontend { packet, data: None }).await;
        self.metrics.frontend_write(started.elapsed());
        sent.map_err(|mpsc::error::SendError(item)| {
            self.undelivered(&item.packet);
            FrontendGone
        })
    }

    /// Queues a control packet without holding up the caller: at once if
    /// there is room, else from a task of its own (bounded wait).
    pub(crate) fn notify(self: &Arc<Self>, packet: Packet) {
        let started = std::time::Instant::now();
        match self.tx.try_send(ToFrontend { packet, data: None }) {
            Ok(()) => self.metrics.frontend_write(started.elapsed()),
            Err(mpsc::error::TrySendError::Closed(item)) => {
                self.metrics.frontend_write(started.elapsed());
                self.undelivered(&item.packet);
            }
            Err(mpsc::error::TrySendError::Full(item)) => {
                let frontend = self.clone();
                tokio::spawn(async move {
                    let sent = tokio::time::timeout(CONTROL_TIMEOUT, frontend.tx.send(item)).await;
                    frontend.metrics.frontend_write(started.elapsed());
                    if let Ok(Err(mpsc::error::SendError(item))) = sent {
                        frontend.undelivered(&item.packet);
                    }
                });
            }
        }
    }

    /// Queues agent DATA of `conn`, bounded by the connection's window: with
    /// flow control it never waits (the agent respects the window); without,
    /// it waits while the frontend drains and gives up after
    /// [`flow::COMPAT_STALL`] without progress.
    pub(crate) async fn push_data(
        &self,
        conn: &Arc<ServerConn>,
        packet: Packet,
        len: usize,
    ) -> Result<(), PushError> {
        let started = std::time::Instant::now();
        let pushed = self.push_data_inner(conn, packet, len).await;
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
        self.tx
            .try_send(ToFrontend {
                packet,
                data: Some((conn.clone(), cost)),
            })
            .map_err(|e| {
                conn.budget.release(cost);
                match e {
                    mpsc::error::TrySendError::Full(_) => PushError::Overflow,
                    mpsc::error::TrySendError::Closed(item) => {
                        self.undelivered(&item.packet);
                        PushError::Closed
                    }
                }
            })
    }

    /// Resolves once the transport dropped the receiving end (the stream
    /// is gone).
    pub(crate) async fn gone(&self) {
        self.tx.closed().await;
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

/// Closes the frontend's dials and connections when its reader ends; on
/// cancel or panic the cleanup runs in a task of its own.
pub(crate) struct FrontendGuard {
    /// Shared proxy state.
    tunnels: Arc<Tunnels>,
    /// The frontend; taken by [`FrontendGuard::close`].
    frontend: Option<Arc<Frontend>>,
}

impl FrontendGuard {
    pub(crate) fn new(tunnels: Arc<Tunnels>, frontend: Arc<Frontend>) -> Self {
        Self {
            tunnels,
            frontend: Some(frontend),
        }
    }

    /// Runs the cleanup now (in this task).
    pub(crate) async fn close(mut self) {
        if let Some(frontend) = self.frontend.take() {
            self.tunnels.frontend_closed(&frontend).await;
        }
    }
}

impl Drop for FrontendGuard {
    fn drop(&mut self) {
        if let Some(frontend) = self.frontend.take() {
            let tunnels = self.tunnels.clone();
            tokio::spawn(async move { tunnels.frontend_closed(&frontend).await });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frontend(kind: FrontendKind) -> (Arc<Frontend>, Arc<ServerMetrics>) {
        let metrics = Arc::new(ServerMetrics::new(&[]));
        let (tx, rx) = mpsc::channel(4);
        drop(rx);
        (
            Arc::new(Frontend::new(1, tx, metrics.clone(), kind)),
            metrics,
        )
    }

    #[tokio::test]
    async fn packets_for_a_gone_grpc_frontend_are_send_errors() {
        let (fe, metrics) = frontend(FrontendKind::Grpc);
        assert!(fe.send(Packet::dial_response(1, 0, "x")).await.is_err());
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
        let (fe, metrics) = frontend(FrontendKind::HttpConnect);
        assert!(fe.send(Packet::dial_response(1, 0, "x")).await.is_err());
        assert!(!metrics.text().contains("stream_errors_total{"));
    }
}
