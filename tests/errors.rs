//! Every row of the contract's error table (section 5) that the proxy answers
//! today: status, `reason`, problem+json shape, and, for every rejected write,
//! the stored value untouched.
//!
//! Each write test stores a value directly in the embedded store first (a write
//! that bypasses the proxy), so "untouched" means the rejected write would have
//! been visible had it landed.

mod support;

use fencegate::clock::ClockKind;
use fencegate::config::{Config, RouteConfig};
use serde_json::json;
use support::{Harness, Held, Req};

const KEY: &str = "/kv/orders/x";

/// A harness where `orders` is held by A (token 1, TTL 5 s) and KEY holds "orig".
async fn held() -> (Harness, Held) {
    let h = Harness::new();
    let a = h.acquire("orders", "A", 5000).await;
    h.store.put(KEY, "orig");
    (h, a)
}

/// Sends a write and checks it was refused with `status` and `reason`, and that
/// the stored value did not change.
async fn refused(h: &Harness, req: Req, status: u16, reason: &str) -> serde_json::Value {
    let before = h.store.get(KEY);
    let r = h.send(req).await;
    assert_eq!(
        (r.status.as_u16(), r.reason().as_str()),
        (status, reason),
        "{}",
        r.text()
    );
    assert_eq!(
        h.store.get(KEY),
        before,
        "the backend was touched by a refused request"
    );
    assert!(r.headers.contains_key("x-request-id"));
    r.json()
}

#[tokio::test]
async fn a_valid_write_lands_so_the_refusals_below_mean_something() {
    let (h, a) = held().await;
    let r = h.send(Req::new("PUT", KEY).held(&a).body("new")).await;
    assert_eq!(r.status, 204);
    assert_eq!(h.store.get(KEY).unwrap(), "new");
}

#[tokio::test]
async fn missing_headers_are_428() {
    let (h, a) = held().await;
    let j = refused(
        &h,
        Req::new("PUT", KEY).body("x"),
        428,
        "missing-fencing-token",
    )
    .await;
    assert_eq!(j["lease"], "orders");
    refused(
        &h,
        Req::new("PUT", KEY)
            .header("fencing-lease-id", &a.lease_id)
            .body("x"),
        428,
        "missing-fencing-token",
    )
    .await;
    refused(
        &h,
        Req::new("PUT", KEY).header("fencing-token", "1").body("x"),
        428,
        "missing-lease-id",
    )
    .await;
    for method in ["POST", "PATCH", "DELETE", "MKCOL", "MOVE"] {
        refused(&h, Req::new(method, KEY), 428, "missing-fencing-token").await;
    }
    // Renew and release follow the same rules.
    refused(
        &h,
        Req::new("POST", "/_fence/leases/orders/renew"),
        428,
        "missing-fencing-token",
    )
    .await;
    refused(
        &h,
        Req::new("DELETE", "/_fence/leases/orders").header("fencing-token", "1"),
        428,
        "missing-lease-id",
    )
    .await;
    assert_eq!(h.leases.inspect("orders").unwrap().token, 1);
}

#[tokio::test]
async fn malformed_tokens_are_400() {
    let (h, a) = held().await;
    for bad in [
        "",
        "abc",
        "-1",
        "+1",
        "1.0",
        "0x1",
        "99999999999999999999999",
    ] {
        let req = Req::new("PUT", KEY)
            .header("fencing-token", bad)
            .header("fencing-lease-id", &a.lease_id)
            .body("x");
        refused(&h, req, 400, "malformed-fencing-token").await;
    }
    let req = Req::new("POST", "/_fence/leases/orders/renew")
        .header("fencing-token", "one")
        .header("fencing-lease-id", &a.lease_id);
    refused(&h, req, 400, "malformed-fencing-token").await;
}

#[tokio::test]
async fn invalid_lease_names_are_400() {
    let (h, a) = held().await;
    let long = "x".repeat(129);
    for name in ["bad%20name", "%C3%BC", long.as_str()] {
        refused(
            &h,
            Req::new("PUT", &format!("/kv/{name}/x")).held(&a).body("x"),
            400,
            "invalid-lease-name",
        )
        .await;
        let acquire = Req::new("POST", &format!("/_fence/leases/{name}"))
            .json(json!({"holder": "A", "ttl_ms": 1000}));
        refused(&h, acquire, 400, "invalid-lease-name").await;
        refused(
            &h,
            Req::new("GET", &format!("/_fence/leases/{name}")),
            400,
            "invalid-lease-name",
        )
        .await;
    }
    // The longest valid name works.
    h.acquire(&"x".repeat(128), "A", 1000).await;
}

