//! Storage-side preconditions (SPEC §10), in process: fencegate in front of
//! the embedded store (whose entity tags change on every write and which
//! evaluates `If-Match` and `If-None-Match`), through a backend that can
//! hold a write, answer fencegate as a lost connection would, and deliver
//! the write to the store later, as a storage that applies a write after
//! fencegate stopped waiting does.
//!
//! Each late-write scenario runs with the route's preconditions on (the
//! storage refuses the stale write, the newer term's bytes stay) and off
//! (the stale write lands: the scenario shows the bug it guards against).

mod support;

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::Bytes;
use fencegate::app;
use fencegate::backend::{EmbeddedStore, Exchange, Sent};
use fencegate::body::{self, Body};
use fencegate::clock::{Clock, ClockKind};
use fencegate::config::{Config, RouteConfig};
use fencegate::journal::MemoryJournal;
use fencegate::lease::LeaseStore;
use fencegate::route::Preconditions;
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use support::{Harness, Held, Req, Resp};
use tower::{Service, ServiceExt};

/// A write the backend took and has not delivered yet.
type HeldWrite = Request<Bytes>;

/// The embedded store behind a switch: while `hold` is on, the next write
/// is kept (answered like a connection lost after the request was sent)
/// and the switch goes off. Every request that reaches it is recorded.
#[derive(Clone, Default)]
struct Holding {
    store: EmbeddedStore,
    hold: Arc<AtomicBool>,
    held: Arc<Mutex<Vec<HeldWrite>>>,
    seen: Arc<Mutex<Vec<(String, http::HeaderMap)>>>,
}

impl Holding {
    /// Delivers the held writes to the store, late: their statuses.
    async fn deliver(&self) -> Vec<StatusCode> {
        let held: Vec<HeldWrite> = std::mem::take(&mut *self.held.lock().unwrap());
        let mut statuses = Vec::new();
        for req in held {
            let req = req.map(body::full);
            let res = self.store.clone().oneshot(req).await.unwrap();
            statuses.push(res.status());
        }
        statuses
    }

    /// The requests that reached the backend, as `METHOD path`, with their
    /// headers.
    fn seen(&self) -> Vec<(String, http::HeaderMap)> {
        self.seen.lock().unwrap().clone()
    }
}

impl Holding {
    /// What the storage does with `req`: its answer, or `None` if it took
    /// the write and holds it.
    async fn take(self, req: Request<Body>) -> Option<Response<Body>> {
        let line = format!("{} {}", req.method(), req.uri());
        self.seen
            .lock()
            .unwrap()
            .push((line, req.headers().clone()));
        let write = fencegate::fence::is_write(req.method());
        if write && self.hold.swap(false, std::sync::atomic::Ordering::SeqCst) {
            let (parts, b) = req.into_parts();
            let bytes = b.collect().await.unwrap().to_bytes();
            self.held
                .lock()
                .unwrap()
                .push(Request::from_parts(parts, bytes));
            return None;
        }
        Some(self.store.clone().call(req).await.unwrap())
    }
}

/// What the upstream client answers when the connection is lost after the
/// request went out.
fn lost() -> Response<Body> {
    fencegate::error::Problem::upstream_error().into_response()
}

impl Service<Request<Body>> for Holding {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let this = self.clone();
        Box::pin(async move { Ok(this.take(req).await.unwrap_or_else(lost)) })
    }
}

/// Admitted writes go in two steps with nothing before sending; a held
/// write's outcome is unknown, as a lost connection's.
impl Exchange for Holding {
    type Staged = Request<Body>;

