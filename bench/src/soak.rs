//! The soak (`bench --scenarios soak`): faults under load, judged from
//! what independent witnesses saw.
//!
//! Two proxy-servers behind a haproxy (`--server-count=2`; server 0 speaks
//! gRPC to its frontends, server 1 HTTP CONNECT), `--soak-agents` agents
//! reaching both through the one address, each agent slot in a network
//! namespace of its own, and every kind of frontend at once: our client's
//! single-use gRPC tunnels, grpc-go's single-use and reusable tunnels
//! (`tests/go/frontend soak`), our client's HTTP CONNECT. Each moves
//! request/response exchanges and paced bulk exchanges whose every byte is
//! checked ([`traffic`]) at a destination that records who carried each
//! ([`node`]). Meanwhile the driver injects faults one at a time
//! ([`faults`]), each followed by its recovery, and the watcher reads
//! every process's books and resources ([`watch`]).
//!
//! This module and those are the driver: they produce the observations.
//! The judging is `soak_judge`'s, a crate of its own with no I/O: every
//! exchange's end is excused by a fault on the agent or server that
//! carried it or it is a violation; the witnesses are set against each
//! other; the books of every process that lived are checked; each fault
//! must show its effect; the verdict is computed from the figures the
//! report prints.
//!
//! # Layout
//! - [`system`]: the processes, the namespaces, the certificates, the
//!   TokenReview stand-in.
//! - [`traffic`]: the exchanges and the frontends.
//! - [`node`]: the destination and the stalled peers' listeners.
//! - [`faults`]: the faults, their evidence and recovery.
//! - [`sabotage`]: breaking a healthy agent on purpose, to show the judge
//!   failing (`--soak-sabotage`).
//! - [`watch`]: the samples, and every process's life and books.

pub mod faults;
pub mod leaf;
pub mod node;
pub mod sabotage;
pub mod system;
pub mod traffic;
pub mod watch;

use std::{
    path::PathBuf,
    sync::{Arc, Mutex},
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use anyhow::Context;
use integration_tests::proxies::ProxyProcess;
use soak_judge::{
    Fault, FaultRecord, Figures, Frontend, Hit, Judgement, ObservedRun, Plan, Role, Seat,
    samples::{self, Resource, Sample},
};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use self::{
    faults::FaultTimes,
    node::{NodeListener, NodeLog, StallListener},
    system::{
        AgentPod, AgentSetup, Auth, DEST_IP, FrontendMode, FrontendPki, Namespaces, RotatingPki,
        Server, ServerSetup, Tokens,
    },
    traffic::{Counts, ExchangeLog, Front, GoSoak, Load, Maker},
    watch::{Lives, Samples, Slot, Slots, WatchSet, lock},
};
use crate::system::Binaries;

/// How long a resource has to come back when performance checks fail the
/// run.
pub const RESOURCE_LIMIT: Duration = Duration::from_secs(60);
/// How long a resource has to come back when they are only reported
/// (`--soak-performance-advisory`): short, so that the planned faults all
/// run within CI's budget.
pub const ADVISORY_RESOURCE_WAIT: Duration = Duration::from_secs(3);
/// The window whose least value is compared with the baseline (traffic
/// keeps short-lived connections, and their descriptors and tasks, coming
/// and going).
pub const RESOURCE_WINDOW: f64 = 10.0;
/// Shortest window a rate is measured over.
const RATE_WINDOW: f64 = 10.0;
/// Shortest window a rate is measured over when performance is only
/// reported: the short runs' faults last 6 s and more.
const ADVISORY_RATE_WINDOW: f64 = 4.0;

/// Shortest window a fault's rates are measured over.
fn rate_window(opt: &SoakOpt) -> f64 {
    if opt.performance_fatal {
        RATE_WINDOW
    } else {
        ADVISORY_RATE_WINDOW
    }
}
/// `--backend-dial-timeout` of the servers; a dial slower than this (plus
/// [`DIAL_SLACK`]) waited past its timeout.
pub const DIAL_TIMEOUT: Duration = Duration::from_secs(5);
/// Scheduling slack on top of [`DIAL_TIMEOUT`] on a loaded 2-core machine.
const DIAL_SLACK: Duration = Duration::from_secs(2);
/// How long the books may take to settle once the traffic stops.
const QUIESCE: Duration = Duration::from_secs(60);

/// The run's clock: seconds since the start, for every witness.
#[derive(Debug, Clone, Copy)]
pub struct RunClock {
    /// The start.
    start: Instant,
    /// The start in Unix nanoseconds (for the grpc-go frontend's times).
    start_unix_ns: i128,
}

impl RunClock {
    /// Starts now.
    pub fn new() -> Self {
        let start_unix_ns = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as i128);
        Self {
            start: Instant::now(),
            start_unix_ns,
        }
    }

    /// Seconds since the start.
    pub fn now(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }

    /// The seconds since the start of the Unix time `ns`.
    pub fn from_unix_nanos(&self, ns: i64) -> f64 {
        (i128::from(ns) - self.start_unix_ns) as f64 / 1e9
    }
}

