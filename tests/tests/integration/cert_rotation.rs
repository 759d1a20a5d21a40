//! Certificates and CAs rotated on disk under running binaries: new
//! handshakes use the new files, established tunnels keep flowing, and
//! files that cannot be used keep the last good ones (logged once, naming
//! the file, and counted).

use std::path::{Path, PathBuf};

use integration_tests::{
    AGENT_FILES, DEADLINE, LoggedProcess, Pki, SERVER_FILES,
    destination::{self, pattern},
    install,
    process::{AgentWithFiles as Agent, ServerProcess, metric_value},
};
use tokio::{
    io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt},
    net::{TcpStream, UnixStream},
};

/// A tunnel through the server's CONNECT frontend (Unix socket).
async fn tunnel(server: &ServerProcess, target: &str) -> UnixStream {
    let mut io = UnixStream::connect(&server.uds).await.unwrap();
    connect(&mut io, target).await.unwrap();
    io
}

/// Sends CONNECT for `target` on `io` and reads the 200; an I/O error
/// (a refused TLS client shows here under TLS 1.3) is handed back.
async fn connect(
    io: &mut (impl AsyncRead + AsyncWrite + Unpin),
    target: &str,
) -> std::io::Result<()> {
    io.write_all(format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n").as_bytes())
        .await?;
    let mut head = vec![0u8; proxy_server::ESTABLISHED.len()];
    tokio::time::timeout(DEADLINE, io.read_exact(&mut head))
        .await
        .expect("no CONNECT answer")?;
    assert_eq!(head, proxy_server::ESTABLISHED);
    Ok(())
}

/// Sends 64 KiB of pattern `seed` through an echo tunnel and reads them
/// back byte-exact.
async fn echo_round(io: &mut (impl AsyncRead + AsyncWrite + Unpin), seed: u64) {
    let sent = pattern(64 * 1024, seed);
    let (mut read, mut write) = tokio::io::split(io);
    let mut back = vec![0u8; sent.len()];
    let (written, got) = tokio::join!(write.write_all(&sent), async {
        tokio::time::timeout(DEADLINE, read.read_exact(&mut back)).await
    });
    written.unwrap();
    got.expect("echo timed out").unwrap();
    assert!(back == sent, "the echo differs (round {seed})");
}

/// Stops `server` and starts it again on its agent port with the files in
/// `dir`; returns once `agents` agents are back.
async fn restart(server: ServerProcess, dir: &Path, agents: usize) -> ServerProcess {
    let port = server.agent_addr.port();
    drop(server);
    let server =
        ServerProcess::start_in(dir, "http-connect", &[format!("--agent-port={port}")]).await;
    server.wait_for_agents(agents).await;
    server
}

/// curl through the mTLS CONNECT frontend on `port` with the frontend CA
/// and client certificate of the PKI in `pki`, fetching `http://<target>/`
/// into `out`.
async fn curl_through(port: u16, pki: &Path, target: &str, out: &Path) -> std::process::Output {
    let mut command = std::process::Command::new("curl");
    command
        .args([
            "--silent",
            "--show-error",
            "--max-time",
            "20",
            "--proxytunnel",
        ])
        .arg("--proxy")
        .arg(format!("https://localhost:{port}"))
        .arg("--proxy-cacert")
        .arg(pki.join("frontend-ca.crt"))
        .arg("--proxy-cert")
        .arg(pki.join("proxy-client.crt"))
        .arg("--proxy-key")
        .arg(pki.join("proxy-client.key"))
        .arg("--output")
        .arg(out)
        .arg(format!("http://{target}/"));
    tokio::task::spawn_blocking(move || command.output().expect("running curl"))
        .await
        .unwrap()
}

/// The value of one series of `text`, which must be there.
fn required(text: &str, series: &str) -> f64 {
    assert!(
        text.lines().any(|l| l.starts_with(&format!("{series} "))),
        "{series} is not exported:\n{text}"
    );
    metric_value(text, series)
}

fn expiry(prefix: &str, flag: &str, file: &Path) -> String {
    format!(
        "{prefix}_certificate_expiry_timestamp_seconds{{certificate=\"{flag}\",file=\"{}\"}}",
        file.display()
    )
}

/// The rotation, with the real binaries: the cluster rotates to a
/// new CA on disk. A new agent holding the new CA's certificate is admitted
/// by the server that is still running; the established tunnel carries
/// bytes exactly across the rotation; the running agent, never restarted,
/// reconnects to the server restarted on the new CA.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ca_rotation_needs_no_restart_and_keeps_tunnels() {
    let (old, new) = (Pki::fresh(), Pki::fresh());
    let server_dir = tempfile::tempdir().unwrap();
    let (agent_dir, new_agent_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    install(old.dir.path(), server_dir.path(), &SERVER_FILES);
    install(old.dir.path(), agent_dir.path(), &AGENT_FILES);
    install(new.dir.path(), new_agent_dir.path(), &AGENT_FILES);

    let server = ServerProcess::start_in(server_dir.path(), "http-connect", &[]).await;
    let port = server.agent_addr.port();
    let agent = Agent::start(agent_dir.path(), port).await;
    server.wait_for_agents(1).await;
    let metrics = server.metrics().await;
    for (flag, file) in [
        ("cluster-cert", "cluster.crt"),
        ("cluster-ca-cert", "agent-ca.crt"),
    ] {
        let series = expiry(
            "konnectivity_rs_server",
            flag,
            &server_dir.path().join(file),
        );
        assert!(required(&metrics, &series) > 4.0e9, "{series}: {metrics}");
    }
    let series = expiry(
        "konnectivity_rs_agent",
        "agent-cert",
        &agent_dir.path().join("proxy-agent.crt"),
    );
    assert!(required(&agent.metrics().await, &series) > 4.0e9);

    let echo = destination::echo().await;
    let mut established = tunnel(&server, &echo.address()).await;
    echo_round(&mut established, 1).await;

    // The rotation: the server's and the running agent's files move to the
    // new CA; nothing is restarted.
    install(new.dir.path(), server_dir.path(), &SERVER_FILES);
    install(new.dir.path(), agent_dir.path(), &AGENT_FILES);
    echo_round(&mut established, 2).await;

    // A new agent with the new CA's certificate is admitted by the running
    // server (it would not be by the files the server started with).
    let _new_agent = Agent::start(new_agent_dir.path(), port).await;
    server.wait_for_agents(2).await;
    echo_round(&mut established, 3).await;
    assert_eq!(
        server
            .metric("konnectivity_rs_server_certificate_reload_failures_total{certificate=\"cluster-cert\"}")
            .await,
        0.0
    );
    let mut fresh = tunnel(&server, &echo.address()).await;
    echo_round(&mut fresh, 4).await;
    drop((established, fresh));

    // The server restarts on the new files; the first agent, still running
    // with the files it started with on its command line, comes back.
    let server = restart(server, server_dir.path(), 2).await;
    let mut after = tunnel(&server, &echo.address()).await;
    echo_round(&mut after, 5).await;
    assert!(
        agent.process.find("panicked").is_none(),
        "{:#?}",
        agent.process.lines()
    );
}

/// Files that cannot be used keep the last good ones, on both sides: the
/// server's key replaced by one that does not match its certificate, the
/// agent's CA file half written. Each is logged once, naming the file, and
/// counted; agents keep connecting with the last good material; fixing the
/// files is picked up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unusable_files_keep_the_last_good_ones() {
    let (good, other) = (Pki::fresh(), Pki::fresh());
    let server_dir = tempfile::tempdir().unwrap();
    let agent_dir = tempfile::tempdir().unwrap();
    install(good.dir.path(), server_dir.path(), &SERVER_FILES);
    install(good.dir.path(), agent_dir.path(), &AGENT_FILES);
    let mut server = ServerProcess::start_in(server_dir.path(), "http-connect", &[]).await;
    let port = server.agent_addr.port();
    let mut agent = Agent::start(agent_dir.path(), port).await;
    server.wait_for_agents(1).await;

    // The server's key no longer matches its certificate.
    let key = server_dir.path().join("cluster.key");
    install(other.dir.path(), server_dir.path(), &["cluster.key"]);
    // The agent's CA bundle is cut in the middle of a certificate.
    let ca = agent_dir.path().join("agent-ca.crt");
    let bundle = std::fs::read(&ca).unwrap();
    std::fs::write(&ca, &bundle[..bundle.len() / 2]).unwrap();

    // A second agent with good files is still admitted, and the server
    // says once which file it could not use.
    let second_dir = tempfile::tempdir().unwrap();
    install(good.dir.path(), second_dir.path(), &AGENT_FILES);
    let _second = Agent::start(second_dir.path(), port).await;
    server.wait_for_agents(2).await;
    let failures =
        "konnectivity_rs_server_certificate_reload_failures_total{certificate=\"cluster-cert\"}";
    assert_eq!(server.metric(failures).await, 1.0);
    let logged = |p: &LoggedProcess, file: &Path| {
        p.lines()
            .iter()
            .filter(|l| l.contains("cannot be used") && l.contains(&*file.to_string_lossy()))
            .count()
    };
    assert_eq!(
        logged(&server.process, &key),
        1,
        "{:#?}",
        server.process.lines()
    );
    let echo = destination::echo().await;
    let mut io = tunnel(&server, &echo.address()).await;
    echo_round(&mut io, 1).await;

    // The running agent reconnects to a restarted server with its last
    // good CA, and says once that its CA file cannot be used.
    install(good.dir.path(), server_dir.path(), &["cluster.key"]);
    drop(io);
    server = restart(server, server_dir.path(), 2).await;
    agent.process.wait_for("cannot be used", 1, DEADLINE).await;
    assert_eq!(
        logged(&agent.process, &ca),
        1,
        "{:#?}",
        agent.process.lines()
    );
    let agent_failures =
        "konnectivity_rs_agent_certificate_reload_failures_total{certificate=\"ca-cert\"}";
    assert_eq!(metric_value(&agent.metrics().await, agent_failures), 1.0);
    assert_eq!(
        server.metric(failures).await,
        0.0,
        "a fresh server counts afresh"
    );

    // Whole files again: taken without a complaint.
    install(good.dir.path(), agent_dir.path(), &["agent-ca.crt"]);
    let _server = restart(server, server_dir.path(), 2).await;
    agent
        .process
        .wait_for("TLS files changed; new handshakes use them", 1, DEADLINE)
        .await;
    assert_eq!(metric_value(&agent.metrics().await, agent_failures), 1.0);
}

