//! The server's own ids: of a frontend stream and of an agent stream
//! (ANP's backend). The protocol's ids are `tunnel::ids`.

/// A frontend stream (`ProxyService/Proxy`, or one HTTP CONNECT).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct FrontendId(pub(crate) u64);

/// An agent stream (`AgentService/Connect`): ANP's backend. Two streams of
/// one agent are two backends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct BackendId(pub(crate) u64);

/// What vouches for an agent stream, as picks and votes count it: one
/// credential, one voice, however many streams or agent ids it opens.
/// `cert:<SHA-256 of the client certificate>` with
/// `--verify-agent-identifiers`, `node:<name>` for a token bound to a
/// node, else `agent:<agent id>` (its word, as ANP takes it).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct Credential(pub(crate) String);

impl std::fmt::Display for Credential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::fmt::Display for FrontendId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::fmt::Display for BackendId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl FrontendId {
    /// This stream, as the lock audit names it.
    pub(crate) fn taker(self) -> tunnel::sync::audit::Taker {
        tunnel::sync::audit::Taker {
            kind: "frontend",
            id: self.0,
        }
    }
}

impl BackendId {
    /// This stream, as the lock audit names it.
    pub(crate) fn taker(self) -> tunnel::sync::audit::Taker {
        tunnel::sync::audit::Taker {
            kind: "backend",
            id: self.0,
        }
    }
}
