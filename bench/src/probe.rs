//! Looking at the processes under test from outside: `/proc/<pid>` (RSS,
//! CPU time), the machine, and the server's health port (`/readyz`,
//! `/metrics`).

use std::{io, net::SocketAddr, time::Duration};

use anyhow::Context;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Clock ticks per second of `utime`/`stime` in `/proc/<pid>/stat`
/// (`USER_HZ`, 100 on every Linux architecture we run on).
pub const CLOCK_TICKS_PER_SEC: f64 = 100.0;

/// The Prometheus gauge of the most bytes the server buffers for one
/// connection.
pub const MAX_BUFFERED_GAUGE: &str = "konnectivity_rs_server_max_buffered_bytes";

/// Longest wait for one health-port answer.
const HTTP_TIMEOUT: Duration = Duration::from_secs(5);

/// `VmRSS` of a `/proc/<pid>/status` text, in bytes.
pub fn parse_vm_rss(status: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let mut words = line["VmRSS:".len()..].split_whitespace();
    let kib: u64 = words.next()?.parse().ok()?;
    match words.next() {
        Some("kB") | None => Some(kib * 1024),
        Some(_) => None,
    }
}

/// `utime + stime` (fields 14 and 15) of a `/proc/<pid>/stat` line, in clock
/// ticks. The command name (field 2) may hold spaces and parentheses, so the
/// fields are counted from the last `)`.
pub fn parse_cpu_ticks(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    // `rest` starts at field 3 (state): field N is at index N - 3.
    let mut fields = rest.split_whitespace().skip(14 - 3);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(utime + stime)
}

/// Resident set size of process `pid`, in bytes.
///
/// # Errors
/// The process is gone or its status has no `VmRSS`.
pub fn rss(pid: u32) -> anyhow::Result<u64> {
    let path = format!("/proc/{pid}/status");
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
    parse_vm_rss(&text).with_context(|| format!("no VmRSS in {path}"))
}

/// CPU time (user + system) used so far by process `pid`, in clock ticks.
///
/// # Errors
/// The process is gone or its stat line is malformed.
pub fn cpu_ticks(pid: u32) -> anyhow::Result<u64> {
    let path = format!("/proc/{pid}/stat");
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
    parse_cpu_ticks(&text).with_context(|| format!("malformed {path}"))
}

/// `voluntary_ctxt_switches + nonvoluntary_ctxt_switches` of a
/// `/proc/<pid>/task/<tid>/status` text: the times one thread left its CPU.
pub fn parse_context_switches(status: &str) -> Option<u64> {
    let count = |key: &str| {
        let line = status.lines().find(|l| l.starts_with(key))?;
        line[key.len()..].trim().parse::<u64>().ok()
    };
    Some(count("voluntary_ctxt_switches:")? + count("nonvoluntary_ctxt_switches:")?)
}

/// Context switches so far of process `pid`'s live threads, summed: what
/// `perf stat -e context-switches` counts, less the threads that exited
/// (the runtime's workers live as long as the process).
///
/// # Errors
/// The process is gone, or a thread's status has no switch counts.
pub fn context_switches(pid: u32) -> anyhow::Result<u64> {
    let dir = format!("/proc/{pid}/task");
    let mut total = 0;
    for task in std::fs::read_dir(&dir).with_context(|| format!("reading {dir}"))? {
        let path = task
            .with_context(|| format!("reading {dir}"))?
            .path()
            .join("status");
        // A thread that exited since the listing has nothing left to count.
        let Ok(text) = std::fs::read_to_string(&path) else {
            continue;
        };
        total += parse_context_switches(&text)
            .with_context(|| format!("no context switches in {}", path.display()))?;
    }
    Ok(total)
}

/// CPU time (user + system) used so far by process `pid`, in seconds.
///
/// # Errors
/// As [`cpu_ticks`].
pub fn cpu_seconds(pid: u32) -> anyhow::Result<f64> {
    Ok(cpu_ticks(pid)? as f64 / CLOCK_TICKS_PER_SEC)
}

/// The value of the sample `name` (no labels, or the largest over its label
/// sets) in a Prometheus text exposition; `None` if absent.
pub fn prometheus_value(exposition: &str, name: &str) -> Option<f64> {
    exposition
        .lines()
        .map(str::trim)
        .filter(|l| !l.starts_with('#'))
        .filter_map(|line| {
            let rest = line.strip_prefix(name)?;
            let rest = if let Some(labelled) = rest.strip_prefix('{') {
                &labelled[labelled.find('}')? + 1..]
            } else if rest.starts_with([' ', '\t']) {
                rest
            } else {
                // A longer metric name that starts with `name`.
                return None;
            };
            rest.split_whitespace().next()?.parse::<f64>().ok()
        })
        .reduce(f64::max)
}

