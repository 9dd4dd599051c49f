//! Shared fixtures: an in-process fencegate on a manual clock, driven either
//! as a tower service (no sockets) or over real HTTP on a loopback port.

// Each test crate includes these fixtures and uses a part of them.
#![allow(dead_code, unreachable_pub)]

pub mod browser;
pub mod cluster;
pub mod dynamodb;
pub mod holding;
pub mod lazyfs;
pub mod proc;
pub mod servers;
pub mod tools;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use bytes::Bytes;
use fencegate::app::{self, App, Parts};
use fencegate::backend::{Backend, EmbeddedStore, Unstaged};
use fencegate::body::Body;
use fencegate::clock::{Clock, ClockKind};
use fencegate::config::Config;
use fencegate::fence::Fence;
use fencegate::journal::MemoryJournal;
use fencegate::lease::{LeaseStore, Primacy};
use fencegate::server::{self, ServerOptions};
use http::{HeaderMap, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tower::{Service, ServiceExt};

/// A response, read in full.
#[derive(Debug)]
pub struct Resp {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Resp {
    pub async fn read(
        res: Response<impl http_body::Body<Data = Bytes, Error = impl std::fmt::Debug>>,
    ) -> Self {
        let (parts, body) = res.into_parts();
        Self {
            status: parts.status,
            headers: parts.headers,
            body: body.collect().await.expect("body").to_bytes(),
        }
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", String::from_utf8_lossy(&self.body)))
    }

    /// The problem's `reason`, checking it is a problem document.
    pub fn reason(&self) -> String {
        assert_eq!(
            self.headers["content-type"], "application/problem+json",
            "not a problem: {self:?}"
        );
        let j = self.json();
        assert_eq!(j["status"], self.status.as_u16(), "status member: {j}");
        for member in ["type", "title", "detail"] {
            assert!(j[member].is_string(), "{member} missing: {j}");
        }
        j["reason"].as_str().expect("reason").to_owned()
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// What a client holds after acquiring.
#[derive(Clone, Debug)]
pub struct Held {
    pub token: u64,
    pub lease_id: String,
}

impl Held {
    pub fn headers(&self) -> Vec<(String, String)> {
        vec![
            ("fencing-token".into(), self.token.to_string()),
            ("fencing-lease-id".into(), self.lease_id.clone()),
        ]
    }
}

/// A request under construction.
pub struct Req {
    pub method: Method,
    pub path: String,
    pub headers: Vec<(String, String)>,
    pub body: Bytes,
}

impl Req {
    pub fn new(method: &str, path: &str) -> Self {
        Self {
            method: Method::from_bytes(method.as_bytes()).unwrap(),
            path: path.into(),
            headers: Vec::new(),
            body: Bytes::new(),
        }
    }

    pub fn header(mut self, k: &str, v: &str) -> Self {
        self.headers.push((k.into(), v.into()));
        self
    }

    pub fn held(mut self, held: &Held) -> Self {
        self.headers.extend(held.headers());
        self
    }

    pub fn body(mut self, body: impl Into<Bytes>) -> Self {
        self.body = body.into();
        self
    }

    pub fn json(self, v: serde_json::Value) -> Self {
        self.header("content-type", "application/json")
            .body(v.to_string())
    }

    pub fn build(self, base: &str) -> Request<Full<Bytes>> {
        let mut b = Request::builder()
            .method(self.method)
            .uri(format!("{base}{}", self.path));
        for (k, v) in &self.headers {
            b = b.header(k, v);
        }
        b.body(Full::new(self.body)).unwrap()
    }
}

/// fencegate in-process, on a manual clock, with the embedded store (or
/// another backend `S`). Clones share everything.
#[derive(Clone)]
pub struct Harness<S = Fence<Backend>> {
    pub app: App<S>,
    pub clock: Clock,
    pub store: EmbeddedStore,
    pub leases: LeaseStore,
    pub journal: Arc<MemoryJournal>,
}

impl Harness {
    pub fn new() -> Self {
        Self::with_config(Config {
            clock: ClockKind::Manual,
            ..Config::default()
        })
    }

    pub fn with_config(config: Config) -> Self {
        let store = EmbeddedStore::new().with_body_read_timeout(std::time::Duration::from_millis(
            config.limits.body_read_timeout_ms,
        ));
        Self::with_backend(config, Backend::Embedded(store.clone()), store)
    }

    pub fn with_backend(config: Config, backend: Backend, store: EmbeddedStore) -> Self {
        Self::build(config, backend, store, |_| None)
    }

    /// A harness whose app serves as a cluster member's primary, its
    /// primacy confirmed until `until_ms` on the harness's clock.
    pub fn primary(config: Config, until_ms: u64) -> (Self, Arc<Primacy>) {
        let store = EmbeddedStore::new();
        let mut primacy = None;
        let harness = Self::build(config, Backend::Embedded(store.clone()), store, |clock| {
            let p = Arc::new(Primacy::new(clock.clone(), until_ms, true));
            primacy = Some(p.clone());
            Some(p)
        });
        (harness, primacy.expect("made by build"))
    }

    fn build(
        config: Config,
        backend: Backend,
        store: EmbeddedStore,
        primacy: impl FnOnce(&Clock) -> Option<Arc<Primacy>>,
    ) -> Self {
        config.validate().unwrap();
        let clock = Clock::new(config.clock);
        let primacy = primacy(&clock);
        let journal = Arc::new(MemoryJournal::default());
        let leases = LeaseStore::new(clock.clone(), config.lease_limits(), journal.clone());
        let app = app::build(
            &config,
            Parts {
                leases: leases.clone(),
                backend,
                draining: Arc::new(AtomicBool::new(false)),
                primacy,
                metrics: None,
                key_states: None,
            },
        )
        .unwrap();
        Self {
            app,
            clock,
            store,
            leases,
            journal,
        }
    }
}

impl<S> Harness<S>
where
    S: Service<Request<Body>, Response = Response<Body>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    /// Sends `req` through the app as a tower service.
    pub async fn send(&self, req: Req) -> Resp {
        let res = self.app.clone().oneshot(req.build("")).await.unwrap();
        Resp::read(res).await
    }

    pub async fn acquire(&self, lease: &str, holder: &str, ttl_ms: u64) -> Held {
        let r = self
            .send(
                Req::new("POST", &format!("/_fence/leases/{lease}"))
                    .json(serde_json::json!({"holder": holder, "ttl_ms": ttl_ms})),
            )
            .await;
        assert_eq!(r.status, 201, "acquire: {}", r.text());
        held_from(&r)
    }

    pub fn advance(&self, ms: u64) {
        self.clock.advance(ms).expect("manual clock");
    }
}

pub fn held_from(r: &Resp) -> Held {
    let j = r.json();
    Held {
        token: j["token"].as_u64().unwrap(),
        lease_id: j["lease_id"].as_str().unwrap().to_owned(),
    }
}

/// A server on a loopback port, stopped when dropped.
pub struct Running {
    pub addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Running {
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops the server and waits for it to finish.
    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            task.await.unwrap();
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// The value of the unlabelled sample `name` in Prometheus text `metrics`.
pub fn metric<'a>(metrics: &'a str, name: &str) -> Option<&'a str> {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .map(str::trim)
}

/// Serves `app` on 127.0.0.1 at a free port.
pub async fn spawn<S>(app: S) -> Running
where
    S: Service<Request<hyper::body::Incoming>, Response = Response<Body>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    spawn_on(TcpListener::bind("127.0.0.1:0").await.unwrap(), app)
}

/// Serves `app` on `listener`.
pub fn spawn_on<S>(listener: TcpListener, app: S) -> Running
where
    S: Service<Request<hyper::body::Incoming>, Response = Response<Body>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = oneshot::channel();
    let options = ServerOptions {
        shutdown_grace_ms: 1_000,
        ..ServerOptions::default()
    };
    let task = tokio::spawn(async move {
        server::run(listener, app, options, async {
            let _ = rx.await;
        })
        .await
        .unwrap();
    });
    Running {
        addr,
        stop: Some(tx),
        task: Some(task),
    }
}

/// A plain HTTP/1.1 client.
#[derive(Clone)]
pub struct HttpClient {
    base: String,
    client: Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>,
}

impl HttpClient {
    pub fn new(base: &str) -> Self {
        Self {
            base: base.to_owned(),
            client: Client::builder(TokioExecutor::new()).build_http(),
        }
    }

    pub async fn send(&self, req: Req) -> Resp {
        self.try_send(req).await.unwrap()
    }

    /// Sends `req`; an error if the connection failed or broke, or if no
    /// answer came within 20 s (so a bug fails a test instead of hanging it).
    pub async fn try_send(&self, req: Req) -> Result<Resp, String> {
        let exchange = async {
            let res = self
                .client
                .request(req.build(&self.base))
                .await
                .map_err(|e| e.to_string())?;
            let (parts, body) = res.into_parts();
            let body = body.collect().await.map_err(|e| e.to_string())?.to_bytes();
            Ok(Resp {
                status: parts.status,
                headers: parts.headers,
                body,
            })
        };
        tokio::time::timeout(std::time::Duration::from_secs(20), exchange)
            .await
            .map_err(|_| "no answer within 20 s".to_owned())?
    }
}

/// A small seeded PRNG (SplitMix64) for reproducible randomized tests.
#[derive(Clone, Debug)]
pub struct SplitMix(u64);

impl SplitMix {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `range` (the tiny modulo bias does not matter here).
    pub fn range(&mut self, range: std::ops::Range<u64>) -> u64 {
        range.start + self.next_u64() % (range.end - range.start)
    }
}

/// What an instrumented backend saw.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// A write reached the backend.
    Arrive { token: u64, id: String },
    /// The backend applied it and answered.
    Finish { token: u64, id: String },
}

