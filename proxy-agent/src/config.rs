//! Command-line flags (ANP's names and defaults) and their validated form.

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    path::PathBuf,
    sync::Arc,
    time::Duration,
};

use clap::{ArgAction, Parser};
use edge::egress::{Proxy, ProxyUrl};
use ops::{
    flags::{
        Deprecated, FlowArgs, FlowControlVersion, GoBoolArg, LogArgs, Notice, RuntimeArgs, go_bool,
        go_duration,
    },
    tls::{self, files},
};
use tunnel::{
    flow::{self, Window},
    ids::AgentId,
};

/// proxy-agent: dials out to proxy-server and opens node-side connections for it.
///
/// Flag names and defaults are ANP's, so an existing manifest works unchanged.
#[derive(Debug, Clone, Parser)]
#[command(name = "proxy-agent", version, about, args_override_self = true)]
pub struct Args {
    /// Client certificate presented to proxy-server (mTLS).
    #[arg(long, value_name = "PATH", value_parser = ops::flags::path)]
    pub agent_cert: Option<PathBuf>,
    /// Private key of --agent-cert.
    #[arg(long, value_name = "PATH", value_parser = ops::flags::path)]
    pub agent_key: Option<PathBuf>,
    /// CA that proxy-server's certificate must chain to (required).
    #[arg(long, value_name = "PATH", value_parser = ops::flags::path)]
    pub ca_cert: Option<PathBuf>,
    /// proxy-server host (or load balancer); also the TLS server name.
    /// Beyond ANP: a comma-separated list (`a,b:8133,[fd00::1]:8132`) makes
    /// the agent connect to every entry; an entry without a port uses
    /// --proxy-server-port.
    #[arg(long, default_value = "127.0.0.1")]
    pub proxy_server_host: String,
    /// proxy-server agent port.
    #[arg(long, default_value_t = 8091)]
    pub proxy_server_port: u16,
    /// Extra ALPN protocols to offer before h2 (comma-separated; `[]` is
    /// empty; repeating the flag appends).
    #[arg(long, default_value = "[]", action = ArgAction::Append)]
    pub alpn_proto: Vec<String>,
    /// Bind host of the health server; empty means all interfaces.
    #[arg(long, default_value = "")]
    pub health_server_host: String,
    /// Health port: /healthz, /readyz, /ready (0 picks a free port).
    #[arg(long, default_value_t = 8093)]
    pub health_server_port: u16,
    /// Bind address of the admin port.
    #[arg(long, default_value = "127.0.0.1")]
    pub admin_bind_address: String,
    /// Admin port (metrics redirect, profiling).
    #[arg(long, default_value_t = 8094)]
    pub admin_server_port: u16,
    /// Serve pprof-format profiles on the admin port.
    #[arg(long, go_bool = Some(false))]
    pub enable_profiling: bool,
    /// kube-apiserver's TracingConfiguration file (YAML or JSON: endpoint,
    /// samplingRatePerMillion): dials as OpenTelemetry spans continuing the
    /// server's, exported over OTLP/gRPC. Unset: no traces.
    #[arg(long)]
    pub tracing_config_file: Option<std::path::PathBuf>,
    /// Enable contention profiling (requires --enable-profiling).
    #[arg(long, go_bool = Some(false))]
    pub enable_contention_profiling: bool,
    /// This agent's id (default: env PROXY_AGENT_ID, else a random UUID).
    #[arg(long, env = "PROXY_AGENT_ID", default_value = "")]
    pub agent_id: String,
    /// URL-encoded identifiers: host=, ipv4=, ipv6=, cidr=, default-route=true.
    #[arg(long, default_value = "")]
    pub agent_identifiers: String,
    /// Initial and steady interval of the connect loop (Go duration).
    #[arg(long, default_value = "1s", value_parser = go_duration)]
    pub sync_interval: Duration,
    /// How often each server connection is checked (Go duration).
    #[arg(long, default_value = "1s", value_parser = go_duration)]
    pub probe_interval: Duration,
    /// Maximum backoff of the connect loop (Go duration).
    #[arg(long, default_value = "10s", value_parser = go_duration)]
    pub sync_interval_cap: Duration,
    /// How often the agent renews its TLS session tickets with a short
    /// extra connection to each server address, so that a long-connected
    /// agent still resumes without a signature after a server restart;
    /// 0s: never (konnectivity-rs, Go duration).
    #[arg(long, default_value = "12h0m0s", value_parser = go_duration)]
    pub tls_session_refresh_interval: Duration,
    /// Interval of HTTP/2 keepalive pings to the server (Go duration).
    #[arg(long, default_value = "1h0m0s", value_parser = go_duration)]
    pub keepalive_time: Duration,
    /// File with a service-account token sent as `authorization: Bearer`.
    #[arg(long, value_name = "PATH", value_parser = ops::flags::path)]
    pub service_account_token_path: Option<PathBuf>,
    /// Log when a per-connection channel is full.
    #[arg(long, go_bool = Some(false))]
    pub warn_on_channel_limit: bool,
    /// Keep opening connections forever to discover server-count changes.
    #[arg(long, go_bool = Some(false))]
    pub sync_forever: bool,
    /// Capacity, in packets, of each connection's channels (ANP's default:
    /// 150). Not implemented: per-connection queues are bounded in bytes;
    /// named at start-up when given.
    #[arg(long, value_name = "PACKETS")]
    pub xfr_channel_size: Option<usize>,
    /// Compute the server count from Leases.
    #[arg(long, go_bool = Some(false))]
    pub count_server_leases: bool,
    /// Namespace watched for leases.
    #[arg(long, default_value = "kube-system")]
    pub lease_namespace: String,
    /// Label selector of counted leases (Kubernetes syntax; empty selects all).
    #[arg(long, default_value = "k8s-app=konnectivity-server")]
    pub lease_label_selector: String,
    /// Deprecated alias of --lease-label-selector (named at start-up when given).
    #[arg(long, hide = true)]
    pub lease_label: Option<String>,
    /// Where the server count comes from.
    #[arg(long, value_enum, default_value_t = ServerCountSource::Default)]
    pub server_count_source: ServerCountSource,
    /// Kubeconfig for leases; empty means in-cluster config.
    #[arg(long, value_name = "PATH", value_parser = ops::flags::path)]
    pub kubeconfig: Option<PathBuf>,
    /// Content type of kube API requests (ANP's default:
    /// application/vnd.kubernetes.protobuf); this build speaks
    /// application/json only, and names any other value at start-up.
    #[arg(long, value_name = "TYPE")]
    pub kube_api_content_type: Option<String>,
    /// Negotiate per-connection flow control with servers that support it
    /// (konnectivity-rs); ANP servers never see a difference.
    #[arg(long, go_bool = Some(true))]
    pub flow_control: bool,
    /// The window announced with it.
    #[command(flatten)]
    pub flow: FlowArgs,
    /// After the first SIGTERM/SIGINT, exit once no connection is open
    /// (konnectivity-rs). Without it a draining agent keeps serving until
    /// the second signal or the kubelet's SIGKILL, as ANP's does.
    #[arg(long, go_bool = Some(false))]
    pub exit_when_drained: bool,
    /// Bytes queued towards one server stream before the connections
    /// sending to it wait (konnectivity-rs). 1 MiB more is kept for control
    /// packets; a server that leaves even that unread is taken to have
    /// stopped reading, and its stream is closed.
    #[arg(long, default_value_t = 4 * 1024 * 1024)]
    pub max_server_queue_bytes: usize,
    /// Reach proxy-server through this proxy: socks5://, socks5h:// or
    /// http://, optionally user:password@ (default: HTTPS_PROXY / ALL_PROXY
    /// with NO_PROXY, as curl reads them).
    #[arg(long, default_value = "", hide_default_value = true)]
    pub proxy_url: ProxyUrl,
    /// The audit log: a JSON line per tunnel at its end (kube-apiserver's
    /// `--audit-log-*` flags).
    #[command(flatten)]
    pub audit: ops::audit::AuditArgs,
    /// Destination policy file (konnectivity-rs): rules that allow or deny
    /// the destinations servers ask for, by address, CIDR, named set
    /// (loopback, link-local, metadata, node), port and host name; re-read
    /// when it changes. Default: every destination allowed, as ANP.
    #[arg(long, value_name = "PATH", value_parser = ops::flags::path)]
    pub destination_policy_file: Option<PathBuf>,
    /// klog-compatible logging flags.
    #[command(flatten)]
    pub log: LogArgs,
    /// The async runtime's size (`--worker-threads`).
    #[command(flatten)]
    pub runtime: RuntimeArgs,
}

