//! fencegate in front of an HTTP backend over real loopback sockets: what is
//! forwarded, what is stripped, and the 502/504 problems when the backend
//! fails.

mod support;

use std::sync::{Arc, Mutex};

use fencegate::app::App;
use fencegate::backend::{Backend, ConnectionMode, EmbeddedStore, Upstream};
use fencegate::body;
use fencegate::clock::ClockKind;
use fencegate::config::Config;
use http::{HeaderMap, Request, Response};
use support::{spawn, Harness, HttpClient, Req};

fn proxy_to(url: &str, timeout_ms: u64) -> Harness {
    proxy_with(url, timeout_ms, |_| {})
}

fn proxy_with(url: &str, timeout_ms: u64, tweak: impl FnOnce(&mut Config)) -> Harness {
    let mut config = Config {
        clock: ClockKind::Manual,
        upstream: url.to_owned(),
        ..Config::default()
    };
    tweak(&mut config);
    config.proxy.timeout_ms = timeout_ms;
    config.proxy.connect_timeout_ms = timeout_ms;
    let upstream = Upstream::new(&url.parse().unwrap(), &config.upstream_options()).unwrap();
    Harness::with_backend(config, Backend::Upstream(upstream), EmbeddedStore::new())
}

#[tokio::test]
async fn fenced_writes_reach_a_standalone_backend_and_stale_ones_do_not() {
    // The standalone backend, as `fencegate backend` serves it.
    let storage = EmbeddedStore::new();
    let backend = spawn(App::new(
        None,
        storage.clone(),
        fencegate::app::RequestLimits::from_config(&Config::default()),
    ))
    .await;
    let h = proxy_to(&backend.url(), 5_000);
    let proxy = spawn(h.app.clone()).await;
    let c = HttpClient::new(&proxy.url());

    let a = h.acquire("orders", "A", 1000).await;
    let r = c
        .send(Req::new("PUT", "/kv/orders/1").held(&a).body("a"))
        .await;
    assert_eq!(r.status, 201);
    assert_eq!(storage.get("/kv/orders/1").unwrap(), "a");
    let r = c.send(Req::new("GET", "/kv/orders/1")).await;
    assert_eq!((r.status.as_u16(), r.text().as_str()), (200, "a"));

    h.advance(1000);
    let b = h.acquire("orders", "B", 1000).await;
    let r = c
        .send(Req::new("PUT", "/kv/orders/1").held(&a).body("stale"))
        .await;
    assert_eq!(
        (r.status.as_u16(), r.reason().as_str()),
        (412, "stale-fencing-token")
    );
    assert_eq!(
        storage.get("/kv/orders/1").unwrap(),
        "a",
        "the stale write reached the backend"
    );
    // The same stale write sent straight to the backend lands: that is what
    // the proxy prevents.
    let direct = HttpClient::new(&backend.url());
    let r = direct
        .send(Req::new("PUT", "/kv/orders/1").held(&a).body("stale"))
        .await;
    assert!(r.status.is_success());
    assert_eq!(storage.get("/kv/orders/1").unwrap(), "stale");

    let r = c
        .send(Req::new("PUT", "/kv/orders/1").held(&b).body("b"))
        .await;
    assert_eq!(r.status, 204);
    // The backend's own errors pass through unchanged.
    let r = c.send(Req::new("GET", "/kv/orders/missing")).await;
    assert_eq!(r.status, 404);
    proxy.stop().await;
    backend.stop().await;
}

/// A backend that records the headers it receives and answers 200.
async fn recording_backend() -> (support::Running, Arc<Mutex<Vec<HeaderMap>>>) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let record = seen.clone();
    let svc = tower::service_fn(move |req: Request<hyper::body::Incoming>| {
        record.lock().unwrap().push(req.headers().clone());
        async move {
            let mut res = Response::new(body::full("ok"));
            res.headers_mut()
                .insert("connection", "x-upstream-hop".parse().unwrap());
            res.headers_mut()
                .insert("x-upstream-hop", "1".parse().unwrap());
            res.headers_mut().insert("x-kept", "1".parse().unwrap());
            Ok::<_, std::convert::Infallible>(res)
        }
    });
    (spawn(svc).await, seen)
}

#[tokio::test]
async fn lease_id_and_hop_by_hop_headers_are_stripped_and_the_token_travels() {
    let (backend, seen) = recording_backend().await;
    let h = proxy_to(&backend.url(), 5_000);
    let proxy = spawn(h.app.clone()).await;
    let c = HttpClient::new(&proxy.url());
    let a = h.acquire("orders", "A", 1000).await;

    let r = c
        .send(
            Req::new("PUT", "/kv/orders/1?v=2")
                .held(&a)
                .header("connection", "x-hop")
                .header("x-hop", "secret")
                .header("x-request-id", "req-42")
                .header("x-custom", "kept")
                .body("a"),
        )
        .await;
    assert_eq!(r.status, 200);
    assert_eq!(r.headers["x-request-id"], "req-42");
    assert_eq!(r.headers["x-kept"], "1");
    assert!(
        !r.headers.contains_key("x-upstream-hop"),
        "response hop-by-hop header forwarded"
    );
    // A client cannot make fencegate strip what it sets or relies on by
    // naming it in Connection (seen failing: the token was removed).
    let r = c
        .send(
            Req::new("PUT", "/kv/orders/2")
                .held(&a)
                .header("connection", "fencing-token, x-request-id, x-forwarded-for")
                .header("x-request-id", "req-43")
                .header("x-forwarded-for", "192.0.2.9")
                .body("b"),
        )
        .await;
    assert_eq!(r.status, 200);
    // A read that carries a lease id does not leak it either.
    c.send(Req::new("GET", "/kv/orders/1").held(&a)).await;

    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 3);
    let put2 = &seen[1];
    assert_eq!(put2["fencing-token"], "1");
    assert_eq!(put2["x-request-id"], "req-43");
    assert_eq!(put2["x-forwarded-for"], "192.0.2.9, 127.0.0.1");
    for headers in seen.iter() {
        assert!(
            !headers.contains_key("fencing-lease-id"),
            "lease id forwarded: {headers:?}"
        );
        for (_, v) in headers {
            assert!(!v
                .as_bytes()
                .windows(a.lease_id.len())
                .any(|w| w == a.lease_id.as_bytes()));
        }
    }
    let put = &seen[0];
    assert_eq!(put["fencing-token"], "1");
    assert_eq!(put["x-request-id"], "req-42");
    assert_eq!(put["x-custom"], "kept");
    assert!(!put.contains_key("x-hop"));
    assert_eq!(put["host"], backend.addr.to_string());
    assert_eq!(put["x-forwarded-for"], "127.0.0.1");
    assert_eq!(put["x-forwarded-proto"], "http");
    assert_eq!(put["x-forwarded-host"], proxy.addr.to_string());
    assert!(!put.contains_key("forwarded"));
    proxy.stop().await;
    backend.stop().await;
}