/// The mTLS frontend follows its files too: after a rotation of its
/// certificate and client CA, a client of the new PKI is served by the
/// running server, and a tunnel opened before keeps flowing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mtls_frontend_rotates_without_a_restart() {
    const FRONTEND_FILES: [&str; 3] = [
        "proxy-frontend.crt",
        "proxy-frontend.key",
        "frontend-ca.crt",
    ];
    let (old, new) = (Pki::fresh(), Pki::fresh());
    let dir = tempfile::tempdir().unwrap();
    install(old.dir.path(), dir.path(), &SERVER_FILES);
    install(old.dir.path(), dir.path(), &FRONTEND_FILES);
    let file = |name: &str| dir.path().join(name).display().to_string();
    let server = ServerProcess::start_in(
        dir.path(),
        "http-connect",
        &[
            "--uds-name=".to_owned(),
            "--server-bind-address=127.0.0.1".to_owned(),
            format!("--server-cert={}", file("proxy-frontend.crt")),
            format!("--server-key={}", file("proxy-frontend.key")),
            format!("--server-ca-cert={}", file("frontend-ca.crt")),
        ],
    )
    .await;
    let mut log = server.process.lines().join("\n");
    let frontend_port = loop {
        if let Some(port) = log
            .split("frontend.addr=Some(127.0.0.1:")
            .nth(1)
            .and_then(|rest| rest.split(')').next())
            .and_then(|p| p.parse::<u16>().ok())
        {
            break port;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        log = server.process.lines().join("\n");
    };
    let agent_dir = tempfile::tempdir().unwrap();
    install(old.dir.path(), agent_dir.path(), &AGENT_FILES);
    let _agent = Agent::start(agent_dir.path(), server.agent_addr.port()).await;
    server.wait_for_agents(1).await;
    let echo = destination::echo().await;

    let client = |pki: &Path| -> tokio_rustls::TlsConnector {
        let config = ops::tls::client_config(
            &pki.join("frontend-ca.crt"),
            Some((&pki.join("proxy-client.crt"), &pki.join("proxy-client.key"))),
            &[],
        )
        .unwrap();
        let mut config = (*config).clone();
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        tokio_rustls::TlsConnector::from(std::sync::Arc::new(config))
    };
    let open = |pki: PathBuf| {
        let echo = echo.address();
        let connector = client(&pki);
        async move {
            let tcp = TcpStream::connect(("127.0.0.1", frontend_port))
                .await
                .unwrap();
            let name = rustls_pki_types::ServerName::try_from("localhost").unwrap();
            let mut io = connector.connect(name, tcp).await?;
            connect(&mut io, &echo).await?;
            Ok::<_, std::io::Error>(io)
        }
    };
    let mut before = open(old.dir.path().to_owned()).await.unwrap();
    echo_round(&mut before, 1).await;

    install(new.dir.path(), dir.path(), &FRONTEND_FILES);
    let mut after = open(new.dir.path().to_owned())
        .await
        .expect("a client of the new PKI");
    echo_round(&mut after, 2).await;
    echo_round(&mut before, 3).await;
    // A client of the old PKI is now refused: the old CA is gone.
    assert!(
        open(old.dir.path().to_owned()).await.is_err(),
        "a client of the old CA was served"
    );
    // curl, a client we did not write, with the new PKI's files.
    let web = destination::http(b"answered after the rotation\n").await;
    let out = dir.path().join("curl-body");
    let curl = curl_through(frontend_port, new.dir.path(), &web.address(), &out).await;
    assert!(
        curl.status.success(),
        "curl failed: {}",
        String::from_utf8_lossy(&curl.stderr)
    );
    assert_eq!(
        std::fs::read(&out).unwrap(),
        b"answered after the rotation\n"
    );
    let metrics = server.metrics().await;
    let series = expiry(
        "konnectivity_rs_server",
        "server-cert",
        &dir.path().join("proxy-frontend.crt"),
    );
    assert!(required(&metrics, &series) > 4.0e9);
}
