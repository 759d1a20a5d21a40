//! What is measured (metric definitions), the per-repetition values, and the
//! results as a text table and as JSON.

use std::fmt::Write as _;

use serde::Serialize;

use crate::{probe::Machine, stats};

/// Where the bench's connections go.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Route {
    /// Client → backend over plain TCP.
    Direct,
    /// Client → UDS → proxy-server (gRPC) → TLS → proxy-agent → backend.
    Grpc,
    /// Client → UDS → proxy-server (HTTP-CONNECT) → TLS → proxy-agent → backend.
    HttpConnect,
}

impl Route {
    /// All routes, in column order.
    pub const ALL: [Self; 3] = [Self::Direct, Self::Grpc, Self::HttpConnect];

    /// Column index.
    pub fn index(self) -> usize {
        self as usize
    }

    /// The column heading.
    pub fn name(self) -> &'static str {
        match self {
            Self::Direct => "direct",
            Self::Grpc => "grpc",
            Self::HttpConnect => "http-connect",
        }
    }
}

/// One measured quantity.
#[derive(Debug)]
pub struct Def {
    /// The scenario it belongs to.
    pub scenario: &'static str,
    /// What it is.
    pub name: &'static str,
    /// Its unit.
    pub unit: &'static str,
    /// Whether to show the ratio to direct (throughputs).
    pub ratio: bool,
}

impl Def {
    /// Whether `other` is this quantity: the same scenario and name (two
    /// scenarios may both have, say, "failed dials").
    fn is(&self, other: &Self) -> bool {
        self.scenario == other.scenario && self.name == other.name
    }
}

/// Shorthand for the definitions below.
const fn def(scenario: &'static str, name: &'static str, unit: &'static str, ratio: bool) -> Def {
    Def {
        scenario,
        name,
        unit,
        ratio,
    }
}

/// Single stream, backend → client.
pub const BULK_DOWN: Def = def("bulk", "1 stream down", "MB/s", true);
/// Single stream, client → backend.
pub const BULK_UP: Def = def("bulk", "1 stream up", "MB/s", true);
/// CPU of server + agent per GiB during bulk down.
pub const CPU_DOWN: Def = def("cpu", "server+agent, bulk down", "s/GiB", false);
/// CPU of server + agent per GiB during bulk up.
pub const CPU_UP: Def = def("cpu", "server+agent, bulk up", "s/GiB", false);
/// Single stream down, grpc-go client (kube-apiserver's library).
pub const BULK_DOWN_GO: Def = def("bulk", "1 stream down, grpc-go", "MB/s", true);
/// Single stream up, grpc-go client.
pub const BULK_UP_GO: Def = def("bulk", "1 stream up, grpc-go", "MB/s", true);
/// CPU per GiB during bulk down with the grpc-go client.
pub const CPU_DOWN_GO: Def = def("cpu", "server+agent, down, grpc-go", "s/GiB", false);
/// CPU per GiB during bulk up with the grpc-go client.
pub const CPU_UP_GO: Def = def("cpu", "server+agent, up, grpc-go", "s/GiB", false);
/// The server's share of [`CPU_DOWN`].
pub const CPU_DOWN_SERVER: Def = def("cpu", "server, bulk down", "s/GiB", false);
/// The agent's share of [`CPU_DOWN`].
pub const CPU_DOWN_AGENT: Def = def("cpu", "agent, bulk down", "s/GiB", false);
/// The server's share of [`CPU_UP`].
pub const CPU_UP_SERVER: Def = def("cpu", "server, bulk up", "s/GiB", false);
/// The agent's share of [`CPU_UP`].
pub const CPU_UP_AGENT: Def = def("cpu", "agent, bulk up", "s/GiB", false);
/// The server's share of [`CPU_DOWN_GO`].
pub const CPU_DOWN_SERVER_GO: Def = def("cpu", "server, down, grpc-go", "s/GiB", false);
/// The agent's share of [`CPU_DOWN_GO`].
pub const CPU_DOWN_AGENT_GO: Def = def("cpu", "agent, down, grpc-go", "s/GiB", false);
/// The server's share of [`CPU_UP_GO`].
pub const CPU_UP_SERVER_GO: Def = def("cpu", "server, up, grpc-go", "s/GiB", false);
/// The agent's share of [`CPU_UP_GO`].
pub const CPU_UP_AGENT_GO: Def = def("cpu", "agent, up, grpc-go", "s/GiB", false);
/// Context switches of the server per GiB of [`CPU_DOWN`]'s run.
pub const SWITCHES_DOWN_SERVER: Def = def("cpu", "server switches, bulk down", "/GiB", false);
/// Context switches of the agent per GiB of [`CPU_DOWN`]'s run.
pub const SWITCHES_DOWN_AGENT: Def = def("cpu", "agent switches, bulk down", "/GiB", false);
/// Context switches of the server per GiB of [`CPU_UP`]'s run.
pub const SWITCHES_UP_SERVER: Def = def("cpu", "server switches, bulk up", "/GiB", false);
/// Context switches of the agent per GiB of [`CPU_UP`]'s run.
pub const SWITCHES_UP_AGENT: Def = def("cpu", "agent switches, bulk up", "/GiB", false);
/// Context switches of the server per GiB of [`CPU_DOWN_GO`]'s run.
pub const SWITCHES_DOWN_SERVER_GO: Def =
    def("cpu", "server switches, down, grpc-go", "/GiB", false);
/// Context switches of the agent per GiB of [`CPU_DOWN_GO`]'s run.
pub const SWITCHES_DOWN_AGENT_GO: Def = def("cpu", "agent switches, down, grpc-go", "/GiB", false);
/// Context switches of the server per GiB of [`CPU_UP_GO`]'s run.
pub const SWITCHES_UP_SERVER_GO: Def = def("cpu", "server switches, up, grpc-go", "/GiB", false);
/// Context switches of the agent per GiB of [`CPU_UP_GO`]'s run.
pub const SWITCHES_UP_AGENT_GO: Def = def("cpu", "agent switches, up, grpc-go", "/GiB", false);
/// Aggregate of the parallel streams.
pub const PARALLEL_RATE: Def = def("parallel", "16 streams down, total", "MB/s", true);
/// Jain's index over the parallel streams.
pub const PARALLEL_FAIRNESS: Def = def("parallel", "Jain fairness", "0..1", false);
/// Bulk alone, in the head-of-line scenario.
pub const HOL_SOLO: Def = def("hol", "bulk alone", "MB/s", false);
/// Bulk next to a stalled connection.
pub const HOL_STALLED: Def = def("hol", "bulk next to stalled", "MB/s", false);
/// Bulk next to a stalled connection, relative to alone.
pub const HOL_RATIO: Def = def("hol", "next to stalled / alone", "ratio", false);
/// The server's gauge of buffered bytes while the stalled one is open.
pub const HOL_BUFFERED: Def = def("hol", "server max buffered", "bytes", false);
/// Ping-pong median.
pub const PING_P50: Def = def("pingpong", "64 B round trip p50", "us", false);
/// Ping-pong 99th percentile.
pub const PING_P99: Def = def("pingpong", "64 B round trip p99", "us", false);
/// Ping-pong median minus direct's.
pub const PING_ADDED_P50: Def = def("pingpong", "added p50 (mode - direct)", "us", false);
/// Ping-pong p99 minus direct's.
pub const PING_ADDED_P99: Def = def("pingpong", "added p99 (mode - direct)", "us", false);
/// Dial rate, one at a time.
pub const DIAL1_RATE: Def = def("dial", "c=1 rate", "dials/s", true);
/// Dial + exchange latency median, one at a time.
pub const DIAL1_P50: Def = def("dial", "c=1 dial+1KiB exchange p50", "us", false);
/// Dial + exchange latency p99, one at a time.
pub const DIAL1_P99: Def = def("dial", "c=1 dial+1KiB exchange p99", "us", false);
/// Dial rate, eight at a time.
pub const DIAL8_RATE: Def = def("dial", "c=8 rate", "dials/s", true);
/// Dial + exchange latency median, eight at a time.
pub const DIAL8_P50: Def = def("dial", "c=8 dial+1KiB exchange p50", "us", false);
/// Dial + exchange latency p99, eight at a time.
pub const DIAL8_P99: Def = def("dial", "c=8 dial+1KiB exchange p99", "us", false);
/// Dial rate, one at a time, grpc-go client.
pub const DIAL1_RATE_GO: Def = def("dial", "c=1 rate, grpc-go", "dials/s", true);
/// Dial + exchange latency median, one at a time, grpc-go client.
pub const DIAL1_P50_GO: Def = def("dial", "c=1 p50, grpc-go", "us", false);
/// Dial + exchange latency p99, one at a time, grpc-go client.
pub const DIAL1_P99_GO: Def = def("dial", "c=1 p99, grpc-go", "us", false);
/// Dial rate, eight at a time, grpc-go client.
pub const DIAL8_RATE_GO: Def = def("dial", "c=8 rate, grpc-go", "dials/s", true);
/// Dial + exchange latency median, eight at a time, grpc-go client.
pub const DIAL8_P50_GO: Def = def("dial", "c=8 p50, grpc-go", "us", false);
/// Dial + exchange latency p99, eight at a time, grpc-go client.
pub const DIAL8_P99_GO: Def = def("dial", "c=8 p99, grpc-go", "us", false);
/// Server CPU per single-use tunnel, eight at a time, our client.
pub const DIAL8_SERVER_US: Def = def("dial", "c=8 server CPU per tunnel", "us", false);
/// Agent CPU per single-use tunnel, eight at a time, our client.
pub const DIAL8_AGENT_US: Def = def("dial", "c=8 agent CPU per tunnel", "us", false);
/// Server CPU per single-use tunnel, eight at a time, grpc-go client.
pub const DIAL8_SERVER_US_GO: Def = def("dial", "c=8 server CPU per tunnel, grpc-go", "us", false);
/// Agent CPU per single-use tunnel, eight at a time, grpc-go client.
pub const DIAL8_AGENT_US_GO: Def = def("dial", "c=8 agent CPU per tunnel, grpc-go", "us", false);
/// Dial rate, one at a time, grpc-go's reusable tunnel (one connection).
pub const DIAL1_RATE_REUSE: Def = def("dial", "c=1 rate, grpc-go reused conn", "dials/s", true);
/// Dial rate, eight at a time, grpc-go's reusable tunnel.
pub const DIAL8_RATE_REUSE: Def = def("dial", "c=8 rate, grpc-go reused conn", "dials/s", true);
/// Dial + exchange latency median, eight at a time, reusable tunnel.
pub const DIAL8_P50_REUSE: Def = def("dial", "c=8 p50, grpc-go reused conn", "us", false);
/// Dial + exchange latency p99, eight at a time, reusable tunnel.
pub const DIAL8_P99_REUSE: Def = def("dial", "c=8 p99, grpc-go reused conn", "us", false);
/// Server CPU per dial on the reusable tunnel, eight at a time.
pub const DIAL8_SERVER_US_REUSE: Def =
    def("dial", "c=8 server CPU per dial, reused conn", "us", false);
