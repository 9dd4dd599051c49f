//! Composes fencegate into one [`tower::Service`], testable without sockets.
//!
//! A request flows, top to bottom:
//! 1. request id: the client's `X-Request-Id` if sane, else a new one; it is
//!    echoed on the response and passed to the backend;
//! 2. limits: the request head (431) and the declared body length (413) are
//!    checked first, and the body is wrapped so a longer stream fails too;
//! 3. `/_fence/…` goes to the lease API; everything else to the data path,
//!    which for `fencegate serve` is the fence in front of the backend.
//!
//! Limits come before routing so no part of fencegate ever reads an oversized
//! request; the fence comes before the backend so a rejected write never
//! reaches the storage.

use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderName, HeaderValue, CONTENT_LENGTH, TRANSFER_ENCODING};
use http::{HeaderMap, Request, Response};
use http_body_util::Limited;
use tower::{Layer, Service};
use tracing::Instrument;

use crate::api::{admin_listener_only, Api, Surface, PREFIX};
use crate::auth::{Authenticator, Caller};
use crate::backend::{Backend, RequestContext, Unstaged};
use crate::body::{self, Body, BoxError, ResponseFuture};
use crate::body_routes::BodyLimits;
use crate::config::{Config, ConfigError};
use crate::error::Problem;
use crate::fence::{Fence, FenceLayer, FencePolicy};
use crate::lease::{LeaseStore, Primacy};
use crate::metrics::Metrics;
use crate::precondition::KeyStateTable;

pub use crate::wire::X_REQUEST_ID;

const REQUEST_ID_NAME: HeaderName = HeaderName::from_static(X_REQUEST_ID);

/// Per-request limits applied before anything else runs.
#[derive(Clone, Copy, Debug)]
pub struct RequestLimits {
    /// Largest request body, in bytes.
    pub max_body_bytes: u64,
    /// Largest request head (target plus all header lines), in bytes.
    pub max_header_bytes: usize,
}

impl RequestLimits {
    /// The limits `config` sets.
    pub fn from_config(config: &Config) -> Self {
        Self {
            max_body_bytes: config.limits.max_body_bytes,
            max_header_bytes: config.limits.max_header_bytes,
        }
    }
}

/// Makes request ids: a random per-process prefix and a counter, so ids are
/// unique without a syscall per request.
#[derive(Debug)]
pub(crate) struct RequestIds {
    prefix: u64,
    next: AtomicU64,
}

impl RequestIds {
    pub(crate) fn new() -> Self {
        let mut raw = [0u8; 8];
        // A predictable prefix only makes ids less unique across processes.
        let _ = getrandom::fill(&mut raw);
        Self {
            prefix: u64::from_le_bytes(raw),
            next: AtomicU64::new(1),
        }
    }

    /// `{prefix:016x}-{n:x}`, without the formatting machinery.
    pub(crate) fn make(&self) -> HeaderValue {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let mut buf = [0u8; 33];
        for (i, b) in buf[..16].iter_mut().enumerate() {
            *b = HEX[(self.prefix >> (60 - 4 * i) & 0xf) as usize];
        }
        buf[16] = b'-';
        let digits = (16 - (n.leading_zeros() / 4) as usize).max(1);
        for i in 0..digits {
            buf[17 + i] = HEX[(n >> (4 * (digits - 1 - i)) & 0xf) as usize];
        }
        HeaderValue::from_bytes(&buf[..17 + digits])
            .expect("hex and '-' are valid header characters")
    }
}

/// A client's request id is kept if it is 1-128 visible ASCII characters.
pub(crate) fn is_sane_request_id(v: &HeaderValue) -> bool {
    let b = v.as_bytes();
    (1..=128).contains(&b.len()) && b.iter().all(|c| (0x21..=0x7e).contains(c))
}

fn head_size<B>(req: &Request<B>) -> usize {
    let headers: usize = req
        .headers()
        .iter()
        .map(|(k, v)| k.as_str().len() + v.len() + 4)
        .sum();
    let uri = req.uri();
    headers
        + uri.path_and_query().map_or(1, |pq| pq.as_str().len())
        + uri.authority().map_or(0, |a| a.as_str().len())
        + uri.scheme_str().map_or(0, |s| s.len() + 3)
}

