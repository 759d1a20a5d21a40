//! The server driven by frontends we did not write: Python's grpcio (gRPC
//! C-core) as a kube-apiserver-like gRPC frontend, over the Unix socket with
//! each `:authority` form a client may send and over mTLS TCP, and Python's
//! standard library for HTTP CONNECT (`tests/python/frontend.py`).
//!
//! kube-apiserver (grpc-go) dials the socket with its path as the target, so
//! its `:authority` is the percent-encoded path, `%2Fdir%2Fs.sock`. grpcio
//! sends that path percent-encoded too, but without its leading slash
//! (`dir%2Fs.sock`); the `authority_*` tests pin what it sends. Neither is a
//! form our own client ever used.

#![allow(clippy::unwrap_used)] // tests: a panic is a failure report

use std::sync::atomic::Ordering::SeqCst;

use integration_tests::{
    Pki, ServerOpts, TestAgent, TestServer,
    destination::{self, Destination},
    python::{self, FrontendReport},
    wait_for,
};
use proxy_server::config::Mode;

/// How the Python frontend reaches the server's gRPC frontend.
#[derive(Clone, Copy, Debug)]
enum Form {
    /// `unix:PATH`; grpcio sends the path without its leading slash,
    /// percent-encoded (`dir%2Fs.sock`), as `:authority`.
    PercentEncodedPath,
    /// `unix:PATH` with `grpc.default_authority` = the whole path
    /// percent-encoded (`%2Fdir%2Fs.sock`): what grpc-go, so kube-apiserver,
    /// sends.
    GrpcGoPercentEncodedPath,
    /// `unix:PATH` with `grpc.default_authority` = PATH, slashes and all.
    RawPath,
    /// `unix:PATH` with `grpc.default_authority` = `localhost`.
    Localhost,
    /// `127.0.0.1:PORT` with TLS and the test PKI's client certificate.
    TcpMtls,
}

impl Form {
    /// A gRPC-mode server listening as this form needs.
    async fn server(self) -> TestServer {
        TestServer::start_with(ServerOpts {
            tcp_frontend: matches!(self, Self::TcpMtls),
            ..Default::default()
        })
        .await
    }

    /// The `grpc.default_authority` this form sets for the socket `uds`.
    fn authority(self, uds: &str) -> Option<String> {
        match self {
            Self::PercentEncodedPath | Self::TcpMtls => None,
            Self::GrpcGoPercentEncodedPath => Some(uds.replace('/', "%2F")),
            Self::RawPath => Some(uds.to_owned()),
            Self::Localhost => Some("localhost".to_owned()),
        }
    }

    /// The command line of `case` against `server` in this form.
    fn args(self, server: &TestServer, case: &str, more: &[String]) -> Vec<String> {
        let mut args = vec![case.to_owned()];
        match self {
            Self::PercentEncodedPath
            | Self::GrpcGoPercentEncodedPath
            | Self::RawPath
            | Self::Localhost => {
                let uds = server.uds.display().to_string();
                args.push(format!("--target=unix:{uds}"));
                if let Some(authority) = self.authority(&uds) {
                    args.push(format!("--authority={authority}"));
                }
            }
            Self::TcpMtls => {
                let pki = Pki::get();
                let addr = server.frontend_tcp.expect("a TCP frontend");
                args.push(format!("--target={addr}"));
                args.push(format!("--ca={}", pki.path("frontend-ca.crt").display()));
                args.push(format!("--cert={}", pki.path("proxy-client.crt").display()));
                args.push(format!("--key={}", pki.path("proxy-client.key").display()));
            }
        }
        args.extend_from_slice(more);
        args
    }
}

/// Waits until the server, the agent and the backend hold nothing of the
/// finished tunnels.
async fn assert_clean(server: &TestServer, agent: &TestAgent, backend: &Destination) {
    server.wait_idle().await;
    wait_for("agent and backend connections closed", || {
        agent.handle.endpoint_connections() == 0 && backend.open_connections() == 0
    })
    .await;
}

