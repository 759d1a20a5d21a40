//! OpenTelemetry traces, configured as kube-apiserver configures its own:
//! `--tracing-config-file` names a `TracingConfiguration` (YAML or JSON)
//! with the collector's `endpoint` (OTLP over gRPC, insecure, default
//! `localhost:4317`) and `samplingRatePerMillion` (default 0). The sampler
//! is kube-apiserver's: a dial whose frontend sent a W3C trace context
//! follows its parent's decision; one without is sampled at the rate.
//!
//! Spans are made with the OpenTelemetry API directly, a handful per
//! tunnel, never per DATA packet, and not through the `tracing` subscriber
//! (whose every span and event would then pass through OpenTelemetry's
//! layer). Ended spans go to the SDK's batch processor, which exports from
//! its own thread; what it cannot take (its queue full, a collector down
//! or slow) is dropped and counted ([`Tracing::spans_dropped`], exposed
//! by each binary as `konnectivity_rs_*_trace_spans_dropped_total`), never
//! waited for.

use std::{
    fmt,
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use opentelemetry::{
    Context, KeyValue, Value,
    trace::{
        Span as _, SpanContext, SpanId, SpanKind, Status, TraceContextExt as _, TraceFlags,
        TraceId, TraceState, Tracer as _, TracerProvider as _,
    },
};
use opentelemetry_otlp::WithExportConfig as _;
use opentelemetry_sdk::{
    Resource,
    error::OTelSdkResult,
    trace::{
        BatchConfigBuilder, BatchSpanProcessor, Sampler, SdkTracer, SdkTracerProvider, SpanData,
        SpanExporter, SpanProcessor,
    },
};
use proto::text::{RECORD_LIMIT, for_record};
use serde::Deserialize;

use crate::metrics::Counter;

/// kube-apiserver's default collector endpoint.
pub const DEFAULT_ENDPOINT: &str = "localhost:4317";
/// The API versions of kube-apiserver's `TracingConfiguration`.
const API_VERSIONS: [&str; 3] = [
    "apiserver.config.k8s.io/v1alpha1",
    "apiserver.config.k8s.io/v1beta1",
    "apiserver.config.k8s.io/v1",
];
/// Spans ended and not yet exported, at most (the SDK's default).
const QUEUE: usize = 2048;
/// Bytes of the spans ended and not yet exported, at most ([`span_bytes`]):
/// with every attribute cut ([`bounded`]), a queue of [`QUEUE`] spans of
/// ours fits in it; it keeps larger ones from taking more.
const QUEUE_BYTES: usize = 16 << 20;
/// Attributes and events a span keeps, at most (ours set a dozen).
const MAX_ATTRIBUTES: u32 = 32;

/// A `TracingConfiguration` file, as written.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct File {
    api_version: Option<String>,
    kind: Option<String>,
    endpoint: Option<String>,
    sampling_rate_per_million: Option<i64>,
}

/// What a `TracingConfiguration` says, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TracingConfig {
    /// The collector, `host:port`.
    pub endpoint: String,
    /// Root spans sampled per million.
    pub sampling_rate_per_million: u32,
}

/// The tracing configuration file cannot be used; the message names the
/// file and the field.
#[derive(Debug, thiserror::Error)]
#[error("--tracing-config-file {}: {what}", path.display())]
pub struct ConfigError {
    /// The file.
    pub path: PathBuf,
    /// What is wrong with it.
    pub what: String,
}

