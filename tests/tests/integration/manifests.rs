//! Drift test for `deploy/*.yaml` (house style 3.8): every `args:` list of a
//! proxy-server or proxy-agent container must parse with that binary's
//! `Args`, carry the documented values, and validate into a `Config` once its
//! certificate paths point at real files, so the manifests cannot rot.
//!
//! No YAML crate: a small line-based reader takes the `args:` list (block
//! `- "--flag=value"` items or a `[ ... ]` flow sequence) and decides which
//! binary it belongs to from the same container's `image:` or `command:`.

#![allow(clippy::unwrap_used)] // tests: a panic is a failure report

use std::{
    fs,
    path::{Path, PathBuf},
};

use clap::Parser;
use integration_tests::{Binary, deploy};

/// One proxy container found in a manifest.
#[derive(Debug, Clone)]
struct Container {
    /// File name inside `deploy/`.
    file: String,
    /// Which binary it runs.
    binary: Binary,
    /// Its `args:`, unquoted.
    args: Vec<String>,
}

impl Container {
    /// `argv`: the binary name followed by the manifest's args.
    fn argv(&self) -> Vec<String> {
        std::iter::once(self.binary.name().to_owned())
            .chain(self.args.iter().cloned())
            .collect()
    }

    fn server_args(&self) -> proxy_server::config::Args {
        assert_eq!(self.binary, Binary::Server, "{}", self.file);
        proxy_server::config::Args::try_parse_from(self.argv()).unwrap_or_else(|e| {
            panic!(
                "deploy/{}: proxy-server rejects its args {:?}:\n{e}",
                self.file, self.args
            )
        })
    }

    fn agent_args(&self) -> proxy_agent::config::Args {
        assert_eq!(self.binary, Binary::Agent, "{}", self.file);
        proxy_agent::config::Args::try_parse_from(self.argv()).unwrap_or_else(|e| {
            panic!(
                "deploy/{}: proxy-agent rejects its args {:?}:\n{e}",
                self.file, self.args
            )
        })
    }
}

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

/// Indentation of a line, in spaces.
fn indent(line: &str) -> usize {
    line.len() - line.trim_start().len()
}

/// Skipped by the args reader: blank lines and comments.
fn is_filler(line: &str) -> bool {
    let t = line.trim();
    t.is_empty() || t.starts_with('#')
}

/// Unquotes one YAML scalar (`"x"`, `'x'` or bare `x`), dropping a trailing
/// comment.
fn scalar(text: &str) -> String {
    let text = text.trim();
    for quote in ['"', '\''] {
        if let Some(rest) = text.strip_prefix(quote) {
            let end = rest
                .find(quote)
                .unwrap_or_else(|| panic!("unterminated quote in {text:?}"));
            let value = &rest[..end];
            assert!(
                !value.contains('\\'),
                "escapes are not supported here: {text:?}"
            );
            return value.to_owned();
        }
    }
    text.split(" #").next().unwrap_or(text).trim().to_owned()
}

/// Reads a flow sequence starting at `text` (just after `args:`): items
/// separated by commas outside quotes, up to the `]` outside quotes, with
/// `#` comments skipped.
fn flow_items(text: &str) -> Vec<String> {
    let text = text
        .trim_start()
        .strip_prefix('[')
        .expect("a flow sequence starts with [");
    let mut items = Vec::new();
    let mut current = String::new();
    let mut quote = None;
    let mut comment = false;
    let mut previous = ' ';
    for c in text.chars() {
        match (quote, c) {
            (_, '\n') => comment = false,
            _ if comment => {}
            (None, '#') if previous.is_whitespace() => comment = true,
            (None, '"' | '\'') => {
                quote = Some(c);
                current.push(c);
            }
            (Some(q), _) if c == q => {
                quote = None;
                current.push(c);
            }
            (None, ',') => items.push(std::mem::take(&mut current)),
            (None, ']') => {
                items.push(std::mem::take(&mut current));
                return items
                    .iter()
                    .filter(|item| !item.trim().is_empty())
                    .map(|item| scalar(item))
                    .collect();
            }
            _ => current.push(c),
        }
        previous = c;
    }
    panic!("unterminated flow sequence: {text:?}");
}