/// Agent CPU per dial on the reusable tunnel, eight at a time.
pub const DIAL8_AGENT_US_REUSE: Def =
    def("dial", "c=8 agent CPU per dial, reused conn", "us", false);
/// Failed dials or exchanges (both concurrencies).
pub const DIAL_ERRORS: Def = def("dial", "errors", "count", false);
/// Tunnels held open on one grpc-go connection (streams scenario).
pub const STREAMS_OPEN: Def = def(
    "streams",
    "tunnels open on one grpc-go conn",
    "count",
    false,
);
/// Time to open them (each echoing 1 KiB), 64 at a time.
pub const STREAMS_OPEN_TIME: Def = def("streams", "time to open them", "s", false);
/// Server RSS per open stream of that connection.
pub const STREAMS_SERVER_KIB: Def = def("streams", "server RSS per open stream", "KiB", false);
/// Agent RSS per open tunnel of that connection.
pub const STREAMS_AGENT_KIB: Def = def("streams", "agent RSS per open tunnel", "KiB", false);
/// Server RSS after its agent connected, before any traffic.
pub const MEM_IDLE_SERVER: Def = def("memory", "server idle RSS", "MiB", false);
/// Agent RSS after it connected, before any traffic.
pub const MEM_IDLE_AGENT: Def = def("memory", "agent idle RSS", "MiB", false);
/// Server RSS growth per open idle connection.
pub const MEM_CONN_SERVER: Def = def("memory", "server RSS per idle conn", "KiB", false);
/// Agent RSS growth per open idle connection.
pub const MEM_CONN_AGENT: Def = def("memory", "agent RSS per idle conn", "KiB", false);
/// Server RSS after open/close round 1.
pub const MEM_R1_SERVER: Def = def("memory", "server RSS after round 1", "MiB", false);
/// Server RSS after open/close round 10.
pub const MEM_R10_SERVER: Def = def("memory", "server RSS after round 10", "MiB", false);
/// Server RSS growth from round 1 to round 10.
pub const MEM_GROWTH_SERVER: Def = def("memory", "server growth round 1->10", "MiB", false);
/// Agent RSS after open/close round 1.
pub const MEM_R1_AGENT: Def = def("memory", "agent RSS after round 1", "MiB", false);
/// Agent RSS after open/close round 10.
pub const MEM_R10_AGENT: Def = def("memory", "agent RSS after round 10", "MiB", false);
/// Agent RSS growth from round 1 to round 10.
pub const MEM_GROWTH_AGENT: Def = def("memory", "agent growth round 1->10", "MiB", false);
/// Server RSS after churn round 2.
pub const CHURN_R2_SERVER: Def = def("churn", "server RSS after round 2", "MiB", false);
/// Server RSS after the last churn round.
pub const CHURN_LAST_SERVER: Def = def("churn", "server RSS after last round", "MiB", false);
/// Server RSS growth from churn round 2 to the last, in percent.
pub const CHURN_GROWTH_SERVER: Def = def("churn", "server growth round 2->last", "%", false);
/// Agent RSS after churn round 2.
pub const CHURN_R2_AGENT: Def = def("churn", "agent RSS after round 2", "MiB", false);
/// Agent RSS after the last churn round.
pub const CHURN_LAST_AGENT: Def = def("churn", "agent RSS after last round", "MiB", false);
/// Agent RSS growth from churn round 2 to the last, in percent.
pub const CHURN_GROWTH_AGENT: Def = def("churn", "agent growth round 2->last", "%", false);

/// Agents whose TLS session resumed after the server restart.
pub const AGENTS_RESUMED: Def = def("agents", "agents resumed after the restart", "count", false);
/// All agents back after their links were cut, the server kept.
pub const AGENTS_CUT: Def = def("agents", "N agents back after links cut", "s", false);
/// Server CPU per agent reconnecting after its link was cut.
pub const AGENTS_CPU_CUT: Def = def("agents", "server CPU per agent, links cut", "ms", false);
/// Agents whose TLS session resumed after their links were cut.
pub const AGENTS_CUT_RESUMED: Def = def("agents", "agents resumed after links cut", "count", false);
/// All ANP-style agents connected after a server restart.
pub const AGENTS_ANP_RESTART: Def = def("agents", "N ANP-style connected, restart", "s", false);
/// Server CPU per ANP-style agent after a restart.
pub const AGENTS_ANP_CPU_RESTART: Def =
    def("agents", "server CPU per ANP-style, restart", "ms", false);
/// The ANP-style swarm's CPU per agent during its restart storm.
pub const AGENTS_ANP_SWARM_CPU_RESTART: Def = def(
    "agents",
    "swarm CPU per ANP-style agent, restart",
    "ms",
    false,
);

/// Token auth: all agents connected after a cold start.
pub const AGENTS_TOKEN_COLD: Def = def("agents", "tokens: N connected, cold start", "s", false);
/// Token auth: TokenReviews during the cold start.
pub const AGENTS_TOKEN_COLD_REVIEWS: Def =
    def("agents", "tokens: reviews, cold start", "count", false);
/// Token auth: all agents back after their links were cut.
pub const AGENTS_TOKEN_CUT: Def = def("agents", "tokens: N back after links cut", "s", false);
/// Token auth: TokenReviews while the links came back.
pub const AGENTS_TOKEN_CUT_REVIEWS: Def =
    def("agents", "tokens: reviews, links cut", "count", false);
/// Token auth: all agents back after a server restart.
pub const AGENTS_TOKEN_RESTART: Def = def("agents", "tokens: N back after restart", "s", false);
/// Token auth: TokenReviews after the restart.
pub const AGENTS_TOKEN_RESTART_REVIEWS: Def =
    def("agents", "tokens: reviews, restart", "count", false);
/// Token auth: the most TokenReviews the API had at once.
pub const AGENTS_TOKEN_IN_FLIGHT: Def =
    def("agents", "tokens: most reviews in flight", "count", false);

/// All agents connected after a cold start (agents scenario).
pub const AGENTS_COLD: Def = def("agents", "N agents connected, cold start", "s", false);
/// All agents connected after the server was killed and started again.
pub const AGENTS_RESTART: Def = def("agents", "N agents connected, server restart", "s", false);
/// Server CPU per agent connection during the cold start.
pub const AGENTS_CPU_COLD: Def = def("agents", "server CPU per agent, cold start", "ms", false);
/// Server CPU per agent connection during the restart storm.
pub const AGENTS_CPU_RESTART: Def = def("agents", "server CPU per agent, restart", "ms", false);
/// The swarm's CPU per agent during the restart storm (the agents' side of
/// the handshakes, on the same cores).
pub const AGENTS_SWARM_CPU_RESTART: Def =
    def("agents", "swarm CPU per agent, restart", "ms", false);
/// The swarm's CPU per agent while the cut links came back.
pub const AGENTS_SWARM_CPU_CUT: Def = def("agents", "swarm CPU per agent, links cut", "ms", false);
/// Server RSS per connected idle agent.
pub const AGENTS_RSS_SERVER: Def = def("agents", "server RSS per idle agent", "KiB", false);
/// Agent-side RSS per agent (the swarm process, beyond one agent).
pub const AGENTS_RSS_SWARM: Def = def("agents", "agent side RSS per agent (swarm)", "KiB", false);
/// Slowest `/readyz` with N agents connected.
pub const AGENTS_READYZ: Def = def("agents", "/readyz slowest of 20, N agents", "ms", false);
/// Slowest `/metrics` with N agents connected.
pub const AGENTS_METRICS: Def = def("agents", "/metrics slowest of 20, N agents", "ms", false);
/// Dial rate at 8 clients with one agent.
pub const AGENTS_DIAL1_RATE: Def = def("agents", "c=8 dial rate, 1 agent", "dials/s", false);
/// Dial p99 at 8 clients with one agent.
pub const AGENTS_DIAL1_P99: Def = def("agents", "c=8 dial p99, 1 agent", "us", false);
/// Dial rate at 8 clients with N agents.
pub const AGENTS_DIALN_RATE: Def = def("agents", "c=8 dial rate, N agents", "dials/s", false);
/// Dial p99 at 8 clients with N agents.
pub const AGENTS_DIALN_P99: Def = def("agents", "c=8 dial p99, N agents", "us", false);
/// Dial rate with N agents over with one.
pub const AGENTS_DIAL_RATIO: Def = def("agents", "dial rate N agents / 1 agent", "ratio", false);
/// Dial p99 with N agents over with one.
pub const AGENTS_DIAL_P99_RATIO: Def = def("agents", "dial p99 N agents / 1 agent", "ratio", false);
/// ANP-style agents (no flow-control negotiation) connected, cold start.
pub const AGENTS_ANP_COLD: Def = def("agents", "N ANP-style agents connected, cold", "s", false);
/// Dial rate at 8 clients with N ANP-style agents.
pub const AGENTS_ANP_DIAL_RATE: Def = def("agents", "c=8 dial rate, N ANP-style", "dials/s", false);
/// Dial p99 at 8 clients with N ANP-style agents.
pub const AGENTS_ANP_DIAL_P99: Def = def("agents", "c=8 dial p99, N ANP-style", "us", false);
/// Failed dials over the agents scenario's dial rows.
pub const AGENTS_DIAL_ERRORS: Def = def("agents", "dial errors", "count", false);

