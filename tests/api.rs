//! The lease API's happy paths: waiting acquires, listing, health, metrics and
//! the manual clock endpoint.

mod support;

use fencegate::config::Config;
use serde_json::json;
use support::{held_from, Harness, Req};

fn acquire(holder: &str, ttl_ms: u64, wait_ms: u64) -> Req {
    Req::new("POST", "/_fence/leases/orders")
        .json(json!({"holder": holder, "ttl_ms": ttl_ms, "wait_ms": wait_ms}))
}

#[tokio::test]
async fn a_waiting_acquire_gets_the_lease_when_it_is_released() {
    let h = Harness::new();
    let a = h.acquire("orders", "A", 10_000).await;
    let waiter = {
        let app = h.clone();
        tokio::spawn(async move { app.send(acquire("B", 1000, 5000)).await })
    };
    tokio::task::yield_now().await;
    assert!(!waiter.is_finished());
    assert_eq!(
        h.send(Req::new("DELETE", "/_fence/leases/orders").held(&a))
            .await
            .status,
        204
    );
    let r = waiter.await.unwrap();
    assert_eq!(r.status, 201);
    assert_eq!(held_from(&r).token, 2);
}

#[tokio::test]
async fn a_waiting_acquire_gets_the_lease_at_expiry_or_gives_up_with_409() {
    let h = Harness::new();
    h.acquire("orders", "A", 1000).await;
    let spawn_waiter = |wait_ms| {
        let app = h.clone();
        tokio::spawn(async move { app.send(acquire("B", 1000, wait_ms)).await })
    };
    let short = spawn_waiter(400);
    let long = spawn_waiter(5000);
    tokio::task::yield_now().await;
    h.advance(400);
    let r = short.await.unwrap();
    assert_eq!(
        (r.status.as_u16(), r.reason().as_str()),
        (409, "lease-held")
    );
    assert_eq!(r.headers["retry-after"], "1");
    assert!(!long.is_finished());
    h.advance(600);
    let r = long.await.unwrap();
    assert_eq!(r.status, 201);
    assert_eq!(r.json()["holder"], "B");
}

