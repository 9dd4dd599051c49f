//! One mapping from errors to HTTP: every error fencegate answers itself is an
//! RFC 9457 `application/problem+json` document with a stable `reason`.
//!
//! Modules return their own typed errors; this is the only place that turns
//! them into status codes and bodies. Problem details never carry internals
//! (no lease ids, no upstream addresses, no error chains).

use bytes::Bytes;
use http::header::{HeaderName, HeaderValue, CONTENT_TYPE, RETRY_AFTER};
use http::{Response, StatusCode};
use serde::Serialize;

use crate::body::{self, Body};
use crate::lease::{AcquireError, Reject, RenewError};
use crate::wire;

/// Every reason fencegate answers with, and its status, slug (the
/// contract's `reason` member) and title, in one table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reason {
    MissingFencingToken,
    MissingLeaseId,
    PreconditionRequired,
    MalformedFencingToken,
    InvalidLeaseName,
    InvalidTtl,
    InvalidRequest,
    StaleFencingToken,
    UnknownFencingToken,
    LeaseExpired,
    LeaseReleased,
    LeaseIdMismatch,
    UnroutedWrite,
    UnroutedKey,
    WriteSpansLeases,
    Forbidden,
    LeaseHeld,
    Unauthorized,
    PayloadTooLarge,
    HeadersTooLarge,
    UnknownLease,
    NotFound,
    MethodNotAllowed,
    RequestTimeout,
    TooManyLeases,
    RateLimited,
    LeaseStoreUnavailable,
    Draining,
    NotPrimary,
    UpstreamError,
    UpstreamTimeout,
}

impl Reason {
    /// Every reason, for documentation and tests.
    pub const ALL: [Reason; 31] = [
        Reason::MissingFencingToken,
        Reason::MissingLeaseId,
        Reason::PreconditionRequired,
        Reason::MalformedFencingToken,
        Reason::InvalidLeaseName,
        Reason::InvalidTtl,
        Reason::InvalidRequest,
        Reason::StaleFencingToken,
        Reason::UnknownFencingToken,
        Reason::LeaseExpired,
        Reason::LeaseReleased,
        Reason::LeaseIdMismatch,
        Reason::UnroutedWrite,
        Reason::UnroutedKey,
        Reason::WriteSpansLeases,
        Reason::Forbidden,
        Reason::LeaseHeld,
        Reason::Unauthorized,
        Reason::PayloadTooLarge,
        Reason::HeadersTooLarge,
        Reason::UnknownLease,
        Reason::NotFound,
        Reason::MethodNotAllowed,
        Reason::RequestTimeout,
        Reason::TooManyLeases,
        Reason::RateLimited,
        Reason::LeaseStoreUnavailable,
        Reason::Draining,
        Reason::NotPrimary,
        Reason::UpstreamError,
        Reason::UpstreamTimeout,
    ];

