//! The server's OpenTelemetry spans (`--tracing-config-file`), kept beside
//! the router under the control lock and fed the router's output: a span
//! per dial, from its DIAL_REQ to its DIAL_RSP (destination, the agents
//! tried, retries, whether it was hedged, how it ended), then one per
//! tunnel, from its DIAL_RSP to its end (its bytes each way and why it
//! ended). A dial continues its frontend's trace when the frontend sent a
//! W3C `traceparent` (gRPC metadata of its stream, or a header of its
//! CONNECT request); its context goes to the agent in the DIAL_REQ
//! (`DialRequest.traceparent`). Nothing here is on the bytes' path: the
//! byte counts are read from the connection once, at its end.
//!
//! The same bookkeeping makes the audit log's server records
//! (`--audit-log-path`, [`audit`]): one per frontend dial, written where
//! its spans end, handed to the log's sink without waiting.

mod audit;

use std::{collections::HashMap, time::Duration};

use ops::{
    audit::{AuditRecord, Sink},
    otel::{Attr, Kind, Parent, Span, Tracing},
};
use proto::{Packet, PacketType, Payload};
use tunnel::{
    compact,
    ids::{AgentId, ConnId, DialId},
};

pub(crate) use self::audit::FrontendPeer;
use self::audit::{End, Outcome, Pending};
use crate::{
    events::{CloseReason, DialError},
    router::{BackendId, FrontendId},
};

/// A dial in flight.
struct DialTrace {
    span: Span,
    /// DIAL_REQs sent.
    attempts: i64,
    /// Agents asked again after one failed the dial.
    retries: i64,
    /// Whether a second agent was asked while the first had not answered.
    hedged: bool,
    /// Agents it was hedged to.
    hedges: u32,
    /// Its audit record in the making (audit log on).
    record: Option<Pending>,
}

/// An established tunnel.
struct TunnelTrace {
    span: Span,
    /// Its audit record in the making, with the dial's retries and hedges.
    record: Option<(Pending, u32, u32)>,
    connection_id: i64,
    frontend: FrontendId,
}

/// A tunnel that just closed, until the router says why.
struct Closing {
    span: Span,
    record: Option<(Pending, u32, u32)>,
    connection_id: i64,
    bytes: (u64, u64),
}

/// The spans of dials and tunnels in progress.
#[derive(Default)]
pub(crate) struct Traces {
    tracing: Tracing,
    /// Frontends that sent a trace context.
    parents: HashMap<FrontendId, Parent>,
    dials: HashMap<DialId, DialTrace>,
    tunnels: HashMap<(BackendId, ConnId), TunnelTrace>,
    /// The audit log's sink and this server's id.
    audit: Option<(Sink<AuditRecord>, String)>,
    /// Who each frontend is (audit log on).
    peers: HashMap<FrontendId, FrontendPeer>,
    /// Established tunnels by their frontend's id for them (audit log on):
    /// a CLOSE_REQ names the tunnel its frontend ends.
    by_frontend: HashMap<(FrontendId, ConnId), BackendId>,
    /// The frontend's Unix socket (`unix:<path>`), the peer of a frontend
    /// that has no address.
    socket: String,
    /// Set when the server shuts down: what ends from then on, its
    /// shutdown ended.
    shutting_down: bool,
    /// Dials that left the pending table in this event, until the event
    /// says how (established, failed; else cancelled).
    settling: Vec<(DialId, DialTrace)>,
    /// The trace of the DIAL_REQ of this event, until the router says
    /// what became of it: accepted (it joins `dials`), refused (its record
    /// is written, `dials` untouched: a duplicate random never replaces
    /// the pending dial's), or neither (an ignored packet: dropped).
    incoming: Option<(FrontendId, DialId, DialTrace)>,
    /// A tunnel that just closed, until the router says why.
    closing: Option<Closing>,
}

impl Traces {
    /// Spans made by `tracing` (off: nothing is kept).
    pub(crate) fn new(tracing: Tracing) -> Self {
        Self {
            tracing,
            ..Self::default()
        }
    }

