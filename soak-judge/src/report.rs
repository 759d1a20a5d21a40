//! The soak's results as Markdown, the tables of `docs/reliability.md`.
//! The verdict at the end is [`Figures::verdict`] of the figures printed
//! above it.

use std::fmt::Write as _;

use crate::{
    books::DRIFT,
    exchanges::{STUCK, Side},
    faults::{effect_note, took_effect},
    figures::Figures,
    observe::{FaultRecord, Frontend, LifeEnd, ObservedRun},
    samples::{Resource, least, least_allocated},
    verdict::Judgement,
};

/// MiB.
const MIB: f64 = 1024.0 * 1024.0;

/// Ends listed one by one in the report; the rest are counted.
const LISTED: usize = 50;

/// `1.2 s`, or `never`.
pub fn secs(s: Option<f64>) -> String {
    s.map_or("never".to_owned(), |s| format!("{s:.1} s"))
}

/// The Markdown of one run: its command and load, then a section per
/// table, then the verdict on the figures in them.
pub fn markdown(run: &ObservedRun, f: &Figures) -> String {
    let mut out = String::new();
    heading(&mut out, f);
    traffic(&mut out, f);
    destination(&mut out, f);
    endings(&mut out, f);
    witnesses(&mut out, f);
    faults(&mut out, f);
    books(&mut out, f);
    curves(&mut out, run);
    verdict(&mut out, &f.verdict());
    out
}

/// The run's mode, length, command line and load per frontend.
fn heading(out: &mut String, f: &Figures) {
    let _ = writeln!(
        out,
        "### {} mode, {:.0} min, {} agents\n\n`{}`\n\n{}\n",
        f.plan.auth,
        f.seconds / 60.0,
        f.plan.agents,
        f.plan.command,
        f.plan.load
    );
}

/// The exchanges per frontend and in all.
fn traffic(out: &mut String, f: &Figures) {
    let _ = writeln!(
        out,
        "| frontend | exchanges started | ended | ok | dial failed | ended with an error | cut by an EOF (CONNECT) | of these, excused by a fault | lost silently | stuck (> {STUCK:.0} s) | bytes checked | slowest dial | dials past {:.0} s |",
        f.plan.dial_limit_s
    );
    let _ = writeln!(
        out,
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
    );
    let mut total = [0u64; 11];
    for (frontend, t) in &f.joined.frontends {
        let (started, bytes) = f
            .started
            .iter()
            .find(|(g, _, _)| g == frontend)
            .map_or((t.recorded, 0), |(_, s, b)| (*s, *b));
        if *frontend == Frontend::Probe && t.recorded == 0 {
            continue;
        }
        let row = [
            started,
            t.recorded,
            t.ok,
            t.dial_failed,
            t.errors,
            t.cut,
            t.excused,
            t.silent,
            t.stuck,
            bytes,
            t.late,
        ];
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} | {} | **{}** | **{}** | {:.2} GB | {:.0} ms | {} |",
            frontend.name(),
            row[0],
            row[1],
            row[2],
            row[3],
            row[4],
            row[5],
            row[6],
            row[7],
            row[8],
            row[9] as f64 / 1e9,
            t.slowest_dial * 1e3,
            row[10]
        );
        for (sum, v) in total.iter_mut().zip(row) {
            *sum += v;
        }
    }
    let _ = writeln!(
        out,
        "| all | {} | {} | {} | {} | {} | {} | {} | **{}** | **{}** | {:.2} GB | | {} |\n",
        total[0],
        total[1],
        total[2],
        total[3],
        total[4],
        total[5],
        total[6],
        total[7],
        total[8],
        total[9] as f64 / 1e9,
        total[10]
    );
}

