//! No dial fails that another agent could serve (issue 38): the real
//! proxy-server and proxy-agent binaries under `default`, driven by
//! kube-apiserver's own gRPC library (`tests/go/frontend`'s `rate` mode:
//! single-use tunnels at a steady rate, each a new grpc-go connection
//! exchanging 1 KiB with an echo destination).
//!
//! The agent that dies, vanishes or is slow runs in a network namespace of
//! its own ([`integration_tests::netns`]: the test runs in a hub namespace
//! with the server, the destination and two agents; the third agent's node
//! is joined to it by a veth pair). Its firewall holds its dials (every SYN
//! to the destination dropped: a dial waits, and never makes a connection
//! that a kill would cut) or slows them (the first SYN of each dropped: a
//! second per dial). The dropped SYNs are counted, so the test knows a dial
//! is pending on that agent before it kills it or cuts its link: the retry
//! is exercised, not left to luck. These need root, as CI has. P2C runs on
//! loopback.
//!
//! The server writes its audit log in the retry and hedge tests (issue
//! 45): each record's `retries` and `hedges` must add up to the server's
//! counters, and the dials retried or hedged away from the node's agent
//! must be recorded as carried by another.

#![allow(clippy::unwrap_used)] // tests: a panic is a failure report

use std::{net::SocketAddr, path::Path, process::Command, time::Duration};

use ops::audit::record::ServerTunnel;

use integration_tests::{
    LoggedProcess, Pki, agent_args, audit, binary,
    destination::{self, Destination},
    grpc_go::{self, Running},
    netns::{self, HUB_IP, Node},
    process::{AgentWithFiles, ServerProcess},
    wait_for,
};

/// Tunnels the frontend starts per second.
const RATE: u32 = 100;
/// How long it starts them.
const TRAFFIC: Duration = Duration::from_secs(6);
/// The retries counter, by reason.
const RETRIED_AGENT_GONE: &str = "konnectivity_rs_server_dial_retries_total{reason=\"agent_gone\"}";
/// Dials the server failed because their agent's stream ended.
const FAILED_BACKEND_CLOSE: &str =
    "konnectivity_network_proxy_server_dial_failure_count{reason=\"backend_close\"}";
/// Dials sent to a second agent, and those it won.
const HEDGES: &str = "konnectivity_rs_server_dial_hedges_total";
const HEDGES_WON: &str = "konnectivity_rs_server_dial_hedges_won_total";
/// The agent in the node, whose dials are held, slowed or cut.
const FAR: &str = "node-1";

/// An echo destination on the hub's end of the link, which the node's
/// agent reaches over it and the hub's agents locally.
async fn hub_echo() -> Destination {
    destination::spawn_on_any(HUB_IP, |mut stream| async move {
        let (mut r, mut w) = stream.split();
        let _ = tokio::io::copy(&mut r, &mut w).await;
    })
    .await
}

/// A real proxy-agent towards the server's agent port on [`HUB_IP`], in
/// the hub, or in `node`.
fn agent(pki: &Path, server: &ServerProcess, id: &str, node: Option<&Node>) -> LoggedProcess {
    let program = binary("proxy-agent");
    let mut command = match node {
        Some(node) => node.command(&program),
        None => Command::new(&program),
    };
    command
        .env("RUST_LOG", "info")
        .args(agent_args(pki, server.agent_addr.port()))
        .args([
            format!("--proxy-server-host={HUB_IP}"),
            format!("--agent-id={id}"),
        ]);
    LoggedProcess::spawn(command, id)
}

