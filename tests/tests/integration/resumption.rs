//! TLS session resumption on the agent listener: a restarted server opens
//! the session tickets it issued before (their keys are derived from its
//! key), so a reconnect storm costs it no signature per agent.

use std::time::Duration;

use integration_tests::{DEADLINE, ServerOpts, TestAgent, TestServer};

/// `konnectivity_rs_server_agent_tls_handshakes_total{kind}` of `server`.
async fn handshakes(server: &TestServer, kind: &str) -> f64 {
    server
        .metric(&format!(
            "konnectivity_rs_server_agent_tls_handshakes_total{{kind=\"{kind}\"}}"
        ))
        .await
}

#[tokio::test]
async fn agents_resume_their_sessions_after_a_server_restart() {
    let server = TestServer::start().await;
    let _agents = [
        TestAgent::start(&server).await,
        TestAgent::start(&server).await,
    ];
    assert_eq!(handshakes(&server, "full").await, 2.0);
    assert_eq!(handshakes(&server, "resumed").await, 0.0);

    let server = server.restart().await;
    server.wait_for_backends(2).await;
    assert_eq!(handshakes(&server, "resumed").await, 2.0);
    assert_eq!(handshakes(&server, "full").await, 0.0);
    server.assert_serves().await;
}

#[tokio::test]
async fn without_session_tickets_a_restart_costs_full_handshakes() {
    let server = TestServer::start_with(ServerOpts {
        session_tickets: false,
        ..Default::default()
    })
    .await;
    let _agent = TestAgent::start(&server).await;
    let server = server.restart().await;
    server.wait_for_backends(1).await;
    assert_eq!(handshakes(&server, "full").await, 1.0);
    assert_eq!(handshakes(&server, "resumed").await, 0.0);
    server.assert_serves().await;
}

/// Tickets last one key rotation. An agent that renews its tickets
/// (`--tls-session-refresh-interval`) resumes after a restart long after it
/// connected; one that does not needs a full handshake.
#[tokio::test]
async fn an_agent_that_renews_its_tickets_resumes_after_they_would_have_expired() {
    const ROTATION: Duration = Duration::from_secs(1);
    let opts = ServerOpts {
        ticket_rotation: ROTATION,
        ..Default::default()
    };
    let server = TestServer::start_with(opts).await;
    let _renewing = integration_tests::TestAgent::start_with(
        server.agent_addr,
        integration_tests::AgentOpts {
            session_refresh: Some(Duration::from_millis(200)),
            ..Default::default()
        },
    )
    .await;
    let _plain = TestAgent::start_with(server.agent_addr, Default::default()).await;
    server.wait_for_backends(2).await;
    // Renewals are resumed handshakes: 15 of them, 200 ms apart, outlast
    // the plain agent's ticket (offered for one rotation, opened for two).
    let started = std::time::Instant::now();
    while handshakes(&server, "resumed").await < 15.0 {
        // 3 s of renewals at most; this only catches a stuck run.
        assert!(started.elapsed() < 2 * DEADLINE, "no renewals");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(started.elapsed() >= 2 * ROTATION);

    let server = server.restart().await;
    server.wait_for_backends(2).await;
    assert_eq!(
        handshakes(&server, "full").await,
        1.0,
        "only the plain agent"
    );
    assert!(handshakes(&server, "resumed").await >= 1.0);
    server.assert_serves().await;
}

/// A CA whose files (`agent-ca.crt`, and `cluster.crt`/`cluster.key` for
/// 127.0.0.1) are written to a directory at once, and agent certificates
/// (`proxy-agent.crt`/`.key`) issued into it later.
struct ShortLivedPki {
    /// Where the files go.
    dir: std::path::PathBuf,
    /// Signs the certificates.
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
}

impl ShortLivedPki {
    /// A new CA and the server's certificate, written to `dir`.
    fn new(dir: &std::path::Path) -> Self {
        let ca_key = rcgen::KeyPair::generate().unwrap();
        let mut ca = rcgen::CertificateParams::new(Vec::new()).unwrap();
        ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        ca.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::DigitalSignature,
        ];
        let ca_cert = ca.self_signed(&ca_key).unwrap();
        let pki = Self {
            dir: dir.to_owned(),
            issuer: rcgen::Issuer::new(ca, ca_key),
        };
        std::fs::write(dir.join("agent-ca.crt"), ca_cert.pem()).unwrap();
        pki.issue(
            ("cluster.crt", "cluster.key"),
            vec!["127.0.0.1".to_owned(), "localhost".to_owned()],
            rcgen::ExtendedKeyUsagePurpose::ServerAuth,
            None,
        );
        pki
    }

    /// The agent's certificate, valid until `until`.
    fn issue_agent(&self, until: time::OffsetDateTime) {
        self.issue(
            ("proxy-agent.crt", "proxy-agent.key"),
            Vec::new(),
            rcgen::ExtendedKeyUsagePurpose::ClientAuth,
            Some(until),
        );
    }

    fn issue(
        &self,
        (crt, key_file): (&str, &str),
        sans: Vec<String>,
        usage: rcgen::ExtendedKeyUsagePurpose,
        until: Option<time::OffsetDateTime>,
    ) {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(sans).unwrap();
        params.extended_key_usages = vec![usage];
        if let Some(until) = until {
            params.not_before = until - time::Duration::hours(1);
            params.not_after = until;
        }
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        std::fs::write(self.dir.join(crt), cert.pem()).unwrap();
        std::fs::write(self.dir.join(key_file), key.serialize_pem()).unwrap();
    }
}

