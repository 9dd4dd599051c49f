//! "Dependencies point one way", checked.
//!
//! Between crates the compiler enforces it: `fencegate-core` cannot name the
//! proxy. What this file checks is what the compiler does not:
//! - the core brings in no runtime and no I/O crate: its dependency tree is
//!   exactly the allowed list below (the standard library's file, network,
//!   process, thread and clock APIs are denied in it by clippy, through
//!   `crates/fencegate-core/clippy.toml`);
//! - inside the `fencegate` package, the modules of `src/` use each other
//!   exactly as the module graph in `src/lib.rs` says, which has no cycle:
//!   every `use` and every path (in code, types, patterns, macro
//!   arguments, visibility), tests included, parsed with `syn`, `crate::`,
//!   `super::` and `self::` resolved from the module they are written in.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use proc_macro2::{TokenStream, TokenTree};
use syn::visit::Visit;

type Graph = BTreeMap<String, BTreeSet<String>>;

/// The top-level modules of `src` (a crate's source directory) and, for
/// each, the top-level modules its files name.
fn imports(src: &Path) -> Graph {
    let mut graph = Graph::new();
    let mut stack = vec![src.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let rel = path
                .strip_prefix(src)
                .unwrap()
                .to_string_lossy()
                .into_owned();
            // The module the file is: src/a.rs and src/a/mod.rs are `a`,
            // src/a/b.rs is `a::b`.
            let mut module: Vec<String> = rel
                .trim_end_matches(".rs")
                .split('/')
                .map(str::to_owned)
                .collect();
            if module.last().is_some_and(|m| m == "mod") {
                module.pop();
            }
            if module == ["main"] || module == ["lib"] {
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap();
            let file = syn::parse_file(&text).unwrap_or_else(|e| panic!("{rel}: {e}"));
            let mut uses = Uses {
                module,
                paths: Vec::new(),
            };
            uses.visit_file(&file);
            let top = uses.module[0].clone();
            let names = graph.entry(top.clone()).or_default();
            for path in uses.paths {
                if let Some(first) = path.first() {
                    if *first != top {
                        names.insert(first.clone());
                    }
                }
            }
        }
    }
    graph
}

/// The absolute paths (from the crate root) a file names.
struct Uses {
    /// The module being read: the file's, and the inline modules in it.
    module: Vec<String>,
    paths: Vec<Vec<String>>,
}

impl Uses {
    /// `segments` (as written) from the crate root, if they start at
    /// `crate`, `super` or `self`; other paths name extern crates, or
    /// items brought in by a `use` (itself read).
    fn resolve(&mut self, segments: &[String]) {
        let mut at = match segments.first().map(String::as_str) {
            Some("crate") => Vec::new(),
            Some("super" | "self") => self.module.clone(),
            _ => return,
        };
        let mut rest = segments;
        if rest[0] == "crate" {
            rest = &rest[1..];
        }
        while let Some(first) = rest.first() {
            match first.as_str() {
                "super" => {
                    at.pop();
                }
                "self" => {}
                _ => break,
            }
            rest = &rest[1..];
        }
        at.extend(rest.iter().cloned());
        self.paths.push(at);
    }

    fn use_tree(&mut self, prefix: &mut Vec<String>, tree: &syn::UseTree) {
        match tree {
            syn::UseTree::Path(p) => {
                prefix.push(p.ident.to_string());
                self.use_tree(prefix, &p.tree);
                prefix.pop();
            }
            syn::UseTree::Name(n) => {
                prefix.push(n.ident.to_string());
                self.resolve(&prefix.clone());
                prefix.pop();
            }
            syn::UseTree::Rename(r) => {
                prefix.push(r.ident.to_string());
                self.resolve(&prefix.clone());
                prefix.pop();
            }
            syn::UseTree::Glob(_) => self.resolve(&prefix.clone()),
            syn::UseTree::Group(g) => {
                for tree in &g.items {
                    self.use_tree(prefix, tree);
                }
            }
        }
    }

    /// Paths in a macro's tokens (`matches!(x, crate::a::B)`, a `select!`
    /// arm): `crate`, `super` or `self`, then `::`-separated names.
    fn tokens(&mut self, tokens: TokenStream) {
        let tokens: Vec<TokenTree> = tokens.into_iter().collect();
        let mut i = 0;
        while i < tokens.len() {
            if let TokenTree::Group(g) = &tokens[i] {
                self.tokens(g.stream());
                i += 1;
                continue;
            }
            let mut path = Vec::new();
            let mut j = i;
            while let Some(TokenTree::Ident(ident)) = tokens.get(j) {
                path.push(ident.to_string());
                let colons = matches!(
                    (tokens.get(j + 1), tokens.get(j + 2)),
                    (Some(TokenTree::Punct(a)), Some(TokenTree::Punct(b)))
                        if a.as_char() == ':' && b.as_char() == ':'
                );
                if !colons {
                    break;
                }
                j += 3;
            }
            if path.len() > 1 {
                self.resolve(&path);
            }
            i = j.max(i + 1);
        }
    }
}

