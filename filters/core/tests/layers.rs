#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! The crate's structure, checked on its sources (natively only: it reads `src/`):
//!
//! - no import circle, between files nor between top-level modules: every `use crate::…`,
//!   `use super::…` tree and every inline `crate::a::b` / `super::a` path outside comments is an
//!   edge to the deepest module file it names;
//! - no source file over 600 lines.
#![cfg(not(target_arch = "wasm32"))]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

const MAX_LINES: usize = 600;

/// A module path, `["filter", "stages"]`; the crate root is empty.
type Module = Vec<String>;
/// Module → the modules it imports from.
type Edges = BTreeMap<Module, BTreeSet<Module>>;

/// Module path (`["filter", "stages"]`) → file, for every `.rs` under `src/`.
fn modules(src: &Path) -> BTreeMap<Vec<String>, PathBuf> {
    let mut out = BTreeMap::new();
    let mut dirs = vec![src.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
                continue;
            }
            if path.extension().and_then(|e| e.to_str()) != Some("rs") {
                continue;
            }
            let rel = path.strip_prefix(src).unwrap().with_extension("");
            let mut parts: Vec<String> = rel.iter().map(|p| p.to_string_lossy().into_owned()).collect();
            if parts == ["lib"] || parts.last().map(String::as_str) == Some("mod") {
                parts.pop();
            }
            out.insert(parts, path);
        }
    }
    out
}

/// The code without comments and string literals (doc links name modules without using them).
fn code_only(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < b.len() {
        if b[i..].starts_with(b"//") {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if b[i..].starts_with(b"/*") {
            while i < b.len() && !b[i..].starts_with(b"*/") {
                i += 1;
            }
            i += 2;
        } else if b[i] == b'"' {
            i += 1;
            while i < b.len() && b[i] != b'"' {
                i += if b[i] == b'\\' { 2 } else { 1 };
            }
            i += 1;
            out.push_str("\"\"");
        } else if b[i] == b'\'' && b.get(i + 2) == Some(&b'\'') {
            i += 3; // a char literal such as '"'
        } else {
            out.push(b[i] as char);
            i += 1;
        }
    }
    out
}

/// Every path of a `use` tree (`a::{b, c::{d}}` → `a::b`, `a::c::d`).
fn use_paths(tree: &str, prefix: &[String], out: &mut Vec<Vec<String>>) {
    let tree = tree.trim();
    if let Some(open) = tree.find('{') {
        let base: Vec<String> = tree[..open].split("::").map(str::trim).filter(|s| !s.is_empty()).map(String::from).collect();
        let inner = &tree[open + 1..tree.rfind('}').unwrap()];
        let mut prefix = prefix.to_vec();
        prefix.extend(base);
        let (mut depth, mut start) = (0, 0);
        for (i, c) in inner.char_indices() {
            match c {
                '{' => depth += 1,
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    use_paths(&inner[start..i], &prefix, out);
                    start = i + 1;
                }
                _ => {}
            }
        }
        if !inner[start..].trim().is_empty() {
            use_paths(&inner[start..], &prefix, out);
        }
        return;
    }
    let tree = tree.split(" as ").next().unwrap_or(tree);
    let mut path = prefix.to_vec();
    path.extend(tree.split("::").map(str::trim).filter(|s| !s.is_empty() && *s != "*").map(String::from));
    out.push(path);
}

/// Paths starting with `crate`, `super` or `self`: from `use` items and inline in the code.
fn paths(code: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let mut rest = code;
    while let Some(at) = rest.find("use ") {
        let before = rest[..at].chars().last();
        rest = &rest[at + 4..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue;
        }
        let item = &rest[..rest.find(';').unwrap_or(rest.len())];
        if ["crate", "super", "self"].iter().any(|p| item.trim_start().starts_with(p)) {
            use_paths(item, &[], &mut out);
        }
    }
    let bytes = code.as_bytes();
    for start in ["crate::", "super::"] {
        let mut from = 0;
        while let Some(i) = code[from..].find(start) {
            let at = from + i;
            from = at + start.len();
            if at > 0 && (bytes[at - 1].is_ascii_alphanumeric() || bytes[at - 1] == b'_') {
                continue;
            }
            let end = code[at..].find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':')).map_or(code.len(), |e| at + e);
            out.push(code[at..end].split("::").filter(|s| !s.is_empty()).map(String::from).collect());
        }
    }
    out
}

/// The module file a path names: its deepest prefix that is a module.
fn resolve(modules: &BTreeMap<Vec<String>, PathBuf>, from: &[String], path: &[String]) -> Option<Vec<String>> {
    let mut base: Vec<String> = Vec::new();
    let mut segs = path.iter().peekable();
    match segs.peek().map(|s| s.as_str()) {
        Some("crate") => {
            segs.next();
        }
        Some("super") | Some("self") => {
            base = from.to_vec();
            while let Some(s) = segs.peek().map(|s| s.as_str()) {
                match s {
                    "super" => base.pop(),
                    "self" => None,
                    _ => break,
                };
                segs.next();
            }
        }
        _ => return None,
    }
    base.extend(segs.filter(|s| *s != "self").cloned());
    (1..=base.len()).rev().map(|n| base[..n].to_vec()).find(|m| modules.contains_key(m))
}

