//! Benchmark of konnectivity-rs: the same scenarios against direct TCP, the
//! gRPC mode and the HTTP-CONNECT mode (client → UDS → proxy-server → TLS →
//! proxy-agent → backend), with the release binaries as child processes on
//! loopback, interleaved direct/grpc/http-connect within each repetition.
//!
//! # Layout
//! - [`agents`]: the agents scenario (N real agents in `agent-swarm`
//!   processes against one server).
//! - [`storm`]: restart storms of grpc-go agents (`tests/go/agents`) with
//!   and without admission, idle, on shared CPUs, and far away.
//! - [`retries`]: dials through three agents while one is killed, slow or
//!   hung (retries, hedging, the pick) and where new dials go (P2C).
//! - [`budget`]: the server's memory under the floods of issue 43,
//!   driven by Python's grpcio.
//! - [`policy`]: CPU per single-use tunnel with the recommended
//!   destination policy against none (issue 45).
//! - [`clients`]: one measurement of a deployment with our client and
//!   grpc-go, for the scenarios that compare deployments side by side.
//! - [`overhead`]: CPU per single-use tunnel with tracing at 100 %
//!   sampling and with the audit log, against neither (issue 45).
//! - [`grpc_go`]: the gRPC rows driven by grpc-go (kube-apiserver's client
//!   library), `tests/go/frontend` as a child process.
//! - [`backends`]: the node-side TCP servers (source, sink, echo, responder,
//!   hold-open) in the bench process.
//! - [`system`]: starting, probing and killing proxy-server and proxy-agent.
//! - [`scenarios`]: one run of each scenario against one route.
//! - [`probe`]: `/proc` (RSS, CPU), the machine, the health port and
//!   Prometheus text.
//! - [`stats`]: median/min/max, Jain's index, latency histograms.
//! - [`report`]: metric definitions, the table and the JSON.
//! - [`soak`]: the soak (faults under load, the books checked throughout),
//!   run on its own.

pub mod agents;
pub mod audit;
pub mod backends;
pub mod budget;
pub mod clients;
pub mod grpc_go;
pub mod overhead;
pub mod policy;
pub mod probe;
pub mod report;
pub mod retries;
pub mod scenarios;
pub mod soak;
pub mod stats;
pub mod storm;
pub mod system;

use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::Context;
use clap::{Parser, ValueEnum};
use client::dial::Mode;
use ops::flags::go_duration;

use crate::{
    backends::Backends,
    probe::Machine,
    report::{Recorder, Report, Route, Settings},
    scenarios::{Target, Timing, Transfer},
    system::{Binaries, Deployment},
};

/// Open files wanted for the bench and the processes it starts.
const NOFILE_WANTED: u64 = 65_536;
/// Descriptors kept free for everything but the idle connections.
const NOFILE_SPARE: u64 = 1024;
/// Concurrencies of the dial-rate scenario.
const DIAL_CONCURRENCY: [usize; 2] = [1, 8];
/// Longest warm-up before a time-boxed measurement.
const MAX_WARMUP: Duration = Duration::from_millis(500);

/// A scenario.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Scenario {
    /// One stream, each direction: MB/s.
    Bulk,
    /// 16 streams down: total MB/s and Jain fairness.
    Parallel,
    /// Bulk next to a stalled connection, and the server's buffered bytes.
    Hol,
    /// 64-byte round trips on one connection: p50/p99.
    Pingpong,
    /// Single-use tunnels with a 1 KiB exchange: dials/s, p50/p99.
    Dial,
    /// RSS idle, per idle connection, and growth over open/close rounds.
    Memory,
    /// CPU seconds of server + agent per GiB during bulk.
    Cpu,
    /// Rounds of --conns tunnels open at once, each echoing 1 KiB: RSS
    /// after round 2 and after the last.
    Churn,
    /// --conns long-lived tunnels on one grpc-go connection (the reusable
    /// tunnel): time to open them, RSS per tunnel on both sides.
    Streams,
    /// --agents agents against one server: connected after a cold start and
    /// after a server restart, RSS and CPU per agent, health latency, dial
    /// rate with 1 and N agents, ANP-style agents.
    Agents,
    /// --storm-agents grpc-go agents (ANP's way: no session cache) against
    /// our server with its admission and with none: time to all connected
    /// after a cold start and after kill -9 and a restart, handshakes
    /// thrown away, in each of --storm-conditions. Not in the default set;
    /// the latency condition needs root.
    Storm,
    /// kube-apiserver's grpc-go client at --retries-rate single-use tunnels
    /// per second through three agents: one killed (SIGKILL after it hung)
    /// --retries-kills times, with --backend-dial-retries=1 and 0 (ANP);
    /// one slowed (its node drops each connection's first SYN) for
    /// --retries-duration with hedging off and on; new dials beside an
    /// agent holding 100 tunnels (P2C); one agent hung (SIGSTOP) under a
    /// 3 s dial timeout, dials one and 8 at a time; --retries-rounds rounds
    /// per mode of an agent killed under 32 single-use tunnels at a time.
    /// Fails on a tunnel still open 15 s on. Not in the default set; needs
    /// root (a network namespace, nftables).
    Retries,
    /// The server's memory under floods (issue 43): 1-byte and padded DATA
    /// behind a stalled upload, --budget-streams stalled streams beside a
    /// connection making round trips; peak RSS, allocated bytes. Frontend:
    /// Python's grpcio from `target/interop-venv` (`scripts/test`). Not in
    /// the default set.
    Budget,
    /// --soak-duration of faults under load (two servers behind haproxy,
    /// --soak-agents agents, every kind of frontend), every byte checked
    /// and the books balanced; fails on a violated invariant. Runs alone
    /// (not in the default set); needs root (a network namespace).
    Soak,
    /// CPU per single-use tunnel with the recommended destination policy
    /// (deploy/konnectivity-agent-policy.yaml) against none: two gRPC
    /// deployments, our client and grpc-go at 8 clients, --reps
    /// repetitions in alternating order. Not in the default set.
    Policy,
    /// --audit-tunnels single-use gRPC tunnels at 8 clients with
    /// --audit-log-path on server and agent, then both stopped and their
    /// records joined: exactly one per side per tunnel, agreeing. Not in
    /// the default set.
    Audit,
    /// CPU per single-use tunnel with tracing at 100 % sampling (towards
    /// an OTLP receiver in the bench) and with the audit log, against
    /// neither: three gRPC deployments, our client and grpc-go at 8
    /// clients, --reps repetitions in rotating order. Not in the default
    /// set.
    Overhead,
}

/// A fault's name on the command line (`--soak-faults`).
fn soak_fault(name: &str) -> Result<soak_judge::Fault, String> {
    soak_judge::Fault::from_flag(name).ok_or_else(|| {
        format!(
            "unknown fault {name:?}; one of: {}",
            soak_judge::Fault::ALL
                .map(soak_judge::Fault::flag)
                .join(", ")
        )
    })
}

/// `--soak-auth`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SoakAuth {
    /// Agents present a client certificate.
    Mtls,
    /// Agents present a service-account token (TokenReview stand-in).
    Token,
}

impl Scenario {
    /// The name on the command line.
    pub fn name(self) -> String {
        self.to_possible_value()
            .map(|v| v.get_name().to_owned())
            .unwrap_or_default()
    }
}