impl<'ast> Visit<'ast> for Uses {
    fn visit_item_mod(&mut self, item: &'ast syn::ItemMod) {
        if item.content.is_some() {
            self.module.push(item.ident.to_string());
            syn::visit::visit_item_mod(self, item);
            self.module.pop();
        }
    }

    fn visit_item_use(&mut self, item: &'ast syn::ItemUse) {
        self.use_tree(&mut Vec::new(), &item.tree);
    }

    fn visit_path(&mut self, path: &'ast syn::Path) {
        let segments: Vec<String> = path.segments.iter().map(|s| s.ident.to_string()).collect();
        if segments.len() > 1 {
            self.resolve(&segments);
        }
        syn::visit::visit_path(self, path);
    }

    fn visit_macro(&mut self, mac: &'ast syn::Macro) {
        self.tokens(mac.tokens.clone());
        syn::visit::visit_macro(self, mac);
    }
}

/// The module graph a `lib.rs` draws: the lines ``- `a` → `b`, `c` ``
/// (or ``- `a`, `b` → nothing``) under its "Module graph" heading.
fn drawn(lib: &Path) -> Graph {
    let lib = std::fs::read_to_string(lib).unwrap();
    let section = lib
        .split("//! # Module graph")
        .nth(1)
        .expect("the lib.rs has a \"Module graph\" section");
    let mut graph = Graph::new();
    for line in section.lines().skip(1) {
        let Some(line) = line.strip_prefix("//!") else {
            break;
        };
        let line = line.trim();
        if line.starts_with("# ") {
            break;
        }
        let Some((from, to)) = line.strip_prefix("- ").and_then(|l| l.split_once('→')) else {
            continue;
        };
        let names = |s: &str| -> BTreeSet<String> {
            s.split(',')
                .map(|n| n.trim().trim_matches('`').to_owned())
                .filter(|n| !n.is_empty() && n != "nothing")
                .collect()
        };
        for from in names(from) {
            graph.insert(from, names(to));
        }
    }
    graph
}

/// A cycle in `graph`, if there is one.
fn cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|n| n == node) {
            let mut found = path[at..].to_vec();
            found.push(node.to_owned());
            return Some(found);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_owned());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(found) = visit(next, graph, path, done) {
                return Some(found);
            }
        }
        path.pop();
        done.insert(node.to_owned());
        None
    }
    let mut done = BTreeSet::new();
    graph
        .keys()
        .find_map(|node| visit(node, graph, &mut Vec::new(), &mut done))
}

/// Whether the modules of the crate at `dir` (relative to the package) use
/// each other as its `src/lib.rs` draws, with no cycle: the graph.
fn as_drawn(dir: &str) -> Graph {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join(dir);
    let graph = imports(&root.join("src"));
    assert!(graph.len() > 5, "{graph:?}");
    if let Some(found) = cycle(&graph) {
        panic!(
            "{dir}: the modules use each other in a cycle: {}",
            found.join(" -> ")
        );
    }
    let drawn = drawn(&root.join("src/lib.rs"));
    if graph != drawn {
        let mut diff = String::new();
        for module in graph.keys().chain(drawn.keys()).collect::<BTreeSet<_>>() {
            let (is, says) = (graph.get(module), drawn.get(module));
            if is != says {
                diff.push_str(&format!("\n  {module}: uses {is:?}, lib.rs says {says:?}"));
            }
        }
        panic!("{dir}src/lib.rs's module graph is not the code's:{diff}");
    }
    graph
}

#[test]
fn modules_use_each_other_as_lib_rs_draws_and_in_one_direction_only() {
    let graph = as_drawn("");
    assert!(
        graph.values().all(|names| !names.contains("serve")),
        "start-up is the top"
    );
}

#[test]
fn the_core_s_modules_use_each_other_as_its_lib_rs_draws() {
    as_drawn("crates/fencegate-core/");
}

/// A source tree of `files` (path, text) in a fresh directory.
fn tree(tag: &str, files: &[(&str, &str)]) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("fencegate-layering-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    for (path, text) in files {
        let path = dir.join(path);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    }
    dir
}

