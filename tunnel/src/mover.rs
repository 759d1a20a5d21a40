//! The byte mover: one connection's bytes between its socket and the DATA
//! packets of its tunnel, in both directions (linkerd's `duplex`).
//!
//! The socket → DATA half ([`Reader`]) waits for readability with a small
//! buffer (an idle connection holds no large one), then takes what is ready
//! into one read buffer that it reuses from read to read; a payload under
//! half a buffer is copied out to its own size, a larger one leaves with the
//! buffer's memory. Each payload goes to the [`Upstream`], which waits for
//! credit and room: a slow tunnel slows the reader rather than growing a
//! buffer.
//!
//! The DATA → socket half writes what the [`Downstream`] yields, tells it
//! each chunk was written (so it releases the connection's window and
//! returns credit), flushes when nothing more is queued, and once the peer
//! has closed writes everything already queued before it shuts the socket's
//! write side down (drain, then close). The protocol has no half-close:
//! whichever half ends first ends the mover, as in ANP.
//!
//! Users: the agent's node-side connections, the server's HTTP CONNECT
//! clients, the frontend client; the gRPC frontend's writer shares the
//! window and credit accounting (its "socket" is the gRPC stream).

use std::{future::Future, io, sync::Arc};

use bytes::{Bytes, BytesMut};
use futures_util::FutureExt;
use proto::Packet;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::{
    flow::{self, Chunks, Flow, InboundRx},
    ids::ConnId,
    queue::{Closed, QueueTx},
};

/// Largest DATA payload we send (ANP's agent sends 4 KiB, which costs a
/// packet per 4 KiB); within the 4 MiB gRPC limit and a flow window.
pub const READ_CHUNK: usize = flow::MAX_CHUNK;
/// What an idle connection's reader holds while it waits.
const IDLE_READ: usize = 2048;

/// Why a mover stopped.
#[derive(Debug)]
pub enum MoverEnd {
    /// The socket reached end of file: the local side closed.
    LocalEof,
    /// Reading or writing the socket failed.
    LocalError(io::Error),
    /// The peer closed the connection, after every queued byte was written.
    PeerClosed,
    /// The peer's end said the connection failed (an agent gone, an error):
    /// every queued byte was written and flushed, and the socket was not
    /// shut down, so that its owner resets it rather than send a FIN.
    PeerFailed,
    /// The tunnel is gone (its stream ended, or the connection was closed
    /// under the mover).
    TunnelGone,
}

/// What became of a payload given to an [`Upstream`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sent {
    /// It went out; read on.
    Sent,
    /// The tunnel is gone: the connection ends now ([`MoverEnd::TunnelGone`]).
    Gone,
    /// The peer is closing the connection: reading the socket stops, and
    /// the downstream half writes what the peer sent before its close,
    /// then ends the connection.
    Closing,
}

/// Where a connection's socket bytes go: DATA packets towards the peer.
pub trait Upstream: Send {
    /// Sends one payload, waiting for credit and room.
    fn send(&mut self, data: Bytes) -> impl Future<Output = Sent> + Send;
}

/// Where a connection's bytes for the socket come from.
pub trait Downstream: Send {
    /// The next bytes to write; `None` once the peer closed (every byte
    /// queued before the close came first).
    fn next(&mut self) -> impl Future<Output = Option<Bytes>> + Send;
    /// The bytes last returned were written: their window is released (and
    /// credit returned); `false` if the tunnel is gone.
    fn written(&mut self) -> bool;
    /// Whether more bytes are queued right now (if not, the writer flushes).
    fn has_more(&self) -> bool;
    /// Whether the end `next` returned (`None`) was a failure rather than
    /// the peer's clean close ([`MoverEnd::PeerFailed`]).
    fn failed(&self) -> bool {
        false
    }
}

/// Reads a socket into DATA payloads with one reusable buffer.
pub struct Reader<R> {
    /// The socket's read half.
    io: R,
    /// The read buffer, kept between reads while they fill whole chunks
    /// (bulk) and dropped as soon as one does not (the socket was drained).
    buf: BytesMut,
    /// The socket reached end of file after the last payload.
    eof: bool,
}

impl<R: AsyncRead + Unpin> Reader<R> {
    /// A reader of `io` holding no buffer yet.
    pub fn new(io: R) -> Self {
        Self {
            io,
            buf: BytesMut::new(),
            eof: false,
        }
    }

