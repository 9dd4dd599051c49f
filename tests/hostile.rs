//! Hostile input over a raw socket: framing tricks, bad headers, oversized
//! heads and bodies, ambiguous paths. Each row has the status it must get, and
//! the storage behind the proxy must receive none of them.

mod support;

use std::time::Duration;

use support::{spawn, Harness};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Sends `request` as raw bytes and returns the status code of the answer.
async fn raw_status(addr: std::net::SocketAddr, request: &[u8]) -> u16 {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    // The server may answer and close before reading everything we send.
    let _ = s.write_all(request).await;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        match tokio::time::timeout(Duration::from_secs(5), s.read(&mut chunk)).await {
            Ok(Ok(0)) | Ok(Err(_)) => break,
            Ok(Ok(n)) => {
                buf.extend_from_slice(&chunk[..n]);
                if buf.windows(4).any(|w| w == b"\r\n\r\n") {
                    break;
                }
            }
            Err(_) => panic!(
                "no answer to {:?}",
                String::from_utf8_lossy(&request[..request.len().min(80)])
            ),
        }
    }
    let line = String::from_utf8_lossy(&buf);
    line.split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP answer: {line:?}"))
}

#[tokio::test]
async fn hostile_requests_are_refused_and_never_reach_the_storage() {
    let h = Harness::new();
    let held = h.acquire("o", "A", 600_000).await;
    let server = spawn(h.app.clone()).await;
    let auth = format!(
        "Fencing-Token: {}\r\nFencing-Lease-Id: {}\r\n",
        held.token, held.lease_id
    );
    let put = |extra: &str, body: &str| {
        format!("PUT /kv/o/x HTTP/1.1\r\nHost: a\r\n{auth}{extra}\r\n{body}")
    };
    let big = "a".repeat(20_000);
    let huge = "a".repeat(300_000);
    let many: String = (0..150).map(|i| format!("X-{i}: a\r\n")).collect();
    let rows: Vec<(&str, String, u16)> = vec![
        ("conflicting Content-Length", put("Content-Length: 2\r\nContent-Length: 3\r\n", "abc"), 400),
        ("Content-Length list", put("Content-Length: 2, 2\r\n", "ok"), 400),
        ("signed Content-Length", put("Content-Length: +2\r\n", "ok"), 400),
        ("negative Content-Length", put("Content-Length: -1\r\n", "ok"), 400),
        ("Content-Length with Transfer-Encoding", put("Content-Length: 3\r\nTransfer-Encoding: chunked\r\n", "3\r\nabc\r\n0\r\n\r\n"), 400),
        ("chunked twice", put("Transfer-Encoding: chunked, chunked\r\n", "2\r\nok\r\n0\r\n\r\n"), 400),
        ("chunked in two headers", put("Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n", "2\r\nok\r\n0\r\n\r\n"), 400),
        ("unknown transfer coding", put("Transfer-Encoding: gzip\r\n", "abc"), 400),
        ("bad chunk size", put("Transfer-Encoding: chunked\r\n", "zz\r\nabc\r\n0\r\n\r\n"), 400),
        ("chunked in HTTP/1.0", format!("PUT /kv/o/x HTTP/1.0\r\nHost: a\r\n{auth}Transfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n"), 400),
        ("NUL in a header", put("X-A: a\0b\r\nContent-Length: 2\r\n", "ok"), 400),
        ("obs-fold", put("X-A: a\r\n b\r\nContent-Length: 2\r\n", "ok"), 400),
        ("space in a header name", put("X A: b\r\nContent-Length: 2\r\n", "ok"), 400),
        ("oversized header", put(&format!("X-A: {big}\r\nContent-Length: 2\r\n"), "ok"), 431),
        ("head past the read buffer", put(&format!("X-A: {huge}\r\nContent-Length: 2\r\n"), "ok"), 431),
        ("too many headers", put(&format!("{many}Content-Length: 2\r\n"), "ok"), 431),
        ("declared body over the limit", put("Content-Length: 2000000\r\n", "aaaa"), 413),
        ("bad percent-encoding", format!("PUT /kv/o/%zz HTTP/1.1\r\nHost: a\r\n{auth}Content-Length: 2\r\n\r\nok"), 400),
        ("dot-dot segment", format!("PUT /kv/o/../o/x HTTP/1.1\r\nHost: a\r\n{auth}Content-Length: 2\r\n\r\nok"), 400),
        ("encoded dot-dot", format!("PUT /kv/o/%2e%2e/x HTTP/1.1\r\nHost: a\r\n{auth}Content-Length: 2\r\n\r\nok"), 400),
        ("encoded slash", format!("PUT /kv/o%2Fx HTTP/1.1\r\nHost: a\r\n{auth}Content-Length: 2\r\n\r\nok"), 400),
        ("invalid UTF-8 path", format!("PUT /kv/o/%ff HTTP/1.1\r\nHost: a\r\n{auth}Content-Length: 2\r\n\r\nok"), 400),
    ];
    // Paths some storage normalises onto another lease's keys (the path
    // model in route.rs; tests/tomcat.rs shows them landing there).
    let aliases = [
        "/kv/o/..;/p/x",
        "/kv/o/%2e%2e;/p/x",
        "/kv/o/..;x=1/p/x",
        "/kv/o/.%2E;/p/x",
        "/kv/o/..;/..;/outside/v5",
        "/kv/o/..%3B/p/x",
        "/kv/o/%252e%252e/p/x",
        "/kv/o/%u002e%u002e/p/x",
        "/kv/o/%c0%ae%c0%ae/p/x",
        "/kv/o/%EF%BC%8E%EF%BC%8E/p/x",
        "/kv/o/a%EF%BC%8Fb",
        "/kv/o./x",
        "/kv/o/x%20/y",
        "/kv/o/.../x",
    ];
    let rows: Vec<(&str, String, u16)> = rows
        .into_iter()
        .chain(aliases.iter().map(|path| {
            let req =
                format!("PUT {path} HTTP/1.1\r\nHost: a\r\n{auth}Content-Length: 2\r\n\r\nok");
            (*path, req, 400)
        }))
        .collect();
    let mut failures = Vec::new();
    for (name, request, want) in &rows {
        let got = raw_status(server.addr, request.as_bytes()).await;
        if got != *want {
            failures.push(format!("{name}: expected {want}, got {got}"));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
    assert!(h.store.is_empty(), "a hostile request reached the storage");

    // The harness can tell: the same connection setup with a valid request
    // does write.
    let ok = raw_status(server.addr, put("Content-Length: 2\r\n", "ok").as_bytes()).await;
    assert_eq!(ok, 201);
    assert_eq!(h.store.get("/kv/o/x").unwrap(), "ok");
    server.stop().await;
}

/// `server::run` on a free loopback port with the given header read
/// timeout, in front of a harness's app.
struct Timed {
    addr: std::net::SocketAddr,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl Timed {
    async fn start(header_read_timeout_ms: u64) -> (Harness, Self) {
        use fencegate::server::{self, ServerOptions};
        let h = Harness::new();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let options = ServerOptions {
            header_read_timeout_ms,
            ..ServerOptions::default()
        };
        let task = tokio::spawn(server::run(listener, h.app.clone(), options, async {
            let _ = stopped.await;
        }));
        (h, Self { addr, stop, task })
    }

    async fn stop(self) {
        let _ = self.stop.send(());
        self.task.await.unwrap().unwrap();
    }
}

/// Whether the server closes `s` within `limit` (reading, and dropping,
/// any answer it sends first: a 408, if any).
async fn closes_within(s: &mut tokio::net::TcpStream, limit: Duration) -> bool {
    let mut buf = [0u8; 256];
    let closed = tokio::time::timeout(limit, async {
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    });
    closed.await.is_ok()
}

/// A client that sends its request head too slowly (slow-loris) is cut off
/// at `limits.header_read_timeout_ms`. (Real time here is the server's own
/// timer, not a lease.)
#[tokio::test]
async fn a_slow_request_head_is_cut_off() {
    let (h, server) = Timed::start(300).await;
    let mut s = tokio::net::TcpStream::connect(server.addr).await.unwrap();
    s.write_all(b"PUT /kv/o/x HTTP/1.1\r\nHost: a\r\nX-Slow: ")
        .await
        .unwrap();
    // Ten times the configured timeout: without it the connection would stay
    // open for the default 10 s and this would fail.
    assert!(
        closes_within(&mut s, Duration::from_secs(3)).await,
        "the slow connection was not closed"
    );
    assert!(h.store.is_empty());
    server.stop().await;
}

/// The connection's header read timer is kept from one request to the
/// next (`rt::TimerSlot`) and moved to each head's own deadline: after a
/// request whose body took longer than the header timeout, the next head,
/// arriving in two parts, is read to its end (a stale deadline would cut it
/// off at its first part), and a slow head after it is cut off as the
/// first would be. Seen failing with the kept timer not moved. (Real time,
/// as above: the server's own timer. The second part follows the first by
/// 50 ms against a timeout of 1 s, a margin for a loaded machine; should
/// both parts arrive in one read, the test passes without proving the
/// point.)
#[tokio::test]
async fn the_header_timer_follows_each_head_on_a_kept_connection() {
    let (h, server) = Timed::start(1_000).await;
    let mut s = tokio::net::TcpStream::connect(server.addr).await.unwrap();
    s.write_all(b"POST /_fence/leases/o HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\n{")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(2_000)).await;
    s.write_all(b"}GET /_fence/readyz HTTP/1.1\r\n")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    s.write_all(b"Host: a\r\n\r\n").await.unwrap();
    // Both answers (the second a 200), the connection still open.
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while got.windows(9).filter(|w| w == b"HTTP/1.1 ").count() < 2
        || !got.ends_with(b"\r\n\r\n") && !got.ends_with(b"}")
    {
        let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut buf))
            .await
            .expect("both answers within 10 s")
            .unwrap();
        assert!(n > 0, "closed after: {:?}", String::from_utf8_lossy(&got));
        got.extend_from_slice(&buf[..n]);
    }
    let text = String::from_utf8_lossy(&got);
    let second = &text[text.rfind("HTTP/1.1 ").unwrap()..];
    assert!(second.starts_with("HTTP/1.1 200"), "{text}");
    s.write_all(b"PUT /kv/o/x HTTP/1.1\r\nHost: a\r\nX-Slow: ")
        .await
        .unwrap();
    // Ten times the configured timeout.
    assert!(
        closes_within(&mut s, Duration::from_secs(10)).await,
        "the slow connection was not closed"
    );
    assert!(h.store.is_empty());
    server.stop().await;
}

