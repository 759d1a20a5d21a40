//! What each fault must show: evidence that it took effect (a fault that
//! did not happen proves nothing, and does not count as run), its
//! recovery, and a check of its own that can fail.

use crate::{
    observe::{Effect, Fault, FaultRecord, OldCa, SlowPeer},
    verdict::{Check, Reason},
};

/// The share of its rate healthy traffic must keep during a fault
/// elsewhere (a performance check).
pub const RATE_KEPT: f64 = 0.9;

/// The share of its rate healthy traffic (on the agents and servers a
/// fault did not touch) must keep during any fault, whatever the machine:
/// a correctness check, in advisory mode too. A fault elsewhere that
/// halves the traffic it does not touch is a denial of service, not
/// noise; the least share the soaks in docs/reliability.md measured is
/// 56 % (an agent rollout on a loaded machine), so half leaves room for
/// the machine and none for a real starvation.
pub const HEALTHY_FLOOR: f64 = 0.5;

/// The longest the CONNECT server may leave a slow request head open: its
/// 60 s bound on reading a head (ANP's `ReadHeaderTimeout`), plus 8 s of
/// scheduling.
pub const SLOW_HEAD_LIMIT: f64 = 68.0;

/// The longest the gRPC server may leave a slow peer open: the peer's
/// bytes are the HTTP/2 preface (24 bytes, one a second) and then the
/// preface again, whose first 9 bytes are a frame header no server may
/// accept; 33 s plus 12 s of scheduling. (A peer that sends the preface
/// and then nothing is not bounded by this check.)
pub const SLOW_PREFACE_LIMIT: f64 = 45.0;

/// Whether `r` shows that its fault took effect.
pub fn took_effect(r: &FaultRecord) -> bool {
    match &r.effect {
        Effect::Unknown => false,
        Effect::Killed { reaped } | Effect::TokenOutage { reaped, .. } => *reaped,
        Effect::Partitioned { fewest_servers } => fewest_servers.is_some_and(|n| n < 2.0),
        Effect::Stalled { tunnels, reached } => *tunnels >= 2 && *reached >= 2,
        Effect::Slowloris { peers } => !peers.is_empty(),
        Effect::Rotated { served_s, .. } => served_s.is_some(),
        Effect::CaRotated { .. } => true,
        Effect::RolledOut { exited_s, .. } => exited_s.is_some(),
    }
}

/// The evidence, in words.
pub fn effect_note(effect: &Effect) -> String {
    let secs = |s: &Option<f64>| s.map_or("never".to_owned(), |s| format!("{s:.1} s"));
    match effect {
        Effect::Unknown => "no effect recorded".to_owned(),
        Effect::Killed { reaped } => {
            if *reaped {
                "killed (reaped, SIGKILL)".to_owned()
            } else {
                "not seen dead".to_owned()
            }
        }
        Effect::Partitioned { fewest_servers } => format!(
            "the agent saw {} server(s) at the least while cut off",
            fewest_servers.map_or("?".to_owned(), |n| format!("{n:.0}"))
        ),
        Effect::Stalled { tunnels, reached } => {
            format!("{tunnels} tunnel(s) opened, {reached} reached the stalled peer")
        }
        Effect::Slowloris { peers } => slowloris_note(peers),
        Effect::Rotated {
            admitted_s,
            serial,
            presented,
            served_s,
        } => rotated_note(*admitted_s, serial, presented, *served_s),
        Effect::CaRotated { steps, old_ca } => format!(
            "an agent with the files of each step admitted in {}; an agent of the old CA {}",
            steps.iter().map(secs).collect::<Vec<_>>().join(", "),
            match old_ca {
                None => "could not be started".to_owned(),
                Some(o) => format!(
                    "{} ({:.0} handshake(s) refused)",
                    if o.connected {
                        "was admitted"
                    } else {
                        "was refused"
                    },
                    o.refusals
                ),
            }
        ),
        Effect::TokenOutage { reaped, during } => format!(
            "the agent {}, connected to {} server(s) during the outage",
            if *reaped {
                "killed to reconnect"
            } else {
                "not seen dead"
            },
            during.map_or("?".to_owned(), |n| format!("{n:.0}"))
        ),
        Effect::RolledOut {
            exited_s,
            exit_ok,
            cut,
        } => format!(
            "the old agent exited {} after SIGTERM ({}), {} connection(s) cut",
            secs(exited_s),
            if *exit_ok { "status 0" } else { "not status 0" },
            cut.map_or("?".to_owned(), |c| format!("{c:.0}"))
        ),
    }
}

