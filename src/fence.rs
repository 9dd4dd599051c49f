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
//!
//! Admission also enforces the handover guarantee: an admitted write holds
//! back newer terms until the backend has answered and its response body has
//! ended (a body still being sent, for at most the settle time after the
//! answer, so a client that stops reading cannot hold the next term), or, if
//! its outcome is unknown, until the settle time has passed. The first write
//! of a newer term waits until no write of an older term holds it back. So
//! the backend never receives a write of term t after one of a later term.
//!
//! On a route with storage-side preconditions (SPEC §10) an admitted write
//! also gets the precondition the key states plan
//! ([`crate::precondition`]: the client's own, one naming the key's state,
//! or `428 precondition-required` with nothing sent), and the answer to
//! every request about such a key, read or write, is learned from before
//! it goes back to the client.

use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};

use std::future::Future;
use std::pin::Pin;

use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, Response};
use http_body::Body as _;
use pin_project_lite::pin_project;
use tower::{Layer, Service};

use crate::auth::{Caller, Identity};
use crate::backend::{Exchange, RequestContext, Sent};
use crate::body::{Body, ResponseFuture};
use crate::body_routes::{
    fenced_request, reshape, BodyLimits, DynamoRoutes, EtcdRoutes, Reshaped, Touches,
};
use crate::error::{Problem, Reason};
use crate::hosts::{virtual_path, Hosts};
use crate::lease::{Admission, AdmitError, AdmitOptions, LeaseStore, Primacy, WriteGuard};
use crate::metrics::Metrics;
use crate::names::LeaseName;
use crate::precondition::{self, Key, KeyStateTable, Observed, Plan};
use crate::route::Routes;
use fencegate_core::body_keys::dynamodb::Op;
use fencegate_core::body_keys::etcd::{self, Call};
use fencegate_core::precondition::Dialect;

pub use crate::wire::{FENCING_LEASE_ID, FENCING_TOKEN};

// The names as parsed header names, so lookups on the hot path skip parsing.
const TOKEN_NAME: HeaderName = HeaderName::from_static(FENCING_TOKEN);
const LEASE_ID_NAME: HeaderName = HeaderName::from_static(FENCING_LEASE_ID);
const DESTINATION_NAME: HeaderName = HeaderName::from_static("destination");

/// How the fence decides.
#[derive(Debug)]
pub struct FencePolicy {
    pub routes: Routes,
    pub leases: LeaseStore,
    /// Whether writes must carry `Fencing-Lease-Id` (the contract's default).
    pub require_lease_id: bool,
    /// Whether writes to paths no route guards are forwarded unchecked.
    pub allow_unrouted_writes: bool,
    /// Margin, barrier and settle time of write admission.
    pub admit: AdmitOptions,
    /// Upstream deadline of routes without their own.
    pub upstream_timeout_ms: u64,
    /// Counts forwarded and refused requests.
    pub metrics: Metrics,
    /// In cluster mode, the member's right to admit: checked right before
    /// anything (reads too) is handed to the backend, after admission and
    /// any wait at the barrier. `None` standalone.
    pub primacy: Option<Arc<Primacy>>,
    /// The key states of the routes with preconditions (SPEC §10), for
    /// this term of primacy.
    pub key_states: Arc<KeyStateTable>,
    /// How the storage reads the client's `Host`, where it gets it
    /// (`proxy.preserve_host`): a virtual-hosted request is routed, fenced
    /// and named by its bucket and path ([`virtual_path`]). `None`: the
    /// storage gets its own host, and every request is path-style.
    pub hosts: Option<Hosts>,
    /// The key routes of an etcd v3 gateway (SPEC §11), with the bounds
    /// of the bodies read to find a write's keys: every gateway call
    /// (`/v3/…`) is decided by them, not by the path routes.
    pub etcd: Option<(EtcdRoutes, BodyLimits)>,
    /// The routes of DynamoDB's API (SPEC §11), with the bounds on the
    /// bodies read.
    pub dynamodb: Option<(DynamoRoutes, BodyLimits)>,
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
    let mut values = headers.get_all(&TOKEN_NAME).iter();
    match values.next() {
        None => Ok(None),
        Some(value) => token_value(value, values.next().is_some()).map(Some),
    }
}

