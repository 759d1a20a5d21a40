//! Traces (`--tracing-config-file`), end to end: the real `proxy-server` and
//! `proxy-agent` export to `tests/python/otlp_receiver.py`, an OTLP/gRPC
//! receiver on the OpenTelemetry project's generated `TraceService`, while
//! frontends we did not write (`tests/python/frontend.py`: grpcio, and the
//! standard library for CONNECT) dial with a W3C `traceparent` as
//! kube-apiserver does when its tracing is on.
//!
//! The exporters' batch delay is [`otlp::BATCH_DELAY_MS`]
//! (`OTEL_BSP_SCHEDULE_DELAY`) unless a case needs the flush at shutdown
//! to be the only way out.

use std::time::{Duration, Instant};

use integration_tests::{
    DEADLINE, LoggedProcess, Pki,
    destination::{self, Destination},
    otlp::{self, ARRIVAL, BATCH_DELAY_MS, Receiver, attr},
    process::{AgentWithFiles, ServerProcess, metric_value},
    python::{self, FrontendReport},
};
use serde_json::Value;

/// The span id of the frontend's (kube-apiserver's) span in every case.
const PARENT: &str = "00f067aa0ba902b7";

/// Bytes each tunnel echoes.
const BYTES: u64 = 65_536;

/// A `traceparent` of `trace`, sampled, whose span is [`PARENT`].
fn traceparent(trace: &str) -> String {
    format!("00-{trace}-{PARENT}-01")
}

/// A server in `mode` and one agent, both reading `config` and with `env`;
/// returns once the agent is connected.
async fn start(
    mode: &str,
    config: &std::path::Path,
    env: &[(&str, &str)],
) -> (ServerProcess, AgentWithFiles) {
    let flag = [format!("--tracing-config-file={}", config.display())];
    let server = ServerProcess::start_with_env(mode, &flag, env).await;
    let pki = Pki::get().dir.path();
    let agent = AgentWithFiles::start_with(pki, server.agent_addr.port(), &flag, env).await;
    server.wait_for_agents(1).await;
    (server, agent)
}

/// One single-use gRPC tunnel through `server` echoing [`BYTES`] from
/// `echo`, its stream carrying `traceparent` if given.
async fn grpc_echo(
    server: &ServerProcess,
    echo: &Destination,
    traceparent: Option<&str>,
) -> FrontendReport {
    let mut args = vec![
        "echo".to_owned(),
        format!("--target=unix:{}", server.uds.display()),
        format!("--address={}", echo.address()),
        format!("--bytes={BYTES}"),
    ];
    args.extend(traceparent.map(|t| format!("--traceparent={t}")));
    let report = python::frontend(args).await;
    report.assert_ok();
    report
}

/// Stops the agent as an operator does (as ANP's, the first SIGTERM
/// drains, the second stops it) and waits until it has exited, its
/// tracer's flush done.
async fn stop_agent(agent: &mut AgentWithFiles) {
    agent.process.signal("TERM");
    agent.process.wait_for("draining", 1, DEADLINE).await;
    stop(&mut agent.process, "proxy-agent").await;
}

