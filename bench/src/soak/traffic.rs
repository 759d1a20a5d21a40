//! The soak's traffic: every exchange is one tunnel carrying a framed,
//! checked request and answer, so that a lost, altered or reordered byte
//! is seen at whichever end receives it.
//!
//! An exchange: the frontend sends a 16-byte header (up length u32, down
//! length u32, seed u64, big-endian) and `up` bytes of the pattern stream
//! of `seed`; the [`Destination`] checks them, answers `down` bytes of the
//! stream of `seed + 1` and closes. The frontend checks every byte, then
//! waits for a clean end. `tests/go/frontend/soak.go` speaks the same.
//!
//! The frontend classifies each exchange: `ok` (every byte, then a clean
//! end), `error` (the tunnel said it failed: a refused dial, a stream or
//! CLOSE_RSP error, a reset) or `silent` (a byte that differs, or bytes
//! missing before an end that said nothing was wrong). HTTP CONNECT on a
//! Unix socket has no end but the EOF once the 200 is sent, so a CONNECT
//! tunnel ended by an EOF with bytes missing is `cut`: the orchestrator
//! accepts it only during a fault that killed its agent or server. The destination
//! does the same from its side: `complete`, `reset` (a read or write
//! error), `truncated` (a FIN before the request's last byte) or
//! `corrupt`.

use std::{
    io,
    net::SocketAddr,
    path::{Path, PathBuf},
    process::Stdio,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use serde::Serialize;
use tokio::{
    io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader},
    net::{TcpListener, TcpStream, UnixStream},
    process::{Child, ChildStdin, Command},
    task::JoinSet,
};
use tokio_util::sync::CancellationToken;

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

/// When the soak started (for the times of [`CUTS`]).
pub static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
/// When each HTTP CONNECT tunnel that ended with an EOF, bytes missing,
/// ended (s since [`START`]).
pub static CUTS: std::sync::Mutex<Vec<f64>> = std::sync::Mutex::new(Vec::new());

/// Bytes of an exchange's header.
const HEADER: usize = 16;
/// Chunk of reads and writes.
const CHUNK: usize = 32 * 1024;
/// Longest a dial may take before the worker gives up on it (far past
/// every timeout on the way; a dial that reaches it is counted late).
const DIAL_CAP: Duration = Duration::from_secs(60);
/// Request/response exchanges one worker has in flight at most.
const RR_IN_FLIGHT: usize = 16;
/// Longest an exchange may sit without progress before the worker gives
/// up (counted as a frontend-side error, `stuck`).
const STUCK: Duration = Duration::from_secs(120);

/// The frontends of the soak.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Kind {
    /// Our client (konnectivity-client), a single-use gRPC tunnel each.
    GrpcOurs,
    /// grpc-go, a gRPC connection per tunnel (kube-apiserver's single-use tunnel).
    GrpcGoSingle,
    /// grpc-go, every tunnel a stream of one connection (the reusable tunnel).
    GrpcGoReused,
    /// Our client's HTTP CONNECT.
    ConnectOurs,
}

impl Kind {
    /// All of them, in table order.
    pub const ALL: [Self; 4] = [
        Self::GrpcOurs,
        Self::GrpcGoSingle,
        Self::GrpcGoReused,
        Self::ConnectOurs,
    ];

    /// Its name in the tables.
    pub fn name(self) -> &'static str {
        match self {
            Self::GrpcOurs => "grpc, ours",
            Self::GrpcGoSingle => "grpc-go single-use",
            Self::GrpcGoReused => "grpc-go reused",
            Self::ConnectOurs => "http-connect, ours",
        }
    }

    /// The server it goes through (0: gRPC, 1: HTTP CONNECT).
    pub fn server(self) -> usize {
        match self {
            Self::ConnectOurs => 1,
            _ => 0,
        }
    }
}

/// A frontend's cumulative counts.
#[derive(Debug, Default)]
pub struct Counts {
    /// Exchanges started.
    pub started: AtomicU64,
    /// Exchanges that carried every byte.
    pub ok: AtomicU64,
    /// Exchanges the tunnel ended with an error.
    pub errors: AtomicU64,
    /// Exchanges that lost or altered bytes without an error.
    pub silent: AtomicU64,
    /// HTTP CONNECT exchanges that ended with an EOF, bytes missing: on a
    /// Unix socket CONNECT has no other end to tell of a failure.
    pub cut: AtomicU64,
    /// Request/response exchanges that carried every byte.
    pub rr_ok: AtomicU64,
    /// Bytes checked on bulk exchanges.
    pub bulk_bytes: AtomicU64,
    /// Bytes checked on all exchanges.
    pub bytes: AtomicU64,
    /// Dials that took longer than the dial timeout.
    pub late: AtomicU64,
    /// Request/response ticks skipped: the worker had the most exchanges
    /// in flight.
    pub skipped: AtomicU64,
    /// The slowest dial so far, µs.
    pub dial_max_us: AtomicU64,
}

