//! Head-of-line isolation: a connection whose reader stalls must not hold up
//! the other connections of the same agent stream, and what is buffered for
//! it stays bounded — with per-connection flow control (our agent and our
//! server) and without it (as with ANP peers, where a stalled connection is
//! closed with an error after a bounded wait instead of stalling everyone).

#![allow(clippy::unwrap_used)] // tests: a panic is a failure report

use client::dial::ClientError;
use integration_tests::{
    AgentOpts, ServerOpts, TestAgent, TestServer,
    destination::{self, Fnv, pattern},
    wait_for,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tunnel::flow::{OVERFLOW, WINDOW};

const LEN: usize = 10 << 20;

/// A server and one agent; `negotiated` picks the flow-control path.
async fn setup(negotiated: bool) -> (TestServer, TestAgent) {
    let server = TestServer::start_with(ServerOpts {
        flow_control: negotiated,
        ..Default::default()
    })
    .await;
    let before = server.handle.backend_count();
    let agent = TestAgent::start_with(
        server.agent_addr,
        AgentOpts {
            no_flow_control: !negotiated,
            ..Default::default()
        },
    )
    .await;
    server.wait_for_backends(before + 1).await;
    (server, agent)
}

async fn download_exact(server: &TestServer, address: &str) {
    let mut conn = server.dial(address).await.unwrap();
    let mut got = Vec::with_capacity(LEN);
    conn.read_to_end(&mut got).await.unwrap();
    assert!(got == pattern(LEN, 7), "downloaded bytes differ");
    conn.finish().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frontend_that_stops_reading_does_not_hold_up_the_others() {
    let (server, _agent) = setup(true).await;
    let endless = destination::source().await;
    let download = destination::download(LEN).await;

    // The stalled connection: data keeps coming, nobody reads it.
    let mut stalled = server.dial(&endless.address()).await.unwrap();
    let handle = server.handle.clone();
    wait_for("the stalled connection to fill its window", || {
        handle.max_buffered() > WINDOW / 2
    })
    .await;

    // Another connection on the same agent stream completes 10 MiB meanwhile.
    download_exact(&server, &download.address()).await;

    // What the server holds for the stalled one stayed within its window.
    assert!(
        server.handle.max_buffered() <= WINDOW,
        "{}",
        server.handle.max_buffered()
    );
    // And the stalled connection is alive: reading it resumes the flow.
    let mut buf = vec![0u8; 4 * WINDOW];
    stalled.read_exact(&mut buf).await.unwrap();
    assert_eq!(&buf[..64 * 1024], &pattern(64 * 1024, 13)[..]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_destination_that_stops_reading_does_not_hold_up_the_others() {
    let (server, _agent) = setup(true).await;
    let silent = destination::silent().await;
    let sink = destination::upload_hash().await;

    // The stalled connection: we keep writing, the destination never reads.
    let stalled = server.dial(&silent.address()).await.unwrap();
    let writer = tokio::spawn(async move {
        let mut stalled = stalled;
        let chunk = pattern(64 * 1024, 2);
        while stalled.write_all(&chunk).await.is_ok() {}
    });

    // Another connection uploads 10 MiB through the same agent stream.
    let data = pattern(LEN, 4);
    let mut expected = Fnv::new();
    expected.update(&data);
    let mut conn = server.dial(&sink.address()).await.unwrap();
    conn.write_u64(LEN as u64).await.unwrap();
    conn.write_all(&data).await.unwrap();
    assert_eq!(conn.read_u64().await.unwrap(), expected.finish());
    conn.finish().await.unwrap();
    assert!(
        !writer.is_finished(),
        "the stalled writer should still be blocked"
    );
    writer.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_negotiation_a_stalled_connection_is_closed_and_the_others_complete() {
    let (server, _agent) = setup(false).await;
    let endless = destination::source().await;
    let download = destination::download(LEN).await;

    let stalled = server.dial(&endless.address()).await.unwrap();
    let handle = server.handle.clone();
    wait_for("the stalled connection to fill its queue", || {
        handle.max_buffered() > WINDOW / 2
    })
    .await;
    assert!(server.handle.max_buffered() <= WINDOW);

    // The other connection waits at most the stall bound, then completes.
    download_exact(&server, &download.address()).await;

    // The stalled one was closed with the overflow error (not left behind).
    match stalled.finish().await {
        Err(ClientError::Remote(reason)) => assert_eq!(reason, OVERFLOW),
        other => panic!("unexpected {other:?}"),
    }
    server.wait_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_paths_carry_every_byte_both_ways() {
    for negotiated in [true, false] {
        let (server, agent) = setup(negotiated).await;
        let echo = destination::echo().await;
        let download = destination::download(LEN).await;
        download_exact(&server, &download.address()).await;

        // 16 connections at once, each echoing 2 MiB both ways.
        let mut tasks = Vec::new();
        for i in 0..16u64 {
            let channel = server.channel().await;
            let address = echo.address();
            tasks.push(tokio::spawn(async move {
                let data = pattern(2 << 20, 100 + i);
                let mut conn = client::dial::dial(channel, &address).await.unwrap();
                let (mut rd, mut wr) = tokio::io::split(&mut conn);
                let (_, got) = tokio::join!(async { wr.write_all(&data).await.unwrap() }, async {
                    let mut got = vec![0u8; data.len()];
                    rd.read_exact(&mut got).await.unwrap();
                    got
                });
                assert!(got == data, "connection {i} (negotiated: {negotiated})");
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
    }
}
