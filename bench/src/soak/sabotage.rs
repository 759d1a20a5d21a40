//! The judge shown failing end to end (`--soak-sabotage`): a short run
//! that breaks a healthy agent on purpose, in the ways a bug would,
//! without telling the judge, and does the same to an agent under a
//! recorded kill:
//!
//! - a spurious close: agent 2's established sockets to the destinations
//!   destroyed (`ss -K`: the agent sees them aborted, the destination a
//!   reset), as an agent that closes connections for no reason;
//! - a crash: agent 2 stopped (SIGSTOP), killed with SIGKILL and started
//!   again as a kubelet would, its books not read and no end recorded;
//!   the judge must find the process that ended unrecorded, and what it
//!   cut;
//! - silent loss: agent 2's connections to the checked destination
//!   redirected for [`TAMPERING`] through [`RELAY`] in its namespace,
//!   which leaves 64 bytes out of every answer and ends each connection
//!   cleanly, as an agent that loses DATA without a close;
//! - an altered byte: the same, the relay inverting each answer's first
//!   byte;
//! - a stuck tunnel: every packet of agent 2 to the checked destination
//!   that carries data dropped (nftables in its namespace; handshakes and
//!   acknowledgements pass, so every tunnel it dials then reaches the
//!   destination and hangs there) for longer than the judge's stuck bound,
//!   as an agent whose connections hang;
//! - then agent 1 killed as a recorded fault, its destination sockets
//!   destroyed first: the same symptoms, excused;
//! - beside a second recorded kill of agent 1, two healthy agents broken:
//!   agent 0's destination policy rewritten to refuse every dial for 3 s
//!   (the servers' audit records name agent 0 for those failed dials), and
//!   agent 2's sockets destroyed inside the kill's window; the judge must
//!   put neither down to agent 1's kill.
//!
//! No act waits on what the judge reads (the frontends' records, the
//! destination's, the processes' books). An act that breaks what an agent
//! carries at an instant is done again, up to [`TRIES`] times, only until
//! the kernel says it broke something: `ss -K` prints the established
//! sockets it destroyed, and a stopped agent's established sockets
//! (counted by `ss` before its SIGKILL) cannot end before it dies. An
//! established socket is one whose destination has not closed it yet, so
//! the exchange it carries cannot have ended cleanly at its frontend. The
//! other acts are timed.
//!
//! The run passes only when the judge found what was done to each healthy
//! agent (in each window, ends of the kind it causes: an error or a reset
//! within 2 s of a close or a crash, silent loss or an altered byte from
//! the relay, a stuck exchange after the drop, failed dials from the
//! refusing agent; and for the crash, the process named as ended with no
//! end recorded) and nothing else (every unexcused end on a broken agent,
//! or on an agent not witnessed, within a window and its aftermath; no
//! other check failed), and excused everything on agent 1.

use std::{process::Stdio, time::Duration};

use soak_judge::{
    Carrier, Check, Fault, FaultRecord, Figures, Judgement, Reason,
    exchanges::{Ending, STUCK},
    sabotage::{self, Sabotaged},
};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

use super::{
    World,
    faults::{self, DOWN},
    system::DEST_IP,
    traffic::GIVE_UP,
};

/// The healthy agent that is broken.
const VICTIM: usize = 2;
/// The agent killed as a recorded fault.
const KILLED: usize = 1;
/// How long after a sabotage's end its symptoms may still surface: a
/// stuck exchange's frontend gives up after [`GIVE_UP`].
const AFTERMATH: f64 = GIVE_UP.as_secs_f64() + 5.0;

/// How soon after a close or a crash its ends reach their witnesses.
const PROMPT: f64 = 2.0;

/// How many times an act that breaks what agent [`VICTIM`] carries at an
/// instant is done until the kernel says it broke something: with no
/// exchange established at that instant (it happened in CI, a crash that
/// found 0 ends) the act gives the judge nothing to find.
const TRIES: usize = 20;

/// How long apart those tries are.
const TRY_EVERY: Duration = Duration::from_millis(250);

