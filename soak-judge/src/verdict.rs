//! The verdict's vocabulary: a check that did not hold ([`Reason`]), of
//! which kind ([`Check`]), and the verdict they make ([`Judgement`]). A
//! leaf: the faults' own checks and the figures both say their reasons in
//! it, and the figures make the judgement (`Figures::verdict`).

use serde::Serialize;

/// What a violated check says about the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Check {
    /// Bytes, books, witnesses, recovery, the faults' own checks: wrong on
    /// any machine.
    Correctness,
    /// Rates and resources: judged over seconds, on a shared machine.
    Performance,
}

/// One check that did not hold.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Reason {
    /// Which kind.
    pub check: Check,
    /// What did not hold, with the figures.
    pub text: String,
}

/// The verdict: the checks that did not hold.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Judgement {
    /// Every check that did not hold, in report order.
    pub reasons: Vec<Reason>,
    /// Whether performance reasons fail the run.
    pub performance_fatal: bool,
}

impl Judgement {
    /// The reasons that fail the run.
    pub fn failing(&self) -> impl Iterator<Item = &Reason> {
        self.reasons
            .iter()
            .filter(|r| r.check == Check::Correctness || self.performance_fatal)
    }

    /// The reasons only reported.
    pub fn advisory(&self) -> impl Iterator<Item = &Reason> {
        self.reasons
            .iter()
            .filter(|r| r.check == Check::Performance && !self.performance_fatal)
    }

    /// Whether every check that fails the run held.
    pub fn held(&self) -> bool {
        self.failing().next().is_none()
    }
}
