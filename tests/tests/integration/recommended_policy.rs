//! Issue 45: the recommended destination policy `deploy/` ships passes
//! kube-apiserver's kinds of traffic. The agent is the real binary run with
//! the agent DaemonSet's arguments and the ConfigMap's policy text as
//! shipped, byte for byte (`manifests::manifest_agent`); the frontend is
//! grpc-go, kube-apiserver's own gRPC client (`tests/go/frontend`).
//!
//! What differs from a cluster, and why: the destinations the agent dials
//! (the kubelet, a webhook, an aggregated API server, an exec or
//! port-forward stream) listen on the hub namespace's veth address
//! ([`netns::HUB_IP`], 10.251.0.1), not on loopback. Elsewhere the suite
//! puts them on 127.0.0.1, which the shipped `deny loopback` refuses, as it
//! should: in a cluster they are on node, pod and service addresses. So
//! each test here runs inside network namespaces of its own, where such an
//! address exists, and the policy file is not edited at all. The server
//! and the frontend still meet on loopback and a Unix socket; the policy
//! only judges what the agent dials. kube-apiserver's other egress
//! protocol, HTTP CONNECT on the socket, is carried too. Frontends we did
//! not write drive both modes through the shipped policy: Python's grpcio
//! (a Proxy stream) and Python's standard library (CONNECT on the socket,
//! as kube-apiserver sends it), beside our own dialer.

#![allow(clippy::unwrap_used)] // tests: a panic is a failure report

use integration_tests::{
    ServerOpts, TestServer,
    destination::{self, Destination},
    grpc_go::{self, transport_args},
    netns::{self, HUB_IP},
    python,
    report::FrontendReport,
};

use crate::manifests::manifest_agent;

/// Bytes of each bulk transfer.
const BULK: usize = 4 << 20;

/// `mode` with `more` through `server`'s Unix socket (kube-apiserver's
/// usual egress), on one shared connection when `reuse` (konnectivity-
/// client's reusable tunnel).
async fn go(server: &TestServer, reuse: bool, mode: &str, more: &[String]) -> FrontendReport {
    let mut args = transport_args(server, false);
    if reuse {
        args.push("-reuse".to_owned());
    }
    args.push(mode.to_owned());
    args.extend(more.iter().cloned());
    grpc_go::run(args).await
}

/// `-addr=` of `destination`.
fn addr(destination: &Destination) -> String {
    format!("-addr={}", destination.address())
}

/// `kubectl logs`, `exec` output, `cp` from a pod: a bulk download from
/// the kubelet, every byte checked.
async fn kubelet_download(server: &TestServer, reuse: bool) {
    let kubelet = destination::download_on_any(HUB_IP, BULK).await;
    let more = [
        addr(&kubelet),
        format!("-bytes={BULK}"),
        "-seed=7".to_owned(),
    ];
    let report = go(server, reuse, "download", &more).await;
    report.assert_ok();
    assert_eq!(report.int("bytes"), BULK as u64, "{report}");
}

/// `exec` stdin, `cp` to a pod: a bulk upload the kubelet side hashes.
async fn kubelet_upload(server: &TestServer, reuse: bool) {
    let kubelet = destination::upload_hash_on_any(HUB_IP).await;
    let more = [addr(&kubelet), format!("-bytes={BULK}"), "-hash".to_owned()];
    let report = go(server, reuse, "upload", &more).await;
    report.assert_ok();
    assert_eq!(report.int("answer"), report.int("fnv"), "{report}");
}

/// Webhook and aggregated-API calls: one short tunnel each, eight at a
/// time, each exchanging 1 KiB both ways.
async fn webhook_calls(server: &TestServer, reuse: bool) {
    let webhook = destination::echo_on_any(HUB_IP).await;
    let more = [
        addr(&webhook),
        "-count=100".to_owned(),
        "-concurrency=8".to_owned(),
        "-exchange=1024".to_owned(),
    ];
    let report = go(server, reuse, "dials", &more).await;
    report.assert_ok();
    assert_eq!(report.int("errors"), 0, "{report}");
    assert_eq!(report.int("dials"), 100, "{report}");
    assert_eq!(
        webhook.accepted.load(std::sync::atomic::Ordering::SeqCst),
        100
    );
}

/// Python's `case` through the server `via` (`--target=…` for grpcio's
/// `echo`, `--socket=…` for the standard library's `connect-echo`): 1 MiB
/// echoed byte-exact from a node address.
async fn python_echoes_a_mib(case: &str, via: &str) {
    let echo = destination::echo_on_any(HUB_IP).await;
    let report = python::frontend([
        case.to_owned(),
        via.to_owned(),
        format!("--address={}", echo.address()),
        "--bytes=1048576".to_owned(),
    ])
    .await;
    report.assert_ok();
    assert_eq!(report.int("received"), 1 << 20, "{case}: {report}");
    assert_eq!(
        report.str("received_sha256"),
        report.str("sent_sha256"),
        "{case}: {report}"
    );
}

