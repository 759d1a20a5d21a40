//! Secrets never reach the logs. The real binaries run at the most verbose
//! level (`-v=9` or `RUST_LOG=trace`: every crate at trace), in text and
//! JSON, to standard error and to `--log-file`, while: agents authenticate
//! with service-account tokens (accepted, refused, and two that a broken
//! kube API echoes back in a body kube cannot parse or in an error text);
//! agents reach the server through a real HTTP CONNECT proxy with Basic auth
//! (right and wrong password) and a real SOCKS5 proxy with a password; the
//! server reads its own kube credentials and private key, the agent its
//! key; and tunnelled bytes carry a bearer token. None of the tokens,
//! passwords, the Basic credentials' base64, the key bodies or the
//! tunnelled bytes may appear in any output.

#![allow(clippy::unwrap_used)] // tests: a panic is a failure report

use std::{
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use base64::Engine;
use clap::Parser;
use integration_tests::{
    LoggedProcess, Pki, binary, destination,
    kube_stub::{Echo, Identity, SERVER_TOKEN, TokenReviewStub, service_account_token},
    proxies::{microsocks, tinyproxy},
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The agent tokens: JWTs with these `jti`s (what local checks pass).
const GOOD_TOKEN: &str = "g00d-agent-token-7f3a9c";
const BAD_TOKEN: &str = "b4d-agent-token-19e2d0";
const GARBLED_TOKEN: &str = "garbl3d-agent-token-c81e";
const ECHOED_TOKEN: &str = "ech0ed-agent-token-4d2b";
const AUDIENCE: &str = "system:konnectivity-server";
const PROXY_USER: &str = "konnectivity";
const PROXY_PASSWORD: &str = "pr0xy-passw0rd-55ab";
const WRONG_PASSWORD: &str = "wr0ng-passw0rd-93cd";
const SOCKS_USER: &str = "socksuser";
const SOCKS_PASSWORD: &str = "s0cks-passw0rd-07ef";
const TUNNELLED_TOKEN: &str = "tunn3lled-bearer-token-b7a1";

const LIMIT: Duration = Duration::from_secs(30);

fn pki(file: &str) -> String {
    Pki::get().path(file).display().to_string()
}

fn basic(user: &str, password: &str) -> String {
    base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"))
}

/// The base64 lines of a PEM file (its body, not the armour).
fn pem_body(file: &str) -> Vec<String> {
    let lines: Vec<String> = std::fs::read_to_string(Pki::get().path(file))
        .unwrap()
        .lines()
        .filter(|l| !l.starts_with("-----") && l.len() >= 16)
        .map(str::to_owned)
        .collect();
    assert!(!lines.is_empty(), "{file} has no body");
    lines
}

/// Waits until `file` holds `needle` `n` times.
async fn wait_in_file(file: &Path, needle: &str, n: usize) {
    let start = Instant::now();
    loop {
        let text = std::fs::read_to_string(file).unwrap_or_default();
        if text.matches(needle).count() >= n {
            return;
        }
        assert!(
            start.elapsed() < LIMIT,
            "{needle:?} not in {} {n} times: {text}",
            file.display()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A real agent against `port` with `extra` flags (and `RUST_LOG` if given).
fn agent(port: u16, extra: &[String], rust_log: Option<&str>) -> LoggedProcess {
    let mut command = Command::new(binary("proxy-agent"));
    command.args([
        format!("--ca-cert={}", pki("agent-ca.crt")),
        "--proxy-server-host=127.0.0.1".to_owned(),
        format!("--proxy-server-port={port}"),
        "--health-server-port=0".to_owned(),
        "--admin-server-port=0".to_owned(),
        "--sync-interval=100ms".to_owned(),
        "--sync-interval-cap=200ms".to_owned(),
    ]);
    command.args(extra);
    if let Some(filter) = rust_log {
        command.env("RUST_LOG", filter);
    }
    LoggedProcess::spawn(command, "proxy-agent")
}

fn token_file(dir: &Path, name: &str, token: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, token).unwrap();
    format!("--service-account-token-path={}", path.display())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_token_password_key_or_payload_is_ever_logged() {
    let jwt = |id| service_account_token(AUDIENCE, id);
    let stub = TokenReviewStub::start().await;
    stub.allow(
        &jwt(GOOD_TOKEN),
        Identity {
            username: "system:serviceaccount:kube-system:konnectivity-agent".to_owned(),
            audiences: vec!["system:konnectivity-server".to_owned()],
            node: None,
        },
    );
    stub.echo(&jwt(GARBLED_TOKEN), Echo::Garbled);
    stub.echo(&jwt(ECHOED_TOKEN), Echo::PlainError);
    let dir = tempfile::tempdir().unwrap();
    let good = token_file(dir.path(), "good", &jwt(GOOD_TOKEN));
    let socket = dir.path().join("s.sock");

    // The server: JSON, to a file and (all of it) to standard error.
    let server_log = dir.path().join("server.log");
    let mut server = Command::new(binary("proxy-server"));
    server.args([
        "-v=9".to_owned(),
        "--log-format=json".to_owned(),
        "--logtostderr=false".to_owned(),
        format!("--log-file={}", server_log.display()),
        "--alsologtostderr".to_owned(),
        format!("--uds-name={}", socket.display()),
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
    let port = server.logged_port("\"agent.addr\":\"Some(127.0.0.1:").await;
    let http_proxy = tinyproxy(Some((PROXY_USER, PROXY_PASSWORD)), port).await;
    let socks_proxy = microsocks(Some((SOCKS_USER, SOCKS_PASSWORD))).await;

    // Accepted through the HTTP proxy (Proxy-Authorization), text, with its key.
    let mut via_http = agent(
        port,
        &[
            "-v=9".to_owned(),
            good.clone(),
            format!("--agent-cert={}", pki("proxy-agent.crt")),
            format!("--agent-key={}", pki("proxy-agent.key")),
            format!(
                "--proxy-url=http://{PROXY_USER}:{PROXY_PASSWORD}@{}",
                http_proxy.addr
            ),
        ],
        None,
    );
    // Accepted through the SOCKS5 proxy (password), JSON, RUST_LOG=trace.
    let mut via_socks = agent(
        port,
        &[
            "--log-format=json".to_owned(),
            good.clone(),
            format!(
                "--proxy-url=socks5://{SOCKS_USER}:{SOCKS_PASSWORD}@{}",
                socks_proxy.addr
            ),
        ],
        Some("trace"),
    );
    // Refused token, logging to a file only.
    let refused_log = dir.path().join("refused.log");
    let refused = agent(
        port,
        &[
            "-v=9".to_owned(),
            token_file(dir.path(), "bad", &jwt(BAD_TOKEN)),
            "--logtostderr=false".to_owned(),
            format!("--log-file={}", refused_log.display()),
        ],
        None,
    );
    // Tokens the kube API echoes back.
    let mut garbled = agent(
        port,
        &[
            "-v=9".to_owned(),
            token_file(dir.path(), "garbled", &jwt(GARBLED_TOKEN)),
        ],
        None,
    );
    let echoed_log = dir.path().join("echoed.log");
    let mut echoed = agent(
        port,
        &[
            "--log-format=json".to_owned(),
            token_file(dir.path(), "echoed", &jwt(ECHOED_TOKEN)),
            "--logtostderr=false".to_owned(),
            format!("--log-file={}", echoed_log.display()),
            "--alsologtostderr".to_owned(),
        ],
        Some("trace"),
    );
    // A wrong proxy password, and a proxy that is not there.
    let mut wrong_password = agent(
        port,
        &[
            "-v=9".to_owned(),
            good.clone(),
            format!(
                "--proxy-url=http://{PROXY_USER}:{WRONG_PASSWORD}@{}",
                http_proxy.addr
            ),
        ],
        None,
    );
    let closed = destination::closed_port();
    let mut no_proxy = agent(
        port,
        &[
            "-v=9".to_owned(),
            good.clone(),
            format!("--proxy-url=http://{PROXY_USER}:{PROXY_PASSWORD}@{closed}"),
        ],
        None,
    );

    via_http
        .wait_for("connected to proxy-server", 1, LIMIT)
        .await;
    via_socks
        .wait_for("connected to proxy-server", 1, LIMIT)
        .await;
    wait_in_file(&refused_log, "cannot connect to proxy-server", 2).await;
    garbled
        .wait_for("cannot connect to proxy-server", 2, LIMIT)
        .await;
    echoed
        .wait_for("cannot connect to proxy-server", 2, LIMIT)
        .await;
    wrong_password
        .wait_for("cannot connect to proxy-server", 2, LIMIT)
        .await;
    no_proxy
        .wait_for("cannot connect to proxy-server", 2, LIMIT)
        .await;
    server.wait_for("agent refused", 6, LIMIT).await;
    // The refusals say why without the body.
    assert!(
        server.find("unreadable TokenReview answer").is_some(),
        "{:#?}",
        server.lines()
    );
    assert!(
        server.find("the API answered 400 Bad Request").is_some(),
        "{:#?}",
        server.lines()
    );
    assert!(
        no_proxy.find(&closed.to_string()).is_some(),
        "the proxy error should name the proxy: {:#?}",
        no_proxy.lines()
    );

    // A bearer token crossing the tunnel, both ways, at trace.
    let echo = destination::echo().await;
    let channel = client::dial::uds_channel(&socket).await.unwrap();
    let mut conn = client::dial::dial(channel, &echo.address()).await.unwrap();
    let request = format!("GET / HTTP/1.1\r\nAuthorization: Bearer {TUNNELLED_TOKEN}\r\n\r\n");
    conn.write_all(request.as_bytes()).await.unwrap();
    let mut back = vec![0u8; request.len()];
    conn.read_exact(&mut back).await.unwrap();
    assert_eq!(back, request.as_bytes());
    conn.finish().await.unwrap();
    // The server has logged the connection's end, so its packets are logged too.
    server.wait_for("connection closed", 1, LIMIT).await;

    let mut secrets: Vec<String> = [
        GOOD_TOKEN,
        BAD_TOKEN,
        GARBLED_TOKEN,
        ECHOED_TOKEN,
        &jwt(GOOD_TOKEN),
        &jwt(BAD_TOKEN),
        &jwt(GARBLED_TOKEN),
        &jwt(ECHOED_TOKEN),
        PROXY_PASSWORD,
        WRONG_PASSWORD,
        SOCKS_PASSWORD,
        SERVER_TOKEN,
        TUNNELLED_TOKEN,
        "PRIVATE KEY",
    ]
    .map(str::to_owned)
    .into();
    secrets.push(basic(PROXY_USER, PROXY_PASSWORD));
    secrets.push(basic(PROXY_USER, WRONG_PASSWORD));
    secrets.extend(pem_body("cluster.key"));
    secrets.extend(pem_body("proxy-agent.key"));

    // Complete lines only: the writer may be half-way through the last one.
    let file_lines = |path: &PathBuf| -> Vec<String> {
        let text = std::fs::read_to_string(path).unwrap();
        let complete = text.rfind('\n').map_or("", |end| &text[..end]);
        complete.lines().map(str::to_owned).collect()
    };
    // (name, lines, JSON, connected: its gRPC and TLS stack logged at trace)
    let outputs: Vec<(&str, Vec<String>, bool, bool)> = vec![
        ("proxy-server stderr (json)", server.lines(), true, true),
        (
            "proxy-server --log-file (json)",
            file_lines(&server_log),
            true,
            true,
        ),
        ("agent via http proxy", via_http.lines(), false, true),
        ("agent via socks5 (json)", via_socks.lines(), true, true),
        (
            "refused agent --log-file",
            file_lines(&refused_log),
            false,
            false,
        ),
        ("garbled agent", garbled.lines(), false, false),
        ("echoed agent stderr (json)", echoed.lines(), true, false),
        (
            "echoed agent --log-file (json)",
            file_lines(&echoed_log),
            true,
            false,
        ),
        ("wrong-password agent", wrong_password.lines(), false, false),
        ("unreachable-proxy agent", no_proxy.lines(), false, false),
    ];
    for (name, lines, json, connected) in outputs {
        assert!(
            lines.len() >= 3,
            "{name} logged too little to prove anything: {lines:#?}"
        );
        if connected {
            let traced = lines
                .iter()
                .any(|l| l.contains(" TRACE ") || l.contains("\"level\":\"TRACE\""));
            assert!(traced, "{name} did not log at trace: {lines:#?}");
        }
        for line in &lines {
            if json {
                serde_json::from_str::<serde_json::Value>(line)
                    .unwrap_or_else(|e| panic!("{name}: not JSON ({e}): {line}"));
            }
            for secret in &secrets {
                assert!(
                    !line.contains(secret.as_str()),
                    "{name} logged {secret:?}: {line}"
                );
            }
        }
    }
    // The refused agent logged only to its file: nothing at ERROR went to stderr.
    assert!(refused.lines().is_empty(), "{:#?}", refused.lines());
}

#[test]
fn the_agents_flags_debug_masks_the_proxy_password() {
    let args = proxy_agent::config::Args::try_parse_from([
        "proxy-agent".to_owned(),
        format!("--ca-cert={}", pki("agent-ca.crt")),
        format!("--proxy-url=http://{PROXY_USER}:{PROXY_PASSWORD}@127.0.0.1:3128"),
    ])
    .unwrap();
    let shown = format!("{args:?}");
    assert!(
        shown.contains(&format!("http://{PROXY_USER}:***@127.0.0.1:3128")),
        "{shown}"
    );
    assert!(!shown.contains(PROXY_PASSWORD), "{shown}");
    let config = proxy_agent::config::Config::try_from(args).unwrap();
    let shown = format!("{config:?}");
    assert!(!shown.contains(PROXY_PASSWORD), "{shown}");
}