/// [`Counts`] at one moment.
#[derive(Debug, Default, Clone, Copy, Serialize)]
pub struct CountsSnap {
    /// See [`Counts::started`].
    pub started: u64,
    /// See [`Counts::ok`].
    pub ok: u64,
    /// See [`Counts::errors`].
    pub errors: u64,
    /// See [`Counts::silent`].
    pub silent: u64,
    /// See [`Counts::cut`].
    pub cut: u64,
    /// See [`Counts::rr_ok`].
    pub rr_ok: u64,
    /// See [`Counts::bulk_bytes`].
    pub bulk_bytes: u64,
    /// See [`Counts::bytes`].
    pub bytes: u64,
    /// See [`Counts::late`].
    pub late: u64,
    /// See [`Counts::skipped`].
    pub skipped: u64,
    /// See [`Counts::dial_max_us`].
    pub dial_max_us: u64,
}

impl Counts {
    /// The counts now.
    pub fn snap(&self) -> CountsSnap {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        CountsSnap {
            started: l(&self.started),
            ok: l(&self.ok),
            errors: l(&self.errors),
            silent: l(&self.silent),
            cut: l(&self.cut),
            rr_ok: l(&self.rr_ok),
            bulk_bytes: l(&self.bulk_bytes),
            bytes: l(&self.bytes),
            late: l(&self.late),
            skipped: l(&self.skipped),
            dial_max_us: l(&self.dial_max_us),
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
        set(&self.ok, "ok");
        set(&self.errors, "errors");
        set(&self.silent, "silent");
        set(&self.rr_ok, "rr_ok");
        set(&self.bulk_bytes, "bulk_bytes");
        set(&self.bytes, "bytes");
        set(&self.late, "late_dials");
        set(&self.skipped, "skipped");
        set(&self.dial_max_us, "dial_max_us");
    }
}

/// The pattern stream of `tests/src/destination.rs`'s `pattern(len, seed)`,
/// a byte at a time.
struct Pattern(u64);

impl Pattern {
    fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    fn next_byte(&mut self) -> u8 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 24) as u8
    }

    fn fill(&mut self, buf: &mut [u8]) {
        for b in buf {
            *b = self.next_byte();
        }
    }

    /// Whether `buf` is the stream's next bytes (the stream advances by
    /// all of them either way).
    fn check(&mut self, buf: &[u8]) -> bool {
        let mut ok = true;
        for b in buf {
            ok &= self.next_byte() == *b;
        }
        ok
    }
}

/// The destination's cumulative counts.
#[derive(Debug, Default)]
pub struct DestCounts {
    /// Connections accepted.
    pub accepted: AtomicU64,
    /// Connections open now.
    pub open: AtomicU64,
    /// Requests checked whole and answered.
    pub complete: AtomicU64,
    /// Of them, those that came through the namespaced agent (from
    /// [`super::system::NS_NODE_IP`]); the rest came through the others.
    pub complete_ns: AtomicU64,
    /// Connections that failed with a read or write error (a reset).
    pub reset: AtomicU64,
    /// Connections that ended cleanly before the request's last byte.
    pub truncated: AtomicU64,
    /// Requests with a byte that differs.
    pub corrupt: AtomicU64,
    /// When each truncated or altered request ended (s since the start),
    /// and whether it was altered.
    pub silent_at: std::sync::Mutex<Vec<(f64, bool)>>,
}

/// [`DestCounts`] at one moment.
#[derive(Debug, Default, Clone, Copy, Serialize)]
pub struct DestSnap {
    /// See [`DestCounts::accepted`].
    pub accepted: u64,
    /// See [`DestCounts::open`].
    pub open: u64,
    /// See [`DestCounts::complete`].
    pub complete: u64,
    /// See [`DestCounts::complete_ns`].
    pub complete_ns: u64,
    /// See [`DestCounts::reset`].
    pub reset: u64,
    /// See [`DestCounts::truncated`].
    pub truncated: u64,
    /// See [`DestCounts::corrupt`].
    pub corrupt: u64,
}

