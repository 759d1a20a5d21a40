//! Flow control across builds and windows (flow control v2: each side
//! announces its window). A rolling upgrade pairs a server and agents of
//! different builds: v1 is the last build before v2, v2 this one. v1 comes
//! two ways, and every pairing runs with both:
//! - **pinned**: this build's binaries with `--flow-control-version=v1`,
//!   which behave on the wire as v1 did; these run on every checkout;
//! - **real**: v1's own binaries, built by `scripts/test` from the
//!   `flow-control-v1` tag into `target/v1`. Those tests are `#[ignore]`d
//!   (a shallow clone or a source archive has no such build); `scripts/test`
//!   runs them with `--run-ignored all` when it built them.
//!
//! In each pairing, and with windows of 64 KiB against 1 MiB, a stalled
//! connection sits beside a 10 MiB transfer, each way: every byte arrives,
//! what the stalled one buffers stays within the window its receiver
//! announced, and nothing overflows (a sender that ignored the receiver's
//! window would get the stalled connection closed with an overflow).

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use integration_tests::{
    AgentOpts, AgentProcess, DEADLINE, Pki, ServerOpts, TestAgent, TestServer, agent_config,
    binary,
    destination::{self, Fnv, pattern},
    http_get,
    process::{ServerProcess, metric_value},
    v1_binary,
};
use proto::{Packet, agent_service_client::AgentServiceClient, packet::PacketKind};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    sync::mpsc,
};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, metadata::MetadataValue, transport::Channel};
use tunnel::flow::{self, Version, Window};

const LEN: usize = 10 << 20;

/// 64 KiB windows of 16 KiB chunks.
fn small() -> Window {
    Window::new(64 * 1024, 16 * 1024).unwrap()
}

/// What stands in for flow control v1.
#[derive(Debug, Clone, Copy)]
enum V1 {
    /// This build's binary with `--flow-control-version=v1`.
    Pinned,
    /// The last build before v2 (`target/v1`).
    Real,
}

impl V1 {
    /// The binary `name` (`proxy-server` or `proxy-agent`) of this v1.
    fn binary(self, name: &str) -> std::path::PathBuf {
        match self {
            Self::Pinned => binary(name),
            Self::Real => v1_binary(name),
        }
    }

    /// The flags that make it v1.
    fn args(self) -> &'static [&'static str] {
        match self {
            Self::Pinned => &["--flow-control-version=v1"],
            Self::Real => &[],
        }
    }
}

/// The server of a pairing.
enum Server {
    /// This build, in process.
    V2(Box<TestServer>),
    /// A v1 binary.
    V1(ServerProcess),
}

impl Server {
    async fn v2(window: Window) -> Self {
        Self::V2(Box::new(
            TestServer::start_with(ServerOpts {
                flow_window: window,
                ..Default::default()
            })
            .await,
        ))
    }

    async fn v1(v1: V1) -> Self {
        let args: Vec<String> = v1.args().iter().map(|a| (*a).to_owned()).collect();
        Self::V1(
            ServerProcess::start_binary(
                &v1.binary("proxy-server"),
                Pki::get().dir.path(),
                "grpc",
                &args,
            )
            .await,
        )
    }

    fn agent_port(&self) -> u16 {
        match self {
            Self::V2(server) => server.agent_addr.port(),
            Self::V1(server) => server.agent_addr.port(),
        }
    }

    async fn channel(&self) -> Channel {
        match self {
            Self::V2(server) => server.channel().await,
            Self::V1(server) => client::dial::uds_channel(&server.uds).await.unwrap(),
        }
    }

    /// What the fullest connection has queued towards its frontend.
    async fn max_buffered(&self) -> usize {
        match self {
            Self::V2(server) => server.handle.max_buffered(),
            Self::V1(server) => {
                server
                    .metric("konnectivity_rs_server_max_buffered_bytes")
                    .await as usize
            }
        }
    }

