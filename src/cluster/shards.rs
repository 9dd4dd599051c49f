//! Where a member with several shards sends a request: to the app of the
//! shard it leads, to the member that leads the shard (one hop), or to its
//! reader (unfenced reads and fencegate's own endpoints), and how it
//! answers what spans shards (the listing, a batch renewal).
//!
//! A request's shard is its lease's: the name in a lease API path, or the
//! lease of the route that fences it. A member never forwards a request
//! that was forwarded to it (`Fencegate-Forwarded`): if it does not lead
//! the shard either, it answers `not-primary` naming the member it believes
//! does.

use std::convert::Infallible;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderName, HeaderValue, CONTENT_LENGTH, CONTENT_TYPE};
use http::{Method, Request, Response, StatusCode};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;
use tower::{Service, ServiceExt};

use crate::api::{Page, MAX_BATCH_BODY_BYTES, MAX_BATCH_LEASES};
use crate::app::{check_head, is_sane_request_id, RequestIds, RequestLimits, X_REQUEST_ID};
use crate::auth::Authenticator;
use crate::backend::upstream::strip_hop_by_hop;
use crate::body::{self, Body, ResponseFuture};
use crate::error::cause;
use crate::error::{Problem, Reason};
use crate::metrics::ClusterStats;
use crate::route::decode_path;
use crate::wire::{FENCEGATE_FORWARDED, FENCEGATE_MEMBER_KEY, FENCEGATE_SHARD};
use fencegate_core::names::LeaseName;
use fencegate_core::shard::{shard_of, Split};

use super::{ClusterError, ClusterOptions, Member, Peer};

const FORWARDED_NAME: HeaderName = HeaderName::from_static(FENCEGATE_FORWARDED);
const SHARD_NAME: HeaderName = HeaderName::from_static(FENCEGATE_SHARD);
const MEMBER_KEY_NAME: HeaderName = HeaderName::from_static(FENCEGATE_MEMBER_KEY);

/// The largest answer one shard may give to a listing or a batch renewal
/// (a page holds at most `PAGE_MAX` leases).
const MAX_SHARD_ANSWER_BYTES: usize = 32 * 1024 * 1024;

/// The lease that fences a proxied request (a write, or a read on a route
/// that fences reads), by its method, path and (for a virtual-hosted one)
/// `Host`; `None` for a request no lease fences.
pub type Classify = Arc<dyn Fn(&Request<Body>) -> Option<String> + Send + Sync>;

/// What a member with several shards needs besides its shards' apps.
pub(super) struct Sharded<S> {
    classify: Classify,
    /// Serves what belongs to no shard: unfenced reads and writes no route
    /// guards go to the storage from any member, and fencegate's own
    /// endpoints (health, metrics, the status page).
    reader: S,
    forwarder: Forwarder,
    /// How long a batch renewal's body may stall.
    body_read_timeout: Duration,
    /// The head checks made before a request is acted on here.
    limits: RequestLimits,
    /// Checked before a request fans out to every shard.
    auth: Option<Arc<Authenticator>>,
    /// Request ids of the answers the member makes itself.
    ids: RequestIds,
    /// Merged listings at once (each holds a page of every shard).
    listings: Arc<Semaphore>,
}

/// What [`super::start`] needs to serve several shards.
pub struct Sharding<S> {
    /// The lease that fences a proxied request.
    pub classify: Classify,
    /// The app for what belongs to no shard: unfenced reads, writes no
    /// route guards, and fencegate's own endpoints.
    pub reader: S,
    /// How long a batch renewal's body may stall.
    pub body_read_timeout: Duration,
    /// The request head limits.
    pub limits: RequestLimits,
    /// The bearer secrets, when authentication is on.
    pub auth: Option<Arc<Authenticator>>,
}

/// Merged listings a member makes at once.
const LISTINGS_AT_ONCE: usize = 4;

impl<S> Sharded<S> {
    pub(super) fn new(
        options: &ClusterOptions,
        sharding: Sharding<S>,
        stats: Arc<ClusterStats>,
    ) -> Result<Self, ClusterError> {
        Ok(Self {
            classify: sharding.classify,
            reader: sharding.reader,
            forwarder: Forwarder::new(options, stats)?,
            body_read_timeout: sharding.body_read_timeout,
            limits: sharding.limits,
            auth: sharding.auth,
            ids: RequestIds::new(),
            listings: Arc::new(Semaphore::new(LISTINGS_AT_ONCE)),
        })
    }
}

