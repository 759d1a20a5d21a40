//! Prometheus exposition shared by both binaries, in the format ANP's Go
//! client serves (text 0.0.4), built on prometheus-client's metric types.
//!
//! prometheus-client writes OpenMetrics: a counter's samples get a `_total`
//! suffix its `# TYPE` line lacks, `# HELP` gets a trailing period and the
//! text ends with `# EOF`. Dashboards and ANP's tests match ANP's exact
//! names (`..._dial_failure_count`, `..._stream_packets_total`) and HELP
//! strings, so here every metric goes through one [`Collector`] that writes
//! the registered name and HELP verbatim, and [`Counter`] encodes as a
//! counter without a suffix. Families, gauges and histograms are
//! prometheus-client's own; `text` then rewrites the numbers, order and
//! histogram layout the way Go's client writes them.
//!
//! # Layout
//! - `text`: Go's text layout and float formatting.
//! - [`jemalloc`] (feature `jemalloc`): the allocator's figures, which a
//!   binary allocating with jemalloc turns on.

#[cfg(feature = "jemalloc")]
pub mod jemalloc;
mod text;

use std::{
    borrow::Cow,
    collections::BTreeMap,
    fmt,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
};

use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric, MetricEncoder},
    metrics::{MetricType, TypedMetric},
    registry::Registry,
};

/// `Content-Type` of the exposition (what Go's promhttp serves by default).
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// A monotonic counter, integer or fractional, exposed under exactly the
/// registered name (Prometheus text format: no `_total` added).
#[derive(Clone, Default, Debug)]
pub struct Counter {
    /// The value's `f64` bits.
    bits: Arc<AtomicU64>,
}

impl Counter {
    /// Adds one.
    pub fn inc(&self) {
        self.inc_by(1.0);
    }

    /// Adds `v` (ignored unless positive and finite).
    pub fn inc_by(&self, v: f64) {
        if !(v.is_finite() && v > 0.0) {
            return;
        }
        let _ = self
            .bits
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
                Some((f64::from_bits(bits) + v).to_bits())
            });
    }

    /// The current value.
    pub fn get(&self) -> f64 {
        f64::from_bits(self.bits.load(Ordering::Relaxed))
    }
}

impl TypedMetric for Counter {
    const TYPE: MetricType = MetricType::Counter;
}

impl EncodeMetric for Counter {
    fn encode(&self, mut encoder: MetricEncoder<'_>) -> Result<(), fmt::Error> {
        encoder.encode_gauge(&self.get())
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Counter
    }
}

/// A metric exposed only once it has been used, as ANP's label-less
/// vectors (`NewGaugeVec(opts, []string{})`) appear only after their first
/// `WithLabelValues()`: a fresh process shows no `pending_backend_dials`
/// until a dial was pending.
#[derive(Clone, Default, Debug)]
pub struct Observed<M> {
    /// Set by the first [`Observed::get`].
    shown: Arc<std::sync::atomic::AtomicBool>,
    /// The metric.
    metric: M,
}

impl<M> Observed<M> {
    /// Wraps `metric`, hidden until first used.
    pub fn new(metric: M) -> Self {
        Self {
            shown: Arc::default(),
            metric,
        }
    }

    /// The metric, shown from now on.
    pub fn get(&self) -> &M {
        self.shown.store(true, Ordering::Relaxed);
        &self.metric
    }

    /// The metric, without showing it (to refresh a value that is shown
    /// only if something else used it).
    pub fn peek(&self) -> &M {
        &self.metric
    }
}

impl<M: EncodeMetric> EncodeMetric for Observed<M> {
    fn encode(&self, encoder: MetricEncoder<'_>) -> Result<(), fmt::Error> {
        if self.shown.load(Ordering::Relaxed) {
            self.metric.encode(encoder)
        } else {
            Ok(())
        }
    }

    fn metric_type(&self) -> MetricType {
        self.metric.metric_type()
    }
}

/// Something that can be exposed: a metric or a family of them.
pub trait Exposed: EncodeMetric + Send + Sync + fmt::Debug + 'static {}
impl<T: EncodeMetric + Send + Sync + fmt::Debug + 'static> Exposed for T {}

/// A value computed when scraped; `None` leaves the metric out.
type Probe = Box<dyn Fn() -> Option<f64> + Send + Sync>;

/// A registered metric or family.
struct Entry {
    /// Its name.
    name: Cow<'static, str>,
    /// Its HELP text.
    help: Cow<'static, str>,
    /// Its series' label names, as declared (none for a single metric).
    labels: Vec<&'static str>,
    /// The values of the labels whose values the code fixes (an enum's).
    values: BTreeMap<&'static str, Vec<&'static str>>,
    /// The metric.
    metric: Box<dyn Exposed>,
}
/// A registered probe: name, HELP, type and how to read it.
type ProbeEntry = (Cow<'static, str>, Cow<'static, str>, MetricType, Probe);

