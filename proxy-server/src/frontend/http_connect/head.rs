//! The HTTP side of a CONNECT: reading the request head (httparse, ANP's
//! limits), and the answers, byte for byte as ANP writes them.

use std::time::Duration;

use bytes::BytesMut;
use proto::text::elide_echo;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::events::{AGENT_STREAM_CLOSED, DIAL_TIMED_OUT, DialError, NO_AGENT};

/// Largest request header accepted (Go's `http.DefaultMaxHeaderBytes`).
pub(crate) const MAX_HEADER_BYTES: usize = 1 << 20;
/// How long a client may take to send its request header (ANP's
/// `ReadHeaderTimeout`).
pub(crate) const READ_HEADER_TIMEOUT: Duration = Duration::from_secs(60);
/// The success answer, byte for byte as ANP and kube-apiserver expect.
pub const ESTABLISHED: &[u8] = b"HTTP/1.1 200 Connection Established\r\n\r\n";

/// How a dial error becomes an HTTP status (ANP's `mapDialErrorToHTTPStatus`):
/// timeouts 504, file-descriptor exhaustion 503, everything else 502.
pub(crate) fn http_status(error: &str) -> u16 {
    let lower = error.to_ascii_lowercase();
    if ["i/o timeout", "deadline exceeded", "timeout"]
        .iter()
        .any(|s| lower.contains(s))
    {
        504
    } else if lower.contains("too many open files") {
        503
    } else {
        502
    }
}

fn reason(status: u16) -> &'static str {
    match status {
        400 => "Bad Request",
        405 => "Method Not Allowed",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        _ => "Bad Gateway",
    }
}

/// The answer to a failed dial to `target`, as ANP writes each case. The
/// server's own reasons are matched as what they are; only an agent's
/// error text (it came over the wire) is read as text, as ANP's
/// `mapDialErrorToHTTPStatus` does. The client's target is repeated at
/// most as a bounded prefix, wherever an agent echoed it.
pub(crate) fn dial_error_response(error: &DialError, target: &str) -> Vec<u8> {
    let close = "Connection: close\r\nContent-Type: text/plain; charset=utf-8";
    match error {
        DialError::NoAgent => format!(
            "HTTP/1.1 500 Internal Server Error\r\nContent-Type: text/plain\r\n\r\ncurrently no tunnels available: {NO_AGENT}"
        ),
        DialError::TimedOut => format!(
            "HTTP/1.1 504 Gateway Timeout\r\n{close}\r\n\r\nBackend dial timeout: {DIAL_TIMED_OUT}"
        ),
        DialError::AgentStreamClosed => format!(
            "HTTP/1.1 502 Bad Gateway\r\nContent-Type: text/plain; charset=utf-8\r\n\r\nFailed to tunnel dial request: {AGENT_STREAM_CLOSED}\r\n"
        ),
        DialError::AddressTooLong(_) | DialError::ProtocolTooLong(_) => {
            format!("HTTP/1.1 400 Bad Request\r\n{close}\r\n\r\n{error}")
        }
        DialError::AgentsBusy(_) | DialError::TooManyPending(_) => {
            format!("HTTP/1.1 503 Service Unavailable\r\n{close}\r\n\r\n{error}")
        }
        DialError::Agent { text, .. } => {
            let status = http_status(text);
            let host = target.rsplit_once(':').map_or(target, |(host, _)| host);
            let body = elide_echo(text, &[target, host]);
            format!("HTTP/1.1 {status} {}\r\n{close}\r\n\r\n{body}", reason(status))
        }
        other => format!(
            "HTTP/1.1 502 Bad Gateway\r\n{close}\r\n\r\n{}",
            elide_echo(&other.to_string(), &[target])
        ),
    }
    .into_bytes()
}

/// A plain error page in the shape of Go's `http.Error`.
pub(crate) fn error_page(status: u16, body: &str) -> Vec<u8> {
    format!(
        "HTTP/1.1 {status} {}\r\nContent-Type: text/plain; charset=utf-8\r\nX-Content-Type-Options: nosniff\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}\n",
        reason(status),
        body.len() + 1
    )
    .into_bytes()
}

