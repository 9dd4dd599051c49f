//! The HTTP upstream: forwards admitted requests to an existing server, over
//! `http://` or `https://` (rustls: the system's CA certificates plus
//! `proxy.upstream_ca_file`, SNI from the upstream's host; a certificate
//! that cannot be verified fails the connection, never a silent downgrade).
//!
//! Two ways to reach it ([`ConnectionMode`]), both driven by the lean
//! HTTP/1.1 client of `h1.rs` (no connection task of their own): one
//! dedicated upstream connection per client connection, opened on its first
//! request and closed with it (HTTP/1.1 answers a connection's requests in
//! order, so it is always free when the next request of its client
//! arrives, with no pool's bookkeeping: see `benches/proxy.rs` and
//! `benches/versus-nginx.sh`); or a pool (`pool.rs`) whose connections the
//! connections of one client share, bounded, idle ones closed after a
//! while. Requests that come without a client connection (in-process
//! tests) use the pool.
//!
//! On either, a connection that was idle is used again only within
//! `pool_idle_timeout_ms` and only if the storage has neither closed it nor
//! sent anything on it since; if it fails as the request goes out anyway
//! (the storage closed it at that moment), the request goes once more on a
//! fresh connection when that is safe: when not a byte of it left, or, for a
//! `GET` or `HEAD` with no body, when not a byte of the answer came (the
//! storage's application never had it; nginx retries the same way).

use std::borrow::Cow;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll};
use std::time::Duration;

use std::net::SocketAddr;

use http::header::{
    HeaderName, HeaderValue, CONNECTION, CONTENT_LENGTH, CONTENT_LOCATION, FORWARDED, HOST,
    LOCATION, TRANSFER_ENCODING,
};
use http::uri::{PathAndQuery, Uri};
use http::{HeaderMap, Request, Response};
use tower::Service;

use super::{h1, pool, Sent};
use crate::body::{self, Body, BoxError};
use crate::clock::Stopwatch;
use crate::error::{Problem, Reason};
use crate::metrics::Metrics;

/// How the upstream client behaves.
#[derive(Clone, Debug, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct UpstreamOptions {
    /// Time to connect to the upstream.
    pub connect_timeout_ms: u64,
    /// Time from sending a request to receiving the response head.
    pub timeout_ms: u64,
    /// How long an idle upstream connection may be used again (both
    /// modes); the pooled mode closes it then.
    pub pool_idle_timeout_ms: u64,
    /// Idle connections the pooled mode keeps, in all.
    pub pool_max_idle: usize,
    /// Pass the client's `Host` header on instead of the upstream's.
    pub preserve_host: bool,
    /// With `preserve_host`: domains under which the storage reads a host's
    /// first label as a bucket (S3's virtual-hosted style), such as
    /// `s3.us-east-1.amazonaws.com` (see `crate::hosts`). Read by the
    /// fence, not the upstream client.
    pub virtual_host_domains: Vec<String>,
    /// With `preserve_host`: hosts with a dot whose requests are
    /// path-style (an IP address or a name without a dot always is).
    pub path_style_hosts: Vec<String>,
    /// Add `X-Forwarded-For`, `X-Forwarded-Proto` and `X-Forwarded-Host`.
    pub x_forwarded: bool,
    /// Add an RFC 7239 `Forwarded` header.
    pub forwarded: bool,
    /// One upstream connection per client connection, or a pool per
    /// client.
    pub upstream_connections: ConnectionMode,
    /// PEM CA certificates trusted beside the system's, for an `https://`
    /// upstream with a private CA (empty: the system's only).
    pub upstream_ca_file: std::path::PathBuf,
    /// The most an upstream connection reads ahead of its client, in bytes
    /// (at least 8 KiB): a response body is relayed in chunks of at most
    /// this, so a client that reads slowly holds about twice this much of
    /// its answer in fencegate (hyper's own default is about 400 KiB).
    pub read_buffer_bytes: usize,
    /// The request body limit, for the 413 of a stream cut off at it (the
    /// config's `limits.max_body_bytes`, not a `[proxy]` key).
    #[serde(skip)]
    pub max_body_bytes: u64,
    /// After this many exchanges with the upstream failed in a row (no
    /// answer: refused, broken, timed out), `/_fence/readyz` answers 502
    /// until a connection to the upstream succeeds again (it tries one at
    /// each readiness check meanwhile); 0: readiness ignores the upstream.
    pub unready_after_failures: u32,
}

/// The smallest `read_buffer_bytes` hyper accepts.
pub const MIN_READ_BUFFER: usize = 8192;

/// How client connections map onto upstream connections.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ConnectionMode {
    /// A pool of upstream connections per client (`pool.rs`), shared by
    /// that client's connections.
    Pooled,
    /// One upstream connection per client connection.
    #[default]
    PerClient,
}

impl Default for UpstreamOptions {
    fn default() -> Self {
        Self {
            connect_timeout_ms: 2_000,
            read_buffer_bytes: 32 * 1024,
            timeout_ms: 30_000,
            pool_idle_timeout_ms: 4_000,
            pool_max_idle: 64,
            preserve_host: false,
            virtual_host_domains: Vec::new(),
            path_style_hosts: Vec::new(),
            x_forwarded: true,
            forwarded: false,
            upstream_connections: ConnectionMode::default(),
            upstream_ca_file: std::path::PathBuf::new(),
            max_body_bytes: 1024 * 1024,
            unready_after_failures: 5,
        }
    }
}

/// A pooled HTTP/1.1 client bound to one upstream base URL; clones share it.
#[derive(Clone, Debug)]
pub struct Upstream(Arc<Shared>);

#[derive(Debug)]
struct Shared {
    /// The pooled mode's connections, per client.
    pool: Arc<pool::Pool>,
    /// TLS to the upstream, for an `https://` base URL.
    tls: Option<UpstreamTls>,
    authority: http::uri::Authority,
    /// The base URL's path without a trailing slash ("" for the root).
    prefix: String,
    /// `scheme://authority` plus the base path: what the upstream's own
    /// absolute URLs start with.
    origin: String,
    /// Deadline of requests without a route deadline.
    timeout_ms: u64,
    preserve_host: bool,
    x_forwarded: bool,
    forwarded: bool,
    max_body_bytes: u64,
    metrics: OnceLock<Metrics>,
    mode: ConnectionMode,
    connect_timeout: Duration,
    /// `read_buffer_bytes` of the options.
    read_buffer: usize,
    /// How long an idle upstream connection may be reused
    /// (`pool_idle_timeout_ms`, both modes).
    idle_timeout_ms: u64,
    /// `host:port` to dial for a dedicated connection.
    dial: String,
    /// The upstream's `Host` header.
    host: HeaderValue,
    /// Exchanges that failed in a row (none since the last answer), and
    /// what the last failure was, for readiness.
    failures: AtomicU32,
    last_failure: Mutex<&'static str>,
    unready_after_failures: u32,
    /// Held by the one readiness probe in flight.
    probing: tokio::sync::Mutex<()>,
}

