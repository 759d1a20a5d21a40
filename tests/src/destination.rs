//! Destinations for the tests: the node-side servers an agent dials, on
//! `127.0.0.1:0` (or another loopback address), stopped on drop.

use std::{
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
};
use tokio_util::sync::CancellationToken;

/// A running destination.
pub struct Destination {
    /// Where it listens.
    pub addr: SocketAddr,
    /// Connections currently open on it.
    pub open: Arc<AtomicUsize>,
    /// Connections accepted so far.
    pub accepted: Arc<AtomicUsize>,
    /// Stops it.
    stop: CancellationToken,
}

impl Destination {
    /// `127.0.0.1:port` as a dial address.
    pub fn address(&self) -> String {
        self.addr.to_string()
    }

    /// Connections currently open.
    pub fn open_connections(&self) -> usize {
        self.open.load(Ordering::SeqCst)
    }
}

impl Drop for Destination {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Starts a destination that runs `serve` for every accepted connection.
pub async fn spawn<F, Fut>(serve: F) -> Destination
where
    F: Fn(TcpStream) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    spawn_on(std::net::Ipv4Addr::LOCALHOST, serve).await
}

/// [`spawn`] on another loopback address (`127.x.y.z`).
pub async fn spawn_on<F, Fut>(ip: std::net::Ipv4Addr, serve: F) -> Destination
where
    F: Fn(TcpStream) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    assert!(ip.is_loopback(), "tests bind only to loopback");
    spawn_on_any(ip, serve).await
}

/// [`spawn`] on `ip`, which the caller vouches for: loopback, or an
/// address on an interface it created (a test inside network namespaces
/// of its own binds its destinations to a veth there).
pub async fn spawn_on_any<F, Fut>(ip: std::net::Ipv4Addr, serve: F) -> Destination
where
    F: Fn(TcpStream) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let listener = TcpListener::bind((ip, 0))
        .await
        .expect("binding a destination");
    let addr = listener.local_addr().expect("destination address");
    let open = Arc::new(AtomicUsize::new(0));
    let accepted = Arc::new(AtomicUsize::new(0));
    let stop = CancellationToken::new();
    let serve = Arc::new(serve);
    {
        let (open, accepted, stop) = (open.clone(), accepted.clone(), stop.clone());
        tokio::spawn(async move {
            loop {
                let stream = tokio::select! {
                    () = stop.cancelled() => return,
                    accepted = listener.accept() => match accepted {
                        Ok((stream, _)) => stream,
                        Err(_) => continue,
                    },
                };
                accepted.fetch_add(1, Ordering::SeqCst);
                open.fetch_add(1, Ordering::SeqCst);
                let (open, stop, serve) = (open.clone(), stop.clone(), serve.clone());
                tokio::spawn(async move {
                    tokio::select! {
                        () = stop.cancelled() => {}
                        () = serve(stream) => {}
                    }
                    open.fetch_sub(1, Ordering::SeqCst);
                });
            }
        });
    }
    Destination {
        addr,
        open,
        accepted,
        stop,
    }
}

/// Echoes every byte back until the client closes.
pub async fn echo() -> Destination {
    echo_on(std::net::Ipv4Addr::LOCALHOST).await
}

/// [`echo`] on another loopback address.
pub async fn echo_on(ip: std::net::Ipv4Addr) -> Destination {
    assert!(ip.is_loopback(), "tests bind only to loopback");
    echo_on_any(ip).await
}

/// [`echo`] on `ip`, which the caller vouches for ([`spawn_on_any`]).
pub async fn echo_on_any(ip: std::net::Ipv4Addr) -> Destination {
    spawn_on_any(ip, |mut stream| async move {
        let (mut r, mut w) = stream.split();
        let _ = tokio::io::copy(&mut r, &mut w).await;
    })
    .await
}

/// Writes `len` bytes of [`pattern`] and closes.
pub async fn download(len: usize) -> Destination {
    download_on_any(std::net::Ipv4Addr::LOCALHOST, len).await
}

/// [`download`] on `ip`, which the caller vouches for ([`spawn_on_any`]).
pub async fn download_on_any(ip: std::net::Ipv4Addr, len: usize) -> Destination {
    spawn_on_any(ip, move |mut stream| async move {
        let _ = stream.write_all(&pattern(len, 7)).await;
        let _ = stream.shutdown().await;
    })
    .await
}

