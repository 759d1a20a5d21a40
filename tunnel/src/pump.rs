//! Moves bytes between a socket and the DATA packets of one connection.
//!
//! The socket → packets half waits for data with a small buffer (an idle
//! connection holds no large buffer), then takes what is immediately
//! available up to [`READ_CHUNK`] into a fresh buffer that becomes the DATA
//! payload without another copy. Sending waits on the (bounded) outbound
//! channel and, when flow control is negotiated, on the connection's credit:
//! a slow tunnel slows the reader rather than growing a buffer. The packets
//! → socket half writes every queued chunk; when the queue is closed (the
//! peer closed the connection) it first writes everything already queued,
//! then shuts the socket's write side down. The protocol has no half-close:
//! whichever half ends first ends the pump, as in ANP.

use std::io;

use bytes::{Bytes, BytesMut};
use futures_util::FutureExt;
use proto::Packet;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::{
    flow::{self, Granter, Outbound, SendCredit},
    ids::ConnId,
    queue::{Closed, QueueTx},
};

/// Largest DATA payload we send (ANP's agent sends 4 KiB, which costs a
/// packet per 4 KiB); within the 4 MiB gRPC limit and a flow window.
pub const READ_CHUNK: usize = flow::MAX_CHUNK;
/// What an idle connection's reader holds while it waits.
const IDLE_READ: usize = 2048;

/// Why a pump stopped.
#[derive(Debug)]
pub enum PumpEnd {
    /// The socket reached end of file: the local side closed.
    LocalEof,
    /// Reading or writing the socket failed.
    LocalError(io::Error),
    /// The inbound queue closed after every queued byte was written: the
    /// peer closed the connection.
    PeerClosed,
    /// The outbound channel is gone: the tunnel stream died.
    TunnelGone,
    /// Like [`PumpEnd::TunnelGone`], found when a DATA packet could not be
    /// sent: the packet is returned so the caller can count it.
    Undelivered(Packet),
}

/// Flow control of one connection (see [`crate::flow`]).
#[derive(Clone, Default)]
pub struct PumpFlow {
    /// Credit to spend before each DATA sent; `None` without negotiation.
    pub send_credit: Option<SendCredit>,
    /// Return credit to the peer as the inbound queue drains.
    pub grant: bool,
}