/// The number a `Fencing-Token` value states; `more`: the header came more
/// than once.
fn token_value(value: &HeaderValue, more: bool) -> Result<u64, Problem> {
    if more {
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
        .ok_or_else(|| Problem::malformed_token("Fencing-Token must be a decimal u64"))
}

/// The presented lease id, if exactly one was sent.
pub fn lease_id_header(headers: &HeaderMap) -> Result<Option<&[u8]>, Problem> {
    let mut values = headers.get_all(&LEASE_ID_NAME).iter();
    let first = values.next();
    lease_id_value(first, values.next().is_some())
}

/// The lease id of a `Fencing-Lease-Id` value; `more`: the header came
/// more than once.
fn lease_id_value(value: Option<&HeaderValue>, more: bool) -> Result<Option<&[u8]>, Problem> {
    if more {
        return Err(Problem::invalid_request(
            "Fencing-Lease-Id must appear exactly once",
        ));
    }
    Ok(value.map(HeaderValue::as_bytes))
}

/// The headers a fenced request presents, checked for presence and form in
/// the contract's order: both present (428), then well formed (400).
pub fn credentials(
    headers: &HeaderMap,
    require_lease_id: bool,
) -> Result<(u64, Option<&[u8]>), Problem> {
    presented(headers, require_lease_id).map(|(token, _, id)| (token, id))
}

/// [`credentials`], with the token as sent; one lookup of each header.
fn presented(
    headers: &HeaderMap,
    require_lease_id: bool,
) -> Result<(u64, &HeaderValue, Option<&[u8]>), Problem> {
    let mut tokens = headers.get_all(&TOKEN_NAME).iter();
    let mut ids = headers.get_all(&LEASE_ID_NAME).iter();
    let Some(sent) = tokens.next() else {
        return Err(Problem::missing_token());
    };
    let id = ids.next();
    if require_lease_id && id.is_none() {
        return Err(Problem::missing_lease_id());
    }
    let token = token_value(sent, tokens.next().is_some())?;
    let lease_id = lease_id_value(id, ids.next().is_some())?;
    Ok((token, sent, lease_id))
}

/// DynamoDB's operation header (`DynamoDB_20120810.PutItem`).
const AMZ_TARGET: HeaderName = HeaderName::from_static("x-amz-target");

/// What the fence decided before any waiting.
enum Decision {
    /// Not fenced (a read, or an allowed unrouted write): forward as it is,
    /// and learn from its answer if it reads a key of a route with
    /// preconditions.
    Pass(Option<Observed>),
    /// Refused before the lease store was asked.
    Reject(Problem),
    /// A fenced request: admit it through the lease store.
    Fenced(Fenced),
    /// A write to an etcd gateway: its body names the keys, and so the
    /// lease (SPEC §11).
    EtcdWrite(Call, Option<Caller>),
    /// A write to DynamoDB: its body names the items, and so the lease.
    DynamoWrite(Op, Option<Caller>),
}

/// A request on a route with preconditions: the key, whether it writes
/// it, and the storage's API.
struct Conditioned {
    key: Key,
    write: bool,
    dialect: Dialect,
}

/// A request the lease store must admit.
struct Fenced {
    lease: LeaseName,
    token: u64,
    lease_id: Option<HeaderValue>,
    /// The authenticated caller, who must hold the term (auth on only).
    caller: Option<Caller>,
    /// The longest wait at the barrier (the route's upstream deadline).
    max_wait_ms: u64,
    /// On a route with preconditions: the key it writes (or reads).
    conditioned: Option<Conditioned>,
}

impl Fenced {
    /// The same write, to be admitted once more (an etcd write that only
    /// made its lease's fence key). No key state rides along.
    fn again(&self) -> Fenced {
        Fenced {
            lease: self.lease.clone(),
            token: self.token,
            lease_id: self.lease_id.clone(),
            caller: self.caller.clone(),
            max_wait_ms: self.max_wait_ms,
            conditioned: None,
        }
    }

    /// The lease id presented.
    fn presented(&self) -> Option<&[u8]> {
        self.lease_id.as_ref().map(HeaderValue::as_bytes)
    }

    /// The authenticated caller's name.
    fn holder(&self) -> Option<&str> {
        self.caller.as_ref().map(|c| c.0.name.as_str())
    }
}

impl FencePolicy {
    /// Routes `req` and checks its headers; removes `Fencing-Lease-Id` (a
    /// credential for fencegate only) and records the route's upstream
    /// deadline on the request.
    fn decide(&self, req: &mut Request<Body>) -> Decision {
        // fencegate's own bearer secret is never forwarded.
        let caller = RequestContext::of(req).and_then(|c| c.caller.clone());
        if caller.is_some() {
            req.headers_mut().remove(http::header::AUTHORIZATION);
        }
        if let Some(call) = self.etcd.as_ref().and_then(|_| Call::of(req.uri().path())) {
            return self.decide_etcd(req, call, caller);
        }
        if self.dynamodb.is_some() {
            match dynamodb_op(req) {
                Ok(Some(op)) => return self.decide_dynamodb(req, op, caller),
                Ok(None) => {}
                Err(problem) => return Decision::Reject(problem),
            }
        }
        let write = is_write(req.method());
        // A virtual-hosted request's path at the storage: its bucket first.
        let vpath = match virtual_path(req, self.hosts.as_ref()) {
            Ok(vpath) => vpath,
            Err(unreadable) => return Decision::Reject(Problem::invalid_request(unreadable.0)),
        };
        let virtual_hosted = vpath.is_some();
        let matched = match self
            .routes
            .resolve(vpath.as_deref().unwrap_or(req.uri().path()), write)
        {
            Ok(matched) => matched,
            Err(bad) => return Decision::Reject(Problem::invalid_request(bad.0)),
        };
        let Some(route) = matched else {
            req.headers_mut().remove(&LEASE_ID_NAME);
            let path = vpath.as_deref().unwrap_or(req.uri().path());
            return match self.unrouted(req, write, path, virtual_hosted) {
                Ok(()) => Decision::Pass(None),
                Err(problem) => Decision::Reject(problem),
            };
        };
        if let Err(problem) = rewrite_for_upstream(req, &route, virtual_hosted) {
            return Decision::Reject(problem);
        }
        if let Some(timeout_ms) = route.timeout_ms {
            RequestContext::of_mut(req).timeout_ms = Some(timeout_ms);
        }
        let timeout_ms = route.timeout_ms.unwrap_or(self.upstream_timeout_ms);
        // The key as the storage will act on it (a prefix rewritten above
        // is the storage's too), and the storage's API.
        let conditioned = route.preconditions.dialect().map(|dialect| Conditioned {
            key: Key::of(vpath.as_deref().unwrap_or(req.uri().path())),
            write,
            dialect,
        });
        if !write && !route.fence_reads {
            req.headers_mut().remove(&LEASE_ID_NAME);
            return Decision::Pass(conditioned.map(|c| self.read_of(c.key, req)));
        }
        let lease = match route.lease {
            Ok(lease) => lease,
            Err(not) => {
                return Decision::Reject(match not.why {
                    Some(why) => Problem::new(Reason::InvalidLeaseName, why),
                    None => Problem::invalid_lease_name(&not.segment),
                })
            }
        };
        if let Err(problem) = self.check_destination(req.headers(), Some(&lease), virtual_hosted) {
            return Decision::Reject(problem);
        }
        if conditioned.is_some() && write && req.headers().contains_key(DESTINATION_NAME) {
            // The storage checks a precondition against the request's own
            // key only: a late COPY or MOVE could still overwrite the other.
            return Decision::Reject(
                Problem::invalid_request(
                    "COPY and MOVE write to a second key that no precondition covers: not on a route with preconditions",
                )
                .lease(&lease),
            );
        }
        let token = match self.token_of(req) {
            Ok(token) => token,
            Err(p) => return Decision::Reject(p.lease(&lease)),
        };
        Decision::Fenced(Fenced {
            lease,
            token,
            lease_id: req.headers_mut().remove(&LEASE_ID_NAME),
            caller,
            max_wait_ms: timeout_ms,
            conditioned,
        })
    }

    /// A write no route guards: refused unless `fence.allow_unrouted_writes`,
    /// and then only where no route could reach it.
    fn unrouted(
        &self,
        req: &Request<Body>,
        write: bool,
        path: &str,
        virtual_hosted: bool,
    ) -> Result<(), Problem> {
        if !write {
            return Ok(());
        }
        if !self.allow_unrouted_writes {
            return Err(Problem::unrouted_write());
        }
        self.routes
            .check_unrouted_write(path)
            .map_err(|bad| Problem::invalid_request(bad.0))?;
        self.check_destination(req.headers(), None, virtual_hosted)
    }

    /// The token a fenced request presents; the backend gets the number in
    /// its one form: `0001` goes on as `1` (a backend comparing tokens as
    /// text would misorder it).
    fn token_of(&self, req: &mut Request<Body>) -> Result<u64, Problem> {
        let (token, sent, _) = presented(req.headers(), self.require_lease_id)?;
        if sent.len() > 1 && sent.as_bytes()[0] == b'0' {
            req.headers_mut()
                .insert(TOKEN_NAME, HeaderValue::from(token));
        }
        Ok(token)
    }

    /// A call to an etcd gateway (SPEC §11), by its path whatever its
    /// method (the gateway takes `POST` for reads too, and a header may
    /// override the method): a read passes; a write is fenced by its
    /// body's keys; any other call that can change data names no key to
    /// fence, and is an unrouted write.
    fn decide_etcd(&self, req: &mut Request<Body>, call: Call, caller: Option<Caller>) -> Decision {
        match call {
            Call::Read => {
                req.headers_mut().remove(&LEASE_ID_NAME);
                Decision::Pass(None)
            }
            Call::Unfenced => {
                req.headers_mut().remove(&LEASE_ID_NAME);
                if self.allow_unrouted_writes {
                    Decision::Pass(None)
                } else {
                    Decision::Reject(Problem::new(
                        Reason::UnroutedWrite,
                        "this etcd call can change data and names no key a route can fence, and unrouted writes are not allowed",
                    ))
                }
            }
            Call::Unfenceable => Decision::Reject(Problem::new(
                Reason::UnroutedWrite,
                "this etcd call may write or delete keys fencegate cannot see (a lease's revocation, a lock, an election, a call fencegate does not know), guarded ones among them: it is refused even where unrouted writes are allowed",
            )),
            Call::Put | Call::DeleteRange | Call::Txn => Decision::EtcdWrite(call, caller),
        }
    }

    fn decide_dynamodb(&self, req: &mut Request<Body>, op: Op, caller: Option<Caller>) -> Decision {
        match op {
            Op::Read => {
                req.headers_mut().remove(&LEASE_ID_NAME);
                Decision::Pass(None)
            }
            Op::Unfenced => {
                req.headers_mut().remove(&LEASE_ID_NAME);
                if self.allow_unrouted_writes {
                    // Allowed only if it names no table a route guards:
                    // its body is read first.
                    Decision::DynamoWrite(op, caller)
                } else {
                    Decision::Reject(Problem::new(
                        Reason::UnroutedWrite,
                        "this DynamoDB operation can change data and names no item a route can fence, and unrouted writes are not allowed",
                    ))
                }
            }
            _ => Decision::DynamoWrite(op, caller),
        }
    }

    /// A write of `lease` found in its body, checked as a write on a path
    /// route is: its headers, then admission.
    fn fenced_by(
        &self,
        req: &mut Request<Body>,
        lease: LeaseName,
        route_timeout_ms: Option<u64>,
        caller: Option<Caller>,
    ) -> Result<Fenced, Problem> {
        let (token, padded) = match presented(req.headers(), self.require_lease_id) {
            Ok((token, sent, _)) => (token, sent.len() > 1 && sent.as_bytes()[0] == b'0'),
            Err(p) => return Err(p.lease(&lease)),
        };
        if padded {
            req.headers_mut()
                .insert(TOKEN_NAME, HeaderValue::from(token));
        }
        if let Some(timeout_ms) = route_timeout_ms {
            RequestContext::of_mut(req).timeout_ms = Some(timeout_ms);
        }
        Ok(Fenced {
            lease,
            token,
            lease_id: req.headers_mut().remove(&LEASE_ID_NAME),
            caller,
            max_wait_ms: route_timeout_ms.unwrap_or(self.upstream_timeout_ms),
            conditioned: None,
        })
    }

    /// A read of `key` on a route with preconditions, to learn from.
    fn read_of<B>(&self, key: Key, req: &Request<B>) -> Observed {
        let exchange = self.key_states.read(key.as_str(), req);
        Observed {
            table: self.key_states.clone(),
            key,
            exchange,
        }
    }

    /// For an admitted request on a route with preconditions: a write gets
    /// the precondition the key states plan (or is answered 428 with
    /// nothing sent), and the answer of each is to be learned from.
    fn condition(
        &self,
        req: &mut Request<Body>,
        fenced: &mut Fenced,
    ) -> Result<Option<Observed>, Problem> {
        let Some(Conditioned {
            key,
            write,
            dialect,
        }) = fenced.conditioned.take()
        else {
            return Ok(None);
        };
        if !write {
            return Ok(Some(self.read_of(key, req)));
        }
        let (plan, exchange) = self.key_states.plan(key.as_str(), req, dialect);
        if let Plan::Required(required) = plan {
            self.metrics
                .write_rejected(Reason::PreconditionRequired.slug());
            let signed = precondition::signature_covers_preconditions(req.headers());
            return Err(Problem::precondition_required(
                &fenced.lease,
                required,
                signed,
            ));
        }
        precondition::add(&plan, req.headers_mut());
        Ok(exchange.teaches().then(|| Observed {
            table: self.key_states.clone(),
            key,
            exchange,
        }))
    }

    /// WebDAV `COPY` and `MOVE` write to their `Destination` too: it must be
    /// guarded by the same lease as the request path (by no lease, for an
    /// allowed unrouted write), or a holder of one lease, or an unrouted
    /// write, could write into another lease's keys. At most one
    /// `Destination` is accepted.
    fn check_destination(
        &self,
        headers: &HeaderMap,
        lease: Option<&str>,
        virtual_hosted: bool,
    ) -> Result<(), Problem> {
        let mut values = headers.get_all(DESTINATION_NAME).iter();
        let Some(dest) = values.next() else {
            return Ok(());
        };
        let bad = |detail: &str| {
            let problem = Problem::invalid_request(detail);
            match lease {
                Some(lease) => problem.lease(lease),
                None => problem,
            }
        };
        if virtual_hosted {
            // WebDAV names no bucket in a Host.
            return Err(bad(
                "a Destination on a virtual-hosted request (its Host names a bucket) is not taken",
            ));
        }
        if values.next().is_some() {
            return Err(bad("Destination must appear at most once"));
        }
        let same_lease = || match lease {
            Some(_) => "Destination must be a path guarded by the same lease as the request",
            None => "Destination of an unrouted write must be unrouted too",
        };
        let uri: http::Uri = dest
            .to_str()
            .ok()
            .and_then(|d| d.parse().ok())
            .ok_or_else(|| bad(same_lease()))?;
        let same = match (self.routes.resolve(uri.path(), true), lease) {
            (Ok(Some(m)), Some(lease)) => m.lease.as_ref().is_ok_and(|l| l.as_str() == lease),
            (Ok(None), None) => true,
            _ => false,
        };
        if !same {
            return Err(bad(same_lease()));
        }
        // The storage gets the Destination as it is: it must name the same
        // lease's keys there too.
        self.routes
            .check_at_storage(uri.path(), lease)
            .map_err(|b| bad(&b.0))
    }

    /// `Some(answer)` when this member may not send anything to the
    /// backend now: it is not (or no longer provably) the primary.
    fn not_primary(&self) -> Option<Response<Body>> {
        let primacy = self.primacy.as_ref()?;
        if primacy.is_live() {
            return None;
        }
        self.metrics.write_rejected(Reason::NotPrimary.slug());
        let problem = Problem::not_primary(
            "this member could not confirm in time that it is the primary; nothing was sent to the backend",
            None,
        );
        Some(problem.into_response())
    }

    /// The fence's last check of an admitted write, between the two steps
    /// of its exchange (after any connect, right before its first byte
    /// leaves): this member still provably primary, the term still current
    /// and live.
    fn still_admitted(&self, lease: &str, token: u64) -> Result<(), Problem> {
        if self.primacy.as_ref().is_some_and(|p| !p.is_live()) {
            return Err(Problem::not_primary(
                "this member could not confirm in time that it is the primary; nothing was sent to the backend",
                None,
            ));
        }
        self.leases
            .check_live(lease, token, self.admit.margin_ms)
            .map_err(|reject| Problem::rejected(lease, reject))
    }

    fn admit_options(&self, max_wait_ms: u64) -> AdmitOptions {
        AdmitOptions {
            max_wait_ms,
            ..self.admit
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

/// A service that forwards only admitted requests to `S`, and keeps each
/// admitted write counted as in flight until its response is complete. It
/// hands an admitted write to `S` in the two steps of an [`Exchange`] and
/// checks the write again between them.
#[derive(Clone, Debug)]
pub struct Fence<S> {
    policy: Arc<FencePolicy>,
    inner: S,
}

impl<S> Service<Request<Body>> for Fence<S>
where
    S: Exchange + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = FenceFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<Body>) -> Self::Future {
        let mut fenced = match self.policy.decide(&mut req) {
            Decision::Pass(observed) => {
                if let Some(refused) = self.policy.not_primary() {
                    return FenceFuture::ready(refused);
                }
                return FenceFuture::forward(self.inner.call(req), observed);
            }
            Decision::Reject(problem) => {
                self.policy.metrics.write_rejected(problem.reason().slug());
                return FenceFuture::ready(problem.into_response());
            }
            Decision::Fenced(fenced) => fenced,
            Decision::EtcdWrite(call, caller) => return self.etcd_write(req, call, caller),
            Decision::DynamoWrite(op, caller) => return self.dynamodb_write(req, op, caller),
        };
        let options = self.policy.admit_options(fenced.max_wait_ms);
        // The common case decides without waiting or allocating.
        match self.policy.leases.try_admit_write(
            &fenced.lease,
            fenced.token,
            fenced.presented(),
            fenced.holder(),
            &options,
        ) {
            Admission::Admitted(guard) => {
                if let Some(refused) = self.policy.not_primary() {
                    // Nothing was sent: the write holds nothing back.
                    guard.finish();
                    return FenceFuture::ready(refused);
                }
                let observed = match self.policy.condition(&mut req, &mut fenced) {
                    Ok(observed) => observed,
                    Err(problem) => {
                        // Nothing was sent: the write holds nothing back.
                        guard.finish();
                        return FenceFuture::ready(problem.into_response());
                    }
                };
                tracing::debug!(lease = fenced.lease.as_str(), token = fenced.token, method = %req.method(), "write admitted");
                // The instance that was polled ready goes; a clone stays
                // for the next call.
                let fresh = self.inner.clone();
                let inner = std::mem::replace(&mut self.inner, fresh);
                let write = AdmittedWrite {
                    lease: fenced.lease,
                    token: fenced.token,
                    caller: fenced.caller,
                    guard,
                    observed,
                };
                FenceFuture::boxed(Box::pin(exchange(inner, self.policy.clone(), req, write)))
            }
            Admission::Refused(reject) => {
                FenceFuture::ready(reject_write(&self.policy, &fenced, &req, reject))
            }
            Admission::MustWait(_) => self.wait_at_barrier(req, fenced, options),
        }
    }
}

impl<S> Fence<S>
where
    S: Exchange + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    /// A newer term's first write while older writes are in flight: it
    /// waits at the handover barrier, then goes to the backend (or is
    /// refused if its term ends or the wait runs out first).
    fn wait_at_barrier(
        &mut self,
        req: Request<Body>,
        fenced: Fenced,
        options: AdmitOptions,
    ) -> FenceFuture<S::Future> {
        // Call the instance that was polled ready later, and keep a clone
        // for the next call.
        let fresh = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, fresh);
        let policy = self.policy.clone();
        FenceFuture::boxed(Box::pin(admit_then_exchange(
            inner, policy, req, fenced, options,
        )))
    }

    /// A write to an etcd gateway: its body is read to find the lease
    /// that guards its keys, then it is admitted as any fenced write (a
    /// transaction of reads only passes as a read).
    fn etcd_write(
        &mut self,
        req: Request<Body>,
        call: Call,
        caller: Option<Caller>,
    ) -> FenceFuture<S::Future> {
        let fresh = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, fresh);
        let policy = self.policy.clone();
        FenceFuture::boxed(Box::pin(async move {
            let read = match &policy.etcd {
                Some((routes, limits)) => routes.read_write(req, call, *limits).await,
                None => unreachable!("an etcd write is decided by etcd routes"),
            };
            let (req, fenced, body) = match fenced_by_body(&policy, &mut inner, read, caller).await
            {
                Ok(fenced) => fenced,
                Err(answer) => return answer,
            };
            // etcd itself compares the token: the write goes as a
            // transaction on the lease's fence key.
            let Some((routes, limits)) = &policy.etcd else {
                unreachable!("an etcd write is decided by etcd routes")
            };
            let fence_key = etcd::fence_key(&routes.fence_prefix, fenced.lease.as_str());
            let (req, txn) = match fenced_request(req, call, &body, &fence_key, fenced.token) {
                Ok(sent) => sent,
                Err(problem) => return Ok(refused(&policy, problem)),
            };
            let idle = limits.idle;
            let (parts, _) = req.into_parts();
            let lease = fenced.lease.clone();
            // At most twice: a lease's first write only makes its fence
            // key, and goes again (admitted again: its term may have ended).
            for _ in 0..2 {
                let req = Request::from_parts(parts.clone(), crate::body::full(txn.clone()));
                let fenced = fenced.again();
                let options = policy.admit_options(fenced.max_wait_ms);
                let res =
                    admit_then_exchange(inner.clone(), policy.clone(), req, fenced, options).await;
                let res = res.unwrap_or_else(|never| match never {});
                match reshape(res, call, lease.as_str(), idle).await {
                    Reshaped::Answer(res) => return Ok(res),
                    Reshaped::FenceCreated => {}
                }
            }
            Ok(Problem::new(
                Reason::UpstreamError,
                "etcd made the lease's fence key twice and applied nothing: is something deleting it?",
            )
            .into_response())
        }))
    }
}

