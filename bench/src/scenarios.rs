//! The scenarios, each run once against one [`Target`]; the caller repeats
//! and interleaves them.

use std::{
    io,
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::{Context, bail};
use client::dial::{Dialer, Io};
use futures_util::{StreamExt, TryStreamExt};
use hdrhistogram::Histogram;
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
    task::JoinSet,
};

use crate::{
    backends::{BULK_BUFFER, Backends, EXCHANGE_BYTES, wait_until},
    probe,
    report::Route,
    stats,
    system::{CpuSpan, Pids},
};

/// Longest wait for one connection to be established.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest wait for the backends to see the previous run's connections
/// close before the next run starts.
pub const QUIESCE_LIMIT: Duration = Duration::from_secs(15);
/// Time the stalled connection gets to fill every buffer on its way before
/// the bulk download next to it is measured.
const STALL_FILL: Duration = Duration::from_secs(1);
/// Untimed round trips before the timed ones.
const PINGPONG_WARMUP: usize = 500;
/// Ping-pong message size.
const PINGPONG_BYTES: usize = 64;
/// Longest a single dial + exchange may take before it counts as an error.
const EXCHANGE_TIMEOUT: Duration = Duration::from_secs(10);
/// Idle connections being opened at once in the memory scenario.
const OPEN_CONCURRENCY: usize = 32;
/// Open/close rounds of the memory scenario.
const MEMORY_ROUNDS: usize = 10;
/// Longest wait for the backend to see all idle connections open or closed.
const MEMORY_WAIT: Duration = Duration::from_secs(120);

/// Where a scenario's connections go, and the processes on the way.
#[derive(Clone)]
pub struct Target {
    /// Which route this is.
    pub route: Route,
    /// `None` for direct TCP.
    pub dialer: Option<Dialer>,
    /// Server and agent, for tunneled routes.
    pub pids: Option<Pids>,
    /// The server's health port, for tunneled routes.
    pub health: Option<SocketAddr>,
}

impl Target {
    /// A connection to `addr` over this route (TCP_NODELAY when direct).
    ///
    /// # Errors
    /// Connecting or dialing fails or takes longer than 30 s.
    pub async fn connect(&self, addr: SocketAddr) -> anyhow::Result<Box<dyn Io>> {
        let connect = async {
            match &self.dialer {
                None => {
                    let stream = TcpStream::connect(addr).await?;
                    stream.set_nodelay(true)?;
                    Ok::<Box<dyn Io>, anyhow::Error>(Box::new(stream))
                }
                Some(dialer) => Ok(dialer.dial(&addr.to_string()).await?),
            }
        };
        tokio::time::timeout(CONNECT_TIMEOUT, connect)
            .await
            .map_err(|_| anyhow::anyhow!("connecting to {addr} timed out"))?
            .with_context(|| format!("connecting to {addr} ({})", self.route.name()))
    }
}

/// How long a time-boxed run lasts.
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    /// Untimed start (connection set-up, TCP slow start, windows opening).
    pub warmup: Duration,
    /// Measured time.
    pub duration: Duration,
}

/// What a time-boxed run moved.
#[derive(Debug, Clone)]
pub struct Transfer {
    /// Bytes per stream within the measured time.
    pub per_stream: Vec<u64>,
    /// Exact measured time, in seconds.
    pub secs: f64,
    /// CPU ticks of server + agent within the measured time (tunneled only).
    pub cpu_ticks: Option<u64>,
    /// Of those, the server's.
    pub server_ticks: Option<u64>,
    /// Context switches of (server, agent) within the measured time.
    pub switches: Option<(u64, u64)>,
}

impl Transfer {
    /// Bytes of all streams.
    pub fn bytes(&self) -> u64 {
        self.per_stream.iter().sum()
    }

    /// Throughput in MB/s (10^6 bytes).
    pub fn mb_per_s(&self) -> f64 {
        self.bytes() as f64 / self.secs / 1e6
    }

    /// GiB moved, all streams.
    fn gib(&self) -> f64 {
        self.bytes() as f64 / f64::from(1u32 << 30)
    }