/// How dedicated connections reach an `https://` upstream.
#[derive(Clone)]
struct UpstreamTls {
    connector: tokio_rustls::TlsConnector,
    /// The upstream's host, for SNI and the certificate check.
    server_name: rustls_pki_types::ServerName<'static>,
}

impl std::fmt::Debug for UpstreamTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpstreamTls")
            .field("server_name", &self.server_name)
            .finish()
    }
}

/// A request's context, carried from accept to answer as its one request
/// extension, instead of an extension per fact: the server puts the client
/// connection in it, the app the authenticated caller, the fence the
/// route's upstream deadline; the fence (the caller), the upstream client
/// and the lease API read it. A request made in process (tests, a cluster
/// member's requests to each shard of a batch) may have none: it then has
/// no client address, no caller and the default deadline.
#[derive(Clone, Debug, Default)]
pub struct RequestContext {
    /// The client connection.
    pub client: Option<ClientAddr>,
    /// The authenticated caller (authentication on).
    pub caller: Option<crate::auth::Caller>,
    /// The route's own upstream deadline, in milliseconds.
    pub timeout_ms: Option<u64>,
    /// The connection's framing guard saw `Content-Length` beside
    /// `Transfer-Encoding` in this request's head (hyper keeps only the
    /// transfer coding): the app refuses it.
    pub framing_conflict: bool,
}

impl RequestContext {
    /// The context of `req`, if it has one.
    pub fn of<B>(req: &Request<B>) -> Option<&Self> {
        req.extensions().get()
    }

    /// The context of `req`, made (empty) if it had none.
    pub fn of_mut<B>(req: &mut Request<B>) -> &mut Self {
        req.extensions_mut().get_or_insert_default()
    }

    /// The context of a request from the client at `client`.
    pub fn from_client(client: ClientAddr) -> Self {
        Self {
            client: Some(client),
            ..Self::default()
        }
    }
}

/// A request's client connection, with the forwarding header
/// values rendered once per connection rather than once per request, and
/// its dedicated upstream connection, if any.
#[derive(Clone, Debug)]
pub struct ClientAddr(Arc<Peer>);

#[derive(Debug)]
struct Peer {
    addr: SocketAddr,
    https: bool,
    /// The address as `X-Forwarded-For` names it.
    ip: HeaderValue,
    /// `for=…;proto=…` of `Forwarded` (RFC 7239).
    forwarded: String,
    /// The idle dedicated upstream connection ([`ConnectionMode::PerClient`]);
    /// an answer's body holds it while it streams, and puts it back.
    upstream: Arc<h1::IdleConn>,
}

impl ClientAddr {
    /// The address the client connected from.
    pub fn ip(&self) -> std::net::IpAddr {
        self.0.addr.ip()
    }

    /// The client at `addr`, connected over TLS if `https`.
    pub fn new(addr: SocketAddr, https: bool) -> Self {
        let proto = if https { "https" } else { "http" };
        let forwarded = match addr.ip() {
            std::net::IpAddr::V4(ip) => format!("for={ip};proto={proto}"),
            std::net::IpAddr::V6(ip) => format!("for=\"[{ip}]\";proto={proto}"),
        };
        let ip = HeaderValue::from_str(&addr.ip().to_string())
            .expect("an IP address is a valid header value");
        Self(Arc::new(Peer {
            addr,
            https,
            ip,
            forwarded,
            upstream: Arc::new(Mutex::new(None)),
        }))
    }
}

const DESTINATION: HeaderName = HeaderName::from_static("destination");
const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");

/// Headers that describe one connection, not the message (RFC 9110 §7.6.1).
const HOP_BY_HOP: [HeaderName; 8] = [
    CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    http::header::TE,
    http::header::TRAILER,
    http::header::TRANSFER_ENCODING,
    http::header::UPGRADE,
    http::header::PROXY_AUTHORIZATION,
];

/// Headers a `Connection` header may not remove: those fencegate sets or
/// relies on (the fencing token the backend may check, the request id, the
/// forwarding headers, `Host`, the checked WebDAV `Destination`, the
/// precondition a route's storage is to evaluate) and the body's framing.
/// A client listing them in `Connection` cannot strip them on their way to
/// the backend.
const KEPT_ON_THE_WAY: [HeaderName; 11] = [
    HOST,
    http::header::IF_MATCH,
    http::header::IF_NONE_MATCH,
    http::header::CONTENT_LENGTH,
    HeaderName::from_static("fencing-token"),
    HeaderName::from_static("x-request-id"),
    X_FORWARDED_FOR,
    X_FORWARDED_PROTO,
    X_FORWARDED_HOST,
    FORWARDED,
    HeaderName::from_static("destination"),
];

/// Removes hop-by-hop headers, including those the `Connection` header names
/// (but never the ones in `KEPT_ON_THE_WAY`).
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // Most messages carry none: one pass over the names, no hashing.
    if !headers.keys().any(|k| HOP_BY_HOP.contains(k)) {
        return;
    }
    let named: Vec<HeaderName> = headers
        .get_all(CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|t| HeaderName::from_bytes(t.trim().as_bytes()).ok())
        .filter(|name| !KEPT_ON_THE_WAY.contains(name))
        .collect();
    for name in named {
        headers.remove(name);
    }
    for name in HOP_BY_HOP {
        headers.remove(name);
    }
}

/// Why an upstream cannot be used as configured.
#[derive(Debug)]
pub enum UpstreamError {
    /// The URL is not one fencegate forwards to: the URL and what is wrong.
    Url {
        base: String,
        why: Cow<'static, str>,
    },
    /// `proxy.upstream_ca_file` is set for an `http://` upstream.
    CaWithoutHttps { base: String },
    /// The CA file is unusable.
    Tls(crate::tls::TlsError),
}

