//! Metrics as operators' tools see them: after a scripted scenario (a dial
//! with no agent, a good dial, a dial to a closed port, a frontend that
//! cancels a pending dial) the scraped exposition of the server and of the
//! agent holds exactly ANP's series for those metrics, with ANP's names,
//! types, HELP texts, labels and values; a fresh process shows only what
//! ANP shows before any event. The endpoints themselves are tested in
//! `endpoints.rs`.

#![allow(clippy::unwrap_used)] // tests: a panic is a failure report

use integration_tests::{
    AgentOpts, RawFrontend, ServerOpts, TestAgent, TestServer, destination, http_request, wait_for,
};
use proto::Packet;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The exposition `addr` serves on `/metrics`.
async fn scrape(addr: std::net::SocketAddr) -> String {
    let answer = http_request(addr, "GET", "/metrics", "localhost", "").await;
    assert_eq!(answer.status, 200, "/metrics on {addr}");
    answer.text()
}

/// The families whose names start with `prefix`, as rendered, with the
/// timing-dependent values (histogram buckets and sums) replaced by `<v>`
/// once their shape is checked: buckets cumulative, `+Inf` equal to the
/// count. Families in `volatile` (gauges of momentary waits) are left out
/// when all their samples are 0.
fn anp_block(text: &str, prefix: &str, volatile: &[&str]) -> String {
    let mut out = String::new();
    let mut last_bucket: Option<(String, u64)> = None;
    for line in text.lines() {
        let name = line
            .strip_prefix("# HELP ")
            .or_else(|| line.strip_prefix("# TYPE "))
            .unwrap_or(line);
        if !name.starts_with(prefix) {
            continue;
        }
        if volatile.iter().any(|v| name.starts_with(v)) {
            continue;
        }
        let (series, value) = line.rsplit_once(' ').unwrap();
        if !line.starts_with('#') && series.contains("_bucket{") {
            let count: u64 = value.parse().unwrap();
            let base = series.split("_bucket{").next().unwrap().to_owned();
            if let Some((prev_base, prev)) = &last_bucket
                && *prev_base == base
            {
                assert!(count >= *prev, "{series}: buckets not cumulative");
            }
            if series.ends_with("le=\"+Inf\"}") {
                let want = format!("\n{base}_count {value}\n");
                assert!(
                    text.contains(&want),
                    "{base}: +Inf bucket differs from the count"
                );
            }
            last_bucket = Some((base, count));
            out.push_str(&format!("{series} <v>\n"));
        } else if !line.starts_with('#') && series.ends_with("_sum") {
            out.push_str(&format!("{series} <v>\n"));
        } else {
            out.push_str(line);
            out.push('\n');
        }
    }
    for family in volatile {
        let zero = text
            .lines()
            .filter(|l| l.starts_with(family))
            .all(|l| l.ends_with(" 0"));
        assert!(zero, "{family} is not 0 at rest:\n{text}");
    }
    out
}

/// A histogram family as Go renders it, timing values as `<v>`.
fn histogram(name: &str, help: &str, buckets: &[&str], count: u64) -> String {
    let mut out = format!("# HELP {name} {help}\n# TYPE {name} histogram\n");
    for le in buckets.iter().chain(&["+Inf"]) {
        out.push_str(&format!("{name}_bucket{{le=\"{le}\"}} <v>\n"));
    }
    out.push_str(&format!("{name}_sum <v>\n{name}_count {count}\n"));
    out
}

const SERVER_BUCKETS: &[&str] = &[
    "1e-06", "1e-05", "0.0001", "0.005", "0.025", "0.1", "0.5", "2.5", "12.5",
];
const CONNECTION_BUCKETS: &[&str] = &[
    "1", "5", "15", "30", "60", "300", "900", "1800", "3600", "14400", "43200", "86400",
];
const AGENT_BUCKETS: &[&str] = &["0.005", "0.025", "0.1", "0.5", "2.5", "10", "30"];

const S: &str = "konnectivity_network_proxy_server_";
const A: &str = "konnectivity_network_proxy_agent_";