/// bench: direct vs gRPC vs HTTP-CONNECT through proxy-server and
/// proxy-agent on loopback, with the release binaries.
#[derive(Debug, Clone, Parser)]
#[command(name = "bench", version, about)]
pub struct Opt {
    /// Measured time of each time-boxed run (Go duration).
    #[arg(long, default_value = "5s", value_parser = go_duration)]
    pub duration: Duration,
    /// Repetitions; each runs direct, grpc and http-connect in turn.
    #[arg(long, default_value_t = 3)]
    pub reps: usize,
    /// Idle tunneled connections opened in the memory scenario.
    #[arg(long, default_value_t = 10_000)]
    pub conns: usize,
    /// Rounds of the churn scenario.
    #[arg(long, default_value_t = 8)]
    pub churn_rounds: usize,
    /// Timed ping-pong round trips per run.
    #[arg(long, default_value_t = 10_000)]
    pub round_trips: usize,
    /// Agents of the agents scenario.
    #[arg(long, default_value_t = 5_000)]
    pub agents: usize,
    /// Streams of the parallel scenario.
    #[arg(long, default_value_t = 16)]
    pub streams: usize,
    /// Keys of the agents scenario's PKI: rsa-2048 (kubeadm's default: a
    /// full handshake costs the server an RSA signature) or ecdsa-p256.
    #[arg(long, value_enum, default_value_t = certs::KeyAlgorithm::Rsa2048)]
    pub agents_key_algorithm: certs::KeyAlgorithm,
    /// How long the agents scenario's TokenReview stand-in takes to answer
    /// each review (Go duration).
    #[arg(long, default_value = "20ms", value_parser = ops::duration::parse)]
    pub agents_review_latency: Duration,
    /// Smoke run: --duration=1s, --reps=1, --conns=1000, --agents at most 1000.
    #[arg(long)]
    pub quick: bool,
    /// Scenarios to run, comma-separated.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "bulk,parallel,hol,pingpong,dial,memory,churn,streams,cpu,agents"
    )]
    pub scenarios: Vec<Scenario>,
    /// Where to write the JSON results.
    #[arg(long, default_value = "bench-results.json")]
    pub json: PathBuf,
    /// `--worker-threads` of proxy-server and proxy-agent (0: their default,
    /// one per CPU).
    #[arg(long, default_value_t = 0)]
    pub worker_threads: usize,
    /// proxy-server binary (default: next to this executable).
    #[arg(long)]
    pub server_bin: Option<PathBuf>,
    /// proxy-agent binary (default: next to this executable).
    #[arg(long)]
    pub agent_bin: Option<PathBuf>,
    /// The grpc-go frontend (default: `target/go-frontend`, which
    /// `scripts/test` builds).
    #[arg(long)]
    pub go_frontend: Option<PathBuf>,
    /// Agents of the storm scenario.
    #[arg(long, default_value_t = 10_000)]
    pub storm_agents: usize,
    /// Conditions of the storm scenario, comma-separated: idle (server and
    /// swarm on separate CPUs), shared (the swarm on the server's CPUs),
    /// latency (as idle, --storm-latency added to every round trip).
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "idle,shared,latency"
    )]
    pub storm_conditions: Vec<storm::Condition>,
    /// Keys of the storm server's certificate: rsa-2048 (kubeadm's
    /// default: each full handshake an RSA signature by the server) or
    /// ecdsa-p256, signed by an RSA-2048 CA either way (an ECDSA serving
    /// certificate from a kubeadm CA). The swarm's client certificates
    /// are ECDSA P-256.
    #[arg(long, value_enum, default_value_t = certs::KeyAlgorithm::Rsa2048)]
    pub storm_key_algorithm: certs::KeyAlgorithm,
    /// Round trip the storm's latency condition adds (Go duration).
    #[arg(long, default_value = "200ms", value_parser = go_duration)]
    pub storm_latency: Duration,
    /// Longest wait for all of the storm's agents to connect, per storm (Go
    /// duration).
    #[arg(long, default_value = "300s", value_parser = go_duration)]
    pub storm_limit: Duration,
    /// Single-use tunnels per second of the retries scenario.
    #[arg(long, default_value_t = 200)]
    pub retries_rate: u32,
    /// Traffic of each slow run of the retries scenario (Go duration).
    #[arg(long, default_value = "20s", value_parser = go_duration)]
    pub retries_duration: Duration,
    /// Kills of each kill run of the retries scenario.
    #[arg(long, default_value_t = 12)]
    pub retries_kills: usize,
    /// Rounds of the retries scenario's rounds part, in each mode: an
    /// agent killed under 32 single-use tunnels at a time.
    #[arg(long, default_value_t = 10)]
    pub retries_rounds: usize,
    /// Streams of the budget scenario's streams part.
    #[arg(long, default_value_t = 4_000)]
    pub budget_streams: usize,
    /// HTTP/2 connections the budget scenario's streams share.
    #[arg(long, default_value_t = 8)]
    pub budget_connections: usize,
    /// Empty, and 1-byte, DATA packets of the budget scenario's tiny flood.
    #[arg(long, default_value_t = 1_000_000)]
    pub budget_packets: u64,
    /// The grpc-go agent swarm (default: `target/go-agents`, which
    /// `scripts/test` builds).
    #[arg(long)]
    pub go_agents: Option<PathBuf>,
    /// Single-use tunnels of the audit scenario.
    #[arg(long, default_value_t = 10_000)]
    pub audit_tunnels: usize,
    /// Length of the soak, faults and all (Go duration).
    #[arg(long, default_value = "60m", value_parser = go_duration)]
    pub soak_duration: Duration,
    /// How the soak's agents authenticate.
    #[arg(long, value_enum, default_value_t = SoakAuth::Mtls)]
    pub soak_auth: SoakAuth,
    /// Agents of the soak (at least 3), each in a network namespace of its
    /// own.
    #[arg(long, default_value_t = 3)]
    pub soak_agents: usize,
    /// The faults the soak injects, once each in this order, instead of
    /// its timed schedule (comma-separated: agent-kill, server-kill,
    /// partition, frontend-stall, destination-stall, slowloris,
    /// cert-rotation, ca-rotation, token-outage, rollout); the run ends
    /// after the last one's recovery, and fails unless each took effect.
    #[arg(long, value_delimiter = ',', value_parser = soak_fault)]
    pub soak_faults: Option<Vec<soak_judge::Fault>>,
    /// How long the soak's stalls and TokenReview outage last (Go
    /// duration).
    #[arg(long, default_value = "30s", value_parser = go_duration)]
    pub soak_hold: Duration,
    /// How long the soak's partitions last (Go duration): past the 2 s
    /// keepalive pings and their 2 s wait for an ack, on both sides.
    #[arg(long, default_value = "20s", value_parser = go_duration)]
    pub soak_partition: Duration,
    /// Break healthy agents on purpose, without telling the judge (a
    /// spurious close, a crash with no end recorded, silent loss and an
    /// altered byte through a tampering relay, a stuck tunnel, dials
    /// refused, a close inside another agent's kill), and kill another as
    /// a recorded fault: the run passes only when the judge fails it for
    /// exactly what was done to the healthy agents and excuses the killed
    /// one. The judge's end-to-end check; needs nftables.
    #[arg(long)]
    pub soak_sabotage: bool,
    /// Request/response workers per soak frontend.
    #[arg(long, default_value_t = 4)]
    pub soak_workers: usize,
    /// Each soak request/response worker starts one exchange per this (Go
    /// duration).
    #[arg(long, default_value = "100ms", value_parser = go_duration)]
    pub soak_interval: Duration,
    /// Bytes per second of each soak frontend's bulk worker.
    #[arg(long, default_value_t = 4_000_000)]
    pub soak_bulk_rate: u64,
    /// Report, without failing, the soak's performance checks: resources
    /// (RSS, fds, tasks) not back within 5 % of their baseline within a
    /// minute of a fault, healthy traffic below 90 % of its rate. For the
    /// short soak of scripts/test, whose baseline falls in the processes'
    /// first minute and whose rates are seconds of debug binaries on a
    /// shared machine. Correctness checks fail the run regardless.
    #[arg(long)]
    pub soak_performance_advisory: bool,
    /// Where the soak writes its Markdown tables.
    #[arg(long, default_value = "soak-report.md")]
    pub soak_report: PathBuf,
    /// Where the soak writes its samples (JSON: the slots' names, then one
    /// sample a second: each process's RSS, descriptors, tasks, books and
    /// allocator figures, the traffic's counts); none if not given.
    #[arg(long)]
    pub soak_samples: Option<PathBuf>,
    /// Internal: serve only the hold-open backend (the bench starts itself
    /// so, to keep idle connections' far ends out of its own fd limit).
    #[arg(long, hide = true)]
    pub hold_backend: bool,
}