/// Seen failing before: `Fencing-Token: 0001` was admitted as token 1 and
/// reached the backend as `0001`, which a backend comparing tokens as text
/// misorders. The backend gets the number in its one form.
#[tokio::test]
async fn the_token_reaches_the_backend_in_its_canonical_form() {
    let (backend, seen) = recording_backend().await;
    let h = proxy_to(&backend.url(), 5_000);
    let proxy = spawn(h.app.clone()).await;
    let c = HttpClient::new(&proxy.url());
    let a = h.acquire("orders", "A", 1000).await;
    for sent in ["0001", "01", "1"] {
        let r = c
            .send(
                Req::new("PUT", "/kv/orders/1")
                    .header("fencing-token", sent)
                    .header("fencing-lease-id", &a.lease_id)
                    .body("a"),
            )
            .await;
        assert_eq!(r.status, 200, "{sent}: {}", r.text());
    }
    let seen = seen.lock().unwrap().clone();
    let tokens: Vec<&str> = seen
        .iter()
        .map(|h| h["fencing-token"].to_str().unwrap())
        .collect();
    assert_eq!(tokens, ["1", "1", "1"]);
    proxy.stop().await;
    backend.stop().await;
}

#[tokio::test]
async fn host_and_forwarding_headers_are_configurable() {
    let (backend, seen) = recording_backend().await;
    let h = proxy_with(&backend.url(), 5_000, |c| {
        c.proxy.preserve_host = true;
        c.proxy.x_forwarded = false;
        c.proxy.forwarded = true;
    });
    let proxy = spawn(h.app.clone()).await;
    let c = HttpClient::new(&proxy.url());
    c.send(Req::new("GET", "/kv/orders/1").header("x-forwarded-for", "10.9.8.7"))
        .await;
    let seen = seen.lock().unwrap().clone();
    let get = &seen[0];
    assert_eq!(
        get["host"],
        proxy.addr.to_string(),
        "the client's Host is kept"
    );
    assert_eq!(
        get["x-forwarded-for"], "10.9.8.7",
        "passed on untouched when off"
    );
    assert_eq!(
        get["forwarded"],
        format!("for=127.0.0.1;proto=http;host=\"{}\"", proxy.addr)
    );
    proxy.stop().await;
    backend.stop().await;
}

#[tokio::test]
async fn a_backend_that_resets_connections_is_502_and_the_proxy_keeps_serving() {
    let resetting = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", resetting.local_addr().unwrap());
    let acceptor = tokio::spawn(async move {
        while let Ok((sock, _)) = resetting.accept().await {
            // SO_LINGER 0: close with a RST instead of a FIN (a zero linger
            // does not block on drop).
            #[allow(deprecated)]
            let _ = sock.set_linger(Some(std::time::Duration::ZERO));
            drop(sock);
        }
    });
    let h = proxy_to(&url, 5_000);
    let proxy = spawn(h.app.clone()).await;
    let c = HttpClient::new(&proxy.url());
    let a = h.acquire("orders", "A", 60_000).await;
    for _ in 0..3 {
        let r = c
            .send(Req::new("PUT", "/kv/orders/1").held(&a).body("x"))
            .await;
        assert_eq!(
            (r.status.as_u16(), r.reason().as_str()),
            (502, "upstream-error")
        );
    }
    // The proxy itself is fine: the lease API answers on the same listener.
    let r = c.send(Req::new("GET", "/_fence/leases/orders")).await;
    assert_eq!(r.status, 200);
    let r = c
        .send(Req::new("POST", "/_fence/leases/orders/renew").held(&a))
        .await;
    assert_eq!(r.status, 200);
    acceptor.abort();
    proxy.stop().await;
}

/// An upstream that stopped answering: each 502 says what failed, and
/// after `proxy.unready_after_failures` failures in a row readiness turns
/// 502 too, so a load balancer moves on, until a probe request gets an answer again
/// (seen failing: a bare "the backend failed to answer", readiness 200
/// all along).
#[tokio::test]
async fn readiness_follows_an_upstream_that_fails_in_a_row() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = closed.local_addr().unwrap();
    drop(closed);
    let h = proxy_with(&format!("http://{addr}"), 5_000, |c| {
        c.proxy.unready_after_failures = 2;
    });
    let a = h.acquire("orders", "A", 60_000).await;
    let ready = || h.send(Req::new("GET", "/_fence/readyz"));
    for n in 0..2 {
        assert_eq!(ready().await.status, 200, "after {n} failures");
        let r = h
            .send(Req::new("PUT", "/kv/orders/1").held(&a).body("x"))
            .await;
        assert_eq!(
            (r.status.as_u16(), r.json()["detail"].as_str()),
            (
                502,
                Some("the backend failed to answer: connection refused")
            )
        );
    }
    let r = ready().await;
    assert_eq!(
        (r.status.as_u16(), r.reason().as_str()),
        (502, "upstream-error"),
        "{}",
        r.text()
    );
    assert!(
        r.text()
            .contains("the last 2 requests to the backend got no answer (connection refused)"),
        "{}",
        r.text()
    );
    assert!(!r.text().contains(&addr.to_string()), "{}", r.text());
    // A process that takes connections and answers nothing is not ready
    // either: the probe is a request, not a connect (seen failing when it
    // was a connect).
    let closer = tokio::net::TcpListener::bind(addr).await.unwrap();
    let closing = tokio::spawn(async move {
        while let Ok((sock, _)) = closer.accept().await {
            drop(sock);
        }
    });
    let r = ready().await;
    assert_eq!(r.status, 502, "{}", r.text());
    assert!(
        r.text().contains("neither did a HEAD request"),
        "{}",
        r.text()
    );
    closing.abort();
    let _ = closing.await;
    // The backend is back: the next readiness check gets an answer, and is 200.
    let back = App::new(
        None,
        EmbeddedStore::new(),
        fencegate::app::RequestLimits::from_config(&Config::default()),
    );
    let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
    let serving = support::spawn_on(listener, back);
    assert_eq!(ready().await.status, 200);
    let r = h
        .send(Req::new("PUT", "/kv/orders/1").held(&a).body("x"))
        .await;
    assert_eq!(r.status, 201);
    serving.stop().await;
}

