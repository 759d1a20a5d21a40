//! Shared runtime pieces of `proxy-server` and `proxy-agent`.
//!
//! # Layout
//! - [`ids`]: newtypes for connection, dial, agent and server ids.
//! - [`pump`]: moves bytes between a socket and DATA packets.
//! - [`proxy_client`]: reaching the server through SOCKS5/HTTP proxies.
//! - [`client`]: the frontend side of `ProxyService/Proxy` (what
//!   konnectivity-client does for kube-apiserver), for tests and tools.
//! - [`tls`]: PEM loading and rustls configs (ring provider only).
//! - [`duration`]: Go duration syntax for flags (`1h0m0s`, `100ms`).
//! - [`signal`]: SIGINT/SIGTERM as futures.
//! - [`telemetry`]: tracing subscriber set-up shared by both binaries.
//! - [`error`]: printing error chains.
//! - [`flags`]: Go booleans, Go durations and klog flags for clap.
//! - [`flow`]: per-connection windows and bounded receive queues.
//! - [`queue`]: byte-bounded outbound queues of shared streams.
//! - [`conn`]: glue that lets tonic serve TLS and Unix streams.
//! - [`http`]: the health and admin HTTP servers with ANP's limits and Go's answers.
//! - [`kube`]: the kube API client (TokenReview, Leases), label selector syntax.
//! - [`profiling`]: Go-style `/debug/pprof/` CPU profiles (`--enable-profiling`).
//! - [`metrics`]: Prometheus exposition in ANP's format, process metrics.

pub mod client;
pub mod conn;
pub mod duration;
pub mod error;
pub mod flags;
pub mod flow;
pub mod http;
pub mod ids;
pub mod kube;
pub mod metrics;
pub mod profiling;
pub mod proxy_client;
pub mod pump;
pub mod queue;
pub mod signal;
pub mod telemetry;
pub mod tls;
