//! The system under test: a `proxy-server` process and its `proxy-agent`
//! process per mode, on loopback, killed on drop.

use std::{
    fs::File,
    net::{SocketAddr, TcpListener},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::Duration,
};

use anyhow::{Context, bail};
use client::dial::{Dialer, Mode, Transport};

use crate::probe;

/// How long the server may take to have its agent connected.
const READY_DEADLINE: Duration = Duration::from_secs(20);

/// The binaries to run.
#[derive(Debug, Clone)]
pub struct Binaries {
    /// `proxy-server`.
    pub server: PathBuf,
    /// `proxy-agent`.
    pub agent: PathBuf,
    /// `agent-swarm` (the agents scenario), next to this executable.
    pub swarm: PathBuf,
    /// Flags given to both (`--worker-threads=N`).
    pub extra: Vec<String>,
}

impl Binaries {
    /// The given paths, else `proxy-server` and `proxy-agent` next to this
    /// executable; `agent-swarm` beside it too when `swarm` is asked for,
    /// checked now rather than when the agents scenario comes, last.
    ///
    /// # Errors
    /// A binary does not exist; the message says how to build it.
    pub fn locate(
        server: Option<PathBuf>,
        agent: Option<PathBuf>,
        swarm: bool,
    ) -> anyhow::Result<Self> {
        let exe = std::env::current_exe().context("finding the bench executable")?;
        let dir = exe
            .parent()
            .context("the bench executable has no directory")?;
        let found = |given: Option<PathBuf>, name: &str| -> anyhow::Result<PathBuf> {
            let path = given.unwrap_or_else(|| dir.join(name));
            if !path.is_file() {
                bail!(
                    "{} not found; run `cargo build --release --workspace --bins` \
                     (or pass --server-bin/--agent-bin; agent-swarm must be next to bench)",
                    path.display()
                );
            }
            Ok(path)
        };
        Ok(Self {
            server: found(server, "proxy-server")?,
            agent: found(agent, "proxy-agent")?,
            swarm: if swarm {
                found(None, "agent-swarm")?
            } else {
                dir.join("agent-swarm")
            },
            extra: Vec::new(),
        })
    }
}

/// A grpc-go program of `tests/go/<program>` (`scripts/test` builds it):
/// `given` (its `--go-<program>` flag), else `target/go-<program>` beside
/// this executable's `target/<profile>/`.
///
/// # Errors
/// It does not exist; the message says how to build it.
pub fn locate_go(given: Option<PathBuf>, program: &str) -> anyhow::Result<PathBuf> {
    let path = match given {
        Some(path) => path,
        None => std::env::current_exe()
            .context("finding the bench executable")?
            .parent()
            .and_then(Path::parent)
            .context("the bench executable has no target directory")?
            .join(format!("go-{program}")),
    };
    if !path.is_file() {
        bail!(
            "{} not found: `scripts/test` builds it, or `GOPATH=/usr/share/gocode \
             GO111MODULE=off go build -o target/go-{program} ./tests/go/{program}` with \
             Debian's golang-go, golang-google-grpc-dev and golang-google-protobuf-dev \
             (or pass --go-{program})",
            path.display()
        );
    }
    Ok(path)
}

/// A child process killed (SIGKILL) and reaped on drop.
pub struct Process {
    /// The child.
    child: Child,
    /// What it is, for messages.
    name: String,
    /// Its stderr.
    log: PathBuf,
}

