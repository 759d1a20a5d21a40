//! Command-line flags (ANP's names and defaults) and their validated form.

use std::{net::SocketAddr, path::PathBuf, sync::Arc, time::Duration};

use clap::{ArgAction, Parser};
use ops::{
    flags::{
        Deprecated, FlowArgs, FlowControlVersion, GoBoolArg, LogArgs, RuntimeArgs, go_duration,
    },
    tls::{self, files},
};
use tunnel::{
    flow::{self, Window},
    ids::ServerId,
};

use crate::{
    auth::TokenAuthConfig,
    lease::{LeaseConfig, parse_labels},
    router::{DialCaps, DialPolicy, HedgeDelay},
    strategy::{ProxyStrategy, parse_strategies},
};

/// proxy-server: serves kube-apiserver (frontends) and proxy-agents (backends).
///
/// Flag names and defaults are ANP's, so an existing manifest works unchanged.
#[derive(Debug, Clone, Parser)]
#[command(name = "proxy-server", version, about, args_override_self = true)]
pub struct Args {
    /// Frontend TLS certificate (TCP frontend only).
    #[arg(long, value_name = "PATH", value_parser = ops::flags::path)]
    pub server_cert: Option<PathBuf>,
    /// Frontend TLS private key (TCP frontend only).
    #[arg(long, value_name = "PATH", value_parser = ops::flags::path)]
    pub server_key: Option<PathBuf>,
    /// CA that frontend client certificates must chain to; required for the TCP frontend.
    #[arg(long, value_name = "PATH", value_parser = ops::flags::path)]
    pub server_ca_cert: Option<PathBuf>,
    /// TLS certificate of the agent listener.
    #[arg(long, value_name = "PATH", value_parser = ops::flags::path)]
    pub cluster_cert: Option<PathBuf>,
    /// TLS private key of the agent listener.
    #[arg(long, value_name = "PATH", value_parser = ops::flags::path)]
    pub cluster_key: Option<PathBuf>,
    /// If set, agents must present a client certificate that chains to this CA (mTLS).
    #[arg(long, value_name = "PATH", value_parser = ops::flags::path)]
    pub cluster_ca_cert: Option<PathBuf>,
    /// Frontend protocol.
    #[arg(long, value_enum, default_value_t = Mode::Grpc)]
    pub mode: Mode,
    /// Unix socket path of the frontend, mode 0770 from the moment it
    /// exists (bound in a private directory beside it, then renamed into
    /// place); when set, --server-port must be 0.
    #[arg(long, value_name = "PATH", value_parser = ops::flags::path)]
    pub uds_name: Option<PathBuf>,
    /// Remove a stale file at --uds-name before listening.
    #[arg(long, go_bool = Some(true))]
    pub delete_existing_uds_file: bool,
    /// TCP port of the frontend (0 with --uds-name).
    #[arg(long, default_value_t = 8090)]
    pub server_port: u16,
    /// Bind address of the TCP frontend; empty means all interfaces.
    #[arg(long, default_value = "")]
    pub server_bind_address: String,
    /// Port agents connect to (0 picks a free port).
    #[arg(long, default_value_t = 8091)]
    pub agent_port: u16,
    /// Bind address of the agent listener; empty means all interfaces.
    #[arg(long, default_value = "")]
    pub agent_bind_address: String,
    /// Admin port (metrics, profiling).
    #[arg(long, default_value_t = 8095)]
    pub admin_port: u16,
    /// Bind address of the admin port.
    #[arg(long, default_value = "127.0.0.1")]
    pub admin_bind_address: String,
    /// Health port: /healthz, /readyz, /ready (0 picks a free port).
    #[arg(long, default_value_t = 8092)]
    pub health_port: u16,
    /// Bind address of the health port; empty means all interfaces.
    #[arg(long, default_value = "")]
    pub health_bind_address: String,
    /// Interval of HTTP/2 keepalive pings on agent connections (Go duration).
    #[arg(long, default_value = "1h0m0s", value_parser = go_duration)]
    pub keepalive_time: Duration,
    /// Interval of HTTP/2 keepalive pings on gRPC frontend connections (Go duration).
    #[arg(long, default_value = "1h0m0s", value_parser = go_duration)]
    pub frontend_keepalive_time: Duration,
    /// Tunnels (gRPC streams) one frontend connection may have open at once
    /// (konnectivity-rs; its SETTINGS_MAX_CONCURRENT_STREAMS): kube-apiserver's
    /// reusable tunnel carries every tunnel on one connection. More wait for
    /// a free one, as HTTP/2 clients do.
    #[arg(long, default_value_t = 100_000, value_parser = clap::value_parser!(u32).range(1..))]
    pub frontend_max_concurrent_streams: u32,
    /// Streams one agent connection may have open at once (konnectivity-rs;
    /// its SETTINGS_MAX_CONCURRENT_STREAMS). An agent opens one `Connect`
    /// stream per connection; the bound keeps one connection from opening
    /// streams without end, each waiting for a token review.
    #[arg(long, default_value_t = DEFAULT_AGENT_MAX_CONCURRENT_STREAMS, value_parser = clap::value_parser!(u32).range(1..))]
    pub agent_max_concurrent_streams: u32,
    /// Serve pprof-format profiles on the admin port.
    #[arg(long, go_bool = Some(false))]
    pub enable_profiling: bool,
    /// kube-apiserver's TracingConfiguration file (YAML or JSON: endpoint,
    /// samplingRatePerMillion): dials and tunnels as OpenTelemetry spans,
    /// exported over OTLP/gRPC. Unset: no traces.
    #[arg(long)]
    pub tracing_config_file: Option<std::path::PathBuf>,
    /// Enable contention profiling (requires --enable-profiling).
    #[arg(long, go_bool = Some(false))]
    pub enable_contention_profiling: bool,
    /// Unique id of this server, sent to agents (default: env PROXY_SERVER_ID, else a random UUID).
    #[arg(long, env = "PROXY_SERVER_ID", default_value = "")]
    pub server_id: String,
    /// Number of proxy-server replicas, sent to agents.
    #[arg(long, default_value_t = 1)]
    pub server_count: u32,
    /// Expected namespace of the agents' service account (turns token auth on).
    #[arg(long, default_value = "")]
    pub agent_namespace: String,
    /// Expected name of the agents' service account.
    #[arg(long, default_value = "")]
    pub agent_service_account: String,
    /// Audience the agents' tokens must carry.
    #[arg(long, default_value = "")]
    pub authentication_audience: String,
    /// Start although the agent port authenticates no agent (neither
    /// --cluster-ca-cert nor service-account token auth): anyone who can
    /// reach it can register as an agent and be sent kube-apiserver's
    /// traffic to nodes. Without this flag such a start is refused; with
    /// it, a warning says so at start-up (konnectivity-rs; ANP starts
    /// without a word).
    #[arg(long, go_bool = Some(false))]
    pub allow_unauthenticated_agents: bool,
    /// Kubeconfig for TokenReview and leases; empty means in-cluster config.
    #[arg(long, value_name = "PATH", value_parser = ops::flags::path)]
    pub kubeconfig: Option<PathBuf>,
    /// Kube client queries per second (0: client default).
    #[arg(long, default_value_t = 0.0)]
    pub kubeconfig_qps: f32,
    /// Kube client burst (0: client default).
    #[arg(long, default_value_t = 0)]
    pub kubeconfig_burst: u32,
    /// Content type of kube API requests (ANP's default:
    /// application/vnd.kubernetes.protobuf); this build speaks
    /// application/json only, and names any other value at start-up.
    #[arg(long, value_name = "TYPE")]
    pub kube_api_content_type: Option<String>,
    /// Ordered, comma-separated backend selection strategies: default, destHost, defaultRoute.
    #[arg(long, default_value = "default")]
    pub proxy_strategies: String,
    /// With client certificates (--cluster-ca-cert): accept an agent's
    /// host=, ipv4= and ipv6= identifiers only when its certificate names
    /// them among its subject alternative names (DNS names, IP addresses),
    /// and no cidr=; an agent that claims more is refused (konnectivity-rs).
    #[arg(long, go_bool = Some(false))]
    pub verify_agent_identifiers: bool,
    /// Comma-separated TLS cipher suites (IANA names) of both listeners;
    /// repeating the flag appends.
    #[arg(long, default_value = "[]", action = ArgAction::Append)]
    pub cipher_suites: Vec<String>,
    /// Minimum TLS version of both listeners (VersionTLS12, VersionTLS13).
    #[arg(long, default_value = "")]
    pub tls_min_version: String,
    /// Capacity, in packets, of the per-stream receive and send channels
    /// (ANP: 10). Accepted and checked; our queues are bounded in bytes.
    #[arg(long)]
    pub xfr_channel_size: Option<usize>,
    /// Packets ANP queues per HTTP-CONNECT connection between the agent
    /// stream's receive loop and the client's socket (ANP #896/#918;
    /// ANP's default 10; 0: ANP writes from the receive loop). Accepted
    /// (0 too, negative refused) and named at start-up, without effect:
    /// here every connection already has that lane, a buffer bounded in
    /// bytes by its flow window, and the receive loop never writes to a
    /// socket, whatever the value.
    #[arg(long, value_name = "PACKETS", allow_negative_numbers = true, value_parser = write_channel_size)]
    pub frontend_write_channel_size: Option<i64>,
    /// Publish and renew this server's Lease.
    #[arg(long, go_bool = Some(false))]
    pub enable_lease_controller: bool,
    /// Namespace of the leases.
    #[arg(long, default_value = "kube-system")]
    pub lease_namespace: String,
    /// Labels (comma-separated k=v) put on the lease.
    #[arg(long, default_value = "k8s-app=konnectivity-server")]
    pub lease_label: String,
    /// Time allowed for a graceful shutdown (Go duration; 0 disables).
    #[arg(long, default_value = "0s", value_parser = go_duration)]
    pub graceful_shutdown_timeout: Duration,
    /// Bound on forwarding a DIAL_REQ to an agent and on waiting for its DIAL_RSP (Go duration; 0 disables).
    #[arg(long, default_value = "0s", value_parser = go_duration)]
    pub backend_dial_timeout: Duration,
    /// How many times a dial goes to another agent when its agent fails it
    /// before any DIAL_RSP established it: its stream ended, or it answered
    /// connection refused, no route to host or network unreachable (never
    /// after a timeout, the frontend's DIAL_CLS or past
    /// --backend-dial-timeout; konnectivity-rs; 0: as ANP; at most 8).
    #[arg(long, default_value_t = 1)]
    pub backend_dial_retries: u32,
    /// Ask a second agent when the first has not answered a dial within
    /// --backend-dial-hedge-delay, where the strategies offer one; the first
    /// DIAL_RSP wins, the other attempt is cancelled (konnectivity-rs).
    #[arg(long, go_bool = Some(false))]
    pub backend_dial_hedge: bool,
    /// When --backend-dial-hedge asks a second agent: `pNN`, that
    /// percentile of the latest 1024 established dials' latencies (at
    /// least 1ms; 100ms until 32 were seen), or a Go duration
    /// (konnectivity-rs).
    #[arg(long, default_value = "p95", value_parser = hedge_delay)]
    pub backend_dial_hedge_delay: HedgeDelay,
    /// Deprecated (as in ANP), no effect; named at start-up when given.
    #[arg(long, hide = true, go_bool = None)]
    pub warn_on_channel_limit: Option<bool>,
    /// Offer per-connection flow control to agents that ask for it
    /// (konnectivity-rs agents); ANP agents never see a difference.
    #[arg(long, go_bool = Some(true))]
    pub flow_control: bool,
    /// The window offered with it.
    #[command(flatten)]
    pub flow: FlowArgs,
    /// Bytes queued towards one agent stream before the frontends sending
    /// to it wait (konnectivity-rs). 1 MiB more is kept for control
    /// packets; an agent that leaves even that unread is taken to have
    /// stopped reading, and its stream is closed.
    #[arg(long, default_value_t = 4 * 1024 * 1024)]
    pub max_agent_queue_bytes: usize,
    /// Bytes of DATA the whole server holds for peers that are not taking
    /// them, over every stream and connection (konnectivity-rs): half for
    /// what frontends' streams read ahead of uploads waiting for their
    /// agents, half for agents' DATA queued for frontends; each queued
    /// packet counts a fixed overhead beyond its bytes. At the limit a
    /// frontend stream stops reading and an agent stream waits (plain
    /// backpressure), and a connection whose upload or download made no
    /// progress for 5 s is closed with an error at both ends. An upload
    /// that goes straight on costs nothing.
    #[arg(long, default_value_t = DEFAULT_BUFFER_BUDGET)]
    pub buffer_budget_bytes: usize,
    /// Connections whose TLS handshake has not finished, per TLS listener
    /// (agents, TCP frontend) (konnectivity-rs). At the cap new connections
    /// wait in the listen backlog, and while no handshake waits for its
    /// turn a pending one whose peer is silent (no ClientHello for 1 s, or
    /// nothing for 5 s after the server's flight) is dropped for each; a
    /// handshake that makes progress is never dropped. Handshakes are taken
    /// up in arrival order, one per worker thread at a time; each has 10 s
    /// for its ClientHello from its accept and 30 s for the rest from when
    /// the server takes it up. At its
    /// largest (18446744073709551615): no admission at all (no cap, every
    /// handshake taken up as soon as its ClientHello is in).
    #[arg(long, default_value_t = 8192)]
    pub max_tls_handshakes: usize,
    /// Issue TLS session tickets on the agent listener, so that an agent
    /// reconnecting to any replica, or to this server after a restart,
    /// resumes without a certificate signature (konnectivity-rs).
    #[arg(long, go_bool = Some(true))]
    pub tls_session_tickets: bool,
    /// File of at least 32 secret bytes the session-ticket keys are derived
    /// from, the same on every replica; empty: the agent listener's own
    /// --cluster-key (konnectivity-rs).
    #[arg(long, value_name = "PATH", value_parser = ops::flags::path)]
    pub tls_session_ticket_key: Option<PathBuf>,
    /// How long each session-ticket key is used, at most 168h (RFC 8446
    /// caps a ticket's lifetime at 7 days); a ticket is offered for one
    /// rotation and accepted for at most two (konnectivity-rs, Go
    /// duration).
    #[arg(long, default_value = "24h0m0s", value_parser = go_duration)]
    pub tls_session_ticket_rotation: Duration,
    /// How long an agent token the TokenReview API accepted is admitted
    /// without another review (never past the token's own expiry): a
    /// revoked service account keeps its agents at most this long; 0s
    /// reviews every connection (konnectivity-rs, Go duration).
    #[arg(long, default_value = "2m0s", value_parser = go_duration)]
    pub token_review_cache_ttl: Duration,
    /// TokenReview calls in flight at once; concurrent reviews of one
    /// token are always one call (konnectivity-rs).
    #[arg(long, default_value_t = 32)]
    pub token_review_max_inflight: usize,
    /// Agent connects waiting for a token review at once (for a call, or
    /// for another connect's call of the same token); more are refused with
    /// `Unavailable` and retry (konnectivity-rs). A call waits at most 15 s
    /// for one of --token-review-max-inflight.
    #[arg(long, default_value_t = crate::auth::DEFAULT_MAX_PENDING)]
    pub token_review_max_pending: usize,
    /// Refuse, without a TokenReview, agent tokens that cannot be valid
    /// service-account tokens: not a JWT, an aud claim without
    /// --authentication-audience, exp past or nbf ahead by more than 5
    /// minutes, a signature that does not verify under the cluster's
    /// service-account key its header names (read from /openid/v1/jwks).
    /// A slowed address's tokens that do verify wait their turn, uncapped.
    /// The review stays the authority. Set false if the cluster's
    /// authenticators admit agents with other tokens (webhook, static,
    /// legacy tokens without aud) (konnectivity-rs).
    #[arg(long, go_bool = Some(true))]
    pub token_review_local_checks: bool,
    /// Frontend connections open at once, in either mode (konnectivity-rs):
    /// an HTTP-CONNECT client over it is answered 503 and closed, a gRPC
    /// connection over it is closed at once (grpc-go retries it after its
    /// backoff). Each connection costs memory beyond the buffer budget (its
    /// HTTP/2 and TLS state, a 64 KiB window per open gRPC stream).
    #[arg(long, default_value_t = 65_536)]
    pub max_http_connections: usize,
    /// Dials pending at once on one frontend stream (konnectivity-rs); more
    /// are refused at once with a DIAL_RSP error naming this flag.
    /// kube-apiserver's streams carry one dial each.
    #[arg(long, default_value_t = DialCaps::default().per_frontend)]
    pub max_pending_dials_per_frontend: usize,
    /// Dials sent to one agent stream and not yet answered (konnectivity-rs);
    /// an agent at the cap is not picked: another agent of the strategy
    /// takes the dial, or it is refused with an error naming this flag.
    #[arg(long, default_value_t = DialCaps::default().per_agent)]
    pub max_pending_dials_per_agent: usize,
    /// Agent streams open at once under one credential: its client
    /// certificate with --verify-agent-identifiers, its node with a token
    /// bound to a node, else its agent id (konnectivity-rs). An agent has
    /// one stream per server, two while it reconnects; more are refused.
    #[arg(long, default_value_t = DialCaps::default().streams_per_credential)]
    pub max_agent_streams_per_credential: usize,
    /// How long a connection's frontend may leave its queued bytes untaken
    /// before the connection is closed with an error at both ends
    /// (konnectivity-rs); 0 never closes. With agents that do not
    /// negotiate flow control the bound is 5 s, as their stream stalls.
    #[arg(long, default_value = "5m", value_parser = go_duration)]
    pub frontend_stall_timeout: Duration,
    /// The audit log: a JSON line per tunnel at its end (kube-apiserver's
    /// `--audit-log-*` flags).
    #[command(flatten)]
    pub audit: ops::audit::AuditArgs,
    /// klog-compatible logging flags.
    #[command(flatten)]
    pub log: LogArgs,
    /// The async runtime's size (`--worker-threads`).
    #[command(flatten)]
    pub runtime: RuntimeArgs,
}

