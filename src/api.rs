//! The lease API under `/_fence/`: decode, call the lease store, encode.
//!
//! | Method and path | |
//! | --- | --- |
//! | `POST /_fence/leases/{name}` | acquire |
//! | `POST /_fence/leases/{name}/renew` | renew |
//! | `DELETE /_fence/leases/{name}` | release |
//! | `GET /_fence/leases/{name}`, `GET /_fence/leases` | inspect, list |
//! | `GET /_fence/livez`, `GET /_fence/readyz` | health |
//! | `GET /_fence/metrics` | Prometheus text |
//! | `GET /_fence/backend/history` | the recording embedded backend's apply log |
//! | `GET`/`POST /_fence/clock` | manual clock only |

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use bytes::Bytes;
use http::header::{HeaderValue, CONTENT_TYPE};
use http::{Method, Request, Response, StatusCode};
use serde::{Deserialize, Serialize};
use serde_json::json;
use sha2::{Digest, Sha256};
use smallvec::SmallVec;

use crate::auth::Identity;
use crate::backend::{ClientAddr, EmbeddedStore, RequestContext, Upstream};
use crate::body::{self, Body};
use crate::clock::ClockKind;
use crate::error::{Problem, Reason};
use crate::fence::{credentials, visible_to};
use crate::lease::{Acquired, LeaseStore, Requester, View};
use crate::metrics::Metrics;
use crate::names::{Holder, LeaseName};
use crate::route::decode_path;

pub use crate::wire::PREFIX;
use crate::wire::{FENCING_LEASE_ID, FENCING_TOKEN};

/// Largest JSON body the lease API reads.
const MAX_API_BODY_BYTES: usize = 64 * 1024;

/// The largest body of a batch renewal (about 10,000 leases).
pub(crate) const MAX_BATCH_BODY_BYTES: usize = 1024 * 1024;

/// The most leases one batch renewal names.
pub const MAX_BATCH_LEASES: usize = 10_000;

/// The lease API's state.
#[derive(Clone, Debug)]
pub struct Api {
    leases: LeaseStore,
    require_lease_id: bool,
    draining: Arc<AtomicBool>,
    /// The embedded backend, when it records an apply log to serve.
    history: Option<EmbeddedStore>,
    metrics: Metrics,
    surface: Surface,
    /// Time a client has to send a request body the API reads.
    body_read_timeout: Duration,
    /// The upstream, whose failures in a row readiness reflects.
    upstream: Option<Upstream>,
}

