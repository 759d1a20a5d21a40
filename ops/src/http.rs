//! The health and admin HTTP servers of both binaries, served as ANP's Go
//! `http.Server`s with a `ServeMux` are: request headers may take 60 s
//! (`ReadHeaderTimeout`) and 1 MiB (`MaxHeaderBytes`), a route answers every
//! method, an unknown path gets Go's `404 page not found`, and redirects look
//! like `http.Redirect`'s.
//!
//! One difference remains: hyper also runs the header-read timer while a
//! keep-alive connection sits idle between requests, so such a connection is
//! closed after 60 s where Go would keep it; probes reconnect anyway.

use std::{fmt::Write as _, net::SocketAddr, time::Duration};

use axum::{
    Router,
    body::Body,
    http::{HeaderValue, Method, Response, StatusCode, header},
    response::IntoResponse,
};
use futures_util::{Stream, StreamExt};
use hyper_util::{
    rt::{TokioIo, TokioTimer},
    service::TowerToHyperService,
};
use tokio::{
    io::{AsyncRead, AsyncWrite},
    net::TcpStream,
};
use tokio_util::{sync::CancellationToken, task::TaskTracker};
use tracing::debug;

/// How long a client may take to send a request's headers (ANP's
/// `ReadHeaderTimeout`); a slower one is disconnected.
pub const READ_HEADER_TIMEOUT: Duration = Duration::from_secs(60);

/// Request headers ANP's servers accept (`MaxHeaderBytes: 1 << 20`).
pub const MAX_HEADER_BYTES: usize = 1 << 20;

/// What Go really reads before it answers 431: `MaxHeaderBytes` plus 4096
/// bytes of slack (`net/http` `initialReadLimitSize`), request line included.
const HEADER_LIMIT: usize = MAX_HEADER_BYTES + 4096;

/// Go's `http.NotFound` body.
pub const NOT_FOUND_BODY: &str = "404 page not found\n";

/// Serves `router` on the connections `incoming` yields (a listener's
/// accepts, with their peers) until `shutdown` or its end, one task per
/// connection; then lets open connections finish their request and
/// returns. `what` names the listener in logs.
///
/// Paths `router` does not know get Go's 404 ([`not_found`]).
pub async fn serve<S>(
    mut incoming: S,
    router: Router,
    shutdown: CancellationToken,
    what: &'static str,
) where
    S: Stream<Item = (TcpStream, SocketAddr)> + Unpin,
{
    let router = router.fallback(not_found);
    let connections = TaskTracker::new();
    loop {
        let (tcp, peer) = tokio::select! {
            () = shutdown.cancelled() => break,
            accepted = incoming.next() => match accepted {
                Some(accepted) => accepted,
                None => break,
            },
        };
        let router = router.clone();
        let shutdown = shutdown.clone();
        connections.spawn(async move {
            if let Err(error) = serve_connection(tcp, router, shutdown).await {
                debug!(%error, peer.addr = %peer, listener = what, "http connection ended with an error");
            }
        });
    }
    drop(incoming);
    connections.close();
    connections.wait().await;
}

/// Serves one HTTP/1 connection with ANP's limits until the client leaves
/// or, after `shutdown`, its current request is answered.
///
/// # Errors
/// The connection failed: I/O, a malformed request, headers too slow (after
/// [`READ_HEADER_TIMEOUT`]) or too large (answered 431 first).
pub async fn serve_connection<IO>(
    io: IO,
    router: Router,
    shutdown: CancellationToken,
) -> Result<(), hyper::Error>
where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let connection = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(READ_HEADER_TIMEOUT)
        .max_header_size(HEADER_LIMIT)
        // The read buffer must hold a whole head; the head limit is the one that applies.
        .max_buf_size(HEADER_LIMIT + 8192)
        .serve_connection(TokioIo::new(io), TowerToHyperService::new(router));
    tokio::pin!(connection);
    tokio::select! {
        result = connection.as_mut() => return result,
        () = shutdown.cancelled() => connection.as_mut().graceful_shutdown(),
    }
    connection.await
}

/// Go's `http.NotFound`, for any method.
pub async fn not_found() -> Response<Body> {
    go_text(StatusCode::NOT_FOUND, NOT_FOUND_BODY)
}

/// A plain-text answer with the headers Go's `http.Error` sets.
fn go_text(status: StatusCode, body: &'static str) -> Response<Body> {
    (
        status,
        [
            (header::CONTENT_TYPE, "text/plain; charset=utf-8"),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        ],
        body,
    )
        .into_response()
}

