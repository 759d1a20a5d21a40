//! The fault suite: the real binaries on loopback, driven into the faults a
//! cluster meets (a destination that stops reading then resets, an agent
//! killed with SIGKILL, a frontend that stops reading, oversize messages,
//! garbage and floods), checking that every frontend is told, that nothing
//! stays behind (gauges, memory, tasks that hold up a graceful shutdown)
//! and that the server keeps serving.

#![allow(clippy::unwrap_used)] // tests: a panic is a failure report

use std::{
    os::unix::net::UnixStream as StdUnixStream,
    path::Path,
    sync::Arc,
    time::{Duration, Instant},
};

use bytes::Bytes;
use hyper_util::rt::TokioIo;
use integration_tests::{
    AgentProcess, DEADLINE,
    backend::{self, Stall},
    process::ServerProcess,
    trace_init,
};
use proto::{Packet, packet::PacketKind, proxy_service_client::ProxyServiceClient};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::UnixStream,
    sync::mpsc,
    task::JoinHandle,
};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Channel, Endpoint};
use tunnel::ids::DialId;

/// Tunnels stalled at once in the stalled-upload scenarios.
const STALLED: usize = 60;
/// Every frontend must learn of the fault within this.
const TOLD_WITHIN: Duration = Duration::from_secs(1);
/// How far server RSS may stay above its baseline once the faults are over.
const RSS_SLACK: u64 = 20 * 1024 * 1024;
/// The graceful shutdown timeout the server runs with.
const GRACE: &str = "--graceful-shutdown-timeout=5s";
/// How long a SIGTERM may take once nothing is open.
const EXIT_WITHIN: Duration = Duration::from_secs(1);
/// One upload write.
const CHUNK: usize = 64 * 1024;

const PROXY_STREAMS: &str =
    "konnectivity_network_proxy_server_grpc_connections{service_method=\"Proxy\"}";
const BLOCKED_READERS: &str =
    "konnectivity_network_proxy_server_full_receive_channels{service_method=\"Proxy\"}";
const HTTP_CONNECTIONS: &str = "konnectivity_network_proxy_server_http_connections";
const ESTABLISHED: &str = "konnectivity_network_proxy_server_established_connections";
const PENDING: &str = "konnectivity_network_proxy_server_pending_backend_dials";

/// A gRPC channel over a Unix-socket connection that the test can close as
/// kube-apiserver closes a single-use tunnel's connection.
struct ClosableChannel {
    channel: Channel,
    /// A second handle on the socket, to shut it down.
    socket: StdUnixStream,
}

impl ClosableChannel {
    async fn connect(path: &Path) -> Self {
        let std = StdUnixStream::connect(path).unwrap();
        let socket = std.try_clone().unwrap();
        std.set_nonblocking(true).unwrap();
        let slot = std::sync::Mutex::new(Some(std));
        let channel = Endpoint::from_static("http://proxy-server.invalid")
            .connect_with_connector(tower::service_fn(move |_| {
                let std = slot.lock().unwrap().take();
                async move {
                    let std =
                        std.ok_or_else(|| std::io::Error::other("connection already used"))?;
                    UnixStream::from_std(std).map(TokioIo::new)
                }
            }))
            .await
            .unwrap();
        Self { channel, socket }
    }

    /// Closes the connection under every stream on it.
    fn close(&self) {
        let _ = self.socket.shutdown(std::net::Shutdown::Both);
    }
}

/// How the stalled frontends reach the server.
#[derive(Clone, Copy, Debug)]
enum Layout {
    /// gRPC, one HTTP/2 connection per tunnel (kube-apiserver's single-use
    /// tunnels), closed once the frontend is told.
    GrpcConnectionPerTunnel,
    /// gRPC, every tunnel a stream of one HTTP/2 connection; each stream is
    /// cancelled once its frontend is told.
    GrpcSharedConnection,
    /// HTTP CONNECT, a socket per tunnel.
    HttpConnect,
}

impl Layout {
    fn mode(self) -> &'static str {
        match self {
            Self::GrpcConnectionPerTunnel | Self::GrpcSharedConnection => "grpc",
            Self::HttpConnect => "http-connect",
        }
    }
}

/// How a stall ends.
#[derive(Clone, Copy, Debug)]
enum Ending {
    /// The destination resets every connection.
    DestinationReset,
    /// The agent is killed with SIGKILL.
    AgentKilled,
}

