//! Harness of the end-to-end tests: a proxy-server, proxy-agents and
//! destinations (node-side servers) on loopback with ephemeral ports, each
//! a handle that shuts down on drop, with readiness awaited (never slept
//! for).
//!
//! # Layout
//! - [`Pki`]: certificates made fresh for the test process.
//! - [`TestServer`], [`TestAgent`], [`AgentProcess`]: the proxies.
//! - [`process`]: the real `proxy-server` binary, observed from outside.
//! - [`destination`]: node-side servers the agent dials (echo, bulk,
//!   blackhole); ANP's "backend" is an agent stream, as in the server.
//! - [`grpc_go`]: `tests/go/frontend`, the grpc-go frontend (kube-apiserver's
//!   gRPC client).
//! - [`kube_stub`]: a TokenReview API stand-in with its kubeconfig.
//! - [`lease_stub`]: a coordination.k8s.io/v1 Lease API stand-in.
//! - [`proxies`]: real SOCKS5 and HTTP CONNECT proxies (microsocks, tinyproxy).
//! - [`python`]: `tests/python/frontend.py`, the grpcio and standard-library
//!   frontend.
//! - [`RawFrontend`]: a frontend that sends packets by hand.
//! - [`wait_for`]: polls a condition until a deadline.
//! - [`http_get`], [`http_request`], [`wait_for_status`]: raw HTTP/1.1 to
//!   the health and admin ports.

pub mod destination;
pub mod grpc_go;
pub mod kube_stub;
pub mod lease_stub;
pub mod process;
pub mod proxies;
pub mod python;

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{Arc, OnceLock},
    time::{Duration, Instant},
};

use client::dial::{TunnelConn, dial, uds_channel};
use ops::tls;
use proto::{Packet, proxy_service_client::ProxyServiceClient};
use proxy_agent::agent::{Agent, AgentHandle};
use proxy_server::{
    config::{Config, FrontendListen, Mode},
    server::{ProxyServer, ServerHandle},
    strategy::ProxyStrategy,
};
use tokio::{sync::mpsc, task::JoinHandle};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Streaming, transport::Channel};
use tunnel::ids::{AgentId, ServerId};

/// How long readiness and cleanup conditions may take before a test fails.
pub const DEADLINE: Duration = Duration::from_secs(10);

/// Installs a test subscriber (once); `RUST_LOG` picks the level.
pub fn trace_init() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_test_writer()
        .try_init();
}

/// Polls `condition` every few milliseconds until it holds; panics with
/// `what` after [`DEADLINE`].
pub async fn wait_for(what: &str, mut condition: impl FnMut() -> bool) {
    let start = Instant::now();
    while !condition() {
        assert!(start.elapsed() < DEADLINE, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Certificates for one test process, written to a temporary directory.
pub struct Pki {
    /// Where the files are.
    pub dir: tempfile::TempDir,
}

impl Pki {
    /// The process-wide PKI (made once).
    pub fn get() -> &'static Self {
        static PKI: OnceLock<Pki> = OnceLock::new();
        PKI.get_or_init(Self::make)
    }

    /// A fresh PKI in a new temporary directory.
    fn make() -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        certs::ClusterPki::generate(&[])
            .expect("generating certificates")
            .write_to(dir.path())
            .expect("writing certificates");
        Self { dir }
    }

    /// Path of a file written by `make-certs` (`cluster.crt`, `agent-ca.crt`, …).
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// A second, unrelated PKI (for "wrong CA" tests).
    pub fn other() -> &'static Self {
        static PKI: OnceLock<Pki> = OnceLock::new();
        PKI.get_or_init(Self::make)
    }
}

/// A stopped [`TestServer`] (see [`TestServer::halt`]).
pub struct Halted {
    /// Its options, with its agent port.
    opts: ServerOpts,
    /// Its socket's directory.
    dir: Arc<tempfile::TempDir>,
}

impl Halted {
    /// Starts it again on the same agent port and socket.
    pub async fn start(self) -> TestServer {
        TestServer::start_in(self.opts, self.dir).await
    }
}