    /// `(status, slug, title)`: one row per reason, a table rather than
    /// logic, so it stays one function however long.
    fn row(self) -> (StatusCode, &'static str, &'static str) {
        match self {
            Reason::MissingFencingToken => (
                StatusCode::PRECONDITION_REQUIRED,
                "missing-fencing-token",
                "Missing fencing token",
            ),
            Reason::MissingLeaseId => (
                StatusCode::PRECONDITION_REQUIRED,
                "missing-lease-id",
                "Missing lease id",
            ),
            Reason::PreconditionRequired => (
                StatusCode::PRECONDITION_REQUIRED,
                "precondition-required",
                "Precondition required",
            ),
            Reason::MalformedFencingToken => (
                StatusCode::BAD_REQUEST,
                "malformed-fencing-token",
                "Malformed fencing token",
            ),
            Reason::InvalidLeaseName => (
                StatusCode::BAD_REQUEST,
                "invalid-lease-name",
                "Invalid lease name",
            ),
            Reason::InvalidTtl => (StatusCode::BAD_REQUEST, "invalid-ttl", "Invalid TTL"),
            Reason::InvalidRequest => (
                StatusCode::BAD_REQUEST,
                "invalid-request",
                "Invalid request",
            ),
            Reason::StaleFencingToken => (
                StatusCode::PRECONDITION_FAILED,
                "stale-fencing-token",
                "Stale fencing token",
            ),
            Reason::UnknownFencingToken => (
                StatusCode::PRECONDITION_FAILED,
                "unknown-fencing-token",
                "Unknown fencing token",
            ),
            Reason::LeaseExpired => (
                StatusCode::PRECONDITION_FAILED,
                "lease-expired",
                "Lease expired",
            ),
            Reason::LeaseReleased => (
                StatusCode::PRECONDITION_FAILED,
                "lease-released",
                "Lease released",
            ),
            Reason::LeaseIdMismatch => (
                StatusCode::FORBIDDEN,
                "lease-id-mismatch",
                "Lease id mismatch",
            ),
            Reason::UnroutedWrite => (StatusCode::FORBIDDEN, "unrouted-write", "Unrouted write"),
            Reason::UnroutedKey => (StatusCode::FORBIDDEN, "unrouted-key", "Unrouted key"),
            Reason::WriteSpansLeases => (
                StatusCode::BAD_REQUEST,
                "write-spans-leases",
                "Write spans leases",
            ),
            Reason::Forbidden => (StatusCode::FORBIDDEN, "forbidden", "Forbidden"),
            Reason::LeaseHeld => (StatusCode::CONFLICT, "lease-held", "Lease held"),
            Reason::Unauthorized => (StatusCode::UNAUTHORIZED, "unauthorized", "Unauthorized"),
            Reason::PayloadTooLarge => (
                StatusCode::PAYLOAD_TOO_LARGE,
                "payload-too-large",
                "Payload too large",
            ),
            Reason::HeadersTooLarge => (
                StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
                "headers-too-large",
                "Headers too large",
            ),
            Reason::UnknownLease => (StatusCode::NOT_FOUND, "unknown-lease", "Unknown lease"),
            Reason::NotFound => (StatusCode::NOT_FOUND, "not-found", "Not found"),
            Reason::MethodNotAllowed => (
                StatusCode::METHOD_NOT_ALLOWED,
                "method-not-allowed",
                "Method not allowed",
            ),
            Reason::RequestTimeout => (
                StatusCode::REQUEST_TIMEOUT,
                "request-timeout",
                "Request timeout",
            ),
            Reason::TooManyLeases => (
                StatusCode::TOO_MANY_REQUESTS,
                "too-many-leases",
                "Too many leases",
            ),
            Reason::RateLimited => (
                StatusCode::TOO_MANY_REQUESTS,
                "rate-limited",
                "Rate limited",
            ),
            Reason::LeaseStoreUnavailable => (
                StatusCode::SERVICE_UNAVAILABLE,
                "lease-store-unavailable",
                "Lease store unavailable",
            ),
            Reason::Draining => (StatusCode::SERVICE_UNAVAILABLE, "draining", "Draining"),
            Reason::NotPrimary => (
                StatusCode::SERVICE_UNAVAILABLE,
                "not-primary",
                "Not the primary",
            ),
            Reason::UpstreamError => (StatusCode::BAD_GATEWAY, "upstream-error", "Upstream error"),
            Reason::UpstreamTimeout => (
                StatusCode::GATEWAY_TIMEOUT,
                "upstream-timeout",
                "Upstream timeout",
            ),
        }
    }

    /// The HTTP status this reason is answered with.
    pub fn status(self) -> StatusCode {
        self.row().0
    }

    /// The stable `reason` member (also the metrics label).
    pub fn slug(self) -> &'static str {
        self.row().1
    }

    /// The RFC 9457 `title`: the same for every occurrence.
    pub fn title(self) -> &'static str {
        self.row().2
    }
}

impl From<&Reject> for Reason {
    fn from(reject: &Reject) -> Self {
        match reject {
            Reject::UnknownToken { .. } => Reason::UnknownFencingToken,
            Reject::StaleToken { .. } => Reason::StaleFencingToken,
            Reject::LeaseIdMismatch { .. } => Reason::LeaseIdMismatch,
            Reject::NotHolder { .. } => Reason::Forbidden,
            Reject::Released { .. } => Reason::LeaseReleased,
            Reject::Expired { .. } => Reason::LeaseExpired,
        }
    }
}

/// A problem document about to be sent. Boxed, so `Result<_, Problem>` stays
/// one word wide on the hot path.
#[derive(Clone, Debug)]
pub struct Problem(Box<Doc>);

