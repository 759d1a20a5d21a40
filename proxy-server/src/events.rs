//! What the routing core and the transports report, as enums: why a dial
//! failed (for the metrics, and for the frontend: [`DialError`] becomes
//! Go's text only on the wire), why a connection ended, which cap was
//! reached. Plain data shared by `router` (which decides), the drivers and
//! `metrics` (which counts).

use std::fmt;

use proto::text::Elided;
use tunnel::ids::{AgentId, ConnId};

ops::label_enum! {
    /// Why a dial failed (`dial_failure_count`'s `reason`).
    pub(crate) enum DialFailure {
        /// No agent could take the dial.
        NoAgent = "no_agent",
        /// The agent answered with an error.
        ErrorResponse = "error_response",
        /// A DIAL_RSP for no pending dial.
        UnrecognizedResponse = "unrecognized_response",
        /// The DIAL_RSP could not be sent to the frontend.
        SendRsp = "send_rsp",
        /// The agent went away while the dial was pending.
        BackendClose = "backend_close",
        /// `--backend-dial-timeout` passed.
        BackendDialTimeout = "backend_dial_timeout",
        /// The frontend went away while the dial was pending.
        FrontendClose = "frontend_close",
    }
}

ops::label_enum! {
    /// Why an established connection ended (konnectivity-rs).
    pub(crate) enum CloseReason {
        /// CLOSE_RSP from the agent without an error (either side closed).
        Closed = "closed",
        /// CLOSE_RSP from the agent with an error.
        Error = "error",
        /// The agent's stream ended.
        AgentGone = "agent_gone",
        /// The frontend's stream ended.
        FrontendGone = "frontend_gone",
        /// The frontend fell a whole window behind.
        Overflow = "overflow",
        /// The frontend took none of the connection's data for
        /// `--frontend-stall-timeout`.
        Stalled = "stalled",
        /// The frontend used another frontend's connection id.
        Mismatch = "mismatch",
        /// Its destination took none of its upload for
        /// `frontend::lanes::UPLOAD_GRACE` while it held up the other
        /// connections of its `Proxy` stream, or its frontend's close.
        UploadStalled = "upload_stalled",
    }
}

ops::label_enum! {
    /// Why a dial was sent again to another agent before any DIAL_RSP
    /// established it (`konnectivity_rs_server_dial_retries_total`'s
    /// `reason`; the table is in docs/operations.md).
    pub(crate) enum DialRetry {
        /// The agent's stream ended (closed, killed, or found dead by
        /// keepalive) with the dial pending on it.
        AgentGone = "agent_gone",
        /// The agent's stream closed before the DIAL_REQ went out.
        NotForwarded = "not_forwarded",
        /// The agent answered at once with an error another node may not
        /// have: connection refused, no route to host, network unreachable.
        Refused = "refused",
    }
}

impl DialRetry {
    /// Whether the agent is gone: the dial may then be picked afresh,
    /// through the whole strategy list, as a new dial would; any other
    /// retry stays among the candidates of the first pick.
    pub(crate) fn agent_gone(self) -> bool {
        matches!(self, Self::AgentGone | Self::NotForwarded)
    }
}

ops::label_enum! {
    /// An admission limit of ours (`konnectivity_rs_server_limit_reached_total`).
    pub(crate) enum Limit {
        /// An agent stream's outbound queue was past its reserve: the agent
        /// does not read, and its stream was ended.
        AgentQueue = "agent_queue",
        /// A frontend stream's control packets were past their reserve: the
        /// frontend does not read, and its stream was ended.
        FrontendQueue = "frontend_queue",
        /// `--max-tls-handshakes`: a pending handshake whose peer stalled was
        /// dropped to make room.
        TlsHandshakes = "tls_handshakes",
        /// `--max-http-connections`: a frontend connection was refused (a
        /// CONNECT client with 503, a gRPC connection closed at once).
        HttpConnections = "http_connections",
        /// An agent connect refused with `Unavailable`:
        /// `--token-review-max-pending` connects were waiting for a token
        /// review, or its review waited too long for one of
        /// `--token-review-max-inflight`.
        TokenReviews = "token_reviews",
        /// `--buffer-budget-bytes`: a stream had to wait for room in the
        /// process-wide buffer budget (a frontend's read-ahead, or an
        /// agent's DATA for its frontends).
        BufferBudget = "buffer_budget",
    }
}