/// Options of a [`TestServer`].
#[derive(Clone)]
pub struct ServerOpts {
    /// Agent port; 0 picks one.
    pub agent_port: u16,
    /// Require agent client certificates.
    pub mtls: bool,
    /// `--backend-dial-timeout`.
    pub backend_dial_timeout: Option<Duration>,
    /// `--proxy-strategies`.
    pub strategies: Vec<ProxyStrategy>,
    /// Serve the frontend on mTLS TCP instead of a Unix socket.
    pub tcp_frontend: bool,
    /// Frontend protocol.
    pub mode: Mode,
    /// Offer per-connection flow control to agents.
    pub flow_control: bool,
    /// Service-account token authentication (turns mTLS off, as ANP).
    pub token_auth: Option<proxy_server::auth::TokenAuthConfig>,
    /// `--graceful-shutdown-timeout`.
    pub graceful_shutdown_timeout: Option<Duration>,
    /// `--server-id` (default `test-server`).
    pub server_id: Option<String>,
    /// `--server-count`.
    pub server_count: u32,
    /// `--keepalive-time` on the agent listener (default 1 h).
    pub keepalive_time: Option<Duration>,
    /// `--enable-lease-controller` and its settings.
    pub lease: Option<proxy_server::lease::LeaseConfig>,
    /// `--enable-profiling`.
    pub profiling: bool,
    /// `--max-tls-handshakes`.
    pub max_tls_handshakes: usize,
    /// `--frontend-stall-timeout`.
    pub frontend_stall_timeout: Option<Duration>,
}

impl Default for ServerOpts {
    fn default() -> Self {
        Self {
            agent_port: 0,
            mtls: true,
            backend_dial_timeout: None,
            strategies: vec![ProxyStrategy::Default],
            tcp_frontend: false,
            mode: Mode::Grpc,
            flow_control: true,
            graceful_shutdown_timeout: None,
            token_auth: None,
            server_id: None,
            server_count: 1,
            keepalive_time: None,
            lease: None,
            profiling: false,
            max_tls_handshakes: 8192,
            frontend_stall_timeout: Some(Duration::from_secs(300)),
        }
    }
}

/// An in-process proxy-server.
pub struct TestServer {
    /// Observes the server.
    pub handle: ServerHandle,
    /// Agent listener.
    pub agent_addr: SocketAddr,
    /// Health listener.
    pub health_addr: SocketAddr,
    /// Admin listener.
    pub admin_addr: SocketAddr,
    /// Frontend socket (UDS mode).
    pub uds: PathBuf,
    /// Frontend TCP address (TCP mode).
    pub frontend_tcp: Option<SocketAddr>,
    /// Frontend protocol.
    pub mode: Mode,
    /// What it was started with.
    opts: ServerOpts,
    /// Stops the server.
    shutdown: CancellationToken,
    /// The serving task.
    task: Option<JoinHandle<()>>,
    /// Holds the socket's directory.
    _dir: Arc<tempfile::TempDir>,
}

impl TestServer {
    /// Starts a server with default options.
    pub async fn start() -> Self {
        Self::start_with(ServerOpts::default()).await
    }

    /// Starts a server; returns once its listeners are bound.
    pub async fn start_with(opts: ServerOpts) -> Self {
        Self::start_in(opts, Arc::new(tempfile::tempdir().expect("temp dir"))).await
    }

