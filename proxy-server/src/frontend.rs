//! Frontends: one [`Frontend`] per `ProxyService/Proxy` stream (or, later,
//! per HTTP CONNECT request). Packets for it are queued on a bounded channel
//! whose receiver the transport drains.

pub(crate) mod grpc;
pub(crate) mod http_connect;

use std::{
    collections::{HashMap, VecDeque},
    sync::{Arc, Mutex, MutexGuard},
};

use proto::Packet;
use tokio::sync::mpsc;
use tunnel::ids::{ConnId, DialId};

use crate::{backend::Backend, lock, tunnels::Tunnels};

/// The frontend is gone; the packet was not delivered.
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error("frontend closed")]
pub(crate) struct FrontendGone;

/// One frontend stream.
pub(crate) struct Frontend {
    /// Unique per stream, for logs and ownership checks.
    pub(crate) uid: u64,
    /// Packets to the frontend; the transport drains the receiver.
    tx: mpsc::Sender<Packet>,
    /// Dials and connections of this stream.
    state: Mutex<FrontendState>,
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
    /// Established connections and their backend.
    pub(crate) conns: HashMap<ConnId, Arc<Backend>>,
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
    pub(crate) fn close_conn(&mut self, id: ConnId) -> Option<Arc<Backend>> {
        let backend = self.conns.remove(&id)?;
        if self.recently_closed.len() == RECENTLY_CLOSED {
            self.recently_closed.pop_front();
        }
        self.recently_closed.push_back(id);
        Some(backend)
    }

    /// Whether `id` was one of this frontend's connections and is now closed.
    pub(crate) fn was_closed(&self, id: ConnId) -> bool {
        self.recently_closed.contains(&id)
    }
}

impl Frontend {
    pub(crate) fn new(uid: u64, tx: mpsc::Sender<Packet>) -> Self {
        Self {
            uid,
            tx,
            state: Mutex::new(FrontendState::default()),
        }
    }

    /// Queues a packet for the frontend, waiting while its queue is full.
    pub(crate) async fn send(&self, packet: Packet) -> Result<(), FrontendGone> {
        tracing::trace!(
            frontend = self.uid,
            packet = packet.type_name(),
            "to frontend"
        );
        self.tx.send(packet).await.map_err(|_| FrontendGone)
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