impl DestCounts {
    /// The counts now.
    pub fn snap(&self) -> DestSnap {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        DestSnap {
            accepted: l(&self.accepted),
            open: l(&self.open),
            complete: l(&self.complete),
            complete_ns: l(&self.complete_ns),
            reset: l(&self.reset),
            truncated: l(&self.truncated),
            corrupt: l(&self.corrupt),
        }
    }
}

/// The node-side end of every exchange, on `ip`; its tasks end on drop.
pub struct Destination {
    /// Where it listens.
    pub addr: SocketAddr,
    /// Its counts.
    pub counts: Arc<DestCounts>,
    /// The accept loop and connections.
    _tasks: JoinSet<()>,
}

impl Destination {
    /// Starts it.
    ///
    /// # Errors
    /// It cannot bind.
    pub async fn start(ip: std::net::Ipv4Addr, since: Instant) -> anyhow::Result<Self> {
        let listener = TcpListener::bind((ip, 0)).await?;
        let addr = listener.local_addr()?;
        let counts = Arc::new(DestCounts::default());
        let mut tasks = JoinSet::new();
        let c = counts.clone();
        tasks.spawn(async move {
            let mut conns = JoinSet::new();
            loop {
                let Ok((stream, peer)) = listener.accept().await else {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                };
                let _ = stream.set_nodelay(true);
                c.accepted.fetch_add(1, Ordering::Relaxed);
                c.open.fetch_add(1, Ordering::Relaxed);
                let c = c.clone();
                conns.spawn(async move {
                    let end = answer(stream).await;
                    if matches!(end, DestEnd::Truncated | DestEnd::Corrupt) {
                        let at = since.elapsed().as_secs_f64();
                        eprintln!("soak: {at:.0} s: a request reached the destination truncated or altered");
                        c.silent_at
                            .lock()
                            .unwrap_or_else(std::sync::PoisonError::into_inner)
                            .push((at, matches!(end, DestEnd::Corrupt)));
                    }
                    if matches!(end, DestEnd::Complete)
                        && peer.ip() == std::net::IpAddr::from(super::system::NS_NODE_IP)
                    {
                        c.complete_ns.fetch_add(1, Ordering::Relaxed);
                    }
                    match end {
                        DestEnd::Complete => &c.complete,
                        DestEnd::Reset => &c.reset,
                        DestEnd::Truncated => &c.truncated,
                        DestEnd::Corrupt => &c.corrupt,
                    }
                    .fetch_add(1, Ordering::Relaxed);
                    c.open.fetch_sub(1, Ordering::Relaxed);
                });
                while conns.try_join_next().is_some() {}
            }
        });
        Ok(Self {
            addr,
            counts,
            _tasks: tasks,
        })
    }
}

/// How a destination connection ended.
enum DestEnd {
    Complete,
    Reset,
    Truncated,
    Corrupt,
}

/// Reads `buf` full; `Ok(false)` on a clean EOF first.
async fn read_full(io: &mut (impl AsyncRead + Unpin), buf: &mut [u8]) -> io::Result<bool> {
    let mut got = 0;
    while got < buf.len() {
        let n = io.read(&mut buf[got..]).await?;
        if n == 0 {
            return Ok(false);
        }
        got += n;
    }
    Ok(true)
}

/// Serves one exchange at the destination.
async fn answer(mut stream: TcpStream) -> DestEnd {
    let mut header = [0u8; HEADER];
    match tokio::time::timeout(STUCK, read_full(&mut stream, &mut header)).await {
        Ok(Ok(true)) => {}
        Ok(Ok(false)) => return DestEnd::Truncated,
        Ok(Err(_)) | Err(_) => return DestEnd::Reset,
    }
    let (up, down, seed) = parse_header(&header);
    let mut pattern = Pattern::new(seed);
    let mut buf = vec![0u8; CHUNK];
    let mut left = up;
    while left > 0 {
        let want = left.min(CHUNK);
        let n = match tokio::time::timeout(STUCK, stream.read(&mut buf[..want])).await {
            Ok(Ok(0)) => return DestEnd::Truncated,
            Ok(Ok(n)) => n,
            Ok(Err(_)) | Err(_) => return DestEnd::Reset,
        };
        if !pattern.check(&buf[..n]) {
            return DestEnd::Corrupt;
        }
        left -= n;
    }
    let mut pattern = Pattern::new(seed.wrapping_add(1));
    let mut left = down;
    while left > 0 {
        let n = left.min(CHUNK);
        pattern.fill(&mut buf[..n]);
        match tokio::time::timeout(STUCK, stream.write_all(&buf[..n])).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) | Err(_) => return DestEnd::Reset,
        }
        left -= n;
    }
    if stream.shutdown().await.is_err() {
        return DestEnd::Reset;
    }
    // The frontend closes once it has read everything.
    let _ = tokio::time::timeout(STUCK, async {
        while matches!(stream.read(&mut buf).await, Ok(n) if n > 0) {}
    })
    .await;
    DestEnd::Complete
}

