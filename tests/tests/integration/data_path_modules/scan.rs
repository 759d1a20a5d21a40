//! The module graph of the workspace's library crates, read from their
//! source: which module names which, through `use` items and paths in code
//! (`crate::…`, `super::…`, `self::…`, a child module, another workspace
//! crate, a name a `use` bound).
//!
//! A module is a file, read from `lib.rs` down the `mod` declarations; an
//! inline `mod x { … }` belongs to its file, and an `include!("file")`
//! (`proto`'s generated code) to the file that includes it. Code a debug
//! build of the binaries does not compile is left out: items behind a
//! `#[cfg(..)]` that is false with `test`, the `fuzzing` and `loom`
//! features and `loom` off and `debug_assertions` on (any other predicate
//! counts as true, so in doubt code is kept). Comments and literals are
//! never read as paths. A re-export (`pub use`, `pub(crate) use`) is
//! followed to the module it names, so `crate::router::BackendId` counts
//! as `ids`, unless the re-exporting module uses the name itself; an
//! exported macro counts as the module that defines it. What this cannot
//! see: what a macro's expansion names, and which implementation a trait
//! object or a generic gets from elsewhere.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    fmt,
    path::{Path, PathBuf},
};

/// A module: its crate (as Rust names it) and its path under the crate
/// root (empty for `lib.rs`).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct ModuleId {
    /// `proxy_server`, `tunnel`, …
    pub(crate) krate: String,
    /// `["frontend", "grpc"]`, …
    pub(crate) path: Vec<String>,
}

impl ModuleId {
    /// `proxy_server::frontend::grpc`, `tunnel::flow`, `proto`.
    pub(crate) fn parse(name: &str) -> Self {
        let mut segs = name.split("::").map(str::to_owned);
        let krate = segs.next().unwrap_or_default();
        Self {
            krate,
            path: segs.collect(),
        }
    }
}

impl fmt::Display for ModuleId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.krate)?;
        for seg in &self.path {
            write!(f, "::{seg}")?;
        }
        Ok(())
    }
}

/// Where a module names another: the file, the line, the path as written.
#[derive(Debug, Clone)]
pub(crate) struct Site {
    /// The file, relative to the workspace.
    pub(crate) file: String,
    /// Its 1-based line.
    pub(crate) line: usize,
    /// The path, `crate::router::FrontendKind`.
    pub(crate) path: String,
}

/// The graph: each scanned module and the modules it names, with the
/// first place it names each.
#[derive(Debug, Default)]
pub(crate) struct Graph {
    /// Every scanned module.
    pub(crate) modules: BTreeSet<ModuleId>,
    /// Module → module it names → where, first.
    pub(crate) edges: BTreeMap<ModuleId, BTreeMap<ModuleId, Site>>,
}

/// A token of Rust source; literals keep their text (a `cfg` feature name),
/// comments and whitespace are gone.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Tok {
    /// An identifier or keyword (a raw `r#type` without its `r#`).
    Ident(String),
    /// A string literal's text between its quotes, escapes as written.
    Str(String),
    /// `::`.
    PathSep,
    /// Any other punctuation, one character.
    Punct(char),
    /// A number, a char literal or a lifetime.
    Other,
}

/// A token and its 1-based line.
type Spanned = (Tok, usize);