#[tokio::test]
async fn a_backend_that_is_down_is_502_and_a_silent_one_is_504() {
    // A port nothing listens on.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let down_url = format!("http://{}", closed.local_addr().unwrap());
    drop(closed);
    let h = proxy_to(&down_url, 5_000);
    let a = h.acquire("orders", "A", 60_000).await;
    let r = h
        .send(Req::new("PUT", "/kv/orders/1").held(&a).body("x"))
        .await;
    assert_eq!(
        (r.status.as_u16(), r.reason().as_str()),
        (502, "upstream-error")
    );
    let r = h.send(Req::new("GET", "/kv/orders/1")).await;
    assert_eq!(
        (r.status.as_u16(), r.reason().as_str()),
        (502, "upstream-error")
    );
    // The lease API keeps working while the backend is down.
    assert_eq!(
        h.send(Req::new("GET", "/_fence/leases/orders"))
            .await
            .status,
        200
    );

    // A backend that accepts connections and never answers (upstream timeout,
    // not a lease deadline: real time is fine here).
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent_url = format!("http://{}", silent.local_addr().unwrap());
    let holder = tokio::spawn(async move {
        let mut open = Vec::new();
        while let Ok((sock, _)) = silent.accept().await {
            open.push(sock);
        }
    });
    let h = proxy_to(&silent_url, 200);
    let a = h.acquire("orders", "A", 60_000).await;
    let r = h
        .send(Req::new("PUT", "/kv/orders/1").held(&a).body("x"))
        .await;
    assert_eq!(
        (r.status.as_u16(), r.reason().as_str()),
        (504, "upstream-timeout")
    );
    holder.abort();
}

/// A backend answering 204 to everything, counting the connections it
/// accepted; with `keep_alive` off it closes each after one response.
async fn counting_backend(keep_alive: bool) -> (String, Arc<std::sync::atomic::AtomicUsize>) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let accepted = Arc::new(AtomicUsize::new(0));
    let count = accepted.clone();
    tokio::spawn(async move {
        while let Ok((sock, _)) = listener.accept().await {
            count.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                let service = hyper::service::service_fn(|_req| async {
                    let mut res = Response::new(body::empty());
                    *res.status_mut() = http::StatusCode::NO_CONTENT;
                    Ok::<_, std::convert::Infallible>(res)
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .keep_alive(keep_alive)
                    .serve_connection(hyper_util::rt::TokioIo::new(sock), service)
                    .await;
            });
        }
    });
    (url, accepted)
}

/// Sends `n` fenced PUTs on `c`, one after another; each must get 204.
async fn put_each(c: &HttpClient, a: &support::Held, n: usize) {
    for i in 0..n {
        let r = c
            .send(
                Req::new("PUT", &format!("/kv/orders/{i}"))
                    .held(a)
                    .body("x"),
            )
            .await;
        assert_eq!(r.status, 204, "request {i}: {}", r.text());
    }
}