/// One entry of `--proxy-server-host`: where to reach a server (or a load
/// balancer in front of several).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerAddr {
    /// Host name or IP; also the TLS server name.
    pub host: String,
    /// Agent port.
    pub port: u16,
    /// Proxy to reach it through (`--proxy-url`, else the environment).
    pub proxy: Option<Proxy>,
}

impl ServerAddr {
    /// A server reached directly.
    pub fn new(host: impl Into<String>, port: u16) -> Self {
        Self {
            host: host.into(),
            port,
            proxy: None,
        }
    }
}

impl std::fmt::Display for ServerAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

/// Splits `--proxy-server-host` into `(host, port)` entries: `host`,
/// `host:port`, `[v6]:port` or a bare IPv6 address; duplicates refused.
///
/// # Errors
/// An empty entry, a bad port or a repeated entry, named.
pub fn parse_server_hosts(text: &str, default_port: u16) -> Result<Vec<(String, u16)>, String> {
    let mut out: Vec<(String, u16)> = Vec::new();
    for entry in text.split(',').map(str::trim) {
        if entry.is_empty() {
            return Err("empty host in the list".to_owned());
        }
        let bad_port = || format!("{entry:?} has an invalid port");
        let (host, port) = if let Some(rest) = entry.strip_prefix('[') {
            let (host, after) = rest
                .split_once(']')
                .ok_or_else(|| format!("{entry:?} lacks a closing ]"))?;
            match after.strip_prefix(':') {
                Some(port) => (host, port.parse().map_err(|_| bad_port())?),
                None if after.is_empty() => (host, default_port),
                None => return Err(format!("{entry:?} is not host, host:port or [ipv6]:port")),
            }
        } else if entry.parse::<Ipv6Addr>().is_ok() {
            (entry, default_port)
        } else {
            match entry.split_once(':') {
                Some((host, port)) => (host, port.parse().map_err(|_| bad_port())?),
                None => (entry, default_port),
            }
        };
        if host.is_empty() || port == 0 {
            return Err(format!("{entry:?} needs a host and a port above 0"));
        }
        if out.iter().any(|(h, p)| h == host && *p == port) {
            return Err(format!("{entry:?} is listed twice"));
        }
        out.push((host.to_owned(), port));
    }
    Ok(out)
}

