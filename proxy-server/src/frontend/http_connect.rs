//! The HTTP-CONNECT frontend (`--mode=http-connect`): one
//! `CONNECT host:port HTTP/1.1` per client connection, answered with exactly
//! `HTTP/1.1 200 Connection Established\r\n\r\n` once the agent has dialed,
//! then raw bytes both ways; errors are answered with ANP's statuses and
//! bodies ([`head`]).
//!
//! Unlike ANP, the client socket is watched while the dial is pending: a
//! client that hangs up cancels its dial (DIAL_CLS to the agent) instead of
//! leaving it behind (#789, #855). Bytes the client sends after its request
//! header, before or during the dial, are forwarded once connected.
//!
//! Once connected, the connection's task is its driver: it runs the byte
//! mover between the client's socket and the connection ([`Conn`]) as the
//! gRPC frontend's driver does with its stream, through the same
//! [`Conn::upload`] and [`FrontendItem::taken`].

pub(crate) mod head;

use std::{sync::Arc, time::Duration};

use bytes::{Bytes, BytesMut};
use proto::{Packet, packet::PacketKind};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio_util::sync::CancellationToken;
use tracing::debug;
use tunnel::{
    blocked::when_blocked,
    ids::{ConnId, DialId},
    mover::{self, MoverEnd},
    queue::QueueRx,
};

pub use self::head::ESTABLISHED;
use self::head::{
    FINAL_WRITE_TIMEOUT, HeadError, READ_HEADER_TIMEOUT, dial_error_response, error_page,
    read_head, write_final,
};
use crate::{
    conn::{Conn, FrontendItem, FrontendLink, FrontendTx, frontend_queue},
    control::Control,
    events::DialError,
    frontend::{FrontendGuard, FrontendSocket},
    metrics::Method,
    router::FrontendKind,
    stream::StreamEnd,
    traces::FrontendPeer,
};

/// Bytes buffered from a client while its dial is pending; past this the
/// client is not read until the dial completes.
const EARLY_BYTES: usize = 256 * 1024;
/// How long a client-initiated close waits for the agent's CLOSE_RSP.
const CLOSE_WAIT: Duration = Duration::from_secs(10);

/// Answers a client over `--max-http-connections` with 503 and closes.
pub(crate) async fn refuse<IO: AsyncWrite + Unpin>(mut io: IO) {
    write_final(
        &mut io,
        &error_page(503, "too many HTTP CONNECT connections open"),
    )
    .await;
}

/// Serves one client connection (UDS or mTLS TCP) until it ends or
/// `shutdown`: every wait of the connection ends with it. `held` (the
/// connection's place under `--max-http-connections`) is dropped at its end.
///
/// Not an `async fn`: one would keep its socket three times over in its
/// future (the argument, a copy made when it starts, the `mut` binding),
/// as rustc lays such futures out; an `async move` block keeps it once.
pub(crate) fn serve_connection<IO, H>(
    io: IO,
    control: Arc<Control>,
    shutdown: CancellationToken,
    held: H,
) -> impl Future<Output = ()> + Send + 'static
where
    IO: AsyncRead + AsyncWrite + Unpin + FrontendSocket + Send + 'static,
    H: Send + 'static,
{
    let (peer, subject) = io.peer();
    let peer = FrontendPeer {
        kind: FrontendKind::HttpConnect,
        peer,
        subject,
    };
    let mut io = io;
    async move {
        let broken = tokio::select! {
            () = shutdown.cancelled() => true,
            broken = serve(&mut io, control, peer, &shutdown) => broken,
        };
        if broken {
            // A tunnel that ends without its destination's close: the
            // client gets a reset, never an end of file that reads as a
            // whole answer.
            io.reset_on_close();
        }
        drop(held);
    }
}

/// The request head, or the error answered for it (`None`).
async fn request<IO: AsyncRead + AsyncWrite + Unpin>(io: &mut IO) -> Option<head::Head> {
    let page = match tokio::time::timeout(READ_HEADER_TIMEOUT, read_head(io)).await {
        Err(_) | Ok(Err(HeadError::Gone)) => return None,
        Ok(Err(HeadError::Malformed)) => error_page(400, "malformed HTTP request"),
        Ok(Err(HeadError::TooLarge)) => error_page(431, "request header too large"),
        Ok(Ok(head)) if head.method == "CONNECT" => return Some(head),
        Ok(Ok(head)) => {
            debug!(method = %proto::text::Elided(&head.method), "refusing a request that is not CONNECT");
            error_page(405, "this proxy only supports CONNECT passthrough")
        }
    };
    write_final(io, &page).await;
    None
}