    fn stage(
        &mut self,
        req: Request<Body>,
    ) -> impl Future<Output = Result<Request<Body>, Response<Body>>> + Send + 'static {
        std::future::ready(Ok(req))
    }

    fn send(
        &mut self,
        req: Request<Body>,
    ) -> impl Future<Output = Sent<Request<Body>>> + Send + 'static {
        let this = self.clone();
        async move {
            match this.take(req).await {
                Some(res) => Sent::Answered(res),
                None => Sent::Unknown(lost()),
            }
        }
    }

    fn restage(
        &mut self,
        req: Request<Body>,
    ) -> impl Future<Output = Result<Request<Body>, Response<Body>>> + Send + 'static {
        std::future::ready(Ok(req))
    }
}

fn config(preconditions: Preconditions) -> Config {
    let mut c = Config {
        clock: ClockKind::Manual,
        ..Config::default()
    };
    c.fence.routes = vec![RouteConfig {
        kind: Default::default(),
        pattern: "/kv/{lease}".into(),
        lease: None,
        fence_reads: false,
        timeout_ms: None,
        upstream_prefix: None,
        preconditions,
        partition_key: None,
        token_attribute: None,
    }];
    c
}

fn harness(preconditions: Preconditions) -> (Harness<fencegate::fence::Fence<Holding>>, Holding) {
    let config = config(preconditions);
    config.validate().unwrap();
    let clock = Clock::new(config.clock);
    let journal = Arc::new(MemoryJournal::default());
    let leases = LeaseStore::new(clock.clone(), config.lease_limits(), journal.clone());
    let backend = Holding::default();
    let app = app::build_exchange(
        &config,
        leases.clone(),
        Arc::new(AtomicBool::new(false)),
        backend.clone(),
    )
    .unwrap();
    let h = Harness {
        app,
        clock,
        store: backend.store.clone(),
        leases,
        journal,
    };
    (h, backend)
}

const KEY: &str = "/kv/orders/42";

fn put(held: &Held, body: &str) -> Req {
    Req::new("PUT", KEY).held(held).body(body.to_owned())
}

/// A's write is held by the storage past its term and past the settle
/// time; B, the next holder, writes; A's write arrives then. What the key
/// holds at the end, and the late write's status.
async fn late_write(preconditions: Preconditions, late: &str) -> (Option<Bytes>, StatusCode) {
    let (h, backend) = harness(preconditions);
    let a = h.acquire("orders", "A", 1_000).await;
    if preconditions == Preconditions::Etag {
        // Nothing known of the key yet: a write is refused until it is read.
        let r = h.send(put(&a, "a-0")).await;
        assert_eq!(
            (r.status.as_u16(), r.reason().as_str()),
            (428, "precondition-required")
        );
        assert!(
            backend.seen().is_empty(),
            "the 428'd write reached the storage"
        );
        assert_eq!(h.send(Req::new("HEAD", KEY)).await.status, 404);
    }
    let r = h.send(put(&a, "a-1")).await;
    assert!(r.status.is_success(), "{r:?}");
    backend
        .hold
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let stale = match late {
        "PUT" => put(&a, "a-2-late"),
        _ => Req::new("DELETE", KEY).held(&a),
    };
    let r = h.send(stale).await;
    assert_eq!(r.status, 502, "the held write: {}", r.text());
    // A's term ends; its unknown write settles (on fencegate's clock); B
    // takes over and writes.
    h.advance(1_000 + 1_000);
    let b = h.acquire("orders", "B", 1_000).await;
    let mut r = h.send(put(&b, "b-1")).await;
    if r.status == StatusCode::PRECONDITION_REQUIRED {
        // The unknown outcome made fencegate forget the key: B reads it once.
        assert_eq!(h.send(Req::new("GET", KEY)).await.status, 200);
        r = h.send(put(&b, "b-1")).await;
    }
    assert!(r.status.is_success(), "B's write: {r:?}");
    // The storage applies A's write now, long after fencegate gave up on it.
    let statuses = backend.deliver().await;
    assert_eq!(statuses.len(), 1);
    (h.store.get(KEY), statuses[0])
}