impl UpstreamError {
    fn url(base: &Uri, why: impl Into<Cow<'static, str>>) -> Self {
        UpstreamError::Url {
            base: base.to_string(),
            why: why.into(),
        }
    }
}

impl std::fmt::Display for UpstreamError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            UpstreamError::Url { base, why } => write!(f, "upstream {base} {why}"),
            UpstreamError::CaWithoutHttps { base } => write!(
                f,
                "proxy.upstream_ca_file is set, but upstream {base} is not an https:// URL"
            ),
            UpstreamError::Tls(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for UpstreamError {}

/// Why the upstream does not count as ready: how many exchanges in a row
/// got no answer, how the last one failed, and how the probe did.
#[derive(Debug)]
pub struct Unready {
    pub failed: u32,
    pub last: &'static str,
    pub probe: &'static str,
}

impl std::fmt::Display for Unready {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the last {} requests to the backend got no answer ({}), and neither did a HEAD \
             request just now ({})",
            self.failed, self.last, self.probe
        )
    }
}

impl std::error::Error for Unready {}

impl Upstream {
    /// A client for `base` (an `http://` or `https://host:port[/prefix]`
    /// URL).
    pub fn new(base: &Uri, options: &UpstreamOptions) -> Result<Self, UpstreamError> {
        let https = match base.scheme_str() {
            Some("http") => false,
            Some("https") => true,
            _ => {
                return Err(UpstreamError::url(
                    base,
                    "must be an http:// or https:// URL",
                ))
            }
        };
        let authority = base
            .authority()
            .cloned()
            .ok_or_else(|| UpstreamError::url(base, "has no host"))?;
        if base.query().is_some() {
            return Err(UpstreamError::url(base, "must not have a query"));
        }
        let ca_file =
            Some(options.upstream_ca_file.as_path()).filter(|f| !f.as_os_str().is_empty());
        let tls_config = match (https, ca_file) {
            (true, ca_file) => Some(
                crate::tls::client_config(ca_file, "proxy.upstream_ca_file")
                    .map_err(UpstreamError::Tls)?,
            ),
            (false, Some(_)) => {
                return Err(UpstreamError::CaWithoutHttps {
                    base: base.to_string(),
                })
            }
            (false, None) => None,
        };
        let pool = pool::Pool::new(options.pool_idle_timeout_ms, options.pool_max_idle);
        let host = authority
            .host()
            .trim_start_matches('[')
            .trim_end_matches(']');
        let tls = match tls_config {
            Some(config) => Some(UpstreamTls {
                connector: tokio_rustls::TlsConnector::from(config),
                server_name: rustls_pki_types::ServerName::try_from(host.to_owned())
                    .map_err(|e| UpstreamError::url(base, format!("names no TLS server: {e}")))?,
            }),
            None => None,
        };
        let default_port = if https { 443 } else { 80 };
        let dial = match authority.port_u16() {
            Some(_) => authority.as_str().to_owned(),
            None => format!("{}:{default_port}", authority.as_str()),
        };
        let host = HeaderValue::from_str(authority.as_str())
            .map_err(|_| UpstreamError::url(base, "has an unusable host"))?;
        let origin = format!(
            "{}://{authority}{}",
            if https { "https" } else { "http" },
            base.path().trim_end_matches('/')
        );
        Ok(Self(Arc::new(Shared {
            origin,
            mode: options.upstream_connections,
            connect_timeout: Duration::from_millis(options.connect_timeout_ms),
            read_buffer: options.read_buffer_bytes.max(MIN_READ_BUFFER),
            idle_timeout_ms: options.pool_idle_timeout_ms,
            dial,
            host,
            pool,
            tls,
            authority,
            prefix: base.path().trim_end_matches('/').to_owned(),
            timeout_ms: options.timeout_ms,
            preserve_host: options.preserve_host,
            x_forwarded: options.x_forwarded,
            forwarded: options.forwarded,
            max_body_bytes: options.max_body_bytes,
            metrics: OnceLock::new(),
            failures: AtomicU32::new(0),
            last_failure: Mutex::new(""),
            unready_after_failures: options.unready_after_failures,
            probing: tokio::sync::Mutex::new(()),
        })))
    }

    /// Whether the upstream counts as reachable for readiness: `Err` with
    /// why once `unready_after_failures` exchanges failed in a row and a
    /// probe tried now fails too: a `HEAD` of the base path on a connection
    /// of its own, any HTTP answer a success (it clears the count). One
    /// probe at a time: concurrent checks wait for it and share its result.
    pub async fn readiness(&self) -> Result<(), Unready> {
        let threshold = self.0.unready_after_failures;
        let failing = || {
            let failed = self.0.failures.load(Ordering::Relaxed);
            (threshold != 0 && failed >= threshold).then_some(failed)
        };
        if failing().is_none() {
            return Ok(());
        }
        let _one = self.0.probing.lock().await;
        let Some(failed) = failing() else {
            return Ok(());
        };
        match self.0.probe().await {
            Ok(()) => {
                self.0.failures.store(0, Ordering::Relaxed);
                tracing::info!(upstream = %self.0.authority, "upstream answers again");
                Ok(())
            }
            Err(kind) => {
                let last = *self
                    .0
                    .last_failure
                    .lock()
                    .unwrap_or_else(|p| p.into_inner());
                Err(Unready {
                    failed,
                    last,
                    probe: kind,
                })
            }
        }
    }

    /// Records upstream latency in `metrics` (the first call wins).
    pub fn set_metrics(&self, metrics: Metrics) {
        let _ = self.0.metrics.set(metrics);
    }
}

impl Shared {
    /// The path and query of the upstream request: the base path joined
    /// with the request's.
    fn target_path(&self, uri: &Uri) -> Result<PathAndQuery, http::Error> {
        Ok(match (self.prefix.is_empty(), uri.path_and_query()) {
            (true, Some(pq)) => pq.clone(),
            (true, None) => PathAndQuery::from_static("/"),
            (false, pq) => {
                let pq = pq.map_or("/", PathAndQuery::as_str);
                format!("{}{pq}", self.prefix).parse()?
            }
        })
    }