/// The RFC 9457 members.
#[derive(Clone, Debug, Serialize)]
struct Doc {
    #[serde(rename = "type")]
    type_uri: String,
    title: &'static str,
    #[serde(serialize_with = "ser_status")]
    status: StatusCode,
    detail: String,
    #[serde(serialize_with = "ser_reason")]
    reason: Reason,
    #[serde(skip_serializing_if = "Option::is_none")]
    lease: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    current_token: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    holder: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    expires_in_ms: Option<u64>,
    /// The primary's advertised URL (`null` while none is known), on
    /// `not-primary` only.
    #[serde(skip_serializing_if = "Option::is_none")]
    primary: Option<Option<String>>,
    /// On `precondition-required`, where fencegate knows the key's state
    /// but may not add it: the precondition to send.
    #[serde(skip_serializing_if = "Option::is_none")]
    if_match: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    if_none_match: Option<&'static str>,
    #[serde(skip)]
    retry_after_s: Option<u64>,
    /// Answer with `Connection: close`.
    #[serde(skip)]
    close: bool,
    /// The `Allow` header of a 405.
    #[serde(skip)]
    allow: Option<&'static str>,
}

fn ser_reason<S: serde::Serializer>(reason: &Reason, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(reason.slug())
}

fn ser_status<S: serde::Serializer>(status: &StatusCode, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_u16(status.as_u16())
}

impl Problem {
    /// A problem of `reason`, with a human `detail`.
    pub fn new(reason: Reason, detail: impl Into<String>) -> Self {
        Self(Box::new(Doc {
            type_uri: format!("urn:fencegate:problem:{}", reason.slug()),
            title: reason.title(),
            status: reason.status(),
            detail: detail.into(),
            reason,
            lease: None,
            current_token: None,
            holder: None,
            expires_in_ms: None,
            primary: None,
            if_match: None,
            if_none_match: None,
            retry_after_s: None,
            close: false,
            allow: None,
        }))
    }

    /// Names the lease the problem is about.
    pub fn lease(mut self, lease: &str) -> Self {
        self.0.lease = Some(lease.to_owned());
        self
    }

    /// Closes the connection after this answer (the rest of the request may
    /// not be where the connection thinks it is).
    pub fn closing_connection(mut self) -> Self {
        self.0.close = true;
        self
    }

    /// Tells the client when to try again (`Retry-After`, whole seconds
    /// rounded up).
    pub fn retry_after_ms(mut self, ms: u64) -> Self {
        self.0.retry_after_s = Some(ms.div_ceil(1000));
        self
    }

    /// The same problem without the lease's current holder, token and time
    /// left, for a caller who may not see them.
    pub fn without_term_details(mut self) -> Self {
        self.0.current_token = None;
        self.0.holder = None;
        self.0.expires_in_ms = None;
        self
    }