#[tokio::test]
async fn a_late_put_of_an_old_term_is_refused_by_the_storage() {
    let (kept, status) = late_write(Preconditions::Etag, "PUT").await;
    assert_eq!(status, 412);
    assert_eq!(
        kept.as_deref(),
        Some(&b"b-1"[..]),
        "B's bytes were replaced"
    );
}

#[tokio::test]
async fn without_preconditions_the_late_put_lands() {
    let (kept, status) = late_write(Preconditions::Off, "PUT").await;
    assert!(status.is_success());
    assert_eq!(kept.as_deref(), Some(&b"a-2-late"[..]));
}

#[tokio::test]
async fn a_late_delete_of_an_old_term_is_refused_by_the_storage() {
    let (kept, status) = late_write(Preconditions::Etag, "DELETE").await;
    assert_eq!(status, 412);
    assert_eq!(kept.as_deref(), Some(&b"b-1"[..]), "B's object was deleted");
}

#[tokio::test]
async fn without_preconditions_the_late_delete_lands() {
    let (kept, status) = late_write(Preconditions::Off, "DELETE").await;
    assert!(status.is_success());
    assert_eq!(kept, None);
}

/// Every write that reaches the storage on a precondition route carries
/// one; the states come from the storage's own answers.
#[tokio::test]
async fn every_write_reaches_the_storage_with_a_precondition() {
    let (h, backend) = harness(Preconditions::Etag);
    let a = h.acquire("orders", "A", 60_000).await;
    let r = h.send(Req::new("GET", KEY)).await;
    assert_eq!(r.status, 404);
    let r = h.send(put(&a, "1")).await;
    assert_eq!(r.status, 201);
    let first = r.headers["etag"].clone();
    let r = h.send(put(&a, "2")).await;
    assert_eq!(r.status, 204);
    let second = r.headers["etag"].clone();
    assert_ne!(first, second);
    let r = h.send(Req::new("DELETE", KEY).held(&a)).await;
    assert_eq!(r.status, 204);
    let r = h.send(put(&a, "3")).await;
    assert_eq!(r.status, 201);
    let writes: Vec<_> = backend
        .seen()
        .into_iter()
        .filter(|(line, _)| !line.starts_with("GET") && !line.starts_with("HEAD"))
        .collect();
    let preconditions: Vec<_> = writes
        .iter()
        .map(|(line, headers)| {
            let p = ["if-match", "if-none-match"].iter().find_map(|n| {
                headers
                    .get(*n)
                    .map(|v| format!("{n}: {}", v.to_str().unwrap()))
            });
            (line.clone(), p.expect("a write without a precondition"))
        })
        .collect();
    assert_eq!(
        preconditions,
        vec![
            (format!("PUT {KEY}"), "if-none-match: *".to_owned()),
            (
                format!("PUT {KEY}"),
                format!("if-match: {}", first.to_str().unwrap())
            ),
            (
                format!("DELETE {KEY}"),
                format!("if-match: {}", second.to_str().unwrap())
            ),
            (format!("PUT {KEY}"), "if-none-match: *".to_owned()),
        ]
    );
    // fencegate's own headers never reach the storage.
    assert!(writes
        .iter()
        .all(|(_, h)| !h.contains_key("fencing-lease-id")));
}

/// A refused precondition is relayed as the storage answered it, and the
/// key's state is forgotten: the next write needs a read first.
#[tokio::test]
async fn a_refused_precondition_is_relayed_and_forgotten() {
    let (h, _backend) = harness(Preconditions::Etag);
    let a = h.acquire("orders", "A", 60_000).await;
    assert_eq!(h.send(Req::new("GET", KEY)).await.status, 404);
    assert_eq!(h.send(put(&a, "1")).await.status, 201);
    // Someone writes the key behind fencegate's back.
    h.store.put(KEY, "elsewhere");
    let r = h.send(put(&a, "2")).await;
    assert_eq!(r.status, 412);
    assert_eq!(
        r.headers["content-type"], "text/plain",
        "not the storage's answer"
    );
    assert_eq!(h.store.get(KEY).as_deref(), Some(&b"elsewhere"[..]));
    let r = h.send(put(&a, "2")).await;
    assert_eq!(r.reason(), "precondition-required");
    let read = h.send(Req::new("HEAD", KEY)).await;
    assert_eq!(read.status, 200);
    let r = h.send(put(&a, "2")).await;
    assert_eq!(r.status, 204);
    assert_eq!(h.store.get(KEY).as_deref(), Some(&b"2"[..]));
}

