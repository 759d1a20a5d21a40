//! Prometheus metrics of the server: ANP's set (names, types, labels, HELP
//! and buckets as `konnectivity_network_proxy_server_*`), process metrics,
//! and konnectivity-rs additions under `konnectivity_rs_server_*`.
//!
//! Gauges of live state (pending dials, established connections, ready
//! backends, buffered bytes) are read from the control core when scraped
//! ([`Live`]); the rest is recorded where it happens. A labelled series
//! appears once it has been observed, except `ready_backends`, which ANP
//! presets to 0 for every strategy; so do the metrics ANP keeps in
//! label-less vectors (dial, write and connection latencies, pending dials,
//! established connections), which stay out of the exposition until first
//! touched.
//!
//! What the bytes' path records (packets, bytes, write latency, blocked
//! time) takes no lock once a series exists: its fields are used directly
//! ([`ops::metrics::PacketCounters`], [`ops::metrics::ByLabel`],
//! [`ops::metrics::Histogram`]).

use std::{sync::Arc, time::Duration};

use ops::metrics::{
    ByLabel, Counter, DEFAULT_BUCKETS, Histogram, Metrics, Observed, PacketCounters, StreamErrors,
};
use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{family::Family, gauge::Gauge},
};

use crate::{
    auth::{Checked, Skipped, reviews::Source as Review},
    events::{CloseReason, DialFailure, DialRetry, Limit},
    strategy::ProxyStrategy,
};

/// Buckets of ANP's server latency histograms.
const SERVER_BUCKETS: [f64; 9] = [1e-6, 1e-5, 1e-4, 0.005, 0.025, 0.1, 0.5, 2.5, 12.5];
/// Buckets of `connection_duration_seconds`.
const CONNECTION_BUCKETS: [f64; 12] = [
    1.0, 5.0, 15.0, 30.0, 60.0, 300.0, 900.0, 1800.0, 3600.0, 14400.0, 43200.0, 86400.0,
];

const PREFIX: &str = "konnectivity_network_proxy_server_";

ops::label_enum! {
    /// Which stream a packet crossed, and which way (`segment`).
    pub(crate) enum Segment {
        /// From a frontend.
        FromClient = "from_client",
        /// To a frontend.
        ToClient = "to_client",
        /// From an agent.
        FromAgent = "from_agent",
        /// To an agent.
        ToAgent = "to_agent",
    }
}

ops::label_enum! {
    /// Which half of the buffer budget (`pool`; `--buffer-budget-bytes`).
    pub(crate) enum Pool {
        /// What frontends' streams read ahead of their waiting uploads.
        ReadAhead = "read_ahead",
        /// Agents' DATA queued for frontends.
        ToFrontend = "to_frontend",
    }
}

ops::label_enum! {
    /// How an agent's TLS handshake went (`kind`).
    pub(crate) enum Handshake {
        /// A full handshake: the server signed with its key.
        Full = "full",
        /// A session resumed from a ticket: no signature.
        Resumed = "resumed",
    }
}

ops::label_enum! {
    /// Why a pending TLS connection ended without a finished handshake
    /// (`reason`; [`edge::admission::Dropped`]).
    pub(crate) enum HandshakeDrop {
        /// At the cap: no ClientHello after a second of silence.
        NoHello = "no_hello",
        /// At the cap: started, its peer silent for five seconds.
        Stalled = "stalled",
        /// No ClientHello within 10 s of its accept.
        HelloTimeout = "hello_timeout",
        /// Not done within 30 s of its start.
        Timeout = "timeout",
        /// No ClientHello came: not TLS, or the peer closed first.
        BadHello = "bad_hello",
        /// The peer hung up while its handshake waited for its turn.
        PeerGone = "peer_gone",
        /// Started, it failed (a TLS error, or the peer hung up).
        Failed = "failed",
    }
}

impl From<edge::admission::Dropped> for HandshakeDrop {
    fn from(reason: edge::admission::Dropped) -> Self {
        use edge::admission::Dropped;
        match reason {
            Dropped::NoHello => Self::NoHello,
            Dropped::Stalled => Self::Stalled,
            Dropped::HelloTimeout => Self::HelloTimeout,
            Dropped::Timeout => Self::Timeout,
            Dropped::BadHello => Self::BadHello,
            Dropped::PeerGone => Self::PeerGone,
            Dropped::Failed => Self::Failed,
        }
    }
}

