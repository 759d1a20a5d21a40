//! Service-account token authentication of agents against a local stand-in
//! of the kube API's TokenReview endpoint (with a real kubeconfig file).

#![allow(clippy::unwrap_used)] // tests: a panic is a failure report

use integration_tests::{
    AgentOpts, ServerOpts, TestAgent, TestServer, agent_config, destination,
    kube_stub::{Identity, TokenReviewStub},
    wait_for,
};
use proxy_agent::client::{Client, ConnectError};
use proxy_server::auth::TokenAuthConfig;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const AUDIENCE: &str = "system:konnectivity-server";
const AGENT_SA: &str = "system:serviceaccount:kube-system:konnectivity-agent";

async fn server(stub: &TokenReviewStub) -> TestServer {
    TestServer::start_with(ServerOpts {
        mtls: false,
        token_auth: Some(TokenAuthConfig {
            namespace: "kube-system".to_owned(),
            service_account: "konnectivity-agent".to_owned(),
            audience: AUDIENCE.to_owned(),
            kubeconfig: Some(stub.kubeconfig.clone()),
        }),
        ..Default::default()
    })
    .await
}

fn token_file(dir: &tempfile::TempDir, token: &str) -> std::path::PathBuf {
    let path = dir.path().join("token");
    std::fs::write(&path, token).unwrap();
    path
}

/// The error a single connect with `token` gets.
async fn refusal(server: &TestServer, token: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    let config = agent_config(
        server.agent_addr,
        &AgentOpts {
            token_path: Some(token_file(&dir, token)),
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
    let text = refusal(&server, "good-token").await;
    assert!(text.contains("TokenReview failed"), "{text}");
    // A second agent keeps retrying; the first keeps serving.
    let second = TestAgent::start_with(server.agent_addr, opts).await;
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
    server.wait_for_backends(1).await;
    // The server may see the stream before the agent has recorded it: wait
    // for both, or there is nothing yet to disconnect.
    let agent_handle = agent.handle.clone();
    wait_for("the agent to record its stream", || {
        agent_handle.server_connections() == 1
    })
    .await;

    // The kubelet rotates the token: the old one stops working, the file changes.
    stub.revoke("token-one");
    stub.allow("token-two", identity(AGENT_SA, AUDIENCE));
    std::fs::write(&path, "token-two").unwrap();
    let reviews = stub.reviews.load(std::sync::atomic::Ordering::SeqCst);
    let before = server.handle.agent_peers();
    agent.handle.disconnect_all();
    // The new stream may be accepted before the old one is seen gone: wait
    // for one stream from another peer port, which only token-two can open.
    let handle = server.handle.clone();
    wait_for("the agent to come back with the rotated token", || {
        let peers = handle.agent_peers();
        peers.len() == 1 && peers != before
    })
    .await;
    assert!(stub.reviews.load(std::sync::atomic::Ordering::SeqCst) > reviews);
}
