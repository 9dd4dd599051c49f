//! Storage-side preconditions (SPEC §10), the shell side: the table of key
//! states the core decides with ([`fencegate_core::precondition`]), shared
//! by every connection and emptied at each new term of primacy
//! ([`KeyStateTable::take_over`]), and the few header reads and writes that
//! carry its decisions out.
//!
//! The fence asks [`KeyStateTable::plan`] what a write on a `preconditions`
//! route gets (a precondition added, its own kept, or 428), and hands every
//! answer of the storage to such a route's keys to [`Observed::learn`].

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::sync::{Mutex, MutexGuard, PoisonError};

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::header::{HeaderName, AUTHORIZATION, CONTENT_TYPE, ETAG, IF_MATCH, IF_NONE_MATCH};
use http::{HeaderMap, HeaderValue, Request, Response};
use http_body::Body as _;
use smallvec::SmallVec;

use crate::body::Body;

pub use fencegate_core::precondition::{
    Answer, Dialect, Exchange, KeyState, KeyStates, Operation, Own, Plan, Required, Sent,
};

/// How many locks the table is split over: a key's lock is held for one
/// lookup or one update, never across I/O, so a few are plenty.
const PARTS: usize = 16;

/// The key states this member learned since its term of primacy began
/// ([`KeyStateTable::take_over`] empties it): at most `capacity` keys, split
/// over `PARTS` (16) independently locked parts by a keyed hash of the key
/// (so a client cannot pile its keys onto one part).
#[derive(Debug)]
pub struct KeyStateTable {
    parts: Box<[Mutex<KeyStates>]>,
    hasher: RandomState,
}

impl KeyStateTable {
    /// A table of at most `capacity` keys.
    pub fn new(capacity: usize) -> Self {
        let per_part = capacity.div_ceil(PARTS).max(2);
        Self {
            parts: (0..PARTS)
                .map(|_| Mutex::new(KeyStates::new(per_part)))
                .collect(),
            hasher: RandomState::new(),
        }
    }

    /// The part `key` lives in, locked. A std mutex: held for one map
    /// operation, never across an await, and a panic inside one leaves the
    /// map usable (its operations cannot leave it half-changed).
    fn part(&self, key: &str) -> MutexGuard<'_, KeyStates> {
        let i = self.hasher.hash_one(key) as usize % self.parts.len();
        self.parts[i].lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// What to do with a write to `key` (see [`KeyStates::plan_write`]):
    /// its operation by its method and query, as a storage that speaks
    /// `dialect` reads them, and the preconditions it carries itself.
    pub fn plan(
        &self,
        key: &str,
        req: &Request<crate::body::Body>,
        dialect: Dialect,
    ) -> (Plan, Exchange) {
        let headers = req.headers();
        // Azure's DELETE of the blob's snapshots only leaves the blob.
        let snapshots_only = dialect == Dialect::Azure
            && headers
                .get(&X_MS_DELETE_SNAPSHOTS)
                .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"only"));
        let op = Operation::of(
            dialect,
            req.method().as_str(),
            req.uri().query(),
            snapshots_only,
        );
        let own = Own {
            if_match: sent(headers, &IF_MATCH),
            if_none_match: sent(headers, &IF_NONE_MATCH),
        };
        let may_add = !signature_covers_preconditions(headers);
        self.part(key).plan_write(key, op, &own, may_add)
    }

    /// A read of `key` (`req`'s method and query say whether it reads the
    /// key's current representation).
    pub fn read<B>(&self, key: &str, req: &Request<B>) -> Exchange {
        self.part(key)
            .read(req.method().as_str(), req.uri().query())
    }

    /// Learns from `answer` to `exchange` about `key`.
    pub fn learn(&self, key: &str, exchange: &Exchange, answer: Answer<'_>) {
        if exchange.teaches() {
            self.part(key).learn(key, exchange, answer);
        }
    }

    /// How many keys it remembers.
    pub fn len(&self) -> usize {
        self.parts
            .iter()
            .map(|p| p.lock().unwrap_or_else(PoisonError::into_inner).len())
            .sum()
    }

    /// Whether it remembers no key.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The most keys it remembers.
    pub fn capacity(&self) -> usize {
        self.parts
            .iter()
            .map(|p| p.lock().unwrap_or_else(PoisonError::into_inner).capacity())
            .sum()
    }

    /// A new term of primacy starts: it knows nothing
    /// ([`KeyStates::take_over`]).
    pub fn take_over(&self) {
        for part in self.parts.iter() {
            part.lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take_over();
        }
    }
}

