//! proxy-server: serves kube-apiserver frontends (gRPC over a Unix socket or
//! mTLS TCP) and proxy-agent backends (gRPC over TLS), and routes each dial
//! to an agent.
//!
//! # Layout
//! The routing core, as plain data (ids only: no `Arc`, no lock, no clock):
//! - `router`: every frontend, agent stream, pending dial and connection
//!   by id; each event in (with `now`), what to do out (`Out`). No I/O.
//! - [`strategy`], `manager`: proxy strategies and the agent streams
//!   indexed by them.
//! - `events`: why dials fail and connections end, for the metrics.
//! - `ids`: the ids of frontend and agent streams.
//!
//! Its driver and the streams:
//! - `hub`: the router behind one lock with every stream's link and every
//!   connection's flow state; reads the clock, carries out the router's
//!   `Out`s that never wait and hands back the one that may (`Work`).
//! - `link`: a stream's outbound queue and its end (`StreamEnd`), and a
//!   connection's flow state (`ConnFlow`: window, credit, stall clock).
//! - `reader`: the one reader loop of both gRPC services.
//! - `frontend`: the `ProxyService` handler and HTTP CONNECT;
//!   `agent_service`: the `AgentService` handler. The `:authority` layer
//!   under the Unix socket is the `authority` crate.
//! - [`auth`]: service-account token authentication (TokenReview).
//! - [`health`]: `/healthz`, `/readyz`, `/metrics`; `metrics`: the registry.
//! - [`lease`]: the server's Lease (`--enable-lease-controller`).
//! - [`config`]: flags (ANP names and defaults) → validated [`config::Config`].
//! - [`server`]: [`server::ProxyServer::bind`] → [`server::Bound::serve`].

mod agent_service;
pub mod auth;
pub mod config;
mod events;
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

pub use frontend::http_connect::ESTABLISHED;
pub use router::{AGENT_STREAM_CLOSED, DIAL_TIMED_OUT, MISMATCHED, NO_AGENT, STALLED};

use std::sync::{Mutex, MutexGuard, PoisonError};

/// Locks a mutex; a panic elsewhere while holding it leaves data that is
/// still consistent for our uses (maps of handles), so poisoning is ignored.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}
