//! The exchanges: each frontend record meets the destination's record of
//! the same exchange (by the id its header carries), which says which
//! agent carried it (the kernel's word: the source address); failing
//! that, its server's audit record of the same dial (by the dial's
//! `random`, or a CONNECT frontend's socket address), which names the
//! agent that answered it. The frontend's record says which server. Every
//! end that is not whole is then excused by a fault on that agent or that
//! server whose window holds the end ([`ends_within`]), or it is a
//! violation.
//!
//! What a fault excuses ([`explains`]):
//!
//! | fault | on the connections of | excuses |
//! | --- | --- | --- |
//! | agent kill -9, TokenReview outage (kills its agent) | that agent | a failed dial, an error, a reset at the destination, a FIN before the request's end (its kernel closes the sockets) |
//! | partition | that agent | a failed dial, an error, a reset |
//! | server kill -9 | that server | a failed dial, an error, a reset |
//! | any other | - | nothing: the stalls and slow peers use connections of their own, rotations and rollouts must lose nothing |
//!
//! An end whose agent no witness names (neither the destination nor its
//! server's audit log: a dial no agent answered, or a killed server's,
//! whose records died with it) is excused by no agent's fault: only by a
//! kill of its own server. A reset at the destination before the
//! request's header (its exchange, so its server, not known) may be put
//! down to the kill of either server.
//!
//! The window: a fault excuses an end that came between its injection
//! (less [`BEFORE`]) and its recovery (plus [`AFTER`]); for a kill, a
//! tunnel's end only if the tunnel was open at the kill (a tunnel that
//! began after the kill ended for another reason). A failed dial needs
//! only its end within the window: the server may route a dial to a dead
//! agent until it sees the stream gone.
//! A byte altered, bytes missing behind a clean end (a CONNECT tunnel cut
//! by a clean end too: the server resets a CONNECT tunnel whose agent or
//! agent stream died, and a killed server's socket ends without TLS's
//! close_notify, so either is an error at the frontend), and an exchange
//! stuck past [`STUCK`] are never excused.

use std::collections::HashMap;

use serde::Serialize;

use crate::observe::{
    Carrier, DialKey, Exchange, Fault, FaultRecord, Frontend, FrontendEnd, Hit, Listener, NodeConn,
    NodeEnd, ObservedRun, Secs,
};

/// An exchange whose end came more than this after its dial started was
/// stuck, however it ended. The longest exchange is a bulk one: 16 MiB at
/// 4 MB/s, about 4 s; a dial may take the 5 s dial timeout. 30 s is three
/// times both on a loaded 2-core machine running debug binaries; the
/// frontends give up at 40 s, the destination after 40 s without progress.
pub const STUCK: f64 = 30.0;

/// A fault's window opens this long before it was injected: the grpc-go
/// frontend's times come from another process's clock, converted.
pub const BEFORE: f64 = 1.0;

/// A fault's window closes this long after its recovery: an end the fault
/// caused reaches its frontend within milliseconds of the dead stream;
/// the rest is scheduling on a loaded machine.
pub const AFTER: f64 = 2.0;

/// How long past a server kill's window a frontend's failed dials through
/// that server are still the kill's, until the frontend's first whole
/// exchange through it: a grpc-go channel whose server died fails its
/// calls at once with the last connection error until its reconnect
/// backoff ends (1 s, then ×1.6 with ±20 % jitter per attempt: 4.2 s after
/// four attempts), which is how kube-apiserver's client behaves too.
pub const RECONNECT: f64 = 8.0;

/// An end that is not whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Ending {
    /// The dial failed.
    DialFailed,
    /// The tunnel said it failed.
    Error,
    /// A CONNECT tunnel ended by a clean end (TLS close_notify and a
    /// FIN), bytes missing: a broken tunnel that looked whole.
    Cut,
    /// A reset at the destination.
    Reset,
    /// A FIN at the destination before the request's last byte.
    Truncated,
    /// Bytes lost or altered without an error, at the frontend.
    Silent,
    /// A request byte altered, at the destination.
    Corrupt,
    /// No end within [`STUCK`] (or the destination's bound).
    Stuck,
}

