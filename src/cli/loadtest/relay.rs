//! A relay between fencegate and the storage that makes some writes arrive
//! late: `fencegate loadtest --late-writes`.
//!
//! fencegate is pointed at the relay (its upstream), the relay at the
//! storage. Most requests go through as they are. A write the relay holds
//! is read in full, then fencegate's connection is closed with no answer,
//! as a connection lost after the request went out: fencegate cannot know
//! whether the storage applied it, so it holds the lease's next term back
//! for `fence.settle_ms`, and the storage gets the write only later, after
//! that bound: as a storage that queues a request, or finishes a
//! multipart upload minutes after the client stopped waiting, does.
//!
//! The relay sees every write the storage answers, so it tells which late
//! writes of an old term the storage applied after a later term's write to
//! the same key ([`RelayReport::late_stale_applied`]) and which it refused.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use serde::Serialize;
use tokio::net::TcpListener;
use tokio::sync::Notify;

use super::store::Storage;
use crate::client::HttpsClient;
use crate::wire::FENCING_TOKEN;

/// What the relay does with a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hold {
    /// Forwards it and relays the answer.
    Pass,
    /// Closes fencegate's connection unanswered, and delivers the write to
    /// the storage after this long.
    Late(Duration),
    /// Closes fencegate's connection unanswered, and delivers the write
    /// when [`Relay::release`] is called.
    UntilReleased,
}

/// Decides, for each request (its head), what the relay does with it.
pub type HoldFn = Arc<dyn Fn(&http::request::Parts) -> Hold + Send + Sync>;

/// A late write the storage answered.
#[derive(Clone, Debug, Serialize)]
pub struct Delivered {
    pub method: String,
    pub path: String,
    pub token: Option<u64>,
    pub status: u16,
    /// A write of a term lower than one whose write to the same key the
    /// storage had applied before it.
    pub stale: bool,
}

/// What the relay saw.
#[derive(Clone, Debug, Default, Serialize)]
pub struct RelayReport {
    /// Writes that came through the relay.
    pub writes: u64,
    /// Of those, writes with neither `If-Match` nor `If-None-Match`: on a
    /// route with preconditions, none but the writes storages evaluate no
    /// precondition on (S3's parts and upload starts).
    pub writes_without_precondition: u64,
    /// Writes held and delivered late.
    pub late_writes: u64,
    /// Of those, writes of an old term: a later term had a write to the
    /// same key applied before it arrived.
    pub late_stale: u64,
    /// Late stale writes the storage applied: a later term's write was
    /// overwritten (or deleted) by an earlier term's.
    pub late_stale_applied: u64,
    /// Late stale writes the storage refused (412, or 409 for a conflict).
    pub late_stale_refused: u64,
    /// Late writes that could not be delivered (the storage unreachable).
    pub late_failed: u64,
    /// A few late stale writes the storage applied, for people.
    pub examples: Vec<Delivered>,
}

/// A held write, and the key it writes.
struct Pending {
    req: Request<Bytes>,
    key: String,
}

struct Shared {
    upstream: String,
    client: HttpsClient,
    hold: HoldFn,
    /// How the storage's requests and answers read.
    store: Storage,
    max_body_bytes: usize,
    /// Per key, the highest token of a write the storage applied (answered
    /// 2xx).
    applied: Mutex<HashMap<String, u64>>,
    released: Mutex<Vec<Pending>>,
    report: Mutex<RelayReport>,
    /// Late deliveries still to come.
    outstanding: AtomicU64,
    delivered: Notify,
    stopping: AtomicBool,
}

/// A running relay; it stops when dropped.
pub struct Relay {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: tokio::task::JoinHandle<()>,
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.shared.stopping.store(true, Ordering::Relaxed);
        self.accept.abort();
    }
}