/// Python's grpcio, a frontend we did not write: 1 MiB echoed byte-exact
/// from a node address, and the metadata address refused naming the rule.
async fn grpcio(server: &TestServer) {
    let target = format!("--target=unix:{}", server.uds.display());
    python_echoes_a_mib("echo", &target).await;
    let report = python::frontend([
        "dial-error".to_owned(),
        target,
        "--address=169.254.169.254:80".to_owned(),
    ])
    .await;
    report.assert_ok();
    let error = report.str("error");
    assert!(
        error.ends_with("denied by the agent's policy (rule deny metadata)"),
        "{error}"
    );
}

/// The policy is in force, not merely loaded: the same kind of dial to a
/// loopback listener and to the metadata address is refused by the agent
/// naming the shipped rule, and the listener sees no connection.
async fn refusals(server: &TestServer) {
    let loopback = destination::echo().await;
    for (target, rule) in [
        (loopback.address(), "deny loopback"),
        ("169.254.169.254:80".to_owned(), "deny metadata"),
        ("169.254.1.1:10250".to_owned(), "deny link-local"),
    ] {
        let report = go(server, false, "dial-error", &[format!("-addr={target}")]).await;
        report.assert_ok();
        let error = report.str("error");
        assert!(
            error.contains(&format!("denied by the agent's policy (rule {rule})")),
            "{target}: {error}"
        );
    }
    assert_eq!(
        loopback.accepted.load(std::sync::atomic::Ordering::SeqCst),
        0
    );
}

/// Each kind of traffic through the manifest's agent, each tunnel its own
/// gRPC connection (kube-apiserver's egress dialer) and then all on one
/// (the reusable tunnel); then the refusals.
#[test]
fn kube_apiserver_traffic_passes_the_shipped_policy() {
    grpc_go::binary();
    netns::run_in_hub(
        "recommended_policy::kube_apiserver_traffic_passes_the_shipped_policy",
        |_node| async move {
            let server = TestServer::start().await;
            let _agent = manifest_agent(&server);
            server.wait_for_backends(1).await;
            for reuse in [false, true] {
                kubelet_download(&server, reuse).await;
                kubelet_upload(&server, reuse).await;
                webhook_calls(&server, reuse).await;
            }
            grpcio(&server).await;
            refusals(&server).await;
            server.wait_idle().await;
        },
    );
}

/// `CONNECT target` on `server`'s socket; the whole answer of a refusal.
async fn refused_connect(server: &TestServer, target: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut io = tokio::net::UnixStream::connect(&server.uds).await.unwrap();
    let request = format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n");
    io.write_all(request.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(
        std::time::Duration::from_secs(10),
        io.read_to_end(&mut answer),
    )
    .await
    .expect("no answer")
    .unwrap();
    String::from_utf8_lossy(&answer).into_owned()
}

/// The same policy under kube-apiserver's HTTP-CONNECT egress: a 4 MiB
/// download from the kubelet side, byte-exact, with our dialer and 1 MiB
/// echoed with Python's standard library; a loopback and a metadata
/// CONNECT answered 502 naming the rule, to a raw request and to Python.
#[test]
fn http_connect_traffic_passes_the_shipped_policy() {
    netns::run_in_hub(
        "recommended_policy::http_connect_traffic_passes_the_shipped_policy",
        |_node| async move {
            use tokio::io::AsyncReadExt;
            let server = TestServer::start_with(ServerOpts {
                mode: proxy_server::config::Mode::HttpConnect,
                ..Default::default()
            })
            .await;
            let _agent = manifest_agent(&server);
            server.wait_for_backends(1).await;
            let kubelet = destination::download_on_any(HUB_IP, BULK).await;
            let mut io = server.dialer().dial(&kubelet.address()).await.unwrap();
            let mut got = Vec::with_capacity(BULK);
            io.read_to_end(&mut got).await.unwrap();
            assert!(got == destination::pattern(BULK, 7), "bytes differ");
            drop(io);
            let socket = format!("--socket={}", server.uds.display());
            python_echoes_a_mib("connect-echo", &socket).await;
            let report = python::frontend([
                "connect-error".to_owned(),
                socket,
                "--address=169.254.169.254:80".to_owned(),
            ])
            .await;
            report.assert_ok();
            assert_eq!(report.int("status"), 502, "{report}");
            assert!(
                report
                    .str("body")
                    .ends_with("denied by the agent's policy (rule deny metadata)"),
                "{report}"
            );

            let loopback = destination::echo().await;
            for (target, rule) in [
                (loopback.address(), "deny loopback"),
                ("169.254.169.254:80".to_owned(), "deny metadata"),
            ] {
                let answer = refused_connect(&server, &target).await;
                assert!(answer.starts_with("HTTP/1.1 502 "), "{target}: {answer}");
                assert!(
                    answer.contains(&format!("denied by the agent's policy (rule {rule})")),
                    "{target}: {answer}"
                );
            }
            assert_eq!(
                loopback.accepted.load(std::sync::atomic::Ordering::SeqCst),
                0
            );
            server.wait_idle().await;
        },
    );
}