/// Reads an 8-byte big-endian length and that many bytes, answers with the
/// FNV-1a hash of the bytes (8 bytes, big-endian) and closes.
pub async fn upload_hash() -> Destination {
    upload_hash_on_any(std::net::Ipv4Addr::LOCALHOST).await
}

/// [`upload_hash`] on `ip`, which the caller vouches for ([`spawn_on_any`]).
pub async fn upload_hash_on_any(ip: std::net::Ipv4Addr) -> Destination {
    spawn_on_any(ip, |mut stream| async move {
        let Ok(len) = stream.read_u64().await else {
            return;
        };
        let mut hash = Fnv::new();
        let mut left = len;
        let mut buf = vec![0u8; 64 * 1024];
        while left > 0 {
            let want = usize::try_from(left.min(buf.len() as u64)).unwrap_or(buf.len());
            match stream.read(&mut buf[..want]).await {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    hash.update(&buf[..n]);
                    left -= n as u64;
                }
            }
        }
        let _ = stream.write_u64(hash.finish()).await;
        let _ = stream.shutdown().await;
    })
    .await
}

/// Accepts and holds connections open without reading or writing.
pub async fn silent() -> Destination {
    spawn(|stream| async move {
        let _held = stream;
        std::future::pending::<()>().await;
    })
    .await
}

/// A deterministic, non-repeating-looking byte pattern.
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// FNV-1a, 64 bit.
pub struct Fnv(u64);

impl Fnv {
    /// A fresh hasher.
    pub fn new() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }

    /// Adds bytes.
    pub fn update(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 ^= u64::from(*b);
            self.0 = self.0.wrapping_mul(0x100_0000_01b3);
        }
    }

    /// The hash.
    pub fn finish(&self) -> u64 {
        self.0
    }
}

impl Default for Fnv {
    fn default() -> Self {
        Self::new()
    }
}

/// A loopback address with nothing listening (bound, then released).
pub fn closed_port() -> SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("binding");
    listener.local_addr().expect("address")
}

/// A loopback address whose TCP connects hang: a listener with a full accept
/// queue that never accepts, so the kernel drops new SYNs. Keep it alive for
/// as long as dials to it must hang.
pub struct Blackhole {
    /// The listener.
    _listener: socket2::Socket,
    /// Connections that fill the queue.
    _fillers: Vec<std::net::TcpStream>,
    /// Its address.
    pub addr: SocketAddr,
}

impl Blackhole {
    /// Creates one.
    pub fn new() -> Self {
        use socket2::{Domain, Socket, Type};
        let listener = Socket::new(Domain::IPV4, Type::STREAM, None).expect("socket");
        listener
            .bind(&SocketAddr::from(([127, 0, 0, 1], 0)).into())
            .expect("bind");
        listener.listen(0).expect("listen");
        let addr = listener
            .local_addr()
            .expect("address")
            .as_socket()
            .expect("inet address");
        // With a backlog of 0 the queue holds one connection; fill it (and a
        // spare), with a short timeout since the later ones may hang.
        let mut fillers = Vec::new();
        for _ in 0..3 {
            if let Ok(s) =
                std::net::TcpStream::connect_timeout(&addr, std::time::Duration::from_millis(200))
            {
                fillers.push(s);
            }
        }
        Self {
            _listener: listener,
            _fillers: fillers,
            addr,
        }
    }
}

impl Default for Blackhole {
    fn default() -> Self {
        Self::new()
    }
}

/// Answers every HTTP request with `200` and `body`, then closes.
pub async fn http(body: &'static [u8]) -> Destination {
    spawn(move |mut stream| async move {
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            match stream.read(&mut byte).await {
                Ok(1) => head.push(byte[0]),
                _ => return,
            }
        }
        let answer = format!(
            "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        );
        let _ = stream.write_all(answer.as_bytes()).await;
        let _ = stream.write_all(body).await;
        let _ = stream.shutdown().await;
    })
    .await
}

/// Writes `banner` as soon as a client connects (a server-speaks-first
/// protocol, like SSH or SMTP), then echoes.
pub async fn banner(banner: &'static [u8]) -> Destination {
    spawn(move |mut stream| async move {
        if stream.write_all(banner).await.is_err() {
            return;
        }
        let (mut r, mut w) = stream.split();
        let _ = tokio::io::copy(&mut r, &mut w).await;
    })
    .await
}

