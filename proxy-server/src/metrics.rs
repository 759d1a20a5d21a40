//! Prometheus metrics of the server: ANP's set (names, types, labels, HELP
//! and buckets as `konnectivity_network_proxy_server_*`), process metrics,
//! and konnectivity-rs additions under `konnectivity_rs_server_*`.
//!
//! Gauges of live state (pending dials, established connections, ready
//! backends, buffered bytes) are read from the hub when scraped ([`Live`]); the
//! rest is recorded where it happens. A labelled series appears once it
//! has been observed, except `ready_backends`, which ANP presets to 0 for
//! every strategy; so do the metrics ANP keeps in label-less vectors (dial,
//! write and connection latencies, pending dials, established connections),
//! which stay out of the exposition until first touched.

use std::{sync::Arc, time::Duration};

use ops::metrics::{Counter, DEFAULT_BUCKETS, Metrics, Observed, StreamCounters};
use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{family::Family, gauge::Gauge, histogram::Histogram},
};

use crate::{
    events::{CloseReason, DialFailure, Limit},
    strategy::ProxyStrategy,
};

/// Buckets of ANP's server latency histograms.
const SERVER_BUCKETS: [f64; 9] = [1e-6, 1e-5, 1e-4, 0.005, 0.025, 0.1, 0.5, 2.5, 12.5];
/// Buckets of `connection_duration_seconds`.
const CONNECTION_BUCKETS: [f64; 12] = [
    1.0, 5.0, 15.0, 30.0, 60.0, 300.0, 900.0, 1800.0, 3600.0, 14400.0, 43200.0, 86400.0,
];

const PREFIX: &str = "konnectivity_network_proxy_server_";

/// `service_method`: `Proxy` (frontends) or `Connect` (agents).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct MethodLabel {
    pub(crate) service_method: &'static str,
}

