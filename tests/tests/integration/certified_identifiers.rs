//! `--verify-agent-identifiers` (issue 43): with mTLS, an agent's
//! `host=`/`ipv4=`/`ipv6=` identifiers are accepted only when its client
//! certificate names them, so that an agent cannot claim another node's
//! traffic under `destHost` by what it says. The real binaries, with
//! certificates made here: one agent certificate naming `node-a` and
//! 10.0.0.5.

use std::{path::Path, process::Command, time::Duration};

use integration_tests::{LoggedProcess, agent_args, binary, process::ServerProcess};

/// Writes the agent listener's files into `dir`, with an agent
/// certificate (`proxy-agent.crt`) naming `node-a` and 10.0.0.5; the CA.
fn write_pki(dir: &Path) -> certs::Ca {
    let ca = certs::Ca::new("agent-ca").unwrap();
    let server = ca
        .server_cert(
            "konnectivity-server",
            &["localhost".to_owned(), "127.0.0.1".to_owned()],
        )
        .unwrap();
    let agent = ca
        .client_cert_naming("node-a", &["node-a".to_owned(), "10.0.0.5".to_owned()])
        .unwrap();
    for (name, pem) in [
        ("agent-ca.crt", ca.cert_pem()),
        ("cluster.crt", server.cert_pem.as_str()),
        ("cluster.key", server.key_pem.as_str()),
        ("proxy-agent.crt", agent.cert_pem.as_str()),
        ("proxy-agent.key", agent.key_pem.as_str()),
    ] {
        std::fs::write(dir.join(name), pem).unwrap();
    }
    ca
}

fn agent(dir: &Path, server: &ServerProcess, id: &str, identifiers: &str) -> LoggedProcess {
    let mut command = Command::new(binary("proxy-agent"));
    command
        .env("RUST_LOG", "info")
        .args(agent_args(dir, server.agent_addr.port()))
        .args([
            format!("--agent-id={id}"),
            format!("--agent-identifiers={identifiers}"),
        ]);
    LoggedProcess::spawn(command, id)
}

#[tokio::test]
async fn an_agent_is_admitted_only_with_identifiers_its_certificate_names() {
    let dir = tempfile::tempdir().unwrap();
    write_pki(dir.path());
    let flags = [
        "--proxy-strategies=destHost,default".to_owned(),
        "--verify-agent-identifiers=true".to_owned(),
    ];
    let mut server = ServerProcess::start_in(dir.path(), "grpc", &flags).await;
    let _named = agent(dir.path(), &server, "node-a", "host=node-a&ipv4=10.0.0.5");
    server
        .wait_for_agents_within(1, Duration::from_secs(20))
        .await;
    // The same certificate, claiming another node: refused, and told why.
    for (id, claim) in [
        ("liar-host", "host=node-b"),
        ("liar-ip", "ipv4=10.0.0.6"),
        ("liar-cidr", "cidr=0.0.0.0/0"),
    ] {
        let mut liar = agent(dir.path(), &server, id, claim);
        let want =
            format!("agent identifier {claim} is not named by the agent's client certificate");
        liar.wait_for(&want, 1, Duration::from_secs(20)).await;
        server
            .process
            .wait_for(&want, 1, Duration::from_secs(20))
            .await;
        assert!(
            !liar.has_exited(),
            "the agent keeps retrying, as for any refusal"
        );
    }
    assert_eq!(
        server
            .metric("konnectivity_network_proxy_server_ready_backends{proxy_strategy=\"default\"}")
            .await,
        1.0,
        "only the agent whose claims its certificate names is connected"
    );
}

/// Issue 51, item 4: the agent id and `default-route=` are bound to the
/// certificate too. The `node-a` certificate cannot register as `node-b`
/// (one certificate taking many ids would be many voices), nor claim
/// `default-route=true` (which draws every `defaultRoute` dial); a
/// certificate that names the URI `urn:konnectivity:default-route` can.
#[tokio::test]
async fn the_agent_id_and_default_route_are_bound_to_the_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let ca = write_pki(dir.path());
    let routed = tempfile::tempdir().unwrap();
    let router = ca
        .client_cert_naming(
            "node-r",
            &[
                "node-r".to_owned(),
                proxy_server::strategy::DEFAULT_ROUTE_URI.to_owned(),
            ],
        )
        .unwrap();
    for (name, pem) in [
        ("agent-ca.crt", ca.cert_pem()),
        ("proxy-agent.crt", router.cert_pem.as_str()),
        ("proxy-agent.key", router.key_pem.as_str()),
    ] {
        std::fs::write(routed.path().join(name), pem).unwrap();
    }
    let flags = [
        "--proxy-strategies=defaultRoute,default".to_owned(),
        "--verify-agent-identifiers=true".to_owned(),
    ];
    let mut server = ServerProcess::start_in(dir.path(), "grpc", &flags).await;
    let _routed = agent(routed.path(), &server, "node-r", "default-route=true");
    server
        .wait_for_agents_within(1, Duration::from_secs(20))
        .await;
    for (id, claim, want) in [
        ("node-b", "host=node-a", "agent id node-b is not named"),
        (
            "node-a",
            "default-route=true",
            "agent identifier default-route=true is not named",
        ),
    ] {
        let mut liar = agent(dir.path(), &server, id, claim);
        liar.wait_for(want, 1, Duration::from_secs(20)).await;
        server
            .process
            .wait_for(want, 1, Duration::from_secs(20))
            .await;
    }
    assert_eq!(
        server
            .metric(
                "konnectivity_network_proxy_server_ready_backends{proxy_strategy=\"defaultRoute\"}"
            )
            .await,
        1.0,
        "only the agent whose certificate grants it routes by default"
    );
}
