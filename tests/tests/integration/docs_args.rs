//! The args of the Konnectivity manifests in the Kubernetes documentation
//! ("Set up Konnectivity service": the server static Pod and the agent
//! DaemonSet, as in ANP's examples) parse into the expected configuration.
//! Only the file paths are moved to a temporary directory, because
//! validation opens them.

#![allow(clippy::unwrap_used)] // tests: a panic is a failure report

use std::path::Path;

use clap::Parser;

/// The server's `args`, verbatim from the docs page, with `{dir}` for the
/// directories of the files it names.
const SERVER: &[&str] = &[
    "--logtostderr=true",
    "--uds-name={dir}/konnectivity-server.socket",
    "--delete-existing-uds-file",
    "--cluster-cert={dir}/apiserver.crt",
    "--cluster-key={dir}/apiserver.key",
    "--mode=grpc",
    "--server-port=0",
    "--agent-port=8132",
    "--admin-port=8133",
    "--health-port=8134",
    "--agent-namespace=kube-system",
    "--agent-service-account=konnectivity-agent",
    "--kubeconfig={dir}/konnectivity-server.conf",
    "--authentication-audience=system:konnectivity-server",
];

/// The agent's `args`, verbatim from the docs page (its example IP).
const AGENT: &[&str] = &[
    "--logtostderr=true",
    "--ca-cert={dir}/ca.crt",
    "--proxy-server-host=35.225.206.7",
    "--proxy-server-port=8132",
    "--admin-server-port=8133",
    "--health-server-port=8134",
    "--service-account-token-path={dir}/konnectivity-agent-token",
];

fn argv(binary: &str, args: &[&str], dir: &Path) -> Vec<String> {
    std::iter::once(binary.to_owned())
        .chain(
            args.iter()
                .map(|a| a.replace("{dir}", &dir.display().to_string())),
        )
        .collect()
}

/// The files the manifests name: certificates from `make-certs`, a
/// kubeconfig and a token.
fn files() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    certs::ClusterPki::generate(&[])
        .unwrap()
        .write_to(dir.path())
        .unwrap();
    let p = |name: &str| dir.path().join(name);
    std::fs::copy(p("cluster.crt"), p("apiserver.crt")).unwrap();
    std::fs::copy(p("cluster.key"), p("apiserver.key")).unwrap();
    std::fs::copy(p("agent-ca.crt"), p("ca.crt")).unwrap();
    std::fs::write(
        p("konnectivity-server.conf"),
        "apiVersion: v1\nkind: Config\nclusters: []\nusers: []\ncontexts: []\n",
    )
    .unwrap();
    std::fs::write(p("konnectivity-agent-token"), "token").unwrap();
    dir
}

#[test]
fn the_docs_server_args_parse_into_the_expected_configuration() {
    use proxy_server::config::{Args, Config, FrontendListen, Mode};
    let dir = files();
    let args = Args::try_parse_from(argv("proxy-server", SERVER, dir.path())).unwrap();
    assert!(args.log.logtostderr);
    let config = Config::try_from(args).unwrap();
    assert_eq!(config.mode, Mode::Grpc);
    match &config.frontend {
        FrontendListen::Uds {
            path,
            delete_existing,
        } => {
            assert_eq!(path, &dir.path().join("konnectivity-server.socket"));
            assert!(delete_existing);
        }
        FrontendListen::Tcp { .. } => panic!("the docs use a Unix socket"),
    }
    assert_eq!(config.agent_addr.port(), 8132);
    assert!(config.agent_addr.ip().is_unspecified());
    assert_eq!(config.admin_addr.to_string(), "127.0.0.1:8133");
    assert_eq!(config.health_addr.port(), 8134);
    let auth = config.token_auth.expect("token auth is on");
    assert_eq!(auth.namespace, "kube-system");
    assert_eq!(auth.service_account, "konnectivity-agent");
    assert_eq!(auth.audience, "system:konnectivity-server");
    assert_eq!(
        auth.kubeconfig.as_deref(),
        Some(dir.path().join("konnectivity-server.conf").as_path())
    );
    assert_eq!(config.server_count, 1);
    assert!(config.lease.is_none());
    assert!(
        config.not_implemented.is_empty(),
        "{:?}",
        config.not_implemented
    );
}

#[test]
fn the_docs_agent_args_parse_into_the_expected_configuration() {
    use proxy_agent::config::{Args, Config, ServerAddr};
    let dir = files();
    let args = Args::try_parse_from(argv("proxy-agent", AGENT, dir.path())).unwrap();
    assert!(args.log.logtostderr);
    let config = Config::try_from(args).unwrap();
    assert_eq!(config.servers, [ServerAddr::new("35.225.206.7", 8132)]);
    assert_eq!(config.admin_addr.to_string(), "127.0.0.1:8133");
    assert_eq!(config.health_addr.port(), 8134);
    assert!(config.health_addr.ip().is_unspecified());
    assert_eq!(
        config.token_path.as_deref(),
        Some(dir.path().join("konnectivity-agent-token").as_path())
    );
    assert!(config.leases.is_none());
    assert!(
        config.not_implemented.is_empty(),
        "{:?}",
        config.not_implemented
    );
}