ops::label_enum! {
    /// The gRPC method of a stream (`service_method`).
    pub(crate) enum Method {
        /// A frontend's `ProxyService/Proxy`.
        Proxy = "Proxy",
        /// An agent's `AgentService/Connect`.
        Connect = "Connect",
    }
}

ops::label_enum! {
    /// Which way tunnel bytes went (`direction`).
    pub(crate) enum Direction {
        /// From frontends towards destinations.
        ToAgent = "to_agent",
        /// Back.
        ToFrontend = "to_frontend",
    }
}

impl prometheus_client::encoding::EncodeLabelValue for ProxyStrategy {
    fn encode(
        &self,
        encoder: &mut prometheus_client::encoding::LabelValueEncoder<'_>,
    ) -> std::fmt::Result {
        std::fmt::Write::write_str(encoder, self.as_str())
    }
}

impl ops::metrics::LabelEnum for ProxyStrategy {
    const COUNT: usize = 3;
    const ALL: &'static [Self] = &[Self::Default, Self::DestHost, Self::DefaultRoute];
    fn index(self) -> usize {
        self as usize
    }
    fn text(self) -> &'static str {
        self.as_str()
    }
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
    /// The read-ahead half of the buffer budget: what is held, its limit.
    pub(crate) read_ahead: (usize, usize),
    /// The half for agents' DATA: what is held, its limit.
    pub(crate) to_frontend: (usize, usize),
}

/// The lease garbage collection's calls.
struct LeaseCalls {
    culled: Counter,
    delete_latency: HistogramFamily<StatusLabel>,
    delete_total: Family<StatusReasonLabels, Counter>,
    list_latency: HistogramFamily<StatusLabel>,
    list_total: Family<StatusReasonLabels, Counter>,
}

/// Everything the server records.
pub(crate) struct ServerMetrics {
    exposition: Arc<Metrics>,
    dial_duration: Observed<Histogram>,
    /// ANP's `frontend_write_duration_seconds`: each packet queued for a
    /// frontend.
    pub(crate) frontend_write: Observed<Histogram>,
    connection_duration: Observed<Histogram>,
    grpc_connections: ByLabel<Method, Gauge>,
    http_connections: Gauge,
    ready_backend_connections: Gauge,
    ready_backends: ByLabel<ProxyStrategy, Gauge>,
    pending_dials: Observed<Gauge>,
    established: Observed<Gauge>,
    full_receive_channels: ByLabel<Method, Gauge>,
    /// ANP #896's HTTP-CONNECT write-queue gauges (see [`Self::write_blocked`]).
    write_queues: WriteQueues,
    dial_failures: ByLabel<DialFailure, Counter>,
    /// ANP's `stream_packets_total`.
    pub(crate) packets: PacketCounters<Segment>,
    errors: StreamErrors<Segment>,
    lease: LeaseCalls,
    /// `konnectivity_rs_server_tunnel_bytes_total`.
    pub(crate) bytes: ByLabel<Direction, Counter>,
    closed: ByLabel<CloseReason, Counter>,
    blocked: ByLabel<Method, Counter>,
    max_buffered: Gauge,
    buffered: Gauge,
    budget: ByLabel<Pool, Gauge>,
    budget_held: ByLabel<Pool, Gauge>,
    limits: ByLabel<Limit, Counter>,
    handshakes: ByLabel<Handshake, Counter>,
    handshake_drops: ByLabel<HandshakeDrop, Counter>,
    reviews: ByLabel<Review, Counter>,
    skipped: ByLabel<Skipped, Counter>,
    retries: ByLabel<DialRetry, Counter>,
    hedges: Counter,
    hedges_won: Counter,
    /// `konnectivity_rs_server_trace_spans_dropped_total`, counted by the
    /// tracer.
    spans_dropped: Counter,
    certs: ops::tls::files::CertMetrics,
    /// The audit log's (`konnectivity_rs_server_audit_*`).
    audit: ops::audit::AuditMetrics,
}

fn name(n: &str) -> String {
    format!("{PREFIX}{n}")
}

