//! What both binaries run on besides the data plane (`tunnel`): their
//! flags, logging, TLS files, HTTP endpoints, metrics exposition, profiles
//! and kube client.
//!
//! # Layout
//! - [`audit`]: the audit log: a record per tunnel, JSON lines, rotated files.
//! - [`cli`]: the start and end of both binaries' `main`.
//! - [`duration`]: Go duration syntax for flags (`1h0m0s`, `100ms`).
//! - [`error`]: printing error chains.
//! - [`flags`]: Go booleans, Go durations and klog flags for clap.
//! - [`tls`]: PEM loading and rustls configs (ring provider only).
//! - [`signal`]: SIGINT/SIGTERM as futures.
//! - [`telemetry`]: tracing subscriber set-up shared by both binaries.
//! - [`http`]: the health and admin HTTP servers with ANP's limits and Go's answers.
//! - [`metrics`]: Prometheus exposition in ANP's format, process metrics.
//! - [`otel`]: OpenTelemetry traces (`--tracing-config-file`), exported over OTLP.
//! - [`profiling`]: Go-style `/debug/pprof/` CPU profiles (`--enable-profiling`).
//! - [`kube`]: the kube API client (TokenReview, Leases), label selector syntax.
//! - `fuzzing`: the fuzz targets' entry points (tests and the `fuzzing`
//!   feature only; `docs/fuzzing.md`).

/// The unit tests of `metrics::jemalloc` read the figures of this test
/// process's own allocator: jemalloc, as in the binaries. The test build
/// counts each thread's heap, so that the replay of the fuzz corpora checks
/// each target's heap bound (`fuzz/replay.rs`).
#[cfg(all(test, feature = "jemalloc"))]
#[global_allocator]
static ALLOCATOR: heap_count::Counting<tikv_jemallocator::Jemalloc> =
    heap_count::Counting::new(tikv_jemallocator::Jemalloc);

/// Without jemalloc, the system allocator, counted as above.
#[cfg(all(test, not(feature = "jemalloc")))]
#[global_allocator]
static ALLOCATOR: heap_count::Counting<std::alloc::System> =
    heap_count::Counting::new(std::alloc::System);

pub mod audit;
pub mod cli;
pub mod duration;
pub mod error;
pub mod flags;
#[cfg(any(test, feature = "fuzzing"))]
#[doc(hidden)]
pub mod fuzzing;
pub mod http;
pub mod kube;
pub mod metrics;
pub mod otel;
pub mod profiling;
pub mod signal;
pub mod telemetry;
pub mod tls;