/// A parsed request head and the bytes that followed it.
pub(crate) struct Head {
    /// The request method.
    pub(crate) method: String,
    /// The CONNECT target (request-target authority, else the Host header).
    pub(crate) target: String,
    /// Bytes the client sent after the header.
    pub(crate) rest: BytesMut,
    /// The W3C `traceparent` header (kube-apiserver sends one when its
    /// tracing is on), unchecked; longer values are no trace context and
    /// are not kept.
    pub(crate) traceparent: Option<String>,
}

/// Why a request head could not be read.
pub(crate) enum HeadError {
    /// The client closed or failed before a complete header.
    Gone,
    /// Not HTTP/1.x.
    Malformed,
    /// Larger than [`MAX_HEADER_BYTES`].
    TooLarge,
}

pub(crate) async fn read_head<IO: AsyncRead + Unpin>(io: &mut IO) -> Result<Head, HeadError> {
    let mut buf = BytesMut::with_capacity(4096);
    // Where to resume looking for the blank line, so that a header arriving
    // in small pieces is scanned once, not once per piece.
    let mut scanned = 0;
    let mut request_line = RequestLine::default();
    loop {
        if let Some(end) = head_end(&buf[scanned..]) {
            return parse_head(buf, scanned + end);
        }
        // Refuse what is clearly not HTTP as soon as its first bytes show
        // it, rather than holding the socket until the header timeout.
        if !request_line.plausible(&buf) {
            return Err(HeadError::Malformed);
        }
        // The last two bytes may begin the end ("\n\r").
        scanned = buf.len().saturating_sub(2);
        if buf.len() >= MAX_HEADER_BYTES {
            return Err(HeadError::TooLarge);
        }
        buf.reserve(4096);
        match io.read_buf(&mut buf).await {
            Ok(0) | Err(_) => return Err(HeadError::Gone),
            Ok(_) => {}
        }
    }
}

/// Checks a request head's first line as it arrives.
#[derive(Default)]
struct RequestLine {
    /// The line is complete and was found valid: nothing more to check.
    done: bool,
    /// Buffer length at the last check; the next check waits for twice as
    /// much (or the line's end), so a line sent a byte at a time costs
    /// linear time.
    checked: usize,
}

impl RequestLine {
    /// Whether `head` (what has arrived of a request head) can still be
    /// the start of a valid HTTP/1.x request: its method, target and
    /// version so far (httparse answers `Partial` for a valid prefix).
    fn plausible(&mut self, head: &[u8]) -> bool {
        if self.done || head.is_empty() {
            return true;
        }
        let line_ended = head.contains(&b'\n');
        if !line_ended && head.len() < 2 * self.checked {
            return true;
        }
        self.checked = head.len();
        let mut headers = [httparse::EMPTY_HEADER; 64];
        match httparse::Request::new(&mut headers).parse(head) {
            Ok(_) | Err(httparse::Error::TooManyHeaders) => {
                self.done = line_ended;
                true
            }
            Err(_) => false,
        }
    }
}

/// Where a head in `bytes` ends: past its first empty line, a line end
/// (LF, or CRLF) right after another. Lines may end with LF alone, as
/// httparse and Go's server read them (RFC 9112 §2.2): looking for CRLF
/// CRLF only would take the bytes up to a later one for the head, and
/// lose them.
fn head_end(bytes: &[u8]) -> Option<usize> {
    bytes
        .iter()
        .enumerate()
        .filter(|(_, b)| **b == b'\n')
        .find_map(|(i, _)| match &bytes[i + 1..] {
            [b'\n', ..] => Some(i + 2),
            [b'\r', b'\n', ..] => Some(i + 3),
            _ => None,
        })
}

/// Parses a complete head (`len` bytes, ending with the blank line).
fn parse_head(buf: BytesMut, len: usize) -> Result<Head, HeadError> {
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let mut request = httparse::Request::new(&mut headers);
    // httparse's own end of the head; the same as `len`, found the same way.
    let len = match request.parse(&buf[..len]) {
        Ok(httparse::Status::Complete(parsed)) => parsed,
        Err(httparse::Error::TooManyHeaders) => return Err(HeadError::TooLarge),
        Ok(httparse::Status::Partial) | Err(_) => return Err(HeadError::Malformed),
    };
    let method = request.method.unwrap_or_default().to_owned();
    let mut target = request.path.unwrap_or_default().to_owned();
    if target.is_empty() {
        target = request
            .headers
            .iter()
            .find(|h| h.name.eq_ignore_ascii_case("host"))
            .map(|h| String::from_utf8_lossy(h.value).into_owned())
            .unwrap_or_default();
    }
    let traceparent = request
        .headers
        .iter()
        .find(|h| h.name.eq_ignore_ascii_case("traceparent") && h.value.len() <= TRACEPARENT_MAX)
        .and_then(|h| std::str::from_utf8(h.value).ok())
        .map(str::to_owned);
    // Keep what followed the header in an allocation of its own size: the
    // header buffer would otherwise stay alive for the whole connection.
    let rest = BytesMut::from(&buf[len..]);
    Ok(Head {
        method,
        target,
        rest,
        traceparent,
    })
}

