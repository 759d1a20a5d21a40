//! Accepting TLS connections for tonic without letting one slow or broken
//! handshake hold up the accept loop.

use std::{
    collections::BTreeMap,
    io,
    net::SocketAddr,
    pin::Pin,
    sync::{Arc, Mutex, PoisonError},
    task::{Context, Poll},
    time::Duration,
};

use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    net::{TcpListener, TcpStream},
    sync::mpsc,
};
use tokio_rustls::{TlsAcceptor, server::TlsStream};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::transport::server::Connected;
use tracing::debug;

use crate::read_ahead::ReadAhead;

/// How long a peer may take to complete its TLS handshake.
pub const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Handshaken connections waiting for the gRPC server to pick them up.
const ACCEPT_BACKLOG: usize = 64;

/// A bidirectional byte stream that can move between tasks (a TCP, TLS or
/// Unix socket, a tunneled connection).
pub trait Io: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> Io for T {}

/// The peer's address, available in request extensions of TLS connections.
#[derive(Debug, Clone, Copy)]
pub struct PeerAddr(pub SocketAddr);

/// A server-side TLS connection that tonic can serve.
pub struct TlsConn {
    /// The stream, reading ahead under TLS.
    inner: TlsStream<ReadAhead<TcpStream>>,
    /// Who is on the other end.
    peer: SocketAddr,
}

impl TlsConn {
    /// The peer's certificate chain, if it presented one.
    pub fn peer_certificates(&self) -> Option<&[rustls_pki_types::CertificateDer<'static>]> {
        self.inner.get_ref().1.peer_certificates()
    }
}

impl Connected for TlsConn {
    type ConnectInfo = PeerAddr;
    fn connect_info(&self) -> PeerAddr {
        PeerAddr(self.peer)
    }
}

impl AsyncRead for TlsConn {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for TlsConn {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

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

/// Pause after a failed accept.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// Called each time a listener's handshake cap is reached.
pub type OnLimit = Arc<dyn Fn() + Send + Sync>;

/// Accepts TCP connections until `shutdown`, runs each TLS handshake in its
/// own task (bounded by [`TLS_HANDSHAKE_TIMEOUT`]) and yields the completed
/// ones. Failed handshakes (plain TCP, wrong CA, garbage) are logged at debug
/// with the peer address and dropped; they never reach the gRPC server.
///
/// At most `max_handshakes` are in progress at once: at the cap a new
/// connection replaces the oldest pending handshake, which is dropped (a
/// real peer completes its handshake in milliseconds, so the oldest is the
/// likeliest to be a silent or slow one), and `on_limit` is called; the
/// first time is logged.
pub fn tls_incoming(
    listener: TcpListener,
    acceptor: Arc<rustls::ServerConfig>,
    shutdown: CancellationToken,
    what: &'static str,
    max_handshakes: usize,
    on_limit: OnLimit,
) -> ReceiverStream<Result<TlsConn, io::Error>> {
    let (tx, rx) = mpsc::channel(ACCEPT_BACKLOG);
    let acceptor = TlsAcceptor::from(acceptor);
    // Pending handshakes by arrival, each stopped by its own token.
    let pending: Arc<Mutex<BTreeMap<u64, CancellationToken>>> = Arc::default();
    tokio::spawn(async move {
        let mut next_id = 0u64;
        let mut logged = false;
        loop {
            let (tcp, peer) = tokio::select! {
                () = shutdown.cancelled() => return,
                accepted = accept(&listener, what) => accepted,
            };
            let _ = tcp.set_nodelay(true);
            let id = next_id;
            next_id += 1;
            let cancel = shutdown.child_token();
            {
                let mut pending = pending.lock().unwrap_or_else(PoisonError::into_inner);
                while pending.len() >= max_handshakes.max(1) {
                    let Some((_, oldest)) = pending.pop_first() else {
                        break;
                    };
                    oldest.cancel();
                    on_limit();
                    if !logged {
                        logged = true;
                        tracing::warn!(
                            listener = what,
                            limit = max_handshakes,
                            "--max-tls-handshakes reached; dropping the oldest pending handshakes"
                        );
                    }
                }
                pending.insert(id, cancel.clone());
            }
            let acceptor = acceptor.clone();
            let tx = tx.clone();
            let pending = pending.clone();
            tokio::spawn(async move {
                let handshake = tokio::time::timeout(
                    TLS_HANDSHAKE_TIMEOUT,
                    acceptor.accept(ReadAhead::new(tcp)),
                );
                let result = tokio::select! {
                    () = cancel.cancelled() => None,
                    r = handshake => Some(r),
                };
                pending
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .remove(&id);
                match result {
                    None => debug!(peer.addr = %peer, listener = what, "tls handshake dropped"),
                    Some(Ok(Ok(inner))) => {
                        tokio::select! {
                            () = cancel.cancelled() => {}
                            _ = tx.send(Ok(TlsConn { inner, peer })) => {}
                        }
                    }
                    Some(Ok(Err(error))) => {
                        debug!(%error, peer.addr = %peer, listener = what, "tls handshake failed");
                    }
                    Some(Err(_)) => {
                        debug!(peer.addr = %peer, listener = what, "tls handshake timed out");
                    }
                }
            });
        }
    });
    ReceiverStream::new(rx)
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

/// Binds a TCP listener; an unspecified IPv6 address (`[::]`, what an empty
/// bind-address flag means) falls back to `0.0.0.0` where IPv6 is disabled.
///
/// # Errors
/// The bind error.
pub async fn bind_tcp(addr: SocketAddr) -> io::Result<TcpListener> {
    match TcpListener::bind(addr).await {
        Err(e) if addr.ip() == std::net::Ipv6Addr::UNSPECIFIED => {
            let v4 = SocketAddr::new(std::net::Ipv4Addr::UNSPECIFIED.into(), addr.port());
            TcpListener::bind(v4).await.map_err(|_| e)
        }
        other => other,
    }
}
