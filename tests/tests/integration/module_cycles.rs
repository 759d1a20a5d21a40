//! Modules import one way (house style: "edges point one way"): in no
//! crate of the tree (`integration_tests::crate_dirs`: every workspace
//! member, the soak's judge and the fuzz harnesses included) does a
//! top-level module of `src/` reach itself again through the modules it
//! names. A module names another by a `crate::other` path anywhere in its
//! files before their `#[cfg(test)]` part, doc comments included (a link
//! is a dependency of the reader), or by `use crate::{other, …}`. This is
//! the rule `../shared/tools/modcycles.py` checks, run with the suite.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::Path,
};

use integration_tests::{crate_dirs, workspace};

/// Module → the modules it names.
type Edges = BTreeMap<String, BTreeSet<String>>;

/// The start of a Rust name (a module's: lowercase).
fn module_name(text: &str) -> Option<&str> {
    let end = text
        .find(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'))
        .unwrap_or(text.len());
    let name = &text[..end];
    name.starts_with(|c: char| c.is_ascii_lowercase() || c == '_')
        .then_some(name)
}

/// The modules `text` names: `crate::x` paths, and the first segment of
/// each item of `use crate::{…}` (nested braces skipped).
fn named(text: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    for (at, _) in text.match_indices("crate::") {
        let before = text[..at].chars().next_back();
        if before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_') {
            continue;
        }
        let rest = &text[at + "crate::".len()..];
        if let Some(list) = rest.strip_prefix('{') {
            let mut depth = 1;
            let mut item_start = 0;
            for (i, c) in list.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    _ => {}
                }
                if (depth == 1 && c == ',') || depth == 0 {
                    if let Some(name) = module_name(list[item_start..i].trim_start()) {
                        found.insert(name.to_owned());
                    }
                    item_start = i + 1;
                }
                if depth == 0 {
                    break;
                }
            }
        } else if let Some(name) = module_name(rest) {
            found.insert(name.to_owned());
        }
    }
    found
}

/// Every `.rs` file below `dir`.
fn files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries {
        let path = entry.unwrap().path();
        if path.is_dir() {
            files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The edges between `src`'s top-level modules.
fn edges(src: &Path) -> Edges {
    let mut all = Vec::new();
    files(src, &mut all);
    let mut edges = Edges::new();
    for file in all {
        let relative = file.strip_prefix(src).unwrap();
        let first = relative.components().next().unwrap();
        let top = first.as_os_str().to_string_lossy();
        let top = top.strip_suffix(".rs").unwrap_or(&top).to_owned();
        if ["lib", "main", "bin"].contains(&top.as_str()) {
            continue;
        }
        let text = std::fs::read_to_string(&file).unwrap();
        let text = text.split("#[cfg(test)]").next().unwrap_or_default();
        let named = named(text);
        let entry = edges.entry(top.clone()).or_default();
        entry.extend(named.into_iter().filter(|n| *n != top));
    }
    edges
}

/// The modules that reach themselves again, each cycle's members sorted.
fn cycles(edges: &Edges) -> BTreeSet<Vec<String>> {
    let reach = |from: &str| {
        let mut seen = BTreeSet::new();
        let mut todo = vec![from.to_owned()];
        while let Some(next) = todo.pop() {
            for to in edges.get(&next).into_iter().flatten() {
                if edges.contains_key(to) && seen.insert(to.clone()) {
                    todo.push(to.clone());
                }
            }
        }
        seen
    };
    let reached: BTreeMap<&String, BTreeSet<String>> =
        edges.keys().map(|m| (m, reach(m))).collect();
    reached
        .iter()
        .filter(|(m, r)| r.contains(m.as_str()))
        .map(|(m, r)| {
            let mut members: Vec<String> = r
                .iter()
                .filter(|o| reached[o].contains(m.as_str()))
                .cloned()
                .collect();
            members.sort();
            members
        })
        .collect()
}

#[test]
fn the_reader_finds_paths_and_use_lists() {
    let text = "use crate::{a::{X, Y}, b, c::d};\nlet x = crate::e::f();\n\
                /// [`crate::g`]\nsupercrate::h; use crate::{\n    i,\n};";
    let found: Vec<String> = named(text).into_iter().collect();
    assert_eq!(found, ["a", "b", "c", "e", "g", "i"]);
    let edges: Edges = [
        ("a", &["b"][..]),
        ("b", &["c"]),
        ("c", &["a"]),
        ("d", &["a"]),
    ]
    .into_iter()
    .map(|(m, to)| (m.to_owned(), to.iter().map(|t| (*t).to_owned()).collect()))
    .collect();
    assert_eq!(
        cycles(&edges),
        BTreeSet::from([vec!["a".to_owned(), "b".to_owned(), "c".to_owned()]])
    );
}

#[test]
fn no_crate_has_a_module_cycle() {
    let mut found = Vec::new();
    let mut read = 0;
    for dir in crate_dirs() {
        let src = workspace().join(&dir).join("src");
        let edges = edges(&src);
        read += edges.len();
        for cycle in cycles(&edges) {
            found.push(format!("{dir}: cycle among modules {}", cycle.join(", ")));
        }
    }
    assert!(read > 50, "only {read} modules read");
    assert!(
        found.is_empty(),
        "modules that import each other (make one a leaf, or move what both need below \
         them):\n{}",
        found.join("\n")
    );
}
