//! [`TestAgent`]: an in-process proxy-agent.

use std::{net::SocketAddr, path::PathBuf, time::Duration};

use proxy_agent::agent::{Agent, AgentHandle};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tunnel::ids::AgentId;

use crate::{Pki, TestServer, trace_init};

/// Options of a [`TestAgent`].
#[derive(Clone, Default)]
pub struct AgentOpts {
    /// `--agent-id` (default: a fresh one).
    pub agent_id: Option<String>,
    /// `--agent-identifiers`.
    pub identifiers: String,
    /// Present no client certificate.
    pub no_client_cert: bool,
    /// Use the other PKI (wrong CA for the server).
    pub foreign_pki: bool,
    /// Do not offer per-connection flow control (behave like an ANP agent).
    pub no_flow_control: bool,
    /// `--flow-control-window` and `--flow-control-max-chunk`.
    pub flow_window: tunnel::flow::Window,
    /// `--flow-control-version`.
    pub flow_version: tunnel::flow::Version,
    /// `--service-account-token-path`.
    pub token_path: Option<PathBuf>,
    /// `--destination-policy-file`.
    pub destination_policy: Option<PathBuf>,
    /// `--proxy-url`.
    pub proxy: Option<edge::egress::Proxy>,
    /// More `--proxy-server-host` entries after the first address.
    pub more_servers: Vec<SocketAddr>,
    /// `--keepalive-time` (default 1 h).
    pub keepalive_time: Option<Duration>,
    /// `--count-server-leases` and where.
    pub leases: Option<proxy_agent::config::LeaseCountConfig>,
    /// `--server-count-source`.
    pub server_count_source: proxy_agent::config::ServerCountSource,
    /// `--tls-session-refresh-interval` (default: never).
    pub session_refresh: Option<Duration>,
    /// `--sync-forever`.
    pub sync_forever: bool,
    /// `--enable-profiling`.
    pub profiling: bool,
    /// `--exit-when-drained`.
    pub exit_when_drained: bool,
    /// `--audit-log-path`.
    pub audit_log: Option<PathBuf>,
}

/// An in-process proxy-agent.
pub struct TestAgent {
    /// Observes the agent.
    pub handle: AgentHandle,
    /// Health listener.
    pub health_addr: SocketAddr,
    /// Admin listener.
    pub admin_addr: SocketAddr,
    /// Stops the agent.
    shutdown: CancellationToken,
    /// The serving task.
    task: Option<JoinHandle<()>>,
}

/// The agent configuration the tests use against `agent_addr`.
pub fn agent_config(agent_addr: SocketAddr, opts: &AgentOpts) -> proxy_agent::config::Config {
    let pki = if opts.foreign_pki {
        Pki::other()
    } else {
        Pki::get()
    };
    let tls = proxy_agent::config::ClientTls::new(
        Pki::get().path("agent-ca.crt"),
        (!opts.no_client_cert).then(|| (pki.path("proxy-agent.crt"), pki.path("proxy-agent.key"))),
    );
    let servers = std::iter::once(agent_addr)
        .chain(opts.more_servers.iter().copied())
        .map(|addr| proxy_agent::config::ServerAddr {
            proxy: opts.proxy.clone(),
            ..proxy_agent::config::ServerAddr::new(addr.ip().to_string(), addr.port())
        })
        .collect();
    proxy_agent::config::Config {
        servers,
        tls,
        agent_id: AgentId(
            opts.agent_id
                .clone()
                .unwrap_or_else(|| format!("agent-{}", fastrand_id())),
        ),
        agent_identifiers: opts.identifiers.clone(),
        health_addr: "127.0.0.1:0".parse().expect("address"),
        admin_addr: "127.0.0.1:0".parse().expect("address"),
        profiling: opts.profiling,
        tracing_config: None,
        tracing: ops::otel::Tracing::off(),
        sync_interval: Duration::from_millis(100),
        sync_interval_cap: Duration::from_secs(1),
        session_refresh: opts.session_refresh,
        sync_forever: opts.sync_forever,
        probe_interval: Duration::from_millis(100),
        keepalive_time: opts.keepalive_time.unwrap_or(Duration::from_secs(3600)),
        flow_control: !opts.no_flow_control,
        flow_window: opts.flow_window,
        flow_version: opts.flow_version,
        exit_when_drained: opts.exit_when_drained,
        max_server_queue_bytes: 4 << 20,
        token_path: opts.token_path.clone(),
        destination_policy: opts.destination_policy.clone(),
        leases: opts.leases.clone(),
        server_count_source: opts.server_count_source,
        audit: opts.audit_log.as_deref().map(crate::audit::config),
        not_implemented: Vec::new(),
        deprecated: Vec::new(),
        notices: Vec::new(),
    }
}

fn fastrand_id() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(1);
    u64::from(std::process::id()) << 20 | NEXT.fetch_add(1, Ordering::Relaxed)
}

impl TestAgent {
    /// Starts an agent for `server` and waits until the server sees it.
    pub async fn start(server: &TestServer) -> Self {
        let before = server.handle.backend_count();
        let agent = Self::start_with(server.agent_addr, AgentOpts::default()).await;
        server.wait_for_backends(before + 1).await;
        agent
    }

    /// Starts an agent against `agent_addr`; returns once it is bound (it
    /// may not be connected yet).
    pub async fn start_with(agent_addr: SocketAddr, opts: AgentOpts) -> Self {
        // A drain signal that never comes: `Bound::serve`.
        Self::start_drainable_with(agent_addr, opts, CancellationToken::new()).await
    }

    /// Starts an agent whose first "signal" is `drain` (DRAIN, keep
    /// serving) and second the agent's own shutdown (drop or
    /// [`TestAgent::stop`]).
    pub async fn start_drainable(agent_addr: SocketAddr, drain: CancellationToken) -> Self {
        Self::start_drainable_with(agent_addr, AgentOpts::default(), drain).await
    }

    /// [`TestAgent::start_drainable`] with options.
    pub async fn start_drainable_with(
        agent_addr: SocketAddr,
        opts: AgentOpts,
        drain: CancellationToken,
    ) -> Self {
        trace_init();
        let bound = Agent::bind(agent_config(agent_addr, &opts))
            .await
            .expect("binding the agent");
        let shutdown = CancellationToken::new();
        let handle = bound.handle();
        let health_addr = bound.health_addr();
        let admin_addr = bound.admin_addr();
        let token = shutdown.clone();
        let task = tokio::spawn(async move {
            bound
                .serve_with_drain(drain.cancelled_owned(), token.cancelled_owned())
                .await;
        });
        Self {
            handle,
            health_addr,
            admin_addr,
            shutdown,
            task: Some(task),
        }
    }

    /// Whether the agent's serve loop has returned.
    pub fn has_exited(&self) -> bool {
        self.task.as_ref().is_none_or(JoinHandle::is_finished)
    }

    /// Stops the agent and waits until it has stopped.
    pub async fn stop(mut self) {
        self.shutdown.cancel();
        if let Some(task) = self.task.take() {
            task.await.expect("agent task");
        }
    }
}

impl Drop for TestAgent {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}
