//! The `AgentService/Connect` handler and its driver: one call is one
//! backend (ANP's name for an agent stream).
//!
//! The driver ([`BackendDriver`]) reads the agent's packets and owns the
//! table of the stream's connections (connect id → [`Conn`]: the
//! frontend's queue and the connection's flow state). DATA and credit are
//! handled against that table without any lock another stream takes;
//! everything else goes to the control core (`control`), which answers a
//! DIAL_RSP with the connection it opened. tonic drains the stream's
//! outbound queue ([`BackendLink`]).

use std::{net::SocketAddr, sync::Arc};

use futures_util::StreamExt;
use proto::{Packet, agent_service_server::AgentService, header};
use tokio_util::{sync::CancellationToken, task::TaskTracker};
use tonic::{Request, Response, Status, Streaming, metadata::MetadataValue};
use tracing::{Instrument, debug, info, info_span, warn};
use tunnel::{
    blocked::when_blocked,
    flow::{self, Scheme, Version, Window},
    ids::{AgentId, ConnId, ServerId},
};

use crate::{
    conn::{Conn, ConnTable, Delivery, Lookup},
    control::Control,
    frontend::grpc::PacketStream,
    metrics::{Method, Segment},
    router::{AgentInfo, BackendId},
    strategy::AgentIdentifiers,
    stream::{BACKEND_CONTROL_RESERVE, BackendLink, StreamEnd, next_packet},
};

/// Serves `AgentService`.
pub(crate) struct AgentServiceImpl {
    /// The control core.
    pub(crate) control: Arc<Control>,
    /// This server's id (`serverid` header).
    pub(crate) server_id: ServerId,
    /// Replica count (`servercount` header).
    pub(crate) server_count: u32,
    /// Tracker of the drivers.
    pub(crate) tasks: TaskTracker,
    /// Parent of every backend's token.
    pub(crate) shutdown: CancellationToken,
    /// Offer per-connection flow control to agents that ask for it, with
    /// this receive window (`None`: not offered).
    pub(crate) flow_window: Option<Window>,
    /// What is announced of it (`--flow-control-version`).
    pub(crate) flow_version: Version,
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

/// What the agent's metadata says of flow control, against what this
/// server offers.
fn scheme(
    request: &Request<Streaming<Packet>>,
    offered: Option<Window>,
    version: Version,
) -> Result<Scheme, Status> {
    let metadata = request.metadata();
    let theirs = Window::announced(|key| metadata.get(key).and_then(|v| v.to_str().ok()))
        .map_err(|e| Status::invalid_argument(e.to_string()))?;
    Ok(Scheme::negotiate(
        offered.is_some(),
        version,
        offered.unwrap_or_default(),
        theirs,
    ))
}

impl AgentServiceImpl {
    /// Checks a `Connect` call: its token, its agent id, its identifiers,
    /// its flow-control numbers.
    async fn admit(
        &self,
        request: &Request<Streaming<Packet>>,
        peer: Option<SocketAddr>,
    ) -> Result<(AgentInfo, Scheme), Status> {
        // Authenticate first, as ANP does; the token itself is never logged.
        // The wait ends with the stream (tonic drops this future when the
        // stream is reset or its connection ends) or at shutdown.
        if let Some(auth) = &self.token_auth {
            let verdict = tokio::select! {
                verdict = auth.authenticate(request.metadata()) => verdict,
                () = self.shutdown.cancelled() => {
                    return Err(Status::unavailable("proxy-server is shutting down"));
                }
            };
            if let Err(error) = verdict {
                // Refusals under load are logged once where the limit is.
                if error.is_load() {
                    debug!(peer.addr = ?peer, %error, "agent refused");
                } else {
                    warn!(peer.addr = ?peer, %error, "agent refused");
                }
                return Err(error.status());
            }
        }
        let checked = exactly_one(request, header::AGENT_ID).and_then(|id| {
            Ok((
                AgentInfo {
                    agent_id: AgentId(id),
                    identifiers: identifiers(request)?,
                },
                scheme(request, self.flow_window, self.flow_version)?,
            ))
        });
        if let Err(status) = &checked {
            debug!(peer.addr = ?peer, error = %status.message(), "agent refused");
        }
        checked
    }

    /// The response headers: who we are and, with credit, our window.
    fn headers(&self, response: &mut Response<PacketStream>, scheme: Scheme) -> Result<(), Status> {
        let headers = response.metadata_mut();
        headers.insert(
            header::SERVER_ID,
            MetadataValue::try_from(self.server_id.0.as_str())
                .map_err(|_| Status::internal("server id is not valid metadata"))?,
        );
        headers.insert(header::SERVER_COUNT, MetadataValue::from(self.server_count));
        if let (Scheme::Credit { .. }, Some(window)) = (scheme, self.flow_window) {
            for (key, value) in window.headers(self.flow_version) {
                let value = MetadataValue::try_from(value)
                    .map_err(|_| Status::internal("flow-control header is not valid metadata"))?;
                headers.insert(key, value);
            }
        }
        Ok(())
    }
}

#[tonic::async_trait]
impl AgentService for AgentServiceImpl {
    type ConnectStream = PacketStream;