    /// The next payload: waits with a small buffer, then takes whatever
    /// else is ready without waiting. `Ok(None)` is end of file.
    ///
    /// # Errors
    /// The read's.
    ///
    /// # Cancel safety
    /// Cancel safe while waiting: nothing has been read until the first
    /// read returns.
    pub async fn next(&mut self) -> io::Result<Option<Bytes>> {
        if self.eof {
            return Ok(None);
        }
        let mut first = [0u8; IDLE_READ];
        let n = self.io.read(&mut first).await?;
        if n == 0 {
            return Ok(None);
        }
        if n < IDLE_READ {
            // The socket had no more than this: a payload of its own size,
            // and no buffer held while the connection idles.
            self.buf = BytesMut::new();
            return Ok(Some(Bytes::copy_from_slice(&first[..n])));
        }
        // Reuses the buffer when the payloads cut from it are gone.
        self.buf.reserve(READ_CHUNK);
        self.buf.extend_from_slice(&first[..n]);
        while self.buf.len() < READ_CHUNK {
            // `read_buf` is cancel safe: polled once, it either reads or
            // registers for wake-up and is dropped.
            match self.io.read_buf(&mut self.buf).now_or_never() {
                Some(Ok(0)) => {
                    self.eof = true;
                    break;
                }
                Some(Ok(_)) => {}
                Some(Err(e)) => return Err(e),
                None => break,
            }
        }
        let full = self.buf.len() >= READ_CHUNK;
        let payload = seal(self.buf.split());
        if !full {
            // The socket is drained: the connection may now idle, so it
            // keeps no buffer (a bulk transfer fills whole chunks and
            // keeps reusing its one).
            self.buf = BytesMut::new();
        }
        Ok(Some(payload))
    }
}

/// Turns read bytes into a DATA payload that holds no more memory than it
/// carries, give or take half: a payload shorter than half a read buffer
/// is copied out (the buffer is reused or freed), a longer one keeps the
/// buffer without a copy. Queued payloads are then bounded by their bytes.
pub fn seal(chunk: BytesMut) -> Bytes {
    if chunk.len() < READ_CHUNK / 2 {
        Bytes::copy_from_slice(&chunk)
    } else {
        chunk.freeze()
    }
}

/// Moves bytes both ways until one half ends; see the module docs.
///
/// # Cancel safety
/// Dropping the future drops queued bytes and the socket.
pub async fn run<IO, U, D>(io: IO, mut up: U, mut down: D) -> MoverEnd
where
    IO: AsyncRead + AsyncWrite,
    U: Upstream,
    D: Downstream,
{
    let (reader, mut writer) = tokio::io::split(io);
    let mut reader = Reader::new(reader);
    // `None`: the upstream stopped for the peer's close; the end is the
    // downstream's.
    let upstream = async {
        loop {
            let data = match reader.next().await {
                Ok(Some(data)) => data,
                Ok(None) => return Some(MoverEnd::LocalEof),
                Err(e) => return Some(MoverEnd::LocalError(e)),
            };
            match up.send(data).await {
                Sent::Sent => {}
                Sent::Gone => return Some(MoverEnd::TunnelGone),
                Sent::Closing => return None,
            }
        }
    };
    let downstream = async {
        while let Some(data) = down.next().await {
            if let Err(e) = writer.write_all(&data).await {
                return MoverEnd::LocalError(e);
            }
            // TLS may hold written bytes until flushed: flush whenever
            // nothing else is queued behind them.
            if !down.has_more()
                && let Err(e) = writer.flush().await
            {
                return MoverEnd::LocalError(e);
            }
            if !down.written() {
                return MoverEnd::TunnelGone;
            }
        }
        if down.failed() {
            return match writer.flush().await {
                Ok(()) => MoverEnd::PeerFailed,
                Err(e) => MoverEnd::LocalError(e),
            };
        }
        match writer.shutdown().await {
            Ok(()) => MoverEnd::PeerClosed,
            Err(e) => MoverEnd::LocalError(e),
        }
    };
    tokio::pin!(downstream);
    tokio::select! {
        end = upstream => match end {
            Some(end) => end,
            None => downstream.await,
        },
        end = &mut downstream => end,
    }
}

/// DATA packets of connection `conn` on a stream's outbound queue, in
/// pieces of the connection's send chunk, each waiting for the
/// connection's credit when it has some.
pub struct QueueUpstream {
    /// The connection.
    pub conn: ConnId,
    /// The stream's outbound queue.
    pub out: QueueTx<Packet>,
    /// The connection's flow (credit and chunk); `None`: no credit, and
    /// payloads go as read.
    pub flow: Option<Arc<Flow>>,
    /// The DATA packet refused because the stream's queue had closed.
    pub undelivered: Option<Packet>,
}