    /// CPU seconds of server + agent per GiB moved.
    pub fn cpu_s_per_gib(&self) -> Option<f64> {
        Some(self.cpu_ticks? as f64 / probe::CLOCK_TICKS_PER_SEC / self.gib())
            .filter(|v| v.is_finite())
    }

    /// The server's share of [`cpu_s_per_gib`](Self::cpu_s_per_gib).
    pub fn server_cpu_s_per_gib(&self) -> Option<f64> {
        Some(self.server_ticks? as f64 / probe::CLOCK_TICKS_PER_SEC / self.gib())
            .filter(|v| v.is_finite())
    }

    /// Context switches of (server, agent) per GiB moved.
    pub fn switches_per_gib(&self) -> Option<(f64, f64)> {
        let (server, agent) = self.switches?;
        let per = (server as f64 / self.gib(), agent as f64 / self.gib());
        Some(per).filter(|(s, a)| s.is_finite() && a.is_finite())
    }
}

/// Stream tasks of a run; all are aborted (and their connections dropped)
/// when this is dropped.
pub type Streams = JoinSet<io::Result<()>>;

/// Fails if a stream task has ended: they only end on error.
fn check_streams(streams: &mut Streams) -> anyhow::Result<()> {
    match streams.try_join_next() {
        None => Ok(()),
        Some(Ok(Ok(()))) => bail!("a stream ended before the measurement did"),
        Some(Ok(Err(e))) => Err(e).context("a stream failed during the measurement"),
        Some(Err(e)) => Err(e).context("a stream task failed"),
    }
}

/// Warms up, then samples `counts` (per-stream byte counters) and the CPU
/// time of `pids` at both ends of the measured time.
pub async fn measure(
    pids: Option<Pids>,
    timing: Timing,
    streams: &mut Streams,
    counts: impl Fn() -> Vec<u64>,
) -> anyhow::Result<Transfer> {
    tokio::time::sleep(timing.warmup).await;
    check_streams(streams)?;
    let cpu0 = pids.map(|p| p.each_cpu_ticks()).transpose()?;
    let switches0 = pids.map(|p| p.context_switches()).transpose()?;
    let bytes0 = counts();
    let t0 = Instant::now();
    tokio::time::sleep(timing.duration).await;
    let bytes1 = counts();
    let secs = t0.elapsed().as_secs_f64();
    let cpu1 = pids.map(|p| p.each_cpu_ticks()).transpose()?;
    let switches1 = pids.map(|p| p.context_switches()).transpose()?;
    check_streams(streams)?;
    Ok(Transfer {
        per_stream: bytes1.iter().zip(&bytes0).map(|(b, a)| b - a).collect(),
        secs,
        cpu_ticks: cpu0
            .zip(cpu1)
            .map(|(a, b)| (b.0 + b.1).saturating_sub(a.0 + a.1)),
        server_ticks: cpu0.zip(cpu1).map(|(a, b)| b.0.saturating_sub(a.0)),
        switches: switches0
            .zip(switches1)
            .map(|(a, b)| (b.0.saturating_sub(a.0), b.1.saturating_sub(a.1))),
    })
}

/// Reads `conn` until it fails, adding what it reads to `counter`.
async fn read_counting(mut conn: Box<dyn Io>, counter: Arc<AtomicU64>) -> io::Result<()> {
    let mut buf = vec![0u8; BULK_BUFFER];
    loop {
        let n = conn.read(&mut buf).await?;
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        counter.fetch_add(n as u64, Ordering::Relaxed);
    }
}

/// Writes to `conn` until it fails.
async fn write_endlessly(mut conn: Box<dyn Io>) -> io::Result<()> {
    let buf = vec![0xa5_u8; BULK_BUFFER];
    loop {
        conn.write_all(&buf).await?;
    }
}

/// Waits for the previous run's backend connections to close; warns if
/// they do not.
pub async fn quiesce(backends: &Backends) {
    if !backends.quiesce(QUIESCE_LIMIT).await {
        eprintln!(
            "warning: backend connections of the previous run still open after {QUIESCE_LIMIT:?}"
        );
    }
}

