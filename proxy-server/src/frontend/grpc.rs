//! The `ProxyService/Proxy` handler: one call is one [`Frontend`].

use std::sync::Arc;

use futures_util::StreamExt;
use proto::{Packet, proxy_service_server::ProxyService};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::{sync::CancellationToken, task::TaskTracker};
use tonic::{Request, Response, Status, Streaming};
use tracing::{Instrument, debug, debug_span};

use super::{Frontend, FrontendGuard, FrontendKind};
use tunnel::metrics::when_blocked;

use crate::{backend::service::PacketStream, metrics::PROXY, tunnels::Tunnels};

/// Serves `ProxyService`.
pub(crate) struct ProxyServiceImpl {
    /// Shared proxy state.
    pub(crate) tunnels: Arc<Tunnels>,
    /// Capacity of each frontend's outbound queue (`--xfr-channel-size`).
    pub(crate) queue: usize,
    /// Tracker of the reader tasks.
    pub(crate) tasks: TaskTracker,
    /// Stops every reader.
    pub(crate) shutdown: CancellationToken,
}

#[tonic::async_trait]
impl ProxyService for ProxyServiceImpl {
    type ProxyStream = PacketStream;

    async fn proxy(
        &self,
        request: Request<Streaming<Packet>>,
    ) -> Result<Response<PacketStream>, Status> {
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(super::queue_slots(self.queue));
        let frontend = Arc::new(Frontend::new(
            self.tunnels.next_uid(),
            tx,
            self.tunnels.metrics.clone(),
            FrontendKind::Grpc,
        ));
        let tunnels = self.tunnels.clone();
        let metrics = self.tunnels.metrics.clone();
        let live = metrics.grpc_stream(PROXY);
        let shutdown = self.shutdown.clone();
        let span = debug_span!("frontend", frontend = frontend.uid);
        self.tasks.spawn(
            async move {
                let _live = live;
                let guard = FrontendGuard::new(tunnels.clone(), frontend.clone());
                loop {
                    let packet = tokio::select! {
                        () = shutdown.cancelled() => break,
                        packet = inbound.message() => packet,
                    };
                    match packet {
                        Ok(Some(packet)) => {
                            metrics.packet("from_client", &packet);
                            // Handling may wait for credit or room on the
                            // agent stream: it ends with the stream's end
                            // (its response dropped) or shutdown.
                            let handled =
                                when_blocked(tunnels.frontend_packet(&frontend, packet), || {
                                    metrics.blocked(PROXY)
                                });
                            tokio::select! {
                                () = shutdown.cancelled() => break,
                                () = frontend.gone() => break,
                                () = handled => {}
                            }
                        }
                        Ok(None) => break,
                        Err(status) => {
                            metrics.stream_error("from_client", status.code());
                            debug!(error = %status, "frontend stream failed");
                            break;
                        }
                    }
                }
                drop(frontend);
                guard.close().await;
            }
            .instrument(span),
        );
        // Taking an item for the HTTP/2 stream (which has a window of its
        // own) releases its accounting and, with flow control, its credit.
        let metrics = self.tunnels.metrics.clone();
        let stream = ReceiverStream::new(rx).then(move |item| {
            metrics.packet("to_client", &item.packet);
            async move {
                item.taken().await;
                Ok(item.packet)
            }
        });
        Ok(Response::new(Box::pin(stream)))
    }
}
