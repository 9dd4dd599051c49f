//! The seed scenario over real HTTP: fencegate on a loopback port with the
//! manual clock, moved only through `POST /_fence/clock`.

mod support;

use serde_json::json;
use support::{held_from, spawn, Harness, HttpClient, Req};

#[tokio::test]
async fn seed_scenario_over_http() {
    let h = Harness::new();
    let server = spawn(h.app.clone()).await;
    let c = HttpClient::new(&server.url());
    let key = "/kv/orders/x";
    let mut now_s = 0;
    let at = |now: &mut u64, t: u64| {
        let ms = (t - *now) * 1000;
        *now = t;
        let c = c.clone();
        async move {
            let r = c
                .send(Req::new("POST", "/_fence/clock").json(json!({"advance_ms": ms})))
                .await;
            assert_eq!(r.status, 200);
            assert_eq!(r.json()["now_ms"], t * 1000);
        }
    };
    let acquire = |holder: &str| {
        Req::new("POST", "/_fence/leases/orders").json(json!({"holder": holder, "ttl_ms": 5000}))
    };

    // t=0 A acquires: token 1.
    let r = c.send(acquire("A")).await;
    assert_eq!(r.status, 201);
    let j = r.json();
    assert_eq!(
        (j["lease"].as_str(), j["holder"].as_str()),
        (Some("orders"), Some("A"))
    );
    assert_eq!(
        (
            j["token"].as_u64(),
            j["ttl_ms"].as_u64(),
            j["expires_in_ms"].as_u64()
        ),
        (Some(1), Some(5000), Some(5000))
    );
    assert_eq!(r.headers["fencing-token"], "1");
    assert_eq!(
        r.headers["fencing-lease-id"],
        j["lease_id"].as_str().unwrap()
    );
    let a = held_from(&r);

    // t=2 A writes: accepted.
    at(&mut now_s, 2).await;
    let r = c.send(Req::new("PUT", key).held(&a).body("a-1")).await;
    assert!(r.status.is_success(), "{r:?}");

    // t=4 A renews: deadline 9.
    at(&mut now_s, 4).await;
    let r = c
        .send(Req::new("POST", "/_fence/leases/orders/renew").held(&a))
        .await;
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["expires_in_ms"], 5000);
    assert_eq!(r.headers["fencing-token"], "1");
    assert!(
        r.json().get("lease_id").is_none(),
        "renew does not echo the lease id"
    );

    // t=8 A writes: accepted.
    at(&mut now_s, 8).await;
    let r = c.send(Req::new("PUT", key).held(&a).body("a-2")).await;
    assert!(r.status.is_success());

    // t=10 A writes: lease-expired; A renews: lease-expired.
    at(&mut now_s, 10).await;
    let r = c.send(Req::new("PUT", key).held(&a).body("a-3")).await;
    assert_eq!(
        (r.status.as_u16(), r.reason()),
        (412, "lease-expired".into())
    );
    let r = c
        .send(Req::new("POST", "/_fence/leases/orders/renew").held(&a))
        .await;
    assert_eq!(
        (r.status.as_u16(), r.reason()),
        (412, "lease-expired".into())
    );
    assert_eq!(
        h.store.get(key).unwrap(),
        "a-2",
        "the expired write did not land"
    );

    // t=10 B acquires: token 2.
    let r = c.send(acquire("B")).await;
    assert_eq!(r.status, 201);
    let b = held_from(&r);
    assert_eq!(b.token, 2);

    // t=11 B writes: accepted.
    at(&mut now_s, 11).await;
    let r = c.send(Req::new("PUT", key).held(&b).body("b-1")).await;
    assert!(r.status.is_success());

    // t=12 token 1 with B's lease id: stale; A's own write: stale.
    at(&mut now_s, 12).await;
    let r = c
        .send(
            Req::new("PUT", key)
                .header("fencing-token", "1")
                .header("fencing-lease-id", &b.lease_id)
                .body("x"),
        )
        .await;
    assert_eq!(
        (r.status.as_u16(), r.reason()),
        (412, "stale-fencing-token".into())
    );
    assert_eq!(r.json()["current_token"], 2);
    let r = c.send(Req::new("PUT", key).held(&a).body("a-4")).await;
    assert_eq!(
        (r.status.as_u16(), r.reason()),
        (412, "stale-fencing-token".into())
    );

    // C acquires: 409 lease-held, Retry-After rounds 3 s up to 3.
    let r = c.send(acquire("C")).await;
    assert_eq!((r.status.as_u16(), r.reason()), (409, "lease-held".into()));
    assert_eq!(r.headers["retry-after"], "3");
    assert_eq!(r.json()["holder"], "B");

    // A releases with token 1: stale. B releases: done.
    let r = c
        .send(Req::new("DELETE", "/_fence/leases/orders").held(&a))
        .await;
    assert_eq!(
        (r.status.as_u16(), r.reason()),
        (412, "stale-fencing-token".into())
    );
    let r = c
        .send(Req::new("DELETE", "/_fence/leases/orders").held(&b))
        .await;
    assert_eq!(r.status, 204);

    // t=13 C acquires: token 3. t=14 C writes "c-1": accepted.
    at(&mut now_s, 13).await;
    let r = c.send(acquire("C")).await;
    assert_eq!(r.status, 201);
    let cc = held_from(&r);
    assert_eq!(cc.token, 3);
    at(&mut now_s, 14).await;
    let r = c.send(Req::new("PUT", key).held(&cc).body("c-1")).await;
    assert!(r.status.is_success());

    // GET /kv/orders/x returns "c-1".
    let r = c.send(Req::new("GET", key)).await;
    assert_eq!((r.status.as_u16(), r.text()), (200, "c-1".into()));

    // Inspection shows the term, never the lease id.
    let r = c.send(Req::new("GET", "/_fence/leases/orders")).await;
    let j = r.json();
    assert_eq!(
        j,
        json!({"lease": "orders", "state": "held", "holder": "C", "token": 3, "expires_in_ms": 4000, "transitions": 3})
    );
    let r = c.send(Req::new("GET", "/_fence/leases")).await;
    assert_eq!(r.json()["leases"][0]["token"], 3);
    assert!(!r.text().contains(&cc.lease_id));

    server.stop().await;
}
