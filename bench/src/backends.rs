//! The node side: TCP servers on `127.0.0.1:0` that the agent (or the bench
//! itself, for direct runs) connects to. All run in the bench process except
//! the hold-open one, which runs in a child process (the bench executable
//! with `--hold-backend`) so that the bench needs one file descriptor per
//! idle connection, not two, under RLIMIT_NOFILE.

use std::{
    io::{BufRead, BufReader, Write as _},
    net::SocketAddr,
    process::{Child, ChildStdin, Command, Stdio},
    sync::{
        Arc,
        atomic::{AtomicU64, AtomicUsize, Ordering},
    },
    time::Duration,
};

use anyhow::Context;
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
    task::JoinSet,
};

/// Read and write buffer of the bulk backends.
pub const BULK_BUFFER: usize = 64 * 1024;
/// Bytes each side sends in one exchange with the responder.
pub const EXCHANGE_BYTES: usize = 1024;

/// What a backend does with each accepted connection.
#[derive(Debug, Clone, Copy)]
enum Behaviour {
    /// Writes without end; never reads.
    Source,
    /// Reads and counts until EOF; never writes.
    Sink,
    /// Writes back what it reads, until EOF.
    Echo,
    /// Reads [`EXCHANGE_BYTES`], writes as many back, closes.
    Responder,
    /// Writes back what it reads with a tiny buffer, until EOF: an idle
    /// connection, or a small echo (the churn scenario).
    Hold,
}

/// One listening backend.
#[derive(Debug, Clone)]
pub struct Backend {
    /// Where it listens.
    pub addr: SocketAddr,
    /// Connections accepted and not yet ended.
    pub active: Arc<AtomicUsize>,
    /// Bytes read from all its connections.
    pub bytes_in: Arc<AtomicU64>,
}

impl Backend {
    /// Connections accepted and not yet ended.
    pub fn active(&self) -> usize {
        self.active.load(Ordering::Relaxed)
    }

    /// Bytes read so far from all connections.
    pub fn bytes_in(&self) -> u64 {
        self.bytes_in.load(Ordering::Relaxed)
    }
}

/// All backends; their tasks end when this is dropped.
pub struct Backends {
    /// Endless writer (bulk down, head-of-line).
    pub source: Backend,
    /// Counting reader (bulk up).
    pub sink: Backend,
    /// Echo (ping-pong).
    pub echo: Backend,
    /// 1 KiB responder that closes first (dial rate).
    pub responder: Backend,
    /// Idle connections (memory), in a child process.
    pub hold: Backend,
    /// The accept loops and connection tasks.
    _tasks: JoinSet<()>,
    /// The child process serving [`Self::hold`].
    _hold_process: HoldProcess,
}

impl Backends {
    /// Binds and starts all backends on `127.0.0.1:0`.
    ///
    /// # Errors
    /// A listener cannot be bound.
    pub async fn start() -> anyhow::Result<Self> {
        let (hold, hold_process) = HoldProcess::start().await?;
        let mut tasks = JoinSet::new();
        let mut start = async |behaviour| -> anyhow::Result<Backend> {
            let listener = TcpListener::bind("127.0.0.1:0").await?;
            let backend = Backend {
                addr: listener.local_addr()?,
                active: Arc::default(),
                bytes_in: Arc::default(),
            };
            tasks.spawn(accept_loop(listener, behaviour, backend.clone()));
            Ok(backend)
        };
        Ok(Self {
            source: start(Behaviour::Source).await?,
            sink: start(Behaviour::Sink).await?,
            echo: start(Behaviour::Echo).await?,
            responder: start(Behaviour::Responder).await?,
            hold,
            _tasks: tasks,
            _hold_process: hold_process,
        })
    }

    /// Waits (up to `limit`) until no connection is open on the traffic
    /// backends, so that one measurement does not drain into the next;
    /// `false` if some are still open then.
    pub async fn quiesce(&self, limit: Duration) -> bool {
        let all = [&self.source, &self.sink, &self.echo, &self.responder];
        wait_until(limit, || all.iter().all(|b| b.active() == 0)).await
    }
}

/// The hold-open backend's process: `<bench> --hold-backend`, killed on
/// drop (and exiting by itself when its stdin closes).
struct HoldProcess {
    /// The child.
    child: Child,
    /// Its stdin; closing it tells the child to exit.
    _stdin: Option<ChildStdin>,
}