/// How `headers` carry the precondition header `name`.
fn sent<'h>(headers: &'h HeaderMap, name: &HeaderName) -> Sent<'h> {
    let mut values = headers.get_all(name).iter();
    match (values.next(), values.next()) {
        (None, _) => Sent::Absent,
        (Some(one), None) => Sent::One(one.as_bytes()),
        (Some(_), Some(_)) => Sent::Several,
    }
}

/// Whether the request's signature covers `If-Match` and `If-None-Match`,
/// so a precondition added to it would break it: Azure's Shared Key
/// (`Authorization: SharedKey account:signature`; Shared Key Lite does not
/// sign them, nor do SAS tokens, AWS Signature V4 unless the client signed
/// them, or bearer tokens).
pub fn signature_covers_preconditions(headers: &HeaderMap) -> bool {
    headers.get(AUTHORIZATION).is_some_and(|v| {
        let v = v.as_bytes();
        v.len() > 10 && v[..10].eq_ignore_ascii_case(b"SharedKey ")
    })
}

/// A key as the table names it: the path the storage acts on (with a
/// virtual-hosted request's bucket first, as `/bucket/key`: see
/// `crate::route::StoragePath`), whatever address the client reached
/// fencegate at; kept inline up to a few hundred bytes so naming it
/// allocates nothing.
#[derive(Clone, Debug)]
pub struct Key(SmallVec<[u8; 192]>);

impl Key {
    /// The key of the storage path `path`.
    pub fn of(path: &str) -> Self {
        Self(SmallVec::from_slice(path.as_bytes()))
    }

    pub fn as_str(&self) -> &str {
        // Built from a `&str`.
        std::str::from_utf8(&self.0).unwrap_or_default()
    }
}

/// Adds the precondition a plan names to `headers`.
pub fn add(plan: &Plan, headers: &mut HeaderMap) {
    match plan {
        Plan::IfMatch(tag) => {
            // A strong tag's bytes are valid header bytes: no copy, no error.
            if let Ok(value) = HeaderValue::from_maybe_shared(tag.clone()) {
                headers.insert(IF_MATCH, value);
            }
        }
        Plan::IfNoneMatchAny => {
            headers.insert(IF_NONE_MATCH, HeaderValue::from_static("*"));
        }
        Plan::AsSent | Plan::Required(_) => {}
    }
}

/// An exchange whose answer is to be learned from: the table that learns,
/// the key, and what the exchange was.
#[derive(Debug)]
pub struct Observed {
    pub table: std::sync::Arc<KeyStateTable>,
    pub key: Key,
    pub exchange: Exchange,
}

impl Observed {
    /// Learns from `res`, the storage's answer to this exchange (a read's
    /// answer fencegate made up, a timeout's, teaches nothing about the
    /// key either way), and gives it back to be relayed. An answer whose
    /// lesson depends on the error code in its body (a 404 to a read: S3's
    /// `NoSuchKey` says the key is absent, `NoSuchVersion` does not), an
    /// XML document (or one of no stated type), is learned from once the
    /// first [`CODE_SCAN_BYTES`] of its body have passed on their way to
    /// the client, or it ended; one the client stops reading before teaches
    /// nothing.
    pub fn learn(self, res: Response<Body>) -> Response<Body> {
        let status = res.status().as_u16();
        let code = res
            .headers()
            .get(&X_MS_ERROR_CODE)
            .map(HeaderValue::as_bytes);
        // Only an XML document (or one of no stated type) can name an S3
        // error code: another body (a problem document, a web page) is
        // learned from at once.
        let xml = res
            .headers()
            .get(CONTENT_TYPE)
            .is_none_or(|t| memchr::memmem::find(t.as_bytes(), b"xml").is_some());
        let at_once = code.is_some() || !xml || res.body().is_end_stream();
        if !self.exchange.needs_code(status) || at_once {
            self.table
                .learn(self.key.as_str(), &self.exchange, answer(&res, code));
            return res;
        }
        let etag = single_etag(&res).map(Bytes::copy_from_slice);
        res.map(|inner| {
            crate::body::boxed(CodeScan {
                inner,
                seen: Vec::new(),
                learning: Some((self, status, etag)),
            })
        })
    }