/// The server (gRPC mode, agent port on [`HUB_IP`], `flags`), two agents
/// in the hub and one, the returned third, in `node`, all connected; the
/// certificates name [`HUB_IP`].
async fn three_agents(
    pki: &Path,
    node: &Node,
    flags: &[&str],
) -> (ServerProcess, [LoggedProcess; 2], LoggedProcess) {
    certs::ClusterPki::generate(&[HUB_IP.to_string()])
        .unwrap()
        .write_to(pki)
        .unwrap();
    let flags: Vec<String> = flags.iter().map(|f| (*f).to_owned()).collect();
    let server = ServerProcess::start_on(pki, HUB_IP, "grpc", &flags).await;
    let hub = [
        agent(pki, &server, "hub-1", None),
        agent(pki, &server, "hub-2", None),
    ];
    let far = agent(pki, &server, FAR, Some(node));
    server
        .wait_for_agents_within(3, Duration::from_secs(30))
        .await;
    (server, hub, far)
}

/// The grpc-go frontend's `rate` mode to `dest` through `server`, for
/// [`TRAFFIC`] at [`RATE`], running on its own.
fn traffic(
    server: &ServerProcess,
    dest: SocketAddr,
) -> tokio::task::JoinHandle<grpc_go::FrontendReport> {
    let args = vec![
        format!("-uds={}", server.uds.display()),
        "rate".to_owned(),
        format!("-addr={dest}"),
        format!("-rate={RATE}"),
        format!("-duration={}ms", TRAFFIC.as_millis()),
    ];
    tokio::spawn(grpc_go::run(args))
}

