//! [`Client`]: one `AgentService/Connect` stream to one proxy-server replica.

use std::{
    io,
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    task::{Context, Poll},
    time::Duration,
};

use edge::{egress, io::Io, read_ahead::ReadAhead};
use futures_util::StreamExt;
use proto::{Packet, agent_service_client::AgentServiceClient, header};
use rustls_pki_types::ServerName;
use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    net::TcpStream,
};
use tokio_rustls::TlsConnector;
use tokio_util::{sync::CancellationToken, task::TaskTracker};
use tonic::{
    Request, Streaming,
    metadata::{MetadataMap, MetadataValue},
    transport::{Channel, Endpoint},
};
use tracing::{Instrument, debug, debug_span, warn};
use tunnel::blocked::when_blocked;
use tunnel::{
    flow::{self, Flow, Refused, Scheme, Window},
    ids::ServerId,
    mover::{ControlSink, QueueUpstream, WindowDownstream},
    queue::QueueTx,
};

use crate::{
    audit::{self, AgentAudit, AgentDial},
    config::{Config, ServerAddr},
    destinations::Destinations,
    endpoint::{self, ConnDriver, ConnEnd, Connections, EndpointConn, EndpointDialError},
    metrics::{AgentMetrics, Direction, Segment},
    outbound::ToServer,
    table::{DialTicket, Dialed, Step},
};

/// How long the TCP connect, TLS handshake and gRPC headers may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);
/// Room for control packets beyond `--max-server-queue-bytes` (see
/// [`tunnel::queue`]): past it the server has stopped reading.
const CONTROL_RESERVE: usize = 1024 * 1024;

