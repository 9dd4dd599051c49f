//! fencegate in front of etcd's v3 JSON gateway (SPEC §11), started by the
//! test on free loopback ports: writes name their keys in the body, and
//! each is fenced by the one lease that guards every key it touches. What
//! one lease cannot fence (keys of two leases, a range past one lease's
//! keys, a key no route guards, a call that names no key) is refused, and
//! every refusal is checked against the data read straight from etcd: the
//! storage saw nothing of it. The same writes sent straight to etcd do
//! land, which is what the proxy prevents (and proves the test would
//! notice).

mod support;

use std::process::Command;

use base64::Engine as _;
use fencegate::backend::{Backend, EmbeddedStore, Upstream};
use fencegate::clock::ClockKind;
use fencegate::config::{Config, RouteConfig};
use fencegate::route::RouteKind;
use serde_json::{json, Value};
use support::holding::HoldingRelay;
use support::servers::etcd_v3;
use support::{spawn, Harness, HttpClient, Req};

fn b64(bytes: &str) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

fn etcd_route(pattern: &str, lease: Option<&str>) -> RouteConfig {
    RouteConfig {
        kind: RouteKind::EtcdV3,
        pattern: pattern.into(),
        lease: lease.map(str::to_owned),
        fence_reads: false,
        timeout_ms: None,
        upstream_prefix: None,
        preconditions: Default::default(),
        partition_key: None,
        token_attribute: None,
    }
}

/// fencegate (manual clock) in front of the etcd at `url`, guarding
/// `/app/{lease}` and `/config` (lease "config").
fn proxy(url: &str, tweak: impl FnOnce(&mut Config)) -> Harness {
    let mut config = Config {
        clock: ClockKind::Manual,
        upstream: url.to_owned(),
        ..Config::default()
    };
    config.fence.routes = vec![
        etcd_route("/app/{lease}", None),
        etcd_route("/config", Some("config")),
    ];
    tweak(&mut config);
    config.validate().expect("a valid configuration");
    let up = Upstream::new(&url.parse().unwrap(), &config.upstream_options()).unwrap();
    Harness::with_backend(config, Backend::Upstream(up), EmbeddedStore::new())
}

fn put(key: &str, value: &str) -> Value {
    json!({"key": b64(key), "value": b64(value)})
}