    async fn start_in(opts: ServerOpts, dir: Arc<tempfile::TempDir>) -> Self {
        trace_init();
        let pki = Pki::get();
        let uds = dir.path().join("konnectivity-server.socket");
        let frontend = if opts.tcp_frontend {
            FrontendListen::Tcp {
                addr: "127.0.0.1:0".parse().expect("address"),
                tls: tls::server_config_with_alpn(
                    &pki.path("proxy-frontend.crt"),
                    &pki.path("proxy-frontend.key"),
                    Some(&pki.path("frontend-ca.crt")),
                    &[match opts.mode {
                        Mode::Grpc => tls::ALPN_H2,
                        Mode::HttpConnect => tls::ALPN_HTTP11,
                    }],
                )
                .expect("frontend TLS"),
            }
        } else {
            FrontendListen::Uds {
                path: uds.clone(),
                delete_existing: true,
            }
        };
        let config = Config {
            mode: opts.mode,
            frontend,
            agent_addr: SocketAddr::from(([127, 0, 0, 1], opts.agent_port)),
            agent_tls: tls::server_config(
                &pki.path("cluster.crt"),
                &pki.path("cluster.key"),
                opts.mtls.then(|| pki.path("agent-ca.crt")).as_deref(),
            )
            .expect("agent TLS"),
            health_addr: "127.0.0.1:0".parse().expect("address"),
            admin_addr: "127.0.0.1:0".parse().expect("address"),
            profiling: opts.profiling,
            server_id: ServerId(
                opts.server_id
                    .clone()
                    .unwrap_or_else(|| "test-server".to_owned()),
            ),
            server_count: opts.server_count,
            strategies: opts.strategies.clone(),
            max_agent_queue_bytes: 4 << 20,
            max_tls_handshakes: opts.max_tls_handshakes,
            max_http_connections: 65_536,
            frontend_stall_timeout: opts.frontend_stall_timeout,
            keepalive_time: opts.keepalive_time.unwrap_or(Duration::from_secs(3600)),
            frontend_keepalive_time: Duration::from_secs(3600),
            backend_dial_timeout: opts.backend_dial_timeout,
            flow_control: opts.flow_control,
            graceful_shutdown_timeout: opts.graceful_shutdown_timeout,
            token_auth: opts.token_auth.clone(),
            lease: opts.lease.clone(),
            not_implemented: Vec::new(),
            deprecated: Vec::new(),
        };
        let bound = ProxyServer::bind(config).await.expect("binding the server");
        let shutdown = CancellationToken::new();
        let handle = bound.handle();
        let agent_addr = bound.agent_addr();
        let health_addr = bound.health_addr();
        let admin_addr = bound.admin_addr();
        let frontend_tcp = match bound.frontend_addr() {
            proxy_server::server::FrontendAddr::Tcp(addr) => Some(addr),
            proxy_server::server::FrontendAddr::Uds(_) => None,
        };
        let token = shutdown.clone();
        let task = tokio::spawn(async move {
            bound
                .serve(token.cancelled_owned())
                .await
                .expect("server failed");
        });
        Self {
            handle,
            agent_addr,
            health_addr,
            admin_addr,
            uds,
            frontend_tcp,
            mode: opts.mode,
            opts,
            shutdown,
            task: Some(task),
            _dir: dir,
        }
    }

    /// Stops the server and waits until it has stopped.
    pub async fn stop(mut self) {
        self.shutdown.cancel();
        if let Some(task) = self.task.take() {
            task.await.expect("server task");
        }
    }

    /// Starts stopping the server (its first signal) without waiting.
    pub fn begin_shutdown(&self) {
        self.shutdown.cancel();
    }

    /// Whether the server has finished stopping.
    pub fn has_stopped(&self) -> bool {
        self.task.as_ref().is_none_or(JoinHandle::is_finished)
    }

    /// Stops the server and starts a new one with the same options on the
    /// same agent port and socket.
    pub async fn restart(self) -> Self {
        self.halt().await.start().await
    }

    /// Stops the server, keeping what it needs to start again on the same
    /// agent port and socket.
    pub async fn halt(mut self) -> Halted {
        let opts = ServerOpts {
            agent_port: self.agent_addr.port(),
            ..self.opts.clone()
        };
        let dir = self._dir.clone();
        self.shutdown.cancel();
        if let Some(task) = self.task.take() {
            task.await.expect("server task");
        }
        Halted { opts, dir }
    }

    /// A fresh gRPC channel on a new frontend connection (what
    /// kube-apiserver's single-use tunnel does).
    pub async fn channel(&self) -> Channel {
        match self.frontend_tcp {
            Some(addr) => {
                client::dial::tls_channel(addr, "localhost", frontend_client_tls(Pki::get()))
                    .await
                    .expect("connecting to the TCP frontend")
            }
            None => uds_channel(&self.uds)
                .await
                .expect("connecting to the frontend"),
        }
    }

    /// A dialer for this server's frontend (mode and transport), with the
    /// test PKI's frontend client certificate.
    pub fn dialer(&self) -> client::dial::Dialer {
        let transport = match self.frontend_tcp {
            Some(addr) => client::dial::Transport::Tls {
                addr,
                server_name: "localhost".to_owned(),
                tls: frontend_client_tls(Pki::get()),
            },
            None => client::dial::Transport::Uds(self.uds.clone()),
        };
        client::dial::Dialer {
            transport,
            mode: match self.mode {
                Mode::Grpc => client::dial::Mode::Grpc,
                Mode::HttpConnect => client::dial::Mode::HttpConnect,
            },
        }
    }

