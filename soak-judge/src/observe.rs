//! What the soak observed: the judge's inputs. Each record says which
//! witness saw it: the frontend (an [`Exchange`]), the destination (a
//! [`NodeConn`]), the driver (a [`FaultRecord`]), a process's own
//! `/metrics` (a [`Life`]'s [`BookSample`]s).

use serde::Serialize;

/// Seconds since the soak started (one clock for every witness: the
/// grpc-go frontend's wall-clock times are converted by the driver).
pub type Secs = f64;

/// Who made an exchange.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum Frontend {
    /// Our client (konnectivity-client), a single-use gRPC tunnel each.
    GrpcOurs,
    /// grpc-go, a gRPC connection per tunnel (kube-apiserver's single-use tunnel).
    GrpcGoSingle,
    /// grpc-go, every tunnel a stream of one connection (the reusable tunnel).
    GrpcGoReused,
    /// Our client's HTTP CONNECT.
    ConnectOurs,
    /// The driver's probe after a fault: does a dial through each server
    /// carry an exchange again?
    Probe,
}

impl Frontend {
    /// The frontends of the traffic, in table order.
    pub const TRAFFIC: [Self; 4] = [
        Self::GrpcOurs,
        Self::GrpcGoSingle,
        Self::GrpcGoReused,
        Self::ConnectOurs,
    ];
    /// Every frontend, in table order.
    pub const ALL: [Self; 5] = [
        Self::GrpcOurs,
        Self::GrpcGoSingle,
        Self::GrpcGoReused,
        Self::ConnectOurs,
        Self::Probe,
    ];

    /// Its name in the tables.
    pub fn name(self) -> &'static str {
        match self {
            Self::GrpcOurs => "grpc, ours",
            Self::GrpcGoSingle => "grpc-go single-use",
            Self::GrpcGoReused => "grpc-go reused",
            Self::ConnectOurs => "http-connect, ours",
            Self::Probe => "recovery probes",
        }
    }

    /// The server a traffic frontend goes through (0: gRPC, 1: HTTP
    /// CONNECT); `None` for the probes, which go through both.
    pub fn server(self) -> Option<usize> {
        match self {
            Self::GrpcOurs | Self::GrpcGoSingle | Self::GrpcGoReused => Some(0),
            Self::ConnectOurs => Some(1),
            Self::Probe => None,
        }
    }
}

/// How an exchange ended at its frontend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum FrontendEnd {
    /// Every byte of the answer as sent, then a clean end.
    Ok,
    /// The dial failed (refused, timed out, or the server was gone): no
    /// tunnel, no byte of the request sent.
    DialFailed,
    /// The tunnel said it failed (a gRPC stream error, CLOSE_RSP or DATA
    /// with an error, a reset).
    Error,
    /// HTTP CONNECT (over TLS): a clean end with bytes missing. Never
    /// excused: a tunnel whose agent or server died ends with a reset or
    /// without close_notify, an error.
    Cut,
    /// A byte that differs, bytes past the answer, or bytes missing before
    /// an end that said nothing was wrong.
    Silent,
    /// No end before the frontend gave up on it.
    Stuck,
}

/// One exchange as its frontend saw it: a tunnel, a request, an answer.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Exchange {
    /// The seed of its bytes, which the request's header carries: the
    /// destination records it too, and the two records meet by it.
    pub id: u64,
    /// Who made it.
    pub frontend: Frontend,
    /// The server it went through: the socket its frontend dialed.
    pub server: usize,
    /// When the frontend started dialing.
    pub started: Secs,
    /// When the frontend saw its end (for [`FrontendEnd::Stuck`], when it
    /// gave up).
    pub ended: Secs,
    /// How long the dial took, if it ended.
    pub dial_s: Option<f64>,
    /// How it ended.
    pub end: FrontendEnd,
    /// What the frontend was told, when it was not [`FrontendEnd::Ok`].
    pub why: Option<String>,
    /// How its server's audit log names its dial, if the frontend got as
    /// far as knowing it.
    pub dial: Option<DialKey>,
}