#[tokio::test]
async fn each_client_connection_gets_one_upstream_connection_of_its_own() {
    use std::sync::atomic::Ordering;
    let (url, accepted) = counting_backend(true).await;
    let h = proxy_to(&url, 5_000);
    let proxy = spawn(h.app.clone()).await;
    let a = h.acquire("orders", "A", 60_000).await;
    let clients = [HttpClient::new(&proxy.url()), HttpClient::new(&proxy.url())];
    for _ in 0..2 {
        for c in &clients {
            put_each(c, &a, 5).await;
        }
    }
    assert_eq!(
        accepted.load(Ordering::SeqCst),
        2,
        "one per client connection"
    );

    // Pooled, the same load may share connections: never more than two.
    let (url, accepted) = counting_backend(true).await;
    let h = proxy_with(&url, 5_000, |c| {
        c.proxy.upstream_connections = fencegate::backend::ConnectionMode::Pooled;
    });
    let proxy = spawn(h.app.clone()).await;
    let a = h.acquire("orders", "A", 60_000).await;
    put_each(&HttpClient::new(&proxy.url()), &a, 10).await;
    assert_eq!(accepted.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_dedicated_connection_the_upstream_closed_is_replaced_transparently() {
    use std::sync::atomic::Ordering;
    // Every response closes its connection: each request needs a new one,
    // and none may fail because the old one is gone.
    let (url, accepted) = counting_backend(false).await;
    let h = proxy_to(&url, 5_000);
    let proxy = spawn(h.app.clone()).await;
    let a = h.acquire("orders", "A", 60_000).await;
    put_each(&HttpClient::new(&proxy.url()), &a, 20).await;
    assert_eq!(accepted.load(Ordering::SeqCst), 20);
}

#[tokio::test]
async fn a_timed_out_dedicated_connection_is_never_reused() {
    // Accepts, counts, never answers.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", silent.local_addr().unwrap());
    let accepted = Arc::new(Mutex::new(Vec::new()));
    let held = accepted.clone();
    let holder = tokio::spawn(async move {
        while let Ok((sock, _)) = silent.accept().await {
            held.lock().unwrap().push(sock);
        }
    });
    let h = proxy_to(&url, 200);
    let proxy = spawn(h.app.clone()).await;
    let a = h.acquire("orders", "A", 60_000).await;
    let c = HttpClient::new(&proxy.url());
    for expected_connections in 1..=2 {
        let r = c
            .send(Req::new("PUT", "/kv/orders/1").held(&a).body("x"))
            .await;
        assert_eq!(
            (r.status.as_u16(), r.reason().as_str()),
            (504, "upstream-timeout")
        );
        // Each try needed a fresh upstream connection: the first one may
        // still deliver the first request, so it must never carry another.
        assert_eq!(accepted.lock().unwrap().len(), expected_connections);
    }
    holder.abort();
    proxy.stop().await;
}

#[tokio::test]
async fn a_kept_connection_gets_a_fresh_deadline_for_each_exchange() {
    use std::sync::atomic::Ordering;
    // The connection keeps one timer for every exchange on it (see
    // `backend::h1::Timed`): the second exchange, well after the first's
    // deadline passed, must get its own. Real time: the upstream timeout
    // runs on tokio's clock over real sockets. 1 s for an answer from a
    // loopback backend is a wide margin on a loaded machine; the 1.5 s
    // pause is within the 4 s a connection may sit idle and be reused.
    let (url, accepted) = counting_backend(true).await;
    let h = proxy_to(&url, 1_000);
    let proxy = spawn(h.app.clone()).await;
    let a = h.acquire("orders", "A", 60_000).await;
    let c = HttpClient::new(&proxy.url());
    put_each(&c, &a, 1).await;
    tokio::time::sleep(std::time::Duration::from_millis(1_500)).await;
    put_each(&c, &a, 2).await;
    assert_eq!(
        accepted.load(Ordering::SeqCst),
        1,
        "the connection was kept"
    );
    proxy.stop().await;
}

/// A client that stops sending its body halfway meets the upstream
/// deadline on its dedicated connection (504), not the longer body read
/// timeout: the wait for the client's next piece is under the deadline
/// too. Seen failing with that wait outside it (the test's 30 s ran out).
/// Real time (the deadline is tokio's, over real sockets): 300 ms against
/// a body read timeout of 60 s and a read timeout of 30 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_body_that_stalls_meets_the_upstream_deadline() {
    let (url, _accepted) = counting_backend(true).await;
    let h = proxy_with(&url, 300, |c| c.limits.body_read_timeout_ms = 60_000);
    let proxy = spawn(h.app.clone()).await;
    let a = h.acquire("orders", "A", 60_000).await;
    let addr = proxy.addr;
    let head = tokio::task::spawn_blocking(move || {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.write_all(put_head("/kv/orders/1", &a, 100).as_bytes())
            .unwrap();
        s.write_all(b"hello").unwrap();
        s.set_read_timeout(Some(std::time::Duration::from_secs(30)))
            .unwrap();
        let mut buf = Vec::new();
        let mut b = [0u8; 4096];
        while whole_message(&buf).is_none() {
            let n = s.read(&mut b).expect("an answer within 30 s");
            assert!(n > 0, "closed without an answer");
            buf.extend_from_slice(&b[..n]);
        }
        whole_message(&buf).unwrap().0
    })
    .await
    .unwrap();
    assert!(head.starts_with("http/1.1 504"), "{head}");
    proxy.stop().await;
}

/// An answer whose body takes longer than the upstream timeout is relayed
/// whole: the deadline ends with the answer's head (the body comes at the
/// storage's pace, as the client reads it). Seen failing with the
/// deadline left armed after the head (the body was cut off). Real time:
/// a 1 s timeout, the body's second half 2.5 s after its first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_body_may_take_longer_than_the_upstream_deadline() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        while let Ok((mut sock, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut b = [0u8; 4096];
                while whole_message(&buf).is_none() {
                    match sock.read(&mut b).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&b[..n]),
                    }
                }
                let head = b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nhello";
                let _ = sock.write_all(head).await;
                tokio::time::sleep(std::time::Duration::from_millis(2_500)).await;
                let _ = sock.write_all(b"world").await;
                tokio::time::sleep(std::time::Duration::from_secs(5)).await;
            });
        }
    });
    let h = proxy_to(&url, 1_000);
    let proxy = spawn(h.app.clone()).await;
    let a = h.acquire("orders", "A", 60_000).await;
    let r = HttpClient::new(&proxy.url())
        .send(Req::new("PUT", "/kv/orders/1").held(&a).body("x"))
        .await;
    assert_eq!(
        (r.status.as_u16(), r.text()),
        (200, "helloworld".to_owned())
    );
    proxy.stop().await;
}

/// An upstream that never answers and records every byte of each connection
/// once fencegate closes it.
async fn recorder() -> (String, Arc<Mutex<Vec<Vec<u8>>>>) {
    use tokio::io::AsyncReadExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let closed = Arc::new(Mutex::new(Vec::new()));
    let record = closed.clone();
    tokio::spawn(async move {
        while let Ok((mut sock, _)) = listener.accept().await {
            let record = record.clone();
            tokio::spawn(async move {
                let mut bytes = Vec::new();
                let _ = sock.read_to_end(&mut bytes).await;
                record.lock().unwrap().push(bytes);
            });
        }
    });
    (url, closed)
}

/// Bad chunking (or a body that breaks off) after part of a body was
/// streamed: the client gets 400, and the backend never gets a complete
/// request: a head and the valid part of the body, no last chunk, then the
/// connection closes. Seen failing before: the answer was 502
/// upstream-error, as if the backend had failed.
#[tokio::test]
async fn a_body_that_breaks_off_reaches_the_backend_only_as_an_incomplete_request() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (url, closed) = recorder().await;
    let h = proxy_to(&url, 10_000);
    let proxy = spawn(h.app.clone()).await;
    let a = h.acquire("orders", "A", 60_000).await;
    let head = |framing: &str| {
        format!(
            "PUT /kv/orders/1 HTTP/1.1\r\nHost: a\r\nFencing-Token: {}\r\nFencing-Lease-Id: {}\r\n{framing}\r\n",
            a.token, a.lease_id
        )
    };
    let cases = [
        format!(
            "{}5\r\nhello\r\nzz\r\nmore\r\n0\r\n\r\n",
            head("Transfer-Encoding: chunked\r\n")
        ),
        format!(
            "{}5\r\nhello\r\n5\nworld\r\n0\r\n\r\n",
            head("Transfer-Encoding: chunked\r\n")
        ),
        format!(
            "{}5\r\nhello\r\n0\r\nbroken trailer\n\r\n\r\n",
            head("Transfer-Encoding: chunked\r\n")
        ),
    ];
    for (i, request) in cases.iter().enumerate() {
        let mut s = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
        s.write_all(request.as_bytes()).await.unwrap();
        let mut answer = Vec::new();
        tokio::time::timeout(
            std::time::Duration::from_secs(10),
            s.read_to_end(&mut answer),
        )
        .await
        .expect("an answer, then the close")
        .unwrap();
        let answer = String::from_utf8_lossy(&answer);
        assert!(answer.starts_with("HTTP/1.1 400 "), "case {i}: {answer}");
        assert!(
            answer.contains("\"reason\":\"invalid-request\""),
            "case {i}: {answer}"
        );
        // The backend's connection was closed; what it got is incomplete.
        let got = loop {
            if let Some(bytes) = closed.lock().unwrap().get(i).cloned() {
                break bytes;
            }
            tokio::task::yield_now().await;
        };
        let got = String::from_utf8_lossy(&got);
        assert!(
            got.starts_with("PUT /kv/orders/1 HTTP/1.1\r\n"),
            "case {i}: {got:?}"
        );
        assert!(
            !got.ends_with("0\r\n\r\n"),
            "case {i}: the backend got a last chunk: {got:?}"
        );
        assert!(
            !got.contains("zz") && !got.contains("world"),
            "case {i}: {got:?}"
        );
    }
    proxy.stop().await;
}

