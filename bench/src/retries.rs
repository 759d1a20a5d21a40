//! The retries scenario (issue 38): kube-apiserver's client library
//! (`tests/go/frontend`'s `rate` mode: single-use tunnels started at
//! `--retries-rate` whatever becomes of the ones before, each a new grpc-go
//! connection exchanging 1 KiB with an echo destination) through one
//! proxy-server and three proxy-agents under `default`, each run on a fresh
//! server:
//! - **kill**: `--retries-kills` times, one agent (in turn) stops answering
//!   (SIGSTOP) for [`HANG`], as a node that is going down does, so that
//!   dials wait on it; then it is killed (SIGKILL) and started again. Once
//!   with `--backend-dial-retries=1` (the default), once with `0` (ANP's
//!   behaviour). The dials that waited on the dead agent are those started
//!   at least [`WAITED`] before a kill and answered (or failed) after it;
//!   for them, the time from the kill to their DIAL_RSP is what a retry
//!   costs. Then the same without the hang: a plain `kill -9` of an agent
//!   that was serving.
//! - **slow**: the third agent runs in a network namespace joined to this
//!   one by a veth pair, where nftables drops the first SYN of each of its
//!   connections to the destination: its dials take a second (Linux's
//!   initial RTO), the others' a millisecond. There is no netem on this
//!   kernel (`CONFIG_NET_SCH_NETEM` is not set), so a delay of every packet
//!   cannot be had. `--retries-duration` each with all agents healthy,
//!   slowed with hedging off, and slowed with hedging on
//!   (`--backend-dial-hedge`, its default delay `p95`), in alternating
//!   rounds of 5 s.
//! - **p2c**: one agent holding 100 long-lived tunnels, two holding none;
//!   300 new tunnels, 4 at a time: the share the two idle agents get, by
//!   the agents' own dial counts.
//! - **hung** (issue 43): one agent of three stopped (SIGSTOP) for the
//!   whole part, its connection up, as a hung node's is, under
//!   `--backend-dial-timeout=3s`: the frontend's `dials` mode one at a
//!   time for [`HUNG_SERIAL`], then 8 at a time for [`HUNG_PARALLEL`]. Every
//!   dial the hung agent is sent times out (a timeout is not retried), so
//!   the frontend's failed dials are the hung agent's share.
//!
//! Needs root (`ip netns`, `nft`); the namespace is removed at the end.

use std::{
    net::{Ipv4Addr, SocketAddr},
    path::{Path, PathBuf},
    process::Stdio,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use anyhow::{Context, bail};
use integration_tests::process::metric_value;
use serde::Deserialize;
use tokio::{
    io::{AsyncBufReadExt, AsyncWriteExt, BufReader},
    net::TcpListener,
    process::Command,
    task::JoinHandle,
};

use crate::{
    grpc_go::GoFrontend,
    probe,
    report::{self, Recorder, Route},
    system::{self, Binaries, Process, path_with_sbin, tool},
};

/// How long a tunnel may take before it counts as hung (issue 50): far
/// past a dial, a retry and a 1 KiB exchange; a tunnel still open then
/// would have waited for ever, and fails the scenario.
pub const HUNG_AFTER: Duration = Duration::from_secs(15);
/// The frontend's text for a tunnel still open at its `-limit`.
const OVER_LIMIT: &str = "not done within -limit";

/// How long an agent stops answering before it is killed.
pub const HANG: Duration = Duration::from_millis(300);
/// How long before a kill a dial must have started to count as one that
/// waited on the killed agent: far longer than a healthy dial here (a few
/// ms), so that dials in flight on the other agents are not counted.
pub const WAITED: Duration = Duration::from_millis(50);
/// One kill every this long.
const ROUND: Duration = Duration::from_secs(2);
/// Traffic before the first kill.
const LEAD: Duration = Duration::from_secs(1);
/// The connected-agents gauge.
const CONNECTED: &str = "konnectivity_network_proxy_server_ready_backend_connections";
/// The slow runs alternate in rounds of this long each.
const SLOW_ROUND: Duration = Duration::from_secs(5);
/// The nftables table of the slow node's rule.
const TABLE: &str = "krsretries";

/// What the scenario is given.
#[derive(Debug, Clone)]
pub struct RetriesOpt {
    /// Tunnels started per second.
    pub rate: u32,
    /// Traffic of each slow run.
    pub duration: Duration,
    /// Kills of each kill run.
    pub kills: usize,
    /// Rounds of the rounds part, in each mode.
    pub rounds: usize,
    /// The grpc-go frontend.
    pub go: GoFrontend,
}

/// An error unless this process may make network namespaces.
///
/// # Errors
/// Not root, or `nft` is missing.
pub fn check() -> anyhow::Result<()> {
    let uid = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .and_then(|l| l.split_whitespace().next().map(str::to_owned))
        });
    if uid.as_deref() != Some("0") {
        bail!("--scenarios retries needs root (a network namespace, nftables)");
    }
    tool("nft", &["--version"])
        .map(drop)
        .context("--scenarios retries needs nftables (`nft`)")
}

/// Sends signal `name` to `pid`.
fn signal(pid: u32, name: &str) -> anyhow::Result<()> {
    tool("kill", &[&format!("-{name}"), &pid.to_string()]).map(drop)
}

/// Now, in µs since the epoch (the frontend's clock for its lines).
fn now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
}

/// The slow agent's node: a namespace joined to this one by a veth pair;
/// removed on drop.
struct Node {
    /// The namespace.
    name: String,
    /// The veth end in this namespace.
    host_if: String,
    /// Its address: the server's agent port and the destination are there.
    host_ip: Ipv4Addr,
}

