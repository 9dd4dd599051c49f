//! Every shipped example configuration (`config/examples/`), run as shipped
//! by the real binary in front of the storage it is written for (nginx
//! WebDAV, etcd's v2 keys API and its v3 JSON gateway, DynamoDB as moto
//! serves it, Garage's S3 API, the embedded store); only the addresses and
//! the data directory are given on the command line, as a user would. Each
//! is attacked the ways the path model and the reach check guard against.

mod support;

use std::path::{Path, PathBuf};

use support::proc::{Proc, TempDir};
use support::servers::{etcd, etcd_v3, garage, nginx, s3_client_venv, GARAGE_KEY};
use support::{held_from, Held, HttpClient, Req};

fn example(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("config/examples")
        .join(name)
}

/// `fencegate serve --config config/examples/NAME` on a free port in front
/// of `upstream` (the example's own storage, started by the test).
fn serve_example(dir: &TempDir, name: &str, upstream: Option<&str>) -> Proc {
    let data = dir.path().join("data");
    let config = example(name);
    let mut args = vec![
        "serve",
        "--config",
        config.to_str().unwrap(),
        "--listen",
        "127.0.0.1:0",
        "--data-dir",
        data.to_str().unwrap(),
    ];
    if let Some(url) = upstream {
        args.extend(["--upstream", url]);
    }
    Proc::start(&args, &dir.path().join("fencegate.log"), &[])
}

async fn acquire(c: &HttpClient, lease: &str, holder: &str, auth: Option<&str>) -> Held {
    let mut req = Req::new("POST", &format!("/_fence/leases/{lease}"))
        .json(serde_json::json!({"holder": holder, "ttl_ms": 60_000}));
    if let Some(secret) = auth {
        req = req.header("authorization", &format!("Bearer {secret}"));
    }
    let r = c.send(req).await;
    assert_eq!(r.status, 201, "{}", r.text());
    held_from(&r)
}

async fn release(c: &HttpClient, lease: &str, held: &Held) {
    let r = c
        .send(Req::new("DELETE", &format!("/_fence/leases/{lease}")).held(held))
        .await;
    assert_eq!(r.status, 204, "{}", r.text());
}

