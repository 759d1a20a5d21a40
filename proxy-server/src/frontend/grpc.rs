//! The `ProxyService/Proxy` handler: one call is one [`Frontend`].

use std::sync::Arc;

use futures_util::StreamExt;
use proto::{Packet, proxy_service_server::ProxyService};
use tokio_util::{sync::CancellationToken, task::TaskTracker};
use tonic::{Request, Response, Status, Streaming};
use tracing::{Instrument, debug, debug_span, warn};

use super::{Frontend, FrontendGuard, FrontendKind};
use runtime::metrics::when_blocked;

use crate::{
    backend::service::PacketStream,
    metrics::PROXY,
    stream_end::{StreamEnd, receive_error},
    tunnels::Tunnels,
};

/// Serves `ProxyService`.
pub(crate) struct ProxyServiceImpl {
    /// Shared proxy state.
    pub(crate) tunnels: Arc<Tunnels>,
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
        let (tx, rx) = super::queue();
        let end = StreamEnd::new(self.shutdown.child_token());
        let frontend = Arc::new(Frontend::new(
            self.tunnels.next_uid(),
            tx,
            end.clone(),
            self.tunnels.metrics.clone(),
            FrontendKind::Grpc,
        ));
        let tunnels = self.tunnels.clone();
        let metrics = self.tunnels.metrics.clone();
        let live = metrics.grpc_stream(PROXY);
        let span = debug_span!("frontend", frontend = frontend.uid);
        self.tasks.spawn(
            async move {
                let _live = live;
                let _guard = FrontendGuard::new(tunnels.clone(), frontend.clone());
                loop {
                    let packet = tokio::select! {
                        () = frontend.gone() => break,
                        packet = inbound.message() => packet,
                    };
                    match packet {
                        Ok(Some(packet)) => {
                            metrics.packet("from_client", &packet);
                            // Handling may wait for credit or room on the
                            // agent stream: it ends with the stream's end
                            // (ended here or its response dropped), which
                            // shutdown brings too.
                            let handled = when_blocked(
                                tunnels.frontend_packet(&frontend, packet),
                                || metrics.blocked(PROXY),
                            );
                            tokio::select! {
                                () = frontend.gone() => break,
                                () = handled => {}
                            }
                        }
                        Ok(None) => break,
                        Err(status) => {
                            let status = receive_error(status);
                            metrics.stream_error("from_client", status.code());
                            debug!(error = %status, "frontend stream failed");
                            if status.code() == tonic::Code::ResourceExhausted {
                                warn!(error = %status.message(), "frontend sent a message over the limit; closing its stream");
                                frontend.end.fail(status);
                            }
                            break;
                        }
                    }
                }
            }
            .instrument(span),
        );
        // Taking an item for the HTTP/2 stream (which has a window of its
        // own) releases its accounting and, with flow control, its credit.
        let metrics = self.tunnels.metrics.clone();
        let packets = rx.map(move |item| {
            metrics.packet("to_client", &item.packet);
            item.taken();
            item.packet
        });
        Ok(Response::new(Box::pin(end.outbound(packets))))
    }
}