    /// Learns that this exchange's outcome is unknown: the storage may
    /// apply the write or not, now or later.
    pub fn learn_unknown(&self) {
        self.table
            .learn(self.key.as_str(), &self.exchange, Answer::Unknown);
    }
}

/// How much of an answer's body is read for its error code: S3's and
/// Azure's error documents name it in their first hundred bytes.
pub const CODE_SCAN_BYTES: usize = 1024;

/// Azure's error code header (on every error answer, a `HEAD`'s too).
const X_MS_ERROR_CODE: HeaderName = HeaderName::from_static("x-ms-error-code");

/// Azure's choice of what a DELETE removes: `include` (the blob and its
/// snapshots) or `only` (its snapshots).
const X_MS_DELETE_SNAPSHOTS: HeaderName = HeaderName::from_static("x-ms-delete-snapshots");

/// An answer's body on its way to the client, its first
/// [`CODE_SCAN_BYTES`] kept to read the error code they name; the answer is
/// learned from when they are in or the body ended.
struct CodeScan {
    inner: Body,
    seen: Vec<u8>,
    /// What to learn from, until it is learned.
    learning: Option<(Observed, u16, Option<Bytes>)>,
}

impl CodeScan {
    fn learn(&mut self) {
        if let Some((observed, status, etag)) = self.learning.take() {
            let code = fencegate_core::precondition::error_code(&self.seen);
            let answer = Answer::Storage {
                status,
                etag: etag.as_deref(),
                code,
            };
            observed
                .table
                .learn(observed.key.as_str(), &observed.exchange, answer);
            self.seen = Vec::new();
        }
    }
}

impl http_body::Body for CodeScan {
    type Data = Bytes;
    type Error = crate::body::BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) if self.learning.is_some() => {
                if let Some(data) = frame.data_ref() {
                    let room = CODE_SCAN_BYTES - self.seen.len();
                    let take = data.len().min(room);
                    self.seen.extend_from_slice(&data[..take]);
                    if self.seen.len() >= CODE_SCAN_BYTES {
                        self.learn();
                    }
                }
            }
            Poll::Ready(None) => self.learn(),
            // A broken body shows nothing for sure: nothing is learned.
            Poll::Ready(Some(Err(_))) => self.learning = None,
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

/// The answer's `ETag`, if it has exactly one.
fn single_etag<B>(res: &Response<B>) -> Option<&[u8]> {
    let mut tags = res.headers().get_all(ETAG).iter();
    match (tags.next(), tags.next()) {
        (Some(tag), None) => Some(tag.as_bytes()),
        _ => None,
    }
}