/// Answer to a dial when no agent can take it (ANP's text, matched by clients).
pub const NO_AGENT: &str = "No agent available";
/// Answer to a dial whose DIAL_RSP did not come within `--backend-dial-timeout`.
pub const DIAL_TIMED_OUT: &str = "timed out waiting for backend dial";
/// DIAL_RSP error when the chosen agent's stream closed before the dial went out.
pub const AGENT_STREAM_CLOSED: &str = "agent stream closed";

/// The longest address a DIAL_REQ may carry: a host name (253 bytes, RFC
/// 1035) and a port (`:65535`). Longer ones are refused before they reach
/// an agent, whatever the server adds to the packet (a traceparent).
pub(crate) const MAX_ADDRESS: usize = 253 + 6;
/// The longest protocol a DIAL_REQ may carry: Go's network names are at
/// most 10 bytes (`unixpacket`); kube-apiserver sends `tcp`.
pub(crate) const MAX_PROTOCOL: usize = 16;

/// Why a dial failed, as the frontend is told. The server's own reasons
/// are variants; only [`DialError::Agent`] is text (with its class), as
/// it came over the wire. It becomes Go's text ([`fmt::Display`]) only on the wire.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum DialError {
    /// No agent can take it.
    NoAgent,
    /// No DIAL_RSP within `--backend-dial-timeout`, or no room on the
    /// agent's stream within it.
    TimedOut,
    /// The chosen agent's stream closed before the dial went out.
    AgentStreamClosed,
    /// Another pending dial uses the same random.
    IdPending,
    /// The DIAL_REQ's address (this many bytes) is longer than any host
    /// name and port can be ([`MAX_ADDRESS`]).
    AddressTooLong(usize),
    /// The DIAL_REQ's protocol (this many bytes) is longer than any
    /// network name can be ([`MAX_PROTOCOL`]).
    ProtocolTooLong(usize),
    /// The frontend's stream already has this many dials pending
    /// (`--max-pending-dials-per-frontend`).
    TooManyPending(usize),
    /// Every agent that could take it has this many dials pending
    /// (`--max-pending-dials-per-agent`).
    AgentsBusy(usize),
    /// The agent's stream ended while the dial was pending.
    AgentGone(AgentId),
    /// The agent answered with a connection id already in use.
    ConnIdInUse(ConnId),
    /// The agent cancelled the dial (DIAL_CLS).
    ClosedByAgent,
    /// The agent's own error (DIAL_RSP): its text, and its class as our
    /// agents send it (`Unspecified` from ANP's, which send only text).
    Agent {
        text: String,
        class: proto::DialErrorClass,
    },
}

impl fmt::Display for DialError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NoAgent => f.write_str(NO_AGENT),
            Self::TimedOut => f.write_str(DIAL_TIMED_OUT),
            Self::AgentStreamClosed => f.write_str(AGENT_STREAM_CLOSED),
            Self::IdPending => f.write_str("dial id already pending"),
            Self::AddressTooLong(len) => write!(
                f,
                "the address ({len} bytes) is longer than a host name and port can be ({MAX_ADDRESS} bytes)"
            ),
            Self::ProtocolTooLong(len) => write!(
                f,
                "the protocol ({len} bytes) is longer than a network name can be ({MAX_PROTOCOL} bytes)"
            ),
            Self::TooManyPending(limit) => write!(
                f,
                "{limit} dials already pending on this stream (--max-pending-dials-per-frontend)"
            ),
            Self::AgentsBusy(limit) => write!(
                f,
                "every agent that could take it has {limit} dials pending (--max-pending-dials-per-agent)"
            ),
            Self::AgentGone(agent) => write!(f, "agent {} disconnected", Elided(&agent.0)),
            Self::ConnIdInUse(conn) => write!(f, "connection id {conn} already in use"),
            Self::ClosedByAgent => f.write_str("dial closed by the agent"),
            Self::Agent { text, .. } => f.write_str(text),
        }
    }
}