    /// Tells the upstream who the client is, as configured: the lines to
    /// add. An existing `X-Forwarded-For` is extended, as the header's
    /// convention is.
    fn forwarding(
        &self,
        headers: &HeaderMap,
        extensions: &http::Extensions,
        added: &mut h1::Added,
    ) {
        let context = extensions.get::<RequestContext>();
        let Some(peer) = context.and_then(|c| c.client.as_ref()) else {
            return;
        };
        let peer = &*peer.0;
        let host = headers.get(HOST);
        if self.x_forwarded {
            let xff = match headers.get(&X_FORWARDED_FOR).and_then(|v| v.to_str().ok()) {
                Some(prior) => HeaderValue::from_str(&format!("{prior}, {}", peer.addr.ip())).ok(),
                None => Some(peer.ip.clone()),
            };
            if let Some(v) = xff {
                added.push((X_FORWARDED_FOR, v, h1::Put::Replace));
            }
            let proto = if peer.https { "https" } else { "http" };
            added.push((
                X_FORWARDED_PROTO,
                HeaderValue::from_static(proto),
                h1::Put::Replace,
            ));
            if let Some(host) = host {
                added.push((X_FORWARDED_HOST, host.clone(), h1::Put::Replace));
            }
        }
        if self.forwarded {
            let value = match host.and_then(|h| h.to_str().ok()) {
                Some(host) => format!("{};host=\"{host}\"", peer.forwarded),
                None => peer.forwarded.clone(),
            };
            if let Ok(v) = HeaderValue::from_str(&value) {
                added.push((FORWARDED, v, h1::Put::Append));
            }
        }
    }

    /// [`Self::forwarding`] applied to the request's own headers.
    #[cfg(test)]
    fn add_forwarded(&self, req: &mut Request<Body>) {
        let mut added = h1::Added::new();
        self.forwarding(req.headers(), req.extensions(), &mut added);
        h1::apply(req.headers_mut(), added);
    }

    /// The header lines a request is written with: the forwarding headers
    /// and, unless the client's is kept (and there is one), the upstream's
    /// `Host`. Made once the request is staged, so they are not carried
    /// while it waits.
    fn lean_lines(&self, parts: &http::request::Parts, client_host: bool) -> h1::Added {
        let mut added = h1::Added::new();
        self.forwarding(&parts.headers, &parts.extensions, &mut added);
        if !self.preserve_host || !client_host {
            // Host names the upstream; a request without one (HTTP/1.0)
            // gets the upstream's, as the pool's client sets it.
            added.push((HOST, self.host.clone(), h1::Put::Replace));
        }
        added
    }

