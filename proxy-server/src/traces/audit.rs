//! The audit half of [`Traces`](super::Traces): what a dial and its
//! tunnel need for their [`ServerTunnel`] record, kept beside their spans
//! and finished where the spans end (one place learns a tunnel's end; two
//! outputs). Records go to the sink with `try_send` at the end only.

use std::time::Instant;

use ops::audit::{
    AuditRecord, Sink,
    record::{EndedBy, ServerEnd, ServerTunnel, Timestamp},
};

use crate::{events::CloseReason, events::DialError, router::FrontendKind};

/// Who a frontend is, for its tunnels' records.
#[derive(Clone, Debug)]
pub(crate) struct FrontendPeer {
    /// Its kind.
    pub(crate) kind: FrontendKind,
    /// `unix:<socket path>` or `ip:port`.
    pub(crate) peer: String,
    /// The client certificate's subject (mTLS), if at hand.
    pub(crate) subject: Option<String>,
}

/// A dial's record in the making.
#[derive(Debug)]
pub(crate) struct Pending {
    start: Timestamp,
    at: Instant,
    frontend: FrontendPeer,
    destination: String,
    dial_id: i64,
    /// The agent asked last.
    pub(crate) agent: Option<String>,
    /// Seconds from DIAL_REQ to DIAL_RSP, once established.
    dial_seconds: Option<f64>,
    /// Set by the frontend's CLOSE_REQ: the frontend ended it.
    pub(crate) close_requested: bool,
}

impl Pending {
    /// A dial request for `destination` arrived from `frontend`.
    pub(crate) fn new(frontend: FrontendPeer, destination: String, dial_id: i64) -> Self {
        Self {
            start: Timestamp::now(),
            at: Instant::now(),
            frontend,
            destination,
            dial_id,
            agent: None,
            dial_seconds: None,
            close_requested: false,
        }
    }

    /// The dial was established after `latency`.
    pub(crate) fn established(&mut self, agent: &str, latency: std::time::Duration) {
        self.agent = Some(agent.to_owned());
        self.dial_seconds = Some(latency.as_secs_f64());
    }
}

/// How a record ends.
#[derive(Debug)]
pub(crate) struct End {
    pub(crate) end: ServerEnd,
    pub(crate) ended_by: EndedBy,
    pub(crate) error: Option<String>,
}

impl End {
    /// A dial that failed with `error`.
    pub(crate) fn failed(error: &DialError) -> Self {
        let (end, ended_by) = match error {
            DialError::NoAgent | DialError::AgentsBusy(_) => (ServerEnd::NoAgent, EndedBy::Server),
            DialError::TimedOut => (ServerEnd::DialTimeout, EndedBy::Server),
            DialError::AgentStreamClosed | DialError::AgentGone(_) => {
                (ServerEnd::AgentGone, EndedBy::Agent)
            }
            DialError::IdPending
            | DialError::TooManyPending(_)
            | DialError::AddressTooLong(_)
            | DialError::ProtocolTooLong(_) => (ServerEnd::DialFailed, EndedBy::Server),
            DialError::Agent {
                class: proto::DialErrorClass::Denied,
                ..
            } => (ServerEnd::Denied, EndedBy::Agent),
            DialError::ConnIdInUse(_) | DialError::ClosedByAgent | DialError::Agent { .. } => {
                (ServerEnd::DialFailed, EndedBy::Agent)
            }
        };
        Self {
            end,
            ended_by,
            error: Some(error.to_string()),
        }
    }

    /// A dial settled without an answer: its frontend left (DIAL_CLS, or
    /// its stream or socket ended), unless the server is `shutting_down`.
    pub(crate) fn abandoned(shutting_down: bool) -> Self {
        if shutting_down {
            return Self::shutdown();
        }
        Self {
            end: ServerEnd::AbandonedByFrontend,
            ended_by: EndedBy::Frontend,
            error: None,
        }
    }

