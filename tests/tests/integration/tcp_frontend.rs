//! gRPC mode over the mTLS TCP frontend (`--server-port`, `--server-ca-cert`).

#![allow(clippy::unwrap_used)] // tests: a panic is a failure report

use client::dial::{ClientError, dial, tls_channel};
use integration_tests::{Pki, ServerOpts, TestAgent, TestServer, destination, frontend_client_tls};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

async fn tcp_server() -> TestServer {
    TestServer::start_with(ServerOpts {
        tcp_frontend: true,
        ..Default::default()
    })
    .await
}

#[tokio::test]
async fn byte_exact_through_the_tcp_frontend() {
    const LEN: usize = 10 << 20;
    let server = tcp_server().await;
    let _agent = TestAgent::start(&server).await;
    let echo = destination::echo().await;
    let download = destination::download(LEN).await;

    let mut conn = server.dial(&download.address()).await.unwrap();
    let mut got = Vec::new();
    conn.read_to_end(&mut got).await.unwrap();
    assert!(got == destination::pattern(LEN, 7));
    conn.finish().await.unwrap();

    let mut conn = server.dial(&echo.address()).await.unwrap();
    let data = destination::pattern(1 << 20, 5);
    let (mut rd, mut wr) = tokio::io::split(&mut conn);
    let (_, got) = tokio::join!(async { wr.write_all(&data).await.unwrap() }, async {
        let mut got = vec![0u8; data.len()];
        rd.read_exact(&mut got).await.unwrap();
        got
    });
    assert!(got == data);
    conn.finish().await.unwrap();
    server.wait_idle().await;
}

#[tokio::test]
async fn frontends_without_a_trusted_client_certificate_are_refused() {
    let server = tcp_server().await;
    let _agent = TestAgent::start(&server).await;
    let echo = destination::echo().await;
    let addr = server.frontend_tcp.unwrap();

    // A certificate from another CA.
    let foreign = frontend_client_tls(Pki::other());
    let refused = match tls_channel(addr, "localhost", foreign).await {
        Err(_) => true,
        Ok(channel) => dial(channel, &echo.address()).await.is_err(),
    };
    assert!(refused, "a foreign client certificate was accepted");

    // No certificate at all.
    let anonymous =
        ops::tls::client_config(&Pki::get().path("frontend-ca.crt"), None, &[]).unwrap();
    let err = match tls_channel(addr, "localhost", anonymous).await {
        Err(e) => e,
        Ok(channel) => dial(channel, &echo.address()).await.err().expect("refused"),
    };
    assert!(!matches!(err, ClientError::Dial { .. }), "{err}");

    // The trusted one works.
    let mut conn = server.dial(&echo.address()).await.unwrap();
    conn.write_all(b"ok").await.unwrap();
    let mut got = [0u8; 2];
    conn.read_exact(&mut got).await.unwrap();
    assert_eq!(&got, b"ok");
}
