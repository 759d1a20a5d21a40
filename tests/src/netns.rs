//! Two network namespaces a test makes for itself: a hub, where the test
//! runs (re-executed inside it by [`run_in_hub`]) with proxy-server, the
//! destinations and most agents, and a [`Node`] joined to the hub by a veth
//! pair, where one agent runs behind a link the test can take down (at
//! either end) and a firewall (nftables) that can hold or slow its dials.
//! Inside the hub,
//! 127.0.0.1 is the hub's own loopback and [`HUB_IP`] its end of the link.
//! Needs root (`ip netns`, `nft`), as CI has; both namespaces, and any
//! process left in them, are removed when the test ends.

use std::{
    future::Future,
    io::Write,
    net::{Ipv4Addr, SocketAddr},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use crate::binary;

/// The hub's end of the link.
pub const HUB_IP: Ipv4Addr = Ipv4Addr::new(10, 251, 0, 1);
/// The node's end of the link.
pub const NODE_IP: Ipv4Addr = Ipv4Addr::new(10, 251, 0, 2);
/// The hub's interface.
const HUB_DEV: &str = "veth-h";
/// The node's interface.
const NODE_DEV: &str = "veth-n";
/// The nftables table the node's rules go in.
const TABLE: &str = "krs";
/// Tells the re-executed test which node namespace is its.
const NODE_ENV: &str = "KONNECTIVITY_TEST_NODE_NETNS";
/// Where the re-executed test says it ran to its end.
const DONE_ENV: &str = "KONNECTIVITY_TEST_NETNS_DONE";
/// The longest a test may run inside the hub.
const LIMIT: Duration = Duration::from_secs(180);

/// Runs `ip` with `args`; panics with its error output if it fails.
fn ip(args: &[&str]) {
    let out = Command::new("ip")
        .args(args)
        .output()
        .expect("running ip (iproute2; scripts/test installs it)");
    assert!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The hub and the node, made by the test outside them; on drop, every
/// process left in them is killed and both are deleted.
struct Pair {
    hub: String,
    node: String,
}

impl Pair {
    fn create(tag: &str) -> Self {
        // Unique on the machine: the process, and the pair within it (cargo
        // test runs tests whose tags agree in one process).
        static PAIRS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = PAIRS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let id = std::process::id();
        let pair = Self {
            hub: format!("krs-{tag}-h{id}-{n}"),
            node: format!("krs-{tag}-n{id}-{n}"),
        };
        ip(&["netns", "add", &pair.hub]);
        ip(&["netns", "add", &pair.node]);
        // Made inside the hub, so no name touches the host's namespace.
        ip(&[
            "-n", &pair.hub, "link", "add", HUB_DEV, "type", "veth", "peer", "name", NODE_DEV,
            "netns", &pair.node,
        ]);
        for (ns, dev, addr) in [
            (&pair.hub, HUB_DEV, HUB_IP),
            (&pair.node, NODE_DEV, NODE_IP),
        ] {
            ip(&["-n", ns, "addr", "add", &format!("{addr}/30"), "dev", dev]);
            ip(&["-n", ns, "link", "set", dev, "up"]);
            ip(&["-n", ns, "link", "set", "lo", "up"]);
        }
        pair
    }
}

impl Drop for Pair {
    fn drop(&mut self) {
        for ns in [&self.hub, &self.node] {
            // Processes a failed test left behind: they are its own.
            if let Ok(out) = Command::new("ip").args(["netns", "pids", ns]).output() {
                for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                    let _ = Command::new("kill").args(["-KILL", pid]).status();
                }
            }
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
    }
}

/// The node namespace, as the test inside the hub sees it.
pub struct Node {
    /// Its name.
    pub name: String,
}

impl Node {
    /// `program` to run inside the node (`ip netns exec` execs it: the
    /// child's pid is the program's).
    pub fn command(&self, program: &std::path::Path) -> Command {
        let mut command = Command::new("ip");
        command.args(["netns", "exec", &self.name]).arg(program);
        command
    }

    /// Sets the node's end of the link `up` or `down`; down, the node is
    /// silent: no packet either way, no RST, no FIN.
    pub fn link(&self, state: &str) {
        ip(&["-n", &self.name, "link", "set", NODE_DEV, state]);
    }

    /// Sets the hub's end of the link `up` or `down` (the test runs in the
    /// hub); down, the hub is silent to the node, which still has its
    /// route: the node's packets go out and are lost, as when a server
    /// vanishes.
    pub fn hub_link(&self, state: &str) {
        ip(&["link", "set", HUB_DEV, state]);
    }

    /// Loads an nftables ruleset into the node.
    fn nft(&self, ruleset: &str) {
        let mut child = Command::new("ip")
            .args(["netns", "exec", &self.name, "nft", "-f", "-"])
            .stdin(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("running nft (nftables)");
        child
            .stdin
            .take()
            .expect("piped stdin")
            .write_all(ruleset.as_bytes())
            .expect("writing the ruleset to nft");
        let out = child.wait_with_output().expect("waiting for nft");
        assert!(
            out.status.success(),
            "nft -f: {}\n{ruleset}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// The node's dials to `dest` hang: every SYN it sends there is
    /// dropped, and counted ([`dropped_syns`](Self::dropped_syns)). An
    /// agent's dial then waits for its own dial timeout (5 s) and never
    /// makes a connection.
    pub fn hold_dials_to(&self, dest: SocketAddr) {
        self.nft(&format!(
            "table ip {TABLE} {{
                counter dropped {{}}
                chain output {{
                    type filter hook output priority 0; policy accept;
                    ip daddr {ip} tcp dport {port} tcp flags & (syn | ack) == syn counter name dropped drop
                }}
            }}",
            ip = dest.ip(),
            port = dest.port(),
        ));
    }

    /// The node's dials to `dest` take a second: the first SYN of each
    /// connection is dropped (and counted), its retransmission, a second
    /// later (Linux's initial RTO), goes through. A slow path to the
    /// destinations without netem (this kernel has no `sch_netem`): the
    /// node remembers each source port it dropped a SYN from for 5 s.
    pub fn slow_dials_to(&self, dest: SocketAddr) {
        self.nft(&format!(
            "table ip {TABLE} {{
                counter dropped {{}}
                set seen {{ type ipv4_addr . inet_service; flags dynamic, timeout; timeout 5s; }}
                chain output {{
                    type filter hook output priority 0; policy accept;
                    ip daddr {ip} tcp dport {port} tcp flags & (syn | ack) == syn ip saddr . tcp sport @seen accept
                    ip daddr {ip} tcp dport {port} tcp flags & (syn | ack) == syn add @seen {{ ip saddr . tcp sport }} counter name dropped drop
                }}
            }}",
            ip = dest.ip(),
            port = dest.port(),
        ));
    }

    /// SYNs the node's rule dropped so far: each is a dial an agent in the
    /// node started towards the destination.
    pub fn dropped_syns(&self) -> u64 {
        let out = Command::new("ip")
            .args([
                "netns", "exec", &self.name, "nft", "list", "counter", "ip", TABLE, "dropped",
            ])
            .output()
            .expect("running nft");
        assert!(
            out.status.success(),
            "nft list counter: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8_lossy(&out.stdout);
        text.split_whitespace()
            .skip_while(|word| *word != "packets")
            .nth(1)
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no packet count in {text:?}"))
    }
}

/// Runs `body` inside a fresh hub, with its node. Called outside (as the
/// test harness runs the test), it makes the two namespaces, runs this same
/// test (`test`: its full name, `module::name`) again inside the hub with
/// `ip netns exec`, and fails if that run fails or never reached the body's
/// end; called inside, it runs `body` on a runtime of its own.
///
/// # Panics
/// If the namespaces cannot be made (not root?), the run inside fails or
/// takes longer than 3 minutes.
pub fn run_in_hub<F, Fut>(test: &str, body: F)
where
    F: FnOnce(Node) -> Fut,
    Fut: Future<Output = ()>,
{
    if let Ok(name) = std::env::var(NODE_ENV) {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("a runtime");
        runtime.block_on(body(Node { name }));
        let done = std::env::var(DONE_ENV).expect("where to say it is done");
        std::fs::write(done, "done").expect("saying it is done");
        return;
    }
    // Built before the namespaces, outside any of them.
    binary("proxy-server");
    binary("proxy-agent");
    let tag = test.rsplit("::").next().unwrap_or(test);
    let tag: String = tag
        .chars()
        .filter(char::is_ascii_alphanumeric)
        .take(6)
        .collect();
    let pair = Pair::create(&tag);
    let dir = tempfile::tempdir().expect("temp dir");
    let done = dir.path().join("done");
    let mut child = Command::new("ip")
        .args(["netns", "exec", &pair.hub])
        .arg(std::env::current_exe().expect("the test executable"))
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(NODE_ENV, &pair.node)
        .env(DONE_ENV, &done)
        .spawn()
        .expect("running the test inside the hub");
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child
            .try_wait()
            .expect("waiting for the test inside the hub")
        {
            break status;
        }
        if started.elapsed() > LIMIT {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the test inside the hub ran longer than {LIMIT:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(
        status.success(),
        "the test inside the hub failed ({status})"
    );
    assert_eq!(
        std::fs::read_to_string(&done).ok().as_deref(),
        Some("done"),
        "the test inside the hub did not reach its end: is {test:?} its full name?"
    );
    drop(pair);
}