    /// Also writes one audit record per frontend dial to `sink`, as
    /// `server_id`; a frontend whose peer is not known otherwise is
    /// `socket` (`unix:<path>`).
    pub(crate) fn set_audit(&mut self, sink: Sink<AuditRecord>, server_id: String, socket: String) {
        self.audit = sink.enabled().then_some((sink, server_id));
        self.socket = socket;
    }

    /// The server is shutting down: what ends now, its shutdown ended.
    pub(crate) fn shutting_down(&mut self) {
        self.shutting_down = true;
    }

    /// The tracer.
    pub(crate) fn tracing(&self) -> Tracing {
        self.tracing.clone()
    }

    /// A frontend's stream started with `traceparent`, if it sent one,
    /// from `peer`.
    pub(crate) fn frontend(
        &mut self,
        fe: FrontendId,
        traceparent: Option<&str>,
        peer: FrontendPeer,
    ) {
        if let Some(parent) = traceparent
            .filter(|_| self.tracing.is_on())
            .and_then(Parent::parse)
        {
            self.parents.insert(fe, parent);
        }
        if self.audit.is_some() {
            let mut peer = peer;
            if peer.peer.is_empty() {
                peer.peer.clone_from(&self.socket);
            }
            self.peers.insert(fe, peer);
        }
    }

    /// A frontend's stream ended.
    pub(crate) fn frontend_closed(&mut self, fe: FrontendId) {
        if self.parents.remove(&fe).is_some() {
            compact(&mut self.parents);
        }
        if self.peers.remove(&fe).is_some() {
            compact(&mut self.peers);
        }
    }

