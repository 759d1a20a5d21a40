//! The frontend side of `ProxyService/Proxy`: what konnectivity-client does
//! for kube-apiserver. One gRPC stream carries one dial ("single-use tunnel"
//! when the channel is fresh, the newer reusable tunnel when a channel is
//! shared); the established connection is an ordinary byte stream.

use std::{
    io,
    path::{Path, PathBuf},
    time::Duration,
};

use hyper_util::rt::TokioIo;
use proto::{Packet, packet::PacketKind, proxy_service_client::ProxyServiceClient};
use tokio::{
    io::{AsyncRead, AsyncWrite, DuplexStream},
    net::UnixStream,
    sync::oneshot,
};
use tonic::transport::{Channel, Endpoint};

use tunnel::{
    ids::{ConnId, DialId},
    mover::{self, MoverEnd, QueueUpstream, WindowDownstream},
};

/// How long a dial may wait for its DIAL_RSP (konnectivity-client's backstop).
pub const DIAL_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a close waits for CLOSE_RSP (konnectivity-client's `CloseTimeout`).
pub const CLOSE_TIMEOUT: Duration = Duration::from_secs(10);
/// Bytes queued towards the server per tunnel before the caller waits.
const OUTBOUND_BYTES: usize = 1024 * 1024;
/// DATA payloads queued towards the caller per tunnel.
const INBOUND_CAPACITY: usize = 16;
/// Bytes buffered between the caller's end and the tunnel driver.
const PIPE_BYTES: usize = 256 * 1024;

/// What can go wrong on the frontend side.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The Unix socket could not be connected.
    #[error("cannot connect to proxy-server at {path}")]
    Connect {
        /// The socket path.
        path: PathBuf,
        /// Why.
        #[source]
        source: tonic::transport::Error,
    },
    /// TCP connect or the TLS handshake with a TCP frontend failed.
    #[error("cannot connect to proxy-server at {addr} over TLS")]
    Tls {
        /// The frontend address.
        addr: std::net::SocketAddr,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// HTTP/2 over the TLS connection could not be set up.
    #[error("HTTP/2 with proxy-server at {addr} failed")]
    Transport {
        /// The frontend address.
        addr: std::net::SocketAddr,
        /// Why.
        #[source]
        source: tonic::transport::Error,
    },
    /// Not a valid TLS server name.
    #[error("{0:?} is not a valid TLS server name")]
    ServerName(String),
    /// The HTTP-CONNECT frontend answered with an error status.
    #[error("CONNECT {address} answered {status}: {body}")]
    HttpStatus {
        /// The destination.
        address: String,
        /// The HTTP status code.
        status: u16,
        /// The response body (at most 64 KiB).
        body: String,
    },
    /// The HTTP-CONNECT frontend's answer was not HTTP.
    #[error("CONNECT {address}: malformed answer from proxy-server")]
    BadAnswer {
        /// The destination.
        address: String,
    },
    /// Reading or writing the frontend connection failed.
    #[error("frontend connection failed")]
    Io(#[from] io::Error),
    /// The Unix socket could not be connected (HTTP-CONNECT mode).
    #[error("cannot connect to proxy-server at {path}")]
    UdsConnect {
        /// The socket path.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The gRPC stream failed.
    #[error("proxy stream failed: {0}")]
    Stream(#[from] tonic::Status),
    /// The server or the agent answered the dial with an error.
    #[error("dial to {address} failed: {error}")]
    Dial {
        /// The destination.
        address: String,
        /// The error text of DIAL_RSP.
        error: String,
    },
    /// No DIAL_RSP within [`DIAL_TIMEOUT`].
    #[error("dial to {address} timed out")]
    DialTimeout {
        /// The destination.
        address: String,
    },
    /// The stream ended before the connection was closed with CLOSE_RSP.
    #[error("proxy stream closed before the connection was closed")]
    StreamClosed,
    /// The connection was closed with an error (CLOSE_RSP error or DIAL_CLS).
    #[error("connection closed by the proxy: {0}")]
    Remote(String),
    /// CLOSE_RSP did not come within [`CLOSE_TIMEOUT`].
    #[error("no CLOSE_RSP within {CLOSE_TIMEOUT:?}")]
    CloseTimeout,
}

/// Our HTTP/2 settings (see [`tunnel::flow`]): 256 KiB frames, large fixed
/// windows.
fn tuned(endpoint: Endpoint) -> Endpoint {
    endpoint
        .max_frame_size(edge::h2::MAX_FRAME_SIZE)
        .initial_stream_window_size(edge::h2::STREAM_WINDOW)
        .initial_connection_window_size(edge::h2::CONNECTION_WINDOW)
}

/// A gRPC channel over a fresh connection to a Unix socket.
///
/// # Errors
/// [`ClientError::Connect`] naming the path.
pub async fn uds_channel(path: &Path) -> Result<Channel, ClientError> {
    let socket = path.to_owned();
    tuned(Endpoint::from_static("http://proxy-server.invalid"))
        .connect_with_connector(tower::service_fn(move |_| {
            let socket = socket.clone();
            async move { UnixStream::connect(socket).await.map(TokioIo::new) }
        }))
        .await
        .map_err(|source| ClientError::Connect {
            path: path.to_owned(),
            source,
        })
}

/// A gRPC channel over a fresh mTLS TCP connection to a proxy-server
/// frontend (`--server-port` with `--server-ca-cert`).
///
/// # Errors
/// TCP or TLS failure, or an invalid server name; the error names the address.
pub async fn tls_channel(
    addr: std::net::SocketAddr,
    server_name: &str,
    tls: std::sync::Arc<rustls::ClientConfig>,
) -> Result<Channel, ClientError> {
    let name = rustls_pki_types::ServerName::try_from(server_name.to_owned())
        .map_err(|_| ClientError::ServerName(server_name.to_owned()))?;
    let connect = |source: io::Error| ClientError::Tls { addr, source };
    let tcp = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(connect)?;
    let _ = tcp.set_nodelay(true);
    let stream = tokio_rustls::TlsConnector::from(tls)
        .connect(name, tcp)
        .await
        .map_err(connect)?;
    let endpoint = Endpoint::from_shared(format!("http://{addr}"))
        .map_err(|source| ClientError::Transport { addr, source })?;
    edge::h2::channel_over(tuned(endpoint), stream)
        .await
        .map_err(|source| ClientError::Transport { addr, source })
}

/// An established tunneled connection: read and write it like a socket.
/// Dropping it (or shutting down its write side) closes the connection with
/// CLOSE_REQ; [`TunnelConn::finish`] tells how the connection ended.
pub struct TunnelConn {
    /// The caller's end of the pipe to the driver task.
    io: DuplexStream,
    /// The connection id the agent assigned.
    conn_id: ConnId,
    /// The driver's verdict once the connection is over.
    outcome: oneshot::Receiver<Result<(), ClientError>>,
}

impl TunnelConn {
    /// The connection id the agent assigned.
    pub fn conn_id(&self) -> ConnId {
        self.conn_id
    }

    /// Closes the caller's end and waits for the connection to end: `Ok` after
    /// a clean CLOSE_RSP, else why it ended.
    ///
    /// # Errors
    /// The ways a connection can end badly; see [`ClientError`].
    pub async fn finish(self) -> Result<(), ClientError> {
        drop(self.io);
        self.outcome.await.unwrap_or(Err(ClientError::StreamClosed))
    }
}

/// Dials `address` through proxy-server on `channel` (a new `Proxy` stream).
///
/// # Errors
/// The stream cannot be opened, the dial is refused or times out.
pub async fn dial(channel: Channel, address: &str) -> Result<TunnelConn, ClientError> {
    dial_as(channel, address, DialId::random()).await
}

/// [`dial`] with the DIAL_REQ's `random` given (unique among the stream's
/// dials): the id the server's audit log records the dial by
/// (`dial_id`), for a caller that joins its dials to those records.
///
/// # Errors
/// As [`dial`].
pub async fn dial_as(
    channel: Channel,
    address: &str,
    random: DialId,
) -> Result<TunnelConn, ClientError> {
    let (out_tx, out_rx) = tunnel::queue::queue(OUTBOUND_BYTES, OUTBOUND_BYTES);
    let dial = Packet::dial_request("tcp", address, random.0);
    let cost = tunnel::flow::packet_cost(&dial);
    out_tx
        .push(dial, cost)
        .map_err(|_| ClientError::StreamClosed)?;
    let handshake = async {
        let mut inbound = ProxyServiceClient::new(channel)
            .proxy(out_rx)
            .await?
            .into_inner();
        loop {
            let Some(packet) = inbound.message().await? else {
                return Err(ClientError::StreamClosed);
            };
            match packet.into_kind() {
                PacketKind::DialRsp(rsp) if rsp.random == random.0 => {
                    if !rsp.error.is_empty() {
                        return Err(ClientError::Dial {
                            address: address.to_owned(),
                            error: rsp.error,
                        });
                    }
                    return Ok((ConnId(rsp.connect_id), inbound));
                }
                PacketKind::DialCls(cls) if cls.random == random.0 => {
                    return Err(ClientError::Dial {
                        address: address.to_owned(),
                        error: "dial closed by the proxy".to_owned(),
                    });
                }
                other => tracing::debug!(packet = ?other, "ignoring packet before DIAL_RSP"),
            }
        }
    };
    let (conn_id, inbound) = tokio::time::timeout(DIAL_TIMEOUT, handshake)
        .await
        .map_err(|_| ClientError::DialTimeout {
            address: address.to_owned(),
        })??;

    let (io, ours) = tokio::io::duplex(PIPE_BYTES);
    let (outcome_tx, outcome) = oneshot::channel();
    tokio::spawn(async move {
        let result = drive(ours, conn_id, inbound, out_tx).await;
        let _ = outcome_tx.send(result);
    });
    Ok(TunnelConn {
        io,
        conn_id,
        outcome,
    })
}

/// Runs an established connection: the byte mover between the caller's pipe and
/// DATA packets, and the reader of the inbound stream.
async fn drive(
    pipe: DuplexStream,
    conn_id: ConnId,
    mut inbound: tonic::Streaming<Packet>,
    out_tx: tunnel::queue::QueueTx<Packet>,
) -> Result<(), ClientError> {
    let (data_tx, data_rx) = tunnel::flow::inbound(None, INBOUND_CAPACITY);
    let reader = async move {
        // `data_tx` lives in here: when this returns, the mover drains and
        // closes the caller's pipe.
        let data_tx = data_tx;
        loop {
            let Some(packet) = inbound.message().await? else {
                return Err(ClientError::StreamClosed);
            };
            match packet.into_kind() {
                PacketKind::Data(data) if data.connect_id == conn_id.0 => {
                    // The caller may be gone; keep reading until CLOSE_RSP.
                    let _ = data_tx.send(data.data).await;
                }
                PacketKind::CloseRsp(rsp) if rsp.connect_id == conn_id.0 => {
                    return if rsp.error.is_empty() {
                        Ok(())
                    } else {
                        Err(ClientError::Remote(rsp.error))
                    };
                }
                PacketKind::DialCls(_) => {
                    return Err(ClientError::Remote("dial closed by the proxy".to_owned()));
                }
                other => tracing::debug!(packet = ?other, "ignoring unexpected packet"),
            }
        }
    };
    // The stream is this connection's own: HTTP/2 flow control is its window.
    let up = QueueUpstream::new(conn_id, out_tx.clone(), None);
    let moving = mover::run(pipe, up, WindowDownstream::new(conn_id, data_rx, None));
    tokio::pin!(reader, moving);
    tokio::select! {
        result = &mut reader => {
            // Remote side closed (or the stream broke): let the mover write
            // what is queued, then it ends on its own.
            let _ = moving.await;
            result
        }
        end = &mut moving => match end {
            MoverEnd::LocalEof | MoverEnd::LocalError(_) => {
                let close = Packet::close_request(conn_id.0);
                let cost = tunnel::flow::packet_cost(&close);
                if out_tx.push(close, cost).is_err() {
                    return Err(ClientError::StreamClosed);
                }
                tokio::time::timeout(CLOSE_TIMEOUT, reader)
                    .await
                    .unwrap_or(Err(ClientError::CloseTimeout))
            }
            MoverEnd::PeerClosed | MoverEnd::PeerFailed | MoverEnd::TunnelGone => reader.await,
        },
    }
}

edge::forward_io!([] TunnelConn, io);

/// Largest HTTP-CONNECT answer head and error body read.
const MAX_ANSWER: usize = 64 * 1024;

/// Sends `CONNECT address HTTP/1.1` on `io` and reads the answer; on `200`
/// returns `io`, positioned at the first tunnel byte (the head is read byte by
/// byte so that nothing after it is consumed).
///
/// # Errors
/// [`ClientError::HttpStatus`] with the status and body of a refusal.
pub async fn http_connect<IO>(mut io: IO, address: &str) -> Result<IO, ClientError>
where
    IO: AsyncRead + AsyncWrite + Unpin,
{
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    io.write_all(format!("CONNECT {address} HTTP/1.1\r\nHost: {address}\r\n\r\n").as_bytes())
        .await?;
    io.flush().await?;
    let bad = || ClientError::BadAnswer {
        address: address.to_owned(),
    };
    let mut head = Vec::with_capacity(64);
    while !head.ends_with(b"\r\n\r\n") {
        if head.len() >= MAX_ANSWER {
            return Err(bad());
        }
        let mut byte = [0u8; 1];
        if io.read(&mut byte).await? == 0 {
            return Err(bad());
        }
        head.push(byte[0]);
    }
    let mut headers = [httparse::EMPTY_HEADER; 32];
    let mut response = httparse::Response::new(&mut headers);
    let status = match response.parse(&head) {
        Ok(httparse::Status::Complete(_)) => response.code.ok_or_else(bad)?,
        _ => return Err(bad()),
    };
    if status == 200 {
        return Ok(io);
    }
    let mut body = Vec::new();
    let _ = (&mut io)
        .take(MAX_ANSWER as u64)
        .read_to_end(&mut body)
        .await;
    Err(ClientError::HttpStatus {
        address: address.to_owned(),
        status,
        body: String::from_utf8_lossy(&body).into_owned(),
    })
}

/// A TLS connection to the HTTP-CONNECT frontend at `addr` (ALPN
/// `http/1.1`), ready for [`http_connect`]; its TCP socket's local address
/// is what the server's audit log records as the frontend's peer.
///
/// # Errors
/// `server_name` is not a name, or connecting or the handshake fails.
pub async fn connect_tls(
    addr: std::net::SocketAddr,
    server_name: &str,
    tls: &rustls::ClientConfig,
) -> Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>, ClientError> {
    let mut config = tls.clone();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    let name = rustls_pki_types::ServerName::try_from(server_name.to_owned())
        .map_err(|_| ClientError::ServerName(server_name.to_owned()))?;
    let failed = |source: io::Error| ClientError::Tls { addr, source };
    let tcp = tokio::net::TcpStream::connect(addr).await.map_err(failed)?;
    let _ = tcp.set_nodelay(true);
    tokio_rustls::TlsConnector::from(std::sync::Arc::new(config))
        .connect(name, tcp)
        .await
        .map_err(failed)
}

/// How the frontend is reached.
#[derive(Clone, Debug)]
pub enum Transport {
    /// A Unix socket (`--uds-name`).
    Uds(PathBuf),
    /// mTLS TCP (`--server-port` with `--server-ca-cert`).
    Tls {
        /// The frontend address.
        addr: std::net::SocketAddr,
        /// The name its certificate must carry.
        server_name: String,
        /// Client TLS (trust and client certificate).
        tls: std::sync::Arc<rustls::ClientConfig>,
    },
}

/// The frontend protocol (`--mode` of proxy-server).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// `ProxyService/Proxy`.
    Grpc,
    /// `CONNECT host:port HTTP/1.1`.
    HttpConnect,
}

/// A tunneled connection of either mode.
pub use edge::io::Io;

/// Dials through proxy-server the way kube-apiserver does: every dial on a
/// fresh frontend connection (a single-use tunnel in gRPC mode).
#[derive(Clone)]
pub struct Dialer {
    /// How the frontend is reached.
    pub transport: Transport,
    /// Which protocol it speaks.
    pub mode: Mode,
}

impl Dialer {
    /// Opens a connection to `address` on the agent side.
    ///
    /// # Errors
    /// Connecting to the frontend fails, or the dial is refused.
    pub async fn dial(&self, address: &str) -> Result<Box<dyn Io>, ClientError> {
        match (self.mode, &self.transport) {
            (Mode::Grpc, Transport::Uds(path)) => {
                Ok(Box::new(dial(uds_channel(path).await?, address).await?))
            }
            (
                Mode::Grpc,
                Transport::Tls {
                    addr,
                    server_name,
                    tls,
                },
            ) => Ok(Box::new(
                dial(tls_channel(*addr, server_name, tls.clone()).await?, address).await?,
            )),
            (Mode::HttpConnect, Transport::Uds(path)) => {
                let io =
                    UnixStream::connect(path)
                        .await
                        .map_err(|source| ClientError::UdsConnect {
                            path: path.clone(),
                            source,
                        })?;
                Ok(Box::new(http_connect(io, address).await?))
            }
            (
                Mode::HttpConnect,
                Transport::Tls {
                    addr,
                    server_name,
                    tls,
                },
            ) => {
                let io = connect_tls(*addr, server_name, tls).await?;
                Ok(Box::new(http_connect(io, address).await?))
            }
        }
    }
}
