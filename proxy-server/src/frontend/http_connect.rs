//! The HTTP-CONNECT frontend (`--mode=http-connect`): one
//! `CONNECT host:port HTTP/1.1` per client connection, answered with exactly
//! `HTTP/1.1 200 Connection Established\r\n\r\n` once the agent has dialed,
//! then raw bytes both ways; errors are answered with ANP's statuses and
//! bodies.
//!
//! Unlike ANP, the client socket is watched while the dial is pending: a
//! client that hangs up cancels its dial (DIAL_CLS to the agent) instead of
//! leaving it behind (#789, #855). Bytes the client sends after its request
//! header, before or during the dial, are forwarded once connected.

use std::{sync::Arc, time::Duration};

use bytes::BytesMut;
use proto::{Packet, packet::PacketKind};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio_util::sync::CancellationToken;
use tracing::debug;
use tunnel::blocked::when_blocked;
use tunnel::{
    ids::{ConnId, DialId},
    mover::{self, MoverEnd},
    queue::QueueRx,
};

use crate::{
    frontend::FrontendGuard,
    hub::{Hub, Work},
    link::{ConnFlow, FrontendItem, FrontendLink, StreamEnd, frontend_queue},
    metrics::PROXY,
    router::{AGENT_STREAM_CLOSED, DIAL_TIMED_OUT, FrontendId, FrontendKind, NO_AGENT},
};

/// Largest request header accepted (Go's `http.DefaultMaxHeaderBytes`).
pub(crate) const MAX_HEADER_BYTES: usize = 1 << 20;
/// How long a client may take to send its request header (ANP's
/// `ReadHeaderTimeout`).
pub(crate) const READ_HEADER_TIMEOUT: Duration = Duration::from_secs(60);
/// Bytes buffered from a client while its dial is pending; past this the
/// client is not read until the dial completes.
const EARLY_BYTES: usize = 256 * 1024;
/// How long a client-initiated close waits for the agent's CLOSE_RSP.
const CLOSE_WAIT: Duration = Duration::from_secs(10);

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

/// The answer to a failed dial, as ANP writes each case.
pub(crate) fn dial_error_response(error: &str) -> Vec<u8> {
    if error == NO_AGENT {
        return format!(
            "HTTP/1.1 500 Internal Server Error\r\nContent-Type: text/plain\r\n\r\ncurrently no tunnels available: {NO_AGENT}"
        )
        .into_bytes();
    }
    if error == DIAL_TIMED_OUT {
        return format!(
            "HTTP/1.1 504 Gateway Timeout\r\nConnection: close\r\nContent-Type: text/plain; charset=utf-8\r\n\r\nBackend dial timeout: {DIAL_TIMED_OUT}"
        )
        .into_bytes();
    }
    if error == AGENT_STREAM_CLOSED {
        return format!(
            "HTTP/1.1 502 Bad Gateway\r\nContent-Type: text/plain; charset=utf-8\r\n\r\nFailed to tunnel dial request: {error}\r\n"
        )
        .into_bytes();
    }
    let status = http_status(error);
    format!(
        "HTTP/1.1 {status} {}\r\nConnection: close\r\nContent-Type: text/plain; charset=utf-8\r\n\r\n{error}",
        reason(status)
    )
    .into_bytes()
}

/// A plain error page in the shape of Go's `http.Error`.
fn error_page(status: u16, body: &str) -> Vec<u8> {
    format!(
        "HTTP/1.1 {status} {}\r\nContent-Type: text/plain; charset=utf-8\r\nX-Content-Type-Options: nosniff\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}\n",
        reason(status),
        body.len() + 1
    )
    .into_bytes()
}

/// A parsed request head and the bytes that followed it.
struct Head {
    /// The request method.
    method: String,
    /// The CONNECT target (request-target authority, else the Host header).
    target: String,
    /// Bytes the client sent after the header.
    rest: BytesMut,
}