impl LeaseCalls {
    fn register(m: &mut Metrics) -> Self {
        Self {
            culled: m.register(
                name("culled_leases_count"),
                "Count of expired leases that the lease garbage collection controller has culled.",
                Counter::default(),
            ),
            delete_latency: m.register_family(
                name("lease_delete_latency_seconds"),
                "Latency of lease deletion calls by the garbage collection controller in seconds.",
                &["http_status_code"],
                HistogramFamily::new_with_constructor(default_histogram as fn() -> Histogram),
            ),
            delete_total: m.register_family(
                name("lease_delete_total"),
                "Count of lease delection calls by the garbage collection controller. Labeled by HTTP status code and reason.",
                &["http_status_code", "reason"],
                Family::default(),
            ),
            list_latency: m.register_family(
                name("lease_list_latency_seconds"),
                "Latency of lease list calls by the garbage collection controller in seconds.",
                &["http_status_code"],
                HistogramFamily::new_with_constructor(default_histogram as fn() -> Histogram),
            ),
            list_total: m.register_family(
                name("lease_list_total"),
                "Count of lease deletion calls by the garbage collection controller. Labeled by HTTP status code and reason.",
                &["http_status_code", "reason"],
                Family::default(),
            ),
        }
    }
}

/// ANP #896's gauges of its per-connection HTTP-CONNECT write queues, shown
/// once first used as ANP's label-less vectors are. Our queue is the
/// connection's buffer, bounded by its flow window: an agent with flow
/// control stops at the window, so only an agent without it (ANP's) makes
/// the stream's reader wait on a full one.
struct WriteQueues {
    full: Observed<Gauge>,
    blocked: Observed<Gauge>,
}

impl WriteQueues {
    fn register(m: &mut Metrics) -> Self {
        Self {
            full: m.register(
                name("full_frontend_write_queues"),
                "Number of per-connection HTTP CONNECT frontend write queues currently at capacity. Here: HTTP CONNECT connections whose buffer (bounded by its flow window) is full while an agent stream's reader waits for room in it; 0 with agents that negotiate flow control, which stop at the window instead.",
                Observed::new(Gauge::default()),
            ),
            blocked: m.register(
                name("blocked_frontend_write_channels"),
                "Number of backend receive loops currently blocked enqueueing to a full HTTP CONNECT frontend write channel. Here: agent stream readers waiting for room in a full HTTP CONNECT connection's buffer; 0 with agents that negotiate flow control. --frontend-write-channel-size does not change it.",
                Observed::new(Gauge::default()),
            ),
        }
    }
}

/// ANP's latency histograms and stream gauges, in ANP's registration order.
struct Latencies {
    dial_duration: Observed<Histogram>,
    frontend_write: Observed<Histogram>,
    connection_duration: Observed<Histogram>,
    grpc_connections: ByLabel<Method, Gauge>,
    http_connections: Gauge,
    ready_backend_connections: Gauge,
    ready_backends: ByLabel<ProxyStrategy, Gauge>,
}

impl Latencies {
    fn register(m: &mut Metrics) -> Self {
        Self {
            dial_duration: m.register(
                name("dial_duration_seconds"),
                "Latency of dial to the remote endpoint in seconds",
                Observed::new(Histogram::new(SERVER_BUCKETS)),
            ),
            frontend_write: m.register(
                name("frontend_write_duration_seconds"),
                "Latency of write to the frontend in seconds",
                Observed::new(Histogram::new(SERVER_BUCKETS)),
            ),
            connection_duration: m.register(
                name("connection_duration_seconds"),
                "Duration in seconds a proxied end-to-end connection was established (post-dial) before being closed.",
                Observed::new(Histogram::new(CONNECTION_BUCKETS)),
            ),
            grpc_connections: ByLabel::register(
                m,
                name("grpc_connections"),
                "Number of current grpc connections, partitioned by service method.",
                "service_method",
            ),
            http_connections: m.register(
                name("http_connections"),
                "Number of current HTTP CONNECT connections",
                Gauge::default(),
            ),
            ready_backend_connections: m.register(
                name("ready_backend_connections"),
                "Number of konnectivity agent connected to the proxy server. DEPRECATED, please use ready_backends",
                Gauge::default(),
            ),
            ready_backends: ByLabel::register(
                m,
                name("ready_backends"),
                "Number of konnectivity agent connected to the proxy server",
                "proxy_strategy",
            ),
        }
    }
}