/// How a server's audit log names a frontend's dial, as the frontend
/// knows it too: the dial id a gRPC frontend chose (`dial_id`, its
/// `random`), or the address of a CONNECT frontend's socket
/// (`frontend_peer`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
pub enum DialKey {
    /// A gRPC dial's `random`.
    Random(i64),
    /// A CONNECT frontend's socket, `ip:port`.
    Peer(String),
}

/// One dial as a server's audit log recorded it at its end: the server's
/// word on which agent answered it last (its `agent_id`, mapped to the
/// agent's slot by the driver). A killed server's open dials have no
/// record.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Audited {
    /// The server that recorded it.
    pub server: usize,
    /// The dial.
    pub key: DialKey,
    /// When its DIAL_REQ (or CONNECT) arrived (a key can come again: a
    /// CONNECT socket's port, reused by a later connection).
    pub started: Secs,
    /// The agent that answered it last; [`Carrier::Unknown`] if none did.
    pub agent: Carrier,
}

/// Which of the destination's listeners accepted a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Listener {
    /// The checked destination: a request checked byte by byte, an answer.
    Exchanges,
    /// The endless source (the stalled frontends' downloads).
    Source,
    /// The destination that never reads (the stalled uploads).
    Stall,
}

/// Which agent carried a connection, from the source address the
/// destination saw: each agent slot has a network namespace of its own
/// (so the kernel, not the agent, says which); the probe agents run on
/// the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum Carrier {
    /// The agent of slot `n` (whichever of its processes ran then).
    Slot(usize),
    /// A probe agent (started on the host to try new certificates).
    Probe,
    /// No agent's address, or not seen by the destination at all (a dial
    /// that failed before the node, or a tunnel whose first byte never
    /// arrived).
    Unknown,
}

impl Carrier {
    /// `agent-1`, `a probe agent`, `an agent not witnessed`.
    pub fn describe(self) -> String {
        match self {
            Self::Slot(n) => format!("agent-{n}"),
            Self::Probe => "a probe agent".to_owned(),
            Self::Unknown => "an agent not witnessed".to_owned(),
        }
    }
}

/// How a connection ended at the destination.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum NodeEnd {
    /// The request checked whole, the answer written, the frontend's end
    /// read.
    Complete,
    /// Closed before any byte of a request: a dial whose tunnel was never
    /// used (the server gave up on it, or its frontend did); nothing lost
    /// here, the frontend's record judges the exchange. Also the end
    /// recorded for the source and the stall, whose ends are not judged.
    Unused,
    /// A read or write error (a reset).
    Reset,
    /// A clean end (a FIN) before the request's last byte.
    Truncated,
    /// A request byte that differs.
    Corrupt,
    /// No progress within the destination's bound.
    Stuck,
    /// Still open when the run ended.
    Open,
}

/// One connection as the destination saw it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct NodeConn {
    /// The exchange's id from its header, once read.
    pub id: Option<u64>,
    /// Which listener accepted it.
    pub listener: Listener,
    /// Who carried it (its source address).
    pub carrier: Carrier,
    /// When it was accepted.
    pub accepted: Secs,
    /// When it ended (for [`NodeEnd::Open`], the end of the run).
    pub ended: Secs,
    /// How.
    pub end: NodeEnd,
}

/// A fault the driver injects.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum Fault {
    /// An agent killed with SIGKILL, started again.
    AgentKill,
    /// A server killed with SIGKILL, started again on the same ports.
    ServerKill,
    /// An agent's control link down, then up.
    Partition,
    /// Frontends that stop reading a download.
    FrontendStall,
    /// A destination that stops reading an upload.
    DestinationStall,
    /// Frontends that send their first bytes one a second.
    Slowloris,
    /// New leaf certificates on both sides (same CA).
    CertRotation,
    /// A new CA: trusted beside the old, leaves switched, old dropped.
    CaRotation,
    /// The TokenReview API answers 503 while an agent reconnects.
    TokenOutage,
    /// A DaemonSet-style rollout of one agent: SIGTERM (drain), a new
    /// agent up, the old one exits once drained.
    Rollout,
}

