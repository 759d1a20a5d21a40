//! The `ProxyService/Proxy` handler and its driver: one call is one
//! frontend stream.
//!
//! The driver ([`FrontendDriver`]) reads the frontend's packets and owns
//! the table of the stream's connections (connect id → [`Conn`](crate::conn::Conn)),
//! which the agent streams that establish them hand over
//! ([`Attachments`](crate::conn::Attachments)). DATA goes to its
//! connection's agent without any lock another stream takes, waiting only
//! for that connection's credit and its agent's queue; everything else
//! goes to the control core. tonic drains the stream's outbound queue,
//! each item taken releasing its window ([`taken_by_frontend`]).

use std::{pin::Pin, sync::Arc};

use futures_util::Stream;
use proto::{Packet, proxy_service_server::ProxyService};
use tokio_util::{sync::CancellationToken, task::TaskTracker};
use tonic::{Request, Response, Status, Streaming};
use tracing::{Instrument, debug_span};
use tunnel::{blocked::when_blocked, ids::ConnId};

use crate::{
    conn::{ConnTable, FrontendLink, FrontendTx, Lookup, frontend_queue, taken_by_frontend},
    control::{Control, Work},
    frontend::FrontendGuard,
    metrics::{Method, Segment},
    router::FrontendKind,
    stream::{StreamEnd, next_packet},
};

/// The packet stream returned to a peer.
pub(crate) type PacketStream = Pin<Box<dyn Stream<Item = Result<Packet, Status>> + Send>>;

/// Serves `ProxyService`.
pub(crate) struct ProxyServiceImpl {
    /// The control core.
    pub(crate) control: Arc<Control>,
    /// Tracker of the drivers.
    pub(crate) tasks: TaskTracker,
    /// Stops every driver.
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
        let metrics = self.control.metrics.clone();
        let link = self.control.add_frontend(FrontendKind::Grpc, |id| {
            FrontendTx::new(id, FrontendKind::Grpc, tx, end.clone(), metrics.clone())
        });
        let live = metrics.grpc_stream(Method::Proxy);
        let span = debug_span!("frontend", frontend = %link.id());
        let driver = FrontendDriver {
            link: link.clone(),
            control: self.control.clone(),
            conns: ConnTable::default(),
        };
        let guard = FrontendGuard {
            control: self.control.clone(),
            link,
        };
        self.tasks.spawn(
            async move {
                let _live = live;
                let _guard = guard;
                driver.run(inbound).await;
            }
            .instrument(span),
        );
        let packets = taken_by_frontend(rx, metrics);
        Ok(Response::new(Box::pin(end.outbound(packets))))
    }
}

/// One frontend stream's driver; see the module documentation.
struct FrontendDriver {
    /// The stream.
    link: FrontendLink,
    /// The control core.
    control: Arc<Control>,
    /// The stream's established connections.
    conns: ConnTable,
}

impl FrontendDriver {
    /// Reads the frontend's packets until it ends the stream, the stream
    /// fails, is ended inside the server (shutdown included) or its
    /// response is dropped; every wait is raced against that end.
    async fn run(mut self, mut inbound: Streaming<Packet>) {
        let tx = self.link.tx.clone();
        let gone = tx.gone();
        tokio::pin!(gone);
        let metrics = self.control.metrics.clone();
        while let Some(packet) = next_packet(
            &mut inbound,
            gone.as_mut(),
            Segment::FromClient,
            &tx.end,
            &metrics,
        )
        .await
        {
            let Some(work) = self.handle(packet) else {
                continue;
            };
            let waited = when_blocked(self.wait(work), || metrics.blocked(Method::Proxy));
            tokio::select! {
                () = &mut gone => return,
                () = waited => {}
            }
        }
    }

    /// Handles one packet; the wait it needs, if any.
    fn handle(&mut self, packet: Packet) -> Option<Work> {
        // Connections established since the last packet: the frontend may
        // use them from now on.
        for conn in self.link.attachments.take() {
            self.conns.insert(conn);
        }
        if packet.r#type == proto::PacketType::Data as i32 {
            let Some(proto::Payload::Data(data)) = &packet.payload else {
                return None;
            };
            match self.conns.lookup(ConnId(data.connect_id)) {
                Lookup::Open(conn) => {
                    return Some(Work::Upload {
                        conn,
                        data: data.data.clone(),
                    });
                }
                // Sent before the frontend learnt of the close.
                Lookup::Closed => return None,
                Lookup::Unknown if data.connect_id == 0 => return None,
                Lookup::Unknown => {}
            }
        }
        self.control.frontend_packet(self.link.id(), packet)
    }

    /// Runs a wait: DATA to its agent, or a dial waiting for room.
    async fn wait(&self, work: Work) {
        match work {
            Work::Upload { conn, data } => {
                conn.upload(data).await;
            }
            work => self.control.run(work).await,
        }
    }
}
