//! The soak's traffic: every exchange is one tunnel carrying a framed,
//! checked request and answer, so that a lost, altered or reordered byte
//! is seen at whichever end receives it.
//!
//! An exchange: the frontend sends a 16-byte header (up length u32, down
//! length u32, seed u64, big-endian) and `up` bytes of the pattern stream
//! of `seed`; the destination ([`super::node`]) checks them, answers
//! `down` bytes of the stream of `seed + 1` and closes. The frontend checks
//! every byte, then waits for a clean end. `tests/go/frontend/soak.go`
//! speaks the same.
//!
//! Each exchange ends as a record ([`Exchange`]): `ok` (every byte, then a
//! clean end), a failed dial, `error` (the tunnel said it failed: a stream
//! or CLOSE_RSP error, a reset), `silent` (a byte that differs, or bytes
//! missing before an end that said nothing was wrong), `cut` (HTTP CONNECT
//! on a Unix socket has no end but the EOF once the 200 is sent) or
//! `stuck` (no end within [`GIVE_UP`]). The judge meets each record with
//! the destination's record of the same seed, which says which agent
//! carried it.

use std::{
    io,
    net::SocketAddr,
    path::{Path, PathBuf},
    process::Stdio,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use soak_judge::{DialKey, Exchange, Frontend, FrontendEnd, samples::CountsSnap};
use tokio::{
    io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader},
    process::{Child, ChildStdin, Command},
    task::JoinSet,
};
use tokio_util::sync::CancellationToken;

use super::{RunClock, watch::lock};

/// A random number (the standard library's per-use random hash keys; no
/// dependency for what only picks seeds and sizes).
fn random() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish()
}

/// A random size in `low..low + span`.
fn size(low: usize, span: usize) -> usize {
    low + (random() % span as u64) as usize
}

/// Every exchange's record, as each ends.
pub type ExchangeLog = Arc<Mutex<Vec<Exchange>>>;

/// Bytes of an exchange's header.
pub const HEADER: usize = 16;
/// Chunk of reads and writes.
pub const CHUNK: usize = 32 * 1024;
/// Request/response exchanges one worker has in flight at most.
const RR_IN_FLIGHT: usize = 16;
/// Longest an exchange may take before its frontend gives up on it
/// (`stuck`): past the judge's bound ([`soak_judge::exchanges::STUCK`]),
/// which calls any exchange longer than that stuck, however it ended.
pub const GIVE_UP: Duration = Duration::from_secs(40);

/// A frontend's cumulative counts (for its rates and bytes; each
/// exchange's end is in its record).
#[derive(Debug, Default)]
pub struct Counts {
    /// Exchanges started.
    pub started: AtomicU64,
    /// Request/response exchanges that carried every byte.
    pub rr_ok: AtomicU64,
    /// Bytes checked on bulk exchanges.
    pub bulk_bytes: AtomicU64,
    /// Bytes checked on all exchanges.
    pub bytes: AtomicU64,
    /// Request/response ticks skipped: the worker had the most exchanges
    /// in flight.
    pub skipped: AtomicU64,
}

impl Counts {
    /// The counts now.
    pub fn snap(&self) -> CountsSnap {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        CountsSnap {
            started: l(&self.started),
            rr_ok: l(&self.rr_ok),
            bulk_bytes: l(&self.bulk_bytes),
            bytes: l(&self.bytes),
            skipped: l(&self.skipped),
        }
    }

    /// Sets every count from a grpc-go frontend's report.
    fn store(&self, json: &serde_json::Value) {
        let set = |a: &AtomicU64, key: &str| {
            if let Some(v) = json[key].as_u64() {
                a.store(v, Ordering::Relaxed);
            }
        };
        set(&self.started, "started");
        set(&self.rr_ok, "rr_ok");
        set(&self.bulk_bytes, "bulk_bytes");
        set(&self.bytes, "bytes");
        set(&self.skipped, "skipped");
    }
}

/// The pattern stream of `tests/src/destination.rs`'s `pattern(len, seed)`,
/// a byte at a time.
pub struct Pattern(u64);