impl Fault {
    /// Every fault.
    pub const ALL: [Self; 10] = [
        Self::AgentKill,
        Self::ServerKill,
        Self::Partition,
        Self::FrontendStall,
        Self::DestinationStall,
        Self::Slowloris,
        Self::CertRotation,
        Self::CaRotation,
        Self::TokenOutage,
        Self::Rollout,
    ];

    /// Its name in the tables.
    pub fn name(self) -> &'static str {
        match self {
            Self::AgentKill => "agent kill -9",
            Self::ServerKill => "server kill -9",
            Self::Partition => "partition",
            Self::FrontendStall => "frontend stops reading",
            Self::DestinationStall => "destination stops reading",
            Self::Slowloris => "slowloris frontends",
            Self::CertRotation => "certificate rotation",
            Self::CaRotation => "CA rotation",
            Self::TokenOutage => "TokenReview outage",
            Self::Rollout => "agent rollout",
        }
    }

    /// Its name on the command line (`--soak-faults`).
    pub fn flag(self) -> &'static str {
        match self {
            Self::AgentKill => "agent-kill",
            Self::ServerKill => "server-kill",
            Self::Partition => "partition",
            Self::FrontendStall => "frontend-stall",
            Self::DestinationStall => "destination-stall",
            Self::Slowloris => "slowloris",
            Self::CertRotation => "cert-rotation",
            Self::CaRotation => "ca-rotation",
            Self::TokenOutage => "token-outage",
            Self::Rollout => "rollout",
        }
    }

    /// The fault named `flag` on the command line.
    pub fn from_flag(flag: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|f| f.flag() == flag)
    }

    /// The schedule of a timed run, repeated: every fault in turn, the
    /// kills twice as often.
    pub fn schedule(token: bool) -> Vec<Self> {
        let mut all = vec![
            Self::AgentKill,
            Self::Partition,
            Self::ServerKill,
            Self::Rollout,
            Self::FrontendStall,
            Self::DestinationStall,
            Self::CertRotation,
            Self::ServerKill,
            Self::Slowloris,
            Self::AgentKill,
            Self::CaRotation,
        ];
        if token {
            all.insert(3, Self::TokenOutage);
        }
        all
    }

    /// The faults every run must inject (and fails without): an agent and
    /// a server killed, a partition, a stalled destination.
    pub const CORE: [Self; 4] = [
        Self::AgentKill,
        Self::ServerKill,
        Self::Partition,
        Self::DestinationStall,
    ];
}

/// Which agent or server a fault hit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Hit {
    /// The agent of this slot.
    Agent(usize),
    /// This server.
    Server(usize),
    /// No agent or server of the traffic: connections of the fault's own
    /// (a stall, slow peers), or files.
    Elsewhere,
}

/// One slow peer of a slowloris fault.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct SlowPeer {
    /// On the HTTP CONNECT server (else the gRPC one).
    pub http_connect: bool,
    /// Seconds from its connect until the server closed it; `None`: not
    /// closed while it went on.
    pub closed_after: Option<f64>,
}

/// The agent of the old CA a CA rotation starts once the old CA is
/// dropped.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct OldCa {
    /// Whether it was seen connected to a server while it was watched.
    pub connected: bool,
    /// Handshakes the servers refused meanwhile
    /// (`tls_handshakes_dropped_total{reason="failed"}`, summed).
    pub refusals: f64,
}

