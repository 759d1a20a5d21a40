//! The soak's deployment: two proxy-servers (one per frontend mode) behind
//! a haproxy, and agents, each agent slot in a network namespace of its
//! own joined to the host by two veth pairs: a control link (to haproxy),
//! which a partition takes down, and a node link (to the destinations),
//! never cut. Each slot's node address is its own, so the destination
//! tells which agent carried a connection from its source address: the
//! kernel's word, not the agent's. The certificates they reload, and the
//! TokenReview stand-in of token mode. Every process is a child killed on
//! drop; the namespaces and links are deleted on drop.

use std::{
    net::{IpAddr, Ipv4Addr, SocketAddr},
    path::{Path, PathBuf},
    process::Command,
    sync::Arc,
    time::Duration,
};

use anyhow::{Context, bail};
use integration_tests::{
    kube_stub::{Identity, TokenReviewStub, service_account_token},
    proxies::{self, ProxyProcess},
};
use soak_judge::{Audited, Carrier, DialKey};

use super::RunClock;

use crate::{
    probe,
    system::{Binaries, Process, free_ports},
};

/// haproxy's address, on a link of the host's own: every agent reaches
/// it through its own control link.
pub const HOST_IP: Ipv4Addr = Ipv4Addr::new(10, 251, 0, 1);
/// The destinations' address, on the same link: every agent reaches
/// it through its own node link; probe agents, on the host, from this
/// address itself.
pub const DEST_IP: Ipv4Addr = Ipv4Addr::new(10, 251, 1, 1);
/// The audience of agent tokens in token mode.
const AUDIENCE: &str = "system:konnectivity-server";
/// The agents' token in token mode (its `jti`: the token is a JWT).
const AGENT_TOKEN: &str = "soak-agent-token";
/// How long a process may take to start listening or connecting.
const START_LIMIT: Duration = Duration::from_secs(30);
/// The most agent slots (one /30 each in two /16s).
pub const MAX_SLOTS: usize = 64;

/// How agents authenticate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Auth {
    /// A client certificate.
    Mtls,
    /// A service-account token, reviewed by the TokenReview stand-in.
    Token,
}

impl Auth {
    /// `mTLS` or `token`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Mtls => "mTLS",
            Self::Token => "token",
        }
    }
}

/// Runs `ip args`.
fn ip(args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .context("running ip (iproute2)")?;
    if !out.status.success() {
        bail!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// The host's end of slot `slot`'s control link (its namespace's end is
/// the next address).
fn control_host(slot: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 252, slot as u8, 1)
}

/// The host's end of slot `slot`'s node link.
fn node_host(slot: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 253, slot as u8, 1)
}

/// Slot `slot`'s node address: its agent's source address at the
/// destinations, and where its health port listens.
pub fn node_ip(slot: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 253, slot as u8, 2)
}

/// The agent slot whose node address `ip` is.
pub fn slot_of(ip: Ipv4Addr) -> Option<usize> {
    let [a, b, c, d] = ip.octets();
    (a == 10 && b == 253 && d == 2 && usize::from(c) < MAX_SLOTS).then_some(usize::from(c))
}

/// The namespaces of the agent slots and the host's link for haproxy's
/// and the destinations' addresses; deleted (with their links) on drop.
pub struct Namespaces {
    /// The host's link (haproxy's and the destinations' addresses).
    hub: String,
    /// Each slot's namespace.
    names: Vec<String>,
}

