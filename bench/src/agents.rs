//! The agents scenario: one proxy-server (gRPC mode, default admission
//! flags) and N real agents run by `agent-swarm` processes, each agent its
//! own TLS connection and `Connect` stream, as a cluster's DaemonSet has one
//! per node. Measures, in one run:
//! - the time until all N are connected after a cold start, and after the
//!   server is killed (SIGKILL) and started again on the same port, with the
//!   server's CPU per agent connection in each;
//! - the server's RSS per connected idle agent, and the swarm's;
//! - `/readyz` and `/metrics` latency with N agents;
//! - the single-use dial rate and p99 at 8 clients with 1 agent and with N;
//! - the time until all are back after every agent's link is cut (the
//!   swarm drops its connections on SIGUSR1) with the server kept, and the
//!   server's CPU per reconnect;
//! - how many of the reconnects resumed their TLS session (no signature);
//! - the same cold start, restart and dial rate with ANP-style agents (no
//!   flow-control negotiation, no TLS session cache, as grpc-go's).
//!
//! The PKI is its own, with keys of `--agents-key-algorithm` (RSA-2048 by
//! default, as kubeadm's: a full handshake then costs the server an RSA
//! signature).

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{Context, bail};
use client::dial::{Dialer, Mode, Transport};

use crate::{
    backends::Backends,
    probe,
    report::{self, Recorder, Route},
    scenarios::{self, Target},
    stats,
    system::{self, Binaries, Pids, Process},
};

/// Descriptors an agent holds while idle: its server connection, its health
/// and admin listeners.
const FDS_PER_AGENT: u64 = 3;
/// Descriptors a swarm process keeps for everything else (dials, logs).
const SWARM_SPARE_FDS: u64 = 1024;
/// Longest wait for all agents to connect.
const CONNECT_LIMIT: Duration = Duration::from_secs(120);
/// How often the server's gauge is read while agents connect.
const POLL: Duration = Duration::from_millis(50);
/// Health-endpoint requests timed per endpoint.
const HEALTH_SAMPLES: usize = 20;
/// Concurrency of the dial rows.
const DIAL_CLIENTS: usize = 8;
/// The server's count of connected agent streams.
const CONNECTED: &str = "konnectivity_network_proxy_server_ready_backend_connections";
/// The server's count of agent TLS handshakes, by kind.
const HANDSHAKES: &str = "konnectivity_rs_server_agent_tls_handshakes_total";

/// The audience of the agents' tokens.
const AUDIENCE: &str = "system:konnectivity-server";

/// Which agents a swarm runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Style {
    /// Ours: flow-control negotiation, a TLS session cache per agent.
    Ours,
    /// As ANP's grpc-go agents: neither.
    Anp,
    /// Ours, each with a service-account token of its own in this
    /// directory instead of a client certificate.
    Tokens(&'static str),
}
/// The server under test, restartable on the same ports.
struct Server {
    /// The running process, if any.
    process: Option<Process>,
    /// Its flags.
    args: Vec<String>,
    /// The binary.
    bin: PathBuf,
    /// Where logs go.
    dir: PathBuf,
    /// How many times it was started (log names).
    starts: usize,
    /// The health port (`/metrics`, `/readyz`).
    health: SocketAddr,
    /// The agent port.
    agent_port: u16,
    /// The frontend socket.
    uds: PathBuf,
}

impl Server {
    fn new(bins: &Binaries, dir: &Path, pki: &Path) -> anyhow::Result<Self> {
        Self::with_auth(bins, dir, pki, None)
    }

    /// A server authenticating agents with client certificates, or with
    /// service-account tokens reviewed by the API of `kubeconfig`.
    fn with_auth(
        bins: &Binaries,
        dir: &Path,
        pki: &Path,
        kubeconfig: Option<&Path>,
    ) -> anyhow::Result<Self> {
        let (agent_port, health_port) = system::free_ports()?;
        let uds = dir.join(format!("agents-{agent_port}.sock"));
        let mut args = [
            &bins.extra[..],
            &system::server_args(pki, "grpc", &uds, agent_port, health_port),
        ]
        .concat();
        if let Some(kubeconfig) = kubeconfig {
            args.retain(|arg| !arg.starts_with("--cluster-ca-cert="));
            args.extend([
                "--agent-namespace=kube-system".to_owned(),
                "--agent-service-account=konnectivity-agent".to_owned(),
                format!("--authentication-audience={AUDIENCE}"),
                format!("--kubeconfig={}", kubeconfig.display()),
            ]);
        }
        Ok(Self {
            process: None,
            args,
            bin: bins.server.clone(),
            dir: dir.to_owned(),
            starts: 0,
            health: SocketAddr::from(([127, 0, 0, 1], health_port)),
            agent_port,
            uds,
        })
    }

