//! Tracing subscriber set-up shared by both binaries (called from `main`
//! only), with klog's flag semantics:
//! - **level**: `RUST_LOG` when set and valid, else the `-v` level; an empty
//!   `RUST_LOG` counts as unset, an invalid one is named in a warning and
//!   ignored;
//! - **destination**: standard error (`--logtostderr=true`, the default), or
//!   `--log-file` with `--logtostderr=false`, started afresh past
//!   `--log-file-max-size`; then ERROR lines (`--stderrthreshold`) also go to
//!   standard error, every line with `--alsologtostderr`, and a file that
//!   cannot be written sends its lines to standard error instead;
//! - a flag that has no effect in the combination given is named in a
//!   warning.

use std::{
    fs::{File, OpenOptions},
    io::{self, Write},
    path::{Path, PathBuf},
    sync::{Arc, Mutex, PoisonError},
};

use tracing::{Level, Metadata, warn};
use tracing_subscriber::{EnvFilter, fmt::MakeWriter, util::SubscriberInitExt};

use crate::flags::{LogArgs, LogFormat};

/// The tracing level a klog `-v` value maps to.
pub fn level_for_verbosity(v: u8) -> &'static str {
    match v {
        0..=4 => "info",
        5..=8 => "debug",
        _ => "trace",
    }
}

/// Logging could not be set up; the message names the flag.
#[derive(Debug, thiserror::Error)]
pub enum LogSetupError {
    /// `--stderrthreshold` is not a klog severity.
    #[error(
        "invalid value {0:?} for --stderrthreshold: want INFO, WARNING, ERROR, FATAL or a number"
    )]
    StderrThreshold(String),
    /// The log file cannot be opened.
    #[error("opening --log-file {}: {cause}", path.display())]
    LogFile {
        /// The file.
        path: PathBuf,
        /// Why (in the message: `main` prints only the message).
        cause: io::Error,
    },
}

/// Installs a plain standard-error subscriber at `level` (`RUST_LOG`
/// overrides as in [`init`]), for tools without klog flags.
pub fn init_simple(level: &str) {
    let (filter, bad_rust_log) = filter_for(rust_log().as_deref(), level);
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(io::stderr)
        .with_ansi(false)
        .init();
    if let Some(notice) = bad_rust_log {
        notice.log();
    }
}

