//! Node-side connections: one [`EndpointConn`] per connection id, kept in
//! the [`Connections`] table of the server stream that dialed it, and the
//! dial itself.

use std::{
    io,
    net::{IpAddr, SocketAddr, SocketAddrV6},
    sync::{Arc, Mutex, MutexGuard, PoisonError},
    time::Duration,
};

use bytes::Bytes;
use proto::{Packet, text::Elided};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;
use tunnel::{
    flow::{self, Flow, InboundTx},
    ids::ConnId,
    mover::{self, Downstream, MoverEnd, QueueUpstream, Sent, Upstream, WindowDownstream},
};

use crate::{
    metrics::{AgentMetrics, EndpointCloseReason, EndpointDialFailure},
    outbound::ToServer,
    policy::{self, Decision, Host, Policy},
    table::StreamTable,
};

/// How long a node-side dial may take (ANP's `dialTimeout`).
pub const DIAL_TIMEOUT: Duration = Duration::from_secs(5);

/// Handle of one node-side connection, kept in its stream's table: where
/// its inbound bytes go and how the stream's reader ends it.
pub struct EndpointConn {
    /// Bytes from the server for the socket; dropping it closes the
    /// connection after the queued bytes are written.
    pub inbound: InboundTx,
    /// Its flow state: the window of `inbound`, its credit towards the
    /// server.
    pub flow: Arc<Flow>,
    /// Cancelled when the destination fell a window behind: the connection
    /// ends at once, with `ConnEnd::Overflow`.
    pub overflow: CancellationToken,
    /// Cancelled when the server closed the connection: bounds the drain.
    pub closing: CancellationToken,
}

/// Why a node-side connection ended: counted, and answered to the server.
#[derive(Debug)]
pub(crate) enum ConnEnd {
    /// The destination closed its side.
    DestinationClosed,
    /// Reading or writing the destination failed.
    DestinationError(io::Error),
    /// The server closed the connection, and every queued byte was written.
    ServerClosed,
    /// The server stream ended (or the connection left it): nothing to answer.
    StreamGone,
    /// The destination read too slowly: it fell a window behind.
    Overflow,
    /// After the server's close, the queued bytes did not reach the
    /// destination within [`CLOSE_DRAIN`].
    DrainTimedOut,
}

impl ConnEnd {
    fn from_mover(end: MoverEnd) -> Self {
        match end {
            MoverEnd::LocalEof => Self::DestinationClosed,
            MoverEnd::LocalError(e) => Self::DestinationError(e),
            MoverEnd::PeerClosed => Self::ServerClosed,
            // The server's side never says a close failed (a CLOSE_REQ
            // carries no error); were it to, the connection failed.
            MoverEnd::TunnelGone | MoverEnd::PeerFailed => Self::StreamGone,
        }
    }

    /// How the close is counted.
    pub(crate) fn reason(&self) -> EndpointCloseReason {
        match self {
            Self::DestinationClosed => EndpointCloseReason::EndpointClosed,
            Self::DestinationError(_) => EndpointCloseReason::EndpointError,
            Self::ServerClosed => EndpointCloseReason::ServerClosed,
            Self::StreamGone => EndpointCloseReason::StreamGone,
            Self::Overflow => EndpointCloseReason::Overflow,
            Self::DrainTimedOut => EndpointCloseReason::DrainTimedOut,
        }
    }

    /// Whether the connection failed rather than closed: the tunnel is
    /// gone, the destination fell behind or did not take the last bytes.
    /// The destination is then reset, not sent a FIN.
    pub(crate) fn is_failure(&self) -> bool {
        matches!(
            self,
            Self::StreamGone | Self::Overflow | Self::DrainTimedOut
        )
    }

    /// The error of the CLOSE_RSP to send (empty: a clean close), or `None`
    /// when there is nobody to answer.
    pub(crate) fn close_error(&self) -> Option<String> {
        match self {
            Self::DestinationClosed | Self::ServerClosed => Some(String::new()),
            Self::DestinationError(e) => Some(e.to_string()),
            Self::StreamGone => None,
            Self::Overflow => Some(flow::OVERFLOW.to_owned()),
            Self::DrainTimedOut => Some(DRAIN_TIMED_OUT.to_owned()),
        }
    }
}

/// CLOSE_RSP error when the destination did not take the last bytes in
/// time after the server's close.
pub(crate) const DRAIN_TIMED_OUT: &str = "timed out writing to the destination before closing";

/// How long a connection closed by the server may take to write what is
/// queued to a destination that may not be reading.
pub const CLOSE_DRAIN: Duration = Duration::from_secs(10);