/// Frontend protocol (`--mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    /// `ProxyService/Proxy` gRPC streams.
    Grpc,
    /// `CONNECT host:port HTTP/1.1`.
    HttpConnect,
}

/// Where frontends connect.
// Built once at start-up: the size of a variant costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone)]
pub enum FrontendListen {
    /// A Unix socket (no TLS; access by file mode 0770).
    Uds {
        /// Socket path.
        path: PathBuf,
        /// Remove an existing file first.
        delete_existing: bool,
    },
    /// TCP with mandatory client certificates.
    Tcp {
        /// Address to bind.
        addr: SocketAddr,
        /// TLS with client verification against --server-ca-cert.
        tls: ListenerTls,
    },
}

/// A TLS listener's files, named by their flags, and what it offers. The
/// flags are checked first; the files are read by [`load`](Self::load)
/// when the server binds.
#[derive(Debug, Clone)]
pub struct ListenerTls {
    /// The certificate chain, its key and the CA that client certificates
    /// must chain to (mTLS), named by their flags.
    pub files: files::CertFiles,
    /// The ALPN protocol offered.
    pub alpn: &'static [u8],
    /// `--cipher-suites` and `--tls-min-version`.
    pub policy: tls::TlsPolicy,
    /// Whether and how sessions resume.
    pub resumption: Resumption,
}