/// Writes bytes until the client goes away (an endless download).
pub async fn source() -> Destination {
    source_on(std::net::Ipv4Addr::LOCALHOST).await
}

/// [`source`] on another address: loopback, or one on an interface in a
/// network namespace the caller created.
pub async fn source_on(ip: std::net::Ipv4Addr) -> Destination {
    spawn_on_any(ip, |mut stream| async move {
        let chunk = pattern(64 * 1024, 13);
        while stream.write_all(&chunk).await.is_ok() {}
    })
    .await
}

/// A destination that accepts connections and never reads them (a node-side
/// server that has stalled), with a small receive buffer so that a tunnel
/// fills up quickly; [`Stall::reset_all`] then resets every connection.
pub struct Stall {
    /// Where it listens.
    pub addr: SocketAddr,
    /// The accepted connections, held unread.
    held: Arc<std::sync::Mutex<Vec<TcpStream>>>,
    /// Stops accepting.
    stop: CancellationToken,
}

impl Stall {
    /// Starts it on 127.0.0.1.
    pub fn start() -> Self {
        Self::start_on(std::net::Ipv4Addr::LOCALHOST)
    }

    /// Starts it on `ip` (loopback, or an address on an interface the
    /// caller created).
    pub fn start_on(ip: std::net::Ipv4Addr) -> Self {
        let socket = socket2::Socket::new(
            socket2::Domain::IPV4,
            socket2::Type::STREAM,
            Some(socket2::Protocol::TCP),
        )
        .expect("a socket");
        // Inherited by accepted sockets; small, so little stays in the kernel.
        socket.set_recv_buffer_size(4096).expect("SO_RCVBUF");
        socket
            .bind(&SocketAddr::from((ip, 0)).into())
            .expect("binding the stalled destination");
        socket.listen(1024).expect("listen");
        socket.set_nonblocking(true).expect("non-blocking");
        let listener = TcpListener::from_std(socket.into()).expect("a tokio listener");
        let addr = listener.local_addr().expect("address");
        let held = Arc::new(std::sync::Mutex::new(Vec::new()));
        let stop = CancellationToken::new();
        {
            let (held, stop) = (held.clone(), stop.clone());
            tokio::spawn(async move {
                loop {
                    tokio::select! {
                        () = stop.cancelled() => return,
                        accepted = listener.accept() => if let Ok((stream, _)) = accepted {
                            held.lock().expect("held lock").push(stream);
                        },
                    }
                }
            });
        }
        Self { addr, held, stop }
    }

    /// `127.0.0.1:port` as a dial address.
    pub fn address(&self) -> String {
        self.addr.to_string()
    }

    /// Connections accepted and held.
    pub fn held(&self) -> usize {
        self.held.lock().expect("held lock").len()
    }

    /// Resets every held connection (RST, unread bytes discarded).
    pub fn reset_all(&self) {
        for stream in self.held.lock().expect("held lock").drain(..) {
            let _ = socket2::SockRef::from(&stream).set_linger(Some(std::time::Duration::ZERO));
        }
    }
}

impl Drop for Stall {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// An echo server in a Python process of its own (`tests/python/echo.py`),
/// for more connections than this process may hold; killed on drop.
pub struct EchoProcess {
    /// Where it listens.
    pub addr: SocketAddr,
    /// The process.
    child: std::process::Child,
}

impl EchoProcess {
    /// Starts it and reads its port.
    pub fn start() -> Self {
        use std::io::BufRead;
        let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("python/echo.py");
        let mut child = std::process::Command::new(crate::python::interpreter())
            .arg(&script)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("starting tests/python/echo.py");
        let stdout = child.stdout.take().expect("piped stdout");
        let mut line = String::new();
        std::io::BufReader::new(stdout)
            .read_line(&mut line)
            .expect("reading the echo server's port");
        let port: u16 = line
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("echo.py printed {line:?}, not a port"));
        Self {
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            child,
        }
    }

    /// `127.0.0.1:port` as a dial address.
    pub fn address(&self) -> String {
        self.addr.to_string()
    }
}

impl Drop for EchoProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