/// Registers the probes of the process's allocator, if its binary set them
/// (`jemalloc::expose`): the global allocator is the process's, so this is
/// too.
static ALLOCATOR_PROBES: std::sync::OnceLock<fn(&mut Metrics)> = std::sync::OnceLock::new();

/// The metrics of one process, in registration order.
#[derive(Default)]
pub struct Metrics {
    /// Metrics and families.
    entries: Vec<Entry>,
    /// `(name, help, type, probe)`: gauges and counters read at scrape time.
    probes: Vec<ProbeEntry>,
}

impl fmt::Debug for Metrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Metrics")
            .field("metrics", &self.entries.len())
            .field("probes", &self.probes.len())
            .finish()
    }
}

impl Metrics {
    /// Adds `metric`, a single series without labels, under exactly `name`
    /// and `help`; returns it for chaining.
    pub fn register<M: Exposed + Clone + Unlabelled>(
        &mut self,
        name: impl Into<Cow<'static, str>>,
        help: impl Into<Cow<'static, str>>,
        metric: M,
    ) -> M {
        self.register_family(name, help, &[], metric)
    }

    /// Adds `family`, whose series are labelled with exactly `labels`,
    /// under exactly `name` and `help`; returns it for chaining. The labels
    /// are what [`Metrics::describe`] reports before any series exists.
    pub fn register_family<M: Exposed + Clone>(
        &mut self,
        name: impl Into<Cow<'static, str>>,
        help: impl Into<Cow<'static, str>>,
        labels: &[&'static str],
        family: M,
    ) -> M {
        self.add(name.into(), help.into(), labels, BTreeMap::new(), family)
    }

    /// [`Metrics::register_family`] with the values of the labels the code
    /// fixes.
    fn add<M: Exposed + Clone>(
        &mut self,
        name: Cow<'static, str>,
        help: Cow<'static, str>,
        labels: &[&'static str],
        values: BTreeMap<&'static str, Vec<&'static str>>,
        family: M,
    ) -> M {
        self.entries.push(Entry {
            name,
            help,
            labels: labels.to_vec(),
            values,
            metric: Box::new(family.clone()),
        });
        family
    }

    /// Adds a value computed at scrape time (a gauge of live state, or a
    /// counter kept elsewhere, e.g. by the kernel); a probe that answers
    /// `None` is left out of that scrape. Probes are read in the order
    /// they were added.
    pub fn probe(
        &mut self,
        name: impl Into<Cow<'static, str>>,
        help: impl Into<Cow<'static, str>>,
        kind: MetricType,
        probe: impl Fn() -> Option<f64> + Send + Sync + 'static,
    ) {
        self.probes
            .push((name.into(), help.into(), kind, Box::new(probe)));
    }

    /// The exposition text, as Go's client writes it: families sorted by
    /// name, series by labels, none without a series.
    pub fn render(self: &Arc<Self>) -> String {
        let mut registry = Registry::default();
        registry.register_collector(Box::new(Shared(self.clone())));
        let mut text = String::new();
        // Writing into a String cannot fail; without `encode`'s `# EOF`.
        let _ = prometheus_client::encoding::text::encode_registry(&mut text, &registry);
        text::go_text(&text)
    }

    /// Every registered family, sorted by name, whether or not it has a
    /// series yet (the exposition shows only those that have).
    pub fn describe(&self) -> Vec<Descriptor> {
        let metrics = self.entries.iter().map(|e| Descriptor {
            name: e.name.to_string(),
            help: e.help.to_string(),
            kind: e.metric.metric_type().as_str().to_owned(),
            labels: sorted(&e.labels),
            values: e.values.clone(),
        });
        let probes = self.probes.iter().map(|(name, help, kind, _)| Descriptor {
            name: name.to_string(),
            help: help.to_string(),
            kind: kind.as_str().to_owned(),
            labels: Vec::new(),
            values: BTreeMap::new(),
        });
        let mut all: Vec<Descriptor> = metrics.chain(probes).collect();
        all.sort_by(|a, b| a.name.cmp(&b.name));
        all
    }

    /// What in the current exposition disagrees with [`Metrics::describe`]
    /// (see [`mismatches`]); for tests that exercise the labelled families.
    pub fn mismatches(self: &Arc<Self>) -> Vec<String> {
        mismatches(&self.describe(), &self.render())
    }
}

fn sorted(labels: &[&'static str]) -> Vec<&'static str> {
    let mut labels = labels.to_vec();
    labels.sort_unstable();
    labels
}

/// A metric with one series and no labels: what [`Metrics::register`]
/// takes. A family goes through [`Metrics::register_family`], which names
/// its labels, so that a reference lists them before any series exists.
pub trait Unlabelled {}
impl Unlabelled for Counter {}
impl Unlabelled for Histogram {}
impl<M: Unlabelled> Unlabelled for Observed<M> {}
impl<N, A> Unlabelled for prometheus_client::metrics::gauge::Gauge<N, A> {}

/// A registered family as a reference lists it: what its `# HELP` and
/// `# TYPE` lines say and which labels its series carry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Descriptor {
    /// The family's name.
    pub name: String,
    /// The HELP text, verbatim.
    pub help: String,
    /// The TYPE: `counter`, `gauge` or `histogram`.
    pub kind: String,
    /// The label names of its series, sorted; a histogram's `_bucket`
    /// samples carry `le` besides.
    pub labels: Vec<&'static str>,
    /// Every value of the labels whose values the code fixes (an enum's,
    /// see [`LabelEnum`]), by label; the other labels' values depend on
    /// what happens (an HTTP status, a file name).
    pub values: BTreeMap<&'static str, Vec<&'static str>>,
}

/// Where the exposition `text` disagrees with `described`, one line per
/// problem: a family not described, or described with another HELP or
/// TYPE; a sample whose name is not its family's (a histogram's `_bucket`,
/// `_sum` or `_count`), whose label names are not the described ones, or
/// whose label value is not among the described values of its label.
/// Empty when they agree.
pub fn mismatches(described: &[Descriptor], text: &str) -> Vec<String> {
    text::mismatches(described, text)
}

/// The collector view of shared [`Metrics`].
#[derive(Debug)]
struct Shared(Arc<Metrics>);

impl Collector for Shared {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), fmt::Error> {
        for Entry {
            name, help, metric, ..
        } in &self.0.entries
        {
            let metric_encoder =
                encoder.encode_descriptor(name, help, None, metric.metric_type())?;
            metric.encode(metric_encoder)?;
        }
        for (name, help, kind, probe) in &self.0.probes {
            let mut metric_encoder = encoder.encode_descriptor(name, help, None, *kind)?;
            if let Some(value) = probe() {
                metric_encoder.encode_gauge(&value)?;
            }
        }
        Ok(())
    }
}

/// Histogram buckets of Go's `prometheus.DefBuckets`.
pub const DEFAULT_BUCKETS: [f64; 11] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// A histogram with fixed buckets whose observations take no lock (a few
/// atomic additions), for what is observed on the bytes' path;
/// prometheus-client's own holds a mutex per observation.
#[derive(Clone, Debug)]
pub struct Histogram {
    /// The shared state.
    inner: Arc<HistogramInner>,
}

#[derive(Debug)]
struct HistogramInner {
    /// Upper bounds, ascending; `+Inf` is implied.
    bounds: Vec<f64>,
    /// Observations per bucket (not cumulative), the last one `+Inf`'s.
    counts: Vec<AtomicU64>,
    /// The sum's `f64` bits.
    sum: AtomicU64,
}

impl Histogram {
    /// A histogram with upper bounds `bounds` (ascending) and `+Inf`.
    pub fn new(bounds: impl IntoIterator<Item = f64>) -> Self {
        let bounds: Vec<f64> = bounds.into_iter().collect();
        let counts = (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect();
        Self {
            inner: Arc::new(HistogramInner {
                bounds,
                counts,
                sum: AtomicU64::new(0),
            }),
        }
    }

    /// Records `value`.
    pub fn observe(&self, value: f64) {
        let inner = &*self.inner;
        let bucket = inner
            .bounds
            .iter()
            .position(|bound| value <= *bound)
            .unwrap_or(inner.bounds.len());
        inner.counts[bucket].fetch_add(1, Ordering::Relaxed);
        let _ = inner
            .sum
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
                Some((f64::from_bits(bits) + value).to_bits())
            });
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.inner
            .counts
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .sum()
    }
}

impl TypedMetric for Histogram {
    const TYPE: MetricType = MetricType::Histogram;
}

impl EncodeMetric for Histogram {
    fn encode(&self, mut encoder: MetricEncoder<'_>) -> Result<(), fmt::Error> {
        let inner = &*self.inner;
        let buckets: Vec<(f64, u64)> = inner
            .bounds
            .iter()
            .copied()
            .chain(std::iter::once(f64::INFINITY))
            .zip(inner.counts.iter().map(|c| c.load(Ordering::Relaxed)))
            .collect();
        let count = buckets.iter().map(|(_, n)| n).sum();
        let sum = f64::from_bits(inner.sum.load(Ordering::Relaxed));
        encoder
            .encode_histogram::<prometheus_client::encoding::NoLabelSet>(sum, count, &buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}

/// A label whose values are the variants of an enum (see [`label_enum!`]):
/// its text, and an index for tables of resolved series.
pub trait LabelEnum:
    prometheus_client::encoding::EncodeLabelValue
    + Copy
    + std::hash::Hash
    + Eq
    + fmt::Debug
    + Send
    + Sync
    + 'static
{
    /// How many values.
    const COUNT: usize;
    /// Every value, in index order.
    const ALL: &'static [Self];
    /// This value's index, below [`LabelEnum::COUNT`].
    fn index(self) -> usize;
    /// The label text.
    fn text(self) -> &'static str;
}

/// Declares an enum whose variants are a metric label's values: the
/// enum, `as_str`, prometheus-client's `EncodeLabelValue` and
/// [`LabelEnum`].
///
/// ```
/// ops::label_enum! {
///     /// Which way bytes went.
///     pub enum Direction {
///         /// Towards the agent.
///         ToAgent = "to_agent",
///         /// Back.
///         ToFrontend = "to_frontend",
///     }
/// }
/// assert_eq!(Direction::ToFrontend.as_str(), "to_frontend");
/// ```
#[macro_export]
macro_rules! label_enum {
    ($(#[$meta:meta])* $vis:vis enum $name:ident {
        $($(#[$vmeta:meta])* $variant:ident = $text:literal),+ $(,)?
    }) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        $vis enum $name {
            $($(#[$vmeta])* $variant),+
        }

        impl $name {
            /// The label text.
            #[allow(dead_code)]
            $vis fn as_str(self) -> &'static str {
                match self {
                    $(Self::$variant => $text),+
                }
            }
        }

        impl ::prometheus_client::encoding::EncodeLabelValue for $name {
            fn encode(
                &self,
                encoder: &mut ::prometheus_client::encoding::LabelValueEncoder<'_>,
            ) -> ::std::fmt::Result {
                ::std::fmt::Write::write_str(encoder, (*self).as_str())
            }
        }

        impl $crate::metrics::LabelEnum for $name {
            const COUNT: usize = [$($text),+].len();
            const ALL: &'static [Self] = &[$(Self::$variant),+];
            fn index(self) -> usize {
                self as usize
            }
            fn text(self) -> &'static str {
                self.as_str()
            }
        }
    };
}

/// Every value of `L`, as label text.
fn texts<L: LabelEnum>() -> Vec<&'static str> {
    L::ALL.iter().map(|value| value.text()).collect()
}

/// A one-label family keyed by a [`LabelEnum`] whose series are found in
/// the family once and kept: after its first use a series is counted
/// without the family's lock (it appears in the exposition on that first
/// use, as before).
#[derive(Debug)]
pub struct ByLabel<L: LabelEnum, M> {
    /// The family, as registered.
    family: prometheus_client::metrics::family::Family<[(&'static str, L); 1], M>,
    /// The label's name.
    key: &'static str,
    /// The series found so far, by the label's index.
    cells: Vec<std::sync::OnceLock<M>>,
}

impl<L, M> ByLabel<L, M>
where
    L: LabelEnum,
    M: EncodeMetric + TypedMetric + Send + Sync + fmt::Debug + Default + Clone + 'static,
{
    /// Registers `name` with `help`, labelled `key`.
    pub fn register(
        metrics: &mut Metrics,
        name: impl Into<Cow<'static, str>>,
        help: impl Into<Cow<'static, str>>,
        key: &'static str,
    ) -> Self {
        Self {
            family: metrics.add(
                name.into(),
                help.into(),
                &[key],
                BTreeMap::from([(key, texts::<L>())]),
                Default::default(),
            ),
            key,
            cells: (0..L::COUNT).map(|_| std::sync::OnceLock::new()).collect(),
        }
    }

    /// The series of `label`.
    pub fn get(&self, label: L) -> &M {
        self.cells[label.index()]
            .get_or_init(|| self.family.get_or_create(&[(self.key, label)]).clone())
    }
}

/// ANP's `stream_packets_total`: packets by type and segment `S`. After the
/// first packet of a segment and type, counting one takes no lock.
#[derive(Debug)]
pub struct PacketCounters<S: LabelEnum> {
    /// The family, as registered.
    family: prometheus_client::metrics::family::Family<[(&'static str, &'static str); 2], Counter>,
    /// The packet types' names, by their number on the wire.
    types: &'static [&'static str],
    /// Series found so far, by segment and type.
    cells: Vec<std::sync::OnceLock<Counter>>,
    /// The segment type.
    segment: std::marker::PhantomData<S>,
}

impl<S: LabelEnum> PacketCounters<S> {
    /// Registers `<prefix>stream_packets_total`; `types` names the packet
    /// types counted, by their number on the wire (others are not).
    pub fn register(metrics: &mut Metrics, prefix: &str, types: &'static [&'static str]) -> Self {
        Self {
            family: metrics.add(
                format!("{prefix}stream_packets_total").into(),
                "Count of packets processed, by segment and packet type (example: from_client, DIAL_REQ)".into(),
                &["packet_type", "segment"],
                BTreeMap::from([("packet_type", types.to_vec()), ("segment", texts::<S>())]),
                Default::default(),
            ),
            types,
            cells: (0..S::COUNT * types.len())
                .map(|_| std::sync::OnceLock::new())
                .collect(),
            segment: std::marker::PhantomData,
        }
    }

    /// A packet of type `packet_type` (its number on the wire) crossed
    /// `segment`.
    pub fn count(&self, segment: S, packet_type: i32) {
        let Some((index, name)) = usize::try_from(packet_type)
            .ok()
            .and_then(|t| self.types.get(t).map(|name| (t, *name)))
        else {
            return;
        };
        self.cells[segment.index() * self.types.len() + index]
            .get_or_init(|| {
                self.family
                    .get_or_create(&[("packet_type", name), ("segment", segment.text())])
                    .clone()
            })
            .inc();
    }
}

/// `code`, `packet_type` and `segment`: ANP's `stream_errors_total` labels.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub struct ErrorLabels<S> {
    /// The gRPC code name (`Unavailable`, …).
    pub code: &'static str,
    /// The packet type (`DIAL_RSP`, …), `Unknown` for receive errors.
    pub packet_type: &'static str,
    /// The stream segment.
    pub segment: S,
}

impl<S: prometheus_client::encoding::EncodeLabelValue + Copy> EncodeLabelSet for ErrorLabels<S> {
    fn encode(
        &self,
        encoder: &mut prometheus_client::encoding::LabelSetEncoder<'_>,
    ) -> Result<(), fmt::Error> {
        use prometheus_client::encoding::EncodeLabel;
        ("code", self.code).encode(encoder.encode_label())?;
        ("packet_type", self.packet_type).encode(encoder.encode_label())?;
        ("segment", self.segment).encode(encoder.encode_label())
    }
}

/// ANP's `stream_errors_total` (same HELP on the server and the agent),
/// by segment `S`.
#[derive(Clone, Debug)]
pub struct StreamErrors<S: LabelEnum> {
    /// Stream errors by code, type and segment.
    errors: prometheus_client::metrics::family::Family<ErrorLabels<S>, Counter>,
}

impl<S: LabelEnum> StreamErrors<S> {
    /// Registers `<prefix>stream_errors_total`.
    pub fn register(metrics: &mut Metrics, prefix: &str) -> Self {
        Self {
            errors: metrics.add(
                format!("{prefix}stream_errors_total").into(),
                "Count of gRPC stream errors, by segment, grpc Code, packet type. (example: from_agent, Code.Unavailable, DIAL_RSP)".into(),
                &["code", "packet_type", "segment"],
                BTreeMap::from([("segment", texts::<S>())]),
                Default::default(),
            ),
        }
    }

