//! The per-second samples (each process's RSS, descriptors, tasks,
//! allocator and books; the traffic's counts; the destination's), the
//! `/metrics` text they are read from, and the measures taken over them:
//! least values for the resources, rates for the traffic.

use serde::Serialize;

pub use crate::observe::{Alloc, CountsSnap, DestSnap, ProcSample, Sample};
use crate::observe::{Books, Role, Secs};

/// The alive-tasks gauge both binaries expose.
pub const TASKS: &str = "konnectivity_rs_runtime_alive_tasks";

/// The allocator figures both binaries expose (built with jemalloc).
pub const JEMALLOC: &str = "konnectivity_rs_jemalloc_";

/// How far a resource may stay above its baseline after a fault.
pub const RESOURCE_SLACK: f64 = 0.05;

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

/// The values of every series of `name` in `text` (none when absent).
fn series<'a>(text: &'a str, name: &'a str) -> impl Iterator<Item = f64> + 'a {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(move |line| {
            let rest = line.strip_prefix(name)?;
            let rest = match rest.strip_prefix('{') {
                Some(labelled) => &labelled[labelled.find('}')? + 1..],
                None if rest.starts_with(' ') => rest,
                None => return None,
            };
            rest.trim().parse::<f64>().ok()
        })
}

/// The sum of every series of `name` in `text` (0 when absent).
pub fn sum(text: &str, name: &str) -> f64 {
    // `+ 0.0`: an empty float sum is -0.0, which prints as "-0".
    series(text, name).sum::<f64>() + 0.0
}

/// The sum of every series of `name` in `text`; `None` when it has none.
pub fn sum_present(text: &str, name: &str) -> Option<f64> {
    series(text, name).reduce(|a, b| a + b)
}

/// The metric names of a role's books: opened, closed, open.
fn book_names(role: Role) -> [&'static str; 3] {
    match role {
        Role::Server => [
            "konnectivity_network_proxy_server_dial_duration_seconds_count",
            "konnectivity_rs_server_connections_closed_total",
            "konnectivity_network_proxy_server_established_connections",
        ],
        Role::Agent => [
            "konnectivity_network_proxy_agent_dial_duration_seconds_count",
            "konnectivity_rs_agent_connections_closed_total",
            "konnectivity_network_proxy_agent_open_endpoint_connections",
        ],
    }
}

/// The agent's close reasons that cut a connection.
const CUT_REASONS: [&str; 3] = ["drain_timeout", "stream_gone", "overflow"];