impl Opt {
    /// Whether `scenario` was selected.
    fn has(&self, scenario: Scenario) -> bool {
        self.scenarios.contains(&scenario)
    }
}

/// Runs the selected scenarios, prints the table, writes the JSON, and
/// returns the report. Children are killed when it returns, fails, or on
/// SIGINT/SIGTERM.
///
/// # Errors
/// The binaries are missing, the system under test does not start or dies,
/// or the JSON cannot be written.
pub async fn run(mut opt: Opt) -> anyhow::Result<Report> {
    if opt.quick {
        opt.duration = Duration::from_secs(1);
        opt.reps = 1;
        opt.conns = 1000;
        opt.agents = opt.agents.min(1000);
        opt.storm_agents = opt.storm_agents.min(1000);
        opt.retries_duration = opt.retries_duration.min(Duration::from_secs(5));
        opt.retries_kills = opt.retries_kills.min(3);
        opt.retries_rounds = opt.retries_rounds.min(3);
    }
    opt.reps = opt.reps.max(1);
    opt.streams = opt.streams.max(1);
    tokio::select! {
        report = run_selected(opt) => report,
        () = ops::signal::shutdown() => anyhow::bail!("interrupted"),
    }
}

/// Raises RLIMIT_NOFILE (soft and, if allowed, hard) to `want`; the soft
/// limit in force afterwards.
fn raise_nofile(want: u64) -> u64 {
    use rlimit::Resource;
    let Ok((soft, hard)) = Resource::NOFILE.get() else {
        return 0;
    };
    if soft >= want {
        return soft;
    }
    if Resource::NOFILE.set(want, hard.max(want)).is_ok() {
        return want;
    }
    rlimit::increase_nofile_limit(want).unwrap_or(soft)
}

/// [`run`] without the signal handling.
async fn run_selected(opt: Opt) -> anyhow::Result<Report> {
    if opt.has(Scenario::Soak) {
        anyhow::ensure!(
            opt.scenarios.len() == 1,
            "--scenarios soak runs alone: give it without other scenarios"
        );
        return run_soak(opt).await;
    }
    run_measurements(opt).await
}

/// The soak's settings from the command line.
fn soak_opt(opt: &Opt, go_frontend: std::path::PathBuf) -> soak::SoakOpt {
    soak::SoakOpt {
        duration: opt.soak_duration,
        faults: opt.soak_faults.clone(),
        times: soak::faults::FaultTimes {
            hold: opt.soak_hold,
            partition: opt.soak_partition,
        },
        sabotage: opt.soak_sabotage,
        auth: match opt.soak_auth {
            SoakAuth::Mtls => soak::system::Auth::Mtls,
            SoakAuth::Token => soak::system::Auth::Token,
        },
        agents: opt.soak_agents,
        load: soak::traffic::Load {
            rr_workers: opt.soak_workers,
            interval: opt.soak_interval,
            bulk_workers: 1,
            bulk_rate: opt.soak_bulk_rate,
            bulk_bytes: 16 * 1024 * 1024,
        },
        go_frontend,
        markdown: opt.soak_report.clone(),
        samples: opt.soak_samples.clone(),
        performance_fatal: !opt.soak_performance_advisory,
    }
}

/// The soak, its rows in the report.
async fn run_soak(opt: Opt) -> anyhow::Result<Report> {
    raise_nofile(NOFILE_WANTED);
    let bins = binaries(&opt, false)?;
    let go = grpc_go::GoFrontend::locate(opt.go_frontend.clone())?;
    let command_line = std::env::args().collect::<Vec<_>>().join(" ");
    println!("command: {command_line}");
    let soak_opt = soak_opt(&opt, go.path);
    let result = soak::run(bins.clone(), soak_opt).await?;
    let mut rec = Recorder::new(1);
    report::push_soak(&mut rec, &result);
    let report = Report {
        command_line,
        machine: Machine::read(),
        settings: Settings {
            duration_s: result.run.seconds,
            reps: 1,
            conns: 0,
            round_trips: 0,
            streams: 0,
            scenarios: opt.scenarios.iter().map(|s| s.name()).collect(),
            nofile_limit: raise_nofile(NOFILE_WANTED),
            server_bin: bins.server.display().to_string(),
            agent_bin: bins.agent.display().to_string(),
            crypto_provider: ops::tls::PROVIDER_NAME.to_owned(),
        },
        notes: vec![
            "soak: the grpc column sums the three frontends of the gRPC server (our client, \
             grpc-go single-use, grpc-go reused); http-connect is our client on the CONNECT \
             server; whole-run rows are in the grpc column"
                .to_owned(),
        ],
        metrics: rec.metrics(),
    };
    println!();
    print!("{}", report.table());
    write_json(&report, &opt.json)?;
    for r in result.verdict.advisory() {
        eprintln!(
            "soak: reported, not failed (--soak-performance-advisory): {}",
            r.text
        );
    }
    if !result.verdict.held() {
        for r in result.verdict.failing() {
            eprintln!("soak: VIOLATED: {}", r.text);
        }
        anyhow::bail!(
            "the soak found {} violated invariants",
            result.verdict.failing().count()
        );
    }
    if opt.soak_sabotage {
        println!("soak: the judge failed the sabotaged run for exactly what was done");
        return Ok(report);
    }
    println!("soak: every invariant held");
    Ok(report)
}

/// The measurement scenarios (all but the soak): the system up, the
/// scenarios that run once, the repetitions, the scenarios with systems
/// of their own, then the table and the JSON.
async fn run_measurements(mut opt: Opt) -> anyhow::Result<Report> {
    let mut notes = Vec::new();
    let (nofile, wanted) = fit_conns(&mut opt, &mut notes);
    let machine = Machine::read();
    let command_line = std::env::args().collect::<Vec<_>>().join(" ");
    let bins = binaries(&opt, opt.has(Scenario::Agents))?;
    let timing = Timing {
        warmup: (opt.duration / 5).min(MAX_WARMUP),
        duration: opt.duration,
    };
    print_setup(
        &opt,
        (&command_line, &machine),
        (nofile, wanted),
        &bins,
        timing,
    );
    let mut system = System::start(&bins).await?;
    let extras = Extras::prepare(&opt)?;
    let mut rec = Recorder::new(opt.reps);
    run_once(&opt, &extras, &system, &mut rec, &mut notes).await?;
    for rep in 0..opt.reps {
        system
            .repetition(&opt, extras.go.as_ref(), timing, rep, &mut rec)
            .await?;
    }
    run_apart(
        &opt,
        &extras,
        (&bins, &system),
        nofile,
        timing,
        &mut rec,
        &mut notes,
    )
    .await?;
    notes.extend(closing_notes());
    let report = Report {
        command_line,
        machine,
        settings: Settings {
            duration_s: opt.duration.as_secs_f64(),
            reps: opt.reps,
            conns: opt.conns,
            round_trips: opt.round_trips,
            streams: opt.streams,
            scenarios: opt.scenarios.iter().map(|s| s.name()).collect(),
            nofile_limit: nofile,
            server_bin: bins.server.display().to_string(),
            agent_bin: bins.agent.display().to_string(),
            crypto_provider: ops::tls::PROVIDER_NAME.to_owned(),
        },
        notes,
        metrics: rec.metrics(),
    };
    println!();
    print!("{}", report.table());
    println!();
    for note in &report.notes {
        println!("note: {note}");
    }
    write_json(&report, &opt.json)?;
    Ok(report)
}

