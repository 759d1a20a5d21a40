//! The real binaries as child processes: [`Binary`] names the two an
//! operator deploys, [`binary`] builds and finds them, [`AgentProcess`]
//! runs proxy-agent, [`LoggedProcess`] collects what a child logs,
//! [`signal`] sends it signals.

use std::{
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{Arc, OnceLock},
    time::{Duration, Instant},
};

use clap::CommandFactory;

use crate::{DEADLINE, Pki, TestServer};

/// One of the two binaries an operator deploys.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Binary {
    /// `proxy-server`.
    Server,
    /// `proxy-agent`.
    Agent,
}

impl Binary {
    /// Its name: argv[0], its file in the target directory ([`binary`]),
    /// what a manifest's `image:` or `command:` mentions.
    pub fn name(self) -> &'static str {
        match self {
            Self::Server => "proxy-server",
            Self::Agent => "proxy-agent",
        }
    }

    /// Its clap command: every flag it accepts.
    pub fn command(self) -> clap::Command {
        match self {
            Self::Server => proxy_server::config::Args::command(),
            Self::Agent => proxy_agent::config::Args::command(),
        }
    }
}

/// The real `proxy-agent` binary, run as a child process (killed on drop).
pub struct AgentProcess {
    /// The child.
    child: Child,
}

/// Path of a workspace binary, built first (once per test process, for the
/// whole workspace so that features unify as in the normal build) when it
/// is missing or older than the test itself.
pub fn binary(name: &str) -> PathBuf {
    static BUILT: OnceLock<()> = OnceLock::new();
    let exe = std::env::current_exe().expect("test executable path");
    // target/<profile>/deps/<test> → target/<profile>/<name>
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target directory");
    let path = dir.join(name);
    // A binary older than this test was built before the last change to
    // the sources: `cargo nextest run` rebuilds tests, not binaries, and a
    // stale binary would test old code. Cargo decides (a no-op when fresh).
    let modified = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    let stale = match (modified(&path), modified(&exe)) {
        (Some(bin), Some(test)) => bin < test,
        _ => true,
    };
    if stale {
        BUILT.get_or_init(|| {
            let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
            let mut command = Command::new(cargo);
            command.args(["build", "--workspace", "--bins"]);
            // What cargo sets for this test's own crate would look like a
            // changed environment to build scripts that watch it (ring
            // watches CARGO_MANIFEST_DIR) and rebuild them for nothing.
            for (key, _) in std::env::vars_os() {
                let key = key.to_string_lossy();
                if key.starts_with("CARGO_PKG_")
                    || key.starts_with("CARGO_MANIFEST_")
                    || key.starts_with("CARGO_BIN_")
                    || key.starts_with("CARGO_CRATE_")
                    || matches!(
                        &*key,
                        "CARGO_PRIMARY_PACKAGE" | "CARGO_TARGET_TMPDIR" | "OUT_DIR"
                    )
                {
                    command.env_remove(&*key);
                }
            }
            if dir.ends_with("release") {
                command.arg("--release");
            }
            let status = command.status().expect("running cargo build");
            assert!(status.success(), "building the binaries failed");
        });
    }
    assert!(path.exists(), "{} not found", path.display());
    path
}

/// A binary of the last build before flow control v2 (`proxy-server` or
/// `proxy-agent`), which `scripts/test` builds from the `flow-control-v1`
/// tag into `target/v1`.
pub fn v1_binary(name: &str) -> PathBuf {
    let path = crate::workspace().join("target/v1").join(name);
    assert!(
        path.exists(),
        "{} not found: scripts/test builds it (step 3b) from the flow-control-v1 tag \
         (a shallow clone lacks it: `git fetch --depth 1 origin tag flow-control-v1`)",
        path.display()
    );
    path
}

impl AgentProcess {
    /// Starts `proxy-agent` against `server` with the test PKI and waits until
    /// the server sees it.
    pub async fn start(server: &TestServer) -> Self {
        Self::start_with_args(server, &[]).await
    }

    /// [`AgentProcess::start`] with more flags.
    pub async fn start_with_args(server: &TestServer, extra: &[&str]) -> Self {
        let before = server.handle.backend_count();
        let agent = Self::spawn(server.agent_addr.port(), extra);
        server.wait_for_backends(before + 1).await;
        agent
    }

    /// Starts `proxy-agent` against the agent port `port` on 127.0.0.1 with
    /// the test PKI and `extra` flags, without waiting for it to connect.
    pub fn spawn(port: u16, extra: &[&str]) -> Self {
        Self::spawn_binary(&binary("proxy-agent"), port, extra)
    }