    async fn connect(
        &self,
        request: Request<Streaming<Packet>>,
    ) -> Result<Response<PacketStream>, Status> {
        let peer = request.remote_addr();
        let metrics = self.control.metrics.clone();
        // Counted from the start of the call, refused ones too (ANP).
        let live = metrics.grpc_stream(Method::Connect);
        let (info, scheme) = self.admit(&request, peer).await?;
        let agent_id = info.agent_id.clone();
        let (tx, rx) = tunnel::queue::queue(self.queue_bytes, BACKEND_CONTROL_RESERVE);
        let end = StreamEnd::new(self.shutdown.child_token());
        let link = BackendLink::new(
            agent_id.clone(),
            peer,
            scheme,
            tx,
            end.clone(),
            metrics.clone(),
        );
        let id = self.control.add_backend(info, link);
        info!(agent.id = %agent_id, peer.addr = ?peer, credit = scheme.is_credit(), "agent connected");
        let driver = BackendDriver {
            id,
            control: self.control.clone(),
            conns: ConnTable::default(),
            end: end.clone(),
        };
        let inbound = request.into_inner();
        let span = info_span!("backend", agent.id = %agent_id);
        let audit = self.control.audit.clone();
        self.tasks.spawn(
            tunnel::sync::audit::scope(audit.clone(), id.taker(), async move {
                let _live = live;
                let _guard = BackendGuard {
                    control: driver.control.clone(),
                    backend: id,
                    agent_id,
                    peer,
                };
                driver.run(inbound).await;
            })
            .instrument(span),
        );
        let stream = end.outbound(rx.map(move |packet| {
            metrics.packets.count(Segment::ToAgent, packet.r#type);
            packet
        }));
        let stream = crate::stream::audited(audit, id.taker(), stream);
        let mut response = Response::new(Box::pin(stream) as PacketStream);
        self.headers(&mut response, scheme)?;
        Ok(response)
    }
}

/// One agent stream's driver; see the module documentation.
struct BackendDriver {
    /// The stream.
    id: BackendId,
    /// The control core.
    control: Arc<Control>,
    /// The stream's established connections.
    conns: ConnTable,
    /// The stream's end.
    end: Arc<StreamEnd>,
}

/// A wait a packet needs: DATA for a frontend, from an agent without
/// credit, waiting for room in its connection's window.
struct Wait {
    /// The connection.
    conn: Arc<Conn>,
    /// The payload.
    data: bytes::Bytes,
}

impl BackendDriver {
    /// Reads the agent's packets until it ends the stream, the stream
    /// fails or is ended inside the server (shutdown included); every wait
    /// is raced against that end.
    async fn run(mut self, mut inbound: Streaming<Packet>) {
        let end = self.end.clone();
        let ended = end.ended();
        tokio::pin!(ended);
        let metrics = self.control.metrics.clone();
        while let Some(packet) = next_packet(
            &mut inbound,
            ended.as_mut(),
            Segment::FromAgent,
            &end,
            &metrics,
        )
        .await
        {
            let Some(wait) = self.handle(packet) else {
                continue;
            };
            let http_connect = wait.conn.to_http_connect();
            let waited = when_blocked(self.deliver_wait(wait), || {
                let write = http_connect.then(|| metrics.write_blocked());
                (metrics.blocked(Method::Connect), write)
            });
            tokio::select! {
                () = &mut ended => return,
                () = waited => {}
            }
        }
    }

    /// Handles one packet; the wait it needs, if any.
    fn handle(&mut self, packet: Packet) -> Option<Wait> {
        if let Some((id, credit)) = flow::parse_credit(&packet) {
            if let Lookup::Open(conn) = self.conns.lookup(ConnId(id)) {
                conn.flow.grant(credit);
            }
            return None;
        }
        if packet.r#type == proto::PacketType::Data as i32 {
            return self.data(packet);
        }
        if packet.r#type == proto::PacketType::CloseRsp as i32
            && let Some(proto::Payload::CloseResponse(rsp)) = &packet.payload
        {
            // The agent is done with it, whoever closed it.
            self.conns.remove(ConnId(rsp.connect_id));
        }
        if let Some(conn) = self.control.backend_packet(self.id, packet) {
            self.conns.insert(conn);
        }
        None
    }

    /// Agent DATA: to its connection's frontend, never waiting with credit.
    fn data(&mut self, packet: Packet) -> Option<Wait> {
        let Some(proto::Payload::Data(data)) = &packet.payload else {
            return None;
        };
        let id = ConnId(data.connect_id);
        let conn = match self.conns.lookup(id) {
            Lookup::Open(conn) => conn,
            // Sent before the agent learnt of the close.
            Lookup::Closed => return None,
            Lookup::Unknown => {
                self.control.backend_packet(self.id, packet);
                return None;
            }
        };
        match conn.deliver(&data.data) {
            Delivery::Queued | Delivery::Gone => None,
            Delivery::Overflow => {
                self.control.overflow(self.id, id);
                None
            }
            Delivery::Wait => Some(Wait {
                conn,
                data: data.data.clone(),
            }),
        }
    }

    /// Waits for room for DATA from an agent without credit (its frontend
    /// must drain within `COMPAT_STALL`).
    async fn deliver_wait(&self, wait: Wait) {
        if wait.conn.deliver_wait(wait.data).await == Delivery::Overflow {
            self.control.overflow(self.id, wait.conn.id);
        }
    }
}

/// Tells the control core that an agent stream ended when its driver ends,
/// on error, cancel and panic alike: its connections are closed towards
/// their frontends and its pending dials fail.
struct BackendGuard {
    /// The control core.
    control: Arc<Control>,
    /// The agent stream.
    backend: BackendId,
    /// Its agent, for the log.
    agent_id: AgentId,
    /// Its address, for the log.
    peer: Option<SocketAddr>,
}

impl Drop for BackendGuard {
    fn drop(&mut self) {
        self.control.backend_closed(self.backend);
        info!(agent.id = %self.agent_id, peer.addr = ?self.peer, "agent disconnected");
    }
}
