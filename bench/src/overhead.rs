//! The overhead scenario (issue 45): what tracing at 100 % sampling and
//! the audit log cost per single-use tunnel. Three gRPC-mode deployments
//! side by side, the same but for flags given to both server and agent:
//! none; `--tracing-config-file` with `samplingRatePerMillion: 1000000`
//! towards an OTLP receiver in this process; `--audit-log-path`. Each
//! repetition runs single-use tunnels at 8 clients (each dial, 1 KiB each
//! way, close) through the three in an order that rotates, with our client
//! and with grpc-go; the ratios are per repetition.
//!
//! The receiver implements OTLP's trace service from its official
//! protocol definitions (the `opentelemetry-proto` crate) and counts the
//! spans of each service: spans that were not exported cost less, so the
//! rows say how many arrived per traced tunnel and how many the server
//! dropped.

use std::{
    net::SocketAddr,
    path::Path,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
};

use anyhow::Context;
use client::dial::Mode;
use opentelemetry_proto::tonic::{
    collector::trace::v1::{
        ExportTraceServiceRequest, ExportTraceServiceResponse,
        trace_service_server::{TraceService, TraceServiceServer},
    },
    common::v1::any_value::Value,
};
use tokio_util::sync::CancellationToken;

use crate::{
    backends::Backends,
    clients::{self, ClientRun},
    grpc_go::GoFrontend,
    probe,
    report::{self, Recorder, Route},
    scenarios::{self, Target, Timing},
    system::{Binaries, Deployment},
};

/// Tunnels at once, as the `dial` rows at eight.
const CONCURRENCY: usize = 8;

/// The deployments, in the order of [`ROWS`]'s columns: label.
const LABELS: [&str; 3] = ["plain", "traced", "audited"];

/// Spans received by the receiver, by the service that sent them.
#[derive(Default)]
struct Counts {
    server: AtomicU64,
    agent: AtomicU64,
    other: AtomicU64,
}

/// An OTLP trace receiver that counts spans and keeps nothing.
struct Receiver(Arc<Counts>);

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        for resource in request.into_inner().resource_spans {
            let service = resource
                .resource
                .iter()
                .flat_map(|r| &r.attributes)
                .find(|a| a.key == "service.name")
                .and_then(|a| a.value.as_ref()?.value.as_ref())
                .and_then(|v| match v {
                    Value::StringValue(s) => Some(s.clone()),
                    _ => None,
                });
            let spans: usize = resource.scope_spans.iter().map(|s| s.spans.len()).sum();
            let counter = match service.as_deref() {
                Some("konnectivity-server") => &self.0.server,
                Some("konnectivity-agent") => &self.0.agent,
                _ => &self.0.other,
            };
            counter.fetch_add(spans as u64, Ordering::Relaxed);
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

/// Starts the receiver on loopback until `stop`; its address.
async fn receiver(counts: Arc<Counts>, stop: CancellationToken) -> anyhow::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .context("binding the OTLP receiver")?;
    let addr = listener.local_addr()?;
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(Receiver(counts)))
            .serve_with_incoming_shutdown(incoming, stop.cancelled_owned()),
    );
    Ok(addr)
}

/// One deployment's runs: our client's, then grpc-go's.
type Measured = [ClientRun; 2];

