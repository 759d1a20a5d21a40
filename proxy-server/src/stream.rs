//! What every server-side stream has: its end ([`StreamEnd`]: how a
//! stream, an agent's `Connect`, a frontend's `Proxy` or an HTTP CONNECT
//! tunnel, is ended from inside the server, with an error status for the
//! peer when it ends on a fault); for gRPC streams, the packets received
//! from the peer ([`next_packet`]) and the stream returned to it
//! ([`PacketStream`]), with the stream's driver beside it
//! ([`spawn_driver`]).

use std::{future::Future, pin::Pin, sync::Arc};

use futures_util::{Stream, StreamExt, stream};
use proto::Packet;
use tokio_util::{sync::CancellationToken, task::TaskTracker};
use tonic::Status;
use tracing::{Instrument, debug, warn};
use tunnel::sync::{
    Mutex,
    audit::{self, LockAudit, Taker},
};

use crate::metrics::{Segment, ServerMetrics};

/// The end of one stream: a token that stops its reader and its outbound
/// packets, and the status the peer gets.
pub(crate) struct StreamEnd {
    /// Cancelled when the stream must end (the reader stops, the outbound
    /// stream stops after the packet being sent).
    cancel: CancellationToken,
    /// The status the stream ends with; `None` is OK.
    status: Mutex<Option<Status>>,
}

impl StreamEnd {
    /// An end triggered by `cancel` (a child of the server's shutdown).
    pub(crate) fn new(cancel: CancellationToken) -> Arc<Self> {
        Arc::new(Self {
            cancel,
            status: Mutex::new(None),
        })
    }

    /// Ends the stream with OK (unless it already failed).
    pub(crate) fn end(&self) {
        self.cancel.cancel();
    }

    /// Ends the stream with `status`; the first failure wins.
    pub(crate) fn fail(&self, status: Status) {
        self.status.lock().get_or_insert(status);
        self.cancel.cancel();
    }

    /// Whether the stream was ended.
    pub(crate) fn is_ended(&self) -> bool {
        self.cancel.is_cancelled()
    }

    /// Resolves once the stream is ended.
    pub(crate) async fn ended(&self) {
        self.cancel.cancelled().await;
    }

    /// What tonic sends the peer: `packets` until the stream is ended, then
    /// the failure status, if any (tonic ends the stream with it).
    pub(crate) fn outbound<S>(
        self: Arc<Self>,
        packets: S,
    ) -> impl Stream<Item = Result<Packet, Status>> + Send + 'static
    where
        S: Stream<Item = Packet> + Send + 'static,
    {
        self.outbound_after(packets, std::future::ready(()))
    }

    /// [`StreamEnd::outbound`], whose end, once the stream is ended, waits
    /// for `after` too (packets still go meanwhile).
    pub(crate) fn outbound_after<S>(
        self: Arc<Self>,
        packets: S,
        after: impl Future<Output = ()> + Send + 'static,
    ) -> impl Stream<Item = Result<Packet, Status>> + Send + 'static
    where
        S: Stream<Item = Packet> + Send + 'static,
    {
        let cancel = self.cancel.clone();
        let ended = async move {
            cancel.cancelled().await;
            after.await;
        };
        packets.map(Ok).take_until(ended).chain(
            stream::once(async move { self.status.lock().take() })
                .filter_map(|status| std::future::ready(status.map(Err))),
        )
    }
}

/// The packet stream returned to a gRPC peer.
pub(crate) type PacketStream = Pin<Box<dyn Stream<Item = Result<Packet, Status>> + Send>>;

/// Starts a gRPC stream: runs its `driver` on `tasks`, in the lock
/// audit's scope as `taker` and in `span`; returns what tonic sends the
/// peer, `outbound` (its packets until its end, then its status:
/// [`StreamEnd::outbound`]), audited as the same stream's.
///
/// Both handlers (`backend::service`, `frontend::grpc`) start their
/// streams this way; what differs (the queue, the registration with the
/// control core, the guard, how taken packets are counted) stays with
/// each. So do the drivers' receive loops, which differ by design and
/// share only [`next_packet`]: an agent stream's driver waits inline, one
/// packet at a time, and only for an agent without credit; a frontend's
/// reads on while its uploads wait (its lanes, their cut timers).
pub(crate) fn spawn_driver(
    tasks: &TaskTracker,
    audit: &Arc<LockAudit>,
    taker: Taker,
    span: tracing::Span,
    driver: impl Future<Output = ()> + Send + 'static,
    outbound: impl Stream<Item = Result<Packet, Status>> + Send + 'static,
) -> PacketStream {
    tasks.spawn(audit::scope(audit.clone(), taker, driver).instrument(span));
    Box::pin(audited(audit.clone(), taker, outbound))
}

