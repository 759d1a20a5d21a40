//! An agent that dies right after answering dials (issue 50): every
//! request kube-apiserver made through it ends, with an error, within a
//! bound; none waits forever.
//!
//! kube-apiserver's konnectivity-client hands a DIAL_RSP from its receiving
//! goroutine to the dialing one, which registers the connection only
//! afterwards; a CLOSE_RSP received in between is dropped as "Connection
//! not recognized", and the request's reads then wait for ever. The grpc-go
//! frontend's `-kclient` dispatch behaves the same (`tests/go/frontend/kclient.go`).
//! The server is frozen (`SIGSTOP`) while its agent answers a batch of
//! dials and is killed, so that once it runs again it reads every DIAL_RSP
//! and the stream's end in one go and answers each frontend with its
//! DIAL_RSP and its CLOSE_RSP back to back: the shape a busy control plane
//! gives to a kill that follows the answers closely, every time instead of
//! by luck.

use std::{net::SocketAddr, time::Duration};

use integration_tests::{
    AgentProcess,
    binaries::signal,
    destination,
    grpc_go::{self, FrontendReport},
    process::{ServerProcess, wait_stopped},
    wait_for,
};

/// Tunnels dialed in the batch the agent answers before it dies.
const TUNNELS: u64 = 24;
/// How long a tunnel may take in all: far past a dial and an exchange, far
/// short of the run's limit, so that one that waits for ever is reported.
const LIMIT: Duration = Duration::from_secs(15);
/// DIAL_REQs the server sent to agents.
const DIAL_REQS_TO_AGENT: &str = "konnectivity_network_proxy_server_stream_packets_total{packet_type=\"DIAL_REQ\",segment=\"to_agent\"}";
/// The fewest bytes a DIAL_RSP takes on the agent's connection: an HTTP/2
/// frame header (9), a gRPC message header (5) and the packet (at least 8).
const DIAL_RSP_BYTES: u64 = 22;
/// The fewest bytes a DIAL_REQ to the echo destination takes: the same
/// headers and the packet (its address alone is 15 bytes or more).
const DIAL_REQ_BYTES: u64 = 30;

/// Which end of the agent's connection.
#[derive(Clone, Copy)]
enum End {
    /// The server's (its local port is the agent port).
    Server,
    /// The agent's (its remote port is the agent port).
    Agent,
}

/// Bytes waiting unread in the receive queue of one end of the agent's
/// connection to the server's agent port (`/proc/net/tcp`, established
/// sockets).
fn unread(agent_addr: SocketAddr, end: End) -> u64 {
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap();
    let port = format!(":{:04X}", agent_addr.port());
    let column = match end {
        End::Server => 1,
        End::Agent => 2,
    };
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let established = fields.get(3) == Some(&"01");
            let ours = fields.get(column).is_some_and(|a| a.ends_with(&port));
            let (_, rx) = fields.get(4)?.split_once(':')?;
            (established && ours).then(|| u64::from_str_radix(rx, 16).ok())?
        })
        .sum()
}

/// Runs the batch through `server` (gRPC mode, one agent: `agent`) and
/// returns the frontend's report: `TUNNELS` single-use tunnels to an echo
/// destination, their DIAL_REQs held by the stopped agent until the server
/// sent them all; the server frozen; the agent let go to answer every dial,
/// then killed; the server let go.
async fn answered_then_killed(server: &ServerProcess, mut agent: AgentProcess) -> FrontendReport {
    let echo = destination::echo().await;
    agent.signal("STOP");
    wait_stopped(agent.pid()).await;
    let args = vec![
        format!("-uds={}", server.uds.display()),
        "-kclient".to_owned(),
        "rate".to_owned(),
        format!("-addr={}", echo.addr),
        "-rate=1000".to_owned(),
        format!("-duration={TUNNELS}ms"),
        format!("-limit={}s", LIMIT.as_secs()),
    ];
    let run = tokio::spawn(grpc_go::run(args));
    server
        .wait_for_metric(DIAL_REQS_TO_AGENT, TUNNELS as f64, Duration::from_secs(20))
        .await;
    // Taken for the stream is not yet written: wait until the stopped
    // agent's socket holds them before the server stops too.
    wait_for("the DIAL_REQs to reach the stopped agent", || {
        unread(server.agent_addr, End::Agent) >= TUNNELS * DIAL_REQ_BYTES
    })
    .await;
    signal(server.pid(), "STOP");
    wait_stopped(server.pid()).await;
    agent.signal("CONT");
    wait_for("the agent to connect every dial", || {
        echo.open_connections() as u64 == TUNNELS
    })
    .await;
    wait_for("the agent's answers to reach the frozen server", || {
        unread(server.agent_addr, End::Server) >= TUNNELS * DIAL_RSP_BYTES
    })
    .await;
    agent.kill();
    signal(server.pid(), "CONT");
    let report = run.await.unwrap();
    println!("{report}");
    report
}

/// gRPC mode: every tunnel whose DIAL_RSP came before its agent died ends
/// (its CLOSE_RSP reaches the client once it knows the connection), none
/// is still open at the limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_close_right_behind_its_dial_answer_ends_kube_apiservers_request() {
    let server = ServerProcess::start("grpc", &[]).await;
    let agent = AgentProcess::spawn(server.agent_addr.port(), &[]);
    server.wait_for_agents(1).await;
    let report = answered_then_killed(&server, agent).await;
    report.assert_ok();
    // The agent answered the dials: the frontend had its connections, so
    // the close was the one that followed the answer closely.
    assert!(
        report.int("exchange_errors") > 0,
        "no tunnel was dialed: {report}"
    );
    assert_eq!(
        report.int("dials"),
        0,
        "a tunnel outlived its agent: {report}"
    );
    assert_eq!(
        report.int("over_limit"),
        0,
        "requests waited past {LIMIT:?} for a close they never got: {report}"
    );
}
