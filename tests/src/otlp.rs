//! `tests/python/otlp_receiver.py`: an OTLP/gRPC trace receiver built on
//! the OpenTelemetry project's own generated `TraceService` (PyPI's
//! `opentelemetry-proto`), sharing no code with ours; the spans it received,
//! and `TracingConfiguration` files pointing at it.

use std::{net::SocketAddr, path::PathBuf, process::Command, time::Duration};

use serde_json::Value;

use crate::{DEADLINE, LoggedProcess, python, workspace};

/// The receiver, killed on drop.
pub struct Receiver {
    /// The process; its standard error carries the spans.
    pub process: LoggedProcess,
    /// Where it serves OTLP/gRPC.
    pub addr: SocketAddr,
}

impl Receiver {
    /// Starts it on 127.0.0.1 with an ephemeral port; returns once it
    /// listens.
    pub async fn start() -> Self {
        let mut command = Command::new(python::interpreter());
        command
            .arg(workspace().join("tests/python/otlp_receiver.py"))
            .env("PYTHONDONTWRITEBYTECODE", "1");
        let mut process = LoggedProcess::spawn(command, "otlp_receiver.py");
        let port = process.logged_port("listening 127.0.0.1:").await;
        Self {
            process,
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
        }
    }

    /// Every span received so far, in order.
    pub fn spans(&self) -> Vec<Value> {
        self.process
            .lines()
            .iter()
            .filter_map(|line| line.strip_prefix("span "))
            .map(|json| serde_json::from_str(json).expect("the receiver's span line"))
            .collect()
    }

    /// Waits until a received span satisfies `wanted` and returns it;
    /// panics after `limit`, listing what came.
    pub async fn wait_for_span(
        &self,
        what: &str,
        limit: Duration,
        wanted: impl Fn(&Value) -> bool,
    ) -> Value {
        let start = std::time::Instant::now();
        loop {
            if let Some(span) = self.spans().into_iter().find(&wanted) {
                return span;
            }
            assert!(
                start.elapsed() < limit,
                "no span {what} within {limit:?}; received: {:#?}",
                self.process.lines()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// A `TracingConfiguration` file for it with `rate` per million in
    /// `dir`.
    pub fn config(&self, dir: &std::path::Path, rate: u32) -> PathBuf {
        config_file(dir, &self.addr.to_string(), rate)
    }
}

/// A `TracingConfiguration` file (as kube-apiserver reads) in `dir` naming
/// `endpoint` and `rate` per million.
pub fn config_file(dir: &std::path::Path, endpoint: &str, rate: u32) -> PathBuf {
    let path = dir.join(format!("tracing-{rate}.yaml"));
    std::fs::write(
        &path,
        format!(
            "apiVersion: apiserver.config.k8s.io/v1beta1\nkind: TracingConfiguration\n\
             endpoint: {endpoint}\nsamplingRatePerMillion: {rate}\n"
        ),
    )
    .expect("writing the tracing configuration");
    path
}

/// How long a span may take to arrive: the exporters' batch delay is set
/// to [`BATCH_DELAY_MS`] by the tests, so this is mostly slack.
pub const ARRIVAL: Duration = DEADLINE;

/// `OTEL_BSP_SCHEDULE_DELAY` (ms) for the processes of a tracing test: the
/// SDK's default, 5 s, would only make them slower.
pub const BATCH_DELAY_MS: &str = "100";

/// A string attribute of a received span (panics naming it if absent).
pub fn attr<'a>(span: &'a Value, key: &str) -> &'a Value {
    let value = &span["attributes"][key];
    assert!(!value.is_null(), "no attribute {key} in {span:#}");
    value
}