/// Refuses message framing that some server would read differently: a
/// `Content-Length` beside `Transfer-Encoding` (hyper drops the length:
/// [`crate::framing`]'s guard saw it, `conflict`), and a doubled
/// `chunked`. Such requests are never repaired and forwarded, since a
/// backend might frame them another way (request smuggling). Conflicting
/// lengths, bad chunking, NUL and obs-fold never get this far: hyper's
/// parser rejects them with a bare 400.
fn check_framing(headers: &HeaderMap, conflict: bool) -> Result<(), Problem> {
    if conflict {
        return Err(Problem::invalid_request(
            "a request may not carry both Content-Length and Transfer-Encoding",
        ));
    }
    let mut codings = headers.get_all(TRANSFER_ENCODING).iter();
    let Some(first) = codings.next() else {
        return Ok(());
    };
    if headers.contains_key(CONTENT_LENGTH) {
        return Err(Problem::invalid_request(
            "a request may not carry both Content-Length and Transfer-Encoding",
        ));
    }
    if codings.next().is_some()
        || !first
            .as_bytes()
            .trim_ascii()
            .eq_ignore_ascii_case(b"chunked")
    {
        return Err(Problem::invalid_request(
            "the only transfer coding accepted is a single \"chunked\"",
        ));
    }
    Ok(())
}

/// The checks of a request's head made before any part of fencegate acts
/// on it: its size, and framing some server would read differently.
pub(crate) fn check_head<B>(req: &Request<B>, limits: &RequestLimits) -> Result<(), Problem> {
    if head_size(req) > limits.max_header_bytes {
        return Err(Problem::headers_too_large(limits.max_header_bytes));
    }
    // Where the body ends is in doubt: the connection is not reused (as
    // hyper itself closes after a length beside a coding).
    let conflict = RequestContext::of(req).is_some_and(|c| c.framing_conflict);
    check_framing(req.headers(), conflict).map_err(Problem::closing_connection)
}

fn declared_length(headers: &HeaderMap) -> Option<u64> {
    headers
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
}

/// The whole of fencegate (or of the standalone backend) as one service.
pub struct App<S> {
    api: Option<Arc<Api>>,
    data: S,
    limits: RequestLimits,
    ids: Arc<RequestIds>,
    auth: Option<Arc<Authenticator>>,
}

impl<S: Clone> Clone for App<S> {
    fn clone(&self) -> Self {
        Self {
            api: self.api.clone(),
            data: self.data.clone(),
            limits: self.limits,
            ids: self.ids.clone(),
            auth: self.auth.clone(),
        }
    }
}

/// The service `fencegate serve` runs.
pub type FencegateApp = App<Fence<Backend>>;

/// Everything [`build`] needs besides the config.
pub struct Parts {
    pub leases: LeaseStore,
    pub backend: Backend,
    /// Set when shutdown begins; turns `/_fence/readyz` to 503.
    pub draining: Arc<AtomicBool>,
    /// In cluster mode, this member's term of primacy (see
    /// [`FencePolicy::primacy`]); `None` standalone.
    pub primacy: Option<Arc<Primacy>>,
    /// Metrics shared with other apps (a cluster member's shards); `None`:
    /// the app's own, over `leases`.
    pub metrics: Option<Metrics>,
    /// The key states of routes with preconditions, kept by a cluster
    /// member for a shard across its terms of primacy (each starts with
    /// [`KeyStateTable::take_over`]); `None`: the app's own, empty.
    pub key_states: Option<Arc<KeyStateTable>>,
}

/// Composes `fencegate serve`: limits → (lease API | fence → backend).
pub fn build(config: &Config, parts: Parts) -> Result<FencegateApp, ConfigError> {
    let recording = match &parts.backend {
        Backend::Embedded(store) if store.is_recording() => Some(store.clone()),
        _ => None,
    };
    let metrics = parts.metrics.unwrap_or_else(|| Metrics::new(&parts.leases));
    let mut backend = parts.backend;
    let mut upstream = None;
    if let Backend::Upstream(u) = &mut backend {
        u.set_metrics(metrics.clone());
        upstream = Some(u.clone());
    }
    let mut app = compose(
        config,
        parts.leases,
        parts.draining,
        (backend, parts.primacy),
        metrics,
        parts.key_states,
    )?;
    if let Some(store) = recording {
        app.api = app
            .api
            .take()
            .map(|api| Arc::new(Arc::unwrap_or_clone(api).with_history(store)));
    }
    if let Some(upstream) = upstream {
        app.api = app
            .api
            .take()
            .map(|api| Arc::new(Arc::unwrap_or_clone(api).with_upstream(upstream)));
    }
    Ok(app)
}