/// What the destination saw.
fn destination(out: &mut String, f: &Figures) {
    let n = &f.joined.node;
    let _ = writeln!(
        out,
        "Destination side: {} connections accepted ({} by the checked destination, the rest by the \
         stalled peers' listeners; {} from no agent's address); of the checked: {} requests \
         complete, {} closed before a request, {} reset, **{} ended by a FIN before their last \
         byte**, **{} altered**, **{} stuck or open at the end**; {} of the resets and FINs \
         excused by a fault on their agent or server.\n",
        n.accepted,
        n.exchanges,
        n.unknown,
        n.complete,
        n.unused,
        n.reset,
        n.truncated,
        n.corrupt,
        n.stuck,
        n.excused
    );
}

/// The ends no fault explains, one by one.
fn endings(out: &mut String, f: &Figures) {
    let unexcused = f.joined.unexcused();
    let _ = writeln!(
        out,
        "Ends not whole that no fault on their agent or server explains: **{}**.",
        unexcused.len()
    );
    for e in unexcused.iter().take(LISTED) {
        let _ = writeln!(out, "- {}", e.describe());
    }
    if unexcused.len() > LISTED {
        let _ = writeln!(out, "- and {} more", unexcused.len() - LISTED);
    }
    let frontend = f
        .joined
        .endings
        .iter()
        .filter(|e| matches!(e.side, Side::Frontend(_)))
        .count();
    let _ = writeln!(
        out,
        "\n({} ends not whole in all: {frontend} at the frontends, {} at the destination.)\n",
        f.joined.endings.len(),
        f.joined.endings.len() - frontend
    );
}

/// The witnesses set against each other.
fn witnesses(out: &mut String, f: &Figures) {
    let _ = writeln!(
        out,
        "| witnesses | one | the other | gap | bounds | holds |"
    );
    let _ = writeln!(out, "| --- | --- | --- | --- | --- | --- |");
    for w in &f.witnesses {
        let _ = writeln!(
            out,
            "| {} | {}: {:.0} | {}: {:.0} | {:.0} | [{:.0}, {:.0}]: {} | {} |",
            w.name,
            w.left_what,
            w.left,
            w.right_what,
            w.right,
            w.gap(),
            w.low,
            w.high,
            w.bounds,
            if w.holds() { "yes" } else { "**no**" }
        );
    }
    let _ = writeln!(out);
}

/// A row per fault, then how many of each kind, and the plan.
fn faults(out: &mut String, f: &Figures) {
    let _ = writeln!(
        out,
        "| # | at | fault | on | what it did | back | dials served | ends it excused | healthy rate kept | all traffic's rate kept ({}) | resources back | note |",
        Frontend::TRAFFIC.map(Frontend::name).join(" / ")
    );
    let _ = writeln!(
        out,
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
    );
    for (i, r) in f.faults.iter().enumerate() {
        let excused = f
            .joined
            .endings
            .iter()
            .filter(|e| e.excused_by == Some(i))
            .count();
        fault_row(out, i, r, excused);
    }
    let mut kinds: Vec<(&str, usize)> = Vec::new();
    for r in f.faults.iter().filter(|r| took_effect(r)) {
        match kinds.iter_mut().find(|(n, _)| *n == r.fault.name()) {
            Some((_, c)) => *c += 1,
            None => kinds.push((r.fault.name(), 1)),
        }
    }
    let _ = writeln!(
        out,
        "\n{} faults injected, {} took effect: {}. Planned (each must take effect): {}.\n",
        f.faults.len(),
        kinds.iter().map(|(_, c)| c).sum::<usize>(),
        kinds
            .iter()
            .map(|(n, c)| format!("{n} ×{c}"))
            .collect::<Vec<_>>()
            .join(", "),
        f.plan
            .required
            .iter()
            .map(|r| r.name())
            .collect::<Vec<_>>()
            .join(", ")
    );
}