/// The slow peers of each server closed, and the slowest.
fn slowloris_note(peers: &[SlowPeer]) -> String {
    let mut parts = Vec::new();
    for (http_connect, name, limit) in [
        (false, "gRPC", SLOW_PREFACE_LIMIT),
        (true, "CONNECT", SLOW_HEAD_LIMIT),
    ] {
        let mine: Vec<Option<f64>> = peers
            .iter()
            .filter(|p| p.http_connect == http_connect)
            .map(|p| p.closed_after)
            .collect();
        let closed = mine.iter().flatten().count();
        let slowest = mine.iter().flatten().copied().fold(0.0, f64::max);
        parts.push(format!(
            "{closed} of {} closed by the {name} server (slowest {slowest:.0} s, bound {limit:.0} s)",
            mine.len()
        ));
    }
    parts.join(", ")
}

/// A certificate rotation's evidence, in words: when every server
/// presented the new file's serial (or which still did not), and when an
/// agent with the new files was admitted.
fn rotated_note(
    admitted_s: Option<f64>,
    serial: &str,
    presented: &[String],
    served_s: Option<f64>,
) -> String {
    let served = match served_s {
        Some(s) => {
            format!("every server presented the new certificate (serial {serial}) in {s:.1} s")
        }
        None => {
            let old: Vec<String> = presented
                .iter()
                .enumerate()
                .filter(|(_, p)| *p != serial)
                .map(|(i, p)| format!("server-{i} {p}"))
                .collect();
            format!(
                "the servers never all presented the new certificate (serial {serial}): {}",
                old.join(", ")
            )
        }
    };
    let admitted = admitted_s.map_or("never".to_owned(), |s| format!("{s:.1} s"));
    format!("{served}; an agent with the new files admitted in {admitted}")
}

/// `agent kill -9 on agent-1 at 31 s`.
pub fn what(r: &FaultRecord) -> String {
    format!("{} on {} at {:.0} s", r.fault.name(), r.target, r.started)
}

/// The reasons one fault's record gives against the run.
pub fn reasons(r: &FaultRecord) -> Vec<Reason> {
    let what = what(r);
    let mut out = Vec::new();
    recovery_reasons(r, &what, &mut out);
    match &r.effect {
        Effect::Slowloris { peers } => slowloris_reasons(peers, &what, &mut out),
        Effect::Rotated {
            admitted_s: None, ..
        } => fail(
            &mut out,
            Check::Correctness,
            format!("{what}: no agent with the new files admitted"),
        ),
        Effect::CaRotated { steps, old_ca } => ca_reasons(steps, old_ca.as_ref(), &what, &mut out),
        Effect::RolledOut {
            exited_s,
            exit_ok,
            cut,
        } => rollout_reasons(exited_s.is_some() && *exit_ok, *cut, &what, &mut out),
        _ => {}
    }
    out
}

fn fail(out: &mut Vec<Reason>, check: Check, text: String) {
    out.push(Reason { check, text });
}

/// What every fault must show: it took effect, the agents came back,
/// dials were served again, resources and the healthy rate.
fn recovery_reasons(r: &FaultRecord, what: &str, out: &mut Vec<Reason>) {
    if !took_effect(r) {
        fail(
            out,
            Check::Correctness,
            format!("{what}: did not take effect ({})", effect_note(&r.effect)),
        );
    }
    if r.back_s.is_none() {
        fail(out, Check::Correctness, format!("{what}: not back"));
    }
    if r.dials_s.is_none() {
        fail(
            out,
            Check::Correctness,
            format!("{what}: dials not served again"),
        );
    }
    if r.resources_s.is_none() {
        fail(
            out,
            Check::Performance,
            format!(
                "{what}: resources not within 5 % of baseline: {}",
                r.resources_note
            ),
        );
    }
    match r.healthy {
        Some(rate) if rate >= RATE_KEPT => {}
        Some(rate) if rate >= HEALTHY_FLOOR => fail(
            out,
            Check::Performance,
            format!(
                "{what}: healthy traffic ({}) kept {:.0} % of its rate",
                r.healthy_what,
                rate * 100.0
            ),
        ),
        Some(rate) => fail(
            out,
            Check::Correctness,
            format!(
                "{what}: healthy traffic ({}) kept {:.0} % of its rate, below the {:.0} % floor",
                r.healthy_what,
                rate * 100.0,
                HEALTHY_FLOOR * 100.0
            ),
        ),
        None => fail(
            out,
            Check::Correctness,
            format!("{what}: no rate of healthy traffic measured"),
        ),
    }
}

