//! A frontend we did not write (grpcio's `frontend.py`, grpc-go's
//! `go-frontend`) run as a child to its end, and the JSON line it reports.

use std::{
    io::Read,
    process::{Child, Command, ExitStatus, Stdio},
    sync::{Arc, Mutex},
    time::Duration,
};

use serde_json::Value;

/// How a frontend says how a run went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SuccessSignal {
    /// A JSON line with `"ok": true` (and exit 0); a run that prints no
    /// JSON line at all is a broken harness, and panics.
    OkField,
    /// Exit 0; the last line is JSON when the run got that far.
    ExitStatus,
}

/// What one run reported.
#[derive(Debug)]
pub struct FrontendReport {
    /// The JSON line; `Null` if none came ([`SuccessSignal::ExitStatus`]).
    pub json: Value,
    /// The exit status.
    pub status: ExitStatus,
    /// Everything written to standard error.
    pub stderr: String,
    /// The program, for messages.
    who: &'static str,
    /// How it says it passed.
    verdict: SuccessSignal,
}

impl FrontendReport {
    /// Whether the run passed.
    pub fn ok(&self) -> bool {
        self.status.success()
            && (self.verdict == SuccessSignal::ExitStatus || self.json["ok"] == Value::Bool(true))
    }

    /// Panics with the whole report unless the run passed.
    pub fn assert_ok(&self) -> &Self {
        assert!(self.ok(), "{} failed: {self}", self.who);
        self
    }

    /// A string field.
    pub fn str(&self, key: &str) -> &str {
        self.json[key]
            .as_str()
            .unwrap_or_else(|| panic!("no string {key:?} in {self}"))
    }

    /// An integer field.
    pub fn int(&self, key: &str) -> u64 {
        self.json[key]
            .as_u64()
            .unwrap_or_else(|| panic!("no integer {key:?} in {self}"))
    }
}

impl std::fmt::Display for FrontendReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.json, self.status)?;
        if !self.stderr.is_empty() {
            write!(f, "\nstderr:\n{}", self.stderr)?;
        }
        Ok(())
    }
}

/// The child, killed and reaped when dropped (a failed or timed-out test
/// leaves nothing behind).
struct KillOnDrop(Arc<Mutex<Child>>);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let mut child = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// Runs `command` (`who` in messages) to its end within `limit` and returns
/// its report. Both output pipes are read at once, and the reading and
/// waiting run off the test's runtime thread, which an in-process server
/// needs.
///
/// # Panics
/// If it cannot start, runs past `limit`, or (with [`SuccessSignal::OkField`])
/// prints no JSON line.
pub async fn run(
    command: Command,
    who: &'static str,
    limit: Duration,
    verdict: SuccessSignal,
) -> FrontendReport {
    Started::new(command, who, Stdio::null())
        .finish(limit, verdict)
        .await
}

/// A child started with its output pipes being read, until
/// [`Started::finish`]: with its standard input piped, it can wait for the
/// test to close it (a frontend that holds its streams open while the test
/// looks at the server).
pub struct Started {
    /// The child.
    child: Arc<Mutex<Child>>,
    /// Its standard input, if piped; closed by [`Started::finish`].
    stdin: Option<std::process::ChildStdin>,
    /// Reads its standard output to the end.
    stdout: tokio::task::JoinHandle<String>,
    /// Reads its standard error to the end.
    stderr: tokio::task::JoinHandle<String>,
    /// Kills it if the test ends first.
    guard: KillOnDrop,
    /// The program, for messages.
    who: &'static str,
}

impl Started {
    /// Starts `command` with its standard input piped; see
    /// [`Started::finish`].
    ///
    /// # Panics
    /// If it cannot start.
    pub fn with_stdin(command: Command, who: &'static str) -> Self {
        Self::new(command, who, Stdio::piped())
    }

    fn new(mut command: Command, who: &'static str, stdin: Stdio) -> Self {
        let mut child = command
            .stdin(stdin)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("starting {who}: {e}"));
        let stdin = child.stdin.take();
        let mut stdout = child.stdout.take().expect("piped stdout");
        let mut stderr = child.stderr.take().expect("piped stderr");
        let stdout = tokio::task::spawn_blocking(move || {
            let mut s = String::new();
            let _ = stdout.read_to_string(&mut s);
            s
        });
        let stderr = tokio::task::spawn_blocking(move || {
            let mut s = String::new();
            let _ = stderr.read_to_string(&mut s);
            s
        });
        let child = Arc::new(Mutex::new(child));
        Self {
            guard: KillOnDrop(child.clone()),
            child,
            stdin,
            stdout,
            stderr,
            who,
        }
    }

    /// Writes `line` to its standard input (a signal it waits for).
    ///
    /// # Panics
    /// If its standard input is not piped or it is gone.
    pub fn send_line(&mut self, line: &str) {
        use std::io::Write;
        let stdin = self.stdin.as_mut().expect("a piped standard input");
        writeln!(stdin, "{line}")
            .and_then(|()| stdin.flush())
            .unwrap_or_else(|e| panic!("writing to {}: {e}", self.who));
    }

    /// Closes its standard input and waits, within `limit`, for its end;
    /// its report.
    ///
    /// # Panics
    /// If it runs past `limit`, or (with [`SuccessSignal::OkField`]) prints no
    /// JSON line.
    pub async fn finish(mut self, limit: Duration, verdict: SuccessSignal) -> FrontendReport {
        drop(self.stdin.take());
        let who = self.who;
        let child = self.child.clone();
        let finished = async move {
            let (out, err) = (self.stdout.await, self.stderr.await);
            // Both pipes are at EOF: the process has exited (or closed them).
            let status =
                tokio::task::spawn_blocking(move || child.lock().expect("child lock").wait()).await;
            (
                out.expect("stdout reader"),
                err.expect("stderr reader"),
                status
                    .expect("waiter")
                    .unwrap_or_else(|e| panic!("waiting for {who}: {e}")),
            )
        };
        let (stdout, stderr, status) = tokio::time::timeout(limit, finished)
            .await
            .unwrap_or_else(|_| panic!("{who} ran longer than {limit:?}"));
        drop(self.guard);
        let json = match verdict {
            SuccessSignal::OkField => stdout
                .lines()
                .rev()
                .find_map(|line| serde_json::from_str::<Value>(line).ok())
                .unwrap_or_else(|| {
                    panic!("{who} printed no JSON ({status}); stdout:\n{stdout}\nstderr:\n{stderr}")
                }),
            SuccessSignal::ExitStatus => stdout
                .lines()
                .last()
                .and_then(|line| serde_json::from_str(line).ok())
                .unwrap_or(Value::Null),
        };
        FrontendReport {
            json,
            status,
            stderr,
            who,
            verdict,
        }
    }
}
