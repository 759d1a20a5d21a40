//! The audit log's file: JSON lines appended to `--audit-log-path`,
//! rotated by size as kube-apiserver's (lumberjack's) is: past
//! `--audit-log-maxsize` the file is renamed `<name>-<UTC time>.<ext>`
//! (`audit-2025-01-02T03-04-05.123.log`) and a new one started; backups
//! past `--audit-log-maxbackup`, or older than `--audit-log-maxage` (by
//! their modification time), are removed. A line is never split across
//! two files. Before each batch the path is checked: a file removed or
//! renamed away (by hand, by logrotate) is replaced by a new one.
//!
//! Hand-written rather than a crate's: the maintained rotation crates
//! panic on a directory they cannot create, write into the void when the
//! file cannot be opened (nothing to count), cut a line at the size limit,
//! or print to standard error themselves (see the commit that added this).

use std::{
    fs::{self, File, OpenOptions},
    io::{self, BufWriter, Write},
    os::unix::fs::{MetadataExt, OpenOptionsExt},
    path::{Path, PathBuf},
    time::{Duration, SystemTime},
};

use time::{OffsetDateTime, macros::format_description};

/// Where a write failed, for the error's log line and metric (`op`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Op {
    /// Opening (or creating) the file.
    Open,
    /// Writing or flushing a line.
    Write,
    /// Renaming the full file, or removing old backups.
    Rotate,
}

/// How the file is rotated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rotation {
    /// Bytes past which the file is rotated.
    pub max_bytes: u64,
    /// Backups kept; 0 keeps every one.
    pub max_backups: usize,
    /// Backups older than this are removed; `None` keeps them.
    pub max_age: Option<Duration>,
}

/// The audit log file, opened when first needed.
pub(crate) struct RotatingFile {
    /// `--audit-log-path`.
    path: PathBuf,
    /// The limits.
    rotation: Rotation,
    /// The open file and its identity (device, inode); `None` until opened
    /// and after a failure.
    file: Option<(BufWriter<File>, (u64, u64))>,
    /// Bytes in the current file.
    written: u64,
    /// The time in the last backup's name, so that the next is later.
    last_backup: Option<OffsetDateTime>,
}

impl RotatingFile {
    /// A file at `path` (nothing is opened yet).
    pub(crate) fn new(path: PathBuf, rotation: Rotation) -> Self {
        Self {
            path,
            rotation,
            file: None,
            written: 0,
            last_backup: None,
        }
    }

    /// Opens the file now (at start-up, so a path that cannot work is an
    /// error naming the flag).
    pub(crate) fn open(&mut self) -> io::Result<()> {
        if let Some(dir) = self.path.parent().filter(|d| !d.as_os_str().is_empty()) {
            fs::create_dir_all(dir)?;
        }
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(&self.path)?;
        let meta = file.metadata()?;
        self.written = meta.len();
        self.file = Some((BufWriter::new(file), (meta.dev(), meta.ino())));
        Ok(())
    }

    /// Before a batch: reopens the file if the path no longer names it
    /// (removed, or renamed away).
    pub(crate) fn check(&mut self) -> Result<(), (Op, io::Error)> {
        let current = fs::metadata(&self.path).ok().map(|m| (m.dev(), m.ino()));
        let stale = match &self.file {
            Some((_, id)) => current != Some(*id),
            None => true,
        };
        if stale {
            if let Some((mut old, _)) = self.file.take() {
                // What was buffered goes to the file it was meant for.
                let _ = old.flush();
            }
            self.open().map_err(|e| (Op::Open, e))?;
        }
        Ok(())
    }

    /// Appends `line` (a whole line, newline included), rotating first
    /// if it would take the file past its size.
    pub(crate) fn write_line(&mut self, line: &[u8]) -> Result<(), (Op, io::Error)> {
        if self.file.is_none() {
            self.open().map_err(|e| (Op::Open, e))?;
        }
        let len = line.len() as u64;
        if self.written > 0 && self.written + len > self.rotation.max_bytes {
            self.rotate()?;
        }
        let Some((file, _)) = self.file.as_mut() else {
            return Err((Op::Open, io::Error::other("no file")));
        };
        match file.write_all(line) {
            Ok(()) => {
                self.written += len;
                Ok(())
            }
            Err(e) => {
                // Reopened for the next line.
                self.file = None;
                Err((Op::Write, e))
            }
        }
    }

