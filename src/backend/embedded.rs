//! The embedded key-value store: the default backend, so `fencegate serve`
//! works alone, and `fencegate backend` serves it standalone.
//!
//! It keeps values in memory, keyed by the request path under `/kv/`: `PUT`
//! stores the body (and its `Content-Type`), `GET`/`HEAD` return it, `DELETE`
//! removes it, a missing key is 404. Every stored value has an entity tag
//! that changes on every write (`ETag: "n"`, from a counter), and `PUT` and
//! `DELETE` evaluate `If-Match` and `If-None-Match` (412 when they fail), so
//! routes with storage-side preconditions (SPEC §10) work in front of it. It
//! is for trying fencegate out and for tests, not the storage you protect in
//! production.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use dashmap::mapref::entry::Entry;
use dashmap::DashMap;
use http::header::{HeaderValue, CONTENT_LENGTH, CONTENT_TYPE, ETAG};
use http::{Method, Request, Response, StatusCode};
use tower::Service;

use crate::body::{self, Body};
use crate::error::{Problem, Reason};
use crate::wire::FENCING_TOKEN;

/// The path prefix the embedded store serves.
pub const KV_PREFIX: &str = "/kv/";

#[derive(Clone, Debug)]
struct Value {
    bytes: Bytes,
    content_type: Option<HeaderValue>,
    /// The version its entity tag names.
    version: u64,
}

impl Value {
    fn etag(&self) -> HeaderValue {
        etag(self.version)
    }
}

fn etag(version: u64) -> HeaderValue {
    HeaderValue::from_maybe_shared(Bytes::from(format!("\"{version}\"")))
        .unwrap_or_else(|_| HeaderValue::from_static("\"0\""))
}

/// Whether the preconditions of `headers` hold for a key whose current
/// entity tag is `current` (`None`: no value): `If-Match` compares strongly
/// (`*`: any value), `If-None-Match` weakly (`*`: none may exist), as RFC
/// 9110 §13.1 has it for a state-changing request.
fn preconditions_hold(headers: &http::HeaderMap, current: Option<&HeaderValue>) -> bool {
    // Each header's values as one comma-separated list of tags; `None`:
    // the header is absent.
    let tags = |name: http::header::HeaderName| {
        let mut values = headers.get_all(name).iter().peekable();
        values.peek()?;
        Some(
            values
                .flat_map(|v| v.as_bytes().split(|b| *b == b','))
                .map(<[u8]>::trim_ascii)
                .filter(|t| !t.is_empty()),
        )
    };
    let current = current.map(HeaderValue::as_bytes);
    if let Some(mut tags) = tags(http::header::IF_MATCH) {
        let Some(current) = current else {
            return false;
        };
        if !tags.any(|t| t == b"*" || (!t.starts_with(b"W/") && t == current)) {
            return false;
        }
    }
    if let Some(mut tags) = tags(http::header::IF_NONE_MATCH) {
        if let Some(current) = current {
            if tags.any(|t| t == b"*" || t.strip_prefix(b"W/").unwrap_or(t) == current) {
                return false;
            }
        }
    }
    true
}

/// The most entries one page of the apply log holds.
pub const HISTORY_PAGE_MAX: usize = 100_000;

/// `after=SEQ&limit=N` of a history request (`None`: no paging asked).
fn history_page(query: Option<&str>) -> Result<Option<(u64, usize)>, Problem> {
    let Some(query) = query.filter(|q| !q.is_empty()) else {
        return Ok(None);
    };
    let (mut after, mut limit) = (0u64, 10_000usize);
    for param in query.split('&') {
        let (name, value) = param.split_once('=').unwrap_or((param, ""));
        let bad = || Problem::invalid_request(format!("{name}: not a whole number"));
        match name {
            "after" => after = value.parse().map_err(|_| bad())?,
            "limit" => limit = value.parse().map_err(|_| bad())?,
            _ => {
                return Err(Problem::invalid_request(format!(
                    "unknown parameter {name:?} (after, limit)"
                )))
            }
        }
    }
    if limit == 0 || limit > HISTORY_PAGE_MAX {
        return Err(Problem::invalid_request(format!(
            "limit must be between 1 and {HISTORY_PAGE_MAX}"
        )));
    }
    Ok(Some((after, limit)))
}

/// A write its preconditions refused: nothing changed.
#[derive(Debug)]
struct Refused;

fn precondition_failed() -> Response<Body> {
    let mut res = Response::new(body::full(
        "precondition failed: the key's state is not the one the request names\n",
    ));
    *res.status_mut() = StatusCode::PRECONDITION_FAILED;
    res.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("text/plain"));
    res
}

/// The path of the apply log of a recording store.
pub const HISTORY_PATH: &str = "/_fence/backend/history";
/// Header naming the writer of a write (set by `fencegate loadtest`).
pub const WRITER_HEADER: &str = "x-fencegate-writer";
/// Header naming one write (set by `fencegate loadtest`).
pub const WRITE_ID_HEADER: &str = "x-fencegate-write-id";