/// The binaries, with `--worker-threads` added to their flags when given;
/// `agent_swarm`: the agents scenario's swarm too.
fn binaries(opt: &Opt, agent_swarm: bool) -> anyhow::Result<Binaries> {
    let mut bins = Binaries::locate(opt.server_bin.clone(), opt.agent_bin.clone(), agent_swarm)?;
    if opt.worker_threads > 0 {
        bins.extra
            .push(format!("--worker-threads={}", opt.worker_threads));
    }
    Ok(bins)
}

/// Raises the open-file limit for `--conns` idle connections, lowering
/// `--conns` (with a note) if it cannot be had; (the limit, the one asked
/// for).
fn fit_conns(opt: &mut Opt, notes: &mut Vec<String>) -> (u64, u64) {
    let wanted = NOFILE_WANTED.max(opt.conns as u64 + NOFILE_SPARE);
    let nofile = raise_nofile(wanted);
    // Every process involved holds one descriptor per idle connection.
    let fits = nofile.saturating_sub(NOFILE_SPARE) as usize;
    if opt.conns > fits {
        notes.push(format!(
            "--conns lowered from {} to {fits} to fit RLIMIT_NOFILE {nofile}",
            opt.conns
        ));
        opt.conns = fits;
    }
    (nofile, wanted)
}

/// Prints the command, the machine, the open-file limit, the binaries and
/// the settings.
fn print_setup(
    opt: &Opt,
    (command_line, machine): (&str, &Machine),
    (nofile, wanted): (u64, u64),
    bins: &Binaries,
    timing: Timing,
) {
    println!("command: {command_line}");
    println!(
        "machine: {} CPUs ({}), {} MiB, kernel {}",
        machine.nproc, machine.cpu, machine.memory_mib, machine.kernel
    );
    println!(
        "RLIMIT_NOFILE: {nofile} (asked for {wanted}) for the bench; proxy-server and \
         proxy-agent inherit it"
    );
    println!(
        "binaries: {} {} (rustls with the {} crypto provider)",
        bins.server.display(),
        bins.agent.display(),
        ops::tls::PROVIDER_NAME
    );
    println!(
        "settings: duration {:?} (+{:?} warm-up), reps {}, conns {}, round trips {}, streams {}, \
         server/agent worker threads {}",
        timing.duration,
        timing.warmup,
        opt.reps,
        opt.conns,
        opt.round_trips,
        opt.streams,
        match opt.worker_threads {
            0 => "one per CPU".to_owned(),
            n => n.to_string(),
        }
    );
}

/// The system the measurement scenarios run against: a deployment per
/// mode, the node-side servers, the certificates. Fields drop in order:
/// the processes before the files they use.
struct System {
    /// Direct, gRPC, HTTP CONNECT.
    targets: [Target; 3],
    /// The HTTP-CONNECT-mode server and agent.
    http: Deployment,
    /// The gRPC-mode server and agent.
    grpc: Deployment,
    /// The node-side servers.
    backends: Backends,
    /// The certificates (and the scenarios' files).
    dir: tempfile::TempDir,
}

impl System {
    /// Writes the certificates, starts the backends and both deployments.
    async fn start(bins: &Binaries) -> anyhow::Result<Self> {
        let dir = tempfile::Builder::new()
            .prefix("konnectivity-bench-")
            .tempdir()
            .context("creating a temporary directory")?;
        certs::ClusterPki::generate(&[])
            .context("generating certificates")?
            .write_to(dir.path())
            .context("writing certificates")?;
        let backends = Backends::start().await.context("starting the backends")?;
        let grpc = Deployment::start(bins, dir.path(), Mode::Grpc)
            .await
            .context("starting the gRPC-mode server and agent")?;
        let http = Deployment::start(bins, dir.path(), Mode::HttpConnect)
            .await
            .context("starting the HTTP-CONNECT-mode server and agent")?;
        let targets = [
            Target {
                route: Route::Direct,
                dialer: None,
                pids: None,
                health: None,
            },
            Target {
                route: Route::Grpc,
                dialer: Some(grpc.dialer()),
                pids: Some(grpc.pids()),
                health: Some(grpc.health),
            },
            Target {
                route: Route::HttpConnect,
                dialer: Some(http.dialer()),
                pids: Some(http.pids()),
                health: Some(http.health),
            },
        ];
        Ok(Self {
            targets,
            http,
            grpc,
            backends,
            dir,
        })
    }

    /// Repetition `rep`: the time-boxed scenarios on each route in turn,
    /// then ping-pong's latency added over direct.
    ///
    /// # Errors
    /// A deployment died.
    async fn repetition(
        &mut self,
        opt: &Opt,
        go: Option<&grpc_go::GoFrontend>,
        timing: Timing,
        rep: usize,
        rec: &mut Recorder,
    ) -> anyhow::Result<()> {
        for target in &self.targets {
            Rep::new(opt, go, target, &self.backends, timing, rep)
                .run(rec)
                .await;
            self.grpc.check_alive()?;
            self.http.check_alive()?;
        }
        if opt.has(Scenario::Pingpong) {
            for target in &self.targets[1..] {
                for (added, of) in [
                    (&report::PING_ADDED_P50, &report::PING_P50),
                    (&report::PING_ADDED_P99, &report::PING_P99),
                ] {
                    let value = rec
                        .get(of, target.route, rep)
                        .zip(rec.get(of, Route::Direct, rep))
                        .map(|(mode, direct)| mode - direct);
                    rec.push(added, target.route, rep, value);
                }
            }
        }
        Ok(())
    }
}

/// What the selected scenarios need besides the system, located and
/// checked before any runs.
struct Extras {
    /// The grpc-go frontend, for bulk, cpu, dial, streams and retries.
    go: Option<grpc_go::GoFrontend>,
    /// The storm scenario's options, if selected.
    storm: Option<storm::StormOpt>,
    /// The retries scenario's options, if selected.
    retries: Option<retries::RetriesOpt>,
}

impl Extras {
    /// Locates the grpc-go programs and checks what the storm and retries
    /// scenarios need.
    ///
    /// # Errors
    /// A program is missing, or a scenario cannot run here.
    fn prepare(opt: &Opt) -> anyhow::Result<Self> {
        let go = if opt.has(Scenario::Bulk)
            || opt.has(Scenario::Cpu)
            || opt.has(Scenario::Dial)
            || opt.has(Scenario::Streams)
            || opt.has(Scenario::Retries)
            || opt.has(Scenario::Policy)
            || opt.has(Scenario::Overhead)
        {
            let go = grpc_go::GoFrontend::locate(opt.go_frontend.clone())?;
            println!("grpc-go frontend: {}", go.path.display());
            Some(go)
        } else {
            None
        };
        let storm = if opt.has(Scenario::Storm) {
            let storm = storm::StormOpt {
                agents: opt.storm_agents,
                conditions: opt.storm_conditions.clone(),
                latency: opt.storm_latency,
                limit: opt.storm_limit,
                key_algorithm: opt.storm_key_algorithm,
                go_agents: storm::GoAgents::locate(opt.go_agents.clone())?,
            };
            storm::check(&storm)?;
            println!("grpc-go agents: {}", storm.go_agents.path.display());
            Some(storm)
        } else {
            None
        };
        let retries = match (opt.has(Scenario::Retries), go.as_ref()) {
            (true, Some(go)) => {
                retries::check()?;
                Some(retries::RetriesOpt {
                    rate: opt.retries_rate,
                    duration: opt.retries_duration,
                    kills: opt.retries_kills,
                    rounds: opt.retries_rounds,
                    go: go.clone(),
                })
            }
            _ => None,
        };
        Ok(Self { go, storm, retries })
    }
}

