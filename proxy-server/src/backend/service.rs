//! The `AgentService` handler: admits an agent's `Connect` call (its
//! token, its id and identifiers, its flow-control numbers), registers
//! the stream with the control core and starts its driver.

use std::{net::SocketAddr, sync::Arc};

use futures_util::StreamExt;
use proto::{Packet, agent_service_server::AgentService, header};
use tokio_util::{sync::CancellationToken, task::TaskTracker};
use tonic::{Request, Response, Status, Streaming, metadata::MetadataValue};
use tracing::{debug, info, info_span, warn};
use tunnel::{
    flow::{Scheme, Version, Window},
    ids::{AgentId, ServerId},
};

use super::{BackendGuard, driver::BackendDriver};
use crate::{
    conn::{BACKEND_CONTROL_RESERVE, BackendLink, ConnTable},
    control::Control,
    metrics::{Method, Segment},
    router::{AgentInfo, Credential},
    strategy::{self, AgentIdentifiers},
    stream::{PacketStream, StreamEnd, spawn_driver},
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
    /// Accept only identifiers the agent's certificate names
    /// (`--verify-agent-identifiers`).
    pub(crate) verify_identifiers: bool,
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

/// With `--verify-agent-identifiers`: refuses identifiers and an agent id
/// the agent's client certificate does not name; the certificate is then
/// the stream's credential (`cert:` and its SHA-256).
fn certified(request: &Request<Streaming<Packet>>, info: &AgentInfo) -> Result<Credential, Status> {
    let certs = request.peer_certs();
    let Some(leaf) = certs.as_deref().and_then(|chain| chain.first()) else {
        return Err(Status::permission_denied(
            "--verify-agent-identifiers: the agent presented no client certificate",
        ));
    };
    let names = ops::tls::files::alt_names(leaf).unwrap_or_default();
    let unnamed = |what: String| {
        Status::permission_denied(format!(
            "{what} is not named by the agent's client certificate (--verify-agent-identifiers: its common name is {:?}, its subject alternative names are DNS {:?}, IP {:?}, URI {:?})",
            names.common_name.as_deref().unwrap_or(""),
            names.dns,
            names.ips,
            names.uris
        ))
    };
    if let Some(claim) = info.identifiers.uncertified(&names) {
        return Err(unnamed(format!("agent identifier {claim}")));
    }
    if !strategy::names_agent(&names, &info.agent_id.0) {
        return Err(unnamed(format!(
            "agent id {}",
            proto::text::Elided(&info.agent_id.0)
        )));
    }
    let digest = ring::digest::digest(&ring::digest::SHA256, leaf.as_ref());
    let hex: String = digest.as_ref().iter().map(|b| format!("{b:02x}")).collect();
    Ok(Credential(format!("cert:{hex}")))
}

/// In token mode: the node the agent's token is bound to is its credential
/// (`node:<name>`); with `--verify-agent-identifiers` the token must be
/// bound to a node, every `host=` must be that node, and `cidr=` and
/// `default-route=true`, which no token grants, are refused. `ipv4=` and
/// `ipv6=` stay the agent's word: a TokenReview names no address.
fn node_bound(
    info: &AgentInfo,
    review: &crate::auth::Admitted,
    verify: bool,
) -> Result<Option<Credential>, Status> {
    let credential = review
        .node
        .as_ref()
        .map(|node| Credential(format!("node:{node}")));
    if !verify {
        return Ok(credential);
    }
    let Some(node) = &review.node else {
        return Err(Status::permission_denied(format!(
            "--verify-agent-identifiers: the agent's token is not bound to a node (no {} in its TokenReview)",
            crate::auth::NODE_NAME_EXTRA
        )));
    };
    let ids = &info.identifiers;
    let claim = ids
        .hosts
        .iter()
        .find(|host| !host.eq_ignore_ascii_case(node))
        .map(|host| format!("host={host}"))
        .or_else(|| ids.cidrs.first().map(|net| format!("cidr={net}")))
        .or_else(|| ids.default_route.then(|| "default-route=true".to_owned()));
    match claim {
        None => Ok(credential),
        Some(claim) => Err(Status::permission_denied(format!(
            "agent identifier {} is not granted by the agent's token (--verify-agent-identifiers: it is bound to node {node}; host= must be that node, and no token grants cidr= or default-route=true)",
            proto::text::Elided(&claim)
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
    /// its flow-control numbers; then lets its data through
    /// ([`edge::gate`]).
    async fn admit(
        &self,
        request: &mut Request<Streaming<Packet>>,
        peer: Option<SocketAddr>,
    ) -> Result<(AgentInfo, Scheme), Status> {
        // Authenticate first, as ANP does; the token itself is never logged.
        // The wait ends with the stream (tonic drops this future when the
        // stream is reset or its connection ends), at shutdown, or when the
        // agent sends data before it is admitted (it holds none meanwhile).
        let mut admitted = None;
        if let Some(auth) = &self.token_auth {
            let (metadata, body) = (request.metadata().clone(), request.get_mut());
            let verdict = tokio::select! {
                verdict = auth.authenticate(&metadata, peer.map(|p| p.ip())) => verdict,
                early = body.message() => {
                    let status = match early {
                        Err(status) => status,
                        Ok(Some(_)) => Status::invalid_argument(edge::gate::EARLY_DATA),
                        Ok(None) => Status::invalid_argument(
                            "the agent ended its stream before it was admitted",
                        ),
                    };
                    debug!(peer.addr = ?peer, error = %status.message(), "agent refused");
                    return Err(status);
                }
                () = self.shutdown.cancelled() => {
                    return Err(Status::unavailable("proxy-server is shutting down"));
                }
            };
            match verdict {
                Ok(review) => admitted = Some(review),
                Err(error) => {
                    // Refusals under load are logged once where the limit is;
                    // those without a review come as fast as a peer sends
                    // them, and are counted
                    // (konnectivity_rs_server_token_reviews_skipped_total).
                    if error.is_load() || matches!(error, crate::auth::AuthError::Claims(_)) {
                        debug!(peer.addr = ?peer, %error, "agent refused");
                    } else {
                        warn!(peer.addr = ?peer, %error, "agent refused");
                    }
                    return Err(error.status());
                }
            }
        }
        let checked = exactly_one(request, header::AGENT_ID).and_then(|id| {
            Ok((
                AgentInfo {
                    agent_id: AgentId(id),
                    identifiers: identifiers(request)?,
                    credential: None,
                },
                scheme(request, self.flow_window, self.flow_version)?,
            ))
        });
        let checked = checked.and_then(|(mut info, scheme)| {
            let vouched = match &admitted {
                Some(review) => node_bound(&info, review, self.verify_identifiers),
                None if self.verify_identifiers => certified(request, &info).map(Some),
                None => Ok(None),
            };
            info.credential = vouched.inspect_err(|status| {
                warn!(peer.addr = ?peer, agent.id = %info.agent_id, error = %status.message(), "agent refused");
            })?;
            Ok((info, scheme))
        });
        if let Err(status) = &checked {
            debug!(peer.addr = ?peer, error = %status.message(), "agent refused");
        }
        if let Some(gate) = request.extensions().get::<edge::gate::Gate>() {
            gate.open();
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
        mut request: Request<Streaming<Packet>>,
    ) -> Result<Response<PacketStream>, Status> {
        let peer = request.remote_addr();
        let metrics = self.control.metrics.clone();
        // Counted from the start of the call, refused ones too (ANP).
        let live = metrics.grpc_stream(Method::Connect);
        let (info, scheme) = self.admit(&mut request, peer).await?;
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
        let id = self.control.admit_backend(info, link).map_err(|cap| {
            warn!(agent.id = %agent_id, peer.addr = ?peer, limit = cap, "agent refused: its credential has --max-agent-streams-per-credential streams open");
            Status::resource_exhausted(format!(
                "this agent's credential already has {cap} streams open (--max-agent-streams-per-credential)"
            ))
        })?;
        info!(agent.id = %agent_id, peer.addr = ?peer, credit = scheme.is_credit(), "agent connected");
        let mut driver = BackendDriver {
            id,
            control: self.control.clone(),
            conns: ConnTable::default(),
            end: end.clone(),
        };
        let mut inbound = request.into_inner();
        let guard = BackendGuard {
            control: self.control.clone(),
            backend: id,
            agent_id: agent_id.clone(),
            peer,
        };
        let stream = spawn_driver(
            &self.tasks,
            &self.control.audit,
            id.taker(),
            info_span!("backend", agent.id = %agent_id),
            // The driver and its stream live here and are lent to `run`:
            // moved into it, each would take its room twice in the task.
            async move {
                let _live = live;
                let _guard = guard;
                driver.run(&mut inbound).await;
                // Gone before the guards, as when `run` took them.
                drop(driver);
                drop(inbound);
            },
            end.outbound(rx.map(move |packet| {
                metrics.packets.count(Segment::ToAgent, packet.r#type);
                packet
            })),
        );
        let mut response = Response::new(stream);
        self.headers(&mut response, scheme)?;
        Ok(response)
    }
}
