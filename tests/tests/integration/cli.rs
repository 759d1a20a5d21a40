//! The real binaries: flag errors exit 2 naming the flag before any socket
//! is bound, flag warnings logged before binding, env fallbacks, the
//! frontend socket's mode, `--version`.

#![allow(clippy::unwrap_used)] // tests: a panic is a failure report

use std::{
    os::unix::fs::PermissionsExt,
    process::{Command, Stdio},
    time::Duration,
};

use integration_tests::{LoggedProcess, Pki, TestServer, binary, http_get, wait_for};

fn run(name: &str, args: &[String]) -> (i32, String) {
    let out = Command::new(binary(name))
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("running the binary");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn pki_arg(flag: &str, file: &str) -> String {
    format!("--{flag}={}", Pki::get().path(file).display())
}

#[test]
fn bad_server_flags_exit_2_naming_the_flag_before_binding() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("s.sock");
    let cases: Vec<(Vec<String>, &str)> = vec![
        (vec!["--agent-port=abc".to_owned()], "--agent-port"),
        (vec!["--keepalive-time=10".to_owned()], "--keepalive-time"),
        // A bool takes its value after `=` only; ANP would read `true`
        // and ignore the stray word, we refuse it.
        (
            vec!["--enable-profiling".to_owned(), "false".to_owned()],
            "unexpected argument 'false'",
        ),
        (
            vec![
                format!("--uds-name={}", socket.display()),
                "--server-port=8090".to_owned(),
                pki_arg("cluster-cert", "cluster.crt"),
                pki_arg("cluster-key", "cluster.key"),
                pki_arg("cluster-ca-cert", "agent-ca.crt"),
            ],
            "--server-port",
        ),
        (
            vec![
                format!("--uds-name={}", socket.display()),
                "--server-port=0".to_owned(),
                "--cluster-cert=/nonexistent/cluster.crt".to_owned(),
                pki_arg("cluster-key", "cluster.key"),
                pki_arg("cluster-ca-cert", "agent-ca.crt"),
            ],
            "/nonexistent/cluster.crt",
        ),
        (
            vec!["--agent-max-concurrent-streams=0".to_owned()],
            "--agent-max-concurrent-streams",
        ),
        (
            vec![
                format!("--uds-name={}", socket.display()),
                "--server-port=0".to_owned(),
                pki_arg("cluster-cert", "cluster.crt"),
                pki_arg("cluster-key", "cluster.key"),
                pki_arg("cluster-ca-cert", "agent-ca.crt"),
                "--tls-session-ticket-rotation=169h".to_owned(),
            ],
            "--tls-session-ticket-rotation",
        ),
        (
            vec![
                format!("--uds-name={}", socket.display()),
                "--server-port=0".to_owned(),
                pki_arg("cluster-cert", "cluster.crt"),
                pki_arg("cluster-key", "cluster.key"),
                pki_arg("cluster-ca-cert", "agent-ca.crt"),
                "--backend-dial-retries=9".to_owned(),
            ],
            "--backend-dial-retries: 9 is more than 8",
        ),
    ];
    for (args, needle) in cases {
        let (code, stderr) = run("proxy-server", &args);
        assert_eq!(code, 2, "{args:?}: {stderr}");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
        assert!(!socket.exists(), "a socket was bound despite a bad flag");
    }
}

#[test]
fn bad_agent_flags_exit_2_naming_the_flag() {
    for (args, needle) in [
        (vec!["--sync-interval=5".to_owned()], "--sync-interval"),
        (
            vec!["--sync-forever".to_owned(), "false".to_owned()],
            "unexpected argument 'false'",
        ),
        (vec![], "--ca-cert"),
        (
            vec![
                pki_arg("ca-cert", "agent-ca.crt"),
                "--agent-identifiers=zone=a".to_owned(),
            ],
            "--agent-identifiers",
        ),
        (
            vec![
                pki_arg("ca-cert", "agent-ca.crt"),
                "--stderrthreshold=LOUD".to_owned(),
            ],
            "--stderrthreshold",
        ),
    ] {
        let (code, stderr) = run("proxy-agent", &args);
        assert_eq!(code, 2, "{args:?}: {stderr}");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
    }
}