#[tokio::test]
async fn ttl_out_of_bounds_is_400_and_bounds_are_inclusive() {
    let h = Harness::new();
    for ttl in [
        json!(0),
        json!(99),
        json!(3_600_001),
        json!(-1),
        json!(1.5),
        json!(1e30),
    ] {
        let r =
            Req::new("POST", "/_fence/leases/orders").json(json!({"holder": "A", "ttl_ms": ttl}));
        refused(&h, r, 400, "invalid-ttl").await;
    }
    assert!(h.leases.inspect("orders").is_none(), "no term was granted");
    h.acquire("orders", "A", 100).await;
    h.acquire("other", "A", 3_600_000).await;
}

#[tokio::test]
async fn renew_ttl_out_of_bounds_is_400_and_changes_nothing() {
    let (h, a) = held().await;
    for ttl in [json!(99), json!(3_600_001)] {
        let r = Req::new("POST", "/_fence/leases/orders/renew")
            .held(&a)
            .json(json!({"ttl_ms": ttl}));
        refused(&h, r, 400, "invalid-ttl").await;
    }
    assert_eq!(h.leases.inspect("orders").unwrap().expires_in_ms, 5000);
}

#[tokio::test]
async fn bad_requests_are_400() {
    let (h, a) = held().await;
    let acquire = |body: &str| Req::new("POST", "/_fence/leases/orders").body(body.to_owned());
    for body in [
        "",
        "{",
        "[]",
        r#"{"ttl_ms": 1000}"#,
        r#"{"holder": "B"}"#,
        r#"{"holder": "B", "ttl_ms": 1000, "extra": 1}"#,
        r#"{"holder": 7, "ttl_ms": 1000}"#,
        r#"{"holder": "B", "ttl_ms": "1000"}"#,
        r#"{"holder": "", "ttl_ms": 1000}"#,
        r#"{"holder": "B", "ttl_ms": 1000, "wait_ms": 60001}"#,
    ] {
        refused(&h, acquire(body), 400, "invalid-request").await;
    }
    // The TTL is checked before the holder's name.
    refused(
        &h,
        acquire(r#"{"holder": "", "ttl_ms": 1}"#),
        400,
        "invalid-ttl",
    )
    .await;
    let renew = Req::new("POST", "/_fence/leases/orders/renew")
        .held(&a)
        .body("{nope");
    refused(&h, renew, 400, "invalid-request").await;
    let clock = Req::new("POST", "/_fence/clock").body(r#"{"advance_ms": -5}"#);
    refused(&h, clock, 400, "invalid-request").await;
    // Ambiguous paths never reach the backend, writes or reads.
    for path in [
        "/kv/orders/../payments/x",
        "/kv/orders/%2e%2e/x",
        "/kv/orders%2Fx",
        "/kv/orders/%zz",
        "/kv/orders/%ff",
    ] {
        refused(
            &h,
            Req::new("PUT", path).held(&a).body("x"),
            400,
            "invalid-request",
        )
        .await;
        refused(&h, Req::new("GET", path), 400, "invalid-request").await;
    }
    // Two tokens are malformed; two lease ids are a bad request.
    let two = Req::new("PUT", KEY)
        .header("fencing-token", "1")
        .header("fencing-token", "1")
        .header("fencing-lease-id", &a.lease_id);
    refused(&h, two, 400, "malformed-fencing-token").await;
    let two = Req::new("PUT", KEY)
        .header("fencing-token", "1")
        .header("fencing-lease-id", &a.lease_id)
        .header("fencing-lease-id", &a.lease_id);
    refused(&h, two, 400, "invalid-request").await;
}

#[tokio::test]
async fn unknown_and_stale_tokens_are_412() {
    let (h, a) = held().await;
    let with = |token: &str, id: &str| {
        Req::new("PUT", KEY)
            .header("fencing-token", token)
            .header("fencing-lease-id", id)
            .body("x")
    };
    for token in ["0", "2", "18446744073709551615"] {
        let j = refused(&h, with(token, &a.lease_id), 412, "unknown-fencing-token").await;
        assert_eq!(j["current_token"], 1);
    }
    // A lease never acquired: unknown.
    let never = Req::new("PUT", "/kv/never/x").held(&a).body("x");
    refused(&h, never, 412, "unknown-fencing-token").await;
    assert_eq!(h.store.get("/kv/never/x"), None);

    h.advance(5000);
    let b = h.acquire("orders", "B", 5000).await;
    let j = refused(&h, with("1", &a.lease_id), 412, "stale-fencing-token").await;
    assert_eq!(
        (j["lease"].as_str(), j["current_token"].as_u64()),
        (Some("orders"), Some(2))
    );
    // Stale is decided before the lease id: B's id does not help token 1.
    refused(&h, with("1", &b.lease_id), 412, "stale-fencing-token").await;
    refused(
        &h,
        Req::new("POST", "/_fence/leases/orders/renew").held(&a),
        412,
        "stale-fencing-token",
    )
    .await;
    refused(
        &h,
        Req::new("DELETE", "/_fence/leases/orders").held(&a),
        412,
        "stale-fencing-token",
    )
    .await;
    assert_eq!(h.leases.inspect("orders").unwrap().holder, "B");
}

#[tokio::test]
async fn expired_and_released_terms_are_412() {
    let (h, a) = held().await;
    h.advance(4999);
    assert_eq!(
        h.send(Req::new("PUT", KEY).held(&a).body("last"))
            .await
            .status,
        204
    );
    h.store.put(KEY, "orig");
    h.advance(1);
    // At the deadline exactly the term has expired.
    let j = refused(
        &h,
        Req::new("PUT", KEY).held(&a).body("x"),
        412,
        "lease-expired",
    )
    .await;
    assert_eq!(j["current_token"], 1);
    refused(
        &h,
        Req::new("POST", "/_fence/leases/orders/renew").held(&a),
        412,
        "lease-expired",
    )
    .await;
    refused(
        &h,
        Req::new("DELETE", "/_fence/leases/orders").held(&a),
        412,
        "lease-expired",
    )
    .await;

    let b = h.acquire("orders", "B", 5000).await;
    assert_eq!(
        h.send(Req::new("DELETE", "/_fence/leases/orders").held(&b))
            .await
            .status,
        204
    );
    refused(
        &h,
        Req::new("PUT", KEY).held(&b).body("x"),
        412,
        "lease-released",
    )
    .await;
    refused(
        &h,
        Req::new("POST", "/_fence/leases/orders/renew").held(&b),
        412,
        "lease-released",
    )
    .await;
    refused(
        &h,
        Req::new("DELETE", "/_fence/leases/orders").held(&b),
        412,
        "lease-released",
    )
    .await;
    let v = h
        .send(Req::new("GET", "/_fence/leases/orders"))
        .await
        .json();
    assert_eq!(
        (v["state"].as_str(), v["expires_in_ms"].as_u64()),
        (Some("released"), Some(0))
    );
}

#[tokio::test]
async fn wrong_lease_id_is_403() {
    let (h, a) = held().await;
    let wrong = "0".repeat(a.lease_id.len());
    for id in [
        wrong.as_str(),
        "x",
        &a.lease_id[..31],
        &format!("{}0", a.lease_id),
        &a.lease_id.to_uppercase(),
    ] {
        let req = Req::new("PUT", KEY)
            .header("fencing-token", "1")
            .header("fencing-lease-id", id)
            .body("x");
        let j = refused(&h, req, 403, "lease-id-mismatch").await;
        assert!(
            !j.to_string().contains(&a.lease_id),
            "the problem leaks the lease id"
        );
        let renew = Req::new("POST", "/_fence/leases/orders/renew")
            .header("fencing-token", "1")
            .header("fencing-lease-id", id);
        refused(&h, renew, 403, "lease-id-mismatch").await;
        let release = Req::new("DELETE", "/_fence/leases/orders")
            .header("fencing-token", "1")
            .header("fencing-lease-id", id);
        refused(&h, release, 403, "lease-id-mismatch").await;
    }
    // The mismatch comes before the term's state: after expiry it still says 403.
    h.advance(10_000);
    let req = Req::new("PUT", KEY)
        .header("fencing-token", "1")
        .header("fencing-lease-id", "x")
        .body("x");
    refused(&h, req, 403, "lease-id-mismatch").await;
}

#[tokio::test]
async fn unrouted_writes_are_403_unless_allowed() {
    let (h, a) = held().await;
    h.store.put("/kv", "never");
    for path in ["/other/x", "/kv", "/", "/kvx/orders"] {
        refused(
            &h,
            Req::new("PUT", path).held(&a).body("x"),
            403,
            "unrouted-write",
        )
        .await;
    }
    // Reads on unrouted paths pass through to the backend (which has no such key).
    assert_eq!(h.send(Req::new("GET", "/other/x")).await.status, 404);

    let mut config = Config {
        clock: ClockKind::Manual,
        ..Config::default()
    };
    config.fence.allow_unrouted_writes = true;
    let h = Harness::with_config(config);
    let r = h.send(Req::new("PUT", "/other/x").body("x")).await;
    assert_ne!(
        r.status, 403,
        "unrouted writes are allowed: the backend answers"
    );
}

#[tokio::test]
async fn held_lease_is_409_with_retry_after() {
    let (h, _a) = held().await;
    h.advance(1500);
    let r = h
        .send(
            Req::new("POST", "/_fence/leases/orders").json(json!({"holder": "B", "ttl_ms": 1000})),
        )
        .await;
    assert_eq!(
        (r.status.as_u16(), r.reason().as_str()),
        (409, "lease-held")
    );
    assert_eq!(r.headers["retry-after"], "4"); // 3500 ms rounds up
    let j = r.json();
    assert_eq!(
        (
            j["holder"].as_str(),
            j["current_token"].as_u64(),
            j["expires_in_ms"].as_u64()
        ),
        (Some("A"), Some(1), Some(3500))
    );
    assert!(j.get("lease_id").is_none());
}

#[tokio::test]
async fn oversized_bodies_are_413_and_never_stored() {
    let mut config = Config {
        clock: ClockKind::Manual,
        ..Config::default()
    };
    config.limits.max_body_bytes = 16;
    let h = Harness::with_config(config);
    let a = h.acquire("orders", "A", 5000).await;
    h.store.put(KEY, "orig");
    // Declared too long: refused before the fence even looks at it.
    let declared = Req::new("PUT", KEY)
        .held(&a)
        .header("content-length", "17")
        .body(vec![b'x'; 17]);
    refused(&h, declared, 413, "payload-too-large").await;
    // Streamed without a length: refused when the stream passes the limit.
    let streamed = Req::new("PUT", KEY).held(&a).body(vec![b'x'; 17]);
    refused(&h, streamed, 413, "payload-too-large").await;
    // At the limit it lands.
    assert_eq!(
        h.send(Req::new("PUT", KEY).held(&a).body(vec![b'y'; 16]))
            .await
            .status,
        204
    );
    assert_eq!(h.store.get(KEY).unwrap().len(), 16);
}

#[tokio::test]
async fn oversized_heads_are_431() {
    let (h, a) = held().await;
    let big = "v".repeat(16 * 1024);
    refused(
        &h,
        Req::new("PUT", KEY)
            .held(&a)
            .header("x-big", &big)
            .body("x"),
        431,
        "headers-too-large",
    )
    .await;
    let many = (0..300).fold(Req::new("PUT", KEY).held(&a), |r, i| {
        r.header(&format!("x-h{i}"), &"v".repeat(60))
    });
    refused(&h, many, 431, "headers-too-large").await;
}

#[tokio::test]
async fn unknown_lease_is_404() {
    let h = Harness::new();
    let r = h.send(Req::new("GET", "/_fence/leases/never")).await;
    assert_eq!(
        (r.status.as_u16(), r.reason().as_str()),
        (404, "unknown-lease")
    );
    assert_eq!(r.json()["lease"], "never");
    let r = h.send(Req::new("GET", "/_fence/leases")).await;
    assert_eq!(r.json(), json!({"leases": [], "next": null}));
    let r = h.send(Req::new("GET", "/_fence/nope")).await;
    assert_eq!((r.status.as_u16(), r.reason().as_str()), (404, "not-found"));
    // A wrong method is 405 with the methods that are right (seen failing
    // before: no Allow header).
    for (method, path, allow) in [
        ("PUT", "/_fence/leases", "GET"),
        ("PUT", "/_fence/leases/x", "GET, POST, DELETE"),
        ("GET", "/_fence/leases/x/renew", "POST"),
        ("POST", "/_fence/readyz", "GET, HEAD"),
        ("PATCH", "/kv/x/1", "GET, HEAD, PUT, DELETE"),
    ] {
        let mut req = Req::new(method, path);
        if method == "PATCH" {
            let held = h.acquire("x", "A", 1000).await;
            req = req.held(&held);
        }
        let r = h.send(req).await;
        assert_eq!(
            (r.status.as_u16(), r.reason().as_str()),
            (405, "method-not-allowed"),
            "{method} {path}"
        );
        assert_eq!(r.headers["allow"], allow, "{method} {path}");
    }
}

#[tokio::test]
async fn store_that_cannot_persist_is_503_and_recovers() {
    let h = Harness::new();
    assert_eq!(h.send(Req::new("GET", "/_fence/readyz")).await.status, 200);
    h.journal.set_failing(true);
    let acquire =
        || Req::new("POST", "/_fence/leases/orders").json(json!({"holder": "A", "ttl_ms": 1000}));
    let r = h.send(acquire()).await;
    assert_eq!(
        (r.status.as_u16(), r.reason().as_str()),
        (503, "lease-store-unavailable")
    );
    assert!(
        !r.headers.contains_key("fencing-token"),
        "no token without persistence"
    );
    let r = h.send(Req::new("GET", "/_fence/readyz")).await;
    assert_eq!(
        (r.status.as_u16(), r.reason().as_str()),
        (503, "lease-store-unavailable")
    );
    assert_eq!(h.send(Req::new("GET", "/_fence/livez")).await.status, 200);
    assert_eq!(
        h.send(Req::new("GET", "/_fence/leases/orders"))
            .await
            .status,
        404
    );

    h.journal.set_failing(false);
    assert_eq!(h.send(Req::new("GET", "/_fence/readyz")).await.status, 200);
    let r = h.send(acquire()).await;
    assert_eq!(r.status, 201);
}

#[tokio::test]
async fn fixed_lease_routes_and_fenced_reads() {
    let mut config = Config {
        clock: ClockKind::Manual,
        ..Config::default()
    };
    config.fence.routes.insert(
        0,
        RouteConfig {
            kind: Default::default(),
            pattern: "/kv/secret".into(),
            lease: Some("vault".into()),
            fence_reads: true,
            timeout_ms: None,
            upstream_prefix: None,
            preconditions: Default::default(),
            partition_key: None,
            token_attribute: None,
        },
    );
    let h = Harness::with_config(config);
    h.store.put("/kv/secret/k", "s");
    let r = h.send(Req::new("GET", "/kv/secret/k")).await;
    assert_eq!(
        (r.status.as_u16(), r.reason().as_str()),
        (428, "missing-fencing-token")
    );
    let v = h.acquire("vault", "A", 1000).await;
    let r = h.send(Req::new("GET", "/kv/secret/k").held(&v)).await;
    assert_eq!((r.status.as_u16(), r.text().as_str()), (200, "s"));
    h.advance(1000);
    let r = h.send(Req::new("GET", "/kv/secret/k").held(&v)).await;
    assert_eq!(
        (r.status.as_u16(), r.reason().as_str()),
        (412, "lease-expired")
    );
}

#[tokio::test]
async fn a_full_lease_store_is_429_for_new_names() {
    let mut config = Config {
        clock: ClockKind::Manual,
        ..Config::default()
    };
    config.leases.max_leases = 1;
    let h = Harness::with_config(config);
    h.acquire("a", "A", 1000).await;
    let r = h
        .send(Req::new("POST", "/_fence/leases/b").json(json!({"holder": "B", "ttl_ms": 1000})))
        .await;
    assert_eq!(
        (r.status.as_u16(), r.reason().as_str()),
        (429, "too-many-leases")
    );
    assert!(h.leases.inspect("b").is_none());
}

#[tokio::test]
async fn a_holder_over_its_acquire_rate_is_429_with_retry_after() {
    let mut config = Config {
        clock: ClockKind::Manual,
        ..Config::default()
    };
    config.leases.acquire_rate_per_client = 1;
    let h = Harness::with_config(config);
    h.acquire("a", "A", 1000).await;
    let r = h
        .send(Req::new("POST", "/_fence/leases/b").json(json!({"holder": "A", "ttl_ms": 1000})))
        .await;
    assert_eq!(
        (r.status.as_u16(), r.reason().as_str()),
        (429, "rate-limited")
    );
    assert_eq!(r.headers["retry-after"], "1");
    h.advance(1000);
    h.acquire("b", "A", 1000).await;
}

/// The acquire rate is the client's, not the holder name's: a client that
/// names a new holder for every acquire is held to the rate all the same.
/// Seen failing when the rate was kept per holder: every acquire passed.
#[tokio::test]
async fn varying_the_holder_does_not_escape_the_acquire_rate() {
    let mut config = Config {
        clock: ClockKind::Manual,
        ..Config::default()
    };
    config.leases.acquire_rate_per_client = 3;
    let h = Harness::with_config(config);
    let server = support::spawn(h.app.clone()).await;
    let c = support::HttpClient::new(&server.url());
    let mut statuses = Vec::new();
    for i in 0..5 {
        let r = c
            .send(
                Req::new("POST", &format!("/_fence/leases/l{i}"))
                    .json(json!({"holder": format!("h{i}"), "ttl_ms": 1000})),
            )
            .await;
        statuses.push(r.status.as_u16());
    }
    assert_eq!(statuses, [201, 201, 201, 429, 429]);
    h.advance(1000);
    let r = c
        .send(Req::new("POST", "/_fence/leases/l9").json(json!({"holder": "h9", "ttl_ms": 1000})))
        .await;
    assert_eq!(r.status, 201, "time refills the client's bucket");
    server.stop().await;
}