impl QueueUpstream {
    /// An upstream of `conn`'s DATA onto `out`, within `flow` if given.
    pub fn new(conn: ConnId, out: QueueTx<Packet>, flow: Option<Arc<Flow>>) -> Self {
        Self {
            conn,
            out,
            flow,
            undelivered: None,
        }
    }

    async fn send_one(&mut self, data: Bytes) -> Sent {
        if let Some(flow) = &self.flow
            && flow.take(flow::cost(data.len())).await.is_err()
        {
            // The connection was closed under us: nothing more goes out.
            return Sent::Gone;
        }
        let packet = Packet::data(self.conn.0, data);
        let cost = flow::packet_cost(&packet);
        match self.out.send(packet, cost).await {
            Ok(()) => Sent::Sent,
            Err(Closed(packet)) => {
                self.undelivered = Some(packet);
                Sent::Gone
            }
        }
    }
}

impl Upstream for QueueUpstream {
    async fn send(&mut self, data: Bytes) -> Sent {
        let chunk = self.flow.as_ref().map_or(usize::MAX, |f| f.send_chunk());
        for piece in Chunks::new(data, chunk) {
            let sent = self.send_one(piece).await;
            if sent != Sent::Sent {
                return sent;
            }
        }
        Sent::Sent
    }
}

impl<U: Upstream> Upstream for &mut U {
    fn send(&mut self, data: Bytes) -> impl Future<Output = Sent> + Send {
        (**self).send(data)
    }
}

/// Where a stream's control packets go (a connection's credit among
/// them): queued without waiting, ahead of waiting DATA. One rule on both
/// sides: a control packet that cannot be queued because the peer has
/// stopped reading the stream ends the stream, with an error, so that
/// every connection on it ends visibly at both ends (a connection whose
/// credit was lost would otherwise hang on the peer).
pub trait ControlSink: Send + Sync {
    /// Queues `packet`; `false` if it was not queued (the stream is gone,
    /// or was ended because its peer does not read it).
    fn send_control(&self, packet: Packet) -> bool;
}

/// A connection's receive queue drained into its socket; credit goes back
/// on the stream's outbound queue as the window empties (negotiated only).
pub struct WindowDownstream {
    /// The connection.
    pub conn: ConnId,
    /// Its receive queue.
    pub rx: InboundRx,
    /// Where credit goes; `None` without negotiation.
    pub grants: Option<Arc<dyn ControlSink>>,
    /// Cost of the chunk being written.
    pub pending: usize,
}

impl WindowDownstream {
    /// A downstream of `rx` for `conn`; grants go to `grants` when given.
    pub fn new(conn: ConnId, rx: InboundRx, grants: Option<Arc<dyn ControlSink>>) -> Self {
        Self {
            conn,
            rx,
            grants,
            pending: 0,
        }
    }
}

impl Downstream for WindowDownstream {
    async fn next(&mut self) -> Option<Bytes> {
        let (data, cost) = self.rx.recv().await?;
        self.pending = cost;
        Some(data)
    }

    fn written(&mut self) -> bool {
        let cost = std::mem::take(&mut self.pending);
        let Some(credit) = self.rx.drained(cost) else {
            return true;
        };
        let Some(grants) = &self.grants else {
            return true;
        };
        // A control packet: it never waits. Refused, the stream is gone or
        // was ended because its peer stopped reading it.
        grants.send_control(flow::credit_packet(self.conn.0, credit))
    }

