//! Authentication: bearer tokens by name and SHA-256, the caller as holder,
//! admin-only endpoints, and 10,000 hostile attempts that change nothing.

mod support;

use std::convert::Infallible;

use bytes::Bytes;
use fencegate::clock::ClockKind;
use fencegate::config::{AuthToken, Config, Overrides};
use http_body_util::channel::Channel;
use serde_json::json;
use sha2::{Digest, Sha256};
use support::{held_from, Harness, Req, Resp};
use tower::ServiceExt;

fn sha(s: &str) -> String {
    Sha256::digest(s.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn harness() -> Harness {
    harness_with(Config::default())
}

fn harness_with(config: Config) -> Harness {
    let mut config = Config {
        clock: ClockKind::Manual,
        ..config
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
    // The status page's shell holds no data and loads without a secret; what
    // it shows comes from the listing and metrics, which need one (metrics
    // an admin's).
    assert_eq!(h.send(Req::new("GET", "/_fence/ui")).await.status, 200);
    let r = h.send(as_("bob", Req::new("GET", "/_fence/metrics"))).await;
    assert_eq!(r.status, 403);
    let r = h.send(as_("ops", Req::new("GET", "/_fence/metrics"))).await;
    assert_eq!(r.status, 200);
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
    // Page by page too: the cursor is always one of his.
    for name in ["zb-1", "zb-2"] {
        let acquire = Req::new("POST", &format!("/_fence/leases/{name}"))
            .json(serde_json::json!({"holder": "bob", "ttl_ms": 5000}));
        assert_eq!(h.send(as_("bob", acquire)).await.status, 201);
    }
    let mut seen = Vec::new();
    let mut path = "/_fence/leases?limit=1".to_owned();
    loop {
        let page = h.send(as_("bob", Req::new("GET", &path))).await.json();
        for l in page["leases"].as_array().unwrap() {
            seen.push(l["lease"].as_str().unwrap().to_owned());
        }
        match page["next"].as_str() {
            Some(next) => {
                assert!(
                    next.starts_with("zb-"),
                    "a cursor names another's lease: {next}"
                );
                path = format!("/_fence/leases?limit=1&after={next}");
            }
            None => break,
        }
    }
    assert_eq!(seen, ["zb-1", "zb-2"]);
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
    assert!(err.to_string().contains("without authentication"), "{err}");
    assert!(load(&[
        ("FENCEGATE_LISTEN", "0.0.0.0:8080"),
        ("FENCEGATE_AUTH__ALLOW_UNAUTHENTICATED_NON_LOOPBACK", "true")
    ])
    .is_ok());
    assert!(load(&[("FENCEGATE_LISTEN", "[::1]:8080")]).is_ok());
}

/// Seen failing when the holder was checked before the renew body was read
/// (and apart from the token check): bob sent the renew of term 2 while term
/// 1 was current, alice then acquired term 2, and bob's body arrived and
/// renewed alice's term.
#[tokio::test]
async fn the_holder_is_checked_with_the_token_not_before_the_body() {
    let mut config = Config::default();
    config.fence.require_lease_id = false;
    let h = harness_with(config);
    let a1 = held_from(
        &h.send(as_(
            "alice",
            Req::new("POST", "/_fence/leases/orders").json(json!({"ttl_ms": 1000})),
        ))
        .await,
    );
    let (mut tx, body) = Channel::<Bytes, Infallible>::new(1);
    let renew = http::Request::post("/_fence/leases/orders/renew")
        .header("authorization", "Bearer bob-secret")
        .header("fencing-token", (a1.token + 1).to_string())
        .body(body)
        .unwrap();
    let bobs_renew = tokio::spawn({
        let app = h.app.clone();
        async move { Resp::read(app.oneshot(renew).await.unwrap()).await }
    });
    for _ in 0..20 {
        tokio::task::yield_now().await;
    }
    h.advance(1000);
    let a2 = held_from(
        &h.send(as_(
            "alice",
            Req::new("POST", "/_fence/leases/orders").json(json!({"ttl_ms": 1000})),
        ))
        .await,
    );
    assert_eq!(a2.token, a1.token + 1);
    tx.send_data(Bytes::from_static(br#"{"ttl_ms": 3600000}"#))
        .await
        .unwrap();
    drop(tx);
    let r = bobs_renew.await.unwrap();
    assert_eq!(
        (r.status.as_u16(), r.reason().as_str()),
        (403, "forbidden"),
        "{}",
        r.text()
    );
    let v = h
        .send(as_("alice", Req::new("GET", "/_fence/leases/orders")))
        .await
        .json();
    assert_eq!(v["expires_in_ms"], 1000, "alice's term was renewed by bob");
}

/// Seen failing before problems were redacted: bob's acquire of alice's
/// lease answered her name, token and time left, and a write with token 0
/// the current token, although inspecting her lease is refused to him.
#[tokio::test]
async fn another_callers_term_is_shown_only_to_admins_and_its_holder() {
    let h = harness();
    let a = held_from(
        &h.send(as_(
            "alice",
            Req::new("POST", "/_fence/leases/orders").json(json!({"ttl_ms": 5000})),
        ))
        .await,
    );
    let acquire = || Req::new("POST", "/_fence/leases/orders").json(json!({"ttl_ms": 1000}));
    let write0 = || {
        Req::new("PUT", "/kv/orders/1")
            .header("fencing-token", "0")
            .header("fencing-lease-id", &a.lease_id)
            .body("x")
    };
    let renew0 = || {
        Req::new("POST", "/_fence/leases/orders/renew")
            .header("fencing-token", "0")
            .header("fencing-lease-id", &a.lease_id)
    };
    for req in [acquire(), write0(), renew0()] {
        let r = h.send(as_("bob", req)).await;
        assert!(matches!(r.status.as_u16(), 409 | 412), "{}", r.text());
        let j = r.json();
        for member in ["holder", "current_token", "expires_in_ms"] {
            assert!(j.get(member).is_none(), "{member} shown to bob: {j}");
        }
    }
    let r = h.send(as_("bob", acquire())).await;
    assert_eq!(r.headers["retry-after"], "5", "the retry hint stays");
    // The admin and the holder herself see the details.
    let j = h.send(as_("ops", acquire())).await.json();
    assert_eq!(
        (j["holder"].as_str(), j["current_token"].as_u64()),
        (Some("alice"), Some(1))
    );
    let j = h.send(as_("alice", write0())).await.json();
    assert_eq!(j["current_token"], 1);
}

#[tokio::test]
async fn on_the_admin_listener_the_status_page_reads_for_admins_only() {
    let mut h = harness();
    let admin = h.app.split_admin();
    let r = h
        .send(as_(
            "alice",
            Req::new("POST", "/_fence/leases/orders").json(json!({"ttl_ms": 5000})),
        ))
        .await;
    assert_eq!(r.status, 201);
    let on_admin = |req: Req| {
        let admin = admin.clone();
        async move { Resp::read(admin.oneshot(req.build("")).await.unwrap()).await }
    };
    // The page is served there, not on the main listener.
    assert_eq!(on_admin(Req::new("GET", "/_fence/ui")).await.status, 200);
    assert_eq!(h.send(Req::new("GET", "/_fence/ui")).await.status, 404);
    // The listing it reads is an operator's there: a writer's secret, even
    // the holder's, gets nothing.
    let r = on_admin(as_("alice", Req::new("GET", "/_fence/leases"))).await;
    assert_eq!((r.status.as_u16(), r.reason().as_str()), (403, "forbidden"));
    let r = on_admin(as_("ops", Req::new("GET", "/_fence/leases"))).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["leases"][0]["lease"], "orders");
    // Nothing else of the lease API is there.
    let r = on_admin(as_("ops", Req::new("GET", "/_fence/leases/orders"))).await;
    assert_eq!(r.status, 404);
}