    /// A frontend's control packet: a DIAL_REQ starts a dial span (and
    /// record), which the dial keeps once the router accepts it
    /// ([`Traces::accepted`]); a CLOSE_REQ says the frontend ends its
    /// tunnel.
    pub(crate) fn frontend_packet(&mut self, fe: FrontendId, packet: &Packet, kind: &'static str) {
        if let Some(Payload::CloseRequest(close)) = &packet.payload {
            if let Some(backend) = self.by_frontend.get(&(fe, ConnId(close.connect_id)))
                && let Some(tunnel) = self.tunnels.get_mut(&(*backend, ConnId(close.connect_id)))
                && let Some((record, ..)) = tunnel.record.as_mut()
            {
                record.close_requested = true;
            }
            return;
        }
        if packet.r#type != PacketType::DialReq as i32 {
            return;
        }
        let Some(Payload::DialRequest(request)) = &packet.payload else {
            return;
        };
        let record = self.audit.as_ref().map(|_| {
            let peer = self.peers.get(&fe).cloned().unwrap_or(FrontendPeer {
                kind: crate::router::FrontendKind::Grpc,
                peer: String::new(),
                subject: None,
            });
            Pending::new(peer, request.address.clone(), request.random)
        });
        if !self.tracing.is_on() && record.is_none() {
            return;
        }
        let mut span = self
            .tracing
            .span("proxy-server dial", Kind::Server, self.parents.get(&fe));
        span.set(|| {
            vec![
                Attr::new("konnectivity.destination", request.address.clone()),
                Attr::new("konnectivity.protocol", request.protocol.clone()),
                Attr::new("konnectivity.frontend", kind),
            ]
        });
        self.incoming = Some((
            fe,
            DialId(request.random),
            DialTrace {
                span,
                attempts: 0,
                retries: 0,
                hedged: false,
                hedges: 0,
                record,
            },
        ));
    }

    /// The router accepted `frontend`'s dial: the DIAL_REQ of this event's
    /// trace becomes the pending dial's.
    pub(crate) fn accepted(&mut self, frontend: FrontendId, dial: DialId) {
        if let Some(trace) = self.take_incoming(frontend, dial) {
            self.dials.insert(dial, trace);
        }
    }

    /// This event's DIAL_REQ trace, if it is `frontend`'s `dial`.
    fn take_incoming(&mut self, frontend: FrontendId, dial: DialId) -> Option<DialTrace> {
        let (fe, id, _) = self.incoming.as_ref()?;
        if (*fe, *id) != (frontend, dial) {
            return None;
        }
        self.incoming.take().map(|(_, _, trace)| trace)
    }

    /// A DIAL_REQ goes to `agent` (the first, a retry or a `hedge`): it
    /// carries the dial span's context.
    pub(crate) fn forward(
        &mut self,
        dial: DialId,
        agent: &AgentId,
        hedge: bool,
        packet: &mut Packet,
    ) {
        let Some(trace) = self.dials.get_mut(&dial) else {
            return;
        };
        trace.attempts += 1;
        let kind = if hedge {
            trace.hedged = true;
            trace.hedges += 1;
            "hedge"
        } else if trace.attempts == 1 {
            "first"
        } else {
            trace.retries += 1;
            "retry"
        };
        if let Some(record) = trace.record.as_mut() {
            record.agent = Some(agent.0.clone());
        }
        trace.span.event("attempt", || {
            vec![
                Attr::new("konnectivity.agent.id", agent.0.clone()),
                Attr::new("konnectivity.attempt", kind),
            ]
        });
        if let (Some(traceparent), Some(Payload::DialRequest(request))) =
            (trace.span.traceparent(), packet.payload.as_mut())
        {
            request.traceparent = traceparent;
        }
    }

    /// The dial of `frontend` was established on `agent`'s connection
    /// `conn`: its span ends, the tunnel's starts.
    pub(crate) fn established(
        &mut self,
        (frontend, dial): (FrontendId, DialId),
        (backend, conn): (BackendId, ConnId),
        agent: &AgentId,
        latency: Duration,
    ) {
        let Some(mut trace) = self.take(dial) else {
            return;
        };
        trace.span.set(|| {
            vec![
                Attr::new("konnectivity.agent.id", agent.0.clone()),
                Attr::new("konnectivity.connect_id", conn.0),
                Attr::new("konnectivity.dial.latency_ms", latency.as_secs_f64() * 1e3),
            ]
        });
        let mut span = self.tracing.span(
            "proxy-server tunnel",
            Kind::Internal,
            trace.span.as_parent().as_ref(),
        );
        span.set(|| {
            vec![
                Attr::new("konnectivity.agent.id", agent.0.clone()),
                Attr::new("konnectivity.connect_id", conn.0),
            ]
        });
        let record = trace.record.take().map(|mut record| {
            record.established(&agent.0, latency);
            self.by_frontend.insert((frontend, conn), backend);
            (record, count(trace.retries), trace.hedges)
        });
        end_dial(trace, "established");
        let tunnel = TunnelTrace {
            span,
            record,
            connection_id: conn.0,
            frontend,
        };
        self.tunnels.insert((backend, conn), tunnel);
    }

    /// `frontend`'s dial failed with `error`: this event's DIAL_REQ,
    /// refused, or a pending dial.
    pub(crate) fn failed(&mut self, frontend: FrontendId, dial: DialId, error: &DialError) {
        let trace = self
            .take_incoming(frontend, dial)
            .or_else(|| self.take(dial));
        if let Some(mut trace) = trace {
            trace.span.fail(error.to_string());
            let end = if self.shutting_down {
                End::shutdown()
            } else {
                End::failed(error)
            };
            self.write_dial(&mut trace, end);
            end_dial(trace, "failed");
        }
    }

    /// Writes a dial's record that ended without a tunnel.
    fn write_dial(&self, trace: &mut DialTrace, end: End) {
        if let (Some((sink, server_id)), Some(record)) = (&self.audit, trace.record.take()) {
            let outcome = Outcome {
                connection_id: None,
                retries: count(trace.retries),
                hedges: trace.hedges,
                bytes: (0, 0),
                end,
            };
            audit::write(sink, server_id, record, outcome);
        }
    }

    /// The dial left the pending table: the rest of the event says how;
    /// if nothing does, it was cancelled ([`Traces::flush`]).
    pub(crate) fn settled(&mut self, dial: DialId) {
        if let Some(trace) = self.dials.remove(&dial) {
            compact(&mut self.dials);
            self.settling.push((dial, trace));
        }
    }

    /// A dial's trace, pending or settling.
    fn take(&mut self, dial: DialId) -> Option<DialTrace> {
        if let Some(at) = self.settling.iter().position(|(id, _)| *id == dial) {
            return Some(self.settling.swap_remove(at).1);
        }
        let trace = self.dials.remove(&dial)?;
        compact(&mut self.dials);
        Some(trace)
    }

    /// A tunnel closed, having carried `bytes` (to the agent, to the
    /// frontend); why comes next ([`Traces::close_reason`]).
    pub(crate) fn closed(&mut self, key: (BackendId, ConnId), bytes: (u64, u64)) {
        self.finish_closing(None);
        let Some(tunnel) = self.tunnels.remove(&key) else {
            return;
        };
        compact(&mut self.tunnels);
        if self.by_frontend.remove(&(tunnel.frontend, key.1)).is_some() {
            compact(&mut self.by_frontend);
        }
        let TunnelTrace {
            mut span,
            record,
            connection_id,
            ..
        } = tunnel;
        span.set(|| {
            vec![
                Attr::new(
                    "konnectivity.bytes.to_agent",
                    i64::try_from(bytes.0).unwrap_or(i64::MAX),
                ),
                Attr::new(
                    "konnectivity.bytes.to_frontend",
                    i64::try_from(bytes.1).unwrap_or(i64::MAX),
                ),
            ]
        });
        self.closing = Some(Closing {
            span,
            record,
            connection_id,
            bytes,
        });
    }

    /// Why the tunnel that just closed ended.
    pub(crate) fn close_reason(&mut self, reason: CloseReason) {
        self.finish_closing(Some(reason));
    }

    /// Ends the span of the tunnel that just closed and writes its record.
    fn finish_closing(&mut self, reason: Option<CloseReason>) {
        let Some(mut closing) = self.closing.take() else {
            return;
        };
        if let Some(reason) = reason {
            closing
                .span
                .set(|| vec![Attr::new("konnectivity.end", reason.as_str())]);
        }
        closing.span.end();
        if let (Some((sink, server_id)), Some((record, retries, hedges))) =
            (&self.audit, closing.record)
        {
            let end = if self.shutting_down {
                End::shutdown()
            } else {
                End::closed(reason, record.close_requested)
            };
            let outcome = Outcome {
                connection_id: Some(closing.connection_id),
                retries,
                hedges,
                bytes: closing.bytes,
                end,
            };
            audit::write(sink, server_id, record, outcome);
        }
    }

    /// Whether nothing is kept: no dial, tunnel, frontend or event state
    /// (tests: once every stream is gone).
    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.parents.is_empty()
            && self.dials.is_empty()
            && self.tunnels.is_empty()
            && self.peers.is_empty()
            && self.by_frontend.is_empty()
            && self.settling.is_empty()
            && self.incoming.is_none()
            && self.closing.is_none()
    }

    /// At the end of an event: ends a closed tunnel's span whose reason
    /// did not follow, and the spans of dials settled without an outcome
    /// (their frontend abandoned them).
    pub(crate) fn flush(&mut self) {
        self.finish_closing(None);
        // A DIAL_REQ the router neither took nor refused (its frontend had
        // broken the protocol) is no dial.
        self.incoming = None;
        for (_, mut trace) in std::mem::take(&mut self.settling) {
            self.write_dial(&mut trace, End::abandoned(self.shutting_down));
            end_dial(trace, "cancelled");
        }
    }
}

/// A count as the record's `u32`.
fn count(n: i64) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// Ends a dial's span, saying how.
fn end_dial(mut trace: DialTrace, end: &'static str) {
    let (retries, hedged) = (trace.retries, trace.hedged);
    trace.span.set(|| {
        vec![
            Attr::new("konnectivity.dial.retries", retries),
            Attr::new("konnectivity.dial.hedged", hedged),
            Attr::new("konnectivity.end", end),
        ]
    });
    trace.span.end();
}