/// Which endpoints a listener serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Surface {
    /// Everything: the single-listener set-up.
    All,
    /// The main listener when an admin listener exists: leases and health,
    /// but not metrics, clock, the apply log or the status page.
    Data,
    /// The admin listener: health, metrics, clock, the apply log, the status
    /// page and the listing it reads (admins only, with auth on) only.
    Admin,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AcquireBody {
    #[serde(default)]
    holder: Option<String>,
    ttl_ms: serde_json::Value,
    #[serde(default)]
    wait_ms: Option<u64>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RenewBody {
    #[serde(default)]
    ttl_ms: Option<serde_json::Value>,
}

/// A batch renewal: every lease with its token and lease id, a TTL for
/// each (`ttl_ms`, optional) or for all (the outer `ttl_ms`).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct BatchRenewBody {
    leases: Vec<BatchRenewItem>,
    #[serde(default)]
    ttl_ms: Option<serde_json::Value>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct BatchRenewItem {
    lease: String,
    token: u64,
    #[serde(default)]
    lease_id: Option<String>,
    #[serde(default)]
    ttl_ms: Option<serde_json::Value>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AdvanceBody {
    advance_ms: u64,
}

/// The authenticated caller, when authentication is on.
fn caller(req: &Request<Body>) -> Option<&Arc<Identity>> {
    RequestContext::of(req)
        .and_then(|c| c.caller.as_ref())
        .map(|c| &c.0)
}

/// Reads a TTL within the store's bounds: any JSON number that is not a
/// u64 in them is `invalid-ttl`; anything else is not a TTL at all
/// (`invalid-request`).
fn ttl_from_json(value: &serde_json::Value, leases: &LeaseStore) -> Result<u64, Problem> {
    let limits = leases.limits();
    let bounds = limits.min_ttl_ms..=limits.max_ttl_ms;
    match value {
        serde_json::Value::Number(n) => n
            .as_u64()
            .filter(|ttl_ms| bounds.contains(ttl_ms))
            .ok_or_else(|| Problem::invalid_ttl(limits.min_ttl_ms, limits.max_ttl_ms)),
        _ => Err(Problem::invalid_request(
            "ttl_ms must be a number of milliseconds",
        )),
    }
}

/// Reads a JSON body of the lease API, which must arrive within `timeout`
/// (a client that declares a body and never sends it costs a connection
/// slot only that long).
async fn read_json<T: serde::de::DeserializeOwned>(
    body: Body,
    optional: bool,
    timeout: Duration,
) -> Result<Option<T>, Problem> {
    read_json_up_to(body, optional, timeout, MAX_API_BODY_BYTES).await
}

async fn read_json_up_to<T: serde::de::DeserializeOwned>(
    body: Body,
    optional: bool,
    timeout: Duration,
    max_bytes: usize,
) -> Result<Option<T>, Problem> {
    let read = tokio::time::timeout(timeout, body::collect(body, max_bytes));
    let Ok(read) = read.await else {
        return Err(Problem::request_timeout(timeout.as_millis() as u64));
    };
    let bytes = match read {
        Ok(bytes) => bytes,
        Err(body::ReadError::TooLarge) => return Err(Problem::payload_too_large(max_bytes as u64)),
        Err(body::ReadError::Failed(_) | body::ReadError::Stalled) => {
            return Err(Problem::invalid_request("the body could not be read"))
        }
    };
    if optional && bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(None);
    }
    serde_json::from_slice(&bytes).map(Some).map_err(|e| {
        Problem::invalid_request(format!("the body is not valid JSON for this call: {e}"))
    })
}

fn json_response(status: StatusCode, value: &serde_json::Value) -> Response<Body> {
    let mut res = Response::new(body::full(Bytes::from(value.to_string())));
    *res.status_mut() = status;
    res.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    res
}

/// The status page (`GET /_fence/ui`): a static shell, compiled in, holding
/// no data; its script reads the listing, the metrics and readiness with
/// the caller's secret, so it shows what that caller may read.
const STATUS_PAGE: &str = include_str!("ui/status.html");

/// The status page's policy: its own inline script and style only (by their
/// digests), requests to its own origin only, no framing.
static STATUS_PAGE_POLICY: std::sync::LazyLock<HeaderValue> = std::sync::LazyLock::new(|| {
    let digest = |open: &str, close: &str| {
        let inline = STATUS_PAGE
            .split_once(open)
            .and_then(|(_, rest)| rest.split_once(close))
            .map_or("", |(inline, _)| inline);
        base64::engine::general_purpose::STANDARD.encode(Sha256::digest(inline.as_bytes()))
    };
    let policy = format!(
        "default-src 'none'; script-src 'sha256-{}'; style-src 'sha256-{}'; \
         connect-src 'self'; form-action 'none'; frame-ancestors 'none'; base-uri 'none'",
        digest("<script>", "</script>"),
        digest("<style>", "</style>"),
    );
    // Digests in base64 and fixed text: always a valid header value.
    HeaderValue::from_str(&policy)
        .unwrap_or_else(|_| HeaderValue::from_static("default-src 'none'"))
});

fn status_page() -> Response<Body> {
    let mut res = Response::new(body::full(Bytes::from_static(STATUS_PAGE.as_bytes())));
    let h = res.headers_mut();
    h.insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/html; charset=utf-8"),
    );
    h.insert(
        http::header::CONTENT_SECURITY_POLICY,
        STATUS_PAGE_POLICY.clone(),
    );
    h.insert(
        http::header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        http::header::CACHE_CONTROL,
        HeaderValue::from_static("no-store"),
    );
    res
}

/// Leases per page of `GET /_fence/leases` unless `?limit=` says.
pub const PAGE_DEFAULT: usize = 1000;

