//! The faults the soak injects, and how each one's end and recovery are
//! told.

use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use anyhow::Context;
use serde::Serialize;
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::UnixStream,
};

use super::{
    World,
    system::{AgentPod, FrontendMode},
    traffic::{self, Counts, Exchange, Front, Outcome},
    watch::{Role, sum},
};
use crate::probe;

/// How long a stall or outage lasts.
pub const HOLD: Duration = Duration::from_secs(30);
/// How long the slowloris frontends keep going: past the CONNECT
/// frontend's 60 s bound on reading a request head.
pub const SLOW: Duration = Duration::from_secs(75);
/// How long a partition lasts: past the keepalive bounds on both sides.
pub const PARTITION: Duration = Duration::from_secs(20);
/// How long a killed process stays down.
pub const DOWN: Duration = Duration::from_secs(3);
/// Longest wait for an agent or a server to be back.
pub const BACK_LIMIT: Duration = Duration::from_secs(120);
/// Connections of the slowloris frontend, per server.
const SLOWLORIS: usize = 32;

/// A fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Fault {
    /// An agent killed with SIGKILL, started again.
    AgentKill,
    /// A server killed with SIGKILL, started again on the same ports.
    ServerKill,
    /// The namespaced agent's link down, then up.
    Partition,
    /// Frontends that stop reading a download.
    FrontendStall,
    /// A destination that stops reading an upload.
    DestinationStall,
    /// Frontends that send their first bytes one a second.
    Slowloris,
    /// New leaf certificates on both sides (same CA).
    CertRotation,
    /// A new CA: trusted beside the old, leaves switched, old dropped.
    CaRotation,
    /// The TokenReview API answers 503 while an agent reconnects.
    TokenOutage,
    /// A DaemonSet-style rollout of one agent: SIGTERM (drain), a new
    /// agent up, the old one exits once drained.
    Rollout,
}

impl Fault {
    /// Its name in the tables.
    pub fn name(self) -> &'static str {
        match self {
            Self::AgentKill => "agent kill -9",
            Self::ServerKill => "server kill -9",
            Self::Partition => "partition",
            Self::FrontendStall => "frontend stops reading",
            Self::DestinationStall => "destination stops reading",
            Self::Slowloris => "slowloris frontends",
            Self::CertRotation => "certificate rotation",
            Self::CaRotation => "CA rotation",
            Self::TokenOutage => "TokenReview outage",
            Self::Rollout => "agent rollout",
        }
    }

    /// The schedule, repeated: every fault in turn, the kills twice as
    /// often.
    pub fn schedule(token: bool) -> Vec<Self> {
        let mut all = vec![
            Self::AgentKill,
            Self::Partition,
            Self::ServerKill,
            Self::Rollout,
            Self::FrontendStall,
            Self::DestinationStall,
            Self::CertRotation,
            Self::ServerKill,
            Self::Slowloris,
            Self::AgentKill,
            Self::CaRotation,
        ];
        if token {
            all.insert(3, Self::TokenOutage);
        }
        all
    }
}

/// What one injected fault showed.
#[derive(Debug, Clone, Serialize)]
pub struct FaultRecord {
    /// Which.
    pub fault: Fault,
    /// Which process or connection.
    pub target: String,
    /// Injected at (s since the start).
    pub started: f64,
    /// The fault over (process restarted, link up, stall ended) at.
    pub ended: f64,
    /// Seconds from the end until the agent(s) concerned were connected
    /// to both servers again (a restarted server: every agent on it).
    pub back_s: Option<f64>,
    /// Seconds from the end until a dial through each server carried an
    /// exchange again.
    pub dials_s: Option<f64>,
    /// Recovered (back and dials) at.
    pub recovered: f64,
    /// Per frontend kind: rate during the fault / baseline rate (the lower
    /// of exchanges/s and bulk bytes/s), all its traffic, that on the
    /// faulty agent too; `None` where the fault took the kind's own server.
    pub rates: Vec<Option<f64>>,
    /// The healthy traffic's rate during the fault / its baseline rate:
    /// for a fault on an agent, the exchanges completed through the other
    /// agents (told apart at the destination by their source address);
    /// for a killed server, the other server's frontends; else every
    /// frontend (the lowest of [`Self::rates`]).
    pub healthy: Option<f64>,
    /// What [`Self::healthy`] measured.
    pub healthy_what: String,
    /// The agent slot the fault was on, if one.
    pub agent: Option<usize>,
    /// Seconds from recovery until RSS, fds and tasks of every process
    /// were within 5 % of their baseline; `None`: not within a minute.
    pub resources_s: Option<f64>,
    /// The figure that did not come back, if any.
    pub resources_note: String,
    /// Anything else worth a note.
    pub note: String,
}