#[test]
fn both_binaries_print_their_version() {
    for name in ["proxy-server", "proxy-agent"] {
        let out = Command::new(binary(name))
            .arg("--version")
            .output()
            .unwrap();
        assert!(out.status.success());
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            text.contains(name) && text.contains(env!("CARGO_PKG_VERSION")),
            "{text}"
        );
    }
}

/// Kills the child on drop.
struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test]
async fn the_agent_id_comes_from_proxy_agent_id() {
    let server = TestServer::start().await;
    let _agent = Child(
        Command::new(binary("proxy-agent"))
            .env("PROXY_AGENT_ID", "from-the-environment")
            .env_remove("HTTPS_PROXY")
            .env_remove("https_proxy")
            .env_remove("ALL_PROXY")
            .env_remove("all_proxy")
            .args([
                pki_arg("ca-cert", "agent-ca.crt"),
                pki_arg("agent-cert", "proxy-agent.crt"),
                pki_arg("agent-key", "proxy-agent.key"),
                format!("--proxy-server-port={}", server.agent_addr.port()),
                "--health-server-port=0".to_owned(),
                "--admin-server-port=0".to_owned(),
                "--sync-interval=100ms".to_owned(),
            ])
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    server.wait_for_backends(1).await;
    assert_eq!(server.handle.agent_ids(), ["from-the-environment"]);
}

#[tokio::test]
async fn the_server_serves_its_socket_with_mode_0770_and_its_id_from_proxy_server_id() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("konnectivity-server.socket");
    std::fs::write(&socket, "stale").unwrap();
    let health = free_port();
    let agent_port = free_port();
    let _server = Child(
        Command::new(binary("proxy-server"))
            .env("PROXY_SERVER_ID", "server-from-env")
            .args([
                format!("--uds-name={}", socket.display()),
                "--server-port=0".to_owned(),
                pki_arg("cluster-cert", "cluster.crt"),
                pki_arg("cluster-key", "cluster.key"),
                pki_arg("cluster-ca-cert", "agent-ca.crt"),
                "--agent-bind-address=127.0.0.1".to_owned(),
                format!("--agent-port={agent_port}"),
                "--health-bind-address=127.0.0.1".to_owned(),
                format!("--health-port={health}"),
                "--admin-port=0".to_owned(),
            ])
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let health_addr = format!("127.0.0.1:{health}").parse().unwrap();
    wait_for("the server's health port", || {
        std::net::TcpStream::connect_timeout(&health_addr, Duration::from_millis(100)).is_ok()
    })
    .await;
    assert_eq!(http_get(health_addr, "/healthz").await.0, 200);
    let mode = std::fs::metadata(&socket).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o770, "mode {mode:o}");
    assert!(
        std::fs::metadata(&socket)
            .unwrap()
            .file_type()
            .is_socket_like()
    );

    let config = integration_tests::agent_config(
        format!("127.0.0.1:{agent_port}").parse().unwrap(),
        &Default::default(),
    );
    let client = proxy_agent::client::Client::connect(
        &config,
        config.tls.load().unwrap(),
        &config.servers[0],
        std::sync::Arc::new(proxy_agent::metrics::AgentMetrics::unattached()),
    )
    .await
    .unwrap();
    assert_eq!(client.server_id.0, "server-from-env");
    assert_eq!(client.server_count, 1);
}

/// A port that was free a moment ago (for the binaries, which take ports by flag).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

trait SocketLike {
    fn is_socket_like(&self) -> bool;
}

impl SocketLike for std::fs::FileType {
    fn is_socket_like(&self) -> bool {
        use std::os::unix::fs::FileTypeExt;
        self.is_socket()
    }
}

