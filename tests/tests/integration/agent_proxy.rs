//! proxy-agent reaching proxy-server through real SOCKS5 (microsocks) and
//! HTTP CONNECT (tinyproxy) proxies, installed by `scripts/test`. Each proxy binds
//! its outgoing connections to its own loopback address, so the server seeing
//! the agent come from that address proves the connection went through it.

#![allow(clippy::unwrap_used)] // tests: a panic is a failure report

use std::{
    process::{Command, Stdio},
    sync::Arc,
};

use edge::egress::{Proxy, ProxyError};
use integration_tests::{
    AgentOpts, TestAgent, TestServer, agent_config, destination,
    proxies::{microsocks, tinyproxy},
};
use proxy_agent::{
    client::{Client, ConnectError},
    metrics::AgentMetrics,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// An agent through `proxy_url` registers from `via`, and a request through
/// the tunnel is byte-exact.
async fn through(proxy_url: String, via: [u8; 4], server: &TestServer) {
    let _agent = TestAgent::start_with(
        server.agent_addr,
        AgentOpts {
            proxy: Some(Proxy::parse(&proxy_url).unwrap()),
            ..Default::default()
        },
    )
    .await;
    server.wait_for_backends(1).await;
    let peers = server.handle.agent_peers();
    assert_eq!(peers.len(), 1);
    assert_eq!(
        peers[0].ip(),
        std::net::IpAddr::from(via),
        "the agent did not come through the proxy"
    );
    let echo = destination::echo().await;
    let data = destination::pattern(1 << 20, 9);
    let mut conn = server.dial(&echo.address()).await.unwrap();
    let (mut rd, mut wr) = tokio::io::split(&mut conn);
    let (_, got) = tokio::join!(async { wr.write_all(&data).await.unwrap() }, async {
        let mut got = vec![0u8; data.len()];
        rd.read_exact(&mut got).await.unwrap();
        got
    });
    assert!(got == data);
    conn.finish().await.unwrap();
}

/// What a connect with `proxy_url` fails with.
async fn refused(proxy_url: &str, server: &TestServer) -> ConnectError {
    let config = agent_config(
        server.agent_addr,
        &AgentOpts {
            proxy: Some(Proxy::parse(proxy_url).unwrap()),
            ..AgentOpts::default()
        },
    );
    Client::connect(
        &config,
        config.tls.load().unwrap(),
        &config.servers[0],
        Arc::new(AgentMetrics::unattached()),
    )
    .await
    .err()
    .expect("the connect should fail")
}

#[tokio::test]
async fn through_microsocks_without_auth() {
    let server = TestServer::start().await;
    let socks = microsocks(None).await;
    through(format!("socks5h://{}", socks.addr), [127, 0, 0, 3], &server).await;
}

#[tokio::test]
async fn through_microsocks_with_auth_and_a_wrong_password_is_named() {
    let server = TestServer::start().await;
    let socks = microsocks(Some(("ops", "s3cret"))).await;
    through(
        format!("socks5://ops:s3cret@{}", socks.addr),
        [127, 0, 0, 3],
        &server,
    )
    .await;

    let err = refused(&format!("socks5://ops:wrong@{}", socks.addr), &server).await;
    let text = ops::error::DisplayErrorStack(&err).to_string();
    assert!(
        matches!(err, ConnectError::Proxy(ProxyError::AuthRefused { .. })),
        "{text}"
    );
    assert!(
        text.contains(&format!("socks5://ops:***@{}", socks.addr)),
        "{text}"
    );
    assert!(text.contains(&server.agent_addr.to_string()), "{text}");
    assert!(!text.contains("wrong"), "the password leaked: {text}");
}

#[tokio::test]
async fn through_tinyproxy_with_basic_auth_and_a_wrong_password_is_named() {
    let server = TestServer::start().await;
    let http = tinyproxy(Some(("ops", "s3cret")), server.agent_addr.port()).await;
    through(
        format!("http://ops:s3cret@{}", http.addr),
        [127, 0, 0, 4],
        &server,
    )
    .await;

    let err = refused(&format!("http://ops:wrong@{}", http.addr), &server).await;
    let text = ops::error::DisplayErrorStack(&err).to_string();
    assert!(
        matches!(err, ConnectError::Proxy(ProxyError::AuthRefused { .. })),
        "{text}"
    );
    assert!(text.contains("http://ops:***@"), "{text}");
    assert!(!text.contains("wrong"), "the password leaked: {text}");
}

#[tokio::test]
async fn proxy_failures_name_the_proxy_and_the_target() {
    let server = TestServer::start().await;
    // Nothing listens there.
    let dead = destination::closed_port();
    let err = refused(&format!("socks5://{dead}"), &server).await;
    assert!(
        matches!(err, ConnectError::Proxy(ProxyError::Unreachable { .. })),
        "{err}"
    );
    assert!(err.to_string().contains(&dead.to_string()), "{err}");
    // tinyproxy refuses CONNECT to a port it does not allow.
    let http = tinyproxy(None, 1).await;
    let err = refused(&format!("http://{}", http.addr), &server).await;
    let text = err.to_string();
    assert!(
        matches!(err, ConnectError::Proxy(ProxyError::TargetRefused { .. })),
        "{text}"
    );
    assert!(text.contains(&server.agent_addr.to_string()), "{text}");
}

#[tokio::test]
async fn the_real_agent_honours_https_proxy_and_no_proxy() {
    let server = TestServer::start().await;
    let socks = microsocks(None).await;
    let pki = integration_tests::Pki::get();
    let run = |no_proxy: &str| {
        Command::new(integration_tests::binary("proxy-agent"))
            .env("HTTPS_PROXY", format!("socks5h://{}", socks.addr))
            .env("NO_PROXY", no_proxy)
            .args([
                format!("--ca-cert={}", pki.path("agent-ca.crt").display()),
                format!("--agent-cert={}", pki.path("proxy-agent.crt").display()),
                format!("--agent-key={}", pki.path("proxy-agent.key").display()),
                format!("--proxy-server-port={}", server.agent_addr.port()),
                "--health-server-port=0".to_owned(),
                "--admin-server-port=0".to_owned(),
                "--sync-interval=100ms".to_owned(),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap()
    };
    // Through the proxy from the environment.
    let mut agent = run("example.invalid");
    server.wait_for_backends(1).await;
    assert_eq!(
        server.handle.agent_peers()[0].ip(),
        std::net::IpAddr::from([127, 0, 0, 3])
    );
    let _ = agent.kill();
    let _ = agent.wait();
    server.wait_for_backends(0).await;
    // NO_PROXY covers the server: straight there.
    let mut agent = run("127.0.0.0/8");
    server.wait_for_backends(1).await;
    assert_eq!(
        server.handle.agent_peers()[0].ip(),
        std::net::IpAddr::from([127, 0, 0, 1])
    );
    let _ = agent.kill();
    let _ = agent.wait();
}
