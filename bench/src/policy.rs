//! The policy scenario (issue 45): what the recommended destination policy
//! costs the agent per single-use tunnel. Two gRPC-mode deployments side by
//! side, the same but for the agent's `--destination-policy-file`: none,
//! and the rules of `deploy/konnectivity-agent-policy.yaml`. Each
//! repetition runs single-use tunnels at 8 clients (each dial, 1 KiB each
//! way, close) through one then the other, in alternating order, with our
//! client and with grpc-go; the ratios are per repetition.
//!
//! The bench's destinations are on 127.0.0.1, which the shipped
//! `deny loopback` refuses; so that line is written out as the 24 networks
//! that make up 127.0.0.0/8 without the destination's address, plus
//! `deny ::1`. The agent then checks 27 rules where the shipped file has 3,
//! so the cost measured is, if anything, above the shipped file's. The
//! check itself (host parsed, address checked) is also timed in this
//! process, a million times over.

use std::{net::Ipv4Addr, path::Path};

use anyhow::{Context, bail};
use client::dial::Mode;

use crate::{
    backends::Backends,
    clients::{self, ClientRun},
    grpc_go::GoFrontend,
    report::{self, Recorder, Route},
    scenarios::{self, Target, Timing},
    system::{Binaries, Deployment},
};

/// The ConfigMap the recommended rules come from.
const MANIFEST: &str = include_str!("../../deploy/konnectivity-agent-policy.yaml");

/// Tunnels at once, as the `dial` rows at eight.
const CONCURRENCY: usize = 8;

/// The rule lines of the ConfigMap's `policy` key, as the agent's volume
/// holds them (indentation kept: the agent splits lines on whitespace).
pub fn recommended() -> anyhow::Result<Vec<&'static str>> {
    let mut lines = MANIFEST.lines().skip_while(|l| l.trim() != "policy: |");
    if lines.next().is_none() {
        bail!("deploy/konnectivity-agent-policy.yaml has no `policy: |` key");
    }
    Ok(lines
        .take_while(|l| l.trim().is_empty() || l.starts_with("    "))
        .collect())
}

/// The networks that make up 127.0.0.0/8 without `keep`: for each prefix
/// length from 9 to 32, the sibling of the network holding `keep`.
pub fn loopback_without(keep: Ipv4Addr) -> Vec<String> {
    let keep = u32::from(keep);
    (9..=32)
        .map(|len: u32| {
            let bit = 1u32 << (32 - len);
            let mask = !(bit - 1);
            let sibling = (keep & mask) ^ bit;
            format!("{}/{len}", Ipv4Addr::from(sibling))
        })
        .collect()
}

/// The recommended rules with `deny loopback` written so that `keep`
/// (the bench's destinations) is allowed, and nothing else of loopback.
///
/// # Errors
/// The shipped file has no `deny loopback` line, or `keep` is not loopback.
pub fn bench_policy(keep: Ipv4Addr) -> anyhow::Result<String> {
    if !keep.is_loopback() {
        bail!("the bench's destinations are on {keep}, not loopback");
    }
    let mut found = false;
    let mut text = String::new();
    for line in recommended()? {
        if line.trim() == "deny loopback" {
            found = true;
            for net in loopback_without(keep) {
                text.push_str(&format!("deny {net}\n"));
            }
            text.push_str("deny ::1\n");
        } else {
            text.push_str(line);
            text.push('\n');
        }
    }
    if !found {
        bail!("deploy/konnectivity-agent-policy.yaml has no `deny loopback` line");
    }
    Ok(text)
}

/// Checks of one destination in [`check_ns`].
const CHECKS: u32 = 1_000_000;

