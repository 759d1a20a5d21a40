//! Metrics and endpoints as operators' tools see them: after a scripted
//! scenario (a dial with no agent, a good dial, a dial to a closed port, a
//! frontend that gives up on a pending dial) the scraped exposition of the
//! server and of the agent holds exactly ANP's series for those metrics,
//! with ANP's names, types, HELP texts, labels and values; and the health
//! and admin endpoints answer as ANP's do before and after an agent
//! connects.

#![allow(clippy::unwrap_used)] // tests: a panic is a failure report

use std::collections::BTreeMap;

use integration_tests::{
    AgentOpts, RawFrontend, ServerOpts, TestAgent, TestServer, backend, http_get, wait_for,
};
use proto::Packet;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A raw HTTP/1.1 GET returning status, headers (lower-cased names) and body.
async fn get(addr: std::net::SocketAddr, path: &str) -> (u16, BTreeMap<String, String>, String) {
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream
        .write_all(
            format!("GET {path} HTTP/1.1\r\nHost: localhost:1\r\nConnection: close\r\n\r\n")
                .as_bytes(),
        )
        .await
        .unwrap();
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await.unwrap();
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    let mut lines = head.lines();
    let status = lines
        .next()
        .unwrap()
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let headers = lines
        .filter_map(|l| l.split_once(": "))
        .map(|(k, v)| (k.to_ascii_lowercase(), v.to_owned()))
        .collect();
    (status, headers, body.to_owned())
}

/// The `# HELP`/`# TYPE` lines and samples of the families whose names
/// start with `prefix`, samples keyed by series. Histogram sums and bucket
/// counts depend on timing: they are checked for shape (every bucket
/// present, `+Inf` equal to the count) and then left out.
fn families(text: &str, prefix: &str) -> (Vec<String>, BTreeMap<String, String>) {
    let mut meta = Vec::new();
    let mut samples = BTreeMap::new();
    for line in text.lines() {
        if let Some(rest) = line
            .strip_prefix("# HELP ")
            .or_else(|| line.strip_prefix("# TYPE "))
        {
            if rest.starts_with(prefix) {
                meta.push(line.to_owned());
            }
            continue;
        }
        if !line.starts_with(prefix) {
            continue;
        }
        let (series, value) = line.rsplit_once(' ').unwrap();
        samples.insert(series.to_owned(), value.to_owned());
    }
    // Fold histograms to their counts.
    let counts: Vec<(String, String)> = samples
        .iter()
        .filter(|(k, _)| k.contains("_count"))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    for (count_key, count) in counts {
        let base = count_key.replace("_count", "");
        let inf = format!("{base}_bucket{{le=\"+Inf\"}}");
        if let Some(inf_value) = samples.get(&inf) {
            assert_eq!(
                inf_value, &count,
                "{base}: +Inf bucket differs from the count"
            );
            samples.retain(|k, _| {
                !(k.starts_with(&format!("{base}_bucket")) || *k == format!("{base}_sum"))
            });
        }
    }
    (meta, samples)
}

/// HELP/TYPE lines in a fixed order (families may come in any order).
fn sorted(lines: &[String]) -> Vec<String> {
    let mut lines = lines.to_vec();
    lines.sort();
    lines
}

fn sorted_text(text: &str) -> Vec<String> {
    sorted(&text.lines().map(str::to_owned).collect::<Vec<_>>())
}