impl Default for RunClock {
    fn default() -> Self {
        Self::new()
    }
}

/// The soak's settings.
#[derive(Debug, Clone)]
pub struct SoakOpt {
    /// How long a timed run goes on, faults and all.
    pub duration: Duration,
    /// The faults to inject once each, in order, instead of the timed
    /// schedule; the run ends after the last one's recovery.
    pub faults: Option<Vec<Fault>>,
    /// How long the holding faults last.
    pub times: FaultTimes,
    /// Agents' authentication.
    pub auth: Auth,
    /// Agents.
    pub agents: usize,
    /// Each frontend's load.
    pub load: Load,
    /// The grpc-go frontend.
    pub go_frontend: PathBuf,
    /// Where the Markdown goes.
    pub markdown: PathBuf,
    /// Where the samples go (JSON), if anywhere.
    pub samples: Option<PathBuf>,
    /// Whether the performance checks (resources back within 5 % in a
    /// minute, healthy traffic's rate kept) fail the run. The short variant
    /// only reports them: its baseline falls in the processes' first
    /// minute, while RSS still climbs and connections in flight settle, and
    /// a few seconds' rate on a 2-core machine running debug binaries is
    /// noise. Correctness always fails it.
    pub performance_fatal: bool,
    /// Break a healthy agent on purpose; the run then passes only when the
    /// judge catches exactly that.
    pub sabotage: bool,
}

/// Everything running, owned by the orchestrator.
pub struct World {
    /// The binaries.
    pub bins: Binaries,
    /// The agent slots' namespaces.
    pub ns: Namespaces,
    /// The certificates.
    pub pki: RotatingPki,
    /// Token mode's stand-in.
    pub tokens: Option<Tokens>,
    /// Server 0 (gRPC), server 1 (HTTP CONNECT).
    pub servers: Vec<Server>,
    /// The load balancer.
    pub lb: ProxyProcess,
    /// The agents.
    pub agents: Vec<AgentPod>,
    /// Agents' flags.
    pub agent_setup: AgentSetup,
    /// What the node side saw.
    pub node: Arc<NodeLog>,
    /// The checked destination.
    pub dest: NodeListener,
    /// An endless writer (the stalled frontends' downloads).
    pub source: NodeListener,
    /// A destination that never reads.
    pub stall: StallListener,
    /// Every exchange's record.
    pub exchanges: ExchangeLog,
    /// Shared with the watcher.
    pub slots: Slots,
    /// Every process's life.
    pub lives: Arc<Lives>,
    /// The run's clock.
    pub clock: RunClock,
    /// Probe agents started so far.
    pub probes: usize,
    /// The agent slot partitions cut off.
    pub partitioned: usize,
    /// How long the holding faults last.
    pub times: FaultTimes,
    /// Destroy a killed agent's destination sockets just before its kill
    /// (the sabotage's recorded kill).
    pub close_before_kill: bool,
    /// The sabotage's relays, killed at the run's end at the latest.
    pub relays: Vec<tokio::process::Child>,
    /// Files and logs.
    pub root: tempfile::TempDir,
}

impl World {
    /// Sets the watcher's slots from the processes now running.
    pub fn update_slots(&self) {
        let mut slots: Vec<Slot> = self
            .servers
            .iter()
            .map(|s| Slot {
                name: format!("server-{}", s.index),
                role: Role::Server,
                pid: s.pid(),
                metrics: Some(s.health),
            })
            .collect();
        slots.extend(self.agents.iter().map(|a| Slot {
            name: format!("agent-{}", a.index),
            role: Role::Agent,
            pid: a.pid(),
            metrics: Some(a.health),
        }));
        *lock(&self.slots) = slots;
    }
}

