//! The audit log: one JSON line per tunnel and side ([`record`]), written
//! off the bytes' path. Any task hands a record to a [`Sink`], which never
//! waits: the record goes into a bounded queue
//! (`--audit-log-batch-buffer-size`), or, when the queue is full, is
//! dropped, counted (`<prefix>audit_records_dropped_total`) and said in a
//! warning at most every [`SAY_EVERY`]. One writer thread serialises the
//! records and appends them to `--audit-log-path` ([`file`], rotated by
//! size) or, for `-`, to standard out (as kube-apiserver's
//! `--audit-log-path=-`). A failed write is counted by where it failed
//! (`<prefix>audit_write_errors_total{op}`), logged once per [`SAY_EVERY`]
//! and place, and the writer goes on with the next record (reopening the
//! file). [`AuditLog::close`] writes every queued record before the process
//! exits, within a timeout.

pub mod file;
pub mod record;

use std::{
    io::{self, Write},
    path::PathBuf,
    sync::{
        Arc,
        atomic::{AtomicU64, AtomicUsize, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use serde::Serialize;
use tokio::sync::{mpsc, oneshot};
use tracing::{debug, info, warn};

use crate::{
    flags::{FlagError, invalid},
    metrics::{ByLabel, Counter, Metrics},
};
pub use file::Rotation;
use file::{Op, RotatingFile};
pub use record::AuditRecord;

/// How often at most a warning about dropped records, or about failed
/// writes of one kind, is logged.
pub const SAY_EVERY: Duration = Duration::from_secs(10);

/// kube-apiserver's default `--audit-log-batch-buffer-size`.
const DEFAULT_QUEUE: usize = 10_000;

/// Bytes of records queued for the writer, at most: past it, records are
/// dropped and counted as when the queue is full. With every peer text cut
/// ([`Recordable::bounded`]) 10,000 records of the largest kind fit in it; it
/// is what keeps a flood of them from taking more than this.
pub const QUEUE_BYTES: usize = 16 << 20;

/// What the audit log queues: a record whose peer texts are bounded, and
/// whose size it can tell.
pub trait Recordable: Serialize + Send + 'static {
    /// The record with every text a peer gave (a destination, an error, a
    /// subject) cut to `proto::text::RECORD_LIMIT` bytes, marked as cut.
    #[must_use]
    fn bounded(self) -> Self;
    /// About how many bytes it holds.
    fn weight(&self) -> usize;
}

/// lumberjack's megabyte.
const MEGABYTE: u64 = 1024 * 1024;

/// The audit log's flags, named and read as kube-apiserver's.
#[derive(Debug, Clone, clap::Args)]
pub struct AuditArgs {
    /// Write one JSON line per tunnel, at its end, to this file; `-` means
    /// standard out; unset (the default), no audit log (konnectivity-rs;
    /// kube-apiserver's flag).
    #[arg(long = "audit-log-path", value_name = "PATH")]
    pub path: Option<PathBuf>,
    /// Megabytes (MiB) the audit log file may reach before it is rotated;
    /// 0 means 100, as in kube-apiserver.
    #[arg(long = "audit-log-maxsize", value_name = "MB", default_value_t = 100)]
    pub max_size: u64,
    /// Rotated audit log files kept; 0 keeps every one (kube-apiserver's
    /// default; ours keeps 10, so that a node's disk cannot fill).
    #[arg(
        long = "audit-log-maxbackup",
        value_name = "FILES",
        default_value_t = 10
    )]
    pub max_backup: usize,
    /// Days a rotated audit log file is kept (by its modification time);
    /// 0 keeps it whatever its age.
    #[arg(long = "audit-log-maxage", value_name = "DAYS", default_value_t = 0)]
    pub max_age: u64,
    /// Records queued for the writer; past it, records are dropped and
    /// counted, never waited for.
    #[arg(
        long = "audit-log-batch-buffer-size",
        value_name = "RECORDS",
        default_value_t = DEFAULT_QUEUE
    )]
    pub batch_buffer_size: usize,
}

/// Where records go.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Output {
    /// Standard out (`--audit-log-path=-`).
    Stdout,
    /// A file, rotated.
    File {
        /// `--audit-log-path`.
        path: PathBuf,
        /// Its rotation.
        rotation: Rotation,
    },
}