/// The most leases one page holds.
pub const PAGE_MAX: usize = 10_000;

/// The query of a listing.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Page {
    pub(crate) limit: usize,
    after: Option<String>,
    /// Only names that start with this.
    prefix: String,
}

impl Page {
    pub(crate) fn parse(query: Option<&str>) -> Result<Self, Problem> {
        let mut page = Page {
            limit: PAGE_DEFAULT,
            after: None,
            prefix: String::new(),
        };
        for pair in query
            .unwrap_or_default()
            .split('&')
            .filter(|p| !p.is_empty())
        {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            let value = percent_encoding::percent_decode_str(&value.replace('+', " "))
                .decode_utf8()
                .map_err(|_| {
                    Problem::invalid_request(format!("query parameter {key:?} is not UTF-8"))
                })?
                .into_owned();
            match key {
                "limit" => {
                    page.limit = value
                        .parse()
                        .ok()
                        .filter(|n| (1..=PAGE_MAX).contains(n))
                        .ok_or_else(|| {
                            Problem::invalid_request(format!(
                                "limit must be a whole number from 1 to {PAGE_MAX}"
                            ))
                        })?;
                }
                "after" => page.after = Some(value),
                "prefix" => page.prefix = value,
                _ => {
                    return Err(Problem::invalid_request(format!(
                        "unknown query parameter {key:?} (this call takes limit, after and prefix)"
                    )))
                }
            }
        }
        Ok(page)
    }
}

fn view_json(name: &str, v: &View) -> serde_json::Value {
    json!({
        "lease": name,
        "state": v.state.as_str(),
        "holder": v.holder,
        "token": v.token,
        "expires_in_ms": v.expires_in_ms,
        "transitions": v.transitions,
    })
}

/// The body of a grant or renewal. Fields in alphabetical order, as the
/// `json!` documents elsewhere come out, so every answer reads alike.
#[derive(Serialize)]
struct GrantBody<'a> {
    expires_in_ms: u64,
    holder: &'a str,
    lease: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    lease_id: Option<&'a str>,
    token: u64,
    ttl_ms: u64,
}

impl<'a> GrantBody<'a> {
    /// What `granted` answers for `name`; the lease id only for an acquire.
    fn of(name: &'a str, granted: &'a Acquired, acquire: bool) -> Self {
        Self {
            expires_in_ms: granted.expires_in_ms,
            holder: &granted.holder,
            lease: name,
            lease_id: acquire.then(|| granted.lease_id.expose()),
            token: granted.token,
            ttl_ms: granted.ttl_ms,
        }
    }
}

fn grant_response(name: &str, granted: &Acquired, acquire: bool) -> Response<Body> {
    // Renewals are the most frequent call: a struct serialises without
    // building a map first.
    let body = GrantBody::of(name, granted, acquire);
    let status = if acquire {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    let bytes = serde_json::to_vec(&body).expect("a struct of strings and numbers serialises");
    let mut res = Response::new(body::full(Bytes::from(bytes)));
    *res.status_mut() = status;
    res.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    res.headers_mut()
        .insert(FENCING_TOKEN, HeaderValue::from(granted.token));
    if acquire {
        if let Ok(id) = HeaderValue::from_str(granted.lease_id.expose()) {
            res.headers_mut().insert(FENCING_LEASE_ID, id);
        }
    }
    res
}

/// The methods an endpoint (its path segments after `/_fence/`) takes, for
/// the `Allow` header of a 405; `None` for no endpoint.
fn allowed_methods(endpoint: &[&str]) -> Option<&'static str> {
    Some(match endpoint {
        ["leases"] | ["metrics"] | ["backend", "history"] => "GET",
        ["leases", _] => "GET, POST, DELETE",
        ["leases", _, "renew"] | ["renew"] => "POST",
        ["livez"] | ["readyz"] | ["ui"] => "GET, HEAD",
        ["clock"] => "GET, POST",
        _ => return None,
    })
}

/// The answer of the admin listener outside its endpoints.
pub fn admin_listener_only() -> Problem {
    Problem::new(
        Reason::NotFound,
        "the admin listener serves only health, metrics, clock and the apply log",
    )
}