impl Namespaces {
    /// Creates the host's link and `slots` namespaces, each joined to the
    /// host by its control and node links (needs root).
    ///
    /// # Errors
    /// An `ip` command fails.
    pub fn create(slots: usize) -> anyhow::Result<Self> {
        anyhow::ensure!(slots <= MAX_SLOTS, "at most {MAX_SLOTS} agents");
        let tag = std::process::id();
        let mut made = Self {
            hub: format!("krsh{tag}"),
            names: Vec::new(),
        };
        // A veth pair with both ends on the host (this kernel has no dummy
        // links): only a place for the two addresses.
        let peer = format!("krsp{tag}");
        ip(&[
            "link", "add", &made.hub, "type", "veth", "peer", "name", &peer,
        ])
        .context("creating the soak's links (needs root)")?;
        for addr in [HOST_IP, DEST_IP] {
            ip(&["addr", "add", &format!("{addr}/32"), "dev", &made.hub])?;
        }
        ip(&["link", "set", &peer, "up"])?;
        ip(&["link", "set", &made.hub, "up"])?;
        for slot in 0..slots {
            let name = format!("krs-soak-{tag}-{slot}");
            ip(&["netns", "add", &name])?;
            made.names.push(name.clone());
            for (host, inner, host_ip, to) in [
                (
                    format!("krsc{tag}x{slot}"),
                    "ctl",
                    control_host(slot),
                    HOST_IP,
                ),
                (
                    format!("krsn{tag}x{slot}"),
                    "node",
                    node_host(slot),
                    DEST_IP,
                ),
            ] {
                let inner_ip = Ipv4Addr::from(u32::from(host_ip) + 1);
                ip(&[
                    "link", "add", &host, "type", "veth", "peer", "name", inner, "netns", &name,
                ])?;
                ip(&["addr", "add", &format!("{host_ip}/30"), "dev", &host])?;
                ip(&["link", "set", &host, "up"])?;
                ip(&[
                    "-n",
                    &name,
                    "addr",
                    "add",
                    &format!("{inner_ip}/30"),
                    "dev",
                    inner,
                ])?;
                ip(&["-n", &name, "link", "set", inner, "up"])?;
                ip(&[
                    "-n",
                    &name,
                    "route",
                    "add",
                    &format!("{to}/32"),
                    "via",
                    &host_ip.to_string(),
                ])?;
            }
            ip(&["-n", &name, "link", "set", "lo", "up"])?;
        }
        Ok(made)
    }

    /// Slot `slot`'s namespace.
    pub fn name(&self, slot: usize) -> Option<&str> {
        self.names.get(slot).map(String::as_str)
    }

    /// Takes slot `slot`'s end of its control link down (a partition:
    /// packets are dropped, nothing is reset) or up again.
    ///
    /// # Errors
    /// There is no such slot, or the `ip` command fails.
    pub fn set_link(&self, slot: usize, up: bool) -> anyhow::Result<()> {
        let name = self.name(slot).context("no such agent slot")?;
        ip(&[
            "-n",
            name,
            "link",
            "set",
            "ctl",
            if up { "up" } else { "down" },
        ])?;
        if up {
            // The route to haproxy went with the link.
            ip(&[
                "-n",
                name,
                "route",
                "replace",
                &format!("{HOST_IP}/32"),
                "via",
                &control_host(slot).to_string(),
            ])?;
        }
        Ok(())
    }
}

impl Drop for Namespaces {
    fn drop(&mut self) {
        for name in &self.names {
            let _ = Command::new("ip").args(["netns", "del", name]).status();
        }
        let _ = Command::new("ip").args(["link", "del", &self.hub]).status();
    }
}

/// The agent PKI the servers and agents reload: the server's files
/// (`cluster.crt`, `cluster.key`, `agent-ca.crt`) and the agents' files
/// (`agent-ca.crt`, `proxy-agent.crt`, `proxy-agent.key`) in two
/// directories, replaced whole by rename as kubelet updates a Secret.
pub struct RotatingPki {
    /// The servers' files.
    pub server_dir: PathBuf,
    /// The agents' files.
    pub agent_dir: PathBuf,
    /// The files of an agent of the CA dropped by the last CA rotation.
    pub old_ca_dir: PathBuf,
    /// The CA before the last switch of leaves.
    old: Option<certs::Ca>,
    /// Where new files are written before they are installed.
    staging: PathBuf,
    /// The CA that signs the current leaves.
    ca: certs::Ca,
    /// CAs made so far (names the next one).
    cas: usize,
}

/// The files of one side.
const SERVER_FILES: [&str; 3] = integration_tests::SERVER_FILES;
/// The agents' files.
const AGENT_FILES: [&str; 3] = integration_tests::AGENT_FILES;

