//! `docs/architecture.md`'s list of the modules on the DATA path is what
//! the source says: no module enters the per-packet path unnoticed.
//!
//! The section "One DATA packet, module by module" holds two tables: the
//! modules on the path (those marked `entry` are where a packet enters our
//! code: a stream's driver, a socket's mover) and the imports that leave
//! the path, each with what they are for. From the entries, the test
//! follows every module an on-path module names ([`scan`]: `use` items
//! and paths in code, across the workspace's library crates) except the
//! imports the second table lets off the path. It fails when a module
//! reached that way is in neither table, when a listed module is no
//! longer reached, and when a listed import no longer exists.
//!
//! The unit is the module, not the function: an on-path module that calls
//! a new function of a module it already imports off the path (the
//! control core, say) is not seen here; the lock audit
//! (`data_path.rs`) catches that one when it takes a shared lock.

mod scan;

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use integration_tests::workspace;

use self::scan::{Graph, ModuleId, Scan};

/// The section of `docs/architecture.md` that holds the tables.
const SECTION: &str = "## One DATA packet, module by module";
/// First header cell of the table of on-path modules.
const ON_HEADER: &str = "on the DATA path";
/// First header cell of the table of imports that leave the path.
const OFF_HEADER: &str = "off the DATA path";

/// What the document says.
#[derive(Debug, Default, Clone)]
struct Listed {
    /// On-path modules → whether it is an entry.
    on: BTreeMap<ModuleId, bool>,
    /// Rows without their last cell (what runs, what for), by first cell.
    unexplained: Vec<String>,
    /// Imports that leave the path: (importer, imported).
    off: BTreeSet<(ModuleId, ModuleId)>,
    /// The modules the diagram above the tables names, with its line.
    drawn: Vec<(ModuleId, String)>,
}

/// Every workspace library crate, from the root manifest's
/// `[workspace.dependencies]` path entries: its Rust name and directory.
fn workspace_crates() -> Vec<(String, String)> {
    let manifest = std::fs::read_to_string(workspace().join("Cargo.toml")).unwrap();
    let deps = manifest
        .split("[workspace.dependencies]")
        .nth(1)
        .expect("Cargo.toml has [workspace.dependencies]");
    let deps = deps.split("\n[").next().unwrap_or(deps);
    deps.lines()
        .filter_map(|line| {
            let (name, spec) = line.split_once('=')?;
            let dir = spec.split("path = \"").nth(1)?.split('"').next()?;
            let has_lib = workspace().join(dir).join("src/lib.rs").exists();
            has_lib.then(|| (name.trim().replace('-', "_"), dir.to_owned()))
        })
        .collect()
}

/// The module graph of every workspace library crate.
fn graph() -> Graph {
    let crates = workspace_crates();
    assert!(
        crates.iter().any(|(name, _)| name == "tunnel"),
        "no tunnel crate in {crates:?}"
    );
    Scan {
        root: workspace().to_path_buf(),
        crates,
    }
    .graph()
    .unwrap_or_else(|e| panic!("{e}"))
}

/// The names in backticks in a table cell.
fn names(cell: &str) -> Vec<ModuleId> {
    cell.split('`')
        .skip(1)
        .step_by(2)
        .map(ModuleId::parse)
        .collect()
}

