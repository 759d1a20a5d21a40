use std::{
    fs,
    sync::{Mutex, mpsc as std_mpsc},
    time::SystemTime,
};

use clap::Parser;
use serde::Deserialize;

use super::{
    record::{AgentEnd, EndedBy, FrontendKind, ServerEnd, ServerTunnel, Timestamp},
    *,
};

/// A record of the tests: its number.
#[derive(Debug, Serialize, Deserialize, PartialEq)]
struct Numbered {
    n: u32,
}

impl Recordable for Numbered {
    fn bounded(self) -> Self {
        self
    }

    fn weight(&self) -> usize {
        4
    }
}

fn file_config(path: &std::path::Path, queue: usize) -> AuditConfig {
    AuditConfig {
        output: Output::File {
            path: path.to_path_buf(),
            rotation: Rotation {
                max_bytes: 100 * MEGABYTE,
                max_backups: 0,
                max_age: None,
            },
        },
        queue,
    }
}

fn numbers(text: &str) -> Vec<u32> {
    text.lines()
        .map(|line| {
            serde_json::from_str::<Numbered>(line)
                .expect("every line is one record")
                .n
        })
        .collect()
}

#[tokio::test]
async fn records_are_written_as_json_lines_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("audit.log");
    let metrics = AuditMetrics::unregistered();
    let log = AuditLog::start(Some(&file_config(&path, 1000)), metrics.clone()).unwrap();
    let sink = log.sink();
    for n in 0..500 {
        assert!(sink.record(Numbered { n }));
    }
    log.close(Duration::from_secs(10)).await;
    let text = fs::read_to_string(&path).unwrap();
    assert_eq!(numbers(&text), (0..500).collect::<Vec<_>>());
    assert_eq!(metrics.written(), 500);
    assert_eq!(metrics.dropped(), 0);
}

#[tokio::test]
async fn shutdown_writes_every_queued_record_and_drops_later_ones() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sub/dir/audit.log");
    let metrics = AuditMetrics::unregistered();
    let log = AuditLog::start(Some(&file_config(&path, 20_000)), metrics.clone()).unwrap();
    let sink = log.sink();
    // Queued faster than the writer writes: most are still queued at close.
    for n in 0..20_000 {
        assert!(sink.record(Numbered { n }), "record {n} was dropped");
    }
    log.close(Duration::from_secs(30)).await;
    let text = fs::read_to_string(&path).unwrap();
    assert_eq!(numbers(&text), (0..20_000).collect::<Vec<_>>());
    // After the close: dropped and counted, never waited for.
    assert!(!sink.record(Numbered { n: 20_000 }));
    assert_eq!(metrics.dropped(), 1);
    assert_eq!(metrics.written(), 20_000);
}

/// A writer that blocks in its first write until released, and says when
/// it got there.
struct Stalled {
    entered: Option<std_mpsc::Sender<()>>,
    release: Option<std_mpsc::Receiver<()>>,
    out: Arc<Mutex<Vec<u8>>>,
}

