//! The soak's results as Markdown, the tables of `docs/reliability.md`.

use std::fmt::Write as _;

use super::{SoakOpt, SoakResult, secs, traffic::Kind, watch::Resource};

/// MiB.
const MIB: f64 = 1024.0 * 1024.0;

/// The Markdown of one run.
pub fn markdown(r: &SoakResult, opt: &SoakOpt) -> String {
    let mut out = String::new();
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

    // Traffic.
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

    // Faults.
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

    // Books.
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

    // Curves.
    let _ = writeln!(
        out,
        "\nRSS / allocated (MiB) / descriptors / tasks, least over each minute (the baseline: the median over the baseline window of each 10-second window's least, what a fault's check compares with its last 10 seconds' least; allocated: jemalloc's, what the program holds, least over the baseline window):\n"
    );
    let _ = writeln!(out, "| minute | {} |", r.slot_names.join(" | "));
    let _ = writeln!(out, "| --- |{}", " --- |".repeat(r.slot_names.len()));
    let cell = |v: [Option<f64>; 3], allocated: Option<f64>| match v {
        [Some(rss), Some(fds), tasks] => format!(
            "{:.1} / {} / {fds:.0} / {}",
            rss / MIB,
            allocated.map_or("?".to_owned(), |a| format!("{:.1}", a / MIB)),
            tasks.map_or("?".to_owned(), |t| format!("{t:.0}"))
        ),
        _ => "-".to_owned(),
    };
    let (base_from, base_to) = r.baseline_window;
    let _ = writeln!(
        out,
        "| baseline | {} |",
        r.baseline
            .iter()
            .enumerate()
            .map(|(slot, (_, b))| cell(
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
                cell(
                    Resource::ALL.map(|res| super::watch::least(&r.samples, slot, res, from, to)),
                    super::watch::least_allocated(&r.samples, slot, from, to),
                )
            })
            .collect();
        let _ = writeln!(out, "| {} | {} |", m + 1, cells.join(" | "));
    }

    // Verdict.
    if r.violations.is_empty() {
        let _ = writeln!(out, "\nEvery invariant held.");
    } else {
        let _ = writeln!(out, "\nInvariants that did not hold:\n");
        for v in &r.violations {
            let _ = writeln!(out, "- {v}");
        }
    }
    out
}
