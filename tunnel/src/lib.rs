//! The data plane of `proxy-server` and `proxy-agent`: what moves a
//! connection's bytes and bounds them. No flags, no telemetry, no kube, no
//! metrics exposition (those are `runtime`'s).
//!
//! # Layout
//! - [`ids`]: newtypes for connection, dial, agent and server ids.
//! - [`flow`]: per-connection windows, credit and bounded receive queues.
//! - [`queue`]: byte-bounded outbound queues of shared streams.
//! - [`mover`]: one connection's bytes between its socket and its DATA
//!   packets, both ways.
//! - [`conn`]: accepting TLS and TCP for tonic without letting one peer
//!   hold up the others; binding listeners.
//! - [`read_ahead`]: up to 64 KiB per read system call under TLS, no
//!   buffer while idle.
//! - [`proxy_client`]: reaching the server through SOCKS5/HTTP proxies.

pub mod conn;
pub mod flow;
pub mod ids;
pub mod mover;
pub mod proxy_client;
pub mod queue;
pub mod read_ahead;