impl Write for Stalled {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if let (Some(entered), Some(release)) = (self.entered.take(), self.release.take()) {
            entered.send(()).unwrap();
            release.recv().unwrap();
        }
        self.out.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// A writer that counts its flushes.
struct Flushes {
    out: Arc<Mutex<Vec<u8>>>,
    flushes: Arc<AtomicU64>,
}

impl Write for Flushes {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.out.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        self.flushes.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

/// Records that come a millisecond apart are written a batch per
/// [`LINGER`], not one flush each. Each batch but the last lingers at
/// least that long before its flush, so the bound holds however loaded
/// the machine is: a batch per LINGER of sending, the close's batch, and
/// the flush after the loop.
#[tokio::test]
async fn a_deep_queues_records_are_flushed_a_batch_at_a_time() {
    let out = Arc::new(Mutex::new(Vec::new()));
    let flushes = Arc::new(AtomicU64::new(0));
    let writer = Flushes {
        out: out.clone(),
        flushes: flushes.clone(),
    };
    let log = AuditLog::spawn(
        Out::Writer(Box::new(writer)),
        10_000,
        AuditMetrics::unregistered(),
    );
    let sink = log.sink();
    let start = Instant::now();
    for n in 0..100 {
        assert!(sink.record(Numbered { n }));
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let took = start.elapsed();
    log.close(Duration::from_secs(10)).await;
    let text = String::from_utf8(out.lock().unwrap().clone()).unwrap();
    assert_eq!(numbers(&text), (0..100).collect::<Vec<_>>());
    let flushes = flushes.load(Ordering::Relaxed);
    let bound = (took.as_millis() / LINGER.as_millis()) as u64 + 3;
    assert!(flushes <= bound, "{flushes} flushes in {took:?}");
}

/// A writer that says when it flushes.
struct Flushed(std_mpsc::Sender<Instant>);

impl Write for Flushed {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        let _ = self.0.send(Instant::now());
        Ok(())
    }
}

/// How long after each of `trials` lone records (each sent once the one
/// before was flushed) a writer with a queue of `queue` flushed it.
async fn lone_flushes(queue: usize, trials: u32) -> Vec<Duration> {
    let (tx, flushed) = std_mpsc::channel();
    let log = AuditLog::spawn(
        Out::Writer(Box::new(Flushed(tx))),
        queue,
        AuditMetrics::unregistered(),
    );
    let sink = log.sink();
    let mut delays = Vec::new();
    for n in 0..trials {
        let sent = Instant::now();
        assert!(sink.record(Numbered { n }));
        let at = flushed
            .recv_timeout(Duration::from_secs(10))
            .expect("a lone record is flushed");
        delays.push(at.saturating_duration_since(sent));
    }
    log.close(Duration::from_secs(10)).await;
    delays
}

/// A deep queue's writer waits [`LINGER`] for more after a lone record
/// before it flushes (a sleep never ends early, so every flush comes that
/// late); a queue shallow enough to fill meanwhile does not wait: of ten
/// lone records, one at least is flushed sooner than that.
#[tokio::test]
async fn only_a_deep_queues_writer_lingers_before_its_flush() {
    let deep = lone_flushes(LINGER_QUEUE, 5).await;
    assert!(
        deep.iter().all(|d| *d >= LINGER),
        "a deep queue flushed before lingering: {deep:?}"
    );
    let shallow = lone_flushes(LINGER_QUEUE - 1, 10).await;
    let soonest = shallow.iter().min().copied().unwrap_or_default();
    assert!(
        soonest < LINGER,
        "a shallow queue lingered before every flush: {shallow:?}"
    );
}

#[tokio::test]
async fn a_full_queue_drops_and_counts_and_never_blocks() {
    let (entered_tx, entered_rx) = std_mpsc::channel();
    let (release_tx, release_rx) = std_mpsc::channel();
    let out = Arc::new(Mutex::new(Vec::new()));
    let writer = Stalled {
        entered: Some(entered_tx),
        release: Some(release_rx),
        out: out.clone(),
    };
    let metrics = AuditMetrics::unregistered();
    let log = AuditLog::spawn(Out::Writer(Box::new(writer)), 4, metrics.clone());
    let sink = log.sink();
    assert!(sink.record(Numbered { n: 0 }));
    // The writer holds record 0 and is stuck writing it.
    entered_rx.recv().unwrap();
    for n in 1..=4 {
        assert!(sink.record(Numbered { n }), "record {n} fits the queue");
    }
    // The queue is full: these return at once, dropped and counted.
    for n in 5..8 {
        assert!(!sink.record(Numbered { n }));
    }
    assert_eq!(metrics.dropped(), 3);
    release_tx.send(()).unwrap();
    log.close(Duration::from_secs(10)).await;
    let text = String::from_utf8(out.lock().unwrap().clone()).unwrap();
    assert_eq!(numbers(&text), vec![0, 1, 2, 3, 4]);
    assert_eq!(metrics.written(), 5);
}

fn rotation(max_bytes: u64, max_backups: usize) -> Rotation {
    Rotation {
        max_bytes,
        max_backups,
        max_age: None,
    }
}

/// A line of exactly 30 bytes.
fn line(n: u32) -> Vec<u8> {
    format!("{{\"n\":{n:>4},\"pad\":\"..........\"}}\n").into_bytes()
}

fn lines_of(path: &std::path::Path) -> Vec<u32> {
    fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| {
            assert_eq!(l.len() + 1, 30, "a whole line: {l:?}");
            l[5..9].trim().parse().unwrap()
        })
        .collect()
}

#[test]
fn rotates_at_the_size_and_keeps_the_newest_backups() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("audit.log");
    let mut file = RotatingFile::new(path.clone(), rotation(100, 2));
    assert_eq!(line(0).len(), 30);
    for n in 0..20 {
        file.write_line(&line(n)).unwrap();
    }
    file.flush().unwrap();
    // 3 lines (90 bytes) per file: 0-2, 3-5, …, 15-17 rotated, 18-19 current.
    let backups = file.backups().unwrap();
    assert_eq!(backups.len(), 2, "{backups:?}");
    assert_eq!(lines_of(&backups[0]), vec![12, 13, 14]);
    assert_eq!(lines_of(&backups[1]), vec![15, 16, 17]);
    assert_eq!(lines_of(&path), vec![18, 19]);
    for backup in &backups {
        let name = backup.file_name().unwrap().to_str().unwrap();
        assert!(
            name.starts_with("audit-") && name.ends_with(".log"),
            "{name}"
        );
    }
    // Nothing else in the directory: the older backups were removed.
    assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 3);
}