    /// Receiving on `segment` failed with `code`.
    pub fn receive_error(&self, segment: S, code: tonic::Code) {
        self.error(segment, code, "Unknown");
    }

    /// Sending a packet of type `packet_type` on `segment` failed with
    /// `code`.
    pub fn error(&self, segment: S, code: tonic::Code, packet_type: &'static str) {
        self.errors
            .get_or_create(&ErrorLabels {
                code: code_name(code),
                packet_type,
                segment,
            })
            .inc();
    }
}

/// gRPC's name of `code`, as Go's `codes.Code.String()` prints it
/// (`OK`, `Canceled`: tonic spells these two differently).
pub fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code;
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "Canceled",
        Code::Unknown => "Unknown",
        Code::InvalidArgument => "InvalidArgument",
        Code::DeadlineExceeded => "DeadlineExceeded",
        Code::NotFound => "NotFound",
        Code::AlreadyExists => "AlreadyExists",
        Code::PermissionDenied => "PermissionDenied",
        Code::ResourceExhausted => "ResourceExhausted",
        Code::FailedPrecondition => "FailedPrecondition",
        Code::Aborted => "Aborted",
        Code::OutOfRange => "OutOfRange",
        Code::Unimplemented => "Unimplemented",
        Code::Internal => "Internal",
        Code::Unavailable => "Unavailable",
        Code::DataLoss => "DataLoss",
        Code::Unauthenticated => "Unauthenticated",
    }
}