impl Ending {
    /// How the report says it.
    pub fn name(self) -> &'static str {
        match self {
            Self::DialFailed => "dial failed",
            Self::Error => "ended with an error",
            Self::Cut => "cut by an EOF",
            Self::Reset => "reset at the destination",
            Self::Truncated => "ended by a FIN before the request's last byte",
            Self::Silent => "lost or altered bytes silently",
            Self::Corrupt => "reached the destination altered",
            Self::Stuck => "stuck",
        }
    }

    /// Whether some fault may excuse it.
    pub fn excusable(self) -> bool {
        !matches!(self, Self::Cut | Self::Silent | Self::Corrupt | Self::Stuck)
    }
}

/// Which witness saw an end.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Side {
    /// This frontend.
    Frontend(Frontend),
    /// The destination.
    Node,
}

/// One end that was not whole, and what excused it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Judged {
    /// Who saw it.
    pub side: Side,
    /// What it was.
    pub ending: Ending,
    /// The agent that carried it.
    pub carrier: Carrier,
    /// The server it went through, if known.
    pub server: Option<usize>,
    /// When the exchange started (or the destination accepted it).
    pub from: Secs,
    /// When it ended.
    pub to: Secs,
    /// What its witness was told.
    pub why: String,
    /// The fault that explains it (an index into the run's faults).
    pub excused_by: Option<usize>,
}

impl Judged {
    /// `grpc, ours: ended with an error at 35.2 s (from 34.9 s) on agent-2
    /// through server-0: why`.
    pub fn describe(&self) -> String {
        let who = match self.side {
            Side::Frontend(f) => f.name(),
            Side::Node => "destination",
        };
        let through = self
            .server
            .map_or(String::new(), |s| format!(" through server-{s}"));
        let why = if self.why.is_empty() {
            String::new()
        } else {
            format!(": {}", self.why)
        };
        format!(
            "{who}: {} at {:.1} s (from {:.1} s) on {}{through}{why}",
            self.ending.name(),
            self.to,
            self.from,
            self.carrier.describe()
        )
    }
}

/// Whether `fault` explains `ending` on a connection `carrier` carried
/// through `server`, whenever it happened (see the module's table).
pub fn explains(
    fault: &FaultRecord,
    ending: Ending,
    carrier: Carrier,
    server: Option<usize>,
) -> bool {
    use Ending::{DialFailed, Error, Reset, Truncated};
    if !ending.excusable() {
        return false;
    }
    match (fault.fault, fault.hit) {
        (Fault::AgentKill | Fault::TokenOutage, Hit::Agent(a)) => carrier == Carrier::Slot(a),
        (Fault::Partition, Hit::Agent(a)) => ending != Truncated && carrier == Carrier::Slot(a),
        (Fault::ServerKill, Hit::Server(s)) => {
            matches!(ending, DialFailed | Error | Reset) && server.is_none_or(|server| server == s)
        }
        _ => false,
    }
}

/// Whether `fault`'s window holds an `ending` of an exchange over `[from,
/// to]`: its end within `[started - BEFORE, recovered + AFTER]`, and, for
/// a kill and an end other than a failed dial, the exchange open at the
/// kill.
pub fn ends_within(fault: &FaultRecord, ending: Ending, from: Secs, to: Secs) -> bool {
    let kill = matches!(
        fault.fault,
        Fault::AgentKill | Fault::TokenOutage | Fault::ServerKill
    );
    to >= fault.started - BEFORE
        && to <= fault.recovered + AFTER
        && (!kill || ending == Ending::DialFailed || from <= fault.started + BEFORE)
}

/// The fault that excuses `ending` over `[from, to]`, if any: one that
/// names the carrier or the server before one that takes an agent not
/// witnessed.
pub fn excuse(
    faults: &[FaultRecord],
    ending: Ending,
    carrier: Carrier,
    server: Option<usize>,
    from: Secs,
    to: Secs,
) -> Option<usize> {
    let mut fits = faults
        .iter()
        .enumerate()
        .filter(|(_, f)| ends_within(f, ending, from, to) && explains(f, ending, carrier, server))
        .map(|(i, _)| i);
    let first = fits.next()?;
    let named = |i: &usize| match faults[*i].hit {
        Hit::Agent(a) => carrier == Carrier::Slot(a),
        Hit::Server(s) => server == Some(s),
        Hit::Elsewhere => false,
    };
    if named(&first) {
        return Some(first);
    }
    Some(fits.find(named).unwrap_or(first))
}