    fn has_more(&self) -> bool {
        !self.rx.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use proto::packet::PacketKind;
    use tokio::io::duplex;

    use super::*;
    use crate::queue;

    /// Control packets pushed onto a queue (the stream's end is not tested
    /// here).
    struct Pushes(QueueTx<Packet>);

    impl ControlSink for Pushes {
        fn send_control(&self, packet: Packet) -> bool {
            let cost = flow::packet_cost(&packet);
            self.0.push(packet, cost).is_ok()
        }
    }

    fn up(out: QueueTx<Packet>, flow: Option<Arc<Flow>>) -> QueueUpstream {
        QueueUpstream::new(ConnId(7), out, flow)
    }

    #[tokio::test]
    async fn socket_bytes_become_data_packets_until_eof() {
        let (mut local, ours) = duplex(1024);
        let (_window, rx) = flow::inbound(None, 16);
        let (out_tx, mut out_rx) = queue::queue(1 << 20, 1 << 20);
        let down = WindowDownstream::new(ConnId(7), rx, None);
        let task = tokio::spawn(run(ours, up(out_tx, None), down));
        local.write_all(b"hello").await.unwrap();
        match out_rx.recv().await.unwrap().into_kind() {
            PacketKind::Data(d) => {
                assert_eq!(d.connect_id, 7);
                assert_eq!(&d.data[..], b"hello");
            }
            other => panic!("unexpected {other:?}"),
        }
        drop(local);
        assert!(matches!(task.await.unwrap(), MoverEnd::LocalEof));
    }

    /// An upstream that learns of the peer's close with its first payload,
    /// and says when it got it.
    struct ClosingAtFirst {
        sends: usize,
        told: Option<tokio::sync::oneshot::Sender<()>>,
    }

    impl Upstream for ClosingAtFirst {
        async fn send(&mut self, _data: Bytes) -> Sent {
            self.sends += 1;
            if let Some(told) = self.told.take() {
                let _ = told.send(());
            }
            Sent::Closing
        }
    }

    #[tokio::test]
    async fn a_closing_upstream_stops_reading_and_the_downstream_ends_the_connection() {
        let (mut local, ours) = duplex(1 << 20);
        let (window, rx) = flow::inbound(None, 16);
        let (told, first_sent) = tokio::sync::oneshot::channel();
        let mut up = ClosingAtFirst {
            sends: 0,
            told: Some(told),
        };
        let task = run(ours, &mut up, WindowDownstream::new(ConnId(7), rx, None));
        let client = async {
            local.write_all(b"first").await.unwrap();
            first_sent.await.unwrap();
            local.write_all(b"more, never read").await.unwrap();
            // The peer's last bytes, then its close.
            window
                .send(Bytes::from_static(b"last words"))
                .await
                .unwrap();
            drop(window);
            let mut got = Vec::new();
            local.read_to_end(&mut got).await.unwrap();
            got
        };
        let (end, got) = tokio::join!(task, client);
        assert!(matches!(end, MoverEnd::PeerClosed), "{end:?}");
        assert_eq!(got, b"last words");
        assert_eq!(up.sends, 1, "reading stopped at the close");
    }

    /// A downstream whose peer failed after `parts`.
    struct FailingAfter(Vec<&'static [u8]>);

    impl Downstream for FailingAfter {
        async fn next(&mut self) -> Option<Bytes> {
            (!self.0.is_empty()).then(|| Bytes::from_static(self.0.remove(0)))
        }

        fn written(&mut self) -> bool {
            true
        }

        fn has_more(&self) -> bool {
            !self.0.is_empty()
        }

        fn failed(&self) -> bool {
            true
        }
    }

    #[tokio::test]
    async fn a_failed_peer_end_writes_every_byte_and_leaves_the_socket_open_for_a_reset() {
        let (mut local, mut ours) = duplex(1 << 20);
        let (out_tx, _out_rx) = queue::queue(1 << 20, 1 << 20);
        let down = FailingAfter(vec![b"one ", b"two"]);
        let end = run(&mut ours, up(out_tx, None), down).await;
        assert!(matches!(end, MoverEnd::PeerFailed), "{end:?}");
        // Not shut down: the owner may still write (or reset) it.
        ours.write_all(b" and on").await.unwrap();
        drop(ours);
        let mut got = Vec::new();
        local.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"one two and on");
    }

    #[tokio::test]
    async fn queued_bytes_are_written_before_the_close() {
        let (mut local, ours) = duplex(1 << 20);
        let (window, rx) = flow::inbound(None, 16);
        let (out_tx, _out_rx) = queue::queue(1 << 20, 1 << 20);
        for part in [&b"one "[..], b"two ", b"three"] {
            window.send(Bytes::copy_from_slice(part)).await.unwrap();
        }
        drop(window);
        let down = WindowDownstream::new(ConnId(1), rx, None);
        let end = run(ours, up(out_tx, None), down).await;
        assert!(matches!(end, MoverEnd::PeerClosed), "{end:?}");
        let mut got = Vec::new();
        local.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"one two three");
    }

    #[tokio::test]
    async fn a_dead_tunnel_stops_the_mover() {
        let (mut local, ours) = duplex(1024);
        let (_window, rx) = flow::inbound(None, 16);
        let (out_tx, out_rx) = queue::queue(1 << 20, 1 << 20);
        drop(out_rx);
        let down = WindowDownstream::new(ConnId(1), rx, None);
        let task = tokio::spawn(run(ours, up(out_tx, None), down));
        local.write_all(b"x").await.unwrap();
        assert!(matches!(task.await.unwrap(), MoverEnd::TunnelGone));
    }

    #[tokio::test]
    async fn bulk_reads_fill_large_packets() {
        let (mut local, ours) = duplex(4 * READ_CHUNK);
        local.write_all(&vec![7u8; 3 * READ_CHUNK]).await.unwrap();
        let mut reader = Reader::new(ours);
        let chunk = reader.next().await.unwrap().unwrap();
        assert_eq!(chunk.len(), READ_CHUNK, "one read takes a whole chunk");
    }

