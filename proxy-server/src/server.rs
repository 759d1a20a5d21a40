//! [`ProxyServer`]: binds every listener, then serves until shutdown.

use std::{
    future::Future,
    io,
    net::SocketAddr,
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use authority::AnyAuthority;
use edge::{
    listen::{Following, bind_named, tls_incoming_counted},
    read_ahead::ReadAhead,
};
use futures_util::StreamExt as _;
use ops::{
    audit::{AuditLog, AuditRecord},
    tls::{ListenerConfig, files::TlsFiles},
};
use proto::{agent_service_server::AgentServiceServer, proxy_service_server::ProxyServiceServer};
use tokio::net::{TcpListener, UnixListener};
use tokio::task::JoinHandle;
use tokio_stream::wrappers::UnixListenerStream;
use tokio_util::{sync::CancellationToken, task::TaskTracker};
use tonic::transport::Server;
use tracing::{info, warn};
use tunnel::flow;

use crate::{
    backend::AgentServiceImpl,
    config::{Config, FrontendListen, Mode},
    control::{Budgets, Control},
    frontend::{cap::ConnectionCap, grpc::ProxyServiceImpl, http_connect},
    health,
    metrics::{Handshake, ServerMetrics},
};

/// What a frontend may send on one stream ahead of the server's reader,
/// which HTTP/2 holds until the stream's driver reads it: HTTP/2's default
/// (grpc-go's too). A driver stops reading only while its read-ahead is
/// full or waits for the buffer budget, so this is what a stalled stream
/// makes HTTP/2 hold beyond the budget; a reader that goes on takes the
/// window back as it reads (hyper gives it back as the stream is read, h2
/// tells the peer at half the window).
pub const FRONTEND_STREAM_WINDOW: u32 = 64 * 1024;
/// What a frontend may send on all its streams ahead of the server's
/// readers: HTTP/2's largest, so that streams whose readers wait
/// (destinations that stopped reading) never hold up the connection's
/// other streams. What HTTP/2 holds is bounded by the streams' windows, a
/// window per open stream, and the streams by
/// `--frontend-max-concurrent-streams` per connection and
/// `--max-http-connections`. A 128 MiB connection window let 128 stalled
/// streams of 1 MiB windows hold up a connection's new dials until they
/// were cut.
const FRONTEND_CONNECTION_WINDOW: u32 = (1 << 31) - 1;

/// The largest gRPC message a frontend may send: ANP's (grpc-go's default
/// receive limit). kube-apiserver's konnectivity-client sends each write of
/// its caller as one DATA packet, whatever its size (its writes are TLS
/// records or 4–32 KiB copies in practice), so a drop-in replacement takes
/// what ANP takes. Each payload under 64 KiB is copied out of the decode
/// buffer (`proto::codec`), and a stream waiting for room holds at most one
/// such message beyond the buffer budget.
pub const MAX_FRONTEND_MESSAGE: usize = 4 * 1024 * 1024;
/// The largest gRPC message an agent may send: a DATA packet of the largest
/// chunk a server may ask for (`flow::MAX_CHUNK_LIMIT`, 1 MiB; ours
/// announces `--flow-control-max-chunk`, and sends agents without credit
/// 256 KiB chunks, which they answer in kind; ANP agents read 4 KiB at a
/// time) with 64 KiB to spare for its framing and for an error text.
pub const MAX_AGENT_MESSAGE: usize = flow::MAX_CHUNK_LIMIT + 64 * 1024;

/// How often stalled connections are looked for: a tenth of the timeout,
/// between 10 ms and 1 s.
fn stall_check_interval(limit: Duration) -> Duration {
    (limit / 10).clamp(Duration::from_millis(10), Duration::from_secs(1))
}

/// How often a graceful shutdown checks whether connections have finished.
const GRACE_POLL: Duration = Duration::from_millis(100);
/// How long the audit log may take to write out its queued records at
/// shutdown (a full default queue of 10,000 records takes well under one).
const AUDIT_FLUSH_TIMEOUT: Duration = Duration::from_secs(5);

/// How long listeners may take to wind down after shutdown before they are dropped.
const STOP_GRACE: Duration = Duration::from_secs(5);

/// A listener could not be set up or a server failed.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// The audit log cannot be opened (the error names `--audit-log-path`).
    #[error(transparent)]
    Audit(ops::flags::FlagError),
    /// A TCP listener could not be bound.
    #[error(transparent)]
    Bind(#[from] edge::listen::BindError),
    /// The Unix socket could not be created.
    #[error("cannot listen on unix socket {path}")]
    Uds {
        /// The path.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// A certificate or key file cannot be used; the error names its flag.
    #[error(transparent)]
    Tls(#[from] crate::config::ConfigError),
    /// The agent port would authenticate no one, and
    /// `--allow-unauthenticated-agents` was not given.
    #[error(transparent)]
    Unauthenticated(crate::config::ConfigError),
    /// Token authentication could not be set up.
    #[error("setting up agent token authentication")]
    Auth(#[from] crate::auth::AuthSetupError),
    /// A gRPC server failed.
    #[error("{what} server failed")]
    Serve {
        /// Which server.
        what: &'static str,
        /// Why.
        #[source]
        source: tonic::transport::Error,
    },
}

/// A frontend server running until shutdown.
type FrontendFuture =
    std::pin::Pin<Box<dyn Future<Output = Result<(), tonic::transport::Error>> + Send>>;

/// Accepts HTTP-CONNECT clients until `shutdown`, each in its own task,
/// at most `max_connections` at once (more are answered 503 and closed).
async fn serve_http_connect<S, IO>(
    mut incoming: S,
    control: Arc<Control>,
    max_connections: usize,
    tasks: TaskTracker,
    accept_stop: CancellationToken,
    shutdown: CancellationToken,
) -> Result<(), tonic::transport::Error>
where
    S: futures_util::Stream<Item = Result<IO, io::Error>> + Unpin,
    IO: tokio::io::AsyncRead
        + tokio::io::AsyncWrite
        + Unpin
        + Send
        + 'static
        + crate::frontend::FrontendSocket,
{
    let mut cap = ConnectionCap::new(
        max_connections,
        control.metrics.clone(),
        "HTTP 503 and a close",
    );
    loop {
        let next = tokio::select! {
            () = accept_stop.cancelled() => return Ok(()),
            next = incoming.next() => next,
        };
        match next {
            None => return Ok(()),
            Some(Ok(io)) => {
                let Some(permit) = cap.admit() else {
                    tasks.spawn(http_connect::refuse(io));
                    continue;
                };
                tasks.spawn(http_connect::serve_connection(
                    io,
                    control.clone(),
                    shutdown.clone(),
                    permit,
                ));
            }
            Some(Err(error)) => {
                warn!(%error, "accepting a frontend connection failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// Binds the frontend's listener (`tls`: its certificates, for TCP).
async fn bind_frontend(
    frontend: &FrontendListen,
    tls: Option<TlsFiles<ListenerConfig>>,
) -> Result<BoundFrontend, ServerError> {
    Ok(match frontend {
        FrontendListen::Uds {
            path,
            delete_existing,
        } => BoundFrontend::Uds {
            listener: bind_uds(path, *delete_existing).map_err(|source| ServerError::Uds {
                path: path.clone(),
                source,
            })?,
            path: path.clone(),
        },
        FrontendListen::Tcp { addr, .. } => BoundFrontend::Tcp {
            listener: bind_named(*addr, "frontend").await?,
            tls: tls.expect("loaded above for a TCP frontend"),
        },
    })
}

/// The peer of a frontend on the Unix socket, for the audit log:
/// `unix:<path>`; none on TCP.
fn socket_peer(frontend: &FrontendListen) -> String {
    match frontend {
        FrontendListen::Uds { path, .. } => format!("unix:{}", path.display()),
        FrontendListen::Tcp { .. } => String::new(),
    }
}

/// Entry point: `ProxyServer::bind(config)` then `Bound::serve(shutdown)`.
pub struct ProxyServer;

impl ProxyServer {
    /// Names the flags without effect and the deprecated ones given, then
    /// binds the agent, frontend, health and admin listeners.
    ///
    /// # Errors
    /// A port is taken, the socket path cannot be used, …; the error names it.
    pub async fn bind(config: Config) -> Result<Bound, ServerError> {
        // Before anything can fail, so an operator sees them either way.
        ops::flags::warn_flags(&config.not_implemented, &config.deprecated, &config.notices);
        config
            .check_agent_auth()
            .map_err(ServerError::Unauthenticated)?;
        if config.agents_unauthenticated() {
            warn!(
                agent.addr = %config.agent_addr,
                "the agent port authenticates no one (--allow-unauthenticated-agents): \
                 neither client certificates (--cluster-ca-cert) nor service-account tokens \
                 (--agent-namespace) are required, so anyone who can reach it can register \
                 as an agent and be sent kube-apiserver's traffic to nodes"
            );
        }
        let metrics = Arc::new(ServerMetrics::new(&config.strategies));
        // Opened before any port is taken: a path that cannot work stops
        // the start, naming the flag.
        let audit_log =
            AuditLog::start(config.audit.as_ref(), metrics.audit()).map_err(ServerError::Audit)?;
        // The certificates, before any port is taken; from then on each
        // handshake uses the files as they are, or the last good ones.
        let agent_tls = config.agent_tls.follow("agent listener", metrics.certs())?;
        let frontend_tls = match &config.frontend {
            FrontendListen::Tcp { tls, .. } => {
                Some(tls.follow("frontend listener", metrics.certs())?)
            }
            FrontendListen::Uds { .. } => None,
        };
        let agent = bind_named(config.agent_addr, "agent").await?;
        let frontend = bind_frontend(&config.frontend, frontend_tls).await?;
        let health = bind_named(config.health_addr, "health").await?;
        let admin = bind_named(config.admin_addr, "admin").await?;
        let tracing = start_tracing(config.tracing.as_ref(), &metrics)?;
        let control = Arc::new(
            Control::new(
                &config.strategies,
                config.dial_policy,
                metrics,
                Budgets::new(config.buffer_budget_bytes),
            )
            .with_tracing(tracing)
            .with_audit(
                audit_log.sink(),
                config.server_id.0.clone(),
                socket_peer(&config.frontend),
            ),
        );
        let token_auth = match &config.token_auth {
            Some(auth) => {
                let metrics = control.metrics.clone();
                let on_review: crate::auth::OnReview =
                    Arc::new(move |checked| metrics.checked(checked));
                Some(Arc::new(
                    crate::auth::TokenAuth::new(auth.clone(), on_review).await?,
                ))
            }
            None => None,
        };
        Ok(Bound {
            config,
            agent_tls,
            agent,
            frontend,
            health,
            admin,
            control,
            token_auth,
            audit_log,
        })
    }
}

/// The frontend socket's mode (ANP: umask 0007 around its bind).
const UDS_MODE: u32 = 0o770;

/// Creates the frontend socket at `path` with mode 0770 from the moment it
/// is there: bound in a private directory (0700) made beside it, given its
/// mode there, then moved into place: renamed over `path` (which replaces a
/// stale file at once) or, with `delete_existing` false, linked to it,
/// which fails if something is there (as a bind there would). A socket bound
/// at `path` itself and chmod-ed after would be open to every user for a
/// moment under umask 0; setting the umask around the bind instead would
/// change it for every thread of the process.
fn bind_uds(path: &Path, delete_existing: bool) -> io::Result<UnixListener> {
    let parent = match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => Path::new("."),
    };
    let private = private_dir(parent)?;
    // One letter: the staged path is no longer than the final one for any
    // socket name of ten bytes or more (a socket path holds 107).
    let staged = private.join("s");
    let bound = (|| {
        let listener = UnixListener::bind(&staged)?;
        std::fs::set_permissions(&staged, std::fs::Permissions::from_mode(UDS_MODE))?;
        if delete_existing {
            std::fs::rename(&staged, path)?;
        } else {
            std::fs::hard_link(&staged, path).map_err(|e| {
                if e.kind() == io::ErrorKind::AlreadyExists {
                    io::Error::new(
                        io::ErrorKind::AddrInUse,
                        "a file is in the way (--delete-existing-uds-file=false)",
                    )
                } else {
                    e
                }
            })?;
        }
        Ok(listener)
    })();
    let _ = std::fs::remove_file(&staged);
    let _ = std::fs::remove_dir(&private);
    bound
}

/// A new directory in `parent` that only this user can enter (0700,
/// whatever the umask), named `.k` and six random letters.
fn private_dir(parent: &Path) -> io::Result<PathBuf> {
    use std::os::unix::fs::DirBuilderExt;
    let mut tries = 0;
    loop {
        let name: String = std::iter::repeat_with(fastrand::alphanumeric)
            .take(6)
            .collect();
        let dir = parent.join(format!(".k{name}"));
        match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
            Ok(()) => {
                // The umask can only have taken bits away: the directory
                // was never more open than 0700. Give back the owner's.
                return match std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))
                {
                    Ok(()) => Ok(dir),
                    Err(e) => {
                        let _ = std::fs::remove_dir(&dir);
                        Err(e)
                    }
                };
            }
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists && tries < 16 => tries += 1,
            Err(e) => return Err(e),
        }
    }
}

/// The bound frontend listener.
enum BoundFrontend {
    /// Unix socket.
    Uds {
        /// The listener.
        listener: UnixListener,
        /// Its path, removed at shutdown.
        path: PathBuf,
    },
    /// TCP with mTLS.
    Tcp {
        /// The listener.
        listener: TcpListener,
        /// Its TLS configuration, following its files.
        tls: TlsFiles<ListenerConfig>,
    },
}

/// Where the frontend listens.
#[derive(Debug, Clone)]
pub enum FrontendAddr {
    /// Unix socket path.
    Uds(PathBuf),
    /// TCP address.
    Tcp(SocketAddr),
}

/// A server with all its listeners bound, ready to [`serve`](Bound::serve).
pub struct Bound {
    /// Validated configuration.
    config: Config,
    /// The agent listener's TLS, following its files.
    agent_tls: TlsFiles<ListenerConfig>,
    /// Agent listener.
    agent: TcpListener,
    /// Frontend listener.
    frontend: BoundFrontend,
    /// Health listener.
    health: TcpListener,
    /// Admin listener (`/metrics`, pprof).
    admin: TcpListener,
    /// The control core.
    control: Arc<Control>,
    /// Agent token authentication, if on.
    token_auth: Option<Arc<crate::auth::TokenAuth>>,
    /// The audit log (`--audit-log-path`); written out at the end of
    /// [`Running::stop`].
    audit_log: AuditLog<AuditRecord>,
}

impl Bound {
    /// Address of the agent listener.
    pub fn agent_addr(&self) -> SocketAddr {
        self.agent
            .local_addr()
            .expect("a bound TCP listener has an address")
    }

    /// Address of the health listener.
    pub fn health_addr(&self) -> SocketAddr {
        self.health
            .local_addr()
            .expect("a bound TCP listener has an address")
    }

    /// Address of the admin listener.
    pub fn admin_addr(&self) -> SocketAddr {
        self.admin
            .local_addr()
            .expect("a bound TCP listener has an address")
    }

    /// Where frontends connect.
    pub fn frontend_addr(&self) -> FrontendAddr {
        match &self.frontend {
            BoundFrontend::Uds { path, .. } => FrontendAddr::Uds(path.clone()),
            BoundFrontend::Tcp { listener, .. } => FrontendAddr::Tcp(
                listener
                    .local_addr()
                    .expect("a bound TCP listener has an address"),
            ),
        }
    }

    /// A handle for observing the running server (tests, tools).
    pub fn handle(&self) -> ServerHandle {
        ServerHandle {
            control: self.control.clone(),
            token_auth: self.token_auth.clone(),
        }
    }

    /// Serves until `shutdown` resolves, then stops every listener and
    /// closes every agent and frontend stream ([`Running::stop`]).
    ///
    /// # Errors
    /// A gRPC server failed.
    pub async fn serve(self, shutdown: impl Future<Output = ()>) -> Result<(), ServerError> {
        info!(server.id = %self.config.server_id, server.count = self.config.server_count, "proxy-server starting");
        let running = self.start();
        shutdown.await;
        running.stop().await
    }

    /// Starts every listener, the lease and the timers.
    fn start(self) -> Running {
        let ends = Ends::default();
        let agent_local = self.agent.local_addr().ok();
        let on_drop: edge::listen::OnDrop = {
            let metrics = self.control.metrics.clone();
            Arc::new(move |reason| metrics.handshake_dropped(reason))
        };
        let Self {
            config,
            agent_tls,
            agent,
            frontend,
            health,
            admin,
            control,
            token_auth,
            audit_log,
        } = self;
        let agent_server = agent_server(
            &config, &control, &ends, agent, agent_tls, token_auth, &on_drop,
        );
        let (frontend_server, uds_path) =
            frontend_server(&config, &control, &ends, frontend, &on_drop);
        info!(agent.addr = ?agent_local, health.addr = ?health.local_addr().ok(), "listening");
        let http = http_servers(&config, &control, &ends, health, admin);
        let tasks = Tasks {
            agent: ends.listeners.spawn(agent_server),
            frontend: ends.listeners.spawn(frontend_server),
            http: ends.listeners.spawn(http),
            lease: config.lease.clone().map(|lease| {
                ends.listeners.spawn(crate::lease::run(
                    lease,
                    config.server_id.clone(),
                    control.metrics.clone(),
                    ends.lease_stop.clone(),
                ))
            }),
        };
        spawn_timers(&config, &control, &ends);
        Running {
            ends,
            tasks,
            control,
            grace: config.graceful_shutdown_timeout,
            uds_path,
            audit_log,
        }
    }
}

/// The tracer `--tracing-config-file` asks for (off without one), counting
/// its dropped spans in `metrics`.
fn start_tracing(
    config: Option<&ops::otel::TracingConfig>,
    metrics: &ServerMetrics,
) -> Result<ops::otel::Tracing, ServerError> {
    let Some(config) = config else {
        return Ok(ops::otel::Tracing::off());
    };
    let dropped = metrics.trace_spans_dropped();
    ops::otel::Tracing::start(config, "konnectivity-server", dropped)
        .map_err(|e| ops::flags::invalid("tracing-config-file", e).into())
}

/// One tree of ends: `token` ends every stream and connection, and with
/// it its children, `accept_stop` (accepting ends first in a graceful
/// shutdown) and `lease_stop` (the lease goes before that). Every task is
/// tracked: `tasks` has the streams' and connections', `listeners` the
/// servers' and the lease's.
struct Ends {
    /// Ends everything.
    token: CancellationToken,
    /// Stops accepting.
    accept_stop: CancellationToken,
    /// Stops the lease.
    lease_stop: CancellationToken,
    /// Streams, connections, timers.
    tasks: TaskTracker,
    /// Servers and the lease.
    listeners: TaskTracker,
}

impl Default for Ends {
    fn default() -> Self {
        let token = CancellationToken::new();
        Self {
            accept_stop: token.child_token(),
            lease_stop: token.child_token(),
            token,
            tasks: TaskTracker::new(),
            listeners: TaskTracker::new(),
        }
    }
}

/// The agent listener: `AgentService` over TLS.
fn agent_server(
    config: &Config,
    control: &Arc<Control>,
    ends: &Ends,
    listener: TcpListener,
    tls: TlsFiles<ListenerConfig>,
    token_auth: Option<Arc<crate::auth::TokenAuth>>,
    on_drop: &edge::listen::OnDrop,
) -> FrontendFuture {
    let service = AgentServiceServer::new(AgentServiceImpl {
        control: control.clone(),
        server_id: config.server_id.clone(),
        server_count: config.server_count,
        tasks: ends.tasks.clone(),
        shutdown: ends.token.clone(),
        flow_window: config.flow_control.then_some(config.flow_window),
        flow_version: config.flow_version,
        token_auth,
        queue_bytes: config.max_agent_queue_bytes,
        verify_identifiers: config.verify_agent_identifiers,
    })
    .max_decoding_message_size(MAX_AGENT_MESSAGE);
    let metrics = control.metrics.clone();
    let handshakes = tls.clone();
    // A resumed session's chain is verified in its connection's task, so
    // that a restart storm's resumptions are checked in parallel.
    let admit: edge::listen::AdmitHandshake =
        Arc::new(move |conn| admit_handshake(conn, &tls.last(), &metrics));
    let incoming = tls_incoming_counted(
        listener,
        Following(move || handshakes.current().server.clone()),
        ends.accept_stop.clone(),
        "agent",
        config.max_tls_handshakes,
        on_drop.clone(),
        Some(admit),
    );
    Box::pin(
        Server::builder()
            .max_frame_size(edge::h2::MAX_FRAME_SIZE)
            .initial_stream_window_size(edge::h2::STREAM_WINDOW)
            .initial_connection_window_size(edge::h2::CONNECTION_WINDOW)
            .max_concurrent_streams(config.agent_max_concurrent_streams)
            .http2_keepalive_interval(Some(config.keepalive_time))
            .http2_keepalive_timeout(Some(edge::h2::keepalive_timeout(config.keepalive_time)))
            // A stream waiting for its token review holds none of its
            // data: the handler reads it, and data is an error until the
            // stream is admitted.
            .layer(edge::gate::GateLayer)
            .add_service(service)
            .serve_with_incoming_shutdown(incoming, ends.accept_stop.clone().cancelled_owned()),
    )
}

/// Counts an agent's completed TLS handshake, and whether to serve it.
/// With client certificates (mTLS), a resumed session's chain is verified
/// again against the client CA as `listener` has it now, as a full
/// handshake would (`ops::tls::tickets::verify_resumed`): a session without
/// a chain (a ticket made with the ticket secret, not by a handshake), or
/// whose chain has expired or no longer chains to the CA, is dropped, and
/// the agent falls back to a full handshake.
fn admit_handshake(
    tls: &rustls::ServerConnection,
    listener: &ListenerConfig,
    metrics: &ServerMetrics,
) -> bool {
    if tls.handshake_kind() != Some(rustls::HandshakeKind::Resumed) {
        metrics.handshake(Handshake::Full);
        return true;
    }
    metrics.handshake(Handshake::Resumed);
    let verdict = ops::tls::tickets::verify_resumed(
        tls,
        listener.client_verifier.as_deref(),
        rustls_pki_types::UnixTime::now(),
    );
    if let Err(error) = &verdict {
        warn!(error = %ops::error::DisplayErrorStack(error), "resumed agent session refused; dropped");
    }
    verdict.is_ok()
}

/// The frontend listener, by mode and transport; the socket path to
/// remove at the end, for a Unix socket.
fn frontend_server(
    config: &Config,
    control: &Arc<Control>,
    ends: &Ends,
    frontend: BoundFrontend,
    on_drop: &edge::listen::OnDrop,
) -> (FrontendFuture, Option<PathBuf>) {
    let stop = || ends.accept_stop.clone().cancelled_owned();
    let tls_incoming = |listener, tls: TlsFiles<ListenerConfig>| {
        tls_incoming_counted(
            listener,
            Following(move || tls.current().server.clone()),
            ends.accept_stop.clone(),
            "frontend",
            config.max_tls_handshakes,
            on_drop.clone(),
            None,
        )
    };
    let grpc = grpc_frontend(config, control, ends);
    let grpc_cap = || {
        ConnectionCap::new(
            config.max_http_connections,
            control.metrics.clone(),
            "a closed connection",
        )
    };
    match (config.mode, frontend) {
        (Mode::Grpc, BoundFrontend::Uds { listener, path }) => {
            info!(frontend.path = %path.display(), "frontend listening (grpc over unix socket)");
            // Any `:authority` is accepted on the socket: kube-apiserver
            // sends the socket's path, which h2 refuses by itself. Reads
            // take up to 64 KiB per system call: h2 asks for 8 KiB at a
            // time, and grpc-go's uploads come in 16 KiB frames.
            let incoming = UnixListenerStream::new(listener)
                .map(|accepted| accepted.map(|socket| AnyAuthority::new(ReadAhead::new(socket))));
            (
                Box::pin(grpc.serve_with_incoming_shutdown(grpc_cap().admitted(incoming), stop())),
                Some(path),
            )
        }
        (Mode::Grpc, BoundFrontend::Tcp { listener, tls }) => {
            info!(frontend.addr = ?listener.local_addr().ok(), "frontend listening (grpc over mTLS)");
            let incoming = tls_incoming(listener, tls);
            (
                Box::pin(grpc.serve_with_incoming_shutdown(grpc_cap().admitted(incoming), stop())),
                None,
            )
        }
        (Mode::HttpConnect, BoundFrontend::Uds { listener, path }) => {
            info!(frontend.path = %path.display(), "frontend listening (http-connect over unix socket)");
            let incoming = UnixListenerStream::new(listener);
            (
                http_connect_server(incoming, config, control, ends),
                Some(path),
            )
        }
        (Mode::HttpConnect, BoundFrontend::Tcp { listener, tls }) => {
            info!(frontend.addr = ?listener.local_addr().ok(), "frontend listening (http-connect over mTLS)");
            let incoming = tls_incoming(listener, tls);
            (http_connect_server(incoming, config, control, ends), None)
        }
    }
}

/// The HTTP-CONNECT frontend's server on `incoming`.
fn http_connect_server<S, IO>(
    incoming: S,
    config: &Config,
    control: &Arc<Control>,
    ends: &Ends,
) -> FrontendFuture
where
    S: futures_util::Stream<Item = Result<IO, io::Error>> + Unpin + Send + 'static,
    IO: tokio::io::AsyncRead
        + tokio::io::AsyncWrite
        + Unpin
        + Send
        + 'static
        + crate::frontend::FrontendSocket,
{
    Box::pin(serve_http_connect(
        incoming,
        control.clone(),
        config.max_http_connections,
        ends.tasks.clone(),
        ends.accept_stop.clone(),
        ends.token.clone(),
    ))
}

/// The gRPC frontend's server, ready for its listener.
fn grpc_frontend(
    config: &Config,
    control: &Arc<Control>,
    ends: &Ends,
) -> tonic::transport::server::Router {
    let service = ProxyServiceServer::new(ProxyServiceImpl {
        control: control.clone(),
        tasks: ends.tasks.clone(),
        shutdown: ends.token.clone(),
    })
    .max_decoding_message_size(MAX_FRONTEND_MESSAGE);
    Server::builder()
        .max_frame_size(edge::h2::MAX_FRAME_SIZE)
        .max_concurrent_streams(config.frontend_max_concurrent_streams)
        .initial_stream_window_size(FRONTEND_STREAM_WINDOW)
        .initial_connection_window_size(FRONTEND_CONNECTION_WINDOW)
        .http2_keepalive_interval(Some(config.frontend_keepalive_time))
        .http2_keepalive_timeout(Some(edge::h2::keepalive_timeout(
            config.frontend_keepalive_time,
        )))
        .add_service(service)
}

/// The health and admin listeners.
fn http_servers(
    config: &Config,
    control: &Arc<Control>,
    ends: &Ends,
    health: TcpListener,
    admin: TcpListener,
) -> impl Future<Output = ()> + Send + 'static {
    let state = health::HealthState {
        control: control.clone(),
    };
    info!(admin.addr = ?admin.local_addr().ok(), profiling = config.profiling, "admin listening");
    let admin = ops::http::serve(
        edge::listen::incoming(admin, "admin"),
        health::admin_router(state.clone(), config.profiling),
        ends.token.clone(),
        "admin",
    );
    let health = ops::http::serve(
        edge::listen::incoming(health, "health"),
        health::router(state),
        ends.token.clone(),
        "health",
    );
    async move {
        let _ = tokio::join!(health, admin);
    }
}

/// The dial timers (`--backend-dial-timeout`, hedging), the dialer of
/// retried and hedged dials and the stall scan.
fn spawn_timers(config: &Config, control: &Arc<Control>, ends: &Ends) {
    ends.tasks.spawn({
        let control = control.clone();
        let token = ends.token.clone();
        async move { control.run_timers(token).await }
    });
    ends.tasks.spawn({
        let control = control.clone();
        let token = ends.token.clone();
        async move { control.run_dialer(token).await }
    });
    // Connections whose frontend takes none of their data are closed after
    // --frontend-stall-timeout (if set), and after `flow::COMPAT_STALL`
    // while agents' DATA fills its half of the buffer budget: what they
    // hold is what other connections wait for.
    let limit = config.frontend_stall_timeout;
    let pressed = flow::COMPAT_STALL.min(limit.unwrap_or(Duration::MAX));
    let control = control.clone();
    let token = ends.token.clone();
    ends.tasks.spawn(async move {
        let mut ticks = tokio::time::interval(stall_check_interval(pressed));
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last = tokio::time::Instant::now();
        loop {
            tokio::select! {
                () = token.cancelled() => return,
                now = ticks.tick() => {
                    if control.budgets.to_frontend.is_full() {
                        control.close_stalled(pressed);
                    } else if let Some(limit) = limit
                        && now - last >= stall_check_interval(limit)
                    {
                        last = now;
                        control.close_stalled(limit);
                    }
                }
            }
        }
    });
}

/// The servers' tasks.
struct Tasks {
    /// The agent listener.
    agent: JoinHandle<Result<(), tonic::transport::Error>>,
    /// The frontend listener.
    frontend: JoinHandle<Result<(), tonic::transport::Error>>,
    /// Health and admin.
    http: JoinHandle<()>,
    /// The lease, if on.
    lease: Option<JoinHandle<()>>,
}

/// A started server, until [`Running::stop`].
struct Running {
    /// Its ends.
    ends: Ends,
    /// Its servers.
    tasks: Tasks,
    /// The control core.
    control: Arc<Control>,
    /// `--graceful-shutdown-timeout`.
    grace: Option<Duration>,
    /// The Unix socket to remove.
    uds_path: Option<PathBuf>,
    /// The audit log, written out last.
    audit_log: AuditLog<AuditRecord>,
}

impl Running {
    /// The shutdown sequence: the lease goes first (lease-counting agents
    /// stop counting us), then accepting stops; open connections get
    /// `--graceful-shutdown-timeout` to finish; then everything is ended
    /// and the servers get [`STOP_GRACE`] to wind down before they are
    /// aborted; the spans not yet exported get the tracer's flush (2 s at
    /// most).
    async fn stop(self) -> Result<(), ServerError> {
        let Self {
            ends,
            tasks,
            control,
            grace,
            uds_path,
            audit_log,
        } = self;
        ends.lease_stop.cancel();
        ends.accept_stop.cancel();
        if let Some(grace) = grace {
            drain(&control, grace).await;
        }
        info!("stopping");
        ends.token.cancel();
        control.shutting_down();
        ends.tasks.close();
        ends.listeners.close();
        let result = wind_down(tasks, &ends).await;
        control.end_backends();
        if let Some(path) = uds_path {
            let _ = std::fs::remove_file(path);
        }
        // The spans of the last tunnels, ended just above, go out before
        // the process does (off the runtime: the flush blocks).
        let tracing = control.tracing();
        let _ = tokio::task::spawn_blocking(move || tracing.shutdown()).await;
        // Every tunnel has ended: its record is queued; write them out.
        audit_log.close(AUDIT_FLUSH_TIMEOUT).await;
        info!("stopped");
        result
    }
}

/// Lets open connections and pending dials finish, for `grace` at most.
async fn drain(control: &Control, grace: Duration) {
    info!(timeout = ?grace, connections = control.established_count(), "stopped accepting; letting open connections finish");
    let idle = async {
        while control.established_count() > 0 || control.pending_count() > 0 {
            tokio::time::sleep(GRACE_POLL).await;
        }
    };
    if tokio::time::timeout(grace, idle).await.is_err() {
        warn!(
            connections = control.established_count(),
            "graceful shutdown timed out; closing the rest"
        );
    }
}

/// Waits [`STOP_GRACE`] for the servers and every tracked task, then
/// aborts the servers; the first server failure, if any.
async fn wind_down(tasks: Tasks, ends: &Ends) -> Result<(), ServerError> {
    let aborts = [
        tasks.agent.abort_handle(),
        tasks.frontend.abort_handle(),
        tasks.http.abort_handle(),
    ];
    let stopped = async {
        let agent = tasks.agent.await;
        let frontend = tasks.frontend.await;
        let _ = tasks.http.await;
        if let Some(lease) = tasks.lease {
            let _ = lease.await;
        }
        ends.listeners.wait().await;
        ends.tasks.wait().await;
        (agent, frontend)
    };
    match tokio::time::timeout(STOP_GRACE, stopped).await {
        Ok((Ok(Err(source)), _)) => Err(ServerError::Serve {
            what: "agent",
            source,
        }),
        Ok((_, Ok(Err(source)))) => Err(ServerError::Serve {
            what: "frontend",
            source,
        }),
        Ok(_) => Ok(()),
        Err(_) => {
            warn!("listeners did not stop within the grace period; aborting them");
            for abort in aborts {
                abort.abort();
            }
            Ok(())
        }
    }
}

/// Observes a running server.
#[derive(Clone)]
pub struct ServerHandle {
    /// The control core.
    control: Arc<Control>,
    /// Agent token authentication, if on.
    token_auth: Option<Arc<crate::auth::TokenAuth>>,
}

impl ServerHandle {
    /// The lock audit of this server's streams (debug builds record; see
    /// `tunnel::sync::audit`).
    pub fn lock_audit(&self) -> Arc<crate::audit::LockAudit> {
        self.control.audit.clone()
    }

    /// Connected agent streams.
    pub fn backend_count(&self) -> usize {
        self.control.backend_count()
    }

    /// Frontend streams (gRPC streams and CONNECT clients past their head).
    pub fn frontend_count(&self) -> usize {
        self.control.frontend_count()
    }

    /// Dials waiting for an agent's answer.
    pub fn pending_dials(&self) -> usize {
        self.control.pending_count()
    }

    /// Established end-to-end connections.
    pub fn established_connections(&self) -> usize {
        self.control.established_count()
    }

    /// The agent id of every connected agent stream, sorted.
    pub fn agent_ids(&self) -> Vec<String> {
        let mut ids: Vec<String> = self
            .control
            .agents()
            .into_iter()
            .map(|(agent, _, _)| agent.0)
            .collect();
        ids.sort();
        ids
    }

    /// The most bytes (payload plus per-packet overhead) any connection has
    /// queued towards its frontend right now.
    pub fn max_buffered(&self) -> usize {
        self.control.live().max_buffered
    }

    /// Agent streams that announced DRAIN.
    pub fn draining_backends(&self) -> usize {
        self.control
            .agents()
            .iter()
            .filter(|(_, draining, _)| *draining)
            .count()
    }

    /// The address each connected agent stream comes from.
    pub fn agent_peers(&self) -> Vec<SocketAddr> {
        self.control
            .agents()
            .into_iter()
            .filter_map(|(_, _, peer)| peer)
            .collect()
    }

    /// What `/readyz` says.
    pub fn is_ready(&self) -> bool {
        self.control.is_ready()
    }

    /// Agent connects waiting for a token review (0 without token auth).
    pub fn pending_reviews(&self) -> usize {
        self.token_auth
            .as_ref()
            .map_or(0, |auth| auth.pending_reviews())
    }
}