/// The modules the section's diagram names: on a line under
/// `proxy-server` or `proxy-agent`, each step's first words
/// (`frontend/grpc (driver, table)` → `proxy_server::frontend::grpc`), and
/// each bracket's (`[flow: credit]` → `tunnel::flow`).
fn drawn(section: &str) -> Vec<(ModuleId, String)> {
    let diagram = section.split("```").nth(1).unwrap_or_default();
    let mut out = Vec::new();
    let mut krate = None;
    for line in diagram.lines() {
        if !line.starts_with(' ') {
            krate = None;
            continue;
        }
        let mut rest = line.trim();
        for (label, name) in [
            ("proxy-server", "proxy_server"),
            ("proxy-agent", "proxy_agent"),
        ] {
            if let Some(after) = rest.strip_prefix(label) {
                (krate, rest) = (Some(name), after);
            }
        }
        let Some(krate) = krate else { continue };
        let module = |krate: &str, name: &str| {
            ModuleId::parse(&format!("{krate}::{}", name.trim().replace('/', "::")))
        };
        for step in rest.split('─').map(|s| s.trim_start_matches('▶')) {
            for bracket in step.split('[').skip(1) {
                let name = bracket.split([':', ']']).next().unwrap_or_default();
                out.push((module("tunnel", name), line.to_owned()));
            }
            let head = step.split(['(', '[']).next().unwrap_or_default().trim();
            if !head.is_empty() {
                out.push((module(krate, head), line.to_owned()));
            }
        }
    }
    out
}

/// Reads the two tables from the section of the document.
fn listed(doc: &str) -> Result<Listed, String> {
    let section = doc
        .split_once(SECTION)
        .ok_or_else(|| format!("no `{SECTION}` in docs/architecture.md"))?
        .1;
    let section = section.split("\n## ").next().unwrap_or(section);
    let mut listed = Listed {
        drawn: drawn(section),
        ..Listed::default()
    };
    let (mut table, mut seen) = (None, BTreeSet::new());
    for line in section.lines().map(str::trim) {
        let Some(row) = line.strip_prefix('|') else {
            table = None;
            continue;
        };
        let cells: Vec<&str> = row
            .trim_end_matches('|')
            .split('|')
            .map(str::trim)
            .collect();
        if cells
            .iter()
            .all(|c| c.chars().all(|ch| matches!(ch, '-' | ':' | ' ')))
        {
            continue;
        }
        if table.is_none() {
            table = [ON_HEADER, OFF_HEADER].into_iter().find(|h| cells[0] == *h);
            seen.extend(table);
            continue;
        }
        let ([first, second, why], Some(table)) = (cells.as_slice(), table) else {
            return Err(format!("a row the tables do not expect: `{line}`"));
        };
        if why.is_empty() {
            listed.unexplained.push((*first).to_owned());
        }
        let (firsts, seconds) = (names(first), names(second));
        if firsts.is_empty() || (table == OFF_HEADER && seconds.is_empty()) {
            return Err(format!("a row without the modules it is about: `{line}`"));
        }
        for module in firsts {
            if table == ON_HEADER {
                listed.on.insert(module, second.contains("entry"));
                continue;
            }
            for importer in &seconds {
                listed.off.insert((importer.clone(), module.clone()));
            }
        }
    }
    for header in [ON_HEADER, OFF_HEADER] {
        if !seen.contains(header) {
            return Err(format!("no table headed `{header}` under `{SECTION}`"));
        }
    }
    Ok(listed)
}

