//! Admission of TLS handshakes (`edge::listen::tls_incoming`) against real
//! peers on loopback: peers that answer every flight late, silent sockets
//! filling the cap, signatures that take the CPU a while, peers that hang
//! up while they wait. What must hold: a handshake that is making progress
//! is finished, and its deadline does not run while it waits for this
//! process.

use std::{
    net::SocketAddr,
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use edge::admission::Dropped;
use futures_util::StreamExt;
use integration_tests::{Pki, trace_init};
use rustls::{
    SignatureAlgorithm, SignatureScheme,
    server::{ClientHello, ResolvesServerCert},
    sign::{CertifiedKey, Signer, SigningKey},
};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
    task::JoinSet,
};
use tokio_util::sync::CancellationToken;

/// How long a test may wait for what it expects.
const LIMIT: Duration = Duration::from_secs(60);

/// A signing key that holds its thread for `delay` before each signature,
/// as an RSA key on a slow or busy machine does, and counts them.
#[derive(Debug)]
struct SlowKey {
    /// The real key.
    inner: Arc<dyn SigningKey>,
    /// Time each signature takes on top.
    delay: Duration,
    /// Signatures made.
    signed: Arc<AtomicUsize>,
}

/// [`SlowKey`]'s signer.
#[derive(Debug)]
struct SlowSigner {
    inner: Box<dyn Signer>,
    delay: Duration,
    signed: Arc<AtomicUsize>,
}

impl SigningKey for SlowKey {
    fn choose_scheme(&self, offered: &[SignatureScheme]) -> Option<Box<dyn Signer>> {
        let inner = self.inner.choose_scheme(offered)?;
        Some(Box::new(SlowSigner {
            inner,
            delay: self.delay,
            signed: self.signed.clone(),
        }))
    }

    fn algorithm(&self) -> SignatureAlgorithm {
        self.inner.algorithm()
    }
}

impl Signer for SlowSigner {
    fn sign(&self, message: &[u8]) -> Result<Vec<u8>, rustls::Error> {
        // Holds the worker thread, as CPU work would.
        std::thread::sleep(self.delay);
        self.signed.fetch_add(1, Ordering::Relaxed);
        self.inner.sign(message)
    }

    fn scheme(&self) -> SignatureScheme {
        self.inner.scheme()
    }
}

/// Always the one certificate, with its [`SlowKey`].
#[derive(Debug)]
struct SlowResolver(Arc<CertifiedKey>);

impl ResolvesServerCert for SlowResolver {
    fn resolve(&self, _: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.clone())
    }
}

/// The agent listener's configuration of the test PKI (mTLS); with a
/// delay, each signature takes that long more, and `signed` counts them.
fn server_tls(slow: Option<(Duration, Arc<AtomicUsize>)>) -> Arc<rustls::ServerConfig> {
    let pki = Pki::get();
    let config = ops::tls::server_config(
        &pki.path("cluster.crt"),
        &pki.path("cluster.key"),
        Some(&pki.path("agent-ca.crt")),
    )
    .unwrap();
    let Some((delay, signed)) = slow else {
        return config;
    };
    let chain = ops::tls::load_certs(&pki.path("cluster.crt")).unwrap();
    let key = ops::tls::load_key(&pki.path("cluster.key")).unwrap();
    let key = rustls::crypto::ring::sign::any_supported_type(&key).unwrap();
    let mut config = (*config).clone();
    config.cert_resolver = Arc::new(SlowResolver(Arc::new(CertifiedKey::new(
        chain,
        Arc::new(SlowKey {
            inner: key,
            delay,
            signed,
        }),
    ))));
    Arc::new(config)
}

/// An agent's client configuration, without session resumption: every
/// handshake is a full one, as ANP's agents make.
fn client_config() -> Arc<rustls::ClientConfig> {
    let pki = Pki::get();
    let config = ops::tls::client_config(
        &pki.path("agent-ca.crt"),
        Some((&pki.path("proxy-agent.crt"), &pki.path("proxy-agent.key"))),
        &[],
    )
    .unwrap();
    let mut config = (*config).clone();
    config.resumption = rustls::client::Resumption::disabled();
    Arc::new(config)
}

