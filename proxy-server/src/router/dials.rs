//! A pending dial's state and the router's dial policy: how long a dial
//! may take, how often it is sent again to another agent, when a second
//! agent is asked at once (hedging), and the latencies hedging learns from.
//! Plain data, as the router's.

use std::{
    collections::{HashMap, HashSet, VecDeque},
    sync::Arc,
    time::{Duration, Instant},
};

use tunnel::ids::DialId;

use crate::{
    events::{DialError, DialFailure, DialRetry},
    ids::{BackendId, FrontendId},
    manager::Scope,
};

/// How the router bounds, retries and hedges dials.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DialPolicy {
    /// `--backend-dial-timeout`: from the first DIAL_REQ sent, across
    /// retries; `None`: no bound.
    pub timeout: Option<Duration>,
    /// `--backend-dial-retries`: how many times a dial may go to another
    /// agent after its agent failed it in a way another may not.
    pub retries: u32,
    /// `--backend-dial-hedge`: when a second agent is asked; `None`: never.
    pub hedge: Option<HedgeDelay>,
    /// How many dials may be pending at once, per frontend stream and per
    /// agent stream.
    pub caps: DialCaps,
}

impl DialPolicy {
    /// ANP's behaviour: no retry, no hedge (and our caps).
    #[cfg(test)]
    pub(crate) fn plain(timeout: Option<Duration>) -> Self {
        Self {
            timeout,
            retries: 0,
            hedge: None,
            caps: DialCaps::default(),
        }
    }
}

/// Dials pending at once, at most: no frontend makes the server hold more
/// than its share of dials, and no agent is sent more than it can answer;
/// and the agent streams one credential may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DialCaps {
    /// `--max-pending-dials-per-frontend`: on one frontend stream (a
    /// CONNECT request is a stream of one dial); past it a dial is refused
    /// at once.
    pub per_frontend: usize,
    /// `--max-pending-dials-per-agent`: sent to one agent stream and not
    /// answered; an agent at its cap is not picked (another is, or the
    /// dial is refused).
    pub per_agent: usize,
    /// `--max-agent-streams-per-credential`: agent streams open at once
    /// under one credential (its voice: [`crate::ids::Credential`]); more
    /// are refused.
    pub streams_per_credential: usize,
}

impl Default for DialCaps {
    fn default() -> Self {
        Self {
            per_frontend: 1024,
            per_agent: 2048,
            streams_per_credential: 8,
        }
    }
}

/// How long a dial waits for its DIAL_RSP before a second agent is asked
/// (`--backend-dial-hedge-delay`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HedgeDelay {
    /// Always this long.
    Fixed(Duration),
    /// This percentile of the latest [`WINDOW`] established dials'
    /// latencies, at least [`FLOOR`] and the agents' median ([`Median`]);
    /// [`BOOTSTRAP`] until [`MIN_SAMPLES`] were seen.
    Percentile(u8),
}

/// How many dial latencies hedging learns from.
pub(crate) const WINDOW: usize = 1024;
/// Latencies seen before a percentile is trusted.
pub(crate) const MIN_SAMPLES: usize = 32;
/// The delay until then: well past a healthy dial on a LAN or to a
/// far-away node (tens of ms), well short of a webhook's patience.
pub(crate) const BOOTSTRAP: Duration = Duration::from_millis(100);
/// The shortest hedge delay: below it, a loopback's jitter alone would
/// double every dial.
pub(crate) const FLOOR: Duration = Duration::from_millis(1);
/// The percentile is recomputed once per this many new latencies.
const RECOMPUTE: usize = 32;

/// The latest dial latencies and the hedge delay they give. Each voice
/// (credential: [`crate::ids::Credential`]) weighs one in the percentiles
/// however many of the latencies are its own: an agent that answers
/// every dial at once, under many streams or ids, sets the hedge delay no
/// more than any other voice does.
#[derive(Debug, Default)]
pub(crate) struct Latencies {
    /// Oldest first, with the voice of the agent that answered.
    recent: VecDeque<(Duration, Arc<str>)>,
    /// Latencies seen since `sorted` was taken.
    fresh: usize,
    /// `recent` sorted, as it was `fresh` latencies ago, each with the
    /// weights up to and including it (a voice's latencies weigh one in
    /// all): every percentile (the hedge delay's, the pick's median) reads
    /// it.
    sorted: Vec<(Duration, f64)>,
}