/// Whether and how a TLS listener resumes sessions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resumption {
    /// Never: no session cache, no tickets; every handshake is a full one
    /// that verifies the client's chain. The TCP frontend: kube-apiserver's
    /// client (grpc-go over Go's `crypto/tls`, no `ClientSessionCache`)
    /// never resumes, so a cache there would only keep chains that nothing
    /// checks again.
    Off,
    /// From rustls's in-memory cache of this process's sessions, each
    /// resumed chain verified again: the agent listener with
    /// `--tls-session-tickets=false`.
    Cache,
    /// From session tickets (`--tls-session-tickets`) whose key changes
    /// every `rotation` (`--tls-session-ticket-rotation`), each resumed
    /// chain verified again: the agent listener.
    Tickets {
        /// How long each ticket key is used.
        rotation: Duration,
    },
}

impl ListenerTls {
    /// The agent listener's files (`--cluster-cert`, `--cluster-key`,
    /// `--cluster-ca-cert`), default TLS policy.
    pub fn agent(cert: PathBuf, key: PathBuf, client_ca: Option<PathBuf>) -> Self {
        Self {
            files: files::CertFiles {
                identity: Some((("cluster-cert", cert), ("cluster-key", key))),
                ca: client_ca.map(|ca| ("cluster-ca-cert", ca)),
                secret: None,
            },
            alpn: tls::ALPN_H2,
            policy: tls::TlsPolicy::default(),
            resumption: Resumption::Tickets {
                rotation: DEFAULT_TICKET_ROTATION,
            },
        }
    }

    /// The TCP frontend's files (`--server-cert`, `--server-key`,
    /// `--server-ca-cert`) for `mode`, default TLS policy.
    pub fn frontend(cert: PathBuf, key: PathBuf, client_ca: PathBuf, mode: Mode) -> Self {
        Self {
            files: files::CertFiles {
                identity: Some((("server-cert", cert), ("server-key", key))),
                ca: Some(("server-ca-cert", client_ca)),
                secret: None,
            },
            // CONNECT is HTTP/1.1 only (ANP disables HTTP/2 there); gRPC is
            // HTTP/2.
            alpn: match mode {
                Mode::Grpc => tls::ALPN_H2,
                Mode::HttpConnect => tls::ALPN_HTTP11,
            },
            policy: tls::TlsPolicy::default(),
            resumption: Resumption::Off,
        }
    }

    /// Reads the files into a TLS configuration.
    ///
    /// # Errors
    /// A file cannot be read or parsed, or the key does not match the
    /// certificate; the error names the flag of the file.
    pub fn load(&self) -> Result<Arc<tls::ListenerConfig>, ConfigError> {
        Ok(self.files.load(self.build())?)
    }

    /// The TLS configuration that follows the files: each new handshake
    /// uses them as they are then, or the last good ones (see
    /// [`ops::tls::files`]). `what` names the listener in logs; `metrics`
    /// shows the certificates' expiry and counts failed reloads.
    ///
    /// # Errors
    /// As [`load`](Self::load): at start-up there is nothing to keep.
    pub fn follow(
        &self,
        what: &'static str,
        metrics: files::CertMetrics,
    ) -> Result<files::TlsFiles<tls::ListenerConfig>, ConfigError> {
        Ok(self.files.follow(what, metrics, self.build())?)
    }

    /// Builds the configuration from the files as they are when called,
    /// reading each once.
    fn build(&self) -> impl Fn() -> Result<Arc<tls::ListenerConfig>, tls::TlsError> + use<> {
        let Self {
            files,
            alpn,
            policy,
            resumption,
        } = self.clone();
        move || {
            let ((_, cert), (_, key)) = files
                .identity
                .as_ref()
                .expect("a listener has a certificate");
            let client_ca = files.ca.as_ref().map(|(_, ca)| ca.as_path());
            // The secret: the ticket key file, else the serving key.
            let resumption = match resumption {
                Resumption::Off => tls::Resumption::Off,
                Resumption::Cache => tls::Resumption::Cache,
                Resumption::Tickets { rotation } => tls::Resumption::Tickets(tls::TicketSettings {
                    secret: files.secret.as_ref().map_or(key, |(_, path)| path),
                    rotation,
                }),
            };
            let config = tls::listener_config(cert, key, client_ca, &[alpn], &policy, resumption)?;
            Ok(Arc::new(config))
        }
    }
}

/// Validated configuration; tests build it directly.
#[derive(Debug, Clone)]
pub struct Config {
    /// Frontend protocol.
    pub mode: Mode,
    /// Frontend listener.
    pub frontend: FrontendListen,
    /// Agent listener address.
    pub agent_addr: SocketAddr,
    /// TLS of the agent listener (mTLS when --cluster-ca-cert is set).
    pub agent_tls: ListenerTls,
    /// Health listener address.
    pub health_addr: SocketAddr,
    /// Admin listener address (`/metrics`, pprof).
    pub admin_addr: SocketAddr,
    /// Serve CPU profiles on the admin port (`--enable-profiling`).
    pub profiling: bool,
    /// Traces (`--tracing-config-file`), if configured.
    pub tracing: Option<ops::otel::TracingConfig>,
    /// This server's id.
    pub server_id: ServerId,
    /// Replica count announced to agents.
    pub server_count: u32,
    /// Backend selection strategies, in order.
    pub strategies: Vec<ProxyStrategy>,
    /// `--max-agent-queue-bytes`.
    pub max_agent_queue_bytes: usize,
    /// `--verify-agent-identifiers`.
    pub verify_agent_identifiers: bool,
    /// `--buffer-budget-bytes`.
    pub buffer_budget_bytes: usize,
    /// `--max-tls-handshakes`.
    pub max_tls_handshakes: usize,
    /// `--max-http-connections`.
    pub max_http_connections: usize,
    /// `--frontend-stall-timeout`; `None` never closes a stalled connection.
    pub frontend_stall_timeout: Option<Duration>,
    /// Agent keepalive ping interval.
    pub keepalive_time: Duration,
    /// Frontend keepalive ping interval.
    pub frontend_keepalive_time: Duration,
    /// `--frontend-max-concurrent-streams`.
    pub frontend_max_concurrent_streams: u32,
    /// `--agent-max-concurrent-streams`.
    pub agent_max_concurrent_streams: u32,
    /// `--backend-dial-timeout`, `--backend-dial-retries`,
    /// `--backend-dial-hedge`, `--backend-dial-hedge-delay`.
    pub dial_policy: DialPolicy,
    /// Offer per-connection flow control (`tunnel::flow`).
    pub flow_control: bool,
    /// The receive window announced with it (`--flow-control-window`,
    /// `--flow-control-max-chunk`).
    pub flow_window: Window,
    /// What is announced of it (`--flow-control-version`).
    pub flow_version: flow::Version,
    /// `--graceful-shutdown-timeout`: how long open connections may take to
    /// finish after the first signal; `None` closes them at once.
    pub graceful_shutdown_timeout: Option<Duration>,
    /// Service-account token authentication of agents, if on.
    pub token_auth: Option<TokenAuthConfig>,
    /// `--allow-unauthenticated-agents`: start although the agent port
    /// has neither client certificates nor token auth (see
    /// [`check_agent_auth`](Self::check_agent_auth)).
    pub allow_unauthenticated_agents: bool,
    /// This server's Lease (`--enable-lease-controller`), if on.
    pub lease: Option<LeaseConfig>,
    /// The audit log (`--audit-log-path`), if on.
    pub audit: Option<ops::audit::AuditConfig>,
    /// Flags given that this build accepts but does not act on, for a start-up warning.
    pub not_implemented: Vec<&'static str>,
    /// Deprecated flags given, for a start-up warning.
    pub deprecated: Vec<Deprecated>,
    /// Values accepted with a caveat (`--tls-min-version=VersionTLS10`, CBC
    /// suites left out), for a start-up warning.
    pub notices: Vec<Notice>,
}

