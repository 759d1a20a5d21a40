//! Newtypes for the protocol's ids, so that the two `i64`s (dial id and
//! connection id) cannot be swapped and string ids are not confused.

use std::fmt;

/// Connection id assigned by an agent (`connectID`); unique per agent stream,
/// 0 means "none".
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConnId(pub i64);

/// Dial id chosen by the frontend (`random`), echoed in `DIAL_RSP`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DialId(pub i64);

impl DialId {
    /// A fresh non-negative random dial id, as Go's `rand.Int63()` gives.
    pub fn random() -> Self {
        Self(fastrand::i64(1..i64::MAX))
    }
}

/// An agent's self-asserted id (`agentid` metadata).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AgentId(pub String);

/// A proxy-server replica's id (`serverid` header).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServerId(pub String);

impl fmt::Display for ConnId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl fmt::Display for DialId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl fmt::Display for AgentId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl fmt::Display for ServerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}