    async fn agents(&self) -> usize {
        match self {
            Self::V2(server) => server.handle.backend_count(),
            Self::V1(server) => server
                .metric("konnectivity_network_proxy_server_grpc_connections{service_method=\"Connect\"}")
                .await
                as usize,
        }
    }

    /// Connections the server closed for overflowing a window.
    async fn overflows(&self) -> f64 {
        let addr = match self {
            Self::V2(server) => server.health_addr,
            Self::V1(server) => server.health_addr,
        };
        overflows(addr, "konnectivity_rs_server_connections_closed_total").await
    }
}

/// The agent of a pairing, held for the test's length.
enum Agent {
    /// This build, in process.
    V2(TestAgent),
    /// A v1 binary, kept running.
    V1 {
        /// The process.
        _process: AgentProcess,
    },
}

impl Agent {
    async fn v2(server: &Server, window: Window) -> Self {
        let agent = TestAgent::start_with(
            std::net::SocketAddr::from(([127, 0, 0, 1], server.agent_port())),
            AgentOpts {
                flow_window: window,
                ..Default::default()
            },
        )
        .await;
        Self::V2(agent)
    }

    fn v1(server: &Server, v1: V1) -> Self {
        Self::V1 {
            _process: AgentProcess::spawn_binary(
                &v1.binary("proxy-agent"),
                server.agent_port(),
                v1.args(),
            ),
        }
    }

    /// Connections the agent closed for overflowing its window.
    async fn overflows(&self) -> f64 {
        match self {
            Self::V2(agent) => {
                overflows(
                    agent.health_addr,
                    "konnectivity_rs_agent_connections_closed_total",
                )
                .await
            }
            // Its metrics port is not known here; an overflow would have
            // failed the stalled connection.
            Self::V1 { .. } => 0.0,
        }
    }
}

/// The `overflow` series of `family` on `addr`'s `/metrics`.
async fn overflows(addr: std::net::SocketAddr, family: &str) -> f64 {
    let (status, text) = http_get(addr, "/metrics").await;
    assert_eq!(status, 200, "{text}");
    metric_value(&text, &format!("{family}{{reason=\"overflow\"}}"))
}