/// One established node-side connection's task: moves its bytes both ways
/// until it ends, then leaves the table, counts the end and answers the
/// server. Every wait is raced against the stream's end (`stream`), an
/// overflow and the drain deadline.
pub(crate) struct ConnDriver {
    /// The connection.
    pub(crate) id: ConnId,
    /// The destination socket.
    pub(crate) socket: TcpStream,
    /// Socket bytes to the server.
    pub(crate) up: QueueUpstream,
    /// Server bytes to the socket.
    pub(crate) down: WindowDownstream,
    /// Its handle's signals (see [`EndpointConn`]).
    pub(crate) overflow: CancellationToken,
    /// See [`EndpointConn::closing`].
    pub(crate) closing: CancellationToken,
    /// Cancelled when the stream ends (the dial's token, a child of it).
    pub(crate) stream: CancellationToken,
    /// The stream's table, which it leaves at the end.
    pub(crate) conns: Connections,
    /// The stream's outbound side, for the CLOSE_RSP.
    pub(crate) to_server: ToServer,
    /// Where the end is counted.
    pub(crate) metrics: Arc<AgentMetrics>,
}

/// A half of a connection's byte mover that counts the payload bytes it
/// carries, for the connection's audit record at its end.
struct Counted<T> {
    inner: T,
    bytes: u64,
}

impl<U: Upstream> Upstream for &mut Counted<U> {
    async fn send(&mut self, data: Bytes) -> Sent {
        let len = data.len() as u64;
        let sent = self.inner.send(data).await;
        if sent == Sent::Sent {
            self.bytes += len;
        }
        sent
    }
}

impl<D: Downstream> Downstream for &mut Counted<D> {
    async fn next(&mut self) -> Option<Bytes> {
        let data = self.inner.next().await?;
        self.bytes += data.len() as u64;
        Some(data)
    }

    fn written(&mut self) -> bool {
        self.inner.written()
    }

    fn has_more(&self) -> bool {
        self.inner.has_more()
    }

    fn failed(&self) -> bool {
        self.inner.failed()
    }
}

impl ConnDriver {
    /// Runs the connection to its end; how it ended, and the payload bytes
    /// it carried (to the endpoint, to the server).
    pub(crate) async fn run(self) -> (ConnEnd, (u64, u64)) {
        let Self {
            id,
            mut socket,
            up,
            down,
            overflow,
            closing,
            stream,
            conns,
            to_server,
            metrics,
        } = self;
        // After CLOSE_REQ the queued bytes get CLOSE_DRAIN to reach a
        // destination that may not be reading.
        let drain_deadline = async {
            closing.cancelled().await;
            tokio::time::sleep(CLOSE_DRAIN).await;
        };
        // Biased, the stream's end first: when the stream ends, its token
        // is cancelled before the table drops this connection's queue, and
        // the mover would take the closed queue for the server's close and
        // send the destination a FIN, a clean end with bytes missing.
        let mut up = Counted {
            inner: up,
            bytes: 0,
        };
        let mut down = Counted {
            inner: down,
            bytes: 0,
        };
        let end = tokio::select! {
            biased;
            () = stream.cancelled() => ConnEnd::StreamGone,
            () = overflow.cancelled() => ConnEnd::Overflow,
            () = drain_deadline => ConnEnd::DrainTimedOut,
            end = mover::run(&mut socket, &mut up, &mut down) => ConnEnd::from_mover(end),
        };
        if end.is_failure() {
            // A FIN would read as a clean end at the destination, with
            // bytes missing: a connection that failed ends with a reset.
            let _ = socket.set_zero_linger();
        }
        drop(socket);
        if let Some(packet) = &up.inner.undelivered {
            metrics.send_failed(packet);
        }
        metrics.connection_closed(end.reason());
        tracing::debug!(?end, "connection closed");
        let answer = end
            .close_error()
            .filter(|_| !stream.is_cancelled())
            .map(|error| Packet::close_response(id.0, &error));
        // Leaving the table and queuing the answer under one lock: a
        // CLOSE_REQ the reader handles once the connection is gone is
        // answered "Unknown connectID" behind this answer, never ahead of
        // it (the server then drops it), so a clean close is never
        // reported to the frontend as an error.
        let mut table = conns.lock();
        table.remove(id);
        if let Some(answer) = answer {
            to_server.control(answer);
        }
        drop(table);
        (end, (down.bytes, up.bytes))
    }
}

/// The connection table of one server stream (see [`crate::table`]),
/// shared by the stream's reader and its dial and connection tasks, each
/// holding the lock only for one table call.
#[derive(Clone)]
pub struct Connections(Arc<Mutex<StreamTable<CancellationToken, EndpointConn>>>);

impl Connections {
    /// An empty table for a stream that agreed `scheme`; pending dials are
    /// cancelled through children of `stream` (so they end with it).
    pub fn new(scheme: flow::Scheme, stream: &CancellationToken) -> Self {
        let stream = stream.clone();
        Self(Arc::new(Mutex::new(StreamTable::new(
            scheme.is_credit(),
            move || stream.child_token(),
        ))))
    }

