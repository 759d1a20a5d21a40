//! Issue 45, item 1: the real proxy-server and a real proxy-agent given
//! `--destination-policy-file`. A denied destination is never connected to
//! in any form a frontend can write it (a name, numeric forms, mapped,
//! NAT64 and IPv4-compatible IPv6): the listener on the denied address
//! counts 0 accepts; the frontend's error names the rule; the agent counts
//! it by rule; the unspecified addresses, which Linux connects to the
//! host itself, are loopback in every form (issue 51). (The
//! server's refusal to retry it elsewhere is the router's test
//! `a_dial_an_agents_policy_denied_is_not_retried`; DNS rebinding is
//! endpoint's, with a scripted resolver.)

#![allow(clippy::unwrap_used)] // tests: a panic is a failure report

use std::{net::SocketAddr, process::Command};

use integration_tests::{LoggedProcess, Pki, agent_args, binary, process::ServerProcess};

/// A non-blocking listener that counts the connections made to it.
struct Counted(std::net::TcpListener);

impl Counted {
    fn bind(addr: SocketAddr) -> Option<Self> {
        let listener = std::net::TcpListener::bind(addr).ok()?;
        listener.set_nonblocking(true).unwrap();
        Some(Self(listener))
    }

    /// Connections queued: each completes before its dial answers.
    fn accepts(&self) -> usize {
        std::iter::from_fn(|| self.0.accept().ok()).count()
    }
}

/// A server and a real agent given `--destination-policy-file` with
/// `policy` (in the returned directory), the agent not yet connected.
async fn with_policy(policy: &str) -> (ServerProcess, LoggedProcess, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("policy");
    std::fs::write(&path, policy).unwrap();
    let server = ServerProcess::start("grpc", &[]).await;
    let mut command = Command::new(binary("proxy-agent"));
    command
        .env("RUST_LOG", "info")
        .args(agent_args(Pki::get().dir.path(), server.agent_addr.port()))
        .arg(format!("--destination-policy-file={}", path.display()));
    let agent = LoggedProcess::spawn(command, "proxy-agent");
    (server, agent, dir)
}

/// The error of a dial to `address` that must be refused.
async fn refusal(channel: &tonic::transport::Channel, address: &str) -> String {
    match client::dial::dial(channel.clone(), address).await {
        Err(client::dial::ClientError::Dial { error, .. }) => error,
        Err(other) => panic!("{address}: expected a refusal, got {other:?}"),
        Ok(_) => panic!("{address}: connected"),
    }
}