/// What a fault did, as the driver saw it: the evidence that it took
/// effect, and the figures its own check reads.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub enum Effect {
    /// Nothing recorded (the driver did not get that far).
    Unknown,
    /// A process killed with SIGKILL.
    Killed {
        /// The killed process was reaped, ended by SIGKILL.
        reaped: bool,
    },
    /// An agent's control link taken down.
    Partitioned {
        /// The fewest servers the agent was connected to while cut off
        /// (its own gauge, read through its node link); `None`: never read.
        fewest_servers: Option<f64>,
    },
    /// A stall: tunnels the driver opened to a peer that stops.
    Stalled {
        /// Tunnels opened (one through each server is the plan).
        tunnels: usize,
        /// Of them, those the stalled peer accepted.
        reached: usize,
    },
    /// Slow peers on both servers' frontend sockets.
    Slowloris {
        /// Each peer.
        peers: Vec<SlowPeer>,
    },
    /// New leaves.
    Rotated {
        /// Seconds until an agent with the new files was on both servers.
        admitted_s: Option<f64>,
        /// The serial of the new server certificate file.
        serial: String,
        /// The serial each server presented to a new handshake last, in
        /// server order.
        presented: Vec<String>,
        /// Seconds until every server presented the new file's serial.
        served_s: Option<f64>,
    },
    /// A new CA.
    CaRotated {
        /// Seconds until an agent with the files of each step (both CAs
        /// trusted; new leaves; old CA dropped) was on both servers.
        steps: [Option<f64>; 3],
        /// The agent of the old CA, started after the last step; `None`:
        /// it could not be started.
        old_ca: Option<OldCa>,
    },
    /// The TokenReview API down while an agent reconnects.
    TokenOutage {
        /// The agent was killed (and reaped) to make it reconnect.
        reaped: bool,
        /// Servers it was connected to at the outage's end (its review
        /// may be cached, so this is reported, not judged).
        during: Option<f64>,
    },
    /// One agent rolled out.
    RolledOut {
        /// Seconds from SIGTERM until the old process exited; `None`: not
        /// within the driver's wait.
        exited_s: Option<f64>,
        /// It exited with status 0.
        exit_ok: bool,
        /// Connections it cut (closed as `drain_timeout`, `stream_gone`
        /// or `overflow`) after SIGTERM: at its last `/metrics`, less
        /// those it had cut at the reading just before; `None`: never read.
        cut: Option<f64>,
    },
}

/// What one injected fault showed.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FaultRecord {
    /// Which.
    pub fault: Fault,
    /// The agent or server it hit.
    pub hit: Hit,
    /// What it hit, for the tables.
    pub target: String,
    /// Injected at.
    pub started: Secs,
    /// The fault over (process restarted, link up, stall ended) at.
    pub ended: Secs,
    /// Seconds from the end until the agent(s) concerned were connected
    /// to both servers again (a restarted server: every agent on it).
    pub back_s: Option<f64>,
    /// Seconds from the end until a dial through each server carried an
    /// exchange again.
    pub dials_s: Option<f64>,
    /// Recovered (back and dials) at.
    pub recovered: Secs,
    /// Per traffic frontend: rate during the fault / baseline rate (the
    /// lower of exchanges/s and bulk bytes/s); `None` where the fault took
    /// the frontend's own server.
    pub rates: Vec<Option<f64>>,
    /// The healthy traffic's rate during the fault / its baseline rate:
    /// for a fault on an agent, the exchanges completed through the other
    /// agents (told apart at the destination by their source address);
    /// for a killed server, the other server's frontends; else every
    /// frontend (the lowest of [`Self::rates`]).
    pub healthy: Option<f64>,
    /// What [`Self::healthy`] measured.
    pub healthy_what: String,
    /// Seconds from recovery until RSS, fds and tasks of every process
    /// were within 5 % of their baseline; `None`: not within the wait.
    pub resources_s: Option<f64>,
    /// The figure that did not come back, if any.
    pub resources_note: String,
    /// What it did.
    pub effect: Effect,
    /// Anything else worth a note.
    pub note: String,
}

impl FaultRecord {
    /// `fault` injected at `started` on `hit`, nothing measured yet.
    pub fn new(fault: Fault, hit: Hit, started: Secs) -> Self {
        Self {
            fault,
            hit,
            target: String::new(),
            started,
            ended: started,
            back_s: None,
            dials_s: None,
            recovered: started,
            rates: Vec::new(),
            healthy: None,
            healthy_what: String::new(),
            resources_s: None,
            resources_note: String::new(),
            effect: Effect::Unknown,
            note: String::new(),
        }
    }
}

/// What a process is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Role {
    /// A proxy-server.
    Server,
    /// A proxy-agent.
    Agent,
}

/// Where a process ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Seat {
    /// Server replica `n`.
    Server(usize),
    /// Agent slot `n` (its namespace).
    Agent(usize),
    /// A probe agent, on the host.
    Probe,
}

