//! Agent drain: the first signal sends DRAIN to the server (new dials go to
//! other agents), refuses new dials, lets open connections finish and then
//! exits; a second signal exits at once.

#![allow(clippy::unwrap_used)] // tests: a panic is a failure report

use integration_tests::{TestAgent, TestServer, backend, wait_for};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_agent_finishes_its_transfer_then_exits_and_new_dials_go_elsewhere() {
    let server = TestServer::start().await;
    let drain = CancellationToken::new();
    let draining = TestAgent::start_drainable(server.agent_addr, drain.clone()).await;
    server.wait_for_backends(1).await;
    let echo = backend::echo().await;

    // A long transfer through the agent that is about to drain.
    let mut conn = server.dial(&echo.address()).await.unwrap();
    assert_eq!(draining.handle.endpoint_connections(), 1);
    let other = TestAgent::start(&server).await;

    drain.cancel();
    wait_for("DRAIN to reach the server", || {
        server.handle.draining_backends() == 1
    })
    .await;
    assert!(draining.handle.is_draining());

    // New dials go to the other agent.
    let mut fresh = server.dial(&echo.address()).await.unwrap();
    fresh.write_all(b"new").await.unwrap();
    let mut got = [0u8; 3];
    fresh.read_exact(&mut got).await.unwrap();
    assert_eq!(other.handle.endpoint_connections(), 1);
    assert_eq!(draining.handle.endpoint_connections(), 1);
    fresh.finish().await.unwrap();

    // The transfer in flight completes byte-exact.
    let data = backend::pattern(10 << 20, 77);
    let (mut rd, mut wr) = tokio::io::split(&mut conn);
    let (_, echoed) = tokio::join!(async { wr.write_all(&data).await.unwrap() }, async {
        let mut echoed = vec![0u8; data.len()];
        rd.read_exact(&mut echoed).await.unwrap();
        echoed
    });
    assert!(
        echoed == data,
        "the draining agent's transfer was not byte-exact"
    );
    assert!(
        !draining.has_exited(),
        "it must wait for its open connection"
    );

    // Once its last connection is closed, the agent exits.
    conn.finish().await.unwrap();
    wait_for("the drained agent to exit", || draining.has_exited()).await;
    server.wait_for_backends(1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_agent_refuses_new_dials_and_a_second_signal_exits_at_once() {
    let server = TestServer::start().await;
    let drain = CancellationToken::new();
    let agent = TestAgent::start_drainable(server.agent_addr, drain.clone()).await;
    server.wait_for_backends(1).await;
    let echo = backend::echo().await;
    let conn = server.dial(&echo.address()).await.unwrap();

    drain.cancel();
    wait_for("DRAIN to reach the server", || {
        server.handle.draining_backends() == 1
    })
    .await;
    // The only agent is draining: the server falls back to it, it refuses.
    match server.dial(&echo.address()).await {
        Err(tunnel::client::ClientError::Dial { error, .. }) => {
            assert_eq!(error, "agent is draining")
        }
        other => panic!("unexpected {:?}", other.err()),
    }
    assert!(!agent.has_exited());

    // The second signal: out at once, the open connection ends with an error.
    agent.stop().await;
    assert!(conn.finish().await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_real_agent_drains_on_sigterm_and_exits_on_the_second() {
    let server = TestServer::start().await;
    let mut agent = integration_tests::AgentProcess::start(&server).await;
    let echo = backend::echo().await;
    let mut conn = server.dial(&echo.address()).await.unwrap();

    agent.signal("TERM");
    wait_for("DRAIN to reach the server", || {
        server.handle.draining_backends() == 1
    })
    .await;
    // Still serving its open connection.
    conn.write_all(b"still").await.unwrap();
    let mut got = [0u8; 5];
    conn.read_exact(&mut got).await.unwrap();
    assert_eq!(&got, b"still");
    assert!(!agent.has_exited());

    agent.signal("TERM");
    wait_for("the agent to exit on the second signal", || {
        agent.has_exited()
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_graceful_shutdown_lets_a_transfer_finish_within_the_timeout() {
    let server = TestServer::start_with(integration_tests::ServerOpts {
        graceful_shutdown_timeout: Some(std::time::Duration::from_secs(30)),
        ..Default::default()
    })
    .await;
    let _agent = TestAgent::start(&server).await;
    let echo = backend::echo().await;
    let mut conn = server.dial(&echo.address()).await.unwrap();

    server.begin_shutdown();
    // No new frontends are accepted...
    wait_for("the frontend socket to close", || {
        std::os::unix::net::UnixStream::connect(&server.uds).is_err()
    })
    .await;
    // ...but the open connection carries every byte.
    let data = backend::pattern(10 << 20, 31);
    let (mut rd, mut wr) = tokio::io::split(&mut conn);
    let (_, echoed) = tokio::join!(async { wr.write_all(&data).await.unwrap() }, async {
        let mut echoed = vec![0u8; data.len()];
        rd.read_exact(&mut echoed).await.unwrap();
        echoed
    });
    assert!(echoed == data);
    assert!(!server.has_stopped());
    conn.finish().await.unwrap();
    wait_for("the server to stop once idle", || server.has_stopped()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_graceful_timeout_both_ends_get_an_error() {
    let server = TestServer::start_with(integration_tests::ServerOpts {
        graceful_shutdown_timeout: Some(std::time::Duration::from_millis(300)),
        ..Default::default()
    })
    .await;
    let agent = TestAgent::start(&server).await;
    let echo = backend::echo().await;
    let mut conn = server.dial(&echo.address()).await.unwrap();
    server.begin_shutdown();
    // The connection outlives the timeout: it is closed under us (EOF) and
    // reports an error, not left hanging.
    let mut buf = [0u8; 1];
    let read = tokio::time::timeout(integration_tests::DEADLINE, conn.read(&mut buf)).await;
    assert!(matches!(read, Ok(Ok(0) | Err(_))), "{read:?}");
    assert!(conn.finish().await.is_err());
    wait_for("the server to stop", || server.has_stopped()).await;
    wait_for("the agent side to be closed", || {
        agent.handle.endpoint_connections() == 0
    })
    .await;
}