/// A resumed session brings back the client certificate of its first
/// handshake. Once that certificate has expired, the server drops the
/// resumed connection, and the agent's full handshake is refused: renewing
/// tickets never outlives the certificate.
#[tokio::test]
async fn a_resumed_session_whose_client_certificate_expired_is_dropped() {
    use integration_tests::process::{AgentWithFiles, ServerProcess};
    const CONNECTIONS: &str =
        "konnectivity_network_proxy_server_grpc_connections{service_method=\"Connect\"}";
    let dir = tempfile::tempdir().unwrap();
    let pki = ShortLivedPki::new(dir.path());
    let server = ServerProcess::start_in(dir.path(), "grpc", &[]).await;
    // The agent must connect (a full handshake, which the server refuses
    // once the certificate has expired) before its certificate expires,
    // and the test then waits out the certificate's life. A loaded machine
    // can make the start slow: each try issues a certificate that lives
    // longer, just before its agent starts.
    let mut lifetimes = [5, 10, 20, 40].into_iter();
    let (until, _agent) = loop {
        let lifetime = lifetimes
            .next()
            .expect("the agent never connected within its certificate's 40 s: stuck");
        let until = time::OffsetDateTime::now_utc() + time::Duration::seconds(lifetime);
        pki.issue_agent(until);
        let agent = AgentWithFiles::start(dir.path(), server.agent_addr.port()).await;
        let connected = loop {
            if server.metric(CONNECTIONS).await >= 1.0 {
                break true;
            }
            if time::OffsetDateTime::now_utc() > until {
                break false;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        if connected {
            break (until, agent);
        }
        println!("the agent did not connect within its certificate's {lifetime} s; again");
    };
    // The certificate's validity is in seconds: wait until it is over.
    while time::OffsetDateTime::now_utc() <= until + time::Duration::seconds(1) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let port = server.agent_addr.port();
    drop(server);
    let server =
        ServerProcess::start_in(dir.path(), "grpc", &[format!("--agent-port={port}")]).await;
    // Each of the agent's tickets is tried and dropped: without the check
    // the first one would connect and no second would come.
    server
        .wait_for_metric_at_least(
            "konnectivity_rs_server_agent_tls_handshakes_total{kind=\"resumed\"}",
            2.0,
            Duration::from_secs(20),
        )
        .await;
    assert_eq!(server.metric(CONNECTIONS).await, 0.0);
}

/// Whether OpenSSL (Python's `ssl`, `tests/python/resume.py`), offering a
/// session it got from `server`, resumes it with the server restarted.
async fn openssl_resumes_after_a_restart(server: TestServer) -> bool {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
    let pki = integration_tests::Pki::get();
    let mut child = tokio::process::Command::new(integration_tests::python::interpreter())
        .arg(integration_tests::workspace().join("tests/python/resume.py"))
        .arg(format!("--port={}", server.agent_addr.port()))
        .arg(format!("--ca={}", pki.path("agent-ca.crt").display()))
        .arg(format!("--cert={}", pki.path("proxy-agent.crt").display()))
        .arg(format!("--key={}", pki.path("proxy-agent.key").display()))
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let next = async |lines: &mut tokio::io::Lines<_>| {
        tokio::time::timeout(Duration::from_secs(20), lines.next_line())
            .await
            .expect("resume.py said nothing")
            .unwrap()
            .expect("resume.py ended early")
    };
    assert_eq!(next(&mut lines).await, "ready");
    let _server = server.restart().await;
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(b"go\n").await.unwrap();
    let report: serde_json::Value = serde_json::from_str(&next(&mut lines).await).unwrap();
    assert_eq!(report["had_ticket"], true, "{report}");
    report["reused"].as_bool().unwrap()
}

/// A client we did not write, OpenSSL, resumes a session of a server that
/// has since restarted; with tickets off it cannot.
#[tokio::test]
async fn openssl_resumes_with_a_ticket_after_a_server_restart() {
    assert!(openssl_resumes_after_a_restart(TestServer::start().await).await);
    let without = TestServer::start_with(ServerOpts {
        session_tickets: false,
        ..Default::default()
    })
    .await;
    assert!(!openssl_resumes_after_a_restart(without).await);
}

/// The handshakes OpenSSL (Python's `ssl`, `tests/python/tickets.py`) makes
/// with the agent port, TLS 1.2 then TLS 1.3: (version, whether it got a
/// session ticket).
async fn openssl_tickets(server: &TestServer) -> Vec<(String, bool)> {
    let pki = integration_tests::Pki::get();
    let output = tokio::time::timeout(
        Duration::from_secs(60),
        tokio::process::Command::new(integration_tests::python::interpreter())
            .arg(integration_tests::workspace().join("tests/python/tickets.py"))
            .arg(format!("--port={}", server.agent_addr.port()))
            .arg(format!("--ca={}", pki.path("agent-ca.crt").display()))
            .arg(format!("--cert={}", pki.path("proxy-agent.crt").display()))
            .arg(format!("--key={}", pki.path("proxy-agent.key").display()))
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("tickets.py did not finish")
    .unwrap();
    assert!(
        output.status.success(),
        "tickets.py: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout)
        .unwrap()
        .lines()
        .map(|line| {
            let report: serde_json::Value = serde_json::from_str(line).unwrap();
            (
                report["version"].as_str().unwrap().to_owned(),
                report["has_ticket"].as_bool().unwrap(),
            )
        })
        .collect()
}

/// A TLS 1.2 ticket carries the master secret: OpenSSL gets none with TLS
/// 1.2, and still gets one with TLS 1.3.
#[tokio::test]
async fn openssl_gets_a_ticket_with_tls13_only() {
    let server = TestServer::start().await;
    assert_eq!(
        openssl_tickets(&server).await,
        [("TLSv1.2".to_owned(), false), ("TLSv1.3".to_owned(), true)]
    );
}

/// What an agent-port connection of `client` (over TLS, SNI `localhost`)
/// got: how its handshake went, and whether the server then spoke HTTP/2
/// (its SETTINGS frame, sent before it reads anything) or dropped it.
async fn agent_port(
    server: &TestServer,
    client: std::sync::Arc<rustls::ClientConfig>,
) -> (rustls::HandshakeKind, bool) {
    use tokio::io::AsyncReadExt;
    let tcp = tokio::net::TcpStream::connect(server.agent_addr)
        .await
        .unwrap();
    let mut tls = tokio_rustls::TlsConnector::from(client)
        .connect(
            rustls_pki_types::ServerName::try_from("localhost").unwrap(),
            tcp,
        )
        .await
        .unwrap();
    let kind = tls.get_ref().1.handshake_kind().unwrap();
    let mut head = [0u8; 9];
    let read = tokio::time::timeout(Duration::from_secs(20), tls.read_exact(&mut head))
        .await
        .expect("the server neither spoke nor closed");
    (kind, read.is_ok() && head[3] == 4)
}

/// A ticket sealed by whoever holds the ticket secret (by default the
/// serving key), for a session of their own making: with no client
/// certificate chain, or one the CA did not sign, it is refused although
/// the TLS resumption itself succeeds; with a valid chain, and for a real
/// agent's own session, the server speaks HTTP/2.
#[tokio::test]
async fn a_ticket_made_with_the_secret_admits_no_one_without_a_valid_chain() {
    use integration_tests::Pki;
    use rustls::HandshakeKind::{Full, Resumed};
    let server = TestServer::start().await;
    let (pki, other) = (Pki::get(), Pki::other());
    let forge = |client_ca: Option<std::path::PathBuf>| {
        let mut config = std::sync::Arc::unwrap_or_clone(
            ops::tls::server_config(
                &pki.path("cluster.crt"),
                &pki.path("cluster.key"),
                client_ca.as_deref(),
            )
            .unwrap(),
        );
        config.ticketer = std::sync::Arc::new(ops::tls::tickets::TicketKeys::new(
            &std::fs::read(pki.path("cluster.key")).unwrap(),
            &std::fs::read(pki.path("agent-ca.crt")).unwrap(),
            proxy_server::config::DEFAULT_TICKET_ROTATION,
        ));
        std::sync::Arc::new(config)
    };
    let client = |cert_of: Option<&Pki>| {
        let files = cert_of.map(|p| (p.path("proxy-agent.crt"), p.path("proxy-agent.key")));
        let files = files.as_ref().map(|(c, k)| (c.as_path(), k.as_path()));
        ops::tls::client_config(&pki.path("agent-ca.crt"), files, &[]).unwrap()
    };
    // The forger's session goes to the client's ticket store.
    let mint = async |server: std::sync::Arc<rustls::ServerConfig>,
                      client: std::sync::Arc<rustls::ClientConfig>| {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (a, b) = tokio::io::duplex(64 * 1024);
        let serve = async move {
            let mut tls = tokio_rustls::TlsAcceptor::from(server)
                .accept(a)
                .await
                .unwrap();
            tls.write_all(b"x").await.unwrap();
            tls.flush().await.unwrap();
            let _ = tls.read(&mut [0u8; 1]).await;
        };
        let take = async move {
            let name = rustls_pki_types::ServerName::try_from("localhost").unwrap();
            let mut tls = tokio_rustls::TlsConnector::from(client)
                .connect(name, b)
                .await
                .unwrap();
            tls.read_exact(&mut [0u8; 1]).await.unwrap();
            let _ = tls.shutdown().await;
        };
        tokio::join!(serve, take);
    };

    let no_chain = client(None);
    mint(forge(None), no_chain.clone()).await;
    assert_eq!(agent_port(&server, no_chain).await, (Resumed, false));

    let foreign = client(Some(other));
    mint(forge(Some(other.path("agent-ca.crt"))), foreign.clone()).await;
    assert_eq!(agent_port(&server, foreign).await, (Resumed, false));

    let valid = client(Some(pki));
    mint(forge(Some(pki.path("agent-ca.crt"))), valid.clone()).await;
    assert_eq!(agent_port(&server, valid).await, (Resumed, true));

    let agent = client(Some(pki));
    assert_eq!(agent_port(&server, agent.clone()).await, (Full, true));
    assert_eq!(agent_port(&server, agent).await, (Resumed, true));
    assert_eq!(handshakes(&server, "resumed").await, 4.0);
}
