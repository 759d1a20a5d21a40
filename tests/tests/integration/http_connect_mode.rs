//! HTTP-CONNECT mode end to end, over the Unix socket and mTLS TCP, with curl
//! as the client where a real one matters.

#![allow(clippy::unwrap_used)] // tests: a panic is a failure report

use std::{path::Path, process::Command, time::Duration};

use client::dial::ClientError;
use integration_tests::{
    DEADLINE, Pki, ServerOpts, TestAgent, TestServer,
    destination::{self, Blackhole, pattern},
    wait_for,
};
use proxy_server::config::Mode;
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::UnixStream,
};

async fn server(tcp: bool) -> TestServer {
    TestServer::start_with(ServerOpts {
        mode: Mode::HttpConnect,
        tcp_frontend: tcp,
        ..Default::default()
    })
    .await
}

/// Sends `request` on the frontend socket and reads the whole answer.
async fn raw(server: &TestServer, request: &[u8]) -> String {
    let mut io = UnixStream::connect(&server.uds).await.unwrap();
    io.write_all(request).await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(DEADLINE, io.read_to_end(&mut answer))
        .await
        .expect("no answer")
        .unwrap();
    String::from_utf8_lossy(&answer).into_owned()
}

fn connect(target: &str) -> Vec<u8> {
    format!("CONNECT {target} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n").into_bytes()
}

#[tokio::test]
async fn connect_answers_exactly_200_then_carries_bytes_both_ways() {
    let server = server(false).await;
    let agent = TestAgent::start(&server).await;
    let echo = destination::echo().await;

    let mut io = UnixStream::connect(&server.uds).await.unwrap();
    // The request header and the first tunnel bytes in one write: pipelined
    // bytes must not be lost.
    let mut first = connect(&echo.address());
    first.extend_from_slice(b"pipelined ");
    io.write_all(&first).await.unwrap();
    let mut head = vec![0u8; proxy_server::ESTABLISHED.len()];
    io.read_exact(&mut head).await.unwrap();
    assert_eq!(head, proxy_server::ESTABLISHED);
    io.write_all(b"bytes").await.unwrap();
    let mut got = [0u8; 15];
    io.read_exact(&mut got).await.unwrap();
    assert_eq!(&got, b"pipelined bytes");

    // 10 MiB both ways at once.
    let data = pattern(10 << 20, 21);
    let (mut rd, mut wr) = io.split();
    let (_, echoed) = tokio::join!(async { wr.write_all(&data).await.unwrap() }, async {
        let mut echoed = vec![0u8; data.len()];
        rd.read_exact(&mut echoed).await.unwrap();
        echoed
    });
    assert!(echoed == data, "echoed bytes differ");
    drop(io);
    server.wait_idle().await;
    wait_for("agent and backend connections closed", || {
        agent.handle.endpoint_connections() == 0 && echo.open_connections() == 0
    })
    .await;
}

#[tokio::test]
async fn ten_mib_down_through_the_dialer_over_uds_and_tcp() {
    const LEN: usize = 10 << 20;
    for tcp in [false, true] {
        let server = server(tcp).await;
        let _agent = TestAgent::start(&server).await;
        let download = destination::download(LEN).await;
        let mut io = server.dialer().dial(&download.address()).await.unwrap();
        let mut got = Vec::with_capacity(LEN);
        io.read_to_end(&mut got).await.unwrap();
        assert!(got == pattern(LEN, 7), "bytes differ (tcp: {tcp})");
        drop(io);
        server.wait_idle().await;
    }
}