/// Registers the standard process metrics (Go's process collector names
/// and HELP): CPU, resident and virtual memory and its limit, open and
/// maximum file descriptors, start time. Values come from `/proc` when
/// scraped; one that cannot be read is left out of that scrape (Go's
/// collector reports an error for it instead). An unlimited limit is
/// `RLIM_INFINITY` as a float, as Go reports it. Ours: the runtime's alive
/// tasks, and the allocator's figures where the binary exposed them
/// (`jemalloc::expose`).
pub fn register_process(metrics: &mut Metrics) {
    use procfs::process::{LimitValue, Limits, Process};
    fn stat() -> Option<procfs::process::Stat> {
        Process::myself().ok()?.stat().ok()
    }
    fn limit(pick: fn(&Limits) -> &LimitValue) -> Option<f64> {
        let limits = Process::myself().ok()?.limits().ok()?;
        Some(match pick(&limits) {
            LimitValue::Value(v) => *v as f64,
            LimitValue::Unlimited => u64::MAX as f64,
        })
    }
    let ticks = procfs::ticks_per_second() as f64;
    let page = procfs::page_size() as f64;
    metrics.probe(
        "process_cpu_seconds_total",
        "Total user and system CPU time spent in seconds.",
        MetricType::Counter,
        move || stat().map(|s| (s.utime + s.stime) as f64 / ticks),
    );
    metrics.probe(
        "process_max_fds",
        "Maximum number of open file descriptors.",
        MetricType::Gauge,
        || limit(|l| &l.max_open_files.soft_limit),
    );
    metrics.probe(
        "process_open_fds",
        "Number of open file descriptors.",
        MetricType::Gauge,
        || {
            Process::myself()
                .ok()
                .and_then(|p| p.fd_count().ok())
                .map(|n| n as f64)
        },
    );
    metrics.probe(
        "process_resident_memory_bytes",
        "Resident memory size in bytes.",
        MetricType::Gauge,
        move || stat().map(|s| s.rss as f64 * page),
    );
    let boot = procfs::boot_time_secs().ok().map(|b| b as f64);
    metrics.probe(
        "process_start_time_seconds",
        "Start time of the process since unix epoch in seconds.",
        MetricType::Gauge,
        move || {
            stat()
                .zip(boot)
                .map(|(s, boot)| boot + s.starttime as f64 / ticks)
        },
    );
    metrics.probe(
        "process_virtual_memory_bytes",
        "Virtual memory size in bytes.",
        MetricType::Gauge,
        move || stat().map(|s| s.vsize as f64),
    );
    metrics.probe(
        "process_virtual_memory_max_bytes",
        "Maximum amount of virtual memory available in bytes.",
        MetricType::Gauge,
        || limit(|l| &l.max_address_space.soft_limit),
    );
    register_runtime(metrics);
}