    /// The table, locked.
    pub fn lock(&self) -> MutexGuard<'_, StreamTable<CancellationToken, EndpointConn>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Number of open connections.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether no connection is open.
    pub fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }

    /// Number of dials in progress.
    pub fn dials_in_progress(&self) -> usize {
        self.lock().dials_in_progress()
    }
}

/// Why a destination dial failed. It becomes Go's text (what frontends
/// that map error strings, as kube-apiserver's HTTP-CONNECT path does,
/// expect) only in the DIAL_RSP; a destination the server sent is shown as
/// a bounded prefix ([`Elided`]).
#[derive(Debug)]
pub enum EndpointDialError {
    /// A network other than TCP.
    UnknownNetwork {
        /// The network asked for.
        network: String,
        /// The address.
        address: String,
    },
    /// The address has no port.
    MissingPort {
        /// The address.
        address: String,
    },
    /// The name did not resolve.
    NoSuchHost {
        /// The address.
        address: String,
    },
    /// Every address of the name refused or failed; the last one's error.
    Connect {
        /// The address tried last.
        addr: std::net::SocketAddr,
        /// Why.
        source: io::Error,
    },
    /// Lookup and connect took longer than [`DIAL_TIMEOUT`].
    Timeout {
        /// The address.
        address: String,
    },
    /// The destination policy refused an address of the destination:
    /// nothing was connected to.
    Denied {
        /// The address asked for.
        address: String,
        /// The address (resolved, normalised) the rule refused.
        addr: SocketAddr,
        /// The rule, as written.
        rule: Arc<str>,
    },
}

impl EndpointDialError {
    /// Whether the dial timed out.
    pub fn is_timeout(&self) -> bool {
        match self {
            Self::Timeout { .. } => true,
            Self::Connect { source, .. } => source.kind() == io::ErrorKind::TimedOut,
            _ => false,
        }
    }

    /// Its class, as the server is told it beside the text.
    pub fn class(&self) -> proto::DialErrorClass {
        use proto::DialErrorClass as Class;
        match self {
            Self::Connect { source, .. } => match source.kind() {
                io::ErrorKind::ConnectionRefused => Class::Refused,
                io::ErrorKind::HostUnreachable | io::ErrorKind::NetworkUnreachable => {
                    Class::Unreachable
                }
                io::ErrorKind::TimedOut => Class::Timeout,
                _ => Class::Other,
            },
            Self::Timeout { .. } => Class::Timeout,
            Self::NoSuchHost { .. } => Class::NoSuchHost,
            Self::Denied { .. } => Class::Denied,
            Self::UnknownNetwork { .. } | Self::MissingPort { .. } => Class::Other,
        }
    }

    /// How `endpoint_dial_failure_total` counts it.
    pub(crate) fn failure(&self) -> EndpointDialFailure {
        if self.is_timeout() {
            EndpointDialFailure::Timeout
        } else {
            EndpointDialFailure::Unknown
        }
    }
}

impl crate::table::DialFailed for EndpointDialError {
    fn class(&self) -> proto::DialErrorClass {
        Self::class(self)
    }
}

impl std::fmt::Display for EndpointDialError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::UnknownNetwork { network, address } => write!(
                f,
                "dial {} {}: unknown network {}",
                Elided(network),
                Elided(address),
                Elided(network)
            ),
            Self::MissingPort { address } => write!(
                f,
                "dial tcp {}: address {}: missing port in address",
                Elided(address),
                Elided(address)
            ),
            Self::NoSuchHost { address } => write!(
                f,
                "dial tcp {}: lookup {}: no such host",
                Elided(address),
                Elided(host(address))
            ),
            Self::Connect { addr, source } => {
                write!(f, "dial tcp {addr}: connect: {}", io_text(source))
            }
            Self::Timeout { address } => write!(f, "dial tcp {}: i/o timeout", Elided(address)),
            Self::Denied {
                address,
                addr,
                rule,
            } => write!(
                f,
                "dial tcp {}: destination {addr} denied by the agent's policy (rule {})",
                Elided(address),
                Elided(rule)
            ),
        }
    }
}

/// How a destination's name is resolved, once per dial: the system's
/// resolver ([`SystemResolver`]), or a test's.
pub trait Resolve: Sync {
    /// The addresses of `host` (a name) with `port`.
    fn resolve(
        &self,
        host: &str,
        port: u16,
    ) -> impl Future<Output = io::Result<Vec<SocketAddr>>> + Send;
}

/// The system's resolver (`getaddrinfo`, on a blocking thread).
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemResolver;