impl Api {
    pub fn new(
        leases: LeaseStore,
        require_lease_id: bool,
        draining: Arc<AtomicBool>,
        metrics: Metrics,
    ) -> Self {
        Self {
            leases,
            require_lease_id,
            draining,
            history: None,
            metrics,
            surface: Surface::All,
            body_read_timeout: Duration::from_millis(10_000),
            upstream: None,
        }
    }

    /// Makes readiness reflect `upstream`: 502 once it has failed
    /// `proxy.unready_after_failures` times in a row and cannot be
    /// connected to (see [`Upstream::readiness`]).
    pub fn with_upstream(mut self, upstream: Upstream) -> Self {
        self.upstream = Some(upstream);
        self
    }

    /// Gives clients `timeout` to send a request body the API reads.
    pub fn with_body_read_timeout(mut self, timeout: Duration) -> Self {
        self.body_read_timeout = timeout;
        self
    }

    /// The same API restricted to the endpoints of one listener.
    pub fn with_surface(mut self, surface: Surface) -> Self {
        self.surface = surface;
        self
    }

    /// Counts a lease operation by its result.
    fn count(&self, op: &'static str, result: &Result<Response<Body>, Problem>) {
        let outcome = match result {
            Ok(_) => "ok",
            Err(p) => p.reason().slug(),
        };
        self.metrics.lease_op(op, outcome);
    }

    /// Serves the embedded backend's apply log at `/_fence/backend/history`.
    pub fn with_history(mut self, store: EmbeddedStore) -> Self {
        self.history = Some(store);
        self
    }

    /// Answers a request whose path starts with [`PREFIX`].
    pub async fn handle(&self, req: Request<Body>) -> Response<Body> {
        match self.route(req).await {
            Ok(res) => res,
            Err(problem) => problem.into_response(),
        }
    }

    async fn route(&self, req: Request<Body>) -> Result<Response<Body>, Problem> {
        let path = req.uri().path().to_owned();
        let segments = decode_path(&path).map_err(|bad| Problem::invalid_request(bad.0))?;
        let segments: SmallVec<[&str; 8]> = segments.iter().map(|s| s.as_ref()).collect();
        let method = req.method().clone();
        let who = caller(&req).cloned();
        let endpoint = segments.get(1).copied();
        let admin_only = matches!(endpoint, Some("clock" | "metrics" | "backend"));
        // The status page is served where the metrics are; it reads the
        // listing, so the admin listener answers the listing too.
        let admin_surface = admin_only || endpoint == Some("ui");
        let health = matches!(endpoint, Some("livez" | "readyz"));
        let listing = segments.len() == 2 && endpoint == Some("leases") && method == Method::GET;
        match self.surface {
            Surface::Data if admin_surface => {
                return Err(Problem::new(
                    Reason::NotFound,
                    "this endpoint is served on the admin listener",
                ))
            }
            Surface::Admin if !admin_surface && !health && !listing => {
                return Err(admin_listener_only())
            }
            _ => {}
        }
        // The admin listener is plain HTTP and meant for operators: there
        // the listing is theirs too.
        let admin_listing = listing && self.surface == Surface::Admin;
        if (admin_only || admin_listing) && who.as_ref().is_some_and(|c| !c.admin) {
            return Err(Problem::forbidden(
                "this endpoint needs an admin credential",
            ));
        }
        let who = who.as_deref();
        match (segments.get(1..).unwrap_or_default(), method) {
            (["leases"], Method::GET) => self.list(req.uri().query(), who).await,
            (["leases", name], Method::POST) => {
                let result = self.acquire(name, req).await;
                self.count("acquire", &result);
                result
            }
            (["leases", name], Method::GET) => self.inspect(name, who),
            (["leases", name], Method::DELETE) => {
                let result = self.release(name, req).await;
                self.count("release", &result);
                result
            }
            (["leases", name, "renew"], Method::POST) => {
                let result = self.renew(name, req).await;
                self.count("renew", &result);
                result
            }
            (["renew"], Method::POST) => self.renew_batch(req).await,
            (["livez"], Method::GET | Method::HEAD) => {
                Ok(json_response(StatusCode::OK, &json!({"status": "live"})))
            }
            (["readyz"], Method::GET | Method::HEAD) => Ok(self.readyz().await),
            (["ui"], Method::GET | Method::HEAD) => Ok(status_page()),
            (["metrics"], Method::GET) => Ok(self.metrics()),
            (["backend", "history"], Method::GET) => match &self.history {
                Some(store) => Ok(store.history_response(req.uri().query())),
                None => Err(Problem::new(
                    Reason::NotFound,
                    "the backend is not a recording embedded store",
                )),
            },
            (["clock"], Method::GET) => self.clock(None),
            (["clock"], Method::POST) => {
                let body: AdvanceBody = read_json(req.into_body(), false, self.body_read_timeout)
                    .await?
                    .expect("required body");
                self.clock(Some(body.advance_ms))
            }
            (endpoint, _) => match allowed_methods(endpoint) {
                Some(allow) => Err(Problem::method_not_allowed(allow)),
                None => Err(Problem::not_found()),
            },
        }
    }

