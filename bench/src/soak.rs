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

/// Runs the soak.
///
/// # Errors
/// The system cannot be set up (no root for the namespace, a binary or
/// haproxy missing), or a process cannot be started again.
pub async fn run(bins: Binaries, opt: SoakOpt) -> anyhow::Result<SoakResult> {
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
    let mut world = World {
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
    };
    for i in 0..world.agents.len() {
        world.agents[i].start(&world.bins, &world.agent_setup, &world.ns)?;
    }
    world.update_slots();
    for agent in &world.agents {
        faults::agent_back(agent)
            .await
            .with_context(|| format!("agent-{} did not connect to both servers", agent.index))?;
    }
    eprintln!(
        "soak: {} agents connected to both servers",
        world.agents.len()
    );

    // Traffic.
    let counts: Vec<Arc<Counts>> = Kind::ALL.iter().map(|_| Arc::default()).collect();
    let stop = CancellationToken::new();
    let mut workers = JoinSet::new();
    let mut gos = Vec::new();
    for (kind, counts) in Kind::ALL.iter().zip(&counts) {
        let uds = world.servers[kind.server()].uds.clone();
        match kind {
            Kind::GrpcOurs => traffic::spawn_ours(
                &mut workers,
                *kind,
                Front::Grpc(uds),
                world.dest.addr,
                opt.load,
                counts.clone(),
                stop.clone(),
            ),
            Kind::ConnectOurs => traffic::spawn_ours(
                &mut workers,
                *kind,
                Front::Connect(uds),
                world.dest.addr,
                opt.load,
                counts.clone(),
                stop.clone(),
            ),
            Kind::GrpcGoSingle | Kind::GrpcGoReused => gos.push(GoSoak::start(
                &opt.go_frontend,
                &uds,
                *kind == Kind::GrpcGoReused,
                world.dest.addr,
                opt.load,
                counts.clone(),
                &world.root.path().join(format!("go-{}.log", gos.len())),
            )?),
        }
    }
    let samples: Samples = Arc::default();
    let watching = CancellationToken::new();
    let watcher = tokio::spawn(watch::run(
        start,
        world.slots.clone(),
        counts.clone(),
        world.dest.counts.clone(),
        samples.clone(),
        watching.clone(),
    ));

    // Warm-up, then the baseline.
    let total = opt.duration.as_secs_f64();
    // Long enough, in a long run, for RSS to reach its plateau (allocator
    // caches, connection pools): the first minutes under traffic grow.
    let warmup = (total / 20.0).clamp(30.0, 180.0);
    let window = (total / 12.0).clamp(10.0, 60.0);
    tokio::time::sleep(Duration::from_secs_f64(warmup + window)).await;
    let base_from = world.now() - window;
    let base_to = world.now();
    let (baseline, baseline_rates, baseline_dest) = {
        let s = lock(&samples);
        let baseline: Vec<[Option<f64>; 3]> = (0..world.agents.len() + 2)
            .map(|slot| {
                Resource::ALL.map(|r| {
                    watch::typical_least(&s, slot, r, (base_from, base_to), RESOURCE_WINDOW)
                })
            })
            .collect();
        let rates: Vec<(f64, f64)> = Kind::ALL
            .iter()
            .map(|k| {
                (
                    watch::rate(&s, *k, base_from, base_to, |c| c.rr_ok).unwrap_or(0.0),
                    watch::rate(&s, *k, base_from, base_to, |c| c.bulk_bytes).unwrap_or(0.0),
                )
            })
            .collect();
        let dest = (
            watch::dest_rate(&s, base_from, base_to, |d| d.complete_ns).unwrap_or(0.0),
            watch::dest_rate(&s, base_from, base_to, |d| d.complete - d.complete_ns).unwrap_or(0.0),
        );
        (baseline, rates, dest)
    };
    eprintln!(
        "soak: baseline at the destination: {:.1} exchanges/s through agent-0, {:.1} through the others",
        baseline_dest.0, baseline_dest.1
    );
    for (kind, (rr, bulk)) in Kind::ALL.iter().zip(&baseline_rates) {
        eprintln!(
            "soak: baseline {}: {rr:.1} exchanges/s, {:.1} MB/s bulk",
            kind.name(),
            bulk / 1e6
        );
    }

    // The faults.
    let mut records = Vec::new();
    let mut violations = Vec::new();
    let schedule = Fault::schedule(opt.auth == Auth::Token);
    let mut next_agent = 1;
    let mut next_server = 0;
    let mut next_rollout = 1;
    let end_by = total - 5.0;
    for (n, fault) in schedule.iter().cycle().enumerate() {
        if world.now() + estimate(*fault) > end_by && n > 0 {
            break;
        }
        let target = match fault {
            Fault::AgentKill | Fault::TokenOutage => {
                let t = next_agent;
                next_agent = (next_agent + 1) % world.agents.len();
                t
            }
            Fault::ServerKill => {
                let t = next_server;
                next_server = (next_server + 1) % 2;
                t
            }
            Fault::Rollout => {
                let t = next_rollout;
                next_rollout = (next_rollout + 1) % world.agents.len();
                t
            }
            _ => 0,
        };
        eprintln!("soak: {:.0} s: {} ...", world.now(), fault.name());
        let mut record = world.inject(*fault, target).await?;
        // Resources: within RESOURCE_SLACK of the baseline within a minute.
        let limit = record.recovered + RESOURCE_LIMIT.as_secs_f64();
        loop {
            tokio::time::sleep(Duration::from_secs(1)).await;
            let now = world.now();
            let worst = {
                let s = lock(&samples);
                worst_resource(&s, &baseline, now - RESOURCE_WINDOW, now, record.recovered)
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
        // Rates while the fault was on.
        {
            let s = lock(&samples);
            let to = record.recovered.max(record.started + RATE_WINDOW);
            record.rates = Kind::ALL
                .iter()
                .zip(&baseline_rates)
                .map(|(kind, (rr, bulk))| {
                    if record.fault == Fault::ServerKill
                        && record.target == format!("server-{}", kind.server())
                    {
                        return None;
                    }
                    let r = watch::rate(&s, *kind, record.started, to, |c| c.rr_ok)? / rr;
                    let b = watch::rate(&s, *kind, record.started, to, |c| c.bulk_bytes)? / bulk;
                    Some(r.min(b))
                })
                .collect();
        }
        {
            let s = lock(&samples);
            let to = record.recovered.max(record.started + RATE_WINDOW);
            let (healthy, what) = match record.agent {
                Some(0) => (
                    watch::dest_rate(&s, record.started, to, |d| d.complete - d.complete_ns)
                        .map(|r| r / baseline_dest.1),
                    "through the other agents",
                ),
                Some(_) => (
                    watch::dest_rate(&s, record.started, to, |d| d.complete_ns)
                        .map(|r| r / baseline_dest.0),
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
            };
            record.healthy = healthy;
            record.healthy_what = what.to_owned();
        }
        for (check, v) in check_fault(&record) {
            if check == Check::Performance && !opt.performance_fatal {
                eprintln!("soak: reported, not failed (--soak-performance-advisory): {v}");
            } else {
                violations.push(v);
            }
        }
        eprintln!(
            "soak: {:.0} s: {} on {}: back {}, dials {}, healthy rate {}, all rates {}, resources {}{}",
            world.now(),
            fault.name(),
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
        records.push(record);
        if world.now() >= end_by {
            break;
        }
    }
    let remaining = total - world.now();
    if remaining > 0.0 {
        tokio::time::sleep(Duration::from_secs_f64(remaining)).await;
    }

    // Stop the traffic; the books must then balance exactly.
    eprintln!("soak: {:.0} s: stopping the traffic", world.now());
    stop.cancel();
    while workers.join_next().await.is_some() {}
    for go in gos {
        if !go.finish(Duration::from_secs(90)).await {
            violations.push("a grpc-go frontend did not stop cleanly".to_owned());
        }
    }
    let quiet = faults_until(QUIESCE, || async {
        let s = watch::sample(start, &world.slots, &counts, &world.dest.counts).await;
        s.dest.open == 0
            && s.procs.iter().flatten().all(|p| {
                p.books
                    .is_some_and(|b| b.open == 0.0 && b.unaccounted() == 0.0)
            })
    })
    .await;
    watching.cancel();
    let _ = watcher.await;
    let last = watch::sample(start, &world.slots, &counts, &world.dest.counts).await;
    if !quiet {
        violations.push(format!(
            "the books did not balance within {QUIESCE:?} of the traffic's end"
        ));
    }
    let samples = std::mem::take(&mut *lock(&samples));
    let slot_names: Vec<String> = lock(&world.slots).iter().map(|s| s.name.clone()).collect();
    let books: Vec<(String, Option<Books>)> = slot_names
        .iter()
        .zip(&last.procs)
        .map(|(n, p)| (n.clone(), p.and_then(|p| p.books)))
        .collect();
    for (name, b) in &books {
        match b {
            Some(b) if b.unaccounted() == 0.0 && b.open == 0.0 => {}
            Some(b) => violations.push(format!(
                "{name}: opened {} != closed {} + open {}",
                b.opened, b.closed, b.open
            )),
            None => violations.push(format!("{name}: no /metrics at the end")),
        }
    }
    let books_drift: Vec<(String, f64)> = slot_names
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
        .collect();
    let counts_end: Vec<(String, CountsSnap)> = Kind::ALL
        .iter()
        .zip(&last.counts)
        .map(|(k, c)| (k.name().to_owned(), *c))
        .collect();
    for (name, c) in &counts_end {
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
    // HTTP CONNECT on a Unix socket has no way to say "error" once the
    // 200 is sent: a tunnel whose agent or server died ends with an EOF.
    // Counted apart; outside such a fault it is a silent loss.
    let cuts = lock(&traffic::CUTS).clone();
    let mut cut_excused = 0;
    for at in &cuts {
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
                cut_excused += 1;
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
    let d = last.dest;
    // A process killed with SIGKILL has its sockets closed by the kernel:
    // a FIN, which the destination cannot tell from a clean end. Only
    // what an agent that lives on ends that way is a silent loss.
    let silent_at = lock(&world.dest.counts.silent_at).clone();
    let mut excused = 0;
    for (at, altered) in &silent_at {
        match fault_during(&records, *at) {
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
    if d.accepted != d.complete + d.reset + d.truncated + d.corrupt + d.open {
        violations.push(format!(
            "destination: {} accepted, accounted {}",
            d.accepted,
            d.complete + d.reset + d.truncated + d.corrupt + d.open
        ));
    }
    let result = SoakResult {
        auth: match opt.auth {
            Auth::Mtls => "mTLS".to_owned(),
            Auth::Token => "token".to_owned(),
        },
        seconds: world.now(),
        agents: world.agents.len(),
        faults: records,
        counts: counts_end,
        dest: d,
        dest_killed: excused,
        cut_excused,
        books,
        books_drift,
        baseline: slot_names.iter().cloned().zip(baseline).collect(),
        baseline_window: (base_from, base_to),
        baseline_rates: Kind::ALL
            .iter()
            .zip(&baseline_rates)
            .map(|(k, (r, b))| (k.name().to_owned(), *r, *b))
            .collect(),
        samples,
        slot_names,
        violations,
    };
    std::fs::write(&opt.markdown, table::markdown(&result, &opt))
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
    Ok(result)
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
    use super::{Check, check_fault};
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
}