/// Installs the global subscriber as the module docs describe, then logs a
/// warning for each setting that has no effect.
///
/// # Errors
/// A bad `--stderrthreshold`, or the log file cannot be opened.
pub fn init(args: &LogArgs) -> Result<(), LogSetupError> {
    let plan = Plan::new(args, rust_log().as_deref())?;
    let file = match &plan.file {
        Some((path, max)) => Some(Mutex::new(SizedFile::open(path, *max).map_err(
            |cause| LogSetupError::LogFile {
                path: path.clone(),
                cause,
            },
        )?)),
        None => None,
    };
    let writer = LogWriter {
        file: file.map(Arc::new),
        copy_at: plan.copy_at,
        console: Console::Stderr,
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(plan.filter)
        .with_writer(writer)
        .with_ansi(false);
    match args.log_format {
        LogFormat::Json => builder.json().finish().init(),
        LogFormat::Text => builder.finish().init(),
    }
    for notice in plan.notices {
        notice.log();
    }
    Ok(())
}

/// `RUST_LOG`, if set (an empty value counts as unset).
fn rust_log() -> Option<String> {
    std::env::var("RUST_LOG")
        .ok()
        .filter(|v| !v.trim().is_empty())
}

/// The filter: `rust_log` when it parses, else `level` and a notice naming
/// the bad value.
fn filter_for(rust_log: Option<&str>, level: &str) -> (EnvFilter, Option<Notice>) {
    let Some(value) = rust_log.filter(|v| !v.trim().is_empty()) else {
        return (EnvFilter::new(level), None);
    };
    match EnvFilter::builder().parse(value) {
        Ok(filter) => (filter, None),
        Err(error) => (
            EnvFilter::new(level),
            Some(Notice::BadRustLog {
                value: value.to_owned(),
                error: error.to_string(),
                level: level.to_owned(),
            }),
        ),
    }
}

/// klog's `--stderrthreshold`: a severity name (any case) or number. The
/// most verbose level still copied to standard error; `None` copies none.
fn stderr_threshold(text: Option<&str>) -> Result<Option<Level>, LogSetupError> {
    let Some(text) = text else {
        return Ok(Some(Level::ERROR));
    };
    let severity = match text.to_ascii_uppercase().as_str() {
        "INFO" => 0,
        "WARNING" => 1,
        "ERROR" => 2,
        "FATAL" => 3,
        other => other
            .parse::<i32>()
            .map_err(|_| LogSetupError::StderrThreshold(text.to_owned()))?,
    };
    Ok(match severity {
        // klog's INFO holds every -v level, so everything.
        ..=0 => Some(Level::TRACE),
        1 => Some(Level::WARN),
        2 => Some(Level::ERROR),
        // FATAL and above: nothing here logs at FATAL.
        _ => None,
    })
}

/// `--log-file-max-size` in bytes (klog's MB are MiB); 0 means unlimited.
fn max_bytes(megabytes: u64) -> u64 {
    megabytes.saturating_mul(1024 * 1024)
}

/// What [`init`] sets up, worked out from the flags and `RUST_LOG`.
struct Plan {
    /// The level filter.
    filter: EnvFilter,
    /// The log file and its size limit in bytes, if logging to a file.
    file: Option<(PathBuf, u64)>,
    /// With a file: the most verbose level also copied to standard error.
    copy_at: Option<Level>,
    /// Warnings to log once the subscriber is up.
    notices: Vec<Notice>,
}

impl Plan {
    fn new(args: &LogArgs, rust_log: Option<&str>) -> Result<Self, LogSetupError> {
        let mut notices = Vec::new();
        let threshold = stderr_threshold(args.stderrthreshold.as_deref())?;
        let (filter, bad_rust_log) = filter_for(rust_log, level_for_verbosity(args.verbosity));
        notices.extend(bad_rust_log);
        let file = match (&args.log_file, args.logtostderr) {
            (Some(path), false) => Some((path.clone(), max_bytes(args.log_file_max_size))),
            (Some(path), true) => {
                notices.push(Notice::LogFileIgnored(path.clone()));
                None
            }
            (None, false) => {
                notices.push(Notice::NoLogFile);
                None
            }
            (None, true) => None,
        };
        let copy_at = if args.alsologtostderr {
            Some(Level::TRACE)
        } else {
            threshold
        };
        Ok(Self {
            filter,
            file,
            copy_at,
            notices,
        })
    }
}

/// A setting that has no effect, logged once logging works.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Notice {
    /// `RUST_LOG` does not parse.
    BadRustLog {
        /// Its value.
        value: String,
        /// The parse error.
        error: String,
        /// The `-v` level used instead.
        level: String,
    },
    /// `--log-file` with `--logtostderr=true`.
    LogFileIgnored(PathBuf),
    /// `--logtostderr=false` without `--log-file`.
    NoLogFile,
}

impl Notice {
    fn log(self) {
        match self {
            Self::BadRustLog {
                value,
                error,
                level,
            } => warn!(
                rust_log = %value,
                %error,
                %level,
                "RUST_LOG is invalid and ignored; logging at the -v level"
            ),
            Self::LogFileIgnored(path) => warn!(
                log_file = %path.display(),
                "--log-file is ignored because --logtostderr is true; set --logtostderr=false to log to the file"
            ),
            Self::NoLogFile => warn!(
                "--logtostderr=false without --log-file: logging to standard error (--log-dir is not supported)"
            ),
        }
    }
}

/// Where lines go besides the file: standard error (a buffer in tests).
#[derive(Clone)]
enum Console {
    /// The process's standard error.
    Stderr,
    /// A buffer standing in for it.
    #[cfg(test)]
    Buffer(Arc<Mutex<Vec<u8>>>),
}

impl Console {
    fn write_all(&self, buf: &[u8]) -> io::Result<()> {
        match self {
            Self::Stderr => io::stderr().write_all(buf),
            #[cfg(test)]
            Self::Buffer(b) => {
                b.lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .extend_from_slice(buf);
                Ok(())
            }
        }
    }
}