    #[tokio::test]
    async fn a_small_read_holds_no_large_buffer() {
        let (mut local, ours) = duplex(4 * READ_CHUNK);
        let mut reader = Reader::new(ours);
        for len in [1, IDLE_READ + 1, READ_CHUNK / 2 - 1] {
            local.write_all(&vec![7u8; len]).await.unwrap();
            let data = reader.next().await.unwrap().unwrap();
            assert_eq!(data.len(), len);
            // A buffer of its own size, not a slice of the read buffer.
            let held = data.try_into_mut().expect("one reference").capacity();
            assert!(held < 2 * len + 64, "{len} bytes hold a {held}-byte buffer");
        }
    }

    #[tokio::test]
    async fn the_read_buffer_is_reused_once_its_payloads_are_gone() {
        let (mut local, ours) = duplex(4 * READ_CHUNK);
        let mut reader = Reader::new(ours);
        local.write_all(&vec![1u8; READ_CHUNK]).await.unwrap();
        let first = reader.next().await.unwrap().unwrap();
        let at = first.as_ptr();
        drop(first);
        local.write_all(&vec![2u8; READ_CHUNK]).await.unwrap();
        let second = reader.next().await.unwrap().unwrap();
        assert_eq!(second.as_ptr(), at, "a fresh allocation per read");
        // While a payload is held, the next read takes another buffer.
        local.write_all(&vec![3u8; READ_CHUNK]).await.unwrap();
        let third = reader.next().await.unwrap().unwrap();
        assert_ne!(third.as_ptr(), second.as_ptr());
        assert_eq!((second[0], third[0]), (2, 3));
    }

    #[tokio::test]
    async fn a_connection_that_goes_idle_after_a_burst_keeps_no_buffer() {
        let (mut local, ours) = duplex(4 * READ_CHUNK);
        let mut reader = Reader::new(ours);
        // Less than a chunk, copied out or not: the socket is drained, and
        // the reader holds nothing while the connection idles.
        for len in [5000, READ_CHUNK - 1000] {
            local.write_all(&vec![2u8; len]).await.unwrap();
            let data = reader.next().await.unwrap().unwrap();
            assert_eq!(data.len(), len);
            assert_eq!(reader.buf.capacity(), 0, "{len}: a buffer held while idle");
        }
    }

    #[tokio::test]
    async fn credit_limits_what_is_in_flight_and_drains_return_it() {
        let (mut local, ours) = duplex(4 << 20);
        // The peer announced 64 KiB windows and 16 KiB chunks.
        let peer = flow::Window::new(64 * 1024, 16 * 1024).unwrap();
        let flow = Arc::new(Flow::new(flow::Scheme::Credit {
            ours: flow::Window::V1,
            theirs: peer,
        }));
        let (window, rx) = flow::inbound(Some(flow.clone()), 0);
        let (out_tx, mut out_rx) = queue::queue(64 << 20, 1 << 20);
        let down = WindowDownstream::new(ConnId(3), rx, Some(Arc::new(Pushes(out_tx.clone()))));
        let _task = tokio::spawn(run(ours, up(out_tx, Some(flow.clone())), down));
        local.write_all(&vec![1u8; 3 << 20]).await.unwrap();
        // Without grants, at most the peer's window goes out, in its
        // chunks: the mover spends its credit, then waits for more.
        let mut sent = 0;
        for _ in 0..1000 {
            tokio::task::yield_now().await;
            while let Some(Some(packet)) = out_rx.recv().now_or_never() {
                if let PacketKind::Data(d) = packet.into_kind() {
                    assert!(d.data.len() <= peer.max_chunk, "{} bytes", d.data.len());
                    sent += flow::cost(d.data.len());
                }
            }
        }
        assert!(sent <= peer.bytes, "{sent} sent without credit back");
        assert!(
            sent > peer.bytes - flow::cost(peer.max_chunk),
            "only {sent} sent"
        );
        assert!(flow.credit() < flow::cost(peer.max_chunk));
        // Bytes for the socket are written and credited back.
        window.send(Bytes::from(vec![2u8; 1000])).await.unwrap();
        let mut got = vec![0u8; 1000];
        local.read_exact(&mut got).await.unwrap();
        assert_eq!(got, vec![2u8; 1000]);
        let credit_back = loop {
            if let Some((conn, c)) = flow::parse_credit(&out_rx.recv().await.unwrap()) {
                break (conn, c);
            }
        };
        assert_eq!(credit_back, (3, flow::cost(1000)));
    }
}
