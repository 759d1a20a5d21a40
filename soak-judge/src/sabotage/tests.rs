//! The sabotaged run's own verdict ([`shortfalls`]): what the judge must
//! have found, and nothing else.

use super::*;
use crate::exchanges::Side;

/// The healthy agent broken, as the driver's.
const VICTIM: usize = 2;
/// The agent killed as a recorded fault.
const KILLED: usize = 1;
/// How soon a close's ends must come.
const PROMPT: f64 = 2.0;
/// How long after an act its ends are explained by it.
const AFTERMATH: f64 = 45.0;
/// The ends a close causes.
const CLOSE_CAUSES: &[Ending] = &[Ending::Error, Ending::Reset, Ending::Cut];

/// Something done to agent [`VICTIM`] over `from..to`, unrecorded.
fn on_victim(what: &'static str, causes: &'static [Ending], from: f64, to: f64) -> Sabotaged {
    Sabotaged {
        what,
        causes,
        after: PROMPT,
        carrier: Carrier::Slot(VICTIM),
        from,
        to,
        recorded: false,
        crashed: false,
    }
}

/// An end the judge did not excuse, on slot `slot`, over `from..to`.
fn end(ending: Ending, slot: usize, (from, to): (f64, f64)) -> Judged {
    Judged {
        side: Side::Node,
        ending,
        carrier: Carrier::Slot(slot),
        server: None,
        from,
        to,
        why: String::new(),
        excused_by: None,
    }
}

/// A close on agent [`VICTIM`] at 10 s, a crash at 20 s and, under a
/// recorded kill of [`KILLED`] over 30-40 s, the same excused.
fn done() -> Vec<Sabotaged> {
    let mut crash = on_victim("a crash", &[Ending::Error], 20.0, 20.0);
    crash.crashed = true;
    let mut kill = on_victim("a close under a recorded kill", &[], 30.0, 40.0);
    kill.carrier = Carrier::Slot(KILLED);
    kill.recorded = true;
    vec![
        on_victim("a spurious close", CLOSE_CAUSES, 10.0, 10.0),
        crash,
        kill,
    ]
}

/// What the judge said of the crash.
fn crash_named() -> String {
    format!("agent-{VICTIM}.1: {VANISHED} (its seat's next process started at 23 s): it crashed")
}

/// Every act found, each by an end of its kind on its agent in its
/// window; the crashed process named.
fn found() -> (Vec<Judged>, Vec<String>) {
    let ends = vec![
        end(Ending::Reset, VICTIM, (9.5, 10.5)),
        end(Ending::Error, VICTIM, (19.0, 21.0)),
    ];
    let failing = vec![
        format!(
            "no fault on its agent or server explains: {}",
            ends[0].describe()
        ),
        crash_named(),
    ];
    (ends, failing)
}

fn judged(ends: &[Judged], failing: &[String], held: bool) -> Vec<String> {
    let refs: Vec<&Judged> = ends.iter().collect();
    let texts: Vec<&str> = failing.iter().map(String::as_str).collect();
    shortfalls(&refs, &texts, held, &done(), AFTERMATH)
}

#[test]
fn a_judge_that_found_exactly_what_was_done_falls_short_in_nothing() {
    let (ends, failing) = found();
    assert_eq!(judged(&ends, &failing, false), Vec::<String>::new());
}

#[test]
fn an_act_with_no_end_of_its_kind_on_its_agent_in_its_window_was_missed() {
    let (mut ends, failing) = found();
    // The close's end of another kind, then on another agent, then late.
    for wrong in [
        end(Ending::Stuck, VICTIM, (9.5, 10.5)),
        end(Ending::Reset, 0, (9.5, 10.5)),
        end(Ending::Reset, VICTIM, (9.5, 10.0 + PROMPT + 0.5)),
    ] {
        ends[0] = wrong;
        let short = judged(&ends, &failing, false);
        assert!(
            short
                .iter()
                .any(|s| s.starts_with("the judge missed a spurious close on agent-2 at 10-10 s")),
            "{short:#?}"
        );
    }
}

