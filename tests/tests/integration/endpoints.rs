//! Every HTTP endpoint of both binaries, as ANP's Go servers answer it,
//! before and after an agent connects: the server's health port (`/healthz`,
//! `/readyz`, `/ready`, `/metrics`) and admin port (`/metrics`), the agent's
//! health port (`/healthz`, `/readyz` with ANP's check-by-check body,
//! `?verbose`, `/metrics`) and admin port (`/metrics` 301 as `http.Redirect`
//! writes it, profiles with `--enable-profiling` only); any method on a
//! route, Go's `404 page not found` elsewhere, 1 MiB of request headers.

#![allow(clippy::unwrap_used)] // tests: a panic is a failure report

use std::{net::SocketAddr, time::Duration};

use integration_tests::{
    AgentOpts, ServerOpts, TestAgent, TestServer, destination, http_request, wait_for_status,
};
use tokio::io::AsyncWriteExt;

const PROMETHEUS: &str = "text/plain; version=0.0.4; charset=utf-8";
const NOT_READY_AGENT: &str = "[+]ping ok\n[-]server-connected failed: no servers connected\n";
const NOT_READY_SERVER: &str = "no connection to any proxy agent";
const METHODS: [&str; 4] = ["GET", "POST", "PUT", "DELETE"];

/// `method path` on `addr` answers `status` with exactly `body`.
async fn expect(addr: SocketAddr, method: &str, path: &str, status: u16, body: &str) {
    let answer = http_request(addr, method, path, "localhost", "").await;
    assert_eq!(
        (answer.status, answer.text().as_str()),
        (status, body),
        "{method} {path} on {addr}"
    );
}

/// Go's `http.NotFound` on `addr` for `path`, whatever the method.
async fn expect_go_404(addr: SocketAddr, path: &str) {
    for method in METHODS {
        let answer = http_request(addr, method, path, "localhost", "").await;
        assert_eq!(answer.status, 404, "{method} {path} on {addr}");
        assert_eq!(answer.text(), "404 page not found\n");
        assert_eq!(answer.headers["content-type"], "text/plain; charset=utf-8");
        assert_eq!(answer.headers["x-content-type-options"], "nosniff");
    }
}

/// `/metrics` on `addr` is Prometheus text holding `family`, for any method.
async fn expect_metrics(addr: SocketAddr, family: &str) {
    for method in METHODS {
        let answer = http_request(addr, method, "/metrics", "localhost", "").await;
        assert_eq!(answer.status, 200, "{method} /metrics on {addr}");
        assert_eq!(answer.headers["content-type"], PROMETHEUS);
        let text = answer.text();
        assert!(
            text.contains(&format!("# TYPE {family} ")),
            "{family} missing on {addr}"
        );
    }
}

