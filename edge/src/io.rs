//! The write side of an I/O wrapper that changes only how it reads
//! ([`forward_write!`]), and both sides of one that only adds to what it
//! wraps ([`forward_io!`]), written once rather than per wrapper.

/// Implements `tokio::io::AsyncWrite` for a wrapper by forwarding every
/// method to one `Unpin` field:
/// `forward_write!([T: AsyncWrite + Unpin] ReadAhead<T>, inner);`
#[macro_export]
macro_rules! forward_write {
    ([$($generics:tt)*] $ty:ty, $field:ident) => {
        impl<$($generics)*> ::tokio::io::AsyncWrite for $ty {
            fn poll_write(
                self: ::std::pin::Pin<&mut Self>,
                cx: &mut ::std::task::Context<'_>,
                buf: &[u8],
            ) -> ::std::task::Poll<::std::io::Result<usize>> {
                ::std::pin::Pin::new(&mut self.get_mut().$field).poll_write(cx, buf)
            }

            fn poll_write_vectored(
                self: ::std::pin::Pin<&mut Self>,
                cx: &mut ::std::task::Context<'_>,
                bufs: &[::std::io::IoSlice<'_>],
            ) -> ::std::task::Poll<::std::io::Result<usize>> {
                ::std::pin::Pin::new(&mut self.get_mut().$field).poll_write_vectored(cx, bufs)
            }

            fn is_write_vectored(&self) -> bool {
                ::tokio::io::AsyncWrite::is_write_vectored(&self.$field)
            }

            fn poll_flush(
                self: ::std::pin::Pin<&mut Self>,
                cx: &mut ::std::task::Context<'_>,
            ) -> ::std::task::Poll<::std::io::Result<()>> {
                ::std::pin::Pin::new(&mut self.get_mut().$field).poll_flush(cx)
            }

            fn poll_shutdown(
                self: ::std::pin::Pin<&mut Self>,
                cx: &mut ::std::task::Context<'_>,
            ) -> ::std::task::Poll<::std::io::Result<()>> {
                ::std::pin::Pin::new(&mut self.get_mut().$field).poll_shutdown(cx)
            }
        }
    };
}

/// Implements `tokio::io::AsyncRead` and `AsyncWrite` for a wrapper by
/// forwarding both to one `Unpin` field: `forward_io!([] TunnelConn, io);`
#[macro_export]
macro_rules! forward_io {
    ([$($generics:tt)*] $ty:ty, $field:ident) => {
        impl<$($generics)*> ::tokio::io::AsyncRead for $ty {
            fn poll_read(
                self: ::std::pin::Pin<&mut Self>,
                cx: &mut ::std::task::Context<'_>,
                buf: &mut ::tokio::io::ReadBuf<'_>,
            ) -> ::std::task::Poll<::std::io::Result<()>> {
                ::std::pin::Pin::new(&mut self.get_mut().$field).poll_read(cx, buf)
            }
        }

        $crate::forward_write!([$($generics)*] $ty, $field);
    };
}

/// A bidirectional byte stream that can move between tasks (a TCP, TLS or
/// Unix socket, a tunneled connection).
pub trait Io: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin> Io for T {}