/// Ours beside the process metrics: the runtime's alive tasks, and the
/// allocator's figures where the binary exposed them.
fn register_runtime(metrics: &mut Metrics) {
    // Read on the runtime that serves the scrape, which is the process's
    // only one; absent when scraped from outside a runtime.
    metrics.probe(
        "konnectivity_rs_runtime_alive_tasks",
        "Tasks alive in the process's async runtime (konnectivity-rs).",
        MetricType::Gauge,
        || {
            tokio::runtime::Handle::try_current()
                .ok()
                .map(|handle| handle.metrics().num_alive_tasks() as f64)
        },
    );
    if let Some(register) = ALLOCATOR_PROBES.get() {
        register(metrics);
    }
}

#[cfg(test)]
mod tests {
    use prometheus_client::metrics::{family::Family, gauge::Gauge};

    use super::*;

    #[test]
    fn exposition_uses_the_names_and_help_verbatim() {
        let mut m = Metrics::default();
        let failures: Family<Vec<(String, String)>, Counter> = m.register_family(
            "x_dial_failure_count",
            "Number of dial failures observed. Multiple failures can occur.",
            &["reason"],
            Family::default(),
        );
        let packets: Family<Vec<(&'static str, &'static str)>, Counter> = m.register_family(
            "x_stream_packets_total",
            "Count of packets",
            &["segment", "packet_type"],
            Family::default(),
        );
        let gauge = m.register("x_open", "Open things", Gauge::<i64>::default());
        let hist = m.register(
            "x_dial_duration_seconds",
            "Latency",
            Histogram::new([0.1, 1.0]),
        );
        let busy = Counter::default();
        let probe = busy.clone();
        m.probe(
            "x_busy_seconds_total",
            "Busy",
            MetricType::Counter,
            move || Some(probe.get()),
        );
        failures
            .get_or_create(&vec![("reason".to_owned(), "no_agent".to_owned())])
            .inc();
        packets
            .get_or_create(&vec![
                ("packet_type", "DIAL_REQ"),
                ("segment", "from_client"),
            ])
            .inc_by(2.0);
        gauge.set(3);
        hist.observe(0.5);
        busy.inc_by(0.25);
        let text = Arc::new(m).render();
        assert_eq!(
            text,
            "# HELP x_busy_seconds_total Busy\n\
             # TYPE x_busy_seconds_total counter\n\
             x_busy_seconds_total 0.25\n\
             # HELP x_dial_duration_seconds Latency\n\
             # TYPE x_dial_duration_seconds histogram\n\
             x_dial_duration_seconds_bucket{le=\"0.1\"} 0\n\
             x_dial_duration_seconds_bucket{le=\"1\"} 1\n\
             x_dial_duration_seconds_bucket{le=\"+Inf\"} 1\n\
             x_dial_duration_seconds_sum 0.5\n\
             x_dial_duration_seconds_count 1\n\
             # HELP x_dial_failure_count Number of dial failures observed. Multiple failures can occur.\n\
             # TYPE x_dial_failure_count counter\n\
             x_dial_failure_count{reason=\"no_agent\"} 1\n\
             # HELP x_open Open things\n\
             # TYPE x_open gauge\n\
             x_open 3\n\
             # HELP x_stream_packets_total Count of packets\n\
             # TYPE x_stream_packets_total counter\n\
             x_stream_packets_total{packet_type=\"DIAL_REQ\",segment=\"from_client\"} 2\n"
        );
    }

