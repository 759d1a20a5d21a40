//! The budget scenario (issue 43, item 3): the release server's memory
//! under the floods the suite's `memory_budget` tests drive at a smaller
//! scale, with the default `--buffer-budget-bytes` (256 MiB). The frontend
//! is Python's grpcio (`tests/python/frontend.py`, from the virtualenv
//! `scripts/test` makes), as in the suite; uploads are stalled at their
//! agent, which is stopped (`SIGSTOP`) once its connections are open, so
//! that it returns no credit. Each part runs against a server and agents
//! of its own:
//! - tiny: behind a stalled upload, 1,000,000 empty DATA then 1,000,000
//!   1-byte DATA (`--budget-packets` each): jemalloc's allocated bytes grown
//!   once the server read them all or stopped reading the stream, and the
//!   1-byte packets it read;
//! - padded: 100 1-byte DATA each carrying a 4 MiB unknown field: the same
//!   growth;
//! - streams: `--budget-streams` (4,000) streams on `--budget-connections`
//!   (8) HTTP/2 connections, each uploading 2 MiB over a stopped agent, and
//!   20 echo round trips through another agent while the budget is full,
//!   on a new stream of a flooding connection and on a connection of its
//!   own: the server's peak RSS (`VmHWM`), what it holds beyond the whole
//!   budget (per stream too: its HTTP/2 window and state), the slowest
//!   round trip of each, and the time until the flood settled: every
//!   stalled connection cut under pressure (5 s after it stalled, its later
//!   DATA dropped) read to its end, the streams left (as many as the
//!   read-ahead's half holds without pressure) waiting for their
//!   destination.

