//! The server driven by kube-apiserver's own gRPC library: grpc-go (Debian's
//! build), through `tests/go/frontend`. Each tunnel is a new gRPC connection
//! dialed as kube-apiserver's egress dialer does (the socket path as the
//! target, so grpc-go picks its own `:authority`; or TCP with mTLS), with
//! grpc-go's own HTTP/2 settings: 16 KiB frames, 64 KiB initial windows
//! grown by BDP pings. The gRPC frontend only exists in the server's gRPC
//! mode; HTTP-CONNECT mode has its own clients (curl, Python).

#![allow(clippy::unwrap_used)] // tests: a panic is a failure report

use integration_tests::{
    ServerOpts, TestAgent, TestServer, destination,
    grpc_go::{self, Running},
};

/// Bytes of the bulk tests.
const BULK: usize = 16 << 20;

/// A gRPC-mode server (with its TCP frontend when `tcp`) and one agent.
async fn deployment(tcp: bool) -> (TestServer, TestAgent) {
    let server = TestServer::start_with(ServerOpts {
        tcp_frontend: tcp,
        ..Default::default()
    })
    .await;
    let agent = TestAgent::start(&server).await;
    (server, agent)
}

/// `mode` with `args` through `server`'s socket, or its TCP frontend.
fn args(server: &TestServer, tcp: bool, mode: &str, more: &[String]) -> Vec<String> {
    let mut args = grpc_go::transport_args(server, tcp);
    args.push(mode.to_owned());
    args.extend(more.iter().cloned());
    args
}

/// Downloads [`BULK`] bytes through `server` with the grpc-go frontend,
/// which checks every byte.
async fn download_bulk(server: &TestServer, tcp: bool) {
    let source = destination::download(BULK).await;
    let report = grpc_go::run(args(
        server,
        tcp,
        "download",
        &[
            format!("-addr={}", source.address()),
            format!("-bytes={BULK}"),
            // destination::download sends pattern(len, 7); the frontend
            // checks every byte against it.
            "-seed=7".to_owned(),
        ],
    ))
    .await;
    report.assert_ok();
    assert_eq!(report.int("bytes"), BULK as u64);
}

async fn download_is_byte_exact(tcp: bool) {
    let (server, _agent) = deployment(tcp).await;
    download_bulk(&server, tcp).await;
    server.wait_idle().await;
}

async fn upload_is_byte_exact(tcp: bool) {
    let (server, _agent) = deployment(tcp).await;
    let sink = destination::upload_hash().await;
    let report = grpc_go::run(args(
        &server,
        tcp,
        "upload",
        &[
            format!("-addr={}", sink.address()),
            format!("-bytes={BULK}"),
            "-hash".to_owned(),
        ],
    ))
    .await;
    report.assert_ok();
    assert_eq!(
        report.int("answer"),
        report.int("fnv"),
        "the destination hashed other bytes than were sent: {report}"
    );
    server.wait_idle().await;
}

async fn the_agents_dial_error_comes_back_in_dial_rsp(tcp: bool) {
    let (server, _agent) = deployment(tcp).await;
    let closed = destination::closed_port();
    let report = grpc_go::run(args(
        &server,
        tcp,
        "dial-error",
        &[format!("-addr={closed}")],
    ))
    .await;
    report.assert_ok();
    assert!(
        report.str("error").contains("connection refused"),
        "{report}"
    );
    server.wait_idle().await;
}

async fn two_hundred_single_use_tunnels_eight_at_a_time(tcp: bool) {
    let (server, _agent) = deployment(tcp).await;
    let echo = destination::echo().await;
    let report = grpc_go::run(args(
        &server,
        tcp,
        "dials",
        &[
            format!("-addr={}", echo.address()),
            "-count=200".to_owned(),
            "-concurrency=8".to_owned(),
            "-exchange=1024".to_owned(),
        ],
    ))
    .await;
    report.assert_ok();
    assert_eq!(report.int("errors"), 0, "{report}");
    assert_eq!(report.int("dials"), 200, "{report}");
    server.wait_idle().await;
    integration_tests::wait_for("every frontend stream to end", || {
        server.handle.frontend_count() == 0
    })
    .await;
}

/// One tunnel reads nothing from a destination that writes without end;
/// a 16 MiB download through the same agent still completes byte-exact.
async fn a_stalled_reader_does_not_hold_up_a_bulk_download(tcp: bool) {
    let (server, _agent) = deployment(tcp).await;
    let endless = destination::source().await;
    let (stalled, said) = Running::start(args(
        &server,
        tcp,
        "stall",
        &[format!("-addr={}", endless.address())],
    ))
    .await;
    assert_eq!(said["stalled"], endless.address());
    download_bulk(&server, tcp).await;
    assert!(stalled.finish().await.success());
    server.wait_idle().await;
}

// --- The reusable tunnel: every tunnel a Proxy stream on one connection, as
// konnectivity-client's CreateGRPCTunnel does (`-reuse`). ---------------------

/// `mode` on one shared gRPC connection.
fn reused(server: &TestServer, tcp: bool, mode: &str, more: &[String]) -> Vec<String> {
    let mut args = grpc_go::transport_args(server, tcp);
    args.push("-reuse".to_owned());
    args.push(mode.to_owned());
    args.extend(more.iter().cloned());
    args
}