/// A write admitted while its term is live, whose upstream connection
/// takes long to open (here: the upstream's accept queue is full, so the
/// kernel drops the SYN and the client tries again after a second), is
/// checked again right before its first byte leaves: the term ended
/// meanwhile, so it is refused and the storage receives nothing. (Real
/// time: the kernel's SYN retry; the margins are wide.)
///
/// Seen failing before the check before sending: the write reached the
/// storage after its term had ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_term_that_ends_while_the_upstream_connects_sends_nothing() {
    use std::io::Read;
    use std::os::fd::AsRawFd;
    use std::time::Duration;

    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    // SAFETY: listen(2) on a socket this test owns; it only changes the
    // queue of connections not yet accepted, here to one.
    #[allow(unsafe_code)]
    unsafe {
        assert_eq!(libc::listen(listener.as_raw_fd(), 0), 0);
    }
    let addr = listener.local_addr().unwrap();
    // Fill the queue: the next connection's SYN is dropped for now.
    let filler = std::net::TcpStream::connect(addr).unwrap();
    let h = proxy_to(&format!("http://{addr}"), 10_000);
    let proxy = spawn(h.app.clone()).await;
    let c = HttpClient::new(&proxy.url());
    let a = h.acquire("orders", "A", 1000).await;
    let write = tokio::spawn({
        let c = c.clone();
        let held = a.clone();
        async move {
            c.send(Req::new("PUT", "/kv/orders/1").held(&held).body("late"))
                .await
        }
    });
    // Admitted, and waiting for its connection: the term ends.
    tokio::time::sleep(Duration::from_millis(300)).await;
    h.advance(1000);
    // Make room: the retried SYN gets through.
    let (first, _) = listener.accept().unwrap();
    drop((first, filler));
    let r = tokio::time::timeout(Duration::from_secs(10), write)
        .await
        .expect("the write came back")
        .unwrap();
    assert_eq!(
        (r.status.as_u16(), r.reason().as_str()),
        (412, "lease-expired"),
        "{}",
        r.text()
    );
    // The connection fencegate opened received not a byte.
    listener.set_nonblocking(false).unwrap();
    let (mut conn, _) = listener.accept().unwrap();
    conn.set_read_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    let mut buf = [0u8; 64];
    let got = conn.read(&mut buf).unwrap_or(0);
    assert_eq!(
        got,
        0,
        "bytes reached the storage: {:?}",
        String::from_utf8_lossy(&buf[..got])
    );
    // Counted as refused, not as forwarded.
    let metrics = h.send(Req::new("GET", "/_fence/metrics")).await.text();
    for line in [
        "fencegate_writes_forwarded_total 0",
        "fencegate_writes_rejected_total{reason=\"lease-expired\"} 1",
    ] {
        assert!(metrics.contains(line), "{line} not in\n{metrics}");
    }
    proxy.stop().await;
}

/// What the lease store still counts (in flight, settling ms) of a fenced
/// PUT sent in `mode` through a proxy whose storage refuses connections.
async fn counted_after_a_refused_connection(mode: ConnectionMode) -> (u64, u64) {
    // A port nothing listens on: the connection is refused.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = closed.local_addr().unwrap();
    drop(closed);
    let h = proxy_with(&format!("http://{addr}"), 10_000, |c| {
        c.proxy.upstream_connections = mode;
    });
    let proxy = spawn(h.app.clone()).await;
    let c = HttpClient::new(&proxy.url());
    let a = h.acquire("orders", "A", 1000).await;
    let r = c
        .send(Req::new("PUT", "/kv/orders/1").held(&a).body("x"))
        .await;
    assert_eq!(r.status.as_u16(), 502, "{}", r.text());
    let counted = (h.leases.inflight_count(), h.leases.settling_left_ms());
    proxy.stop().await;
    counted
}

/// A write whose connection to the storage is refused was never sent: it
/// holds back no later term, as nothing of it can reach the storage late.
/// Seen failing before the fence took it from the exchange's first step
/// (the write was counted as settling for `settle_ms`).
#[tokio::test]
async fn a_write_whose_connection_is_refused_holds_nothing_back() {
    let counted = counted_after_a_refused_connection(ConnectionMode::PerClient).await;
    assert_eq!(counted, (0, 0), "the refused write is still counted");
}

/// The same through the pool: the pool connects when the request is sent,
/// and a connect error says nothing was. Seen failing before `send` told
/// the fence so (the write was counted as settling).
#[tokio::test]
async fn a_pooled_write_whose_connection_is_refused_holds_nothing_back() {
    let counted = counted_after_a_refused_connection(ConnectionMode::Pooled).await;
    assert_eq!(counted, (0, 0), "the refused write is still counted");
}

/// A fenced PUT's head with a body of `len` bytes to follow.
fn put_head(path: &str, held: &support::Held, len: usize) -> String {
    format!(
        "PUT {path} HTTP/1.1\r\nhost: proxy\r\nfencing-token: {}\r\nfencing-lease-id: {}\r\ncontent-length: {len}\r\n\r\n",
        held.token, held.lease_id
    )
}

/// The first whole message in `buf`, once all of it is there: its head
/// (lowercased) and its length with its `Content-Length` body.
fn whole_message(buf: &[u8]) -> Option<(String, usize)> {
    let end = buf.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = String::from_utf8_lossy(&buf[..end]).to_lowercase();
    let body: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length: "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    (buf.len() >= end + 4 + body).then_some((head, end + 4 + body))
}

/// Reads one answer's head (and its `Content-Length` body) from `s`.
fn answer_head(s: &mut std::net::TcpStream) -> String {
    use std::io::Read;
    s.set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .unwrap();
    let mut buf = Vec::new();
    let mut b = [0u8; 4096];
    loop {
        if let Some((head, _)) = whole_message(&buf) {
            return head;
        }
        let n = s.read(&mut b).expect("read");
        assert!(n > 0, "client connection closed");
        buf.extend_from_slice(&b[..n]);
    }
}