/// Hands the formatter a [`Line`] per event, knowing its level.
#[derive(Clone)]
struct LogWriter {
    /// The log file, or none: standard error only.
    file: Option<Arc<Mutex<SizedFile>>>,
    /// With a file: the most verbose level also copied to the console.
    copy_at: Option<Level>,
    /// Standard error.
    console: Console,
}

impl<'a> MakeWriter<'a> for LogWriter {
    type Writer = Line<'a>;

    fn make_writer(&'a self) -> Line<'a> {
        Line {
            file: self.file.as_deref(),
            to_console: self.file.is_none(),
            console: &self.console,
        }
    }

    fn make_writer_for(&'a self, meta: &Metadata<'_>) -> Line<'a> {
        let copy = self.copy_at.is_some_and(|at| *meta.level() <= at);
        Line {
            file: self.file.as_deref(),
            to_console: self.file.is_none() || copy,
            console: &self.console,
        }
    }
}

/// One formatted event on its way out (the formatter writes it in one call).
struct Line<'a> {
    /// The log file, if any.
    file: Option<&'a Mutex<SizedFile>>,
    /// Also (or only) to the console.
    to_console: bool,
    /// The console.
    console: &'a Console,
}

impl Write for Line<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let mut to_console = self.to_console;
        if let Some(file) = self.file {
            let mut file = file.lock().unwrap_or_else(PoisonError::into_inner);
            if let Err(notice) = file.write(buf) {
                // The line is not lost: standard error takes it.
                if let Some(notice) = notice {
                    let _ = self.console.write_all(notice.as_bytes());
                }
                to_console = true;
            }
        }
        if to_console {
            self.console.write_all(buf)?;
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// A log file started afresh once it exceeds `max` bytes (0 = unlimited),
/// as klog does with `--log-file-max-size`.
struct SizedFile {
    /// Where it lives.
    path: PathBuf,
    /// The open file; `None` after it could not be reopened.
    file: Option<File>,
    /// Bytes written (or, while `file` is `None`, sent to standard error)
    /// since it was (re)started.
    written: u64,
    /// Limit in bytes; 0 means none.
    max: u64,
}

/// Opens `path` for appending (created if missing).
fn open_append(path: &Path) -> io::Result<File> {
    OpenOptions::new().create(true).append(true).open(path)
}

impl SizedFile {
    fn open(path: &Path, max: u64) -> io::Result<Self> {
        let file = open_append(path)?;
        let written = file.metadata().map(|m| m.len()).unwrap_or(0);
        Ok(Self {
            path: path.to_owned(),
            file: Some(file),
            written,
            max,
        })
    }

    /// Writes `buf` to the file, starting it afresh first if `buf` would
    /// take it past its limit.
    ///
    /// # Errors
    /// The file cannot take the line (the caller sends it to standard
    /// error), with a notice for standard error the first time.
    fn write(&mut self, buf: &[u8]) -> Result<(), Option<String>> {
        let len = buf.len() as u64;
        let mut notice = None;
        if self.max > 0 && self.written.saturating_add(len) > self.max {
            notice = self.restart();
        }
        self.written = self.written.saturating_add(len);
        let Some(file) = self.file.as_mut() else {
            return Err(notice);
        };
        file.write_all(buf).map_err(|e| {
            Some(format!(
                "cannot write --log-file {} ({e}); this line goes to standard error\n",
                self.path.display()
            ))
        })
    }

    /// Reopens the file in append mode and empties it; the size count
    /// starts again at 0. On failure lines go to standard error until the
    /// next restart, and the returned notice says so.
    fn restart(&mut self) -> Option<String> {
        self.written = 0;
        // Append mode: if something else truncates the file (copytruncate),
        // lines still land at its end instead of leaving a hole.
        let reopened = open_append(&self.path).and_then(|file| file.set_len(0).map(|()| file));
        match reopened {
            Ok(file) => {
                self.file = Some(file);
                None
            }
            Err(e) => {
                let was_open = self.file.take().is_some();
                was_open.then(|| {
                    format!(
                        "cannot reopen --log-file {} ({e}); logging to standard error\n",
                        self.path.display()
                    )
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;
    use tracing::level_filters::LevelFilter;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        log: LogArgs,
    }

    fn args(flags: &[&str]) -> LogArgs {
        Cli::try_parse_from(std::iter::once("x").chain(flags.iter().copied()))
            .unwrap()
            .log
    }

    #[test]
    fn verbosity_levels() {
        assert_eq!(level_for_verbosity(0), "info");
        assert_eq!(level_for_verbosity(4), "info");
        assert_eq!(level_for_verbosity(5), "debug");
        assert_eq!(level_for_verbosity(9), "trace");
    }

    #[test]
    fn rust_log_overrides_v_unless_empty_or_invalid() {
        let hint = |rust_log: Option<&str>, level| filter_for(rust_log, level).0.max_level_hint();
        assert_eq!(hint(None, "info"), Some(LevelFilter::INFO));
        assert_eq!(hint(Some("trace"), "info"), Some(LevelFilter::TRACE));
        assert_eq!(hint(Some("warn"), "trace"), Some(LevelFilter::WARN));
        // Empty is unset (tracing-subscriber alone would log errors only).
        assert_eq!(hint(Some(""), "debug"), Some(LevelFilter::DEBUG));
        assert_eq!(hint(Some("  "), "debug"), Some(LevelFilter::DEBUG));
        // Invalid: the -v level, and a notice naming the value.
        let (filter, notice) = filter_for(Some("tunnel=loud"), "debug");
        assert_eq!(filter.max_level_hint(), Some(LevelFilter::DEBUG));
        match notice {
            Some(Notice::BadRustLog { value, level, .. }) => {
                assert_eq!((value.as_str(), level.as_str()), ("tunnel=loud", "debug"));
            }
            other => panic!("{other:?}"),
        }
        assert!(filter_for(Some("info"), "debug").1.is_none());
    }

    #[test]
    fn stderrthreshold_is_klogs() {
        for (text, want) in [
            (None, Some(Level::ERROR)),
            (Some("INFO"), Some(Level::TRACE)),
            (Some("info"), Some(Level::TRACE)),
            (Some("0"), Some(Level::TRACE)),
            (Some("-3"), Some(Level::TRACE)),
            (Some("WARNING"), Some(Level::WARN)),
            (Some("1"), Some(Level::WARN)),
            (Some("Error"), Some(Level::ERROR)),
            (Some("2"), Some(Level::ERROR)),
            (Some("FATAL"), None),
            (Some("3"), None),
        ] {
            assert_eq!(stderr_threshold(text).unwrap(), want, "{text:?}");
        }
        let err = stderr_threshold(Some("WARN")).unwrap_err().to_string();
        assert!(
            err.contains("--stderrthreshold") && err.contains("WARN"),
            "{err}"
        );
    }

    #[test]
    fn destinations_and_their_warnings() {
        let plan = Plan::new(&args(&[]), None).unwrap();
        assert!(plan.file.is_none() && plan.notices.is_empty());

        let plan = Plan::new(&args(&["--log-file=/tmp/x.log"]), None).unwrap();
        assert!(plan.file.is_none());
        assert_eq!(
            plan.notices,
            [Notice::LogFileIgnored(PathBuf::from("/tmp/x.log"))]
        );

        let plan = Plan::new(&args(&["--logtostderr=false"]), None).unwrap();
        assert!(plan.file.is_none());
        assert_eq!(plan.notices, [Notice::NoLogFile]);

        let plan = Plan::new(
            &args(&[
                "--logtostderr=false",
                "--log-file=/tmp/x.log",
                "--log-file-max-size=2",
            ]),
            Some(""),
        )
        .unwrap();
        assert_eq!(plan.file, Some((PathBuf::from("/tmp/x.log"), 2 << 20)));
        assert_eq!(plan.copy_at, Some(Level::ERROR));
        assert!(plan.notices.is_empty());

        let also = Plan::new(
            &args(&["--alsologtostderr", "--stderrthreshold=FATAL"]),
            None,
        );
        assert_eq!(also.unwrap().copy_at, Some(Level::TRACE));
        let warning = Plan::new(&args(&["--stderrthreshold=WARNING"]), None);
        assert_eq!(warning.unwrap().copy_at, Some(Level::WARN));
        assert!(Plan::new(&args(&["--stderrthreshold=loud"]), None).is_err());
    }

    #[test]
    fn max_size_saturates() {
        assert_eq!(max_bytes(0), 0);
        assert_eq!(max_bytes(1800), 1800 << 20);
        assert_eq!(max_bytes(u64::MAX), u64::MAX);
    }

    /// Logs one event per level through a file writer; returns (file, console).
    fn log_through(copy_at: Option<Level>) -> (String, String) {
        let dir = tempfile_dir();
        let path = dir.join("log");
        let file = Arc::new(Mutex::new(SizedFile::open(&path, 0).unwrap()));
        let console = Arc::new(Mutex::new(Vec::new()));
        let subscriber = tracing_subscriber::fmt()
            .with_env_filter(EnvFilter::new("trace"))
            .with_writer(LogWriter {
                file: Some(file),
                copy_at,
                console: Console::Buffer(console.clone()),
            })
            .with_ansi(false)
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            tracing::trace!("t-line");
            tracing::debug!("d-line");
            tracing::info!("i-line");
            tracing::warn!("w-line");
            tracing::error!("e-line");
        });
        let console = String::from_utf8(console.lock().unwrap().clone()).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        (text, console)
    }

    fn tempfile_dir() -> PathBuf {
        let dir = std::env::temp_dir().join(format!("tunnel-log-{}", fastrand::u64(..)));
        std::fs::create_dir(&dir).unwrap();
        dir
    }

    fn has(text: &str, lines: &[&str]) -> bool {
        lines.iter().all(|l| text.contains(l))
    }

    #[test]
    fn errors_and_above_are_copied_to_standard_error() {
        let all = ["t-line", "d-line", "i-line", "w-line", "e-line"];
        let (file, console) = log_through(Some(Level::ERROR));
        assert!(has(&file, &all), "{file}");
        assert!(console.contains("e-line"), "{console}");
        assert!(!has(&console, &["w-line"]) && !console.contains("i-line"));
        let (_, console) = log_through(Some(Level::WARN));
        assert!(has(&console, &["w-line", "e-line"]) && !console.contains("i-line"));
        let (_, console) = log_through(Some(Level::TRACE));
        assert!(has(&console, &all), "{console}");
        let (file, console) = log_through(None);
        assert!(has(&file, &all) && console.is_empty(), "{console}");
    }

    #[test]
    fn log_file_starts_afresh_past_its_limit_in_append_mode() {
        let dir = tempfile_dir();
        let path = dir.join("log");
        let mut file = SizedFile::open(&path, 10).unwrap();
        file.write(b"12345678").unwrap();
        file.write(b"abcdef").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"abcdef");
        assert_eq!(file.written, 6, "the count starts again");
        // Someone truncates the file under us: the next line lands at its
        // start, not after a hole of zeros.
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(0)
            .unwrap();
        file.write(b"xy").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"xy");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_log_file_that_cannot_be_reopened_falls_back_to_standard_error() {
        let dir = tempfile_dir();
        let path = dir.join("log");
        let file = Mutex::new(SizedFile::open(&path, 10).unwrap());
        let console_buf = Arc::new(Mutex::new(Vec::new()));
        let console = Console::Buffer(console_buf.clone());
        let line = || Line {
            file: Some(&file),
            to_console: false,
            console: &console,
        };
        line().write_all(b"first\n").unwrap();
        // The directory goes away: the restart cannot reopen the file.
        std::fs::remove_dir_all(&dir).unwrap();
        line().write_all(b"second-line\n").unwrap();
        line().write_all(b"third\n").unwrap();
        let text = String::from_utf8(console_buf.lock().unwrap().clone()).unwrap();
        assert!(text.contains("cannot reopen --log-file"), "{text}");
        assert_eq!(text.matches("cannot reopen").count(), 1, "{text}");
        assert!(text.ends_with("second-line\nthird\n"), "{text}");
        // Once the directory is back, the next restart writes to the file again.
        std::fs::create_dir(&dir).unwrap();
        line().write_all(b"0123456789\n").unwrap();
        line().write_all(b"back\n").unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "back\n");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