/// `streams` downloads from the endless source at once, time-boxed.
///
/// # Errors
/// A connection fails.
pub async fn download(
    target: &Target,
    backends: &Backends,
    timing: Timing,
    streams: usize,
) -> anyhow::Result<Transfer> {
    quiesce(backends).await;
    let mut tasks = Streams::new();
    let mut counters = Vec::with_capacity(streams);
    for _ in 0..streams {
        let conn = target.connect(backends.source.addr).await?;
        let counter = Arc::new(AtomicU64::new(0));
        tasks.spawn(read_counting(conn, counter.clone()));
        counters.push(counter);
    }
    measure(target.pids, timing, &mut tasks, || {
        counters.iter().map(|c| c.load(Ordering::Relaxed)).collect()
    })
    .await
}

/// One upload to the sink, time-boxed; counted where the sink receives.
///
/// # Errors
/// The connection fails.
pub async fn upload(
    target: &Target,
    backends: &Backends,
    timing: Timing,
) -> anyhow::Result<Transfer> {
    quiesce(backends).await;
    let mut tasks = Streams::new();
    let conn = target.connect(backends.sink.addr).await?;
    tasks.spawn(write_endlessly(conn));
    measure(target.pids, timing, &mut tasks, || {
        vec![backends.sink.bytes_in()]
    })
    .await
}

/// Results of the head-of-line scenario.
#[derive(Debug, Clone, Copy)]
pub struct Hol {
    /// Bulk download alone, MB/s.
    pub solo: f64,
    /// Bulk download next to the stalled connection, MB/s (0 if it could
    /// not even be dialed).
    pub stalled: f64,
    /// The server's max-buffered gauge with the stalled one open.
    pub buffered: Option<f64>,
}

/// Bulk download alone, then next to a connection to the endless source
/// that is never read.
///
/// # Errors
/// The solo download or the stalled connection fails.
pub async fn head_of_line(
    target: &Target,
    backends: &Backends,
    timing: Timing,
) -> anyhow::Result<Hol> {
    let solo = download(target, backends, timing, 1)
        .await
        .context("bulk download alone")?
        .mb_per_s();
    quiesce(backends).await;
    let stalled_conn = target
        .connect(backends.source.addr)
        .await
        .context("the stalled connection")?;
    tokio::time::sleep(STALL_FILL).await;
    // The stalled source is open: download() must not wait for it.
    let mut tasks = Streams::new();
    let counter = Arc::new(AtomicU64::new(0));
    let stalled = match target.connect(backends.source.addr).await {
        Ok(conn) => {
            tasks.spawn(read_counting(conn, counter.clone()));
            measure(target.pids, timing, &mut tasks, || {
                vec![counter.load(Ordering::Relaxed)]
            })
            .await
            .map(|w| w.mb_per_s())
        }
        Err(e) => Err(e),
    };
    let stalled = stalled.unwrap_or_else(|e| {
        eprintln!("warning: bulk next to the stalled connection failed: {e:#}");
        0.0
    });
    let buffered = match target.health {
        Some(health) => match probe::http_get(health, "/metrics").await {
            Ok((200, body)) => probe::prometheus_value(&body, probe::MAX_BUFFERED_GAUGE),
            _ => None,
        },
        None => None,
    };
    drop(tasks);
    drop(stalled_conn);
    quiesce(backends).await;
    Ok(Hol {
        solo,
        stalled,
        buffered,
    })
}

/// `round_trips` timed 64-byte ping-pongs on one connection to the echo
/// backend; the histogram of round-trip times (ns).
///
/// # Errors
/// The connection fails.
pub async fn pingpong(
    target: &Target,
    backends: &Backends,
    round_trips: usize,
) -> anyhow::Result<Histogram<u64>> {
    quiesce(backends).await;
    let mut conn = target.connect(backends.echo.addr).await?;
    let ping = [0x42_u8; PINGPONG_BYTES];
    let mut pong = [0u8; PINGPONG_BYTES];
    let mut histogram = stats::latency_histogram();
    for i in 0..PINGPONG_WARMUP + round_trips {
        let start = Instant::now();
        conn.write_all(&ping).await?;
        conn.flush().await?;
        conn.read_exact(&mut pong).await?;
        if i >= PINGPONG_WARMUP {
            stats::record(&mut histogram, start.elapsed());
        }
    }
    Ok(histogram)
}

