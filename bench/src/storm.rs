//! The storm scenario: restart storms of grpc-go agents against our server,
//! with its admission (default flags) and with none
//! (`--max-tls-handshakes` at its largest), in three conditions:
//! - **idle**: the server on the first half of the CPUs, the swarm on the
//!   other half (on 2 cores: one each);
//! - **shared**: the swarm on the server's CPUs (its peers answer late
//!   because they wait for the same CPU);
//! - **latency**: as idle, with the swarm in a network namespace behind a
//!   veth pair whose two ends delay every packet by half of `--storm-latency`
//!   (netem): a round trip longer by that much, as agents far from a hosted
//!   control plane have it. On a kernel without netem (this machine's:
//!   `CONFIG_NET_SCH_NETEM` is not set) the swarm delays its own
//!   connections' bytes instead (`-latency`: half each way, the TCP
//!   handshake itself not delayed), and the report says so.
//!
//! The agents are `tests/go/agents` (grpc-go, as ANP's proxy-agent: each
//! agent its own TLS connection and no session cache, so every handshake
//! is a full one with a signature by the server's key: RSA-2048 as
//! kubeadm makes it, or ECDSA P-256 (`--storm-key-algorithm`), its CA
//! RSA-2048 either way, as kubeadm's; its own
//! `Connect` stream; a retry 1 to 2 s after a failure). They
//! present ECDSA P-256 client certificates from a CA of their own: as cheap
//! for them as sending a token is for the agents of the Konnectivity docs'
//! deployment, so the swarm's CPU is not what the storm measures. For
//! each condition and variant, on a fresh server: the time from the
//! swarm's start until the server counts all N agents (cold), then from a
//! SIGKILL of the server, started again at once on the same port, until it
//! counts all N again (restart); the handshakes the server threw away after
//! signing (`konnectivity_rs_server_tls_handshakes_dropped_total`, reasons
//! `stalled`, `timeout`, `failed`); the swarm's failed connection attempts.
//!
//! Needs `taskset` and, for the latency condition, root (`ip netns`,
//! `tc`); the namespace and the veth pair are removed when it ends.

use std::{
    net::{IpAddr, Ipv4Addr, SocketAddr},
    path::{Path, PathBuf},
    process::Stdio,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use anyhow::{Context, bail};
use clap::ValueEnum;
use serde::Deserialize;
use tokio::{
    io::{AsyncBufReadExt, BufReader},
    process::{Child, ChildStdin, Command},
    task::JoinHandle,
};

use crate::{
    probe,
    report::{self, Recorder, Route},
    system::{self, Binaries, Process, path_with_sbin, tool},
};

/// How often the server's gauge is read while agents connect.
const POLL: Duration = Duration::from_millis(200);
/// The server's count of connected agent streams.
const CONNECTED: &str = "konnectivity_network_proxy_server_ready_backend_connections";
/// The server's count of pending connections given up, by reason.
const DROPPED: &str = "konnectivity_rs_server_tls_handshakes_dropped_total";
/// The reasons that cost the server a signature.
const AFTER_SIGNING: [&str; 3] = ["stalled", "timeout", "failed"];
/// Every reason, for the log.
const REASONS: [&str; 7] = [
    "no_hello",
    "stalled",
    "hello_timeout",
    "bad_hello",
    "peer_gone",
    "timeout",
    "failed",
];
/// `--max-tls-handshakes` at its largest: no admission cap.
const NO_ADMISSION: &str = "--max-tls-handshakes=18446744073709551615";

/// A condition of the storm (`--storm-conditions`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Condition {
    /// Server and swarm on separate CPUs.
    Idle,
    /// The swarm on the server's CPUs.
    Shared,
    /// As idle, `--storm-latency` added to every round trip.
    Latency,
}

impl Condition {
    /// Its index in [`report::STORM`].
    fn index(self) -> usize {
        self as usize
    }
}

/// The built swarm, `tests/go/agents`.
#[derive(Debug, Clone)]
pub struct GoAgents {
    /// Its path.
    pub path: PathBuf,
}

impl GoAgents {
    /// `given`, else `target/go-agents` beside this executable's
    /// `target/<profile>/`.
    ///
    /// # Errors
    /// It does not exist; the message says how to build it.
    pub fn locate(given: Option<PathBuf>) -> anyhow::Result<Self> {
        let path = system::locate_go(given, "agents")?;
        Ok(Self { path })
    }
}