impl HoldProcess {
    /// Starts the child and reads its address; a thread keeps
    /// [`Backend::active`] up to date from the counts it prints.
    async fn start() -> anyhow::Result<(Backend, Self)> {
        let exe = std::env::current_exe().context("finding the bench executable")?;
        let mut child = Command::new(&exe)
            .arg("--hold-backend")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("starting {} --hold-backend", exe.display()))?;
        let stdout = child.stdout.take().context("the child's stdout")?;
        let process = Self {
            _stdin: child.stdin.take(),
            child,
        };
        let active = Arc::new(AtomicUsize::new(0));
        let (addr_tx, addr_rx) = tokio::sync::oneshot::channel();
        let counts = active.clone();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            let first = lines.next().and_then(Result::ok);
            let _ = addr_tx.send(first);
            for line in lines.map_while(Result::ok) {
                if let Ok(n) = line.trim().parse() {
                    counts.store(n, Ordering::Relaxed);
                }
            }
        });
        let first = tokio::time::timeout(Duration::from_secs(10), addr_rx)
            .await
            .ok()
            .and_then(Result::ok)
            .flatten()
            .context("the hold-open backend process did not print its address")?;
        let addr = first
            .trim()
            .parse()
            .with_context(|| format!("the hold-open backend printed {first:?}, not an address"))?;
        let backend = Backend {
            addr,
            active,
            bytes_in: Arc::default(),
        };
        Ok((backend, process))
    }
}

impl Drop for HoldProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The body of `bench --hold-backend`: a hold-open backend on
/// `127.0.0.1:0`. Prints its address, then the number of open connections
/// whenever it changes (checked every 10 ms), one per line; returns when
/// stdin reaches EOF (the bench closed it or died).
///
/// # Errors
/// The listener cannot be bound or stdout cannot be written.
pub async fn hold_backend_main() -> anyhow::Result<()> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let backend = Backend {
        addr: listener.local_addr()?,
        active: Arc::default(),
        bytes_in: Arc::default(),
    };
    let mut out = std::io::stdout();
    writeln!(out, "{}", backend.addr)?;
    out.flush()?;
    let mut tasks = JoinSet::new();
    tasks.spawn(accept_loop(listener, Behaviour::Hold, backend.clone()));
    let report = async {
        let mut last = 0;
        loop {
            tokio::time::sleep(Duration::from_millis(10)).await;
            let now = backend.active();
            if now != last {
                writeln!(out, "{now}")?;
                out.flush()?;
                last = now;
            }
        }
    };
    let stdin_closed = async {
        let mut stdin = tokio::io::stdin();
        let mut buf = [0u8; 64];
        while matches!(stdin.read(&mut buf).await, Ok(n) if n > 0) {}
    };
    tokio::select! {
        result = report => result,
        () = stdin_closed => Ok(()),
    }
}

/// Polls `done` every 10 ms until it holds or `limit` passes; whether it
/// held.
pub async fn wait_until(limit: Duration, mut done: impl FnMut() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if done() {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Accepts until the task is dropped; one task per connection.
async fn accept_loop(listener: TcpListener, behaviour: Behaviour, backend: Backend) {
    let mut conns = JoinSet::new();
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                let _ = stream.set_nodelay(true);
                backend.active.fetch_add(1, Ordering::Relaxed);
                let backend = backend.clone();
                conns.spawn(async move {
                    let _ = serve(stream, behaviour, &backend.bytes_in).await;
                    backend.active.fetch_sub(1, Ordering::Relaxed);
                });
                // Reap finished connection tasks so the set stays small.
                while conns.try_join_next().is_some() {}
            }
            // Out of file descriptors, most likely: let some close.
            Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    }
}

/// Runs one accepted connection.
async fn serve(
    mut stream: TcpStream,
    behaviour: Behaviour,
    bytes_in: &AtomicU64,
) -> std::io::Result<()> {
    match behaviour {
        Behaviour::Source => {
            let buf = vec![0x5a_u8; BULK_BUFFER];
            loop {
                stream.write_all(&buf).await?;
            }
        }
        Behaviour::Sink => {
            let mut buf = vec![0u8; BULK_BUFFER];
            loop {
                let n = stream.read(&mut buf).await?;
                if n == 0 {
                    return Ok(());
                }
                bytes_in.fetch_add(n as u64, Ordering::Relaxed);
            }
        }
        Behaviour::Echo => {
            let mut buf = vec![0u8; BULK_BUFFER];
            loop {
                let n = stream.read(&mut buf).await?;
                if n == 0 {
                    return Ok(());
                }
                stream.write_all(&buf[..n]).await?;
            }
        }
        Behaviour::Responder => {
            let mut buf = [0u8; EXCHANGE_BYTES];
            stream.read_exact(&mut buf).await?;
            stream.write_all(&buf).await?;
            // Closing first leaves TIME_WAIT on this side, so the dialer's
            // ephemeral ports are not used up at high dial rates.
            Ok(())
        }
        Behaviour::Hold => {
            let mut buf = [0u8; 64];
            loop {
                let n = stream.read(&mut buf).await?;
                if n == 0 {
                    return Ok(());
                }
                stream.write_all(&buf[..n]).await?;
            }
        }
    }
}
