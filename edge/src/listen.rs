//! Listening: binding listeners, accepting TCP, and accepting TLS
//! connections for tonic without letting one slow or broken handshake hold
//! up the accept loop.

use std::{io, net::SocketAddr, os::fd::AsFd, sync::Arc, time::Duration};

use tokio::{
    net::{TcpListener, TcpStream},
    sync::mpsc,
};
use tokio_rustls::{LazyConfigAcceptor, server::TlsStream};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tracing::debug;

use crate::{
    admission::{Admission, Dropped, HELLO_TIMEOUT, Ticket, Watched},
    read_ahead::ReadAhead,
};

/// Handshaken connections waiting for the gRPC server to pick them up.
const ACCEPT_BACKLOG: usize = 64;

/// A server-side TLS connection that tonic can serve: its connect info
/// (tonic's `TlsConnectInfo`) carries the peer's address, which a handler
/// reads with `Request::remote_addr`, and its certificates.
pub type TlsConn = TlsStream<Watched<ReadAhead<TcpStream>>>;

/// The next connection on `listener`. A failed accept (EMFILE and
/// friends) is logged, naming the listener `what`, and retried after a
/// short pause instead of spinning. Cancel safe.
pub async fn accept(listener: &TcpListener, what: &'static str) -> (TcpStream, SocketAddr) {
    loop {
        match listener.accept().await {
            Ok(pair) => return pair,
            Err(error) => {
                tracing::warn!(%error, listener = what, "accept failed");
                tokio::time::sleep(ACCEPT_BACKOFF).await;
            }
        }
    }
}

/// The connections of `listener`, with their peers, as a stream (see
/// [`accept`]); it never ends.
pub fn incoming(
    listener: TcpListener,
    what: &'static str,
) -> impl futures_util::Stream<Item = (TcpStream, SocketAddr)> + Unpin + Send + 'static {
    Box::pin(futures_util::stream::unfold(
        listener,
        move |listener| async move {
            let accepted = accept(&listener, what).await;
            Some((accepted, listener))
        },
    ))
}

/// Pause after a failed accept.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// Called each time a listener drops a silent pending connection at its
/// cap ([`tls_incoming`]).
pub type OnLimit = Arc<dyn Fn() + Send + Sync>;

/// Called for each pending connection a listener gives up on, with the
/// reason ([`tls_incoming_counted`]).
pub type OnDrop = Arc<dyn Fn(Dropped) + Send + Sync>;

/// Where a listener takes the TLS configuration of each handshake from: a
/// fixed one, or one that follows its files (`ops::tls::files`).
pub trait ServerTls: Send + Sync + 'static {
    /// The configuration for the next handshake.
    fn server_config(&self) -> Arc<rustls::ServerConfig>;
}

impl ServerTls for Arc<rustls::ServerConfig> {
    fn server_config(&self) -> Arc<rustls::ServerConfig> {
        self.clone()
    }
}

/// A configuration that follows its files: a closure that gives the
/// current one.
pub struct Following<F>(pub F);

impl<F> ServerTls for Following<F>
where
    F: Fn() -> Arc<rustls::ServerConfig> + Send + Sync + 'static,
{
    fn server_config(&self) -> Arc<rustls::ServerConfig> {
        (self.0)()
    }
}

/// [`tls_incoming_counted`], calling `on_limit` for each pending connection
/// dropped at the cap to make room.
pub fn tls_incoming(
    listener: TcpListener,
    tls: impl ServerTls,
    shutdown: CancellationToken,
    what: &'static str,
    max_pending: usize,
    on_limit: OnLimit,
) -> ReceiverStream<Result<TlsConn, io::Error>> {
    let on_drop: OnDrop = Arc::new(move |reason: Dropped| {
        if reason.at_cap() {
            on_limit();
        }
    });
    tls_incoming_counted(listener, tls, shutdown, what, max_pending, on_drop, None)
}

/// A check of a finished handshake (a resumed session's client chain, say)
/// run in the connection's own task: `false` drops the connection before
/// the server sees it.
pub type AdmitHandshake = Arc<dyn Fn(&rustls::ServerConnection) -> bool + Send + Sync>;

