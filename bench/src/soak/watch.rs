//! What the soak watches once a second: each process's RSS, descriptors
//! and tasks, its allocator's figures (jemalloc's, in its `/metrics`), its
//! books (connections opened, closed and open, in its own `/metrics`), and
//! the traffic's counts; and every process's life, from its start to its
//! end, with every reading of its books ([`Lives`]), for the judge.

use std::{
    net::SocketAddr,
    sync::{Arc, Mutex, PoisonError},
    time::Duration,
};

use soak_judge::{
    BookSample, Books, Life, LifeEnd, Role, Seat,
    samples::{self, Alloc, ProcSample, Sample, TASKS},
};
use tokio_util::sync::CancellationToken;

use super::{RunClock, node::NodeLog, traffic::Counts};
use crate::probe;

/// One process slot (a server replica or an agent "pod"), as the
/// orchestrator last set it.
#[derive(Debug, Clone)]
pub struct Slot {
    /// `server-0`, `agent-2`, …
    pub name: String,
    /// Server or agent.
    pub role: Role,
    /// The running process, if any.
    pub pid: Option<u32>,
    /// Its health port (`/metrics`).
    pub metrics: Option<SocketAddr>,
}

/// The slots, shared with the orchestrator, which updates them on restarts.
pub type Slots = Arc<Mutex<Vec<Slot>>>;

/// Locks a mutex, poisoned or not.
pub fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Every process that lived, with every reading of its books.
#[derive(Debug, Default)]
pub struct Lives {
    /// In order of birth.
    all: Mutex<Vec<Life>>,
}

impl Lives {
    /// Process `pid` started at `t`.
    pub fn born(&self, name: String, seat: Seat, pid: u32, t: f64) {
        lock(&self.all).push(Life {
            name,
            seat,
            pid,
            born: t,
            died: t,
            end: LifeEnd::Running,
            drained: None,
            books: Vec::new(),
        });
    }

    /// A reading of `pid`'s books, asked for at `t`.
    pub fn reading(&self, pid: u32, t: f64, books: Books) {
        if let Some(life) = lock(&self.all).iter_mut().rev().find(|l| l.pid == pid) {
            life.books.push(BookSample { t, books });
        }
    }

    /// Process `pid` was told to drain at `t`.
    pub fn drained(&self, pid: u32, t: f64) {
        if let Some(life) = lock(&self.all).iter_mut().rev().find(|l| l.pid == pid) {
            life.drained = Some(t);
        }
    }

    /// Process `pid` ended at `t`.
    pub fn died(&self, pid: u32, t: f64, end: LifeEnd) {
        if let Some(life) = lock(&self.all).iter_mut().rev().find(|l| l.pid == pid) {
            life.died = t;
            life.end = end;
        }
    }

    /// Every life, those still running ended at `now`.
    pub fn take(&self, now: f64) -> Vec<Life> {
        let mut all = std::mem::take(&mut *lock(&self.all));
        for l in &mut all {
            if l.end == LifeEnd::Running {
                l.died = now;
            }
        }
        all
    }
}

/// `/metrics` of the process at `addr`, if it answers within 2 s.
pub async fn metrics(addr: SocketAddr) -> Option<String> {
    match tokio::time::timeout(Duration::from_secs(2), probe::http_get(addr, "/metrics")).await {
        Ok(Ok((200, text))) => Some(text),
        _ => None,
    }
}

/// Reads the books of process `pid` (a `role`) at `addr` into `lives`; the
/// books, if it answered with them.
pub async fn read_books(
    clock: RunClock,
    lives: &Lives,
    pid: u32,
    role: Role,
    addr: SocketAddr,
) -> Option<Books> {
    let t = clock.now();
    let books = samples::read_books(role, &metrics(addr).await?)?;
    lives.reading(pid, t, books);
    Some(books)
}

/// Open descriptors of `pid`.
fn fds(pid: u32) -> Option<u64> {
    Some(std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count() as u64)
}

/// Samples one process; its books go to `lives` too.
async fn sample_proc(slot: &Slot, clock: RunClock, lives: &Lives) -> Option<ProcSample> {
    let pid = slot.pid?;
    let rss = probe::rss(pid).ok()?;
    let fds = fds(pid)?;
    let t = clock.now();
    let text = match slot.metrics {
        Some(addr) => metrics(addr).await,
        None => None,
    };
    let books = text
        .as_deref()
        .and_then(|text| samples::read_books(slot.role, text));
    if let Some(books) = books {
        lives.reading(pid, t, books);
    }
    Some(ProcSample {
        pid,
        rss,
        fds,
        tasks: text.as_deref().map(|t| samples::sum(t, TASKS)),
        books,
        alloc: text.as_deref().and_then(Alloc::read),
    })
}

/// What the watcher reads.
#[derive(Clone)]
pub struct WatchSet {
    /// The run's clock.
    pub clock: RunClock,
    /// The process slots.
    pub slots: Slots,
    /// Every process's life.
    pub lives: Arc<Lives>,
    /// Per traffic frontend.
    pub counts: Vec<Arc<Counts>>,
    /// The destination.
    pub node: Arc<NodeLog>,
}

/// The samples so far.
pub type Samples = Arc<Mutex<Vec<Sample>>>;

/// Takes one sample now.
pub async fn sample(w: &WatchSet) -> Sample {
    let now: Vec<Slot> = lock(&w.slots).clone();
    let t = w.clock.now();
    let mut procs = Vec::with_capacity(now.len());
    for slot in &now {
        procs.push(sample_proc(slot, w.clock, &w.lives).await);
    }
    Sample {
        t,
        procs,
        counts: w.counts.iter().map(|c| c.snap()).collect(),
        dest: w.node.snap(),
    }
}

/// Samples every second into `samples` until `stop`.
pub async fn run(w: WatchSet, samples: Samples, stop: CancellationToken) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        let s = sample(&w).await;
        lock(&samples).push(s);
    }
}
