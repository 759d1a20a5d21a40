//! proxy-server: serves kube-apiserver frontends (gRPC over a Unix socket or
//! mTLS TCP) and proxy-agent backends (gRPC over TLS), and routes each dial
//! to an agent.
//!
//! # Layout
//! The routing core, as plain data (ids only: no `Arc`, no lock, no clock):
//! - `router`: every frontend, agent stream, pending dial and connection
//!   by id; each control event in (with `now`), what to do out (`Out`).
//!   It sees DATA only as a fallback, for a connection its stream's driver
//!   does not know: a frontend's (forwarded to its agent, or refused), an
//!   agent's for a closed connection (answered with CLOSE_REQ).
//! - [`strategy`], `manager`: proxy strategies and the agent streams
//!   indexed by them.
//! - `events`: why dials fail and connections end, as enums.
//! - `ids`: the ids of frontend and agent streams.
//!
//! Its driver, and one driver per stream:
//! - `control`: the router behind the one lock streams share, taken once
//!   per control event; carries out the router's `Out`s that never wait
//!   and hands back those that may (`Work`): to the frontend's driver, or
//!   to its dialer (retried and hedged dials).
//! - `conn`: an established connection (`Conn`: its flow state and both
//!   streams' queues), which both streams' drivers hold in their own
//!   tables (`ConnTable`); the outbound queues of both streams it joins,
//!   an agent's (`BackendLink`) and a frontend's (`FrontendTx`).
//! - `stream`: what every stream has: its end (`StreamEnd`); for gRPC
//!   streams, the packets received from the peer (`next_packet`) and the
//!   stream returned to it (`PacketStream`).
//! - `backend`: the `AgentService` handler (`backend/service`) and the
//!   agent stream's driver (`backend/driver`).
//! - `frontend`: the `ProxyService` handler and its driver, and HTTP
//!   CONNECT. The `:authority` layer under the Unix socket is the
//!   `authority` crate.
//! - [`auth`]: service-account token authentication (TokenReview).
//! - [`health`]: `/healthz`, `/readyz`, `/metrics`; [`metrics`]: the registry
//!   (every family in it: [`metrics::families`], `docs/metrics.md`).
//! - [`lease`]: the server's Lease (`--enable-lease-controller`).
//! - [`config`]: flags (ANP names and defaults) → validated [`config::Config`].
//! - [`server`]: [`server::ProxyServer::bind`] → [`server::Bound::serve`].
//! - `fuzzing`: the fuzz targets' entry points (tests and the `fuzzing`
//!   feature only; `docs/fuzzing.md`).

/// The test build counts each thread's heap, so that the replay of the fuzz
/// corpora checks each target's heap bound (`fuzz/replay.rs`).
#[cfg(test)]
#[global_allocator]
static ALLOCATOR: heap_count::Counting<std::alloc::System> =
    heap_count::Counting::new(std::alloc::System);

pub mod auth;
mod backend;
pub mod config;
mod conn;
mod control;
mod events;
mod frontend;
#[cfg(any(test, feature = "fuzzing"))]
#[doc(hidden)]
pub mod fuzzing;
pub mod health;
mod ids;
pub mod lease;
mod manager;
pub mod metrics;
mod router;
pub mod server;
pub mod strategy;
mod stream;
mod traces;

pub use events::{AGENT_STREAM_CLOSED, DIAL_TIMED_OUT, NO_AGENT};
pub use frontend::{http_connect::ESTABLISHED, lanes::UPLOAD_GRACE};
pub use router::{DialCaps, DialPolicy, HedgeDelay, MISMATCHED, STALLED, UPLOAD_STALLED};

/// The lock audit of a server instance: which streams took which lock
/// (see `tunnel::sync::audit`).
pub use tunnel::sync::audit;
