//! agent-swarm: many proxy-agents in one process, for the bench's agents
//! scenario (a cluster has one agent per node, thousands of them). Each is
//! the real agent (`proxy_agent::Agent`) with its own id, its own TLS
//! connection and `Connect` stream, its own health and admin listeners;
//! they share one process and one runtime, each with its TLS session cache
//! (`--resumption=false`: none, as ANP's grpc-go agents). SIGUSR1 cuts
//! every agent's server connection, as a network fault would.
//!
//! ```text
//! agent-swarm --agents 5000 --first 0 [--resumption=false] -- <proxy-agent flags>
//! ```
//! Agent ids are `swarm-<first>`, `swarm-<first+1>`, …. Agent `n` listens
//! for health and admin on ANP's ports 8093 and 8094 of a loopback address
//! of its own, `127.100.0.1` onwards, as agents on separate nodes do:
//! thousands of listeners on port 0 of one address cost the kernel a
//! search per bind that grows with each (half the swarm's CPU at 5,000).
//! Runs until SIGTERM/SIGINT.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use clap::Parser;
use tokio_util::{sync::CancellationToken, task::TaskTracker};

#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// Many proxy-agents in one process.
#[derive(Debug, Parser)]
#[command(name = "agent-swarm")]
struct Opt {
    /// Agents to run.
    #[arg(long, default_value_t = 1)]
    agents: usize,
    /// Number of the first agent (ids are `swarm-<n>`).
    #[arg(long, default_value_t = 0)]
    first: usize,
    /// Keep a TLS session cache per agent (ours) or none (as ANP's grpc-go
    /// agents, every handshake a full one).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    resumption: bool,
    /// A directory of service-account tokens: agent n presents the one in
    /// `token-<n>`.
    #[arg(long, value_name = "DIR")]
    token_dir: Option<std::path::PathBuf>,
    /// proxy-agent flags, shared by every agent.
    #[arg(last = true)]
    agent_args: Vec<String>,
}

/// ANP's agent health port.
const HEALTH_PORT: u16 = 8093;
/// ANP's agent admin port.
const ADMIN_PORT: u16 = 8094;

/// Agent `n`'s own loopback address: `127.100.0.1` onwards, each octet in
/// 1..=250 (16 million agents before it wraps).
fn node_address(n: usize) -> IpAddr {
    let octet = |k: usize| u8::try_from(k % 250 + 1).expect("at most 250");
    Ipv4Addr::new(127, 100 + octet(n / 62_500) - 1, octet(n / 250), octet(n)).into()
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let opt = Opt::parse();
    ops::telemetry::init_simple("error");
    // Three descriptors per agent: as many as the hard limit allows.
    if let Err(e) = rlimit::increase_nofile_limit(u64::MAX) {
        eprintln!("agent-swarm: cannot raise the open-file limit: {e}");
    }
    let args = match proxy_agent::config::Args::try_parse_from(
        std::iter::once("proxy-agent".to_owned()).chain(opt.agent_args.iter().cloned()),
    ) {
        Ok(args) => args,
        Err(e) => e.exit(),
    };
    let base = match proxy_agent::config::Config::try_from(args) {
        Ok(config) => config,
        Err(e) => {
            eprintln!("agent-swarm: {}", ops::error::DisplayErrorStack(&e));
            return std::process::ExitCode::from(2);
        }
    };
    // Each agent loads its own TLS configuration, and with it a session
    // cache of its own, as on its own node.
    let tls = proxy_agent::config::ClientTls {
        resumption: opt.resumption,
        ..base.tls.clone()
    };
    let stop = CancellationToken::new();
    let agents = TaskTracker::new();
    let mut handles = Vec::with_capacity(opt.agents);
    for n in opt.first..opt.first + opt.agents {
        let mut config = base.clone();
        config.agent_id = tunnel::ids::AgentId(format!("swarm-{n}"));
        let ip = node_address(n);
        config.health_addr = SocketAddr::new(ip, HEALTH_PORT);
        config.admin_addr = SocketAddr::new(ip, ADMIN_PORT);
        config.tls = tls.clone();
        if let Some(dir) = &opt.token_dir {
            config.token_path = Some(dir.join(format!("token-{n}")));
        }
        let bound = match proxy_agent::agent::Agent::bind(config).await {
            Ok(bound) => bound,
            Err(e) => {
                eprintln!(
                    "agent-swarm: agent {n} of {}: {}",
                    opt.agents,
                    ops::error::DisplayErrorStack(&e)
                );
                stop.cancel();
                agents.close();
                agents.wait().await;
                return std::process::ExitCode::FAILURE;
            }
        };
        handles.push(bound.handle());
        agents.spawn(bound.serve(stop.clone().cancelled_owned()));
    }
    agents.close();
    eprintln!("agent-swarm: {} agents started", opt.agents);
    // SIGUSR1: every agent's link is cut, as by a network fault.
    let mut cut = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::user_defined1())
    {
        Ok(signal) => signal,
        Err(e) => {
            eprintln!("agent-swarm: cannot handle SIGUSR1: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let shutdown = ops::signal::shutdown();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            () = &mut shutdown => break,
            _ = cut.recv() => handles.iter().for_each(proxy_agent::agent::AgentHandle::disconnect_all),
        }
    }
    stop.cancel();
    agents.wait().await;
    std::process::ExitCode::SUCCESS
}
