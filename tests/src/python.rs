//! Runs `tests/python/frontend.py`, a frontend on Python's grpcio (gRPC
//! C-core) and standard library that shares no code with ours, and reads the
//! one JSON line it reports.
//!
//! The interpreter is `$KONNECTIVITY_PYTHON`, else the virtualenv that
//! `scripts/test` makes in `target/interop-venv` from
//! `tests/python/requirements.txt`.

use std::{path::PathBuf, process::Command, time::Duration};

pub use crate::report::FrontendReport;
use crate::{
    report::{self, SuccessSignal},
    workspace,
};

/// How long one run of the script may take in all (each of its own waits is
/// bounded by `--timeout`, [`WAIT`]).
pub const RUN_LIMIT: Duration = Duration::from_secs(90);

/// The script's `--timeout`: how long any one of its waits, or one Proxy
/// stream in all, may take.
pub const WAIT: Duration = Duration::from_secs(20);

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

/// `frontend.py <args>` started with its standard input piped, for a case
/// that holds its streams open until the test closes it
/// ([`report::Started::finish`] with [`RUN_LIMIT`] and
/// [`SuccessSignal::OkField`]: see [`HeldFrontend::finish`]).
pub fn start_frontend<I, S>(args: I) -> HeldFrontend
where
    I: IntoIterator<Item = S>,
    S: AsRef<std::ffi::OsStr>,
{
    HeldFrontend(report::Started::with_stdin(command(args), "frontend.py"))
}

/// A `frontend.py` run that waits for the test (see [`start_frontend`]).
pub struct HeldFrontend(report::Started);

impl HeldFrontend {
    /// Tells it to go on to its next step (a line on its standard input).
    pub fn signal(&mut self, step: &str) {
        self.0.send_line(step);
    }

    /// Lets it finish (closes its standard input) and returns its report.
    pub async fn finish(self) -> FrontendReport {
        self.0.finish(RUN_LIMIT, SuccessSignal::OkField).await
    }
}

/// Runs `frontend.py <args>` and returns its report. Reading and waiting run
/// off the test's runtime thread, which the in-process server needs.
///
/// # Panics
/// If the interpreter is missing, the run exceeds [`RUN_LIMIT`], or no JSON
/// line comes out.
pub async fn frontend<I, S>(args: I) -> FrontendReport
where
    I: IntoIterator<Item = S>,
    S: AsRef<std::ffi::OsStr>,
{
    report::run(
        command(args),
        "frontend.py",
        RUN_LIMIT,
        SuccessSignal::OkField,
    )
    .await
}

/// The command line of `frontend.py <args>`.
fn command<I, S>(args: I) -> Command
where
    I: IntoIterator<Item = S>,
    S: AsRef<std::ffi::OsStr>,
{
    let script = workspace().join("tests/python/frontend.py");
    let mut command = Command::new(interpreter());
    command
        .arg(&script)
        .args(args)
        .arg(format!("--timeout={}", WAIT.as_secs()))
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env_remove("http_proxy")
        .env_remove("https_proxy")
        .env_remove("grpc_proxy")
        .env_remove("HTTP_PROXY")
        .env_remove("HTTPS_PROXY");
    command
}
