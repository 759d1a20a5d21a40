//! Raw HTTP/1.1 to the health and admin ports.

use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use crate::DEADLINE;

/// A plain HTTP/1.1 GET; returns the status code and the body.
pub async fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    let answer = http_request(addr, "GET", path, "test", "").await;
    (answer.status, answer.text())
}

/// An HTTP/1.1 answer read off the wire.
#[derive(Debug, Clone)]
pub struct HttpAnswer {
    /// Status code.
    pub status: u16,
    /// Header values by lower-cased name (the last one wins).
    pub headers: std::collections::BTreeMap<String, String>,
    /// The body as sent (not de-chunked).
    pub body: Vec<u8>,
}

impl HttpAnswer {
    /// The body as text (lossily decoded).
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// Sends `method target` with `Host: host` and `Connection: close` (plus
/// `extra` header lines, each ending in CRLF) and reads the whole answer.
pub async fn http_request(
    addr: SocketAddr,
    method: &str,
    target: &str,
    host: &str,
    extra: &str,
) -> HttpAnswer {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr)
        .await
        .expect("connecting");
    stream
        .write_all(
            format!(
                "{method} {target} HTTP/1.1\r\nHost: {host}\r\n{extra}Connection: close\r\n\r\n"
            )
            .as_bytes(),
        )
        .await
        .expect("writing the request");
    let mut raw = Vec::new();
    stream
        .read_to_end(&mut raw)
        .await
        .expect("reading the response");
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a response head");
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|s| s.parse().ok())
        .expect("a status line");
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    HttpAnswer {
        status,
        headers,
        body: raw[split + 4..].to_vec(),
    }
}

/// Polls `GET path` on `addr` until it answers `status` and returns that
/// body; panics after [`DEADLINE`] with the last answer.
pub async fn wait_for_status(addr: SocketAddr, path: &str, status: u16) -> String {
    let start = Instant::now();
    loop {
        let (got, body) = http_get(addr, path).await;
        if got == status {
            return body;
        }
        assert!(
            start.elapsed() < DEADLINE,
            "{path} on {addr} still answers {got} {body:?}, not {status}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