/// Where a request goes.
enum Target {
    /// The shard of its lease.
    Shard(u32),
    /// One shard's part of the listing (a member's fan-out).
    ShardListing(u32),
    /// The listing of every shard.
    Listing,
    /// A batch renewal, split by shard.
    Batch,
    Readiness,
    /// The reader.
    Any,
}

/// Sends requests to other members: one pooled HTTP/1.1 client.
struct Forwarder {
    client: Client<hyper_rustls::HttpsConnector<HttpConnector>, Body>,
    me: HeaderValue,
    timeout: Duration,
    stats: Arc<ClusterStats>,
    /// Forwarded requests that failed because of their client (it went
    /// away, or its body broke off), counted and logged once an interval.
    client_failures: ClientFailures,
}

/// Failures a client caused, told in one line an interval rather than one
/// a request (a few clients that abort can cause thousands).
#[derive(Default)]
struct ClientFailures {
    count: std::sync::atomic::AtomicU64,
    /// When the last line was written; `None` before the first.
    last: std::sync::Mutex<Option<crate::clock::Stopwatch>>,
}

/// How often, at most, the line about client-caused failures is written.
const CLIENT_FAILURES_EVERY_MS: u64 = 10_000;

impl ClientFailures {
    /// Counts one; writes the line if the interval has passed.
    fn note(&self, to: &str) {
        self.count.fetch_add(1, Relaxed);
        // A std mutex held for a comparison and a log line, never across
        // an await.
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        if last
            .as_ref()
            .is_some_and(|at| at.elapsed_ms() < CLIENT_FAILURES_EVERY_MS)
        {
            return;
        }
        let n = self.count.swap(0, Relaxed);
        *last = Some(crate::clock::Stopwatch::start());
        drop(last);
        tracing::warn!(member = %to, failed = n, every_s = CLIENT_FAILURES_EVERY_MS / 1000, "forwarded requests failed because their clients went away or sent a broken body (counted, at most one line an interval)");
    }
}

impl Forwarder {
    fn new(options: &ClusterOptions, stats: Arc<ClusterStats>) -> Result<Self, ClusterError> {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.enforce_http(false);
        connector.set_connect_timeout(Some(Duration::from_millis(
            options.forward_timeout_ms.min(5_000),
        )));
        let tls = crate::tls::client_config(None, "forwarding to cluster members")
            .map_err(|e| ClusterError::Options(e.to_string()))?;
        let mut tls = tokio_rustls::rustls::ClientConfig::clone(&tls);
        tls.alpn_protocols.clear();
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .wrap_connector(connector);
        Ok(Self {
            client: Client::builder(crate::rt::ClientExecutor::here())
                .http1_max_buf_size(options.forward_read_buffer_bytes)
                .build(connector),
            me: HeaderValue::from_str(&options.name).map_err(|_| {
                ClusterError::Options("cluster.name cannot be sent in a header".into())
            })?,
            timeout: Duration::from_millis(options.forward_timeout_ms),
            stats,
            client_failures: ClientFailures::default(),
        })
    }