/// Accepts TCP connections until `shutdown`, runs each TLS handshake in its
/// own task with the configuration `tls` gives at that moment, and yields
/// the completed ones. Failed handshakes (plain TCP, wrong CA, garbage)
/// are logged at debug with the peer address and dropped; they never reach
/// the gRPC server. `on_drop` is called with the reason for each pending
/// connection that ends without a finished handshake. `admit`, if given,
/// checks each finished handshake in its own task (off the accept loop and
/// the server's, so that a storm's checks run in parallel).
///
/// Admission ([`admission`](crate::admission)): at most `max_pending`
/// connections are between `accept` and the gRPC server at once; past
/// that, new connections wait in the listen backlog, and a pending one
/// whose peer is truly silent is dropped for each while no handshake
/// waits for its turn (the first drop is logged). Handshakes whose ClientHello is in are taken up in arrival
/// order, one per runtime worker at a time; the ClientHello has
/// [`HELLO_TIMEOUT`] from `accept`, the rest [`HANDSHAKE_TIMEOUT`] from the
/// start of its turn. A peer that hung up while its handshake waited
/// for its turn costs no signature. A handshake that makes progress is
/// never dropped, so a storm of real peers all get through, at the rate
/// the CPU allows, while a flood of silent ones cannot keep them out. A
/// `max_pending` of 2^61 or more turns admission off: no cap, and every
/// handshake is taken up as soon as its ClientHello is in.
///
/// [`HANDSHAKE_TIMEOUT`]: crate::admission::HANDSHAKE_TIMEOUT
pub fn tls_incoming_counted(
    listener: TcpListener,
    tls: impl ServerTls,
    shutdown: CancellationToken,
    what: &'static str,
    max_pending: usize,
    on_drop: OnDrop,
    admit: Option<AdmitHandshake>,
) -> ReceiverStream<Result<TlsConn, io::Error>> {
    let (tx, rx) = mpsc::channel(ACCEPT_BACKLOG);
    let tls = Arc::new(tls);
    let workers = tokio::runtime::Handle::current().metrics().num_workers();
    let admission = Admission::new(max_pending, workers);
    tokio::spawn(async move {
        let logged = std::sync::atomic::AtomicBool::new(false);
        let on_shed = |reason: Dropped| {
            on_drop(reason);
            if !logged.swap(true, std::sync::atomic::Ordering::Relaxed) {
                tracing::warn!(
                    listener = what,
                    limit = max_pending,
                    "--max-tls-handshakes reached; dropping pending handshakes whose peers are silent"
                );
            }
        };
        loop {
            let ticket = tokio::select! {
                () = shutdown.cancelled() => return,
                ticket = admission.admit(&shutdown, &on_shed) => ticket,
            };
            let (tcp, peer) = tokio::select! {
                () = shutdown.cancelled() => return,
                accepted = accept(&listener, what) => accepted,
            };
            let hello_deadline = tokio::time::Instant::now() + HELLO_TIMEOUT;
            let _ = tcp.set_nodelay(true);
            // Reads up to 64 KiB per system call under TLS (see `ReadAhead`).
            let io = admission.watch(ReadAhead::new(tcp), &ticket);
            let pending = Pending {
                admission: admission.clone(),
                ticket,
                peer,
                what,
            };
            tokio::spawn(pending.handshake(
                io,
                hello_deadline,
                tls.clone(),
                tx.clone(),
                (on_drop.clone(), admit.clone()),
            ));
        }
    });
    ReceiverStream::new(rx)
}

/// One pending connection of [`tls_incoming_counted`]: its handshake
/// task's state.
struct Pending {
    /// The listener's admission.
    admission: Arc<Admission>,
    /// Its slot, stage and stop.
    ticket: Ticket,
    /// The peer, for logs.
    peer: SocketAddr,
    /// The listener, for logs.
    what: &'static str,
}

impl Pending {
    /// Runs the handshake (see [`tls_incoming_counted`]) and hands the
    /// connection to `tx`; the slot is held until the server takes it, so
    /// a slow taker bounds them too.
    async fn handshake(
        self,
        io: Watched<ReadAhead<TcpStream>>,
        hello_deadline: tokio::time::Instant,
        tls: Arc<impl ServerTls>,
        tx: mpsc::Sender<Result<TlsConn, io::Error>>,
        (on_drop, admit): (OnDrop, Option<AdmitHandshake>),
    ) {
        let (peer, what) = (self.peer, self.what);
        let result = tokio::select! {
            // Dropped at the cap (counted there) or shut down.
            () = self.ticket.cancel.cancelled() => None,
            result = self.stages(io, hello_deadline, &*tls) => Some(result),
        };
        self.admission.done(&self.ticket);
        match result {
            None => debug!(peer.addr = %peer, listener = what, "tls handshake dropped"),
            Some(Ok(mut conn)) => {
                conn.get_mut().0.disarm();
                if admit.is_some_and(|admit| !admit(conn.get_ref().1)) {
                    debug!(peer.addr = %peer, listener = what, "tls handshake refused after it finished");
                    return;
                }
                tokio::select! {
                    () = self.ticket.cancel.cancelled() => {}
                    _ = tx.send(Ok(conn)) => {}
                }
            }
            Some(Err(reason)) => {
                debug!(peer.addr = %peer, listener = what, ?reason, "tls handshake dropped");
                on_drop(reason);
            }
        }
    }