/// Results of a dial-rate run.
#[derive(Debug)]
pub struct DialRate {
    /// Completed dial + exchange per second.
    pub rate: f64,
    /// Their latencies (ns).
    pub latency: Histogram<u64>,
    /// Failed ones.
    pub errors: u64,
    /// The first failure.
    pub first_error: Option<String>,
    /// CPU per completed tunnel, (server, agent), µs (tunneled only).
    pub cpu_us: Option<(f64, f64)>,
}

/// One single-use connection: dial, send 1 KiB, read 1 KiB back, close.
async fn exchange(target: &Target, addr: SocketAddr) -> anyhow::Result<()> {
    let mut conn = target.connect(addr).await?;
    let out = [0x17_u8; EXCHANGE_BYTES];
    let mut back = [0u8; EXCHANGE_BYTES];
    conn.write_all(&out).await?;
    conn.flush().await?;
    conn.read_exact(&mut back).await?;
    if back != out {
        bail!("the responder's answer differs from what was sent");
    }
    Ok(())
}

/// `concurrency` loops of `exchange` with the responder for `duration`.
///
/// # Errors
/// Never for failed dials (they are counted); only if a worker task panics.
pub async fn dial_rate(
    target: &Target,
    backends: &Backends,
    concurrency: usize,
    duration: Duration,
) -> anyhow::Result<DialRate> {
    quiesce(backends).await;
    let cpu = target.pids.map(CpuSpan::start).transpose()?;
    let start = Instant::now();
    let deadline = start + duration;
    let mut workers = JoinSet::new();
    for _ in 0..concurrency {
        let target = target.clone();
        let addr = backends.responder.addr;
        workers.spawn(async move {
            let mut latency = stats::latency_histogram();
            let (mut errors, mut first_error) = (0u64, None);
            while Instant::now() < deadline {
                let began = Instant::now();
                let result = tokio::time::timeout(EXCHANGE_TIMEOUT, exchange(&target, addr))
                    .await
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("dial + exchange timed out")));
                match result {
                    Ok(()) => stats::record(&mut latency, began.elapsed()),
                    Err(e) => {
                        errors += 1;
                        first_error.get_or_insert_with(|| format!("{e:#}"));
                    }
                }
            }
            (latency, errors, first_error)
        });
    }
    let mut total = DialRate {
        rate: 0.0,
        latency: stats::latency_histogram(),
        errors: 0,
        first_error: None,
        cpu_us: None,
    };
    while let Some(worker) = workers.join_next().await {
        let (latency, errors, first_error) = worker.context("a dial worker failed")?;
        total
            .latency
            .add(&latency)
            .context("merging latency histograms")?;
        total.errors += errors;
        total.first_error = total.first_error.or(first_error);
    }
    total.rate = total.latency.len() as f64 / start.elapsed().as_secs_f64();
    if let Some(cpu) = cpu {
        total.cpu_us = cpu.per(total.latency.len() as f64)?;
    }
    Ok(total)
}

/// RSS of server and agent (bytes) at the points of the memory scenario.
#[derive(Debug, Clone, Copy)]
pub struct Memory {
    /// Growth per open idle connection, (server, agent), bytes.
    pub per_conn: (f64, f64),
    /// After the first open/close round of N/10.
    pub round1: (u64, u64),
    /// After the last round.
    pub round10: (u64, u64),
}

/// Opens `n` connections to the hold-open backend, `OPEN_CONCURRENCY` at a
/// time, and waits until the backend has them all.
async fn open_idle(
    target: &Target,
    backends: &Backends,
    n: usize,
) -> anyhow::Result<Vec<Box<dyn Io>>> {
    let before = backends.hold.active();
    let conns: Vec<Box<dyn Io>> = futures_util::stream::iter(0..n)
        .map(|_| target.connect(backends.hold.addr))
        .buffer_unordered(OPEN_CONCURRENCY)
        .try_collect()
        .await?;
    if !wait_until(MEMORY_WAIT, || backends.hold.active() >= before + n).await {
        bail!(
            "the backend has {} of {n} idle connections after {MEMORY_WAIT:?}",
            backends.hold.active() - before
        );
    }
    Ok(conns)
}