    /// A `HEAD` of the base path on a connection of its own, within the
    /// connect timeout (twice: connect, then answer): any answer is one.
    async fn probe(&self) -> Result<(), &'static str> {
        let conn = self.connect().await.map_err(|e| failure_kind(&*e))?;
        let path = if self.prefix.is_empty() {
            "/"
        } else {
            self.prefix.as_str()
        };
        let req = Request::head(path)
            .header(HOST, self.host.clone())
            .body(body::empty())
            .map_err(|_| "the exchange broke off")?;
        let slot = Arc::new(Mutex::new(None));
        let timeout_ms = u64::try_from(self.connect_timeout.as_millis()).unwrap_or(u64::MAX);
        let deadline = Stopwatch::start().deadline_after_ms(timeout_ms);
        // No body to wait for: the connection's deadline covers it all.
        let exchange = async {
            let out = h1::Outgoing::new(req).await?;
            let mut conn = conn;
            conn.begin(&out, &h1::Added::new(), deadline).await?;
            conn.send(out, &slot, false).await
        };
        match exchange.await {
            Ok(_answer) => Ok(()),
            Err(e) if h1::is_expired(&*e) => Err("no answer in time"),
            Err(e) => Err(failure_kind(&*e)),
        }
    }

    /// Opens a dedicated upstream connection.
    async fn connect(&self) -> Result<h1::Conn, BoxError> {
        let stream = tokio::time::timeout(
            self.connect_timeout,
            tokio::net::TcpStream::connect(&self.dial),
        )
        .await
        .map_err(|_| format!("connecting to {} timed out", self.dial))??;
        stream.set_nodelay(true)?;
        let Some(tls) = &self.tls else {
            return Ok(h1::Conn::new(h1::Stream::Tcp(stream), self.read_buffer));
        };
        let stream = tokio::time::timeout(
            self.connect_timeout,
            tls.connector.connect(tls.server_name.clone(), stream),
        )
        .await
        .map_err(|_| format!("the TLS handshake with {} timed out", self.dial))??;
        Ok(h1::Conn::new(
            h1::Stream::Tls(Box::new(stream)),
            self.read_buffer,
        ))
    }

    /// Step one of an exchange (see [`Exchange`](super::Exchange)): the
    /// request readied for the upstream, its first body piece read, and a
    /// connection taken (its client connection's, or an idle one of its
    /// client's in the pool, checked open now and so written to at once,
    /// not after the client took its time) or opened. Nothing is sent.
    /// `Err`: the answer, nothing sent.
    async fn stage(self: Arc<Self>, mut req: Request<Body>) -> Result<Staged, Response<Body>> {
        // A request with no client address (one made in process) goes
        // through the pool in either mode.
        let context = RequestContext::of(&req);
        let home = match (self.mode, context.and_then(|c| c.client.as_ref())) {
            (ConnectionMode::PerClient, Some(peer)) => Home::Slot(peer.0.upstream.clone()),
            (_, peer) => Home::Pool(pool::Client::new(
                peer.map(ClientAddr::ip),
                context
                    .and_then(|c| c.caller.as_ref())
                    .map(|c| c.0.name.clone()),
            )),
        };
        let client = match self.prepare(&mut req) {
            Ok(prepared) => prepared,
            Err(problem) => return Err(problem.into_response()),
        };
        let timeout_ms = RequestContext::of(&req)
            .and_then(|c| c.timeout_ms)
            .unwrap_or(self.timeout_ms);
        let watch = Stopwatch::start();
        let deadline = watch.deadline_after_ms(timeout_ms);
        // Usually ready at once (the body's first piece is in, an idle
        // connection open): a timer only if it must wait. The block is
        // pinned where it is built: moved into the timeout, it would also
        // keep its room in this future.
        let ready = {
            let mut ready = std::pin::pin!(async {
                let out = h1::Outgoing::new(req).await?;
                let (idle, home) = match home {
                    Home::Slot(slot) => {
                        let idle = slot.lock().unwrap_or_else(|p| p.into_inner()).take();
                        let idle_timeout_ms = self.idle_timeout_ms;
                        let idle = idle.and_then(|mut c| c.is_open(idle_timeout_ms).then_some(c));
                        (idle, Taken::Slot(slot))
                    }
                    Home::Pool(client) => {
                        let (idle, home) = self.pool.take(&client);
                        (idle, Taken::Pool(home))
                    }
                };
                let conn = match idle {
                    Some(conn) => (conn, true),
                    // Boxed: a connect (with TLS) is a large future, and a
                    // rare one; inline it would make every exchange's
                    // future that large.
                    None => (Box::pin(self.connect()).await?, false),
                };
                Ok::<_, BoxError>((out, conn, home))
            });
            let first = std::future::poll_fn(|cx| Poll::Ready(ready.as_mut().poll(cx))).await;
            match first {
                Poll::Ready(ready) => Ok(ready),
                Poll::Pending => tokio::time::timeout_at(deadline, ready).await,
            }
        };
        let on = match ready {
            Ok(Ok((out, (conn, reused), home))) => Box::new(OnConn {
                added: self.lean_lines(out.parts(), client.is_some()),
                home,
                out,
                conn: Some(conn),
                reused,
            }),
            Ok(Err(err)) => return Err(self.failed(watch, &*err)),
            Err(_) => return Err(self.timed_out(watch, timeout_ms)),
        };
        Ok(Staged {
            upstream: self,
            on,
            client,
            timeout_ms,
            watch,
        })
    }

    /// Step two: sends what [`Self::stage`] readied, and relays the answer.
    /// The answer's body holds the connection and puts it back (in its
    /// client connection's slot, or in the pool) once read to its end; on
    /// any error or a timeout it is dropped, and closed. A request that may
    /// go again on a fresh connection comes back as [`Sent::Again`]: one
    /// whose first write failed on a reused connection (nothing of it
    /// left), or a `GET` or `HEAD` with no body whose reused connection
    /// failed before any byte of the answer; it goes again only once staged
    /// anew and checked.
    async fn send(staged: Staged) -> Sent<Staged> {
        let Staged {
            upstream: this,
            mut on,
            client,
            timeout_ms,
            watch,
        } = staged;
        let deadline = watch.deadline_after_ms(timeout_ms);
        // The connection's own kept timer holds the deadline (see
        // `h1::Timed`): no timer per request.
        let o = &mut *on;
        let conn = o.conn.as_mut().expect("staged on a connection");
        let sent = match conn.begin(&o.out, &o.added, deadline).await {
            Err(e) if h1::is_expired(&e) => Exchanged::Expired,
            // The write failed outright: not a byte of the request left.
            Err(e) if !o.reused => Exchanged::Unsent(e.into()),
            Err(e) => {
                // The upstream closed or reset the idle connection as the
                // request went out: it may go again (once) on a fresh one,
                // staged anew and checked first.
                tracing::debug!(upstream = %this.authority, error = %e, "an idle upstream connection failed before the request left: staged again on a new one");
                Exchanged::Again(on)
            }
            Ok(()) => {
                let OnConn {
                    home,
                    out,
                    conn,
                    reused,
                    added,
                } = *on;
                let conn = conn.expect("staged on a connection");
                let answer = match &home {
                    Taken::Slot(slot) => conn.send(out, slot, reused).await,
                    Taken::Pool(home) => conn.send(out, home, reused).await,
                };
                match answer {
                    Err(e) if h1::is_expired(&*e) => Exchanged::Expired,
                    Err(e) => match h1::unanswered(e) {
                        // Nothing of an answer came on a reused connection:
                        // a GET or HEAD goes again on a fresh one.
                        Ok(out) => {
                            tracing::debug!(upstream = %this.authority, "a reused upstream connection failed before any answer: a GET or HEAD goes again on a new one");
                            Exchanged::Again(Box::new(OnConn {
                                home,
                                out,
                                conn: None,
                                reused: true,
                                added,
                            }))
                        }
                        Err(e) => Exchanged::Answer(Err(e)),
                    },
                    answer => Exchanged::Answer(answer),
                }
            }
        };
        match sent {
            Exchanged::Answer(result) => this.ended(watch, result, client.as_ref()),
            Exchanged::Unsent(err) => Sent::NotSent(this.failed(watch, &*err)),
            Exchanged::Again(on) => Sent::Again(Staged {
                upstream: this,
                on,
                client,
                timeout_ms,
                watch,
            }),
            Exchanged::Expired => Sent::Unknown(this.timed_out(watch, timeout_ms)),
        }
    }

    /// Stages again, on a fresh connection, a request [`Self::send`] gave
    /// back ([`Sent::Again`]): within the exchange's deadline. `Err`: the
    /// answer, nothing sent.
    async fn restage(mut staged: Staged) -> Result<Staged, Response<Body>> {
        let this = &staged.upstream;
        let deadline = staged.watch.deadline_after_ms(staged.timeout_ms);
        match tokio::time::timeout_at(deadline, Box::pin(this.connect())).await {
            Ok(Ok(conn)) => {
                staged.on.conn = Some(conn);
                // A fresh connection: it never goes again.
                staged.on.reused = false;
            }
            Ok(Err(err)) => return Err(this.failed(staged.watch, &*err)),
            Err(_) => return Err(this.timed_out(staged.watch, staged.timeout_ms)),
        }
        Ok(staged)
    }

    /// Both steps (again, once, on a fresh connection if the idle one had
    /// been closed), with no check between them.
    async fn forward(self: Arc<Self>, req: Request<Body>) -> Response<Body> {
        let mut staged = match self.stage(req).await {
            Ok(staged) => staged,
            Err(answer) => return answer,
        };
        loop {
            match Self::send(staged).await {
                Sent::Answered(res) | Sent::Unknown(res) | Sent::NotSent(res) => return res,
                Sent::Again(again) => match Self::restage(again).await {
                    Ok(again) => staged = again,
                    Err(answer) => return answer,
                },
            }
        }
    }

    /// The exchange ended: the storage's answer relayed, or the answer to
    /// its failure, whose outcome is unknown.
    fn ended<S>(
        &self,
        watch: Stopwatch,
        result: Result<Response<Body>, BoxError>,
        client: Option<&(HeaderValue, bool)>,
    ) -> Sent<S> {
        match result {
            Ok(res) => {
                if let Some(m) = self.metrics.get() {
                    m.upstream_latency(watch.elapsed_us() as f64 / 1e6);
                }
                if self.failures.load(Ordering::Relaxed) != 0 {
                    self.failures.store(0, Ordering::Relaxed);
                }
                self.relay(res, client)
            }
            Err(err) => Sent::Unknown(self.failed(watch, &*err)),
        }
    }

    /// The exchange ran out of time. Any connection it held was dropped
    /// with it, and so closed: it is never reused.
    fn timed_out(&self, watch: Stopwatch, timeout_ms: u64) -> Response<Body> {
        if let Some(m) = self.metrics.get() {
            m.upstream_latency(watch.elapsed_us() as f64 / 1e6);
        }
        tracing::warn!(upstream = %self.authority, timeout_ms, "upstream timed out");
        self.count_failure("timed out");
        Problem::upstream_timeout(timeout_ms).into_response()
    }

    /// Readies `req` for the upstream: its target (the base path joined
    /// with the request's, in origin form), hop-by-hop headers removed, and
    /// a `Destination` that names the proxy made to name the upstream; the
    /// forwarding headers and `Host` are left for [`Self::lean_lines`], for
    /// the head to be written with them rather than inserted (and rehashed)
    /// here. The address the client used (its `Host`, and whether it came
    /// over TLS), for translating absolute URLs back.
    fn prepare(&self, req: &mut Request<Body>) -> Result<Option<(HeaderValue, bool)>, Problem> {
        *req.uri_mut() = self
            .target_path(req.uri())
            .map(Uri::from)
            .map_err(|_| Problem::invalid_request("the request target cannot be forwarded"))?;
        strip_hop_by_hop(req.headers_mut());
        // The address the client used (its Host header, and whether it came
        // over TLS), for translating absolute URLs both ways. A cheap clone;
        // the origin string is made only when a header needs it.
        let client = req.headers().get(HOST).cloned().map(|host| {
            let https = RequestContext::of(req)
                .and_then(|c| c.client.as_ref())
                .is_some_and(|c| c.0.https);
            (host, https)
        });
        if !self.preserve_host {
            // Host names the upstream (`lean_lines` writes the upstream's).
            // A WebDAV Destination naming the proxy then names the upstream
            // instead, as servers check it against the Host they were sent.
            if let (true, Some(client)) = (req.headers().contains_key(DESTINATION), &client) {
                if let Some(origin) = client_origin(client) {
                    rebase(req.headers_mut(), &DESTINATION, &origin, &self.origin);
                }
            }
        }
        Ok(client)
    }

    /// The upstream's answer, relayed: hop-by-hop headers removed, and a
    /// redirect that names the upstream's own address made to name the
    /// proxy instead (nginx's `proxy_redirect default`); or, for an answer
    /// that cannot be relayed, fencegate's in its place.
    fn relay<S>(&self, res: Response<Body>, client: Option<&(HeaderValue, bool)>) -> Sent<S> {
        let (mut parts, body) = res.into_parts();
        if parts.headers.contains_key(TRANSFER_ENCODING)
            && parts.headers.contains_key(CONTENT_LENGTH)
        {
            // RFC 9112 §6.3: an error an intermediary must not forward as
            // it is (the length would go on with the coding gone). Its body
            // is dropped unread, so the connection is never reused.
            drop(body);
            tracing::warn!(upstream = %self.authority, status = parts.status.as_u16(), "the upstream's answer has both Content-Length and Transfer-Encoding: not relayed");
            self.count_failure("ambiguous framing");
            return Sent::Unknown(
                Problem::new(
                    Reason::UpstreamError,
                    "the backend failed to answer: its answer had both Content-Length and Transfer-Encoding",
                )
                .into_response(),
            );
        }
        strip_hop_by_hop(&mut parts.headers);
        let located =
            parts.headers.contains_key(LOCATION) || parts.headers.contains_key(CONTENT_LOCATION);
        // The origin string is made only for an answer that needs it.
        if let Some(origin) = located.then(|| client.and_then(client_origin)).flatten() {
            rebase(&mut parts.headers, &LOCATION, &self.origin, &origin);
            rebase(&mut parts.headers, &CONTENT_LOCATION, &self.origin, &origin);
        }
        Sent::Answered(Response::from_parts(parts, body))
    }

    /// The answer when the exchange with the upstream failed (its outcome
    /// is unknown, unless nothing was sent).
    fn failed(
        &self,
        watch: Stopwatch,
        err: &(dyn std::error::Error + Send + Sync + 'static),
    ) -> Response<Body> {
        if let Some(m) = self.metrics.get() {
            m.upstream_latency(watch.elapsed_us() as f64 / 1e6);
        }
        if body::is_length_limit(err) {
            // The client streamed more than the body limit: the upstream
            // got a cut-off request, and the connection was dropped.
            return Problem::payload_too_large(self.max_body_bytes).into_response();
        }
        if body::is_client_body_error(err) {
            // The client's body broke off or its chunking was malformed
            // after part of it was streamed: the upstream got a head and at
            // most the valid part of the body, never its end (no last chunk,
            // fewer bytes than declared), and the connection was closed, so
            // a correct HTTP/1.1 server sees an incomplete request and does
            // not apply it.
            tracing::info!(upstream = %self.authority, error = %err, "request body failed; upstream request abandoned");
            return Problem::invalid_request(
                "the request body broke off or its chunked framing is malformed",
            )
            .closing_connection()
            .into_response();
        }
        // The whole chain: a pooled client's error says only "client error
        // (Connect)"; the cause (a refused connection, a certificate that
        // cannot be verified) is in its sources.
        let cause = crate::error::cause(err);
        tracing::warn!(upstream = %self.authority, error = %cause, "upstream request failed");
        let kind = failure_kind(err);
        self.count_failure(kind);
        Problem::new(
            Reason::UpstreamError,
            format!("the backend failed to answer: {kind}"),
        )
        .into_response()
    }

    /// One more exchange failed in a row, as `kind`.
    fn count_failure(&self, kind: &'static str) {
        self.failures.fetch_add(1, Ordering::Relaxed);
        *self.last_failure.lock().unwrap_or_else(|p| p.into_inner()) = kind;
    }
}