#[test]
fn backups_older_than_the_max_age_are_removed() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("audit.log");
    let old = dir.path().join("audit-2020-01-02T03-04-05.678.log");
    let other = dir.path().join("unrelated-2020-01-02T03-04-05.678.log");
    for stale in [&old, &other] {
        let f = fs::File::create(stale).unwrap();
        f.set_modified(SystemTime::now() - Duration::from_secs(3 * 24 * 3600))
            .unwrap();
    }
    let mut file = RotatingFile::new(
        path.clone(),
        Rotation {
            max_bytes: 30,
            max_backups: 0,
            max_age: Some(Duration::from_secs(24 * 3600)),
        },
    );
    file.write_line(&line(0)).unwrap();
    file.write_line(&line(1)).unwrap();
    file.flush().unwrap();
    assert!(!old.exists(), "a backup past the age is removed");
    assert!(other.exists(), "another file's is not");
    let backups = file.backups().unwrap();
    assert_eq!(backups.len(), 1);
    assert_eq!(lines_of(&backups[0]), vec![0]);
    assert_eq!(lines_of(&path), vec![1]);
}

#[test]
fn a_removed_file_is_recreated() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("audit.log");
    let mut file = RotatingFile::new(path.clone(), rotation(1 << 20, 1));
    file.check().unwrap();
    file.write_line(&line(0)).unwrap();
    file.flush().unwrap();
    fs::remove_file(&path).unwrap();
    // The next batch checks the path first.
    file.check().unwrap();
    file.write_line(&line(1)).unwrap();
    file.flush().unwrap();
    assert_eq!(lines_of(&path), vec![1]);
    // Renamed away (logrotate): the same.
    let moved = dir.path().join("moved.log");
    fs::rename(&path, &moved).unwrap();
    file.check().unwrap();
    file.write_line(&line(2)).unwrap();
    file.flush().unwrap();
    assert_eq!(lines_of(&path), vec![2]);
    assert_eq!(lines_of(&moved), vec![1]);
}

#[tokio::test]
async fn a_failed_write_is_counted_and_the_writer_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("logs/audit.log");
    let metrics = AuditMetrics::unregistered();
    let log = AuditLog::start(Some(&file_config(&path, 100)), metrics.clone()).unwrap();
    let sink = log.sink();
    // The directory becomes a file: the path cannot be opened.
    fs::remove_dir_all(dir.path().join("logs")).unwrap();
    fs::write(dir.path().join("logs"), b"not a directory").unwrap();
    assert!(sink.record(Numbered { n: 0 }));
    // Both the batch's check and the record's own open fail; once both are
    // counted, record 0 is dropped (waiting for the first alone raced the
    // record's open, which then found the directory back and wrote it).
    let written = async {
        while metrics.errors(WriteOp::Open) < 2 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), written)
        .await
        .expect("the failure is counted");
    // Then it is a directory again: the next record is written.
    fs::remove_file(dir.path().join("logs")).unwrap();
    assert!(sink.record(Numbered { n: 1 }));
    log.close(Duration::from_secs(10)).await;
    assert_eq!(numbers(&fs::read_to_string(&path).unwrap()), vec![1]);
    assert_eq!(metrics.written(), 1);
}

#[derive(Parser, Debug)]
struct Cli {
    #[command(flatten)]
    audit: AuditArgs,
}

fn parse(args: &[&str]) -> Result<Option<AuditConfig>, String> {
    let cli = Cli::try_parse_from(std::iter::once("test").chain(args.iter().copied()))
        .map_err(|e| e.to_string())?;
    cli.audit.config().map_err(|e| e.to_string())
}

