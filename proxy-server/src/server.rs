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
use futures_util::StreamExt as _;
use ops::tls::files::TlsFiles;
use proto::{agent_service_server::AgentServiceServer, proxy_service_server::ProxyServiceServer};
use tokio::net::{TcpListener, UnixListener};
use tokio_stream::wrappers::UnixListenerStream;
use tokio_util::{sync::CancellationToken, task::TaskTracker};
use tonic::transport::Server;
use tracing::{info, warn};
use tunnel::{
    conn::{bind_named, tls_incoming},
    flow,
    read_ahead::ReadAhead,
};

use crate::{
    agent_service::AgentServiceImpl,
    config::{Config, FrontendListen, Mode},
    events::Limit,
    frontend::{grpc::ProxyServiceImpl, http_connect},
    health,
    hub::Hub,
    metrics::ServerMetrics,
};

/// Streams one frontend connection may have open at once (more wait for
/// a free one, as HTTP/2 clients do). kube-apiserver opens one per
/// connection (single-use hub) or few (reusable hub).
const FRONTEND_MAX_STREAMS: u32 = 128;
/// What a frontend may send on one stream ahead of the server's reader:
/// one flow-control window, as much as the reader can forward at once.
const FRONTEND_STREAM_WINDOW: u32 = flow::WINDOW as u32;
/// Room for every stream's window at once: h2 gives connection window back
/// only as a stream's reader takes its data, so a smaller one would let
/// streams whose readers wait (a destination that stopped reading) starve
/// the connection's other streams. This is the most a frontend connection
/// makes the server buffer.
const FRONTEND_CONNECTION_WINDOW: u32 = FRONTEND_MAX_STREAMS * FRONTEND_STREAM_WINDOW;

/// How often stalled connections are looked for: a tenth of the timeout,
/// between 10 ms and 1 s.
fn stall_check_interval(limit: Duration) -> Duration {
    (limit / 10).clamp(Duration::from_millis(10), Duration::from_secs(1))
}

/// How often a graceful shutdown checks whether connections have finished.
const GRACE_POLL: Duration = Duration::from_millis(100);
/// How long listeners may take to wind down after shutdown before they are dropped.
const STOP_GRACE: Duration = Duration::from_secs(5);