pub use ops::flags::Notice;

/// A flag combination or value that cannot work (shared with proxy-agent).
pub use ops::flags::FlagError as ConfigError;
use ops::flags::{given_path, invalid};

/// ANP's port rule (1024..=49151), extended so that 0 binds a free port.
/// Parses `--backend-dial-hedge-delay`: `pNN` (a percentile, 1 to 99)
/// or a positive Go duration.
fn hedge_delay(text: &str) -> Result<HedgeDelay, String> {
    if let Some(p) = text.strip_prefix('p') {
        return match p.parse::<u8>() {
            Ok(p @ 1..=99) => Ok(HedgeDelay::Percentile(p)),
            _ => Err(format!("`{text}`: a percentile is p1 to p99")),
        };
    }
    match go_duration(text)? {
        Duration::ZERO => Err(
            "a hedge delay of 0 would double every dial; leave --backend-dial-hedge off instead"
                .to_owned(),
        ),
        delay => Ok(HedgeDelay::Fixed(delay)),
    }
}

/// `--tracing-config-file`, read and checked.
fn tracing_config(
    path: Option<&std::path::Path>,
) -> Result<Option<ops::otel::TracingConfig>, ConfigError> {
    path.map(|path| {
        ops::otel::TracingConfig::load(path).map_err(|e| {
            ops::flags::invalid(
                "tracing-config-file",
                format!("{}: {}", e.path.display(), e.what),
            )
        })
    })
    .transpose()
}

fn check_port(flag: &'static str, port: u16) -> Result<u16, ConfigError> {
    if port == 0 || (1024..=49151).contains(&port) {
        Ok(port)
    } else {
        Err(invalid(
            flag,
            format!("port {port} is outside 1024..49151 (0 picks a free port)"),
        ))
    }
}

/// `--frontend-write-channel-size`: an integer, not negative (ANP #918).
fn write_channel_size(text: &str) -> Result<i64, String> {
    let size: i64 = text
        .trim()
        .parse()
        .map_err(|_| format!("{text:?} is not an integer"))?;
    if size < 0 {
        return Err(format!("{size} is negative (0 or more)"));
    }
    Ok(size)
}

/// Joins a bind address flag ("" = all interfaces) and a port.
fn bind_addr(flag: &'static str, host: &str, port: u16) -> Result<SocketAddr, ConfigError> {
    ops::flags::bind_addr(host, port).map_err(|reason| invalid(flag, reason))
}

impl Config {
    /// Whether the agent port authenticates no one: no client
    /// certificates required (`--cluster-ca-cert`) and no token auth.
    pub fn agents_unauthenticated(&self) -> bool {
        self.agent_tls.files.ca.is_none() && self.token_auth.is_none()
    }

    /// Refuses an agent port that authenticates no one, unless
    /// `--allow-unauthenticated-agents` says it is meant.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] naming the flags that would authenticate
    /// agents, and the one that allows none.
    pub fn check_agent_auth(&self) -> Result<(), ConfigError> {
        if self.agents_unauthenticated() && !self.allow_unauthenticated_agents {
            return Err(invalid(
                "cluster-ca-cert",
                "empty, and token auth is off: the agent port would admit anyone as an agent. \
                 Set --cluster-ca-cert (client certificates), or --agent-namespace, \
                 --agent-service-account and --authentication-audience (service-account \
                 tokens), or --allow-unauthenticated-agents if that is meant",
            ));
        }
        Ok(())
    }

    /// Reads every certificate and key the flags name, as the server does
    /// when it binds: for a start-up that fails before anything is bound.
    ///
    /// # Errors
    /// The first file that cannot be used, naming its flag.
    pub fn load_tls(&self) -> Result<(), ConfigError> {
        self.agent_tls.load()?;
        if let FrontendListen::Tcp { tls, .. } = &self.frontend {
            tls.load()?;
        }
        Ok(())
    }
}

impl TryFrom<Args> for Config {
    type Error = ConfigError;

    /// Checks every flag, a group at a time; reads no certificate (see
    /// [`ListenerTls::load`]).
    fn try_from(args: Args) -> Result<Self, ConfigError> {
        let mut notices = Vec::new();
        let policy = tls_policy(&args, &mut notices)?;
        if let Some(size) = args.frontend_write_channel_size {
            notices.push(Notice {
                flag: "frontend-write-channel-size",
                text: format!("{size}: no effect; every HTTP-CONNECT connection already has its own lane (a buffer bounded by its flow window) and the agent stream's receive loop never writes to a socket"),
            });
        }
        notices.extend(args.flow.notice(args.flow_control));
        let frontend = frontend(&args, &policy)?;
        let agent_tls = agent_tls(&args, &policy)?;
        let token_auth = token_auth(&args)?;
        limits(&args)?;
        let tracing = tracing_config(args.tracing_config_file.as_deref())?;
        let (admin_addr, health_addr, agent_addr) = addresses(&args)?;
        if args.enable_contention_profiling && !args.enable_profiling {
            return Err(invalid(
                "enable-contention-profiling",
                "requires --enable-profiling",
            ));
        }
        if args.server_count == 0 {
            return Err(invalid("server-count", "must be at least 1"));
        }
        let lease = lease(&args)?;
        let strategies = parse_strategies(&args.proxy_strategies)
            .map_err(|reason| invalid("proxy-strategies", reason))?;
        if args.verify_agent_identifiers
            && given_path(args.cluster_ca_cert.as_ref()).is_none()
            && token_auth.is_none()
        {
            return Err(invalid(
                "verify-agent-identifiers",
                "requires --cluster-ca-cert or token authentication: without client certificates or tokens there is nothing to bind agent identifiers to",
            ));
        }
        let server_id = server_id(&args);
        let (flow_window, flow_version) = flow_settings(&args)?;
        let config = Self {
            mode: args.mode,
            frontend,
            agent_addr,
            agent_tls,
            health_addr,
            admin_addr,
            profiling: args.enable_profiling,
            tracing,
            server_id,
            server_count: args.server_count,
            strategies,
            max_agent_queue_bytes: args.max_agent_queue_bytes,
            verify_agent_identifiers: args.verify_agent_identifiers,
            buffer_budget_bytes: args.buffer_budget_bytes,
            max_tls_handshakes: args.max_tls_handshakes,
            max_http_connections: args.max_http_connections,
            frontend_stall_timeout: nonzero(args.frontend_stall_timeout),
            keepalive_time: args.keepalive_time,
            frontend_keepalive_time: args.frontend_keepalive_time,
            frontend_max_concurrent_streams: args.frontend_max_concurrent_streams,
            agent_max_concurrent_streams: args.agent_max_concurrent_streams,
            flow_control: args.flow_control,
            flow_window,
            flow_version,
            graceful_shutdown_timeout: nonzero(args.graceful_shutdown_timeout),
            token_auth,
            allow_unauthenticated_agents: args.allow_unauthenticated_agents,
            dial_policy: dial_policy(&args),
            lease,
            audit: args.audit.config()?,
            not_implemented: not_implemented(&args),
            deprecated: deprecated(&args),
            notices,
        };
        config.check_agent_auth()?;
        Ok(config)
    }
}

/// `--server-id`, or a random UUID when it is empty (ANP).
fn server_id(args: &Args) -> ServerId {
    if args.server_id.is_empty() {
        ServerId(uuid::Uuid::new_v4().to_string())
    } else {
        ServerId(args.server_id.clone())
    }
}

/// `None` for a zero duration: a timeout flag's "off".
fn nonzero(d: Duration) -> Option<Duration> {
    (!d.is_zero()).then_some(d)
}

/// The receive window announced with flow control
/// (`--flow-control-window`, `--flow-control-max-chunk`), and what is
/// announced of it (`--flow-control-version`).
fn flow_settings(args: &Args) -> Result<(Window, flow::Version), ConfigError> {
    let window = Window::from_flags(
        args.flow.flow_control_window,
        args.flow.flow_control_max_chunk,
    )
    .map_err(|(flag, reason)| invalid(flag, reason))?;
    let version = match args.flow.flow_control_version {
        FlowControlVersion::V1 => flow::Version::V1,
        FlowControlVersion::V2 => flow::Version::V2,
    };
    Ok((window, version))
}

/// How dials go out: `--backend-dial-timeout` (0: none),
/// `--backend-dial-retries`, and the hedge (`--backend-dial-hedge`,
/// `--backend-dial-hedge-delay`).
fn dial_policy(args: &Args) -> DialPolicy {
    DialPolicy {
        timeout: nonzero(args.backend_dial_timeout),
        retries: args.backend_dial_retries,
        hedge: args
            .backend_dial_hedge
            .then_some(args.backend_dial_hedge_delay),
        caps: DialCaps {
            per_frontend: args.max_pending_dials_per_frontend,
            per_agent: args.max_pending_dials_per_agent,
            streams_per_credential: args.max_agent_streams_per_credential,
        },
    }
}