/// The strongly connected components with more than one node (Tarjan).
fn cycles<N: Ord + Clone>(edges: &BTreeMap<N, BTreeSet<N>>) -> Vec<Vec<N>> {
    struct Tarjan<'a, N: Ord> {
        edges: &'a BTreeMap<N, BTreeSet<N>>,
        index: BTreeMap<N, usize>,
        low: BTreeMap<N, usize>,
        stack: Vec<N>,
        on: BTreeSet<N>,
        out: Vec<Vec<N>>,
    }
    impl<N: Ord + Clone> Tarjan<'_, N> {
        fn visit(&mut self, v: &N) {
            let i = self.index.len();
            self.index.insert(v.clone(), i);
            self.low.insert(v.clone(), i);
            self.stack.push(v.clone());
            self.on.insert(v.clone());
            for w in self.edges.get(v).into_iter().flatten() {
                if !self.index.contains_key(w) {
                    self.visit(w);
                    let l = self.low[w].min(self.low[v]);
                    self.low.insert(v.clone(), l);
                } else if self.on.contains(w) {
                    let l = self.index[w].min(self.low[v]);
                    self.low.insert(v.clone(), l);
                }
            }
            if self.low[v] == self.index[v] {
                let mut comp = Vec::new();
                loop {
                    let w = self.stack.pop().unwrap();
                    self.on.remove(&w);
                    let done = &w == v;
                    comp.push(w);
                    if done {
                        break;
                    }
                }
                if comp.len() > 1 {
                    self.out.push(comp);
                }
            }
        }
    }
    let mut t = Tarjan { edges, index: BTreeMap::new(), low: BTreeMap::new(), stack: Vec::new(), on: BTreeSet::new(), out: Vec::new() };
    for v in edges.keys() {
        if !t.index.contains_key(v) {
            t.visit(v);
        }
    }
    t.out
}

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// File-level import edges of the crate.
fn file_edges() -> (BTreeMap<Module, PathBuf>, Edges) {
    let modules = modules(&src());
    let mut edges = BTreeMap::new();
    for (module, file) in &modules {
        let code = code_only(&std::fs::read_to_string(file).unwrap());
        let targets: BTreeSet<Vec<String>> = paths(&code)
            .iter()
            .filter_map(|p| resolve(&modules, module, p))
            .filter(|t| t != module && !t.is_empty())
            .collect();
        edges.insert(module.clone(), targets);
    }
    (modules, edges)
}

#[test]
fn no_import_circle_between_files_or_top_level_modules() {
    let (modules, edges) = file_edges();
    assert!(edges.len() > 20, "the scan found the modules: {:?}", modules.keys());
    assert!(
        edges.values().map(BTreeSet::len).sum::<usize>() > 40,
        "the scan found the imports: {edges:?}"
    );
    let files: Vec<Vec<String>> = cycles(&edges)
        .into_iter()
        .map(|c| c.iter().map(|m| modules[m].strip_prefix(src()).unwrap().display().to_string()).collect())
        .collect();
    assert!(files.is_empty(), "files importing each other in a circle: {files:?}");
    let mut top: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (from, to) in &edges {
        let Some(a) = from.first() else { continue };
        for b in to.iter().filter_map(|t| t.first()).filter(|b| *b != a) {
            top.entry(a.clone()).or_default().insert(b.clone());
        }
    }
    assert!(cycles(&top).is_empty(), "top-level modules importing each other in a circle: {:?}", cycles(&top));
}

#[test]
fn the_scan_sees_a_circle_when_there_is_one() {
    let modules: BTreeMap<Vec<String>, PathBuf> =
        [vec![], vec!["a".to_string()], vec!["b".to_string()], vec!["b".to_string(), "c".to_string()]]
            .into_iter()
            .map(|m| (m, PathBuf::new()))
            .collect();
    let a = vec!["a".to_string()];
    let c = vec!["b".to_string(), "c".to_string()];
    let code = code_only("use crate::b::{c::Thing, self};\n// use crate::nothing;\nfn f() { crate::a::g(); let s = \"crate::x\"; }");
    let found: BTreeSet<Option<Vec<String>>> = paths(&code).iter().map(|p| resolve(&modules, &a, p)).collect();
    assert_eq!(found, BTreeSet::from([Some(c.clone()), Some(vec!["b".to_string()]), Some(a.clone())]));
    assert_eq!(resolve(&modules, &c, &["super".into(), "super".into(), "a".into(), "X".into()]), Some(a.clone()));
    let edges: Edges =
        [(a.clone(), BTreeSet::from([c.clone()])), (c.clone(), BTreeSet::from([a.clone()]))].into_iter().collect();
    assert_eq!(cycles(&edges).len(), 1);
}

#[test]
fn no_source_file_over_600_lines() {
    let long: Vec<(String, usize)> = modules(&src())
        .values()
        .map(|f| (f.strip_prefix(src()).unwrap().display().to_string(), std::fs::read_to_string(f).unwrap().lines().count()))
        .filter(|(_, n)| *n > MAX_LINES)
        .collect();
    assert!(long.is_empty(), "split these: {long:?}");
}
