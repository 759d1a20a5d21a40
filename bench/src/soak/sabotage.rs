//! The judge shown failing end to end (`--soak-sabotage`): a short run
//! that breaks a healthy agent on purpose, in the three ways a bug would,
//! without telling the judge, and does the same to an agent under a
//! recorded kill:
//!
//! - a spurious close: every destination socket of agent 2 destroyed
//!   (`ss -K`: the agent sees its sockets aborted, the destination a
//!   reset), as an agent that closes connections for no reason;
//! - a truncation: agent 2 killed with SIGKILL and started again without
//!   a fault recorded (its kernel ends its destination connections with a
//!   FIN before their last byte), as an agent that crashes;
//! - a stuck tunnel: every packet of agent 2 to the checked destination
//!   that carries data dropped (nftables in its namespace; handshakes and
//!   acknowledgements pass, so every tunnel it dials then reaches the
//!   destination and hangs there) for longer than the judge's stuck bound,
//!   as an agent whose connections hang;
//! - then agent 1 killed as a recorded fault, its destination sockets
//!   destroyed first: the same symptoms, excused;
//! - a dial refused by a healthy agent while another is killed: agent 0's
//!   destination policy rewritten to refuse every dial for 3 s during a
//!   second recorded kill of agent 1; the servers' audit records name
//!   agent 0 for those failed dials, and the judge must not put them down
//!   to agent 1's kill (timed, not repeated until a witness saw it).
//!
//! A close or a crash breaks only the exchanges the agent is carrying at
//! that instant, a few at most; with none, the act gives the judge nothing
//! to find. So each is done again (up to [`TRIES`] times) until the
//! destination saw one of agent 2's exchanges break, the ground truth
//! that there is something to find.
//!
//! The run passes only when the judge found what was done to agent 2 (in
//! each window, ends of the kind it causes: an error or a reset
//! within 2 s of a close or a crash; a stuck exchange after the drop) and
//! nothing else (every unexcused end on agent 2, or on an agent not
//! witnessed, within a window and its aftermath; no other check failed),
//! and excused everything on agent 1.

use std::{process::Stdio, time::Duration};

use soak_judge::{
    Carrier, Check, Fault, FaultRecord, Figures, Judgement, Listener, Reason,
    exchanges::{Ending, STUCK},
};
use tokio::io::AsyncWriteExt;

use super::{World, faults, system::DEST_IP, traffic::GIVE_UP};

/// The healthy agent that is broken.
const VICTIM: usize = 2;
/// The agent killed as a recorded fault.
const KILLED: usize = 1;
/// How long after a sabotage's end its symptoms may still surface: a
/// stuck exchange's frontend gives up after [`GIVE_UP`].
const AFTERMATH: f64 = GIVE_UP.as_secs_f64() + 5.0;

/// How soon after a close or a crash its ends reach their witnesses.
const PROMPT: f64 = 2.0;

/// How long an exchange agent [`VICTIM`] carries should have been open
/// at the destination before a close or a crash is done to it: one in its
/// middle, likelier to be cut than one answered and closing.
const CARRYING_FOR: f64 = 0.3;

/// How long to wait for such an exchange before acting anyway: whether
/// the act broke something is checked after it, at the destination.
const CARRYING_WITHIN: Duration = Duration::from_secs(5);

/// How many times an act is done to agent [`VICTIM`] until the
/// destination saw one of its exchanges break. An act that breaks nothing
/// (no exchange of that agent in its middle: it happened in CI, a crash
/// that found 0 ends) gives the judge nothing to find; so it is done
/// again, and the run fails, blaming the act and not the judge, only if
/// none of these broke anything.
const TRIES: usize = 10;

/// One thing done on purpose.
#[derive(Debug, Clone)]
pub struct Sabotaged {
    /// What.
    pub what: &'static str,
    /// The ends it must cause, one at least within its window.
    pub causes: &'static [Ending],
    /// How long after its end they may come.
    pub after: f64,
    /// On which agent.
    pub carrier: Carrier,
    /// From.
    pub from: f64,
    /// Until.
    pub to: f64,
    /// Under a recorded fault (so excused).
    pub recorded: bool,
}