/// Reads the `args:` value starting at `lines[at]`; returns the items.
fn read_args(lines: &[&str], at: usize) -> Vec<String> {
    let rest = lines[at].trim().trim_start_matches("args:").trim();
    if rest.starts_with('[') {
        return flow_items(&format!("{rest}\n{}", lines[at + 1..].join("\n")));
    }
    assert!(
        rest.is_empty() || rest.starts_with('#'),
        "unsupported args form: {:?}",
        lines[at]
    );
    lines[at + 1..]
        .iter()
        .filter(|line| !is_filler(line))
        .map_while(|line| line.trim().strip_prefix("- "))
        .map(scalar)
        .collect()
}

/// The binary the container owning `lines[at]` (its `args:` line) runs, from
/// its `image:` or `command:`: the container's other keys sit at the same
/// indentation, up to the `- ` line that starts the container.
fn container_binary(lines: &[&str], at: usize) -> Option<Binary> {
    let key_indent = indent(lines[at]);
    let mentions = |line: &str| {
        let key = line.trim().trim_start_matches("- ");
        let hint = key.starts_with("image:") || key.starts_with("command:");
        [Binary::Server, Binary::Agent]
            .into_iter()
            .find(|b| hint && key.contains(b.name()))
    };
    let mut found = None;
    for line in lines[..at].iter().rev().filter(|l| !is_filler(l)) {
        if indent(line) < key_indent {
            // The `- name:`/`- image:` line opening this container.
            found = found.or_else(|| mentions(line));
            break;
        }
        if indent(line) == key_indent {
            found = found.or_else(|| mentions(line));
        }
    }
    for line in lines[at + 1..].iter().filter(|l| !is_filler(l)) {
        if indent(line) < key_indent {
            break;
        }
        if indent(line) == key_indent {
            found = found.or_else(|| mentions(line));
        }
    }
    found
}

/// Every proxy-server and proxy-agent container in `deploy/*.yaml`.
fn containers() -> Vec<Container> {
    let mut files: Vec<PathBuf> = fs::read_dir(deploy_dir())
        .expect("deploy/ exists")
        .map(|entry| entry.expect("readable deploy/ entry").path())
        .filter(|path| {
            path.extension()
                .is_some_and(|ext| ext == "yaml" || ext == "yml")
        })
        .collect();
    files.sort();
    let mut found = Vec::new();
    for path in files {
        let text = fs::read_to_string(&path).expect("readable manifest");
        let file = path
            .file_name()
            .expect("file name")
            .to_string_lossy()
            .into_owned();
        let lines: Vec<&str> = text.lines().collect();
        for (at, line) in lines.iter().enumerate() {
            if !line.trim_start().starts_with("args:") {
                continue;
            }
            if let Some(binary) = container_binary(&lines, at) {
                found.push(Container {
                    file: file.clone(),
                    binary,
                    args: read_args(&lines, at),
                });
            }
        }
    }
    found
}

fn of(binary: Binary) -> Vec<Container> {
    containers()
        .into_iter()
        .filter(|c| c.binary == binary)
        .collect()
}

fn in_file(file: &str) -> Container {
    let mut matching: Vec<Container> = containers()
        .into_iter()
        .filter(|c| c.file == file)
        .collect();
    assert_eq!(
        matching.len(),
        1,
        "deploy/{file}: want exactly one proxy container"
    );
    matching.remove(0)
}

const UDS: &str = "/etc/kubernetes/konnectivity-server/konnectivity-server.socket";

#[test]
fn the_line_reader_handles_block_and_flow_args() {
    let block = [
        "  - name: c",
        "    image: konnectivity-rs/proxy-agent:v1",
        "    args:",
        "    # comment",
        "    - \"--a=1\"",
        "",
        "    - '--b=x,y'",
        "    - --c # trailing",
        "    livenessProbe:",
    ];
    assert_eq!(container_binary(&block, 2), Some(Binary::Agent));
    assert_eq!(read_args(&block, 2), ["--a=1", "--b=x,y", "--c"]);

    let flow = [
        "  - command: [\"/proxy-server\"]",
        "    args: [",
        "            \"--a=1\",",
        "            # comment, with a comma",
        "            \"--b=x,y\", # trailing ] comment",
        "            \"--alpn-proto=[]\"",
        "            ]",
    ];
    assert_eq!(container_binary(&flow, 1), Some(Binary::Server));
    assert_eq!(read_args(&flow, 1), ["--a=1", "--b=x,y", "--alpn-proto=[]"]);
    let inline = ["- image: other", "  args: [\"--x\", '--y']"];
    assert_eq!(container_binary(&inline, 1), None);
    assert_eq!(read_args(&inline, 1), ["--x", "--y"]);
}