#[tokio::test]
async fn other_methods_get_405() {
    let server = server(false).await;
    let answer = raw(&server, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").await;
    assert!(
        answer.starts_with("HTTP/1.1 405 Method Not Allowed\r\n"),
        "{answer}"
    );
    assert!(
        answer.ends_with("\r\n\r\nthis proxy only supports CONNECT passthrough\n"),
        "{answer}"
    );
}

#[tokio::test]
async fn no_agent_gets_anps_500() {
    let server = server(false).await;
    let answer = raw(&server, &connect("127.0.0.1:1")).await;
    assert_eq!(
        answer,
        "HTTP/1.1 500 Internal Server Error\r\nContent-Type: text/plain\r\n\r\ncurrently no tunnels available: No agent available"
    );
}

#[tokio::test]
async fn a_closed_port_gets_502_connection_refused() {
    let server = server(false).await;
    let _agent = TestAgent::start(&server).await;
    let closed = destination::closed_port();
    let answer = raw(&server, &connect(&closed.to_string())).await;
    assert!(
        answer.starts_with("HTTP/1.1 502 Bad Gateway\r\n"),
        "{answer}"
    );
    assert!(
        answer.ends_with(&format!("dial tcp {closed}: connect: connection refused")),
        "{answer}"
    );
    server.wait_idle().await;
}

#[tokio::test]
async fn an_unresolvable_name_gets_502_no_such_host() {
    let server = server(false).await;
    let _agent = TestAgent::start(&server).await;
    let answer = raw(&server, &connect("no-such-host.invalid:80")).await;
    assert!(
        answer.starts_with("HTTP/1.1 502 Bad Gateway\r\n"),
        "{answer}"
    );
    assert!(answer.contains("no such host"), "{answer}");
}

/// A 100 KB `Host` (and target) never reaches an agent (issue 51): it is
/// answered `400` naming the limit, in a few hundred bytes, not the 200 KB
/// of an agent that echoes the destination twice (how an agent's echo of
/// a long host is cut: `head`'s unit tests).
#[tokio::test]
async fn an_error_answer_repeats_no_more_than_a_prefix_of_a_huge_host() {
    let server = server(false).await;
    let agent = TestAgent::start(&server).await;
    let host = format!("{}.invalid", "h".repeat(100_000));
    let request = format!("CONNECT {host}:80 HTTP/1.1\r\nHost: {host}:80\r\n\r\n");
    let answer = raw(&server, request.as_bytes()).await;
    assert!(
        answer.starts_with("HTTP/1.1 400 Bad Request\r\n"),
        "{}",
        &answer[..answer.len().min(512)]
    );
    assert!(answer.len() < 512, "a {}-byte answer", answer.len());
    assert!(
        answer.ends_with("(100011 bytes) is longer than a host name and port can be (259 bytes)"),
        "{answer}"
    );
    assert_eq!(agent.handle.dials_in_progress(), 0);
}

#[tokio::test]
async fn a_dial_past_backend_dial_timeout_gets_504() {
    let server = TestServer::start_with(ServerOpts {
        mode: Mode::HttpConnect,
        backend_dial_timeout: Some(Duration::from_millis(300)),
        ..Default::default()
    })
    .await;
    let agent = TestAgent::start(&server).await;
    let hole = Blackhole::new();
    let answer = raw(&server, &connect(&hole.addr.to_string())).await;
    assert!(
        answer.starts_with("HTTP/1.1 504 Gateway Timeout\r\n"),
        "{answer}"
    );
    assert!(
        answer.ends_with("Backend dial timeout: timed out waiting for backend dial"),
        "{answer}"
    );
    wait_for("the agent's dial to be cancelled", || {
        agent.handle.dials_in_progress() == 0
    })
    .await;
    server.wait_idle().await;
}

#[tokio::test]
async fn an_agent_dial_timeout_gets_504() {
    let server = server(false).await;
    let _agent = TestAgent::start(&server).await;
    let hole = Blackhole::new();
    // The agent gives up after its 5 s dial timeout: "i/o timeout" → 504.
    let answer = raw(&server, &connect(&hole.addr.to_string())).await;
    assert!(
        answer.starts_with("HTTP/1.1 504 Gateway Timeout\r\n"),
        "{answer}"
    );
    assert!(answer.contains("i/o timeout"), "{answer}");
}

#[tokio::test]
async fn a_client_that_leaves_during_a_slow_dial_leaves_nothing_behind() {
    let server = server(false).await;
    let agent = TestAgent::start(&server).await;
    let hole = Blackhole::new();

    let mut io = UnixStream::connect(&server.uds).await.unwrap();
    io.write_all(&connect(&hole.addr.to_string()))
        .await
        .unwrap();
    wait_for("the dial to be pending on server and agent", || {
        server.handle.pending_dials() == 1 && agent.handle.dials_in_progress() == 1
    })
    .await;
    drop(io);
    wait_for("the pending dial to be cancelled everywhere", || {
        server.handle.pending_dials() == 0 && agent.handle.dials_in_progress() == 0
    })
    .await;
    assert_eq!(server.handle.established_connections(), 0);
    assert_eq!(agent.handle.endpoint_connections(), 0);
}

#[tokio::test]
async fn a_server_speaks_first_backend_comes_after_the_200_every_time() {
    const BANNER: &[u8] = b"SSH-2.0-OpenSSH_9.6\r\n";
    let server = server(false).await;
    let _agent = TestAgent::start(&server).await;
    let ssh = destination::banner(BANNER).await;
    let expected: Vec<u8> = [proxy_server::ESTABLISHED, BANNER].concat();
    for round in 0..200 {
        let mut io = UnixStream::connect(&server.uds).await.unwrap();
        io.write_all(&connect(&ssh.address())).await.unwrap();
        let mut got = vec![0u8; expected.len()];
        io.read_exact(&mut got).await.unwrap();
        assert_eq!(got, expected, "round {round}");
    }
    server.wait_idle().await;
}

#[tokio::test]
async fn the_dialer_reports_refusals_with_status_and_body() {
    let server = server(false).await;
    let err = server.dialer().dial("127.0.0.1:1").await.err().unwrap();
    match err {
        ClientError::HttpStatus { status, body, .. } => {
            assert_eq!(status, 500);
            assert_eq!(body, "currently no tunnels available: No agent available");
        }
        other => panic!("unexpected {other:?}"),
    }
}

/// Runs a command off the test's (single) runtime thread, which the server
/// and agent under test need.
async fn output(mut command: Command) -> std::process::Output {
    tokio::task::spawn_blocking(move || {
        command
            .output()
            .expect("running curl (apt-get install curl)")
    })
    .await
    .unwrap()
}

async fn curl_proxy(proxy_port: u16, pki: &Pki, url: &str, out: &Path) -> std::process::Output {
    let mut command = Command::new("curl");
    command
        .args([
            "--silent",
            "--show-error",
            "--max-time",
            "20",
            "--proxytunnel",
            "--proxy",
            &format!("https://127.0.0.1:{proxy_port}"),
            "--proxy-cacert",
        ])
        .arg(Pki::get().path("frontend-ca.crt"))
        .arg("--proxy-cert")
        .arg(pki.path("proxy-client.crt"))
        .arg("--proxy-key")
        .arg(pki.path("proxy-client.key"))
        .arg("--output")
        .arg(out)
        .arg(url);
    output(command).await
}

#[tokio::test]
async fn curl_through_the_tcp_frontend_with_a_client_certificate() {
    const BODY: &[u8] = b"node-side answer through HTTP CONNECT\n";
    let server = server(true).await;
    let _agent = TestAgent::start(&server).await;
    let web = destination::http(BODY).await;
    let port = server.frontend_tcp.unwrap().port();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("body");
    let url = format!("http://{}/", web.address());

    let run = curl_proxy(port, Pki::get(), &url, &out).await;
    assert!(
        run.status.success(),
        "curl failed: {}",
        String::from_utf8_lossy(&run.stderr)
    );
    assert_eq!(std::fs::read(&out).unwrap(), BODY);

    // A client certificate from another CA is refused.
    let _ = std::fs::remove_file(&out);
    let run = curl_proxy(port, Pki::other(), &url, &out).await;
    assert!(
        !run.status.success(),
        "a foreign client certificate was accepted"
    );
    assert!(!out.exists() || std::fs::read(&out).unwrap() != BODY);

    // No client certificate at all is refused.
    let mut command = Command::new("curl");
    command
        .args([
            "--silent",
            "--show-error",
            "--max-time",
            "20",
            "--proxytunnel",
            "--proxy",
        ])
        .arg(format!("https://127.0.0.1:{port}"))
        .arg("--proxy-cacert")
        .arg(Pki::get().path("frontend-ca.crt"))
        .arg(&url);
    let run = output(command).await;
    assert!(
        !run.status.success(),
        "a client without a certificate was accepted"
    );
    assert!(!String::from_utf8_lossy(&run.stdout).contains("node-side answer"));
}
