//! The gRPC-mode rows driven by kube-apiserver's own gRPC client library:
//! `tests/go/frontend` on grpc-go (Debian's build), as a child process.
//! Each tunnel is a new gRPC connection with grpc-go's own HTTP/2 settings
//! (16 KiB frames, 64 KiB initial windows grown by BDP pings); uploads are
//! written 32 KiB per DATA packet, as a proxied stream through
//! konnectivity-client's `Write`.

use std::{
    path::PathBuf,
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
    scenarios::{self, Target, Timing, Transfer},
    system::{self, CpuSpan},
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
        let path = system::locate_go(given, "frontend")?;
        Ok(Self { path })
    }

    /// `mode` against `target` (its Unix socket) with `args`; stdin and
    /// stdout piped, killed when dropped.
    fn spawn(&self, target: &Target, mode: &str, args: &[String]) -> anyhow::Result<Child> {
        self.spawn_with(target, false, mode, args)
    }

    /// [`spawn`](Self::spawn), every tunnel on one gRPC connection when
    /// `reuse` (konnectivity-client's reusable tunnel).
    fn spawn_with(
        &self,
        target: &Target,
        reuse: bool,
        mode: &str,
        args: &[String],
    ) -> anyhow::Result<Child> {
        let Some(Transport::Uds(uds)) = target.dialer.as_ref().map(|d| &d.transport) else {
            bail!("the grpc-go rows need a target on a Unix socket");
        };
        Command::new(&self.path)
            .arg(format!("-uds={}", uds.display()))
            .args(reuse.then_some("-reuse"))
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
    ) -> anyhow::Result<Transfer> {
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

    /// Tunnels at `concurrency` for `duration`, each exchanging 1 KiB each
    /// way with the responder: single-use (a new gRPC connection each), or
    /// with `reuse` a Proxy stream each on one connection.
    ///
    /// # Errors
    /// The frontend cannot start, fails, or reports nothing.
    pub async fn dials(
        &self,
        target: &Target,
        backends: &Backends,
        concurrency: usize,
        duration: Duration,
        reuse: bool,
    ) -> anyhow::Result<GoDials> {
        scenarios::quiesce(backends).await;
        let cpu = target.pids.map(CpuSpan::start).transpose()?;
        let child = self.spawn_with(
            target,
            reuse,
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
        let cpu_us = match cpu {
            Some(cpu) => cpu.per(num("dials"))?,
            None => None,
        };
        Ok(GoDials {
            cpu_us,
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
    /// CPU per tunnel, (server, agent), µs.
    pub cpu_us: Option<(f64, f64)>,
}

/// What holding many tunnels on one gRPC connection cost.
#[derive(Debug, Clone, Copy)]
pub struct GoStreams {
    /// How long opening them took, in seconds.
    pub open_s: f64,
    /// RSS per open tunnel, (server, agent), bytes.
    pub per_stream: (f64, f64),
}

impl GoFrontend {
    /// `n` long-lived tunnels on one gRPC connection (the reusable tunnel),
    /// each echoing 1 KiB when opened: the time to open them and what each
    /// costs in RSS, settled, on both sides.
    ///
    /// # Errors
    /// The frontend cannot start or fails, or a process is gone.
    pub async fn streams(
        &self,
        target: &Target,
        backends: &Backends,
        n: usize,
    ) -> anyhow::Result<GoStreams> {
        let pids = target
            .pids
            .context("the streams scenario needs a tunneled target")?;
        scenarios::quiesce(backends).await;
        let before = scenarios::settled_rss(pids).await?;
        let started = std::time::Instant::now();
        let mut child = self.spawn_with(
            target,
            true,
            "many",
            &[
                format!("-addr={}", backends.echo.addr),
                format!("-count={n}"),
            ],
        )?;
        let stdout = child.stdout.take().context("the frontend's stdout")?;
        let mut lines = BufReader::new(stdout).lines();
        let first = tokio::time::timeout(Duration::from_secs(300), lines.next_line())
            .await
            .context("the grpc-go frontend did not open its tunnels within 300 s")??
            .context("the grpc-go frontend exited before opening its tunnels")?;
        let open_s = started.elapsed().as_secs_f64();
        let json: serde_json::Value = serde_json::from_str(&first)
            .with_context(|| format!("the grpc-go frontend printed {first:?}"))?;
        if json["open"].as_u64() != Some(n as u64) || json["connections"].as_u64() != Some(1) {
            bail!("the grpc-go frontend printed {first:?}");
        }
        let during = scenarios::settled_rss(pids).await?;
        drop(child.stdin.take());
        let status = tokio::time::timeout(Duration::from_secs(300), child.wait())
            .await
            .context("the grpc-go frontend did not close its tunnels within 300 s")??;
        if !status.success() {
            bail!("the grpc-go frontend's tunnels failed at the end ({status})");
        }
        let per = |during: u64, before: u64| (during as f64 - before as f64) / n as f64;
        Ok(GoStreams {
            open_s,
            per_stream: (per(during.0, before.0), per(during.1, before.1)),
        })
    }
}
