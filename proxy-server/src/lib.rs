//! proxy-server: serves kube-apiserver frontends (gRPC over a Unix socket or
//! mTLS TCP) and proxy-agent backends (gRPC over TLS), and routes each dial
//! to an agent.
//!
//! # Layout
//! The routing core, as plain data:
//! - `router`: every frontend, agent stream, pending dial and connection
//!   by id; each event in, what to send to whom out. No I/O.
//! - [`strategy`], `manager`: proxy strategies and the agent streams
//!   indexed by them.
//! - `conn`: one connection's flow state (window, credit, end), shared
//!   with the transports that move its bytes.
//! - `events`: why dials fail and connections end, for the metrics.
//! - `ids`: the ids of frontend and agent streams.
//!
//! Around it:
//! - `hub`: the router behind one lock with every stream's link; delivers
//!   what never waits, hands back what does.
//! - `link`: a stream's outbound queue and end; `stream_end`: ending a
//!   stream from inside, with a status.
//! - `frontend`: the `ProxyService` handler, HTTP CONNECT, the
//!   `:authority` layer; `agent_service`: the `AgentService` handler.
//! - [`auth`]: service-account token authentication (TokenReview).
//! - [`health`]: `/healthz`, `/readyz`, `/metrics`; `metrics`: the registry.
//! - [`lease`]: the server's Lease (`--enable-lease-controller`).
//! - [`config`]: flags (ANP names and defaults) → validated [`config::Config`].
//! - [`server`]: [`server::ProxyServer::bind`] → [`server::Bound::serve`].

mod agent_service;
pub mod auth;
pub mod config;
mod events;
mod flow_state;
mod frontend;
pub mod health;
mod hub;
mod ids;
pub mod lease;
mod link;
mod manager;
mod metrics;
mod reader;
mod router;
pub mod server;
pub mod strategy;
mod stream_end;

pub use frontend::http_connect::ESTABLISHED;
pub use router::{AGENT_STREAM_CLOSED, DIAL_TIMED_OUT, MISMATCHED, NO_AGENT, STALLED};

use std::sync::{Mutex, MutexGuard, PoisonError};

/// Locks a mutex; a panic elsewhere while holding it leaves data that is
/// still consistent for our uses (maps of handles), so poisoning is ignored.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}
