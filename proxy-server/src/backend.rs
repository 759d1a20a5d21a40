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
use tonic::Status;
use tracing::warn;
use tunnel::{
    flow,
    ids::{AgentId, ConnId},
    queue::{Closed, PushError, QueueTx},
};

use crate::{
    conn::BackendConn,
    lock,
    metrics::{Limit, ServerMetrics},
    stream_end::StreamEnd,
};
use strategy::AgentIdentifiers;

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
    /// Outbound packets, bounded in bytes; tonic drains the receiver into
    /// the stream.
    tx: QueueTx<Packet>,
    /// Set by DRAIN (or when retired): prefer other backends for new dials.
    draining: AtomicBool,
    /// Established connections on this stream and the frontend of each.
    conns: Mutex<HashMap<ConnId, BackendConn>>,
    /// Whether per-connection flow control was negotiated (`tunnel::flow`).
    pub(crate) flow_control: bool,
    /// Ends the stream (agent gone, retired, shutdown, a fault).
    pub(crate) end: Arc<StreamEnd>,
    /// Where packets that cannot be sent are counted.
    metrics: Arc<ServerMetrics>,
}

/// The stream side of a new [`Backend`].
pub(crate) struct BackendStream {
    /// Outbound packets; tonic drains the receiver into the stream.
    pub(crate) tx: QueueTx<Packet>,
    /// Ends the stream.
    pub(crate) end: Arc<StreamEnd>,
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
            end,
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
            Err(PushError::Closed(packet)) => self.metrics.send_error("to_agent", &packet),
            Err(PushError::Full(packet)) => {
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

    /// The connections whose frontend has left queued DATA untaken for
    /// `limit`, with their frontends.
    pub(crate) fn stalled(
        &self,
        limit: std::time::Duration,
    ) -> Vec<(ConnId, Arc<crate::frontend::Frontend>)> {
        lock(&self.conns)
            .iter()
            .filter(|(_, c)| c.conn.stalled_for() >= limit)
            .map(|(id, c)| (*id, c.frontend.clone()))
            .collect()
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
    use tokio_util::sync::CancellationToken;

    use super::*;

    fn backend(
        metrics: &Arc<ServerMetrics>,
        limit: usize,
    ) -> (Backend, tunnel::queue::QueueRx<Packet>) {
        let (tx, rx) = tunnel::queue::queue(limit, limit);
        let backend = Backend::new(
            1,
            AgentId("a".to_owned()),
            AgentIdentifiers::default(),
            None,
            BackendStream {
                tx,
                end: StreamEnd::new(CancellationToken::new()),
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
        let (backend, rx) = backend(&metrics, 1024);
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
        let metrics = Arc::new(ServerMetrics::new(&[]));
        let (backend, _rx) = backend(&metrics, 64);
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
}