    /// The ClientHello, the wait for a turn, then the rest of the
    /// handshake.
    async fn stages(
        &self,
        io: Watched<ReadAhead<TcpStream>>,
        hello_deadline: tokio::time::Instant,
        tls: &impl ServerTls,
    ) -> Result<TlsConn, Dropped> {
        let hello = LazyConfigAcceptor::new(rustls::server::Acceptor::default(), io);
        let mut start = match tokio::time::timeout_at(hello_deadline, hello).await {
            Err(_) => return Err(Dropped::HelloTimeout),
            Ok(Err(error)) => {
                debug!(%error, peer.addr = %self.peer, listener = self.what, "no tls client hello");
                return Err(Dropped::BadHello);
            }
            Ok(Ok(start)) => start,
        };
        // Nothing is held for reading while it waits for its turn.
        start.io.get_mut().release();
        // Reads the files when they follow them: before the turn.
        let config = tls.server_config();
        let turn = self.admission.turn(&self.ticket).await;
        if peer_gone(&start.io) {
            return Err(Dropped::PeerGone);
        }
        // The key exchange and the signature happen here, on the turn.
        let accept = start.into_stream(config);
        let deadline = turn.deadline;
        drop(turn);
        match tokio::time::timeout_at(deadline, accept).await {
            Err(_) => Err(Dropped::Timeout),
            Ok(Err(error)) => {
                debug!(%error, peer.addr = %self.peer, listener = self.what, "tls handshake failed");
                Err(Dropped::Failed)
            }
            Ok(Ok(conn)) => Ok(conn),
        }
    }
}

/// Whether the peer of `io` has hung up (its end of stream, or a reset, is
/// all there is to read), looked at without waiting or taking anything.
/// The socket itself is asked, through a duplicate of its descriptor:
/// tokio's readiness may not know yet of an end that came while the
/// runtime was busy, which is when it matters.
fn peer_gone(io: &Watched<ReadAhead<TcpStream>>) -> bool {
    let ahead = io.get_ref();
    if ahead.buffered() > 0 {
        return false;
    }
    let Ok(fd) = ahead.get_ref().as_fd().try_clone_to_owned() else {
        return false;
    };
    // Shares the original's open file (non-blocking); closing it on drop
    // leaves the original open.
    let socket = std::net::TcpStream::from(fd);
    let mut byte = [0u8; 1];
    match socket.peek(&mut byte) {
        Ok(n) => n == 0,
        Err(error) => error.kind() != io::ErrorKind::WouldBlock,
    }
}

/// A listener that could not be bound, named.
#[derive(Debug, thiserror::Error)]
#[error("cannot listen on {addr} ({what})")]
pub struct BindError {
    /// The address.
    pub addr: SocketAddr,
    /// Which listener (`agent`, `health`, …).
    pub what: &'static str,
    /// Why.
    #[source]
    pub source: io::Error,
}

/// [`bind_tcp`], with an error naming the listener `what`.
///
/// # Errors
/// [`BindError`].
pub async fn bind_named(addr: SocketAddr, what: &'static str) -> Result<TcpListener, BindError> {
    bind_tcp(addr)
        .await
        .map_err(|source| BindError { addr, what, source })
}

/// Binds a TCP listener with the largest listen backlog the kernel allows
/// (`net.core.somaxconn`, as Go's listeners do, not std's 128): a storm of
/// thousands of agents reconnecting at once must queue in the kernel, not
/// have its SYNs dropped and retried a second later. An unspecified IPv6
/// address (`[::]`, what an empty bind-address flag means) falls back to
/// `0.0.0.0` where IPv6 is disabled.
///
/// # Errors
/// The bind error.
pub async fn bind_tcp(addr: SocketAddr) -> io::Result<TcpListener> {
    match listen(addr) {
        Err(e) if addr.ip() == std::net::Ipv6Addr::UNSPECIFIED => {
            let v4 = SocketAddr::new(std::net::Ipv4Addr::UNSPECIFIED.into(), addr.port());
            listen(v4).map_err(|_| e)
        }
        other => other,
    }
}

/// Listen backlog asked for; the kernel caps it at `net.core.somaxconn`.
const LISTEN_BACKLOG: u32 = 65_535;

/// A listening socket on `addr` (`SO_REUSEADDR`, as std's), backlog
/// [`LISTEN_BACKLOG`].
fn listen(addr: SocketAddr) -> io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Connections that complete while nobody accepts: with std's backlog
    /// of 128 the rest would wait for accepts that never come.
    #[tokio::test]
    async fn the_listen_backlog_is_the_kernels_largest_not_128() {
        let somaxconn: usize = std::fs::read_to_string("/proc/sys/net/core/somaxconn")
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        assert!(somaxconn > 128, "net.core.somaxconn is {somaxconn}");
        let n = somaxconn.min(600) - 1;
        let listener = bind_tcp("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut connecting = tokio::task::JoinSet::new();
        for _ in 0..n {
            connecting.spawn(tokio::time::timeout(
                Duration::from_secs(10),
                TcpStream::connect(addr),
            ));
        }
        let mut held = Vec::new();
        while let Some(connected) = connecting.join_next().await {
            held.push(connected.unwrap().expect("queued in the backlog").unwrap());
        }
        for _ in 0..n {
            listener.accept().await.unwrap();
        }
        assert_eq!(held.len(), n);
    }
}