/// What a fresh server shows of ANP's families: only the metrics ANP
/// registers without labels or presets.
const FRESH_SERVER: &str = r#"# HELP konnectivity_network_proxy_server_culled_leases_count Count of expired leases that the lease garbage collection controller has culled.
# TYPE konnectivity_network_proxy_server_culled_leases_count counter
konnectivity_network_proxy_server_culled_leases_count 0
# HELP konnectivity_network_proxy_server_http_connections Number of current HTTP CONNECT connections
# TYPE konnectivity_network_proxy_server_http_connections gauge
konnectivity_network_proxy_server_http_connections 0
# HELP konnectivity_network_proxy_server_ready_backend_connections Number of konnectivity agent connected to the proxy server. DEPRECATED, please use ready_backends
# TYPE konnectivity_network_proxy_server_ready_backend_connections gauge
konnectivity_network_proxy_server_ready_backend_connections 0
# HELP konnectivity_network_proxy_server_ready_backends Number of konnectivity agent connected to the proxy server
# TYPE konnectivity_network_proxy_server_ready_backends gauge
konnectivity_network_proxy_server_ready_backends{proxy_strategy="default"} 0
"#;

/// The server's families after the scenario, between the histograms.
const SERVER_COUNTERS: &str = r#"# HELP konnectivity_network_proxy_server_culled_leases_count Count of expired leases that the lease garbage collection controller has culled.
# TYPE konnectivity_network_proxy_server_culled_leases_count counter
konnectivity_network_proxy_server_culled_leases_count 0
"#;
const SERVER_AFTER_DIAL: &str = r#"# HELP konnectivity_network_proxy_server_dial_failure_count Number of dial failures observed. Multiple failures can occur for a single dial request.
# TYPE konnectivity_network_proxy_server_dial_failure_count counter
konnectivity_network_proxy_server_dial_failure_count{reason="error_response"} 1
konnectivity_network_proxy_server_dial_failure_count{reason="frontend_close"} 1
konnectivity_network_proxy_server_dial_failure_count{reason="no_agent"} 1
# HELP konnectivity_network_proxy_server_established_connections Current number of established end-to-end connections (post-dial).
# TYPE konnectivity_network_proxy_server_established_connections gauge
konnectivity_network_proxy_server_established_connections 0
"#;
const SERVER_REST: &str = r#"# HELP konnectivity_network_proxy_server_grpc_connections Number of current grpc connections, partitioned by service method.
# TYPE konnectivity_network_proxy_server_grpc_connections gauge
konnectivity_network_proxy_server_grpc_connections{service_method="Connect"} 1
konnectivity_network_proxy_server_grpc_connections{service_method="Proxy"} 0
# HELP konnectivity_network_proxy_server_http_connections Number of current HTTP CONNECT connections
# TYPE konnectivity_network_proxy_server_http_connections gauge
konnectivity_network_proxy_server_http_connections 0
# HELP konnectivity_network_proxy_server_pending_backend_dials Current number of pending backend dial requests
# TYPE konnectivity_network_proxy_server_pending_backend_dials gauge
konnectivity_network_proxy_server_pending_backend_dials 0
# HELP konnectivity_network_proxy_server_ready_backend_connections Number of konnectivity agent connected to the proxy server. DEPRECATED, please use ready_backends
# TYPE konnectivity_network_proxy_server_ready_backend_connections gauge
konnectivity_network_proxy_server_ready_backend_connections 1
# HELP konnectivity_network_proxy_server_ready_backends Number of konnectivity agent connected to the proxy server
# TYPE konnectivity_network_proxy_server_ready_backends gauge
konnectivity_network_proxy_server_ready_backends{proxy_strategy="default"} 1
# HELP konnectivity_network_proxy_server_stream_packets_total Count of packets processed, by segment and packet type (example: from_client, DIAL_REQ)
# TYPE konnectivity_network_proxy_server_stream_packets_total counter
konnectivity_network_proxy_server_stream_packets_total{packet_type="CLOSE_REQ",segment="from_client"} 1
konnectivity_network_proxy_server_stream_packets_total{packet_type="CLOSE_REQ",segment="to_agent"} 1
konnectivity_network_proxy_server_stream_packets_total{packet_type="CLOSE_RSP",segment="from_agent"} 1
konnectivity_network_proxy_server_stream_packets_total{packet_type="CLOSE_RSP",segment="to_client"} 1
konnectivity_network_proxy_server_stream_packets_total{packet_type="DATA",segment="from_agent"} 1
konnectivity_network_proxy_server_stream_packets_total{packet_type="DATA",segment="from_client"} 1
konnectivity_network_proxy_server_stream_packets_total{packet_type="DATA",segment="to_agent"} 1
konnectivity_network_proxy_server_stream_packets_total{packet_type="DATA",segment="to_client"} 1
konnectivity_network_proxy_server_stream_packets_total{packet_type="DIAL_CLS",segment="from_client"} 1
konnectivity_network_proxy_server_stream_packets_total{packet_type="DIAL_CLS",segment="to_agent"} 1
konnectivity_network_proxy_server_stream_packets_total{packet_type="DIAL_REQ",segment="from_client"} 4
konnectivity_network_proxy_server_stream_packets_total{packet_type="DIAL_REQ",segment="to_agent"} 3
konnectivity_network_proxy_server_stream_packets_total{packet_type="DIAL_RSP",segment="from_agent"} 2
konnectivity_network_proxy_server_stream_packets_total{packet_type="DIAL_RSP",segment="to_client"} 3
"#;

