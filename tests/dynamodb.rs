//! fencegate in front of DynamoDB's API as moto's server serves it (SPEC
//! §11), started by the test on a free loopback port: every write names
//! its items in the body, is fenced by the one lease that guards them all,
//! and must carry the term's token in the item and a condition on it, so
//! that DynamoDB itself refuses a write of an old term that arrives after
//! a later term's. Every refusal is checked against the item read straight
//! from moto.

mod support;

use fencegate::backend::{Backend, EmbeddedStore, Upstream};
use fencegate::clock::ClockKind;
use fencegate::config::{Config, RouteConfig};
use fencegate::route::RouteKind;
use serde_json::{json, Value};
use support::dynamodb::{self, call, create_table, item, CONDITION};
use support::holding::HoldingRelay;
use support::servers::moto;
use support::{Harness, Held, HttpClient, Req};

fn route(pattern: &str) -> RouteConfig {
    RouteConfig {
        kind: RouteKind::DynamoDb,
        pattern: pattern.into(),
        lease: None,
        fence_reads: false,
        timeout_ms: None,
        upstream_prefix: None,
        preconditions: Default::default(),
        partition_key: Some("pk".into()),
        token_attribute: None,
    }
}

/// Creates the tables `jobs` and `other` straight at moto.
async fn tables(direct: &HttpClient) {
    for name in ["jobs", "other"] {
        create_table(direct, name).await;
    }
}

/// The value `v` of item `pk`, as moto holds it.
async fn value(direct: &HttpClient, pk: &str) -> Option<String> {
    item(direct, pk)
        .await
        .and_then(|i| i["v"]["S"].as_str().map(str::to_owned))
}

/// A PutItem of `pk` with value `v`, carrying `token` as fencegate needs.
fn put(pk: &str, v: &str, token: u64) -> Value {
    dynamodb::put(pk, json!({"v": {"S": v}}), token, true)
}

fn proxy(url: &str) -> Harness {
    proxy_with(url, |_| {})
}

