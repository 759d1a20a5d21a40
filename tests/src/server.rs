//! [`TestServer`]: an in-process proxy-server on ephemeral ports.

use std::{net::SocketAddr, path::PathBuf, sync::Arc, time::Duration};

use client::dial::{TunnelConn, dial, uds_channel};
use proxy_server::{
    DialPolicy, HedgeDelay,
    config::{Config, FrontendListen, ListenerTls, Mode, Resumption},
    server::{ProxyServer, ServerHandle},
    strategy::ProxyStrategy,
};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;
use tunnel::ids::ServerId;

use crate::{Pki, frontend_client_tls, trace_init, wait_for};

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
    /// `--backend-dial-retries`.
    pub backend_dial_retries: u32,
    /// `--backend-dial-hedge` with `--backend-dial-hedge-delay`.
    pub backend_dial_hedge: Option<HedgeDelay>,
    /// `--proxy-strategies`.
    pub strategies: Vec<ProxyStrategy>,
    /// Serve the frontend on mTLS TCP instead of a Unix socket.
    pub tcp_frontend: bool,
    /// Frontend protocol.
    pub mode: Mode,
    /// Offer per-connection flow control to agents.
    pub flow_control: bool,
    /// `--flow-control-window` and `--flow-control-max-chunk`.
    pub flow_window: tunnel::flow::Window,
    /// `--flow-control-version`.
    pub flow_version: tunnel::flow::Version,
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
    /// `--tls-session-tickets` on the agent listener.
    pub session_tickets: bool,
    /// `--verify-agent-identifiers`.
    pub verify_agent_identifiers: bool,
    /// `--tls-session-ticket-rotation`.
    pub ticket_rotation: Duration,
    /// `--max-agent-queue-bytes`.
    pub max_agent_queue_bytes: usize,
    /// `--allow-unauthenticated-agents` (needed with neither `mtls` nor
    /// `token_auth`).
    pub allow_unauthenticated_agents: bool,
    /// `--buffer-budget-bytes`.
    pub buffer_budget_bytes: usize,
    /// `--audit-log-path`.
    pub audit_log: Option<PathBuf>,
}

impl Default for ServerOpts {
    fn default() -> Self {
        Self {
            agent_port: 0,
            mtls: true,
            backend_dial_timeout: None,
            backend_dial_retries: 1,
            backend_dial_hedge: None,
            strategies: vec![ProxyStrategy::Default],
            tcp_frontend: false,
            mode: Mode::Grpc,
            flow_control: true,
            flow_window: tunnel::flow::Window::V1,
            flow_version: tunnel::flow::Version::V2,
            graceful_shutdown_timeout: None,
            token_auth: None,
            server_id: None,
            server_count: 1,
            keepalive_time: None,
            lease: None,
            profiling: false,
            max_tls_handshakes: 8192,
            frontend_stall_timeout: Some(Duration::from_secs(300)),
            session_tickets: true,
            verify_agent_identifiers: false,
            ticket_rotation: proxy_server::config::DEFAULT_TICKET_ROTATION,
            max_agent_queue_bytes: 4 << 20,
            allow_unauthenticated_agents: false,
            buffer_budget_bytes: proxy_server::config::DEFAULT_BUFFER_BUDGET,
            audit_log: None,
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
                tls: ListenerTls::frontend(
                    pki.path("proxy-frontend.crt"),
                    pki.path("proxy-frontend.key"),
                    pki.path("frontend-ca.crt"),
                    opts.mode,
                ),
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
            agent_tls: ListenerTls {
                resumption: if opts.session_tickets {
                    Resumption::Tickets {
                        rotation: opts.ticket_rotation,
                    }
                } else {
                    Resumption::Cache
                },
                ..ListenerTls::agent(
                    pki.path("cluster.crt"),
                    pki.path("cluster.key"),
                    opts.mtls.then(|| pki.path("agent-ca.crt")),
                )
            },
            health_addr: "127.0.0.1:0".parse().expect("address"),
            admin_addr: "127.0.0.1:0".parse().expect("address"),
            profiling: opts.profiling,
            tracing: None,
            server_id: ServerId(
                opts.server_id
                    .clone()
                    .unwrap_or_else(|| "test-server".to_owned()),
            ),
            server_count: opts.server_count,
            strategies: opts.strategies.clone(),
            max_agent_queue_bytes: opts.max_agent_queue_bytes,
            verify_agent_identifiers: opts.verify_agent_identifiers,
            buffer_budget_bytes: opts.buffer_budget_bytes,
            max_tls_handshakes: opts.max_tls_handshakes,
            max_http_connections: 65_536,
            frontend_stall_timeout: opts.frontend_stall_timeout,
            keepalive_time: opts.keepalive_time.unwrap_or(Duration::from_secs(3600)),
            frontend_keepalive_time: Duration::from_secs(3600),
            frontend_max_concurrent_streams: 100_000,
            agent_max_concurrent_streams:
                proxy_server::config::DEFAULT_AGENT_MAX_CONCURRENT_STREAMS,
            dial_policy: DialPolicy {
                timeout: opts.backend_dial_timeout,
                retries: opts.backend_dial_retries,
                hedge: opts.backend_dial_hedge,
                caps: proxy_server::DialCaps::default(),
            },
            flow_control: opts.flow_control,
            flow_window: opts.flow_window,
            flow_version: opts.flow_version,
            graceful_shutdown_timeout: opts.graceful_shutdown_timeout,
            token_auth: opts.token_auth.clone(),
            allow_unauthenticated_agents: opts.allow_unauthenticated_agents,
            lease: opts.lease.clone(),
            audit: opts.audit_log.as_deref().map(crate::audit::config),
            not_implemented: Vec::new(),
            deprecated: Vec::new(),
            notices: Vec::new(),
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

    /// Proves the server serves: a fresh dial through the tunnel to an echo
    /// destination carries bytes both ways and closes cleanly. Panics
    /// otherwise.
    pub async fn assert_serves(&self) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let echo = crate::destination::echo().await;
        let mut conn = self.dial(&echo.address()).await.expect("dial");
        conn.write_all(b"still here").await.expect("write");
        let mut got = [0u8; 10];
        conn.read_exact(&mut got).await.expect("read");
        assert_eq!(&got, b"still here");
        conn.finish().await.expect("finish");
    }

    /// The value of one series of the server's `/metrics` (`name{labels}`
    /// exactly as exposed), 0 when it is not exposed.
    pub async fn metric(&self, series: &str) -> f64 {
        let (status, text) = crate::http_get(self.admin_addr, "/metrics").await;
        assert_eq!(status, 200, "/metrics answered {status}: {text}");
        crate::process::metric_value(&text, series)
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
