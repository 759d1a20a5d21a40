//! Service-account token authentication of agents against a local stand-in
//! of the kube API's TokenReview endpoint (with a real kubeconfig file).

#![allow(clippy::unwrap_used)] // tests: a panic is a failure report

use std::time::{Duration, Instant};

use integration_tests::{
    AgentOpts, DEADLINE, ServerOpts, TestAgent, TestServer, agent_config, destination,
    kube_stub::{Identity, TokenReviewStub},
    wait_for,
};
use proxy_agent::client::{Client, ConnectError};
use proxy_server::auth::TokenAuthConfig;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const AUDIENCE: &str = "system:konnectivity-server";
const AGENT_SA: &str = "system:serviceaccount:kube-system:konnectivity-agent";

async fn server(stub: &TokenReviewStub) -> TestServer {
    server_with(
        stub,
        proxy_server::auth::DEFAULT_CACHE_TTL,
        proxy_server::auth::DEFAULT_MAX_IN_FLIGHT,
    )
    .await
}

/// A server whose reviews are cached for `cache_ttl`, at most
/// `max_in_flight` at once.
async fn server_with(
    stub: &TokenReviewStub,
    cache_ttl: Duration,
    max_in_flight: usize,
) -> TestServer {
    server_bounded(
        stub,
        cache_ttl,
        max_in_flight,
        proxy_server::auth::DEFAULT_MAX_PENDING,
    )
    .await
}

/// [`server_with`], at most `max_pending` connects waiting for a review.
async fn server_bounded(
    stub: &TokenReviewStub,
    cache_ttl: Duration,
    max_in_flight: usize,
    max_pending: usize,
) -> TestServer {
    TestServer::start_with(ServerOpts {
        mtls: false,
        token_auth: Some(TokenAuthConfig {
            namespace: "kube-system".to_owned(),
            service_account: "konnectivity-agent".to_owned(),
            audience: AUDIENCE.to_owned(),
            kubeconfig: Some(stub.kubeconfig.clone()),
            cache_ttl,
            max_in_flight,
            max_pending,
        }),
        ..Default::default()
    })
    .await
}

/// `konnectivity_rs_server_token_reviews_total{source}` of `server`.
async fn reviews(server: &TestServer, source: &str) -> f64 {
    server
        .metric(&format!(
            "konnectivity_rs_server_token_reviews_total{{source=\"{source}\"}}"
        ))
        .await
}

/// Options of an agent presenting `token` (its file in `dir`).
fn with_token(dir: &tempfile::TempDir, token: &str) -> AgentOpts {
    AgentOpts {
        token_path: Some(token_file(dir, token)),
        no_client_cert: true,
        ..Default::default()
    }
}

/// One connect of an agent presenting `token`.
async fn connect_with(server: &TestServer, token: &str) -> Result<Client, ConnectError> {
    let dir = tempfile::tempdir().unwrap();
    let config = agent_config(server.agent_addr, &with_token(&dir, token));
    Client::connect(
        &config,
        config.tls.load().unwrap(),
        &config.servers[0],
        std::sync::Arc::new(proxy_agent::metrics::AgentMetrics::unattached()),
    )
    .await
}

/// Whether one connect with `token` is admitted.
async fn admitted(server: &TestServer, token: &str) -> bool {
    match connect_with(server, token).await {
        Ok(_) => true,
        Err(ConnectError::Refused { status, .. }) => {
            assert_eq!(status.code(), tonic::Code::Unauthenticated, "{status:?}");
            false
        }
        Err(other) => panic!("unexpected {other}"),
    }
}

fn token_file(dir: &tempfile::TempDir, token: &str) -> std::path::PathBuf {
    let path = dir.path().join("token");
    std::fs::write(&path, token).unwrap();
    path
}

/// The error a single connect with `token` gets.
async fn refusal(server: &TestServer, token: &str) -> String {
    match connect_with(server, token).await {
        Err(ConnectError::Refused { status, .. }) => {
            assert_eq!(status.code(), tonic::Code::Unauthenticated, "{status:?}");
            assert!(
                !status.message().contains(token),
                "the token leaked: {}",
                status.message()
            );
            status.message().to_owned()
        }
        Err(other) => panic!("unexpected {other}"),
        Ok(_) => panic!("token {token} was accepted"),
    }
}

/// Waits until `agent`, the only agent of `server`, has its stream
/// recorded on both sides.
async fn wait_connected(server: &TestServer, agent: &TestAgent) {
    server.wait_for_backends(1).await;
    // The server may see the stream before the agent has recorded it: wait
    // for both, or there is nothing yet to disconnect.
    let handle = agent.handle.clone();
    wait_for("the agent to record its stream", || {
        handle.server_connections() == 1
    })
    .await;
}