/// [`build`] with any backend service, which gets each admitted write in
/// one step (tests put instrumented backends here).
pub fn build_with<S>(
    config: &Config,
    leases: LeaseStore,
    draining: Arc<AtomicBool>,
    backend: S,
) -> Result<App<Fence<Unstaged<S>>>, ConfigError> {
    build_exchange(config, leases, draining, Unstaged(backend))
}

/// [`build`] with any backend that takes admitted writes in the two steps
/// of an [`crate::backend::Exchange`] (tests that need a step's outcome,
/// such as an unknown one, put theirs here).
pub fn build_exchange<S>(
    config: &Config,
    leases: LeaseStore,
    draining: Arc<AtomicBool>,
    backend: S,
) -> Result<App<Fence<S>>, ConfigError> {
    let metrics = Metrics::new(&leases);
    compose(config, leases, draining, (backend, None), metrics, None)
}

/// The fence (with this member's primacy in cluster mode) around
/// `backend`, and the API beside it.
fn compose<S>(
    config: &Config,
    leases: LeaseStore,
    draining: Arc<AtomicBool>,
    (backend, primacy): (S, Option<Arc<Primacy>>),
    metrics: Metrics,
    key_states: Option<Arc<KeyStateTable>>,
) -> Result<App<Fence<S>>, ConfigError> {
    let body_limits = BodyLimits {
        max_bytes: usize::try_from(config.limits.max_body_bytes).unwrap_or(usize::MAX),
        idle: Duration::from_millis(config.limits.body_read_timeout_ms),
    };
    let policy = FencePolicy {
        metrics: metrics.clone(),
        routes: config.fence.compile_routes()?,
        leases: leases.clone(),
        require_lease_id: config.fence.require_lease_id,
        allow_unrouted_writes: config.fence.allow_unrouted_writes,
        admit: config.admit_options(),
        upstream_timeout_ms: config.proxy.timeout_ms,
        primacy,
        key_states: key_states
            .unwrap_or_else(|| Arc::new(KeyStateTable::new(config.fence.precondition_keys))),
        hosts: config.hosts()?,
        etcd: config
            .fence
            .compile_key_routes()?
            .map(|routes| (routes, body_limits)),
        dynamodb: config
            .fence
            .compile_dynamodb_routes()?
            .map(|routes| (routes, body_limits)),
    };
    let data = FenceLayer::new(policy).layer(backend);
    let api = Api::new(leases, config.fence.require_lease_id, draining, metrics)
        .with_body_read_timeout(Duration::from_millis(config.limits.body_read_timeout_ms));
    let auth = Authenticator::from_config(&config.auth)?;
    Ok(App::new(Some(api), data, RequestLimits::from_config(config)).with_auth(auth))
}

impl<S> App<S> {
    /// An app with an optional lease API in front of `data`.
    pub fn new(api: Option<Api>, data: S, limits: RequestLimits) -> Self {
        Self {
            api: api.map(Arc::new),
            data,
            limits,
            ids: Arc::new(RequestIds::new()),
            auth: None,
        }
    }

    /// Requires a known bearer token on every request but the health checks.
    pub fn with_auth(mut self, auth: Option<Authenticator>) -> Self {
        self.auth = auth.map(Arc::new);
        self
    }

    /// Splits off the app of a separate admin listener (health, metrics,
    /// clock, apply log, the status page and the listing it reads); this
    /// app stops serving those but health and the listing.
    pub fn split_admin(&mut self) -> AdminApp {
        let api = self.api.take().map(Arc::unwrap_or_clone);
        self.api = api.clone().map(|a| Arc::new(a.with_surface(Surface::Data)));
        App {
            api: api.map(|a| Arc::new(a.with_surface(Surface::Admin))),
            data: NoData,
            limits: self.limits,
            ids: self.ids.clone(),
            auth: self.auth.clone(),
        }
    }
}

/// The admin listener's app.
pub type AdminApp = App<NoData>;