impl<S> Fence<S>
where
    S: Exchange + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    /// A write to DynamoDB: its body read, its items' one lease found, its
    /// token checked in its headers and in the body (the item's token
    /// attribute and the condition on it), then admitted; the body goes
    /// as it came (SigV4 signed it), and DynamoDB's answer passes as it is.
    fn dynamodb_write(
        &mut self,
        req: Request<Body>,
        op: Op,
        caller: Option<Caller>,
    ) -> FenceFuture<S::Future> {
        let fresh = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, fresh);
        let policy = self.policy.clone();
        FenceFuture::boxed(Box::pin(async move {
            let Some((routes, limits)) = &policy.dynamodb else {
                unreachable!("a DynamoDB write is decided by dynamodb routes")
            };
            if op == Op::Unfenced {
                return match routes.unrouted(req, *limits).await {
                    Ok(req) => boxed_call(&mut inner, req).await,
                    Err(problem) => Ok(refused(&policy, problem)),
                };
            }
            // The body is read once: what it touches, then what it carries.
            let mut doc = None;
            let read = routes
                .read_write(req, op, *limits)
                .await
                .map(|(req, touches, read)| {
                    doc = Some(read);
                    (req, touches)
                });
            let (req, fenced, _) = match fenced_by_body(&policy, &mut inner, read, caller).await {
                Ok(fenced) => fenced,
                Err(answer) => return answer,
            };
            let doc = doc.expect("a write fenced by its body was read");
            if let Err(problem) = routes.check(op, &doc, fenced.token, fenced.lease.as_str()) {
                return Ok(refused(&policy, problem));
            }
            let options = policy.admit_options(fenced.max_wait_ms);
            admit_then_exchange(inner, policy, req, fenced, options).await
        }))
    }
}