impl Relay {
    /// Listens on `listen` and relays to `upstream` (a base URL) with
    /// `client`; `hold` says which requests arrive late. `Err`: it cannot
    /// listen there.
    pub async fn start(
        listen: SocketAddr,
        upstream: &str,
        client: HttpsClient,
        hold: HoldFn,
        store: Storage,
    ) -> std::io::Result<Self> {
        let listener = TcpListener::bind(listen).await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            upstream: upstream.trim_end_matches('/').to_owned(),
            client,
            hold,
            store,
            max_body_bytes: 64 << 20,
            applied: Mutex::default(),
            released: Mutex::default(),
            report: Mutex::default(),
            outstanding: AtomicU64::new(0),
            delivered: Notify::new(),
            stopping: AtomicBool::new(false),
        });
        let accept = tokio::spawn(accept_loop(listener, shared.clone()));
        Ok(Self {
            addr,
            shared,
            accept,
        })
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Delivers the writes held [`Hold::UntilReleased`] now, one after the
    /// other in the order they came: what the storage answered each.
    pub async fn release(&self) -> Vec<Delivered> {
        let held = std::mem::take(&mut *lock(&self.shared.released));
        let mut out = Vec::new();
        for pending in held {
            if let Some(d) = deliver(&self.shared, pending.req, pending.key).await {
                out.push(d);
            }
        }
        out
    }

    /// Waits until every write held [`Hold::Late`] has been delivered (at
    /// most `limit`), then says what the relay saw.
    pub async fn finish(&self, limit: Duration) -> RelayReport {
        let all_delivered = async {
            loop {
                let notified = self.shared.delivered.notified();
                if self.shared.outstanding.load(Ordering::SeqCst) == 0 {
                    return;
                }
                notified.await;
            }
        };
        let _ = tokio::time::timeout(limit, all_delivered).await;
        self.report()
    }

    /// What the relay saw so far.
    pub fn report(&self) -> RelayReport {
        lock(&self.shared.report).clone()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let shared = shared.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| relay(shared.clone(), req));
            // A held write ends its connection with an error: expected.
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

/// The relay's answer to fencegate: the storage's, or none at all (an
/// error closes the connection unanswered).
async fn relay(
    shared: Arc<Shared>,
    req: Request<Incoming>,
) -> Result<Response<http_body_util::combinators::BoxBody<Bytes, hyper::Error>>, HeldBack> {
    let (parts, body) = req.into_parts();
    let body = match Limited::new(body, shared.max_body_bytes).collect().await {
        Ok(b) => b.to_bytes(),
        Err(_) => {
            return Ok(plain(
                StatusCode::BAD_GATEWAY,
                "relay: the request body broke off",
            ))
        }
    };
    let if_header = parts.headers.contains_key(http::header::IF_MATCH)
        || parts.headers.contains_key(http::header::IF_NONE_MATCH);
    let amz_target = parts
        .headers
        .get("x-amz-target")
        .and_then(|v| v.to_str().ok());
    let written = shared.store.relayed_write(
        &parts.method,
        parts.uri.path(),
        amz_target,
        &body,
        if_header,
    );
    let hold = match &written {
        Some((_, compared)) => {
            let mut report = lock(&shared.report);
            report.writes += 1;
            if !compared {
                report.writes_without_precondition += 1;
            }
            drop(report);
            (shared.hold)(&parts)
        }
        None => Hold::Pass,
    };
    let req = Request::from_parts(parts, body);
    let key = match (hold, written) {
        (Hold::Pass, written) => return Ok(forward(&shared, req, written.map(|w| w.0)).await),
        (_, Some((key, _))) => key,
        (_, None) => unreachable!("only writes are held"),
    };
    match hold {
        Hold::Pass => unreachable!("passed above"),
        Hold::UntilReleased => {
            lock(&shared.released).push(Pending { req, key });
            Err(HeldBack)
        }
        Hold::Late(after) => {
            shared.outstanding.fetch_add(1, Ordering::SeqCst);
            let shared = shared.clone();
            tokio::spawn(async move {
                tokio::time::sleep(after).await;
                if !shared.stopping.load(Ordering::Relaxed) {
                    deliver(&shared, req, key).await;
                }
                shared.outstanding.fetch_sub(1, Ordering::SeqCst);
                shared.delivered.notify_waiters();
            });
            Err(HeldBack)
        }
    }
}

/// Ends fencegate's connection with no answer.
#[derive(Debug)]
struct HeldBack;

impl std::fmt::Display for HeldBack {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("held back: delivered to the storage later")
    }
}

