//! Runs examples/seed-replay.sh against the real binary, as CI and users do.

mod support;

use std::process::Command;

#[test]
fn seed_replay_script_passes() {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/seed-replay.sh");
    // The script talks to the server with curl.
    support::tools::program("curl");
    let out = Command::new("bash")
        .arg(script)
        .env("FENCEGATE_BIN", env!("CARGO_BIN_EXE_fencegate"))
        .output()
        .expect("bash runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "seed-replay failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(stdout.lines().filter(|l| l.starts_with("t=")).count(), 16);
    assert!(stdout
        .trim_end()
        .ends_with("PASS: seed scenario replayed over HTTP"));
}