    /// Dials `address` through the tunnel on a fresh frontend connection.
    pub async fn dial(&self, address: &str) -> Result<TunnelConn, client::dial::ClientError> {
        dial(self.channel().await, address).await
    }

    /// Waits until `n` agent streams are connected.
    pub async fn wait_for_backends(&self, n: usize) {
        let handle = self.handle.clone();
        wait_for(&format!("{n} agent(s) connected"), || {
            handle.backend_count() == n
        })
        .await;
    }

    /// Waits until no dial is pending and no connection is established.
    pub async fn wait_idle(&self) {
        let handle = self.handle.clone();
        wait_for("server to have no pending dial or connection", || {
            handle.pending_dials() == 0 && handle.established_connections() == 0
        })
        .await;
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// TLS for a frontend client: trusts the test frontend CA and presents the
/// client certificate of `pki` (another PKI's to test refusal).
pub fn frontend_client_tls(pki: &Pki) -> Arc<rustls::ClientConfig> {
    tls::client_config(
        &Pki::get().path("frontend-ca.crt"),
        Some((&pki.path("proxy-client.crt"), &pki.path("proxy-client.key"))),
        &[],
    )
    .expect("frontend client TLS")
}

/// Options of a [`TestAgent`].
#[derive(Clone, Default)]
pub struct AgentOpts {
    /// `--agent-id` (default: a fresh one).
    pub agent_id: Option<String>,
    /// `--agent-identifiers`.
    pub identifiers: String,
    /// Present no client certificate.
    pub no_client_cert: bool,
    /// Use the other PKI (wrong CA for the server).
    pub foreign_pki: bool,
    /// Do not offer per-connection flow control (behave like an ANP agent).
    pub no_flow_control: bool,
    /// `--service-account-token-path`.
    pub token_path: Option<PathBuf>,
    /// `--proxy-url`.
    pub proxy: Option<tunnel::proxy_client::Proxy>,
    /// More `--proxy-server-host` entries after the first address.
    pub more_servers: Vec<SocketAddr>,
    /// `--keepalive-time` (default 1 h).
    pub keepalive_time: Option<Duration>,
    /// `--count-server-leases` and where.
    pub leases: Option<proxy_agent::config::LeaseCountConfig>,
    /// `--server-count-source`.
    pub server_count_source: proxy_agent::config::ServerCountSource,
    /// `--sync-forever`.
    pub sync_forever: bool,
    /// `--enable-profiling`.
    pub profiling: bool,
    /// `--exit-when-drained`.
    pub exit_when_drained: bool,
}

/// An in-process proxy-agent.
pub struct TestAgent {
    /// Observes the agent.
    pub handle: AgentHandle,
    /// Health listener.
    pub health_addr: SocketAddr,
    /// Admin listener.
    pub admin_addr: SocketAddr,
    /// Stops the agent.
    shutdown: CancellationToken,
    /// The serving task.
    task: Option<JoinHandle<()>>,
}

/// The agent configuration the tests use against `agent_addr`.
pub fn agent_config(agent_addr: SocketAddr, opts: &AgentOpts) -> proxy_agent::config::Config {
    let pki = if opts.foreign_pki {
        Pki::other()
    } else {
        Pki::get()
    };
    let tls = tls::client_config(
        &Pki::get().path("agent-ca.crt"),
        (!opts.no_client_cert)
            .then(|| (pki.path("proxy-agent.crt"), pki.path("proxy-agent.key")))
            .as_ref()
            .map(|(c, k)| (c.as_path(), k.as_path())),
        &[],
    )
    .expect("agent TLS");
    let servers = std::iter::once(agent_addr)
        .chain(opts.more_servers.iter().copied())
        .map(|addr| proxy_agent::config::ServerAddr {
            proxy: opts.proxy.clone(),
            ..proxy_agent::config::ServerAddr::new(addr.ip().to_string(), addr.port())
        })
        .collect();
    proxy_agent::config::Config {
        servers,
        tls,
        agent_id: AgentId(
            opts.agent_id
                .clone()
                .unwrap_or_else(|| format!("agent-{}", fastrand_id())),
        ),
        agent_identifiers: opts.identifiers.clone(),
        health_addr: "127.0.0.1:0".parse().expect("address"),
        admin_addr: "127.0.0.1:0".parse().expect("address"),
        profiling: opts.profiling,
        sync_interval: Duration::from_millis(100),
        sync_interval_cap: Duration::from_secs(1),
        sync_forever: opts.sync_forever,
        probe_interval: Duration::from_millis(100),
        keepalive_time: opts.keepalive_time.unwrap_or(Duration::from_secs(3600)),
        flow_control: !opts.no_flow_control,
        exit_when_drained: opts.exit_when_drained,
        max_server_queue_bytes: 4 << 20,
        token_path: opts.token_path.clone(),
        leases: opts.leases.clone(),
        server_count_source: opts.server_count_source,
        not_implemented: Vec::new(),
        deprecated: Vec::new(),
    }
}

fn fastrand_id() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(1);
    u64::from(std::process::id()) << 20 | NEXT.fetch_add(1, Ordering::Relaxed)
}

impl TestAgent {
    /// Starts an agent for `server` and waits until the server sees it.
    pub async fn start(server: &TestServer) -> Self {
        let before = server.handle.backend_count();
        let agent = Self::start_with(server.agent_addr, AgentOpts::default()).await;
        server.wait_for_backends(before + 1).await;
        agent
    }