    #[test]
    fn every_family_is_described_before_it_has_a_series() {
        type Latencies = Family<Vec<(&'static str, &'static str)>, Histogram, fn() -> Histogram>;
        let mut m = Metrics::default();
        let hist: Latencies = m.register_family(
            "x_latency_seconds",
            "Latency",
            &["status", "kind"],
            Family::new_with_constructor(|| Histogram::new([1.0])),
        );
        let pending = m.register(
            "x_pending",
            "Pending",
            Observed::new(Gauge::<i64>::default()),
        );
        let bytes: ByLabel<Way, Counter> =
            ByLabel::register(&mut m, "x_bytes_total", "Bytes", "direction");
        m.probe("x_busy", "Busy", MetricType::Gauge, || None);
        let m = Arc::new(m);
        assert_eq!(m.render(), "", "no series yet");
        let described: Vec<String> = m
            .describe()
            .iter()
            .map(|d| {
                format!(
                    "{} {} {} {:?} {:?}",
                    d.name, d.kind, d.help, d.labels, d.values
                )
            })
            .collect();
        assert_eq!(
            described,
            [
                "x_busy gauge Busy [] {}",
                "x_bytes_total counter Bytes [\"direction\"] {\"direction\": [\"up\", \"down\"]}",
                "x_latency_seconds histogram Latency [\"kind\", \"status\"] {}",
                "x_pending gauge Pending [] {}",
            ]
        );

        // Series as described: no mismatch.
        hist.get_or_create(&vec![("kind", "a"), ("status", "200")])
            .observe(0.5);
        pending.get().set(1);
        bytes.get(Way::Up).inc();
        assert_eq!(m.mismatches(), Vec::<String>::new());
    }

