//! What the soak watches once a second: each process's RSS, descriptors
//! and tasks, its allocator's figures (jemalloc's, in its `/metrics`), each
//! binary's books (connections opened, closed and open, in its own
//! `/metrics`), and the traffic's counts.

use std::{
    net::SocketAddr,
    sync::{Arc, Mutex, PoisonError},
    time::{Duration, Instant},
};

use serde::Serialize;
use tokio_util::sync::CancellationToken;

use super::traffic::{Counts, CountsSnap, DestCounts, DestSnap, Kind};
use crate::probe;

/// The alive-tasks gauge both binaries expose.
pub const TASKS: &str = "konnectivity_rs_runtime_alive_tasks";

/// The allocator figures both binaries expose (built with jemalloc).
pub const JEMALLOC: &str = "konnectivity_rs_jemalloc_";

/// A process's allocator at one sample: jemalloc's figures, bytes.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Alloc {
    /// Held by the program (thread caches included).
    pub allocated: f64,
    /// In the pages that hold it.
    pub active: f64,
    /// Freed pages not yet purged.
    pub dirty: f64,
    /// jemalloc's metadata.
    pub metadata: f64,
    /// Resident pages jemalloc maps (at most).
    pub resident: f64,
    /// Address space kept for reuse, not resident.
    pub retained: f64,
}

impl Alloc {
    /// The figures in `text`, if it has them.
    pub fn read(text: &str) -> Option<Self> {
        let get = |name: &str| -> Option<f64> {
            let prefix = format!("{JEMALLOC}{name}_bytes ");
            text.lines()
                .find_map(|l| l.strip_prefix(&prefix))?
                .trim()
                .parse()
                .ok()
        };
        Some(Self {
            allocated: get("allocated")?,
            active: get("active")?,
            dirty: get("dirty")?,
            metadata: get("metadata")?,
            resident: get("resident")?,
            retained: get("retained")?,
        })
    }
}

/// What a process is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Role {
    /// A proxy-server.
    Server,
    /// A proxy-agent.
    Agent,
}

/// One process slot (a server replica or an agent "pod"), as the
/// orchestrator last set it.
#[derive(Debug, Clone, Serialize)]
pub struct Slot {
    /// `server-0`, `agent-2`, …
    pub name: String,
    /// Server or agent.
    pub role: Role,
    /// The running process, if any.
    pub pid: Option<u32>,
    /// Its health port (`/metrics`).
    pub metrics: Option<SocketAddr>,
}

/// The slots, shared with the orchestrator, which updates them on restarts.
pub type Slots = Arc<Mutex<Vec<Slot>>>;

/// The books of one process: connections it opened (dials that
/// succeeded), closed, and has open, from its `/metrics`.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Books {
    /// Established connections so far (`dial_duration_seconds_count`).
    pub opened: f64,
    /// Closed so far (`connections_closed_total`, every reason).
    pub closed: f64,
    /// Open now (the established / open-endpoint gauge).
    pub open: f64,
}

impl Books {
    /// `opened - closed - open`: 0 when every connection is accounted for.
    pub fn unaccounted(&self) -> f64 {
        self.opened - self.closed - self.open
    }

    /// The books in `text`, a `role`'s exposition.
    pub fn read(role: Role, text: &str) -> Self {
        let (opened, closed, open) = match role {
            Role::Server => (
                "konnectivity_network_proxy_server_dial_duration_seconds_count",
                "konnectivity_rs_server_connections_closed_total",
                "konnectivity_network_proxy_server_established_connections",
            ),
            Role::Agent => (
                "konnectivity_network_proxy_agent_dial_duration_seconds_count",
                "konnectivity_rs_agent_connections_closed_total",
                "konnectivity_network_proxy_agent_open_endpoint_connections",
            ),
        };
        Self {
            opened: sum(text, opened),
            closed: sum(text, closed),
            open: sum(text, open),
        }
    }
}

/// The sum of every series of `name` in `text` (0 when absent).
pub fn sum(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|line| {
            let rest = line.strip_prefix(name)?;
            let rest = match rest.strip_prefix('{') {
                Some(labelled) => &labelled[labelled.find('}')? + 1..],
                None if rest.starts_with(' ') => rest,
                None => return None,
            };
            rest.trim().parse::<f64>().ok()
        })
        .sum()
}

