//! The figures the report prints, and the verdict computed from them and
//! nothing else: [`judge`] turns what was observed into [`Figures`];
//! [`Figures::verdict`] reads only those.

use serde::Serialize;

use crate::verdict::{Check, Judgement, Reason};
use crate::{
    books::{self, DRIFT, LifeBooks, Witness},
    exchanges::{self, Joined},
    faults,
    observe::{FaultRecord, Frontend, LifeEnd, ObservedRun, Plan},
};

/// Every figure the report prints.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Figures {
    /// The plan.
    pub plan: Plan,
    /// Seconds it ran.
    pub seconds: f64,
    /// The exchanges judged.
    pub joined: Joined,
    /// Per frontend: exchanges started (its own counter), bytes checked.
    pub started: Vec<(Frontend, u64, u64)>,
    /// The witnesses set against each other.
    pub witnesses: Vec<Witness>,
    /// Every process's books.
    pub books: Vec<LifeBooks>,
    /// The faults.
    pub faults: Vec<FaultRecord>,
    /// Every frontend stopped when told to.
    pub frontends_stopped: bool,
    /// Seconds until the books settled after the traffic's end.
    pub settled_s: Option<f64>,
}

/// Unexcused ends named one by one in the verdict; the rest are counted.
pub const NAMED: usize = 20;

/// The figures of `run`.
pub fn judge(run: &ObservedRun) -> Figures {
    let joined = exchanges::join(run, run.plan.dial_limit_s);
    let books = books::lives(run);
    let witnesses = books::witnesses(run, &joined, &books);
    Figures {
        plan: run.plan.clone(),
        seconds: run.seconds,
        joined,
        started: run.started.clone(),
        witnesses,
        books,
        faults: run.faults.clone(),
        frontends_stopped: run.frontends_stopped,
        settled_s: run.settled_s,
    }
}

impl Figures {
    /// The verdict on these figures.
    pub fn verdict(&self) -> Judgement {
        let mut reasons = Vec::new();
        let mut fail = |text: String| {
            reasons.push(Reason {
                check: Check::Correctness,
                text,
            });
        };
        for (frontend, tally) in &self.joined.frontends {
            let name = frontend.name();
            let started = self
                .started
                .iter()
                .find(|(f, _, _)| f == frontend)
                .map_or(tally.recorded, |(_, started, _)| *started);
            if started != tally.recorded {
                fail(format!(
                    "{name}: {started} exchanges started, {} ended",
                    tally.recorded
                ));
            }
            if tally.late > 0 {
                fail(format!(
                    "{name}: {} dials took longer than {:.0} s",
                    tally.late, self.plan.dial_limit_s
                ));
            }
        }
        let unexcused = self.joined.unexcused();
        for e in unexcused.iter().take(NAMED) {
            fail(format!(
                "no fault on its agent or server explains: {}",
                e.describe()
            ));
        }
        if unexcused.len() > NAMED {
            fail(format!(
                "and {} more ends no fault explains",
                unexcused.len() - NAMED
            ));
        }
        for w in &self.witnesses {
            if !w.holds() {
                fail(format!(
                    "{}: {} {:.0} against {} {:.0}, a gap of {:.0} outside [{:.0}, {:.0}] ({})",
                    w.name,
                    w.left_what,
                    w.left,
                    w.right_what,
                    w.right,
                    w.gap(),
                    w.low,
                    w.high,
                    w.bounds
                ));
            }
        }
        for b in &self.books {
            life_reasons(b, &mut fail);
        }
        if !self.frontends_stopped {
            fail("a frontend did not stop cleanly".to_owned());
        }
        if self.settled_s.is_none() {
            fail("the books did not settle with nothing open after the traffic's end".to_owned());
        }
        for r in &self.faults {
            reasons.extend(faults::reasons(r));
        }
        reasons.extend(faults::missing(&self.plan.required, &self.faults));
        Judgement {
            reasons,
            performance_fatal: self.plan.performance_fatal,
        }
    }
}

/// What a process that ended with no end recorded is failed for: the
/// words every such reason starts with.
pub const VANISHED: &str = "ended with no end recorded";

/// The reasons one process's books give.
fn life_reasons(b: &LifeBooks, fail: &mut impl FnMut(String)) {
    let name = &b.name;
    if let Some(next) = b.vanished {
        fail(format!(
            "{name}: {VANISHED} (its seat's next process started at {next:.0} s): it crashed"
        ));
    }
    match b.last {
        None if b.must_carry() => fail(format!(
            "{name}: lived {:.0} s without readable books",
            b.died - b.born
        )),
        None => {}
        Some(last) => {
            if b.must_carry() && last.opened <= 0.0 {
                fail(format!(
                    "{name}: opened no connection in {:.0} s",
                    b.died - b.born
                ));
            }
            if b.largest_gap > DRIFT {
                fail(format!(
                    "{name}: opened - closed - open reached {:.0} in a reading, past {DRIFT:.0}",
                    b.largest_gap
                ));
            }
            match b.end {
                LifeEnd::Running if b.vanished.is_some() => {}
                LifeEnd::Running => {
                    if last.unaccounted() != 0.0 || last.open != 0.0 {
                        fail(format!(
                            "{name}: at the end opened {} != closed {} + open {}, or some open",
                            last.opened, last.closed, last.open
                        ));
                    }
                }
                LifeEnd::Exited { ok } => {
                    if !ok {
                        fail(format!("{name}: exited with a failure"));
                    }
                    if b.cut_draining > 0.0 {
                        fail(format!(
                            "{name}: cut {:.0} connection(s) while draining",
                            b.cut_draining
                        ));
                    }
                }
                // A killed process's last reading is from just before its
                // kill; what it cut then is its kill's.
                LifeEnd::Killed => {}
            }
        }
    }
}
