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

/// What `openssl s_client` printed (stdout and stderr) for one connection
/// to `127.0.0.1:port` with the client certificate `cert`/`key`, the CA
/// `ca` and `args`, after writing `input`; with input, it reads until the
/// server closes (`-ign_eof`), without, it ends at once.
async fn s_client(
    port: u16,
    (ca, cert, key): (&std::path::Path, &std::path::Path, &std::path::Path),
    args: &[&str],
    input: &[u8],
) -> String {
    use std::process::Stdio;
    let mut child = tokio::process::Command::new("openssl")
        .arg("s_client")
        .arg("-connect")
        .arg(format!("127.0.0.1:{port}"))
        .args(["-servername", "localhost"])
        .args((!input.is_empty()).then_some("-ign_eof"))
        .arg("-CAfile")
        .arg(ca)
        .arg("-cert")
        .arg(cert)
        .arg("-key")
        .arg(key)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("running openssl (scripts/test installs it)");
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(input).await.unwrap();
    drop(stdin);
    let output = tokio::time::timeout(integration_tests::DEADLINE * 3, child.wait_with_output())
        .await
        .expect("openssl s_client did not finish")
        .unwrap();
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// The TCP frontend resumes no TLS session: it keeps no session cache and
/// issues no tickets, so every connection is a full handshake whose client
/// certificate is verified against `--server-ca-cert` as it is then
/// (rustls's cache would otherwise resume a certificate that has expired
/// since, without a check). kube-apiserver's client (grpc-go over Go's
/// `crypto/tls` with no `ClientSessionCache`) never resumes, so it loses
/// nothing. Shown with OpenSSL against the real binary: with TLS 1.2,
/// `-reconnect` offers the first session five more times and is never
/// resumed; with TLS 1.3 no ticket arrives before the server's answer. The
/// agent port of the same process, which does issue tickets, resumes the
/// same way of asking: OpenSSL would say so if the frontend did.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openssl_resumes_no_session_on_the_tcp_frontend() {
    let pki = Pki::get();
    let file = |name: &str| pki.path(name).display().to_string();
    let mut server = integration_tests::process::ServerProcess::start(
        "http-connect",
        &[
            "--uds-name=".to_owned(),
            "--server-bind-address=127.0.0.1".to_owned(),
            format!("--server-cert={}", file("proxy-frontend.crt")),
            format!("--server-key={}", file("proxy-frontend.key")),
            format!("--server-ca-cert={}", file("frontend-ca.crt")),
        ],
    )
    .await;
    let frontend = server
        .process
        .logged_port("frontend.addr=Some(127.0.0.1:")
        .await;
    let client = (
        pki.path("frontend-ca.crt"),
        pki.path("proxy-client.crt"),
        pki.path("proxy-client.key"),
    );
    let client = (client.0.as_path(), client.1.as_path(), client.2.as_path());
    let agent = (
        pki.path("agent-ca.crt"),
        pki.path("proxy-agent.crt"),
        pki.path("proxy-agent.key"),
    );
    let agent = (agent.0.as_path(), agent.1.as_path(), agent.2.as_path());
    // Answered at once (no agent is connected): the answer comes after
    // any ticket the server sends.
    let request = b"CONNECT 127.0.0.1:9 HTTP/1.1\r\nHost: 127.0.0.1:9\r\n\r\n";

    // TLS 1.2: the session id of the first handshake, offered again.
    let tls12 = s_client(frontend, client, &["-tls1_2", "-reconnect"], b"").await;
    assert_eq!(tls12.matches("New, TLSv1.2").count(), 6, "{tls12}");
    assert!(!tls12.contains("Reused"), "{tls12}");

    // TLS 1.3: tickets, saved and offered again.
    let dir = tempfile::tempdir().unwrap();
    let session = dir.path().join("frontend.pem");
    let session_arg = session.display().to_string();
    let first = s_client(
        frontend,
        client,
        &["-tls1_3", "-sess_out", &session_arg],
        request,
    )
    .await;
    assert!(first.contains("New, TLSv1.3"), "{first}");
    assert!(first.contains("HTTP/1.1 "), "no answer: {first}");
    assert!(!first.contains("New Session Ticket"), "{first}");
    if session.exists() {
        let again = s_client(
            frontend,
            client,
            &["-tls1_3", "-sess_in", &session_arg],
            request,
        )
        .await;
        assert!(again.contains("New, TLSv1.3"), "{again}");
        assert!(!again.contains("Reused"), "{again}");
    }

    // The control: the agent port resumes, asked the same way.
    let ticket = dir.path().join("agent.pem");
    let ticket_arg = ticket.display().to_string();
    let first = s_client(
        server.agent_addr.port(),
        agent,
        &["-tls1_3", "-sess_out", &ticket_arg],
        request,
    )
    .await;
    assert!(first.contains("New Session Ticket"), "{first}");
    let again = s_client(
        server.agent_addr.port(),
        agent,
        &["-tls1_3", "-sess_in", &ticket_arg],
        request,
    )
    .await;
    assert!(again.contains("Reused, TLSv1.3"), "{again}");
}