/// The storage's answer `res`, as the core reads it, with the error
/// `code` it names.
fn answer<'a, B>(res: &'a Response<B>, code: Option<&'a [u8]>) -> Answer<'a> {
    Answer::Storage {
        status: res.status().as_u16(),
        etag: single_etag(res),
        code,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    fn req(method: &str, uri: &str, headers: &[(&str, &str)]) -> Request<Body> {
        let mut b = Request::builder().method(method).uri(uri);
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        b.body(crate::body::empty()).unwrap()
    }

    fn observed(table: &std::sync::Arc<KeyStateTable>, exchange: Exchange) -> Observed {
        Observed {
            table: table.clone(),
            key: Key::of("/b/k"),
            exchange,
        }
    }

    #[test]
    fn plans_carry_out_the_core() {
        let table = std::sync::Arc::new(KeyStateTable::new(64));
        let put = req("PUT", "/b/k", &[]);
        assert_eq!(
            table.plan("/b/k", &put, Dialect::S3).0,
            Plan::Required(Required::Unknown)
        );
        let get = req("GET", "/b/k", &[]);
        let ok = Response::builder()
            .header("etag", "\"e1\"")
            .body(crate::body::empty())
            .unwrap();
        let _ = observed(&table, table.read("/b/k", &get)).learn(ok);
        let (plan, _) = table.plan("/b/k", &put, Dialect::S3);
        let mut headers = HeaderMap::new();
        add(&plan, &mut headers);
        assert_eq!(headers["if-match"], "\"e1\"");
        // Shared Key signs If-Match: fencegate may not add it.
        let signed = req("PUT", "/b/k", &[("authorization", "SharedKey acct:c2ln")]);
        assert!(matches!(
            table.plan("/b/k", &signed, Dialect::Azure).0,
            Plan::Required(Required::Send(_))
        ));
        let own = req("PUT", "/b/k", &[("if-none-match", "*")]);
        assert_eq!(table.plan("/b/k", &own, Dialect::S3).0, Plan::AsSent);
        // Sent twice: which one the storage takes is its own.
        let twice = req(
            "PUT",
            "/b/k",
            &[("if-none-match", "*"), ("if-none-match", "*")],
        );
        assert!(matches!(
            table.plan("/b/k", &twice, Dialect::S3).0,
            Plan::Required(Required::Unprotected(_))
        ));
        assert_eq!(table.len(), 1);
        table.take_over();
        assert!(table.is_empty());
    }

    /// A 404's error code is read from its body as it passes: S3's
    /// `NoSuchVersion` teaches nothing, `NoSuchKey` that the key is absent.
    #[tokio::test]
    async fn a_not_found_teaches_by_its_error_code() {
        let table = std::sync::Arc::new(KeyStateTable::new(64));
        let get = req("GET", "/b/k", &[]);
        let not_found = |body: &'static str| {
            Response::builder()
                .status(404)
                .body(crate::body::full(body))
                .unwrap()
        };
        let tagged = Response::builder()
            .header("etag", "\"e1\"")
            .body(crate::body::empty())
            .unwrap();
        let _ = observed(&table, table.read("/b/k", &get)).learn(tagged);
        let doc = "<?xml version=\"1.0\"?><Error><Code>NoSuchVersion</Code></Error>";
        let res = observed(&table, table.read("/b/k", &get)).learn(not_found(doc));
        // Nothing is learned before the body passed.
        let body = res.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(body, doc.as_bytes(), "relayed unchanged");
        let known = || table.part("/b/k").known("/b/k").cloned();
        assert!(matches!(known(), Some(KeyState::Tagged(_))));
        let doc = "<Error><Code>NoSuchKey</Code></Error>";
        let res = observed(&table, table.read("/b/k", &get)).learn(not_found(doc));
        assert!(matches!(known(), Some(KeyState::Tagged(_))));
        res.into_body().collect().await.unwrap();
        assert_eq!(known(), Some(KeyState::Absent));
        // Azure names it in a header, a HEAD's answer too.
        let _ = observed(&table, table.read("/b/k", &get)).learn(
            Response::builder()
                .header("etag", "\"e2\"")
                .body(crate::body::empty())
                .unwrap(),
        );
        let head = req("HEAD", "/b/k", &[]);
        let res = Response::builder()
            .status(404)
            .header("x-ms-error-code", "ContainerNotFound")
            .body(crate::body::empty())
            .unwrap();
        let _ = observed(&table, table.read("/b/k", &head)).learn(res);
        assert!(matches!(known(), Some(KeyState::Tagged(_))));
        // A client that stops reading teaches nothing.
        let res = observed(&table, table.read("/b/k", &get)).learn(not_found(doc));
        drop(res);
        assert!(matches!(known(), Some(KeyState::Tagged(_))));
        // A HEAD's 404 has no body: absent.
        let res = Response::builder()
            .status(404)
            .body(crate::body::empty())
            .unwrap();
        let _ = observed(&table, table.read("/b/k", &head)).learn(res);
        assert_eq!(known(), Some(KeyState::Absent));
        // A 404 that is no XML document names no S3 code: absent at once,
        // its body read or not.
        let _ = observed(&table, table.read("/b/k", &get)).learn(
            Response::builder()
                .header("etag", "\"e3\"")
                .body(crate::body::empty())
                .unwrap(),
        );
        let problem = Response::builder()
            .status(404)
            .header("content-type", "application/problem+json")
            .body(crate::body::full("{}"))
            .unwrap();
        drop(observed(&table, table.read("/b/k", &get)).learn(problem));
        assert_eq!(known(), Some(KeyState::Absent));
    }
}
