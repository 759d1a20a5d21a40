//! The `AgentService/Connect` handler: one call is one [`Backend`].

use std::{net::SocketAddr, sync::Arc};

use futures_util::StreamExt;
use proto::{Packet, agent_service_server::AgentService, header};
use tokio_util::{sync::CancellationToken, task::TaskTracker};
use tonic::{Request, Response, Status, Streaming, metadata::MetadataValue};
use tracing::{Instrument, debug, info, info_span, warn};
use tunnel::{conn::PeerAddr, ids::AgentId, ids::ServerId};

use crate::{
    frontend::grpc::PacketStream,
    hub::Hub,
    link::{BACKEND_CONTROL_RESERVE, BackendLink, StreamEnd},
    metrics::CONNECT,
    reader::{self, Side},
    router::{AgentInfo, BackendId},
    strategy::AgentIdentifiers,
};

/// Serves `AgentService`.
pub(crate) struct AgentServiceImpl {
    /// The routing core and the streams' links.
    pub(crate) hub: Arc<Hub>,
    /// This server's id (`serverid` header).
    pub(crate) server_id: ServerId,
    /// Replica count (`servercount` header).
    pub(crate) server_count: u32,
    /// Tracker of the reader tasks.
    pub(crate) tasks: TaskTracker,
    /// Parent of every backend's token.
    pub(crate) shutdown: CancellationToken,
    /// Offer per-connection flow control to agents that ask for it.
    pub(crate) flow_control: bool,
    /// Agent token authentication, if on.
    pub(crate) token_auth: Option<Arc<crate::auth::TokenAuth>>,
    /// Bytes queued towards one agent before its senders wait
    /// (`--max-agent-queue-bytes`).
    pub(crate) queue_bytes: usize,
}

/// Reads the single value of a metadata key that must appear exactly once.
fn exactly_one(request: &Request<Streaming<Packet>>, key: &str) -> Result<String, Status> {
    let values: Vec<_> = request.metadata().get_all(key).iter().collect();
    match values.as_slice() {
        [one] => one
            .to_str()
            .map(str::to_owned)
            .map_err(|_| Status::invalid_argument(format!("{key} is not valid text"))),
        _ => Err(Status::invalid_argument(format!(
            "expected one agent ID in the context, got {:?}",
            values
                .iter()
                .map(|v| v.to_str().unwrap_or("?"))
                .collect::<Vec<_>>()
        ))),
    }
}

fn identifiers(request: &Request<Streaming<Packet>>) -> Result<AgentIdentifiers, Status> {
    let values: Vec<_> = request
        .metadata()
        .get_all(header::AGENT_IDENTIFIERS)
        .iter()
        .collect();
    match values.as_slice() {
        [] => Ok(AgentIdentifiers::default()),
        [one] => one
            .to_str()
            .map(AgentIdentifiers::parse)
            .map_err(|_| Status::invalid_argument("agentidentifiers is not valid text")),
        many => Err(Status::invalid_argument(format!(
            "expected at most one agent identifiers value, got {}",
            many.len()
        ))),
    }
}

#[tonic::async_trait]
impl AgentService for AgentServiceImpl {
    type ConnectStream = PacketStream;

    async fn connect(
        &self,
        request: Request<Streaming<Packet>>,
    ) -> Result<Response<PacketStream>, Status> {
        let peer = request.extensions().get::<PeerAddr>().map(|p| p.0);
        // Counted from the start of the call, refused ones too (ANP).
        let live = self.hub.metrics.grpc_stream(CONNECT);
        // Authenticate first, as ANP does; the token itself is never logged.
        if let Some(auth) = &self.token_auth
            && let Err(error) = auth.authenticate(request.metadata()).await
        {
            warn!(peer.addr = ?peer, %error, "agent refused");
            return Err(Status::unauthenticated(error.to_string()));
        }
        let agent_id = match exactly_one(&request, header::AGENT_ID) {
            Ok(id) => AgentId(id),
            Err(status) => {
                debug!(peer.addr = ?peer, error = %status.message(), "agent refused");
                return Err(status);
            }
        };
        let identifiers = identifiers(&request)?;
        let flow_control = self.flow_control
            && tunnel::flow::announced(
                request
                    .metadata()
                    .get(tunnel::flow::HEADER)
                    .and_then(|v| v.to_str().ok()),
            );
        let inbound = request.into_inner();

        let (tx, rx) = tunnel::queue::queue(self.queue_bytes, BACKEND_CONTROL_RESERVE);
        let end = StreamEnd::new(self.shutdown.child_token());
        let link = BackendLink::new(
            agent_id.clone(),
            peer,
            tx,
            end.clone(),
            self.hub.metrics.clone(),
        );
        let be = self.hub.add_backend(
            AgentInfo {
                agent_id: agent_id.clone(),
                identifiers,
                flow_control,
            },
            link,
        );
        info!(agent.id = %agent_id, peer.addr = ?peer, flow_control, "agent connected");

        let hub = self.hub.clone();
        let span = info_span!("backend", agent.id = %agent_id);
        let reader_end = end.clone();
        self.tasks.spawn(
            async move {
                let _live = live;
                let _guard = BackendGuard {
                    hub: hub.clone(),
                    backend: be,
                    agent_id,
                    peer,
                };
                reader::read(
                    Side::Agent,
                    inbound,
                    &hub,
                    &reader_end,
                    || reader_end.ended(),
                    |hub, packet| hub.backend_packet(be, packet),
                )
                .await;
            }
            .instrument(span),
        );

        let metrics = self.hub.metrics.clone();
        let stream = end.outbound(rx.map(move |packet| {
            metrics.packet("to_agent", &packet);
            packet
        }));
        let mut response = Response::new(Box::pin(stream) as PacketStream);
        let headers = response.metadata_mut();
        headers.insert(
            header::SERVER_ID,
            MetadataValue::try_from(self.server_id.0.as_str())
                .map_err(|_| Status::internal("server id is not valid metadata"))?,
        );
        headers.insert(header::SERVER_COUNT, MetadataValue::from(self.server_count));
        if flow_control {
            headers.insert(
                tunnel::flow::HEADER,
                MetadataValue::from_static(tunnel::flow::VERSION),
            );
        }
        Ok(response)
    }
}

/// Tells the hub that an agent stream ended when its reader ends, on error,
/// cancel and panic alike: its connections are closed towards their
/// frontends and its pending dials fail.
struct BackendGuard {
    /// The hub.
    hub: Arc<Hub>,
    /// The agent stream.
    backend: BackendId,
    /// Its agent, for the log.
    agent_id: AgentId,
    /// Its address, for the log.
    peer: Option<SocketAddr>,
}

impl Drop for BackendGuard {
    fn drop(&mut self) {
        self.hub.backend_closed(self.backend);
        info!(agent.id = %self.agent_id, peer.addr = ?self.peer, "agent disconnected");
    }
}
