//! [`Core`]: one connection's flow control as plain data, the clock given.
//!
//! Both directions of one connection, as one side sees them:
//! - **receive**: what the peer sent that waits for the local writer (the
//!   frontend's stream on the server, the destination socket on the agent).
//!   [`Core::offer`] admits a DATA packet's cost against the window and
//!   [`Core::drained`] counts what the writer took, returning the credit to
//!   send back when enough has drained.
//! - **send**: the credit this side may spend on DATA to the peer
//!   ([`Core::take`], [`Core::grant`]), in pieces of at most
//!   [`Core::send_chunk`].
//!
//! With credit negotiated ([`Scheme::Credit`]) a sender never exceeds the
//! window, so an offer past it is a broken peer: [`Offer::Overflow`]. Without
//! (an ANP peer, [`Scheme::Compat`]) an offer past the window waits while
//! the writer makes progress and overflows after [`COMPAT_STALL`] without
//! any ([`Offer::Wait`] says until when). No I/O, no waker, no clock: the
//! driver (`super::Flow`) locks it, passes `now` and does the waiting.

use std::time::{Duration, Instant};

use super::{COMPAT_STALL, MAX_CHUNK, PACKET_OVERHEAD, Scheme};

/// What became of a DATA packet offered to the receive window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Offer {
    /// Counted in the window: queue it.
    Admitted,
    /// No room yet (compat only): wait for a drain, at most until this
    /// instant, then offer again.
    Wait(Instant),
    /// The window is exceeded: with credit the peer broke the protocol;
    /// without, the writer took nothing for [`COMPAT_STALL`]. Close the
    /// connection with [`super::OVERFLOW`].
    Overflow,
    /// The connection is closed.
    Closed,
}

/// Whether credit could be taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Take {
    /// Taken (always, without credit).
    Taken,
    /// Not enough: wait for a grant.
    Wait,
    /// The connection is closed: send nothing more.
    Closed,
}

/// One connection's flow state; see the module documentation.
#[derive(Debug, Clone)]
pub struct Core {
    /// What the stream agreed.
    scheme: Scheme,
    /// Cost received and not yet drained by the writer.
    queued: usize,
    /// Drained and not yet returned as credit.
    to_grant: usize,
    /// While something is queued: when the writer last took something, or
    /// when the queue last went from empty to not (how long it has waited).
    progress: Option<Instant>,
    /// Credit available for DATA to the peer (credit only).
    credit: usize,
    /// Credit spent and not yet returned; `credit + spent` is the peer's
    /// window.
    spent: usize,
    /// Set once the connection is closed.
    closed: bool,
}

impl Core {
    /// A new connection's state: an empty receive window, a full send
    /// window.
    pub fn new(scheme: Scheme) -> Self {
        let credit = match scheme {
            Scheme::Credit { theirs, .. } => theirs.bytes,
            Scheme::Compat { .. } => 0,
        };
        Self {
            scheme,
            queued: 0,
            to_grant: 0,
            progress: None,
            credit,
            spent: 0,
            closed: false,
        }
    }

    /// What the stream agreed.
    pub fn scheme(&self) -> Scheme {
        self.scheme
    }

    /// Offers a received DATA packet of `cost` at `now`. Anything fits an
    /// empty queue, so no packet is too large to pass.
    pub fn offer(&mut self, cost: usize, now: Instant) -> Offer {
        if self.closed {
            return Offer::Closed;
        }
        let window = self.scheme.ours().bytes;
        if self.queued == 0 || self.queued.saturating_add(cost) <= window {
            if self.queued == 0 {
                self.progress = Some(now);
            }
            self.queued += cost;
            return Offer::Admitted;
        }
        match self.scheme {
            Scheme::Credit { .. } => Offer::Overflow,
            Scheme::Compat { .. } => {
                let since = self.progress.unwrap_or(now);
                let until = since + COMPAT_STALL;
                if now >= until {
                    Offer::Overflow
                } else {
                    Offer::Wait(until)
                }
            }
        }
    }

