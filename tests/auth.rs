//! Authentication: bearer tokens by name and SHA-256, the caller as holder,
//! admin-only endpoints, and 10,000 hostile attempts that change nothing.

mod support;

use fencegate::clock::ClockKind;
use fencegate::config::{AuthToken, Config, Overrides};
use serde_json::json;
use sha2::{Digest, Sha256};
use support::{held_from, Harness, Req};

fn sha(s: &str) -> String {
    Sha256::digest(s.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn harness() -> Harness {
    let mut config = Config {
        clock: ClockKind::Manual,
        ..Config::default()
    };
    config.auth.enabled = true;
    config.auth.tokens = vec![
        AuthToken {
            name: "alice".into(),
            sha256: sha("alice-secret"),
            admin: false,
        },
        AuthToken {
            name: "bob".into(),
            sha256: sha("bob-secret"),
            admin: false,
        },
        AuthToken {
            name: "ops".into(),
            sha256: sha("ops-secret"),
            admin: true,
        },
    ];
    Harness::with_config(config)
}

fn as_(who: &str, req: Req) -> Req {
    req.header("authorization", &format!("Bearer {who}-secret"))
}

#[tokio::test]
async fn callers_need_a_known_bearer_token_except_for_health() {
    let h = harness();
    for req in [
        Req::new("GET", "/_fence/leases"),
        Req::new("POST", "/_fence/leases/x").json(json!({"ttl_ms": 1000})),
        Req::new("GET", "/kv/x/1"),
        Req::new("GET", "/_fence/leases").header("authorization", "Bearer nope"),
        Req::new("GET", "/_fence/leases").header("authorization", "Basic YWxpY2U6eA=="),
    ] {
        let r = h.send(req).await;
        assert_eq!(
            (r.status.as_u16(), r.reason().as_str()),
            (401, "unauthorized")
        );
        assert_eq!(r.headers["www-authenticate"], "Bearer realm=\"fencegate\"");
        assert!(r.headers.contains_key("x-request-id"));
    }
    assert_eq!(h.send(Req::new("GET", "/_fence/livez")).await.status, 200);
    assert_eq!(h.send(Req::new("GET", "/_fence/readyz")).await.status, 200);
}

#[tokio::test]
async fn the_caller_is_the_holder_and_only_the_holder_may_use_the_term() {
    let h = harness();
    let r = h
        .send(as_(
            "alice",
            Req::new("POST", "/_fence/leases/orders").json(json!({"ttl_ms": 5000})),
        ))
        .await;
    assert_eq!(r.status, 201);
    assert_eq!(r.json()["holder"], "alice");
    let a = held_from(&r);
    let r = h
        .send(as_(
            "alice",
            Req::new("POST", "/_fence/leases/x").json(json!({"holder": "bob", "ttl_ms": 5000})),
        ))
        .await;
    assert_eq!((r.status.as_u16(), r.reason().as_str()), (403, "forbidden"));

    assert_eq!(
        h.send(as_(
            "alice",
            Req::new("PUT", "/kv/orders/1").held(&a).body("a")
        ))
        .await
        .status,
        201
    );
    // Bob has alice's token and lease id (a leak): still refused, nothing changes.
    for req in [
        Req::new("PUT", "/kv/orders/1").held(&a).body("bob"),
        Req::new("POST", "/_fence/leases/orders/renew").held(&a),
        Req::new("DELETE", "/_fence/leases/orders").held(&a),
        Req::new("GET", "/_fence/leases/orders"),
    ] {
        let r = h.send(as_("bob", req)).await;
        assert_eq!(
            (r.status.as_u16(), r.reason().as_str()),
            (403, "forbidden"),
            "{}",
            r.text()
        );
    }
    assert_eq!(h.store.get("/kv/orders/1").unwrap(), "a");
    let list = h
        .send(as_("bob", Req::new("GET", "/_fence/leases")))
        .await
        .json();
    assert_eq!(
        list["leases"].as_array().unwrap().len(),
        0,
        "bob sees only his own leases"
    );
    // Admins see everything and may use the clock and metrics; others may not.
    let list = h
        .send(as_("ops", Req::new("GET", "/_fence/leases")))
        .await
        .json();
    assert_eq!(list["leases"][0]["holder"], "alice");
    assert_eq!(
        h.send(as_("ops", Req::new("GET", "/_fence/leases/orders")))
            .await
            .status,
        200
    );
    assert_eq!(
        h.send(as_("ops", Req::new("GET", "/_fence/metrics")))
            .await
            .status,
        200
    );
    for path in ["/_fence/metrics", "/_fence/clock"] {
        let r = h.send(as_("alice", Req::new("GET", path))).await;
        assert_eq!((r.status.as_u16(), r.reason().as_str()), (403, "forbidden"));
    }
    assert_eq!(
        h.send(as_(
            "alice",
            Req::new("DELETE", "/_fence/leases/orders").held(&a)
        ))
        .await
        .status,
        204
    );
}

#[tokio::test]
async fn ten_thousand_hostile_attempts_change_nothing() {
    let h = harness();
    let a = held_from(
        &h.send(as_(
            "alice",
            Req::new("POST", "/_fence/leases/orders").json(json!({"ttl_ms": 60_000})),
        ))
        .await,
    );
    h.store.put("/kv/orders/1", "orig");
    let before = h
        .send(as_("ops", Req::new("GET", "/_fence/leases/orders")))
        .await
        .json();
    let wrong_id = "0".repeat(32);
    for i in 0..10_000 {
        let (who, id) = match i % 3 {
            0 => ("alice", wrong_id.as_str()), // the holder, a wrong lease id
            1 => ("mallory", a.lease_id.as_str()), // an unknown bearer token
            _ => ("bob", a.lease_id.as_str()), // another holder's identity
        };
        let base = match i % 4 {
            0 => Req::new("PUT", "/kv/orders/1").body("evil"),
            1 => Req::new("POST", "/_fence/leases/orders/renew").json(json!({"ttl_ms": 3_600_000})),
            2 => Req::new("DELETE", "/_fence/leases/orders"),
            _ => Req::new("DELETE", "/kv/orders/1"),
        };
        let req = as_(
            who,
            base.header("fencing-token", &a.token.to_string())
                .header("fencing-lease-id", id),
        );
        let r = h.send(req).await;
        assert!(
            matches!(r.status.as_u16(), 401 | 403),
            "attempt {i}: {} {}",
            r.status,
            r.text()
        );
    }
    let after = h
        .send(as_("ops", Req::new("GET", "/_fence/leases/orders")))
        .await
        .json();
    assert_eq!(before, after, "the lease changed");
    assert_eq!(
        h.store.get("/kv/orders/1").unwrap(),
        "orig",
        "the stored value changed"
    );
}

#[test]
fn listening_beyond_loopback_needs_auth_or_an_explicit_flag() {
    let load = |env: &[(&str, &str)]| {
        Config::load(
            None,
            env.iter().map(|(k, v)| (k.to_string(), v.to_string())),
            &Overrides::default(),
        )
    };
    let err = load(&[("FENCEGATE_LISTEN", "0.0.0.0:8080")]).unwrap_err();
    assert!(err.contains("without authentication"), "{err}");
    assert!(load(&[
        ("FENCEGATE_LISTEN", "0.0.0.0:8080"),
        ("FENCEGATE_AUTH__ALLOW_UNAUTHENTICATED_NON_LOOPBACK", "true")
    ])
    .is_ok());
    assert!(load(&[("FENCEGATE_LISTEN", "[::1]:8080")]).is_ok());
}
