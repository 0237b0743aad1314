//! The controller's modules import each other without a circle.
//!
//! Reads `src/controller/**/*.rs`, resolves every path that names a module
//! of the controller (`use` trees with their groups, and paths in code:
//! `super::x`, `crate::controller::x`, `self::x`, a child module's name)
//! to the deepest module file it reaches, and looks for cycles twice: among
//! the module files (`supervisor::converge` is its own node) and among the
//! controller's direct children (`supervisor` and all below it are one
//! node). A module reaching into one of its own ancestors is not an edge:
//! a child sees its parent's items as its scope (`use super::*` in a test
//! module, `super::Command` in the supervisor's task). Comments and string
//! literals are skipped, so doc links are no imports.

#![allow(clippy::unwrap_used)] // test helpers outside #[test] functions

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A module path below the crate root, e.g. `["controller", "kube", "stores"]`.
type Module = Vec<String>;

/// Where an edge was seen: file and line.
type Evidence = (PathBuf, usize);

#[derive(Debug, Clone, PartialEq)]
enum Token {
    Ident(String),
    Colons,
    Open,
    Close,
    Comma,
    Semi,
    Star,
    Other,
}

/// The tokens of `src` with their lines; comments, strings and char
/// literals dropped.
fn tokens(src: &str) -> Vec<(Token, usize)> {
    let b = src.as_bytes();
    let mut out = Vec::new();
    let (mut i, mut line) = (0, 1);
    let at = |i: usize, s: &str| b[i..].starts_with(s.as_bytes());
    while i < b.len() {
        let c = b[i];
        if c == b'\n' {
            line += 1;
            i += 1;
        } else if c.is_ascii_whitespace() {
            i += 1;
        } else if at(i, "//") {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if at(i, "/*") {
            let mut depth = 0;
            while i < b.len() {
                if at(i, "/*") {
                    depth += 1;
                    i += 2;
                } else if at(i, "*/") {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    line += usize::from(b[i] == b'\n');
                    i += 1;
                }
            }
        } else if (c == b'r' || c == b'b') && raw_string_start(b, i).is_some() {
            let (hashes, start) = raw_string_start(b, i).unwrap();
            let end = format!("\"{}", "#".repeat(hashes));
            i = start;
            while i < b.len() && !at(i, &end) {
                line += usize::from(b[i] == b'\n');
                i += 1;
            }
            i += end.len();
        } else if c == b'"' || (c == b'b' && b.get(i + 1) == Some(&b'"')) {
            i += if c == b'b' { 2 } else { 1 };
            while i < b.len() && b[i] != b'"' {
                if b[i] == b'\\' {
                    i += 1;
                }
                line += usize::from(b.get(i) == Some(&b'\n'));
                i += 1;
            }
            i += 1;
        } else if c == b'\'' {
            // A char literal ('x', '\n', '\u{..}') or a lifetime ('a).
            if b.get(i + 1) == Some(&b'\\') {
                i += 2;
                while i < b.len() && b[i] != b'\'' {
                    i += 1;
                }
                i += 1;
            } else if b.get(i + 2) == Some(&b'\'') {
                i += 3;
            } else {
                let ch = src[i + 1..].chars().next().unwrap_or(' ');
                if !ch.is_ascii() && src[i + 1 + ch.len_utf8()..].starts_with('\'') {
                    i += 2 + ch.len_utf8();
                } else {
                    i += 1; // a lifetime: its name follows as an identifier
                }
            }
        } else if c == b'_' || c.is_ascii_alphabetic() {
            let start = i;
            while i < b.len() && (b[i] == b'_' || b[i].is_ascii_alphanumeric()) {
                i += 1;
            }
            let word = &src[start..i];
            let word = word.strip_prefix("r#").unwrap_or(word);
            out.push((Token::Ident(word.to_owned()), line));
        } else {
            let t = match c {
                b':' if at(i, "::") => {
                    i += 1;
                    Token::Colons
                }
                b'{' => Token::Open,
                b'}' => Token::Close,
                b',' => Token::Comma,
                b';' => Token::Semi,
                b'*' => Token::Star,
                _ => Token::Other,
            };
            out.push((t, line));
            i += 1;
        }
    }
    out
}

/// `(hashes, index after the opening quote)` when a raw string starts at `i`.
fn raw_string_start(b: &[u8], i: usize) -> Option<(usize, usize)> {
    let mut j = i;
    if b[j] == b'b' {
        j += 1;
    }
    if b.get(j) != Some(&b'r') || (i > 0 && (b[i - 1] == b'_' || b[i - 1].is_ascii_alphanumeric())) {
        return None;
    }
    j += 1;
    let hashes = b[j..].iter().take_while(|&&c| c == b'#').count();
    (b.get(j + hashes) == Some(&b'"')).then_some((hashes, j + hashes + 1))
}

/// Every module file under `dir`, by module path (`mod.rs` is its folder).
fn module_files(root: &Path, dir: &Path, out: &mut BTreeMap<Module, PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            module_files(root, &path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            let rel = path.strip_prefix(root).unwrap().with_extension("");
            let mut module: Module = rel.iter().map(|s| s.to_string_lossy().into_owned()).collect();
            if module.last().is_some_and(|s| s == "mod") {
                module.pop();
            }
            out.insert(module, path);
        }
    }
}