/// Serves one client connection; `true` if its tunnel broke (see
/// [`TunnelEnd::Broken`]), for the caller to reset the socket.
async fn serve<IO>(
    io: &mut IO,
    control: Arc<Control>,
    peer: FrontendPeer,
    shutdown: &CancellationToken,
) -> bool
where
    IO: AsyncRead + AsyncWrite + Unpin,
{
    let Some(head) = request(io).await else {
        return false;
    };
    let (tx, mut rx) = frontend_queue();
    let metrics = control.metrics.clone();
    let _live = metrics.http_connection();
    let end = StreamEnd::new(shutdown.child_token());
    let budget = control.budgets.to_frontend.clone();
    let link = control.add_frontend(FrontendKind::HttpConnect, |id| {
        FrontendTx::new(id, FrontendKind::HttpConnect, tx, end, metrics, budget)
    });
    let _guard = FrontendGuard {
        control: control.clone(),
        link: link.clone(),
    };
    control.frontend_traced(link.id(), head.traceparent.as_deref(), peer);
    let mut early = head.rest;
    let target = head.target;
    let Some(answer) = dial(io, &control, &link, &mut rx, &target, &mut early).await else {
        return false;
    };
    let id = match answer {
        Ok(id) => id,
        Err(error) => {
            write_final(io, &dial_error_response(&error, &target)).await;
            return false;
        }
    };
    // The 200 goes out alone, before any tunnel byte.
    if io.write_all(ESTABLISHED).await.is_err() || io.flush().await.is_err() {
        return false;
    }
    // The connection, handed over before its DIAL_RSP was queued.
    let Some(conn) = link.attachments.take().into_iter().find(|c| c.id == id) else {
        return true;
    };
    if !early.is_empty() {
        upload(&conn, &control, early.freeze()).await;
    }
    let tunnel = tunnel_bytes(io, &control, &conn, &link, &mut rx);
    let audit = control.audit.clone();
    match tunnel::sync::audit::scope(audit, link.id().taker(), tunnel).await {
        TunnelEnd::ByClient => close(&control, &link, &mut rx, id).await,
        TunnelEnd::ByAgent => {}
        TunnelEnd::Broken | TunnelEnd::FromInside => return true,
    }
    let _ = tokio::time::timeout(FINAL_WRITE_TIMEOUT, io.shutdown()).await;
    false
}

/// Dials `target` and waits for the answer, while reading what the client
/// sends meanwhile into `early`; `None` if the client left (the dial is
/// then cancelled by the frontend's end).
async fn dial<IO: AsyncRead + Unpin>(
    io: &mut IO,
    control: &Control,
    link: &FrontendLink,
    rx: &mut QueueRx<FrontendItem>,
    target: &str,
    early: &mut BytesMut,
) -> Option<Result<ConnId, DialError>> {
    let random = DialId::random();
    debug!(frontend = %link.id(), address = %proto::text::Elided(target), dial.id = %random, "CONNECT");
    let send = send(control, link, Packet::dial_request("tcp", target, random.0));
    tokio::pin!(send);
    let mut sending = true;
    loop {
        tokio::select! {
            () = &mut send, if sending => sending = false,
            item = rx.recv() => match item {
                Some(FrontendItem::DialFailed { dial, error }) if dial == random => return Some(Err(error)),
                Some(FrontendItem::Packet(packet) | FrontendItem::Answered { packet, .. }) => match packet.into_kind() {
                    PacketKind::DialRsp(rsp) if rsp.random == random.0 => {
                        return Some(Ok(ConnId(rsp.connect_id)));
                    }
                    PacketKind::DialCls(_) => return Some(Err(DialError::ClosedByAgent)),
                    other => debug!(packet = ?other, "ignoring packet before DIAL_RSP"),
                },
                Some(_) => debug!("ignoring an item before DIAL_RSP"),
                None => return Some(Err(DialError::AgentStreamClosed)),
            },
            read = io.read_buf(early), if early.len() < EARLY_BYTES => match read {
                Ok(0) | Err(_) => {
                    debug!(frontend = %link.id(), "client left while its dial was pending");
                    return None;
                }
                Ok(_) => {}
            },
        }
    }
}

/// A control packet from the client's side, with what it waits for (a
/// dial's room on its agent stream).
async fn send(control: &Control, link: &FrontendLink, packet: Packet) {
    for work in control.frontend_packet(link.id(), packet) {
        when_blocked(control.run(work), || control.metrics.blocked(Method::Proxy)).await;
    }
}

