//! proxy-agent: dials out to proxy-server over TLS, keeps one
//! `AgentService/Connect` stream per server replica, and opens the node-side
//! TCP connections the server asks for.
//!
//! # Layout
//! - [`config`]: flags (ANP names and defaults) → validated [`config::Config`].
//! - [`agent`]: [`agent::Agent::bind`] → [`agent::Bound::serve`]; the client
//!   set and its sync loop.
//! - [`client`]: one `Connect` stream and its packet handling.
//! - [`endpoint`]: node-side connections and dials of one stream.
//! - [`destinations`]: the destination policy in use (its file followed),
//!   the node's addresses, the log of refusals.
//! - `health`: `/healthz`, `/readyz`.
//! - [`lease`]: counting servers by their Leases.
//! - [`metrics`]: ANP's agent metrics and ours.
//! - [`policy`]: the destination policy (pure: rules, normalisation,
//!   decisions).
//! - `fuzzing`: the fuzz targets' entry points (tests and the `fuzzing`
//!   feature only; `docs/fuzzing.md`).

/// The test build counts each thread's heap, so that the replay of the fuzz
/// corpora checks each target's heap bound (`fuzz/replay.rs`).
#[cfg(test)]
#[global_allocator]
static ALLOCATOR: heap_count::Counting<std::alloc::System> =
    heap_count::Counting::new(std::alloc::System);

pub mod agent;
pub mod audit;
pub mod client;
pub mod config;
pub mod destinations;
pub mod endpoint;
#[cfg(any(test, feature = "fuzzing"))]
#[doc(hidden)]
pub mod fuzzing;
mod health;
pub mod lease;
pub mod metrics;
mod outbound;
pub mod policy;
pub mod table;