fn proxy_with(url: &str, tweak: impl FnOnce(&mut Config)) -> Harness {
    let mut config = Config {
        clock: ClockKind::Manual,
        upstream: url.to_owned(),
        ..Config::default()
    };
    config.fence.routes = vec![route("/jobs/{lease}")];
    tweak(&mut config);
    config.validate().expect("a valid configuration");
    let up = Upstream::new(&url.parse().unwrap(), &config.upstream_options()).unwrap();
    Harness::with_backend(config, Backend::Upstream(up), EmbeddedStore::new())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_is_fenced_by_its_items_lease_and_carries_its_token() {
    let moto = moto().await;
    let direct = HttpClient::new(&moto.url);
    tables(&direct).await;
    let h = proxy(&moto.url);
    let a = h.acquire("orders", "A", 5000).await;

    let r = h
        .send(call("PutItem", put("orders/1", "a-1", a.token)).held(&a))
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(value(&direct, "orders/1").await.as_deref(), Some("a-1"));
    let update = json!({
        "TableName": "jobs",
        "Key": {"pk": {"S": "orders/1"}},
        "UpdateExpression": "SET v = :v, #fencegate_token = :fencegate_token",
        "ConditionExpression": format!("attribute_exists(pk) AND ({CONDITION})"),
        "ExpressionAttributeNames": {"#fencegate_token": "fencing_token"},
        "ExpressionAttributeValues": {":fencegate_token": {"N": a.token.to_string()}, ":v": {"S": "a-2"}},
    });
    let r = h.send(call("UpdateItem", update).held(&a)).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(value(&direct, "orders/1").await.as_deref(), Some("a-2"));

    // What fencegate cannot let DynamoDB compare: 428, nothing sent.
    let mut bare = put("orders/1", "x", a.token);
    for member in [
        "ConditionExpression",
        "ExpressionAttributeNames",
        "ExpressionAttributeValues",
    ] {
        bare.as_object_mut().unwrap().remove(member);
    }
    let delete = json!({"TableName": "jobs", "Key": {"pk": {"S": "orders/1"}}});
    let batch =
        json!({"RequestItems": {"jobs": [{"PutRequest": {"Item": {"pk": {"S": "orders/1"}}}}]}});
    let other_token = put("orders/1", "x", a.token + 1);
    let or = {
        let mut p = put("orders/1", "x", a.token);
        p["ConditionExpression"] = json!(format!("attribute_exists(v) OR ({CONDITION})"));
        p
    };
    let two_leases = json!({"TransactItems": [
        {"Put": put("orders/2", "x", a.token)},
        {"Put": put("users/1", "x", a.token)},
    ]});
    let cases = [
        ("PutItem", bare, 428, "precondition-required"),
        ("PutItem", other_token, 428, "precondition-required"),
        ("PutItem", or, 428, "precondition-required"),
        ("DeleteItem", delete, 428, "precondition-required"),
        ("BatchWriteItem", batch, 428, "precondition-required"),
        ("TransactWriteItems", two_leases, 400, "write-spans-leases"),
        (
            "PutItem",
            json!({"TableName": "other", "Item": {"pk": {"S": "orders/1"}}}),
            403,
            "unrouted-key",
        ),
        (
            "PutItem",
            json!({"TableName": "jobs", "Item": {"pk": {"N": "1"}}}),
            400,
            "invalid-request",
        ),
        (
            "DeleteTable",
            json!({"TableName": "jobs"}),
            403,
            "unrouted-write",
        ),
        (
            "ExecuteStatement",
            json!({"Statement": "DELETE FROM jobs WHERE pk = 'orders/1'"}),
            403,
            "unrouted-write",
        ),
    ];
    for (op, body, status, reason) in cases {
        let r = h.send(call(op, body.clone()).held(&a)).await;
        assert_eq!(
            (r.status.as_u16(), r.reason().as_str()),
            (status, reason),
            "{op} {body}: {}",
            r.text()
        );
    }
    let r = h
        .send(
            call("PutItem", put("orders/1", "x", a.token))
                .held(&a)
                .header("x-amz-target", "DynamoDB_20120810.GetItem"),
        )
        .await;
    assert_eq!(
        (r.status.as_u16(), r.reason().as_str()),
        (400, "invalid-request")
    );
    // A body that is not JSON, and one over the body limit (1 MiB by
    // default): refused, nothing sent.
    let not_json = call("PutItem", json!(null)).body("{\"TableName\": \"jobs\", ");
    let huge = call("PutItem", put("orders/1", &"x".repeat(1 << 20), a.token));
    for (req, want) in [
        (not_json, (400, "invalid-request")),
        (huge, (413, "payload-too-large")),
    ] {
        let r = h.send(req.held(&a)).await;
        assert_eq!(
            (r.status.as_u16(), r.reason().as_str()),
            want,
            "{}",
            r.text()
        );
    }
    assert_eq!(value(&direct, "orders/1").await.as_deref(), Some("a-2"));
    assert!(item(&direct, "orders/2").await.is_none());

    // A's term ends, B takes over: A's write is refused by fencegate.
    h.advance(5000);
    let b = h.acquire("orders", "B", 5000).await;
    let r = h
        .send(call("PutItem", put("orders/1", "zombie", a.token)).held(&a))
        .await;
    assert_eq!(
        (r.status.as_u16(), r.reason().as_str()),
        (412, "stale-fencing-token")
    );
    // B's headers with A's token in the body: the body must name B's.
    let r = h
        .send(call("PutItem", put("orders/1", "x", a.token)).held(&b))
        .await;
    assert_eq!(
        (r.status.as_u16(), r.reason().as_str()),
        (428, "precondition-required")
    );
    let r = h
        .send(
            call(
                "TransactWriteItems",
                json!({"TransactItems": [
                    {"Put": put("orders/1", "b-1", b.token)},
                    {"Put": put("orders/2", "b-1", b.token)},
                ]}),
            )
            .held(&b),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(value(&direct, "orders/1").await.as_deref(), Some("b-1"));
    assert_eq!(
        item(&direct, "orders/2").await.unwrap()["fencing_token"]["N"],
        b.token.to_string()
    );
    // Reads pass with no term.
    let r = h
        .send(call(
            "GetItem",
            json!({"TableName": "jobs", "Key": {"pk": {"S": "orders/1"}}}),
        ))
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["Item"]["v"]["S"], "b-1");
}

/// With unrouted writes allowed, an operation that names no item passes
/// only if it names no table a route guards: a PartiQL statement could
/// delete a guarded item (and its token) with no term at all (found by a
/// review).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allowed_unrouted_writes_reach_no_routed_table() {
    let moto = moto().await;
    let direct = HttpClient::new(&moto.url);
    tables(&direct).await;
    let h = proxy_with(&moto.url, |c| c.fence.allow_unrouted_writes = true);
    let a = h.acquire("orders", "A", 5000).await;
    let r = h
        .send(call("PutItem", put("orders/1", "a-1", a.token)).held(&a))
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    for (op, body) in [
        (
            "ExecuteStatement",
            json!({"Statement": "DELETE FROM jobs WHERE pk = 'orders/1'"}),
        ),
        (
            "ExecuteStatement",
            json!({"Statement": "UPDATE \"jobs\" SET fencing_token = 99 WHERE pk = 'orders/1'"}),
        ),
        ("DeleteTable", json!({"TableName": "jobs"})),
        (
            "UpdateTimeToLive",
            json!({"TableName": "jobs", "TimeToLiveSpecification": {"Enabled": true, "AttributeName": "ttl"}}),
        ),
    ] {
        let r = h.send(call(op, body.clone())).await;
        assert_eq!(
            (r.status.as_u16(), r.reason().as_str()),
            (403, "unrouted-write"),
            "{op} {body}"
        );
    }
    assert_eq!(value(&direct, "orders/1").await.as_deref(), Some("a-1"));
    // The same on a table no route guards: passed on, as allowed.
    let r = h
        .send(call(
            "ExecuteStatement",
            json!({"Statement": "INSERT INTO \"other\" VALUE {'pk': 'x'}"}),
        ))
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
}

