//! Routes of a store that names the key in the body (SPEC §11): etcd's v3
//! JSON gateway (`kind = "etcd-v3"`).
//!
//! The gateway takes `POST` for every call, reads too, so the fence knows
//! a call by its path ([`Call::of`]) and, for a write, reads the whole
//! body (within `limits.max_body_bytes`, each wait for more at most
//! `limits.body_read_timeout_ms`) to find every key it touches
//! ([`fencegate_core::body_keys::etcd`]) and the one lease that guards
//! them all. Then the write is fenced as a write on a path route is (§4):
//! the term's token and lease id in its headers, admitted on the proxy's
//! clock, the body forwarded as it came. What cannot be fenced by one
//! lease is refused with nothing sent.

use std::time::Duration;

use bytes::Bytes;
use http::Request;

use crate::body::{self, Body, ReadError};
use crate::error::Problem;
use crate::names::LeaseName;
use fencegate_core::body_keys::etcd::{self, Call};
use fencegate_core::body_keys::KeyRoutes;

/// The key routes of an etcd gateway, in the order they were configured.
#[derive(Clone, Debug)]
pub struct EtcdRoutes {
    pub keys: KeyRoutes,
    /// Each route's own upstream deadline.
    pub timeouts_ms: Vec<Option<u64>>,
}

/// What a write to the gateway touches, once its body is read.
#[derive(Debug)]
pub enum Touches {
    /// Keys of one lease, guarded by a route with this deadline.
    Lease {
        lease: LeaseName,
        timeout_ms: Option<u64>,
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
        let (parts, body) = req.into_parts();
        let bytes = read(body, limits).await?;
        let touched = etcd::touched(call, &bytes).map_err(|bad| {
            Problem::invalid_request(format!("{}: nothing was sent to the storage", bad.0))
        })?;
        let touches = match self.keys.one_lease(&touched) {
            Ok(fenced) => Touches::Lease {
                lease: fenced.lease,
                timeout_ms: self.timeouts_ms.get(fenced.route).copied().flatten(),
            },
            Err(fencegate_core::body_keys::Refusal::NoKey) if call == Call::Txn => Touches::Nothing,
            Err(refusal) => return Err(Problem::not_one_lease(refusal)),
        };
        Ok((Request::from_parts(parts, body::full(bytes)), touches))
    }
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
