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

use http::header::{AUTHORIZATION, ETAG, HOST, IF_MATCH, IF_NONE_MATCH};
use http::{HeaderMap, HeaderValue, Method, Request, Response};
use smallvec::SmallVec;

pub use fencegate_core::precondition::{
    write_shape, Answer, Exchange, KeyState, KeyStates, Plan, WriteShape,
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

    /// What to do with a write to `key` (see [`KeyStates::plan_write`]).
    pub fn plan(&self, key: &str, req: &Request<crate::body::Body>) -> (Plan, Exchange) {
        let headers = req.headers();
        let shape = write_shape(req.method().as_str(), req.uri().query());
        let own = headers.contains_key(IF_MATCH) || headers.contains_key(IF_NONE_MATCH);
        let may_add = !signature_covers_preconditions(headers);
        let delete = req.method() == Method::DELETE;
        self.part(key).plan_write(key, shape, delete, own, may_add)
    }

    /// A read of `key` (`req`'s method and query say whether it reads the
    /// key's current representation).
    pub fn read<B>(&self, key: &str, req: &Request<B>) -> Exchange {
        let get_or_head = matches!(*req.method(), Method::GET | Method::HEAD);
        self.part(key).read(get_or_head, req.uri().query())
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

/// A key as the table names it: the path the storage gets (and, where the
/// storage gets the client's `Host`, that host first), kept inline up to a
/// few hundred bytes so naming it allocates nothing.
#[derive(Clone, Debug)]
pub struct Key(SmallVec<[u8; 192]>);

impl Key {
    /// The key of `req` (its URI already the one the storage gets); with
    /// `host`, the client's `Host` first. `None` if the host is not text.
    pub fn of<B>(req: &Request<B>, host: bool) -> Option<Self> {
        let mut key = SmallVec::new();
        if host {
            let host = match req.headers().get(HOST) {
                Some(h) => h.to_str().ok()?,
                None => req.uri().authority().map_or("", |a| a.as_str()),
            };
            key.extend_from_slice(host.as_bytes());
        }
        key.extend_from_slice(req.uri().path().as_bytes());
        Some(Self(key))
    }

    pub fn as_str(&self) -> &str {
        // Built from a `&str` host and a URI path, both text.
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
    /// key either way).
    pub fn learn<B>(&self, res: &Response<B>) {
        self.table
            .learn(self.key.as_str(), &self.exchange, answer(res));
    }

    /// Learns that this exchange's outcome is unknown: the storage may
    /// apply the write or not, now or later.
    pub fn learn_unknown(&self) {
        self.table
            .learn(self.key.as_str(), &self.exchange, Answer::Unknown);
    }
}

/// The storage's answer `res`, as the core reads it.
fn answer<B>(res: &Response<B>) -> Answer<'_> {
    let mut tags = res.headers().get_all(ETAG).iter();
    let etag = match (tags.next(), tags.next()) {
        (Some(tag), None) => Some(tag.as_bytes()),
        _ => None,
    };
    Answer::Storage {
        status: res.status().as_u16(),
        etag,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(method: &str, uri: &str, headers: &[(&str, &str)]) -> Request<crate::body::Body> {
        let mut b = Request::builder().method(method).uri(uri);
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        b.body(crate::body::empty()).unwrap()
    }

    #[test]
    fn keys_name_the_path_and_the_host_where_it_counts() {
        let r = req("PUT", "/b/k?x=1", &[("host", "bucket.example")]);
        assert_eq!(Key::of(&r, false).unwrap().as_str(), "/b/k");
        assert_eq!(Key::of(&r, true).unwrap().as_str(), "bucket.example/b/k");
    }

    #[test]
    fn plans_carry_out_the_core() {
        let table = std::sync::Arc::new(KeyStateTable::new(64));
        let put = req("PUT", "/b/k", &[]);
        assert_eq!(table.plan("/b/k", &put).0, Plan::Required(None));
        let get = req("GET", "/b/k", &[]);
        let read = table.read("/b/k", &get);
        let ok = Response::builder()
            .header("etag", "\"e1\"")
            .body(())
            .unwrap();
        Observed {
            table: table.clone(),
            key: Key::of(&put, false).unwrap(),
            exchange: read,
        }
        .learn(&ok);
        let (plan, _) = table.plan("/b/k", &put);
        let mut headers = HeaderMap::new();
        add(&plan, &mut headers);
        assert_eq!(headers["if-match"], "\"e1\"");
        // Shared Key signs If-Match: fencegate may not add it.
        let signed = req("PUT", "/b/k", &[("authorization", "SharedKey acct:c2ln")]);
        assert!(matches!(
            table.plan("/b/k", &signed).0,
            Plan::Required(Some(_))
        ));
        let own = req("PUT", "/b/k", &[("if-none-match", "*")]);
        assert_eq!(table.plan("/b/k", &own).0, Plan::AsSent);
        assert_eq!(table.len(), 1);
        table.take_over();
        assert!(table.is_empty());
    }
}