/// The agent admin port's `/metrics` redirect for `target` with `Host: host`.
async fn expect_redirect(admin: SocketAddr, method: &str, target: &str, host: &str, to: &str) {
    let answer = http_request(admin, method, target, host, "").await;
    assert_eq!(answer.status, 301, "{method} {target}");
    assert_eq!(answer.headers["location"], to, "{method} {target}");
    let (content_type, body) = match method {
        "GET" => (
            Some("text/html; charset=utf-8"),
            format!(
                "<a href=\"{}\">Moved Permanently</a>.\n\n",
                to.replace('&', "&amp;")
            ),
        ),
        "HEAD" => (Some("text/html; charset=utf-8"), String::new()),
        _ => (None, String::new()),
    };
    assert_eq!(
        answer.headers.get("content-type").map(String::as_str),
        content_type,
        "{method} {target}"
    );
    assert_eq!(answer.text(), body, "{method} {target}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_endpoint_answers_as_anps_before_and_after_an_agent_connects() {
    let server = TestServer::start().await;
    // An agent with no server to reach: what an agent looks like before it connects.
    let lonely = TestAgent::start_with(destination::closed_port(), AgentOpts::default()).await;

    // Before.
    for method in METHODS {
        expect(server.health_addr, method, "/healthz", 200, "ok").await;
        expect(server.health_addr, method, "/readyz", 500, NOT_READY_SERVER).await;
        expect(server.health_addr, method, "/ready", 500, NOT_READY_SERVER).await;
        expect(lonely.health_addr, method, "/healthz", 200, "ok").await;
        for path in ["/readyz", "/ready", "/readyz?verbose", "/ready?verbose=1"] {
            expect(lonely.health_addr, method, path, 503, NOT_READY_AGENT).await;
        }
    }
    let head = http_request(server.health_addr, "HEAD", "/healthz", "localhost", "").await;
    assert_eq!((head.status, head.body.len()), (200, 0));
    expect_metrics(
        server.health_addr,
        "konnectivity_network_proxy_server_ready_backend_connections",
    )
    .await;
    expect_metrics(
        server.admin_addr,
        "konnectivity_network_proxy_server_ready_backend_connections",
    )
    .await;
    // Before any server connection ANP shows the known server count only.
    expect_metrics(
        lonely.health_addr,
        "konnectivity_network_proxy_agent_known_server_count",
    )
    .await;
    for addr in [
        server.health_addr,
        server.admin_addr,
        lonely.health_addr,
        lonely.admin_addr,
    ] {
        expect_go_404(addr, "/nope").await;
        expect_go_404(addr, "/healthz/").await;
    }
    // The admin ports serve neither health checks nor, by default, profiles.
    for admin in [server.admin_addr, lonely.admin_addr] {
        expect_go_404(admin, "/healthz").await;
        expect_go_404(admin, "/debug/pprof/profile?seconds=1").await;
        expect_go_404(admin, "/debug/pprof").await;
    }
    // The agent's admin /metrics: 301 to the same URL on the health port,
    // scheme-less and with the query, as Go's `http.Redirect` writes it.
    let port = lonely.health_addr.port();
    for method in ["GET", "HEAD", "POST"] {
        expect_redirect(
            lonely.admin_addr,
            method,
            "/metrics?x=1&b",
            "localhost:8094",
            &format!("//localhost:{port}/metrics?x=1&b"),
        )
        .await;
    }
    expect_redirect(
        lonely.admin_addr,
        "GET",
        "/metrics",
        "[::1]:8094",
        &format!("//[::1]:{port}/metrics"),
    )
    .await;
    expect_redirect(
        lonely.admin_addr,
        "GET",
        "/metrics",
        "node-1",
        &format!("//node-1:{port}/metrics"),
    )
    .await;

    // After.
    let agent = TestAgent::start(&server).await;
    // The server counts the agent before the agent has read the server's answer.
    assert_eq!(
        wait_for_status(agent.health_addr, "/readyz", 200).await,
        "ok"
    );
    for method in METHODS {
        expect(server.health_addr, method, "/readyz", 200, "ok").await;
        expect(server.health_addr, method, "/ready", 200, "ok").await;
        expect(server.health_addr, method, "/healthz", 200, "ok").await;
        expect(agent.health_addr, method, "/readyz", 200, "ok").await;
        expect(agent.health_addr, method, "/ready", 200, "ok").await;
        expect(agent.health_addr, method, "/healthz", 200, "ok").await;
        for path in ["/readyz?verbose", "/ready?verbose=1", "/readyz?a=b&verbose"] {
            expect(
                agent.health_addr,
                method,
                path,
                200,
                "[+]ping ok\n[+]server-connected ok\ncheck passed\n",
            )
            .await;
        }
    }
    expect_metrics(
        agent.health_addr,
        "konnectivity_network_proxy_agent_open_server_connections",
    )
    .await;
    let after = http_request(server.admin_addr, "GET", "/metrics", "localhost", "").await;
    assert!(
        after
            .text()
            .contains("\nkonnectivity_network_proxy_server_ready_backend_connections 1\n"),
        "{}",
        after.text()
    );
    // Readiness follows the connection, both ways.
    lonely.stop().await;
    server.halt().await;
    assert_eq!(
        wait_for_status(agent.health_addr, "/readyz", 503).await,
        NOT_READY_AGENT
    );
}

/// A process has one CPU profiler: the two tests that take a profile from
/// a server or agent running in this process take turns (cargo test runs
/// them in one process; nextest in one each).
static PROFILER: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enable_profiling_serves_cpu_profiles_on_the_server_admin_port() {
    let _profiler = PROFILER.lock().await;
    let server = TestServer::start_with(ServerOpts {
        profiling: true,
        ..ServerOpts::default()
    })
    .await;
    let get =
        |target: &'static str| http_request(server.admin_addr, "GET", target, "localhost", "");
    let index = get("/debug/pprof/").await;
    assert_eq!(index.status, 200);
    assert!(index.text().contains("profile"), "{}", index.text());
    let profile = get("/debug/pprof/profile?seconds=1").await;
    assert_eq!(profile.status, 200);
    assert_eq!(profile.headers["content-type"], "application/octet-stream");
    assert_eq!(get("/debug/pprof/profile?seconds=x").await.status, 400);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enable_profiling_serves_cpu_profiles_on_the_agent_admin_port() {
    let _profiler = PROFILER.lock().await;
    let agent = TestAgent::start_with(
        destination::closed_port(),
        AgentOpts {
            profiling: true,
            ..AgentOpts::default()
        },
    )
    .await;
    let answer = http_request(
        agent.admin_addr,
        "GET",
        "/debug/pprof/profile?seconds=1",
        "localhost",
        "",
    )
    .await;
    assert_eq!(answer.status, 200, "{}", answer.text());
    assert_eq!(answer.headers["content-type"], "application/octet-stream");
    assert_eq!(&answer.body[..2], &[0x1f, 0x8b], "a gzipped profile");
    let index = http_request(agent.admin_addr, "POST", "/debug/pprof/", "localhost", "").await;
    assert_eq!(index.status, 200);
    assert!(index.text().contains("profile"), "{}", index.text());
    let bare = http_request(agent.admin_addr, "GET", "/debug/pprof", "localhost", "").await;
    assert_eq!(bare.status, 301);
    assert_eq!(bare.headers["location"], "/debug/pprof/");
    assert_eq!(
        bare.text(),
        "<a href=\"/debug/pprof/\">Moved Permanently</a>.\n\n"
    );
    // Profiling does not hide the redirect, nor add a health port route.
    assert_eq!(
        http_request(agent.admin_addr, "GET", "/metrics", "localhost:1", "")
            .await
            .status,
        301
    );
    expect_go_404(agent.health_addr, "/debug/pprof/").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_and_admin_ports_read_a_mebibyte_of_headers() {
    let server = TestServer::start().await;
    let agent = TestAgent::start_with(destination::closed_port(), AgentOpts::default()).await;
    // Past hyper's default limit (~400 KiB), within Go's `MaxHeaderBytes`.
    let big = format!("X-Big: {}\r\n", "x".repeat(900 * 1024));
    let huge = format!("X-Big: {}\r\n", "x".repeat(1024 * 1024 + 8192));
    for (addr, path, status) in [
        (server.health_addr, "/healthz", 200),
        (server.admin_addr, "/metrics", 200),
        (agent.health_addr, "/healthz", 200),
        (agent.admin_addr, "/metrics", 301),
    ] {
        let answer = http_request(addr, "GET", path, "localhost", &big).await;
        assert_eq!(answer.status, status, "{path} on {addr}");
        let answer = http_request_lenient(addr, path, &huge).await;
        assert!(
            answer.starts_with("HTTP/1.1 431 "),
            "{path} on {addr}: {answer:.100}"
        );
    }
}

/// A request whose sending may fail once the server has answered and closed.
async fn http_request_lenient(addr: SocketAddr, path: &str, extra: &str) -> String {
    use tokio::io::AsyncReadExt;
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = format!("GET {path} HTTP/1.1\r\nHost: localhost\r\n{extra}\r\n");
    let _ = stream.write_all(request.as_bytes()).await;
    let mut raw = Vec::new();
    let _ = stream.read_to_end(&mut raw).await;
    String::from_utf8_lossy(&raw).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http_client_cannot_hold_up_the_agents_shutdown() {
    let agent = TestAgent::start_with(destination::closed_port(), AgentOpts::default()).await;
    // Half a request: the connection is busy until the 60 s header timeout.
    let mut slow = tokio::net::TcpStream::connect(agent.health_addr)
        .await
        .unwrap();
    slow.write_all(b"GET /healthz HTTP/1.1\r\nHost: a\r\n")
        .await
        .unwrap();
    // The agent is serving it: a complete request on another connection is answered.
    assert_eq!(
        wait_for_status(agent.health_addr, "/healthz", 200).await,
        "ok"
    );
    let started = std::time::Instant::now();
    agent.stop().await;
    assert!(
        started.elapsed() < proxy_agent::agent::STOP_GRACE + Duration::from_secs(3),
        "stopping took {:?}",
        started.elapsed()
    );
    drop(slow);
}