/// The validated audit log flags.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AuditConfig {
    /// Where records go.
    pub output: Output,
    /// The queue's size in records.
    pub queue: usize,
}

impl AuditArgs {
    /// The audit log's configuration; `None` when it is off.
    ///
    /// # Errors
    /// A value out of range, naming its flag.
    pub fn config(&self) -> Result<Option<AuditConfig>, FlagError> {
        if self.batch_buffer_size == 0 {
            return Err(invalid(
                "audit-log-batch-buffer-size",
                "0 would drop every record; give at least 1",
            ));
        }
        let days = Duration::from_secs(24 * 3600);
        let max_age = match self.max_age {
            0 => None,
            n => Some(
                days.checked_mul(u32::try_from(n).unwrap_or(u32::MAX))
                    .ok_or_else(|| invalid("audit-log-maxage", format!("{n} days is too long")))?,
            ),
        };
        let max_mb = if self.max_size == 0 {
            100
        } else {
            self.max_size
        };
        let max_bytes = max_mb.checked_mul(MEGABYTE).ok_or_else(|| {
            invalid(
                "audit-log-maxsize",
                format!("{} MB is too large", self.max_size),
            )
        })?;
        let Some(path) = self.path.as_ref().filter(|p| !p.as_os_str().is_empty()) else {
            return Ok(None);
        };
        let output = match path.to_str() {
            Some("-") => Output::Stdout,
            _ => Output::File {
                path: path.clone(),
                rotation: Rotation {
                    max_bytes,
                    max_backups: self.max_backup,
                    max_age,
                },
            },
        };
        Ok(Some(AuditConfig {
            output,
            queue: self.batch_buffer_size,
        }))
    }
}

crate::label_enum! {
    /// Where an audit log write failed (`op`).
    pub enum WriteOp {
        /// Opening or creating the file.
        Open = "open",
        /// Writing or flushing.
        Write = "write",
        /// Rotating: renaming the file, removing old backups.
        Rotate = "rotate",
    }
}

impl From<Op> for WriteOp {
    fn from(op: Op) -> Self {
        match op {
            Op::Open => Self::Open,
            Op::Write => Self::Write,
            Op::Rotate => Self::Rotate,
        }
    }
}

/// The audit log's metrics of one binary, registered under its prefix.
#[derive(Clone, Debug)]
pub struct AuditMetrics {
    /// Records written.
    written: Counter,
    /// Records dropped: the queue was full, or the log closed.
    dropped: Counter,
    /// Failed writes, by where they failed.
    errors: Arc<ByLabel<WriteOp, Counter>>,
}

impl AuditMetrics {
    /// Registers `<prefix>audit_records_total`,
    /// `<prefix>audit_records_dropped_total` and
    /// `<prefix>audit_write_errors_total` (`konnectivity_rs_server_`, …).
    pub fn register(metrics: &mut Metrics, prefix: &str) -> Self {
        Self {
            written: metrics.register(
                format!("{prefix}audit_records_total"),
                "Audit records written (--audit-log-path)",
                Counter::default(),
            ),
            dropped: metrics.register(
                format!("{prefix}audit_records_dropped_total"),
                "Audit records dropped because the queue was full (--audit-log-batch-buffer-size) or the log was closed",
                Counter::default(),
            ),
            errors: Arc::new(ByLabel::register(
                metrics,
                format!("{prefix}audit_write_errors_total"),
                "Audit log writes that failed, by where (open, write, rotate); the record being written is lost",
                "op",
            )),
        }
    }

    /// Metrics registered nowhere (tests, tools).
    pub fn unregistered() -> Self {
        Self::register(&mut Metrics::default(), "")
    }

    /// Records written so far.
    pub fn written(&self) -> u64 {
        self.written.get() as u64
    }

    /// Records dropped so far.
    pub fn dropped(&self) -> u64 {
        self.dropped.get() as u64
    }

    /// Failed writes of `op` so far.
    pub fn errors(&self, op: WriteOp) -> u64 {
        self.errors.get(op).get() as u64
    }
}