/// The scenarios that run once, before the repetitions, on the system's
/// fresh processes: memory, churn, streams; their notes.
async fn run_once(
    opt: &Opt,
    extras: &Extras,
    system: &System,
    rec: &mut Recorder,
    notes: &mut Vec<String>,
) -> anyhow::Result<()> {
    let (targets, backends) = (&system.targets, &system.backends);
    if opt.has(Scenario::Memory) {
        memory_scenario(opt, targets, backends, rec).await?;
        notes.push(format!(
            "memory runs once, before the other scenarios, on fresh processes; \
             per-conn = (RSS with {} open - RSS just before) / {}; rounds open and close {} each",
            opt.conns,
            opt.conns,
            (opt.conns / 10).max(1)
        ));
    }
    if opt.has(Scenario::Churn) {
        churn_scenario(opt, targets, backends, rec).await?;
        notes.push(format!(
            "churn runs once, after memory, before the time-boxed scenarios: {} rounds of {} \
             tunnels open at once, each echoing 1 KiB, RSS settled after each",
            opt.churn_rounds.max(2),
            opt.conns
        ));
    }
    if let (true, Some(go)) = (opt.has(Scenario::Streams), extras.go.as_ref()) {
        streams_scenario(opt, go, targets, backends, rec).await?;
        notes.push(format!(
            "streams runs once, after churn: {} tunnels held open on one grpc-go connection \
             (-reuse many), 64 opened at a time, each echoing 1 KiB; RSS per tunnel = (settled \
             RSS with them open - settled RSS before) / {}",
            opt.conns, opt.conns
        ));
    }
    Ok(())
}

/// The scenarios that start systems of their own, after the repetitions:
/// agents, storm, retries, policy, budget; their notes.
async fn run_apart(
    opt: &Opt,
    extras: &Extras,
    (bins, system): (&Binaries, &System),
    nofile: u64,
    timing: Timing,
    rec: &mut Recorder,
    notes: &mut Vec<String>,
) -> anyhow::Result<()> {
    let dir = system.dir.path();
    if opt.has(Scenario::Agents) {
        let agents = agents::AgentsOpt {
            n: opt.agents,
            duration: timing.duration,
            nofile,
            algorithm: opt.agents_key_algorithm,
            review_latency: opt.agents_review_latency,
        };
        agents::run(bins, dir, &system.backends, &agents, rec)
            .await
            .context("agents scenario")?;
        notes.push(format!(
            "agents runs once, last, against a server of its own (gRPC mode, default flags, {:?} \
             keys): N = {} real agents in agent-swarm processes (each agent its own TLS \
             connection, session cache, Connect stream, health and admin listeners; default \
             --sync-interval); links cut = SIGUSR1 to the swarm, which drops every agent's \
             connection; ANP-style = no flow control, no session cache; RSS per agent = (RSS \
             with N - RSS before) / N, the swarm's beyond its first agent; CPU = utime+stime of \
             proxy-server while they connect",
            opt.agents_key_algorithm, opt.agents
        ));
    }
    if let Some(storm) = &extras.storm {
        let more = storm::run(bins, dir, storm, rec)
            .await
            .context("storm scenario")?;
        notes.extend(more);
    }
    if let Some(retries) = &extras.retries {
        let more = retries::run(bins, dir, retries, rec)
            .await
            .context("retries scenario")?;
        notes.extend(more);
    }
    costs(opt, extras, (bins, system), timing, rec, notes).await?;
    if opt.has(Scenario::Audit) {
        let more = audit::run(bins, dir, &system.backends, opt.audit_tunnels)
            .await
            .context("audit scenario")?;
        notes.extend(more);
    }
    if opt.has(Scenario::Budget) {
        let budget = budget::BudgetOpt {
            streams: opt.budget_streams,
            connections: opt.budget_connections,
            packets: opt.budget_packets,
        };
        let more = budget::run(bins, dir, &system.backends, &budget, rec)
            .await
            .context("budget scenario")?;
        notes.extend(more);
    }
    Ok(())
}

/// The policy and overhead scenarios: what a feature costs per tunnel,
/// side by side with a deployment without it; their notes.
async fn costs(
    opt: &Opt,
    extras: &Extras,
    (bins, system): (&Binaries, &System),
    timing: Timing,
    rec: &mut Recorder,
    notes: &mut Vec<String>,
) -> anyhow::Result<()> {
    let dir = system.dir.path();
    if opt.has(Scenario::Policy) {
        let more = policy::run(
            bins,
            dir,
            &system.backends,
            extras.go.as_ref(),
            (timing, opt.reps),
            rec,
        )
        .await
        .context("policy scenario")?;
        notes.extend(more);
    }
    if opt.has(Scenario::Overhead) {
        let more = overhead::run(
            bins,
            dir,
            &system.backends,
            extras.go.as_ref(),
            (timing, opt.reps),
            rec,
        )
        .await
        .context("overhead scenario")?;
        notes.extend(more);
    }
    Ok(())
}

/// The notes on how every measurement reads.
fn closing_notes() -> [String; 2] {
    [
        "each repetition runs direct, grpc, http-connect in turn; cells are median [min–max] \
         over repetitions, ×r is the median of per-repetition ratios to direct"
            .to_owned(),
        "MB/s = 10^6 bytes/s; cpu = utime+stime of proxy-server + proxy-agent from /proc \
         (100 ticks/s) per GiB moved in the measured window; hol 'server max buffered' is \
         the konnectivity_rs_server_max_buffered_bytes gauge (n/a when /metrics lacks it)"
            .to_owned(),
    ]
}

/// Writes `report` as pretty JSON to `path` (`--json`) and says where.
fn write_json(report: &Report, path: &Path) -> anyhow::Result<()> {
    let json = serde_json::to_string_pretty(report).context("serializing the results")?;
    std::fs::write(path, json + "\n")
        .with_context(|| format!("writing --json {}", path.display()))?;
    println!("JSON: {}", path.display());
    Ok(())
}

/// Idle RSS, then the memory scenario, for each tunneled route.
async fn memory_scenario(
    opt: &Opt,
    targets: &[Target],
    backends: &Backends,
    rec: &mut Recorder,
) -> anyhow::Result<()> {
    const MIB: f64 = 1024.0 * 1024.0;
    for target in targets {
        let Some(pids) = target.pids else { continue };
        let route = target.route;
        let idle = scenarios::settled_rss(pids).await?;
        rec.push(
            &report::MEM_IDLE_SERVER,
            route,
            0,
            Some(idle.0 as f64 / MIB),
        );
        rec.push(&report::MEM_IDLE_AGENT, route, 0, Some(idle.1 as f64 / MIB));
        eprintln!(
            "memory {}: {} idle connections ...",
            route.name(),
            opt.conns
        );
        let m = scenarios::memory(target, backends, opt.conns)
            .await
            .with_context(|| format!("memory scenario, {}", route.name()))?;
        let values = [
            (&report::MEM_CONN_SERVER, m.per_conn.0 / 1024.0),
            (&report::MEM_CONN_AGENT, m.per_conn.1 / 1024.0),
            (&report::MEM_R1_SERVER, m.round1.0 as f64 / MIB),
            (&report::MEM_R10_SERVER, m.round10.0 as f64 / MIB),
            (
                &report::MEM_GROWTH_SERVER,
                (m.round10.0 as f64 - m.round1.0 as f64) / MIB,
            ),
            (&report::MEM_R1_AGENT, m.round1.1 as f64 / MIB),
            (&report::MEM_R10_AGENT, m.round10.1 as f64 / MIB),
            (
                &report::MEM_GROWTH_AGENT,
                (m.round10.1 as f64 - m.round1.1 as f64) / MIB,
            ),
        ];
        for (def, value) in values {
            rec.push(def, route, 0, Some(value));
        }
        eprintln!(
            "memory {}: {:.1} KiB/conn server, {:.1} KiB/conn agent",
            route.name(),
            m.per_conn.0 / 1024.0,
            m.per_conn.1 / 1024.0
        );
    }
    Ok(())
}

