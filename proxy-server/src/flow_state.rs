//! [`ConnFlow`]: the flow state of one established connection, kept by
//! the router's driver (`hub`) from the router's [`Opened`] to its
//! [`Closed`], and shared with the transports that move its bytes (which
//! wait on it).
//!
//! [`Opened`]: crate::router::Out::Opened
//! [`Closed`]: crate::router::Out::Closed

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
pub(crate) struct ConnFlow {
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

impl ConnFlow {
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
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn a_connection_is_stalled_from_when_its_data_waited_untaken() {
        let start = Instant::now();
        let conn = ConnFlow::new(ConnId(3), BackendId(1), true, start);
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

    #[test]
    fn buffered_bytes_are_summed_over_connections() {
        let now = Instant::now();
        let one = ConnFlow::new(ConnId(3), BackendId(1), true, now);
        let two = ConnFlow::new(ConnId(4), BackendId(1), true, now);
        assert!(one.budget.try_reserve(100));
        assert!(two.budget.try_reserve(300));
        assert_eq!(buffered([&one, &two].into_iter()), (300, 400));
        assert_eq!(buffered(std::iter::empty()), (0, 0));
    }
}
