//! fencegate in front of real storage: nginx's WebDAV module (which accepts
//! any PUT) and etcd's v2 keys API, each started by the test on free loopback
//! ports. Stale writers are refused with the stored value untouched, read back
//! straight from the backend; the same stale write sent straight to the
//! backend does land, which is what the proxy prevents (and proves the test
//! would notice).

mod support;

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use fencegate::backend::{Backend, EmbeddedStore, Upstream};
use fencegate::clock::ClockKind;
use fencegate::config::{Config, RouteConfig};
use http::{Request, Response};
use http_body_util::{BodyExt, Channel};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use support::proc::{serve_args, Proc, TempDir};
use support::servers::{etcd, nginx, nginx_tls};
use support::{spawn, Harness, HttpClient, Req};

fn route(pattern: &str, upstream_prefix: Option<&str>) -> RouteConfig {
    RouteConfig {
        kind: Default::default(),
        pattern: pattern.into(),
        lease: None,
        fence_reads: false,
        timeout_ms: None,
        upstream_prefix: upstream_prefix.map(str::to_owned),
        preconditions: Default::default(),
        partition_key: None,
        token_attribute: None,
    }
}

/// fencegate (manual clock) proxying to `url` with `routes`.
fn proxy(url: &str, routes: Vec<RouteConfig>) -> Harness {
    proxy_with(url, routes, |_| {})
}