/// Rows of one client: server+agent µs plain, traced, audited; traced /
/// plain, audited / plain.
type Rows = [&'static report::Def; 5];
/// Our client's rows, then grpc-go's.
const ROWS: [Rows; 2] = [
    [
        &report::OVERHEAD_US_PLAIN,
        &report::OVERHEAD_US_TRACED,
        &report::OVERHEAD_US_AUDITED,
        &report::OVERHEAD_TRACED_RATIO,
        &report::OVERHEAD_AUDITED_RATIO,
    ],
    [
        &report::OVERHEAD_US_PLAIN_GO,
        &report::OVERHEAD_US_TRACED_GO,
        &report::OVERHEAD_US_AUDITED_GO,
        &report::OVERHEAD_TRACED_RATIO_GO,
        &report::OVERHEAD_AUDITED_RATIO_GO,
    ],
];

/// Records repetition `rep` from the three deployments' [`Measured`], in
/// [`LABELS`]' order; the tunnels the traced deployment carried.
fn record(rec: &mut Recorder, rep: usize, measured: &[Measured; 3]) -> f64 {
    let mut errors = 0;
    for (client, rows) in ROWS.iter().enumerate() {
        let cpu: Vec<Option<f64>> = measured
            .iter()
            .map(|m| {
                errors += m[client].errors;
                m[client].cpu_us.map(|(server, agent)| server + agent)
            })
            .collect();
        let (Some(plain), Some(traced), Some(audited)) = (cpu[0], cpu[1], cpu[2]) else {
            continue;
        };
        let values = [plain, traced, audited, traced / plain, audited / plain];
        for (row, value) in rows.iter().zip(values) {
            rec.push(row, Route::Grpc, rep, Some(value));
        }
        eprintln!(
            "overhead rep {rep} {}: server+agent {plain:.1} us/tunnel, traced {traced:.1} \
             ({:.3}), audited {audited:.1} ({:.3})",
            rows[0].name,
            traced / plain,
            audited / plain,
        );
    }
    rec.push(
        &report::OVERHEAD_ERRORS,
        Route::Grpc,
        rep,
        Some(errors as f64),
    );
    measured[1][0].tunnels + measured[1][1].tunnels
}

/// The three deployments, in [`LABELS`]' order: the traced one towards
/// the receiver at `otlp`, the audited one writing in `dir`.
async fn deployments(
    bins: &Binaries,
    dir: &Path,
    otlp: SocketAddr,
) -> anyhow::Result<[Deployment; 3]> {
    let tracing = dir.join("overhead-tracing.yaml");
    std::fs::write(
        &tracing,
        format!(
            "apiVersion: apiserver.config.k8s.io/v1\nkind: TracingConfiguration\n\
             endpoint: {otlp}\nsamplingRatePerMillion: 1000000\n"
        ),
    )
    .context("writing the tracing configuration")?;
    let traced = [format!("--tracing-config-file={}", tracing.display())];
    let audit = |side: &str| {
        let path = dir.join(format!("overhead-audit-{side}.jsonl"));
        [format!("--audit-log-path={}", path.display())]
    };
    let flags: [(&[String], &[String]); 3] = [
        (&[], &[]),
        (&traced, &traced),
        (&audit("server"), &audit("agent")),
    ];
    let mut started = Vec::new();
    for (label, flags) in LABELS.iter().zip(flags) {
        let name = format!("overhead-{label}");
        started.push(Deployment::start_with(bins, dir, Mode::Grpc, &name, flags).await?);
    }
    started
        .try_into()
        .map_err(|_| anyhow::anyhow!("three deployments"))
}

/// Records how many spans of each side arrived per traced tunnel after
/// `warm` (server, agent) and how many the server `dropped`; the note.
fn spans_rows(
    rec: &mut Recorder,
    counts: &Counts,
    warm: [u64; 2],
    traced_tunnels: f64,
    dropped: f64,
) -> String {
    let [server, agent] = [&counts.server, &counts.agent]
        .map(|c| c.load(Ordering::Relaxed))
        .map(|n| n as f64);
    let per = |n: f64, warm: u64| (n - warm as f64) / traced_tunnels.max(1.0);
    rec.push(
        &report::OVERHEAD_SERVER_SPANS,
        Route::Grpc,
        0,
        Some(per(server, warm[0])),
    );
    rec.push(
        &report::OVERHEAD_AGENT_SPANS,
        Route::Grpc,
        0,
        Some(per(agent, warm[1])),
    );
    rec.push(&report::OVERHEAD_DROPPED, Route::Grpc, 0, Some(dropped));
    let line = format!(
        "overhead: the receiver got {server} server and {agent} agent spans ({} from another \
         service); {traced_tunnels:.0} tunnels through the traced deployment after warm-up; the \
         traced server dropped {dropped}",
        counts.other.load(Ordering::Relaxed)
    );
    eprintln!("{line}");
    line
}

/// Runs the scenario: `reps` repetitions of `timing.duration` per client
/// and deployment; the notes.
///
/// # Errors
/// A deployment does not start or dies, or a run fails.
pub async fn run(
    bins: &Binaries,
    dir: &Path,
    backends: &Backends,
    go: Option<&GoFrontend>,
    (timing, reps): (Timing, usize),
    rec: &mut Recorder,
) -> anyhow::Result<Vec<String>> {
    let counts = Arc::new(Counts::default());
    let stop = CancellationToken::new();
    let _stop = stop.clone().drop_guard();
    let otlp = receiver(counts.clone(), stop).await?;
    let mut running = deployments(bins, dir, otlp).await?;
    let targets = running.each_ref().map(|d| Target {
        route: Route::Grpc,
        dialer: Some(d.dialer()),
        pids: Some(d.pids()),
        health: Some(d.health),
    });
    // Warm each: first connections, the exporter's first batch.
    for t in &targets {
        scenarios::dial_rate(t, backends, CONCURRENCY, timing.warmup).await?;
    }
    let warm = [&counts.server, &counts.agent].map(|c| c.load(Ordering::Relaxed));
    let mut traced_tunnels = 0.0;
    for rep in 0..reps {
        let mut measured: [Option<Measured>; 3] = [None; 3];
        for k in 0..LABELS.len() {
            let at = (rep + k) % LABELS.len();
            let runs = clients::both(&targets[at], backends, go, CONCURRENCY, timing.duration);
            measured[at] = Some(runs.await?);
        }
        let measured = measured.map(Option::unwrap_or_default);
        traced_tunnels += record(rec, rep, &measured);
        for d in &mut running {
            d.check_alive()?;
        }
    }
    let (_, metrics) = probe::http_get(running[1].health, "/metrics").await?;
    let dropped =
        probe::prometheus_value(&metrics, "konnectivity_rs_server_trace_spans_dropped_total")
            .context("the traced server has no spans-dropped counter")?;
    // Their last spans are exported as they stop.
    for d in &mut running {
        d.stop().await?;
    }
    let line = spans_rows(rec, &counts, warm, traced_tunnels, dropped);
    Ok(vec![
        format!(
            "overhead runs once, after the repetitions: three gRPC-mode deployments, the same \
             but for flags on both server and agent: none; --tracing-config-file at \
             samplingRatePerMillion 1000000 towards an OTLP receiver in the bench (spans \
             counted, nothing kept); --audit-log-path; each repetition runs single-use tunnels \
             at 8 clients for {:?} per client and deployment, in an order that rotates; ratios \
             are traced / plain and audited / plain, server+agent CPU, within a repetition",
            timing.duration
        ),
        line,
    ])
}