/// The row of the `i`th fault.
fn fault_row(out: &mut String, i: usize, r: &FaultRecord, excused: usize) {
    let rates = r
        .rates
        .iter()
        .map(|r| r.map_or("-".to_owned(), |r| format!("{:.0} %", r * 100.0)))
        .collect::<Vec<_>>()
        .join(" / ");
    let resources = match r.resources_s {
        Some(s) => format!("{s:.0} s"),
        None => format!("**no**: {}", r.resources_note),
    };
    let effect = if took_effect(r) {
        effect_note(&r.effect)
    } else {
        format!("**did not take effect**: {}", effect_note(&r.effect))
    };
    let _ = writeln!(
        out,
        "| {} | {:.0} s | {} | {} | {effect} | {} | {} | {excused} | {} ({}) | {rates} | {resources} | {} |",
        i + 1,
        r.started,
        r.fault.name(),
        r.target,
        secs(r.back_s),
        secs(r.dials_s),
        r.healthy
            .map_or("?".to_owned(), |h| format!("{:.0} %", h * 100.0)),
        r.healthy_what,
        r.note
    );
}

/// Every process's books.
fn books(out: &mut String, f: &Figures) {
    let _ = writeln!(
        out,
        "| process | pid | lived | end | readings | opened | closed | open | cut | largest gap (bound {DRIFT:.0}) | dials after its last reading |"
    );
    let _ = writeln!(
        out,
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
    );
    for b in &f.books {
        let end = match b.end {
            LifeEnd::Running if b.vanished.is_some() => "**crashed: no end recorded**".to_owned(),
            LifeEnd::Killed => "killed".to_owned(),
            LifeEnd::Exited { ok: true } => "exited, status 0".to_owned(),
            LifeEnd::Exited { ok: false } => "**exited, failed**".to_owned(),
            LifeEnd::Running => "running at the end".to_owned(),
        };
        let (opened, closed, open, cut) = b.last.map_or(
            (
                "?".to_owned(),
                "?".to_owned(),
                "?".to_owned(),
                "?".to_owned(),
            ),
            |l| {
                (
                    format!("{:.0}", l.opened),
                    format!("{:.0}", l.closed),
                    format!("{:.0}", l.open),
                    format!("{:.0}", l.cut),
                )
            },
        );
        let _ = writeln!(
            out,
            "| {} | {} | {:.0}-{:.0} s | {end} | {} | {opened} | {closed} | {open} | {cut} | {:.0} | {} |",
            b.name, b.pid, b.born, b.died, b.readings, b.largest_gap, b.tail
        );
    }
}

/// Each process slot's resources: the baseline, then the least over each
/// minute.
fn curves(out: &mut String, run: &ObservedRun) {
    let _ = writeln!(
        out,
        "\nRSS / allocated (MiB) / descriptors / tasks, least over each minute (the baseline: the median over the baseline window of each 10-second window's least, what a fault's check compares with its last 10 seconds' least; allocated: jemalloc's, what the program holds, least over the baseline window):\n"
    );
    let _ = writeln!(out, "| minute | {} |", run.slot_names.join(" | "));
    let _ = writeln!(out, "| --- |{}", " --- |".repeat(run.slot_names.len()));
    let (base_from, base_to) = run.baseline_window;
    let _ = writeln!(
        out,
        "| baseline | {} |",
        run.baseline
            .iter()
            .enumerate()
            .map(|(slot, b)| resource_cell(
                *b,
                least_allocated(&run.samples, slot, base_from, base_to)
            ))
            .collect::<Vec<_>>()
            .join(" | ")
    );
    let minutes = (run.seconds / 60.0).ceil() as usize;
    for m in 0..minutes {
        let (from, to) = (m as f64 * 60.0, (m + 1) as f64 * 60.0);
        let cells: Vec<String> = (0..run.slot_names.len())
            .map(|slot| {
                resource_cell(
                    Resource::ALL.map(|res| least(&run.samples, slot, res, from, to)),
                    least_allocated(&run.samples, slot, from, to),
                )
            })
            .collect();
        let _ = writeln!(out, "| {} | {} |", m + 1, cells.join(" | "));
    }
}

/// One process's `RSS / allocated / descriptors / tasks`, `-` without RSS
/// or descriptors.
fn resource_cell(v: [Option<f64>; 3], allocated: Option<f64>) -> String {
    match v {
        [Some(rss), Some(fds), tasks] => format!(
            "{:.1} / {} / {fds:.0} / {}",
            rss / MIB,
            allocated.map_or("?".to_owned(), |a| format!("{:.1}", a / MIB)),
            tasks.map_or("?".to_owned(), |t| format!("{t:.0}"))
        ),
        _ => "-".to_owned(),
    }
}