impl Process {
    /// Starts `program args`, stdout discarded, stderr to `log`.
    ///
    /// # Errors
    /// The log cannot be created or the program started.
    pub fn spawn(
        name: String,
        program: &Path,
        args: &[String],
        log: PathBuf,
    ) -> anyhow::Result<Self> {
        let stderr = File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let child = Command::new(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .with_context(|| format!("starting {}", program.display()))?;
        Ok(Self { child, name, log })
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends SIGTERM (the first signal of a graceful shutdown).
    ///
    /// # Errors
    /// `kill` cannot be run or fails.
    pub fn terminate(&self) -> anyhow::Result<()> {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .context("running kill")?;
        if !status.success() {
            bail!("kill -TERM {} failed", self.child.id());
        }
        Ok(())
    }

    /// Whether the process has exited (reaping it if so).
    pub fn has_exited(&mut self) -> bool {
        !matches!(self.child.try_wait(), Ok(None))
    }

    /// Its exit status once it has exited (reaping it).
    pub fn exit_status(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// Waits until it has exited (killed already, say) and reaps it, so
    /// that its ports are free.
    pub fn reap(&mut self) {
        let _ = self.child.wait();
    }

    /// Kills it with SIGKILL and reaps it; whether that signal ended it.
    pub fn kill_reaped(mut self) -> bool {
        use std::os::unix::process::ExitStatusExt;
        let _ = self.child.kill();
        matches!(self.child.wait(), Ok(status) if status.signal() == Some(9))
    }

    /// Where its stderr goes.
    pub fn log(&self) -> &Path {
        &self.log
    }

    /// An error if the process has exited, with the end of its log.
    ///
    /// # Errors
    /// It has exited.
    pub fn check_alive(&mut self) -> anyhow::Result<()> {
        if let Some(status) = self.child.try_wait()? {
            let log = std::fs::read_to_string(&self.log).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(20).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            bail!(
                "{} exited ({status}); its log:\n{}",
                self.name,
                tail.join("\n")
            );
        }
        Ok(())
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One proxy-server with one proxy-agent connected, in one mode.
pub struct Deployment {
    /// Frontend protocol.
    pub mode: Mode,
    /// Frontend Unix socket.
    pub uds: PathBuf,
    /// The server's health port (`/readyz`, `/metrics`).
    pub health: SocketAddr,
    /// The server process.
    server: Process,
    /// The agent process.
    agent: Process,
}

impl Deployment {
    /// Starts server and agent with the certificates in `dir` and waits
    /// until the server's `/readyz` answers 200 (its agent is connected).
    ///
    /// # Errors
    /// A process cannot be started, exits, or is not ready within 20 s.
    pub async fn start(bins: &Binaries, dir: &Path, mode: Mode) -> anyhow::Result<Self> {
        let name = match mode {
            Mode::Grpc => "grpc",
            Mode::HttpConnect => "http-connect",
        };
        Self::start_labelled(bins, dir, mode, name, &[]).await
    }

    /// [`Deployment::start`] with its socket and logs named `label` in
    /// `dir` (a second deployment of a mode beside the first), and `agent`
    /// added to the agent's flags.
    ///
    /// # Errors
    /// As [`Deployment::start`].
    pub async fn start_labelled(
        bins: &Binaries,
        dir: &Path,
        mode: Mode,
        label: &str,
        agent: &[String],
    ) -> anyhow::Result<Self> {
        Self::start_with(bins, dir, mode, label, (&[], agent)).await
    }

    /// [`Deployment::start_labelled`] with flags for the server too.
    ///
    /// # Errors
    /// A process cannot be started, or the server is not ready in time.
    pub async fn start_with(
        bins: &Binaries,
        dir: &Path,
        mode: Mode,
        label: &str,
        (server, agent): (&[String], &[String]),
    ) -> anyhow::Result<Self> {
        let name = match mode {
            Mode::Grpc => "grpc",
            Mode::HttpConnect => "http-connect",
        };
        let uds = dir.join(format!("{label}.sock"));
        let (agent_port, health_port) = free_ports()?;
        let server = Process::spawn(
            format!("proxy-server --mode={name}"),
            &bins.server,
            &[
                &bins.extra[..],
                &server_args(dir, name, &uds, agent_port, health_port),
                server,
            ]
            .concat(),
            dir.join(format!("{label}-server.log")),
        )?;
        let agent = Process::spawn(
            format!("proxy-agent of the {label} server"),
            &bins.agent,
            &[
                &bins.extra[..],
                &agent_args(dir, agent_port),
                &["--sync-interval=100ms".to_owned()],
                agent,
            ]
            .concat(),
            dir.join(format!("{label}-agent.log")),
        )?;
        let mut deployment = Self {
            mode,
            uds,
            health: SocketAddr::from(([127, 0, 0, 1], health_port)),
            server,
            agent,
        };
        deployment.wait_ready().await?;
        Ok(deployment)
    }

    /// Polls `/readyz` until 200.
    async fn wait_ready(&mut self) -> anyhow::Result<()> {
        let deadline = tokio::time::Instant::now() + READY_DEADLINE;
        loop {
            self.server.check_alive()?;
            self.agent.check_alive()?;
            if let Ok((200, _)) = probe::http_get(self.health, "/readyz").await {
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                bail!(
                    "{} not ready within {READY_DEADLINE:?} (GET http://{}/readyz); logs in {}",
                    self.server.name,
                    self.health,
                    self.server
                        .log
                        .parent()
                        .map_or(Path::new("?"), |p| p)
                        .display()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Dials through this deployment as kube-apiserver does.
    pub fn dialer(&self) -> Dialer {
        Dialer {
            transport: Transport::Uds(self.uds.clone()),
            mode: self.mode,
        }
    }

    /// Process ids of server and agent.
    pub fn pids(&self) -> Pids {
        Pids {
            server: self.server.child.id(),
            agent: self.agent.child.id(),
        }
    }

    /// An error if server or agent has exited.
    pub fn check_alive(&mut self) -> anyhow::Result<()> {
        self.server.check_alive()?;
        self.agent.check_alive()
    }

    /// Stops both as an operator does and waits until they have exited
    /// (each writes out its audit log first): the agent's first SIGTERM
    /// drains it (it logs `draining`), its second stops it; then the
    /// server's SIGTERM.
    ///
    /// # Errors
    /// A signal cannot be sent, or a process does not exit within
    /// [`READY_DEADLINE`].
    pub async fn stop(&mut self) -> anyhow::Result<()> {
        self.agent.terminate()?;
        let log = self.agent.log().to_owned();
        wait_until(
            |agent: &mut Process| {
                agent.has_exited()
                    || std::fs::read_to_string(&log).is_ok_and(|text| text.contains("draining"))
            },
            &mut self.agent,
            "the agent to drain",
        )
        .await?;
        if !self.agent.has_exited() {
            self.agent.terminate()?;
        }
        wait_until(Process::has_exited, &mut self.agent, "the agent to exit").await?;
        self.server.terminate()?;
        wait_until(Process::has_exited, &mut self.server, "the server to exit").await
    }
}

/// Polls `done` on `process` until it holds, within [`READY_DEADLINE`].
async fn wait_until(
    mut done: impl FnMut(&mut Process) -> bool,
    process: &mut Process,
    what: &str,
) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + READY_DEADLINE;
    while !done(process) {
        if tokio::time::Instant::now() >= deadline {
            bail!("timed out waiting for {what} ({})", process.log().display());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

/// Process ids of a deployment.
#[derive(Debug, Clone, Copy)]
pub struct Pids {
    /// proxy-server.
    pub server: u32,
    /// proxy-agent.
    pub agent: u32,
}

impl Pids {
    /// RSS of (server, agent), in bytes.
    ///
    /// # Errors
    /// A process is gone.
    pub fn rss(&self) -> anyhow::Result<(u64, u64)> {
        Ok((probe::rss(self.server)?, probe::rss(self.agent)?))
    }

    /// Context switches so far of (server, agent).
    ///
    /// # Errors
    /// A process is gone.
    pub fn context_switches(&self) -> anyhow::Result<(u64, u64)> {
        Ok((
            probe::context_switches(self.server)?,
            probe::context_switches(self.agent)?,
        ))
    }

    /// CPU clock ticks of (server, agent).
    ///
    /// # Errors
    /// A process is gone.
    pub fn each_cpu_ticks(&self) -> anyhow::Result<(u64, u64)> {
        Ok((
            probe::cpu_ticks(self.server)?,
            probe::cpu_ticks(self.agent)?,
        ))
    }
}

/// The CPU server and agent spend between [`CpuSpan::start`] and
/// [`CpuSpan::per`].
#[derive(Debug, Clone, Copy)]
pub struct CpuSpan {
    /// The processes.
    pids: Pids,
    /// Their ticks at the start.
    start: (u64, u64),
}

impl CpuSpan {
    /// Starts counting the CPU of `pids`.
    ///
    /// # Errors
    /// A process is gone.
    pub fn start(pids: Pids) -> anyhow::Result<Self> {
        Ok(Self {
            pids,
            start: pids.each_cpu_ticks()?,
        })
    }

    /// CPU per event since the start, in microseconds, for (server, agent);
    /// `None` without events.
    ///
    /// # Errors
    /// A process is gone.
    pub fn per(&self, events: f64) -> anyhow::Result<Option<(f64, f64)>> {
        let now = self.pids.each_cpu_ticks()?;
        let us = |ticks: u64| ticks as f64 / probe::CLOCK_TICKS_PER_SEC * 1e6 / events;
        Ok((events > 0.0).then(|| {
            (
                us(now.0.saturating_sub(self.start.0)),
                us(now.1.saturating_sub(self.start.1)),
            )
        }))
    }
}

/// proxy-server's flags in `mode` (`grpc`, `http-connect`) with the
/// certificates in `dir`, the frontend on `uds`, the agent and health ports
/// given, quiet logs.
pub fn server_args(
    dir: &Path,
    mode: &str,
    uds: &Path,
    agent_port: u16,
    health_port: u16,
) -> Vec<String> {
    let file = |f: &str| dir.join(f).display().to_string();
    vec![
        format!("--mode={mode}"),
        format!("--uds-name={}", uds.display()),
        "--server-port=0".to_owned(),
        format!("--cluster-cert={}", file("cluster.crt")),
        format!("--cluster-key={}", file("cluster.key")),
        format!("--cluster-ca-cert={}", file("agent-ca.crt")),
        "--agent-bind-address=127.0.0.1".to_owned(),
        format!("--agent-port={agent_port}"),
        "--health-bind-address=127.0.0.1".to_owned(),
        format!("--health-port={health_port}"),
        "--admin-port=0".to_owned(),
        "--v=0".to_owned(),
    ]
}

/// proxy-agent's flags towards the server's `agent_port`, with the
/// certificates in `dir`, ephemeral health and admin ports, quiet logs.
pub fn agent_args(dir: &Path, agent_port: u16) -> Vec<String> {
    let file = |f: &str| dir.join(f).display().to_string();
    vec![
        format!("--ca-cert={}", file("agent-ca.crt")),
        format!("--agent-cert={}", file("proxy-agent.crt")),
        format!("--agent-key={}", file("proxy-agent.key")),
        "--proxy-server-host=127.0.0.1".to_owned(),
        format!("--proxy-server-port={agent_port}"),
        "--health-server-host=127.0.0.1".to_owned(),
        "--health-server-port=0".to_owned(),
        "--admin-server-port=0".to_owned(),
        "--v=0".to_owned(),
    ]
}

/// Two distinct free ports (agent, health).
///
/// # Errors
/// No free port.
pub fn free_ports() -> anyhow::Result<(u16, u16)> {
    let first = free_port()?;
    let mut second = free_port()?;
    while second == first {
        second = free_port()?;
    }
    Ok((first, second))
}

/// A currently free loopback port that proxy-server accepts: ANP's port
/// checks refuse ports above 49151, which the kernel's ephemeral range
/// (bind to port 0) often hands out, so those are skipped.
fn free_port() -> anyhow::Result<u16> {
    for _ in 0..1000 {
        let port = TcpListener::bind("127.0.0.1:0")
            .context("binding 127.0.0.1:0 to find a free port")?
            .local_addr()?
            .port();
        if (1024..=49151).contains(&port) {
            return Ok(port);
        }
    }
    bail!("no free loopback port in 1024..=49151")
}

/// `PATH` with the sbin directories, where `ip`, `tc` and `nft` live.
pub fn path_with_sbin() -> String {
    format!(
        "{}:/usr/sbin:/sbin",
        std::env::var("PATH").unwrap_or_default()
    )
}

/// Runs `program args` to its end; its stdout, or an error with its stderr.
pub fn tool(program: &str, args: &[&str]) -> anyhow::Result<String> {
    let out = std::process::Command::new(program)
        .args(args)
        .env("PATH", path_with_sbin())
        .output()
        .with_context(|| format!("running {program}"))?;
    if !out.status.success() {
        bail!(
            "{program} {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
