//! Service-account token authentication of agents against a local stand-in
//! of the kube API's TokenReview endpoint (with a real kubeconfig file).

#![allow(clippy::unwrap_used)] // tests: a panic is a failure report

use std::time::{Duration, Instant};

use integration_tests::{
    AgentOpts, DEADLINE, ServerOpts, TestAgent, TestServer, agent_config, destination,
    kube_stub::{ClusterKey, Identity, TokenReviewStub, jwt, service_account_token},
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
    server_checking(stub, cache_ttl, max_in_flight, max_pending, true).await
}

/// [`server_bounded`], with `--token-review-local-checks` as given.
async fn server_checking(
    stub: &TokenReviewStub,
    cache_ttl: Duration,
    max_in_flight: usize,
    max_pending: usize,
    local_checks: bool,
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
            local_checks,
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
    connect_as(server, token, "").await
}

/// One connect of an agent presenting `token` and claiming `identifiers`.
async fn connect_as(
    server: &TestServer,
    token: &str,
    identifiers: &str,
) -> Result<Client, ConnectError> {
    let dir = tempfile::tempdir().unwrap();
    let opts = AgentOpts {
        identifiers: identifiers.to_owned(),
        ..with_token(&dir, token)
    };
    let config = agent_config(server.agent_addr, &opts);
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

/// The token named `id`: a JWT for our audience, as the kubelet makes
/// them (the local checks pass it; the review decides).
fn sa(id: &str) -> String {
    service_account_token(AUDIENCE, id)
}

fn identity(username: &str, audience: &str) -> Identity {
    Identity {
        username: username.to_owned(),
        audiences: vec![audience.to_owned()],
        node: None,
    }
}

#[tokio::test]
async fn a_good_token_connects_and_tunnels() {
    let stub = TokenReviewStub::start().await;
    stub.allow(&sa("good-token"), identity(AGENT_SA, AUDIENCE));
    let server = server(&stub).await;
    let dir = tempfile::tempdir().unwrap();
    let _agent = TestAgent::start_with(
        server.agent_addr,
        AgentOpts {
            token_path: Some(token_file(&dir, &sa("good-token"))),
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
    stub.allow(&sa("other-audience"), identity(AGENT_SA, "someone-else"));
    stub.allow(
        &sa("other-namespace"),
        identity("system:serviceaccount:default:konnectivity-agent", AUDIENCE),
    );
    stub.allow(
        &sa("other-sa"),
        identity("system:serviceaccount:kube-system:default", AUDIENCE),
    );
    stub.allow(&sa("a-user"), identity("alice", AUDIENCE));
    let server = server(&stub).await;

    let text = refusal(&server, &sa("other-audience")).await;
    assert!(text.contains("audiences"), "{text}");
    let text = refusal(&server, &sa("other-namespace")).await;
    assert!(
        text.contains("namespace \"default\" is not \"kube-system\""),
        "{text}"
    );
    let text = refusal(&server, &sa("other-sa")).await;
    assert!(
        text.contains("service account \"default\" is not \"konnectivity-agent\""),
        "{text}"
    );
    let text = refusal(&server, &sa("a-user")).await;
    assert!(text.contains("not a service account"), "{text}");
    let text = refusal(&server, &sa("unknown-token")).await;
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

/// Tokens no review could pass are refused at once, each with its reason,
/// and the API never sees them; with `--token-review-local-checks=false`,
/// the API decides (a cluster whose authenticators take other tokens).
#[tokio::test]
async fn tokens_that_cannot_be_valid_are_refused_without_a_review() {
    let stub = TokenReviewStub::start().await;
    let server = server(&stub).await;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let cases = [
        ("random-bearer-text", "not a JWT", "malformed"),
        (
            &jwt(&serde_json::json!({"aud": "api", "exp": now + 600})),
            "aud claim does not name \"system:konnectivity-server\"",
            "audience",
        ),
        (
            &jwt(&serde_json::json!({"aud": [AUDIENCE], "exp": now - 3600})),
            "the token expired",
            "expired",
        ),
        (
            &jwt(&serde_json::json!({"aud": [AUDIENCE], "nbf": now + 3600})),
            "is not valid for another",
            "not_yet_valid",
        ),
        (
            &jwt(&serde_json::json!({"aud": [AUDIENCE], "exp": "soon"})),
            "its exp claim is not a number",
            "malformed",
        ),
    ];
    for (token, reason, _) in &cases {
        let text = refusal(&server, token).await;
        assert!(text.contains(reason), "{text}");
        assert!(text.contains("--token-review-local-checks"), "{text}");
    }
    assert_eq!(stub.review_count(), 0, "a review was made");
    for (reason, count) in [
        ("malformed", 2.0),
        ("audience", 1.0),
        ("expired", 1.0),
        ("not_yet_valid", 1.0),
    ] {
        let series =
            format!("konnectivity_rs_server_token_reviews_skipped_total{{reason=\"{reason}\"}}");
        assert_eq!(server.metric(&series).await, count, "{series}");
    }
    // With the checks off, the API reviews them all.
    let server = server_checking(
        &stub,
        proxy_server::auth::DEFAULT_CACHE_TTL,
        proxy_server::auth::DEFAULT_MAX_IN_FLIGHT,
        proxy_server::auth::DEFAULT_MAX_PENDING,
        false,
    )
    .await;
    for (token, _, _) in &cases {
        let text = refusal(&server, token).await;
        assert!(text.contains("invalid bearer token"), "{text}");
        assert!(stub.reviewed(token));
    }
    assert_eq!(stub.review_count(), cases.len());
}

#[tokio::test]
async fn an_api_outage_refuses_new_agents_but_keeps_serving_and_recovers() {
    let stub = TokenReviewStub::start().await;
    stub.allow(&sa("good-token"), identity(AGENT_SA, AUDIENCE));
    let server = server(&stub).await;
    let dir = tempfile::tempdir().unwrap();
    let opts = AgentOpts {
        token_path: Some(token_file(&dir, &sa("good-token"))),
        no_client_cert: true,
        ..Default::default()
    };
    let _first = TestAgent::start_with(server.agent_addr, opts.clone()).await;
    server.wait_for_backends(1).await;

    stub.set_down(true);
    // A token reviewed before the outage is still admitted from the cache;
    // one never reviewed is refused.
    assert!(admitted(&server, &sa("good-token")).await);
    stub.allow(&sa("new-token"), identity(AGENT_SA, AUDIENCE));
    let text = refusal(&server, &sa("new-token")).await;
    assert!(text.contains("TokenReview failed"), "{text}");
    // A second agent keeps retrying; the first keeps serving.
    let second = TestAgent::start_with(server.agent_addr, with_token(&dir, &sa("new-token"))).await;
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
    stub.allow(&sa("token-one"), identity(AGENT_SA, AUDIENCE));
    let server = server(&stub).await;
    let dir = tempfile::tempdir().unwrap();
    let path = token_file(&dir, &sa("token-one"));
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
    stub.revoke(&sa("token-one"));
    stub.allow(&sa("token-two"), identity(AGENT_SA, AUDIENCE));
    std::fs::write(&path, sa("token-two")).unwrap();
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
    stub.allow(&sa("good-token"), identity(AGENT_SA, AUDIENCE));
    let server = server(&stub).await;
    let dir = tempfile::tempdir().unwrap();
    let agent = TestAgent::start_with(server.agent_addr, with_token(&dir, &sa("good-token"))).await;
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
    stub.allow(&sa("shared-token"), identity(AGENT_SA, AUDIENCE));
    // The first review waits until all 8 agents are waiting for it.
    stub.hold();
    let server = server(&stub).await;
    let dir = tempfile::tempdir().unwrap();
    let agents =
        futures_util::future::join_all((0..8).map(|_| {
            TestAgent::start_with(server.agent_addr, with_token(&dir, &sa("shared-token")))
        }))
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
        let name = format!("token-{n}");
        let token = sa(&name);
        stub.allow(&token, identity(AGENT_SA, AUDIENCE));
        let path = dir.path().join(&name);
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
    stub.allow(&sa("good-token"), identity(AGENT_SA, AUDIENCE));
    let server = server_with(&stub, TTL, 4).await;
    // The review is answered between these two instants, and its cache
    // entry lasts TTL from then.
    let reviewing = Instant::now();
    assert!(admitted(&server, &sa("good-token")).await);
    let reviewed = Instant::now();
    stub.revoke(&sa("good-token"));
    assert!(admitted(&server, &sa("good-token")).await, "not cached");
    assert_eq!(stub.review_count(), 1);
    let refused = tokio::time::timeout(DEADLINE + TTL, async {
        loop {
            let started = Instant::now();
            if !admitted(&server, &sa("good-token")).await {
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
    stub.allow(&sa("good-token"), identity(AGENT_SA, AUDIENCE));
    stub.set_delay(Duration::from_secs(3600));
    let server = server_bounded(&stub, Duration::from_secs(60), 1, 3).await;
    let waiting: Vec<_> = (0..3)
        .map(|n| connect_in_background(&server, &sa(&format!("bogus-{n}"))))
        .collect();
    wait_pending(&server, 3).await;
    let refused = tokio::time::timeout(
        Duration::from_secs(20),
        connect_with(&server, &sa("bogus-x")),
    )
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
    assert!(admitted(&server, &sa("good-token")).await);
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
        .map(|n| conn.connect(&sa(&format!("bogus-{n}"))))
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
    let stream = conn.connect(&sa("bogus-late"));
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

/// A stream waiting for its token review holds none of its peer's data:
/// an agent sends nothing before the server's headers (ours, ANP's), so
/// data before admission ends the stream at once, and its review wait with
/// it, instead of sitting in the connection's HTTP/2 windows (4 MiB a
/// stream, 8 MiB a connection) for as long as the review takes.
#[tokio::test]
async fn data_sent_before_admission_ends_the_stream_at_once() {
    use proto::agent_service_client::AgentServiceClient;
    let stub = TokenReviewStub::start().await;
    stub.hold();
    let server = server(&stub).await;
    let conn = AgentConnection::open(&server).await;
    let (tx, rx) = tokio::sync::mpsc::channel::<proto::Packet>(64);
    // 4 MiB of DATA, queued before the call: all of it may go out at once.
    for n in 0..16 {
        let chunk = proto::Packet {
            r#type: proto::PacketType::Data as i32,
            payload: Some(proto::Payload::Data(proto::Data {
                connect_id: n,
                data: vec![7u8; 256 * 1024].into(),
                ..Default::default()
            })),
        };
        tx.send(chunk).await.unwrap();
    }
    let mut request = tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(rx));
    request
        .metadata_mut()
        .insert("agentid", "eager-agent".parse().unwrap());
    request.metadata_mut().insert(
        "authorization",
        format!("Bearer {}", sa("eager")).parse().unwrap(),
    );
    let answer = tokio::time::timeout(
        DEADLINE,
        AgentServiceClient::new(conn.channel.clone()).connect(request),
    )
    .await
    .expect("the stream waited for its review with its data unread");
    let Err(status) = answer else {
        panic!("admitted")
    };
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
    assert!(
        status.message().contains("before it was admitted"),
        "{status:?}"
    );
    wait_pending(&server, 0).await;
    drop(tx);
    // A stream that sends nothing first still waits for its review.
    let waiting = conn.connect(&sa("patient"));
    wait_pending(&server, 1).await;
    stub.release();
    let status = waiting.await.unwrap().unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unauthenticated, "{status:?}");
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

/// Where the flood of [`flood`] comes from: another loopback address than
/// the agents', so that the server sees another peer.
const FLOOD_PEER: std::net::IpAddr = std::net::IpAddr::V4(std::net::Ipv4Addr::new(127, 0, 0, 2));

/// What the `Connect`s of a flood were answered.
#[derive(Debug, Default)]
struct FloodOutcome {
    /// Refused `Unauthenticated`.
    unauthenticated: usize,
    /// Refused `Unavailable` (retry later).
    unavailable: usize,
    /// Anything else (admitted, a transport error).
    other: usize,
    /// How long the whole flood took.
    took: Duration,
}

/// Opens `connections` TLS connections to the agent port from `source`,
/// then sends one `Connect` per token, as many at once as the
/// connections carry (16 streams each, the server's bound), each waiting
/// for its answer, until the tokens run out or `stop`; counts the answers
/// in `answered` as they come.
async fn flood(
    agent_addr: std::net::SocketAddr,
    source: std::net::IpAddr,
    tokens: impl Iterator<Item = String> + Send,
    connections: usize,
    answered: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    stop: tokio_util::sync::CancellationToken,
) -> FloodOutcome {
    use futures_util::StreamExt;
    use proto::agent_service_client::AgentServiceClient;
    let started = Instant::now();
    let tls = agent_config(
        agent_addr,
        &AgentOpts {
            no_client_cert: true,
            ..Default::default()
        },
    )
    .tls
    .load()
    .unwrap();
    let channels: Vec<tonic::transport::Channel> = futures_util::stream::iter(0..connections)
        .map(|_| {
            let tls = tls.clone();
            async move {
                let socket = tokio::net::TcpSocket::new_v4().unwrap();
                socket.bind(std::net::SocketAddr::new(source, 0)).unwrap();
                let tcp = socket.connect(agent_addr).await.unwrap();
                let tls = tokio_rustls::TlsConnector::from(tls)
                    .connect(
                        rustls_pki_types::ServerName::try_from("127.0.0.1").unwrap(),
                        tcp,
                    )
                    .await
                    .unwrap();
                let endpoint = tonic::transport::Endpoint::from_static("http://agent-port.invalid");
                edge::h2::channel_over(endpoint, tls).await.unwrap()
            }
        })
        .buffer_unordered(64)
        .collect()
        .await;
    let outcome = std::sync::Mutex::new(FloodOutcome::default());
    futures_util::stream::iter(tokens.enumerate())
        .take_until(stop.cancelled())
        .for_each_concurrent(connections * 16, |(n, token)| {
            let channel = channels[n % connections].clone();
            let (outcome, answered) = (&outcome, &answered);
            async move {
                let (_tx, rx) = tokio::sync::mpsc::channel::<proto::Packet>(1);
                let mut request =
                    tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(rx));
                let metadata = request.metadata_mut();
                metadata.insert("agentid", "flooding-agent".parse().unwrap());
                metadata.insert("authorization", format!("Bearer {token}").parse().unwrap());
                let answer = AgentServiceClient::new(channel).connect(request).await;
                answered.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let mut outcome = outcome.lock().unwrap();
                match answer.map_err(|status| status.code()) {
                    Err(tonic::Code::Unauthenticated) => outcome.unauthenticated += 1,
                    Err(tonic::Code::Unavailable) => outcome.unavailable += 1,
                    _ => outcome.other += 1,
                }
            }
        })
        .await;
    let mut outcome = outcome.into_inner().unwrap();
    outcome.took = started.elapsed();
    outcome
}

/// A random string of `len` base64url characters.
fn random_text(len: usize) -> String {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    (0..len)
        .map(|_| char::from(ALPHABET[fastrand_index(ALPHABET.len())]))
        .collect()
}

fn fastrand_index(n: usize) -> usize {
    use std::sync::atomic::{AtomicU64, Ordering};
    // A xorshift seeded from the clock: random enough for distinct tokens.
    static STATE: AtomicU64 = AtomicU64::new(0);
    let mut x = STATE.load(Ordering::Relaxed);
    if x == 0 {
        x = u64::from(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .subsec_nanos(),
        ) | 1;
    }
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    STATE.store(x, Ordering::Relaxed);
    usize::try_from(x % n as u64).unwrap()
}

/// 20,000 `Connect`s from one peer, each with a token of its own that no
/// review passes: an eighth not JWTs at all, an eighth for another
/// audience, the rest shaped as our service-account tokens, as an attacker
/// would make them. They come 16,384 at a time (1,024 connections of 16
/// streams: `--token-review-max-pending`'s worth), against a TokenReview
/// API that takes 50 ms a review. An agent with a good token, connecting
/// from another address once 2,000 of them were answered, is admitted
/// within 5 s; the API never sees a token that could not be valid.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_flood_from_one_peer_does_not_keep_an_agent_out() {
    const FLOOD: usize = 20_000;
    const CONNECTIONS: usize = 1_024;
    const ADMITTED_WITHIN: Duration = Duration::from_secs(5);
    let stub = TokenReviewStub::start().await;
    stub.set_delay(Duration::from_millis(50));
    let good = service_account_token(AUDIENCE, "the-legitimate-agent");
    stub.allow(&good, identity(AGENT_SA, AUDIENCE));
    let server = server(&stub).await;

    let tokens: Vec<String> = (0..FLOOD)
        .map(|n| match n % 8 {
            0 => format!("flood-{n}-{}", random_text(40)),
            1 => service_account_token("another-audience", &random_text(24)),
            _ => service_account_token(AUDIENCE, &random_text(24)),
        })
        .collect();
    let impossible: Vec<String> = tokens
        .iter()
        .enumerate()
        .filter(|(n, _)| n % 8 < 2)
        .map(|(_, t)| t.clone())
        .collect();
    let answered = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let flooding = tokio::spawn(flood(
        server.agent_addr,
        FLOOD_PEER,
        tokens.into_iter(),
        CONNECTIONS,
        answered.clone(),
        tokio_util::sync::CancellationToken::new(),
    ));
    // Under way: its connections are open, its streams sent, the first
    // thousands answered.
    let progress = answered.clone();
    tokio::time::timeout(Duration::from_secs(60), async move {
        while progress.load(std::sync::atomic::Ordering::Relaxed) < 2_000 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the flood did not get under way");

    let started = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let _agent = TestAgent::start_with(server.agent_addr, with_token(&dir, &good)).await;
    // Measured up to a minute, so that a failure says how late it was.
    while server.handle.backend_count() == 0 && started.elapsed() < Duration::from_secs(60) {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let admitted = started.elapsed();
    let during_flood = !flooding.is_finished();
    let reviews_then = stub.review_count();
    assert!(
        admitted <= ADMITTED_WITHIN,
        "the agent was admitted after {admitted:?} (reviews by then: {reviews_then})"
    );
    let outcome = tokio::time::timeout(Duration::from_secs(120), flooding)
        .await
        .expect("the flood never ended")
        .unwrap();
    eprintln!(
        "agent admitted after {admitted:?} (flood still running: {during_flood}); \
         flood of {FLOOD}: {outcome:?}; reviews at the API: {}",
        stub.review_count()
    );
    assert_eq!(
        outcome.unauthenticated + outcome.unavailable,
        FLOOD,
        "{outcome:?}"
    );
    let reviewed: Vec<&String> = impossible.iter().filter(|t| stub.reviewed(t)).collect();
    assert!(
        reviewed.is_empty(),
        "{} malformed or wrong-audience tokens were reviewed",
        reviewed.len()
    );
}

/// An attacker sharing the agents' address (one peer to the server)
/// floods tokens shaped as ours that no review passes, against an API that
/// takes 50 ms a review, until its address is slowed (100 refusals). Then 8 agents behind
/// that address connect once each, with tokens the cluster signed: every
/// one is admitted on that one connect while the flood goes on. Before,
/// each was refused `Unavailable`: the flood held its address's few places
/// among the waiting. A quarter of the flood names the cluster's key with
/// a signature that is not one: refused without a review.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_behind_a_flooding_address_are_admitted_with_signed_tokens() {
    const CONNECTIONS: usize = 256;
    const AGENTS: usize = 8;
    let stub = TokenReviewStub::start().await;
    stub.set_delay(Duration::from_millis(50));
    let key = ClusterKey::default();
    stub.publish(&key);
    let signed = |n: usize| {
        let token = key.sign(AUDIENCE, &format!("agent-{n}"));
        stub.allow(&token, identity(AGENT_SA, AUDIENCE));
        token
    };
    let server = server(&stub).await;
    // The first agent reads the cluster's keys.
    assert!(connect_with(&server, &signed(0)).await.is_ok());
    assert_eq!(stub.key_reads(), 1);

    let stop = tokio_util::sync::CancellationToken::new();
    let forged: std::sync::Arc<std::sync::Mutex<Vec<String>>> = std::sync::Arc::default();
    let tokens = {
        let (key, forged) = (key.clone(), forged.clone());
        (0..).map(move |n: usize| {
            if n.is_multiple_of(4) {
                let token = key.forge(AUDIENCE, &format!("forged-{n}"));
                forged.lock().unwrap().push(token.clone());
                token
            } else {
                service_account_token(AUDIENCE, &format!("flood-{n}-{}", random_text(16)))
            }
        })
    };
    let answered = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let flooding = tokio::spawn(flood(
        server.agent_addr,
        std::net::IpAddr::from([127, 0, 0, 1]),
        tokens,
        CONNECTIONS,
        answered,
        stop.clone(),
    ));
    let slowed = "konnectivity_rs_server_token_reviews_skipped_total{reason=\"peer_slowed\"}";
    let started = Instant::now();
    // Well under way: its address's places among the waiting held.
    while server.metric(slowed).await < 100.0 {
        assert!(
            started.elapsed() < DEADLINE,
            "the flood never slowed its address"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let tokens: Vec<String> = (1..=AGENTS).map(signed).collect();
    let connects: Vec<_> = tokens.iter().map(|t| connect_with(&server, t)).collect();
    let outcomes = futures_util::future::join_all(connects).await;
    let refused_meanwhile = server.metric(slowed).await;
    stop.cancel();
    let outcome = flooding.await.unwrap();
    eprintln!(
        "{AGENTS} signed connects beside the flood: {:?}; flood: {outcome:?}, refused slowed: {refused_meanwhile}",
        outcomes.iter().map(Result::is_ok).collect::<Vec<_>>()
    );
    for outcome in outcomes {
        if let Err(error) = outcome {
            panic!("a signed connect behind the flooding address was refused: {error}");
        }
    }
    assert_eq!(outcome.other, 0, "a flood token was admitted: {outcome:?}");
    let forged = std::mem::take(&mut *forged.lock().unwrap());
    assert!(!forged.is_empty());
    assert!(
        forged.iter().all(|token| !stub.reviewed(token)),
        "a token with a forged signature was reviewed"
    );
    let refused_forged = server
        .metric("konnectivity_rs_server_token_reviews_skipped_total{reason=\"signature\"}")
        .await;
    assert!(refused_forged > 0.0);
}

/// One connect with `token` and `identifiers`: the status it was refused
/// with, or `None` if admitted.
async fn connect_claiming(
    server: &TestServer,
    token: &str,
    identifiers: &str,
) -> Option<tonic::Status> {
    match connect_as(server, token, identifiers).await {
        Ok(_) => None,
        Err(ConnectError::Refused { status, .. }) => Some(status),
        Err(other) => panic!("unexpected {other}"),
    }
}

/// Issue 51, item 4: in token mode with `--verify-agent-identifiers`, a
/// token bound to a node (the TokenReview's
/// `authentication.kubernetes.io/node-name`) admits `host=` that node
/// only, and neither `cidr=` nor `default-route=true`; a token bound to no
/// node is refused. Before, the flag was refused in token mode and any
/// holder of the service account's token could claim any node.
#[tokio::test]
async fn a_node_bound_token_admits_its_own_node_only() {
    let stub = TokenReviewStub::start().await;
    stub.allow(
        &sa("node-a-token"),
        Identity {
            node: Some("node-a".to_owned()),
            ..identity(AGENT_SA, AUDIENCE)
        },
    );
    stub.allow(&sa("unbound-token"), identity(AGENT_SA, AUDIENCE));
    let server = TestServer::start_with(ServerOpts {
        mtls: false,
        verify_agent_identifiers: true,
        token_auth: Some(TokenAuthConfig {
            namespace: "kube-system".to_owned(),
            service_account: "konnectivity-agent".to_owned(),
            audience: AUDIENCE.to_owned(),
            kubeconfig: Some(stub.kubeconfig.clone()),
            cache_ttl: proxy_server::auth::DEFAULT_CACHE_TTL,
            max_in_flight: proxy_server::auth::DEFAULT_MAX_IN_FLIGHT,
            max_pending: proxy_server::auth::DEFAULT_MAX_PENDING,
            local_checks: true,
        }),
        ..Default::default()
    })
    .await;
    let token = sa("node-a-token");
    assert!(
        connect_claiming(&server, &token, "host=node-a&ipv4=10.0.0.5")
            .await
            .is_none(),
        "its own node (ipv4= stays its word)"
    );
    for claim in ["host=node-b", "cidr=10.0.0.0/8", "default-route=true"] {
        let status = connect_claiming(&server, &token, claim)
            .await
            .unwrap_or_else(|| panic!("{claim} admitted"));
        assert_eq!(status.code(), tonic::Code::PermissionDenied, "{status:?}");
        assert!(
            status.message().contains(&format!(
                "agent identifier {claim} is not granted by the agent's token"
            )) && status.message().contains("bound to node node-a"),
            "{status:?}"
        );
    }
    let status = connect_claiming(&server, &sa("unbound-token"), "host=node-a")
        .await
        .expect("an unbound token refused");
    assert_eq!(status.code(), tonic::Code::PermissionDenied, "{status:?}");
    assert!(
        status.message().contains("is not bound to a node"),
        "{status:?}"
    );
}