    /// Starts an agent against `agent_addr`; returns once it is bound (it
    /// may not be connected yet).
    pub async fn start_with(agent_addr: SocketAddr, opts: AgentOpts) -> Self {
        trace_init();
        let bound = Agent::bind(agent_config(agent_addr, &opts))
            .await
            .expect("binding the agent");
        let shutdown = CancellationToken::new();
        let handle = bound.handle();
        let health_addr = bound.health_addr();
        let admin_addr = bound.admin_addr();
        let token = shutdown.clone();
        let task = tokio::spawn(async move { bound.serve(token.cancelled_owned()).await });
        Self {
            handle,
            health_addr,
            admin_addr,
            shutdown,
            task: Some(task),
        }
    }

    /// Starts an agent whose first "signal" is `drain` (DRAIN, keep
    /// serving) and second the agent's own shutdown (drop or
    /// [`TestAgent::stop`]).
    pub async fn start_drainable(agent_addr: SocketAddr, drain: CancellationToken) -> Self {
        Self::start_drainable_with(agent_addr, AgentOpts::default(), drain).await
    }

    /// [`TestAgent::start_drainable`] with options.
    pub async fn start_drainable_with(
        agent_addr: SocketAddr,
        opts: AgentOpts,
        drain: CancellationToken,
    ) -> Self {
        trace_init();
        let bound = Agent::bind(agent_config(agent_addr, &opts))
            .await
            .expect("binding the agent");
        let shutdown = CancellationToken::new();
        let handle = bound.handle();
        let health_addr = bound.health_addr();
        let admin_addr = bound.admin_addr();
        let token = shutdown.clone();
        let task = tokio::spawn(async move {
            bound
                .serve_with_drain(drain.cancelled_owned(), token.cancelled_owned())
                .await;
        });
        Self {
            handle,
            health_addr,
            admin_addr,
            shutdown,
            task: Some(task),
        }
    }

    /// Whether the agent's serve loop has returned.
    pub fn has_exited(&self) -> bool {
        self.task.as_ref().is_none_or(JoinHandle::is_finished)
    }