/// Why a request head could not be read.
enum HeadError {
    /// The client closed or failed before a complete header.
    Gone,
    /// Not HTTP/1.x.
    Malformed,
    /// Larger than [`MAX_HEADER_BYTES`].
    TooLarge,
}

async fn read_head<IO: AsyncRead + Unpin>(io: &mut IO) -> Result<Head, HeadError> {
    let mut buf = BytesMut::with_capacity(4096);
    // Where to resume looking for the blank line, so that a header arriving
    // in small pieces is scanned once, not once per piece.
    let mut scanned = 0;
    let mut request_line = RequestLine::default();
    loop {
        if let Some(i) = find(&buf[scanned..], b"\r\n\r\n") {
            let len = scanned + i + 4;
            return parse_head(buf, len);
        }
        // Refuse what is clearly not HTTP as soon as its first bytes show
        // it, rather than holding the socket until the header timeout.
        if !request_line.plausible(&buf) {
            return Err(HeadError::Malformed);
        }
        scanned = buf.len().saturating_sub(3);
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

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// Parses a complete head (`len` bytes, ending with the blank line).
fn parse_head(buf: BytesMut, len: usize) -> Result<Head, HeadError> {
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let mut request = httparse::Request::new(&mut headers);
    match request.parse(&buf[..len]) {
        Ok(httparse::Status::Complete(_)) => {}
        Err(httparse::Error::TooManyHeaders) => return Err(HeadError::TooLarge),
        Ok(httparse::Status::Partial) | Err(_) => return Err(HeadError::Malformed),
    }
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
    // Keep what followed the header in an allocation of its own size: the
    // header buffer would otherwise stay alive for the whole connection.
    let rest = BytesMut::from(&buf[len..]);
    Ok(Head {
        method,
        target,
        rest,
    })
}

/// Writes a final answer and closes the write side (flushing TLS), within
/// [`FINAL_WRITE_TIMEOUT`]: a client that does not read does not hold the
/// connection.
async fn write_final<IO: AsyncWrite + Unpin>(io: &mut IO, bytes: &[u8]) {
    let _ = tokio::time::timeout(FINAL_WRITE_TIMEOUT, async {
        if io.write_all(bytes).await.is_ok() {
            let _ = io.shutdown().await;
        }
    })
    .await;
}

/// How long a final answer (an error page, the close) may take to write.
const FINAL_WRITE_TIMEOUT: Duration = Duration::from_secs(5);

/// Answers a client over `--max-http-connections` with 503 and closes.
pub(crate) async fn refuse<IO: AsyncWrite + Unpin>(mut io: IO) {
    write_final(
        &mut io,
        &error_page(503, "too many HTTP CONNECT connections open"),
    )
    .await;
}

/// Serves one client connection (UDS or mTLS TCP) until it ends or
/// `shutdown`: every wait of the connection ends with it.
pub(crate) async fn serve_connection<IO>(io: IO, hub: Arc<Hub>, shutdown: CancellationToken)
where
    IO: AsyncRead + AsyncWrite + Unpin,
{
    tokio::select! {
        () = shutdown.cancelled() => {}
        () = serve(io, hub, &shutdown) => {}
    }
}

async fn serve<IO>(mut io: IO, hub: Arc<Hub>, shutdown: &CancellationToken)
where
    IO: AsyncRead + AsyncWrite + Unpin,
{
    let head = match tokio::time::timeout(READ_HEADER_TIMEOUT, read_head(&mut io)).await {
        Err(_) | Ok(Err(HeadError::Gone)) => return,
        Ok(Err(HeadError::Malformed)) => {
            write_final(&mut io, &error_page(400, "malformed HTTP request")).await;
            return;
        }
        Ok(Err(HeadError::TooLarge)) => {
            write_final(&mut io, &error_page(431, "request header too large")).await;
            return;
        }
        Ok(Ok(head)) => head,
    };
    if head.method != "CONNECT" {
        debug!(method = %head.method, "refusing a request that is not CONNECT");
        write_final(
            &mut io,
            &error_page(405, "this proxy only supports CONNECT passthrough"),
        )
        .await;
        return;
    }

    let (tx, mut rx) = frontend_queue();
    let _live = hub.metrics.http_connection();
    let end = StreamEnd::new(shutdown.child_token());
    let metrics = hub.metrics.clone();
    let link = hub.add_frontend(FrontendKind::HttpConnect, |id| {
        FrontendLink::new(id, FrontendKind::HttpConnect, tx, end, metrics)
    });
    let _guard = FrontendGuard {
        hub: hub.clone(),
        link: link.clone(),
    };
    let fe = link.id;
    let random = DialId::random();
    let mut early = head.rest;
    debug!(frontend = %fe, address = %head.target, dial.id = %random, "CONNECT");

    // Dial, while watching the client: a client that leaves cancels the dial.
    let answer = {
        let dial = send(
            &hub,
            fe,
            Packet::dial_request("tcp", &head.target, random.0),
        );
        tokio::pin!(dial);
        let mut dialing = true;
        loop {
            tokio::select! {
                () = &mut dial, if dialing => dialing = false,
                packet = rx.recv() => match packet.map(|item| item.packet.into_kind()) {
                    Some(PacketKind::DialRsp(rsp)) if rsp.random == random.0 => break Ok(rsp),
                    Some(PacketKind::DialCls(_)) => break Err("dial closed by the agent".to_owned()),
                    Some(other) => debug!(packet = ?other, "ignoring packet before DIAL_RSP"),
                    None => break Err(AGENT_STREAM_CLOSED.to_owned()),
                },
                read = io.read_buf(&mut early), if early.len() < EARLY_BYTES => match read {
                    Ok(0) | Err(_) => {
                        debug!(frontend = %fe, "client left while its dial was pending");
                        return;
                    }
                    Ok(_) => {}
                },
            }
        }
    };
    let conn = match answer {
        Ok(rsp) if rsp.error.is_empty() => ConnId(rsp.connect_id),
        Ok(rsp) => {
            write_final(&mut io, &dial_error_response(&rsp.error)).await;
            return;
        }
        Err(error) => {
            write_final(&mut io, &dial_error_response(&error)).await;
            return;
        }
    };
    // The 200 goes out alone, before any tunnel byte.
    if io.write_all(ESTABLISHED).await.is_err() || io.flush().await.is_err() {
        return;
    }
    // The connection's flow state: its bytes go straight to its agent's
    // queue.
    let Some(flow) = hub.route(fe, conn) else {
        return;
    };
    if !early.is_empty() {
        upload(&hub, &flow, early.freeze()).await;
    }
    let ended = tunnel_bytes(&mut io, &hub, &flow, &link, &mut rx).await;
    if let TunnelEnd::ByClient = ended {
        // Ask the agent to close and wait for its answer, so nothing of this
        // connection stays behind.
        send(&hub, fe, Packet::close_request(conn.0)).await;
        let _ = tokio::time::timeout(CLOSE_WAIT, async {
            while let Some(item) = rx.recv().await {
                if matches!(item.taken().into_kind(), PacketKind::CloseRsp(_)) {
                    return;
                }
            }
        })
        .await;
    }
    let _ = tokio::time::timeout(FINAL_WRITE_TIMEOUT, io.shutdown()).await;
}

/// A packet from the client's side, through the hub, with what it waits
/// for (a dial's room on its agent stream).
async fn send(hub: &Hub, fe: FrontendId, packet: Packet) {
    if let Some(work) = hub.frontend_packet(fe, packet) {
        when_blocked(hub.run(work), || hub.metrics.blocked(PROXY)).await;
    }
}

/// Client bytes to the agent: credit and room on the agent stream, counted
/// as a gRPC frontend's reader is while it waits.
async fn upload(hub: &Hub, conn: &Arc<ConnFlow>, data: bytes::Bytes) {
    hub.metrics.bytes("to_agent", data.len());
    let work = Work::SendData {
        conn: conn.clone(),
        data,
    };
    when_blocked(hub.run(work), || hub.metrics.blocked(PROXY)).await;
}

/// Client bytes go to the connection's agent through the hub: credit and
/// room on the agent stream, counted as a gRPC frontend's reader is while
/// it waits.
struct ToAgent<'a> {
    /// The hub.
    hub: &'a Hub,
    /// The connection's flow state (credit, end, its agent's link).
    conn: &'a Arc<ConnFlow>,
}

impl mover::Upstream for ToAgent<'_> {
    async fn send(&mut self, data: bytes::Bytes) -> mover::Sent {
        upload(self.hub, self.conn, data).await;
        if self.conn.closed.is_cancelled() {
            // The connection has left the routing core: the agent closed it
            // (CLOSE_RSP, DIAL_CLS) or its stream is gone, and the close is
            // on the frontend's queue behind the agent's last DATA. Reading
            // the client stops here; the downstream writes those bytes and
            // ends the tunnel at the close (the caller also races the
            // stream's end). Ending here instead would drop them.
            return mover::Sent::Closing;
        }
        mover::Sent::Sent
    }
}