/// The DynamoDB operation a request names in `X-Amz-Target`, if any (a
/// request that names two is refused).
fn dynamodb_op(req: &Request<Body>) -> Result<Option<Op>, Problem> {
    let mut targets = req.headers().get_all(AMZ_TARGET).iter();
    let Some(target) = targets.next() else {
        return Ok(None);
    };
    if targets.next().is_some() {
        return Err(Problem::invalid_request(
            "a request names X-Amz-Target twice",
        ));
    }
    Ok(target.to_str().ok().and_then(Op::of))
}

/// The request's path as the storage is to get it, for a route with an
/// `upstream_prefix` (path-style requests only: the prefix is the path's,
/// and a virtual-hosted request's bucket is its Host's).
fn rewrite_for_upstream(
    req: &mut Request<Body>,
    route: &crate::route::Matched<'_>,
    virtual_hosted: bool,
) -> Result<(), Problem> {
    let Some(path) = route.upstream_path(req.uri().path(), req.uri().query()) else {
        return Ok(());
    };
    if virtual_hosted {
        return Err(Problem::invalid_request(
            "a route with an upstream_prefix takes path-style requests only, and this one is virtual-hosted (its Host names the bucket)",
        ));
    }
    *req.uri_mut() = path
        .parse::<http::Uri>()
        .map_err(|_| Problem::invalid_request("the rewritten path is not a valid URI"))?;
    Ok(())
}

