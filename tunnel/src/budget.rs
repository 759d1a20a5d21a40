//! [`Budget`]: bytes a whole process may hold for peers that are not
//! taking them, shared by every stream; [`Account`]: what one holder took
//! from it.
//!
//! Per-connection windows and per-stream caps bound each connection and
//! each stream, not their sum: ten thousand streams each within its cap
//! are ten thousand caps. A budget bounds the sum. It is the byte
//! accounting of [`queue`](crate::queue)'s room without the queue: holders
//! take bytes only for what actually waits (data that goes straight on
//! costs nothing, so the fast path never touches it), give them back as it
//! leaves, and a holder that finds it full waits, in order of arrival,
//! each release waking only the waiters it admits (one wake each, as
//! tokio's `Semaphore::acquire_many`), never all of them. Bytes are
//! admitted while less than the limit is held, so the limit is exceeded by
//! one take at most.
//!
//! An [`Account`] is one holder's side (a stream's read-ahead, one queued
//! item): it keeps what it took and gives it all back when dropped, so a
//! holder that ends in any way (error, cancel, panic) leaves nothing taken.

use std::{
    future::Future,
    sync::{
        Arc as StdArc,
        atomic::{AtomicBool, Ordering},
    },
};

use crate::queue::Room;

/// A process-wide byte budget; see the module documentation.
pub struct Budget {
    /// The accounting: `limit` bytes, no reserve.
    room: Room,
    /// The limit.
    limit: usize,
    /// Whether a holder has waited yet ([`Budget::first_wait`]).
    waited: AtomicBool,
}

impl std::fmt::Debug for Budget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Budget")
            .field("limit", &self.limit)
            .field("held", &self.held())
            .field("waiting", &self.waiting())
            .finish()
    }
}

impl Budget {
    /// A budget of `limit` bytes.
    pub fn new(limit: usize) -> Self {
        Self {
            room: Room::new(limit, 0),
            limit,
            waited: AtomicBool::new(false),
        }
    }

    /// `true` the first time it is called: for logging the first wait for
    /// room once (waits are counted elsewhere).
    pub fn first_wait(&self) -> bool {
        !self.waited.swap(true, Ordering::Relaxed)
    }

    /// Its limit.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Bytes taken and not given back.
    pub fn held(&self) -> usize {
        self.room.queued()
    }

    /// Holders waiting for room now.
    pub fn waiting(&self) -> usize {
        self.room.waiting()
    }

    /// Whether it is full: the limit is held, or a holder waits for room.
    /// Two atomic loads, no lock.
    pub fn is_full(&self) -> bool {
        self.waiting() > 0 || self.held() >= self.limit
    }

    /// Takes `cost` now if nobody waits for room and less than the limit
    /// is held; `false` (nothing taken) otherwise.
    pub fn try_take(&self, cost: usize) -> bool {
        self.room.try_admit(cost)
    }

    /// Waits until `cost` is taken, behind the holders already waiting.
    ///
    /// # Cancel safety
    /// Cancel safe: a dropped wait holds nothing (room granted to it
    /// passes to the next waiter).
    pub fn take(&self, cost: usize) -> impl Future<Output = ()> + Send + '_ {
        let acquire = self.room.acquire(cost);
        async move {
            // A budget is never closed: the wait ends only with room.
            let _ = acquire.await;
        }
    }

    /// Gives `cost` back, and admits waiting holders while there is room.
    pub fn release(&self, cost: usize) {
        if cost > 0 {
            self.room.release(cost);
        }
    }
}

/// What one holder has taken from a [`Budget`]; given back when dropped.
pub struct Account {
    /// The budget.
    budget: StdArc<Budget>,
    /// Bytes taken.
    taken: usize,
}

impl std::fmt::Debug for Account {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Account")
            .field("taken", &self.taken)
            .finish()
    }
}

