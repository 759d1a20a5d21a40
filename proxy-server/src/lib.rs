//! proxy-server: serves kube-apiserver frontends (gRPC over a Unix socket or
//! mTLS TCP) and proxy-agent backends (gRPC over TLS), and routes each dial
//! to an agent.
//!
//! # Layout
//! - [`config`]: flags (ANP names and defaults) → validated [`config::Config`].
//! - [`server`]: [`server::ProxyServer::bind`] → [`server::Bound::serve`].
//! - `tunnels`: the packet bookkeeping between frontends and backends.
//! - [`auth`]: service-account token authentication (TokenReview).
//! - [`backend`]: one `Backend` per agent stream, the `BackendManager` and
//!   proxy strategies, the `AgentService` handler.
//! - `frontend`: one `Frontend` per `Proxy` stream, the `ProxyService` handler.
//! - `dial`: the pending-dial table.
//! - [`health`]: `/healthz`, `/readyz`, `/metrics`.
//! - [`lease`]: the server's Lease (`--enable-lease-controller`).
//! - `metrics`: the Prometheus registry.
//! - `stream_end`: ending a server-side stream, with a status.

pub mod auth;
pub mod backend;
pub mod config;
pub(crate) mod conn;
mod dial;
mod frontend;
pub mod health;
pub mod lease;
mod metrics;
pub mod server;
mod stream_end;
mod tunnels;

pub use frontend::http_connect::ESTABLISHED;
pub use tunnels::{AGENT_STREAM_CLOSED, DIAL_TIMED_OUT, MISMATCHED, NO_AGENT, STALLED};

use std::sync::{Mutex, MutexGuard, PoisonError};

/// Locks a mutex; a panic elsewhere while holding it leaves data that is
/// still consistent for our uses (maps of handles), so poisoning is ignored.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}
