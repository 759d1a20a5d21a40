//! gRPC mode end to end: frontend (UDS) → proxy-server → TLS → proxy-agent → backend.

#![allow(clippy::unwrap_used)] // tests: a panic is a failure report

use std::time::{Duration, Instant};

use client::dial::{ClientError, dial};
use integration_tests::{
    AgentProcess, DEADLINE, RawFrontend, TestAgent, TestServer,
    destination::{self, Blackhole, Fnv, pattern},
    wait_for,
};
use proto::{Packet, packet::PacketKind};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[tokio::test]
async fn a_request_returns_the_backends_exact_bytes() {
    let server = TestServer::start().await;
    let _agent = TestAgent::start(&server).await;
    let echo = destination::echo().await;

    let mut conn = server.dial(&echo.address()).await.unwrap();
    conn.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
    let mut got = [0u8; 18];
    conn.read_exact(&mut got).await.unwrap();
    assert_eq!(&got, b"GET / HTTP/1.1\r\n\r\n");
    conn.finish().await.unwrap();
    server.wait_idle().await;
}

#[tokio::test]
async fn ten_mib_down_is_byte_exact_and_closes_cleanly() {
    const LEN: usize = 10 << 20;
    let server = TestServer::start().await;
    let agent = TestAgent::start(&server).await;
    let download = destination::download(LEN).await;

    let mut conn = server.dial(&download.address()).await.unwrap();
    let mut got = Vec::with_capacity(LEN);
    conn.read_to_end(&mut got).await.unwrap();
    assert_eq!(got.len(), LEN);
    assert!(got == pattern(LEN, 7), "downloaded bytes differ");
    // The backend closed: the agent answered CLOSE_RSP with no error.
    conn.finish().await.unwrap();
    server.wait_idle().await;
    wait_for("agent connections closed", || {
        agent.handle.endpoint_connections() == 0
    })
    .await;
}

#[tokio::test]
async fn ten_mib_up_is_byte_exact() {
    const LEN: usize = 10 << 20;
    let server = TestServer::start().await;
    let _agent = TestAgent::start(&server).await;
    let sink = destination::upload_hash().await;

    let data = pattern(LEN, 3);
    let mut expected = Fnv::new();
    expected.update(&data);
    let mut conn = server.dial(&sink.address()).await.unwrap();
    conn.write_u64(LEN as u64).await.unwrap();
    conn.write_all(&data).await.unwrap();
    let hash = conn.read_u64().await.unwrap();
    assert_eq!(hash, expected.finish(), "uploaded bytes differ");
    conn.finish().await.unwrap();
}

#[tokio::test]
async fn ten_mib_both_ways_at_once_through_an_echo() {
    const LEN: usize = 10 << 20;
    let server = TestServer::start().await;
    let _agent = TestAgent::start(&server).await;
    let echo = destination::echo().await;

    let conn = server.dial(&echo.address()).await.unwrap();
    let (mut rd, mut wr) = tokio::io::split(conn);
    let data = pattern(LEN, 11);
    let sent = data.clone();
    let writer = tokio::spawn(async move {
        wr.write_all(&sent).await.unwrap();
        wr
    });
    let mut got = vec![0u8; LEN];
    rd.read_exact(&mut got).await.unwrap();
    assert!(got == data, "echoed bytes differ");
    let wr = writer.await.unwrap();
    rd.unsplit(wr).finish().await.unwrap();
}