/// Faults the soak injected.
pub const SOAK_FAULTS: Def = def("soak", "faults injected", "count", false);
/// Exchanges (each a tunnel) that carried every byte.
pub const SOAK_OK: Def = def("soak", "exchanges carried whole", "count", false);
/// Exchanges the tunnel ended with an error.
pub const SOAK_ERRORS: Def = def("soak", "exchanges ended with an error", "count", false);
/// Exchanges that lost or altered bytes without an error (must be 0).
pub const SOAK_SILENT: Def = def(
    "soak",
    "exchanges lost silently (must be 0)",
    "count",
    false,
);
/// Bytes checked end to end.
pub const SOAK_BYTES: Def = def("soak", "bytes carried, checked", "GB", false);
/// Dials that waited past their timeout (must be 0).
pub const SOAK_LATE: Def = def("soak", "dials past the timeout (must be 0)", "count", false);
/// Requests the destination saw end cleanly before their last byte, or
/// altered, but for those of an agent killed with SIGKILL (its kernel's
/// FIN).
pub const SOAK_DEST_SILENT: Def = def(
    "soak",
    "destination: cut short or altered, no fault explains (must be 0)",
    "count",
    false,
);
/// Slowest time for an agent (or every agent of a restarted server) to be back.
pub const SOAK_BACK_MAX: Def = def("soak", "slowest recovery: agent back", "s", false);
/// Slowest time for dials through both servers to be served again.
pub const SOAK_DIALS_MAX: Def = def("soak", "slowest recovery: dials served", "s", false);
/// The least share of its rate healthy traffic kept during a fault.
pub const SOAK_RATE_MIN: Def = def(
    "soak",
    "least rate healthy traffic kept in a fault",
    "ratio",
    false,
);
/// Slowest return of RSS, fds and tasks to within 5 % of the baseline.
pub const SOAK_RESOURCES_MAX: Def = def("soak", "slowest RSS/fds/tasks back", "s", false);
/// Largest server RSS over the run.
pub const SOAK_SERVER_RSS: Def = def("soak", "largest server RSS", "MiB", false);
/// Largest agent RSS over the run.
pub const SOAK_AGENT_RSS: Def = def("soak", "largest agent RSS", "MiB", false);
/// Invariants that did not hold (must be 0).
pub const SOAK_VIOLATIONS: Def = def("soak", "violated invariants (must be 0)", "count", false);

/// Records a soak's rows: per route where they split (the gRPC server's
/// frontends, the CONNECT server's), whole-run rows in the grpc column.
pub fn push_soak(rec: &mut Recorder, r: &crate::soak::SoakResult) {
    push_soak_routes(rec, &r.figures);
    push_soak_whole(rec, r);
    push_soak_rss(rec, r);
}

/// The exchanges' rows, per server (each server its own route).
fn push_soak_routes(rec: &mut Recorder, f: &soak_judge::Figures) {
    for route in [Route::Grpc, Route::HttpConnect] {
        let server = usize::from(route == Route::HttpConnect);
        let of = |pick: fn(&soak_judge::exchanges::FrontendTally) -> u64| -> f64 {
            f.joined
                .frontends
                .iter()
                .filter(|(k, _)| k.server() == Some(server))
                .map(|(_, t)| pick(t) as f64)
                .sum()
        };
        let bytes: f64 = f
            .started
            .iter()
            .filter(|(k, _, _)| k.server() == Some(server))
            .map(|(_, _, b)| *b as f64)
            .sum();
        rec.push(&SOAK_OK, route, 0, Some(of(|t| t.ok)));
        rec.push(
            &SOAK_ERRORS,
            route,
            0,
            Some(of(|t| t.errors + t.dial_failed + t.cut)),
        );
        rec.push(&SOAK_SILENT, route, 0, Some(of(|t| t.silent)));
        rec.push(&SOAK_BYTES, route, 0, Some(bytes / 1e9));
        rec.push(&SOAK_LATE, route, 0, Some(of(|t| t.late)));
    }
}

/// The whole run's rows, in the grpc column.
fn push_soak_whole(rec: &mut Recorder, r: &crate::soak::SoakResult) {
    let f = &r.figures;
    let max = |it: &mut dyn Iterator<Item = f64>| it.reduce(f64::max);
    let whole = [
        (&SOAK_FAULTS, Some(f.faults.len() as f64)),
        (
            &SOAK_DEST_SILENT,
            Some(
                f.joined
                    .unexcused()
                    .iter()
                    .filter(|e| {
                        matches!(
                            e.ending,
                            soak_judge::exchanges::Ending::Truncated
                                | soak_judge::exchanges::Ending::Corrupt
                        )
                    })
                    .count() as f64,
            ),
        ),
        (
            &SOAK_BACK_MAX,
            max(&mut f.faults.iter().filter_map(|f| f.back_s)),
        ),
        (
            &SOAK_DIALS_MAX,
            max(&mut f.faults.iter().filter_map(|f| f.dials_s)),
        ),
        (
            &SOAK_RATE_MIN,
            f.faults.iter().filter_map(|f| f.healthy).reduce(f64::min),
        ),
        (
            &SOAK_RESOURCES_MAX,
            max(&mut f.faults.iter().filter_map(|f| f.resources_s)),
        ),
        (&SOAK_VIOLATIONS, Some(r.verdict.failing().count() as f64)),
    ];
    for (def, value) in whole {
        rec.push(def, Route::Grpc, 0, value);
    }
}

/// The largest RSS of any server and of any agent, in MiB.
fn push_soak_rss(rec: &mut Recorder, r: &crate::soak::SoakResult) {
    use soak_judge::Role;
    const MIB: f64 = 1024.0 * 1024.0;
    let roles: Vec<Role> = r
        .run
        .slot_names
        .iter()
        .map(|n| {
            if n.starts_with("server") {
                Role::Server
            } else {
                Role::Agent
            }
        })
        .collect();
    for (def, role) in [
        (&SOAK_SERVER_RSS, Role::Server),
        (&SOAK_AGENT_RSS, Role::Agent),
    ] {
        let largest = r
            .run
            .samples
            .iter()
            .flat_map(|s| s.procs.iter().zip(&roles))
            .filter(|(_, r)| **r == role)
            .filter_map(|(p, _)| p.map(|p| p.rss as f64 / MIB))
            .reduce(f64::max);
        rec.push(def, Route::Grpc, 0, largest);
    }
}

/// Failed dials over the kill runs with `--backend-dial-retries=1`.
pub const RETRIES_KILL_FAILED: Def =
    def("retries", "kill: failed dials, retries=1", "count", false);
/// Failed dials with `--backend-dial-retries=0` (ANP's behaviour).
pub const RETRIES_KILL_FAILED_ANP: Def = def(
    "retries",
    "kill: failed dials, retries=0 (ANP)",
    "count",
    false,
);
/// Dials the server sent to another agent after theirs died.
pub const RETRIES_KILL_RETRIED: Def =
    def("retries", "kill: dials retried (server)", "count", false);
/// Tunnels established on an agent before it hung, cut by its death.
pub const RETRIES_KILL_CUT: Def = def(
    "retries",
    "kill: tunnels cut after DIAL_RSP",
    "count",
    false,
);
/// Rounds part (issue 50), gRPC: tunnels that carried their exchange.
pub const RETRIES_ROUNDS_GRPC_TUNNELS: Def =
    def("retries", "rounds, grpc: tunnels", "count", false);
/// Rounds part, gRPC: tunnels that failed with an error.
pub const RETRIES_ROUNDS_GRPC_ERRORS: Def =
    def("retries", "rounds, grpc: tunnels failed", "count", false);
/// Rounds part, gRPC: tunnels still open 15 s after they started.
pub const RETRIES_ROUNDS_GRPC_HUNG: Def = def(
    "retries",
    "rounds, grpc: tunnels hung (open 15 s on)",
    "count",
    false,
);
/// Rounds part, HTTP-CONNECT: tunnels that carried their exchange.
pub const RETRIES_ROUNDS_CONNECT_TUNNELS: Def =
    def("retries", "rounds, http-connect: tunnels", "count", false);
/// Rounds part, HTTP-CONNECT: tunnels that failed with an error.
pub const RETRIES_ROUNDS_CONNECT_ERRORS: Def = def(
    "retries",
    "rounds, http-connect: tunnels failed",
    "count",
    false,
);
/// Rounds part, HTTP-CONNECT: tunnels still open 15 s after they started.
pub const RETRIES_ROUNDS_CONNECT_HUNG: Def = def(
    "retries",
    "rounds, http-connect: tunnels hung (open 15 s on)",
    "count",
    false,
);
/// Tunnels still open `retries::HUNG_AFTER` after they started (a kill).
pub const RETRIES_KILL_HUNG: Def = def(
    "retries",
    "kill: tunnels hung (open 15 s on)",
    "count",
    false,
);
/// Dials identified as having waited on a killed agent.
pub const RETRIES_KILL_WAITED: Def =
    def("retries", "kill: dials that waited on it", "count", false);