/// The kill of `x`'s server that a failed dial of `x` still belongs to
/// after the kill's window: `x` ended after the kill, before its
/// frontend's first whole exchange through that server since the kill,
/// and within [`RECONNECT`] of the window's end (`whole`: the starts of
/// each frontend's whole exchanges through each server, sorted). (Within
/// the window, [`excuse`] has found the kill already.)
pub(crate) fn reconnecting(
    faults: &[FaultRecord],
    ending: Ending,
    x: &Exchange,
    whole: &HashMap<(Frontend, usize), Vec<Secs>>,
) -> Option<usize> {
    if ending != Ending::DialFailed {
        return None;
    }
    let starts = whole
        .get(&(x.frontend, x.server))
        .map_or(&[][..], Vec::as_slice);
    faults.iter().position(|f| {
        let back = starts
            .get(starts.partition_point(|t| *t < f.started))
            .copied()
            .unwrap_or(f64::INFINITY);
        f.fault == Fault::ServerKill
            && f.hit == Hit::Server(x.server)
            && x.ended >= f.started
            && x.ended <= back.min(f.recovered + AFTER + RECONNECT)
    })
}

/// The most a server's record of a dial may start after, or before, its
/// frontend's record of it and still be the same dial: a dial reaches its
/// server within a TLS handshake; a CONNECT socket's port comes back to
/// another connection only after a cycle of the ephemeral range.
pub const SAME_DIAL: f64 = 10.0;

/// The agent `run`'s audit records name for `x`'s dial: the record of
/// its server with its key that started nearest to it, within
/// [`SAME_DIAL`].
pub(crate) fn audited_agent(
    audited: &HashMap<(usize, &DialKey), Vec<(Secs, Carrier)>>,
    x: &Exchange,
) -> Option<Carrier> {
    let records = audited.get(&(x.server, x.dial.as_ref()?))?;
    records
        .iter()
        .filter(|(at, _)| (at - x.started).abs() <= SAME_DIAL)
        .min_by(|(a, _), (b, _)| (a - x.started).abs().total_cmp(&(b - x.started).abs()))
        .map(|(_, carrier)| *carrier)
}

/// One frontend's exchanges, counted from their records.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct FrontendTally {
    /// Records.
    pub recorded: u64,
    /// Every byte, then a clean end.
    pub ok: u64,
    /// Dials that failed.
    pub dial_failed: u64,
    /// Tunnels that said they failed.
    pub errors: u64,
    /// CONNECT tunnels cut by an EOF.
    pub cut: u64,
    /// Lost or altered silently.
    pub silent: u64,
    /// Stuck: given up on, or ended after [`STUCK`].
    pub stuck: u64,
    /// Of the failed dials, errors and cuts, those a fault excused.
    pub excused: u64,
    /// Dials slower than the plan's dial limit.
    pub late: u64,
    /// The slowest dial, seconds.
    pub slowest_dial: f64,
}

/// The destination's connections, counted from their records.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct NodeTally {
    /// Accepted, every listener.
    pub accepted: u64,
    /// Accepted by the checked destination.
    pub exchanges: u64,
    /// Complete.
    pub complete: u64,
    /// Closed before a request began.
    pub unused: u64,
    /// Reset.
    pub reset: u64,
    /// Ended by a FIN before the request's last byte.
    pub truncated: u64,
    /// Altered.
    pub corrupt: u64,
    /// Stuck, or still open at the end.
    pub stuck: u64,
    /// Of the resets and truncations, those a fault excused.
    pub excused: u64,
    /// From an address no agent has.
    pub unknown: u64,
}