/// The relay the silent loss and the altered byte go through (a binary
/// beside `bench`).
const RELAY: &str = "tamper-relay";

/// How long agent [`VICTIM`]'s new connections to the checked destination
/// go through [`RELAY`].
const TAMPERING: Duration = Duration::from_secs(2);

/// The mark of the relay's own connections, which its redirect skips.
const RELAY_MARK: u32 = 0x6b72;

/// Something done to agent [`VICTIM`] over `from..to`, unrecorded.
fn on_victim(what: &'static str, causes: &'static [Ending], from: f64, to: f64) -> Sabotaged {
    Sabotaged {
        what,
        causes,
        after: PROMPT,
        carrier: Carrier::Slot(VICTIM),
        from,
        to,
        recorded: false,
        crashed: false,
    }
}

/// Runs `args` in namespace `ns`, `stdin` fed to it; its output.
async fn in_ns(ns: &str, args: &[&str], stdin: Option<&str>) -> anyhow::Result<String> {
    let mut child = tokio::process::Command::new("ip")
        .args(["netns", "exec", ns])
        .args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
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
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Agent slot `slot`'s namespace.
fn ns_of(world: &World, slot: usize) -> anyhow::Result<String> {
    world
        .ns
        .name(slot)
        .map(str::to_owned)
        .ok_or_else(|| anyhow::anyhow!("no agent slot {slot}"))
}

/// The lines of `ss` output: one per socket (`-H`: no header).
fn sockets(out: &str) -> usize {
    out.lines().filter(|l| !l.trim().is_empty()).count()
}

/// The established sockets in namespace `ns` to the destinations, as
/// `ss` counts them; with `destroy`, destroyed (`ss -K` prints those it
/// destroyed).
async fn established_in(ns: &str, destroy: bool) -> anyhow::Result<usize> {
    let dst = DEST_IP.to_string();
    let mut args = vec!["ss", "-H", "-tn", "state", "established", "dst", &dst];
    if destroy {
        args.insert(1, "-K");
    }
    Ok(sockets(&in_ns(ns, &args, None).await?))
}

/// Destroys every established socket of agent slot `slot` to the
/// destinations; how many the kernel destroyed.
pub async fn close_sockets(world: &World, slot: usize) -> anyhow::Result<usize> {
    established_in(&ns_of(world, slot)?, true).await
}

/// Destroys the established sockets in namespace `ns` to the
/// destinations, again every `every` (up to [`TRIES`] times) until the
/// kernel destroyed one at least; how many then, or `None`.
async fn close_until_one(ns: &str, every: Duration) -> anyhow::Result<Option<usize>> {
    for _ in 0..TRIES {
        let closed = established_in(ns, true).await?;
        if closed > 0 {
            return Ok(Some(closed));
        }
        tokio::time::sleep(every).await;
    }
    Ok(None)
}

/// Sends `signal` (`STOP`, `CONT`) to process `pid`.
async fn signal(pid: u32, signal: &str) -> anyhow::Result<()> {
    let status = tokio::process::Command::new("kill")
        .args([format!("-{signal}"), pid.to_string()])
        .status()
        .await?;
    anyhow::ensure!(status.success(), "kill -{signal} {pid}: {status}");
    Ok(())
}

/// Breaks agent [`VICTIM`] in every way and kills agent [`KILLED`] twice
/// as a recorded fault, breaking healthy agents meanwhile; what was done,
/// when.
///
/// # Errors
/// A command fails, or an agent cannot be started again.
pub async fn run(
    world: &mut World,
    records: &mut Vec<FaultRecord>,
) -> anyhow::Result<Vec<Sabotaged>> {
    let mut done = vec![spurious_close(world).await?];
    tokio::time::sleep(Duration::from_secs(2)).await;
    done.push(crash(world).await?);
    done.push(tampered(world, Tamper::Drop).await?);
    done.push(tampered(world, Tamper::Flip).await?);
    done.extend(stuck_beside_a_kill(world, records).await?);
    done.extend(broken_beside_a_kill(world, records).await?);
    if faults::agent_back(&world.agents[VICTIM]).await.is_none() {
        anyhow::bail!("agent-{VICTIM} did not come back after the sabotage");
    }
    Ok(done)
}

/// The ends a close causes.
const CLOSE_CAUSES: &[Ending] = &[Ending::Error, Ending::Reset, Ending::Cut];

/// Agent [`VICTIM`]'s established sockets to the destinations destroyed,
/// again until the kernel destroyed one at least; its window starts at
/// the first try.
async fn spurious_close(world: &World) -> anyhow::Result<Sabotaged> {
    let from = world.now();
    let Some(closed) = close_until_one(&ns_of(world, VICTIM)?, TRY_EVERY).await? else {
        anyhow::bail!("agent-{VICTIM} had no established socket to close in {TRIES} tries")
    };
    let to = world.now();
    eprintln!(
        "soak: {to:.0} s: sabotage: {closed} of agent-{VICTIM}'s established sockets destroyed"
    );
    Ok(on_victim("a spurious close", CLOSE_CAUSES, from, to))
}

/// Agent [`VICTIM`] crashes: stopped, so that nothing it carries ends
/// meanwhile; if the kernel then shows it carrying an established
/// connection, killed (SIGKILL) with its books not read and no end
/// recorded, and started again after [`DOWN`] as a kubelet restarts a
/// crashed container; else let go on and tried again.
async fn crash(world: &mut World) -> anyhow::Result<Sabotaged> {
    let from = world.now();
    for _ in 0..TRIES {
        let pid = world.agents[VICTIM]
            .pid()
            .ok_or_else(|| anyhow::anyhow!("agent-{VICTIM} is not running"))?;
        signal(pid, "STOP").await?;
        let carrying = established_in(&ns_of(world, VICTIM)?, false).await;
        match carrying {
            Ok(n) if n > 0 => {
                eprintln!(
                    "soak: {:.0} s: sabotage: agent-{VICTIM} crashes (SIGKILL, its books not \
                     read, no end recorded; {n} connections established)",
                    world.now()
                );
                if let Some(process) = world.agents[VICTIM].process.take() {
                    let _ = process.kill_reaped();
                }
                let to = world.now();
                tokio::time::sleep(DOWN).await;
                world.start_agent(VICTIM)?;
                let mut done = on_victim(
                    "a crash",
                    &[
                        Ending::Error,
                        Ending::Reset,
                        Ending::Truncated,
                        Ending::Cut,
                        Ending::DialFailed,
                    ],
                    from,
                    to,
                );
                done.crashed = true;
                return Ok(done);
            }
            _ => {
                signal(pid, "CONT").await?;
                carrying?;
            }
        }
        tokio::time::sleep(TRY_EVERY).await;
    }
    anyhow::bail!("agent-{VICTIM} carried no established connection in {TRIES} tries")
}

/// What [`RELAY`] does to every answer.
#[derive(Debug, Clone, Copy)]
enum Tamper {
    /// Bytes left out.
    Drop,
    /// A byte inverted.
    Flip,
}

impl Tamper {
    /// Its name on the relay's command line.
    fn arg(self) -> &'static str {
        match self {
            Self::Drop => "drop",
            Self::Flip => "flip",
        }
    }

    /// What it is, as the judge is told.
    fn what(self) -> &'static str {
        match self {
            Self::Drop => "silent loss (answers' bytes left out, clean ends)",
            Self::Flip => "an altered byte (each answer's first)",
        }
    }

    /// The ends it causes: bytes that differ or are missing before a
    /// clean end; over HTTP CONNECT on a Unix socket, whose only end is an
    /// EOF, a cut.
    fn causes(self) -> &'static [Ending] {
        &[Ending::Silent, Ending::Cut]
    }
}

