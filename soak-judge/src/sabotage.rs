//! The sabotaged run's own verdict (`bench --soak-sabotage`,
//! `docs/reliability.md`): given what the driver did to healthy agents
//! without telling the judge ([`Sabotaged`]) and what the judge then said,
//! whether the judge found exactly that. Here, beside the judge, so that
//! a mutation run reaches it in seconds; the acts themselves are the
//! driver's (`bench/src/soak/sabotage.rs`).

use crate::{
    exchanges::{Ending, Judged},
    figures::VANISHED,
    observe::{Carrier, Secs},
};

/// One thing done on purpose.
#[derive(Debug, Clone)]
pub struct Sabotaged {
    /// What.
    pub what: &'static str,
    /// The ends it must cause, one at least within its window.
    pub causes: &'static [Ending],
    /// How long after its end they may come.
    pub after: Secs,
    /// On which agent.
    pub carrier: Carrier,
    /// From.
    pub from: Secs,
    /// Until.
    pub to: Secs,
    /// Under a recorded fault (so excused).
    pub recorded: bool,
    /// A process of its agent crashed, which the judge must name.
    pub crashed: bool,
}

/// How many ends the judge did not excuse that `s` explains as found:
/// of a kind it causes, on its agent, ended from its start to its end
/// plus its delay.
pub fn found(unexcused: &[&Judged], s: &Sabotaged) -> usize {
    unexcused
        .iter()
        .filter(|e| {
            e.carrier == s.carrier
                && s.causes.contains(&e.ending)
                && e.to >= s.from
                && e.to <= s.to + s.after
        })
        .count()
}

/// What the judge got wrong about a sabotaged run, in words: given the
/// ends it did not excuse, the texts of the reasons it failed the run
/// for, whether it held the run, and what was `done`; an unexcused end
/// is explained by an unrecorded act on its agent (or by any, when no
/// witness named its agent) from a second before the act to `aftermath`
/// past it.
pub fn shortfalls(
    unexcused: &[&Judged],
    failing: &[&str],
    held: bool,
    done: &[Sabotaged],
    aftermath: Secs,
) -> Vec<String> {
    let mut out = Vec::new();
    for s in done.iter().filter(|s| !s.recorded) {
        if found(unexcused, s) == 0 {
            out.push(format!(
                "the judge missed {} on {} at {:.0}-{:.0} s",
                s.what,
                s.carrier.describe(),
                s.from,
                s.to
            ));
        }
    }
    let within = |s: &Sabotaged, e: &Judged| e.to >= s.from - 1.0 && e.from <= s.to + aftermath;
    for e in unexcused {
        let explained = done.iter().any(|s| {
            !s.recorded && (e.carrier == s.carrier || e.carrier == Carrier::Unknown) && within(s, e)
        });
        if !explained {
            out.push(format!(
                "a violation no sabotage explains: {}",
                e.describe()
            ));
        }
    }
    for s in done.iter().filter(|s| s.recorded) {
        let charged = unexcused
            .iter()
            .filter(|e| e.carrier == s.carrier && e.from >= s.from && e.to <= s.to)
            .count();
        if charged > 0 {
            out.push(format!(
                "{charged} end(s) of {} on {} charged to no fault",
                s.what,
                s.carrier.describe()
            ));
        }
    }
    // The crashed processes' names start with their agent's.
    let crashes: Vec<String> = done
        .iter()
        .filter(|s| s.crashed)
        .map(|s| format!("{}.", s.carrier.describe()))
        .collect();
    let names = |agent: &str, text: &str| text.starts_with(agent) && text.contains(VANISHED);
    let crashed = |text: &str| crashes.iter().any(|agent| names(agent, text));
    for agent in &crashes {
        if !failing.iter().any(|t| names(agent, t)) {
            out.push(format!(
                "the judge did not name {}'s crashed process ({VANISHED})",
                agent.trim_end_matches('.')
            ));
        }
    }
    let prefix = "no fault on its agent or server explains";
    for text in failing {
        if !text.starts_with(prefix) && !text.starts_with("and ") && !crashed(text) {
            out.push(format!("a check the sabotage should not fail: {text}"));
        }
    }
    if held {
        out.push("the judge found nothing wrong".to_owned());
    }
    out
}

#[cfg(test)]
mod tests;