fn parse_header(h: &[u8; HEADER]) -> (usize, usize, u64) {
    let u32_at = |i: usize| u32::from_be_bytes([h[i], h[i + 1], h[i + 2], h[i + 3]]) as usize;
    let mut seed = [0u8; 8];
    seed.copy_from_slice(&h[8..16]);
    (u32_at(0), u32_at(4), u64::from_be_bytes(seed))
}

/// How our frontends reach their server.
#[derive(Debug, Clone)]
pub enum Front {
    /// gRPC on the Unix socket: our client's single-use tunnel.
    Grpc(PathBuf),
    /// HTTP CONNECT on the Unix socket.
    Connect(PathBuf),
}

/// How one exchange ended at the frontend.
#[derive(Debug)]
pub enum Outcome {
    /// Every byte, then a clean end.
    Ok,
    /// The tunnel told of an error.
    Error(String),
    /// Bytes lost or altered with no error.
    Silent(String),
    /// An HTTP CONNECT tunnel that ended with an EOF, bytes missing.
    Cut(String),
}

/// How [`run_exchange`] stopped.
enum End {
    /// Every byte, then EOF.
    Done,
    /// EOF before the last byte (or a byte past the last).
    Early(String),
    /// A byte differs.
    Mismatch,
    /// Reading or writing failed.
    Io(io::Error),
}

/// One exchange's parameters.
#[derive(Debug, Clone, Copy)]
pub struct Exchange {
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
    x: Exchange,
    counts: &Counts,
) -> End {
    let seed = random();
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
            return End::Mismatch;
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
        Ok(_) => End::Early("bytes past the answer".to_owned()),
        Err(e) => End::Io(e),
    }
}

/// Dials `addr` through `front` and runs one exchange; the outcome.
pub async fn exchange(
    front: &Front,
    addr: SocketAddr,
    x: Exchange,
    counts: &Counts,
    dial_limit: Duration,
) -> Outcome {
    let began = Instant::now();
    let target = addr.to_string();
    let dialed = match front {
        Front::Grpc(path) => tokio::time::timeout(DIAL_CAP, async {
            let channel = client::dial::uds_channel(path).await?;
            client::dial::dial(channel, &target).await
        })
        .await
        .map(|r| r.map(Dialed::Grpc).map_err(|e| format!("{e}"))),
        Front::Connect(path) => tokio::time::timeout(DIAL_CAP, async {
            let io = UnixStream::connect(path)
                .await
                .map_err(|e| format!("connecting to {}: {e}", path.display()))?;
            client::dial::http_connect(io, &target)
                .await
                .map_err(|e| format!("{e}"))
        })
        .await
        .map(|r| r.map(Dialed::Connect)),
    };
    let took = began.elapsed();
    counts
        .dial_max_us
        .fetch_max(took.as_micros() as u64, Ordering::Relaxed);
    if took > dial_limit {
        counts.late.fetch_add(1, Ordering::Relaxed);
    }
    let dialed = match dialed {
        Err(_) => return Outcome::Error(format!("the dial took more than {DIAL_CAP:?}")),
        Ok(Err(e)) => return Outcome::Error(e),
        Ok(Ok(d)) => d,
    };
    match dialed {
        Dialed::Grpc(mut conn) => {
            let Ok(end) = tokio::time::timeout(STUCK, run_exchange(&mut conn, x, counts)).await
            else {
                return Outcome::Error("stuck: no end within 120 s".to_owned());
            };
            // Our client turns a failed tunnel into an EOF on the pipe and
            // says why through `finish`.
            let finished = tokio::time::timeout(STUCK, conn.finish()).await;
            match (end, finished) {
                (End::Done, _) => Outcome::Ok,
                (End::Mismatch, _) => Outcome::Silent("a byte differs".to_owned()),
                (End::Early(_) | End::Io(_), Ok(Err(e))) => Outcome::Error(format!("{e}")),
                (End::Early(why), Ok(Ok(()))) => Outcome::Silent(why),
                (End::Io(e), Ok(Ok(()))) => {
                    Outcome::Silent(format!("{e}, yet the tunnel closed cleanly"))
                }
                (_, Err(_)) => Outcome::Error("the tunnel did not end within 120 s".to_owned()),
            }
        }
        Dialed::Connect(mut io) => {
            match tokio::time::timeout(STUCK, run_exchange(&mut io, x, counts)).await {
                Err(_) => Outcome::Error("stuck: no end within 120 s".to_owned()),
                Ok(End::Done) => Outcome::Ok,
                Ok(End::Mismatch) => Outcome::Silent("a byte differs".to_owned()),
                Ok(End::Early(why)) => Outcome::Cut(why),
                Ok(End::Io(e)) => Outcome::Error(format!("{e}")),
            }
        }
    }
}