/// The `Proxy` method label.
pub(crate) const PROXY: MethodLabel = MethodLabel {
    service_method: "Proxy",
};
/// The `Connect` method label.
pub(crate) const CONNECT: MethodLabel = MethodLabel {
    service_method: "Connect",
};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StrategyLabel {
    proxy_strategy: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StatusLabel {
    http_status_code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StatusReasonLabels {
    http_status_code: String,
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DirectionLabel {
    direction: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LimitLabel {
    limit: &'static str,
}

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

fn default_histogram() -> Histogram {
    Histogram::new(DEFAULT_BUCKETS)
}

/// The live state the gauges show, read when scraped.
#[derive(Debug, Default)]
pub(crate) struct Live {
    /// Distinct agent keys per strategy (`ready_backends`).
    pub(crate) ready: Vec<(ProxyStrategy, usize)>,
    /// Dials waiting for a DIAL_RSP.
    pub(crate) pending: usize,
    /// Established connections.
    pub(crate) established: usize,
    /// Bytes queued towards frontends, most for one connection.
    pub(crate) max_buffered: usize,
    /// Bytes queued towards frontends in all.
    pub(crate) buffered: usize,
}

/// Everything the server records.
pub(crate) struct ServerMetrics {
    exposition: Arc<Metrics>,
    dial_duration: Observed<Histogram>,
    frontend_write_duration: Observed<Histogram>,
    connection_duration: Observed<Histogram>,
    grpc_connections: Family<MethodLabel, Gauge>,
    http_connections: Gauge,
    ready_backend_connections: Gauge,
    ready_backends: Family<StrategyLabel, Gauge>,
    pending_dials: Observed<Gauge>,
    established: Observed<Gauge>,
    full_receive_channels: Family<MethodLabel, Gauge>,
    dial_failures: Family<ReasonLabel, Counter>,
    streams: StreamCounters,
    culled_leases: Counter,
    lease_delete_latency: HistogramFamily<StatusLabel>,
    lease_delete_total: Family<StatusReasonLabels, Counter>,
    lease_list_latency: HistogramFamily<StatusLabel>,
    lease_list_total: Family<StatusReasonLabels, Counter>,
    tunnel_bytes: Family<DirectionLabel, Counter>,
    closed: Family<ReasonLabel, Counter>,
    blocked: Family<MethodLabel, Counter>,
    max_buffered: Gauge,
    buffered: Gauge,
    limits: Family<LimitLabel, Counter>,
    certs: ops::tls::files::CertMetrics,
}

impl ServerMetrics {
    /// Registers every metric; `strategies` get their `ready_backends` 0.
    pub(crate) fn new(strategies: &[ProxyStrategy]) -> Self {
        let mut m = Metrics::default();
        let name = |n: &str| format!("{PREFIX}{n}");
        let dial_duration = m.register(
            name("dial_duration_seconds"),
            "Latency of dial to the remote endpoint in seconds",
            Observed::new(Histogram::new(SERVER_BUCKETS)),
        );
        let frontend_write_duration = m.register(
            name("frontend_write_duration_seconds"),
            "Latency of write to the frontend in seconds",
            Observed::new(Histogram::new(SERVER_BUCKETS)),
        );
        let connection_duration = m.register(
            name("connection_duration_seconds"),
            "Duration in seconds a proxied end-to-end connection was established (post-dial) before being closed.",
            Observed::new(Histogram::new(CONNECTION_BUCKETS)),
        );
        let grpc_connections = m.register(
            name("grpc_connections"),
            "Number of current grpc connections, partitioned by service method.",
            Family::default(),
        );
        let http_connections = m.register(
            name("http_connections"),
            "Number of current HTTP CONNECT connections",
            Gauge::default(),
        );
        let ready_backend_connections = m.register(
            name("ready_backend_connections"),
            "Number of konnectivity agent connected to the proxy server. DEPRECATED, please use ready_backends",
            Gauge::default(),
        );
        let ready_backends: Family<StrategyLabel, Gauge> = m.register(
            name("ready_backends"),
            "Number of konnectivity agent connected to the proxy server",
            Family::default(),
        );
        for strategy in strategies {
            let _ = ready_backends.get_or_create(&StrategyLabel {
                proxy_strategy: strategy.as_str(),
            });
        }
        let pending_dials = m.register(
            name("pending_backend_dials"),
            "Current number of pending backend dial requests",
            Observed::new(Gauge::default()),
        );
        let established = m.register(
            name("established_connections"),
            "Current number of established end-to-end connections (post-dial).",
            Observed::new(Gauge::default()),
        );
        let full_receive_channels = m.register(
            name("full_receive_channels"),
            "Number of current connections blocked by a full receive channel, partitioned by service method.",
            Family::default(),
        );
        let dial_failures = m.register(
            name("dial_failure_count"),
            "Number of dial failures observed. Multiple failures can occur for a single dial request.",
            Family::default(),
        );
        let streams = StreamCounters::register(&mut m, PREFIX);
        let culled_leases = m.register(
            name("culled_leases_count"),
            "Count of expired leases that the lease garbage collection controller has culled.",
            Counter::default(),
        );
        let lease_delete_latency = m.register(
            name("lease_delete_latency_seconds"),
            "Latency of lease deletion calls by the garbage collection controller in seconds.",
            HistogramFamily::new_with_constructor(default_histogram as fn() -> Histogram),
        );
        let lease_delete_total = m.register(
            name("lease_delete_total"),
            "Count of lease delection calls by the garbage collection controller. Labeled by HTTP status code and reason.",
            Family::default(),
        );
        let lease_list_latency = m.register(
            name("lease_list_latency_seconds"),
            "Latency of lease list calls by the garbage collection controller in seconds.",
            HistogramFamily::new_with_constructor(default_histogram as fn() -> Histogram),
        );
        let lease_list_total = m.register(
            name("lease_list_total"),
            "Count of lease deletion calls by the garbage collection controller. Labeled by HTTP status code and reason.",
            Family::default(),
        );
        ops::metrics::register_process(&mut m);
        let tunnel_bytes = m.register(
            "konnectivity_rs_server_tunnel_bytes_total",
            "Payload bytes carried through the tunnel, by direction (to_agent: from frontends towards destinations; to_frontend: back)",
            Family::default(),
        );
        let closed = m.register(
            "konnectivity_rs_server_connections_closed_total",
            "Established connections that ended, by reason (closed, error, agent_gone, frontend_gone, overflow, stalled, mismatch)",
            Family::default(),
        );
        let blocked = m.register(
            "konnectivity_rs_server_blocked_seconds_total",
            "Seconds stream readers spent waiting for room in a full per-connection buffer or agent queue, by service method",
            Family::default(),
        );
        let max_buffered = m.register(
            "konnectivity_rs_server_max_buffered_bytes",
            "Bytes the fullest connection has queued towards its frontend (bounded by the flow window)",
            Gauge::default(),
        );
        let buffered = m.register(
            "konnectivity_rs_server_buffered_bytes",
            "Bytes queued towards frontends over all connections",
            Gauge::default(),
        );
        let limits = m.register(
            "konnectivity_rs_server_limit_reached_total",
            "Times an admission limit was reached, by limit (agent_queue, frontend_queue: a stream whose peer stopped reading was ended; tls_handshakes: a pending handshake whose peer stalled was dropped to make room; http_connections: a CONNECT client was refused)",
            Family::default(),
        );
        let certs = ops::tls::files::CertMetrics::default();
        certs.register(&mut m, "konnectivity_rs_server_");
        Self {
            exposition: Arc::new(m),
            certs,
            dial_duration,
            frontend_write_duration,
            connection_duration,
            grpc_connections,
            http_connections,
            ready_backend_connections,
            ready_backends,
            pending_dials,
            established,
            full_receive_channels,
            dial_failures,
            streams,
            culled_leases,
            lease_delete_latency,
            lease_delete_total,
            lease_list_latency,
            lease_list_total,
            tunnel_bytes,
            closed,
            blocked,
            max_buffered,
            buffered,
            limits,
        }
    }

    /// The certificate expiry gauges and reload-failure counters.
    pub(crate) fn certs(&self) -> ops::tls::files::CertMetrics {
        self.certs.clone()
    }

    /// An admission limit was reached.
    pub(crate) fn limit_reached(&self, limit: Limit) {
        self.limits
            .get_or_create(&LimitLabel {
                limit: limit.as_str(),
            })
            .inc();
    }

    /// The exposition text, with the live-state gauges set from `live`.
    pub(crate) fn render(&self, live: &Live) -> String {
        for (strategy, count) in &live.ready {
            self.ready_backends
                .get_or_create(&StrategyLabel {
                    proxy_strategy: strategy.as_str(),
                })
                .set(as_i64(*count));
        }
        // ANP: every manager writes it, the last one wins.
        if let Some((_, count)) = live.ready.last() {
            self.ready_backend_connections.set(as_i64(*count));
        }
        self.pending_dials.peek().set(as_i64(live.pending));
        self.established.peek().set(as_i64(live.established));
        self.max_buffered.set(as_i64(live.max_buffered));
        self.buffered.set(as_i64(live.buffered));
        self.exposition.render()
    }

    /// The exposition without refreshing the live-state gauges.
    #[cfg(test)]
    pub(crate) fn text(&self) -> String {
        self.exposition.render()
    }

    pub(crate) fn dial_failed(&self, reason: DialFailure) {
        self.dial_failures
            .get_or_create(&ReasonLabel {
                reason: reason.as_str(),
            })
            .inc();
    }

    pub(crate) fn dial_succeeded(&self, latency: Duration) {
        self.dial_duration.get().observe(latency.as_secs_f64());
    }

    pub(crate) fn frontend_write(&self, took: Duration) {
        self.frontend_write_duration
            .get()
            .observe(took.as_secs_f64());
    }

    /// A dial became pending (ANP sets the gauge from then on).
    pub(crate) fn dial_pending(&self) {
        let _ = self.pending_dials.get();
    }

    /// A connection was established (ANP sets the gauge from then on).
    pub(crate) fn connection_established(&self) {
        let _ = self.established.get();
    }

    /// An established connection ended after `lived`.
    pub(crate) fn connection_closed(&self, reason: CloseReason, lived: Duration) {
        self.connection_duration.get().observe(lived.as_secs_f64());
        self.closed
            .get_or_create(&ReasonLabel {
                reason: reason.as_str(),
            })
            .inc();
    }

    /// A packet of ANP's types crossed `segment`.
    pub(crate) fn packet(&self, segment: &'static str, packet: &proto::Packet) {
        self.streams.packet(segment, packet);
    }

    /// A stream failed on receive.
    pub(crate) fn stream_error(&self, segment: &'static str, code: tonic::Code) {
        self.streams.receive_error(segment, code);
    }

    /// `packet` could not be sent on `segment`: its stream is gone.
    pub(crate) fn send_error(&self, segment: &'static str, packet: &proto::Packet) {
        self.streams
            .send_error(segment, tonic::Code::Unavailable, packet);
    }

    /// A gRPC stream of `method` started; the gauge drops with the guard.
    pub(crate) fn grpc_stream(self: &Arc<Self>, method: MethodLabel) -> GaugeGuard {
        GaugeGuard::new(self.grpc_connections.get_or_create(&method).clone())
    }

    /// An HTTP CONNECT connection started; the gauge drops with the guard.
    pub(crate) fn http_connection(&self) -> GaugeGuard {
        GaugeGuard::new(self.http_connections.clone())
    }

    /// A reader of `method` found its way blocked; the returned guard
    /// counts it in `full_receive_channels` and adds the wait to the
    /// blocked time when dropped.
    pub(crate) fn blocked(&self, method: MethodLabel) -> BlockedGuard {
        BlockedGuard {
            gauge: GaugeGuard::new(self.full_receive_channels.get_or_create(&method).clone()),
            seconds: self.blocked.get_or_create(&method).clone(),
            since: std::time::Instant::now(),
        }
    }

    pub(crate) fn bytes(&self, direction: &'static str, len: usize) {
        self.tunnel_bytes
            .get_or_create(&DirectionLabel { direction })
            .inc_by(len as f64);
    }

    pub(crate) fn lease_culled(&self) {
        self.culled_leases.inc();
    }

    /// A lease list (`delete = false`) or delete call of the garbage
    /// collection answered `status` (0: no answer) with `reason`.
    pub(crate) fn lease_call(&self, delete: bool, status: u16, reason: &str, took: Duration) {
        let (latency, total) = if delete {
            (&self.lease_delete_latency, &self.lease_delete_total)
        } else {
            (&self.lease_list_latency, &self.lease_list_total)
        };
        latency
            .get_or_create(&StatusLabel {
                http_status_code: status.to_string(),
            })
            .observe(took.as_secs_f64());
        total
            .get_or_create(&StatusReasonLabels {
                http_status_code: status.to_string(),
                reason: reason.to_owned(),
            })
            .inc();
    }
}

fn as_i64(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// Holds a gauge up by one while alive.
pub(crate) struct GaugeGuard(Gauge);

impl GaugeGuard {
    fn new(gauge: Gauge) -> Self {
        gauge.inc();
        Self(gauge)
    }
}

impl Drop for GaugeGuard {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// See [`ServerMetrics::blocked`].
pub(crate) struct BlockedGuard {
    gauge: GaugeGuard,
    seconds: Counter,
    since: std::time::Instant,
}

impl Drop for BlockedGuard {
    fn drop(&mut self) {
        self.seconds.inc_by(self.since.elapsed().as_secs_f64());
        let _ = &self.gauge;
    }
}
