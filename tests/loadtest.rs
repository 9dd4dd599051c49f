//! `fencegate loadtest` end to end with the real binaries: a recording
//! backend, fencegate in front of it, and the same workload through the proxy
//! and straight to the backend.

mod support;

use std::process::Command;

use support::proc::{serve_args, Proc, TempDir};

fn loadtest(args: &[&str], json: &std::path::Path) -> (i32, serde_json::Value, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_fencegate"))
        .arg("loadtest")
        .args(args)
        .args([
            "--writers",
            "8",
            "--leases",
            "4",
            "--writes",
            "2000",
            "--ttl",
            "300ms",
        ])
        .args(["--pause-prob", "0.1", "--seed", "42", "--json"])
        .arg(json)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let report = std::fs::read_to_string(json).unwrap_or_else(|_| {
        panic!(
            "no report: {stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (
        out.status.code().unwrap_or(-1),
        serde_json::from_str(&report).unwrap(),
        stdout,
    )
}

#[test]
fn through_the_proxy_nothing_stale_lands_and_straight_to_the_backend_it_does() {
    let dir = TempDir::new("loadtest");
    let log = dir.path().join("servers.log");
    let backend = Proc::start(
        &["backend", "--listen", "127.0.0.1:0", "--record"],
        &log,
        &[],
    );
    let data = dir.path().join("data");
    let proxy = Proc::start(
        &[
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            &backend.url,
            "--data-dir",
            data.to_str().unwrap(),
        ],
        &log,
        &[],
    );

    let (code, r, stdout) = loadtest(
        &["--target", &proxy.url, "--history", &backend.url],
        &dir.path().join("proxy.json"),
    );
    let f = &r["findings"];
    assert_eq!(code, 0, "{stdout}");
    assert_eq!(f["stale_writes_applied"], 0, "{stdout}");
    assert_eq!(f["acknowledged_missing"], 0, "{stdout}");
    assert_eq!(f["rejected_present"], 0, "{stdout}");
    assert!(
        f["stale_attempts_rejected"].as_u64().unwrap() >= 200,
        "{stdout}"
    );
    assert_eq!(f["writes_attempted"], 2000);
    assert!(stdout.contains("SAFE: no stale write reached the storage"));

    // The same workload without fencing: stale writes land, and the run fails.
    let (code, r, stdout) = loadtest(
        &["--target", &proxy.url, "--direct", &backend.url],
        &dir.path().join("direct.json"),
    );
    assert_eq!(code, 1, "{stdout}");
    assert!(
        r["findings"]["stale_writes_applied"].as_u64().unwrap() > 0,
        "{stdout}"
    );
    assert_eq!(r["safe"], false);
    assert!(stdout.contains("UNSAFE"));
}

#[test]
fn a_run_that_never_exercised_the_fault_does_not_pass() {
    let dir = TempDir::new("loadtest-quiet");
    let log = dir.path().join("servers.log");
    let data = dir.path().join("data");
    // The embedded backend records when told to by config.
    let proxy = Proc::start(
        &serve_args(&data, false),
        &log,
        &[("FENCEGATE_EMBEDDED__RECORD", "true")],
    );
    let json = dir.path().join("quiet.json");
    let out = Command::new(env!("CARGO_BIN_EXE_fencegate"))
        .args([
            "loadtest",
            "--target",
            &proxy.url,
            "--writes",
            "50",
            "--pause-prob",
            "0",
            "--ttl",
            "2s",
            "--json",
        ])
        .arg(&json)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    assert!(stdout.contains("INCONCLUSIVE"), "{stdout}");
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(r["findings"]["stale_writes_applied"], 0);
    assert_eq!(r["findings"]["acknowledged"], 50);
}