impl RotatingPki {
    /// A fresh CA and leaves, installed under `root`.
    ///
    /// # Errors
    /// Generating or writing fails.
    pub fn new(root: &Path) -> anyhow::Result<Self> {
        let pki = Self {
            server_dir: root.join("server-pki"),
            agent_dir: root.join("agent-pki"),
            old_ca_dir: root.join("agent-pki-old-ca"),
            old: None,
            staging: root.join("pki-staging"),
            ca: certs::Ca::new("soak-agent-ca-1")?,
            cas: 1,
        };
        let bundle = pki.ca.cert_pem().to_owned();
        pki.install_leaves(&bundle)?;
        Ok(pki)
    }

    /// Writes `files` (name, contents) to the staging directory and
    /// installs them into `dir`.
    fn install(&self, dir: &Path, files: &[(&str, &str)]) -> anyhow::Result<()> {
        std::fs::create_dir_all(&self.staging)?;
        for (name, contents) in files {
            std::fs::write(self.staging.join(name), contents)
                .with_context(|| format!("writing {name}"))?;
        }
        let names: Vec<&str> = files.iter().map(|(n, _)| *n).collect();
        integration_tests::install(&self.staging, dir, &names);
        Ok(())
    }

    /// New leaves from the current CA, with `bundle` as both sides' CA
    /// file; the new server certificate, PEM.
    fn install_leaves(&self, bundle: &str) -> anyhow::Result<String> {
        let sans = ["localhost", "127.0.0.1", &HOST_IP.to_string()].map(str::to_owned);
        let server = self.ca.server_cert("konnectivity-server", &sans)?;
        let agent = self.ca.client_cert("proxy-agent")?;
        self.install(
            &self.server_dir,
            &[
                (SERVER_FILES[0], &server.cert_pem),
                (SERVER_FILES[1], &server.key_pem),
                (SERVER_FILES[2], bundle),
            ],
        )?;
        self.install(
            &self.agent_dir,
            &[
                (AGENT_FILES[0], bundle),
                (AGENT_FILES[1], &agent.cert_pem),
                (AGENT_FILES[2], &agent.key_pem),
            ],
        )?;
        Ok(server.cert_pem)
    }

    /// Certificate rotation: new leaves from the same CA; the new server
    /// certificate, PEM.
    ///
    /// # Errors
    /// Generating or writing fails.
    pub fn rotate_leaves(&self) -> anyhow::Result<String> {
        let bundle = self.ca.cert_pem().to_owned();
        self.install_leaves(&bundle)
    }

    /// CA rotation, step 1 of 3: a new CA, trusted beside the old one.
    ///
    /// # Errors
    /// Generating or writing fails.
    pub fn ca_trust_both(&mut self) -> anyhow::Result<certs::Ca> {
        self.cas += 1;
        let new = certs::Ca::new(&format!("soak-agent-ca-{}", self.cas))?;
        let bundle = format!("{}{}", self.ca.cert_pem(), new.cert_pem());
        self.install(&self.server_dir, &[(SERVER_FILES[2], &bundle)])?;
        self.install(&self.agent_dir, &[(AGENT_FILES[0], &bundle)])?;
        Ok(new)
    }

    /// Step 2: leaves from the new CA, both still trusted.
    ///
    /// # Errors
    /// Generating or writing fails.
    pub fn ca_switch_leaves(&mut self, new: certs::Ca) -> anyhow::Result<()> {
        let bundle = format!("{}{}", self.ca.cert_pem(), new.cert_pem());
        self.old = Some(std::mem::replace(&mut self.ca, new));
        self.install_leaves(&bundle).map(drop)
    }

    /// Step 3: the old CA is no longer trusted.
    ///
    /// # Errors
    /// Writing fails.
    pub fn ca_drop_old(&self) -> anyhow::Result<()> {
        let bundle = self.ca.cert_pem().to_owned();
        self.install(&self.server_dir, &[(SERVER_FILES[2], &bundle)])?;
        self.install(&self.agent_dir, &[(AGENT_FILES[0], &bundle)])?;
        // An agent that missed the rotation: the old CA's leaf, trusting
        // the old CA only.
        let old = self.old.as_ref().context("no CA switched yet")?;
        let agent = old.client_cert("proxy-agent")?;
        self.install(
            &self.old_ca_dir,
            &[
                (AGENT_FILES[0], old.cert_pem()),
                (AGENT_FILES[1], &agent.cert_pem),
                (AGENT_FILES[2], &agent.key_pem),
            ],
        )
    }
}