/// The value of `key` as etcd holds it, read straight from etcd.
async fn stored(direct: &HttpClient, key: &str) -> Option<String> {
    let r = direct
        .send(Req::new("POST", "/v3/kv/range").json(json!({"key": b64(key)})))
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let kvs = r.json()["kvs"].clone();
    let value = kvs
        .get(0)?
        .get("value")
        .and_then(Value::as_str)
        .unwrap_or("");
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(value)
        .unwrap();
    Some(String::from_utf8(bytes).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_writer_is_refused_and_etcd_keeps_the_value() {
    let etcd = etcd_v3(None).await;
    let h = proxy(&etcd.url, |_| {});
    let direct = HttpClient::new(&etcd.url);
    let key = "/app/orders/42";

    let a = h.acquire("orders", "A", 5000).await;
    let r = h
        .send(
            Req::new("POST", "/v3/kv/put")
                .held(&a)
                .json(put(key, "a-1")),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(
        r.json()["header"]["revision"].is_string(),
        "etcd's answer: {}",
        r.text()
    );
    assert_eq!(stored(&direct, key).await.as_deref(), Some("a-1"));

    // A's term ends; B takes over; A, a zombie, writes on, in each of the
    // three calls that write, under each path prefix etcd serves.
    h.advance(5000);
    let b = h.acquire("orders", "B", 5000).await;
    let txn = json!({"success": [{"request_put": put(key, "zombie")}]});
    let delete = json!({"key": b64(key)});
    for (path, body) in [
        ("/v3/kv/put", put(key, "zombie")),
        ("/v3beta/kv/put", put(key, "zombie")),
        ("/v3alpha/kv/txn", txn.clone()),
        ("/v3/kv/txn", txn.clone()),
        ("/v3/kv/deleterange", delete.clone()),
        // The gateway percent-decodes the path, and takes a trailing `:`
        // for an empty custom verb: these are puts too.
        ("/v3/kv/%70ut", put(key, "zombie")),
        ("/v3/kv/put:", put(key, "zombie")),
        ("/v3/kv/put%3A", put(key, "zombie")),
    ] {
        let r = h.send(Req::new("POST", path).held(&a).json(body)).await;
        assert_eq!(r.status, 412, "{path}: {}", r.text());
        assert_eq!(r.reason(), "stale-fencing-token", "{path}");
        assert_eq!(r.json()["lease"], "orders");
    }
    assert_eq!(stored(&direct, key).await.as_deref(), Some("a-1"));

    // Without the term's headers, a write is not taken either.
    let r = h
        .send(Req::new("POST", "/v3/kv/put").json(put(key, "x")))
        .await;
    assert_eq!(
        (r.status.as_u16(), r.reason().as_str()),
        (428, "missing-fencing-token")
    );

    // B writes, by each call.
    let r = h
        .send(Req::new("POST", "/v3/kv/txn").held(&b).json(json!({
            "compare": [{"key": b64(key), "target": "VALUE", "result": "EQUAL", "value": b64("a-1")}],
            "success": [{"requestPut": put(key, "b-1")}],
        })))
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["succeeded"], true, "{}", r.text());
    assert_eq!(stored(&direct, key).await.as_deref(), Some("b-1"));
    let r = h
        .send(Req::new("POST", "/v3/kv/deleterange").held(&b).json(json!({
            "key": b64("/app/orders/"), "range_end": b64("/app/orders0"),
        })))
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["deleted"], "1", "{}", r.text());
    assert_eq!(stored(&direct, key).await, None);

    // The zombie's write sent straight to etcd lands: what the proxy
    // stopped.
    let r = direct
        .send(Req::new("POST", "/v3/kv/put").json(put(key, "zombie")))
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(stored(&direct, key).await.as_deref(), Some("zombie"));
}

/// Writes one lease cannot fence are refused with a reason of their own,
/// and etcd sees nothing of them; reads pass without a term.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_one_lease_cannot_fence_is_refused_and_reads_pass() {
    let etcd = etcd_v3(None).await;
    let h = proxy(&etcd.url, |_| {});
    let direct = HttpClient::new(&etcd.url);
    let orders = h.acquire("orders", "A", 60_000).await;
    // Keys of orders, of orders-2 and ordersx (leases whose names start
    // alike, on either side of orders' keys) and of users, written straight to etcd to be seen untouched.
    for key in [
        "/app/orders/1",
        "/app/orders-2/1",
        "/app/ordersx/1",
        "/app/users/1",
        "/other/1",
    ] {
        let r = direct
            .send(Req::new("POST", "/v3/kv/put").json(put(key, "kept")))
            .await;
        assert_eq!(r.status, 200);
    }

    let spans = json!({"success": [
        {"request_put": put("/app/orders/1", "x")},
        {"request_txn": {"success": [{"request_delete_range": {"key": b64("/app/users/1")}}]}},
    ]});
    let failure_branch = json!({
        "compare": [{"key": b64("/app/orders/1"), "target": "VERSION", "result": "EQUAL", "version": "0"}],
        "success": [{"request_put": put("/app/orders/1", "x")}],
        "failure": [{"request_put": put("/app/users/1", "x")}],
    });
    let cases = [
        ("/v3/kv/txn", spans, 400, "write-spans-leases"),
        ("/v3/kv/txn", failure_branch, 400, "write-spans-leases"),
        // A range from orders' key past its keys reaches orders-2's.
        (
            "/v3/kv/deleterange",
            json!({"key": b64("/app/orders"), "range_end": b64("/app/orders0")}),
            400,
            "write-spans-leases",
        ),
        // A range from orders' keys on to ordersx's.
        (
            "/v3/kv/deleterange",
            json!({"key": b64("/app/orders/"), "range_end": b64("/app/ordersz")}),
            400,
            "write-spans-leases",
        ),
        (
            "/v3/kv/deleterange",
            json!({"key": b64("/app/orders/"), "range_end": "AA=="}),
            400,
            "write-spans-leases",
        ),
        ("/v3/kv/put", put("/other/1", "x"), 403, "unrouted-key"),
        // Not a lease name: no route guards it.
        (
            "/v3/kv/put",
            put("/app/or ders/1", "x"),
            403,
            "unrouted-key",
        ),
        // Calls that change data and name no key a route can fence.
        (
            "/v3/lease/revoke",
            json!({"ID": "1"}),
            403,
            "unrouted-write",
        ),
        (
            "/v3/kv/compaction",
            json!({"revision": "1"}),
            403,
            "unrouted-write",
        ),
        ("/v3/auth/enable", json!({}), 403, "unrouted-write"),
        // What etcd might read otherwise than fencegate.
        (
            "/v3/kv/put",
            json!({"key": b64("/app/orders/1"), "value": b64("x"), "Key": b64("/app/users/1")}),
            400,
            "invalid-request",
        ),
        // A key not in base64, and one without its padding: etcd refuses both.
        (
            "/v3/kv/put",
            json!({"key": "/app/orders/1"}),
            400,
            "invalid-request",
        ),
        (
            "/v3/kv/put",
            json!({"key": b64("/app/orders/1").trim_end_matches('=')}),
            400,
            "invalid-request",
        ),
        (
            "/v3/kv/put",
            json!({"value": b64("x")}),
            400,
            "invalid-request",
        ),
    ];
    for (path, body, status, reason) in cases {
        let r = h
            .send(Req::new("POST", path).held(&orders).json(body.clone()))
            .await;
        assert_eq!(r.status, status, "{path} {body}: {}", r.text());
        assert_eq!(r.reason(), reason, "{path} {body}");
    }
    // A key named twice: etcd takes the last; fencegate refuses.
    let twice = format!(
        r#"{{"key": "{}", "value": "{}", "key": "{}"}}"#,
        b64("/app/orders/1"),
        b64("x"),
        b64("/app/users/1")
    );
    let r = h
        .send(
            Req::new("POST", "/v3/kv/put")
                .held(&orders)
                .header("content-type", "application/json")
                .body(twice),
        )
        .await;
    assert_eq!(
        (r.status.as_u16(), r.reason().as_str()),
        (400, "invalid-request")
    );
    for key in [
        "/app/orders/1",
        "/app/orders-2/1",
        "/app/ordersx/1",
        "/app/users/1",
        "/other/1",
    ] {
        assert_eq!(stored(&direct, key).await.as_deref(), Some("kept"), "{key}");
    }

    // Reads pass with no term: a range, and a transaction of reads only.
    let r = h
        .send(Req::new("POST", "/v3/kv/range").json(json!({"key": b64("/app/users/1")})))
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["count"], "1");
    let r = h
        .send(Req::new("POST", "/v3/kv/txn").json(json!({
            "success": [{"request_range": {"key": b64("/app/users/1")}}],
        })))
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["succeeded"], true);

    // A key of a fixed-lease route.
    let config = h.acquire("config", "A", 60_000).await;
    let r = h
        .send(
            Req::new("POST", "/v3/kv/put")
                .held(&config)
                .json(put("/config/db", "v")),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(stored(&direct, "/config/db").await.as_deref(), Some("v"));
}

