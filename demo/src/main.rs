//! The main job on one machine, no arguments: fresh certificates, a backend,
//! proxy-server and proxy-agent on loopback, and one request through the
//! tunnel in each frontend mode (gRPC, HTTP-CONNECT), printing each step.

use std::{net::SocketAddr, path::Path, time::Duration};

use anyhow::{Context, Result, bail};
use client::dial::{Dialer, Transport};
use proxy_agent::agent::Agent;
use proxy_server::{
    config::{Config, FrontendListen, ListenerTls, Mode},
    server::ProxyServer,
    strategy::ProxyStrategy,
};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpListener,
};
use tokio_util::sync::CancellationToken;
use tunnel::ids::ServerId;

const BODY: &str = "hello from the node side\n";

#[tokio::main]
async fn main() -> Result<()> {
    let dir = tempfile::tempdir().context("creating a temporary directory")?;
    let written = certs::ClusterPki::generate(&[])
        .context("generating certificates")?
        .write_to(dir.path())
        .context("writing certificates")?;
    println!(
        "1. made a CA and {} certificate files in {}",
        written.len(),
        dir.path().display()
    );
    let backend_addr = backend().await?;
    println!("2. backend (a tiny HTTP server) listening on {backend_addr}");
    for (step, mode) in [(3, Mode::Grpc), (5, Mode::HttpConnect)] {
        through_tunnel(step, mode, dir.path(), backend_addr).await?;
    }
    println!("7. stopped proxy-agents and proxy-servers; all good");
    Ok(())
}

/// A tiny HTTP server answering [`BODY`] to every request.
async fn backend() -> Result<SocketAddr> {
    let backend = TcpListener::bind("127.0.0.1:0").await?;
    let addr = backend.local_addr()?;
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = backend.accept().await {
            tokio::spawn(async move {
                let mut buf = [0u8; 1024];
                let _ = stream.read(&mut buf).await;
                let reply = format!(
                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{BODY}",
                    BODY.len()
                );
                let _ = stream.write_all(reply.as_bytes()).await;
            });
        }
    });
    Ok(addr)
}