async fn reusable_tunnels_are_byte_exact_both_ways(tcp: bool) {
    let (server, _agent) = deployment(tcp).await;
    let source = destination::download(BULK).await;
    let sink = destination::upload_hash().await;
    let down = grpc_go::run(reused(
        &server,
        tcp,
        "download",
        &[
            format!("-addr={}", source.address()),
            format!("-bytes={BULK}"),
            "-seed=7".to_owned(),
        ],
    ))
    .await;
    down.assert_ok();
    assert_eq!(down.int("connections"), 1, "{down}");
    let up = grpc_go::run(reused(
        &server,
        tcp,
        "upload",
        &[
            format!("-addr={}", sink.address()),
            format!("-bytes={BULK}"),
            "-hash".to_owned(),
        ],
    ))
    .await;
    up.assert_ok();
    assert_eq!(up.int("answer"), up.int("fnv"), "{up}");
    server.wait_idle().await;
}

async fn two_hundred_reusable_tunnels_eight_at_a_time_on_one_connection(tcp: bool) {
    let (server, _agent) = deployment(tcp).await;
    let echo = destination::echo().await;
    let report = grpc_go::run(reused(
        &server,
        tcp,
        "dials",
        &[
            format!("-addr={}", echo.address()),
            "-count=200".to_owned(),
            "-concurrency=8".to_owned(),
            "-exchange=1024".to_owned(),
        ],
    ))
    .await;
    report.assert_ok();
    assert_eq!(report.int("errors"), 0, "{report}");
    assert_eq!(report.int("dials"), 200, "{report}");
    assert_eq!(report.int("connections"), 1, "{report}");
    server.wait_idle().await;
}

/// A stream that reads nothing beside a 16 MiB download on the same
/// connection: HTTP/2's per-stream windows keep them apart.
async fn a_stalled_stream_beside_a_bulk_one_on_the_same_connection(tcp: bool) {
    let (server, _agent) = deployment(tcp).await;
    let endless = destination::source().await;
    let source = destination::download(BULK).await;
    let report = grpc_go::run(reused(
        &server,
        tcp,
        "stall-bulk",
        &[
            format!("-stall={}", endless.address()),
            format!("-addr={}", source.address()),
            format!("-bytes={BULK}"),
            "-seed=7".to_owned(),
        ],
    ))
    .await;
    report.assert_ok();
    assert_eq!(report.int("bytes"), BULK as u64, "{report}");
    assert_eq!(report.int("connections"), 1, "{report}");
    server.wait_idle().await;
}

/// The frontend's connection closes under 16 live tunnels: every stream
/// fails on the frontend, and the server and the agent close them all.
async fn a_connection_closed_under_live_streams_ends_them_all(tcp: bool) {
    let (server, agent) = deployment(tcp).await;
    let echo = destination::echo().await;
    let report = grpc_go::run(reused(
        &server,
        tcp,
        "cut",
        &[format!("-addr={}", echo.address()), "-count=16".to_owned()],
    ))
    .await;
    report.assert_ok();
    assert_eq!(report.int("failed"), 16, "{report}");
    server.wait_idle().await;
    integration_tests::wait_for("the agent to close the destinations", || {
        agent.handle.endpoint_connections() == 0
    })
    .await;
    integration_tests::wait_for("the echo server to see them closed", || {
        echo.open_connections() == 0
    })
    .await;
}

/// Each case over the Unix socket (kube-apiserver's usual way) and over TCP
/// with mTLS.
macro_rules! both_transports {
    ($($case:ident),* $(,)?) => {
        mod uds {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    super::$case(false).await;
                }
            )*
        }
        mod tcp_mtls {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    super::$case(true).await;
                }
            )*
        }
    };
}

both_transports!(
    download_is_byte_exact,
    upload_is_byte_exact,
    the_agents_dial_error_comes_back_in_dial_rsp,
    two_hundred_single_use_tunnels_eight_at_a_time,
    a_stalled_reader_does_not_hold_up_a_bulk_download,
    reusable_tunnels_are_byte_exact_both_ways,
    two_hundred_reusable_tunnels_eight_at_a_time_on_one_connection,
    a_stalled_stream_beside_a_bulk_one_on_the_same_connection,
    a_connection_closed_under_live_streams_ends_them_all,
);

/// kube-apiserver with the reusable tunnel carries every tunnel on one
/// connection: 1,000 long-lived ones (and a stalled one) at once, far past
/// the 128 streams a connection was limited to, each echoing when opened
/// and again at the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_long_lived_tunnels_on_one_connection_with_a_stalled_one() {
    let (server, agent) = deployment(false).await;
    let echo = destination::echo().await;
    let endless = destination::source().await;
    let (many, said) = Running::start(reused(
        &server,
        false,
        "many",
        &[
            format!("-addr={}", echo.address()),
            format!("-stall={}", endless.address()),
            "-count=1000".to_owned(),
        ],
    ))
    .await;
    assert_eq!(said["open"], 1000, "{said}");
    assert_eq!(said["connections"], 1, "{said}");
    assert_eq!(server.handle.established_connections(), 1001);
    assert_eq!(agent.handle.endpoint_connections(), 1001);
    assert!(many.finish().await.success(), "a tunnel failed at the end");
    server.wait_idle().await;
}
