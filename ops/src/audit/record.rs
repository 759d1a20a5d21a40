//! The audit log's records: one per tunnel and side, at the tunnel's end
//! (`docs/operations.md`, "Audit log", documents every field). Field names
//! are stable: renaming one breaks operators' queries.
//!
//! Conventions: times are RFC 3339 in UTC with nanoseconds
//! ([`Timestamp`]); durations are seconds as `f64` (`*_seconds`, as the
//! metrics); ids are the wire's numbers; a field that does not apply (no
//! connection id for a dial that failed) is `null`.

use std::time::SystemTime;

use proto::text::for_record;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use time::{OffsetDateTime, format_description::well_known::Rfc3339};

use super::Recordable;

/// One line of the audit log: its `side` says which process wrote it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "side", rename_all = "snake_case")]
pub enum AuditRecord {
    /// A proxy-server's record of one frontend's tunnel.
    Server(ServerTunnel),
    /// A proxy-agent's record of one dial it was asked for.
    Agent(AgentTunnel),
}

/// A point in time, written in RFC 3339, UTC, with nanoseconds
/// (`2025-01-02T03:04:05.123456789Z`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Timestamp(pub SystemTime);

impl Timestamp {
    /// Now, by the wall clock.
    pub fn now() -> Self {
        Self(SystemTime::now())
    }
}

impl Serialize for Timestamp {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let text = OffsetDateTime::from(self.0)
            .format(&Rfc3339)
            .map_err(serde::ser::Error::custom)?;
        serializer.serialize_str(&text)
    }
}

impl<'de> Deserialize<'de> for Timestamp {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        let at = OffsetDateTime::parse(&text, &Rfc3339).map_err(serde::de::Error::custom)?;
        Ok(Self(at.into()))
    }
}

/// Which kind of frontend asked for a tunnel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FrontendKind {
    /// A `ProxyService/Proxy` stream (`--mode=grpc`).
    Grpc,
    /// An HTTP CONNECT request (`--mode=http-connect`).
    HttpConnect,
}

/// Who ended a tunnel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EndedBy {
    /// The frontend (kube-apiserver): CLOSE_REQ, DIAL_CLS, or it went away.
    Frontend,
    /// The server: its CLOSE_REQ or DIAL_CLS (in an agent's record), its
    /// stream going away, a limit, a timeout, its shutdown.
    Server,
    /// The agent: its answer or CLOSE_RSP (in a server's record), its
    /// stream going away, its policy, a limit, a timeout, its shutdown.
    Agent,
    /// The destination (the node-side peer) closed or failed.
    Destination,
}

/// How a tunnel ended, seen from the server. The established ones use the
/// reasons of `konnectivity_rs_server_connections_closed_total`, the
/// failed dials those of `dial_failure_count` where they fit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ServerEnd {
    /// Closed by a CLOSE_REQ/CLOSE_RSP exchange (`ended_by` says who).
    Closed,
    /// An error closed it (the agent's CLOSE_RSP error, a write failure).
    Error,
    /// The agent stream ended under it.
    AgentGone,
    /// The frontend stream or socket ended under it.
    FrontendGone,
    /// A peer sent past its window.
    Overflow,
    /// The frontend left its bytes untaken (`--frontend-stall-timeout`).
    Stalled,
    /// Its upload made no progress while the buffer budget was full.
    UploadStalled,
    /// A packet named it on the wrong stream.
    Mismatch,
    /// No agent could take the dial.
    NoAgent,
    /// The agent answered the dial with an error (`error` has its text).
    DialFailed,
    /// The agent's destination policy refused the dial.
    Denied,
    /// No DIAL_RSP within `--backend-dial-timeout`.
    DialTimeout,
    /// The frontend gave up before the DIAL_RSP (DIAL_CLS, or it hung up).
    AbandonedByFrontend,
    /// The server shut down.
    Shutdown,
}

/// How a tunnel ended, seen from the agent. The established ones use the
/// reasons of `konnectivity_rs_agent_connections_closed_total`, the
/// failed dials those of `endpoint_dial_failure_total` where they fit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AgentEnd {
    /// The destination closed it.
    EndpointClosed,
    /// Reading or writing the destination failed.
    EndpointError,
    /// The server (its frontend) closed it.
    ServerClosed,
    /// The destination read too slowly: a window behind.
    Overflow,
    /// The destination did not take the last bytes in time after the
    /// server's close.
    DrainTimeout,
    /// The server stream ended.
    StreamGone,
    /// The dial failed (`error` has the text the DIAL_RSP carried).
    DialFailed,
    /// The dial did not connect in time.
    DialTimeout,
    /// The destination policy refused the dial (`rule` names the rule).
    Denied,
    /// The server cancelled the dial (DIAL_CLS) before it connected.
    DialCancelled,
    /// The agent shut down.
    Shutdown,
}