/// How many connections the storage saw when a client connection's idle
/// upstream connection is older than `pool_idle_timeout_ms` at its third
/// write, the second write (`withdrawn`) having been withdrawn by the
/// check before sending: its term ended while its body was awaited.
async fn connections_after_an_idle_while(withdrawn: bool) -> usize {
    use std::io::Write;
    use std::time::Duration;
    let (url, accepted) = counting_backend(true).await;
    let h = proxy_with(&url, 5_000, |c| {
        c.proxy.pool_idle_timeout_ms = 300;
    });
    let proxy = spawn(h.app.clone()).await;
    let addr = proxy.addr;
    let a = h.acquire("orders", "A", 1000).await;
    let held = a.clone();
    let mut s = tokio::task::spawn_blocking(move || {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.write_all(format!("{}x", put_head("/kv/orders/1", &held, 1)).as_bytes())
            .unwrap();
        let first = answer_head(&mut s);
        assert!(first.starts_with("http/1.1 204"), "{first}");
        s
    })
    .await
    .unwrap();
    if withdrawn {
        s.write_all(put_head("/kv/orders/2", &a, 1).as_bytes())
            .unwrap();
        // Real time, for the head to be admitted and its body awaited; on
        // a loaded machine it may come later, and then the write is refused
        // at admission instead, which the count below tolerates too.
        tokio::time::sleep(Duration::from_millis(30)).await;
        h.advance(1000);
        s.write_all(b"x").unwrap();
        let (back, second) = tokio::task::spawn_blocking(move || {
            let second = answer_head(&mut s);
            (s, second)
        })
        .await
        .unwrap();
        s = back;
        assert!(second.starts_with("http/1.1 412"), "{second}");
    } else {
        h.advance(1000);
    }
    // Real time: the upstream connection's idle age is measured on it.
    // At least twice the limit, whatever the load.
    tokio::time::sleep(Duration::from_millis(700)).await;
    let b = h.acquire("orders", "B", 60_000).await;
    let third = tokio::task::spawn_blocking(move || {
        s.write_all(format!("{}x", put_head("/kv/orders/3", &b, 1)).as_bytes())
            .unwrap();
        answer_head(&mut s)
    })
    .await
    .unwrap();
    assert!(third.starts_with("http/1.1 204"), "{third}");
    accepted.load(std::sync::atomic::Ordering::SeqCst)
}

/// An idle upstream connection older than `pool_idle_timeout_ms` is not
/// reused, also after a withdrawn write put it back unused. Seen failing
/// before the connection kept its idle age when taken (3 connections'
/// worth of requests on 1).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_connection_past_its_age_is_not_reused_even_after_a_withdrawn_write() {
    assert_eq!(connections_after_an_idle_while(false).await, 2, "control");
    assert_eq!(
        connections_after_an_idle_while(true).await,
        2,
        "an idle connection older than pool_idle_timeout_ms was reused after a withdraw"
    );
}

/// A storage that answers each request with the `x-id` it carried, and,
/// after a request with `x-extra: MS`, sends one more answer nobody asked
/// for MS milliseconds later, in the same write as the answer for 0 (a
/// buggy storage: response queue poisoning).
async fn stray_answer_backend() -> String {
    // Threads of its own with blocking sockets, as a storage process of
    // its own would answer: not behind the test's tasks in tokio's queue.
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        while let Ok((mut sock, _)) = listener.accept() {
            // Nagle's algorithm on (the socket's default): a small write
            // waits for the last one's acknowledgement, so each answer
            // after a stray is held back until the next request carries
            // that acknowledgement: the connection stays one answer behind.
            std::thread::spawn(move || {
                let mut buf = Vec::new();
                loop {
                    let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
                        let mut chunk = [0u8; 4096];
                        match sock.read(&mut chunk) {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                        continue;
                    };
                    let head = String::from_utf8_lossy(&buf[..end]).to_lowercase();
                    buf.drain(..end + 4);
                    let header = |name: &str| {
                        head.lines()
                            .find_map(|l| l.strip_prefix(&format!("{name}: ")))
                            .map(str::to_owned)
                    };
                    let id = header("x-id").unwrap_or_default();
                    let answer = format!(
                        "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{id}",
                        id.len()
                    );
                    let stray = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nstray";
                    let extra = header("x-extra").and_then(|ms| ms.parse::<u64>().ok());
                    let mut out = answer.into_bytes();
                    if extra == Some(0) {
                        out.extend_from_slice(stray);
                    }
                    if sock.write_all(&out).is_err() {
                        return;
                    }
                    if let Some(ms) = extra.filter(|ms| *ms > 0) {
                        std::thread::sleep(std::time::Duration::from_millis(ms));
                        if sock.write_all(stray).is_err() {
                            return;
                        }
                    }
                }
            });
        }
    });
    url
}

/// A client whose connections come from `ip` (any 127/8 address is this
/// host's loopback).
fn client_from(
    ip: &str,
) -> hyper_util::client::legacy::Client<
    hyper_util::client::legacy::connect::HttpConnector,
    http_body_util::Full<bytes::Bytes>,
> {
    let mut connector = hyper_util::client::legacy::connect::HttpConnector::new();
    connector.set_local_address(Some(ip.parse().unwrap()));
    hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build(connector)
}

/// Reads of `/kv/x` with `id` through `client`: what came back.
async fn read_as(
    client: &hyper_util::client::legacy::Client<
        hyper_util::client::legacy::connect::HttpConnector,
        http_body_util::Full<bytes::Bytes>,
    >,
    url: &str,
    id: &str,
    extra: Option<u64>,
) -> String {
    use http_body_util::BodyExt;
    let mut req = Request::get(format!("{url}/kv/x")).header("x-id", id);
    if let Some(ms) = extra {
        req = req.header("x-extra", ms.to_string());
    }
    let req = req
        .body(http_body_util::Full::new(bytes::Bytes::new()))
        .unwrap();
    let res = client.request(req).await.unwrap();
    let body = res.into_body().collect().await.unwrap().to_bytes();
    String::from_utf8_lossy(&body).into_owned()
}

