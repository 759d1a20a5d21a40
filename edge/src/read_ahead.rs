//! [`ReadAhead`]: fewer read system calls under TLS.
//!
//! rustls asks its transport for at most 4 KiB more than it holds
//! (`DeframerVecBuffer::prepare_read`), so a TLS stream that carries bulk
//! data costs four or five `recv` calls per 16 KiB record. Under it,
//! `ReadAhead` reads up to [`READ_AHEAD`] bytes per call into a buffer of
//! its own and serves the small reads from there. The buffer is taken only
//! when the transport has data. It is given back whenever the reader waits
//! with nothing buffered, so an idle connection holds none: thousands of
//! idle agent streams cost nothing extra. Writes pass through.

use std::{
    io,
    pin::Pin,
    task::{Context, Poll},
};

use bytes::{Buf, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Bytes read from the transport per call at most.
pub const READ_AHEAD: usize = 64 * 1024;

/// See the module documentation.
pub struct ReadAhead<T> {
    /// The transport.
    inner: T,
    /// Bytes read ahead and not yet taken; no allocation while empty and
    /// waiting.
    buf: BytesMut,
}

impl<T> ReadAhead<T> {
    /// Wraps `inner`, holding no buffer yet.
    pub fn new(inner: T) -> Self {
        Self {
            inner,
            buf: BytesMut::new(),
        }
    }

    /// The transport.
    pub fn get_ref(&self) -> &T {
        &self.inner
    }

    /// Bytes held for the next reads (for tests and accounting).
    pub fn held(&self) -> usize {
        self.buf.capacity()
    }

    /// Bytes read ahead and not yet taken.
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// Gives the buffer back if nothing is in it: for a connection about
    /// to wait with no read pending (the buffer otherwise goes back only
    /// when a read finds nothing).
    pub fn release(&mut self) {
        if self.buf.is_empty() {
            self.buf = BytesMut::new();
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for ReadAhead<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        dst: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.buf.is_empty() {
            if dst.remaining() >= READ_AHEAD {
                // A large read gains nothing from the buffer.
                return Pin::new(&mut this.inner).poll_read(cx, dst);
            }
            this.buf.reserve(READ_AHEAD);
            match tokio_util::io::poll_read_buf(Pin::new(&mut this.inner), cx, &mut this.buf) {
                Poll::Ready(Ok(_)) => {}
                Poll::Ready(Err(e)) => {
                    this.buf = BytesMut::new();
                    return Poll::Ready(Err(e));
                }
                Poll::Pending => {
                    // Waiting with nothing buffered: hold no memory.
                    this.buf = BytesMut::new();
                    return Poll::Pending;
                }
            }
            if this.buf.is_empty() {
                // End of file.
                this.buf = BytesMut::new();
                return Poll::Ready(Ok(()));
            }
        }
        let n = this.buf.len().min(dst.remaining());
        dst.put_slice(&this.buf[..n]);
        this.buf.advance(n);
        Poll::Ready(Ok(()))
    }
}

impl<T: tonic::transport::server::Connected> tonic::transport::server::Connected for ReadAhead<T> {
    type ConnectInfo = T::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

crate::forward_write!([T: AsyncWrite + Unpin] ReadAhead<T>, inner);

#[cfg(test)]
mod tests {
    use futures_util::FutureExt;
    use tokio::io::{AsyncReadExt, AsyncWriteExt, duplex};

    use super::*;

    /// Counts the reads that reach the transport.
    struct Counted<T> {
        inner: T,
        reads: usize,
    }

    impl<T: AsyncRead + Unpin> AsyncRead for Counted<T> {
        fn poll_read(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &mut ReadBuf<'_>,
        ) -> Poll<io::Result<()>> {
            let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
            if polled.is_ready() {
                self.reads += 1;
            }
            polled
        }
    }

    #[tokio::test]
    async fn small_reads_are_served_from_one_large_read_byte_exact() {
        let (mut peer, ours) = duplex(4 * READ_AHEAD);
        let data: Vec<u8> = (0..READ_AHEAD).map(|i| (i % 251) as u8).collect();
        peer.write_all(&data).await.unwrap();
        let mut reader = ReadAhead::new(Counted {
            inner: ours,
            reads: 0,
        });
        let mut got = Vec::new();
        let mut chunk = [0u8; 4096];
        while got.len() < data.len() {
            let n = reader.read(&mut chunk).await.unwrap();
            got.extend_from_slice(&chunk[..n]);
        }
        assert_eq!(got, data);
        assert_eq!(
            reader.inner.reads, 1,
            "16 reads of 4 KiB took one transport read"
        );
    }

    #[tokio::test]
    async fn a_waiting_reader_holds_no_buffer_and_sees_the_end() {
        let (mut peer, ours) = duplex(1024);
        let mut reader = ReadAhead::new(ours);
        let mut chunk = [0u8; 100];
        // Nothing to read: the read waits, holding nothing.
        assert!(reader.read(&mut chunk).now_or_never().is_none());
        assert_eq!(reader.held(), 0);
        peer.write_all(b"hello").await.unwrap();
        let n = reader.read(&mut chunk).await.unwrap();
        assert_eq!(&chunk[..n], b"hello");
        assert!(reader.read(&mut chunk).now_or_never().is_none());
        assert_eq!(reader.held(), 0, "drained and waiting: no buffer");
        drop(peer);
        assert_eq!(reader.read(&mut chunk).await.unwrap(), 0);
    }

    #[tokio::test]
    async fn writes_pass_through() {
        let (mut peer, ours) = duplex(1024);
        let mut io = ReadAhead::new(ours);
        io.write_all(b"out").await.unwrap();
        let mut got = [0u8; 3];
        peer.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"out");
    }
}