/// Validated configuration; tests build it directly.
#[derive(Debug, Clone)]
pub struct Config {
    /// Where the servers are: one entry per `--proxy-server-host` item; the
    /// agent holds connections to every one.
    pub servers: Vec<ServerAddr>,
    /// TLS to the server: the files, read for each new connection.
    pub tls: ClientTls,
    /// This agent's id.
    pub agent_id: AgentId,
    /// Raw `agentidentifiers` value (validated).
    pub agent_identifiers: String,
    /// Health listener address.
    pub health_addr: SocketAddr,
    /// Admin listener address (`/metrics` redirect, pprof).
    pub admin_addr: SocketAddr,
    /// Serve CPU profiles on the admin port (`--enable-profiling`).
    pub profiling: bool,
    /// `--tracing-config-file`, read and checked.
    pub tracing_config: Option<ops::otel::TracingConfig>,
    /// The tracer, started from `tracing_config` by `main` (off until then).
    pub tracing: ops::otel::Tracing,
    /// Connect loop interval.
    pub sync_interval: Duration,
    /// `--tls-session-refresh-interval`; `None` for never.
    pub session_refresh: Option<Duration>,
    /// Connect loop backoff cap.
    pub sync_interval_cap: Duration,
    /// Keep connecting forever.
    pub sync_forever: bool,
    /// Server connection check interval.
    pub probe_interval: Duration,
    /// HTTP/2 keepalive interval.
    pub keepalive_time: Duration,
    /// Offer per-connection flow control (`tunnel::flow`).
    pub flow_control: bool,
    /// The receive window announced with it (`--flow-control-window`,
    /// `--flow-control-max-chunk`).
    pub flow_window: Window,
    /// What is announced of it (`--flow-control-version`).
    pub flow_version: flow::Version,
    /// Exit once drained and idle (`--exit-when-drained`).
    pub exit_when_drained: bool,
    /// `--max-server-queue-bytes`.
    pub max_server_queue_bytes: usize,
    /// Service-account token file, re-read on every connect.
    pub token_path: Option<PathBuf>,
    /// `--destination-policy-file`: followed from start-up; `None` allows
    /// every destination.
    pub destination_policy: Option<PathBuf>,
    /// Count servers by their Leases (`--count-server-leases`), if on.
    pub leases: Option<LeaseCountConfig>,
    /// `--server-count-source`.
    pub server_count_source: ServerCountSource,
    /// The audit log (`--audit-log-path`), if on.
    pub audit: Option<ops::audit::AuditConfig>,
    /// Flags given that this build accepts but does not act on.
    pub not_implemented: Vec<&'static str>,
    /// Deprecated flags given, for a start-up warning.
    pub deprecated: Vec<Deprecated>,
    /// Values accepted with a caveat, for a start-up warning.
    pub notices: Vec<Notice>,
}

/// A flag combination or value that cannot work (shared with proxy-agent).
pub use ops::flags::FlagError as ConfigError;
use ops::flags::{given_path, invalid};

/// Checks `--agent-identifiers` as ANP's agent does: only known keys, valid
/// addresses and CIDRs, and a boolean `default-route`.
fn check_identifiers(text: &str) -> Result<(), String> {
    for (key, value) in form_urlencoded::parse(text.as_bytes()) {
        match key.as_ref() {
            "host" => {}
            "ipv4" => {
                value
                    .parse::<Ipv4Addr>()
                    .map_err(|_| format!("ipv4={value} is not an IPv4 address"))?;
            }
            "ipv6" => {
                value
                    .parse::<Ipv6Addr>()
                    .map_err(|_| format!("ipv6={value} is not an IPv6 address"))?;
            }
            "cidr" => {
                let (ip, bits) = value
                    .split_once('/')
                    .ok_or_else(|| format!("cidr={value} is not a CIDR"))?;
                let ip: IpAddr = ip
                    .parse()
                    .map_err(|_| format!("cidr={value} is not a CIDR"))?;
                let bits: u8 = bits
                    .parse()
                    .map_err(|_| format!("cidr={value} is not a CIDR"))?;
                if bits > if ip.is_ipv4() { 32 } else { 128 } {
                    return Err(format!("cidr={value} has too many prefix bits"));
                }
            }
            "default-route" => {
                go_bool(&value).map_err(|_| format!("default-route={value} is not a boolean"))?;
            }
            other => {
                return Err(format!(
                    "unknown identifier type {other:?} (want host, ipv4, ipv6, cidr or default-route)"
                ));
            }
        }
    }
    Ok(())
}

fn bind_addr(flag: &'static str, host: &str, port: u16) -> Result<SocketAddr, ConfigError> {
    ops::flags::bind_addr(host, port).map_err(|reason| invalid(flag, reason))
}

impl TryFrom<Args> for Config {
    type Error = ConfigError;