/// A plain HTTP/1.1 `GET` on `addr`; the status code and the body.
///
/// # Errors
/// Connecting, writing or reading fails, takes longer than 5 s, or the
/// answer is not HTTP.
pub async fn http_get(addr: SocketAddr, path: &str) -> anyhow::Result<(u16, String)> {
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(addr).await?;
        stream
            .write_all(
                format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n")
                    .as_bytes(),
            )
            .await?;
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).await?;
        Ok::<_, io::Error>(raw)
    };
    let raw = tokio::time::timeout(HTTP_TIMEOUT, exchange)
        .await
        .map_err(|_| anyhow::anyhow!("GET http://{addr}{path} timed out"))?
        .with_context(|| format!("GET http://{addr}{path}"))?;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .with_context(|| format!("GET http://{addr}{path}: not an HTTP answer"))?;
    Ok((status, body.to_owned()))
}

/// Facts about the machine printed above the results.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Machine {
    /// Logical CPUs this process may use.
    pub nproc: usize,
    /// `/proc/sys/kernel/osrelease`.
    pub kernel: String,
    /// First `model name` of `/proc/cpuinfo`.
    pub cpu: String,
    /// `MemTotal` of `/proc/meminfo`, in MiB.
    pub memory_mib: u64,
}

impl Machine {
    /// Reads the facts; unknown ones are left empty or zero.
    pub fn read() -> Self {
        let read = |path: &str| std::fs::read_to_string(path).unwrap_or_default();
        let cpuinfo = read("/proc/cpuinfo");
        let meminfo = read("/proc/meminfo");
        Self {
            nproc: std::thread::available_parallelism().map_or(0, usize::from),
            kernel: read("/proc/sys/kernel/osrelease").trim().to_owned(),
            cpu: cpuinfo
                .lines()
                .find_map(|l| l.strip_prefix("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_owned())
                .unwrap_or_default(),
            memory_mib: meminfo
                .lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|l| l.split_whitespace().next()?.parse::<u64>().ok())
                .map_or(0, |kib| kib / 1024),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const STATUS: &str = "Name:\tproxy-server\nUmask:\t0022\nState:\tS (sleeping)\n\
        VmPeak:\t  123456 kB\nVmHWM:\t   20000 kB\nVmRSS:\t   12345 kB\n\
        RssAnon:\t    8000 kB\nThreads:\t3\n";

    #[test]
    fn vm_rss_in_bytes() {
        assert_eq!(parse_vm_rss(STATUS), Some(12345 * 1024));
        assert_eq!(parse_vm_rss("Name:\tx\n"), None);
        assert_eq!(parse_vm_rss("VmRSS:\t12 MB\n"), None);
    }

    #[test]
    fn cpu_ticks_are_utime_plus_stime() {
        let stat = "4242 (proxy-server) S 1 4242 4242 0 -1 4194560 1500 0 0 0 \
                    250 130 0 0 20 0 4 0 123456 200000000 3000 18446744073709551615";
        assert_eq!(parse_cpu_ticks(stat), Some(380));
    }

    #[test]
    fn context_switches_are_voluntary_plus_not() {
        let status = "Name:\tproxy-agent\nvoluntary_ctxt_switches:\t1200\n\
            nonvoluntary_ctxt_switches:\t34\n";
        assert_eq!(parse_context_switches(status), Some(1234));
        assert_eq!(
            parse_context_switches("voluntary_ctxt_switches:\t5\n"),
            None
        );
        assert_eq!(parse_context_switches(STATUS), None);
    }

    #[test]
    fn context_switches_of_this_process_grow() {
        let pid = std::process::id();
        let before = context_switches(pid).unwrap();
        // A sleep gives the CPU up: at least one voluntary switch.
        std::thread::sleep(std::time::Duration::from_millis(2));
        assert!(context_switches(pid).unwrap() > before);
    }

    #[test]
    fn cpu_ticks_with_odd_command_name() {
        let stat = "7 (a) b (c)) R 1 7 7 0 -1 0 0 0 0 0 11 22 0 0 20 0 1 0 1 1 1";
        assert_eq!(parse_cpu_ticks(stat), Some(33));
        assert_eq!(parse_cpu_ticks("7 (x) R 1 2"), None);
        assert_eq!(parse_cpu_ticks("garbage"), None);
    }

    #[test]
    fn prometheus_gauge_found() {
        let text = "# HELP konnectivity_rs_server_max_buffered_bytes Most bytes buffered.\n\
                    # TYPE konnectivity_rs_server_max_buffered_bytes gauge\n\
                    konnectivity_rs_server_max_buffered_bytes_total 99\n\
                    konnectivity_rs_server_max_buffered_bytes 262144\n\
                    other_metric 1\n";
        assert_eq!(prometheus_value(text, MAX_BUFFERED_GAUGE), Some(262_144.0));
    }

    #[test]
    fn prometheus_labels_timestamps_and_absence() {
        let text = "m{a=\"1\"} 5 1700000000000\nm{a=\"2\"} 7.5\nmm 100\n";
        assert_eq!(prometheus_value(text, "m"), Some(7.5));
        assert_eq!(prometheus_value("x 1\n", "m"), None);
        assert_eq!(prometheus_value("m\n", "m"), None);
        assert_eq!(prometheus_value("m 1e3\n", "m"), Some(1000.0));
    }
}