impl Resolve for SystemResolver {
    async fn resolve(&self, host: &str, port: u16) -> io::Result<Vec<SocketAddr>> {
        Ok(tokio::net::lookup_host((host, port)).await?.collect())
    }
}

/// A destination connected to: what the audit of a tunnel will record.
#[derive(Debug)]
pub struct Connected {
    /// The socket.
    pub stream: TcpStream,
    /// The checked address it is connected to.
    pub addr: SocketAddr,
    /// What the destination policy said.
    pub verdict: Decision,
}

/// Dials a node-side TCP address within [`DIAL_TIMEOUT`], if `policy`
/// allows every address of it (see [`dial_with`]).
///
/// # Errors
/// Why it failed; its text is Go's (`dial tcp host:port: connect:
/// connection refused`, `… i/o timeout`, `lookup host: no such host`), or
/// names the rule that refused it.
pub async fn dial(
    protocol: &str,
    address: &str,
    policy: &Policy,
) -> Result<Connected, EndpointDialError> {
    dial_with(protocol, address, policy, &SystemResolver).await
}

/// [`dial`] with the names resolved by `resolver`: a name is resolved
/// once, every address is checked against `policy`, and only the checked
/// addresses are connected to, in order (never the name again: a second
/// answer, DNS rebinding, cannot slip past the check). Numeric hosts in
/// any form libc accepts are checked as the address they are, unresolved.
///
/// # Errors
/// As [`dial`].
pub async fn dial_with<R: Resolve>(
    protocol: &str,
    address: &str,
    policy: &Policy,
    resolver: &R,
) -> Result<Connected, EndpointDialError> {
    if !matches!(protocol, "tcp" | "tcp4" | "tcp6" | "") {
        return Err(EndpointDialError::UnknownNetwork {
            network: protocol.to_owned(),
            address: address.to_owned(),
        });
    }
    let attempt = async {
        let (addrs, verdict) = resolve_checked(address, policy, resolver).await?;
        let mut last = None;
        for addr in addrs {
            match TcpStream::connect(addr).await {
                Ok(stream) => {
                    return Ok(Connected {
                        stream,
                        addr,
                        verdict,
                    });
                }
                Err(e) => last = Some((addr, e)),
            }
        }
        match last {
            Some((addr, source)) => Err(EndpointDialError::Connect { addr, source }),
            None => Err(EndpointDialError::NoSuchHost {
                address: address.to_owned(),
            }),
        }
    };
    // One limit for lookup and connect together, as Go's DialTimeout.
    let connected = tokio::time::timeout(DIAL_TIMEOUT, attempt)
        .await
        .map_err(|_| EndpointDialError::Timeout {
            address: address.to_owned(),
        })??;
    let _ = connected.stream.set_nodelay(true);
    Ok(connected)
}

/// The addresses of `address` (resolved once if a name, normalised) and
/// the policy's verdict on them.
async fn resolve_checked<R: Resolve>(
    address: &str,
    policy: &Policy,
    resolver: &R,
) -> Result<(Vec<SocketAddr>, Decision), EndpointDialError> {
    let no_such_host = || EndpointDialError::NoSuchHost {
        address: address.to_owned(),
    };
    let (host, port) =
        policy::split_host_port(address).ok_or_else(|| EndpointDialError::MissingPort {
            address: address.to_owned(),
        })?;
    let (name, addrs) = match policy::parse_host(host) {
        Host::Ip { addr, zone } => {
            let scope = match zone {
                Some(zone) => crate::destinations::scope_id(&zone).ok_or_else(no_such_host)?,
                None => 0,
            };
            (None, vec![socket_addr(addr, port, scope)])
        }
        Host::Name(name) => {
            let addrs = resolver
                .resolve(host, port)
                .await
                .map_err(|_| no_such_host())?
                .into_iter()
                .map(|a| socket_addr(policy::canonical(a.ip()), a.port(), scope_of(&a)))
                .collect();
            (Some(name), addrs)
        }
    };
    let verdict = policy
        .check_all(name.as_deref(), &addrs)
        .map_err(|(addr, rule)| EndpointDialError::Denied {
            address: address.to_owned(),
            addr,
            rule,
        })?;
    Ok((addrs, verdict))
}

fn socket_addr(addr: IpAddr, port: u16, scope: u32) -> SocketAddr {
    match addr {
        IpAddr::V6(v6) => SocketAddr::V6(SocketAddrV6::new(v6, port, 0, scope)),
        IpAddr::V4(_) => SocketAddr::new(addr, port),
    }
}

fn scope_of(addr: &SocketAddr) -> u32 {
    match addr {
        SocketAddr::V6(v6) => v6.scope_id(),
        SocketAddr::V4(_) => 0,
    }
}

fn host(address: &str) -> &str {
    address
        .rsplit_once(':')
        .map_or(address, |(h, _)| h)
        .trim_start_matches('[')
        .trim_end_matches(']')
}