/// Runs `args` in agent slot `slot`'s namespace.
async fn in_slot(
    world: &World,
    slot: usize,
    args: &[&str],
    stdin: Option<&str>,
) -> anyhow::Result<()> {
    let ns = world
        .ns
        .name(slot)
        .ok_or_else(|| anyhow::anyhow!("no agent slot {slot}"))?;
    let mut child = tokio::process::Command::new("ip")
        .args(["netns", "exec", ns])
        .args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()?;
    if let (Some(text), Some(mut input)) = (stdin, child.stdin.take()) {
        input.write_all(text.as_bytes()).await?;
    }
    let out = child.wait_with_output().await?;
    anyhow::ensure!(
        out.status.success(),
        "{}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(())
}

/// Destroys every socket of agent slot `slot` to the destinations.
pub async fn close_sockets(world: &World, slot: usize) -> anyhow::Result<()> {
    in_slot(
        world,
        slot,
        &["ss", "-K", "dst", &DEST_IP.to_string()],
        None,
    )
    .await
}

/// Breaks agent [`VICTIM`] three ways and kills agent [`KILLED`] as a
/// recorded fault (its sockets destroyed first); what was done, when.
///
/// # Errors
/// A command fails, or an agent cannot be started again.
pub async fn run(
    world: &mut World,
    records: &mut Vec<FaultRecord>,
) -> anyhow::Result<Vec<Sabotaged>> {
    let mut done = vec![until_broken(world, Act::Close).await?];
    tokio::time::sleep(Duration::from_secs(2)).await;
    done.push(until_broken(world, Act::Crash).await?);
    done.extend(stuck_beside_a_kill(world, records).await?);
    done.extend(refused_beside_a_kill(world, records).await?);
    if faults::agent_back(&world.agents[VICTIM]).await.is_none() {
        anyhow::bail!("agent-{VICTIM} did not come back after the sabotage");
    }
    Ok(done)
}

/// Waits up to [`CARRYING_WITHIN`] until agent [`VICTIM`] carries an
/// exchange open at the checked destination for [`CARRYING_FOR`]; how
/// many it carries so.
async fn carrying(world: &World) -> usize {
    let deadline = tokio::time::Instant::now() + CARRYING_WITHIN;
    let open = || {
        world
            .node
            .open_on(Listener::Exchanges, Carrier::Slot(VICTIM), CARRYING_FOR)
    };
    while open() == 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    open()
}

/// Whether the destination saw an exchange of agent [`VICTIM`] break
/// since `from`, waiting up to [`PROMPT`] for it.
async fn broke_since(world: &World, from: f64) -> bool {
    let deadline = tokio::time::Instant::now() + Duration::from_secs_f64(PROMPT);
    loop {
        let broken = world
            .node
            .broken_on(Listener::Exchanges, Carrier::Slot(VICTIM), from);
        if broken > 0 {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// An act on agent [`VICTIM`] that breaks what it carries at that
/// instant: a close or a crash.
#[derive(Debug, Clone, Copy)]
enum Act {
    /// Every destination socket of it destroyed.
    Close,
    /// Killed and started again, no fault recorded.
    Crash,
}

impl Act {
    /// What it is, as the judge is told.
    fn what(self) -> &'static str {
        match self {
            Self::Close => "a spurious close",
            Self::Crash => "a crash",
        }
    }

    /// The ends it must cause.
    fn causes(self) -> &'static [Ending] {
        match self {
            Self::Close => &[Ending::Error, Ending::Reset],
            Self::Crash => &[
                Ending::Error,
                Ending::Reset,
                Ending::Truncated,
                Ending::DialFailed,
            ],
        }
    }

    /// Does it once.
    async fn once(self, world: &mut World, open: usize) -> anyhow::Result<()> {
        let at = world.now();
        match self {
            Self::Close => {
                eprintln!(
                    "soak: {at:.0} s: sabotage: agent-{VICTIM}'s sockets destroyed ({open} \
                     exchanges in their middle)"
                );
                close_sockets(world, VICTIM).await
            }
            Self::Crash => {
                eprintln!(
                    "soak: {at:.0} s: sabotage: agent-{VICTIM} crashes (SIGKILL, no fault \
                     recorded; {open} exchanges in their middle)"
                );
                world.crash_agent(VICTIM).await
            }
        }
    }
}

/// Does `act` to agent [`VICTIM`], again until the destination saw one of
/// its exchanges break (the ground truth that the act did something the
/// judge must find); its window starts at the first try.
async fn until_broken(world: &mut World, act: Act) -> anyhow::Result<Sabotaged> {
    let from = world.now();
    for _ in 0..TRIES {
        let open = carrying(world).await;
        let at = world.now();
        act.once(world, open).await?;
        let to = world.now();
        if broke_since(world, at).await {
            return Ok(Sabotaged {
                what: act.what(),
                causes: act.causes(),
                after: PROMPT,
                carrier: Carrier::Slot(VICTIM),
                from,
                to,
                recorded: false,
            });
        }
    }
    anyhow::bail!(
        "{} done to agent-{VICTIM} {TRIES} times and no exchange broke",
        act.what()
    )
}

/// Agent [`VICTIM`]'s data to the destination dropped past the stuck
/// bound and, meanwhile, agent [`KILLED`] killed as a recorded fault.
async fn stuck_beside_a_kill(
    world: &mut World,
    records: &mut Vec<FaultRecord>,
) -> anyhow::Result<Vec<Sabotaged>> {
    eprintln!(
        "soak: {:.0} s: sabotage: agent-{VICTIM}'s data to the destination dropped",
        world.now()
    );
    let port = world.dest.addr.port();
    let from = world.now();
    in_slot(
        world,
        VICTIM,
        &["nft", "-f", "-"],
        Some(&format!(
            "table inet krs_sabotage {{\n  chain out {{\n    type filter hook output priority 0;\n    \
             ip daddr {DEST_IP} tcp dport {port} ip length > 100 drop\n  }}\n}}\n"
        )),
    )
    .await?;
    // The recorded kill while the tunnels hang.
    tokio::time::sleep(Duration::from_secs(2)).await;
    eprintln!(
        "soak: {:.0} s: agent-{KILLED} killed as a recorded fault, its sockets destroyed first",
        world.now()
    );
    world.close_before_kill = true;
    let kill = world.inject(Fault::AgentKill, KILLED).await;
    world.close_before_kill = false;
    let kill = kill?;
    let mut done = vec![Sabotaged {
        what: "a spurious close and a crash under a recorded kill",
        causes: &[],
        after: PROMPT,
        carrier: Carrier::Slot(KILLED),
        from: kill.started,
        to: kill.recovered,
        recorded: true,
    }];
    records.push(kill);
    let hold = (STUCK + 5.0 - (world.now() - from)).max(0.0);
    tokio::time::sleep(Duration::from_secs_f64(hold)).await;
    in_slot(
        world,
        VICTIM,
        &["nft", "delete", "table", "inet", "krs_sabotage"],
        None,
    )
    .await?;
    done.push(Sabotaged {
        what: "a stuck tunnel",
        causes: &[Ending::Stuck],
        after: AFTERMATH,
        carrier: Carrier::Slot(VICTIM),
        from,
        to: world.now(),
        recorded: false,
    });
    Ok(done)
}

/// The healthy agent whose dials the sabotage refuses during
/// [`KILLED`]'s second recorded kill.
const REFUSER: usize = 0;

/// How long [`REFUSER`] refuses every dial: its policy file says `deny
/// any` for this long (the agent looks at the file once a second).
const REFUSING: Duration = Duration::from_secs(3);

/// Agent [`KILLED`] killed again as a recorded fault and, meanwhile,
/// agent [`REFUSER`], healthy, made to refuse every dial for [`REFUSING`]
/// (its destination policy rewritten, as an agent whose dials fail for no
/// reason): the judge must not put those failed dials down to the kill of
/// another agent. The driver does not wait on the judge's witness: the
/// act is timed, whatever it broke.
async fn refused_beside_a_kill(
    world: &mut World,
    records: &mut Vec<FaultRecord>,
) -> anyhow::Result<Vec<Sabotaged>> {
    let policy = world.agent_setup.policy_file(REFUSER);
    let clock = world.clock;
    let window = std::sync::Arc::new(std::sync::Mutex::new((0.0, 0.0)));
    let act = {
        let (policy, window) = (policy.clone(), window.clone());
        tokio::spawn(async move {
            // The kill under way first.
            tokio::time::sleep(Duration::from_millis(500)).await;
            let from = clock.now();
            eprintln!("soak: {from:.0} s: sabotage: agent-{REFUSER} refuses every dial");
            tokio::fs::write(&policy, "deny any\n").await?;
            tokio::time::sleep(REFUSING).await;
            tokio::fs::write(&policy, super::system::ALLOW_ALL).await?;
            *window.lock().unwrap_or_else(|e| e.into_inner()) = (from, clock.now());
            anyhow::Ok(())
        })
    };
    eprintln!(
        "soak: {:.0} s: agent-{KILLED} killed again as a recorded fault",
        world.now()
    );
    let kill = world.inject(Fault::AgentKill, KILLED).await;
    // Whatever the kill did, the policy is allowed again before going on.
    act.await??;
    let kill = kill?;
    let (from, to) = *window.lock().unwrap_or_else(|e| e.into_inner());
    records.push(kill);
    Ok(vec![Sabotaged {
        what: "dials refused by a healthy agent during another agent's kill",
        causes: &[Ending::DialFailed],
        // The agent sees the rewritten file within a second.
        after: PROMPT,
        carrier: Carrier::Slot(REFUSER),
        from,
        to,
        recorded: false,
    }])
}

/// Each act on the healthy agent found by the judge: at least one
/// unexcused end of a kind it causes, on its agent, from its start to
/// its end plus its delay; what was missed, in words.
fn missed(unexcused: &[&soak_judge::exchanges::Judged], done: &[Sabotaged]) -> Vec<String> {
    let mut out = Vec::new();
    for s in done.iter().filter(|s| !s.recorded) {
        let found = unexcused
            .iter()
            .filter(|e| {
                e.carrier == s.carrier
                    && s.causes.contains(&e.ending)
                    && e.to >= s.from
                    && e.to <= s.to + s.after
            })
            .count();
        if found == 0 {
            out.push(format!(
                "the judge missed {} on {} at {:.0}-{:.0} s",
                s.what,
                s.carrier.describe(),
                s.from,
                s.to
            ));
        }
        eprintln!(
            "soak: sabotage: {} on {} at {:.0}-{:.0} s: {found} unexcused ends found",
            s.what,
            s.carrier.describe(),
            s.from,
            s.to
        );
    }
    out
}

/// The verdict of a sabotaged run: held when the judge failed the run for
/// exactly what was done to the healthy agent (each sabotage found in its
/// window; every unexcused end on that agent, or on an agent not
/// witnessed, within a sabotage's window and its aftermath; no other
/// check failed) and excused what was done under the recorded kill.
pub fn expect(figures: &Figures, verdict: &Judgement, done: &[Sabotaged]) -> Judgement {
    let mut reasons = Vec::new();
    let mut fail = |text: String| {
        reasons.push(Reason {
            check: Check::Correctness,
            text,
        });
    };
    let unexcused = figures.joined.unexcused();
    let within = |s: &Sabotaged, e: &soak_judge::exchanges::Judged| {
        e.to >= s.from - 1.0 && e.from <= s.to + AFTERMATH
    };
    for text in missed(&unexcused, done) {
        fail(text);
    }
    for e in &unexcused {
        let explained = done.iter().any(|s| {
            !s.recorded && (e.carrier == s.carrier || e.carrier == Carrier::Unknown) && within(s, e)
        });
        if !explained {
            fail(format!(
                "a violation no sabotage explains: {}",
                e.describe()
            ));
        }
    }
    for s in done.iter().filter(|s| s.recorded) {
        let charged = unexcused
            .iter()
            .filter(|e| e.carrier == s.carrier && e.from >= s.from && e.to <= s.to)
            .count();
        if charged > 0 {
            fail(format!(
                "{charged} end(s) of {} on {} charged to no fault",
                s.what,
                s.carrier.describe()
            ));
        }
    }
    let prefix = "no fault on its agent or server explains";
    for r in verdict.failing() {
        if !r.text.starts_with(prefix) && !r.text.starts_with("and ") {
            fail(format!("a check the sabotage should not fail: {}", r.text));
        }
    }
    if verdict.held() {
        fail("the judge found nothing wrong".to_owned());
    }
    Judgement {
        reasons,
        performance_fatal: verdict.performance_fatal,
    }
}