/// The verdict: whether every check that fails the run held, else those
/// that did not; then what was only reported.
fn verdict(out: &mut String, v: &Judgement) {
    if v.held() {
        let _ = writeln!(out, "\nEvery invariant held.");
    } else {
        let _ = writeln!(out, "\nInvariants that did not hold:\n");
        for r in v.failing() {
            let _ = writeln!(out, "- {}", r.text);
        }
    }
    let advisory: Vec<_> = v.advisory().collect();
    if !advisory.is_empty() {
        let _ = writeln!(
            out,
            "\nPerformance checks reported, not failed (--soak-performance-advisory):\n"
        );
        for r in advisory {
            let _ = writeln!(out, "- {}", r.text);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{LISTED, markdown};
    use crate::{
        figures::judge,
        observe::{
            BookSample, Books, Carrier, Effect, Exchange, Fault, FaultRecord, Frontend,
            FrontendEnd, Hit, Life, LifeEnd, Listener, NodeConn, NodeEnd, ObservedRun, Plan, Seat,
        },
        samples::{Alloc, DestSnap, ProcSample, Sample},
    };

    const MIB: u64 = 1024 * 1024;

    fn exchange(id: u64, frontend: Frontend, (from, to): (f64, f64), end: FrontendEnd) -> Exchange {
        Exchange {
            id,
            frontend,
            server: 0,
            started: from,
            ended: to,
            dial_s: Some(0.012),
            end,
            why: (end != FrontendEnd::Ok).then(|| "agent soak-agent-1-1 disconnected".to_owned()),
            dial: None,
        }
    }

    fn node(id: u64, slot: usize, (from, to): (f64, f64), end: NodeEnd) -> NodeConn {
        NodeConn {
            id: Some(id),
            listener: Listener::Exchanges,
            carrier: Carrier::Slot(slot),
            accepted: from + 0.01,
            ended: to,
            end,
        }
    }

    fn life(
        name: &str,
        seat: Seat,
        (born, died): (f64, f64),
        end: LifeEnd,
        readings: &[(f64, [f64; 3])],
    ) -> Life {
        Life {
            name: name.to_owned(),
            seat,
            pid: 7,
            born,
            died,
            end,
            drained: None,
            books: readings
                .iter()
                .map(|(t, [opened, closed, open])| BookSample {
                    t: *t,
                    books: Books {
                        opened: *opened,
                        closed: *closed,
                        open: *open,
                        cut: 0.0,
                    },
                })
                .collect(),
        }
    }

    fn proc(rss_mib: u64, fds: u64, tasks: Option<f64>, allocated: Option<f64>) -> ProcSample {
        ProcSample {
            pid: 7,
            rss: rss_mib * MIB,
            fds,
            tasks,
            books: None,
            alloc: allocated.map(|a| Alloc {
                allocated: a * MIB as f64,
                ..Alloc::default()
            }),
        }
    }

    fn sample(t: f64, procs: Vec<Option<ProcSample>>) -> Sample {
        Sample {
            t,
            procs,
            counts: Vec::new(),
            dest: DestSnap::default(),
        }
    }

    /// A small run: two exchanges whole, one ended by agent 1's kill (and
    /// reset at the destination), a recovery probe; the books of every
    /// process, the killed one's read just before its kill.
    fn run() -> ObservedRun {
        let mut kill = FaultRecord::new(Fault::AgentKill, Hit::Agent(1), 31.4);
        kill.target = "agent-1".to_owned();
        kill.ended = 34.4;
        kill.recovered = 36.2;
        kill.back_s = Some(1.26);
        kill.dials_s = Some(0.04);
        kill.rates = vec![Some(0.951), None, Some(1.0), Some(0.5)];
        kill.healthy = Some(0.876);
        kill.healthy_what = "through the other agents".to_owned();
        kill.resources_s = Some(4.5);
        kill.effect = Effect::Killed { reaped: true };
        ObservedRun {
            plan: Plan {
                auth: "mTLS".to_owned(),
                agents: 2,
                required: vec![Fault::AgentKill],
                performance_fatal: false,
                dial_limit_s: 7.0,
                command: "bench --scenarios soak".to_owned(),
                load: "Load per frontend: LOAD.".to_owned(),
            },
            seconds: 90.0,
            exchanges: vec![
                exchange(1, Frontend::GrpcOurs, (10.0, 10.2), FrontendEnd::Ok),
                exchange(2, Frontend::GrpcOurs, (11.0, 11.3), FrontendEnd::Ok),
                exchange(3, Frontend::GrpcOurs, (31.0, 31.5), FrontendEnd::Error),
                exchange(4, Frontend::Probe, (36.0, 36.1), FrontendEnd::Ok),
            ],
            node: vec![
                node(1, 0, (10.0, 10.2), NodeEnd::Complete),
                node(2, 1, (11.0, 11.3), NodeEnd::Complete),
                node(3, 1, (31.0, 31.5), NodeEnd::Reset),
                node(4, 1, (36.0, 36.1), NodeEnd::Complete),
            ],
            audited: Vec::new(),
            faults: vec![kill],
            lives: vec![
                life(
                    "server-0.1",
                    Seat::Server(0),
                    (0.0, 90.0),
                    LifeEnd::Running,
                    &[(20.0, [2.0, 2.0, 0.0]), (90.0, [4.0, 4.0, 0.0])],
                ),
                life(
                    "agent-0.1",
                    Seat::Agent(0),
                    (0.0, 90.0),
                    LifeEnd::Running,
                    &[(90.0, [1.0, 1.0, 0.0])],
                ),
                life(
                    "agent-1.1",
                    Seat::Agent(1),
                    (0.0, 31.4),
                    LifeEnd::Killed,
                    &[(31.3, [2.0, 1.0, 1.0])],
                ),
                life(
                    "agent-1.2",
                    Seat::Agent(1),
                    (34.4, 90.0),
                    LifeEnd::Running,
                    &[(90.0, [1.0, 1.0, 0.0])],
                ),
            ],
            started: vec![(Frontend::GrpcOurs, 3, 3_000_000)],
            frontends_stopped: true,
            settled_s: Some(0.5),
            samples: vec![
                sample(
                    5.0,
                    vec![
                        Some(proc(21, 16, Some(12.0), Some(3.25))),
                        Some(proc(11, 9, None, None)),
                    ],
                ),
                sample(
                    30.0,
                    vec![
                        Some(proc(25, 20, Some(14.0), Some(4.0))),
                        Some(proc(12, 10, Some(3.0), Some(1.5))),
                    ],
                ),
                sample(70.0, vec![Some(proc(22, 17, None, None)), None]),
            ],
            slot_names: vec!["server-0".to_owned(), "agent-0".to_owned()],
            baseline: vec![
                [Some(20.0 * MIB as f64), Some(15.0), Some(12.0)],
                [Some(10.0 * MIB as f64), None, None],
            ],
            baseline_window: (0.0, 20.0),
        }
    }

    /// The report of [`run`], pinned so that a change to the Markdown or to
    /// what the verdict reads shows here: every figure in it agrees with
    /// its verdict (nothing lost silently, every end excused, every
    /// witness within its bounds), and the verdict is the last section.
    const GOLDEN: &str = include_str!("report/golden.md");

    #[test]
    fn a_healthy_reports_figures_and_its_verdict_agree_byte_for_byte() {
        let run = run();
        let found = markdown(&run, &judge(&run));
        if std::env::var_os("UPDATE_GOLDEN").is_some() {
            std::fs::write(
                concat!(env!("CARGO_MANIFEST_DIR"), "/src/report/golden.md"),
                &found,
            )
            .unwrap();
        }
        assert_eq!(found, GOLDEN, "found:\n{found}");
        assert!(found.ends_with(
            "\nEvery invariant held.\n\nPerformance checks reported, not failed (--soak-performance-advisory):\n\n- agent kill -9 on agent-1 at 31 s: healthy traffic (through the other agents) kept 88 % of its rate\n"
        ));
    }

    #[test]
    fn the_figures_of_a_violation_turn_the_verdict() {
        // The old golden report printed "3 lost silently, 1 altered" above
        // "Every invariant held.".
        let mut run = run();
        for id in 10..13 {
            run.exchanges.push(exchange(
                id,
                Frontend::GrpcOurs,
                (50.0, 50.2),
                FrontendEnd::Silent,
            ));
            run.node.push(node(id, 0, (50.0, 50.2), NodeEnd::Complete));
        }
        run.exchanges.push(exchange(
            13,
            Frontend::GrpcOurs,
            (51.0, 51.2),
            FrontendEnd::Error,
        ));
        run.node.push(node(13, 0, (51.0, 51.2), NodeEnd::Corrupt));
        run.started[0].1 += 4;
        for l in &mut run.lives {
            if l.name == "agent-0.1" || l.name == "server-0.1" {
                let last = &mut l.books.last_mut().unwrap().books;
                last.opened += 4.0;
                last.closed += 4.0;
            }
        }
        let figures = judge(&run);
        let found = markdown(&run, &figures);
        assert!(
            found.contains("| grpc, ours | 7 | 7 | 2 | 0 | 2 | 0 | 1 | **3** | **0** |"),
            "{found}"
        );
        assert!(found.contains("**1 altered**"), "{found}");
        assert!(!found.contains("Every invariant held."), "{found}");
        let verdict = found
            .split("\nInvariants that did not hold:\n\n")
            .nth(1)
            .unwrap();
        let reasons: Vec<&str> = verdict
            .lines()
            .take_while(|l| l.starts_with("- "))
            .collect();
        assert_eq!(reasons.len(), 5, "{verdict}");
        assert!(
            reasons[..3]
                .iter()
                .all(|r| r.contains("lost or altered bytes silently")),
            "{reasons:#?}"
        );
        assert!(
            reasons[3].contains("grpc, ours: ended with an error at 51.2 s"),
            "{reasons:#?}"
        );
        assert!(
            reasons[4].contains("reached the destination altered"),
            "{reasons:#?}"
        );
        assert!(!figures.verdict().held());
    }

    #[test]
    fn the_report_counts_each_kind_of_fault_that_took_effect_and_only_those() {
        let mut run = run();
        let mut again = run.faults[0].clone();
        again.started = 60.0;
        again.ended = 62.0;
        again.recovered = 63.0;
        let mut unseen = FaultRecord::new(Fault::ServerKill, Hit::Server(0), 70.0);
        unseen.effect = Effect::Killed { reaped: false };
        run.faults.extend([again, unseen]);
        let found = markdown(&run, &judge(&run));
        assert!(
            found.contains(
                "\n3 faults injected, 2 took effect: agent kill -9 ×2. Planned (each must take effect): agent kill -9.\n"
            ),
            "{found}"
        );
    }

    #[test]
    fn ends_past_those_the_report_lists_are_counted_not_dropped() {
        for n in [LISTED, LISTED + 1] {
            let mut run = run();
            // Dials that failed long after the kill.
            for i in 0..n {
                run.exchanges.push(exchange(
                    100 + i as u64,
                    Frontend::GrpcOurs,
                    (60.0, 60.5),
                    FrontendEnd::DialFailed,
                ));
            }
            let found = markdown(&run, &judge(&run));
            let listed: Vec<&str> = found
                .lines()
                .skip_while(|l| !l.starts_with("Ends not whole that no fault"))
                .skip(1)
                .take_while(|l| l.starts_with("- "))
                .collect();
            let more = usize::from(n > LISTED);
            assert_eq!(listed.len(), LISTED + more, "{n}");
            assert_eq!(listed.last() == Some(&"- and 1 more"), n > LISTED, "{n}");
        }
    }
}