/// Kill → DIAL_RSP of those, median.
pub const RETRIES_KILL_AFTER_P50: Def =
    def("retries", "kill: their death -> DIAL_RSP p50", "ms", false);
/// Kill → DIAL_RSP of those, p99.
pub const RETRIES_KILL_AFTER_P99: Def =
    def("retries", "kill: their death -> DIAL_RSP p99", "ms", false);
/// Dial latency of the other dials, median.
pub const RETRIES_KILL_HEALTHY_P50: Def = def("retries", "kill: other dials p50", "ms", false);
/// Dial latency of the other dials, p99.
pub const RETRIES_KILL_HEALTHY_P99: Def = def("retries", "kill: other dials p99", "ms", false);
/// Failed dials, plain kill -9 (no hang), `--backend-dial-retries=1`.
pub const RETRIES_KILL_PLAIN_FAILED: Def = def(
    "retries",
    "kill, no hang: failed dials, retries=1",
    "count",
    false,
);
/// Failed dials, plain kill -9, `--backend-dial-retries=0`.
pub const RETRIES_KILL_PLAIN_FAILED_ANP: Def = def(
    "retries",
    "kill, no hang: failed dials, retries=0",
    "count",
    false,
);
/// Dials retried, plain kill -9.
pub const RETRIES_KILL_PLAIN_RETRIED: Def = def(
    "retries",
    "kill, no hang: dials retried (server)",
    "count",
    false,
);
/// Tunnels cut, plain kill -9.
pub const RETRIES_KILL_PLAIN_CUT: Def = def(
    "retries",
    "kill, no hang: tunnels cut after DIAL_RSP",
    "count",
    false,
);
/// Tunnels still open `retries::HUNG_AFTER` after they started (a plain
/// kill).
pub const RETRIES_KILL_PLAIN_HUNG: Def = def(
    "retries",
    "kill, no hang: tunnels hung (open 15 s on)",
    "count",
    false,
);
/// Dial latency, all agents healthy, median.
pub const RETRIES_SLOW_HEALTHY_P50: Def = def("retries", "slow: all healthy, p50", "ms", false);
/// Dial latency, all agents healthy, p99.
pub const RETRIES_SLOW_HEALTHY_P99: Def = def("retries", "slow: all healthy, p99", "ms", false);
/// One agent slowed, hedging off, median.
pub const RETRIES_SLOW_OFF_P50: Def = def("retries", "slow: hedging off, p50", "ms", false);
/// One agent slowed, hedging off, p99.
pub const RETRIES_SLOW_OFF_P99: Def = def("retries", "slow: hedging off, p99", "ms", false);
/// One agent slowed, hedging off, p99.9.
pub const RETRIES_SLOW_OFF_P999: Def = def("retries", "slow: hedging off, p99.9", "ms", false);
/// One agent slowed, hedging on, median.
pub const RETRIES_SLOW_ON_P50: Def = def("retries", "slow: hedging on, p50", "ms", false);
/// One agent slowed, hedging on, p99.
pub const RETRIES_SLOW_ON_P99: Def = def("retries", "slow: hedging on, p99", "ms", false);
/// One agent slowed, hedging on, p99.9.
pub const RETRIES_SLOW_ON_P999: Def = def("retries", "slow: hedging on, p99.9", "ms", false);
/// p99 hedging off over the healthy p99.
pub const RETRIES_SLOW_OFF_RATIO: Def =
    def("retries", "slow: p99 hedging off / healthy", "ratio", false);
/// p99 hedging on over the healthy p99.
pub const RETRIES_SLOW_ON_RATIO: Def =
    def("retries", "slow: p99 hedging on / healthy", "ratio", false);
/// Dials of a second or more, hedging off.
pub const RETRIES_SLOW_OFF_SECOND: Def = def(
    "retries",
    "slow: dials >= 0.9 s, hedging off",
    "count",
    false,
);
/// Dials of a second or more, hedging on.
pub const RETRIES_SLOW_ON_SECOND: Def = def(
    "retries",
    "slow: dials >= 0.9 s, hedging on",
    "count",
    false,
);
/// First SYNs the slow node dropped (dials it was sent), hedging off.
pub const RETRIES_SLOW_HELD_OFF: Def = def(
    "retries",
    "slow: dials to the slow agent, off",
    "count",
    false,
);
/// The same, hedging on.
pub const RETRIES_SLOW_HELD_ON: Def = def(
    "retries",
    "slow: dials to the slow agent, on",
    "count",
    false,
);
/// Dial latency, all agents healthy, p99.9.
pub const RETRIES_SLOW_HEALTHY_P999: Def = def("retries", "slow: all healthy, p99.9", "ms", false);
/// Dials sent to a second agent (hedging on).
pub const RETRIES_SLOW_HEDGED: Def = def("retries", "slow: dials hedged", "count", false);
/// Hedges that won.
pub const RETRIES_SLOW_WON: Def = def("retries", "slow: hedges won", "count", false);
/// Failed tunnels over the three slow runs.
pub const RETRIES_SLOW_FAILED: Def = def("retries", "slow: failed tunnels", "count", false);
/// Share of 300 new dials the two idle agents got.
pub const RETRIES_P2C_IDLE: Def = def("retries", "p2c: new dials to the 2 idle agents", "%", false);
/// Dials that timed out on the hung agent, one dial at a time for a minute.
pub const RETRIES_HUNG_SERIAL_FAILED: Def = def(
    "retries",
    "hung: timed-out dials, one at a time for 60 s",
    "count",
    false,
);
/// Share of that minute the caller spent waiting on those timeouts.
pub const RETRIES_HUNG_SERIAL_WAITED: Def = def(
    "retries",
    "hung: time spent on timeouts, one at a time",
    "%",
    false,
);
/// Share of the dials, 8 at a time, sent to the hung agent.
pub const RETRIES_HUNG_PARALLEL_SHARE: Def = def(
    "retries",
    "hung: dials to the hung agent, 8 at a time",
    "%",
    false,
);

/// jemalloc's allocated bytes grown under the tiny part's flood.
pub const BUDGET_TINY_GROWN: Def = def("budget", "tiny DATA flood: allocated grown", "MB", false);
/// 1-byte DATA the server read before it stopped reading the stream.
pub const BUDGET_TINY_READ: Def = def("budget", "tiny DATA flood: 1-byte read", "count", false);
/// jemalloc's allocated bytes grown under the padded part's flood.
pub const BUDGET_PADDED_GROWN: Def = def(
    "budget",
    "100 DATA padded to 4 MiB: allocated grown",
    "MB",
    false,
);
/// The server's peak RSS under the streams part.
pub const BUDGET_STREAMS_PEAK: Def = def("budget", "stalled streams: peak RSS", "MB", false);
/// The peak beyond RSS before and the whole buffer budget.
pub const BUDGET_STREAMS_BEYOND: Def = def("budget", "stalled streams: beyond budget", "MB", false);
/// The same per stream.
pub const BUDGET_STREAMS_PER_STREAM: Def = def(
    "budget",
    "stalled streams: beyond budget per stream",
    "KiB/stream",
    false,
);
/// Round trips made beside the stalled streams, on a new stream of a
/// flooding connection.
pub const BUDGET_STREAMS_TRIPS: Def = def(
    "budget",
    "stalled streams: round trips, same connection",
    "count",
    false,
);
/// The slowest of them.
pub const BUDGET_STREAMS_SLOWEST: Def = def(
    "budget",
    "stalled streams: slowest round trip, same connection",
    "ms",
    false,
);
/// Round trips made beside the stalled streams on a connection of their
/// own.
pub const BUDGET_STREAMS_TRIPS_OWN: Def = def(
    "budget",
    "stalled streams: round trips, own connection",
    "count",
    false,
);
/// The slowest of them.
pub const BUDGET_STREAMS_SLOWEST_OWN: Def = def(
    "budget",
    "stalled streams: slowest round trip, own connection",
    "ms",
    false,
);
/// Until the flood settled: every stream cut for its stall read to its
/// end, every other one stopped.
pub const BUDGET_STREAMS_DRAINED: Def = def("budget", "stalled streams: settled", "s", false);
/// Streams left open then, waiting for their destination.
pub const BUDGET_STREAMS_LEFT: Def = def("budget", "stalled streams: left waiting", "count", false);
/// Agent CPU per single-use tunnel at 8 clients, our client, no policy.
pub const POLICY_AGENT_US_NONE: Def = def("policy", "c=8 agent CPU per tunnel, none", "us", false);
/// The same with the recommended policy.
pub const POLICY_AGENT_US: Def = def(
    "policy",
    "c=8 agent CPU per tunnel, recommended",
    "us",
    false,
);
/// Recommended / none, agent CPU per tunnel, our client.
pub const POLICY_AGENT_RATIO: Def = def("policy", "agent CPU, recommended / none", "ratio", false);
/// Recommended / none, server+agent CPU per tunnel, our client.
pub const POLICY_TOTAL_RATIO: Def = def(
    "policy",
    "server+agent CPU, recommended / none",
    "ratio",
    false,
);
/// Agent CPU per single-use tunnel at 8 clients, grpc-go, no policy.
pub const POLICY_AGENT_US_NONE_GO: Def = def(
    "policy",
    "c=8 agent CPU per tunnel, none, grpc-go",
    "us",
    false,
);
/// The same with the recommended policy.
pub const POLICY_AGENT_US_GO: Def = def(
    "policy",
    "c=8 agent CPU per tunnel, recommended, grpc-go",
    "us",
    false,
);
/// Recommended / none, agent CPU per tunnel, grpc-go.
pub const POLICY_AGENT_RATIO_GO: Def = def(
    "policy",
    "agent CPU, recommended / none, grpc-go",
    "ratio",
    false,
);
/// Recommended / none, server+agent CPU per tunnel, grpc-go.
pub const POLICY_TOTAL_RATIO_GO: Def = def(
    "policy",
    "server+agent CPU, recommended / none, grpc-go",
    "ratio",
    false,
);
/// What the policy's check adds to a dial, timed in the bench process.
pub const POLICY_CHECK_NS: Def = def("policy", "check of one dial, in process", "ns", false);
/// Failed dials of the policy scenario, both deployments and clients.
pub const POLICY_ERRORS: Def = def("policy", "failed dials", "count", false);