/// A write with its own precondition goes as it is, whatever fencegate
/// knows; on an S3 route, writes S3 never evaluates a precondition on go
/// as they are.
#[tokio::test]
async fn own_preconditions_and_staging_writes_pass_unchanged() {
    let (h, backend) = harness(Preconditions::S3);
    let a = h.acquire("orders", "A", 60_000).await;
    let r = h.send(put(&a, "mine").header("if-none-match", "*")).await;
    assert_eq!(r.status, 201);
    let r = h.send(put(&a, "again").header("if-none-match", "*")).await;
    assert_eq!(r.status, 412, "the client's own precondition was not sent");
    for (method, query) in [
        ("POST", "uploads"),
        ("PUT", "partNumber=1&uploadId=u"),
        ("DELETE", "uploadId=u"),
        ("PUT", "tagging"),
    ] {
        let path = format!("{KEY}?{query}");
        let _ = h.send(Req::new(method, &path).held(&a)).await;
        let (line, headers) = backend.seen().pop().unwrap();
        assert_eq!(line, format!("{method} {path}"));
        assert!(
            !headers.contains_key("if-match") && !headers.contains_key("if-none-match"),
            "{line} got a precondition"
        );
    }
}

/// COPY and MOVE also write their Destination, which no precondition
/// covers: refused on a precondition route, before the storage sees them.
#[tokio::test]
async fn copy_and_move_are_refused_on_precondition_routes() {
    let (h, backend) = harness(Preconditions::Etag);
    let a = h.acquire("orders", "A", 60_000).await;
    let r = h
        .send(
            Req::new("MOVE", KEY)
                .held(&a)
                .header("destination", "/kv/orders/43"),
        )
        .await;
    assert_eq!(r.reason(), "invalid-request");
    assert!(backend.seen().is_empty());
}

/// A request signed with Azure's Shared Key covers If-Match: fencegate may
/// not add one, and says which to send.
#[tokio::test]
async fn a_shared_key_signature_gets_the_precondition_to_send() {
    let (h, backend) = harness(Preconditions::Etag);
    let a = h.acquire("orders", "A", 60_000).await;
    let r = h.send(Req::new("GET", KEY)).await;
    assert_eq!(r.status, 404);
    let signed = || put(&a, "x").header("authorization", "SharedKey acct:c2lnbmF0dXJl");
    let r = h.send(signed()).await;
    assert_eq!(r.reason(), "precondition-required");
    assert_eq!(r.json()["if_none_match"], "*");
    assert_eq!(r.json()["lease"], "orders");
    assert!(backend.seen().iter().all(|(l, _)| l.starts_with("GET")));
    let r = h.send(signed().header("if-none-match", "*")).await;
    assert_eq!(r.status, 201);
    let tag = r.headers["etag"].to_str().unwrap().to_owned();
    let r = h.send(signed()).await;
    assert_eq!(r.json()["if_match"], tag.as_str());
}

/// A lease check comes first: a stale writer hears that its token is stale,
/// not that it lacks a precondition.
#[tokio::test]
async fn lease_checks_come_before_the_precondition() {
    let (h, _backend) = harness(Preconditions::Etag);
    let a = h.acquire("orders", "A", 1_000).await;
    h.advance(1_000);
    let _b = h.acquire("orders", "B", 1_000).await;
    let r = h.send(put(&a, "zombie")).await;
    assert_eq!(r.reason(), "stale-fencing-token");
    let r: Resp = h.send(Req::new("PUT", KEY).body("x")).await;
    assert_eq!(r.reason(), "missing-fencing-token");
}