/// The status codes of every answer on one connection, until it closes.
async fn raw_statuses(addr: std::net::SocketAddr, requests: &[u8]) -> Vec<u16> {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let _ = s.write_all(requests).await;
    let mut buf = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut buf)).await;
    assert!(read.is_ok(), "the connection stayed open");
    String::from_utf8_lossy(&buf)
        .match_indices("HTTP/1.1 ")
        .filter_map(|(at, _)| buf.get(at + 9..at + 12))
        .filter_map(|code| std::str::from_utf8(code).ok()?.parse().ok())
        .collect()
}

/// Seen failing before the guard kept watching a connection after an
/// upgrade request (or an empty line before a request): the next request,
/// with a length beside a transfer coding, was forwarded and stored.
#[tokio::test]
async fn an_upgrade_or_an_empty_line_does_not_open_the_connection_to_smuggling() {
    let h = Harness::new();
    let held = h.acquire("o", "A", 600_000).await;
    let server = spawn(h.app.clone()).await;
    let smuggled = format!(
        "PUT /kv/o/x HTTP/1.1\r\nHost: a\r\nFencing-Token: {}\r\nFencing-Lease-Id: {}\r\n\
         Content-Length: 3\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
        held.token, held.lease_id
    );
    for (first, statuses) in [
        ("GET /kv/o/none HTTP/1.1\r\nHost: a\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\n", vec![404, 400]),
        ("GET /kv/o/none HTTP/1.1\r\nHost: a\r\nUpgrade: h2c\r\n\r\n", vec![404, 400]),
        ("\r\n", vec![400]),
    ] {
        let got = raw_statuses(server.addr, format!("{first}{smuggled}").as_bytes()).await;
        assert_eq!(got, statuses, "after {first:?}");
    }
    assert!(h.store.is_empty(), "a smuggled request reached the storage");
    server.stop().await;
}