/// The exchanges judged.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Joined {
    /// Per frontend ([`Frontend::ALL`] order).
    pub frontends: Vec<(Frontend, FrontendTally)>,
    /// The destination.
    pub node: NodeTally,
    /// Every end that was not whole, excused or not, in time order.
    pub endings: Vec<Judged>,
    /// Exchanges whole at the frontend.
    pub ok: u64,
    /// Of them, those the destination saw complete (the same id).
    pub ok_complete: u64,
}

impl Joined {
    /// The ends no fault explains, in time order.
    pub fn unexcused(&self) -> Vec<&Judged> {
        self.endings
            .iter()
            .filter(|e| e.excused_by.is_none())
            .collect()
    }
}

/// The frontend end's class, the exchange's stuck or not.
fn frontend_ending(x: &Exchange) -> Option<Ending> {
    if x.end == FrontendEnd::Stuck || x.ended - x.started > STUCK {
        return Some(Ending::Stuck);
    }
    match x.end {
        FrontendEnd::Ok => None,
        FrontendEnd::DialFailed => Some(Ending::DialFailed),
        FrontendEnd::Error => Some(Ending::Error),
        FrontendEnd::Cut => Some(Ending::Cut),
        FrontendEnd::Silent => Some(Ending::Silent),
        FrontendEnd::Stuck => Some(Ending::Stuck),
    }
}

/// The destination end's class.
fn node_ending(n: &NodeConn) -> Option<Ending> {
    match n.end {
        NodeEnd::Complete | NodeEnd::Unused => None,
        NodeEnd::Reset => Some(Ending::Reset),
        NodeEnd::Truncated => Some(Ending::Truncated),
        NodeEnd::Corrupt => Some(Ending::Corrupt),
        NodeEnd::Stuck | NodeEnd::Open => Some(Ending::Stuck),
    }
}

/// Joins the run's frontend and destination records and judges every end.
pub fn join(run: &ObservedRun, dial_limit: f64) -> Joined {
    let checked = |n: &&NodeConn| n.listener == Listener::Exchanges;
    let node_by_id: HashMap<u64, &NodeConn> = run
        .node
        .iter()
        .filter(checked)
        .filter_map(|n| Some((n.id?, n)))
        .collect();
    let mut joined = Joined {
        frontends: Frontend::ALL
            .iter()
            .map(|f| (*f, FrontendTally::default()))
            .collect(),
        ..Joined::default()
    };
    join_frontends(run, &node_by_id, dial_limit, &mut joined);
    join_node(run, &mut joined);
    joined.endings.sort_by(|a, b| a.to.total_cmp(&b.to));
    joined
}

/// Each frontend record, joined with the destination's record of the
/// same exchange (by its seed), tallied and, if not whole, judged.
fn join_frontends(
    run: &ObservedRun,
    node_by_id: &HashMap<u64, &NodeConn>,
    dial_limit: f64,
    joined: &mut Joined,
) {
    let mut audited: HashMap<(usize, &DialKey), Vec<(Secs, Carrier)>> = HashMap::new();
    for a in &run.audited {
        audited
            .entry((a.server, &a.key))
            .or_default()
            .push((a.started, a.agent));
    }
    let mut whole: HashMap<(Frontend, usize), Vec<Secs>> = HashMap::new();
    for x in run.exchanges.iter().filter(|x| x.end == FrontendEnd::Ok) {
        whole
            .entry((x.frontend, x.server))
            .or_default()
            .push(x.started);
    }
    for starts in whole.values_mut() {
        starts.sort_by(f64::total_cmp);
    }
    for x in &run.exchanges {
        let seen = node_by_id.get(&x.id).copied();
        let carrier = seen
            .map(|n| n.carrier)
            .or_else(|| audited_agent(&audited, x))
            .unwrap_or(Carrier::Unknown);
        let ending = frontend_ending(x);
        let excused_by = ending.and_then(|e| {
            excuse(&run.faults, e, carrier, Some(x.server), x.started, x.ended)
                .or_else(|| reconnecting(&run.faults, e, x, &whole))
        });
        let Some(tally) = joined
            .frontends
            .iter_mut()
            .find(|(f, _)| *f == x.frontend)
            .map(|(_, t)| t)
        else {
            continue;
        };
        tally.recorded += 1;
        if let Some(dial) = x.dial_s {
            tally.slowest_dial = tally.slowest_dial.max(dial);
            tally.late += u64::from(dial > dial_limit);
        }
        match ending {
            None => {
                tally.ok += 1;
                joined.ok += 1;
                if seen.is_some_and(|n| n.end == NodeEnd::Complete) {
                    joined.ok_complete += 1;
                }
            }
            Some(e) => {
                match e {
                    Ending::DialFailed => tally.dial_failed += 1,
                    Ending::Error => tally.errors += 1,
                    Ending::Cut => tally.cut += 1,
                    Ending::Silent => tally.silent += 1,
                    _ => tally.stuck += 1,
                }
                tally.excused += u64::from(excused_by.is_some());
                joined.endings.push(Judged {
                    side: Side::Frontend(x.frontend),
                    ending: e,
                    carrier,
                    server: Some(x.server),
                    from: x.started,
                    to: x.ended,
                    why: x.why.clone().unwrap_or_default(),
                    excused_by,
                });
            }
        }
    }
}