/// Cuts `agent`'s server connection and waits until it is back: one
/// stream from another peer port (the new stream may be accepted before
/// the old one is seen gone).
async fn reconnect(server: &TestServer, agent: &TestAgent) {
    let before = server.handle.agent_peers();
    agent.handle.disconnect_all();
    let handle = server.handle.clone();
    wait_for("the agent to come back", || {
        let peers = handle.agent_peers();
        peers.len() == 1 && peers != before
    })
    .await;
}

fn identity(username: &str, audience: &str) -> Identity {
    Identity {
        username: username.to_owned(),
        audiences: vec![audience.to_owned()],
    }
}

#[tokio::test]
async fn a_good_token_connects_and_tunnels() {
    let stub = TokenReviewStub::start().await;
    stub.allow("good-token", identity(AGENT_SA, AUDIENCE));
    let server = server(&stub).await;
    let dir = tempfile::tempdir().unwrap();
    let _agent = TestAgent::start_with(
        server.agent_addr,
        AgentOpts {
            token_path: Some(token_file(&dir, "good-token")),
            no_client_cert: true,
            ..Default::default()
        },
    )
    .await;
    server.wait_for_backends(1).await;
    let echo = destination::echo().await;
    let mut conn = server.dial(&echo.address()).await.unwrap();
    conn.write_all(b"authenticated").await.unwrap();
    let mut got = [0u8; 13];
    conn.read_exact(&mut got).await.unwrap();
    assert_eq!(&got, b"authenticated");
}

#[tokio::test]
async fn each_failed_check_is_refused_with_its_reason() {
    let stub = TokenReviewStub::start().await;
    stub.allow("other-audience", identity(AGENT_SA, "someone-else"));
    stub.allow(
        "other-namespace",
        identity("system:serviceaccount:default:konnectivity-agent", AUDIENCE),
    );
    stub.allow(
        "other-sa",
        identity("system:serviceaccount:kube-system:default", AUDIENCE),
    );
    stub.allow("a-user", identity("alice", AUDIENCE));
    let server = server(&stub).await;

    let text = refusal(&server, "other-audience").await;
    assert!(text.contains("audiences"), "{text}");
    let text = refusal(&server, "other-namespace").await;
    assert!(
        text.contains("namespace \"default\" is not \"kube-system\""),
        "{text}"
    );
    let text = refusal(&server, "other-sa").await;
    assert!(
        text.contains("service account \"default\" is not \"konnectivity-agent\""),
        "{text}"
    );
    let text = refusal(&server, "a-user").await;
    assert!(text.contains("not a service account"), "{text}");
    let text = refusal(&server, "unknown-token").await;
    assert!(text.contains("invalid bearer token"), "{text}");

    // No token at all.
    let config = agent_config(
        server.agent_addr,
        &AgentOpts {
            no_client_cert: true,
            ..Default::default()
        },
    );
    match Client::connect(
        &config,
        config.tls.load().unwrap(),
        &config.servers[0],
        std::sync::Arc::new(proxy_agent::metrics::AgentMetrics::unattached()),
    )
    .await
    {
        Err(ConnectError::Refused { status, .. }) => {
            assert_eq!(
                status.message(),
                "Authentication context was not found in metadata"
            );
        }
        other => panic!("unexpected {:?}", other.err()),
    }
    assert_eq!(server.handle.backend_count(), 0);
}

#[tokio::test]
async fn an_api_outage_refuses_new_agents_but_keeps_serving_and_recovers() {
    let stub = TokenReviewStub::start().await;
    stub.allow("good-token", identity(AGENT_SA, AUDIENCE));
    let server = server(&stub).await;
    let dir = tempfile::tempdir().unwrap();
    let opts = AgentOpts {
        token_path: Some(token_file(&dir, "good-token")),
        no_client_cert: true,
        ..Default::default()
    };
    let _first = TestAgent::start_with(server.agent_addr, opts.clone()).await;
    server.wait_for_backends(1).await;

    stub.set_down(true);
    // A token reviewed before the outage is still admitted from the cache;
    // one never reviewed is refused.
    assert!(admitted(&server, "good-token").await);
    stub.allow("new-token", identity(AGENT_SA, AUDIENCE));
    let text = refusal(&server, "new-token").await;
    assert!(text.contains("TokenReview failed"), "{text}");
    // A second agent keeps retrying; the first keeps serving.
    let second = TestAgent::start_with(server.agent_addr, with_token(&dir, "new-token")).await;
    let echo = destination::echo().await;
    let mut conn = server.dial(&echo.address()).await.unwrap();
    conn.write_all(b"x").await.unwrap();
    let mut b = [0u8; 1];
    conn.read_exact(&mut b).await.unwrap();
    assert_eq!(server.handle.backend_count(), 1);

    stub.set_down(false);
    server.wait_for_backends(2).await;
    wait_for("the second agent to register", || {
        second.handle.server_connections() == 1
    })
    .await;
}