    /// The problem+json document, as the body of its answer holds it.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(&*self.0).unwrap_or_default()
    }

    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        self.0.status
    }

    /// The reason.
    pub fn reason(&self) -> Reason {
        self.0.reason
    }

    // Constructors for the contract's rows that have no typed source error.

    pub fn missing_token() -> Self {
        Self::new(
            Reason::MissingFencingToken,
            "a fenced request needs a Fencing-Token header",
        )
    }

    pub fn missing_lease_id() -> Self {
        Self::new(
            Reason::MissingLeaseId,
            "a fenced request needs a Fencing-Lease-Id header",
        )
    }

    pub fn malformed_token(detail: impl Into<String>) -> Self {
        Self::new(Reason::MalformedFencingToken, detail)
    }

    pub fn invalid_lease_name(name: &str) -> Self {
        // The name is echoed only when it is printable and short.
        let shown = if name.len() <= 200 && !name.chars().any(char::is_control) {
            format!("{name:?}")
        } else {
            "the name".to_owned()
        };
        Self::new(
            Reason::InvalidLeaseName,
            format!("{shown} is not a lease name: use 1-128 bytes of [A-Za-z0-9._-]"),
        )
    }

    pub fn invalid_request(detail: impl Into<String>) -> Self {
        Self::new(Reason::InvalidRequest, detail)
    }

    pub fn invalid_ttl(min_ttl_ms: u64, max_ttl_ms: u64) -> Self {
        Self::new(
            Reason::InvalidTtl,
            format!("ttl_ms must be between {min_ttl_ms} and {max_ttl_ms} inclusive"),
        )
    }

    pub fn unrouted_write() -> Self {
        Self::new(
            Reason::UnroutedWrite,
            "no route guards this path, and unrouted writes are not allowed",
        )
    }

    /// A write to a store that names the key in the body (SPEC §11) that
    /// one lease cannot fence: a key no route guards (403 `unrouted-key`),
    /// keys of several leases or a range past one lease's keys (400
    /// `write-spans-leases`).
    pub fn not_one_lease(refusal: fencegate_core::body_keys::Refusal) -> Self {
        use fencegate_core::body_keys::Refusal;
        match refusal {
            Refusal::Unrouted(key) => Self::new(
                Reason::UnroutedKey,
                format!("no key route guards the key {key:?}: nothing was sent to the storage"),
            ),
            Refusal::SpansLeases(a, b) => Self::new(
                Reason::WriteSpansLeases,
                format!(
                    "one write may touch the keys of one lease only, and {a:?} and {b:?} belong to different leases: nothing was sent to the storage"
                ),
            ),
            Refusal::RangeSpansLeases(from, to) => Self::new(
                Reason::WriteSpansLeases,
                format!(
                    "the range from {from:?} to {to:?} reaches past one lease's keys (a range must lie inside one lease's prefix followed by /): nothing was sent to the storage"
                ),
            ),
            Refusal::Reserved(what) => Self::new(
                Reason::UnroutedKey,
                format!("{what} reaches fencegate's fence keys, which no client writes: nothing was sent to the storage"),
            ),
            Refusal::NoKey => Self::invalid_request("the write touches no key"),
        }
    }

    pub fn payload_too_large(limit: u64) -> Self {
        Self::new(
            Reason::PayloadTooLarge,
            format!("the body is over the limit of {limit} bytes"),
        )
    }

    pub fn headers_too_large(limit: usize) -> Self {
        Self::new(
            Reason::HeadersTooLarge,
            format!("the request headers are over the limit of {limit} bytes"),
        )
    }

    pub fn unknown_lease(name: &str) -> Self {
        Self::new(Reason::UnknownLease, "this lease has never been acquired").lease(name)
    }

    pub fn store_unavailable(detail: impl Into<String>) -> Self {
        Self::new(Reason::LeaseStoreUnavailable, detail)
    }

    /// The client did not send the body it announced in time; the
    /// connection is closed.
    pub fn request_timeout(timeout_ms: u64) -> Self {
        Self::new(
            Reason::RequestTimeout,
            format!("the request body did not arrive within {timeout_ms} ms"),
        )
        .closing_connection()
    }

    /// A write the storage itself refused because a later term of `lease`
    /// wrote first (SPEC §11): the storage's fence names that term's token.
    pub fn refused_by_storage(lease: &str, stored: Option<u64>) -> Self {
        let mut p = Self::new(
            Reason::StaleFencingToken,
            "the storage refused the write: a later term of this lease has written (its fence key names that term); nothing was applied",
        )
        .lease(lease);
        p.0.current_token = stored;
        p
    }

    pub fn upstream_error() -> Self {
        Self::new(Reason::UpstreamError, "the backend failed to answer")
    }

    pub fn upstream_timeout(timeout_ms: u64) -> Self {
        Self::new(
            Reason::UpstreamTimeout,
            format!("the backend did not answer within {timeout_ms} ms"),
        )
    }

    /// A cluster member that may not serve this request: a standby, or a
    /// primary that could not confirm its primacy in time. `primary` is the
    /// primary's advertised URL when known (also sent as `Fencegate-Primary`).
    pub fn not_primary(detail: &str, primary: Option<&str>) -> Self {
        let mut problem = Self::new(Reason::NotPrimary, detail).retry_after_ms(1000);
        problem.0.primary = Some(primary.map(str::to_owned));
        problem
    }

    /// A write on a route with preconditions (SPEC §10) that carries none
    /// and gets none: fencegate knows no state of its key, or (`signed`)
    /// the request's signature covers the precondition headers, and
    /// `known` is the state the client should name itself.
    pub fn precondition_required(
        lease: &str,
        required: crate::precondition::Required,
        signed: bool,
    ) -> Self {
        use crate::precondition::{KeyState, Required};
        let detail: std::borrow::Cow<'static, str> = match (&required, signed) {
            (Required::Send(_), _) => "this request's signature (Azure Shared Key) covers If-Match and If-None-Match, so fencegate cannot add the precondition this route needs: send the one in this problem's if_match or if_none_match member yourself (nothing was sent to the storage)".into(),
            (Required::Unknown, true) => "this route needs a precondition on every write, fencegate knows no state of this key, and this request's signature (Azure Shared Key) covers the precondition headers: read the key once through fencegate (GET or HEAD), then send If-Match or If-None-Match yourself (nothing was sent to the storage)".into(),
            (Required::Unknown, false) => "this route needs a precondition on every write and fencegate knows no state of this key: read it once through fencegate (GET or HEAD) and send the write again, or send If-Match or If-None-Match yourself (nothing was sent to the storage)".into(),
            (Required::DeleteOfAbsent, _) => "fencegate last saw this key absent, and no precondition a storage evaluates on a DELETE names an absent key (S3 compares If-Match only), so a late DELETE could remove what a later term writes: there is nothing to delete; if the key may have been written since, read it once through fencegate and send the DELETE again (nothing was sent to the storage)".into(),
            (Required::NotEvaluated, _) => "this operation changes what the key holds, but the storage evaluates no precondition on it (Azure's Undelete Blob, Set Blob Expiry, Abort Copy Blob, or an operation fencegate does not know), so a late one could undo what a later term wrote: not taken on a route with preconditions (nothing was sent to the storage)".into(),
            (Required::Unprotected(why), _) => format!(
                "this write's own precondition protects nothing the storage will compare: {}; send one that does, or none and fencegate adds one (nothing was sent to the storage)",
                why.why()
            )
            .into(),
        };
        let mut p = Self::new(Reason::PreconditionRequired, detail).lease(lease);
        match required {
            Required::Send(KeyState::Tagged(tag)) => {
                p.0.if_match = Some(String::from_utf8_lossy(&tag).into_owned());
            }
            Required::Send(KeyState::Absent) => p.0.if_none_match = Some("*"),
            _ => {}
        }
        p
    }

    /// A write held at the handover barrier past its wait limit;
    /// `retry_after_ms` when only writes sent before a restart hold it back,
    /// so it is known when they will have settled.
    pub fn barrier_timeout(lease: &str, retry_after_ms: Option<u64>) -> Self {
        let detail = if retry_after_ms.is_some() {
            "writes of an earlier term of this lease sent before fencegate restarted (or, in a cluster, before this member took over) may still be unfinished at the backend"
        } else {
            "writes of an earlier term of this lease are still unfinished at the backend"
        };
        let problem = Self::new(Reason::UpstreamTimeout, detail).lease(lease);
        match retry_after_ms {
            Some(ms) => problem.retry_after_ms(ms),
            None => problem,
        }
    }

    pub fn unauthorized() -> Self {
        Self::new(
            Reason::Unauthorized,
            "send Authorization: Bearer <secret> with a known secret",
        )
    }

    pub fn forbidden(detail: impl Into<String>) -> Self {
        Self::new(Reason::Forbidden, detail)
    }

    pub fn not_found() -> Self {
        Self::new(Reason::NotFound, "no such fencegate endpoint")
    }

    /// 405, with the `Allow` header listing the methods that are.
    pub fn method_not_allowed(allow: &'static str) -> Self {
        let mut p = Self::new(
            Reason::MethodNotAllowed,
            format!("this endpoint takes {allow} only"),
        );
        p.0.allow = Some(allow);
        p
    }

    /// A refused write, renew or release of `lease`.
    pub fn rejected(lease: &str, reject: Reject) -> Self {
        let detail = match reject {
            Reject::UnknownToken { .. } => "this fencing token was never issued for this lease",
            Reject::StaleToken { .. } => "a newer term of this lease exists; this token is stale",
            Reject::LeaseIdMismatch { .. } => "the lease id does not belong to this term",
            Reject::NotHolder { .. } => "this term of the lease is held by another caller",
            Reject::Released { .. } => "this term of the lease was released",
            Reject::Expired { .. } => "this term of the lease has expired; acquire it again",
        };
        let mut p = Self::new(Reason::from(&reject), detail).lease(lease);
        p.0.current_token = Some(reject.current_token());
        p
    }

    /// A refused acquire of `lease`.
    pub fn acquire_failed(lease: &str, err: AcquireError) -> Self {
        match err {
            AcquireError::Held(held) => {
                let mut p = Self::new(
                    Reason::LeaseHeld,
                    "another holder has a live term of this lease",
                )
                .lease(lease);
                p.0.current_token = Some(held.token);
                p.0.holder = Some(held.holder);
                p.0.expires_in_ms = Some(held.expires_in_ms);
                p.0.retry_after_s = Some(held.expires_in_ms.div_ceil(1000));
                p
            }
            AcquireError::InvalidTtl {
                min_ttl_ms,
                max_ttl_ms,
            } => Self::invalid_ttl(min_ttl_ms, max_ttl_ms),
            AcquireError::Invalid(detail) => Self::invalid_request(detail),
            AcquireError::Unavailable(detail) => Self::store_unavailable(detail).lease(lease),
            AcquireError::RateLimited { retry_after_ms } => {
                let mut p = Self::new(
                    Reason::RateLimited,
                    "this holder is acquiring faster than the configured rate",
                )
                .lease(lease);
                p.0.retry_after_s = Some(retry_after_ms.div_ceil(1000));
                p
            }
            AcquireError::TooManyLeases { max_leases } => Self::new(
                Reason::TooManyLeases,
                format!("the store already holds its maximum of {max_leases} leases"),
            )
            .lease(lease),
        }
    }

    /// A refused renew of `lease`.
    pub fn renew_failed(lease: &str, err: RenewError) -> Self {
        match err {
            RenewError::Rejected(reject) => Self::rejected(lease, reject),
            RenewError::InvalidTtl {
                min_ttl_ms,
                max_ttl_ms,
            } => Self::invalid_ttl(min_ttl_ms, max_ttl_ms),
        }
    }

    /// The HTTP response for this problem.
    pub fn into_response(self) -> Response<Body> {
        let json = serde_json::to_vec(&*self.0).unwrap_or_default();
        let mut res = Response::new(body::full(Bytes::from(json)));
        *res.status_mut() = self.0.status;
        res.headers_mut().insert(
            CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        if let Some(secs) = self.0.retry_after_s {
            res.headers_mut()
                .insert(RETRY_AFTER, HeaderValue::from(secs));
        }
        if let Some(Some(url)) = &self.0.primary {
            if let Ok(url) = HeaderValue::from_str(url) {
                res.headers_mut()
                    .insert(HeaderName::from_static(wire::FENCEGATE_PRIMARY), url);
            }
        }
        if let Some(allow) = self.0.allow {
            res.headers_mut()
                .insert(http::header::ALLOW, HeaderValue::from_static(allow));
        }
        if self.0.close {
            res.headers_mut()
                .insert(http::header::CONNECTION, HeaderValue::from_static("close"));
        }
        if self.0.status == StatusCode::UNAUTHORIZED {
            res.headers_mut().insert(
                http::header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"fencegate\""),
            );
        }
        res
    }
}