/// The agent's bytes for the client come from the frontend's queue; its
/// CLOSE_RSP (or DIAL_CLS) is the peer's close.
struct FromAgent<'a> {
    /// The connection.
    conn: ConnId,
    /// The frontend's queue.
    rx: &'a mut QueueRx<FrontendItem>,
    /// The item whose bytes are being written.
    writing: Option<FrontendItem>,
    /// The agent's close, once seen.
    closed: &'a mut Option<String>,
}

impl mover::Downstream for FromAgent<'_> {
    async fn next(&mut self) -> Option<bytes::Bytes> {
        while let Some(item) = self.rx.recv().await {
            match &item.packet.payload {
                Some(proto::Payload::Data(data))
                    if data.connect_id == self.conn.0
                        && item.packet.r#type == proto::PacketType::Data as i32 =>
                {
                    let bytes = data.data.clone();
                    self.writing = Some(item);
                    return Some(bytes);
                }
                _ => {}
            }
            match item.packet.into_kind() {
                PacketKind::CloseRsp(rsp) if rsp.connect_id == self.conn.0 => {
                    debug!(conn.id = %self.conn, error = %rsp.error, "closed by the agent side");
                    *self.closed = Some(rsp.error);
                    return None;
                }
                PacketKind::DialCls(_) => {
                    *self.closed = Some("dial closed".to_owned());
                    return None;
                }
                other => debug!(packet = ?other, "ignoring packet"),
            }
        }
        None
    }

    fn written(&mut self) -> bool {
        if let Some(item) = self.writing.take() {
            item.taken();
        }
        true
    }

    fn has_more(&self) -> bool {
        !self.rx.is_empty()
    }
}

