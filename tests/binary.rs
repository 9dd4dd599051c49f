//! The real `fencegate` binary: starts on a free port, never logs a lease id
//! (at trace level, through acquire, writes, renew, rejections and release),
//! and exits 0 on SIGTERM.

mod support;

use std::process::Command;

use serde_json::json;
use support::proc::{serve_args, Proc, TempDir};
use support::{held_from, HttpClient, Req};

#[tokio::test]
async fn no_lease_id_in_any_log_line_and_sigterm_exits_cleanly() {
    let dir = TempDir::new("binary");
    let data = dir.path().join("data");
    let log = dir.path().join("stderr.log");
    let args = serve_args(&data, true);
    let mut p = Proc::start(&args, &log, &[("FENCEGATE_LOG", "trace")]);
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

    let log = p.log_text();
    assert!(
        log.contains("lease acquired"),
        "trace logging was on: {log}"
    );
    for id in [&a.lease_id, &b.lease_id] {
        assert!(!log.contains(id.as_str()), "a lease id appears in the log");
    }
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

#[tokio::test]
async fn json_logs_are_one_object_per_line_with_audit_records() {
    let dir = TempDir::new("json-logs");
    let data = dir.path().join("data");
    let log = dir.path().join("stderr.log");
    let args = serve_args(&data, true);
    let mut p = Proc::start(
        &args,
        &log,
        &[("FENCEGATE_LOG_FORMAT", "json"), ("FENCEGATE_LOG", "debug")],
    );
    let c = HttpClient::new(&p.url);
    let r = c
        .send(
            Req::new("POST", "/_fence/leases/orders").json(json!({"holder": "A", "ttl_ms": 1000})),
        )
        .await;
    let a = held_from(&r);
    c.send(
        Req::new("PUT", "/kv/orders/1")
            .header("fencing-token", "7")
            .header("fencing-lease-id", &a.lease_id)
            .body("x"),
    )
    .await;
    p.signal("-TERM");
    assert!(p.child.wait().unwrap().success());
    let text = p.log_text();
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    let audit: Vec<&serde_json::Value> = lines.iter().filter(|l| l["target"] == "audit").collect();
    assert!(
        audit
            .iter()
            .any(|l| l["fields"]["message"] == "lease acquired" && l["fields"]["token"] == 1),
        "{text}"
    );
    assert!(
        audit
            .iter()
            .any(|l| l["fields"]["reason"] == "unknown-fencing-token"),
        "{text}"
    );
    assert!(!text.contains(&a.lease_id));
}