#[test]
fn flags() {
    assert_eq!(parse(&[]).unwrap(), None);
    let stdout = parse(&["--audit-log-path=-"]).unwrap().unwrap();
    assert_eq!(stdout.output, Output::Stdout);
    assert_eq!(stdout.queue, 10_000);
    let file = parse(&[
        "--audit-log-path=/var/log/konnectivity/audit.log",
        "--audit-log-maxsize=0",
        "--audit-log-maxbackup=3",
        "--audit-log-maxage=7",
        "--audit-log-batch-buffer-size=50",
    ])
    .unwrap()
    .unwrap();
    assert_eq!(
        file,
        AuditConfig {
            output: Output::File {
                path: "/var/log/konnectivity/audit.log".into(),
                rotation: Rotation {
                    max_bytes: 100 * MEGABYTE,
                    max_backups: 3,
                    max_age: Some(Duration::from_secs(7 * 24 * 3600)),
                },
            },
            queue: 50,
        }
    );
    for (args, flag) in [
        (
            &["--audit-log-batch-buffer-size=0"][..],
            "--audit-log-batch-buffer-size",
        ),
        (&["--audit-log-maxsize=-1"], "--audit-log-maxsize"),
        (
            &["--audit-log-maxsize=99999999999999"],
            "--audit-log-maxsize",
        ),
        (&["--audit-log-maxbackup=x"], "--audit-log-maxbackup"),
        (&["--audit-log-maxage=1d"], "--audit-log-maxage"),
    ] {
        let error = parse(args).expect_err(flag);
        assert!(error.contains(flag), "{args:?}: {error}");
    }
}

#[test]
fn a_path_that_cannot_be_opened_names_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let blocker = dir.path().join("file");
    fs::write(&blocker, b"").unwrap();
    let config = file_config(&blocker.join("audit.log"), 10);
    let Err(error) = AuditLog::<Numbered>::start(Some(&config), AuditMetrics::unregistered())
    else {
        panic!("opened a file under a file");
    };
    let text = error.to_string();
    assert!(text.contains("--audit-log-path"), "{text}");
    assert!(text.contains("file/audit.log"), "{text}");
}

/// Run as a child process by [`dash_writes_to_standard_out`]: writes
/// three records to standard out (does nothing otherwise).
#[tokio::test]
async fn stdout_child() {
    if std::env::var_os("AUDIT_STDOUT_CHILD").is_none() {
        return;
    }
    let config = AuditArgs::parse_from_path("-");
    let log = AuditLog::start(Some(&config), AuditMetrics::unregistered()).unwrap();
    for n in [7, 8, 9] {
        log.sink().record(Numbered { n });
    }
    log.close(Duration::from_secs(10)).await;
}

impl AuditArgs {
    fn parse_from_path(path: &str) -> AuditConfig {
        let flag = format!("--audit-log-path={path}");
        Cli::parse_from(["test", flag.as_str()])
            .audit
            .config()
            .unwrap()
            .unwrap()
    }
}

#[test]
fn dash_writes_to_standard_out() {
    let output = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["audit::tests::stdout_child", "--exact", "--nocapture"])
        .env("AUDIT_STDOUT_CHILD", "1")
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    let stdout = String::from_utf8(output.stdout).unwrap();
    let records: String = stdout
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| format!("{l}\n"))
        .collect();
    assert_eq!(numbers(&records), vec![7, 8, 9], "{stdout}");
    let stderr = String::from_utf8(output.stderr).unwrap();
    assert!(!stderr.contains("\"n\":"), "{stderr}");
}

fn server_record(destination: String, error: Option<String>) -> AuditRecord {
    let start = Timestamp(SystemTime::UNIX_EPOCH + Duration::new(1_735_787_045, 123_456_789));
    AuditRecord::Server(ServerTunnel {
        time: start,
        start,
        server_id: "server-a".into(),
        frontend_kind: FrontendKind::Grpc,
        frontend_peer: String::new(),
        frontend_subject: None,
        destination,
        dial_id: 1,
        agent_id: None,
        connection_id: None,
        dial_seconds: None,
        retries: 0,
        hedges: 0,
        bytes_to_agent: 0,
        bytes_to_frontend: 0,
        duration_seconds: 0.0,
        end: ServerEnd::DialFailed,
        ended_by: EndedBy::Agent,
        error,
    })
}