/// Go's `http.Redirect(w, r, url, status)` for a `url` that is absolute,
/// `//host/…` or an already clean absolute path: `Location` (non-ASCII
/// bytes %-escaped), and for GET/HEAD `Content-Type: text/html;
/// charset=utf-8`, for GET the body `<a href="…">Status Text</a>.` and two
/// newlines.
pub fn redirect(method: &Method, url: &str, status: StatusCode) -> Response<Body> {
    let mut response = Response::new(Body::empty());
    *response.status_mut() = status;
    let location = HeaderValue::from_str(&hex_escape_non_ascii(url))
        .unwrap_or_else(|_| HeaderValue::from_static("/"));
    response.headers_mut().insert(header::LOCATION, location);
    if method == Method::GET || method == Method::HEAD {
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/html; charset=utf-8"),
        );
    }
    if method == Method::GET {
        let text = status.canonical_reason().unwrap_or_default();
        *response.body_mut() =
            Body::from(format!("<a href=\"{}\">{text}</a>.\n\n", html_escape(url)));
    }
    response
}

/// Go's `hexEscapeNonASCII`, plus the control bytes a header value cannot
/// hold (never in a URL hyper parsed).
fn hex_escape_non_ascii(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for byte in text.bytes() {
        if !(0x20..0x7f).contains(&byte) {
            let _ = write!(out, "%{byte:02X}");
        } else {
            out.push(char::from(byte));
        }
    }
    out
}

/// Go's `htmlEscape` (`html.EscapeString` without the quote forms it lacks).
fn html_escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&#34;"),
            '\'' => out.push_str("&#39;"),
            other => out.push(other),
        }
    }
    out
}

/// The host of `host:port` as Go's `net.SplitHostPort` finds it (brackets
/// removed), or `None` where Go reports an error (no port, stray colons or
/// brackets).
pub fn split_host(hostport: &str) -> Option<&str> {
    let last_colon = hostport.rfind(':')?;
    let (host, after_host) = if hostport.starts_with('[') {
        let end = hostport.find(']')?;
        if end + 1 != last_colon {
            return None;
        }
        (&hostport[1..end], end + 1)
    } else {
        let host = &hostport[..last_colon];
        if host.contains(':') {
            return None;
        }
        (host, 0)
    };
    let brackets_ok = !hostport[usize::from(hostport.starts_with('['))..].contains('[')
        && !hostport[after_host..].contains(']');
    brackets_ok.then_some(host)
}

