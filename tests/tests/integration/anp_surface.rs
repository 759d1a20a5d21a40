//! ANP's flags and metrics, as pinned in `tests/fixtures/anp/` (the ANP
//! commit and PRs are named in each file's header): a manifest that sets
//! every flag ANP's newest server and agent accept (their options and the
//! klog flags) starts both real binaries, which then serve; and after a
//! scenario that touches each metric, every ANP metric name is in their
//! `/metrics`.

#![allow(clippy::unwrap_used)] // tests: a panic is a failure report

use std::{
    collections::{BTreeMap, BTreeSet},
    net::SocketAddr,
    path::PathBuf,
    process::Command,
    time::Duration,
};

use integration_tests::{
    AgentProcess, Binary, DEADLINE, LoggedProcess, Pki, destination, http_get,
    kube_stub::{Identity, TokenReviewStub, service_account_token},
    lease_stub::LeaseStub,
    process::metric_value,
    wait_for, workspace,
};
use k8s_openapi::{
    api::coordination::v1::{Lease, LeaseSpec},
    apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta},
    jiff::{SignedDuration, Timestamp},
};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::UnixStream,
};

/// The ANP commit the fixtures are read from.
const ANP_COMMIT: &str = "4f8517c137a11752b68f57a990497bfa4d3f122f";

/// The names in `tests/fixtures/anp/<file>`: every line that is neither
/// blank nor a `#` comment, trimmed, in order.
fn fixture(file: &str) -> Vec<String> {
    let path = workspace().join("tests/fixtures/anp").join(file);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    text.lines()
        .map(str::trim)
        .filter(|line| !line.is_empty() && !line.starts_with('#'))
        .map(str::to_owned)
        .collect()
}

/// Every flag ANP's `binary` accepts: its options and the klog flags.
fn anp_flags(binary: Binary) -> Vec<String> {
    let own = match binary {
        Binary::Server => "server-flags.txt",
        Binary::Agent => "agent-flags.txt",
    };
    let mut flags = fixture(own);
    flags.extend(fixture("klog-flags.txt"));
    flags
}

#[test]
fn the_fixtures_are_read_whole() {
    for (file, name_ok) in [
        ("server-flags.txt", flag_name as fn(&str) -> bool),
        ("agent-flags.txt", flag_name),
        ("klog-flags.txt", flag_name),
        ("server-metrics.txt", |n: &str| {
            metric_name(n, "konnectivity_network_proxy_server_")
        }),
        ("agent-metrics.txt", |n: &str| {
            metric_name(n, "konnectivity_network_proxy_agent_")
        }),
    ] {
        let path = workspace().join("tests/fixtures/anp").join(file);
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.ends_with('\n'), "{file}: no final newline");
        assert!(text.contains(ANP_COMMIT), "{file}: the pin is not named");
        let names = fixture(file);
        assert!(!names.is_empty(), "{file} is empty");
        // Every line is a comment, blank or a name: nothing is skipped, and
        // the last line read is the file's last.
        let content: Vec<&str> = text
            .lines()
            .filter(|l| !l.trim().is_empty() && !l.trim_start().starts_with('#'))
            .collect();
        assert_eq!(content.len(), names.len(), "{file}");
        assert_eq!(
            names.last().map(String::as_str),
            text.lines().rev().find(|l| !l.trim().is_empty()),
            "{file}: not read to its end"
        );
        for name in &names {
            assert!(name_ok(name), "{file}: {name:?} is not a name");
        }
        let unique: BTreeSet<&String> = names.iter().collect();
        assert_eq!(unique.len(), names.len(), "{file} has duplicates");
    }
    // The server's and the agent's option names never clash with klog's.
    let klog: BTreeSet<String> = fixture("klog-flags.txt").into_iter().collect();
    for own in ["server-flags.txt", "agent-flags.txt"] {
        for flag in fixture(own) {
            assert!(!klog.contains(&flag), "{own}: {flag} is also klog's");
        }
    }
}

/// A flag name without its dashes, as pflag spells them.
fn flag_name(name: &str) -> bool {
    name.starts_with(|c: char| c.is_ascii_lowercase())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
}

/// A metric name of ANP's subsystem `prefix`.
fn metric_name(name: &str, prefix: &str) -> bool {
    name.strip_prefix(prefix).is_some_and(|rest| {
        !rest.is_empty() && rest.chars().all(|c| c.is_ascii_lowercase() || c == '_')
    })
}