/// `LeaseGuard::write` (the Rust client) on a route with preconditions:
/// a 428 makes it read the key once and send the write again; once the
/// term is lost it sends nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rust_client_reads_once_on_428_and_never_writes_when_lost() {
    let (h, backend) = harness(Preconditions::Etag);
    let server = support::spawn(h.app.clone()).await;
    let client = fencegate::client::LeaseClient::new(&server.url());
    // A short TTL: its renewals (every 100 ms of real time) find the term
    // ended soon after the manual clock passes its deadline.
    let guard = client
        .hold("orders", "w", 300, 0, Default::default())
        .await
        .unwrap();
    let w = guard
        .write(http::Method::PUT, KEY, &[], Bytes::from_static(b"v1"))
        .await
        .unwrap();
    assert_eq!(w.status, 201, "{w:?}");
    let lines: Vec<String> = backend.seen().into_iter().map(|(l, _)| l).collect();
    assert_eq!(lines, [format!("HEAD {KEY}"), format!("PUT {KEY}")]);
    let w = guard
        .write(http::Method::PUT, KEY, &[], Bytes::from_static(b"v2"))
        .await
        .unwrap();
    assert_eq!(w.status, 204);
    assert_eq!(h.store.get(KEY).as_deref(), Some(&b"v2"[..]));

    h.advance(300);
    // Real time, bounded: the renewer's next round is 100 ms away.
    tokio::time::timeout(std::time::Duration::from_secs(30), guard.lost())
        .await
        .expect("the guard never saw its term end");
    let sent_before = backend.seen().len();
    let err = guard
        .write(http::Method::PUT, KEY, &[], Bytes::from_static(b"late"))
        .await
        .unwrap_err();
    assert!(
        matches!(err, fencegate::client::ClientError::Lost(_)),
        "{err}"
    );
    assert_eq!(
        backend.seen().len(),
        sent_before,
        "a lost term's write was sent"
    );
    assert_eq!(h.store.get(KEY).as_deref(), Some(&b"v2"[..]));
}

/// On a route whose storage fencegate knows nothing of (`etag`), no write
/// is sorted aside: S3's staging writes get a precondition too. And a
/// `Connection` header naming `If-Match` cannot take the precondition off
/// on the way (seen failing: the storage got none).
#[tokio::test]
async fn any_storage_gets_a_precondition_on_every_write_and_keeps_it() {
    let (h, backend) = harness(Preconditions::Etag);
    let a = h.acquire("orders", "A", 60_000).await;
    let r = h.send(Req::new("GET", KEY)).await;
    assert_eq!(r.status, 404);
    let r = h.send(put(&a, "first")).await;
    assert_eq!(r.status, 201, "{}", r.text());
    for (method, query) in [("PUT", "partNumber=1&uploadId=u"), ("PUT", "tagging")] {
        let path = format!("{KEY}?{query}");
        let _ = h.send(Req::new(method, &path).held(&a).body("x")).await;
        let (line, headers) = backend.seen().pop().unwrap();
        assert_eq!(line, format!("{method} {path}"));
        assert!(
            headers.contains_key("if-match"),
            "{line} got no precondition"
        );
        // Its answer is not the key's state: forgotten.
        let r = h.send(put(&a, "again")).await;
        assert_eq!(r.reason(), "precondition-required", "{line}");
        let r = h.send(Req::new("GET", KEY)).await;
        assert_eq!(r.status, 200);
    }
    let r = h
        .send(put(&a, "kept").header("connection", "keep-alive, if-match"))
        .await;
    assert!(r.status.is_success(), "{}", r.text());
    let (_, headers) = backend.seen().pop().unwrap();
    assert!(headers.contains_key("if-match"), "Connection took it off");
}
