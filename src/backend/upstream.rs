//! The HTTP upstream: forwards admitted requests to an existing server
//! through hyper-util's pooled client.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use http::header::{HeaderName, CONNECTION, HOST};
use http::uri::{PathAndQuery, Uri};
use http::{HeaderMap, Request, Response};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tower::Service;

use crate::body::{self, Body};
use crate::error::Problem;
use crate::fence::OutcomeUnknown;
use crate::route::RouteTimeout;

/// How the upstream client behaves.
#[derive(Clone, Debug)]
pub struct UpstreamOptions {
    /// Time to connect to the upstream.
    pub connect_timeout_ms: u64,
    /// Time from sending a request to receiving the response head.
    pub timeout_ms: u64,
    /// How long an idle pooled connection is kept.
    pub pool_idle_timeout_ms: u64,
    /// Idle connections kept per upstream.
    pub pool_max_idle: usize,
}

impl Default for UpstreamOptions {
    fn default() -> Self {
        Self {
            connect_timeout_ms: 2_000,
            timeout_ms: 30_000,
            pool_idle_timeout_ms: 90_000,
            pool_max_idle: 64,
        }
    }
}

/// A pooled HTTP/1.1 client bound to one upstream base URL.
#[derive(Clone, Debug)]
pub struct Upstream {
    client: Client<HttpConnector, Body>,
    scheme: http::uri::Scheme,
    authority: http::uri::Authority,
    /// The base URL's path without a trailing slash ("" for the root).
    prefix: String,
    /// Deadline of requests without a route deadline.
    timeout_ms: u64,
}

/// Headers that describe one connection, not the message (RFC 9110 §7.6.1).
const HOP_BY_HOP: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "proxy-authorization",
];

/// Removes hop-by-hop headers, including those the `Connection` header names.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|t| HeaderName::from_bytes(t.trim().as_bytes()).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    for name in HOP_BY_HOP {
        headers.remove(name);
    }
}

impl Upstream {
    /// A client for `base` (an `http://host:port[/prefix]` URL).
    pub fn new(base: &Uri, options: &UpstreamOptions) -> Result<Self, String> {
        if base.scheme_str() != Some("http") {
            return Err(format!("upstream {base} must be an http:// URL"));
        }
        let authority = base
            .authority()
            .cloned()
            .ok_or_else(|| format!("upstream {base} has no host"))?;
        if base.query().is_some() {
            return Err(format!("upstream {base} must not have a query"));
        }
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(Duration::from_millis(options.connect_timeout_ms)));
        connector.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_millis(options.pool_idle_timeout_ms))
            .pool_max_idle_per_host(options.pool_max_idle)
            .build(connector);
        Ok(Self {
            client,
            scheme: http::uri::Scheme::HTTP,
            authority,
            prefix: base.path().trim_end_matches('/').to_owned(),
            timeout_ms: options.timeout_ms,
        })
    }

    fn target(&self, uri: &Uri) -> Result<Uri, http::Error> {
        let pq = uri.path_and_query().map_or("/", PathAndQuery::as_str);
        let pq: PathAndQuery = if self.prefix.is_empty() {
            pq.parse()?
        } else {
            format!("{}{pq}", self.prefix).parse()?
        };
        Uri::builder()
            .scheme(self.scheme.clone())
            .authority(self.authority.clone())
            .path_and_query(pq)
            .build()
    }

    async fn forward(self, mut req: Request<Body>) -> Response<Body> {
        match self.target(req.uri()) {
            Ok(uri) => *req.uri_mut() = uri,
            Err(_) => {
                return Problem::invalid_request("the request target cannot be forwarded")
                    .into_response()
            }
        }
        strip_hop_by_hop(req.headers_mut());
        // The client sets Host from the upstream URL.
        req.headers_mut().remove(HOST);
        let timeout_ms = req
            .extensions()
            .get::<RouteTimeout>()
            .map_or(self.timeout_ms, |t| t.0);
        match tokio::time::timeout(Duration::from_millis(timeout_ms), self.client.request(req))
            .await
        {
            Ok(Ok(res)) => {
                let (mut parts, incoming) = res.into_parts();
                strip_hop_by_hop(&mut parts.headers);
                Response::from_parts(parts, body::boxed(incoming))
            }
            Ok(Err(err)) => {
                tracing::warn!(upstream = %self.authority, error = %err, "upstream request failed");
                outcome_unknown(Problem::upstream_error().into_response())
            }
            Err(_) => {
                // Dropping the request future closes its connection, so it is
                // never reused.
                tracing::warn!(upstream = %self.authority, timeout_ms, "upstream timed out");
                outcome_unknown(Problem::upstream_timeout(timeout_ms).into_response())
            }
        }
    }
}

/// Marks a response fencegate made up for a request whose fate at the
/// backend is unknown.
fn outcome_unknown(mut res: Response<Body>) -> Response<Body> {
    res.extensions_mut().insert(OutcomeUnknown);
    res
}

impl Service<Request<Body>> for Upstream {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let upstream = self.clone();
        Box::pin(async move { Ok(upstream.forward(req).await) })
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

    #[tokio::test]
    async fn targets_join_the_base_path() {
        let up = Upstream::new(
            &"http://127.0.0.1:9/base/".parse().unwrap(),
            &UpstreamOptions::default(),
        )
        .unwrap();
        let t = up.target(&"/kv/a?x=1".parse().unwrap()).unwrap();
        assert_eq!(t, "http://127.0.0.1:9/base/kv/a?x=1");
        let up = Upstream::new(
            &"http://127.0.0.1:9".parse().unwrap(),
            &UpstreamOptions::default(),
        )
        .unwrap();
        assert_eq!(
            up.target(&"/kv/a".parse().unwrap()).unwrap(),
            "http://127.0.0.1:9/kv/a"
        );
        assert!(Upstream::new(&"https://x".parse().unwrap(), &UpstreamOptions::default()).is_err());
    }
}