/// konnectivity-rs's own series, registered a group at a time.
struct Ours {
    traffic: Traffic,
    buffers: Buffers,
    admission: Admission,
    dials: Dials,
}

impl Ours {
    fn register(m: &mut Metrics) -> Self {
        Self {
            traffic: Traffic::register(m),
            buffers: Buffers::register(m),
            admission: Admission::register(m),
            dials: Dials::register(m),
        }
    }
}

/// Our series of the tunnel's traffic: payload bytes, connections ended.
struct Traffic {
    bytes: ByLabel<Direction, Counter>,
    closed: ByLabel<CloseReason, Counter>,
}

impl Traffic {
    fn register(m: &mut Metrics) -> Self {
        Self {
            bytes: ByLabel::register(
                m,
                "konnectivity_rs_server_tunnel_bytes_total",
                "Payload bytes carried through the tunnel, by direction (to_agent: from frontends towards destinations; to_frontend: back)",
                "direction",
            ),
            closed: ByLabel::register(
                m,
                "konnectivity_rs_server_connections_closed_total",
                "Established connections that ended, by reason (closed, error, agent_gone, frontend_gone, overflow, stalled, mismatch, upload_stalled)",
                "reason",
            ),
        }
    }
}

/// Our series of buffering: readers blocked on a full buffer, bytes queued
/// towards frontends, the buffer budget and what is held of it.
struct Buffers {
    blocked: ByLabel<Method, Counter>,
    max_buffered: Gauge,
    buffered: Gauge,
    budget: ByLabel<Pool, Gauge>,
    budget_held: ByLabel<Pool, Gauge>,
}

impl Buffers {
    fn register(m: &mut Metrics) -> Self {
        Self {
            blocked: ByLabel::register(
                m,
                "konnectivity_rs_server_blocked_seconds_total",
                "Seconds stream readers spent waiting for room in a full per-connection buffer or agent queue, by service method",
                "service_method",
            ),
            max_buffered: m.register(
                "konnectivity_rs_server_max_buffered_bytes",
                "Bytes the fullest connection has queued towards its frontend (bounded by the flow window)",
                Gauge::default(),
            ),
            buffered: m.register(
                "konnectivity_rs_server_buffered_bytes",
                "Bytes queued towards frontends over all connections",
                Gauge::default(),
            ),
            budget: ByLabel::register(
                m,
                "konnectivity_rs_server_buffer_budget_bytes",
                "Bytes of the buffer budget, by pool (read_ahead: what frontends' streams read ahead of their waiting uploads; to_frontend: agents' DATA queued for frontends), half of --buffer-budget-bytes each",
                "pool",
            ),
            budget_held: ByLabel::register(
                m,
                "konnectivity_rs_server_buffer_budget_held_bytes",
                "Bytes of the buffer budget held now, by pool (read_ahead, to_frontend; what is held, with a fixed overhead per queued item)",
                "pool",
            ),
        }
    }
}

/// Our series of admission: limits reached, TLS handshakes done and
/// dropped, token reviews made and skipped.
struct Admission {
    limits: ByLabel<Limit, Counter>,
    handshakes: ByLabel<Handshake, Counter>,
    handshake_drops: ByLabel<HandshakeDrop, Counter>,
    reviews: ByLabel<Review, Counter>,
    skipped: ByLabel<Skipped, Counter>,
}