fn proxy_with(url: &str, routes: Vec<RouteConfig>, tweak: impl FnOnce(&mut Config)) -> Harness {
    let mut config = Config {
        clock: ClockKind::Manual,
        upstream: url.to_owned(),
        ..Config::default()
    };
    config.fence.routes = routes;
    tweak(&mut config);
    config.limits.max_body_bytes = 16 * 1024 * 1024;
    let up = Upstream::new(&url.parse().unwrap(), &config.upstream_options()).unwrap();
    Harness::with_backend(config, Backend::Upstream(up), EmbeddedStore::new())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nginx_webdav_behind_fencegate() {
    let nginx = nginx().await;
    let h = proxy(&nginx.url, vec![route("/dav/{lease}", None)]);
    let fg = spawn(h.app.clone()).await;
    let c = HttpClient::new(&fg.url());
    let direct = HttpClient::new(&nginx.url);
    let key = "/dav/orders/42";

    let a = h.acquire("orders", "A", 5000).await;
    let r = c.send(Req::new("PUT", key).held(&a).body("a-1")).await;
    assert_eq!(r.status, 201, "{}", r.text());
    let r = c.send(Req::new("GET", key)).await;
    assert_eq!((r.status.as_u16(), r.text().as_str()), (200, "a-1"));
    assert_eq!(direct.send(Req::new("GET", key)).await.text(), "a-1");
    assert_eq!(
        std::fs::read_to_string(nginx.root.join("dav/orders/42")).unwrap(),
        "a-1"
    );

    // A's term ends; B takes over; A, a zombie, writes on.
    h.advance(5000);
    let b = h.acquire("orders", "B", 5000).await;
    let r = c.send(Req::new("PUT", key).held(&a).body("zombie")).await;
    assert_eq!(
        (r.status.as_u16(), r.reason().as_str()),
        (412, "stale-fencing-token")
    );
    assert_eq!(
        direct.send(Req::new("GET", key)).await.text(),
        "a-1",
        "the stale write reached nginx"
    );
    let r = c.send(Req::new("PUT", key).held(&b).body("b-1")).await;
    assert_eq!(r.status, 204);
    assert_eq!(direct.send(Req::new("GET", key)).await.text(), "b-1");

    // Without the proxy the zombie wins: nginx takes any PUT.
    let r = direct
        .send(Req::new("PUT", key).held(&a).body("zombie"))
        .await;
    assert!(r.status.is_success());
    assert_eq!(direct.send(Req::new("GET", key)).await.text(), "zombie");

    // WebDAV's other writes are fenced too; nginx's own errors pass through.
    let r = c.send(Req::new("MKCOL", "/dav/orders/dir/")).await;
    assert_eq!(
        (r.status.as_u16(), r.reason().as_str()),
        (428, "missing-fencing-token")
    );
    let r = c.send(Req::new("MKCOL", "/dav/orders/dir/").held(&b)).await;
    assert_eq!(r.status, 201);
    // COPY/MOVE may not write into another lease's tree.
    let r = c
        .send(
            Req::new("COPY", key)
                .held(&b)
                .header("destination", &format!("{}/dav/payments/1", nginx.url)),
        )
        .await;
    assert_eq!(
        (r.status.as_u16(), r.reason().as_str()),
        (400, "invalid-request")
    );
    assert!(!nginx.root.join("dav/payments/1").exists());
    let r = c
        .send(
            Req::new("COPY", key)
                .held(&b)
                .header("destination", &format!("{}/dav/orders/copy", nginx.url)),
        )
        .await;
    assert!(r.status.is_success(), "{}", r.text());
    assert!(nginx.root.join("dav/orders/copy").exists());
    // A Destination that names the proxy, as a client naturally writes it
    // (here by the name `localhost`), reaches nginx as the upstream's own
    // address: nginx checks its host against the Host it was sent. Seen
    // failing before: nginx refused the COPY with 400.
    let proxy_by_name = format!("http://localhost:{}", fg.addr.port());
    let lc = HttpClient::new(&proxy_by_name);
    let r = lc
        .send(
            Req::new("COPY", key)
                .held(&b)
                .header("destination", &format!("{proxy_by_name}/dav/orders/copy2")),
        )
        .await;
    assert!(r.status.is_success(), "{}", r.text());
    assert!(nginx.root.join("dav/orders/copy2").exists());
    // A redirect from nginx (a directory without its slash) points at the
    // proxy as the client named it, not at the storage. Seen failing
    // before: it named nginx.
    let r = lc.send(Req::new("GET", "/dav/orders/dir")).await;
    assert_eq!(r.status, 301, "{}", r.text());
    assert_eq!(
        r.headers["location"].to_str().unwrap(),
        format!("{proxy_by_name}/dav/orders/dir/")
    );
    let r = c.send(Req::new("GET", "/dav/orders/missing")).await;
    assert_eq!(r.status, 404);
    assert!(
        r.headers["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/html"),
        "nginx's body"
    );
    assert!(r.text().contains("nginx"));

    let r = c.send(Req::new("DELETE", key).held(&b)).await;
    assert_eq!(r.status, 204);
    assert_eq!(direct.send(Req::new("GET", key)).await.status, 404);
    fg.stop().await;
}

/// Paths and headers that would reach a guarded file around its route, with
/// unrouted writes allowed (`/dav/public/…` is unrouted, `/dav/guarded/…`
/// guarded, and nginx serves both). Seen failing before empty segments and
/// every Destination were checked: `PUT //dav/guarded/payments/ledger`
/// matched no route, was forwarded, and nginx merged the slashes onto the
/// guarded file; `GET //dav/…` skipped `fence_reads`; a COPY from an
/// unrouted path skipped the Destination check.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slashes_and_destinations_cannot_reach_a_guarded_file_around_its_route() {
    let nginx = nginx().await;
    let mut guarded = route("/dav/guarded/{lease}", None);
    guarded.fence_reads = true;
    let h = proxy_with(&nginx.url, vec![guarded], |c| {
        c.fence.allow_unrouted_writes = true;
    });
    let fg = spawn(h.app.clone()).await;
    let c = HttpClient::new(&fg.url());
    let direct = HttpClient::new(&nginx.url);
    let ledger = "/dav/guarded/payments/ledger";
    let ledger_file = || std::fs::read_to_string(nginx.root.join("dav/guarded/payments/ledger"));
    assert!(direct
        .send(Req::new("PUT", ledger).body("original"))
        .await
        .status
        .is_success());
    assert!(direct
        .send(Req::new("PUT", "/dav/public/x").body("evil"))
        .await
        .status
        .is_success());

    let to_ledger = format!("{}{ledger}", nginx.url);
    for req in [
        Req::new("PUT", &format!("/{ledger}")).body("evil"),
        Req::new("PUT", "/dav//guarded/payments/ledger").body("evil"),
        Req::new("GET", &format!("/{ledger}")),
        Req::new("COPY", "/dav/public/x")
            .header("destination", &to_ledger)
            .header("overwrite", "T"),
        Req::new("MOVE", "/dav/public/x").header("destination", &to_ledger),
        Req::new("COPY", "/dav/public/x")
            .header("destination", &format!("{}/dav/public/y", nginx.url))
            .header("destination", &to_ledger),
    ] {
        let r = c.send(req).await;
        assert_eq!(
            (r.status.as_u16(), r.reason().as_str()),
            (400, "invalid-request"),
            "{}",
            r.text()
        );
    }
    assert_eq!(ledger_file().unwrap(), "original");
    assert_eq!(
        std::fs::read_to_string(nginx.root.join("dav/public/x")).unwrap(),
        "evil"
    );
    // What is allowed still works: unrouted to unrouted, and a trailing slash.
    let r = c
        .send(
            Req::new("COPY", "/dav/public/x")
                .header("destination", &format!("{}/dav/public/y", nginx.url)),
        )
        .await;
    assert!(r.status.is_success(), "{}", r.text());
    assert!(nginx.root.join("dav/public/y").exists());
    let r = c.send(Req::new("MKCOL", "/dav/public/dir/")).await;
    assert_eq!(r.status, 201, "{}", r.text());
    fg.stop().await;
}