/// The paths a file names, each with the module it is written in (inline
/// `mod x { .. }` blocks included) and its line.
fn paths(file_module: &Module, toks: &[(Token, usize)]) -> Vec<(Module, Vec<String>, usize)> {
    let mut out = Vec::new();
    // Inline modules: (name, brace depth at which it closes).
    let mut inline: Vec<(String, usize)> = Vec::new();
    let mut depth = 0usize;
    let here = |inline: &[(String, usize)]| {
        let mut m = file_module.clone();
        m.extend(inline.iter().map(|(n, _)| n.clone()));
        m
    };
    let mut i = 0;
    while i < toks.len() {
        match &toks[i].0 {
            Token::Open => depth += 1,
            Token::Close => {
                depth = depth.saturating_sub(1);
                if inline.last().is_some_and(|(_, d)| *d == depth) {
                    inline.pop();
                }
            }
            Token::Ident(w) if w == "mod" => {
                if let (Some((Token::Ident(name), _)), Some((Token::Open, _))) =
                    (toks.get(i + 1), toks.get(i + 2))
                {
                    inline.push((name.clone(), depth));
                    depth += 1;
                    i += 3;
                    continue;
                }
            }
            Token::Ident(w) if w == "use" => {
                let (mut found, end) = use_tree(toks, i + 1, Vec::new());
                let module = here(&inline);
                out.extend(found.drain(..).map(|(p, line)| (module.clone(), p, line)));
                i = end;
                continue;
            }
            Token::Ident(first) if i == 0 || toks[i - 1].0 != Token::Colons => {
                let line = toks[i].1;
                let mut path = vec![first.clone()];
                let mut j = i + 1;
                while let (Some((Token::Colons, _)), Some((Token::Ident(next), _))) =
                    (toks.get(j), toks.get(j + 1))
                {
                    path.push(next.clone());
                    j += 2;
                }
                if path.len() > 1 {
                    out.push((here(&inline), path, line));
                }
                i = j;
                continue;
            }
            _ => {}
        }
        i += 1;
    }
    out
}

/// The paths of one `use` tree starting at `i` under `prefix`, and the
/// index after it.
fn use_tree(
    toks: &[(Token, usize)],
    mut i: usize,
    mut prefix: Vec<String>,
) -> (Vec<(Vec<String>, usize)>, usize) {
    let mut out = Vec::new();
    loop {
        match toks.get(i) {
            Some((Token::Ident(w), line)) => {
                if w == "as" {
                    i += 2; // the alias
                    out.push((prefix.clone(), *line));
                    return (out, i);
                }
                if w != "self" || prefix.is_empty() {
                    prefix.push(w.clone());
                }
                i += 1;
                if !matches!(toks.get(i), Some((Token::Colons, _))) {
                    out.push((prefix, *line));
                    return (out, i);
                }
                i += 1;
            }
            Some((Token::Star, line)) => {
                out.push((prefix, *line));
                return (out, i + 1);
            }
            Some((Token::Open, _)) => {
                i += 1;
                loop {
                    match toks.get(i) {
                        Some((Token::Close, _)) => return (out, i + 1),
                        Some((Token::Comma, _)) => i += 1,
                        Some(_) => {
                            let (found, end) = use_tree(toks, i, prefix.clone());
                            out.extend(found);
                            i = end;
                        }
                        None => return (out, i),
                    }
                }
            }
            _ => return (out, i + 1),
        }
    }
}

