//! What the routing core and the transports report for the metrics:
//! why a dial failed, why a connection ended, which cap was reached. Plain
//! data shared by `router` (which decides) and `metrics` (which counts).

/// Why a dial failed (`dial_failure_count`'s `reason`).
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub(crate) enum DialFailure {
    /// No agent could take the dial.
    NoAgent,
    /// The agent answered with an error.
    ErrorResponse,
    /// A DIAL_RSP for no pending dial.
    UnrecognizedResponse,
    /// The DIAL_RSP could not be sent to the frontend.
    SendRsp,
    /// The agent went away while the dial was pending.
    BackendClose,
    /// `--backend-dial-timeout` passed.
    BackendDialTimeout,
    /// The frontend went away while the dial was pending.
    FrontendClose,
}

impl DialFailure {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::NoAgent => "no_agent",
            Self::ErrorResponse => "error_response",
            Self::UnrecognizedResponse => "unrecognized_response",
            Self::SendRsp => "send_rsp",
            Self::BackendClose => "backend_close",
            Self::BackendDialTimeout => "backend_dial_timeout",
            Self::FrontendClose => "frontend_close",
        }
    }
}

/// Why an established connection ended (konnectivity-rs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CloseReason {
    /// CLOSE_RSP from the agent without an error (either side closed).
    Closed,
    /// CLOSE_RSP from the agent with an error.
    Error,
    /// The agent's stream ended.
    AgentGone,
    /// The frontend's stream ended.
    FrontendGone,
    /// The frontend fell a whole window behind.
    Overflow,
    /// The frontend took none of the connection's data for
    /// `--frontend-stall-timeout`.
    Stalled,
    /// The frontend used another frontend's connection id.
    Mismatch,
}

impl CloseReason {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Closed => "closed",
            Self::Error => "error",
            Self::AgentGone => "agent_gone",
            Self::FrontendGone => "frontend_gone",
            Self::Overflow => "overflow",
            Self::Stalled => "stalled",
            Self::Mismatch => "mismatch",
        }
    }
}

/// An admission limit of ours (`konnectivity_rs_server_limit_reached_total`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Limit {
    /// An agent stream's outbound queue was past its reserve: the agent
    /// does not read, and its stream was ended.
    AgentQueue,
    /// A frontend stream's control packets were past their reserve: the
    /// frontend does not read, and its stream was ended.
    FrontendQueue,
    /// `--max-tls-handshakes`: a pending handshake whose peer stalled was
    /// dropped to make room.
    TlsHandshakes,
    /// `--max-http-connections`: a CONNECT client was refused with 503.
    HttpConnections,
}

impl Limit {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::AgentQueue => "agent_queue",
            Self::FrontendQueue => "frontend_queue",
            Self::TlsHandshakes => "tls_handshakes",
            Self::HttpConnections => "http_connections",
        }
    }
}