/// Each destination record, tallied and, if not whole, judged (its
/// server from the frontend record of the same exchange).
fn join_node(run: &ObservedRun, joined: &mut Joined) {
    let server_by_id: HashMap<u64, usize> =
        run.exchanges.iter().map(|x| (x.id, x.server)).collect();
    for n in &run.node {
        let t = &mut joined.node;
        t.accepted += 1;
        t.unknown += u64::from(n.carrier == Carrier::Unknown);
        if n.listener != Listener::Exchanges {
            continue;
        }
        t.exchanges += 1;
        match n.end {
            NodeEnd::Complete => t.complete += 1,
            NodeEnd::Unused => t.unused += 1,
            NodeEnd::Reset => t.reset += 1,
            NodeEnd::Truncated => t.truncated += 1,
            NodeEnd::Corrupt => t.corrupt += 1,
            NodeEnd::Stuck | NodeEnd::Open => t.stuck += 1,
        }
        let Some(ending) = node_ending(n) else {
            continue;
        };
        let server = n.id.and_then(|id| server_by_id.get(&id).copied());
        let excused_by = excuse(&run.faults, ending, n.carrier, server, n.accepted, n.ended);
        t.excused += u64::from(excused_by.is_some());
        joined.endings.push(Judged {
            side: Side::Node,
            ending,
            carrier: n.carrier,
            server,
            from: n.accepted,
            to: n.ended,
            why: n.id.map_or("before its header".to_owned(), |id| {
                format!("exchange {id:x}")
            }),
            excused_by,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::{Ending, excuse, explains};
    use crate::observe::{Carrier, Fault, FaultRecord, Hit};

    fn fault(fault: Fault, hit: Hit, from: f64, to: f64) -> FaultRecord {
        let mut f = FaultRecord::new(fault, hit, from);
        f.recovered = to;
        f
    }

    #[test]
    fn a_kill_excuses_its_own_agent_only() {
        let kill = fault(Fault::AgentKill, Hit::Agent(1), 10.0, 20.0);
        for e in [
            Ending::DialFailed,
            Ending::Error,
            Ending::Reset,
            Ending::Truncated,
        ] {
            assert!(explains(&kill, e, Carrier::Slot(1), Some(0)), "{e:?}");
            assert!(!explains(&kill, e, Carrier::Slot(2), Some(0)), "{e:?}");
            assert!(!explains(&kill, e, Carrier::Probe, Some(0)), "{e:?}");
        }
        for e in [Ending::Cut, Ending::Silent, Ending::Corrupt, Ending::Stuck] {
            assert!(!explains(&kill, e, Carrier::Slot(1), Some(0)), "{e:?}");
        }
        // An agent no witness names: no agent's fault excuses it.
        for e in [Ending::DialFailed, Ending::Error, Ending::Reset] {
            assert!(!explains(&kill, e, Carrier::Unknown, Some(0)), "{e:?}");
        }
        let cut = fault(Fault::Partition, Hit::Agent(1), 10.0, 20.0);
        assert!(!explains(
            &cut,
            Ending::DialFailed,
            Carrier::Unknown,
            Some(0)
        ));
        let server = fault(Fault::ServerKill, Hit::Server(0), 10.0, 20.0);
        assert!(explains(
            &server,
            Ending::DialFailed,
            Carrier::Unknown,
            Some(0)
        ));
    }

    #[test]
    fn a_partition_or_a_server_kill_excuses_no_fin() {
        let cut = fault(Fault::Partition, Hit::Agent(0), 10.0, 20.0);
        assert!(explains(&cut, Ending::Reset, Carrier::Slot(0), None));
        assert!(!explains(&cut, Ending::Truncated, Carrier::Slot(0), None));
        let server = fault(Fault::ServerKill, Hit::Server(1), 10.0, 20.0);
        assert!(explains(&server, Ending::Error, Carrier::Slot(2), Some(1)));
        assert!(!explains(&server, Ending::Error, Carrier::Slot(2), Some(0)));
        assert!(!explains(
            &server,
            Ending::Truncated,
            Carrier::Slot(2),
            Some(1)
        ));
        // Before its header, the destination cannot tell the server.
        assert!(explains(&server, Ending::Reset, Carrier::Slot(2), None));
    }

    #[test]
    fn faults_that_hit_nothing_of_the_traffic_excuse_nothing() {
        for f in [
            Fault::FrontendStall,
            Fault::DestinationStall,
            Fault::Slowloris,
            Fault::CertRotation,
            Fault::CaRotation,
            Fault::Rollout,
        ] {
            let hit = if f == Fault::Rollout {
                Hit::Agent(1)
            } else {
                Hit::Elsewhere
            };
            let r = fault(f, hit, 10.0, 20.0);
            assert!(
                !explains(&r, Ending::Error, Carrier::Slot(1), Some(0)),
                "{f:?}"
            );
            assert!(
                !explains(&r, Ending::DialFailed, Carrier::Unknown, Some(0)),
                "{f:?}"
            );
        }
    }

    #[test]
    fn the_window_holds_the_end_and_a_kill_the_tunnels_start() {
        let faults = [
            fault(Fault::Partition, Hit::Agent(0), 10.0, 20.0),
            fault(Fault::ServerKill, Hit::Server(0), 15.0, 18.0),
        ];
        let (e, on_0) = (Ending::DialFailed, Carrier::Slot(0));
        // The end within [started - BEFORE, recovered + AFTER].
        assert_eq!(excuse(&faults, e, on_0, Some(1), 8.0, 9.5), Some(0));
        assert_eq!(excuse(&faults, e, on_0, Some(1), 8.0, 8.9), None);
        assert_eq!(excuse(&faults, e, on_0, Some(1), 21.9, 21.95), Some(0));
        assert_eq!(excuse(&faults, e, on_0, Some(1), 21.0, 22.1), None);
        // An exchange that began before the fault and ended after its
        // window: not by overlap any more.
        assert_eq!(
            excuse(&faults, Ending::Error, on_0, Some(1), 5.0, 30.0),
            None
        );
        // Both fit; the one that names the server wins.
        assert_eq!(
            excuse(&faults, e, Carrier::Unknown, Some(0), 16.0, 17.0),
            Some(1)
        );
        assert_eq!(excuse(&faults, e, on_0, Some(0), 16.0, 17.0), Some(0));
        // A kill: a tunnel's end only if it was open at the kill; a
        // failed dial whenever it ended in the window.
        let kill = [fault(Fault::AgentKill, Hit::Agent(1), 10.0, 20.0)];
        let on_1 = Carrier::Slot(1);
        assert_eq!(excuse(&kill, Ending::Error, on_1, None, 9.0, 12.0), Some(0));
        assert_eq!(excuse(&kill, Ending::Error, on_1, None, 12.0, 13.0), None);
        assert_eq!(
            excuse(&kill, Ending::DialFailed, on_1, None, 12.0, 13.0),
            Some(0)
        );
    }
}
