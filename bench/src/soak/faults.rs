//! The fault driver: injects each fault, records the evidence that it
//! took effect ([`Effect`]) and waits for its recovery. What the evidence
//! must show is the judge's (`soak_judge::faults`).

use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use anyhow::Context;
use soak_judge::{
    Effect, Exchange, Fault, FaultRecord, Frontend, FrontendEnd, Hit, LifeEnd, Listener, OldCa,
    Role, Seat, SlowPeer,
};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::UnixStream,
};

use super::{
    World,
    system::{AgentPod, AgentSetup, FrontendMode},
    traffic::{self, Counts, Front, Maker, Shape},
    watch::{self, lock},
};

/// How long a stall or outage lasts in a long run.
pub const HOLD: Duration = Duration::from_secs(30);
/// How long the slowloris frontends keep going: past the CONNECT
/// frontend's 60 s bound on reading a request head.
pub const SLOW: Duration = Duration::from_secs(75);
/// How long a partition lasts in a long run: past the keepalive bounds on
/// both sides (2 s pings, 2 s for their ack).
pub const PARTITION: Duration = Duration::from_secs(20);
/// How long a killed process stays down.
pub const DOWN: Duration = Duration::from_secs(3);
/// Longest wait for an agent or a server to be back.
pub const BACK_LIMIT: Duration = Duration::from_secs(120);
/// How long an agent of a dropped CA is watched for a connection.
const OLD_CA_WATCH: Duration = Duration::from_secs(5);
/// How soon after a certificate rotation every server must present the
/// new leaf: a server reads its files at each handshake, so the first one
/// after the rotation should; this leaves room for a loaded machine.
const SERVED_WITHIN: Duration = Duration::from_secs(10);
/// Connections of the slowloris frontend, per server.
const SLOWLORIS: usize = 32;

/// How long the faults that hold last.
#[derive(Debug, Clone, Copy)]
pub struct FaultTimes {
    /// A stall or an outage.
    pub hold: Duration,
    /// A partition.
    pub partition: Duration,
}

