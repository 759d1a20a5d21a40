//! proxy-client: `request`, and the local SOCKS5 and HTTP proxies driven by
//! curl, in both frontend modes.

#![allow(clippy::unwrap_used)] // tests: a panic is a failure report

use std::process::Command;

use integration_tests::{Pki, ServerOpts, TestAgent, TestServer, binary, destination};
use proxy_client as tool;
use proxy_server::config::Mode;
use tokio::net::TcpListener;

const BODY: &[u8] = b"hello from the node side, through proxy-client\n";

async fn output(mut command: Command) -> std::process::Output {
    tokio::task::spawn_blocking(move || {
        command
            .output()
            .expect("running curl (apt-get install curl)")
    })
    .await
    .unwrap()
}

async fn server(mode: Mode) -> (TestServer, TestAgent) {
    let server = TestServer::start_with(ServerOpts {
        mode,
        ..Default::default()
    })
    .await;
    let agent = TestAgent::start(&server).await;
    (server, agent)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_prints_status_and_body_in_both_modes() {
    for (mode, flag) in [(Mode::Grpc, "grpc"), (Mode::HttpConnect, "http-connect")] {
        let (server, _agent) = server(mode).await;
        let web = destination::http(BODY).await;
        let mut command = Command::new(binary("proxy-client"));
        command.args([
            format!("--mode={flag}"),
            format!("--uds-name={}", server.uds.display()),
            "request".to_owned(),
            format!("http://{}/healthz", web.address()),
        ]);
        let run = output(command).await;
        assert!(
            run.status.success(),
            "{}",
            String::from_utf8_lossy(&run.stderr)
        );
        let stdout = String::from_utf8(run.stdout).unwrap();
        assert!(stdout.starts_with("HTTP/1.1 200 OK\n"), "{stdout}");
        assert!(
            stdout.ends_with(std::str::from_utf8(BODY).unwrap()),
            "{stdout}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_reports_a_refused_dial() {
    let (server, _agent) = server(Mode::Grpc).await;
    let closed = destination::closed_port();
    let mut command = Command::new(binary("proxy-client"));
    command.args([
        format!("--uds-name={}", server.uds.display()),
        "request".to_owned(),
        format!("http://{closed}/"),
    ]);
    let run = output(command).await;
    assert_eq!(run.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(stderr.contains("connection refused"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_through_the_tcp_frontend_with_mtls() {
    let server = TestServer::start_with(ServerOpts {
        tcp_frontend: true,
        ..Default::default()
    })
    .await;
    let _agent = TestAgent::start(&server).await;
    let web = destination::http(BODY).await;
    let pki = Pki::get();
    let mut command = Command::new(binary("proxy-client"));
    command.args([
        "--server-host=127.0.0.1".to_owned(),
        format!("--server-port={}", server.frontend_tcp.unwrap().port()),
        "--server-name=localhost".to_owned(),
        format!("--ca-cert={}", pki.path("frontend-ca.crt").display()),
        format!("--client-cert={}", pki.path("proxy-client.crt").display()),
        format!("--client-key={}", pki.path("proxy-client.key").display()),
        "request".to_owned(),
        format!("http://{}/", web.address()),
    ]);
    let run = output(command).await;
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    assert!(run.stdout.ends_with(BODY));
}

/// Runs `n` curls at once and checks each got exactly `BODY`.
async fn curls(n: usize, args: impl Fn() -> Vec<String>) {
    let mut runs = Vec::new();
    for _ in 0..n {
        let mut command = Command::new("curl");
        command
            .args(["--silent", "--show-error", "--max-time", "30"])
            .args(args());
        runs.push(tokio::spawn(output(command)));
    }
    for run in runs {
        let run = run.await.unwrap();
        assert!(
            run.status.success(),
            "curl: {}",
            String::from_utf8_lossy(&run.stderr)
        );
        assert_eq!(run.stdout, BODY);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curl_through_the_socks5_proxy_in_both_modes() {
    for mode in [Mode::Grpc, Mode::HttpConnect] {
        let (server, agent) = server(mode).await;
        let web = destination::http(BODY).await;
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let socks = listener.local_addr().unwrap();
        let proxy = tokio::spawn(tool::serve_socks5(listener, server.dialer(), None));
        // "localhost" is resolved on the agent side (socks5h).
        let url = format!("http://localhost:{}/", web.addr.port());
        curls(50, || {
            vec![
                "--socks5-hostname".to_owned(),
                socks.to_string(),
                url.clone(),
            ]
        })
        .await;
        assert_eq!(web.accepted.load(std::sync::atomic::Ordering::SeqCst), 50);
        proxy.abort();
        server.wait_idle().await;
        integration_tests::wait_for("agent connections closed", || {
            agent.handle.endpoint_connections() == 0
        })
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_socks5_proxy_checks_username_and_password() {
    let (server, _agent) = server(Mode::Grpc).await;
    let web = destination::http(BODY).await;
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let socks = listener.local_addr().unwrap();
    let _proxy = tokio::spawn(tool::serve_socks5(
        listener,
        server.dialer(),
        Some(("ops".to_owned(), "s3cret".to_owned())),
    ));
    let url = format!("http://{}/", web.address());
    curls(1, || {
        vec![
            "-x".to_owned(),
            format!("socks5h://ops:s3cret@{socks}"),
            url.clone(),
        ]
    })
    .await;

    let mut command = Command::new("curl");
    command
        .args(["--silent", "--max-time", "30", "-x"])
        .arg(format!("socks5h://ops:wrong@{socks}"))
        .arg(&url);
    let run = output(command).await;
    assert!(!run.status.success(), "a wrong password was accepted");
    assert!(run.stdout.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curl_through_the_http_proxy_in_both_modes() {
    for mode in [Mode::Grpc, Mode::HttpConnect] {
        let (server, _agent) = server(mode).await;
        let web = destination::http(BODY).await;
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let proxy_addr = listener.local_addr().unwrap();
        let proxy = tokio::spawn(tool::serve_http_proxy(listener, server.dialer()));
        let url = format!("http://{}/", web.address());
        let proxy_url = format!("http://{proxy_addr}");
        // Absolute-form requests, then CONNECT tunnels.
        curls(50, || vec!["-x".to_owned(), proxy_url.clone(), url.clone()]).await;
        curls(50, || {
            vec![
                "--proxytunnel".to_owned(),
                "-x".to_owned(),
                proxy_url.clone(),
                url.clone(),
            ]
        })
        .await;
        proxy.abort();
        server.wait_idle().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_http_proxy_answers_502_for_a_refused_dial() {
    let (server, _agent) = server(Mode::Grpc).await;
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let proxy_addr = listener.local_addr().unwrap();
    let _proxy = tokio::spawn(tool::serve_http_proxy(listener, server.dialer()));
    let closed = destination::closed_port();
    let mut command = Command::new("curl");
    command
        .args([
            "--silent",
            "--max-time",
            "30",
            "--output",
            "/dev/null",
            "--write-out",
            "%{http_code}",
            "-x",
        ])
        .arg(format!("http://{proxy_addr}"))
        .arg(format!("http://{closed}/"));
    let run = output(command).await;
    assert_eq!(String::from_utf8_lossy(&run.stdout), "502");
}