/// The churn scenario, for each tunneled route.
async fn churn_scenario(
    opt: &Opt,
    targets: &[Target],
    backends: &Backends,
    rec: &mut Recorder,
) -> anyhow::Result<()> {
    const MIB: f64 = 1024.0 * 1024.0;
    let rounds = opt.churn_rounds.max(2);
    for target in targets.iter().filter(|t| t.pids.is_some()) {
        let route = target.route;
        eprintln!(
            "churn {}: {rounds} rounds of {} tunnels ...",
            route.name(),
            opt.conns
        );
        let rss = scenarios::churn(target, backends, opt.conns, rounds)
            .await
            .with_context(|| format!("churn scenario, {}", route.name()))?;
        let per_round: Vec<String> = rss
            .iter()
            .map(|(s, a)| format!("{:.1}/{:.1}", *s as f64 / MIB, *a as f64 / MIB))
            .collect();
        eprintln!(
            "churn {}: RSS after each round (MiB, server/agent): {}",
            route.name(),
            per_round.join(" ")
        );
        let (second, last) = (rss[1], rss[rss.len() - 1]);
        let growth = |last: u64, second: u64| (last as f64 / second as f64 - 1.0) * 100.0;
        for (def, value) in [
            (&report::CHURN_R2_SERVER, second.0 as f64 / MIB),
            (&report::CHURN_LAST_SERVER, last.0 as f64 / MIB),
            (&report::CHURN_GROWTH_SERVER, growth(last.0, second.0)),
            (&report::CHURN_R2_AGENT, second.1 as f64 / MIB),
            (&report::CHURN_LAST_AGENT, last.1 as f64 / MIB),
            (&report::CHURN_GROWTH_AGENT, growth(last.1, second.1)),
        ] {
            rec.push(def, route, 0, Some(value));
        }
    }
    Ok(())
}

/// One repetition of the selected time-series scenarios against one
/// target; failures are reported and leave `n/a`.
struct Rep<'a> {
    /// The options.
    opt: &'a Opt,
    /// The grpc-go frontend, if located.
    go: Option<&'a grpc_go::GoFrontend>,
    /// The route measured.
    target: &'a Target,
    /// The node-side servers.
    backends: &'a Backends,
    /// Warm-up and measured time.
    timing: Timing,
    /// Which repetition.
    rep: usize,
    /// `rep N/M`, the start of its log lines.
    ctx: String,
}

/// A bulk run: its rate row, its CPU rows, upload or download, and the
/// grpc-go frontend that drives it (our client if none).
type BulkRun<'a> = (
    &'static report::Def,
    CpuRows,
    bool,
    Option<&'a grpc_go::GoFrontend>,
);

impl<'a> Rep<'a> {
    /// Repetition `rep` against `target`.
    fn new(
        opt: &'a Opt,
        go: Option<&'a grpc_go::GoFrontend>,
        target: &'a Target,
        backends: &'a Backends,
        timing: Timing,
        rep: usize,
    ) -> Self {
        Self {
            opt,
            go,
            target,
            backends,
            timing,
            rep,
            ctx: format!("rep {}/{}", rep + 1, opt.reps),
        }
    }

    /// Runs the selected scenarios and records their rows.
    async fn run(&self, rec: &mut Recorder) {
        let opt = self.opt;
        if opt.has(Scenario::Bulk) || (opt.has(Scenario::Cpu) && self.tunneled()) {
            self.bulk(rec).await;
        }
        if opt.has(Scenario::Parallel) {
            self.parallel(rec).await;
        }
        if opt.has(Scenario::Hol) && self.tunneled() {
            self.hol(rec).await;
        }
        if opt.has(Scenario::Pingpong) {
            self.pingpong(rec).await;
        }
        if opt.has(Scenario::Dial) {
            self.dial(rec).await;
        }
    }

    /// The route.
    fn route(&self) -> Route {
        self.target.route
    }