#[test]
fn every_manifest_args_list_parses() {
    let all = containers();
    let servers = all.iter().filter(|c| c.binary == Binary::Server).count();
    let agents = all.iter().filter(|c| c.binary == Binary::Agent).count();
    assert!(
        servers >= 2,
        "found {servers} proxy-server manifests in deploy/: {all:#?}"
    );
    assert!(
        agents >= 2,
        "found {agents} proxy-agent manifests in deploy/: {all:#?}"
    );
    for c in &all {
        assert!(!c.args.is_empty(), "deploy/{}: empty args", c.file);
        for arg in &c.args {
            assert!(
                arg.starts_with("--"),
                "deploy/{}: {arg:?} is not a --flag",
                c.file
            );
            assert!(
                !arg.contains("$("),
                "deploy/{}: {arg:?}: keep $(VAR) references out of args",
                c.file
            );
        }
        match c.binary {
            Binary::Server => {
                let args = c.server_args();
                assert!(args.log.logtostderr, "{}", c.file);
                assert_eq!(args.mode, proxy_server::config::Mode::Grpc, "{}", c.file);
                assert_eq!(text(&args.uds_name), UDS, "{}", c.file);
                assert!(args.delete_existing_uds_file, "{}", c.file);
                assert_eq!(args.server_port, 0, "{}", c.file);
                assert_eq!(args.agent_port, 8132, "{}", c.file);
                assert_eq!(args.admin_port, 8133, "{}", c.file);
                assert_eq!(args.health_port, 8134, "{}", c.file);
            }
            Binary::Agent => {
                let args = c.agent_args();
                assert!(args.log.logtostderr, "{}", c.file);
                assert_eq!(
                    args.proxy_server_host, "konnectivity.example.internal",
                    "{}",
                    c.file
                );
                assert_eq!(args.proxy_server_port, 8132, "{}", c.file);
                assert_eq!(args.admin_server_port, 8133, "{}", c.file);
                assert_eq!(args.health_server_port, 8134, "{}", c.file);
            }
        }
    }
}

/// A path flag as the manifest wrote it ("" when absent).
fn text(path: &Option<std::path::PathBuf>) -> String {
    path.as_ref()
        .map(|p| p.display().to_string())
        .unwrap_or_default()
}

#[test]
fn server_manifests_carry_their_agent_authentication() {
    let mtls = in_file("konnectivity-server.yaml").server_args();
    assert_eq!(
        text(&mtls.cluster_cert),
        "/etc/kubernetes/pki/konnectivity/cluster.crt"
    );
    assert_eq!(
        text(&mtls.cluster_key),
        "/etc/kubernetes/pki/konnectivity/cluster.key"
    );
    assert_eq!(
        text(&mtls.cluster_ca_cert),
        "/etc/kubernetes/pki/konnectivity/agent-ca.crt"
    );
    assert_eq!(mtls.agent_namespace, "");
    assert_eq!(mtls.agent_service_account, "");
    assert_eq!(mtls.authentication_audience, "");
    assert_eq!(text(&mtls.kubeconfig), "");

    let token = in_file("konnectivity-server-token-auth.yaml").server_args();
    assert_eq!(
        text(&token.cluster_ca_cert),
        "",
        "token auth forbids --cluster-ca-cert"
    );
    assert_eq!(token.agent_namespace, "kube-system");
    assert_eq!(token.agent_service_account, "konnectivity-agent");
    assert_eq!(token.authentication_audience, "system:konnectivity-server");
    assert_eq!(
        text(&token.kubeconfig),
        "/etc/kubernetes/konnectivity-server.conf"
    );
    assert!(!text(&token.cluster_cert).is_empty() && !text(&token.cluster_key).is_empty());
}