/// An agent port that authenticates no one (no `--cluster-ca-cert`, no
/// token auth) is refused at start-up: exit 2 before anything is bound,
/// naming the flags that would authenticate agents and the one that allows
/// none. With `--allow-unauthenticated-agents` the server starts, and says
/// at `warn` that anyone can register as an agent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unauthenticated_agent_port_needs_allow_unauthenticated_agents() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("s.sock");
    let args = vec![
        format!("--uds-name={}", socket.display()),
        "--server-port=0".to_owned(),
        pki_arg("cluster-cert", "cluster.crt"),
        pki_arg("cluster-key", "cluster.key"),
        "--agent-bind-address=127.0.0.1".to_owned(),
        "--agent-port=0".to_owned(),
        "--health-bind-address=127.0.0.1".to_owned(),
        "--health-port=0".to_owned(),
        "--admin-port=0".to_owned(),
    ];
    let (code, stderr) = run("proxy-server", &args);
    assert_eq!(code, 2, "{stderr}");
    for flag in [
        "--cluster-ca-cert",
        "--agent-namespace",
        "--allow-unauthenticated-agents",
    ] {
        assert!(stderr.contains(flag), "{flag} not named: {stderr}");
    }
    assert!(!socket.exists(), "a socket was bound despite the refusal");

    let mut command = Command::new(binary("proxy-server"));
    command.args(&args).arg("--allow-unauthenticated-agents");
    let mut server = LoggedProcess::spawn(command, "proxy-server");
    server
        .wait_for("frontend listening", 1, Duration::from_secs(30))
        .await;
    let line = server
        .find("the agent port authenticates no one")
        .expect("no warning");
    assert!(line.contains("WARN"), "{line}");
    assert!(line.contains("--allow-unauthenticated-agents"), "{line}");
}

/// What inotify saw happen to the entry `name` of the directory `watch`
/// watches, in order (`watch` is non-blocking: what is queued now).
fn entry_events(watch: &impl std::os::fd::AsFd, name: &str) -> Vec<rustix::fs::inotify::ReadFlags> {
    let mut buf = [std::mem::MaybeUninit::<u8>::uninit(); 4096];
    let mut reader = rustix::fs::inotify::Reader::new(watch, &mut buf);
    let mut seen = Vec::new();
    loop {
        match reader.next() {
            Ok(event) => {
                if event
                    .file_name()
                    .is_some_and(|n| n.to_bytes() == name.as_bytes())
                {
                    seen.push(event.events());
                }
            }
            Err(rustix::io::Errno::AGAIN) => return seen,
            Err(e) => panic!("reading inotify events: {e}"),
        }
    }
}

