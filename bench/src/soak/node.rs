//! The node side: the checked destination every exchange ends at, the
//! endless source the stalled frontends download from, the destination
//! that never reads the stalled uploads. Each records every connection it
//! accepts ([`NodeConn`]): its source address says which agent carried it
//! (each agent slot dials from a network namespace of its own, so the
//! kernel says which, not the agent), and for the checked destination the
//! exchange's id from its header and how it ended.
//!
//! The checked destination's end of an exchange: a 16-byte header (up
//! length u32, down length u32, seed u64, big-endian), `up` bytes of the
//! pattern stream of `seed`, checked; then `down` bytes of the stream of
//! `seed + 1`, a FIN, and the frontend's end awaited.

use std::{
    collections::HashMap,
    net::{IpAddr, SocketAddr},
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use soak_judge::{Carrier, Listener, NodeConn, NodeEnd, samples::DestSnap};
use tokio::{
    io::{AsyncRead, AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
    task::JoinSet,
};

use super::{
    RunClock,
    system::slot_of,
    traffic::{CHUNK, HEADER, Pattern},
    watch::lock,
};

/// How long the destination waits for a byte (or room to write one)
/// before it calls the exchange stuck: past the judge's bound on an
/// exchange ([`soak_judge::exchanges::STUCK`]), so that the judge, not
/// this timeout, decides.
pub const NODE_STUCK: Duration = Duration::from_secs(40);

/// What every listener accepted, and the checked destination's counts.
pub struct NodeLog {
    /// Every connection, once it ended (the source's and the stall's at
    /// their accept).
    conns: Mutex<Vec<NodeConn>>,
    /// The checked connections still open, by a serial number.
    open_conns: Mutex<HashMap<u64, NodeConn>>,
    /// The next serial number.
    serial: AtomicU64,
    /// Connections accepted, every listener.
    accepted: AtomicU64,
    /// Checked connections open now.
    open: AtomicU64,
    /// Requests checked whole and answered.
    complete: AtomicU64,
    /// Of them, per agent slot.
    complete_by_slot: Vec<AtomicU64>,
    /// Which agent slot an address is, if any.
    agents: usize,
    /// The run's clock.
    clock: RunClock,
}

impl NodeLog {
    /// An empty log for `agents` slots.
    pub fn new(agents: usize, clock: RunClock) -> Arc<Self> {
        Arc::new(Self {
            conns: Mutex::new(Vec::new()),
            open_conns: Mutex::new(HashMap::new()),
            serial: AtomicU64::new(0),
            accepted: AtomicU64::new(0),
            open: AtomicU64::new(0),
            complete: AtomicU64::new(0),
            complete_by_slot: (0..agents).map(|_| AtomicU64::new(0)).collect(),
            agents,
            clock,
        })
    }

    /// Who carried a connection from `ip`.
    fn carrier(&self, ip: IpAddr) -> Carrier {
        match ip {
            IpAddr::V4(v4) if v4 == super::system::DEST_IP => Carrier::Probe,
            IpAddr::V4(v4) => match slot_of(v4) {
                Some(slot) if slot < self.agents => Carrier::Slot(slot),
                _ => Carrier::Unknown,
            },
            IpAddr::V6(_) => Carrier::Unknown,
        }
    }

    /// The counts now.
    pub fn snap(&self) -> DestSnap {
        DestSnap {
            accepted: self.accepted.load(Ordering::Relaxed),
            open: self.open.load(Ordering::Relaxed),
            complete: self.complete.load(Ordering::Relaxed),
            complete_by_slot: self
                .complete_by_slot
                .iter()
                .map(|c| c.load(Ordering::Relaxed))
                .collect(),
        }
    }

    /// Accepted so far by `listener`.
    pub fn accepted_by(&self, listener: Listener) -> usize {
        lock(&self.conns)
            .iter()
            .filter(|c| c.listener == listener)
            .count()
    }

    /// Every record so far, and those still open as [`NodeEnd::Open`]
    /// (ending now).
    pub fn take(&self) -> Vec<NodeConn> {
        let now = self.clock.now();
        let mut all = std::mem::take(&mut *lock(&self.conns));
        all.extend(lock(&self.open_conns).drain().map(|(_, mut c)| {
            c.ended = now;
            c
        }));
        all.sort_by(|a, b| a.accepted.total_cmp(&b.accepted));
        all
    }

    fn push(&self, conn: NodeConn) {
        lock(&self.conns).push(conn);
    }
}

/// A listener on `ip` that hands each accepted connection, with who
/// carried it and when, to `serve`; its tasks end on drop.
pub struct NodeListener {
    /// Where it listens.
    pub addr: SocketAddr,
    /// The accept loop and its connections.
    _tasks: JoinSet<()>,
}

impl NodeListener {
    /// Binds `ip:0` (with `rcvbuf`, if given) and serves.
    fn start<F, Fut>(
        ip: std::net::Ipv4Addr,
        rcvbuf: Option<usize>,
        log: Arc<NodeLog>,
        serve: F,
    ) -> anyhow::Result<Self>
    where
        F: Fn(TcpStream, Carrier, f64, Arc<NodeLog>) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let socket = socket2::Socket::new(
            socket2::Domain::IPV4,
            socket2::Type::STREAM,
            Some(socket2::Protocol::TCP),
        )?;
        if let Some(size) = rcvbuf {
            // Inherited by accepted sockets; small, so little stays in the
            // kernel of a stalled upload.
            socket.set_recv_buffer_size(size)?;
        }
        socket.set_reuse_address(true)?;
        socket.bind(&SocketAddr::from((ip, 0)).into())?;
        socket.listen(4096)?;
        socket.set_nonblocking(true)?;
        let listener = TcpListener::from_std(socket.into())?;
        let addr = listener.local_addr()?;
        let mut tasks = JoinSet::new();
        tasks.spawn(async move {
            let mut conns = JoinSet::new();
            loop {
                let Ok((stream, peer)) = listener.accept().await else {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                };
                let _ = stream.set_nodelay(true);
                let at = log.clock.now();
                log.accepted.fetch_add(1, Ordering::Relaxed);
                let carrier = log.carrier(peer.ip());
                conns.spawn(serve(stream, carrier, at, log.clone()));
                while conns.try_join_next().is_some() {}
            }
        });
        Ok(Self {
            addr,
            _tasks: tasks,
        })
    }
}

/// The checked destination.
///
/// # Errors
/// It cannot bind.
pub fn destination(ip: std::net::Ipv4Addr, log: Arc<NodeLog>) -> anyhow::Result<NodeListener> {
    NodeListener::start(ip, None, log, |stream, carrier, at, log| async move {
        log.open.fetch_add(1, Ordering::Relaxed);
        let serial = log.serial.fetch_add(1, Ordering::Relaxed);
        lock(&log.open_conns).insert(
            serial,
            NodeConn {
                id: None,
                listener: Listener::Exchanges,
                carrier,
                accepted: at,
                ended: at,
                end: NodeEnd::Open,
            },
        );
        let (id, end) = answer(stream).await;
        lock(&log.open_conns).remove(&serial);
        if end == NodeEnd::Complete {
            log.complete.fetch_add(1, Ordering::Relaxed);
            if let Carrier::Slot(n) = carrier
                && let Some(c) = log.complete_by_slot.get(n)
            {
                c.fetch_add(1, Ordering::Relaxed);
            }
        }
        if matches!(end, NodeEnd::Truncated | NodeEnd::Corrupt | NodeEnd::Stuck) {
            eprintln!(
                "soak: {:.0} s: a request from {} reached the destination {end:?}",
                log.clock.now(),
                carrier.describe()
            );
        }
        log.push(NodeConn {
            id,
            listener: Listener::Exchanges,
            carrier,
            accepted: at,
            ended: log.clock.now(),
            end,
        });
        log.open.fetch_sub(1, Ordering::Relaxed);
    })
}

/// The endless source: writes the pattern until the reader goes.
///
/// # Errors
/// It cannot bind.
pub fn source(ip: std::net::Ipv4Addr, log: Arc<NodeLog>) -> anyhow::Result<NodeListener> {
    NodeListener::start(ip, None, log, |mut stream, carrier, at, log| async move {
        log.push(unjudged(Listener::Source, carrier, at));
        let mut pattern = Pattern::new(7);
        let mut buf = vec![0u8; CHUNK];
        loop {
            pattern.fill(&mut buf);
            if stream.write_all(&buf).await.is_err() {
                return;
            }
        }
    })
}

/// The destination that never reads: holds each connection until
/// [`StallListener::reset_all`].
pub struct StallListener {
    /// The listener.
    pub listener: NodeListener,
    /// The connections held.
    held: Arc<Mutex<Vec<TcpStream>>>,
}

impl StallListener {
    /// Starts it on `ip`.
    ///
    /// # Errors
    /// It cannot bind.
    pub fn start(ip: std::net::Ipv4Addr, log: Arc<NodeLog>) -> anyhow::Result<Self> {
        let held: Arc<Mutex<Vec<TcpStream>>> = Arc::default();
        let keep = held.clone();
        let listener =
            NodeListener::start(ip, Some(4096), log, move |stream, carrier, at, log| {
                let keep = keep.clone();
                async move {
                    log.push(unjudged(Listener::Stall, carrier, at));
                    lock(&keep).push(stream);
                }
            })?;
        Ok(Self { listener, held })
    }

    /// Connections held now.
    pub fn held(&self) -> usize {
        lock(&self.held).len()
    }

    /// Closes every held connection with a reset.
    pub fn reset_all(&self) {
        for stream in lock(&self.held).drain(..) {
            if let Ok(std) = stream.into_std() {
                let _ = socket2::SockRef::from(&std).set_linger(Some(Duration::ZERO));
            }
        }
    }
}

/// The record of a source's or the stall's connection (their ends are
/// not judged).
fn unjudged(listener: Listener, carrier: Carrier, at: f64) -> NodeConn {
    NodeConn {
        id: None,
        listener,
        carrier,
        accepted: at,
        ended: at,
        end: NodeEnd::Unused,
    }
}

/// Reads `buf` full within [`NODE_STUCK`] per read; how many bytes came
/// before an EOF, or the end it makes.
async fn read_full(io: &mut (impl AsyncRead + Unpin), buf: &mut [u8]) -> Result<usize, NodeEnd> {
    let mut got = 0;
    while got < buf.len() {
        match tokio::time::timeout(NODE_STUCK, io.read(&mut buf[got..])).await {
            Ok(Ok(0)) => return Ok(got),
            Ok(Ok(n)) => got += n,
            Ok(Err(_)) => return Err(NodeEnd::Reset),
            Err(_) => return Err(NodeEnd::Stuck),
        }
    }
    Ok(got)
}

/// Serves one exchange; its id, once read, and how it ended.
async fn answer(mut stream: TcpStream) -> (Option<u64>, NodeEnd) {
    let mut header = [0u8; HEADER];
    match read_full(&mut stream, &mut header).await {
        Ok(HEADER) => {}
        Ok(0) => return (None, NodeEnd::Unused),
        Ok(_) => return (None, NodeEnd::Truncated),
        Err(end) => return (None, end),
    }
    let (up, down, seed) = parse_header(&header);
    (Some(seed), exchange(&mut stream, up, down, seed).await)
}

/// The rest of an exchange after its header.
async fn exchange(stream: &mut TcpStream, up: usize, down: usize, seed: u64) -> NodeEnd {
    let mut pattern = Pattern::new(seed);
    let mut buf = vec![0u8; CHUNK];
    let mut left = up;
    while left > 0 {
        let want = left.min(CHUNK);
        match read_full(stream, &mut buf[..want]).await {
            Ok(n) if n == want => {}
            Ok(_) => return NodeEnd::Truncated,
            Err(end) => return end,
        }
        if !pattern.check(&buf[..want]) {
            return NodeEnd::Corrupt;
        }
        left -= want;
    }
    let mut pattern = Pattern::new(seed.wrapping_add(1));
    let mut left = down;
    while left > 0 {
        let n = left.min(CHUNK);
        pattern.fill(&mut buf[..n]);
        match tokio::time::timeout(NODE_STUCK, stream.write_all(&buf[..n])).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => return NodeEnd::Reset,
            Err(_) => return NodeEnd::Stuck,
        }
        left -= n;
    }
    if stream.shutdown().await.is_err() {
        return NodeEnd::Reset;
    }
    // The frontend closes once it has read everything; how it does is the
    // frontend's to judge.
    let _ = tokio::time::timeout(NODE_STUCK, async {
        while matches!(stream.read(&mut buf).await, Ok(n) if n > 0) {}
    })
    .await;
    NodeEnd::Complete
}

/// The header's up and down lengths and seed.
fn parse_header(h: &[u8; HEADER]) -> (usize, usize, u64) {
    let u32_at = |i: usize| u32::from_be_bytes([h[i], h[i + 1], h[i + 2], h[i + 3]]) as usize;
    let mut seed = [0u8; 8];
    seed.copy_from_slice(&h[8..16]);
    (u32_at(0), u32_at(4), u64::from_be_bytes(seed))
}