/// Go's `net.JoinHostPort`: IPv6 hosts (anything with a colon) in brackets.
pub fn join_host_port(host: &str, port: u16) -> String {
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

#[cfg(test)]
mod tests {
    use axum::routing::any;
    use http_body_util::BodyExt;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    fn app() -> Router {
        Router::new()
            .route("/healthz", any(|| async { "ok" }))
            .fallback(not_found)
    }

    /// Sends `request` on a fresh in-memory connection and returns the raw answer.
    async fn exchange(request: &[u8]) -> String {
        let (mut client, server) = tokio::io::duplex(64 * 1024);
        let task = tokio::spawn(serve_connection(server, app(), CancellationToken::new()));
        // A server that answers 431 stops reading; the broken pipe is expected.
        let _ = client.write_all(request).await;
        let mut raw = Vec::new();
        let _ = client.read_to_end(&mut raw).await;
        let _ = task.await;
        String::from_utf8_lossy(&raw).into_owned()
    }

    fn request_with_header_of(bytes: usize) -> Vec<u8> {
        format!(
            "GET /healthz HTTP/1.1\r\nHost: a\r\nConnection: close\r\nX-Big: {}\r\n\r\n",
            "x".repeat(bytes)
        )
        .into_bytes()
    }

    #[tokio::test]
    async fn headers_up_to_a_mebibyte_are_read_more_get_431() {
        // hyper's default limit (~400 KiB) refuses this one; Go and we do not.
        let answer = exchange(&request_with_header_of(MAX_HEADER_BYTES - 1024)).await;
        assert!(answer.starts_with("HTTP/1.1 200 OK\r\n"), "{answer:.200}");
        assert!(answer.ends_with("\r\n\r\nok"), "{answer:.200}");
        let answer = exchange(&request_with_header_of(HEADER_LIMIT)).await;
        assert!(
            answer.starts_with("HTTP/1.1 431 Request Header Fields Too Large\r\n"),
            "{answer:.200}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn headers_slower_than_60_seconds_are_cut_off() {
        let (mut client, server) = tokio::io::duplex(64 * 1024);
        let task = tokio::spawn(serve_connection(server, app(), CancellationToken::new()));
        client
            .write_all(b"GET /healthz HTTP/1.1\r\nHost: a\r\n")
            .await
            .unwrap();
        let started = tokio::time::Instant::now();
        let mut buf = [0u8; 64];
        // Still open just before the limit…
        assert!(
            tokio::time::timeout(
                READ_HEADER_TIMEOUT - Duration::from_millis(100),
                client.read(&mut buf)
            )
            .await
            .is_err()
        );
        // …closed without an answer at it.
        let read = tokio::time::timeout(Duration::from_secs(1), client.read(&mut buf))
            .await
            .expect("the connection should be closed at 60 s");
        assert_eq!(read.unwrap(), 0);
        assert!(started.elapsed() >= READ_HEADER_TIMEOUT);
        assert!(task.await.unwrap().is_err(), "a header timeout is an error");
    }

    #[tokio::test]
    async fn any_method_is_served_and_unknown_paths_get_gos_404() {
        for method in ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"] {
            let answer = exchange(
                format!("{method} /healthz HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
                    .as_bytes(),
            )
            .await;
            assert!(
                answer.starts_with("HTTP/1.1 200 OK\r\n"),
                "{method}: {answer}"
            );
        }
        let answer = exchange(b"POST /nope HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n").await;
        assert!(answer.starts_with("HTTP/1.1 404 Not Found\r\n"), "{answer}");
        assert!(
            answer.contains("content-type: text/plain; charset=utf-8\r\n"),
            "{answer}"
        );
        assert!(answer.contains("x-content-type-options: nosniff\r\n"));
        assert!(answer.ends_with("\r\n\r\n404 page not found\n"), "{answer}");
    }

    async fn body(response: Response<Body>) -> String {
        String::from_utf8(
            response
                .into_body()
                .collect()
                .await
                .unwrap()
                .to_bytes()
                .to_vec(),
        )
        .unwrap()
    }

    #[tokio::test]
    async fn redirects_are_gos() {
        let url = "//h\u{e9}:8093/metrics?a=1&b='<x>\"";
        let response = redirect(&Method::GET, url, StatusCode::MOVED_PERMANENTLY);
        assert_eq!(response.status(), StatusCode::MOVED_PERMANENTLY);
        assert_eq!(
            response.headers()[header::LOCATION],
            "//h%C3%A9:8093/metrics?a=1&b='<x>\""
        );
        assert_eq!(
            response.headers()[header::CONTENT_TYPE],
            "text/html; charset=utf-8"
        );
        assert_eq!(
            body(response).await,
            "<a href=\"//h\u{e9}:8093/metrics?a=1&amp;b=&#39;&lt;x&gt;&#34;\">Moved Permanently</a>.\n\n"
        );

        let head = redirect(&Method::HEAD, "/x", StatusCode::MOVED_PERMANENTLY);
        assert_eq!(
            head.headers()[header::CONTENT_TYPE],
            "text/html; charset=utf-8"
        );
        assert_eq!(body(head).await, "");
        let post = redirect(&Method::POST, "/x", StatusCode::MOVED_PERMANENTLY);
        assert!(post.headers().get(header::CONTENT_TYPE).is_none());
        assert_eq!(post.headers()[header::LOCATION], "/x");
        assert_eq!(body(post).await, "");
    }

    #[test]
    fn host_split_and_join_as_go() {
        for (hostport, host) in [
            ("localhost:8094", Some("localhost")),
            ("10.0.0.1:1", Some("10.0.0.1")),
            ("[::1]:8094", Some("::1")),
            ("host:", Some("host")),
            ("localhost", None),
            ("", None),
            ("::1", None),
            ("[::1]", None),
            ("[::1]x:1", None),
            ("a]:1", None),
            ("[a[b]:1", None),
        ] {
            assert_eq!(split_host(hostport), host, "{hostport:?}");
        }
        assert_eq!(join_host_port("localhost", 1), "localhost:1");
        assert_eq!(join_host_port("::1", 2), "[::1]:2");
        assert_eq!(join_host_port("", 3), ":3");
    }
}