impl Seat {
    /// Server or agent.
    pub fn role(self) -> Role {
        match self {
            Self::Server(_) => Role::Server,
            Self::Agent(_) | Self::Probe => Role::Agent,
        }
    }

    /// The destination's name for the connections an agent here carries.
    pub fn carrier(self) -> Option<Carrier> {
        match self {
            Self::Server(_) => None,
            Self::Agent(n) => Some(Carrier::Slot(n)),
            Self::Probe => Some(Carrier::Probe),
        }
    }
}

/// The books of one process, from its `/metrics`: connections it opened
/// (dials that succeeded), closed, and has open.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Books {
    /// Established connections so far (`dial_duration_seconds_count`).
    pub opened: f64,
    /// Closed so far (`connections_closed_total`, every reason).
    pub closed: f64,
    /// Open now (the established / open-endpoint gauge).
    pub open: f64,
    /// Of the closed, those an agent cut (`drain_timeout`, `stream_gone`,
    /// `overflow`); 0 for a server.
    pub cut: f64,
}

impl Books {
    /// `opened - closed - open`: 0 when every connection is accounted for.
    pub fn unaccounted(&self) -> f64 {
        self.opened - self.closed - self.open
    }
}

/// One reading of a process's books.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct BookSample {
    /// When the request for it was sent: everything before is counted.
    pub t: Secs,
    /// What it said.
    pub books: Books,
}

/// How a process's life ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum LifeEnd {
    /// Killed with SIGKILL by a fault.
    Killed,
    /// Exited by itself (drained); `ok`: with status 0.
    Exited {
        /// Status 0.
        ok: bool,
    },
    /// Running when the traffic had stopped and settled: its last sample
    /// was read then.
    Running,
}

/// One process from its start to its end: every agent and server process
/// that lived, not only the last of each slot.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Life {
    /// `server-0.2`, `agent-1.3`, `probe-4`.
    pub name: String,
    /// Where it ran.
    pub seat: Seat,
    /// Its process id.
    pub pid: u32,
    /// Started at.
    pub born: Secs,
    /// Ended at (the run's end for one still running).
    pub died: Secs,
    /// How.
    pub end: LifeEnd,
    /// When it was told to drain (SIGTERM), its books read just before:
    /// what it cut after that is the drain's; what it cut before (an
    /// agent's connections through a server that was killed) is not.
    pub drained: Option<Secs>,
    /// Its books, every time they were read, in order.
    pub books: Vec<BookSample>,
}

/// What the run set out to do.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Plan {
    /// mTLS or token.
    pub auth: String,
    /// Agent slots.
    pub agents: usize,
    /// The faults that must have taken effect at least once each.
    pub required: Vec<Fault>,
    /// Whether performance checks fail the run (else they are reported).
    pub performance_fatal: bool,
    /// A dial slower than this, seconds, waited past the servers' dial
    /// timeout (`--backend-dial-timeout` plus scheduling slack).
    pub dial_limit_s: f64,
    /// The command line, for the report.
    pub command: String,
    /// The load, in words, for the report.
    pub load: String,
}

/// Everything the soak observed: the judge's whole input.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ObservedRun {
    /// The plan.
    pub plan: Plan,
    /// Seconds it ran.
    pub seconds: Secs,
    /// Every exchange, as its frontend saw it.
    pub exchanges: Vec<Exchange>,
    /// Every connection, as the destination saw it.
    pub node: Vec<NodeConn>,
    /// Every dial the servers' audit logs recorded.
    pub audited: Vec<Audited>,
    /// The faults, in order.
    pub faults: Vec<FaultRecord>,
    /// Every process that lived.
    pub lives: Vec<Life>,
    /// Per frontend: exchanges started (its own counter), bytes checked.
    pub started: Vec<(Frontend, u64, u64)>,
    /// Every frontend stopped when told to (grpc-go's exited 0).
    pub frontends_stopped: bool,
    /// Seconds from the traffic's end until every book balanced with
    /// nothing open; `None`: not within the driver's wait.
    pub settled_s: Option<f64>,
    /// Samples, one a second (for rates and resource curves).
    pub samples: Vec<Sample>,
    /// The samples' process slots, by name, in sample order.
    pub slot_names: Vec<String>,
    /// Per slot and resource, the baseline.
    pub baseline: Vec<[Option<f64>; 3]>,
    /// The baseline window.
    pub baseline_window: (Secs, Secs),
}