/// The frontend socket is never at its path with a mode wider than 0770,
/// even under umask 0 (where a socket is bound 0777): it is bound and
/// given its mode in a private directory, then moved (or, with
/// `--delete-existing-uds-file=false`, linked) into place. Watched with
/// inotify, its name appears once, as a socket that is already 0770, and
/// its attributes never change at that path: a chmod after binding there
/// (the old way) shows as IN_ATTRIB on a socket that was there 0777 until
/// then. Nothing is left beside it; with `false`, a file in the way is an
/// error naming the path, and the file stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_socket_is_never_at_its_path_with_a_wider_mode() {
    use rustix::fs::inotify::{self, ReadFlags, WatchFlags};
    const NAME: &str = "konnectivity-server.socket";
    for delete_existing in [true, false] {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join(NAME);
        if delete_existing {
            std::fs::write(&socket, "stale").unwrap();
        }
        let watch =
            inotify::init(inotify::CreateFlags::NONBLOCK | inotify::CreateFlags::CLOEXEC).unwrap();
        inotify::add_watch(
            &watch,
            dir.path(),
            WatchFlags::CREATE | WatchFlags::ATTRIB | WatchFlags::MOVED_TO | WatchFlags::DELETE,
        )
        .unwrap();
        let args = vec![
            format!("--uds-name={}", socket.display()),
            format!("--delete-existing-uds-file={delete_existing}"),
            "--server-port=0".to_owned(),
            pki_arg("cluster-cert", "cluster.crt"),
            pki_arg("cluster-key", "cluster.key"),
            pki_arg("cluster-ca-cert", "agent-ca.crt"),
            "--agent-bind-address=127.0.0.1".to_owned(),
            "--agent-port=0".to_owned(),
            "--health-bind-address=127.0.0.1".to_owned(),
            "--health-port=0".to_owned(),
            "--admin-port=0".to_owned(),
        ];
        let mut command = Command::new("sh");
        command
            .arg("-c")
            .arg(r#"umask 0 && exec "$0" "$@""#)
            .arg(binary("proxy-server"))
            .args(&args);
        let mut server = LoggedProcess::spawn(command, "proxy-server");
        server
            .wait_for("frontend listening", 1, Duration::from_secs(30))
            .await;
        let events = entry_events(&watch, NAME);
        let meta = std::fs::symlink_metadata(&socket).unwrap();
        assert!(meta.file_type().is_socket_like());
        assert_eq!(meta.permissions().mode() & 0o7777, 0o770);
        assert!(
            !events.iter().any(|e| e.contains(ReadFlags::ATTRIB)),
            "the socket's mode changed at its path (delete_existing={delete_existing}): {events:?}"
        );
        let appeared = if delete_existing {
            ReadFlags::MOVED_TO
        } else {
            ReadFlags::CREATE
        };
        assert_eq!(
            events
                .iter()
                .filter(|e| !e.contains(ReadFlags::DELETE))
                .collect::<Vec<_>>(),
            [&appeared],
            "delete_existing={delete_existing}"
        );
        let entries: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(entries, [NAME], "the private directory is left");
        drop(server);

        if !delete_existing {
            // A file in the way: the bind fails, naming the path.
            let stale = dir.path().join("stale.socket");
            std::fs::write(&stale, "stale").unwrap();
            let mut args = args.clone();
            args[0] = format!("--uds-name={}", stale.display());
            let (code, stderr) = run("proxy-server", &args);
            assert_ne!(code, 0, "{stderr}");
            assert!(
                stderr.contains(&format!("unix socket {}", stale.display())),
                "{stderr}"
            );
            assert_eq!(std::fs::read(&stale).unwrap(), b"stale");
            let left = std::fs::read_dir(dir.path())
                .unwrap()
                .filter(|e| {
                    e.as_ref()
                        .unwrap()
                        .file_name()
                        .to_string_lossy()
                        .starts_with(".k")
                })
                .count();
            assert_eq!(left, 0, "the private directory is left after a failure");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flags_without_effect_are_named_at_start_up() {
    let dir = tempfile::tempdir().unwrap();
    let mut command = Command::new(binary("proxy-server"));
    command.args([
        format!("--uds-name={}", dir.path().join("s.sock").display()),
        "--server-port=0".to_owned(),
        "--agent-bind-address=127.0.0.1".to_owned(),
        "--agent-port=0".to_owned(),
        "--health-port=0".to_owned(),
        "--admin-port=0".to_owned(),
        pki_arg("cluster-cert", "cluster.crt"),
        pki_arg("cluster-key", "cluster.key"),
        pki_arg("cluster-ca-cert", "agent-ca.crt"),
        "--enable-profiling".to_owned(),
        "--enable-contention-profiling".to_owned(),
        "--log-dir=/var/log/konnectivity".to_owned(),
        "--vmodule=server=5".to_owned(),
    ]);
    let mut server = integration_tests::LoggedProcess::spawn(command, "proxy-server");
    server
        .wait_for("not implemented", 1, Duration::from_secs(30))
        .await;
    let line = server.find("not implemented").unwrap();
    for flag in ["enable-contention-profiling", "log-dir", "vmodule"] {
        assert!(line.contains(flag), "{flag} not named: {line}");
    }
    assert!(
        !line.contains("\"enable-profiling\""),
        "profiling is implemented: {line}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_file_json_format_and_verbosity_are_honoured() {
    let server = TestServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    for (verbosity, debug_expected) in [(4, false), (9, true)] {
        let file = dir.path().join(format!("agent-v{verbosity}.log"));
        let mut command = Command::new(binary("proxy-agent"));
        command.args([
            format!("-v={verbosity}"),
            "--logtostderr=false".to_owned(),
            format!("--log-file={}", file.display()),
            "--log-format=json".to_owned(),
            pki_arg("ca-cert", "agent-ca.crt"),
            pki_arg("agent-cert", "proxy-agent.crt"),
            pki_arg("agent-key", "proxy-agent.key"),
            "--proxy-server-host=127.0.0.1".to_owned(),
            format!("--proxy-server-port={}", server.agent_addr.port()),
            "--health-server-port=0".to_owned(),
            "--admin-server-port=0".to_owned(),
        ]);
        let agent = integration_tests::LoggedProcess::spawn(command, "proxy-agent");
        let handle = server.handle.clone();
        wait_for("the agent to connect", || handle.backend_count() == 1).await;
        let logged = || std::fs::read_to_string(&file).unwrap_or_default();
        wait_for("the connect to be logged", || {
            logged().contains("connected to proxy-server")
        })
        .await;
        drop(agent);
        wait_for("the agent to go", || handle.backend_count() == 0).await;

        let mut levels = std::collections::BTreeSet::new();
        for line in logged().lines() {
            let record: serde_json::Value =
                serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
            levels.insert(record["level"].as_str().unwrap().to_owned());
            assert!(record["fields"].is_object(), "{line}");
        }
        let verbose = levels.contains("DEBUG") || levels.contains("TRACE");
        assert_eq!(verbose, debug_expected, "-v={verbosity}: levels {levels:?}");
        assert!(levels.contains("INFO"), "{levels:?}");
    }
}

/// How long a real agent may take to log what a test waits for.
const LOG_LIMIT: Duration = Duration::from_secs(30);

/// A real agent against `port` on loopback with the test PKI, `flags` and
/// `RUST_LOG` (`None`: unset).
fn logging_agent(port: u16, flags: &[String], rust_log: Option<&str>) -> LoggedProcess {
    let mut command = Command::new(binary("proxy-agent"));
    command.args([
        pki_arg("ca-cert", "agent-ca.crt"),
        pki_arg("agent-cert", "proxy-agent.crt"),
        pki_arg("agent-key", "proxy-agent.key"),
        "--proxy-server-host=127.0.0.1".to_owned(),
        format!("--proxy-server-port={port}"),
        "--health-server-host=127.0.0.1".to_owned(),
        "--health-server-port=0".to_owned(),
        "--admin-server-port=0".to_owned(),
        "--sync-interval=100ms".to_owned(),
        "--sync-interval-cap=200ms".to_owned(),
    ]);
    command.args(flags);
    if let Some(filter) = rust_log {
        command.env("RUST_LOG", filter);
    }
    LoggedProcess::spawn(command, "proxy-agent")
}

/// The level of a text log line (`<time> <LEVEL> <target>: …`).
fn level(line: &str) -> &str {
    line.split_whitespace().nth(1).unwrap_or_default()
}

/// Waits until `file` holds `needle` `n` times; returns its text.
async fn wait_in_file(file: &std::path::Path, needle: &str, n: usize) -> String {
    let mut text = String::new();
    wait_for(&format!("{needle:?} in {}", file.display()), || {
        text = std::fs::read_to_string(file).unwrap_or_default();
        text.matches(needle).count() >= n
    })
    .await;
    text
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rust_log_overrides_v_unless_it_is_empty_or_invalid() {
    let server = TestServer::start().await;
    let closed = integration_tests::destination::closed_port().port();

    // RUST_LOG=trace beats -v=0.
    let mut traced = logging_agent(
        server.agent_addr.port(),
        &["-v=0".to_owned()],
        Some("trace"),
    );
    traced.wait_for(" TRACE ", 1, LOG_LIMIT).await;
    // RUST_LOG=warn beats -v=9: warnings and nothing below.
    let mut quiet = logging_agent(closed, &["-v=9".to_owned()], Some("warn"));
    quiet
        .wait_for("cannot connect to proxy-server", 2, LOG_LIMIT)
        .await;
    for line in quiet.lines() {
        assert!(matches!(level(&line), "WARN" | "ERROR"), "{line}");
    }
    // An empty RUST_LOG is no RUST_LOG: the -v level, not errors only.
    let mut empty = logging_agent(closed, &["-v=4".to_owned()], Some(""));
    empty.wait_for("proxy-agent starting", 1, LOG_LIMIT).await;
    // An invalid one is named in a warning and the -v level applies.
    let mut invalid = logging_agent(closed, &["-v=4".to_owned()], Some("tunnel=loud"));
    invalid.wait_for("RUST_LOG is invalid", 1, LOG_LIMIT).await;
    let warning = invalid.find("RUST_LOG is invalid").unwrap();
    assert!(
        level(&warning) == "WARN" && warning.contains("rust_log=tunnel=loud"),
        "{warning}"
    );
    invalid.wait_for("proxy-agent starting", 1, LOG_LIMIT).await;
    assert!(invalid.lines().iter().all(|l| level(l) != "DEBUG"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_log_file_gets_every_line_and_standard_error_the_errors() {
    let dir = tempfile::tempdir().unwrap();
    let closed = integration_tests::destination::closed_port().port();

    // An agent that fails at once: its ERROR is in the file and on stderr.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let failed_log = dir.path().join("failed.log");
    let out = Command::new(binary("proxy-agent"))
        .env_remove("RUST_LOG")
        .args([
            pki_arg("ca-cert", "agent-ca.crt"),
            "--logtostderr=false".to_owned(),
            format!("--log-file={}", failed_log.display()),
            "--health-server-host=127.0.0.1".to_owned(),
            format!(
                "--health-server-port={}",
                taken.local_addr().unwrap().port()
            ),
            "--admin-server-port=0".to_owned(),
        ])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr
            .lines()
            .any(|l| level(l) == "ERROR" && l.contains("proxy-agent failed")),
        "{stderr}"
    );
    let file = std::fs::read_to_string(&failed_log).unwrap();
    assert!(file.contains("proxy-agent failed"), "{file}");

    // A running agent that cannot connect: INFO and WARN go to the file
    // only (ERROR is the default threshold). The largest max size is fine.
    let quiet_log = dir.path().join("quiet.log");
    let quiet = logging_agent(
        closed,
        &[
            "--logtostderr=false".to_owned(),
            format!("--log-file={}", quiet_log.display()),
            format!("--log-file-max-size={}", u64::MAX),
        ],
        None,
    );
    let text = wait_in_file(&quiet_log, "cannot connect to proxy-server", 2).await;
    assert!(text.contains("proxy-agent starting"), "{text}");
    assert!(quiet.lines().is_empty(), "{:#?}", quiet.lines());

    // --stderrthreshold=WARNING: warnings reach stderr too, INFO does not.
    let warned_log = dir.path().join("warned.log");
    let mut warned = logging_agent(
        closed,
        &[
            "--logtostderr=false".to_owned(),
            format!("--log-file={}", warned_log.display()),
            "--stderrthreshold=WARNING".to_owned(),
        ],
        None,
    );
    warned
        .wait_for("cannot connect to proxy-server", 2, LOG_LIMIT)
        .await;
    assert!(
        warned.lines().iter().all(|l| level(l) == "WARN"),
        "{:#?}",
        warned.lines()
    );
    let text = wait_in_file(&warned_log, "proxy-agent starting", 1).await;
    assert!(text.contains("cannot connect to proxy-server"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_flags_without_effect_together_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let closed = integration_tests::destination::closed_port().port();
    // --log-file while --logtostderr is true (its default): ignored, said so.
    let ignored_log = dir.path().join("ignored.log");
    let mut ignored = logging_agent(
        closed,
        &[format!("--log-file={}", ignored_log.display())],
        None,
    );
    ignored
        .wait_for("--log-file is ignored", 1, LOG_LIMIT)
        .await;
    let line = ignored.find("--log-file is ignored").unwrap();
    assert!(
        level(&line) == "WARN" && line.contains(&ignored_log.display().to_string()),
        "{line}"
    );
    ignored.wait_for("proxy-agent starting", 1, LOG_LIMIT).await;
    assert!(!ignored_log.exists());
    // --logtostderr=false with no file: standard error, said so.
    let mut nowhere = logging_agent(closed, &["--logtostderr=false".to_owned()], None);
    nowhere
        .wait_for("--logtostderr=false without --log-file", 1, LOG_LIMIT)
        .await;
    nowhere.wait_for("proxy-agent starting", 1, LOG_LIMIT).await;
}

/// Runs a binary to its exit with `RUST_LOG` removed (so the default level
/// decides what is logged); returns its exit code and standard error.
fn run_logged(name: &str, args: &[String]) -> (i32, String) {
    let out = Command::new(binary(name))
        .args(args)
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .output()
        .expect("running the binary");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The line of `log` that contains `needle`, or a panic showing the log.
fn line_with<'a>(log: &'a str, needle: &str) -> &'a str {
    log.lines()
        .find(|l| l.contains(needle))
        .unwrap_or_else(|| panic!("{needle:?} not logged:\n{log}"))
}

/// The flag warnings come before anything is bound: a taken port makes
/// the agent fail at start-up, and the warnings are in its log anyway.
#[test]
fn the_agent_names_flags_without_effect_and_deprecated_ones_even_when_start_up_fails() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let (code, log) = run_logged(
        "proxy-agent",
        &[
            pki_arg("ca-cert", "agent-ca.crt"),
            pki_arg("agent-cert", "proxy-agent.crt"),
            pki_arg("agent-key", "proxy-agent.key"),
            "--health-server-host=127.0.0.1".to_owned(),
            format!(
                "--health-server-port={}",
                taken.local_addr().unwrap().port()
            ),
            "--admin-server-port=0".to_owned(),
            "--xfr-channel-size=150".to_owned(),
            "--kube-api-content-type=application/vnd.kubernetes.protobuf".to_owned(),
            "--lease-label=k8s-app=konnectivity-server".to_owned(),
        ],
    );
    assert_eq!(code, 1, "the health port is taken: {log}");
    let line = line_with(&log, "flags accepted but not implemented");
    for flag in ["xfr-channel-size", "kube-api-content-type"] {
        assert!(line.contains(flag), "{flag} not named: {line}");
    }
    let line = line_with(&log, "deprecated flag given");
    assert!(line.contains("--lease-label"), "{line}");
    assert!(line.contains("WARN"), "{line}");
}

/// The same for the server, with its CBC cipher-suite warning.
#[test]
fn the_server_names_flags_without_effect_and_deprecated_ones_even_when_start_up_fails() {
    let dir = tempfile::tempdir().unwrap();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let (code, log) = run_logged(
        "proxy-server",
        &[
            format!("--uds-name={}", dir.path().join("s.sock").display()),
            "--server-port=0".to_owned(),
            pki_arg("cluster-cert", "cluster.crt"),
            pki_arg("cluster-key", "cluster.key"),
            pki_arg("cluster-ca-cert", "agent-ca.crt"),
            "--agent-bind-address=127.0.0.1".to_owned(),
            format!("--agent-port={}", taken.local_addr().unwrap().port()),
            "--health-port=0".to_owned(),
            "--admin-port=0".to_owned(),
            "--kube-api-content-type=application/vnd.kubernetes.protobuf".to_owned(),
            "--warn-on-channel-limit=false".to_owned(),
            "--cipher-suites=TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA".to_owned(),
            "--cipher-suites=TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256".to_owned(),
        ],
    );
    assert_eq!(code, 1, "the agent port is taken: {log}");
    assert!(
        line_with(&log, "flags accepted but not implemented").contains("kube-api-content-type"),
        "{log}"
    );
    assert!(
        line_with(&log, "deprecated flag given").contains("--warn-on-channel-limit"),
        "{log}"
    );
    assert!(
        line_with(&log, "CBC suites left out").contains("TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA"),
        "{log}"
    );
}

/// pflag reads `--flag false` as `--flag` (true) plus a stray `false`,
/// which ANP ignores; clap refuses the stray word instead, for every
/// boolean flag of both binaries, so the mistake cannot pass unnoticed.
#[test]
fn bool_flags_take_their_value_only_after_equals() {
    fn check<A: clap::Parser>(bin: &str) {
        let command = A::command();
        let bools: Vec<&str> = command
            .get_arguments()
            .filter(|arg| arg.is_require_equals_set())
            .filter_map(|arg| arg.get_long())
            .collect();
        assert!(bools.len() >= 10, "{bin}: {bools:?}");
        for flag in bools {
            let err = A::try_parse_from([bin, &format!("--{flag}"), "false"])
                .err()
                .unwrap_or_else(|| panic!("{bin} --{flag} false was accepted"));
            assert_eq!(
                err.kind(),
                clap::error::ErrorKind::UnknownArgument,
                "{bin} --{flag}"
            );
            A::try_parse_from([bin, &format!("--{flag}=false")])
                .unwrap_or_else(|e| panic!("{bin} --{flag}=false: {e}"));
        }
    }
    check::<proxy_server::config::Args>("proxy-server");
    check::<proxy_agent::config::Args>("proxy-agent");
}

/// Threads of process `pid` named as tokio's workers.
fn worker_threads(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|tasks| {
            tasks
                .filter_map(Result::ok)
                .filter(|task| {
                    std::fs::read_to_string(task.path().join("comm"))
                        .is_ok_and(|comm| comm.trim() == "tokio-rt-worker")
                })
                .count()
        })
        .unwrap_or(0)
}

#[tokio::test]
async fn worker_threads_sizes_the_runtime_of_both_binaries() {
    // One more than the CPUs: only the flag gives that many.
    let n = std::thread::available_parallelism().map_or(1, usize::from) + 1;
    let server = integration_tests::process::ServerProcess::start(
        "grpc",
        &[format!("--worker-threads={n}")],
    )
    .await;
    assert_eq!(worker_threads(server.pid()), n);
    let agent =
        integration_tests::AgentProcess::spawn(server.agent_addr.port(), &["--worker-threads=1"]);
    server.wait_for_agents(1).await;
    assert_eq!(worker_threads(agent.pid()), 1);
}

/// The soft open-file limit of `pid`, from `/proc/<pid>/limits`.
fn soft_open_files(pid: u32) -> u64 {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .unwrap();
    line.split_whitespace().nth(3).unwrap().parse().unwrap()
}

/// Both binaries raise their soft open-file limit to the hard limit at
/// start-up, as Go's runtime does for ANP's (a server holds a socket per
/// agent, thousands of them, and a container's soft limit may be 1,024).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_binaries_raise_their_open_file_limit_to_the_hard_limit() {
    let (_, hard) = rlimit::Resource::NOFILE.get().unwrap();
    assert!(hard > 512, "the hard limit is {hard}: nothing to raise");
    // Each binary starts under a shell that lowers the soft limit for it
    // alone (this process's limit is shared with the tests cargo test runs
    // beside this one).
    let dir = tempfile::tempdir().unwrap();
    let lowered = |name: &str| {
        let path = dir.path().join(name);
        let script = format!(
            "#!/bin/sh\nulimit -Sn 512 || exit 1\nexec {} \"$@\"\n",
            binary(name).display()
        );
        std::fs::write(&path, script).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        path
    };
    let server = integration_tests::process::ServerProcess::start_binary(
        &lowered("proxy-server"),
        Pki::get().dir.path(),
        "grpc",
        &[],
    )
    .await;
    let agent = integration_tests::AgentProcess::spawn_binary(
        &lowered("proxy-agent"),
        server.agent_addr.port(),
        &[],
    );
    server.wait_for_agents(1).await;
    assert_eq!(soft_open_files(server.pid()), hard, "proxy-server");
    assert_eq!(soft_open_files(agent.pid()), hard, "proxy-agent");
}
