//! The soak's results as Markdown, the tables of `docs/reliability.md`.

use std::fmt::Write as _;

use super::{SoakOpt, SoakResult, faults::FaultRecord, secs, traffic::Kind, watch::Resource};

/// MiB.
const MIB: f64 = 1024.0 * 1024.0;

/// The Markdown of one run: its command and load, then a section per
/// table.
pub fn markdown(r: &SoakResult, opt: &SoakOpt) -> String {
    let mut out = String::new();
    heading(&mut out, r, opt);
    traffic(&mut out, r);
    destination(&mut out, r);
    faults(&mut out, r);
    books(&mut out, r);
    curves(&mut out, r);
    verdict(&mut out, r);
    out
}

/// The run's mode, length, command line and load per frontend.
fn heading(out: &mut String, r: &SoakResult, opt: &SoakOpt) {
    let command = std::env::args().collect::<Vec<_>>().join(" ");
    let _ = writeln!(
        out,
        "### {} mode, {:.0} min, {} agents\n\n`{command}`\n",
        r.auth,
        r.seconds / 60.0,
        r.agents
    );
    let _ = writeln!(
        out,
        "Load per frontend: {} request/response workers (one exchange each per {:?}, 1-16 KiB up, \
         1-64 KiB down), {} bulk worker(s) ({} MiB up or down per exchange at {:.1} MB/s).\n",
        opt.load.rr_workers,
        opt.load.interval,
        opt.load.bulk_workers,
        opt.load.bulk_bytes / (1024 * 1024),
        opt.load.bulk_rate as f64 / 1e6
    );
}

/// The exchanges per frontend and in all.
fn traffic(out: &mut String, r: &SoakResult) {
    let _ = writeln!(
        out,
        "| frontend | exchanges | ok | ended with an error | cut by an EOF (CONNECT) | lost silently | bytes checked | slowest dial | dials past the timeout |"
    );
    let _ = writeln!(
        out,
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"
    );
    let mut total = [0u64; 7];
    for (name, c) in &r.counts {
        let _ = writeln!(
            out,
            "| {name} | {} | {} | {} | {} | **{}** | {:.2} GB | {:.0} ms | {} |",
            c.started,
            c.ok,
            c.errors,
            c.cut,
            c.silent,
            c.bytes as f64 / 1e9,
            c.dial_max_us as f64 / 1e3,
            c.late
        );
        for (t, v) in total
            .iter_mut()
            .zip([c.started, c.ok, c.errors, c.cut, c.silent, c.bytes, c.late])
        {
            *t += v;
        }
    }
    let _ = writeln!(
        out,
        "| all | {} | {} | {} | {} | **{}** | {:.2} GB | | {} |\n",
        total[0],
        total[1],
        total[2],
        total[3],
        total[4],
        total[5] as f64 / 1e9,
        total[6]
    );
}

/// The CONNECT tunnels cut by an EOF, and what the destination saw.
fn destination(out: &mut String, r: &SoakResult) {
    let _ = writeln!(
        out,
        "Cut by an EOF: HTTP CONNECT tunnels on the Unix socket whose agent or server died ({} \
         of them during such a fault); once the 200 is sent, CONNECT on a Unix socket has no \
         other way to end.\n",
        r.cut_excused
    );
    let d = r.dest;
    let _ = writeln!(
        out,
        "Destination side: {} connections accepted, {} requests complete, {} reset, \
         **{} ended cleanly before their last byte** ({} of them by an agent killed with \
         SIGKILL, whose kernel closes its sockets with a FIN), **{} altered**, {} open at the end.\n",
        d.accepted, d.complete, d.reset, d.truncated, r.dest_killed, d.corrupt, d.open
    );
}