impl Admission {
    fn register(m: &mut Metrics) -> Self {
        Self {
            limits: ByLabel::register(
                m,
                "konnectivity_rs_server_limit_reached_total",
                "Times an admission limit was reached, by limit (agent_queue, frontend_queue: a stream whose peer stopped reading was ended; tls_handshakes: a pending handshake whose peer stalled was dropped to make room; http_connections: a frontend connection was refused, over --max-http-connections; token_reviews: an agent was refused Unavailable, too many connects waiting for a token review or none started in time; buffer_budget: a stream waited for room in the buffer budget)",
                "limit",
            ),
            handshakes: ByLabel::register(
                m,
                "konnectivity_rs_server_agent_tls_handshakes_total",
                "TLS handshakes completed on the agent listener, by kind (full: the server signed with its key; resumed: from a session ticket, no signature)",
                "kind",
            ),
            handshake_drops: ByLabel::register(
                m,
                "konnectivity_rs_server_tls_handshakes_dropped_total",
                "Connections to a TLS listener (agents, TCP frontend) that ended without a finished handshake, by reason (no_hello, stalled: a silent peer dropped at --max-tls-handshakes to make room; hello_timeout: no ClientHello within 10 s; bad_hello: no ClientHello came; peer_gone: the peer hung up while its handshake waited for its turn; timeout: not done within 30 s of its start; failed: a TLS error after its start; stalled, timeout and failed cost the server a signature)",
                "reason",
            ),
            reviews: ByLabel::register(
                m,
                "konnectivity_rs_server_token_reviews_total",
                "Agent tokens checked, by what answered (api: a TokenReview call; coalesced: the answer to a call already in flight for the same token; cache: a cached review)",
                "source",
            ),
            skipped: ByLabel::register(
                m,
                "konnectivity_rs_server_token_reviews_skipped_total",
                "Agent connects refused without a TokenReview, by reason (malformed: the token is not a JWT; audience: its aud claim does not name --authentication-audience; expired: its exp is past; not_yet_valid: its nbf is ahead; signature: its signature does not verify under the cluster's service-account key its header names; peer_slowed: the connect's source address had its share of connects waiting for a review while its tokens kept failing review)",
                "reason",
            ),
        }
    }
}

/// Our series of dials sent to another agent: retries, hedges, hedges won.
struct Dials {
    retries: ByLabel<DialRetry, Counter>,
    hedges: Counter,
    hedges_won: Counter,
}

impl Dials {
    fn register(m: &mut Metrics) -> Self {
        Self {
            retries: ByLabel::register(
                m,
                "konnectivity_rs_server_dial_retries_total",
                "Dials sent again to another agent before any DIAL_RSP established them (--backend-dial-retries), by reason (agent_gone: the agent's stream ended; not_forwarded: it closed before the DIAL_REQ went out; refused: the agent answered connection refused, no route to host or network unreachable)",
                "reason",
            ),
            hedges: m.register(
                "konnectivity_rs_server_dial_hedges_total",
                "Dials sent to a second agent because the first had not answered within the hedge delay (--backend-dial-hedge)",
                Counter::default(),
            ),
            hedges_won: m.register(
                "konnectivity_rs_server_dial_hedges_won_total",
                "Hedged dials the second agent established first (the first agent's attempt was cancelled)",
                Counter::default(),
            ),
        }
    }
}

