//! Real SOCKS5 (microsocks) and HTTP CONNECT (tinyproxy) proxies on
//! loopback, installed by `scripts/test`. Each binds its outgoing connections to
//! its own loopback address (127.0.0.3 and 127.0.0.4), so a peer address
//! proves a connection went through it. And a TCP load balancer (haproxy)
//! in front of several proxy-server replicas.

use std::{
    net::{IpAddr, SocketAddr},
    process::{Child, Command, Stdio},
};

use crate::wait_for;

/// A proxy process, killed on drop.
pub struct ProxyProcess {
    /// The process.
    child: Child,
    /// Where it listens.
    pub addr: SocketAddr,
    /// Keeps its configuration file.
    _dir: tempfile::TempDir,
}

impl Drop for ProxyProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

fn spawn(program: &str, args: &[String]) -> Child {
    Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| {
            panic!("cannot run {program} ({e}); scripts/test installs it: apt-get install microsocks tinyproxy haproxy")
        })
}

async fn ready(mut proxy: ProxyProcess) -> ProxyProcess {
    let addr = proxy.addr;
    wait_for("the proxy to listen", || {
        std::net::TcpStream::connect(addr).is_ok()
    })
    .await;
    assert!(
        proxy
            .child
            .try_wait()
            .expect("checking the proxy")
            .is_none(),
        "the proxy exited"
    );
    proxy
}

/// microsocks on 127.0.0.1, connecting out from 127.0.0.3.
pub async fn microsocks(auth: Option<(&str, &str)>) -> ProxyProcess {
    let port = free_port();
    let mut args = vec![
        "-i".to_owned(),
        "127.0.0.1".to_owned(),
        "-p".to_owned(),
        port.to_string(),
        "-b".to_owned(),
        "127.0.0.3".to_owned(),
    ];
    if let Some((user, pass)) = auth {
        args.extend([
            "-u".to_owned(),
            user.to_owned(),
            "-P".to_owned(),
            pass.to_owned(),
        ]);
    }
    ready(ProxyProcess {
        child: spawn("microsocks", &args),
        addr: SocketAddr::from(([127, 0, 0, 1], port)),
        _dir: tempfile::tempdir().expect("temp dir"),
    })
    .await
}

/// tinyproxy on 127.0.0.1 allowing CONNECT to `target_port`, connecting out
/// from 127.0.0.4.
pub async fn tinyproxy(auth: Option<(&str, &str)>, target_port: u16) -> ProxyProcess {
    let port = free_port();
    let dir = tempfile::tempdir().expect("temp dir");
    let mut conf = format!(
        "Port {port}\nListen 127.0.0.1\nBind 127.0.0.4\nTimeout 60\nAllow 127.0.0.1\nConnectPort {target_port}\nMaxClients 50\nLogLevel Info\nLogFile \"{}\"\n",
        dir.path().join("tinyproxy.log").display()
    );
    if let Some((user, pass)) = auth {
        conf.push_str(&format!("BasicAuth {user} {pass}\n"));
    }
    let path = dir.path().join("tinyproxy.conf");
    std::fs::write(&path, conf).expect("writing the tinyproxy configuration");
    ready(ProxyProcess {
        child: spawn(
            "tinyproxy",
            &["-d".to_owned(), "-c".to_owned(), path.display().to_string()],
        ),
        addr: SocketAddr::from(([127, 0, 0, 1], port)),
        _dir: dir,
    })
    .await
}

/// haproxy in TCP mode on `ip` (a free port) in front of `servers`, round
/// robin, each server checked every 200 ms (out after one failed check,
/// back after one good one), so that a stopped replica gets no new
/// connections: several replicas behind one load balancer.
pub async fn haproxy(ip: IpAddr, servers: &[SocketAddr]) -> ProxyProcess {
    let dir = tempfile::tempdir().expect("temp dir");
    // haproxy cannot report a port it picked; take a free one.
    let port = std::net::TcpListener::bind((ip, 0))
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let addr = SocketAddr::new(ip, port);
    let mut config = format!(
        "global\n  maxconn 4096\ndefaults\n  mode tcp\n  timeout connect 2s\n  timeout client 1h\n  timeout server 1h\nfrontend agents\n  bind {addr}\n  default_backend servers\nbackend servers\n  balance roundrobin\n"
    );
    for (i, server) in servers.iter().enumerate() {
        config.push_str(&format!(
            "  server s{i} {server} check inter 200ms fall 1 rise 1\n"
        ));
    }
    let path = dir.path().join("haproxy.cfg");
    std::fs::write(&path, config).expect("writing the haproxy configuration");
    ready(ProxyProcess {
        child: spawn(
            "haproxy",
            &[
                "-db".to_owned(),
                "-f".to_owned(),
                path.display().to_string(),
            ],
        ),
        addr,
        _dir: dir,
    })
    .await
}