/// Sends SIGTERM and waits until the process has exited (its tracer's
/// flush done).
async fn stop(process: &mut LoggedProcess, name: &str) {
    process.signal("TERM");
    let start = Instant::now();
    while !process.has_exited() {
        assert!(
            start.elapsed() < DEADLINE,
            "{name} still running {DEADLINE:?} after SIGTERM: {:#?}",
            process.lines()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The span named `name` in `trace`, once it arrived.
async fn span(receiver: &Receiver, name: &str, trace: &str) -> Value {
    receiver
        .wait_for_span(&format!("{name:?} in trace {trace}"), ARRIVAL, |s| {
            s["name"] == name && s["trace_id"] == trace
        })
        .await
}

/// Asserts the three spans of one traced dial through `echo` link up: the
/// server's dial is the child of [`PARENT`], the agent's dial and the
/// tunnel children of the server's dial; returns the server's dial span.
async fn assert_linked(receiver: &Receiver, trace: &str, echo: &Destination) -> Value {
    let dial = span(receiver, "proxy-server dial", trace).await;
    assert_eq!(dial["parent_span_id"], PARENT, "{dial:#}");
    assert_eq!(dial["service"], "konnectivity-server", "{dial:#}");
    assert_eq!(
        *attr(&dial, "konnectivity.destination"),
        echo.address(),
        "{dial:#}"
    );
    assert_eq!(*attr(&dial, "konnectivity.dial.retries"), 0, "{dial:#}");
    assert_eq!(*attr(&dial, "konnectivity.dial.hedged"), false, "{dial:#}");
    assert_eq!(*attr(&dial, "konnectivity.end"), "established", "{dial:#}");
    let agent_id = attr(&dial, "konnectivity.agent.id");
    assert!(
        agent_id.as_str().is_some_and(|id| !id.is_empty()),
        "{dial:#}"
    );
    let attempts: Vec<&Value> = dial["events"]
        .as_array()
        .expect("events")
        .iter()
        .filter(|e| e["name"] == "attempt")
        .collect();
    assert_eq!(attempts.len(), 1, "{dial:#}");
    assert_eq!(
        attempts[0]["attributes"]["konnectivity.agent.id"],
        *agent_id
    );
    assert_eq!(attempts[0]["attributes"]["konnectivity.attempt"], "first");

    let agent = span(receiver, "proxy-agent dial", trace).await;
    assert_eq!(agent["parent_span_id"], dial["span_id"], "{agent:#}");
    assert_eq!(agent["service"], "konnectivity-agent", "{agent:#}");
    assert_eq!(
        *attr(&agent, "konnectivity.destination"),
        echo.address(),
        "{agent:#}"
    );
    assert_eq!(*attr(&agent, "konnectivity.end"), "connected", "{agent:#}");
    assert_eq!(
        *attr(&agent, "konnectivity.resolved_address"),
        echo.address(),
        "{agent:#}"
    );

    let tunnel = span(receiver, "proxy-server tunnel", trace).await;
    assert_eq!(tunnel["parent_span_id"], dial["span_id"], "{tunnel:#}");
    assert_eq!(*attr(&tunnel, "konnectivity.agent.id"), *agent_id);
    assert_eq!(*attr(&tunnel, "konnectivity.bytes.to_agent"), BYTES);
    assert_eq!(*attr(&tunnel, "konnectivity.bytes.to_frontend"), BYTES);
    assert_eq!(*attr(&tunnel, "konnectivity.end"), "closed", "{tunnel:#}");
    dial
}

#[tokio::test]
async fn a_dial_arrives_as_linked_spans_and_sampling_zero_sends_nothing() {
    let receiver = Receiver::start().await;
    let dir = tempfile::tempdir().unwrap();
    let env = [("OTEL_BSP_SCHEDULE_DELAY", BATCH_DELAY_MS)];
    let echo = destination::echo().await;

    // Every root sampled; this dial's parent is sampled anyway.
    let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let (mut server, mut agent) =
        start("grpc", &receiver.config(dir.path(), 1_000_000), &env).await;
    grpc_echo(&server, &echo, Some(&traceparent(trace))).await;
    let dial = assert_linked(&receiver, trace, &echo).await;
    assert_eq!(*attr(&dial, "konnectivity.frontend"), "grpc");
    stop(&mut server.process, "proxy-server").await;
    stop_agent(&mut agent).await;
    let received = receiver.spans().len();

    // No root sampled and no parent given: nothing, not even at the
    // flushes of the processes' ends.
    let (mut server, mut agent) = start("grpc", &receiver.config(dir.path(), 0), &env).await;
    grpc_echo(&server, &echo, None).await;
    stop(&mut server.process, "proxy-server").await;
    stop_agent(&mut agent).await;
    let spans = receiver.spans();
    assert_eq!(
        spans.len(),
        received,
        "spans exported at samplingRatePerMillion 0: {:#?}",
        &spans[received..]
    );
}

#[tokio::test]
async fn the_last_dials_spans_arrive_when_the_processes_stop() {
    let receiver = Receiver::start().await;
    let dir = tempfile::tempdir().unwrap();
    // Ten minutes: only the flush at the end can export within the test.
    let env = [("OTEL_BSP_SCHEDULE_DELAY", "600000")];
    let echo = destination::echo().await;
    let trace = "0af7651916cd43dd8448eb211c80319c";
    let (mut server, mut agent) = start("grpc", &receiver.config(dir.path(), 0), &env).await;
    grpc_echo(&server, &echo, Some(&traceparent(trace))).await;
    assert!(
        receiver.spans().is_empty(),
        "exported before the end: {:#?}",
        receiver.spans()
    );
    server.terminate(DEADLINE).await;
    stop_agent(&mut agent).await;
    // Both exited after their flush, which waits for the receiver's answer.
    let names: Vec<String> = receiver
        .spans()
        .iter()
        .filter(|s| s["trace_id"] == trace)
        .map(|s| s["name"].as_str().unwrap_or_default().to_owned())
        .collect();
    for name in [
        "proxy-server dial",
        "proxy-server tunnel",
        "proxy-agent dial",
    ] {
        assert!(names.iter().any(|n| n == name), "no {name} in {names:?}");
    }
    assert_linked(&receiver, trace, &echo).await;
}

#[tokio::test]
async fn a_collector_that_is_down_costs_only_dropped_spans() {
    let dir = tempfile::tempdir().unwrap();
    let closed = destination::closed_port();
    let config = otlp::config_file(dir.path(), &closed.to_string(), 1_000_000);
    let env = [("OTEL_BSP_SCHEDULE_DELAY", BATCH_DELAY_MS)];
    let echo = destination::echo().await;
    let (server, agent) = start("grpc", &config, &env).await;
    let started = Instant::now();
    let report = grpc_echo(&server, &echo, None).await;
    // A dial and its tunnel on loopback: milliseconds, nowhere near the
    // exporter's 10 s timeout.
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "the tunnel took {:?}: {report}",
        started.elapsed()
    );
    // Its dial and tunnel spans, then the agent's dial span, dropped.
    server
        .wait_for_metric_at_least(
            "konnectivity_rs_server_trace_spans_dropped_total",
            2.0,
            DEADLINE,
        )
        .await;
    let start = Instant::now();
    loop {
        let text = agent.metrics().await;
        if metric_value(&text, "konnectivity_rs_agent_trace_spans_dropped_total") >= 1.0 {
            break;
        }
        assert!(
            start.elapsed() < DEADLINE,
            "no dropped span counted:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn a_connect_requests_traceparent_header_is_the_dials_parent() {
    let receiver = Receiver::start().await;
    let dir = tempfile::tempdir().unwrap();
    let env = [("OTEL_BSP_SCHEDULE_DELAY", BATCH_DELAY_MS)];
    let echo = destination::echo().await;
    let trace = "b7ad6b7169203331b7ad6b7169203331";
    let (server, _agent) = start("http-connect", &receiver.config(dir.path(), 0), &env).await;
    let report = python::frontend([
        "connect-echo".to_owned(),
        format!("--socket={}", server.uds.display()),
        format!("--address={}", echo.address()),
        format!("--bytes={BYTES}"),
        format!("--traceparent={}", traceparent(trace)),
    ])
    .await;
    report.assert_ok();
    let dial = assert_linked(&receiver, trace, &echo).await;
    assert_eq!(*attr(&dial, "konnectivity.frontend"), "http-connect");
}

/// Issue 51, item 2: with tracing on, which adds a `traceparent` to every
/// DIAL_REQ it forwards, the largest DIAL_REQ a frontend may send (its
/// address 4 MiB less 64 bytes) is refused naming the address limit and
/// never reaches an agent, which stays connected. Before, it was forwarded
/// with the traceparent past the agent's 4 MiB decode limit, and the agent
/// dropped its whole stream (the dial then failed `agent … disconnected`).
#[tokio::test]
async fn the_largest_dial_request_leaves_every_agent_connected() {
    use proto::{Packet, packet::PacketKind, proxy_service_client::ProxyServiceClient};
    let receiver = Receiver::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (server, _agent) = start("grpc", &receiver.config(dir.path(), 0), &[]).await;
    let channel = client::dial::uds_channel(&server.uds).await.unwrap();
    let address = format!("{}:80", "a".repeat(4 * 1024 * 1024 - 64 - 3));
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    tx.send(Packet::dial_request("tcp", &address, 1))
        .await
        .unwrap();
    let mut answers = ProxyServiceClient::new(channel)
        .proxy(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let answer = tokio::time::timeout(DEADLINE, answers.message())
        .await
        .expect("an answer in time")
        .expect("the stream")
        .expect("a packet");
    let PacketKind::DialRsp(rsp) = answer.into_kind() else {
        panic!("expected a DIAL_RSP");
    };
    assert!(
        rsp.error
            .ends_with("is longer than a host name and port can be (259 bytes)"),
        "{}",
        rsp.error
    );
    let connected =
        "konnectivity_network_proxy_server_grpc_connections{service_method=\"Connect\"}";
    assert_eq!(server.metric(connected).await, 1.0);
    assert_eq!(
        server
            .metric("konnectivity_network_proxy_server_stream_packets_total{packet_type=\"DIAL_REQ\",segment=\"to_agent\"}")
            .await,
        0.0,
        "the DIAL_REQ reached an agent"
    );
}