/// Server+agent CPU per single-use tunnel at 8 clients, our client,
/// neither tracing nor audit log.
pub const OVERHEAD_US_PLAIN: Def = def(
    "overhead",
    "c=8 server+agent CPU per tunnel, plain",
    "us",
    false,
);
/// The same with tracing at 100 % sampling.
pub const OVERHEAD_US_TRACED: Def = def(
    "overhead",
    "c=8 server+agent CPU per tunnel, traced 100 %",
    "us",
    false,
);
/// The same with the audit log.
pub const OVERHEAD_US_AUDITED: Def = def(
    "overhead",
    "c=8 server+agent CPU per tunnel, audited",
    "us",
    false,
);
/// Traced / plain, server+agent CPU per tunnel, our client.
pub const OVERHEAD_TRACED_RATIO: Def = def(
    "overhead",
    "server+agent CPU, traced / plain",
    "ratio",
    false,
);
/// Audited / plain, server+agent CPU per tunnel, our client.
pub const OVERHEAD_AUDITED_RATIO: Def = def(
    "overhead",
    "server+agent CPU, audited / plain",
    "ratio",
    false,
);
/// [`OVERHEAD_US_PLAIN`] with grpc-go.
pub const OVERHEAD_US_PLAIN_GO: Def = def(
    "overhead",
    "c=8 server+agent CPU per tunnel, plain, grpc-go",
    "us",
    false,
);
/// [`OVERHEAD_US_TRACED`] with grpc-go.
pub const OVERHEAD_US_TRACED_GO: Def = def(
    "overhead",
    "c=8 server+agent CPU per tunnel, traced 100 %, grpc-go",
    "us",
    false,
);
/// [`OVERHEAD_US_AUDITED`] with grpc-go.
pub const OVERHEAD_US_AUDITED_GO: Def = def(
    "overhead",
    "c=8 server+agent CPU per tunnel, audited, grpc-go",
    "us",
    false,
);
/// [`OVERHEAD_TRACED_RATIO`] with grpc-go.
pub const OVERHEAD_TRACED_RATIO_GO: Def = def(
    "overhead",
    "server+agent CPU, traced / plain, grpc-go",
    "ratio",
    false,
);
/// [`OVERHEAD_AUDITED_RATIO`] with grpc-go.
pub const OVERHEAD_AUDITED_RATIO_GO: Def = def(
    "overhead",
    "server+agent CPU, audited / plain, grpc-go",
    "ratio",
    false,
);
/// Server spans the OTLP receiver got per traced tunnel (after warm-up).
pub const OVERHEAD_SERVER_SPANS: Def = def(
    "overhead",
    "server spans received per traced tunnel",
    "count",
    false,
);
/// Agent spans the OTLP receiver got per traced tunnel (after warm-up).
pub const OVERHEAD_AGENT_SPANS: Def = def(
    "overhead",
    "agent spans received per traced tunnel",
    "count",
    false,
);
/// Spans the traced server dropped (its export queue full).
pub const OVERHEAD_DROPPED: Def = def("overhead", "server spans dropped", "count", false);
/// Failed dials of the overhead scenario, all deployments and clients.
pub const OVERHEAD_ERRORS: Def = def("overhead", "failed dials", "count", false);

/// Until all N agents are connected; idle, cold, admission.
pub const STORM_IDLE_COLD_TIME_ADMISSION: Def =
    def("storm", "idle cold: all connected, admission", "s", false);
/// Handshakes dropped or failed after the server signed; idle, cold, admission.
pub const STORM_IDLE_COLD_THROWN_ADMISSION: Def =
    def("storm", "idle cold: thrown away, admission", "count", false);
/// Connection attempts of the swarm that failed; idle, cold, admission.
pub const STORM_IDLE_COLD_FAILED_ADMISSION: Def = def(
    "storm",
    "idle cold: connects failed, admission",
    "count",
    false,
);
/// Until all N agents are connected; idle, cold, none.
pub const STORM_IDLE_COLD_TIME_NONE: Def =
    def("storm", "idle cold: all connected, none", "s", false);
/// Handshakes dropped or failed after the server signed; idle, cold, none.
pub const STORM_IDLE_COLD_THROWN_NONE: Def =
    def("storm", "idle cold: thrown away, none", "count", false);
/// Connection attempts of the swarm that failed; idle, cold, none.
pub const STORM_IDLE_COLD_FAILED_NONE: Def =
    def("storm", "idle cold: connects failed, none", "count", false);
/// Time to all connected, with no admission / with it; idle, cold.
pub const STORM_IDLE_COLD_RATIO: Def = def("storm", "idle cold: none / admission", "ratio", false);
/// Until all N agents are connected; idle, restart, admission.
pub const STORM_IDLE_RESTART_TIME_ADMISSION: Def = def(
    "storm",
    "idle restart: all connected, admission",
    "s",
    false,
);
/// Handshakes dropped or failed after the server signed; idle, restart, admission.
pub const STORM_IDLE_RESTART_THROWN_ADMISSION: Def = def(
    "storm",
    "idle restart: thrown away, admission",
    "count",
    false,
);
/// Connection attempts of the swarm that failed; idle, restart, admission.
pub const STORM_IDLE_RESTART_FAILED_ADMISSION: Def = def(
    "storm",
    "idle restart: connects failed, admission",
    "count",
    false,
);
/// Until all N agents are connected; idle, restart, none.
pub const STORM_IDLE_RESTART_TIME_NONE: Def =
    def("storm", "idle restart: all connected, none", "s", false);
/// Handshakes dropped or failed after the server signed; idle, restart, none.
pub const STORM_IDLE_RESTART_THROWN_NONE: Def =
    def("storm", "idle restart: thrown away, none", "count", false);
/// Connection attempts of the swarm that failed; idle, restart, none.
pub const STORM_IDLE_RESTART_FAILED_NONE: Def = def(
    "storm",
    "idle restart: connects failed, none",
    "count",
    false,
);
/// Time to all connected, with no admission / with it; idle, restart.
pub const STORM_IDLE_RESTART_RATIO: Def =
    def("storm", "idle restart: none / admission", "ratio", false);
/// Until all N agents are connected; shared, cold, admission.
pub const STORM_SHARED_COLD_TIME_ADMISSION: Def =
    def("storm", "shared cold: all connected, admission", "s", false);
/// Handshakes dropped or failed after the server signed; shared, cold, admission.
pub const STORM_SHARED_COLD_THROWN_ADMISSION: Def = def(
    "storm",
    "shared cold: thrown away, admission",
    "count",
    false,
);
/// Connection attempts of the swarm that failed; shared, cold, admission.
pub const STORM_SHARED_COLD_FAILED_ADMISSION: Def = def(
    "storm",
    "shared cold: connects failed, admission",
    "count",
    false,
);
/// Until all N agents are connected; shared, cold, none.
pub const STORM_SHARED_COLD_TIME_NONE: Def =
    def("storm", "shared cold: all connected, none", "s", false);
/// Handshakes dropped or failed after the server signed; shared, cold, none.
pub const STORM_SHARED_COLD_THROWN_NONE: Def =
    def("storm", "shared cold: thrown away, none", "count", false);
/// Connection attempts of the swarm that failed; shared, cold, none.
pub const STORM_SHARED_COLD_FAILED_NONE: Def = def(
    "storm",
    "shared cold: connects failed, none",
    "count",
    false,
);
/// Time to all connected, with no admission / with it; shared, cold.
pub const STORM_SHARED_COLD_RATIO: Def =
    def("storm", "shared cold: none / admission", "ratio", false);
/// Until all N agents are connected; shared, restart, admission.
pub const STORM_SHARED_RESTART_TIME_ADMISSION: Def = def(
    "storm",
    "shared restart: all connected, admission",
    "s",
    false,
);
/// Handshakes dropped or failed after the server signed; shared, restart, admission.
pub const STORM_SHARED_RESTART_THROWN_ADMISSION: Def = def(
    "storm",
    "shared restart: thrown away, admission",
    "count",
    false,
);
/// Connection attempts of the swarm that failed; shared, restart, admission.
pub const STORM_SHARED_RESTART_FAILED_ADMISSION: Def = def(
    "storm",
    "shared restart: connects failed, admission",
    "count",
    false,
);
/// Until all N agents are connected; shared, restart, none.
pub const STORM_SHARED_RESTART_TIME_NONE: Def =
    def("storm", "shared restart: all connected, none", "s", false);
/// Handshakes dropped or failed after the server signed; shared, restart, none.
pub const STORM_SHARED_RESTART_THROWN_NONE: Def =
    def("storm", "shared restart: thrown away, none", "count", false);
/// Connection attempts of the swarm that failed; shared, restart, none.
pub const STORM_SHARED_RESTART_FAILED_NONE: Def = def(
    "storm",
    "shared restart: connects failed, none",
    "count",
    false,
);
/// Time to all connected, with no admission / with it; shared, restart.
pub const STORM_SHARED_RESTART_RATIO: Def =
    def("storm", "shared restart: none / admission", "ratio", false);