    /// Flushes what is buffered.
    pub(crate) fn flush(&mut self) -> Result<(), (Op, io::Error)> {
        let Some((file, _)) = self.file.as_mut() else {
            return Ok(());
        };
        file.flush().map_err(|e| {
            self.file = None;
            (Op::Write, e)
        })
    }

    /// Renames the file to a backup, starts a new one, removes the old
    /// backups. A failed rename is an error and the file goes on growing;
    /// a failed removal is an error after the new file is open.
    fn rotate(&mut self) -> Result<(), (Op, io::Error)> {
        self.flush()?;
        self.file = None;
        let backup = self.backup_path();
        fs::rename(&self.path, &backup).map_err(|e| (Op::Rotate, e))?;
        self.open().map_err(|e| (Op::Open, e))?;
        self.prune().map_err(|e| (Op::Rotate, e))
    }

    /// The next backup's name: the time now to the millisecond, or a
    /// millisecond past the last backup's (or past a file already there)
    /// if the clock has not moved on, so that no backup is overwritten and
    /// the names sort by age.
    fn backup_path(&mut self) -> PathBuf {
        let millis = |at: OffsetDateTime| at.unix_timestamp_nanos() / 1_000_000;
        let mut at = OffsetDateTime::now_utc();
        at = at.replace_millisecond(at.millisecond()).unwrap_or(at);
        if let Some(last) = self.last_backup.filter(|last| millis(at) <= millis(*last)) {
            at = last + Duration::from_millis(1);
        }
        let (stem, ext) = self.stem_ext();
        let format = format_description!(
            "[year]-[month]-[day]T[hour]-[minute]-[second].[subsecond digits:3]"
        );
        loop {
            let stamp = at.format(&format).unwrap_or_default();
            let path = self.path.with_file_name(format!("{stem}-{stamp}{ext}"));
            if !path.exists() {
                self.last_backup = Some(at);
                return path;
            }
            at += Duration::from_millis(1);
        }
    }

    /// The file name's stem and its extension (with the dot), as
    /// lumberjack splits them.
    fn stem_ext(&self) -> (String, String) {
        let name = self
            .path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        match name.rfind('.') {
            Some(dot) if dot > 0 => (name[..dot].to_owned(), name[dot..].to_owned()),
            _ => (name, String::new()),
        }
    }

    /// This file's backups, oldest first (their names sort by time).
    pub(crate) fn backups(&self) -> io::Result<Vec<PathBuf>> {
        let (stem, ext) = self.stem_ext();
        let prefix = format!("{stem}-");
        let dir = match self.path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let mut found: Vec<PathBuf> = fs::read_dir(&dir)?
            .filter_map(Result::ok)
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| is_backup(n, &prefix, &ext))
            .map(|n| dir.join(n))
            .collect();
        found.sort();
        Ok(found)
    }

    /// Removes backups past the count and the age.
    fn prune(&self) -> io::Result<()> {
        let backups = self.backups()?;
        let keep = self.rotation.max_backups;
        let excess = if keep == 0 {
            0
        } else {
            backups.len().saturating_sub(keep)
        };
        let mut result = Ok(());
        for (i, backup) in backups.iter().enumerate() {
            if (i < excess || self.too_old(backup))
                && let Err(e) = fs::remove_file(backup)
            {
                result = Err(e);
            }
        }
        result
    }

    fn too_old(&self, backup: &Path) -> bool {
        let Some(max_age) = self.rotation.max_age else {
            return false;
        };
        fs::metadata(backup)
            .and_then(|m| m.modified())
            .ok()
            .and_then(|at| SystemTime::now().duration_since(at).ok())
            .is_some_and(|age| age > max_age)
    }
}

/// Whether `name` is `<prefix><time as backup_path writes it><ext>`.
fn is_backup(name: &str, prefix: &str, ext: &str) -> bool {
    let Some(stamp) = name
        .strip_prefix(prefix)
        .and_then(|rest| rest.strip_suffix(ext))
    else {
        return false;
    };
    // 2025-01-02T03-04-05.123
    stamp.len() == 23
        && stamp.bytes().enumerate().all(|(i, b)| match i {
            4 | 7 | 13 | 16 => b == b'-',
            10 => b == b'T',
            19 => b == b'.',
            _ => b.is_ascii_digit(),
        })
}
