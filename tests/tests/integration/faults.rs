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
    AgentProcess, DEADLINE, RawFrontend,
    destination::{self, Stall},
    process::{AgentSwarm, ServerProcess},
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
    let (
        RawFrontend {
            tx,
            rx: mut inbound,
        },
        conn,
    ) = RawFrontend::dial(ProxyServiceClient::new(channel), address).await;
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
    let io = client::dial::http_connect(io, address).await.unwrap();
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
    echo: &destination::Destination,
) {
    let sent = destination::pattern(256 * 1024, 3);
    let mut conn: Box<dyn client::dial::Io> = match layout {
        Layout::HttpConnect => Box::new(
            client::dial::http_connect(
                UnixStream::connect(&server.uds).await.unwrap(),
                &echo.address(),
            )
            .await
            .unwrap(),
        ),
        _ => {
            let channel = match channel {
                Some(channel) => channel,
                None => client::dial::uds_channel(&server.uds).await.unwrap(),
            };
            Box::new(client::dial::dial(channel, &echo.address()).await.unwrap())
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
    let echo = destination::echo().await;
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

    let stalled_rss = server.rss();
    let fault = Instant::now();
    match ending {
        Ending::DestinationReset => stall.reset_all(),
        Ending::AgentKilled => agent.kill(),
    }
    let mut slowest = Duration::ZERO;
    for upload in uploads {
        let told = tokio::time::timeout(DEADLINE, upload.told)
            .await
            .expect("a frontend was never told")
            .unwrap();
        let after = told.saturating_duration_since(fault);
        assert!(after < TOLD_WITHIN, "a frontend was told after {after:?}");
        slowest = slowest.max(after);
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

    let after_rss = server.rss();
    let took = server.terminate(Duration::from_secs(10)).await;
    assert!(took < EXIT_WITHIN, "SIGTERM took {took:?} to exit");
    eprintln!(
        "{layout:?}, {ending:?}: all told within {slowest:?}; server RSS {} MiB before, {} MiB stalled, {} MiB after; SIGTERM exit in {took:?}",
        baseline >> 20,
        stalled_rss >> 20,
        after_rss >> 20
    );
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

/// A message one byte over gRPC's 4 MiB limit: a DATA packet whose
/// payload alone is 4 MiB.
fn oversize_data(conn: i64) -> Packet {
    Packet::data(conn, Bytes::from(vec![0x42; 4 * 1024 * 1024]))
}

const FROM_CLIENT_TOO_LARGE: &str = "konnectivity_network_proxy_server_stream_errors_total{code=\"ResourceExhausted\",packet_type=\"Unknown\",segment=\"from_client\"}";
const FROM_AGENT_TOO_LARGE: &str = "konnectivity_network_proxy_server_stream_errors_total{code=\"ResourceExhausted\",packet_type=\"Unknown\",segment=\"from_agent\"}";

mod oversize {
    use proto::agent_service_client::AgentServiceClient;
    use tonic::{Code, Request, metadata::MetadataValue};

    use super::*;

    /// A frontend sends a message over 4 MiB: its stream ends with
    /// RESOURCE_EXHAUSTED (as grpc-go's server answers), its connection is
    /// closed on the node side, the error is counted, and the server keeps
    /// serving.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn from_a_frontend() {
        trace_init();
        let server = ServerProcess::start("grpc", &[]).await;
        let _agent = AgentProcess::spawn(server.agent_addr.port(), &[]);
        server.wait_for_agents(1).await;
        let echo = destination::echo().await;

        let channel = client::dial::uds_channel(&server.uds).await.unwrap();
        let client = ProxyServiceClient::new(channel).max_encoding_message_size(16 << 20);
        let (
            RawFrontend {
                tx,
                rx: mut inbound,
            },
            conn,
        ) = RawFrontend::dial(client, &echo.address()).await;
        integration_tests::wait_for("the echo connection", || echo.open_connections() == 1).await;
        tx.send(oversize_data(conn)).await.unwrap();

        let status = loop {
            match tokio::time::timeout(DEADLINE, inbound.message())
                .await
                .unwrap()
            {
                Ok(Some(_)) => continue,
                Ok(None) => panic!("the stream ended with OK: the message was dropped silently"),
                Err(status) => break status,
            }
        };
        assert_eq!(status.code(), Code::ResourceExhausted, "{status}");
        integration_tests::wait_for("the node-side connection to close", || {
            echo.open_connections() == 0
        })
        .await;
        server
            .wait_for_metric(FROM_CLIENT_TOO_LARGE, 1.0, DEADLINE)
            .await;
        server.wait_for_metric(ESTABLISHED, 0.0, DEADLINE).await;
        server.wait_for_metric(PROXY_STREAMS, 0.0, DEADLINE).await;
        echo_through(&server, Layout::GrpcConnectionPerTunnel, None, &echo).await;
    }

    /// An agent sends a message over 4 MiB: its stream ends with
    /// RESOURCE_EXHAUSTED, the frontend's connection over it is closed with
    /// an error, the error is counted, and the server keeps serving through
    /// another agent.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn from_an_agent() {
        trace_init();
        let server = ServerProcess::start("grpc", &[]).await;
        let config = integration_tests::agent_config(server.agent_addr, &Default::default());
        let channel =
            client::dial::tls_channel(server.agent_addr, "127.0.0.1", config.tls.load().unwrap())
                .await
                .unwrap();
        let (agent_tx, agent_rx) = mpsc::channel::<Packet>(4);
        let mut request = Request::new(ReceiverStream::new(agent_rx));
        request
            .metadata_mut()
            .insert("agentid", MetadataValue::from_static("oversize-agent"));
        let mut agent_inbound = AgentServiceClient::new(channel)
            .max_encoding_message_size(16 << 20)
            .connect(request)
            .await
            .unwrap()
            .into_inner();
        server.wait_for_agents(1).await;

        // A frontend dials through the scripted agent.
        let (tx, rx) = mpsc::channel(4);
        let random = DialId::random();
        tx.send(Packet::dial_request("tcp", "10.0.0.1:80", random.0))
            .await
            .unwrap();
        let frontend = client::dial::uds_channel(&server.uds).await.unwrap();
        let mut inbound = ProxyServiceClient::new(frontend)
            .proxy(ReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        match agent_inbound.message().await.unwrap().unwrap().into_kind() {
            PacketKind::DialReq(req) => {
                assert_eq!(req.random, random.0);
                agent_tx
                    .send(Packet::dial_response(req.random, 1, ""))
                    .await
                    .unwrap();
            }
            other => panic!("expected DIAL_REQ, got {other:?}"),
        }
        match inbound.message().await.unwrap().unwrap().into_kind() {
            PacketKind::DialRsp(rsp) => assert_eq!((rsp.connect_id, rsp.error.as_str()), (1, "")),
            other => panic!("expected DIAL_RSP, got {other:?}"),
        }

        agent_tx.send(oversize_data(1)).await.unwrap();
        let status = loop {
            match tokio::time::timeout(DEADLINE, agent_inbound.message())
                .await
                .unwrap()
            {
                Ok(Some(_)) => continue,
                Ok(None) => {
                    panic!("the agent stream ended with OK: the message was dropped silently")
                }
                Err(status) => break status,
            }
        };
        assert_eq!(status.code(), Code::ResourceExhausted, "{status}");
        match tokio::time::timeout(DEADLINE, inbound.message())
            .await
            .unwrap()
            .unwrap()
            .unwrap()
            .into_kind()
        {
            PacketKind::CloseRsp(rsp) => {
                assert_eq!(rsp.connect_id, 1);
                assert!(!rsp.error.is_empty(), "closed without an error");
            }
            other => panic!("expected CLOSE_RSP, got {other:?}"),
        }
        server
            .wait_for_metric(FROM_AGENT_TOO_LARGE, 1.0, DEADLINE)
            .await;
        server.wait_for_metric(ESTABLISHED, 0.0, DEADLINE).await;

        let _agent = AgentProcess::spawn(server.agent_addr.port(), &[]);
        server.wait_for_agents(1).await;
        let echo = destination::echo().await;
        echo_through(&server, Layout::GrpcConnectionPerTunnel, None, &echo).await;
    }
}

const STALLED_CLOSED: &str = "konnectivity_rs_server_connections_closed_total{reason=\"stalled\"}";

/// A frontend stops reading its tunnel while another frontend downloads
/// through the same agent: the download completes byte-exact (its rate
/// next to the stalled one is the bench's `hol` scenario), and the stalled
/// connection is closed with an error once `--frontend-stall-timeout`
/// passes, at both ends.
async fn stalled_reader(layout: Layout) {
    trace_init();
    let server =
        ServerProcess::start(layout.mode(), &["--frontend-stall-timeout=1s".to_owned()]).await;
    let _agent = AgentProcess::spawn(server.agent_addr.port(), &[]);
    server.wait_for_agents(1).await;
    let endless = destination::download(256 * 1024 * 1024).await;
    let bulk_len = 16 * 1024 * 1024;
    let bulk = destination::download(bulk_len).await;

    // The frontend that stops reading: it dials, then never reads again.
    let stuck = match layout {
        Layout::HttpConnect => {
            let io = UnixStream::connect(&server.uds).await.unwrap();
            Stuck::Connect(
                client::dial::http_connect(io, &endless.address())
                    .await
                    .unwrap(),
            )
        }
        _ => {
            let (tx, rx) = mpsc::channel(4);
            let random = DialId::random();
            tx.send(Packet::dial_request("tcp", &endless.address(), random.0))
                .await
                .unwrap();
            let channel = client::dial::uds_channel(&server.uds).await.unwrap();
            let mut inbound = ProxyServiceClient::new(channel)
                .proxy(ReceiverStream::new(rx))
                .await
                .unwrap()
                .into_inner();
            match inbound.message().await.unwrap().unwrap().into_kind() {
                PacketKind::DialRsp(rsp) if rsp.error.is_empty() => {}
                other => panic!("expected a successful DIAL_RSP, got {other:?}"),
            }
            Stuck::Grpc(tx, inbound)
        }
    };
    let started = Instant::now();

    // The other frontend downloads through the same agent, byte-exact.
    let mut conn = server_dialer(&server, layout)
        .dial(&bulk.address())
        .await
        .unwrap();
    let mut got = Vec::with_capacity(bulk_len);
    conn.read_to_end(&mut got).await.unwrap();
    assert!(
        got == destination::pattern(bulk_len, 7),
        "the download differs"
    );

    // The stalled connection is closed with an error at both ends.
    server.wait_for_metric(STALLED_CLOSED, 1.0, DEADLINE).await;
    assert!(started.elapsed() >= Duration::from_secs(1));
    integration_tests::wait_for("the node side of the stalled connection to close", || {
        endless.open_connections() == 0
    })
    .await;
    let read = match stuck {
        Stuck::Grpc(_tx, mut inbound) => {
            let mut read = 0;
            loop {
                match tokio::time::timeout(DEADLINE, inbound.message())
                    .await
                    .unwrap()
                {
                    Ok(Some(packet)) => match packet.into_kind() {
                        PacketKind::Data(data) => read += data.data.len(),
                        PacketKind::CloseRsp(rsp) => {
                            assert_eq!(rsp.error, proxy_server::STALLED);
                            break;
                        }
                        other => panic!("unexpected {other:?}"),
                    },
                    other => panic!("the stalled stream ended without CLOSE_RSP: {other:?}"),
                }
            }
            read
        }
        Stuck::Connect(mut io) => {
            let mut rest = Vec::new();
            // What was in flight, then the close.
            let _ = tokio::time::timeout(DEADLINE, io.read_to_end(&mut rest))
                .await
                .expect("the stalled CONNECT socket was never closed");
            server
                .wait_for_metric(HTTP_CONNECTIONS, 0.0, DEADLINE)
                .await;
            rest.len()
        }
    };
    assert!(
        read < 256 * 1024 * 1024,
        "the stalled connection was not cut short"
    );
    server.wait_for_metric(ESTABLISHED, 0.0, DEADLINE).await;
}

/// The frontend of [`stalled_reader`] that stops reading.
enum Stuck {
    Grpc(mpsc::Sender<Packet>, tonic::Streaming<Packet>),
    Connect(UnixStream),
}

fn server_dialer(server: &ServerProcess, layout: Layout) -> client::dial::Dialer {
    client::dial::Dialer {
        transport: client::dial::Transport::Uds(server.uds.clone()),
        mode: match layout {
            Layout::HttpConnect => client::dial::Mode::HttpConnect,
            _ => client::dial::Mode::Grpc,
        },
    }
}

mod stalled_reader {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn grpc() {
        stalled_reader(Layout::GrpcConnectionPerTunnel).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn http_connect() {
        stalled_reader(Layout::HttpConnect).await;
    }
}

/// 1,000 clients send bytes that can never be an HTTP request head, and
/// keep their sockets open: each is answered 400 and closed within a
/// second, not held for the 60 s header timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_on_the_connect_socket_is_closed_at_once() {
    trace_init();
    let server = ServerProcess::start("http-connect", &[]).await;
    let garbage: [&[u8]; 4] = [
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03 a TLS hello",
        b"\x00\x00\x00\x00",
        b"GET\x01/ HTTP/1.1",
        b"CONNECT 10.0.0.1:443 FTP/1.0\r\n",
    ];
    let mut clients = tokio::task::JoinSet::new();
    for i in 0..1000 {
        let uds = server.uds.clone();
        let bytes = garbage[i % garbage.len()];
        clients.spawn(async move {
            let mut io = UnixStream::connect(&uds).await.unwrap();
            io.write_all(bytes).await.unwrap();
            let sent = Instant::now();
            let mut answer = Vec::new();
            tokio::time::timeout(DEADLINE, io.read_to_end(&mut answer))
                .await
                .expect("a garbage connection was held")
                .unwrap();
            (sent.elapsed(), answer)
        });
    }
    let mut slowest = Duration::ZERO;
    while let Some(client) = clients.join_next().await {
        let (took, answer) = client.unwrap();
        assert!(took < Duration::from_secs(1), "closed after {took:?}");
        slowest = slowest.max(took);
        assert!(
            answer.starts_with(b"HTTP/1.1 400 Bad Request\r\n"),
            "{}",
            String::from_utf8_lossy(&answer)
        );
    }
    server
        .wait_for_metric(HTTP_CONNECTIONS, 0.0, DEADLINE)
        .await;
    eprintln!("1,000 garbage clients answered 400 and closed, the slowest after {slowest:?}");
}

/// Opens `n` TCP connections to `addr` that never send a byte.
async fn silent_connections(addr: std::net::SocketAddr, n: usize) -> Vec<tokio::net::TcpStream> {
    let mut connecting = tokio::task::JoinSet::new();
    for _ in 0..n {
        connecting.spawn(tokio::net::TcpStream::connect(addr));
    }
    let mut silent = Vec::with_capacity(n);
    while let Some(connected) = connecting.join_next().await {
        silent.push(connected.unwrap().unwrap());
    }
    silent
}

/// Serves one request through `server` with a new agent process, behind
/// whatever else sits on the agent port; how long the agent took to
/// connect and serve.
async fn an_agent_connects_and_serves(server: &ServerProcess) -> (AgentProcess, Duration) {
    let started = Instant::now();
    let agent = AgentProcess::spawn(server.agent_addr.port(), &[]);
    server.wait_for_agents(1).await;
    let echo = destination::echo().await;
    echo_through(server, Layout::GrpcConnectionPerTunnel, None, &echo).await;
    (agent, started.elapsed())
}

/// 2,000 TCP connections that never send a byte sit on the agent port,
/// under the default `--max-tls-handshakes`: all are held (as ANP holds
/// them) and none is dropped, and a real agent connects beside them at
/// once and serves a request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_silent_connections_does_not_lock_agents_out() {
    trace_init();
    let server = ServerProcess::start("grpc", &[]).await;
    let silent = silent_connections(server.agent_addr, 2000).await;
    server
        .wait_for_metric_at_least("process_open_fds", 2000.0, DEADLINE)
        .await;
    let (_agent, took) = an_agent_connects_and_serves(&server).await;
    assert_eq!(
        server.metric(SHED).await,
        0.0,
        "nothing dropped below the cap"
    );
    eprintln!("beside 2,000 silent connections an agent connected and served in {took:?}");
    drop(silent);
}

/// The same flood against a cap of 256: the server holds at most that many
/// (the rest wait in the listen backlog), drops the silent ones (no
/// ClientHello) as they pass a second of silence, and a real agent behind
/// them still gets in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_its_cap_the_agent_port_drops_silent_connections_to_let_an_agent_in() {
    trace_init();
    let server = ServerProcess::start("grpc", &["--max-tls-handshakes=256".to_owned()]).await;
    let silent = silent_connections(server.agent_addr, 2000).await;
    server.wait_for_metric_at_least(SHED, 1.0, DEADLINE).await;
    let (_agent, took) = an_agent_connects_and_serves(&server).await;
    let fds = server.metric("process_open_fds").await;
    assert!(fds < 400.0, "the server holds {fds} descriptors");
    eprintln!(
        "behind 2,000 silent connections at a cap of 256 an agent connected and served in {took:?}; \
         {} dropped, the server holds {fds} descriptors",
        server.metric(SHED).await
    );
    drop(silent);
}

/// Agents of the storm test: one `agent-swarm` process of ours and one of
/// ANP-style agents (no flow-control negotiation), half each.
const STORM_AGENTS: usize = 1_000;
/// How long the storm's agents may take to connect, in the debug build on
/// 2 cores (the bench measures the release build: about 2 s for 5,000).
const STORM_LIMIT: Duration = Duration::from_secs(60);

/// Every agent counts once in each of the server's agent gauges, and
/// nothing was dropped at the handshake cap.
async fn storm_gauges_are_right(server: &ServerProcess, agents: usize) {
    for series in [
        "konnectivity_network_proxy_server_grpc_connections{service_method=\"Connect\"}",
        "konnectivity_network_proxy_server_ready_backend_connections",
    ] {
        assert_eq!(server.metric(series).await, agents as f64, "{series}");
    }
    assert_eq!(server.metric(SHED).await, 0.0, "a handshake was dropped");
}

/// A cluster's reconnect storm: 1,000 agents, each its own TLS connection
/// and `Connect` stream, connect at once to a server with its default flags;
/// every one is admitted (none dropped at the handshake cap) and a tunnel
/// works through them. Then the server is killed (SIGKILL) and started
/// again on the same port: all 1,000 come back by themselves, the gauges
/// count each once, and tunnels work again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_agents_connects_and_all_return_after_a_server_restart() {
    trace_init();
    let server = ServerProcess::start("grpc", &[]).await;
    let port = server.agent_addr.port();
    let half = STORM_AGENTS / 2;
    let _ours = AgentSwarm::start(port, 0, half, &[]).await;
    let _anp_style = AgentSwarm::start(port, half, half, &["--flow-control=false"]).await;
    let connected = Instant::now();
    server
        .wait_for_agents_within(STORM_AGENTS, STORM_LIMIT)
        .await;
    eprintln!(
        "{STORM_AGENTS} agents connected in {:?}",
        connected.elapsed()
    );
    storm_gauges_are_right(&server, STORM_AGENTS).await;
    let echo = destination::echo().await;
    for _ in 0..4 {
        echo_through(&server, Layout::GrpcConnectionPerTunnel, None, &echo).await;
    }

    drop(server);
    let restarted = Instant::now();
    let server = ServerProcess::start("grpc", &[format!("--agent-port={port}")]).await;
    assert_eq!(server.agent_addr.port(), port);
    server
        .wait_for_agents_within(STORM_AGENTS, STORM_LIMIT)
        .await;
    eprintln!(
        "{STORM_AGENTS} agents back {:?} after the restart",
        restarted.elapsed()
    );
    storm_gauges_are_right(&server, STORM_AGENTS).await;
    for _ in 0..4 {
        echo_through(&server, Layout::GrpcConnectionPerTunnel, None, &echo).await;
    }
}