    /// The server's shutdown ended it.
    pub(crate) fn shutdown() -> Self {
        Self {
            end: ServerEnd::Shutdown,
            ended_by: EndedBy::Server,
            error: None,
        }
    }

    /// An established tunnel closed for `reason` (`None`: not said), the
    /// frontend having asked for it or not.
    pub(crate) fn closed(reason: Option<CloseReason>, close_requested: bool) -> Self {
        let (end, ended_by) = match reason {
            None | Some(CloseReason::Closed) if close_requested => {
                (ServerEnd::Closed, EndedBy::Frontend)
            }
            None | Some(CloseReason::Closed) => (ServerEnd::Closed, EndedBy::Destination),
            Some(CloseReason::Error) => (ServerEnd::Error, EndedBy::Destination),
            Some(CloseReason::AgentGone) => (ServerEnd::AgentGone, EndedBy::Agent),
            Some(CloseReason::FrontendGone) => (ServerEnd::FrontendGone, EndedBy::Frontend),
            Some(CloseReason::Overflow) => (ServerEnd::Overflow, EndedBy::Server),
            Some(CloseReason::Stalled) => (ServerEnd::Stalled, EndedBy::Server),
            Some(CloseReason::Mismatch) => (ServerEnd::Mismatch, EndedBy::Server),
            Some(CloseReason::UploadStalled) => (ServerEnd::UploadStalled, EndedBy::Server),
        };
        Self {
            end,
            ended_by,
            error: None,
        }
    }
}

/// What a finished record needs besides its dial.
pub(crate) struct Outcome {
    pub(crate) connection_id: Option<i64>,
    pub(crate) retries: u32,
    pub(crate) hedges: u32,
    /// To the agent, to the frontend.
    pub(crate) bytes: (u64, u64),
    pub(crate) end: End,
}

/// Builds the record of `dial` and hands it to `sink` (never waits).
pub(crate) fn write(sink: &Sink<AuditRecord>, server_id: &str, dial: Pending, outcome: Outcome) {
    let dial_seconds = dial
        .dial_seconds
        .or_else(|| (outcome.connection_id.is_none()).then(|| dial.at.elapsed().as_secs_f64()));
    let record = ServerTunnel {
        time: Timestamp::now(),
        start: dial.start,
        server_id: server_id.to_owned(),
        frontend_kind: dial.frontend.kind,
        frontend_peer: dial.frontend.peer,
        frontend_subject: dial.frontend.subject,
        destination: dial.destination,
        dial_id: dial.dial_id,
        agent_id: dial.agent,
        connection_id: outcome.connection_id,
        dial_seconds,
        retries: outcome.retries,
        hedges: outcome.hedges,
        bytes_to_agent: outcome.bytes.0,
        bytes_to_frontend: outcome.bytes.1,
        duration_seconds: dial.at.elapsed().as_secs_f64(),
        end: outcome.end.end,
        ended_by: outcome.end.ended_by,
        error: outcome.end.error,
    };
    sink.record(AuditRecord::Server(record));
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A policy refusal is known by its class, as our agents send it; text
    /// that only looks like one (an ANP agent's, or any peer's) is a
    /// failed dial.
    #[test]
    fn a_dial_is_denied_by_its_class_not_its_text() {
        let text = "destination 10.0.0.1:80 denied by the agent's policy (rule deny metadata)";
        let end = |class| {
            End::failed(&DialError::Agent {
                text: text.to_owned(),
                class,
            })
        };
        let denied = end(proto::DialErrorClass::Denied);
        assert_eq!(
            (denied.end, denied.ended_by),
            (ServerEnd::Denied, EndedBy::Agent)
        );
        assert_eq!(denied.error.as_deref(), Some(text));
        for class in [
            proto::DialErrorClass::Unspecified,
            proto::DialErrorClass::Refused,
        ] {
            let failed = end(class);
            assert_eq!(
                (failed.end, failed.ended_by),
                (ServerEnd::DialFailed, EndedBy::Agent),
                "{class:?}"
            );
        }
    }
}