/// Waits until the node's firewall dropped a SYN: a dial is pending on its
/// agent (held: until that agent's 5 s dial timeout).
async fn a_dial_pending_in(node: &Node) {
    let start = std::time::Instant::now();
    while node.dropped_syns() == 0 {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "the node's agent was sent no dial"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Every dial failure the server counted, whatever its reason.
async fn dial_failures(server: &ServerProcess) -> f64 {
    summed(
        server,
        "konnectivity_network_proxy_server_dial_failure_count{",
    )
    .await
}

/// The sum of the server's series that start with `prefix`.
async fn summed(server: &ServerProcess, prefix: &str) -> f64 {
    server
        .metrics()
        .await
        .lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

/// `--audit-log-path` in `dir`.
fn audit_flag(dir: &Path) -> String {
    format!("--audit-log-path={}", dir.join("server.jsonl").display())
}

/// Stops `server` (it writes every queued record before it exits) and
/// checks its audit records against its counters, read first: the
/// records' `retries` and `hedges` add up to the dials retried and
/// hedged, and each dial the server sent away from [`FAR`] is recorded as
/// carried by another agent. Returns the records that were (retried,
/// hedged) and carried.
async fn audited(server: &mut ServerProcess, dir: &Path) -> (usize, usize) {
    let retried = summed(server, "konnectivity_rs_server_dial_retries_total{").await;
    let hedged = server.metric(HEDGES).await;
    server.terminate(Duration::from_secs(30)).await;
    let (records, _) = audit::sides(&dir.join("server.jsonl"));
    assert!(!records.is_empty(), "no audit record");
    let retries: u32 = records.iter().map(|r| r.retries).sum();
    let hedges: u32 = records.iter().map(|r| r.hedges).sum();
    assert_eq!(f64::from(retries), retried, "retries in the records");
    assert_eq!(f64::from(hedges), hedged, "hedges in the records");
    let carried = |r: &ServerTunnel| {
        r.connection_id.is_some() && r.agent_id.as_deref().is_some_and(|a| a != FAR)
    };
    let count = |pick: fn(&ServerTunnel) -> bool| {
        let picked: Vec<&ServerTunnel> = records.iter().filter(|r| pick(r)).collect();
        let away = picked.iter().filter(|r| carried(r)).count();
        assert_eq!(away, picked.len(), "not carried elsewhere: {picked:#?}");
        away
    };
    (count(|r| r.retries > 0), count(|r| r.hedges > 0))
}

/// The agent in the node is killed (`kill -9`) while a dial waits for its
/// DIAL_RSP, under traffic at [`RATE`]; `retries` is
/// `--backend-dial-retries`; the server's audit log goes to `audit`.
/// Returns the frontend's report and the server.
async fn kill_with_a_dial_pending(
    node: Node,
    retries: u32,
    audit: &Path,
) -> (grpc_go::FrontendReport, ServerProcess) {
    let pki = tempfile::tempdir().unwrap();
    let (mut server, _hub, mut far) = three_agents(
        pki.path(),
        &node,
        &[
            &format!("--backend-dial-retries={retries}"),
            &audit_flag(audit),
        ],
    )
    .await;
    let echo = hub_echo().await;
    node.hold_dials_to(echo.addr);
    let run = traffic(&server, echo.addr);
    a_dial_pending_in(&node).await;
    far.signal("KILL");
    server
        .process
        .wait_for("agent disconnected", 1, Duration::from_secs(10))
        .await;
    let report = run.await.unwrap();
    println!("{report}");
    assert!(far.has_exited());
    (report, server)
}

/// (a) `kill -9` of one agent of three while dials flow: the dial pending
/// on it goes to another agent, and no dial fails.
#[test]
fn a_killed_agents_pending_dial_is_served_by_another() {
    netns::run_in_hub(
        "dial_retries::a_killed_agents_pending_dial_is_served_by_another",
        |node| async move {
            let dir = tempfile::tempdir().unwrap();
            let (report, mut server) = kill_with_a_dial_pending(node, 1, dir.path()).await;
            report.assert_ok();
            assert_eq!(report.int("dial_errors"), 0, "{report}");
            assert_eq!(report.int("exchange_errors"), 0, "{report}");
            assert!(report.int("dials") > 0, "{report}");
            assert!(server.metric(RETRIED_AGENT_GONE).await >= 1.0);
            assert_eq!(server.metric(FAILED_BACKEND_CLOSE).await, 0.0);
            assert_eq!(dial_failures(&server).await, 0.0);
            let (retried, _) = audited(&mut server, dir.path()).await;
            assert!(retried >= 1, "no record of a retried dial");
        },
    );
}

/// The same with `--backend-dial-retries=0` (ANP's behaviour): the dial
/// pending on the killed agent fails. What the test above would see if
/// retries did nothing.
#[test]
fn without_retries_a_killed_agents_pending_dial_fails() {
    netns::run_in_hub(
        "dial_retries::without_retries_a_killed_agents_pending_dial_fails",
        |node| async move {
            let dir = tempfile::tempdir().unwrap();
            let (report, server) = kill_with_a_dial_pending(node, 0, dir.path()).await;
            assert!(report.int("dial_errors") >= 1, "{report}");
            assert!(server.metric(FAILED_BACKEND_CLOSE).await >= 1.0);
            assert_eq!(server.metric(RETRIED_AGENT_GONE).await, 0.0);
        },
    );
}

/// (b) One agent's node is partitioned (its link down: no RST, no FIN)
/// while a dial waits on it: once the server's keepalive (1 s) finds the
/// agent dead, its dials go to the other agents, and none fails.
#[test]
fn a_partitioned_agents_pending_dials_are_served_once_keepalive_finds_it_dead() {
    netns::run_in_hub(
        "dial_retries::a_partitioned_agents_pending_dials_are_served_once_keepalive_finds_it_dead",
        |node| async move {
            let pki = tempfile::tempdir().unwrap();
            let (mut server, _hub, _far) =
                three_agents(pki.path(), &node, &["--keepalive-time=1s"]).await;
            let echo = hub_echo().await;
            node.hold_dials_to(echo.addr);
            let run = traffic(&server, echo.addr);
            a_dial_pending_in(&node).await;
            node.link("down");
            let found = server
                .process
                .wait_for("agent disconnected", 1, Duration::from_secs(15))
                .await;
            println!("the server dropped the partitioned agent after {found:?}");
            let report = run.await.unwrap();
            println!("{report}");
            report.assert_ok();
            assert_eq!(report.int("dial_errors"), 0, "{report}");
            assert_eq!(report.int("exchange_errors"), 0, "{report}");
            assert!(server.metric(RETRIED_AGENT_GONE).await >= 1.0);
            assert_eq!(dial_failures(&server).await, 0.0);
        },
    );
}

/// (c) One agent's dials take a second (its node drops the first SYN of
/// each): with `--backend-dial-hedge`, a dial that waits past the hedge
/// delay goes to a second agent too, which wins; every dial succeeds.
/// Latency is the bench's to measure (`--scenarios retries`), not this
/// test's.
#[test]
fn a_slow_agents_dials_are_hedged_and_won_elsewhere() {
    netns::run_in_hub(
        "dial_retries::a_slow_agents_dials_are_hedged_and_won_elsewhere",
        |node| async move {
            let pki = tempfile::tempdir().unwrap();
            let dir = tempfile::tempdir().unwrap();
            let audit = audit_flag(dir.path());
            let (mut server, _hub, _far) =
                three_agents(pki.path(), &node, &["--backend-dial-hedge", &audit]).await;
            let echo = hub_echo().await;
            node.slow_dials_to(echo.addr);
            let run = traffic(&server, echo.addr);
            a_dial_pending_in(&node).await;
            server
                .wait_for_metric_at_least(HEDGES_WON, 1.0, Duration::from_secs(20))
                .await;
            let report = run.await.unwrap();
            println!("{report}");
            report.assert_ok();
            assert_eq!(report.int("dial_errors"), 0, "{report}");
            assert_eq!(report.int("exchange_errors"), 0, "{report}");
            let hedges = server.metric(HEDGES).await;
            let won = server.metric(HEDGES_WON).await;
            println!(
                "{} SYNs held a second; {hedges} dials hedged, {won} won by the second agent",
                node.dropped_syns()
            );
            assert!(hedges >= won && won >= 1.0);
            assert_eq!(dial_failures(&server).await, 0.0);
            let (_, hedged) = audited(&mut server, dir.path()).await;
            assert!(hedged as f64 >= won, "{hedged} records of hedged dials");
        },
    );
}

/// Successful dials an agent made so far (its dial-latency histogram).
async fn dials_of(agent: &AgentWithFiles) -> f64 {
    integration_tests::process::metric_value(
        &agent.metrics().await,
        "konnectivity_network_proxy_agent_dial_duration_seconds_count",
    )
}

/// (d) The less loaded of two agents: one agent holds 100 long-lived
/// connections, two hold none; of 300 new single-use tunnels the two idle
/// agents get at least 80 % (a uniform pick would give them two thirds).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_dials_go_to_the_less_loaded_agents() {
    let server = ServerProcess::start("grpc", &[]).await;
    let pki = Pki::get().dir.path();
    let port = server.agent_addr.port();
    let busy = AgentWithFiles::start(pki, port).await;
    server.wait_for_agents(1).await;
    let echo = destination::echo().await;
    let uds = format!("-uds={}", server.uds.display());
    let addr = format!("-addr={}", echo.address());
    let (held, said) = Running::start(vec![
        uds.clone(),
        "many".to_owned(),
        addr.clone(),
        "-count=100".to_owned(),
    ])
    .await;
    assert_eq!(said["open"], 100);
    wait_for("100 connections at the destination", || {
        echo.open_connections() == 100
    })
    .await;
    let idle = [
        AgentWithFiles::start(pki, port).await,
        AgentWithFiles::start(pki, port).await,
    ];
    server.wait_for_agents(3).await;
    let before = dials_of(&busy).await;
    assert_eq!(before, 100.0);
    let report = grpc_go::run(vec![
        uds,
        "dials".to_owned(),
        addr,
        "-count=300".to_owned(),
        "-concurrency=4".to_owned(),
    ])
    .await;
    report.assert_ok();
    assert_eq!(report.int("errors"), 0, "{report}");
    let to_busy = dials_of(&busy).await - before;
    let to_idle = dials_of(&idle[0]).await + dials_of(&idle[1]).await;
    println!("of 300 dials: {to_busy} to the busy agent, {to_idle} to the two idle ones");
    assert_eq!(to_busy + to_idle, 300.0);
    assert!(to_idle >= 240.0, "the idle agents got {to_idle} of 300");
    assert!(held.finish().await.success());
}