    fn name(&self, name: &str) -> Result<LeaseName, Problem> {
        LeaseName::new(name).map_err(|_| Problem::invalid_lease_name(name))
    }

    async fn acquire(&self, name: &str, req: Request<Body>) -> Result<Response<Body>, Problem> {
        let lease = self.name(name)?;
        let name = lease.as_str();
        let caller = caller(&req).cloned();
        let client_ip = RequestContext::of(&req)
            .and_then(|c| c.client.as_ref())
            .map(ClientAddr::ip);
        let body: AcquireBody = read_json(req.into_body(), false, self.body_read_timeout)
            .await?
            .expect("required body");
        // With authentication on, the caller is the holder.
        let holder = match (&caller, body.holder) {
            (Some(c), Some(h)) if h != c.name.as_str() => {
                return Err(Problem::forbidden(
                    "the holder must be the authenticated caller",
                ))
            }
            (Some(c), _) => Ok(c.name.clone()),
            (None, Some(h)) => Err(h),
            (None, None) => return Err(Problem::invalid_request("the body needs a holder")),
        };
        // The TTL is checked before the holder's name, as the store does.
        let ttl_ms = ttl_from_json(&body.ttl_ms, &self.leases)?;
        let holder = holder
            .or_else(|h| Holder::new(&h).map_err(|e| Problem::invalid_request(e.to_string())))?;
        // The acquire rate is the caller's, or the client address's: never
        // keyed on a name the client picks.
        let requester = match (&caller, client_ip) {
            (Some(c), _) => Requester::Caller(c.name.as_str()),
            (None, Some(ip)) => Requester::Address(ip),
            (None, None) => Requester::Holder(holder.as_str()),
        };
        let granted = self
            .leases
            .acquire_from(
                requester,
                &lease,
                &holder,
                ttl_ms,
                body.wait_ms.unwrap_or(0),
            )
            .await
            .map_err(|e| {
                let problem = Problem::acquire_failed(name, e);
                // Not a rate-limited one: the limiter bounds the log too.
                if problem.reason() != Reason::RateLimited {
                    tracing::info!(
                        target: "audit",
                        lease = name,
                        holder = holder.as_str(),
                        reason = problem.reason().slug(),
                        "acquire refused"
                    );
                }
                visible_to(problem, &self.leases, name, caller.as_deref())
            })?;
        Ok(grant_response(name, &granted, true))
    }

    async fn renew(&self, name: &str, req: Request<Body>) -> Result<Response<Body>, Problem> {
        let name = self.name(name)?;
        let name = name.as_str();
        let caller = caller(&req).cloned();
        let (parts, body) = req.into_parts();
        let (token, lease_id) =
            credentials(&parts.headers, self.require_lease_id).map_err(|p| p.lease(name))?;
        let body: RenewBody = read_json(body, true, self.body_read_timeout)
            .await?
            .unwrap_or_default();
        let ttl_ms = body
            .ttl_ms
            .as_ref()
            .map(|v| ttl_from_json(v, &self.leases))
            .transpose()?;
        let renewed = self.renew_lease(name, token, lease_id, caller.as_deref(), ttl_ms)?;
        Ok(grant_response(name, &renewed, false))
    }