/// What became of a write of an old term that reached DynamoDB after the
/// next term wrote: DynamoDB's answer, and the value it kept.
struct LateWrite {
    status: u16,
    answer: Value,
    kept: Option<String>,
}

/// Term 1 writes; a relay holds that write until fencegate gives up on it
/// (504) and the next term has written; then it delivers it. fencegate is
/// the real binary, so that a run can plant a mutant; `conditioned` says
/// whether the writes carry the token and its condition. Real time:
/// fencegate's upstream deadline (1 s) and settle time (0.5 s) pass; the
/// test waits on events, not on time.
async fn late_write(mutant: Option<&str>, conditioned: bool) -> LateWrite {
    let moto = moto().await;
    let direct = HttpClient::new(&moto.url);
    tables(&direct).await;
    let (relay, running) = HoldingRelay::start(&moto.url, |held| {
        held.headers
            .iter()
            .any(|(k, v)| k == "x-amz-target" && v.ends_with(".PutItem"))
    })
    .await;
    let dir = support::proc::TempDir::new("dynamodb-late-write");
    let fg = support::proc::serve_config(
        &dir,
        "fencegate",
        "[fence]\nsettle_ms = 500\n\n[[fence.routes]]\nkind = \"dynamodb\"\npattern = \"/jobs/{lease}\"\npartition_key = \"pk\"\ntimeout_ms = 1000\n",
        &format!("http://{}", running.addr),
        mutant,
    );
    let c = HttpClient::new(&fg.url);
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
    let write = move |v: &str, held: &Held| {
        let mut body = put("orders/1", v, held.token);
        if !conditioned {
            let item = body.as_object_mut().unwrap();
            for member in [
                "ConditionExpression",
                "ExpressionAttributeNames",
                "ExpressionAttributeValues",
            ] {
                item.remove(member);
            }
        }
        call("PutItem", body).held(held)
    };

    let a = acquire("A").await;
    relay.arm();
    let pending = {
        let (c, req) = (c.clone(), write("from A", &a));
        tokio::spawn(async move { c.send(req).await })
    };
    relay.got.notified().await;
    let r = pending.await.unwrap();
    assert_eq!(r.status, 504, "{}", r.text());
    let r = c
        .send(Req::new("DELETE", "/_fence/leases/orders").held(&a))
        .await;
    assert_eq!(r.status, 204, "{}", r.text());
    let b = acquire("B").await;
    let r = c.send(write("from B", &b)).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let late = relay.deliver().await;
    LateWrite {
        status: late.status.as_u16(),
        answer: late.json(),
        kept: value(&direct, "orders/1").await,
    }
}

/// DynamoDB itself refuses a write of an old term that reaches it after
/// the next term wrote, however late (SPEC §11): the item keeps the later
/// term's token and the write's condition fails. With fencegate's check
/// off (a planted mutant) and writes without the condition, the same late
/// write lands over the newer value: what the check prevents.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dynamodb_refuses_a_late_write_of_an_old_term() {
    let late = late_write(None, true).await;
    assert_eq!(late.status, 400, "{}", late.answer);
    assert!(
        late.answer["__type"]
            .as_str()
            .is_some_and(|t| t.ends_with("ConditionalCheckFailedException")),
        "{}",
        late.answer
    );
    assert_eq!(late.kept.as_deref(), Some("from B"));

    let late = late_write(Some("dynamo-condition-unchecked"), false).await;
    assert_eq!(late.status, 200, "{}", late.answer);
    assert_eq!(late.kept.as_deref(), Some("from A"));
}