/// Counts the handover violations in a backend's event log: an older term's
/// write arriving or finishing after a newer term's write arrived.
pub fn handover_violations(events: &[Event]) -> usize {
    let mut newest_arrived = 0;
    let mut violations = 0;
    for e in events {
        match e {
            Event::Arrive { token, .. } => {
                if *token < newest_arrived {
                    violations += 1;
                }
                newest_arrived = newest_arrived.max(*token);
            }
            Event::Finish { token, .. } => {
                if *token < newest_arrived {
                    violations += 1;
                }
            }
        }
    }
    violations
}

/// An in-process backend that records arrivals and completions, and holds a
/// request marked `x-hold: 1` until the test opens its gate (`x-write-id`);
/// one marked `x-applies-anyway: 1` is applied even if its sender goes away.
#[derive(Clone, Default)]
pub struct HoldingBackend {
    state: Arc<std::sync::Mutex<HoldState>>,
    opened: Arc<tokio::sync::Notify>,
}

#[derive(Default)]
struct HoldState {
    events: Vec<Event>,
    open: std::collections::HashSet<String>,
}

impl HoldingBackend {
    pub fn events(&self) -> Vec<Event> {
        self.state.lock().unwrap().events.clone()
    }

    pub fn arrived(&self, id: &str) -> bool {
        self.events()
            .iter()
            .any(|e| matches!(e, Event::Arrive { id: i, .. } if i == id))
    }