/// Each binary's clap command knows every ANP flag by its long name (`v`
/// also as `-v`), hidden ones included: the quick form of the manifest test
/// below, naming every missing flag at once.
#[test]
fn both_binaries_know_every_anp_flag_by_name() {
    for binary in [Binary::Server, Binary::Agent] {
        let command = binary.command();
        let missing: Vec<String> = anp_flags(binary)
            .into_iter()
            .filter(|flag| {
                !command.get_arguments().any(|arg| {
                    arg.get_long() == Some(flag.as_str())
                        || arg
                            .get_all_aliases()
                            .is_some_and(|aliases| aliases.contains(&flag.as_str()))
                })
            })
            .collect();
        assert!(missing.is_empty(), "{} lacks {missing:?}", binary.name());
        let short_v = command
            .get_arguments()
            .any(|arg| arg.get_short() == Some('v'));
        assert!(short_v, "{}: no -v", binary.name());
    }
}

/// Two manifests, each setting every flag to a valid value: the flags that
/// exclude one another (a Unix socket or TCP certificates for frontends,
/// client certificates or tokens for agents) are set in one and empty in
/// the other.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Layout {
    /// HTTP-CONNECT on a Unix socket; agent mTLS; lease controller and
    /// lease counting on.
    UdsCertificates,
    /// gRPC on TCP (mTLS); agent tokens (TokenReview); leases off.
    TcpTokens,
}

/// What the manifests point at: files, and the kube API stand-ins.
struct Files {
    /// Holds the socket, the token and the log files.
    dir: tempfile::TempDir,
    /// The test PKI's files.
    pki: PathBuf,
    /// The Lease API stand-in ([`Layout::UdsCertificates`]).
    leases: Option<LeaseStub>,
    /// The TokenReview stand-in ([`Layout::TcpTokens`]).
    reviews: Option<TokenReviewStub>,
}

const NAMESPACE: &str = "kube-system";
const LABEL: &str = "k8s-app=konnectivity-server";
const SERVER_ID: &str = "anp-flags";
/// The agent's token (a JWT with this `jti`), and whose it is for the
/// TokenReview stand-in.
const TOKEN: &str = "anp-flags-agent-token";
const AGENT_SA: &str = "konnectivity-agent";
const AUDIENCE: &str = "system:konnectivity-server";

impl Files {
    async fn new(layout: Layout) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let token = service_account_token(AUDIENCE, TOKEN);
        std::fs::write(dir.path().join("token"), &token).unwrap();
        let (leases, reviews) = match layout {
            Layout::UdsCertificates => {
                let stub = LeaseStub::start().await;
                // An expired lease for the garbage collection to cull.
                stub.put(expired_lease("konnectivity-proxy-server-gone"));
                (Some(stub), None)
            }
            Layout::TcpTokens => {
                let stub = TokenReviewStub::start().await;
                stub.allow(
                    &token,
                    Identity {
                        username: format!("system:serviceaccount:{NAMESPACE}:{AGENT_SA}"),
                        audiences: vec![AUDIENCE.to_owned()],
                        node: None,
                    },
                );
                (None, Some(stub))
            }
        };
        Self {
            dir,
            pki: Pki::get().dir.path().to_owned(),
            leases,
            reviews,
        }
    }

    fn pki(&self, name: &str) -> String {
        self.pki.join(name).display().to_string()
    }

    fn path(&self, name: &str) -> String {
        self.dir.path().join(name).display().to_string()
    }

    fn kubeconfig(&self) -> String {
        let path = match (&self.leases, &self.reviews) {
            (Some(stub), _) => &stub.kubeconfig,
            (None, Some(stub)) => &stub.kubeconfig,
            (None, None) => unreachable!("every layout has a kube API"),
        };
        path.display().to_string()
    }

    fn socket(&self) -> PathBuf {
        self.dir.path().join("konnectivity-server.socket")
    }
}

/// A lease of our labels that expired long ago.
fn expired_lease(name: &str) -> Lease {
    let renewed = MicroTime(
        Timestamp::now()
            .checked_sub(SignedDuration::from_secs(120))
            .unwrap(),
    );
    Lease {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            namespace: Some(NAMESPACE.to_owned()),
            labels: Some(BTreeMap::from([(
                "k8s-app".to_owned(),
                "konnectivity-server".to_owned(),
            )])),
            ..ObjectMeta::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some(name.to_owned()),
            lease_duration_seconds: Some(30),
            acquire_time: Some(renewed.clone()),
            renew_time: Some(renewed),
            ..LeaseSpec::default()
        }),
    }
}

