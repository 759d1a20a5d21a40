//! The books: each process's own (opened = closed + open, from its
//! `/metrics`), for every process that lived, and the witnesses set
//! against each other: what the destination accepted from each agent's
//! address against that agent's dials, the servers' dials against both.
//!
//! A process's counters die with it. A killed process is read just before
//! its kill, a draining one every tenth of a second until it exits, but
//! what it did between its last reading and its end is lost: its *tail*,
//! bounded by what the destination accepted from it (its address, or its
//! server's exchanges) in that time, widened by [`ACCEPT_SLACK`] on both
//! sides. (Another process of the same slot in that time, a rollout's
//! successor, only widens it.)
//! The bounds below are computed from those figures, never set by hand.

use serde::Serialize;

use crate::{
    exchanges::Joined,
    observe::{Life, LifeEnd, Listener, ObservedRun, Role, Seat, Secs},
};

/// How far apart a scrape's counters may be while traffic runs: a
/// `/metrics` answer reads its counters one after the other, and
/// connections open and close in between. The soak opens about 200
/// connections a second; 32 is what a scrape delayed by a tenth of a
/// second on a loaded machine might see, and 16 times the largest gap the
/// hours in `docs/reliability.md` saw. A leak (a close not counted) grows
/// past it within the run, and the books of every process still running
/// at the end are checked exactly.
pub const DRIFT: f64 = 32.0;

/// A process that lived this long must have opened a connection (the
/// traffic dials several a second through every agent and server); a
/// shorter life (a probe agent, an agent refused during an outage) may not.
pub const CARRIES_AFTER: f64 = 20.0;

/// How far apart the destination's accept of a connection and the dialing
/// process's count of it may be: the accept loop runs in the soak behind
/// its other tasks, the count in the process behind its own. A killed
/// process's tail reaches this far before its last reading and after its
/// death.
pub const ACCEPT_SLACK: f64 = 1.0;

/// One process's books, as the report shows them.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LifeBooks {
    /// Its name.
    pub name: String,
    /// Where it ran.
    pub seat: Seat,
    /// Its pid.
    pub pid: u32,
    /// Lived from.
    pub born: Secs,
    /// Until.
    pub died: Secs,
    /// How it ended.
    pub end: LifeEnd,
    /// Readings of its books.
    pub readings: usize,
    /// The last reading.
    pub last: Option<crate::observe::Books>,
    /// Connections it cut after it was told to drain: its last reading's
    /// cut less that of its last reading before the drain (all it cut,
    /// for one with no drain recorded).
    pub cut_draining: f64,
    /// When the last reading was asked for.
    pub last_t: Option<Secs>,
    /// The largest |opened - closed - open| of any reading.
    pub largest_gap: f64,
    /// What the destination accepted from it after its last reading,
    /// before its end (each widened by [`ACCEPT_SLACK`]), for a process
    /// that ended: what its books may have missed.
    pub tail: u64,
    /// For a process recorded running whose seat's next process started
    /// at this time: it ended then at the latest, and nobody recorded
    /// how (the driver records every kill and drain it does), so it
    /// crashed.
    pub vanished: Option<Secs>,
}

impl LifeBooks {
    /// Whether it lived long enough to have carried traffic.
    pub fn must_carry(&self) -> bool {
        self.died - self.born >= CARRIES_AFTER
    }
}

/// Two witnesses of the same connections set against each other: `left -
/// right` must lie within `[low, high]`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Witness {
    /// What is compared.
    pub name: String,
    /// The first witness, in words.
    pub left_what: String,
    /// Its figure.
    pub left: f64,
    /// The second witness, in words.
    pub right_what: String,
    /// Its figure.
    pub right: f64,
    /// The least `left - right` may be.
    pub low: f64,
    /// The most.
    pub high: f64,
    /// Where the bounds come from.
    pub bounds: String,
}

impl Witness {
    /// `left - right`.
    pub fn gap(&self) -> f64 {
        self.left - self.right
    }

    /// Whether the gap is within its bounds.
    pub fn holds(&self) -> bool {
        self.gap() >= self.low && self.gap() <= self.high
    }
}

