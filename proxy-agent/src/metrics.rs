//! Prometheus metrics of the agent: ANP's set (names, types, labels, HELP
//! and buckets as `konnectivity_network_proxy_agent_*`), process metrics,
//! and konnectivity-rs additions under `konnectivity_rs_agent_*`.
//!
//! The three gauges (open server and endpoint connections, known server
//! count) are read from the agent's state when scraped; the rest is
//! recorded where it happens, a labelled series appearing once observed.
//! As in ANP, the dial latency and the open server and endpoint
//! connection gauges stay out of the exposition until first set.

use std::{
    sync::{
        Arc, Weak,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use ops::{
    kube::{Call, CallKind, status_reason},
    metrics::{ByLabel, Counter, Histogram, Metrics, Observed, PacketCounters, StreamErrors},
    tls::files::CertMetrics,
};
use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{MetricType, family::Family},
};

/// Buckets of ANP's agent latency histograms.
const AGENT_BUCKETS: [f64; 7] = [0.005, 0.025, 0.1, 0.5, 2.5, 10.0, 30.0];

const PREFIX: &str = "konnectivity_network_proxy_agent_";

ops::label_enum! {
    /// Which way a packet went on a server stream (`segment`, ANP's
    /// names: the agent's packets are `from_agent`).
    pub(crate) enum Segment {
        /// From the server to the agent.
        ToAgent = "to_agent",
        /// From the agent to the server.
        FromAgent = "from_agent",
    }
}

ops::label_enum! {
    /// Which way a server stream failed (`direction`).
    pub(crate) enum ServerDirection {
        /// Receiving from the server.
        FromServer = "from_server",
        /// Sending to the server.
        ToServer = "to_server",
    }
}

ops::label_enum! {
    /// Which way tunnel bytes went (`direction`).
    pub(crate) enum Direction {
        /// Towards destinations.
        ToEndpoint = "to_endpoint",
        /// Back to the server.
        ToServer = "to_server",
    }
}

ops::label_enum! {
    /// Why a destination dial failed (`endpoint_dial_failure_total`'s
    /// `reason`, ANP's).
    pub(crate) enum EndpointDialFailure {
        /// It timed out.
        Timeout = "timeout",
        /// Anything else.
        Unknown = "unknown",
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResponseLabels {
    http_response_code: String,
    reason: &'static str,
}

/// The destination policy's rule that refused a dial (`rule`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RuleLabel {
    rule: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResponseCodeLabel {
    http_response_code: String,
}

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

fn agent_histogram() -> Histogram {
    Histogram::new(AGENT_BUCKETS)
}

/// What the three gauges read when scraped: the agent's live state.
pub(crate) trait Live: Send + Sync {
    /// Connected servers.
    fn server_connections(&self) -> usize;
    /// Servers the agent works towards.
    fn target_count(&self) -> usize;
    /// Open node-side connections.
    fn endpoint_connections(&self) -> usize;
}

/// The lease watch's metrics, made before the agent's state (whose lease
/// counter reports to them) and registered with the rest.
#[derive(Clone)]
pub(crate) struct LeaseMetrics {
    lists: Family<ResponseLabels, Counter>,
    watches: Family<ResponseLabels, Counter>,
    list_latency: HistogramFamily<ResponseCodeLabel>,
}

impl Default for LeaseMetrics {
    fn default() -> Self {
        Self {
            lists: Family::default(),
            watches: Family::default(),
            list_latency: HistogramFamily::new_with_constructor(agent_histogram),
        }
    }
}

impl LeaseMetrics {
    /// A kube API call of the lease watch.
    pub(crate) fn lease_call(&self, call: &Call) {
        let labels = ResponseLabels {
            http_response_code: call.status.to_string(),
            reason: status_reason(call.status),
        };
        match call.kind {
            CallKind::List => {
                self.lists.get_or_create(&labels).inc();
                self.list_latency
                    .get_or_create(&ResponseCodeLabel {
                        http_response_code: call.status.to_string(),
                    })
                    .observe(call.took.as_secs_f64());
            }
            CallKind::Watch => self.watches.get_or_create(&labels).inc(),
            CallKind::Delete | CallKind::Other => {}
        }
    }
}

/// A state that is never there: the gauges read 0.
struct Nothing;

impl Live for Nothing {
    fn server_connections(&self) -> usize {
        0
    }
    fn target_count(&self) -> usize {
        0
    }
    fn endpoint_connections(&self) -> usize {
        0
    }
}

ops::label_enum! {
    /// Why a node-side connection ended (konnectivity-rs).
    pub(crate) enum EndpointCloseReason {
        /// The destination closed it.
        EndpointClosed = "endpoint_closed",
        /// Reading or writing the destination failed.
        EndpointError = "endpoint_error",
        /// The server (its frontend) closed it.
        ServerClosed = "server_closed",
        /// The destination read too slowly: a window behind.
        Overflow = "overflow",
        /// The destination did not take the last bytes in time after the
        /// server's close.
        DrainTimedOut = "drain_timeout",
        /// The server stream ended.
        StreamGone = "stream_gone",
    }
}

/// Everything the agent records.
pub struct AgentMetrics {
    exposition: Arc<Metrics>,
    dial_duration: Observed<Histogram>,
    /// Whether an endpoint connection was ever opened (shows the gauge).
    endpoint_seen: Arc<AtomicBool>,
    server_failures: ByLabel<ServerDirection, Counter>,
    dial_failures: ByLabel<EndpointDialFailure, Counter>,
    /// ANP's `stream_packets_total`.
    pub(crate) packets: PacketCounters<Segment>,
    errors: StreamErrors<Segment>,
    /// `konnectivity_rs_agent_tunnel_bytes_total`.
    pub(crate) bytes: ByLabel<Direction, Counter>,
    closed: ByLabel<EndpointCloseReason, Counter>,
    blocked: Counter,
    limits: Counter,
    /// The audit log's (`konnectivity_rs_agent_audit_*`).
    audit: ops::audit::AuditMetrics,
    denied: Family<RuleLabel, Counter>,
    policy_reload_failures: Counter,
}

/// konnectivity-rs's own series (and the tracer's dropped spans, which
/// it counts itself).
struct Ours {
    bytes: ByLabel<Direction, Counter>,
    closed: ByLabel<EndpointCloseReason, Counter>,
    blocked: Counter,
    limits: Counter,
    denied: Family<RuleLabel, Counter>,
    policy_reload_failures: Counter,
}

impl Ours {
    fn register(m: &mut Metrics) -> Self {
        Self {
            bytes: ByLabel::register(
                m,
                "konnectivity_rs_agent_tunnel_bytes_total",
                "Payload bytes carried through the tunnel, by direction (to_endpoint: towards destinations; to_server: back)",
                "direction",
            ),
            closed: ByLabel::register(
                m,
                "konnectivity_rs_agent_connections_closed_total",
                "Node-side connections that ended, by reason (endpoint_closed, endpoint_error, server_closed, overflow, drain_timeout, stream_gone)",
                "reason",
            ),
            blocked: m.register(
                "konnectivity_rs_agent_blocked_seconds_total",
                "Seconds server stream readers spent waiting for room in a full per-connection buffer (ANP servers only; with flow control they never wait)",
                Counter::default(),
            ),
            limits: m.register(
                "konnectivity_rs_agent_limit_reached_total",
                "Times a server stream's outbound queue was past its reserve (the server does not read) and the stream was closed",
                Counter::default(),
            ),
            denied: m.register_family(
                "konnectivity_rs_agent_dials_denied_total",
                "Destination dials refused by the agent's destination policy (--destination-policy-file), by the rule that refused them",
                &["rule"],
                Family::default(),
            ),
            policy_reload_failures: m.register(
                "konnectivity_rs_agent_policy_reload_failures_total",
                "Times the destination policy file changed but could not be used (the last good policy is kept)",
                Counter::default(),
            ),
        }
    }
}

fn name(n: &str) -> String {
    format!("{PREFIX}{n}")
}

/// Registers the three gauges read from `state` when scraped; the endpoint
/// one shows once `endpoint_seen` is set.
fn register_gauges(m: &mut Metrics, state: &Weak<dyn Live>, endpoint_seen: &Arc<AtomicBool>) {
    // A gauge read from the state, shown once `seen` is set.
    let gauge = |read: fn(&dyn Live) -> usize, seen: Option<Arc<AtomicBool>>| {
        let state = state.clone();
        move || {
            if seen.as_ref().is_some_and(|s| !s.load(Ordering::Relaxed)) {
                return None;
            }
            Some(state.upgrade().map_or(0.0, |s| read(&*s) as f64))
        }
    };
    m.probe(
        name("open_server_connections"),
        "Current number of open server connections.",
        MetricType::Gauge,
        // Shown from start-up, at 0 until the first server connection
        // (ANP shows it only from then on; a scrape right after
        // `/healthz` answers would find no such metric).
        gauge(|s| s.server_connections(), None),
    );
    m.probe(
        name("known_server_count"),
        "Current number of servers agent is trying to connect to.",
        MetricType::Gauge,
        gauge(|s| s.target_count(), None),
    );
    m.probe(
        name("open_endpoint_connections"),
        "Current number of open endpoint connections.",
        MetricType::Gauge,
        gauge(|s| s.endpoint_connections(), Some(endpoint_seen.clone())),
    );
}

/// Registers the lease watch's metrics.
fn register_leases(m: &mut Metrics, leases: &LeaseMetrics) {
    m.register_family(
        name("lease_lists_total"),
        "Count of server lease list calls made by the agent to the k8s apiserver, labeled by HTTP response code and reason",
        &["http_response_code", "reason"],
        leases.lists.clone(),
    );
    m.register_family(
        name("lease_watches_total"),
        "Count of server lease watch calls made by the agent to the k8s apiserver, labeled by HTTP response code and reason",
        &["http_response_code", "reason"],
        leases.watches.clone(),
    );
    m.register_family(
        name("lease_list_latency_seconds"),
        "Latency of server lease listing in seconds",
        &["http_response_code"],
        leases.list_latency.clone(),
    );
}

/// Every metric family the agent registers, sorted by name, whether or
/// not it has a series yet: what `docs/metrics.md` lists. The allocator's
/// are among them once the process called `ops::metrics::jemalloc::expose`,
/// as the binary does.
pub fn families() -> Vec<ops::metrics::Descriptor> {
    AgentMetrics::unattached().exposition.describe()
}

impl std::fmt::Debug for AgentMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentMetrics").finish_non_exhaustive()
    }
}

impl AgentMetrics {
    /// The audit log's counters.
    pub(crate) fn audit(&self) -> ops::audit::AuditMetrics {
        self.audit.clone()
    }

    /// Metrics of no agent (its gauges read 0), for a client (one server
    /// connection) used on its own.
    pub fn unattached() -> Self {
        Self::new(
            Weak::<Nothing>::new(),
            &LeaseMetrics::default(),
            &CertMetrics::default(),
            &Counter::default(),
        )
    }

    /// Registers every metric; the gauges read `state` when scraped;
    /// `spans_dropped` is the tracer's count.
    pub(crate) fn new(
        state: Weak<dyn Live>,
        leases: &LeaseMetrics,
        certs: &CertMetrics,
        spans_dropped: &Counter,
    ) -> Self {
        let mut m = Metrics::default();
        let dial_duration = m.register(
            name("dial_duration_seconds"),
            "Latency of dial to the remote endpoint in seconds",
            Observed::new(Histogram::new(AGENT_BUCKETS)),
        );
        let server_failures = ByLabel::register(
            &mut m,
            name("server_connection_failure_count"),
            "Count of failures to send to or receive from the proxy server, labeled by the direction (from_server or to_server). DEPRECATED, please use stream_events_error_total",
            "direction",
        );
        let dial_failures = ByLabel::register(
            &mut m,
            name("endpoint_dial_failure_total"),
            "Number of failures dialing the remote endpoint, by reason (example: timeout).",
            "reason",
        );
        let endpoint_seen = Arc::new(AtomicBool::new(false));
        register_gauges(&mut m, &state, &endpoint_seen);
        register_leases(&mut m, leases);
        let packets = PacketCounters::register(&mut m, PREFIX, &proto::packet::TYPE_NAMES);
        let errors = StreamErrors::register(&mut m, PREFIX);
        ops::metrics::register_process(&mut m);
        let ours = Ours::register(&mut m);
        certs.register(&mut m, "konnectivity_rs_agent_");
        m.register(
            "konnectivity_rs_agent_trace_spans_dropped_total",
            "OpenTelemetry spans (--tracing-config-file) ended and never exported: the export queue was full or the collector did not take them",
            spans_dropped.clone(),
        );
        let audit = ops::audit::AuditMetrics::register(&mut m, "konnectivity_rs_agent_");
        Self {
            audit,
            exposition: Arc::new(m),
            dial_duration,
            endpoint_seen,
            server_failures,
            dial_failures,
            packets,
            errors,
            bytes: ours.bytes,
            closed: ours.closed,
            blocked: ours.blocked,
            limits: ours.limits,
            denied: ours.denied,
            policy_reload_failures: ours.policy_reload_failures,
        }
    }

    /// The exposition text.
    pub(crate) fn render(&self) -> String {
        self.exposition.render()
    }

    /// A destination dial succeeded after `took`.
    pub(crate) fn dial_succeeded(&self, took: Duration) {
        self.dial_duration.get().observe(took.as_secs_f64());
    }

    /// An endpoint connection was registered (ANP sets its gauge from then
    /// on).
    pub(crate) fn endpoint_connection_opened(&self) {
        self.endpoint_seen.store(true, Ordering::Relaxed);
    }

    /// A destination dial failed.
    pub(crate) fn dial_failed(&self, reason: EndpointDialFailure) {
        self.dial_failures.get(reason).inc();
    }

    /// The destination policy refused a dial by `rule`.
    pub(crate) fn dial_denied(&self, rule: &str) {
        self.denied
            .get_or_create(&RuleLabel {
                rule: rule.to_owned(),
            })
            .inc();
    }

    /// The destination policy file changed but could not be used.
    pub(crate) fn policy_reload_failed(&self) {
        self.policy_reload_failures.inc();
    }

    /// Receiving from the server failed.
    pub(crate) fn receive_failed(&self, code: tonic::Code) {
        self.server_failures.get(ServerDirection::FromServer).inc();
        self.errors.receive_error(Segment::ToAgent, code);
    }

    /// A server stream's outbound queue was past its reserve.
    pub(crate) fn limit_reached(&self) {
        self.limits.inc();
    }

    /// `packet` could not be sent to the server: its stream is gone.
    pub(crate) fn send_failed(&self, packet: &proto::Packet) {
        self.server_failures.get(ServerDirection::ToServer).inc();
        if let Some(name) = usize::try_from(packet.r#type)
            .ok()
            .and_then(|t| proto::packet::TYPE_NAMES.get(t))
        {
            self.errors
                .error(Segment::FromAgent, tonic::Code::Unavailable, name);
        }
    }

    pub(crate) fn connection_closed(&self, reason: EndpointCloseReason) {
        self.closed.get(reason).inc();
    }

    /// A stream reader waited `took` for room in a connection's buffer.
    pub(crate) fn blocked(&self, took: Duration) {
        self.blocked.inc_by(took.as_secs_f64());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_packet_the_server_stream_did_not_take_counts_in_both_metrics() {
        let metrics = AgentMetrics::unattached();
        metrics.send_failed(&proto::Packet::dial_response(1, 2, ""));
        let text = metrics.render();
        for series in [
            "konnectivity_network_proxy_agent_server_connection_failure_count{direction=\"to_server\"} 1\n",
            "konnectivity_network_proxy_agent_stream_errors_total{code=\"Unavailable\",packet_type=\"DIAL_RSP\",segment=\"from_agent\"} 1\n",
        ] {
            assert!(text.contains(series), "{series}{text}");
        }
    }

    /// The families whose label names are declared apart from the code
    /// that labels their series (the lease watch's, the certificates')
    /// carry the declared ones.
    #[test]
    fn series_carry_the_labels_described() {
        let leases = LeaseMetrics::default();
        let certs = CertMetrics::default();
        let metrics =
            AgentMetrics::new(Weak::<Nothing>::new(), &leases, &certs, &Counter::default());
        for kind in [CallKind::List, CallKind::Watch] {
            leases.lease_call(&Call {
                kind,
                status: 200,
                took: Duration::from_millis(2),
            });
        }
        let _ = certs.failures("agent-cert");
        metrics.send_failed(&proto::Packet::dial_response(1, 2, ""));
        metrics.dial_failed(EndpointDialFailure::Timeout);
        let text = metrics.render();
        for family in ["lease_watches_total", "lease_list_latency_seconds_bucket"] {
            assert!(text.contains(&name(family)), "{family} missing:\n{text}");
        }
        assert_eq!(metrics.exposition.mismatches(), Vec::<String>::new());
    }

    #[test]
    fn the_server_gauge_shows_from_start_up_and_the_endpoint_gauge_once_set() {
        let metrics = AgentMetrics::unattached();
        let text = metrics.render();
        assert!(text.contains("\nkonnectivity_network_proxy_agent_open_server_connections 0\n"));
        assert!(!text.contains("open_endpoint_connections"), "{text}");
        assert!(text.contains("\nkonnectivity_network_proxy_agent_known_server_count 0\n"));
        metrics.endpoint_connection_opened();
        let text = metrics.render();
        assert!(text.contains("\nkonnectivity_network_proxy_agent_open_endpoint_connections 0\n"));
    }
}