/// The data path of the admin listener: nothing is proxied there.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoData;

impl Service<Request<Body>> for NoData {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = std::future::Ready<Result<Response<Body>, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: Request<Body>) -> Self::Future {
        std::future::ready(Ok(admin_listener_only().into_response()))
    }
}

fn with_request_id(mut res: Response<Body>, id: HeaderValue) -> Response<Body> {
    res.headers_mut().insert(REQUEST_ID_NAME, id);
    res
}

impl<S, B> Service<Request<B>> for App<S>
where
    S: Service<Request<Body>, Response = Response<Body>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = ResponseFuture;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.data.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let request_id = req
            .headers()
            .get(&REQUEST_ID_NAME)
            .filter(|v| is_sane_request_id(v))
            .cloned()
            .unwrap_or_else(|| self.ids.make());
        let span = tracing::debug_span!("request", id = ?request_id, method = %req.method(), path = %req.uri().path());
        // Everything generic over the body happens here, synchronously; the
        // futures below are boxed and concrete.
        let to_api = self.api.is_some() && req.uri().path().starts_with(PREFIX);
        let mut req = req;
        if let Some(auth) = &self.auth {
            // The health checks, and the status page's shell (it holds no
            // data; its script sends the caller's secret with every read).
            let health = matches!(
                req.uri().path(),
                "/_fence/livez" | "/_fence/readyz" | "/_fence/ui"
            );
            match auth.authenticate(req.headers()) {
                Some(identity) => {
                    RequestContext::of_mut(&mut req).caller = Some(Caller(identity));
                }
                None if health => {}
                None => {
                    let res = Problem::unauthorized().into_response();
                    return Box::pin(std::future::ready(Ok(with_request_id(res, request_id))));
                }
            }
        }
        let response: ResponseFuture = match self.limit(req, !to_api) {
            Err(problem) => Box::pin(std::future::ready(Ok(problem.into_response()))),
            Ok(mut req) => {
                req.headers_mut()
                    .insert(REQUEST_ID_NAME, request_id.clone());
                match &self.api {
                    Some(api) if to_api => {
                        let api = api.clone();
                        Box::pin(async move { Ok(api.handle(req).await) })
                    }
                    _ => {
                        // The standard tower dance: call the instance that was
                        // polled ready, keep a fresh clone for the next call.
                        let fresh = self.data.clone();
                        let mut ready = std::mem::replace(&mut self.data, fresh);
                        Box::pin(ready.call(req))
                    }
                }
            }
        };
        Box::pin(
            async move {
                let mut res = response.await?;
                res.headers_mut().insert(REQUEST_ID_NAME, request_id);
                Ok(res)
            }
            .instrument(span),
        )
    }
}

impl<S> App<S> {
    /// Applies the head limit and, for proxied requests, the body limit; the
    /// body comes back boxed (and capped). The lease API caps its own bodies.
    fn limit<B>(&self, req: Request<B>, limit_body: bool) -> Result<Request<Body>, Problem>
    where
        B: http_body::Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        check_head(&req, &self.limits)?;
        if !limit_body {
            return Ok(req.map(body::boxed));
        }
        if declared_length(req.headers()).is_some_and(|n| n > self.limits.max_body_bytes) {
            return Err(Problem::payload_too_large(self.limits.max_body_bytes));
        }
        let limit = usize::try_from(self.limits.max_body_bytes).unwrap_or(usize::MAX);
        Ok(req.map(|b| body::boxed(Limited::new(body::from_client(b), limit))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_ids() {
        let ids = RequestIds::new();
        assert_ne!(ids.make(), ids.make());
        for n in [0u64, 1, 15, 16, 255, 0xdead_beef, u64::MAX] {
            ids.next.store(n, Ordering::Relaxed);
            let expected = format!("{:016x}-{n:x}", ids.prefix);
            assert_eq!(ids.make().to_str().unwrap(), expected);
        }
        assert!(is_sane_request_id(&HeaderValue::from_static("abc-123")));
        assert!(!is_sane_request_id(&HeaderValue::from_static("")));
        assert!(!is_sane_request_id(&HeaderValue::from_static("a b")));
        assert!(!is_sane_request_id(
            &HeaderValue::from_str(&"x".repeat(129)).unwrap()
        ));
    }
}