/// A stream a library's task polls (tonic's response stream), audited as
/// `taker`'s: its locks count as that stream's.
fn audited<S>(
    audit: Arc<LockAudit>,
    taker: Taker,
    stream: S,
) -> impl Stream<Item = S::Item> + Send + 'static
where
    S: Stream + Send + 'static,
{
    let mut stream = Box::pin(stream);
    stream::poll_fn(move |cx| audit::sync_scope(&audit, taker, || stream.as_mut().poll_next(cx)))
}

/// The next packet from a stream's peer, counted on `segment`; `None` once
/// the peer ended the stream, the stream failed (see [`receive_failed`]), or
/// `gone` resolved (the stream was ended inside the server).
///
/// # Cancel safety
/// Cancel safe: `Streaming::message` is.
pub(crate) async fn next_packet(
    inbound: &mut tonic::Streaming<Packet>,
    gone: std::pin::Pin<&mut impl std::future::Future<Output = ()>>,
    segment: Segment,
    end: &StreamEnd,
    metrics: &ServerMetrics,
) -> Option<Packet> {
    let received = tokio::select! {
        biased;
        () = gone => return None,
        received = inbound.message() => received,
    };
    match received {
        Ok(Some(packet)) => {
            metrics.packets.count(segment, packet.r#type);
            Some(packet)
        }
        Ok(None) => None,
        Err(status) => {
            receive_failed(status, segment, end, metrics);
            None
        }
    }
}

/// A receive error as grpc-go reports it: tonic refuses a message over
/// the 4 MiB limit with `OUT_OF_RANGE`, grpc-go (and so ANP) with
/// `RESOURCE_EXHAUSTED`, which is what the peer and the metrics get. Over
/// the limit, the stream is failed with it.
pub(crate) fn receive_failed(
    status: Status,
    segment: Segment,
    end: &StreamEnd,
    metrics: &ServerMetrics,
) {
    let status = if status.code() == tonic::Code::OutOfRange
        && status
            .message()
            .starts_with("Error, decoded message length too large")
    {
        Status::resource_exhausted(format!(
            "grpc: received message larger than max ({})",
            status.message()
        ))
    } else {
        status
    };
    metrics.stream_error(segment, status.code());
    debug!(error = %status, segment = segment.as_str(), "stream failed");
    if status.code() == tonic::Code::ResourceExhausted {
        warn!(error = %status.message(), "a peer sent a message over the limit; closing its stream");
        end.fail(status);
    }
}

#[cfg(test)]
mod tests {
    use futures_util::StreamExt;

    use super::*;

    #[tokio::test]
    async fn a_failed_stream_ends_with_its_status_after_what_was_sent() {
        let end = StreamEnd::new(CancellationToken::new());
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let mut out = Box::pin(
            end.clone()
                .outbound(tokio_stream::wrappers::ReceiverStream::new(rx)),
        );
        tx.send(Packet::close_request(1)).await.unwrap();
        assert!(matches!(out.next().await, Some(Ok(_))));
        end.fail(Status::resource_exhausted("too large"));
        end.fail(Status::internal("second"));
        let status = out.next().await.unwrap().unwrap_err();
        assert_eq!(status.code(), tonic::Code::ResourceExhausted);
        assert!(out.next().await.is_none());
    }

    #[tokio::test]
    async fn an_ended_stream_ends_ok() {
        let end = StreamEnd::new(CancellationToken::new());
        let mut out = Box::pin(end.clone().outbound(stream::pending::<Packet>()));
        end.end();
        assert!(out.next().await.is_none());
        assert!(end.is_ended());
    }

    #[test]
    fn an_oversize_message_is_resource_exhausted_as_in_grpc_go() {
        let metrics = ServerMetrics::new(&[]);
        let end = StreamEnd::new(CancellationToken::new());
        let tonic_says = Status::out_of_range(
            "Error, decoded message length too large: found 4194305 bytes, the limit is: 4194304 bytes",
        );
        receive_failed(tonic_says, Segment::FromAgent, &end, &metrics);
        assert!(end.is_ended());
        let text = metrics.text();
        assert!(
            text.contains("stream_errors_total{code=\"ResourceExhausted\",packet_type=\"Unknown\",segment=\"from_agent\"} 1"),
            "{text}"
        );
        let other = StreamEnd::new(CancellationToken::new());
        receive_failed(
            Status::unavailable("gone"),
            Segment::FromAgent,
            &other,
            &metrics,
        );
        assert!(!other.is_ended());
    }
}