/// An io error as Go's syscall text (lower case, no "os error N").
fn io_text(e: &io::Error) -> String {
    match e.kind() {
        io::ErrorKind::ConnectionRefused => "connection refused".to_owned(),
        io::ErrorKind::ConnectionReset => "connection reset by peer".to_owned(),
        io::ErrorKind::TimedOut => "i/o timeout".to_owned(),
        io::ErrorKind::NetworkUnreachable => "network is unreachable".to_owned(),
        io::ErrorKind::HostUnreachable => "no route to host".to_owned(),
        io::ErrorKind::AddrNotAvailable => "cannot assign requested address".to_owned(),
        _ => {
            let text = e.to_string();
            let text = text.split(" (os error").next().unwrap_or(&text);
            text.to_lowercase()
        }
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use tokio::io::AsyncReadExt;

    use super::*;

    /// A connected pair with small socket buffers: the driver's side, and
    /// the destination's.
    async fn small_pair() -> (TcpStream, TcpStream) {
        let listener = tokio::net::TcpSocket::new_v4().unwrap();
        listener.set_recv_buffer_size(4096).unwrap();
        listener.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let listener = listener.listen(1).unwrap();
        let ours = tokio::net::TcpSocket::new_v4().unwrap();
        ours.set_send_buffer_size(4096).unwrap();
        let (ours, theirs) = tokio::join!(
            ours.connect(listener.local_addr().unwrap()),
            listener.accept()
        );
        (ours.unwrap(), theirs.unwrap().0)
    }

    /// A connection the server closed with a full window still queued for
    /// its destination; what it sent the server, and its metrics.
    struct Closed {
        driver: ConnDriver,
        out: tunnel::queue::QueueRx<Packet>,
        metrics: Arc<AgentMetrics>,
        queued: usize,
    }

    async fn closed_with_a_full_window(socket: TcpStream) -> Closed {
        let stream = CancellationToken::new();
        let (out_tx, out) = tunnel::queue::queue(1 << 20, 1 << 20);
        let metrics = Arc::new(AgentMetrics::unattached());
        let scheme = flow::Scheme::Credit {
            ours: flow::Window::V1,
            theirs: flow::Window::V1,
        };
        let flow = Arc::new(Flow::new(scheme));
        let (inbound, window) = flow::inbound(Some(flow), 0);
        let chunk = Bytes::from(vec![7u8; 64 * 1024]);
        let mut queued = 0;
        while inbound.send(chunk.clone()).await.is_ok() {
            queued += chunk.len();
        }
        let closing = CancellationToken::new();
        // CLOSE_REQ: the handle leaves the table (its sender drops).
        drop(inbound);
        closing.cancel();
        let id = ConnId(1);
        let driver = ConnDriver {
            id,
            socket,
            up: QueueUpstream::new(id, out_tx.clone(), None),
            down: WindowDownstream::new(id, window, None),
            overflow: CancellationToken::new(),
            closing,
            stream: stream.clone(),
            conns: Connections::new(scheme, &stream),
            to_server: ToServer::new(out_tx, stream, metrics.clone()),
            metrics: metrics.clone(),
        };
        Closed {
            driver,
            out,
            metrics,
            queued,
        }
    }

    fn close_error(packet: Packet) -> String {
        match packet.into_kind() {
            proto::packet::PacketKind::CloseRsp(rsp) => rsp.error,
            other => panic!("expected CLOSE_RSP, got {other:?}"),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_destination_that_does_not_take_the_last_bytes_is_closed_after_the_drain() {
        let (ours, _destination_never_reads) = small_pair().await;
        let mut closed = closed_with_a_full_window(ours).await;
        let started = tokio::time::Instant::now();
        closed.driver.run().await;
        assert!(started.elapsed() >= CLOSE_DRAIN);
        let answer = closed.out.recv().await.unwrap();
        assert_eq!(close_error(answer), DRAIN_TIMED_OUT);
        let text = closed.metrics.render();
        assert!(
            text.contains(
                "konnectivity_rs_agent_connections_closed_total{reason=\"drain_timeout\"} 1\n"
            ),
            "{text}"
        );
        assert!(!text.contains("reason=\"overflow\""), "{text}");
    }

    #[tokio::test]
    async fn a_destination_that_reads_gets_every_byte_then_a_clean_close() {
        let (ours, mut destination) = small_pair().await;
        let mut closed = closed_with_a_full_window(ours).await;
        let reader = tokio::spawn(async move {
            let mut all = Vec::new();
            destination.read_to_end(&mut all).await.unwrap();
            all
        });
        closed.driver.run().await;
        let all = reader.await.unwrap();
        assert_eq!(all.len(), closed.queued);
        assert!(all.iter().all(|b| *b == 7));
        assert_eq!(close_error(closed.out.recv().await.unwrap()), "");
        let text = closed.metrics.render();
        assert!(
            text.contains(
                "konnectivity_rs_agent_connections_closed_total{reason=\"server_closed\"} 1\n"
            ),
            "{text}"
        );
    }

    /// Issue 37, item 1: the credit for bytes written to the destination
    /// cannot be queued because the server stopped reading the stream. The
    /// stream is ended, so that the server ends every connection on it
    /// with an error; before, the connection ended alone, unanswered, and
    /// the server's side of it hung while the stream stayed up.
    /// A connection whose stream ended resets its destination: a FIN
    /// would read as a clean end there, with bytes missing (the soak,
    /// docs/reliability.md, saw requests cut short so when a server was
    /// killed). The stream's token is cancelled before its table drops the
    /// connection's queue, as `Client::serve` does; the driver must take
    /// the stream's end first every time, not the closed queue for the
    /// server's close.
    #[tokio::test]
    async fn a_connection_whose_stream_ended_resets_its_destination() {
        for _ in 0..20 {
            let (ours, mut destination) = small_pair().await;
            let stream = CancellationToken::new();
            let (out_tx, _out) = tunnel::queue::queue(1 << 20, 1 << 20);
            let metrics = Arc::new(AgentMetrics::unattached());
            let to_server = ToServer::new(out_tx.clone(), stream.clone(), metrics.clone());
            let scheme = flow::Scheme::Credit {
                ours: flow::Window::V1,
                theirs: flow::Window::V1,
            };
            let flow = Arc::new(Flow::new(scheme));
            let (inbound, window) = flow::inbound(Some(flow.clone()), 0);
            let id = ConnId(1);
            let driver = ConnDriver {
                id,
                socket: ours,
                up: QueueUpstream::new(id, out_tx, Some(flow)),
                down: WindowDownstream::new(id, window, Some(Arc::new(to_server.clone()))),
                overflow: CancellationToken::new(),
                closing: CancellationToken::new(),
                stream: stream.child_token(),
                conns: Connections::new(scheme, &stream),
                to_server,
                metrics,
            };
            stream.cancel();
            drop(inbound);
            tokio::spawn(driver.run()).await.unwrap();
            let mut buf = [0u8; 16];
            let read = tokio::time::timeout(Duration::from_secs(10), destination.read(&mut buf))
                .await
                .expect("the destination was told");
            assert!(
                matches!(&read, Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset),
                "the destination read {read:?}, not a reset"
            );
        }
    }

    #[tokio::test]
    async fn a_credit_that_cannot_be_queued_ends_the_stream() {
        let (ours, mut destination) = small_pair().await;
        let stream = CancellationToken::new();
        let (out_tx, _unread) = tunnel::queue::queue(256, 256);
        // The server has stopped reading: the queue is past its reserve.
        while out_tx.push(Packet::close_request(1), 100).is_ok() {}
        let metrics = Arc::new(AgentMetrics::unattached());
        let to_server = ToServer::new(out_tx.clone(), stream.clone(), metrics.clone());
        let scheme = flow::Scheme::Credit {
            ours: flow::Window::V1,
            theirs: flow::Window::V1,
        };
        let flow = Arc::new(Flow::new(scheme));
        let (inbound, window) = flow::inbound(Some(flow.clone()), 0);
        inbound.send(Bytes::from_static(b"hello")).await.unwrap();
        let id = ConnId(1);
        let driver = ConnDriver {
            id,
            socket: ours,
            up: QueueUpstream::new(id, out_tx, Some(flow)),
            down: WindowDownstream::new(id, window, Some(Arc::new(to_server.clone()))),
            overflow: CancellationToken::new(),
            closing: CancellationToken::new(),
            stream: stream.child_token(),
            conns: Connections::new(scheme, &stream),
            to_server,
            metrics: metrics.clone(),
        };
        let run = tokio::spawn(driver.run());
        let mut hello = [0u8; 5];
        destination.read_exact(&mut hello).await.unwrap();
        assert_eq!(&hello, b"hello");
        tokio::time::timeout(Duration::from_secs(30), run)
            .await
            .expect("the connection ended")
            .unwrap();
        assert!(
            stream.is_cancelled(),
            "the stream stayed up with a connection lost"
        );
        let text = metrics.render();
        assert!(
            text.contains("konnectivity_rs_agent_limit_reached_total 1\n"),
            "{text}"
        );
    }

    #[tokio::test]
    async fn refused_dials_read_like_go() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        drop(listener);
        let err = dial("tcp", &addr.to_string(), &Policy::allow_all())
            .await
            .unwrap_err();
        assert!(!err.is_timeout());
        assert_eq!(
            err.to_string(),
            format!("dial tcp {addr}: connect: connection refused")
        );
        assert_eq!(err.class(), proto::DialErrorClass::Refused);
    }

    #[test]
    fn each_failure_has_its_class() {
        use proto::DialErrorClass as Class;
        let connect = |kind| EndpointDialError::Connect {
            addr: "10.0.0.1:80".parse().unwrap(),
            source: io::Error::from(kind),
        };
        let address = "10.0.0.1:80".to_owned();
        for (error, class) in [
            (connect(io::ErrorKind::ConnectionRefused), Class::Refused),
            (connect(io::ErrorKind::HostUnreachable), Class::Unreachable),
            (
                connect(io::ErrorKind::NetworkUnreachable),
                Class::Unreachable,
            ),
            (connect(io::ErrorKind::TimedOut), Class::Timeout),
            (connect(io::ErrorKind::PermissionDenied), Class::Other),
            (
                EndpointDialError::Timeout {
                    address: address.clone(),
                },
                Class::Timeout,
            ),
            (
                EndpointDialError::NoSuchHost {
                    address: address.clone(),
                },
                Class::NoSuchHost,
            ),
            (EndpointDialError::MissingPort { address }, Class::Other),
        ] {
            assert_eq!(error.class(), class, "{error}");
        }
    }

    #[tokio::test]
    async fn unresolvable_names_read_like_go() {
        let err = dial("tcp", "no-such-host.invalid:80", &Policy::allow_all())
            .await
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "dial tcp no-such-host.invalid:80: lookup no-such-host.invalid: no such host"
        );
    }

    #[tokio::test]
    async fn other_protocols_are_refused() {
        let err = dial("udp", "127.0.0.1:53", &Policy::allow_all())
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("unknown network udp"), "{err}");
        let err = dial("tcp", "10.0.0.1", &Policy::allow_all())
            .await
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "dial tcp 10.0.0.1: address 10.0.0.1: missing port in address"
        );
    }

    /// A resolver that answers `answers[i]` to its i-th call, and counts.
    struct Scripted {
        answers: Vec<Vec<IpAddr>>,
        calls: std::sync::atomic::AtomicUsize,
    }

    impl Scripted {
        fn new(answers: &[&[&str]]) -> Self {
            Self {
                answers: answers
                    .iter()
                    .map(|a| a.iter().map(|ip| ip.parse().unwrap()).collect())
                    .collect(),
                calls: Default::default(),
            }
        }

        fn calls(&self) -> usize {
            self.calls.load(std::sync::atomic::Ordering::SeqCst)
        }
    }

    impl Resolve for Scripted {
        async fn resolve(&self, _host: &str, port: u16) -> io::Result<Vec<SocketAddr>> {
            let call = self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let answer = self.answers.get(call).or(self.answers.last()).unwrap();
            Ok(answer.iter().map(|ip| SocketAddr::new(*ip, port)).collect())
        }
    }

    /// A listener on `ip` at `port` (0: any) that counts what it was sent.
    struct Counted(std::net::TcpListener);

    impl Counted {
        fn bind(ip: &str, port: u16) -> Self {
            let listener = std::net::TcpListener::bind((ip, port)).unwrap();
            listener.set_nonblocking(true).unwrap();
            Self(listener)
        }

        fn port(&self) -> u16 {
            self.0.local_addr().unwrap().port()
        }

        /// Connections made to it: the kernel completes them before
        /// `connect` returns, so they are queued by the time this looks.
        fn accepts(&self) -> usize {
            std::iter::from_fn(|| self.0.accept().ok()).count()
        }
    }

    /// Listeners on 127.0.0.2 (to be denied) and 127.0.0.3 at one port.
    fn two_listeners() -> (Counted, Counted) {
        loop {
            let allowed = Counted::bind("127.0.0.3", 0);
            if let Ok(denied) = std::net::TcpListener::bind(("127.0.0.2", allowed.port())) {
                denied.set_nonblocking(true).unwrap();
                return (Counted(denied), allowed);
            }
        }
    }

    fn deny_127_0_0_2() -> Policy {
        Policy::parse("deny 127.0.0.2", Vec::new()).unwrap()
    }

    fn denial(result: Result<Connected, EndpointDialError>) -> (SocketAddr, Arc<str>, String) {
        match result {
            Err(e @ EndpointDialError::Denied { .. }) => {
                let text = e.to_string();
                assert_eq!(e.class(), proto::DialErrorClass::Denied);
                let EndpointDialError::Denied { addr, rule, .. } = e else {
                    unreachable!()
                };
                (addr, rule, text)
            }
            other => panic!("expected a denial, got {other:?}"),
        }
    }

    /// DNS rebinding: a name that answers an allowed address, then a
    /// denied one, is resolved once; the address checked is the one
    /// connected to.
    #[tokio::test]
    async fn a_name_is_resolved_once_and_only_its_checked_address_is_connected() {
        let (denied, allowed) = two_listeners();
        let resolver = Scripted::new(&[&["127.0.0.3"], &["127.0.0.2"]]);
        let address = format!("rebind.example:{}", allowed.port());
        let connected = dial_with("tcp", &address, &deny_127_0_0_2(), &resolver)
            .await
            .unwrap();
        assert_eq!(resolver.calls(), 1);
        assert_eq!(
            connected.addr,
            SocketAddr::new("127.0.0.3".parse().unwrap(), allowed.port())
        );
        assert_eq!(connected.stream.peer_addr().unwrap(), connected.addr);
        assert_eq!(connected.verdict, Decision::Allowed(None));
        drop(connected);
        assert_eq!((denied.accepts(), allowed.accepts()), (0, 1));
    }

    /// A name with a denied address among its answers is refused whole:
    /// neither address is connected to.
    #[tokio::test]
    async fn a_name_with_one_denied_address_connects_to_none() {
        let (denied, allowed) = two_listeners();
        for answer in [&["127.0.0.3", "127.0.0.2"][..], &["::ffff:127.0.0.2"]] {
            let resolver = Scripted::new(&[answer]);
            let address = format!("mixed.example:{}", allowed.port());
            let (addr, rule, text) =
                denial(dial_with("tcp", &address, &deny_127_0_0_2(), &resolver).await);
            assert_eq!(addr.ip(), "127.0.0.2".parse::<IpAddr>().unwrap());
            assert_eq!(&*rule, "deny 127.0.0.2");
            assert_eq!(
                text,
                format!(
                    "dial tcp {address}: destination {addr} denied by the agent's policy (rule deny 127.0.0.2)"
                )
            );
        }
        assert_eq!((denied.accepts(), allowed.accepts()), (0, 0));
    }

    /// Every numeric form of a denied address is that address: refused,
    /// never resolved, never connected to.
    #[tokio::test]
    async fn a_denied_address_is_refused_in_every_numeric_form() {
        let (denied, allowed) = two_listeners();
        let resolver = Scripted::new(&[&["127.0.0.3"]]);
        let port = denied.port();
        for host in [
            "127.0.0.2",
            "2130706434",
            "0x7f000002",
            "0x7f.2",
            "0177.0.0.2",
            "127.2",
            "127.0.2",
            "[::ffff:127.0.0.2]",
            "[::ffff:7f00:2]",
        ] {
            let address = format!("{host}:{port}");
            let (addr, _, _) =
                denial(dial_with("tcp", &address, &deny_127_0_0_2(), &resolver).await);
            assert_eq!(
                addr,
                SocketAddr::new("127.0.0.2".parse().unwrap(), port),
                "{host}"
            );
        }
        assert_eq!(resolver.calls(), 0, "a number is not a name");
        assert_eq!((denied.accepts(), allowed.accepts()), (0, 0));
        // The allowed neighbour, in a short form, is connected to.
        let connected = dial_with(
            "tcp",
            &format!("127.3:{port}"),
            &deny_127_0_0_2(),
            &resolver,
        )
        .await
        .unwrap();
        drop(connected);
        assert_eq!((denied.accepts(), allowed.accepts()), (0, 1));
    }

    #[tokio::test]
    async fn localhost_is_loopback_by_every_name() {
        let policy = Policy::parse("deny loopback", Vec::new()).unwrap();
        let listener = Counted::bind("127.0.0.1", 0);
        for host in [
            "localhost",
            "LocalHost",
            "127.0.0.1",
            "[::1]",
            "[::ffff:127.0.0.1]",
        ] {
            let address = format!("{host}:{}", listener.port());
            let (_, rule, _) = denial(dial("tcp", &address, &policy).await);
            assert_eq!(&*rule, "deny loopback", "{host}");
        }
        assert_eq!(listener.accepts(), 0);
        // An interface's zone is taken, and the address still checked.
        let zoned = format!("[fe80::1%lo]:{}", listener.port());
        let link_local = Policy::parse("deny link-local", Vec::new()).unwrap();
        let (addr, _, _) = denial(dial("tcp", &zoned, &link_local).await);
        assert!(
            matches!(addr, SocketAddr::V6(v6) if v6.scope_id() == 1),
            "{addr}"
        );
    }

    #[test]
    fn a_long_destination_is_repeated_only_as_a_prefix() {
        let address = format!("{}:80", "h".repeat(100_000));
        let text = EndpointDialError::NoSuchHost { address }.to_string();
        assert!(text.len() < 1024, "{} bytes", text.len());
        assert!(text.ends_with(": no such host"), "{text}");
        assert!(
            EndpointDialError::Timeout {
                address: "10.0.0.1:1".to_owned()
            }
            .is_timeout()
        );
    }
}
