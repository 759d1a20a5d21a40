//! Secrets never reach the logs: the real binaries at the most verbose
//! level (`-v=9`, every crate at trace), with a service-account token that
//! is accepted, one that is refused, the server's own kube credentials, and
//! a proxy password, log none of them — nor a private key.

#![allow(clippy::unwrap_used)] // tests: a panic is a failure report

use std::{process::Command, time::Duration};

use integration_tests::{
    LoggedProcess, Pki, backend, binary,
    kube_stub::{Identity, SERVER_TOKEN, TokenReviewStub},
};

const GOOD_TOKEN: &str = "g00d-agent-token-7f3a9c";
const BAD_TOKEN: &str = "b4d-agent-token-19e2d0";
const PROXY_PASSWORD: &str = "pr0xy-passw0rd-55ab";

fn pki(file: &str) -> String {
    Pki::get().path(file).display().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_token_key_or_password_is_ever_logged() {
    let stub = TokenReviewStub::start().await;
    stub.allow(
        GOOD_TOKEN,
        Identity {
            username: "system:serviceaccount:kube-system:konnectivity-agent".to_owned(),
            audiences: vec!["system:konnectivity-server".to_owned()],
        },
    );
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good-token");
    let bad = dir.path().join("bad-token");
    std::fs::write(&good, GOOD_TOKEN).unwrap();
    std::fs::write(&bad, BAD_TOKEN).unwrap();

    let mut server = Command::new(binary("proxy-server"));
    server.args([
        "-v=9".to_owned(),
        format!("--uds-name={}", dir.path().join("s.sock").display()),
        "--server-port=0".to_owned(),
        "--agent-bind-address=127.0.0.1".to_owned(),
        "--agent-port=0".to_owned(),
        "--health-port=0".to_owned(),
        "--admin-port=0".to_owned(),
        format!("--cluster-cert={}", pki("cluster.crt")),
        format!("--cluster-key={}", pki("cluster.key")),
        "--agent-namespace=kube-system".to_owned(),
        "--agent-service-account=konnectivity-agent".to_owned(),
        "--authentication-audience=system:konnectivity-server".to_owned(),
        format!("--kubeconfig={}", stub.kubeconfig.display()),
    ]);
    let mut server = LoggedProcess::spawn(server, "proxy-server");
    let port = server.logged_port("agent.addr=Some(127.0.0.1:").await;

    let agent = |token: Option<&std::path::Path>, proxy: Option<String>| {
        let mut command = Command::new(binary("proxy-agent"));
        command.args([
            "-v=9".to_owned(),
            format!("--ca-cert={}", pki("agent-ca.crt")),
            "--proxy-server-host=127.0.0.1".to_owned(),
            format!("--proxy-server-port={port}"),
            "--health-server-port=0".to_owned(),
            "--admin-server-port=0".to_owned(),
            "--sync-interval=100ms".to_owned(),
            "--sync-interval-cap=200ms".to_owned(),
        ]);
        if let Some(token) = token {
            command.arg(format!("--service-account-token-path={}", token.display()));
        }
        if let Some(proxy) = proxy {
            command.arg(format!("--proxy-url={proxy}"));
        }
        LoggedProcess::spawn(command, "proxy-agent")
    };
    let limit = Duration::from_secs(30);
    let mut accepted = agent(Some(&good), None);
    accepted
        .wait_for("connected to proxy-server", 1, limit)
        .await;
    let mut refused = agent(Some(&bad), None);
    refused
        .wait_for("cannot connect to proxy-server", 2, limit)
        .await;
    server.wait_for("agent refused", 1, limit).await;
    // A proxy that refuses the connection: the error names the proxy.
    let closed = backend::closed_port();
    let mut proxied = agent(
        Some(&good),
        Some(format!("http://konnectivity:{PROXY_PASSWORD}@{closed}")),
    );
    proxied
        .wait_for("cannot connect to proxy-server", 2, limit)
        .await;
    assert!(
        proxied.find(&closed.to_string()).is_some(),
        "the proxy error should name the proxy: {:#?}",
        proxied.lines()
    );

    let secrets = [
        GOOD_TOKEN,
        BAD_TOKEN,
        PROXY_PASSWORD,
        SERVER_TOKEN,
        "PRIVATE KEY",
    ];
    for (name, process) in [
        ("proxy-server", &server),
        ("accepted agent", &accepted),
        ("refused agent", &refused),
        ("proxied agent", &proxied),
    ] {
        let lines = process.lines();
        assert!(
            lines.len() >= 3,
            "{name} logged too little to prove anything: {lines:#?}"
        );
        for line in &lines {
            for secret in secrets {
                assert!(!line.contains(secret), "{name} logged {secret:?}: {line}");
            }
        }
    }
}
