//! Moves bytes between a socket and the DATA packets of one connection.
//!
//! The socket → packets half reads into fresh buffers and sends each chunk as
//! a `DATA` packet on the (bounded) outbound channel, so a slow tunnel slows
//! the reader (backpressure) rather than growing a buffer. The packets →
//! socket half writes every chunk it receives; when its channel is closed
//! (the peer closed the connection) it first writes everything already
//! queued, then shuts the socket's write side down. The protocol has no
//! half-close: whichever half ends first ends the pump, as in ANP.

use std::io;

use bytes::{Bytes, BytesMut};
use proto::Packet;
use tokio::{
    io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt},
    sync::mpsc,
};

use crate::ids::ConnId;

/// Size of one read from the socket, hence the largest DATA payload we send.
/// ANP's agent uses 4 KiB, which costs a packet per 4 KiB; 32 KiB is what
/// its HTTP-CONNECT frontend reads and stays far below gRPC's 4 MiB limit.
pub const READ_CHUNK: usize = 32 * 1024;

/// Why a pump stopped.
#[derive(Debug)]
pub enum PumpEnd {
    /// The socket reached end of file: the local side closed.
    LocalEof,
    /// Reading or writing the socket failed.
    LocalError(io::Error),
    /// The inbound channel closed after every queued byte was written: the
    /// peer closed the connection.
    PeerClosed,
    /// The outbound channel is gone: the tunnel stream died.
    TunnelGone,
}

/// Runs both halves until one ends; see the module docs.
///
/// # Cancel safety
/// Dropping the future drops queued inbound bytes and the socket.
pub async fn pump<IO>(
    io: IO,
    conn_id: ConnId,
    mut data_rx: mpsc::Receiver<Bytes>,
    out_tx: mpsc::Sender<Packet>,
) -> PumpEnd
where
    IO: AsyncRead + AsyncWrite,
{
    let (mut reader, mut writer) = tokio::io::split(io);
    let upstream = async {
        let mut buf = BytesMut::with_capacity(READ_CHUNK);
        loop {
            if buf.capacity() < READ_CHUNK / 4 {
                buf = BytesMut::with_capacity(READ_CHUNK);
            }
            match reader.read_buf(&mut buf).await {
                Ok(0) => return PumpEnd::LocalEof,
                Ok(_) => {
                    let chunk = buf.split().freeze();
                    if out_tx.send(Packet::data(conn_id.0, chunk)).await.is_err() {
                        return PumpEnd::TunnelGone;
                    }
                }
                Err(e) => return PumpEnd::LocalError(e),
            }
        }
    };
    let downstream = async {
        while let Some(chunk) = data_rx.recv().await {
            if let Err(e) = writer.write_all(&chunk).await {
                return PumpEnd::LocalError(e);
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
        let (_data_tx, data_rx) = mpsc::channel(4);
        let (out_tx, mut out_rx) = mpsc::channel(16);
        let task = tokio::spawn(pump(ours, ConnId(7), data_rx, out_tx));
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
        let (data_tx, data_rx) = mpsc::channel(8);
        let (out_tx, _out_rx) = mpsc::channel(16);
        for part in [&b"one "[..], b"two ", b"three"] {
            data_tx.send(Bytes::copy_from_slice(part)).await.unwrap();
        }
        drop(data_tx);
        let end = pump(ours, ConnId(1), data_rx, out_tx).await;
        assert!(matches!(end, PumpEnd::PeerClosed), "{end:?}");
        let mut got = Vec::new();
        local.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"one two three");
    }

    #[tokio::test]
    async fn a_dead_tunnel_stops_the_pump() {
        let (mut local, ours) = duplex(1024);
        let (_data_tx, data_rx) = mpsc::channel(4);
        let (out_tx, out_rx) = mpsc::channel(1);
        drop(out_rx);
        let task = tokio::spawn(pump(ours, ConnId(1), data_rx, out_tx));
        local.write_all(b"x").await.unwrap();
        assert!(matches!(task.await.unwrap(), PumpEnd::TunnelGone));
    }
}
