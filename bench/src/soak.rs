//! The soak (`bench --scenarios soak`): an hour (`--soak-duration`) of
//! faults under load, the books checked throughout.
//!
//! Two proxy-servers behind a haproxy (`--server-count=2`; server 0 speaks
//! gRPC to its frontends, server 1 HTTP CONNECT), `--soak-agents` agents
//! reaching both through the one address (agent 0 in a network namespace
//! of its own), and every kind of frontend at once: our client's
//! single-use gRPC tunnels, grpc-go's single-use and reusable tunnels
//! (`tests/go/frontend soak`), our client's HTTP CONNECT. Each moves
//! request/response exchanges and paced bulk exchanges whose every byte is
//! checked ([`traffic`]). Meanwhile a schedule injects faults
//! ([`faults::Fault::schedule`]), one at a time, each followed by the
//! checks of its recovery.
//!
//! Checked: no byte lost or altered without an error, at either end; the
//! books of every process (connections opened = closed + open, from its
//! own `/metrics`) throughout and exactly once the traffic has stopped; no
//! dial waiting past its timeout; after each fault, RSS, descriptors and
//! tasks of every process back within 5 % of their baseline within a
//! minute; while a fault is on another agent or connection, every
//! frontend keeping 90 % of its rate. A violation fails the run.
//!
//! # Layout
//! - [`system`]: the processes, the namespace, the certificates, the
//!   TokenReview stand-in.
//! - [`traffic`]: the exchanges, the destination, the frontends.
//! - [`faults`]: the faults and their recovery.
//! - [`watch`]: the samples (resources, books, counts).
//! - [`table`]: the Markdown for `docs/reliability.md`.

pub mod faults;
pub mod system;
pub mod table;
pub mod traffic;
pub mod watch;