/// What kind of failure `err` is, in words a client may be shown (no
/// address, no certificate detail: those are in the log).
fn failure_kind(err: &(dyn std::error::Error + 'static)) -> &'static str {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(err);
    let mut text = String::new();
    while let Some(e) = source {
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            // tokio-rustls wraps its error in an io::Error, whose source()
            // skips it.
            let tls = io.get_ref().is_some_and(|inner| {
                inner
                    .downcast_ref::<tokio_rustls::rustls::Error>()
                    .is_some()
            });
            if tls {
                return "TLS handshake failed";
            }
            match io.kind() {
                std::io::ErrorKind::ConnectionRefused => return "connection refused",
                std::io::ErrorKind::ConnectionReset => return "connection reset",
                std::io::ErrorKind::TimedOut => return "connect timed out",
                _ => {}
            }
        }
        if e.downcast_ref::<tokio_rustls::rustls::Error>().is_some() {
            return "TLS handshake failed";
        }
        text.push_str(&e.to_string());
        text.push(' ');
        source = e.source();
    }
    if text.contains("TLS handshake") {
        "TLS handshake failed"
    } else if text.contains("timed out") {
        "connect timed out"
    } else if text.contains("dns error") || text.contains("failed to lookup") {
        "the backend's name did not resolve"
    } else if text.contains("TLS") || text.contains("certificate") {
        "TLS handshake failed"
    } else if text.contains("connection closed") || text.contains("incomplete") {
        "the backend closed the connection"
    } else {
        "the exchange broke off"
    }
}

/// Where a request's connection comes from.
enum Home {
    /// Its client connection's slot.
    Slot(Arc<h1::IdleConn>),
    /// Its client's connections in the pool.
    Pool(pool::Client),
}

/// Where a staged request's connection goes back to.
enum Taken {
    Slot(Arc<h1::IdleConn>),
    Pool(Arc<pool::ClientHome>),
}

/// A request readied for the upstream by [`Upstream::stage`]: nothing of it
/// sent yet.
pub struct Staged {
    upstream: Arc<Shared>,
    /// Boxed: a staged request is moved from step to step.
    on: Box<OnConn>,
    /// The address the client used, for translating absolute URLs back.
    client: Option<(HeaderValue, bool)>,
    /// The exchange's deadline, counted from `watch` (both steps count).
    timeout_ms: u64,
    watch: Stopwatch,
}

impl std::fmt::Debug for Staged {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Staged")
            .field("timeout_ms", &self.timeout_ms)
            .finish_non_exhaustive()
    }
}