/// Agent [`VICTIM`]'s new connections to the checked destination sent
/// through [`RELAY`] for [`TAMPERING`]: each answer relayed with `tamper`
/// done to it, each connection ended cleanly. Timed, whatever it broke;
/// the relay runs until the run's end at most.
async fn tampered(world: &mut World, tamper: Tamper) -> anyhow::Result<Sabotaged> {
    let ns = ns_of(world, VICTIM)?;
    let relay = std::env::current_exe()?.with_file_name(RELAY);
    let upstream = std::net::SocketAddr::new(DEST_IP.into(), world.dest.addr.port());
    let log = std::fs::File::create(
        world
            .root
            .path()
            .join(format!("{RELAY}-{}.log", tamper.arg())),
    )?;
    let accept_for = TAMPERING.as_secs_f64() + 2.0;
    let mut child = tokio::process::Command::new("ip")
        .args(["netns", "exec", &ns])
        .arg(&relay)
        .args([
            "--upstream",
            &upstream.to_string(),
            "--tamper",
            tamper.arg(),
        ])
        .args(["--mark", &RELAY_MARK.to_string()])
        .args(["--accept-for", &accept_for.to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(log)
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| anyhow::anyhow!("starting {}: {e}", relay.display()))?;
    let stdout = child
        .stdout
        .take()
        .ok_or_else(|| anyhow::anyhow!("{RELAY} has no stdout"))?;
    let mut line = String::new();
    tokio::time::timeout(
        Duration::from_secs(10),
        BufReader::new(stdout).read_line(&mut line),
    )
    .await
    .map_err(|_| anyhow::anyhow!("{RELAY} did not say its port within 10 s"))??;
    let port: u16 = line
        .trim()
        .parse()
        .map_err(|e| anyhow::anyhow!("{RELAY} said {line:?} for its port: {e}"))?;
    world.relays.push(child);
    let rule = format!(
        "table ip krs_tamper {{\n  chain out {{\n    type nat hook output priority -100;\n    \
         ip daddr {DEST_IP} tcp dport {} meta mark != {RELAY_MARK} redirect to :{port}\n  }}\n}}\n",
        upstream.port()
    );
    let from = world.now();
    eprintln!(
        "soak: {from:.0} s: sabotage: agent-{VICTIM}'s connections to the destination through \
         {RELAY} ({})",
        tamper.arg()
    );
    in_ns(&ns, &["nft", "-f", "-"], Some(&rule)).await?;
    tokio::time::sleep(TAMPERING).await;
    in_ns(&ns, &["nft", "delete", "table", "ip", "krs_tamper"], None).await?;
    let mut done = on_victim(tamper.what(), tamper.causes(), from, world.now());
    // An answer tampered with ends when its exchange does.
    done.after = AFTERMATH;
    Ok(done)
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
    let ns = ns_of(world, VICTIM)?;
    let port = world.dest.addr.port();
    let from = world.now();
    in_ns(
        &ns,
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
        crashed: false,
    }];
    records.push(kill);
    let hold = (STUCK + 5.0 - (world.now() - from)).max(0.0);
    tokio::time::sleep(Duration::from_secs_f64(hold)).await;
    in_ns(
        &ns,
        &["nft", "delete", "table", "inet", "krs_sabotage"],
        None,
    )
    .await?;
    let mut stuck = on_victim("a stuck tunnel", &[Ending::Stuck], from, world.now());
    stuck.after = AFTERMATH;
    done.push(stuck);
    Ok(done)
}