use std::{
    path::PathBuf,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use anyhow::Context;
use integration_tests::{destination, proxies::ProxyProcess};
use serde::Serialize;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use self::{
    faults::{Fault, FaultRecord},
    system::{
        AgentPod, AgentSetup, Auth, DEST_IP, FrontendMode, Namespace, RotatingPki, Server,
        ServerSetup, Tokens,
    },
    traffic::{Counts, CountsSnap, DestSnap, Destination, Front, GoSoak, Kind, Load},
    watch::{Books, Resource, Role, Sample, Samples, Slot, Slots, lock},
};
use crate::system::Binaries;

/// How far a resource may stay above its baseline after a fault.
pub const RESOURCE_SLACK: f64 = 0.05;
/// How long a resource has to come back.
pub const RESOURCE_LIMIT: Duration = Duration::from_secs(60);
/// The window whose least value is compared with the baseline (traffic
/// keeps short-lived connections, and their descriptors and tasks, coming
/// and going).
pub const RESOURCE_WINDOW: f64 = 10.0;
/// The share of its rate healthy traffic must keep.
pub const RATE_KEPT: f64 = 0.9;
/// Shortest window a rate is measured over.
const RATE_WINDOW: f64 = 10.0;
/// `--backend-dial-timeout` of the servers; a dial slower than this (plus
/// [`DIAL_SLACK`]) waited past its timeout.
pub const DIAL_TIMEOUT: Duration = Duration::from_secs(5);
/// Scheduling slack on top of [`DIAL_TIMEOUT`] on a loaded 2-core machine.
const DIAL_SLACK: Duration = Duration::from_secs(2);
/// How long the books may take to settle once the traffic stops.
const QUIESCE: Duration = Duration::from_secs(60);

/// The soak's settings.
#[derive(Debug, Clone)]
pub struct SoakOpt {
    /// How long it runs, faults and all.
    pub duration: Duration,
    /// Agents' authentication.
    pub auth: Auth,
    /// Agents (agent 0 in the namespace).
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
    /// noise. Correctness (bytes, books, recovery, dial deadlines) always
    /// fails it.
    pub performance_fatal: bool,
}

/// Everything running, owned by the orchestrator.
pub struct World {
    /// The binaries.
    pub bins: Binaries,
    /// The namespace of agent 0.
    pub ns: Namespace,
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
    /// The checked destination.
    pub dest: Destination,
    /// An endless writer (the stalled frontend's download).
    pub source: destination::Destination,
    /// A destination that never reads.
    pub stall: destination::Stall,
    /// Shared with the watcher.
    pub slots: Slots,
    /// When the soak started.
    pub start: Instant,
    /// Probe agents started so far.
    pub probes: usize,
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

/// What a soak found.
#[derive(Debug, Clone, Serialize)]
pub struct SoakResult {
    /// mTLS or token.
    pub auth: String,
    /// Seconds it ran.
    pub seconds: f64,
    /// Agents.
    pub agents: usize,
    /// The faults, in order.
    pub faults: Vec<FaultRecord>,
    /// Per frontend kind, at the end.
    pub counts: Vec<(String, CountsSnap)>,
    /// The destination at the end.
    pub dest: DestSnap,
    /// Of its truncated requests, those whose agent was killed with
    /// SIGKILL (its kernel closed the socket with a FIN).
    pub dest_killed: u64,
    /// HTTP CONNECT tunnels cut by a killed or partitioned agent or a
    /// killed server: an EOF, the only end CONNECT on a Unix socket has.
    pub cut_excused: u64,
    /// Per slot, the books once the traffic stopped.
    pub books: Vec<(String, Option<Books>)>,
    /// The largest |opened - closed - open| seen in a sample while
    /// traffic ran, per slot.
    pub books_drift: Vec<(String, f64)>,
    /// Per slot and resource, the baseline (least over the baseline
    /// window).
    pub baseline: Vec<(String, [Option<f64>; 3])>,
    /// The baseline window, seconds since the start.
    pub baseline_window: (f64, f64),
    /// Per kind: baseline exchanges/s and bulk bytes/s.
    pub baseline_rates: Vec<(String, f64, f64)>,
    /// Samples, one a second.
    pub samples: Vec<Sample>,
    /// Slot names in sample order.
    pub slot_names: Vec<String>,
    /// The invariants that did not hold.
    pub violations: Vec<String>,
}

/// Runs the soak: the system up, the traffic on, a baseline, the faults
/// one at a time, then the traffic stopped and the books checked.
///
/// # Errors
/// The system cannot be set up (no root for the namespace, a binary or
/// haproxy missing), or a process cannot be started again.
pub async fn run(bins: Binaries, opt: SoakOpt) -> anyhow::Result<SoakResult> {
    let mut world = World::start(bins, &opt).await?;
    world.connect_agents().await?;
    let traffic = Traffic::start(&world, &opt)?;
    let total = opt.duration.as_secs_f64();
    let baseline = Baseline::measure(&world, &traffic.samples, total).await;
    let mut violations = Vec::new();
    let records = inject_faults(&mut world, &opt, &traffic, &baseline, &mut violations).await?;
    let remaining = total - world.now();
    if remaining > 0.0 {
        tokio::time::sleep(Duration::from_secs_f64(remaining)).await;
    }
    let end = traffic.stop(&world, &mut violations).await;
    let result = tally(&world, &opt, records, end, baseline, violations);
    write_outputs(&result, &opt, world)?;
    Ok(result)
}

impl World {
    /// The namespace, the certificates, the two servers behind haproxy,
    /// the destinations; the agents not started yet.
    async fn start(bins: Binaries, opt: &SoakOpt) -> anyhow::Result<Self> {
        let start = Instant::now();
        let root = tempfile::Builder::new()
            .prefix("konnectivity-soak-")
            .tempdir()
            .context("creating a temporary directory")?;
        eprintln!("soak: files and logs in {}", root.path().display());
        let ns = Namespace::create().context("the soak needs root for `ip netns`")?;
        let pki = RotatingPki::new(root.path())?;
        let tokens = match opt.auth {
            Auth::Mtls => None,
            Auth::Token => Some(Tokens::start(root.path()).await?),
        };
        let setup = ServerSetup {
            root: root.path(),
            pki: &pki,
            tokens: tokens.as_ref(),
            dial_timeout: DIAL_TIMEOUT,
            keepalive: Duration::from_secs(2),
        };
        let servers = vec![
            Server::start(&bins, &setup, 0, FrontendMode::Grpc).await?,
            Server::start(&bins, &setup, 1, FrontendMode::HttpConnect).await?,
        ];
        let lb = system::load_balancer(&[&servers[0], &servers[1]]).await;
        let agent_setup = AgentSetup::new(root.path(), &pki, tokens.as_ref(), lb.addr);
        traffic::START.get_or_init(|| start);
        let dest = Destination::start(DEST_IP, start).await?;
        let source = destination::source_on(DEST_IP).await;
        let stall = destination::Stall::start_on(DEST_IP);
        Ok(Self {
            bins,
            ns,
            pki,
            tokens,
            servers,
            lb,
            agents: (0..opt.agents.max(2))
                .map(|i| AgentPod::new(i, i == 0))
                .collect(),
            agent_setup,
            dest,
            source,
            stall,
            slots: Arc::new(Mutex::new(Vec::new())),
            start,
            probes: 0,
            root,
        })
    }

    /// Starts every agent and waits until each is connected to both
    /// servers.
    async fn connect_agents(&mut self) -> anyhow::Result<()> {
        for i in 0..self.agents.len() {
            self.agents[i].start(&self.bins, &self.agent_setup, &self.ns)?;
        }
        self.update_slots();
        for agent in &self.agents {
            faults::agent_back(agent).await.with_context(|| {
                format!("agent-{} did not connect to both servers", agent.index)
            })?;
        }
        eprintln!(
            "soak: {} agents connected to both servers",
            self.agents.len()
        );
        Ok(())
    }
}

/// The frontends' traffic and the watcher sampling it, running.
struct Traffic {
    /// Per frontend kind ([`Kind::ALL`] order).
    counts: Vec<Arc<Counts>>,
    /// Stops our frontends' workers.
    stop: CancellationToken,
    /// Our frontends' workers.
    workers: JoinSet<()>,
    /// The grpc-go frontends.
    gos: Vec<GoSoak>,
    /// What the watcher sampled so far.
    samples: Samples,
    /// Stops the watcher.
    watching: CancellationToken,
    /// The watcher.
    watcher: tokio::task::JoinHandle<()>,
}

/// What is left once the traffic has stopped.
struct TrafficEnd {
    /// A sample taken after the books settled (or the wait for them
    /// ended).
    last: Sample,
    /// Every sample taken while the traffic ran.
    samples: Vec<Sample>,
}

impl Traffic {
    /// Starts every kind of frontend against its server, and the watcher.
    fn start(world: &World, opt: &SoakOpt) -> anyhow::Result<Self> {
        let counts: Vec<Arc<Counts>> = Kind::ALL.iter().map(|_| Arc::default()).collect();
        let stop = CancellationToken::new();
        let mut workers = JoinSet::new();
        let mut gos = Vec::new();
        for (kind, counts) in Kind::ALL.iter().zip(&counts) {
            let uds = world.servers[kind.server()].uds.clone();
            let front = match kind {
                Kind::GrpcOurs => Front::Grpc(uds),
                Kind::ConnectOurs => Front::Connect(uds),
                Kind::GrpcGoSingle | Kind::GrpcGoReused => {
                    gos.push(GoSoak::start(
                        &opt.go_frontend,
                        &uds,
                        *kind == Kind::GrpcGoReused,
                        world.dest.addr,
                        opt.load,
                        counts.clone(),
                        &world.root.path().join(format!("go-{}.log", gos.len())),
                    )?);
                    continue;
                }
            };
            traffic::spawn_ours(
                &mut workers,
                *kind,
                front,
                world.dest.addr,
                opt.load,
                counts.clone(),
                stop.clone(),
            );
        }
        let samples: Samples = Arc::default();
        let watching = CancellationToken::new();
        let watcher = tokio::spawn(watch::run(
            world.start,
            world.slots.clone(),
            counts.clone(),
            world.dest.counts.clone(),
            samples.clone(),
            watching.clone(),
        ));
        Ok(Self {
            counts,
            stop,
            workers,
            gos,
            samples,
            watching,
            watcher,
        })
    }

    /// Stops the frontends, waits up to [`QUIESCE`] for the books to
    /// balance, stops the watcher; a violation for a grpc-go frontend that
    /// did not stop cleanly and for books that did not balance.
    async fn stop(mut self, world: &World, violations: &mut Vec<String>) -> TrafficEnd {
        eprintln!("soak: {:.0} s: stopping the traffic", world.now());
        self.stop.cancel();
        while self.workers.join_next().await.is_some() {}
        for go in self.gos {
            if !go.finish(Duration::from_secs(90)).await {
                violations.push("a grpc-go frontend did not stop cleanly".to_owned());
            }
        }
        let counts = &self.counts;
        let quiet = faults_until(QUIESCE, || async {
            let s = watch::sample(world.start, &world.slots, counts, &world.dest.counts).await;
            s.dest.open == 0
                && s.procs.iter().flatten().all(|p| {
                    p.books
                        .is_some_and(|b| b.open == 0.0 && b.unaccounted() == 0.0)
                })
        })
        .await;
        self.watching.cancel();
        let _ = self.watcher.await;
        let last = watch::sample(world.start, &world.slots, counts, &world.dest.counts).await;
        if !quiet {
            violations.push(format!(
                "the books did not balance within {QUIESCE:?} of the traffic's end"
            ));
        }
        let samples = std::mem::take(&mut *lock(&self.samples));
        TrafficEnd { last, samples }
    }
}

/// What the faults are compared with: the least resources and the rates
/// over a window after the warm-up.
struct Baseline {
    /// Per slot, per [`Resource`]: the typical least over the window.
    resources: Vec<[Option<f64>; 3]>,
    /// Per kind: exchanges/s and bulk bytes/s.
    rates: Vec<(f64, f64)>,
    /// At the destination: exchanges/s through agent 0 (in the
    /// namespace), and through the others.
    dest: (f64, f64),
    /// The window, seconds since the start.
    window: (f64, f64),
}

impl Baseline {
    /// Waits out the warm-up and the window (longer in a longer run), then
    /// measures the baseline and logs its rates.
    async fn measure(world: &World, samples: &Samples, total: f64) -> Self {
        // Long enough, in a long run, for RSS to reach its plateau
        // (allocator caches, connection pools): the first minutes under
        // traffic grow.
        let warmup = (total / 20.0).clamp(30.0, 180.0);
        let window = (total / 12.0).clamp(10.0, 60.0);
        tokio::time::sleep(Duration::from_secs_f64(warmup + window)).await;
        let (from, to) = (world.now() - window, world.now());
        let baseline = {
            let s = lock(samples);
            Self {
                resources: (0..world.agents.len() + 2)
                    .map(|slot| {
                        Resource::ALL
                            .map(|r| watch::typical_least(&s, slot, r, (from, to), RESOURCE_WINDOW))
                    })
                    .collect(),
                rates: Kind::ALL
                    .iter()
                    .map(|k| {
                        (
                            watch::rate(&s, *k, from, to, |c| c.rr_ok).unwrap_or(0.0),
                            watch::rate(&s, *k, from, to, |c| c.bulk_bytes).unwrap_or(0.0),
                        )
                    })
                    .collect(),
                dest: (
                    watch::dest_rate(&s, from, to, |d| d.complete_ns).unwrap_or(0.0),
                    watch::dest_rate(&s, from, to, |d| d.complete - d.complete_ns).unwrap_or(0.0),
                ),
                window: (from, to),
            }
        };
        baseline.log();
        baseline
    }

    /// Logs the baseline's rates.
    fn log(&self) {
        eprintln!(
            "soak: baseline at the destination: {:.1} exchanges/s through agent-0, {:.1} through the others",
            self.dest.0, self.dest.1
        );
        for (kind, (rr, bulk)) in Kind::ALL.iter().zip(&self.rates) {
            eprintln!(
                "soak: baseline {}: {rr:.1} exchanges/s, {:.1} MB/s bulk",
                kind.name(),
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

/// Injects the schedule's faults in turn, each measured once recovered,
/// until the next would not end within the run (at least one); the
/// records. A fault's violations go to `violations`, its performance ones
/// only to the log when they are advisory.
async fn inject_faults(
    world: &mut World,
    opt: &SoakOpt,
    traffic: &Traffic,
    baseline: &Baseline,
    violations: &mut Vec<String>,
) -> anyhow::Result<Vec<FaultRecord>> {
    let mut records = Vec::new();
    let schedule = Fault::schedule(opt.auth == Auth::Token);
    let mut targets = Targets {
        agent: 1,
        server: 0,
        rollout: 1,
    };
    let end_by = opt.duration.as_secs_f64() - 5.0;
    for (n, fault) in schedule.iter().cycle().enumerate() {
        if world.now() + estimate(*fault) > end_by && n > 0 {
            break;
        }
        let target = targets.next(*fault, world.agents.len());
        eprintln!("soak: {:.0} s: {} ...", world.now(), fault.name());
        let mut record = world.inject(*fault, target).await?;
        wait_resources(world, &traffic.samples, baseline, &mut record).await;
        record.rates = kind_rates(&lock(&traffic.samples), baseline, &record);
        let (healthy, what) = healthy_rate(&lock(&traffic.samples), baseline, &record);
        record.healthy = healthy;
        record.healthy_what = what.to_owned();
        for (check, v) in check_fault(&record) {
            if check == Check::Performance && !opt.performance_fatal {
                eprintln!("soak: reported, not failed (--soak-performance-advisory): {v}");
            } else {
                violations.push(v);
            }
        }
        log_fault(world.now(), &record);
        records.push(record);
        if world.now() >= end_by {
            break;
        }
    }
    Ok(records)
}

/// Waits, a second at a time, until every resource is within
/// [`RESOURCE_SLACK`] of the baseline or [`RESOURCE_LIMIT`] has passed
/// since the recovery; records which.
async fn wait_resources(
    world: &World,
    samples: &Samples,
    baseline: &Baseline,
    record: &mut FaultRecord,
) {
    let limit = record.recovered + RESOURCE_LIMIT.as_secs_f64();
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let now = world.now();
        let worst = {
            let s = lock(samples);
            worst_resource(
                &s,
                &baseline.resources,
                now - RESOURCE_WINDOW,
                now,
                record.recovered,
            )
        };
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

/// Per kind, its rate while the fault was on (at least [`RATE_WINDOW`])
/// against its baseline: the lower of exchanges/s and bulk bytes/s;
/// `None` for the kinds whose own server the fault killed.
fn kind_rates(s: &[Sample], baseline: &Baseline, record: &FaultRecord) -> Vec<Option<f64>> {
    let to = record.recovered.max(record.started + RATE_WINDOW);
    Kind::ALL
        .iter()
        .zip(&baseline.rates)
        .map(|(kind, (rr, bulk))| {
            if record.fault == Fault::ServerKill
                && record.target == format!("server-{}", kind.server())
            {
                return None;
            }
            let r = watch::rate(s, *kind, record.started, to, |c| c.rr_ok)? / rr;
            let b = watch::rate(s, *kind, record.started, to, |c| c.bulk_bytes)? / bulk;
            Some(r.min(b))
        })
        .collect()
}

/// The rate of the traffic the fault should have spared, against its
/// baseline, and what that traffic is: through the other agents (told
/// apart at the destination) for a fault on an agent, else the lowest of
/// the record's rates.
fn healthy_rate(
    s: &[Sample],
    baseline: &Baseline,
    record: &FaultRecord,
) -> (Option<f64>, &'static str) {
    let to = record.recovered.max(record.started + RATE_WINDOW);
    match record.agent {
        Some(0) => (
            watch::dest_rate(s, record.started, to, |d| d.complete - d.complete_ns)
                .map(|r| r / baseline.dest.1),
            "through the other agents",
        ),
        Some(_) => (
            watch::dest_rate(s, record.started, to, |d| d.complete_ns).map(|r| r / baseline.dest.0),
            "through agent-0",
        ),
        None => (
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
    eprintln!(
        "soak: {:.0} s: {} on {}: back {}, dials {}, healthy rate {}, all rates {}, resources {}{}",
        now,
        record.fault.name(),
        record.target,
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

/// The result: the records, the counts and books at the end checked
/// (their violations after those already found).
fn tally(
    world: &World,
    opt: &SoakOpt,
    records: Vec<FaultRecord>,
    end: TrafficEnd,
    baseline: Baseline,
    mut violations: Vec<String>,
) -> SoakResult {
    let slot_names: Vec<String> = lock(&world.slots).iter().map(|s| s.name.clone()).collect();
    let books: Vec<(String, Option<Books>)> = slot_names
        .iter()
        .zip(&end.last.procs)
        .map(|(n, p)| (n.clone(), p.and_then(|p| p.books)))
        .collect();
    check_books(&books, &mut violations);
    let books_drift = books_drift(&slot_names, &end.samples);
    let counts_end: Vec<(String, CountsSnap)> = Kind::ALL
        .iter()
        .zip(&end.last.counts)
        .map(|(k, c)| (k.name().to_owned(), *c))
        .collect();
    check_counts(&counts_end, &mut violations);
    let cuts = lock(&traffic::CUTS).clone();
    let cut_excused = excuse_cuts(&cuts, &records, &mut violations);
    let d = end.last.dest;
    let silent_at = lock(&world.dest.counts.silent_at).clone();
    let dest_killed = excuse_truncations(&silent_at, &records, &mut violations);
    check_destination(&d, &mut violations);
    SoakResult {
        auth: match opt.auth {
            Auth::Mtls => "mTLS".to_owned(),
            Auth::Token => "token".to_owned(),
        },
        seconds: world.now(),
        agents: world.agents.len(),
        faults: records,
        counts: counts_end,
        dest: d,
        dest_killed,
        cut_excused,
        books,
        books_drift,
        baseline: slot_names.iter().cloned().zip(baseline.resources).collect(),
        baseline_window: baseline.window,
        baseline_rates: Kind::ALL
            .iter()
            .zip(&baseline.rates)
            .map(|(k, (r, b))| (k.name().to_owned(), *r, *b))
            .collect(),
        samples: end.samples,
        slot_names,
        violations,
    }
}

/// A violation for each process whose books, once the traffic stopped, do
/// not balance with nothing open, or that had no `/metrics`.
fn check_books(books: &[(String, Option<Books>)], violations: &mut Vec<String>) {
    for (name, b) in books {
        match b {
            Some(b) if b.unaccounted() == 0.0 && b.open == 0.0 => {}
            Some(b) => violations.push(format!(
                "{name}: opened {} != closed {} + open {}",
                b.opened, b.closed, b.open
            )),
            None => violations.push(format!("{name}: no /metrics at the end")),
        }
    }
}

/// Per slot, the largest |opened - closed - open| in any sample.
fn books_drift(slot_names: &[String], samples: &[Sample]) -> Vec<(String, f64)> {
    slot_names
        .iter()
        .enumerate()
        .map(|(i, n)| {
            let drift = samples
                .iter()
                .filter_map(|s| s.procs.get(i).copied().flatten()?.books)
                .map(|b| b.unaccounted().abs())
                .fold(0.0, f64::max);
            (n.clone(), drift)
        })
        .collect()
}

/// A violation for each frontend kind that lost bytes silently, waited
/// past the dial timeout, or has exchanges not accounted for.
fn check_counts(counts: &[(String, CountsSnap)], violations: &mut Vec<String>) {
    for (name, c) in counts {
        if c.silent > 0 {
            violations.push(format!(
                "{name}: {} exchanges lost bytes silently",
                c.silent
            ));
        }
        if c.late > 0 {
            violations.push(format!(
                "{name}: {} dials waited past the {DIAL_TIMEOUT:?} dial timeout",
                c.late
            ));
        }
        if c.started != c.ok + c.errors + c.silent + c.cut {
            violations.push(format!(
                "{name}: {} exchanges started, {} accounted for",
                c.started,
                c.ok + c.errors + c.silent + c.cut
            ));
        }
    }
}

/// HTTP CONNECT tunnels that ended with an EOF at `cuts`: excused (and
/// counted) during a fault that took their agent or server, else a
/// violation each. CONNECT on a Unix socket has no way to say "error" once
/// the 200 is sent: a tunnel whose agent or server died ends with an EOF;
/// outside such a fault it is a silent loss.
fn excuse_cuts(cuts: &[f64], records: &[FaultRecord], violations: &mut Vec<String>) -> u64 {
    let mut excused = 0;
    for at in cuts {
        let during = records
            .iter()
            .find(|f| *at >= f.started - 1.0 && *at <= f.recovered + 2.0);
        match during {
            Some(f)
                if matches!(
                    f.fault,
                    Fault::AgentKill | Fault::ServerKill | Fault::Partition | Fault::TokenOutage
                ) =>
            {
                excused += 1;
            }
            Some(f) => violations.push(format!(
                "http-connect: a tunnel ended with an EOF, bytes missing, at {at:.0} s, during {} on {}",
                f.fault.name(),
                f.target
            )),
            None => violations.push(format!(
                "http-connect: a tunnel ended with an EOF, bytes missing, at {at:.0} s, outside any fault"
            )),
        }
    }
    excused
}

/// Requests the destination saw end cleanly before their last byte, or
/// altered, at `silent_at`: excused (and counted) when unaltered and
/// during a fault that killed an agent with SIGKILL (its kernel closes
/// the sockets with a FIN, which the destination cannot tell from a clean
/// end), else a violation each.
fn excuse_truncations(
    silent_at: &[(f64, bool)],
    records: &[FaultRecord],
    violations: &mut Vec<String>,
) -> u64 {
    let mut excused = 0;
    for (at, altered) in silent_at {
        match fault_during(records, *at) {
            Some(f) if !altered && kills_an_agent(f) => {
                excused += 1;
            }
            Some(f) => violations.push(format!(
                "destination: a request ended cleanly before its last byte, or altered, at {at:.0} s, during {} on {}",
                f.fault.name(),
                f.target
            )),
            None => violations.push(format!(
                "destination: a request ended cleanly before its last byte, or altered, at {at:.0} s, outside any fault"
            )),
        }
    }
    excused
}

/// A violation if the destination's connections are not all accounted
/// for.
fn check_destination(d: &DestSnap, violations: &mut Vec<String>) {
    if d.accepted != d.complete + d.reset + d.truncated + d.corrupt + d.open {
        violations.push(format!(
            "destination: {} accepted, accounted {}",
            d.accepted,
            d.complete + d.reset + d.truncated + d.corrupt + d.open
        ));
    }
}

/// Writes the Markdown and, if asked for, the samples; keeps the files
/// and logs if an invariant did not hold.
fn write_outputs(result: &SoakResult, opt: &SoakOpt, world: World) -> anyhow::Result<()> {
    std::fs::write(&opt.markdown, table::markdown(result, opt))
        .with_context(|| format!("writing {}", opt.markdown.display()))?;
    eprintln!("soak: tables in {}", opt.markdown.display());
    if let Some(path) = &opt.samples {
        let json = serde_json::json!({
            "slots": result.slot_names,
            "samples": result.samples,
        });
        std::fs::write(path, json.to_string())
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!("soak: samples in {}", path.display());
    }
    if !result.violations.is_empty() {
        let kept = world.root.keep();
        eprintln!(
            "soak: violations: files and logs kept in {}",
            kept.display()
        );
    }
    Ok(())
}

/// Rough seconds a fault takes with its recovery, so that the last one
/// ends within the run.
fn estimate(fault: Fault) -> f64 {
    match fault {
        Fault::Slowloris => 90.0,
        Fault::FrontendStall | Fault::DestinationStall | Fault::TokenOutage => 45.0,
        Fault::Partition => 40.0,
        Fault::CaRotation => 25.0,
        _ => 20.0,
    }
}

/// Polls `done` every 500 ms up to `limit`.
async fn faults_until<F, Fut>(limit: Duration, mut done: F) -> bool
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

/// The first resource of any slot whose least value over `[from, to]`
/// (only samples after `after`) is more than [`RESOURCE_SLACK`] above its
/// baseline, described; `None` if all are back.
fn worst_resource(
    samples: &[Sample],
    baseline: &[[Option<f64>; 3]],
    from: f64,
    to: f64,
    after: f64,
) -> Option<String> {
    for (slot, base) in baseline.iter().enumerate() {
        for (r, base) in Resource::ALL.iter().zip(base) {
            let Some(base) = base else { continue };
            let Some(now) = watch::least(samples, slot, *r, from.max(after), to) else {
                continue;
            };
            // Descriptors and tasks are whole numbers: 5 % of 15 is less
            // than one, so the bound is rounded up to the next whole one.
            let bound = match r {
                Resource::Rss => base * (1.0 + RESOURCE_SLACK),
                Resource::Fds | Resource::Tasks => (base * (1.0 + RESOURCE_SLACK)).ceil(),
            };
            if now > bound {
                return Some(format!(
                    "slot {slot} {}: {now:.0} vs baseline {base:.0}",
                    r.name()
                ));
            }
        }
    }
    None
}

/// Whether a fault kills an agent with SIGKILL (whose kernel then ends its
/// destination connections with a FIN).
fn kills_an_agent(f: &FaultRecord) -> bool {
    matches!(f.fault, Fault::AgentKill | Fault::TokenOutage)
}

/// The fault whose window (with a second before and two after) holds
/// `at`: one that killed an agent if any does. Windows overlap by their
/// slack: a TokenReview outage kills its agent the moment a server kill's
/// recovery ends.
fn fault_during(records: &[FaultRecord], at: f64) -> Option<&FaultRecord> {
    let mut during = records
        .iter()
        .filter(|f| at >= f.started - 1.0 && at <= f.recovered + 2.0);
    during
        .clone()
        .find(|f| kills_an_agent(f))
        .or_else(|| during.next())
}

/// What a violated check says about the run.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Check {
    /// Bytes, books, recovery: wrong on any machine.
    Correctness,
    /// Rates and resources: judged over seconds, on a shared machine.
    Performance,
}

/// The violations one fault's record shows.
fn check_fault(record: &FaultRecord) -> Vec<(Check, String)> {
    let what = format!(
        "{} on {} at {:.0} s",
        record.fault.name(),
        record.target,
        record.started
    );
    let mut found = Vec::new();
    if record.back_s.is_none() {
        found.push((
            Check::Correctness,
            format!("{what}: not back within {:?}", faults::BACK_LIMIT),
        ));
    }
    if record.dials_s.is_none() {
        found.push((
            Check::Correctness,
            format!("{what}: dials not served again"),
        ));
    }
    if record.resources_s.is_none() {
        found.push((
            Check::Performance,
            format!(
                "{what}: resources not within {:.0} % of baseline within {RESOURCE_LIMIT:?}: {}",
                RESOURCE_SLACK * 100.0,
                record.resources_note
            ),
        ));
    }
    match record.healthy {
        Some(rate) if rate >= RATE_KEPT => {}
        Some(rate) => found.push((
            Check::Performance,
            format!(
                "{what}: healthy traffic ({}) kept {:.0} % of its rate",
                record.healthy_what,
                rate * 100.0
            ),
        )),
        None => found.push((
            Check::Correctness,
            format!("{what}: no rate of healthy traffic measured"),
        )),
    }
    found
}

/// `1.2 s`, or `never`.
pub fn secs(s: Option<f64>) -> String {
    s.map_or("never".to_owned(), |s| format!("{s:.1} s"))
}

/// The dial limit the frontends count against.
pub fn dial_limit() -> Duration {
    DIAL_TIMEOUT + DIAL_SLACK
}

#[cfg(test)]
mod tests {
    use super::{
        Books, Check, CountsSnap, Targets, check_books, check_counts, check_fault, excuse_cuts,
    };
    use crate::soak::faults::{Fault, FaultRecord};

    fn recovered() -> FaultRecord {
        let mut record = FaultRecord::new(Fault::Rollout, 82.0);
        record.target = "agent-1".to_owned();
        record.back_s = Some(0.3);
        record.dials_s = Some(0.0);
        record.healthy = Some(1.0);
        record.resources_s = Some(5.0);
        record
    }

    #[test]
    fn a_fin_in_overlapping_windows_is_put_down_to_the_agent_kill() {
        let mut server_kill = FaultRecord::new(Fault::ServerKill, 992.0);
        server_kill.recovered = 996.5;
        let mut outage = FaultRecord::new(Fault::TokenOutage, 997.0);
        outage.recovered = 1010.0;
        let records = [server_kill, outage];
        let at_997 = super::fault_during(&records, 997.2).map(|f| f.fault);
        assert_eq!(at_997, Some(Fault::TokenOutage));
        let at_993 = super::fault_during(&records, 993.0).map(|f| f.fault);
        assert_eq!(at_993, Some(Fault::ServerKill));
        assert!(super::fault_during(&records, 1500.0).is_none());
    }

    #[test]
    fn a_fault_that_recovered_whole_violates_nothing() {
        assert!(check_fault(&recovered()).is_empty());
    }

    #[test]
    fn a_slow_rate_or_resources_are_performance_and_a_missed_recovery_is_correctness() {
        let mut slow = recovered();
        slow.healthy = Some(0.88);
        slow.resources_s = None;
        let found = check_fault(&slow);
        assert_eq!(found.len(), 2, "{found:?}");
        assert!(
            found.iter().all(|(check, _)| *check == Check::Performance),
            "{found:?}"
        );
        assert!(found[1].1.contains("kept 88 % of its rate"), "{found:?}");

        let mut stuck = recovered();
        stuck.back_s = None;
        stuck.dials_s = None;
        let found = check_fault(&stuck);
        assert_eq!(found.len(), 2, "{found:?}");
        assert!(
            found.iter().all(|(check, _)| *check == Check::Correctness),
            "{found:?}"
        );
    }

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
    fn an_eof_is_excused_only_during_a_fault_that_took_an_agent_or_a_server() {
        let mut kill = FaultRecord::new(Fault::AgentKill, 10.0);
        kill.recovered = 20.0;
        kill.target = "agent-1".to_owned();
        let mut stall = FaultRecord::new(Fault::FrontendStall, 30.0);
        stall.recovered = 40.0;
        stall.target = "a download".to_owned();
        let mut violations = Vec::new();
        let excused = excuse_cuts(&[9.5, 21.9, 35.0, 100.0], &[kill, stall], &mut violations);
        assert_eq!(excused, 2);
        assert_eq!(
            violations,
            [
                "http-connect: a tunnel ended with an EOF, bytes missing, at 35 s, during \
                 frontend stops reading on a download",
                "http-connect: a tunnel ended with an EOF, bytes missing, at 100 s, outside any fault",
            ]
        );
    }

    #[test]
    fn counts_lost_late_or_unaccounted_are_violations() {
        let fine = CountsSnap {
            started: 10,
            ok: 7,
            errors: 1,
            silent: 0,
            cut: 2,
            ..CountsSnap::default()
        };
        let bad = CountsSnap {
            started: 10,
            ok: 7,
            silent: 1,
            late: 2,
            ..CountsSnap::default()
        };
        let mut violations = Vec::new();
        check_counts(
            &[("fine".to_owned(), fine), ("bad".to_owned(), bad)],
            &mut violations,
        );
        assert_eq!(
            violations,
            [
                "bad: 1 exchanges lost bytes silently",
                "bad: 2 dials waited past the 5s dial timeout",
                "bad: 10 exchanges started, 8 accounted for",
            ]
        );
    }

    #[test]
    fn books_open_unbalanced_or_missing_at_the_end_are_violations() {
        let books = |opened, closed, open| {
            Some(Books {
                opened,
                closed,
                open,
            })
        };
        let mut violations = Vec::new();
        check_books(
            &[
                ("server-0".to_owned(), books(5.0, 5.0, 0.0)),
                ("server-1".to_owned(), books(5.0, 4.0, 1.0)),
                ("agent-0".to_owned(), books(5.0, 3.0, 0.0)),
                ("agent-1".to_owned(), None),
            ],
            &mut violations,
        );
        assert_eq!(
            violations,
            [
                "server-1: opened 5 != closed 4 + open 1",
                "agent-0: opened 5 != closed 3 + open 0",
                "agent-1: no /metrics at the end",
            ]
        );
    }
}
