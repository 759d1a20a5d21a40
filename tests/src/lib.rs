//! Harness of the end-to-end tests: a proxy-server, proxy-agents and
//! destinations (node-side servers) on loopback with ephemeral ports, each
//! a handle that shuts down on drop, with readiness awaited (never slept
//! for).
//!
//! # Layout
//! - [`pki`]: certificates made fresh for the test process.
//! - [`server`], [`agent`]: [`TestServer`] and [`TestAgent`], the proxies in
//!   process.
//! - [`binaries`]: the real binaries as children ([`AgentProcess`],
//!   [`LoggedProcess`]); [`process`]: the real `proxy-server`, observed from
//!   outside.
//! - [`flags_doc`]: `docs/flags.md`, the flags reference, rendered from
//!   clap.
//! - [`deploy`]: what `deploy/` ships that tests run as shipped (the
//!   recommended destination policy).
//! - [`destination`]: node-side servers the agent dials (echo, bulk,
//!   blackhole); ANP's "backend" is an agent stream, as in the server.
//! - [`grpc_go`]: `tests/go/frontend`, the grpc-go frontend (kube-apiserver's
//!   gRPC client).
//! - [`kube_stub`]: a TokenReview API stand-in with its kubeconfig.
//! - [`lease_stub`]: a coordination.k8s.io/v1 Lease API stand-in.
//! - [`netns`]: a hub and a node network namespace, the test re-run inside
//!   the hub, the node's link and firewall in the test's hands.
//! - [`otlp`]: `tests/python/otlp_receiver.py`, an OTLP/gRPC trace
//!   receiver on OpenTelemetry's generated service.
//! - [`proxies`]: real SOCKS5 and HTTP CONNECT proxies (microsocks, tinyproxy).
//! - [`python`]: `tests/python/frontend.py`, the grpcio and standard-library
//!   frontend.
//! - [`raw_frontend`]: a frontend that sends packets by hand.
//! - [`http`]: raw HTTP/1.1 to the health and admin ports.
//! - [`report`]: a frontend we did not write, run to its end, and the JSON
//!   line it reports.
//! - here: [`wait_for`], which polls a condition until a deadline.

pub mod agent;
pub mod audit;
pub mod binaries;
pub mod deploy;
pub mod destination;
pub mod flags_doc;
pub mod grpc_go;
pub mod http;
pub mod kube_stub;
pub mod lease_stub;
pub mod netns;
pub mod otlp;
pub mod pki;
pub mod process;
pub mod proxies;
pub mod python;
pub mod raw_frontend;
pub mod report;
pub mod server;

use std::{
    path::Path,
    time::{Duration, Instant},
};

pub use agent::*;
pub use binaries::*;
pub use http::*;
pub use pki::*;
pub use raw_frontend::*;
pub use server::*;

/// How long readiness and cleanup conditions may take before a test fails.
pub const DEADLINE: Duration = Duration::from_secs(10);

/// Installs a test subscriber (once); `RUST_LOG` picks the level.
pub fn trace_init() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_test_writer()
        .try_init();
}

/// Polls `condition` every few milliseconds until it holds; panics with
/// `what` after [`DEADLINE`].
pub async fn wait_for(what: &str, mut condition: impl FnMut() -> bool) {
    let start = Instant::now();
    while !condition() {
        assert!(start.elapsed() < DEADLINE, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The workspace root.
pub fn workspace() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the tests crate sits in the workspace")
}

/// The crates of the tree (directories from the workspace root): the
/// root manifest's workspace members, and the fuzz harnesses' crate
/// (outside the workspace: nightly only). The checks of the tree's shape
/// read them all.
pub fn crate_dirs() -> Vec<String> {
    let manifest =
        std::fs::read_to_string(workspace().join("Cargo.toml")).expect("the root manifest");
    let list = manifest
        .split_once("members = [")
        .and_then(|(_, rest)| rest.split_once(']'))
        .map(|(list, _)| list)
        .expect("a members list in the root Cargo.toml");
    list.split(',')
        .map(|m| m.trim().trim_matches('"').to_owned())
        .filter(|m| !m.is_empty())
        .chain(std::iter::once("fuzz".to_owned()))
        .collect()
}

/// Checks that the generated document `relative` (to the workspace root)
/// is `fresh`, what `source` ("what clap says") gives now; with `UPDATE_DOCS` set, rewrites it
/// instead. Panics naming the first line that differs and `update`, the
/// command that rewrites it.
pub fn check_generated_doc(relative: &str, fresh: &str, source: &str, update: &str) {
    let path = workspace().join(relative);
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    if fresh == committed {
        return;
    }
    if std::env::var_os("UPDATE_DOCS").is_some() {
        std::fs::write(&path, fresh).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
        return;
    }
    let lines = committed.lines().count().max(fresh.lines().count());
    let (line, (old, new)) = committed
        .lines()
        .chain(std::iter::repeat("<end of file>"))
        .zip(fresh.lines().chain(std::iter::repeat("<end of file>")))
        .take(lines)
        .enumerate()
        .find(|(_, (old, new))| old != new)
        .unwrap_or((lines, ("<line ends differ>", "")));
    panic!(
        "{relative} differs from {source}, first at line {}:\n  \
         committed: {old}\n  now:       {new}\n\
         It changed without the reference: run `{update}` to rewrite it.",
        line + 1
    );
}