    #[test]
    fn mismatches_name_what_differs() {
        let described = vec![
            Descriptor {
                name: "x_total".to_owned(),
                help: "Things".to_owned(),
                kind: "counter".to_owned(),
                labels: vec!["reason", "way"],
                values: BTreeMap::from([("way", vec!["up", "down"])]),
            },
            Descriptor {
                name: "x_seconds".to_owned(),
                help: "Latency".to_owned(),
                kind: "histogram".to_owned(),
                labels: vec![],
                values: BTreeMap::new(),
            },
        ];
        let good = "# HELP x_seconds Latency\n# TYPE x_seconds histogram\n\
                    x_seconds_bucket{le=\"+Inf\"} 1\nx_seconds_sum 1\nx_seconds_count 1\n\
                    # HELP x_total Things\n# TYPE x_total counter\nx_total{reason=\"a\",way=\"up\"} 1\n";
        assert_eq!(mismatches(&described, good), Vec::<String>::new());
        let bad = "# HELP x_other Other\n# TYPE x_other gauge\nx_other 1\n\
                   # HELP x_seconds Latency.\n# TYPE x_seconds summary\nx_seconds_max 1\n\
                   # HELP x_total Things\n# TYPE x_total counter\nx_total{cause=\"a\",way=\"up\"} 1\n\
                   x_total{reason=\"a\",way=\"left\"} 1\n";
        assert_eq!(
            mismatches(&described, bad),
            [
                "x_other: not described",
                "x_seconds: HELP \"Latency.\", described as \"Latency\"",
                "x_seconds: TYPE summary, described as histogram",
                "x_seconds: sample \"x_seconds_max 1\" is not one of its",
                "x_total{cause=\"a\",way=\"up\"} 1: labels [\"cause\", \"way\"], described as [\"reason\", \"way\"]",
                "x_total{reason=\"a\",way=\"left\"} 1: way=\"left\" is none of the described [\"up\", \"down\"]",
            ]
        );
    }