#[cfg(test)]
mod tests {
    use super::Fault;

    #[test]
    fn every_fault_is_found_by_its_own_flag_and_only_by_it() {
        for f in Fault::ALL {
            assert_eq!(Fault::from_flag(f.flag()), Some(f), "{f:?}");
        }
        assert_eq!(Fault::from_flag("no-such-fault"), None);
        assert_eq!(Fault::from_flag(""), None);
        // The faults CI plans (scripts/test's --soak-faults).
        let ci: Vec<_> = "agent-kill,server-kill,partition,destination-stall"
            .split(',')
            .map(Fault::from_flag)
            .collect();
        assert_eq!(ci, Fault::CORE.map(Some));
    }

    #[test]
    fn a_timed_run_schedules_every_fault_and_the_kills_twice() {
        let count = |s: &[Fault], f: Fault| s.iter().filter(|g| **g == f).count();
        let token = Fault::schedule(true);
        for f in Fault::ALL {
            let kills = matches!(f, Fault::AgentKill | Fault::ServerKill);
            assert_eq!(count(&token, f), if kills { 2 } else { 1 }, "{f:?}");
        }
        // Without token auth there is no TokenReview to take down.
        let mtls = Fault::schedule(false);
        assert_eq!(count(&mtls, Fault::TokenOutage), 0);
        assert_eq!(mtls.len(), token.len() - 1);
    }
}

/// A process's allocator at one sample: jemalloc's figures, bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Alloc {
    /// Held by the program (thread caches included).
    pub allocated: f64,
    /// In the pages that hold it.
    pub active: f64,
    /// Freed pages not yet purged.
    pub dirty: f64,
    /// jemalloc's metadata.
    pub metadata: f64,
    /// Resident pages jemalloc maps (at most).
    pub resident: f64,
    /// Address space kept for reuse, not resident.
    pub retained: f64,
}

/// The traffic's counts of one frontend at one moment (for its rates and
/// bytes; the exchanges are judged from their records).
#[derive(Debug, Default, Clone, Copy, PartialEq, Serialize)]
pub struct CountsSnap {
    /// Exchanges started.
    pub started: u64,
    /// Request/response exchanges that carried every byte.
    pub rr_ok: u64,
    /// Bytes checked on bulk exchanges.
    pub bulk_bytes: u64,
    /// Bytes checked on all exchanges.
    pub bytes: u64,
    /// Request/response ticks skipped: the worker had the most exchanges
    /// in flight.
    pub skipped: u64,
}

/// The destination's counts at one moment.
#[derive(Debug, Default, Clone, PartialEq, Serialize)]
pub struct DestSnap {
    /// Connections accepted (every listener).
    pub accepted: u64,
    /// Connections open now.
    pub open: u64,
    /// Requests checked whole and answered.
    pub complete: u64,
    /// Of them, per agent slot (by source address).
    pub complete_by_slot: Vec<u64>,
}

/// One process at one sample.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct ProcSample {
    /// The process.
    pub pid: u32,
    /// Resident memory, bytes.
    pub rss: u64,
    /// Open file descriptors.
    pub fds: u64,
    /// Alive tasks, if `/metrics` answered.
    pub tasks: Option<f64>,
    /// Its books, if `/metrics` answered with them.
    pub books: Option<Books>,
    /// Its allocator's figures, if `/metrics` answered with them.
    pub alloc: Option<Alloc>,
}

/// Everything at one moment.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Sample {
    /// When.
    pub t: Secs,
    /// Per slot, while its process runs.
    pub procs: Vec<Option<ProcSample>>,
    /// Per traffic frontend ([`crate::Frontend::TRAFFIC`] order).
    pub counts: Vec<CountsSnap>,
    /// The destination.
    pub dest: DestSnap,
}