    /// Checks every flag, a group at a time; reads no certificate (see
    /// [`ClientTls::load`]).
    fn try_from(args: Args) -> Result<Self, ConfigError> {
        let tls = client_tls(&args)?;
        let servers = servers(&args)?;
        limits(&args)?;
        intervals(&args)?;
        if args.enable_contention_profiling && !args.enable_profiling {
            return Err(invalid(
                "enable-contention-profiling",
                "requires --enable-profiling",
            ));
        }
        let leases = leases(&args)?;
        let token_path = given_path(args.service_account_token_path.as_ref());
        if let Some(path) = &token_path {
            ops::flags::check_readable_file("service-account-token-path", path)?;
        }
        check_identifiers(&args.agent_identifiers)
            .map_err(|reason| invalid("agent-identifiers", reason))?;
        let agent_id = if args.agent_id.is_empty() {
            AgentId(uuid::Uuid::new_v4().to_string())
        } else {
            AgentId(args.agent_id.clone())
        };
        Ok(Self {
            servers,
            tls,
            agent_id,
            agent_identifiers: args.agent_identifiers.clone(),
            health_addr: bind_addr(
                "health-server-host",
                &args.health_server_host,
                args.health_server_port,
            )?,
            admin_addr: bind_addr(
                "admin-bind-address",
                &args.admin_bind_address,
                args.admin_server_port,
            )?,
            profiling: args.enable_profiling,
            tracing_config: args
                .tracing_config_file
                .as_deref()
                .map(ops::otel::TracingConfig::load)
                .transpose()
                .map_err(|e| {
                    ops::flags::invalid(
                        "tracing-config-file",
                        format!("{}: {}", e.path.display(), e.what),
                    )
                })?,
            tracing: ops::otel::Tracing::off(),
            sync_interval: args.sync_interval,
            sync_interval_cap: args.sync_interval_cap,
            session_refresh: (!args.tls_session_refresh_interval.is_zero())
                .then_some(args.tls_session_refresh_interval),
            sync_forever: args.sync_forever,
            probe_interval: args.probe_interval,
            keepalive_time: args.keepalive_time,
            flow_control: args.flow_control,
            flow_window: Window::from_flags(
                args.flow.flow_control_window,
                args.flow.flow_control_max_chunk,
            )
            .map_err(|(flag, reason)| invalid(flag, reason))?,
            flow_version: match args.flow.flow_control_version {
                FlowControlVersion::V1 => flow::Version::V1,
                FlowControlVersion::V2 => flow::Version::V2,
            },
            exit_when_drained: args.exit_when_drained,
            max_server_queue_bytes: args.max_server_queue_bytes,
            token_path,
            destination_policy: given_path(args.destination_policy_file.as_ref()),
            leases,
            server_count_source: args.server_count_source,
            audit: args.audit.config()?,
            not_implemented: not_implemented(&args),
            deprecated: deprecated(&args),
            notices: args.flow.notice(args.flow_control).into_iter().collect(),
        })
    }
}

/// `--ca-cert`, `--agent-cert`, `--agent-key`, `--alpn-proto`.
fn client_tls(args: &Args) -> Result<ClientTls, ConfigError> {
    let ca = given_path(args.ca_cert.as_ref()).ok_or_else(|| {
        invalid(
            "ca-cert",
            "required: the server's certificate is always verified",
        )
    })?;
    let client = match (
        given_path(args.agent_cert.as_ref()),
        given_path(args.agent_key.as_ref()),
    ) {
        (Some(cert), Some(key)) => Some((cert, key)),
        (None, None) => None,
        _ => {
            return Err(invalid(
                "agent-cert",
                "--agent-cert and --agent-key go together",
            ));
        }
    };
    Ok(ClientTls {
        alpn: ops::flags::string_slice(&args.alpn_proto),
        ..ClientTls::new(ca, client)
    })
}

/// `--proxy-server-host`, `--proxy-server-port`, `--proxy-url` (or the
/// proxy environment variables).
fn servers(args: &Args) -> Result<Vec<ServerAddr>, ConfigError> {
    if args.proxy_server_port == 0 {
        return Err(invalid("proxy-server-port", "must be greater than 0"));
    }
    if args.proxy_server_host.is_empty() {
        return Err(invalid("proxy-server-host", "must not be empty"));
    }
    let proxy_url = (!args.proxy_url.is_empty())
        .then(|| Proxy::parse(&args.proxy_url).map_err(|reason| invalid("proxy-url", reason)))
        .transpose()?;
    parse_server_hosts(&args.proxy_server_host, args.proxy_server_port)
        .map_err(|reason| invalid("proxy-server-host", reason))?
        .into_iter()
        .map(|(host, port)| {
            let proxy = match &proxy_url {
                Some(proxy) => Some(proxy.clone()),
                None => Proxy::from_env(|name| std::env::var(name).ok(), &host)
                    .map_err(|reason| invalid("proxy-url", reason))?,
            };
            Ok(ServerAddr { host, port, proxy })
        })
        .collect()
}

/// The queue caps.
fn limits(args: &Args) -> Result<(), ConfigError> {
    if args.xfr_channel_size == Some(0) {
        return Err(invalid("xfr-channel-size", "must be greater than 0"));
    }
    if args.max_server_queue_bytes == 0 {
        return Err(invalid("max-server-queue-bytes", "must be greater than 0"));
    }
    Ok(())
}

/// `--sync-interval`, `--sync-interval-cap`, `--probe-interval`.
fn intervals(args: &Args) -> Result<(), ConfigError> {
    if args.sync_interval > args.sync_interval_cap {
        return Err(invalid(
            "sync-interval",
            "must not exceed --sync-interval-cap",
        ));
    }
    if args.sync_interval.is_zero() {
        return Err(invalid("sync-interval", "must be greater than 0"));
    }
    if args.probe_interval.is_zero() {
        return Err(invalid("probe-interval", "must be greater than 0"));
    }
    Ok(())
}

