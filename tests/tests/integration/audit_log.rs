//! Issue 45, item 2 (and the audit half of item 4): with `--audit-log-path`
//! on both, every frontend dial leaves exactly one record on the server and
//! one on the agent, whichever way it ends, and the two agree. The
//! processes write every queued record before they exit: stopping them is
//! the barrier before the files are read.

#![allow(clippy::unwrap_used)] // tests: a panic is a failure report

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use client::dial::{ClientError, dial, uds_channel};
use integration_tests::{
    AgentOpts, DEADLINE, LoggedProcess, Pki, RawFrontend, ServerOpts, TestAgent, TestServer,
    agent_args,
    audit::sides,
    binary,
    destination::{self, Blackhole},
    process::ServerProcess,
    wait_for,
};
use ops::audit::record::{
    AgentEnd, AgentTunnel, DestinationVerdict, EndedBy, ServerEnd, ServerTunnel,
};
use proto::Packet;
use proxy_server::config::Mode;
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::UnixStream,
};

/// What the test did with one tunnel, and so what both records must say.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    /// Echoed 100 bytes, then the frontend closed.
    ClosedByFrontend,
    /// The destination sent 1000 bytes and closed.
    ClosedByDestination,
    /// Dialed a closed port.
    Failed,
    /// Denied by the agent's policy.
    Denied,
}

/// Runs one tunnel of `kind`; the destination it dialed.
async fn tunnel(
    channel: &tonic::transport::Channel,
    kind: Kind,
    (echo, download): (&str, &str),
) -> String {
    match kind {
        Kind::ClosedByFrontend => {
            let mut conn = dial(channel.clone(), echo).await.unwrap();
            conn.write_all(&[7u8; 100]).await.unwrap();
            let mut got = [0u8; 100];
            conn.read_exact(&mut got).await.unwrap();
            conn.finish().await.unwrap();
            echo.to_owned()
        }
        Kind::ClosedByDestination => {
            let mut conn = dial(channel.clone(), download).await.unwrap();
            let mut got = Vec::new();
            conn.read_to_end(&mut got).await.unwrap();
            assert_eq!(got.len(), 1000);
            let _ = conn.finish().await;
            download.to_owned()
        }
        Kind::Failed => {
            let closed = destination::closed_port().to_string();
            let error = dial(channel.clone(), &closed).await.err().unwrap();
            assert!(matches!(error, ClientError::Dial { .. }), "{error:?}");
            closed
        }
        Kind::Denied => {
            let denied = "127.0.0.2:1".to_owned();
            let error = dial(channel.clone(), &denied).await.err().unwrap();
            assert!(matches!(error, ClientError::Dial { .. }), "{error:?}");
            denied
        }
    }
}

/// Checks that the server's and the agent's records of one tunnel agree
/// with each other and with what was done.
fn check_pair(kind: Kind, destination: &str, server: &ServerTunnel, agent: &AgentTunnel) {
    let what = format!("{kind:?}: {server:?} / {agent:?}");
    assert_eq!(server.destination, destination, "{what}");
    assert_eq!(agent.destination, destination, "{what}");
    assert_eq!(server.connection_id, agent.connection_id, "{what}");
    assert_eq!(
        server.agent_id.as_deref(),
        Some(agent.agent_id.as_str()),
        "{what}"
    );
    assert_eq!(agent.server_id, server.server_id, "{what}");
    assert_eq!(server.bytes_to_agent, agent.bytes_to_endpoint, "{what}");
    assert_eq!(server.bytes_to_frontend, agent.bytes_to_server, "{what}");
    assert!(server.frontend_peer.starts_with("unix:"), "{what}");
    let expected = match kind {
        Kind::ClosedByFrontend => (
            (ServerEnd::Closed, EndedBy::Frontend),
            (AgentEnd::ServerClosed, EndedBy::Server),
            (100, 100),
        ),
        Kind::ClosedByDestination => (
            (ServerEnd::Closed, EndedBy::Destination),
            (AgentEnd::EndpointClosed, EndedBy::Destination),
            (0, 1000),
        ),
        Kind::Failed => (
            (ServerEnd::DialFailed, EndedBy::Agent),
            (AgentEnd::DialFailed, EndedBy::Destination),
            (0, 0),
        ),
        Kind::Denied => (
            (ServerEnd::Denied, EndedBy::Agent),
            (AgentEnd::Denied, EndedBy::Agent),
            (0, 0),
        ),
    };
    assert_eq!((server.end, server.ended_by), expected.0, "{what}");
    assert_eq!((agent.end, agent.ended_by), expected.1, "{what}");
    assert_eq!(
        (server.bytes_to_agent, server.bytes_to_frontend),
        expected.2,
        "{what}"
    );
    let established = matches!(kind, Kind::ClosedByFrontend | Kind::ClosedByDestination);
    assert_eq!(server.connection_id.is_some(), established, "{what}");
    if kind == Kind::Denied {
        assert_eq!(agent.verdict, DestinationVerdict::Deny, "{what}");
        assert_eq!(agent.rule.as_deref(), Some("deny 127.0.0.2"), "{what}");
        assert_eq!(agent.resolved.as_deref(), Some("127.0.0.2:1"), "{what}");
    } else {
        assert_eq!(agent.verdict, DestinationVerdict::Allow, "{what}");
    }
}

