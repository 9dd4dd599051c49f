//! The real `fencegate` binary: starts on a free port, never logs a lease id
//! (at trace level, through acquire, writes, renew, rejections and release),
//! and exits 0 on SIGTERM.

mod support;

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use serde_json::json;
use support::{held_from, HttpClient, Req};

struct Proc {
    child: Child,
    url: String,
    log: PathBuf,
}

impl Proc {
    fn start(args: &[&str]) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "fencegate-test-{}-{}",
            std::process::id(),
            args.len()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let log = dir.join("stderr.log");
        let mut child = Command::new(env!("CARGO_BIN_EXE_fencegate"))
            .args(args)
            .env("FENCEGATE_LOG", "trace")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let url = line
            .trim()
            .rsplit(' ')
            .next()
            .filter(|u| u.starts_with("http://"))
            .unwrap_or_else(|| panic!("no address announced: {line:?}"))
            .to_owned();
        Self { child, url, log }
    }

    fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args([sig, &self.child.id().to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok);
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test]
async fn no_lease_id_in_any_log_line_and_sigterm_exits_cleanly() {
    let mut p = Proc::start(&["serve", "--listen", "127.0.0.1:0", "--clock", "manual"]);
    let c = HttpClient::new(&p.url);
    let acquire = |holder: &str| {
        Req::new("POST", "/_fence/leases/orders").json(json!({"holder": holder, "ttl_ms": 1000}))
    };
    let r = c.send(acquire("A")).await;
    assert_eq!(r.status, 201);
    let a = held_from(&r);
    assert_eq!(
        c.send(Req::new("PUT", "/kv/orders/1").held(&a).body("a"))
            .await
            .status,
        201
    );
    assert_eq!(
        c.send(Req::new("POST", "/_fence/leases/orders/renew").held(&a))
            .await
            .status,
        200
    );
    let wrong = Req::new("PUT", "/kv/orders/1")
        .header("fencing-token", "1")
        .header("fencing-lease-id", "nope");
    assert_eq!(c.send(wrong).await.status, 403);
    c.send(Req::new("POST", "/_fence/clock").json(json!({"advance_ms": 1000})))
        .await;
    assert_eq!(
        c.send(Req::new("PUT", "/kv/orders/1").held(&a).body("late"))
            .await
            .status,
        412
    );
    let r = c.send(acquire("B")).await;
    let b = held_from(&r);
    assert_eq!(
        c.send(Req::new("PUT", "/kv/orders/1").held(&a).body("stale"))
            .await
            .status,
        412
    );
    assert_eq!(
        c.send(Req::new("DELETE", "/_fence/leases/orders").held(&b))
            .await
            .status,
        204
    );
    assert_eq!(c.send(Req::new("GET", "/_fence/readyz")).await.status, 200);

    p.signal("-TERM");
    let status = p.child.wait().unwrap();
    assert!(status.success(), "exit status after SIGTERM: {status:?}");

    let log = std::fs::read_to_string(&p.log).unwrap();
    assert!(
        log.contains("lease acquired"),
        "trace logging was on: {log}"
    );
    for id in [&a.lease_id, &b.lease_id] {
        assert!(!log.contains(id.as_str()), "a lease id appears in the log");
    }
    let _ = std::fs::remove_dir_all(p.log.parent().unwrap());
}

#[tokio::test]
async fn bad_configuration_stops_the_start_with_a_message() {
    let out = Command::new(env!("CARGO_BIN_EXE_fencegate"))
        .args(["serve", "--listen", "nowhere"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("listen"));
    let out = Command::new(env!("CARGO_BIN_EXE_fencegate"))
        .args(["serve", "--listen", "127.0.0.1:0"])
        .env("FENCEGATE_LIMITS__MAX_BODY_BYTES", "lots")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("FENCEGATE_LIMITS__MAX_BODY_BYTES"));
}