/// A body over the limit is refused, with nothing sent; with unrouted
/// writes allowed, a call that names no key goes to etcd.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_are_bounded_and_unrouted_calls_may_be_allowed() {
    let etcd = etcd_v3(None).await;
    let h = proxy(&etcd.url, |c| {
        c.limits.max_body_bytes = 4096;
        c.fence.allow_unrouted_writes = true;
    });
    let direct = HttpClient::new(&etcd.url);
    let a = h.acquire("orders", "A", 60_000).await;
    let big = "v".repeat(8192);
    let r = h
        .send(
            Req::new("POST", "/v3/kv/put")
                .held(&a)
                .json(put("/app/orders/big", &big)),
        )
        .await;
    assert_eq!(
        (r.status.as_u16(), r.reason().as_str()),
        (413, "payload-too-large")
    );
    assert_eq!(stored(&direct, "/app/orders/big").await, None);

    // Allowed unrouted writes do not open the keys of a route, nor a key
    // no route guards: those are keys, not calls without one.
    let r = h
        .send(Req::new("POST", "/v3/kv/put").json(put("/other/1", "x")))
        .await;
    assert_eq!(
        (r.status.as_u16(), r.reason().as_str()),
        (403, "unrouted-key")
    );
    // Nor a write under another spelling of its call (found by a review:
    // etcd serves `kv/put:` as a put, and it passed as an unrouted call).
    for path in ["/v3/kv/put", "/v3/kv/put:", "/v3/kv/put%3a"] {
        let r = h
            .send(Req::new("POST", path).json(put("/app/orders/1", "x")))
            .await;
        assert_eq!(
            (r.status.as_u16(), r.reason().as_str()),
            (428, "missing-fencing-token"),
            "{path}"
        );
    }
    assert_eq!(stored(&direct, "/app/orders/1").await, None);
    let r = h
        .send(Req::new("POST", "/v3/lease/grant").json(json!({"TTL": "60"})))
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let id = r.json()["ID"].as_str().unwrap().to_owned();
    // A call that changes no key's value passes; one that may delete or
    // write keys fencegate cannot see does not, allowed or not (a review
    // found a revocation deleting the guarded keys attached to a lease).
    let r = h
        .send(Req::new("POST", "/v3/maintenance/status").json(json!({})))
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    for (path, body) in [
        ("/v3/lease/revoke", json!({"ID": id})),
        ("/v3/lock/lock", json!({"name": b64("/app/orders/lock")})),
        (
            "/v3/election/campaign",
            json!({"name": b64("/app/orders/e"), "value": b64("x")}),
        ),
    ] {
        let r = h.send(Req::new("POST", path).json(body)).await;
        assert_eq!(
            (r.status.as_u16(), r.reason().as_str()),
            (403, "unrouted-write"),
            "{path}"
        );
    }
}