/// Asserts that a run echoed `len` bytes byte-exact and closed cleanly.
fn assert_echoed(report: &FrontendReport, len: u64) {
    report.assert_ok();
    assert_eq!(report.int("sent"), len, "{report}");
    assert_eq!(report.int("received"), len, "{report}");
    assert_eq!(
        report.str("received_sha256"),
        report.str("sent_sha256"),
        "{report}"
    );
    assert_eq!(report.str("close_error"), "", "{report}");
    // After CLOSE_RSP and the client's half-close the server ends the
    // stream with status OK.
    assert_eq!(report.str("stream_end"), "OK", "{report}");
}

/// One single-use tunnel: 1 MiB to the echo backend and back, then
/// CLOSE_REQ answered by CLOSE_RSP.
async fn echo(form: Form) {
    let server = form.server().await;
    let agent = TestAgent::start(&server).await;
    let echo = destination::echo().await;
    let more = [
        format!("--address={}", echo.address()),
        "--bytes=1048576".into(),
    ];
    let report = python::frontend(form.args(&server, "echo", &more)).await;
    assert_echoed(&report, 1 << 20);
    assert_eq!(echo.accepted.load(SeqCst), 1);
    assert_clean(&server, &agent, &echo).await;
}

/// A dial to a closed port comes back as DIAL_RSP with the agent's error.
async fn dial_error(form: Form) {
    let server = form.server().await;
    let agent = TestAgent::start(&server).await;
    let closed = destination::closed_port();
    let more = [format!("--address={closed}")];
    let report = python::frontend(form.args(&server, "dial-error", &more)).await;
    report.assert_ok();
    assert_eq!(
        report.str("error"),
        format!("dial tcp {closed}: connect: connection refused"),
        "{report}"
    );
    assert_eq!(report.int("connect_id"), 0, "{report}");
    assert_eq!(report.str("stream_end"), "OK", "{report}");
    server.wait_idle().await;
    assert_eq!(agent.handle.endpoint_connections(), 0);
}

/// Fifty single-use tunnels at once, each its own channel (connection).
async fn concurrent(form: Form) {
    const TUNNELS: u64 = 50;
    let server = form.server().await;
    let agent = TestAgent::start(&server).await;
    let echo = destination::echo().await;
    let more = [
        format!("--address={}", echo.address()),
        format!("--tunnels={TUNNELS}"),
        "--bytes=65536".into(),
    ];
    let report = python::frontend(form.args(&server, "concurrent", &more)).await;
    report.assert_ok();
    assert_eq!(report.int("matched"), TUNNELS, "{report}");
    assert_eq!(report.int("distinct_connect_ids"), TUNNELS, "{report}");
    assert_eq!(report.json["stream_ends"]["OK"], TUNNELS, "{report}");
    assert_eq!(echo.accepted.load(SeqCst) as u64, TUNNELS);
    assert_clean(&server, &agent, &echo).await;
}

/// Several Proxy streams on one channel, one after another and then at
/// once, one dial each.
async fn multi_stream(form: Form) {
    const STREAMS: u64 = 8;
    let server = form.server().await;
    let agent = TestAgent::start(&server).await;
    let echo = destination::echo().await;
    let more = [
        format!("--address={}", echo.address()),
        format!("--streams={STREAMS}"),
        "--bytes=131072".into(),
    ];
    let report = python::frontend(form.args(&server, "multi-stream", &more)).await;
    report.assert_ok();
    assert_eq!(report.int("sequential_matched"), STREAMS, "{report}");
    assert_eq!(report.int("concurrent_matched"), STREAMS, "{report}");
    assert_eq!(report.json["stream_ends"]["OK"], 2 * STREAMS, "{report}");
    assert_eq!(echo.accepted.load(SeqCst) as u64, 2 * STREAMS);
    assert_clean(&server, &agent, &echo).await;
}

