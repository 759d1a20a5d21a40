//! Backends: one [`Backend`] per agent `Connect` stream, kept by the
//! [`manager::BackendManager`] and chosen per dial by a [`strategy::ProxyStrategy`].

pub mod manager;
pub(crate) mod service;
pub mod strategy;

use std::{
    collections::HashMap,
    net::SocketAddr,
    sync::{
        Mutex,
        atomic::{AtomicBool, Ordering},
    },
};

use proto::Packet;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tunnel::ids::{AgentId, ConnId};

use crate::{conn::BackendConn, lock};
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
}

impl Backend {
    pub(crate) fn new(
        uid: u64,
        agent_id: AgentId,
        identifiers: AgentIdentifiers,
        peer: Option<SocketAddr>,
        tx: mpsc::Sender<Packet>,
        cancel: CancellationToken,
        flow_control: bool,
    ) -> Self {
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
        }
    }

    /// Queues a packet for the agent, waiting while the queue is full.
    pub(crate) async fn send(&self, packet: Packet) -> Result<(), BackendGone> {
        tracing::trace!(agent.id = %self.agent_id, packet = packet.type_name(), "to agent");
        self.tx.send(packet).await.map_err(|_| BackendGone)
    }

    /// Queues a packet without waiting: used by readers, which must keep
    /// reading (two full queues waiting on each other would deadlock); when
    /// the queue is full a task delivers it within a bound.
    pub(crate) fn send_nowait(&self, packet: Packet) {
        if let Err(mpsc::error::TrySendError::Full(packet)) = self.tx.try_send(packet) {
            let tx = self.tx.clone();
            tokio::spawn(async move {
                let _ = tokio::time::timeout(REPLY_TIMEOUT, tx.send(packet)).await;
            });
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

    pub(crate) fn remove_conn(&self, id: ConnId) -> Option<BackendConn> {
        lock(&self.conns).remove(&id)
    }

    pub(crate) fn take_conns(&self) -> HashMap<ConnId, BackendConn> {
        std::mem::take(&mut *lock(&self.conns))
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