/// How a CONNECT tunnel ended.
enum TunnelEnd {
    /// The client closed or failed first: the connection is still open on
    /// the agent.
    ByClient,
    /// The agent closed it (CLOSE_RSP), or the agent stream is gone.
    ByAgent,
    /// The stream was ended from inside (shutdown, a stalled connection).
    FromInside,
}

/// Moves bytes with the byte mover until one side ends.
async fn tunnel_bytes<IO>(
    io: &mut IO,
    hub: &Hub,
    conn: &Arc<ConnFlow>,
    link: &FrontendLink,
    rx: &mut QueueRx<FrontendItem>,
) -> TunnelEnd
where
    IO: AsyncRead + AsyncWrite + Unpin,
{
    let mut closed = None;
    let down = FromAgent {
        conn: conn.id,
        rx,
        writing: None,
        closed: &mut closed,
    };
    let end = tokio::select! {
        end = mover::run(io, ToAgent { hub, conn }, down) => end,
        () = link.end.ended() => return TunnelEnd::FromInside,
    };
    match end {
        MoverEnd::LocalEof | MoverEnd::LocalError(_) => TunnelEnd::ByClient,
        MoverEnd::PeerClosed | MoverEnd::TunnelGone => TunnelEnd::ByAgent,
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::{
        link::BackendLink,
        metrics::ServerMetrics,
        router::AgentInfo,
        strategy::{AgentIdentifiers, ProxyStrategy},
    };

    /// The destination answers and closes at once: its DATA and CLOSE_RSP
    /// reach the frontend's queue, and the connection leaves the tables,
    /// while the client's own bytes are still on their way to the agent.
    /// The upload then finds the connection closed; the client must still
    /// get every byte the agent sent before its close, then the end.
    #[tokio::test]
    async fn the_agents_last_bytes_reach_the_client_when_the_upload_sees_the_close_first() {
        let metrics = Arc::new(ServerMetrics::new(&[ProxyStrategy::Default]));
        let hub = Hub::new(&[ProxyStrategy::Default], None, metrics.clone());
        let (agent_tx, mut agent_rx) = tunnel::queue::queue(1 << 20, 1 << 16);
        let agent = tunnel::ids::AgentId("agent".to_owned());
        let be = hub.add_backend(
            AgentInfo {
                agent_id: agent.clone(),
                identifiers: AgentIdentifiers::default(),
                flow_control: false,
            },
            BackendLink::new(
                agent,
                None,
                agent_tx,
                StreamEnd::new(CancellationToken::new()),
                metrics.clone(),
            ),
        );
        let (tx, mut rx) = frontend_queue();
        let link = hub.add_frontend(FrontendKind::HttpConnect, |id| {
            FrontendLink::new(
                id,
                FrontendKind::HttpConnect,
                tx,
                StreamEnd::new(CancellationToken::new()),
                metrics.clone(),
            )
        });
        send(&hub, link.id, Packet::dial_request("tcp", "10.0.0.1:80", 7)).await;
        assert!(agent_rx.recv().await.is_some(), "the agent gets the dial");
        let _ = hub.backend_packet(be, Packet::dial_response(7, 1, ""));
        assert!(rx.recv().await.is_some(), "the frontend gets DIAL_RSP");
        let flow = hub.route(link.id, ConnId(1)).expect("established");

        let answer = vec![5u8; 1024];
        for packet in [
            Packet::data(1, answer.clone().into()),
            Packet::close_response(1, ""),
        ] {
            if let Some(work) = hub.backend_packet(be, packet) {
                hub.run(work).await;
            }
        }
        assert!(flow.closed.is_cancelled(), "the connection left the tables");

        // The client has sent bytes, and its socket takes 64 bytes at a
        // time: the answer cannot be written before the upload is tried.
        let (mut client, mut ours) = tokio::io::duplex(64);
        client.write_all(b"ping").await.unwrap();
        let tunnel = async {
            let end = tunnel_bytes(&mut ours, &hub, &flow, &link, &mut rx).await;
            let _ = ours.shutdown().await;
            end
        };
        let read = async {
            let mut got = Vec::new();
            client.read_to_end(&mut got).await.unwrap();
            got
        };
        let (end, got) = tokio::time::timeout(Duration::from_secs(10), async {
            tokio::join!(tunnel, read)
        })
        .await
        .expect("the tunnel ends");
        assert!(matches!(end, TunnelEnd::ByAgent));
        assert_eq!(got.len(), answer.len(), "every byte before the close");
        assert_eq!(got, answer);
    }

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
            dial_error_response(NO_AGENT),
            b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: text/plain\r\n\r\ncurrently no tunnels available: No agent available"
        );
        let refused = String::from_utf8(dial_error_response(
            "dial tcp 127.0.0.1:1: connect: connection refused",
        ))
        .unwrap();
        assert!(refused.starts_with("HTTP/1.1 502 Bad Gateway\r\n"));
        assert!(refused.ends_with("\r\n\r\ndial tcp 127.0.0.1:1: connect: connection refused"));
        let timeout = String::from_utf8(dial_error_response(DIAL_TIMED_OUT)).unwrap();
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