impl Node {
    /// Creates it, with names and a /30 of 10.253.0.0/16 taken from this
    /// process's id; an error if that /30 is routed here already.
    fn create() -> anyhow::Result<Self> {
        let pid = std::process::id();
        let (a, b) = (((pid >> 6) & 0xff) as u8, ((pid & 0x3f) << 2) as u8);
        let subnet = format!("10.253.{a}.{b}/30");
        let routes = tool("ip", &["-4", "route", "show", "match", &subnet])?;
        if routes.lines().any(|route| !route.starts_with("default")) {
            bail!("{subnet} is routed here already: another namespace uses it");
        }
        let node = Self {
            name: format!("kretries{pid}"),
            host_if: format!("krh{pid}"),
            host_ip: Ipv4Addr::new(10, 253, a, b + 1),
        };
        let node_if = format!("krn{pid}");
        let node_ip = Ipv4Addr::new(10, 253, a, b + 2);
        tool("ip", &["netns", "add", &node.name])?;
        tool(
            "ip",
            &[
                "link",
                "add",
                &node.host_if,
                "type",
                "veth",
                "peer",
                "name",
                &node_if,
            ],
        )?;
        tool("ip", &["link", "set", &node_if, "netns", &node.name])?;
        let host_cidr = format!("{}/30", node.host_ip);
        tool("ip", &["addr", "add", &host_cidr, "dev", &node.host_if])?;
        tool("ip", &["link", "set", &node.host_if, "up"])?;
        let node_cidr = format!("{node_ip}/30");
        for args in [
            &["addr", "add", &node_cidr, "dev", &node_if][..],
            &["link", "set", &node_if, "up"],
            &["link", "set", "lo", "up"],
        ] {
            tool("ip", &[&["-n", &node.name][..], args].concat())?;
        }
        Ok(node)
    }

    /// Drops the first SYN of each connection to `dest` from the node (and
    /// counts it): its dials take a second.
    fn slow_dials_to(&self, dest: SocketAddr) -> anyhow::Result<()> {
        let rule = |tail: &str| {
            format!(
                "ip daddr {} tcp dport {} tcp flags & (syn | ack) == syn {tail}",
                dest.ip(),
                dest.port()
            )
        };
        let ruleset = format!(
            "table ip {TABLE} {{
                counter dropped {{}}
                set seen {{ type ipv4_addr . inet_service; flags dynamic, timeout; timeout 5s; }}
                chain output {{
                    type filter hook output priority 0; policy accept;
                    {}
                    {}
                }}
            }}",
            rule("ip saddr . tcp sport @seen accept"),
            rule("add @seen { ip saddr . tcp sport } counter name dropped drop"),
        );
        let mut child = std::process::Command::new("ip")
            .args(["netns", "exec", &self.name, "nft", "-f", "-"])
            .env("PATH", path_with_sbin())
            .stdin(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .context("running nft")?;
        std::io::Write::write_all(
            &mut child.stdin.take().context("nft's stdin")?,
            ruleset.as_bytes(),
        )
        .context("writing the ruleset to nft")?;
        let out = child.wait_with_output().context("waiting for nft")?;
        if !out.status.success() {
            bail!("nft -f: {}", String::from_utf8_lossy(&out.stderr).trim());
        }
        Ok(())
    }

    /// Removes the rule.
    fn heal(&self) -> anyhow::Result<()> {
        tool(
            "ip",
            &[
                "netns", "exec", &self.name, "nft", "delete", "table", "ip", TABLE,
            ],
        )
        .map(drop)
    }

    /// SYNs the rule dropped so far.
    fn dropped(&self) -> anyhow::Result<u64> {
        let text = tool(
            "ip",
            &[
                "netns", "exec", &self.name, "nft", "list", "counter", "ip", TABLE, "dropped",
            ],
        )?;
        text.split_whitespace()
            .skip_while(|w| *w != "packets")
            .nth(1)
            .and_then(|n| n.parse().ok())
            .with_context(|| format!("no packet count in {text:?}"))
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        // Deleting the namespace deletes its veth end, and so the pair.
        let _ = tool("ip", &["netns", "del", &self.name]);
        let _ = tool("ip", &["link", "del", &self.host_if]);
    }
}

/// An echo destination on `ip`; stopped on drop.
struct Echo {
    addr: SocketAddr,
    task: JoinHandle<()>,
}

impl Echo {
    async fn start(ip: Ipv4Addr) -> anyhow::Result<Self> {
        let listener = TcpListener::bind((ip, 0))
            .await
            .with_context(|| format!("binding an echo destination on {ip}"))?;
        let addr = listener.local_addr()?;
        let task = tokio::spawn(async move {
            let mut conns = tokio::task::JoinSet::new();
            loop {
                let Ok((mut stream, _)) = listener.accept().await else {
                    continue;
                };
                conns.spawn(async move {
                    let (mut r, mut w) = stream.split();
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                });
                while conns.try_join_next().is_some() {}
            }
        });
        Ok(Self { addr, task })
    }
}

impl Drop for Echo {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// One agent of a [`Rig`], restartable.
struct Agent {
    /// The process.
    process: Process,
    /// What runs it: program and arguments.
    argv: (PathBuf, Vec<String>),
    /// Its health port (`/metrics`), on loopback (none in the node).
    health: Option<SocketAddr>,
    /// Its name, for its logs.
    name: String,
    /// How many times it was started.
    starts: usize,
}

/// A server and its agents, killed on drop.
struct Rig {
    server: Process,
    health: SocketAddr,
    uds: PathBuf,
    agent_port: u16,
    agents: Vec<Agent>,
    /// The certificates and logs.
    dir: PathBuf,
    /// The agent listener's address.
    host_ip: Ipv4Addr,
    label: String,
}

impl Rig {
    /// A server with `flags`, its agent port on `host_ip`, no agent yet.
    async fn server(
        bins: &Binaries,
        dir: &Path,
        host_ip: Ipv4Addr,
        label: &str,
        flags: &[String],
    ) -> anyhow::Result<Self> {
        Self::server_in(bins, dir, host_ip, (label, "grpc"), flags).await
    }