/// A dialed tunnel.
enum Dialed {
    Grpc(client::dial::TunnelConn),
    Connect(UnixStream),
}

/// Records `outcome` in `counts`; a silent loss is also printed.
fn record(kind: Kind, counts: &Counts, outcome: &Outcome) {
    match outcome {
        Outcome::Ok => counts.ok.fetch_add(1, Ordering::Relaxed),
        Outcome::Error(_) => counts.errors.fetch_add(1, Ordering::Relaxed),
        Outcome::Silent(why) => {
            eprintln!("soak: LOST SILENTLY ({}): {why}", kind.name());
            counts.silent.fetch_add(1, Ordering::Relaxed)
        }
        Outcome::Cut(why) => {
            let at = START.get().map_or(0.0, |s| s.elapsed().as_secs_f64());
            eprintln!("soak: {at:.0} s: an HTTP CONNECT tunnel ended with an EOF: {why}");
            CUTS.lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .push(at);
            counts.cut.fetch_add(1, Ordering::Relaxed)
        }
    };
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
    /// A dial slower than this is late.
    pub dial_limit: Duration,
}

/// Spawns our frontend's workers on `tasks` until `stop`.
pub fn spawn_ours(
    tasks: &mut JoinSet<()>,
    kind: Kind,
    front: Front,
    addr: SocketAddr,
    load: Load,
    counts: Arc<Counts>,
    stop: CancellationToken,
) {
    // Open loop: each tick starts an exchange whatever the earlier ones
    // are doing (up to RR_IN_FLIGHT at once per worker), so that exchanges
    // stuck on a faulty agent do not hold back the load on healthy ones.
    for _ in 0..load.rr_workers {
        let (front, counts, stop) = (front.clone(), counts.clone(), stop.clone());
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
                let (front, counts) = (front.clone(), counts.clone());
                in_flight.spawn(async move {
                    let x = Exchange {
                        up: size(1024, 15 * 1024),
                        down: size(1024, 63 * 1024),
                        rate: 0,
                        bulk: false,
                    };
                    let outcome = exchange(&front, addr, x, &counts, load.dial_limit).await;
                    if matches!(outcome, Outcome::Ok) {
                        counts.rr_ok.fetch_add(1, Ordering::Relaxed);
                    }
                    record(kind, &counts, &outcome);
                });
            }
            while in_flight.join_next().await.is_some() {}
        });
    }
    for w in 0..load.bulk_workers {
        let (front, counts, stop) = (front.clone(), counts.clone(), stop.clone());
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
                let x = Exchange {
                    up,
                    down,
                    rate: load.bulk_rate,
                    bulk: true,
                };
                let outcome = exchange(&front, addr, x, &counts, load.dial_limit).await;
                record(kind, &counts, &outcome);
                if !matches!(outcome, Outcome::Ok) {
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
    pub fn start(
        go_frontend: &Path,
        uds: &Path,
        reuse: bool,
        addr: SocketAddr,
        load: Load,
        counts: Arc<Counts>,
        log: &Path,
    ) -> anyhow::Result<Self> {
        let stderr = std::fs::File::create(log)?;
        let mut child = Command::new(go_frontend)
            .arg(format!("-uds={}", uds.display()))
            .args(reuse.then_some("-reuse"))
            .arg("soak")
            .arg(format!("-addr={addr}"))
            .arg(format!("-workers={}", load.rr_workers))
            .arg(format!("-interval={}ms", load.interval.as_millis()))
            .arg(format!("-bulk={}", load.bulk_workers))
            .arg(format!("-rate={}", load.bulk_rate))
            .arg(format!("-bulk-bytes={}", load.bulk_bytes))
            .arg(format!("-dial-limit={}ms", load.dial_limit.as_millis()))
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
        let reader = tokio::spawn(async move {
            let mut lines = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                if let Ok(json) = serde_json::from_str::<serde_json::Value>(&line) {
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