/// The destination policy's verdict on a dial.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DestinationVerdict {
    /// Allowed (every dial, with no policy).
    Allow,
    /// Denied: never connected.
    Deny,
}

/// The server's record of one tunnel: one per frontend dial, whether it
/// was established or not.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ServerTunnel {
    /// When the record was made: the tunnel's end.
    pub time: Timestamp,
    /// When the dial request arrived.
    pub start: Timestamp,
    /// This server's `--server-id`.
    pub server_id: String,
    /// The frontend's kind.
    pub frontend_kind: FrontendKind,
    /// The frontend's peer: `unix:<socket path>` or `ip:port`.
    pub frontend_peer: String,
    /// The subject of the frontend's client certificate (mTLS), if any.
    pub frontend_subject: Option<String>,
    /// The destination asked for, `host:port`.
    pub destination: String,
    /// The frontend's dial id (`random`); the server's own for CONNECT.
    pub dial_id: i64,
    /// The agent that carried it (or answered last); `null` if none did.
    pub agent_id: Option<String>,
    /// The connection id the agent gave (`connectID`); `null` if never
    /// established.
    pub connection_id: Option<i64>,
    /// DIAL_REQ to DIAL_RSP (or to the dial's failure), seconds.
    pub dial_seconds: Option<f64>,
    /// Agents the dial was retried on after a failure.
    pub retries: u32,
    /// Agents it was hedged to (`--backend-dial-hedge`).
    pub hedges: u32,
    /// Payload bytes from the frontend towards the destination.
    pub bytes_to_agent: u64,
    /// Payload bytes from the destination back to the frontend.
    pub bytes_to_frontend: u64,
    /// From `start` to `time`, seconds.
    pub duration_seconds: f64,
    /// How it ended.
    pub end: ServerEnd,
    /// Who ended it.
    pub ended_by: EndedBy,
    /// The error's text, when it ended with one.
    pub error: Option<String>,
}

/// The agent's record of one dial it was asked for (and of the connection,
/// if the dial made one).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AgentTunnel {
    /// When the record was made: the tunnel's end.
    pub time: Timestamp,
    /// When the DIAL_REQ arrived.
    pub start: Timestamp,
    /// This agent's `--agent-id`.
    pub agent_id: String,
    /// The server that asked (its `serverID`).
    pub server_id: String,
    /// The server's dial id (`random`).
    pub dial_id: i64,
    /// The connection id this agent gave; `null` if the dial failed.
    pub connection_id: Option<i64>,
    /// The destination asked for, `host:port`.
    pub destination: String,
    /// The address connected to (or last tried), `ip:port`; `null` if the
    /// name did not resolve.
    pub resolved: Option<String>,
    /// The destination policy's verdict.
    pub verdict: DestinationVerdict,
    /// The policy rule that decided, if one did.
    pub rule: Option<String>,
    /// DIAL_REQ to connected (or to the dial's failure), seconds.
    pub dial_seconds: Option<f64>,
    /// Payload bytes from the server towards the destination.
    pub bytes_to_endpoint: u64,
    /// Payload bytes from the destination back to the server.
    pub bytes_to_server: u64,
    /// From `start` to `time`, seconds.
    pub duration_seconds: f64,
    /// How it ended.
    pub end: AgentEnd,
    /// Who ended it.
    pub ended_by: EndedBy,
    /// The error's text, when it ended with one.
    pub error: Option<String>,
}

impl Recordable for AuditRecord {
    fn bounded(self) -> Self {
        match self {
            Self::Server(t) => Self::Server(ServerTunnel {
                frontend_peer: for_record(t.frontend_peer),
                frontend_subject: t.frontend_subject.map(for_record),
                destination: for_record(t.destination),
                agent_id: t.agent_id.map(for_record),
                error: t.error.map(for_record),
                ..t
            }),
            Self::Agent(t) => Self::Agent(AgentTunnel {
                server_id: for_record(t.server_id),
                destination: for_record(t.destination),
                resolved: t.resolved.map(for_record),
                rule: t.rule.map(for_record),
                error: t.error.map(for_record),
                ..t
            }),
        }
    }

    fn weight(&self) -> usize {
        let texts = match self {
            Self::Server(t) => [
                t.server_id.len(),
                t.frontend_peer.len(),
                t.frontend_subject.as_ref().map_or(0, String::len),
                t.destination.len(),
                t.agent_id.as_ref().map_or(0, String::len),
                t.error.as_ref().map_or(0, String::len),
            ],
            Self::Agent(t) => [
                t.agent_id.len(),
                t.server_id.len(),
                t.destination.len(),
                t.resolved.as_ref().map_or(0, String::len),
                t.rule.as_ref().map_or(0, String::len),
                t.error.as_ref().map_or(0, String::len),
            ],
        };
        std::mem::size_of::<Self>() + texts.iter().sum::<usize>()
    }
}
