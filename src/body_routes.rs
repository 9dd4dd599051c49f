//! Routes of a store that names the key in the body (SPEC §11): etcd's v3
//! JSON gateway (`kind = "etcd-v3"`) and DynamoDB's API (`kind =
//! "dynamodb"`, whose writes the client conditions on the token itself,
//! since SigV4 signs the body: [`DynamoRoutes::check`]).
//!
//! The gateway takes `POST` for every call, reads too, so the fence knows
//! a call by its path ([`Call::of`]) and, for a write, reads the whole
//! body (within `limits.max_body_bytes`, each wait for more at most
//! `limits.body_read_timeout_ms`) to find every key it touches
//! ([`fencegate_core::body_keys::etcd`]) and the one lease that guards
//! them all. Then the write is fenced as a write on a path route is (§4):
//! the term's token and lease id in its headers, admitted on the proxy's
//! clock; and it goes to etcd as a transaction that compares and sets the
//! lease's fence key ([`fenced_request`]), whose answer is reshaped as the
//! answer to the call the client made ([`reshape`]). What cannot be fenced
//! by one lease is refused with nothing sent.

use std::time::Duration;

use bytes::Bytes;
use http::Request;

use crate::body::{self, Body, ReadError};
use crate::error::{Problem, Reason};
use crate::names::LeaseName;
use fencegate_core::body_keys::dynamodb::{self, Op, Table};
use fencegate_core::body_keys::etcd::{self, Call};
use fencegate_core::body_keys::json::Json;
use fencegate_core::body_keys::KeyRoutes;

/// The key routes of an etcd gateway, in the order they were configured.
#[derive(Clone, Debug)]
pub struct EtcdRoutes {
    pub keys: KeyRoutes,
    /// Each route's own upstream deadline.
    pub timeouts_ms: Vec<Option<u64>>,
    /// Where each lease's fence key lives: this prefix, then its name.
    pub fence_prefix: String,
}

/// The routes of DynamoDB's API, in the order they were configured, and
/// the tables they name.
#[derive(Clone, Debug)]
pub struct DynamoRoutes {
    pub keys: KeyRoutes,
    pub tables: Vec<Table>,
    /// Each route's own upstream deadline.
    pub timeouts_ms: Vec<Option<u64>>,
}

impl DynamoRoutes {
    /// Reads the body of a write `op` and finds the lease of the items it
    /// writes; the request comes back with the same body, whole.
    pub async fn read_write(
        &self,
        req: Request<Body>,
        op: Op,
        limits: BodyLimits,
    ) -> Result<(Request<Body>, Touches, Json), Problem> {
        read_lease(req, limits, &self.keys, &self.timeouts_ms, |bytes| {
            let doc = dynamodb::parse(bytes).map_err(|bad| bad.0)?;
            let touched = dynamodb::touched_in(op, &doc, &self.tables).map_err(|bad| bad.0)?;
            Ok((touched, doc))
        })
        .await
    }

    /// An operation that changes data and names no item (PartiQL, a table
    /// deleted, a TTL set), allowed as an unrouted write: only if its body
    /// names no table a route guards, anywhere (a statement's text
    /// included; a name that merely contains one counts too).
    pub async fn unrouted(
        &self,
        req: Request<Body>,
        limits: BodyLimits,
    ) -> Result<Request<Body>, Problem> {
        let (parts, body) = req.into_parts();
        let bytes = read(body, limits).await?;
        if let Some(table) = self
            .tables
            .iter()
            .find(|t| bytes.windows(t.name.len()).any(|w| w == t.name.as_bytes()))
        {
            return Err(Problem::new(
                Reason::UnroutedWrite,
                format!(
                    "this DynamoDB operation changes data and names the table {:?}, which a route guards: it is refused even though unrouted writes are allowed",
                    table.name
                ),
            ));
        }
        Ok(Request::from_parts(parts, body::full(bytes)))
    }

    /// Whether the write of `op` (its body as [`Self::read_write`] read
    /// it) carries `token` as DynamoDB must compare it (SPEC §11); `428
    /// precondition-required` saying what to add if not.
    pub fn check(&self, op: Op, doc: &Json, token: u64, lease: &str) -> Result<(), Problem> {
        dynamodb::check_in(op, doc, &self.tables, token).map_err(|missing| {
            Problem::new(
                Reason::PreconditionRequired,
                format!("{}: nothing was sent to the storage", missing.0),
            )
            .lease(lease)
        })
    }
}

/// What a write to the gateway touches, once its body is read.
#[derive(Debug)]
pub enum Touches {
    /// Keys of one lease, guarded by a route with this deadline; the body
    /// as it came.
    Lease {
        lease: LeaseName,
        timeout_ms: Option<u64>,
        body: Bytes,
    },
    /// No key: a transaction of reads only.
    Nothing,
}

/// How much of a body the fence reads, and how long it waits for more.
#[derive(Clone, Copy, Debug)]
pub struct BodyLimits {
    pub max_bytes: usize,
    pub idle: Duration,
}

impl EtcdRoutes {
    /// Reads the body of a write `call` and finds what it touches; the
    /// request comes back with the same body, whole.
    pub async fn read_write(
        &self,
        req: Request<Body>,
        call: Call,
        limits: BodyLimits,
    ) -> Result<(Request<Body>, Touches), Problem> {
        read_lease(req, limits, &self.keys, &self.timeouts_ms, |bytes| {
            Ok((etcd::touched(call, bytes).map_err(|bad| bad.0)?, ()))
        })
        .await
        .map(|(req, touches, ())| (req, touches))
    }
}