/// Every slow peer closed within its bound (the healthy rate beside them
/// is every fault's [`HEALTHY_FLOOR`]).
fn slowloris_reasons(peers: &[SlowPeer], what: &str, out: &mut Vec<Reason>) {
    for p in peers {
        let limit = if p.http_connect {
            SLOW_HEAD_LIMIT
        } else {
            SLOW_PREFACE_LIMIT
        };
        if !p.closed_after.is_some_and(|s| s <= limit) {
            fail(
                out,
                Check::Correctness,
                format!(
                    "{what}: a slow peer of the {} server not closed within {limit:.0} s ({})",
                    if p.http_connect { "CONNECT" } else { "gRPC" },
                    p.closed_after
                        .map_or("never".to_owned(), |s| format!("{s:.0} s"))
                ),
            );
        }
    }
}

/// An agent admitted after each step of a CA rotation, and one of the
/// dropped CA refused.
fn ca_reasons(steps: &[Option<f64>], old_ca: Option<&OldCa>, what: &str, out: &mut Vec<Reason>) {
    if steps.iter().any(Option::is_none) {
        fail(
            out,
            Check::Correctness,
            format!("{what}: an agent with the files of a step was not admitted"),
        );
    }
    match old_ca {
        Some(o) if !o.connected && o.refusals > 0.0 => {}
        Some(o) if o.connected => fail(
            out,
            Check::Correctness,
            format!("{what}: an agent of the dropped CA was admitted"),
        ),
        Some(_) => fail(
            out,
            Check::Correctness,
            format!("{what}: no server refused the agent of the dropped CA"),
        ),
        None => fail(
            out,
            Check::Correctness,
            format!("{what}: the agent of the dropped CA could not be started"),
        ),
    }
}

/// A rolled-out agent exited drained with status 0 and cut nothing.
fn rollout_reasons(exited_ok: bool, cut: Option<f64>, what: &str, out: &mut Vec<Reason>) {
    if !exited_ok {
        fail(
            out,
            Check::Correctness,
            format!("{what}: the old agent did not exit drained with status 0"),
        );
    }
    if cut != Some(0.0) {
        fail(
            out,
            Check::Correctness,
            format!(
                "{what}: the old agent cut {} connection(s)",
                cut.map_or("an unknown number of".to_owned(), |c| format!("{c:.0}"))
            ),
        );
    }
}