impl ServerMetrics {
    /// Registers every metric; `strategies` get their `ready_backends` 0.
    pub(crate) fn new(strategies: &[ProxyStrategy]) -> Self {
        let mut m = Metrics::default();
        let latencies = Latencies::register(&mut m);
        for strategy in strategies {
            let _ = latencies.ready_backends.get(*strategy);
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
        let full_receive_channels = ByLabel::register(
            &mut m,
            name("full_receive_channels"),
            "Number of current connections blocked by a full receive channel, partitioned by service method.",
            "service_method",
        );
        let write_queues = WriteQueues::register(&mut m);
        let dial_failures = ByLabel::register(
            &mut m,
            name("dial_failure_count"),
            "Number of dial failures observed. Multiple failures can occur for a single dial request.",
            "reason",
        );
        let packets = PacketCounters::register(&mut m, PREFIX, &proto::packet::TYPE_NAMES);
        let errors = StreamErrors::register(&mut m, PREFIX);
        let lease = LeaseCalls::register(&mut m);
        ops::metrics::register_process(&mut m);
        let ours = Ours::register(&mut m);
        let certs = ops::tls::files::CertMetrics::default();
        certs.register(&mut m, "konnectivity_rs_server_");
        let spans_dropped = m.register(
            "konnectivity_rs_server_trace_spans_dropped_total",
            "OpenTelemetry spans (--tracing-config-file) ended and never exported: the export queue was full or the collector did not take them",
            Counter::default(),
        );
        let audit = ops::audit::AuditMetrics::register(&mut m, "konnectivity_rs_server_");
        Self {
            exposition: Arc::new(m),
            certs,
            audit,
            dial_duration: latencies.dial_duration,
            frontend_write: latencies.frontend_write,
            connection_duration: latencies.connection_duration,
            grpc_connections: latencies.grpc_connections,
            http_connections: latencies.http_connections,
            ready_backend_connections: latencies.ready_backend_connections,
            ready_backends: latencies.ready_backends,
            pending_dials,
            established,
            full_receive_channels,
            write_queues,
            dial_failures,
            packets,
            errors,
            lease,
            bytes: ours.traffic.bytes,
            closed: ours.traffic.closed,
            blocked: ours.buffers.blocked,
            max_buffered: ours.buffers.max_buffered,
            buffered: ours.buffers.buffered,
            budget: ours.buffers.budget,
            budget_held: ours.buffers.budget_held,
            limits: ours.admission.limits,
            handshakes: ours.admission.handshakes,
            retries: ours.dials.retries,
            hedges: ours.dials.hedges,
            hedges_won: ours.dials.hedges_won,
            spans_dropped,
            handshake_drops: ours.admission.handshake_drops,
            reviews: ours.admission.reviews,
            skipped: ours.admission.skipped,
        }
    }

    /// The counter of trace spans never exported, for the tracer.
    pub(crate) fn trace_spans_dropped(&self) -> Counter {
        self.spans_dropped.clone()
    }

    /// The certificate expiry gauges and reload-failure counters.
    pub(crate) fn certs(&self) -> ops::tls::files::CertMetrics {
        self.certs.clone()
    }

    /// The audit log's counters.
    pub(crate) fn audit(&self) -> ops::audit::AuditMetrics {
        self.audit.clone()
    }

    /// An admission limit was reached.
    pub(crate) fn limit_reached(&self, limit: Limit) {
        self.limits.get(limit).inc();
    }

    /// An agent's TLS handshake completed.
    pub(crate) fn handshake(&self, kind: Handshake) {
        self.handshakes.get(kind).inc();
    }

    /// A pending TLS connection ended without a finished handshake; at
    /// `--max-tls-handshakes`, that limit was reached.
    pub(crate) fn handshake_dropped(&self, reason: edge::admission::Dropped) {
        self.handshake_drops.get(reason.into()).inc();
        if reason.at_cap() {
            self.limit_reached(Limit::TlsHandshakes);
        }
    }

    /// An agent's token was checked.
    pub(crate) fn checked(&self, checked: Checked) {
        match checked {
            Checked::Answered(source) => self.reviews.get(source).inc(),
            Checked::Load => self.limit_reached(Limit::TokenReviews),
            Checked::Skipped(reason) => self.skipped.get(reason).inc(),
        }
    }

    /// The exposition text, with the live-state gauges set from `live`.
    pub(crate) fn render(&self, live: &Live) -> String {
        for (strategy, count) in &live.ready {
            self.ready_backends.get(*strategy).set(as_i64(*count));
        }
        // ANP: every manager writes it, the last one wins.
        if let Some((_, count)) = live.ready.last() {
            self.ready_backend_connections.set(as_i64(*count));
        }
        self.pending_dials.peek().set(as_i64(live.pending));
        self.established.peek().set(as_i64(live.established));
        self.max_buffered.set(as_i64(live.max_buffered));
        self.buffered.set(as_i64(live.buffered));
        for (pool, (held, limit)) in [
            (Pool::ReadAhead, live.read_ahead),
            (Pool::ToFrontend, live.to_frontend),
        ] {
            self.budget.get(pool).set(as_i64(limit));
            self.budget_held.get(pool).set(as_i64(held));
        }
        self.exposition.render()
    }

    /// The exposition without refreshing the live-state gauges.
    #[cfg(test)]
    pub(crate) fn text(&self) -> String {
        self.exposition.render()
    }

    pub(crate) fn dial_failed(&self, reason: DialFailure) {
        self.dial_failures.get(reason).inc();
    }

    pub(crate) fn dial_succeeded(&self, latency: Duration) {
        self.dial_duration.get().observe(latency.as_secs_f64());
    }

    /// A dial went to another agent.
    pub(crate) fn dial_retried(&self, reason: DialRetry) {
        self.retries.get(reason).inc();
    }

    /// A dial went to a second agent (hedging).
    pub(crate) fn dial_hedged(&self) {
        self.hedges.inc();
    }

    /// A hedged dial was won by its second agent.
    pub(crate) fn hedge_won(&self) {
        self.hedges_won.inc();
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
        self.closed.get(reason).inc();
    }

    /// A stream failed on receive.
    pub(crate) fn stream_error(&self, segment: Segment, code: tonic::Code) {
        self.errors.receive_error(segment, code);
    }

    /// A packet of type `packet_type` could not be sent on `segment`: its
    /// stream is gone.
    pub(crate) fn send_error(&self, segment: Segment, packet_type: i32) {
        if let Some(name) = usize::try_from(packet_type)
            .ok()
            .and_then(|t| proto::packet::TYPE_NAMES.get(t))
        {
            self.errors.error(segment, tonic::Code::Unavailable, name);
        }
    }

    /// A gRPC stream of `method` started; the gauge drops with the guard.
    pub(crate) fn grpc_stream(&self, method: Method) -> GaugeGuard {
        GaugeGuard::new(self.grpc_connections.get(method).clone())
    }

    /// An HTTP CONNECT connection started; the gauge drops with the guard.
    pub(crate) fn http_connection(&self) -> GaugeGuard {
        GaugeGuard::new(self.http_connections.clone())
    }

    /// A reader of `method` found its way blocked; the returned guard
    /// counts it in `full_receive_channels` and adds the wait to the
    /// blocked time when dropped.
    pub(crate) fn blocked(&self, method: Method) -> BlockedGuard {
        BlockedGuard {
            gauge: GaugeGuard::new(self.full_receive_channels.get(method).clone()),
            seconds: self.blocked.get(method).clone(),
            since: std::time::Instant::now(),
        }
    }

    /// An agent stream's reader waits for room in an HTTP-CONNECT
    /// connection's full buffer (an agent without flow control); the
    /// returned guard counts that buffer in `full_frontend_write_queues`
    /// and the reader in `blocked_frontend_write_channels` until dropped.
    pub(crate) fn write_blocked(&self) -> (GaugeGuard, GaugeGuard) {
        (
            GaugeGuard::new(self.write_queues.full.get().clone()),
            GaugeGuard::new(self.write_queues.blocked.get().clone()),
        )
    }

    pub(crate) fn lease_culled(&self) {
        self.lease.culled.inc();
    }

    /// A lease list (`delete = false`) or delete call of the garbage
    /// collection answered `status` (0: no answer) with `reason`.
    pub(crate) fn lease_call(&self, delete: bool, status: u16, reason: &str, took: Duration) {
        let (latency, total) = if delete {
            (&self.lease.delete_latency, &self.lease.delete_total)
        } else {
            (&self.lease.list_latency, &self.lease.list_total)
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

/// Every metric family the server registers, sorted by name, whether or
/// not it has a series yet: what `docs/metrics.md` lists. The allocator's
/// are among them once the process called `ops::metrics::jemalloc::expose`,
/// as the binary does.
pub fn families() -> Vec<ops::metrics::Descriptor> {
    ServerMetrics::new(&[]).exposition.describe()
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The families whose label names are declared apart from the code
    /// that labels their series (the lease garbage collection's, the
    /// certificates') carry the declared ones.
    #[test]
    fn series_carry_the_labels_described() {
        let metrics = ServerMetrics::new(&[ProxyStrategy::Default]);
        metrics.lease_call(false, 200, "OK", Duration::from_millis(3));
        metrics.lease_call(true, 404, "NotFound", Duration::from_millis(2));
        let _ = metrics.certs().failures("cluster-cert");
        metrics.packets.count(Segment::FromClient, 1);
        metrics.stream_error(Segment::ToAgent, tonic::Code::Unavailable);
        metrics.dial_failed(DialFailure::NoAgent);
        let text = metrics.text();
        for family in ["lease_list_total", "lease_delete_latency_seconds_bucket"] {
            assert!(text.contains(&name(family)), "{family} missing:\n{text}");
        }
        assert_eq!(metrics.exposition.mismatches(), Vec::<String>::new());
    }
}
