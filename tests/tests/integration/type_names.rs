//! One name per concept across the workspace (issue 39): no two crates
//! declare a type (`pub struct`, `enum`, `trait`, `type` or `union`, with
//! any `pub(…)` visibility: a crate-wide name is read across the tree as
//! much as a public one) of the same name, unless [`SAME_CONCEPT`] says
//! why the name means one thing in each. The sources of every member of
//! the root `Cargo.toml` and of the fuzz harnesses (`fuzz/`) are read as
//! text (private types do not count);
//! a new clash fails naming the crates and the places, and an allowlist
//! entry that no longer matches what the crates declare fails too.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
};

use integration_tests::{crate_dirs as members, workspace};

/// Names that several crates declare on purpose: the crates (package
/// names), and why the name is one concept in all of them.
const SAME_CONCEPT: &[(&str, &[&str], &str)] = &[
    (
        "Args",
        &["proxy-agent", "proxy-client", "proxy-server"],
        "what clap parses from a binary's flags, one per binary (house style 3.6)",
    ),
    (
        "Config",
        &["proxy-agent", "proxy-server"],
        "a binary's configuration, validated from its Args (house style 3.6)",
    ),
    (
        "Bound",
        &["proxy-agent", "proxy-server"],
        "a binary with its sockets bound, ready to serve (house style rule 2: bind, then serve)",
    ),
    (
        "Resumption",
        &["ops", "proxy-server"],
        "whether and how a TLS listener resumes sessions (off, cache, tickets): the server's \
         setting validated from its flags, and the form ops builds a listener from, which \
         borrows the ticket secret once it is loaded",
    ),
    (
        "Mode",
        &["konnectivity-client", "proxy-server"],
        "the frontend protocol, ANP's --mode: the server's flag value and what the client's \
         Dialer speaks; the client crate depends on no binary, and the crates both use carry \
         no clap",
    ),
    (
        "Direction",
        &["proxy-agent", "proxy-server"],
        "the `direction` label of a binary's byte counters (ANP's label, each binary's own \
         metric family)",
    ),
    (
        "Segment",
        &["proxy-agent", "proxy-server"],
        "the `segment` label of a binary's dial-latency histogram, each binary's own metric \
         family",
    ),
    (
        "Live",
        &["proxy-agent", "proxy-server"],
        "the live state a binary's gauges read when scraped (a struct the server fills, a \
         trait the agent's state implements)",
    ),
];

/// The name of the type `line` declares with some `pub`, if it declares
/// one.
fn declared(line: &str) -> Option<&str> {
    let rest = line.trim_start().strip_prefix("pub")?;
    let rest = match rest.strip_prefix('(') {
        Some(scope) => scope.split_once(')')?.1,
        None => rest,
    };
    let rest = rest.strip_prefix(' ')?.trim_start();
    let rest = ["struct ", "enum ", "trait ", "type ", "union "]
        .iter()
        .find_map(|keyword| rest.strip_prefix(keyword))?
        .trim_start();
    let end = rest
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(rest.len());
    let name = &rest[..end];
    // `$name` in a macro, or nothing: not a declaration.
    name.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_')
        .then_some(name)
}

/// A member's package name, from its manifest's `name = "…"`.
fn package_name(member: &str) -> String {
    let path = workspace().join(member).join("Cargo.toml");
    let manifest = std::fs::read_to_string(&path).unwrap();
    manifest
        .lines()
        .find_map(|line| line.strip_prefix("name = "))
        .map(|name| name.trim().trim_matches('"').to_owned())
        .unwrap_or_else(|| panic!("no package name in {}", path.display()))
}

/// Every `.rs` file below `dir`, but in build output (`target`).
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            if path.file_name().is_some_and(|n| n != "target") {
                sources(&path, out);
            }
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Public type name → crate → where it declares it (`path:line`).
type Declarations = BTreeMap<String, BTreeMap<String, Vec<String>>>;

fn scan() -> Declarations {
    let mut found = Declarations::new();
    for member in members() {
        let krate = package_name(&member);
        let mut files = Vec::new();
        sources(&workspace().join(&member), &mut files);
        for file in files {
            let text = std::fs::read_to_string(&file).unwrap();
            let shown = file
                .strip_prefix(workspace())
                .unwrap()
                .display()
                .to_string();
            for (n, line) in text.lines().enumerate() {
                if let Some(name) = declared(line) {
                    found
                        .entry(name.to_owned())
                        .or_default()
                        .entry(krate.clone())
                        .or_default()
                        .push(format!("{shown}:{}", n + 1));
                }
            }
        }
    }
    found
}

#[test]
fn the_scanner_reads_declarations_only() {
    for (line, name) in [
        ("pub struct Agent;", Some("Agent")),
        ("    pub enum Mode {", Some("Mode")),
        ("pub trait Io: AsyncRead {", Some("Io")),
        (
            "pub type Result<T> = std::result::Result<T, Error>;",
            Some("Result"),
        ),
        ("pub union Bits {", Some("Bits")),
        ("pub struct Window<'a>(&'a [u8]);", Some("Window")),
        ("pub(crate) struct Table {", Some("Table")),
        ("    pub(super) enum Step {", Some("Step")),
        ("pub(in crate::auth) type Key = [u8; 32];", Some("Key")),
        ("pub(crate) fn table() {}", None),
        ("pubstruct Joined;", None),
        ("struct Private;", None),
        ("pub fn structure() {}", None),
        ("/// pub struct InADoc;", None),
        ("        pub struct $name;", None),
    ] {
        assert_eq!(declared(line), name, "{line:?}");
    }
}

/// No type name in two crates, but the allowlisted ones, which
/// stand in exactly the crates their entry names.
#[test]
fn no_two_crates_declare_a_type_of_the_same_name() {
    let found = scan();
    // The scan read the workspace: the allowlisted names are there.
    assert!(found.len() > 100, "only {} types found", found.len());
    let allowed: BTreeMap<&str, (&[&str], &str)> = SAME_CONCEPT
        .iter()
        .map(|(name, crates, why)| (*name, (*crates, *why)))
        .collect();
    let mut problems = Vec::new();
    for (name, crates) in &found {
        if crates.len() < 2 {
            continue;
        }
        let names: BTreeSet<&str> = crates.keys().map(String::as_str).collect();
        let places = crates
            .iter()
            .map(|(krate, at)| format!("    {krate}: {}", at.join(", ")))
            .collect::<Vec<_>>()
            .join("\n");
        match allowed.get(name.as_str()) {
            None => problems.push(format!(
                "`{name}` is a type in {} crates; rename all but one (one name per \
                 concept), or, if it is one concept, add it to SAME_CONCEPT saying why:\n{places}",
                crates.len()
            )),
            Some((listed, _)) if names != listed.iter().copied().collect() => {
                problems.push(format!(
                    "`{name}` is allowed in {listed:?}, but declared in {names:?}:\n{places}"
                ));
            }
            Some(_) => {}
        }
    }
    for (name, (listed, _)) in &allowed {
        let shared = found.get(*name).is_some_and(|crates| crates.len() > 1);
        if !shared {
            problems.push(format!(
                "SAME_CONCEPT lists `{name}` for {listed:?}, but no two crates declare it now: \
                 remove the entry"
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n\n"));
}