/// What the storm scenario is asked for.
#[derive(Debug, Clone)]
pub struct StormOpt {
    /// Agents in the swarm.
    pub agents: usize,
    /// The conditions, in order.
    pub conditions: Vec<Condition>,
    /// Round trip added in the latency condition.
    pub latency: Duration,
    /// Longest wait for all agents to connect, per storm.
    pub limit: Duration,
    /// The keys of the server's certificates.
    pub key_algorithm: certs::KeyAlgorithm,
    /// The swarm's binary.
    pub go_agents: GoAgents,
}

/// Checks, before any scenario runs, that the storm can: `taskset`, and
/// for the latency condition root, `ip` and `tc`.
///
/// # Errors
/// What is missing.
pub fn check(opt: &StormOpt) -> anyhow::Result<()> {
    let mut needed = vec!["taskset"];
    if opt.conditions.contains(&Condition::Latency) {
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        let root = status
            .lines()
            .find_map(|l| l.strip_prefix("Uid:"))
            .and_then(|uids| uids.split_whitespace().nth(1))
            == Some("0");
        if !root {
            bail!(
                "--storm-conditions latency needs root (a network namespace, netem); \
                 run as root or leave it out"
            );
        }
        needed.extend(["ip", "tc"]);
    }
    for tool in needed {
        let found = std::process::Command::new("sh")
            .args(["-c", &format!("command -v {tool}")])
            .env("PATH", path_with_sbin())
            .stdout(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !found {
            bail!("the storm scenario needs `{tool}` (util-linux, iproute2)");
        }
    }
    Ok(())
}

/// A network namespace joined to this one by a veth pair whose two ends
/// delay every packet by `one_way` when the kernel has netem; removed on
/// drop.
struct Netns {
    /// The namespace.
    name: String,
    /// The veth end in this namespace.
    host_if: String,
    /// Its address (the server listens there).
    host_ip: Ipv4Addr,
    /// Whether netem delays the packets (else the swarm must).
    netem: bool,
}

impl Netns {
    /// Creates it, with names and a /30 of 10.254.0.0/16 taken from this
    /// process's id; an error if that /30 is routed here already.
    fn create(one_way: Duration) -> anyhow::Result<Self> {
        let pid = std::process::id();
        let (a, b) = (((pid >> 6) & 0xff) as u8, ((pid & 0x3f) << 2) as u8);
        let subnet = format!("10.254.{a}.{b}/30");
        let routes = std::process::Command::new("ip")
            .args(["-4", "route", "show", "match", &subnet])
            .env("PATH", path_with_sbin())
            .output()
            .context("running ip route")?;
        let taken = String::from_utf8_lossy(&routes.stdout)
            .lines()
            .any(|route| !route.starts_with("default"));
        if taken {
            bail!("{subnet} is routed here already: another namespace uses it");
        }
        let mut netns = Self {
            name: format!("kstorm{pid}"),
            host_if: format!("ksh{pid}"),
            host_ip: Ipv4Addr::new(10, 254, a, b + 1),
            netem: false,
        };
        let ns_if = format!("ksn{pid}");
        let ns_ip = Ipv4Addr::new(10, 254, a, b + 2);
        let delay = format!("{}ms", one_way.as_millis());
        let (name, host_if) = (netns.name.as_str(), netns.host_if.as_str());
        let host_cidr = format!("{}/30", netns.host_ip);
        let ns_cidr = format!("{ns_ip}/30");
        let netem = ["netem", "delay", &delay, "limit", "1000000"];
        tool("ip", &["netns", "add", name])?;
        tool(
            "ip",
            &[
                "link", "add", host_if, "type", "veth", "peer", "name", &ns_if,
            ],
        )?;
        tool("ip", &["link", "set", &ns_if, "netns", name])?;
        tool("ip", &["addr", "add", &host_cidr, "dev", host_if])?;
        tool("ip", &["link", "set", host_if, "up"])?;
        let in_ns = |args: &[&str]| {
            let all = [&["netns", "exec", name][..], args].concat();
            tool("ip", &all)
        };
        in_ns(&["ip", "addr", "add", &ns_cidr, "dev", &ns_if])?;
        in_ns(&["ip", "link", "set", &ns_if, "up"])?;
        in_ns(&["ip", "link", "set", "lo", "up"])?;
        let host_netem = tool(
            "tc",
            &[&["qdisc", "add", "dev", host_if, "root"][..], &netem].concat(),
        );
        match host_netem {
            Ok(_) => {
                in_ns(&[&["tc", "qdisc", "add", "dev", &ns_if, "root"][..], &netem].concat())?;
                netns.netem = true;
            }
            Err(error) => eprintln!("storm: no netem ({error:#}): the swarm delays its bytes"),
        }
        Ok(netns)
    }

    /// The command prefix that runs a program inside it.
    fn exec(&self) -> Vec<String> {
        ["ip", "netns", "exec", &self.name]
            .map(str::to_owned)
            .to_vec()
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        // Deleting the namespace deletes its veth end, and so the pair.
        let _ = tool("ip", &["netns", "del", &self.name]);
        let _ = tool("ip", &["link", "del", &self.host_if]);
    }
}

/// The server under test, on CPUs of its own choosing, restartable on the
/// same ports.
struct Server {
    /// The running process, if any.
    process: Option<Process>,
    /// `taskset -c CPUS proxy-server ARGS`.
    argv: Vec<String>,
    /// Where logs go.
    dir: PathBuf,
    /// Name of its logs.
    label: String,
    /// How many times it was started (log names).
    starts: usize,
    /// The health port (`/metrics`).
    health: SocketAddr,
}

impl Server {
    /// Starts the process and waits until `/metrics` answers.
    async fn start(&mut self) -> anyhow::Result<()> {
        self.starts += 1;
        self.process = Some(Process::spawn(
            format!("proxy-server ({})", self.label),
            Path::new("taskset"),
            &self.argv,
            self.dir
                .join(format!("storm-server-{}-{}.log", self.label, self.starts)),
        )?);
        let started = Instant::now();
        while probe::http_get(self.health, "/metrics").await.is_err() {
            self.check_alive()?;
            if started.elapsed() > Duration::from_secs(30) {
                bail!("proxy-server did not answer /metrics within 30 s");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(())
    }

    /// SIGKILL, as a crashed or evicted control-plane Pod.
    fn kill(&mut self) {
        self.process = None;
    }

    fn check_alive(&mut self) -> anyhow::Result<()> {
        match &mut self.process {
            Some(p) => p.check_alive(),
            None => bail!("proxy-server is not running"),
        }
    }

    /// CPU seconds the running process has used.
    fn cpu(&self) -> anyhow::Result<f64> {
        let process = self
            .process
            .as_ref()
            .context("proxy-server is not running")?;
        probe::cpu_seconds(process.pid())
    }

    /// `/metrics` now.
    async fn scrape(&self) -> anyhow::Result<String> {
        Ok(probe::http_get(self.health, "/metrics").await?.1)
    }
}

/// The counts the swarm prints.
#[derive(Debug, Default, Clone, Copy, Deserialize)]
struct SwarmCounts {
    /// Agents with their stream up.
    connected: u64,
    /// Connections tried.
    attempts: u64,
    /// Connections that never got a stream up.
    failures: u64,
}

/// A running `tests/go/agents`, killed on drop.
struct Swarm {
    /// The process (`ip netns exec` and `taskset` exec it).
    child: Child,
    /// Its stdin: it runs until this closes.
    _stdin: ChildStdin,
    /// The last counts it printed.
    latest: Arc<Mutex<SwarmCounts>>,
    /// Reads its reports.
    reader: JoinHandle<()>,
    /// Its stderr.
    log: PathBuf,
}

impl Swarm {
    fn start(argv: &[String], log: PathBuf) -> anyhow::Result<Self> {
        let (program, args) = argv.split_first().context("an empty command")?;
        let stderr =
            std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let mut child = Command::new(program)
            .args(args)
            .env("PATH", path_with_sbin())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {}", argv.join(" ")))?;
        let stdin = child.stdin.take().context("the swarm's stdin")?;
        let stdout = child.stdout.take().context("the swarm's stdout")?;
        let latest = Arc::new(Mutex::new(SwarmCounts::default()));
        let into = latest.clone();
        let reader = tokio::spawn(async move {
            let mut lines = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                if let Ok(counts) = serde_json::from_str::<SwarmCounts>(&line) {
                    *into.lock().unwrap_or_else(|e| e.into_inner()) = counts;
                }
            }
        });
        Ok(Self {
            child,
            _stdin: stdin,
            latest,
            reader,
            log,
        })
    }

    /// CPU seconds the swarm has used.
    fn cpu(&self) -> anyhow::Result<f64> {
        let pid = self.child.id().context("the grpc-go swarm has exited")?;
        probe::cpu_seconds(pid)
    }

    fn counts(&self) -> SwarmCounts {
        *self.latest.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn check_alive(&mut self) -> anyhow::Result<()> {
        if let Some(status) = self.child.try_wait()? {
            let log = std::fs::read_to_string(&self.log).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(20).collect();
            bail!(
                "the grpc-go swarm exited ({status}); its log:\n{}",
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            );
        }
        Ok(())
    }
}

impl Drop for Swarm {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

/// What one storm found.
struct Storm {
    /// Until all were connected; `None` past the limit.
    took: Option<Duration>,
    /// Handshakes the server threw away after signing.
    thrown: f64,
    /// The swarm's failed attempts meanwhile.
    failed: u64,
    /// CPU seconds the server and the swarm used meanwhile.
    cpu: (f64, f64),
}

/// Waits until the server counts `n` agents, from `since`; `None` if not
/// within `limit` (the count reached is logged).
async fn until_connected(
    server: &mut Server,
    swarm: &mut Swarm,
    n: usize,
    since: Instant,
    limit: Duration,
) -> anyhow::Result<Option<Duration>> {
    loop {
        server.check_alive()?;
        swarm.check_alive()?;
        let text = server.scrape().await.unwrap_or_default();
        let now = probe::prometheus_value(&text, CONNECTED).unwrap_or(0.0) as usize;
        if now >= n {
            return Ok(Some(since.elapsed()));
        }
        if since.elapsed() > limit {
            eprintln!(
                "storm: {now} of {n} agents connected after {limit:?} (swarm: {} up)",
                swarm.counts().connected
            );
            return Ok(None);
        }
        tokio::time::sleep(POLL).await;
    }
}

/// The server's drops by reason since it started: (thrown away after
/// signing, a summary for the log).
fn drops(text: &str) -> (f64, String) {
    let value = |reason: &str| {
        probe::prometheus_value(text, &format!("{DROPPED}{{reason=\"{reason}\"}}")).unwrap_or(0.0)
    };
    let thrown = AFTER_SIGNING.iter().map(|r| value(r)).sum();
    let summary = REASONS
        .iter()
        .map(|r| (r, value(r)))
        .filter(|(_, v)| *v > 0.0)
        .map(|(r, v)| format!("{r} {v}"))
        .collect::<Vec<_>>()
        .join(", ");
    (thrown, summary)
}

/// `/proc/loadavg`'s first three fields.
fn load() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

/// The CPUs (taskset lists) of the server and of the swarm in `condition`.
fn cpus(condition: Condition) -> (String, String) {
    let n = std::thread::available_parallelism().map_or(1, usize::from);
    let half = (n / 2).max(1);
    let server = format!("0-{}", half - 1);
    let swarm = match condition {
        Condition::Shared => server.clone(),
        _ if n > half => format!("{half}-{}", n - 1),
        _ => server.clone(),
    };
    (server, swarm)
}

/// Runs the storms and records their rows; returns notes for the report.
///
/// # Errors
/// A process does not start or dies, or the namespace cannot be made.
pub async fn run(
    bins: &Binaries,
    dir: &Path,
    opt: &StormOpt,
    rec: &mut Recorder,
) -> anyhow::Result<Vec<String>> {
    let setup = Setup::write(bins, dir, opt)?;
    let mut notes = Vec::new();
    for &condition in &opt.conditions {
        notes.extend(setup.condition(condition, rec).await?);
    }
    notes.push(note(opt));
    notes.push(format!("storm: load average at the end {}", load()));
    Ok(notes)
}

/// What every storm runs with: the binaries, the options and the
/// certificates.
struct Setup<'a> {
    /// The binaries.
    bins: &'a Binaries,
    /// Files and logs.
    dir: &'a Path,
    /// The scenario's options.
    opt: &'a StormOpt,
    /// The server's certificates (`--storm-key-algorithm`).
    pki: PathBuf,
    /// The agents' certificates (ECDSA P-256).
    agent_pki: PathBuf,
}

impl<'a> Setup<'a> {
    /// Writes the server's keys (`--storm-key-algorithm`) and the
    /// agents' (ECDSA P-256) under `dir`.
    fn write(bins: &'a Binaries, dir: &'a Path, opt: &'a StormOpt) -> anyhow::Result<Self> {
        let (pki, agent_pki) = write_pkis(dir, opt.key_algorithm)?;
        Ok(Self {
            bins,
            dir,
            opt,
            pki,
            agent_pki,
        })
    }

    /// Both variants (with admission and with none) in `condition`, then
    /// their ratio rows; a note if the latency was emulated by the swarm.
    async fn condition(
        &self,
        condition: Condition,
        rec: &mut Recorder,
    ) -> anyhow::Result<Option<String>> {
        let netns = match condition {
            Condition::Latency => Some(Netns::create(self.opt.latency / 2)?),
            _ => None,
        };
        let cpus = cpus(condition);
        for variant in [("admission", None), ("none", Some(NO_ADMISSION))] {
            self.variant(condition, netns.as_ref(), &cpus, variant, rec)
                .await?;
        }
        push_ratios(rec, condition);
        let note = netns.as_ref().filter(|netns| !netns.netem).map(|_| {
            format!(
                "storm: latency emulated by the swarm ({:?} round trip, half each way on its \
                 connections' bytes; the TCP handshake not delayed): this kernel has no netem",
                self.opt.latency
            )
        });
        drop(netns);
        Ok(note)
    }

    /// One variant (`extra`: the server's flag that turns admission off)
    /// on a fresh server: a cold storm, then a restart storm; their rows.
    async fn variant(
        &self,
        condition: Condition,
        netns: Option<&Netns>,
        (server_cpus, swarm_cpus): &(String, String),
        (variant, extra): (&str, Option<&str>),
        rec: &mut Recorder,
    ) -> anyhow::Result<()> {
        let label = format!("{condition:?}-{variant}").to_lowercase();
        eprintln!(
            "storm {label}: {} grpc-go agents; server on CPUs {server_cpus}, swarm on \
             {swarm_cpus}; load {}",
            self.opt.agents,
            load()
        );
        let (agent_port, health_port) = system::free_ports()?;
        let listen = netns.map_or(Ipv4Addr::LOCALHOST, |netns| netns.host_ip);
        let mut server = self.server(
            &label,
            listen,
            (agent_port, health_port),
            server_cpus,
            extra,
        );
        server.start().await?;
        let swarm_argv = self.swarm_argv(netns, listen, agent_port, swarm_cpus);

        // Cold: every agent at once.
        let began = Instant::now();
        let server_cpu = server.cpu()?;
        let mut swarm = Swarm::start(&swarm_argv, self.dir.join(format!("storm-{label}.log")))?;
        let cold = self
            .storm(
                (&mut server, &mut swarm),
                began,
                (&label, "cold start"),
                (0, (server_cpu, 0.0)),
            )
            .await?;

        // Restart: SIGKILL, started again at once on the same port.
        server.kill();
        let began = Instant::now();
        let swarm_cpu = swarm.cpu()?;
        server.start().await?;
        // A fresh process: all its counts and its CPU are the restart's.
        let restart = self
            .storm(
                (&mut server, &mut swarm),
                began,
                (&label, "restart"),
                (cold.failed, (0.0, swarm_cpu)),
            )
            .await?;
        let v = usize::from(extra.is_some());
        for (phase, storm) in [cold, restart].iter().enumerate() {
            let [time, thrown, failed] = report::STORM[condition.index()][phase][v];
            rec.push(time, Route::Grpc, 0, storm.took.map(|t| t.as_secs_f64()));
            rec.push(thrown, Route::Grpc, 0, Some(storm.thrown));
            rec.push(failed, Route::Grpc, 0, Some(storm.failed as f64));
        }
        drop(swarm);
        drop(server);
        Ok(())
    }

    /// The server (not started yet) listening for agents on
    /// `listen:agent_port`, on CPUs `cpus`, with `extra` added.
    fn server(
        &self,
        label: &str,
        listen: Ipv4Addr,
        (agent_port, health_port): (u16, u16),
        cpus: &str,
        extra: Option<&str>,
    ) -> Server {
        let uds = self.dir.join(format!("storm-{agent_port}.sock"));
        let client_ca = self.agent_pki.join("agent-ca.crt");
        let mut args = [
            &self.bins.extra[..],
            &system::server_args(&self.pki, "grpc", &uds, agent_port, health_port),
        ]
        .concat();
        for arg in &mut args {
            if arg.starts_with("--agent-bind-address=") {
                *arg = format!("--agent-bind-address={listen}");
            } else if arg.starts_with("--cluster-ca-cert=") {
                *arg = format!("--cluster-ca-cert={}", client_ca.display());
            }
        }
        args.extend(extra.map(str::to_owned));
        Server {
            process: None,
            argv: [
                vec!["-c".to_owned(), cpus.to_owned()],
                vec![self.bins.server.display().to_string()],
                args,
            ]
            .concat(),
            dir: self.dir.to_owned(),
            label: label.to_owned(),
            starts: 0,
            health: SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), health_port),
        }
    }

    /// The swarm's command: in `netns` if given, on CPUs `cpus`, its
    /// agents dialing `listen:agent_port`.
    fn swarm_argv(
        &self,
        netns: Option<&Netns>,
        listen: Ipv4Addr,
        agent_port: u16,
        cpus: &str,
    ) -> Vec<String> {
        let file = |name: &str| self.pki.join(name).display().to_string();
        // Without netem the swarm delays its own connections' bytes.
        let emulated = netns
            .filter(|netns| !netns.netem)
            .map(|_| format!("-latency={}ms", self.opt.latency.as_millis()));
        [
            netns.map(Netns::exec).unwrap_or_default(),
            vec!["taskset".to_owned(), "-c".to_owned(), cpus.to_owned()],
            vec![
                self.opt.go_agents.path.display().to_string(),
                format!("-addr={listen}:{agent_port}"),
                format!("-ca={}", file("agent-ca.crt")),
                format!("-cert={}", self.agent_pki.join("proxy-agent.crt").display()),
                format!("-key={}", self.agent_pki.join("proxy-agent.key").display()),
                format!("-count={}", self.opt.agents),
            ],
            emulated.into_iter().collect(),
        ]
        .concat()
    }

    /// Waits for every agent from `began`, reads what the server threw
    /// away and logs the storm; `failed_before`: the swarm's failures
    /// before it, `cpu_before`: the CPU seconds the server and the swarm
    /// had used before it.
    async fn storm(
        &self,
        (server, swarm): (&mut Server, &mut Swarm),
        began: Instant,
        (label, phase): (&str, &str),
        (failed_before, cpu_before): (u64, (f64, f64)),
    ) -> anyhow::Result<Storm> {
        let took = until_connected(server, swarm, self.opt.agents, began, self.opt.limit).await?;
        let cpu = (server.cpu()? - cpu_before.0, swarm.cpu()? - cpu_before.1);
        let (thrown, summary) = drops(&server.scrape().await?);
        let storm = Storm {
            took,
            thrown,
            failed: swarm.counts().failures - failed_before,
            cpu,
        };
        report_storm(
            (label, phase),
            (&storm, self.opt.agents),
            &summary,
            swarm.counts(),
        );
        Ok(storm)
    }
}

/// Writes the server's PKI, an RSA-2048 CA (kubeadm's) signing a leaf of
/// `server_keys`, and the agents' (ECDSA P-256) under `dir`; returns their
/// directories.
fn write_pkis(dir: &Path, server_keys: certs::KeyAlgorithm) -> anyhow::Result<(PathBuf, PathBuf)> {
    use certs::KeyAlgorithm::{EcdsaP256, Rsa2048};
    let (pki, agent_pki) = (dir.join("storm-pki"), dir.join("storm-agent-pki"));
    for (path, (cas, leaves)) in [
        (&pki, (Rsa2048, server_keys)),
        (&agent_pki, (EcdsaP256, EcdsaP256)),
    ] {
        certs::ClusterPki::generate_with_leaves(&[], cas, leaves)
            .context("generating the storm scenario's certificates")?
            .write_to(path)
            .context("writing the storm scenario's certificates")?;
    }
    Ok((pki, agent_pki))
}

/// The ratio rows of `condition`: time without admission / time with it,
/// per phase.
fn push_ratios(rec: &mut Recorder, condition: Condition) {
    for phase in 0..2 {
        let [with, none] = [0, 1].map(|v| {
            rec.get(
                report::STORM[condition.index()][phase][v][0],
                Route::Grpc,
                0,
            )
        });
        let ratio = with.zip(none).map(|(with, none)| none / with);
        rec.push(
            report::STORM_RATIO[condition.index()][phase],
            Route::Grpc,
            0,
            ratio,
        );
    }
}

/// The report's note on how the storms ran.
fn note(opt: &StormOpt) -> String {
    format!(
        "storm: {} grpc-go agents (tests/go/agents: ANP's way, a TLS connection each with no \
         session cache, one Connect stream, a retry 1-2 s after a failure), the server's leaf \
         {:?} under an RSA-2048 CA, the agents' client certificates ECDSA P-256; per condition and variant a fresh server: cold = from the \
         swarm's start until the server counts all N; restart = from SIGKILL, the server \
         started again at once on the same port, until it counts all N again; thrown away = \
         tls_handshakes_dropped_total for stalled, timeout, failed (after the server signed); \
         none = --max-tls-handshakes at its largest (no cap, every handshake taken up at once); idle: server and swarm on separate CPUs; \
         shared: the swarm on the server's CPUs; latency: as idle, {:?} added to every round \
         trip (netem, half each way, network namespace); limit {:?} per storm (n/a: not all \
         connected by then)",
        opt.agents, opt.key_algorithm, opt.latency, opt.limit
    )
}

/// Logs one storm: its time, what was thrown away, and where the CPU went.
fn report_storm(
    (label, phase): (&str, &str),
    (storm, agents): (&Storm, usize),
    drops: &str,
    swarm: SwarmCounts,
) {
    let (server_cpu, swarm_cpu) = storm.cpu;
    eprintln!(
        "storm {label} {phase}: {}; server CPU {server_cpu:.2} s ({:.3} ms an agent), swarm \
         CPU {swarm_cpu:.2} s; thrown away after signing {}; swarm: {} attempts, {} failed; \
         server drops: {}; load {}",
        storm
            .took
            .map_or("not all connected".to_owned(), |t| format!(
                "all connected in {:.2} s",
                t.as_secs_f64()
            )),
        server_cpu * 1e3 / agents.max(1) as f64,
        storm.thrown,
        swarm.attempts,
        swarm.failures,
        if drops.is_empty() { "none" } else { drops },
        load()
    );
}

#[cfg(test)]
mod tests {
    use rustls_pki_types::{CertificateDer, pem::PemObject as _};
    use x509_parser::{oid_registry, prelude::FromDer as _};

    use super::*;

    /// The OID of the public key in the PEM certificate at `path`.
    fn key_oid(path: &Path) -> String {
        let der = CertificateDer::from_pem_file(path).unwrap();
        let (_, cert) = x509_parser::certificate::X509Certificate::from_der(&der).unwrap();
        cert.public_key().algorithm.algorithm.to_id_string()
    }

    #[test]
    fn the_storm_servers_leaf_is_of_the_key_asked_for_under_an_rsa_ca_and_the_agents_stay_ecdsa() {
        for (asked, oid) in [
            (
                certs::KeyAlgorithm::Rsa2048,
                oid_registry::OID_PKCS1_RSAENCRYPTION,
            ),
            (
                certs::KeyAlgorithm::EcdsaP256,
                oid_registry::OID_KEY_TYPE_EC_PUBLIC_KEY,
            ),
        ] {
            let dir = tempfile::tempdir().unwrap();
            let (pki, agent_pki) = write_pkis(dir.path(), asked).unwrap();
            assert_eq!(
                key_oid(&pki.join("agent-ca.crt")),
                oid_registry::OID_PKCS1_RSAENCRYPTION.to_id_string(),
                "the CA the swarm trusts is RSA-2048, as kubeadm's"
            );
            assert_eq!(
                key_oid(&pki.join("cluster.crt")),
                oid.to_id_string(),
                "{asked:?}"
            );
            assert_eq!(
                key_oid(&agent_pki.join("proxy-agent.crt")),
                oid_registry::OID_KEY_TYPE_EC_PUBLIC_KEY.to_id_string(),
                "the agents' keys with a server of {asked:?}"
            );
        }
    }
}