/// Connections the destination accepted over `(after, until]` that
/// `carried` says a process carried.
fn accepted_in(
    run: &ObservedRun,
    (after, until): (Secs, Secs),
    carried: &dyn Fn(&crate::observe::NodeConn) -> bool,
) -> u64 {
    run.node
        .iter()
        .filter(|n| n.accepted > after && n.accepted <= until && carried(n))
        .count() as u64
}

/// Whether the destination's connection `n` may have been carried through
/// server `s`: its exchange went through `s`, or it cannot be told.
fn through_server(
    run_server: &std::collections::HashMap<u64, usize>,
    n: &crate::observe::NodeConn,
    s: usize,
) -> bool {
    match n.id.and_then(|id| run_server.get(&id)) {
        Some(server) => *server == s,
        None => true,
    }
}

/// Every process's books.
pub fn lives(run: &ObservedRun) -> Vec<LifeBooks> {
    let server_by_id: std::collections::HashMap<u64, usize> =
        run.exchanges.iter().map(|x| (x.id, x.server)).collect();
    run.lives
        .iter()
        .map(|l| life_books(run, &server_by_id, l, vanished(run, l)))
        .collect()
}

/// When `l`'s seat's next process started, if `l` was still recorded
/// running then: a process that ended with no end recorded. Probes are
/// not one seat's successive processes, and are left out.
fn vanished(run: &ObservedRun, l: &Life) -> Option<Secs> {
    if l.end != LifeEnd::Running || l.seat == Seat::Probe {
        return None;
    }
    run.lives
        .iter()
        .filter(|next| next.seat == l.seat && next.born > l.born)
        .map(|next| next.born)
        .min_by(f64::total_cmp)
}

fn life_books(
    run: &ObservedRun,
    server_by_id: &std::collections::HashMap<u64, usize>,
    l: &Life,
    vanished: Option<Secs>,
) -> LifeBooks {
    let last = l.books.last();
    let died = vanished.unwrap_or(l.died);
    let tail = if l.end != LifeEnd::Running || vanished.is_some() {
        // From a little before its last reading: a dial the destination
        // accepted just before it may have been counted just after.
        let after = last.map_or(l.born, |s| s.t) - ACCEPT_SLACK;
        let window = (after, died + ACCEPT_SLACK);
        match l.seat {
            Seat::Server(s) => accepted_in(run, window, &|n| through_server(server_by_id, n, s)),
            Seat::Agent(_) | Seat::Probe => {
                let carrier = l.seat.carrier();
                accepted_in(run, window, &|n| Some(n.carrier) == carrier)
            }
        }
    } else {
        0
    };
    LifeBooks {
        name: l.name.clone(),
        seat: l.seat,
        pid: l.pid,
        born: l.born,
        died,
        end: l.end,
        readings: l.books.len(),
        last: last.map(|s| s.books),
        cut_draining: cut_draining(l),
        last_t: last.map(|s| s.t),
        largest_gap: l
            .books
            .iter()
            .map(|s| s.books.unaccounted().abs())
            .fold(0.0, f64::max),
        tail,
        vanished,
    }
}

/// What `l` cut after it was told to drain; for one with no drain
/// recorded, all it cut.
fn cut_draining(l: &Life) -> f64 {
    let before = l.drained.map_or(0.0, |drained| {
        l.books
            .iter()
            .rev()
            .find(|s| s.t <= drained)
            .map_or(0.0, |s| s.books.cut)
    });
    l.books.last().map_or(0.0, |s| s.books.cut) - before
}

/// The sum of the last `opened` of every process that `pick` takes.
fn opened(books: &[LifeBooks], pick: &dyn Fn(&LifeBooks) -> bool) -> f64 {
    books
        .iter()
        .filter(|b| pick(b))
        .filter_map(|b| b.last)
        .map(|b| b.opened)
        .sum::<f64>()
        + 0.0
}