/// One process at one sample.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct ProcSample {
    /// The process.
    pub pid: u32,
    /// Resident memory, bytes.
    pub rss: u64,
    /// Open file descriptors.
    pub fds: u64,
    /// Alive tasks, if `/metrics` answered.
    pub tasks: Option<f64>,
    /// Its books, if `/metrics` answered.
    pub books: Option<Books>,
    /// Its allocator's figures, if `/metrics` answered with them.
    pub alloc: Option<Alloc>,
}

/// Everything at one moment.
#[derive(Debug, Clone, Serialize)]
pub struct Sample {
    /// Seconds since the soak started.
    pub t: f64,
    /// Per slot, while its process runs.
    pub procs: Vec<Option<ProcSample>>,
    /// Per frontend kind ([`Kind::ALL`] order).
    pub counts: Vec<CountsSnap>,
    /// The destination.
    pub dest: DestSnap,
}

/// Open descriptors of `pid`.
fn fds(pid: u32) -> Option<u64> {
    Some(std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count() as u64)
}

/// Samples one process.
async fn sample_proc(slot: &Slot) -> Option<ProcSample> {
    let pid = slot.pid?;
    let rss = probe::rss(pid).ok()?;
    let fds = fds(pid)?;
    let text = match slot.metrics {
        Some(addr) => {
            match tokio::time::timeout(Duration::from_secs(2), probe::http_get(addr, "/metrics"))
                .await
            {
                Ok(Ok((200, text))) => Some(text),
                _ => None,
            }
        }
        None => None,
    };
    Some(ProcSample {
        pid,
        rss,
        fds,
        tasks: text.as_deref().map(|t| sum(t, TASKS)),
        books: text.as_deref().map(|t| Books::read(slot.role, t)),
        alloc: text.as_deref().and_then(Alloc::read),
    })
}

/// The samples so far.
pub type Samples = Arc<Mutex<Vec<Sample>>>;

/// Locks a mutex, poisoned or not.
pub fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Takes one sample now.
pub async fn sample(
    start: Instant,
    slots: &Slots,
    counts: &[Arc<Counts>],
    dest: &DestCounts,
) -> Sample {
    let now: Vec<Slot> = lock(slots).clone();
    let mut procs = Vec::with_capacity(now.len());
    for slot in &now {
        procs.push(sample_proc(slot).await);
    }
    Sample {
        t: start.elapsed().as_secs_f64(),
        procs,
        counts: counts.iter().map(|c| c.snap()).collect(),
        dest: dest.snap(),
    }
}

/// Samples every second into `samples` until `stop`.
pub async fn run(
    start: Instant,
    slots: Slots,
    counts: Vec<Arc<Counts>>,
    dest: Arc<DestCounts>,
    samples: Samples,
    stop: CancellationToken,
) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        let s = sample(start, &slots, &counts, &dest).await;
        lock(&samples).push(s);
    }
}

/// Which of a process's figures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Resource {
    /// RSS.
    Rss,
    /// Descriptors.
    Fds,
    /// Tasks.
    Tasks,
}

impl Resource {
    /// All three.
    pub const ALL: [Self; 3] = [Self::Rss, Self::Fds, Self::Tasks];

    /// Its value in `p`.
    pub fn of(self, p: &ProcSample) -> Option<f64> {
        match self {
            Self::Rss => Some(p.rss as f64),
            Self::Fds => Some(p.fds as f64),
            Self::Tasks => p.tasks,
        }
    }

    /// Its name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Rss => "RSS",
            Self::Fds => "fds",
            Self::Tasks => "tasks",
        }
    }
}

/// The least value of `resource` of `slot` over the samples in `[from, to]`.
pub fn least(
    samples: &[Sample],
    slot: usize,
    resource: Resource,
    from: f64,
    to: f64,
) -> Option<f64> {
    samples
        .iter()
        .filter(|s| s.t >= from && s.t <= to)
        .filter_map(|s| s.procs.get(slot).copied().flatten())
        .filter_map(|p| resource.of(&p))
        .reduce(f64::min)
}

