//! Several proxy-server replicas: an agent reaches all of them, behind one
//! TCP load balancer (a real haproxy) or given as an address list, and
//! keeps serving through the others while one is down. Also which agent a
//! dial goes to under `--proxy-strategies`.

#![allow(clippy::unwrap_used)] // tests: a panic is a failure report

use std::net::Ipv4Addr;

use integration_tests::{
    AgentOpts, ServerOpts, TestAgent, TestServer, destination, http_get, proxies, wait_for,
};
use proxy_server::strategy::ProxyStrategy;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Three servers that announce `servercount: 3`.
async fn three_servers() -> Vec<TestServer> {
    let mut servers = Vec::new();
    for i in 1..=3 {
        servers.push(
            TestServer::start_with(ServerOpts {
                server_id: Some(format!("server-{i}")),
                server_count: 3,
                ..ServerOpts::default()
            })
            .await,
        );
    }
    servers
}

/// A request through `server`'s frontend to `echo` comes back byte-exact.
async fn round_trip(server: &TestServer, echo: &destination::Destination) {
    let mut conn = server.dial(&echo.address()).await.unwrap();
    let sent = destination::pattern(64 * 1024, 7);
    conn.write_all(&sent).await.unwrap();
    let mut got = vec![0u8; sent.len()];
    conn.read_exact(&mut got).await.unwrap();
    assert!(got == sent, "echo through the tunnel differs");
    conn.finish().await.unwrap();
}

async fn wait_connected(agent: &TestAgent, servers: &[&TestServer]) {
    let handle = agent.handle.clone();
    let counts: Vec<_> = servers.iter().map(|s| s.handle.clone()).collect();
    let n = servers.len();
    wait_for(&format!("the agent to hold {n} server connections"), || {
        handle.server_connections() == n && counts.iter().all(|s| s.backend_count() == 1)
    })
    .await;
}