/// curl, as a user at a shell would write: the term's headers and a JSON
/// body, through a fencegate listening on a loopback port.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curl_writes_through_fencegate() {
    let curl = support::tools::program("curl");
    let etcd = etcd_v3(None).await;
    let h = proxy(&etcd.url, |_| {});
    let fg = spawn(h.app.clone()).await;
    let direct = HttpClient::new(&etcd.url);
    let a = h.acquire("orders", "A", 5000).await;
    let run = |held: &support::Held, value: &str| {
        let out = Command::new(&curl)
            .args(["-s", "-w", "\n%{http_code}", "-X", "POST"])
            .arg(format!("{}/v3/kv/put", fg.url()))
            .args(["-H", &format!("Fencing-Token: {}", held.token)])
            .args(["-H", &format!("Fencing-Lease-Id: {}", held.lease_id)])
            .args(["-d", &put("/app/orders/7", value).to_string()])
            .output()
            .unwrap();
        String::from_utf8(out.stdout).unwrap()
    };
    let out = run(&a, "from-curl");
    assert!(out.ends_with("\n200"), "{out}");
    assert_eq!(
        stored(&direct, "/app/orders/7").await.as_deref(),
        Some("from-curl")
    );
    h.advance(5000);
    let _b = h.acquire("orders", "B", 5000).await;
    let out = run(&a, "late");
    assert!(out.ends_with("\n412"), "{out}");
    assert!(out.contains("stale-fencing-token"), "{out}");
    assert_eq!(
        stored(&direct, "/app/orders/7").await.as_deref(),
        Some("from-curl")
    );
    fg.stop().await;
}