impl Pattern {
    /// The stream of `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    fn next_byte(&mut self) -> u8 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 24) as u8
    }

    /// Writes the stream's next bytes into `buf`.
    pub fn fill(&mut self, buf: &mut [u8]) {
        for b in buf {
            *b = self.next_byte();
        }
    }

    /// Whether `buf` is the stream's next bytes (the stream advances by
    /// all of them either way).
    pub fn check(&mut self, buf: &[u8]) -> bool {
        let mut ok = true;
        for b in buf {
            ok &= self.next_byte() == *b;
        }
        ok
    }
}

/// How our frontends reach their server.
#[derive(Debug, Clone)]
pub enum Front {
    /// gRPC on the Unix socket: our client's single-use tunnel.
    Grpc(PathBuf),
    /// HTTP CONNECT over mTLS TCP, where a broken tunnel is reset.
    Connect(client::dial::Transport),
}

/// How [`run_exchange`] stopped.
enum End {
    /// Every byte, then EOF.
    Done,
    /// EOF before the last byte.
    Early(String),
    /// A byte differs, or bytes came past the answer's last: altered, on
    /// either transport, never a cut or an error a fault excuses.
    Mismatch(&'static str),
    /// Reading or writing failed.
    Io(io::Error),
}

/// One exchange's sizes and pace.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    /// Bytes up.
    pub up: usize,
    /// Bytes down.
    pub down: usize,
    /// Bytes per second of each direction (0: as fast as it goes).
    pub rate: u64,
    /// Whether bytes count as bulk as they move.
    pub bulk: bool,
}

/// Sleeps until `moved` bytes at `rate` are due since `start`.
async fn pace(start: Instant, moved: usize, rate: u64) {
    if rate == 0 {
        return;
    }
    let due = start + Duration::from_secs_f64(moved as f64 / rate as f64);
    tokio::time::sleep_until(due.into()).await;
}

/// Runs one exchange on an established tunnel.
async fn run_exchange(
    io: &mut (impl AsyncRead + AsyncWrite + Unpin),
    seed: u64,
    x: Shape,
    counts: &Counts,
) -> End {
    let mut header = [0u8; HEADER];
    header[0..4].copy_from_slice(&(x.up as u32).to_be_bytes());
    header[4..8].copy_from_slice(&(x.down as u32).to_be_bytes());
    header[8..16].copy_from_slice(&seed.to_be_bytes());
    let moved = |n: usize| {
        counts.bytes.fetch_add(n as u64, Ordering::Relaxed);
        if x.bulk {
            counts.bulk_bytes.fetch_add(n as u64, Ordering::Relaxed);
        }
    };
    if let Err(e) = io.write_all(&header).await {
        return End::Io(e);
    }
    let mut out = Pattern::new(seed);
    let mut buf = vec![0u8; CHUNK];
    let start = Instant::now();
    let mut sent = 0;
    while sent < x.up {
        let n = (x.up - sent).min(CHUNK);
        out.fill(&mut buf[..n]);
        if let Err(e) = io.write_all(&buf[..n]).await {
            return End::Io(e);
        }
        sent += n;
        if x.bulk {
            moved(n);
        }
        pace(start, sent, x.rate).await;
    }
    if let Err(e) = io.flush().await {
        return End::Io(e);
    }
    let mut back = Pattern::new(seed.wrapping_add(1));
    let start = Instant::now();
    let mut got = 0;
    while got < x.down {
        let want = (x.down - got).min(CHUNK);
        let n = match io.read(&mut buf[..want]).await {
            Ok(0) => return End::Early(format!("EOF after {got} of {} bytes down", x.down)),
            Ok(n) => n,
            Err(e) => return End::Io(e),
        };
        if !back.check(&buf[..n]) {
            return End::Mismatch("a byte differs");
        }
        got += n;
        if x.bulk {
            moved(n);
        }
        pace(start, got, x.rate).await;
    }
    match io.read(&mut buf[..1]).await {
        Ok(0) => {
            if !x.bulk {
                moved(x.up + x.down);
            }
            End::Done
        }
        Ok(_) => End::Mismatch("bytes past the answer"),
        Err(e) => End::Io(e),
    }
}

/// Who makes an exchange, through which server, and its clock.
#[derive(Debug, Clone)]
pub struct Maker {
    /// How it reaches its server.
    pub front: Front,
    /// Who it is.
    pub frontend: Frontend,
    /// The server `front` reaches.
    pub server: usize,
    /// The run's clock.
    pub clock: RunClock,
}

