//! The fence: a tower [`Layer`] that admits or rejects each proxied request
//! before the backend sees it.
//!
//! For every request the fence resolves the guarding lease from the path. A
//! write (any method but `GET`, `HEAD`, `OPTIONS`) on a guarded path is
//! admitted only if it carries the lease's current token and the term's lease
//! id, and the term is live on the proxy's clock right now. A rejected request
//! never reaches the inner service. `Fencing-Lease-Id` is removed from every
//! request before it goes on; `Fencing-Token` is passed on so backends that
//! can compare tokens may do so.

use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};

use futures_util::future::{Either, Ready};
use http::{HeaderMap, Method, Request, Response};
use tower::{Layer, Service};

use crate::body::Body;
use crate::error::Problem;
use crate::lease::{is_valid_lease_name, LeaseStore};
use crate::route::Routes;

/// The header that carries the fencing token.
pub const FENCING_TOKEN: &str = "fencing-token";
/// The header that carries the lease id; never forwarded.
pub const FENCING_LEASE_ID: &str = "fencing-lease-id";

/// How the fence decides.
#[derive(Debug)]
pub struct FencePolicy {
    pub routes: Routes,
    pub leases: LeaseStore,
    /// Whether writes must carry `Fencing-Lease-Id` (the contract's default).
    pub require_lease_id: bool,
    /// Whether writes to paths no route guards are forwarded unchecked.
    pub allow_unrouted_writes: bool,
}

/// Whether `method` changes state at the backend. Everything but the safe
/// read methods (`GET`, `HEAD`, `OPTIONS`, WebDAV's `PROPFIND`) counts, so
/// `MKCOL`, `MOVE`, `COPY` and unknown extension methods are fenced too: a
/// method fencegate does not know is treated as the dangerous kind.
pub fn is_write(method: &Method) -> bool {
    !matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS)
        && method.as_str() != "PROPFIND"
}

/// A parsed `Fencing-Token`.
pub fn parse_token(headers: &HeaderMap) -> Result<Option<u64>, Problem> {
    let mut values = headers.get_all(FENCING_TOKEN).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(Problem::malformed_token(
            "Fencing-Token must appear exactly once",
        ));
    }
    let text = value.as_bytes();
    if text.is_empty() || text.len() > 20 || !text.iter().all(u8::is_ascii_digit) {
        return Err(Problem::malformed_token(
            "Fencing-Token must be a decimal u64",
        ));
    }
    std::str::from_utf8(text)
        .ok()
        .and_then(|t| t.parse::<u64>().ok())
        .map(Some)
        .ok_or_else(|| Problem::malformed_token("Fencing-Token must be a decimal u64"))
}

/// The presented lease id, if exactly one was sent.
pub fn lease_id_header(headers: &HeaderMap) -> Result<Option<&[u8]>, Problem> {
    let mut values = headers.get_all(FENCING_LEASE_ID).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(Problem::invalid_request(
            "Fencing-Lease-Id must appear exactly once",
        ));
    }
    Ok(Some(value.as_bytes()))
}

/// The headers a fenced request presents, checked for presence and form in
/// the contract's order: both present (428), then well formed (400).
pub fn credentials(
    headers: &HeaderMap,
    require_lease_id: bool,
) -> Result<(u64, Option<&[u8]>), Problem> {
    let has_token = headers.contains_key(FENCING_TOKEN);
    let has_id = headers.contains_key(FENCING_LEASE_ID);
    if !has_token {
        return Err(Problem::missing_token());
    }
    if require_lease_id && !has_id {
        return Err(Problem::missing_lease_id());
    }
    let token = parse_token(headers)?.ok_or_else(Problem::missing_token)?;
    let lease_id = lease_id_header(headers)?;
    Ok((token, lease_id))
}

