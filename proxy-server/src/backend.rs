//! Backends: one [`Backend`] per agent `Connect` stream, kept by the
//! [`manager::BackendManager`] and chosen per dial by a [`strategy::ProxyStrategy`].

pub mod manager;
pub(crate) mod service;
pub mod strategy;

use std::{
    collections::HashMap,
    net::SocketAddr,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
};

use proto::Packet;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tunnel::ids::{AgentId, ConnId};

use crate::{conn::BackendConn, lock, metrics::ServerMetrics};
use strategy::AgentIdentifiers;

/// How long a reply from a reader may wait for room in a full agent queue.
const REPLY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// The agent stream is gone; the packet was not sent.
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error("agent stream closed")]
pub(crate) struct BackendGone;

/// One agent `Connect` stream, as seen by the rest of the server.
///
/// Owned (via `Arc`) by the [`manager::BackendManager`], by pending dials and
/// by the frontends whose connections run over it. Its reader task removes
/// it everywhere when the stream ends.
pub(crate) struct Backend {
    /// Unique per stream: two streams of one agent id are different backends.
    pub(crate) uid: u64,
    /// The agent's self-asserted id.
    pub(crate) agent_id: AgentId,
    /// What the agent announced about itself.
    pub(crate) identifiers: AgentIdentifiers,
    /// The agent's address, if known.
    pub(crate) peer: Option<SocketAddr>,
    /// Outbound packets; tonic drains the receiver into the stream.
    tx: mpsc::Sender<Packet>,
    /// Set by DRAIN (or when retired): prefer other backends for new dials.
    draining: AtomicBool,
    /// Established connections on this stream and the frontend of each.
    conns: Mutex<HashMap<ConnId, BackendConn>>,
    /// Whether per-connection flow control was negotiated (`tunnel::flow`).
    pub(crate) flow_control: bool,
    /// Cancelled when the stream must end (agent gone, retired, shutdown).
    pub(crate) cancel: CancellationToken,
    /// Where packets that cannot be sent are counted.
    metrics: Arc<ServerMetrics>,
}

/// The stream side of a new [`Backend`].
pub(crate) struct BackendStream {
    /// Outbound packets; tonic drains the receiver into the stream.
    pub(crate) tx: mpsc::Sender<Packet>,
    /// Cancelled when the stream must end.
    pub(crate) cancel: CancellationToken,
    /// Whether per-connection flow control was negotiated.
    pub(crate) flow_control: bool,
    /// Where packets that cannot be sent are counted.
    pub(crate) metrics: Arc<ServerMetrics>,
}

impl Backend {
    pub(crate) fn new(
        uid: u64,
        agent_id: AgentId,
        identifiers: AgentIdentifiers,
        peer: Option<SocketAddr>,
        stream: BackendStream,
    ) -> Self {
        let BackendStream {
            tx,
            cancel,
            flow_control,
            metrics,
        } = stream;
        Self {
            uid,
            agent_id,
            identifiers,
            peer,
            tx,
            draining: AtomicBool::new(false),
            conns: Mutex::new(HashMap::new()),
            flow_control,
            cancel,
            metrics,
        }
    }

    /// Queues a packet for the agent, waiting while the queue is full.
    pub(crate) async fn send(&self, packet: Packet) -> Result<(), BackendGone> {
        tracing::trace!(agent.id = %self.agent_id, packet = packet.type_name(), "to agent");
        self.tx
            .send(packet)
            .await
            .map_err(|mpsc::error::SendError(packet)| {
                self.metrics.send_error("to_agent", &packet);
                BackendGone
            })
    }

    /// Queues a packet without waiting: used by readers, which must keep
    /// reading (two full queues waiting on each other would deadlock); when
    /// the queue is full a task delivers it within a bound.
    pub(crate) fn send_nowait(&self, packet: Packet) {
        match self.tx.try_send(packet) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Closed(packet)) => {
                self.metrics.send_error("to_agent", &packet);
            }
            Err(mpsc::error::TrySendError::Full(packet)) => {
                let tx = self.tx.clone();
                let metrics = self.metrics.clone();
                tokio::spawn(async move {
                    let sent = tokio::time::timeout(REPLY_TIMEOUT, tx.send(packet)).await;
                    if let Ok(Err(mpsc::error::SendError(packet))) = sent {
                        metrics.send_error("to_agent", &packet);
                    }
                });
            }
        }
    }

    pub(crate) fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    pub(crate) fn set_draining(&self) {
        self.draining.store(true, Ordering::Relaxed);
    }

    pub(crate) fn conn(&self, id: ConnId) -> Option<BackendConn> {
        lock(&self.conns).get(&id).cloned()
    }

    pub(crate) fn insert_conn(&self, id: ConnId, conn: BackendConn) {
        lock(&self.conns).insert(id, conn);
    }

    /// Removes a connection; it is closed (see [`crate::conn::ServerConn::close`]).
    pub(crate) fn remove_conn(&self, id: ConnId) -> Option<BackendConn> {
        let removed = lock(&self.conns).remove(&id);
        if let Some(conn) = &removed {
            conn.conn.close();
        }
        removed
    }

    /// Removes every connection; each is closed.
    pub(crate) fn take_conns(&self) -> HashMap<ConnId, BackendConn> {
        let conns = std::mem::take(&mut *lock(&self.conns));
        for conn in conns.values() {
            conn.conn.close();
        }
        conns
    }

    /// The most and the total cost its connections have queued towards
    /// their frontends.
    pub(crate) fn queued(&self) -> (usize, usize) {
        lock(&self.conns)
            .values()
            .map(|c| c.conn.queued())
            .fold((0, 0), |(max, total), q| (max.max(q), total + q))
    }

    pub(crate) fn conn_count(&self) -> usize {
        lock(&self.conns).len()
    }
}

impl std::fmt::Debug for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Backend")
            .field("uid", &self.uid)
            .field("agent_id", &self.agent_id)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn backend(metrics: &Arc<ServerMetrics>) -> (Backend, mpsc::Receiver<Packet>) {
        let (tx, rx) = mpsc::channel(1);
        let backend = Backend::new(
            1,
            AgentId("a".to_owned()),
            AgentIdentifiers::default(),
            None,
            BackendStream {
                tx,
                cancel: CancellationToken::new(),
                flow_control: false,
                metrics: metrics.clone(),
            },
        );
        (backend, rx)
    }

    const CLOSE_REQ_LOST: &str = "konnectivity_network_proxy_server_stream_errors_total{code=\"Unavailable\",packet_type=\"CLOSE_REQ\",segment=\"to_agent\"}";

    #[tokio::test]
    async fn a_packet_for_a_gone_agent_is_counted_as_a_send_error() {
        let metrics = Arc::new(ServerMetrics::new(&[]));
        let (backend, rx) = backend(&metrics);
        backend.send(Packet::close_request(1)).await.unwrap();
        assert!(!metrics.text().contains("stream_errors_total{"));
        drop(rx);
        assert!(backend.send(Packet::close_request(1)).await.is_err());
        backend.send_nowait(Packet::close_request(2));
        let text = metrics.text();
        assert!(text.contains(&format!("\n{CLOSE_REQ_LOST} 2\n")), "{text}");
    }
}