impl Default for FaultTimes {
    fn default() -> Self {
        Self {
            hold: HOLD,
            partition: PARTITION,
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
    Some(soak_judge::samples::sum(&watch::metrics(addr).await?, name))
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

/// Handshakes the servers' agent listeners refused so far.
async fn refusals(world: &World) -> f64 {
    let mut sum = 0.0;
    for s in &world.servers {
        sum += metric(
            s.health,
            "konnectivity_rs_server_tls_handshakes_dropped_total{reason=\"failed\"}",
        )
        .await
        .unwrap_or(0.0);
    }
    sum
}

impl World {
    /// Our frontend on server `index`.
    pub fn front(&self, index: usize) -> Front {
        let server = &self.servers[index];
        match server.mode {
            FrontendMode::Grpc => Front::Grpc(server.uds.clone()),
            FrontendMode::HttpConnect => Front::Connect(
                server
                    .connect
                    .clone()
                    .expect("the CONNECT server listens on mTLS TCP"),
            ),
        }
    }

    /// One small exchange through server `index`, recorded as a probe's;
    /// whether it was whole.
    async fn probe_dial(&self, index: usize) -> bool {
        let maker = Maker {
            front: self.front(index),
            frontend: Frontend::Probe,
            server: index,
            clock: self.clock,
        };
        let x = Shape {
            up: 1024,
            down: 1024,
            rate: 0,
            bulk: false,
        };
        let record: Exchange =
            traffic::exchange(&maker, self.dest.addr, x, &Counts::default()).await;
        let ok = record.end == FrontendEnd::Ok;
        lock(&self.exchanges).push(record);
        ok
    }

    /// Waits until a dial through each server carries an exchange.
    async fn dials_served(&self) -> Option<Duration> {
        until(BACK_LIMIT, || async {
            for index in 0..self.servers.len() {
                if !self.probe_dial(index).await {
                    return false;
                }
            }
            true
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
        self.clock.now()
    }

    /// Starts a process in agent slot `i`, its life recorded.
    ///
    /// # Errors
    /// It cannot be started.
    pub fn start_agent(&mut self, i: usize) -> anyhow::Result<()> {
        self.agents[i].start(&self.bins, &self.agent_setup)?;
        let agent = &self.agents[i];
        if let Some(pid) = agent.pid() {
            self.lives
                .born(agent.name(), Seat::Agent(i), pid, self.now());
        }
        self.update_slots();
        Ok(())
    }

    /// Kills `role`'s process of slot `i` (an agent slot or a server) with
    /// SIGKILL, its books read just before; whether it was reaped dead by
    /// that signal.
    async fn kill_now(&mut self, role: Role, i: usize) -> bool {
        let (health, pid, process) = match role {
            Role::Agent => {
                let a = &mut self.agents[i];
                (a.health, a.pid(), &mut a.process)
            }
            Role::Server => {
                let s = &mut self.servers[i];
                (s.health, s.pid(), &mut s.process)
            }
        };
        let process = process.take();
        if let Some(pid) = pid {
            watch::read_books(self.clock, &self.lives, pid, role, health).await;
        }
        let reaped = process.is_some_and(|p| p.kill_reaped());
        if let Some(pid) = pid {
            self.lives.died(pid, self.now(), LifeEnd::Killed);
        }
        self.update_slots();
        reaped
    }

    /// Starts server `i` again on its ports, its life recorded.
    ///
    /// # Errors
    /// It cannot be started.
    pub async fn restart_server(&mut self, i: usize) -> anyhow::Result<()> {
        self.servers[i].restart(&self.bins).await?;
        if let Some(pid) = self.servers[i].pid() {
            let name = format!("server-{i}.{}", self.servers[i].starts());
            self.lives.born(name, Seat::Server(i), pid, self.now());
        }
        self.update_slots();
        Ok(())
    }

    /// Injects `fault` on `target` (an agent or server index where it
    /// applies) and waits for its recovery; the record, resources and
    /// rates not yet filled in.
    ///
    /// # Errors
    /// A process cannot be started again, or a file written.
    pub async fn inject(&mut self, fault: Fault, target: usize) -> anyhow::Result<FaultRecord> {
        let started = self.now();
        let hit = match fault {
            Fault::AgentKill | Fault::TokenOutage | Fault::Rollout => Hit::Agent(target),
            Fault::ServerKill => Hit::Server(target),
            Fault::Partition => Hit::Agent(self.partitioned),
            _ => Hit::Elsewhere,
        };
        let mut record = FaultRecord::new(fault, hit, started);
        let back = match fault {
            Fault::AgentKill => self.kill_agent(target, &mut record).await?,
            Fault::ServerKill => self.kill_server(target, &mut record).await?,
            Fault::Partition => self.partition(&mut record).await?,
            Fault::FrontendStall => self.stall_frontends(&mut record).await,
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
        if self.close_before_kill {
            super::sabotage::close_sockets(self, target).await?;
        }
        let reaped = self.kill_now(Role::Agent, target).await;
        record.effect = Effect::Killed { reaped };
        tokio::time::sleep(DOWN).await;
        self.start_agent(target)?;
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
        let reaped = self.kill_now(Role::Server, target).await;
        record.effect = Effect::Killed { reaped };
        tokio::time::sleep(DOWN).await;
        self.restart_server(target).await?;
        record.ended = self.now();
        Ok(self.server_back(target).await)
    }

    /// [`Fault::Partition`]: the partitioned agent's control link down
    /// for the partition's time, its server connections watched through
    /// its node link; how long until it is back on both servers.
    async fn partition(&mut self, record: &mut FaultRecord) -> anyhow::Result<Option<Duration>> {
        let i = self.partitioned;
        record.target = format!("agent-{i}");
        self.ns.set_link(i, false)?;
        let health = self.agents[i].health;
        let until_up = Instant::now() + self.times.partition;
        let mut fewest: Option<f64> = None;
        while Instant::now() < until_up {
            if let Some(n) = agent_servers(health).await {
                fewest = Some(fewest.map_or(n, |f| f.min(n)));
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        self.ns.set_link(i, true)?;
        record.effect = Effect::Partitioned {
            fewest_servers: fewest,
        };
        record.ended = self.now();
        Ok(agent_back(&self.agents[i]).await)
    }

    /// [`Fault::FrontendStall`]: a download through each server left
    /// unread for the hold.
    async fn stall_frontends(&mut self, record: &mut FaultRecord) -> Option<Duration> {
        record.target = "a gRPC and a CONNECT download".to_owned();
        let before = self.node.accepted_by(Listener::Source);
        let mut held = Vec::new();
        for index in 0..self.servers.len() {
            match dial(&self.front(index), self.source.addr).await {
                Ok(io) => held.push(io),
                Err(e) => eprintln!("soak: a stalled download through server-{index}: {e:#}"),
            }
        }
        tokio::time::sleep(self.times.hold).await;
        record.effect = Effect::Stalled {
            tunnels: held.len(),
            reached: self.node.accepted_by(Listener::Source) - before,
        };
        drop(held);
        record.ended = self.now();
        Some(Duration::ZERO)
    }

    /// [`Fault::DestinationStall`]: an upload through each server to a
    /// destination that stops reading, for the hold.
    async fn stall_destination(&mut self, record: &mut FaultRecord) -> Option<Duration> {
        record.target = "a gRPC and a CONNECT upload".to_owned();
        let before = self.node.accepted_by(Listener::Stall);
        let mut tasks = tokio::task::JoinSet::new();
        let (opened_tx, mut opened_rx) = tokio::sync::mpsc::channel(4);
        for index in 0..self.servers.len() {
            let front = self.front(index);
            let addr = self.stall.listener.addr;
            let opened_tx = opened_tx.clone();
            tasks.spawn(async move {
                let Ok(mut io) = dial(&front, addr).await else {
                    return;
                };
                let _ = opened_tx.send(()).await;
                let chunk = vec![0x5a_u8; 32 * 1024];
                while io.write_all(&chunk).await.is_ok() {}
            });
        }
        drop(opened_tx);
        tokio::time::sleep(self.times.hold).await;
        let mut tunnels = 0;
        while opened_rx.try_recv().is_ok() {
            tunnels += 1;
        }
        tasks.abort_all();
        while tasks.join_next().await.is_some() {}
        record.effect = Effect::Stalled {
            tunnels,
            reached: self.node.accepted_by(Listener::Stall) - before,
        };
        record.note = format!("{} held by the destination", self.stall.held());
        self.stall.reset_all();
        record.ended = self.now();
        Some(Duration::ZERO)
    }

    /// [`Fault::Slowloris`]: [`SLOWLORIS`] slow frontends per server (see
    /// [`Self::slowloris`]).
    async fn slow_frontends(&mut self, record: &mut FaultRecord) -> Option<Duration> {
        record.target = format!("{SLOWLORIS} connections per server");
        record.effect = Effect::Slowloris {
            peers: self.slowloris().await,
        };
        record.ended = self.now();
        Some(Duration::ZERO)
    }

    /// [`Fault::CertRotation`]: new leaves on both sides; how long until
    /// every server presents the new leaf (its serial, read by a TLS
    /// client, against the new file's) and until a new agent connects with
    /// them.
    async fn rotate_leaves(
        &mut self,
        record: &mut FaultRecord,
    ) -> anyhow::Result<Option<Duration>> {
        record.target = "servers and agents".to_owned();
        let serial = super::leaf::serial_of_pem(&self.pki.rotate_leaves()?)?;
        let rotated = Instant::now();
        let mut presented = Vec::new();
        let served = loop {
            presented.clear();
            for server in &self.servers {
                let seen = super::leaf::presented_serial(server.agent_addr).await;
                presented.push(seen.unwrap_or_else(|e| format!("none ({e:#})")));
            }
            if presented.iter().all(|p| *p == serial) {
                break Some(rotated.elapsed());
            }
            if rotated.elapsed() >= SERVED_WITHIN {
                break None;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        let back = self.probe_agent().await;
        record.effect = Effect::Rotated {
            admitted_s: back.map(|d| d.as_secs_f64()),
            serial,
            presented,
            served_s: served.map(|d| d.as_secs_f64()),
        };
        record.ended = self.now();
        Ok(back)
    }

    /// [`Fault::CaRotation`]: a new CA trusted beside the old, the leaves
    /// switched, the old CA dropped, a new agent connecting after each
    /// step; then an agent of the old CA, which must be refused. How long
    /// the last new agent took.
    async fn rotate_ca(&mut self, record: &mut FaultRecord) -> anyhow::Result<Option<Duration>> {
        record.target = "servers and agents".to_owned();
        let new = self.pki.ca_trust_both()?;
        let first = self.probe_agent().await;
        self.pki.ca_switch_leaves(new)?;
        let second = self.probe_agent().await;
        self.pki.ca_drop_old()?;
        let back = self.probe_agent().await;
        let old_ca = self.old_ca_agent().await;
        record.effect = Effect::CaRotated {
            steps: [first, second, back].map(|d| d.map(|d| d.as_secs_f64())),
            old_ca,
        };
        record.ended = self.now();
        Ok(back)
    }

    /// An agent with the files of the CA just dropped, watched for
    /// [`OLD_CA_WATCH`]: whether it connected, and how many handshakes the
    /// servers refused meanwhile.
    async fn old_ca_agent(&mut self) -> Option<OldCa> {
        let setup = AgentSetup::new(
            self.root.path(),
            &self.pki.old_ca_dir,
            self.tokens.as_ref(),
            self.lb.addr,
        );
        let before = refusals(self).await;
        let mut agent = self.probe_pod();
        if let Err(e) = agent.start(&self.bins, &setup) {
            eprintln!("soak: the agent of the old CA: {e:#}");
            return None;
        }
        let pid = agent.pid()?;
        self.lives.born(agent.name(), Seat::Probe, pid, self.now());
        let health = agent.health;
        let connected = until(OLD_CA_WATCH, || async move {
            agent_servers(health).await.is_some_and(|n| n > 0.0)
        })
        .await
        .is_some();
        let refused = refusals(self).await - before;
        self.drain_probe(agent).await;
        Some(OldCa {
            connected,
            refusals: refused,
        })
    }

    /// [`Fault::TokenOutage`]: the TokenReview API down for the hold while
    /// agent `target` reconnects; how long until it is back on both
    /// servers.
    async fn token_outage(
        &mut self,
        target: usize,
        record: &mut FaultRecord,
    ) -> anyhow::Result<Option<Duration>> {
        record.target = format!("TokenReview API, agent-{target} reconnecting");
        let tokens = self.tokens.as_ref().context("token mode only")?;
        tokens.stub.set_down(true);
        let reaped = self.kill_now(Role::Agent, target).await;
        self.start_agent(target)?;
        tokio::time::sleep(self.times.hold).await;
        let during = agent_servers(self.agents[target].health).await;
        if let Some(tokens) = &self.tokens {
            tokens.stub.set_down(false);
        }
        record.effect = Effect::TokenOutage { reaped, during };
        record.ended = self.now();
        Ok(agent_back(&self.agents[target]).await)
    }

    /// [`Fault::Rollout`]: agent `target` drained (SIGTERM) while its
    /// successor starts, the old one's books read until it exits; how long
    /// until the successor is back on both servers.
    async fn roll_out(
        &mut self,
        target: usize,
        record: &mut FaultRecord,
    ) -> anyhow::Result<Option<Duration>> {
        record.target = format!("agent-{target}");
        let health = self.agents[target].health;
        let mut old = self.agents[target].process.take();
        // What it cut before the drain (through a server killed under
        // it) is not the drain's.
        let mut cut_before = 0.0;
        let mut open_before = None;
        if let Some(old) = &old {
            let pid = old.pid();
            if let Some(books) =
                watch::read_books(self.clock, &self.lives, pid, Role::Agent, health).await
            {
                cut_before = books.cut;
                open_before = Some(books.open);
            }
            self.lives.drained(pid, self.now());
        }
        let sent = Instant::now();
        if let Some(old) = &old {
            old.terminate()?;
        }
        self.start_agent(target)?;
        let mut exited = None;
        let mut cut = None;
        let mut exit_ok = false;
        if let Some(p) = &mut old {
            let pid = p.pid();
            loop {
                // Read before looking for its exit: an idle agent exits
                // within a tenth of a second of SIGTERM.
                if let Some(books) =
                    watch::read_books(self.clock, &self.lives, pid, Role::Agent, health).await
                {
                    cut = Some(books.cut - cut_before);
                }
                if let Some(status) = p.exit_status() {
                    exited = Some(sent.elapsed().as_secs_f64());
                    exit_ok = status.success();
                    self.lives
                        .died(pid, self.now(), LifeEnd::Exited { ok: exit_ok });
                    break;
                }
                if sent.elapsed() >= BACK_LIMIT {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        // Gone before a reading after SIGTERM, with nothing open just
        // before it: nothing to cut (what it dialed in between, and cut,
        // its slot's frontends and the destination would see).
        if cut.is_none() && exited.is_some() && open_before == Some(0.0) {
            cut = Some(0.0);
        }
        drop(old);
        record.effect = Effect::RolledOut {
            exited_s: exited,
            exit_ok,
            cut,
        };
        let back = agent_back(&self.agents[target]).await;
        record.ended = self.now();
        Ok(back)
    }

    /// [`SLOWLORIS`] connections to each server's frontend socket, each
    /// sending the start of a request one byte a second for [`SLOW`]; when
    /// the server closed each.
    async fn slowloris(&self) -> Vec<SlowPeer> {
        let mut tasks = tokio::task::JoinSet::new();
        let deadline = tokio::time::Instant::now() + SLOW;
        for server in &self.servers {
            let http_connect = server.mode == FrontendMode::HttpConnect;
            let opening: &'static [u8] = if http_connect {
                b"CONNECT 10.251.1.1:1 HTTP/1.1\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
            } else {
                b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
            };
            for _ in 0..SLOWLORIS {
                let uds = server.uds.clone();
                let connect = server.connect.clone();
                tasks.spawn(async move {
                    let began = tokio::time::Instant::now();
                    let closed_after = match connect {
                        // The CONNECT server is on mTLS TCP: the slow head
                        // comes after a prompt handshake.
                        Some(client::dial::Transport::Tls {
                            addr,
                            server_name,
                            tls,
                        }) => match tls_connect(addr, &server_name, tls).await {
                            Ok(io) => slow_peer(io, opening, deadline, began).await,
                            Err(_) => None,
                        },
                        _ => match UnixStream::connect(&uds).await {
                            Ok(io) => slow_peer(io, opening, deadline, began).await,
                            Err(_) => None,
                        },
                    };
                    SlowPeer {
                        http_connect,
                        closed_after,
                    }
                });
            }
        }
        let mut peers = Vec::new();
        while let Some(r) = tasks.join_next().await {
            if let Ok(peer) = r {
                peers.push(peer);
            }
        }
        peers
    }

    /// A probe agent's pod, on the host, not started.
    fn probe_pod(&mut self) -> AgentPod {
        self.probes += 1;
        AgentPod::new(self.probes, None)
    }

    /// Starts a short-lived agent with the current files, waits until it
    /// is connected to both servers, then drains it away (SIGTERM); how
    /// long connecting took.
    async fn probe_agent(&mut self) -> Option<Duration> {
        let mut probe = self.probe_pod();
        if probe.start(&self.bins, &self.agent_setup).is_err() {
            return None;
        }
        self.lives
            .born(probe.name(), Seat::Probe, probe.pid()?, self.now());
        let took = agent_back(&probe).await;
        self.drain_probe(probe).await;
        took
    }

    /// Drains a probe agent (SIGTERM), its books read until it exits.
    async fn drain_probe(&self, mut probe: AgentPod) {
        let Some(mut p) = probe.process.take() else {
            return;
        };
        let pid = p.pid();
        watch::read_books(self.clock, &self.lives, pid, Role::Agent, probe.health).await;
        self.lives.drained(pid, self.now());
        let _ = p.terminate();
        let sent = Instant::now();
        loop {
            if let Some(status) = p.exit_status() {
                self.lives.died(
                    pid,
                    self.now(),
                    LifeEnd::Exited {
                        ok: status.success(),
                    },
                );
                return;
            }
            if sent.elapsed() >= BACK_LIMIT {
                self.lives
                    .died(pid, self.now(), LifeEnd::Exited { ok: false });
                return;
            }
            watch::read_books(self.clock, &self.lives, pid, Role::Agent, probe.health).await;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// Sends `opening` a byte a second until `deadline` (after `began`);
/// when the server closed the connection, if it did.
async fn slow_peer(
    mut io: impl tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    opening: &[u8],
    deadline: tokio::time::Instant,
    began: tokio::time::Instant,
) -> Option<f64> {
    let closed = || Some(began.elapsed().as_secs_f64());
    let mut buf = [0u8; 256];
    for byte in opening.iter().cycle() {
        if tokio::time::Instant::now() >= deadline {
            break;
        }
        if io.write_all(&[*byte]).await.is_err() || io.flush().await.is_err() {
            return closed();
        }
        // The server may answer (an error page) and close.
        if let Ok(r) = tokio::time::timeout(Duration::from_secs(1), io.read(&mut buf)).await
            && matches!(r, Ok(0) | Err(_))
        {
            return closed();
        }
    }
    None
}

/// A TLS connection to the CONNECT frontend at `addr`.
async fn tls_connect(
    addr: SocketAddr,
    server_name: &str,
    tls: std::sync::Arc<rustls::ClientConfig>,
) -> anyhow::Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
    let mut config = (*tls).clone();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    let name = rustls::pki_types::ServerName::try_from(server_name.to_owned())?;
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    Ok(
        tokio_rustls::TlsConnector::from(std::sync::Arc::new(config))
            .connect(name, tcp)
            .await?,
    )
}

/// A tunnel through `front` to `addr`.
async fn dial(front: &Front, addr: SocketAddr) -> anyhow::Result<Box<dyn client::dial::Io>> {
    let dialer = match front {
        Front::Grpc(path) => client::dial::Dialer {
            transport: client::dial::Transport::Uds(path.clone()),
            mode: client::dial::Mode::Grpc,
        },
        Front::Connect(transport) => client::dial::Dialer {
            transport: transport.clone(),
            mode: client::dial::Mode::HttpConnect,
        },
    };
    Ok(dialer.dial(&addr.to_string()).await?)
}
