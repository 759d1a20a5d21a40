//! The real `proxy-server` binary as a child process, observed from outside
//! as an operator would: its ports from its log, its gauges from
//! `/metrics`, its memory from `/proc`, its exit after a signal; and many
//! real agents in one `agent-swarm` process.

use std::{
    net::{Ipv4Addr, SocketAddr},
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use crate::{DEADLINE, LoggedProcess, Pki, binary, http_get};

/// `n` real agents (`proxy_agent::Agent`, each its own TLS connection and
/// `Connect` stream) in one `agent-swarm` process, killed on drop.
pub struct AgentSwarm {
    /// The process and its log.
    pub process: LoggedProcess,
}

impl AgentSwarm {
    /// Starts `n` agents numbered from `first` against the agent port `port`
    /// on 127.0.0.1 with the test PKI, ANP's default intervals and `extra`
    /// proxy-agent flags; returns once the process says they are started.
    pub async fn start(port: u16, first: usize, n: usize, extra: &[&str]) -> Self {
        let pki = Pki::get();
        let mut command = Command::new(binary("agent-swarm"));
        command
            .args([
                format!("--agents={n}"),
                format!("--first={first}"),
                "--".to_owned(),
                format!("--ca-cert={}", pki.path("agent-ca.crt").display()),
                format!("--agent-cert={}", pki.path("proxy-agent.crt").display()),
                format!("--agent-key={}", pki.path("proxy-agent.key").display()),
                "--proxy-server-host=127.0.0.1".to_owned(),
                format!("--proxy-server-port={port}"),
            ])
            .args(extra);
        let mut process = LoggedProcess::spawn(command, "agent-swarm");
        process.wait_for("agents started", 1, DEADLINE * 3).await;
        Self { process }
    }
}

/// A real `proxy-agent` with its TLS files (`AGENT_FILES`) in a directory
/// of its own, logging at info; killed on drop.
pub struct AgentWithFiles {
    /// The process and its log.
    pub process: LoggedProcess,
    /// Health listener (`/metrics` too).
    pub health_addr: SocketAddr,
}

impl AgentWithFiles {
    /// Starts it against the agent port `server_port` on 127.0.0.1 with
    /// the files in `dir`; returns once it logged its health port (it may
    /// not be connected yet).
    pub async fn start(dir: &Path, server_port: u16) -> Self {
        Self::start_with(dir, server_port, &[], &[]).await
    }

    /// [`start`](Self::start) with `extra` flags and `env` set in its
    /// environment.
    pub async fn start_with(
        dir: &Path,
        server_port: u16,
        extra: &[String],
        env: &[(&str, &str)],
    ) -> Self {
        let mut command = Command::new(binary("proxy-agent"));
        command
            .env("RUST_LOG", "info")
            .args(crate::agent_args(dir, server_port))
            .args(extra)
            .envs(env.iter().copied());
        let mut process = LoggedProcess::spawn(command, "proxy-agent");
        let port = process.logged_port("health.addr=Some(127.0.0.1:").await;
        Self {
            process,
            health_addr: SocketAddr::from(([127, 0, 0, 1], port)),
        }
    }

    /// The Prometheus text of `/metrics`.
    pub async fn metrics(&self) -> String {
        let (status, text) = http_get(self.health_addr, "/metrics").await;
        assert_eq!(status, 200, "/metrics answered {status}: {text}");
        text
    }
}

/// A `proxy-server` process on loopback, killed on drop.
pub struct ServerProcess {
    /// The process and its log.
    pub process: LoggedProcess,
    /// Agent listener.
    pub agent_addr: SocketAddr,
    /// Health listener (`/metrics` too).
    pub health_addr: SocketAddr,
    /// The frontend socket.
    pub uds: PathBuf,
    /// Holds the socket's directory.
    _dir: tempfile::TempDir,
}

impl ServerProcess {
    /// Starts `proxy-server` with the frontend on a fresh Unix socket, every
    /// TCP port ephemeral on 127.0.0.1, the test PKI, `mode` (`grpc` or
    /// `http-connect`) and `extra` flags; returns once it logged its ports.
    pub async fn start(mode: &str, extra: &[String]) -> Self {
        Self::start_in(Pki::get().dir.path(), mode, extra).await
    }

    /// [`start`](Self::start) with the agent listener's files
    /// (`cluster.crt`, `cluster.key`, `agent-ca.crt`) in `pki` instead of the
    /// test PKI's.
    pub async fn start_in(pki: &Path, mode: &str, extra: &[String]) -> Self {
        Self::start_binary(&binary("proxy-server"), pki, mode, extra).await
    }

    /// [`start_in`](Self::start_in) with another `proxy-server` binary.
    pub async fn start_binary(binary: &Path, pki: &Path, mode: &str, extra: &[String]) -> Self {
        Self::spawn(binary, pki, Ipv4Addr::LOCALHOST, mode, (extra, &[])).await
    }

    /// [`start`](Self::start) with `env` set in its environment.
    pub async fn start_with_env(mode: &str, extra: &[String], env: &[(&str, &str)]) -> Self {
        let pki = Pki::get().dir.path();
        let binary = binary("proxy-server");
        Self::spawn(&binary, pki, Ipv4Addr::LOCALHOST, mode, (extra, env)).await
    }

    /// [`start_in`](Self::start_in) with the agent listener on `agent_ip`
    /// (an address of a network namespace the test made, whose agents
    /// reach it over a veth pair; `pki`'s server certificate must name it).
    pub async fn start_on(pki: &Path, agent_ip: Ipv4Addr, mode: &str, extra: &[String]) -> Self {
        Self::spawn(&binary("proxy-server"), pki, agent_ip, mode, (extra, &[])).await
    }

    async fn spawn(
        binary: &Path,
        pki: &Path,
        agent_ip: Ipv4Addr,
        mode: &str,
        (extra, env): (&[String], &[(&str, &str)]),
    ) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let uds = dir.path().join("konnectivity-server.socket");
        let mut command = Command::new(binary);
        command
            .env("RUST_LOG", "info")
            .args([
                format!("--mode={mode}"),
                format!("--uds-name={}", uds.display()),
                "--server-port=0".to_owned(),
                format!("--cluster-cert={}", pki.join("cluster.crt").display()),
                format!("--cluster-key={}", pki.join("cluster.key").display()),
                format!("--cluster-ca-cert={}", pki.join("agent-ca.crt").display()),
                format!("--agent-bind-address={agent_ip}"),
                "--agent-port=0".to_owned(),
                "--health-bind-address=127.0.0.1".to_owned(),
                "--health-port=0".to_owned(),
                "--admin-bind-address=127.0.0.1".to_owned(),
                "--admin-port=0".to_owned(),
            ])
            .args(extra)
            .envs(env.iter().copied());
        let mut process = LoggedProcess::spawn(command, "proxy-server");
        let agent_port = process
            .logged_port(&format!("agent.addr=Some({agent_ip}:"))
            .await;
        let health_port = process.logged_port("health.addr=Some(127.0.0.1:").await;
        Self {
            process,
            agent_addr: SocketAddr::from((agent_ip, agent_port)),
            health_addr: SocketAddr::from(([127, 0, 0, 1], health_port)),
            uds,
            _dir: dir,
        }
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.process.pid()
    }

    /// The Prometheus text of `/metrics`.
    pub async fn metrics(&self) -> String {
        let (status, text) = http_get(self.health_addr, "/metrics").await;
        assert_eq!(status, 200, "/metrics answered {status}: {text}");
        text
    }

    /// The value of one series (`name{labels}` exactly as exposed, or a
    /// bare name), 0 when the series is not exposed.
    pub async fn metric(&self, series: &str) -> f64 {
        metric_value(&self.metrics().await, series)
    }

    /// Polls `/metrics` until `series` has `value`; panics after `limit`
    /// with the last text.
    pub async fn wait_for_metric(&self, series: &str, value: f64, limit: Duration) {
        self.wait_for_metric_where(series, &format!("{value}"), |v| v == value, limit)
            .await;
    }

    /// Waits until one series (as [`metric`](Self::metric)) is at least
    /// `value`.
    pub async fn wait_for_metric_at_least(&self, series: &str, value: f64, limit: Duration) {
        self.wait_for_metric_where(series, &format!("at least {value}"), |v| v >= value, limit)
            .await;
    }

    async fn wait_for_metric_where(
        &self,
        series: &str,
        wanted: &str,
        done: impl Fn(f64) -> bool,
        limit: Duration,
    ) {
        let start = Instant::now();
        loop {
            let text = self.metrics().await;
            if done(metric_value(&text, series)) {
                return;
            }
            assert!(
                start.elapsed() < limit,
                "{series} is {} after {limit:?}, not {wanted}:\n{text}",
                metric_value(&text, series)
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits until `n` agent streams are connected (`/metrics`).
    pub async fn wait_for_agents(&self, n: usize) {
        self.wait_for_agents_within(n, DEADLINE).await;
    }

    /// [`wait_for_agents`](Self::wait_for_agents) with a longer `limit`.
    pub async fn wait_for_agents_within(&self, n: usize, limit: Duration) {
        self.wait_for_metric(
            "konnectivity_network_proxy_server_grpc_connections{service_method=\"Connect\"}",
            n as f64,
            limit,
        )
        .await;
    }

    /// Resident memory in bytes (`VmRSS`).
    pub fn rss(&self) -> u64 {
        rss_bytes(self.pid())
    }

    /// The most memory it has had resident (`VmHWM`).
    pub fn peak_rss(&self) -> u64 {
        peak_rss_bytes(self.pid())
    }

    /// Sends `SIGTERM` and returns how long the process took to exit;
    /// panics if it is still running after `limit`.
    pub async fn terminate(&mut self, limit: Duration) -> Duration {
        self.process.signal("TERM");
        let start = Instant::now();
        while !self.process.has_exited() {
            assert!(
                start.elapsed() < limit,
                "proxy-server still running {limit:?} after SIGTERM: {:#?}",
                self.process.lines()
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        start.elapsed()
    }
}

/// The value of `series` in Prometheus text, 0 when absent.
pub fn metric_value(text: &str, series: &str) -> f64 {
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .find_map(|line| {
            let (name, value) = line.rsplit_once(' ')?;
            (name == series).then(|| value.parse().ok()).flatten()
        })
        .unwrap_or(0.0)
}

/// `VmHWM` of a process in bytes: the most it was ever resident.
pub fn peak_rss_bytes(pid: u32) -> u64 {
    status_bytes(pid, "VmHWM:")
}

/// `VmRSS` of a process in bytes.
pub fn rss_bytes(pid: u32) -> u64 {
    status_bytes(pid, "VmRSS:")
}

/// A `kB` field of `/proc/PID/status`, in bytes.
fn status_bytes(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_else(|e| panic!("reading /proc/{pid}/status: {e}"));
    status
        .lines()
        .find_map(|line| line.strip_prefix(field))
        .and_then(|rest| {
            rest.trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<u64>()
                .ok()
        })
        .map(|kib| kib * 1024)
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"))
}

/// Waits until the process is stopped (`T` in `/proc/PID/stat`: a
/// `SIGSTOP` took effect).
pub async fn wait_stopped(pid: u32) {
    crate::wait_for("the process to stop", || {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|stat| {
                let (_, after) = stat.rsplit_once(") ")?;
                after.chars().next()
            })
            == Some('T')
    })
    .await;
}