/// No answer reaches a client that did not ask for it, in either mode: a
/// storage's unsolicited answer on client A's upstream connection never
/// goes to client B (another address), whose requests run while it comes,
/// nor to A's own next request. Seen failing with the pooled mode's one
/// shared pool: B got "stray", and from then on every answer was the one
/// before its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_answer_reaches_a_client_that_did_not_ask_for_it() {
    use fencegate::backend::ConnectionMode;
    let storage = stray_answer_backend().await;
    for mode in [ConnectionMode::Pooled, ConnectionMode::PerClient] {
        let h = proxy_with(&storage, 5_000, |c| c.proxy.upstream_connections = mode);
        let proxy = spawn(h.app.clone()).await;
        let url = proxy.url();
        let (a, b) = (client_from("127.0.0.2"), client_from("127.0.0.3"));
        assert_eq!(read_as(&a, &url, "a0", Some(300)).await, "a0");
        let mut wrong = Vec::new();
        // B reads for 600 ms, across the stray answer's arrival at 300 ms.
        let started = fencegate::clock::Stopwatch::start();
        let mut n = 0;
        while started.elapsed_ms() < 600 {
            let id = format!("b{n}");
            let got = read_as(&b, &url, &id, None).await;
            if got != id {
                wrong.push((id, got));
            }
            n += 1;
        }
        for n in 1..20 {
            let id = format!("a{n}");
            let got = read_as(&a, &url, &id, None).await;
            if got != id {
                wrong.push((id, got));
            }
        }
        wrong.truncate(10);
        assert!(wrong.is_empty(), "{mode:?}: {wrong:?}");
    }
}

/// A storage that closes a keep-alive connection after `idle_ms` without a
/// request (nginx's `keepalive_timeout`, S3's about 20 s); it answers each
/// request 204.
async fn closes_idle_after(idle_ms: u64) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        while let Ok((mut sock, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = Vec::new();
                loop {
                    if let Some((_, len)) = whole_message(&buf) {
                        buf.drain(..len);
                        let answer = b"HTTP/1.1 204 No Content\r\n\r\n";
                        if sock.write_all(answer).await.is_err() {
                            return;
                        }
                        continue;
                    }
                    let mut chunk = [0u8; 4096];
                    let idle = std::time::Duration::from_millis(idle_ms);
                    match tokio::time::timeout(idle, sock.read(&mut chunk)).await {
                        Ok(Ok(n)) if n > 0 => buf.extend_from_slice(&chunk[..n]),
                        // Idle too long (or gone): closed, as such a storage does.
                        _ => return,
                    }
                }
            });
        }
    });
    url
}

/// A storage that closes idle connections is never sent a request on one
/// it is closing: fencegate reuses an idle upstream connection only for
/// `proxy.pool_idle_timeout_ms`, shorter than the storage's, so no write
/// gets a made-up 502 for a request the storage never saw (seen failing
/// with no idle limit: 502 "the exchange broke off" for 2 of the 40).
/// Real time: the storage's idle limit is its own (300 ms); the gaps
/// between requests (296 to 304 ms) meet it, so its close and a request
/// cross on the wire, and fencegate's limit (100 ms) is well below.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_storage_closing_idle_connections_never_races_a_request() {
    use fencegate::backend::ConnectionMode;
    let storage = closes_idle_after(300).await;
    for mode in [ConnectionMode::PerClient, ConnectionMode::Pooled] {
        let h = proxy_with(&storage, 5_000, |c| {
            c.proxy.upstream_connections = mode;
            c.proxy.pool_idle_timeout_ms = 100;
        });
        let proxy = spawn(h.app.clone()).await;
        let a = h.acquire("orders", "A", 600_000).await;
        let c = HttpClient::new(&proxy.url());
        let mut failed = Vec::new();
        for i in 0..40u64 {
            let r = c
                .send(
                    Req::new("PUT", &format!("/kv/orders/{i}"))
                        .held(&a)
                        .body("x"),
                )
                .await;
            if r.status != 204 {
                failed.push((i, r.status, r.text()));
            }
            tokio::time::sleep(std::time::Duration::from_millis(296 + i % 9)).await;
        }
        assert!(failed.is_empty(), "{mode:?}: {failed:?}");
    }
}

/// Clients behind one address (a load balancer's) share a pool, and no
/// client gets another one's answer after the storage sent one nobody
/// asked for: a pooled connection with anything after an answer, or
/// anything that arrived while it was idle (asked of the kernel itself),
/// is closed and never used again. A stray that lands while a request is
/// on its way is read as that request's answer (HTTP/1.1 cannot tell; nginx
/// reads it so too), and the answer it pushed back then shows before the
/// connection's next use: fencegate has the kernel acknowledge at once, so
/// a storage that holds small writes back (Nagle's algorithm, as this one
/// does) sends it. Seen failing with hyper's pool, and with this pool
/// before the acknowledgement: every later answer on that connection was
/// the one before its own (another client's), the stray's shift never
/// caught up. Real time: reads one after another for 400 ms after an
/// answer whose stray comes 50 ms later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_behind_one_address_never_get_each_others_answers() {
    use fencegate::backend::ConnectionMode;
    let storage = stray_answer_backend().await;
    let h = proxy_with(&storage, 5_000, |c| {
        c.proxy.upstream_connections = ConnectionMode::Pooled
    });
    let proxy = spawn(h.app.clone()).await;
    let url = proxy.url();
    // A stray in the same write as the answer, or while the connection is
    // idle: nobody gets it.
    let mut wrong = Vec::new();
    for (round, delay) in [(0, 0), (1, 50), (2, 0), (3, 50)] {
        let poisoned = client_from("127.0.0.4");
        let id = format!("p{round}");
        assert_eq!(read_as(&poisoned, &url, &id, Some(delay)).await, id);
        tokio::time::sleep(std::time::Duration::from_millis(150)).await;
        for n in 0..5 {
            let other = client_from("127.0.0.4");
            let id = format!("r{round}-{n}");
            let got = read_as(&other, &url, &id, None).await;
            if got != id {
                wrong.push((id, got));
            }
        }
    }
    assert!(wrong.is_empty(), "{wrong:?}");
    // A stray that lands while a request is on its way on the connection:
    // read as its answer (HTTP/1.1 cannot tell), and the answer left over
    // closes the connection at its next use, so no later client gets the
    // answer of the one before it.
    let (mut leaked, mut strays) = (Vec::new(), 0);
    for round in 0..5 {
        let poisoned = client_from("127.0.0.4");
        let id = format!("q{round}");
        assert_eq!(read_as(&poisoned, &url, &id, Some(50)).await, id);
        let started = fencegate::clock::Stopwatch::start();
        let mut n = 0;
        while started.elapsed_ms() < 400 {
            let other = client_from("127.0.0.4");
            let id = format!("s{round}-{n}");
            match read_as(&other, &url, &id, None).await {
                got if got == id => {}
                got if got == "stray" => strays += 1,
                got => leaked.push((id, got)),
            }
            n += 1;
        }
    }
    leaked.truncate(10);
    assert!(leaked.is_empty(), "another client's answer: {leaked:?}");
    assert!(
        strays <= 5,
        "{strays} strays read as answers, one a round at most"
    );
}