/// Pending handshakes dropped at `--max-tls-handshakes`.
const SHED: &str = "konnectivity_rs_server_limit_reached_total{limit=\"tls_handshakes\"}";

/// Tunnels open at once in the many-tunnels test: enough that a leak of a
/// few hundred bytes per tunnel shows over the rounds, small enough for the
/// debug build on 2 cores. Full size (10,000 × 8 rounds, release binaries)
/// is the bench's churn scenario.
const MANY: usize = 2_000;
/// Dials in flight at once while opening them (the socket's backlog).
const OPENING: usize = 256;

/// Raises this process's open-file limit to its hard limit (children
/// inherit it): `MANY` tunnels take as many sockets here (their frontends),
/// in the server, the agent and the echo process (each a process of its
/// own, so no process holds more than one socket per tunnel).
fn raise_fd_limit() {
    let want = MANY as u64 + 1024;
    let (soft, hard) = rlimit::Resource::NOFILE.get().unwrap();
    assert!(
        hard >= want,
        "the open-file hard limit is {hard}: {MANY} tunnels need {want} (ulimit -Hn)"
    );
    if soft < want {
        rlimit::Resource::NOFILE.set(hard, hard).unwrap();
    }
}

/// One tunnel of the many: dials the echo backend, echoes 1 KiB of its own
/// pattern byte-exact, holds the tunnel open until `close`, then closes it.
async fn one_of_many(
    layout: Layout,
    uds: std::path::PathBuf,
    echo: String,
    seed: u64,
    opening: Arc<tokio::sync::Semaphore>,
    open: Arc<std::sync::atomic::AtomicUsize>,
    close: tokio_util::sync::CancellationToken,
) {
    let sent = destination::pattern(1024, seed);
    let mut got = vec![0u8; sent.len()];
    match layout {
        Layout::HttpConnect => {
            let permit = opening.acquire().await.unwrap();
            let io = UnixStream::connect(&uds).await.unwrap();
            let mut io = client::dial::http_connect(io, &echo).await.unwrap();
            io.write_all(&sent).await.unwrap();
            io.read_exact(&mut got).await.unwrap();
            drop(permit);
            open.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            close.cancelled().await;
            io.shutdown().await.unwrap();
            let mut rest = Vec::new();
            io.read_to_end(&mut rest).await.unwrap();
            assert!(rest.is_empty());
        }
        _ => {
            let permit = opening.acquire().await.unwrap();
            let channel = client::dial::uds_channel(&uds).await.unwrap();
            let (
                RawFrontend {
                    tx,
                    rx: mut inbound,
                },
                conn,
            ) = RawFrontend::dial(ProxyServiceClient::new(channel), &echo).await;
            tx.send(Packet::data(conn, Bytes::from(sent.clone())))
                .await
                .unwrap();
            let mut filled = 0;
            while filled < got.len() {
                match inbound.message().await.unwrap().unwrap().into_kind() {
                    PacketKind::Data(data) => {
                        got[filled..filled + data.data.len()].copy_from_slice(&data.data);
                        filled += data.data.len();
                    }
                    other => panic!("expected DATA, got {other:?}"),
                }
            }
            drop(permit);
            open.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            close.cancelled().await;
            tx.send(Packet::close_request(conn)).await.unwrap();
            match inbound.message().await.unwrap().unwrap().into_kind() {
                PacketKind::CloseRsp(rsp) => assert_eq!(rsp.error, ""),
                other => panic!("expected CLOSE_RSP, got {other:?}"),
            }
        }
    }
    assert!(got == sent, "tunnel {seed} echoed other bytes");
}