/// A write to a store that names its keys in the body, its body read
/// (`read`): fenced by the term its headers name of the lease its keys
/// belong to, with the body as it came; or already answered (refused, or
/// passed on as a transaction that writes nothing).
async fn fenced_by_body<S>(
    policy: &FencePolicy,
    inner: &mut S,
    read: Result<(Request<Body>, Touches), Problem>,
    caller: Option<Caller>,
) -> Result<(Request<Body>, Fenced, bytes::Bytes), Result<Response<Body>, Infallible>>
where
    S: Exchange,
    S::Future: Send + 'static,
{
    let (mut req, touches) = read.map_err(|problem| Ok(refused(policy, problem)))?;
    let (lease, timeout_ms, body) = match touches {
        Touches::Lease {
            lease,
            timeout_ms,
            body,
        } => (lease, timeout_ms, body),
        Touches::Nothing => {
            req.headers_mut().remove(&LEASE_ID_NAME);
            if let Some(refused) = policy.not_primary() {
                return Err(Ok(refused));
            }
            return Err(boxed_call(inner, req).await);
        }
    };
    let fenced = policy
        .fenced_by(&mut req, lease, timeout_ms, caller)
        .map_err(|problem| Ok(refused(policy, problem)))?;
    Ok((req, fenced, body))
}