/// Clients that announce a lease-API body and never send it hold their
/// connection slots only until `limits.body_read_timeout_ms`, then get 408
/// and are closed, so other clients get in. (Real time here is the server's
/// own timer, not a lease; the margins are wide.)
///
/// Seen failing before lease-API bodies had a deadline: with every slot
/// taken by such a client, the next client was never served.
#[tokio::test]
async fn a_lease_api_body_that_never_comes_frees_its_connection_slot() {
    use fencegate::server::{self, ServerOptions};
    let mut config = fencegate::config::Config {
        clock: fencegate::clock::ClockKind::Manual,
        ..fencegate::config::Config::default()
    };
    config.limits.body_read_timeout_ms = 300;
    let h = Harness::with_config(config);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let options = ServerOptions {
        max_connections: 2,
        ..ServerOptions::default()
    };
    let task = tokio::spawn(server::run(listener, h.app.clone(), options, async {
        let _ = stopped.await;
    }));
    let mut silent = Vec::new();
    for _ in 0..2 {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(b"POST /_fence/leases/x HTTP/1.1\r\nHost: a\r\nContent-Length: 100\r\n\r\n")
            .await
            .unwrap();
        silent.push(s);
    }
    // Every slot is taken; the next client is served once a body times out.
    let served = tokio::time::timeout(
        Duration::from_secs(10),
        raw_status(addr, b"GET /_fence/livez HTTP/1.1\r\nHost: a\r\n\r\n"),
    )
    .await
    .expect("no slot came free");
    assert_eq!(served, 200);
    for mut s in silent {
        let mut answer = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut answer))
            .await
            .expect("the silent client was not closed")
            .unwrap();
        let answer = String::from_utf8_lossy(&answer);
        assert!(answer.starts_with("HTTP/1.1 408 "), "{answer}");
        assert!(answer.contains("request-timeout"), "{answer}");
    }
    let _ = stop.send(());
    task.await.unwrap().unwrap();
}