/// What the writer is sent.
enum Msg<R> {
    /// A record to write, and its weight ([`Recordable::weight`]).
    Record(R, usize),
    /// Write what is queued, then stop.
    Close,
}

/// What a sink's clones share: the drop count not yet said, and when it
/// was last said.
#[derive(Debug)]
struct Drops {
    /// The metrics.
    metrics: AuditMetrics,
    /// Bytes of the records queued ([`QUEUE_BYTES`]); the writer takes a
    /// record's weight off as it takes the record.
    queued_bytes: Arc<AtomicUsize>,
    /// Drops since the last warning.
    unsaid: AtomicU64,
    /// Milliseconds after `epoch` of the last warning (0: never).
    said_at: AtomicU64,
    /// The sink's start.
    epoch: Instant,
}

impl Drops {
    fn dropped(&self) {
        self.metrics.dropped.inc();
        self.unsaid.fetch_add(1, Ordering::Relaxed);
        let now = u64::try_from(self.epoch.elapsed().as_millis())
            .unwrap_or(u64::MAX)
            .max(1);
        let last = self.said_at.load(Ordering::Relaxed);
        let due = last == 0 || now.saturating_sub(last) >= SAY_EVERY.as_millis() as u64;
        if due
            && self
                .said_at
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            let records = self.unsaid.swap(0, Ordering::Relaxed);
            warn!(
                records,
                "audit records dropped: the queue is full (--audit-log-batch-buffer-size, or 16 MiB)"
            );
        }
    }
}

/// Where any task hands its records: never waits. Cheap to clone; a
/// disabled sink (no `--audit-log-path`) takes records and does nothing.
pub struct Sink<R> {
    /// The writer's queue and the drop count; `None` when disabled.
    inner: Option<(mpsc::Sender<Msg<R>>, Arc<Drops>)>,
}

impl<R> Clone for Sink<R> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
        }
    }
}

impl<R> std::fmt::Debug for Sink<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sink")
            .field("enabled", &self.inner.is_some())
            .finish()
    }
}

impl<R: Recordable> Sink<R> {
    /// Queues `record`, its peer texts bounded, for the writer; when the
    /// queue is full (in records or in [`QUEUE_BYTES`]), or the log closed,
    /// drops it and counts it. Returns whether it was queued.
    pub fn record(&self, record: R) -> bool {
        let Some((tx, drops)) = &self.inner else {
            return false;
        };
        let record = record.bounded();
        let weight = record.weight();
        let queued = drops.queued_bytes.fetch_add(weight, Ordering::Relaxed);
        if queued + weight > QUEUE_BYTES || tx.try_send(Msg::Record(record, weight)).is_err() {
            drops.queued_bytes.fetch_sub(weight, Ordering::Relaxed);
            drops.dropped();
            return false;
        }
        true
    }
}

impl<R> Sink<R> {
    /// A sink that records nothing.
    pub fn disabled() -> Self {
        Self { inner: None }
    }

    /// Whether records are kept: callers may skip building one otherwise.
    pub fn enabled(&self) -> bool {
        self.inner.is_some()
    }
}

/// The running audit log: its sink and its writer thread, until
/// [`AuditLog::close`].
pub struct AuditLog<R> {
    /// The sink handed to tasks.
    sink: Sink<R>,
    /// Signalled by the writer once it has written all and stopped.
    done: Option<oneshot::Receiver<()>>,
}

impl<R: Recordable> AuditLog<R> {
    /// Starts the writer for `config`, or a disabled log for `None`; the
    /// file is opened now.
    ///
    /// # Errors
    /// The file cannot be opened, naming `--audit-log-path`.
    pub fn start(config: Option<&AuditConfig>, metrics: AuditMetrics) -> Result<Self, FlagError> {
        let Some(config) = config else {
            return Ok(Self {
                sink: Sink::disabled(),
                done: None,
            });
        };
        let out = match &config.output {
            Output::Stdout => Out::Stdout,
            Output::File { path, rotation } => {
                let mut file = RotatingFile::new(path.clone(), rotation.clone());
                file.open().map_err(|e| {
                    invalid("audit-log-path", format!("opening {}: {e}", path.display()))
                })?;
                Out::File(file)
            }
        };
        info!(output = ?config.output, queue = config.queue, "audit log on");
        Ok(Self::spawn(out, config.queue, metrics))
    }