/// A listener could not be set up or a server failed.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// A TCP listener could not be bound.
    #[error(transparent)]
    Bind(#[from] tunnel::conn::BindError),
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
    hub: Arc<Hub>,
    max_connections: usize,
    tasks: TaskTracker,
    accept_stop: CancellationToken,
    shutdown: CancellationToken,
) -> Result<(), tonic::transport::Error>
where
    S: futures_util::Stream<Item = Result<IO, io::Error>> + Unpin,
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let admitted = Arc::new(tokio::sync::Semaphore::new(max_connections));
    // Logged when the cap is first reached, again after it was left.
    let mut at_cap = false;
    loop {
        let next = tokio::select! {
            () = accept_stop.cancelled() => return Ok(()),
            next = incoming.next() => next,
        };
        match next {
            None => return Ok(()),
            Some(Ok(io)) => {
                let Ok(permit) = admitted.clone().try_acquire_owned() else {
                    if !at_cap {
                        warn!(
                            limit = max_connections,
                            "--max-http-connections reached; refusing CONNECT clients with 503"
                        );
                    }
                    at_cap = true;
                    hub.metrics.limit_reached(Limit::HttpConnections);
                    tasks.spawn(http_connect::refuse(io));
                    continue;
                };
                at_cap = false;
                let hub = hub.clone();
                let shutdown = shutdown.clone();
                tasks.spawn(async move {
                    http_connect::serve_connection(io, hub, shutdown).await;
                    drop(permit);
                });
            }
            Some(Err(error)) => {
                warn!(%error, "accepting a frontend connection failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
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
        let metrics = Arc::new(ServerMetrics::new(&config.strategies));
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
        let frontend = match &config.frontend {
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
                tls: frontend_tls.expect("loaded above for a TCP frontend"),
            },
        };
        let health = bind_named(config.health_addr, "health").await?;
        let admin = bind_named(config.admin_addr, "admin").await?;
        let hub = Arc::new(Hub::new(
            &config.strategies,
            config.backend_dial_timeout,
            metrics,
        ));
        let token_auth = match &config.token_auth {
            Some(auth) => Some(Arc::new(crate::auth::TokenAuth::new(auth.clone()).await?)),
            None => None,
        };
        Ok(Bound {
            config,
            agent_tls,
            agent,
            frontend,
            health,
            admin,
            hub,
            token_auth,
        })
    }
}

/// Creates the frontend socket with mode 0770, as ANP does with umask 0007.
fn bind_uds(path: &Path, delete_existing: bool) -> io::Result<UnixListener> {
    if delete_existing {
        match std::fs::remove_file(path) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
    }
    let listener = UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o770))?;
    Ok(listener)
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
        tls: TlsFiles<rustls::ServerConfig>,
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
    agent_tls: TlsFiles<rustls::ServerConfig>,
    /// Agent listener.
    agent: TcpListener,
    /// Frontend listener.
    frontend: BoundFrontend,
    /// Health listener.
    health: TcpListener,
    /// Admin listener (`/metrics`, pprof).
    admin: TcpListener,
    /// The routing core and the streams' links.
    hub: Arc<Hub>,
    /// Agent token authentication, if on.
    token_auth: Option<Arc<crate::auth::TokenAuth>>,
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
            hub: self.hub.clone(),
        }
    }

    /// Serves until `shutdown` resolves, then stops every listener and
    /// closes every agent and frontend stream.
    ///
    /// # Errors
    /// A gRPC server failed.
    pub async fn serve(self, shutdown: impl Future<Output = ()>) -> Result<(), ServerError> {
        let Self {
            config,
            agent_tls,
            agent,
            frontend,
            health,
            admin,
            hub,
            token_auth,
        } = self;
        // One tree of ends: `token` ends every stream and connection, and
        // with it its children, `accept_stop` (accepting ends first in a
        // graceful shutdown) and `lease_stop` (the lease goes before that).
        // Every task is tracked: `tasks` has the streams' and connections',
        // `listeners` the servers' and the lease's.
        let token = CancellationToken::new();
        let accept_stop = token.child_token();
        let lease_stop = token.child_token();
        let tasks = TaskTracker::new();
        let listeners = TaskTracker::new();
        let agent_local = agent.local_addr().ok();
        info!(server.id = %config.server_id, server.count = config.server_count, "proxy-server starting");
        let on_handshake_limit: tunnel::conn::OnLimit = {
            let metrics = hub.metrics.clone();
            Arc::new(move || metrics.limit_reached(Limit::TlsHandshakes))
        };

        let agent_service = AgentServiceServer::new(AgentServiceImpl {
            hub: hub.clone(),
            server_id: config.server_id.clone(),
            server_count: config.server_count,
            tasks: tasks.clone(),
            shutdown: token.clone(),
            flow_control: config.flow_control,
            token_auth,
            queue_bytes: config.max_agent_queue_bytes,
        });
        let agent_server = Server::builder()
            .max_frame_size(flow::H2_MAX_FRAME_SIZE)
            .initial_stream_window_size(flow::H2_STREAM_WINDOW)
            .initial_connection_window_size(flow::H2_CONNECTION_WINDOW)
            .http2_keepalive_interval(Some(config.keepalive_time))
            .http2_keepalive_timeout(Some(tunnel::flow::keepalive_timeout(config.keepalive_time)))
            .add_service(agent_service)
            .serve_with_incoming_shutdown(
                tls_incoming(
                    agent,
                    agent_tls.clone(),
                    accept_stop.clone(),
                    "agent",
                    config.max_tls_handshakes,
                    on_handshake_limit.clone(),
                ),
                accept_stop.clone().cancelled_owned(),
            );

        let proxy_service = ProxyServiceServer::new(ProxyServiceImpl {
            hub: hub.clone(),
            tasks: tasks.clone(),
            shutdown: token.clone(),
        });
        let frontend_builder = Server::builder()
            .max_frame_size(flow::H2_MAX_FRAME_SIZE)
            .max_concurrent_streams(FRONTEND_MAX_STREAMS)
            .initial_stream_window_size(FRONTEND_STREAM_WINDOW)
            .initial_connection_window_size(FRONTEND_CONNECTION_WINDOW)
            .http2_keepalive_interval(Some(config.frontend_keepalive_time))
            .http2_keepalive_timeout(Some(tunnel::flow::keepalive_timeout(
                config.frontend_keepalive_time,
            )));
        let (frontend_server, uds_path): (FrontendFuture, _) = match (config.mode, frontend) {
            (Mode::Grpc, BoundFrontend::Uds { listener, path }) => {
                info!(frontend.path = %path.display(), "frontend listening (grpc over unix socket)");
                // Any `:authority` is accepted on the socket: kube-apiserver
                // sends the socket's path, which h2 refuses by itself. Reads
                // take up to 64 KiB per system call: h2 asks for 8 KiB at a
                // time, and grpc-go's uploads come in 16 KiB frames.
                let incoming = UnixListenerStream::new(listener).map(|accepted| {
                    accepted.map(|socket| AnyAuthority::new(ReadAhead::new(socket)))
                });
                let server = frontend_builder
                    .clone()
                    .add_service(proxy_service)
                    .serve_with_incoming_shutdown(incoming, accept_stop.clone().cancelled_owned());
                (Box::pin(server), Some(path))
            }
            (Mode::Grpc, BoundFrontend::Tcp { listener, tls }) => {
                info!(frontend.addr = ?listener.local_addr().ok(), "frontend listening (grpc over mTLS)");
                let server = frontend_builder
                    .clone()
                    .add_service(proxy_service)
                    .serve_with_incoming_shutdown(
                        tls_incoming(
                            listener,
                            tls,
                            accept_stop.clone(),
                            "frontend",
                            config.max_tls_handshakes,
                            on_handshake_limit.clone(),
                        ),
                        accept_stop.clone().cancelled_owned(),
                    );
                (Box::pin(server), None)
            }
            (Mode::HttpConnect, BoundFrontend::Uds { listener, path }) => {
                info!(frontend.path = %path.display(), "frontend listening (http-connect over unix socket)");
                let incoming = UnixListenerStream::new(listener);
                let server = serve_http_connect(
                    incoming,
                    hub.clone(),
                    config.max_http_connections,
                    tasks.clone(),
                    accept_stop.clone(),
                    token.clone(),
                );
                (Box::pin(server), Some(path))
            }
            (Mode::HttpConnect, BoundFrontend::Tcp { listener, tls }) => {
                info!(frontend.addr = ?listener.local_addr().ok(), "frontend listening (http-connect over mTLS)");
                let incoming = tls_incoming(
                    listener,
                    tls,
                    accept_stop.clone(),
                    "frontend",
                    config.max_tls_handshakes,
                    on_handshake_limit.clone(),
                );
                let server = serve_http_connect(
                    incoming,
                    hub.clone(),
                    config.max_http_connections,
                    tasks.clone(),
                    accept_stop.clone(),
                    token.clone(),
                );
                (Box::pin(server), None)
            }
        };
        info!(agent.addr = ?agent_local, health.addr = ?health.local_addr().ok(), "listening");

        let health_state = health::HealthState { hub: hub.clone() };
        let admin_local = admin.local_addr().ok();
        let admin_server = ops::http::serve(
            admin,
            health::admin_router(health_state.clone(), config.profiling),
            token.clone(),
            "admin",
        );
        let health_server = ops::http::serve(
            health,
            health::router(health_state),
            token.clone(),
            "health",
        );
        info!(admin.addr = ?admin_local, profiling = config.profiling, "admin listening");

        let agent_task = listeners.spawn(agent_server);
        let frontend_task = listeners.spawn(frontend_server);
        let health_task = listeners.spawn(async move {
            let _ = tokio::join!(health_server, admin_server);
        });
        let lease_task = config.lease.clone().map(|lease| {
            listeners.spawn(crate::lease::run(
                lease,
                config.server_id.clone(),
                hub.metrics.clone(),
                lease_stop.clone(),
            ))
        });

        // The dial timers (`--backend-dial-timeout`).
        tasks.spawn({
            let hub = hub.clone();
            let token = token.clone();
            async move { hub.run_timers(token).await }
        });
        if let Some(limit) = config.frontend_stall_timeout {
            let hub = hub.clone();
            let token = token.clone();
            tasks.spawn(async move {
                let mut ticks = tokio::time::interval(stall_check_interval(limit));
                ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    tokio::select! {
                        () = token.cancelled() => return,
                        _ = ticks.tick() => hub.close_stalled(limit),
                    }
                }
            });
        }

        shutdown.await;
        // The lease goes first: lease-counting agents stop counting us.
        lease_stop.cancel();
        accept_stop.cancel();
        if let Some(grace) = config.graceful_shutdown_timeout {
            info!(timeout = ?grace, connections = hub.established_count(), "stopped accepting; letting open connections finish");
            let idle = async {
                while hub.established_count() > 0 || hub.pending_count() > 0 {
                    tokio::time::sleep(GRACE_POLL).await;
                }
            };
            if tokio::time::timeout(grace, idle).await.is_err() {
                warn!(
                    connections = hub.established_count(),
                    "graceful shutdown timed out; closing the rest"
                );
            }
        }
        info!("stopping");
        token.cancel();
        tasks.close();
        listeners.close();
        let aborts = [
            agent_task.abort_handle(),
            frontend_task.abort_handle(),
            health_task.abort_handle(),
        ];
        let stopped = async {
            let agent = agent_task.await;
            let frontend = frontend_task.await;
            let _ = health_task.await;
            if let Some(lease) = lease_task {
                let _ = lease.await;
            }
            listeners.wait().await;
            tasks.wait().await;
            (agent, frontend)
        };
        let result = match tokio::time::timeout(STOP_GRACE, stopped).await {
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
        };
        hub.end_backends();
        if let Some(path) = uds_path {
            let _ = std::fs::remove_file(path);
        }
        info!("stopped");
        result
    }
}