/// A writer paused in the middle of its body (the embedded backend): its
/// write is answered `408` once `limits.body_read_timeout_ms` has passed,
/// so the next holder's first write goes through within that time, not
/// after the whole upstream deadline. (tokio's paused time: the body
/// deadline is a tokio timer, the lease clock manual.)
///
/// Seen failing before the embedded store read bodies under that deadline:
/// the stalled write stayed in flight for ever (the real binary answered B
/// 504 after 30 s; here, on the manual clock, B's write never came back).
#[tokio::test(start_paused = true)]
async fn a_writer_paused_mid_body_does_not_hold_the_next_term() {
    use bytes::Bytes;
    use fencegate::clock::Stopwatch;
    use tower::ServiceExt;

    let mut config = fencegate::config::Config {
        clock: fencegate::clock::ClockKind::Manual,
        ..fencegate::config::Config::default()
    };
    config.limits.body_read_timeout_ms = 2_000;
    let h = Harness::with_config(config);
    let a = h.acquire("o", "A", 1000).await;
    let (mut tx, body) = http_body_util::Channel::<Bytes, std::convert::Infallible>::new(1);
    let req = http::Request::builder()
        .method("PUT")
        .uri("/kv/o/x")
        .header("fencing-token", a.token.to_string())
        .header("fencing-lease-id", &a.lease_id)
        .header("content-length", "100")
        .body(body)
        .unwrap();
    // The answer is read as the server would send it.
    let app = h.app.clone();
    let stalled =
        tokio::spawn(async move { support::Resp::read(app.oneshot(req).await.unwrap()).await });
    tx.send_data(Bytes::from_static(b"hello world"))
        .await
        .unwrap();
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    assert!(!stalled.is_finished());
    h.advance(1000);
    let b = h.acquire("o", "B", 60_000).await;
    let watch = Stopwatch::start();
    let r = tokio::time::timeout(
        Duration::from_secs(600),
        h.send(support::Req::new("PUT", "/kv/o/x").held(&b).body("b")),
    )
    .await
    .expect("B's write never came back");
    assert_eq!(r.status, 201, "{}", r.text());
    assert!(
        watch.elapsed_ms() <= 2_000 + 1_000,
        "B waited {} ms",
        watch.elapsed_ms()
    );
    let a_res = stalled.await.unwrap();
    assert_eq!(
        (a_res.status.as_u16(), a_res.reason().as_str()),
        (408, "request-timeout")
    );
    assert_eq!(h.store.get("/kv/o/x").unwrap(), "b");
    drop(tx);
}