/// Sends `chunks` of `chunk` bytes as a chunked (unsized) body; after the
/// first half, waits for `halfway` (if any) before sending the rest.
async fn put_streamed(
    url: &str,
    path: &str,
    held: &support::Held,
    chunks: usize,
    chunk: usize,
    halfway: Option<Arc<tokio::sync::Notify>>,
) -> Result<support::Resp, String> {
    let (mut tx, body) = Channel::<Bytes, Infallible>::new(4);
    let mut req = Request::put(format!("{url}{path}"));
    for (k, v) in held.headers() {
        req = req.header(k, v);
    }
    let req = req.body(body).unwrap();
    let client: Client<_, Channel<Bytes, Infallible>> =
        Client::builder(TokioExecutor::new()).build_http();
    let sender = tokio::spawn(async move {
        for i in 0..chunks {
            if i == chunks / 2 {
                if let Some(halfway) = &halfway {
                    // Bounded: a proxy that buffers the whole body never
                    // lets the backend see the first half.
                    tokio::time::timeout(Duration::from_secs(10), halfway.notified())
                        .await
                        .expect("the backend saw nothing before the client finished: the body was buffered");
                }
            }
            if tx.send_data(Bytes::from(vec![b'x'; chunk])).await.is_err() {
                return;
            }
        }
    });
    let res = client.request(req).await.map_err(|e| e.to_string())?;
    let resp = support::Resp::read(res).await;
    sender.await.unwrap();
    Ok(resp)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_bodies_stream_through_without_being_buffered() {
    // A backend that signals once it has received the first 1 MiB.
    let halfway = Arc::new(tokio::sync::Notify::new());
    let backend = spawn(tower::service_fn({
        let halfway = halfway.clone();
        move |req: Request<hyper::body::Incoming>| {
            let halfway = halfway.clone();
            async move {
                let mut body = req.into_body();
                let mut total = 0usize;
                let mut signalled = false;
                while let Some(frame) = body.frame().await {
                    if let Ok(data) = frame.unwrap().into_data() {
                        total += data.len();
                    }
                    if total >= 1024 * 1024 && !signalled {
                        halfway.notify_one();
                        signalled = true;
                    }
                }
                Ok::<_, Infallible>(Response::new(fencegate::body::full(total.to_string())))
            }
        }
    }))
    .await;
    let h = proxy(&backend.url(), vec![route("/dav/{lease}", None)]);
    let fg = spawn(h.app.clone()).await;
    let a = h.acquire("big", "A", 5000).await;
    // 8 MiB in 64 KiB chunks; the second half goes only once the backend has
    // seen 1 MiB of the first.
    let r = put_streamed(
        &fg.url(),
        "/dav/big/blob",
        &a,
        128,
        64 * 1024,
        Some(halfway),
    )
    .await
    .unwrap();
    assert_eq!(
        (r.status.as_u16(), r.text()),
        (200, (8 * 1024 * 1024).to_string())
    );
    fg.stop().await;
    backend.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_bodies_reach_nginx_intact_and_oversized_ones_never_land() {
    let nginx = nginx().await;
    let h = proxy(&nginx.url, vec![route("/dav/{lease}", None)]);
    let fg = spawn(h.app.clone()).await;
    let c = HttpClient::new(&fg.url());
    let a = h.acquire("big", "A", 5000).await;
    let body: Vec<u8> = (0..8 * 1024 * 1024u32).map(|i| (i % 251) as u8).collect();
    let r = c
        .send(Req::new("PUT", "/dav/big/blob").held(&a).body(body.clone()))
        .await;
    assert_eq!(r.status, 201, "{}", r.text());
    let r = c.send(Req::new("GET", "/dav/big/blob")).await;
    assert!(r.body == body, "the body changed on the way");
    // A chunked body that runs past the 16 MiB limit: cut off, refused, and
    // nothing lands at nginx.
    let r = put_streamed(&fg.url(), "/dav/big/huge", &a, 17, 1024 * 1024, None)
        .await
        .unwrap();
    assert_eq!(
        (r.status.as_u16(), r.reason().as_str()),
        (413, "payload-too-large")
    );
    assert!(!nginx.root.join("dav/big/huge").exists());
    fg.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_v2_keys_behind_fencegate() {
    let etcd = etcd().await;
    let h = proxy(
        &etcd.url,
        vec![
            route("/v2/keys/{lease}", None),
            route("/keys/{lease}", Some("/v2/keys")),
        ],
    );
    let fg = spawn(h.app.clone()).await;
    let c = HttpClient::new(&fg.url());
    let direct = HttpClient::new(&etcd.url);
    let form = |req: Req, value: &str| {
        req.header("content-type", "application/x-www-form-urlencoded")
            .body(format!("value={value}"))
    };
    let value = |r: &support::Resp| r.json()["node"]["value"].as_str().map(str::to_owned);
    let key = "/v2/keys/orders/42";

    let a = h.acquire("orders", "A", 5000).await;
    let r = c.send(form(Req::new("PUT", key).held(&a), "a-1")).await;
    assert_eq!(r.status, 201, "{}", r.text());
    let r = c.send(Req::new("GET", key)).await;
    assert_eq!(value(&r).as_deref(), Some("a-1"));

    h.advance(5000);
    let b = h.acquire("orders", "B", 5000).await;
    let r = c.send(form(Req::new("PUT", key).held(&a), "zombie")).await;
    assert_eq!(
        (r.status.as_u16(), r.reason().as_str()),
        (412, "stale-fencing-token")
    );
    assert_eq!(
        value(&direct.send(Req::new("GET", key)).await).as_deref(),
        Some("a-1")
    );
    let r = c.send(form(Req::new("PUT", key).held(&b), "b-1")).await;
    assert_eq!(r.status, 200, "{}", r.text());

    // Straight to etcd, the zombie's write lands.
    let r = direct.send(form(Req::new("PUT", key), "zombie")).await;
    assert!(r.status.is_success());
    assert_eq!(
        value(&direct.send(Req::new("GET", key)).await).as_deref(),
        Some("zombie")
    );

    // A rewritten prefix: /keys/… is /v2/keys/… upstream.
    let r = c
        .send(form(Req::new("PUT", "/keys/orders/43").held(&b), "b-2"))
        .await;
    assert_eq!(r.status, 201, "{}", r.text());
    assert_eq!(
        value(&direct.send(Req::new("GET", "/v2/keys/orders/43")).await).as_deref(),
        Some("b-2")
    );

    // etcd's own errors pass through: a missing key is its JSON 404.
    let r = c.send(Req::new("GET", "/v2/keys/orders/missing")).await;
    assert_eq!(r.status, 404);
    assert_eq!(r.json()["errorCode"], 100);

    let r = c.send(Req::new("DELETE", key).held(&b)).await;
    assert_eq!(r.status, 200);
    assert_eq!(direct.send(Req::new("GET", key)).await.status, 404);
    fg.stop().await;
}

/// Storage over HTTPS: nginx with a certificate from a private CA. With
/// the CA in `proxy.upstream_ca_file`, a fenced write lands (dedicated and
/// pooled upstream connections); without it the certificate cannot be
/// verified: 502 upstream-error, a log line naming the certificate, and
/// nothing written (never a plain-text fallback).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nginx_over_https_behind_fencegate() {
    let dir = TempDir::new("https-upstream");
    let support::servers::TestCa { ca, cert, key } = support::servers::TestCa::new(dir.path());
    let nginx = nginx_tls(&cert, &key).await;
    assert!(nginx.url.starts_with("https://"));
    for mode in [
        fencegate::backend::ConnectionMode::PerClient,
        fencegate::backend::ConnectionMode::Pooled,
    ] {
        let h = proxy_with(&nginx.url, vec![route("/dav/{lease}", None)], |c| {
            c.proxy.upstream_ca_file = ca.clone();
            c.proxy.upstream_connections = mode;
        });
        let fg = spawn(h.app.clone()).await;
        let c = HttpClient::new(&fg.url());
        let a = h.acquire("orders", "A", 5000).await;
        let key = format!("/dav/orders/{mode:?}");
        let r = c
            .send(Req::new("PUT", &key).held(&a).body("over tls"))
            .await;
        assert!(r.status.is_success(), "{mode:?}: {}", r.text());
        assert_eq!(
            std::fs::read_to_string(nginx.root.join(&key[1..])).unwrap(),
            "over tls"
        );
        fg.stop().await;
    }

    // The real binary without the CA: refused, and the log says why.
    let log = dir.path().join("fencegate.log");
    let mut args = serve_args(&dir.path().join("data"), true);
    args.extend(["--upstream".to_owned(), nginx.url.clone()]);
    let p = Proc::start(&args, &log, &[]);
    let c = HttpClient::new(&p.url);
    let a = support::held_from(
        &c.send(
            Req::new("POST", "/_fence/leases/orders")
                .json(serde_json::json!({"holder": "A", "ttl_ms": 5000})),
        )
        .await,
    );
    let r = c
        .send(Req::new("PUT", "/kv/orders/untrusted").held(&a).body("x"))
        .await;
    assert_eq!(
        (r.status.as_u16(), r.reason().as_str()),
        (502, "upstream-error"),
        "{}",
        r.text()
    );
    assert!(!nginx.root.join("kv/orders/untrusted").exists());
    let text = p.log_text();
    assert!(
        text.contains("upstream request failed") && text.contains("certificate"),
        "{text}"
    );
}