/// The books in `text`, a `role`'s exposition; `None` when the opened or
/// open series is missing (a counter never incremented is still exported
/// as 0; a missing series is a broken exposition, not an idle process).
/// Closed is a labelled family with no series until the first close.
pub fn read_books(role: Role, text: &str) -> Option<Books> {
    let [opened, closed, open] = book_names(role);
    let cut = match role {
        Role::Server => 0.0,
        Role::Agent => {
            CUT_REASONS
                .iter()
                .map(|r| sum(text, &format!("{closed}{{reason=\"{r}\"}}")))
                .sum::<f64>()
                + 0.0
        }
    };
    Some(Books {
        opened: sum_present(text, opened)?,
        closed: sum(text, closed),
        open: sum_present(text, open)?,
        cut,
    })
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
    from: Secs,
    to: Secs,
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
    (from, to): (Secs, Secs),
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
pub fn least_allocated(samples: &[Sample], slot: usize, from: Secs, to: Secs) -> Option<f64> {
    samples
        .iter()
        .filter(|s| s.t >= from && s.t <= to)
        .filter_map(|s| s.procs.get(slot).copied().flatten()?.alloc)
        .map(|a| a.allocated)
        .reduce(f64::min)
}

/// The first and last samples within `[from, to]`, at least half a
/// second apart.
fn span(samples: &[Sample], from: Secs, to: Secs) -> Option<(&Sample, &Sample)> {
    let first = samples.iter().find(|s| s.t >= from)?;
    let last = samples.iter().rev().find(|s| s.t <= to)?;
    (last.t - first.t > 0.5).then_some((first, last))
}

/// Rate of `pick` of traffic frontend `i` over `[from, to]`, per second.
pub fn rate(
    samples: &[Sample],
    i: usize,
    from: Secs,
    to: Secs,
    pick: fn(&CountsSnap) -> u64,
) -> Option<f64> {
    let (first, last) = span(samples, from, to)?;
    let now = pick(last.counts.get(i)?);
    let then = pick(first.counts.get(i)?);
    Some(now.saturating_sub(then) as f64 / (last.t - first.t))
}

/// Rate of `pick` of the destination's counts over `[from, to]`, per second.
pub fn dest_rate(
    samples: &[Sample],
    from: Secs,
    to: Secs,
    pick: &dyn Fn(&DestSnap) -> u64,
) -> Option<f64> {
    let (first, last) = span(samples, from, to)?;
    Some(pick(&last.dest).saturating_sub(pick(&first.dest)) as f64 / (last.t - first.t))
}

/// The first resource of any slot whose least value over `[from, to]`
/// (only samples after `after`) is more than [`RESOURCE_SLACK`] above its
/// baseline, described; `None` if all are back.
pub fn worst_resource(
    samples: &[Sample],
    baseline: &[[Option<f64>; 3]],
    (from, to): (Secs, Secs),
    after: Secs,
) -> Option<String> {
    for (slot, base) in baseline.iter().enumerate() {
        for (r, base) in Resource::ALL.iter().zip(base) {
            let Some(base) = base else { continue };
            let Some(now) = least(samples, slot, *r, from.max(after), to) else {
                continue;
            };
            // Descriptors and tasks are whole numbers: 5 % of 15 is less
            // than one, so the bound is rounded up to the next whole one.
            let bound = match r {
                Resource::Rss => base * (1.0 + RESOURCE_SLACK),
                Resource::Fds | Resource::Tasks => (base * (1.0 + RESOURCE_SLACK)).ceil(),
            };
            if now > bound {
                return Some(format!(
                    "slot {slot} {}: {now:.0} vs baseline {base:.0}",
                    r.name()
                ));
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::{
        Alloc, CountsSnap, DestSnap, ProcSample, Resource, Role, Sample, dest_rate, least, rate,
        read_books, sum, sum_present, typical_least, worst_resource,
    };

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

    #[test]
    fn a_resource_above_its_baseline_by_more_than_the_slack_is_named() {
        let samples = series(&[100, 104, 106, 106]);
        let base = [[Some(100.0), Some(10.0), None]];
        assert_eq!(worst_resource(&samples, &base, (0.0, 3.0), 0.0), None);
        assert_eq!(
            worst_resource(&samples, &base, (2.0, 3.0), 0.0).as_deref(),
            Some("slot 0 RSS: 106 vs baseline 100")
        );
        // Samples before `after` do not count.
        assert_eq!(
            worst_resource(&samples, &base, (0.0, 3.0), 2.0).as_deref(),
            Some("slot 0 RSS: 106 vs baseline 100")
        );
    }

    #[test]
    fn books_need_their_opened_and_open_series() {
        let text = "# HELP x\n\
            konnectivity_network_proxy_agent_dial_duration_seconds_count 7\n\
            konnectivity_rs_agent_connections_closed_total{reason=\"endpoint_closed\"} 5\n\
            konnectivity_rs_agent_connections_closed_total{reason=\"stream_gone\"} 1\n\
            konnectivity_network_proxy_agent_open_endpoint_connections 1\n";
        let books = read_books(Role::Agent, text).unwrap();
        assert_eq!(
            (books.opened, books.closed, books.open, books.cut),
            (7.0, 6.0, 1.0, 1.0)
        );
        assert_eq!(books.unaccounted(), 0.0);
        // An exposition without the gauge is not an idle process.
        let no_gauge = text.replace("open_endpoint_connections", "something_else");
        assert_eq!(read_books(Role::Agent, &no_gauge), None);
        // Nor one without the dial counter (the old check read 0 here).
        assert_eq!(read_books(Role::Server, text), None);
        assert_eq!(
            sum(text, "konnectivity_rs_agent_connections_closed_total"),
            6.0
        );
    }

    #[test]
    fn the_baseline_is_taken_from_windows_within_its_own_bounds() {
        // 16 before 30 s but for a dip to 10 at 15 s; 4 from 30 s on.
        let rss: Vec<u64> = (0..60)
            .map(|t| match t {
                15 => 10,
                t if t >= 30 => 4,
                _ => 16,
            })
            .collect();
        let samples = series(&rss);
        // The 5-second windows within [10, 29]: six hold the dip, nine
        // do not; what comes after 29 s does not lower it.
        assert_eq!(
            typical_least(&samples, 0, Resource::Rss, (10.0, 29.0), 5.0),
            Some(16.0)
        );
    }

    /// Samples at `times`, frontend 0 having started `started` exchanges
    /// and the destination accepted twice as many connections.
    fn counted(times: &[(f64, u64)]) -> Vec<Sample> {
        times
            .iter()
            .map(|(t, started)| Sample {
                t: *t,
                procs: Vec::new(),
                counts: vec![CountsSnap {
                    started: *started,
                    ..CountsSnap::default()
                }],
                dest: DestSnap {
                    accepted: 2 * started,
                    ..DestSnap::default()
                },
            })
            .collect()
    }

    #[test]
    fn a_rate_is_taken_between_the_first_and_last_samples_within_its_window() {
        let samples = counted(&[(0.0, 0), (1.0, 10), (2.0, 30), (3.0, 60)]);
        let started = |c: &CountsSnap| c.started;
        let accepted = |d: &DestSnap| d.accepted;
        // From the sample at 1 s to the one at 3 s: 50 in 2 s.
        assert_eq!(rate(&samples, 0, 0.5, 3.0, started), Some(25.0));
        assert_eq!(dest_rate(&samples, 0.5, 3.0, &accepted), Some(50.0));
        // To the last sample at or before 2.5 s: 20 in 1 s.
        assert_eq!(rate(&samples, 0, 1.0, 2.5, started), Some(20.0));
        assert_eq!(dest_rate(&samples, 1.0, 2.5, &accepted), Some(40.0));
        // No frontend 1.
        assert_eq!(rate(&samples, 1, 0.0, 3.0, started), None);
    }

    #[test]
    fn no_rate_is_taken_over_samples_half_a_second_apart_or_less() {
        let started = |c: &CountsSnap| c.started;
        let accepted = |d: &DestSnap| d.accepted;
        let one = counted(&[(10.0, 5), (11.0, 6)]);
        assert_eq!(rate(&one, 0, 10.2, 11.0, started), None);
        assert_eq!(dest_rate(&one, 10.2, 11.0, &accepted), None);
        let half = counted(&[(10.0, 5), (10.5, 6)]);
        assert_eq!(rate(&half, 0, 10.0, 10.5, started), None);
        assert_eq!(dest_rate(&half, 10.0, 10.5, &accepted), None);
    }

    #[test]
    fn a_resource_within_the_slack_is_back_and_whole_counts_round_the_bound_up() {
        // RSS 4 % above its baseline is back.
        let samples = series(&[100, 104, 104]);
        let rss = [[Some(100.0), None, None]];
        assert_eq!(worst_resource(&samples, &rss, (1.0, 2.0), 0.0), None);
        // 5 % of 10 descriptors is half of one: 11 is back, 12 is not.
        let fds = |n: u64| {
            let mut samples = series(&[100]);
            samples[0].procs[0].as_mut().unwrap().fds = n;
            worst_resource(&samples, &[[None, Some(10.0), None]], (0.0, 1.0), 0.0)
        };
        assert_eq!(fds(11), None);
        assert_eq!(fds(12).as_deref(), Some("slot 0 fds: 12 vs baseline 10"));
    }

    #[test]
    fn the_allocators_figures_are_read_only_when_all_are_there() {
        let text = "konnectivity_rs_jemalloc_allocated_bytes 1\n\
            konnectivity_rs_jemalloc_active_bytes 2\n\
            konnectivity_rs_jemalloc_dirty_bytes 3\n\
            konnectivity_rs_jemalloc_metadata_bytes 4\n\
            konnectivity_rs_jemalloc_resident_bytes 5\n\
            konnectivity_rs_jemalloc_retained_bytes 6\n";
        assert_eq!(
            Alloc::read(text),
            Some(Alloc {
                allocated: 1.0,
                active: 2.0,
                dirty: 3.0,
                metadata: 4.0,
                resident: 5.0,
                retained: 6.0,
            })
        );
        let no_retained = text.replace("retained", "something_else");
        assert_eq!(Alloc::read(&no_retained), None);
    }

    #[test]
    fn a_family_sums_its_labelled_series_and_an_absent_one_prints_as_0() {
        let text = "x_total{reason=\"a\"} 7\nx_total{reason=\"b\"} 1\n";
        assert_eq!(sum_present(text, "x_total"), Some(8.0));
        assert_eq!(sum(text, "x_total"), 8.0);
        assert_eq!(sum_present(text, "y_total"), None);
        assert_eq!(format!("{:.0}", sum(text, "y_total")), "0");
    }
}
