//! [`StreamEnd`]: how a server-side gRPC stream (an agent's `Connect`, a
//! frontend's `Proxy`) is ended from inside the server, with an error
//! status for the peer when it ends on a fault.

use std::sync::{Arc, Mutex};

use futures_util::{Stream, StreamExt, stream};
use proto::Packet;
use tokio_util::sync::CancellationToken;
use tonic::Status;

use crate::lock;

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
        lock(&self.status).get_or_insert(status);
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
        let cancel = self.cancel.clone();
        packets.map(Ok).take_until(cancel.cancelled_owned()).chain(
            stream::once(async move { lock(&self.status).take() })
                .filter_map(|status| std::future::ready(status.map(Err))),
        )
    }
}

/// A receive error as grpc-go reports it: tonic refuses a message over
/// the 4 MiB limit with `OUT_OF_RANGE`, grpc-go (and so ANP) with
/// `RESOURCE_EXHAUSTED`, which is what the peer and the metrics get.
pub(crate) fn receive_error(status: Status) -> Status {
    if status.code() == tonic::Code::OutOfRange
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
    }
}

#[cfg(test)]
mod tests {
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

    #[test]
    fn an_oversize_message_is_resource_exhausted_as_in_grpc_go() {
        let tonic_says = Status::out_of_range(
            "Error, decoded message length too large: found 4194305 bytes, the limit is: 4194304 bytes",
        );
        let status = receive_error(tonic_says);
        assert_eq!(status.code(), tonic::Code::ResourceExhausted);
        assert!(status.message().contains("found 4194305 bytes"), "{status}");
        let other = receive_error(Status::unavailable("gone"));
        assert_eq!(other.code(), tonic::Code::Unavailable);
    }

    #[tokio::test]
    async fn an_ended_stream_ends_ok() {
        let end = StreamEnd::new(CancellationToken::new());
        let mut out = Box::pin(end.clone().outbound(stream::pending::<Packet>()));
        end.end();
        assert!(out.next().await.is_none());
        assert!(end.is_ended());
    }
}
