//! The soak's judge (`bench --scenarios soak`, `docs/reliability.md`):
//! what the soak observed goes in, the figures it reports and the verdict
//! on them come out. No I/O, no clock, no tokio: the driver that injects
//! the faults and the traffic that produces the events live in `bench`
//! (`bench/src/soak*`), as the server's routing core sits beside its
//! driver. A crate of its own so that nothing here can reach a socket,
//! and so that a mutation run (cargo-mutants) builds in seconds.
//!
//! The rules, in short:
//! - every exchange is tagged with the agent that carried it (by the
//!   source address the destination saw: the kernel's word, not the
//!   agent's; failing that, by its server's audit record of the dial) and
//!   the server (by the socket its frontend dialed); a loss, an error, a
//!   reset or a truncation is excused only by a fault on that agent or
//!   that server whose window holds the exchange's end ([`exchanges`]);
//! - a stuck exchange, a byte altered, or bytes missing behind a clean end
//!   are never excused;
//! - independent witnesses are set against each other: the frontend's
//!   `ok` against the destination's `complete` for the same exchange, each
//!   agent's dials against what the destination accepted from its
//!   address, the servers' dials against both ([`books`]);
//! - every process that lived has its books checked, with a stated bound
//!   while traffic runs and exactly at the end ([`books`]);
//! - every fault leaves evidence that it took effect, and its own check
//!   that can fail ([`faults`]);
//! - the verdict is a function of the figures the report prints
//!   ([`figures::Figures::verdict`]), never a list kept beside them.
//!
//! # Layout
//! - [`observe`]: the inputs: exchanges as each end saw them, faults with
//!   their effects, the processes' lives and books, the plan.
//! - [`samples`]: the per-second samples, `/metrics` text, and the
//!   measures over them (least values, rates).
//! - [`exchanges`]: frontend and destination records joined, each ending
//!   excused by a fault on its carrier or not.
//! - [`books`]: each process's books, and the witnesses set against each
//!   other.
//! - [`faults`]: what each fault must show.
//! - [`figures`]: [`figures::Figures`] (everything the report prints) and
//!   the verdict computed from them.
//! - [`report`]: the Markdown of `docs/reliability.md`.
//! - [`verdict`]: what a check that did not hold says, and the verdict.
//! - [`sabotage`]: the sabotaged run's own verdict: whether the judge
//!   found exactly what the driver did without telling it.
//!
//! Modules import one way: observations ([`observe`], and [`samples`]'
//! measures over them) → [`exchanges`], [`books`], [`faults`] →
//! [`figures`] → [`report`], [`sabotage`]; [`verdict`] is a leaf they all
//! speak.

pub mod books;
pub mod exchanges;
pub mod faults;
pub mod figures;
pub mod observe;
pub mod report;
pub mod sabotage;
pub mod samples;
#[cfg(test)]
mod tests;
pub mod verdict;

pub use figures::{Figures, judge};
pub use observe::{
    Audited, BookSample, Books, Carrier, DialKey, Effect, Exchange, Fault, FaultRecord, Frontend,
    FrontendEnd, Hit, Life, LifeEnd, Listener, NodeConn, NodeEnd, ObservedRun, OldCa, Plan, Role,
    Seat, Secs, SlowPeer,
};
pub use verdict::{Check, Judgement, Reason};