/// The typical least value of `resource` of `slot` over windows of
/// `width` seconds within `[from, to]`: the median, over every window
/// starting at a sample, of the window's least value. A baseline to set
/// beside the least over one window of the same width: the least over a
/// longer window is lower by construction (RSS swings by megabytes with
/// the bytes in flight), so comparing it with a short window's least
/// would find growth where there is none.
pub fn typical_least(
    samples: &[Sample],
    slot: usize,
    resource: Resource,
    (from, to): (f64, f64),
    width: f64,
) -> Option<f64> {
    let mut minima: Vec<f64> = samples
        .iter()
        .filter(|s| s.t >= from && s.t + width <= to)
        .filter_map(|s| least(samples, slot, resource, s.t, s.t + width))
        .collect();
    if minima.is_empty() {
        return least(samples, slot, resource, from, to);
    }
    minima.sort_by(f64::total_cmp);
    Some(minima[minima.len() / 2])
}

/// The least bytes allocated (jemalloc's `allocated`) of `slot` over the
/// samples in `[from, to]`.
pub fn least_allocated(samples: &[Sample], slot: usize, from: f64, to: f64) -> Option<f64> {
    samples
        .iter()
        .filter(|s| s.t >= from && s.t <= to)
        .filter_map(|s| s.procs.get(slot).copied().flatten()?.alloc)
        .map(|a| a.allocated)
        .reduce(f64::min)
}

/// Rate of `pick` of `kind` over `[from, to]`, per second.
pub fn rate(
    samples: &[Sample],
    kind: Kind,
    from: f64,
    to: f64,
    pick: fn(&CountsSnap) -> u64,
) -> Option<f64> {
    let i = Kind::ALL.iter().position(|k| *k == kind)?;
    let first = samples.iter().find(|s| s.t >= from)?;
    let last = samples.iter().rev().find(|s| s.t <= to)?;
    let secs = last.t - first.t;
    (secs > 0.5).then(|| pick(&last.counts[i]).saturating_sub(pick(&first.counts[i])) as f64 / secs)
}

/// Rate of `pick` of the destination's counts over `[from, to]`, per second.
pub fn dest_rate(
    samples: &[Sample],
    from: f64,
    to: f64,
    pick: fn(&DestSnap) -> u64,
) -> Option<f64> {
    let first = samples.iter().find(|s| s.t >= from)?;
    let last = samples.iter().rev().find(|s| s.t <= to)?;
    let secs = last.t - first.t;
    (secs > 0.5).then(|| pick(&last.dest).saturating_sub(pick(&first.dest)) as f64 / secs)
}

#[cfg(test)]
mod tests {
    use super::{DestSnap, ProcSample, Resource, Sample, least, typical_least};

    /// One process whose RSS follows `rss`, a sample a second.
    fn series(rss: &[u64]) -> Vec<Sample> {
        rss.iter()
            .enumerate()
            .map(|(t, rss)| Sample {
                t: t as f64,
                procs: vec![Some(ProcSample {
                    pid: 1,
                    rss: *rss,
                    fds: 10,
                    tasks: None,
                    books: None,
                    alloc: None,
                })],
                counts: Vec::new(),
                dest: DestSnap::default(),
            })
            .collect()
    }

    #[test]
    fn the_baseline_is_the_typical_least_of_windows_as_wide_as_the_check() {
        // Traffic dips to 10 once a minute and stays near 16 otherwise.
        let rss: Vec<u64> = (0..60)
            .map(|t| if t == 30 { 10 } else { 16 + t % 2 })
            .collect();
        let samples = series(&rss);
        assert_eq!(least(&samples, 0, Resource::Rss, 0.0, 59.0), Some(10.0));
        // Most 10-second windows' least is 16: the dip is one window's.
        assert_eq!(
            typical_least(&samples, 0, Resource::Rss, (0.0, 59.0), 10.0),
            Some(16.0)
        );
        // Shorter than a window: the plain least.
        assert_eq!(
            typical_least(&samples, 0, Resource::Rss, (0.0, 5.0), 10.0),
            Some(16.0)
        );
    }
}