/// Dials `addr` through `maker` and runs one exchange of `x`; its record.
pub async fn exchange(maker: &Maker, addr: SocketAddr, x: Shape, counts: &Counts) -> Exchange {
    let seed = random();
    let started = maker.clock.now();
    // How the server's audit log will name the dial: set by the dial as
    // soon as it is known, so that an exchange given up on keeps it.
    let mut dial = None;
    let (end, dial_s, why) = match tokio::time::timeout(
        GIVE_UP,
        dial_and_run(&maker.front, addr, seed, x, counts, &mut dial),
    )
    .await
    {
        Ok((end, dial, why)) => (end, dial, why),
        Err(_) => (
            FrontendEnd::Stuck,
            None,
            Some(format!("no end within {GIVE_UP:?}")),
        ),
    };
    log_end(maker, end, why.as_deref().unwrap_or(""));
    Exchange {
        id: seed,
        frontend: maker.frontend,
        server: maker.server,
        started,
        ended: maker.clock.now(),
        dial_s,
        end,
        why,
        dial,
    }
}

/// The dial id a gRPC exchange of `seed` sends (its `random`): the seed,
/// as Go's frontend sends it too, so that the judge finds the audit
/// record of a dial from the exchange's id alone.
pub fn dial_id(seed: u64) -> i64 {
    seed as i64
}

/// Logs an end worth reading about as it happens: bytes lost silently, a
/// stuck exchange, a CONNECT tunnel cut (errors come in hundreds with a
/// fault; the report lists those no fault explains).
fn log_end(maker: &Maker, end: FrontendEnd, why: &str) {
    let what = match end {
        FrontendEnd::Silent => "LOST SILENTLY",
        FrontendEnd::Stuck => "an exchange stuck",
        FrontendEnd::Cut => "an HTTP CONNECT tunnel ended cleanly with bytes missing",
        _ => return,
    };
    eprintln!(
        "soak: {:.0} s: {what} ({}): {why}",
        maker.clock.now(),
        maker.frontend.name()
    );
}

/// The dial and the exchange: its end, how long the dial took, why.
async fn dial_and_run(
    front: &Front,
    addr: SocketAddr,
    seed: u64,
    x: Shape,
    counts: &Counts,
    key: &mut Option<DialKey>,
) -> (FrontendEnd, Option<f64>, Option<String>) {
    let began = Instant::now();
    let target = addr.to_string();
    let dialed = match front {
        Front::Grpc(path) => async {
            let channel = client::dial::uds_channel(path).await?;
            *key = Some(DialKey::Random(dial_id(seed)));
            client::dial::dial_as(channel, &target, tunnel::ids::DialId(dial_id(seed))).await
        }
        .await
        .map(Dialed::Grpc)
        .map_err(|e| format!("{e}")),
        Front::Connect(transport) => connect(transport, &target, key)
            .await
            .map(Dialed::Connect)
            .map_err(|e| format!("{e}")),
    };
    let dial_s = began.elapsed().as_secs_f64();
    let dialed = match dialed {
        Err(e) => return (FrontendEnd::DialFailed, None, Some(e)),
        Ok(d) => d,
    };
    let (end, why) = match dialed {
        Dialed::Grpc(mut conn) => {
            let end = run_exchange(&mut conn, seed, x, counts).await;
            // Our client turns a failed tunnel into an EOF on the pipe and
            // says why through `finish`.
            match (end, conn.finish().await) {
                (End::Done, _) => (FrontendEnd::Ok, None),
                (End::Mismatch(what), _) => (FrontendEnd::Silent, Some(what.to_owned())),
                (End::Early(_) | End::Io(_), Err(e)) => (FrontendEnd::Error, Some(format!("{e}"))),
                (End::Early(why), Ok(())) => (FrontendEnd::Silent, Some(why)),
                (End::Io(e), Ok(())) => (
                    FrontendEnd::Silent,
                    Some(format!("{e}, yet the tunnel closed cleanly")),
                ),
            }
        }
        // Over TLS a broken tunnel is a reset or an end without
        // close_notify: an error. A clean end with bytes missing is a cut.
        Dialed::Connect(mut io) => match run_exchange(&mut io, seed, x, counts).await {
            End::Done => (FrontendEnd::Ok, None),
            End::Mismatch(what) => (FrontendEnd::Silent, Some(what.to_owned())),
            End::Early(why) => (FrontendEnd::Cut, Some(why)),
            End::Io(e) => (FrontendEnd::Error, Some(format!("{e}"))),
        },
    };
    (end, Some(dial_s), why)
}