/// `--tls-min-version` and `--cipher-suites`, which both TLS listeners
/// follow.
fn tls_policy(args: &Args, notices: &mut Vec<Notice>) -> Result<tls::TlsPolicy, ConfigError> {
    let (tls13_only, warning) = tls::parse_min_version(&args.tls_min_version)
        .map_err(|reason| invalid("tls-min-version", reason))?;
    if let Some(warning) = warning {
        notices.push(Notice {
            flag: "tls-min-version",
            text: format!("{}: {warning}", args.tls_min_version),
        });
    }
    let cipher_suites = tls::parse_cipher_suites(&ops::flags::string_slice(&args.cipher_suites))
        .map_err(|reason| invalid("cipher-suites", reason))?;
    if !cipher_suites.left_out.is_empty() {
        if cipher_suites.no_tls12_suite_left() && !tls13_only {
            return Err(invalid(
                "cipher-suites",
                format!(
                    "{} are CBC suites, which this build (rustls) does not implement, and no other TLS 1.2 suite is listed",
                    cipher_suites.left_out.join(", ")
                ),
            ));
        }
        notices.push(Notice {
            flag: "cipher-suites",
            text: format!(
                "CBC suites left out, this build (rustls) has none: {}",
                cipher_suites.left_out.join(", ")
            ),
        });
    }
    Ok(tls::TlsPolicy {
        tls12_suites: cipher_suites.suites,
        tls13_only,
    })
}

/// `--uds-name` or `--server-port` with the frontend's TLS files.
fn frontend(args: &Args, policy: &tls::TlsPolicy) -> Result<FrontendListen, ConfigError> {
    let Some(path) = given_path(args.uds_name.as_ref()) else {
        let port = check_port("server-port", args.server_port)?;
        let ca = given_path(args.server_ca_cert.as_ref()).ok_or_else(|| {
            invalid(
                "server-ca-cert",
                "required for the TCP frontend (--uds-name is empty)",
            )
        })?;
        let cert = given_path(args.server_cert.as_ref())
            .ok_or_else(|| invalid("server-cert", "required for the TCP frontend"))?;
        let key = given_path(args.server_key.as_ref())
            .ok_or_else(|| invalid("server-key", "required for the TCP frontend"))?;
        return Ok(FrontendListen::Tcp {
            addr: bind_addr("server-bind-address", &args.server_bind_address, port)?,
            tls: ListenerTls {
                policy: policy.clone(),
                ..ListenerTls::frontend(cert, key, ca, args.mode)
            },
        });
    };
    if args.server_port != 0 {
        return Err(invalid("server-port", "must be 0 when --uds-name is set"));
    }
    for (flag, value) in [
        ("server-cert", &args.server_cert),
        ("server-key", &args.server_key),
        ("server-ca-cert", &args.server_ca_cert),
    ] {
        if given_path(value.as_ref()).is_some() {
            return Err(invalid(flag, "must be empty when --uds-name is set"));
        }
    }
    Ok(FrontendListen::Uds {
        path,
        delete_existing: args.delete_existing_uds_file,
    })
}

/// How long a session-ticket key is used by default
/// (`--tls-session-ticket-rotation`).
pub const DEFAULT_TICKET_ROTATION: Duration = Duration::from_secs(24 * 3600);

/// `--buffer-budget-bytes`'s default, 256 MiB: a control-plane node's
/// kube-apiserver and etcd want most of its memory, and this server's own
/// steady state is tens of MiB. Healthy traffic holds next to none of it
/// (its DATA goes straight on); 128 MiB of read-ahead is 128 uploads
/// stalled with a full 1 MiB read-ahead each, or thousands holding a few
/// packets, before any stream has to wait.
pub const DEFAULT_BUFFER_BUDGET: usize = 256 * 1024 * 1024;

/// `--agent-max-concurrent-streams`'s default: an agent needs one stream per
/// connection; a few more let a new `Connect` start while an ended one is
/// still being closed.
pub const DEFAULT_AGENT_MAX_CONCURRENT_STREAMS: u32 = 16;

/// The agent listener's TLS files (`--cluster-*`) and session tickets
/// (`--tls-session-ticket*`).
fn agent_tls(args: &Args, policy: &tls::TlsPolicy) -> Result<ListenerTls, ConfigError> {
    let required = |flag, value: Option<&PathBuf>| {
        given_path(value)
            .ok_or_else(|| invalid(flag, "required: the agent listener always uses TLS"))
    };
    let cert = required("cluster-cert", args.cluster_cert.as_ref())?;
    let key = required("cluster-key", args.cluster_key.as_ref())?;
    if args.tls_session_ticket_rotation < Duration::from_secs(1) {
        return Err(invalid(
            "tls-session-ticket-rotation",
            "must be at least 1s",
        ));
    }
    if args.tls_session_ticket_rotation > tls::tickets::MAX_LIFETIME {
        return Err(invalid(
            "tls-session-ticket-rotation",
            "must be at most 168h (RFC 8446 caps a ticket's lifetime at 7 days)",
        ));
    }
    let mut tls = ListenerTls {
        policy: policy.clone(),
        resumption: if args.tls_session_tickets {
            Resumption::Tickets {
                rotation: args.tls_session_ticket_rotation,
            }
        } else {
            Resumption::Cache
        },
        ..ListenerTls::agent(cert, key, given_path(args.cluster_ca_cert.as_ref()))
    };
    tls.files.secret = given_path(args.tls_session_ticket_key.as_ref())
        .filter(|_| args.tls_session_tickets)
        .map(|path| ("tls-session-ticket-key", path));
    Ok(tls)
}

/// Service-account token authentication of agents (`--agent-namespace`,
/// `--agent-service-account`, `--authentication-audience`), and
/// `--kubeconfig`, checked whenever given, used or not (ANP).
fn token_auth(args: &Args) -> Result<Option<TokenAuthConfig>, ConfigError> {
    let kubeconfig = given_path(args.kubeconfig.as_ref());
    let token_auth = [
        &args.agent_namespace,
        &args.agent_service_account,
        &args.authentication_audience,
    ];
    let on = token_auth.iter().any(|v| !v.is_empty());
    if on {
        if token_auth.iter().any(|v| v.is_empty()) {
            return Err(invalid(
                "agent-namespace",
                "--agent-namespace, --agent-service-account and --authentication-audience must be set together",
            ));
        }
        if given_path(args.cluster_ca_cert.as_ref()).is_some() {
            return Err(invalid(
                "cluster-ca-cert",
                "must be empty when service-account token auth (--agent-namespace) is on",
            ));
        }
    }
    if let Some(path) = &kubeconfig {
        ops::flags::check_readable_file("kubeconfig", path)?;
    }
    if !on {
        return Ok(None);
    }
    if args.token_review_max_inflight == 0 {
        return Err(invalid("token-review-max-inflight", "must be at least 1"));
    }
    if args.token_review_max_pending == 0 {
        return Err(invalid("token-review-max-pending", "must be at least 1"));
    }
    Ok(Some(TokenAuthConfig {
        namespace: args.agent_namespace.clone(),
        service_account: args.agent_service_account.clone(),
        audience: args.authentication_audience.clone(),
        kubeconfig,
        cache_ttl: args.token_review_cache_ttl,
        max_in_flight: args.token_review_max_inflight,
        max_pending: args.token_review_max_pending,
        local_checks: args.token_review_local_checks,
    }))
}

/// `--backend-dial-retries`' largest value: one dial reaches at most
/// this many agents after the first (and one more when hedged). A retry
/// is for an agent that went away, or a refusal another agent may not
/// give; even with half the agents going at once (a node pool replaced),
/// eight retries all land on departing agents once in 256 dials, while
/// a destination that every agent refuses costs at most nine dials for
/// one request, not one per agent of the cluster.
pub const MAX_BACKEND_DIAL_RETRIES: u32 = 8;

/// The queue, handshake, connection and retry caps.
fn limits(args: &Args) -> Result<(), ConfigError> {
    if args.xfr_channel_size == Some(0) {
        return Err(invalid("xfr-channel-size", "must be greater than 0"));
    }
    if args.backend_dial_retries > MAX_BACKEND_DIAL_RETRIES {
        return Err(invalid(
            "backend-dial-retries",
            format!(
                "{} is more than {MAX_BACKEND_DIAL_RETRIES}: a dial would reach up to {} agents",
                args.backend_dial_retries,
                u64::from(args.backend_dial_retries) + 1
            ),
        ));
    }
    for (flag, value) in [
        ("max-agent-queue-bytes", args.max_agent_queue_bytes),
        ("buffer-budget-bytes", args.buffer_budget_bytes),
        ("max-tls-handshakes", args.max_tls_handshakes),
        ("max-http-connections", args.max_http_connections),
        (
            "max-pending-dials-per-frontend",
            args.max_pending_dials_per_frontend,
        ),
        (
            "max-pending-dials-per-agent",
            args.max_pending_dials_per_agent,
        ),
        (
            "max-agent-streams-per-credential",
            args.max_agent_streams_per_credential,
        ),
    ] {
        if value == 0 {
            return Err(invalid(flag, "must be greater than 0"));
        }
    }
    Ok(())
}