/// Lease counting (`--count-server-leases`, `--lease-namespace`,
/// `--lease-label-selector` or the deprecated `--lease-label` (which wins
/// when given, as in ANP), `--kubeconfig`). The selectors and the
/// kubeconfig are checked whatever `--count-server-leases` says (ANP parses
/// them as flags); an empty selector selects every lease.
fn leases(args: &Args) -> Result<Option<LeaseCountConfig>, ConfigError> {
    ops::kube::selector::check_label_selector(&args.lease_label_selector)
        .map_err(|reason| invalid("lease-label-selector", reason))?;
    if let Some(label) = &args.lease_label {
        ops::kube::selector::check_label_selector(label)
            .map_err(|reason| invalid("lease-label", reason))?;
    }
    if args.count_server_leases && args.lease_namespace.is_empty() {
        return Err(invalid("lease-namespace", "must not be empty"));
    }
    let kubeconfig = given_path(args.kubeconfig.as_ref());
    if let Some(path) = &kubeconfig {
        ops::flags::check_readable_file("kubeconfig", path)?;
    }
    let selector = args
        .lease_label
        .as_ref()
        .unwrap_or(&args.lease_label_selector);
    Ok(args.count_server_leases.then(|| LeaseCountConfig {
        namespace: args.lease_namespace.clone(),
        selector: selector.clone(),
        kubeconfig,
    }))
}

/// Flags given that this build accepts but does not act on.
fn not_implemented(args: &Args) -> Vec<&'static str> {
    [
        // Rust has no block profiler; CPU profiles are served.
        (
            "enable-contention-profiling",
            args.enable_contention_profiling,
        ),
        // Per-connection queues are bounded in bytes and never block the
        // stream, so there is no channel limit to warn about.
        ("warn-on-channel-limit", args.warn_on_channel_limit),
        // ... and not in packets: the flag has nothing to size.
        ("xfr-channel-size", args.xfr_channel_size.is_some()),
        // The kube crate speaks JSON only.
        (
            "kube-api-content-type",
            args.kube_api_content_type
                .as_ref()
                .is_some_and(|t| t != "application/json"),
        ),
    ]
    .into_iter()
    .filter_map(|(flag, given)| given.then_some(flag))
    .chain(args.log.without_effect())
    .collect()
}

/// Deprecated flags given.
fn deprecated(args: &Args) -> Vec<Deprecated> {
    args.lease_label
        .as_ref()
        .map(|_| Deprecated {
            flag: "lease-label",
            note: "use --lease-label-selector; when given, --lease-label wins (ANP)",
        })
        .into_iter()
        .collect()
}

/// The agent's TLS files, named by their flags, read for each new
/// connection to a server (so a rotated certificate is used from the next
/// connection on).
#[derive(Debug, Clone)]
pub struct ClientTls {
    /// `--ca-cert`: the CA the server's certificate must chain to; and for
    /// mTLS `--agent-cert` and `--agent-key`.
    pub files: files::CertFiles,
    /// `--alpn-proto`: protocols offered before h2.
    pub alpn: Vec<String>,
    /// Offer TLS session resumption (the bench's swarm turns it off, so
    /// that every agent does a full handshake).
    pub resumption: bool,
}

impl ClientTls {
    /// The files of `ca` and, for mTLS, `client` (certificate, key).
    pub fn new(ca: PathBuf, client: Option<(PathBuf, PathBuf)>) -> Self {
        Self {
            files: files::CertFiles {
                identity: client.map(|(cert, key)| (("agent-cert", cert), ("agent-key", key))),
                ca: Some(("ca-cert", ca)),
                secret: None,
            },
            alpn: Vec::new(),
            resumption: true,
        }
    }

    /// Reads the files into a TLS configuration.
    ///
    /// # Errors
    /// A file cannot be read or parsed, or the key does not match the
    /// certificate; the error names the flag of the file.
    pub fn load(&self) -> Result<Arc<rustls::ClientConfig>, ConfigError> {
        Ok(self.files.load(self.build())?)
    }

    /// The TLS configuration that follows the files: each new connection
    /// to a server uses them as they are then, or the last good ones (see
    /// [`ops::tls::files`]); `metrics` shows the certificates' expiry and
    /// counts failed reloads.
    ///
    /// # Errors
    /// As [`load`](Self::load): at start-up there is nothing to keep.
    pub fn follow(
        &self,
        metrics: files::CertMetrics,
    ) -> Result<files::TlsFiles<rustls::ClientConfig>, ConfigError> {
        Ok(self
            .files
            .follow("server connections", metrics, self.build())?)
    }

    /// Builds the configuration from the files as they are when called.
    fn build(&self) -> impl Fn() -> Result<Arc<rustls::ClientConfig>, tls::TlsError> + use<> {
        let Self {
            files,
            alpn,
            resumption,
        } = self.clone();
        move || {
            let ca = files.ca.as_ref().map(|(_, ca)| ca.as_path());
            let loaded = tls::client_config(
                ca.expect("an agent has a CA"),
                files
                    .identity
                    .as_ref()
                    .map(|((_, cert), (_, key))| (cert.as_path(), key.as_path())),
                &alpn,
            )?;
            if resumption {
                return Ok(loaded);
            }
            let mut config = (*loaded).clone();
            config.resumption = rustls::client::Resumption::disabled();
            Ok(Arc::new(config))
        }
    }
}