#[test]
fn etcd_routes_are_checked_at_start() {
    let mut config = Config::default();
    config.fence.routes = vec![etcd_route("/app/{lease}", None)];
    let err = config.validate().unwrap_err().to_string();
    assert!(err.contains("etcd-v3 routes"), "{err}");
    config.upstream = "http://127.0.0.1:2379".into();
    config.validate().unwrap();
    for (route, says) in [
        (etcd_route("app//{lease}", None), "no empty segment"),
        (etcd_route("/app", None), "names its lease"),
        (
            RouteConfig {
                fence_reads: true,
                ..etcd_route("/app/{lease}", None)
            },
            "takes pattern, lease and timeout_ms only",
        ),
    ] {
        config.fence.routes = vec![route];
        let err = config.validate().unwrap_err().to_string();
        assert!(err.contains(says), "{err}");
    }
}

/// What became of a write of an old term that reached etcd after the next
/// term wrote: etcd's answer to it, and the value etcd kept.
struct LateWrite {
    answer: Value,
    kept: Option<String>,
}

/// Term 1 writes; a relay holds that write until fencegate gives up on it
/// (504) and the lease's next term has written; then the relay delivers
/// it. fencegate is the real binary, so that a run can plant a mutant.
/// Real time: fencegate's own upstream deadline (1 s) and settle time
/// (0.5 s) pass; the test waits on events, not on time.
async fn late_write(mutant: Option<&str>) -> LateWrite {
    let etcd = etcd_v3(None).await;
    let (relay, running) =
        HoldingRelay::start(&etcd.url, |held| held.path.ends_with("/kv/txn")).await;
    let dir = support::proc::TempDir::new("etcd-late-write");
    let fg = support::proc::serve_config(
        &dir,
        "fencegate",
        "[fence]\nsettle_ms = 500\n\n[[fence.routes]]\nkind = \"etcd-v3\"\npattern = \"/app/{lease}\"\ntimeout_ms = 1000\n",
        &format!("http://{}", running.addr),
        mutant,
    );
    let c = HttpClient::new(&fg.url);
    let direct = HttpClient::new(&etcd.url);
    let key = "/app/orders/1";
    let acquire = |holder: &'static str| {
        let c = c.clone();
        async move {
            let r = c
                .send(
                    Req::new("POST", "/_fence/leases/orders")
                        .json(json!({"holder": holder, "ttl_ms": 60_000})),
                )
                .await;
            assert_eq!(r.status, 201, "{}", r.text());
            support::held_from(&r)
        }
    };

    let a = acquire("A").await;
    relay.arm();
    let write = {
        let (c, a) = (
            c.clone(),
            support::Held {
                token: a.token,
                lease_id: a.lease_id.clone(),
            },
        );
        tokio::spawn(async move {
            c.send(
                Req::new("POST", "/v3/kv/put")
                    .held(&a)
                    .json(put(key, "from A")),
            )
            .await
        })
    };
    relay.got.notified().await;
    let r = write.await.unwrap();
    assert_eq!(r.status, 504, "{}", r.text());
    let r = c
        .send(Req::new("DELETE", "/_fence/leases/orders").held(&a))
        .await;
    assert_eq!(r.status, 204, "{}", r.text());
    let b = acquire("B").await;
    let r = c
        .send(
            Req::new("POST", "/v3/kv/put")
                .held(&b)
                .json(put(key, "from B")),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let answer = relay.deliver().await;
    assert_eq!(answer.status, 200, "{}", answer.text());
    let answer = answer.json();
    LateWrite {
        answer,
        kept: stored(&direct, key).await,
    }
}