/// The admin, health and agent listeners' addresses.
fn addresses(args: &Args) -> Result<(SocketAddr, SocketAddr, SocketAddr), ConfigError> {
    Ok((
        bind_addr(
            "admin-bind-address",
            &args.admin_bind_address,
            check_port("admin-port", args.admin_port)?,
        )?,
        bind_addr(
            "health-bind-address",
            &args.health_bind_address,
            check_port("health-port", args.health_port)?,
        )?,
        bind_addr(
            "agent-bind-address",
            &args.agent_bind_address,
            check_port("agent-port", args.agent_port)?,
        )?,
    ))
}

/// This server's Lease; `--lease-label` is parsed even with leases off
/// (ANP).
fn lease(args: &Args) -> Result<Option<LeaseConfig>, ConfigError> {
    let labels =
        parse_labels(&args.lease_label).map_err(|reason| invalid("lease-label", reason))?;
    if !args.enable_lease_controller {
        return Ok(None);
    }
    if args.lease_namespace.is_empty() {
        return Err(invalid("lease-namespace", "must not be empty"));
    }
    Ok(Some(LeaseConfig::new(
        args.lease_namespace.clone(),
        labels,
        given_path(args.kubeconfig.as_ref()),
    )))
}

/// Flags given that this build accepts but does not act on.
fn not_implemented(args: &Args) -> Vec<&'static str> {
    [
        ("kubeconfig-qps", args.kubeconfig_qps != 0.0),
        ("kubeconfig-burst", args.kubeconfig_burst != 0),
        // The kube crate speaks JSON only.
        (
            "kube-api-content-type",
            args.kube_api_content_type
                .as_ref()
                .is_some_and(|t| t != "application/json"),
        ),
        // Rust has no block profiler; CPU profiles are served.
        (
            "enable-contention-profiling",
            args.enable_contention_profiling,
        ),
        // Queues are bounded in bytes.
        ("xfr-channel-size", args.xfr_channel_size.is_some()),
    ]
    .into_iter()
    .filter_map(|(flag, given)| given.then_some(flag))
    .chain(args.log.without_effect())
    .collect()
}

