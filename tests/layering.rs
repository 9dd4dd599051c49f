//! "Dependencies point one way", checked.
//!
//! Between crates the compiler enforces it: `fencegate-core` cannot name the
//! proxy. What this file checks is what the compiler does not:
//! - the core brings in no runtime and no I/O crate: its dependency tree is
//!   exactly the allowed list below (the standard library's file, network,
//!   process, thread and clock APIs are denied in it by clippy, through
//!   `crates/fencegate-core/clippy.toml`);
//! - inside the `fencegate` package, the `use` lines and `crate::` or
//!   `super::` paths between top-level modules of `src/` form no cycle, and
//!   the leaves named in `lib.rs` import nothing from the crate.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Top-level module → the top-level modules its code (not its tests) names.
fn imports() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut stack = vec![src.clone()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            let rel = path
                .strip_prefix(&src)
                .unwrap()
                .to_string_lossy()
                .into_owned();
            let module = rel
                .trim_end_matches(".rs")
                .split('/')
                .next()
                .unwrap()
                .to_owned();
            if module == "main" || module == "lib" {
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap();
            let code = text.split("#[cfg(test)]").next().unwrap_or_default();
            let names = graph.entry(module.clone()).or_default();
            // `super::` from `src/a.rs` or `src/a/mod.rs` is the crate root,
            // from `src/a/b.rs` it is `a`, and so on down.
            let depth = rel.split('/').count() - usize::from(rel.ends_with("mod.rs"));
            let to_root = "super::".repeat(depth);
            for (at, _) in code.match_indices(&to_root) {
                let rest = &code[at + to_root.len()..];
                if rest.starts_with("super::") {
                    continue;
                }
                assert!(
                    !rest.starts_with('{'),
                    "{rel}: name each module in its own `use super::…` line, so this check sees it"
                );
                let name: String = rest
                    .chars()
                    .take_while(|c| c.is_ascii_lowercase() || *c == '_')
                    .collect();
                if !name.is_empty() && name != module && rest[name.len()..].starts_with("::") {
                    names.insert(name);
                }
            }
            for (at, _) in code.match_indices("crate::") {
                let name: String = code[at + 7..]
                    .chars()
                    .take_while(|c| c.is_ascii_lowercase() || *c == '_')
                    .collect();
                assert!(
                    !code[at + 7..].starts_with('{'),
                    "{rel}: name each module in its own `use crate::…` line, so this check sees it"
                );
                if !name.is_empty() && name != module {
                    names.insert(name);
                }
            }
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

#[test]
fn modules_import_each_other_in_one_direction_only() {
    let graph = imports();
    assert!(graph.len() > 10, "{graph:?}");
    if let Some(found) = cycle(&graph) {
        panic!(
            "the modules import each other in a cycle: {}",
            found.join(" -> ")
        );
    }
    for leaf in ["body", "clock", "framing", "journal", "tls", "wire"] {
        assert_eq!(
            graph[leaf],
            BTreeSet::new(),
            "{leaf} imports from the crate"
        );
    }
    let importers = |target: &str| -> BTreeSet<&str> {
        graph
            .iter()
            .filter(|(_, names)| names.contains(target))
            .map(|(module, _)| module.as_str())
            .collect()
    };
    assert_eq!(importers("serve"), BTreeSet::new(), "start-up is the top");
    assert_eq!(
        importers("config"),
        BTreeSet::from(["app", "serve"]),
        "the config is read by start-up only"
    );
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
/// computation (hashing, checksums, byte buffers, inline strings) and the
/// macros they are built with. `libc` comes only through `cpufeatures`
/// (sha2's CPU feature probe, which reads the auxiliary vector on ARM).
const CORE_MAY_USE: &[&str] = &[
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
    "rustversion",
    "sha2",
    "static_assertions",
    "subtle",
    "typenum",
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
