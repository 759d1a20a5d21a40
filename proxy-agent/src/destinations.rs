//! The destination policy in use (`--destination-policy-file`): the file
//! followed as the certificates are (re-read when it changes; a change that
//! cannot be used is logged and counted, and the last good policy kept),
//! the node's addresses for the `node` set, and the bounded log of refusals.
//! The rules themselves are [`crate::policy`]'s.

use std::{
    collections::HashMap,
    net::{IpAddr, Ipv6Addr, SocketAddr},
    path::{Path, PathBuf},
    sync::{Arc, Mutex, MutexGuard, PoisonError},
    time::{Duration, Instant},
};

use tracing::{error, info, warn};

use crate::{
    metrics::AgentMetrics,
    policy::{Policy, PolicyError},
};

/// How often, at most, dials look at the file (and at the node's addresses
/// when the policy uses them): a change is in force within this, and a
/// dial costs no file read.
pub const RECHECK: Duration = Duration::from_secs(1);

/// How long a refusal of one destination by one rule stays unlogged after
/// it was logged.
pub const LOG_EVERY: Duration = Duration::from_secs(60);

/// How many (rule, destination) pairs the refusal log remembers; past it,
/// refusals of new pairs go unlogged (still counted) until entries expire.
pub const LOG_PAIRS: usize = 1024;

/// A policy file that cannot be used at start-up.
#[derive(Debug, thiserror::Error)]
pub enum PolicyFileError {
    /// It cannot be read.
    #[error("--destination-policy-file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A line is not a rule.
    #[error("--destination-policy-file {path}: {source}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The line, and why.
        source: PolicyError,
    },
}

/// What the file was and what it made.
struct State {
    /// The file's bytes at the last look (good or bad).
    seen: Option<Vec<u8>>,
    /// The node's addresses at the last look.
    node: Vec<IpAddr>,
    /// When the file was last looked at.
    checked: Instant,
    /// The last policy built without error.
    current: Arc<Policy>,
}

struct Inner {
    /// The file; `None`: everything allowed, nothing read.
    path: Option<PathBuf>,
    state: Mutex<State>,
    /// When each (rule, destination) was last logged.
    logged: Mutex<HashMap<(Arc<str>, String), Instant>>,
    metrics: Arc<AgentMetrics>,
}

/// The agent's destination policy; clones share it.
#[derive(Clone)]
pub struct Destinations {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Destinations {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Destinations")
            .field("path", &self.inner.path)
            .finish_non_exhaustive()
    }
}

impl Destinations {
    /// No policy: every destination allowed (ANP's behaviour).
    pub fn allow_all(metrics: Arc<AgentMetrics>) -> Self {
        Self::with(None, None, Vec::new(), Policy::allow_all(), metrics)
    }

    /// The policy of `path`, followed from now on.
    ///
    /// # Errors
    /// The file cannot be read or parsed: there is no last good policy at
    /// start-up.
    pub fn load(path: &Path, metrics: Arc<AgentMetrics>) -> Result<Self, PolicyFileError> {
        let bytes = std::fs::read(path).map_err(|source| PolicyFileError::Read {
            path: path.to_owned(),
            source,
        })?;
        let node = node_addresses();
        let policy = parse(&bytes, node.clone()).map_err(|source| PolicyFileError::Parse {
            path: path.to_owned(),
            source,
        })?;
        Ok(Self::with(
            Some(path.to_owned()),
            Some(bytes),
            node,
            policy,
            metrics,
        ))
    }

