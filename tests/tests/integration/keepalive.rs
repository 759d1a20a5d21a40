//! A server that silently vanishes: the real binaries run in two network
//! namespaces this test creates, joined by a veth pair; taking the server's
//! end of the link down drops every packet without a RST or FIN. The agent
//! must notice through its keepalive pings and probe, drop the connection,
//! and reconnect once the link is back. Needs root (`ip netns`), as CI has.

#![allow(clippy::unwrap_used)] // tests: a panic is a failure report

use std::{process::Command, time::Duration};

use integration_tests::{LoggedProcess, binary};

const SERVER_IP: &str = "10.250.0.1";
const AGENT_IP: &str = "10.250.0.2";

fn ip(args: &[&str]) {
    let out = Command::new("ip")
        .args(args)
        .output()
        .expect("running ip (iproute2; scripts/test installs it)");
    assert!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Two namespaces, `server` and `agent`, linked by a veth pair; deleted on drop.
struct Namespaces {
    server: String,
    agent: String,
}

impl Namespaces {
    fn new() -> Self {
        let tag = std::process::id();
        let ns = Self {
            server: format!("krs-s-{tag}"),
            agent: format!("krs-a-{tag}"),
        };
        ip(&["netns", "add", &ns.server]);
        ip(&["netns", "add", &ns.agent]);
        // Created inside the server namespace, so no name touches the host.
        ip(&[
            "-n", &ns.server, "link", "add", "veth-s", "type", "veth", "peer", "name", "veth-a",
            "netns", &ns.agent,
        ]);
        for (name, dev, addr) in [
            (&ns.server, "veth-s", SERVER_IP),
            (&ns.agent, "veth-a", AGENT_IP),
        ] {
            ip(&["-n", name, "addr", "add", &format!("{addr}/30"), "dev", dev]);
            ip(&["-n", name, "link", "set", dev, "up"]);
            ip(&["-n", name, "link", "set", "lo", "up"]);
        }
        ns
    }

    fn server_link(&self, state: &str) {
        ip(&["-n", &self.server, "link", "set", "veth-s", state]);
    }
}

impl Drop for Namespaces {
    fn drop(&mut self) {
        for name in [&self.server, &self.agent] {
            let _ = Command::new("ip").args(["netns", "del", name]).status();
        }
    }
}

/// A workspace binary run in `namespace`, its stderr collected.
fn start_in(namespace: &str, name: &str, args: &[String]) -> LoggedProcess {
    let mut command = Command::new("ip");
    command
        .args(["netns", "exec", namespace])
        .arg(binary(name))
        .args(args);
    LoggedProcess::spawn(command, name)
}

/// The server in `ns`'s server namespace and an agent in its agent
/// namespace with `agent_flags`, both pinging every second; returns once
/// the agent is connected.
async fn server_and_agent(
    ns: &Namespaces,
    dir: &std::path::Path,
    agent_flags: &[&str],
) -> (LoggedProcess, LoggedProcess) {
    certs::ClusterPki::generate(&[SERVER_IP.to_owned()])
        .unwrap()
        .write_to(dir)
        .unwrap();
    let file = |name: &str| dir.join(name).display().to_string();
    let mut server = start_in(
        &ns.server,
        "proxy-server",
        &[
            format!("--uds-name={}", file("frontend.sock")),
            "--server-port=0".to_owned(),
            format!("--agent-bind-address={SERVER_IP}"),
            "--agent-port=0".to_owned(),
            "--health-port=0".to_owned(),
            "--admin-port=0".to_owned(),
            format!("--cluster-cert={}", file("cluster.crt")),
            format!("--cluster-key={}", file("cluster.key")),
            format!("--cluster-ca-cert={}", file("agent-ca.crt")),
            "--keepalive-time=1s".to_owned(),
        ],
    );
    let port = server
        .logged_port(&format!("agent.addr=Some({SERVER_IP}:"))
        .await;
    let mut args = vec![
        format!("--ca-cert={}", file("agent-ca.crt")),
        format!("--agent-cert={}", file("proxy-agent.crt")),
        format!("--agent-key={}", file("proxy-agent.key")),
        format!("--proxy-server-host={SERVER_IP}"),
        format!("--proxy-server-port={port}"),
        "--health-server-port=0".to_owned(),
        "--admin-server-port=0".to_owned(),
        "--keepalive-time=1s".to_owned(),
    ];
    args.extend(agent_flags.iter().map(|f| (*f).to_owned()));
    let mut agent = start_in(&ns.agent, "proxy-agent", &args);
    agent
        .wait_for("connected to proxy-server", 1, Duration::from_secs(30))
        .await;
    server
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
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_is_back_soon_after_a_partition_ends() {
    let ns = Namespaces::new();
    let dir = tempfile::tempdir().unwrap();
    let (mut server, mut agent) =
        server_and_agent(&ns, dir.path(), &["--sync-interval-cap=60s"]).await;
    ns.server_link("down");
    agent
        .wait_for("disconnected from proxy-server", 1, Duration::from_secs(10))
        .await;
    // Failed attempts while the link is down: "no route", or no answer.
    // (The limit only catches a stuck run.)
    agent
        .wait_for("will retry", 9, Duration::from_secs(180))
        .await;
    ns.server_link("up");
    let back = agent
        .wait_for("connected to proxy-server", 2, Duration::from_secs(60))
        .await;
    println!("agent back {back:?} after the link");
    assert!(
        back < Duration::from_secs(10),
        "the agent took {back:?} to come back: a grown backoff step"
    );
    server
        .wait_for("agent connected", 2, Duration::from_secs(10))
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_detects_a_silently_vanished_server_and_reconnects() {
    let ns = Namespaces::new();
    let dir = tempfile::tempdir().unwrap();
    let (mut server, mut agent) = server_and_agent(
        &ns,
        dir.path(),
        &[
            "--probe-interval=100ms",
            "--sync-interval=100ms",
            "--sync-interval-cap=1s",
        ],
    )
    .await;

    // The server's end goes dark: no RST, no FIN, nothing.
    ns.server_link("down");
    // Documented bound: --keepalive-time + min(--keepalive-time, 20s) +
    // --probe-interval = 2.1 s here; the limit leaves room for a slow machine.
    let took = agent
        .wait_for("disconnected from proxy-server", 1, Duration::from_secs(10))
        .await;
    println!("agent dropped the vanished server after {took:?}");
    // The server, pinging too, drops the agent on its side.
    server
        .wait_for("agent disconnected", 1, Duration::from_secs(10))
        .await;

    ns.server_link("up");
    // Reconnection rides on the sync loop's backoff (cap 1 s) and TCP's SYN
    // retransmissions for a connect that started while the link was down.
    agent
        .wait_for("connected to proxy-server", 2, Duration::from_secs(40))
        .await;
    server
        .wait_for("agent connected", 2, Duration::from_secs(10))
        .await;
}
