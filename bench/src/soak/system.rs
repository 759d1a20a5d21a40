//! The soak's deployment: two proxy-servers (one per frontend mode) behind
//! a haproxy, agents (one of them in a network namespace the soak creates,
//! joined to the host by a veth pair, so that a partition is a link set
//! down), the certificates they reload, and the TokenReview stand-in of
//! token mode. Every process is a child killed on drop; the namespace is
//! deleted on drop.

use std::{
    net::{IpAddr, Ipv4Addr, SocketAddr},
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use anyhow::{Context, bail};
use integration_tests::{
    kube_stub::{Identity, TokenReviewStub, service_account_token},
    proxies::{self, ProxyProcess},
};

use crate::{
    probe,
    system::{Binaries, Process, free_ports},
};

/// The host's end of the control link (a veth pair): haproxy listens
/// here, so that every agent, in the namespace or not, reaches it. A
/// partition takes this link down.
pub const HOST_IP: Ipv4Addr = Ipv4Addr::new(10, 251, 0, 1);
/// The namespace's end of the control link.
pub const NS_IP: Ipv4Addr = Ipv4Addr::new(10, 251, 0, 2);
/// The host's end of the node link (a second veth pair, never cut): the
/// destinations listen here, as node-side servers stay reachable from
/// their node's agent while the control plane is partitioned away.
pub const DEST_IP: Ipv4Addr = Ipv4Addr::new(10, 251, 1, 1);
/// The namespace's end of the node link (the namespaced agent's health
/// port, so that it is watched through a partition).
pub const NS_NODE_IP: Ipv4Addr = Ipv4Addr::new(10, 251, 1, 2);
/// The audience of agent tokens in token mode.
const AUDIENCE: &str = "system:konnectivity-server";
/// The agents' token in token mode (its `jti`: the token is a JWT).
const AGENT_TOKEN: &str = "soak-agent-token";
/// How long a process may take to start listening or connecting.
const START_LIMIT: Duration = Duration::from_secs(30);

/// How agents authenticate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Auth {
    /// A client certificate.
    Mtls,
    /// A service-account token, reviewed by the TokenReview stand-in.
    Token,
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

/// A network namespace joined to the host by two veth pairs, the control
/// link ([`HOST_IP`] ↔ [`NS_IP`]) and the node link ([`DEST_IP`] ↔
/// [`NS_NODE_IP`]); deleted (with the pairs) on drop.
pub struct Namespace {
    /// Its name.
    pub name: String,
}

impl Namespace {
    /// Creates it (needs root).
    ///
    /// # Errors
    /// An `ip` command fails.
    pub fn create() -> anyhow::Result<Self> {
        let tag = std::process::id();
        let ns = Self {
            name: format!("krs-soak-{tag}"),
        };
        ip(&["netns", "add", &ns.name]).context("creating the soak's network namespace")?;
        for (host, inner, host_ip, inner_ip) in [
            (format!("krss{tag}"), "veth-a", HOST_IP, NS_IP),
            (format!("krsd{tag}"), "veth-n", DEST_IP, NS_NODE_IP),
        ] {
            ip(&[
                "link", "add", &host, "type", "veth", "peer", "name", inner, "netns", &ns.name,
            ])?;
            ip(&["addr", "add", &format!("{host_ip}/30"), "dev", &host])?;
            ip(&["link", "set", &host, "up"])?;
            ip(&[
                "-n",
                &ns.name,
                "addr",
                "add",
                &format!("{inner_ip}/30"),
                "dev",
                inner,
            ])?;
            ip(&["-n", &ns.name, "link", "set", inner, "up"])?;
        }
        ip(&["-n", &ns.name, "link", "set", "lo", "up"])?;
        Ok(ns)
    }

    /// Takes the namespace's end of the control link down (a partition:
    /// packets are dropped, nothing is reset) or up again.
    ///
    /// # Errors
    /// The `ip` command fails.
    pub fn set_link(&self, up: bool) -> anyhow::Result<()> {
        ip(&[
            "-n",
            &self.name,
            "link",
            "set",
            "veth-a",
            if up { "up" } else { "down" },
        ])
    }
}

impl Drop for Namespace {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .status();
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

    /// New leaves from the current CA, with `bundle` as both sides' CA file.
    fn install_leaves(&self, bundle: &str) -> anyhow::Result<()> {
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
        )
    }

    /// Certificate rotation: new leaves from the same CA.
    ///
    /// # Errors
    /// Generating or writing fails.
    pub fn rotate_leaves(&self) -> anyhow::Result<()> {
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
        self.ca = new;
        self.install_leaves(&bundle)
    }

    /// Step 3: the old CA is no longer trusted.
    ///
    /// # Errors
    /// Writing fails.
    pub fn ca_drop_old(&self) -> anyhow::Result<()> {
        let bundle = self.ca.cert_pem().to_owned();
        self.install(&self.server_dir, &[(SERVER_FILES[2], &bundle)])?;
        self.install(&self.agent_dir, &[(AGENT_FILES[0], &bundle)])
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
    /// The frontend socket.
    pub uds: PathBuf,
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

/// Flags common to the soak's servers.
pub struct ServerSetup<'a> {
    /// Where the files and logs go.
    pub root: &'a Path,
    /// The PKI.
    pub pki: &'a RotatingPki,
    /// The TokenReview stand-in in token mode.
    pub tokens: Option<&'a Tokens>,
    /// `--backend-dial-timeout`.
    pub dial_timeout: Duration,
    /// `--keepalive-time` (towards agents).
    pub keepalive: Duration,
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
        let mut args = vec![
            format!("--mode={}", mode.flag()),
            format!("--uds-name={}", uds.display()),
            "--server-port=0".to_owned(),
            format!("--cluster-cert={}", file("cluster.crt")),
            format!("--cluster-key={}", file("cluster.key")),
            "--agent-bind-address=127.0.0.1".to_owned(),
            format!("--agent-port={agent_port}"),
            "--health-bind-address=127.0.0.1".to_owned(),
            format!("--health-port={health_port}"),
            "--admin-port=0".to_owned(),
            format!("--server-id=soak-server-{index}"),
            "--server-count=2".to_owned(),
            format!("--keepalive-time={}ms", setup.keepalive.as_millis()),
            format!(
                "--backend-dial-timeout={}ms",
                setup.dial_timeout.as_millis()
            ),
        ];
        match setup.tokens {
            None => args.push(format!("--cluster-ca-cert={}", file("agent-ca.crt"))),
            Some(tokens) => args.extend([
                "--agent-namespace=kube-system".to_owned(),
                "--agent-service-account=konnectivity-agent".to_owned(),
                format!("--authentication-audience={AUDIENCE}"),
                format!("--kubeconfig={}", tokens.stub.kubeconfig.display()),
                // Short, so that an outage of the API meets agents whose
                // review is no longer cached.
                "--token-review-cache-ttl=10s".to_owned(),
            ]),
        }
        args.extend(bins.extra.iter().cloned());
        let mut server = Self {
            index,
            mode,
            uds,
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

    /// SIGKILLs the process.
    pub fn kill(&mut self) {
        self.process = None;
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
    /// Agents reaching the servers through haproxy at `lb`.
    pub fn new(root: &Path, pki: &RotatingPki, tokens: Option<&Tokens>, lb: SocketAddr) -> Self {
        let file = |f: &str| pki.agent_dir.join(f).display().to_string();
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
}

/// One agent "pod" slot: a process, replaced on restarts and rollouts.
pub struct AgentPod {
    /// The slot.
    pub index: usize,
    /// In the soak's namespace (the one partitions cut off).
    pub in_namespace: bool,
    /// The process, while it runs.
    pub process: Option<Process>,
    /// Its health port (`/metrics`), which changes with each process.
    pub health: SocketAddr,
    /// Processes started so far.
    pub generation: usize,
}

impl AgentPod {
    /// A slot with no process yet.
    pub fn new(index: usize, in_namespace: bool) -> Self {
        Self {
            index,
            in_namespace,
            process: None,
            health: SocketAddr::from(([127, 0, 0, 1], 0)),
            generation: 0,
        }
    }

    /// Starts a new process in this slot (a new agent id), the old one, if
    /// any, left to whoever took it.
    ///
    /// # Errors
    /// The process cannot be started.
    pub fn start(
        &mut self,
        bins: &Binaries,
        setup: &AgentSetup,
        ns: &Namespace,
    ) -> anyhow::Result<()> {
        self.generation += 1;
        let (health_port, _) = free_ports()?;
        let host: IpAddr = if self.in_namespace {
            NS_NODE_IP.into()
        } else {
            Ipv4Addr::LOCALHOST.into()
        };
        self.health = SocketAddr::new(host, health_port);
        let mut args = setup.args.clone();
        args.extend([
            format!("--agent-id=soak-agent-{}-{}", self.index, self.generation),
            format!("--health-server-host={host}"),
            format!("--health-server-port={health_port}"),
        ]);
        args.extend(bins.extra.iter().cloned());
        let log = setup
            .logs
            .join(format!("agent-{}.{}.log", self.index, self.generation));
        let name = format!("proxy-agent {}.{}", self.index, self.generation);
        self.process = Some(if self.in_namespace {
            // `ip netns exec` execs the agent: the child's pid is the agent's.
            let mut all = vec![
                "netns".to_owned(),
                "exec".to_owned(),
                ns.name.clone(),
                bins.agent.display().to_string(),
            ];
            all.extend(args);
            Process::spawn(name, Path::new("ip"), &all, log)?
        } else {
            Process::spawn(name, &bins.agent, &args, log)?
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
