//! The monitoring kit in `deploy/monitoring/`: the alerting rules pass
//! `promtool check rules` and their unit tests (`promtool test rules`),
//! every alert is labelled, annotated and tested both ways, the
//! PrometheusRule carries exactly the rules file's groups, the Grafana
//! dashboard is importable and its queries parse, and every metric the
//! rules and the dashboard name is one a real proxy-server or proxy-agent
//! exports once traffic has made its series appear.
//!
//! `promtool` is Debian's `prometheus` package (scripts/test installs it).
//! No YAML crate: the YAML files are read with PyYAML from the test
//! virtualenv (`tests/python/requirements.txt`, pinned) and compared as
//! JSON values.

#![allow(clippy::unwrap_used)] // tests: a panic is a failure report

use std::{
    collections::{BTreeMap, BTreeSet},
    net::SocketAddr,
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use bytes::Bytes;
use integration_tests::{
    AGENT_FILES, DEADLINE, Pki, RawFrontend, SERVER_FILES, destination, http_get, install,
    process::{AgentWithFiles, ServerProcess},
    python, trace_init, workspace,
};
use proto::{Packet, proxy_service_client::ProxyServiceClient};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const RULES: &str = "konnectivity-rules.yaml";
const RULES_TEST: &str = "konnectivity-rules.test.yaml";
const PROMETHEUS_RULE: &str = "konnectivity-prometheusrule.yaml";
const DASHBOARD: &str = "konnectivity-dashboard.json";

/// Metrics the rules and the dashboard may name that neither binary
/// exports, each with who does. Every one must be used (the list stays
/// exact).
const EXTERNAL: &[(&str, &str)] = &[("kube_node_info", "kube-state-metrics")];

/// The certificate metrics (issue 26, item 2): their families must be in
/// the expositions too.
const CERTIFICATE_METRICS: &[&str] = &[
    "konnectivity_rs_server_certificate_expiry_timestamp_seconds",
    "konnectivity_rs_server_certificate_reload_failures_total",
    "konnectivity_rs_agent_certificate_expiry_timestamp_seconds",
    "konnectivity_rs_agent_certificate_reload_failures_total",
];

fn monitoring_dir() -> PathBuf {
    workspace().join("deploy/monitoring")
}

/// Runs `promtool args`; its success and output. Panics, saying how to
/// install it, when there is no `promtool`.
fn promtool(args: &[&str]) -> (bool, String) {
    let out = Command::new("promtool")
        .args(args)
        .current_dir(monitoring_dir())
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "cannot run promtool ({e}): install Debian's `prometheus` package \
                 (apt-get install prometheus), as scripts/test does"
            )
        });
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// A YAML file as a JSON value, read by PyYAML's `safe_load`.
fn yaml(path: &Path) -> Value {
    let out = Command::new(python::interpreter())
        .args([
            "-c",
            "import json, sys, yaml; json.dump(yaml.safe_load(open(sys.argv[1])), sys.stdout)",
        ])
        .arg(path)
        .output()
        .expect("running python");
    assert!(
        out.status.success(),
        "PyYAML cannot read {}: {}",
        path.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn rules_file() -> Value {
    yaml(&monitoring_dir().join(RULES))
}

/// Every rule of a `groups:` list.
fn rules(groups: &Value) -> Vec<&Value> {
    groups
        .as_array()
        .expect("groups is a list")
        .iter()
        .flat_map(|g| g["rules"].as_array().expect("a group's rules").iter())
        .collect()
}

fn dashboard() -> Value {
    let path = monitoring_dir().join(DASHBOARD);
    let text = std::fs::read_to_string(&path).unwrap();
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every string under an `expr` key in `value`, with its JSON path.
fn exprs_in(value: &Value, path: &str, out: &mut Vec<(String, String)>) {
    match value {
        Value::Object(map) => {
            for (key, v) in map {
                let here = format!("{path}.{key}");
                match (key.as_str(), v) {
                    ("expr", Value::String(expr)) => out.push((here, expr.clone())),
                    _ => exprs_in(v, &here, out),
                }
            }
        }
        Value::Array(items) => {
            for (i, v) in items.iter().enumerate() {
                exprs_in(v, &format!("{path}[{i}]"), out);
            }
        }
        _ => {}
    }
}

/// The dashboard's queries: every panel target's `expr`, and the selector
/// of every `label_values(selector, label)` variable query.
fn dashboard_queries(dashboard: &Value) -> Vec<(String, String)> {
    let mut out = Vec::new();
    exprs_in(&dashboard["panels"], "panels", &mut out);
    for var in dashboard["templating"]["list"].as_array().unwrap() {
        if var["type"] != "query" {
            continue;
        }
        let query = var["query"]["query"]
            .as_str()
            .or_else(|| var["query"].as_str())
            .unwrap();
        let name = var["name"].as_str().unwrap();
        assert_eq!(
            var["definition"].as_str(),
            Some(query),
            "variable {name}: definition and query differ"
        );
        let args = query
            .strip_prefix("label_values(")
            .and_then(|rest| rest.strip_suffix(')'))
            .unwrap_or_else(|| panic!("variable {name}: not label_values(...): {query}"));
        if let Some((selector, _label)) = args.rsplit_once(',') {
            out.push((format!("templating.{name}"), selector.to_owned()));
        }
    }
    out
}

/// The rules' and the dashboard's queries, each with where it is.
fn all_queries() -> Vec<(String, String)> {
    let file = rules_file();
    let mut out: Vec<(String, String)> = rules(&file["groups"])
        .into_iter()
        .map(|rule| {
            let name = rule["alert"].as_str().or(rule["record"].as_str()).unwrap();
            (
                format!("{RULES}: {name}"),
                rule["expr"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    out.extend(
        dashboard_queries(&dashboard())
            .into_iter()
            .map(|(at, q)| (format!("{DASHBOARD}: {at}"), q)),
    );
    out
}

/// PromQL keywords that are not metric names.
const KEYWORDS: &[&str] = &[
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "atan2",
    "inf",
    "nan",
    "start",
    "end",
];

/// Keywords followed by a parenthesised list of label names.
const LABEL_LISTS: &[&str] = &[
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
];

/// The byte index just past the bracket that closes the one at `open`
/// (strings inside skipped).
fn past_closing(bytes: &[u8], open: usize) -> usize {
    let opener = bytes[open];
    let closer = match opener {
        b'(' => b')',
        b'[' => b']',
        _ => b'}',
    };
    let mut depth = 0;
    let mut i = open;
    while i < bytes.len() {
        match bytes[i] {
            b'"' | b'\'' | b'`' => i = past_string(bytes, i) - 1,
            b if b == opener => depth += 1,
            b if b == closer => {
                depth -= 1;
                if depth == 0 {
                    return i + 1;
                }
            }
            _ => {}
        }
        i += 1;
    }
    panic!(
        "unbalanced {} in {}",
        opener as char,
        String::from_utf8_lossy(bytes)
    )
}

/// The byte index just past the string literal that starts at `open`.
fn past_string(bytes: &[u8], open: usize) -> usize {
    let quote = bytes[open];
    let mut i = open + 1;
    while i < bytes.len() {
        match bytes[i] {
            b'\\' if quote != b'`' => i += 1,
            b if b == quote => return i + 1,
            _ => {}
        }
        i += 1;
    }
    panic!("unterminated string in {}", String::from_utf8_lossy(bytes))
}

/// The metric names a PromQL expression selects: its identifiers, less
/// label matchers (`{...}`), ranges (`[...]`), strings, label lists after
/// `by`/`on`/…, function names (followed by `(`), keywords, numbers and
/// durations, and Grafana variables (`$name`).
fn metric_names(expr: &str) -> BTreeSet<String> {
    let bytes = expr.as_bytes();
    let ident = |b: u8| b.is_ascii_alphanumeric() || b == b'_' || b == b':';
    let mut names = BTreeSet::new();
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        if b == b'"' || b == b'\'' || b == b'`' {
            i = past_string(bytes, i);
        } else if b == b'{' || b == b'[' {
            i = past_closing(bytes, i);
        } else if b == b'#' {
            i = bytes[i..]
                .iter()
                .position(|&c| c == b'\n')
                .map_or(bytes.len(), |n| i + n);
        } else if b == b'$' || b.is_ascii_digit() || b == b'.' {
            // A variable, or a number or duration (`5m`, `1e-06`, `0.1`).
            i += 1;
            while i < bytes.len() && (ident(bytes[i]) || bytes[i] == b'.') {
                i += 1;
            }
        } else if ident(b) {
            let start = i;
            while i < bytes.len() && ident(bytes[i]) {
                i += 1;
            }
            let word = &expr[start..i];
            let next = bytes[i..].iter().position(|c| !c.is_ascii_whitespace());
            // A function or an aggregation: `f(`, `sum by (..) (`.
            let after = next.map_or("", |n| &expr[i + n..]);
            let called = after.starts_with('(')
                || ["by", "without"].iter().any(|k| {
                    after
                        .strip_prefix(k)
                        .is_some_and(|r| r.starts_with(|c: char| c == '(' || c.is_whitespace()))
                });
            if called && LABEL_LISTS.contains(&word) {
                i = past_closing(bytes, i + next.unwrap());
            } else if !called && !KEYWORDS.contains(&word) {
                names.insert(word.to_owned());
            }
        } else {
            i += 1;
        }
    }
    names
}

#[test]
fn metric_names_are_read_from_promql() {
    let names = |e: &str| metric_names(e).into_iter().collect::<Vec<_>>();
    assert_eq!(
        names(
            r#"sum without (reason) (rate(a_count{reason=~"x|y", job="$job"}[$__rate_interval]))
                / on (instance) group_left () count(count by (node) (b_info))
                > 0.1 and c offset 10m or vector(0) unless d_bucket{le="+Inf"} > 1e-06"#
        ),
        ["a_count", "b_info", "c", "d_bucket"]
    );
    assert_eq!(names("time() - max(e) < 14 * 24 * 3600"), ["e"]);
    assert_eq!(
        names("histogram_quantile(0.99, sum by (le) (rate(f_bucket[5m])))"),
        ["f_bucket"]
    );
    assert_eq!(names(r#"g{a="}{[", b='"'} == bool 0"#), ["g"]);
}

#[test]
fn promtool_accepts_the_rules() {
    let (ok, text) = promtool(&["check", "rules", RULES]);
    assert!(ok, "promtool check rules {RULES}:\n{text}");
    let count = rules(&rules_file()["groups"]).len();
    assert!(
        text.contains(&format!("SUCCESS: {count} rules found")),
        "{text}"
    );
}

#[test]
fn the_rules_pass_their_unit_tests() {
    let (ok, text) = promtool(&["test", "rules", RULES_TEST]);
    assert!(ok, "promtool test rules {RULES_TEST}:\n{text}");
}

/// Every alert: a `Konnectivity…` name, a `for`, a severity, a summary and
/// a description that name the instance; and in the unit tests at least
/// one case where it fires and one where it stays silent.
#[test]
fn every_alert_is_labelled_annotated_and_tested_both_ways() {
    let file = rules_file();
    let tests = yaml(&monitoring_dir().join(RULES_TEST));
    let mut cases: BTreeMap<&str, (usize, usize)> = BTreeMap::new();
    for group in tests["tests"].as_array().unwrap() {
        for case in group["alert_rule_test"].as_array().unwrap() {
            let entry = cases
                .entry(case["alertname"].as_str().unwrap())
                .or_default();
            if case["exp_alerts"].as_array().is_some_and(|a| !a.is_empty()) {
                entry.0 += 1;
            } else {
                entry.1 += 1;
            }
        }
    }
    let mut alerts = BTreeSet::new();
    for rule in rules(&file["groups"]) {
        let name = rule["alert"]
            .as_str()
            .unwrap_or_else(|| panic!("not an alert: {rule}"));
        assert!(alerts.insert(name), "{name} twice");
        assert!(
            name.starts_with("Konnectivity") && !name.contains(['_', '-', ' ']),
            "{name}: not CamelCase with the Konnectivity prefix"
        );
        let for_ = rule["for"].as_str().unwrap_or("");
        assert!(
            for_.ends_with('m') || for_.ends_with('h'),
            "{name}: for {for_:?}"
        );
        let severity = rule["labels"]["severity"].as_str();
        assert!(
            matches!(severity, Some("critical" | "warning" | "info")),
            "{name}: severity {severity:?}"
        );
        for key in ["summary", "description"] {
            let text = rule["annotations"][key].as_str().unwrap_or("");
            assert!(
                text.contains("{{ $labels.instance }}"),
                "{name}: its {key} does not name the instance: {text:?}"
            );
        }
        let (firing, silent) = cases.get(name).copied().unwrap_or_default();
        assert!(
            firing > 0 && silent > 0,
            "{name}: {firing} firing and {silent} silent cases in {RULES_TEST}"
        );
    }
    let unknown: Vec<_> = cases.keys().filter(|n| !alerts.contains(*n)).collect();
    assert!(
        unknown.is_empty(),
        "{RULES_TEST} tests no such alerts: {unknown:?}"
    );
}

/// The JSON path of the first place where `a` and `b` differ.
fn first_difference(a: &Value, b: &Value, path: &str) -> Option<String> {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let keys: BTreeSet<_> = x.keys().chain(y.keys()).collect();
            keys.into_iter().find_map(|k| {
                first_difference(
                    x.get(k).unwrap_or(&Value::Null),
                    y.get(k).unwrap_or(&Value::Null),
                    &format!("{path}.{k}"),
                )
            })
        }
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => x
            .iter()
            .zip(y)
            .enumerate()
            .find_map(|(i, (p, q))| first_difference(p, q, &format!("{path}[{i}]"))),
        _ => (a != b).then(|| format!("{path}: {a} vs {b}")),
    }
}

#[test]
fn the_prometheus_rule_carries_exactly_the_rules_files_groups() {
    let plain = rules_file();
    let object = yaml(&monitoring_dir().join(PROMETHEUS_RULE));
    assert_eq!(object["apiVersion"], "monitoring.coreos.com/v1");
    assert_eq!(object["kind"], "PrometheusRule");
    assert!(object["metadata"]["name"].is_string(), "{object}");
    let keys: Vec<_> = plain.as_object().unwrap().keys().collect();
    assert_eq!(keys, ["groups"], "{RULES} has more than groups");
    let keys: Vec<_> = object["spec"].as_object().unwrap().keys().collect();
    assert_eq!(
        keys,
        ["groups"],
        "{PROMETHEUS_RULE} spec has more than groups"
    );
    if let Some(at) = first_difference(&plain["groups"], &object["spec"]["groups"], "groups") {
        panic!("{PROMETHEUS_RULE} spec.groups drifted from {RULES} at {at}");
    }
}

/// `expr` with Grafana's variables replaced by what Prometheus can parse:
/// `$__…` intervals by `5m`, the dashboard's own (label matchers) by `.*`.
fn without_variables(expr: &str) -> String {
    let mut out = String::new();
    let mut rest = expr;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        let after = rest[at + 1..].trim_start_matches('{');
        let len = after
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(after.len());
        out.push_str(if after.starts_with("__") { "5m" } else { ".*" });
        rest = after[len..].strip_prefix('}').unwrap_or(&after[len..]);
    }
    out.push_str(rest);
    out
}

/// Importable as is: schema 36 or later, a Prometheus `datasource`
/// variable that every panel and query uses, unique panel ids, and every
/// query parses (promtool checks them as recording rules).
#[test]
fn the_dashboard_is_importable_and_its_queries_parse() {
    let dashboard = dashboard();
    assert!(dashboard["title"].is_string() && dashboard["uid"].is_string());
    let schema = dashboard["schemaVersion"].as_u64().unwrap();
    assert!(schema >= 36, "schemaVersion {schema}");
    let vars = dashboard["templating"]["list"].as_array().unwrap();
    assert!(
        vars.iter().any(|v| v["type"] == "datasource"
            && v["name"] == "datasource"
            && v["query"] == "prometheus"),
        "no prometheus datasource variable named datasource"
    );
    // Every data source reference (panels, targets, variables) is the
    // variable, so the dashboard imports into any Grafana.
    fn sources(value: &Value, out: &mut Vec<Value>) {
        match value {
            Value::Object(map) => {
                for (k, v) in map {
                    if k == "datasource" {
                        out.push(v.clone());
                    } else {
                        sources(v, out);
                    }
                }
            }
            Value::Array(items) => items.iter().for_each(|v| sources(v, out)),
            _ => {}
        }
    }
    let mut refs = Vec::new();
    sources(&dashboard["panels"], &mut refs);
    sources(&dashboard["templating"], &mut refs);
    let wanted = serde_json::json!({"type": "prometheus", "uid": "${datasource}"});
    for r in &refs {
        assert_eq!(
            r, &wanted,
            "a data source reference that is not ${{datasource}}"
        );
    }
    let mut ids = BTreeSet::new();
    let mut targets = 0;
    for panel in dashboard["panels"].as_array().unwrap() {
        assert!(ids.insert(panel["id"].as_u64().unwrap()), "panel id twice");
        let pos = &panel["gridPos"];
        assert!(pos["w"].as_u64().unwrap() + pos["x"].as_u64().unwrap() <= 24);
        targets += panel["targets"].as_array().map_or(0, Vec::len);
    }
    assert!(targets > 20, "{targets} queries");

    let queries = dashboard_queries(&dashboard);
    let recording: Vec<Value> = queries
        .iter()
        .enumerate()
        .map(|(i, (_, q))| {
            serde_json::json!({"record": format!("dashboard:query_{i}"), "expr": without_variables(q)})
        })
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("dashboard-queries.yaml");
    // JSON is YAML.
    let groups = serde_json::json!({"groups": [{"name": "dashboard", "rules": recording}]});
    std::fs::write(&file, groups.to_string()).unwrap();
    let (ok, text) = promtool(&["check", "rules", file.to_str().unwrap()]);
    assert!(
        ok,
        "a dashboard query does not parse:\n{text}\n{queries:#?}"
    );
}

/// Families of a Prometheus text exposition: name → type.
fn families(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_once(' '))
        .map(|(name, kind)| (name.to_owned(), kind.to_owned()))
        .collect()
}

/// Whether `name` (a sample name as PromQL selects it) is in `families`:
/// a family, or a histogram's `_bucket`, `_sum` or `_count`.
fn exposes(families: &BTreeMap<String, String>, name: &str) -> bool {
    families.contains_key(name)
        || ["_bucket", "_sum", "_count"].iter().any(|suffix| {
            name.strip_suffix(suffix)
                .is_some_and(|base| families.get(base).is_some_and(|t| t == "histogram"))
        })
}

/// Which process exports `name`: the server, the agent, or both
/// (`process_*`).
fn exporters(name: &str) -> &'static [&'static str] {
    if name.starts_with("process_") {
        &["proxy-server", "proxy-agent"]
    } else if name.starts_with("konnectivity_network_proxy_server_")
        || name.starts_with("konnectivity_rs_server_")
    {
        &["proxy-server"]
    } else if name.starts_with("konnectivity_network_proxy_agent_")
        || name.starts_with("konnectivity_rs_agent_")
    {
        &["proxy-agent"]
    } else {
        panic!("{name}: neither a server nor an agent metric")
    }
}

/// The server's agent-port files and the agent's, copied from the test PKI
/// into a directory of their own, so that the test can spoil them.
/// Replaces `file` whole with `bytes` (by rename, as kubelet updates a
/// Secret volume).
fn replace(file: &Path, bytes: &[u8]) {
    let staged = file.with_extension("new");
    std::fs::write(&staged, bytes).unwrap();
    std::fs::rename(&staged, file).unwrap();
}

async fn scrape(addr: SocketAddr) -> String {
    let (status, text) = http_get(addr, "/metrics").await;
    assert_eq!(status, 200, "/metrics on {addr}: {text}");
    text
}

/// A frontend that uploads without flow control (as ANP's clients do) to a
/// destination that never reads, until the server's reader of its stream
/// waits for room: `full_receive_channels` and `blocked_seconds_total`
/// get their series. The upload ends when the returned guard drops.
async fn block_a_reader(server: &ServerProcess, stall: &destination::Stall) -> AbortOnDrop {
    let channel = client::dial::uds_channel(&server.uds).await.unwrap();
    let (RawFrontend { tx, rx: inbound }, conn) =
        RawFrontend::dial(ProxyServiceClient::new(channel), &stall.address()).await;
    let writer = tokio::spawn(async move {
        let chunk = Bytes::from(vec![0x5a; 64 * 1024]);
        while tx.send(Packet::data(conn, chunk.clone())).await.is_ok() {}
        drop(inbound);
    });
    server
        .wait_for_metric_at_least(
            "konnectivity_network_proxy_server_full_receive_channels{service_method=\"Proxy\"}",
            1.0,
            DEADLINE,
        )
        .await;
    AbortOnDrop(writer)
}

/// Aborts its task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Every metric the rules and the dashboard name is exported by the
/// process it belongs to, once a scenario has made the labelled series
/// appear: a good dial and a refused one, a reader blocked by a
/// destination that does not read, a TLS handshake dropped at
/// `--max-tls-handshakes=1`, and certificate files spoilt under both
/// running binaries (the reload failures). With `--server-count=2` the
/// agent keeps opening a second connection to the one server, so new
/// handshakes on both sides meet the spoilt files.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_the_rules_and_the_dashboard_name_is_exported() {
    trace_init();
    let queries = all_queries();
    let mut wanted: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (at, query) in &queries {
        for name in metric_names(query) {
            wanted.entry(name).or_default().push(at.clone());
        }
    }
    for (name, who) in EXTERNAL {
        assert!(
            wanted.remove(*name).is_some(),
            "{name} ({who}) is listed as external but nothing names it"
        );
    }
    let stray: Vec<_> = wanted
        .iter()
        .filter(|(name, _)| !name.starts_with("konnectivity_") && !name.starts_with("process_"))
        .collect();
    assert!(
        stray.is_empty(),
        "metrics neither binary exports and not in EXTERNAL: {stray:?}"
    );
    for name in CERTIFICATE_METRICS {
        assert!(wanted.contains_key(*name), "no rule or panel uses {name}");
    }

    let files = tempfile::tempdir().unwrap();
    let (server_dir, agent_dir) = (files.path().join("server"), files.path().join("agent"));
    install(Pki::get().dir.path(), &server_dir, &SERVER_FILES);
    install(Pki::get().dir.path(), &agent_dir, &AGENT_FILES);
    let server = ServerProcess::start_in(
        &server_dir,
        "grpc",
        &[
            "--max-tls-handshakes=1".to_owned(),
            "--server-count=2".to_owned(),
        ],
    )
    .await;
    let agent = AgentWithFiles::start(&agent_dir, server.agent_addr.port()).await;
    server.wait_for_agents(1).await;

    // A good dial: bytes there and back, then closed.
    let echo = destination::echo().await;
    let channel = client::dial::uds_channel(&server.uds).await.unwrap();
    let mut conn = client::dial::dial(channel, &echo.address()).await.unwrap();
    conn.write_all(b"hello").await.unwrap();
    let mut got = [0u8; 5];
    conn.read_exact(&mut got).await.unwrap();
    assert_eq!(&got, b"hello");
    conn.finish().await.unwrap();

    // A refused dial.
    let channel = client::dial::uds_channel(&server.uds).await.unwrap();
    let closed = destination::closed_port().to_string();
    assert!(client::dial::dial(channel, &closed).await.is_err());

    // A blocked reader.
    let stall = destination::Stall::start();
    let upload = block_a_reader(&server, &stall).await;

    // A limit: silent connections on the agent port hold the one pending
    // handshake slot until they are dropped to make room.
    let mut silent = Vec::new();
    for _ in 0..2 {
        silent.push(
            tokio::net::TcpStream::connect(server.agent_addr)
                .await
                .unwrap(),
        );
    }
    server
        .wait_for_metric_at_least(
            "konnectivity_rs_server_limit_reached_total{limit=\"tls_handshakes\"}",
            1.0,
            DEADLINE,
        )
        .await;
    drop(silent);
    drop(upload);

    // Spoilt files: the server's key no longer matches its certificate,
    // the agent's CA bundle is cut in the middle.
    replace(
        &server_dir.join("cluster.key"),
        &std::fs::read(Pki::get().path("proxy-agent.key")).unwrap(),
    );
    let bundle = std::fs::read(agent_dir.join("agent-ca.crt")).unwrap();
    replace(&agent_dir.join("agent-ca.crt"), &bundle[..bundle.len() / 2]);

    // Both expositions, until every wanted family is there (series that the
    // scenario's last steps make may lag its waits by a scrape).
    let start = Instant::now();
    loop {
        let texts = [
            ("proxy-server", scrape(server.health_addr).await),
            ("proxy-agent", scrape(agent.health_addr).await),
        ];
        let exposed: BTreeMap<&str, BTreeMap<String, String>> = texts
            .iter()
            .map(|(who, text)| (*who, families(text)))
            .collect();
        let missing: Vec<String> = wanted
            .iter()
            .flat_map(|(name, at)| {
                exporters(name)
                    .iter()
                    .filter(|who| !exposes(&exposed[**who], name))
                    .map(move |who| format!("{name} (not in {who}'s /metrics; used by {at:?})"))
            })
            .collect();
        if missing.is_empty() {
            break;
        }
        assert!(
            start.elapsed() < DEADLINE,
            "named by the rules or the dashboard but not exported:\n  {}\n\n{}\n\n{}",
            missing.join("\n  "),
            texts[0].1,
            texts[1].1
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(stall);
}
