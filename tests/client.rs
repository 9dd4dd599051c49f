//! The client side against a real `fencegate serve`: `fencegate lease` exit
//! codes and shell exports, and `fencegate run` stopping its command (and the
//! command's children) when the lease is lost.

mod support;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::json;
use support::proc::{serve_args, Proc, TempDir};
use support::{HttpClient, Req};

fn fencegate(server: &str) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_fencegate"));
    c.env("FENCEGATE_SERVER", server)
        .env_remove("FENCING_TOKEN")
        .env_remove("FENCING_LEASE_ID");
    c
}

fn serve_manual(dir: &TempDir) -> Proc {
    let data = dir.path().join("data");
    Proc::start(
        &serve_args(&data, true),
        &dir.path().join("fencegate.log"),
        &[],
    )
}

/// Whether process `pid` is gone (or a zombie nobody has reaped yet).
fn gone(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat
            .rsplit(')')
            .next()
            .is_some_and(|rest| rest.trim_start().starts_with('Z')),
    }
}

/// Reads a pid the command wrote, waiting (bounded) for it to appear.
async fn read_pid(path: &Path) -> u32 {
    for _ in 0..500 {
        if let Ok(text) = std::fs::read_to_string(path) {
            if let Ok(pid) = text.trim().parse() {
                return pid;
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{} never appeared", path.display());
}

/// Waits (bounded) for a child process to exit.
async fn wait_exit(child: &mut std::process::Child) -> std::process::ExitStatus {
    for _ in 0..1000 {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let _ = child.kill();
    panic!("fencegate run did not exit");
}

#[tokio::test]
async fn lease_commands_export_shell_assignments_and_exit_by_class() {
    let dir = TempDir::new("lease-cli");
    let p = serve_manual(&dir);
    let out = fencegate(&p.url)
        .args([
            "lease", "acquire", "orders", "--holder", "a", "--ttl", "10s", "--export",
        ])
        .output()
        .unwrap();
    assert!(out.status.success());
    let exports = String::from_utf8(out.stdout).unwrap();
    // The exports work in a shell, and curl-style writes then go through.
    let script =
        format!("{exports}\necho \"$FENCING_LEASE $FENCING_TOKEN ${{#FENCING_LEASE_ID}}\"");
    let out = Command::new("sh").arg("-c").arg(&script).output().unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "orders 1 32");
    let id = exports
        .lines()
        .find_map(|l| l.strip_prefix("export FENCING_LEASE_ID="))
        .unwrap()
        .trim_matches('\'')
        .to_owned();
    let c = HttpClient::new(&p.url);
    let w = Req::new("PUT", "/kv/orders/x")
        .header("fencing-token", "1")
        .header("fencing-lease-id", &id)
        .body("v");
    assert!(c.send(w).await.status.is_success());

    let code = |args: &[&str], env: &[(&str, &str)]| {
        let mut cmd = fencegate(&p.url);
        cmd.args(args).stdout(Stdio::null()).stderr(Stdio::null());
        for (k, v) in env {
            cmd.env(k, v);
        }
        cmd.status().unwrap().code()
    };
    assert_eq!(
        code(
            &["lease", "acquire", "orders", "--holder", "b", "--ttl", "1s"],
            &[]
        ),
        Some(3),
        "held"
    );
    // Usage errors are said before any request: a name the server would
    // refuse (seen failing: "unexpected answer: invalid uri character" for
    // a space, 404 for a slash), and no holder without authentication
    // (seen failing: "400 the body needs a holder").
    for (args, said) in [
        (
            &["orders x", "--holder", "b"][..],
            "a lease name is 1-128 bytes",
        ),
        (&["a/b", "--holder", "b"][..], "a lease name is 1-128 bytes"),
        (&["orders"][..], "--holder is required"),
    ] {
        let out = fencegate(&p.url)
            .args(["lease", "acquire", "--ttl", "1s"])
            .args(args)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(said), "{args:?}: {stderr}");
    }
    // The refusal is in the audit log, with its reason (seen failing: a
    // 409 lease-held was not logged).
    let log = p.log_text();
    assert!(
        log.lines()
            .any(|l| l.contains("acquire refused") && l.contains("lease-held")),
        "{log}"
    );
    // renew reads the token and lease id from the environment.
    assert_eq!(
        code(
            &["lease", "renew", "orders"],
            &[("FENCING_TOKEN", "1"), ("FENCING_LEASE_ID", &id)]
        ),
        Some(0)
    );
    assert_eq!(
        code(
            &[
                "lease",
                "renew",
                "orders",
                "--token",
                "1",
                "--lease-id",
                "nope"
            ],
            &[]
        ),
        Some(4),
        "refused"
    );
    assert_eq!(
        code(
            &[
                "lease",
                "release",
                "orders",
                "--token",
                "1",
                "--lease-id",
                &id
            ],
            &[]
        ),
        Some(0)
    );
    assert_eq!(
        code(
            &[
                "lease",
                "release",
                "orders",
                "--token",
                "1",
                "--lease-id",
                &id
            ],
            &[]
        ),
        Some(4),
        "released"
    );
    assert_eq!(
        code(&["lease", "acquire", "orders", "--ttl", "1s"], &[]),
        Some(2),
        "usage"
    );
    assert_eq!(
        code(&["lease", "show", "--server", "http://127.0.0.1:1"], &[]),
        Some(5),
        "unreachable"
    );
    // The message names the server and the cause (seen failing before: it
    // said only "client error (Connect)").
    let out = fencegate(&p.url)
        .args(["lease", "show", "--server", "http://127.0.0.1:1"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("http://127.0.0.1:1") && stderr.contains("Connection refused"),
        "{stderr}"
    );
    assert_eq!(
        code(&["lease", "show", "--server", "127.0.0.1:8080"], &[]),
        Some(2),
        "a server without a scheme"
    );
    let out = fencegate(&p.url)
        .args(["lease", "show", "orders", "--json"])
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["state"], "released");
}

#[tokio::test]
async fn run_stops_the_whole_group_when_a_renewal_is_refused() {
    let dir = TempDir::new("run-lost");
    let p = serve_manual(&dir);
    let d = dir.path();
    let script = format!(
        "echo \"$FENCING_LEASE $FENCING_TOKEN\" > {d}/env; sleep 1000 & echo $! > {d}/grandchild; echo $$ > {d}/child; wait",
        d = d.display()
    );
    let mut run = fencegate(&p.url)
        .args([
            "run", "--lease", "job", "--holder", "r", "--ttl", "1s", "--", "sh", "-c", &script,
        ])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let child = read_pid(&d.join("child")).await;
    let grandchild = read_pid(&d.join("grandchild")).await;
    assert_eq!(
        std::fs::read_to_string(d.join("env")).unwrap().trim(),
        "job 1",
        "the token reaches the command"
    );
    assert!(!gone(child) && !gone(grandchild));

    // The proxy's clock passes the deadline: the next renewal is refused.
    let c = HttpClient::new(&p.url);
    c.send(Req::new("POST", "/_fence/clock").json(json!({"advance_ms": 1000})))
        .await;
    let status = wait_exit(&mut run).await;
    assert_eq!(status.code(), Some(6), "the lease-lost exit code");
    assert!(gone(child), "the command outlived its lease");
    assert!(gone(grandchild), "the command's child outlived the lease");
    let mut err = String::new();
    std::io::Read::read_to_string(&mut run.stderr.take().unwrap(), &mut err).unwrap();
    assert!(err.contains("lease-expired"), "{err}");
}

#[tokio::test]
async fn run_releases_the_lease_when_the_command_exits() {
    let dir = TempDir::new("run-exit");
    let p = serve_manual(&dir);
    let status = fencegate(&p.url)
        .args([
            "run", "--lease", "job", "--holder", "r", "--ttl", "10s", "--", "sh", "-c", "exit 3",
        ])
        .status()
        .unwrap();
    assert_eq!(status.code(), Some(3), "the command's status");
    // Another holder gets the lease at once, without waiting for the TTL.
    let c = HttpClient::new(&p.url);
    let r = c
        .send(
            Req::new("POST", "/_fence/leases/job").json(json!({"holder": "next", "ttl_ms": 1000})),
        )
        .await;
    assert_eq!(r.status, 201, "{}", r.text());
    assert_eq!(r.json()["token"], 2);
}

/// With the system clock: the server stops answering (SIGSTOP), and the
/// command is stopped before the server's deadline: once woken, the server
/// shows the old term still held, or released by `run` after it stopped the
/// command (a release succeeds only while the term is live).
#[tokio::test]
async fn run_stops_the_command_before_the_deadline_when_the_server_goes_silent() {
    let dir = TempDir::new("run-silent");
    let data = dir.path().join("data");
    let p = Proc::start(
        &serve_args(&data, false),
        &dir.path().join("fencegate.log"),
        &[],
    );
    let d = dir.path();
    let script = format!(
        "sleep 1000 & echo $! > {d}/grandchild; wait",
        d = d.display()
    );
    let mut run = fencegate(&p.url)
        .args([
            "run", "--lease", "job", "--holder", "r", "--ttl", "3s", "--margin", "1s", "--grace",
            "100ms", "--",
        ])
        .args(["sh", "-c", &script])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let grandchild = read_pid(&d.join("grandchild")).await;
    p.signal("-STOP");
    let status = wait_exit(&mut run).await;
    p.signal("-CONT");
    assert_eq!(status.code(), Some(6));
    assert!(gone(grandchild));
    let c = HttpClient::new(&p.url);
    let v = c.send(Req::new("GET", "/_fence/leases/job")).await.json();
    match v["state"].as_str() {
        Some("held") => assert!(v["expires_in_ms"].as_u64().unwrap() > 0),
        Some("released") => {}
        _ => panic!("the command was stopped only after the server's deadline: {v}"),
    }
    let mut err = String::new();
    std::io::Read::read_to_string(&mut run.stderr.take().unwrap(), &mut err).unwrap();
    assert!(err.contains("local deadline"), "{err}");
}

/// `run --wait` starts the command once the lease comes free, and keeps it
/// running: the local deadline counts from after the wait. (Real time here:
/// the client's own clock is what is tested; the proxy's clock is manual and
/// moves only when the test says.)
///
/// Seen failing before: the local deadline counted from when the waiting
/// acquire was sent, so it had passed by the time the lease came free, and
/// `run` killed the command it had just started and left the lease held.
#[tokio::test]
async fn run_with_wait_keeps_the_command_it_started_after_the_wait() {
    let dir = TempDir::new("run-wait");
    let p = serve_manual(&dir);
    let c = HttpClient::new(&p.url);
    let busy = c
        .send(Req::new("POST", "/_fence/leases/busy").json(json!({"holder": "x", "ttl_ms": 3000})))
        .await;
    assert_eq!(busy.status, 201);
    let run = fencegate(&p.url)
        .args([
            "run",
            "--lease",
            "busy",
            "--holder",
            "h",
            "--ttl",
            "1s",
            "--wait",
            "30s",
            "--",
            "sh",
            "-c",
            "echo started; sleep 0.3; echo done",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Longer than the TTL `run` asked for passes on the client's clock while
    // it waits; then the lease comes free.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    c.send(Req::new("POST", "/_fence/clock").json(json!({"advance_ms": 3000})))
        .await;
    let out = tokio::task::spawn_blocking(move || run.wait_with_output().unwrap())
        .await
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert_eq!(out.status.code(), Some(0), "{stdout}{stderr}");
    assert_eq!(stdout, "started\ndone\n");
    // And released: the next holder gets it at once.
    let r = c
        .send(Req::new("POST", "/_fence/leases/busy").json(json!({"holder": "y", "ttl_ms": 1000})))
        .await;
    assert_eq!(r.status, 201, "{}", r.text());
}

/// A fencegate with authentication on (alice a caller, ops an admin), its
/// embedded store recording an apply log; the manual clock if `manual`.
fn serve_with_auth(dir: &TempDir, manual: bool) -> Proc {
    use sha2::{Digest, Sha256};
    let sha = |s: &str| -> String {
        Sha256::digest(s.as_bytes())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    };
    let config = dir.path().join("auth.toml");
    std::fs::write(
        &config,
        format!(
            "[embedded]\nrecord = true\n[auth]\nenabled = true\n\
             [[auth.tokens]]\nname = \"alice\"\nsha256 = \"{}\"\n\
             [[auth.tokens]]\nname = \"ops\"\nsha256 = \"{}\"\nadmin = true\n",
            sha("alice-secret"),
            sha("ops-secret")
        ),
    )
    .unwrap();
    let mut args = serve_args(&dir.path().join("data"), manual);
    args.extend(["--config".to_owned(), config.to_string_lossy().into_owned()]);
    Proc::start(&args, &dir.path().join("fencegate.log"), &[])
}

/// Seen failing before the clients could send a bearer secret: with
/// authentication on, every call ended in 401.
#[tokio::test]
async fn the_client_commands_send_a_bearer_secret_and_never_show_it() {
    let dir = TempDir::new("client-auth");
    let p = serve_with_auth(&dir, true);
    let out = fencegate(&p.url)
        .env("FENCEGATE_TOKEN", "alice-secret")
        .args(["lease", "acquire", "job", "--ttl", "10s", "--export"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("FENCING_TOKEN=1"), "{stdout}");
    assert!(
        !stdout.contains("alice-secret"),
        "the secret was echoed: {stdout}"
    );

    // A wrong secret, or none: a clear error and the not-allowed exit code.
    for secret in [Some("wrong"), None] {
        let mut cmd = fencegate(&p.url);
        cmd.env_remove("FENCEGATE_TOKEN").args(["lease", "show"]);
        if let Some(secret) = secret {
            cmd.env("FENCEGATE_TOKEN", secret);
        }
        let out = cmd.output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(8), "{stderr}");
        assert!(stderr.contains("401 unauthorized"), "{stderr}");
        assert!(!stderr.contains("wrong"), "the secret was echoed: {stderr}");
    }

    // run --token-file: the command writes through fencegate as alice.
    let secret_file = dir.path().join("secret");
    std::fs::write(&secret_file, "alice-secret\n").unwrap();
    let curl = support::tools::program("curl");
    let script = format!(
        "{} -sf -o /dev/null -X PUT -d v \"$FENCEGATE_URL/kv/job2/k\" \
         -H \"Authorization: Bearer $(cat \"$FENCEGATE_TOKEN_FILE\")\" \
         -H \"Fencing-Token: $FENCING_TOKEN\" -H \"Fencing-Lease-Id: $FENCING_LEASE_ID\"",
        curl.display()
    );
    let out = fencegate(&p.url)
        .env_remove("FENCEGATE_TOKEN")
        .arg("run")
        .arg("--token-file")
        .arg(&secret_file)
        .args(["--lease", "job2", "--ttl", "10s", "--", "sh", "-c", &script])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(!stderr.contains("alice-secret"), "{stderr}");
    let c = HttpClient::new(&p.url);
    let r = c
        .send(Req::new("GET", "/kv/job2/k").header("authorization", "Bearer alice-secret"))
        .await;
    assert_eq!((r.status.as_u16(), r.text().as_str()), (200, "v"));
    // No log line holds the secret either.
    assert!(!p.log_text().contains("alice-secret"));
}

/// A client passes on every member it knows, so the next one follows the
/// primary too (seen failing: `--export` and `run` passed on only the
/// member that answered, and after it died `lease renew` failed for ever):
/// with a member down listed first, the acquire moves on to the live one,
/// and `--export` and `run` name both, the one that answered first;
/// `run` gives its command that one alone as `FENCEGATE_URL`, for curl.
#[tokio::test]
async fn exports_and_run_pass_on_every_member() {
    let dir = TempDir::new("members");
    let p = serve_manual(&dir);
    let down = format!("http://127.0.0.1:{}", support::servers::free_port());
    let both = format!("{down},{}", p.url);
    let out = fencegate(&both)
        .args([
            "lease", "acquire", "orders", "--holder", "a", "--ttl", "10s", "--export",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let exports = String::from_utf8(out.stdout).unwrap();
    let listed = format!("export FENCEGATE_SERVER='{},{down}'", p.url);
    assert!(exports.lines().any(|l| l == listed), "{exports}");
    let one = format!("export FENCEGATE_URL='{}'", p.url);
    assert!(exports.lines().any(|l| l == one), "{exports}");

    let seen = dir.path().join("seen");
    let script = format!(
        "echo \"$FENCEGATE_SERVER $FENCEGATE_URL\" > {}",
        seen.display()
    );
    let out = fencegate(&both)
        .args([
            "run", "--lease", "job", "--holder", "a", "--ttl", "10s", "--", "sh", "-c", &script,
        ])
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        std::fs::read_to_string(&seen).unwrap().trim(),
        format!("{},{down} {}", p.url, p.url)
    );
}

/// `fencegate loadtest` against a target with authentication on: the writers
/// act as the caller the secret names (an admin here, who may read the
/// apply log), and the run passes.
#[tokio::test]
async fn the_load_test_runs_against_a_target_with_authentication_on() {
    let dir = TempDir::new("loadtest-auth");
    let p = serve_with_auth(&dir, false);
    let url = p.url.clone();
    let out = tokio::task::spawn_blocking(move || {
        Command::new(env!("CARGO_BIN_EXE_fencegate"))
            .env("FENCEGATE_TOKEN", "ops-secret")
            .args([
                "loadtest", "--target", &url, "--writes", "300", "--ttl", "300ms",
            ])
            .args(["--pause-prob", "0.1", "--seed", "3"])
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("SAFE"), "{stdout}");
}

/// `fencegate lease show` lists every lease, following the server's pages
/// (1,000 leases each unless asked otherwise).
#[tokio::test]
async fn lease_show_follows_every_page() {
    let dir = TempDir::new("lease-show");
    // 1,205 acquires from one address on a clock that never moves: past
    // any acquire rate per client, which is not what this test is about.
    let p = Proc::start(
        &serve_args(&dir.path().join("data"), true),
        &dir.path().join("fencegate.log"),
        &[("FENCEGATE_LEASES__ACQUIRE_RATE_PER_CLIENT", "0")],
    );
    let c = HttpClient::new(&p.url);
    let total = 1_205;
    for i in 0..total {
        let r = c
            .send(
                Req::new("POST", &format!("/_fence/leases/l{i:05}"))
                    .json(json!({"holder": format!("h{i}"), "ttl_ms": 60_000})),
            )
            .await;
        assert_eq!(r.status, 201);
    }
    let first = c.send(Req::new("GET", "/_fence/leases")).await.json();
    assert_eq!(first["leases"].as_array().unwrap().len(), 1000);
    assert_eq!(first["next"], "l00999");

    let out = fencegate(&p.url)
        .args(["lease", "show", "--json"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let all: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let names: Vec<&str> = all["leases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["lease"].as_str().unwrap())
        .collect();
    let expected: Vec<String> = (0..total).map(|i| format!("l{i:05}")).collect();
    assert_eq!(names, expected);
}