impl Latencies {
    /// One established dial's latency (its DIAL_REQ to its DIAL_RSP on the
    /// agent that answered), and that agent's voice.
    pub(crate) fn observe(&mut self, latency: Duration, voice: &Arc<str>) {
        if self.recent.len() == WINDOW {
            self.recent.pop_front();
        }
        self.recent.push_back((latency, voice.clone()));
        self.fresh += 1;
    }

    /// Takes the snapshot: the latencies sorted, each weighing one over
    /// its voice's count, and the running sum of the weights.
    fn snapshot(&mut self) {
        let mut counts: HashMap<&str, usize> = HashMap::new();
        for (_, voice) in &self.recent {
            *counts.entry(voice).or_default() += 1;
        }
        let mut weighed: Vec<(Duration, f64)> = self
            .recent
            .iter()
            .map(|(latency, voice)| (*latency, 1.0 / counts[&**voice] as f64))
            .collect();
        weighed.sort_unstable_by_key(|(latency, _)| *latency);
        let mut sum = 0.0;
        self.sorted.clear();
        self.sorted
            .extend(weighed.into_iter().map(|(latency, weight)| {
                sum += weight;
                (latency, sum)
            }));
        self.fresh = 0;
    }

    /// The hedge delay `hedge` gives now; a percentile is never below
    /// `floor` (the agents' median: [`Median`]).
    pub(crate) fn delay(&mut self, hedge: HedgeDelay, floor: Duration) -> Duration {
        let percentile = match hedge {
            HedgeDelay::Fixed(delay) => return delay,
            HedgeDelay::Percentile(p) => p,
        };
        if self.recent.len() < MIN_SAMPLES {
            return BOOTSTRAP.max(floor);
        }
        if self.sorted.is_empty() || self.fresh >= RECOMPUTE {
            self.snapshot();
        }
        self.read(percentile, floor)
    }

    /// The weighted percentile of the snapshot as it stands (taken: see
    /// [`Latencies::delay`]): the first latency whose running weight
    /// reaches that share of the voices; at least [`FLOOR`] and `floor`.
    fn read(&self, percentile: u8, floor: Duration) -> Duration {
        let total = self.sorted.last().map_or(0.0, |(_, sum)| *sum);
        let target = total * f64::from(percentile) / 100.0;
        // A little below, so that float sums that should meet it do.
        let at = self
            .sorted
            .partition_point(|(_, sum)| *sum < target - 1e-9)
            .min(self.sorted.len() - 1);
        self.sorted[at].0.max(FLOOR).max(floor)
    }

    /// What [`Latencies::delay`] gave last, without taking a new snapshot:
    /// the same as long as no latency came since (the fuzz target's view
    /// of a pick it just saw).
    #[cfg(any(test, feature = "fuzzing"))]
    pub(crate) fn last_delay(&self, percentile: u8, floor: Duration) -> Duration {
        if self.recent.len() < MIN_SAMPLES || self.sorted.is_empty() {
            return BOOTSTRAP.max(floor);
        }
        self.read(percentile, floor)
    }
}

/// The median of the agents' dial latencies, one vote per agent: no
/// agent's estimate counts for less (a pick weighs at least this), and
/// the hedge delay is no shorter. An agent that answers at once (it lies,
/// or dials nothing) is one vote among all: it cannot drag the floor down,
/// nor the hedge delay, by winning many dials.
#[derive(Debug, Default)]
pub(crate) struct Median {
    /// The median as last computed.
    value: Duration,
    /// When it was computed (`None`: never).
    at: Option<Instant>,
    /// Agent samples since.
    samples: usize,
}