/// A CONNECT tunnel to `target` through `transport`; over TCP, `key` set
/// to the frontend socket's address once it is connected (the server's
/// audit log records the dial by it).
async fn connect(
    transport: &client::dial::Transport,
    target: &str,
    key: &mut Option<DialKey>,
) -> Result<Box<dyn client::dial::Io>, client::dial::ClientError> {
    let client::dial::Transport::Tls {
        addr,
        server_name,
        tls,
    } = transport
    else {
        return client::dial::Dialer {
            transport: transport.clone(),
            mode: client::dial::Mode::HttpConnect,
        }
        .dial(target)
        .await;
    };
    let io = client::dial::connect_tls(*addr, server_name, tls).await?;
    if let Ok(local) = io.get_ref().0.local_addr() {
        *key = Some(DialKey::Peer(local.to_string()));
    }
    Ok(Box::new(client::dial::http_connect(io, target).await?))
}

/// A dialed tunnel.
enum Dialed {
    Grpc(client::dial::TunnelConn),
    Connect(Box<dyn client::dial::Io>),
}

/// The load each frontend offers.
#[derive(Debug, Clone, Copy)]
pub struct Load {
    /// Request/response workers.
    pub rr_workers: usize,
    /// One exchange per worker per this.
    pub interval: Duration,
    /// Bulk workers.
    pub bulk_workers: usize,
    /// Bytes/s of each bulk worker.
    pub bulk_rate: u64,
    /// Bytes of each bulk exchange.
    pub bulk_bytes: usize,
}