    /// [`Rig::server`] in `mode` (`grpc`, `http-connect`).
    async fn server_in(
        bins: &Binaries,
        dir: &Path,
        host_ip: Ipv4Addr,
        (label, mode): (&str, &str),
        flags: &[String],
    ) -> anyhow::Result<Self> {
        let (agent_port, health_port) = system::free_ports()?;
        let uds = dir.join(format!("retries-{label}.sock"));
        let args = [
            &bins.extra[..],
            &system::server_args(dir, mode, &uds, agent_port, health_port),
            &[format!("--agent-bind-address={host_ip}")],
            flags,
        ]
        .concat();
        let server = Process::spawn(
            format!("proxy-server ({label})"),
            &bins.server,
            &args,
            dir.join(format!("retries-{label}-server.log")),
        )?;
        let mut server = server;
        let health = SocketAddr::from(([127, 0, 0, 1], health_port));
        let started = Instant::now();
        while probe::http_get(health, "/metrics").await.is_err() {
            server.check_alive()?;
            if started.elapsed() > Duration::from_secs(30) {
                bail!("proxy-server ({label}) did not answer /metrics within 30 s");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(Self {
            server,
            health,
            uds,
            agent_port,
            agents: Vec::new(),
            dir: dir.to_owned(),
            host_ip,
            label: label.to_owned(),
        })
    }

    /// Starts one more agent, in `node` if given.
    fn add_agent(&mut self, bins: &Binaries, node: Option<&Node>) -> anyhow::Result<()> {
        let n = self.agents.len();
        let health = match node {
            None => Some(SocketAddr::from(([127, 0, 0, 1], system::free_ports()?.0))),
            Some(_) => None,
        };
        let args = [
            &bins.extra[..],
            &system::agent_args(&self.dir, self.agent_port),
            &[
                format!("--proxy-server-host={}", self.host_ip),
                format!("--health-server-port={}", health.map_or(0, |h| h.port())),
                format!("--agent-id=agent-{n}"),
                "--sync-interval=100ms".to_owned(),
            ],
        ]
        .concat();
        let argv = match node {
            None => (bins.agent.clone(), args),
            Some(node) => (
                PathBuf::from("ip"),
                [
                    vec!["netns".to_owned(), "exec".to_owned(), node.name.clone()],
                    vec![bins.agent.display().to_string()],
                    args,
                ]
                .concat(),
            ),
        };
        let name = format!("{}-agent-{n}", self.label);
        let process = Process::spawn(
            format!("proxy-agent {n} ({})", self.label),
            &argv.0,
            &argv.1,
            self.dir.join(format!("retries-{name}-1.log")),
        )?;
        self.agents.push(Agent {
            process,
            argv,
            health,
            name,
            starts: 1,
        });
        Ok(())
    }

    /// Starts agent `i` again (killed by the caller: the old process is
    /// reaped first, so that its health port is free for the new one).
    fn restart(&mut self, i: usize) -> anyhow::Result<()> {
        let agent = &mut self.agents[i];
        agent.starts += 1;
        let log = self
            .dir
            .join(format!("retries-{}-{}.log", agent.name, agent.starts));
        agent.process.reap();
        agent.process = Process::spawn(agent.name.clone(), &agent.argv.0, &agent.argv.1, log)?;
        Ok(())
    }

    /// `/metrics` now.
    async fn scrape(&self) -> anyhow::Result<String> {
        Ok(probe::http_get(self.health, "/metrics").await?.1)
    }

    /// One series (`name{labels}` exactly) of the server, 0 if absent.
    async fn metric(&self, series: &str) -> anyhow::Result<f64> {
        Ok(metric_value(&self.scrape().await?, series))
    }

    /// Waits until the server counts `n` agents; an error names an agent
    /// that exited (with its log), or what the server counts.
    async fn wait_agents(&mut self, n: usize) -> anyhow::Result<()> {
        let started = Instant::now();
        loop {
            self.server.check_alive()?;
            for agent in &mut self.agents {
                agent.process.check_alive()?;
            }
            let text = self.scrape().await?;
            let connected = probe::prometheus_value(&text, CONNECTED);
            if connected == Some(n as f64) {
                return Ok(());
            }
            if started.elapsed() > Duration::from_secs(30) {
                bail!(
                    "{n} agents not connected within 30 s: the server counts {connected:?} ({})",
                    self.label
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// One tunnel's line from the frontend.
#[derive(Debug, Clone, Deserialize)]
struct Outcome {
    /// Its start, µs since the epoch.
    start_us: i64,
    /// Until its DIAL_RSP, µs.
    dial_us: i64,
    /// In all, µs.
    us: i64,
    /// Where it failed: `dial`, `exchange`; empty if it did not.
    #[serde(default)]
    phase: String,
    /// Why it failed.
    #[serde(default)]
    error: String,
}

impl Outcome {
    /// When its dial was answered or failed.
    fn answered_at(&self) -> i64 {
        if self.phase.is_empty() {
            self.start_us + self.dial_us
        } else {
            self.start_us + self.us
        }
    }
}

/// Starts the frontend's `rate` mode against `rig` for `duration`, with
/// konnectivity-client's dispatch (`-kclient`: a CLOSE_RSP it would drop
/// leaves the tunnel open) and each tunnel bounded by [`HUNG_AFTER`]; the
/// task returns every tunnel's outcome.
fn traffic(
    go: &GoFrontend,
    rig: &Rig,
    dest: SocketAddr,
    rate: u32,
    duration: Duration,
) -> anyhow::Result<JoinHandle<anyhow::Result<Vec<Outcome>>>> {
    let mut child = Command::new(&go.path)
        .arg(format!("-uds={}", rig.uds.display()))
        .args([
            "-kclient".to_owned(),
            "rate".to_owned(),
            format!("-addr={dest}"),
            format!("-rate={rate}"),
            format!("-duration={}ms", duration.as_millis()),
            format!("-limit={}ms", HUNG_AFTER.as_millis()),
            "-each".to_owned(),
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting {}", go.path.display()))?;
    let stdout = child.stdout.take().context("the frontend's stdout")?;
    Ok(tokio::spawn(async move {
        let mut outcomes = Vec::new();
        let mut lines = BufReader::new(stdout).lines();
        while let Some(line) = lines.next_line().await? {
            if let Ok(outcome) = serde_json::from_str::<Outcome>(&line) {
                outcomes.push(outcome);
            }
        }
        let status = child.wait().await?;
        if !status.success() {
            bail!("the grpc-go frontend's rate mode failed ({status})");
        }
        Ok(outcomes)
    }))
}

/// The `q` quantile (nearest rank) of `values`, in ms; `None` if empty.
fn quantile_ms(values: &[i64], q: f64) -> Option<f64> {
    let mut sorted = values.to_vec();
    sorted.sort_unstable();
    let rank = ((sorted.len() as f64 * q).ceil() as usize).clamp(1, sorted.len().max(1));
    sorted.get(rank - 1).map(|us| *us as f64 / 1000.0)
}

/// What one kill run found.
#[derive(Debug, Default)]
struct KillRun {
    tunnels: usize,
    failed_dials: usize,
    cut: usize,
    /// Tunnels still open [`HUNG_AFTER`] after they started.
    hung: usize,
    retried: f64,
    backend_close: f64,
    /// Kill → DIAL_RSP of the dials that waited on a killed agent, µs.
    after_death: Vec<i64>,
    /// Until DIAL_RSP of the other dials, µs.
    healthy: Vec<i64>,
}

async fn kill_run(
    bins: &Binaries,
    dir: &Path,
    opt: &RetriesOpt,
    host_ip: Ipv4Addr,
    (hang, retries): (Option<Duration>, u32),
) -> anyhow::Result<KillRun> {
    let echo = Echo::start(host_ip).await?;
    let label = format!(
        "kill-{}-retries{retries}",
        if hang.is_some() { "hung" } else { "plain" }
    );
    let mut rig = Rig::server(
        bins,
        dir,
        host_ip,
        &label,
        &[format!("--backend-dial-retries={retries}")],
    )
    .await?;
    for _ in 0..3 {
        rig.add_agent(bins, None)?;
    }
    rig.wait_agents(3).await?;
    let total = LEAD + ROUND * u32::try_from(opt.kills).unwrap_or(u32::MAX);
    let run = traffic(&opt.go, &rig, echo.addr, opt.rate, total)?;
    let start = tokio::time::Instant::now();
    let mut kills = Vec::new();
    for k in 0..opt.kills {
        tokio::time::sleep_until(start + LEAD + ROUND * k as u32).await;
        let victim = k % rig.agents.len();
        if let Some(hang) = hang {
            signal(rig.agents[victim].process.pid(), "STOP")?;
            tokio::time::sleep(hang).await;
        }
        kills.push(now_us());
        signal(rig.agents[victim].process.pid(), "KILL")?;
        rig.restart(victim)?;
        rig.wait_agents(3).await?;
    }
    let outcomes = run.await.context("the frontend's task")??;
    let waited = i64::try_from(WAITED.as_micros()).unwrap_or(i64::MAX);
    let mut result = KillRun {
        tunnels: outcomes.len(),
        retried: rig
            .metric("konnectivity_rs_server_dial_retries_total{reason=\"agent_gone\"}")
            .await?,
        backend_close: rig
            .metric(
                "konnectivity_network_proxy_server_dial_failure_count{reason=\"backend_close\"}",
            )
            .await?,
        ..KillRun::default()
    };
    for o in &outcomes {
        match o.phase.as_str() {
            "dial" => result.failed_dials += 1,
            "exchange" => result.cut += 1,
            _ => {}
        }
        if o.error == OVER_LIMIT {
            result.hung += 1;
        }
        let killed = kills
            .iter()
            .find(|k| o.start_us <= *k - waited && o.answered_at() >= **k);
        match (killed, o.phase.is_empty()) {
            (Some(kill), true) => result.after_death.push(o.answered_at() - kill),
            (None, true) => result.healthy.push(o.dial_us),
            _ => {}
        }
    }
    Ok(result)
}

/// What one slow run found.
#[derive(Debug, Default)]
struct SlowRun {
    dials: Vec<i64>,
    failed: usize,
    hedges: f64,
    won: f64,
    held: u64,
}

impl SlowRun {
    /// Adds another run's figures to these.
    fn absorb(&mut self, other: Self) {
        self.dials.extend(other.dials);
        self.failed += other.failed;
        self.hedges += other.hedges;
        self.won += other.won;
        self.held += other.held;
    }

    /// Dials that took a second or more (a SYN retransmitted).
    fn slow(&self) -> usize {
        self.dials.iter().filter(|us| **us >= 900_000).count()
    }
}

async fn slow_run(
    bins: &Binaries,
    dir: &Path,
    opt: &RetriesOpt,
    node: &Node,
    (label, slowed, hedge): (&str, bool, bool),
    duration: Duration,
) -> anyhow::Result<SlowRun> {
    let echo = Echo::start(node.host_ip).await?;
    let flags: Vec<String> = hedge
        .then(|| "--backend-dial-hedge".to_owned())
        .into_iter()
        .collect();
    let mut rig = Rig::server(bins, dir, node.host_ip, label, &flags).await?;
    rig.add_agent(bins, None)?;
    rig.add_agent(bins, None)?;
    rig.add_agent(bins, Some(node))?;
    rig.wait_agents(3).await?;
    if slowed {
        node.slow_dials_to(echo.addr)?;
    }
    let run = traffic(&opt.go, &rig, echo.addr, opt.rate, duration)?;
    let outcomes = run.await.context("the frontend's task")??;
    let held = if slowed {
        let held = node.dropped()?;
        node.heal()?;
        held
    } else {
        0
    };
    Ok(SlowRun {
        dials: outcomes
            .iter()
            .filter(|o| o.phase.is_empty())
            .map(|o| o.dial_us)
            .collect(),
        failed: outcomes.iter().filter(|o| !o.phase.is_empty()).count(),
        hedges: rig
            .metric("konnectivity_rs_server_dial_hedges_total")
            .await?,
        won: rig
            .metric("konnectivity_rs_server_dial_hedges_won_total")
            .await?,
        held,
    })
}

/// One agent's successful dials so far.
async fn dials_of(agent: &Agent) -> anyhow::Result<f64> {
    let health = agent.health.context("an agent without a health port")?;
    let text = probe::http_get(health, "/metrics").await?.1;
    Ok(metric_value(
        &text,
        "konnectivity_network_proxy_agent_dial_duration_seconds_count",
    ))
}

/// Tunnels the p2c holder keeps open on the first agent.
const P2C_HELD: usize = 100;
/// New tunnels of the p2c part.
const P2C_NEW: usize = 300;

/// (to the busy agent, to the two idle ones) of [`P2C_NEW`] new dials:
/// one agent holds [`P2C_HELD`] tunnels before the other two join.
async fn p2c_run(
    bins: &Binaries,
    dir: &Path,
    opt: &RetriesOpt,
    host_ip: Ipv4Addr,
) -> anyhow::Result<(f64, f64)> {
    let echo = Echo::start(host_ip).await?;
    let mut rig = Rig::server(bins, dir, host_ip, "p2c", &[]).await?;
    rig.add_agent(bins, None)?;
    rig.wait_agents(1).await?;
    // The agent's health port answers once it is up.
    wait_dials_answer(&rig.agents[0], "the p2c agent").await?;
    let uds = format!("-uds={}", rig.uds.display());
    let addr = format!("-addr={}", echo.addr);
    let holder = Holder::start(&opt.go, &uds, &addr).await?;
    rig.add_agent(bins, None)?;
    rig.add_agent(bins, None)?;
    rig.wait_agents(3).await?;
    for agent in &rig.agents[1..] {
        wait_dials_answer(agent, "a p2c agent").await?;
    }
    let before = dials_of(&rig.agents[0]).await?;
    new_dials(&opt.go, &uds, &addr).await?;
    let busy = dials_of(&rig.agents[0]).await? - before;
    let idle = dials_of(&rig.agents[1]).await? + dials_of(&rig.agents[2]).await?;
    holder.finish().await?;
    Ok((busy, idle))
}

/// Waits up to 30 s for `agent`'s dial count to answer; `who` names it in
/// the error.
async fn wait_dials_answer(agent: &Agent, who: &str) -> anyhow::Result<()> {
    let started = Instant::now();
    while dials_of(agent).await.is_err() {
        if started.elapsed() > Duration::from_secs(30) {
            bail!("{who}'s /metrics did not answer within 30 s");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

/// The grpc-go frontend holding [`P2C_HELD`] tunnels open until its stdin
/// closes (`many` mode).
struct Holder {
    child: tokio::process::Child,
}

impl Holder {
    /// Starts it with `uds` and `addr` (its `-uds=`, `-addr=` flags) and
    /// waits until it says its tunnels are open.
    async fn start(go: &GoFrontend, uds: &str, addr: &str) -> anyhow::Result<Self> {
        let mut child = Command::new(&go.path)
            .args([uds, "many", addr, &format!("-count={P2C_HELD}")])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .context("starting the grpc-go frontend (many)")?;
        let stdout = child.stdout.take().context("its stdout")?;
        let first = tokio::time::timeout(
            Duration::from_secs(60),
            BufReader::new(stdout).lines().next_line(),
        )
        .await
        .context("the holder did not open its tunnels within 60 s")??
        .context("the holder exited before opening its tunnels")?;
        if !first.contains(&format!("\"open\":{P2C_HELD}")) {
            bail!("the holder said {first:?}");
        }
        Ok(Self { child })
    }

    /// Closes its stdin and waits for it to close its tunnels cleanly.
    async fn finish(mut self) -> anyhow::Result<()> {
        if let Some(mut stdin) = self.child.stdin.take() {
            let _ = stdin.shutdown().await;
        }
        let status = tokio::time::timeout(Duration::from_secs(60), self.child.wait())
            .await
            .context("the holder did not close its tunnels within 60 s")??;
        if !status.success() {
            bail!("the holder's tunnels failed at the end ({status})");
        }
        Ok(())
    }
}

/// [`P2C_NEW`] single-use tunnels, 4 at a time, with the grpc-go
/// frontend's `dials` mode.
async fn new_dials(go: &GoFrontend, uds: &str, addr: &str) -> anyhow::Result<()> {
    let out = Command::new(&go.path)
        .args([
            uds,
            "dials",
            addr,
            &format!("-count={P2C_NEW}"),
            "-concurrency=4",
        ])
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .output()
        .await
        .context("running the grpc-go frontend (dials)")?;
    if !out.status.success() {
        bail!("the grpc-go frontend's dials failed ({})", out.status);
    }
    Ok(())
}

/// How long the hung part dials one at a time.
pub const HUNG_SERIAL: Duration = Duration::from_secs(60);
/// How long the hung part dials 8 at a time.
pub const HUNG_PARALLEL: Duration = Duration::from_secs(6);
/// The hung part's `--backend-dial-timeout`.
const HUNG_DIAL_TIMEOUT: Duration = Duration::from_secs(3);

/// What the frontend's `dials` mode reports.
#[derive(Debug, Deserialize)]
struct DialsReport {
    /// Dials that worked.
    dials: u64,
    /// Dials that failed.
    errors: u64,
}

/// Single-use tunnels `concurrency` at a time for `duration`, with the
/// grpc-go frontend's `dials` mode; what it reports.
async fn dials_for(
    go: &GoFrontend,
    uds: &str,
    addr: &str,
    concurrency: usize,
    duration: Duration,
) -> anyhow::Result<DialsReport> {
    let out = Command::new(&go.path)
        .args([
            uds,
            "dials",
            addr,
            &format!("-concurrency={concurrency}"),
            &format!("-duration={}ms", duration.as_millis()),
        ])
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .output()
        .await
        .context("running the grpc-go frontend (dials)")?;
    if !out.status.success() {
        bail!("the grpc-go frontend's dials failed ({})", out.status);
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .last()
        .context("the dials mode printed nothing")?;
    serde_json::from_str(line).with_context(|| format!("reading the dials report {line:?}"))
}

/// The hung part: (one at a time, 8 at a time) with one agent of three
/// stopped.
async fn hung_run(
    bins: &Binaries,
    dir: &Path,
    opt: &RetriesOpt,
    host_ip: Ipv4Addr,
) -> anyhow::Result<(DialsReport, DialsReport)> {
    let echo = Echo::start(host_ip).await?;
    let timeout = format!("--backend-dial-timeout={}s", HUNG_DIAL_TIMEOUT.as_secs());
    let mut rig = Rig::server(bins, dir, host_ip, "hung", &[timeout]).await?;
    for _ in 0..3 {
        rig.add_agent(bins, None)?;
    }
    rig.wait_agents(3).await?;
    for agent in &rig.agents {
        wait_dials_answer(agent, "a hung-part agent").await?;
    }
    let uds = format!("-uds={}", rig.uds.display());
    let addr = format!("-addr={}", echo.addr);
    let hung = rig.agents[0].process.pid();
    signal(hung, "STOP")?;
    let serial = dials_for(&opt.go, &uds, &addr, 1, HUNG_SERIAL).await;
    let parallel = dials_for(&opt.go, &uds, &addr, 8, HUNG_PARALLEL).await;
    signal(hung, "CONT")?;
    Ok((serial?, parallel?))
}

async fn hung_part(
    bins: &Binaries,
    pki: &Path,
    opt: &RetriesOpt,
    host_ip: Ipv4Addr,
    rec: &mut Recorder,
) -> anyhow::Result<()> {
    eprintln!(
        "retries hung: one agent of three stopped, {HUNG_SERIAL:?} one dial at a time, {HUNG_PARALLEL:?} 8 at a time ..."
    );
    let (serial, parallel) = hung_run(bins, pki, opt, host_ip).await?;
    eprintln!(
        "retries hung: one at a time {} ok, {} timed out; 8 at a time {} ok, {} timed out",
        serial.dials, serial.errors, parallel.dials, parallel.errors
    );
    push(
        rec,
        &report::RETRIES_HUNG_SERIAL_FAILED,
        count(serial.errors as usize),
    );
    let waited = serial.errors as f64 * HUNG_DIAL_TIMEOUT.as_secs_f64();
    push(
        rec,
        &report::RETRIES_HUNG_SERIAL_WAITED,
        Some(waited / HUNG_SERIAL.as_secs_f64() * 100.0),
    );
    let sent = (parallel.dials + parallel.errors).max(1) as f64;
    push(
        rec,
        &report::RETRIES_HUNG_PARALLEL_SHARE,
        Some(parallel.errors as f64 / sent * 100.0),
    );
    Ok(())
}

/// Runs the four parts and records their rows (grpc column); returns the
/// notes for the report.
///
/// # Errors
/// A process does not start or dies, the namespace cannot be made, or the
/// frontend fails.
pub async fn run(
    bins: &Binaries,
    dir: &Path,
    opt: &RetriesOpt,
    rec: &mut Recorder,
) -> anyhow::Result<Vec<String>> {
    let node = Node::create()?;
    let pki = dir.join("retries-pki");
    certs::ClusterPki::generate(&[node.host_ip.to_string()])
        .context("generating the retries scenario's certificates")?
        .write_to(&pki)
        .context("writing the retries scenario's certificates")?;
    rounds_part(bins, &pki, opt, node.host_ip, rec).await?;
    kill_part(bins, &pki, opt, node.host_ip, rec).await?;
    slow_part(bins, &pki, opt, &node, rec).await?;
    p2c_part(bins, &pki, opt, node.host_ip, rec).await?;
    hung_part(bins, &pki, opt, node.host_ip, rec).await?;
    Ok(vec![note(opt)])
}

/// Tunnels at once in each round of the rounds part.
const ROUND_CONCURRENCY: usize = 32;
/// Each round's load.
const ROUND_LOAD: Duration = Duration::from_secs(3);
/// When in its round an agent is killed.
const ROUND_KILL_AT: Duration = Duration::from_millis(1500);

/// What the rounds of one mode found.
#[derive(Debug, Default)]
struct Rounds {
    /// Tunnels that carried their exchange.
    tunnels: usize,
    /// Tunnels that failed (a dial, or a cut with an error).
    errors: usize,
    /// Tunnels still open [`HUNG_AFTER`] after they started.
    hung: usize,
}

impl Rounds {
    fn absorb(&mut self, other: &Self) {
        self.tunnels += other.tunnels;
        self.errors += other.errors;
        self.hung += other.hung;
    }
}

/// One round of gRPC tunnels: the grpc-go frontend's `dials` mode with
/// konnectivity-client's dispatch, [`ROUND_CONCURRENCY`] at a time for
/// [`ROUND_LOAD`], each bounded by [`HUNG_AFTER`].
async fn grpc_round(go: &GoFrontend, uds: &Path, dest: SocketAddr) -> anyhow::Result<Rounds> {
    let output = Command::new(&go.path)
        .arg(format!("-uds={}", uds.display()))
        .args([
            "-kclient".to_owned(),
            "dials".to_owned(),
            format!("-addr={dest}"),
            format!("-concurrency={ROUND_CONCURRENCY}"),
            format!("-duration={}ms", ROUND_LOAD.as_millis()),
            format!("-limit={}ms", HUNG_AFTER.as_millis()),
        ])
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .output()
        .await
        .with_context(|| format!("running {}", go.path.display()))?;
    if !output.status.success() {
        bail!(
            "the grpc-go frontend's dials mode failed ({})",
            output.status
        );
    }
    let report: serde_json::Value =
        serde_json::from_slice(&output.stdout).context("the grpc-go frontend's dials report")?;
    let count = |key: &str| {
        report[key]
            .as_u64()
            .and_then(|n| usize::try_from(n).ok())
            .unwrap_or(0)
    };
    Ok(Rounds {
        tunnels: count("dials"),
        errors: count("errors") - count("over_limit"),
        hung: count("over_limit"),
    })
}

/// One HTTP-CONNECT tunnel on `uds`: 1 KiB echoed by `dest`, checked.
async fn connect_once(uds: &Path, dest: SocketAddr) -> anyhow::Result<()> {
    use tokio::io::AsyncReadExt;
    let socket = tokio::net::UnixStream::connect(uds).await?;
    let mut tunnel = client::dial::http_connect(socket, &dest.to_string()).await?;
    let sent = integration_tests::destination::pattern(1024, 5);
    tunnel.write_all(&sent).await?;
    let mut got = vec![0u8; sent.len()];
    tunnel.read_exact(&mut got).await?;
    if got != sent {
        bail!("the echo differs");
    }
    tunnel.shutdown().await?;
    Ok(())
}

/// One round of HTTP-CONNECT tunnels: [`ROUND_CONCURRENCY`] at a time for
/// [`ROUND_LOAD`], each bounded by [`HUNG_AFTER`].
async fn connect_round(uds: &Path, dest: SocketAddr) -> Rounds {
    let until = tokio::time::Instant::now() + ROUND_LOAD;
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..ROUND_CONCURRENCY {
        let uds = uds.to_owned();
        workers.spawn(async move {
            let mut mine = Rounds::default();
            while tokio::time::Instant::now() < until {
                match tokio::time::timeout(HUNG_AFTER, connect_once(&uds, dest)).await {
                    Ok(Ok(())) => mine.tunnels += 1,
                    Ok(Err(_)) => mine.errors += 1,
                    Err(_) => mine.hung += 1,
                }
            }
            mine
        });
    }
    let mut all = Rounds::default();
    while let Some(done) = workers.join_next().await {
        if let Ok(mine) = done {
            all.absorb(&mine);
        }
    }
    all
}

/// `rounds` rounds in `mode`: each a round of single-use tunnels, one agent
/// of three (in turn) killed (SIGKILL) [`ROUND_KILL_AT`] into it and
/// started again.
async fn rounds_run(
    bins: &Binaries,
    dir: &Path,
    opt: &RetriesOpt,
    host_ip: Ipv4Addr,
    mode: &str,
) -> anyhow::Result<Rounds> {
    let echo = Echo::start(host_ip).await?;
    let label = format!("rounds-{mode}");
    let mut rig = Rig::server_in(bins, dir, host_ip, (&label, mode), &[]).await?;
    for _ in 0..3 {
        rig.add_agent(bins, None)?;
    }
    rig.wait_agents(3).await?;
    let mut all = Rounds::default();
    for round in 0..opt.rounds {
        let load = {
            let (go, uds, mode) = (opt.go.clone(), rig.uds.clone(), mode.to_owned());
            let dest = echo.addr;
            tokio::spawn(async move {
                if mode == "grpc" {
                    grpc_round(&go, &uds, dest).await
                } else {
                    Ok(connect_round(&uds, dest).await)
                }
            })
        };
        tokio::time::sleep(ROUND_KILL_AT).await;
        let victim = round % rig.agents.len();
        signal(rig.agents[victim].process.pid(), "KILL")?;
        rig.restart(victim)?;
        let done = load.await.context("a round's load")??;
        all.absorb(&done);
        rig.wait_agents(3).await?;
    }
    Ok(all)
}

/// The rounds part (issue 50): `--retries-rounds` rounds of an agent
/// killed under [`ROUND_CONCURRENCY`] single-use tunnels at a time, in
/// gRPC mode (konnectivity-client's dispatch) and HTTP-CONNECT mode; a
/// tunnel still open [`HUNG_AFTER`] after it started fails the scenario.
async fn rounds_part(
    bins: &Binaries,
    pki: &Path,
    opt: &RetriesOpt,
    host_ip: Ipv4Addr,
    rec: &mut Recorder,
) -> anyhow::Result<()> {
    let mut hung = 0;
    for (mode, tunnels, errors, hung_row) in [
        (
            "grpc",
            &report::RETRIES_ROUNDS_GRPC_TUNNELS,
            &report::RETRIES_ROUNDS_GRPC_ERRORS,
            &report::RETRIES_ROUNDS_GRPC_HUNG,
        ),
        (
            "http-connect",
            &report::RETRIES_ROUNDS_CONNECT_TUNNELS,
            &report::RETRIES_ROUNDS_CONNECT_ERRORS,
            &report::RETRIES_ROUNDS_CONNECT_HUNG,
        ),
    ] {
        eprintln!(
            "retries rounds: {} rounds of a kill under {ROUND_CONCURRENCY} tunnels at a time, {mode} ...",
            opt.rounds
        );
        let r = rounds_run(bins, pki, opt, host_ip, mode).await?;
        eprintln!(
            "retries rounds ({mode}): {} tunnels, {} failed, {} hung",
            r.tunnels, r.errors, r.hung
        );
        push(rec, tunnels, count(r.tunnels));
        push(rec, errors, count(r.errors));
        push(rec, hung_row, count(r.hung));
        hung += r.hung;
    }
    none_hung(hung, "in rounds of an agent killed under load")
}

/// An error when `hung` tunnels were still open [`HUNG_AFTER`] after they
/// started, `when`.
fn none_hung(hung: usize, when: &str) -> anyhow::Result<()> {
    if hung > 0 {
        bail!(
            "{hung} tunnels were still open {HUNG_AFTER:?} after they started, {when}: requests \
             kube-apiserver made would have waited for ever"
        );
    }
    Ok(())
}

/// Records `value` in the grpc column.
fn push(rec: &mut Recorder, def: &report::Def, value: Option<f64>) {
    rec.push(def, Route::Grpc, 0, value);
}

/// A count as a value.
fn count(n: usize) -> Option<f64> {
    Some(n as f64)
}

/// The kill runs: hung first and plain, with `--backend-dial-retries` 1
/// and 0 (ANP).
async fn kill_part(
    bins: &Binaries,
    pki: &Path,
    opt: &RetriesOpt,
    host_ip: Ipv4Addr,
    rec: &mut Recorder,
) -> anyhow::Result<()> {
    let mut hung = 0;
    for (hang, retries) in [(Some(HANG), 1), (Some(HANG), 0), (None, 1), (None, 0)] {
        eprintln!(
            "retries kill: {} kills (hung {hang:?} first) at {}/s, --backend-dial-retries={retries} ...",
            opt.kills, opt.rate
        );
        let k = kill_run(bins, pki, opt, host_ip, (hang, retries)).await?;
        eprintln!(
            "retries kill: {} tunnels, {} dials failed, {} cut after DIAL_RSP, {} hung, {} retried \
             (server), {} failed backend_close (server), {} identified as waiting on a killed agent",
            k.tunnels,
            k.failed_dials,
            k.cut,
            k.hung,
            k.retried,
            k.backend_close,
            k.after_death.len()
        );
        push_kill(rec, (hang.is_some(), retries), &k);
        hung += k.hung;
    }
    none_hung(hung, "in the kill runs")
}

/// The rows of one kill run: those of a hung or a plain kill, with
/// retries (1) or without (0).
fn push_kill(rec: &mut Recorder, (hung, retries): (bool, u32), k: &KillRun) {
    match (hung, retries) {
        (false, 1) => {
            push(
                rec,
                &report::RETRIES_KILL_PLAIN_FAILED,
                count(k.failed_dials),
            );
            push(rec, &report::RETRIES_KILL_PLAIN_RETRIED, Some(k.retried));
            push(rec, &report::RETRIES_KILL_PLAIN_CUT, count(k.cut));
            push(rec, &report::RETRIES_KILL_PLAIN_HUNG, count(k.hung));
        }
        (false, _) => {
            push(
                rec,
                &report::RETRIES_KILL_PLAIN_FAILED_ANP,
                count(k.failed_dials),
            );
        }
        (true, 1) => {
            push(rec, &report::RETRIES_KILL_FAILED, count(k.failed_dials));
            push(rec, &report::RETRIES_KILL_RETRIED, Some(k.retried));
            push(rec, &report::RETRIES_KILL_CUT, count(k.cut));
            push(rec, &report::RETRIES_KILL_HUNG, count(k.hung));
            push(
                rec,
                &report::RETRIES_KILL_WAITED,
                count(k.after_death.len()),
            );
            for (def, values, q) in [
                (&report::RETRIES_KILL_AFTER_P50, &k.after_death, 0.5),
                (&report::RETRIES_KILL_AFTER_P99, &k.after_death, 0.99),
                (&report::RETRIES_KILL_HEALTHY_P50, &k.healthy, 0.5),
                (&report::RETRIES_KILL_HEALTHY_P99, &k.healthy, 0.99),
            ] {
                push(rec, def, quantile_ms(values, q));
            }
        }
        (true, _) => {
            push(rec, &report::RETRIES_KILL_FAILED_ANP, count(k.failed_dials));
        }
    }
}

/// The slow runs: all healthy, slowed with hedging off, slowed with it
/// on, interleaved in rounds so that the machine's drift falls on all
/// three.
async fn slow_part(
    bins: &Binaries,
    pki: &Path,
    opt: &RetriesOpt,
    node: &Node,
    rec: &mut Recorder,
) -> anyhow::Result<()> {
    let rounds: u32 = if opt.duration >= SLOW_ROUND * 2 {
        u32::try_from(opt.duration.as_secs() / SLOW_ROUND.as_secs()).unwrap_or(1)
    } else {
        1
    };
    let per_round = opt.duration / rounds;
    let mut slow: Vec<SlowRun> = (0..3).map(|_| SlowRun::default()).collect();
    for round in 1..=rounds {
        for (i, (label, slowed, hedge)) in [
            ("healthy", false, false),
            ("slow-nohedge", true, false),
            ("slow-hedge", true, true),
        ]
        .into_iter()
        .enumerate()
        {
            let label = format!("{label}-{round}");
            let s = slow_run(bins, pki, opt, node, (&label, slowed, hedge), per_round).await?;
            eprintln!(
                "retries slow: {label}: {} dials, {} failed, p50 {:?} ms, p99 {:?} ms, \
                 p99.9 {:?} ms, {} took >= 0.9 s; {} SYNs held; {} hedged, {} won",
                s.dials.len(),
                s.failed,
                quantile_ms(&s.dials, 0.5),
                quantile_ms(&s.dials, 0.99),
                quantile_ms(&s.dials, 0.999),
                s.slow(),
                s.held,
                s.hedges,
                s.won
            );
            slow[i].absorb(s);
        }
    }
    let [healthy, off, on] = &slow[..] else {
        bail!("three slow runs expected");
    };
    push_slow(rec, healthy, off, on);
    Ok(())
}

/// The rows of the slow runs: each one's latency quantiles, the slowed
/// runs' p99 against the healthy one's, the slow dials, SYNs held and
/// hedges.
fn push_slow(rec: &mut Recorder, healthy: &SlowRun, off: &SlowRun, on: &SlowRun) {
    let p99 = |s: &SlowRun| quantile_ms(&s.dials, 0.99);
    let ratio = |a: Option<f64>, b: Option<f64>| a.zip(b).map(|(a, b)| a / b);
    for (run, [p50_row, p99_row, p999_row]) in [
        (
            healthy,
            [
                &report::RETRIES_SLOW_HEALTHY_P50,
                &report::RETRIES_SLOW_HEALTHY_P99,
                &report::RETRIES_SLOW_HEALTHY_P999,
            ],
        ),
        (
            off,
            [
                &report::RETRIES_SLOW_OFF_P50,
                &report::RETRIES_SLOW_OFF_P99,
                &report::RETRIES_SLOW_OFF_P999,
            ],
        ),
        (
            on,
            [
                &report::RETRIES_SLOW_ON_P50,
                &report::RETRIES_SLOW_ON_P99,
                &report::RETRIES_SLOW_ON_P999,
            ],
        ),
    ] {
        push(rec, p50_row, quantile_ms(&run.dials, 0.5));
        push(rec, p99_row, p99(run));
        push(rec, p999_row, quantile_ms(&run.dials, 0.999));
    }
    push(
        rec,
        &report::RETRIES_SLOW_OFF_RATIO,
        ratio(p99(off), p99(healthy)),
    );
    push(
        rec,
        &report::RETRIES_SLOW_ON_RATIO,
        ratio(p99(on), p99(healthy)),
    );
    push(rec, &report::RETRIES_SLOW_OFF_SECOND, count(off.slow()));
    push(rec, &report::RETRIES_SLOW_ON_SECOND, count(on.slow()));
    push(rec, &report::RETRIES_SLOW_HELD_OFF, Some(off.held as f64));
    push(rec, &report::RETRIES_SLOW_HELD_ON, Some(on.held as f64));
    push(rec, &report::RETRIES_SLOW_HEDGED, Some(on.hedges));
    push(rec, &report::RETRIES_SLOW_WON, Some(on.won));
    push(
        rec,
        &report::RETRIES_SLOW_FAILED,
        count(healthy.failed + off.failed + on.failed),
    );
}

/// The p2c run and its row: the share of new dials the idle agents got.
async fn p2c_part(
    bins: &Binaries,
    pki: &Path,
    opt: &RetriesOpt,
    host_ip: Ipv4Addr,
    rec: &mut Recorder,
) -> anyhow::Result<()> {
    eprintln!("retries p2c: 100 tunnels held on one agent of three, 300 new ...");
    let (busy, idle) = p2c_run(bins, pki, opt, host_ip).await?;
    eprintln!("retries p2c: {busy} to the busy agent, {idle} to the two idle ones");
    push(
        rec,
        &report::RETRIES_P2C_IDLE,
        Some(idle / (busy + idle) * 100.0),
    );
    Ok(())
}

/// The report's note on how the scenario ran.
fn note(opt: &RetriesOpt) -> String {
    format!(
        "retries runs once, after storm, each part on a fresh server with three agents, \
         kube-apiserver's grpc-go client starting single-use tunnels at {rate}/s (1 KiB echoed \
         each): kill = {kills} times one agent in turn stops answering (SIGSTOP) for {hang:?}, \
         then SIGKILL, started again, once with --backend-dial-retries=1, once with 0 (ANP), then \
         the same with no hang (kill -9 of a serving agent); a \
         dial 'waited on the killed agent' started >= {waited:?} before a kill and was \
         answered after it, its 'death -> DIAL_RSP' from the kill; 'healthy' = the other \
         dials, until DIAL_RSP; slow = {dur:?} each: all healthy, then one agent (its own \
         network namespace) whose node drops the first SYN of each connection to the \
         destination (nftables; no netem on this kernel) so its dials take 1 s, hedging off, \
         and on (--backend-dial-hedge, delay p95), in alternating rounds of {round:?}, each \
         on a fresh server; latency = until DIAL_RSP as the frontend \
         sees it (a new grpc-go connection included); p2c = 100 tunnels held on one agent, then \
         300 new ones 4 at a time, counted by the agents' dial counters; hung = one agent of \
         three stopped (SIGSTOP, its connection up) under --backend-dial-timeout=3s, single-use \
         tunnels one at a time for {serial:?}, then 8 at a time for {parallel:?}: each dial \
         sent to it times out",
        rate = opt.rate,
        kills = opt.kills,
        hang = HANG,
        waited = WAITED,
        dur = opt.duration,
        round = SLOW_ROUND,
        serial = HUNG_SERIAL,
        parallel = HUNG_PARALLEL,
    )
}