/// Rounds of [`many_tunnels`].
const ROUNDS: usize = 4;

/// `ROUNDS` rounds of `MANY` tunnels open at once, each echoing its own
/// bytes: after each, every gauge is back to 0; over the rounds the
/// memory of the server and the agent stops growing (the least of the later
/// half of the rounds within 10 % of the most of the earlier half: a leak or
/// creeping fragmentation grows every round).
async fn many_tunnels(layout: Layout) {
    trace_init();
    raise_fd_limit();
    let server = ServerProcess::start(layout.mode(), &[]).await;
    let agent = AgentProcess::spawn(server.agent_addr.port(), &[]);
    server.wait_for_agents(1).await;
    let echo = destination::EchoProcess::start();
    let mut rss = Vec::new();
    for _ in 0..ROUNDS {
        let opening = Arc::new(tokio::sync::Semaphore::new(OPENING));
        let open = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let close = tokio_util::sync::CancellationToken::new();
        let mut tunnels = tokio::task::JoinSet::new();
        for seed in 0..MANY {
            tunnels.spawn(one_of_many(
                layout,
                server.uds.clone(),
                echo.address(),
                seed as u64,
                opening.clone(),
                open.clone(),
                close.clone(),
            ));
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        while open.load(std::sync::atomic::Ordering::SeqCst) < MANY {
            if let Some(Err(e)) = tunnels.try_join_next() {
                std::panic::resume_unwind(e.into_panic());
            }
            assert!(
                Instant::now() < deadline,
                "{} of {MANY} tunnels open",
                open.load(std::sync::atomic::Ordering::SeqCst)
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        server
            .wait_for_metric(ESTABLISHED, MANY as f64, DEADLINE)
            .await;
        close.cancel();
        while let Some(tunnel) = tunnels.join_next().await {
            tunnel.unwrap();
        }
        for (series, value) in [
            (ESTABLISHED, 0.0),
            (PENDING, 0.0),
            (PROXY_STREAMS, 0.0),
            (HTTP_CONNECTIONS, 0.0),
        ] {
            server.wait_for_metric(series, value, DEADLINE).await;
        }
        rss.push(tokio::join!(
            settled_rss(server.pid()),
            settled_rss(agent.pid())
        ));
    }
    let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
    let rounds: Vec<String> = rss
        .iter()
        .map(|(s, a)| format!("{:.1}/{:.1}", mib(*s), mib(*a)))
        .collect();
    eprintln!("RSS after each round (MiB, server/agent): {rounds:?}");
    // A leak grows every round: the later rounds' least would exceed the
    // earlier rounds' most. (The bench's churn scenario measures the
    // release binaries round by round.)
    let half = ROUNDS / 2;
    let early = |pick: fn(&(u64, u64)) -> u64| rss[..half].iter().map(pick).max().unwrap_or(0);
    let late = |pick: fn(&(u64, u64)) -> u64| rss[half..].iter().map(pick).min().unwrap_or(0);
    for (who, pick) in [
        ("server", (|r: &(u64, u64)| r.0) as fn(&(u64, u64)) -> u64),
        ("agent", |r| r.1),
    ] {
        assert!(
            late(pick) as f64 <= early(pick) as f64 * 1.1,
            "{who} RSS grows over rounds (MiB, server/agent): {rounds:?}"
        );
    }
}

/// RSS of `pid` once freed memory has gone back: jemalloc returns it
/// within a second (`.cargo/config.toml`), so this waits two, then takes
/// the least of four samples over the next second.
async fn settled_rss(pid: u32) -> u64 {
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut least = u64::MAX;
    for _ in 0..4 {
        least = least.min(integration_tests::process::rss_bytes(pid));
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    least
}

mod many_tunnels {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn grpc() {
        many_tunnels(Layout::GrpcConnectionPerTunnel).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn http_connect() {
        many_tunnels(Layout::HttpConnect).await;
    }
}