/// How the sending of a staged request ended, before its answer is
/// relayed.
enum Exchanged {
    /// An answer, or a failure after bytes of the request may have left.
    Answer(Result<Response<Body>, BoxError>),
    /// A failure before any byte of it left.
    Unsent(BoxError),
    /// The reused idle connection had been closed: it goes again.
    Again(Box<OnConn>),
    /// The exchange's deadline passed (whatever of it left).
    Expired,
}

/// A request staged on an upstream connection.
struct OnConn {
    /// Where the connection goes back to.
    home: Taken,
    out: h1::Outgoing,
    /// `None` only between a [`Sent::Again`] and the connection
    /// [`Shared::restage`] opens.
    conn: Option<h1::Conn>,
    /// Whether the connection was idle (not opened for this request).
    reused: bool,
    /// The header lines the head is written with.
    added: h1::Added,
}

/// `scheme://host` of the address a client used, from its Host header; `None`
/// for a Host that is not a plain authority.
fn client_origin((host, https): &(HeaderValue, bool)) -> Option<String> {
    let host = host.to_str().ok()?;
    let authority: http::uri::Authority = host.parse().ok()?;
    let scheme = if *https { "https" } else { "http" };
    Some(format!("{scheme}://{authority}"))
}

/// Rewrites an absolute URL in header `name` that starts with origin `from`
/// (followed by `/` or nothing) to start with `to` instead.
fn rebase(headers: &mut HeaderMap, name: &HeaderName, from: &str, to: &str) {
    let Some(value) = headers.get(name).and_then(|v| v.to_str().ok()) else {
        return;
    };
    let rest = match value.get(..from.len()) {
        Some(head) if head.eq_ignore_ascii_case(from) => &value[from.len()..],
        _ => return,
    };
    if !(rest.is_empty() || rest.starts_with('/')) {
        return;
    }
    if let Ok(v) = HeaderValue::from_str(&format!("{to}{rest}")) {
        headers.insert(name.clone(), v);
    }
}

impl Service<Request<Body>> for Upstream {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let upstream = self.0.clone();
        Box::pin(async move { Ok(upstream.forward(req).await) })
    }
}

impl Upstream {
    /// Step one of an exchange (see [`Exchange`](super::Exchange)):
    /// everything before the request's first byte leaves. `Err`: the
    /// answer, nothing sent.
    pub fn stage(
        &self,
        req: Request<Body>,
    ) -> impl Future<Output = Result<Staged, Response<Body>>> + Send + 'static {
        Shared::stage(self.0.clone(), req)
    }
}

impl Upstream {
    /// The same exchange with hyper's own HTTP/1.1 client in the place of
    /// fencegate's (`h1.rs`): the request readied and the answer relayed
    /// exactly as [`Upstream::call`] does, hyper-util's client in between.
    /// Only for `tests/upstream_h1.rs`, which holds the lean client to
    /// hyper's rules by sending both the same corpus.
    #[doc(hidden)]
    pub async fn call_with_hyper(&self, mut req: Request<Body>) -> Response<Body> {
        let this = &self.0;
        let client = match this.prepare(&mut req) {
            Ok(client) => client,
            Err(problem) => return problem.into_response(),
        };
        let (mut parts, body) = req.into_parts();
        let added = this.lean_lines(&parts, client.is_some());
        h1::apply(&mut parts.headers, added);
        parts.uri = match format!("http://{}{}", this.authority, parts.uri).parse() {
            Ok(uri) => uri,
            Err(_) => return Problem::invalid_request("no target").into_response(),
        };
        let req = Request::from_parts(parts, body);
        let hyper = hyper_util::client::legacy::Client::builder(crate::rt::ClientExecutor::here())
            .http1_max_buf_size(this.read_buffer)
            .build_http::<Body>();
        let watch = Stopwatch::start();
        let sent = tokio::time::timeout(Duration::from_millis(this.timeout_ms), hyper.request(req));
        let sent: Sent<()> = match sent.await {
            Ok(Ok(res)) => this.ended(watch, Ok(res.map(body::boxed)), client.as_ref()),
            Ok(Err(e)) if e.is_connect() => Sent::NotSent(this.failed(watch, &e)),
            Ok(Err(e)) => this.ended(watch, Err(BoxError::from(e)), client.as_ref()),
            Err(_) => Sent::Unknown(this.timed_out(watch, this.timeout_ms)),
        };
        match sent {
            Sent::Answered(res) | Sent::Unknown(res) | Sent::NotSent(res) => res,
            Sent::Again(()) => unreachable!("hyper's client retries itself"),
        }
    }
}