    /// The writer took `cost` at `now`; the credit to return to the peer,
    /// if it is time (credit only): once an eighth of the window drained,
    /// or the queue is empty.
    pub fn drained(&mut self, cost: usize, now: Instant) -> Option<usize> {
        self.queued = self.queued.saturating_sub(cost);
        self.progress = (self.queued > 0).then_some(now);
        let Scheme::Credit { ours, .. } = self.scheme else {
            return None;
        };
        if self.closed {
            return None;
        }
        self.to_grant += cost;
        let threshold = ours.bytes / 8;
        (self.to_grant >= threshold || (self.queued == 0 && self.to_grant > 0))
            .then(|| std::mem::take(&mut self.to_grant))
    }

    /// How long the writer has left queued data untaken, at `now`.
    pub fn stalled_for(&self, now: Instant) -> Duration {
        self.progress
            .map_or(Duration::ZERO, |since| now.saturating_duration_since(since))
    }

    /// Cost received and not yet drained.
    pub fn queued(&self) -> usize {
        self.queued
    }

    /// Takes credit for a DATA packet of `cost` to the peer. A packet never
    /// needs more than the whole window (a larger one waits for all of it).
    pub fn take(&mut self, cost: usize) -> Take {
        if self.closed {
            return Take::Closed;
        }
        let Scheme::Credit { theirs, .. } = self.scheme else {
            return Take::Taken;
        };
        let cost = cost.min(theirs.bytes);
        if self.credit < cost {
            return Take::Wait;
        }
        self.credit -= cost;
        self.spent += cost;
        Take::Taken
    }

    /// The peer returned `credit`; whether any became available. A peer
    /// cannot return more than was spent, so the window never grows.
    pub fn grant(&mut self, credit: usize) -> bool {
        let returned = credit.min(self.spent);
        self.spent -= returned;
        self.credit += returned;
        returned > 0
    }

    /// Credit available now.
    pub fn credit(&self) -> usize {
        self.credit
    }

    /// The largest DATA payload to send the peer: what it announced (and
    /// what fits its window), or [`MAX_CHUNK`] without credit.
    pub fn send_chunk(&self) -> usize {
        match self.scheme {
            Scheme::Credit { theirs, .. } => theirs
                .max_chunk
                .min(theirs.bytes.saturating_sub(PACKET_OVERHEAD))
                .max(1),
            Scheme::Compat { .. } => MAX_CHUNK,
        }
    }

    /// Closes the connection: offers and takes fail from now on.
    pub fn close(&mut self) {
        self.closed = true;
    }

