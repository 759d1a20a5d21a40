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

use std::{collections::HashMap, time::Duration};

use ops::otel::{Attr, Kind, Parent, Span, Tracing};
use proto::{Packet, PacketType, Payload};
use tunnel::{
    compact,
    ids::{AgentId, ConnId, DialId},
};

use crate::router::{BackendId, FrontendId};

/// A dial in flight.
struct DialTrace {
    span: Span,
    /// DIAL_REQs sent.
    attempts: i64,
    /// Agents asked again after one failed the dial.
    retries: i64,
    /// Whether a second agent was asked while the first had not answered.
    hedged: bool,
}

/// The spans of dials and tunnels in progress.
#[derive(Default)]
pub(crate) struct Traces {
    tracing: Tracing,
    /// Frontends that sent a trace context.
    parents: HashMap<FrontendId, Parent>,
    dials: HashMap<DialId, DialTrace>,
    tunnels: HashMap<(BackendId, ConnId), Span>,
    /// Dials that left the pending table in this event, until the event
    /// says how (established, failed; else cancelled).
    settling: Vec<(DialId, DialTrace)>,
    /// A tunnel that just closed, until the router says why.
    closing: Option<Span>,
}

impl Traces {
    /// Spans made by `tracing` (off: nothing is kept).
    pub(crate) fn new(tracing: Tracing) -> Self {
        Self {
            tracing,
            ..Self::default()
        }
    }

    /// The tracer.
    pub(crate) fn tracing(&self) -> Tracing {
        self.tracing.clone()
    }

    /// A frontend's stream started with `traceparent`, if it sent one.
    pub(crate) fn frontend(&mut self, fe: FrontendId, traceparent: Option<&str>) {
        if let Some(parent) = traceparent
            .filter(|_| self.tracing.is_on())
            .and_then(Parent::parse)
        {
            self.parents.insert(fe, parent);
        }
    }

    /// A frontend's stream ended.
    pub(crate) fn frontend_closed(&mut self, fe: FrontendId) {
        if self.parents.remove(&fe).is_some() {
            compact(&mut self.parents);
        }
    }

    /// A frontend's control packet: a DIAL_REQ starts a dial span.
    pub(crate) fn frontend_packet(&mut self, fe: FrontendId, packet: &Packet, kind: &'static str) {
        if !self.tracing.is_on() || packet.r#type != PacketType::DialReq as i32 {
            return;
        }
        let Some(Payload::DialRequest(request)) = &packet.payload else {
            return;
        };
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
        self.dials.insert(
            DialId(request.random),
            DialTrace {
                span,
                attempts: 0,
                retries: 0,
                hedged: false,
            },
        );
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
            "hedge"
        } else if trace.attempts == 1 {
            "first"
        } else {
            trace.retries += 1;
            "retry"
        };
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

    /// The dial was established on `agent`'s connection `conn`: its span
    /// ends, the tunnel's starts.
    pub(crate) fn established(
        &mut self,
        dial: DialId,
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
        let mut tunnel = self.tracing.span(
            "proxy-server tunnel",
            Kind::Internal,
            trace.span.as_parent().as_ref(),
        );
        tunnel.set(|| {
            vec![
                Attr::new("konnectivity.agent.id", agent.0.clone()),
                Attr::new("konnectivity.connect_id", conn.0),
            ]
        });
        end_dial(trace, "established");
        self.tunnels.insert((backend, conn), tunnel);
    }

    /// The dial failed with `error`.
    pub(crate) fn failed(&mut self, dial: DialId, error: &str) {
        if let Some(mut trace) = self.take(dial) {
            trace.span.fail(error);
            end_dial(trace, "failed");
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
        if let Some(span) = self.closing.take() {
            span.end();
        }
        let Some(mut span) = self.tunnels.remove(&key) else {
            return;
        };
        compact(&mut self.tunnels);
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
        self.closing = Some(span);
    }

    /// Why the tunnel that just closed ended.
    pub(crate) fn close_reason(&mut self, reason: &'static str) {
        if let Some(mut span) = self.closing.take() {
            span.set(|| vec![Attr::new("konnectivity.end", reason)]);
            span.end();
        }
    }

    /// At the end of an event: ends a closed tunnel's span whose reason
    /// did not follow, and the spans of dials settled without an outcome.
    pub(crate) fn flush(&mut self) {
        if let Some(span) = self.closing.take() {
            span.end();
        }
        for (_, trace) in self.settling.drain(..) {
            end_dial(trace, "cancelled");
        }
    }
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