/// What a soak observed and found.
#[derive(Debug, Clone)]
pub struct SoakResult {
    /// Everything observed.
    pub run: ObservedRun,
    /// The figures.
    pub figures: Figures,
    /// The verdict on them.
    pub verdict: Judgement,
}

/// Runs the soak: the system up, the traffic on, a baseline, the faults
/// one at a time, then the traffic stopped and everything judged.
///
/// # Errors
/// The system cannot be set up (no root for the namespaces, a binary or
/// haproxy missing), or a process cannot be started again.
pub async fn run(bins: Binaries, opt: SoakOpt) -> anyhow::Result<SoakResult> {
    let mut world = World::start(bins, &opt).await?;
    world.connect_agents().await?;
    let traffic = Traffic::start(&world, &opt)?;
    let baseline = Baseline::measure(&world, &traffic.samples, &opt).await;
    let mut records = Vec::new();
    let mut sabotaged = Vec::new();
    if opt.sabotage {
        sabotaged = sabotage::run(&mut world, &mut records).await?;
        let s = lock(&traffic.samples);
        for record in &mut records {
            record.rates = kind_rates(&s, &baseline, record, rate_window(&opt));
            (record.healthy, record.healthy_what) = {
                let (h, what) = healthy_rate(&s, &baseline, record, rate_window(&opt));
                (h, what.to_owned())
            };
        }
    } else {
        records = inject_faults(&mut world, &opt, &traffic, &baseline).await?;
        let remaining = opt.duration.as_secs_f64() - world.now();
        if opt.faults.is_none() && remaining > 0.0 {
            tokio::time::sleep(Duration::from_secs_f64(remaining)).await;
        }
    }
    let end = traffic.stop(&world).await;
    let run = observed(&world, &opt, records, end, baseline);
    let figures = soak_judge::judge(&run);
    let mut verdict = figures.verdict();
    if opt.sabotage {
        verdict = sabotage::expect(&figures, &verdict, &sabotaged);
    }
    let result = SoakResult {
        run,
        figures,
        verdict,
    };
    write_outputs(&result, &opt, world)?;
    Ok(result)
}

impl World {
    /// The namespaces, the certificates, the two servers behind haproxy,
    /// the destinations; the agents not started yet.
    async fn start(bins: Binaries, opt: &SoakOpt) -> anyhow::Result<Self> {
        let clock = RunClock::new();
        let root = tempfile::Builder::new()
            .prefix("konnectivity-soak-")
            .tempdir()
            .context("creating a temporary directory")?;
        eprintln!("soak: files and logs in {}", root.path().display());
        let agents = opt.agents.max(3);
        let ns = Namespaces::create(agents).context("the soak needs root for `ip netns`")?;
        let pki = RotatingPki::new(root.path())?;
        let tokens = match opt.auth {
            Auth::Mtls => None,
            Auth::Token => Some(Tokens::start(root.path()).await?),
        };
        let frontend = FrontendPki::new(root.path())?;
        let setup = ServerSetup {
            root: root.path(),
            pki: &pki,
            frontend: &frontend,
            tokens: tokens.as_ref(),
            dial_timeout: DIAL_TIMEOUT,
            keepalive: Duration::from_secs(2),
        };
        let lives = Arc::new(Lives::default());
        let mut servers = Vec::new();
        for (i, mode) in [FrontendMode::Grpc, FrontendMode::HttpConnect]
            .into_iter()
            .enumerate()
        {
            let server = Server::start(&bins, &setup, i, mode).await?;
            if let Some(pid) = server.pid() {
                lives.born(format!("server-{i}.1"), Seat::Server(i), pid, clock.now());
            }
            servers.push(server);
        }
        eprintln!("soak: {:.1} s: both servers answer", clock.now());
        let lb = system::load_balancer(&[&servers[0], &servers[1]]).await;
        eprintln!("soak: {:.1} s: haproxy up", clock.now());
        let agent_setup = AgentSetup::new(root.path(), &pki.agent_dir, tokens.as_ref(), lb.addr);
        let node = NodeLog::new(agents, clock);
        let dest = node::destination(DEST_IP, node.clone())?;
        let source = node::source(DEST_IP, node.clone())?;
        let stall = StallListener::start(DEST_IP, node.clone())?;
        Ok(Self {
            bins,
            pki,
            tokens,
            servers,
            lb,
            agents: (0..agents)
                .map(|i| AgentPod::new(i, ns.name(i).map(str::to_owned)))
                .collect(),
            ns,
            agent_setup,
            node,
            dest,
            source,
            stall,
            exchanges: Arc::default(),
            slots: Arc::new(Mutex::new(Vec::new())),
            lives,
            clock,
            probes: 0,
            partitioned: 0,
            times: opt.times,
            close_before_kill: false,
            relays: Vec::new(),
            root,
        })
    }