/// The klog flags as a manifest would set them, for `binary`'s log file.
fn klog_values(files: &Files, binary: Binary) -> Vec<(&'static str, String)> {
    vec![
        ("log-dir", files.path("logs")),
        ("log-file", files.path(&format!("{}.log", binary.name()))),
        ("log-file-max-size", "100".to_owned()),
        ("logtostderr", "true".to_owned()),
        ("alsologtostderr", "false".to_owned()),
        ("legacy-stderr-threshold-behavior", "true".to_owned()),
        ("v", "4".to_owned()),
        ("add-dir-header", "false".to_owned()),
        ("skip-headers", "false".to_owned()),
        ("one-output", "false".to_owned()),
        ("skip-log-headers", "false".to_owned()),
        ("stderrthreshold", "ERROR".to_owned()),
        ("alsologtostderrthreshold", "INFO".to_owned()),
        ("vmodule", "server=5".to_owned()),
        ("log-backtrace-at", ":0".to_owned()),
    ]
}

/// Every server flag with a value for `layout`; ports are ephemeral on
/// loopback.
fn server_manifest(layout: Layout, files: &Files) -> Vec<(&'static str, String)> {
    let uds = layout == Layout::UdsCertificates;
    let pick = |a: String, b: String| if uds { a } else { b };
    let s = str::to_owned;
    let mut flags = vec![
        ("server-cert", pick(s(""), files.pki("proxy-frontend.crt"))),
        ("server-key", pick(s(""), files.pki("proxy-frontend.key"))),
        ("server-ca-cert", pick(s(""), files.pki("frontend-ca.crt"))),
        ("cluster-cert", files.pki("cluster.crt")),
        ("cluster-key", files.pki("cluster.key")),
        ("cluster-ca-cert", pick(files.pki("agent-ca.crt"), s(""))),
        ("mode", pick(s("http-connect"), s("grpc"))),
        (
            "uds-name",
            pick(files.socket().display().to_string(), s("")),
        ),
        ("delete-existing-uds-file", s("true")),
        ("server-port", s("0")),
        ("server-bind-address", s("127.0.0.1")),
        ("agent-port", s("0")),
        ("agent-bind-address", s("127.0.0.1")),
        ("admin-port", s("0")),
        ("admin-bind-address", s("127.0.0.1")),
        ("health-port", s("0")),
        ("health-bind-address", s("127.0.0.1")),
        ("keepalive-time", s("1h0m0s")),
        ("frontend-keepalive-time", s("30m0s")),
        ("enable-profiling", s("true")),
        ("enable-contention-profiling", s("true")),
        ("server-id", s(SERVER_ID)),
        ("server-count", s("1")),
        ("agent-namespace", pick(s(""), s(NAMESPACE))),
        ("agent-service-account", pick(s(""), s(AGENT_SA))),
        ("kubeconfig", files.kubeconfig()),
        ("kubeconfig-qps", s("5")),
        ("kubeconfig-burst", s("10")),
        (
            "kube-api-content-type",
            s("application/vnd.kubernetes.protobuf"),
        ),
        ("authentication-audience", pick(s(""), s(AUDIENCE))),
        ("proxy-strategies", s("destHost,default")),
        (
            "cipher-suites",
            s("TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256,TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256"),
        ),
        ("tls-min-version", s("VersionTLS12")),
        ("xfr-channel-size", s("10")),
        ("frontend-write-channel-size", pick(s("10"), s("0"))),
        ("enable-lease-controller", pick(s("true"), s("false"))),
        ("lease-namespace", s(NAMESPACE)),
        ("lease-label", s(LABEL)),
        ("graceful-shutdown-timeout", s("15s")),
        ("backend-dial-timeout", s("10s")),
        ("warn-on-channel-limit", s("true")),
    ];
    flags.extend(klog_values(files, Binary::Server));
    flags
}