/// [`client_config`] as a connector.
fn client_tls() -> tokio_rustls::TlsConnector {
    tokio_rustls::TlsConnector::from(client_config())
}

/// A full TLS handshake with the server at `addr`, as an agent.
async fn handshake(addr: SocketAddr) -> std::io::Result<()> {
    let tcp = TcpStream::connect(addr).await?;
    let name = rustls_pki_types::ServerName::try_from("localhost").unwrap();
    client_tls().connect(name, tcp).await.map(drop)
}

/// A listener with admission, `max_pending` at most, on a runtime of its
/// own (two workers, as the machine's server has; the peers' runtime is
/// not the one its signatures hold up), whose finished connections are
/// counted and held open.
struct Listener {
    /// Where peers connect.
    addr: SocketAddr,
    /// Handshakes finished and handed over.
    done: Arc<AtomicUsize>,
    /// Pending connections that ended without a finished handshake.
    dropped: Arc<Mutex<Vec<Dropped>>>,
    /// Stops it.
    stop: CancellationToken,
    /// Its thread.
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Listener {
    async fn start(tls: Arc<rustls::ServerConfig>, max_pending: usize) -> Self {
        let done = Arc::new(AtomicUsize::new(0));
        let dropped = Arc::new(Mutex::new(Vec::new()));
        let stop = CancellationToken::new();
        let (addr_tx, addr_rx) = tokio::sync::oneshot::channel();
        let (finished, counted, stopped) = (done.clone(), dropped.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async move {
                let listener = edge::listen::bind_tcp("127.0.0.1:0".parse().unwrap())
                    .await
                    .unwrap();
                addr_tx.send(listener.local_addr().unwrap()).unwrap();
                let mut incoming = edge::listen::tls_incoming_counted(
                    listener,
                    tls,
                    stopped.clone(),
                    "test",
                    max_pending,
                    Arc::new(move |reason| counted.lock().unwrap().push(reason)),
                    None,
                );
                let mut held = Vec::new();
                while let Some(conn) = stopped.run_until_cancelled(incoming.next()).await.flatten()
                {
                    held.push(conn.unwrap());
                    finished.fetch_add(1, Ordering::Relaxed);
                }
            });
            runtime.shutdown_background();
        });
        Self {
            addr: addr_rx.await.unwrap(),
            done,
            dropped,
            stop,
            thread: Some(thread),
        }
    }

    /// How many pending connections were dropped for `reason`.
    fn dropped(&self, reason: Dropped) -> usize {
        let dropped = self.dropped.lock().unwrap();
        dropped.iter().filter(|r| **r == reason).count()
    }

    /// Everything dropped so far.
    fn all_dropped(&self) -> Vec<Dropped> {
        self.dropped.lock().unwrap().clone()
    }

    /// Waits until `n` handshakes have finished.
    async fn wait_done(&self, n: usize) {
        let waited = tokio::time::timeout(LIMIT, async {
            while self.done.load(Ordering::Relaxed) < n {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await;
        assert!(
            waited.is_ok(),
            "{} of {n} handshakes finished within {LIMIT:?}",
            self.done.load(Ordering::Relaxed)
        );
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.stop.cancel();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// A loopback relay to `to` that holds each chunk its client sends for
/// `delay` before passing it on: a peer that answers every flight `delay`
/// late (a far-away agent, or one starved of CPU). The way back is not
/// delayed.
async fn late_relay(to: SocketAddr, delay: Duration, tasks: &mut JoinSet<()>) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tasks.spawn(async move {
        let mut relays = JoinSet::new();
        loop {
            let (client, _) = listener.accept().await.unwrap();
            relays.spawn(async move {
                let server = TcpStream::connect(to).await.unwrap();
                let (mut client_rx, mut client_tx) = client.into_split();
                let (mut server_rx, mut server_tx) = server.into_split();
                let up = async move {
                    let mut buf = vec![0u8; 16 * 1024];
                    loop {
                        let n = client_rx.read(&mut buf).await.unwrap_or(0);
                        if n == 0 {
                            let _ = server_tx.shutdown().await;
                            return;
                        }
                        tokio::time::sleep(delay).await;
                        if server_tx.write_all(&buf[..n]).await.is_err() {
                            return;
                        }
                    }
                };
                let down = async move {
                    let _ = tokio::io::copy(&mut server_rx, &mut client_tx).await;
                    let _ = client_tx.shutdown().await;
                };
                tokio::join!(up, down);
            });
        }
    });
    addr
}

/// Opens a silent connection to `to` (one that never sends a byte) every
/// `every`, `count` in all, and holds them open.
fn silent_flood(to: SocketAddr, every: Duration, count: usize, tasks: &mut JoinSet<()>) {
    tasks.spawn(async move {
        let mut held = Vec::new();
        for _ in 0..count {
            held.push(TcpStream::connect(to).await.unwrap());
            tokio::time::sleep(every).await;
        }
        std::future::pending::<()>().await;
    });
}

/// Real peers 300 ms away (every flight they send arrives 300 ms late) and
/// a flood of silent sockets share a listener whose cap is 4: the silent
/// ones are dropped to make room, the slow real ones never are, and every
/// one of them finishes its handshake. (Dropping any pending connection
/// that kept its handshake waiting 200 ms in all threw these away.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peers_that_answer_each_flight_late_are_never_dropped_while_silent_ones_fill_the_cap() {
    trace_init();
    const SLOW: usize = 6;
    let listener = Listener::start(server_tls(None), 4).await;
    let mut tasks = JoinSet::new();
    silent_flood(listener.addr, Duration::from_millis(100), 60, &mut tasks);
    let relay = late_relay(listener.addr, Duration::from_millis(300), &mut tasks).await;
    let mut peers = JoinSet::new();
    for k in 0..SLOW {
        peers.spawn(async move {
            tokio::time::sleep(Duration::from_millis(150 * k as u64)).await;
            handshake(relay).await
        });
    }
    while let Some(result) = tokio::time::timeout(LIMIT, peers.join_next())
        .await
        .expect("the slow peers' handshakes end")
    {
        result
            .unwrap()
            .expect("a slow peer's handshake was thrown away");
    }
    listener.wait_done(SLOW).await;
    assert!(
        listener.dropped(Dropped::NoHello) > 0,
        "the cap was never reached: the test proves nothing"
    );
    let thrown_away: Vec<Dropped> = listener
        .all_dropped()
        .into_iter()
        .filter(|r| r.after_start())
        .collect();
    assert_eq!(thrown_away, [], "started handshakes dropped");
}

/// A hundred agents connect at once to a server whose every signature
/// takes 250 ms (two at a time on its two workers: about 12 s for all):
/// each handshake's deadline runs from when the server starts on it, so
/// the last ones, which waited behind all the others, are finished rather
/// than timed out 10 s after their `accept`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handshakes_queued_behind_slow_signatures_are_not_timed_out_before_they_start() {
    trace_init();
    const AGENTS: usize = 100;
    let signed = Arc::new(AtomicUsize::new(0));
    let tls = server_tls(Some((Duration::from_millis(250), signed.clone())));
    let listener = Listener::start(tls, 8192).await;
    let mut peers = JoinSet::new();
    for _ in 0..AGENTS {
        let addr = listener.addr;
        peers.spawn(async move { handshake(addr).await });
    }
    let mut failed = 0;
    while let Some(result) = tokio::time::timeout(LIMIT, peers.join_next())
        .await
        .expect("the handshakes end")
    {
        if result.unwrap().is_err() {
            failed += 1;
        }
    }
    assert_eq!(failed, 0, "handshakes thrown away");
    listener.wait_done(AGENTS).await;
    assert_eq!(signed.load(Ordering::Relaxed), AGENTS);
    assert_eq!(listener.all_dropped(), []);
}

/// Agents that send their ClientHello and hang up before the server gets
/// to it (a client whose own timeout fired while it queued) cost the
/// server no signature: it sees they are gone when their turn comes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_hangs_up_while_its_handshake_waits_costs_no_signature() {
    trace_init();
    const AGENTS: usize = 20;
    const IMPATIENT: usize = 10;
    let signed = Arc::new(AtomicUsize::new(0));
    let tls = server_tls(Some((Duration::from_millis(200), signed.clone())));
    let listener = Listener::start(tls, 8192).await;
    let mut peers = JoinSet::new();
    for _ in 0..AGENTS {
        let addr = listener.addr;
        peers.spawn(async move { handshake(addr).await });
    }
    // Once the server is at work on them, the impatient ones queue behind.
    tokio::time::timeout(LIMIT, async {
        while signed.load(Ordering::Relaxed) == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("a signature");
    for _ in 0..IMPATIENT {
        let name = rustls_pki_types::ServerName::try_from("localhost").unwrap();
        let mut client = rustls::ClientConnection::new(client_config(), name).unwrap();
        let mut hello = Vec::new();
        client.write_tls(&mut hello).unwrap();
        let mut tcp = TcpStream::connect(listener.addr).await.unwrap();
        tcp.write_all(&hello).await.unwrap();
        drop(tcp);
    }
    while let Some(result) = tokio::time::timeout(LIMIT, peers.join_next())
        .await
        .expect("the handshakes end")
    {
        result.unwrap().expect("a handshake failed");
    }
    listener.wait_done(AGENTS).await;
    tokio::time::timeout(LIMIT, async {
        while listener.dropped(Dropped::PeerGone) < IMPATIENT {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("dropped: {:?}", listener.all_dropped()));
    assert_eq!(signed.load(Ordering::Relaxed), AGENTS);
    assert_eq!(listener.all_dropped().len(), IMPATIENT);
}

/// `tests/go/agents`, the grpc-go agent swarm; panics naming how to build
/// it.
fn go_agents() -> std::path::PathBuf {
    let path = integration_tests::workspace().join("target/go-agents");
    assert!(
        path.exists(),
        "no grpc-go agent swarm at {}: run scripts/test, which installs golang-go, \
         golang-google-grpc-dev and golang-google-protobuf-dev and builds tests/go/agents",
        path.display()
    );
    path
}

/// 300 grpc-go agents (`tests/go/agents`: each its own TLS connection with
/// no session cache and its own `Connect` stream, as ANP's agents) connect
/// at once to a server that holds at most 32 pending handshakes: every one
/// connects, the server throws none away after signing, a dial reaches
/// one of them (which refuses it in its own words), and the swarm's
/// counts say the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_storm_of_grpc_go_agents_gets_through_a_small_cap() {
    use integration_tests::{ServerOpts, TestServer};
    use tokio::io::AsyncBufReadExt;
    trace_init();
    const AGENTS: usize = 300;
    let server = TestServer::start_with(ServerOpts {
        max_tls_handshakes: 32,
        ..ServerOpts::default()
    })
    .await;
    let pki = Pki::get();
    let mut swarm = tokio::process::Command::new(go_agents())
        .arg(format!("-addr={}", server.agent_addr))
        .arg(format!("-ca={}", pki.path("agent-ca.crt").display()))
        .arg(format!("-cert={}", pki.path("proxy-agent.crt").display()))
        .arg(format!("-key={}", pki.path("proxy-agent.key").display()))
        .arg(format!("-count={AGENTS}"))
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let stdin = swarm.stdin.take().unwrap();
    let mut reports = tokio::io::BufReader::new(swarm.stdout.take().unwrap()).lines();
    let report = tokio::time::timeout(LIMIT, async {
        loop {
            let line = reports.next_line().await.unwrap().expect("a report");
            let report: serde_json::Value = serde_json::from_str(&line).unwrap();
            if report["connected"] == AGENTS && server.handle.backend_count() == AGENTS {
                return report;
            }
        }
    })
    .await
    .expect("every agent connected");
    assert_eq!(report["agents"], AGENTS);
    for reason in ["stalled", "timeout", "failed"] {
        let series =
            format!("konnectivity_rs_server_tls_handshakes_dropped_total{{reason=\"{reason}\"}}");
        assert_eq!(server.metric(&series).await, 0.0, "{series}");
    }
    let refused = server.dial("127.0.0.1:1").await.err().expect("refused");
    assert!(
        refused
            .to_string()
            .contains("the agent swarm dials nothing"),
        "{refused}"
    );
    // Its stdin closed, the swarm reports once more and ends.
    drop(stdin);
    let mut last = None;
    while let Some(line) = reports.next_line().await.unwrap() {
        last = Some(line);
    }
    let last: serde_json::Value = serde_json::from_str(&last.expect("a last report")).unwrap();
    assert_eq!(last["dials"], 1, "{last}");
    assert!(swarm.wait().await.unwrap().success());
}