/// The records of each side, by dial id; panics on a dial id recorded
/// twice on one side.
fn by_dial(path: &Path) -> (HashMap<i64, ServerTunnel>, HashMap<i64, AgentTunnel>) {
    let (server, agent) = sides(path);
    let mut servers = HashMap::new();
    for record in server {
        let id = record.dial_id;
        assert!(
            servers.insert(id, record).is_none(),
            "two server records of dial {id}"
        );
    }
    let mut agents = HashMap::new();
    for record in agent {
        let id = record.dial_id;
        assert!(
            agents.insert(id, record).is_none(),
            "two agent records of dial {id}"
        );
    }
    (servers, agents)
}

#[tokio::test]
async fn every_tunnel_has_one_record_per_side_and_they_agree() {
    const TUNNELS: usize = 200;
    let dir = tempfile::tempdir().unwrap();
    let server_log = dir.path().join("server.jsonl");
    let agent_log = dir.path().join("agent.jsonl");
    let policy = dir.path().join("policy");
    std::fs::write(&policy, "deny 127.0.0.2\n").unwrap();
    let mut server = ServerProcess::start(
        "grpc",
        &[format!("--audit-log-path={}", server_log.display())],
    )
    .await;
    let mut command = Command::new(binary("proxy-agent"));
    command
        .env("RUST_LOG", "info")
        .args(agent_args(Pki::get().dir.path(), server.agent_addr.port()))
        .arg(format!("--destination-policy-file={}", policy.display()))
        .arg(format!("--audit-log-path={}", agent_log.display()));
    let mut agent = LoggedProcess::spawn(command, "proxy-agent");
    server.wait_for_agents(1).await;

    let echo = destination::echo().await;
    let download = destination::download(1000).await;
    let channel = uds_channel(&server.uds).await.unwrap();
    let mut done = Vec::new();
    for i in 0..TUNNELS {
        let kind = match i % 3 {
            _ if i == 5 => Kind::Denied,
            0 => Kind::ClosedByFrontend,
            1 => Kind::ClosedByDestination,
            _ => Kind::Failed,
        };
        let to = tunnel(&channel, kind, (&echo.address(), &download.address())).await;
        done.push((kind, to));
    }
    wait_for("every destination connection to close", || {
        echo.open_connections() == 0 && download.open_connections() == 0
    })
    .await;
    drop(channel);
    // The barrier: both write every record before they exit.
    // (The agent's first SIGTERM drains it, the second stops it.)
    agent.signal("TERM");
    agent.wait_for("draining", 1, DEADLINE).await;
    agent.signal("TERM");
    wait_for("the agent to exit", || agent.has_exited()).await;
    server.terminate(Duration::from_secs(30)).await;

    let (servers, agents) = by_dial(&server_log);
    let (_, agent_only) = by_dial(&agent_log);
    assert!(agents.is_empty(), "agent records in the server's log");
    assert_eq!(servers.len(), TUNNELS, "server records");
    assert_eq!(agent_only.len(), TUNNELS, "agent records");
    // The test's dials in order of their start on the server.
    let mut ordered: Vec<&ServerTunnel> = servers.values().collect();
    ordered.sort_by_key(|r| r.start);
    for ((kind, to), server) in done.iter().zip(ordered) {
        let agent = agent_only
            .get(&server.dial_id)
            .unwrap_or_else(|| panic!("no agent record of {server:?}"));
        check_pair(*kind, to, server, agent);
    }
}