    #[test]
    fn observed_metrics_appear_once_used() {
        let mut m = Metrics::default();
        let pending = m.register(
            "x_pending",
            "Pending",
            Observed::new(Gauge::<i64>::default()),
        );
        let hist = m.register(
            "x_latency_seconds",
            "Latency",
            Observed::new(Histogram::new([1.0])),
        );
        let hidden = Arc::new(m);
        pending.peek().set(5);
        assert_eq!(hidden.render(), "", "nothing used yet");
        pending.get().set(0);
        hist.get().observe(2.0);
        assert_eq!(
            hidden.render(),
            "# HELP x_latency_seconds Latency\n\
             # TYPE x_latency_seconds histogram\n\
             x_latency_seconds_bucket{le=\"1\"} 0\n\
             x_latency_seconds_bucket{le=\"+Inf\"} 1\n\
             x_latency_seconds_sum 2\n\
             x_latency_seconds_count 1\n\
             # HELP x_pending Pending\n\
             # TYPE x_pending gauge\n\
             x_pending 0\n"
        );
    }

    crate::label_enum! {
        /// A test label.
        enum Way {
            /// One way.
            Up = "up",
            /// The other.
            Down = "down",
        }
    }

    #[test]
    fn a_resolved_series_is_the_familys_and_appears_on_first_use() {
        let mut m = Metrics::default();
        let bytes: ByLabel<Way, Counter> =
            ByLabel::register(&mut m, "x_bytes_total", "Bytes", "direction");
        let packets: PacketCounters<Way> =
            PacketCounters::register(&mut m, "x_", &["DIAL_REQ", "DIAL_RSP"]);
        let m = Arc::new(m);
        assert_eq!(m.render(), "");
        bytes.get(Way::Down).inc_by(3.0);
        bytes.get(Way::Down).inc();
        packets.count(Way::Up, 1);
        packets.count(Way::Up, 1);
        packets.count(Way::Up, 7);
        packets.count(Way::Up, -1);
        let text = m.render();
        assert!(
            text.contains("x_bytes_total{direction=\"down\"} 4\n"),
            "{text}"
        );
        assert!(!text.contains("direction=\"up\""), "{text}");
        assert!(
            text.contains("x_stream_packets_total{packet_type=\"DIAL_RSP\",segment=\"up\"} 2\n"),
            "{text}"
        );
        assert_eq!(text.matches("x_stream_packets_total{").count(), 1, "{text}");
    }

    #[test]
    fn code_names_are_go_names() {
        assert_eq!(code_name(tonic::Code::Cancelled), "Canceled");
        assert_eq!(code_name(tonic::Code::Ok), "OK");
        assert_eq!(code_name(tonic::Code::Unavailable), "Unavailable");
        assert_eq!(code_name(tonic::Code::DeadlineExceeded), "DeadlineExceeded");
    }

    #[tokio::test]
    async fn alive_tasks_are_counted_on_the_runtime() {
        let mut m = Metrics::default();
        register_process(&mut m);
        let m = Arc::new(m);
        let tasks = |text: &str| -> f64 {
            text.lines()
                .find_map(|l| l.strip_prefix("konnectivity_rs_runtime_alive_tasks "))
                .unwrap_or_else(|| panic!("alive tasks missing:\n{text}"))
                .parse()
                .unwrap()
        };
        let before = tasks(&m.render());
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let held = tokio::spawn(async move {
            let _ = rx.await;
        });
        assert_eq!(tasks(&m.render()), before + 1.0);
        drop(tx);
        held.await.unwrap();
        assert_eq!(tasks(&m.render()), before);
    }

    #[test]
    fn process_metrics_have_values() {
        let mut m = Metrics::default();
        register_process(&mut m);
        let text = Arc::new(m).render();
        for name in [
            "process_cpu_seconds_total",
            "process_resident_memory_bytes",
            "process_open_fds",
            "process_start_time_seconds",
        ] {
            let value: f64 = text
                .lines()
                .find_map(|l| l.strip_prefix(&format!("{name} ")))
                .unwrap_or_else(|| panic!("{name} missing:\n{text}"))
                .parse()
                .unwrap();
            if name != "process_cpu_seconds_total" {
                assert!(value > 0.0, "{name} = {value}");
            }
        }
    }
}