/// The four gRPC cases for one form, as a module of their own.
macro_rules! grpc_cases {
    ($name:ident, $form:expr) => {
        mod $name {
            use super::*;

            #[tokio::test]
            async fn echoes_one_mib_byte_exact() {
                echo($form).await;
            }

            #[tokio::test]
            async fn reports_the_agents_dial_error() {
                dial_error($form).await;
            }

            #[tokio::test]
            async fn fifty_single_use_tunnels_at_once() {
                concurrent($form).await;
            }

            #[tokio::test]
            async fn several_streams_on_one_channel() {
                multi_stream($form).await;
            }
        }
    };
}

grpc_cases!(uds_percent_encoded_path, Form::PercentEncodedPath);
grpc_cases!(
    uds_grpc_go_percent_encoded_path,
    Form::GrpcGoPercentEncodedPath
);
grpc_cases!(uds_raw_path, Form::RawPath);
grpc_cases!(uds_localhost, Form::Localhost);
grpc_cases!(tcp_mtls, Form::TcpMtls);

/// grpcio's own TLS stack against ours: a client certificate from another
/// CA, or none at all, gets no tunnel.
#[tokio::test]
async fn tcp_mtls_refuses_a_foreign_or_missing_client_certificate() {
    let server = Form::TcpMtls.server().await;
    let _agent = TestAgent::start(&server).await;
    let echo = destination::echo().await;
    let foreign = Pki::other();
    let clients = [
        vec![
            format!("--cert={}", foreign.path("proxy-client.crt").display()),
            format!("--key={}", foreign.path("proxy-client.key").display()),
        ],
        vec![],
    ];
    for client in clients {
        let mut args = vec![
            "echo".to_owned(),
            format!("--target={}", server.frontend_tcp.unwrap()),
            format!("--ca={}", Pki::get().path("frontend-ca.crt").display()),
            format!("--address={}", echo.address()),
        ];
        args.extend(client);
        let report = python::frontend(args).await;
        assert!(
            !report.ok(),
            "a tunnel without a trusted certificate: {report}"
        );
        // The handshake fails, so the channel never connects.
        assert!(
            report
                .str("error")
                .contains("UNAVAILABLE: failed to connect to all addresses"),
            "{report}"
        );
    }
    assert_eq!(echo.accepted.load(SeqCst), 0);
    server.wait_idle().await;
}

/// What grpcio puts in `:authority` for a socket in this form, read off a
/// socket the script itself listens on; returns (socket path, authority).
async fn authority_sent(form: Form) -> (String, String) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("probe.sock").display().to_string();
    let mut args = vec!["authority".to_owned(), format!("--target=unix:{path}")];
    if let Some(authority) = form.authority(&path) {
        args.push(format!("--authority={authority}"));
    }
    let report = python::frontend(args).await;
    report.assert_ok();
    (path, report.str("authority").to_owned())
}

#[tokio::test]
async fn authority_for_a_unix_target_is_the_path_percent_encoded_without_its_first_slash() {
    let (path, sent) = authority_sent(Form::PercentEncodedPath).await;
    // C-core drops the leading slash and percent-encodes the others.
    assert_eq!(sent, path.trim_start_matches('/').replace('/', "%2F"));
}

#[tokio::test]
async fn authority_in_the_grpc_go_form_is_the_whole_path_percent_encoded() {
    let (path, sent) = authority_sent(Form::GrpcGoPercentEncodedPath).await;
    assert_eq!(sent, path.replace('/', "%2F"));
    assert!(sent.starts_with("%2F"), "{sent}");
}

#[tokio::test]
async fn authority_with_the_raw_path_option_is_the_path() {
    let (path, sent) = authority_sent(Form::RawPath).await;
    assert_eq!(sent, path);
}