/// Token mode's TokenReview stand-in and the agents' token file.
pub struct Tokens {
    /// The stub.
    pub stub: TokenReviewStub,
    /// The token file the agents read.
    pub path: PathBuf,
}

impl Tokens {
    /// Starts the stub, knowing the agents' token.
    ///
    /// # Errors
    /// The token file cannot be written.
    pub async fn start(root: &Path) -> anyhow::Result<Self> {
        let stub = TokenReviewStub::start().await;
        let token = service_account_token(AUDIENCE, AGENT_TOKEN);
        stub.allow(
            &token,
            Identity {
                username: "system:serviceaccount:kube-system:konnectivity-agent".to_owned(),
                audiences: vec![AUDIENCE.to_owned()],
                node: None,
            },
        );
        let path = root.join("agent-token");
        std::fs::write(&path, token).context("writing the agents' token")?;
        Ok(Self { stub, path })
    }
}

/// Which frontend protocol a server speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrontendMode {
    /// `ProxyService/Proxy`.
    Grpc,
    /// `CONNECT`.
    HttpConnect,
}

impl FrontendMode {
    /// `--mode`.
    pub fn flag(self) -> &'static str {
        match self {
            Self::Grpc => "grpc",
            Self::HttpConnect => "http-connect",
        }
    }
}

/// One proxy-server replica: its ports stay across restarts (haproxy
/// knows them).
pub struct Server {
    /// 0 or 1.
    pub index: usize,
    /// Its frontend protocol.
    pub mode: FrontendMode,
    /// The frontend socket (the gRPC server's).
    pub uds: PathBuf,
    /// How our CONNECT client reaches the CONNECT server: mTLS TCP.
    pub connect: Option<client::dial::Transport>,
    /// The agent listener (127.0.0.1).
    pub agent_addr: SocketAddr,
    /// The health port (`/metrics`).
    pub health: SocketAddr,
    /// The process, while it runs.
    pub process: Option<Process>,
    /// Processes started so far (names the logs).
    starts: usize,
    /// Its flags.
    args: Vec<String>,
    /// Its log directory.
    logs: PathBuf,
}

/// The CONNECT frontend's certificates (server, client, their CA): the
/// CONNECT server listens on mTLS TCP, where a broken tunnel can end with
/// a reset (a Unix socket has none). They never rotate.
pub struct FrontendPki {
    /// The files: `frontend-ca.crt`, `proxy-frontend.*`, `proxy-client.*`.
    pub dir: PathBuf,
    /// Our CONNECT client's TLS (trust and client certificate).
    pub client: Arc<rustls::ClientConfig>,
}

impl FrontendPki {
    /// Fresh certificates under `root`.
    ///
    /// # Errors
    /// Generating, writing or loading them fails.
    pub fn new(root: &Path) -> anyhow::Result<Self> {
        let dir = root.join("frontend-pki");
        certs::ClusterPki::generate(&[])?.write_to(&dir)?;
        let client = ops::tls::client_config(
            &dir.join("frontend-ca.crt"),
            Some((&dir.join("proxy-client.crt"), &dir.join("proxy-client.key"))),
            &[],
        )?;
        Ok(Self { dir, client })
    }
}

/// Server `index`'s audit log, kept across its restarts (appended to).
pub fn audit_log(root: &Path, index: usize) -> PathBuf {
    root.join(format!("server-{index}.audit.jsonl"))
}