/// Why a connection to proxy-server failed.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// TCP connect failed.
    #[error("cannot connect to proxy-server {server}")]
    Tcp {
        /// `host:port`.
        server: String,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The proxy did not give us a connection to the server.
    #[error(transparent)]
    Proxy(#[from] egress::ProxyError),
    /// The TLS handshake failed (untrusted certificate, refused client cert, …).
    #[error("TLS handshake with proxy-server {server} failed")]
    Tls {
        /// `host:port`.
        server: String,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// `--proxy-server-host` is not a valid TLS server name.
    #[error("--proxy-server-host {0:?} is not a valid TLS server name")]
    ServerName(String),
    /// No answer within [`CONNECT_TIMEOUT`].
    #[error("proxy-server {server} did not answer within {CONNECT_TIMEOUT:?}")]
    Timeout {
        /// `host:port`.
        server: String,
    },
    /// The HTTP/2 connection could not be set up.
    #[error("HTTP/2 with proxy-server {server} failed")]
    Transport {
        /// `host:port`.
        server: String,
        /// Why.
        #[source]
        source: tonic::transport::Error,
    },
    /// The server refused the `Connect` call.
    #[error("proxy-server {server} refused the connection: {status}")]
    Refused {
        /// `host:port`.
        server: String,
        /// The gRPC status.
        status: tonic::Status,
    },
    /// The service-account token file could not be read.
    #[error("cannot read --service-account-token-path {path}")]
    Token {
        /// The file.
        path: std::path::PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The token is not valid header text.
    #[error("the token in --service-account-token-path {path} is not valid header text")]
    TokenText {
        /// The file.
        path: std::path::PathBuf,
    },
    /// The server announced flow-control numbers we cannot use.
    #[error("proxy-server {server} announced an invalid flow-control window")]
    FlowControl {
        /// `host:port`.
        server: String,
        /// What is wrong.
        #[source]
        source: flow::WindowError,
    },
    /// The response headers lack a valid `serverid`/`servercount`.
    #[error("proxy-server {server} sent an invalid {header} header")]
    Header {
        /// `host:port`.
        server: String,
        /// The header.
        header: &'static str,
    },
}

impl ConnectError {
    /// Whether the connection failed before the server said anything of
    /// it: nothing listening (a restarting server), the socket closed
    /// during the handshake (a server shedding load), no route or no
    /// answer (a network partition). Such a failure says nothing against
    /// the next try, so it is retried within one `--sync-interval` rather
    /// than after a growing backoff: the agent is back as soon as the
    /// server or the link is.
    pub fn is_transient(&self) -> bool {
        let cut = |e: &io::Error| {
            matches!(
                e.kind(),
                io::ErrorKind::ConnectionRefused
                    | io::ErrorKind::ConnectionReset
                    | io::ErrorKind::ConnectionAborted
                    | io::ErrorKind::UnexpectedEof
                    | io::ErrorKind::BrokenPipe
                    | io::ErrorKind::HostUnreachable
                    | io::ErrorKind::NetworkUnreachable
                    | io::ErrorKind::NetworkDown
                    | io::ErrorKind::TimedOut
            )
        };
        match self {
            Self::Tcp { source, .. } | Self::Tls { source, .. } => cut(source),
            Self::Timeout { .. } => true,
            _ => false,
        }
    }
}

/// How long a direct TCP connect to a server may take: one
/// `--sync-interval`, at least a second. A connect lost in a partition is
/// given up then, so a new one goes out soon after the link is back.
fn tcp_timeout(config: &Config) -> Duration {
    config.sync_interval.max(Duration::from_secs(1))
}

/// A freshly opened stream, not yet serving.
pub struct Client {
    /// The server's id (`serverid`).
    pub server_id: ServerId,
    /// The replica count the server announced (`servercount`).
    pub server_count: u32,
    /// What both ends agreed on flow control (see `tunnel::flow`).
    pub scheme: Scheme,
    /// Packets from the server.
    inbound: Streaming<Packet>,
    /// Packets to the server, bounded in bytes.
    out_tx: QueueTx<Packet>,
    /// What the agent records.
    metrics: Arc<AgentMetrics>,
    /// Keeps the HTTP/2 connection alive while the client lives.
    _channel: Channel,
    /// The connection's transport, for the probe.
    transport: TransportEnd,
    /// How often the probe checks it (`--probe-interval`).
    probe_interval: Duration,
    /// Spans of dials (`--tracing-config-file`).
    tracing: ops::otel::Tracing,
    /// The destination policy its dials follow.
    destinations: Destinations,
    /// Where its dials' audit records go.
    audit: AgentAudit,
}

/// Whether a server connection's TCP/TLS transport has ended (a flag its
/// I/O sets). ANP's probe checks that the gRPC connection state is `Ready`
/// every `--probe-interval`; this is the same check on our transport.
#[derive(Clone, Default)]
struct TransportEnd {
    /// Set once the transport hit EOF, failed or was dropped.
    closed: Arc<AtomicBool>,
}

impl TransportEnd {
    /// Wraps `io` so that its end is seen here.
    fn watch<T>(&self, io: T) -> EndNoted<T> {
        EndNoted {
            io,
            closed: self.closed.clone(),
        }
    }

    fn is_open(&self) -> bool {
        !self.closed.load(Ordering::Relaxed)
    }

    /// Resolves once a check finds the transport closed.
    async fn probe(&self, interval: Duration) {
        let mut ticks = tokio::time::interval(interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        while self.is_open() {
            ticks.tick().await;
        }
    }
}

/// An I/O object that records its own end in a [`TransportEnd`].
struct EndNoted<T> {
    io: T,
    closed: Arc<AtomicBool>,
}

impl<T> Drop for EndNoted<T> {
    fn drop(&mut self) {
        self.closed.store(true, Ordering::Relaxed);
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for EndNoted<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.io).poll_read(cx, buf);
        if let Poll::Ready(result) = &polled
            && (result.is_err() || (buf.filled().len() == before && buf.remaining() > 0))
        {
            // Failed, or EOF.
            self.closed.store(true, Ordering::Relaxed);
        }
        polled
    }
}

// A failed write fails the reads too (hyper reads the connection all the
// time), and hyper drops the transport once it is done with it.
edge::forward_write!([T: AsyncWrite + Unpin] EndNoted<T>, io);

impl Client {
    /// Opens TCP, TLS (with `tls`: the agent passes its files as they are
    /// now, see [`ClientTls::follow`](crate::config::ClientTls::follow)),
    /// HTTP/2 and the `Connect` stream, and reads the server's id and count.
    ///
    /// # Errors
    /// Each step's failure, naming the server.
    pub async fn connect(
        config: &Config,
        tls: Arc<rustls::ClientConfig>,
        target: &ServerAddr,
        metrics: Arc<AgentMetrics>,
    ) -> Result<Self, ConnectError> {
        let server = target.to_string();
        tokio::time::timeout(
            CONNECT_TIMEOUT,
            Self::connect_inner(config, tls, target, &server, metrics),
        )
        .await
        .map_err(|_| ConnectError::Timeout {
            server: server.clone(),
        })?
    }

    async fn connect_inner(
        config: &Config,
        tls: Arc<rustls::ClientConfig>,
        target: &ServerAddr,
        server: &str,
        metrics: Arc<AgentMetrics>,
    ) -> Result<Self, ConnectError> {
        let transport = TransportEnd::default();
        let io = transport.watch(Self::tls(tls, target, server, tcp_timeout(config)).await?);
        let endpoint = Endpoint::from_shared(format!("http://{server}"))
            .map_err(|source| ConnectError::Transport {
                server: server.to_owned(),
                source,
            })?
            .max_frame_size(edge::h2::MAX_FRAME_SIZE)
            .initial_stream_window_size(edge::h2::STREAM_WINDOW)
            .initial_connection_window_size(edge::h2::CONNECTION_WINDOW)
            .http2_keep_alive_interval(config.keepalive_time)
            .keep_alive_timeout(edge::h2::keepalive_timeout(config.keepalive_time))
            .keep_alive_while_idle(true);
        let channel = edge::h2::channel_over(endpoint, io)
            .await
            .map_err(|source| ConnectError::Transport {
                server: server.to_owned(),
                source,
            })?;
        let (out_tx, out_rx) = tunnel::queue::queue(config.max_server_queue_bytes, CONTROL_RESERVE);
        let counting = metrics.clone();
        let outbound = out_rx.map(move |packet: Packet| {
            counting.packets.count(Segment::FromAgent, packet.r#type);
            // Flow-control credits travel as DATA; they carry no bytes.
            if let Some(proto::Payload::Data(data)) = &packet.payload
                && packet.r#type == proto::PacketType::Data as i32
            {
                counting
                    .bytes
                    .get(Direction::ToServer)
                    .inc_by(data.data.len() as f64);
            }
            packet
        });
        let mut request = Request::new(outbound);
        request_metadata(config, server, request.metadata_mut()).await?;
        let response = AgentServiceClient::new(channel.clone())
            .connect(request)
            .await
            .map_err(|status| ConnectError::Refused {
                server: server.to_owned(),
                status,
            })?;
        let (server_id, server_count, scheme) =
            response_headers(config, server, response.metadata())?;
        Ok(Self {
            server_id,
            server_count,
            scheme,
            inbound: response.into_inner(),
            out_tx,
            destinations: Destinations::allow_all(metrics.clone()),
            audit: AgentAudit::disabled(),
            metrics,
            _channel: channel,
            transport,
            probe_interval: config.probe_interval,
            tracing: config.tracing.clone(),
        })
    }

    /// The client with its dials following `destinations` (without it,
    /// every destination is allowed).
    #[must_use]
    pub fn with_destinations(mut self, destinations: Destinations) -> Self {
        self.destinations = destinations;
        self
    }

    /// The client with an audit record of each of its dials to `audit`.
    #[must_use]
    pub fn with_audit(mut self, audit: AgentAudit) -> Self {
        self.audit = audit;
        self
    }

    /// Renews the TLS session tickets `tls` keeps for `target`: a resumed
    /// handshake on a connection of its own, which brings fresh tickets
    /// before the server's first bytes, then a close. The server sees a
    /// connection that ends before its HTTP/2 preface.
    ///
    /// # Errors
    /// The connection or the handshake failed, or the server said nothing
    /// within [`CONNECT_TIMEOUT`].
    pub async fn refresh_session(
        config: &Config,
        tls: Arc<rustls::ClientConfig>,
        target: &ServerAddr,
    ) -> Result<(), ConnectError> {
        use tokio::io::AsyncReadExt as _;
        let server = target.to_string();
        let refresh = async {
            let mut conn = Self::tls(tls, target, &server, tcp_timeout(config)).await?;
            // The tickets come after the handshake, before the server's
            // HTTP/2 SETTINGS: reading those reads them.
            let mut first = [0u8; 1];
            conn.read(&mut first)
                .await
                .map_err(|source| ConnectError::Tls {
                    server: server.clone(),
                    source,
                })?;
            Ok(())
        };
        tokio::time::timeout(CONNECT_TIMEOUT, refresh)
            .await
            .map_err(|_| ConnectError::Timeout {
                server: server.clone(),
            })?
    }

    /// TCP (through the egress proxy, if any; a direct connect within
    /// `tcp_timeout`) and TLS to `target`.
    async fn tls(
        tls: Arc<rustls::ClientConfig>,
        target: &ServerAddr,
        server: &str,
        tcp_timeout: Duration,
    ) -> Result<tokio_rustls::client::TlsStream<ReadAhead<Box<dyn Io>>>, ConnectError> {
        let tcp: Box<dyn Io> = match &target.proxy {
            Some(proxy) => egress::connect(proxy, &target.host, target.port).await?,
            None => {
                let connect = TcpStream::connect((target.host.as_str(), target.port));
                let tcp = tokio::time::timeout(tcp_timeout, connect)
                    .await
                    .unwrap_or_else(|_| {
                        Err(io::Error::new(
                            io::ErrorKind::TimedOut,
                            format!("no answer to the TCP connect within {tcp_timeout:?}"),
                        ))
                    })
                    .map_err(|source| ConnectError::Tcp {
                        server: server.to_owned(),
                        source,
                    })?;
                let _ = tcp.set_nodelay(true);
                Box::new(tcp)
            }
        };
        let name = ServerName::try_from(target.host.clone())
            .map_err(|_| ConnectError::ServerName(target.host.clone()))?;
        // Reads up to 64 KiB per system call under TLS (see `ReadAhead`).
        TlsConnector::from(tls)
            .connect(name, ReadAhead::new(tcp))
            .await
            .map_err(|source| ConnectError::Tls {
                server: server.to_owned(),
                source,
            })
    }

    /// What the agent records.
    pub fn metrics(&self) -> &AgentMetrics {
        &self.metrics
    }

    /// Sender for packets to this server (DRAIN, …).
    pub fn sender(&self) -> QueueTx<Packet> {
        self.out_tx.clone()
    }

    /// Serves the stream until it ends or `cancel` fires; every connection of
    /// the stream is closed when it returns.
    pub async fn serve(self, conns: Connections, cancel: CancellationToken) {
        let Self {
            mut inbound,
            out_tx,
            server_id,
            scheme,
            _channel,
            transport,
            probe_interval,
            metrics,
            tracing,
            destinations,
            audit,
            ..
        } = self;
        let tasks = TaskTracker::new();
        let dispatcher = Dispatcher {
            conns: conns.clone(),
            to_server: ToServer::new(out_tx, cancel.clone(), metrics.clone()),
            tasks: tasks.clone(),
            scheme,
            metrics: metrics.clone(),
            tracing,
            destinations,
            audit: (audit, server_id.0.clone()),
        };
        let end = dispatcher
            .read(&mut inbound, &transport, probe_interval, &cancel)
            .await;
        debug!(server.id = %server_id, ?end, "server stream ended");
        cancel.cancel();
        // Dials and connections leave the table now; their tasks end with
        // `cancel` (their tokens are its children) and answer nothing.
        drop(conns.lock().stream_ended());
        tasks.close();
        tasks.wait().await;
    }
}

/// The `Connect` call's metadata: the agent's id, flow control with its
/// window, its token, its identifiers.
async fn request_metadata(
    config: &Config,
    server: &str,
    metadata: &mut MetadataMap,
) -> Result<(), ConnectError> {
    let invalid = |header| ConnectError::Header {
        server: server.to_owned(),
        header,
    };
    metadata.insert(
        header::AGENT_ID,
        MetadataValue::try_from(config.agent_id.0.as_str())
            .map_err(|_| invalid(header::AGENT_ID))?,
    );
    if config.flow_control {
        for (key, value) in config.flow_window.headers(config.flow_version) {
            metadata.insert(
                key,
                MetadataValue::try_from(value).map_err(|_| invalid(key))?,
            );
        }
    }
    if let Some(path) = &config.token_path {
        // Re-read on every connect: projected tokens rotate. The raw file
        // content is sent, untrimmed, as ANP does.
        let token = tokio::fs::read(path)
            .await
            .map_err(|source| ConnectError::Token {
                path: path.clone(),
                source,
            })?;
        let mut value = header::BEARER_PREFIX.as_bytes().to_vec();
        value.extend_from_slice(&token);
        let mut value = MetadataValue::try_from(value.as_slice())
            .map_err(|_| ConnectError::TokenText { path: path.clone() })?;
        value.set_sensitive(true);
        metadata.insert(header::AUTHORIZATION, value);
    }
    if !config.agent_identifiers.is_empty() {
        metadata.insert(
            header::AGENT_IDENTIFIERS,
            MetadataValue::try_from(config.agent_identifiers.as_str())
                .map_err(|_| invalid(header::AGENT_IDENTIFIERS))?,
        );
    }
    Ok(())
}

/// The server's id, its replica count and the flow-control scheme, from
/// its response headers.
fn response_headers(
    config: &Config,
    server: &str,
    metadata: &MetadataMap,
) -> Result<(ServerId, u32, Scheme), ConnectError> {
    let text = |key: &'static str| metadata.get(key).and_then(|v| v.to_str().ok());
    let invalid = |header| ConnectError::Header {
        server: server.to_owned(),
        header,
    };
    let server_id = ServerId(
        text(header::SERVER_ID)
            .ok_or(invalid(header::SERVER_ID))?
            .to_owned(),
    );
    let server_count = text(header::SERVER_COUNT)
        .and_then(|count| count.parse::<u32>().ok())
        .ok_or(invalid(header::SERVER_COUNT))?;
    let theirs = Window::announced(text).map_err(|source| ConnectError::FlowControl {
        server: server.to_owned(),
        source,
    })?;
    let scheme = Scheme::negotiate(
        config.flow_control,
        config.flow_version,
        config.flow_window,
        theirs,
    );
    Ok((server_id, server_count, scheme))
}

/// Why a server stream's reader stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum StreamEnd {
    /// The agent ended the stream (`cancel`: it is stopping, or the server
    /// stopped reading).
    Cancelled,
    /// The server ended the stream with an OK status (grpc-go's `io.EOF`,
    /// which ANP does not count).
    Closed,
    /// Receiving failed, with this code; counted, as ANP counts every
    /// failed `Recv`.
    Failed(tonic::Code),
}

/// Carries out the connection table's steps for one server stream: the
/// stream reader hands it each packet; dial and connection tasks report to
/// the table themselves.
struct Dispatcher {
    /// Connections and dials of this stream.
    conns: Connections,
    /// Packets to the server.
    to_server: ToServer,
    /// Dial and connection tasks.
    tasks: TaskTracker,
    /// What the stream agreed on flow control.
    scheme: Scheme,
    /// What the agent records.
    metrics: Arc<AgentMetrics>,
    /// Spans of dials.
    tracing: ops::otel::Tracing,
    /// The destination policy.
    destinations: Destinations,
    /// Where the audit records of its dials go, and the server's id.
    audit: (AgentAudit, String),
}

/// Adds the time a reader waited to the blocked-time counter when dropped.
struct BlockedTimer<'a>(std::time::Instant, &'a AgentMetrics);

impl Drop for BlockedTimer<'_> {
    fn drop(&mut self) {
        self.1.blocked(self.0.elapsed());
    }
}

impl Dispatcher {
    /// Reads `inbound` (the stream from the server, whose connection
    /// `transport` is) and handles each packet, until the stream ends, the
    /// probe finds the connection closed (every `probe_interval`), or
    /// `cancel` fires; why it stopped.
    ///
    /// A server that dies (a crash, a SIGKILL) fails the stream however the
    /// agent learns of it: by the stream's error, or by the probe when that
    /// looks first (its tick and the error can be due at the same poll, and
    /// `select!` takes either). Both count as the failed `Recv` that ANP's
    /// agent sees then, with grpc-go's code for a connection that is gone,
    /// `Unavailable` (tonic's code only says how the bytes stopped:
    /// `Unknown` for TLS cut without close_notify).
    async fn read<S>(
        &self,
        inbound: &mut S,
        transport: &TransportEnd,
        probe_interval: Duration,
        cancel: &CancellationToken,
    ) -> StreamEnd
    where
        S: futures_util::Stream<Item = Result<Packet, tonic::Status>> + Unpin,
    {
        let probe = transport.probe(probe_interval);
        tokio::pin!(probe);
        let end = loop {
            let packet = tokio::select! {
                () = cancel.cancelled() => break StreamEnd::Cancelled,
                () = &mut probe => {
                    warn!("connection to the server is closed; dropping it");
                    break StreamEnd::Failed(tonic::Code::Unavailable);
                }
                packet = inbound.next() => packet,
            };
            match packet {
                // Handling waits only for room on a connection's queue
                // (without flow control); a cancel must still get through.
                Some(Ok(packet)) => {
                    self.metrics.packets.count(Segment::ToAgent, packet.r#type);
                    let handled = when_blocked(self.handle(packet), || {
                        BlockedTimer(std::time::Instant::now(), &self.metrics)
                    });
                    tokio::select! {
                        () = cancel.cancelled() => break StreamEnd::Cancelled,
                        () = handled => {}
                    }
                }
                None => break StreamEnd::Closed,
                Some(Err(status)) => {
                    warn!(error = %status, "server stream failed");
                    let code = if transport.is_open() {
                        status.code()
                    } else {
                        tonic::Code::Unavailable
                    };
                    break StreamEnd::Failed(code);
                }
            }
        };
        if let StreamEnd::Failed(code) = end {
            self.metrics.receive_failed(code);
        }
        end
    }

    async fn handle(&self, packet: Packet) {
        // One lock of this stream's table: the step and the handle it needs.
        let (step, handle) = {
            let mut table = self.conns.lock();
            let step = table.handle(packet);
            let handle = match step {
                Step::Deliver { conn, .. } | Step::Grant { conn, .. } => table
                    .conn(conn)
                    .map(|c| (c.inbound.clone(), c.flow.clone())),
                _ => None,
            };
            (step, handle)
        };
        match step {
            Step::Dial {
                ticket,
                protocol,
                address,
                traceparent,
                cancel,
            } => {
                let span = self.dial_span(&protocol, &address, &traceparent);
                self.spawn_dial(ticket, protocol, address, (cancel, span));
            }
            Step::Deliver { conn, data } => {
                let Some((inbound, _)) = handle else { return };
                self.metrics
                    .bytes
                    .get(Direction::ToEndpoint)
                    .inc_by(data.len() as f64);
                // With credit the server keeps within our window and this
                // never waits; an ANP server sends without credit, and this
                // waits while the destination drains, and gives up if it
                // stalls. Closed: the connection is ending; its task answers.
                if inbound.send(data).await == Err(Refused::Overflow) {
                    warn!(conn.id = %conn, "connection closed: its destination reads too slowly");
                    if let Some(handle) = self.conns.lock().remove(conn) {
                        handle.overflow.cancel();
                    }
                }
            }
            Step::Grant { credit, .. } => {
                if let Some((_, flow)) = handle {
                    flow.grant(credit);
                }
            }
            Step::Close { conn, handle } => {
                // Dropped: its mover writes what is queued, then the
                // connection task answers CLOSE_RSP (within CLOSE_DRAIN).
                debug!(conn.id = %conn, "server closes connection");
                handle.closing.cancel();
            }
            Step::CancelDial(cancel) => {
                debug!("dial cancelled by the server");
                cancel.cancel();
            }
            Step::Reply(packet) => self.control(packet),
            Step::Ignore(why) => debug!(why, "packet from the server ignored"),
        }
    }

    /// Sends a control packet without waiting (see [`ToServer::control`]).
    fn control(&self, packet: Packet) {
        self.to_server.control(packet);
    }

    /// The OpenTelemetry span of a dial: the child of the server's dial
    /// span when the DIAL_REQ carried its context.
    fn dial_span(&self, protocol: &str, address: &str, traceparent: &str) -> ops::otel::Span {
        if !self.tracing.is_on() {
            return ops::otel::Span::none();
        }
        let parent = ops::otel::Parent::parse(traceparent);
        let mut span =
            self.tracing
                .span("proxy-agent dial", ops::otel::Kind::Server, parent.as_ref());
        span.set(|| {
            vec![
                ops::otel::Attr::new("konnectivity.destination", address.to_owned()),
                ops::otel::Attr::new("konnectivity.protocol", protocol.to_owned()),
            ]
        });
        span
    }

    fn spawn_dial(
        &self,
        ticket: DialTicket,
        protocol: String,
        address: String,
        (cancel, otel): (CancellationToken, ops::otel::Span),
    ) {
        let span =
            debug_span!("conn", dial.id = %ticket.dial, %address, conn.id = tracing::field::Empty);
        let dial = Dial {
            conns: self.conns.clone(),
            to_server: self.to_server.clone(),
            scheme: self.scheme,
            metrics: self.metrics.clone(),
            destinations: self.destinations.clone(),
        };
        let record = self.audit.0.dial(&self.audit.1, ticket.dial.0, &address);
        self.tasks.spawn(
            dial.run(ticket, (protocol, address), cancel, (otel, record))
                .instrument(span),
        );
    }
}

/// One DIAL_REQ's task: what it needs from its stream's dispatcher.
struct Dial {
    conns: Connections,
    to_server: ToServer,
    scheme: Scheme,
    metrics: Arc<AgentMetrics>,
    destinations: Destinations,
}

impl Dial {
    /// Dials `address`, answers DIAL_RSP, then carries the connection until
    /// it ends; `cancel` is DIAL_CLS or the stream's end.
    async fn run(
        self,
        ticket: DialTicket,
        (protocol, address): (String, String),
        cancel: CancellationToken,
        (mut otel, mut record): (ops::otel::Span, Option<AgentDial>),
    ) {
        let started = std::time::Instant::now();
        let policy = self.destinations.current();
        let dialed = tokio::select! {
            // DIAL_CLS or the stream's end: it has left the table.
            () = cancel.cancelled() => {
                otel.set(|| vec![ops::otel::Attr::new("konnectivity.end", "cancelled")]);
                if let Some(record) = record {
                    record.finish(audit::cancelled(), None, (0, 0));
                }
                return;
            }
            dialed = endpoint::dial(&protocol, &address, &policy) => dialed,
        };
        match &dialed {
            Ok(connected) => otel.set(|| {
                vec![
                    ops::otel::Attr::new(
                        "konnectivity.resolved_address",
                        connected.addr.to_string(),
                    ),
                    ops::otel::Attr::new("konnectivity.policy", connected.verdict.to_string()),
                    ops::otel::Attr::new("konnectivity.end", "connected"),
                ]
            }),
            Err(error) => {
                let end = match error {
                    EndpointDialError::Denied { .. } => "denied",
                    _ => "failed",
                };
                otel.set(|| vec![ops::otel::Attr::new("konnectivity.end", end)]);
                otel.fail(error.to_string());
            }
        }
        otel.end();
        match dialed {
            Ok(connected) => {
                self.metrics.dial_succeeded(started.elapsed());
                if let Some(record) = record.as_mut() {
                    record.dialed(Some(connected.addr.to_string()), Some(&connected.verdict));
                }
                self.carry(connected.stream, ticket, cancel, record).await;
            }
            Err(error) => {
                if let EndpointDialError::Denied { addr, rule, .. } = &error {
                    self.destinations.refused(rule, &address, *addr);
                }
                if let Some(record) = record {
                    audit::dial_failed(record, &error);
                }
                self.metrics.dial_failed(error.failure());
                debug!(error = %error, "dial failed");
                if let Dialed::Failed { reply } = self.conns.lock().dialed(ticket, Err(error)) {
                    self.to_server.control(reply);
                }
            }
        }
    }

    /// Enters the dialed `socket` in the table, answers DIAL_RSP and moves
    /// its bytes until it ends.
    async fn carry(
        self,
        socket: TcpStream,
        ticket: DialTicket,
        cancel: CancellationToken,
        mut record: Option<AgentDial>,
    ) {
        let Self {
            conns,
            to_server,
            scheme,
            metrics,
            ..
        } = self;
        let flow = Arc::new(Flow::new(scheme));
        let (inbound, window) = flow::inbound(Some(flow.clone()), 0);
        let overflow = CancellationToken::new();
        let closing = CancellationToken::new();
        let handle = EndpointConn {
            inbound,
            flow: flow.clone(),
            overflow: overflow.clone(),
            closing: closing.clone(),
        };
        let opened = conns
            .lock()
            .dialed(ticket, Ok::<_, endpoint::EndpointDialError>(handle));
        let Dialed::Open { conn: id, reply } = opened else {
            // Cancelled meanwhile: the socket closes unanswered.
            if let Some(record) = record {
                record.finish(audit::cancelled(), None, (0, 0));
            }
            return;
        };
        tracing::Span::current().record("conn.id", tracing::field::display(id));
        metrics.endpoint_connection_opened();
        if let Some(record) = record.as_mut() {
            record.opened(id.0);
        }
        if !to_server.control(reply) {
            conns.lock().remove(id);
            if let Some(record) = record {
                record.finish(audit::closed(&ConnEnd::StreamGone), None, (0, 0));
            }
            return;
        }
        debug!("connected");
        let out = to_server.queue().clone();
        let grants = scheme
            .is_credit()
            .then(|| Arc::new(to_server.clone()) as Arc<dyn ControlSink>);
        let (end, bytes) = ConnDriver {
            id,
            socket,
            up: QueueUpstream::new(id, out, Some(flow)),
            down: WindowDownstream::new(id, window, grants),
            overflow,
            closing,
            stream: cancel,
            conns,
            to_server,
            metrics,
        }
        .run()
        .await;
        if let Some(record) = record {
            let error = match &end {
                ConnEnd::DestinationError(error) => Some(error.to_string()),
                _ => None,
            };
            record.finish(audit::closed(&end), error, bytes);
        }
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    const TICK: Duration = Duration::from_millis(10);

    #[test]
    fn a_refused_or_unreachable_server_is_transient_and_a_tls_verdict_is_not() {
        let server = || "proxy:8091".to_owned();
        let io = |kind| io::Error::new(kind, "test");
        let cases = [
            (
                ConnectError::Tcp {
                    server: server(),
                    source: io(io::ErrorKind::ConnectionRefused),
                },
                true,
            ),
            (
                ConnectError::Tls {
                    server: server(),
                    source: io(io::ErrorKind::UnexpectedEof),
                },
                true,
            ),
            (
                ConnectError::Tls {
                    server: server(),
                    source: io(io::ErrorKind::ConnectionReset),
                },
                true,
            ),
            // A partition: no route, or no answer.
            (
                ConnectError::Tcp {
                    server: server(),
                    source: io(io::ErrorKind::HostUnreachable),
                },
                true,
            ),
            (
                ConnectError::Tcp {
                    server: server(),
                    source: io(io::ErrorKind::NetworkUnreachable),
                },
                true,
            ),
            (
                ConnectError::Tcp {
                    server: server(),
                    source: io(io::ErrorKind::TimedOut),
                },
                true,
            ),
            // A proxy's verdict is not.
            (
                ConnectError::Tcp {
                    server: server(),
                    source: io(io::ErrorKind::PermissionDenied),
                },
                false,
            ),
            // A TLS alert (bad certificate) is a verdict, not load.
            (
                ConnectError::Tls {
                    server: server(),
                    source: io(io::ErrorKind::InvalidData),
                },
                false,
            ),
            (ConnectError::Timeout { server: server() }, true),
        ];
        for (error, transient) in cases {
            assert_eq!(error.is_transient(), transient, "{error:?}");
        }
    }

    #[tokio::test]
    async fn the_probe_sees_the_transport_end() {
        // EOF from the peer.
        let transport = TransportEnd::default();
        let (ours, theirs) = tokio::io::duplex(64);
        let mut ours = transport.watch(ours);
        drop(theirs);
        let mut buf = [0u8; 8];
        assert_eq!(ours.read(&mut buf).await.unwrap(), 0);
        tokio::time::timeout(Duration::from_secs(5), transport.probe(TICK))
            .await
            .expect("the probe missed EOF");

        // A failed write: the reads (hyper's, all the time) see it too.
        let transport = TransportEnd::default();
        let (ours, theirs) = tokio::io::duplex(64);
        let mut ours = transport.watch(ours);
        drop(theirs);
        assert!(ours.write_all(b"x").await.is_err());
        assert_eq!(ours.read(&mut buf).await.unwrap(), 0);
        assert!(!transport.is_open());

        // The transport dropped (hyper gave up on the connection).
        let transport = TransportEnd::default();
        let (ours, _theirs) = tokio::io::duplex(64);
        let ours = transport.watch(ours);
        assert!(transport.is_open());
        drop(ours);
        tokio::time::timeout(Duration::from_secs(5), transport.probe(TICK))
            .await
            .expect("the probe missed the drop");
    }

    #[tokio::test]
    async fn the_probe_waits_while_the_transport_is_open() {
        let transport = TransportEnd::default();
        let (ours, mut theirs) = tokio::io::duplex(64);
        let mut ours = transport.watch(ours);
        theirs.write_all(b"ping").await.unwrap();
        let mut buf = [0u8; 4];
        ours.read_exact(&mut buf).await.unwrap();
        let probe = transport.probe(TICK);
        tokio::pin!(probe);
        // Many intervals pass (virtual time would skip the I/O above).
        for _ in 0..5 {
            tokio::select! {
                () = &mut probe => panic!("an open transport failed the probe"),
                () = tokio::time::sleep(TICK * 2) => {}
            }
        }
        drop(ours);
        tokio::time::timeout(Duration::from_secs(5), probe)
            .await
            .expect("the probe missed the drop");
    }

    /// A dispatcher of a stream without credit, as the agent makes one.
    fn dispatcher(metrics: &Arc<AgentMetrics>, cancel: &CancellationToken) -> Dispatcher {
        let scheme = Scheme::Compat {
            ours: Window::default(),
        };
        let (tx, _) = tunnel::queue::queue(1 << 20, CONTROL_RESERVE);
        Dispatcher {
            conns: Connections::new(scheme, cancel),
            to_server: ToServer::new(tx, cancel.clone(), metrics.clone()),
            tasks: TaskTracker::new(),
            scheme,
            metrics: metrics.clone(),
            tracing: ops::otel::Tracing::off(),
            destinations: Destinations::allow_all(metrics.clone()),
            audit: (AgentAudit::disabled(), String::new()),
        }
    }

    /// The series of one failed receive with `code`, as ANP's agent counts
    /// a failed `Recv`.
    fn receive_failure(code: &str) -> [String; 2] {
        [
            "konnectivity_network_proxy_agent_server_connection_failure_count{direction=\"from_server\"} 1\n"
                .to_owned(),
            format!(
                "konnectivity_network_proxy_agent_stream_errors_total{{code=\"{code}\",packet_type=\"Unknown\",segment=\"to_agent\"}} 1\n"
            ),
        ]
    }

    /// The CI failure of `anp_surface::both_binaries_export_every_anp_metric`:
    /// the server was SIGKILLed, the agent's probe saw the connection closed
    /// before the stream's error was read, and nothing was counted. Here
    /// the stream never says anything, so only the probe can see it.
    #[tokio::test]
    async fn a_connection_the_probe_finds_closed_counts_as_a_failed_receive() {
        let metrics = Arc::new(AgentMetrics::unattached());
        let cancel = CancellationToken::new();
        let transport = TransportEnd::default();
        drop(transport.watch(tokio::io::empty()));
        let end = dispatcher(&metrics, &cancel)
            .read(
                &mut futures_util::stream::pending(),
                &transport,
                TICK,
                &cancel,
            )
            .await;
        assert_eq!(end, StreamEnd::Failed(tonic::Code::Unavailable));
        let text = metrics.render();
        for series in receive_failure("Unavailable") {
            assert!(text.contains(&series), "{series}{text}");
        }
    }

    /// How each way a stream can end is counted: a failed receive always,
    /// with grpc-go's `Unavailable` once the connection is gone (a dead
    /// server) and the stream's own code while it is open (a reset
    /// stream); a clean end and the agent's own cancel never (ANP counts
    /// neither `io.EOF` nor its own shutdown as the server's failure).
    #[tokio::test]
    async fn every_failed_receive_is_counted_and_a_clean_end_is_not() {
        enum Then {
            Fails(tonic::Status),
            Ends,
            IsCancelled,
        }
        let cases = [
            (
                Then::Fails(tonic::Status::unknown("tls eof")),
                false,
                StreamEnd::Failed(tonic::Code::Unavailable),
                Some("Unavailable"),
            ),
            (
                Then::Fails(tonic::Status::cancelled("reset")),
                true,
                StreamEnd::Failed(tonic::Code::Cancelled),
                Some("Canceled"),
            ),
            (Then::Ends, true, StreamEnd::Closed, None),
            (Then::IsCancelled, true, StreamEnd::Cancelled, None),
        ];
        for (then, open, want, counted) in cases {
            let metrics = Arc::new(AgentMetrics::unattached());
            let cancel = CancellationToken::new();
            let transport = TransportEnd::default();
            let (ours, _theirs) = tokio::io::duplex(64);
            // The connection: open while this lives, else ended.
            let _connection = open.then_some(transport.watch(ours));
            let mut inbound: futures_util::stream::BoxStream<'_, Result<Packet, tonic::Status>> =
                match then {
                    Then::Fails(status) => futures_util::stream::iter([Err(status)]).boxed(),
                    Then::Ends => futures_util::stream::empty().boxed(),
                    Then::IsCancelled => {
                        cancel.cancel();
                        futures_util::stream::pending().boxed()
                    }
                };
            let end = dispatcher(&metrics, &cancel)
                .read(&mut inbound, &transport, TICK, &cancel)
                .await;
            assert_eq!(end, want);
            let text = metrics.render();
            match counted {
                Some(code) => {
                    for series in receive_failure(code) {
                        assert!(text.contains(&series), "{want:?}: {series}{text}");
                    }
                }
                None => assert!(
                    !text.contains("server_connection_failure_count{")
                        && !text.contains("stream_errors_total{"),
                    "{want:?}: {text}"
                ),
            }
        }
    }
}