const AGENT_REST: &str = r#"# HELP konnectivity_network_proxy_agent_endpoint_dial_failure_total Number of failures dialing the remote endpoint, by reason (example: timeout).
# TYPE konnectivity_network_proxy_agent_endpoint_dial_failure_total counter
konnectivity_network_proxy_agent_endpoint_dial_failure_total{reason="unknown"} 1
# HELP konnectivity_network_proxy_agent_known_server_count Current number of servers agent is trying to connect to.
# TYPE konnectivity_network_proxy_agent_known_server_count gauge
konnectivity_network_proxy_agent_known_server_count 1
# HELP konnectivity_network_proxy_agent_open_endpoint_connections Current number of open endpoint connections.
# TYPE konnectivity_network_proxy_agent_open_endpoint_connections gauge
konnectivity_network_proxy_agent_open_endpoint_connections 0
# HELP konnectivity_network_proxy_agent_open_server_connections Current number of open server connections.
# TYPE konnectivity_network_proxy_agent_open_server_connections gauge
konnectivity_network_proxy_agent_open_server_connections 1
# HELP konnectivity_network_proxy_agent_stream_packets_total Count of packets processed, by segment and packet type (example: from_client, DIAL_REQ)
# TYPE konnectivity_network_proxy_agent_stream_packets_total counter
konnectivity_network_proxy_agent_stream_packets_total{packet_type="CLOSE_REQ",segment="to_agent"} 1
konnectivity_network_proxy_agent_stream_packets_total{packet_type="CLOSE_RSP",segment="from_agent"} 1
konnectivity_network_proxy_agent_stream_packets_total{packet_type="DATA",segment="from_agent"} 1
konnectivity_network_proxy_agent_stream_packets_total{packet_type="DATA",segment="to_agent"} 1
konnectivity_network_proxy_agent_stream_packets_total{packet_type="DIAL_CLS",segment="to_agent"} 1
konnectivity_network_proxy_agent_stream_packets_total{packet_type="DIAL_REQ",segment="to_agent"} 3
konnectivity_network_proxy_agent_stream_packets_total{packet_type="DIAL_RSP",segment="from_agent"} 2
"#;