/// Every agent flag with a value for `layout`, against `agent_port`.
fn agent_manifest(layout: Layout, files: &Files, agent_port: u16) -> Vec<(&'static str, String)> {
    let uds = layout == Layout::UdsCertificates;
    let pick = |a: String, b: String| if uds { a } else { b };
    let s = str::to_owned;
    let mut flags = vec![
        ("agent-cert", files.pki("proxy-agent.crt")),
        ("agent-key", files.pki("proxy-agent.key")),
        ("ca-cert", files.pki("agent-ca.crt")),
        ("proxy-server-host", s("127.0.0.1")),
        ("proxy-server-port", agent_port.to_string()),
        ("alpn-proto", s("konnectivity")),
        ("health-server-host", s("127.0.0.1")),
        ("health-server-port", s("0")),
        ("admin-server-port", s("0")),
        ("admin-bind-address", s("127.0.0.1")),
        ("enable-profiling", s("true")),
        ("enable-contention-profiling", s("true")),
        ("agent-id", s("anp-flags-agent")),
        ("sync-interval", s("100ms")),
        ("probe-interval", s("100ms")),
        ("sync-interval-cap", s("1s")),
        ("keepalive-time", s("1h0m0s")),
        (
            "service-account-token-path",
            pick(s(""), files.path("token")),
        ),
        (
            "agent-identifiers",
            s("host=localhost&ipv4=127.0.0.1&default-route=true"),
        ),
        ("warn-on-channel-limit", s("false")),
        ("sync-forever", s("true")),
        ("xfr-channel-size", s("150")),
        ("count-server-leases", pick(s("true"), s("false"))),
        ("lease-namespace", s(NAMESPACE)),
        ("lease-label-selector", s(LABEL)),
        ("lease-label", s(LABEL)),
        ("server-count-source", pick(s("default"), s("max"))),
        ("kubeconfig", files.kubeconfig()),
        (
            "kube-api-content-type",
            s("application/vnd.kubernetes.protobuf"),
        ),
    ];
    flags.extend(klog_values(files, Binary::Agent));
    flags
}