impl std::error::Error for HeldBack {}

fn plain(
    status: StatusCode,
    text: &'static str,
) -> Response<http_body_util::combinators::BoxBody<Bytes, hyper::Error>> {
    let mut res = Response::new(
        Full::new(Bytes::from_static(text.as_bytes()))
            .map_err(|never: Infallible| match never {})
            .boxed(),
    );
    *res.status_mut() = status;
    res
}

fn token_of(req: &Request<Bytes>) -> Option<u64> {
    req.headers()
        .get(FENCING_TOKEN)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
}

/// Sends `req` to the storage now, noting what a write's answer shows
/// (`written`: the key it writes).
async fn forward(
    shared: &Shared,
    req: Request<Bytes>,
    written: Option<String>,
) -> Response<http_body_util::combinators::BoxBody<Bytes, hyper::Error>> {
    let token = token_of(&req);
    let res = match send(shared, req).await {
        Ok(res) => res,
        Err(_) => return plain(StatusCode::BAD_GATEWAY, "relay: the storage did not answer"),
    };
    let Some(key) = written else {
        return res.map(BodyExt::boxed);
    };
    if !shared.store.answer_says_applied() {
        // The status says it: the answer streams through as it comes.
        if shared.store.delivered(res.status(), &[]).0 {
            note_applied(shared, &key, token);
        }
        return res.map(BodyExt::boxed);
    }
    // A write's answer is read whole, to see whether it was applied (etcd
    // answers 200 to a refused transaction too).
    let (parts, body) = res.into_parts();
    let Ok(body) = Limited::new(body, shared.max_body_bytes).collect().await else {
        return plain(
            StatusCode::BAD_GATEWAY,
            "relay: the storage's answer broke off",
        );
    };
    let body = body.to_bytes();
    if shared.store.delivered(parts.status, &body).0 {
        note_applied(shared, &key, token);
    }
    Response::from_parts(
        parts,
        Full::new(body)
            .map_err(|never: Infallible| match never {})
            .boxed(),
    )
}

async fn send(shared: &Shared, req: Request<Bytes>) -> Result<Response<Incoming>, String> {
    let (mut parts, body) = req.into_parts();
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    parts.uri = format!("{}{path}", shared.upstream)
        .parse()
        .map_err(|e: http::uri::InvalidUri| e.to_string())?;
    let req = Request::from_parts(parts, Full::new(body));
    shared.client.request(req).await.map_err(|e| e.to_string())
}

fn note_applied(shared: &Shared, key: &str, token: Option<u64>) {
    if let Some(token) = token {
        let mut applied = lock(&shared.applied);
        let max = applied.entry(key.to_owned()).or_insert(0);
        *max = (*max).max(token);
    }
}

/// Delivers a held write (of `key`) to the storage: what it answered.
async fn deliver(shared: &Shared, req: Request<Bytes>, key: String) -> Option<Delivered> {
    let token = token_of(&req);
    let method = req.method().to_string();
    let newer_applied =
        token.is_some_and(|t| lock(&shared.applied).get(&key).is_some_and(|&max| max > t));
    let answer = send(shared, req).await;
    lock(&shared.report).late_writes += 1;
    let res = match answer {
        Ok(res) => res,
        Err(_) => {
            lock(&shared.report).late_failed += 1;
            return None;
        }
    };
    let status = res.status().as_u16();
    let code = res.status();
    let body = match Limited::new(res.into_body(), shared.max_body_bytes)
        .collect()
        .await
    {
        Ok(b) => b.to_bytes(),
        Err(_) => Bytes::new(),
    };
    let (applied, refused) = shared.store.delivered(code, &body);
    let mut report = lock(&shared.report);
    let delivered = Delivered {
        method,
        path: key.clone(),
        token,
        status,
        stale: newer_applied,
    };
    if newer_applied {
        report.late_stale += 1;
        if applied {
            report.late_stale_applied += 1;
            if report.examples.len() < 5 {
                report.examples.push(delivered.clone());
            }
        } else if refused {
            report.late_stale_refused += 1;
        }
    }
    drop(report);
    if applied {
        note_applied(shared, &key, token);
    }
    Some(delivered)
}