    /// Sends `req` to `to`, marked as forwarded and proved so with the
    /// cluster's member `key`, and relays its answer; a member that does
    /// not take the connection is answered for as `not-primary` (nothing
    /// was sent).
    async fn send(&self, to: &Peer, mut req: Request<Body>, key: &HeaderValue) -> Response<Body> {
        let target = format!(
            "{}{}",
            to.url.trim_end_matches('/'),
            req.uri().path_and_query().map_or("/", |pq| pq.as_str())
        );
        let Ok(uri) = target.parse::<http::Uri>() else {
            return Problem::invalid_request("the request target cannot be forwarded")
                .into_response();
        };
        *req.uri_mut() = uri;
        strip_hop_by_hop(req.headers_mut());
        req.headers_mut().insert(FORWARDED_NAME, self.me.clone());
        req.headers_mut().insert(MEMBER_KEY_NAME, key.clone());
        self.stats.forwarded.fetch_add(1, Relaxed);
        match tokio::time::timeout(self.timeout, self.client.request(req)).await {
            Ok(Ok(res)) => {
                let (mut parts, incoming) = res.into_parts();
                strip_hop_by_hop(&mut parts.headers);
                // Tells a client that reads the shard map that it is out of
                // date: this answer crossed two members.
                parts.headers.insert(FORWARDED_NAME, self.me.clone());
                Response::from_parts(parts, body::boxed(incoming))
            }
            Ok(Err(e)) if e.is_connect() => {
                tracing::warn!(member = %to.name, url = %to.url, error = %cause(&e), "cannot forward to the member that leads the shard");
                Problem::not_primary(
                    &format!(
                        "member {} leads this lease's shard but did not take the connection; retry shortly",
                        to.name
                    ),
                    None,
                )
                .into_response()
            }
            Ok(Err(e)) => {
                if body::is_client_body_error(&e) {
                    self.client_failures.note(&to.name);
                } else {
                    tracing::warn!(member = %to.name, error = %cause(&e), "forwarding a request failed");
                }
                Problem::new(
                    Reason::UpstreamError,
                    format!(
                        "forwarding to member {}, which leads this lease's shard, failed: its outcome is unknown",
                        to.name
                    ),
                )
                .into_response()
            }
            Err(_) => Problem::upstream_timeout(self.timeout.as_millis() as u64).into_response(),
        }
    }
}

/// Where a request for `/_fence/…` goes.
fn api_target(shards: u32, method: &Method, path: &str, shard: Option<&HeaderValue>) -> Target {
    let Ok(segments) = decode_path(path) else {
        return Target::Any;
    };
    let segments: Vec<&str> = segments.iter().map(|s| s.as_ref()).collect();
    match segments.get(1..).unwrap_or_default() {
        ["leases"] if method == Method::GET => match shard {
            Some(v) => match v.to_str().ok().and_then(|v| v.parse::<u32>().ok()) {
                Some(k) if k < shards => Target::ShardListing(k),
                _ => Target::Any,
            },
            None => Target::Listing,
        },
        ["leases", name, ..] => match LeaseName::new(name) {
            Ok(name) => Target::Shard(shard_of(name.as_str(), shards)),
            // The reader's lease API refuses the name.
            Err(_) => Target::Any,
        },
        ["renew"] if method == Method::POST => Target::Batch,
        ["readyz"] => Target::Readiness,
        _ => Target::Any,
    }
}

/// `{"leases": [...], "next": ...}` or `{"results": [...]}` of one shard.
fn parse_answer(bytes: &[u8]) -> Option<serde_json::Map<String, serde_json::Value>> {
    match serde_json::from_slice(bytes) {
        Ok(serde_json::Value::Object(map)) => Some(map),
        _ => None,
    }
}

fn json_response(status: StatusCode, doc: &serde_json::Value) -> Response<Body> {
    let mut res = Response::new(body::full(Bytes::from(doc.to_string())));
    *res.status_mut() = status;
    res.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    res
}

/// A copy of `req`'s head with `body`.
fn with_body(req: &http::request::Parts, body: Bytes) -> Request<Body> {
    let mut sub = Request::new(body::full(body.clone()));
    *sub.method_mut() = req.method.clone();
    *sub.uri_mut() = req.uri.clone();
    *sub.headers_mut() = req.headers.clone();
    sub.headers_mut().remove(http::header::TRANSFER_ENCODING);
    sub.headers_mut()
        .insert(CONTENT_LENGTH, HeaderValue::from(body.len()));
    sub
}

/// `app`'s answer to `req`, through a boxed future: awaited inside
/// [`Member::dispatch`], the app's own future type would have to be `Send`
/// for every lifetime of the body's error type, which the compiler cannot
/// prove.
fn boxed_call<S>(app: S, req: Request<Body>) -> ResponseFuture
where
    S: Service<Request<Body>, Response = Response<Body>, Error = Infallible> + Send + 'static,
    S::Future: Send + 'static,
{
    Box::pin(app.oneshot(req))
}

async fn serve<S>(app: S, req: Request<Body>) -> Response<Body>
where
    S: Service<Request<Body>, Response = Response<Body>, Error = Infallible> + Send + 'static,
    S::Future: Send + 'static,
{
    match boxed_call(app, req).await {
        Ok(res) => res,
        Err(never) => match never {},
    }
}