    fn spawn(out: Out, queue: usize, metrics: AuditMetrics) -> Self {
        let (tx, rx) = mpsc::channel(queue);
        let (done_tx, done) = oneshot::channel();
        let queued_bytes = Arc::new(AtomicUsize::new(0));
        let drops = Arc::new(Drops {
            metrics: metrics.clone(),
            queued_bytes: queued_bytes.clone(),
            unsaid: AtomicU64::new(0),
            said_at: AtomicU64::new(0),
            epoch: Instant::now(),
        });
        let writer = Writer {
            out,
            metrics,
            said: [None; 3],
            line: Vec::with_capacity(1024),
            linger: lingers(queue),
            queued_bytes,
        };
        // A thread, not a task: file writes block.
        let spawned = thread::Builder::new()
            .name("audit-log".into())
            .spawn(move || {
                writer.run(rx);
                let _ = done_tx.send(());
            });
        if let Err(e) = spawned {
            warn!(error = %e, "cannot start the audit log's writer; no records will be written");
            return Self {
                sink: Sink::disabled(),
                done: None,
            };
        }
        Self {
            sink: Sink {
                inner: Some((tx, drops)),
            },
            done: Some(done),
        }
    }
}

impl<R> AuditLog<R> {
    /// A sink for the tasks that record.
    pub fn sink(&self) -> Sink<R> {
        self.sink.clone()
    }

    /// Writes every record queued so far, and any queued while it waits,
    /// then stops the writer; gives up after `timeout` (the rest is lost,
    /// and said). Records handed to a sink afterwards are dropped and
    /// counted.
    pub async fn close(self, timeout: Duration) {
        let (Some((tx, _)), Some(done)) = (self.sink.inner, self.done) else {
            return;
        };
        let deadline = tokio::time::Instant::now() + timeout;
        let queued = tx.max_capacity() - tx.capacity();
        let closed = async {
            // Waits for room behind the queued records.
            if tx.send(Msg::Close).await.is_ok() {
                let _ = done.await;
            }
        };
        if tokio::time::timeout_at(deadline, closed).await.is_err() {
            let left = tx.max_capacity() - tx.capacity();
            warn!(
                records = left,
                ?timeout,
                "audit log not written out in time; its queued records are lost"
            );
        } else {
            debug!(records = queued, "audit log written out");
        }
    }
}

/// The writer thread's output.
enum Out {
    /// Standard out.
    Stdout,
    /// The rotated file.
    File(RotatingFile),
    /// Any writer (tests).
    #[cfg(test)]
    Writer(Box<dyn Write + Send>),
}

/// The writer thread's state.
struct Writer {
    /// Where lines go.
    out: Out,
    /// What it counts.
    metrics: AuditMetrics,
    /// When each kind of error was last said, and how many since.
    said: [Option<(Instant, u64)>; 3],
    /// The line being written, reused.
    line: Vec<u8>,
    /// Whether a batch waits for more records after its first
    /// ([`LINGER`]): only when the queue is deep enough not to fill
    /// meanwhile.
    linger: bool,
    /// Bytes of the records queued, shared with the sinks.
    queued_bytes: Arc<AtomicUsize>,
}

/// Records taken from the queue per batch (between checks of the file
/// and flushes).
const BATCH: usize = 256;

/// How long a batch waits for more records after its first, so that a
/// busy server checks and flushes its file once per batch rather than once
/// per tunnel, and its tunnels' ends do not each wake the writer. In
/// `bench --scenarios overhead` the audit log cost 1.11–1.13× the CPU per
/// single-use tunnel of no log before this wait (a stat, a write, a flush
/// and a wake-up for every record), 1.04× after (`docs/performance.md`).
/// A record reaches the file this much later at most; at shutdown every
/// queued record is written all the same.
const LINGER: Duration = Duration::from_millis(20);

/// How often a lingering batch looks at the queue: it stops waiting once
/// [`BATCH`] records are queued.
const LINGER_STEP: Duration = Duration::from_millis(5);