/// The agent an audit record's `agent_id` names: a slot by its
/// [`AgentPod::agent_id`], a probe, or none.
pub fn carrier_of(agent_id: Option<&str>) -> Carrier {
    let Some(id) = agent_id else {
        return Carrier::Unknown;
    };
    if id.starts_with("soak-probe-") {
        return Carrier::Probe;
    }
    id.strip_prefix("soak-agent-")
        .and_then(|rest| rest.split_once('-'))
        .and_then(|(slot, _)| slot.parse().ok())
        .map_or(Carrier::Unknown, Carrier::Slot)
}

/// Every dial the `servers` servers' audit logs under `root` recorded,
/// its start on `clock` (lines that are not a server's tunnel record are
/// skipped).
pub fn read_audited(root: &Path, servers: usize, clock: RunClock) -> Vec<Audited> {
    use ops::audit::record::{FrontendKind, ServerTunnel};
    let mut audited = Vec::new();
    for server in 0..servers {
        let Ok(text) = std::fs::read_to_string(audit_log(root, server)) else {
            continue;
        };
        for line in text.lines() {
            let Ok(record) = serde_json::from_str::<ServerTunnel>(line) else {
                continue;
            };
            let key = match record.frontend_kind {
                FrontendKind::Grpc => DialKey::Random(record.dial_id),
                FrontendKind::HttpConnect => DialKey::Peer(record.frontend_peer),
            };
            let unix_ns = record
                .start
                .0
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX));
            audited.push(Audited {
                server,
                key,
                started: clock.from_unix_nanos(unix_ns),
                agent: carrier_of(record.agent_id.as_deref()),
            });
        }
    }
    audited
}

/// Flags common to the soak's servers.
pub struct ServerSetup<'a> {
    /// Where the files and logs go.
    pub root: &'a Path,
    /// The PKI.
    pub pki: &'a RotatingPki,
    /// The CONNECT frontend's certificates.
    pub frontend: &'a FrontendPki,
    /// The TokenReview stand-in in token mode.
    pub tokens: Option<&'a Tokens>,
    /// `--backend-dial-timeout`.
    pub dial_timeout: Duration,
    /// `--keepalive-time` (towards agents).
    pub keepalive: Duration,
}

impl ServerSetup<'_> {
    /// How the servers authenticate agents: the agent CA (mTLS), or
    /// TokenReviews against the stand-in API (token mode).
    fn agent_auth(&self) -> Vec<String> {
        match self.tokens {
            None => vec![format!(
                "--cluster-ca-cert={}",
                self.pki.server_dir.join("agent-ca.crt").display()
            )],
            Some(tokens) => vec![
                "--agent-namespace=kube-system".to_owned(),
                "--agent-service-account=konnectivity-agent".to_owned(),
                format!("--authentication-audience={AUDIENCE}"),
                format!("--kubeconfig={}", tokens.stub.kubeconfig.display()),
                // Short, so that an outage of the API meets agents whose
                // review is no longer cached.
                "--token-review-cache-ttl=10s".to_owned(),
            ],
        }
    }
}