    /// The route's name in the log.
    fn name(&self) -> &'static str {
        self.target.route.name()
    }

    /// Whether the route goes through a server and an agent.
    fn tunneled(&self) -> bool {
        self.target.pids.is_some()
    }

    /// Whether the route is the gRPC mode's.
    fn grpc(&self) -> bool {
        self.target
            .dialer
            .as_ref()
            .is_some_and(|d| d.mode == client::dial::Mode::Grpc)
    }

    /// Logs that `what` failed.
    fn failed(&self, what: &str, e: anyhow::Error) {
        eprintln!("{} {what} {}: FAILED: {e:#}", self.ctx, self.name());
    }

    /// Records `value` in `def`'s row for this route and repetition.
    fn push(&self, rec: &mut Recorder, def: &report::Def, value: Option<f64>) {
        rec.push(def, self.route(), self.rep, value);
    }

    /// Bulk down and up; in gRPC mode twice: with our client, then with
    /// grpc-go (kube-apiserver's client library).
    async fn bulk(&self, rec: &mut Recorder) {
        let mut runs: Vec<BulkRun<'_>> = vec![
            (&report::BULK_DOWN, CPU_DOWN_ROWS, false, None),
            (&report::BULK_UP, CPU_UP_ROWS, true, None),
        ];
        if let (true, Some(go)) = (self.grpc(), self.go) {
            runs.push((&report::BULK_DOWN_GO, CPU_DOWN_GO_ROWS, false, Some(go)));
            runs.push((&report::BULK_UP_GO, CPU_UP_GO_ROWS, true, Some(go)));
        }
        for run in runs {
            self.bulk_run(run, rec).await;
        }
    }

    /// One bulk run and its rows.
    async fn bulk_run(&self, (rate, cpu, up, go): BulkRun<'_>, rec: &mut Recorder) {
        let (target, backends, timing) = (self.target, self.backends, self.timing);
        let transfer = match (go, up) {
            (Some(go), up) => go.bulk(target, backends, timing, up).await,
            (None, true) => scenarios::upload(target, backends, timing).await,
            (None, false) => scenarios::download(target, backends, timing, 1).await,
        };
        let what = format!(
            "{}{}",
            if up { "bulk up" } else { "bulk down" },
            if go.is_some() { " (grpc-go)" } else { "" }
        );
        match transfer {
            Ok(t) => self.bulk_rows(&t, (rate, cpu), up, &what, rec),
            Err(e) => {
                self.failed(&what, e);
                self.push(rec, rate, None);
            }
        }
    }

    /// The rows of a bulk run that moved `t`: its rate (direct's also
    /// in the grpc-go row, which compares with it) and CPU per GiB.
    fn bulk_rows(
        &self,
        t: &Transfer,
        (rate, [cpu, server, agent, server_switches, agent_switches]): (&report::Def, CpuRows),
        up: bool,
        what: &str,
        rec: &mut Recorder,
    ) {
        let opt = self.opt;
        if self.route() == Route::Direct && opt.has(Scenario::Bulk) {
            // The grpc-go rows' ratios are to the same direct run.
            let go = if up {
                &report::BULK_UP_GO
            } else {
                &report::BULK_DOWN_GO
            };
            self.push(rec, go, Some(t.mb_per_s()));
        }
        eprintln!(
            "{} {what} {}: {:.0} MB/s{}{}",
            self.ctx,
            self.name(),
            t.mb_per_s(),
            t.cpu_s_per_gib()
                .zip(t.server_cpu_s_per_gib())
                .map(|(c, s)| format!(", {c:.2} cpu s/GiB (server {s:.2}, agent {:.2})", c - s))
                .unwrap_or_default(),
            t.switches_per_gib()
                .map(|(s, a)| format!(", context switches per GiB: server {s:.0}, agent {a:.0}"))
                .unwrap_or_default()
        );
        if opt.has(Scenario::Bulk) {
            self.push(rec, rate, Some(t.mb_per_s()));
        }
        if opt.has(Scenario::Cpu) && self.tunneled() {
            self.push(rec, cpu, t.cpu_s_per_gib());
            let server_cpu = t.server_cpu_s_per_gib();
            self.push(rec, server, server_cpu);
            let agent_cpu = t.cpu_s_per_gib().zip(server_cpu).map(|(c, s)| c - s);
            self.push(rec, agent, agent_cpu);
            let switches = t.switches_per_gib();
            self.push(rec, server_switches, switches.map(|(s, _)| s));
            self.push(rec, agent_switches, switches.map(|(_, a)| a));
        }
    }

    /// `--streams` downloads at once: the total rate and Jain's fairness.
    async fn parallel(&self, rec: &mut Recorder) {
        let streams = self.opt.streams;
        match scenarios::download(self.target, self.backends, self.timing, streams).await {
            Ok(w) => {
                let shares: Vec<f64> = w.per_stream.iter().map(|&b| b as f64).collect();
                let fairness = stats::jain_index(&shares);
                eprintln!(
                    "{} parallel x{streams} {}: {:.0} MB/s, fairness {}",
                    self.ctx,
                    self.name(),
                    w.mb_per_s(),
                    fairness.map_or("n/a".to_owned(), |f| format!("{f:.3}"))
                );
                self.push(rec, &report::PARALLEL_RATE, Some(w.mb_per_s()));
                self.push(rec, &report::PARALLEL_FAIRNESS, fairness);
            }
            Err(e) => {
                self.failed("parallel", e);
                self.push(rec, &report::PARALLEL_RATE, None);
            }
        }
    }

    /// Bulk alone and next to a stalled connection, and the server's
    /// buffered bytes.
    async fn hol(&self, rec: &mut Recorder) {
        match scenarios::head_of_line(self.target, self.backends, self.timing).await {
            Ok(h) => {
                eprintln!(
                    "{} hol {}: alone {:.0} MB/s, next to stalled {:.0} MB/s, buffered {}",
                    self.ctx,
                    self.name(),
                    h.solo,
                    h.stalled,
                    h.buffered.map_or("n/a".to_owned(), |b| format!("{b:.0} B"))
                );
                self.push(rec, &report::HOL_SOLO, Some(h.solo));
                self.push(rec, &report::HOL_STALLED, Some(h.stalled));
                let ratio = Some(h.stalled / h.solo).filter(|r| r.is_finite());
                self.push(rec, &report::HOL_RATIO, ratio);
                self.push(rec, &report::HOL_BUFFERED, h.buffered);
            }
            Err(e) => {
                self.failed("hol", e);
                self.push(rec, &report::HOL_RATIO, None);
            }
        }
    }

    /// Round trips on one connection: p50 and p99.
    async fn pingpong(&self, rec: &mut Recorder) {
        match scenarios::pingpong(self.target, self.backends, self.opt.round_trips).await {
            Ok(h) => {
                let (p50, p99) = (stats::quantile_us(&h, 0.5), stats::quantile_us(&h, 0.99));
                eprintln!(
                    "{} pingpong {}: p50 {p50:.1} us, p99 {p99:.1} us",
                    self.ctx,
                    self.name()
                );
                self.push(rec, &report::PING_P50, Some(p50));
                self.push(rec, &report::PING_P99, Some(p99));
            }
            Err(e) => {
                self.failed("pingpong", e);
                self.push(rec, &report::PING_P50, None);
            }
        }
    }

    /// Single-use tunnels with our client and, in gRPC mode, with
    /// grpc-go (new connections, then one reused); the errors of all.
    async fn dial(&self, rec: &mut Recorder) {
        let mut errors = self.dials_ours(rec).await;
        if let (true, Some(go)) = (self.grpc(), self.go) {
            errors += self.dials_go(go, rec).await;
            errors += self.reused_dials(go, rec).await;
        }
        if self.route() == Route::Direct {
            // The grpc-go rows' ratios are to the same direct run.
            for (ours, go) in [
                (&report::DIAL1_RATE, &report::DIAL1_RATE_GO),
                (&report::DIAL8_RATE, &report::DIAL8_RATE_GO),
                (&report::DIAL1_RATE, &report::DIAL1_RATE_REUSE),
                (&report::DIAL8_RATE, &report::DIAL8_RATE_REUSE),
            ] {
                let direct = rec.get(ours, self.route(), self.rep);
                self.push(rec, go, direct);
            }
        }
        self.push(rec, &report::DIAL_ERRORS, Some(errors as f64));
    }

    /// Our client's single-use tunnels, one and eight at a time; the
    /// errors.
    async fn dials_ours(&self, rec: &mut Recorder) -> u64 {
        let mut errors = 0;
        for (concurrency, defs) in DIAL_CONCURRENCY.into_iter().zip([
            [&report::DIAL1_RATE, &report::DIAL1_P50, &report::DIAL1_P99],
            [&report::DIAL8_RATE, &report::DIAL8_P50, &report::DIAL8_P99],
        ]) {
            let duration = self.timing.duration;
            let run = scenarios::dial_rate(self.target, self.backends, concurrency, duration).await;
            let figures = run.map(|d| {
                let some = !d.latency.is_empty();
                DialFigures {
                    rate: d.rate,
                    p50_us: some.then(|| stats::quantile_us(&d.latency, 0.5)),
                    p99_us: some.then(|| stats::quantile_us(&d.latency, 0.99)),
                    errors: d.errors,
                    first_error: d.first_error,
                    cpu_us: d.cpu_us,
                }
            });
            let rows = (defs, DIAL8_CPU_ROWS);
            errors += self.record_dials(rec, concurrency, "", rows, figures);
        }
        errors
    }

    /// grpc-go's single-use tunnels (a connection each), one and eight at
    /// a time; the errors.
    async fn dials_go(&self, go: &grpc_go::GoFrontend, rec: &mut Recorder) -> u64 {
        let mut errors = 0;
        for (concurrency, defs) in DIAL_CONCURRENCY.into_iter().zip([
            [
                &report::DIAL1_RATE_GO,
                &report::DIAL1_P50_GO,
                &report::DIAL1_P99_GO,
            ],
            [
                &report::DIAL8_RATE_GO,
                &report::DIAL8_P50_GO,
                &report::DIAL8_P99_GO,
            ],
        ]) {
            let duration = self.timing.duration;
            let run = go
                .dials(self.target, self.backends, concurrency, duration, false)
                .await;
            let figures = run.map(|d| DialFigures {
                rate: d.rate,
                p50_us: Some(d.p50_us),
                p99_us: Some(d.p99_us),
                errors: d.errors,
                first_error: d.first_error,
                cpu_us: d.cpu_us,
            });
            let rows = (defs, DIAL8_CPU_GO_ROWS);
            errors += self.record_dials(rec, concurrency, " (grpc-go)", rows, figures);
        }
        errors
    }

    /// Logs and records one single-use dial run of `concurrency` (rate,
    /// p50, p99 in `rows.0`; CPU per tunnel at eight in `rows.1`); its
    /// errors. `client` follows "dial" in the log (empty for ours).
    fn record_dials(
        &self,
        rec: &mut Recorder,
        concurrency: usize,
        client: &str,
        rows: ([&'static report::Def; 3], TunnelCpuRows),
        figures: anyhow::Result<DialFigures>,
    ) -> u64 {
        let (defs, cpu_rows) = rows;
        let d = match figures {
            Ok(d) => d,
            Err(e) => {
                self.failed(&format!("dial{client}"), e);
                self.push(rec, defs[0], None);
                return 0;
            }
        };
        let (p50, p99) = (d.p50_us.unwrap_or(0.0), d.p99_us.unwrap_or(0.0));
        eprintln!(
            "{} dial c={concurrency} {}{client}: {:.0} dials/s, p50 {p50:.0} us, \
             p99 {p99:.0} us, {} errors{}",
            self.ctx,
            self.name(),
            d.rate,
            d.errors,
            d.first_error
                .as_deref()
                .map(|e| format!(" (first: {e})"))
                .unwrap_or_default()
        );
        self.push(rec, defs[0], Some(d.rate));
        self.push(rec, defs[1], d.p50_us);
        self.push(rec, defs[2], d.p99_us);
        if concurrency == 8 {
            push_cpu(rec, cpu_rows, self.route(), self.rep, d.cpu_us);
        }
        d.errors
    }

    /// Dials on grpc-go's reusable tunnel (one connection, a Proxy stream
    /// each), one and eight at a time; the errors.
    async fn reused_dials(&self, go: &grpc_go::GoFrontend, rec: &mut Recorder) -> u64 {
        let route = self.route();
        let mut errors = 0;
        for concurrency in DIAL_CONCURRENCY {
            match go
                .dials(
                    self.target,
                    self.backends,
                    concurrency,
                    self.timing.duration,
                    true,
                )
                .await
            {
                Ok(d) => {
                    eprintln!(
                        "{} dial c={concurrency} {} (grpc-go, reused conn): {:.0} dials/s, p50 {:.0} us, \
                         p99 {:.0} us, {} errors{}",
                        self.ctx,
                        route.name(),
                        d.rate,
                        d.p50_us,
                        d.p99_us,
                        d.errors,
                        d.cpu_us
                            .map(|(s, a)| format!(
                                ", CPU per dial server {s:.0} us, agent {a:.0} us"
                            ))
                            .unwrap_or_default()
                    );
                    if concurrency == 1 {
                        self.push(rec, &report::DIAL1_RATE_REUSE, Some(d.rate));
                    } else {
                        self.push(rec, &report::DIAL8_RATE_REUSE, Some(d.rate));
                        self.push(rec, &report::DIAL8_P50_REUSE, Some(d.p50_us));
                        self.push(rec, &report::DIAL8_P99_REUSE, Some(d.p99_us));
                        push_cpu(rec, DIAL8_CPU_REUSE_ROWS, route, self.rep, d.cpu_us);
                    }
                    errors += d.errors;
                }
                Err(e) => {
                    eprintln!(
                        "{} dial (grpc-go, reused conn) {}: FAILED: {e:#}",
                        self.ctx,
                        route.name()
                    );
                }
            }
        }
        errors
    }
}

/// CPU rows of a bulk run: server+agent, server, agent, then the
/// server's and the agent's context switches.
type CpuRows = [&'static report::Def; 5];
/// Bulk down, our client.
const CPU_DOWN_ROWS: CpuRows = [
    &report::CPU_DOWN,
    &report::CPU_DOWN_SERVER,
    &report::CPU_DOWN_AGENT,
    &report::SWITCHES_DOWN_SERVER,
    &report::SWITCHES_DOWN_AGENT,
];
/// Bulk up, our client.
const CPU_UP_ROWS: CpuRows = [
    &report::CPU_UP,
    &report::CPU_UP_SERVER,
    &report::CPU_UP_AGENT,
    &report::SWITCHES_UP_SERVER,
    &report::SWITCHES_UP_AGENT,
];
/// Bulk down, grpc-go.
const CPU_DOWN_GO_ROWS: CpuRows = [
    &report::CPU_DOWN_GO,
    &report::CPU_DOWN_SERVER_GO,
    &report::CPU_DOWN_AGENT_GO,
    &report::SWITCHES_DOWN_SERVER_GO,
    &report::SWITCHES_DOWN_AGENT_GO,
];
/// Bulk up, grpc-go.
const CPU_UP_GO_ROWS: CpuRows = [
    &report::CPU_UP_GO,
    &report::CPU_UP_SERVER_GO,
    &report::CPU_UP_AGENT_GO,
    &report::SWITCHES_UP_SERVER_GO,
    &report::SWITCHES_UP_AGENT_GO,
];
/// CPU per tunnel rows, (server, agent).
type TunnelCpuRows = [&'static report::Def; 2];
/// Single-use tunnels at 8 clients, our client.
const DIAL8_CPU_ROWS: TunnelCpuRows = [&report::DIAL8_SERVER_US, &report::DIAL8_AGENT_US];
/// Single-use tunnels at 8 clients, grpc-go.
const DIAL8_CPU_GO_ROWS: TunnelCpuRows = [&report::DIAL8_SERVER_US_GO, &report::DIAL8_AGENT_US_GO];
/// Dials on one reused connection at 8 clients, grpc-go.
const DIAL8_CPU_REUSE_ROWS: TunnelCpuRows = [
    &report::DIAL8_SERVER_US_REUSE,
    &report::DIAL8_AGENT_US_REUSE,
];

/// What one run of single-use dials measured, whoever's client made it.
struct DialFigures {
    rate: f64,
    p50_us: Option<f64>,
    p99_us: Option<f64>,
    errors: u64,
    first_error: Option<String>,
    cpu_us: Option<(f64, f64)>,
}

/// Records CPU per tunnel, (server, agent) in µs.
fn push_cpu(
    rec: &mut Recorder,
    rows: TunnelCpuRows,
    route: Route,
    rep: usize,
    cpu_us: Option<(f64, f64)>,
) {
    if let Some((server, agent)) = cpu_us {
        rec.push(rows[0], route, rep, Some(server));
        rec.push(rows[1], route, rep, Some(agent));
    }
}

/// N long-lived tunnels on one grpc-go connection (the reusable tunnel):
/// the time to open them and RSS per tunnel on both sides.
async fn streams_scenario(
    opt: &Opt,
    go: &grpc_go::GoFrontend,
    targets: &[Target],
    backends: &Backends,
    rec: &mut Recorder,
) -> anyhow::Result<()> {
    let Some(target) = targets.iter().find(|t| t.route == Route::Grpc) else {
        return Ok(());
    };
    eprintln!(
        "streams: {} tunnels on one grpc-go connection ...",
        opt.conns
    );
    let s = go
        .streams(target, backends, opt.conns)
        .await
        .context("streams scenario")?;
    eprintln!(
        "streams: opened in {:.1} s; {:.1} KiB server, {:.1} KiB agent per tunnel",
        s.open_s,
        s.per_stream.0 / 1024.0,
        s.per_stream.1 / 1024.0
    );
    for (def, value) in [
        (&report::STREAMS_OPEN, opt.conns as f64),
        (&report::STREAMS_OPEN_TIME, s.open_s),
        (&report::STREAMS_SERVER_KIB, s.per_stream.0 / 1024.0),
        (&report::STREAMS_AGENT_KIB, s.per_stream.1 / 1024.0),
    ] {
        rec.push(def, Route::Grpc, 0, Some(value));
    }
    Ok(())
}