/// Until all N agents are connected; latency, cold, admission.
pub const STORM_LATENCY_COLD_TIME_ADMISSION: Def = def(
    "storm",
    "latency cold: all connected, admission",
    "s",
    false,
);
/// Handshakes dropped or failed after the server signed; latency, cold, admission.
pub const STORM_LATENCY_COLD_THROWN_ADMISSION: Def = def(
    "storm",
    "latency cold: thrown away, admission",
    "count",
    false,
);
/// Connection attempts of the swarm that failed; latency, cold, admission.
pub const STORM_LATENCY_COLD_FAILED_ADMISSION: Def = def(
    "storm",
    "latency cold: connects failed, admission",
    "count",
    false,
);
/// Until all N agents are connected; latency, cold, none.
pub const STORM_LATENCY_COLD_TIME_NONE: Def =
    def("storm", "latency cold: all connected, none", "s", false);
/// Handshakes dropped or failed after the server signed; latency, cold, none.
pub const STORM_LATENCY_COLD_THROWN_NONE: Def =
    def("storm", "latency cold: thrown away, none", "count", false);
/// Connection attempts of the swarm that failed; latency, cold, none.
pub const STORM_LATENCY_COLD_FAILED_NONE: Def = def(
    "storm",
    "latency cold: connects failed, none",
    "count",
    false,
);
/// Time to all connected, with no admission / with it; latency, cold.
pub const STORM_LATENCY_COLD_RATIO: Def =
    def("storm", "latency cold: none / admission", "ratio", false);
/// Until all N agents are connected; latency, restart, admission.
pub const STORM_LATENCY_RESTART_TIME_ADMISSION: Def = def(
    "storm",
    "latency restart: all connected, admission",
    "s",
    false,
);
/// Handshakes dropped or failed after the server signed; latency, restart, admission.
pub const STORM_LATENCY_RESTART_THROWN_ADMISSION: Def = def(
    "storm",
    "latency restart: thrown away, admission",
    "count",
    false,
);
/// Connection attempts of the swarm that failed; latency, restart, admission.
pub const STORM_LATENCY_RESTART_FAILED_ADMISSION: Def = def(
    "storm",
    "latency restart: connects failed, admission",
    "count",
    false,
);
/// Until all N agents are connected; latency, restart, none.
pub const STORM_LATENCY_RESTART_TIME_NONE: Def =
    def("storm", "latency restart: all connected, none", "s", false);
/// Handshakes dropped or failed after the server signed; latency, restart, none.
pub const STORM_LATENCY_RESTART_THROWN_NONE: Def = def(
    "storm",
    "latency restart: thrown away, none",
    "count",
    false,
);
/// Connection attempts of the swarm that failed; latency, restart, none.
pub const STORM_LATENCY_RESTART_FAILED_NONE: Def = def(
    "storm",
    "latency restart: connects failed, none",
    "count",
    false,
);
/// Time to all connected, with no admission / with it; latency, restart.
pub const STORM_LATENCY_RESTART_RATIO: Def =
    def("storm", "latency restart: none / admission", "ratio", false);
/// The storm rows by condition (idle, shared, latency), phase (cold,
/// restart), variant (admission, none) and what (time, thrown away,
/// connects failed).
pub const STORM: [[[[&Def; 3]; 2]; 2]; 3] = [
    [
        [
            [
                &STORM_IDLE_COLD_TIME_ADMISSION,
                &STORM_IDLE_COLD_THROWN_ADMISSION,
                &STORM_IDLE_COLD_FAILED_ADMISSION,
            ],
            [
                &STORM_IDLE_COLD_TIME_NONE,
                &STORM_IDLE_COLD_THROWN_NONE,
                &STORM_IDLE_COLD_FAILED_NONE,
            ],
        ],
        [
            [
                &STORM_IDLE_RESTART_TIME_ADMISSION,
                &STORM_IDLE_RESTART_THROWN_ADMISSION,
                &STORM_IDLE_RESTART_FAILED_ADMISSION,
            ],
            [
                &STORM_IDLE_RESTART_TIME_NONE,
                &STORM_IDLE_RESTART_THROWN_NONE,
                &STORM_IDLE_RESTART_FAILED_NONE,
            ],
        ],
    ],
    [
        [
            [
                &STORM_SHARED_COLD_TIME_ADMISSION,
                &STORM_SHARED_COLD_THROWN_ADMISSION,
                &STORM_SHARED_COLD_FAILED_ADMISSION,
            ],
            [
                &STORM_SHARED_COLD_TIME_NONE,
                &STORM_SHARED_COLD_THROWN_NONE,
                &STORM_SHARED_COLD_FAILED_NONE,
            ],
        ],
        [
            [
                &STORM_SHARED_RESTART_TIME_ADMISSION,
                &STORM_SHARED_RESTART_THROWN_ADMISSION,
                &STORM_SHARED_RESTART_FAILED_ADMISSION,
            ],
            [
                &STORM_SHARED_RESTART_TIME_NONE,
                &STORM_SHARED_RESTART_THROWN_NONE,
                &STORM_SHARED_RESTART_FAILED_NONE,
            ],
        ],
    ],
    [
        [
            [
                &STORM_LATENCY_COLD_TIME_ADMISSION,
                &STORM_LATENCY_COLD_THROWN_ADMISSION,
                &STORM_LATENCY_COLD_FAILED_ADMISSION,
            ],
            [
                &STORM_LATENCY_COLD_TIME_NONE,
                &STORM_LATENCY_COLD_THROWN_NONE,
                &STORM_LATENCY_COLD_FAILED_NONE,
            ],
        ],
        [
            [
                &STORM_LATENCY_RESTART_TIME_ADMISSION,
                &STORM_LATENCY_RESTART_THROWN_ADMISSION,
                &STORM_LATENCY_RESTART_FAILED_ADMISSION,
            ],
            [
                &STORM_LATENCY_RESTART_TIME_NONE,
                &STORM_LATENCY_RESTART_THROWN_NONE,
                &STORM_LATENCY_RESTART_FAILED_NONE,
            ],
        ],
    ],
];
/// The storm's ratio rows by condition and phase.
pub const STORM_RATIO: [[&Def; 2]; 3] = [
    [&STORM_IDLE_COLD_RATIO, &STORM_IDLE_RESTART_RATIO],
    [&STORM_SHARED_COLD_RATIO, &STORM_SHARED_RESTART_RATIO],
    [&STORM_LATENCY_COLD_RATIO, &STORM_LATENCY_RESTART_RATIO],
];