    /// [`AgentProcess::spawn`] with another `proxy-agent` binary.
    pub fn spawn_binary(binary: &Path, port: u16, extra: &[&str]) -> Self {
        let child = Command::new(binary)
            .env_remove("HTTPS_PROXY")
            .env_remove("https_proxy")
            .env_remove("ALL_PROXY")
            .env_remove("all_proxy")
            .args(agent_args(Pki::get().dir.path(), port))
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting proxy-agent");
        Self { child }
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends a signal (`TERM`, `INT`, …) with the system's `kill`.
    pub fn signal(&self, name: &str) {
        signal(self.child.id(), name);
    }

    /// Whether the process has exited (reaping it if so).
    pub fn has_exited(&mut self) -> bool {
        self.child.try_wait().expect("checking the child").is_some()
    }

    /// SIGKILLs the process and reaps it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for AgentProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The flags of a test `proxy-agent`: mTLS with the `AGENT_FILES` in
/// `files`, the server at 127.0.0.1:`port`, ephemeral health and admin
/// ports on loopback, quick reconnects.
pub fn agent_args(files: &Path, port: u16) -> Vec<String> {
    vec![
        format!("--ca-cert={}", files.join("agent-ca.crt").display()),
        format!("--agent-cert={}", files.join("proxy-agent.crt").display()),
        format!("--agent-key={}", files.join("proxy-agent.key").display()),
        "--proxy-server-host=127.0.0.1".to_owned(),
        format!("--proxy-server-port={port}"),
        "--health-server-host=127.0.0.1".to_owned(),
        "--health-server-port=0".to_owned(),
        "--admin-server-port=0".to_owned(),
        "--sync-interval=100ms".to_owned(),
        "--sync-interval-cap=1s".to_owned(),
    ]
}

/// Sends the signal `name` (`TERM`, `KILL`, …) to `pid` with the system's `kill`.
pub fn signal(pid: u32, name: &str) {
    let status = Command::new("kill")
        .arg(format!("-{name}"))
        .arg(pid.to_string())
        .status()
        .expect("running kill");
    assert!(status.success(), "kill -{name} {pid} failed");
}

/// A child process whose standard error is collected line by line (for
/// tests that read what a real binary logs); killed when dropped.
pub struct LoggedProcess {
    /// The child.
    child: std::process::Child,
    /// Its standard error so far.
    log: Arc<std::sync::Mutex<Vec<String>>>,
}

impl LoggedProcess {
    /// Spawns `command` (proxy variables removed, and `RUST_LOG` unless the
    /// command sets it; stdout discarded, stderr collected); `name` is for
    /// failure messages.
    pub fn spawn(mut command: Command, name: &str) -> Self {
        use std::io::BufRead;
        if !command.get_envs().any(|(key, _)| key == "RUST_LOG") {
            command.env_remove("RUST_LOG");
        }
        let mut child = command
            .env_remove("HTTPS_PROXY")
            .env_remove("https_proxy")
            .env_remove("ALL_PROXY")
            .env_remove("all_proxy")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("starting {name}: {e}"));
        let log = Arc::new(std::sync::Mutex::new(Vec::new()));
        let stderr = child.stderr.take().expect("piped stderr");
        let sink = log.clone();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stderr)
                .lines()
                .map_while(Result::ok)
            {
                sink.lock().expect("log lock").push(line);
            }
        });
        Self { child, log }
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends a signal (`TERM`, `KILL`, …) with the system's `kill`.
    pub fn signal(&self, name: &str) {
        signal(self.child.id(), name);
    }

    /// Whether the process has exited (reaping it if so).
    pub fn has_exited(&mut self) -> bool {
        self.child.try_wait().expect("checking the child").is_some()
    }

    /// Everything logged so far.
    pub fn lines(&self) -> Vec<String> {
        self.log.lock().expect("log lock").clone()
    }

    /// How many lines contain `needle`.
    pub fn count(&self, needle: &str) -> usize {
        self.lines().iter().filter(|l| l.contains(needle)).count()
    }

    /// The first line containing `needle`.
    pub fn find(&self, needle: &str) -> Option<String> {
        self.lines().into_iter().find(|l| l.contains(needle))
    }

    /// Waits until `needle` has been logged `n` times; returns how long it
    /// took. Panics, with the log, after `limit` or if the process exits.
    pub async fn wait_for(&mut self, needle: &str, n: usize, limit: Duration) -> Duration {
        let start = Instant::now();
        while self.count(needle) < n {
            if let Some(status) = self.child.try_wait().expect("checking the child") {
                panic!(
                    "exited ({status}) before logging {needle:?}: {:#?}",
                    self.lines()
                );
            }
            assert!(
                start.elapsed() < limit,
                "{needle:?} not logged {n} times within {limit:?}: {:#?}",
                self.lines()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        start.elapsed()
    }

    /// The port of the first `<ip>:<port>` after `prefix` in a logged line
    /// (e.g. `agent.addr=Some(127.0.0.1:` for a port the kernel picked).
    pub async fn logged_port(&mut self, prefix: &str) -> u16 {
        self.wait_for(prefix, 1, DEADLINE * 3).await;
        let line = self.find(prefix).expect("the line just waited for");
        line.split(prefix)
            .nth(1)
            .and_then(|rest| {
                rest.split(|c: char| !c.is_ascii_digit())
                    .next()
                    .and_then(|p| p.parse().ok())
            })
            .unwrap_or_else(|| panic!("no port after {prefix:?} in {line:?}"))
    }
}

impl Drop for LoggedProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