/// Observes a running server.
#[derive(Clone)]
pub struct ServerHandle {
    /// The routing core and the streams' links.
    hub: Arc<Hub>,
}

impl ServerHandle {
    /// Connected agent streams.
    pub fn backend_count(&self) -> usize {
        self.hub.backend_count()
    }

    /// Frontend streams (gRPC streams and CONNECT clients past their head).
    pub fn frontend_count(&self) -> usize {
        self.hub.frontend_count()
    }

    /// Dials waiting for an agent's answer.
    pub fn pending_dials(&self) -> usize {
        self.hub.pending_count()
    }

    /// Established end-to-end connections.
    pub fn established_connections(&self) -> usize {
        self.hub.established_count()
    }

    /// The agent id of every connected agent stream, sorted.
    pub fn agent_ids(&self) -> Vec<String> {
        let mut ids: Vec<String> = self
            .hub
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
        self.hub.live().max_buffered
    }

    /// Agent streams that announced DRAIN.
    pub fn draining_backends(&self) -> usize {
        self.hub
            .agents()
            .iter()
            .filter(|(_, draining, _)| *draining)
            .count()
    }

    /// The address each connected agent stream comes from.
    pub fn agent_peers(&self) -> Vec<SocketAddr> {
        self.hub
            .agents()
            .into_iter()
            .filter_map(|(_, _, peer)| peer)
            .collect()
    }

    /// What `/readyz` says.
    pub fn is_ready(&self) -> bool {
        self.hub.is_ready()
    }
}
