//! `--max-http-connections`: the frontend connections open at once, in
//! either mode. Each connection holds a place until it ends; one accepted
//! with every place taken is refused at once (an HTTP-CONNECT client gets
//! a 503, a gRPC one a closed connection, which grpc-go retries with its
//! backoff), counted in `limit_reached_total{limit="http_connections"}`
//! and logged when the cap is reached, again after it was left.
//!
//! What each connection costs the server beyond the buffer budget (its
//! HTTP/2 and TLS state, at most a stream window per open stream) is thus
//! bounded by the number of connections, whatever their peer does.

use std::{
    io,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
};

use futures_util::{Stream, StreamExt};
use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    sync::{OwnedSemaphorePermit, Semaphore},
};
use tonic::transport::server::Connected;
use tracing::warn;

use crate::{events::Limit, metrics::ServerMetrics};

/// See the module documentation.
pub(crate) struct ConnectionCap {
    /// The places.
    places: Arc<Semaphore>,
    /// `--max-http-connections`.
    limit: usize,
    /// Whether the last connection found every place taken (the cap is
    /// logged once each time it is reached).
    at_cap: bool,
    /// Counts the refusals.
    metrics: Arc<ServerMetrics>,
    /// What a refused client gets, for the log line.
    refusal: &'static str,
}

impl ConnectionCap {
    /// `limit` places; `refusal` says what a refused client gets.
    pub(crate) fn new(limit: usize, metrics: Arc<ServerMetrics>, refusal: &'static str) -> Self {
        Self {
            places: Arc::new(Semaphore::new(limit)),
            limit,
            at_cap: false,
            metrics,
            refusal,
        }
    }

    /// A place for a connection just accepted, or `None` (counted, and
    /// logged when the cap is first reached) if every place is taken.
    pub(crate) fn admit(&mut self) -> Option<OwnedSemaphorePermit> {
        match self.places.clone().try_acquire_owned() {
            Ok(place) => {
                self.at_cap = false;
                Some(place)
            }
            Err(_) => {
                if !self.at_cap {
                    warn!(
                        limit = self.limit,
                        refusal = self.refusal,
                        "--max-http-connections reached: frontend connections are refused until one ends"
                    );
                }
                self.at_cap = true;
                self.metrics.limit_reached(Limit::HttpConnections);
                None
            }
        }
    }

    /// `incoming`'s connections that found a place, each holding it until
    /// dropped; the others are closed at once.
    pub(crate) fn admitted<S, IO>(
        mut self,
        incoming: S,
    ) -> impl Stream<Item = Result<Admitted<IO>, io::Error>> + Send + 'static
    where
        S: Stream<Item = Result<IO, io::Error>> + Send + 'static,
        IO: Send + 'static,
    {
        incoming.filter_map(move |accepted| {
            let admitted = match accepted {
                Ok(io) => self.admit().map(|place| Ok(Admitted { io, _place: place })),
                Err(error) => Some(Err(error)),
            };
            std::future::ready(admitted)
        })
    }
}

/// A frontend connection with its place under the cap, given back when the
/// server drops it.
pub(crate) struct Admitted<IO> {
    /// The connection.
    io: IO,
    /// Its place.
    _place: OwnedSemaphorePermit,
}

impl<IO: AsyncRead + Unpin> AsyncRead for Admitted<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Admitted<IO> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

impl<IO: Connected> Connected for Admitted<IO> {
    type ConnectInfo = IO::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}