    fn with(
        path: Option<PathBuf>,
        seen: Option<Vec<u8>>,
        node: Vec<IpAddr>,
        policy: Policy,
        metrics: Arc<AgentMetrics>,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                path,
                state: Mutex::new(State {
                    seen,
                    node,
                    checked: Instant::now(),
                    current: Arc::new(policy),
                }),
                logged: Mutex::new(HashMap::new()),
                metrics,
            }),
        }
    }

    /// The policy for a new dial: the file as it is (looked at no more
    /// than every [`RECHECK`]), or the last good one.
    pub fn current(&self) -> Arc<Policy> {
        let Some(path) = &self.inner.path else {
            return lock(&self.inner.state).current.clone();
        };
        let mut state = lock(&self.inner.state);
        if state.checked.elapsed() < RECHECK {
            return state.current.clone();
        }
        state.checked = Instant::now();
        let bytes = std::fs::read(path).ok();
        let node = if state.current.uses_node() || bytes != state.seen {
            node_addresses()
        } else {
            state.node.clone()
        };
        if bytes == state.seen && node == state.node {
            return state.current.clone();
        }
        state.seen.clone_from(&bytes);
        state.node.clone_from(&node);
        let parsed = match bytes {
            Some(bytes) => parse(&bytes, node).map_err(|e| e.to_string()),
            None => Err("cannot be read".to_owned()),
        };
        match parsed {
            Ok(policy) => {
                state.current = Arc::new(policy);
                info!(file = %path.display(), "destination policy changed; new dials use it");
            }
            Err(reason) => {
                self.inner.metrics.policy_reload_failed();
                error!(
                    file = %path.display(),
                    error = %reason,
                    "destination policy changed but cannot be used; new dials keep the last good one"
                );
            }
        }
        state.current.clone()
    }

    /// A dial to `destination` (as asked) was refused by `rule` at `addr`:
    /// counted, and logged unless the same rule refused the same
    /// destination within [`LOG_EVERY`].
    pub(crate) fn refused(&self, rule: &Arc<str>, destination: &str, addr: SocketAddr) {
        self.inner.metrics.dial_denied(rule);
        let now = Instant::now();
        let mut logged = lock(&self.inner.logged);
        let key = (rule.clone(), proto::text::Elided(destination).to_string());
        if logged.get(&key).is_some_and(|at| now - *at < LOG_EVERY) {
            return;
        }
        if logged.len() >= LOG_PAIRS && !logged.contains_key(&key) {
            logged.retain(|_, at| now - *at < LOG_EVERY);
            if logged.len() >= LOG_PAIRS {
                return;
            }
        }
        logged.insert(key, now);
        warn!(
            %rule,
            destination = %proto::text::Elided(destination),
            %addr,
            "dial refused by the destination policy (logged once a minute per rule and destination)"
        );
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

fn parse(bytes: &[u8], node: Vec<IpAddr>) -> Result<Policy, PolicyError> {
    let text = std::str::from_utf8(bytes).map_err(|e| PolicyError {
        line: 1 + bytes[..e.valid_up_to()]
            .iter()
            .filter(|b| **b == b'\n')
            .count(),
        reason: "not UTF-8".to_owned(),
    })?;
    Policy::parse(text, node)
}

/// The node's own addresses: the local IPv4 addresses of the kernel's
/// routing table (`/proc/net/fib_trie`, `/32 host LOCAL`) and the IPv6
/// addresses of its interfaces (`/proc/net/if_inet6`). Empty where they
/// cannot be read.
pub fn node_addresses() -> Vec<IpAddr> {
    let mut out = Vec::new();
    if let Ok(text) = std::fs::read_to_string("/proc/net/fib_trie") {
        out.extend(local_ipv4(&text));
    }
    if let Ok(text) = std::fs::read_to_string("/proc/net/if_inet6") {
        out.extend(interface_ipv6(&text));
    }
    out.sort_unstable();
    out.dedup();
    out
}

/// `|-- 10.0.0.5` followed by `/32 host LOCAL`: a local address.
fn local_ipv4(fib_trie: &str) -> Vec<IpAddr> {
    let mut out = Vec::new();
    let mut last = None;
    for line in fib_trie.lines() {
        let line = line.trim_start();
        if let Some(addr) = line.strip_prefix("|-- ") {
            last = addr.trim().parse().ok().map(IpAddr::V4);
        } else if line.starts_with("/32 host LOCAL")
            && let Some(addr) = last
        {
            out.push(addr);
        }
    }
    out
}

/// The first column of `/proc/net/if_inet6`: 32 hex digits.
fn interface_ipv6(if_inet6: &str) -> Vec<IpAddr> {
    if_inet6
        .lines()
        .filter_map(|line| {
            let hex = line.split_whitespace().next()?;
            let bits = u128::from_str_radix(hex, 16)
                .ok()
                .filter(|_| hex.len() == 32)?;
            Some(IpAddr::V6(Ipv6Addr::from(bits)))
        })
        .collect()
}

/// The scope id of an IPv6 zone: a number, or an interface's name
/// (`/sys/class/net/<name>/ifindex`).
pub(crate) fn scope_id(zone: &str) -> Option<u32> {
    if let Ok(index) = zone.parse() {
        return Some(index);
    }
    let safe = !zone.is_empty()
        && zone.len() <= 15
        && zone
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        && zone != "."
        && zone != "..";
    if !safe {
        return None;
    }
    std::fs::read_to_string(format!("/sys/class/net/{zone}/ifindex"))
        .ok()?
        .trim()
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    #[test]
    fn the_node_set_reads_the_kernels_local_addresses() {
        let fib = "Main:\n  +-- 0.0.0.0/0 3 0 5\n     |-- 10.0.2.15\n        /32 host LOCAL\n     \
                   |-- 10.0.2.255\n        /32 link BROADCAST\n";
        assert_eq!(local_ipv4(fib), vec![ip("10.0.2.15")]);
        let v6 = "00000000000000000000000000000001 01 80 10 80       lo\n\
                  fe800000000000000000000000000001 02 40 20 80     eth0\n";
        assert_eq!(interface_ipv6(v6), vec![ip("::1"), ip("fe80::1")]);
        // This machine's loopback is among them.
        assert!(node_addresses().contains(&ip("127.0.0.1")));
        assert_eq!(scope_id("lo"), Some(1));
        assert_eq!(scope_id("3"), Some(3));
        assert_eq!(scope_id("../../etc"), None);
    }

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    #[test]
    fn the_file_is_followed_and_a_bad_change_keeps_the_last_good_policy() {
        let metrics = Arc::new(AgentMetrics::unattached());
        let mut file = tempfile::NamedTempFile::new().unwrap();
        writeln!(file, "deny 127.0.0.2").unwrap();
        let destinations = Destinations::load(file.path(), metrics.clone()).unwrap();
        let denied = |d: &Destinations| {
            !matches!(
                d.current().check(None, ip("127.0.0.2"), 1),
                crate::policy::Decision::Allowed(_)
            )
        };
        assert!(denied(&destinations));
        std::fs::write(file.path(), "allow any\n").unwrap();
        lock(&destinations.inner.state).checked -= RECHECK;
        assert!(!denied(&destinations));
        std::fs::write(file.path(), "deny nonsense\n").unwrap();
        lock(&destinations.inner.state).checked -= RECHECK;
        assert!(!denied(&destinations), "the last good policy is kept");
        assert!(
            metrics
                .render()
                .contains("konnectivity_rs_agent_policy_reload_failures_total 1\n")
        );
        std::fs::write(file.path(), "deny nonsense\n").unwrap();
        let err = Destinations::load(file.path(), metrics)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("--destination-policy-file") && err.contains("line 1"),
            "{err}"
        );
    }

    #[test]
    fn refusals_are_counted_always_and_logged_within_a_bound() {
        let metrics = Arc::new(AgentMetrics::unattached());
        let destinations = Destinations::allow_all(metrics.clone());
        let rule: Arc<str> = Arc::from("deny loopback");
        let addr: SocketAddr = "127.0.0.1:1".parse().unwrap();
        for i in 0..(LOG_PAIRS + 10) {
            destinations.refused(&rule, &format!("host{i}:1"), addr);
            destinations.refused(&rule, &format!("host{i}:1"), addr);
        }
        assert_eq!(lock(&destinations.inner.logged).len(), LOG_PAIRS);
        let text = metrics.render();
        let count = 2 * (LOG_PAIRS + 10);
        assert!(
            text.contains(&format!(
                "konnectivity_rs_agent_dials_denied_total{{rule=\"deny loopback\"}} {count}\n"
            )),
            "{text}"
        );
    }
}