/// What the policy adds to a dial of `destination` (`host:port`), timed in
/// this process: splitting and normalising the host, and checking its
/// address against `text`'s rules; nanoseconds per dial.
///
/// # Errors
/// `text` is not a policy, or `destination` not a numeric `host:port`.
pub fn check_ns(text: &str, destination: &str) -> anyhow::Result<f64> {
    use proxy_agent::policy::{self, Host, Policy};
    let policy = Policy::parse(text, Vec::new()).context("the bench's policy")?;
    let start = std::time::Instant::now();
    for _ in 0..CHECKS {
        let address = std::hint::black_box(destination);
        let (host, port) = policy::split_host_port(address).context("no port")?;
        let Host::Ip { addr, .. } = policy::parse_host(host) else {
            bail!("{destination} is not numeric");
        };
        let addrs = [std::net::SocketAddr::new(addr, port)];
        if policy
            .check_all(None, std::hint::black_box(&addrs))
            .is_err()
        {
            bail!("{destination} is denied");
        }
    }
    Ok(start.elapsed().as_nanos() as f64 / f64::from(CHECKS))
}

/// Rows of one client: agent µs none, agent µs recommended, agent ratio,
/// server+agent ratio.
type Rows = [&'static report::Def; 4];
/// Our client's rows, then grpc-go's.
const ROWS: [Rows; 2] = [
    [
        &report::POLICY_AGENT_US_NONE,
        &report::POLICY_AGENT_US,
        &report::POLICY_AGENT_RATIO,
        &report::POLICY_TOTAL_RATIO,
    ],
    [
        &report::POLICY_AGENT_US_NONE_GO,
        &report::POLICY_AGENT_US_GO,
        &report::POLICY_AGENT_RATIO_GO,
        &report::POLICY_TOTAL_RATIO_GO,
    ],
];

/// Records repetition `rep`: `none` and `policy` from [`clients::both`].
fn record(rec: &mut Recorder, rep: usize, none: [ClientRun; 2], policy: [ClientRun; 2]) {
    let mut errors = 0;
    for ((rows, none), policy) in ROWS.iter().zip(none).zip(policy) {
        errors += none.errors + policy.errors;
        let (Some((s0, a0)), Some((s1, a1))) = (none.cpu_us, policy.cpu_us) else {
            continue;
        };
        let values = [a0, a1, a1 / a0, (s1 + a1) / (s0 + a0)];
        for (row, value) in rows.iter().zip(values) {
            rec.push(row, Route::Grpc, rep, Some(value));
        }
        eprintln!(
            "policy rep {rep} {}: agent {a0:.1} -> {a1:.1} us/tunnel ({:.3}), server+agent {:.1} -> {:.1} ({:.3})",
            rows[0].name,
            a1 / a0,
            s0 + a0,
            s1 + a1,
            (s1 + a1) / (s0 + a0)
        );
    }
    rec.push(
        &report::POLICY_ERRORS,
        Route::Grpc,
        rep,
        Some(errors as f64),
    );
}

/// Runs the scenario: `reps` repetitions of `timing.duration` per client
/// and deployment; the notes.
///
/// # Errors
/// A deployment does not start or dies, or a run fails.
pub async fn run(
    bins: &Binaries,
    dir: &Path,
    backends: &Backends,
    go: Option<&GoFrontend>,
    (timing, reps): (Timing, usize),
    rec: &mut Recorder,
) -> anyhow::Result<Vec<String>> {
    let std::net::IpAddr::V4(keep) = backends.responder.addr.ip() else {
        bail!("the responder is not on IPv4");
    };
    let text = bench_policy(keep)?;
    let file = dir.join("policy-recommended");
    std::fs::write(&file, &text).context("writing the policy file")?;
    let ns = check_ns(&text, &backends.responder.addr.to_string())?;
    eprintln!("policy: {ns:.0} ns per dial's check, in process");
    rec.push(&report::POLICY_CHECK_NS, Route::Grpc, 0, Some(ns));
    let flag = format!("--destination-policy-file={}", file.display());
    let mut none = Deployment::start_labelled(bins, dir, Mode::Grpc, "policy-none", &[]).await?;
    let mut policy =
        Deployment::start_labelled(bins, dir, Mode::Grpc, "policy-recommended", &[flag]).await?;
    let target = |d: &Deployment| Target {
        route: Route::Grpc,
        dialer: Some(d.dialer()),
        pids: Some(d.pids()),
        health: Some(d.health),
    };
    let (t_none, t_policy) = (target(&none), target(&policy));
    // Warm both: first connections, the policy file's first look.
    for t in [&t_none, &t_policy] {
        scenarios::dial_rate(t, backends, CONCURRENCY, timing.warmup).await?;
    }
    for rep in 0..reps {
        let (first, second) = if rep % 2 == 0 {
            (&t_none, &t_policy)
        } else {
            (&t_policy, &t_none)
        };
        let a = clients::both(first, backends, go, CONCURRENCY, timing.duration).await?;
        let b = clients::both(second, backends, go, CONCURRENCY, timing.duration).await?;
        let (n, p) = if rep % 2 == 0 { (a, b) } else { (b, a) };
        record(rec, rep, n, p);
        none.check_alive()?;
        policy.check_alive()?;
    }
    Ok(vec![format!(
        "policy runs once, after the repetitions: two gRPC-mode deployments, one agent without \
         --destination-policy-file, one with deploy/konnectivity-agent-policy.yaml's rules \
         (`deny loopback` written as the 24 networks of 127.0.0.0/8 without {keep}, the \
         destinations' address, and `deny ::1`: 27 rules instead of 3); each repetition runs \
         single-use tunnels at 8 clients for {:?} per client and deployment, in alternating \
         order; ratios are recommended / none within a repetition",
        timing.duration
    )])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_without_covers_the_rest_of_127_exactly() {
        let keep = Ipv4Addr::new(127, 0, 0, 1);
        let nets: Vec<(u32, u32)> = loopback_without(keep)
            .iter()
            .map(|n| {
                let (addr, len) = n.split_once('/').unwrap();
                let len: u32 = len.parse().unwrap();
                (u32::from(addr.parse::<Ipv4Addr>().unwrap()), len)
            })
            .collect();
        let size: u64 = nets.iter().map(|(_, len)| 1u64 << (32 - len)).sum();
        assert_eq!(size, (1 << 24) - 1);
        let inside = |a: u32| {
            nets.iter()
                .any(|&(net, len)| a >> (32 - len) == net >> (32 - len))
        };
        assert!(!inside(u32::from(keep)));
        for a in ["127.0.0.0", "127.0.0.2", "127.255.255.255", "127.1.0.1"] {
            assert!(inside(u32::from(a.parse::<Ipv4Addr>().unwrap())), "{a}");
        }
        assert!(!inside(u32::from(Ipv4Addr::new(128, 0, 0, 1))));
    }

    #[test]
    fn the_bench_policy_is_the_shipped_one_but_for_loopback() {
        let text = bench_policy(Ipv4Addr::new(127, 0, 0, 1)).unwrap();
        let rules: Vec<&str> = text
            .lines()
            .map(|l| l.split('#').next().unwrap().trim())
            .filter(|l| !l.is_empty())
            .collect();
        assert_eq!(rules.len(), 27, "{text}");
        assert_eq!(rules[0], "deny metadata");
        assert_eq!(rules[26], "deny link-local");
        assert!(!text.contains("deny loopback"));
        let policy = proxy_agent::policy::Policy::parse(&text, Vec::new()).unwrap();
        use proxy_agent::policy::Decision;
        for (addr, denied) in [
            ("127.0.0.1", false),
            ("127.0.0.2", true),
            ("127.9.9.9", true),
            ("::1", true),
            ("169.254.169.254", true),
            ("10.0.0.1", false),
        ] {
            let verdict = policy.check(None, addr.parse().unwrap(), 80);
            assert_eq!(matches!(verdict, Decision::Denied(_)), denied, "{addr}");
        }
    }
}