    /// Starts the process and waits until `/metrics` answers.
    async fn start(&mut self) -> anyhow::Result<()> {
        self.starts += 1;
        self.process = Some(Process::spawn(
            "proxy-server (agents scenario)".to_owned(),
            &self.bin,
            &self.args,
            self.dir.join(format!(
                "agents-server-{}-{}.log",
                self.agent_port, self.starts
            )),
        )?);
        let started = Instant::now();
        while probe::http_get(self.health, "/metrics").await.is_err() {
            self.check_alive()?;
            if started.elapsed() > CONNECT_LIMIT {
                bail!("proxy-server did not answer /metrics within {CONNECT_LIMIT:?}");
            }
            tokio::time::sleep(POLL).await;
        }
        Ok(())
    }

    /// SIGKILL, as a crashed or evicted control-plane Pod.
    fn kill(&mut self) {
        self.process = None;
    }

    fn pid(&self) -> anyhow::Result<u32> {
        self.process
            .as_ref()
            .map(Process::pid)
            .context("proxy-server is not running")
    }

    fn check_alive(&mut self) -> anyhow::Result<()> {
        match &mut self.process {
            Some(p) => p.check_alive(),
            None => bail!("proxy-server is not running"),
        }
    }

    /// Connected agent streams, from `/metrics`.
    async fn connected(&self) -> anyhow::Result<usize> {
        let (_, text) = probe::http_get(self.health, "/metrics").await?;
        Ok(probe::prometheus_value(&text, CONNECTED).unwrap_or(0.0) as usize)
    }

    /// Agent TLS handshakes of `kind` (`full`, `resumed`) so far.
    async fn handshakes(&self, kind: &str) -> anyhow::Result<f64> {
        let (_, text) = probe::http_get(self.health, "/metrics").await?;
        Ok(
            probe::prometheus_value(&text, &format!("{HANDSHAKES}{{kind=\"{kind}\"}}"))
                .unwrap_or(0.0),
        )
    }