/// `inner`'s answer to `req`, boxed (an async block that awaited
/// `S::Future` itself could not be proven `Send`).
fn boxed_call<S>(inner: &mut S, req: Request<Body>) -> ResponseFuture
where
    S: Exchange,
    S::Future: Send + 'static,
{
    Box::pin(inner.call(req))
}

/// A request refused before anything was sent, counted.
fn refused(policy: &FencePolicy, problem: Problem) -> Response<Body> {
    policy.metrics.write_rejected(problem.reason().slug());
    problem.into_response()
}

/// A fenced write admitted through the lease store, waiting at the
/// handover barrier if older terms' writes are in flight, then sent (or
/// refused if its term ends or the wait runs out first).
async fn admit_then_exchange<S: Exchange>(
    inner: S,
    policy: Arc<FencePolicy>,
    req: Request<Body>,
    mut fenced: Fenced,
    options: AdmitOptions,
) -> Result<Response<Body>, Infallible> {
    let admitted = policy
        .leases
        .admit_write(
            &fenced.lease,
            fenced.token,
            fenced.presented(),
            fenced.holder(),
            options,
        )
        .await;
    let admitted = match admitted {
        Ok(admitted) => admitted,
        Err(AdmitError::Rejected(reject)) => {
            return Ok(reject_write(&policy, &fenced, &req, reject));
        }
        Err(AdmitError::DrainTimeout {
            older_token,
            waited_ms,
            retry_after_ms,
        }) => {
            policy
                .metrics
                .write_rejected(Reason::UpstreamTimeout.slug());
            tracing::warn!(
                lease = fenced.lease.as_str(),
                token = fenced.token,
                older_token,
                waited_ms,
                retry_after_ms,
                "write refused: an earlier term's writes did not finish in time"
            );
            let problem = Problem::barrier_timeout(&fenced.lease, retry_after_ms);
            return Ok(problem.into_response());
        }
    };
    if let Some(refused) = policy.not_primary() {
        admitted.guard.finish();
        return Ok(refused);
    }
    let mut req = req;
    let observed = match policy.condition(&mut req, &mut fenced) {
        Ok(observed) => observed,
        Err(problem) => {
            admitted.guard.finish();
            return Ok(problem.into_response());
        }
    };
    tracing::debug!(lease = fenced.lease.as_str(), token = fenced.token, waited_ms = admitted.waited_ms, method = %req.method(), "write admitted");
    let write = AdmittedWrite {
        lease: fenced.lease,
        token: fenced.token,
        caller: fenced.caller,
        guard: admitted.guard,
        observed,
    };
    exchange(inner, policy, req, write).await
}