/// The healthy agent whose dials the sabotage refuses during
/// [`KILLED`]'s second recorded kill.
const REFUSER: usize = 0;

/// How long [`REFUSER`] refuses every dial: its policy file says `deny
/// any` for this long (the agent looks at the file once a second).
const REFUSING: Duration = Duration::from_secs(3);

/// Agent [`KILLED`] killed again as a recorded fault and, meanwhile, two
/// healthy agents broken: [`REFUSER`] made to refuse every dial for
/// [`REFUSING`] (its destination policy rewritten, as an agent whose
/// dials fail for no reason), and [`VICTIM`]'s established sockets
/// destroyed inside the kill's window. The judge must put neither down
/// to the kill of another agent.
async fn broken_beside_a_kill(
    world: &mut World,
    records: &mut Vec<FaultRecord>,
) -> anyhow::Result<Vec<Sabotaged>> {
    let policy = world.agent_setup.policy_file(REFUSER);
    let ns = ns_of(world, VICTIM)?;
    let clock = world.clock;
    let act = tokio::spawn(async move {
        // The kill under way first.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let from = clock.now();
        eprintln!("soak: {from:.0} s: sabotage: agent-{REFUSER} refuses every dial");
        tokio::fs::write(&policy, "deny any\n").await?;
        let refused = async {
            tokio::time::sleep(REFUSING).await;
            tokio::fs::write(&policy, super::system::ALLOW_ALL).await?;
            anyhow::Ok((from, clock.now()))
        };
        let closed = async {
            // Inside the kill's window: it takes [`DOWN`] and more.
            let from = clock.now();
            let Some(closed) = close_until_one(&ns, TRY_EVERY / 5).await? else {
                return anyhow::Ok(None);
            };
            eprintln!(
                "soak: {:.0} s: sabotage: {closed} of agent-{VICTIM}'s established sockets \
                 destroyed during agent-{KILLED}'s kill",
                clock.now()
            );
            anyhow::Ok(Some((from, clock.now())))
        };
        let (refused, closed) = tokio::join!(refused, closed);
        anyhow::Ok((refused, closed))
    });
    eprintln!(
        "soak: {:.0} s: agent-{KILLED} killed again as a recorded fault",
        world.now()
    );
    let kill = world.inject(Fault::AgentKill, KILLED).await;
    // Whatever the kill did, the policy is allowed again before going on.
    let (refused, closed) = act.await??;
    let kill = kill?;
    let (from, to) = refused?;
    let Some((closed_from, closed_to)) = closed? else {
        anyhow::bail!(
            "agent-{VICTIM} had no established socket to close during agent-{KILLED}'s kill"
        );
    };
    anyhow::ensure!(
        closed_from >= kill.started && closed_to <= kill.recovered,
        "agent-{VICTIM}'s close at {closed_from:.1}-{closed_to:.1} s fell outside agent-{KILLED}'s \
         kill at {:.1}-{:.1} s",
        kill.started,
        kill.recovered
    );
    records.push(kill);
    let mut refusals = on_victim(
        "dials refused by a healthy agent during another agent's kill",
        &[Ending::DialFailed],
        from,
        to,
    );
    refusals.carrier = Carrier::Slot(REFUSER);
    Ok(vec![
        refusals,
        on_victim(
            "a spurious close inside another agent's kill",
            CLOSE_CAUSES,
            closed_from,
            closed_to,
        ),
    ])
}

/// The verdict of a sabotaged run: held when the judge failed the run for
/// exactly what was done to the healthy agents (each sabotage found in its
/// window; every unexcused end on such an agent, or on an agent not
/// witnessed, within a sabotage's window and its aftermath; no other
/// check failed) and excused what was done under the recorded kills
/// ([`soak_judge::sabotage::shortfalls`]).
pub fn expect(figures: &Figures, verdict: &Judgement, done: &[Sabotaged]) -> Judgement {
    let unexcused = figures.joined.unexcused();
    for s in done.iter().filter(|s| !s.recorded) {
        eprintln!(
            "soak: sabotage: {} on {} at {:.0}-{:.0} s: {} unexcused ends found",
            s.what,
            s.carrier.describe(),
            s.from,
            s.to,
            sabotage::found(&unexcused, s)
        );
    }
    let failing: Vec<&str> = verdict.failing().map(|r| r.text.as_str()).collect();
    Judgement {
        reasons: sabotage::shortfalls(&unexcused, &failing, verdict.held(), done, AFTERMATH)
            .into_iter()
            .map(|text| Reason {
                check: Check::Correctness,
                text,
            })
            .collect(),
        performance_fatal: verdict.performance_fatal,
    }
}