/// A server of `mode` and its agent, both with an audit log in `dir`.
async fn pair(dir: &Path, mode: Mode) -> (TestServer, TestAgent, PathBuf, PathBuf) {
    let name = format!("{mode:?}");
    let server_log = dir.join(format!("{name}-server.jsonl"));
    let agent_log = dir.join(format!("{name}-agent.jsonl"));
    let server = TestServer::start_with(ServerOpts {
        mode,
        audit_log: Some(server_log.clone()),
        ..Default::default()
    })
    .await;
    let agent = TestAgent::start_with(
        server.agent_addr,
        AgentOpts {
            audit_log: Some(agent_log.clone()),
            ..Default::default()
        },
    )
    .await;
    server.wait_for_backends(1).await;
    (server, agent, server_log, agent_log)
}

/// The one record each side wrote, checked to say the frontend gave up.
fn assert_abandoned(server_log: &Path, agent_log: &Path, what: &str) {
    let (servers, _) = by_dial(server_log);
    let (_, agents) = by_dial(agent_log);
    assert_eq!(servers.len(), 1, "{what}: {servers:?}");
    assert_eq!(agents.len(), 1, "{what}: {agents:?}");
    let (id, server) = servers.into_iter().next().unwrap();
    let agent = &agents[&id];
    assert_eq!(
        (server.end, server.ended_by),
        (ServerEnd::AbandonedByFrontend, EndedBy::Frontend),
        "{what}: {server:?}"
    );
    assert_eq!(server.connection_id, None, "{what}");
    assert_eq!(
        (agent.end, agent.ended_by),
        (AgentEnd::DialCancelled, EndedBy::Server),
        "{what}: {agent:?}"
    );
    assert_eq!(agent.connection_id, None, "{what}");
    assert_eq!(agent.destination, server.destination, "{what}");
}

#[tokio::test]
async fn a_frontend_that_gives_up_mid_dial_leaves_nothing_but_records_saying_so() {
    let dir = tempfile::tempdir().unwrap();
    let hole = Blackhole::new();
    let target = hole.addr.to_string();
    // gRPC: DIAL_CLS, then a stream that goes away, each before DIAL_RSP.
    for drop_stream in [false, true] {
        let sub = dir.path().join(format!("grpc-{drop_stream}"));
        std::fs::create_dir(&sub).unwrap();
        let (server, agent, server_log, agent_log) = pair(&sub, Mode::Grpc).await;
        let frontend = RawFrontend::open(&server, Packet::dial_request("tcp", &target, 42)).await;
        wait_for("the dial to be pending on server and agent", || {
            server.handle.pending_dials() == 1 && agent.handle.dials_in_progress() == 1
        })
        .await;
        if drop_stream {
            drop(frontend);
        } else {
            frontend.send(Packet::close_dial(42)).await;
        }
        wait_for("the pending dial to be cancelled everywhere", || {
            server.handle.pending_dials() == 0 && agent.handle.dials_in_progress() == 0
        })
        .await;
        assert_eq!(agent.handle.endpoint_connections(), 0);
        agent.stop().await;
        server.stop().await;
        let what = if drop_stream {
            "stream gone"
        } else {
            "DIAL_CLS"
        };
        assert_abandoned(&server_log, &agent_log, what);
    }
    // HTTP CONNECT: the client closes before the 200.
    let (server, agent, server_log, agent_log) = pair(dir.path(), Mode::HttpConnect).await;
    let mut io = UnixStream::connect(&server.uds).await.unwrap();
    let request = format!("CONNECT {target} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n");
    io.write_all(request.as_bytes()).await.unwrap();
    wait_for("the dial to be pending on server and agent", || {
        server.handle.pending_dials() == 1 && agent.handle.dials_in_progress() == 1
    })
    .await;
    drop(io);
    wait_for("the pending dial to be cancelled everywhere", || {
        server.handle.pending_dials() == 0 && agent.handle.dials_in_progress() == 0
    })
    .await;
    assert_eq!(server.handle.established_connections(), 0);
    assert_eq!(agent.handle.endpoint_connections(), 0);
    agent.stop().await;
    server.stop().await;
    assert_abandoned(&server_log, &agent_log, "CONNECT client gone");
}

