//! What every server-side gRPC stream has: its end ([`StreamEnd`]: how a
//! stream, an agent's `Connect` or a frontend's `Proxy`, is ended from
//! inside the server, with an error status for the peer when it ends on a
//! fault), and for an agent stream the sending side of its outbound queue
//! ([`BackendLink`]).

use std::{net::SocketAddr, sync::Arc};

use futures_util::{Stream, StreamExt, stream};
use proto::Packet;
use tokio_util::sync::CancellationToken;
use tonic::Status;
use tracing::{debug, warn};
use tunnel::{
    flow::{self, Scheme},
    ids::AgentId,
    queue::{self, Closed, QueueTx},
    sync::{
        Mutex,
        audit::{self, LockAudit, Taker},
    },
};

use crate::{
    events::Limit,
    metrics::{Segment, ServerMetrics},
};

/// Room for control packets beyond `--max-agent-queue-bytes`: past it the
/// agent has stopped reading.
pub(crate) const BACKEND_CONTROL_RESERVE: usize = 1024 * 1024;

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
        let cancel = self.cancel.clone();
        packets.map(Ok).take_until(cancel.cancelled_owned()).chain(
            stream::once(async move { self.status.lock().take() })
                .filter_map(|status| std::future::ready(status.map(Err))),
        )
    }
}

/// A stream a library's task polls (tonic's response stream), audited as
/// `taker`'s: its locks count as that stream's.
pub(crate) fn audited<S>(
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

/// The agent stream is gone; the packet was not sent.
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error("agent stream closed")]
pub(crate) struct BackendGone;

/// Where packets for one agent stream go.
#[derive(Clone)]
pub(crate) struct BackendLink {
    /// The agent's self-asserted id.
    pub(crate) agent_id: AgentId,
    /// The agent's address, if known.
    pub(crate) peer: Option<SocketAddr>,
    /// What the stream negotiated: every connection on it uses it.
    pub(crate) scheme: Scheme,
    /// Outbound packets, bounded in bytes; tonic drains the receiver into
    /// the stream.
    tx: QueueTx<Packet>,
    /// Ends the stream (agent gone, retired, shutdown, a fault).
    pub(crate) end: Arc<StreamEnd>,
    /// Where packets that cannot be sent are counted.
    metrics: Arc<ServerMetrics>,
}

impl BackendLink {
    pub(crate) fn new(
        agent_id: AgentId,
        peer: Option<SocketAddr>,
        scheme: Scheme,
        tx: QueueTx<Packet>,
        end: Arc<StreamEnd>,
        metrics: Arc<ServerMetrics>,
    ) -> Self {
        Self {
            agent_id,
            peer,
            scheme,
            tx,
            end,
            metrics,
        }
    }

    /// Queues a packet for the agent, waiting while the stream's queue is
    /// full (`--max-agent-queue-bytes`). For a frontend's DATA and dials,
    /// whose callers race the wait against their own end.
    ///
    /// # Cancel safety
    /// Nothing is queued if the future is dropped before it completes.
    pub(crate) async fn send(&self, packet: Packet) -> Result<(), BackendGone> {
        let cost = flow::packet_cost(&packet);
        self.tx.send(packet, cost).await.map_err(|Closed(packet)| {
            self.metrics.send_error(Segment::ToAgent, packet.r#type);
            BackendGone
        })
    }

    /// Queues a control packet without waiting: stream readers and cleanup
    /// send these and must not wait on an agent (two full queues waiting
    /// on each other would deadlock). Past the queue's reserve the agent has
    /// stopped reading its stream: the stream is ended with an error.
    pub(crate) fn send_control(&self, packet: Packet) {
        let cost = flow::packet_cost(&packet);
        match self.tx.push(packet, cost) {
            Ok(()) => {}
            Err(queue::PushError::Closed(packet)) => {
                self.metrics.send_error(Segment::ToAgent, packet.r#type);
            }
            Err(queue::PushError::Full(packet)) => {
                self.metrics.send_error(Segment::ToAgent, packet.r#type);
                if !self.end.is_ended() {
                    warn!(agent.id = %self.agent_id, queued = self.tx.queued(), "agent does not read its stream; closing it");
                    self.metrics.limit_reached(Limit::AgentQueue);
                }
                self.end.fail(Status::resource_exhausted(
                    "the agent does not read its stream: its outbound queue is full",
                ));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use futures_util::StreamExt;
    use tunnel::queue::QueueRx;

    use super::*;

    fn backend(limit: usize) -> (BackendLink, Arc<ServerMetrics>, QueueRx<Packet>) {
        let metrics = Arc::new(ServerMetrics::new(&[]));
        let (tx, rx) = queue::queue(limit, limit);
        let link = BackendLink::new(
            AgentId("a".to_owned()),
            None,
            Scheme::Compat {
                ours: flow::Window::V1,
            },
            tx,
            StreamEnd::new(CancellationToken::new()),
            metrics.clone(),
        );
        (link, metrics, rx)
    }

    const CLOSE_REQ_LOST: &str = "konnectivity_network_proxy_server_stream_errors_total{code=\"Unavailable\",packet_type=\"CLOSE_REQ\",segment=\"to_agent\"}";

    #[tokio::test]
    async fn a_packet_for_a_gone_agent_is_counted_as_a_send_error() {
        let (backend, metrics, rx) = backend(1024);
        backend.send(Packet::close_request(1)).await.unwrap();
        assert!(!metrics.text().contains("stream_errors_total{"));
        drop(rx);
        assert!(backend.send(Packet::close_request(1)).await.is_err());
        backend.send_control(Packet::close_request(2));
        let text = metrics.text();
        assert!(text.contains(&format!("\n{CLOSE_REQ_LOST} 2\n")), "{text}");
    }

    #[tokio::test]
    async fn an_agent_that_does_not_read_has_its_stream_ended_not_a_task_per_packet() {
        let (backend, metrics, _rx) = backend(64);
        // Control packets never wait; once past the reserve the stream ends.
        let mut sent = 0;
        while !backend.end.is_ended() {
            backend.send_control(Packet::close_request(sent));
            sent += 1;
            assert!(sent < 100, "the queue took {sent} packets");
        }
        assert!(backend.tx.queued() < 2 * 64 + flow::packet_cost(&Packet::close_request(1)));
        let text = metrics.text();
        assert!(
            text.contains("konnectivity_rs_server_limit_reached_total{limit=\"agent_queue\"} 1\n"),
            "{text}"
        );
    }

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