    /// Starts every agent and waits until each is connected to both
    /// servers.
    async fn connect_agents(&mut self) -> anyhow::Result<()> {
        for i in 0..self.agents.len() {
            self.start_agent(i)?;
        }
        for agent in &self.agents {
            let took = faults::agent_back(agent).await.with_context(|| {
                format!("agent-{} did not connect to both servers", agent.index)
            })?;
            eprintln!(
                "soak: {:.1} s: agent-{} on both servers ({:.1} s)",
                self.now(),
                agent.index,
                took.as_secs_f64()
            );
        }
        eprintln!(
            "soak: {:.0} s: {} agents connected to both servers",
            self.now(),
            self.agents.len()
        );
        Ok(())
    }
}

/// The frontends' traffic and the watcher sampling it, running.
struct Traffic {
    /// Per traffic frontend ([`Frontend::TRAFFIC`] order).
    counts: Vec<Arc<Counts>>,
    /// Stops our frontends' workers.
    stop: CancellationToken,
    /// Our frontends' workers.
    workers: JoinSet<()>,
    /// The grpc-go frontends.
    gos: Vec<GoSoak>,
    /// What the watcher sampled so far.
    samples: Samples,
    /// What the watcher reads.
    watched: WatchSet,
    /// Stops the watcher.
    watching: CancellationToken,
    /// The watcher.
    watcher: tokio::task::JoinHandle<()>,
}

/// What is left once the traffic has stopped.
struct TrafficEnd {
    /// Every sample taken while the traffic ran, and after.
    samples: Vec<Sample>,
    /// Every frontend stopped when told to.
    stopped: bool,
    /// Seconds until the books settled.
    settled_s: Option<f64>,
}

impl Traffic {
    /// Starts every kind of frontend against its server, and the watcher.
    fn start(world: &World, opt: &SoakOpt) -> anyhow::Result<Self> {
        let counts: Vec<Arc<Counts>> = Frontend::TRAFFIC.iter().map(|_| Arc::default()).collect();
        let stop = CancellationToken::new();
        let mut workers = JoinSet::new();
        let mut gos = Vec::new();
        for (frontend, counts) in Frontend::TRAFFIC.iter().zip(&counts) {
            let server = frontend.server().unwrap_or(0);
            let uds = world.servers[server].uds.clone();
            let front = match frontend {
                Frontend::ConnectOurs => world.front(server),
                _ => Front::Grpc(uds.clone()),
            };
            let maker = Maker {
                front,
                frontend: *frontend,
                server,
                clock: world.clock,
            };
            if matches!(frontend, Frontend::GrpcGoSingle | Frontend::GrpcGoReused) {
                gos.push(GoSoak::start(
                    &opt.go_frontend,
                    &uds,
                    &maker,
                    world.dest.addr,
                    opt.load,
                    counts.clone(),
                    world.exchanges.clone(),
                    &world.root.path().join(format!("go-{}.log", gos.len())),
                )?);
                continue;
            }
            traffic::spawn_ours(
                &mut workers,
                &maker,
                world.dest.addr,
                opt.load,
                counts,
                &world.exchanges,
                &stop,
            );
        }
        let samples: Samples = Arc::default();
        let watched = WatchSet {
            clock: world.clock,
            slots: world.slots.clone(),
            lives: world.lives.clone(),
            counts: counts.clone(),
            node: world.node.clone(),
        };
        let watching = CancellationToken::new();
        let watcher = tokio::spawn(watch::run(
            watched.clone(),
            samples.clone(),
            watching.clone(),
        ));
        Ok(Self {
            counts,
            stop,
            workers,
            gos,
            samples,
            watched,
            watching,
            watcher,
        })
    }

