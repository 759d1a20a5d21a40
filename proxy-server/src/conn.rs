//! [`ServerConn`]: the flow state of one established connection, shared by
//! the routing core (which owns the connection by id) and the transports
//! that move its bytes (which wait on it).

use std::{
    sync::{
        Mutex,
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

use crate::{ids::BackendId, lock};

/// An established connection's flow state in both directions.
pub(crate) struct ServerConn {
    /// The agent-assigned id.
    pub(crate) id: ConnId,
    /// The agent stream it runs over.
    pub(crate) backend: BackendId,
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

impl ServerConn {
    pub(crate) fn new(id: ConnId, backend: BackendId, flow_control: bool, now: Instant) -> Self {
        Self {
            id,
            backend,
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

    /// Records that the frontend took `cost` of this connection's DATA; the
    /// credit grant to send the agent when enough has drained.
    pub(crate) fn drained(&self, cost: usize) -> Option<Packet> {
        self.budget.release(cost);
        self.mark_progress();
        if !self.flow_control {
            return None;
        }
        let empty = self.budget.queued() == 0;
        let credit = lock(&self.granter).drained(cost, empty)?;
        Some(flow::credit_packet(self.id.0, credit))
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

impl std::fmt::Debug for ServerConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerConn")
            .field("id", &self.id)
            .field("backend", &self.backend)
            .finish_non_exhaustive()
    }
}