impl TracingConfig {
    /// Reads and validates `path`.
    ///
    /// # Errors
    /// The file cannot be read, is not a `TracingConfiguration`, or a field
    /// is out of range.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let fail = |what: String| ConfigError {
            path: path.to_owned(),
            what,
        };
        let text = std::fs::read_to_string(path).map_err(|e| fail(e.to_string()))?;
        Self::parse(&text).map_err(fail)
    }

    /// Validates a file's text (YAML, of which JSON is a subset).
    ///
    /// # Errors
    /// What is wrong, naming the field.
    pub fn parse(text: &str) -> Result<Self, String> {
        let file: File = serde_saphyr::from_str(text).map_err(|e| e.to_string())?;
        if let Some(kind) = file
            .kind
            .as_deref()
            .filter(|k| *k != "TracingConfiguration")
        {
            return Err(format!("kind: {kind:?} is not TracingConfiguration"));
        }
        if let Some(v) = file
            .api_version
            .as_deref()
            .filter(|v| !API_VERSIONS.contains(v))
        {
            return Err(format!("apiVersion: {v:?} is not one of {API_VERSIONS:?}"));
        }
        let rate = file.sampling_rate_per_million.unwrap_or(0);
        let rate = u32::try_from(rate)
            .ok()
            .filter(|r| *r <= 1_000_000)
            .ok_or_else(|| {
                format!("samplingRatePerMillion: {rate} is not between 0 and 1000000")
            })?;
        let endpoint = file.endpoint.unwrap_or_else(|| DEFAULT_ENDPOINT.to_owned());
        let port = endpoint
            .rsplit_once(':')
            .map(|(host, port)| (host, port.parse::<u16>()));
        if !matches!(port, Some((host, Ok(_))) if !host.is_empty()) {
            return Err(format!("endpoint: {endpoint:?} is not host:port"));
        }
        Ok(Self {
            endpoint,
            sampling_rate_per_million: rate,
        })
    }
}

/// A W3C trace context (`traceparent`) received from a peer.
#[derive(Debug, Clone, PartialEq)]
pub struct Parent(SpanContext);

impl Parent {
    /// Parses a `traceparent` value (`00-<trace id>-<span id>-<flags>`);
    /// `None` when it is not one.
    pub fn parse(value: &str) -> Option<Self> {
        let mut parts = value.trim().split('-');
        let (version, trace, span, flags) =
            (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        if version.len() != 2 || version == "ff" || (version == "00" && parts.next().is_some()) {
            return None;
        }
        if trace.len() != 32 || span.len() != 16 || flags.len() != 2 {
            return None;
        }
        let context = SpanContext::new(
            TraceId::from_hex(trace).ok()?,
            SpanId::from_hex(span).ok()?,
            TraceFlags::new(u8::from_str_radix(flags, 16).ok()? & 1),
            true,
            TraceState::default(),
        );
        context.is_valid().then_some(Self(context))
    }
}

/// Formats a span context as a `traceparent` value.
fn traceparent(context: &SpanContext) -> String {
    format!(
        "00-{}-{}-{:02x}",
        context.trace_id(),
        context.span_id(),
        context.trace_flags().to_u8()
    )
}

/// The process's tracer: off (every span a no-op, free), or exporting.
#[derive(Clone, Default)]
pub struct Tracing {
    /// The provider and its tracer; `None` when traces are off.
    on: Option<On>,
    /// Spans ended and never exported.
    dropped: Counter,
}

/// A started tracer.
#[derive(Clone)]
struct On {
    /// What exports, and is shut down at the end.
    provider: SdkTracerProvider,
    /// What makes spans.
    tracer: SdkTracer,
}

impl fmt::Debug for Tracing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tracing")
            .field("on", &self.on.is_some())
            .field("dropped", &self.dropped)
            .finish()
    }
}

impl Tracing {
    /// Traces off.
    pub fn off() -> Self {
        Self::default()
    }