    /// Stops the frontends, waits up to [`QUIESCE`] for the books to
    /// balance with nothing open, stops the watcher, and reads every
    /// running process's books once more.
    async fn stop(mut self, world: &World) -> TrafficEnd {
        eprintln!("soak: {:.0} s: stopping the traffic", world.now());
        self.stop.cancel();
        while self.workers.join_next().await.is_some() {}
        let mut stopped = true;
        for go in self.gos {
            if !go.finish(Duration::from_secs(90)).await {
                eprintln!("soak: a grpc-go frontend did not stop cleanly");
                stopped = false;
            }
        }
        self.watching.cancel();
        let _ = self.watcher.await;
        let stopped_at = Instant::now();
        let watched = &self.watched;
        let settled = until_polled(QUIESCE, || async {
            let s = watch::sample(watched).await;
            let quiet = s.dest.open == 0
                && s.procs.iter().flatten().all(|p| {
                    p.books
                        .is_some_and(|b| b.open == 0.0 && b.unaccounted() == 0.0)
                });
            lock(&self.samples).push(s);
            quiet
        })
        .await;
        let settled_s = settled.then(|| stopped_at.elapsed().as_secs_f64());
        // The last reading of every running process: the one the judge
        // holds to exact books.
        let last = watch::sample(watched).await;
        lock(&self.samples).push(last);
        let samples = std::mem::take(&mut *lock(&self.samples));
        drop(self.counts);
        TrafficEnd {
            samples,
            stopped,
            settled_s,
        }
    }
}

/// What the faults are compared with: the least resources and the rates
/// over a window after the warm-up.
struct Baseline {
    /// Per slot, per [`Resource`]: the typical least over the window.
    resources: Vec<[Option<f64>; 3]>,
    /// Per traffic frontend: exchanges/s and bulk bytes/s.
    rates: Vec<(f64, f64)>,
    /// At the destination: exchanges/s completed through each agent slot.
    dest: Vec<f64>,
    /// The window, seconds since the start.
    window: (f64, f64),
}

impl Baseline {
    /// Waits out the warm-up and the window (longer in a longer run, short
    /// when performance is only reported), then measures the baseline and
    /// logs its rates.
    async fn measure(world: &World, samples: &Samples, opt: &SoakOpt) -> Self {
        let total = opt.duration.as_secs_f64();
        // Long enough, in a long run, for RSS to reach its plateau
        // (allocator caches, connection pools): the first minutes under
        // traffic grow.
        let (warmup, window) = if opt.performance_fatal {
            (
                (total / 20.0).clamp(30.0, 180.0),
                (total / 12.0).clamp(10.0, 60.0),
            )
        } else {
            // Performance is only reported: what the faults' healthy rates
            // are set against, and no more.
            (5.0, 8.0)
        };
        tokio::time::sleep(Duration::from_secs_f64(warmup + window)).await;
        let (from, to) = (world.now() - window, world.now());
        let baseline = {
            let s = lock(samples);
            Self {
                resources: (0..world.agents.len() + 2)
                    .map(|slot| {
                        Resource::ALL.map(|r| {
                            samples::typical_least(&s, slot, r, (from, to), RESOURCE_WINDOW)
                        })
                    })
                    .collect(),
                rates: (0..Frontend::TRAFFIC.len())
                    .map(|i| {
                        (
                            samples::rate(&s, i, from, to, |c| c.rr_ok).unwrap_or(0.0),
                            samples::rate(&s, i, from, to, |c| c.bulk_bytes).unwrap_or(0.0),
                        )
                    })
                    .collect(),
                dest: (0..world.agents.len())
                    .map(|slot| {
                        samples::dest_rate(&s, from, to, &|d| {
                            d.complete_by_slot.get(slot).copied().unwrap_or(0)
                        })
                        .unwrap_or(0.0)
                    })
                    .collect(),
                window: (from, to),
            }
        };
        baseline.log();
        baseline
    }