    /// Renews term `token` of `name` for `caller`: the renewal, or the
    /// problem answered for it (shown as the caller may see it).
    fn renew_lease(
        &self,
        name: &str,
        token: u64,
        lease_id: Option<&[u8]>,
        caller: Option<&Identity>,
        ttl_ms: Option<u64>,
    ) -> Result<Acquired, Problem> {
        let renewed = self
            .leases
            .renew(
                name,
                token,
                lease_id,
                caller.map(|c| c.name.as_str()),
                ttl_ms,
            )
            .map_err(|e| {
                let problem = Problem::renew_failed(name, e);
                visible_to(problem, &self.leases, name, caller)
            })?;
        tracing::debug!(
            target: "audit",
            lease = name,
            token,
            ttl_ms = renewed.ttl_ms,
            "lease renewed"
        );
        Ok(renewed)
    }

    /// Renews many leases in one request: `{"leases": [{"lease", "token",
    /// "lease_id", "ttl_ms"?}], "ttl_ms"?}`. The answer is 200 with one
    /// result per lease, in order: the renewal (`status` 200, as `POST
    /// /_fence/leases/{name}/renew` answers it) or the problem that lease's
    /// renewal alone would have been answered with. A body that is not such
    /// a list fails as a whole.
    async fn renew_batch(&self, req: Request<Body>) -> Result<Response<Body>, Problem> {
        let caller = caller(&req).cloned();
        let body: BatchRenewBody = read_json_up_to(
            req.into_body(),
            false,
            self.body_read_timeout,
            MAX_BATCH_BODY_BYTES,
        )
        .await?
        .expect("a required body");
        if body.leases.len() > MAX_BATCH_LEASES {
            return Err(Problem::invalid_request(format!(
                "a batch renewal names at most {MAX_BATCH_LEASES} leases"
            )));
        }
        let results: Vec<serde_json::Value> = body
            .leases
            .iter()
            .map(|item| {
                let result = self.renew_one(item, body.ttl_ms.as_ref(), caller.as_deref());
                self.metrics.lease_op(
                    "renew",
                    result.as_ref().map_or_else(|p| p.reason().slug(), |_| "ok"),
                );
                result.unwrap_or_else(|p| p.to_json())
            })
            .collect();
        Ok(json_response(
            StatusCode::OK,
            &json!({ "results": results }),
        ))
    }

    /// One lease of a batch renewal, checked as a renewal of its own is.
    fn renew_one(
        &self,
        item: &BatchRenewItem,
        ttl_ms: Option<&serde_json::Value>,
        caller: Option<&Identity>,
    ) -> Result<serde_json::Value, Problem> {
        let name = self.name(&item.lease)?;
        let name = name.as_str();
        if self.require_lease_id && item.lease_id.is_none() {
            return Err(Problem::missing_lease_id().lease(name));
        }
        let ttl_ms = item
            .ttl_ms
            .as_ref()
            .or(ttl_ms)
            .map(|v| ttl_from_json(v, &self.leases))
            .transpose()
            .map_err(|p| p.lease(name))?;
        let lease_id = item.lease_id.as_deref().map(str::as_bytes);
        let renewed = self.renew_lease(name, item.token, lease_id, caller, ttl_ms)?;
        let mut result = serde_json::to_value(GrantBody::of(name, &renewed, false))
            .expect("a struct of strings and numbers serialises");
        result["status"] = json!(200);
        Ok(result)
    }