    /// Waits until `n` agents are connected and `handshakes` more TLS
    /// handshakes than `before` are done; how long that took from `since`.
    async fn wait_reconnected(
        &mut self,
        n: usize,
        before: f64,
        since: Instant,
    ) -> anyhow::Result<Duration> {
        loop {
            self.check_alive()?;
            let done = self.handshakes("full").await? + self.handshakes("resumed").await? - before;
            if done >= n as f64 && self.connected().await? == n {
                return Ok(since.elapsed());
            }
            if since.elapsed() > CONNECT_LIMIT {
                bail!("{done} of {n} agents reconnected after {CONNECT_LIMIT:?}");
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// Waits until exactly `n` agents are connected; how long that took
    /// from `since`.
    async fn wait_connected(&mut self, n: usize, since: Instant) -> anyhow::Result<Duration> {
        loop {
            self.check_alive()?;
            let now = self.connected().await.unwrap_or(0);
            if now == n {
                return Ok(since.elapsed());
            }
            if since.elapsed() > CONNECT_LIMIT {
                bail!("{now} of {n} agents connected after {CONNECT_LIMIT:?}");
            }
            tokio::time::sleep(POLL).await;
        }
    }

    fn target(&self, swarm_pid: u32) -> anyhow::Result<Target> {
        Ok(Target {
            route: Route::Grpc,
            dialer: Some(Dialer {
                transport: Transport::Uds(self.uds.clone()),
                mode: Mode::Grpc,
            }),
            pids: Some(Pids {
                server: self.pid()?,
                agent: swarm_pid,
            }),
            health: Some(self.health),
        })
    }
}

/// `agent-swarm` processes running N agents between them.
struct Swarm {
    /// The processes.
    processes: Vec<Process>,
}

impl Swarm {
    /// Starts `n` agents of `style` with the certificates in `pki` against
    /// `server`, as few processes as the open-file limit allows.
    fn start(
        bins: &Binaries,
        (dir, pki): (&Path, &Path),
        server: &Server,
        (n, style): (usize, Style),
        nofile: u64,
    ) -> anyhow::Result<Self> {
        let ours = style != Style::Anp;
        let per = usize::try_from(nofile.saturating_sub(SWARM_SPARE_FDS) / FDS_PER_AGENT)
            .unwrap_or(usize::MAX)
            .max(1);
        let mut processes = Vec::new();
        let mut first = 0;
        while first < n {
            let agents = per.min(n - first);
            let args = [
                vec![
                    format!("--agents={agents}"),
                    format!("--first={first}"),
                    format!("--resumption={ours}"),
                ],
                match style {
                    Style::Tokens(tokens) => {
                        vec![format!("--token-dir={}", dir.join(tokens).display())]
                    }
                    _ => Vec::new(),
                },
                vec!["--".to_owned()],
                system::agent_args(pki, server.agent_port),
                vec![format!("--flow-control={ours}")],
            ]
            .concat();
            let args: Vec<String> = match style {
                // No client certificate: the token authenticates.
                Style::Tokens(_) => args
                    .into_iter()
                    .filter(|a| !a.starts_with("--agent-cert=") && !a.starts_with("--agent-key="))
                    .collect(),
                _ => args,
            };
            processes.push(Process::spawn(
                format!("agent-swarm --first={first}"),
                &bins.swarm,
                &args,
                dir.join(format!("swarm-{first}.log")),
            )?);
            first += agents;
        }
        Ok(Self { processes })
    }

    fn check_alive(&mut self) -> anyhow::Result<()> {
        self.processes.iter_mut().try_for_each(Process::check_alive)
    }

    /// Cuts every agent's server connection (SIGUSR1): each reconnects as
    /// after a lost link.
    fn cut(&self) -> anyhow::Result<()> {
        for process in &self.processes {
            let status = std::process::Command::new("kill")
                .args(["-USR1", &process.pid().to_string()])
                .status()
                .context("running kill")?;
            if !status.success() {
                bail!("kill -USR1 {} failed: {status}", process.pid());
            }
        }
        Ok(())
    }

    /// CPU time of all swarm processes so far, clock ticks.
    fn cpu_ticks(&self) -> anyhow::Result<u64> {
        self.processes
            .iter()
            .map(|p| probe::cpu_ticks(p.pid()))
            .sum()
    }

    /// RSS of all swarm processes, bytes.
    fn rss(&self) -> anyhow::Result<u64> {
        self.processes.iter().map(|p| probe::rss(p.pid())).sum()
    }

    fn first_pid(&self) -> u32 {
        self.processes.first().map_or(0, Process::pid)
    }
}

/// RSS of `pid` once freed memory has gone back (see
/// [`scenarios::settled_rss`]).
async fn settled(rss: impl Fn() -> anyhow::Result<u64>) -> anyhow::Result<u64> {
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut least = u64::MAX;
    for _ in 0..4 {
        least = least.min(rss()?);
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    Ok(least)
}

/// The slowest of [`HEALTH_SAMPLES`] GETs of `path`, ms.
async fn slowest_get(addr: SocketAddr, path: &str) -> anyhow::Result<f64> {
    let mut slowest = Duration::ZERO;
    for _ in 0..HEALTH_SAMPLES {
        let began = Instant::now();
        let (status, _) = probe::http_get(addr, path).await?;
        if status != 200 {
            bail!("GET {path} answered {status}");
        }
        slowest = slowest.max(began.elapsed());
    }
    Ok(slowest.as_secs_f64() * 1e3)
}

/// One dial row: rate and p99 (µs) at [`DIAL_CLIENTS`]; errors.
async fn dial_row(
    target: &Target,
    backends: &Backends,
    duration: Duration,
    what: &str,
) -> anyhow::Result<(f64, f64, u64)> {
    let pids = target.pids.context("a tunneled target")?;
    let before = (
        probe::cpu_ticks(pids.server)?,
        probe::cpu_ticks(pids.agent)?,
    );
    let d = scenarios::dial_rate(target, backends, DIAL_CLIENTS, duration).await?;
    let after = (
        probe::cpu_ticks(pids.server)?,
        probe::cpu_ticks(pids.agent)?,
    );
    let dials = d.latency.len().max(1) as f64;
    let p99 = stats::quantile_us(&d.latency, 0.99);
    eprintln!(
        "agents: dial c={DIAL_CLIENTS} with {what}: {:.0} dials/s, p99 {p99:.0} us, \
         CPU per dial: server {:.0} us, agents {:.0} us; {} errors{}",
        d.rate,
        ticks_ms(after.0 - before.0) * 1e3 / dials,
        ticks_ms(after.1 - before.1) * 1e3 / dials,
        d.errors,
        d.first_error
            .as_deref()
            .map(|e| format!(" (first: {e})"))
            .unwrap_or_default()
    );
    Ok((d.rate, p99, d.errors))
}

/// What the agents scenario is asked for.
#[derive(Debug, Clone, Copy)]
pub struct AgentsOpt {
    /// Agents (`--agents`).
    pub n: usize,
    /// Measured time of each dial row.
    pub duration: Duration,
    /// The open-file limit, which sets how many agents a swarm process
    /// runs.
    pub nofile: u64,
    /// Keys of the scenario's PKI (`--agents-key-algorithm`).
    pub algorithm: certs::KeyAlgorithm,
    /// How long the TokenReview stand-in takes to answer each review
    /// (`--agents-review-latency`).
    pub review_latency: Duration,
}

/// Runs the scenario with `opt.n` agents and records its rows.
///
/// # Errors
/// A process does not start or dies, or the agents do not all connect
/// within two minutes.
pub async fn run(
    bins: &Binaries,
    dir: &Path,
    backends: &Backends,
    opt: &AgentsOpt,
    rec: &mut Recorder,
) -> anyhow::Result<()> {
    let AgentsOpt {
        n,
        duration,
        nofile,
        algorithm,
        review_latency,
    } = *opt;
    let pki = dir.join("agents-pki");
    certs::ClusterPki::generate_with(&[], algorithm)
        .context("generating the agents scenario's certificates")?
        .write_to(&pki)
        .context("writing the agents scenario's certificates")?;
    let setup = Setup {
        bins,
        paths: (dir, pki.as_path()),
        backends,
        n,
        duration,
        nofile,
    };
    let mut server = Server::new(bins, dir, &pki)?;
    server.start().await?;
    let server_idle = settled(|| probe::rss(server.pid()?)).await?;
    let (one, swarm_one) = setup.one_agent(&mut server).await?;
    let many = setup
        .ours(&mut server, (server_idle, swarm_one), one, rec)
        .await?;
    let errors_anp = setup.anp(&mut server, rec).await?;
    drop(server);
    token_storms(bins, setup.paths, n, nofile, review_latency, rec).await?;
    rec.push(
        &report::AGENTS_DIAL_ERRORS,
        Route::Grpc,
        0,
        Some((one.2 + many.2 + errors_anp) as f64),
    );
    Ok(())
}

/// A dial row: rate, p99 (µs), errors.
type DialRow = (f64, f64, u64);

/// What every part of the scenario runs with.
struct Setup<'a> {
    /// The binaries.
    bins: &'a Binaries,
    /// Files and logs, and the certificates.
    paths: (&'a Path, &'a Path),
    /// The node-side servers the dial rows reach.
    backends: &'a Backends,
    /// Agents.
    n: usize,
    /// Measured time of each dial row.
    duration: Duration,
    /// The open-file limit, which sets how many agents a swarm process
    /// runs.
    nofile: u64,
}

impl Setup<'_> {
    /// One agent: the dial row to compare with, and the swarm's own size
    /// (RSS).
    async fn one_agent(&self, server: &mut Server) -> anyhow::Result<(DialRow, u64)> {
        let mut swarm = Swarm::start(self.bins, self.paths, server, (1, Style::Ours), self.nofile)?;
        server.wait_connected(1, Instant::now()).await?;
        let one = dial_row(
            &server.target(swarm.first_pid())?,
            self.backends,
            self.duration,
            "1 agent",
        )
        .await?;
        swarm.check_alive()?;
        let swarm_one = settled(|| swarm.rss()).await?;
        drop(swarm);
        server.wait_connected(0, Instant::now()).await?;
        Ok((one, swarm_one))
    }

    /// N of our agents: the cold start, memory and health rows, the dial
    /// row (against `one`'s), a restart storm and a cut storm; the dial
    /// row.
    async fn ours(
        &self,
        server: &mut Server,
        (server_idle, swarm_one): (u64, u64),
        one: DialRow,
        rec: &mut Recorder,
    ) -> anyhow::Result<DialRow> {
        let n = self.n;
        // Cold start: N agents at once.
        let cpu = probe::cpu_ticks(server.pid()?)?;
        let began = Instant::now();
        let mut swarm = Swarm::start(self.bins, self.paths, server, (n, Style::Ours), self.nofile)?;
        let cold = server.wait_connected(n, began).await?;
        let cold_cpu = probe::cpu_ticks(server.pid()?)? - cpu;
        swarm.check_alive()?;
        eprintln!(
            "agents: {n} connected {:.2} s after a cold start; server CPU {:.2} ms per agent",
            cold.as_secs_f64(),
            ticks_ms(cold_cpu) / n as f64
        );
        rec.push(
            &report::AGENTS_COLD,
            Route::Grpc,
            0,
            Some(cold.as_secs_f64()),
        );
        let per_agent = ticks_ms(cold_cpu) / n as f64;
        rec.push(&report::AGENTS_CPU_COLD, Route::Grpc, 0, Some(per_agent));

        memory_rows(server, &swarm, (server_idle, swarm_one), n, rec).await?;
        let many = dial_row(
            &server.target(swarm.first_pid())?,
            self.backends,
            self.duration,
            &format!("{n} agents"),
        )
        .await?;
        dial_rows(one, many, rec);

        restart_storm(server, &mut swarm, n).await?.push(
            rec,
            (
                &report::AGENTS_RESTART,
                &report::AGENTS_CPU_RESTART,
                &report::AGENTS_SWARM_CPU_RESTART,
            ),
            Some(&report::AGENTS_RESUMED),
        );
        cut_storm(server, &mut swarm, n).await?.push(
            rec,
            (
                &report::AGENTS_CUT,
                &report::AGENTS_CPU_CUT,
                &report::AGENTS_SWARM_CPU_CUT,
            ),
            Some(&report::AGENTS_CUT_RESUMED),
        );
        drop(swarm);
        server.wait_connected(0, Instant::now()).await?;
        Ok(many)
    }

    /// N ANP-style agents (no flow-control negotiation, no session cache):
    /// the cold start, the dial row, a restart storm; the dial errors.
    async fn anp(&self, server: &mut Server, rec: &mut Recorder) -> anyhow::Result<u64> {
        let n = self.n;
        let began = Instant::now();
        let mut swarm = Swarm::start(self.bins, self.paths, server, (n, Style::Anp), self.nofile)?;
        let anp_cold = server.wait_connected(n, began).await?;
        eprintln!(
            "agents: {n} ANP-style agents connected {:.2} s after a cold start",
            anp_cold.as_secs_f64()
        );
        let (rate_anp, p99_anp, errors_anp) = dial_row(
            &server.target(swarm.first_pid())?,
            self.backends,
            self.duration,
            &format!("{n} ANP-style agents"),
        )
        .await?;
        let push = |rec: &mut Recorder, def: &report::Def, value: f64| {
            rec.push(def, Route::Grpc, 0, Some(value));
        };
        push(rec, &report::AGENTS_ANP_COLD, anp_cold.as_secs_f64());
        push(rec, &report::AGENTS_ANP_DIAL_RATE, rate_anp);
        push(rec, &report::AGENTS_ANP_DIAL_P99, p99_anp);
        restart_storm(server, &mut swarm, n).await?.push(
            rec,
            (
                &report::AGENTS_ANP_RESTART,
                &report::AGENTS_ANP_CPU_RESTART,
                &report::AGENTS_ANP_SWARM_CPU_RESTART,
            ),
            None,
        );
        drop(swarm);
        Ok(errors_anp)
    }
}

/// The server's and the swarm's RSS per connected idle agent, and the
/// health endpoints' latency with N agents.
async fn memory_rows(
    server: &Server,
    swarm: &Swarm,
    (server_idle, swarm_one): (u64, u64),
    n: usize,
    rec: &mut Recorder,
) -> anyhow::Result<()> {
    let server_rss = settled(|| probe::rss(server.pid()?)).await?;
    let swarm_rss = settled(|| swarm.rss()).await?;
    let per_server = server_rss.saturating_sub(server_idle) as f64 / n as f64 / 1024.0;
    let per_swarm = swarm_rss.saturating_sub(swarm_one) as f64 / (n.max(2) - 1) as f64 / 1024.0;
    eprintln!(
        "agents: server RSS {:.1} MiB idle, {:.1} MiB with {n}: {per_server:.1} KiB per agent; \
         swarm {per_swarm:.1} KiB per agent",
        mib(server_idle),
        mib(server_rss)
    );
    rec.push(&report::AGENTS_RSS_SERVER, Route::Grpc, 0, Some(per_server));
    rec.push(&report::AGENTS_RSS_SWARM, Route::Grpc, 0, Some(per_swarm));
    let readyz = slowest_get(server.health, "/readyz").await?;
    let metrics = slowest_get(server.health, "/metrics").await?;
    eprintln!(
        "agents: slowest of {HEALTH_SAMPLES}: /readyz {readyz:.1} ms, /metrics {metrics:.1} ms"
    );
    rec.push(&report::AGENTS_READYZ, Route::Grpc, 0, Some(readyz));
    rec.push(&report::AGENTS_METRICS, Route::Grpc, 0, Some(metrics));
    Ok(())
}

/// The dial rows with 1 agent and with N, and their ratios.
fn dial_rows(one: (f64, f64, u64), many: (f64, f64, u64), rec: &mut Recorder) {
    for (def, value) in [
        (&report::AGENTS_DIAL1_RATE, one.0),
        (&report::AGENTS_DIAL1_P99, one.1),
        (&report::AGENTS_DIALN_RATE, many.0),
        (&report::AGENTS_DIALN_P99, many.1),
        (&report::AGENTS_DIAL_RATIO, many.0 / one.0),
        (&report::AGENTS_DIAL_P99_RATIO, many.1 / one.1),
    ] {
        rec.push(def, Route::Grpc, 0, Some(value));
    }
}

/// What one storm of `n` reconnects took.
struct Storm {
    /// Until all were connected again.
    took: Duration,
    /// The server's CPU per agent meanwhile, ms.
    cpu_ms: f64,
    /// The swarm's CPU per agent meanwhile, ms.
    swarm_ms: f64,
    /// Handshakes that resumed a TLS session.
    resumed: f64,
}

impl Storm {
    /// Its time, each side's CPU per agent, and how busy the machine's
    /// cores were: server and swarm together over the storm's time, as a
    /// share of every core (near 100 %, the storm was bound by CPU).
    fn describe(&self, n: usize) -> String {
        let secs = self.took.as_secs_f64();
        let cores = std::thread::available_parallelism().map_or(1, usize::from) as f64;
        let busy = (self.cpu_ms + self.swarm_ms) * n as f64 / 1000.0 / secs / cores;
        format!(
            "{secs:.2} s; CPU per agent: server {:.2} ms, swarm {:.2} ms; cores {:.0} % busy; \
             {} resumed",
            self.cpu_ms,
            self.swarm_ms,
            busy * 100.0,
            self.resumed
        )
    }

    /// Records the storm's time, CPU per agent and, when given, its
    /// resumed handshakes.
    fn push(
        &self,
        rec: &mut Recorder,
        (took, cpu, swarm): (&report::Def, &report::Def, &report::Def),
        resumed: Option<&report::Def>,
    ) {
        rec.push(took, Route::Grpc, 0, Some(self.took.as_secs_f64()));
        rec.push(cpu, Route::Grpc, 0, Some(self.cpu_ms));
        rec.push(swarm, Route::Grpc, 0, Some(self.swarm_ms));
        if let Some(def) = resumed {
            rec.push(def, Route::Grpc, 0, Some(self.resumed));
        }
    }
}

/// SIGKILL, then the same ports again: until all `n` agents are back.
async fn restart_storm(server: &mut Server, swarm: &mut Swarm, n: usize) -> anyhow::Result<Storm> {
    let swarm_cpu = swarm.cpu_ticks()?;
    server.kill();
    let began = Instant::now();
    server.start().await?;
    let took = server.wait_connected(n, began).await?;
    // A fresh process: all its CPU is the storm's.
    let cpu_ms = ticks_ms(probe::cpu_ticks(server.pid()?)?) / n as f64;
    let swarm_ms = ticks_ms(swarm.cpu_ticks()? - swarm_cpu) / n as f64;
    let resumed = server.handshakes("resumed").await?;
    swarm.check_alive()?;
    let storm = Storm {
        took,
        cpu_ms,
        swarm_ms,
        resumed,
    };
    eprintln!(
        "agents: {n} back after a server restart: {}",
        storm.describe(n)
    );
    Ok(storm)
}

/// Every agent's link cut, the server kept: until all `n` are back.
async fn cut_storm(server: &mut Server, swarm: &mut Swarm, n: usize) -> anyhow::Result<Storm> {
    let resumed = server.handshakes("resumed").await?;
    let before = server.handshakes("full").await? + resumed;
    let (cpu, swarm_cpu) = (probe::cpu_ticks(server.pid()?)?, swarm.cpu_ticks()?);
    let began = Instant::now();
    swarm.cut()?;
    let took = server.wait_reconnected(n, before, began).await?;
    let cpu_ms = ticks_ms(probe::cpu_ticks(server.pid()?)? - cpu) / n as f64;
    let swarm_ms = ticks_ms(swarm.cpu_ticks()? - swarm_cpu) / n as f64;
    let resumed = server.handshakes("resumed").await? - resumed;
    swarm.check_alive()?;
    let storm = Storm {
        took,
        cpu_ms,
        swarm_ms,
        resumed,
    };
    eprintln!(
        "agents: {n} back after their links were cut: {}",
        storm.describe(n)
    );
    Ok(storm)
}

/// Service-account token auth against a TokenReview stand-in that answers
/// after `latency` (each agent its own token): TokenReviews and time for a
/// cold start, for every link cut with the server kept (answered from the
/// cache), and for a server restart (the cache is gone: one review per
/// agent, at most `--token-review-max-inflight` at once).
async fn token_storms(
    bins: &Binaries,
    (dir, pki): (&Path, &Path),
    n: usize,
    nofile: u64,
    latency: Duration,
    rec: &mut Recorder,
) -> anyhow::Result<()> {
    const TOKENS: &str = "agent-tokens";
    let stub = integration_tests::kube_stub::TokenReviewStub::start().await;
    stub.set_delay(latency);
    let tokens = dir.join(TOKENS);
    std::fs::create_dir_all(&tokens).context("creating the token directory")?;
    for k in 0..n {
        let token = integration_tests::kube_stub::service_account_token(
            AUDIENCE,
            &format!("bench-agent-token-{k}"),
        );
        std::fs::write(tokens.join(format!("token-{k}")), &token).context("writing a token")?;
        stub.allow(
            &token,
            integration_tests::kube_stub::Identity {
                username: "system:serviceaccount:kube-system:konnectivity-agent".to_owned(),
                audiences: vec![AUDIENCE.to_owned()],
                node: None,
            },
        );
    }
    let mut server = Server::with_auth(bins, dir, pki, Some(&stub.kubeconfig))?;
    server.start().await?;
    let push = |rec: &mut Recorder, def: &report::Def, value: f64| {
        rec.push(def, Route::Grpc, 0, Some(value));
    };

    let began = Instant::now();
    let mut swarm = Swarm::start(
        bins,
        (dir, pki),
        &server,
        (n, Style::Tokens(TOKENS)),
        nofile,
    )?;
    let cold = server.wait_connected(n, began).await?;
    let cold_reviews = stub.review_count();
    push(rec, &report::AGENTS_TOKEN_COLD, cold.as_secs_f64());
    push(rec, &report::AGENTS_TOKEN_COLD_REVIEWS, cold_reviews as f64);

    let cut = cut_storm(&mut server, &mut swarm, n).await?.took;
    let cut_reviews = stub.review_count() - cold_reviews;
    push(rec, &report::AGENTS_TOKEN_CUT, cut.as_secs_f64());
    push(rec, &report::AGENTS_TOKEN_CUT_REVIEWS, cut_reviews as f64);

    let restart = restart_storm(&mut server, &mut swarm, n).await?.took;
    let restart_reviews = stub.review_count() - cold_reviews - cut_reviews;
    push(rec, &report::AGENTS_TOKEN_RESTART, restart.as_secs_f64());
    push(
        rec,
        &report::AGENTS_TOKEN_RESTART_REVIEWS,
        restart_reviews as f64,
    );
    push(
        rec,
        &report::AGENTS_TOKEN_IN_FLIGHT,
        stub.most_in_flight() as f64,
    );
    eprintln!(
        "agents: tokens ({latency:?} per review): {n} connected {:.2} s cold ({cold_reviews} \
         reviews), back {:.2} s after links cut ({cut_reviews} reviews), {:.2} s after a restart \
         ({restart_reviews} reviews); at most {} reviews in flight",
        cold.as_secs_f64(),
        cut.as_secs_f64(),
        restart.as_secs_f64(),
        stub.most_in_flight()
    );
    Ok(())
}

/// Clock ticks (100 per second) as milliseconds.
fn ticks_ms(ticks: u64) -> f64 {
    ticks as f64 * 10.0
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}