/// Spawns our frontend's workers on `tasks` until `stop`, their records
/// into `log`.
pub fn spawn_ours(
    tasks: &mut JoinSet<()>,
    maker: &Maker,
    addr: SocketAddr,
    load: Load,
    counts: &Arc<Counts>,
    log: &ExchangeLog,
    stop: &CancellationToken,
) {
    // Open loop: each tick starts an exchange whatever the earlier ones
    // are doing (up to RR_IN_FLIGHT at once per worker), so that exchanges
    // stuck on a faulty agent do not hold back the load on healthy ones.
    for _ in 0..load.rr_workers {
        let (maker, counts, log, stop) = (maker.clone(), counts.clone(), log.clone(), stop.clone());
        tasks.spawn(async move {
            let mut in_flight = JoinSet::new();
            let mut tick = tokio::time::interval(load.interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
            loop {
                tokio::select! {
                    () = stop.cancelled() => break,
                    _ = tick.tick() => {}
                }
                while in_flight.try_join_next().is_some() {}
                if in_flight.len() >= RR_IN_FLIGHT {
                    counts.skipped.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                counts.started.fetch_add(1, Ordering::Relaxed);
                let (maker, counts, log) = (maker.clone(), counts.clone(), log.clone());
                in_flight.spawn(async move {
                    let x = Shape {
                        up: size(1024, 15 * 1024),
                        down: size(1024, 63 * 1024),
                        rate: 0,
                        bulk: false,
                    };
                    let record = exchange(&maker, addr, x, &counts).await;
                    if record.end == FrontendEnd::Ok {
                        counts.rr_ok.fetch_add(1, Ordering::Relaxed);
                    }
                    lock(&log).push(record);
                });
            }
            while in_flight.join_next().await.is_some() {}
        });
    }
    for w in 0..load.bulk_workers {
        let (maker, counts, log, stop) = (maker.clone(), counts.clone(), log.clone(), stop.clone());
        tasks.spawn(async move {
            let mut i = w;
            while !stop.is_cancelled() {
                let (up, down) = if i % 2 == 0 {
                    (load.bulk_bytes, 1024)
                } else {
                    (1024, load.bulk_bytes)
                };
                i += 1;
                counts.started.fetch_add(1, Ordering::Relaxed);
                let x = Shape {
                    up,
                    down,
                    rate: load.bulk_rate,
                    bulk: true,
                };
                let record = exchange(&maker, addr, x, &counts).await;
                let ok = record.end == FrontendEnd::Ok;
                lock(&log).push(record);
                if !ok {
                    tokio::time::sleep(load.interval).await;
                }
            }
        });
    }
}

/// A grpc-go frontend in its soak mode; killed on drop.
pub struct GoSoak {
    /// The child.
    child: Child,
    /// Its stdin; closing it stops the workers.
    stdin: Option<ChildStdin>,
    /// The task that reads its reports.
    reader: tokio::task::JoinHandle<()>,
}

impl GoSoak {
    /// Starts `go_frontend` against `uds` (every tunnel on one connection
    /// when `reuse`), its stderr to `log`.
    ///
    /// # Errors
    /// It cannot start.
    #[allow(clippy::too_many_arguments)]
    pub fn start(
        go_frontend: &Path,
        uds: &Path,
        maker: &Maker,
        addr: SocketAddr,
        load: Load,
        counts: Arc<Counts>,
        records: ExchangeLog,
        log: &Path,
    ) -> anyhow::Result<Self> {
        let stderr = std::fs::File::create(log)?;
        let reuse = maker.frontend == Frontend::GrpcGoReused;
        let mut child = Command::new(go_frontend)
            .arg(format!("-uds={}", uds.display()))
            .args(reuse.then_some("-reuse"))
            // konnectivity-client's dispatch: a CLOSE_RSP it would drop
            // leaves the exchange stuck (issue 50).
            .arg("-kclient")
            .arg("soak")
            .arg(format!("-addr={addr}"))
            .arg(format!("-workers={}", load.rr_workers))
            .arg(format!("-interval={}ms", load.interval.as_millis()))
            .arg(format!("-bulk={}", load.bulk_workers))
            .arg(format!("-rate={}", load.bulk_rate))
            .arg(format!("-bulk-bytes={}", load.bulk_bytes))
            .arg(format!("-stuck={}ms", GIVE_UP.as_millis()))
            .env_remove("GRPC_PROXY")
            .env_remove("grpc_proxy")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .kill_on_drop(true)
            .spawn()?;
        let stdout = child
            .stdout
            .take()
            .ok_or_else(|| anyhow::anyhow!("no stdout"))?;
        let maker = maker.clone();
        let reader = tokio::spawn(async move {
            let mut lines = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                let Ok(json) = serde_json::from_str::<serde_json::Value>(&line) else {
                    continue;
                };
                if json.get("x").is_some() {
                    if let Some(record) = go_record(&maker, &json) {
                        lock(&records).push(record);
                    }
                } else {
                    counts.store(&json);
                }
            }
        });
        Ok(Self {
            stdin: child.stdin.take(),
            child,
            reader,
        })
    }

    /// Closes its stdin and waits (up to `limit`) for its last report and
    /// its exit; whether it exited 0.
    pub async fn finish(mut self, limit: Duration) -> bool {
        drop(self.stdin.take());
        let waited = tokio::time::timeout(limit, async {
            let _ = (&mut self.reader).await;
            self.child.wait().await
        })
        .await;
        matches!(waited, Ok(Ok(status)) if status.success())
    }
}

/// The record of one exchange a grpc-go frontend reported (its times in
/// Unix nanoseconds).
fn go_record(maker: &Maker, json: &serde_json::Value) -> Option<Exchange> {
    let at = |key: &str| json[key].as_i64().map(|ns| maker.clock.from_unix_nanos(ns));
    let end = match json["end"].as_str()? {
        "ok" => FrontendEnd::Ok,
        "dial" => FrontendEnd::DialFailed,
        "error" => FrontendEnd::Error,
        "silent" => FrontendEnd::Silent,
        "stuck" => FrontendEnd::Stuck,
        _ => return None,
    };
    let why = json["why"].as_str().filter(|w| !w.is_empty());
    log_end(maker, end, why.unwrap_or(""));
    Some(Exchange {
        id: json["id"].as_u64()?,
        frontend: maker.frontend,
        server: maker.server,
        started: at("start_ns")?,
        ended: at("end_ns")?,
        dial_s: json["dial_ns"]
            .as_i64()
            .filter(|ns| *ns >= 0)
            .map(|ns| ns as f64 / 1e9),
        end,
        why: why.map(str::to_owned),
        dial: Some(DialKey::Random(dial_id(json["id"].as_u64()?))),
    })
}
