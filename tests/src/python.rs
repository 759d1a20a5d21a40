//! Runs `tests/python/frontend.py`, a frontend on Python's grpcio (gRPC
//! C-core) and standard library that shares no code with ours, and reads the
//! one JSON line it reports.
//!
//! The interpreter is `$KONNECTIVITY_PYTHON`, else the virtualenv that
//! `scripts/test` makes in `target/interop-venv` from
//! `tests/python/requirements.txt`.

use std::{
    io::Read,
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Stdio},
    sync::{Arc, Mutex},
    time::Duration,
};

use serde_json::Value;

/// How long one run of the script may take in all (each of its own waits is
/// bounded by `--timeout`, [`WAIT`]).
pub const RUN_LIMIT: Duration = Duration::from_secs(90);

/// The script's `--timeout`: how long any one of its waits, or one Proxy
/// stream in all, may take.
pub const WAIT: Duration = Duration::from_secs(20);

/// The workspace root.
fn workspace() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the tests crate sits in the workspace")
}

/// The interpreter that has grpcio; panics naming how to make it.
pub fn interpreter() -> PathBuf {
    let path = std::env::var_os("KONNECTIVITY_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace().join("target/interop-venv/bin/python"));
    assert!(
        path.exists(),
        "no Python interpreter at {}: run scripts/test, which creates target/interop-venv \
         from tests/python/requirements.txt (or point KONNECTIVITY_PYTHON at a python with them)",
        path.display()
    );
    path
}

/// A console script installed beside [`interpreter`] (from
/// `tests/python/requirements.txt`); panics naming how to get it.
pub fn script(name: &str) -> PathBuf {
    let path = interpreter().with_file_name(name);
    assert!(
        path.exists(),
        "no {} beside the test interpreter: run scripts/test, which installs \
         tests/python/requirements.txt into target/interop-venv",
        path.display()
    );
    path
}

/// What one run reported.
#[derive(Debug)]
pub struct Report {
    /// The JSON line (`{"case": .., "ok": .., ..}`).
    pub json: Value,
    /// The exit status.
    pub status: ExitStatus,
    /// Everything written to standard error.
    pub stderr: String,
}

impl Report {
    /// Whether the case passed (exit 0 and `"ok": true`).
    pub fn ok(&self) -> bool {
        self.status.success() && self.json["ok"] == Value::Bool(true)
    }

    /// Panics with the whole report unless the case passed.
    pub fn assert_ok(&self) -> &Self {
        assert!(self.ok(), "frontend.py failed: {self}");
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

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.json, self.status)?;
        if !self.stderr.is_empty() {
            write!(f, "\nstderr:\n{}", self.stderr)?;
        }
        Ok(())
    }
}

/// The child, killed and reaped when dropped (a failed or timed-out test
/// leaves no Python behind).
struct KillOnDrop(Arc<Mutex<Child>>);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let mut child = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// Runs `frontend.py <args>` and returns its report. Reading and waiting run
/// off the test's runtime thread, which the in-process server needs.
///
/// # Panics
/// If the interpreter is missing, the run exceeds [`RUN_LIMIT`], or no JSON
/// line comes out.
pub async fn frontend<I, S>(args: I) -> Report
where
    I: IntoIterator<Item = S>,
    S: AsRef<std::ffi::OsStr>,
{
    let script = workspace().join("tests/python/frontend.py");
    let mut child = Command::new(interpreter())
        .arg(&script)
        .args(args)
        .arg(format!("--timeout={}", WAIT.as_secs()))
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env_remove("http_proxy")
        .env_remove("https_proxy")
        .env_remove("grpc_proxy")
        .env_remove("HTTP_PROXY")
        .env_remove("HTTPS_PROXY")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("starting {}: {e}", script.display()));
    let mut stdout = child.stdout.take().expect("piped stdout");
    let mut stderr = child.stderr.take().expect("piped stderr");
    let child = Arc::new(Mutex::new(child));
    let guard = KillOnDrop(child.clone());
    let run = async move {
        let out = tokio::task::spawn_blocking(move || {
            let mut s = String::new();
            let _ = stdout.read_to_string(&mut s);
            s
        });
        let err = tokio::task::spawn_blocking(move || {
            let mut s = String::new();
            let _ = stderr.read_to_string(&mut s);
            s
        });
        let (out, err) = (out.await, err.await);
        // Both pipes are at EOF: the process has exited (or closed them).
        let status =
            tokio::task::spawn_blocking(move || child.lock().expect("child lock").wait()).await;
        (
            out.expect("stdout reader"),
            err.expect("stderr reader"),
            status.expect("waiter").expect("waiting for python"),
        )
    };
    let (stdout, stderr, status) = tokio::time::timeout(RUN_LIMIT, run)
        .await
        .unwrap_or_else(|_| panic!("frontend.py ran longer than {RUN_LIMIT:?}"));
    drop(guard);
    let json = stdout
        .lines()
        .rev()
        .find_map(|line| serde_json::from_str::<Value>(line).ok())
        .unwrap_or_else(|| {
            panic!("frontend.py printed no JSON ({status}); stdout:\n{stdout}\nstderr:\n{stderr}")
        });
    Report {
        json,
        status,
        stderr,
    }
}
