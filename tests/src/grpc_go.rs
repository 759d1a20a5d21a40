//! Runs `tests/go/frontend`, a frontend on grpc-go (kube-apiserver's gRPC
//! client, Debian's build) that shares no code with ours, and reads the one
//! JSON line it reports. `scripts/test` builds it into `target/go-frontend`
//! from Debian's packages in GOPATH mode.

use std::{
    io::{BufRead, BufReader},
    path::PathBuf,
    process::{Child, ChildStdin, Command, ExitStatus, Stdio},
    time::Duration,
};

use serde_json::Value;

pub use crate::report::FrontendReport;
use crate::{
    Pki, TestServer,
    report::{self, SuccessSignal},
    workspace,
};

/// How long one run may take in all.
pub const RUN_LIMIT: Duration = Duration::from_secs(60);

/// The built frontend; panics naming how to build it.
pub fn binary() -> PathBuf {
    let path = workspace().join("target/go-frontend");
    assert!(
        path.exists(),
        "no grpc-go frontend at {}: run scripts/test, which installs golang-go, \
         golang-google-grpc-dev and golang-google-protobuf-dev and builds tests/go/frontend",
        path.display()
    );
    path
}

/// How the frontend reaches the server.
pub fn transport_args(server: &TestServer, tcp: bool) -> Vec<String> {
    if tcp {
        let pki = Pki::get();
        let addr = server.frontend_tcp.expect("a TCP frontend");
        vec![
            format!("-tcp={addr}"),
            format!("-ca={}", pki.path("frontend-ca.crt").display()),
            format!("-cert={}", pki.path("proxy-client.crt").display()),
            format!("-key={}", pki.path("proxy-client.key").display()),
            "-server-name=localhost".to_owned(),
        ]
    } else {
        vec![format!("-uds={}", server.uds.display())]
    }
}

/// Runs the frontend with `args` to its end and returns its report.
///
/// # Panics
/// If the binary is missing or the run exceeds [`RUN_LIMIT`].
pub async fn run(args: Vec<String>) -> FrontendReport {
    report::run(
        command(&args),
        "the grpc-go frontend",
        RUN_LIMIT,
        SuccessSignal::ExitStatus,
    )
    .await
}

fn command(args: &[String]) -> Command {
    let mut command = Command::new(binary());
    command
        .args(args)
        .env_remove("GRPC_PROXY")
        .env_remove("grpc_proxy")
        .env_remove("HTTPS_PROXY")
        .env_remove("https_proxy");
    command
}

/// A frontend left running (the `stall` mode), killed on drop; closing
/// its stdin ends it.
pub struct Running {
    /// The child, until [`finish`](Self::finish) takes it.
    child: Option<Child>,
    /// Its stdin.
    stdin: Option<ChildStdin>,
}

impl Running {
    /// Starts the frontend with `args` and waits for its first JSON line
    /// (the mode's "ready").
    pub async fn start(args: Vec<String>) -> (Self, Value) {
        let mut child = command(&args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("starting the grpc-go frontend: {e}"));
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().expect("piped stdout");
        let line = tokio::task::spawn_blocking(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            line
        });
        let line = tokio::time::timeout(RUN_LIMIT, line)
            .await
            .unwrap_or_else(|_| panic!("no line from the grpc-go frontend ({args:?})"))
            .expect("the reading task");
        let json = serde_json::from_str(line.trim())
            .unwrap_or_else(|_| panic!("the grpc-go frontend ({args:?}) said {line:?}"));
        (
            Self {
                child: Some(child),
                stdin,
            },
            json,
        )
    }

    /// Closes its stdin and waits for it to exit.
    pub async fn finish(mut self) -> ExitStatus {
        self.stdin = None;
        let mut child = self.child.take().expect("not finished yet");
        tokio::task::spawn_blocking(move || child.wait())
            .await
            .expect("the waiting task")
            .expect("waiting for the grpc-go frontend")
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(child) = &mut self.child {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