/// Splits Rust source into tokens.
fn lex(src: &str) -> Vec<Spanned> {
    let chars: Vec<char> = src.chars().collect();
    let (mut i, mut line, mut out) = (0, 1, Vec::new());
    let at = |i: usize| chars.get(i).copied().unwrap_or('\0');
    while i < chars.len() {
        let c = chars[i];
        let start_line = line;
        if c == '\n' {
            line += 1;
            i += 1;
        } else if c.is_whitespace() {
            i += 1;
        } else if c == '/' && at(i + 1) == '/' {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && at(i + 1) == '*' {
            let mut depth = 0;
            while i < chars.len() {
                if chars[i] == '/' && at(i + 1) == '*' {
                    depth += 1;
                    i += 2;
                } else if chars[i] == '*' && at(i + 1) == '/' {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    line += usize::from(chars[i] == '\n');
                    i += 1;
                }
            }
        } else if c == '"' {
            let (text, next, lines) = quoted(&chars, i + 1);
            out.push((Tok::Str(text), start_line));
            (i, line) = (next, line + lines);
        } else if c == '\'' {
            // A char literal ('a', '\n', '\u{..}') or a lifetime ('a).
            if at(i + 1) == '\\' {
                i += 3;
                while i < chars.len() && chars[i] != '\'' {
                    i += 1;
                }
                i += 1;
            } else if at(i + 2) == '\'' {
                i += 3;
            } else {
                i += 1;
                while at(i).is_alphanumeric() || at(i) == '_' {
                    i += 1;
                }
            }
            out.push((Tok::Other, start_line));
        } else if c.is_ascii_digit() {
            while at(i).is_alphanumeric() || at(i) == '_' {
                i += 1;
            }
            out.push((Tok::Other, start_line));
        } else if c.is_alphabetic() || c == '_' {
            let begin = i;
            while at(i).is_alphanumeric() || at(i) == '_' {
                i += 1;
            }
            let word: String = chars[begin..i].iter().collect();
            let prefix = matches!(word.as_str(), "r" | "b" | "br" | "c" | "cr");
            if prefix && at(i) == '"' {
                let (text, next, lines) = quoted(&chars, i + 1);
                out.push((Tok::Str(text), start_line));
                (i, line) = (next, line + lines);
            } else if prefix && word != "b" && word != "c" && at(i) == '#' {
                let mut hashes = 0;
                while at(i + hashes) == '#' {
                    hashes += 1;
                }
                if at(i + hashes) == '"' {
                    // A raw string: ends at `"` and as many `#`.
                    let body = i + hashes + 1;
                    let mut end = body;
                    while end < chars.len()
                        && !(chars[end] == '"' && (1..=hashes).all(|k| at(end + k) == '#'))
                    {
                        end += 1;
                    }
                    let text: String = chars[body..end.min(chars.len())].iter().collect();
                    line += text.matches('\n').count();
                    out.push((Tok::Str(text), start_line));
                    i = end + 1 + hashes;
                } else if word == "r" && hashes == 1 {
                    // A raw identifier: `r#type`.
                    let begin = i + 1;
                    i = begin;
                    while at(i).is_alphanumeric() || at(i) == '_' {
                        i += 1;
                    }
                    out.push((Tok::Ident(chars[begin..i].iter().collect()), start_line));
                } else {
                    out.push((Tok::Ident(word), start_line));
                }
            } else {
                out.push((Tok::Ident(word), start_line));
            }
        } else if c == ':' && at(i + 1) == ':' {
            out.push((Tok::PathSep, start_line));
            i += 2;
        } else {
            out.push((Tok::Punct(c), start_line));
            i += 1;
        }
    }
    out
}

/// The tokens with each `include!("file")` replaced by the tokens of that
/// file (at the line of the `include!`): the generated code of `proto`.
fn spliced(toks: Vec<Spanned>, file: &Path) -> Result<Vec<Spanned>, String> {
    let mut out = Vec::with_capacity(toks.len());
    let mut i = 0;
    while i < toks.len() {
        let window: Vec<&Tok> = toks[i..(i + 5).min(toks.len())]
            .iter()
            .map(|t| &t.0)
            .collect();
        if let [
            Tok::Ident(mac),
            Tok::Punct('!'),
            Tok::Punct('('),
            Tok::Str(name),
            Tok::Punct(')'),
        ] = window.as_slice()
            && mac == "include"
        {
            let included = file.parent().unwrap_or(file).join(name);
            let src = std::fs::read_to_string(&included)
                .map_err(|e| format!("reading {}: {e}", included.display()))?;
            let line = toks[i].1;
            let inner = spliced(lex(&src), &included)?;
            out.extend(inner.into_iter().map(|(tok, _)| (tok, line)));
            i += 5;
        } else {
            out.push(toks[i].clone());
            i += 1;
        }
    }
    Ok(out)
}

/// A quoted literal from `from` (after its opening quote): its text, the
/// index after its closing quote, the newlines in it.
fn quoted(chars: &[char], from: usize) -> (String, usize, usize) {
    let mut i = from;
    while i < chars.len() && chars[i] != '"' {
        i += if chars[i] == '\\' { 2 } else { 1 };
    }
    let text: String = chars[from..i.min(chars.len())].iter().collect();
    let lines = text.matches('\n').count();
    (text, i + 1, lines)
}

/// Whether a `cfg` predicate holds for a debug, non-test build of the
/// binaries; `toks` is what is between `cfg(` and its `)`.
fn cfg_holds(toks: &[Tok]) -> bool {
    fn eval(toks: &[Tok], i: &mut usize) -> bool {
        let Some(Tok::Ident(word)) = toks.get(*i) else {
            *i += 1;
            return true;
        };
        *i += 1;
        match (word.as_str(), toks.get(*i)) {
            ("any" | "all" | "not", Some(Tok::Punct('('))) => {
                *i += 1;
                let mut values = Vec::new();
                while *i < toks.len() && toks[*i] != Tok::Punct(')') {
                    if toks[*i] == Tok::Punct(',') {
                        *i += 1;
                        continue;
                    }
                    values.push(eval(toks, i));
                }
                *i += 1;
                match word.as_str() {
                    "any" => values.into_iter().any(|v| v),
                    "all" => values.into_iter().all(|v| v),
                    _ => !values.first().copied().unwrap_or(true),
                }
            }
            (_, Some(Tok::Punct('='))) => {
                *i += 1;
                let value = match toks.get(*i) {
                    Some(Tok::Str(s)) => s.clone(),
                    _ => String::new(),
                };
                *i += 1;
                !(word == "feature" && matches!(value.as_str(), "fuzzing" | "loom"))
            }
            ("test" | "loom" | "fuzzing", _) => false,
            _ => true,
        }
    }
    eval(toks, &mut 0)
}

/// The tokens with every item a false `#[cfg(..)]` guards taken out (and
/// everything after a false `#![cfg(..)]`).
fn compiled(toks: Vec<Spanned>) -> Vec<Spanned> {
    let mut out = Vec::with_capacity(toks.len());
    let mut i = 0;
    while i < toks.len() {
        let inner = toks.get(i + 1).map(|t| &t.0) == Some(&Tok::Punct('!'));
        let open = i + 1 + usize::from(inner);
        let is_cfg = toks[i].0 == Tok::Punct('#')
            && toks.get(open).map(|t| &t.0) == Some(&Tok::Punct('['))
            && toks.get(open + 1).map(|t| &t.0) == Some(&Tok::Ident("cfg".into()))
            && toks.get(open + 2).map(|t| &t.0) == Some(&Tok::Punct('('));
        if !is_cfg {
            out.push(toks[i].clone());
            i += 1;
            continue;
        }
        let close = group_end(&toks, open);
        let pred: Vec<Tok> = toks[open + 3..close.saturating_sub(1)]
            .iter()
            .map(|t| t.0.clone())
            .collect();
        if cfg_holds(&pred) {
            out.extend_from_slice(&toks[i..=close.min(toks.len() - 1)]);
            i = close + 1;
        } else if inner {
            break;
        } else {
            i = item_end(&toks, close + 1);
        }
    }
    out
}

/// The index of the bracket closing the group opened at `open`.
fn group_end(toks: &[Spanned], open: usize) -> usize {
    let mut depth = 0usize;
    for (k, (tok, _)) in toks.iter().enumerate().skip(open) {
        match tok {
            Tok::Punct('(' | '[' | '{') => depth += 1,
            Tok::Punct(')' | ']' | '}') => {
                depth = depth.saturating_sub(1);
                if depth == 0 {
                    return k;
                }
            }
            _ => {}
        }
    }
    toks.len() - 1
}

/// The index after the item (or field, statement) that starts at `from`,
/// its own attributes included: after its `;` or `,`, or its first brace
/// group, or at a bracket closing its surroundings. A `,` inside generics
/// ends it early, which keeps more code, never less.
fn item_end(toks: &[Spanned], from: usize) -> usize {
    let mut k = from;
    while k < toks.len() {
        match toks[k].0 {
            Tok::Punct('#') => k = group_end(toks, k + 1) + 1,
            Tok::Punct(';' | ',') => return k + 1,
            Tok::Punct('{') => return group_end(toks, k) + 1,
            Tok::Punct('(' | '[') => k = group_end(toks, k) + 1,
            Tok::Punct(')' | ']' | '}') => return k,
            _ => k += 1,
        }
    }
    k
}

/// A leaf of a `use` tree: its full path and the name it binds (none for
/// a glob or `_`).
type Leaf = (Vec<String>, Option<String>);

/// One `use` item's leaves (from after its `use`), and the index after
/// its `;`.
fn use_leaves(toks: &[Spanned], from: usize) -> (Vec<Leaf>, usize) {
    fn tree(toks: &[Spanned], i: &mut usize, prefix: &[String], out: &mut Vec<Leaf>) {
        let mut path = prefix.to_vec();
        loop {
            match toks.get(*i).map(|t| &t.0) {
                Some(Tok::Ident(seg)) if seg != "as" => {
                    path.push(seg.clone());
                    *i += 1;
                }
                Some(Tok::PathSep) => *i += 1,
                Some(Tok::Punct('*')) => {
                    *i += 1;
                    out.push((path, None));
                    return;
                }
                Some(Tok::Punct('{')) => {
                    *i += 1;
                    while let Some(tok) = toks.get(*i).map(|t| &t.0) {
                        match tok {
                            Tok::Punct('}') => {
                                *i += 1;
                                return;
                            }
                            Tok::Punct(',') => *i += 1,
                            _ => tree(toks, i, &path, out),
                        }
                    }
                    return;
                }
                _ => break,
            }
        }
        let mut name = path.last().cloned();
        if path.last().map(String::as_str) == Some("self") {
            path.pop();
            name = path.last().cloned();
        }
        if toks.get(*i).map(|t| &t.0) == Some(&Tok::Ident("as".into())) {
            name = match toks.get(*i + 1).map(|t| &t.0) {
                Some(Tok::Ident(alias)) if alias != "_" => Some(alias.clone()),
                _ => None,
            };
            *i += 2;
        }
        out.push((path, name));
    }
    let mut out = Vec::new();
    let mut i = from;
    tree(toks, &mut i, &[], &mut out);
    while i < toks.len() && toks[i].0 != Tok::Punct(';') {
        i += 1;
    }
    (out, i + 1)
}

/// A module as read: where it is, what it declares.
#[derive(Debug, Default)]
struct Module {
    /// The file (or, inline, the file it is in), workspace-relative.
    file: String,
    /// The file's module: itself, or for an inline module the file's.
    node: Vec<String>,
    /// Its tokens (its own, not its inline children's).
    toks: Vec<Spanned>,
    /// Child modules by name.
    children: BTreeSet<String>,
    /// Its `use` items' leaves.
    uses: Vec<Use>,
    /// The `macro_rules!` it defines (an exported one is named at the
    /// crate root).
    macros: BTreeSet<String>,
}

/// One leaf of a `use` item.
#[derive(Debug)]
struct Use {
    /// The name it binds, if any.
    name: Option<String>,
    /// The full path.
    path: Vec<String>,
    /// Whether the item is `pub` (a re-export).
    reexport: bool,
    /// Its line.
    line: usize,
}

/// The crates to read: Rust name → directory under the workspace.
pub(crate) struct Scan {
    /// The workspace root.
    pub(crate) root: PathBuf,
    /// `("proxy_server", "proxy-server")`, …
    pub(crate) crates: Vec<(String, String)>,
}

impl Scan {
    /// Reads every scanned crate from its `src/lib.rs` down the `mod`
    /// declarations a debug build compiles.
    pub(crate) fn graph(&self) -> Result<Graph, String> {
        let mut modules: HashMap<(String, Vec<String>), Module> = HashMap::new();
        for (krate, dir) in &self.crates {
            let lib = self.root.join(dir).join("src/lib.rs");
            self.read(krate, &[], &lib, &mut modules)?;
        }
        let mut graph = Graph::default();
        let mut keys: Vec<_> = modules.keys().cloned().collect();
        keys.sort();
        for key in &keys {
            let module = &modules[key];
            let from = ModuleId {
                krate: key.0.clone(),
                path: module.node.clone(),
            };
            graph.modules.insert(from.clone());
            let mut named: Vec<(Vec<String>, usize)> = Vec::new();
            for Use {
                name,
                path,
                reexport,
                line,
            } in &module.uses
            {
                let used_here = name.as_ref().is_some_and(|n| {
                    module
                        .toks
                        .iter()
                        .filter(|t| t.0 == Tok::Ident(n.clone()))
                        .count()
                        > 0
                });
                if !reexport || used_here {
                    named.push((path.clone(), *line));
                }
            }
            named.extend(code_paths(&module.toks));
            for (path, line) in named {
                let Some(to) = self.resolve(&modules, key, &path, 0) else {
                    continue;
                };
                if to == from {
                    continue;
                }
                graph
                    .edges
                    .entry(from.clone())
                    .or_default()
                    .entry(to)
                    .or_insert_with(|| Site {
                        file: module.file.clone(),
                        line,
                        path: path.join("::"),
                    });
            }
        }
        Ok(graph)
    }

    /// Reads one module file and, recursively, the modules it declares.
    fn read(
        &self,
        krate: &str,
        path: &[String],
        file: &Path,
        modules: &mut HashMap<(String, Vec<String>), Module>,
    ) -> Result<(), String> {
        let src = std::fs::read_to_string(file)
            .map_err(|e| format!("reading {}: {e}", file.display()))?;
        let rel = file
            .strip_prefix(&self.root)
            .unwrap_or(file)
            .display()
            .to_string();
        let toks = compiled(spliced(lex(&src), file)?);
        // The directory of its children: `a/b.rs` → `a/b/`, `lib.rs` or
        // `mod.rs` → its own directory.
        let stem = file.file_stem().and_then(|s| s.to_str()).unwrap_or("");
        let dir = if matches!(stem, "lib" | "mod") {
            file.parent().map(Path::to_path_buf)
        } else {
            file.parent().map(|p| p.join(stem))
        }
        .unwrap_or_default();
        let mut files = Vec::new();
        split_inline(krate, path, &rel, path, toks, modules, &mut files);
        for child_path in files {
            // Under an inline module, its name is a directory too.
            let under = child_path[path.len()..].join("/");
            let flat = dir.join(format!("{under}.rs"));
            let nested = dir.join(&under).join("mod.rs");
            let child = if flat.exists() { flat } else { nested };
            self.read(krate, &child_path, &child, modules)?;
        }
        Ok(())
    }

    /// The module a path names, seen from `at`; `None` for a path outside
    /// the workspace (std, tokio) or a local name.
    fn resolve(
        &self,
        modules: &HashMap<(String, Vec<String>), Module>,
        at: &(String, Vec<String>),
        path: &[String],
        depth: usize,
    ) -> Option<ModuleId> {
        if depth > 16 || path.is_empty() {
            return None;
        }
        let here = modules.get(at)?;
        let (krate, mut cur, rest): (String, Vec<String>, &[String]) = match path[0].as_str() {
            "crate" => (at.0.clone(), Vec::new(), &path[1..]),
            "self" => (at.0.clone(), at.1.clone(), &path[1..]),
            "super" => {
                let mut cur = at.1.clone();
                let mut k = 0;
                while path.get(k).map(String::as_str) == Some("super") {
                    cur.pop();
                    k += 1;
                }
                (at.0.clone(), cur, &path[k..])
            }
            first if here.children.contains(first) => (at.0.clone(), at.1.clone(), path),
            first if self.crates.iter().any(|(c, _)| c == first) => {
                (first.to_owned(), Vec::new(), &path[1..])
            }
            first => {
                // A name a `use` of this module bound to a module (the `use`
                // itself already counts; this finds the module under it).
                let bound = here
                    .uses
                    .iter()
                    .find(|u| u.name.as_deref() == Some(first))?;
                let mut full = bound.path.clone();
                full.extend_from_slice(&path[1..]);
                return self.resolve(modules, at, &full, depth + 1);
            }
        };
        let mut k = 0;
        while let Some(seg) = rest.get(k) {
            let key = (krate.clone(), cur.clone());
            let module = modules.get(&key)?;
            if module.children.contains(seg) {
                cur.push(seg.clone());
                k += 1;
                continue;
            }
            // A re-export: follow it to where the item is.
            if let Some(export) = module
                .uses
                .iter()
                .find(|u| u.reexport && u.name.as_deref() == Some(seg.as_str()))
            {
                let mut full = export.path.clone();
                full.extend_from_slice(&rest[k + 1..]);
                if let Some(found) = self.resolve(modules, &key, &full, depth + 1) {
                    return Some(found);
                }
            }
            // An exported macro, named at the crate root: the module that
            // defines it.
            if cur.is_empty()
                && let Some(module) = modules
                    .iter()
                    .find(|((c, _), m)| *c == krate && m.macros.contains(seg))
                    .map(|(_, m)| m)
            {
                return Some(ModuleId {
                    krate,
                    path: module.node.clone(),
                });
            }
            break;
        }
        let module = modules.get(&(krate.clone(), cur))?;
        Some(ModuleId {
            krate,
            path: module.node.clone(),
        })
    }
}

/// Registers the module `path` from its tokens, and every inline module
/// in them as its own (belonging to the file's `node`); pushes the paths
/// of the file modules it declares (`mod x;`) onto `files`.
fn split_inline(
    krate: &str,
    path: &[String],
    file: &str,
    node: &[String],
    toks: Vec<Spanned>,
    modules: &mut HashMap<(String, Vec<String>), Module>,
    files: &mut Vec<Vec<String>>,
) {
    let mut module = Module {
        file: file.to_owned(),
        node: node.to_vec(),
        ..Module::default()
    };
    let mut i = 0;
    while i < toks.len() {
        let ident = |k: usize| match toks.get(k).map(|t| &t.0) {
            Some(Tok::Ident(s)) => Some(s.as_str()),
            _ => None,
        };
        match (ident(i), toks.get(i + 2).map(|t| &t.0)) {
            (Some("mod"), Some(Tok::Punct(';'))) => {
                if let Some(name) = ident(i + 1) {
                    module.children.insert(name.to_owned());
                    let mut child = path.to_vec();
                    child.push(name.to_owned());
                    files.push(child);
                }
                i += 3;
            }
            (Some("mod"), Some(Tok::Punct('{'))) => {
                let Some(name) = ident(i + 1) else {
                    i += 1;
                    continue;
                };
                module.children.insert(name.to_owned());
                let end = group_end(&toks, i + 2);
                let mut child = path.to_vec();
                child.push(name.to_owned());
                let inner = toks[i + 3..end].to_vec();
                split_inline(krate, &child, file, node, inner, modules, files);
                i = end + 1;
            }
            (Some("macro_rules"), _) if toks.get(i + 1).map(|t| &t.0) == Some(&Tok::Punct('!')) => {
                if let Some(name) = ident(i + 2) {
                    module.macros.insert(name.to_owned());
                }
                i += 1;
            }
            (Some("use"), next) if next.is_some() && toks[i + 1].0 != Tok::Punct('<') => {
                let reexport = i > 0
                    && (ident(i - 1) == Some("pub")
                        || (toks[i - 1].0 == Tok::Punct(')') && {
                            let mut k = i - 1;
                            while k > 0 && toks[k].0 != Tok::Punct('(') {
                                k -= 1;
                            }
                            k > 0 && ident(k - 1) == Some("pub")
                        }));
                let line = toks[i].1;
                let (leaves, next) = use_leaves(&toks, i + 1);
                for (path, name) in leaves {
                    module.uses.push(Use {
                        name,
                        path,
                        reexport,
                        line,
                    });
                }
                // The `use` item's tokens are not code paths.
                module.toks.push((Tok::Punct(';'), line));
                i = next;
            }
            _ => {
                module.toks.push(toks[i].clone());
                i += 1;
            }
        }
    }
    modules.insert((krate.to_owned(), path.to_vec()), module);
}

/// The paths in code: `a::b::c` sequences, each with its line. A path
/// that continues after generic arguments (`Vec::<u8>::new`) is cut at
/// them, and a path preceded by `::` or `.` is not one.
fn code_paths(toks: &[Spanned]) -> Vec<(Vec<String>, usize)> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < toks.len() {
        let starts = matches!(toks[i].0, Tok::Ident(_))
            && toks.get(i + 1).map(|t| &t.0) == Some(&Tok::PathSep)
            && !(i > 0 && matches!(toks[i - 1].0, Tok::PathSep | Tok::Punct('.')));
        if !starts {
            i += 1;
            continue;
        }
        let line = toks[i].1;
        let mut path = Vec::new();
        while let Some(Tok::Ident(seg)) = toks.get(i).map(|t| &t.0) {
            path.push(seg.clone());
            if toks.get(i + 1).map(|t| &t.0) != Some(&Tok::PathSep) {
                break;
            }
            i += 2;
        }
        i += 1;
        out.push((path, line));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The identifiers of `src`, in order.
    fn idents(toks: &[Spanned]) -> Vec<&str> {
        toks.iter()
            .filter_map(|(t, _)| match t {
                Tok::Ident(s) => Some(s.as_str()),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn lexer_skips_comments_and_literals() {
        let src = "// crate::a\n/* crate::b /* nested */ */ let s = \"crate::c\";\n\
                   r#\"crate::\"d\"#; '\\''; 'x'; 'a; packet.r#type; crate::e";
        let toks = lex(src);
        assert_eq!(idents(&toks), ["let", "s", "packet", "type", "crate", "e"]);
        assert_eq!(toks.last().map(|t| t.1), Some(3), "lines are counted");
    }

    #[test]
    fn cfg_is_read_for_a_debug_build_of_the_binaries() {
        for (pred, holds) in [
            ("test", false),
            ("any(test, feature = \"fuzzing\")", false),
            ("all(test, not(feature = \"loom\"))", false),
            ("feature = \"loom\"", false),
            ("not(feature = \"loom\")", true),
            ("all(debug_assertions, not(feature = \"loom\"))", true),
            ("feature = \"jemalloc\"", true),
            ("unix", true),
        ] {
            let toks: Vec<Tok> = lex(pred).into_iter().map(|t| t.0).collect();
            assert_eq!(cfg_holds(&toks), holds, "{pred}");
        }
    }

    #[test]
    fn items_a_false_cfg_guards_are_left_out() {
        let src = "use crate::a;\n#[cfg(test)]\nmod tests { use crate::b; }\n\
                   #[cfg(any(test, feature = \"fuzzing\"))] #[doc(hidden)] pub fn f() { crate::c::g() }\n\
                   struct S { #[cfg(test)] x: crate::d::X, y: crate::e::Y }\n\
                   #[cfg(not(test))] use crate::f;";
        let kept = compiled(lex(src));
        let words = idents(&kept).join(" ");
        for (name, kept_) in [
            ("a", true),
            ("b", false),
            ("c", false),
            ("d", false),
            ("e", true),
            ("f", true),
        ] {
            assert_eq!(
                words.split(' ').any(|w| w == name),
                kept_,
                "`{name}` in {words}"
            );
        }
    }

    #[test]
    fn use_trees_are_expanded() {
        let toks = lex("tunnel::{flow::{self, Flow as F}, ids::*, queue}; x");
        let (leaves, next) = use_leaves(&toks, 0);
        let leaves: Vec<(String, Option<String>)> = leaves
            .into_iter()
            .map(|(path, name)| (path.join("::"), name))
            .collect();
        let expected = [
            ("tunnel::flow", Some("flow")),
            ("tunnel::flow::Flow", Some("F")),
            ("tunnel::ids", None),
            ("tunnel::queue", Some("queue")),
        ];
        let expected: Vec<(String, Option<String>)> = expected
            .iter()
            .map(|(p, n)| ((*p).to_owned(), n.map(str::to_owned)))
            .collect();
        assert_eq!(leaves, expected);
        assert_eq!(toks[next].0, Tok::Ident("x".into()));
    }

    #[test]
    fn paths_in_code_are_found() {
        let toks = lex("let x = crate::conn::Conn::new(); y.z::<u8>(); super::a; Vec::<u8>::new()");
        let paths: Vec<String> = code_paths(&toks)
            .into_iter()
            .map(|(p, _)| p.join("::"))
            .collect();
        assert_eq!(paths, ["crate::conn::Conn::new", "super::a", "Vec"]);
    }
}