use std::{
    net::{Ipv4Addr, SocketAddr},
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{Context, bail};
use integration_tests::{destination::Stall, python};

use crate::{
    backends::Backends,
    probe,
    report::{self, Recorder, Route},
    system::{self, Binaries, Process},
};

/// The server's default budget (`--buffer-budget-bytes`), half of which is
/// the read-ahead's.
const BUDGET: f64 = 256.0 * 1024.0 * 1024.0;
/// Bytes each stream of the streams part uploads.
const EACH: usize = 2 * 1024 * 1024;
/// Packets of the padded part.
const PADDED: u64 = 100;
/// Longest wait for a part to reach its state.
const LIMIT: Duration = Duration::from_secs(600);
/// How often `/metrics` is read while waiting.
const POLL: Duration = Duration::from_millis(100);

const ALLOCATED: &str = "konnectivity_rs_jemalloc_allocated_bytes";
const ESTABLISHED: &str = "konnectivity_network_proxy_server_established_connections";
const CONNECTED: &str = "konnectivity_network_proxy_server_ready_backend_connections";
const DATA_FROM_CLIENT: &str = "konnectivity_network_proxy_server_stream_packets_total{packet_type=\"DATA\",segment=\"from_client\"}";
const PROXY_BLOCKED: &str =
    "konnectivity_network_proxy_server_full_receive_channels{service_method=\"Proxy\"}";
const READ_AHEAD_HELD: &str =
    "konnectivity_rs_server_buffer_budget_held_bytes{pool=\"read_ahead\"}";
const READ_AHEAD_LIMIT: &str = "konnectivity_rs_server_buffer_budget_bytes{pool=\"read_ahead\"}";
const BUDGET_WAITS: &str = "konnectivity_rs_server_limit_reached_total{limit=\"buffer_budget\"}";

/// Flags of an agent whose window per connection is small (64 KiB, in
/// 16 KiB chunks): a stopped one holds little of a connection's upload.
const SMALL_WINDOW: [&str; 2] = [
    "--flow-control-window=65536",
    "--flow-control-max-chunk=16384",
];

/// What the budget scenario is asked for.
#[derive(Debug, Clone, Copy)]
pub struct BudgetOpt {
    /// Streams of the streams part (`--budget-streams`).
    pub streams: usize,
    /// The HTTP/2 connections they share (`--budget-connections`).
    pub connections: usize,
    /// Empty, and 1-byte, DATA packets of the tiny part
    /// (`--budget-packets`).
    pub packets: u64,
}

/// A server and its agents for one part, killed when dropped.
struct Part {
    /// The agents, the first of which is stopped.
    agents: Vec<Process>,
    /// The server.
    server: Process,
    /// Its health port (`/metrics`).
    health: SocketAddr,
    /// Its frontend socket.
    uds: PathBuf,
}

impl Part {
    /// A server with `extra` flags and one agent per entry of `agents`
    /// (its extra flags), all connected.
    async fn start(
        bins: &Binaries,
        dir: &Path,
        name: &str,
        extra: &[&str],
        agents: &[&[&str]],
    ) -> anyhow::Result<Self> {
        let (agent_port, health_port) = system::free_ports()?;
        let uds = dir.join(format!("budget-{name}.sock"));
        let mut args = [
            &bins.extra[..],
            &system::server_args(dir, "grpc", &uds, agent_port, health_port),
        ]
        .concat();
        args.extend(extra.iter().map(|s| (*s).to_owned()));
        let server = Process::spawn(
            format!("proxy-server (budget {name})"),
            &bins.server,
            &args,
            dir.join(format!("budget-{name}-server.log")),
        )?;
        let mut part = Self {
            agents: Vec::new(),
            server,
            health: SocketAddr::from(([127, 0, 0, 1], health_port)),
            uds,
        };
        for (i, flags) in agents.iter().enumerate() {
            let mut args = system::agent_args(dir, agent_port);
            args.extend(flags.iter().map(|s| (*s).to_owned()));
            part.agents.push(Process::spawn(
                format!("proxy-agent {i} (budget {name})"),
                &bins.agent,
                &args,
                dir.join(format!("budget-{name}-agent-{i}.log")),
            )?);
        }
        let connected = agents.len() as f64;
        part.wait("agents connected", |text| {
            value(text, CONNECTED) >= connected
        })
        .await?;
        Ok(part)
    }

    /// `/metrics`.
    async fn metrics(&mut self) -> anyhow::Result<String> {
        self.server.check_alive()?;
        Ok(probe::http_get(self.health, "/metrics").await?.1)
    }

    /// Polls `/metrics` until `ready` holds; the text then.
    async fn wait(&mut self, what: &str, ready: impl Fn(&str) -> bool) -> anyhow::Result<String> {
        let started = Instant::now();
        loop {
            if let Ok(text) = self.metrics().await
                && ready(&text)
            {
                return Ok(text);
            }
            if started.elapsed() > LIMIT {
                bail!("budget: not {what} after {LIMIT:?}");
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// Stops the first agent (SIGSTOP) and waits until it is stopped.
    async fn stop_agent(&self) -> anyhow::Result<()> {
        let pid = self.agents.first().context("an agent")?.pid();
        let status = std::process::Command::new("kill")
            .args(["-STOP", &pid.to_string()])
            .status()
            .context("running kill")?;
        if !status.success() {
            bail!("kill -STOP {pid} failed: {status}");
        }
        integration_tests::process::wait_stopped(pid).await;
        Ok(())
    }

    /// The server's peak resident memory (`VmHWM`), bytes.
    fn peak_rss(&self) -> u64 {
        integration_tests::process::peak_rss_bytes(self.server.pid())
    }
}

/// A series' value, 0 when it is not exposed.
fn value(text: &str, series: &str) -> f64 {
    probe::prometheus_value(text, series).unwrap_or(0.0)
}

/// Runs the three parts and records their rows; the notes.
///
/// # Errors
/// A process does not start or dies, the Python frontend is missing, or a
/// part does not reach its state within ten minutes.
pub async fn run(
    bins: &Binaries,
    dir: &Path,
    backends: &Backends,
    opt: &BudgetOpt,
    rec: &mut Recorder,
) -> anyhow::Result<Vec<String>> {
    let (grown, read) = flood(
        bins,
        dir,
        "tiny",
        &[
            format!("--empty={}", opt.packets),
            format!("--tiny={}", opt.packets),
        ],
        2 * opt.packets,
    )
    .await?;
    rec.push(&report::BUDGET_TINY_GROWN, Route::Grpc, 0, Some(grown));
    rec.push(&report::BUDGET_TINY_READ, Route::Grpc, 0, Some(read));
    let (grown, _) = flood(
        bins,
        dir,
        "padded",
        &[
            format!("--padded={PADDED}"),
            format!("--padding={}", (4 << 20) - 1024),
        ],
        PADDED,
    )
    .await?;
    rec.push(&report::BUDGET_PADDED_GROWN, Route::Grpc, 0, Some(grown));
    streams(bins, dir, backends, opt, rec).await?;
    Ok(vec![format!(
        "budget runs once, after the repetitions, each part against a server of its own with \
         the default --buffer-budget-bytes (256 MiB) and agents with a 64 KiB window, the \
         stalled one stopped (SIGSTOP) once its connections are open; frontend: Python's \
         grpcio (tests/python/frontend.py); tiny: {} empty then {} 1-byte DATA behind a \
         stalled upload; padded: {PADDED} 1-byte DATA each with a 4 MiB unknown field; growth \
         = jemalloc's allocated bytes once the server read them all or stopped reading, less \
         before; streams: {} x 2 MiB on {} HTTP/2 connections, peak = VmHWM, beyond = peak - \
         RSS before - the whole budget (per stream: / streams); round trips on a new stream \
         of a flooding connection and on a connection of its own",
        opt.packets, opt.packets, opt.streams, opt.connections
    )])
}

/// One stream floods a connection over a stopped agent: 256 KiB, then
/// `flags`' packets; (allocated bytes grown, MB; 1-byte DATA read) once the
/// server read all `packets` or stopped reading the stream.
async fn flood(
    bins: &Binaries,
    dir: &Path,
    name: &str,
    flags: &[String],
    packets: u64,
) -> anyhow::Result<(f64, f64)> {
    let mut part = Part::start(bins, dir, name, &[], &[&SMALL_WINDOW]).await?;
    let stall = Stall::start();
    let mut args = vec![
        "flood".to_owned(),
        format!("--target=unix:{}", part.uds.display()),
        format!("--address={}", stall.addr),
        "--upload-bytes=262144".to_owned(),
    ];
    args.extend_from_slice(flags);
    let mut frontend = python::start_frontend(args);
    part.wait("dialed", |text| value(text, ESTABLISHED) >= 1.0)
        .await?;
    part.stop_agent().await?;
    let before = value(&part.metrics().await?, ALLOCATED);
    let started = Instant::now();
    frontend.signal("go");
    let text = part
        .wait("done with the flood", |text| {
            value(text, DATA_FROM_CLIENT) >= (8 + packets) as f64
                || value(text, PROXY_BLOCKED) >= 1.0
        })
        .await?;
    let took = started.elapsed();
    let report = frontend.finish().await;
    if !report.ok() {
        bail!("budget {name}: the frontend failed: {report}");
    }
    let grown = (value(&text, ALLOCATED) - before) / 1e6;
    let tiny = report.json["sent"]["tiny"].as_f64().unwrap_or(0.0);
    eprintln!(
        "budget {name}: {} DATA read in {took:?}, allocated +{grown:.1} MB; {report}",
        value(&text, DATA_FROM_CLIENT)
    );
    Ok((grown, tiny))
}

/// The streams part's server (`--proxy-strategies=destHost`) and its two
/// agents: dials to 127.0.0.2 go to the one that will be stopped (with a
/// small window), dials to 127.0.0.1 (the echo backend) to the other.
async fn start_streams_part(bins: &Binaries, dir: &Path) -> anyhow::Result<Part> {
    Part::start(
        bins,
        dir,
        "streams",
        &["--proxy-strategies=destHost"],
        &[
            &[
                SMALL_WINDOW[0],
                SMALL_WINDOW[1],
                "--agent-identifiers=ipv4=127.0.0.2",
            ],
            &["--agent-identifiers=ipv4=127.0.0.1"],
        ],
    )
    .await
}

/// The streams part; see the module documentation.
async fn streams(
    bins: &Binaries,
    dir: &Path,
    backends: &Backends,
    opt: &BudgetOpt,
    rec: &mut Recorder,
) -> anyhow::Result<()> {
    let streams = opt.streams;
    let mut part = start_streams_part(bins, dir).await?;
    let stall = Stall::start_on(Ipv4Addr::new(127, 0, 0, 2));
    let before = probe::rss(part.server.pid())? as f64;
    let mut frontend = python::start_frontend([
        "streams".to_owned(),
        format!("--target=unix:{}", part.uds.display()),
        format!("--stalled-address={}", stall.addr),
        format!("--address={}", backends.echo.addr),
        format!("--streams={streams}"),
        format!("--connections={}", opt.connections),
        format!("--bytes={EACH}"),
        "--round-trips=20".to_owned(),
    ]);
    part.wait("dialed", |text| value(text, ESTABLISHED) >= streams as f64)
        .await?;
    part.stop_agent().await?;
    let started = Instant::now();
    frontend.signal("go");
    let all = (streams * EACH / (16 * 1024)) as f64;
    part.wait("flooded", |text| {
        value(text, BUDGET_WAITS) >= 1.0 || value(text, DATA_FROM_CLIENT) >= all
    })
    .await?;
    frontend.signal("trips");
    // Settled: the read-ahead's half no longer full (no more cuts to
    // come), every stream cut for its stall read to its end (its later
    // DATA dropped), every other one stopped. A stream that carries only
    // its stalled connection is cut only under pressure: once the streams
    // still open hold less than the read-ahead's half (each up to 1 MiB
    // and its agent's 64 KiB window of a 2 MiB upload), they wait, as a
    // TCP upload to a destination that stopped reading does.
    let per_stream = (EACH / (16 * 1024)) as f64;
    let settled = part
        .wait("settled after the flood", |text| {
            let open = value(text, ESTABLISHED);
            open == value(text, PROXY_BLOCKED)
                && value(text, READ_AHEAD_HELD) < value(text, READ_AHEAD_LIMIT)
                && value(text, DATA_FROM_CLIENT) >= (streams as f64 - open) * per_stream
        })
        .await?;
    let drained = started.elapsed();
    let left = value(&settled, ESTABLISHED);
    let peak = part.peak_rss() as f64;
    let report = frontend.finish().await;
    if !report.ok() {
        bail!("budget streams: the frontend failed: {report}");
    }
    let beyond = peak - before - BUDGET;
    let beyond_each = beyond / streams as f64 / 1024.0;
    eprintln!(
        "budget streams: {streams} x {EACH} bytes on {} connections; RSS {:.0} MB before, {:.0} MB \
         at its peak ({:.0} MB, {beyond_each:.1} KiB per stream, beyond the budget); settled \
         in {drained:?}, {left} streams left waiting for their destination; {report}",
        opt.connections,
        before / 1e6,
        peak / 1e6,
        beyond / 1e6,
    );
    let rows = [
        (&report::BUDGET_STREAMS_PEAK, Some(peak / 1e6)),
        (&report::BUDGET_STREAMS_BEYOND, Some(beyond / 1e6)),
        (&report::BUDGET_STREAMS_PER_STREAM, Some(beyond_each)),
        (&report::BUDGET_STREAMS_DRAINED, Some(drained.as_secs_f64())),
        (&report::BUDGET_STREAMS_LEFT, Some(left)),
    ];
    for (def, value) in rows {
        rec.push(def, Route::Grpc, 0, value);
    }
    push_round_trips(&report, rec);
    Ok(())
}

/// The streams part's round trips beside the flood, from the frontend's
/// report: how many, and the slowest, on each healthy connection.
fn push_round_trips(report: &python::FrontendReport, rec: &mut Recorder) {
    for (name, trips_def, slowest_def) in [
        (
            "same_connection",
            &report::BUDGET_STREAMS_TRIPS,
            &report::BUDGET_STREAMS_SLOWEST,
        ),
        (
            "own_connection",
            &report::BUDGET_STREAMS_TRIPS_OWN,
            &report::BUDGET_STREAMS_SLOWEST_OWN,
        ),
    ] {
        let trips = report.json[format!("round_trips_{name}")].as_f64();
        let slowest = report.json[format!("slowest_round_trip_{name}")].as_f64();
        rec.push(trips_def, Route::Grpc, 0, Some(trips.unwrap_or(0.0)));
        rec.push(slowest_def, Route::Grpc, 0, slowest.map(|s| s * 1e3));
    }
}