/// Client bytes to the agent: credit and room on the agent stream, counted
/// as a gRPC frontend's driver is while it waits.
async fn upload(conn: &Conn, control: &Control, data: Bytes) {
    when_blocked(conn.upload(data), || control.metrics.blocked(Method::Proxy)).await;
}

/// Asks the agent to close and waits for its answer (bounded), so nothing
/// of this connection stays behind.
async fn close(control: &Control, link: &FrontendLink, rx: &mut QueueRx<FrontendItem>, id: ConnId) {
    send(control, link, Packet::close_request(id.0)).await;
    let _ = tokio::time::timeout(CLOSE_WAIT, async {
        while let Some(item) = rx.recv().await {
            if matches!(item.taken().into_kind(), PacketKind::CloseRsp(_)) {
                return;
            }
        }
    })
    .await;
}

/// Client bytes go to the connection's agent: credit and room on the agent
/// stream.
struct ToAgent<'a> {
    /// The control core, for the blocked-time metrics.
    control: &'a Control,
    /// The connection.
    conn: &'a Conn,
}

impl mover::Upstream for ToAgent<'_> {
    async fn send(&mut self, data: Bytes) -> mover::Sent {
        upload(self.conn, self.control, data).await;
        if self.conn.is_closed() {
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
    /// The end was a failure: a CLOSE_RSP with an error (the agent or its
    /// stream gone, the destination's error), or the queue's end.
    failed: bool,
}

impl mover::Downstream for FromAgent<'_> {
    async fn next(&mut self) -> Option<Bytes> {
        while let Some(item) = self.rx.recv().await {
            let packet = match item {
                FrontendItem::Data {
                    ref packet,
                    ref queued,
                } if queued.conn.id == self.conn => {
                    let Some(proto::Payload::Data(data)) = &packet.payload else {
                        continue;
                    };
                    let bytes = data.data.clone();
                    self.writing = Some(item);
                    return Some(bytes);
                }
                other => other.taken(),
            };
            match packet.into_kind() {
                PacketKind::CloseRsp(rsp) if rsp.connect_id == self.conn.0 => {
                    debug!(conn.id = %self.conn, error = %rsp.error, "closed by the agent side");
                    self.failed = !rsp.error.is_empty();
                    return None;
                }
                PacketKind::DialCls(_) => {
                    self.failed = true;
                    return None;
                }
                other => debug!(packet = ?other, "ignoring packet"),
            }
        }
        self.failed = true;
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

    fn failed(&self) -> bool {
        self.failed
    }
}

/// How a CONNECT tunnel ended.
enum TunnelEnd {
    /// The client closed or failed first: the connection is still open on
    /// the agent.
    ByClient,
    /// The agent closed it cleanly (a CLOSE_RSP without an error): its
    /// destination closed.
    ByAgent,
    /// The connection failed on the agent's side: its agent or agent stream
    /// is gone, or the close carried an error. Every byte the agent sent
    /// was written; the client's socket is reset, not closed.
    Broken,
    /// The stream was ended from inside (shutdown, a stalled connection).
    FromInside,
}

/// Moves bytes with the byte mover until one side ends.
async fn tunnel_bytes<IO>(
    io: &mut IO,
    control: &Control,
    conn: &Conn,
    link: &FrontendLink,
    rx: &mut QueueRx<FrontendItem>,
) -> TunnelEnd
where
    IO: AsyncRead + AsyncWrite + Unpin,
{
    let down = FromAgent {
        conn: conn.id,
        rx,
        writing: None,
        failed: false,
    };
    let end = tokio::select! {
        end = mover::run(io, ToAgent { control, conn }, down) => end,
        () = link.tx.end.ended() => return TunnelEnd::FromInside,
    };
    match end {
        MoverEnd::LocalEof | MoverEnd::LocalError(_) => TunnelEnd::ByClient,
        MoverEnd::PeerClosed => TunnelEnd::ByAgent,
        MoverEnd::PeerFailed | MoverEnd::TunnelGone => TunnelEnd::Broken,
    }
}

#[cfg(test)]
mod tests {
    use tunnel::flow;

    use super::*;
    use crate::{
        conn::BackendLink,
        metrics::ServerMetrics,
        router::AgentInfo,
        strategy::{AgentIdentifiers, ProxyStrategy},
    };

    /// A socket as large as a TLS stream is many times over.
    struct Padded {
        io: tokio::io::DuplexStream,
        _pad: [u8; 16 * 1024],
    }

    impl AsyncRead for Padded {
        fn poll_read(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
            buf: &mut tokio::io::ReadBuf<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            std::pin::Pin::new(&mut self.io).poll_read(cx, buf)
        }
    }

    impl AsyncWrite for Padded {
        fn poll_write(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
            buf: &[u8],
        ) -> std::task::Poll<std::io::Result<usize>> {
            std::pin::Pin::new(&mut self.io).poll_write(cx, buf)
        }

        fn poll_flush(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            std::pin::Pin::new(&mut self.io).poll_flush(cx)
        }

        fn poll_shutdown(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            std::pin::Pin::new(&mut self.io).poll_shutdown(cx)
        }
    }

    impl FrontendSocket for Padded {
        fn peer(&self) -> (String, Option<String>) {
            (String::new(), None)
        }

        fn reset_on_close(&self) {}
    }

    #[test]
    fn a_connections_task_keeps_its_socket_once() {
        let (io, _client) = tokio::io::duplex(64);
        let socket = Padded {
            io,
            _pad: [0; 16 * 1024],
        };
        let socket_size = std::mem::size_of_val(&socket);
        let serving = serve_connection(
            socket,
            crate::fuzzing::streams::control(),
            CancellationToken::new(),
            (),
        );
        // As an `async fn` it kept the socket three times over (a TLS
        // stream is 1,272 bytes: 8,704 for each mTLS CONNECT client).
        let size = std::mem::size_of_val(&serving);
        assert!(
            size < 2 * socket_size,
            "a {socket_size}-byte socket makes a {size}-byte task"
        );
    }

    /// The destination answers and closes at once: its DATA and CLOSE_RSP
    /// reach the frontend's queue, and the connection leaves the tables,
    /// while the client's own bytes are still on their way to the agent.
    /// The upload then finds the connection closed; the client must still
    /// get every byte the agent sent before its close, then the end.
    #[tokio::test]
    async fn the_agents_last_bytes_reach_the_client_when_the_upload_sees_the_close_first() {
        let metrics = Arc::new(ServerMetrics::new(&[ProxyStrategy::Default]));
        let control = Control::new(
            &[ProxyStrategy::Default],
            crate::router::DialPolicy::plain(None),
            metrics.clone(),
            crate::control::Budgets::new(usize::MAX),
        );
        let (agent_tx, mut agent_rx) = tunnel::queue::queue(1 << 20, 1 << 16);
        let agent = tunnel::ids::AgentId("agent".to_owned());
        let be = control.add_backend(
            AgentInfo {
                agent_id: agent.clone(),
                identifiers: AgentIdentifiers::default(),
                credential: None,
            },
            BackendLink::new(
                agent,
                None,
                flow::Scheme::Compat {
                    ours: flow::Window::V1,
                },
                agent_tx,
                StreamEnd::new(CancellationToken::new()),
                metrics.clone(),
            ),
        );
        let (tx, mut rx) = frontend_queue();
        let link = control.add_frontend(FrontendKind::HttpConnect, |id| {
            FrontendTx::new(
                id,
                FrontendKind::HttpConnect,
                tx,
                StreamEnd::new(CancellationToken::new()),
                metrics.clone(),
                control.budgets.to_frontend.clone(),
            )
        });
        send(
            &control,
            &link,
            Packet::dial_request("tcp", "10.0.0.1:80", 7),
        )
        .await;
        assert!(agent_rx.recv().await.is_some(), "the agent gets the dial");
        let conn = control
            .backend_packet(be, Packet::dial_response(7, 1, ""))
            .expect("opened");
        assert!(rx.recv().await.is_some(), "the frontend gets DIAL_RSP");
        assert_eq!(link.attachments.take().len(), 1, "handed over");

        let answer = vec![5u8; 1024];
        assert_eq!(
            conn.deliver(&Bytes::from(answer.clone())),
            crate::conn::Delivery::Queued
        );
        control.backend_packet(be, Packet::close_response(1, ""));
        assert!(conn.is_closed(), "the connection left the tables");

        // The client has sent bytes, and its socket takes 64 bytes at a
        // time: the answer cannot be written before the upload is tried.
        let (mut client, mut ours) = tokio::io::duplex(64);
        client.write_all(b"ping").await.unwrap();
        let tunnel = async {
            let end = tunnel_bytes(&mut ours, &control, &conn, &link, &mut rx).await;
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
}