impl<S> Member<S>
where
    S: Service<Request<Body>, Response = Response<Body>, Error = Infallible>
        + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send + 'static,
{
    fn sharded(&self) -> &Sharded<S> {
        self.shared
            .sharded
            .as_ref()
            .expect("dispatch runs only with several shards")
    }

    /// Answers `req` with several shards.
    pub(super) async fn dispatch(self, mut req: Request<Body>) -> Response<Body> {
        let request_id = req
            .headers()
            .get(X_REQUEST_ID)
            .filter(|v| is_sane_request_id(v))
            .cloned();
        let mut res = self.route(&mut req).await;
        if !res.headers().contains_key(X_REQUEST_ID) {
            let id = request_id.unwrap_or_else(|| self.sharded().ids.make());
            res.headers_mut().insert(X_REQUEST_ID, id);
        }
        res
    }

    async fn route(&self, req: &mut Request<Body>) -> Response<Body> {
        let sharded = self.sharded();
        if let Err(problem) = check_head(req, &sharded.limits) {
            return problem.into_response();
        }
        // Only members set these, and the storage never sees them. The
        // mark counts only with the cluster's member key (a client cannot
        // know it): a request marked so is never forwarded again (one hop),
        // and only on it a shard pin counts, so a client's pin never picks
        // a shard, and a member's that names no shard is refused, never
        // answered from no shard.
        let key = req.headers_mut().remove(MEMBER_KEY_NAME);
        let marked = req.headers_mut().remove(FORWARDED_NAME).is_some();
        let forwarded = marked && key.is_some_and(|k| self.is_member_key(&k));
        let pinned = req.headers_mut().remove(SHARD_NAME).filter(|_| forwarded);
        if let Some(pin) = &pinned {
            let shard = pin.to_str().ok().and_then(|v| v.parse::<u32>().ok());
            if shard.is_none_or(|k| k >= self.shared.options.shards) {
                return Problem::invalid_request(format!(
                    "Fencegate-Shard must name one of the {} shards",
                    self.shared.options.shards
                ))
                .into_response();
            }
        }
        let req = std::mem::take(req);
        let shards = self.shared.options.shards;
        let forward = self.shared.options.forward && !forwarded;
        let path = req.uri().path();
        let target = if path.starts_with(crate::wire::PREFIX) {
            api_target(shards, req.method(), path, pinned.as_ref())
        } else {
            match (sharded.classify)(&req) {
                Some(lease) => Target::Shard(shard_of(&lease, shards)),
                None => Target::Any,
            }
        };
        match target {
            Target::Shard(k) | Target::ShardListing(k) => self.to_shard(k, req, forward).await,
            Target::Listing | Target::Batch if !self.authenticated(&req) => {
                Problem::unauthorized().into_response()
            }
            Target::Listing => self.list(req).await,
            Target::Batch => self.renew_batch(req).await,
            Target::Readiness => self.readiness(req).await,
            Target::Any => self.to_reader(req).await,
        }
    }

    /// Whether `presented` is the cluster's member key (compared in
    /// constant time; never, before this member has read it).
    fn is_member_key(&self, presented: &HeaderValue) -> bool {
        use subtle::ConstantTimeEq;
        self.shared.member_key.get().is_some_and(|mine| {
            let (a, b) = (mine.as_bytes(), presented.as_bytes());
            a.len() == b.len() && bool::from(a.ct_eq(b))
        })
    }

    /// Whether a request that fans out to every shard may (with
    /// authentication on, it carries a known secret): the shards check it
    /// again, this saves them the work.
    fn authenticated(&self, req: &Request<Body>) -> bool {
        self.sharded()
            .auth
            .as_ref()
            .is_none_or(|auth| auth.authenticate(req.headers()).is_some())
    }

    async fn to_reader(&self, req: Request<Body>) -> Response<Body> {
        let reader = self.sharded().reader.clone();
        serve(reader, req).await
    }

    /// Serves `req` with shard `shard`'s app if this member leads it, else
    /// forwards it to the member that does (if `forward`), else answers
    /// `not-primary`.
    async fn to_shard(&self, shard: u32, req: Request<Body>, forward: bool) -> Response<Body> {
        let (app, primary) = {
            let view = self.view();
            let slot = &view.shards[shard as usize];
            (slot.live_app().cloned(), slot.primary.clone())
        };
        if let Some(app) = app {
            return serve(app, req).await;
        }
        let key = self.shared.member_key.get();
        match (primary.filter(|p| p.name != self.shared.me.name), key) {
            (Some(to), Some(key)) if forward => self.sharded().forwarder.send(&to, req, key).await,
            _ => self.not_primary(shard, req.uri().path()),
        }
    }

    /// Sends a part of a request that spans shards to shard `shard` (here,
    /// or at the member that leads it), on a task of its own so the parts
    /// run at once.
    fn part(&self, shard: Option<u32>, req: Request<Body>) -> JoinHandle<Response<Body>> {
        let member = self.clone();
        tokio::spawn(async move {
            match shard {
                Some(shard) => member.to_shard(shard, req, true).await,
                None => member.to_reader(req).await,
            }
        })
    }

    /// One ordered page across every shard: each shard's page after the
    /// same cursor, asked at once, merged by name and cut at the limit.
    async fn list(&self, req: Request<Body>) -> Response<Body> {
        let limit = match Page::parse(req.uri().query()) {
            Ok(page) => page.limit,
            Err(problem) => return problem.into_response(),
        };
        let Ok(_slot) = self.sharded().listings.clone().acquire_owned().await else {
            return Problem::not_primary("the member is stopping", None).into_response();
        };
        let (parts, _) = req.into_parts();
        let asked: Vec<_> = (0..self.shared.options.shards)
            .map(|shard| {
                let mut sub = with_body(&parts, Bytes::new());
                sub.headers_mut().remove(CONTENT_LENGTH);
                sub.headers_mut()
                    .insert(SHARD_NAME, HeaderValue::from(shard));
                self.part(Some(shard), sub)
            })
            .collect();
        let mut leases = Vec::new();
        let mut more = false;
        for (shard, asked) in asked.into_iter().enumerate() {
            let Ok(res) = asked.await else {
                return Problem::new(Reason::UpstreamError, "a shard's listing failed")
                    .into_response();
            };
            if res.status() != StatusCode::OK {
                return res;
            }
            let Some(mut page) = read_answer(res).await else {
                return Problem::new(
                    Reason::UpstreamError,
                    format!("shard {shard}'s listing could not be read"),
                )
                .into_response();
            };
            more |= page.get("next").is_some_and(|n| !n.is_null());
            if let Some(serde_json::Value::Array(page)) = page.remove("leases") {
                leases.extend(page);
            }
        }
        let name = |v: &serde_json::Value| v["lease"].as_str().unwrap_or_default().to_owned();
        leases.sort_by(|a, b| {
            let (a, b) = (a["lease"].as_str(), b["lease"].as_str());
            a.unwrap_or_default().cmp(b.unwrap_or_default())
        });
        if leases.len() > limit {
            leases.truncate(limit);
            more = true;
        }
        let next = match leases.last() {
            Some(last) if more => serde_json::Value::String(name(last)),
            _ => serde_json::Value::Null,
        };
        json_response(
            StatusCode::OK,
            &serde_json::json!({ "leases": leases, "next": next }),
        )
    }

    /// A batch renewal naming leases of several shards: each shard's part
    /// sent where the shard is led, all at once, the results put back in
    /// order. A batch within one shard, or one the lease API refuses whole
    /// (not a list, unknown fields, too many leases), goes as it is.
    async fn renew_batch(&self, req: Request<Body>) -> Response<Body> {
        let (parts, body) = req.into_parts();
        let bytes = match self.batch_body(body).await {
            Ok(bytes) => bytes,
            Err(problem) => return problem.into_response(),
        };
        let shards = self.shared.options.shards;
        let mut doc = parse_answer(&bytes).unwrap_or_default();
        let ttl_ms = doc.remove("ttl_ms");
        let items = match doc.remove("leases") {
            Some(serde_json::Value::Array(items))
                if doc.is_empty() && items.len() <= MAX_BATCH_LEASES =>
            {
                items
            }
            // Not a batch the lease API takes: it says what is wrong.
            _ => return self.to_reader(with_body(&parts, bytes)).await,
        };
        let split = Split::new(items.iter().map(|item| item["lease"].as_str()), shards);
        let forward = self.shared.options.forward;
        if split.parts().len() <= 1 {
            let whole = with_body(&parts, bytes);
            return match split.parts().first().and_then(|(shard, _)| *shard) {
                Some(shard) => self.to_shard(shard, whole, forward).await,
                None => self.to_reader(whole).await,
            };
        }
        let asked: Vec<_> = split
            .parts()
            .iter()
            .map(|(shard, indices)| {
                let shard = *shard;
                let mut part = serde_json::Map::new();
                part.insert(
                    "leases".to_owned(),
                    indices.iter().map(|&i| items[i].clone()).collect(),
                );
                if let Some(ttl_ms) = &ttl_ms {
                    part.insert("ttl_ms".to_owned(), ttl_ms.clone());
                }
                let part = Bytes::from(serde_json::Value::Object(part).to_string());
                let sub = with_body(&parts, part);
                // Without forwarding, another member's leases are answered
                // `not-primary`, each.
                let sub_shard = shard.filter(|_| forward || self.leads(shard));
                match (shard, sub_shard) {
                    (Some(_), None) => None,
                    _ => Some(self.part(sub_shard, sub)),
                }
            })
            .collect();
        let unreadable = || {
            Problem::new(
                Reason::UpstreamError,
                "this lease's shard gave no readable answer",
            )
            .to_json()
        };
        let mut answers = Vec::with_capacity(asked.len());
        for (asked, (shard, indices)) in asked.into_iter().zip(split.parts()) {
            let res = match asked {
                Some(asked) => asked.await.ok(),
                None => Some(self.not_primary(shard.unwrap_or(0), "/_fence/renew")),
            };
            let ok = res.as_ref().is_some_and(|r| r.status() == StatusCode::OK);
            let answer = match res {
                Some(res) => read_answer(res).await,
                None => None,
            };
            let results = answer
                .as_ref()
                .filter(|_| ok)
                .and_then(|a| a.get("results"))
                .and_then(|r| r.as_array())
                .filter(|r| r.len() == indices.len())
                .cloned();
            answers.push(match (results, answer) {
                (Some(results), _) => Ok(results),
                // The shard refused the whole part: its problem, for each
                // of the part's leases.
                (None, Some(problem)) => Err(serde_json::Value::Object(problem)),
                (None, None) => Err(unreadable()),
            });
        }
        let results = split.merge(answers, unreadable());
        json_response(StatusCode::OK, &serde_json::json!({ "results": results }))
    }

    /// A batch renewal's body, read whole within its bound and the body
    /// read timeout.
    async fn batch_body(&self, body: Body) -> Result<Bytes, Problem> {
        let timeout = Some(self.sharded().body_read_timeout);
        match body::collect_idle(body, MAX_BATCH_BODY_BYTES, timeout).await {
            Ok(bytes) => Ok(bytes),
            Err(body::ReadError::TooLarge) => {
                Err(Problem::payload_too_large(MAX_BATCH_BODY_BYTES as u64))
            }
            Err(body::ReadError::Failed(_) | body::ReadError::Stalled) => Err(Problem::new(
                Reason::RequestTimeout,
                "the request body did not arrive in time",
            )
            .closing_connection()),
        }
    }

    /// Whether this member leads `shard` now.
    fn leads(&self, shard: Option<u32>) -> bool {
        shard.is_some_and(|k| self.view().shards[k as usize].live_app().is_some())
    }

    /// Ready when the reader is (not draining, the storage reachable) and
    /// the member can serve or forward a lease's requests: it leads a
    /// shard, or (forwarding) knows the primary of one.
    async fn readiness(&self, req: Request<Body>) -> Response<Body> {
        let res = self.to_reader(req).await;
        if res.status() != StatusCode::OK {
            return res;
        }
        let ready = {
            let view = self.view();
            view.shards.iter().any(|s| {
                s.live_app().is_some() || (self.shared.options.forward && s.primary.is_some())
            })
        };
        if ready {
            res
        } else {
            Problem::not_primary("this member serves no shard yet; retry shortly", None)
                .into_response()
        }
    }
}

/// A shard's answer to a part of a request that spans shards, as JSON.
async fn read_answer(res: Response<Body>) -> Option<serde_json::Map<String, serde_json::Value>> {
    let bytes = body::collect(res.into_body(), MAX_SHARD_ANSWER_BYTES)
        .await
        .ok()?;
    parse_answer(&bytes)
}