/// An admitted write, as the fence hands it to [`exchange`].
struct AdmittedWrite {
    lease: LeaseName,
    token: u64,
    /// The authenticated caller, who sees a refusal's term details only if
    /// it holds the term.
    caller: Option<Caller>,
    guard: WriteGuard,
    observed: Option<Observed>,
}

/// An admitted write's exchange with the backend, as the fence drives it:
/// step one (nothing sent), the fence's check, then step two (and, if the
/// backend gives the request back unsent, step one again and the check
/// again); the write's guard goes with the answer (see [`attach_guard`]),
/// or is finished at once if nothing was sent.
async fn exchange<S: Exchange>(
    mut inner: S,
    policy: Arc<FencePolicy>,
    req: Request<Body>,
    write: AdmittedWrite,
) -> Result<Response<Body>, Infallible> {
    let AdmittedWrite {
        lease,
        token,
        caller,
        guard,
        observed,
    } = write;
    let mut staged = match inner.stage(req).await {
        Ok(staged) => staged,
        Err(res) => {
            // Nothing was sent (however the step failed: a refused or
            // timed-out connect, the client's body): the write holds
            // nothing back, and taught nothing about the key.
            guard.finish();
            return Ok(res);
        }
    };
    let res = loop {
        if let Err(problem) = policy.still_admitted(&lease, token) {
            inner.withdraw(staged);
            // Nothing was sent: the write holds nothing back.
            guard.finish();
            tracing::info!(target: "audit", lease = lease.as_str(), token, reason = problem.reason().slug(), "write withdrawn before sending");
            return Ok(refusal(&policy, problem, &lease, caller.as_ref()));
        }
        match inner.send(staged).await {
            Sent::Answered(res) => {
                policy.metrics.write_forwarded();
                break res;
            }
            Sent::Unknown(res) => {
                policy.metrics.write_forwarded();
                if let Some(observed) = &observed {
                    observed.learn_unknown();
                }
                // Dropped unfinished: the storage may still apply the
                // write, so it holds newer terms back for the settle time.
                drop(guard);
                return Ok(res);
            }
            Sent::NotSent(res) => {
                guard.finish();
                return Ok(res);
            }
            // An idle connection the storage had closed: staged again on
            // a fresh one, and checked again before it goes.
            Sent::Again(again) => match inner.restage(again).await {
                Ok(again) => staged = again,
                Err(res) => {
                    guard.finish();
                    return Ok(res);
                }
            },
        }
    };
    let res = match observed {
        Some(observed) => observed.learn(res),
        None => res,
    };
    Ok(attach_guard(res, guard))
}