/// Where to count leases, from the flags.
#[derive(Debug, Clone)]
pub struct LeaseCountConfig {
    /// `--lease-namespace`.
    pub namespace: String,
    /// `--lease-label-selector` (or the deprecated `--lease-label`).
    pub selector: String,
    /// `--kubeconfig`; `None` means in-cluster configuration.
    pub kubeconfig: Option<PathBuf>,
}

/// `--server-count-source`: how leases and server answers combine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum ServerCountSource {
    /// Leases when counting them, else the servers' `servercount` (also
    /// an empty value, as ANP reads it).
    #[default]
    #[value(alias = "")]
    Default,
    /// The larger of the two.
    Max,
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    fn pki() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        certs::ClusterPki::generate(&[])
            .unwrap()
            .write_to(dir.path())
            .unwrap();
        dir
    }

    fn parse(dir: &std::path::Path, extra: &[&str]) -> Result<Config, ConfigError> {
        let mut argv = vec![
            "proxy-agent".to_owned(),
            format!("--ca-cert={}", dir.join("agent-ca.crt").display()),
            format!("--agent-cert={}", dir.join("proxy-agent.crt").display()),
            format!("--agent-key={}", dir.join("proxy-agent.key").display()),
        ];
        argv.extend(extra.iter().map(|s| (*s).to_owned()));
        let config =
            Config::try_from(
                Args::try_parse_from(argv).map_err(|e| ConfigError::Invalid {
                    flag: "(syntax)",
                    reason: e.to_string(),
                })?,
            )?;
        // As the agent does when it starts.
        config.tls.load()?;
        Ok(config)
    }

    #[test]
    fn defaults_are_anps() {
        let a = Args::try_parse_from(["proxy-agent"]).unwrap();
        assert_eq!(a.proxy_server_host, "127.0.0.1");
        assert_eq!(a.proxy_server_port, 8091);
        assert_eq!(a.alpn_proto, ["[]"]);
        assert_eq!(a.health_server_host, "");
        assert_eq!(a.health_server_port, 8093);
        assert_eq!(a.admin_bind_address, "127.0.0.1");
        assert_eq!(a.admin_server_port, 8094);
        assert_eq!(a.sync_interval, Duration::from_secs(1));
        assert_eq!(a.probe_interval, Duration::from_secs(1));
        assert_eq!(a.sync_interval_cap, Duration::from_secs(10));
        assert_eq!(a.keepalive_time, Duration::from_secs(3600));
        assert_eq!(a.xfr_channel_size, None, "150, not named");
        assert_eq!(a.max_server_queue_bytes, 4 << 20);
        assert!(!a.sync_forever);
        assert!(!a.warn_on_channel_limit);
        assert_eq!(a.lease_namespace, "kube-system");
        assert_eq!(a.lease_label_selector, "k8s-app=konnectivity-server");
        assert_eq!(a.server_count_source, ServerCountSource::Default);
        assert_eq!(a.kube_api_content_type, None, "protobuf, not named");
    }

    /// `--flow-control-version`: v2 by default; v1 pins what is announced,
    /// and names the window flags it makes void at start-up.
    #[test]
    fn flow_control_version_pins_what_is_announced() {
        let dir = pki();
        let config = parse(dir.path(), &[]).unwrap();
        assert_eq!(config.flow_version, flow::Version::V2);
        assert!(config.notices.is_empty());
        let config = parse(dir.path(), &["--flow-control-version=v1"]).unwrap();
        assert_eq!(config.flow_version, flow::Version::V1);
        assert!(config.notices.is_empty(), "{:?}", config.notices);
        let config = parse(
            dir.path(),
            &["--flow-control-version=v1", "--flow-control-window=65536"],
        )
        .unwrap();
        let flags: Vec<_> = config.notices.iter().map(|n| n.flag).collect();
        assert_eq!(flags, ["flow-control-version"]);
        assert!(
            config.notices[0].text.contains("--flow-control-window"),
            "{:?}",
            config.notices
        );
        let config = parse(
            dir.path(),
            &["--flow-control-version=v1", "--flow-control=false"],
        )
        .unwrap();
        assert!(
            config.notices[0].text.contains("--flow-control=false"),
            "{:?}",
            config.notices
        );
        let err = parse(dir.path(), &["--flow-control-version=v3"])
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("--flow-control-version"), "{err}");
    }

    /// What ANP's external-agent test runner passes: every flag as `--name=value`.
    #[test]
    fn the_anp_test_runner_argv_parses() {
        let dir = pki();
        let c = parse(
            dir.path(),
            &[
                "--admin-bind-address=127.0.0.1",
                "--admin-server-port=0",
                "--agent-id=agent-1",
                "--agent-identifiers=",
                "--alpn-proto=[]",
                "--count-server-leases=false",
                "--enable-contention-profiling=false",
                "--enable-profiling=false",
                "--health-server-host=127.0.0.1",
                "--health-server-port=0",
                "--keepalive-time=1h0m0s",
                "--kube-api-content-type=application/vnd.kubernetes.protobuf",
                "--kubeconfig=",
                "--lease-label=k8s-app=konnectivity-server",
                "--lease-label-selector=k8s-app=konnectivity-server",
                "--lease-namespace=kube-system",
                "--probe-interval=100ms",
                "--proxy-server-host=localhost",
                "--proxy-server-port=8091",
                "--server-count-source=default",
                "--service-account-token-path=",
                "--sync-forever=false",
                "--sync-interval=100ms",
                "--sync-interval-cap=1s",
                "--warn-on-channel-limit=false",
                "--xfr-channel-size=150",
            ],
        )
        .unwrap();
        assert_eq!(c.agent_id.0, "agent-1");
        assert_eq!(c.sync_interval, Duration::from_millis(100));
        assert_eq!(c.sync_interval_cap, Duration::from_secs(1));
        assert_eq!(c.servers, [ServerAddr::new("localhost", 8091)]);
        // The runner passes every flag, so the ones without effect here
        // are named, and the deprecated one too.
        assert_eq!(
            c.not_implemented,
            ["xfr-channel-size", "kube-api-content-type"]
        );
        assert_eq!(
            c.deprecated.iter().map(|d| d.flag).collect::<Vec<_>>(),
            ["lease-label"]
        );
    }

    /// A flag without effect is named only when given, and the content
    /// type only when it asks for something other than JSON (which the
    /// kube crate speaks).
    #[test]
    fn flags_without_effect_are_named_when_given() {
        let dir = pki();
        let named = |extra: &[&str]| parse(dir.path(), extra).unwrap().not_implemented;
        assert!(named(&[]).is_empty());
        assert_eq!(named(&["--xfr-channel-size=150"]), ["xfr-channel-size"]);
        assert_eq!(
            named(&["--kube-api-content-type=application/vnd.kubernetes.protobuf"]),
            ["kube-api-content-type"]
        );
        assert!(named(&["--kube-api-content-type=application/json"]).is_empty());
        assert_eq!(
            named(&["--warn-on-channel-limit"]),
            ["warn-on-channel-limit"]
        );
        assert!(parse(dir.path(), &[]).unwrap().deprecated.is_empty());
        let deprecated = parse(dir.path(), &["--lease-label=app=a"])
            .unwrap()
            .deprecated;
        assert_eq!(deprecated.len(), 1);
        assert_eq!(deprecated[0].flag, "lease-label");
        assert!(deprecated[0].note.contains("--lease-label-selector"));
    }

    #[test]
    fn invalid_values_name_the_flag() {
        let dir = pki();
        for (extra, needle) in [
            (&["--sync-interval=20s"][..], "--sync-interval"),
            (&["--xfr-channel-size=0"], "--xfr-channel-size"),
            (&["--max-server-queue-bytes=0"], "--max-server-queue-bytes"),
            (&["--proxy-server-port=0"], "--proxy-server-port"),
            (&["--agent-identifiers=zone=a"], "--agent-identifiers"),
            (&["--server-count-source=min"], "--server-count-source"),
            (
                &["--service-account-token-path=/nonexistent/token"],
                "/nonexistent/token",
            ),
            (
                &["--enable-contention-profiling"],
                "--enable-contention-profiling",
            ),
            (&["--health-server-host=nope"], "--health-server-host"),
            (&["--proxy-url=ftp://proxy:21"], "--proxy-url"),
            (&["--proxy-url=http://proxy:port"], "--proxy-url"),
        ] {
            let err = parse(dir.path(), extra)
                .err()
                .unwrap_or_else(|| panic!("{extra:?}"));
            let text = ops::error::DisplayErrorStack(&err).to_string();
            assert!(text.contains(needle), "{extra:?}: {text}");
        }
        let err = Config::try_from(Args::try_parse_from(["proxy-agent"]).unwrap()).unwrap_err();
        assert!(err.to_string().contains("--ca-cert"), "{err}");
        let config = Config::try_from(
            Args::try_parse_from(["proxy-agent", "--ca-cert=/nonexistent/ca.crt"]).unwrap(),
        )
        .expect("the files are read when the agent starts, not while parsing");
        let err = config.tls.load().unwrap_err();
        let text = ops::error::DisplayErrorStack(&err).to_string();
        assert!(
            text.contains("--ca-cert") && text.contains("/nonexistent/ca.crt"),
            "{text}"
        );
        let err = Args::try_parse_from(["proxy-agent", "--sync-interval=5"])
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("--sync-interval"), "{err}");
    }

    /// ANP's flags are strings: an empty path or an empty
    /// `--server-count-source` is the same as none.
    #[test]
    fn empty_values_are_not_given() {
        let dir = pki();
        let config = parse(
            dir.path(),
            &[
                "--kubeconfig=",
                "--service-account-token-path=",
                "--server-count-source=",
            ],
        )
        .unwrap();
        assert_eq!(config.token_path, None);
        assert_eq!(config.server_count_source, ServerCountSource::Default);
        let err = Config::try_from(
            Args::try_parse_from(["proxy-agent", "--ca-cert=", "--agent-cert=/x"]).unwrap(),
        )
        .unwrap_err();
        assert!(err.to_string().contains("--ca-cert"), "{err}");
    }

    #[test]
    fn alpn_protos_append_like_pflag() {
        let dir = pki();
        let alpn = |extra: &[&str]| {
            parse(dir.path(), extra)
                .unwrap()
                .tls
                .load()
                .unwrap()
                .alpn_protocols
                .clone()
        };
        let h2 = b"h2".to_vec();
        assert_eq!(alpn(&[]), std::slice::from_ref(&h2));
        assert_eq!(alpn(&["--alpn-proto=[]"]), std::slice::from_ref(&h2));
        let repeated = alpn(&["--alpn-proto=a", "--alpn-proto", "b,c"]);
        assert_eq!(repeated, alpn(&["--alpn-proto=a,b,c"]));
        assert_eq!(
            repeated,
            [b"a".to_vec(), b"b".to_vec(), b"c".to_vec(), h2.clone()]
        );
        assert_eq!(
            alpn(&["--alpn-proto=[]", "--alpn-proto=[x,y]"]),
            [b"x".to_vec(), b"y".to_vec(), h2]
        );
    }

    #[test]
    fn identifiers_are_checked() {
        assert!(check_identifiers("").is_ok());
        assert!(
            check_identifiers("host=n1&ipv4=10.0.0.1&ipv6=::1&cidr=10.0.0.0/8&default-route=true")
                .is_ok()
        );
        for bad in [
            "zone=a",
            "ipv4=nope",
            "ipv6=1.2.3.4",
            "cidr=10.0.0.0",
            "cidr=10.0.0.0/33",
            "default-route=maybe",
        ] {
            assert!(check_identifiers(bad).is_err(), "{bad}");
        }
        assert!(check_identifiers("zone=a").unwrap_err().contains("zone"));
    }

    #[test]
    fn server_host_lists() {
        let hosts = |text| parse_server_hosts(text, 8091);
        assert_eq!(
            hosts("konnectivity").unwrap(),
            [("konnectivity".to_owned(), 8091)]
        );
        assert_eq!(
            hosts("a, b:8133,[fd00::1]:9000,fd00::2,[::1]").unwrap(),
            [
                ("a".to_owned(), 8091),
                ("b".to_owned(), 8133),
                ("fd00::1".to_owned(), 9000),
                ("fd00::2".to_owned(), 8091),
                ("::1".to_owned(), 8091),
            ]
        );
        for (bad, needle) in [
            ("a,,b", "empty"),
            ("a:x", "invalid port"),
            ("a:0", "above 0"),
            ("a,a:8091", "twice"),
            ("[::1", "closing"),
            ("[::1]x", "[ipv6]:port"),
            (":8091", "needs a host"),
        ] {
            let err = hosts(bad).unwrap_err();
            assert!(err.contains(needle), "{bad}: {err}");
        }
    }

    #[test]
    fn lease_flags() {
        let dir = pki();
        let off = parse(dir.path(), &[]).unwrap();
        assert!(off.leases.is_none());
        assert_eq!(off.server_count_source, ServerCountSource::Default);
        let on = parse(
            dir.path(),
            &[
                "--count-server-leases",
                "--lease-namespace=konnectivity",
                "--lease-label-selector=app=a",
                "--server-count-source=max",
            ],
        )
        .unwrap();
        let leases = on.leases.unwrap();
        assert_eq!(leases.namespace, "konnectivity");
        assert_eq!(leases.selector, "app=a");
        assert_eq!(leases.kubeconfig, None, "in-cluster");
        assert_eq!(on.server_count_source, ServerCountSource::Max);
        // When given, the hidden, deprecated alias decides (documented).
        let alias = parse(
            dir.path(),
            &[
                "--count-server-leases=true",
                "--lease-label-selector=app=a",
                "--lease-label=app=b",
            ],
        )
        .unwrap();
        assert_eq!(alias.leases.unwrap().selector, "app=b");
        // An empty selector counts every lease of the namespace (ANP).
        let all = parse(
            dir.path(),
            &["--count-server-leases", "--lease-label-selector="],
        )
        .unwrap();
        assert_eq!(all.leases.unwrap().selector, "");
        let selector = parse(
            dir.path(),
            &[
                "--count-server-leases",
                "--lease-label-selector=k8s-app in (konnectivity-server),!canary",
            ],
        )
        .unwrap();
        assert_eq!(
            selector.leases.unwrap().selector,
            "k8s-app in (konnectivity-server),!canary"
        );
        // The selectors and the kubeconfig are checked with leases off too.
        for (extra, needle) in [
            (
                &["--lease-label-selector=*notavalidlabel*"][..],
                "--lease-label-selector: \"*notavalidlabel*\"",
            ),
            (
                &["--lease-label=*notavalidlabel*"],
                "--lease-label: \"*notavalidlabel*\"",
            ),
            (
                &["--count-server-leases", "--lease-label-selector=app in a"],
                "--lease-label-selector",
            ),
            (
                &["--count-server-leases", "--lease-namespace="],
                "--lease-namespace",
            ),
            (
                &["--kubeconfig=/nonexistent/kubeconfig"],
                "--kubeconfig: cannot read /nonexistent/kubeconfig",
            ),
            (
                &["--count-server-leases", "--kubeconfig=/nonexistent"],
                "--kubeconfig",
            ),
        ] {
            let err = parse(dir.path(), extra).err().unwrap().to_string();
            assert!(err.contains(needle), "{extra:?}: {err}");
        }
        let dir_as_kubeconfig = format!("--kubeconfig={}", dir.path().display());
        let err = parse(dir.path(), &[&dir_as_kubeconfig])
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("is not a file"), "{err}");
        let kubeconfig = dir.path().join("kubeconfig");
        std::fs::write(&kubeconfig, "apiVersion: v1\nkind: Config\n").unwrap();
        let c = parse(
            dir.path(),
            &[&format!("--kubeconfig={}", kubeconfig.display())],
        )
        .unwrap();
        assert!(c.leases.is_none(), "checked, not used");
    }
}
