//! TLS session resumption on the agent listener: a restarted server opens
//! the session tickets it issued before (their keys are derived from its
//! key), so a reconnect storm costs it no signature per agent.

use std::time::Duration;

use integration_tests::{ServerOpts, TestAgent, TestServer};

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
        assert!(started.elapsed() < Duration::from_secs(20), "no renewals");
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

/// A CA, a server certificate for 127.0.0.1 and a client certificate that
/// stops being valid at `client_until`, written as the agent and server
/// files of `dir`.
fn pki_with_client_until(dir: &std::path::Path, client_until: time::OffsetDateTime) {
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca = rcgen::CertificateParams::new(Vec::new()).unwrap();
    ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca.key_usages = vec![
        rcgen::KeyUsagePurpose::KeyCertSign,
        rcgen::KeyUsagePurpose::DigitalSignature,
    ];
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    let issuer = rcgen::Issuer::new(ca, ca_key);
    let leaf = |sans: Vec<String>, usage, until: Option<time::OffsetDateTime>| {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(sans).unwrap();
        params.extended_key_usages = vec![usage];
        if let Some(until) = until {
            params.not_before = until - time::Duration::hours(1);
            params.not_after = until;
        }
        (
            params.signed_by(&key, &issuer).unwrap().pem(),
            key.serialize_pem(),
        )
    };
    let (server_crt, server_key) = leaf(
        vec!["127.0.0.1".to_owned(), "localhost".to_owned()],
        rcgen::ExtendedKeyUsagePurpose::ServerAuth,
        None,
    );
    let (agent_crt, agent_key) = leaf(
        Vec::new(),
        rcgen::ExtendedKeyUsagePurpose::ClientAuth,
        Some(client_until),
    );
    for (name, text) in [
        ("agent-ca.crt", ca_cert.pem()),
        ("cluster.crt", server_crt),
        ("cluster.key", server_key),
        ("proxy-agent.crt", agent_crt),
        ("proxy-agent.key", agent_key),
    ] {
        std::fs::write(dir.join(name), text).unwrap();
    }
}

/// A resumed session brings back the client certificate of its first
/// handshake. Once that certificate has expired, the server drops the
/// resumed connection, and the agent's full handshake is refused: renewing
/// tickets never outlives the certificate.
#[tokio::test]
async fn a_resumed_session_whose_client_certificate_expired_is_dropped() {
    use integration_tests::process::{AgentWithFiles, ServerProcess};
    let dir = tempfile::tempdir().unwrap();
    let until = time::OffsetDateTime::now_utc() + time::Duration::seconds(3);
    pki_with_client_until(dir.path(), until);
    let server = ServerProcess::start_in(dir.path(), "grpc", &[]).await;
    let _agent = AgentWithFiles::start(dir.path(), server.agent_addr.port()).await;
    server.wait_for_agents(1).await;
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
    assert_eq!(
        server
            .metric(
                "konnectivity_network_proxy_server_grpc_connections{service_method=\"Connect\"}"
            )
            .await,
        0.0
    );
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