    /// Whether the connection is closed.
    pub fn is_closed(&self) -> bool {
        self.closed
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flow::{Window, cost};

    const MS: Duration = Duration::from_millis(1);

    fn credit(ours: usize, theirs: usize) -> Core {
        Core::new(Scheme::Credit {
            ours: Window::new(ours, ours / 4).unwrap(),
            theirs: Window::new(theirs, theirs / 4).unwrap(),
        })
    }

    fn compat(window: usize) -> Core {
        Core::new(Scheme::Compat {
            ours: Window::new(window, window / 4).unwrap(),
        })
    }

    #[test]
    fn with_credit_the_window_admits_and_an_excess_is_an_overflow() {
        let t = Instant::now();
        let mut core = credit(64 * 1024, 1 << 20);
        assert_eq!(core.offer(40 * 1024, t), Offer::Admitted);
        assert_eq!(core.offer(24 * 1024, t), Offer::Admitted);
        assert_eq!(core.offer(1, t), Offer::Overflow);
        assert_eq!(core.queued(), 64 * 1024);
        // Draining makes room again.
        assert_eq!(core.drained(40 * 1024, t + MS), Some(40 * 1024));
        assert_eq!(core.offer(1, t + MS), Offer::Admitted);
    }

    #[test]
    fn a_packet_larger_than_the_window_passes_an_empty_queue_only() {
        let t = Instant::now();
        let mut core = credit(16 * 1024, 1 << 20);
        assert_eq!(core.offer(100 * 1024, t), Offer::Admitted);
        assert_eq!(core.offer(1, t), Offer::Overflow);
    }

    #[test]
    fn credit_is_returned_per_eighth_of_the_window_or_when_the_queue_empties() {
        let t = Instant::now();
        let window = 1 << 20;
        let mut core = credit(window, window);
        for _ in 0..4 {
            assert_eq!(core.offer(window / 4, t), Offer::Admitted);
        }
        assert_eq!(core.drained(window / 16, t), None);
        assert_eq!(core.drained(window / 16, t), Some(window / 8));
        assert_eq!(core.drained(window / 4, t), Some(window / 4));
        assert_eq!(core.drained(window / 2, t), Some(window / 2));
        assert_eq!(core.drained(window / 8 - 10, t), None);
        // The last drain returns what is left, however small.
        assert_eq!(core.drained(10, t), Some(window / 8));
        assert_eq!(core.queued(), 0);
    }

    #[test]
    fn without_credit_nothing_is_returned() {
        let t = Instant::now();
        let mut core = compat(1 << 20);
        assert_eq!(core.offer(1000, t), Offer::Admitted);
        assert_eq!(core.drained(1000, t), None);
        assert_eq!(core.take(usize::MAX), Take::Taken);
    }

    #[test]
    fn without_credit_a_full_window_waits_while_the_writer_progresses_then_overflows() {
        let t = Instant::now();
        let mut core = compat(64 * 1024);
        assert_eq!(core.offer(64 * 1024, t), Offer::Admitted);
        // Full: wait, at most COMPAT_STALL after the queue started waiting.
        assert_eq!(core.offer(10, t + MS), Offer::Wait(t + COMPAT_STALL));
        // Progress (a partial drain) moves the deadline.
        let later = t + COMPAT_STALL - MS;
        assert_eq!(core.drained(5, later), None);
        assert_eq!(core.offer(10, later), Offer::Wait(later + COMPAT_STALL));
        // Nothing more drains: past the deadline it overflows.
        assert_eq!(core.offer(10, later + COMPAT_STALL), Offer::Overflow);
    }

    #[test]
    fn the_stall_clock_runs_only_while_something_waits() {
        let t = Instant::now();
        let mut core = credit(1 << 20, 1 << 20);
        assert_eq!(core.stalled_for(t + 3600 * 1000 * MS), Duration::ZERO);
        assert_eq!(core.offer(1000, t + 10 * MS), Offer::Admitted);
        assert_eq!(core.stalled_for(t + 30 * MS), 20 * MS);
        // A partial drain is progress: the wait starts again.
        let _ = core.drained(500, t + 40 * MS);
        assert_eq!(core.stalled_for(t + 45 * MS), 5 * MS);
        // Queue empty: not stalled however long it idles.
        let _ = core.drained(500, t + 50 * MS);
        assert_eq!(core.stalled_for(t + 3600 * 1000 * MS), Duration::ZERO);
    }

    #[test]
    fn credit_is_spent_and_returned_but_never_above_the_peers_window() {
        let mut core = credit(1 << 20, 64 * 1024);
        assert_eq!(core.take(60 * 1024), Take::Taken);
        assert_eq!(core.take(8 * 1024), Take::Wait);
        // A peer returning more than was spent does not grow the window.
        assert!(core.grant(1 << 30));
        assert_eq!(core.credit(), 64 * 1024);
        assert!(!core.grant(1));
        // A packet larger than the window waits for all of it, no more.
        assert_eq!(core.take(1 << 20), Take::Taken);
        assert_eq!(core.credit(), 0);
    }

    #[test]
    fn the_send_chunk_is_the_peers_and_fits_its_window() {
        let core = Core::new(Scheme::Credit {
            ours: Window::V1,
            theirs: Window::new(64 * 1024, 64 * 1024).unwrap(),
        });
        assert_eq!(core.send_chunk(), 64 * 1024 - PACKET_OVERHEAD);
        let core = Core::new(Scheme::Credit {
            ours: Window::V1,
            theirs: Window::new(1 << 20, 16 * 1024).unwrap(),
        });
        assert_eq!(core.send_chunk(), 16 * 1024);
        assert_eq!(compat(1 << 20).send_chunk(), MAX_CHUNK);
        // A full chunk costs no more than the window.
        assert!(cost(credit(1 << 20, 64 * 1024).send_chunk()) <= 64 * 1024);
    }

    #[test]
    fn a_closed_connection_admits_and_sends_nothing() {
        let t = Instant::now();
        let mut core = credit(1 << 20, 1 << 20);
        assert_eq!(core.offer(10, t), Offer::Admitted);
        core.close();
        assert_eq!(core.offer(10, t), Offer::Closed);
        assert_eq!(core.take(10), Take::Closed);
        assert_eq!(core.drained(10, t), None, "no credit for a closed one");
        assert!(core.is_closed());
    }
}