#[tokio::test]
async fn authority_with_the_localhost_option_is_localhost() {
    let (_, sent) = authority_sent(Form::Localhost).await;
    assert_eq!(sent, "localhost");
}

/// A server in `--mode=http-connect` on its Unix socket.
async fn connect_server() -> TestServer {
    TestServer::start_with(ServerOpts {
        mode: Mode::HttpConnect,
        ..Default::default()
    })
    .await
}

#[tokio::test]
async fn connect_with_the_standard_library_echoes_one_mib_byte_exact() {
    let server = connect_server().await;
    let agent = TestAgent::start(&server).await;
    let echo = destination::echo().await;
    let report = python::frontend([
        "connect-echo".to_owned(),
        format!("--socket={}", server.uds.display()),
        format!("--address={}", echo.address()),
        "--bytes=1048576".to_owned(),
    ])
    .await;
    report.assert_ok();
    // Exactly ANP's head, and no tunnel byte before the client sent one.
    assert_eq!(
        report.str("head"),
        "HTTP/1.1 200 Connection Established",
        "{report}"
    );
    assert_eq!(report.int("received"), 1 << 20, "{report}");
    assert_eq!(
        report.str("received_sha256"),
        report.str("sent_sha256"),
        "{report}"
    );
    assert_clean(&server, &agent, &echo).await;
}

#[tokio::test]
async fn connect_to_a_closed_port_gets_502_with_the_agents_error() {
    let server = connect_server().await;
    let agent = TestAgent::start(&server).await;
    let closed = destination::closed_port();
    let report = python::frontend([
        "connect-error".to_owned(),
        format!("--socket={}", server.uds.display()),
        format!("--address={closed}"),
    ])
    .await;
    report.assert_ok();
    // The agent's "connection refused" is none of the timeout or
    // too-many-files errors, so ANP's mapDialErrorToHTTPStatus gives 502.
    assert_eq!(
        report.str("status_line"),
        "HTTP/1.1 502 Bad Gateway",
        "{report}"
    );
    assert_eq!(
        report.str("body"),
        format!("dial tcp {closed}: connect: connection refused"),
        "{report}"
    );
    assert_eq!(
        report.json["headers"]["content-type"], "text/plain; charset=utf-8",
        "{report}"
    );
    server.wait_idle().await;
    assert_eq!(agent.handle.endpoint_connections(), 0);
}

/// A CONNECT tunnel over mTLS TCP whose agent dies: Python's socket reads
/// a reset (`ConnectionResetError`), never an end of file that would pass
/// for the destination's close (ANP #748: a long `exec` "succeeds" when its
/// agent dies). Before, the server closed the client's socket cleanly
/// (close_notify and a FIN) and Python read `b""`.
#[tokio::test]
async fn connect_over_tls_is_reset_when_its_agent_dies() {
    let server = TestServer::start_with(ServerOpts {
        mode: Mode::HttpConnect,
        tcp_frontend: true,
        ..Default::default()
    })
    .await;
    let agent = TestAgent::start(&server).await;
    let echo = destination::echo().await;
    let pki = Pki::get();
    let addr = server.frontend_tcp.expect("a TCP frontend");
    let run = python::frontend([
        "connect-broken".to_owned(),
        format!("--tcp={addr}"),
        format!("--ca={}", pki.path("frontend-ca.crt").display()),
        format!("--cert={}", pki.path("proxy-client.crt").display()),
        format!("--key={}", pki.path("proxy-client.key").display()),
        format!("--address={}", echo.address()),
        "--bytes=65536".to_owned(),
    ]);
    let kill = async {
        let handle = server.handle.clone();
        wait_for("the tunnel established", || {
            handle.established_connections() == 1
        })
        .await;
        agent.stop().await;
    };
    let (report, ()) = tokio::join!(run, kill);
    report.assert_ok();
    assert_eq!(report.str("ending"), "reset", "{report}");
    assert_eq!(report.json["echoed"], true, "{report}");
    server.wait_idle().await;
}
