//! The agent's audit records (`--audit-log-path`): one per DIAL_REQ, at its
//! end (a dial that failed, was denied or cancelled; or the connection it
//! made, closed), handed to the log's sink without waiting. A leaf: the
//! dial task (in the client) fills an [`AgentDial`] as it learns, and
//! finishes it once.

use std::{sync::Arc, time::Instant};

use tokio_util::sync::CancellationToken;

use ops::audit::{
    AuditRecord, Sink,
    record::{AgentEnd, AgentTunnel, DestinationVerdict, EndedBy, Timestamp},
};

use crate::{
    endpoint::{ConnEnd, EndpointDialError},
    policy::Decision,
};

/// Where the agent's records go, its id, and its stop.
#[derive(Clone, Debug)]
pub struct AgentAudit {
    sink: Sink<AuditRecord>,
    agent_id: Arc<str>,
    stopping: CancellationToken,
}

impl AgentAudit {
    /// Records of agent `agent_id` to `sink`; a tunnel that ends with its
    /// stream once `stopping` is cancelled ended by the agent's shutdown.
    pub fn new(sink: Sink<AuditRecord>, agent_id: &str, stopping: CancellationToken) -> Self {
        Self {
            sink,
            agent_id: agent_id.into(),
            stopping,
        }
    }

    /// No records.
    pub fn disabled() -> Self {
        Self::new(Sink::disabled(), "", CancellationToken::new())
    }

    /// A record for the dial `dial_id` to `destination` asked by
    /// `server_id`, starting now; `None` when the log is off.
    pub(crate) fn dial(
        &self,
        server_id: &str,
        dial_id: i64,
        destination: &str,
    ) -> Option<AgentDial> {
        self.sink.enabled().then(|| AgentDial {
            sink: self.sink.clone(),
            stopping: self.stopping.clone(),
            at: Instant::now(),
            record: AgentTunnel {
                time: Timestamp::now(),
                start: Timestamp::now(),
                agent_id: self.agent_id.to_string(),
                server_id: server_id.to_owned(),
                dial_id,
                connection_id: None,
                destination: destination.to_owned(),
                resolved: None,
                verdict: DestinationVerdict::Allow,
                rule: None,
                dial_seconds: None,
                bytes_to_endpoint: 0,
                bytes_to_server: 0,
                duration_seconds: 0.0,
                end: AgentEnd::DialCancelled,
                ended_by: EndedBy::Server,
                error: None,
            },
        })
    }
}

/// One dial's record in the making.
#[derive(Debug)]
pub(crate) struct AgentDial {
    sink: Sink<AuditRecord>,
    stopping: CancellationToken,
    at: Instant,
    record: AgentTunnel,
}

impl AgentDial {
    /// The dial ended (connected or not): the address it checked, and the
    /// policy's `decision`, if it got that far.
    pub(crate) fn dialed(&mut self, resolved: Option<String>, decision: Option<&Decision>) {
        self.record.dial_seconds = Some(self.at.elapsed().as_secs_f64());
        self.record.resolved = resolved;
        match decision {
            Some(Decision::Allowed(rule)) => self.record.rule = rule.as_deref().map(str::to_owned),
            Some(Decision::Denied(rule)) => {
                self.record.verdict = DestinationVerdict::Deny;
                self.record.rule = Some(rule.to_string());
            }
            None => {}
        }
    }

    /// The connection made has the id `conn`.
    pub(crate) fn opened(&mut self, conn: i64) {
        self.record.connection_id = Some(conn);
    }

    /// It ended as `end`, by `ended_by`, having carried `bytes` (to the
    /// endpoint, to the server): the record goes to the sink. Its stream
    /// ending under it, or the dial's cancellation, is the agent's shutdown
    /// once the agent is stopping: the agent ends its streams.
    pub(crate) fn finish(
        mut self,
        (end, ended_by): (AgentEnd, EndedBy),
        error: Option<String>,
        bytes: (u64, u64),
    ) {
        let (end, ended_by) = match end {
            AgentEnd::StreamGone | AgentEnd::DialCancelled if self.stopping.is_cancelled() => {
                (AgentEnd::Shutdown, EndedBy::Agent)
            }
            _ => (end, ended_by),
        };
        self.record.time = Timestamp::now();
        self.record.duration_seconds = self.at.elapsed().as_secs_f64();
        self.record.end = end;
        self.record.ended_by = ended_by;
        self.record.error = error;
        (self.record.bytes_to_endpoint, self.record.bytes_to_server) = bytes;
        self.sink.record(AuditRecord::Agent(self.record));
    }
}

/// How a dial cancelled by the server (DIAL_CLS, or its stream's end)
/// before it connected ends.
pub(crate) fn cancelled() -> (AgentEnd, EndedBy) {
    (AgentEnd::DialCancelled, EndedBy::Server)
}

/// Finishes the record of a dial that failed with `error`.
pub(crate) fn dial_failed(mut record: AgentDial, error: &EndpointDialError) {
    let (resolved, decision, end) = match error {
        EndpointDialError::Denied { addr, rule, .. } => (
            Some(addr.to_string()),
            Some(Decision::Denied(rule.clone())),
            (AgentEnd::Denied, EndedBy::Agent),
        ),
        EndpointDialError::Connect { addr, .. } => (
            Some(addr.to_string()),
            None,
            (AgentEnd::DialFailed, EndedBy::Destination),
        ),
        EndpointDialError::Timeout { .. } => {
            (None, None, (AgentEnd::DialTimeout, EndedBy::Destination))
        }
        EndpointDialError::UnknownNetwork { .. }
        | EndpointDialError::MissingPort { .. }
        | EndpointDialError::NoSuchHost { .. } => {
            (None, None, (AgentEnd::DialFailed, EndedBy::Destination))
        }
    };
    record.dialed(resolved, decision.as_ref());
    record.finish(end, Some(error.to_string()), (0, 0));
}

/// How an established connection that ended as `end` ends.
pub(crate) fn closed(end: &ConnEnd) -> (AgentEnd, EndedBy) {
    match end {
        ConnEnd::DestinationClosed => (AgentEnd::EndpointClosed, EndedBy::Destination),
        ConnEnd::DestinationError(_) => (AgentEnd::EndpointError, EndedBy::Destination),
        ConnEnd::ServerClosed => (AgentEnd::ServerClosed, EndedBy::Server),
        ConnEnd::StreamGone => (AgentEnd::StreamGone, EndedBy::Server),
        ConnEnd::Overflow => (AgentEnd::Overflow, EndedBy::Agent),
        ConnEnd::DrainTimedOut => (AgentEnd::DrainTimeout, EndedBy::Agent),
    }
}
