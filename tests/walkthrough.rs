//! The README's walkthrough, run as written against the real binary: the
//! block after `<!-- walkthrough -->`, with only the server's address
//! replaced by a free port's; the same for the docs' examples. Every `#>` line in it is output the commands
//! must print, in order (`…` stands for a part that differs per run).

mod support;

use std::process::Command;

use support::proc::{serve_args, Proc, TempDir};

/// Whether `line` matches `pattern`, where `…` matches any text.
fn matches(pattern: &str, line: &str) -> bool {
    let mut parts = pattern.split('…');
    let first = parts.next().unwrap_or_default();
    let Some(mut rest) = line.strip_prefix(first) else {
        return false;
    };
    let parts: Vec<&str> = parts.collect();
    for (i, part) in parts.iter().enumerate() {
        if i + 1 == parts.len() {
            return rest.ends_with(part);
        }
        match rest.find(part) {
            Some(at) => rest = &rest[at + part.len()..],
            None => return false,
        }
    }
    rest.is_empty()
}

/// The README's and the docs' text, one after the other.
fn readme_and_docs() -> String {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut text = std::fs::read_to_string(root.join("README.md")).unwrap();
    let mut docs: Vec<_> = std::fs::read_dir(root.join("docs"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    for doc in docs {
        text.push('\n');
        text.push_str(&std::fs::read_to_string(doc).unwrap());
    }
    text
}

/// The block after `marker` in the README or the docs, unindented.
fn readme_block(marker: &str) -> String {
    let readme = readme_and_docs();
    let after = readme
        .split(marker)
        .nth(1)
        .unwrap_or_else(|| panic!("neither the README nor docs/ has {marker}"));
    let (indent, rest) = after
        .trim_start_matches('\n')
        .split_once("```sh\n")
        .expect("a sh block follows the marker");
    let block = rest.split(&format!("\n{indent}```")).next().unwrap();
    block
        .lines()
        .map(|l| l.strip_prefix(indent).unwrap_or(l))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Runs `script` with bash in the repository, the built `fencegate` first
/// on PATH, and checks what it prints (stdout, and stderr with
/// `with_stderr`) against the `#>` lines of `block`.
fn run_and_check(block: &str, script: &str, with_stderr: bool) {
    let bin_dir = std::path::Path::new(env!("CARGO_BIN_EXE_fencegate"))
        .parent()
        .unwrap()
        .to_owned();
    let path = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let prefix = if with_stderr { "exec 2>&1\n" } else { "" };
    let out = Command::new("bash")
        .arg("-c")
        .arg(format!("{prefix}{script}"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("PATH", path)
        .env_remove("FENCEGATE_SERVER")
        .env_remove("FENCEGATE_TOKEN")
        .env_remove("FENCING_TOKEN")
        .env_remove("FENCING_LEASE_ID")
        .output()
        .unwrap();
    let printed = String::from_utf8_lossy(&out.stdout);
    let expected: Vec<&str> = block
        .lines()
        .filter_map(|l| l.strip_prefix("#> "))
        .collect();
    let lines: Vec<&str> = printed.lines().collect();
    assert_eq!(
        lines.len(),
        expected.len(),
        "the block printed:\n{printed}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for (want, got) in expected.iter().zip(&lines) {
        assert!(
            matches(want, got),
            "expected {want:?}, got {got:?}\nall:\n{printed}"
        );
    }
    assert!(
        out.status.success(),
        "{}: {printed}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn the_readme_walkthrough_runs_as_written() {
    support::tools::program("curl");
    let block = readme_block("<!-- walkthrough -->");
    let dir = TempDir::new("walkthrough");
    let p = Proc::start(
        &serve_args(&dir.path().join("data"), false),
        &dir.path().join("fencegate.log"),
        &[],
    );
    let script = block.replace("http://127.0.0.1:8080", &p.url);
    run_and_check(&block, &script, true);
}

/// The TLS and authentication example (docs/operations.md), with its directory and
/// port replaced by a temporary one and a free one.
#[test]
fn the_readme_tls_example_runs_as_written() {
    support::tools::program("curl");
    support::tools::program("openssl");
    let block = readme_block("<!-- tls-example -->");
    let dir = TempDir::new("tls-example");
    let port = support::servers::free_port().to_string();
    let tmp = dir.path().join("fg-tls").to_string_lossy().into_owned();
    let script = block.replace("/tmp/fg-tls", &tmp).replace("8443", &port);
    let expected = block.replace("/tmp/fg-tls", &tmp).replace("8443", &port);
    run_and_check(&expected, &script, false);
}

/// The etcd v3 example (docs/stores.md), in front of an etcd started by the
/// test, fencegate run with `config/examples/etcd-v3.toml` as shipped; the
/// addresses replaced by the servers' own.
#[test]
fn the_etcd_v3_example_runs_as_written() {
    support::tools::program("curl");
    let block = readme_block("<!-- etcd-v3-example -->");
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let etcd = runtime.block_on(support::servers::etcd_v3(None));
    let dir = TempDir::new("etcd-v3-example");
    let config =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config/examples/etcd-v3.toml");
    let data = dir.path().join("data");
    let p = Proc::start(
        &[
            "serve",
            "--config",
            config.to_str().unwrap(),
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            &etcd.url,
            "--data-dir",
            data.to_str().unwrap(),
        ],
        &dir.path().join("fencegate.log"),
        &[],
    );
    let script = block
        .replace("http://127.0.0.1:8180", &p.url)
        .replace("http://127.0.0.1:2379", &etcd.url);
    run_and_check(&block, &script, false);
}

/// The cluster example (docs/cluster.md), with its directory replaced by a temporary
/// one and its ports by free ones (a block below the ephemeral range that
/// other tests' free ports come from). Real time: etcd, and a member
/// campaigning once its clock agreed with etcd's (about 5 s).
#[test]
fn the_readme_cluster_example_runs_as_written() {
    support::tools::program("curl");
    support::tools::program("etcd");
    let block = readme_block("<!-- cluster-example -->");
    let dir = TempDir::new("cluster-example");
    let free = |port: u16| std::net::TcpListener::bind(("127.0.0.1", port)).is_ok();
    let digit = (1..=9u16)
        .find(|d| {
            [81, 82, 83]
                .iter()
                .map(|p| 20_000 + d * 1000 + p)
                .chain([379, 380, 900].map(|p| 20_000 + d * 1000 + p))
                .all(free)
        })
        .expect("a free block of ports");
    let at = |p: u16| format!("127.0.0.1:{}", 20_000 + digit * 1000 + p);
    let tmp = dir.path().join("fg-cluster").to_string_lossy().into_owned();
    let script = block
        .replace("/tmp/fg-cluster", &tmp)
        .replace("127.0.0.1:22379", &at(379))
        .replace("127.0.0.1:22380", &at(380))
        .replace("127.0.0.1:9000", &at(900))
        .replace("127.0.0.1:808", &format!("127.0.0.1:2{digit}08"));
    // A failed run must not leave its servers behind.
    let script = format!("trap 'kill $(jobs -p) 2>/dev/null' EXIT\n{script}");
    run_and_check(&block, &script, false);
}

#[test]
fn patterns_match_what_they_should() {
    assert!(matches("a … b", "a 123 b"));
    assert!(matches("x", "x"));
    assert!(!matches("x", "xy"));
    assert!(matches(
        "held by \"A\", … ms left)",
        "held by \"A\", 59 ms left)"
    ));
    assert!(!matches("a … b", "a 1 c"));
}