/// Every metric, in table order.
const ALL: &[&Def] = &[
    &BULK_DOWN,
    &BULK_UP,
    &CPU_DOWN,
    &CPU_DOWN_SERVER,
    &CPU_DOWN_AGENT,
    &SWITCHES_DOWN_SERVER,
    &SWITCHES_DOWN_AGENT,
    &CPU_UP,
    &CPU_UP_SERVER,
    &CPU_UP_AGENT,
    &SWITCHES_UP_SERVER,
    &SWITCHES_UP_AGENT,
    &BULK_DOWN_GO,
    &BULK_UP_GO,
    &CPU_DOWN_GO,
    &CPU_DOWN_SERVER_GO,
    &CPU_DOWN_AGENT_GO,
    &SWITCHES_DOWN_SERVER_GO,
    &SWITCHES_DOWN_AGENT_GO,
    &CPU_UP_GO,
    &CPU_UP_SERVER_GO,
    &CPU_UP_AGENT_GO,
    &SWITCHES_UP_SERVER_GO,
    &SWITCHES_UP_AGENT_GO,
    &PARALLEL_RATE,
    &PARALLEL_FAIRNESS,
    &HOL_SOLO,
    &HOL_STALLED,
    &HOL_RATIO,
    &HOL_BUFFERED,
    &PING_P50,
    &PING_P99,
    &PING_ADDED_P50,
    &PING_ADDED_P99,
    &DIAL1_RATE,
    &DIAL1_P50,
    &DIAL1_P99,
    &DIAL8_RATE,
    &DIAL8_P50,
    &DIAL8_P99,
    &DIAL1_RATE_GO,
    &DIAL1_P50_GO,
    &DIAL1_P99_GO,
    &DIAL8_RATE_GO,
    &DIAL8_P50_GO,
    &DIAL8_P99_GO,
    &DIAL8_SERVER_US,
    &DIAL8_AGENT_US,
    &DIAL8_SERVER_US_GO,
    &DIAL8_AGENT_US_GO,
    &DIAL1_RATE_REUSE,
    &DIAL8_RATE_REUSE,
    &DIAL8_P50_REUSE,
    &DIAL8_P99_REUSE,
    &DIAL8_SERVER_US_REUSE,
    &DIAL8_AGENT_US_REUSE,
    &DIAL_ERRORS,
    &STREAMS_OPEN,
    &STREAMS_OPEN_TIME,
    &STREAMS_SERVER_KIB,
    &STREAMS_AGENT_KIB,
    &MEM_IDLE_SERVER,
    &MEM_IDLE_AGENT,
    &MEM_CONN_SERVER,
    &MEM_CONN_AGENT,
    &MEM_R1_SERVER,
    &MEM_R10_SERVER,
    &MEM_GROWTH_SERVER,
    &MEM_R1_AGENT,
    &MEM_R10_AGENT,
    &MEM_GROWTH_AGENT,
    &CHURN_R2_SERVER,
    &CHURN_LAST_SERVER,
    &CHURN_GROWTH_SERVER,
    &CHURN_R2_AGENT,
    &CHURN_LAST_AGENT,
    &CHURN_GROWTH_AGENT,
    &AGENTS_COLD,
    &AGENTS_RESTART,
    &AGENTS_CPU_COLD,
    &AGENTS_CPU_RESTART,
    &AGENTS_SWARM_CPU_RESTART,
    &AGENTS_RESUMED,
    &AGENTS_CUT,
    &AGENTS_CPU_CUT,
    &AGENTS_SWARM_CPU_CUT,
    &AGENTS_CUT_RESUMED,
    &AGENTS_RSS_SERVER,
    &AGENTS_RSS_SWARM,
    &AGENTS_READYZ,
    &AGENTS_METRICS,
    &AGENTS_DIAL1_RATE,
    &AGENTS_DIAL1_P99,
    &AGENTS_DIALN_RATE,
    &AGENTS_DIALN_P99,
    &AGENTS_DIAL_RATIO,
    &AGENTS_DIAL_P99_RATIO,
    &AGENTS_ANP_COLD,
    &AGENTS_ANP_RESTART,
    &AGENTS_ANP_CPU_RESTART,
    &AGENTS_ANP_SWARM_CPU_RESTART,
    &AGENTS_TOKEN_COLD,
    &AGENTS_TOKEN_COLD_REVIEWS,
    &AGENTS_TOKEN_CUT,
    &AGENTS_TOKEN_CUT_REVIEWS,
    &AGENTS_TOKEN_RESTART,
    &AGENTS_TOKEN_RESTART_REVIEWS,
    &AGENTS_TOKEN_IN_FLIGHT,
    &AGENTS_ANP_DIAL_RATE,
    &AGENTS_ANP_DIAL_P99,
    &AGENTS_DIAL_ERRORS,
    &RETRIES_KILL_FAILED,
    &RETRIES_KILL_FAILED_ANP,
    &RETRIES_KILL_RETRIED,
    &RETRIES_ROUNDS_GRPC_TUNNELS,
    &RETRIES_ROUNDS_GRPC_ERRORS,
    &RETRIES_ROUNDS_GRPC_HUNG,
    &RETRIES_ROUNDS_CONNECT_TUNNELS,
    &RETRIES_ROUNDS_CONNECT_ERRORS,
    &RETRIES_ROUNDS_CONNECT_HUNG,
    &RETRIES_KILL_CUT,
    &RETRIES_KILL_HUNG,
    &RETRIES_KILL_WAITED,
    &RETRIES_KILL_AFTER_P50,
    &RETRIES_KILL_AFTER_P99,
    &RETRIES_KILL_HEALTHY_P50,
    &RETRIES_KILL_HEALTHY_P99,
    &RETRIES_KILL_PLAIN_FAILED,
    &RETRIES_KILL_PLAIN_FAILED_ANP,
    &RETRIES_KILL_PLAIN_RETRIED,
    &RETRIES_KILL_PLAIN_CUT,
    &RETRIES_KILL_PLAIN_HUNG,
    &RETRIES_SLOW_HEALTHY_P50,
    &RETRIES_SLOW_HEALTHY_P99,
    &RETRIES_SLOW_HEALTHY_P999,
    &RETRIES_SLOW_OFF_P50,
    &RETRIES_SLOW_OFF_P99,
    &RETRIES_SLOW_OFF_P999,
    &RETRIES_SLOW_ON_P50,
    &RETRIES_SLOW_ON_P99,
    &RETRIES_SLOW_ON_P999,
    &RETRIES_SLOW_OFF_RATIO,
    &RETRIES_SLOW_ON_RATIO,
    &RETRIES_SLOW_OFF_SECOND,
    &RETRIES_SLOW_ON_SECOND,
    &RETRIES_SLOW_HELD_OFF,
    &RETRIES_SLOW_HELD_ON,
    &RETRIES_SLOW_HEDGED,
    &RETRIES_SLOW_WON,
    &RETRIES_SLOW_FAILED,
    &RETRIES_P2C_IDLE,
    &RETRIES_HUNG_SERIAL_FAILED,
    &RETRIES_HUNG_SERIAL_WAITED,
    &RETRIES_HUNG_PARALLEL_SHARE,
    &BUDGET_TINY_GROWN,
    &BUDGET_TINY_READ,
    &BUDGET_PADDED_GROWN,
    &BUDGET_STREAMS_PEAK,
    &BUDGET_STREAMS_BEYOND,
    &BUDGET_STREAMS_PER_STREAM,
    &BUDGET_STREAMS_TRIPS,
    &BUDGET_STREAMS_SLOWEST,
    &BUDGET_STREAMS_TRIPS_OWN,
    &BUDGET_STREAMS_SLOWEST_OWN,
    &BUDGET_STREAMS_DRAINED,
    &BUDGET_STREAMS_LEFT,
    &POLICY_AGENT_US_NONE,
    &POLICY_AGENT_US,
    &POLICY_AGENT_RATIO,
    &POLICY_TOTAL_RATIO,
    &POLICY_AGENT_US_NONE_GO,
    &POLICY_AGENT_US_GO,
    &POLICY_AGENT_RATIO_GO,
    &POLICY_TOTAL_RATIO_GO,
    &POLICY_CHECK_NS,
    &POLICY_ERRORS,
    &OVERHEAD_US_PLAIN,
    &OVERHEAD_US_TRACED,
    &OVERHEAD_US_AUDITED,
    &OVERHEAD_TRACED_RATIO,
    &OVERHEAD_AUDITED_RATIO,
    &OVERHEAD_US_PLAIN_GO,
    &OVERHEAD_US_TRACED_GO,
    &OVERHEAD_US_AUDITED_GO,
    &OVERHEAD_TRACED_RATIO_GO,
    &OVERHEAD_AUDITED_RATIO_GO,
    &OVERHEAD_SERVER_SPANS,
    &OVERHEAD_AGENT_SPANS,
    &OVERHEAD_DROPPED,
    &OVERHEAD_ERRORS,
    &STORM_IDLE_COLD_TIME_ADMISSION,
    &STORM_IDLE_COLD_THROWN_ADMISSION,
    &STORM_IDLE_COLD_FAILED_ADMISSION,
    &STORM_IDLE_COLD_TIME_NONE,
    &STORM_IDLE_COLD_THROWN_NONE,
    &STORM_IDLE_COLD_FAILED_NONE,
    &STORM_IDLE_COLD_RATIO,
    &STORM_IDLE_RESTART_TIME_ADMISSION,
    &STORM_IDLE_RESTART_THROWN_ADMISSION,
    &STORM_IDLE_RESTART_FAILED_ADMISSION,
    &STORM_IDLE_RESTART_TIME_NONE,
    &STORM_IDLE_RESTART_THROWN_NONE,
    &STORM_IDLE_RESTART_FAILED_NONE,
    &STORM_IDLE_RESTART_RATIO,
    &STORM_SHARED_COLD_TIME_ADMISSION,
    &STORM_SHARED_COLD_THROWN_ADMISSION,
    &STORM_SHARED_COLD_FAILED_ADMISSION,
    &STORM_SHARED_COLD_TIME_NONE,
    &STORM_SHARED_COLD_THROWN_NONE,
    &STORM_SHARED_COLD_FAILED_NONE,
    &STORM_SHARED_COLD_RATIO,
    &STORM_SHARED_RESTART_TIME_ADMISSION,
    &STORM_SHARED_RESTART_THROWN_ADMISSION,
    &STORM_SHARED_RESTART_FAILED_ADMISSION,
    &STORM_SHARED_RESTART_TIME_NONE,
    &STORM_SHARED_RESTART_THROWN_NONE,
    &STORM_SHARED_RESTART_FAILED_NONE,
    &STORM_SHARED_RESTART_RATIO,
    &STORM_LATENCY_COLD_TIME_ADMISSION,
    &STORM_LATENCY_COLD_THROWN_ADMISSION,
    &STORM_LATENCY_COLD_FAILED_ADMISSION,
    &STORM_LATENCY_COLD_TIME_NONE,
    &STORM_LATENCY_COLD_THROWN_NONE,
    &STORM_LATENCY_COLD_FAILED_NONE,
    &STORM_LATENCY_COLD_RATIO,
    &STORM_LATENCY_RESTART_TIME_ADMISSION,
    &STORM_LATENCY_RESTART_THROWN_ADMISSION,
    &STORM_LATENCY_RESTART_FAILED_ADMISSION,
    &STORM_LATENCY_RESTART_TIME_NONE,
    &STORM_LATENCY_RESTART_THROWN_NONE,
    &STORM_LATENCY_RESTART_FAILED_NONE,
    &STORM_LATENCY_RESTART_RATIO,
    &SOAK_FAULTS,
    &SOAK_OK,
    &SOAK_ERRORS,
    &SOAK_SILENT,
    &SOAK_BYTES,
    &SOAK_LATE,
    &SOAK_DEST_SILENT,
    &SOAK_BACK_MAX,
    &SOAK_DIALS_MAX,
    &SOAK_RATE_MIN,
    &SOAK_RESOURCES_MAX,
    &SOAK_SERVER_RSS,
    &SOAK_AGENT_RSS,
    &SOAK_VIOLATIONS,
];

/// Values collected so far, per metric, route and repetition.
pub struct Recorder {
    /// Repetitions.
    reps: usize,
    /// `values[metric][route]`: `None` if that route was never measured,
    /// else one slot per repetition (`None` for a value not available).
    values: Vec<[Option<Vec<Option<f64>>>; 3]>,
}

impl Recorder {
    /// An empty recorder for `reps` repetitions.
    pub fn new(reps: usize) -> Self {
        Self {
            reps,
            values: (0..ALL.len()).map(|_| Default::default()).collect(),
        }
    }

    /// Records `value` of `metric` for `route` in repetition `rep`.
    pub fn push(&mut self, metric: &Def, route: Route, rep: usize, value: Option<f64>) {
        let Some(i) = ALL.iter().position(|d| d.is(metric)) else {
            return;
        };
        let slots = self.values[i][route.index()].get_or_insert_with(|| vec![None; self.reps]);
        if let Some(slot) = slots.get_mut(rep) {
            *slot = value;
        }
    }

