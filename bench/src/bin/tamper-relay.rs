//! tamper-relay: what the soak's sabotage (`bench --soak-sabotage`) puts
//! between a healthy agent and the checked destination, in the agent's
//! network namespace, to break its tunnels without a sound: every answer
//! it relays loses bytes or has one altered, and every connection ends
//! cleanly, as a bug that loses or alters DATA would leave it. The
//! sabotage redirects the agent's connections to the destination here
//! (nftables in the namespace); the relay's own connections carry a mark
//! the redirect skips.
//!
//! ```text
//! ip netns exec <ns> tamper-relay --upstream 10.251.1.1:PORT --tamper drop --mark 27506 --accept-for 4
//! ```
//! Prints the port it listens on (127.0.0.1) on a line of its own, takes
//! connections for `--accept-for` seconds, then exits once those it took
//! have ended (after [`LINGER`] at most).

use std::{
    io,
    net::{Ipv4Addr, SocketAddr},
    time::Duration,
};

use clap::{Parser, ValueEnum};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpSocket, TcpStream},
    task::JoinSet,
};

/// The longest the relay waits, once it takes no more connections, for
/// those it took to end: past the soak frontends' own bound.
const LINGER: Duration = Duration::from_secs(60);

/// Bytes of each answer left out by `--tamper drop`: from its second byte
/// on, so that its first says the tunnel worked.
const DROPPED: std::ops::Range<u64> = 1..65;

/// What is done to each answer.
#[derive(Debug, Clone, Copy, ValueEnum)]
enum Tamper {
    /// Bytes 1 to 64 left out, the rest relayed (silent loss).
    Drop,
    /// Its first byte inverted (an altered byte).
    Flip,
}

/// A relay that tampers with answers.
#[derive(Debug, Parser)]
#[command(name = "tamper-relay")]
struct Opt {
    /// Where every connection is relayed to.
    #[arg(long)]
    upstream: SocketAddr,
    /// What is done to each answer.
    #[arg(long, value_enum)]
    tamper: Tamper,
    /// The mark (SO_MARK) of the relay's own connections.
    #[arg(long)]
    mark: u32,
    /// Seconds during which connections are taken.
    #[arg(long)]
    accept_for: f64,
}

fn main() -> anyhow::Result<()> {
    let opt = Opt::parse();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(serve(opt))
}

async fn serve(opt: Opt) -> anyhow::Result<()> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await?;
    println!("{}", listener.local_addr()?.port());
    let deadline = tokio::time::Instant::now() + Duration::from_secs_f64(opt.accept_for);
    let mut relays = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (agent, _) = accepted?;
                relays.spawn(relay(agent, opt.upstream, opt.mark, opt.tamper));
            }
            () = tokio::time::sleep_until(deadline) => break,
        }
    }
    drop(listener);
    let (mut relayed, mut failed) = (0, 0);
    let drained = tokio::time::timeout(LINGER, async {
        while let Some(done) = relays.join_next().await {
            match done {
                Ok(Ok(())) => relayed += 1,
                _ => failed += 1,
            }
        }
    })
    .await;
    eprintln!(
        "tamper-relay: {relayed} connections relayed with {:?}, {failed} failed{}",
        opt.tamper,
        if drained.is_err() {
            ", the rest cut after the linger"
        } else {
            ""
        }
    );
    Ok(())
}

/// Relays one connection: the request as it is, the answer tampered
/// with, each direction's end passed on.
async fn relay(
    agent: TcpStream,
    upstream: SocketAddr,
    mark: u32,
    tamper: Tamper,
) -> io::Result<()> {
    let socket = socket2::Socket::new(
        socket2::Domain::IPV4,
        socket2::Type::STREAM,
        Some(socket2::Protocol::TCP),
    )?;
    socket.set_mark(mark)?;
    socket.set_nonblocking(true)?;
    let upstream = TcpSocket::from_std_stream(socket.into())
        .connect(upstream)
        .await?;
    let (mut agent_read, mut agent_write) = agent.into_split();
    let (mut up_read, mut up_write) = upstream.into_split();
    let request = async {
        tokio::io::copy(&mut agent_read, &mut up_write).await?;
        up_write.shutdown().await
    };
    let answer = async {
        let mut buf = vec![0u8; 32 * 1024];
        let mut offset = 0u64;
        loop {
            let n = up_read.read(&mut buf).await?;
            if n == 0 {
                break;
            }
            let chunk = &mut buf[..n];
            let (from, to) = (offset, offset + n as u64);
            offset = to;
            match tamper {
                Tamper::Flip => {
                    if from == 0 {
                        chunk[0] ^= 0xff;
                    }
                    agent_write.write_all(chunk).await?;
                }
                Tamper::Drop => {
                    let (lo, hi) = (DROPPED.start.max(from), DROPPED.end.min(to));
                    if lo < hi {
                        let (lo, hi) = ((lo - from) as usize, (hi - from) as usize);
                        agent_write.write_all(&chunk[..lo]).await?;
                        agent_write.write_all(&chunk[hi..]).await?;
                    } else {
                        agent_write.write_all(chunk).await?;
                    }
                }
            }
        }
        agent_write.shutdown().await
    };
    tokio::try_join!(request, answer).map(|_| ())
}