#[tokio::test]
async fn a_denied_destination_gets_no_connection_in_any_form() {
    // 127.0.0.2 and 127.0.0.1 at one port: the first denied on every port,
    // the second (and ::1: localhost) on that port; the
    // allowed neighbour 127.0.0.3 proves the agent dials at all.
    let (denied, loopback, allowed, port) = loop {
        let allowed = Counted::bind("127.0.0.3:0".parse().unwrap()).unwrap();
        let port = allowed.0.local_addr().unwrap().port();
        let at = |ip: &str| Counted::bind(SocketAddr::new(ip.parse().unwrap(), port));
        if let (Some(denied), Some(loopback)) = (at("127.0.0.2"), at("127.0.0.1")) {
            break (denied, loopback, allowed, port);
        }
    };
    let (server, mut agent, _dir) = with_policy(&format!(
        "deny metadata\ndeny 127.0.0.2\ndeny 127.0.0.1 port {port}\ndeny ::1 port {port}\n"
    ))
    .await;
    let health = agent.logged_port("health.addr=Some(127.0.0.1:").await;
    server.wait_for_agents(1).await;

    let channel = client::dial::uds_channel(&server.uds).await.unwrap();
    let by_address = vec!["deny 127.0.0.2".to_owned()];
    let v4 = format!("deny 127.0.0.1 port {port}");
    let localhost = vec![v4.clone(), format!("deny ::1 port {port}")];
    let forms = [
        ("127.0.0.2", &by_address),
        ("2130706434", &by_address),
        ("0x7f.2", &by_address),
        ("0177.0.0.2", &by_address),
        ("127.2", &by_address),
        ("[::ffff:127.0.0.2]", &by_address),
        ("[64:ff9b::127.0.0.2]", &by_address),
        ("[::127.0.0.2]", &by_address),
        ("localhost", &localhost),
        ("127.1", &vec![v4]),
    ];
    for (host, rules) in forms {
        let address = format!("{host}:{port}");
        let error = refusal(&channel, &address).await;
        assert!(
            rules.iter().any(|rule| error.ends_with(&format!(
                "denied by the agent's policy (rule {rule})"
            ))),
            "{address}: {error}"
        );
    }
    let open = client::dial::dial(channel.clone(), &format!("127.0.0.3:{port}"))
        .await
        .unwrap();
    drop(open);
    assert_eq!(denied.accepts(), 0, "the denied address was connected to");
    assert_eq!(loopback.accepts(), 0, "localhost was connected to");
    assert_eq!(allowed.accepts(), 1);

    let (status, metrics) =
        integration_tests::http_get(SocketAddr::from(([127, 0, 0, 1], health)), "/metrics").await;
    assert_eq!(status, 200);
    let denied_by = |rule: &str| {
        let series = format!("konnectivity_rs_agent_dials_denied_total{{rule=\"{rule}\"}}");
        integration_tests::process::metric_value(&metrics, &series)
    };
    assert_eq!(denied_by("deny 127.0.0.2"), 8.0, "{metrics}");
    let loopback = denied_by(&format!("deny 127.0.0.1 port {port}"))
        + denied_by(&format!("deny ::1 port {port}"));
    assert_eq!(loopback, 2.0, "{metrics}");
}

/// Issue 51, item 1: under `deny loopback` (here for one port, so that the
/// agent's dials elsewhere show it dials at all), the unspecified
/// addresses in every form a frontend can write them get no connection to
/// the host's loopback listeners, which Linux connects them to (before,
/// `0.0.0.0`, `0`, `0x0` and `[::]` reached them); each is refused naming
/// the rule.
#[tokio::test]
async fn the_unspecified_address_in_any_form_is_loopback() {
    // 127.0.0.1 and, where the host has it, ::1 at one port; another port
    // of 127.0.0.1 is allowed.
    let (v4, v6, allowed, port) = loop {
        let v4 = Counted::bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let port = v4.0.local_addr().unwrap().port();
        let allowed = Counted::bind("127.0.0.1:0".parse().unwrap()).unwrap();
        match std::net::TcpListener::bind(("::1", 0)) {
            // No IPv6 loopback here: `[::]` cannot reach one.
            Err(_) => break (v4, None, allowed, port),
            Ok(_) => {
                if let Some(v6) = Counted::bind(SocketAddr::new("::1".parse().unwrap(), port)) {
                    break (v4, Some(v6), allowed, port);
                }
            }
        }
    };
    let rule = format!("deny loopback port {port}");
    let (server, _agent, _dir) = with_policy(&format!("{rule}\n")).await;
    server.wait_for_agents(1).await;
    let channel = client::dial::uds_channel(&server.uds).await.unwrap();
    let forms = [
        "0.0.0.0",
        "0",
        "0x0",
        "0.0",
        "000.0.0.0",
        "[::]",
        "[0:0:0:0:0:0:0:0]",
        "[::ffff:0.0.0.0]",
        "[::0.0.0.0]",
        "[64:ff9b::0.0.0.0]",
    ];
    for host in forms {
        let address = format!("{host}:{port}");
        let error = refusal(&channel, &address).await;
        assert!(
            error.ends_with(&format!("denied by the agent's policy (rule {rule})")),
            "{address}: {error}"
        );
    }
    let other = allowed.0.local_addr().unwrap().port();
    drop(
        client::dial::dial(channel, &format!("0.0.0.0:{other}"))
            .await
            .unwrap(),
    );
    assert_eq!(v4.accepts(), 0, "127.0.0.1 was connected to");
    assert_eq!(v6.map_or(0, |v6| v6.accepts()), 0, "::1 was connected to");
    assert_eq!(allowed.accepts(), 1, "0.0.0.0 on an allowed port");
}