/// The token-auth server's user may create TokenReviews and read the
/// cluster's signing keys (`GET /openid/v1/jwks`): each a binding of a
/// built-in ClusterRole to user `system:konnectivity-server` in rbac.yaml.
#[test]
fn the_server_user_may_review_tokens_and_read_the_signing_keys() {
    let rbac = std::fs::read_to_string(deploy_dir().join("rbac.yaml")).unwrap();
    let bound = |role: &str| {
        rbac.split("\n---\n").any(|document| {
            document.contains("kind: ClusterRoleBinding")
                && document.contains(&format!("  kind: ClusterRole\n  name: {role}\n"))
                && document.contains("  kind: User\n  name: system:konnectivity-server")
        })
    };
    assert!(bound("system:auth-delegator"), "TokenReviews");
    assert!(
        bound("system:service-account-issuer-discovery"),
        "the signing keys"
    );
}

#[test]
fn agent_manifests_carry_their_authentication() {
    let mtls = in_file("konnectivity-agent.yaml").agent_args();
    assert_eq!(text(&mtls.ca_cert), "/etc/konnectivity/agent-ca.crt");
    assert_eq!(text(&mtls.agent_cert), "/etc/konnectivity/proxy-agent.crt");
    assert_eq!(text(&mtls.agent_key), "/etc/konnectivity/proxy-agent.key");
    assert_eq!(text(&mtls.service_account_token_path), "");

    let token = in_file("konnectivity-agent-token-auth.yaml").agent_args();
    assert_eq!(
        text(&token.ca_cert),
        "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"
    );
    assert_eq!(
        text(&token.service_account_token_path),
        "/var/run/secrets/tokens/konnectivity-agent-token"
    );
    assert_eq!(text(&token.agent_cert), "");
    assert_eq!(text(&token.agent_key), "");
}

#[test]
fn mtls_server_manifest_fails_only_on_missing_cert_files() {
    let args = in_file("konnectivity-server.yaml").server_args();
    let dir = "/etc/kubernetes/pki/konnectivity/";
    if Path::new(dir).exists() {
        // A node with real certificates: the validation below covers it.
        return;
    }
    let config = proxy_server::config::Config::try_from(args)
        .expect("the flags are valid; the files are read after them");
    let err = config
        .load_tls()
        .expect_err("no certificates on this machine");
    let text = ops::error::DisplayErrorStack(&err).to_string();
    assert!(
        matches!(err, proxy_server::config::ConfigError::Tls { .. }),
        "want a TLS file error, got: {text}"
    );
    assert!(text.contains("--cluster-") && text.contains(dir), "{text}");
}

/// File `make-certs` writes for a certificate flag, or `None` for other flags.
fn cert_file(binary: Binary, flag: &str) -> Option<&'static str> {
    Some(match (binary, flag) {
        (Binary::Server, "cluster-cert") => "cluster.crt",
        (Binary::Server, "cluster-key") => "cluster.key",
        (Binary::Server, "cluster-ca-cert") => "agent-ca.crt",
        (Binary::Server, "server-cert") => "proxy-frontend.crt",
        (Binary::Server, "server-key") => "proxy-frontend.key",
        (Binary::Server, "server-ca-cert") => "frontend-ca.crt",
        (Binary::Agent, "ca-cert") => "agent-ca.crt",
        (Binary::Agent, "agent-cert") => "proxy-agent.crt",
        (Binary::Agent, "agent-key") => "proxy-agent.key",
        (Binary::Agent, "service-account-token-path") => "token",
        (Binary::Server, "kubeconfig") => "kubeconfig",
        (Binary::Agent, "destination-policy-file") => "policy",
        _ => return None,
    })
}