/// A storage answering 200 to every request, keeping connections open,
/// and counting those open now.
async fn live_connections_backend() -> (String, Arc<std::sync::atomic::AtomicUsize>) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let live = Arc::new(AtomicUsize::new(0));
    let count = live.clone();
    tokio::spawn(async move {
        while let Ok((sock, _)) = listener.accept().await {
            let count = count.clone();
            count.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                let service = hyper::service::service_fn(|_req| async {
                    Ok::<_, std::convert::Infallible>(Response::new(body::full("ok")))
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(sock), service)
                    .await;
                count.fetch_sub(1, Ordering::SeqCst);
            });
        }
    });
    (url, live)
}

/// Waits (real time, up to 20 s) until `what` holds; whether it did.
async fn eventually(what: impl Fn() -> bool) -> bool {
    for _ in 0..400 {
        if what() {
            return true;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    what()
}

/// The pooled mode keeps at most `pool_max_idle` idle upstream connections
/// however many clients it has, and closes them once idle for
/// `pool_idle_timeout_ms`. Seen failing with hyper's pools (one per client
/// address, no timer): 200 connections open after the burst, and still
/// open 20 s later. Real time: the idle limit is 400 ms, the waits up to
/// 20 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pooled_idle_connections_are_bounded_and_closed() {
    use fencegate::backend::ConnectionMode;
    use std::sync::atomic::Ordering;
    let (storage, live) = live_connections_backend().await;
    let h = proxy_with(&storage, 5_000, |c| {
        c.proxy.upstream_connections = ConnectionMode::Pooled;
        c.proxy.pool_idle_timeout_ms = 400;
        c.proxy.pool_max_idle = 16;
    });
    let proxy = spawn(h.app.clone()).await;
    let url = proxy.url();
    // 50 client addresses, four reads at once from each.
    let mut reads = tokio::task::JoinSet::new();
    for host in 1..=50 {
        let client = client_from(&format!("127.0.1.{host}"));
        for n in 0..4 {
            let (client, url) = (client.clone(), url.clone());
            reads.spawn(async move { read_as(&client, &url, &format!("{host}-{n}"), None).await });
        }
    }
    while let Some(got) = reads.join_next().await {
        assert_eq!(got.unwrap(), "ok");
    }
    assert!(
        eventually(|| live.load(Ordering::SeqCst) <= 16).await,
        "{} upstream connections open after the burst",
        live.load(Ordering::SeqCst)
    );
    assert!(
        eventually(|| live.load(Ordering::SeqCst) == 0).await,
        "{} upstream connections still open after their idle limit",
        live.load(Ordering::SeqCst)
    );
}

/// A storage that answers the first request on each connection and closes
/// the connection when the next one arrives, without answering it (as a
/// storage does whose idle close crosses a request on the wire); it counts
/// the requests it read.
async fn closes_on_the_second_request() -> (String, Arc<std::sync::atomic::AtomicUsize>) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let read = Arc::new(AtomicUsize::new(0));
    let count = read.clone();
    tokio::spawn(async move {
        while let Ok((mut sock, _)) = listener.accept().await {
            let count = count.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut answered = false;
                loop {
                    if let Some((head, len)) = whole_message(&buf) {
                        buf.drain(..len);
                        count.fetch_add(1, Ordering::SeqCst);
                        if answered {
                            return;
                        }
                        let answer: &[u8] = if head.starts_with("head ") {
                            b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n"
                        } else {
                            b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
                        };
                        if sock.write_all(answer).await.is_err() {
                            return;
                        }
                        answered = true;
                        continue;
                    }
                    let mut chunk = [0u8; 4096];
                    match sock.read(&mut chunk).await {
                        Ok(n) if n > 0 => buf.extend_from_slice(&chunk[..n]),
                        _ => return,
                    }
                }
            });
        }
    });
    (url, read)
}

/// A `GET` or `HEAD` with no body whose reused upstream connection fails
/// before any byte of the answer never reached the storage's application:
/// it goes once more on a fresh connection, in both modes, with the default
/// settings; a write in the same spot is not sent again (its outcome is
/// unknown: 502). Seen failing before: the GET got 502.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_that_meets_a_closing_connection_goes_again_and_a_write_does_not() {
    use fencegate::backend::ConnectionMode;
    use std::sync::atomic::Ordering;
    for mode in [ConnectionMode::PerClient, ConnectionMode::Pooled] {
        for method in ["GET", "HEAD", "PUT"] {
            let (storage, read) = closes_on_the_second_request().await;
            let h = proxy_with(&storage, 5_000, |c| c.proxy.upstream_connections = mode);
            let proxy = spawn(h.app.clone()).await;
            let c = HttpClient::new(&proxy.url());
            let a = h.acquire("orders", "A", 60_000).await;
            let send = || {
                let r = Req::new(method, "/kv/orders/1");
                match method {
                    "PUT" => c.send(r.held(&a).body("x")),
                    _ => c.send(r),
                }
            };
            assert_eq!(send().await.status, 200, "{mode:?} first {method}");
            let r = send().await;
            if method == "PUT" {
                // Its outcome is unknown: never sent again.
                assert_eq!(r.status, 502, "{mode:?} second PUT: {}", r.text());
                assert_eq!(
                    read.load(Ordering::SeqCst),
                    2,
                    "{mode:?}: the PUT went again"
                );
            } else {
                assert_eq!(r.status, 200, "{mode:?} second {method}: {}", r.text());
                // The second, read and dropped; then again on a new
                // connection.
                assert_eq!(read.load(Ordering::SeqCst), 3, "{mode:?} {method}");
            }
        }
    }
}