/// The module file `path`, written in `here`, reaches (the deepest one).
fn resolve(modules: &BTreeMap<Module, PathBuf>, here: &Module, path: &[String]) -> Option<Module> {
    let mut at: Module;
    let mut rest = path;
    match path.first().map(String::as_str) {
        Some("crate") => {
            at = Vec::new();
            rest = &path[1..];
        }
        Some("self") => {
            at = here.clone();
            rest = &path[1..];
        }
        Some("super") => {
            at = here.clone();
            while rest.first().is_some_and(|s| s == "super") {
                at.pop()?;
                rest = &rest[1..];
            }
        }
        Some(first) => {
            // A child module of the module it is written in.
            let mut child = here.clone();
            child.push(first.to_owned());
            if !modules.contains_key(&child) {
                return None;
            }
            at = here.clone();
        }
        None => return None,
    }
    let mut reached = modules.contains_key(&at).then(|| at.clone());
    if !matches!(path.first().map(String::as_str), Some("crate" | "self" | "super")) {
        reached = None;
    }
    for seg in rest {
        at.push(seg.clone());
        if modules.contains_key(&at) {
            reached = Some(at.clone());
        } else {
            break;
        }
    }
    reached
}

/// The module file that holds `m` (inline modules belong to their file).
fn owner(modules: &BTreeMap<Module, PathBuf>, m: &Module) -> Module {
    let mut m = m.clone();
    while !modules.contains_key(&m) {
        m.pop();
    }
    m
}

type Graph = BTreeMap<String, BTreeMap<String, Evidence>>;

/// The import graph of the controller's module files, each node named by
/// `node` (edges inside one node dropped).
fn graph(node: impl Fn(&Module) -> String) -> Graph {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut modules = BTreeMap::new();
    module_files(&root, &root.join("controller"), &mut modules);
    let mut g = Graph::new();
    for (module, file) in &modules {
        g.entry(node(module)).or_default();
        let src = std::fs::read_to_string(file).unwrap();
        for (here, path, line) in paths(module, &tokens(&src)) {
            let Some(target) = resolve(&modules, &here, &path) else {
                continue;
            };
            let from = owner(&modules, &here);
            if target.len() < 2 || from.starts_with(&target) {
                continue; // the crate's controller root, or an ancestor: scope, not an import
            }
            let (a, b) = (node(&from), node(&target));
            if a != b {
                g.entry(a).or_default().entry(b).or_insert_with(|| {
                    (
                        file.strip_prefix(root.parent().unwrap()).unwrap().to_owned(),
                        line,
                    )
                });
            }
        }
    }
    g
}

/// The strongly connected components of more than one node (Tarjan).
fn cycles(g: &Graph) -> Vec<Vec<String>> {
    struct State<'a> {
        g: &'a Graph,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        out: Vec<Vec<String>>,
    }
    fn visit<'a>(s: &mut State<'a>, v: &'a str) {
        let n = s.index.len();
        s.index.insert(v, n);
        s.low.insert(v, n);
        s.stack.push(v);
        s.on_stack.insert(v);
        for w in s.g[v].keys() {
            let w = w.as_str();
            if !s.index.contains_key(w) {
                visit(s, w);
                let lw = s.low[w];
                let lv = s.low.get_mut(v).unwrap();
                *lv = (*lv).min(lw);
            } else if s.on_stack.contains(w) {
                let iw = s.index[w];
                let lv = s.low.get_mut(v).unwrap();
                *lv = (*lv).min(iw);
            }
        }
        if s.low[v] == s.index[v] {
            let mut scc = Vec::new();
            loop {
                let w = s.stack.pop().unwrap();
                s.on_stack.remove(w);
                scc.push(w.to_owned());
                if w == v {
                    break;
                }
            }
            if scc.len() > 1 {
                scc.sort();
                s.out.push(scc);
            }
        }
    }
    let mut s = State {
        g,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in g.keys() {
        if !s.index.contains_key(v.as_str()) {
            visit(&mut s, v);
        }
    }
    s.out
}