    async fn release(&self, name: &str, req: Request<Body>) -> Result<Response<Body>, Problem> {
        let name = self.name(name)?;
        let name = name.as_str();
        let (token, persisted) = {
            let (token, lease_id) =
                credentials(req.headers(), self.require_lease_id).map_err(|p| p.lease(name))?;
            let caller = caller(&req);
            let persisted = self
                .leases
                .release(name, token, lease_id, caller.map(|c| c.name.as_str()))
                .map_err(|r| {
                    let problem = Problem::rejected(name, r);
                    visible_to(problem, &self.leases, name, caller.map(|c| &**c))
                })?;
            (token, persisted)
        };
        drop(req);
        // 204 only once the release is durable: a term answered as released
        // never comes back after a crash or a power cut.
        if let Err(err) = persisted.await {
            tracing::warn!(target: "audit", lease = name, token, error = %err, "release not persisted");
            return Err(Problem::store_unavailable(
                "the release could not be made durable: the term has ended here, but after a \
                 restart it may be held again until its TTL ends",
            )
            .lease(name));
        }
        tracing::info!(target: "audit", lease = name, token, "lease released");
        let mut res = Response::new(body::empty());
        *res.status_mut() = StatusCode::NO_CONTENT;
        Ok(res)
    }

    fn inspect(&self, name: &str, caller: Option<&Identity>) -> Result<Response<Body>, Problem> {
        let name = self.name(name)?;
        let name = name.as_str();
        let view = self
            .leases
            .inspect(name)
            .ok_or_else(|| Problem::unknown_lease(name))?;
        if let Some(c) = caller.filter(|c| !c.admin) {
            if view.holder != c.name.as_str() {
                return Err(Problem::forbidden("this lease is held by another caller").lease(name));
            }
        }
        Ok(json_response(StatusCode::OK, &view_json(name, &view)))
    }

    /// One page of the leases, in name order: `?limit=` (default
    /// [`PAGE_DEFAULT`], at most [`PAGE_MAX`]) after `?after=`, only names
    /// starting with `?prefix=`; `next` is the `after` of the following
    /// page, `null` on the last one.
    async fn list(
        &self,
        query: Option<&str>,
        caller: Option<&Identity>,
    ) -> Result<Response<Body>, Problem> {
        let page = Page::parse(query)?;
        // Callers who are not admins see their own leases only, from the
        // holder index (and the cursor is one of them).
        let own = caller.filter(|c| !c.admin).map(|c| c.name.as_str());
        if own.is_some() && !self.leases.has_holder_index() {
            // The first such page builds the index, a pass over every
            // lease: off the async workers, so renewals go on meanwhile.
            let leases = self.leases.clone();
            let _ = tokio::task::spawn_blocking(move || leases.build_holder_index()).await;
        }
        let (leases, next) = self
            .leases
            .page(own, &page.prefix, page.after.as_deref(), page.limit);
        let leases: Vec<serde_json::Value> = leases
            .iter()
            .map(|(name, view)| view_json(name, view))
            .collect();
        Ok(json_response(
            StatusCode::OK,
            &json!({ "leases": leases, "next": next }),
        ))
    }

    async fn readyz(&self) -> Response<Body> {
        if self.draining.load(Ordering::Acquire) {
            return Problem::new(Reason::Draining, "fencegate is shutting down").into_response();
        }
        if !self.leases.is_ready() {
            return Problem::store_unavailable("the lease store cannot persist grants")
                .into_response();
        }
        if let Some(upstream) = &self.upstream {
            if let Err(why) = upstream.readiness().await {
                return Problem::new(Reason::UpstreamError, why.to_string()).into_response();
            }
        }
        json_response(StatusCode::OK, &json!({"status": "ready"}))
    }

    fn metrics(&self) -> Response<Body> {
        let mut res = Response::new(body::full(self.metrics.render()));
        res.headers_mut().insert(
            CONTENT_TYPE,
            HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
        );
        res
    }

    fn clock(&self, advance_ms: Option<u64>) -> Result<Response<Body>, Problem> {
        let clock = self.leases.clock();
        if clock.kind() != ClockKind::Manual {
            return Err(Problem::new(
                Reason::NotFound,
                "the clock endpoint exists only with --clock manual",
            ));
        }
        let now_ms = match advance_ms {
            Some(ms) => {
                let now_ms = clock.advance(ms).unwrap_or_else(|| clock.now_ms());
                tracing::info!(advance_ms = ms, now_ms, "manual clock advanced");
                now_ms
            }
            None => clock.now_ms(),
        };
        Ok(json_response(StatusCode::OK, &json!({ "now_ms": now_ms })))
    }
}