#[tokio::test]
async fn a_token_rotated_on_disk_is_used_on_the_next_connect() {
    let stub = TokenReviewStub::start().await;
    stub.allow("token-one", identity(AGENT_SA, AUDIENCE));
    let server = server(&stub).await;
    let dir = tempfile::tempdir().unwrap();
    let path = token_file(&dir, "token-one");
    let agent = TestAgent::start_with(
        server.agent_addr,
        AgentOpts {
            token_path: Some(path.clone()),
            no_client_cert: true,
            ..Default::default()
        },
    )
    .await;
    wait_connected(&server, &agent).await;

    // The kubelet rotates the token: the old one stops working, the file changes.
    stub.revoke("token-one");
    stub.allow("token-two", identity(AGENT_SA, AUDIENCE));
    std::fs::write(&path, "token-two").unwrap();
    let reviews = stub.review_count();
    // Only token-two can open the new stream.
    reconnect(&server, &agent).await;
    assert!(stub.review_count() > reviews);
}

/// An agent that reconnects with the token it was admitted with is
/// admitted from the cache: no second TokenReview.
#[tokio::test]
async fn a_reconnect_reuses_the_cached_review() {
    let stub = TokenReviewStub::start().await;
    stub.allow("good-token", identity(AGENT_SA, AUDIENCE));
    let server = server(&stub).await;
    let dir = tempfile::tempdir().unwrap();
    let agent = TestAgent::start_with(server.agent_addr, with_token(&dir, "good-token")).await;
    wait_connected(&server, &agent).await;
    assert_eq!(stub.review_count(), 1);
    reconnect(&server, &agent).await;
    assert_eq!(stub.review_count(), 1, "the reconnect was reviewed again");
    assert_eq!(reviews(&server, "cache").await, 1.0);
    assert_eq!(reviews(&server, "api").await, 1.0);
}

/// Agents that present one token at once wait for one review.
#[tokio::test]
async fn concurrent_connects_with_one_token_make_one_review() {
    let stub = TokenReviewStub::start().await;
    stub.allow("shared-token", identity(AGENT_SA, AUDIENCE));
    // The first review waits until all 8 agents are waiting for it.
    stub.hold();
    let server = server(&stub).await;
    let dir = tempfile::tempdir().unwrap();
    let agents = futures_util::future::join_all(
        (0..8).map(|_| TestAgent::start_with(server.agent_addr, with_token(&dir, "shared-token"))),
    )
    .await;
    wait_pending(&server, 8).await;
    wait_for("the first review at the stub", || stub.in_flight() >= 1).await;
    stub.release();
    server.wait_for_backends(8).await;
    assert_eq!(stub.review_count(), 1);
    assert_eq!(reviews(&server, "api").await, 1.0);
    assert_eq!(reviews(&server, "coalesced").await, 7.0);
    assert_eq!(reviews(&server, "cache").await, 0.0);
    drop(agents);
}

/// Many agents with tokens of their own: never more reviews in flight
/// than the bound, and every agent admitted.
#[tokio::test]
async fn reviews_in_flight_stay_within_the_bound() {
    let stub = TokenReviewStub::start().await;
    // Reviews wait until all 8 agents are waiting and the bound is reached.
    stub.hold();
    let server = server_with(&stub, Duration::from_secs(60), 2).await;
    let dir = tempfile::tempdir().unwrap();
    let mut agents = Vec::new();
    for n in 0..8 {
        let token = format!("token-{n}");
        stub.allow(&token, identity(AGENT_SA, AUDIENCE));
        let path = dir.path().join(&token);
        std::fs::write(&path, &token).unwrap();
        let opts = AgentOpts {
            token_path: Some(path),
            no_client_cert: true,
            ..Default::default()
        };
        agents.push(TestAgent::start_with(server.agent_addr, opts));
    }
    let agents = futures_util::future::join_all(agents).await;
    wait_pending(&server, 8).await;
    wait_for("2 reviews in flight", || stub.in_flight() == 2).await;
    stub.release();
    server.wait_for_backends(8).await;
    assert_eq!(stub.review_count(), 8);
    assert_eq!(stub.most_in_flight(), 2, "the bound was passed");
    drop(agents);
}