#[test]
fn every_manifest_validates_with_real_certificates() {
    let dir = tempfile::tempdir().expect("temp dir");
    certs::ClusterPki::generate(&["konnectivity.example.internal".to_owned()])
        .expect("certificates")
        .write_to(dir.path())
        .expect("written");
    fs::write(dir.path().join("token"), "not-a-real-token").expect("token file");
    fs::write(
        dir.path().join("kubeconfig"),
        "apiVersion: v1\nkind: Config\n",
    )
    .expect("kubeconfig");
    fs::write(dir.path().join("policy"), deploy::recommended_policy()).expect("policy");

    for mut c in containers() {
        for arg in &mut c.args {
            let Some((flag, _)) = arg.trim_start_matches("--").split_once('=') else {
                continue;
            };
            if let Some(file) = cert_file(c.binary, flag) {
                *arg = format!("--{flag}={}", dir.path().join(file).display());
            }
        }
        let mtls = !c.file.contains("token-auth");
        match c.binary {
            Binary::Server => {
                let config = proxy_server::config::Config::try_from(c.server_args())
                    .unwrap_or_else(|e| panic!("deploy/{}: {e}", c.file));
                config
                    .load_tls()
                    .unwrap_or_else(|e| panic!("deploy/{}: {e}", c.file));
                assert!(
                    matches!(
                        config.frontend,
                        proxy_server::config::FrontendListen::Uds { .. }
                    ),
                    "{}",
                    c.file
                );
                assert_eq!(config.agent_addr.port(), 8132, "{}", c.file);
                assert_eq!(config.token_auth.is_some(), !mtls, "{}", c.file);
                if mtls {
                    assert!(
                        config.not_implemented.is_empty(),
                        "deploy/{}: {:?}",
                        c.file,
                        config.not_implemented
                    );
                }
            }
            Binary::Agent => {
                let config = proxy_agent::config::Config::try_from(c.agent_args())
                    .unwrap_or_else(|e| panic!("deploy/{}: {e}", c.file));
                config
                    .tls
                    .load()
                    .unwrap_or_else(|e| panic!("deploy/{}: {e}", c.file));
                assert_eq!(
                    config.servers,
                    [proxy_agent::config::ServerAddr::new(
                        "konnectivity.example.internal",
                        8132
                    )],
                    "{}",
                    c.file
                );
                assert_eq!(config.health_addr.port(), 8134, "{}", c.file);
                assert_eq!(
                    config.destination_policy,
                    Some(dir.path().join("policy")),
                    "{}",
                    c.file
                );
                if mtls {
                    assert!(
                        config.not_implemented.is_empty(),
                        "deploy/{}: {:?}",
                        c.file,
                        config.not_implemented
                    );
                }
            }
        }
    }
}

#[test]
fn server_and_agent_manifests_agree() {
    for server in of(Binary::Server) {
        let agent_file = server
            .file
            .replace("konnectivity-server", "konnectivity-agent");
        let server = server.server_args();
        let agent = in_file(&agent_file).agent_args();
        assert_eq!(agent.proxy_server_port, server.agent_port, "{agent_file}");
    }
    for agent in of(Binary::Agent) {
        assert!(
            deploy_dir()
                .join(
                    agent
                        .file
                        .replace("konnectivity-agent", "konnectivity-server")
                )
                .is_file(),
            "deploy/{}: no matching server manifest",
            agent.file
        );
    }
    let egress = fs::read_to_string(deploy_dir().join("egress-selector-configuration.yaml"))
        .expect("egress config");
    assert!(
        egress.contains(&format!("udsName: {UDS}")),
        "egress selector and --uds-name differ"
    );
    assert!(egress.contains("proxyProtocol: GRPC"));
}

/// The Kubernetes minor versions the manifests must be valid for: the three
/// upstream supports (1.35–1.37 as this is written) and the two before them,
/// which providers still run under extended support.
const KUBERNETES_VERSIONS: [&str; 5] = ["1.33", "1.34", "1.35", "1.36", "1.37"];

/// The files in `deploy/` that hold Kubernetes API objects. The egress
/// selector configurations are kube-apiserver's own config files, with no
/// OpenAPI schema; the tests above read them.
fn api_manifests() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = fs::read_dir(deploy_dir())
        .expect("deploy/")
        .map(|e| e.expect("deploy/ entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .filter(|p| {
            !p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("egress-selector-"))
        })
        .collect();
    files.sort();
    files
}

/// Runs `kubernetes-validate --strict` (Kubernetes' own OpenAPI schemas,
/// offline, unknown fields refused) on `files` for `version`; its output and
/// whether every document validated.
fn validate(version: &str, files: &[PathBuf]) -> (bool, String) {
    let out = std::process::Command::new(integration_tests::python::script("kubernetes-validate"))
        .args(["--strict", "--kubernetes-version", version])
        .args(files)
        .output()
        .expect("running kubernetes-validate");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // A kind without a schema is only a warning to the tool: not to us.
    let ok = out.status.success() && !text.contains("Couldn't find schema");
    (ok, text)
}