/// etcd itself refuses a write of an old term that reaches it after the
/// next term wrote, however late (SPEC §11): its fence key names the later
/// term. With the comparison dropped (a planted mutant), the same late
/// write lands over the newer value: what the comparison prevents.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_refuses_a_late_write_of_an_old_term() {
    let late = late_write(None).await;
    assert_ne!(late.answer["succeeded"], true, "{}", late.answer);
    assert_ne!(
        late.answer["responses"][0]["response_txn"]["succeeded"], true,
        "{}",
        late.answer
    );
    assert_eq!(late.kept.as_deref(), Some("from B"));

    let late = late_write(Some("etcd-compare-dropped")).await;
    assert_eq!(late.answer["succeeded"], true, "{}", late.answer);
    assert_eq!(late.kept.as_deref(), Some("from A"));
}

/// The Rust client's etcd calls (`LeaseGuard::etcd_put`, `etcd_delete`,
/// `etcd_txn`) through fencegate in front of etcd: written under the term,
/// read back straight from etcd; a guard whose term ended is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rust_client_writes_to_etcd_under_its_term() {
    let etcd = etcd_v3(None).await;
    let h = proxy(&etcd.url, |_| {});
    let direct = HttpClient::new(&etcd.url);
    let server = spawn(h.app.clone()).await;
    let client = fencegate::client::LeaseClient::new(&server.url());
    let a = client
        .hold("orders", "A", 60_000, 0, Default::default())
        .await
        .unwrap();
    let w = a.etcd_put(b"/app/orders/1", b"a-1").await.unwrap();
    assert_eq!(w.status, 200, "{w:?}");
    let w = a.etcd_put(b"/app/orders/2", b"a-2").await.unwrap();
    assert_eq!(w.status, 200, "{w:?}");
    assert_eq!(
        stored(&direct, "/app/orders/1").await.as_deref(),
        Some("a-1")
    );
    let w = a
        .etcd_delete(b"/app/orders/2", Some(b"/app/orders/3"))
        .await
        .unwrap();
    assert_eq!(w.status, 200, "{w:?}");
    let answer: Value = serde_json::from_slice(&w.body).unwrap();
    assert_eq!(answer["deleted"], "1", "{answer}");
    assert_eq!(stored(&direct, "/app/orders/2").await, None);
    let w = a
        .etcd_txn(json!({
            "compare": [{"key": b64("/app/orders/1"), "target": "VALUE", "result": "EQUAL", "value": b64("a-1")}],
            "success": [{"request_put": put("/app/orders/1", "a-2")}],
        }))
        .await
        .unwrap();
    assert_eq!(w.status, 200, "{w:?}");
    assert_eq!(
        stored(&direct, "/app/orders/1").await.as_deref(),
        Some("a-2")
    );
    // Another lease's key: refused by fencegate, etcd untouched.
    let w = a.etcd_put(b"/app/users/1", b"x").await.unwrap();
    assert_eq!(w.status, 412, "{w:?}");
    assert_eq!(stored(&direct, "/app/users/1").await, None);

    // A's term ends and B's begins: A's put is refused.
    h.advance(60_000);
    let b = h.acquire("orders", "B", 60_000).await;
    let w = a.etcd_put(b"/app/orders/1", b"zombie").await;
    match w {
        Ok(w) => assert_eq!(w.status, 412, "{w:?}"),
        Err(e) => assert!(matches!(e, fencegate::client::ClientError::Lost(_)), "{e}"),
    }
    assert_eq!(
        stored(&direct, "/app/orders/1").await.as_deref(),
        Some("a-2")
    );
    let r = h
        .send(
            Req::new("POST", "/v3/kv/put")
                .held(&b)
                .json(put("/app/orders/1", "b-1")),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
}