/// The smallest queue (`--audit-log-batch-buffer-size`) that lingers: it
/// takes [`BATCH`] records to end a wait early, and a queue this deep
/// fills in one [`LINGER_STEP`] only at 100,000 records a second.
const LINGER_QUEUE: usize = 2 * BATCH;

/// Whether a writer with a queue of `queue` records lingers: a shallow
/// queue could fill while it waits, and its records would be dropped.
fn lingers(queue: usize) -> bool {
    queue >= LINGER_QUEUE
}

impl Writer {
    /// Writes batches until closed: each batch is what is queued (up to
    /// [`BATCH`]), then a flush.
    fn run<R: Serialize>(mut self, mut rx: mpsc::Receiver<Msg<R>>) {
        let mut batch = Vec::with_capacity(BATCH);
        let mut closing = false;
        while !closing {
            let Some(first) = rx.blocking_recv() else {
                break;
            };
            batch.push(first);
            self.linger(&rx);
            while batch.len() < BATCH {
                match rx.try_recv() {
                    Ok(msg) => batch.push(msg),
                    Err(_) => break,
                }
            }
            if let Out::File(file) = &mut self.out
                && let Err((op, e)) = file.check()
            {
                self.failed(op, &e);
            }
            for msg in batch.drain(..) {
                match msg {
                    Msg::Record(record, weight) => self.write(&record, weight),
                    Msg::Close => {
                        closing = true;
                        // Nothing more is taken; what was queued is written.
                        rx.close();
                    }
                }
            }
            self.flush();
        }
        while let Ok(msg) = rx.try_recv() {
            if let Msg::Record(record, weight) = msg {
                self.write(&record, weight);
            }
        }
        self.flush();
    }

    /// After a batch's first record, waits up to [`LINGER`] for
    /// [`BATCH`] more (a deep queue only), looking every [`LINGER_STEP`].
    /// Not parked on the queue meanwhile, so senders wake nobody.
    fn linger<R>(&self, rx: &mpsc::Receiver<Msg<R>>) {
        if !self.linger {
            return;
        }
        let start = Instant::now();
        while rx.len() < BATCH && start.elapsed() < LINGER && !rx.is_closed() {
            thread::sleep(LINGER_STEP);
        }
    }

    fn write<R: Serialize>(&mut self, record: &R, weight: usize) {
        self.queued_bytes.fetch_sub(weight, Ordering::Relaxed);
        self.line.clear();
        if let Err(e) = serde_json::to_writer(&mut self.line, record) {
            self.failed(Op::Write, &io::Error::other(e));
            return;
        }
        self.line.push(b'\n');
        let result = match &mut self.out {
            Out::Stdout => io::stdout()
                .lock()
                .write_all(&self.line)
                .map_err(|e| (Op::Write, e)),
            Out::File(file) => file.write_line(&self.line),
            #[cfg(test)]
            Out::Writer(w) => w.write_all(&self.line).map_err(|e| (Op::Write, e)),
        };
        match result {
            Ok(()) => self.metrics.written.inc(),
            Err((op, e)) => self.failed(op, &e),
        }
    }

    fn flush(&mut self) {
        let result = match &mut self.out {
            Out::Stdout => io::stdout().lock().flush().map_err(|e| (Op::Write, e)),
            Out::File(file) => file.flush(),
            #[cfg(test)]
            Out::Writer(w) => w.flush().map_err(|e| (Op::Write, e)),
        };
        if let Err((op, e)) = result {
            self.failed(op, &e);
        }
    }

    /// Counts a failure, and says it unless one of its kind was said
    /// within [`SAY_EVERY`].
    fn failed(&mut self, op: Op, error: &io::Error) {
        let op = WriteOp::from(op);
        self.metrics.errors.get(op).inc();
        let slot = &mut self.said[op as usize];
        match slot {
            Some((at, since)) if at.elapsed() < SAY_EVERY => *since += 1,
            _ => {
                let suppressed = slot.map_or(0, |(_, since)| since);
                *slot = Some((Instant::now(), 0));
                warn!(op = op.as_str(), error = %error, suppressed, "audit log write failed; going on");
            }
        }
    }
}

#[cfg(test)]
mod tests;