/// The longest `traceparent` kept: version 00's 55 bytes, with room for a
/// later version's additions.
const TRACEPARENT_MAX: usize = 128;

/// Writes a final answer and closes the write side (flushing TLS), within
/// [`FINAL_WRITE_TIMEOUT`]: a client that does not read does not hold the
/// connection.
pub(crate) async fn write_final<IO: AsyncWrite + Unpin>(io: &mut IO, bytes: &[u8]) {
    let _ = tokio::time::timeout(FINAL_WRITE_TIMEOUT, async {
        if io.write_all(bytes).await.is_ok() {
            let _ = io.shutdown().await;
        }
    })
    .await;
}

/// How long a final answer (an error page, the close) may take to write.
pub(crate) const FINAL_WRITE_TIMEOUT: Duration = Duration::from_secs(5);

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// Feeds `input` to [`read_head`] in pieces cut at `cuts`, the client
    /// then closing; returns what it made of it.
    fn read_in_pieces(
        input: &[u8],
        cuts: &[usize],
    ) -> Result<(String, String, Vec<u8>), &'static str> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let (mut client, mut server) = tokio::io::duplex(input.len().max(1));
            let mut pieces = Vec::new();
            let mut start = 0;
            let mut cuts: Vec<usize> = cuts.iter().map(|c| c % (input.len() + 1)).collect();
            cuts.sort_unstable();
            for cut in cuts {
                pieces.push(input[start..cut.max(start)].to_vec());
                start = cut.max(start);
            }
            pieces.push(input[start..].to_vec());
            let writer = tokio::spawn(async move {
                for piece in pieces {
                    if client.write_all(&piece).await.is_err() {
                        return;
                    }
                    tokio::task::yield_now().await;
                }
            });
            let head = read_head(&mut server).await;
            drop(server);
            writer.await.unwrap();
            match head {
                Ok(h) => Ok((h.method, h.target, h.rest.to_vec())),
                Err(HeadError::Gone) => Err("gone"),
                Err(HeadError::Malformed) => Err("malformed"),
                Err(HeadError::TooLarge) => Err("too large"),
            }
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Any bytes, in any pieces: an answer, never a panic.
        #[test]
        fn any_input_gets_an_answer(input in proptest::collection::vec(any::<u8>(), 0..2048),
                                    cuts in proptest::collection::vec(any::<usize>(), 0..8)) {
            let _ = read_in_pieces(&input, &cuts);
        }

        /// A valid CONNECT head, however it is cut, parses the same; what
        /// arrived with it is kept (the rest is read later, as tunnel bytes).
        #[test]
        fn a_valid_head_parses_however_it_arrives(
            host in "[a-z0-9.-]{1,40}",
            port in 1u16..,
            headers in proptest::collection::vec(("[A-Za-z][A-Za-z0-9-]{0,20}", "[ -~]{0,40}"), 0..8),
            rest in proptest::collection::vec(any::<u8>(), 0..64),
            cuts in proptest::collection::vec(any::<usize>(), 0..8),
        ) {
            let target = format!("{host}:{port}");
            let mut input = format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n");
            for (name, value) in &headers {
                input.push_str(&format!("{name}: {}\r\n", value.trim()));
            }
            input.push_str("\r\n");
            let mut input = input.into_bytes();
            input.extend_from_slice(&rest);
            let (method, got_target, kept) = read_in_pieces(&input, &cuts).unwrap();
            prop_assert_eq!(method, "CONNECT");
            prop_assert_eq!(got_target, target);
            prop_assert!(rest.starts_with(&kept), "{:?} is not a prefix of {:?}", kept, rest);
        }

        /// Bytes that cannot start a request are refused, however they
        /// arrive, without waiting for a line end.
        #[test]
        fn a_bad_first_byte_is_refused(first in any::<u8>().prop_filter("not a token byte or a line end",
                                          |b| !(b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~\r\n".contains(b))),
                                       tail in proptest::collection::vec(any::<u8>(), 0..64)) {
            let mut input = vec![first];
            input.extend(tail.iter().filter(|b| **b != b'\n'));
            // The client stays open (a duplex larger than the input): only
            // the bytes can end it.
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            let refused = runtime.block_on(async {
                let (mut client, mut server) = tokio::io::duplex(4096);
                client.write_all(&input).await.unwrap();
                let head = tokio::time::timeout(std::time::Duration::from_secs(5), read_head(&mut server)).await;
                drop(client);
                matches!(head, Ok(Err(HeadError::Malformed)))
            });
            prop_assert!(refused, "{:?} was not refused", input);
        }
    }

    #[test]
    fn dial_errors_map_like_anp() {
        let cases = [
            ("dial tcp 10.0.0.1:443: i/o timeout", 504),
            ("context deadline exceeded", 504),
            ("dial tcp: lookup x: Timeout", 504),
            ("dial tcp: socket: too many open files", 503),
            ("dial tcp 127.0.0.1:1: connect: connection refused", 502),
            ("dial tcp: lookup nope.invalid: no such host", 502),
            ("read: connection reset by peer", 502),
            ("anything else", 502),
        ];
        for (error, status) in cases {
            assert_eq!(http_status(error), status, "{error}");
        }
    }

    #[test]
    fn answers_are_anps_bytes() {
        assert_eq!(
            dial_error_response(&DialError::NoAgent, "10.0.0.1:80"),
            b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: text/plain\r\n\r\ncurrently no tunnels available: No agent available"
        );
        let refused = String::from_utf8(dial_error_response(
            &DialError::Agent {
                text: "dial tcp 127.0.0.1:1: connect: connection refused".to_owned(),
                class: proto::DialErrorClass::Refused,
            },
            "127.0.0.1:1",
        ))
        .unwrap();
        assert!(refused.starts_with("HTTP/1.1 502 Bad Gateway\r\n"));
        assert!(refused.ends_with("\r\n\r\ndial tcp 127.0.0.1:1: connect: connection refused"));
        let timeout =
            String::from_utf8(dial_error_response(&DialError::TimedOut, "10.0.0.1:80")).unwrap();
        assert!(timeout.starts_with("HTTP/1.1 504 Gateway Timeout\r\n"));
        assert!(timeout.ends_with("Backend dial timeout: timed out waiting for backend dial"));
        let page = String::from_utf8(error_page(
            405,
            "this proxy only supports CONNECT passthrough",
        ))
        .unwrap();
        assert!(page.starts_with("HTTP/1.1 405 Method Not Allowed\r\n"));
        assert!(page.ends_with("\r\n\r\nthis proxy only supports CONNECT passthrough\n"));
    }

    #[test]
    fn an_error_reply_repeats_no_more_than_a_prefix_of_the_target() {
        let host = "h".repeat(100_000);
        let target = format!("{host}:80");
        // An agent that echoes the target in full, twice (as ours did).
        let agent = format!("dial tcp {target}: lookup {host}: no such host");
        let error = DialError::Agent {
            text: agent,
            class: proto::DialErrorClass::Unspecified,
        };
        let reply = String::from_utf8(dial_error_response(&error, &target)).unwrap();
        assert!(reply.len() < 2048, "a {}-byte reply", reply.len());
        assert!(reply.starts_with("HTTP/1.1 502 Bad Gateway\r\n"), "{reply}");
        assert!(reply.ends_with(": no such host"), "{reply}");
        let ours = String::from_utf8(dial_error_response(
            &DialError::ConnIdInUse(tunnel::ids::ConnId(3)),
            &target,
        ))
        .unwrap();
        assert!(ours.ends_with("connection id 3 already in use"), "{ours}");
        // A target longer than any host name and port: the client's fault,
        // answered without the target.
        let long = String::from_utf8(dial_error_response(
            &DialError::AddressTooLong(target.len()),
            &target,
        ))
        .unwrap();
        assert!(long.starts_with("HTTP/1.1 400 Bad Request\r\n"), "{long}");
        assert!(long.len() < 256, "{long}");
    }

    #[tokio::test]
    async fn heads_are_parsed_with_what_follows() {
        let (mut client, mut server) = tokio::io::duplex(1024);
        client
            .write_all(b"CONNECT 10.0.0.1:443 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\nearly bytes")
            .await
            .unwrap();
        let head = read_head(&mut server).await.ok().unwrap();
        assert_eq!(head.method, "CONNECT");
        assert_eq!(head.target, "10.0.0.1:443");
        assert_eq!(&head.rest[..], b"early bytes");
    }

    /// Lines may end with LF alone (httparse and Go's server read them
    /// so): the head ends at its first empty line, not at a later CRLF
    /// CRLF, and what follows is kept whole. Before, the bytes up to the
    /// next CRLF CRLF were taken for the head and lost, and a head ending
    /// with LF LF waited for more.
    #[tokio::test]
    async fn a_head_whose_lines_end_with_lf_alone_ends_at_its_empty_line() {
        for (sent, kept) in [
            (
                &b"CONNECT a:1 HTTP/1.1\n\r\nearly\r\n\r\n"[..],
                &b"early\r\n\r\n"[..],
            ),
            (b"CONNECT a:1 HTTP/1.1\nHost: a:1\n\n\r\n\r\n", b"\r\n\r\n"),
            (b"CONNECT a:1 HTTP/1.1\r\nHost: a:1\n\nx", b"x"),
        ] {
            let (mut client, mut server) = tokio::io::duplex(1024);
            // The client stays open: only the bytes end the head.
            client.write_all(sent).await.unwrap();
            let head = tokio::time::timeout(Duration::from_secs(5), read_head(&mut server))
                .await
                .unwrap_or_else(|_| panic!("{sent:?} was held"))
                .ok()
                .unwrap();
            assert_eq!(
                (head.method.as_str(), head.target.as_str()),
                ("CONNECT", "a:1")
            );
            assert_eq!(&head.rest[..], kept, "{sent:?}");
        }
    }

    #[tokio::test]
    async fn garbage_is_refused_from_its_first_bytes_without_a_line_end() {
        for garbage in [
            &b"\x00\x01garbage"[..],
            b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",
            b"CONNECT\x7f",
            b"CONNECT  10.0.0.1:443",
            b"CONNECT 10.0.0.1:443 HTTQ",
            b"C\xc3\xa9 x",
        ] {
            let (mut client, mut server) = tokio::io::duplex(1024);
            // The client keeps its side open: only the bytes can end it.
            client.write_all(garbage).await.unwrap();
            let head =
                tokio::time::timeout(std::time::Duration::from_secs(5), read_head(&mut server))
                    .await
                    .unwrap_or_else(|_| panic!("{garbage:?} was held"));
            assert!(matches!(head, Err(HeadError::Malformed)), "{garbage:?}");
        }
        // A valid head that arrives a byte at a time is not refused.
        let (mut client, mut server) = tokio::io::duplex(1024);
        let reader =
            tokio::spawn(async move { read_head(&mut server).await.ok().map(|h| h.target) });
        for byte in b"CONNECT 10.0.0.1:443 HTTP/1.1\r\nHost: x\r\n\r\n" {
            client.write_all(&[*byte]).await.unwrap();
            tokio::task::yield_now().await;
        }
        assert_eq!(reader.await.unwrap().as_deref(), Some("10.0.0.1:443"));
    }

    #[tokio::test]
    async fn garbage_and_huge_heads_are_refused() {
        let (mut client, mut server) = tokio::io::duplex(1 << 16);
        client
            .write_all(b"\x00\x01\x02 garbage\r\n\r\n")
            .await
            .unwrap();
        assert!(matches!(
            read_head(&mut server).await,
            Err(HeadError::Malformed)
        ));

        let (mut client, mut server) = tokio::io::duplex(1 << 16);
        let writer = tokio::spawn(async move {
            let _ = client.write_all(b"CONNECT a:1 HTTP/1.1\r\nX: ").await;
            let filler = vec![b'a'; 64 * 1024];
            while client.write_all(&filler).await.is_ok() {}
        });
        assert!(matches!(
            read_head(&mut server).await,
            Err(HeadError::TooLarge)
        ));
        drop(server);
        writer.await.unwrap();
    }
}