impl Server {
    /// Starts replica `index` in `mode` and waits until it answers on its
    /// health port.
    ///
    /// # Errors
    /// It cannot start, or does not answer within 30 s.
    pub async fn start(
        bins: &Binaries,
        setup: &ServerSetup<'_>,
        index: usize,
        mode: FrontendMode,
    ) -> anyhow::Result<Self> {
        let (agent_port, health_port) = free_ports()?;
        let uds = setup.root.join(format!("server-{index}.sock"));
        let file = |f: &str| setup.pki.server_dir.join(f).display().to_string();
        let mut args = vec![format!("--mode={}", mode.flag())];
        let connect = match mode {
            FrontendMode::Grpc => {
                args.extend([
                    format!("--uds-name={}", uds.display()),
                    "--server-port=0".to_owned(),
                ]);
                None
            }
            FrontendMode::HttpConnect => {
                let (port, _) = free_ports()?;
                let pem = |f: &str| setup.frontend.dir.join(f).display().to_string();
                args.extend([
                    "--server-bind-address=127.0.0.1".to_owned(),
                    format!("--server-port={port}"),
                    format!("--server-cert={}", pem("proxy-frontend.crt")),
                    format!("--server-key={}", pem("proxy-frontend.key")),
                    format!("--server-ca-cert={}", pem("frontend-ca.crt")),
                ]);
                Some(client::dial::Transport::Tls {
                    addr: SocketAddr::from(([127, 0, 0, 1], port)),
                    server_name: "127.0.0.1".to_owned(),
                    tls: setup.frontend.client.clone(),
                })
            }
        };
        args.extend([
            format!("--cluster-cert={}", file("cluster.crt")),
            format!("--cluster-key={}", file("cluster.key")),
            "--agent-bind-address=127.0.0.1".to_owned(),
            format!("--agent-port={agent_port}"),
            "--health-bind-address=127.0.0.1".to_owned(),
            format!("--health-port={health_port}"),
            "--admin-port=0".to_owned(),
            format!("--server-id=soak-server-{index}"),
            // Every dial's record, for the judge's attribution of a failed
            // dial to the agent that answered it (never rotated away).
            format!(
                "--audit-log-path={}",
                audit_log(setup.root, index).display()
            ),
            "--audit-log-maxsize=1000000".to_owned(),
            "--server-count=2".to_owned(),
            format!("--keepalive-time={}ms", setup.keepalive.as_millis()),
            format!(
                "--backend-dial-timeout={}ms",
                setup.dial_timeout.as_millis()
            ),
        ]);
        args.extend(setup.agent_auth());
        args.extend(bins.extra.iter().cloned());
        let mut server = Self {
            index,
            mode,
            uds,
            connect,
            agent_addr: SocketAddr::from(([127, 0, 0, 1], agent_port)),
            health: SocketAddr::from(([127, 0, 0, 1], health_port)),
            process: None,
            starts: 0,
            args,
            logs: setup.root.to_owned(),
        };
        server.restart(bins).await?;
        Ok(server)
    }