/// What an agent that has never reached a server shows of ANP's families:
/// ANP's, and (ours) the server connection gauge at 0, which ANP shows
/// only from the first connection.
const FRESH_AGENT: &str = r#"# HELP konnectivity_network_proxy_agent_known_server_count Current number of servers agent is trying to connect to.
# TYPE konnectivity_network_proxy_agent_known_server_count gauge
konnectivity_network_proxy_agent_known_server_count 1
# HELP konnectivity_network_proxy_agent_open_server_connections Current number of open server connections.
# TYPE konnectivity_network_proxy_agent_open_server_connections gauge
konnectivity_network_proxy_agent_open_server_connections 0
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_process_shows_only_the_metrics_anp_shows_before_any_event() {
    let server = TestServer::start().await;
    let text = scrape(server.health_addr).await;
    assert_eq!(anp_block(&text, S, &[]), FRESH_SERVER, "{text}");

    let nobody = destination::closed_port();
    let agent = TestAgent::start_with(nobody, AgentOpts::default()).await;
    let agent_text = scrape(agent.health_addr).await;
    assert_eq!(anp_block(&agent_text, A, &[]), FRESH_AGENT, "{agent_text}");
    for name in [
        "process_cpu_seconds_total",
        "process_resident_memory_bytes",
        "process_virtual_memory_bytes",
        "process_virtual_memory_max_bytes",
        "process_open_fds",
        "process_max_fds",
        "process_start_time_seconds",
    ] {
        for text in [&text, &agent_text] {
            assert!(
                text.contains(&format!("\n# TYPE {name} ")),
                "{name} missing"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_exposition_after_a_scripted_scenario_matches_anps() {
    let server = TestServer::start().await;

    // 1. A dial with no agent.
    let err = server.dial("127.0.0.1:1").await.err().unwrap();
    assert!(err.to_string().contains(proxy_server::NO_AGENT), "{err}");

    let agent = TestAgent::start(&server).await;

    // 2. A good dial: 5 bytes there and back, then closed by the client.
    let echo = destination::echo().await;
    let mut conn = server.dial(&echo.address()).await.unwrap();
    conn.write_all(b"hello").await.unwrap();
    let mut got = [0u8; 5];
    conn.read_exact(&mut got).await.unwrap();
    // Live gauges while it is open.
    let server_text = scrape(server.health_addr).await;
    assert!(
        server_text.contains(&format!("\n{S}established_connections 1\n")),
        "{server_text}"
    );
    let agent_text = scrape(agent.health_addr).await;
    assert!(
        agent_text.contains(&format!("\n{A}open_endpoint_connections 1\n")),
        "{agent_text}"
    );
    conn.finish().await.unwrap();

    // 3. A dial to a closed port.
    let closed = destination::closed_port();
    assert!(server.dial(&closed.to_string()).await.is_err());

    // 4. A frontend that cancels its dial (DIAL_CLS) while the agent is
    // still dialing, then leaves.
    let hole = destination::Blackhole::new();
    let frontend = RawFrontend::open(
        &server,
        Packet::dial_request("tcp", &hole.addr.to_string(), 77),
    )
    .await;
    let handle = agent.handle.clone();
    wait_for("the dial to reach the agent", || {
        handle.dials_in_progress() == 1
    })
    .await;
    let server_text = scrape(server.health_addr).await;
    assert!(
        server_text.contains(&format!("\n{S}pending_backend_dials 1\n")),
        "{server_text}"
    );
    frontend.send(Packet::close_dial(77)).await;
    wait_for("the agent to drop the cancelled dial", || {
        handle.dials_in_progress() == 0
    })
    .await;
    drop(frontend);
    let server_handle = server.handle.clone();
    wait_for("the server to settle", || {
        server_handle.pending_dials() == 0 && server_handle.established_connections() == 0
    })
    .await;

    // The frontend streams' gauge drops as their readers finish.
    let proxy_streams = format!("{S}grpc_connections{{service_method=\"Proxy\"}} 0\n");
    let metrics = server.health_addr;
    let mut text = String::new();
    tokio::time::timeout(integration_tests::DEADLINE, async {
        loop {
            text = scrape(metrics).await;
            if text.contains(&proxy_streams) {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the frontend streams to end");
    let want = [
        histogram(
            &format!("{S}connection_duration_seconds"),
            "Duration in seconds a proxied end-to-end connection was established (post-dial) before being closed.",
            CONNECTION_BUCKETS,
            1,
        ),
        SERVER_COUNTERS.to_owned(),
        histogram(
            &format!("{S}dial_duration_seconds"),
            "Latency of dial to the remote endpoint in seconds",
            SERVER_BUCKETS,
            1,
        ),
        SERVER_AFTER_DIAL.to_owned(),
        // DIAL_RSP (no agent, good, refused), the echoed DATA, CLOSE_RSP.
        histogram(
            &format!("{S}frontend_write_duration_seconds"),
            "Latency of write to the frontend in seconds",
            SERVER_BUCKETS,
            5,
        ),
        SERVER_REST.to_owned(),
    ]
    .concat();
    let volatile = format!("{S}full_receive_channels");
    assert_eq!(
        anp_block(&text, S, &[&volatile]),
        want,
        "server exposition:\n{text}"
    );
    for (name, value) in [
        (
            "konnectivity_rs_server_tunnel_bytes_total{direction=\"to_agent\"}",
            "5",
        ),
        (
            "konnectivity_rs_server_tunnel_bytes_total{direction=\"to_frontend\"}",
            "5",
        ),
        (
            "konnectivity_rs_server_connections_closed_total{reason=\"closed\"}",
            "1",
        ),
    ] {
        assert!(
            text.contains(&format!("\n{name} {value}\n")),
            "{name}:\n{text}"
        );
    }

    // The agent's side of the same scenario.
    let text = scrape(agent.health_addr).await;
    let want = [
        histogram(
            &format!("{A}dial_duration_seconds"),
            "Latency of dial to the remote endpoint in seconds",
            AGENT_BUCKETS,
            1,
        ),
        AGENT_REST.to_owned(),
    ]
    .concat();
    assert_eq!(anp_block(&text, A, &[]), want, "agent exposition:\n{text}");
    for (name, value) in [
        (
            "konnectivity_rs_agent_tunnel_bytes_total{direction=\"to_endpoint\"}",
            "5",
        ),
        (
            "konnectivity_rs_agent_tunnel_bytes_total{direction=\"to_server\"}",
            "5",
        ),
        (
            "konnectivity_rs_agent_connections_closed_total{reason=\"server_closed\"}",
            "1",
        ),
    ] {
        assert!(
            text.contains(&format!("\n{name} {value}\n")),
            "{name}:\n{text}"
        );
    }
    drop(hole);
}

/// HTTP CONNECT counts dial failures as ANP's tunnel handler does: a
/// CONNECT with no agent is answered 500 and not counted; a client that
/// leaves while its dial is pending counts as `frontend_close`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_connect_dial_failures_are_counted_as_anps() {
    let server = TestServer::start_with(ServerOpts {
        mode: proxy_server::config::Mode::HttpConnect,
        ..ServerOpts::default()
    })
    .await;
    let uds = server.uds.clone();
    let connect = |target: String| {
        let uds = uds.clone();
        async move {
            let mut io = tokio::net::UnixStream::connect(&uds).await.unwrap();
            io.write_all(format!("CONNECT {target} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
                .await
                .unwrap();
            io
        }
    };
    let mut io = connect("127.0.0.1:1".to_owned()).await;
    let mut answer = String::new();
    io.read_to_string(&mut answer).await.unwrap();
    assert_eq!(
        answer,
        "HTTP/1.1 500 Internal Server Error\r\nContent-Type: text/plain\r\n\r\ncurrently no tunnels available: No agent available"
    );

    let agent = TestAgent::start(&server).await;
    let hole = destination::Blackhole::new();
    let io = connect(hole.addr.to_string()).await;
    let handle = agent.handle.clone();
    wait_for("the dial to reach the agent", || {
        handle.dials_in_progress() == 1
    })
    .await;
    drop(io);
    wait_for("the agent to drop the abandoned dial", || {
        handle.dials_in_progress() == 0
    })
    .await;
    let text = scrape(server.health_addr).await;
    let failures: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with(&format!("{S}dial_failure_count")))
        .collect();
    assert_eq!(
        failures,
        [format!(
            "{S}dial_failure_count{{reason=\"frontend_close\"}} 1"
        )],
        "{text}"
    );
    assert!(
        !text.contains(&format!(
            "{S}stream_packets_total{{packet_type=\"DIAL_RSP\",segment=\"to_client\""
        )),
        "{text}"
    );
}

/// The real agent binary: the first scrape after `/healthz` first answers
/// already has the server connection gauge, 0 while no server is reached
/// (a monitoring stack that waits for `/healthz` and reads it finds it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agents_server_connection_gauge_is_there_as_soon_as_healthz_answers() {
    use integration_tests::{LoggedProcess, Pki, binary};
    let pki = Pki::get();
    let nobody = destination::closed_port();
    let mut command = std::process::Command::new(binary("proxy-agent"));
    command.args([
        format!("--ca-cert={}", pki.path("agent-ca.crt").display()),
        format!("--agent-cert={}", pki.path("proxy-agent.crt").display()),
        format!("--agent-key={}", pki.path("proxy-agent.key").display()),
        "--proxy-server-host=127.0.0.1".to_owned(),
        format!("--proxy-server-port={}", nobody.port()),
        "--health-server-host=127.0.0.1".to_owned(),
        "--health-server-port=0".to_owned(),
        "--admin-server-port=0".to_owned(),
    ]);
    let mut agent = LoggedProcess::spawn(command, "proxy-agent");
    let port = agent.logged_port("health.addr=Some(127.0.0.1:").await;
    let health = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    wait_for_async_200(health).await;
    let text = scrape(health).await;
    assert!(
        text.contains(&format!("\n{A}open_server_connections 0\n")),
        "{text}"
    );
}

/// Both binaries allocate with jemalloc and expose its figures beside their
/// RSS (`konnectivity_rs_jemalloc_*_bytes`, consistent with one another);
/// a process on another allocator (this test's, running a server in
/// process) shows none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_binaries_expose_their_allocators_figures() {
    use integration_tests::{
        Pki,
        process::{AgentWithFiles, ServerProcess},
    };
    let server = ServerProcess::start("grpc", &[]).await;
    let agent = AgentWithFiles::start(Pki::get().dir.path(), server.agent_addr.port()).await;
    server.wait_for_agents(1).await;
    for (who, text) in [
        ("proxy-server", server.metrics().await),
        ("proxy-agent", agent.metrics().await),
    ] {
        let figure = |name: &str| -> f64 {
            let prefix = format!("konnectivity_rs_jemalloc_{name}_bytes ");
            text.lines()
                .find_map(|l| l.strip_prefix(&prefix))
                .unwrap_or_else(|| panic!("{who}: no {name} bytes:\n{text}"))
                .parse()
                .unwrap()
        };
        let (allocated, active, resident) =
            (figure("allocated"), figure("active"), figure("resident"));
        assert!(
            0.0 < allocated && allocated <= active && active <= resident,
            "{who}: allocated {allocated}, active {active}, resident {resident}"
        );
        for name in ["dirty", "metadata", "retained"] {
            assert!(figure(name) >= 0.0);
        }
    }
    let in_process = TestServer::start().await;
    let text = scrape(in_process.health_addr).await;
    assert!(!text.contains("konnectivity_rs_jemalloc_"), "{text}");
}

/// Polls `GET /healthz` on `addr` until it answers 200.
async fn wait_for_async_200(addr: std::net::SocketAddr) {
    let start = std::time::Instant::now();
    loop {
        if tokio::net::TcpStream::connect(addr).await.is_ok()
            && http_request(addr, "GET", "/healthz", "localhost", "")
                .await
                .status
                == 200
        {
            return;
        }
        assert!(
            start.elapsed() < integration_tests::DEADLINE,
            "/healthz on {addr} never answered 200"
        );
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
}