/// The reasons the run's faults give against it for `required` faults
/// that never took effect.
pub fn missing(required: &[Fault], records: &[FaultRecord]) -> Vec<Reason> {
    required
        .iter()
        .filter(|f| !records.iter().any(|r| r.fault == **f && took_effect(r)))
        .map(|f| Reason {
            check: Check::Correctness,
            text: format!("{}: planned, never took effect", f.name()),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::{effect_note, missing, reasons, took_effect};
    use crate::{
        observe::{Effect, Fault, FaultRecord, Hit, OldCa, SlowPeer},
        verdict::Check,
    };

    fn recovered(fault: Fault, effect: Effect) -> FaultRecord {
        let mut r = FaultRecord::new(fault, Hit::Agent(1), 82.0);
        r.target = "agent-1".to_owned();
        r.back_s = Some(0.3);
        r.dials_s = Some(0.0);
        r.healthy = Some(1.0);
        r.resources_s = Some(5.0);
        r.effect = effect;
        r
    }

    fn texts(r: &FaultRecord) -> Vec<String> {
        reasons(r).into_iter().map(|r| r.text).collect()
    }

    #[test]
    fn a_fault_that_took_effect_and_recovered_gives_no_reason() {
        for (fault, effect) in [
            (Fault::AgentKill, Effect::Killed { reaped: true }),
            (
                Fault::Partition,
                Effect::Partitioned {
                    fewest_servers: Some(0.0),
                },
            ),
            (
                Fault::DestinationStall,
                Effect::Stalled {
                    tunnels: 2,
                    reached: 2,
                },
            ),
            (
                Fault::Rollout,
                Effect::RolledOut {
                    exited_s: Some(1.0),
                    exit_ok: true,
                    cut: Some(0.0),
                },
            ),
        ] {
            assert!(texts(&recovered(fault, effect)).is_empty(), "{fault:?}");
        }
    }

    #[test]
    fn a_fault_without_effect_is_not_run() {
        let kill = recovered(Fault::AgentKill, Effect::Killed { reaped: false });
        assert!(!took_effect(&kill));
        assert_eq!(
            texts(&kill),
            ["agent kill -9 on agent-1 at 82 s: did not take effect (not seen dead)"]
        );
        let partition = recovered(
            Fault::Partition,
            Effect::Partitioned {
                fewest_servers: Some(2.0),
            },
        );
        assert!(!took_effect(&partition));
        let required = [Fault::AgentKill, Fault::Partition, Fault::ServerKill];
        let found: Vec<String> = missing(&required, &[kill, partition])
            .into_iter()
            .map(|r| r.text)
            .collect();
        assert_eq!(
            found,
            [
                "agent kill -9: planned, never took effect",
                "partition: planned, never took effect",
                "server kill -9: planned, never took effect",
            ]
        );
    }

    #[test]
    fn a_slow_rate_or_resources_are_performance_and_a_missed_recovery_is_correctness() {
        let mut slow = recovered(Fault::AgentKill, Effect::Killed { reaped: true });
        slow.healthy = Some(0.88);
        slow.resources_s = None;
        let found = reasons(&slow);
        assert_eq!(found.len(), 2, "{found:?}");
        assert!(found.iter().all(|r| r.check == Check::Performance));
        assert!(found[1].text.contains("kept 88 % of its rate"), "{found:?}");

        let mut stuck = recovered(Fault::AgentKill, Effect::Killed { reaped: true });
        stuck.back_s = None;
        stuck.dials_s = None;
        stuck.healthy = None;
        let found = reasons(&stuck);
        assert_eq!(found.len(), 3, "{found:?}");
        assert!(found.iter().all(|r| r.check == Check::Correctness));
    }

    #[test]
    fn slow_peers_left_open_or_starving_others_fail() {
        let peers = vec![
            SlowPeer {
                http_connect: false,
                closed_after: Some(33.0),
            },
            SlowPeer {
                http_connect: true,
                closed_after: Some(61.0),
            },
        ];
        let fine = recovered(
            Fault::Slowloris,
            Effect::Slowloris {
                peers: peers.clone(),
            },
        );
        assert!(texts(&fine).is_empty());
        let mut open = peers.clone();
        open[1].closed_after = None;
        open[0].closed_after = Some(50.0);
        let mut starved = recovered(Fault::Slowloris, Effect::Slowloris { peers: open });
        starved.healthy = Some(0.4);
        let found = reasons(&starved);
        let correctness: Vec<&str> = found
            .iter()
            .filter(|r| r.check == Check::Correctness)
            .map(|r| r.text.as_str())
            .collect();
        assert_eq!(
            correctness,
            [
                "slowloris frontends on agent-1 at 82 s: healthy traffic () kept 40 % of its rate, below the 50 % floor",
                "slowloris frontends on agent-1 at 82 s: a slow peer of the gRPC server not closed within 45 s (50 s)",
                "slowloris frontends on agent-1 at 82 s: a slow peer of the CONNECT server not closed within 68 s (never)",
            ]
        );
    }

    #[test]
    fn a_ca_rotation_must_admit_the_new_and_refuse_the_old() {
        let rotated = |old_ca| {
            recovered(
                Fault::CaRotation,
                Effect::CaRotated {
                    steps: [Some(0.3); 3],
                    old_ca,
                },
            )
        };
        let refused = Some(OldCa {
            connected: false,
            refusals: 3.0,
        });
        assert!(texts(&rotated(refused)).is_empty());
        let admitted = Some(OldCa {
            connected: true,
            refusals: 0.0,
        });
        assert_eq!(
            texts(&rotated(admitted)),
            ["CA rotation on agent-1 at 82 s: an agent of the dropped CA was admitted"]
        );
        let unseen = Some(OldCa {
            connected: false,
            refusals: 0.0,
        });
        assert_eq!(
            texts(&rotated(unseen)),
            ["CA rotation on agent-1 at 82 s: no server refused the agent of the dropped CA"]
        );
        let mut late = rotated(refused);
        late.effect = Effect::CaRotated {
            steps: [Some(0.3), None, Some(0.3)],
            old_ca: refused,
        };
        assert_eq!(reasons(&late).len(), 1);
    }

    #[test]
    fn a_rollout_that_cut_or_did_not_exit_fails() {
        let cut = recovered(
            Fault::Rollout,
            Effect::RolledOut {
                exited_s: Some(1.0),
                exit_ok: true,
                cut: Some(2.0),
            },
        );
        assert_eq!(
            texts(&cut),
            ["agent rollout on agent-1 at 82 s: the old agent cut 2 connection(s)"]
        );
        let stayed = recovered(
            Fault::Rollout,
            Effect::RolledOut {
                exited_s: None,
                exit_ok: false,
                cut: None,
            },
        );
        assert_eq!(reasons(&stayed).len(), 3, "{:?}", reasons(&stayed));
    }

    #[test]
    fn a_stall_whose_tunnels_did_not_both_reach_the_stalled_peer_did_not_take_effect() {
        let stall = |tunnels, reached| {
            took_effect(&recovered(
                Fault::DestinationStall,
                Effect::Stalled { tunnels, reached },
            ))
        };
        assert!(stall(2, 2));
        assert!(!stall(2, 1));
        assert!(!stall(1, 1));
    }

    #[test]
    fn a_slowloris_note_counts_each_servers_peers_apart() {
        let peers = vec![
            SlowPeer {
                http_connect: false,
                closed_after: Some(33.0),
            },
            SlowPeer {
                http_connect: true,
                closed_after: None,
            },
            SlowPeer {
                http_connect: true,
                closed_after: Some(61.0),
            },
        ];
        assert_eq!(
            effect_note(&Effect::Slowloris { peers }),
            "1 of 1 closed by the gRPC server (slowest 33 s, bound 45 s), \
             1 of 2 closed by the CONNECT server (slowest 61 s, bound 68 s)"
        );
    }

    #[test]
    fn a_certificate_rotation_that_admitted_no_agent_with_the_new_files_fails() {
        let rotated = |admitted_s| {
            recovered(
                Fault::CertRotation,
                Effect::Rotated {
                    admitted_s,
                    serial: "0a:01".to_owned(),
                    presented: vec!["0a:01".to_owned(); 2],
                    served_s: Some(0.1),
                },
            )
        };
        assert!(texts(&rotated(Some(0.4))).is_empty());
        assert_eq!(
            texts(&rotated(None)),
            ["certificate rotation on agent-1 at 82 s: no agent with the new files admitted"]
        );
    }

    /// An agent trusts the same CA whether or not a server reloaded its
    /// leaf: only the serial the server presents tells.
    #[test]
    fn a_certificate_rotation_whose_servers_present_the_old_leaf_fails() {
        let r = recovered(
            Fault::CertRotation,
            Effect::Rotated {
                admitted_s: Some(0.4),
                serial: "0a:02".to_owned(),
                presented: vec!["0a:02".to_owned(), "0a:01".to_owned()],
                served_s: None,
            },
        );
        assert!(!took_effect(&r));
        assert_eq!(
            texts(&r),
            [
                "certificate rotation on agent-1 at 82 s: did not take effect (the servers never \
                 all presented the new certificate (serial 0a:02): server-1 0a:01; an agent with \
                 the new files admitted in 0.4 s)"
            ]
        );
    }

    #[test]
    fn slow_peers_may_halve_the_healthy_traffic_and_no_more() {
        let beside = |healthy| {
            let peers = vec![SlowPeer {
                http_connect: false,
                closed_after: Some(30.0),
            }];
            let mut r = recovered(Fault::Slowloris, Effect::Slowloris { peers });
            r.healthy = Some(healthy);
            reasons(&r)
                .into_iter()
                .filter(|r| r.check == Check::Correctness)
                .count()
        };
        // Half is a performance reason only (below RATE_KEPT), less is
        // a denial of service.
        assert_eq!(beside(0.5), 0);
        assert_eq!(beside(0.49), 1);
    }

    /// Every fault, not only slow peers: healthy traffic that keeps less
    /// than half its rate fails the run (in advisory mode too: a
    /// correctness reason); below 90 % it is a performance reason.
    #[test]
    fn healthy_traffic_below_the_floor_fails_any_fault() {
        for fault in [Fault::AgentKill, Fault::ServerKill, Fault::Partition] {
            let check = |healthy| {
                let mut r = recovered(fault, Effect::Killed { reaped: true });
                r.healthy = Some(healthy);
                reasons(&r)
                    .into_iter()
                    .filter(|r| r.text.contains("healthy traffic"))
                    .map(|r| r.check)
                    .collect::<Vec<_>>()
            };
            assert_eq!(check(0.95), [], "{fault:?}");
            assert_eq!(check(0.6), [Check::Performance], "{fault:?}");
            assert_eq!(check(0.45), [Check::Correctness], "{fault:?}");
        }
    }

    #[test]
    fn a_rollout_whose_old_agent_exited_with_a_failure_fails() {
        let failed = recovered(
            Fault::Rollout,
            Effect::RolledOut {
                exited_s: Some(1.0),
                exit_ok: false,
                cut: Some(0.0),
            },
        );
        assert_eq!(
            texts(&failed),
            ["agent rollout on agent-1 at 82 s: the old agent did not exit drained with status 0"]
        );
    }
}