/// One circle through the component `scc`, each edge with where it is written.
fn describe(g: &Graph, scc: &[String]) -> String {
    let inside: BTreeSet<&str> = scc.iter().map(String::as_str).collect();
    let start = scc[0].as_str();
    // Breadth-first from each successor of `start` back to `start`.
    let mut prev: BTreeMap<&str, &str> = BTreeMap::new();
    let mut queue = std::collections::VecDeque::from([start]);
    let mut seen = BTreeSet::from([start]);
    'search: while let Some(v) = queue.pop_front() {
        for w in g[v].keys().map(String::as_str).filter(|w| inside.contains(w)) {
            if w == start {
                prev.insert("", v);
                break 'search;
            }
            if seen.insert(w) {
                prev.insert(w, v);
                queue.push_back(w);
            }
        }
    }
    let mut path = vec![start];
    let mut v = prev[""];
    while v != start {
        path.push(v);
        v = prev[v];
    }
    path.push(start);
    path.reverse();
    let hops: Vec<String> = path
        .windows(2)
        .map(|w| {
            let (file, line) = &g[w[0]][w[1]];
            format!("  {} -> {} ({}:{line})", w[0], w[1], file.display())
        })
        .collect();
    format!("{{{}}}\n{}", scc.join(", "), hops.join("\n"))
}

fn assert_acyclic(level: &str, g: &Graph) {
    let found: Vec<String> = cycles(g).iter().map(|scc| describe(g, scc)).collect();
    assert!(
        found.is_empty(),
        "import cycles among the controller's {level}:\n{}",
        found.join("\n")
    );
}

fn name(m: &Module) -> String {
    m[1..].join("::")
}

#[test]
fn the_controller_module_files_import_each_other_without_a_cycle() {
    let g = graph(name);
    assert!(
        g.contains_key("supervisor::converge"),
        "the graph reads the module files: {:?}",
        g.keys()
    );
    assert!(
        g["core"].contains_key("supervisor"),
        "the graph has the core's edges: {:?}",
        g["core"]
    );
    assert_acyclic("module files", &g);
}

#[test]
fn the_controller_top_level_modules_import_each_other_without_a_cycle() {
    let g = graph(|m| m[..m.len().min(2)][1..].join("::"));
    assert_acyclic("top-level modules", &g);
}

#[test]
fn the_import_reader_resolves_use_trees_and_paths() {
    let modules: BTreeMap<Module, PathBuf> =
        ["controller", "controller::a", "controller::b", "controller::b::c"]
            .iter()
            .map(|m| (m.split("::").map(str::to_owned).collect(), PathBuf::new()))
            .collect();
    let here: Module = vec!["controller".into(), "b".into()];
    let src = r#"
        //! [`super::a::X`] is a doc link, no import
        use super::{a::{self, Y}, b};
        use c::Z;
        fn f() { let s = "crate::controller::a::X"; crate::controller::a::g(); }
        mod tests { use super::*; use super::super::a::T; }
    "#;
    let found: BTreeSet<(String, String)> = paths(&here, &tokens(src))
        .into_iter()
        .filter_map(|(at, p, _)| Some((at.join("::"), resolve(&modules, &at, &p)?.join("::"))))
        .collect();
    let want: BTreeSet<(String, String)> = [
        ("controller::b", "controller::a"),
        ("controller::b", "controller::b"),
        ("controller::b", "controller::b::c"),
        ("controller::b::tests", "controller::b"),
        ("controller::b::tests", "controller::a"),
    ]
    .iter()
    .map(|(a, b)| ((*a).to_owned(), (*b).to_owned()))
    .collect();
    assert_eq!(found, want);
}