impl FaultRecord {
    /// A fault injected at `started`, nothing measured yet.
    pub fn new(fault: Fault, started: f64) -> Self {
        Self {
            fault,
            target: String::new(),
            started,
            ended: started,
            back_s: None,
            dials_s: None,
            recovered: started,
            rates: Vec::new(),
            healthy: None,
            healthy_what: String::new(),
            agent: None,
            resources_s: None,
            resources_note: String::new(),
            note: String::new(),
        }
    }
}

/// Polls `done` every 100 ms up to `limit`; the time it took.
async fn until<F, Fut>(limit: Duration, mut done: F) -> Option<Duration>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    loop {
        if done().await {
            return Some(start.elapsed());
        }
        if start.elapsed() >= limit {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// One series of a process's `/metrics`, if it answers.
async fn metric(addr: SocketAddr, name: &str) -> Option<f64> {
    match tokio::time::timeout(Duration::from_secs(2), probe::http_get(addr, "/metrics")).await {
        Ok(Ok((200, text))) => Some(sum(&text, name)),
        _ => None,
    }
}

/// Server connections of the agent at `health`.
async fn agent_servers(health: SocketAddr) -> Option<f64> {
    metric(
        health,
        "konnectivity_network_proxy_agent_open_server_connections",
    )
    .await
}

/// Waits until `agent` is connected to both servers.
pub async fn agent_back(agent: &AgentPod) -> Option<Duration> {
    let health = agent.health;
    until(BACK_LIMIT, || async move {
        agent_servers(health).await == Some(2.0)
    })
    .await
}

/// One small exchange through `front`, Ok or not.
async fn probe_dial(front: &Front, dest: SocketAddr) -> bool {
    let x = Exchange {
        up: 1024,
        down: 1024,
        rate: 0,
        bulk: false,
    };
    let counts = Counts::default();
    matches!(
        traffic::exchange(front, dest, x, &counts, Duration::from_secs(60)).await,
        Outcome::Ok
    )
}

impl World {
    /// Our frontend on server `index`.
    pub fn front(&self, index: usize) -> Front {
        let server = &self.servers[index];
        match server.mode {
            FrontendMode::Grpc => Front::Grpc(server.uds.clone()),
            FrontendMode::HttpConnect => Front::Connect(server.uds.clone()),
        }
    }

    /// Waits until a dial through each server carries an exchange.
    async fn dials_served(&self) -> Option<Duration> {
        let fronts = [self.front(0), self.front(1)];
        let dest = self.dest.addr;
        until(BACK_LIMIT, || {
            let fronts = fronts.clone();
            async move {
                for front in &fronts {
                    if !probe_dial(front, dest).await {
                        return false;
                    }
                }
                true
            }
        })
        .await
    }

    /// Waits until server `index` has every running agent.
    async fn server_back(&self, index: usize) -> Option<Duration> {
        let health = self.servers[index].health;
        let agents = self.agents.iter().filter(|a| a.process.is_some()).count() as f64;
        until(BACK_LIMIT, || async move {
            metric(
                health,
                "konnectivity_network_proxy_server_grpc_connections{service_method=\"Connect\"}",
            )
            .await
            .is_some_and(|n| n >= agents)
        })
        .await
    }

    /// Seconds since the start.
    pub fn now(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }

    /// Injects `fault` on `target` (an agent or server index where it
    /// applies) and waits for its recovery; the record, resources and
    /// rates not yet filled in.
    ///
    /// # Errors
    /// A process cannot be started again, or a file written.
    pub async fn inject(&mut self, fault: Fault, target: usize) -> anyhow::Result<FaultRecord> {
        let started = self.now();
        let mut record = FaultRecord::new(fault, started);
        let back = match fault {
            Fault::AgentKill => self.kill_agent(target, &mut record).await?,
            Fault::ServerKill => self.kill_server(target, &mut record).await?,
            Fault::Partition => self.partition(&mut record).await?,
            Fault::FrontendStall => self.stall_frontends(&mut record).await?,
            Fault::DestinationStall => self.stall_destination(&mut record).await,
            Fault::Slowloris => self.slow_frontends(&mut record).await,
            Fault::CertRotation => self.rotate_leaves(&mut record).await?,
            Fault::CaRotation => self.rotate_ca(&mut record).await?,
            Fault::TokenOutage => self.token_outage(target, &mut record).await?,
            Fault::Rollout => self.roll_out(target, &mut record).await?,
        };
        record.back_s = back.map(|d| d.as_secs_f64());
        record.dials_s = self.dials_served().await.map(|d| d.as_secs_f64());
        record.recovered = self.now();
        Ok(record)
    }

    /// [`Fault::AgentKill`]: agent `target` killed, started again after
    /// [`DOWN`]; how long until it is back on both servers.
    async fn kill_agent(
        &mut self,
        target: usize,
        record: &mut FaultRecord,
    ) -> anyhow::Result<Option<Duration>> {
        record.target = format!("agent-{target}");
        record.agent = Some(target);
        self.agents[target].process = None;
        self.update_slots();
        tokio::time::sleep(DOWN).await;
        self.agents[target].start(&self.bins, &self.agent_setup, &self.ns)?;
        self.update_slots();
        record.ended = self.now();
        Ok(agent_back(&self.agents[target]).await)
    }

    /// [`Fault::ServerKill`]: server `target` killed, started again on
    /// the same ports after [`DOWN`]; how long until it has every agent.
    async fn kill_server(
        &mut self,
        target: usize,
        record: &mut FaultRecord,
    ) -> anyhow::Result<Option<Duration>> {
        record.target = format!("server-{target}");
        self.servers[target].kill();
        self.update_slots();
        tokio::time::sleep(DOWN).await;
        self.servers[target].restart(&self.bins).await?;
        self.update_slots();
        record.ended = self.now();
        Ok(self.server_back(target).await)
    }

    /// [`Fault::Partition`]: the namespaced agent's link down for
    /// [`PARTITION`]; how long until it is back on both servers.
    async fn partition(&mut self, record: &mut FaultRecord) -> anyhow::Result<Option<Duration>> {
        let i = self
            .agents
            .iter()
            .position(|a| a.in_namespace)
            .context("no agent in the namespace")?;
        record.target = format!("agent-{i} (namespace)");
        record.agent = Some(i);
        self.ns.set_link(false)?;
        tokio::time::sleep(PARTITION).await;
        self.ns.set_link(true)?;
        record.ended = self.now();
        Ok(agent_back(&self.agents[i]).await)
    }

    /// [`Fault::FrontendStall`]: a download through each server left
    /// unread for [`HOLD`].
    async fn stall_frontends(
        &mut self,
        record: &mut FaultRecord,
    ) -> anyhow::Result<Option<Duration>> {
        record.target = "a gRPC and a CONNECT download".to_owned();
        let mut held = Vec::new();
        for index in 0..2 {
            held.push(self.stalled_download(index).await?);
        }
        tokio::time::sleep(HOLD).await;
        drop(held);
        record.ended = self.now();
        Ok(Some(Duration::ZERO))
    }

    /// [`Fault::DestinationStall`]: an upload through each server to a
    /// destination that stops reading, for [`HOLD`].
    async fn stall_destination(&mut self, record: &mut FaultRecord) -> Option<Duration> {
        record.target = "a gRPC and a CONNECT upload".to_owned();
        let mut tasks = tokio::task::JoinSet::new();
        for index in 0..2 {
            let front = self.front(index);
            let addr = self.stall.addr;
            tasks.spawn(async move {
                let Ok(mut io) = dial(&front, addr).await else {
                    return;
                };
                let chunk = vec![0x5a_u8; 32 * 1024];
                while io.write_all(&chunk).await.is_ok() {}
            });
        }
        tokio::time::sleep(HOLD).await;
        tasks.abort_all();
        while tasks.join_next().await.is_some() {}
        record.note = format!("{} held by the destination", self.stall.held());
        self.stall.reset_all();
        record.ended = self.now();
        Some(Duration::ZERO)
    }

    /// [`Fault::Slowloris`]: [`SLOWLORIS`] slow frontends per server (see
    /// [`Self::slowloris`]).
    async fn slow_frontends(&mut self, record: &mut FaultRecord) -> Option<Duration> {
        record.target = format!("{SLOWLORIS} connections per server");
        let closed = self.slowloris().await;
        record.note = format!(
            "{} of {SLOWLORIS} closed by the gRPC server, {} of {SLOWLORIS} by the CONNECT server, within {SLOW:?}",
            closed[0], closed[1]
        );
        record.ended = self.now();
        Some(Duration::ZERO)
    }

    /// [`Fault::CertRotation`]: new leaves on both sides; how long until a
    /// new agent connects with them.
    async fn rotate_leaves(
        &mut self,
        record: &mut FaultRecord,
    ) -> anyhow::Result<Option<Duration>> {
        record.target = "servers and agents".to_owned();
        self.pki.rotate_leaves()?;
        let back = self.probe_agent().await;
        record.ended = self.now();
        Ok(back)
    }

    /// [`Fault::CaRotation`]: a new CA trusted beside the old, the leaves
    /// switched, the old CA dropped, a new agent connecting after each
    /// step; how long the last one took.
    async fn rotate_ca(&mut self, record: &mut FaultRecord) -> anyhow::Result<Option<Duration>> {
        record.target = "servers and agents".to_owned();
        let new = self.pki.ca_trust_both()?;
        let first = self.probe_agent().await;
        self.pki.ca_switch_leaves(new)?;
        let second = self.probe_agent().await;
        self.pki.ca_drop_old()?;
        let back = self.probe_agent().await;
        record.note = format!(
            "a new agent connected after each step: {}",
            [first, second, back]
                .iter()
                .map(|d| d.map_or("never".to_owned(), |d| format!("{:.1} s", d.as_secs_f64())))
                .collect::<Vec<_>>()
                .join(", ")
        );
        record.ended = self.now();
        Ok(back)
    }

    /// [`Fault::TokenOutage`]: the TokenReview API down for [`HOLD`] while
    /// agent `target` reconnects; how long until it is back on both
    /// servers.
    async fn token_outage(
        &mut self,
        target: usize,
        record: &mut FaultRecord,
    ) -> anyhow::Result<Option<Duration>> {
        record.target = format!("TokenReview API, agent-{target} reconnecting");
        record.agent = Some(target);
        let tokens = self.tokens.as_ref().context("token mode only")?;
        tokens.stub.set_down(true);
        self.agents[target].process = None;
        self.update_slots();
        self.agents[target].start(&self.bins, &self.agent_setup, &self.ns)?;
        self.update_slots();
        tokio::time::sleep(HOLD).await;
        let during = agent_servers(self.agents[target].health).await;
        if let Some(tokens) = &self.tokens {
            tokens.stub.set_down(false);
        }
        record.note = format!(
            "the reconnecting agent had {} server connections during the outage",
            during.map_or("?".to_owned(), |n| n.to_string())
        );
        record.ended = self.now();
        Ok(agent_back(&self.agents[target]).await)
    }

    /// [`Fault::Rollout`]: agent `target` drained (SIGTERM) while its
    /// successor starts; how long until the successor is back on both
    /// servers. The note says how long the old one took to exit.
    async fn roll_out(
        &mut self,
        target: usize,
        record: &mut FaultRecord,
    ) -> anyhow::Result<Option<Duration>> {
        record.target = format!("agent-{target}");
        record.agent = Some(target);
        let mut old = self.agents[target].process.take();
        if let Some(old) = &old {
            old.terminate()?;
        }
        self.agents[target].start(&self.bins, &self.agent_setup, &self.ns)?;
        self.update_slots();
        let back = agent_back(&self.agents[target]).await;
        let drained = match &mut old {
            Some(old) => {
                until(BACK_LIMIT, || {
                    let exited = old.has_exited();
                    async move { exited }
                })
                .await
            }
            None => Some(Duration::ZERO),
        };
        record.note = match drained {
            Some(d) => format!(
                "the old agent drained and exited in {:.1} s",
                d.as_secs_f64()
            ),
            None => format!("the old agent had not exited after {BACK_LIMIT:?}"),
        };
        drop(old);
        record.ended = self.now();
        Ok(back)
    }

    /// A download from the endless source through server `index` that is
    /// never read.
    async fn stalled_download(&self, index: usize) -> anyhow::Result<Box<dyn client::dial::Io>> {
        dial(&self.front(index), self.source.addr).await
    }

    /// [`SLOWLORIS`] connections to each server's frontend socket, each
    /// sending the start of a request one byte a second for [`SLOW`]; how
    /// many each server closed meanwhile.
    async fn slowloris(&self) -> [usize; 2] {
        let mut tasks = tokio::task::JoinSet::new();
        let deadline = tokio::time::Instant::now() + SLOW;
        for server in &self.servers {
            let opening: &'static [u8] = match server.mode {
                FrontendMode::Grpc => b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
                FrontendMode::HttpConnect => {
                    b"CONNECT 10.251.1.1:1 HTTP/1.1\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
                }
            };
            for _ in 0..SLOWLORIS {
                let uds = server.uds.clone();
                let index = server.index;
                tasks.spawn(async move {
                    let Ok(mut io) = UnixStream::connect(&uds).await else {
                        return (index, false);
                    };
                    let mut buf = [0u8; 256];
                    for byte in opening.iter().cycle() {
                        if tokio::time::Instant::now() >= deadline {
                            return (index, false);
                        }
                        if io.write_all(&[*byte]).await.is_err() {
                            return (index, true);
                        }
                        // The server may answer (an error page) and close.
                        if let Ok(r) =
                            tokio::time::timeout(Duration::from_secs(1), io.read(&mut buf)).await
                        {
                            match r {
                                Ok(0) | Err(_) => return (index, true),
                                Ok(_) => {}
                            }
                        }
                    }
                    (index, false)
                });
            }
        }
        let mut closed = [0; 2];
        while let Some(r) = tasks.join_next().await {
            if let Ok((index, true)) = r {
                closed[index] += 1;
            }
        }
        closed
    }

    /// Starts a short-lived agent with the current files, waits until it
    /// is connected to both servers, then drains it away (SIGTERM); how
    /// long connecting took.
    async fn probe_agent(&mut self) -> Option<Duration> {
        let mut probe = AgentPod::new(self.agents.len(), false);
        probe.generation = 1000 + self.probes;
        self.probes += 1;
        if probe
            .start(&self.bins, &self.agent_setup, &self.ns)
            .is_err()
        {
            return None;
        }
        let took = agent_back(&probe).await;
        if let Some(mut p) = probe.process.take() {
            let _ = p.terminate();
            let _ = until(BACK_LIMIT, || {
                let exited = p.has_exited();
                async move { exited }
            })
            .await;
        }
        took
    }
}

/// A tunnel through `front` to `addr`.
async fn dial(front: &Front, addr: SocketAddr) -> anyhow::Result<Box<dyn client::dial::Io>> {
    let dialer = match front {
        Front::Grpc(path) => client::dial::Dialer {
            transport: client::dial::Transport::Uds(path.clone()),
            mode: client::dial::Mode::Grpc,
        },
        Front::Connect(path) => client::dial::Dialer {
            transport: client::dial::Transport::Uds(path.clone()),
            mode: client::dial::Mode::HttpConnect,
        },
    };
    Ok(dialer.dial(&addr.to_string()).await?)
}

/// Roles of the slots, for the tables.
pub fn role_name(role: Role) -> &'static str {
    match role {
        Role::Server => "server",
        Role::Agent => "agent",
    }
}