/// The sum of the tails of every process that `pick` takes.
fn tails(books: &[LifeBooks], pick: &dyn Fn(&LifeBooks) -> bool) -> f64 {
    books
        .iter()
        .filter(|b| pick(b))
        .map(|b| b.tail as f64)
        .sum::<f64>()
        + 0.0
}

/// Each agent slot (and the probes): what the destination accepted from
/// its address against its processes' dials.
fn slot_witnesses(run: &ObservedRun, books: &[LifeBooks]) -> Vec<Witness> {
    let mut out = Vec::new();
    let mut seats: Vec<Seat> = (0..run.plan.agents).map(Seat::Agent).collect();
    seats.push(Seat::Probe);
    for seat in seats {
        let carrier = seat.carrier();
        let accepted = run
            .node
            .iter()
            .filter(|n| Some(n.carrier) == carrier)
            .count() as f64;
        let mine = |b: &LifeBooks| b.seat == seat;
        let (name, address, counted) = match seat {
            Seat::Agent(n) => (
                format!("agent-{n}"),
                format!("agent-{n}'s address"),
                format!("dials agent-{n}'s processes counted"),
            ),
            _ => (
                "probe agents".to_owned(),
                "the host's address (probe agents)".to_owned(),
                "dials the probe agents counted".to_owned(),
            ),
        };
        out.push(Witness {
            name: format!("{name}: the destination saw every dial its processes counted"),
            left_what: format!("accepted from {address}"),
            left: accepted,
            right_what: counted,
            right: opened(books, &mine),
            low: 0.0,
            high: tails(books, &mine),
            bounds: "0 to the ended processes' tails".to_owned(),
        });
    }
    out
}

/// The witnesses, each with its bounds.
pub fn witnesses(run: &ObservedRun, joined: &Joined, books: &[LifeBooks]) -> Vec<Witness> {
    let mut out = vec![Witness {
        name: "every exchange whole at its frontend was complete at the destination".to_owned(),
        left_what: "whole at the frontend".to_owned(),
        left: joined.ok as f64,
        right_what: "of them, complete at the destination (same id)".to_owned(),
        right: joined.ok_complete as f64,
        low: 0.0,
        high: 0.0,
        bounds: "exact".to_owned(),
    }];
    out.extend(slot_witnesses(run, books));
    out.push(Witness {
        name: "the destination knew every address it was dialed from".to_owned(),
        left_what: "accepted from no agent's address".to_owned(),
        left: joined.node.unknown as f64,
        right_what: "-".to_owned(),
        right: 0.0,
        low: 0.0,
        high: 0.0,
        bounds: "exact".to_owned(),
    });
    let agent = |b: &LifeBooks| b.seat.role() == Role::Agent;
    let server = |b: &LifeBooks| b.seat.role() == Role::Server;
    // Dials an agent made that its server did not count: the server gave
    // up on the dial (its timeout, its frontend gone) and closed it before
    // any request; the destination saw those close unused.
    let unjoined = run
        .node
        .iter()
        .filter(|n| n.listener == Listener::Exchanges && n.id.is_none())
        .count() as f64;
    let server_tails = tails(books, &server);
    out.push(Witness {
        name: "the servers counted no dial the destination did not accept".to_owned(),
        left_what: "accepted by the destination".to_owned(),
        left: joined.node.accepted as f64,
        right_what: "dials the servers counted".to_owned(),
        right: opened(books, &server),
        low: 0.0,
        high: server_tails + unjoined,
        bounds: format!(
            "0 to the killed servers' tails ({server_tails:.0}) + connections closed before a request ({unjoined:.0})"
        ),
    });
    let agent_tails = tails(books, &agent);
    out.push(Witness {
        name: "the agents' dials and the servers' agree".to_owned(),
        left_what: "dials the agents counted".to_owned(),
        left: opened(books, &agent),
        right_what: "dials the servers counted".to_owned(),
        right: opened(books, &server),
        low: 0.0 - agent_tails,
        high: server_tails + unjoined,
        bounds: format!(
            "minus the killed agents' tails ({agent_tails:.0}) to the killed servers' tails ({server_tails:.0}) + connections closed before a request ({unjoined:.0})"
        ),
    });
    out
}