    /// Logs the baseline's rates.
    fn log(&self) {
        eprintln!(
            "soak: baseline over {:.0}-{:.0} s at the destination, exchanges/s per agent: {}",
            self.window.0,
            self.window.1,
            self.dest
                .iter()
                .map(|r| format!("{r:.1}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
        for (frontend, (rr, bulk)) in Frontend::TRAFFIC.iter().zip(&self.rates) {
            eprintln!(
                "soak: baseline {}: {rr:.1} exchanges/s, {:.1} MB/s bulk",
                frontend.name(),
                bulk / 1e6
            );
        }
    }
}

/// Which agent or server the next fault of each kind takes: each in turn.
struct Targets {
    /// The next agent killed or whose TokenReview fails.
    agent: usize,
    /// The next server killed.
    server: usize,
    /// The next agent rolled out.
    rollout: usize,
}

impl Targets {
    /// The target of `fault` among `agents` agents and two servers; 0
    /// where the fault has none.
    fn next(&mut self, fault: Fault, agents: usize) -> usize {
        let (next, of) = match fault {
            Fault::AgentKill | Fault::TokenOutage => (&mut self.agent, agents),
            Fault::ServerKill => (&mut self.server, 2),
            Fault::Rollout => (&mut self.rollout, agents),
            _ => return 0,
        };
        let t = *next;
        *next = (*next + 1) % of;
        t
    }
}

/// Rough seconds a fault takes with its recovery, so that the last one
/// of a timed run ends within it.
fn estimate(fault: Fault, times: FaultTimes) -> f64 {
    let hold = times.hold.as_secs_f64();
    match fault {
        Fault::Slowloris => 90.0,
        Fault::FrontendStall | Fault::DestinationStall | Fault::TokenOutage => hold + 15.0,
        Fault::Partition => times.partition.as_secs_f64() + 20.0,
        Fault::CaRotation => 30.0,
        _ => 20.0,
    }
}

/// Injects the faults: the planned ones once each in order, or the
/// schedule in turn until the next would not end within the run (at least
/// one). Each is measured once recovered; its performance figures are
/// logged as it goes.
async fn inject_faults(
    world: &mut World,
    opt: &SoakOpt,
    traffic: &Traffic,
    baseline: &Baseline,
) -> anyhow::Result<Vec<FaultRecord>> {
    let mut records = Vec::new();
    let mut targets = Targets {
        agent: 1,
        server: 0,
        rollout: 1,
    };
    let end_by = opt.duration.as_secs_f64() - 5.0;
    let schedule = Fault::schedule(opt.auth == Auth::Token);
    let planned = opt.faults.is_some();
    let faults: Box<dyn Iterator<Item = Fault>> = match &opt.faults {
        Some(list) => Box::new(list.clone().into_iter()),
        None => Box::new(schedule.into_iter().cycle()),
    };
    for (n, fault) in faults.enumerate() {
        if !planned && world.now() + estimate(fault, opt.times) > end_by && n > 0 {
            break;
        }
        let target = targets.next(fault, world.agents.len());
        eprintln!("soak: {:.0} s: {} ...", world.now(), fault.name());
        let mut record = world.inject(fault, target).await?;
        wait_resources(world, &traffic.samples, baseline, &mut record, opt).await;
        // A short fault's rates need samples over a window of their own.
        let window = rate_window(opt);
        let covered = record.started + window + 1.5;
        if world.now() < covered {
            tokio::time::sleep(Duration::from_secs_f64(covered - world.now())).await;
        }
        record.rates = kind_rates(&lock(&traffic.samples), baseline, &record, window);
        let (healthy, what) = healthy_rate(&lock(&traffic.samples), baseline, &record, window);
        record.healthy = healthy;
        record.healthy_what = what.to_owned();
        log_fault(world.now(), &record);
        records.push(record);
        if !planned && world.now() >= end_by {
            break;
        }
    }
    Ok(records)
}

/// Waits, a second at a time, until every resource is within 5 % of the
/// baseline or the wait is over ([`RESOURCE_LIMIT`] since the recovery;
/// [`ADVISORY_RESOURCE_WAIT`] when performance is only reported); records
/// which.
async fn wait_resources(
    world: &World,
    samples: &Samples,
    baseline: &Baseline,
    record: &mut FaultRecord,
    opt: &SoakOpt,
) {
    let wait = if opt.performance_fatal {
        RESOURCE_LIMIT
    } else {
        ADVISORY_RESOURCE_WAIT
    };
    let limit = record.recovered + wait.as_secs_f64();
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let now = world.now();
        let worst = samples::worst_resource(
            &lock(samples),
            &baseline.resources,
            (now - RESOURCE_WINDOW, now),
            record.recovered,
        );
        match worst {
            None => {
                record.resources_s = Some((now - record.recovered).max(0.0));
                break;
            }
            Some(what) if now >= limit => {
                record.resources_note = what;
                break;
            }
            Some(_) => {}
        }
    }
}

/// Per traffic frontend, its rate while the fault was on (at least
/// `window` seconds) against its baseline: the lower of exchanges/s and
/// bulk bytes/s; `None` for the frontends whose own server the fault
/// killed.
fn kind_rates(
    s: &[Sample],
    baseline: &Baseline,
    record: &FaultRecord,
    window: f64,
) -> Vec<Option<f64>> {
    let to = record.recovered.max(record.started + window);
    Frontend::TRAFFIC
        .iter()
        .zip(&baseline.rates)
        .enumerate()
        .map(|(i, (frontend, (rr, bulk)))| {
            if record.fault == Fault::ServerKill
                && record.hit == Hit::Server(frontend.server().unwrap_or(0))
            {
                return None;
            }
            let r = samples::rate(s, i, record.started, to, |c| c.rr_ok)? / rr;
            let b = samples::rate(s, i, record.started, to, |c| c.bulk_bytes)? / bulk;
            Some(r.min(b))
        })
        .collect()
}

/// The rate of the traffic the fault should have spared, against its
/// baseline, and what that traffic is: through the other agents (told
/// apart at the destination by their source address) for a fault on an
/// agent, else the lowest of the record's rates.
fn healthy_rate(
    s: &[Sample],
    baseline: &Baseline,
    record: &FaultRecord,
    window: f64,
) -> (Option<f64>, &'static str) {
    let to = record.recovered.max(record.started + window);
    match record.hit {
        Hit::Agent(a) => {
            let others = |d: &samples::DestSnap| -> u64 {
                d.complete_by_slot
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| *i != a)
                    .map(|(_, c)| *c)
                    .sum()
            };
            let base: f64 = baseline
                .dest
                .iter()
                .enumerate()
                .filter(|(i, _)| *i != a)
                .map(|(_, r)| r)
                .sum();
            (
                samples::dest_rate(s, record.started, to, &others).map(|r| r / base),
                "through the other agents",
            )
        }
        _ => (
            record.rates.iter().flatten().copied().reduce(f64::min),
            if record.fault == Fault::ServerKill {
                "the other server's frontends"
            } else {
                "every frontend"
            },
        ),
    }
}

/// Logs what one fault showed, at `now`.
fn log_fault(now: f64, record: &FaultRecord) {
    let secs = soak_judge::report::secs;
    eprintln!(
        "soak: {:.0} s: {} on {}: {}; back {}, dials {}, healthy rate {}, all rates {}, resources {}{}",
        now,
        record.fault.name(),
        record.target,
        soak_judge::faults::effect_note(&record.effect),
        secs(record.back_s),
        secs(record.dials_s),
        record.healthy.map_or("?".to_owned(), |r| format!("{r:.2}")),
        record
            .rates
            .iter()
            .map(|r| r.map_or("-".to_owned(), |r| format!("{r:.2}")))
            .collect::<Vec<_>>()
            .join("/"),
        secs(record.resources_s),
        if record.note.is_empty() {
            String::new()
        } else {
            format!(" ({})", record.note)
        }
    );
}

/// Everything the run observed, for the judge.
fn observed(
    world: &World,
    opt: &SoakOpt,
    faults: Vec<FaultRecord>,
    end: TrafficEnd,
    baseline: Baseline,
) -> ObservedRun {
    let now = world.now();
    let required = match &opt.faults {
        Some(planned) => {
            let mut all = planned.clone();
            all.dedup();
            all
        }
        None if opt.sabotage => vec![Fault::AgentKill],
        None => Fault::CORE.to_vec(),
    };
    let last = end.samples.last();
    let started = Frontend::TRAFFIC
        .iter()
        .enumerate()
        .map(|(i, f)| {
            let c = last
                .and_then(|s| s.counts.get(i))
                .copied()
                .unwrap_or_default();
            (*f, c.started, c.bytes)
        })
        .collect();
    ObservedRun {
        plan: Plan {
            auth: opt.auth.name().to_owned(),
            agents: world.agents.len(),
            required,
            performance_fatal: opt.performance_fatal,
            dial_limit_s: dial_limit().as_secs_f64(),
            command: std::env::args().collect::<Vec<_>>().join(" "),
            load: format!(
                "Load per frontend: {} request/response workers (one exchange each per {:?}, \
                 1-16 KiB up, 1-64 KiB down), {} bulk worker(s) ({} MiB up or down per exchange \
                 at {:.1} MB/s).",
                opt.load.rr_workers,
                opt.load.interval,
                opt.load.bulk_workers,
                opt.load.bulk_bytes / (1024 * 1024),
                opt.load.bulk_rate as f64 / 1e6
            ),
        },
        seconds: now,
        exchanges: std::mem::take(&mut *lock(&world.exchanges)),
        node: world.node.take(),
        // The servers lived until now: their records of every dial that
        // ended are written (their writer lingers 20 ms at most).
        audited: system::read_audited(world.root.path(), world.servers.len(), world.clock),
        faults,
        lives: world.lives.take(now),
        started,
        frontends_stopped: end.stopped,
        settled_s: end.settled_s,
        samples: end.samples,
        slot_names: lock(&world.slots).iter().map(|s| s.name.clone()).collect(),
        baseline: baseline.resources,
        baseline_window: baseline.window,
    }
}

/// Writes the Markdown and, if asked for, the samples; keeps the files
/// and logs if the verdict failed.
fn write_outputs(result: &SoakResult, opt: &SoakOpt, world: World) -> anyhow::Result<()> {
    let markdown = soak_judge::report::markdown(&result.run, &result.figures);
    std::fs::write(&opt.markdown, markdown)
        .with_context(|| format!("writing {}", opt.markdown.display()))?;
    eprintln!("soak: tables in {}", opt.markdown.display());
    if let Some(path) = &opt.samples {
        let json = serde_json::json!({
            "slots": result.run.slot_names,
            "samples": result.run.samples,
        });
        std::fs::write(path, json.to_string())
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!("soak: samples in {}", path.display());
    }
    if !result.verdict.held() || opt.sabotage {
        let kept = world.root.keep();
        eprintln!("soak: files and logs kept in {}", kept.display());
    }
    Ok(())
}

/// Polls `done` every 500 ms up to `limit`.
async fn until_polled<F, Fut>(limit: Duration, mut done: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    loop {
        if done().await {
            return true;
        }
        if start.elapsed() >= limit {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// The dial limit the frontends count against.
pub fn dial_limit() -> Duration {
    DIAL_TIMEOUT + DIAL_SLACK
}

#[cfg(test)]
mod tests {
    use super::{RunClock, Targets};
    use soak_judge::Fault;

    #[test]
    fn each_fault_takes_the_next_agent_or_server_in_turn() {
        let mut targets = Targets {
            agent: 1,
            server: 0,
            rollout: 1,
        };
        let taken: Vec<usize> = [
            Fault::AgentKill,
            Fault::TokenOutage,
            Fault::AgentKill,
            Fault::ServerKill,
            Fault::ServerKill,
            Fault::ServerKill,
            Fault::Rollout,
            Fault::Partition,
            Fault::Rollout,
        ]
        .into_iter()
        .map(|fault| targets.next(fault, 3))
        .collect();
        assert_eq!(taken, [1, 2, 0, 0, 1, 0, 1, 0, 2]);
    }

    #[test]
    fn the_clock_converts_unix_time_to_the_runs_seconds() {
        let clock = RunClock::new();
        let now_ns = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as i64;
        let then = clock.from_unix_nanos(now_ns);
        assert!(
            (then - clock.now()).abs() < 0.5,
            "{then} vs {}",
            clock.now()
        );
        assert!((clock.from_unix_nanos(now_ns + 2_000_000_000) - then - 2.0).abs() < 1e-6);
    }
}