/// Agents whose latest sample is older than this have no vote: the
/// median is of agents dialed lately.
pub(crate) const VOTE_WINDOW: Duration = Duration::from_secs(30);
/// The median is recomputed at most this often, or after [`RECOMPUTE`]
/// agent samples, whichever comes first (a pass over every agent).
const MEDIAN_REFRESH: Duration = Duration::from_secs(1);

impl Median {
    /// An agent's estimate changed.
    pub(crate) fn sampled(&mut self) {
        self.samples += 1;
    }

    /// Whether it should be recomputed at `now`.
    pub(crate) fn is_stale(&self, now: Instant) -> bool {
        self.samples >= RECOMPUTE
            || self
                .at
                .is_none_or(|at| now.saturating_duration_since(at) >= MEDIAN_REFRESH)
    }

    /// Recomputes it from the agents' estimates, one vote per voice (its
    /// fastest stream's), however many streams it has.
    pub(crate) fn recompute<'a>(
        &mut self,
        now: Instant,
        estimates: impl Iterator<Item = (&'a str, &'a PeakEwma)>,
    ) {
        let mut fastest: HashMap<&str, Duration> = HashMap::new();
        for (voice, estimate) in estimates {
            if let Some(latest) = estimate.latest(now) {
                fastest
                    .entry(voice)
                    .and_modify(|d| *d = (*d).min(latest))
                    .or_insert(latest);
            }
        }
        let mut votes: Vec<Duration> = fastest.into_values().collect();
        self.value = if votes.is_empty() {
            Duration::ZERO
        } else {
            // The lower median: of two agents, the faster one, so that
            // with two the slower is still shed.
            let mid = (votes.len() - 1) / 2;
            *votes.select_nth_unstable(mid).1
        };
        self.at = Some(now);
        self.samples = 0;
    }

    /// The median as last computed (zero before any agent sample).
    pub(crate) fn get(&self) -> Duration {
        self.value
    }
}

/// One agent a pending dial was sent to.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Attempt {
    /// The agent stream.
    pub(crate) backend: BackendId,
    /// When its DIAL_REQ went out, once it did.
    pub(crate) forwarded: Option<Instant>,
}

/// A dial sent and not yet answered.
#[derive(Debug)]
pub(crate) struct PendingDial {
    /// Who asked.
    pub(crate) frontend: FrontendId,
    /// The DIAL_REQ's protocol, for a retry.
    pub(crate) protocol: String,
    /// The DIAL_REQ's address, for a retry.
    pub(crate) address: String,
    /// The agent streams it is in flight on: one, or two once hedged.
    pub(crate) attempts: Vec<Attempt>,
    /// Every agent stream it was sent to, which a retry or a hedge avoids.
    pub(crate) tried: Vec<BackendId>,
    /// The candidates its agent was chosen among (a strategy and key): a
    /// retry or a hedge goes only to them; a new pick after its agent is
    /// gone may choose others (and replaces it).
    pub(crate) scope: Scope,
    /// Retries left.
    pub(crate) retries_left: u32,
    /// The agent stream asked second by hedging, once it was.
    pub(crate) hedge: Option<BackendId>,
    /// When a second agent is asked, once armed.
    pub(crate) hedge_at: Option<Instant>,
    /// When it was received, for the dial latency.
    pub(crate) started: Instant,
    /// When it times out (`--backend-dial-timeout`), once forwarded.
    pub(crate) deadline: Option<Instant>,
}

impl PendingDial {
    /// Whether it is in flight on `backend`.
    pub(crate) fn on(&self, backend: BackendId) -> bool {
        self.attempts.iter().any(|a| a.backend == backend)
    }
}

/// Why an agent's attempt at a dial ended without a connection.
#[derive(Debug, Clone)]
pub(crate) enum AttemptEnd {
    /// Another agent may serve it: retried if the budget allows; else the
    /// dial fails as given.
    Retry(DialRetry, DialFailure, DialError),
    /// Another agent would fail it too, or it would take too long.
    Final(DialFailure, DialError),
    /// A node's policy refused it: the dial ends, with any other attempt
    /// in flight (a hedge) cancelled, so that no other node connects where
    /// one refused.
    Refused(DialFailure, DialError),
}