/// The agent keeps serving through the others while one server is down,
/// and reconnects to it when it comes back.
async fn survive_one_server_restart(agent: &TestAgent, mut servers: Vec<TestServer>) {
    let echo = destination::echo().await;
    wait_connected(agent, &servers.iter().collect::<Vec<_>>()).await;
    for server in &servers {
        round_trip(server, &echo).await;
    }

    let halted = servers.remove(1).halt().await;
    let handle = agent.handle.clone();
    wait_for("the agent to drop the stopped server", || {
        handle.server_connections() == 2
    })
    .await;
    for server in &servers {
        round_trip(server, &echo).await;
    }

    servers.insert(1, halted.start().await);
    wait_connected(agent, &servers.iter().collect::<Vec<_>>()).await;
    for server in &servers {
        round_trip(server, &echo).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_reaches_every_server_in_an_address_list() {
    let servers = three_servers().await;
    let agent = TestAgent::start_with(
        servers[0].agent_addr,
        AgentOpts {
            more_servers: vec![servers[1].agent_addr, servers[2].agent_addr],
            ..AgentOpts::default()
        },
    )
    .await;
    survive_one_server_restart(&agent, servers).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listed_server_is_connected_even_when_the_count_is_already_met() {
    // Servers that (wrongly) announce a count of 1: every listed address
    // still gets a connection.
    let mut servers = Vec::new();
    for i in 1..=2 {
        servers.push(
            TestServer::start_with(ServerOpts {
                server_id: Some(format!("lonely-{i}")),
                ..ServerOpts::default()
            })
            .await,
        );
    }
    let agent = TestAgent::start_with(
        servers[0].agent_addr,
        AgentOpts {
            more_servers: vec![servers[1].agent_addr],
            ..AgentOpts::default()
        },
    )
    .await;
    wait_connected(&agent, &[&servers[0], &servers[1]]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_finds_all_three_servers_behind_a_load_balancer() {
    let servers = three_servers().await;
    let addrs: Vec<_> = servers.iter().map(|s| s.agent_addr).collect();
    let lb = proxies::haproxy(Ipv4Addr::LOCALHOST.into(), &addrs).await;
    let agent = TestAgent::start_with(lb.addr, AgentOpts::default()).await;
    survive_one_server_restart(&agent, servers).await;
    drop(lb);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sync_forever_finds_servers_beyond_the_announced_count() {
    // Two servers that both announce a count of 1 behind one address: only
    // --sync-forever keeps dialing, and so finds the second.
    let mut servers = Vec::new();
    for i in 1..=2 {
        servers.push(
            TestServer::start_with(ServerOpts {
                server_id: Some(format!("undercounted-{i}")),
                ..ServerOpts::default()
            })
            .await,
        );
    }
    let addrs: Vec<_> = servers.iter().map(|s| s.agent_addr).collect();
    let lb = proxies::haproxy(Ipv4Addr::LOCALHOST.into(), &addrs).await;
    let agent = TestAgent::start_with(
        lb.addr,
        AgentOpts {
            sync_forever: true,
            ..AgentOpts::default()
        },
    )
    .await;
    wait_connected(&agent, &[&servers[0], &servers[1]]).await;
    drop(lb);
}

/// Which of `agents` holds the connection now open.
fn serving(agents: &[(&str, &TestAgent)]) -> Vec<String> {
    agents
        .iter()
        .filter(|(_, a)| a.handle.endpoint_connections() > 0)
        .map(|(name, _)| (*name).to_owned())
        .collect()
}

async fn routed_to(server: &TestServer, address: &str, agents: &[(&str, &TestAgent)]) -> String {
    let mut conn = server.dial(address).await.unwrap();
    conn.write_all(b"which").await.unwrap();
    let mut got = [0u8; 5];
    conn.read_exact(&mut got).await.unwrap();
    let who = serving(agents);
    conn.finish().await.unwrap();
    let handles: Vec<_> = agents.iter().map(|(_, a)| a.handle.clone()).collect();
    wait_for("the connection to close on the agent", || {
        handles.iter().all(|h| h.endpoint_connections() == 0)
    })
    .await;
    assert_eq!(who.len(), 1, "{address}: served by {who:?}");
    who.into_iter().next().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dest_host_cidr_and_default_route_pick_the_right_agent() {
    let server = TestServer::start_with(ServerOpts {
        strategies: vec![ProxyStrategy::DestHost, ProxyStrategy::DefaultRoute],
        ..ServerOpts::default()
    })
    .await;
    let start = |identifiers: &str| {
        TestAgent::start_with(
            server.agent_addr,
            AgentOpts {
                identifiers: identifiers.to_owned(),
                ..AgentOpts::default()
            },
        )
    };
    let exact = start("host=localhost&ipv4=127.0.0.2").await;
    let net = start("cidr=127.0.0.0%2F24").await;
    let wide = start("cidr=127.0.0.0%2F16").await;
    let gateway = start("default-route=true").await;
    server.wait_for_backends(4).await;
    let agents = [
        ("exact", &exact),
        ("net", &net),
        ("wide", &wide),
        ("gateway", &gateway),
    ];

    let local = destination::echo().await;
    let two = destination::echo_on(Ipv4Addr::new(127, 0, 0, 2)).await;
    let three = destination::echo_on(Ipv4Addr::new(127, 0, 0, 3)).await;
    let far = destination::echo_on(Ipv4Addr::new(127, 0, 1, 1)).await;
    let outside = destination::echo_on(Ipv4Addr::new(127, 1, 0, 1)).await;
    let port = local.addr.port();

    // destHost: the host name and the ipv4 identifier match exactly.
    assert_eq!(
        routed_to(&server, &format!("localhost:{port}"), &agents).await,
        "exact"
    );
    assert_eq!(routed_to(&server, &two.address(), &agents).await, "exact");
    // cidr: the longest prefix that contains the destination.
    assert_eq!(routed_to(&server, &three.address(), &agents).await, "net");
    assert_eq!(routed_to(&server, &far.address(), &agents).await, "wide");
    // No identifier matches: on to defaultRoute.
    assert_eq!(
        routed_to(&server, &outside.address(), &agents).await,
        "gateway"
    );

    // Without the gateway nothing takes unmatched destinations.
    gateway.stop().await;
    server.wait_for_backends(3).await;
    let err = server.dial(&outside.address()).await.err().unwrap();
    assert!(
        err.to_string().contains(proxy_server::NO_AGENT),
        "unexpected error: {err}"
    );
    assert_eq!(
        routed_to(
            &server,
            &three.address(),
            &[("exact", &exact), ("net", &net), ("wide", &wide)]
        )
        .await,
        "net"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_follows_the_first_strategy_while_dials_fall_through() {
    let server = TestServer::start_with(ServerOpts {
        strategies: vec![ProxyStrategy::DestHost, ProxyStrategy::Default],
        ..ServerOpts::default()
    })
    .await;
    let plain = TestAgent::start(&server).await;
    // Served through `default`, yet not ready: no agent has a destHost key.
    let echo = destination::echo().await;
    round_trip(&server, &echo).await;
    assert!(!server.handle.is_ready());
    assert_ne!(http_get(server.health_addr, "/readyz").await.0, 200);

    let named = TestAgent::start_with(
        server.agent_addr,
        AgentOpts {
            identifiers: "host=node-1".to_owned(),
            ..AgentOpts::default()
        },
    )
    .await;
    server.wait_for_backends(2).await;
    assert!(server.handle.is_ready());
    assert_eq!(http_get(server.health_addr, "/readyz").await.0, 200);
    drop((plain, named));
}