/// Waits until the server has an agent stream.
async fn connected(server: &Server) {
    let start = Instant::now();
    while server.agents().await < 1 {
        assert!(start.elapsed() < DEADLINE, "the agent did not connect");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A frontend that stops reading beside a 10 MiB download: the download
/// is byte-exact and the stalled connection's bytes on the server stay
/// within `bound` (the server's receive window).
async fn stalled_frontend_beside_a_download(server: &Server, bound: usize) {
    let endless = destination::source().await;
    let download = destination::download(LEN).await;
    let _stalled = client::dial::dial(server.channel().await, &endless.address())
        .await
        .unwrap();
    let start = Instant::now();
    while server.max_buffered().await < bound / 2 {
        assert!(
            start.elapsed() < DEADLINE,
            "the stalled connection did not fill its window: {} of {bound} bytes buffered",
            server.max_buffered().await
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut conn = client::dial::dial(server.channel().await, &download.address())
        .await
        .unwrap();
    let mut got = Vec::with_capacity(LEN);
    conn.read_to_end(&mut got).await.unwrap();
    assert!(got == pattern(LEN, 7), "downloaded bytes differ");
    conn.finish().await.unwrap();
    let buffered = server.max_buffered().await;
    assert!(
        buffered <= bound,
        "{buffered} bytes buffered, the window is {bound}"
    );
}

/// A destination that stops reading beside a 10 MiB upload: the upload is
/// byte-exact, and the stalled connection is still open (its writer
/// blocked, not failed: nothing overflowed the agent's window).
async fn stalled_destination_beside_an_upload(server: &Server) {
    let silent = destination::silent().await;
    let sink = destination::upload_hash().await;
    let stalled = client::dial::dial(server.channel().await, &silent.address())
        .await
        .unwrap();
    let written = Arc::new(AtomicUsize::new(0));
    let writer = tokio::spawn({
        let written = written.clone();
        async move {
            let mut stalled = stalled;
            let chunk = pattern(64 * 1024, 2);
            while stalled.write_all(&chunk).await.is_ok() {
                written.fetch_add(chunk.len(), Ordering::Relaxed);
            }
        }
    });
    let data = pattern(LEN, 4);
    let mut expected = Fnv::new();
    expected.update(&data);
    let mut conn = client::dial::dial(server.channel().await, &sink.address())
        .await
        .unwrap();
    conn.write_u64(LEN as u64).await.unwrap();
    conn.write_all(&data).await.unwrap();
    assert_eq!(conn.read_u64().await.unwrap(), expected.finish());
    conn.finish().await.unwrap();
    assert!(
        written.load(Ordering::Relaxed) >= 1 << 20,
        "the stalled connection took only {} bytes",
        written.load(Ordering::Relaxed)
    );
    assert!(!writer.is_finished(), "the stalled connection failed");
    writer.abort();
}

/// Both directions, then no overflow on either side.
async fn exercise(server: &Server, agent: &Agent, server_window: usize) {
    connected(server).await;
    stalled_frontend_beside_a_download(server, server_window).await;
    stalled_destination_beside_an_upload(server).await;
    assert_eq!(
        server.overflows().await,
        0.0,
        "the server saw its window exceeded"
    );
    assert_eq!(
        agent.overflows().await,
        0.0,
        "the agent saw its window exceeded"
    );
}

async fn v2_server_serves_v1_agent(v1: V1) {
    let server = Server::v2(Window::V1).await;
    let agent = Agent::v1(&server, v1);
    exercise(&server, &agent, Window::V1.bytes).await;
}

async fn v1_server_serves_v2_agent(v1: V1) {
    let server = Server::v1(v1).await;
    let agent = Agent::v2(&server, Window::V1).await;
    exercise(&server, &agent, Window::V1.bytes).await;
}

/// A v1 server never saw the agent's 64 KiB window and sends within
/// v1's 1 MiB: the agent takes what v1 assumes.
async fn v2_agent_with_a_small_window_takes_what_v1_server_sends(v1: V1) {
    let server = Server::v1(v1).await;
    let agent = Agent::v2(&server, small()).await;
    exercise(&server, &agent, Window::V1.bytes).await;
}

/// And the reverse: a v1 agent sends within 1 MiB to a server configured
/// with 64 KiB, which then receives within 1 MiB. (An agent that kept to
/// the server's 64 KiB would never fill the stalled connection's 1 MiB.)
async fn v2_server_with_a_small_window_takes_what_v1_agent_sends(v1: V1) {
    let server = Server::v2(small()).await;
    let agent = Agent::v1(&server, v1);
    exercise(&server, &agent, Window::V1.bytes).await;
}

/// A v1 server never reads the agent's window: to an agent (scripted here)
/// that announces 64 KiB windows of 16 KiB chunks and returns no credit,
/// it sends past 64 KiB (within v1's 1 MiB, in chunks of at most v1's
/// 256 KiB); and its response announces credit without a window.
async fn v1_server_ignores_an_agents_window(v1: V1) {
    let Server::V1(server) = Server::v1(v1).await else {
        unreachable!("Server::v1 runs a process")
    };
    let config = agent_config(server.agent_addr, &Default::default());
    let channel =
        client::dial::tls_channel(server.agent_addr, "127.0.0.1", config.tls.load().unwrap())
            .await
            .unwrap();
    let (agent_tx, agent_rx) = mpsc::channel::<Packet>(4);
    let mut request = Request::new(ReceiverStream::new(agent_rx));
    let metadata = request.metadata_mut();
    metadata.insert("agentid", MetadataValue::from_static("scripted-agent"));
    for (key, value) in small().headers(Version::V2) {
        metadata.insert(key, MetadataValue::try_from(value).unwrap());
    }
    let response = AgentServiceClient::new(channel)
        .connect(request)
        .await
        .unwrap();
    let announced = response.metadata();
    let text = |key| announced.get(key).and_then(|v| v.to_str().ok());
    assert_eq!(text(flow::HEADER), Some(flow::VERSION), "no credit offered");
    assert_eq!(
        (text(flow::WINDOW_HEADER), text(flow::CHUNK_HEADER)),
        (None, None),
        "a v1 server announced a window"
    );
    let mut from_server = response.into_inner();
    server.wait_for_agents(1).await;

    // A frontend dials through the scripted agent and sends 2 MiB.
    let frontend = client::dial::uds_channel(&server.uds).await.unwrap();
    let writer = tokio::spawn(async move {
        let mut conn = client::dial::dial(frontend, "10.0.0.1:80").await.unwrap();
        conn.write_all(&pattern(2 << 20, 3)).await.unwrap();
    });
    tokio::time::timeout(DEADLINE, async {
        let mut received = 0;
        while received <= small().bytes {
            match from_server.message().await.unwrap().unwrap().into_kind() {
                PacketKind::DialReq(req) => agent_tx
                    .send(Packet::dial_response(req.random, 1, ""))
                    .await
                    .unwrap(),
                PacketKind::Data(data) => {
                    assert_eq!(data.connect_id, 1);
                    assert!(
                        data.data.len() <= Window::V1.max_chunk,
                        "a chunk of {} bytes, past v1's",
                        data.data.len()
                    );
                    received += flow::cost(data.data.len());
                }
                other => panic!("unexpected {other:?}"),
            }
        }
    })
    .await
    .expect("the server kept to the agent's 64 KiB window, which a v1 server never reads");
    writer.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_v2_server_serves_a_pinned_v1_agent() {
    v2_server_serves_v1_agent(V1::Pinned).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pinned_v1_server_serves_a_v2_agent() {
    v1_server_serves_v2_agent(V1::Pinned).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_v2_agent_with_a_small_window_takes_what_a_pinned_v1_server_sends() {
    v2_agent_with_a_small_window_takes_what_v1_server_sends(V1::Pinned).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_v2_server_with_a_small_window_takes_what_a_pinned_v1_agent_sends() {
    v2_server_with_a_small_window_takes_what_v1_agent_sends(V1::Pinned).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pinned_v1_server_ignores_an_agents_window() {
    v1_server_ignores_an_agents_window(V1::Pinned).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs target/v1: scripts/test builds it from the flow-control-v1 tag"]
async fn a_v2_server_serves_a_v1_agent() {
    v2_server_serves_v1_agent(V1::Real).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs target/v1: scripts/test builds it from the flow-control-v1 tag"]
async fn a_v1_server_serves_a_v2_agent() {
    v1_server_serves_v2_agent(V1::Real).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs target/v1: scripts/test builds it from the flow-control-v1 tag"]
async fn a_v2_agent_with_a_small_window_takes_what_a_v1_server_sends() {
    v2_agent_with_a_small_window_takes_what_v1_server_sends(V1::Real).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs target/v1: scripts/test builds it from the flow-control-v1 tag"]
async fn a_v2_server_with_a_small_window_takes_what_a_v1_agent_sends() {
    v2_server_with_a_small_window_takes_what_v1_agent_sends(V1::Real).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs target/v1: scripts/test builds it from the flow-control-v1 tag"]
async fn a_v1_server_ignores_an_agents_window() {
    v1_server_ignores_an_agents_window(V1::Real).await;
}

/// A 64 KiB server window against a 1 MiB agent window: the agent keeps to
/// the server's 64 KiB, the server to the agent's 1 MiB.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_server_window_against_a_large_agent_window() {
    let server = Server::v2(small()).await;
    let agent = Agent::v2(&server, Window::V1).await;
    exercise(&server, &agent, small().bytes).await;
}

/// And the reverse: the server keeps to the agent's 64 KiB in 16 KiB
/// chunks (the stalled destination's connection would overflow otherwise).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_server_window_against_a_small_agent_window() {
    let server = Server::v2(Window::V1).await;
    let agent = Agent::v2(&server, small()).await;
    exercise(&server, &agent, Window::V1.bytes).await;
}