/// Whether an agent's failed DIAL_RSP is one another node may not have:
/// the destination refused, or this node has no route to it. Our agents
/// say so in the answer's class (`errorClass`); ANP's send only the text,
/// read as Go writes these errors (`dial tcp <addr>: connect: connection
/// refused`, `…: no route to host`, `…: network is unreachable`), at its
/// end only, so that a destination's name that contains these words is
/// not taken for them. A timeout is not retried: a retry would double the
/// wait its caller already spent. Nor is a refusal by an agent's
/// destination policy (`Denied`): it is the operator's decision, and
/// another agent must not be asked to reach what one refused; its text
/// ends with the rule (`…(rule deny metadata)`), never with the words
/// above, so a server that predates the class does not retry it either.
pub(crate) fn retryable(rsp: &proto::DialResponse) -> bool {
    use proto::DialErrorClass as Class;
    match rsp.error_class() {
        Class::Refused | Class::Unreachable => true,
        Class::Timeout | Class::NoSuchHost | Class::Other | Class::Denied => false,
        Class::Unspecified => {
            const ELSEWHERE: [&str; 3] = [
                ": connection refused",
                ": no route to host",
                ": network is unreachable",
            ];
            ELSEWHERE.iter().any(|text| rsp.error.ends_with(text))
        }
    }
}

/// How fast an agent's latency estimate forgets: a sample this old weighs
/// 1/e of a new one, and an agent not dialed for that long looks that
/// much faster (so a slow agent is tried again once it may have healed),
/// down to the agents' median ([`Median`]).
pub(crate) const DECAY: Duration = Duration::from_secs(10);

/// What an attempt that failed weighs in its agent's estimate, at least:
/// an error answer (a refusal included) or the agent's DIAL_CLS. Well past
/// any healthy dial (tens of ms), so that an agent that fails dials at
/// once is not taken for a fast one: it is tried again once its estimate
/// has decayed to the others' (about 40 s against 20 ms agents).
pub(crate) const FAILURE_COST: Duration = Duration::from_secs(1);

/// One agent's dial latency as the less-loaded pick weighs it ("peak
/// EWMA", as Finagle's and linkerd's balancers): a slower sample is taken
/// at once, a faster one averaged in over [`DECAY`]; between samples the
/// estimate decays towards zero. Failures count (at least
/// [`FAILURE_COST`]), as do timeouts and cancellations (what the attempt
/// had taken so far, a lower bound that only raises it: an attempt
/// another agent won, one the frontend cancelled, one that timed out):
/// without them, an agent whose dials are always hedged away, that fails
/// them or never answers would look idle and fast. The pick also weighs a
/// dial still pending on the agent by its age, and never less than the
/// agents' median.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct PeakEwma {
    /// The estimate at `stamp`, in seconds; `None` until the first sample.
    estimate: Option<(f64, Instant)>,
}

impl PeakEwma {
    /// Weight of the estimate `since` after its stamp.
    fn kept(since: Duration) -> f64 {
        (-since.as_secs_f64() / DECAY.as_secs_f64()).exp()
    }

    /// A dial attempt took `latency` by `now`.
    pub(crate) fn observe(&mut self, now: Instant, latency: Duration) {
        let sample = latency.as_secs_f64();
        let next = match self.estimate {
            Some((cost, stamp)) if sample < cost => {
                let kept = Self::kept(now.saturating_duration_since(stamp));
                cost * kept + sample * (1.0 - kept)
            }
            _ => sample,
        };
        self.estimate = Some((next, now));
    }

    /// A dial attempt took at least `latency` by `now` (it was cut short):
    /// raises the estimate to it if it is higher, else changes nothing.
    pub(crate) fn observe_at_least(&mut self, now: Instant, latency: Duration) {
        if self.get(now).is_none_or(|estimate| latency > estimate) {
            self.estimate = Some((latency.as_secs_f64(), now));
        }
    }