/// `--flag=value` for each flag, after checking that the manifest sets
/// exactly the flags of ANP's `binary`: a flag added to a fixture without
/// a value here fails, as does one given twice.
fn argv(binary: Binary, manifest: &[(&'static str, String)]) -> Vec<String> {
    let given: Vec<&str> = manifest.iter().map(|(flag, _)| *flag).collect();
    let set: BTreeSet<&str> = given.iter().copied().collect();
    assert_eq!(set.len(), given.len(), "a flag is given twice: {given:?}");
    let anp = anp_flags(binary);
    let anp: BTreeSet<&str> = anp.iter().map(String::as_str).collect();
    assert_eq!(
        set,
        anp,
        "{}: the manifest differs from ANP's flags",
        binary.name()
    );
    manifest
        .iter()
        .map(|(flag, value)| format!("--{flag}={value}"))
        .collect()
}

/// A real binary started from a manifest, with the address of its health
/// port (from its log).
struct Started {
    process: LoggedProcess,
    health: SocketAddr,
}

impl Started {
    async fn scrape(&self) -> String {
        let (status, text) = http_get(self.health, "/metrics").await;
        assert_eq!(status, 200, "/metrics: {text}");
        text
    }

    /// Polls `/metrics` until `done` holds for it; panics with the last
    /// text and the end of the log after `limit`.
    async fn wait_for_metrics(&self, what: &str, limit: Duration, done: impl Fn(&str) -> bool) {
        let start = std::time::Instant::now();
        loop {
            let text = self.scrape().await;
            if done(&text) {
                return;
            }
            if start.elapsed() >= limit {
                let lines = self.process.lines();
                let tail = &lines[lines.len().saturating_sub(40)..];
                panic!("waiting for {what}:\n{text}\nlog: {tail:#?}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn wait_ready(&self) {
        let start = std::time::Instant::now();
        loop {
            let (status, text) = http_get(self.health, "/readyz").await;
            if status == 200 {
                return;
            }
            assert!(
                start.elapsed() < DEADLINE * 3,
                "/readyz answers {status} {text}; log: {:#?}",
                self.process.lines()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Starts `binary` with `args` (and `extra`, flags of ours); returns once
/// it logged its health address, with its agent port for the server.
async fn start(binary: Binary, args: &[String], extra: &[&str]) -> (Started, Option<u16>) {
    let mut command = Command::new(integration_tests::binary(binary.name()));
    command.args(args).args(extra);
    let mut process = LoggedProcess::spawn(command, binary.name());
    let agent_port = match binary {
        Binary::Server => Some(process.logged_port("agent.addr=Some(127.0.0.1:").await),
        Binary::Agent => None,
    };
    let health = process.logged_port("health.addr=Some(127.0.0.1:").await;
    let health = SocketAddr::from(([127, 0, 0, 1], health));
    (Started { process, health }, agent_port)
}

/// Starts the server and the agent of `layout` from manifests with every
/// ANP flag, `extra_agent` flags of ours added, and waits until the agent
/// is connected and both are ready; also returns the server's agent port.
async fn start_pair(
    layout: Layout,
    files: &Files,
    extra_agent: &[&str],
) -> (Started, Started, u16) {
    let (server, agent_port) = start(
        Binary::Server,
        &argv(Binary::Server, &server_manifest(layout, files)),
        &[],
    )
    .await;
    if let Some(stub) = &files.leases {
        // A lease-counting agent counts the server once its lease is there.
        let own = format!("konnectivity-proxy-server-{SERVER_ID}");
        wait_for("the server's lease", || {
            stub.leases(NAMESPACE)
                .iter()
                .any(|l| l.metadata.name.as_deref() == Some(&own))
        })
        .await;
    }
    let agent_port = agent_port.unwrap();
    let agent_args = argv(Binary::Agent, &agent_manifest(layout, files, agent_port));
    let (agent, _) = start(Binary::Agent, &agent_args, extra_agent).await;
    server
        .wait_for_metrics("the agent's stream", DEADLINE * 3, |text| {
            metric_value(text, CONNECT_STREAMS) == 1.0
        })
        .await;
    server.wait_ready().await;
    agent.wait_ready().await;
    (server, agent, agent_port)
}

/// ANP #896's gauges: HTTP-CONNECT connections with a full buffer, and
/// agent stream readers waiting on one.
const WRITE_QUEUES: [&str; 2] = [
    "konnectivity_network_proxy_server_full_frontend_write_queues",
    "konnectivity_network_proxy_server_blocked_frontend_write_channels",
];

const CONNECT_STREAMS: &str =
    "konnectivity_network_proxy_server_grpc_connections{service_method=\"Connect\"}";

/// Agents (by agent id) the server's `default` strategy holds.
const DEFAULT_BACKENDS: &str =
    "konnectivity_network_proxy_server_ready_backends{proxy_strategy=\"default\"}";

/// The agent's series that its server's death adds: a failed receive.
const KILL_FAILURES: [&str; 2] = [
    "konnectivity_network_proxy_agent_server_connection_failure_count{direction=\"from_server\"}",
    "konnectivity_network_proxy_agent_stream_errors_total{code=\"Unavailable\",packet_type=\"Unknown\",segment=\"to_agent\"}",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_manifest_with_every_anp_flag_starts_both_binaries() {
    for layout in [Layout::UdsCertificates, Layout::TcpTokens] {
        let files = Files::new(layout).await;
        let (server, agent, _) = start_pair(layout, &files, &[]).await;
        // The flags without effect here, ours included, are named.
        let warned = server
            .process
            .find("frontend-write-channel-size")
            .unwrap_or_else(|| panic!("{layout:?}: not named: {:#?}", server.process.lines()));
        assert!(warned.contains("no effect"), "{warned}");
        for process in [&server.process, &agent.process] {
            assert!(
                process.find("flags accepted but not implemented").is_some(),
                "{layout:?}: {:#?}",
                process.lines()
            );
        }
        if let Some(stub) = &files.reviews {
            assert!(
                stub.review_count() >= 1,
                "{layout:?}: the agent's token was not reviewed"
            );
        }
    }
}

/// The HTTP-CONNECT client `address` through the server's socket.
async fn connect(files: &Files, address: &str) -> Result<UnixStream, client::dial::ClientError> {
    let socket = UnixStream::connect(files.socket()).await.unwrap();
    client::dial::http_connect(socket, address).await
}

/// Whether `text` exposes the metric `name` (its `# TYPE` line: a family
/// is exposed only with a series).
fn exposes(text: &str, name: &str) -> bool {
    text.contains(&format!("\n# TYPE {name} ")) || text.starts_with(&format!("# TYPE {name} "))
}

fn missing(text: &str, names: &[String]) -> Vec<String> {
    names
        .iter()
        .filter(|n| !exposes(text, n))
        .cloned()
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_binaries_export_every_anp_metric() {
    let files = Files::new(Layout::UdsCertificates).await;
    // Without flow control (as an ANP agent), so that a client that does
    // not read holds up the agent's stream, as in ANP.
    let (mut server, agent, agent_port) =
        start_pair(Layout::UdsCertificates, &files, &["--flow-control=false"]).await;

    // A good dial, bytes both ways, closed.
    let echo = destination::echo().await;
    let mut conn = connect(&files, &echo.address()).await.unwrap();
    conn.write_all(b"hello").await.unwrap();
    let mut got = [0u8; 5];
    conn.read_exact(&mut got).await.unwrap();
    assert_eq!(&got, b"hello");
    drop(conn);
    // A dial the agent cannot make.
    let closed = destination::closed_port();
    assert!(connect(&files, &closed.to_string()).await.is_err());
    // A client that stops reading a download: its buffer fills and the
    // agent stream's reader waits for room.
    let source = destination::source().await;
    let stalled = connect(&files, &source.address()).await.unwrap();
    server
        .wait_for_metrics(
            "a reader blocked on a full CONNECT buffer",
            DEADLINE * 3,
            |text| {
                WRITE_QUEUES
                    .iter()
                    .all(|name| metric_value(text, name) == 1.0)
            },
        )
        .await;
    drop(stalled);
    server
        .wait_for_metrics("the reader to go on", DEADLINE * 3, |text| {
            WRITE_QUEUES
                .iter()
                .all(|name| exposes(text, name) && metric_value(text, name) == 0.0)
        })
        .await;
    // An agent stream that breaks: a second agent, killed once the server
    // has its stream. Its own agent id tells it from the first agent's
    // `--sync-forever` connections, which come and go all the time (they
    // count in `grpc_connections` from the start of the call, and waiting
    // for that to read 2 once killed the second agent before it connected).
    let mut second = AgentProcess::spawn(agent_port, &["--agent-id=anp-flags-second-agent"]);
    server
        .wait_for_metrics("the second agent's stream", DEADLINE * 3, |text| {
            metric_value(text, DEFAULT_BACKENDS) == 2.0
        })
        .await;
    second.kill();
    server
        .wait_for_metrics("a stream error", DEADLINE * 3, |text| {
            exposes(
                text,
                "konnectivity_network_proxy_server_stream_errors_total",
            )
        })
        .await;

    let names = fixture("server-metrics.txt");
    let text = server.scrape().await;
    assert!(
        missing(&text, &names).is_empty(),
        "server lacks {:?}:\n{text}",
        missing(&text, &names)
    );

    // The agent's view of a server that dies: every other metric first
    // (the lease watch's come in their own time), then the failed receive
    // that the kill causes, counted as ANP's agent counts it (grpc-go's
    // `Recv` fails with `Unavailable`), whichever way the agent learns of
    // it (the stream's error or the connection probe).
    let names = fixture("agent-metrics.txt");
    let (by_kill, before): (Vec<String>, Vec<String>) = names.into_iter().partition(|name| {
        KILL_FAILURES
            .iter()
            .any(|series| series.starts_with(&format!("{name}{{")))
    });
    assert_eq!(by_kill.len(), KILL_FAILURES.len(), "{by_kill:?}");
    agent
        .wait_for_metrics(
            "the agent's metrics but its failures",
            DEADLINE * 3,
            |text| missing(text, &before).is_empty(),
        )
        .await;
    server.process.signal("KILL");
    agent
        .wait_for_metrics(
            "the failed receive of a killed server",
            DEADLINE * 3,
            |text| {
                KILL_FAILURES
                    .iter()
                    .all(|series| metric_value(text, series) >= 1.0)
            },
        )
        .await;
    let _ = server.process.has_exited();
}

/// With an agent that negotiates flow control (ours), a CONNECT client that
/// stops reading fills its connection's window and the agent holds the
/// rest: no agent stream reader waits, so ANP #896's gauges stay out of
/// the exposition, as does `full_receive_channels` for agent streams.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_flow_control_no_reader_waits_on_a_full_connect_buffer() {
    let server = integration_tests::TestServer::start_with(integration_tests::ServerOpts {
        mode: proxy_server::config::Mode::HttpConnect,
        ..Default::default()
    })
    .await;
    let _agent = integration_tests::TestAgent::start(&server).await;
    let source = destination::source().await;
    let socket = UnixStream::connect(&server.uds).await.unwrap();
    let _stalled = client::dial::http_connect(socket, &source.address())
        .await
        .unwrap();
    let handle = server.handle.clone();
    wait_for("the stalled connection to fill its window", || {
        handle.max_buffered() > tunnel::flow::WINDOW / 2
    })
    .await;
    let (status, text) = http_get(server.health_addr, "/metrics").await;
    assert_eq!(status, 200);
    for name in WRITE_QUEUES {
        assert!(!exposes(&text, name), "{name}:\n{text}");
    }
    assert!(
        !text.contains("full_receive_channels{service_method=\"Connect\"}"),
        "{text}"
    );
}
