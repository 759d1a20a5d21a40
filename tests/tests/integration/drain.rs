//! Agent drain, as ANP: the first signal sends DRAIN to the server (new
//! dials go to other agents, to the draining one only when none other fits)
//! and the agent keeps serving; the second signal exits at once.
//! `--exit-when-drained` (ours) also exits once no connection is open.
//! Server graceful shutdown.

#![allow(clippy::unwrap_used)] // tests: a panic is a failure report

use client::dial::TunnelConn;
use integration_tests::{AgentOpts, AgentProcess, TestAgent, TestServer, destination, wait_for};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

/// Echoes `data` through `conn` and checks it came back byte-exact.
async fn echo_exact(conn: &mut TunnelConn, data: &[u8]) {
    let (mut rd, mut wr) = tokio::io::split(conn);
    let (_, echoed) = tokio::join!(async { wr.write_all(data).await.unwrap() }, async {
        let mut echoed = vec![0u8; data.len()];
        rd.read_exact(&mut echoed).await.unwrap();
        echoed
    });
    assert!(echoed == data, "not byte-exact");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_drain_a_new_dial_is_served_by_the_only_agent_which_keeps_running() {
    // ANP's TestProxyHandle_AfterDrain.
    let server = TestServer::start().await;
    let drain = CancellationToken::new();
    let agent = TestAgent::start_drainable(server.agent_addr, drain.clone()).await;
    server.wait_for_backends(1).await;
    let echo = destination::echo().await;

    drain.cancel();
    wait_for("DRAIN to reach the server", || {
        server.handle.draining_backends() == 1
    })
    .await;
    assert!(agent.handle.is_draining());

    // The only agent is draining: the server falls back to it and it dials.
    for round in 0..3u64 {
        let mut conn = server.dial(&echo.address()).await.unwrap();
        echo_exact(&mut conn, &destination::pattern(256 << 10, round)).await;
        conn.finish().await.unwrap();
    }
    server.wait_idle().await;
    assert!(!agent.has_exited(), "a draining agent keeps serving");
    assert_eq!(server.handle.backend_count(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_agent_finishes_its_transfer_while_new_dials_go_elsewhere() {
    let server = TestServer::start().await;
    let drain = CancellationToken::new();
    let draining = TestAgent::start_drainable(server.agent_addr, drain.clone()).await;
    server.wait_for_backends(1).await;
    let echo = destination::echo().await;

    // A long transfer through the agent that is about to drain.
    let mut conn = server.dial(&echo.address()).await.unwrap();
    assert_eq!(draining.handle.endpoint_connections(), 1);
    let other = TestAgent::start(&server).await;

    drain.cancel();
    wait_for("DRAIN to reach the server", || {
        server.handle.draining_backends() == 1
    })
    .await;

    // New dials go to the other agent.
    for _ in 0..5 {
        let mut fresh = server.dial(&echo.address()).await.unwrap();
        echo_exact(&mut fresh, b"new").await;
        assert_eq!(other.handle.endpoint_connections(), 1);
        assert_eq!(draining.handle.endpoint_connections(), 1);
        fresh.finish().await.unwrap();
        wait_for("the other agent's connection to close", || {
            other.handle.endpoint_connections() == 0
        })
        .await;
    }

    // The transfer in flight completes byte-exact.
    echo_exact(&mut conn, &destination::pattern(10 << 20, 77)).await;
    conn.finish().await.unwrap();
    server.wait_idle().await;
    assert!(
        !draining.has_exited(),
        "idle, it still waits for the second signal"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_second_signal_exits_at_once_and_ends_open_connections_with_an_error() {
    let server = TestServer::start().await;
    let drain = CancellationToken::new();
    let agent = TestAgent::start_drainable(server.agent_addr, drain.clone()).await;
    server.wait_for_backends(1).await;
    let echo = destination::echo().await;
    let conn = server.dial(&echo.address()).await.unwrap();

    drain.cancel();
    wait_for("DRAIN to reach the server", || {
        server.handle.draining_backends() == 1
    })
    .await;
    assert!(!agent.has_exited());

    // The second signal: out at once, the open connection ends with an error.
    tokio::time::timeout(integration_tests::DEADLINE, agent.stop())
        .await
        .expect("the agent stops at once");
    assert!(conn.finish().await.is_err());
    server.wait_for_backends(0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_exit_when_drained_the_agent_exits_once_its_last_connection_closes() {
    let server = TestServer::start().await;
    let drain = CancellationToken::new();
    let agent = TestAgent::start_drainable_with(
        server.agent_addr,
        AgentOpts {
            exit_when_drained: true,
            ..Default::default()
        },
        drain.clone(),
    )
    .await;
    server.wait_for_backends(1).await;
    let echo = destination::echo().await;
    let mut conn = server.dial(&echo.address()).await.unwrap();

    drain.cancel();
    wait_for("DRAIN to reach the server", || {
        server.handle.draining_backends() == 1
    })
    .await;
    // Still serving: its open connection, and a new dial (the only agent).
    let mut fresh = server.dial(&echo.address()).await.unwrap();
    echo_exact(&mut fresh, b"while draining").await;
    fresh.finish().await.unwrap();
    echo_exact(&mut conn, &destination::pattern(1 << 20, 5)).await;
    assert!(!agent.has_exited(), "it waits for its open connection");

    conn.finish().await.unwrap();
    wait_for("the drained agent to exit", || agent.has_exited()).await;
    server.wait_for_backends(0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_real_agent_keeps_serving_after_sigterm_and_exits_on_the_second() {
    let server = TestServer::start().await;
    let mut agent = AgentProcess::start(&server).await;
    let echo = destination::echo().await;
    let mut conn = server.dial(&echo.address()).await.unwrap();

    agent.signal("TERM");
    wait_for("DRAIN to reach the server", || {
        server.handle.draining_backends() == 1
    })
    .await;
    // Its open connection and a new dial both work (TestProxyHandle_AfterDrain).
    echo_exact(&mut conn, b"still").await;
    let mut fresh = server.dial(&echo.address()).await.unwrap();
    echo_exact(&mut fresh, &destination::pattern(64 << 10, 9)).await;
    fresh.finish().await.unwrap();
    conn.finish().await.unwrap();
    server.wait_idle().await;
    assert!(!agent.has_exited());

    agent.signal("TERM");
    wait_for("the agent to exit on the second signal", || {
        agent.has_exited()
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_real_agent_with_exit_when_drained_exits_once_idle() {
    let server = TestServer::start().await;
    let mut agent = AgentProcess::start_with_args(&server, &["--exit-when-drained"]).await;
    let echo = destination::echo().await;
    let mut conn = server.dial(&echo.address()).await.unwrap();

    agent.signal("TERM");
    wait_for("DRAIN to reach the server", || {
        server.handle.draining_backends() == 1
    })
    .await;
    echo_exact(&mut conn, b"still").await;
    assert!(!agent.has_exited());
    conn.finish().await.unwrap();
    wait_for("the idle agent to exit", || agent.has_exited()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_graceful_shutdown_lets_a_transfer_finish_within_the_timeout() {
    let server = TestServer::start_with(integration_tests::ServerOpts {
        graceful_shutdown_timeout: Some(std::time::Duration::from_secs(30)),
        ..Default::default()
    })
    .await;
    let _agent = TestAgent::start(&server).await;
    let echo = destination::echo().await;
    let mut conn = server.dial(&echo.address()).await.unwrap();

    server.begin_shutdown();
    // No new frontends are accepted...
    wait_for("the frontend socket to close", || {
        std::os::unix::net::UnixStream::connect(&server.uds).is_err()
    })
    .await;
    // ...but the open connection carries every byte.
    let data = destination::pattern(10 << 20, 31);
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
    let echo = destination::echo().await;
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