    /// Stops the agent and waits until it has stopped.
    pub async fn stop(mut self) {
        self.shutdown.cancel();
        if let Some(task) = self.task.take() {
            task.await.expect("agent task");
        }
    }
}

impl Drop for TestAgent {
    fn drop(&mut self) {
        self.shutdown.cancel();
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
        let pki = Pki::get();
        let child = Command::new(binary("proxy-agent"))
            .env_remove("HTTPS_PROXY")
            .env_remove("https_proxy")
            .env_remove("ALL_PROXY")
            .env_remove("all_proxy")
            .args([
                format!("--ca-cert={}", pki.path("agent-ca.crt").display()),
                format!("--agent-cert={}", pki.path("proxy-agent.crt").display()),
                format!("--agent-key={}", pki.path("proxy-agent.key").display()),
                "--proxy-server-host=127.0.0.1".to_owned(),
                format!("--proxy-server-port={port}"),
                "--health-server-host=127.0.0.1".to_owned(),
                "--health-server-port=0".to_owned(),
                "--admin-server-port=0".to_owned(),
                "--sync-interval=100ms".to_owned(),
                "--sync-interval-cap=1s".to_owned(),
            ])
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

/// Sends the signal `name` (`TERM`, `KILL`, …) to `pid` with the system's `kill`.
pub fn signal(pid: u32, name: &str) {
    let status = Command::new("kill")
        .arg(format!("-{name}"))
        .arg(pid.to_string())
        .status()
        .expect("running kill");
    assert!(status.success(), "kill -{name} {pid} failed");
}

/// A frontend that speaks packets directly, for protocol tests.
pub struct RawFrontend {
    /// Packets to the server.
    pub tx: mpsc::Sender<Packet>,
    /// Packets from the server.
    pub rx: Streaming<Packet>,
}

impl RawFrontend {
    /// Opens a `Proxy` stream on a fresh frontend connection; `first` is sent
    /// before the call so the server's headers come with its answer.
    pub async fn open(server: &TestServer, first: Packet) -> Self {
        let (tx, rx) = mpsc::channel(64);
        tx.send(first).await.expect("queueing the first packet");
        let response = ProxyServiceClient::new(server.channel().await)
            .proxy(ReceiverStream::new(rx))
            .await
            .expect("opening the proxy stream");
        Self {
            tx,
            rx: response.into_inner(),
        }
    }

    /// Sends a packet.
    pub async fn send(&self, packet: Packet) {
        self.tx.send(packet).await.expect("sending a packet");
    }

    /// The next packet, failing the test after [`DEADLINE`].
    pub async fn recv(&mut self) -> Packet {
        tokio::time::timeout(DEADLINE, self.rx.message())
            .await
            .expect("timed out waiting for a packet")
            .expect("stream failed")
            .expect("stream ended")
    }
}

/// A plain HTTP/1.1 GET; returns the status code and the body.
pub async fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    let answer = http_request(addr, "GET", path, "test", "").await;
    (answer.status, answer.text())
}

/// An HTTP/1.1 answer read off the wire.
#[derive(Debug, Clone)]
pub struct HttpAnswer {
    /// Status code.
    pub status: u16,
    /// Header values by lower-cased name (the last one wins).
    pub headers: std::collections::BTreeMap<String, String>,
    /// The body as sent (not de-chunked).
    pub body: Vec<u8>,
}

impl HttpAnswer {
    /// The body as text (lossily decoded).
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// Sends `method target` with `Host: host` and `Connection: close` (plus
/// `extra` header lines, each ending in CRLF) and reads the whole answer.
pub async fn http_request(
    addr: SocketAddr,
    method: &str,
    target: &str,
    host: &str,
    extra: &str,
) -> HttpAnswer {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr)
        .await
        .expect("connecting");
    stream
        .write_all(
            format!(
                "{method} {target} HTTP/1.1\r\nHost: {host}\r\n{extra}Connection: close\r\n\r\n"
            )
            .as_bytes(),
        )
        .await
        .expect("writing the request");
    let mut raw = Vec::new();
    stream
        .read_to_end(&mut raw)
        .await
        .expect("reading the response");
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a response head");
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|s| s.parse().ok())
        .expect("a status line");
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    HttpAnswer {
        status,
        headers,
        body: raw[split + 4..].to_vec(),
    }
}

/// Polls `GET path` on `addr` until it answers `status` and returns that
/// body; panics after [`DEADLINE`] with the last answer.
pub async fn wait_for_status(addr: SocketAddr, path: &str, status: u16) -> String {
    let start = Instant::now();
    loop {
        let (got, body) = http_get(addr, path).await;
        if got == status {
            return body;
        }
        assert!(
            start.elapsed() < DEADLINE,
            "{path} on {addr} still answers {got} {body:?}, not {status}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
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
