//! `--max-http-connections` caps the frontend connections open at once in
//! both modes: past it a gRPC connection is closed at once and a CONNECT
//! client gets a 503; each refusal is counted; a place is free again once
//! a connection ends. The connections held are raw sockets, so that
//! nothing but the cap decides.

use std::time::Duration;

use integration_tests::process::ServerProcess;
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::UnixStream,
};

const REFUSED: &str = "konnectivity_rs_server_limit_reached_total{limit=\"http_connections\"}";
/// Longest wait for the server's answer to a new connection.
const ANSWER: Duration = Duration::from_secs(10);
/// The client preface and an empty SETTINGS frame.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0";

/// What the server first sends on a new connection after `hello`: its
/// first bytes, or an empty vector if it closed the connection.
async fn first_answer(server: &ServerProcess, hello: &[u8]) -> (UnixStream, Vec<u8>) {
    let mut socket = UnixStream::connect(&server.uds).await.unwrap();
    // A refused connection may be closed before the hello is written.
    let _ = socket.write_all(hello).await;
    let mut buf = vec![0u8; 512];
    let n = tokio::time::timeout(ANSWER, socket.read(&mut buf))
        .await
        .expect("the server answers or closes a new connection")
        .unwrap_or(0);
    buf.truncate(n);
    (socket, buf)
}

/// Whether `answer` is the start of what a served connection gets: on
/// gRPC, a SETTINGS frame's header (type 4); on CONNECT, the 405 a request
/// other than CONNECT gets (no agent needed).
fn served(mode: &str, answer: &[u8]) -> bool {
    match mode {
        "grpc" => answer.len() >= 9 && answer[3] == 4,
        _ => answer.starts_with(b"HTTP/1.1 405"),
    }
}

async fn capped(mode: &str) {
    let server = ServerProcess::start(mode, &["--max-http-connections=2".to_owned()]).await;
    let hello: &[u8] = if mode == "grpc" {
        H2_PREFACE
    } else {
        b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    };
    // Two connections that send nothing hold both places (the server
    // admits connections in the order they came).
    let mut held = vec![
        UnixStream::connect(&server.uds).await.unwrap(),
        UnixStream::connect(&server.uds).await.unwrap(),
    ];
    let (_third, answer) = first_answer(&server, hello).await;
    if mode == "grpc" {
        assert!(
            answer.is_empty(),
            "{mode}: the third connection is closed: {answer:?}"
        );
    } else {
        assert!(
            answer.starts_with(b"HTTP/1.1 503"),
            "{mode}: the third connection gets a 503: {}",
            String::from_utf8_lossy(&answer)
        );
    }
    assert_eq!(server.metric(REFUSED).await, 1.0, "{mode}");
    // A connection ends: its place is free again (once the server has seen
    // the end, which it does on its own time).
    drop(held.pop());
    let deadline = tokio::time::Instant::now() + ANSWER;
    loop {
        let (_socket, answer) = first_answer(&server, hello).await;
        if served(mode, &answer) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{mode}: no place freed after a connection ended: {answer:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn grpc_connections_past_the_cap_are_closed_and_counted() {
    capped("grpc").await;
}

#[tokio::test]
async fn connect_clients_past_the_cap_get_503_and_are_counted() {
    capped("http-connect").await;
}