impl FencePolicy {
    /// Decides whether `req` may go on to the backend.
    pub fn admit(&self, req: &Request<Body>) -> Result<(), Problem> {
        let matched = self
            .routes
            .resolve(req.uri().path())
            .map_err(|bad| Problem::invalid_request(bad.0))?;
        let write = is_write(req.method());
        let Some(route) = matched else {
            if write && !self.allow_unrouted_writes {
                return Err(Problem::unrouted_write());
            }
            return Ok(());
        };
        if !write && !route.fence_reads {
            return Ok(());
        }
        let lease = route.lease.as_str();
        if !is_valid_lease_name(lease) {
            return Err(Problem::invalid_lease_name(lease));
        }
        let (token, lease_id) =
            credentials(req.headers(), self.require_lease_id).map_err(|p| p.lease(lease))?;
        match self.leases.check_write(lease, token, lease_id) {
            Ok(_) => {
                tracing::debug!(lease, token, method = %req.method(), "write admitted");
                Ok(())
            }
            Err(reject) => {
                tracing::info!(lease, token, reason = reject.reason(), method = %req.method(), "write rejected");
                Err(Problem::rejected(lease, reject))
            }
        }
    }
}

/// Builds [`Fence`] services around a backend.
#[derive(Clone, Debug)]
pub struct FenceLayer {
    policy: Arc<FencePolicy>,
}

impl FenceLayer {
    pub fn new(policy: FencePolicy) -> Self {
        Self {
            policy: Arc::new(policy),
        }
    }
}

impl<S> Layer<S> for FenceLayer {
    type Service = Fence<S>;
    fn layer(&self, inner: S) -> Fence<S> {
        Fence {
            policy: self.policy.clone(),
            inner,
        }
    }
}

/// A service that forwards only admitted requests to `S`.
#[derive(Clone, Debug)]
pub struct Fence<S> {
    policy: Arc<FencePolicy>,
    inner: S,
}

impl<S> Service<Request<Body>> for Fence<S>
where
    S: Service<Request<Body>, Response = Response<Body>, Error = Infallible>,
{
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = Either<S::Future, Ready<Result<Response<Body>, Infallible>>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<Body>) -> Self::Future {
        match self.policy.admit(&req) {
            Ok(()) => {
                // The lease id is a credential for fencegate only.
                req.headers_mut().remove(FENCING_LEASE_ID);
                Either::Left(self.inner.call(req))
            }
            Err(problem) => Either::Right(futures_util::future::ready(Ok(problem.into_response()))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        h
    }

    #[test]
    fn token_forms() {
        let ok = |v: &str| parse_token(&headers(&[("fencing-token", v)]));
        assert_eq!(ok("0").unwrap(), Some(0));
        assert_eq!(ok("18446744073709551615").unwrap(), Some(u64::MAX));
        for bad in [
            "",
            "+1",
            "-1",
            "1.0",
            "0x1",
            "1 2",
            "18446744073709551616",
            "abc",
        ] {
            assert_eq!(
                ok(bad).unwrap_err().reason(),
                "malformed-fencing-token",
                "{bad:?}"
            );
        }
        let two = headers(&[("fencing-token", "1"), ("fencing-token", "1")]);
        assert!(parse_token(&two).is_err());
    }

    #[test]
    fn presence_is_checked_before_form() {
        let r = |pairs: &[(&str, &str)]| credentials(&headers(pairs), true).unwrap_err().reason();
        assert_eq!(r(&[]), "missing-fencing-token");
        assert_eq!(r(&[("fencing-lease-id", "x")]), "missing-fencing-token");
        // A malformed token with no lease id: the missing header decides.
        assert_eq!(r(&[("fencing-token", "x")]), "missing-lease-id");
        assert_eq!(
            r(&[("fencing-token", "x"), ("fencing-lease-id", "y")]),
            "malformed-fencing-token"
        );
        let only_token = headers(&[("fencing-token", "7")]);
        let (t, id) = credentials(&only_token, false).unwrap();
        assert_eq!((t, id), (7, None));
    }

    #[test]
    fn writes_are_everything_but_safe_reads() {
        for m in [
            "PUT",
            "POST",
            "PATCH",
            "DELETE",
            "MKCOL",
            "MOVE",
            "COPY",
            "PROPPATCH",
        ] {
            assert!(is_write(&Method::from_bytes(m.as_bytes()).unwrap()), "{m}");
        }
        for m in [
            Method::GET,
            Method::HEAD,
            Method::OPTIONS,
            Method::from_bytes(b"PROPFIND").unwrap(),
        ] {
            assert!(!is_write(&m));
        }
    }
}