impl Account {
    /// An account that has taken nothing yet.
    pub fn new(budget: StdArc<Budget>) -> Self {
        Self { budget, taken: 0 }
    }

    /// An account of `cost` if it can be taken now (see
    /// [`Budget::try_take`]).
    pub fn try_new(budget: &StdArc<Budget>, cost: usize) -> Option<Self> {
        budget.try_take(cost).then(|| Self {
            budget: budget.clone(),
            taken: cost,
        })
    }

    /// The budget.
    pub fn budget(&self) -> &StdArc<Budget> {
        &self.budget
    }

    /// Bytes taken.
    pub fn taken(&self) -> usize {
        self.taken
    }

    /// Brings what is taken to `want`: gives an excess back at once, takes
    /// a shortfall if it can without waiting. Returns the shortfall still
    /// owed (0 when settled): wait for it with [`Budget::take`], then
    /// [`Account::taken_more`].
    pub fn settle(&mut self, want: usize) -> usize {
        if want < self.taken {
            self.budget.release(self.taken - want);
            self.taken = want;
        } else if want > self.taken && self.budget.try_take(want - self.taken) {
            self.taken = want;
        }
        want - self.taken
    }

    /// A wait for `cost` ([`Budget::take`]) ended: it is taken.
    pub fn taken_more(&mut self, cost: usize) {
        self.taken += cost;
    }
}

impl Drop for Account {
    fn drop(&mut self) {
        self.budget.release(self.taken);
    }
}

#[cfg(test)]
mod tests {
    use std::{
        pin::pin,
        task::{Context, Poll, Waker},
    };

    use super::*;

    #[test]
    fn takes_are_admitted_while_less_than_the_limit_is_held() {
        let budget = Budget::new(100);
        assert!(budget.try_take(60));
        assert!(budget.try_take(60), "60 < 100: admitted, now 120");
        assert!(!budget.try_take(1));
        assert!(budget.is_full());
        budget.release(60);
        assert!(budget.try_take(1));
        assert_eq!(budget.held(), 61);
    }

    #[test]
    fn waiters_get_room_in_order_of_arrival() {
        let budget = Budget::new(10);
        assert!(budget.try_take(10));
        let mut cx = Context::from_waker(Waker::noop());
        let mut first = pin!(budget.take(10));
        let mut second = pin!(budget.take(1));
        assert!(first.as_mut().poll(&mut cx).is_pending());
        assert!(second.as_mut().poll(&mut cx).is_pending());
        assert!(!budget.try_take(1), "holders wait: no newcomer goes first");
        budget.release(10);
        assert_eq!(first.as_mut().poll(&mut cx), Poll::Ready(()));
        assert!(second.as_mut().poll(&mut cx).is_pending(), "10 held again");
        budget.release(10);
        assert_eq!(second.as_mut().poll(&mut cx), Poll::Ready(()));
        assert_eq!(budget.held(), 1);
        assert_eq!(budget.waiting(), 0);
    }

    #[test]
    fn an_account_settles_to_what_it_holds_and_gives_it_all_back_when_dropped() {
        let budget = StdArc::new(Budget::new(100));
        let mut account = Account::new(budget.clone());
        assert_eq!(account.settle(70), 0);
        assert_eq!(budget.held(), 70);
        assert_eq!(account.settle(20), 0, "an excess goes back at once");
        assert_eq!(budget.held(), 20);
        let mut other = Account::try_new(&budget, 90).expect("20 < 100");
        assert_eq!(budget.held(), 110);
        assert_eq!(account.settle(50), 30, "owed: the budget is full");
        assert_eq!(account.taken(), 20);
        other.settle(0);
        let mut cx = Context::from_waker(Waker::noop());
        assert_eq!(pin!(budget.take(30)).poll(&mut cx), Poll::Ready(()));
        account.taken_more(30);
        assert_eq!(account.settle(50), 0);
        drop(other);
        drop(account);
        assert_eq!(budget.held(), 0);
    }
}