#[tokio::test]
async fn list_inspect_and_states() {
    let h = Harness::new();
    let b = h.acquire("b-lease", "B", 1000).await;
    h.acquire("a-lease", "A", 5000).await;
    h.acquire("c-lease", "C", 500).await;
    h.send(Req::new("DELETE", "/_fence/leases/b-lease").held(&b))
        .await;
    h.advance(500);
    let list = h.send(Req::new("GET", "/_fence/leases")).await.json();
    let rows: Vec<(String, String, u64)> = list["leases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| {
            (
                l["lease"].as_str().unwrap().into(),
                l["state"].as_str().unwrap().into(),
                l["expires_in_ms"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        rows,
        vec![
            ("a-lease".into(), "held".into(), 4500),
            ("b-lease".into(), "released".into(), 0),
            ("c-lease".into(), "expired".into(), 0)
        ]
    );
}

/// Many leases renewed in one request: one result per lease, in order,
/// each what its own renewal would have answered; a bad body fails whole.
#[tokio::test]
async fn a_batch_renews_many_leases_each_checked_alone() {
    let h = Harness::new();
    let a = h.acquire("a", "A", 1000).await;
    let b = h.acquire("b", "B", 1000).await;
    let c = h.acquire("c", "C", 1000).await;
    h.send(Req::new("DELETE", "/_fence/leases/b").held(&b))
        .await;
    h.advance(600);
    let r = h
        .send(Req::new("POST", "/_fence/renew").json(serde_json::json!({
            "ttl_ms": 2000,
            "leases": [
                {"lease": "a", "token": a.token, "lease_id": a.lease_id},
                {"lease": "b", "token": b.token, "lease_id": b.lease_id},
                {"lease": "c", "token": c.token + 1, "lease_id": c.lease_id},
                {"lease": "c", "token": c.token, "lease_id": a.lease_id},
                {"lease": "c", "token": c.token, "lease_id": c.lease_id, "ttl_ms": 3000},
                {"lease": "c", "token": c.token},
                {"lease": "no/such", "token": 1, "lease_id": a.lease_id},
                {"lease": "a", "token": a.token, "lease_id": a.lease_id, "ttl_ms": 1},
            ],
        })))
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let results = r.json()["results"].as_array().unwrap().clone();
    let got: Vec<(u64, String)> = results
        .iter()
        .map(|x| {
            (
                x["status"].as_u64().unwrap(),
                x["reason"].as_str().unwrap_or("").to_owned(),
            )
        })
        .collect();
    let want = [
        (200, ""),
        (412, "lease-released"),
        (412, "unknown-fencing-token"),
        (403, "lease-id-mismatch"),
        (200, ""),
        (428, "missing-lease-id"),
        (400, "invalid-lease-name"),
        (400, "invalid-ttl"),
    ];
    let want: Vec<(u64, String)> = want.iter().map(|(s, r)| (*s, r.to_string())).collect();
    assert_eq!(got, want, "{results:#?}");
    assert_eq!(results[0]["ttl_ms"], 2000);
    assert_eq!(results[4]["ttl_ms"], 3000);
    assert!(results.iter().all(|x| x.get("lease_id").is_none()));
    // The renewals took effect: a is held 2 s from now, c 3 s.
    h.advance(1500);
    let a_now = h.send(Req::new("GET", "/_fence/leases/a")).await.json();
    let c_now = h.send(Req::new("GET", "/_fence/leases/c")).await.json();
    assert_eq!(
        (a_now["state"].as_str(), a_now["expires_in_ms"].as_u64()),
        (Some("held"), Some(500))
    );
    assert_eq!(c_now["expires_in_ms"], 1500);

    let too_many: Vec<_> = (0..10_001)
        .map(|_| serde_json::json!({"lease": "a", "token": 1}))
        .collect();
    for bad in [
        serde_json::json!({"leases": too_many}),
        serde_json::json!({"leases": [{"lease": "a"}]}),
        serde_json::json!({"leases": [], "extra": 1}),
        serde_json::json!([]),
    ] {
        let r = h.send(Req::new("POST", "/_fence/renew").json(bad)).await;
        assert_eq!(
            (r.status.as_u16(), r.reason()),
            (400, "invalid-request".into())
        );
    }
    let r = h
        .send(Req::new("POST", "/_fence/renew").json(serde_json::json!({"leases": []})))
        .await;
    assert_eq!(r.json(), serde_json::json!({"results": []}));
}

/// The listing comes in pages in name order: `limit` and `after`, a
/// `next` cursor that is `null` on the last page; a bad query is refused.
#[tokio::test]
async fn the_listing_comes_in_pages() {
    let h = Harness::new();
    let names = ["a", "b.b", "c_d", "e-e", "f", "g", "h"];
    for (i, name) in names.iter().enumerate() {
        let r = h
            .send(
                Req::new("POST", &format!("/_fence/leases/{name}"))
                    .json(serde_json::json!({"holder": format!("h{i}"), "ttl_ms": 1000})),
            )
            .await;
        assert_eq!(r.status, 201, "{name}: {:?}", r.json());
    }
    let first = h.send(Req::new("GET", "/_fence/leases")).await.json();
    assert_eq!(first["leases"].as_array().unwrap().len(), names.len());
    assert_eq!(first["next"], serde_json::Value::Null);

    let mut seen = Vec::new();
    let mut pages = 0;
    let mut path = "/_fence/leases?limit=3".to_owned();
    loop {
        let page = h.send(Req::new("GET", &path)).await.json();
        let rows = page["leases"].as_array().unwrap();
        assert!(rows.len() <= 3);
        seen.extend(rows.iter().map(|l| l["lease"].as_str().unwrap().to_owned()));
        pages += 1;
        match page["next"].as_str() {
            Some(next) => {
                assert_eq!(Some(next), seen.last().map(String::as_str));
                path = format!("/_fence/leases?limit=3&after={next}");
            }
            None => break,
        }
    }
    assert_eq!(seen, names);
    assert_eq!(pages, 3);

    // A prefix narrows the pages to the names that start with it.
    let page = h
        .send(Req::new("GET", "/_fence/leases?prefix=e-&limit=1"))
        .await
        .json();
    assert_eq!(page["leases"][0]["lease"], "e-e");
    assert_eq!(page["next"], serde_json::Value::Null);
    let page = h
        .send(Req::new("GET", "/_fence/leases?prefix=b"))
        .await
        .json();
    assert_eq!(page["leases"].as_array().unwrap().len(), 1);

    for bad in [
        "/_fence/leases?limit=0",
        "/_fence/leases?limit=10001",
        "/_fence/leases?limit=ten",
        "/_fence/leases?limt=3",
        "/_fence/leases?after=%FF",
    ] {
        let r = h.send(Req::new("GET", bad)).await;
        assert_eq!(
            (r.status.as_u16(), r.reason()),
            (400, "invalid-request".into()),
            "{bad}"
        );
    }
}

#[tokio::test]
async fn the_status_page_is_a_static_shell_with_a_strict_policy() {
    let h = Harness::new();
    let r = h.send(Req::new("GET", "/_fence/ui")).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.headers["content-type"], "text/html; charset=utf-8");
    let csp = r.headers["content-security-policy"].to_str().unwrap();
    assert!(
        csp.contains("default-src 'none'") && csp.contains("connect-src 'self'"),
        "{csp}"
    );
    assert!(r.text().contains("/_fence/leases?"));
    let r = h.send(Req::new("DELETE", "/_fence/ui")).await;
    assert_eq!(r.status, 405);
    assert_eq!(r.headers["allow"], "GET, HEAD");
}

#[tokio::test]
async fn health_metrics_and_request_ids() {
    let h = Harness::new();
    h.acquire("orders", "A", 1000).await;
    let r = h.send(Req::new("GET", "/_fence/livez")).await;
    assert_eq!(r.status, 200);
    let id = r.headers["x-request-id"].to_str().unwrap().to_owned();
    assert!(!id.is_empty());
    assert_ne!(
        h.send(Req::new("GET", "/_fence/livez")).await.headers["x-request-id"],
        id.as_str()
    );
    let r = h
        .send(Req::new("GET", "/_fence/readyz").header("x-request-id", "mine-1"))
        .await;
    assert_eq!(
        (
            r.status.as_u16(),
            r.headers["x-request-id"].to_str().unwrap()
        ),
        (200, "mine-1")
    );
    let r = h.send(Req::new("GET", "/_fence/metrics")).await;
    assert!(r.headers["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/plain"));
    assert!(r.text().contains("fencegate_leases_held 1"), "{}", r.text());
    // The manual clock counts no suspend.
    assert!(
        r.text()
            .contains("fencegate_clock_suspended_seconds_total 0.0"),
        "{}",
        r.text()
    );
}

#[tokio::test]
async fn the_clock_endpoint_exists_only_on_the_manual_clock() {
    let h = Harness::new();
    assert_eq!(
        h.send(Req::new("GET", "/_fence/clock")).await.json(),
        json!({"now_ms": 0})
    );
    let r = h
        .send(Req::new("POST", "/_fence/clock").json(json!({"advance_ms": 250})))
        .await;
    assert_eq!(r.json(), json!({"now_ms": 250}));
    assert_eq!(h.clock.now_ms(), 250);

    let h = Harness::with_config(Config::default());
    for req in [
        Req::new("GET", "/_fence/clock"),
        Req::new("POST", "/_fence/clock").json(json!({"advance_ms": 1})),
    ] {
        let r = h.send(req).await;
        assert_eq!((r.status.as_u16(), r.reason().as_str()), (404, "not-found"));
    }
}

#[tokio::test(start_paused = true)]
async fn the_system_clock_expires_terms_on_paused_tokio_time() {
    let h = Harness::with_config(Config::default());
    let a = h.acquire("orders", "A", 1000).await;
    tokio::time::advance(std::time::Duration::from_millis(999)).await;
    assert_eq!(
        h.send(Req::new("PUT", "/kv/orders/1").held(&a).body("x"))
            .await
            .status,
        201
    );
    tokio::time::advance(std::time::Duration::from_millis(1)).await;
    let r = h
        .send(Req::new("PUT", "/kv/orders/1").held(&a).body("y"))
        .await;
    assert_eq!(
        (r.status.as_u16(), r.reason().as_str()),
        (412, "lease-expired")
    );
    assert_eq!(h.store.get("/kv/orders/1").unwrap(), "x");
}
