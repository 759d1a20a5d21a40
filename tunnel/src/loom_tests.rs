//! Model checks, under `loom`, of the waits where a lost wake-up would hang
//! a connection: every interleaving of two or three threads over the real
//! [`Room`] (the byte queue's admit, release, wait list, close and dropped
//! waiters; the budget's take without waiting), the real [`Flow`] (a
//! sender's wait for credit, the close), and the [`Signal`] and [`Latch`]
//! under them. With the `loom` feature, the
//! primitives of `crate::sync` are loom's; loom reports a wake-up that never
//! comes as a deadlock.
//!
//! `cargo test -p tunnel --features loom --lib loom_tests` (scripts/test
//! runs it; `LOOM_MAX_PREEMPTIONS` bounds the search, 3 by default here).

use std::{
    future::Future,
    task::{Context, Poll, Waker},
};

use loom::{future::block_on, thread};

use crate::{
    budget::Budget,
    flow::{Flow, Scheme, Window},
    queue::Room,
    sync::{Arc, Latch, Signal},
};

/// Runs `model` over every interleaving, with preemptions bounded (as
/// tokio's own loom tests do) so that a run takes seconds.
fn check(model: impl Fn() + Sync + Send + 'static) {
    let mut builder = loom::model::Builder::new();
    if builder.preemption_bound.is_none() {
        builder.preemption_bound = Some(3);
    }
    builder.check(model);
}

/// A queue at its limit of one byte, drained by the main thread while two
/// senders wait: both get room, each is woken, nothing stays counted.
#[test]
fn two_waiting_senders_both_get_room_as_the_queue_drains() {
    check(|| {
        let room = Arc::new(Room::new(1, 0));
        assert!(room.push(1));
        let senders: Vec<_> = (0..2)
            .map(|_| {
                let room = room.clone();
                thread::spawn(move || {
                    block_on(room.acquire(1)).expect("the receiver is there");
                    room.release(1);
                })
            })
            .collect();
        room.release(1);
        for sender in senders {
            sender.join().expect("a sender");
        }
        assert_eq!(room.queued(), 0);
        assert_eq!(room.waiting(), 0);
    });
}

/// The receiver goes while a sender waits: the sender is woken with an
/// error, whichever comes first.
#[test]
fn a_closing_receiver_wakes_a_waiting_sender() {
    check(|| {
        let room = Arc::new(Room::new(1, 0));
        assert!(room.push(1));
        let sender = {
            let room = room.clone();
            thread::spawn(move || block_on(room.acquire(1)))
        };
        room.close();
        assert_eq!(sender.join().expect("the sender"), Err(()));
        assert_eq!(room.waiting(), 0);
    });
}

/// A sender that gives up after one poll (its task was cancelled) while
/// another waits and the queue drains: the room it may have been granted
/// goes to the other, which is woken.
#[test]
fn a_sender_that_gives_up_passes_its_room_on() {
    check(|| {
        let room = Arc::new(Room::new(1, 0));
        assert!(room.push(1));
        let quitter = {
            let room = room.clone();
            thread::spawn(move || {
                let mut acquire = Box::pin(room.acquire(1));
                let mut cx = Context::from_waker(Waker::noop());
                if let Poll::Ready(Ok(())) = acquire.as_mut().poll(&mut cx) {
                    // It got in before anyone waited: its room is its own.
                    room.release(1);
                }
            })
        };
        let waiter = {
            let room = room.clone();
            thread::spawn(move || {
                block_on(room.acquire(1)).expect("the receiver is there");
                room.release(1);
            })
        };
        room.release(1);
        quitter.join().expect("the quitter");
        waiter.join().expect("the waiter");
        assert_eq!(room.queued(), 0);
        assert_eq!(room.waiting(), 0);
    });
}

/// A budget at its limit: one holder waits for room while another takes
/// without waiting and gives back, and the first holder's bytes are
/// released: the waiter gets room whichever goes first, nothing stays
/// taken.
#[test]
fn a_take_without_waiting_never_strands_a_waiting_holder() {
    check(|| {
        let budget = Arc::new(Budget::new(1));
        assert!(budget.try_take(1));
        let waiter = {
            let budget = budget.clone();
            thread::spawn(move || {
                block_on(budget.take(1));
                budget.release(1);
            })
        };
        let taker = {
            let budget = budget.clone();
            thread::spawn(move || {
                if budget.try_take(1) {
                    budget.release(1);
                }
            })
        };
        budget.release(1);
        waiter.join().expect("the waiter");
        taker.join().expect("the taker");
        assert_eq!(budget.held(), 0);
        assert_eq!(budget.waiting(), 0);
    });
}

/// The smallest credit window there is, all of it taken.
fn flow_without_credit() -> Arc<Flow> {
    let theirs = Window::new(crate::flow::MIN_WINDOW, crate::flow::MIN_CHUNK).expect("in range");
    let flow = Arc::new(Flow::new(Scheme::Credit {
        ours: Window::V1,
        theirs,
    }));
    block_on(flow.take(theirs.bytes)).expect("the whole window");
    flow
}

/// A sender waiting for credit is woken by the grant, whenever it lands.
#[test]
fn a_grant_wakes_the_sender_waiting_for_credit() {
    check(|| {
        let flow = flow_without_credit();
        let sender = {
            let flow = flow.clone();
            thread::spawn(move || block_on(flow.take(1000)))
        };
        flow.grant(1000);
        assert_eq!(sender.join().expect("the sender"), Ok(()));
        assert_eq!(flow.credit(), 0);
    });
}

/// Closing the connection wakes both its waits: the sender's for credit
/// and another task's for the close.
#[test]
fn a_close_ends_every_wait_of_the_connection() {
    check(|| {
        let flow = flow_without_credit();
        let sender = {
            let flow = flow.clone();
            thread::spawn(move || block_on(flow.take(1)))
        };
        let watcher = {
            let flow = flow.clone();
            thread::spawn(move || block_on(flow.closed()))
        };
        flow.close();
        assert!(sender.join().expect("the sender").is_err());
        watcher.join().expect("the watcher");
        assert!(flow.is_closed());
    });
}

/// A signal given before, during or after the wait wakes it.
#[test]
fn a_signal_is_never_lost() {
    check(|| {
        let signal = Arc::new(Signal::new());
        let waiter = {
            let signal = signal.clone();
            thread::spawn(move || block_on(signal.wait()))
        };
        signal.notify();
        waiter.join().expect("the waiter");
    });
}

/// An event set while two tasks register for it wakes both.
#[test]
fn a_latch_wakes_every_waiter() {
    check(|| {
        let event = Arc::new(Latch::new());
        let waiters: Vec<_> = (0..2)
            .map(|_| {
                let event = event.clone();
                thread::spawn(move || block_on(event.wait()))
            })
            .collect();
        event.set();
        for waiter in waiters {
            waiter.join().expect("a waiter");
        }
    });
}
