//! HTTP/2 as both binaries set it up: frame size, windows, how long a
//! keepalive ping waits, and a gRPC channel over a connection already made.

use std::{io, time::Duration};

use tokio::io::{AsyncRead, AsyncWrite};

/// HTTP/2 frame size we accept (peers may send DATA frames this large), so
/// that a DATA packet of `tunnel::flow::MAX_CHUNK` crosses in one frame, not sixteen of 16 KiB.
pub const MAX_FRAME_SIZE: u32 = 256 * 1024;
/// HTTP/2 stream window: an agent stream carries many connections and is
/// always drained (readers never block), so a large window only saves
/// WINDOW_UPDATE round trips; a frontend stream carries one connection.
pub const STREAM_WINDOW: u32 = 4 * 1024 * 1024;
/// HTTP/2 connection window.
pub const CONNECTION_WINDOW: u32 = 8 * 1024 * 1024;

/// How long an HTTP/2 keepalive ping sent every `interval` waits for its
/// ack: gRPC's 20 s, or the interval itself when shorter, so that a peer
/// that vanished is dropped within twice a short `--keepalive-time`.
pub fn keepalive_timeout(interval: Duration) -> Duration {
    interval.clamp(Duration::from_millis(100), Duration::from_secs(20))
}

/// A gRPC channel over `io`, a transport already connected (and its TLS
/// handshake done): tonic asks its connector for a connection, and this
/// one hands it `io`, once; a reconnect fails, and the caller makes a new
/// channel.
///
/// # Errors
/// HTTP/2 could not be set up over `io`.
pub async fn channel_over<IO>(
    endpoint: tonic::transport::Endpoint,
    io: IO,
) -> Result<tonic::transport::Channel, tonic::transport::Error>
where
    IO: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    let slot = std::sync::Mutex::new(Some(io));
    endpoint
        .connect_with_connector(tower::service_fn(move |_| {
            let io = slot.lock().ok().and_then(|mut slot| slot.take());
            async move {
                io.map(hyper_util::rt::TokioIo::new)
                    .ok_or_else(|| io::Error::other("connection already used"))
            }
        }))
        .await
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::keepalive_timeout;

    #[test]
    fn keepalive_acks_wait_the_interval_within_bounds() {
        assert_eq!(
            keepalive_timeout(Duration::from_secs(3600)),
            Duration::from_secs(20)
        );
        assert_eq!(
            keepalive_timeout(Duration::from_millis(500)),
            Duration::from_millis(500)
        );
    }
}
