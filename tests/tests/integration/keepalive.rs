//! A server that silently vanishes: the real binaries run in two network
//! namespaces this test creates ([`integration_tests::netns`]: the server
//! in the hub, where the test runs, the agent in the node, joined by a
//! veth pair); taking the hub's end of the link down drops every packet
//! without a RST or FIN. The agent must notice through its keepalive pings
//! and probe, drop the connection, and reconnect once the link is back.
//! Needs root (`ip netns`), as CI has.

#![allow(clippy::unwrap_used)] // tests: a panic is a failure report

use std::time::Duration;

use integration_tests::{
    LoggedProcess, binary,
    netns::{self, HUB_IP, Node},
    process::ServerProcess,
};

/// The server in the hub, its agent port on [`HUB_IP`], and an agent in
/// `node` with `agent_flags`, both pinging every second; returns once the
/// agent is connected.
async fn server_and_agent(
    node: &Node,
    dir: &std::path::Path,
    agent_flags: &[&str],
) -> (ServerProcess, LoggedProcess) {
    certs::ClusterPki::generate(&[HUB_IP.to_string()])
        .unwrap()
        .write_to(dir)
        .unwrap();
    let file = |name: &str| dir.join(name).display().to_string();
    let mut server =
        ServerProcess::start_on(dir, HUB_IP, "grpc", &["--keepalive-time=1s".to_owned()]).await;
    let mut command = node.command(&binary("proxy-agent"));
    command
        .args([
            format!("--ca-cert={}", file("agent-ca.crt")),
            format!("--agent-cert={}", file("proxy-agent.crt")),
            format!("--agent-key={}", file("proxy-agent.key")),
            format!("--proxy-server-host={HUB_IP}"),
            format!("--proxy-server-port={}", server.agent_addr.port()),
            "--health-server-port=0".to_owned(),
            "--admin-server-port=0".to_owned(),
            "--keepalive-time=1s".to_owned(),
        ])
        .args(agent_flags);
    let mut agent = LoggedProcess::spawn(command, "proxy-agent");
    agent
        .wait_for("connected to proxy-server", 1, Duration::from_secs(30))
        .await;
    server
        .process
        .wait_for("agent connected", 1, Duration::from_secs(10))
        .await;
    (server, agent)
}

/// A partition long enough for a growing backoff to grow far: the agent,
/// retrying an unreachable server as it retries a refusing one, is back
/// within about one `--sync-interval` (1 s by default) of the link's
/// return, not after a grown backoff step.
///
/// The bound is the feature, so the test widens the gap it stands in:
/// with `--sync-interval-cap=60s` and the link back right after the 9th
/// failed attempt, an agent that grew its step on each failure (×1.5 from
/// 1 s, each wait in the upper half of the step) would wait at least half
/// of 1.5⁸ s ≈ 25.6 s, so 12.8 s, before its next try. With the feature
/// it waits at most 1 s, plus about 1 s when that try was sent into the
/// dark just before the link returned (TCP's first SYN retransmission):
/// about 2 s, a fifth of the 10 s bound.
#[test]
fn an_agent_is_back_soon_after_a_partition_ends() {
    netns::run_in_hub(
        "keepalive::an_agent_is_back_soon_after_a_partition_ends",
        |node| async move {
            let dir = tempfile::tempdir().unwrap();
            let (mut server, mut agent) =
                server_and_agent(&node, dir.path(), &["--sync-interval-cap=60s"]).await;
            node.hub_link("down");
            agent
                .wait_for("disconnected from proxy-server", 1, Duration::from_secs(10))
                .await;
            // Failed attempts while the link is down: "no route", or no answer.
            // (The limit only catches a stuck run.)
            agent
                .wait_for("will retry", 9, Duration::from_secs(180))
                .await;
            node.hub_link("up");
            let back = agent
                .wait_for("connected to proxy-server", 2, Duration::from_secs(60))
                .await;
            println!("agent back {back:?} after the link");
            assert!(
                back < Duration::from_secs(10),
                "the agent took {back:?} to come back: a grown backoff step"
            );
            server
                .process
                .wait_for("agent connected", 2, Duration::from_secs(10))
                .await;
        },
    );
}

#[test]
fn an_agent_detects_a_silently_vanished_server_and_reconnects() {
    netns::run_in_hub(
        "keepalive::an_agent_detects_a_silently_vanished_server_and_reconnects",
        |node| async move {
            let dir = tempfile::tempdir().unwrap();
            let (mut server, mut agent) = server_and_agent(
                &node,
                dir.path(),
                &[
                    "--probe-interval=100ms",
                    "--sync-interval=100ms",
                    "--sync-interval-cap=1s",
                ],
            )
            .await;

            // The server's end goes dark: no RST, no FIN, nothing.
            node.hub_link("down");
            // Documented bound: --keepalive-time + min(--keepalive-time, 20s) +
            // --probe-interval = 2.1 s here; the limit leaves room for a slow machine.
            let took = agent
                .wait_for("disconnected from proxy-server", 1, Duration::from_secs(10))
                .await;
            println!("agent dropped the vanished server after {took:?}");
            // The server, pinging too, drops the agent on its side.
            server
                .process
                .wait_for("agent disconnected", 1, Duration::from_secs(10))
                .await;

            node.hub_link("up");
            // Reconnection rides on the sync loop's backoff (cap 1 s) and TCP's SYN
            // retransmissions for a connect that started while the link was down.
            agent
                .wait_for("connected to proxy-server", 2, Duration::from_secs(40))
                .await;
            server
                .process
                .wait_for("agent connected", 2, Duration::from_secs(10))
                .await;
        },
    );
}