    /// Exports to `config`'s collector as `service`, counting in `dropped`
    /// the spans it could not export (must be called within a tokio
    /// runtime: the gRPC channel's worker runs on it).
    ///
    /// # Errors
    /// The exporter cannot be built (an endpoint tonic does not take).
    pub fn start(
        config: &TracingConfig,
        service: &'static str,
        dropped: Counter,
    ) -> Result<Self, String> {
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_endpoint(format!("http://{}", config.endpoint))
            .with_timeout(Duration::from_secs(10))
            .build()
            .map_err(|e| format!("the OTLP exporter for {}: {e}", config.endpoint))?;
        let in_flight = Arc::new(InFlight::default());
        let batch = BatchSpanProcessor::builder(Counted {
            inner: exporter,
            in_flight: in_flight.clone(),
            dropped: dropped.clone(),
        })
        .with_batch_config(
            BatchConfigBuilder::default()
                .with_max_queue_size(QUEUE)
                .build(),
        )
        .build();
        let rate = f64::from(config.sampling_rate_per_million) / 1e6;
        let provider = SdkTracerProvider::builder()
            .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
                rate,
            ))))
            .with_resource(Resource::builder().with_service_name(service).build())
            .with_max_attributes_per_span(MAX_ATTRIBUTES)
            .with_max_events_per_span(MAX_ATTRIBUTES)
            .with_max_attributes_per_event(MAX_ATTRIBUTES)
            .with_span_processor(Admit {
                inner: batch,
                in_flight,
                dropped: dropped.clone(),
            })
            .build();
        let tracer = provider.tracer("konnectivity-rs");
        Ok(Self {
            on: Some(On { provider, tracer }),
            dropped,
        })
    }

    /// Whether spans are made at all.
    pub fn is_on(&self) -> bool {
        self.on.is_some()
    }

    /// Spans ended and never exported: the queue was full, or the
    /// collector did not take them (a handle on the counter, for a metrics
    /// registry).
    pub fn spans_dropped(&self) -> Counter {
        self.dropped.clone()
    }

    /// Starts a span named `name`, the child of `parent` when given (else
    /// a root, subject to sampling).
    pub fn span(&self, name: &'static str, kind: SpanKind, parent: Option<&Parent>) -> Span {
        let Some(on) = &self.on else {
            return Span(None);
        };
        let context = match parent {
            Some(Parent(remote)) => Context::new().with_remote_span_context(remote.clone()),
            None => Context::new(),
        };
        let span = on
            .tracer
            .span_builder(name)
            .with_kind(kind)
            .start_with_context(&on.tracer, &context);
        Span(Some(span))
    }

    /// Exports what is queued and stops (at the process's end).
    pub fn shutdown(&self) {
        if let Some(on) = &self.on
            && let Err(error) = on.provider.shutdown_with_timeout(Duration::from_secs(2))
        {
            tracing::debug!(%error, "tracing shutdown");
        }
    }
}

pub use opentelemetry::trace::SpanKind as Kind;

/// A span in progress: a no-op when traces are off. Ends when dropped.
#[derive(Debug)]
pub struct Span(Option<opentelemetry_sdk::trace::Span>);

impl Span {
    /// A span that records nothing.
    pub fn none() -> Self {
        Self(None)
    }

    /// Whether attributes given to it are kept (traces on and sampled).
    pub fn is_recording(&self) -> bool {
        self.0.as_ref().is_some_and(|s| s.is_recording())
    }

    /// Its context as a `traceparent` for a peer (also when not sampled, so
    /// that the peer follows the decision); `None` when traces are off.
    pub fn traceparent(&self) -> Option<String> {
        let span = self.0.as_ref()?;
        let context = span.span_context();
        context.is_valid().then(|| traceparent(context))
    }

    /// Its context, as the parent of a span made here.
    pub fn as_parent(&self) -> Option<Parent> {
        let span = self.0.as_ref()?;
        let context = span.span_context();
        context.is_valid().then(|| Parent(context.clone()))
    }

    /// Sets attributes (cheap when not recording: nothing is built); a
    /// text longer than `proto::text::RECORD_LIMIT` is cut, marked.
    pub fn set(&mut self, attributes: impl FnOnce() -> Vec<KeyValue>) {
        if let Some(span) = self.0.as_mut().filter(|s| s.is_recording()) {
            span.set_attributes(attributes().into_iter().map(bounded));
        }
    }

    /// Adds an event with attributes, cut as [`Self::set`]'s.
    pub fn event(&mut self, name: &'static str, attributes: impl FnOnce() -> Vec<KeyValue>) {
        if let Some(span) = self.0.as_mut().filter(|s| s.is_recording()) {
            span.add_event(name, attributes().into_iter().map(bounded).collect());
        }
    }

    /// Marks it failed with `description` (cut as an attribute).
    pub fn fail(&mut self, description: impl Into<String>) {
        if let Some(span) = self.0.as_mut().filter(|s| s.is_recording()) {
            span.set_status(Status::error(for_record(description.into())));
        }
    }