/// One write the store applied, in apply order.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Applied {
    pub seq: u64,
    pub method: String,
    pub key: String,
    /// The write's `Fencing-Token`, if it carried one.
    pub token: Option<u64>,
    pub writer: Option<String>,
    pub write_id: Option<String>,
}

/// The apply log of a recording store, bounded.
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct History {
    pub entries: Vec<Applied>,
    /// Whether entries were dropped because the log was full.
    pub truncated: bool,
    #[serde(skip)]
    max_entries: usize,
}

/// The in-memory store; clones share the same data.
#[derive(Clone, Debug)]
pub struct EmbeddedStore {
    // A sharded map: keys are independent, and no guard lives across an await
    // (the body is read in full before the insert).
    values: Arc<DashMap<String, Value>>,
    /// The apply log, when recording. Writes take this mutex around the
    /// change itself, so the log's order is the order writes were applied.
    history: Option<Arc<Mutex<History>>>,
    /// The last version an entity tag named.
    versions: Arc<AtomicU64>,
    /// Time a `PUT` body may send nothing (`limits.body_read_timeout_ms`):
    /// a writer that stops sending mid-body is answered 408 then, so its
    /// write stops holding the next term at the handover barrier; one that
    /// sends slowly goes on.
    body_read_timeout: Duration,
}

impl Default for EmbeddedStore {
    fn default() -> Self {
        Self {
            values: Arc::default(),
            versions: Arc::default(),
            history: None,
            body_read_timeout: Duration::from_millis(10_000),
        }
    }
}

impl EmbeddedStore {
    pub fn new() -> Self {
        Self::default()
    }

    /// A store that keeps an apply log of up to `max_entries` writes, served
    /// at [`HISTORY_PATH`].
    pub fn recording(max_entries: usize) -> Self {
        Self {
            history: Some(Arc::new(Mutex::new(History {
                max_entries,
                ..History::default()
            }))),
            ..Self::default()
        }
    }

    /// Gives `PUT` bodies `timeout` to arrive in full (default 10 s).
    pub fn with_body_read_timeout(mut self, timeout: Duration) -> Self {
        self.body_read_timeout = timeout;
        self
    }

    /// Whether this store keeps an apply log.
    pub fn is_recording(&self) -> bool {
        self.history.is_some()
    }

    /// The apply log as JSON (404 when not recording): all of it, or with
    /// `query` `after=SEQ&limit=N` a page of at most `N` entries (at most
    /// [`HISTORY_PAGE_MAX`]) after entry `SEQ`, with `next`: the `after`
    /// of the next page, `null` on the last.
    pub fn history_response(&self, query: Option<&str>) -> Response<Body> {
        let Some(history) = &self.history else {
            return Problem::new(Reason::NotFound, "this backend does not record writes")
                .into_response();
        };
        let page = match history_page(query) {
            Ok(page) => page,
            Err(problem) => return problem.into_response(),
        };
        let json = {
            let h = history
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            match page {
                None => serde_json::to_vec(&*h).unwrap_or_default(),
                Some((after, limit)) => {
                    // Entry `seq` is at index `seq - 1`.
                    let from = usize::try_from(after)
                        .unwrap_or(usize::MAX)
                        .min(h.entries.len());
                    let to = from.saturating_add(limit).min(h.entries.len());
                    let next = (to < h.entries.len()).then_some(to as u64);
                    serde_json::to_vec(&serde_json::json!({
                        "entries": &h.entries[from..to],
                        "truncated": h.truncated,
                        "next": next,
                    }))
                    .unwrap_or_default()
                }
            }
        };
        let mut res = Response::new(body::full(json));
        res.headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        res
    }

    /// Applies `change` and logs it (if recording) as one step, unless its
    /// preconditions refused it (`Err`).
    fn apply<T>(
        &self,
        method: &Method,
        key: &str,
        headers: &http::HeaderMap,
        change: impl FnOnce() -> Result<T, Refused>,
    ) -> Result<T, Refused> {
        let Some(history) = &self.history else {
            return change();
        };
        let text = |name: &str| {
            headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        };
        let mut h = history
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let out = change()?;
        if h.entries.len() < h.max_entries {
            let seq = h.entries.len() as u64 + 1;
            h.entries.push(Applied {
                seq,
                method: method.to_string(),
                key: key.to_owned(),
                token: text(FENCING_TOKEN).and_then(|t| t.parse().ok()),
                writer: text(WRITER_HEADER),
                write_id: text(WRITE_ID_HEADER),
            });
        } else {
            h.truncated = true;
        }
        Ok(out)
    }

    /// The stored value at `path` (e.g. `/kv/orders/x`), bypassing any fence.
    /// Tests use it to prove what did or did not reach the storage.
    pub fn get(&self, path: &str) -> Option<Bytes> {
        self.values.get(path).map(|v| v.bytes.clone())
    }