#[tokio::test]
async fn a_tcp_frontends_record_names_its_address_and_certificate_subject() {
    let dir = tempfile::tempdir().unwrap();
    let echo = destination::echo().await;
    for mode in [Mode::Grpc, Mode::HttpConnect] {
        let server_log = dir.path().join(format!("{mode:?}-tcp.jsonl"));
        let server = TestServer::start_with(ServerOpts {
            mode,
            tcp_frontend: true,
            audit_log: Some(server_log.clone()),
            ..Default::default()
        })
        .await;
        let agent = TestAgent::start(&server).await;
        server.wait_for_backends(1).await;
        let mut conn = server.dialer().dial(&echo.address()).await.unwrap();
        conn.write_all(b"ping").await.unwrap();
        let mut got = [0u8; 4];
        conn.read_exact(&mut got).await.unwrap();
        drop(conn);
        wait_for("the tunnel to close", || echo.open_connections() == 0).await;
        agent.stop().await;
        server.stop().await;
        let (records, _) = sides(&server_log);
        assert_eq!(records.len(), 1, "{mode:?}: {records:?}");
        let record = &records[0];
        assert!(
            record.frontend_peer.starts_with("127.0.0.1:"),
            "{mode:?}: {record:?}"
        );
        assert!(
            record
                .frontend_subject
                .as_deref()
                .is_some_and(|s| s.contains("CN=")),
            "{mode:?}: {record:?}"
        );
    }
}

/// One open tunnel to `echo` (100 bytes echoed) and one dial pending on
/// `hole`, through `server`; the tunnel and the frontend holding the dial.
async fn one_open_one_pending(
    server: &TestServer,
    agent: &TestAgent,
    echo: &str,
    hole: &str,
) -> (client::dial::TunnelConn, RawFrontend) {
    let channel = uds_channel(&server.uds).await.unwrap();
    let mut open = dial(channel, echo).await.unwrap();
    open.write_all(&[7u8; 100]).await.unwrap();
    let mut got = [0u8; 100];
    open.read_exact(&mut got).await.unwrap();
    let pending = RawFrontend::open(server, Packet::dial_request("tcp", hole, 42)).await;
    wait_for("the dial to be pending on server and agent", || {
        server.handle.pending_dials() == 1 && agent.handle.dials_in_progress() == 1
    })
    .await;
    (open, pending)
}

/// How each record ended, by its destination.
type Ends<E> = HashMap<String, (E, EndedBy)>;

/// The ends recorded on each side, once both stopped.
fn ends(server_log: &Path, agent_log: &Path) -> (Ends<ServerEnd>, Ends<AgentEnd>) {
    let (servers, _) = sides(server_log);
    let (_, agents) = sides(agent_log);
    assert_eq!(
        (servers.len(), agents.len()),
        (2, 2),
        "{servers:?} / {agents:?}"
    );
    (
        servers
            .into_iter()
            .map(|r| (r.destination, (r.end, r.ended_by)))
            .collect(),
        agents
            .into_iter()
            .map(|r| (r.destination, (r.end, r.ended_by)))
            .collect(),
    )
}

/// Whichever process stops, its records of what was open or pending say
/// it shut down, and the other's say the stream went away under them.
#[tokio::test]
async fn what_a_shutdown_ends_is_recorded_as_that_sides_shutdown() {
    let dir = tempfile::tempdir().unwrap();
    let echo = destination::echo().await;
    let hole = Blackhole::new();
    let (echo, hole) = (echo.address(), hole.addr.to_string());
    for agent_stops in [true, false] {
        let sub = dir.path().join(format!("agent-stops-{agent_stops}"));
        std::fs::create_dir(&sub).unwrap();
        let (server, agent, server_log, agent_log) = pair(&sub, Mode::Grpc).await;
        let held = one_open_one_pending(&server, &agent, &echo, &hole).await;
        if agent_stops {
            agent.stop().await;
            wait_for("the server to see the agent go", || {
                server.handle.pending_dials() == 0
            })
            .await;
            server.stop().await;
        } else {
            server.stop().await;
            agent.stop().await;
        }
        drop(held);
        let (server_ends, agent_ends) = ends(&server_log, &agent_log);
        let (on_server, on_agent) = if agent_stops {
            (
                (ServerEnd::AgentGone, EndedBy::Agent),
                (AgentEnd::Shutdown, EndedBy::Agent),
            )
        } else {
            (
                (ServerEnd::Shutdown, EndedBy::Server),
                (AgentEnd::StreamGone, EndedBy::Server),
            )
        };
        for to in [&echo, &hole] {
            let what = format!("agent stops: {agent_stops}, {to}");
            assert_eq!(server_ends[to.as_str()], on_server, "{what}");
            // The pending dial is cancelled on the agent when its server
            // goes: not a connection's end.
            let on_agent = if to == &hole && !agent_stops {
                (AgentEnd::DialCancelled, EndedBy::Server)
            } else {
                on_agent
            };
            assert_eq!(agent_ends[to.as_str()], on_agent, "{what}");
        }
    }
}
