//! [`ToServer`]: the sending side of one server stream, shared by its
//! reader, its dials and its connections.

use std::sync::Arc;

use proto::Packet;
use tokio_util::sync::CancellationToken;
use tracing::warn;
use tunnel::{
    flow,
    mover::ControlSink,
    queue::{QueueTx, Unread},
};

use crate::metrics::AgentMetrics;

/// Where one server stream's packets go, and how the stream is ended when
/// the server stops reading it.
#[derive(Clone)]
pub(crate) struct ToServer {
    /// The stream's outbound queue, bounded in bytes.
    tx: QueueTx<Packet>,
    /// Ends the stream and every task of it.
    stream: CancellationToken,
    /// Where lost packets and the limit are counted.
    metrics: Arc<AgentMetrics>,
}

impl ToServer {
    pub(crate) fn new(
        tx: QueueTx<Packet>,
        stream: CancellationToken,
        metrics: Arc<AgentMetrics>,
    ) -> Self {
        Self {
            tx,
            stream,
            metrics,
        }
    }

    /// The queue itself, for a connection's DATA (which waits for room).
    pub(crate) fn queue(&self) -> &QueueTx<Packet> {
        &self.tx
    }

    /// Queues a control packet without waiting: readers and connection ends
    /// send these and must not wait on a server. Past the queue's reserve
    /// the server has stopped reading the stream, which is then ended.
    /// `false` if the packet was not queued.
    pub(crate) fn control(&self, packet: Packet) -> bool {
        let cost = flow::packet_cost(&packet);
        self.tx.push_or_end(packet, cost, self, |packet| {
            self.metrics.send_failed(&packet);
        })
    }
}

/// Ends a server stream that the server does not read.
impl Unread for ToServer {
    fn is_ended(&self) -> bool {
        self.stream.is_cancelled()
    }

    fn end_unread(&self, queued: usize, first: bool) {
        if first {
            warn!(queued, "the server does not read its stream; closing it");
            self.metrics.limit_reached();
        }
        self.stream.cancel();
    }
}

impl ControlSink for ToServer {
    fn send_control(&self, packet: Packet) -> bool {
        self.control(packet)
    }
}
