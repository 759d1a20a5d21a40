//! [`ServerConn`]: one established connection as the server sees it, with
//! its flow-control state in both directions.

use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use proto::Packet;
use tokio_util::sync::CancellationToken;
use tunnel::{
    flow::{self, Budget, Granter, SendCredit},
    ids::ConnId,
};

use crate::{backend::Backend, frontend::Frontend, lock};

/// An established connection: a frontend's, over a backend.
pub(crate) struct ServerConn {
    /// The agent-assigned id.
    pub(crate) id: ConnId,
    /// The agent stream it runs over.
    pub(crate) backend: Arc<Backend>,
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
    /// Cancelled once the connection is removed from its backend: every
    /// wait on its behalf (credit, room in the agent queue) ends with it.
    pub(crate) closed: CancellationToken,
}

impl ServerConn {
    pub(crate) fn new(id: ConnId, backend: Arc<Backend>) -> Self {
        let send_credit = backend.flow_control.then(SendCredit::new);
        Self {
            id,
            backend,
            budget: Budget::default(),
            granter: Mutex::new(Granter::default()),
            send_credit,
            established: Instant::now(),
            progress: AtomicU64::new(0),
            closed: CancellationToken::new(),
        }
    }

    /// Ends every wait on this connection's behalf; called when it leaves
    /// its backend's table.
    pub(crate) fn close(&self) {
        self.closed.cancel();
        if let Some(credit) = &self.send_credit {
            credit.close();
        }
    }

    /// Records that the frontend took `cost` of this connection's DATA and
    /// returns credit to the agent when enough has drained.
    pub(crate) fn drained(&self, cost: usize) {
        self.budget.release(cost);
        self.mark_progress();
        if !self.backend.flow_control {
            return;
        }
        let empty = self.budget.queued() == 0;
        let credit = lock(&self.granter).drained(cost, empty);
        if let Some(credit) = credit {
            self.backend
                .send_control(flow::credit_packet(self.id.0, credit));
        }
    }

    /// Records progress now: the frontend took DATA, or DATA was queued
    /// while none was (its wait starts now).
    pub(crate) fn mark_progress(&self) {
        let now = u64::try_from(self.established.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.progress.store(now, Ordering::Relaxed);
    }

    /// How long the frontend has left queued DATA unread (zero when none is
    /// queued).
    pub(crate) fn stalled_for(&self) -> Duration {
        if self.budget.queued() == 0 {
            return Duration::ZERO;
        }
        let since = Duration::from_millis(self.progress.load(Ordering::Relaxed));
        self.established.elapsed().saturating_sub(since)
    }

    /// Cost units queued towards the frontend now.
    pub(crate) fn queued(&self) -> usize {
        self.budget.queued()
    }
}

/// What a backend knows of one of its connections.
#[derive(Clone)]
pub(crate) struct BackendConn {
    /// The connection.
    pub(crate) conn: Arc<ServerConn>,
    /// Whose it is.
    pub(crate) frontend: Arc<Frontend>,
}

/// An item of a frontend's outbound queue: a packet, and for DATA the
/// connection and cost to release once the frontend took it.
pub(crate) struct ToFrontend {
    /// The packet.
    pub(crate) packet: Packet,
    /// For DATA: whose bytes, and what they cost.
    pub(crate) data: Option<(Arc<ServerConn>, usize)>,
}

impl ToFrontend {
    /// Releases the DATA accounting (after the frontend took the packet).
    pub(crate) fn taken(&self) {
        if let Some((conn, cost)) = &self.data {
            conn.drained(*cost);
        }
    }
}
