//! Tracing subscriber set-up shared by both binaries (called from `main` only).

use std::{
    fs::{File, OpenOptions},
    io::{self, Write},
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
};

use tracing_subscriber::{EnvFilter, fmt::MakeWriter};

use crate::flags::{LogArgs, LogFormat};

/// The tracing level a klog `-v` value maps to.
pub fn level_for_verbosity(v: u8) -> &'static str {
    match v {
        0..=4 => "info",
        5..=8 => "debug",
        _ => "trace",
    }
}

/// Installs a plain standard-error subscriber at `level` (`RUST_LOG`
/// overrides), for tools without klog flags.
pub fn init_simple(level: &str) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(level));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(io::stderr)
        .with_ansi(false)
        .init();
}

/// Installs the global subscriber: `RUST_LOG` if set, else the `-v` level;
/// standard error, or `--log-file` when `--logtostderr=false`.
///
/// # Errors
/// The log file cannot be opened (the message names it).
pub fn init(args: &LogArgs) -> io::Result<()> {
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new(level_for_verbosity(args.verbosity)));
    let writer = match (&args.log_file, args.logtostderr) {
        (Some(path), false) => LogWriter::File {
            file: Arc::new(Mutex::new(SizedFile::open(
                path,
                args.log_file_max_size * 1024 * 1024,
            )?)),
            also_stderr: args.alsologtostderr,
        },
        _ => LogWriter::Stderr,
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(writer)
        .with_ansi(false);
    match args.log_format {
        LogFormat::Json => builder.json().init(),
        LogFormat::Text => builder.init(),
    }
    Ok(())
}

/// Where log lines go.
#[derive(Clone)]
enum LogWriter {
    /// Standard error.
    Stderr,
    /// A size-bounded file, optionally mirrored to standard error.
    File {
        /// The file, shared by every writer handed out.
        file: Arc<Mutex<SizedFile>>,
        /// Mirror to standard error too (`--alsologtostderr`).
        also_stderr: bool,
    },
}

impl<'a> MakeWriter<'a> for LogWriter {
    type Writer = Self;
    fn make_writer(&'a self) -> Self {
        self.clone()
    }
}

impl Write for LogWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Self::Stderr => io::stderr().write(buf),
            Self::File { file, also_stderr } => {
                if *also_stderr {
                    io::stderr().write_all(buf)?;
                }
                file.lock()
                    .map_err(|_| io::Error::other("log file lock poisoned"))?
                    .write(buf)
            }
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// A log file that starts afresh once it exceeds `max` bytes (0 = unlimited),
/// as klog does with `--log-file-max-size`.
struct SizedFile {
    /// Where it lives.
    path: PathBuf,
    /// The open file.
    file: File,
    /// Bytes written since it was (re)started.
    written: u64,
    /// Limit in bytes; 0 means none.
    max: u64,
}

impl SizedFile {
    fn open(path: &Path, max: u64) -> io::Result<Self> {
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(|e| {
                io::Error::new(
                    e.kind(),
                    format!("opening --log-file {}: {e}", path.display()),
                )
            })?;
        let written = file.metadata().map(|m| m.len()).unwrap_or(0);
        Ok(Self {
            path: path.to_owned(),
            file,
            written,
            max,
        })
    }

    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.max > 0 && self.written + buf.len() as u64 > self.max {
            self.file = OpenOptions::new()
                .create(true)
                .write(true)
                .truncate(true)
                .open(&self.path)?;
            self.written = 0;
        }
        self.file.write_all(buf)?;
        self.written += buf.len() as u64;
        Ok(buf.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verbosity_levels() {
        assert_eq!(level_for_verbosity(0), "info");
        assert_eq!(level_for_verbosity(4), "info");
        assert_eq!(level_for_verbosity(5), "debug");
        assert_eq!(level_for_verbosity(9), "trace");
    }

    #[test]
    fn log_file_starts_afresh_past_its_limit() {
        let path = std::env::temp_dir().join(format!("tunnel-log-{}", fastrand::u64(..)));
        let mut file = SizedFile::open(&path, 10).unwrap();
        file.write(b"12345678").unwrap();
        file.write(b"abcdef").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"abcdef");
        std::fs::remove_file(&path).unwrap();
    }
}
