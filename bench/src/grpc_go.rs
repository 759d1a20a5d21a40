//! The gRPC-mode rows driven by kube-apiserver's own gRPC client library:
//! `tests/go/frontend` on grpc-go (Debian's build), as a child process.
//! Each tunnel is a new gRPC connection with grpc-go's own HTTP/2 settings
//! (16 KiB frames, 64 KiB initial windows grown by BDP pings); uploads are
//! written 32 KiB per DATA packet, as a proxied stream through
//! konnectivity-client's `Write`.

use std::{
    path::{Path, PathBuf},
    process::Stdio,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use anyhow::{Context, bail};
use client::dial::Transport;
use tokio::{
    io::{AsyncBufReadExt, BufReader},
    process::{Child, Command},
};

use crate::{
    backends::{Backends, EXCHANGE_BYTES},
    scenarios::{self, Target, Timing, Window},
};

/// The built frontend.
#[derive(Debug, Clone)]
pub struct GoFrontend {
    /// Its path.
    pub path: PathBuf,
}

impl GoFrontend {
    /// `given`, else `target/go-frontend` beside this executable's
    /// `target/<profile>/`.
    ///
    /// # Errors
    /// It does not exist; the message says how to build it.
    pub fn locate(given: Option<PathBuf>) -> anyhow::Result<Self> {
        let path = match given {
            Some(path) => path,
            None => std::env::current_exe()
                .context("finding the bench executable")?
                .parent()
                .and_then(Path::parent)
                .context("the bench executable has no target directory")?
                .join("go-frontend"),
        };
        if !path.is_file() {
            bail!(
                "{} not found: `scripts/test` builds it, or `GOPATH=/usr/share/gocode \
                 GO111MODULE=off go build -o target/go-frontend ./tests/go/frontend` with \
                 Debian's golang-go, golang-google-grpc-dev and golang-google-protobuf-dev \
                 (or pass --go-frontend)",
                path.display()
            );
        }
        Ok(Self { path })
    }

    /// `mode` against `target` (its Unix socket) with `args`; stdin and
    /// stdout piped, killed when dropped.
    fn spawn(&self, target: &Target, mode: &str, args: &[String]) -> anyhow::Result<Child> {
        let Some(Transport::Uds(uds)) = target.dialer.as_ref().map(|d| &d.transport) else {
            bail!("the grpc-go rows need a target on a Unix socket");
        };
        Command::new(&self.path)
            .arg(format!("-uds={}", uds.display()))
            .arg(mode)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {}", self.path.display()))
    }

    /// One stream, time-boxed: `download` from the endless source (bytes
    /// as the frontend reports them read) or `upload` to the sink (bytes as
    /// the sink receives them).
    ///
    /// # Errors
    /// The frontend cannot start or fails during the measurement.
    pub async fn bulk(
        &self,
        target: &Target,
        backends: &Backends,
        timing: Timing,
        up: bool,
    ) -> anyhow::Result<Window> {
        scenarios::quiesce(backends).await;
        let (mode, addr) = if up {
            ("upload", backends.sink.addr)
        } else {
            ("download", backends.source.addr)
        };
        let mut child = self.spawn(target, mode, &[format!("-addr={addr}"), "-bytes=0".into()])?;
        let stdout = child.stdout.take().context("the frontend's stdout")?;
        let reported = Arc::new(AtomicU64::new(0));
        let progress = reported.clone();
        let mut tasks = scenarios::Streams::new();
        tasks.spawn(async move {
            // The child lives, and is killed, with this task.
            let _child = child;
            let mut lines = BufReader::new(stdout).lines();
            while let Some(line) = lines.next_line().await? {
                let bytes = serde_json::from_str::<serde_json::Value>(&line)
                    .ok()
                    .and_then(|v| v["bytes"].as_u64());
                if let Some(bytes) = bytes {
                    progress.store(bytes, Ordering::Relaxed);
                }
            }
            Err(std::io::Error::other("the grpc-go frontend exited"))
        });
        scenarios::measure(target.pids, timing, &mut tasks, || {
            vec![if up {
                backends.sink.bytes_in()
            } else {
                reported.load(Ordering::Relaxed)
            }]
        })
        .await
    }

    /// Single-use tunnels at `concurrency` for `duration`, each a new gRPC
    /// connection exchanging 1 KiB each way with the responder.
    ///
    /// # Errors
    /// The frontend cannot start, fails, or reports nothing.
    pub async fn dials(
        &self,
        target: &Target,
        backends: &Backends,
        concurrency: usize,
        duration: Duration,
    ) -> anyhow::Result<GoDials> {
        scenarios::quiesce(backends).await;
        let child = self.spawn(
            target,
            "dials",
            &[
                format!("-addr={}", backends.responder.addr),
                format!("-concurrency={concurrency}"),
                format!("-duration={}ms", duration.as_millis()),
                format!("-exchange={EXCHANGE_BYTES}"),
            ],
        )?;
        let out =
            tokio::time::timeout(duration + Duration::from_secs(30), child.wait_with_output())
                .await
                .context("the grpc-go frontend's dials ran 30 s past their time")?
                .context("waiting for the grpc-go frontend")?;
        if !out.status.success() {
            bail!("the grpc-go frontend's dials failed ({})", out.status);
        }
        let text = String::from_utf8_lossy(&out.stdout);
        let json: serde_json::Value = text
            .lines()
            .last()
            .and_then(|l| serde_json::from_str(l).ok())
            .with_context(|| format!("the grpc-go frontend printed {text:?}"))?;
        let num = |key: &str| json[key].as_f64().unwrap_or(f64::NAN);
        Ok(GoDials {
            rate: num("dials") / num("seconds"),
            p50_us: num("p50_us"),
            p99_us: num("p99_us"),
            errors: json["errors"].as_u64().unwrap_or(0),
            first_error: json["first_error"]
                .as_str()
                .filter(|e| !e.is_empty())
                .map(str::to_owned),
        })
    }
}

/// What the grpc-go frontend's dials measured.
#[derive(Debug, Clone)]
pub struct GoDials {
    /// Completed dial + exchange per second.
    pub rate: f64,
    /// Median latency, µs.
    pub p50_us: f64,
    /// 99th percentile latency, µs.
    pub p99_us: f64,
    /// Failed ones.
    pub errors: u64,
    /// The first failure.
    pub first_error: Option<String>,
}