    /// Lets the held request `id` (or a future one) finish.
    pub fn open(&self, id: &str) {
        self.state.lock().unwrap().open.insert(id.to_owned());
        self.opened.notify_waiters();
    }
}

impl Service<Request<Body>> for HoldingBackend {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Response<Body>, Infallible>> + Send>,
    >;

    fn poll_ready(
        &mut self,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Infallible>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let this = self.clone();
        let header = |k: &str| {
            req.headers()
                .get(k)
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_owned()
        };
        let token: u64 = header("fencing-token").parse().unwrap_or(0);
        let id = header("x-write-id");
        let hold = header("x-hold") == "1";
        // Storage that applies a write even when the client that sent it
        // has gone (the sender died while the write was in flight).
        let detached = header("x-applies-anyway") == "1";
        let work = async move {
            this.state.lock().unwrap().events.push(Event::Arrive {
                token,
                id: id.clone(),
            });
            if hold {
                loop {
                    let notified = this.opened.notified();
                    tokio::pin!(notified);
                    notified.as_mut().enable();
                    if this.state.lock().unwrap().open.contains(&id) {
                        break;
                    }
                    notified.await;
                }
            }
            this.state
                .lock()
                .unwrap()
                .events
                .push(Event::Finish { token, id });
        };
        Box::pin(async move {
            if detached {
                let _ = tokio::spawn(work).await;
            } else {
                work.await;
            }
            let mut res = Response::new(fencegate::body::empty());
            *res.status_mut() = StatusCode::NO_CONTENT;
            Ok(res)
        })
    }
}

impl Harness<Fence<Unstaged<HoldingBackend>>> {
    /// fencegate on the manual clock in front of a [`HoldingBackend`].
    pub fn holding(mut config: Config) -> (Self, HoldingBackend) {
        config.clock = ClockKind::Manual;
        let backend = HoldingBackend::default();
        let clock = Clock::new(config.clock);
        let journal = Arc::new(MemoryJournal::default());
        let leases = LeaseStore::new(clock.clone(), config.lease_limits(), journal.clone());
        let app = app::build_with(
            &config,
            leases.clone(),
            Arc::new(AtomicBool::new(false)),
            backend.clone(),
        )
        .unwrap();
        let h = Harness {
            app,
            clock,
            store: EmbeddedStore::new(),
            leases,
            journal,
        };
        (h, backend)
    }
}