    /// The estimate at `now`; `None` before any sample.
    pub(crate) fn get(&self, now: Instant) -> Option<Duration> {
        let (cost, stamp) = self.estimate?;
        let decayed = cost * Self::kept(now.saturating_duration_since(stamp));
        Some(Duration::from_secs_f64(decayed))
    }

    /// The estimate as its latest sample left it, if that was within
    /// [`VOTE_WINDOW`] of `now` (the agent's vote in [`Median`]).
    fn latest(&self, now: Instant) -> Option<Duration> {
        let (cost, stamp) = self.estimate?;
        (now.saturating_duration_since(stamp) < VOTE_WINDOW).then(|| Duration::from_secs_f64(cost))
    }
}

/// Attempts closed because another agent answered first: their late
/// DIAL_RSP is closed on the agent, not counted as unrecognized. Bounded:
/// the oldest is forgotten (its late answer is then counted, and closed
/// all the same).
#[derive(Debug, Default)]
pub(crate) struct Cancelled {
    /// Oldest first.
    order: VecDeque<(DialId, BackendId)>,
    /// The same, for lookups.
    set: HashSet<(DialId, BackendId)>,
}

/// How many cancelled attempts are remembered.
const CANCELLED: usize = 4096;

impl Cancelled {
    /// Remembers an attempt closed before its answer.
    pub(crate) fn insert(&mut self, dial: DialId, backend: BackendId) {
        if self.order.len() == CANCELLED
            && let Some(old) = self.order.pop_front()
        {
            self.set.remove(&old);
        }
        if self.set.insert((dial, backend)) {
            self.order.push_back((dial, backend));
        }
    }

    /// Whether the attempt was cancelled (forgetting it).
    pub(crate) fn take(&mut self, dial: DialId, backend: BackendId) -> bool {
        if !self.set.remove(&(dial, backend)) {
            return false;
        }
        self.order.retain(|entry| *entry != (dial, backend));
        true
    }