/// A row per fault, then how many of each kind.
fn faults(out: &mut String, r: &SoakResult) {
    let _ = writeln!(
        out,
        "| # | at | fault | on | back | dials served | healthy rate kept | all traffic's rate kept ({}) | resources back | note |",
        Kind::ALL.map(Kind::name).join(" / ")
    );
    let _ = writeln!(
        out,
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
    );
    for (i, f) in r.faults.iter().enumerate() {
        fault_row(out, i, f);
    }
    let mut kinds: Vec<(&str, usize)> = Vec::new();
    for f in &r.faults {
        match kinds.iter_mut().find(|(n, _)| *n == f.fault.name()) {
            Some((_, c)) => *c += 1,
            None => kinds.push((f.fault.name(), 1)),
        }
    }
    let _ = writeln!(
        out,
        "\n{} faults: {}.\n",
        r.faults.len(),
        kinds
            .iter()
            .map(|(n, c)| format!("{n} ×{c}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
}

/// The row of the `i`th fault.
fn fault_row(out: &mut String, i: usize, f: &FaultRecord) {
    let rates = f
        .rates
        .iter()
        .map(|r| r.map_or("-".to_owned(), |r| format!("{:.0} %", r * 100.0)))
        .collect::<Vec<_>>()
        .join(" / ");
    let resources = match f.resources_s {
        Some(s) => format!("{s:.0} s"),
        None => format!("**no**: {}", f.resources_note),
    };
    let _ = writeln!(
        out,
        "| {} | {:.0} s | {} | {} | {} | {} | {} ({}) | {rates} | {resources} | {} |",
        i + 1,
        f.started,
        f.fault.name(),
        f.target,
        secs(f.back_s),
        secs(f.dials_s),
        f.healthy
            .map_or("?".to_owned(), |r| format!("{:.0} %", r * 100.0)),
        f.healthy_what,
        f.note
    );
}

/// Each process's books at the end, and their largest gap meanwhile.
fn books(out: &mut String, r: &SoakResult) {
    let _ = writeln!(
        out,
        "| process | opened | closed | open | largest gap in a sample while traffic ran |"
    );
    let _ = writeln!(out, "| --- | --- | --- | --- | --- |");
    for ((name, b), (_, drift)) in r.books.iter().zip(&r.books_drift) {
        match b {
            Some(b) => {
                let _ = writeln!(
                    out,
                    "| {name} (last process) | {} | {} | {} | {drift:.0} |",
                    b.opened, b.closed, b.open
                );
            }
            None => {
                let _ = writeln!(out, "| {name} | ? | ? | ? | {drift:.0} |");
            }
        }
    }
}

/// Each process's resources: the baseline, then the least over each
/// minute.
fn curves(out: &mut String, r: &SoakResult) {
    let _ = writeln!(
        out,
        "\nRSS / allocated (MiB) / descriptors / tasks, least over each minute (the baseline: the median over the baseline window of each 10-second window's least, what a fault's check compares with its last 10 seconds' least; allocated: jemalloc's, what the program holds, least over the baseline window):\n"
    );
    let _ = writeln!(out, "| minute | {} |", r.slot_names.join(" | "));
    let _ = writeln!(out, "| --- |{}", " --- |".repeat(r.slot_names.len()));
    let (base_from, base_to) = r.baseline_window;
    let _ = writeln!(
        out,
        "| baseline | {} |",
        r.baseline
            .iter()
            .enumerate()
            .map(|(slot, (_, b))| resource_cell(
                *b,
                super::watch::least_allocated(&r.samples, slot, base_from, base_to)
            ))
            .collect::<Vec<_>>()
            .join(" | ")
    );
    let minutes = (r.seconds / 60.0).ceil() as usize;
    for m in 0..minutes {
        let (from, to) = (m as f64 * 60.0, (m + 1) as f64 * 60.0);
        let cells: Vec<String> = (0..r.slot_names.len())
            .map(|slot| {
                resource_cell(
                    Resource::ALL.map(|res| super::watch::least(&r.samples, slot, res, from, to)),
                    super::watch::least_allocated(&r.samples, slot, from, to),
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

/// Whether every invariant held, else those that did not.
fn verdict(out: &mut String, r: &SoakResult) {
    if r.violations.is_empty() {
        let _ = writeln!(out, "\nEvery invariant held.");
    } else {
        let _ = writeln!(out, "\nInvariants that did not hold:\n");
        for v in &r.violations {
            let _ = writeln!(out, "- {v}");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::{path::PathBuf, time::Duration};

    use super::markdown;
    use crate::soak::{
        SoakOpt, SoakResult,
        faults::{Fault, FaultRecord},
        system::Auth,
        traffic::{CountsSnap, DestSnap, Load},
        watch::{Alloc, Books, ProcSample, Sample},
    };

    const MIB: u64 = 1024 * 1024;

    fn opt() -> SoakOpt {
        SoakOpt {
            duration: Duration::from_secs(90),
            auth: Auth::Mtls,
            agents: 2,
            load: Load {
                rr_workers: 4,
                interval: Duration::from_millis(100),
                bulk_workers: 1,
                bulk_rate: 4_000_000,
                bulk_bytes: 16 * 1024 * 1024,
                dial_limit: Duration::from_secs(7),
            },
            go_frontend: PathBuf::from("go-frontend"),
            markdown: PathBuf::from("soak.md"),
            samples: None,
            performance_fatal: false,
        }
    }

    fn counts(started: u64, silent: u64) -> CountsSnap {
        CountsSnap {
            started,
            ok: started - silent - 2,
            errors: 1,
            silent,
            cut: 1,
            rr_ok: 0,
            bulk_bytes: 0,
            bytes: started * 1_000_000,
            late: silent,
            skipped: 0,
            dial_max_us: 1_234_567,
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

    fn result(violations: Vec<String>) -> SoakResult {
        let mut kill = FaultRecord::new(Fault::AgentKill, 31.4);
        kill.target = "agent-1".to_owned();
        kill.back_s = Some(1.26);
        kill.dials_s = Some(0.04);
        kill.rates = vec![Some(0.951), None, Some(1.0), Some(0.5)];
        kill.healthy = Some(0.876);
        kill.healthy_what = "through agent-0".to_owned();
        kill.resources_s = Some(4.5);
        let mut stall = FaultRecord::new(Fault::FrontendStall, 50.0);
        stall.target = "a gRPC and a CONNECT download".to_owned();
        stall.rates = vec![None; 4];
        stall.healthy_what = "every frontend".to_owned();
        stall.resources_note = "slot 1 RSS: 30 vs baseline 20".to_owned();
        stall.note = "2 held".to_owned();
        let mut again = FaultRecord::new(Fault::AgentKill, 70.0);
        again.target = "agent-0".to_owned();
        again.rates = vec![Some(0.9); 4];
        SoakResult {
            auth: "mTLS".to_owned(),
            seconds: 90.0,
            agents: 2,
            faults: vec![kill, stall, again],
            counts: vec![
                ("grpc, ours".to_owned(), counts(100, 0)),
                ("http-connect, ours".to_owned(), counts(50, 3)),
            ],
            dest: DestSnap {
                accepted: 150,
                open: 0,
                complete: 140,
                complete_ns: 70,
                reset: 6,
                truncated: 3,
                corrupt: 1,
            },
            dest_killed: 2,
            cut_excused: 1,
            books: vec![
                (
                    "server-0".to_owned(),
                    Some(Books {
                        opened: 150.0,
                        closed: 149.0,
                        open: 1.0,
                    }),
                ),
                ("agent-0".to_owned(), None),
            ],
            books_drift: vec![("server-0".to_owned(), 2.4), ("agent-0".to_owned(), 0.0)],
            baseline: vec![
                (
                    "server-0".to_owned(),
                    [Some(20.0 * MIB as f64), Some(15.0), Some(12.0)],
                ),
                ("agent-0".to_owned(), [Some(10.0 * MIB as f64), None, None]),
            ],
            baseline_window: (0.0, 20.0),
            baseline_rates: Vec::new(),
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
            violations,
        }
    }

    /// The command line the Markdown quotes: this test binary's.
    fn command() -> String {
        std::env::args().collect::<Vec<_>>().join(" ")
    }

    /// The tables of [`result`], as `docs/reliability.md` has them; pinned
    /// so that a restructuring of [`markdown`] keeps them byte for byte.
    const TABLES: &str = r#"### mTLS mode, 2 min, 2 agents

`COMMAND`

Load per frontend: 4 request/response workers (one exchange each per 100ms, 1-16 KiB up, 1-64 KiB down), 1 bulk worker(s) (16 MiB up or down per exchange at 4.0 MB/s).

| frontend | exchanges | ok | ended with an error | cut by an EOF (CONNECT) | lost silently | bytes checked | slowest dial | dials past the timeout |
| --- | --- | --- | --- | --- | --- | --- | --- | --- |
| grpc, ours | 100 | 98 | 1 | 1 | **0** | 0.10 GB | 1235 ms | 0 |
| http-connect, ours | 50 | 45 | 1 | 1 | **3** | 0.05 GB | 1235 ms | 3 |
| all | 150 | 143 | 2 | 2 | **3** | 0.15 GB | | 3 |

Cut by an EOF: HTTP CONNECT tunnels on the Unix socket whose agent or server died (1 of them during such a fault); once the 200 is sent, CONNECT on a Unix socket has no other way to end.

Destination side: 150 connections accepted, 140 requests complete, 6 reset, **3 ended cleanly before their last byte** (2 of them by an agent killed with SIGKILL, whose kernel closes its sockets with a FIN), **1 altered**, 0 open at the end.

| # | at | fault | on | back | dials served | healthy rate kept | all traffic's rate kept (grpc, ours / grpc-go single-use / grpc-go reused / http-connect, ours) | resources back | note |
| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |
| 1 | 31 s | agent kill -9 | agent-1 | 1.3 s | 0.0 s | 88 % (through agent-0) | 95 % / - / 100 % / 50 % | 4 s |  |
| 2 | 50 s | frontend stops reading | a gRPC and a CONNECT download | never | never | ? (every frontend) | - / - / - / - | **no**: slot 1 RSS: 30 vs baseline 20 | 2 held |
| 3 | 70 s | agent kill -9 | agent-0 | never | never | ? () | 90 % / 90 % / 90 % / 90 % | **no**:  |  |

3 faults: agent kill -9 ×2, frontend stops reading ×1.

| process | opened | closed | open | largest gap in a sample while traffic ran |
| --- | --- | --- | --- | --- |
| server-0 (last process) | 150 | 149 | 1 | 2 |
| agent-0 | ? | ? | ? | 0 |

RSS / allocated (MiB) / descriptors / tasks, least over each minute (the baseline: the median over the baseline window of each 10-second window's least, what a fault's check compares with its last 10 seconds' least; allocated: jemalloc's, what the program holds, least over the baseline window):

| minute | server-0 | agent-0 |
| --- | --- | --- |
| baseline | 20.0 / 3.2 / 15 / 12 | - |
| 1 | 21.0 / 3.2 / 16 / 12 | 11.0 / 1.5 / 9 / 3 |
| 2 | 22.0 / ? / 17 / ? | - |
"#;

    #[test]
    fn the_tables_keep_their_bytes() {
        let expected = format!(
            "{}\nInvariants that did not hold:\n\n- a\n- b c\n",
            TABLES.replace("COMMAND", &command())
        );
        let found = markdown(&result(vec!["a".to_owned(), "b c".to_owned()]), &opt());
        assert_eq!(found, expected, "found:\n{found}");
    }

    #[test]
    fn a_run_without_violations_says_so_last() {
        let expected = format!(
            "{}\nEvery invariant held.\n",
            TABLES.replace("COMMAND", &command())
        );
        assert_eq!(markdown(&result(Vec::new()), &opt()), expected);
    }
}