/// A cycle made only by an inline path in a function body, or only by a
/// test module's `use`, is found; `super::` counts from the module it is
/// written in (an inline test module's is one deeper than its file's).
#[test]
fn the_check_sees_inline_paths_test_modules_and_macros() {
    let dir = tree(
        "planted",
        &[
            ("a.rs", "pub fn f() { crate::b::g() }\n"),
            (
                "b.rs",
                "pub fn g() {}\n#[cfg(test)]\nmod tests { use super::super::c::H; }\n",
            ),
            ("c/mod.rs", "mod d;\n"),
            (
                "c/d.rs",
                "fn x() -> bool { matches!(1, super::super::e::K) }\n",
            ),
            (
                "e.rs",
                "pub(crate) fn y() -> u8 { self::z() }\nfn z() -> u8 { 0 }\n",
            ),
        ],
    );
    let graph = imports(&dir);
    let _ = std::fs::remove_dir_all(&dir);
    let names = |m: &str| graph[m].iter().map(String::as_str).collect::<Vec<_>>();
    assert_eq!(names("a"), ["b"]);
    assert_eq!(names("b"), ["c"]);
    assert_eq!(names("c"), ["e"]);
    assert_eq!(names("e"), Vec::<&str>::new());

    let dir = tree(
        "cycle",
        &[
            ("server.rs", "use crate::backend::ClientAddr;\n"),
            (
                "backend.rs",
                "fn f() { let _ = crate::server::ClientExecutor::here(); }\n",
            ),
        ],
    );
    let graph = imports(&dir);
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(cycle(&graph).unwrap().len(), 3, "{graph:?}");
}

#[test]
fn the_check_finds_a_cycle() {
    let graph: BTreeMap<String, BTreeSet<String>> = [
        ("a", vec!["b"]),
        ("b", vec!["c"]),
        ("c", vec!["a"]),
        ("d", vec![]),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.into_iter().map(str::to_owned).collect()))
    .collect();
    assert_eq!(cycle(&graph).unwrap().len(), 4);
}

/// The crates `fencegate-core` may depend on, on any target: pure
/// computation (hashing, checksums, byte buffers, inline strings,
/// percent-decoding, base64 and JSON for the bodies of SPEC §11) and the
/// macros they are built with. `libc` comes only through `cpufeatures`
/// (sha2's CPU feature probe, which reads the auxiliary vector on ARM).
const CORE_MAY_USE: &[&str] = &[
    "base64",
    "block-buffer",
    "bytes",
    "castaway",
    "cfg-if",
    "compact_str",
    "cpufeatures",
    "crc32fast",
    "crypto-common",
    "digest",
    "fencegate-core",
    "generic-array",
    "itoa",
    "libc",
    "memchr",
    "percent-encoding",
    "proc-macro2",
    "quote",
    "rustversion",
    "serde",
    "serde_core",
    "serde_derive",
    "serde_json",
    "sha2",
    "static_assertions",
    "subtle",
    "syn",
    "typenum",
    "unicode-ident",
    "version_check",
    "zmij",
];

/// The names of the crates in `package`'s dependency tree (normal and
/// build dependencies) for `target` ("all", or the host's with `None`).
fn dependency_tree(package: &str, target: Option<&str>) -> String {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let out = std::process::Command::new(cargo)
        .args(["tree", "--offline", "--locked", "-p", package])
        .args(["-e", "normal,build", "--prefix", "none", "--format", "{p}"])
        .args(target.map(|t| ["--target", t]).into_iter().flatten())
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// The core's dependency tree: no runtime, no I/O crate, nothing but the
/// allowed list.
#[test]
fn the_core_depends_on_no_runtime_and_no_io_crate() {
    let tree = dependency_tree("fencegate-core", Some("all"));
    let crates: BTreeSet<&str> = tree
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    assert!(crates.contains("sha2"), "{tree}");
    let extra: Vec<&&str> = crates
        .iter()
        .filter(|c| !CORE_MAY_USE.contains(c))
        .collect();
    assert!(
        extra.is_empty(),
        "fencegate-core depends on {extra:?}: the core must stay free of I/O and runtimes \
         (if the crate is pure computation, add it to CORE_MAY_USE with the reason)"
    );
    for banned in ["tokio", "mio", "socket2", "hyper", "getrandom"] {
        assert!(!crates.contains(banned), "{banned}");
    }
}

/// The client crate brings what a program that takes leases needs, not the
/// proxy: no server side of hyper, no metrics, no command line, no
/// concurrent map, and not the proxy crate itself.
#[test]
fn the_client_depends_on_nothing_of_the_proxy() {
    // The host's tree: other platforms' TLS roots (macOS, Windows) are not
    // fetched by an offline build here.
    let tree = dependency_tree("fencegate-client", None);
    let crates: BTreeSet<&str> = tree
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    assert!(crates.contains("hyper-util"), "{tree}");
    for banned in [
        "fencegate",
        "dashmap",
        "prometheus-client",
        "clap",
        "tracing-subscriber",
        "hdrhistogram",
        "toml",
    ] {
        assert!(!crates.contains(banned), "the client depends on {banned}");
    }
}