/// Steps `step` and `step + 1`: a proxy-server in `mode` and an agent, one
/// GET through them to `backend`, then both stopped.
async fn through_tunnel(step: u32, mode: Mode, dir: &Path, backend: SocketAddr) -> Result<()> {
    let name = match mode {
        Mode::Grpc => "grpc",
        Mode::HttpConnect => "http-connect",
    };
    let socket = dir.join(format!("konnectivity-server-{name}.socket"));
    let server = ProxyServer::bind(server_config(mode, name, &socket, dir)?).await?;
    let agent_addr = server.agent_addr();
    let handle = server.handle();
    let stop = CancellationToken::new();
    let server_task = tokio::spawn(server.serve(stop.clone().cancelled_owned()));
    println!(
        "{step}. proxy-server --mode={name}: frontend on {}, agents on {agent_addr} (mTLS)",
        socket.display()
    );
    let agent = Agent::bind(agent_config(agent_addr, dir)?).await?;
    let agent_task = tokio::spawn(agent.serve(stop.clone().cancelled_owned()));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !handle.is_ready() {
        if tokio::time::Instant::now() > deadline {
            bail!("the agent did not connect within 10 s");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    println!("   proxy-agent demo-agent connected; the server is ready");

    let dialer = Dialer {
        transport: Transport::Uds(socket.clone()),
        mode: match mode {
            Mode::Grpc => client::dial::Mode::Grpc,
            Mode::HttpConnect => client::dial::Mode::HttpConnect,
        },
    };
    let mut conn = dialer.dial(&backend.to_string()).await?;
    conn.write_all(b"GET / HTTP/1.1\r\nHost: backend\r\n\r\n")
        .await?;
    let mut response = Vec::new();
    conn.read_to_end(&mut response).await?;
    drop(conn);
    let response = String::from_utf8_lossy(&response);
    println!(
        "{}. GET http://{backend}/ through the tunnel ({name} mode) answered:",
        step + 1
    );
    for line in response.lines() {
        println!("   | {line}");
    }
    if !response.ends_with(BODY) {
        bail!("unexpected answer through the tunnel");
    }
    stop.cancel();
    server_task.await??;
    agent_task.await?;
    Ok(())
}

/// A proxy-server on loopback: `mode`'s frontend on the Unix socket
/// `socket`, agents by mTLS on an ephemeral port.
fn server_config(mode: Mode, name: &str, socket: &Path, dir: &Path) -> Result<Config> {
    let any: SocketAddr = "127.0.0.1:0".parse()?;
    Ok(Config {
        mode,
        frontend: FrontendListen::Uds {
            path: socket.to_owned(),
            delete_existing: true,
        },
        agent_addr: any,
        agent_tls: ListenerTls::agent(
            dir.join("cluster.crt"),
            dir.join("cluster.key"),
            Some(dir.join("agent-ca.crt")),
        ),
        health_addr: any,
        admin_addr: any,
        profiling: false,
        tracing: None,
        server_id: ServerId(format!("demo-server-{name}")),
        server_count: 1,
        strategies: vec![ProxyStrategy::Default],
        max_agent_queue_bytes: 4 << 20,
        verify_agent_identifiers: false,
        buffer_budget_bytes: proxy_server::config::DEFAULT_BUFFER_BUDGET,
        max_tls_handshakes: 8192,
        max_http_connections: 65_536,
        frontend_stall_timeout: Some(Duration::from_secs(300)),
        keepalive_time: Duration::from_secs(3600),
        frontend_keepalive_time: Duration::from_secs(3600),
        frontend_max_concurrent_streams: 100_000,
        agent_max_concurrent_streams: proxy_server::config::DEFAULT_AGENT_MAX_CONCURRENT_STREAMS,
        dial_policy: proxy_server::DialPolicy {
            timeout: None,
            retries: 1,
            hedge: None,
            caps: proxy_server::DialCaps::default(),
        },
        flow_control: true,
        flow_window: tunnel::flow::Window::V1,
        flow_version: tunnel::flow::Version::V2,
        graceful_shutdown_timeout: None,
        token_auth: None,
        allow_unauthenticated_agents: false,
        lease: None,
        audit: None,
        not_implemented: Vec::new(),
        deprecated: Vec::new(),
        notices: Vec::new(),
    })
}

/// The agent `demo-agent`, connecting to the server's agent port by mTLS.
fn agent_config(server: SocketAddr, dir: &Path) -> Result<proxy_agent::config::Config> {
    use proxy_agent::config::{ClientTls, Config, ServerAddr, ServerCountSource};
    let any: SocketAddr = "127.0.0.1:0".parse()?;
    Ok(Config {
        servers: vec![ServerAddr::new("127.0.0.1", server.port())],
        tls: ClientTls::new(
            dir.join("agent-ca.crt"),
            Some((dir.join("proxy-agent.crt"), dir.join("proxy-agent.key"))),
        ),
        agent_id: tunnel::ids::AgentId("demo-agent".to_owned()),
        agent_identifiers: String::new(),
        health_addr: any,
        admin_addr: any,
        profiling: false,
        tracing_config: None,
        tracing: Default::default(),
        sync_interval: Duration::from_millis(100),
        sync_interval_cap: Duration::from_secs(1),
        session_refresh: None,
        sync_forever: false,
        probe_interval: Duration::from_secs(1),
        keepalive_time: Duration::from_secs(3600),
        flow_control: true,
        flow_window: tunnel::flow::Window::V1,
        flow_version: tunnel::flow::Version::V2,
        exit_when_drained: false,
        max_server_queue_bytes: 4 << 20,
        token_path: None,
        destination_policy: None,
        leases: None,
        server_count_source: ServerCountSource::Default,
        audit: None,
        not_implemented: Vec::new(),
        deprecated: Vec::new(),
        notices: Vec::new(),
    })
}