    /// Stores `bytes` at `path` directly, bypassing any fence.
    pub fn put(&self, path: &str, bytes: impl Into<Bytes>) {
        self.values.insert(
            path.to_owned(),
            Value {
                bytes: bytes.into(),
                content_type: None,
                version: self.next_version(),
            },
        );
    }

    fn next_version(&self) -> u64 {
        self.versions.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// How many keys are stored.
    pub fn len(&self) -> usize {
        self.values.len()
    }

    /// Whether nothing is stored.
    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    pub(super) async fn handle(self, req: Request<Body>) -> Response<Body> {
        let path = req.uri().path().to_owned();
        if path == HISTORY_PATH && req.method() == Method::GET {
            return self.history_response(req.uri().query());
        }
        if !path.starts_with(KV_PREFIX) || path.len() == KV_PREFIX.len() {
            return Problem::new(Reason::NotFound, "the embedded store serves /kv/{key}")
                .into_response();
        }
        match *req.method() {
            Method::GET | Method::HEAD => self.get_request(&path, req.method() == Method::HEAD),
            Method::PUT => self.put_request(path, req).await,
            Method::DELETE => self.delete_request(path, req.headers()),
            _ => Problem::method_not_allowed("GET, HEAD, PUT, DELETE").into_response(),
        }
    }

    /// A `GET` (or, `head`, a `HEAD`) of the key at `path`.
    fn get_request(&self, path: &str, head: bool) -> Response<Body> {
        let Some(value) = self.values.get(path).map(|v| v.clone()) else {
            return no_such_key();
        };
        let mut res = if head {
            let mut res = Response::new(body::empty());
            res.headers_mut()
                .insert(CONTENT_LENGTH, HeaderValue::from(value.bytes.len()));
            res
        } else {
            Response::new(body::full(value.bytes))
        };
        res.headers_mut().insert(ETAG, etag(value.version));
        if let Some(ct) = value.content_type {
            res.headers_mut().insert(CONTENT_TYPE, ct);
        }
        res
    }

    /// A `PUT` of the key at `path`: its body read whole, then stored if
    /// the request's preconditions hold.
    async fn put_request(&self, path: String, req: Request<Body>) -> Response<Body> {
        let (parts, body) = req.into_parts();
        let read = body::collect_idle(body, usize::MAX, Some(self.body_read_timeout)).await;
        let bytes = match read {
            Ok(bytes) => bytes,
            Err(body::ReadError::Stalled) => {
                let timeout_ms = u64::try_from(self.body_read_timeout.as_millis());
                return Problem::request_timeout(timeout_ms.unwrap_or(u64::MAX)).into_response();
            }
            Err(body::ReadError::TooLarge) => {
                return Problem::new(
                    Reason::PayloadTooLarge,
                    "the body is over the configured limit",
                )
                .into_response()
            }
            Err(_) => {
                return Problem::invalid_request("the body could not be read").into_response()
            }
        };
        let value = Value {
            bytes,
            content_type: parts.headers.get(CONTENT_TYPE).cloned(),
            version: self.next_version(),
        };
        let tag = value.etag();
        // The check and the change under the key's entry lock: no other
        // write of the key comes between them.
        let store = || match self.values.entry(path.clone()) {
            Entry::Occupied(mut e) => {
                if !preconditions_hold(&parts.headers, Some(&e.get().etag())) {
                    return Err(Refused);
                }
                e.insert(value);
                Ok(false)
            }
            Entry::Vacant(e) => {
                if !preconditions_hold(&parts.headers, None) {
                    return Err(Refused);
                }
                e.insert(value);
                Ok(true)
            }
        };
        let Ok(created) = self.apply(&parts.method, &path, &parts.headers, store) else {
            return precondition_failed();
        };
        let mut res = Response::new(body::empty());
        *res.status_mut() = if created {
            StatusCode::CREATED
        } else {
            StatusCode::NO_CONTENT
        };
        res.headers_mut().insert(ETAG, tag);
        res
    }

    /// A `DELETE` of the key at `path`, if its preconditions hold.
    fn delete_request(&self, path: String, headers: &http::HeaderMap) -> Response<Body> {
        let remove = || match self.values.entry(path.clone()) {
            Entry::Occupied(e) => {
                if !preconditions_hold(headers, Some(&e.get().etag())) {
                    return Err(Refused);
                }
                e.remove();
                Ok(true)
            }
            Entry::Vacant(_) => {
                if !preconditions_hold(headers, None) {
                    return Err(Refused);
                }
                Ok(false)
            }
        };
        match self.apply(&Method::DELETE, &path, headers, remove) {
            Ok(true) => {
                let mut res = Response::new(body::empty());
                *res.status_mut() = StatusCode::NO_CONTENT;
                res
            }
            Ok(false) => no_such_key(),
            Err(Refused) => precondition_failed(),
        }
    }
}

fn no_such_key() -> Response<Body> {
    Problem::new(Reason::NotFound, "no value is stored at this key").into_response()
}

impl Service<Request<Body>> for EmbeddedStore {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let store = self.clone();
        Box::pin(async move { Ok(store.handle(req).await) })
    }
}