    /// The value recorded for `metric`, `route`, `rep`, if any.
    pub fn get(&self, metric: &Def, route: Route, rep: usize) -> Option<f64> {
        let i = ALL.iter().position(|d| d.is(metric))?;
        self.values[i][route.index()]
            .as_ref()?
            .get(rep)
            .copied()
            .flatten()
    }

    /// The metrics measured on at least one route, with their summaries.
    pub fn metrics(&self) -> Vec<Metric> {
        let mut out = Vec::new();
        for (def, values) in ALL.iter().zip(&self.values) {
            if values.iter().all(Option::is_none) {
                continue;
            }
            let direct = values[Route::Direct.index()].as_deref();
            let series = |route: Route| {
                let per_rep = values[route.index()].clone()?;
                let present: Vec<f64> = per_rep.iter().flatten().copied().collect();
                let summary = stats::summarize(&present);
                let ratio_to_direct = match (def.ratio && route != Route::Direct, direct) {
                    (true, Some(direct)) => {
                        let ratios: Vec<f64> = per_rep
                            .iter()
                            .zip(direct)
                            .filter_map(|(v, d)| Some((*v)? / (*d)?))
                            .filter(|r| r.is_finite())
                            .collect();
                        stats::summarize(&ratios).map(|s| s.median)
                    }
                    _ => None,
                };
                Some(Series {
                    per_rep,
                    median: summary.map(|s| s.median),
                    min: summary.map(|s| s.min),
                    max: summary.map(|s| s.max),
                    ratio_to_direct,
                })
            };
            out.push(Metric {
                scenario: def.scenario.to_owned(),
                name: def.name.to_owned(),
                unit: def.unit.to_owned(),
                direct: series(Route::Direct),
                grpc: series(Route::Grpc),
                http_connect: series(Route::HttpConnect),
            });
        }
        out
    }
}

/// One metric's results.
#[derive(Debug, Clone, Serialize)]
pub struct Metric {
    /// Scenario.
    pub scenario: String,
    /// What.
    pub name: String,
    /// Unit.
    pub unit: String,
    /// Direct TCP; `null` where not applicable.
    pub direct: Option<Series>,
    /// gRPC mode; `null` where not applicable.
    pub grpc: Option<Series>,
    /// HTTP-CONNECT mode; `null` where not applicable.
    #[serde(rename = "http-connect")]
    pub http_connect: Option<Series>,
}

/// The values of one metric on one route.
#[derive(Debug, Clone, Serialize)]
pub struct Series {
    /// One value per repetition (`null`: not available in that one).
    pub per_rep: Vec<Option<f64>>,
    /// Median of the available values.
    pub median: Option<f64>,
    /// Smallest.
    pub min: Option<f64>,
    /// Largest.
    pub max: Option<f64>,
    /// Median over repetitions of value / direct's value in the same
    /// repetition (throughputs only).
    pub ratio_to_direct: Option<f64>,
}

/// The effective settings of a run.
#[derive(Debug, Clone, Serialize)]
pub struct Settings {
    /// Measured seconds per time-boxed run.
    pub duration_s: f64,
    /// Repetitions (each runs direct, grpc, http-connect in turn).
    pub reps: usize,
    /// Idle connections opened in the memory scenario.
    pub conns: usize,
    /// Timed ping-pong round trips per run.
    pub round_trips: usize,
    /// Streams of the parallel scenario.
    pub streams: usize,
    /// Scenarios run.
    pub scenarios: Vec<String>,
    /// RLIMIT_NOFILE of the bench (inherited by server and agent).
    pub nofile_limit: u64,
    /// The proxy-server binary.
    pub server_bin: String,
    /// The proxy-agent binary.
    pub agent_bin: String,
    /// The crypto provider of both binaries' rustls.
    pub crypto_provider: String,
}

/// Everything a run found.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// The command line, as given.
    pub command_line: String,
    /// The machine.
    pub machine: Machine,
    /// The settings.
    pub settings: Settings,
    /// How to read the numbers.
    pub notes: Vec<String>,
    /// The results.
    pub metrics: Vec<Metric>,
}

impl Report {
    /// The results as an aligned text table: one line per metric, columns
    /// direct | grpc | http-connect, each `median [min–max]`, and `×ratio`
    /// to direct for throughputs.
    pub fn table(&self) -> String {
        let mut rows: Vec<[String; 4]> = vec![[
            "metric".to_owned(),
            Route::Direct.name().to_owned(),
            Route::Grpc.name().to_owned(),
            Route::HttpConnect.name().to_owned(),
        ]];
        for m in &self.metrics {
            rows.push([
                format!("{:<8} {} ({})", m.scenario, m.name, m.unit),
                cell(m.direct.as_ref()),
                cell(m.grpc.as_ref()),
                cell(m.http_connect.as_ref()),
            ]);
        }
        let mut widths = [0usize; 4];
        for row in &rows {
            for (w, c) in widths.iter_mut().zip(row) {
                *w = (*w).max(c.chars().count());
            }
        }
        let mut out = String::new();
        for (i, row) in rows.iter().enumerate() {
            let line = format!(
                "{:<w0$} | {:<w1$} | {:<w2$} | {}",
                row[0],
                row[1],
                row[2],
                row[3],
                w0 = widths[0],
                w1 = widths[1],
                w2 = widths[2],
            );
            let _ = writeln!(out, "{}", line.trim_end());
            if i == 0 {
                let total = widths.iter().sum::<usize>() + 9;
                let _ = writeln!(out, "{}", "-".repeat(total));
            }
        }
        out
    }
}

/// `median [min–max] ×ratio`, `n/a` for no value, empty for not
/// applicable.
fn cell(series: Option<&Series>) -> String {
    let Some(s) = series else {
        return String::new();
    };
    let (Some(median), Some(min), Some(max)) = (s.median, s.min, s.max) else {
        return "n/a".to_owned();
    };
    let mut text = number(median);
    if s.per_rep.iter().flatten().count() > 1 {
        let _ = write!(text, " [{}–{}]", number(min), number(max));
    }
    if let Some(r) = s.ratio_to_direct {
        let _ = write!(text, " ×{r:.2}");
    }
    text
}

/// About three significant digits, no exponent.
fn number(v: f64) -> String {
    let a = v.abs();
    if a >= 100.0 || a == 0.0 {
        format!("{v:.0}")
    } else if a >= 10.0 {
        format!("{v:.1}")
    } else if a >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_quantity_is_listed_once_and_recorded_as_itself() {
        for (i, a) in ALL.iter().enumerate() {
            for b in &ALL[i + 1..] {
                assert!(!a.is(b), "{}: {} listed twice", a.scenario, a.name);
            }
        }
        let mut r = Recorder::new(1);
        r.push(&OVERHEAD_ERRORS, Route::Grpc, 0, Some(3.0));
        assert_eq!(r.get(&POLICY_ERRORS, Route::Grpc, 0), None);
        assert_eq!(r.get(&OVERHEAD_ERRORS, Route::Grpc, 0), Some(3.0));
    }

    #[test]
    fn ratio_is_per_repetition() {
        let mut r = Recorder::new(2);
        r.push(&BULK_DOWN, Route::Direct, 0, Some(100.0));
        r.push(&BULK_DOWN, Route::Direct, 1, Some(200.0));
        r.push(&BULK_DOWN, Route::Grpc, 0, Some(50.0));
        r.push(&BULK_DOWN, Route::Grpc, 1, Some(50.0));
        let m = &r.metrics()[0];
        let grpc = m.grpc.as_ref().unwrap();
        assert_eq!(grpc.median, Some(50.0));
        // (0.5 + 0.25) / 2
        assert_eq!(grpc.ratio_to_direct, Some(0.375));
        assert!(m.http_connect.is_none());
        assert!(m.direct.as_ref().unwrap().ratio_to_direct.is_none());
    }

    #[test]
    fn unavailable_values_are_null() {
        let mut r = Recorder::new(1);
        r.push(&HOL_BUFFERED, Route::Grpc, 0, None);
        let m = &r.metrics()[0];
        let grpc = m.grpc.as_ref().unwrap();
        assert_eq!(grpc.per_rep, vec![None]);
        assert_eq!(grpc.median, None);
        assert_eq!(cell(Some(grpc)), "n/a");
        let json = serde_json::to_value(m).unwrap();
        assert!(json["direct"].is_null());
        assert!(json["grpc"]["median"].is_null());
    }

    #[test]
    fn table_lines_are_aligned() {
        let mut r = Recorder::new(3);
        for (rep, v) in [1000.0, 900.0, 1100.0].into_iter().enumerate() {
            r.push(&BULK_DOWN, Route::Direct, rep, Some(v));
            r.push(&BULK_DOWN, Route::Grpc, rep, Some(v / 2.0));
            r.push(&BULK_DOWN, Route::HttpConnect, rep, Some(v / 4.0));
        }
        let report = Report {
            command_line: String::new(),
            machine: Machine::read(),
            settings: Settings {
                duration_s: 1.0,
                reps: 3,
                conns: 1,
                round_trips: 1,
                streams: 1,
                scenarios: vec![],
                nofile_limit: 0,
                server_bin: String::new(),
                agent_bin: String::new(),
                crypto_provider: String::new(),
            },
            notes: vec![],
            metrics: r.metrics(),
        };
        let table = report.table();
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines.len(), 3);
        assert!(lines[2].contains("1000 [900–1100]"), "{table}");
        assert!(lines[2].contains("500 [450–550] ×0.50"), "{table}");
        assert_eq!(lines[0].find('|'), lines[2].find('|'));
    }

    #[test]
    fn numbers_keep_three_digits() {
        assert_eq!(number(1234.4), "1234");
        assert_eq!(number(45.67), "45.7");
        assert_eq!(number(4.567), "4.57");
        assert_eq!(number(0.9876), "0.988");
    }
}
