//! The `ProxyService/Proxy` handler: one call is one frontend stream. Its
//! reader feeds packets to the hub and runs what they need to wait for,
//! raced against the stream's end; tonic drains its outbound queue.

use std::{pin::Pin, sync::Arc};

use futures_util::Stream;
use proto::{Packet, proxy_service_server::ProxyService};
use tokio_util::{sync::CancellationToken, task::TaskTracker};
use tonic::{Request, Response, Status, Streaming};
use tracing::{Instrument, debug_span};

use crate::{
    frontend::FrontendGuard,
    hub::Hub,
    link::{FrontendLink, StreamEnd, frontend_queue, taken_by_frontend},
    metrics::PROXY,
    reader::{self, Side},
    router::FrontendKind,
};

/// The packet stream returned to a peer.
pub(crate) type PacketStream = Pin<Box<dyn Stream<Item = Result<Packet, Status>> + Send>>;

/// Serves `ProxyService`.
pub(crate) struct ProxyServiceImpl {
    /// The routing core and the streams' links.
    pub(crate) hub: Arc<Hub>,
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
        let inbound = request.into_inner();
        let (tx, rx) = frontend_queue();
        let end = StreamEnd::new(self.shutdown.child_token());
        let metrics = self.hub.metrics.clone();
        let link = self.hub.add_frontend(FrontendKind::Grpc, |id| {
            FrontendLink::new(id, FrontendKind::Grpc, tx, end.clone(), metrics.clone())
        });
        let hub = self.hub.clone();
        let live = metrics.grpc_stream(PROXY);
        let span = debug_span!("frontend", frontend = %link.id);
        self.tasks.spawn(
            async move {
                let _live = live;
                let guard = FrontendGuard {
                    hub: hub.clone(),
                    link: link.clone(),
                };
                let fe = guard.link.id;
                reader::read(
                    Side::Frontend,
                    inbound,
                    &hub,
                    &link.end,
                    || link.gone(),
                    |hub, packet| hub.frontend_packet(fe, packet),
                )
                .await;
            }
            .instrument(span),
        );
        let packets = taken_by_frontend(rx, self.hub.metrics.clone());
        Ok(Response::new(Box::pin(end.outbound(packets))))
    }
}