#[test]
fn an_end_outside_every_window_or_on_an_untouched_agent_is_unexplained() {
    let (mut ends, failing) = found();
    ends.push(end(Ending::Reset, VICTIM, (80.0, 80.5)));
    ends.push(end(Ending::Error, 0, (10.0, 10.2)));
    let short = judged(&ends, &failing, false);
    let unexplained: Vec<&String> = short
        .iter()
        .filter(|s| s.starts_with("a violation no sabotage explains"))
        .collect();
    assert_eq!(unexplained.len(), 2, "{short:#?}");
    // One that ended a second before an act (the witnesses' clocks) is
    // its act's; an end on the killed agent outside its kill is not
    // charged to the kill, only unexplained.
    let (mut ends, failing) = found();
    ends.push(end(Ending::Reset, VICTIM, (9.0, 9.5)));
    assert_eq!(judged(&ends, &failing, false), Vec::<String>::new());
    let (mut ends, failing) = found();
    ends.push(end(Ending::Reset, KILLED, (20.0, 21.0)));
    let short = judged(&ends, &failing, false);
    assert_eq!(short.len(), 1, "{short:#?}");
    assert!(
        short[0].starts_with("a violation no sabotage explains"),
        "{short:#?}"
    );
    // An end no witness attributed, inside a window, is explained.
    let (mut ends, failing) = found();
    let mut unknown = end(Ending::Error, 0, (10.0, 10.2));
    unknown.carrier = Carrier::Unknown;
    ends.push(unknown);
    assert_eq!(judged(&ends, &failing, false), Vec::<String>::new());
}

#[test]
fn an_end_on_the_agent_under_a_recorded_kill_is_charged_to_no_fault() {
    let (mut ends, failing) = found();
    ends.push(end(Ending::Reset, KILLED, (31.0, 32.0)));
    let short = judged(&ends, &failing, false);
    assert!(
        short.contains(
            &"1 end(s) of a close under a recorded kill on agent-1 charged to no fault".to_owned()
        ),
        "{short:#?}"
    );
}

#[test]
fn a_crash_the_judge_did_not_name_and_any_other_failed_check_fall_short() {
    let (ends, mut failing) = found();
    failing.retain(|t| *t != crash_named());
    let short = judged(&ends, &failing, false);
    assert_eq!(
        short,
        [format!(
            "the judge did not name agent-{VICTIM}'s crashed process ({VANISHED})"
        )]
    );
    // A reason about the crashed agent that is not its crash does not
    // name it.
    let (ends, mut failing) = found();
    failing.retain(|t| *t != crash_named());
    failing.push(format!("agent-{VICTIM}.1: opened no connection in 60 s"));
    assert_eq!(
        judged(&ends, &failing, false),
        [
            format!("the judge did not name agent-{VICTIM}'s crashed process ({VANISHED})"),
            format!(
                "a check the sabotage should not fail: agent-{VICTIM}.1: opened no connection in \
                 60 s"
            )
        ]
    );
    let (ends, mut failing) = found();
    failing.push("agent-0.1: opened no connection in 60 s".to_owned());
    failing.push(format!(
        "agent-0.1: {VANISHED} (its seat's next process started at 9 s)"
    ));
    assert_eq!(
        judged(&ends, &failing, false),
        [
            "a check the sabotage should not fail: agent-0.1: opened no connection in 60 s"
                .to_owned(),
            format!(
                "a check the sabotage should not fail: agent-0.1: {VANISHED} (its seat's next \
                 process started at 9 s)"
            )
        ]
    );
}

#[test]
fn a_judge_that_held_the_run_found_nothing() {
    let (ends, failing) = found();
    assert_eq!(
        judged(&ends, &failing, true),
        ["the judge found nothing wrong"]
    );
}
