//! Graceful shutdown of the real binary under a steady write load: SIGTERM
//! turns readiness off, lets in-flight writes finish, and exits 0; every
//! write a client saw acknowledged is in the storage's apply log.

mod support;

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::json;
use support::proc::{proxy_to, recording_backend, TempDir};
use support::{held_from, HttpClient, Req};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_during_writes_loses_no_acknowledged_write() {
    let dir = TempDir::new("shutdown");
    let backend = recording_backend(&dir);
    let mut proxy = proxy_to(
        &dir,
        &backend.url,
        &[("FENCEGATE_LIMITS__SHUTDOWN_GRACE_MS", "5000")],
    );
    let c = HttpClient::new(&proxy.url);
    let acked = Arc::new(Mutex::new(HashSet::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let mut writers = Vec::new();
    for w in 0..4 {
        let r = c
            .send(
                Req::new("POST", &format!("/_fence/leases/s{w}"))
                    .json(json!({"holder": "w", "ttl_ms": 60_000})),
            )
            .await;
        let held = held_from(&r);
        let (c, acked, stop) = (HttpClient::new(&proxy.url), acked.clone(), stop.clone());
        writers.push(tokio::spawn(async move {
            let mut n = 0;
            while !stop.load(Ordering::Relaxed) {
                n += 1;
                let id = format!("w{w}-{n}");
                let req = Req::new("PUT", &format!("/kv/s{w}/k"))
                    .held(&held)
                    .header("x-fencegate-write-id", &id)
                    .body(id.clone());
                match c.try_send(req).await {
                    Ok(r) if r.status.is_success() => {
                        acked.lock().unwrap().insert(id);
                    }
                    Ok(_) => {}
                    Err(_) => break, // the proxy closed the connection
                }
            }
        }));
    }
    // Let the load run, then stop the proxy in the middle of it.
    while acked.lock().unwrap().len() < 200 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    proxy.signal("-TERM");
    let mut status = None;
    for _ in 0..1000 {
        if let Some(s) = proxy.child.try_wait().unwrap() {
            status = Some(s);
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    stop.store(true, Ordering::Relaxed);
    for w in writers {
        w.await.unwrap();
    }
    let status = status.expect("fencegate did not exit within the grace period");
    assert!(
        status.success(),
        "exit status {status:?}: {}",
        proxy.log_text()
    );

    let history = HttpClient::new(&backend.url)
        .send(Req::new("GET", "/_fence/backend/history"))
        .await
        .json();
    let applied: HashSet<String> = history["entries"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| e["write_id"].as_str().map(str::to_owned))
        .collect();
    let acked = acked.lock().unwrap();
    let lost: Vec<_> = acked.iter().filter(|id| !applied.contains(*id)).collect();
    assert!(
        lost.is_empty(),
        "{} acknowledged writes are not in the storage: {lost:?}",
        lost.len()
    );
    assert!(acked.len() >= 200);
    assert!(proxy.log_text().contains("shutting down"));
}