/// A destination of 4 MiB and an agent's error of as much reach the file
/// as their first `RECORD_LIMIT` bytes, marked as cut (issue 51: records
/// carried them whole, and a few hundred took GiBs).
#[tokio::test]
async fn peer_text_in_a_record_is_cut_and_marked() {
    let out = Arc::new(Mutex::new(Vec::new()));
    let log = AuditLog::spawn(
        Out::Writer(Box::new(Flushes {
            out: out.clone(),
            flushes: Arc::default(),
        })),
        16,
        AuditMetrics::unregistered(),
    );
    let huge = "h".repeat(4 << 20);
    let sink = log.sink();
    assert!(sink.record(server_record(huge.clone(), Some(huge.clone()))));
    assert!(sink.record(server_record("10.0.0.7:10250".into(), None)));
    log.close(Duration::from_secs(10)).await;
    let text = String::from_utf8(out.lock().unwrap().clone()).unwrap();
    assert!(text.len() < 4 * proto::text::RECORD_LIMIT, "{}", text.len());
    let records: Vec<AuditRecord> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let AuditRecord::Server(cut) = &records[0] else {
        panic!("{records:?}")
    };
    let mark = format!("…({} more bytes)", (4 << 20) - proto::text::RECORD_LIMIT);
    assert!(cut.destination.ends_with(&mark), "{}", cut.destination);
    assert!(cut.error.as_ref().unwrap().ends_with(&mark));
    assert_eq!(records[1], server_record("10.0.0.7:10250".into(), None));
}

/// While the writer is stuck, records are queued up to [`QUEUE_BYTES`]
/// and no further, however few they are.
#[tokio::test]
async fn the_queue_is_bounded_in_bytes_too() {
    let (entered_tx, entered_rx) = std_mpsc::channel();
    let (release_tx, release_rx) = std_mpsc::channel();
    let metrics = AuditMetrics::unregistered();
    let log = AuditLog::spawn(
        Out::Writer(Box::new(Stalled {
            entered: Some(entered_tx),
            release: Some(release_rx),
            out: Arc::default(),
        })),
        100_000,
        metrics.clone(),
    );
    let sink = log.sink();
    assert!(sink.record(server_record("first".into(), None)));
    entered_rx.recv().unwrap();
    // Each just under the text limit in both fields: about 2 KiB.
    let text = "e".repeat(proto::text::RECORD_LIMIT);
    let weight = server_record(text.clone(), Some(text.clone())).weight();
    let mut queued = 0;
    while sink.record(server_record(text.clone(), Some(text.clone()))) {
        queued += 1;
        assert!(queued <= QUEUE_BYTES / weight, "{queued} records queued");
    }
    assert_eq!(queued, QUEUE_BYTES / weight);
    assert_eq!(metrics.dropped(), 1);
    release_tx.send(()).unwrap();
    log.close(Duration::from_secs(30)).await;
    assert_eq!(metrics.written() as usize, queued + 1);
}

#[test]
fn records_have_their_documented_shape() {
    let start = Timestamp(SystemTime::UNIX_EPOCH + Duration::new(1_735_787_045, 123_456_789));
    let record = AuditRecord::Server(ServerTunnel {
        time: start,
        start,
        server_id: "server-a".into(),
        frontend_kind: FrontendKind::HttpConnect,
        frontend_peer: "unix:/etc/konnectivity/konnectivity-server.socket".into(),
        frontend_subject: None,
        destination: "10.0.0.7:10250".into(),
        dial_id: -5,
        agent_id: Some("node-1".into()),
        connection_id: Some(12),
        dial_seconds: Some(0.002),
        retries: 1,
        hedges: 0,
        bytes_to_agent: 10,
        bytes_to_frontend: 20,
        duration_seconds: 1.5,
        end: ServerEnd::AbandonedByFrontend,
        ended_by: EndedBy::Frontend,
        error: None,
    });
    let json: serde_json::Value = serde_json::to_value(&record).unwrap();
    assert_eq!(json["side"], "server");
    assert_eq!(json["time"], "2025-01-02T03:04:05.123456789Z");
    assert_eq!(json["frontend_kind"], "http_connect");
    assert_eq!(json["end"], "abandoned_by_frontend");
    assert_eq!(json["ended_by"], "frontend");
    assert!(json["frontend_subject"].is_null());
    let back: AuditRecord = serde_json::from_value(json).unwrap();
    assert_eq!(back, record);
    assert_eq!(
        serde_json::to_value(AgentEnd::DrainTimeout).unwrap(),
        "drain_timeout"
    );
}
