//! [`Agent`]: the set of server connections (one [`Client`] per proxy-server
//! replica) and the sync loop that keeps it complete.

use std::{
    collections::HashMap,
    future::Future,
    net::SocketAddr,
    sync::{
        Arc, Mutex, MutexGuard, PoisonError,
        atomic::{AtomicBool, AtomicU32, Ordering},
    },
    time::Duration,
};

use edge::listen::bind_named;
use ops::{
    error::DisplayErrorStack,
    tls::files::{CertMetrics, TlsFiles},
};
use tokio::net::TcpListener;
use tokio_util::{sync::CancellationToken, task::TaskTracker};
use tracing::{Instrument, debug, info, info_span, warn};
use tunnel::ids::ServerId;

use crate::{
    client::Client,
    config::Config,
    config::ServerCountSource,
    destinations::Destinations,
    endpoint::Connections,
    health,
    lease::{self, LeaseCounter, LeaseWatch},
    metrics::{AgentMetrics, LeaseMetrics, Live},
};

/// Failure to start the agent.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// A listener could not be bound.
    #[error(transparent)]
    Bind(#[from] edge::listen::BindError),
    /// The audit log cannot be opened (the error names `--audit-log-path`).
    #[error(transparent)]
    Audit(ops::flags::FlagError),
    /// `--count-server-leases` is on and the kube client cannot be set up.
    #[error(transparent)]
    Kube(#[from] ops::kube::KubeSetupError),
    /// A certificate, key or CA file cannot be used (the error names its
    /// flag).
    #[error(transparent)]
    Tls(#[from] crate::config::ConfigError),
    /// The destination policy file cannot be used (the error names it and
    /// the line).
    #[error(transparent)]
    Policy(#[from] crate::destinations::PolicyFileError),
}

/// One live server connection, as the client set sees it.
struct ClientEntry {
    /// Stops the client.
    cancel: CancellationToken,
    /// Its connections.
    conns: Connections,
    /// Packets to the server (DRAIN).
    out_tx: tunnel::queue::QueueTx<proto::Packet>,
    /// Which `--proxy-server-host` entry it was reached through.
    address: usize,
}

impl ClientEntry {
    /// Queues DRAIN: a control packet, queued at once, never waiting on the
    /// server.
    fn send_drain(&self) {
        let drain = proto::Packet::drain();
        let cost = tunnel::flow::packet_cost(&drain);
        let _ = self.out_tx.push(drain, cost);
    }
}

/// State shared by the sync loop, the clients and the health server.
pub(crate) struct AgentState {
    /// Live clients by server id.
    clients: Mutex<HashMap<ServerId, ClientEntry>>,
    /// Server count from the last new server's `servercount` (0 = unknown).
    server_count: AtomicU32,
    /// Set on the first signal: no new server connections, no new dials.
    draining: Arc<AtomicBool>,
    /// Lease count (`--count-server-leases`), if on.
    leases: Option<Arc<LeaseCounter>>,
    /// `--server-count-source`.
    count_source: ServerCountSource,
    /// Told when a server connection ends: wakes the sync loops.
    lost: tokio::sync::Notify,
}

impl AgentState {
    fn clients(&self) -> MutexGuard<'_, HashMap<ServerId, ClientEntry>> {
        self.clients.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Sets `draining` and sends DRAIN to every connected server, under the
    /// client lock: a connection [`register`](Self::register)ed at the same
    /// moment either is in the map here or sees the flag there, so an early
    /// signal (one racing the first connection) is never lost.
    fn start_draining(&self) {
        let clients = self.clients();
        self.draining.store(true, Ordering::SeqCst);
        for client in clients.values() {
            client.send_drain();
        }
    }

    /// Adds a new server connection unless one to `server_id` exists
    /// (`false`); tells it DRAIN at once if the agent is already draining.
    fn register(&self, server_id: ServerId, entry: ClientEntry, server_count: u32) -> bool {
        let mut clients = self.clients();
        if clients.contains_key(&server_id) {
            return false;
        }
        if self.draining.load(Ordering::SeqCst) {
            entry.send_drain();
        }
        clients.insert(server_id, entry);
        self.server_count.store(server_count, Ordering::Relaxed);
        true
    }

    /// Number of connected servers.
    pub(crate) fn server_connections(&self) -> usize {
        self.clients().len()
    }

    /// Number of open node-side connections over all servers.
    pub(crate) fn endpoint_connections(&self) -> usize {
        self.clients().values().map(|c| c.conns.len()).sum()
    }

    /// Node-side dials in progress over all servers.
    pub(crate) fn dials_in_progress(&self) -> usize {
        self.clients()
            .values()
            .map(|c| c.conns.dials_in_progress())
            .sum()
    }

    /// How many servers to hold connections to: the servers' answers, or
    /// the lease count, or the larger of both (`--server-count-source`);
    /// 0 counts as 1 (ANP).
    pub(crate) fn target_count(&self) -> usize {
        let answered = self.server_count.load(Ordering::Relaxed) as usize;
        let count = match (&self.leases, self.count_source) {
            (None, _) => answered,
            (Some(leases), ServerCountSource::Default) => leases.count(),
            (Some(leases), ServerCountSource::Max) => leases.count().max(answered),
        };
        count.max(1)
    }

    /// Whether the sync loop of `--proxy-server-host` entry `address` (of
    /// `addresses`) should open a connection now: always with
    /// `--sync-forever`; when it has none; and, once every entry has one,
    /// while fewer servers than the count are connected (entries that are
    /// load balancers lead to the missing ones).
    fn should_dial(&self, address: usize, addresses: usize, forever: bool) -> bool {
        if forever {
            return true;
        }
        let target = self.target_count();
        let clients = self.clients();
        let has = |i: usize| clients.values().any(|c| c.address == i);
        !has(address) || ((0..addresses).all(has) && clients.len() < target)
    }
}

impl Live for AgentState {
    fn server_connections(&self) -> usize {
        self.server_connections()
    }

    fn target_count(&self) -> usize {
        self.target_count()
    }

    fn endpoint_connections(&self) -> usize {
        self.endpoint_connections()
    }
}

/// Jittered exponential backoff: factor 1.5 up to the cap, as ANP's, but
/// each wait drawn from the upper half of the current step rather than
/// ANP's +10 %, so agents that failed together do not retry together.
/// A refused or unreachable server (see [`ConnectError::is_transient`]) is
/// retried within one `--sync-interval` and does not grow the step.
///
/// [`ConnectError::is_transient`]: crate::client::ConnectError::is_transient
struct Backoff {
    /// First and steady interval.
    initial: Duration,
    /// Upper bound.
    cap: Duration,
    /// The next un-jittered wait.
    current: Duration,
}

impl Backoff {
    fn new(initial: Duration, cap: Duration) -> Self {
        Self {
            initial,
            cap,
            current: initial,
        }
    }

    /// The wait after a failure: in the upper half of the current step,
    /// which then grows towards the cap.
    fn next_failure(&mut self) -> Duration {
        let wait = self.current.mul_f64(0.5 + 0.5 * fastrand::f64());
        self.current = self.current.mul_f64(1.5).min(self.cap);
        wait
    }

    /// The wait after a refused connection: anywhere within the first
    /// step; the step does not grow.
    fn refused(&self) -> Duration {
        spread(self.initial)
    }

    /// The wait after a success; resets the growth.
    fn success(&mut self) -> Duration {
        self.current = self.initial;
        jitter(self.initial)
    }

    /// The wait after a connection that reached a server the agent already
    /// had (a load balancer's pick): anywhere within the first step, and
    /// the growth reset. Two agents that each miss the server the other
    /// keeps being sent to, behind a round-robin balancer, would stay in
    /// step for minutes with `success`'s 10 % jitter (seen: 71 s); a pause
    /// drawn from the whole step reorders them within a few tries.
    fn duplicate(&mut self) -> Duration {
        self.current = self.initial;
        spread(self.initial)
    }
}

/// Adds up to 10 % (ANP's `wait.Jitter(d, 0.1)`).
fn jitter(d: Duration) -> Duration {
    d + d.mul_f64(0.1 * fastrand::f64())
}

/// Anywhere in `(0, d]`: how long an agent waits before reconnecting to a
/// server that went away, so that thousands of agents losing the same
/// server come back spread over `d`, not in one burst.
fn spread(d: Duration) -> Duration {
    d.mul_f64(1.0 - fastrand::f64())
}

/// Entry point: `Agent::bind(config)` then `Bound::serve(shutdown)`.
pub struct Agent;

impl Agent {
    /// Names the flags without effect and the deprecated ones given, then
    /// binds the health and admin listeners.
    ///
    /// # Errors
    /// The port is taken or the address unusable.
    pub async fn bind(config: Config) -> Result<Bound, AgentError> {
        // Before anything can fail, so an operator sees them either way.
        ops::flags::warn_flags(&config.not_implemented, &config.deprecated, &config.notices);
        // The certificates are read for each connection (the last good ones
        // are kept when they cannot be); a start-up with files that cannot
        // work fails here, naming the flag.
        let certs = CertMetrics::default();
        let tls = config.tls.follow(certs.clone())?;
        let health = bind_named(config.health_addr, "health").await?;
        let admin = bind_named(config.admin_addr, "admin").await?;
        // The lease watch reports its calls to its own metrics; the state
        // holds the lease count; the gauges read the state.
        let lease_metrics = LeaseMetrics::default();
        let (leases, lease_watch) = match &config.leases {
            Some(leases) => {
                let (counter, watch) = lease::counter(leases, lease_metrics.clone()).await?;
                (Some(counter), Some(watch))
            }
            None => (None, None),
        };
        let state = Arc::new(AgentState {
            clients: Mutex::new(HashMap::new()),
            server_count: AtomicU32::new(0),
            draining: Arc::new(AtomicBool::new(false)),
            leases,
            count_source: config.server_count_source,
            lost: tokio::sync::Notify::new(),
        });
        let live: Arc<dyn Live> = state.clone();
        let metrics = Arc::new(AgentMetrics::new(
            Arc::downgrade(&live),
            &lease_metrics,
            &certs,
            &config.tracing.spans_dropped(),
        ));
        // Read now: a policy that cannot be used stops the start, naming
        // the file and the line.
        let destinations = match &config.destination_policy {
            Some(path) => Destinations::load(path, metrics.clone())?,
            None => Destinations::allow_all(metrics.clone()),
        };
        let audit_log = ops::audit::AuditLog::start(config.audit.as_ref(), metrics.audit())
            .map_err(AgentError::Audit)?;
        Ok(Bound {
            audit_log,
            tls,
            health,
            admin,
            lease_watch,
            state,
            metrics,
            destinations,
            config,
        })
    }
}

/// An agent with its health port bound, ready to [`serve`](Bound::serve).
pub struct Bound {
    /// Validated configuration.
    config: Config,
    /// The TLS configuration of new server connections, following its files.
    tls: TlsFiles<rustls::ClientConfig>,
    /// Health listener.
    health: TcpListener,
    /// Admin listener (`/metrics` redirect, pprof).
    admin: TcpListener,
    /// The lease watch to run (`--count-server-leases`).
    lease_watch: Option<LeaseWatch>,
    /// Shared state.
    state: Arc<AgentState>,
    /// What the agent records.
    metrics: Arc<AgentMetrics>,
    /// The destination policy (`--destination-policy-file`).
    destinations: Destinations,
    /// The audit log (`--audit-log-path`); written out when serving ends.
    audit_log: ops::audit::AuditLog<ops::audit::AuditRecord>,
}

impl Bound {
    /// Address of the health listener.
    pub fn health_addr(&self) -> SocketAddr {
        self.health
            .local_addr()
            .expect("a bound TCP listener has an address")
    }

    /// Address of the admin listener.
    pub fn admin_addr(&self) -> SocketAddr {
        self.admin
            .local_addr()
            .expect("a bound TCP listener has an address")
    }

    /// A handle for observing the running agent.
    pub fn handle(&self) -> AgentHandle {
        AgentHandle {
            state: self.state.clone(),
        }
    }

    /// Connects to the server(s) and serves until `shutdown` resolves; every
    /// connection is closed when it returns.
    pub async fn serve(self, shutdown: impl Future<Output = ()>) {
        self.serve_with_drain(std::future::pending(), shutdown)
            .await;
    }

    /// Serves until `stop` (the second signal). When `drain` (the first
    /// signal) resolves before it, sends DRAIN to every server and stops
    /// connecting to new ones, but keeps serving (ANP): servers send a
    /// draining agent new dials only when no other agent fits. With
    /// `--exit-when-drained` it also returns once no connection is open.
    pub async fn serve_with_drain(
        self,
        drain: impl Future<Output = ()>,
        stop: impl Future<Output = ()>,
    ) {
        let Self {
            config,
            tls,
            health,
            admin,
            lease_watch,
            state,
            metrics,
            destinations,
            audit_log,
        } = self;
        let servers: Vec<String> = config.servers.iter().map(ToString::to_string).collect();
        info!(agent.id = %config.agent_id, ?servers, health.addr = ?health.local_addr().ok(), "proxy-agent starting");
        let token = CancellationToken::new();
        let tasks = TaskTracker::new();
        let health_port = health.local_addr().map_or(0, |a| a.port());
        tasks.spawn(ops::http::serve(
            edge::listen::incoming(health, "health"),
            health::router(metrics.clone(), state.clone()),
            token.clone(),
            "health",
        ));
        tasks.spawn(ops::http::serve(
            edge::listen::incoming(admin, "admin"),
            health::admin_router(health_port, config.profiling),
            token.clone(),
            "admin",
        ));
        if let Some(watch) = lease_watch {
            tasks.spawn(watch.run(token.clone()));
        }
        let config = Arc::new(config);
        let with = Connecting {
            tls: tls.clone(),
            metrics,
            destinations,
            audit: crate::audit::AgentAudit::new(
                audit_log.sink(),
                &config.agent_id.0,
                token.clone(),
            ),
        };
        for address in 0..config.servers.len() {
            tasks.spawn(sync_loop(
                config.clone(),
                with.clone(),
                address,
                state.clone(),
                token.clone(),
                tasks.clone(),
            ));
        }
        if let Some(every) = config.session_refresh {
            for address in 0..config.servers.len() {
                tasks.spawn(refresh_sessions(
                    config.clone(),
                    tls.clone(),
                    address,
                    every,
                    token.clone(),
                ));
            }
        }
        tokio::pin!(stop);
        let draining = tokio::select! {
            () = drain => true,
            () = &mut stop => false,
        };
        if draining {
            drained(&state, config.exit_when_drained, stop).await;
        }
        stop_tasks(&token, &tasks, audit_log).await;
    }
}

/// Ends every task, waits [`STOP_GRACE`] for them, then writes out the
/// audit log.
async fn stop_tasks(
    token: &CancellationToken,
    tasks: &TaskTracker,
    audit_log: ops::audit::AuditLog<ops::audit::AuditRecord>,
) {
    info!("stopping");
    token.cancel();
    tasks.close();
    if tokio::time::timeout(STOP_GRACE, tasks.wait())
        .await
        .is_err()
    {
        warn!(
            tasks = tasks.len(),
            "tasks did not stop within the grace period; leaving them"
        );
    }
    // Every connection has ended: its record is queued; write them out.
    audit_log.close(AUDIT_FLUSH_TIMEOUT).await;
    info!("stopped");
}

/// The first signal came: servers are told, and the agent serves on until
/// `stop` (the second signal) or, with `--exit-when-drained`, until no
/// connection is open.
async fn drained(state: &AgentState, exit_when_drained: bool, stop: impl Future<Output = ()>) {
    info!(
        connections = state.endpoint_connections(),
        exit_when_drained, "draining: telling servers, still serving until the second signal"
    );
    state.start_draining();
    tokio::pin!(stop);
    if exit_when_drained {
        // Open connections finish on their own; the second signal ends it
        // sooner.
        loop {
            if state.endpoint_connections() == 0 && state.dials_in_progress() == 0 {
                info!("drained: no open connections left");
                break;
            }
            tokio::select! {
                () = &mut stop => break,
                () = tokio::time::sleep(DRAIN_POLL) => {}
            }
        }
    } else {
        stop.await;
    }
    if state.endpoint_connections() > 0 {
        warn!(
            connections = state.endpoint_connections(),
            "second signal: closing open connections"
        );
    }
}

/// How often a draining agent checks whether its connections have finished.
const DRAIN_POLL: Duration = Duration::from_millis(100);
/// How long the audit log may take to write out its queued records when
/// the agent stops (a full default queue of 10,000 records takes well
/// under one).
const AUDIT_FLUSH_TIMEOUT: Duration = Duration::from_secs(5);

/// How long the agent's tasks may take to wind down once cancelled (an
/// HTTP request still being answered, a CPU profile) before `serve` returns
/// without them, as the server's listeners get.
pub const STOP_GRACE: Duration = Duration::from_secs(5);

/// Renews the TLS session tickets for `--proxy-server-host` entry
/// `address` every `every` (`--tls-session-refresh-interval`): a server's
/// ticket is good for one key rotation (a day by default), and an agent
/// connected for longer would otherwise do a full handshake, with a
/// signature, when that server restarts.
async fn refresh_sessions(
    config: Arc<Config>,
    tls: TlsFiles<rustls::ClientConfig>,
    address: usize,
    every: Duration,
    token: CancellationToken,
) {
    let target = &config.servers[address];
    loop {
        tokio::select! {
            () = token.cancelled() => return,
            () = tokio::time::sleep(jitter(every)) => {}
        }
        let refreshed = tokio::select! {
            () = token.cancelled() => return,
            r = Client::refresh_session(&config, tls.current(), target) => r,
        };
        match refreshed {
            Ok(()) => debug!(server = %target, "TLS session tickets renewed"),
            Err(error) => {
                debug!(server = %target, error = %DisplayErrorStack(&error), "cannot renew TLS session tickets; the next reconnect may need a full handshake")
            }
        }
    }
}

/// What every server connection is made with, besides its address.
#[derive(Clone)]
struct Connecting {
    /// TLS, following its files.
    tls: TlsFiles<rustls::ClientConfig>,
    /// What the agent records.
    metrics: Arc<AgentMetrics>,
    /// The destination policy its dials follow.
    destinations: Destinations,
    /// Where its dials' audit records go.
    audit: crate::audit::AgentAudit,
}

/// Keeps one client per server for `--proxy-server-host` entry `address`:
/// connects when [`AgentState::should_dial`] says so, backing off on failures.
async fn sync_loop(
    config: Arc<Config>,
    with: Connecting,
    address: usize,
    state: Arc<AgentState>,
    token: CancellationToken,
    tasks: TaskTracker,
) {
    let Connecting {
        tls,
        metrics,
        destinations,
        audit,
    } = with;
    let target = &config.servers[address];
    let mut backoff = Backoff::new(config.sync_interval, config.sync_interval_cap);
    loop {
        let wait = if state.draining.load(Ordering::SeqCst) {
            // Draining: no new server connections.
            jitter(config.sync_interval)
        } else if state.should_dial(address, config.servers.len(), config.sync_forever) {
            match Client::connect(&config, tls.current(), target, metrics.clone()).await {
                Ok(client) => {
                    let client = client
                        .with_destinations(destinations.clone())
                        .with_audit(audit.clone());
                    if add_client(&state, client, address, &token, &tasks) {
                        backoff.success()
                    } else {
                        backoff.duplicate()
                    }
                }
                Err(error) if error.is_transient() => {
                    warn!(error = %DisplayErrorStack(&error), "proxy-server refused or unreachable; will retry soon");
                    backoff.refused()
                }
                Err(error) => {
                    warn!(error = %DisplayErrorStack(&error), "cannot connect to proxy-server; will retry");
                    backoff.next_failure()
                }
            }
        } else {
            jitter(config.sync_interval)
        };
        let lost = state.lost.notified();
        tokio::select! {
            () = token.cancelled() => return,
            () = tokio::time::sleep(wait) => {}
            () = lost => {
                // A server connection ended: reconnect after a pause drawn
                // from one interval, not in step with every other agent
                // that lost the same server.
                tokio::select! {
                    () = token.cancelled() => return,
                    () = tokio::time::sleep(spread(config.sync_interval)) => {}
                }
            }
        }
    }
}

fn add_client(
    state: &Arc<AgentState>,
    client: Client,
    address: usize,
    token: &CancellationToken,
    tasks: &TaskTracker,
) -> bool {
    let server_id = client.server_id.clone();
    let cancel = token.child_token();
    let conns = Connections::new(client.scheme, &cancel);
    let entry = ClientEntry {
        cancel: cancel.clone(),
        conns: conns.clone(),
        out_tx: client.sender(),
        address,
    };
    if !state.register(server_id.clone(), entry, client.server_count) {
        tracing::debug!(server.id = %server_id, "already connected to this server; closing the duplicate");
        return false;
    }
    info!(server.id = %server_id, server.count = client.server_count, credit = client.scheme.is_credit(), "connected to proxy-server");
    let state = state.clone();
    let span = info_span!("client", server.id = %server_id);
    tasks.spawn(
        async move {
            client.serve(conns, cancel).await;
            state.clients().remove(&server_id);
            state.lost.notify_waiters();
            info!("disconnected from proxy-server");
        }
        .instrument(span),
    );
    true
}

/// Observes a running agent.
#[derive(Clone)]
pub struct AgentHandle {
    /// Shared state.
    state: Arc<AgentState>,
}

impl AgentHandle {
    /// Number of connected servers.
    pub fn server_connections(&self) -> usize {
        self.state.server_connections()
    }

    /// Number of open node-side connections.
    pub fn endpoint_connections(&self) -> usize {
        self.state.endpoint_connections()
    }

    /// The server count the agent works towards (ANP's
    /// `known_server_count`).
    pub fn known_server_count(&self) -> usize {
        self.state.target_count()
    }

    /// Whether the agent is draining.
    pub fn is_draining(&self) -> bool {
        self.state.draining.load(Ordering::SeqCst)
    }

    /// Node-side dials in progress.
    pub fn dials_in_progress(&self) -> usize {
        self.state.dials_in_progress()
    }

    /// Cancels every server connection at once, as a dead network would.
    pub fn disconnect_all(&self) {
        for client in self.state.clients().values() {
            client.cancel.cancel();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_to_the_cap_and_resets() {
        let mut b = Backoff::new(Duration::from_secs(1), Duration::from_secs(10));
        let waits: Vec<Duration> = (0..10).map(|_| b.next_failure()).collect();
        let within = |d: Duration, lo: u64, hi: u64| {
            d >= Duration::from_millis(lo) && d <= Duration::from_millis(hi)
        };
        assert!(within(waits[0], 500, 1000), "{:?}", waits[0]);
        assert!(within(waits[1], 750, 1500), "{:?}", waits[1]);
        assert!(within(waits[9], 5000, 10_000), "capped: {:?}", waits[9]);
        // Refusals wait at most one step and do not grow it.
        for _ in 0..100 {
            assert!(within(b.refused(), 0, 1000));
        }
        let reset = b.success();
        assert!(within(reset, 1000, 1100), "{reset:?}");
        assert!(within(b.next_failure(), 500, 1000));
    }

    #[test]
    fn waits_of_agents_that_failed_together_are_spread() {
        // 1,000 agents losing one server: their pauses cover the interval
        // rather than falling in one millisecond.
        let interval = Duration::from_secs(1);
        let mut buckets = [0usize; 10];
        for _ in 0..1000 {
            let wait = spread(interval);
            assert!(wait > Duration::ZERO && wait <= interval, "{wait:?}");
            buckets[(wait.as_millis() as usize * 10 / 1001).min(9)] += 1;
        }
        assert!(buckets.iter().all(|&n| n > 0), "{buckets:?}");
        let mut b = Backoff::new(interval, Duration::from_secs(10));
        let failed: Vec<Duration> = (0..1000)
            .map(|_| {
                b.current = interval;
                b.next_failure()
            })
            .collect();
        let distinct: std::collections::HashSet<_> = failed.iter().map(|d| d.as_millis()).collect();
        assert!(distinct.len() > 100, "{} distinct waits", distinct.len());
    }

    /// Two agents behind a round-robin balancer, each missing the server
    /// the other keeps being sent to, as the soak saw them (20 ms apart,
    /// connects alternating): how many tries until both have both
    /// servers, with `wait` after each duplicate.
    fn tries_until_both(mut wait: impl FnMut() -> Duration) -> usize {
        // (next try, the server it misses); the balancer's next pick.
        let mut agents = [
            (Duration::ZERO, Some(1u8)),
            (Duration::from_millis(20), Some(0u8)),
        ];
        let mut next_pick = 0u8;
        for tries in 1..=10_000 {
            let Some(i) = (0..2)
                .filter(|&i| agents[i].1.is_some())
                .min_by_key(|&i| agents[i].0)
            else {
                return tries - 1;
            };
            let picked = next_pick;
            next_pick = 1 - next_pick;
            if agents[i].1 == Some(picked) {
                agents[i].1 = None;
            } else {
                // The connect and handshake, then the pause.
                agents[i].0 += Duration::from_millis(10) + wait();
            }
        }
        10_000
    }

    #[test]
    fn agents_in_step_behind_a_round_robin_balancer_fall_out_of_step() {
        fastrand::seed(7);
        let p99 = |mut tries: Vec<usize>| {
            tries.sort_unstable();
            tries[tries.len() * 99 / 100]
        };
        let interval = Duration::from_millis(200);
        let mut b = Backoff::new(interval, Duration::from_secs(2));
        let ours = p99((0..1000)
            .map(|_| tries_until_both(|| b.duplicate()))
            .collect());
        let in_step = p99((0..1000)
            .map(|_| tries_until_both(|| b.success()))
            .collect());
        eprintln!(
            "99th percentile of tries: {ours} drawn from the step, {in_step} with 10 % jitter"
        );
        assert!(ours <= 16, "99 % of pairs within {ours} tries");
        assert!(
            in_step > 4 * ours,
            "the 10 % jitter: {in_step} tries, ours {ours}"
        );
        for _ in 0..100 {
            let d = b.duplicate();
            assert!(d > Duration::ZERO && d <= interval, "{d:?}");
        }
    }

    fn state() -> AgentState {
        AgentState {
            clients: Mutex::new(HashMap::new()),
            server_count: AtomicU32::new(0),
            draining: Arc::new(AtomicBool::new(false)),
            leases: None,
            count_source: ServerCountSource::Default,
            lost: tokio::sync::Notify::new(),
        }
    }

    fn entry(cancel: &CancellationToken) -> (ClientEntry, tunnel::queue::QueueRx<proto::Packet>) {
        let (out_tx, out_rx) = tunnel::queue::queue(1 << 20, 1 << 10);
        let entry = ClientEntry {
            cancel: cancel.clone(),
            conns: Connections::new(
                tunnel::flow::Scheme::Credit {
                    ours: tunnel::flow::Window::V1,
                    theirs: tunnel::flow::Window::V1,
                },
                cancel,
            ),
            out_tx,
            address: 0,
        };
        (entry, out_rx)
    }

    fn is_drain(rx: &mut tunnel::queue::QueueRx<proto::Packet>) -> bool {
        let waker = futures_util::task::noop_waker();
        let mut cx = std::task::Context::from_waker(&waker);
        match rx.poll_recv(&mut cx) {
            std::task::Poll::Ready(Some(packet)) => {
                matches!(packet.into_kind(), proto::packet::PacketKind::Drain)
            }
            _ => false,
        }
    }

    #[test]
    fn a_server_connection_registered_after_the_drain_signal_is_told_drain() {
        let state = state();
        let cancel = CancellationToken::new();
        let (before, mut before_rx) = entry(&cancel);
        assert!(state.register(ServerId("a".into()), before, 1));
        state.start_draining();
        assert!(is_drain(&mut before_rx), "a connected server is told");
        // The connection that completes after the signal (the race an early
        // SIGTERM hits) is told too.
        let (after, mut after_rx) = entry(&cancel);
        assert!(state.register(ServerId("b".into()), after, 2));
        assert!(is_drain(&mut after_rx), "a server connected later is told");
        // A duplicate is refused and told nothing.
        let (duplicate, mut duplicate_rx) = entry(&cancel);
        assert!(!state.register(ServerId("b".into()), duplicate, 2));
        assert!(!is_drain(&mut duplicate_rx));
    }

    #[test]
    fn before_the_drain_signal_a_server_connection_is_told_nothing() {
        let state = state();
        let cancel = CancellationToken::new();
        let (entry, mut rx) = entry(&cancel);
        assert!(state.register(ServerId("a".into()), entry, 1));
        assert!(!is_drain(&mut rx));
    }
}