/// An error and all its causes, for a log line.
pub(crate) fn cause(err: &dyn std::error::Error) -> String {
    let mut out = err.to_string();
    let mut source = err.source();
    while let Some(e) = source {
        out.push_str(": ");
        out.push_str(&e.to_string());
        source = e.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lease::Held;

    #[test]
    fn retry_after_rounds_up_to_whole_seconds() {
        for (ms, secs) in [(1, "1"), (1000, "1"), (1001, "2"), (3000, "3")] {
            let res = Problem::acquire_failed(
                "l",
                AcquireError::Held(Held {
                    holder: "B".into(),
                    token: 2,
                    expires_in_ms: ms,
                }),
            )
            .into_response();
            assert_eq!(res.status(), 409);
            assert_eq!(res.headers()[RETRY_AFTER], secs);
        }
    }

    /// The slugs are the contract's: distinct, kebab-case, each with a title
    /// and an error status.
    #[test]
    fn every_reason_has_one_row() {
        let mut slugs = std::collections::HashSet::new();
        for reason in Reason::ALL {
            assert!(slugs.insert(reason.slug()), "{reason:?} repeats a slug");
            assert!(reason
                .slug()
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b == b'-'));
            assert!(!reason.title().is_empty());
            assert!(reason.status().is_client_error() || reason.status().is_server_error());
        }
    }
}