/// Every way the source and the tables disagree, one message each.
fn disagreements(graph: &Graph, listed: &Listed) -> Vec<String> {
    let mut errors = Vec::new();
    let known = |m: &ModuleId| graph.modules.contains(m);
    for row in &listed.unexplained {
        errors.push(format!(
            "the row of {row} does not say what runs or what for"
        ));
    }
    let mut undrawn = BTreeSet::new();
    for (module, line) in &listed.drawn {
        if !listed.on.contains_key(module) && undrawn.insert(module) {
            errors.push(format!(
                "the diagram names `{module}` (`{}`), which the `{ON_HEADER}` table does not list",
                line.trim()
            ));
        }
    }
    for module in listed.on.keys() {
        if !known(module) {
            errors.push(format!(
                "`{module}` is listed on the DATA path but there is no such module"
            ));
        }
    }
    for (from, to) in &listed.off {
        for m in [from, to] {
            if !known(m) {
                errors.push(format!(
                    "`{m}` is listed in `{OFF_HEADER}` but there is no such module"
                ));
            }
        }
        if listed.on.contains_key(to) {
            errors.push(format!(
                "`{to}` is listed both on the DATA path and off it (imported by `{from}`): \
                 an import of an on-path module needs no reason; drop the `{OFF_HEADER}` row"
            ));
        }
        if !listed.on.contains_key(from) {
            errors.push(format!(
                "`{from}` imports `{to}` off the DATA path, but `{from}` is not listed on it"
            ));
        }
    }
    let mut reached: BTreeSet<&ModuleId> = BTreeSet::new();
    let mut used: BTreeSet<(&ModuleId, &ModuleId)> = BTreeSet::new();
    let mut queue: VecDeque<&ModuleId> = listed
        .on
        .iter()
        .filter(|(_, entry)| **entry)
        .map(|(m, _)| m)
        .collect();
    reached.extend(queue.iter().copied());
    let mut entered: BTreeMap<&ModuleId, Vec<String>> = BTreeMap::new();
    while let Some(from) = queue.pop_front() {
        for (to, site) in graph.edges.get(from).into_iter().flatten() {
            if listed.off.contains(&(from.clone(), to.clone())) {
                used.insert((from, to));
            } else if listed.on.contains_key(to) {
                if reached.insert(to) {
                    queue.push_back(to);
                }
            } else {
                entered.entry(to).or_default().push(format!(
                    "`{from}` names it at {}:{} (`{}`)",
                    site.file, site.line, site.path
                ));
            }
        }
    }
    for (to, by) in entered {
        errors.push(format!(
            "`{to}` entered the DATA path: {}. Document it in docs/architecture.md: in the \
             `{ON_HEADER}` table if its code runs for each packet, else its import in the \
             `{OFF_HEADER}` table with what it is for; or keep it off the path",
            by.join("; ")
        ));
    }
    for module in listed.on.keys() {
        if known(module) && !reached.contains(module) {
            errors.push(format!(
                "`{module}` is listed on the DATA path but no entry reaches it any more: \
                 take it off the `{ON_HEADER}` table of docs/architecture.md"
            ));
        }
    }
    for (from, to) in &listed.off {
        if known(from) && known(to) && !used.contains(&(from, to)) {
            errors.push(format!(
                "`{from}` no longer imports `{to}` (or is no longer reached): \
                 take it off the `{OFF_HEADER}` table of docs/architecture.md"
            ));
        }
    }
    errors
}

/// The document's tables.
fn documented() -> Listed {
    let path = workspace().join("docs/architecture.md");
    let doc = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    listed(&doc).unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn docs_list_the_modules_on_the_data_path() {
    let errors = disagreements(&graph(), &documented());
    assert!(
        errors.is_empty(),
        "docs/architecture.md's DATA path disagrees with the source:\n- {}",
        errors.join("\n- ")
    );
}

/// The check is not vacuous: each on-path module taken off the table (not
/// an entry) is reported as entering the path, named, and each import
/// let off the path, when dropped, brings its module onto it.
#[test]
fn a_module_left_off_the_list_is_reported() {
    let graph = graph();
    let listed = documented();
    let mut checked = 0;
    for (module, _) in listed.on.iter().filter(|(_, entry)| !**entry) {
        let mut less = listed.clone();
        less.on.remove(module);
        less.drawn.clear();
        let errors = disagreements(&graph, &less);
        let entered = format!("`{module}` entered the DATA path");
        assert!(
            errors.iter().any(|e| e.starts_with(&entered)),
            "taking `{module}` off the list was not reported: {errors:?}"
        );
        checked += 1;
    }
    for key in &listed.off {
        let mut less = listed.clone();
        less.off.remove(key);
        let entered = format!("`{}` entered the DATA path: ", key.1);
        let names = format!("`{}` names it", key.0);
        assert!(
            disagreements(&graph, &less)
                .iter()
                .any(|e| e.starts_with(&entered) && e.contains(&names)),
            "dropping the import {key:?} was not reported"
        );
        checked += 1;
    }
    assert!(checked > 10, "only {checked} rows to take away");
}