/// Closes `conns` and waits until the backend has seen them all close.
async fn close_idle(backends: &Backends, conns: Vec<Box<dyn Io>>) -> anyhow::Result<()> {
    drop(conns);
    if !wait_until(MEMORY_WAIT, || backends.hold.active() == 0).await {
        bail!(
            "{} idle connections still open on the backend after {MEMORY_WAIT:?}",
            backends.hold.active()
        );
    }
    Ok(())
}

/// The RSS of both processes once freed memory has gone back: the
/// binaries' jemalloc returns freed pages within a second, so this waits
/// two, then takes the least of four samples over the next second.
pub async fn settled_rss(pids: Pids) -> anyhow::Result<(u64, u64)> {
    const DECAY: Duration = Duration::from_secs(2);
    const STEP: Duration = Duration::from_millis(250);
    tokio::time::sleep(DECAY).await;
    let mut least = (u64::MAX, u64::MAX);
    for _ in 0..4 {
        let now = pids.rss()?;
        least = (least.0.min(now.0), least.1.min(now.1));
        tokio::time::sleep(STEP).await;
    }
    Ok(least)
}

/// RSS per idle tunneled connection at `n` open, then 10 rounds of
/// opening and closing `n/10`.
///
/// # Errors
/// A dial fails, or the backend does not see the connections.
pub async fn memory(target: &Target, backends: &Backends, n: usize) -> anyhow::Result<Memory> {
    let pids = target.pids.context("the memory scenario needs a tunnel")?;
    let before = settled_rss(pids).await?;
    let conns = open_idle(target, backends, n).await?;
    let open = settled_rss(pids).await?;
    close_idle(backends, conns).await?;
    let per_conn = |open: u64, before: u64| (open as f64 - before as f64) / n as f64;
    let mut result = Memory {
        per_conn: (per_conn(open.0, before.0), per_conn(open.1, before.1)),
        round1: (0, 0),
        round10: (0, 0),
    };
    for round in 1..=MEMORY_ROUNDS {
        let conns = open_idle(target, backends, (n / MEMORY_ROUNDS).max(1)).await?;
        close_idle(backends, conns).await?;
        if round == 1 {
            result.round1 = settled_rss(pids).await?;
        }
    }
    result.round10 = settled_rss(pids).await?;
    Ok(result)
}

/// One round of the churn scenario: `n` tunnels to the hold-open backend
/// (which echoes), opened `OPEN_CONCURRENCY` at a time, each exchanging
/// 1 KiB, all open at once, then all closed.
async fn churn_round(target: &Target, backends: &Backends, n: usize) -> anyhow::Result<()> {
    let conns: Vec<Box<dyn Io>> = futures_util::stream::iter(0..n)
        .map(|_| async {
            let mut conn = target.connect(backends.hold.addr).await?;
            let sent = [0x5au8; EXCHANGE_BYTES];
            conn.write_all(&sent).await?;
            let mut got = [0u8; EXCHANGE_BYTES];
            conn.read_exact(&mut got).await?;
            anyhow::ensure!(got == sent, "the echo differs");
            Ok(conn)
        })
        .buffer_unordered(OPEN_CONCURRENCY)
        .try_collect()
        .await?;
    close_idle(backends, conns).await
}

/// Server and agent RSS (settled) after each of `rounds` rounds of `n`
/// tunnels open at once, each echoing 1 KiB (issue 14's churn: memory must
/// stop growing after the first rounds).
///
/// # Errors
/// A dial or an exchange fails, or the backend does not see the closes.
pub async fn churn(
    target: &Target,
    backends: &Backends,
    n: usize,
    rounds: usize,
) -> anyhow::Result<Vec<(u64, u64)>> {
    let pids = target.pids.context("the churn scenario needs a tunnel")?;
    let mut rss = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        churn_round(target, backends, n).await?;
        rss.push(settled_rss(pids).await?);
    }
    Ok(rss)
}
