//! The audit scenario (issue 45's goal: "every tunnel of a 10,000-tunnel
//! bench run has exactly one record per side, and the two records
//! agree"): one gRPC deployment with `--audit-log-path` on the server and
//! on the agent, `--audit-tunnels` single-use tunnels (dial, 1 KiB each
//! way, close) at 8 clients, then both stopped as an operator stops them
//! (they write every queued record before they exit) and the two files
//! joined: one record per tunnel on each side, none dropped, joined on
//! (agent, connection id), with the same destination, bytes each way and
//! dial id.

use std::{collections::HashMap, net::SocketAddr, path::Path, sync::Arc, time::Instant};

use anyhow::{Context, bail, ensure};
use client::dial::Mode;
use ops::audit::{
    AuditRecord,
    record::{AgentTunnel, ServerTunnel},
};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    sync::Semaphore,
    task::JoinSet,
};

use crate::{
    backends::Backends,
    system::{Binaries, Deployment},
};

/// Clients dialing at once.
const CONCURRENCY: usize = 8;

/// Bytes each way per tunnel.
const BYTES: usize = 1024;

/// Runs the scenario; its notes.
///
/// # Errors
/// The deployment fails, a tunnel fails, or the records do not join.
pub async fn run(
    bins: &Binaries,
    dir: &Path,
    backends: &Backends,
    tunnels: usize,
) -> anyhow::Result<Vec<String>> {
    let server_log = dir.join("audit-server.jsonl");
    let agent_log = dir.join("audit-agent.jsonl");
    let flag = |path: &Path| format!("--audit-log-path={}", path.display());
    let mut deployment = Deployment::start_with(
        bins,
        dir,
        Mode::Grpc,
        "audit",
        (&[flag(&server_log)], &[flag(&agent_log)]),
    )
    .await?;
    let began = Instant::now();
    load(&deployment, backends.responder.addr, tunnels).await?;
    let took = began.elapsed();
    deployment.check_alive()?;
    deployment.stop().await?;
    let (server, agent) = (read(&server_log)?, read(&agent_log)?);
    let checked = join(&server, &agent, tunnels, backends.responder.addr)?;
    let line = format!(
        "audit: {tunnels} single-use gRPC tunnels at {CONCURRENCY} clients in {:.1} s; \
         {} server and {} agent records, {checked} joined pairs agreeing (destination, \
         dial id, {BYTES} bytes each way)",
        took.as_secs_f64(),
        server.len(),
        agent.len(),
    );
    eprintln!("{line}");
    Ok(vec![line])
}

/// `tunnels` single-use tunnels to `addr` through `deployment`, at
/// [`CONCURRENCY`] at once.
async fn load(deployment: &Deployment, addr: SocketAddr, tunnels: usize) -> anyhow::Result<()> {
    let permits = Arc::new(Semaphore::new(CONCURRENCY));
    let mut running = JoinSet::new();
    for _ in 0..tunnels {
        let permit = permits.clone().acquire_owned().await?;
        let dialer = deployment.dialer();
        running.spawn(async move {
            let _permit = permit;
            let mut conn = dialer.dial(&addr.to_string()).await?;
            let out = [0x5a_u8; BYTES];
            let mut back = [0u8; BYTES];
            conn.write_all(&out).await?;
            conn.flush().await?;
            conn.read_exact(&mut back).await?;
            ensure!(back == out, "the responder's answer differs");
            Ok::<_, anyhow::Error>(())
        });
        while let Some(done) = running.try_join_next() {
            done??;
        }
    }
    while let Some(done) = running.join_next().await {
        done??;
    }
    Ok(())
}

/// The records in `path`.
fn read(path: &Path) -> anyhow::Result<Vec<AuditRecord>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    text.lines()
        .map(|line| serde_json::from_str(line).with_context(|| format!("a bad record: {line}")))
        .collect()
}

/// Joins the two sides' records; how many pairs agreed.
fn join(
    server: &[AuditRecord],
    agent: &[AuditRecord],
    tunnels: usize,
    destination: SocketAddr,
) -> anyhow::Result<usize> {
    let servers: Vec<&ServerTunnel> = server
        .iter()
        .filter_map(|r| match r {
            AuditRecord::Server(s) => Some(s),
            AuditRecord::Agent(_) => None,
        })
        .collect();
    let mut agents: HashMap<(&str, i64), &AgentTunnel> = HashMap::new();
    for record in agent {
        let AuditRecord::Agent(a) = record else {
            bail!("a server record in the agent's log");
        };
        let id = a
            .connection_id
            .context("an agent record without a connection")?;
        if agents.insert((a.agent_id.as_str(), id), a).is_some() {
            bail!("two agent records of connection {id}");
        }
    }
    ensure!(
        servers.len() == tunnels,
        "{} server records of {tunnels} tunnels",
        servers.len()
    );
    ensure!(
        agents.len() == tunnels,
        "{} agent records of {tunnels} tunnels",
        agents.len()
    );
    let destination = destination.to_string();
    for s in &servers {
        let key = (
            s.agent_id
                .as_deref()
                .context("a server record without an agent")?,
            s.connection_id
                .context("a server record without a connection")?,
        );
        let a = agents
            .remove(&key)
            .with_context(|| format!("no agent record of {s:?}"))?;
        ensure!(
            s.destination == destination
                && a.destination == destination
                && s.dial_id == a.dial_id
                && s.server_id == a.server_id
                && (s.bytes_to_agent, s.bytes_to_frontend) == (BYTES as u64, BYTES as u64)
                && (a.bytes_to_endpoint, a.bytes_to_server) == (BYTES as u64, BYTES as u64),
            "the records disagree: {s:?} / {a:?}"
        );
    }
    Ok(servers.len())
}