async fn status_reason(c: &HttpClient, req: Req) -> (u16, String) {
    let r = c.send(req).await;
    let reason = if r.status.is_success() {
        String::new()
    } else {
        r.reason()
    };
    (r.status.as_u16(), reason)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nginx_webdav_example_as_shipped() {
    let nginx = nginx().await;
    let dir = TempDir::new("example-webdav");
    let fg = serve_example(&dir, "nginx-webdav.toml", Some(&nginx.url));
    let c = HttpClient::new(&fg.url);
    let a = acquire(&c, "orders", "A", None).await;
    let r = c
        .send(Req::new("PUT", "/dav/orders/42").held(&a).body("from A"))
        .await;
    assert_eq!(r.status, 201, "{}", r.text());
    release(&c, "orders", &a).await;
    let b = acquire(&c, "orders", "B", None).await;
    assert_eq!(
        status_reason(
            &c,
            Req::new("PUT", "/dav/orders/42").held(&a).body("zombie")
        )
        .await,
        (412, "stale-fencing-token".into())
    );
    let p = acquire(&c, "payments", "P", None).await;
    for path in [
        "/dav/orders/..;/payments/1",
        "/dav/orders/%2e%2e/payments/1",
        "/dav/orders/.%2E/payments/1",
        "/dav/orders/%252e%252e/payments/1",
        "/dav/orders//payments/1",
        "/dav/orders/a%5c..%5c..%5cpayments%5c1",
    ] {
        assert_eq!(
            status_reason(&c, Req::new("PUT", path).held(&b).body("x")).await,
            (400, "invalid-request".into()),
            "{path}"
        );
    }
    // A collection above every lease's keys: a DELETE there would take
    // them all.
    assert_eq!(
        status_reason(&c, Req::new("DELETE", "/dav/").held(&b))
            .await
            .0,
        400
    );
    assert_eq!(
        std::fs::read_to_string(nginx.root.join("dav/orders/42")).unwrap(),
        "from A"
    );
    assert!(!nginx.root.join("dav/payments").exists());
    let r = c
        .send(Req::new("PUT", "/dav/payments/1").held(&p).body("p"))
        .await;
    assert_eq!(r.status, 201);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_v2_example_as_shipped() {
    let etcd = etcd().await;
    let dir = TempDir::new("example-etcd");
    let fg = serve_example(&dir, "etcd-v2.toml", Some(&etcd.url));
    let c = HttpClient::new(&fg.url);
    let direct = HttpClient::new(&etcd.url);
    let a = acquire(&c, "orders", "A", None).await;
    let r = c
        .send(Req::new("PUT", "/v2/keys/orders/42?value=shipped").held(&a))
        .await;
    assert_eq!(r.status, 201, "{}", r.text());
    // Writes no route guards, whatever they would touch: refused.
    for (method, path) in [
        ("DELETE", "/v2/keys?recursive=true"),
        ("POST", "/v3/kv/put"),
        ("POST", "/v3/kv/txn"),
        ("POST", "/v3/kv/deleterange"),
    ] {
        assert_eq!(
            status_reason(&c, Req::new(method, path).held(&a)).await,
            (403, "unrouted-write".into()),
            "{method} {path}"
        );
    }
    assert_eq!(
        status_reason(
            &c,
            Req::new("PUT", "/v2/keys/orders/..;/payments/x?value=1").held(&a)
        )
        .await,
        (400, "invalid-request".into())
    );
    // The route's own parent names no lease.
    assert_eq!(
        status_reason(&c, Req::new("DELETE", "/v2/keys/?recursive=true").held(&a)).await,
        (400, "invalid-lease-name".into())
    );
    let r = direct.send(Req::new("GET", "/v2/keys/orders/42")).await;
    assert_eq!(r.json()["node"]["value"], "shipped");
    assert_eq!(
        direct
            .send(Req::new("GET", "/v2/keys/payments"))
            .await
            .status,
        404
    );
}

/// The etcd v3 example: keys in the body, the first segment naming the
/// lease; what one lease cannot fence is refused and etcd keeps its data.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_v3_example_as_shipped() {
    use base64::Engine as _;
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
    let put = |key: &str, value: &str| serde_json::json!({"key": b64(key), "value": b64(value)});
    let etcd = etcd_v3(None).await;
    let dir = TempDir::new("example-etcd-v3");
    let fg = serve_example(&dir, "etcd-v3.toml", Some(&etcd.url));
    let c = HttpClient::new(&fg.url);
    let direct = HttpClient::new(&etcd.url);
    let a = acquire(&c, "orders", "A", None).await;
    let r = c
        .send(
            Req::new("POST", "/v3/kv/put")
                .held(&a)
                .json(put("orders/42", "shipped")),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let two = serde_json::json!({"success": [
        {"request_put": put("orders/42", "x")},
        {"request_put": put("payments/1", "x")},
    ]});
    for (path, body, want) in [
        ("/v3/kv/txn", two, (400, "write-spans-leases")),
        ("/v3/kv/put", put("/registry/x", "x"), (403, "unrouted-key")),
        (
            "/v3/kv/deleterange",
            serde_json::json!({"key": b64("orders"), "range_end": b64("orders0")}),
            (400, "write-spans-leases"),
        ),
        (
            "/v3/lease/revoke",
            serde_json::json!({"ID": "7"}),
            (403, "unrouted-write"),
        ),
    ] {
        assert_eq!(
            status_reason(&c, Req::new("POST", path).held(&a).json(body.clone())).await,
            (want.0, want.1.into()),
            "{path} {body}"
        );
    }
    // The fence keys are fencegate's, even to the holder of the lease
    // their names fall under.
    let f = acquire(&c, "fencegate", "F", None).await;
    for (path, body) in [
        (
            "/v3/kv/put",
            put("fencegate/fence/orders", "00000000000000000000"),
        ),
        (
            "/v3/kv/deleterange",
            serde_json::json!({"key": b64("fencegate/"), "range_end": b64("fencegate0")}),
        ),
    ] {
        assert_eq!(
            status_reason(&c, Req::new("POST", path).held(&f).json(body.clone())).await,
            (403, "unrouted-key".into()),
            "{path} {body}"
        );
    }
    release(&c, "orders", &a).await;
    let _b = acquire(&c, "orders", "B", None).await;
    assert_eq!(
        status_reason(
            &c,
            Req::new("POST", "/v3/kv/put")
                .held(&a)
                .json(put("orders/42", "late"))
        )
        .await,
        (412, "stale-fencing-token".into())
    );
    let r = direct
        .send(Req::new("POST", "/v3/kv/range").json(serde_json::json!({"key": b64("orders/42")})))
        .await;
    assert_eq!(r.json()["kvs"][0]["value"], b64("shipped"));
    let r = direct
        .send(Req::new("POST", "/v3/kv/range").json(serde_json::json!({"key": b64("payments/1")})))
        .await;
    assert_eq!(r.json()["count"], serde_json::Value::Null, "{}", r.text());
}

/// The DynamoDB example in front of moto's server: item `orders/42` of
/// table `jobs` under lease `orders`, its token carried in the item and in
/// the condition DynamoDB evaluates; without them, or as a delete, 428.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dynamodb_example_as_shipped() {
    use support::dynamodb::{call, create_table, item};
    let put = |token: u64, conditioned: bool| {
        support::dynamodb::put("orders/42", serde_json::json!({}), token, conditioned)
    };
    let moto = support::servers::moto().await;
    let direct = HttpClient::new(&moto.url);
    create_table(&direct, "jobs").await;
    let dir = TempDir::new("example-dynamodb");
    let fg = serve_example(&dir, "dynamodb.toml", Some(&moto.url));
    let c = HttpClient::new(&fg.url);
    let a = acquire(&c, "orders", "A", None).await;
    let r = c.send(call("PutItem", put(a.token, true)).held(&a)).await;
    assert_eq!(r.status, 200, "{}", r.text());
    for (op, body) in [
        ("PutItem", put(a.token, false)),
        (
            "DeleteItem",
            serde_json::json!({"TableName": "jobs", "Key": {"pk": {"S": "orders/42"}}}),
        ),
    ] {
        assert_eq!(
            status_reason(&c, call(op, body).held(&a)).await,
            (428, "precondition-required".into()),
            "{op}"
        );
    }
    release(&c, "orders", &a).await;
    let b = acquire(&c, "orders", "B", None).await;
    assert_eq!(
        status_reason(&c, call("PutItem", put(a.token, true)).held(&a)).await,
        (412, "stale-fencing-token".into())
    );
    let r = c.send(call("PutItem", put(b.token, true)).held(&b)).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let stored = item(&direct, "orders/42").await.unwrap();
    assert_eq!(stored["fencing_token"]["N"], b.token.to_string());
}

/// The lease-per-key example fences reads: no read around the rewrite
/// reaches the fenced keys. Seen failing before the reach check:
/// `GET /v2/keys/locks/job-7` and `GET /v2/keys?recursive=true` answered
/// 200 with the value.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_per_key_example_as_shipped() {
    let etcd = etcd().await;
    let dir = TempDir::new("example-lease-per-key");
    let fg = serve_example(&dir, "lease-per-key.toml", Some(&etcd.url));
    let c = HttpClient::new(&fg.url);
    let direct = HttpClient::new(&etcd.url);
    let a = acquire(&c, "job-7", "A", None).await;
    let r = c
        .send(Req::new("PUT", "/locks/job-7?value=secret").held(&a))
        .await;
    assert_eq!(r.status, 201, "{}", r.text());
    // Through its route a read needs the term.
    assert_eq!(
        status_reason(&c, Req::new("GET", "/locks/job-7")).await,
        (428, "missing-fencing-token".into())
    );
    let r = c.send(Req::new("GET", "/locks/job-7").held(&a)).await;
    assert_eq!(r.json()["node"]["value"], "secret");
    // The value is there at the storage: an unfenced read that reached it
    // would show it.
    let r = direct.send(Req::new("GET", "/v2/keys/locks/job-7")).await;
    assert_eq!(r.json()["node"]["value"], "secret");
    for path in [
        "/v2/keys/locks/job-7",
        "/v2/keys/locks/job-7?wait=false",
        "/v2/keys/%6Cocks/job-7",
        "/v2/keys/locks?recursive=true",
        "/v2/keys?recursive=true",
        "/v2/keys/?recursive=true",
    ] {
        let r = c.send(Req::new("GET", path)).await;
        assert_eq!(r.status, 400, "GET {path}: {}", r.text());
        assert!(!r.text().contains("secret"), "GET {path}");
    }
    // Other keys of the same storage are still read as they are.
    let r = c.send(Req::new("GET", "/v2/keys/elsewhere")).await;
    assert_eq!(r.status, 404, "{}", r.text());
    assert_eq!(r.json()["errorCode"], 100, "etcd's own answer");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auth_example_as_shipped() {
    let dir = TempDir::new("example-auth");
    let fg = serve_example(&dir, "auth.toml", None);
    let c = HttpClient::new(&fg.url);
    assert_eq!(
        status_reason(
            &c,
            Req::new("POST", "/_fence/leases/orders").json(serde_json::json!({"ttl_ms": 60_000}))
        )
        .await,
        (401, "unauthorized".into())
    );
    let a = acquire(&c, "orders", "alice", Some("alice-secret")).await;
    let bearer = |req: Req, s: &str| req.header("authorization", &format!("Bearer {s}"));
    let r = c
        .send(bearer(
            Req::new("PUT", "/kv/orders/1").held(&a).body("x"),
            "alice-secret",
        ))
        .await;
    assert_eq!(r.status, 201, "{}", r.text());
    // The admin may read metrics; alice may not; another caller's term is
    // forbidden even with its token and lease id.
    assert_eq!(
        c.send(bearer(Req::new("GET", "/_fence/metrics"), "ops-secret"))
            .await
            .status,
        200
    );
    assert_eq!(
        c.send(bearer(Req::new("GET", "/_fence/metrics"), "alice-secret"))
            .await
            .status,
        403
    );
    let r = c
        .send(bearer(
            Req::new("PUT", "/kv/orders/1").held(&a).body("y"),
            "ops-secret",
        ))
        .await;
    assert_eq!((r.status.as_u16(), r.reason().as_str()), (403, "forbidden"));
}

/// What the caller's environment must not lend the S3 clients (a profile,
/// a session, a proxy between them and fencegate).
const CLEAN_ENV: [&str; 6] = [
    "AWS_PROFILE",
    "AWS_SESSION_TOKEN",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "http_proxy",
    "https_proxy",
];

/// `config/examples/s3.toml` in front of Garage (which checks every SigV4
/// signature), driven by boto3 (`tests/s3/fenced.py`): a signed request is
/// verified by Garage through fencegate and a wrongly signed one refused;
/// after a handover the former holder's PUT, DELETE, CopyObject, UploadPart
/// and CompleteMultipartUpload are refused and land nothing, and the new
/// holder's all work (seen failing with `proxy.preserve_host` off: every
/// request failed the signature check). Then the README's boto3 block runs
/// as printed under a new term.
#[tokio::test]
async fn s3_example_as_shipped() {
    let storage = garage().await;
    let venv = s3_client_venv();
    let dir = TempDir::new("s3-example");
    let p = serve_example(&dir, "s3.toml", Some(&storage.server.url));
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/s3/fenced.py");
    let (key_id, secret) = GARAGE_KEY;
    let args = [
        p.url.clone(),
        storage.server.url.clone(),
        key_id.to_owned(),
        secret.to_owned(),
        storage.region.to_owned(),
    ];
    let python = venv.join("bin/python");
    let py = python.clone();
    let out = tokio::task::spawn_blocking(move || {
        let mut cmd = std::process::Command::new(py);
        for key in CLEAN_ENV {
            cmd.env_remove(key);
        }
        cmd.arg(&script).args(&args).output().unwrap()
    })
    .await
    .unwrap();
    let printed = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success() && printed.trim_end().ends_with("ok"),
        "{printed}\n{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        p.log_text()
    );

    // The README's boto3 block, as printed (it holds its own term through
    // the Python client, whose 428 path it takes: fencegate has not seen
    // the key), with only the address changed; then the object it wrote is
    // checked.
    let readme =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md")).unwrap();
    let block = readme
        .split("<!-- s3-example -->")
        .nth(1)
        .and_then(|rest| rest.split_once("```python\n"))
        .and_then(|(_, rest)| rest.split_once("\n```"))
        .map(|(block, _)| block.to_owned())
        .expect("the README's s3-example block");
    let script = format!(
        "{}\nassert s3.get_object(Bucket=\"orders-bucket\", Key=\"orders/42\")[\"Body\"].read() == b\"shipped\"\n\
         print(\"ok\")\n",
        block.replace("http://127.0.0.1:8280", &p.url)
    );
    let region = storage.region;
    let out = tokio::task::spawn_blocking(move || {
        let mut cmd = std::process::Command::new(python);
        for key in CLEAN_ENV {
            cmd.env_remove(key);
        }
        // The block uses the Python client, from its source.
        let client = Path::new(env!("CARGO_MANIFEST_DIR")).join("clients/python/src");
        cmd.args(["-c", &script])
            .env("PYTHONPATH", client)
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .env("AWS_ACCESS_KEY_ID", key_id)
            .env("AWS_SECRET_ACCESS_KEY", secret)
            .env("AWS_DEFAULT_REGION", region)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