    /// Ends it now.
    pub fn end(mut self) {
        if let Some(mut span) = self.0.take() {
            span.end();
        }
    }
}

pub use opentelemetry::KeyValue as Attr;

/// `attribute` with its text cut to `proto::text::RECORD_LIMIT` bytes,
/// marked as cut: a peer's text (a destination, an error) never goes
/// whole into a span.
fn bounded(attribute: KeyValue) -> KeyValue {
    match attribute.value {
        Value::String(text) if text.as_str().len() > RECORD_LIMIT => {
            KeyValue::new(attribute.key, for_record(text.as_str().to_owned()))
        }
        value => KeyValue::new(attribute.key, value),
    }
}

/// About how many bytes an ended span holds: its name, attributes, events
/// and status text.
fn span_bytes(span: &SpanData) -> usize {
    fn attributes(list: &[KeyValue]) -> usize {
        list.iter()
            .map(|kv| {
                kv.key.as_str().len()
                    + match &kv.value {
                        Value::String(text) => text.as_str().len(),
                        _ => 16,
                    }
            })
            .sum()
    }
    let status = match &span.status {
        Status::Error { description } => description.len(),
        _ => 0,
    };
    std::mem::size_of::<SpanData>()
        + span.name.len()
        + attributes(&span.attributes)
        + span
            .events
            .iter()
            .map(|e| e.name.len() + attributes(&e.attributes))
            .sum::<usize>()
        + status
}

/// Releases a batch's spans from [`InFlight`] when dropped.
struct Release<'a> {
    /// The count.
    in_flight: &'a InFlight,
    /// The batch's spans.
    spans: usize,
    /// Their bytes.
    bytes: usize,
}

impl Drop for Release<'_> {
    fn drop(&mut self) {
        self.in_flight.release(self.spans, self.bytes);
    }
}

/// The spans handed to the batch processor and not yet through the
/// exporter: how many, and their bytes.
#[derive(Debug, Default)]
struct InFlight {
    /// Spans.
    spans: AtomicUsize,
    /// Their bytes ([`span_bytes`]).
    bytes: AtomicUsize,
}

impl InFlight {
    /// Takes a span of `bytes` in, unless [`QUEUE`] spans or
    /// [`QUEUE_BYTES`] are in already.
    fn admit(&self, bytes: usize) -> bool {
        let spans = self.spans.fetch_add(1, Ordering::Relaxed);
        let held = self.bytes.fetch_add(bytes, Ordering::Relaxed);
        if spans >= QUEUE || held + bytes > QUEUE_BYTES {
            self.release(1, bytes);
            return false;
        }
        true
    }

    /// `spans` of `bytes` in all are out.
    fn release(&self, spans: usize, bytes: usize) {
        self.spans.fetch_sub(spans, Ordering::Relaxed);
        self.bytes.fetch_sub(bytes, Ordering::Relaxed);
    }
}

/// The batch processor behind an admission count: a span that would not
/// fit in its queue is dropped here and counted, instead of inside the SDK
/// (which counts it where no one can read it).
#[derive(Debug)]
struct Admit {
    inner: BatchSpanProcessor,
    in_flight: Arc<InFlight>,
    dropped: Counter,
}

impl SpanProcessor for Admit {
    fn on_start(&self, span: &mut opentelemetry_sdk::trace::Span, cx: &Context) {
        self.inner.on_start(span, cx);
    }