    /// How many are remembered.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.order.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_latency_estimate_takes_a_slower_sample_at_once_and_a_faster_one_over_time() {
        let t0 = Instant::now();
        let mut e = PeakEwma::default();
        assert_eq!(e.get(t0), None, "no sample yet");
        e.observe(t0, Duration::from_millis(10));
        assert_eq!(e.get(t0), Some(Duration::from_millis(10)));
        e.observe(t0, Duration::from_millis(50));
        assert_eq!(
            e.get(t0),
            Some(Duration::from_millis(50)),
            "the peak at once"
        );
        // A faster sample right away barely moves it; one a DECAY later
        // weighs 1 - 1/e.
        e.observe(t0, Duration::from_millis(1));
        assert_eq!(e.get(t0), Some(Duration::from_millis(50)));
        e.observe(t0 + DECAY, Duration::from_millis(1));
        let kept = (-1f64).exp();
        let want = 0.050 * kept + 0.001 * (1.0 - kept);
        let got = e.get(t0 + DECAY).unwrap().as_secs_f64();
        assert!((got - want).abs() < 1e-9, "{got} vs {want}");
        // Without samples it decays towards zero.
        let later = e.get(t0 + 6 * DECAY).unwrap().as_secs_f64();
        assert!((later - want * (-5f64).exp()).abs() < 1e-9, "{later}");
    }

    #[test]
    fn a_lower_bound_only_raises_an_estimate() {
        let t0 = Instant::now();
        let mut e = PeakEwma::default();
        e.observe_at_least(t0, Duration::from_millis(5));
        assert_eq!(
            e.get(t0),
            Some(Duration::from_millis(5)),
            "the first sample"
        );
        e.observe_at_least(t0, Duration::from_millis(1));
        assert_eq!(
            e.get(t0),
            Some(Duration::from_millis(5)),
            "shorter: no news"
        );
        e.observe_at_least(t0, Duration::from_secs(3));
        assert_eq!(e.get(t0), Some(Duration::from_secs(3)), "longer: taken");
    }

    #[test]
    fn the_median_is_one_vote_per_agent_dialed_lately() {
        let t0 = Instant::now();
        let agent = |ms: u64, at: Instant| {
            let mut e = PeakEwma::default();
            e.observe(at, Duration::from_millis(ms));
            e
        };
        // Each its own voice.
        let voiced = |agents: &[PeakEwma]| -> Vec<(String, PeakEwma)> {
            agents
                .iter()
                .enumerate()
                .map(|(i, e)| (format!("agent:{i}"), *e))
                .collect()
        };
        fn votes(list: &[(String, PeakEwma)]) -> Vec<(&str, &PeakEwma)> {
            list.iter().map(|(v, e)| (v.as_str(), e)).collect()
        }
        let mut m = Median::default();
        assert!(m.is_stale(t0));
        m.recompute(t0, std::iter::empty());
        assert_eq!(m.get(), Duration::ZERO, "no agent sampled");
        let agents = voiced(&[agent(0, t0), agent(10, t0), agent(12, t0), agent(500, t0)]);
        m.recompute(t0, votes(&agents).into_iter());
        assert_eq!(m.get(), Duration::from_millis(10), "the lower median");
        assert!(!m.is_stale(t0));
        let two = voiced(&[agent(2, t0), agent(1002, t0)]);
        m.recompute(t0, votes(&two).into_iter());
        assert_eq!(m.get(), Duration::from_millis(2), "of two, the faster");
        // Votes are the latest samples, undecayed, of agents sampled
        // within VOTE_WINDOW.
        let t1 = t0 + VOTE_WINDOW;
        let later = t1 + VOTE_WINDOW / 2;
        let mixed = voiced(&[agent(10, t1), agent(10, t1), agent(1, t0)]);
        m.recompute(later, votes(&mixed).into_iter());
        assert_eq!(m.get(), Duration::from_millis(10));
        // One voice, ten instant streams, beside three honest agents: one
        // vote (issue 51: ten votes set the floor to zero).
        let mut crowd = voiced(&[agent(20, t0), agent(30, t0), agent(40, t0)]);
        crowd.extend((0..10).map(|_| ("cert:liar".to_owned(), agent(0, t0))));
        m.recompute(t0, votes(&crowd).into_iter());
        assert_eq!(
            m.get(),
            Duration::from_millis(20),
            "the lower median of four voices"
        );
        for _ in 0..RECOMPUTE {
            m.sampled();
        }
        assert!(m.is_stale(later), "stale after enough samples");
        assert!(m.is_stale(later + MEDIAN_REFRESH));
    }

    #[test]
    fn the_hedge_delay_is_the_percentile_of_the_latest_dials() {
        let mut l = Latencies::default();
        let p95 = HedgeDelay::Percentile(95);
        assert_eq!(
            l.delay(p95, Duration::ZERO),
            BOOTSTRAP,
            "too few dials seen"
        );
        let one: Arc<str> = Arc::from("agent:a");
        for ms in 1..=100 {
            l.observe(Duration::from_millis(ms), &one);
        }
        assert_eq!(l.delay(p95, Duration::ZERO), Duration::from_millis(95));
        assert_eq!(
            l.delay(HedgeDelay::Percentile(50), Duration::ZERO),
            Duration::from_millis(50)
        );
        assert_eq!(
            l.delay(HedgeDelay::Percentile(50), Duration::from_millis(70)),
            Duration::from_millis(70),
            "never below the agents' median"
        );
        assert_eq!(
            l.delay(
                HedgeDelay::Fixed(Duration::from_secs(3)),
                Duration::from_secs(9)
            ),
            Duration::from_secs(3),
            "a fixed delay is the operator's"
        );
        // The window forgets: a slower regime takes over.
        for _ in 0..WINDOW {
            l.observe(Duration::from_millis(400), &one);
        }
        assert_eq!(l.delay(p95, Duration::ZERO), Duration::from_millis(400));
        let mut fast = Latencies::default();
        for _ in 0..MIN_SAMPLES {
            fast.observe(Duration::from_micros(50), &one);
        }
        assert_eq!(fast.delay(p95, Duration::ZERO), FLOOR);
    }

    /// Issue 51: a voice that answers a thousand dials at once weighs one,
    /// as each of three honest agents does, in the hedge delay.
    #[test]
    fn the_hedge_delay_takes_one_vote_per_voice() {
        let mut l = Latencies::default();
        let liar: Arc<str> = Arc::from("cert:liar");
        for _ in 0..900 {
            l.observe(Duration::ZERO, &liar);
        }
        for (voice, ms) in [("agent:a", 10), ("agent:b", 20), ("agent:c", 30)] {
            let voice: Arc<str> = Arc::from(voice);
            for _ in 0..40 {
                l.observe(Duration::from_millis(ms), &voice);
            }
        }
        let p = |p: u8, l: &mut Latencies| l.delay(HedgeDelay::Percentile(p), Duration::ZERO);
        // Unweighted, 900 of 1020 are the liar's: every percentile to 88
        // would be its zero.
        assert_eq!(p(50, &mut l), Duration::from_millis(10));
        assert_eq!(p(75, &mut l), Duration::from_millis(20));
        assert_eq!(p(95, &mut l), Duration::from_millis(30));
        assert_eq!(p(20, &mut l), FLOOR, "the liar's own quarter");
    }

    #[test]
    fn refusals_and_unreachable_nodes_are_retried_timeouts_are_not() {
        use proto::DialErrorClass as Class;
        let text = |error: &str| proto::DialResponse {
            error: error.to_owned(),
            ..Default::default()
        };
        let classed = |error: &str, class: Class| proto::DialResponse {
            error_class: class as i32,
            ..text(error)
        };
        // ANP's agents: Go's texts, at their end.
        assert!(retryable(&text(
            "dial tcp 10.0.0.1:443: connect: connection refused"
        )));
        assert!(retryable(&text(
            "dial tcp 10.0.0.1:443: connect: no route to host"
        )));
        assert!(retryable(&text(
            "dial tcp 10.0.0.1:443: connect: network is unreachable"
        )));
        assert!(!retryable(&text("dial tcp 10.0.0.1:443: i/o timeout")));
        assert!(!retryable(&text(
            "dial tcp 10.0.0.1:443: connect: connection timed out"
        )));
        assert!(!retryable(&text("dial tcp: lookup nowhere: no such host")));
        assert!(
            !retryable(&text(
                "dial tcp: lookup connection refused.example: no such host"
            )),
            "the words inside a name are not the error"
        );
        // Ours: the class decides, whatever the text says.
        assert!(retryable(&classed("anything", Class::Refused)));
        assert!(retryable(&classed("anything", Class::Unreachable)));
        let refused = "dial tcp 10.0.0.1:443: connect: connection refused";
        for class in [
            Class::Timeout,
            Class::NoSuchHost,
            Class::Other,
            Class::Denied,
        ] {
            assert!(!retryable(&classed(refused, class)), "{class:?}");
        }
        // A policy refusal, by its text alone (a server that does not know
        // the class reads it as unspecified), even for a rule whose words
        // are a retryable error's.
        let denied = "dial tcp 127.0.0.2:80: destination 127.0.0.2:80 denied by the agent's \
                      policy (rule deny host connection refused)";
        assert!(!retryable(&text(denied)));
        assert!(!retryable(&classed(denied, Class::Denied)));
    }

    #[test]
    fn cancelled_attempts_are_remembered_within_a_bound() {
        let mut c = Cancelled::default();
        for id in 0..(CANCELLED as i64 + 10) {
            c.insert(DialId(id), BackendId(1));
        }
        assert_eq!(c.len(), CANCELLED);
        assert!(!c.take(DialId(0), BackendId(1)), "the oldest is forgotten");
        assert!(c.take(DialId(20), BackendId(1)));
        assert!(!c.take(DialId(20), BackendId(1)), "taken once");
        assert!(!c.take(DialId(21), BackendId(2)), "another agent's");
    }
}