fn reject_write(
    policy: &FencePolicy,
    fenced: &Fenced,
    req: &Request<Body>,
    reject: crate::lease::Reject,
) -> Response<Body> {
    let reason = Reason::from(&reject).slug();
    tracing::info!(target: "audit", lease = fenced.lease.as_str(), token = fenced.token, reason, method = %req.method(), "write rejected");
    let problem = Problem::rejected(&fenced.lease, reject);
    refusal(policy, problem, &fenced.lease, fenced.caller.as_ref())
}

/// The answer to a write refused for `problem`: counted by its reason, and
/// shown to `caller` as [`visible_to`] allows.
fn refusal(
    policy: &FencePolicy,
    problem: Problem,
    lease: &str,
    caller: Option<&Caller>,
) -> Response<Body> {
    policy.metrics.write_rejected(problem.reason().slug());
    let caller = caller.map(|c| &*c.0);
    visible_to(problem, &policy.leases, lease, caller).into_response()
}

/// With authentication on, a problem about `lease` shows the current term's
/// details (holder, token, time left) only to admins and to that term's own
/// holder; other callers see the reason alone (and `Retry-After`).
pub fn visible_to(
    problem: Problem,
    leases: &LeaseStore,
    lease: &str,
    caller: Option<&Identity>,
) -> Problem {
    match caller {
        Some(c)
            if !c.admin
                && leases
                    .holder(lease)
                    .is_none_or(|(_, h)| h != c.name.as_str()) =>
        {
            problem.without_term_details()
        }
        _ => problem,
    }
}

/// Counts the write answered once the storage's response head is here: it
/// then holds back newer terms until the response body ends, or for at most
/// the settle time (whether the client reads or not).
fn attach_guard(res: Response<Body>, mut guard: WriteGuard) -> Response<Body> {
    if res.body().is_end_stream() {
        guard.finish();
        return res;
    }
    guard.answered();
    res.map(|b| GuardedBody::wrap(b, guard))
}

pin_project! {
    /// The future of a [`Fence`] call: an answer the fence made itself, a
    /// request passed through, or an admitted write's exchange.
    #[project = FenceFutureProj]
    pub enum FenceFuture<F> {
        Ready { res: Option<Response<Body>> },
        Forward { #[pin] fut: F, observed: Option<Observed> },
        Boxed { fut: ResponseFuture },
    }
}

impl<F> FenceFuture<F> {
    fn ready(res: Response<Body>) -> Self {
        Self::Ready { res: Some(res) }
    }

    fn forward(fut: F, observed: Option<Observed>) -> Self {
        Self::Forward { fut, observed }
    }

    fn boxed(fut: ResponseFuture) -> Self {
        Self::Boxed { fut }
    }
}

impl<F> Future for FenceFuture<F>
where
    F: Future<Output = Result<Response<Body>, Infallible>>,
{
    type Output = Result<Response<Body>, Infallible>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project() {
            FenceFutureProj::Ready { res } => {
                Poll::Ready(Ok(res.take().expect("polled after completion")))
            }
            FenceFutureProj::Forward { fut, observed } => {
                let res = std::task::ready!(fut.poll(cx))?;
                Poll::Ready(Ok(match observed.take() {
                    Some(observed) => observed.learn(res),
                    None => res,
                }))
            }
            FenceFutureProj::Boxed { fut } => fut.as_mut().poll(cx),
        }
    }
}

/// A response body that finishes its write's guard when the body ends.
struct GuardedBody {
    inner: Body,
    guard: Option<WriteGuard>,
}

impl GuardedBody {
    fn wrap(inner: Body, guard: WriteGuard) -> Body {
        crate::body::boxed(Self {
            inner,
            guard: Some(guard),
        })
    }
}

impl http_body::Body for GuardedBody {
    type Data = bytes::Bytes;
    type Error = crate::body::BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(None) => {
                if let Some(guard) = self.guard.take() {
                    guard.finish();
                }
            }
            Poll::Ready(Some(Err(_))) => {
                // The response broke off: the outcome is unknown.
                drop(self.guard.take());
            }
            _ => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for GuardedBody {
    fn drop(&mut self) {
        if let Some(guard) = self.guard.take() {
            if self.inner.is_end_stream() {
                guard.finish();
            }
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
                ok(bad).unwrap_err().reason().slug(),
                "malformed-fencing-token",
                "{bad:?}"
            );
        }
        let two = headers(&[("fencing-token", "1"), ("fencing-token", "1")]);
        assert!(parse_token(&two).is_err());
    }

    #[test]
    fn presence_is_checked_before_form() {
        let r = |pairs: &[(&str, &str)]| {
            credentials(&headers(pairs), true)
                .unwrap_err()
                .reason()
                .slug()
        };
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