#[test]
fn every_manifest_is_valid_for_each_supported_kubernetes_version_strictly() {
    let files = api_manifests();
    let names: Vec<_> = files
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    for needed in [
        "konnectivity-agent.yaml",
        "konnectivity-server.yaml",
        "rbac.yaml",
    ] {
        assert!(names.iter().any(|n| n == needed), "{needed} in {names:?}");
    }
    for version in KUBERNETES_VERSIONS {
        let (ok, text) = validate(version, &files);
        assert!(ok, "Kubernetes {version}:\n{text}");
    }
    // Strict really is strict: a field the schema does not know is refused.
    let dir = tempfile::tempdir().unwrap();
    let agent = fs::read_to_string(deploy_dir().join("konnectivity-agent.yaml")).unwrap();
    let bad = agent.replacen(
        "\n      containers:",
        "\n      unknownField: true\n      containers:",
        1,
    );
    assert_ne!(bad, agent, "the agent DaemonSet's pod spec has containers");
    let bad_file = dir.path().join("bad.yaml");
    fs::write(&bad_file, bad).unwrap();
    let (ok, text) = validate("1.36", &[bad_file]);
    assert!(!ok, "an unknown field passed:\n{text}");
    assert!(text.contains("unknownField"), "{text}");
}

/// The rollout the agent DaemonSets promise (docs/operations.md, "Agent retries and DaemonSet
/// rollouts"): a surge, no unavailable node, and agents that leave once drained.
#[test]
fn agent_daemonsets_roll_over_without_a_gap() {
    for file in [
        "konnectivity-agent.yaml",
        "konnectivity-agent-token-auth.yaml",
    ] {
        let text = fs::read_to_string(deploy_dir().join(file)).unwrap();
        for line in ["maxSurge: 10%", "maxUnavailable: 0", "type: RollingUpdate"] {
            assert!(text.contains(line), "deploy/{file}: no {line:?}");
        }
        assert!(
            !text.contains("hostPort:"),
            "deploy/{file}: a hostPort forbids the surge"
        );
        assert!(
            in_file(file).agent_args().exit_when_drained,
            "deploy/{file}"
        );
    }
}

/// Both agent DaemonSets mount the recommended policy's ConfigMap and give
/// it with `--destination-policy-file`; its text is a policy the agent
/// accepts, refusing what the issue asks (metadata, loopback, link-local)
/// in every family, naming the rule, and allowing the rest.
#[test]
fn agent_manifests_use_the_recommended_policy() {
    for file in [
        "konnectivity-agent.yaml",
        "konnectivity-agent-token-auth.yaml",
    ] {
        assert_eq!(
            text(&in_file(file).agent_args().destination_policy_file),
            deploy::POLICY_PATH,
            "deploy/{file}"
        );
        let manifest = fs::read_to_string(deploy_dir().join(file)).unwrap();
        for line in [
            "- name: konnectivity-agent-policy\n          mountPath: /etc/konnectivity-policy\n",
            "configMap:\n          name: konnectivity-agent-policy\n",
        ] {
            assert!(manifest.contains(line), "deploy/{file}: no {line:?}");
        }
    }
    let configmap = fs::read_to_string(deploy_dir().join(deploy::POLICY_MANIFEST)).unwrap();
    assert!(configmap.contains("kind: ConfigMap\n") && configmap.contains("  policy: |\n"));
    let text = deploy::recommended_policy();
    let policy = proxy_agent::policy::Policy::parse(&text, Vec::new())
        .unwrap_or_else(|e| panic!("deploy/{}: {e}\n{text}", deploy::POLICY_MANIFEST));
    use proxy_agent::policy::Decision;
    for (addr, port, want) in [
        ("169.254.169.254", 80, Some("deny metadata")),
        ("fd00:ec2::254", 80, Some("deny metadata")),
        ("100.100.100.200", 80, Some("deny metadata")),
        ("127.0.0.1", 10248, Some("deny loopback")),
        ("127.3.4.5", 443, Some("deny loopback")),
        ("::1", 443, Some("deny loopback")),
        ("::ffff:127.0.0.1", 443, Some("deny loopback")),
        ("169.254.20.10", 53, Some("deny link-local")),
        ("fe80::1", 10250, Some("deny link-local")),
        ("10.20.3.4", 10250, None),
        ("10.244.1.7", 8443, None),
        ("fd12::7", 443, None),
        ("203.0.113.9", 443, None),
    ] {
        let verdict = policy.check(None, addr.parse().unwrap(), port);
        match want {
            Some(rule) => assert_eq!(verdict, Decision::Denied(rule.into()), "{addr}"),
            None => assert_eq!(verdict, Decision::Allowed(None), "{addr}"),
        }
    }
}