/// Reads the next chunk: waits with a small buffer, then takes whatever else
/// is ready without waiting. `Ok(None)` is end of file; `eof` is set when
/// the end of file was found after the returned chunk.
///
/// # Errors
/// The read's.
pub async fn read_chunk<R: AsyncRead + Unpin>(
    reader: &mut R,
    eof: &mut bool,
) -> io::Result<Option<Bytes>> {
    let mut first = [0u8; IDLE_READ];
    let n = reader.read(&mut first).await?;
    if n == 0 {
        return Ok(None);
    }
    if n < IDLE_READ {
        // The socket had no more than this: a packet of its own size.
        return Ok(Some(Bytes::copy_from_slice(&first[..n])));
    }
    let mut buf = BytesMut::with_capacity(READ_CHUNK);
    buf.extend_from_slice(&first[..n]);
    while buf.len() < READ_CHUNK {
        // `read_buf` is cancel safe: polled once, it either reads or
        // registers for wake-up and is dropped.
        match reader.read_buf(&mut buf).now_or_never() {
            Some(Ok(0)) => {
                *eof = true;
                break;
            }
            Some(Ok(_)) => {}
            Some(Err(e)) => return Err(e),
            None => break,
        }
    }
    Ok(Some(seal(buf)))
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

/// Runs both halves until one ends; see the module docs.
///
/// # Cancel safety
/// Dropping the future drops queued inbound bytes and the socket.
pub async fn pump<IO>(
    io: IO,
    conn_id: ConnId,
    mut inbound: Outbound<Bytes>,
    out_tx: QueueTx<Packet>,
    flow: PumpFlow,
) -> PumpEnd
where
    IO: AsyncRead + AsyncWrite,
{
    let (mut reader, mut writer) = tokio::io::split(io);
    let upstream = async {
        let mut eof = false;
        loop {
            let chunk = match read_chunk(&mut reader, &mut eof).await {
                Ok(Some(chunk)) => chunk,
                Ok(None) => return PumpEnd::LocalEof,
                Err(e) => return PumpEnd::LocalError(e),
            };
            if let Some(credit) = &flow.send_credit
                && credit.take(flow::cost(chunk.len())).await.is_err()
            {
                // The connection was closed under us: nothing more goes out.
                return PumpEnd::TunnelGone;
            }
            let packet = Packet::data(conn_id.0, chunk);
            let cost = flow::packet_cost(&packet);
            if let Err(Closed(packet)) = out_tx.send(packet, cost).await {
                return PumpEnd::Undelivered(packet);
            }
            if eof {
                return PumpEnd::LocalEof;
            }
        }
    };
    let downstream = async {
        let mut granter = Granter::default();
        while let Some((chunk, cost)) = inbound.recv().await {
            if let Err(e) = writer.write_all(&chunk).await {
                return PumpEnd::LocalError(e);
            }
            inbound.drained(cost);
            let credit = if flow.grant {
                granter.drained(cost, inbound.is_empty())
            } else {
                None
            };
            if let Some(credit) = credit {
                let packet = flow::credit_packet(conn_id.0, credit);
                let cost = flow::packet_cost(&packet);
                // A control packet: it never waits. Refused, the stream is
                // gone or its peer stopped reading it.
                if out_tx.push(packet, cost).is_err() {
                    return PumpEnd::TunnelGone;
                }
            }
        }
        match writer.shutdown().await {
            Ok(()) => PumpEnd::PeerClosed,
            Err(e) => PumpEnd::LocalError(e),
        }
    };
    tokio::select! {
        end = upstream => end,
        end = downstream => end,
    }
}

#[cfg(test)]
mod tests {
    use proto::packet::PacketKind;
    use tokio::io::duplex;

    use super::*;

    #[tokio::test]
    async fn socket_bytes_become_data_packets_until_eof() {
        let (mut local, ours) = duplex(1024);
        let (_inbound, outbound) = flow::queue();
        let (out_tx, mut out_rx) = crate::queue::queue(1 << 20, 1 << 20);
        let task = tokio::spawn(pump(ours, ConnId(7), outbound, out_tx, PumpFlow::default()));
        local.write_all(b"hello").await.unwrap();
        let packet = out_rx.recv().await.unwrap();
        match packet.into_kind() {
            PacketKind::Data(d) => {
                assert_eq!(d.connect_id, 7);
                assert_eq!(&d.data[..], b"hello");
            }
            other => panic!("unexpected {other:?}"),
        }
        drop(local);
        assert!(matches!(task.await.unwrap(), PumpEnd::LocalEof));
    }

    #[tokio::test]
    async fn queued_bytes_are_written_before_the_close() {
        let (mut local, ours) = duplex(1 << 20);
        let (inbound, outbound) = flow::queue();
        let (out_tx, _out_rx) = crate::queue::queue(1 << 20, 1 << 20);
        for part in [&b"one "[..], b"two ", b"three"] {
            inbound
                .push(Bytes::copy_from_slice(part), flow::cost(part.len()))
                .unwrap();
        }
        drop(inbound);
        let end = pump(ours, ConnId(1), outbound, out_tx, PumpFlow::default()).await;
        assert!(matches!(end, PumpEnd::PeerClosed), "{end:?}");
        let mut got = Vec::new();
        local.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"one two three");
    }

    #[tokio::test]
    async fn a_dead_tunnel_stops_the_pump() {
        let (mut local, ours) = duplex(1024);
        let (_inbound, outbound) = flow::queue();
        let (out_tx, out_rx) = crate::queue::queue(1 << 20, 1 << 20);
        drop(out_rx);
        let task = tokio::spawn(pump(ours, ConnId(1), outbound, out_tx, PumpFlow::default()));
        local.write_all(b"x").await.unwrap();
        let end = task.await.unwrap();
        let PumpEnd::Undelivered(packet) = end else {
            panic!("expected the undelivered DATA, got {end:?}")
        };
        assert_eq!(packet.type_name(), "DATA");
    }

    #[tokio::test]
    async fn a_small_read_holds_no_large_buffer() {
        let (mut local, ours) = duplex(4 * READ_CHUNK);
        let (_inbound, outbound) = flow::queue();
        let (out_tx, mut out_rx) = crate::queue::queue(1 << 20, 1 << 20);
        let _task = tokio::spawn(pump(ours, ConnId(1), outbound, out_tx, PumpFlow::default()));
        for len in [1, IDLE_READ + 1, READ_CHUNK / 2 - 1] {
            local.write_all(&vec![7u8; len]).await.unwrap();
            let PacketKind::Data(d) = out_rx.recv().await.unwrap().into_kind() else {
                panic!("expected DATA")
            };
            assert_eq!(d.data.len(), len);
            // A buffer of its own size, not a slice of a 64 KiB one.
            let held = d.data.try_into_mut().expect("one reference").capacity();
            assert!(held < 2 * len + 64, "{len} bytes hold a {held}-byte buffer");
        }
    }

    #[tokio::test]
    async fn bulk_reads_fill_large_packets() {
        let (mut local, ours) = duplex(4 * READ_CHUNK);
        let (_inbound, outbound) = flow::queue();
        let (out_tx, mut out_rx) = crate::queue::queue(1 << 20, 1 << 20);
        local.write_all(&vec![7u8; 3 * READ_CHUNK]).await.unwrap();
        let _task = tokio::spawn(pump(ours, ConnId(1), outbound, out_tx, PumpFlow::default()));
        let PacketKind::Data(d) = out_rx.recv().await.unwrap().into_kind() else {
            panic!("expected DATA")
        };
        assert_eq!(d.data.len(), READ_CHUNK, "one read takes a whole chunk");
    }

    #[tokio::test]
    async fn credit_limits_what_is_in_flight_and_drains_return_it() {
        let (mut local, ours) = duplex(4 << 20);
        let (inbound, outbound) = flow::queue();
        let (out_tx, mut out_rx) = crate::queue::queue(64 << 20, 1 << 20);
        let credit = SendCredit::new();
        let flow = PumpFlow {
            send_credit: Some(credit.clone()),
            grant: true,
        };
        let _task = tokio::spawn(pump(ours, ConnId(3), outbound, out_tx, flow));
        local.write_all(&vec![1u8; 3 << 20]).await.unwrap();
        // Without grants, at most a window's worth of DATA goes out.
        let mut sent = 0;
        while let Ok(Some(packet)) =
            tokio::time::timeout(std::time::Duration::from_millis(200), out_rx.recv()).await
        {
            if let PacketKind::Data(d) = packet.into_kind() {
                sent += flow::cost(d.data.len());
            }
        }
        assert!(sent <= flow::WINDOW, "{sent} in flight");
        assert!(
            sent > flow::WINDOW - flow::cost(READ_CHUNK),
            "{sent} in flight"
        );
        // Bytes for the socket are written and credited back.
        inbound
            .push(Bytes::from(vec![2u8; 1000]), flow::cost(1000))
            .unwrap();
        let mut got = vec![0u8; 1000];
        let mut total = 0;
        // The socket also holds what the local side wrote; read the echo of ours.
        let reader = async {
            loop {
                let n = local.read(&mut got[total..]).await.unwrap();
                total += n;
                if total == 1000 {
                    break;
                }
            }
        };
        reader.await;
        assert_eq!(got, vec![2u8; 1000]);
        let credit_back = loop {
            if let Some((conn, c)) = flow::parse_credit(&out_rx.recv().await.unwrap()) {
                break (conn, c);
            }
        };
        assert_eq!(credit_back, (3, flow::cost(1000)));
    }
}