/// Deprecated flags given.
fn deprecated(args: &Args) -> Vec<Deprecated> {
    args.warn_on_channel_limit
        .map(|_| Deprecated {
            flag: "warn-on-channel-limit",
            note: "no effect; channel limits are always handled (ANP)",
        })
        .into_iter()
        .collect()
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use clap::Parser;

    use super::*;

    /// Certificates for the tests that need real files.
    fn pki() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        certs::ClusterPki::generate(&[])
            .unwrap()
            .write_to(dir.path())
            .unwrap();
        dir
    }

    /// The flags checked, then the certificates loaded (as the server does
    /// when it binds): the first error of either.
    fn parse(extra: &[String]) -> Result<Config, ConfigError> {
        let mut argv = vec!["proxy-server".to_owned()];
        argv.extend(extra.iter().cloned());
        let config = Config::try_from(Args::try_parse_from(argv).unwrap())?;
        config.load_tls()?;
        Ok(config)
    }

    /// A server on a Unix socket whose agents need client certificates.
    fn uds_args(dir: &std::path::Path) -> Vec<String> {
        vec![
            format!("--uds-name={}", dir.join("s.sock").display()),
            "--server-port=0".to_owned(),
            format!("--cluster-cert={}", dir.join("cluster.crt").display()),
            format!("--cluster-key={}", dir.join("cluster.key").display()),
            format!("--cluster-ca-cert={}", dir.join("agent-ca.crt").display()),
        ]
    }

    #[test]
    fn defaults_are_anps() {
        let a = Args::try_parse_from(["proxy-server"]).unwrap();
        assert_eq!(a.mode, Mode::Grpc);
        assert_eq!(a.uds_name, None);
        assert!(a.delete_existing_uds_file);
        assert_eq!(a.server_port, 8090);
        assert_eq!(a.agent_port, 8091);
        assert_eq!(a.admin_port, 8095);
        assert_eq!(a.admin_bind_address, "127.0.0.1");
        assert_eq!(a.health_port, 8092);
        assert_eq!(a.keepalive_time, Duration::from_secs(3600));
        assert_eq!(a.frontend_keepalive_time, Duration::from_secs(3600));
        assert_eq!(a.server_count, 1);
        assert_eq!(a.proxy_strategies, "default");
        assert_eq!(a.xfr_channel_size, None, "10, not named");
        assert_eq!(a.max_agent_queue_bytes, 4 << 20);
        assert_eq!(a.buffer_budget_bytes, 256 << 20);
        assert_eq!(a.max_tls_handshakes, 8192);
        assert_eq!(a.max_http_connections, 65_536);
        assert_eq!(a.agent_max_concurrent_streams, 16);
        assert_eq!(a.token_review_max_pending, 16_384);
        assert!(a.token_review_local_checks);
        assert_eq!(
            a.tls_session_ticket_rotation,
            Duration::from_secs(24 * 3600)
        );
        assert_eq!(a.frontend_stall_timeout, Duration::from_secs(300));
        assert_eq!(a.kube_api_content_type, None, "protobuf, not named");
        assert_eq!(a.cipher_suites, ["[]"]);
        assert_eq!(a.lease_namespace, "kube-system");
        assert_eq!(a.lease_label, "k8s-app=konnectivity-server");
        assert_eq!(a.graceful_shutdown_timeout, Duration::ZERO);
        assert_eq!(a.backend_dial_timeout, Duration::ZERO);
        assert!(!a.enable_profiling);
        assert_eq!(a.warn_on_channel_limit, None, "true, not named");
        assert_eq!(a.log.verbosity, 4);
    }

    #[test]
    fn a_uds_configuration_validates() {
        let dir = pki();
        let mut args = uds_args(dir.path());
        args.extend([
            "--keepalive-time=1h0m0s".to_owned(),
            "--backend-dial-timeout=500ms".to_owned(),
            "--delete-existing-uds-file=false".to_owned(),
            "--server-id=replica-1".to_owned(),
            "--server-count=3".to_owned(),
            "--agent-port=8132".to_owned(),
            "--proxy-strategies=destHost,default".to_owned(),
        ]);
        let c = parse(&args).unwrap();
        assert!(matches!(
            c.frontend,
            FrontendListen::Uds {
                delete_existing: false,
                ..
            }
        ));
        assert_eq!(
            c.dial_policy,
            DialPolicy {
                timeout: Some(Duration::from_millis(500)),
                retries: 1,
                hedge: None,
                caps: DialCaps::default(),
            }
        );
        assert_eq!(c.server_id.0, "replica-1");
        assert_eq!(c.server_count, 3);
        assert_eq!(c.agent_addr.port(), 8132);
        assert_eq!(
            c.strategies,
            [ProxyStrategy::DestHost, ProxyStrategy::Default]
        );
        let c = parse(&uds_args(dir.path())).unwrap();
        assert_eq!(c.dial_policy.timeout, None);
        assert!(!c.server_id.0.is_empty(), "a random id by default");
        args.push(format!("--backend-dial-retries={MAX_BACKEND_DIAL_RETRIES}"));
        assert_eq!(parse(&args).unwrap().dial_policy.retries, 8, "the bound");
    }

    #[test]
    fn invalid_combinations_name_the_flag() {
        let dir = pki();
        let base = uds_args(dir.path());
        let with = |extra: &[&str]| {
            let mut args = base.clone();
            args.extend(extra.iter().map(|s| (*s).to_owned()));
            args
        };
        let cases: Vec<(Vec<String>, &str)> = vec![
            (with(&["--server-port=8090"]), "--server-port"),
            (with(&["--server-cert=/x"]), "--server-cert"),
            (with(&["--server-ca-cert=/x"]), "--server-ca-cert"),
            (with(&["--xfr-channel-size=0"]), "--xfr-channel-size"),
            (
                with(&["--backend-dial-retries=9"]),
                "--backend-dial-retries: 9 is more than 8",
            ),
            (
                with(&["--max-agent-queue-bytes=0"]),
                "--max-agent-queue-bytes",
            ),
            (with(&["--buffer-budget-bytes=0"]), "--buffer-budget-bytes"),
            (with(&["--max-tls-handshakes=0"]), "--max-tls-handshakes"),
            (
                with(&["--max-http-connections=0"]),
                "--max-http-connections",
            ),
            (with(&["--agent-port=80"]), "--agent-port"),
            (with(&["--health-port=50000"]), "--health-port"),
            (
                with(&["--enable-contention-profiling"]),
                "--enable-contention-profiling",
            ),
            (with(&["--proxy-strategies=random"]), "--proxy-strategies"),
            (
                {
                    // Neither client certificates nor tokens.
                    let mut a = base[..4].to_vec();
                    a.extend(
                        [
                            "--allow-unauthenticated-agents=true",
                            "--verify-agent-identifiers=true",
                        ]
                        .map(str::to_owned),
                    );
                    a
                },
                "--verify-agent-identifiers: requires --cluster-ca-cert or token authentication",
            ),
            (with(&["--server-count=0"]), "--server-count"),
            (with(&["--lease-label="]), "--lease-label"),
            (
                with(&["--cipher-suites=TLS_RSA_WITH_RC4_128_SHA"]),
                "--cipher-suites",
            ),
            (with(&["--tls-min-version=TLS13"]), "--tls-min-version"),
            (
                with(&["--cipher-suites=TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA"]),
                "--cipher-suites: TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA are CBC suites",
            ),
            (
                with(&["--kubeconfig=/nonexistent/kubeconfig"]),
                "--kubeconfig: cannot read /nonexistent/kubeconfig",
            ),
            (
                with(&["--agent-bind-address=not-an-ip"]),
                "--agent-bind-address",
            ),
            (
                with(&["--tls-session-ticket-rotation=500ms"]),
                "--tls-session-ticket-rotation",
            ),
            (
                with(&["--tls-session-ticket-rotation=168h1s"]),
                "--tls-session-ticket-rotation: must be at most 168h",
            ),
            (
                with(&[
                    "--token-review-max-pending=0",
                    "--cluster-ca-cert=",
                    "--agent-namespace=a",
                    "--agent-service-account=b",
                    "--authentication-audience=c",
                ]),
                "--token-review-max-pending",
            ),
            (
                with(&["--tls-session-ticket-key=/nonexistent/ticket.key"]),
                "--tls-session-ticket-key: cannot read the session-ticket secret /nonexistent/ticket.key",
            ),
            (
                with(&[
                    "--token-review-max-inflight=0",
                    "--cluster-ca-cert=",
                    "--agent-namespace=a",
                    "--agent-service-account=b",
                    "--authentication-audience=c",
                ]),
                "--token-review-max-inflight",
            ),
            (
                with(&["--agent-namespace=kube-system"]),
                "--agent-namespace",
            ),
            (
                with(&[
                    "--agent-namespace=kube-system",
                    "--agent-service-account=konnectivity-agent",
                    "--authentication-audience=system:konnectivity-server",
                    "--cluster-ca-cert=/x",
                ]),
                "--cluster-ca-cert",
            ),
            (
                vec![
                    format!(
                        "--cluster-cert={}",
                        dir.path().join("cluster.crt").display()
                    ),
                    format!("--cluster-key={}", dir.path().join("cluster.key").display()),
                ],
                "--server-ca-cert",
            ),
            (
                vec![
                    format!("--uds-name={}", dir.path().join("s").display()),
                    "--server-port=0".to_owned(),
                ],
                "--cluster-cert",
            ),
            (
                {
                    let mut a = base.clone();
                    a[2] = "--cluster-cert=/nonexistent/cluster.crt".to_owned();
                    a
                },
                "--cluster-cert: cannot read certificates from /nonexistent/cluster.crt",
            ),
            (
                {
                    let mut a = base.clone();
                    a[3] = "--cluster-key=/nonexistent/cluster.key".to_owned();
                    a.push("--cluster-ca-cert=/nonexistent/ca.crt".to_owned());
                    a
                },
                "--cluster-ca-cert: cannot read certificates from /nonexistent/ca.crt",
            ),
            (
                {
                    let mut a = base.clone();
                    a[3] = "--cluster-key=/nonexistent/cluster.key".to_owned();
                    a
                },
                "--cluster-key: cannot read a private key from /nonexistent/cluster.key",
            ),
        ];
        for (args, needle) in cases {
            let err = parse(&args)
                .err()
                .unwrap_or_else(|| panic!("{args:?} should fail"));
            let text = ops::error::DisplayErrorStack(&err).to_string();
            assert!(text.contains(needle), "{args:?}: {text}");
        }
    }

    /// An agent port with neither client certificates nor token auth is
    /// refused, naming the flags that would authenticate agents, unless
    /// `--allow-unauthenticated-agents` says it is meant.
    #[test]
    fn an_agent_port_without_authentication_needs_the_flag_that_allows_it() {
        let dir = pki();
        let mut open = uds_args(dir.path());
        open.push("--cluster-ca-cert=".to_owned());
        let err = parse(&open).expect_err("refused").to_string();
        for flag in [
            "--cluster-ca-cert",
            "--agent-namespace",
            "--allow-unauthenticated-agents",
        ] {
            assert!(err.contains(flag), "{flag} not named: {err}");
        }
        let mut allowed = open.clone();
        allowed.push("--allow-unauthenticated-agents".to_owned());
        let config = parse(&allowed).unwrap();
        assert!(config.agents_unauthenticated());
        assert!(config.allow_unauthenticated_agents);
        // A config built directly is held to the same rule.
        let built = Config {
            allow_unauthenticated_agents: false,
            ..config
        };
        assert!(built.check_agent_auth().is_err());

        let mtls = parse(&uds_args(dir.path())).unwrap();
        assert!(!mtls.agents_unauthenticated());
        let mut token = open.clone();
        token.extend([
            "--agent-namespace=kube-system".to_owned(),
            "--agent-service-account=konnectivity-agent".to_owned(),
            "--authentication-audience=system:konnectivity-server".to_owned(),
        ]);
        assert!(!parse(&token).unwrap().agents_unauthenticated());
    }

    /// Parsing checks the flags and reads no certificate; loading reads the
    /// files and names the flag of the one that fails.
    #[test]
    fn certificates_are_read_after_the_flags_are_checked() {
        let dir = pki();
        let args = Args::try_parse_from([
            "proxy-server".to_owned(),
            "--uds-name=/tmp/x.sock".to_owned(),
            "--server-port=0".to_owned(),
            "--cluster-cert=/nonexistent/cluster.crt".to_owned(),
            "--cluster-key=/nonexistent/cluster.key".to_owned(),
            format!(
                "--cluster-ca-cert={}",
                dir.path().join("agent-ca.crt").display()
            ),
        ])
        .unwrap();
        let config = Config::try_from(args).unwrap();
        let err = config.agent_tls.load().unwrap_err().to_string();
        assert!(err.contains("--cluster-cert"), "{err}");
    }

    /// ANP's flags are strings: an empty path is the same as none.
    #[test]
    fn an_empty_path_is_not_given() {
        let dir = pki();
        let mut args = uds_args(dir.path());
        args.extend([
            "--server-cert=".to_owned(),
            "--server-ca-cert=".to_owned(),
            "--kubeconfig=".to_owned(),
        ]);
        let config = parse(&args).unwrap();
        assert!(config.token_auth.is_none());
        let mut tcp = uds_args(dir.path());
        tcp[0] = "--uds-name=".to_owned();
        tcp[1] = "--server-port=8090".to_owned();
        let err = parse(&tcp).err().unwrap().to_string();
        assert!(err.contains("--server-ca-cert"), "{err}");
    }

    /// Token auth checks tokens locally before a review unless told not to.
    #[test]
    fn local_token_checks_are_on_unless_turned_off() {
        let dir = pki();
        let local_checks = |extra: &[&str]| {
            // Token auth in place of the client CA.
            let mut args = uds_args(dir.path())[..4].to_vec();
            args.extend(
                [
                    "--agent-namespace=kube-system",
                    "--agent-service-account=konnectivity-agent",
                    "--authentication-audience=system:konnectivity-server",
                ]
                .iter()
                .chain(extra)
                .map(|a| (*a).to_owned()),
            );
            parse(&args).unwrap().token_auth.unwrap().local_checks
        };
        assert!(local_checks(&[]));
        assert!(!local_checks(&["--token-review-local-checks=false"]));
        assert!(local_checks(&["--token-review-local-checks"]));
    }

    /// A value accepted with a caveat is a notice for the start-up log, not
    /// logged while parsing.
    #[test]
    fn caveats_are_notices() {
        let dir = pki();
        let mut args = uds_args(dir.path());
        args.extend([
            "--tls-min-version=VersionTLS10".to_owned(),
            "--cipher-suites=TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA,TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256".to_owned(),
        ]);
        let config = parse(&args).unwrap();
        let flags: Vec<_> = config.notices.iter().map(|n| n.flag).collect();
        assert_eq!(flags, ["tls-min-version", "cipher-suites"]);
        assert!(
            config.notices[1]
                .text
                .contains("TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA"),
            "{:?}",
            config.notices
        );
        assert!(parse(&uds_args(dir.path())).unwrap().notices.is_empty());
    }

    /// `--flow-control-version`: v2 by default; v1 pins what is announced,
    /// and names the window flags it makes void at start-up.
    #[test]
    fn flow_control_version_pins_what_is_announced() {
        let dir = pki();
        let with = |extra: &[&str]| {
            let mut args = uds_args(dir.path());
            args.extend(extra.iter().map(|s| (*s).to_owned()));
            parse(&args)
        };
        let config = with(&[]).unwrap();
        assert_eq!(config.flow_version, flow::Version::V2);
        assert!(config.notices.is_empty());
        let config = with(&["--flow-control-version=v1"]).unwrap();
        assert_eq!(config.flow_version, flow::Version::V1);
        assert!(config.notices.is_empty(), "{:?}", config.notices);
        let config = with(&[
            "--flow-control-version=v1",
            "--flow-control-max-chunk=65536",
        ])
        .unwrap();
        let flags: Vec<_> = config.notices.iter().map(|n| n.flag).collect();
        assert_eq!(flags, ["flow-control-version"]);
        assert!(
            config.notices[0].text.contains("--flow-control-max-chunk"),
            "{:?}",
            config.notices
        );
        let err = Args::try_parse_from(["proxy-server", "--flow-control-version=2"])
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("--flow-control-version"), "{err}");
    }

    /// ANP #896/#918's `--frontend-write-channel-size`: any size from 0
    /// (ANP's synchronous writes) up is accepted and named at start-up as
    /// without effect; a negative one is refused naming the flag, however
    /// it is spelled.
    #[test]
    fn frontend_write_channel_size_is_accepted_from_zero_and_named() {
        let dir = pki();
        assert_eq!(
            Args::try_parse_from(["proxy-server"])
                .unwrap()
                .frontend_write_channel_size,
            None,
            "ANP's 10, not named"
        );
        for size in ["0", "10", "4096"] {
            let mut args = uds_args(dir.path());
            args.push(format!("--frontend-write-channel-size={size}"));
            let config = parse(&args).unwrap();
            let notice = &config.notices[0];
            assert_eq!(notice.flag, "frontend-write-channel-size");
            assert!(
                notice.text.starts_with(&format!("{size}: no effect")),
                "{notice:?}"
            );
        }
        for argv in [
            &["--frontend-write-channel-size=-1"][..],
            &["--frontend-write-channel-size", "-10"],
            &["--frontend-write-channel-size=ten"],
        ] {
            let err = Args::try_parse_from(std::iter::once(&"proxy-server").chain(argv))
                .err()
                .unwrap();
            assert_eq!(
                err.kind(),
                clap::error::ErrorKind::ValueValidation,
                "{argv:?}"
            );
            let text = err.to_string();
            assert!(text.contains("--frontend-write-channel-size"), "{text}");
        }
    }

    #[test]
    fn syntax_errors_name_the_flag() {
        for (arg, needle) in [
            ("--keepalive-time=1", "--keepalive-time"),
            ("--agent-port=abc", "--agent-port"),
            (
                "--delete-existing-uds-file=maybe",
                "--delete-existing-uds-file",
            ),
            ("--backend-dial-timeout=-1s", "--backend-dial-timeout"),
            ("--frontend-stall-timeout=-1s", "--frontend-stall-timeout"),
            ("--max-tls-handshakes=many", "--max-tls-handshakes"),
            ("--mode=socks", "--mode"),
        ] {
            let err = Args::try_parse_from(["proxy-server", arg])
                .err()
                .unwrap()
                .to_string();
            assert!(err.contains(needle), "{arg}: {err}");
        }
    }

    /// A flag without effect is named only when given, and the content
    /// type only when it asks for something other than JSON (which the
    /// kube crate speaks); the deprecated flag is named whatever its value.
    #[test]
    fn flags_without_effect_and_deprecated_ones_are_named_when_given() {
        let dir = pki();
        let with = |extra: &[&str]| {
            let mut args = uds_args(dir.path());
            args.extend(extra.iter().map(|s| (*s).to_owned()));
            parse(&args).unwrap()
        };
        let plain = with(&[]);
        assert!(plain.not_implemented.is_empty());
        assert!(plain.deprecated.is_empty());
        assert_eq!(
            with(&["--kube-api-content-type=application/vnd.kubernetes.protobuf"]).not_implemented,
            ["kube-api-content-type"]
        );
        assert!(
            with(&["--kube-api-content-type=application/json"])
                .not_implemented
                .is_empty()
        );
        for given in ["--warn-on-channel-limit", "--warn-on-channel-limit=false"] {
            let c = with(&[given]);
            assert!(c.not_implemented.is_empty(), "{given}");
            assert_eq!(c.deprecated.len(), 1, "{given}");
            assert_eq!(c.deprecated[0].flag, "warn-on-channel-limit");
        }
    }

    /// `--cipher-suites` is a pflag StringSlice: a repeated flag appends.
    /// Go's ECDHE CBC suites are accepted and left out while a usable
    /// TLS 1.2 suite remains, or when only TLS 1.3 is allowed.
    #[test]
    fn cipher_suites_append_and_cbc_suites_are_left_out() {
        let a = Args::try_parse_from([
            "proxy-server",
            "--cipher-suites=TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA",
            "--cipher-suites",
            "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256,TLS_AES_128_GCM_SHA256",
        ])
        .unwrap();
        assert_eq!(
            ops::flags::string_slice(&a.cipher_suites),
            [
                "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA",
                "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256",
                "TLS_AES_128_GCM_SHA256"
            ]
        );
        let dir = pki();
        let with = |extra: &[&str]| {
            let mut args = uds_args(dir.path());
            args.extend(extra.iter().map(|s| (*s).to_owned()));
            parse(&args)
        };
        with(&[
            "--cipher-suites=TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA",
            "--cipher-suites=TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256",
        ])
        .unwrap();
        with(&[
            "--cipher-suites=TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA",
            "--tls-min-version=VersionTLS13",
        ])
        .unwrap();
        // The second occurrence is read too: its bad name is refused.
        let err = with(&[
            "--cipher-suites=TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256",
            "--cipher-suites=TLS_RSA_WITH_RC4_128_SHA",
        ])
        .err()
        .unwrap()
        .to_string();
        assert!(err.contains("TLS_RSA_WITH_RC4_128_SHA"), "{err}");
    }

    #[test]
    fn a_repeated_flag_takes_the_last_value_as_pflag_does() {
        let a = Args::try_parse_from(["proxy-server", "--agent-port=8132", "--agent-port", "8133"])
            .unwrap();
        assert_eq!(a.agent_port, 8133);
    }

    #[test]
    fn a_tcp_frontend_needs_its_ca_and_gets_mtls() {
        let dir = pki();
        let p = |f: &str| dir.path().join(f).display().to_string();
        let c = parse(&[
            "--server-port=8090".to_owned(),
            format!("--server-cert={}", p("proxy-frontend.crt")),
            format!("--server-key={}", p("proxy-frontend.key")),
            format!("--server-ca-cert={}", p("frontend-ca.crt")),
            format!("--cluster-cert={}", p("cluster.crt")),
            format!("--cluster-key={}", p("cluster.key")),
            format!("--cluster-ca-cert={}", p("agent-ca.crt")),
            "--server-bind-address=127.0.0.1".to_owned(),
        ])
        .unwrap();
        match c.frontend {
            FrontendListen::Tcp { addr, tls } => {
                assert_eq!(addr.to_string(), "127.0.0.1:8090");
                assert_eq!(tls.load().unwrap().server.alpn_protocols, [b"h2".to_vec()]);
            }
            FrontendListen::Uds { .. } => panic!("expected TCP"),
        }
        // CONNECT over TLS offers HTTP/1.1 only.
        let c = parse(&[
            "--mode=http-connect".to_owned(),
            "--server-port=8090".to_owned(),
            format!("--server-cert={}", p("proxy-frontend.crt")),
            format!("--server-key={}", p("proxy-frontend.key")),
            format!("--server-ca-cert={}", p("frontend-ca.crt")),
            format!("--cluster-cert={}", p("cluster.crt")),
            format!("--cluster-key={}", p("cluster.key")),
            format!("--cluster-ca-cert={}", p("agent-ca.crt")),
        ])
        .unwrap();
        match c.frontend {
            FrontendListen::Tcp { tls, .. } => {
                assert_eq!(
                    tls.load().unwrap().server.alpn_protocols,
                    [b"http/1.1".to_vec()]
                );
            }
            FrontendListen::Uds { .. } => panic!("expected TCP"),
        }
    }

    #[test]
    fn lease_flags() {
        let dir = pki();
        let mut args = uds_args(dir.path());
        assert!(parse(&args).unwrap().lease.is_none());
        args.extend([
            "--enable-lease-controller".to_owned(),
            "--lease-namespace=konnectivity".to_owned(),
            "--lease-label=k8s-app=konnectivity-server,tier=control-plane".to_owned(),
            "--server-id=replica-1".to_owned(),
        ]);
        let c = parse(&args).unwrap();
        let lease = c.lease.unwrap();
        assert_eq!(lease.namespace, "konnectivity");
        assert_eq!(lease.labels.len(), 2);
        assert_eq!(lease.labels["tier"], "control-plane");
        assert_eq!(lease.duration, Duration::from_secs(30));
        assert_eq!(lease.renew_interval, Duration::from_secs(15));
        assert_eq!(
            crate::lease::lease_name(&c.server_id),
            "konnectivity-proxy-server-replica-1"
        );
        let mut bad = uds_args(dir.path());
        bad.push("--lease-label=no-value".to_owned());
        let err = parse(&bad).err().unwrap().to_string();
        assert!(err.contains("--lease-label"), "{err}");
        let mut missing = uds_args(dir.path());
        missing.extend([
            "--enable-lease-controller".to_owned(),
            "--kubeconfig=/nonexistent".to_owned(),
        ]);
        let err = parse(&missing).err().unwrap().to_string();
        assert!(err.contains("--kubeconfig"), "{err}");
    }
}
