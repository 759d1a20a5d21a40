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
    metrics::{Counter, Metrics, Observed, StreamCounters},
    tls::files::CertMetrics,
};
use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{MetricType, family::Family, histogram::Histogram},
};

/// Buckets of ANP's agent latency histograms.
const AGENT_BUCKETS: [f64; 7] = [0.005, 0.025, 0.1, 0.5, 2.5, 10.0, 30.0];

const PREFIX: &str = "konnectivity_network_proxy_agent_";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DirectionLabel {
    direction: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResponseLabels {
    http_response_code: String,
    reason: &'static str,
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

/// Why a node-side connection ended (konnectivity-rs).
#[derive(Clone, Copy, Debug)]
pub(crate) enum CloseReason {
    /// The destination closed it.
    EndpointClosed,
    /// Reading or writing the destination failed.
    EndpointError,
    /// The server (its frontend) closed it.
    ServerClosed,
    /// The destination read too slowly: a window behind.
    Overflow,
    /// The destination did not take the last bytes in time after the
    /// server's close.
    DrainTimedOut,
    /// The server stream ended.
    StreamGone,
}

impl CloseReason {
    fn as_str(self) -> &'static str {
        match self {
            Self::EndpointClosed => "endpoint_closed",
            Self::EndpointError => "endpoint_error",
            Self::ServerClosed => "server_closed",
            Self::Overflow => "overflow",
            Self::DrainTimedOut => "drain_timeout",
            Self::StreamGone => "stream_gone",
        }
    }
}

/// Everything the agent records.
pub struct AgentMetrics {
    exposition: Arc<Metrics>,
    dial_duration: Observed<Histogram>,
    /// Whether an endpoint connection was ever opened (shows the gauge).
    endpoint_seen: Arc<AtomicBool>,
    server_failures: Family<DirectionLabel, Counter>,
    dial_failures: Family<ReasonLabel, Counter>,
    streams: StreamCounters,
    tunnel_bytes: Family<DirectionLabel, Counter>,
    closed: Family<ReasonLabel, Counter>,
    blocked: Counter,
    limits: Counter,
}

impl std::fmt::Debug for AgentMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentMetrics").finish_non_exhaustive()
    }
}

impl AgentMetrics {
    /// Metrics of no agent (its gauges read 0), for a client (one server
    /// connection) used on its own.
    pub fn unattached() -> Self {
        Self::new(
            Weak::<Nothing>::new(),
            &LeaseMetrics::default(),
            &CertMetrics::default(),
        )
    }

    /// Registers every metric; the gauges read `state` when scraped.
    pub(crate) fn new(state: Weak<dyn Live>, leases: &LeaseMetrics, certs: &CertMetrics) -> Self {
        let mut m = Metrics::default();
        let name = |n: &str| format!("{PREFIX}{n}");
        let dial_duration = m.register(
            name("dial_duration_seconds"),
            "Latency of dial to the remote endpoint in seconds",
            Observed::new(Histogram::new(AGENT_BUCKETS)),
        );
        let server_failures = m.register(
            name("server_connection_failure_count"),
            "Count of failures to send to or receive from the proxy server, labeled by the direction (from_server or to_server). DEPRECATED, please use stream_events_error_total",
            Family::default(),
        );
        let dial_failures = m.register(
            name("endpoint_dial_failure_total"),
            "Number of failures dialing the remote endpoint, by reason (example: timeout).",
            Family::default(),
        );
        let endpoint_seen = Arc::new(AtomicBool::new(false));
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
        m.register(
            name("lease_lists_total"),
            "Count of server lease list calls made by the agent to the k8s apiserver, labeled by HTTP response code and reason",
            leases.lists.clone(),
        );
        m.register(
            name("lease_watches_total"),
            "Count of server lease watch calls made by the agent to the k8s apiserver, labeled by HTTP response code and reason",
            leases.watches.clone(),
        );
        m.register(
            name("lease_list_latency_seconds"),
            "Latency of server lease listing in seconds",
            leases.list_latency.clone(),
        );
        let streams = StreamCounters::register(&mut m, PREFIX);
        ops::metrics::register_process(&mut m);
        let tunnel_bytes = m.register(
            "konnectivity_rs_agent_tunnel_bytes_total",
            "Payload bytes carried through the tunnel, by direction (to_endpoint: towards destinations; to_server: back)",
            Family::default(),
        );
        let closed = m.register(
            "konnectivity_rs_agent_connections_closed_total",
            "Node-side connections that ended, by reason (endpoint_closed, endpoint_error, server_closed, overflow, drain_timeout, stream_gone)",
            Family::default(),
        );
        let blocked = m.register(
            "konnectivity_rs_agent_blocked_seconds_total",
            "Seconds server stream readers spent waiting for room in a full per-connection buffer (ANP servers only; with flow control they never wait)",
            Counter::default(),
        );
        let limits = m.register(
            "konnectivity_rs_agent_limit_reached_total",
            "Times a server stream's outbound queue was past its reserve (the server does not read) and the stream was closed",
            Counter::default(),
        );
        certs.register(&mut m, "konnectivity_rs_agent_");
        Self {
            exposition: Arc::new(m),
            dial_duration,
            endpoint_seen,
            server_failures,
            dial_failures,
            streams,
            tunnel_bytes,
            closed,
            blocked,
            limits,
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

    /// A destination dial failed with `error` (Go-style text).
    pub(crate) fn dial_failed(&self, error: &str) {
        let reason = if error.contains("i/o timeout") || error.contains("timed out") {
            "timeout"
        } else {
            "unknown"
        };
        self.dial_failures
            .get_or_create(&ReasonLabel { reason })
            .inc();
    }

    /// A packet of ANP's types to (`to_agent`) or from (`from_agent`) the
    /// server.
    pub(crate) fn packet(&self, segment: &'static str, packet: &proto::Packet) {
        self.streams.packet(segment, packet);
    }

    /// Receiving from the server failed.
    pub(crate) fn receive_failed(&self, code: tonic::Code) {
        self.server_failures
            .get_or_create(&DirectionLabel {
                direction: "from_server",
            })
            .inc();
        self.streams.receive_error("to_agent", code);
    }

    /// A server stream's outbound queue was past its reserve.
    pub(crate) fn limit_reached(&self) {
        self.limits.inc();
    }

    /// `packet` could not be sent to the server: its stream is gone.
    pub(crate) fn send_failed(&self, packet: &proto::Packet) {
        self.server_failures
            .get_or_create(&DirectionLabel {
                direction: "to_server",
            })
            .inc();
        self.streams
            .send_error("from_agent", tonic::Code::Unavailable, packet);
    }

    pub(crate) fn bytes(&self, direction: &'static str, len: usize) {
        self.tunnel_bytes
            .get_or_create(&DirectionLabel { direction })
            .inc_by(len as f64);
    }

    pub(crate) fn connection_closed(&self, reason: CloseReason) {
        self.closed
            .get_or_create(&ReasonLabel {
                reason: reason.as_str(),
            })
            .inc();
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