/// Clients that pipeline reads of a large value and never read the answers
/// hold their connection slots only until `limits.send_timeout_ms`, then
/// are closed, so other clients get in. (Real time here is the server's own
/// timer, not a lease; the margins are wide.)
///
/// Seen failing before the send timeout: with every slot taken by such a
/// client, the next client was never served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_that_stop_reading_free_their_connection_slots() {
    use fencegate::server::{self, ServerOptions};
    let mut config = fencegate::config::Config {
        clock: fencegate::clock::ClockKind::Manual,
        ..fencegate::config::Config::default()
    };
    config.limits.max_body_bytes = 4 * 1024 * 1024;
    let h = Harness::with_config(config);
    h.store.put("/kv/o/big", vec![b'x'; 2 * 1024 * 1024]);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let options = ServerOptions {
        max_connections: 2,
        send_timeout_ms: 300,
        ..ServerOptions::default()
    };
    let task = tokio::spawn(server::run(listener, h.app.clone(), options, async {
        let _ = stopped.await;
    }));
    // 32 MiB of answers each: far more than the sockets buffer.
    let gets = "GET /kv/o/big HTTP/1.1\r\nHost: a\r\n\r\n".repeat(16);
    let mut stalled = Vec::new();
    for _ in 0..2 {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(gets.as_bytes()).await.unwrap();
        stalled.push(s);
    }
    // A client served once a stalled one's slot came free keeps its
    // connection (and so the slot) open...
    let mut holder = tokio::time::timeout(Duration::from_secs(10), async {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /_fence/livez HTTP/1.1\r\nHost: a\r\n\r\n")
            .await
            .unwrap();
        let mut head = Vec::new();
        let mut chunk = [0u8; 1024];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = s.read(&mut chunk).await.unwrap();
            assert!(n > 0, "closed before answering");
            head.extend_from_slice(&chunk[..n]);
        }
        assert!(head.starts_with(b"HTTP/1.1 200"), "{head:?}");
        s
    })
    .await
    .expect("no slot came free");
    // ...so the next is served only once the other stalled client's slot
    // came free too: both are closed before either is read (reading one
    // whose send timeout had not yet run out would un-stall it).
    let served = tokio::time::timeout(
        Duration::from_secs(10),
        raw_status(addr, b"GET /_fence/livez HTTP/1.1\r\nHost: a\r\n\r\n"),
    )
    .await
    .expect("the second stalled client's slot never came free");
    assert_eq!(served, 200);
    drop(holder.shutdown().await);
    for mut s in stalled {
        // What was sent before the close, then the end of the stream.
        let mut sink = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut sink)).await;
        assert!(read.is_ok(), "the stalled reader was not closed");
        assert!(sink.len() < 32 * 1024 * 1024, "every answer was sent");
    }
    let _ = stop.send(());
    task.await.unwrap().unwrap();
}