fn expected(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

const SERVER_META: &str = r#"# HELP konnectivity_network_proxy_server_dial_duration_seconds Latency of dial to the remote endpoint in seconds
# TYPE konnectivity_network_proxy_server_dial_duration_seconds histogram
# HELP konnectivity_network_proxy_server_frontend_write_duration_seconds Latency of write to the frontend in seconds
# TYPE konnectivity_network_proxy_server_frontend_write_duration_seconds histogram
# HELP konnectivity_network_proxy_server_connection_duration_seconds Duration in seconds a proxied end-to-end connection was established (post-dial) before being closed.
# TYPE konnectivity_network_proxy_server_connection_duration_seconds histogram
# HELP konnectivity_network_proxy_server_grpc_connections Number of current grpc connections, partitioned by service method.
# TYPE konnectivity_network_proxy_server_grpc_connections gauge
# HELP konnectivity_network_proxy_server_http_connections Number of current HTTP CONNECT connections
# TYPE konnectivity_network_proxy_server_http_connections gauge
# HELP konnectivity_network_proxy_server_ready_backend_connections Number of konnectivity agent connected to the proxy server. DEPRECATED, please use ready_backends
# TYPE konnectivity_network_proxy_server_ready_backend_connections gauge
# HELP konnectivity_network_proxy_server_ready_backends Number of konnectivity agent connected to the proxy server
# TYPE konnectivity_network_proxy_server_ready_backends gauge
# HELP konnectivity_network_proxy_server_pending_backend_dials Current number of pending backend dial requests
# TYPE konnectivity_network_proxy_server_pending_backend_dials gauge
# HELP konnectivity_network_proxy_server_established_connections Current number of established end-to-end connections (post-dial).
# TYPE konnectivity_network_proxy_server_established_connections gauge
# HELP konnectivity_network_proxy_server_full_receive_channels Number of current connections blocked by a full receive channel, partitioned by service method.
# TYPE konnectivity_network_proxy_server_full_receive_channels gauge
# HELP konnectivity_network_proxy_server_dial_failure_count Number of dial failures observed. Multiple failures can occur for a single dial request.
# TYPE konnectivity_network_proxy_server_dial_failure_count counter
# HELP konnectivity_network_proxy_server_stream_packets_total Count of packets processed, by segment and packet type (example: from_client, DIAL_REQ)
# TYPE konnectivity_network_proxy_server_stream_packets_total counter
# HELP konnectivity_network_proxy_server_stream_errors_total Count of gRPC stream errors, by segment, grpc Code, packet type. (example: from_agent, Code.Unavailable, DIAL_RSP)
# TYPE konnectivity_network_proxy_server_stream_errors_total counter
# HELP konnectivity_network_proxy_server_culled_leases_count Count of expired leases that the lease garbage collection controller has culled.
# TYPE konnectivity_network_proxy_server_culled_leases_count counter
# HELP konnectivity_network_proxy_server_lease_delete_latency_seconds Latency of lease deletion calls by the garbage collection controller in seconds.
# TYPE konnectivity_network_proxy_server_lease_delete_latency_seconds histogram
# HELP konnectivity_network_proxy_server_lease_delete_total Count of lease delection calls by the garbage collection controller. Labeled by HTTP status code and reason.
# TYPE konnectivity_network_proxy_server_lease_delete_total counter
# HELP konnectivity_network_proxy_server_lease_list_latency_seconds Latency of lease list calls by the garbage collection controller in seconds.
# TYPE konnectivity_network_proxy_server_lease_list_latency_seconds histogram
# HELP konnectivity_network_proxy_server_lease_list_total Count of lease deletion calls by the garbage collection controller. Labeled by HTTP status code and reason.
# TYPE konnectivity_network_proxy_server_lease_list_total counter"#;

const AGENT_META: &str = r#"# HELP konnectivity_network_proxy_agent_dial_duration_seconds Latency of dial to the remote endpoint in seconds
# TYPE konnectivity_network_proxy_agent_dial_duration_seconds histogram
# HELP konnectivity_network_proxy_agent_server_connection_failure_count Count of failures to send to or receive from the proxy server, labeled by the direction (from_server or to_server). DEPRECATED, please use stream_events_error_total
# TYPE konnectivity_network_proxy_agent_server_connection_failure_count counter
# HELP konnectivity_network_proxy_agent_endpoint_dial_failure_total Number of failures dialing the remote endpoint, by reason (example: timeout).
# TYPE konnectivity_network_proxy_agent_endpoint_dial_failure_total counter
# HELP konnectivity_network_proxy_agent_open_server_connections Current number of open server connections.
# TYPE konnectivity_network_proxy_agent_open_server_connections gauge
# HELP konnectivity_network_proxy_agent_known_server_count Current number of servers agent is trying to connect to.
# TYPE konnectivity_network_proxy_agent_known_server_count gauge
# HELP konnectivity_network_proxy_agent_open_endpoint_connections Current number of open endpoint connections.
# TYPE konnectivity_network_proxy_agent_open_endpoint_connections gauge
# HELP konnectivity_network_proxy_agent_lease_lists_total Count of server lease list calls made by the agent to the k8s apiserver, labeled by HTTP response code and reason
# TYPE konnectivity_network_proxy_agent_lease_lists_total counter
# HELP konnectivity_network_proxy_agent_lease_watches_total Count of server lease watch calls made by the agent to the k8s apiserver, labeled by HTTP response code and reason
# TYPE konnectivity_network_proxy_agent_lease_watches_total counter
# HELP konnectivity_network_proxy_agent_lease_list_latency_seconds Latency of server lease listing in seconds
# TYPE konnectivity_network_proxy_agent_lease_list_latency_seconds histogram
# HELP konnectivity_network_proxy_agent_stream_packets_total Count of packets processed, by segment and packet type (example: from_client, DIAL_REQ)
# TYPE konnectivity_network_proxy_agent_stream_packets_total counter
# HELP konnectivity_network_proxy_agent_stream_errors_total Count of gRPC stream errors, by segment, grpc Code, packet type. (example: from_agent, Code.Unavailable, DIAL_RSP)
# TYPE konnectivity_network_proxy_agent_stream_errors_total counter"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_exposition_after_a_scripted_scenario_matches_anps() {
    let server = TestServer::start().await;

    // 1. A dial with no agent.
    let err = server.dial("127.0.0.1:1").await.err().unwrap();
    assert!(err.to_string().contains(proxy_server::NO_AGENT), "{err}");

    let agent = TestAgent::start(&server).await;

    // 2. A good dial: 5 bytes there and back, then closed by the client.
    let echo = backend::echo().await;
    let mut conn = server.dial(&echo.address()).await.unwrap();
    conn.write_all(b"hello").await.unwrap();
    let mut got = [0u8; 5];
    conn.read_exact(&mut got).await.unwrap();
    // Live gauges while it is open.
    let server_text = get(server.health_addr, "/metrics").await.2;
    assert!(
        server_text.contains("\nkonnectivity_network_proxy_server_established_connections 1\n"),
        "{server_text}"
    );
    let agent_text = get(agent.health_addr, "/metrics").await.2;
    assert!(
        agent_text.contains("\nkonnectivity_network_proxy_agent_open_endpoint_connections 1\n"),
        "{agent_text}"
    );
    conn.finish().await.unwrap();

    // 3. A dial to a closed port.
    let closed = backend::closed_port();
    assert!(server.dial(&closed.to_string()).await.is_err());

    // 4. A frontend that leaves while its dial is pending on the agent.
    let hole = backend::Blackhole::new();
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
    let server_text = get(server.health_addr, "/metrics").await.2;
    assert!(
        server_text.contains("\nkonnectivity_network_proxy_server_pending_backend_dials 1\n"),
        "{server_text}"
    );
    drop(frontend);
    wait_for("the agent to drop the cancelled dial", || {
        handle.dials_in_progress() == 0
    })
    .await;
    let server_handle = server.handle.clone();
    wait_for("the server to settle", || {
        server_handle.pending_dials() == 0 && server_handle.established_connections() == 0
    })
    .await;

    // The frontend streams' gauge drops as their readers finish.
    let proxy_streams =
        "konnectivity_network_proxy_server_grpc_connections{service_method=\"Proxy\"}";
    let mut text = String::new();
    for _ in 0..200 {
        text = get(server.health_addr, "/metrics").await.2;
        if text.contains(&format!("{proxy_streams} 0\n")) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    let (meta, mut samples) = families(&text, "konnectivity_network_proxy_server_");
    assert_eq!(sorted(&meta), sorted_text(SERVER_META));
    // Timing decides how often a reader briefly waited; the gauge is 0 now.
    samples.retain(|k, v| !(k.contains("full_receive_channels") && v == "0"));
    let writes = samples
        .remove("konnectivity_network_proxy_server_frontend_write_duration_seconds_count")
        .expect("frontend writes");
    assert!(writes.parse::<u64>().unwrap() >= 3, "{writes}");
    let p = |segment: &str, kind: &str| {
        format!(
            "konnectivity_network_proxy_server_stream_packets_total{{packet_type=\"{kind}\",segment=\"{segment}\"}}"
        )
    };
    let want: Vec<(String, &str)> = vec![
        (
            "konnectivity_network_proxy_server_dial_duration_seconds_count".into(),
            "1",
        ),
        (
            "konnectivity_network_proxy_server_connection_duration_seconds_count".into(),
            "1",
        ),
        (
            "konnectivity_network_proxy_server_grpc_connections{service_method=\"Connect\"}".into(),
            "1",
        ),
        (proxy_streams.into(), "0"),
        (
            "konnectivity_network_proxy_server_http_connections".into(),
            "0",
        ),
        (
            "konnectivity_network_proxy_server_ready_backend_connections".into(),
            "1",
        ),
        (
            "konnectivity_network_proxy_server_ready_backends{proxy_strategy=\"default\"}".into(),
            "1",
        ),
        (
            "konnectivity_network_proxy_server_pending_backend_dials".into(),
            "0",
        ),
        (
            "konnectivity_network_proxy_server_established_connections".into(),
            "0",
        ),
        (
            "konnectivity_network_proxy_server_dial_failure_count{reason=\"no_agent\"}".into(),
            "1",
        ),
        (
            "konnectivity_network_proxy_server_dial_failure_count{reason=\"error_response\"}"
                .into(),
            "1",
        ),
        (
            "konnectivity_network_proxy_server_dial_failure_count{reason=\"frontend_close\"}"
                .into(),
            "1",
        ),
        (
            "konnectivity_network_proxy_server_culled_leases_count".into(),
            "0",
        ),
        (p("from_client", "DIAL_REQ"), "4"),
        (p("from_client", "DATA"), "1"),
        (p("from_client", "CLOSE_REQ"), "1"),
        (p("to_client", "DIAL_RSP"), "3"),
        (p("to_client", "DATA"), "1"),
        (p("to_client", "CLOSE_RSP"), "1"),
        (p("to_agent", "DIAL_REQ"), "3"),
        (p("to_agent", "DATA"), "1"),
        (p("to_agent", "CLOSE_REQ"), "1"),
        (p("to_agent", "DIAL_CLS"), "1"),
        (p("from_agent", "DIAL_RSP"), "2"),
        (p("from_agent", "DATA"), "1"),
        (p("from_agent", "CLOSE_RSP"), "1"),
    ];
    let want: BTreeMap<String, String> = want.into_iter().map(|(k, v)| (k, v.to_owned())).collect();
    assert_eq!(samples, want, "server exposition:\n{text}");
    for name in [
        "process_cpu_seconds_total",
        "process_resident_memory_bytes",
        "process_open_fds",
        "process_start_time_seconds",
    ] {
        assert!(text.contains(&format!("\n{name} ")), "{name} missing");
    }
    assert!(text.contains("konnectivity_rs_server_tunnel_bytes_total{direction=\"to_agent\"} 5\n"));
    assert!(
        text.contains("konnectivity_rs_server_tunnel_bytes_total{direction=\"to_frontend\"} 5\n")
    );
    assert!(
        text.contains("konnectivity_rs_server_connections_closed_total{reason=\"closed\"} 1\n")
    );

    // The agent's side of the same scenario.
    let text = get(agent.health_addr, "/metrics").await.2;
    let (meta, samples) = families(&text, "konnectivity_network_proxy_agent_");
    assert_eq!(sorted(&meta), sorted_text(AGENT_META));
    let a = |segment: &str, kind: &str| {
        format!(
            "konnectivity_network_proxy_agent_stream_packets_total{{packet_type=\"{kind}\",segment=\"{segment}\"}}"
        )
    };
    let want = expected(&[
        (
            "konnectivity_network_proxy_agent_dial_duration_seconds_count",
            "1",
        ),
        (
            "konnectivity_network_proxy_agent_endpoint_dial_failure_total{reason=\"unknown\"}",
            "1",
        ),
        (
            "konnectivity_network_proxy_agent_open_server_connections",
            "1",
        ),
        ("konnectivity_network_proxy_agent_known_server_count", "1"),
        (
            "konnectivity_network_proxy_agent_open_endpoint_connections",
            "0",
        ),
        (&a("to_agent", "DIAL_REQ"), "3"),
        (&a("to_agent", "DATA"), "1"),
        (&a("to_agent", "CLOSE_REQ"), "1"),
        (&a("to_agent", "DIAL_CLS"), "1"),
        (&a("from_agent", "DIAL_RSP"), "2"),
        (&a("from_agent", "DATA"), "1"),
        (&a("from_agent", "CLOSE_RSP"), "1"),
    ]);
    assert_eq!(samples, want, "agent exposition:\n{text}");
    assert!(
        text.contains("konnectivity_rs_agent_tunnel_bytes_total{direction=\"to_endpoint\"} 5\n")
    );
    assert!(
        text.contains(
            "konnectivity_rs_agent_connections_closed_total{reason=\"server_closed\"} 1\n"
        )
    );
    drop(hole);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoints_answer_as_anps_before_and_after_an_agent_connects() {
    let server = TestServer::start().await;
    let agent = TestAgent::start_with(server.agent_addr, AgentOpts::default()).await;
    server.wait_for_backends(1).await;
    let halted = server.halt().await;
    let handle = agent.handle.clone();
    wait_for("the agent to lose its server", || {
        handle.server_connections() == 0
    })
    .await;

    // Agent without a server.
    assert_eq!(
        http_get(agent.health_addr, "/healthz").await,
        (200, "ok".to_owned())
    );
    let not_ready = "[+]ping ok\n[-]server-connected failed: no servers connected\n".to_owned();
    assert_eq!(
        http_get(agent.health_addr, "/readyz").await,
        (503, not_ready.clone())
    );
    assert_eq!(
        http_get(agent.health_addr, "/ready").await,
        (503, not_ready)
    );

    // Server before any agent: this agent must not reconnect first.
    agent.stop().await;
    let server = halted.start().await;
    assert_eq!(
        http_get(server.health_addr, "/healthz").await,
        (200, "ok".to_owned())
    );
    let no_agent = (500, "no connection to any proxy agent".to_owned());
    assert_eq!(http_get(server.health_addr, "/readyz").await, no_agent);
    assert_eq!(http_get(server.health_addr, "/ready").await, no_agent);

    let agent = TestAgent::start(&server).await;
    // The server counts the agent before the agent has read its answer.
    let handle = agent.handle.clone();
    wait_for("the agent to see its server", || {
        handle.server_connections() == 1
    })
    .await;
    assert_eq!(
        http_get(server.health_addr, "/readyz").await,
        (200, "ok".to_owned())
    );
    assert_eq!(
        http_get(server.health_addr, "/ready").await,
        (200, "ok".to_owned())
    );
    assert_eq!(
        http_get(agent.health_addr, "/readyz").await,
        (200, "ok".to_owned())
    );
    assert_eq!(
        http_get(agent.health_addr, "/readyz?verbose").await,
        (
            200,
            "[+]ping ok\n[+]server-connected ok\ncheck passed\n".to_owned()
        )
    );

    // /metrics on both health ports and the server's admin port.
    for addr in [server.health_addr, server.admin_addr, agent.health_addr] {
        let (status, headers, body) = get(addr, "/metrics").await;
        assert_eq!(status, 200, "{addr}");
        assert_eq!(
            headers["content-type"],
            "text/plain; version=0.0.4; charset=utf-8"
        );
        assert!(
            body.contains("# TYPE process_cpu_seconds_total counter"),
            "{addr}"
        );
    }
    // The agent's admin port sends /metrics to its health port.
    let (status, headers, _) = get(agent.admin_addr, "/metrics").await;
    assert_eq!(status, 301);
    assert_eq!(
        headers["location"],
        format!("//localhost:{}/metrics", agent.health_addr.port())
    );
    // Profiling is off unless asked for.
    assert_eq!(get(server.admin_addr, "/debug/pprof/").await.0, 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enable_profiling_serves_cpu_profiles_on_the_admin_port() {
    let server = TestServer::start_with(ServerOpts {
        profiling: true,
        ..ServerOpts::default()
    })
    .await;
    let (status, _, index) = get(server.admin_addr, "/debug/pprof/").await;
    assert_eq!(status, 200);
    assert!(index.contains("profile"), "{index}");
    let (status, headers, _) = get(server.admin_addr, "/debug/pprof/profile?seconds=1").await;
    assert_eq!(status, 200);
    assert_eq!(headers["content-type"], "application/octet-stream");
    assert_eq!(
        get(server.admin_addr, "/debug/pprof/profile?seconds=x")
            .await
            .0,
        400
    );
}