    fn on_end(&self, span: SpanData) {
        if !self.in_flight.admit(span_bytes(&span)) {
            self.dropped.inc();
            return;
        }
        self.inner.on_end(span);
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    /// The provider's resource (`service.name`) reaches the exporter only
    /// through here.
    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

/// The OTLP exporter, counting the spans of batches the collector did not
/// take as dropped, and every batch as out of the queue.
#[derive(Debug)]
struct Counted {
    inner: opentelemetry_otlp::SpanExporter,
    in_flight: Arc<InFlight>,
    dropped: Counter,
}

impl SpanExporter for Counted {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        // Out of the queue when the export ends, or when its future is
        // dropped (a timeout).
        let _out = Release {
            in_flight: &self.in_flight,
            spans: batch.len(),
            bytes: batch.iter().map(span_bytes).sum(),
        };
        let spans = batch.len();
        let result = self.inner.export(batch).await;
        if result.is_err() {
            self.dropped.inc_by(spans as f64);
        }
        result
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// A peer's long text goes into a span cut and marked; short texts and
    /// other values as they are (issue 51: destinations and agents' errors
    /// went whole into span attributes).
    #[test]
    fn a_long_attribute_is_cut_and_marked() {
        let long = bounded(KeyValue::new("error", "e".repeat(4 << 20)));
        assert_eq!(long.key.as_str(), "error");
        let Value::String(text) = &long.value else {
            panic!("{long:?}")
        };
        assert!(text.as_str().len() < RECORD_LIMIT + 32);
        assert!(
            text.as_str()
                .ends_with(&format!("…({} more bytes)", (4 << 20) - RECORD_LIMIT))
        );
        let short = KeyValue::new("net.peer.name", "10.0.0.7:10250");
        assert_eq!(bounded(short.clone()), short);
        let number = KeyValue::new("retries", 3_i64);
        assert_eq!(bounded(number.clone()), number);
    }

    /// The export queue takes spans up to its count and its bytes, and has
    /// room again once a batch is through.
    #[test]
    fn the_span_queue_is_bounded_in_spans_and_bytes() {
        let in_flight = InFlight::default();
        let big = QUEUE_BYTES / 4;
        for _ in 0..4 {
            assert!(in_flight.admit(big));
        }
        assert!(!in_flight.admit(1), "bytes full");
        in_flight.release(1, big);
        assert!(in_flight.admit(big));
        in_flight.release(4, 4 * big);
        for _ in 0..QUEUE {
            assert!(in_flight.admit(1));
        }
        assert!(!in_flight.admit(1), "spans full");
        {
            let _batch = Release {
                in_flight: &in_flight,
                spans: 1,
                bytes: 1,
            };
        }
        assert!(in_flight.admit(1), "a dropped export releases its batch");
    }

    #[test]
    fn kube_apiservers_file_is_read() {
        let c = TracingConfig::parse(
            "apiVersion: apiserver.config.k8s.io/v1beta1\nkind: TracingConfiguration\n\
             endpoint: otel-collector.monitoring:4317\nsamplingRatePerMillion: 10000\n",
        )
        .unwrap();
        assert_eq!(c.endpoint, "otel-collector.monitoring:4317");
        assert_eq!(c.sampling_rate_per_million, 10000);
        let json = TracingConfig::parse(r#"{"kind":"TracingConfiguration"}"#).unwrap();
        assert_eq!(json.endpoint, DEFAULT_ENDPOINT);
        assert_eq!(json.sampling_rate_per_million, 0);
    }

    #[test]
    fn errors_name_the_field() {
        for (text, field) in [
            ("samplingRatePerMillion: 1000001", "samplingRatePerMillion"),
            ("samplingRatePerMillion: -1", "samplingRatePerMillion"),
            ("endpoint: nohost", "endpoint"),
            ("endpoint: \":4317\"", "endpoint"),
            ("kind: EgressSelectorConfiguration", "kind"),
            ("apiVersion: v1", "apiVersion"),
            ("sampling: 3", "sampling"),
        ] {
            let e = TracingConfig::parse(text).unwrap_err();
            assert!(e.contains(field), "{text}: {e}");
        }
        let e = TracingConfig::load(Path::new("/nonexistent/tracing.yaml")).unwrap_err();
        assert!(e.to_string().contains("/nonexistent/tracing.yaml"), "{e}");
    }

    #[test]
    fn traceparent_round_trips() {
        let v = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let p = Parent::parse(v).unwrap();
        assert_eq!(traceparent(&p.0), v);
        assert!(p.0.is_sampled());
        for bad in [
            "",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x",
            "00-xyz",
        ] {
            assert!(Parent::parse(bad).is_none(), "{bad}");
        }
    }

    #[test]
    fn off_makes_no_spans() {
        let t = Tracing::off();
        let mut s = t.span("dial", Kind::Server, None);
        assert!(!s.is_recording());
        assert!(s.traceparent().is_none());
        s.set(|| unreachable!());
        s.end();
    }
}