/// Reads the body of a write whole and finds, by `touched` (what the
/// store's module reads in it, and what it keeps of its reading), the one
/// lease of `keys` that guards every key it touches; the request comes
/// back with the same body. A write that touches no key (a transaction of
/// reads or condition checks only) is [`Touches::Nothing`].
async fn read_lease<T>(
    req: Request<Body>,
    limits: BodyLimits,
    keys: &KeyRoutes,
    timeouts_ms: &[Option<u64>],
    touched: impl FnOnce(&[u8]) -> Result<(Vec<fencegate_core::body_keys::Touched>, T), String>,
) -> Result<(Request<Body>, Touches, T), Problem> {
    let (parts, body) = req.into_parts();
    let bytes = read(body, limits).await?;
    let (touched, kept) = touched(&bytes).map_err(|why| {
        Problem::invalid_request(format!("{why}: nothing was sent to the storage"))
    })?;
    let touches = match keys.one_lease(&touched) {
        Ok(fenced) => Touches::Lease {
            lease: fenced.lease,
            timeout_ms: timeouts_ms.get(fenced.route).copied().flatten(),
            body: bytes.clone(),
        },
        Err(fencegate_core::body_keys::Refusal::NoKey) => Touches::Nothing,
        Err(refusal) => return Err(Problem::not_one_lease(refusal)),
    };
    Ok((Request::from_parts(parts, body::full(bytes)), touches, kept))
}

/// The request that carries out a write of `call` to `lease` under the
/// term of `token`, as a transaction that etcd runs only if the lease's
/// fence key names no later term ([`etcd::fenced`]): the same head, sent
/// to the gateway's `kv/txn`.
pub fn fenced_request(
    mut req: Request<Body>,
    call: Call,
    body: &[u8],
    fence_key: &[u8],
    token: u64,
) -> Result<(Request<Body>, Bytes), Problem> {
    let txn = etcd::fenced(call, body, fence_key, token).map_err(|bad| {
        Problem::invalid_request(format!("{}: nothing was sent to the storage", bad.0))
    })?;
    let txn = Bytes::from(txn);
    let path = etcd::txn_path(req.uri().path());
    *req.uri_mut() = http::Uri::from_static(path);
    let headers = req.headers_mut();
    headers.remove(http::header::TRANSFER_ENCODING);
    headers.insert(
        http::header::CONTENT_LENGTH,
        http::HeaderValue::from(txn.len()),
    );
    headers.insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    *req.body_mut() = body::full(txn.clone());
    Ok((req, txn))
}

/// etcd's answer to a fenced write, for the client; or word that it only
/// made the lease's fence key, and the write must go again.
#[derive(Debug)]
pub enum Reshaped {
    Answer(http::Response<Body>),
    FenceCreated,
}

/// The most of etcd's answer to a fenced write that is read to reshape it
/// (a transaction's reads are in it).
pub const MAX_ANSWER_BYTES: usize = 64 << 20;

/// etcd's answer to a fenced write, reshaped as the answer to the call the
/// client made; a refusal by etcd (a later term wrote) as `412
/// stale-fencing-token`. An answer that is not a 200 passes as it is.
pub async fn reshape(
    res: http::Response<Body>,
    call: Call,
    lease: &str,
    idle: Duration,
) -> Reshaped {
    if res.status() != http::StatusCode::OK {
        return Reshaped::Answer(res);
    }
    let (mut parts, body) = res.into_parts();
    let bytes = match body::collect_idle(body, MAX_ANSWER_BYTES, Some(idle)).await {
        Ok(bytes) => bytes,
        Err(_) => {
            return Reshaped::Answer(
                Problem::new(
                    Reason::UpstreamError,
                    "etcd's answer to the fenced write could not be read whole; it may have been applied",
                )
                .into_response(),
            )
        }
    };
    Reshaped::Answer(match etcd::answer(call, &bytes) {
        etcd::Answer::Applied(shaped) => {
            parts.headers.remove(http::header::TRANSFER_ENCODING);
            parts.headers.insert(
                http::header::CONTENT_LENGTH,
                http::HeaderValue::from(shaped.len()),
            );
            http::Response::from_parts(parts, body::full(shaped))
        }
        etcd::Answer::Refused { stored } => {
            Problem::refused_by_storage(lease, stored).into_response()
        }
        etcd::Answer::FenceCreated => return Reshaped::FenceCreated,
        etcd::Answer::Unreadable(why) => {
            tracing::warn!(
                lease,
                why,
                "etcd's answer to a fenced write is not one fencegate can read"
            );
            Problem::new(
                Reason::UpstreamError,
                format!("{why}; the write may have been applied"),
            )
            .into_response()
        }
    })
}

/// The whole body, within the limits.
async fn read(body: Body, limits: BodyLimits) -> Result<Bytes, Problem> {
    match body::collect_idle(body, limits.max_bytes, Some(limits.idle)).await {
        Ok(bytes) => Ok(bytes),
        Err(ReadError::TooLarge) => Err(Problem::payload_too_large(limits.max_bytes as u64)),
        Err(ReadError::Stalled) => Err(Problem::request_timeout(
            u64::try_from(limits.idle.as_millis()).unwrap_or(u64::MAX),
        )),
        Err(ReadError::Failed(_)) => Err(Problem::invalid_request(
            "the request body could not be read: nothing was sent to the storage",
        )),
    }
}