/// The mTLS agent manifest's own arguments, run by the real binary against
/// a test server: its files (the policy: the ConfigMap's text, as shipped),
/// server address and ports replaced by the test's, everything else as the
/// manifest has it.
pub(crate) fn manifest_agent(
    server: &integration_tests::TestServer,
) -> integration_tests::LoggedProcess {
    let pki = integration_tests::Pki::get();
    let local = [
        ("--ca-cert", pki.path("agent-ca.crt").display().to_string()),
        (
            "--agent-cert",
            pki.path("proxy-agent.crt").display().to_string(),
        ),
        (
            "--agent-key",
            pki.path("proxy-agent.key").display().to_string(),
        ),
        ("--proxy-server-host", "127.0.0.1".to_owned()),
        ("--proxy-server-port", server.agent_addr.port().to_string()),
        ("--admin-server-port", "0".to_owned()),
        ("--health-server-port", "0".to_owned()),
        (
            "--destination-policy-file",
            deploy::recommended_policy_file().display().to_string(),
        ),
    ];
    let mut args: Vec<String> = in_file("konnectivity-agent.yaml")
        .args
        .into_iter()
        .filter(|arg| {
            !local
                .iter()
                .any(|(flag, _)| arg.starts_with(&format!("{flag}=")))
        })
        .collect();
    args.extend(local.iter().map(|(flag, value)| format!("{flag}={value}")));
    args.push("--health-server-host=127.0.0.1".to_owned());
    let mut command = std::process::Command::new(integration_tests::binary("proxy-agent"));
    command.env("RUST_LOG", "info").args(args);
    integration_tests::LoggedProcess::spawn(command, "proxy-agent")
}

/// SIGTERM to an idle agent run with the manifest's arguments: it exits at
/// once, not at the end of its grace period.
#[tokio::test]
async fn the_manifest_agent_exits_at_once_when_idle() {
    let server = integration_tests::TestServer::start().await;
    let mut agent = manifest_agent(&server);
    server.wait_for_backends(1).await;
    agent.signal("TERM");
    agent
        .wait_for(
            "drained: no open connections left",
            1,
            std::time::Duration::from_secs(5),
        )
        .await;
    integration_tests::wait_for("the agent to exit", || agent.has_exited()).await;
}

/// SIGTERM to an agent with an open tunnel: it keeps carrying it, and exits
/// once it ends. The destination is on the hub's veth, not loopback, which
/// the manifest's policy refuses (as on a node, where the kubelet and pods
/// are not on the agent's loopback).
#[test]
fn the_manifest_agent_exits_when_its_last_tunnel_ends() {
    integration_tests::netns::run_in_hub(
        "manifests::the_manifest_agent_exits_when_its_last_tunnel_ends",
        |_node| exits_when_its_last_tunnel_ends(),
    );
}

async fn exits_when_its_last_tunnel_ends() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let server = integration_tests::TestServer::start().await;
    let mut agent = manifest_agent(&server);
    server.wait_for_backends(1).await;
    let echo = integration_tests::destination::echo_on_any(integration_tests::netns::HUB_IP).await;
    let mut conn = server.dial(&echo.address()).await.unwrap();
    agent.signal("TERM");
    agent
        .wait_for(
            "draining: telling servers",
            1,
            std::time::Duration::from_secs(5),
        )
        .await;
    // Still served after the signal, byte for byte.
    let mut back = [0u8; 6];
    for round in 0..3 {
        conn.write_all(b"after!").await.unwrap();
        conn.read_exact(&mut back).await.unwrap();
        assert_eq!(&back, b"after!", "round {round}");
    }
    assert!(!agent.has_exited(), "exited with a tunnel open");
    drop(conn);
    agent
        .wait_for(
            "drained: no open connections left",
            1,
            std::time::Duration::from_secs(10),
        )
        .await;
    integration_tests::wait_for("the agent to exit", || agent.has_exited()).await;
}