#[tokio::test]
async fn a_hundred_concurrent_connections_are_each_byte_exact() {
    let server = TestServer::start().await;
    let agent = TestAgent::start(&server).await;
    let echo = destination::echo().await;

    let mut tasks = Vec::new();
    for i in 0..100u64 {
        let address = echo.address();
        let channel = server.channel().await;
        tasks.push(tokio::spawn(async move {
            let data = pattern(64 * 1024 + i as usize, i);
            let mut conn = dial(channel, &address).await.unwrap();
            let (mut rd, mut wr) = tokio::io::split(&mut conn);
            let (_, got) = tokio::join!(async { wr.write_all(&data).await.unwrap() }, async {
                let mut got = vec![0u8; data.len()];
                rd.read_exact(&mut got).await.unwrap();
                got
            });
            assert!(got == data, "connection {i} got other bytes");
            conn.finish().await.unwrap();
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    server.wait_idle().await;
    wait_for("agent connections closed", || {
        agent.handle.endpoint_connections() == 0
    })
    .await;
    wait_for("backend connections closed", || {
        echo.open_connections() == 0
    })
    .await;
}

#[tokio::test]
async fn a_dial_to_a_closed_port_fails_and_leaks_nothing() {
    let server = TestServer::start().await;
    let agent = TestAgent::start(&server).await;
    let closed = destination::closed_port();

    let err = server.dial(&closed.to_string()).await.err().unwrap();
    match err {
        ClientError::Dial { error, .. } => {
            assert!(error.contains("connection refused"), "{error}");
        }
        other => panic!("unexpected {other:?}"),
    }
    server.wait_idle().await;
    assert_eq!(agent.handle.endpoint_connections(), 0);
    assert_eq!(agent.handle.dials_in_progress(), 0);
}

#[tokio::test]
async fn without_an_agent_the_dial_says_no_agent_available() {
    let server = TestServer::start().await;
    let err = server.dial("127.0.0.1:1").await.err().unwrap();
    match err {
        ClientError::Dial { error, .. } => assert_eq!(error, proxy_server::NO_AGENT),
        other => panic!("unexpected {other:?}"),
    }
    assert_eq!(server.handle.pending_dials(), 0);
}

#[tokio::test]
async fn a_killed_agent_ends_the_frontend_connection_with_an_error_within_a_second() {
    let server = TestServer::start().await;
    let mut agent = AgentProcess::start(&server).await;
    let echo = destination::echo().await;

    let mut conn = server.dial(&echo.address()).await.unwrap();
    let (mut rd, mut wr) = tokio::io::split(&mut conn);
    // Bytes flow both ways until the agent is killed mid-transfer.
    let writing = async {
        let chunk = pattern(16 * 1024, 1);
        while wr.write_all(&chunk).await.is_ok() {}
    };
    let reading = async {
        let mut buf = vec![0u8; 64 * 1024];
        let mut total = 0;
        while total < 1 << 20 {
            total += rd.read(&mut buf).await.unwrap();
        }
        agent.kill();
        let killed = Instant::now();
        while rd.read(&mut buf).await.is_ok_and(|n| n > 0) {}
        killed
    };
    let ((), killed) = tokio::time::timeout(DEADLINE, async { tokio::join!(writing, reading) })
        .await
        .expect("the connection did not end");
    let err = conn.finish().await.unwrap_err();
    let elapsed = killed.elapsed();
    assert!(elapsed < Duration::from_secs(1), "took {elapsed:?}");
    match err {
        ClientError::Remote(reason) => assert!(reason.contains("disconnected"), "{reason}"),
        other => panic!("unexpected {other:?}"),
    }
    server.wait_idle().await;
    server.wait_for_backends(0).await;
}

#[tokio::test]
async fn a_restarted_server_gets_its_agent_back() {
    let server = TestServer::start().await;
    let _agent = TestAgent::start(&server).await;
    let echo = destination::echo().await;
    roundtrip(&server, &echo.address()).await;

    let server = server.restart().await;
    server.wait_for_backends(1).await;
    roundtrip(&server, &echo.address()).await;
}

async fn roundtrip(server: &TestServer, address: &str) {
    let mut conn = server.dial(address).await.unwrap();
    conn.write_all(b"ping").await.unwrap();
    let mut got = [0u8; 4];
    conn.read_exact(&mut got).await.unwrap();
    assert_eq!(&got, b"ping");
    conn.finish().await.unwrap();
}

#[tokio::test]
async fn several_streams_share_one_frontend_connection() {
    let server = TestServer::start().await;
    let _agent = TestAgent::start(&server).await;
    let echo = destination::echo().await;
    let channel = server.channel().await;
    let mut tasks = Vec::new();
    for i in 0..8u64 {
        let channel = channel.clone();
        let address = echo.address();
        tasks.push(tokio::spawn(async move {
            let data = pattern(100_000, i);
            let mut conn = dial(channel, &address).await.unwrap();
            conn.write_all(&data).await.unwrap();
            let mut got = vec![0u8; data.len()];
            conn.read_exact(&mut got).await.unwrap();
            assert!(got == data);
            conn.finish().await.unwrap();
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    server.wait_idle().await;
}

#[tokio::test]
async fn dial_cls_cancels_a_pending_dial_on_the_agent() {
    let server = TestServer::start().await;
    let agent = TestAgent::start(&server).await;
    let hole = Blackhole::new();

    let mut frontend = RawFrontend::open(
        &server,
        Packet::dial_request("tcp", &hole.addr.to_string(), 42),
    )
    .await;
    wait_for("the dial to reach the agent", || {
        agent.handle.dials_in_progress() == 1
    })
    .await;
    assert_eq!(server.handle.pending_dials(), 1);
    frontend.send(Packet::close_dial(42)).await;
    wait_for("the dial to be cancelled", || {
        agent.handle.dials_in_progress() == 0 && server.handle.pending_dials() == 0
    })
    .await;
    // Nothing is answered for a cancelled dial; the stream stays usable.
    frontend
        .send(Packet::dial_request("tcp", "127.0.0.1:1", 43))
        .await;
    match frontend.recv().await.into_kind() {
        PacketKind::DialRsp(rsp) => {
            assert_eq!(rsp.random, 43);
            assert!(rsp.error.contains("connection refused"), "{}", rsp.error);
        }
        other => panic!("unexpected {other:?}"),
    }
}

#[tokio::test]
async fn a_frontend_that_goes_away_cancels_its_dials_and_closes_its_connections() {
    let server = TestServer::start().await;
    let agent = TestAgent::start(&server).await;
    let hole = Blackhole::new();
    let echo = destination::echo().await;

    // A pending dial, then the frontend vanishes.
    let frontend = RawFrontend::open(
        &server,
        Packet::dial_request("tcp", &hole.addr.to_string(), 7),
    )
    .await;
    wait_for("the dial to reach the agent", || {
        agent.handle.dials_in_progress() == 1
    })
    .await;
    drop(frontend);
    wait_for("the abandoned dial to be cancelled", || {
        agent.handle.dials_in_progress() == 0 && server.handle.pending_dials() == 0
    })
    .await;

    // An established connection, then the frontend vanishes without CLOSE_REQ.
    let mut frontend =
        RawFrontend::open(&server, Packet::dial_request("tcp", &echo.address(), 8)).await;
    let PacketKind::DialRsp(rsp) = frontend.recv().await.into_kind() else {
        panic!("expected DIAL_RSP")
    };
    assert!(rsp.error.is_empty());
    wait_for("the backend connection", || echo.open_connections() == 1).await;
    drop(frontend);
    wait_for("the abandoned connection to be closed", || {
        echo.open_connections() == 0 && agent.handle.endpoint_connections() == 0
    })
    .await;
    server.wait_idle().await;
}

#[tokio::test]
async fn pending_dials_fail_at_once_when_their_agent_goes_away() {
    let server = TestServer::start().await;
    let agent = TestAgent::start(&server).await;
    let hole = Blackhole::new();

    let mut frontend = RawFrontend::open(
        &server,
        Packet::dial_request("tcp", &hole.addr.to_string(), 9),
    )
    .await;
    wait_for("the dial to reach the agent", || {
        agent.handle.dials_in_progress() == 1
    })
    .await;
    let stopped = Instant::now();
    agent.handle.disconnect_all();
    match frontend.recv().await.into_kind() {
        PacketKind::DialRsp(rsp) => {
            assert_eq!(rsp.random, 9);
            assert!(rsp.error.contains("disconnected"), "{}", rsp.error);
        }
        other => panic!("unexpected {other:?}"),
    }
    // Well before the agent's own 5 s dial timeout.
    assert!(stopped.elapsed() < Duration::from_secs(4));
    assert_eq!(server.handle.pending_dials(), 0);
}

#[tokio::test]
async fn backend_dial_timeout_fails_slow_dials_and_cancels_them() {
    let server = TestServer::start_with(integration_tests::ServerOpts {
        backend_dial_timeout: Some(Duration::from_millis(300)),
        ..Default::default()
    })
    .await;
    let agent = TestAgent::start(&server).await;
    let hole = Blackhole::new();

    let err = server.dial(&hole.addr.to_string()).await.err().unwrap();
    match err {
        ClientError::Dial { error, .. } => assert_eq!(error, proxy_server::DIAL_TIMED_OUT),
        other => panic!("unexpected {other:?}"),
    }
    wait_for("the agent's dial to be cancelled", || {
        agent.handle.dials_in_progress() == 0
    })
    .await;
    assert_eq!(server.handle.pending_dials(), 0);
}

#[tokio::test]
async fn the_server_is_ready_only_with_an_agent() {
    let server = TestServer::start().await;
    let health = server.health_addr;
    assert_eq!(
        integration_tests::http_get(health, "/healthz").await,
        (200, "ok".to_owned())
    );
    let not_ready = (500, "no connection to any proxy agent".to_owned());
    assert_eq!(
        integration_tests::http_get(health, "/readyz").await,
        not_ready
    );
    assert_eq!(
        integration_tests::http_get(health, "/ready").await,
        not_ready
    );

    let agent = TestAgent::start(&server).await;
    assert_eq!(
        integration_tests::http_get(health, "/readyz").await,
        (200, "ok".to_owned())
    );
    assert_eq!(
        integration_tests::http_get(health, "/ready").await,
        (200, "ok".to_owned())
    );
    // The server counts the agent before the agent has read the server's
    // answer: wait for the agent's own view.
    assert_eq!(
        integration_tests::wait_for_status(agent.health_addr, "/readyz", 200).await,
        "ok"
    );
    assert_eq!(
        integration_tests::http_get(agent.health_addr, "/healthz").await,
        (200, "ok".to_owned())
    );
}

#[tokio::test]
async fn an_agent_without_a_server_is_not_ready() {
    let nowhere = destination::closed_port();
    let agent = TestAgent::start_with(nowhere, Default::default()).await;
    assert_eq!(
        integration_tests::http_get(agent.health_addr, "/readyz").await,
        (
            503,
            "[+]ping ok\n[-]server-connected failed: no servers connected\n".to_owned()
        )
    );
    assert_eq!(
        integration_tests::http_get(agent.health_addr, "/healthz").await,
        (200, "ok".to_owned())
    );
    let _ = DEADLINE;
}

#[tokio::test]
async fn an_agent_started_before_its_server_connects_once_it_is_up() {
    let port = destination::closed_port().port();
    let agent = TestAgent::start_with(
        std::net::SocketAddr::from(([127, 0, 0, 1], port)),
        Default::default(),
    )
    .await;
    // The agent is failing and backing off while nothing listens.
    assert_eq!(agent.handle.server_connections(), 0);
    let server = TestServer::start_with(integration_tests::ServerOpts {
        agent_port: port,
        ..Default::default()
    })
    .await;
    server.wait_for_backends(1).await;
    let echo = destination::echo().await;
    roundtrip(&server, &echo.address()).await;
}