/// A revoked token is admitted from the cache for at most the cache's
/// time-to-live after its review, then refused.
#[tokio::test]
async fn a_revoked_token_is_refused_within_the_cache_ttl() {
    const TTL: Duration = Duration::from_secs(2);
    let stub = TokenReviewStub::start().await;
    stub.allow("good-token", identity(AGENT_SA, AUDIENCE));
    let server = server_with(&stub, TTL, 4).await;
    // The review is answered between these two instants, and its cache
    // entry lasts TTL from then.
    let reviewing = Instant::now();
    assert!(admitted(&server, "good-token").await);
    let reviewed = Instant::now();
    stub.revoke("good-token");
    assert!(admitted(&server, "good-token").await, "not cached");
    assert_eq!(stub.review_count(), 1);
    let refused = tokio::time::timeout(DEADLINE + TTL, async {
        loop {
            let started = Instant::now();
            if !admitted(&server, "good-token").await {
                break reviewing.elapsed();
            }
            // A connect that began after the entry's end was not cached.
            assert!(
                started < reviewed + TTL,
                "admitted by a connect begun {:?} after the review",
                started - reviewed
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await
    .expect("the revoked token was never refused");
    assert!(refused >= TTL, "refused after {refused:?}, before the ttl");
    assert_eq!(stub.review_count(), 2);
}

/// A connect that is waiting for its review, in a task the test can end.
fn connect_in_background(server: &TestServer, token: &str) -> tokio::task::JoinHandle<()> {
    let (addr, token) = (server.agent_addr, token.to_owned());
    tokio::spawn(async move {
        let dir = tempfile::tempdir().unwrap();
        let config = agent_config(addr, &with_token(&dir, &token));
        let _ = Client::connect(
            &config,
            config.tls.load().unwrap(),
            &config.servers[0],
            std::sync::Arc::new(proxy_agent::metrics::AgentMetrics::unattached()),
        )
        .await;
    })
}

/// Waits until `server` has `n` connects waiting for a review.
async fn wait_pending(server: &TestServer, n: usize) {
    let handle = server.handle.clone();
    wait_for(&format!("{n} pending reviews"), || {
        handle.pending_reviews() == n
    })
    .await;
}

/// During a TokenReview outage that hangs, connects with tokens never seen
/// (anyone who can reach the agent port) wait up to
/// `--token-review-max-pending`; past it they are refused at once with
/// `Unavailable`, which agents retry. A connect that ends gives its place
/// back, and the API's return admits agents again.
#[tokio::test]
async fn connects_past_the_pending_bound_are_refused_unavailable() {
    let stub = TokenReviewStub::start().await;
    stub.allow("good-token", identity(AGENT_SA, AUDIENCE));
    stub.set_delay(Duration::from_secs(3600));
    let server = server_bounded(&stub, Duration::from_secs(60), 1, 3).await;
    let waiting: Vec<_> = (0..3)
        .map(|n| connect_in_background(&server, &format!("bogus-{n}")))
        .collect();
    wait_pending(&server, 3).await;
    let refused = tokio::time::timeout(Duration::from_secs(20), connect_with(&server, "bogus-x"))
        .await
        .expect("the connect past the bound waited");
    match refused {
        Err(ConnectError::Refused { status, .. }) => {
            assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
            assert!(
                status.message().contains("--token-review-max-pending"),
                "{status:?}"
            );
        }
        Err(other) => panic!("unexpected {other}"),
        Ok(_) => panic!("admitted"),
    }
    assert_eq!(
        server
            .metric("konnectivity_rs_server_limit_reached_total{limit=\"token_reviews\"}")
            .await,
        1.0
    );
    // The waiting connects hang up: their places come back.
    for task in waiting {
        task.abort();
    }
    wait_pending(&server, 0).await;
    stub.set_delay(Duration::ZERO);
    assert!(admitted(&server, "good-token").await);
}

/// A TLS connection to the agent port that the test can cut under its
/// streams, with a gRPC channel over it.
struct AgentConnection {
    /// The channel (one HTTP/2 connection).
    channel: tonic::transport::Channel,
    /// A second handle on the socket, to cut it.
    socket: std::net::TcpStream,
}

impl AgentConnection {
    /// Connects without a client certificate (token mode).
    async fn open(server: &TestServer) -> Self {
        let config = agent_config(
            server.agent_addr,
            &AgentOpts {
                no_client_cert: true,
                ..Default::default()
            },
        );
        let std = std::net::TcpStream::connect(server.agent_addr).unwrap();
        let socket = std.try_clone().unwrap();
        std.set_nonblocking(true).unwrap();
        let tcp = tokio::net::TcpStream::from_std(std).unwrap();
        let tls = tokio_rustls::TlsConnector::from(config.tls.load().unwrap())
            .connect(
                rustls_pki_types::ServerName::try_from("127.0.0.1").unwrap(),
                tcp,
            )
            .await
            .unwrap();
        let endpoint = tonic::transport::Endpoint::from_static("http://agent-port.invalid");
        let channel = edge::h2::channel_over(endpoint, tls).await.unwrap();
        Self { channel, socket }
    }

    /// A `Connect` stream with `token`, waiting for the server's answer.
    fn connect(&self, token: &str) -> tokio::task::JoinHandle<Result<(), tonic::Status>> {
        use proto::agent_service_client::AgentServiceClient;
        let channel = self.channel.clone();
        let token = format!("Bearer {token}");
        tokio::spawn(async move {
            let (_tx, rx) = tokio::sync::mpsc::channel::<proto::Packet>(1);
            let mut request = tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(rx));
            let metadata = request.metadata_mut();
            metadata.insert("agentid", "flooding-agent".parse().unwrap());
            metadata.insert("authorization", token.parse().unwrap());
            AgentServiceClient::new(channel)
                .connect(request)
                .await
                .map(|_| ())
        })
    }

    /// Cuts the connection under every stream on it.
    fn cut(&self) {
        let _ = self.socket.shutdown(std::net::Shutdown::Both);
    }
}

/// A review's wait ends with what it serves: a stream reset by its client,
/// a connection cut under its streams, a server shutting down.
#[tokio::test]
async fn a_review_wait_ends_with_its_stream_its_connection_and_shutdown() {
    let stub = TokenReviewStub::start().await;
    stub.set_delay(Duration::from_secs(3600));
    let server = server_bounded(&stub, Duration::from_secs(60), 1, 100).await;
    let conn = AgentConnection::open(&server).await;
    let streams: Vec<_> = (0..4)
        .map(|n| conn.connect(&format!("bogus-{n}")))
        .collect();
    wait_pending(&server, 4).await;
    // Two streams are cancelled (RST_STREAM); the connection stays.
    for stream in &streams[..2] {
        stream.abort();
    }
    wait_pending(&server, 2).await;
    conn.cut();
    wait_pending(&server, 0).await;

    let conn = AgentConnection::open(&server).await;
    let stream = conn.connect("bogus-late");
    wait_pending(&server, 1).await;
    server.begin_shutdown();
    let status = tokio::time::timeout(Duration::from_secs(20), stream)
        .await
        .expect("the review outlived the server's shutdown")
        .unwrap()
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    assert!(status.message().contains("shutting down"), "{status:?}");
}

/// One agent connection carries at most `--agent-max-concurrent-streams`
/// streams (an agent needs one): the server's first SETTINGS say so, and a
/// client may not open more, each waiting for a review.
#[tokio::test]
async fn the_agent_port_bounds_streams_per_connection() {
    use tokio::io::AsyncReadExt;
    let stub = TokenReviewStub::start().await;
    let server = server(&stub).await;
    let config = agent_config(
        server.agent_addr,
        &AgentOpts {
            no_client_cert: true,
            ..Default::default()
        },
    );
    let tcp = tokio::net::TcpStream::connect(server.agent_addr)
        .await
        .unwrap();
    let mut tls = tokio_rustls::TlsConnector::from(config.tls.load().unwrap())
        .connect(
            rustls_pki_types::ServerName::try_from("127.0.0.1").unwrap(),
            tcp,
        )
        .await
        .unwrap();
    // The server's preface: a SETTINGS frame (type 4) on stream 0, sent
    // before it reads anything.
    let mut head = [0u8; 9];
    tokio::time::timeout(Duration::from_secs(20), tls.read_exact(&mut head))
        .await
        .expect("no SETTINGS from the server")
        .unwrap();
    assert_eq!(head[3], 4, "not a SETTINGS frame: {head:?}");
    let len = usize::from(head[0]) << 16 | usize::from(head[1]) << 8 | usize::from(head[2]);
    let mut payload = vec![0u8; len];
    tls.read_exact(&mut payload).await.unwrap();
    let max_streams = payload.chunks_exact(6).find_map(|setting| {
        (u16::from_be_bytes([setting[0], setting[1]]) == 3)
            .then(|| u32::from_be_bytes([setting[2], setting[3], setting[4], setting[5]]))
    });
    assert_eq!(
        max_streams,
        Some(proxy_server::config::DEFAULT_AGENT_MAX_CONCURRENT_STREAMS)
    );
}