impl Staged {
    /// Step two: sends the request (see [`Sent`]).
    pub fn send(self) -> impl Future<Output = Sent<Staged>> + Send + 'static {
        Shared::send(self)
    }

    /// Stages it again, on a fresh connection, after [`Sent::Again`].
    pub fn restage(self) -> impl Future<Output = Result<Staged, Response<Body>>> + Send + 'static {
        Shared::restage(self)
    }

    /// Not sent after all: what step one took goes back (an idle
    /// connection it reused, to its slot or the pool).
    pub fn withdraw(self) {
        let OnConn {
            home, conn, reused, ..
        } = *self.on;
        if let (true, Some(conn)) = (reused, conn) {
            // Put back as it was: it keeps its age.
            match home {
                Taken::Slot(slot) => *slot.lock().unwrap_or_else(|p| p.into_inner()) = Some(conn),
                Taken::Pool(home) => h1::Home::put(&*home, conn),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hop_by_hop_headers_are_stripped() {
        let mut h = HeaderMap::new();
        h.insert("connection", "close, x-secret".parse().unwrap());
        h.insert("x-secret", "1".parse().unwrap());
        h.insert("keep-alive", "timeout=5".parse().unwrap());
        h.insert("upgrade", "h2c".parse().unwrap());
        h.insert("fencing-token", "7".parse().unwrap());
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1);
        assert_eq!(h["fencing-token"], "7");
    }

    /// Seen failing before: `Connection: close, fencing-token` removed the
    /// token, defeating a backend's own token check; and `Connection:
    /// If-Match` removed the precondition a route with preconditions had
    /// added (or judged), so a late write went unconditioned.
    #[test]
    fn connection_cannot_name_what_fencegate_sets_or_relies_on() {
        let mut h = HeaderMap::new();
        let kept = [
            "host",
            "if-match",
            "if-none-match",
            "content-length",
            "fencing-token",
            "x-request-id",
            "x-forwarded-for",
            "x-forwarded-proto",
            "x-forwarded-host",
            "forwarded",
            "destination",
        ];
        h.insert(
            "connection",
            format!("close, x-secret, {}", kept.join(", "))
                .parse()
                .unwrap(),
        );
        h.insert("x-secret", "1".parse().unwrap());
        for name in kept {
            h.insert(name, "1".parse().unwrap());
        }
        strip_hop_by_hop(&mut h);
        let mut left: Vec<&str> = h.keys().map(HeaderName::as_str).collect();
        left.sort_unstable();
        let mut want = kept.to_vec();
        want.sort_unstable();
        assert_eq!(left, want);
    }

    #[tokio::test]
    async fn forwarding_headers_name_the_client_and_its_scheme() {
        let options = UpstreamOptions {
            forwarded: true,
            ..UpstreamOptions::default()
        };
        let up = Upstream::new(&"http://127.0.0.1:9".parse().unwrap(), &options).unwrap();
        for (https, proto) in [(false, "http"), (true, "https")] {
            let mut req = Request::new(body::empty());
            req.headers_mut().insert(HOST, "svc".parse().unwrap());
            req.extensions_mut()
                .insert(RequestContext::from_client(ClientAddr::new(
                    "10.0.0.7:5000".parse().unwrap(),
                    https,
                )));
            up.0.add_forwarded(&mut req);
            let h = req.headers();
            assert_eq!(h["x-forwarded-for"], "10.0.0.7");
            assert_eq!(h["x-forwarded-proto"], proto);
            assert_eq!(h["x-forwarded-host"], "svc");
            let forwarded = format!("for=10.0.0.7;proto={proto};host=\"svc\"");
            assert_eq!(h["forwarded"], forwarded.as_str());
        }
        let mut req = Request::new(body::empty());
        req.headers_mut()
            .insert("x-forwarded-for", "192.0.2.1".parse().unwrap());
        req.extensions_mut()
            .insert(RequestContext::from_client(ClientAddr::new(
                "[::1]:5000".parse().unwrap(),
                false,
            )));
        up.0.add_forwarded(&mut req);
        assert_eq!(req.headers()["x-forwarded-for"], "192.0.2.1, ::1");
        assert_eq!(req.headers()["forwarded"], "for=\"[::1]\";proto=http");
    }

    #[test]
    fn absolute_urls_are_rebased_only_on_their_origin() {
        let rebased = |value: &str| {
            let mut h = HeaderMap::new();
            h.insert(LOCATION, value.parse().unwrap());
            rebase(&mut h, &LOCATION, "http://up:9000/base", "https://proxy");
            h[LOCATION].to_str().unwrap().to_owned()
        };
        assert_eq!(rebased("http://up:9000/base/a?b"), "https://proxy/a?b");
        assert_eq!(rebased("HTTP://UP:9000/base"), "https://proxy");
        for kept in [
            "http://up:9000/basement",
            "http://other/base/a",
            "/base/a",
            "x",
        ] {
            assert_eq!(rebased(kept), kept);
        }
        let origin = |host: &str, https| client_origin(&(host.parse().unwrap(), https));
        assert_eq!(
            origin("proxy:8080", false).as_deref(),
            Some("http://proxy:8080")
        );
        assert_eq!(
            origin("[::1]:8443", true).as_deref(),
            Some("https://[::1]:8443")
        );
        assert_eq!(origin("a b", false), None);
    }

    #[tokio::test]
    async fn targets_join_the_base_path() {
        let up = Upstream::new(
            &"http://127.0.0.1:9/base/".parse().unwrap(),
            &UpstreamOptions::default(),
        )
        .unwrap();
        let t = up.0.target_path(&"/kv/a?x=1".parse().unwrap()).unwrap();
        assert_eq!(t, "/base/kv/a?x=1");
        let up = Upstream::new(
            &"http://127.0.0.1:9".parse().unwrap(),
            &UpstreamOptions::default(),
        )
        .unwrap();
        assert_eq!(
            up.0.target_path(&"/kv/a".parse().unwrap()).unwrap(),
            "/kv/a"
        );
        assert!(Upstream::new(&"ftp://x".parse().unwrap(), &UpstreamOptions::default()).is_err());
    }
}