/// A frontend that uploads without end; `told` resolves with the time it
/// learnt that its connection is over.
struct Upload {
    told: JoinHandle<Instant>,
}

/// Opens a `Proxy` stream on `channel`, dials `address` and uploads until
/// the connection is closed; then closes the tunnel (`close`).
async fn grpc_upload(
    channel: Channel,
    address: &str,
    close: impl FnOnce() + Send + 'static,
) -> Upload {
    let (tx, rx) = mpsc::channel(4);
    let random = DialId::random();
    tx.send(Packet::dial_request("tcp", address, random.0))
        .await
        .unwrap();
    let mut inbound = ProxyServiceClient::new(channel)
        .proxy(ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let conn = match inbound.message().await.unwrap().unwrap().into_kind() {
        PacketKind::DialRsp(rsp) if rsp.error.is_empty() => rsp.connect_id,
        other => panic!("expected a successful DIAL_RSP, got {other:?}"),
    };
    let writer = tokio::spawn(async move {
        let chunk = Bytes::from(vec![0x5a; CHUNK]);
        while tx.send(Packet::data(conn, chunk.clone())).await.is_ok() {}
    });
    let told = tokio::spawn(async move {
        // A CLOSE_RSP, or the stream's end: either tells the frontend.
        if let Ok(Some(packet)) = inbound.message().await {
            match packet.into_kind() {
                PacketKind::CloseRsp(rsp) if rsp.connect_id == conn => {}
                other => panic!("unexpected packet while uploading: {other:?}"),
            }
        }
        let at = Instant::now();
        // As konnectivity-client: the tunnel is done.
        writer.abort();
        drop(inbound);
        close();
        at
    });
    Upload { told }
}

/// CONNECTs to `address` over the socket and uploads until the server
/// closes the connection.
async fn connect_upload(uds: &Path, address: &str) -> Upload {
    let io = UnixStream::connect(uds).await.unwrap();
    let io = tunnel::client::http_connect(io, address).await.unwrap();
    let (mut reader, mut writer) = tokio::io::split(io);
    let writer = tokio::spawn(async move {
        let chunk = vec![0x5a; CHUNK];
        while writer.write_all(&chunk).await.is_ok() {}
    });
    let told = tokio::spawn(async move {
        let mut buf = [0u8; 1024];
        // Nothing comes back from a destination that never writes: the
        // first read that returns is the close (EOF or reset).
        while let Ok(n) = reader.read(&mut buf).await {
            if n == 0 {
                break;
            }
        }
        let at = Instant::now();
        writer.abort();
        at
    });
    Upload { told }
}

/// An echo through `server` in `layout` on `channel` (a fresh connection
/// when `None`), byte-exact.
async fn echo_through(
    server: &ServerProcess,
    layout: Layout,
    channel: Option<Channel>,
    echo: &backend::Backend,
) {
    let sent = backend::pattern(256 * 1024, 3);
    let mut conn: Box<dyn tunnel::client::Io> = match layout {
        Layout::HttpConnect => Box::new(
            tunnel::client::http_connect(
                UnixStream::connect(&server.uds).await.unwrap(),
                &echo.address(),
            )
            .await
            .unwrap(),
        ),
        _ => {
            let channel = match channel {
                Some(channel) => channel,
                None => tunnel::client::uds_channel(&server.uds).await.unwrap(),
            };
            Box::new(
                tunnel::client::dial(channel, &echo.address())
                    .await
                    .unwrap(),
            )
        }
    };
    let (mut r, mut w) = tokio::io::split(&mut conn);
    let write = async {
        w.write_all(&sent).await.unwrap();
    };
    let mut got = vec![0u8; sent.len()];
    let read = async {
        r.read_exact(&mut got).await.unwrap();
    };
    tokio::join!(write, read);
    assert!(got == sent, "echo differs");
}

/// Sixty tunnels upload to a destination that stopped reading; then the
/// fault (`ending`) ends them. Every frontend is told within a second,
/// every gauge and the server's memory return to their baseline, the
/// server serves new dials at once (on the shared connection too), and a
/// SIGTERM with a 5 s graceful timeout exits within a second.
async fn stalled_uploads(layout: Layout, ending: Ending) {
    trace_init();
    let mut server = ServerProcess::start(layout.mode(), &[GRACE.to_owned()]).await;
    let mut agent = AgentProcess::spawn(server.agent_addr.port(), &[]);
    server.wait_for_agents(1).await;
    let echo = backend::echo().await;
    let shared = match layout {
        Layout::GrpcSharedConnection => Some(ClosableChannel::connect(&server.uds).await),
        _ => None,
    };
    // Baseline: the server after one tunnel of each kind it will carry.
    echo_through(
        &server,
        layout,
        shared.as_ref().map(|c| c.channel.clone()),
        &echo,
    )
    .await;
    server.wait_for_metric(ESTABLISHED, 0.0, DEADLINE).await;
    let baseline = server.rss();

    let stall = Stall::start();
    let mut uploads = Vec::new();
    let mut per_tunnel = Vec::new();
    for _ in 0..STALLED {
        let upload = match layout {
            Layout::GrpcConnectionPerTunnel => {
                let conn = Arc::new(ClosableChannel::connect(&server.uds).await);
                per_tunnel.push(conn.clone());
                let channel = conn.channel.clone();
                grpc_upload(channel, &stall.address(), move || conn.close()).await
            }
            Layout::GrpcSharedConnection => {
                let channel = shared.as_ref().unwrap().channel.clone();
                grpc_upload(channel, &stall.address(), || {}).await
            }
            Layout::HttpConnect => connect_upload(&server.uds, &stall.address()).await,
        };
        uploads.push(upload);
    }
    // Stalled: every tunnel's reader in the server waits for room.
    server
        .wait_for_metric(BLOCKED_READERS, STALLED as f64, Duration::from_secs(60))
        .await;
    assert_eq!(stall.held(), STALLED);

    let fault = Instant::now();
    match ending {
        Ending::DestinationReset => stall.reset_all(),
        Ending::AgentKilled => agent.kill(),
    }
    for upload in uploads {
        let told = tokio::time::timeout(DEADLINE, upload.told)
            .await
            .expect("a frontend was never told")
            .unwrap();
        let after = told.saturating_duration_since(fault);
        assert!(after < TOLD_WITHIN, "a frontend was told after {after:?}");
    }

    // Nothing stays behind.
    for (series, value) in [
        (PROXY_STREAMS, 0.0),
        (HTTP_CONNECTIONS, 0.0),
        (ESTABLISHED, 0.0),
        (PENDING, 0.0),
        (BLOCKED_READERS, 0.0),
    ] {
        server.wait_for_metric(series, value, DEADLINE).await;
    }
    let rss_limit = baseline + RSS_SLACK;
    let start = Instant::now();
    while server.rss() > rss_limit {
        assert!(
            start.elapsed() < DEADLINE,
            "server RSS {} MiB stays above its baseline {} MiB + 20 MiB",
            server.rss() >> 20,
            baseline >> 20
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // New dials are served at once, on the shared connection too.
    if let Ending::AgentKilled = ending {
        agent = AgentProcess::spawn(server.agent_addr.port(), &[]);
        server.wait_for_agents(1).await;
    }
    let started = Instant::now();
    echo_through(
        &server,
        layout,
        shared.as_ref().map(|c| c.channel.clone()),
        &echo,
    )
    .await;
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "a new tunnel took {:?}",
        started.elapsed()
    );
    drop(shared);
    drop(per_tunnel);
    server.wait_for_metric(ESTABLISHED, 0.0, DEADLINE).await;

    let took = server.terminate(Duration::from_secs(10)).await;
    assert!(took < EXIT_WITHIN, "SIGTERM took {took:?} to exit");
    drop(agent);
}

mod stalled_upload {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn grpc_connection_per_tunnel_destination_reset() {
        stalled_uploads(Layout::GrpcConnectionPerTunnel, Ending::DestinationReset).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn grpc_connection_per_tunnel_agent_killed() {
        stalled_uploads(Layout::GrpcConnectionPerTunnel, Ending::AgentKilled).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn grpc_shared_connection_destination_reset() {
        stalled_uploads(Layout::GrpcSharedConnection, Ending::DestinationReset).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn grpc_shared_connection_agent_killed() {
        stalled_uploads(Layout::GrpcSharedConnection, Ending::AgentKilled).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn http_connect_destination_reset() {
        stalled_uploads(Layout::HttpConnect, Ending::DestinationReset).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn http_connect_agent_killed() {
        stalled_uploads(Layout::HttpConnect, Ending::AgentKilled).await;
    }
}