    /// Starts the process again (after a kill) on the same ports and files.
    ///
    /// # Errors
    /// It cannot start, or does not answer within 30 s.
    pub async fn restart(&mut self, bins: &Binaries) -> anyhow::Result<()> {
        self.starts += 1;
        let log = self
            .logs
            .join(format!("server-{}.{}.log", self.index, self.starts));
        self.process = Some(Process::spawn(
            format!("proxy-server {}", self.index),
            &bins.server,
            &self.args,
            log,
        )?);
        let deadline = tokio::time::Instant::now() + START_LIMIT;
        loop {
            if let Some(p) = &mut self.process {
                p.check_alive()?;
            }
            if let Ok((200, _)) = probe::http_get(self.health, "/healthz").await {
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                bail!(
                    "proxy-server {} did not answer within {START_LIMIT:?}",
                    self.index
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Processes started so far (the current one's number).
    pub fn starts(&self) -> usize {
        self.starts
    }

    /// The process id while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.process.as_ref().map(Process::pid)
    }
}

/// Flags common to the soak's agents.
pub struct AgentSetup {
    /// proxy-agent's flags but the id and ports.
    pub args: Vec<String>,
    /// Where the logs go.
    pub logs: PathBuf,
}

impl AgentSetup {
    /// Agents with the files in `dir` reaching the servers through haproxy
    /// at `lb`.
    pub fn new(root: &Path, dir: &Path, tokens: Option<&Tokens>, lb: SocketAddr) -> Self {
        let file = |f: &str| dir.join(f).display().to_string();
        let mut args = vec![
            format!("--ca-cert={}", file("agent-ca.crt")),
            format!("--proxy-server-host={}", lb.ip()),
            format!("--proxy-server-port={}", lb.port()),
            "--sync-interval=200ms".to_owned(),
            "--sync-interval-cap=2s".to_owned(),
            "--keepalive-time=2s".to_owned(),
            "--probe-interval=500ms".to_owned(),
            "--exit-when-drained".to_owned(),
            "--admin-server-port=0".to_owned(),
        ];
        match tokens {
            None => args.extend([
                format!("--agent-cert={}", file("proxy-agent.crt")),
                format!("--agent-key={}", file("proxy-agent.key")),
            ]),
            Some(tokens) => args.push(format!(
                "--service-account-token-path={}",
                tokens.path.display()
            )),
        }
        Self {
            args,
            logs: root.to_owned(),
        }
    }

    /// Agent slot `slot`'s destination policy file (`--destination-policy-file`,
    /// followed by the agent): the sabotage rewrites it to refuse dials.
    pub fn policy_file(&self, slot: usize) -> PathBuf {
        self.logs.join(format!("policy-agent-{slot}"))
    }
}

/// A destination policy that allows every dial.
pub const ALLOW_ALL: &str = "default allow\n";

/// One agent "pod": a slot whose process is replaced on restarts and
/// rollouts, in the slot's namespace; or a probe agent on the host.
pub struct AgentPod {
    /// The slot (for a probe, a number of its own).
    pub index: usize,
    /// Its namespace; `None`: on the host (a probe).
    pub netns: Option<String>,
    /// The process, while it runs.
    pub process: Option<Process>,
    /// Its health port (`/metrics`), which changes with each process.
    pub health: SocketAddr,
    /// Processes started so far.
    pub generation: usize,
}

impl AgentPod {
    /// A slot with no process yet, in `netns` (`None`: on the host).
    pub fn new(index: usize, netns: Option<String>) -> Self {
        Self {
            index,
            netns,
            process: None,
            health: SocketAddr::from(([127, 0, 0, 1], 0)),
            generation: 0,
        }
    }

    /// Its process's `--agent-id`, which the servers' audit records name:
    /// `soak-agent-<slot>-<generation>`, or `soak-probe-<n>` (see
    /// [`carrier_of`]).
    pub fn agent_id(&self) -> String {
        match self.netns {
            Some(_) => format!("soak-agent-{}-{}", self.index, self.generation),
            None => format!("soak-probe-{}", self.index),
        }
    }

    /// Its name, with its process's generation: `agent-1.2`, `probe-3`.
    pub fn name(&self) -> String {
        match self.netns {
            Some(_) => format!("agent-{}.{}", self.index, self.generation),
            None => format!("probe-{}", self.index),
        }
    }

    /// Starts a new process in this slot (a new agent id), the old one, if
    /// any, left to whoever took it.
    ///
    /// # Errors
    /// The process cannot be started.
    pub fn start(&mut self, bins: &Binaries, setup: &AgentSetup) -> anyhow::Result<()> {
        self.generation += 1;
        let (health_port, _) = free_ports()?;
        let host: IpAddr = match self.netns {
            Some(_) => node_ip(self.index).into(),
            None => Ipv4Addr::LOCALHOST.into(),
        };
        self.health = SocketAddr::new(host, health_port);
        let mut args = setup.args.clone();
        if self.netns.is_some() {
            let policy = setup.policy_file(self.index);
            if !policy.exists() {
                std::fs::write(&policy, ALLOW_ALL)
                    .with_context(|| format!("writing {}", policy.display()))?;
            }
            args.push(format!("--destination-policy-file={}", policy.display()));
        }
        args.extend([
            format!("--agent-id={}", self.agent_id()),
            format!("--health-server-host={host}"),
            format!("--health-server-port={health_port}"),
        ]);
        args.extend(bins.extra.iter().cloned());
        let name = self.name();
        let log = setup.logs.join(format!("{name}.log"));
        self.process = Some(match &self.netns {
            Some(netns) => {
                // `ip netns exec` execs the agent: the child's pid is the agent's.
                let mut all = vec![
                    "netns".to_owned(),
                    "exec".to_owned(),
                    netns.clone(),
                    bins.agent.display().to_string(),
                ];
                all.extend(args);
                Process::spawn(name, Path::new("ip"), &all, log)?
            }
            None => Process::spawn(name, &bins.agent, &args, log)?,
        });
        Ok(())
    }

    /// The process id while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.process.as_ref().map(Process::pid)
    }
}

/// The load balancer in front of both servers, on [`HOST_IP`].
pub async fn load_balancer(servers: &[&Server]) -> ProxyProcess {
    let addrs: Vec<SocketAddr> = servers.iter().map(|s| s.agent_addr).collect();
    proxies::haproxy(HOST_IP.into(), &addrs).await
}
